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
    format!(
        "run-{secs}-{:06x}",
        rand::thread_rng().gen_range(0..0x100_0000u32)
    )
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
    bucket: TokenBucket,
    ck: Checkpoint,
    workdir: String,
    state: LoopState,
    session_start: Instant,
    retry: Option<RetryPlan>,
    llm_attempt: u32,
    act_attempt: u32,
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
            labels: [(RUN_LABEL.to_owned(), run_id.clone())]
                .into_iter()
                .collect(),
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
pub async fn resume<S: SandboxApi + Clone + 'static>(
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
        let trace = if opts.trace {
            let dir = store.run_dir(&ck.run_id);
            std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
                what: "cannot create",
                path: dir.clone(),
                source,
            })?;
            Trace::open(
                &dir.join("trace.jsonl"),
                &ck.trace_id,
                &ck.run_id,
                ck.sessions,
            )?
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
            act_attempt: 0,
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
            ..crate::exec_request(self.ck.sandbox_id.as_str(), [self.shell(), "-c", command])
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
            .snapshot(
                &self.ck.sandbox_id,
                &format!("agent-{}-base", self.ck.run_id),
            )
            .await
            .map_err(|source| AgentError::Daemon {
                what: "cannot snapshot the sandbox".into(),
                source,
            })?;
        self.ck.base_snapshot_id = Some(snap.snapshot_id.clone());
        self.ck.snapshot_id = Some(snap.snapshot_id);
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

    async fn think(&mut self) -> Result<(), AgentError> {
        match self
            .budget
            .check(self.ck.step, self.session_start.elapsed())
        {
            Verdict::Stop(reason, detail) => return self.halt(reason, detail),
            Verdict::Warn(text) => {
                self.trace_event(
                    "decision",
                    json!({"decision": "budget_warning", "detail": text}),
                );
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
        self.step_tokens += prompt + completion;
        self.trace_event(
            "llm_call",
            json!({
                "purpose": "step",
                "prompt_tokens": prompt,
                "counted_prompt_tokens": counted,
                "completion_tokens": completion,
                "latency_ms": latency,
                "finish_reason": response.finish_reason,
                "tool_calls": response.tool_calls.len(),
            }),
        );

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
                    idempotency_key: idempotency_key(
                        &self.ck.run_id,
                        step,
                        0,
                        if verifying { "verify" } else { "act" },
                    ),
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
                match self.opts.backoff.delay(self.llm_attempt, retry_after) {
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
                            "the model endpoint kept failing ({} attempts): {message}",
                            self.llm_attempt
                        ),
                    ),
                }
            }
            LlmError::ContextTooLong(message) => {
                self.llm_attempt += 1;
                if self.llm_attempt > 3 || !self.compact(true).await? {
                    return self.halt(
                        StopReason::FatalError,
                        format!("the prompt does not fit the model: {message}"),
                    );
                }
                self.retry = Some(RetryPlan {
                    attempt: self.llm_attempt,
                    delay: Duration::ZERO,
                    then: LoopState::Thinking,
                });
                self.go(LoopState::Retrying, "prompt too long: compacted")
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
                self.budget
                    .record_call(usage.prompt_tokens, usage.completion_tokens);
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
                return Err(AgentError::Daemon {
                    what: format!("sandbox {} is gone", self.ck.sandbox_id),
                    source: e,
                });
            }
            Err(e) if is_unavailable(&e) => {
                // The key makes a re-send safe: the daemon runs the command at most once.
                self.act_attempt += 1;
                return match self.opts.backoff.delay(self.act_attempt, None) {
                    Some(delay) => {
                        self.retry = Some(RetryPlan {
                            attempt: self.act_attempt,
                            delay,
                            then: LoopState::Acting,
                        });
                        self.go(LoopState::Retrying, &format!("daemon unavailable: {e}"))
                    }
                    None => Err(AgentError::Daemon {
                        what: format!(
                            "the daemon is unreachable after {} attempts",
                            self.act_attempt
                        ),
                        source: e,
                    }),
                };
            }
            Err(e)
                if matches!(
                    e.code(),
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                ) =>
            {
                return Err(AgentError::Daemon {
                    what: "the daemon refused the credentials".into(),
                    source: e,
                });
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
        if obs.lost && pending.attempt < 2 {
            // The daemon died under the command (it came back: it answered). Same recovery
            // as a resume: files back to the last step's snapshot, the action again under a
            // new key, so a half-done effect cannot stack.
            if let Some(snap) = self.ck.snapshot_id.clone() {
                self.sandbox
                    .rollback(&self.ck.sandbox_id, &snap)
                    .await
                    .map_err(|source| AgentError::Daemon {
                        what: format!("cannot roll back to snapshot {snap} after a lost exec"),
                        source,
                    })?;
            }
            let mut p = pending.clone();
            p.attempt += 1;
            p.idempotency_key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "act");
            self.trace_event("decision", json!({"decision": "rollback_after_lost_exec", "snapshot": self.ck.snapshot_id, "exec_id": obs.exec_id, "new_key": p.idempotency_key}));
            self.ck.pending = Some(p);
            self.retry = Some(RetryPlan {
                attempt: 1,
                delay: Duration::ZERO,
                then: LoopState::Acting,
            });
            return self.go(
                LoopState::Retrying,
                "exec lost: rolled back, running it again",
            );
        }
        self.act_attempt = 0;
        if tool != "bash" {
            // bash judged its own outcome (a timeout counts against it); others got here
            // because the daemon answered.
            self.breakers.record(tool, true, Instant::now());
        }
        self.last_obs = Some(obs);
        self.go(LoopState::Observing, "action done")
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
                arguments: pending.call_arguments.clone(),
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
            }),
        );
        self.ctx.push_step(
            pending.step,
            call,
            action_line,
            obs.text.clone(),
            obs.exec_id.clone(),
            obs.ok,
        );

        // Progress signals cost an exec, so they are gathered only for a repeated action.
        let canonical = pending.action.canonical();
        let workspace = if self.detector.wants_probe(&canonical) {
            let req = self.sh_request(
                &termination::probe_command(&self.workdir),
                String::new(),
                Duration::from_secs(20),
            );
            match self.exec(req).await {
                Ok(r) if verify::action_ok(&r) => {
                    Some(String::from_utf8_lossy(&r.stdout).trim().to_owned())
                }
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
                    // Off the hot path: a snapshot left behind costs only disk.
                    let sandbox = self.sandbox.clone();
                    tokio::spawn(async move {
                        if let Err(e) = sandbox.delete_snapshot(&old).await {
                            tracing::debug!(snapshot = %old, error = %e, "cannot delete an old step snapshot");
                        }
                    });
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
                self.trace_event(
                    "decision",
                    json!({"decision": "snapshot_failed", "detail": e.to_string()}),
                );
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
            let r = match self
                .exec(self.sh_request(&command, key, self.budget.limits.step_time))
                .await
            {
                Ok(r) => r,
                Err(e) if is_unavailable(&e) || e.code() == tonic::Code::NotFound => {
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
                self.ctx.push_step(
                    pending.step,
                    call,
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
                self.ctx.push_step(
                    pending.step,
                    call,
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

fn is_background(a: &Action) -> bool {
    matches!(
        a,
        Action::Bash {
            background: true,
            ..
        }
    )
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
mod resume;
mod salvage;
#[cfg(test)]
mod tests;
