//! Token counting: the model family's real BPE when it is known, an estimate otherwise.

use std::fmt;
use tiktoken_rs::CoreBPE;

/// Tokens a chat message costs beyond its text (role, separators), as OpenAI documents it.
pub const MESSAGE_OVERHEAD: usize = 4;

/// Counts tokens of text for one model.
#[derive(Clone)]
pub struct TokenCounter {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Bpe {
        name: &'static str,
        bpe: &'static CoreBPE,
    },
    Estimate,
}

impl fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TokenCounter {
    /// The counter for `model`: `o200k_base` for gpt-4o/4.1/5 and o-series models,
    /// `cl100k_base` for gpt-4/3.5, and an estimate for every other family (Llama, Qwen,
    /// Mistral, …), whose tokenizers are not bundled.
    pub fn for_model(model: &str) -> Self {
        let tokenizer = tiktoken_rs::tokenizer::get_tokenizer(model);
        let bpe = tokenizer.and_then(|t| {
            let name = match t {
                tiktoken_rs::tokenizer::Tokenizer::O200kBase => "o200k_base",
                tiktoken_rs::tokenizer::Tokenizer::Cl100kBase => "cl100k_base",
                tiktoken_rs::tokenizer::Tokenizer::O200kHarmony => "o200k_harmony",
                tiktoken_rs::tokenizer::Tokenizer::P50kBase => "p50k_base",
                tiktoken_rs::tokenizer::Tokenizer::P50kEdit => "p50k_edit",
                tiktoken_rs::tokenizer::Tokenizer::R50kBase => "r50k_base",
                tiktoken_rs::tokenizer::Tokenizer::Gpt2 => "gpt2",
            };
            tiktoken_rs::bpe_for_tokenizer(t)
                .ok()
                .map(|bpe| (name, bpe))
        });
        match bpe {
            Some((name, bpe)) => TokenCounter {
                kind: Kind::Bpe { name, bpe },
            },
            None => Self::estimate(),
        }
    }

    /// The estimating counter (about four characters of English or code per token).
    pub fn estimate() -> Self {
        TokenCounter {
            kind: Kind::Estimate,
        }
    }

    /// `o200k_base`, `cl100k_base`, … or `estimate`.
    pub fn name(&self) -> &'static str {
        match &self.kind {
            Kind::Bpe { name, .. } => name,
            Kind::Estimate => "estimate",
        }
    }

    /// Whether counts come from the model's own tokenizer.
    pub fn is_exact(&self) -> bool {
        matches!(self.kind, Kind::Bpe { .. })
    }

    /// Tokens in `text`.
    pub fn count(&self, text: &str) -> usize {
        match &self.kind {
            Kind::Bpe { bpe, .. } => bpe.count_ordinary(text),
            Kind::Estimate => estimate(text),
        }
    }
}

/// A tokenizer-free estimate. BPE vocabularies give about 4 characters per token for English
/// and code, but close to one token per character for CJK and other non-Latin scripts, and
/// whitespace runs are cheap; erring high keeps the budget checks on the safe side.
pub fn estimate(text: &str) -> usize {
    let mut ascii = 0usize;
    let mut other = 0usize;
    for c in text.chars() {
        if c.is_ascii() {
            ascii += 1;
        } else {
            other += 1;
        }
    }
    ascii.div_ceil(4) + other
}

/// Default context window, in tokens, for `model`: the model's own where it is known, else
/// 32k (a conservative size most current open models exceed).
pub fn default_window(model: &str) -> usize {
    tiktoken_rs::model::get_context_size(model).unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_families_get_a_real_tokenizer() {
        let c = TokenCounter::for_model("gpt-4o-mini");
        assert_eq!(c.name(), "o200k_base");
        assert!(c.is_exact());
        assert_eq!(c.count("hello world"), 2);
        assert_eq!(TokenCounter::for_model("gpt-4").name(), "cl100k_base");
    }

    #[test]
    fn unknown_families_are_estimated() {
        let c = TokenCounter::for_model("llama-3.1-70b");
        assert!(!c.is_exact());
        assert_eq!(c.count("abcdefgh"), 2);
        assert_eq!(estimate("日本語"), 3);
        assert_eq!(estimate(""), 0);
    }

    #[test]
    fn estimate_is_within_reason_of_the_bpe() {
        let text =
            "fn main() { println!(\"hello\"); }\nThe quick brown fox jumps over the lazy dog.\n"
                .repeat(20);
        let exact = TokenCounter::for_model("gpt-4o").count(&text) as f64;
        let est = estimate(&text) as f64;
        assert!(est / exact > 0.6 && est / exact < 1.8, "{est} vs {exact}");
    }

    #[test]
    fn windows() {
        assert!(default_window("gpt-4o") >= 128_000);
        assert_eq!(default_window("my-local-model"), 32_768);
    }
}
