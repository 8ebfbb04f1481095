//! The loop: an explicit state machine driving model calls and sandbox actions.
//!
//! Each state has one handler; what to keep in the prompt, when a run is stuck or over budget,
//! how a check is judged and how a checkpoint is written live in their own modules. The loop
//! only sequences them, and it keeps two promises about persistence: the pending action is on
//! disk before it is sent (so a resume knows it may have happened), and a step's checkpoint is
//! on disk before the next step acts (written in the background meanwhile, overlapping the
//! model call).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use super::budget::{Budget, BudgetLimits, BudgetUsed, Verdict};
use super::checkpoint::{
    Checkpoint, CheckpointError, CheckpointStore, FileStore, Outcome, PendingAction, RunLock,
    RunSpec, Writer,
};
use super::classify::{classify, Class, Op, OpError};
use super::context::{ContextConfig, ContextError, ContextManager};
use super::llm::{ChatRequest, LlmError, LlmProvider, Message, ToolCall};
use super::observe::{self, Observation, ObserveLimits};
use super::retry::{Backoff, Breakers, TokenBucket};
use super::sandbox::SandboxApi;
use super::state::{IllegalTransition, LoopState, RunStatus, StopReason};
use super::termination::{self, Detector, DetectorConfig};
use super::tokens::TokenCounter;
use super::tools::{self, Action, CallError};
use super::trace::Trace;
use super::verify::{self, Level};
use crate::proto::{CreateSandboxRequest, ExecRequest, ExecResult, Isolation};

/// Where files the loop keeps inside the sandbox go (the diff base, spilled outputs).
const AGENT_DIR: &str = "/tmp/.agent";
/// Label put on the sandboxes of a run.
pub const RUN_LABEL: &str = "agent-run";
/// Tokens kept free between the prompt and the window beyond the completion limit: our count
/// and the endpoint's differ a little.
const PROMPT_MARGIN_TOKENS: usize = 64;
/// Times in a row the endpoint may refuse a prompt as too long (each time the usable window
/// shrinks by a quarter and the prompt is repaired) before the run stops.
const MAX_CONTEXT_REPAIRS: u32 = 8;
/// Characters of the model's reasoning kept per step in the trace.
const TRACE_REASONING_CHARS: usize = 8_000;
/// Largest diff kept in the report (the whole one is in the run directory).
const REPORT_DIFF_CHARS: usize = 8_000;
/// How often a retry's wait looks at the operator's inbox.
const OPERATOR_POLL: Duration = Duration::from_millis(250);

/// Everything that can stop the loop from running at all (as opposed to a run that ends with
/// a reason, which is a [`RunReport`]).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Checkpoint trouble: missing, corrupt, incompatible, locked, I/O.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A daemon call that the loop cannot do without failed.
    #[error("{what}: {source}")]
    Daemon {
        /// What was being done.
        what: String,
        /// The client error.
        #[source]
        source: crate::Error,
    },
    /// The model endpoint cannot be used.
    #[error(transparent)]
    Llm(#[from] LlmError),
    /// The context cannot fit the window.
    #[error(transparent)]
    Context(#[from] ContextError),
    /// A run with this id exists already.
    #[error(
        "run {0} already exists; continue it with `sbx agent resume {0}` or pick another --run-id"
    )]
    RunExists(String),
    /// The checkpoint cannot be continued from.
    #[error("cannot resume run {run_id}: {reason}")]
    CannotResume {
        /// The run.
        run_id: String,
        /// Why.
        reason: String,
    },
    /// A bug: the loop tried an illegal transition.
    #[error(transparent)]
    Transition(#[from] IllegalTransition),
    /// Trace file trouble.
    #[error(transparent)]
    Trace(#[from] super::trace::TraceError),
}

/// How long a model endpoint outage is waited out by default, seconds.
pub const DEFAULT_LLM_PATIENCE_SECS: u64 = 600;
/// The breaker key of the model endpoint.
const LLM_BREAKER: &str = "model endpoint";

/// Knobs beyond the run's spec.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Where runs are kept.
    pub state_dir: PathBuf,
    /// Observation cut sizes.
    pub observe: ObserveLimits,
    /// No-progress detection.
    pub detector: DetectorConfig,
    /// Retry policy for daemon calls.
    pub backoff: Backoff,
    /// Retry policy for model calls: patient, an endpoint outage of minutes is survived.
    pub llm_backoff: Backoff,
    /// Consecutive failed model calls that open the endpoint's circuit breaker (summaries
    /// then use the deterministic fallback and turns wait for the cooldown).
    pub llm_breaker_threshold: u32,
    /// How long the endpoint's open breaker stays open before a probe call.
    pub llm_breaker_cooldown: Duration,
    /// Consecutive failures that open a tool's breaker.
    pub breaker_threshold: u32,
    /// How long an open breaker stays open.
    pub breaker_cooldown: Duration,
    /// Model calls allowed in a burst.
    pub rate_burst: u32,
    /// Model calls per second, sustained.
    pub rate_per_sec: f64,
    /// Re-asks for one malformed turn.
    pub max_reasks: u32,
    /// `finish` rejections before the run fails.
    pub max_rejected_finishes: u32,
    /// Steps whose results stay verbatim.
    pub fold_after: usize,
    /// Snapshot after every step that may change files (needed for rollback on resume).
    pub snapshot_steps: bool,
    /// How long the run's sandbox is kept once the run has ended (then
    /// [`reap_finished_sandboxes`] removes it); `None` keeps it. On resume, `Some` replaces
    /// the run's own.
    pub keep_sandbox: Option<Duration>,
    /// Receives a line per step (and per wait for the model endpoint), for a human watching.
    pub progress: Option<ProgressSink>,
    /// Told once a new run's first checkpoint is on disk (from then on `resume` can continue
    /// it), before its sandbox is made.
    pub started: Option<ProgressSink>,
    /// On resume: new task budgets. A run stopped by a budget, the step limit or the
    /// no-progress detector continues with them instead of being reported as it ended.
    pub new_budgets: NewBudgets,
}

/// Where live progress goes: `sbx agent run` prints it on a terminal.
#[derive(Clone)]
pub struct ProgressSink(pub Arc<dyn Fn(&Progress) + Send + Sync>);

impl std::fmt::Debug for ProgressSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressSink")
    }
}

/// One line of live progress.
#[derive(Clone, Debug, Serialize)]
pub struct Progress {
    /// The run.
    pub run_id: String,
    /// Steps done.
    pub step: u64,
    /// The step budget.
    pub max_steps: u64,
    /// Tokens used so far.
    pub tokens: u64,
    /// The token budget, if any.
    pub max_tokens: Option<u64>,
    /// Wall time of the run so far, ms.
    pub elapsed_ms: u64,
    /// What happened: the action and its result, or what the loop waits for.
    pub line: String,
}

/// Task budgets given again on resume; `None` keeps the run's own.
#[derive(Clone, Copy, Debug, Default)]
pub struct NewBudgets {
    /// Step budget (total steps, those taken included).
    pub max_steps: Option<u64>,
    /// Token budget (total).
    pub max_tokens: Option<u64>,
    /// Wall-time budget (total), seconds.
    pub max_time_secs: Option<u64>,
    /// Cost budget (total), USD.
    pub max_cost: Option<f64>,
}

impl NewBudgets {
    /// Whether any budget is given.
    pub fn any(&self) -> bool {
        self.max_steps.is_some()
            || self.max_tokens.is_some()
            || self.max_time_secs.is_some()
            || self.max_cost.is_some()
    }

    /// Puts the given budgets into `spec`; returns a description of what changed.
    fn apply(&self, spec: &mut RunSpec) -> Vec<String> {
        let mut changed = Vec::new();
        if let Some(n) = self.max_steps {
            changed.push(format!("steps {} -> {n}", spec.max_steps));
            spec.max_steps = n;
        }
        if let Some(n) = self.max_tokens {
            changed.push(format!("tokens {:?} -> {n}", spec.max_tokens));
            spec.max_tokens = Some(n);
        }
        if let Some(n) = self.max_time_secs {
            changed.push(format!("time {:?}s -> {n}s", spec.max_time_secs));
            spec.max_time_secs = Some(n);
        }
        if let Some(n) = self.max_cost {
            changed.push(format!("cost {:?} -> {n}", spec.max_cost));
            spec.max_cost = Some(n);
        }
        changed
    }
}

impl RunOptions {
    /// Defaults with runs kept under `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        RunOptions {
            state_dir: state_dir.into(),
            observe: ObserveLimits::default(),
            detector: DetectorConfig::default(),
            backoff: Backoff::default(),
            llm_backoff: Backoff::patient(Duration::from_secs(DEFAULT_LLM_PATIENCE_SECS)),
            llm_breaker_threshold: 5,
            llm_breaker_cooldown: Duration::from_secs(30),
            breaker_threshold: 5,
            breaker_cooldown: Duration::from_secs(30),
            rate_burst: 10,
            rate_per_sec: 10.0,
            max_reasks: 3,
            max_rejected_finishes: 3,
            fold_after: 5,
            snapshot_steps: true,
            new_budgets: NewBudgets::default(),
            keep_sandbox: None,
            progress: None,
            started: None,
        }
    }
}

/// The result of a run: what `sbx agent run --json` prints.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// The run.
    pub run_id: String,
    /// `done`, `failed` or `stopped`.
    pub status: RunStatus,
    /// The named reason.
    pub reason: StopReason,
    /// Steps taken.
    pub steps: u64,
    /// Prompt tokens used (as the endpoint reported them).
    pub prompt_tokens: u64,
    /// Completion tokens used.
    pub completion_tokens: u64,
    /// The sandbox the run worked in (kept for inspection).
    pub sandbox_id: String,
    /// Snapshot of the sandbox at the end.
    pub final_snapshot_id: Option<String>,
    /// The answer given to `finish`.
    pub answer: Option<String>,
    /// Cost, USD; `None` (not reported) when the run has no price: neither `--price` nor a
    /// model whose price is known on its endpoint.
    pub cost_usd: Option<f64>,
    /// Wall time over all sessions, ms.
    pub elapsed_ms: u64,
    /// What was done, in a few lines.
    pub summary: String,
    /// Diff of the workspace against its state before the first step (bounded).
    pub diff: String,
    /// The whole diff.
    pub diff_path: Option<String>,
    /// The trace.
    pub trace_path: Option<String>,
    /// The error behind a `fatal_error`.
    pub error: Option<String>,
    /// Whether `sbx agent resume` can continue it.
    pub resumable: bool,
    /// Checkpoint write latencies of this session, ms, p50 and p99.
    pub checkpoint_ms_p50: f64,
    /// See `checkpoint_ms_p50`.
    pub checkpoint_ms_p99: f64,
    /// Longest time the loop waited for a background checkpoint write, ms.
    pub checkpoint_stall_ms_max: f64,
}

/// The instructions every prompt starts with.
pub fn instructions(has_verify: bool) -> String {
    let mut s = String::from(
        "You are an autonomous software agent working inside a Linux sandbox through tools. \
Work in small, checkable steps: inspect, change, run, read the result. One tool call per turn.\n\
- bash runs a command in /workspace; long output is cut to head and tail and the full text is kept in a file you can page with read_file.\n\
- Edit files with write_file or str_replace; read them with read_file.\n\
- snapshot before risky changes; rollback to undo them.\n\
- pin facts you must not forget (key paths, values, what is verified); they survive when old steps are summarized.\n\
- Old results are folded or summarized; recall(step=N) shows a step's full result again.\n\
- Do not repeat an approach listed as failed without changing it.\n\
- When the task is complete, call finish with the answer.",
    );
    if has_verify {
        s.push_str(" finish is accepted only when the task's check command passes; if it fails you get its output.");
    }
    s
}

/// The idempotency key of a step's exec: derived from the run, the step and the attempt, so a
/// resumed run asks the daemon about exactly the exec it may have started.
pub fn idempotency_key(run_id: &str, step: u64, attempt: u32, what: &str) -> String {
    format!("{run_id}:{step}:{what}:{attempt}")
}

/// A fresh run id: `run-<unix seconds>-<random>`.
pub fn new_run_id() -> String {
    use rand::Rng;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "run-{secs}-{:06x}",
        rand::thread_rng().gen_range(0..0x100_0000u32)
    )
}

struct RetryPlan {
    attempt: u32,
    delay: Duration,
    then: LoopState,
}

/// A run in progress.
pub struct Agent<S: SandboxApi + Clone + 'static> {
    sandbox: S,
    llm: Arc<dyn LlmProvider>,
    opts: RunOptions,
    store: FileStore,
    writer: Writer,
    trace: Trace,
    ctx: ContextManager,
    budget: Budget,
    detector: Detector,
    breakers: Breakers,
    llm_breaker: Breakers,
    /// When the current model outage began (the first failure of the calls in a row).
    llm_outage: Option<Instant>,
    bucket: TokenBucket,
    ck: Checkpoint,
    workdir: String,
    state: LoopState,
    session_start: Instant,
    retry: Option<RetryPlan>,
    llm_attempt: u32,
    act_attempt: u32,
    reasks: u32,
    /// Completion limit for the next call when it differs from the configured one: raised
    /// after a reply was cut off by the limit, back to `None` once a call is accepted.
    completion_limit: Option<u32>,
    step_tokens: u64,
    last_obs: Option<Observation>,
    stop: Option<(StopReason, String)>,
    answer: Option<String>,
    _lock: Option<RunLock>,
}

fn limits_of(spec: &RunSpec) -> BudgetLimits {
    BudgetLimits {
        max_tokens: spec.max_tokens,
        max_cost: spec.max_cost,
        max_time: spec.max_time_secs.map(Duration::from_secs),
        max_steps: spec.max_steps,
        price: spec.price,
        call_completion_tokens: spec.max_completion_tokens,
        step_time: Duration::from_secs(spec.step_timeout_secs.max(1)),
        step_tokens: (spec.context_window as u64).saturating_mul(4),
    }
}

fn context_config(spec: &RunSpec, opts: &RunOptions) -> ContextConfig {
    let mut cfg = ContextConfig::for_window(spec.context_window);
    cfg.fold_after = opts.fold_after;
    cfg.managed = spec.managed_context;
    cfg
}

fn tool_wire() -> Vec<Value> {
    tools::specs().iter().map(|s| s.to_wire()).collect()
}

/// Starts a new run and drives it to its end.
pub async fn start<S: SandboxApi + Clone + 'static>(
    sandbox: S,
    llm: Arc<dyn LlmProvider>,
    spec: RunSpec,
    run_id: Option<String>,
    opts: RunOptions,
) -> Result<RunReport, AgentError> {
    let run_id = run_id.unwrap_or_else(new_run_id);
    super::checkpoint::validate_run_id(&run_id)?;
    let store = FileStore::new(&opts.state_dir);
    // Makes the run's directory durably (fsyncs): on the blocking pool.
    let lock = {
        let (store, id) = (store.clone(), run_id.clone());
        super::checkpoint::off_runtime("cannot lock", store.run_dir(&run_id), move || {
            RunLock::acquire(&store, &id)
        })
        .await?
    };
    if store.exists(&run_id) {
        return Err(AgentError::RunExists(run_id));
    }
    // In this order, so that a failure leaves nothing behind that no one knows of: the prompt
    // is checked before anything exists; the run is on disk before its sandbox exists (a
    // resume of a run whose sandbox was never made makes it); a sandbox that cannot be
    // prepared is destroyed.
    let counter = TokenCounter::for_model(&spec.model);
    let ctx = ContextManager::new(
        context_config(&spec, &opts),
        counter,
        &instructions(spec.verify.is_some()),
        &spec.task,
        tool_wire(),
    );
    ctx.check_fits()?;
    let trace_id = format!("{:032x}", rand::random::<u128>());
    let ck = Checkpoint {
        run_id: run_id.clone(),
        trace_id,
        spec: spec.clone(),
        step: 0,
        state: LoopState::Idle,
        context: ctx.state().clone(),
        budget: BudgetUsed::default(),
        pending: None,
        sandbox_id: String::new(),
        snapshot_id: None,
        unsnapshotted_steps: Vec::new(),
        auto_snapshots: Vec::new(),
        detector: Default::default(),
        exec_ids: BTreeMap::new(),
        rejected_finishes: 0,
        sessions: 0,
        outcome: None,
        has_bash: false,
        subtask_check: None,
        background_execs: Vec::new(),
        keep_sandbox_secs: opts.keep_sandbox.map(|d| d.as_secs()),
        sandbox_removed: false,
        operator: Vec::new(),
        stop_requested: None,
    };
    let mut agent = Agent::assemble(
        sandbox,
        llm,
        opts,
        store,
        ck,
        ctx,
        String::new(),
        Some(lock),
    )?;
    agent.trace_event(
        "start",
        json!({"task": spec.task, "model": spec.model, "tokenizer": agent.ctx.counter().name()}),
    );
    agent.writer.write_now(agent.checkpoint()).await?;
    if let Some(sink) = &agent.opts.started {
        agent.progress_to(sink, "started".into());
    }
    agent.make_sandbox().await?;
    Ok(agent.run().await)
}

/// Picks up a run from its checkpoint and drives it to its end. `make_llm` builds the provider
/// for the model the run was started with.
pub async fn resume<S: SandboxApi + Clone + 'static>(
    sandbox: S,
    make_llm: impl FnOnce(&RunSpec) -> Result<Arc<dyn LlmProvider>, LlmError>,
    run_id: &str,
    opts: RunOptions,
) -> Result<RunReport, AgentError> {
    let store = FileStore::new(&opts.state_dir);
    let lock = RunLock::acquire_existing(&store, run_id)?;
    let mut ck = store.load(run_id)?;
    let mut extended = Vec::new();
    if let Some(outcome) = ck.outcome.clone() {
        let stopped = outcome.reason.status() == RunStatus::Stopped;
        if stopped && opts.new_budgets.any() {
            // A deliberate stop, continued on purpose with new budgets.
            extended = opts.new_budgets.apply(&mut ck.spec);
            ck.budget.warned.clear();
            ck.context.pinned.remove("budget");
            if outcome.reason == StopReason::NoProgress {
                ck.detector = Default::default();
            }
        } else if !outcome.reason.resumable() {
            // Nothing to do: report how it ended, unchanged.
            return Ok(report_of(&ck, &store, &[], &[]));
        }
    }
    if ck.spec.task.trim().is_empty() || ck.spec.max_steps == 0 {
        return Err(AgentError::CannotResume {
            run_id: run_id.into(),
            reason: "the checkpoint's task is empty or has no step budget".into(),
        });
    }
    // A run whose sandbox was never made (or was destroyed when it could not be prepared)
    // has taken no step; its resume makes the sandbox. Steps without a sandbox are damage.
    if ck.sandbox_id.is_empty() && (ck.step > 0 || ck.pending.is_some()) {
        return Err(AgentError::CannotResume {
            run_id: run_id.into(),
            reason: "the checkpoint names no sandbox".into(),
        });
    }
    let llm = make_llm(&ck.spec)?;
    if let Some(keep) = opts.keep_sandbox {
        ck.keep_sandbox_secs = Some(keep.as_secs());
    }
    ck.sessions += 1;
    ck.outcome = None;
    let counter = TokenCounter::for_model(&ck.spec.model);
    let ctx = ContextManager::restore(
        context_config(&ck.spec, &opts),
        counter,
        tool_wire(),
        ck.context.clone(),
    );
    let mut agent = Agent::assemble(
        sandbox,
        llm,
        opts,
        store,
        ck,
        ctx,
        String::new(),
        Some(lock),
    )?;
    agent.trace_event("resume", json!({"session": agent.ck.sessions, "pending": agent.ck.pending.as_ref().map(|p| p.action.describe()), "budgets": extended}));
    if !extended.is_empty() {
        agent.ctx.pin(
            "budgets extended",
            &format!(
                "the run was stopped and continued with new budgets: {}",
                extended.join(", ")
            ),
        );
    }
    agent.reconcile().await?;
    Ok(agent.run().await)
}

/// Milliseconds since the epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Removes the sandboxes of ended runs under `state_dir` whose keep time has passed, and
/// marks them removed in their checkpoints. Runs in use (locked), unreadable checkpoints and
/// runs without a keep time are left alone; a daemon error skips the run. Returns the
/// `(run id, sandbox id)` pairs removed.
pub async fn reap_finished_sandboxes<S: SandboxApi>(
    sandbox: &S,
    state_dir: &std::path::Path,
) -> Vec<(String, String)> {
    let store = FileStore::new(state_dir);
    let runs = store
        .run_dir("x")
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let Ok(entries) = std::fs::read_dir(&runs) else {
        return Vec::new();
    };
    let now = now_ms();
    let mut removed = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let Some(run_id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if super::checkpoint::validate_run_id(&run_id).is_err() {
            continue;
        }
        let Ok(ck) = store.load(&run_id) else {
            continue;
        };
        let due = match (&ck.outcome, ck.keep_sandbox_secs) {
            (Some(o), Some(keep)) if !ck.sandbox_removed => o
                .finished_at_ms
                .is_some_and(|at| at.saturating_add(keep.saturating_mul(1000)) <= now),
            _ => false,
        };
        if !due {
            continue;
        }
        // Not while a resume holds the run; reload under the lock.
        let Ok(_lock) = RunLock::acquire_existing(&store, &run_id) else {
            continue;
        };
        let Ok(mut ck) = store.load(&run_id) else {
            continue;
        };
        if ck.outcome.is_none() || ck.sandbox_removed {
            continue;
        }
        match sandbox.destroy(&ck.sandbox_id).await {
            Ok(()) => {}
            Err(e) if e.code() == tonic::Code::NotFound => {}
            Err(e) => {
                tracing::warn!(run = %run_id, sandbox = %ck.sandbox_id, error = %e, "cannot remove the sandbox of an ended run");
                continue;
            }
        }
        tracing::info!(run = %run_id, sandbox = %ck.sandbox_id, "removed the sandbox of an ended run after its keep time");
        ck.sandbox_removed = true;
        if let Err(e) = store.save_off_runtime(ck.clone()).await {
            tracing::warn!(run = %run_id, error = %e, "cannot mark the sandbox removed");
        }
        removed.push((run_id, ck.sandbox_id.clone()));
    }
    removed
}

/// Removes at once the sandbox of an ended run that took no step (it failed before its first
/// action, e.g. the model endpoint refused it): nothing in it is worth a day's keep, and a
/// resume makes a new one. The checkpoint is left naming no sandbox, as for a run that never
/// had one. Returns the sandbox removed, if any.
pub async fn remove_unused_sandbox<S: SandboxApi>(
    sandbox: &S,
    state_dir: &std::path::Path,
    run_id: &str,
) -> Result<Option<String>, AgentError> {
    let store = FileStore::new(state_dir);
    let _lock = RunLock::acquire_existing(&store, run_id)?;
    let mut ck = store.load(run_id)?;
    if ck.outcome.is_none()
        || ck.step > 0
        || ck.pending.is_some()
        || ck.sandbox_id.is_empty()
        || ck.sandbox_removed
    {
        return Ok(None);
    }
    match sandbox.destroy(&ck.sandbox_id).await {
        Ok(()) => {}
        Err(e) if e.code() == tonic::Code::NotFound => {}
        Err(source) => {
            return Err(AgentError::Daemon {
                what: format!("cannot remove sandbox {}", ck.sandbox_id),
                source,
            })
        }
    }
    let removed = std::mem::take(&mut ck.sandbox_id);
    store.save_off_runtime(ck).await?;
    Ok(Some(removed))
}

fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    if sorted_ms.is_empty() {
        return 0.0;
    }
    let idx = ((sorted_ms.len() as f64 - 1.0) * p).round() as usize;
    sorted_ms[idx.min(sorted_ms.len() - 1)]
}

fn report_of(
    ck: &Checkpoint,
    store: &FileStore,
    latencies: &[Duration],
    stalls: &[Duration],
) -> RunReport {
    let outcome = ck.outcome.clone().unwrap_or(Outcome {
        reason: StopReason::FatalError,
        answer: None,
        final_snapshot_id: None,
        diff: String::new(),
        summary: String::new(),
        error: Some("the run has no outcome".into()),
        finished_at_ms: None,
    });
    let run_dir = store.run_dir(&ck.run_id);
    let diff_path = run_dir.join("final.diff");
    let mut ms: Vec<f64> = latencies.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    RunReport {
        run_id: ck.run_id.clone(),
        status: outcome.reason.status(),
        reason: outcome.reason,
        steps: ck.step,
        prompt_tokens: ck.budget.prompt_tokens,
        completion_tokens: ck.budget.completion_tokens,
        sandbox_id: ck.sandbox_id.clone(),
        final_snapshot_id: outcome.final_snapshot_id.clone(),
        answer: outcome.answer.clone(),
        cost_usd: ck.spec.price.map(|_| ck.budget.cost_usd),
        elapsed_ms: ck.budget.elapsed_ms_before,
        summary: outcome.summary.clone(),
        diff: observe::cut_chars(&outcome.diff, REPORT_DIFF_CHARS),
        diff_path: diff_path.exists().then(|| diff_path.display().to_string()),
        trace_path: Some(run_dir.join("trace.jsonl").display().to_string()),
        error: outcome.error.clone(),
        resumable: outcome.reason.resumable(),
        checkpoint_ms_p50: percentile(&ms, 0.5),
        checkpoint_ms_p99: percentile(&ms, 0.99),
        checkpoint_stall_ms_max: stalls
            .iter()
            .map(|d| d.as_secs_f64() * 1000.0)
            .fold(0.0, f64::max),
    }
}

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        sandbox: S,
        llm: Arc<dyn LlmProvider>,
        opts: RunOptions,
        store: FileStore,
        ck: Checkpoint,
        ctx: ContextManager,
        workdir: String,
        lock: Option<RunLock>,
    ) -> Result<Self, AgentError> {
        let dir = store.run_dir(&ck.run_id);
        std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
            what: "cannot create",
            path: dir.clone(),
            source,
        })?;
        let trace = Trace::open(
            &dir.join("trace.jsonl"),
            &ck.trace_id,
            &ck.run_id,
            ck.sessions,
        )?;
        let budget = Budget::new(limits_of(&ck.spec), ck.budget.clone());
        let detector = Detector::new(opts.detector, ck.detector.clone());
        Ok(Agent {
            sandbox,
            llm,
            writer: Writer::new(Arc::new(store.clone()) as Arc<dyn CheckpointStore>),
            store,
            trace,
            ctx,
            budget,
            detector,
            breakers: Breakers::new(opts.breaker_threshold, opts.breaker_cooldown),
            llm_breaker: Breakers::new(opts.llm_breaker_threshold, opts.llm_breaker_cooldown),
            llm_outage: None,
            bucket: TokenBucket::new(opts.rate_burst, opts.rate_per_sec),
            workdir,
            state: ck.state,
            ck,
            session_start: Instant::now(),
            retry: None,
            llm_attempt: 0,
            act_attempt: 0,
            reasks: 0,
            completion_limit: None,
            step_tokens: 0,
            last_obs: None,
            stop: None,
            answer: None,
            opts,
            _lock: lock,
        })
    }

    // ---- bookkeeping -------------------------------------------------------------------

    /// The checkpoint as of now.
    fn checkpoint(&self) -> Checkpoint {
        let mut ck = self.ck.clone();
        ck.state = self.state;
        ck.context = self.ctx.state().clone();
        ck.budget = self.budget.used.clone();
        ck.budget.elapsed_ms_before += self.session_start.elapsed().as_millis() as u64;
        ck.detector = self.detector.state().clone();
        ck
    }

    /// Tells the human watching, if any.
    fn progress(&self, line: String) {
        if let Some(sink) = &self.opts.progress {
            self.progress_to(sink, line);
        }
    }

    fn progress_to(&self, sink: &ProgressSink, line: String) {
        (sink.0)(&Progress {
            run_id: self.ck.run_id.clone(),
            step: self.ck.step,
            max_steps: self.ck.spec.max_steps,
            tokens: self.budget.used.tokens(),
            max_tokens: self.ck.spec.max_tokens,
            elapsed_ms: self
                .budget
                .elapsed(self.session_start.elapsed())
                .as_millis() as u64,
            line,
        });
    }

    fn trace_event(&mut self, kind: &str, fields: Value) {
        let state = self.state.to_string();
        self.trace.event(kind, self.ck.step, &state, fields);
    }

    fn go(&mut self, to: LoopState, why: &str) -> Result<(), AgentError> {
        let from = self.state;
        self.state = from.check(to)?;
        tracing::debug!(run = %self.ck.run_id, step = self.ck.step, %from, %to, why, "transition");
        self.trace_event(
            "transition",
            json!({"from": from.to_string(), "to": to.to_string(), "why": why}),
        );
        Ok(())
    }

    fn halt(&mut self, reason: StopReason, detail: impl Into<String>) -> Result<(), AgentError> {
        let detail = detail.into();
        tracing::info!(run = %self.ck.run_id, %reason, %detail, "stopping");
        self.trace_event(
            "decision",
            json!({"decision": "stop", "reason": reason.as_str(), "detail": detail}),
        );
        self.stop = Some((reason, detail));
        let to = if reason == StopReason::Finished {
            LoopState::Done
        } else {
            LoopState::Failed
        };
        self.go(to, reason.as_str())
    }

    fn abs_path(&self, path: &str) -> String {
        if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("{}/{}", self.workdir.trim_end_matches('/'), path)
        }
    }

    fn shell(&self) -> &'static str {
        if self.ck.has_bash {
            "bash"
        } else {
            "sh"
        }
    }

    /// An exec retried on transient daemon errors. With a key, a retry cannot run the command
    /// twice; without one the command must be read-only.
    async fn exec(&mut self, request: ExecRequest) -> Result<ExecResult, crate::Error> {
        let mut attempt = 0;
        loop {
            match self.sandbox.exec(request.clone()).await {
                Ok(r) => return Ok(r),
                Err(e) if classify(Op::Exec, &e) == Class::Transient => {
                    attempt += 1;
                    match self.opts.backoff.delay(attempt, None) {
                        Some(d) => {
                            tracing::warn!(error = %e, attempt, delay_ms = d.as_millis() as u64, "daemon call failed; retrying");
                            self.trace_event("retry", json!({"what": "exec", "attempt": attempt, "delay_ms": d.as_millis() as u64, "error": e.to_string()}));
                            tokio::time::sleep(d).await;
                        }
                        None => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn sh_request(&self, command: &str, key: String, timeout: Duration) -> ExecRequest {
        ExecRequest {
            idempotency_key: key,
            // Never 0: the daemon reads 0 as "the sandbox's default".
            timeout_ms: (timeout.as_millis() as u64).max(1),
            ..crate::exec_request(self.ck.sandbox_id.as_str(), [self.shell(), "-c", command])
        }
    }

    /// Creates the run's sandbox (labelled with the run), records it in the checkpoint and
    /// prepares it. A sandbox that cannot be prepared or recorded is destroyed again, and the
    /// checkpoint names none, so a resume starts over here.
    async fn make_sandbox(&mut self) -> Result<(), AgentError> {
        let isolation = match self.ck.spec.isolation.as_str() {
            "process" => Isolation::Process,
            "container" => Isolation::Container,
            "microvm" => Isolation::Microvm,
            _ => Isolation::Unspecified,
        };
        let created = self
            .sandbox
            .create(CreateSandboxRequest {
                isolation: isolation as i32,
                image: self.ck.spec.image.clone(),
                labels: [(RUN_LABEL.to_owned(), self.ck.run_id.clone())]
                    .into_iter()
                    .collect(),
                ..Default::default()
            })
            .await
            .map_err(|source| AgentError::Daemon {
                what: "cannot create the run's sandbox".into(),
                source,
            })?;
        self.ck.sandbox_id = created.id.clone();
        self.workdir = if created.workdir.is_empty() {
            "/workspace".to_owned()
        } else {
            created.workdir
        };
        self.trace_event("sandbox", json!({"sandbox_id": created.id}));
        let prepared = match self.prepare_sandbox().await {
            Ok(()) => self
                .writer
                .write_now(self.checkpoint())
                .await
                .map_err(AgentError::from),
            Err(e) => Err(e),
        };
        if let Err(e) = prepared {
            if let Err(d) = self.sandbox.destroy(&created.id).await {
                tracing::warn!(sandbox = %created.id, error = %d, "cannot destroy the sandbox of a run that could not start");
            }
            self.ck.sandbox_id.clear();
            self.ck.snapshot_id = None;
            if let Err(w) = self.writer.write_now(self.checkpoint()).await {
                tracing::warn!(error = %w, "cannot record that the run has no sandbox");
            }
            return Err(e);
        }
        Ok(())
    }

    /// First session only: find the shell, copy the workspace as the diff base, snapshot.
    async fn prepare_sandbox(&mut self) -> Result<(), AgentError> {
        let probe = format!(
            "command -v bash >/dev/null 2>&1 && echo bash; mkdir -p {AGENT_DIR}/base {AGENT_DIR}/spill && cp -a {}/. {AGENT_DIR}/base/ 2>/dev/null; true",
            tools::shell_quote(&self.workdir)
        );
        let req = ExecRequest {
            idempotency_key: idempotency_key(&self.ck.run_id, 0, 0, "prepare"),
            ..crate::exec_request(self.ck.sandbox_id.as_str(), ["sh", "-c", probe.as_str()])
        };
        let r = self.exec(req).await.map_err(|source| AgentError::Daemon {
            what: "cannot prepare the sandbox".into(),
            source,
        })?;
        self.ck.has_bash = String::from_utf8_lossy(&r.stdout).contains("bash");
        let snap = self
            .sandbox
            .snapshot(
                &self.ck.sandbox_id,
                &format!("agent-{}-base", self.ck.run_id),
            )
            .await
            .map_err(|source| AgentError::Daemon {
                what: "cannot snapshot the sandbox".into(),
                source,
            })?;
        self.ck.snapshot_id = Some(snap.snapshot_id);
        self.ck.unsnapshotted_steps.clear();
        Ok(())
    }

    // ---- the loop ----------------------------------------------------------------------

    /// Drives the state machine to a terminal state, then salvages and reports.
    pub async fn run(mut self) -> RunReport {
        while !self.state.is_terminal() {
            let result = match self.state {
                LoopState::Idle => self.go(LoopState::Thinking, "start"),
                LoopState::Thinking => self.think().await,
                LoopState::Acting => self.act().await,
                LoopState::Observing => self.observe_step().await,
                LoopState::Verifying => self.verify().await,
                LoopState::Retrying => self.wait_retry().await,
                LoopState::Done | LoopState::Failed => Ok(()),
            };
            if let Err(e) = result {
                tracing::error!(run = %self.ck.run_id, error = %e, "fatal error");
                let message = e.to_string();
                if let Err(e2) = self.halt(StopReason::FatalError, message) {
                    // Only an illegal transition can fail here, which would be a bug; force
                    // the terminal state rather than loop forever.
                    tracing::error!(error = %e2, "forcing FAILED");
                    self.state = LoopState::Failed;
                }
            }
        }
        self.salvage().await
    }

    /// THINKING: one model turn. Within the budgets, a prompt that fits the window, through
    /// the endpoint's breaker; then the reply becomes the pending action, or a re-ask.
    async fn think(&mut self) -> Result<(), AgentError> {
        // A boundary: the operator's requests are taken before the prompt is built, so a
        // steer is in this very prompt.
        if self.operator_boundary().await? {
            return Ok(());
        }
        if let Some((reason, detail)) = self.check_budgets() {
            return self.halt(reason, detail);
        }
        let request = self.build_prompt().await?;
        let counted = self.ctx.prompt_tokens();
        if let Some(gated) = self.endpoint_gate() {
            return gated;
        }
        let limit = request.max_tokens.unwrap_or_default();
        let (response, latency_ms) = match self.call_model(&request, counted).await {
            Ok(r) => r,
            Err(e) => return self.model_failed(e).await,
        };
        self.record_usage(&response, counted, latency_ms);
        self.take_reply(response, limit, counted)
    }

    /// Step 1 of a turn: the task budgets. A stop reason, or nothing (a warning is pinned).
    fn check_budgets(&mut self) -> Option<(StopReason, String)> {
        match self
            .budget
            .check(self.ck.step, self.session_start.elapsed())
        {
            Verdict::Stop(reason, detail) => Some((reason, detail)),
            Verdict::Warn(text) => {
                self.trace_event(
                    "decision",
                    json!({"decision": "budget_warning", "detail": text}),
                );
                self.ctx.pin("budget", &text);
                None
            }
            Verdict::Ok => None,
        }
    }

    /// Step 2: the prompt, compacted when due and repaired down to what fits the window with
    /// room for the answer.
    async fn build_prompt(&mut self) -> Result<ChatRequest, AgentError> {
        self.ctx.next_turn();
        if self.ctx.needs_compaction() {
            // Hysteresis: the model summarizes at most every other turn; in between, and
            // whenever a summary left the prompt above the trigger, the manager folds harder.
            if self.ctx.may_summarize() {
                self.compact(false).await?;
            }
            let trigger = self.ctx.trigger_tokens();
            self.fit_context(trigger.saturating_sub(1), "above_trigger");
        }
        let limit = match self.completion_limit {
            Some(cap) => self.budget.call_completion_tokens_up_to(cap),
            None => self.budget.call_completion_tokens(),
        };
        // Whatever the state (a resumed checkpoint included), never send a prompt that
        // cannot fit with room for the answer.
        let window = self.ctx.window();
        let hard = window
            .saturating_sub((limit as usize).min(window / 2))
            .saturating_sub(PROMPT_MARGIN_TOKENS);
        self.fit_context(hard, "over_window");
        Ok(ChatRequest {
            messages: self.ctx.render(),
            tools: self.ctx.tools().to_vec(),
            max_tokens: Some(limit),
        })
    }

    /// Step 3: while the endpoint's breaker is open the turn waits out its cooldown (within
    /// the patience) instead of calling; `Some` is the transition taken instead of the call.
    /// Closed or half-open, the call goes through (half-open: as the probe).
    fn endpoint_gate(&mut self) -> Option<Result<(), AgentError>> {
        let now = Instant::now();
        let Some(open_for) = self.llm_breaker.open_for(LLM_BREAKER, now) else {
            let _ = self.llm_breaker.allow(LLM_BREAKER, now);
            return None;
        };
        let spent = self.llm_outage.map_or(Duration::ZERO, |t| t.elapsed());
        let left = self
            .opts
            .llm_backoff
            .patience
            .map_or(Duration::MAX, |p| p.saturating_sub(spent));
        if left.is_zero() {
            return Some(self.halt(
                StopReason::FatalError,
                format!(
                    "the model endpoint has been failing for {}s ({} attempts)",
                    spent.as_secs(),
                    self.llm_attempt
                ),
            ));
        }
        self.trace_event(
            "decision",
            json!({"decision": "llm_breaker_open", "retry_in_ms": open_for.as_millis() as u64}),
        );
        self.retry = Some(RetryPlan {
            attempt: self.llm_attempt,
            delay: open_for.min(left),
            then: LoopState::Thinking,
        });
        Some(self.go(LoopState::Retrying, "model endpoint breaker open"))
    }

    /// Step 4: the call, within the rate limit; a success closes the outage.
    async fn call_model(
        &mut self,
        request: &ChatRequest,
        counted: usize,
    ) -> Result<(super::llm::ChatResponse, u64), LlmError> {
        self.bucket.take().await;
        let started = Instant::now();
        let result = self.llm.complete(request).await;
        let latency = started.elapsed().as_millis() as u64;
        match &result {
            Ok(_) => {
                self.llm_attempt = 0;
                self.llm_outage = None;
                self.llm_breaker.record(LLM_BREAKER, true, Instant::now());
            }
            Err(e) => {
                self.trace_event("llm_call", json!({"purpose": "step", "counted_prompt_tokens": counted, "latency_ms": latency, "error": e.to_string()}));
            }
        }
        result.map(|r| (r, latency))
    }

    /// Step 5: tokens counted against the budgets: the endpoint's counts, or ours where it
    /// gives none.
    fn record_usage(
        &mut self,
        response: &super::llm::ChatResponse,
        counted: usize,
        latency_ms: u64,
    ) {
        let usage = response.usage.unwrap_or_default();
        let completion_counted = self.ctx.counter().count(
            &(response.content.clone()
                + &response
                    .tool_calls
                    .iter()
                    .map(|c| c.function.arguments.clone())
                    .collect::<String>()),
        );
        let prompt = if usage.prompt_tokens > 0 {
            usage.prompt_tokens
        } else {
            counted as u64
        };
        let completion = if usage.completion_tokens > 0 {
            usage.completion_tokens
        } else {
            completion_counted as u64
        };
        self.budget.record_call(prompt, completion);
        self.step_tokens = self
            .step_tokens
            .saturating_add(prompt.saturating_add(completion));
        self.trace_event(
            "llm_call",
            json!({
                "purpose": "step",
                "prompt_tokens": prompt,
                "counted_prompt_tokens": counted,
                "completion_tokens": completion,
                "latency_ms": latency_ms,
                "finish_reason": response.finish_reason,
                "tool_calls": response.tool_calls.len(),
            }),
        );
    }

    /// Step 6: the reply. A cut-off reply or one without a usable call is re-asked; a call is
    /// parsed (and repaired) into the pending action.
    fn take_reply(
        &mut self,
        response: super::llm::ChatResponse,
        limit: u32,
        counted: usize,
    ) -> Result<(), AgentError> {
        if response.finish_reason == "length" {
            // Whatever the reply holds is a prefix: a repaired half call would run a cut
            // command or write half a file. Never act on it.
            return self.cut_off(&response, limit, counted);
        }
        let Some(call) = response.tool_calls.first().cloned() else {
            let text = if response.content.trim().is_empty() {
                "(empty answer)".to_owned()
            } else {
                response.content.clone()
            };
            let assistant = Message {
                role: "assistant".into(),
                content: Some(text),
                ..Default::default()
            };
            let error = Message::user("Your answer did not call a tool. Respond with exactly one tool call; call finish(answer) when the task is done.");
            return self.reask(assistant, error, "no tool call");
        };
        match tools::parse_call(&call.function.name, &call.function.arguments) {
            Err(e) => {
                let assistant =
                    Message::assistant_call(call.clone(), Some(response.content.clone()));
                let error = Message::tool(&call.id, reask_text(&e));
                self.reask(assistant, error, &e.to_string())
            }
            Ok(parsed) => {
                if !parsed.repairs.is_empty() {
                    tracing::info!(repairs = ?parsed.repairs, "repaired a tool call");
                    self.trace_event(
                        "decision",
                        json!({"decision": "repaired_call", "repairs": parsed.repairs}),
                    );
                }
                self.reasks = 0;
                self.completion_limit = None;
                let repaired = ToolCall {
                    id: call.id.clone(),
                    kind: "function".into(),
                    function: super::llm::FunctionCall {
                        name: parsed.action.tool().into(),
                        arguments: action_arguments(&parsed.action),
                    },
                };
                let step = self.ck.step + 1;
                // The prompt this call answers carried every pinned steer.
                self.acknowledge_steers(step);
                let verifying = matches!(parsed.action, Action::Finish { .. });
                self.ck.pending = Some(PendingAction {
                    step,
                    call_id: repaired.id.clone(),
                    call_name: repaired.function.name.clone(),
                    call_arguments: repaired.function.arguments.clone(),
                    action: parsed.action,
                    idempotency_key: idempotency_key(
                        &self.ck.run_id,
                        step,
                        0,
                        if verifying { "verify" } else { "act" },
                    ),
                    attempt: 0,
                    verifying,
                    reasoning: observe::cut_chars(response.content.trim(), TRACE_REASONING_CHARS),
                    expect_sha256: None,
                });
                if verifying {
                    self.go(LoopState::Verifying, "finish called")
                } else {
                    self.go(LoopState::Acting, "tool call")
                }
            }
        }
    }

    /// A reply cut off by the completion limit (`finish_reason: "length"`): nothing of it is
    /// executed; the model is told and asked again, with a larger limit where the window and
    /// the token budget allow (doubling, up to 8 times the configured limit).
    fn cut_off(
        &mut self,
        response: &super::llm::ChatResponse,
        limit: u32,
        prompt_tokens: usize,
    ) -> Result<(), AgentError> {
        // The answer may take at most half the window: the prompt needs the rest.
        let window = self.ctx.window();
        let room = window
            .saturating_sub(prompt_tokens)
            .saturating_sub(PROMPT_MARGIN_TOKENS)
            .min(window / 2)
            .min(u32::MAX as usize) as u32;
        let ceiling = self.budget.limits.call_completion_tokens.saturating_mul(8);
        let next = self.budget.call_completion_tokens_up_to(
            limit.saturating_mul(2).min(room).min(ceiling).max(limit),
        );
        if next > limit {
            self.completion_limit = Some(next);
        }
        let call = response.tool_calls.first();
        self.trace_event(
            "decision",
            json!({"decision": "cut_off_reply", "tool": call.map(|c| c.function.name.clone()), "limit": limit, "next_limit": next}),
        );
        tracing::warn!(
            limit,
            next,
            "the model's reply was cut off by the completion limit; not executed"
        );
        let what = call.map_or_else(
            || "your reply".to_owned(),
            |c| format!("your call to {}", c.function.name),
        );
        let raised = if next > limit {
            format!(" Your next reply may use up to {next} tokens.")
        } else {
            String::new()
        };
        let text = format!(
            "ERROR: {what} was cut off at the completion limit of {limit} tokens, so it was NOT executed (nothing was run or written).{raised} Send the call again, complete. Keep each call short: write a large file in parts (write_file for the first part, then bash `cat >> FILE <<'EOF'` for the rest)."
        );
        let (assistant, error) = match call {
            Some(c) => {
                // Keep the cut call out of the history in full: valid JSON, a short prefix.
                let mut shown = c.clone();
                shown.function.arguments =
                    json!({"cut_off_arguments": observe::cut_chars(&c.function.arguments, 200)})
                        .to_string();
                (
                    Message::assistant_call(shown, Some(response.content.clone())),
                    Message::tool(&c.id, text),
                )
            }
            None => (
                Message {
                    role: "assistant".into(),
                    content: Some(observe::cut_chars(&response.content, 2_000)),
                    ..Default::default()
                },
                Message::user(text),
            ),
        };
        self.reask(assistant, error, "reply cut off by the completion limit")
    }

    fn reask(&mut self, assistant: Message, error: Message, why: &str) -> Result<(), AgentError> {
        self.reasks += 1;
        self.trace_event(
            "decision",
            json!({"decision": "reask", "attempt": self.reasks, "detail": why}),
        );
        if self.reasks > self.opts.max_reasks {
            return self.halt(
                StopReason::MalformedOutput,
                format!(
                    "the model's answer could not be used after {} re-asks: {why}",
                    self.opts.max_reasks
                ),
            );
        }
        if self.step_tokens > self.budget.limits.step_tokens {
            return self.halt(
                StopReason::MalformedOutput,
                format!(
                    "the step spent {} tokens on re-asks (step budget {})",
                    self.step_tokens, self.budget.limits.step_tokens
                ),
            );
        }
        self.ctx.set_reask(assistant, error);
        self.go(LoopState::Thinking, "re-ask")
    }

    async fn model_failed(&mut self, e: LlmError) -> Result<(), AgentError> {
        match e {
            LlmError::Retryable {
                message,
                retry_after,
            } => {
                self.llm_attempt += 1;
                let began = *self.llm_outage.get_or_insert_with(Instant::now);
                self.llm_breaker.record(LLM_BREAKER, false, Instant::now());
                match self.opts.llm_backoff.delay_within(
                    self.llm_attempt,
                    retry_after,
                    began.elapsed(),
                ) {
                    Some(delay) => {
                        self.retry = Some(RetryPlan {
                            attempt: self.llm_attempt,
                            delay,
                            then: LoopState::Thinking,
                        });
                        self.go(LoopState::Retrying, &message)
                    }
                    None => self.halt(
                        StopReason::FatalError,
                        format!(
                            "the model endpoint kept failing for {}s ({} attempts): {message}",
                            began.elapsed().as_secs(),
                            self.llm_attempt
                        ),
                    ),
                }
            }
            LlmError::ContextTooLong(message) => {
                // The endpoint counts more tokens than we do: use less of the window from now
                // on (kept in the checkpoint, so a resume does the same); the next turn
                // repairs the prompt down to it.
                self.llm_attempt += 1;
                if self.llm_attempt > MAX_CONTEXT_REPAIRS || !self.ctx.shrink_window() {
                    return self.halt(
                        StopReason::FatalError,
                        format!("the prompt does not fit the model even with only the task, instructions and pinned facts: {message}"),
                    );
                }
                self.trace_event("decision", json!({"decision": "window_shrunk", "window": self.ctx.window(), "detail": message}));
                self.retry = Some(RetryPlan {
                    attempt: self.llm_attempt,
                    delay: Duration::ZERO,
                    then: LoopState::Thinking,
                });
                self.go(LoopState::Retrying, "prompt too long: window shrunk")
            }
            other => self.halt(StopReason::FatalError, other.to_string()),
        }
    }

    async fn wait_retry(&mut self) -> Result<(), AgentError> {
        let Some(plan) = self.retry.take() else {
            return self.go(LoopState::Thinking, "retry");
        };
        self.trace_event(
            "retry",
            json!({"attempt": plan.attempt, "delay_ms": plan.delay.as_millis() as u64}),
        );
        if plan.delay >= Duration::from_secs(1) {
            self.progress(format!(
                "waiting {:.0}s before retry {} ({})",
                plan.delay.as_secs_f64(),
                plan.attempt,
                if plan.then == LoopState::Thinking {
                    "model endpoint"
                } else {
                    "daemon"
                }
            ));
        }
        // The wait is a boundary too: a stop does not wait for an outage to end.
        let until = Instant::now() + plan.delay;
        loop {
            if self.operator_boundary().await? {
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            tokio::time::sleep(left.min(OPERATOR_POLL)).await;
        }
        self.go(plan.then, "retry")
    }

    /// Repairs the context down to `limit` tokens without the model when it is above, and
    /// says so in the trace.
    fn fit_context(&mut self, limit: usize, why: &str) {
        let before = self.ctx.prompt_tokens();
        if before <= limit {
            return;
        }
        let stages = self.ctx.shrink_to(limit);
        let after = self.ctx.prompt_tokens();
        tracing::info!(before, after, limit, ?stages, why, "context repaired");
        self.trace_event(
            "decision",
            json!({"decision": "context_repaired", "why": why, "stages": stages, "tokens_before": before, "tokens_after": after, "limit": limit}),
        );
    }

    /// Summarizes the middle of the working layer. Returns whether anything was compacted.
    async fn compact(&mut self, force: bool) -> Result<bool, AgentError> {
        let Some(plan) = self.ctx.plan_compaction(force) else {
            return Ok(false);
        };
        let before = self.ctx.prompt_tokens();
        // Around each compaction: the state before is durable, so a crash while summarizing
        // loses nothing.
        self.writer.write_now(self.checkpoint()).await?;
        let started = Instant::now();
        let answer = if self.llm_breaker.is_open(LLM_BREAKER, Instant::now()) {
            Err(LlmError::Retryable {
                message: "the model endpoint's breaker is open".into(),
                retry_after: None,
            })
        } else {
            self.bucket.take().await;
            let r = self.llm.complete(&plan.request).await;
            self.llm_breaker
                .record(LLM_BREAKER, r.is_ok(), Instant::now());
            r
        };
        let summary = match answer {
            Ok(r) => {
                let usage = r.usage.unwrap_or_default();
                self.budget
                    .record_call(usage.prompt_tokens, usage.completion_tokens);
                self.step_tokens = self
                    .step_tokens
                    .saturating_add(usage.prompt_tokens.saturating_add(usage.completion_tokens));
                self.trace_event("llm_call", json!({"purpose": "summary", "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens, "latency_ms": started.elapsed().as_millis() as u64}));
                Some(r.content)
            }
            Err(e) => {
                tracing::warn!(error = %e, "summarization failed; using the deterministic summary");
                self.trace_event("llm_call", json!({"purpose": "summary", "error": e.to_string(), "latency_ms": started.elapsed().as_millis() as u64}));
                None
            }
        };
        self.ctx.apply_compaction(&plan, summary);
        // Hysteresis: a compaction ends below the trigger, or the manager folds harder now,
        // so the next turn does not summarize again.
        let trigger = self.ctx.trigger_tokens();
        self.fit_context(trigger.saturating_sub(1), "after_summary");
        let after = self.ctx.prompt_tokens();
        self.trace_event("compaction", json!({"from_step": plan.from_step, "to_step": plan.to_step, "steps": plan.steps, "tokens_before": before, "tokens_after": after}));
        self.writer.write_now(self.checkpoint()).await?;
        Ok(true)
    }

    async fn act(&mut self) -> Result<(), AgentError> {
        // A boundary: an action chosen while a stop was on its way is not sent.
        if self.operator_boundary().await? {
            return Ok(());
        }
        // The step before is durable (its write overlapped the model call), and the pending
        // action is durable before it is sent.
        self.writer.write_now(self.checkpoint()).await?;
        let Some(pending) = self.ck.pending.clone() else {
            return self.go(LoopState::Failed, "no pending action");
        };
        let tool = pending.action.tool();
        self.trace_event("action", json!({"action": pending.action.describe(), "key": pending.idempotency_key, "attempt": pending.attempt}));
        if let Err(e) = self.breakers.allow(tool, Instant::now()) {
            self.last_obs = Some(Observation::error(format!("NOT RUN: {e}")));
            return self.go(LoopState::Observing, "breaker open");
        }
        let (obs, tool_ok) = match self.execute(&pending).await {
            Ok(obs) if obs.lost && pending.attempt < 2 => {
                return self.exec_lost(&pending, obs).await
            }
            Ok(obs) => (obs, true),
            Err(e) => match self.action_failed(&pending, e).await? {
                Some(answer) => answer,
                // Retrying.
                None => return Ok(()),
            },
        };
        self.act_attempt = 0;
        let mut obs = obs;
        // One cap for every tool's result, whatever produced it.
        let (text, cut) = observe::cap(&obs.text, self.opts.observe);
        if cut {
            obs.text = text;
            obs.truncated = true;
        }
        if tool != "bash" {
            // bash judged its own outcome (a timeout counts against it); others got here
            // because the daemon answered — a refusal counts against the tool.
            self.breakers.record(tool, tool_ok, Instant::now());
        }
        self.last_obs = Some(obs);
        self.go(LoopState::Observing, "action done")
    }

    /// A daemon error of the pending action, by its class ([`classify`]): `Some` with the
    /// observation for the model (and whether the tool itself worked), `None` when the loop
    /// retries, `Err` when the run cannot go on.
    async fn action_failed(
        &mut self,
        pending: &PendingAction,
        e: OpError,
    ) -> Result<Option<(Observation, bool)>, AgentError> {
        let class = match e.class() {
            // A NOT_FOUND of a call that names a file, exec or snapshot: which one is missing
            // is asked of the daemon, not read from its words.
            Class::TargetMissing => match self.sandbox_alive().await {
                Ok(true) => Class::TargetMissing,
                Ok(false) => Class::SandboxGone,
                Err(lookup) if lookup.class() == Class::Transient => Class::Transient,
                Err(lookup) => {
                    return Err(AgentError::Daemon {
                        what: format!("cannot look up sandbox {}", self.ck.sandbox_id),
                        source: lookup.source,
                    })
                }
            },
            other => other,
        };
        match class {
            Class::Transient => {
                // Sending the action again is safe: each tool's `Repeat` is honoured by
                // `execute` (keys replay an exec, a str_replace checks whether its write
                // landed, a snapshot is looked up before another is made).
                self.act_attempt += 1;
                match self.opts.backoff.delay(self.act_attempt, None) {
                    Some(delay) => {
                        self.retry = Some(RetryPlan {
                            attempt: self.act_attempt,
                            delay,
                            then: LoopState::Acting,
                        });
                        self.go(LoopState::Retrying, &format!("daemon unavailable: {e}"))?;
                        Ok(None)
                    }
                    None => Err(AgentError::Daemon {
                        what: format!(
                            "the daemon is unreachable after {} attempts",
                            self.act_attempt
                        ),
                        source: e.source,
                    }),
                }
            }
            Class::Credentials => Err(AgentError::Daemon {
                what: "the daemon refused the credentials".into(),
                source: e.source,
            }),
            Class::SandboxGone => Err(self.sandbox_gone(e)),
            // The model named something that is not there: the tool works.
            Class::TargetMissing => Ok(Some((self.refusal(&pending.action, &e), true))),
            Class::Refused => Ok(Some((self.refusal(&pending.action, &e), false))),
        }
    }

    /// An exec that ended LOST: the daemon died under it, and it may have run in part. When the
    /// last snapshot holds every step before it, the files go back to it and the action runs
    /// again under a new key, so a half-done effect cannot stack (the same recovery as a
    /// resume). When it does not (a step snapshot failed since), a rollback would erase those
    /// steps: nothing is rolled back or re-run, and the model is told.
    async fn exec_lost(
        &mut self,
        pending: &PendingAction,
        mut obs: Observation,
    ) -> Result<(), AgentError> {
        match self.ck.snapshot_id.clone() {
            Some(snap) if self.ck.unsnapshotted_steps.is_empty() => {
                self.sandbox
                    .rollback(&self.ck.sandbox_id, &snap)
                    .await
                    .map_err(|source| AgentError::Daemon {
                        what: format!("cannot roll back to snapshot {snap} after a lost exec"),
                        source,
                    })?;
                let mut p = pending.clone();
                p.attempt += 1;
                p.idempotency_key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "act");
                self.trace_event("decision", json!({"decision": "rollback_after_lost_exec", "snapshot": snap, "exec_id": obs.exec_id, "new_key": p.idempotency_key}));
                self.ck.pending = Some(p);
                self.retry = Some(RetryPlan {
                    attempt: 1,
                    delay: Duration::ZERO,
                    then: LoopState::Acting,
                });
                self.go(
                    LoopState::Retrying,
                    "exec lost: rolled back, running it again",
                )
            }
            snap => {
                let why = self.no_rollback_reason(snap.as_deref());
                self.trace_event("decision", json!({"decision": "lost_exec_not_rolled_back", "exec_id": obs.exec_id, "why": why}));
                obs.text = format!(
                    "{}\nThe command was interrupted (the daemon restarted under it) and may have run in part. It was NOT run again and nothing was rolled back: {why}. Check the state of the files, then decide.",
                    obs.text
                );
                obs.ok = false;
                obs.lost = false;
                self.act_attempt = 0;
                self.last_obs = Some(obs);
                self.go(LoopState::Observing, "exec lost; no safe rollback")
            }
        }
    }

    /// Why the sandbox cannot be put back to the state before the pending step.
    fn no_rollback_reason(&self, snapshot: Option<&str>) -> String {
        let steps: Vec<String> = self
            .ck
            .unsnapshotted_steps
            .iter()
            .map(u64::to_string)
            .collect();
        match snapshot {
            Some(snap) => format!(
                "the last snapshot ({snap}) is from before step{} {}, whose changes a rollback would erase",
                if steps.len() == 1 { "" } else { "s" },
                steps.join(", ")
            ),
            None => "there is no snapshot to go back to".into(),
        }
    }

    async fn observe_step(&mut self) -> Result<(), AgentError> {
        let Some(pending) = self.ck.pending.take() else {
            return self.go(LoopState::Thinking, "nothing to observe");
        };
        let obs = self
            .last_obs
            .take()
            .unwrap_or_else(|| Observation::error("no result was recorded"));
        self.ck.step = pending.step;
        self.step_tokens = 0;
        let action_line = pending.action.describe();
        let call = ToolCall {
            id: pending.call_id.clone(),
            kind: "function".into(),
            function: super::llm::FunctionCall {
                name: pending.call_name.clone(),
                arguments: history_arguments(&pending.call_arguments, obs.ok),
            },
        };
        if let Some(exec_id) = &obs.exec_id {
            self.ck.exec_ids.insert(pending.step, exec_id.clone());
        }
        if obs.ok {
            self.ctx.record_success(&action_line);
        } else {
            self.ctx
                .record_failure(pending.step, &action_line, &obs.headline());
        }
        self.trace_event(
            "step",
            json!({
                "action": action_line,
                "tool": pending.action.tool(),
                "exec_id": obs.exec_id,
                "exit_code": obs.exit_code,
                "result": if obs.ok { "ok" } else { "failed" },
                "truncated": obs.truncated,
                "reasoning": observe::cut_chars(&pending.reasoning, TRACE_REASONING_CHARS),
            }),
        );
        if is_background(&pending.action) && obs.ok {
            if let Some(id) = &obs.exec_id {
                self.ck.background_execs.push(id.clone());
            }
        }

        // Progress signals cost execs, so they are gathered only for a repeated action.
        let canonical = pending.action.canonical();
        let mut print = Detector::print(pending.step, &canonical, &obs.text, None);
        // The model saying it waits for something makes its repeated checks polls.
        print.waiting |= termination::plans_to_wait(&pending.reasoning);
        if self.detector.wants_probe(&canonical) {
            let probe = self.probe_progress().await;
            print.workspace = probe.workspace;
            print.activity = probe.activity;
            print.busy = probe.busy;
        }
        let verdict = self.detector.judge(print);
        let mut text = obs.text.clone();
        // Before the step is recorded, so a failed snapshot is in what the model sees of it.
        if let Some(warning) = self.snapshot_step(&pending.action).await? {
            text.push_str("\n\n");
            text.push_str(&warning);
        }
        if let termination::Verdict::Warning(w) = &verdict {
            self.trace_event(
                "decision",
                json!({"decision": "no_progress_warning", "detail": w}),
            );
            text.push_str("\n\n");
            text.push_str(w);
        }
        self.ctx.push_reasoned_step(
            pending.step,
            call,
            pending.reasoning.clone(),
            action_line,
            text,
            obs.exec_id.clone(),
            obs.ok,
        );
        self.progress(format!(
            "{} -> {}",
            pending.action.describe(),
            if obs.ok {
                "ok".to_owned()
            } else {
                observe::cut_chars(&obs.headline(), 80)
            }
        ));
        if let termination::Verdict::Stuck(stuck) = verdict {
            self.writer.start(self.checkpoint()).await?;
            return self.halt(StopReason::NoProgress, stuck.to_string());
        }
        // Durable before the next action; written while the model thinks.
        self.writer.start(self.checkpoint()).await?;
        self.go(LoopState::Thinking, "observed")
    }

    /// Progress signals after a repeated action: the workspace's content, processes in the
    /// sandbox (their CPU time), and the run's background execs (running, output size).
    async fn probe_progress(&mut self) -> Probe {
        let mut probe = Probe::default();
        let command = format!(
            "{}; {}",
            termination::probe_command(&self.workdir),
            termination::activity_probe_command()
        );
        let req = self.sh_request(&command, String::new(), Duration::from_secs(20));
        let mut activity = Vec::new();
        if let Ok(r) = self.exec(req).await {
            if verify::action_ok(&r) {
                let out = String::from_utf8_lossy(&r.stdout);
                let mut lines = out.lines();
                probe.workspace = lines.next().map(|l| l.trim().to_owned());
                activity.extend(lines.filter(|l| l.starts_with("proc ")).map(str::to_owned));
            }
        }
        let mut still_running = Vec::new();
        for id in std::mem::take(&mut self.ck.background_execs) {
            match self.sandbox.get_exec(&id, false).await {
                Ok(r) => {
                    let running = r.status == crate::proto::ExecStatus::Running as i32;
                    activity.push(format!(
                        "exec {id} {} {} {}",
                        r.status,
                        r.stdout_total_bytes.max(r.stdout.len() as u64),
                        r.stderr_total_bytes.max(r.stderr.len() as u64)
                    ));
                    if running {
                        probe.busy = true;
                        still_running.push(id);
                    }
                }
                Err(e) => {
                    tracing::debug!(exec = %id, error = %e, "cannot look at a background exec");
                }
            }
        }
        self.ck.background_execs = still_running;
        if !activity.is_empty() {
            activity.sort();
            probe.activity = Some(activity.join("\n"));
        }
        probe
    }

    /// Snapshots after a step that may have changed files, so a resume or a lost exec can roll
    /// back to it; keeps only the last two of these. A snapshot that fails is not hidden: the
    /// step is remembered as not in any snapshot (so no later rollback silently erases it)
    /// and the returned warning goes to the model with the step's result.
    async fn snapshot_step(&mut self, action: &Action) -> Result<Option<String>, AgentError> {
        if !action.may_mutate() {
            return Ok(None);
        }
        if !self.opts.snapshot_steps {
            self.ck.unsnapshotted_steps.push(self.ck.step);
            return Ok(None);
        }
        let name = format!("agent-{}-step-{}", self.ck.run_id, self.ck.step);
        match self.sandbox.snapshot(&self.ck.sandbox_id, &name).await {
            Ok(info) => {
                self.ck.snapshot_id = Some(info.snapshot_id.clone());
                self.ck.unsnapshotted_steps.clear();
                self.ck.auto_snapshots.push(info.snapshot_id);
                while self.ck.auto_snapshots.len() > 2 {
                    let old = self.ck.auto_snapshots.remove(0);
                    // Off the hot path: a snapshot left behind costs only disk.
                    let sandbox = self.sandbox.clone();
                    tokio::spawn(async move {
                        if let Err(e) = sandbox.delete_snapshot(&old).await {
                            tracing::debug!(snapshot = %old, error = %e, "cannot delete an old step snapshot");
                        }
                    });
                }
                Ok(None)
            }
            Err(e) if classify(Op::Snapshot, &e) == Class::SandboxGone => {
                Err(self.sandbox_gone(OpError::new(Op::Snapshot, e)))
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot snapshot after the step");
                self.ck.unsnapshotted_steps.push(self.ck.step);
                self.trace_event(
                    "decision",
                    json!({"decision": "snapshot_failed", "detail": e.to_string(), "unsnapshotted_steps": self.ck.unsnapshotted_steps}),
                );
                Ok(Some(format!(
                    "WARNING: the snapshot after this step failed ({e}). If a later command is interrupted, the files cannot be put back without losing this step's changes, so that will not be done automatically; snapshot yourself before a risky change."
                )))
            }
        }
    }

    async fn verify(&mut self) -> Result<(), AgentError> {
        if self.operator_boundary().await? {
            return Ok(());
        }
        if self.ctx.steers().iter().any(|s| s.acked_step.is_none()) {
            // A correction the model has not seen must not be overtaken by the end of the
            // run: the model gets it, and may finish again.
            return self.hold_finish().await;
        }
        self.writer.write_now(self.checkpoint()).await?;
        let Some(pending) = self.ck.pending.clone() else {
            return self.go(LoopState::Thinking, "nothing to verify");
        };
        let Action::Finish { answer } = pending.action.clone() else {
            return self.go(LoopState::Thinking, "not a finish");
        };
        let mut checks = Vec::new();
        if let Some(c) = self.ck.subtask_check.clone() {
            checks.push((Level::Subtask, c, "subtask-check"));
        }
        if let Some(c) = self.ck.spec.verify.clone() {
            checks.push((Level::Task, c, "verify"));
        }
        let mut rejection = None;
        for (level, command, what) in checks {
            let key = idempotency_key(&self.ck.run_id, pending.step, pending.attempt, what);
            let r = match self
                .exec(self.sh_request(&command, key, self.budget.limits.step_time))
                .await
            {
                Ok(r) => r,
                // The daemon or the sandbox cannot run it: not the model's doing.
                Err(e)
                    if matches!(
                        classify(Op::Exec, &e),
                        Class::Transient | Class::SandboxGone | Class::Credentials
                    ) =>
                {
                    return Err(AgentError::Daemon {
                        what: "cannot run the check".into(),
                        source: e,
                    })
                }
                Err(e) => {
                    rejection = Some((
                        format!("finish REJECTED: the check `{command}` could not run: {e}"),
                        None,
                    ));
                    break;
                }
            };
            let c = verify::judge(level, &command, &r);
            self.trace_event("verify", json!({"level": level, "command": command, "passed": c.passed, "actual": c.actual, "exec_id": c.exec_id}));
            if !c.passed {
                rejection = Some((c.rejection("finish"), Some(c.exec_id.clone())));
                break;
            }
            self.ctx.pin(
                &format!(
                    "verified ({})",
                    if level == Level::Task {
                        "task"
                    } else {
                        "subtask"
                    }
                ),
                &format!("`{command}` passed at step {}", pending.step),
            );
        }
        let call = ToolCall {
            id: pending.call_id.clone(),
            kind: "function".into(),
            function: super::llm::FunctionCall {
                name: pending.call_name.clone(),
                arguments: pending.call_arguments.clone(),
            },
        };
        self.ck.pending = None;
        self.ck.step = pending.step;
        match rejection {
            None => {
                self.ctx.push_reasoned_step(
                    pending.step,
                    call,
                    pending.reasoning.clone(),
                    pending.action.describe(),
                    "finish accepted".into(),
                    None,
                    true,
                );
                self.answer = Some(answer);
                self.halt(StopReason::Finished, "finish accepted")
            }
            Some((text, exec_id)) => {
                self.ck.rejected_finishes += 1;
                self.ctx
                    .record_failure(pending.step, "finish", "the task check failed");
                self.ctx.push_reasoned_step(
                    pending.step,
                    call,
                    pending.reasoning.clone(),
                    pending.action.describe(),
                    text,
                    exec_id,
                    false,
                );
                self.writer.start(self.checkpoint()).await?;
                if self.ck.rejected_finishes >= self.opts.max_rejected_finishes {
                    return self.halt(
                        StopReason::VerifyFailed,
                        format!(
                            "finish was rejected {} times by the check",
                            self.ck.rejected_finishes
                        ),
                    );
                }
                self.go(LoopState::Thinking, "finish rejected")
            }
        }
    }
}

/// What a progress probe found.
#[derive(Default)]
struct Probe {
    workspace: Option<String>,
    activity: Option<String>,
    busy: bool,
}

fn is_background(a: &Action) -> bool {
    matches!(
        a,
        Action::Bash {
            background: true,
            ..
        }
    )
}

/// Longest argument text of a failed call kept in the history.
const FAILED_CALL_ARGUMENT_CHARS: usize = 2_000;

/// A call's arguments as the history keeps them. A failed call changed nothing, and its
/// arguments (a refused 40 KB pin, a huge edit that did not apply) would otherwise ride along
/// in every prompt: a valid-JSON prefix is kept instead.
fn history_arguments(arguments: &str, ok: bool) -> String {
    if ok || arguments.chars().count() <= FAILED_CALL_ARGUMENT_CHARS {
        return arguments.to_owned();
    }
    json!({
        "arguments_not_kept": observe::cut_chars(arguments, 200),
        "chars": arguments.chars().count(),
    })
    .to_string()
}

/// The arguments of an action as the model should have written them.
fn action_arguments(action: &Action) -> String {
    match serde_json::to_value(action) {
        Ok(Value::Object(mut map)) => {
            map.remove("tool");
            map.retain(|_, v| !v.is_null() && *v != Value::Bool(false));
            Value::Object(map).to_string()
        }
        _ => "{}".into(),
    }
}

/// What the model is told when its call could not be used.
fn reask_text(e: &CallError) -> String {
    let schema = match e {
        CallError::UnknownTool { .. } => String::new(),
        CallError::BadJson { tool, .. }
        | CallError::Missing { tool, .. }
        | CallError::BadType { tool, .. } => tools::specs()
            .iter()
            .find(|s| s.name == tool)
            .map(|s| format!(" Its parameters: {}", s.parameters))
            .unwrap_or_default(),
    };
    format!("ERROR: your tool call could not be used: {e}.{schema} Call the tool again with valid JSON arguments.")
}

mod actions;
mod operator;
mod resume;
mod salvage;
#[cfg(test)]
mod tests;
