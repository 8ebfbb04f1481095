//! The agent loop: a model drives a sandbox through tools until the task is done, verified,
//! stopped by a budget or stuck — and a crash anywhere is resumable without repeating a side
//! effect.
//!
//! The loop ([`runner`]) is a small explicit state machine ([`state`]); what it relies on lives
//! in modules of their own, each with its own tests:
//!
//! | module | concern |
//! |---|---|
//! | [`llm`] | OpenAI-compatible Chat Completions with tool calling, tolerant response parsing |
//! | [`tools`] | the tool schemas, tolerant parsing and repair of the model's calls |
//! | [`observe`] | observation normalization (head+tail, spill paths, plain statuses) |
//! | [`context`] | the three context layers, folding, summarization, pinned facts |
//! | [`tokens`] | token counting (tiktoken where the model family is known) |
//! | [`classify`] | what a daemon error means to the loop, by gRPC code and call, in one place |
//! | [`checkpoint`] | crash-safe, checksummed, versioned checkpoints and the run lock |
//! | [`termination`] | no-progress detection (fingerprints, alternation, progress signals) |
//! | [`budget`] | budgets per call, per step and per task, with a soft warning |
//! | [`retry`] | backoff with jitter, per-tool circuit breakers, the model's rate limit |
//! | [`verify`] | action, subtask and task-level checks |
//! | [`trace`] | the JSONL trace and its timeline |
//! | [`inbox`] | operator requests (`steer`, `stop`) through the run's directory |
//! | [`sandbox`] | the daemon calls the loop makes, and an in-memory fake |
//! | [`fixture`] | a scripted OpenAI-compatible server for tests and benchmarks |

pub mod budget;
pub mod checkpoint;
pub mod classify;
pub mod context;
pub mod fixture;
pub mod inbox;
pub mod llm;
pub mod observe;
pub mod retry;
pub mod runner;
pub mod sandbox;
pub mod state;
pub mod termination;
pub mod tokens;
pub mod tools;
pub mod trace;
pub mod verify;

pub use checkpoint::{Checkpoint, CheckpointError, CheckpointStore, FileStore, RunSpec};
pub use llm::{LlmProvider, OpenAiProvider};
pub use runner::{
    reap_finished_sandboxes, remove_unused_sandbox, resume, start, AgentError, NewBudgets,
    Progress, ProgressSink, RunOptions, RunReport,
};
pub use state::{LoopState, RunStatus, StopReason};

/// Environment variable naming the default state directory for runs.
pub const STATE_DIR_ENV: &str = "SBX_AGENT_STATE_DIR";

/// State directory when neither `--state-dir` nor [`STATE_DIR_ENV`] is given: next to the
/// daemon's default socket, under the current directory.
pub const DEFAULT_STATE_DIR: &str = ".sandboxd/agent";
