//! `agent_bench`: prompt tokens per step over a 200-step scripted run with and without context
//! management, and checkpoint write latency.
//!
//! The model is the scripted fixture over real HTTP; the sandbox is the in-memory fake by
//! default (so the numbers are about the loop, not the daemon), or a real daemon with
//! `--socket ADDR`. Prints a table; with `--out FILE` also writes it as the `## Agent loop`
//! section of that Markdown file, leaving the rest of the file alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_client::agent::checkpoint::{CheckpointStore, FileStore};
use agent_client::agent::fixture::{FixtureServer, Reply, Script, Turn};
use agent_client::agent::sandbox::{basic_handler, FakeSandbox, SandboxApi};
use agent_client::agent::{
    self, trace, LlmProvider, OpenAiProvider, RunOptions, RunReport, RunSpec,
};
use anyhow::{Context, Result};
use clap::Parser;

/// Benchmark of the agent loop's context management and checkpoints.
#[derive(Clone, Debug, Parser)]
struct Args {
    /// Steps of the scripted run.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Context window of the managed run, tokens.
    #[arg(long, default_value_t = 16_000)]
    window: usize,
    /// Run against this daemon instead of the in-memory sandbox.
    #[arg(long)]
    socket: Option<String>,
    /// Checkpoint writes to time in the micro-benchmark.
    #[arg(long, default_value_t = 500)]
    writes: usize,
    /// Where to keep runs and checkpoints [default: a temporary directory].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Delay of each model answer, ms (the fixture answers at once otherwise).
    #[arg(long, default_value_t = 0)]
    model_latency_ms: u64,
    /// Markdown file whose `## Agent loop` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

struct RunResult {
    report: RunReport,
    per_step: Vec<u64>,
    wall: Duration,
}

fn script(steps: usize, latency: Duration) -> Script {
    Script::from_fn(move |t: &Turn| {
        let reply = if t.index + 1 >= steps {
            Reply::finish("done")
        } else {
            // Outputs of 60..160 lines, different each step, like a build or test log.
            Reply::bash(&format!("seq {}", 60 + (t.index * 37) % 100))
        };
        if latency.is_zero() {
            reply
        } else {
            Reply::Delay(latency, Box::new(reply))
        }
    })
}

/// The benchmark task with a step budget and a context window.
fn run_spec(max_steps: u64, context_window: usize, managed_context: bool) -> RunSpec {
    RunSpec {
        task: "Count lines, step by step, and report the totals.".into(),
        model: "gpt-4o".into(),
        isolation: String::new(),
        image: String::new(),
        verify: None,
        max_steps,
        context_window,
        managed_context,
        max_tokens: None,
        max_cost: None,
        max_time_secs: None,
        price: None,
        step_timeout_secs: 60,
        max_completion_tokens: 1_000,
    }
}

/// The scripted model at `base_url`, and run options without rate limiting, runs kept in `dir`.
fn model_and_options(base_url: &str, dir: &Path) -> Result<(Arc<dyn LlmProvider>, RunOptions)> {
    let llm: Arc<dyn LlmProvider> = Arc::new(OpenAiProvider::new(
        base_url,
        None,
        "gpt-4o",
        Duration::from_secs(60),
    )?);
    let mut opts = RunOptions::new(dir);
    opts.rate_burst = 1_000;
    opts.rate_per_sec = 1_000.0;
    Ok((llm, opts))
}

async fn one_run<S: SandboxApi + Clone + 'static>(
    sandbox: S,
    base_url: &str,
    managed: bool,
    args: &Args,
    dir: &Path,
) -> Result<RunResult> {
    let run_id = if managed { "managed" } else { "full" };
    let window = if managed { args.window } else { 10_000_000 };
    let spec = run_spec(args.steps as u64 + 10, window, managed);
    let (llm, opts) = model_and_options(base_url, dir)?;
    let started = Instant::now();
    let report = agent::start(sandbox, llm, spec, Some(run_id.into()), opts).await?;
    let wall = started.elapsed();
    let events = trace::read(&FileStore::new(dir).run_dir(run_id).join("trace.jsonl"))?;
    Ok(RunResult {
        report,
        per_step: trace::prompt_tokens_per_call(&events),
        wall,
    })
}

/// Resume time of a long run: a run stopped by its step budget after `steps` steps, continued
/// with a budget of one more step. Timed from the resume call to its report: loading the
/// checkpoint, finding the last exec by its idempotency key, and one more model call and action.
async fn resume_after<S: SandboxApi + Clone + 'static>(
    sandbox: S,
    steps: usize,
    dir: &Path,
) -> Result<(u64, Duration)> {
    // A script that never finishes on its own: the step budget stops it.
    let server = FixtureServer::start(script(usize::MAX, Duration::ZERO)).await?;
    let spec = run_spec(steps as u64, 16_000, true);
    let (llm, mut opts) = model_and_options(&server.base_url, dir)?;
    let first = agent::start(
        sandbox.clone(),
        llm.clone(),
        spec,
        Some("resumed".into()),
        opts.clone(),
    )
    .await?;
    opts.new_budgets.max_steps = Some(steps as u64 + 1);
    let started = Instant::now();
    let report = agent::resume(sandbox, move |_| Ok(llm), "resumed", opts).await?;
    let took = started.elapsed();
    anyhow::ensure!(
        report.steps > first.steps,
        "the resumed run took no step ({} then {})",
        first.steps,
        report.steps
    );
    Ok((first.steps, took))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

/// Latencies of one kind of checkpoint work, ms.
struct Timing {
    p50: f64,
    p99: f64,
}

fn timed(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<Timing> {
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok(Timing {
        p50: percentile(&ms, 0.5),
        p99: percentile(&ms, 0.99),
    })
}

/// Times the final checkpoint of a run three ways: encoding alone (JSON + SHA-256), a durable
/// write to the state dir (encode + temp file + fsync + rename + directory fsync), and the same
/// write to tmpfs, which shows what the disk's fsync costs.
fn checkpoint_latency(
    store: &FileStore,
    run_id: &str,
    writes: usize,
) -> Result<(usize, Timing, Timing, Option<Timing>)> {
    let ck = store.load(run_id)?;
    let size = agent::checkpoint::encode(&ck).len();
    let encode = timed(writes, || {
        std::hint::black_box(agent::checkpoint::encode(&ck));
        Ok(())
    })?;
    let disk = timed(writes, || Ok(store.save(&ck)?))?;
    let shm = Path::new("/dev/shm");
    let tmpfs = if shm.is_dir() {
        let dir = tempfile::Builder::new()
            .prefix("agent-bench-")
            .tempdir_in(shm)?;
        let mem = FileStore::new(dir.path());
        Some(timed(writes, || Ok(mem.save(&ck)?))?)
    } else {
        None
    };
    Ok((size, encode, disk, tmpfs))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let load_before = loadavg();
    let tmp = tempfile::Builder::new().prefix("agent-bench-").tempdir()?;
    let dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let mut results = Vec::new();
    for managed in [true, false] {
        let server = FixtureServer::start(script(
            args.steps,
            Duration::from_millis(args.model_latency_ms),
        ))
        .await?;
        let r = match &args.socket {
            Some(addr) => {
                let client = agent_client::Client::connect(addr)
                    .await
                    .context("connecting to the daemon")?;
                one_run(client, &server.base_url, managed, &args, &dir).await?
            }
            None => {
                one_run(
                    FakeSandbox::new(basic_handler()),
                    &server.base_url,
                    managed,
                    &args,
                    &dir,
                )
                .await?
            }
        };
        results.push(r);
    }
    // The background write hides behind the model call only if the call takes longer than the
    // write; a short run with a realistic model delay shows the stall then.
    let stall = {
        let short = Args {
            steps: 40,
            model_latency_ms: 100,
            ..args.clone()
        };
        let server = FixtureServer::start(script(short.steps, Duration::from_millis(100))).await?;
        let sub = dir.join("with-latency");
        let r = one_run(
            FakeSandbox::new(basic_handler()),
            &server.base_url,
            true,
            &short,
            &sub,
        )
        .await?;
        r.report.checkpoint_stall_ms_max
    };
    let resume_dir = dir.join("resume");
    let (resume_steps, resume_time) = match &args.socket {
        Some(addr) => {
            resume_after(
                agent_client::Client::connect(addr)
                    .await
                    .context("connecting to the daemon")?,
                100,
                &resume_dir,
            )
            .await?
        }
        None => resume_after(FakeSandbox::new(basic_handler()), 100, &resume_dir).await?,
    };
    let (m, f) = (&results[0], &results[1]);
    let total = |r: &RunResult| r.per_step.iter().sum::<u64>();
    let max = |r: &RunResult| r.per_step.iter().copied().max().unwrap_or(0);
    let mean = |r: &RunResult| total(r) as f64 / r.per_step.len().max(1) as f64;
    let store = FileStore::new(&dir);
    let managed_ck = checkpoint_latency(&store, "managed", args.writes)?;
    let full_ck = checkpoint_latency(&store, "full", args.writes / 5)?;

    let sandbox = if args.socket.is_some() {
        "sandboxd (real daemon)"
    } else {
        "in-memory sandbox"
    };
    let mut md = String::new();
    md.push_str("## Agent loop\n\n");
    md.push_str(&format!(
        "`agent_bench` (`cargo run --release -p agent-client --bin agent_bench -- --out BENCHMARKS.md`): a {}-step scripted run \
         (each step a command printing 60–160 lines), model = the scripted OpenAI-compatible fixture over HTTP, \
         sandbox = {sandbox}, tokens counted with tiktoken `o200k_base` (model `gpt-4o`). \
         Managed = folding beyond the last 5 results + summarization at 70% of a {}-token window; \
         full = every message kept.\n\n",
        args.steps, args.window
    ));
    md.push_str("Prompt tokens per step:\n\n| step | managed | full history |\n|---:|---:|---:|\n");
    let n = m.per_step.len().min(f.per_step.len());
    let mut rows: Vec<usize> = vec![1, 5, 10, 25, 50, 75, 100, 125, 150, 175];
    rows.push(n);
    for s in rows.into_iter().filter(|s| *s >= 1 && *s <= n) {
        md.push_str(&format!(
            "| {s} | {} | {} |\n",
            m.per_step[s - 1],
            f.per_step[s - 1]
        ));
    }
    md.push_str(&format!(
        "\n| run | steps | mean tokens/step | max tokens/step | total prompt tokens | wall time |\n|---|---:|---:|---:|---:|---:|\n\
         | managed | {} | {:.0} | {} | {} | {:.1} s |\n| full history | {} | {:.0} | {} | {} | {:.1} s |\n\n",
        m.report.steps, mean(m), max(m), total(m), m.wall.as_secs_f64(),
        f.report.steps, mean(f), max(f), total(f), f.wall.as_secs_f64(),
    ));
    md.push_str(&format!(
        "Managed context uses **{:.1}× fewer** prompt tokens in total; its prompt peaks at {} tokens \
         ({:.0}% of the window, where summarization fires) however long the run, while the full history grows \
         by every step's output.\n\n",
        total(f) as f64 / total(m).max(1) as f64,
        max(m),
        100.0 * max(m) as f64 / args.window as f64
    ));
    md.push_str(
        "Checkpoint writes (the final checkpoint of each run; durable = encode + temp file + fsync + rename + \
         directory fsync):\n\n| checkpoint | size | encode + SHA-256 p50 / p99 | durable, state dir p50 / p99 | \
         durable, tmpfs p50 / p99 |\n|---|---:|---:|---:|---:|\n",
    );
    for (name, (size, enc, disk, mem)) in
        [("managed run", &managed_ck), ("full-history run", &full_ck)]
    {
        md.push_str(&format!(
            "| {name} | {:.0} KiB | {:.2} / {:.2} ms | {:.2} / {:.2} ms | {} |\n",
            *size as f64 / 1024.0,
            enc.p50,
            enc.p99,
            disk.p50,
            disk.p99,
            mem.as_ref()
                .map_or_else(|| "-".into(), |t| format!("{:.2} / {:.2} ms", t.p50, t.p99)),
        ));
    }
    md.push_str(&format!(
        "\nIn the loop (managed run, {} writes): p50 {:.2} ms, p99 {:.2} ms. The step checkpoint is written in the \
         background while the next model call runs and awaited only before the next action. With the fixture \
         answering after {} ms the loop still waited up to {:.2} ms (managed) / {:.2} ms (full) for one; with \
         answers after 100 ms (a fast real model; 40 steps) the longest wait was {:.2} ms. The pending-action \
         checkpoint, durable before the action is sent, is the one write on the hot path; its cost is the disk's \
         fsync, as the tmpfs column shows.\n",
        m.report.steps * 2,
        m.report.checkpoint_ms_p50,
        m.report.checkpoint_ms_p99,
        args.model_latency_ms,
        m.report.checkpoint_stall_ms_max,
        f.report.checkpoint_stall_ms_max,
        stall,
    ));
    md.push_str(&format!(
        "\nResume of a long run: a run stopped by its step budget after {resume_steps} steps, continued with one more \
         step (`resume` with a new budget: checkpoint load, the last exec found by its idempotency key, one model call \
         and action): **{:.1} ms** ({sandbox}).\n",
        resume_time.as_secs_f64() * 1000.0,
    ));
    md.push_str(&format!(
        "\nLoad average (1, 5, 15 min) before → after: {} → {} on {} CPUs; fsync latency on a shared \
         disk varies with it.\n",
        load_before,
        loadavg(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    print!("{md}");
    if let Some(out) = &args.out {
        write_section(out, &md)?;
        eprintln!("wrote the `## Agent loop` section of {}", out.display());
    }
    Ok(())
}

/// Replaces the `## Agent loop` section of a Markdown file (up to the next `## ` heading), or
/// appends it.
fn write_section(path: &Path, section: &str) -> Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let new = replace_section(&old, "## Agent loop", section);
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

fn replace_section(doc: &str, heading: &str, section: &str) -> String {
    let lines: Vec<&str> = doc.lines().collect();
    let Some(start) = lines.iter().position(|l| l.trim_end() == heading) else {
        let mut out = doc.trim_end().to_owned();
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(section.trim_end());
        out.push('\n');
        return out;
    };
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## ") || l.starts_with("# "))
        .map_or(lines.len(), |i| start + 1 + i);
    let mut out = lines[..start].join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(section.trim_end());
    out.push('\n');
    if end < lines.len() {
        out.push('\n');
        out.push_str(&lines[end..].join("\n"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn section_is_replaced_or_appended() {
        let doc = "# Bench\n\n## Latency\nfast\n\n## Agent loop\nold\nold\n\n## Density\nmany\n";
        let out = replace_section(doc, "## Agent loop", "## Agent loop\nnew\n");
        assert_eq!(
            out,
            "# Bench\n\n## Latency\nfast\n\n## Agent loop\nnew\n\n## Density\nmany\n"
        );
        let out = replace_section("# Bench\n", "## Agent loop", "## Agent loop\nnew\n");
        assert_eq!(out, "# Bench\n\n## Agent loop\nnew\n");
        let out = replace_section(
            "# B\n\n## Agent loop\nold\n",
            "## Agent loop",
            "## Agent loop\nnew\n",
        );
        assert_eq!(out, "# B\n\n## Agent loop\nnew\n");
    }
}
