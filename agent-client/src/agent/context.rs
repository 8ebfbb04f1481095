//! The context manager: what the model sees each turn, kept within a token budget.
//!
//! Three layers. **System** — instructions, the task, the tool schemas — always sent whole.
//! **Working** — recent steps verbatim (the assistant's call and the tool's result); results
//! older than the last `fold_after` steps are folded to a one-line stub that says how to fetch
//! them back (`recall(step)`). **Archive** — one running summary of the steps that left the
//! working layer. When the prompt passes `trigger` (70%) of the model's window, the middle of
//! the working layer is summarized (by the model, with a deterministic fallback) and the prompt
//! shrinks to about `target` (50%): the first steps and the recent tail stay.
//!
//! Beside the layers, a **pinned facts** channel (current subtask, verified results, key
//! variables, budget warnings, the recovery note) and the list of **failed approaches** ("tried
//! X, failed because Y") are rendered into every prompt and never summarized away.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::llm::{ChatRequest, Message, ToolCall};
use super::observe::cut_chars;
use super::tokens::{TokenCounter, MESSAGE_OVERHEAD};

/// What can go wrong managing the context.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// Even the system layer and pinned facts do not fit in the window.
    #[error("the fixed part of the prompt ({fixed} tokens) does not fit the context window of {window} tokens")]
    WindowTooSmall {
        /// Tokens of the layers that are never dropped.
        fixed: usize,
        /// The window.
        window: usize,
    },
}

/// Tuning of the context manager.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ContextConfig {
    /// The model's context window, in tokens.
    pub window: usize,
    /// Results of steps older than this many recent ones are folded to stubs.
    pub fold_after: usize,
    /// Summarize once the prompt passes this fraction of the window.
    pub trigger: f64,
    /// Summarizing aims for a prompt of about this fraction of the window.
    pub target: f64,
    /// Steps at the start kept out of summaries (they often hold the lay of the land).
    pub keep_first: usize,
    /// Recent steps a summary never swallows.
    pub min_tail: usize,
    /// Failed approaches remembered.
    pub max_failed: usize,
    /// `false` keeps the full history (no folding, no summaries): the baseline for benchmarks.
    pub managed: bool,
}

impl ContextConfig {
    /// Defaults for a window of `window` tokens.
    pub fn for_window(window: usize) -> Self {
        ContextConfig {
            window,
            fold_after: 5,
            trigger: 0.70,
            target: 0.50,
            keep_first: 1,
            min_tail: 2,
            max_failed: 10,
            managed: true,
        }
    }
}

/// One step in the working layer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepEntry {
    /// Step number, from 1.
    pub step: u64,
    /// The call as the model made it (arguments already repaired).
    pub call: ToolCall,
    /// One line describing the action.
    pub action_line: String,
    /// The full normalized observation.
    pub observation: String,
    /// The exec behind it, if any.
    pub exec_id: Option<String>,
    /// Whether it succeeded.
    pub ok: bool,
    /// The one-line stub shown once the result is folded.
    #[serde(default)]
    pub stub: String,
    /// Set once the observation was dropped from memory (it is folded for good and the
    /// daemon keeps the exec's record, which `recall` fetches).
    #[serde(default)]
    pub dropped: bool,
    tokens_full: usize,
    tokens_folded: usize,
}

impl StepEntry {
    /// The one-line stub that replaces the observation once folded.
    fn make_stub(&self) -> String {
        let lines = self.observation.lines().count();
        let first = self
            .observation
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        format!(
            "[step {} result folded: {}{}, {} line{}: \"{}\"{}. recall(step={}) shows it again]",
            self.step,
            if self.ok { "ok" } else { "FAILED" },
            self.exec_id
                .as_deref()
                .map(|e| format!(", exec {e}"))
                .unwrap_or_default(),
            lines,
            if lines == 1 { "" } else { "s" },
            cut_chars(first.trim(), 80),
            if lines > 1 { " …" } else { "" },
            self.step
        )
    }

    /// The call with bulky arguments (file contents) folded too, still valid JSON.
    fn folded_call(&self) -> ToolCall {
        let mut call = self.call.clone();
        if call.function.arguments.len() > 400 {
            if let Ok(Value::Object(mut map)) =
                serde_json::from_str::<Value>(&call.function.arguments)
            {
                for v in map.values_mut() {
                    if let Value::String(s) = v {
                        if s.len() > 200 {
                            *v = Value::String(format!(
                                "{}… [{} bytes folded]",
                                cut_chars(s, 60),
                                s.len()
                            ));
                        }
                    }
                }
                call.function.arguments = Value::Object(map).to_string();
            }
        }
        call
    }

    fn messages(&self, folded: bool) -> [Message; 2] {
        if folded {
            [
                Message::assistant_call(self.folded_call(), None),
                Message::tool(&self.call.id, &self.stub),
            ]
        } else {
            [
                Message::assistant_call(self.call.clone(), None),
                Message::tool(&self.call.id, &self.observation),
            ]
        }
    }
}

/// A summary of steps that left the working layer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    /// First step covered.
    pub from_step: u64,
    /// Last step covered.
    pub to_step: u64,
    /// The text.
    pub text: String,
    /// Whether the model wrote it (else the deterministic fallback did).
    pub by_model: bool,
}

/// Everything the context holds, serializable into a checkpoint.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ContextState {
    /// Instructions.
    pub instructions: String,
    /// The task as given.
    pub task: String,
    /// Pinned facts, by key.
    pub pinned: BTreeMap<String, String>,
    /// "tried X, failed because Y" lines, oldest first.
    pub failed: Vec<String>,
    /// Summary of the steps no longer in the working layer.
    pub archive: Option<Summary>,
    /// The first steps, kept out of summaries.
    pub first: Vec<StepEntry>,
    /// Recent steps.
    pub working: VecDeque<StepEntry>,
    /// The latest malformed call and the error sent back about it; only the latest is kept.
    pub reask: Option<(Message, Message)>,
    /// Summaries made so far.
    pub compactions: u32,
}

/// The work a compaction needs from the model.
#[derive(Clone, Debug)]
pub struct CompactionPlan {
    /// How many working steps (from the front) the summary replaces.
    pub steps: usize,
    /// First step covered (including the previous summary's).
    pub from_step: u64,
    /// Last step covered.
    pub to_step: u64,
    /// The request asking the model for the summary.
    pub request: ChatRequest,
    /// What to use if the model cannot answer.
    pub fallback: String,
}

/// Builds each turn's prompt and keeps it within budget.
#[derive(Clone, Debug)]
pub struct ContextManager {
    cfg: ContextConfig,
    counter: TokenCounter,
    tools: Vec<Value>,
    tools_tokens: usize,
    state: ContextState,
}

const SUMMARY_SYSTEM: &str = "You compress the history of a coding agent working in a sandbox. \
Write a concise summary that lets the agent continue without the original messages: what was \
done, what was found (paths, values, commands that work), what failed and why, and what remains. \
Refer to steps by number (\"step 12\") and keep exec ids, so details can be fetched back. \
Plain text, no preamble.";

impl ContextManager {
    /// A fresh context for `task`.
    pub fn new(
        cfg: ContextConfig,
        counter: TokenCounter,
        instructions: &str,
        task: &str,
        tools: Vec<Value>,
    ) -> Self {
        let state = ContextState {
            instructions: instructions.to_owned(),
            task: task.to_owned(),
            ..Default::default()
        };
        Self::restore(cfg, counter, tools, state)
    }

    /// A context rebuilt from a checkpoint.
    pub fn restore(
        cfg: ContextConfig,
        counter: TokenCounter,
        tools: Vec<Value>,
        state: ContextState,
    ) -> Self {
        let tools_tokens = counter.count(&Value::Array(tools.clone()).to_string());
        ContextManager {
            cfg,
            counter,
            tools,
            tools_tokens,
            state,
        }
    }

    /// The serializable state, for checkpoints.
    pub fn state(&self) -> &ContextState {
        &self.state
    }

    /// The configuration.
    pub fn config(&self) -> &ContextConfig {
        &self.cfg
    }

    /// The token counter in use.
    pub fn counter(&self) -> &TokenCounter {
        &self.counter
    }

    /// Pins a fact (replacing one with the same key).
    pub fn pin(&mut self, key: &str, value: &str) {
        self.state.pinned.insert(key.to_owned(), value.to_owned());
    }

    /// Removes a pinned fact.
    pub fn unpin(&mut self, key: &str) {
        self.state.pinned.remove(key);
    }

    /// The pinned facts.
    pub fn pinned(&self) -> &BTreeMap<String, String> {
        &self.state.pinned
    }

    /// Remembers a failed approach; `action_key` identifies the action so a later success of
    /// the same action clears it.
    pub fn record_failure(&mut self, step: u64, action_line: &str, because: &str) {
        let line = format!(
            "tried {} (step {step}), failed because: {}",
            action_line,
            cut_chars(because, 160)
        );
        let prefix = format!("tried {action_line} (");
        self.state.failed.retain(|l| !l.starts_with(&prefix));
        self.state.failed.push(line);
        let excess = self.state.failed.len().saturating_sub(self.cfg.max_failed);
        self.state.failed.drain(..excess);
    }

    /// Forgets failures of an action that has now worked.
    pub fn record_success(&mut self, action_line: &str) {
        let prefix = format!("tried {action_line} (");
        self.state.failed.retain(|l| !l.starts_with(&prefix));
    }

    /// The failed approaches.
    pub fn failed(&self) -> &[String] {
        &self.state.failed
    }

    /// Adds a finished step to the working layer and clears any pending re-ask.
    pub fn push_step(
        &mut self,
        step: u64,
        call: ToolCall,
        action_line: String,
        observation: String,
        exec_id: Option<String>,
        ok: bool,
    ) {
        let mut entry = StepEntry {
            step,
            call,
            action_line,
            observation,
            exec_id,
            ok,
            stub: String::new(),
            dropped: false,
            tokens_full: 0,
            tokens_folded: 0,
        };
        entry.stub = entry.make_stub();
        entry.tokens_full = self.count_messages(&entry.messages(false));
        entry.tokens_folded = self.count_messages(&entry.messages(true));
        self.state.reask = None;
        if self.state.first.len() < self.cfg.keep_first && self.state.archive.is_none() {
            self.state.first.push(entry);
        } else {
            self.state.working.push_back(entry);
        }
        self.drop_folded_observations();
    }

    /// Folded results whose exec the daemon keeps need not be held here too: dropping them
    /// keeps memory and checkpoints small however long the run (`recall` fetches them back).
    fn drop_folded_observations(&mut self) {
        if !self.cfg.managed {
            return;
        }
        let newest = self.state.working.back().map_or(0, |e| e.step);
        let horizon = self.cfg.fold_after as u64;
        for e in self
            .state
            .first
            .iter_mut()
            .chain(self.state.working.iter_mut())
        {
            if !e.dropped && e.exec_id.is_some() && newest.saturating_sub(e.step) >= horizon {
                e.observation = String::new();
                e.dropped = true;
            }
        }
    }

    /// Keeps a malformed call and the error about it, replacing the previous pair, so repeated
    /// re-asks do not pile up in the history.
    pub fn set_reask(&mut self, assistant: Message, error: Message) {
        self.state.reask = Some((assistant, error));
    }

    /// Drops the re-ask pair.
    pub fn clear_reask(&mut self) {
        self.state.reask = None;
    }

    /// A step whose full observation is still held (first or working layer, not dropped).
    pub fn find_step(&self, step: u64) -> Option<&StepEntry> {
        self.state
            .first
            .iter()
            .chain(self.state.working.iter())
            .find(|e| e.step == step && !e.dropped)
    }

    fn count_messages(&self, messages: &[Message]) -> usize {
        messages
            .iter()
            .map(|m| MESSAGE_OVERHEAD + self.counter.count(&m.countable_text()))
            .sum()
    }

    /// Whether the step at `index` of the working layer (or first layer) is shown folded.
    fn folded(&self, step: u64) -> bool {
        if !self.cfg.managed {
            return false;
        }
        let newest = self
            .state
            .working
            .back()
            .or(self.state.first.last())
            .map_or(0, |e| e.step);
        newest.saturating_sub(step) >= self.cfg.fold_after as u64
    }

    fn memory_message(&self) -> Option<Message> {
        if self.state.pinned.is_empty() && self.state.failed.is_empty() {
            return None;
        }
        let mut text = String::from(
            "[agent memory: pinned facts and failed approaches, kept across summaries]\n",
        );
        for (k, v) in &self.state.pinned {
            text.push_str(&format!("- {k}: {v}\n"));
        }
        if !self.state.failed.is_empty() {
            text.push_str("Failed approaches (do not repeat them unchanged):\n");
            for line in &self.state.failed {
                text.push_str(&format!("- {line}\n"));
            }
        }
        Some(Message::user(text))
    }

    fn summary_message(&self) -> Option<Message> {
        self.state.archive.as_ref().map(|s| {
            Message::user(format!(
                "[summary of steps {}-{}; recall(step=N) fetches any step's full result]\n{}",
                s.from_step, s.to_step, s.text
            ))
        })
    }

    /// The messages of the next prompt.
    pub fn render(&self) -> Vec<Message> {
        let mut messages = vec![
            Message::system(&self.state.instructions),
            Message::user(format!("Task:\n{}", self.state.task)),
        ];
        for e in &self.state.first {
            messages.extend(e.messages(self.folded(e.step)));
        }
        messages.extend(self.summary_message());
        for e in &self.state.working {
            messages.extend(e.messages(self.folded(e.step)));
        }
        if let Some((assistant, error)) = &self.state.reask {
            messages.push(assistant.clone());
            messages.push(error.clone());
        }
        messages.extend(self.memory_message());
        messages
    }

    /// The tool schemas sent with every prompt.
    pub fn tools(&self) -> &[Value] {
        &self.tools
    }

    /// Tokens of the next prompt (messages and tool schemas), from cached per-step counts.
    pub fn prompt_tokens(&self) -> usize {
        let fixed = self.fixed_tokens();
        let steps: usize = self
            .state
            .first
            .iter()
            .chain(self.state.working.iter())
            .map(|e| {
                if self.folded(e.step) {
                    e.tokens_folded
                } else {
                    e.tokens_full
                }
            })
            .sum();
        let summary = self
            .summary_message()
            .map_or(0, |m| self.count_messages(&[m]));
        let reask = self
            .state
            .reask
            .as_ref()
            .map_or(0, |(a, e)| self.count_messages(&[a.clone(), e.clone()]));
        fixed + steps + summary + reask
    }

    /// Tokens of what is never dropped: system layer, tools, pinned facts, failures.
    fn fixed_tokens(&self) -> usize {
        let mut fixed = self.count_messages(&[
            Message::system(&self.state.instructions),
            Message::user(format!("Task:\n{}", self.state.task)),
        ]) + self.tools_tokens;
        if let Some(m) = self.memory_message() {
            fixed += self.count_messages(&[m]);
        }
        fixed
    }

    /// Checks that the fixed layers fit at all.
    pub fn check_fits(&self) -> Result<(), ContextError> {
        let fixed = self.fixed_tokens();
        if fixed * 10 > self.cfg.window * 9 {
            return Err(ContextError::WindowTooSmall {
                fixed,
                window: self.cfg.window,
            });
        }
        Ok(())
    }

    /// Whether the prompt has passed the summarization trigger.
    pub fn needs_compaction(&self) -> bool {
        self.cfg.managed
            && self.prompt_tokens() as f64 > self.cfg.trigger * self.cfg.window as f64
            && self.state.working.len() > self.cfg.min_tail
    }

    /// Plans a compaction: which working steps to summarize so the prompt lands near the
    /// target, and the request to the model. `force` plans one even below the trigger (the
    /// endpoint said the prompt is too long).
    pub fn plan_compaction(&self, force: bool) -> Option<CompactionPlan> {
        if !self.cfg.managed || (!force && !self.needs_compaction()) {
            return None;
        }
        let n = self.state.working.len();
        if n <= self.cfg.min_tail {
            return None;
        }
        let target = (self.cfg.target * self.cfg.window as f64) as usize;
        // Leave room for the summary itself.
        let summary_budget = self.summary_max_tokens();
        let first: usize = self
            .state
            .first
            .iter()
            .map(|e| {
                if self.folded(e.step) {
                    e.tokens_folded
                } else {
                    e.tokens_full
                }
            })
            .sum();
        let fixed = self.fixed_tokens() + summary_budget + first;
        // Grow the tail from the newest step back while it fits in the target, at least
        // `min_tail` steps.
        let mut tail = 0;
        let mut used = fixed;
        // Beyond `fold_after` the tail is folded and cheap, so it goes back as far as the
        // target allows: the summary replaces only what must go.
        for e in self.state.working.iter().rev() {
            let cost = if tail < self.cfg.fold_after {
                e.tokens_full
            } else {
                e.tokens_folded
            };
            if tail >= self.cfg.min_tail && used + cost > target {
                break;
            }
            used += cost;
            tail += 1;
        }
        let steps = n - tail.max(self.cfg.min_tail).min(n);
        if steps == 0 {
            return None;
        }
        let covered: Vec<&StepEntry> = self.state.working.iter().take(steps).collect();
        let from_step = self
            .state
            .archive
            .as_ref()
            .map_or(covered[0].step, |s| s.from_step);
        let to_step = covered[covered.len() - 1].step;

        // The input: the previous summary, then each step in brief. Bounded so that the
        // summarization call itself fits comfortably in the window.
        let input_budget = (self.cfg.window as f64 * 0.4) as usize;
        let per_step_chars = (input_budget * 4 / covered.len().max(1)).clamp(120, 1_500);
        let mut input = String::new();
        if let Some(s) = &self.state.archive {
            input.push_str(&format!(
                "Summary so far (steps {}-{}):\n{}\n\n",
                s.from_step, s.to_step, s.text
            ));
        }
        input.push_str("Steps to add:\n");
        for e in &covered {
            input.push_str(&format!(
                "step {}{}: {} -> {}\n",
                e.step,
                e.exec_id
                    .as_deref()
                    .map(|x| format!(" (exec {x})"))
                    .unwrap_or_default(),
                e.action_line,
                if e.dropped {
                    e.stub.clone()
                } else {
                    cut_chars(&e.observation.replace('\n', " | "), per_step_chars)
                }
            ));
        }
        let request = ChatRequest {
            messages: vec![
                Message::system(SUMMARY_SYSTEM),
                Message::user(format!(
                    "Task of the agent:\n{}\n\n{}",
                    cut_chars(&self.state.task, 2_000),
                    input
                )),
            ],
            tools: Vec::new(),
            max_tokens: Some(summary_budget as u32),
        };
        Some(CompactionPlan {
            steps,
            from_step,
            to_step,
            request,
            fallback: self.fallback_summary(&covered),
        })
    }

    /// Tokens a summary may take: a tenth of the window, at most 2,000.
    pub fn summary_max_tokens(&self) -> usize {
        (self.cfg.window / 10).clamp(64, 2_000)
    }

    /// A summary made without the model: the previous summary and one line per step, bounded.
    fn fallback_summary(&self, covered: &[&StepEntry]) -> String {
        let mut lines = Vec::new();
        if let Some(s) = &self.state.archive {
            lines.push(cut_chars(&s.text, 2_000));
        }
        let keep = 40;
        let skipped = covered.len().saturating_sub(keep);
        if skipped > 0 {
            let failed = covered[..skipped].iter().filter(|e| !e.ok).count();
            lines.push(format!(
                "steps {}-{}: {} actions ({} failed), details via recall(step)",
                covered[0].step,
                covered[skipped - 1].step,
                skipped,
                failed
            ));
        }
        for e in &covered[skipped..] {
            lines.push(format!(
                "step {}: {} -> {}{}",
                e.step,
                e.action_line,
                if e.ok { "ok" } else { "FAILED" },
                e.exec_id
                    .as_deref()
                    .map(|x| format!(" (exec {x})"))
                    .unwrap_or_default()
            ));
        }
        lines.join("\n")
    }

    /// Applies a compaction: the planned steps leave the working layer for the archive.
    pub fn apply_compaction(&mut self, plan: &CompactionPlan, summary: Option<String>) {
        let by_model = summary.as_ref().is_some_and(|s| !s.trim().is_empty());
        let mut text = summary
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| plan.fallback.clone());
        // A summary longer than its budget defeats its purpose.
        let max_chars = self.summary_max_tokens() * 4;
        if text.chars().count() > max_chars {
            text = cut_chars(&text, max_chars);
        }
        for _ in 0..plan.steps.min(self.state.working.len()) {
            self.state.working.pop_front();
        }
        self.state.archive = Some(Summary {
            from_step: plan.from_step,
            to_step: plan.to_step,
            text,
            by_model,
        });
        self.state.compactions += 1;
    }

    /// A short deterministic account of the run so far: pinned facts and the latest steps.
    /// Used for the recovery note and the salvage summary, which must not depend on the model.
    pub fn brief(&self, last: usize) -> String {
        let mut parts = Vec::new();
        if let Some(s) = &self.state.archive {
            parts.push(format!(
                "summary of steps {}-{}: {}",
                s.from_step,
                s.to_step,
                cut_chars(&s.text.replace('\n', " "), 400)
            ));
        }
        let all: Vec<&StepEntry> = self
            .state
            .first
            .iter()
            .chain(self.state.working.iter())
            .collect();
        for e in all.iter().skip(all.len().saturating_sub(last)) {
            parts.push(format!(
                "step {}: {} -> {}",
                e.step,
                e.action_line,
                if e.ok { "ok" } else { "failed" }
            ));
        }
        for (k, v) in &self.state.pinned {
            if !k.starts_with("recovery") {
                parts.push(format!("{k}: {}", cut_chars(v, 200)));
            }
        }
        parts.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::llm::FunctionCall;

    fn call(step: u64, args: &str) -> ToolCall {
        ToolCall {
            id: format!("c{step}"),
            kind: "function".into(),
            function: FunctionCall {
                name: "bash".into(),
                arguments: args.into(),
            },
        }
    }

    fn manager(window: usize) -> ContextManager {
        ContextManager::new(
            ContextConfig::for_window(window),
            TokenCounter::for_model("gpt-4o"),
            "You are an agent.",
            "Do the thing.",
            crate::agent::tools::specs()
                .iter()
                .map(|s| s.to_wire())
                .collect(),
        )
    }

    fn push(m: &mut ContextManager, step: u64, output: &str) {
        m.push_step(
            step,
            call(step, &format!(r#"{{"command":"echo {step}"}}"#)),
            format!("bash `echo {step}`"),
            output.to_owned(),
            Some(format!("ex-{step}")),
            true,
        );
    }

    #[test]
    fn old_results_are_folded_to_stubs() {
        let mut m = manager(100_000);
        for step in 1..=8 {
            push(&mut m, step, &format!("output of step {step}\n").repeat(50));
        }
        let msgs = m.render();
        let tool_texts: Vec<&str> = msgs
            .iter()
            .filter(|m| m.role == "tool")
            .filter_map(|m| m.content.as_deref())
            .collect();
        assert_eq!(tool_texts.len(), 8);
        // Steps 1..=3 are more than 5 steps old by step 8.
        assert!(
            tool_texts[0].starts_with("[step 1 result folded"),
            "{}",
            tool_texts[0]
        );
        assert!(tool_texts[0].contains("recall(step=1)"));
        assert!(tool_texts[2].starts_with("[step 3 result folded"));
        assert!(tool_texts[3].starts_with("output of step 4"));
        // Every tool message follows the assistant message that called it.
        for (i, msg) in msgs.iter().enumerate() {
            if msg.role == "tool" {
                assert_eq!(msgs[i - 1].role, "assistant");
                assert_eq!(
                    msgs[i - 1].tool_calls[0].id,
                    msg.tool_call_id.clone().unwrap_or_default()
                );
            }
        }
    }

    #[test]
    fn prompt_tokens_match_a_recount() {
        let mut m = manager(100_000);
        for step in 1..=7 {
            push(&mut m, step, "some output\n");
        }
        m.pin("subtask", "write tests");
        let counter = TokenCounter::for_model("gpt-4o");
        let recount: usize = m
            .render()
            .iter()
            .map(|msg| MESSAGE_OVERHEAD + counter.count(&msg.countable_text()))
            .sum::<usize>()
            + counter.count(&Value::Array(m.tools().to_vec()).to_string());
        assert_eq!(m.prompt_tokens(), recount);
    }

    #[test]
    fn compaction_keeps_first_and_tail_and_lands_near_target() {
        let mut m = manager(8_000);
        let mut step = 0;
        while !m.needs_compaction() {
            step += 1;
            push(
                &mut m,
                step,
                &format!("result line for {step}\n").repeat(40),
            );
            assert!(step < 500, "never triggered");
        }
        let before = m.prompt_tokens();
        let plan = m.plan_compaction(false).expect("a plan");
        assert!(plan.steps > 0);
        assert_eq!(plan.from_step, 2, "step 1 is kept first");
        assert!(plan.request.tools.is_empty());
        m.apply_compaction(&plan, Some("did steps 2..n, all fine (exec ex-2..)".into()));
        let after = m.prompt_tokens();
        assert!(after < before, "{after} >= {before}");
        assert!(after as f64 <= 0.55 * 8_000.0, "after {after}");
        assert_eq!(m.state().first.len(), 1);
        assert!(m.state().working.len() >= 2);
        let text: String = m
            .render()
            .iter()
            .filter_map(|m| m.content.clone())
            .collect();
        assert!(text.contains("[summary of steps 2-"), "{text}");
    }

    #[test]
    fn fallback_summary_keeps_step_refs() {
        let mut m = manager(4_000);
        for step in 1..=30 {
            push(&mut m, step, &"x".repeat(400));
        }
        let plan = m.plan_compaction(true).expect("a plan");
        m.apply_compaction(&plan, None);
        let s = m.state().archive.clone().unwrap_or_default();
        assert!(!s.by_model);
        assert!(s.text.contains("step 2"), "{}", s.text);
        assert!(s.text.contains("exec ex-"), "{}", s.text);
    }

    #[test]
    fn pinned_facts_and_failures_survive_compaction() {
        let mut m = manager(4_000);
        m.pin("verified", "make build passed at step 3");
        m.record_failure(2, "bash `make`", "exit 2: missing header");
        for step in 1..=30 {
            push(&mut m, step, &"y".repeat(300));
        }
        let plan = m.plan_compaction(true).expect("a plan");
        m.apply_compaction(&plan, Some("summary".into()));
        let last = m.render().pop().and_then(|m| m.content).unwrap_or_default();
        assert!(last.contains("verified: make build passed"), "{last}");
        assert!(
            last.contains("tried bash `make` (step 2), failed because: exit 2"),
            "{last}"
        );
        m.record_success("bash `make`");
        assert!(m.failed().is_empty());
    }

    #[test]
    fn only_the_latest_reask_is_kept() {
        let mut m = manager(10_000);
        push(&mut m, 1, "ok");
        for i in 0..3 {
            m.set_reask(
                Message::assistant_call(call(9, "{bad"), None),
                Message::tool("c9", format!("error {i}")),
            );
        }
        let msgs = m.render();
        let errors: Vec<_> = msgs
            .iter()
            .filter(|m| m.content.as_deref().is_some_and(|c| c.starts_with("error")))
            .collect();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].content.as_deref(), Some("error 2"));
        push(&mut m, 2, "ok");
        assert!(m.state().reask.is_none());
    }

    #[test]
    fn unmanaged_context_keeps_everything() {
        let mut cfg = ContextConfig::for_window(1_000);
        cfg.managed = false;
        let mut m = ContextManager::new(cfg, TokenCounter::estimate(), "i", "t", vec![]);
        for step in 1..=50 {
            push(&mut m, step, "z");
        }
        assert!(m.plan_compaction(true).is_none());
        assert!(!m
            .render()
            .iter()
            .any(|m| m.content.as_deref().is_some_and(|c| c.contains("folded"))));
    }
}
