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
use super::context::{ContextConfig, ContextError, ContextManager};
use super::llm::{ChatRequest, LlmError, LlmProvider, Message, ToolCall};
use super::observe::{self, ObserveLimits, Observation};
use super::retry::{Backoff, Breakers, TokenBucket};
use super::sandbox::SandboxApi;
use super::state::{IllegalTransition, LoopState, RunStatus, StopReason};
use super::termination::{self, Detector, DetectorConfig};
use super::tokens::TokenCounter;
use super::tools::{self, Action, CallError};
use super::trace::Trace;
use super::verify::{self, Level};
use crate::proto::{CreateSandboxRequest, ExecRequest, ExecResult, ExecStatus, Isolation, SandboxState};

/// Where files the loop keeps inside the sandbox go (the diff base, spilled outputs).
const AGENT_DIR: &str = "/tmp/.agent";
/// Label put on the sandboxes of a run.
pub const RUN_LABEL: &str = "agent-run";
/// Largest diff kept in the report (the whole one is in the run directory).
const REPORT_DIFF_CHARS: usize = 8_000;

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
    #[error("run {0} already exists; continue it with `sbx agent resume {0}` or pick another --run-id")]
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

/// Knobs beyond the run's spec.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Where runs are kept.
    pub state_dir: PathBuf,
    /// Observation cut sizes.
    pub observe: ObserveLimits,
    /// No-progress detection.
    pub detector: DetectorConfig,
    /// Retry policy for model and daemon calls.
    pub backoff: Backoff,
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
    /// Write the JSONL trace.
    pub trace: bool,
}

impl RunOptions {
    /// Defaults with runs kept under `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        RunOptions {
            state_dir: state_dir.into(),
            observe: ObserveLimits::default(),
            detector: DetectorConfig::default(),
            backoff: Backoff::default(),
            breaker_threshold: 5,
            breaker_cooldown: Duration::from_secs(30),
            rate_burst: 10,
            rate_per_sec: 10.0,
            max_reasks: 3,
            max_rejected_finishes: 3,
            fold_after: 5,
            snapshot_steps: true,
            trace: true,
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
    /// Cost, USD (0 when the price is unknown).
    pub cost_usd: f64,
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
    format!("run-{secs}-{:06x}", rand::thread_rng().gen_range(0..0x100_0000u32))
}

fn is_unavailable(e: &crate::Error) -> bool {
    matches!(
        e.code(),
        tonic::Code::Unavailable
            | tonic::Code::ResourceExhausted
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Aborted
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
    )
}

struct RetryPlan {
    attempt: u32,
    delay: Duration,
    then: LoopState,
}

/// A run in progress.
pub struct Agent<S: SandboxApi> {
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
    bucket: TokenBucket,
    ck: Checkpoint,
    workdir: String,
    state: LoopState,
    session_start: Instant,
    retry: Option<RetryPlan>,
    llm_attempt: u32,
    reasks: u32,
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
pub async fn start<S: SandboxApi>(
    sandbox: S,
    llm: Arc<dyn LlmProvider>,
    spec: RunSpec,
    run_id: Option<String>,
    opts: RunOptions,
) -> Result<RunReport, AgentError> {
    let run_id = run_id.unwrap_or_else(new_run_id);
    super::checkpoint::validate_run_id(&run_id)?;
    let store = FileStore::new(&opts.state_dir);
    let lock = RunLock::acquire(&store, &run_id)?;
    if store.exists(&run_id) {
        return Err(AgentError::RunExists(run_id));
    }
    let isolation = match spec.isolation.as_str() {
        "process" => Isolation::Process,
        "container" => Isolation::Container,
        "microvm" => Isolation::Microvm,
        _ => Isolation::Unspecified,
    };
    let created = sandbox
        .create(CreateSandboxRequest {
            isolation: isolation as i32,
            image: spec.image.clone(),
            labels: [(RUN_LABEL.to_owned(), run_id.clone())].into_iter().collect(),
            ..Default::default()
        })
        .await
        .map_err(|source| AgentError::Daemon {
            what: "cannot create the run's sandbox".into(),
            source,
        })?;
    let workdir = if created.workdir.is_empty() {
        "/workspace".to_owned()
    } else {
        created.workdir.clone()
    };
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
        sandbox_id: created.id.clone(),
        snapshot_id: None,
        base_snapshot_id: None,
        auto_snapshots: Vec::new(),
        detector: Default::default(),
        exec_ids: BTreeMap::new(),
        rejected_finishes: 0,
        sessions: 0,
        outcome: None,
        has_bash: false,
        subtask_check: None,
    };
    let mut agent = Agent::assemble(sandbox, llm, opts, store, ck, ctx, workdir, Some(lock))?;
    agent.trace_event("start", json!({"task": spec.task, "model": spec.model, "sandbox_id": created.id, "tokenizer": agent.ctx.counter().name()}));
    agent.prepare_sandbox().await?;
    agent.writer.write_now(agent.checkpoint()).await?;
    Ok(agent.run().await)
}

/// Picks up a run from its checkpoint and drives it to its end. `make_llm` builds the provider
/// for the model the run was started with.
pub async fn resume<S: SandboxApi>(
    sandbox: S,
    make_llm: impl FnOnce(&RunSpec) -> Result<Arc<dyn LlmProvider>, LlmError>,
    run_id: &str,
    opts: RunOptions,
) -> Result<RunReport, AgentError> {
    let store = FileStore::new(&opts.state_dir);
    let lock = RunLock::acquire(&store, run_id)?;
    let mut ck = store.load(run_id)?;
    if let Some(outcome) = &ck.outcome {
        if !outcome.reason.resumable() {
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
    if ck.sandbox_id.is_empty() {
        return Err(AgentError::CannotResume {
            run_id: run_id.into(),
            reason: "the checkpoint names no sandbox".into(),
        });
    }
    let llm = make_llm(&ck.spec)?;
    ck.sessions += 1;
    ck.outcome = None;
    let counter = TokenCounter::for_model(&ck.spec.model);
    let ctx = ContextManager::restore(
        context_config(&ck.spec, &opts),
        counter,
        tool_wire(),
        ck.context.clone(),
    );
    let mut agent = Agent::assemble(sandbox, llm, opts, store, ck, ctx, String::new(), Some(lock))?;
    agent.trace_event("resume", json!({"session": agent.ck.sessions, "pending": agent.ck.pending.as_ref().map(|p| p.action.describe())}));
    agent.reconcile().await?;
    Ok(agent.run().await)
}

fn percentile(sorted_ms: &[f64], p: f64) -> f64 {
    if sorted_ms.is_empty() {
        return 0.0;
    }
    let idx = ((sorted_ms.len() as f64 - 1.0) * p).round() as usize;
    sorted_ms[idx.min(sorted_ms.len() - 1)]
}

fn report_of(ck: &Checkpoint, store: &FileStore, latencies: &[Duration], stalls: &[Duration]) -> RunReport {
    let outcome = ck.outcome.clone().unwrap_or(Outcome {
        reason: StopReason::FatalError,
        answer: None,
        final_snapshot_id: None,
        diff: String::new(),
        summary: String::new(),
        error: Some("the run has no outcome".into()),
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
        cost_usd: ck.budget.cost_usd,
        elapsed_ms: ck.budget.elapsed_ms_before,
        summary: outcome.summary.clone(),
        diff: observe::cut_chars(&outcome.diff, REPORT_DIFF_CHARS),
        diff_path: diff_path
            .exists()
            .then(|| diff_path.display().to_string()),
        trace_path: Some(run_dir.join("trace.jsonl").display().to_string()),
        error: outcome.error.clone(),
        resumable: outcome.reason.resumable(),
        checkpoint_ms_p50: percentile(&ms, 0.5),
        checkpoint_ms_p99: percentile(&ms, 0.99),
        checkpoint_stall_ms_max: stalls.iter().map(|d| d.as_secs_f64() * 1000.0).fold(0.0, f64::max),
    }
}

impl<S: SandboxApi> Agent<S> {
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
        let trace = if opts.trace {
            let dir = store.run_dir(&ck.run_id);
            std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
                what: "cannot create",
                path: dir.clone(),
                source,
            })?;
            Trace::open(&dir.join("trace.jsonl"), &ck.trace_id, &ck.run_id, ck.sessions)?
        } else {
            Trace::disabled()
        };
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
            bucket: TokenBucket::new(opts.rate_burst, opts.rate_per_sec),
            workdir,
            state: ck.state,
            ck,
            session_start: Instant::now(),
            retry: None,
            llm_attempt: 0,
            reasks: 0,
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

    fn trace_event(&mut self, kind: &str, fields: Value) {
        let state = self.state.to_string();
        self.trace.event(kind, self.ck.step, &state, fields);
    }

    fn go(&mut self, to: LoopState, why: &str) -> Result<(), AgentError> {
        let from = self.state;
        self.state = from.check(to)?;
        tracing::debug!(run = %self.ck.run_id, step = self.ck.step, %from, %to, why, "transition");
        self.trace_event("transition", json!({"from": from.to_string(), "to": to.to_string(), "why": why}));
        Ok(())
    }

    fn halt(&mut self, reason: StopReason, detail: impl Into<String>) -> Result<(), AgentError> {
        let detail = detail.into();
        tracing::info!(run = %self.ck.run_id, %reason, %detail, "stopping");
        self.trace_event("decision", json!({"decision": "stop", "reason": reason.as_str(), "detail": detail}));
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
                Err(e) if is_unavailable(&e) => {
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
            timeout_ms: timeout.as_millis() as u64,
            ..crate::exec_request(
                self.ck.sandbox_id.as_str(),
                [self.shell(), "-c", command],
            )
        }
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
            .snapshot(&self.ck.sandbox_id, &format!("agent-{}-base", self.ck.run_id))
            .await
            .map_err(|source| AgentError::Daemon {
                what: "cannot snapshot the sandbox".into(),
                source,
            })?;
        self.ck.base_snapshot_id = Some(snap.snapshot_id.clone());
        self.ck.snapshot_id = Some(snap.snapshot_id);
        Ok(())
    }

    // ---- resume ------------------------------------------------------------------------

    /// Makes the sandbox agree with the checkpoint: the sandbox exists (forked from the last
    /// snapshot if not), and the pending action's effect is there exactly once.
    async fn reconcile(&mut self) -> Result<(), AgentError> {
        let mut notes = Vec::new();
        let sandbox = match self.sandbox.get(&self.ck.sandbox_id).await {
            Ok(sb) if sb.state == SandboxState::Running as i32 => Some(sb),
            Ok(_) => None,
            Err(e) if e.code() == tonic::Code::NotFound => None,
            Err(source) => {
                return Err(AgentError::Daemon {
                    what: format!("cannot look up sandbox {}", self.ck.sandbox_id),
                    source,
                })
            }
        };
        let forked = match sandbox {
            Some(sb) => {
                self.workdir = sb.workdir;
                false
            }
            None => {
                let snap = self.ck.snapshot_id.clone().ok_or_else(|| AgentError::CannotResume {
                    run_id: self.ck.run_id.clone(),
                    reason: format!("sandbox {} is gone and no snapshot was taken", self.ck.sandbox_id),
                })?;
                let sb = self
                    .sandbox
                    .create(CreateSandboxRequest {
                        from_snapshot_id: snap.clone(),
                        labels: [(RUN_LABEL.to_owned(), self.ck.run_id.clone())].into_iter().collect(),
                        ..Default::default()
                    })
                    .await
                    .map_err(|source| AgentError::Daemon {
                        what: format!("sandbox {} is gone and forking snapshot {snap} failed", self.ck.sandbox_id),
                        source,
                    })?;
                notes.push(format!(
                    "sandbox {} was gone; continued in {} forked from snapshot {snap} (the state after step {})",
                    self.ck.sandbox_id, sb.id, self.ck.step
                ));
                self.trace_event("decision", json!({"decision": "fork", "old_sandbox": self.ck.sandbox_id, "new_sandbox": sb.id, "snapshot": snap}));
                self.ck.sandbox_id = sb.id;
                self.workdir = sb.workdir;
                true
            }
        };
        if self.workdir.is_empty() {
            self.workdir = "/workspace".into();
        }

        let mut next = LoopState::Thinking;
        if let Some(pending) = self.ck.pending.clone() {
            let recorded = if forked || !matches!(pending.action, Action::Bash { .. }) && !pending.verifying {
                None
            } else {
                self.recorded_exec(&pending.idempotency_key).await?
            };
            match recorded {
                Some(r) if r.status != ExecStatus::Lost as i32 => {
                    // The daemon ran it (or still runs it): its effect is in the filesystem
                    // already, so take its result instead of running it again.
                    let r = if r.status == ExecStatus::Running as i32 && !is_background(&pending.action) {
                        self.sandbox.get_exec(&r.exec_id, true).await.map_err(|source| AgentError::Daemon {
                            what: format!("cannot wait for exec {}", r.exec_id),
                            source,
                        })?
                    } else {
                        r
                    };
                    notes.push(format!(
                        "the action of step {} ({}) had already run as exec {}; its recorded result is used",
                        pending.step,
                        pending.action.describe(),
                        r.exec_id
                    ));
                    self.trace_event("decision", json!({"decision": "adopt_recorded_exec", "exec_id": r.exec_id, "key": pending.idempotency_key}));
                    if pending.verifying {
                        next = LoopState::Verifying;
                    } else {
                        let mut obs = observe::exec(&r, self.opts.observe);
                        self.spill(&mut obs, pending.step).await;
                        self.last_obs = Some(obs);
                        next = LoopState::Acting; // straight to OBSERVING below
                    }
                }
                other => {
                    // Never started, or LOST half-way: put the files back to the last step's
                    // snapshot so a half-done effect cannot stack, then run it again under a
                    // new key.
                    let why = if other.is_some() { "ended LOST" } else { "never started" };
                    // A fork starts from that snapshot already.
                    let needs_rollback = pending.action.may_mutate() && !forked;
                    if needs_rollback {
                        if let Some(snap) = self.ck.snapshot_id.clone() {
                            self.sandbox
                                .rollback(&self.ck.sandbox_id, &snap)
                                .await
                                .map_err(|source| AgentError::Daemon {
                                    what: format!("cannot roll back to snapshot {snap}"),
                                    source,
                                })?;
                            self.trace_event("decision", json!({"decision": "rollback", "snapshot": snap, "why": why}));
                        }
                    }
                    let mut p = pending.clone();
                    p.attempt += 1;
                    p.idempotency_key = idempotency_key(
                        &self.ck.run_id,
                        p.step,
                        p.attempt,
                        if p.verifying { "verify" } else { "act" },
                    );
                    notes.push(format!(
                        "the action of step {} ({}) {why}; {}it is run again",
                        p.step,
                        p.action.describe(),
                        if needs_rollback { "the sandbox was rolled back to the last step's snapshot and " } else { "" }
                    ));
                    next = if p.verifying { LoopState::Verifying } else { LoopState::Acting };
                    self.ck.pending = Some(p);
                }
            }
        }
        let done: Vec<String> = vec![self.ctx.brief(5)];
        let note = format!(
            "Resumed at step {} after an interruption (session {}). {} Done so far: {}",
            self.ck.step,
            self.ck.sessions,
            notes.join(". "),
            done.join("; ")
        );
        self.ctx.pin("recovery note", &observe::cut_chars(&note, 1_500));
        self.trace_event("recovery", json!({"detail": note}));
        self.state = LoopState::Idle;
        self.writer.write_now(self.checkpoint()).await?;
        match next {
            LoopState::Acting if self.last_obs.is_some() => {
                // The result is known: go through ACTING without sending anything.
                self.go(LoopState::Acting, "resume: pending action already ran")?;
                self.go(LoopState::Observing, "resume: recorded result")?;
            }
            other => self.go(other, "resume")?,
        }
        Ok(())
    }

    async fn recorded_exec(&self, key: &str) -> Result<Option<ExecResult>, AgentError> {
        let execs = self
            .sandbox
            .list_execs(&self.ck.sandbox_id)
            .await
            .map_err(|source| AgentError::Daemon {
                what: format!("cannot list the execs of sandbox {}", self.ck.sandbox_id),
                source,
            })?;
        Ok(execs.into_iter().rev().find(|r| r.idempotency_key == key))
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

    async fn think(&mut self) -> Result<(), AgentError> {
        match self.budget.check(self.ck.step, self.session_start.elapsed()) {
            Verdict::Stop(reason, detail) => return self.halt(reason, detail),
            Verdict::Warn(text) => {
                self.trace_event("decision", json!({"decision": "budget_warning", "detail": text}));
                self.ctx.pin("budget", &text);
            }
            Verdict::Ok => {}
        }
        if self.ctx.needs_compaction() {
            self.compact(false).await?;
        }
        let counted = self.ctx.prompt_tokens();
        let request = ChatRequest {
            messages: self.ctx.render(),
            tools: self.ctx.tools().to_vec(),
            max_tokens: Some(self.budget.call_completion_tokens()),
        };
        self.bucket.take().await;
        let started = Instant::now();
        let result = self.llm.complete(&request).await;
        let latency = started.elapsed().as_millis() as u64;
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                self.trace_event("llm_call", json!({"purpose": "step", "counted_prompt_tokens": counted, "latency_ms": latency, "error": e.to_string()}));
                return self.model_failed(e).await;
            }
        };
        self.llm_attempt = 0;
        let usage = response.usage.unwrap_or_default();
        let completion_counted = self
            .ctx
            .counter()
            .count(&(response.content.clone() + &response.tool_calls.iter().map(|c| c.function.arguments.clone()).collect::<String>()));
        let prompt = if usage.prompt_tokens > 0 { usage.prompt_tokens } else { counted as u64 };
        let completion = if usage.completion_tokens > 0 { usage.completion_tokens } else { completion_counted as u64 };
        self.budget.record_call(prompt, completion);
        self.step_tokens += prompt + completion;
        self.trace_event("llm_call", json!({
            "purpose": "step",
            "prompt_tokens": prompt,
            "counted_prompt_tokens": counted,
            "completion_tokens": completion,
            "latency_ms": latency,
            "finish_reason": response.finish_reason,
            "tool_calls": response.tool_calls.len(),
        }));

        let Some(call) = response.tool_calls.first().cloned() else {
            let text = if response.content.trim().is_empty() { "(empty answer)".to_owned() } else { response.content.clone() };
            let assistant = Message { role: "assistant".into(), content: Some(text), ..Default::default() };
            let error = Message::user("Your answer did not call a tool. Respond with exactly one tool call; call finish(answer) when the task is done.");
            return self.reask(assistant, error, "no tool call");
        };
        match tools::parse_call(&call.function.name, &call.function.arguments) {
            Err(e) => {
                let assistant = Message::assistant_call(call.clone(), Some(response.content.clone()));
                let error = Message::tool(&call.id, reask_text(&e));
                self.reask(assistant, error, &e.to_string())
            }
            Ok(parsed) => {
                if !parsed.repairs.is_empty() {
                    tracing::info!(repairs = ?parsed.repairs, "repaired a tool call");
                    self.trace_event("decision", json!({"decision": "repaired_call", "repairs": parsed.repairs}));
                }
                self.reasks = 0;
                let repaired = ToolCall {
                    id: call.id.clone(),
                    kind: "function".into(),
                    function: super::llm::FunctionCall {
                        name: parsed.action.tool().into(),
                        arguments: action_arguments(&parsed.action),
                    },
                };
                let step = self.ck.step + 1;
                let verifying = matches!(parsed.action, Action::Finish { .. });
                self.ck.pending = Some(PendingAction {
                    step,
                    call_id: repaired.id.clone(),
                    call_name: repaired.function.name.clone(),
                    call_arguments: repaired.function.arguments.clone(),
                    action: parsed.action,
                    idempotency_key: idempotency_key(&self.ck.run_id, step, 0, if verifying { "verify" } else { "act" }),
                    attempt: 0,
                    verifying,
                });
                if verifying {
                    self.go(LoopState::Verifying, "finish called")
                } else {
                    self.go(LoopState::Acting, "tool call")
                }
            }
        }
    }

    fn reask(&mut self, assistant: Message, error: Message, why: &str) -> Result<(), AgentError> {
        self.reasks += 1;
        self.trace_event("decision", json!({"decision": "reask", "attempt": self.reasks, "detail": why}));
        if self.reasks > self.opts.max_reasks {
            return self.halt(
                StopReason::MalformedOutput,
                format!("the model's answer could not be used after {} re-asks: {why}", self.opts.max_reasks),
            );
        }
        if self.step_tokens > self.budget.limits.step_tokens {
            return self.halt(
                StopReason::MalformedOutput,
                format!("the step spent {} tokens on re-asks (step budget {})", self.step_tokens, self.budget.limits.step_tokens),
            );
        }
        self.ctx.set_reask(assistant, error);
        self.go(LoopState::Thinking, "re-ask")
    }

    async fn model_failed(&mut self, e: LlmError) -> Result<(), AgentError> {
        match e {
            LlmError::Retryable { message, retry_after } => {
                self.llm_attempt += 1;
                match self.opts.backoff.delay(self.llm_attempt, retry_after) {
                    Some(delay) => {
                        self.retry = Some(RetryPlan { attempt: self.llm_attempt, delay, then: LoopState::Thinking });
                        self.go(LoopState::Retrying, &message)
                    }
                    None => self.halt(
                        StopReason::FatalError,
                        format!("the model endpoint kept failing ({} attempts): {message}", self.llm_attempt),
                    ),
                }
            }
            LlmError::ContextTooLong(message) => {
                self.llm_attempt += 1;
                if self.llm_attempt > 3 || !self.compact(true).await? {
                    return self.halt(StopReason::FatalError, format!("the prompt does not fit the model: {message}"));
                }
                self.retry = Some(RetryPlan { attempt: self.llm_attempt, delay: Duration::ZERO, then: LoopState::Thinking });
                self.go(LoopState::Retrying, "prompt too long: compacted")
            }
            other => self.halt(StopReason::FatalError, other.to_string()),
        }
    }

    async fn wait_retry(&mut self) -> Result<(), AgentError> {
        let Some(plan) = self.retry.take() else {
            return self.go(LoopState::Thinking, "retry");
        };
        self.trace_event("retry", json!({"attempt": plan.attempt, "delay_ms": plan.delay.as_millis() as u64}));
        tokio::time::sleep(plan.delay).await;
        self.go(plan.then, "retry")
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
        self.bucket.take().await;
        let started = Instant::now();
        let summary = match self.llm.complete(&plan.request).await {
            Ok(r) => {
                let usage = r.usage.unwrap_or_default();
                self.budget.record_call(usage.prompt_tokens, usage.completion_tokens);
                self.step_tokens += usage.prompt_tokens + usage.completion_tokens;
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
        let after = self.ctx.prompt_tokens();
        self.trace_event("compaction", json!({"from_step": plan.from_step, "to_step": plan.to_step, "steps": plan.steps, "tokens_before": before, "tokens_after": after}));
        self.writer.write_now(self.checkpoint()).await?;
        Ok(true)
    }

    async fn act(&mut self) -> Result<(), AgentError> {
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
        let obs = match self.execute(&pending).await {
            Ok(obs) => obs,
            Err(e) if e.code() == tonic::Code::NotFound && e.to_string().contains("sandbox") => {
                return Err(AgentError::Daemon { what: format!("sandbox {} is gone", self.ck.sandbox_id), source: e });
            }
            Err(e) if is_unavailable(&e) => {
                return Err(AgentError::Daemon { what: "the daemon is unreachable".into(), source: e });
            }
            Err(e) if matches!(e.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
                return Err(AgentError::Daemon { what: "the daemon refused the credentials".into(), source: e });
            }
            Err(e) => {
                // Not retryable and not fatal: the model should know and adapt.
                self.breakers.record(tool, false, Instant::now());
                self.last_obs = Some(Observation::error(format!(
                    "ERROR from the sandbox daemon: {}",
                    json!({"code": crate::code_name(e.code()), "message": e.status().map_or_else(|| e.to_string(), |s| s.message().to_owned())})
                )));
                return self.go(LoopState::Observing, "tool error");
            }
        };
        self.last_obs = Some(obs);
        self.go(LoopState::Observing, "action done")
    }

    /// Runs one action. Errors are daemon errors; failures inside the sandbox are observations.
    async fn execute(&mut self, p: &PendingAction) -> Result<Observation, crate::Error> {
        let sid = self.ck.sandbox_id.clone();
        let obs = match &p.action {
            Action::Bash { command, timeout_secs, background } => {
                let mut req = self.sh_request(command, p.idempotency_key.clone(), self.budget.step_timeout(*timeout_secs));
                req.background = *background;
                let r = self.exec(req).await?;
                let failed_tool = matches!(ExecStatus::try_from(r.status), Ok(ExecStatus::SpawnFailed | ExecStatus::Lost | ExecStatus::TimedOut));
                self.breakers.record("bash", !failed_tool, Instant::now());
                let mut obs = observe::exec(&r, self.opts.observe);
                self.spill(&mut obs, p.step).await;
                obs
            }
            Action::ReadFile { path, start_line, max_lines } => {
                let path = self.abs_path(path);
                match self.sandbox.read_file(&sid, &path, 0, 8 << 20).await {
                    Ok(resp) => {
                        let text = String::from_utf8_lossy(&resp.content);
                        let total = text.lines().count() as u64;
                        let start = (*start_line).max(1);
                        let mut out = String::new();
                        for (i, line) in text.lines().enumerate().skip((start - 1) as usize).take(*max_lines as usize) {
                            out.push_str(&format!("{:>6}\t{}\n", i + 1, line));
                        }
                        let end = (start + max_lines - 1).min(total);
                        if out.is_empty() {
                            Observation::ok(format!("{path}: {total} lines, nothing at line {start}"))
                        } else {
                            let more = if end < total { format!("; more from start_line={}", end + 1) } else { String::new() };
                            let cut = if resp.eof { "" } else { " (file larger than 8 MiB: only its start was read)" };
                            Observation::ok(format!("{path} lines {start}-{end} of {total}{more}{cut}\n{out}"))
                        }
                    }
                    Err(e) if matches!(e.code(), tonic::Code::NotFound | tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition) && !e.to_string().contains("sandbox") => {
                        Observation::error(format!("cannot read {path}: {}", e.status().map_or_else(|| e.to_string(), |s| s.message().to_owned())))
                    }
                    Err(e) => return Err(e),
                }
            }
            Action::WriteFile { path, content } => {
                let path = self.abs_path(path);
                let n = self.sandbox.write_file(&sid, &path, content.clone().into_bytes()).await?;
                Observation::ok(format!("wrote {n} bytes to {path}"))
            }
            Action::StrReplace { path, old_str, new_str, replace_all } => {
                let path = self.abs_path(path);
                let content = match self.sandbox.read_file(&sid, &path, 0, 8 << 20).await {
                    Ok(r) => String::from_utf8_lossy(&r.content).into_owned(),
                    Err(e) if e.code() == tonic::Code::NotFound && !e.to_string().contains("sandbox") => {
                        return Ok(Observation::error(format!("cannot edit {path}: it does not exist (use write_file to create it)")));
                    }
                    Err(e) => return Err(e),
                };
                let count = if old_str.is_empty() { 0 } else { content.matches(old_str.as_str()).count() };
                if count == 0 {
                    Observation::error(format!("str_replace in {path}: old_str was not found; read the file and copy the text exactly (whitespace included)"))
                } else if count > 1 && !replace_all {
                    Observation::error(format!("str_replace in {path}: old_str occurs {count} times; include more surrounding text to make it unique, or set replace_all"))
                } else {
                    let updated = if *replace_all { content.replace(old_str.as_str(), new_str) } else { content.replacen(old_str.as_str(), new_str, 1) };
                    self.sandbox.write_file(&sid, &path, updated.clone().into_bytes()).await?;
                    let at = updated.find(new_str.as_str()).map_or(1, |i| updated[..i].lines().count().max(1));
                    let snippet: String = updated.lines().enumerate().skip(at.saturating_sub(3)).take(new_str.lines().count() + 5)
                        .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1)).collect();
                    Observation::ok(format!("replaced {count} occurrence{} in {path}:\n{snippet}", if count == 1 { "" } else { "s" }))
                }
            }
            Action::Snapshot { name } => {
                let info = self.sandbox.snapshot(&sid, name.as_deref().unwrap_or("")).await?;
                let label = name.clone().unwrap_or_else(|| format!("step {}", p.step));
                self.ctx.pin(&format!("snapshot {label}"), &info.snapshot_id);
                Observation::ok(format!("snapshot {} taken (pinned as \"snapshot {label}\")", info.snapshot_id))
            }
            Action::Rollback { snapshot_id } => match self.sandbox.rollback(&sid, snapshot_id).await {
                Ok(_) => Observation::ok(format!("rolled back to {snapshot_id}; processes that were running were stopped")),
                Err(e) if e.code() == tonic::Code::NotFound && e.to_string().contains("snapshot") => {
                    Observation::error(format!("no snapshot {snapshot_id}"))
                }
                Err(e) if e.code() == tonic::Code::FailedPrecondition => Observation::error(format!("cannot roll back: {e}")),
                Err(e) => return Err(e),
            },
            Action::Pin { key, value } => match value {
                Some(v) => {
                    self.ctx.pin(key, v);
                    Observation::ok(format!("pinned {key}"))
                }
                None => {
                    self.ctx.unpin(key);
                    Observation::ok(format!("unpinned {key}"))
                }
            },
            Action::Subtask { title, check } => {
                if let Some(previous) = self.ck.subtask_check.clone() {
                    let key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "subtask-check");
                    let r = self.exec(self.sh_request(&previous, key, self.budget.limits.step_time)).await?;
                    let c = verify::judge(Level::Subtask, &previous, &r);
                    if !c.passed {
                        return Ok(Observation::error(c.rejection("starting a new subtask")));
                    }
                    let prev_title = self.ctx.pinned().get("subtask").cloned().unwrap_or_default();
                    self.ctx.pin(&format!("verified: {prev_title}"), &format!("check `{previous}` passed at step {}", p.step));
                }
                self.ctx.pin("subtask", title);
                self.ck.subtask_check = check.clone();
                Observation::ok(match check {
                    Some(c) => format!("subtask set: {title} (check: `{c}`, run before the next subtask or finish)"),
                    None => format!("subtask set: {title}"),
                })
            }
            Action::Recall { step } => {
                if let Some(e) = self.ctx.find_step(*step) {
                    Observation::ok(format!("step {step} ({}):\n{}", e.action_line, e.observation))
                } else if let Some(exec_id) = self.ck.exec_ids.get(step).cloned() {
                    let r = self.sandbox.get_exec(&exec_id, false).await?;
                    let mut obs = observe::exec(&r, self.opts.observe);
                    self.spill(&mut obs, p.step).await;
                    obs.ok = true;
                    obs.text = format!("step {step} (exec {exec_id}):\n{}", obs.text);
                    obs
                } else {
                    Observation::error(format!("step {step} ran no command and its result is no longer held; its summary is all that is left"))
                }
            }
            Action::Finish { .. } => Observation::error("finish is handled by verification"),
        };
        Ok(obs)
    }

    /// Writes streams the observation cut (and the daemon did not spill) into the sandbox so
    /// the model can page them, and fills in the path.
    async fn spill(&mut self, obs: &mut Observation, step: u64) {
        for (stream, text) in std::mem::take(&mut obs.to_spill) {
            let path = format!("{AGENT_DIR}/spill/step-{step}.{stream}");
            let shown = match self.sandbox.write_file(&self.ck.sandbox_id, &path, text.into_bytes()).await {
                Ok(_) => path,
                Err(e) => format!("(not kept: {e})"),
            };
            observe::fill_spill_path(obs, &stream, &shown);
        }
    }

    async fn observe_step(&mut self) -> Result<(), AgentError> {
        let Some(pending) = self.ck.pending.take() else {
            return self.go(LoopState::Thinking, "nothing to observe");
        };
        let obs = self.last_obs.take().unwrap_or_else(|| Observation::error("no result was recorded"));
        self.ck.step = pending.step;
        self.step_tokens = 0;
        let action_line = pending.action.describe();
        let call = ToolCall {
            id: pending.call_id.clone(),
            kind: "function".into(),
            function: super::llm::FunctionCall { name: pending.call_name.clone(), arguments: pending.call_arguments.clone() },
        };
        if let Some(exec_id) = &obs.exec_id {
            self.ck.exec_ids.insert(pending.step, exec_id.clone());
        }
        if obs.ok {
            self.ctx.record_success(&action_line);
        } else {
            self.ctx.record_failure(pending.step, &action_line, &obs.headline());
        }
        self.trace_event("step", json!({
            "action": action_line,
            "tool": pending.action.tool(),
            "exec_id": obs.exec_id,
            "exit_code": obs.exit_code,
            "result": if obs.ok { "ok" } else { "failed" },
            "truncated": obs.truncated,
        }));
        self.ctx.push_step(pending.step, call, action_line, obs.text.clone(), obs.exec_id.clone(), obs.ok);

        // Progress signals cost an exec, so they are gathered only for a repeated action.
        let canonical = pending.action.canonical();
        let workspace = if self.detector.wants_probe(&canonical) {
            let req = self.sh_request(&termination::probe_command(&self.workdir), String::new(), Duration::from_secs(20));
            match self.exec(req).await {
                Ok(r) if verify::action_ok(&r) => Some(String::from_utf8_lossy(&r.stdout).trim().to_owned()),
                _ => None,
            }
        } else {
            None
        };
        let print = Detector::print(pending.step, &canonical, &obs.text, workspace);
        if let Some(stuck) = self.detector.observe(print) {
            self.snapshot_step(&pending.action).await?;
            self.writer.start(self.checkpoint()).await?;
            return self.halt(StopReason::NoProgress, stuck.to_string());
        }
        self.snapshot_step(&pending.action).await?;
        // Durable before the next action; written while the model thinks.
        self.writer.start(self.checkpoint()).await?;
        self.go(LoopState::Thinking, "observed")
    }

    /// Snapshots after a step that may have changed files, so a resume can roll back to it;
    /// keeps only the last two of these.
    async fn snapshot_step(&mut self, action: &Action) -> Result<(), AgentError> {
        if !self.opts.snapshot_steps || !action.may_mutate() {
            return Ok(());
        }
        let name = format!("agent-{}-step-{}", self.ck.run_id, self.ck.step);
        match self.sandbox.snapshot(&self.ck.sandbox_id, &name).await {
            Ok(info) => {
                self.ck.snapshot_id = Some(info.snapshot_id.clone());
                self.ck.auto_snapshots.push(info.snapshot_id);
                while self.ck.auto_snapshots.len() > 2 {
                    let old = self.ck.auto_snapshots.remove(0);
                    if let Err(e) = self.sandbox.delete_snapshot(&old).await {
                        tracing::debug!(snapshot = %old, error = %e, "cannot delete an old step snapshot");
                    }
                }
                Ok(())
            }
            Err(e) if e.code() == tonic::Code::NotFound => Err(AgentError::Daemon {
                what: format!("sandbox {} is gone", self.ck.sandbox_id),
                source: e,
            }),
            Err(e) => {
                // A missing step snapshot only weakens a later resume; the run goes on.
                tracing::warn!(error = %e, "cannot snapshot after the step");
                self.trace_event("decision", json!({"decision": "snapshot_failed", "detail": e.to_string()}));
                Ok(())
            }
        }
    }

    async fn verify(&mut self) -> Result<(), AgentError> {
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
            let r = match self.exec(self.sh_request(&command, key, self.budget.limits.step_time)).await {
                Ok(r) => r,
                Err(e) if is_unavailable(&e) || e.code() == tonic::Code::NotFound => {
                    return Err(AgentError::Daemon { what: "cannot run the check".into(), source: e })
                }
                Err(e) => {
                    rejection = Some((format!("finish REJECTED: the check `{command}` could not run: {e}"), None));
                    break;
                }
            };
            let c = verify::judge(level, &command, &r);
            self.trace_event("verify", json!({"level": level, "command": command, "passed": c.passed, "actual": c.actual, "exec_id": c.exec_id}));
            if !c.passed {
                rejection = Some((c.rejection("finish"), Some(c.exec_id.clone())));
                break;
            }
            self.ctx.pin(&format!("verified ({})", if level == Level::Task { "task" } else { "subtask" }), &format!("`{command}` passed at step {}", pending.step));
        }
        let call = ToolCall {
            id: pending.call_id.clone(),
            kind: "function".into(),
            function: super::llm::FunctionCall { name: pending.call_name.clone(), arguments: pending.call_arguments.clone() },
        };
        self.ck.pending = None;
        self.ck.step = pending.step;
        match rejection {
            None => {
                self.ctx.push_step(pending.step, call, pending.action.describe(), "finish accepted".into(), None, true);
                self.answer = Some(answer);
                self.halt(StopReason::Finished, "finish accepted")
            }
            Some((text, exec_id)) => {
                self.ck.rejected_finishes += 1;
                self.ctx.record_failure(pending.step, "finish", "the task check failed");
                self.ctx.push_step(pending.step, call, pending.action.describe(), text, exec_id, false);
                self.writer.start(self.checkpoint()).await?;
                if self.ck.rejected_finishes >= self.opts.max_rejected_finishes {
                    return self.halt(StopReason::VerifyFailed, format!("finish was rejected {} times by the check", self.ck.rejected_finishes));
                }
                self.go(LoopState::Thinking, "finish rejected")
            }
        }
    }

    // ---- the end -----------------------------------------------------------------------

    /// Every stop ends here: final snapshot, workspace diff, summary, final checkpoint.
    async fn salvage(mut self) -> RunReport {
        let (reason, detail) = self.stop.clone().unwrap_or((StopReason::FatalError, "stopped".into()));
        if let Err(e) = self.writer.flush().await {
            tracing::warn!(error = %e, "a checkpoint write failed before the salvage");
        }
        let mut errors = Vec::new();
        if reason == StopReason::FatalError {
            errors.push(detail.clone());
        }
        let final_snapshot_id = match self
            .sandbox
            .snapshot(&self.ck.sandbox_id, &format!("agent-{}-final", self.ck.run_id))
            .await
        {
            Ok(info) => Some(info.snapshot_id),
            Err(e) => {
                errors.push(format!("final snapshot failed: {e}"));
                self.ck.snapshot_id.clone()
            }
        };
        let diff_cmd = format!(
            "cd {AGENT_DIR}/base 2>/dev/null || exit 0; diff -ruN . {} 2>&1; true",
            tools::shell_quote(&self.workdir)
        );
        let diff = match self
            .exec(ExecRequest {
                max_output_bytes: 4 << 20,
                timeout_ms: 60_000,
                ..crate::exec_request(self.ck.sandbox_id.as_str(), ["sh", "-c", diff_cmd.as_str()])
            })
            .await
        {
            Ok(r) => String::from_utf8_lossy(&r.stdout).into_owned(),
            Err(e) => {
                errors.push(format!("workspace diff failed: {e}"));
                String::new()
            }
        };
        let run_dir = self.store.run_dir(&self.ck.run_id);
        if self.opts.trace && !diff.is_empty() {
            if let Err(e) = FileStore::write_atomic(&run_dir.join("final.diff"), diff.as_bytes()) {
                errors.push(format!("cannot save the diff: {e}"));
            }
        }
        let files_changed = diff.lines().filter(|l| l.starts_with("+++ ")).count();
        let summary = format!(
            "{} after {} steps ({}): {}. {} file{} changed. {}",
            reason.status().as_str(),
            self.ck.step,
            reason,
            detail,
            files_changed,
            if files_changed == 1 { "" } else { "s" },
            self.ctx.brief(5)
        );
        self.ck.outcome = Some(Outcome {
            reason,
            answer: self.answer.clone(),
            final_snapshot_id,
            diff,
            summary,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        });
        let ck = self.checkpoint();
        if let Err(e) = self.writer.write_now(ck.clone()).await {
            tracing::error!(error = %e, "cannot write the final checkpoint");
        }
        self.trace_event("stop", json!({"reason": reason.as_str(), "status": reason.status().as_str(), "detail": detail,
            "prompt_tokens": ck.budget.prompt_tokens, "completion_tokens": ck.budget.completion_tokens}));
        report_of(&ck, &self.store, self.writer.latencies(), self.writer.stalls())
    }
}

fn is_background(a: &Action) -> bool {
    matches!(a, Action::Bash { background: true, .. })
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
        CallError::BadJson { tool, .. } | CallError::Missing { tool, .. } | CallError::BadType { tool, .. } => tools::specs()
            .iter()
            .find(|s| s.name == tool)
            .map(|s| format!(" Its parameters: {}", s.parameters))
            .unwrap_or_default(),
    };
    format!("ERROR: your tool call could not be used: {e}.{schema} Call the tool again with valid JSON arguments.")
}

#[cfg(test)]
mod tests;
