//! `sbx agent run`, `resume`, `show`, `steer` and `stop`: the agent loop on the command line.
//!
//! Exit codes: 0 only when the run is `done`; 1 when it `failed` (or cannot start or resume:
//! a corrupt checkpoint, an unknown run); 3 when a termination rule `stopped` it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_client::agent::checkpoint::{CheckpointError, CheckpointStore, FileStore, RunLock};
use agent_client::agent::inbox::{self, Command, Inbox, InboxError, Liveness, StopAs};
use agent_client::agent::{
    self, trace, AgentError, LlmProvider, NewBudgets, OpenAiProvider, Progress, ProgressSink,
    RunOptions, RunReport, RunSpec, RunStatus,
};
use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::cli::{AgentCommand, AgentRunArgs, IsolationArg, LoopTuning};
use crate::{output, Ctx};

/// Exit code of a run stopped by a termination rule.
const EXIT_STOPPED: u8 = 3;
/// How long one model call may take.
const LLM_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a new run's sandbox is kept after the run ends, unless --keep-sandbox says.
const DEFAULT_KEEP_SANDBOX_SECS: u64 = 86_400;

/// Live progress on stderr when it is a terminal (SBX_PROGRESS=1 forces it, 0 turns it off).
/// Elsewhere (a pipe, a log file) only the waits are printed: an outage being waited out
/// must not look like a hang.
fn progress_sink() -> Option<ProgressSink> {
    use std::io::IsTerminal;
    let (on, waits_only) = match std::env::var("SBX_PROGRESS").ok().as_deref() {
        Some("1") => (true, false),
        Some("0") => (false, false),
        _ if std::io::stderr().is_terminal() => (true, false),
        _ => (true, true),
    };
    on.then(|| {
        ProgressSink(Arc::new(move |p: &Progress| {
            // The runner's retry lines: "waiting 4s before retry 2 (model endpoint)".
            if waits_only && !p.line.starts_with("waiting ") {
                return;
            }
            let tokens = match p.max_tokens {
                Some(max) => format!("{}/{max} tok", p.tokens),
                None => format!("{} tok", p.tokens),
            };
            let line = format!(
                "[{} step {}/{} · {tokens} · {:.0}s] {}",
                p.run_id,
                p.step,
                p.max_steps,
                p.elapsed_ms as f64 / 1000.0,
                p.line
            );
            // Progress is a courtesy: a closed stderr must not stop the run.
            let _ = output::note(&line);
        }))
    })
}

/// Removes the sandboxes of ended runs whose keep time has passed (best effort).
async fn reap(client: &agent_client::Client, state_dir: &std::path::Path) {
    for (run, sandbox) in agent::reap_finished_sandboxes(client, state_dir).await {
        tracing::info!(%run, %sandbox, "removed the sandbox of an ended run");
    }
}

/// Runs an `sbx agent` subcommand.
pub async fn agent(ctx: &Ctx, command: AgentCommand) -> Result<u8> {
    init_logging();
    match command {
        AgentCommand::Run(args) => run(ctx, *args).await,
        AgentCommand::Resume {
            run_id,
            state_dir,
            tuning,
            max_steps,
            max_tokens,
            max_time,
            max_cost,
        } => {
            let budgets = NewBudgets {
                max_steps,
                max_tokens,
                max_time_secs: max_time,
                max_cost,
            };
            resume(ctx, run_id, state_dir, &tuning, budgets).await
        }
        AgentCommand::Show {
            run_id,
            state_dir,
            follow: false,
        } => show(ctx, run_id, state_dir),
        AgentCommand::Show {
            run_id,
            state_dir,
            follow: true,
        } => follow(ctx, run_id, state_dir).await,
        AgentCommand::Ls { state_dir } => ls(ctx, state_dir),
        AgentCommand::Steer {
            run_id,
            message,
            state_dir,
        } => operator(ctx, &run_id, state_dir, Command::Steer { message }),
        AgentCommand::Stop {
            run_id,
            done,
            failed: _,
            reason,
            state_dir,
        } => {
            let status = if done { StopAs::Done } else { StopAs::Failed };
            operator(ctx, &run_id, state_dir, Command::Stop { status, reason })
        }
        AgentCommand::DemoModel { listen } => demo_model(listen).await,
    }
}

/// `sbx agent steer` and `stop`: the request goes into the run's inbox (no daemon needed); the
/// run takes it at its next step boundary, or on resume. Prints the request id.
fn operator(ctx: &Ctx, run_id: &str, dir: Option<PathBuf>, command: Command) -> Result<u8> {
    let store = FileStore::new(state_dir(dir));
    let kind = command.kind();
    let sent = match inbox::send(&store, run_id, command) {
        Ok(sent) => sent,
        Err(e) => {
            if ctx.json {
                output::json(&json!({
                    "run_id": run_id,
                    "request_id": null,
                    "kind": kind,
                    "reason": refusal_reason(&e),
                    "error": e.to_string(),
                }))?;
            }
            return Err(e.into());
        }
    };
    if ctx.json {
        output::json(&json!({
            "run_id": run_id,
            "request_id": sent.id,
            "kind": kind,
            "run": sent.run,
        }))?;
        return Ok(0);
    }
    output::note(&match sent.run {
        Liveness::Running => format!("{kind} sent to run {run_id}: taken at its next step boundary"),
        Liveness::Down => format!(
            "{kind} queued for run {run_id}, which is not running: taken when it is resumed (sbx agent resume {run_id})"
        ),
    })?;
    output::stdout(format!("{}\n", sent.id).as_bytes())?;
    Ok(0)
}

/// The `reason` of a refused steer or stop, for scripts (`--json`).
fn refusal_reason(e: &InboxError) -> &'static str {
    match e {
        InboxError::UnknownRun { .. } => "unknown_run",
        InboxError::Finished { .. } => "run_finished",
        InboxError::Full { .. } => "inbox_full",
        InboxError::Inbox(
            agent_inbox::Error::EmptyMessage
            | agent_inbox::Error::MessageTooLong { .. }
            | agent_inbox::Error::ReasonTooLong { .. },
        ) => "invalid_request",
        InboxError::Checkpoint(CheckpointError::InvalidRunId(_)) => "invalid_run_id",
        InboxError::Checkpoint(CheckpointError::Corrupt { .. }) => "checkpoint_corrupt",
        InboxError::Checkpoint(CheckpointError::Incompatible { .. }) => "checkpoint_incompatible",
        InboxError::Checkpoint(_) | InboxError::Inbox(_) => "io_error",
    }
}

/// `sbx agent demo-model`: the scripted model, until SIGINT or SIGTERM.
async fn demo_model(listen: std::net::SocketAddr) -> Result<u8> {
    use agent::fixture::{demo, FixtureServer};
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let server = FixtureServer::start_on(listen, demo())
        .await
        .with_context(|| format!("cannot serve the demo model on {listen}"))?;
    output::note(&format!(
        "demo model (scripted, not an AI) on {url}\nin another terminal: OPENAI_BASE_URL={url} sbx agent run --task \"try the demo\"",
        url = server.base_url
    ))?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot wait for Ctrl-C")?,
        _ = term.recv() => {}
    }
    output::note(&format!(
        "demo model: served {} model calls",
        server.turns() + server.summaries()
    ))?;
    Ok(0)
}

/// Message when no model endpoint is configured at all.
const NO_ENDPOINT: &str = "no model endpoint: OPENAI_BASE_URL and OPENAI_API_KEY are both unset, \
so sbx agent would call OpenAI's API (https://api.openai.com/v1) without a key. Set \
OPENAI_BASE_URL to an OpenAI-compatible server: `sbx agent demo-model` (a scripted demo, \
http://127.0.0.1:8089/v1), llama.cpp's llama-server (http://127.0.0.1:8080/v1) or Ollama \
(http://127.0.0.1:11434/v1); for OpenAI, set OPENAI_API_KEY";

/// The model endpoint `sbx agent` calls, as OPENAI_BASE_URL and OPENAI_API_KEY say.
struct Endpoint {
    base: String,
    /// The base came from OPENAI_BASE_URL, not the default.
    from_env: bool,
    key: Option<String>,
}

impl Endpoint {
    /// The configured endpoint; an error when neither variable is set (calling OpenAI
    /// without a key can only fail, after minutes of retries).
    fn from_env() -> Result<Self> {
        let var = |name| {
            std::env::var(name)
                .ok()
                .filter(|v: &String| !v.trim().is_empty())
        };
        let base = var(agent::llm::BASE_URL_ENV);
        let key = var(agent::llm::API_KEY_ENV);
        if base.is_none() && key.is_none() {
            anyhow::bail!(NO_ENDPOINT);
        }
        Ok(Self {
            from_env: base.is_some(),
            base: base.unwrap_or_else(|| agent::llm::DEFAULT_BASE_URL.to_owned()),
            key,
        })
    }

    /// Whether this is OpenAI's API, whose model prices sbx knows.
    fn is_openai(&self) -> bool {
        self.base
            .split("://")
            .nth(1)
            .and_then(|rest| rest.split(['/', ':']).next())
            == Some("api.openai.com")
    }

    /// Says which endpoint the run uses and fails at once when nothing answers there: a
    /// wrong URL is a mistake to report now, not an outage to wait out for ten minutes. Any
    /// HTTP answer (a 404 included) means a server is there.
    async fn check(&self, model: &str) -> Result<()> {
        let how = if self.from_env {
            "OPENAI_BASE_URL"
        } else {
            "OPENAI_BASE_URL is unset: OpenAI's API"
        };
        output::note(&format!(
            "model endpoint: {} ({how}), model {model}",
            self.base
        ))?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(20))
            .build()
            .context("cannot build an HTTP client")?;
        let mut probe = http.get(format!("{}/models", self.base.trim_end_matches('/')));
        if let Some(key) = &self.key {
            probe = probe.bearer_auth(key);
        }
        if let Err(e) = probe.send().await {
            let mut chain = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                chain.push_str(&format!(": {s}"));
                source = s.source();
            }
            anyhow::bail!(
                "the model endpoint {} does not answer ({chain}); start the model server or set OPENAI_BASE_URL to one that runs (`sbx agent demo-model` serves a scripted demo at http://127.0.0.1:8089/v1)",
                self.base
            );
        }
        Ok(())
    }
}

/// Logs go to stderr, filtered by `SBX_LOG` (default: warnings); stdout stays for results.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SBX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn state_dir(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| {
            std::env::var_os(agent::STATE_DIR_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(agent::DEFAULT_STATE_DIR))
}

fn provider(model: &str) -> Result<Arc<dyn LlmProvider>, agent::llm::LlmError> {
    Ok(Arc::new(OpenAiProvider::from_env(model, LLM_TIMEOUT)?))
}

fn options(
    state_dir: PathBuf,
    fold_after: Option<usize>,
    llm_rate: Option<f64>,
    tuning: &LoopTuning,
) -> RunOptions {
    let mut opts = RunOptions::new(state_dir);
    if let Some(n) = tuning.stuck_after {
        opts.detector.repeat = n;
    }
    if let Some(n) = tuning.stuck_after_waiting {
        opts.detector.repeat_waiting = n;
    }
    if let Some(n) = tuning.stuck_alternations {
        opts.detector.alternations = n;
    }
    if let Some(secs) = tuning.llm_patience {
        opts.llm_backoff.patience = Some(Duration::from_secs(secs));
    }
    opts.keep_sandbox = tuning.keep_sandbox.map(Duration::from_secs);
    opts.progress = progress_sink();
    if let Some(n) = fold_after {
        opts.fold_after = n;
    }
    if let Some(rate) = llm_rate {
        opts.rate_per_sec = rate;
        opts.rate_burst = rate.ceil().max(1.0) as u32;
    }
    opts
}

async fn run(ctx: &Ctx, args: AgentRunArgs) -> Result<u8> {
    let model = args.model.clone();
    let window = args
        .context_window
        .unwrap_or_else(|| agent::tokens::default_window(&model));
    let endpoint = match Endpoint::from_env() {
        Ok(e) => e,
        Err(e) => {
            let run_id = args.run_id.as_deref().unwrap_or("-");
            return Err(failed(ctx, run_id, "no_model_endpoint", e));
        }
    };
    // A known price is OpenAI's: a local server that calls its model "gpt-4o-mini" costs nothing
    // of the kind, so elsewhere only --price counts.
    let price = match args.price.as_deref() {
        Some(p) => Some(parse_price(p)?),
        None if endpoint.is_openai() => agent::budget::known_price(&model),
        None => None,
    };
    if args.max_cost.is_some() && price.is_none() {
        anyhow::bail!("--max-cost needs a price: model {model:?} has no known price at {}, give --price IN,OUT (USD per million tokens)", endpoint.base);
    }
    let spec = RunSpec {
        task: args.task,
        model: model.clone(),
        isolation: args
            .isolation
            .map(isolation_name)
            .unwrap_or_default()
            .into(),
        image: args.image.unwrap_or_default(),
        verify: args.verify.filter(|v| !v.trim().is_empty()),
        max_steps: args.max_steps,
        context_window: window,
        managed_context: !args.no_context_management,
        max_tokens: args.max_tokens,
        max_cost: args.max_cost,
        max_time_secs: args.max_time,
        price,
        step_timeout_secs: args.step_timeout,
        max_completion_tokens: args.max_completion_tokens,
    };
    let run_id = args.run_id.unwrap_or_else(agent::runner::new_run_id);
    // Before anything is made: no sandbox, no run directory for a run that cannot start.
    if let Err(e) = endpoint.check(&model).await {
        return Err(failed(ctx, &run_id, "model_unreachable", e));
    }
    let llm = provider(&model)?;
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return Err(failed(ctx, &run_id, "fatal_error", e)),
    };
    let mut opts = options(
        state_dir(args.state_dir),
        args.fold_after,
        args.llm_rate,
        &args.tuning,
    );
    if opts.keep_sandbox.is_none() {
        opts.keep_sandbox = Some(Duration::from_secs(DEFAULT_KEEP_SANDBOX_SECS));
    }
    // Said once the run is on disk, so the hint is true whatever fails later.
    opts.started = Some(agent::ProgressSink(Arc::new(|p: &agent::Progress| {
        let run_id = &p.run_id;
        if let Err(e) = output::note(&format!(
            "agent run {run_id} (resume with: sbx agent resume {run_id})"
        )) {
            tracing::debug!(error = %e, "cannot print the resume hint");
        }
    })));
    reap(&client, &opts.state_dir).await;
    let state_dir = opts.state_dir.clone();
    let result = agent::start(client.clone(), llm, spec, Some(run_id.clone()), opts).await;
    let result = match result {
        Ok(report) if report.steps == 0 && report.status == RunStatus::Failed => {
            Ok(drop_unused_sandbox(&client, &state_dir, report).await)
        }
        other => other,
    };
    finish(ctx, &run_id, result)
}

async fn resume(
    ctx: &Ctx,
    run_id: String,
    dir: Option<PathBuf>,
    tuning: &LoopTuning,
    budgets: NewBudgets,
) -> Result<u8> {
    let mut opts = options(state_dir(dir), None, None, tuning);
    opts.new_budgets = budgets;
    // An unknown run is said at once, daemon or not, and nothing is created for it.
    let store = FileStore::new(&opts.state_dir);
    if agent::checkpoint::validate_run_id(&run_id).is_ok() && !store.run_dir(&run_id).is_dir() {
        let unknown = CheckpointError::NotFound {
            run_id: run_id.clone(),
            dir: opts.state_dir.clone(),
        };
        return finish(ctx, &run_id, Err(AgentError::Checkpoint(unknown)));
    }
    // A run that will call its model checks the endpoint first; an ended run is answered by
    // the resume itself, endpoint or not.
    if let Ok(ck) = store.load(&run_id) {
        if ck.outcome.as_ref().is_none_or(|o| o.reason.resumable()) {
            let checked = match Endpoint::from_env() {
                Ok(endpoint) => endpoint.check(&ck.spec.model).await,
                Err(e) => Err(e),
            };
            if let Err(e) = checked {
                return Err(failed(ctx, &run_id, "model_unreachable", e));
            }
        }
    }
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return Err(failed(ctx, &run_id, "fatal_error", e)),
    };
    reap(&client, &opts.state_dir).await;
    let result = agent::resume(client, |spec| provider(&spec.model), &run_id, opts).await;
    finish(ctx, &run_id, result)
}

/// A run that failed before its first step does not keep its (empty) sandbox for a day.
async fn drop_unused_sandbox(
    client: &agent_client::Client,
    state_dir: &std::path::Path,
    mut report: RunReport,
) -> RunReport {
    match agent::remove_unused_sandbox(client, state_dir, &report.run_id).await {
        Ok(Some(sandbox)) => {
            tracing::info!(run = %report.run_id, %sandbox, "removed the sandbox of a run that took no step");
            report.sandbox_id = String::new();
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(run = %report.run_id, error = %e, "cannot remove the sandbox of a run that took no step")
        }
    }
    report
}

/// Prints the report (or the reason there is none) and picks the exit code.
fn finish(ctx: &Ctx, run_id: &str, result: Result<RunReport, AgentError>) -> Result<u8> {
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            let reason = match &e {
                AgentError::Checkpoint(CheckpointError::Corrupt { .. }) => "checkpoint_corrupt",
                AgentError::Checkpoint(CheckpointError::Incompatible { .. }) => {
                    "checkpoint_incompatible"
                }
                AgentError::Checkpoint(CheckpointError::NotFound { .. }) => "unknown_run",
                AgentError::Checkpoint(CheckpointError::Locked(_)) => "run_in_use",
                AgentError::RunExists(_) => "run_exists",
                _ => "fatal_error",
            };
            return Err(failed(ctx, run_id, reason, anyhow::Error::new(e)));
        }
    };
    if ctx.json {
        output::json(&serde_json::to_value(&report).context("cannot encode the report")?)?;
    } else {
        let mut lines = vec![
            format!(
                "run {}: {} ({}) after {} steps",
                report.run_id,
                report.status.as_str(),
                report.reason,
                report.steps
            ),
            format!(
                "tokens: {} prompt + {} completion{}; {:.1}s",
                report.prompt_tokens,
                report.completion_tokens,
                match report.cost_usd {
                    Some(cost) => format!("; ${cost:.4}"),
                    None => String::new(),
                },
                report.elapsed_ms as f64 / 1000.0
            ),
            if report.sandbox_id.is_empty() {
                "sandbox: none kept (the run took no step)".to_owned()
            } else {
                format!(
                    "sandbox {}, final snapshot {}",
                    report.sandbox_id,
                    report.final_snapshot_id.as_deref().unwrap_or("-")
                )
            },
        ];
        if let Some(answer) = &report.answer {
            lines.push(format!("answer: {answer}"));
        }
        if let Some(error) = &report.error {
            lines.push(format!("error: {error}"));
        }
        if let Some(path) = &report.diff_path {
            lines.push(format!("diff: {path}"));
        }
        if report.resumable {
            lines.push(format!("resumable: sbx agent resume {}", report.run_id));
        }
        output::stdout(format!("{}\n", lines.join("\n")).as_bytes())?;
    }
    Ok(match report.status {
        RunStatus::Done => 0,
        RunStatus::Stopped => EXIT_STOPPED,
        RunStatus::Failed => 1,
    })
}

/// With `--json`, prints the failure as the one JSON object scripts expect, then hands the
/// error back for the `sbx: …` line and exit code 1.
fn failed(ctx: &Ctx, run_id: &str, reason: &str, e: anyhow::Error) -> anyhow::Error {
    if ctx.json {
        let printed = output::json(&json!({
            "run_id": run_id,
            "status": "failed",
            "reason": reason,
            "steps": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "sandbox_id": null,
            "final_snapshot_id": null,
            "answer": null,
            "error": crate::message(&e),
        }));
        if let Err(p) = printed {
            return p;
        }
    }
    e
}

/// One row of `sbx agent ls`; None for a directory that holds neither a checkpoint nor a
/// trace (not a run: what an older `sbx agent resume` of a mistyped id left behind).
fn run_row(store: &FileStore, run_id: &str) -> Option<Value> {
    let running = matches!(
        RunLock::acquire_existing(store, run_id),
        Err(CheckpointError::Locked(_))
    );
    let trace_path = store.run_dir(run_id).join("trace.jsonl");
    Some(match store.load(run_id) {
        Err(CheckpointError::NotFound { .. }) if !running && !trace_path.exists() => return None,
        Ok(ck) => {
            let (status, reason) = match &ck.outcome {
                Some(o) if !running => (o.reason.status().as_str(), Some(o.reason.as_str())),
                _ if running => ("running", None),
                _ => ("interrupted", None),
            };
            json!({
                "run_id": ck.run_id,
                "status": status,
                "reason": reason,
                "resumable": ck.outcome.as_ref().is_none_or(|o| o.reason.resumable()),
                "steps": ck.step,
                "max_steps": ck.spec.max_steps,
                "tokens": ck.budget.tokens(),
                "sandbox_id": ck.sandbox_id,
                "sandbox_removed": ck.sandbox_removed,
                "task": ck.spec.task,
            })
        }
        Err(e) => {
            // The trace still says what happened.
            let d = trace::read(&trace_path)
                .map(|events| trace::digest(&events))
                .unwrap_or_default();
            json!({
                "run_id": run_id,
                "status": if running { "running" } else { "checkpoint_damaged" },
                "reason": d.reason,
                "resumable": false,
                "steps": d.steps,
                "tokens": d.prompt_tokens + d.completion_tokens,
                "sandbox_id": d.sandbox_id,
                "task": d.task,
                "error": e.to_string(),
            })
        }
    })
}

fn ls(ctx: &Ctx, dir: Option<PathBuf>) -> Result<u8> {
    let store = FileStore::new(state_dir(dir));
    let runs_dir = store
        .run_dir("x")
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let mut ids: Vec<String> = match std::fs::read_dir(&runs_dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|id| agent::checkpoint::validate_run_id(id).is_ok())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("cannot list the runs in {}", runs_dir.display())))
        }
    };
    ids.sort();
    let rows: Vec<Value> = ids.iter().filter_map(|id| run_row(&store, id)).collect();
    if ctx.json {
        output::json(&Value::Array(rows))?;
        return Ok(0);
    }
    // Columns as wide as their widest cell: statuses with reasons and generated run ids vary.
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let status = r["status"].as_str().unwrap_or("-");
            let status = match r["reason"].as_str() {
                Some(reason) if reason != status => format!("{status} ({reason})"),
                _ => status.to_owned(),
            };
            let sandbox = if r["sandbox_removed"] == true {
                "(removed)".to_owned()
            } else {
                r["sandbox_id"].as_str().unwrap_or("-").to_owned()
            };
            vec![
                r["run_id"].as_str().unwrap_or("-").to_owned(),
                status,
                r["steps"]
                    .as_u64()
                    .map_or_else(|| "-".into(), |n| n.to_string()),
                r["tokens"]
                    .as_u64()
                    .map_or_else(|| "-".into(), |n| n.to_string()),
                sandbox,
                output::ellipsize(&r["task"].as_str().unwrap_or("").replace('\n', " "), 60),
            ]
        })
        .collect();
    let text = output::table(
        &["RUN", "STATUS", "STEPS", "TOKENS", "SANDBOX", "TASK"],
        &cells,
    );
    output::stdout(text.as_bytes())?;
    Ok(0)
}

/// `show --follow`: the timeline from the start, then each event as it is appended, until the
/// run has stopped (a `stop` event, and no process holds the run) or, when no process holds
/// it, nothing new comes.
async fn follow(ctx: &Ctx, run_id: String, dir: Option<PathBuf>) -> Result<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let store = FileStore::new(state_dir(dir));
    agent::checkpoint::validate_run_id(&run_id)?;
    if !store.run_dir(&run_id).is_dir() {
        anyhow::bail!(
            "unknown run {run_id} (no directory under {})",
            store.run_dir(&run_id).display()
        );
    }
    let path = store.run_dir(&run_id).join("trace.jsonl");
    if !ctx.json {
        output::stdout(trace::timeline_header().as_bytes())?;
    }
    let mut offset = 0u64;
    let mut stopped = false;
    let mut partial = String::new();
    let mut t0 = None;
    loop {
        let mut chunk = String::new();
        if let Ok(mut f) = std::fs::File::open(&path) {
            f.seek(SeekFrom::Start(offset))
                .with_context(|| format!("cannot read {}", path.display()))?;
            let n = f
                .read_to_string(&mut chunk)
                .with_context(|| format!("cannot read {}", path.display()))?;
            offset += n as u64;
        }
        partial.push_str(&chunk);
        // Only whole lines: the writer may be half-way through one.
        while let Some(end) = partial.find('\n') {
            let line: String = partial.drain(..=end).collect();
            let Ok(event) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            match event["event"].as_str() {
                Some("stop") => stopped = true,
                Some("resume") => stopped = false,
                _ => {}
            }
            if ctx.json {
                output::stdout(format!("{event}\n").as_bytes())?;
            } else {
                let t = *t0.get_or_insert(event["ts_ms"].as_u64().unwrap_or(0));
                if let Some(text) = trace::timeline_line(&event, t) {
                    output::stdout(text.as_bytes())?;
                }
            }
        }
        let running = matches!(
            RunLock::acquire_existing(&store, &run_id),
            Err(CheckpointError::Locked(_))
        );
        if !running && (stopped || chunk.is_empty()) {
            return Ok(0);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `show` of a run whose checkpoint cannot be read: what its trace says.
fn show_from_trace(
    ctx: &Ctx,
    store: &FileStore,
    run_id: &str,
    damaged: &CheckpointError,
) -> Result<u8> {
    let path = store.run_dir(run_id).join("trace.jsonl");
    let events = trace::read(&path)
        .with_context(|| format!("{damaged}; and its trace cannot be read either"))?;
    let d = trace::digest(&events);
    output::note(&format!(
        "the checkpoint is damaged ({damaged}); showing what the trace says"
    ))?;
    if ctx.json {
        output::json(&json!({
            "run_id": run_id,
            "from_trace": true,
            "checkpoint_error": damaged.to_string(),
            "task": d.task,
            "model": d.model,
            "reason": d.reason,
            "detail": d.detail,
            "steps": d.steps,
            "sessions": d.sessions,
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": d.completion_tokens,
            "sandbox_id": d.sandbox_id,
            "last_actions": d.last_actions,
            "events": events,
        }))?;
        return Ok(0);
    }
    let rows = [
        ("RUN", run_id.to_owned()),
        ("CHECKPOINT", format!("damaged: {damaged}")),
        (
            "TASK",
            output::ellipsize(&d.task.clone().unwrap_or_default().replace('\n', " "), 100),
        ),
        ("MODEL", d.model.clone().unwrap_or_else(|| "-".into())),
        (
            "STATUS",
            d.reason
                .clone()
                .map_or_else(|| "no stop recorded".into(), |r| format!("stopped ({r})")),
        ),
        ("STEPS", d.steps.to_string()),
        (
            "TOKENS",
            format!(
                "{} prompt + {} completion",
                d.prompt_tokens, d.completion_tokens
            ),
        ),
        (
            "SANDBOX",
            d.sandbox_id.clone().unwrap_or_else(|| "-".into()),
        ),
        ("SESSIONS", d.sessions.to_string()),
    ];
    let mut text = output::fields(&rows);
    text.push('\n');
    text.push_str(&trace::timeline(&events));
    output::stdout(text.as_bytes())?;
    Ok(0)
}

fn show(ctx: &Ctx, run_id: String, dir: Option<PathBuf>) -> Result<u8> {
    let store = FileStore::new(state_dir(dir));
    let ck = match store.load(&run_id) {
        Ok(ck) => ck,
        Err(e @ (CheckpointError::Corrupt { .. } | CheckpointError::Incompatible { .. })) => {
            return show_from_trace(ctx, &store, &run_id, &e);
        }
        Err(e) => return Err(e.into()),
    };
    let trace_path = store.run_dir(&run_id).join("trace.jsonl");
    let events = trace::read(&trace_path).unwrap_or_default();
    let status = ck.outcome.as_ref().map_or_else(
        || format!("in progress ({})", ck.state),
        |o| format!("{} ({})", o.reason.status().as_str(), o.reason),
    );
    let per_call = trace::prompt_tokens_per_call(&events);
    let waiting = Inbox::of(&store.run_dir(&run_id))
        .pending()
        .map(|p| p.len())
        .unwrap_or(0);
    if ctx.json {
        output::json(&json!({
            "run_id": ck.run_id,
            "trace_id": ck.trace_id,
            "task": ck.spec.task,
            "model": ck.spec.model,
            "status": ck.outcome.as_ref().map(|o| o.reason.status().as_str()),
            "reason": ck.outcome.as_ref().map(|o| o.reason.as_str()),
            "state": ck.state,
            "steps": ck.step,
            "max_steps": ck.spec.max_steps,
            "sessions": ck.sessions + 1,
            "prompt_tokens": ck.budget.prompt_tokens,
            "completion_tokens": ck.budget.completion_tokens,
            "max_tokens": ck.spec.max_tokens,
            "cost_usd": ck.spec.price.map(|_| ck.budget.cost_usd),
            "max_cost": ck.spec.max_cost,
            "elapsed_ms": ck.budget.elapsed_ms_before,
            "max_time_secs": ck.spec.max_time_secs,
            "sandbox_id": ck.sandbox_id,
            "snapshot_id": ck.snapshot_id,
            "final_snapshot_id": ck.outcome.as_ref().and_then(|o| o.final_snapshot_id.clone()),
            "answer": ck.outcome.as_ref().and_then(|o| o.answer.clone()),
            "pinned": ck.context.pinned,
            "operator": ck.operator,
            "steers_pinned": ck.context.steers,
            "operator_waiting": waiting,
            "prompt_tokens_per_call": per_call,
            "events": events,
        }))?;
        return Ok(0);
    }
    let budget = |used: String, limit: Option<String>| match limit {
        Some(l) => format!("{used} of {l}"),
        None => used,
    };
    let rows = [
        ("RUN", ck.run_id.clone()),
        (
            "TASK",
            output::ellipsize(&ck.spec.task.replace('\n', " "), 100),
        ),
        (
            "MODEL",
            format!(
                "{} (window {} tokens)",
                ck.spec.model, ck.spec.context_window
            ),
        ),
        ("STATUS", status),
        (
            "STEPS",
            budget(ck.step.to_string(), Some(ck.spec.max_steps.to_string())),
        ),
        (
            "TOKENS",
            budget(
                format!(
                    "{} ({} prompt + {} completion, {} calls)",
                    ck.budget.tokens(),
                    ck.budget.prompt_tokens,
                    ck.budget.completion_tokens,
                    ck.budget.llm_calls
                ),
                ck.spec.max_tokens.map(|t| t.to_string()),
            ),
        ),
        (
            "COST",
            match ck.spec.price {
                Some(_) => budget(
                    format!("${:.4}", ck.budget.cost_usd),
                    ck.spec.max_cost.map(|c| format!("${c:.4}")),
                ),
                None => "- (no price: sbx agent run --price IN,OUT)".to_owned(),
            },
        ),
        (
            "TIME",
            budget(
                format!("{:.1}s", ck.budget.elapsed_ms_before as f64 / 1000.0),
                ck.spec.max_time_secs.map(|s| format!("{s}s")),
            ),
        ),
        (
            "PROMPT/STEP",
            match (per_call.iter().min(), per_call.iter().max()) {
                (Some(min), Some(max)) => format!(
                    "min {min}, max {max}, last {}",
                    per_call.last().copied().unwrap_or(0)
                ),
                _ => "-".into(),
            },
        ),
        (
            "SANDBOX",
            format!(
                "{} (snapshot {})",
                ck.sandbox_id,
                ck.snapshot_id.as_deref().unwrap_or("-")
            ),
        ),
        ("SESSIONS", (ck.sessions + 1).to_string()),
        ("TRACE", ck.trace_id.clone()),
    ];
    let mut text = output::fields(&rows);
    if let Some(o) = &ck.outcome {
        if let Some(a) = &o.answer {
            text.push_str(&format!("ANSWER        {a}\n"));
        }
        text.push_str(&format!("SUMMARY       {}\n", o.summary));
    }
    if !ck.operator.is_empty() || waiting > 0 {
        text.push_str("\nOperator requests:\n");
        for r in &ck.operator {
            let acked = match (r.kind.as_str(), r.acked_step) {
                ("steer", Some(step)) => format!(", answered at step {step}"),
                ("steer", None) => ", pinned, not yet answered".to_owned(),
                _ => String::new(),
            };
            text.push_str(&format!(
                "  {} {} after step {}{acked}: {}\n",
                r.id,
                r.kind,
                r.step,
                output::ellipsize(&r.text.replace('\n', " "), 120)
            ));
        }
        if waiting > 0 {
            text.push_str(&format!("  {waiting} waiting for the next step boundary\n"));
        }
    }
    if !ck.context.pinned.is_empty() {
        text.push_str("\nPinned facts:\n");
        for (k, v) in &ck.context.pinned {
            text.push_str(&format!(
                "  {k}: {}\n",
                output::ellipsize(&v.replace('\n', " "), 160)
            ));
        }
    }
    text.push('\n');
    text.push_str(&trace::timeline(&events));
    output::stdout(text.as_bytes())?;
    Ok(0)
}

fn isolation_name(i: IsolationArg) -> &'static str {
    match i {
        IsolationArg::Process => "process",
        IsolationArg::Container => "container",
        IsolationArg::Microvm => "microvm",
    }
}

/// `IN,OUT` in USD per million tokens.
fn parse_price(s: &str) -> Result<(f64, f64)> {
    let (a, b) = s.split_once(',').with_context(|| {
        format!("--price {s:?}: expected IN,OUT (USD per million prompt and completion tokens)")
    })?;
    let parse = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .with_context(|| format!("--price {s:?}: {x:?} is not a non-negative number"))
    };
    Ok((parse(a)?, parse(b)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_parse() {
        assert_eq!(parse_price("2.5,10").ok(), Some((2.5, 10.0)));
        assert!(parse_price("2.5").is_err());
        assert!(parse_price("-1,2").is_err());
    }
}
