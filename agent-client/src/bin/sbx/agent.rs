//! `sbx agent run`, `resume` and `show`: the agent loop on the command line.
//!
//! Exit codes: 0 only when the run is `done`; 1 when it `failed` (or cannot start or resume:
//! a corrupt checkpoint, an unknown run); 3 when a termination rule `stopped` it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_client::agent::checkpoint::{CheckpointError, CheckpointStore, FileStore};
use agent_client::agent::{
    self, trace, AgentError, LlmProvider, OpenAiProvider, RunOptions, RunReport, RunSpec, RunStatus,
};
use anyhow::{Context, Result};
use serde_json::json;

use crate::cli::{AgentCommand, AgentRunArgs, IsolationArg};
use crate::{output, Ctx};

/// Exit code of a run stopped by a termination rule.
const EXIT_STOPPED: u8 = 3;
/// How long one model call may take.
const LLM_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs an `sbx agent` subcommand.
pub async fn agent(ctx: &Ctx, command: AgentCommand) -> Result<u8> {
    init_logging();
    match command {
        AgentCommand::Run(args) => run(ctx, *args).await,
        AgentCommand::Resume { run_id, state_dir } => resume(ctx, run_id, state_dir).await,
        AgentCommand::Show { run_id, state_dir } => show(ctx, run_id, state_dir),
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

fn options(state_dir: PathBuf, fold_after: Option<usize>, llm_rate: Option<f64>) -> RunOptions {
    let mut opts = RunOptions::new(state_dir);
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
    let price = match args.price.as_deref() {
        Some(p) => Some(parse_price(p)?),
        None => agent::budget::known_price(&model),
    };
    if args.max_cost.is_some() && price.is_none() {
        anyhow::bail!("--max-cost needs a price: model {model:?} has no known price, give --price IN,OUT (USD per million tokens)");
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
    let llm = provider(&model)?;
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return Err(failed(ctx, &run_id, "fatal_error", e)),
    };
    output::note(&format!(
        "agent run {run_id} (resume with: sbx agent resume {run_id})"
    ))?;
    let opts = options(state_dir(args.state_dir), args.fold_after, args.llm_rate);
    let result = agent::start(client, llm, spec, Some(run_id.clone()), opts).await;
    finish(ctx, &run_id, result)
}

async fn resume(ctx: &Ctx, run_id: String, dir: Option<PathBuf>) -> Result<u8> {
    let opts = options(state_dir(dir), None, None);
    let client = match ctx.client().await {
        Ok(c) => c,
        Err(e) => return Err(failed(ctx, &run_id, "fatal_error", e)),
    };
    let result = agent::resume(client, |spec| provider(&spec.model), &run_id, opts).await;
    finish(ctx, &run_id, result)
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
                if report.cost_usd > 0.0 {
                    format!("; ${:.4}", report.cost_usd)
                } else {
                    String::new()
                },
                report.elapsed_ms as f64 / 1000.0
            ),
            format!(
                "sandbox {}, final snapshot {}",
                report.sandbox_id,
                report.final_snapshot_id.as_deref().unwrap_or("-")
            ),
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

fn show(ctx: &Ctx, run_id: String, dir: Option<PathBuf>) -> Result<u8> {
    let store = FileStore::new(state_dir(dir));
    let ck = store.load(&run_id)?;
    let trace_path = store.run_dir(&run_id).join("trace.jsonl");
    let events = trace::read(&trace_path).unwrap_or_default();
    let status = ck.outcome.as_ref().map_or_else(
        || format!("in progress ({})", ck.state),
        |o| format!("{} ({})", o.reason.status().as_str(), o.reason),
    );
    let per_call = trace::prompt_tokens_per_call(&events);
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
            "cost_usd": ck.budget.cost_usd,
            "max_cost": ck.spec.max_cost,
            "elapsed_ms": ck.budget.elapsed_ms_before,
            "max_time_secs": ck.spec.max_time_secs,
            "sandbox_id": ck.sandbox_id,
            "snapshot_id": ck.snapshot_id,
            "final_snapshot_id": ck.outcome.as_ref().and_then(|o| o.final_snapshot_id.clone()),
            "answer": ck.outcome.as_ref().and_then(|o| o.answer.clone()),
            "pinned": ck.context.pinned,
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
            budget(
                format!("${:.4}", ck.budget.cost_usd),
                ck.spec.max_cost.map(|c| format!("${c:.4}")),
            ),
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
