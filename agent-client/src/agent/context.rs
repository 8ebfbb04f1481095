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
//!
//! An operator's **steer** (`sbx agent steer`) is pinned last in every prompt until the model
//! acknowledges it, which is: answering a prompt that carried it with a usable tool call. It
//! then moves into the history just before that step's call, as the message the step answered,
//! and from there is folded, summarized and archived like the rest of the step.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::llm::{ChatRequest, Message, ToolCall};
use super::observe::{cut_chars, head_tail, ObserveLimits};
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
    /// What the model wrote alongside the call (its reasoning, its plan); shown with the call,
    /// cut short once the step is folded.
    #[serde(default)]
    pub reasoning: String,
    /// The observation was cut to make the prompt fit the window (the whole is in the exec
    /// record or the file it came from).
    #[serde(default)]
    pub shrunk: bool,
    /// Shown folded whatever its age: the context manager folded harder to fit the window.
    #[serde(default)]
    pub force_folded: bool,
    /// Operator messages the model had seen when it took this step (acknowledged steers),
    /// shown just before its call.
    #[serde(default)]
    pub operator: Vec<String>,
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

    /// The call with bulky arguments (file contents) folded too, still valid JSON. A
    /// `write_file` keeps its path and, for the content, a prefix, the size and a digest:
    /// whatever its length, the content itself is in the file, not in the history. Folding a
    /// folded call changes nothing.
    fn folded_call(&self) -> ToolCall {
        let mut call = self.call.clone();
        if call.function.name == "write_file" {
            if let Ok(Value::Object(mut map)) =
                serde_json::from_str::<Value>(&call.function.arguments)
            {
                if let Some(Value::String(content)) = map.get_mut("content") {
                    if content.chars().count() > FOLDED_CONTENT_CHARS {
                        *content = fold_content(content);
                        call.function.arguments = Value::Object(map).to_string();
                    }
                }
            }
        }
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

    fn messages(&self, folded: bool) -> Vec<Message> {
        let reasoning = self.reasoning.trim();
        let mut messages = Vec::with_capacity(3);
        if !self.operator.is_empty() {
            let lines: Vec<String> = if folded {
                self.operator
                    .iter()
                    .map(|m| cut_chars(&m.replace('\n', " "), FOLDED_OPERATOR_CHARS))
                    .collect()
            } else {
                self.operator.clone()
            };
            messages.push(Message::user(lines.join("\n")));
        }
        if folded {
            let brief = (!reasoning.is_empty())
                .then(|| cut_chars(&reasoning.replace('\n', " "), FOLDED_REASONING_CHARS));
            messages.push(Message::assistant_call(self.folded_call(), brief));
            messages.push(Message::tool(&self.call.id, &self.stub));
        } else {
            messages.push(Message::assistant_call(
                self.call.clone(),
                Some(reasoning.to_owned()),
            ));
            messages.push(Message::tool(&self.call.id, &self.observation));
        }
        messages
    }
}

/// Tokens of `messages` in a prompt.
fn count_messages(counter: &TokenCounter, messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| MESSAGE_OVERHEAD + counter.count(&m.countable_text()))
        .sum()
}

/// Longest `write_file` content a folded step still shows whole; a longer one is replaced by
/// [`fold_content`], which is shorter than this (so folding twice changes nothing).
const FOLDED_CONTENT_CHARS: usize = 120;
/// Characters of a folded `write_file` content's prefix still shown.
const FOLDED_CONTENT_PREFIX_CHARS: usize = 48;

/// What a folded `write_file` keeps of the content: a prefix, the size and a short digest
/// (enough to tell two writes apart; the content is in the file).
fn fold_content(content: &str) -> String {
    use sha2::{Digest as _, Sha256};
    let sum = Sha256::digest(content.as_bytes());
    let short: String = sum.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}… [{} bytes folded, sha256 {short}]",
        content
            .chars()
            .take(FOLDED_CONTENT_PREFIX_CHARS)
            .collect::<String>(),
        content.len()
    )
}

/// Characters of a folded step's reasoning still shown.
const FOLDED_REASONING_CHARS: usize = 160;
/// Characters of each operator message of a folded step still shown.
const FOLDED_OPERATOR_CHARS: usize = 200;
/// Characters an operator's steer keeps at least, however full the window.
const MIN_STEER_CHARS: usize = 200;

/// An operator's correction (`sbx agent steer`), pinned in every prompt until acknowledged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Steer {
    /// The request id.
    pub id: String,
    /// The message (cut to what the window allows).
    pub text: String,
    /// Steps done when it arrived.
    pub at_step: u64,
    /// The step the model took after seeing it; set until that step is recorded, when the
    /// steer moves into the step's history.
    #[serde(default)]
    pub acked_step: Option<u64>,
}

impl Steer {
    /// How the history shows it, before the call of the step that answered it.
    fn history_line(&self) -> String {
        format!(
            "[operator message {} (sent after step {}), answered by the next call]\n{}",
            self.id, self.at_step, self.text
        )
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
    /// Fraction of the configured window actually usable: lowered each time the endpoint
    /// says a prompt was too long (its tokenizer counts more than ours). `None` is 1.
    #[serde(default)]
    pub window_scale: Option<f64>,
    /// Model turns so far (summaries not counted), for compaction hysteresis.
    #[serde(default)]
    pub turn: u64,
    /// The turn of the latest summary by the model.
    #[serde(default)]
    pub last_summary_turn: Option<u64>,
    /// Operator steers not yet in the history: pinned last in every prompt.
    #[serde(default)]
    pub steers: Vec<Steer>,
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
Write a concise summary that lets the agent continue without the original messages, in two \
parts. \"Done:\" what was done and found (paths, values, commands that work), what failed and \
why. \"Left to do:\" what remains of the task and the agent's plan for it. Refer to steps by \
number (\"step 12\") and keep exec ids, so details can be fetched back. Plain text, no preamble.";

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

    /// Tokens pinned facts may still take: all of them together get at most an eighth of the
    /// window, so they can never push the prompt past it (the loop's own notes included).
    pub fn pin_room(&self) -> usize {
        let used: usize = self
            .state
            .pinned
            .iter()
            .map(|(k, v)| self.counter.count(k) + self.counter.count(v))
            .sum();
        (self.window() / 8).saturating_sub(used)
    }

    /// Pins an operator's steer until the model acknowledges it. The steers together get at
    /// most an eighth of the window (as pinned facts do), so a long one is cut, never below
    /// [`MIN_STEER_CHARS`]; returns whether it was.
    pub fn steer(&mut self, id: &str, text: &str, at_step: u64) -> bool {
        let used: usize = self
            .state
            .steers
            .iter()
            .map(|s| self.counter.count(&s.text))
            .sum();
        let room_chars = ((self.window() / 8).saturating_sub(used) * 3).max(MIN_STEER_CHARS);
        let text = text.trim();
        let cut = text.chars().count() > room_chars;
        self.state.steers.push(Steer {
            id: id.to_owned(),
            text: if cut {
                cut_chars(text, room_chars)
            } else {
                text.to_owned()
            },
            at_step,
            acked_step: None,
        });
        cut
    }

    /// The model answered a prompt carrying the pinned steers with a usable call for `step`:
    /// they are acknowledged, and move into that step's history once it is recorded. Returns
    /// the ids acknowledged now.
    pub fn acknowledge_steers(&mut self, step: u64) -> Vec<String> {
        self.state
            .steers
            .iter_mut()
            .filter(|s| s.acked_step.is_none())
            .map(|s| {
                s.acked_step = Some(step);
                s.id.clone()
            })
            .collect()
    }

    /// Steers not yet in the history.
    pub fn steers(&self) -> &[Steer] {
        &self.state.steers
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
        self.push_reasoned_step(
            step,
            call,
            String::new(),
            action_line,
            observation,
            exec_id,
            ok,
        );
    }

    /// [`ContextManager::push_step`] with the text the model wrote alongside the call.
    #[allow(clippy::too_many_arguments)]
    pub fn push_reasoned_step(
        &mut self,
        step: u64,
        call: ToolCall,
        reasoning: String,
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
            reasoning,
            shrunk: false,
            force_folded: false,
            operator: Vec::new(),
            tokens_full: 0,
            tokens_folded: 0,
        };
        // The steers the model had seen when it made this call go into the history with it.
        let (answered, pinned): (Vec<Steer>, Vec<Steer>) = std::mem::take(&mut self.state.steers)
            .into_iter()
            .partition(|s| s.acked_step.is_some_and(|at| at <= step));
        self.state.steers = pinned;
        entry.operator = answered.iter().map(Steer::history_line).collect();
        self.recount(&mut entry);
        self.state.reask = None;
        if self.state.first.len() < self.cfg.keep_first && self.state.archive.is_none() {
            self.state.first.push(entry);
        } else {
            self.state.working.push_back(entry);
        }
        self.drop_folded_observations();
    }

    fn recount(&self, entry: &mut StepEntry) {
        entry.stub = entry.make_stub();
        entry.tokens_full = self.count_messages(&entry.messages(false));
        entry.tokens_folded = self.count_messages(&entry.messages(true));
    }

    /// Folded results whose exec the daemon keeps need not be held here too: dropping them
    /// keeps memory and checkpoints small however long the run (`recall` fetches them back).
    /// Likewise a folded `write_file` keeps only what its folded call shows (path, size, a
    /// prefix and a digest of the content), not the content it wrote.
    fn drop_folded_observations(&mut self) {
        if !self.cfg.managed {
            return;
        }
        let newest = self.state.working.back().map_or(0, |e| e.step);
        let horizon = self.cfg.fold_after as u64;
        let counter = &self.counter;
        for e in self
            .state
            .first
            .iter_mut()
            .chain(self.state.working.iter_mut())
        {
            if e.call.function.name == "write_file" && newest.saturating_sub(e.step) >= horizon {
                let folded = e.folded_call();
                if folded.function.arguments != e.call.function.arguments {
                    e.call = folded;
                    e.tokens_full = count_messages(counter, &e.messages(false));
                }
            }
            if !e.dropped && e.exec_id.is_some() && newest.saturating_sub(e.step) >= horizon {
                // A bounded digest stays for the summary that will absorb this step.
                e.observation = digest(&e.observation);
                e.reasoning = cut_chars(&e.reasoning, DIGEST_CHARS);
                e.dropped = true;
            }
        }
    }

    /// Keeps a malformed call and the error about it, replacing the previous pair, so repeated
    /// re-asks do not pile up in the history.
    pub fn set_reask(&mut self, assistant: Message, error: Message) {
        self.state.reask = Some((assistant, error));
    }

    /// A step whose full observation is still held (first or working layer, not dropped).
    pub fn find_step(&self, step: u64) -> Option<&StepEntry> {
        self.state
            .first
            .iter()
            .chain(self.state.working.iter())
            .find(|e| e.step == step && !e.dropped && !e.shrunk)
    }

    fn count_messages(&self, messages: &[Message]) -> usize {
        count_messages(&self.counter, messages)
    }

    /// Whether a step is shown folded: by age, or because the manager folded harder.
    fn is_folded(&self, e: &StepEntry) -> bool {
        self.cfg.managed && (e.force_folded || self.folded(e.step))
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

    /// The pinned steers, last in the prompt so they are the freshest instruction.
    fn steer_message(&self) -> Option<Message> {
        if self.state.steers.is_empty() {
            return None;
        }
        let mut text = String::from(
            "[operator: a human supervising this run sends this correction; it takes precedence over your plan. Act on it in your next tool call.]\n",
        );
        for s in &self.state.steers {
            text.push_str(&format!("- ({}) {}\n", s.id, s.text));
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
            messages.extend(e.messages(self.is_folded(e)));
        }
        messages.extend(self.summary_message());
        for e in &self.state.working {
            messages.extend(e.messages(self.is_folded(e)));
        }
        if let Some((assistant, error)) = &self.state.reask {
            messages.push(assistant.clone());
            messages.push(error.clone());
        }
        messages.extend(self.memory_message());
        messages.extend(self.steer_message());
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
                if self.is_folded(e) {
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
        if let Some(m) = self.steer_message() {
            fixed += self.count_messages(&[m]);
        }
        fixed
    }

    /// Checks that the fixed layers fit at all.
    pub fn check_fits(&self) -> Result<(), ContextError> {
        let fixed = self.fixed_tokens();
        if fixed * 10 > self.window() * 9 {
            return Err(ContextError::WindowTooSmall {
                fixed,
                window: self.window(),
            });
        }
        Ok(())
    }

    /// The usable window: the configured one, shrunk after the endpoint refused a prompt as
    /// too long.
    pub fn window(&self) -> usize {
        (self.cfg.window as f64 * self.state.window_scale.unwrap_or(1.0)) as usize
    }

    /// Tokens above which the prompt is compacted.
    pub fn trigger_tokens(&self) -> usize {
        (self.cfg.trigger * self.window() as f64) as usize
    }

    /// The endpoint said the prompt was too long though it was counted as fitting: use a
    /// quarter less of the window from now on (the prompt is then repaired to fit). Returns
    /// `false` when the window cannot shrink further (the fixed layers fill it).
    pub fn shrink_window(&mut self) -> bool {
        let scale = self.state.window_scale.unwrap_or(1.0) * 0.75;
        let floor = (self.fixed_tokens() as f64 * 1.25) / self.cfg.window.max(1) as f64;
        if scale < floor {
            return false;
        }
        self.state.window_scale = Some(scale);
        true
    }

    /// Counts a model turn (compaction hysteresis is measured in turns).
    pub fn next_turn(&mut self) {
        self.state.turn += 1;
    }

    /// Whether the model may be asked for a summary this turn: never on two turns in a row.
    pub fn may_summarize(&self) -> bool {
        self.state
            .last_summary_turn
            .is_none_or(|t| self.state.turn > t + 1)
    }

    /// Whether the prompt has passed the summarization trigger.
    pub fn needs_compaction(&self) -> bool {
        self.cfg.managed
            && self.prompt_tokens() > self.trigger_tokens()
            && self.state.working.len() > self.cfg.min_tail
    }

    /// Makes the prompt fit `limit` tokens without the model, harder at each stage until it
    /// does: cut verbatim observations to a fair share (their whole stays in the exec record
    /// or file), fold every step but the newest, move everything but the newest into the
    /// archive with a deterministic summary, and at last cut the archive and the newest
    /// result. Returns the stages used (empty when the prompt fit already).
    pub fn shrink_to(&mut self, limit: usize) -> Vec<&'static str> {
        let mut stages = Vec::new();
        if self.prompt_tokens() <= limit {
            return stages;
        }
        // 1. Verbatim observations down to an equal share of what is left for them.
        let verbatim: Vec<u64> = self
            .state
            .first
            .iter()
            .chain(self.state.working.iter())
            .filter(|e| !self.is_folded(e))
            .map(|e| e.step)
            .collect();
        if !verbatim.is_empty() {
            let verbatim_tokens: usize = self
                .state
                .first
                .iter()
                .chain(self.state.working.iter())
                .filter(|e| !self.is_folded(e))
                .map(|e| e.tokens_full)
                .sum();
            let others = self.prompt_tokens().saturating_sub(verbatim_tokens);
            let share = limit.saturating_sub(others) / verbatim.len();
            let chars = (share.saturating_sub(60) * 3).max(300);
            let mut changed = false;
            for i in 0..self.state.first.len() + self.state.working.len() {
                let e = if i < self.state.first.len() {
                    &self.state.first[i]
                } else {
                    &self.state.working[i - self.state.first.len()]
                };
                if !verbatim.contains(&e.step) || e.tokens_full <= share {
                    continue;
                }
                let mut e = e.clone();
                e.observation = shrink_text(&e.observation, e.step, chars);
                e.reasoning = cut_chars(&e.reasoning, chars / 4);
                e.shrunk = true;
                self.recount(&mut e);
                if i < self.state.first.len() {
                    self.state.first[i] = e;
                } else {
                    let j = i - self.state.first.len();
                    self.state.working[j] = e;
                }
                changed = true;
            }
            if changed {
                stages.push("cut_results");
            }
        }
        if self.prompt_tokens() <= limit {
            return stages;
        }
        // 2. Fold everything but the newest step.
        let newest = self
            .state
            .working
            .back()
            .or(self.state.first.last())
            .map(|e| e.step);
        for e in self
            .state
            .first
            .iter_mut()
            .chain(self.state.working.iter_mut())
        {
            if Some(e.step) != newest {
                e.force_folded = true;
            }
        }
        stages.push("fold_all");
        if self.prompt_tokens() <= limit {
            return stages;
        }
        // 3. Everything but the newest step into the archive, summarized without the model.
        if self.state.working.len() > 1 {
            let covered: Vec<&StepEntry> = self
                .state
                .working
                .iter()
                .take(self.state.working.len() - 1)
                .collect();
            let plan = CompactionPlan {
                steps: covered.len(),
                from_step: self
                    .state
                    .archive
                    .as_ref()
                    .map_or(covered[0].step, |s| s.from_step),
                to_step: covered[covered.len() - 1].step,
                request: ChatRequest::default(),
                fallback: self.fallback_summary(&covered),
            };
            self.apply_compaction_inner(&plan, None, false);
            stages.push("archive_all");
        }
        if self.prompt_tokens() <= limit {
            return stages;
        }
        // 4. The archive and the newest result cut hard; the re-ask dropped.
        if let Some(a) = &mut self.state.archive {
            a.text = cut_chars(&a.text, 1_000);
        }
        self.state.reask = None;
        let mut entries: Vec<StepEntry> = self
            .state
            .first
            .iter()
            .chain(self.state.working.iter())
            .cloned()
            .collect();
        for e in &mut entries {
            e.observation = shrink_text(&e.observation, e.step, 600);
            e.reasoning = cut_chars(&e.reasoning, 200);
            for m in &mut e.operator {
                *m = cut_chars(m, 300);
            }
            e.shrunk = true;
            self.recount(e);
        }
        let n_first = self.state.first.len();
        self.state.working = entries.split_off(n_first).into();
        self.state.first = entries;
        stages.push("cut_hard");
        stages
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
        let target = (self.cfg.target * self.window() as f64) as usize;
        // Leave room for the summary itself.
        let summary_budget = self.summary_max_tokens();
        let first: usize = self
            .state
            .first
            .iter()
            .map(|e| {
                if self.is_folded(e) {
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
        let input_budget = (self.window() as f64 * 0.4) as usize;
        let per_step_chars = (input_budget * 4 / covered.len().max(1)).clamp(120, 1_500);
        let mut input = String::new();
        if let Some(s) = &self.state.archive {
            input.push_str(&format!(
                "Summary so far (steps {}-{}):\n{}\n\n",
                s.from_step, s.to_step, s.text
            ));
        }
        input.push_str("Steps to add (the agent's reasoning, the action, its result):\n");
        for e in &covered {
            input.push_str(&format!(
                "step {}{}: {} -> {}\n",
                e.step,
                e.exec_id
                    .as_deref()
                    .map(|x| format!(" (exec {x})"))
                    .unwrap_or_default(),
                e.action_line,
                if e.ok { "ok" } else { "FAILED" },
            ));
            // Reasoning first: it holds the plan, which is what says what is left to do.
            let reasoning = e.reasoning.trim();
            let reasoning_chars = if reasoning.is_empty() {
                0
            } else {
                per_step_chars / 3
            };
            for m in &e.operator {
                // The operator's correction must outlive the step it steered.
                input.push_str(&format!(
                    "  operator said before it: {}\n",
                    cut_chars(&m.replace('\n', " "), per_step_chars / 2)
                ));
            }
            if reasoning_chars > 0 {
                input.push_str(&format!(
                    "  reasoning: {}\n",
                    cut_chars(&reasoning.replace('\n', " "), reasoning_chars)
                ));
            }
            let (result, _) = head_tail(
                &e.observation,
                ObserveLimits {
                    head_chars: (per_step_chars - reasoning_chars) / 2,
                    tail_chars: (per_step_chars - reasoning_chars) / 3,
                    line_chars: 300,
                    max_chars: per_step_chars,
                },
            );
            input.push_str(&format!("  result: {}\n", result.replace('\n', "\n    ")));
        }
        if let Some(plan) = self.latest_plan() {
            input.push_str(&format!("\nThe agent's latest stated plan: {plan}\n"));
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
        (self.window() / 10).clamp(64, 2_000)
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
            for m in &e.operator {
                lines.push(format!(
                    "operator before step {}: {}",
                    e.step,
                    cut_chars(&m.replace('\n', " "), 300)
                ));
            }
            lines.push(format!(
                "step {}: {} -> {}{}{}",
                e.step,
                e.action_line,
                if e.ok { "ok" } else { "FAILED" },
                e.exec_id
                    .as_deref()
                    .map(|x| format!(" (exec {x})"))
                    .unwrap_or_default(),
                if e.reasoning.trim().is_empty() {
                    String::new()
                } else {
                    format!(
                        " — why: {}",
                        cut_chars(&e.reasoning.trim().replace('\n', " "), 160)
                    )
                }
            ));
        }
        let mut left = String::from("\nLeft to do: ");
        match (self.state.pinned.get("subtask"), self.latest_plan()) {
            (None, None) => left.push_str("the rest of the task (no plan was stated)"),
            (subtask, plan) => {
                if let Some(t) = subtask {
                    left.push_str(&format!("current subtask: {}. ", cut_chars(t, 300)));
                }
                if let Some(p) = plan {
                    left.push_str(&format!("latest plan: {p}"));
                }
            }
        }
        // The summary is cut to its budget; what is left must survive the cut, so the done
        // part gives way (its oldest lines first).
        let budget = (self.summary_max_tokens() * 4).saturating_sub(left.chars().count() + 8);
        let mut done = lines.join("\n");
        let len = done.chars().count();
        if len > budget {
            done = format!("…{}", done.chars().skip(len - budget).collect::<String>());
        }
        format!("Done:\n{done}{left}")
    }

    /// The newest reasoning the model wrote with a call, bounded: its current plan.
    pub fn latest_plan(&self) -> Option<String> {
        self.state
            .first
            .iter()
            .chain(self.state.working.iter())
            .rev()
            .map(|e| e.reasoning.trim())
            .find(|r| !r.is_empty())
            .map(|r| cut_chars(&r.replace('\n', " "), 600))
    }

    /// Applies a compaction: the planned steps leave the working layer for the archive.
    pub fn apply_compaction(&mut self, plan: &CompactionPlan, summary: Option<String>) {
        self.apply_compaction_inner(plan, summary, true);
    }

    fn apply_compaction_inner(
        &mut self,
        plan: &CompactionPlan,
        summary: Option<String>,
        asked_model: bool,
    ) {
        if asked_model {
            self.state.last_summary_turn = Some(self.state.turn);
        }
        let by_model = summary.as_ref().is_some_and(|s| !s.trim().is_empty());
        let mut text = summary
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| plan.fallback.clone());
        // A summary longer than its budget defeats its purpose.
        let max_chars = self.summary_max_tokens() * 4;
        let len = text.chars().count();
        if len > max_chars {
            // Head and tail: "Left to do" comes last and must survive.
            let head: String = text.chars().take(max_chars * 3 / 5).collect();
            let tail: String = text.chars().skip(len - max_chars * 2 / 5).collect();
            text = format!("{head}\n[…]\n{tail}");
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

/// Characters of a dropped observation kept for the summary that will absorb its step.
const DIGEST_CHARS: usize = 1_200;

/// The bounded digest of an observation dropped from the prompt.
fn digest(text: &str) -> String {
    let (shown, _) = head_tail(
        text,
        ObserveLimits {
            head_chars: DIGEST_CHARS / 2,
            tail_chars: DIGEST_CHARS / 2 - 100,
            line_chars: 300,
            max_chars: DIGEST_CHARS,
        },
    );
    shown
}

/// An observation cut to about `chars` characters (head + tail, long lines cut), saying that
/// the whole is still available.
fn shrink_text(text: &str, step: u64, chars: usize) -> String {
    if text.chars().count() <= chars {
        return text.to_owned();
    }
    let half = chars / 2;
    let (shown, _) = head_tail(
        text,
        ObserveLimits {
            head_chars: half,
            tail_chars: half.saturating_sub(100).max(50),
            line_chars: half.clamp(40, 500),
            max_chars: chars,
        },
    );
    format!("{shown}\n[step {step}: result cut to fit the context window; the whole is in the exec record or the file it came from — recall(step={step}) or read_file with start_line]")
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

    /// The prompt's tokens counted from scratch, as `prompt_tokens_match_a_recount` does.
    fn recount(m: &ContextManager) -> usize {
        let counter = TokenCounter::for_model("gpt-4o");
        m.render()
            .iter()
            .map(|msg| MESSAGE_OVERHEAD + counter.count(&msg.countable_text()))
            .sum::<usize>()
            + counter.count(&Value::Array(m.tools().to_vec()).to_string())
    }

    fn texts(m: &ContextManager) -> Vec<String> {
        m.render()
            .iter()
            .map(|m| m.content.clone().unwrap_or_default())
            .collect()
    }

    #[test]
    fn a_folded_write_file_keeps_path_size_and_digest_not_the_content() {
        let mut m = manager(100_000);
        // Steps in the first layer and in the working layer, a short and a long content.
        let contents: Vec<String> = (1..=6)
            .map(|i| {
                let len = if i % 2 == 0 { 300 } else { 5_000 };
                (0..len)
                    .map(|j| char::from(b'a' + ((i * 7 + j * 13) % 26) as u8))
                    .collect()
            })
            .collect();
        for (i, content) in contents.iter().enumerate() {
            let step = i as u64 + 1;
            let mut c = call(step, &json_args(step, content));
            c.function.name = "write_file".into();
            m.push_step(
                step,
                c,
                format!("write_file f{step} ({} bytes)", content.len()),
                format!("wrote {} bytes to f{step}", content.len()),
                None,
                true,
            );
        }
        for step in 7..=14 {
            push(&mut m, step, "more");
        }
        let held: Vec<&StepEntry> = m
            .state()
            .first
            .iter()
            .chain(m.state().working.iter())
            .collect();
        let rendered = serde_json::to_string(&m.render()).expect("json");
        let stored = serde_json::to_string(m.state()).expect("json");
        for (i, content) in contents.iter().enumerate() {
            let step = i as u64 + 1;
            let e = held.iter().find(|e| e.step == step).expect("held");
            let args: Value = serde_json::from_str(&e.call.function.arguments).expect("valid JSON");
            assert_eq!(args["path"], format!("f{step}"));
            let kept = args["content"].as_str().unwrap_or_default();
            assert!(kept.chars().count() <= FOLDED_CONTENT_CHARS, "{kept}");
            assert!(
                kept.contains(&format!("{} bytes folded, sha256 ", content.len())),
                "{kept}"
            );
            assert!(
                kept.starts_with(&content[..FOLDED_CONTENT_PREFIX_CHARS]),
                "{kept}"
            );
            // Neither the prompt nor the checkpointed state holds the content any more.
            let piece = &content[..FOLDED_CONTENT_PREFIX_CHARS + 20];
            assert!(
                !rendered.contains(piece),
                "step {step} content in the prompt"
            );
            assert!(!stored.contains(piece), "step {step} content in the state");
        }
        assert_eq!(m.prompt_tokens(), recount(&m));
    }

    fn json_args(step: u64, content: &str) -> String {
        serde_json::json!({"path": format!("f{step}"), "content": content}).to_string()
    }

    #[test]
    fn a_steer_is_pinned_until_acknowledged_then_kept_with_its_step() {
        let mut m = manager(100_000);
        push(&mut m, 1, "one");
        let before = m.prompt_tokens();
        assert!(!m.steer("op-1", "use python3, not python", 1));
        // Pinned last, counted in the prompt.
        let last = texts(&m).last().cloned().unwrap_or_default();
        assert!(
            last.contains("[operator:") && last.contains("use python3, not python"),
            "{last}"
        );
        assert!(m.prompt_tokens() > before);
        assert_eq!(m.prompt_tokens(), recount(&m));

        // A malformed reply does not acknowledge it: it stays pinned through re-asks.
        m.set_reask(Message::user("bad"), Message::user("error"));
        assert!(texts(&m).last().is_some_and(|t| t.contains("use python3")));

        // The model answers with a call for step 2: acknowledged, still shown until the step
        // is recorded, then in the history just before that step's call.
        assert_eq!(m.acknowledge_steers(2), vec!["op-1".to_owned()]);
        assert!(m.acknowledge_steers(2).is_empty(), "acknowledged once");
        push(&mut m, 2, "two");
        assert!(m.steers().is_empty());
        let msgs = m.render();
        let at = msgs
            .iter()
            .position(|x| {
                x.content
                    .as_deref()
                    .is_some_and(|c| c.contains("use python3"))
            })
            .expect("in the history");
        assert_eq!(msgs[at].role, "user");
        assert!(
            msgs[at]
                .content
                .as_deref()
                .is_some_and(|c| c.contains("operator message op-1")),
            "{:?}",
            msgs[at]
        );
        assert_eq!(msgs[at + 1].role, "assistant");
        assert_eq!(msgs[at + 1].tool_calls[0].id, "c2");
        assert!(
            !texts(&m).last().is_some_and(|t| t.contains("[operator:")),
            "no longer pinned"
        );
        assert_eq!(m.prompt_tokens(), recount(&m));

        // Folded with its step once old, still there in brief.
        let long = format!("use python3; {}", "details ".repeat(100));
        m.steer("op-2", &long, 2);
        m.acknowledge_steers(3);
        push(&mut m, 3, "three");
        for step in 4..=10 {
            push(&mut m, step, "more");
        }
        let folded = texts(&m)
            .into_iter()
            .find(|t| t.contains("operator message op-2"))
            .expect("kept folded");
        assert!(
            folded.chars().count() <= FOLDED_OPERATOR_CHARS + 1,
            "{folded}"
        );
        assert_eq!(m.prompt_tokens(), recount(&m));
    }

    #[test]
    fn steers_survive_a_checkpoint_and_a_summary_keeps_them() {
        let mut m = manager(100_000);
        push(&mut m, 1, "one");
        m.steer("op-1", "do not touch the tests directory", 1);
        let restored = ContextManager::restore(
            ContextConfig::for_window(100_000),
            TokenCounter::for_model("gpt-4o"),
            Vec::new(),
            serde_json::from_value(serde_json::to_value(m.state()).expect("encode"))
                .expect("decode"),
        );
        assert_eq!(restored.steers().len(), 1);
        assert!(restored
            .render()
            .last()
            .and_then(|x| x.content.clone())
            .is_some_and(|t| t.contains("tests directory")));

        m.acknowledge_steers(2);
        push(&mut m, 2, "two");
        // A window the steps overflow, so the oldest working step (2) is summarized.
        let mut m = ContextManager::restore(
            ContextConfig::for_window(8_000),
            TokenCounter::for_model("gpt-4o"),
            m.tools().to_vec(),
            m.state().clone(),
        );
        for step in 3..=8 {
            push(&mut m, step, &"more words here ".repeat(150));
        }
        let plan = m.plan_compaction(true).expect("a plan");
        assert!(
            plan.from_step <= 2 && plan.to_step >= 2,
            "{} {}",
            plan.from_step,
            plan.to_step
        );
        let input = plan.request.messages[1].content.clone().unwrap_or_default();
        assert!(
            input.contains("operator said before it") && input.contains("tests directory"),
            "{input}"
        );
        assert!(
            plan.fallback.contains("tests directory"),
            "{}",
            plan.fallback
        );
    }

    #[test]
    fn a_steer_too_long_for_the_window_is_cut() {
        let mut m = manager(4_000);
        let text = "word ".repeat(2_000);
        assert!(m.steer("op-1", &text, 0), "cut");
        let kept = m.steers()[0].text.chars().count();
        assert!(kept < text.len() && kept >= MIN_STEER_CHARS, "{kept}");
        assert!(m.check_fits().is_ok());
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
    fn shrink_to_repairs_any_oversized_prompt() {
        let mut m = manager(8_000);
        // What a run without caps could hold: a 400 KB result among verbatim steps.
        push(&mut m, 1, "first\n");
        push(&mut m, 2, &"x".repeat(400_000));
        push(&mut m, 3, &"y\n".repeat(5_000));
        m.set_reask(
            Message::assistant_call(call(9, "{bad"), None),
            Message::tool("c9", "error"),
        );
        assert!(m.prompt_tokens() > 8_000);
        let stages = m.shrink_to(6_000);
        assert!(!stages.is_empty());
        assert!(
            m.prompt_tokens() <= 6_000,
            "{} after {stages:?}",
            m.prompt_tokens()
        );
        // What was cut says where the rest is, and recall goes to the daemon for it.
        let text: String = m
            .render()
            .iter()
            .filter_map(|m| m.content.clone())
            .collect();
        assert!(
            text.contains("result cut to fit the context window"),
            "{text}"
        );
        assert!(m.find_step(2).is_none());
        // A tiny limit still ends with a prompt, as small as it can get.
        m.shrink_to(10);
        assert!(m.prompt_tokens() < 3_000, "{}", m.prompt_tokens());
    }

    #[test]
    fn summaries_keep_reasoning_and_say_what_is_left() {
        let mut m = manager(4_000);
        for step in 1..=30 {
            m.push_reasoned_step(
                step,
                call(step, "{}"),
                format!("Step {step}: next I will fix module {step}"),
                format!("bash `echo {step}`"),
                format!("out {step}\n").repeat(20) + &format!("END-{step}\n"),
                Some(format!("ex-{step}")),
                true,
            );
        }
        let plan = m.plan_compaction(true).expect("a plan");
        let input = plan.request.messages[1].content.clone().unwrap_or_default();
        assert!(
            input.contains("reasoning: Step 2: next I will fix module 2"),
            "{input}"
        );
        assert!(
            input.contains("END-2"),
            "the end of a dropped result: {input}"
        );
        assert!(input.contains("latest stated plan: Step 30"), "{input}");
        m.apply_compaction(&plan, None);
        let s = m.state().archive.clone().unwrap_or_default();
        assert!(s.text.starts_with("Done:"), "{}", s.text);
        assert!(
            s.text.contains("Left to do: latest plan: Step 30"),
            "{}",
            s.text
        );
        assert!(!m.may_summarize(), "not on the next turn");
        m.next_turn();
        assert!(!m.may_summarize());
        m.next_turn();
        assert!(m.may_summarize());
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
