//! `bench`: latency and density of `sandboxd`, with Docker measured in the same run.
//!
//! Starts the real daemon (`SANDBOXD_BIN`) through the test harness, drives it with the real
//! client over its UNIX socket, measures the Docker Engine API the same way (one API client, one
//! call after another), prints a markdown report and, with `--out`, writes it to a file.
//! `make bench` runs it as `target/release/bench --out BENCHMARKS.md`.
//!
//! Every sandbox and container it makes is removed again, also when a section fails or the run
//! is interrupted with Ctrl-C. Docker missing is not a failure (its rows say "unavailable");
//! a sandboxd section that fails is, and the exit code says so. Targets that are missed are
//! reported as MISS but do not change the exit code: this is a measurement, not a gate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use agent_client::{exec_request, Client};
use anyhow::{anyhow, bail, Context, Result};
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, RemoveImageOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::Docker;
use clap::Parser;
use futures::StreamExt;
use sandbox_tests::{
    images_dir, process_sandbox, proto, rss_bytes, sandboxd_bin, workspace_root, Daemon,
};

/// Where the Docker Engine listens, unless `DOCKER_HOST` names another `unix://` socket.
const DOCKER_SOCKET: &str = "/var/run/docker.sock";
/// The image the Docker baseline imports from the `minimal` rootfs (no registry involved).
const DOCKER_IMAGE: &str = "sandboxd-bench-minimal:latest";
/// Label on every container the bench makes, so leftovers of a killed run can be found.
const DOCKER_LABEL: &str = "sandboxd-bench";
/// Targets from the issue.
const TARGET_CREATE_P50_MS: f64 = 20.0;
const TARGET_EXEC_P50_MS: f64 = 3.0;
const TARGET_LIVE: usize = 100;
const TARGET_RSS_BYTES: u64 = 100 << 20;

/// Pause between the execs of the spaced exec row: an agent that thinks between commands.
/// Longer than a few RCU grace periods, so each exec meets the kernel as a lone one would.
const EXEC_GAP: Duration = Duration::from_millis(100);

/// Set by Ctrl-C; every measuring loop checks it so the normal error path cleans up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C)");
    }
    Ok(())
}

#[derive(Parser, Debug)]
#[command(about = "Latency and density of sandboxd, with Docker measured in the same run")]
struct Args {
    /// Also write the report (markdown) to this file, e.g. BENCHMARKS.md.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Samples in every latency section. Default: each section's own (100 creates, 1,000
    /// GetSandbox calls and execs back to back, 100 execs 100 ms apart, 200 streamed execs,
    /// 30 docker runs and create+starts, 200 docker execs).
    #[arg(long)]
    iterations: Option<usize>,
    /// Sandboxes kept alive at once in the density section (default 100; 10 with --quick).
    #[arg(long)]
    live: Option<usize>,
    /// Smoke mode: a few samples per section, done in seconds. Not numbers to compare.
    #[arg(long)]
    quick: bool,
    /// Leave out the Docker baseline.
    #[arg(long)]
    no_docker: bool,
}

/// How many samples each section takes.
#[derive(Debug, Clone, Copy)]
struct Plan {
    quick: bool,
    create: usize,
    exec: usize,
    stream: usize,
    spaced: usize,
    live: usize,
    docker_run: usize,
    docker_create: usize,
    docker_exec: usize,
    /// Untimed calls before each section, so one-off costs (page faults, first connection,
    /// lazily built state) do not land in the first sample.
    warmup: usize,
}

impl Plan {
    fn new(args: &Args) -> Self {
        let mut p = if args.quick {
            Plan {
                quick: true,
                create: 10,
                exec: 50,
                stream: 20,
                spaced: 10,
                live: 10,
                docker_run: 3,
                docker_create: 3,
                docker_exec: 10,
                warmup: 1,
            }
        } else {
            Plan {
                quick: false,
                create: 100,
                exec: 1000,
                stream: 200,
                spaced: 100,
                live: TARGET_LIVE,
                docker_run: 30,
                docker_create: 30,
                docker_exec: 200,
                warmup: 3,
            }
        };
        if let Some(n) = args.iterations {
            let n = n.max(1);
            (
                p.create,
                p.exec,
                p.stream,
                p.spaced,
                p.docker_run,
                p.docker_create,
                p.docker_exec,
            ) = (n, n, n, n, n, n, n);
        }
        if let Some(n) = args.live {
            p.live = n.max(1);
        }
        p
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics

/// n, p50, p99, mean and max of one set of samples, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Summary {
    n: usize,
    p50: f64,
    p99: f64,
    mean: f64,
    max: f64,
}

/// Nearest-rank percentile of sorted samples: the smallest sample with at least `p`% of the
/// samples at or below it (so p99 of fewer than 100 samples is the maximum).
fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    Some(Summary {
        n: ms.len(),
        p50: nearest_rank(&ms, 50.0),
        p99: nearest_rank(&ms, 99.0),
        mean: ms.iter().sum::<f64>() / ms.len() as f64,
        max: ms[ms.len() - 1],
    })
}

// ---------------------------------------------------------------------------------------------
// The report

/// One row of the results table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Create,
    Destroy,
    Get,
    Exec,
    ExecSpaced,
    ExecStream,
    LiveCreate,
    LiveExec,
    LiveDestroy,
    DockerRun,
    DockerCreateStart,
    DockerCreateStartBridge,
    DockerRemove,
    DockerExec,
}

impl Key {
    const SANDBOXD: [Key; 9] = [
        Key::Create,
        Key::Destroy,
        Key::Get,
        Key::Exec,
        Key::ExecSpaced,
        Key::ExecStream,
        Key::LiveCreate,
        Key::LiveExec,
        Key::LiveDestroy,
    ];
    const DOCKER: [Key; 5] = [
        Key::DockerRun,
        Key::DockerCreateStart,
        Key::DockerCreateStartBridge,
        Key::DockerRemove,
        Key::DockerExec,
    ];

    fn label(self, live: usize) -> String {
        match self {
            Key::Create => "sandboxd `CreateSandbox` (process tier, image minimal)".into(),
            Key::Destroy => "sandboxd `DestroySandbox`".into(),
            Key::Get => "sandboxd `GetSandbox` (the gRPC floor: no process is started)".into(),
            Key::Exec => "sandboxd `Exec` of `true` (unary), back to back".into(),
            Key::ExecSpaced => format!(
                "sandboxd `Exec` of `true` (unary), {} ms apart",
                EXEC_GAP.as_millis()
            ),
            Key::ExecStream => "sandboxd `ExecStream` of `true`".into(),
            Key::LiveCreate => format!("sandboxd `CreateSandbox`, filling up to {live} live"),
            Key::LiveExec => format!("sandboxd `Exec` of `true` across {live} live sandboxes"),
            Key::LiveDestroy => format!("sandboxd `DestroySandbox`, emptying {live} live"),
            Key::DockerRun => "Docker `run --rm` of `true` (create+start+wait+remove)".into(),
            Key::DockerCreateStart => "Docker container create+start (`--network none`)".into(),
            Key::DockerCreateStartBridge => {
                "Docker container create+start (default bridge network)".into()
            }
            Key::DockerRemove => "Docker `rm -f` of a running container".into(),
            Key::DockerExec => "Docker `exec` of `true` (exec create+start+inspect)".into(),
        }
    }
}

#[derive(Debug, Clone)]
enum Outcome {
    Measured(Summary),
    /// Docker could not be reached or could not run the section: not a failure of the bench.
    Unavailable(String),
    /// A sandboxd section failed: the bench exits non-zero.
    Failed(String),
}

/// What the density section found.
#[derive(Debug, Clone)]
struct Density {
    live: usize,
    rss_idle: Option<u64>,
    rss_live: Option<u64>,
    /// PSS of the daemon and every process under it (shims, inits), and how many processes.
    pss_tree: Option<(u64, usize)>,
    create_total: Duration,
    destroy_total: Duration,
    rss_after: Option<u64>,
}

#[derive(Debug, Default)]
struct Report {
    rows: BTreeMap<Key, Outcome>,
    density: Option<Result<Density, String>>,
    /// RSS of the latency daemon once its sections were done and nothing was live.
    rss_after_latency: Option<u64>,
    docker: Option<String>,
    docker_unavailable: Option<String>,
    docker_import: Option<Duration>,
    section_times: Vec<(String, Duration)>,
}

impl Report {
    fn measured(&mut self, key: Key, samples: &[Duration]) {
        let outcome = match summarize(samples) {
            Some(s) => Outcome::Measured(s),
            None => Outcome::Failed("no samples".into()),
        };
        self.rows.insert(key, outcome);
    }

    fn failed(&mut self, keys: &[Key], err: &anyhow::Error) {
        let msg = format!("{err:#}");
        eprintln!(
            "bench: FAILED {}: {msg}",
            keys.iter()
                .map(|k| format!("{k:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for k in keys {
            self.rows.insert(*k, Outcome::Failed(msg.clone()));
        }
    }

    fn unavailable(&mut self, keys: &[Key], reason: &str) {
        for k in keys {
            self.rows
                .entry(*k)
                .or_insert_with(|| Outcome::Unavailable(reason.to_string()));
        }
    }

    fn p50(&self, key: Key) -> Option<f64> {
        match self.rows.get(&key) {
            Some(Outcome::Measured(s)) => Some(s.p50),
            _ => None,
        }
    }

    fn any_failed(&self) -> bool {
        self.rows.values().any(|o| matches!(o, Outcome::Failed(_)))
            || matches!(self.density, Some(Err(_)))
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 1000.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// Markdown table cells can hold neither newlines nor pipes.
fn cell(s: &str) -> String {
    let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let short: String = if one_line.chars().count() > 160 {
        one_line.chars().take(160).chain("…".chars()).collect()
    } else {
        one_line
    };
    short.replace('|', "\\|")
}

fn render(report: &Report, plan: &Plan, machine: &Machine, total: Duration) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# sandboxd benchmarks\n");
    let _ = writeln!(
        w,
        "Written by `make bench` (`target/release/bench --out BENCHMARKS.md`) on {}; the run took {:.0} s.{}\n\
         Numbers from one machine do not carry over to another: re-run the bench where it matters.\n",
        machine.date,
        total.as_secs_f64(),
        if plan.quick { " **Quick mode: a smoke run with few samples, not numbers to compare.**" } else { "" }
    );

    let _ = writeln!(w, "## Machine\n");
    let _ = writeln!(w, "| | |\n|---|---|");
    for (k, v) in machine.rows(report) {
        let _ = writeln!(w, "| {k} | {} |", cell(&v));
    }

    let _ = writeln!(w, "\n## Latency\n");
    let _ = writeln!(
        w,
        "Milliseconds of wall time per API call, as the client sees it.\n"
    );
    let _ = writeln!(
        w,
        "| measurement | n | p50 ms | p99 ms | mean ms | max ms |\n|---|---:|---:|---:|---:|---:|"
    );
    for key in Key::SANDBOXD.iter().chain(Key::DOCKER.iter()) {
        let label = key.label(plan.live);
        match report.rows.get(key) {
            Some(Outcome::Measured(s)) => {
                let _ = writeln!(
                    w,
                    "| {label} | {} | {} | {} | {} | {} |",
                    s.n,
                    ms(s.p50),
                    ms(s.p99),
                    ms(s.mean),
                    ms(s.max)
                );
            }
            Some(Outcome::Unavailable(why)) => {
                let _ = writeln!(w, "| {label} | — | unavailable | | | {} |", cell(why));
            }
            Some(Outcome::Failed(why)) => {
                let _ = writeln!(w, "| {label} | — | **FAILED** | | | {} |", cell(why));
            }
            None => {
                let _ = writeln!(w, "| {label} | — | not run | | | |");
            }
        }
    }

    let _ = writeln!(w, "\n## Density\n");
    match &report.density {
        Some(Ok(d)) => {
            let opt = |v: Option<u64>| v.map(mib).unwrap_or_else(|| "unknown".into());
            let _ = writeln!(w, "A fresh daemon, then {} process-tier sandboxes created one after another and kept alive:\n", d.live);
            let _ = writeln!(w, "- daemon RSS (VmRSS) idle: {}; with {} live: **{}**; after destroying them all: {}", opt(d.rss_idle), d.live, opt(d.rss_live), opt(d.rss_after));
            if let Some((pss, procs)) = d.pss_tree {
                let _ = writeln!(
                    w,
                    "- the daemon and every process under it ({procs} processes: per-sandbox shim and init) together: {} PSS, {:.2} MiB per sandbox",
                    mib(pss),
                    pss as f64 / (1u64 << 20) as f64 / d.live.max(1) as f64
                );
            }
            let _ = writeln!(w, "- time to create all {}: {:.2} s ({:.1} ms each on average); to destroy them all: {:.2} s", d.live, d.create_total.as_secs_f64(), d.create_total.as_secs_f64() * 1e3 / d.live.max(1) as f64, d.destroy_total.as_secs_f64());
        }
        Some(Err(e)) => {
            let _ = writeln!(w, "**FAILED**: {}", cell(e));
        }
        None => {
            let _ = writeln!(w, "not run");
        }
    }
    if let Some(rss) = report.rss_after_latency {
        let _ = writeln!(
            w,
            "- the latency daemon, after its creates, destroys and execs with nothing live: {} RSS",
            mib(rss)
        );
    }

    let _ = writeln!(w, "\n## Against Docker\n");
    let _ = writeln!(
        w,
        "p50 against p50, measured in this run; ratio = Docker ÷ sandboxd.\n"
    );
    let _ = writeln!(
        w,
        "| | sandboxd p50 ms | Docker p50 ms | ratio |\n|---|---:|---:|---:|"
    );
    let one_shot = match (
        report.p50(Key::Create),
        report.p50(Key::Exec),
        report.p50(Key::Destroy),
    ) {
        (Some(c), Some(e), Some(d)) => Some(c + e + d),
        _ => None,
    };
    let comparisons = [
        (
            "a sandbox ready to exec: `CreateSandbox` vs container create+start (`--network none`)",
            report.p50(Key::Create),
            report.p50(Key::DockerCreateStart),
        ),
        (
            "run `true` in it: `Exec` vs `docker exec`",
            report.p50(Key::Exec),
            report.p50(Key::DockerExec),
        ),
        (
            "tear down: `DestroySandbox` vs `rm -f`",
            report.p50(Key::Destroy),
            report.p50(Key::DockerRemove),
        ),
        (
            "one-shot `true`: create+exec+destroy (sum of p50s) vs `docker run --rm`",
            one_shot,
            report.p50(Key::DockerRun),
        ),
    ];
    for (what, ours, theirs) in comparisons {
        let f = |v: Option<f64>| v.map(ms).unwrap_or_else(|| "unavailable".into());
        let ratio = match (ours, theirs) {
            (Some(o), Some(t)) if o > 0.0 => format!("{:.1}×", t / o),
            _ => "—".into(),
        };
        let _ = writeln!(w, "| {what} | {} | {} | {ratio} |", f(ours), f(theirs));
    }

    let _ = writeln!(w, "\n## Targets\n");
    let _ = writeln!(w, "| target | measured | result |\n|---|---|---|");
    for (target, measured, result) in targets(report) {
        let _ = writeln!(w, "| {target} | {} | {result} |", cell(&measured));
    }

    let _ = writeln!(w, "\n## How measured\n");
    let _ = writeln!(
        w,
        "The bench starts the release `sandboxd` ({}) with a state dir of its own and talks to it with \
         `agent-client` over its UNIX socket: one HTTP/2 connection, one call at a time, each sample the wall \
         time of one call from send to complete answer. `CreateSandbox` returns when the sandbox can exec; \
         every exec is checked to have exited 0. Creates are timed apart from their destroys ({} cycles). \
         `GetSandbox` calls, unary execs back to back, unary execs {} ms apart (the pause is not timed: it is \
         an agent thinking between commands) and streamed execs each run in one sandbox; a few untimed \
         calls before each section ({} creates, {} calls) take one-off costs out. Execs are timed both ways \
         because on cgroup v1 moving the exec into its cgroups can wait for an RCU grace period, which \
         back-to-back execs often skip and a lone one pays. The density section uses a second, fresh \
         daemon: it creates {} \
         sandboxes in turn, reads the daemon's VmRSS from /proc/<pid>/status (and the PSS of its whole \
         process tree from /proc/<pid>/smaps_rollup), runs `true` in each sandbox 3 times round-robin, then \
         destroys them. Docker is driven through its Engine API at {} with `bollard` from the \
         same process, so API call is compared with API call: the image `{DOCKER_IMAGE}` is imported from \
         the same `minimal` rootfs (no registry); `run --rm` is create, start, wait, remove; `exec` is what \
         the CLI does (exec create, attached start, inspect for the exit code); containers use `--network none` \
         like a sandbox, except in the row that says otherwise. Percentiles are nearest-rank over the sorted \
         samples, so p99 of fewer than 100 samples is the maximum. The machine has {} CPUs and other work may \
         run beside the bench: the load average before and after is in the table above.",
        machine.sandboxd_bin,
        plan.create,
        EXEC_GAP.as_millis(),
        plan.warmup,
        plan.warmup * 3,
        plan.live,
        docker_socket(),
        machine.nproc,
    );
    let _ = writeln!(
        w,
        "\nTime per section: {}.",
        report
            .section_times
            .iter()
            .map(|(s, d)| format!("{s} {:.1} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    md
}

/// (target, what was measured, PASS / MISS / not measured) for each target of the issue.
fn targets(report: &Report) -> Vec<(String, String, String)> {
    let verdict = |ok: bool| {
        if ok {
            "PASS".to_string()
        } else {
            "**MISS**".to_string()
        }
    };
    let mut out = Vec::new();
    let t = format!("`CreateSandbox` p50 ≤ {TARGET_CREATE_P50_MS} ms");
    out.push(match report.p50(Key::Create) {
        Some(p) => (
            t,
            format!("{} ms", ms(p)),
            verdict(p <= TARGET_CREATE_P50_MS),
        ),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("exec round trip p50 ≤ {TARGET_EXEC_P50_MS} ms");
    let gap = EXEC_GAP.as_millis();
    out.push(match (report.p50(Key::Exec), report.p50(Key::ExecSpaced)) {
        (Some(p), Some(spaced)) => {
            let measured = format!(
                "{} ms back to back; {} ms with {gap} ms between execs (unary `Exec` of `true`)",
                ms(p),
                ms(spaced)
            );
            let result = match (p <= TARGET_EXEC_P50_MS, spaced <= TARGET_EXEC_P50_MS) {
                (true, true) => "PASS".to_string(),
                (true, false) => format!("PASS back to back, **MISS** {gap} ms apart"),
                (false, true) => format!("**MISS** back to back, PASS {gap} ms apart"),
                (false, false) => "**MISS**".to_string(),
            };
            (t, measured, result)
        }
        (Some(p), None) => (
            t,
            format!("{} ms back to back (unary `Exec` of `true`)", ms(p)),
            verdict(p <= TARGET_EXEC_P50_MS),
        ),
        _ => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!(
        "{TARGET_LIVE} live sandboxes, daemon RSS < {}",
        mib(TARGET_RSS_BYTES)
    );
    out.push(match &report.density {
        Some(Ok(d)) if d.live >= TARGET_LIVE => match d.rss_live {
            Some(rss) => (
                t,
                format!("{} with {} live", mib(rss), d.live),
                verdict(rss < TARGET_RSS_BYTES),
            ),
            None => (t, "RSS unreadable".into(), "not measured".into()),
        },
        Some(Ok(d)) => (
            t,
            format!(
                "only {} live in this run ({})",
                d.live,
                d.rss_live.map(mib).unwrap_or_default()
            ),
            "not measured".into(),
        ),
        Some(Err(e)) => (t, format!("failed: {e}"), "**MISS**".into()),
        None => (t, "not run".into(), "not measured".into()),
    });
    out
}

// ---------------------------------------------------------------------------------------------
// The machine

#[derive(Debug, Default)]
struct Machine {
    date: String,
    nproc: usize,
    cpu: String,
    memory: String,
    os: String,
    kernel: String,
    cgroups: String,
    load_start: String,
    load_end: String,
    sandboxd_bin: String,
    commit: String,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The value of the first `key: value` (or `key=value`) line of a file.
fn field_of(path: &str, key: &str, sep: char) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(sep)?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}

fn loadavg() -> String {
    read_trimmed("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

impl Machine {
    fn probe() -> Self {
        let cgroups = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            "v2 (unified)".to_string()
        } else if Path::new("/sys/fs/cgroup/unified").exists() {
            "v1 (hybrid: v1 controllers under /sys/fs/cgroup/<controller>, an empty v2 at /sys/fs/cgroup/unified)".to_string()
        } else {
            "v1".to_string()
        };
        let commit = std::process::Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let dirty = std::process::Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(["status", "--porcelain", "--untracked-files=no"])
            .output()
            .ok()
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false);
        Machine {
            date: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            nproc: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            cpu: field_of("/proc/cpuinfo", "model name", ':').unwrap_or_else(|| "unknown".into()),
            memory: field_of("/proc/meminfo", "MemTotal", ':')
                .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| format!("{:.1} GiB", kb as f64 / (1u64 << 20) as f64))
                .unwrap_or_else(|| "unknown".into()),
            os: field_of("/etc/os-release", "PRETTY_NAME", '=').unwrap_or_else(|| "unknown".into()),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            cgroups,
            load_start: loadavg(),
            load_end: String::new(),
            sandboxd_bin: sandboxd_bin()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|e| format!("not found: {e}")),
            commit: match commit {
                Some(c) if dirty => format!("{c} with uncommitted changes"),
                Some(c) => c,
                None => "unknown (not a git checkout)".into(),
            },
        }
    }

    fn rows(&self, report: &Report) -> Vec<(&'static str, String)> {
        let docker = match (&report.docker, &report.docker_unavailable) {
            (_, Some(why)) => format!("unavailable: {why}"),
            (Some(v), None) => v.clone(),
            (None, None) => "not measured".into(),
        };
        vec![
            ("date (UTC)", self.date.clone()),
            ("CPUs (nproc)", self.nproc.to_string()),
            ("CPU", self.cpu.clone()),
            ("memory", self.memory.clone()),
            ("OS", self.os.clone()),
            ("kernel", self.kernel.clone()),
            ("cgroups", self.cgroups.clone()),
            (
                "load average (1, 5, 15 min) before → after",
                format!("{} → {}", self.load_start, self.load_end),
            ),
            (
                "sandboxd",
                format!("{} (commit {})", self.sandboxd_bin, self.commit),
            ),
            ("Docker", docker),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// sandboxd

/// The sandboxes of one daemon that are alive, so that each one is destroyed whatever happens.
struct Sandboxes {
    client: Client,
    live: BTreeSet<String>,
}

impl Sandboxes {
    fn new(client: Client) -> Self {
        Sandboxes {
            client,
            live: BTreeSet::new(),
        }
    }

    /// Creates a process-tier sandbox of image `minimal`; returns its id and the call's time.
    async fn create(&mut self, what: &str) -> Result<(String, Duration)> {
        check_interrupt()?;
        let t = Instant::now();
        let sandbox = self
            .client
            .create(process_sandbox("minimal"))
            .await
            .with_context(|| format!("CreateSandbox ({what})"))?;
        let took = t.elapsed();
        self.live.insert(sandbox.id.clone());
        if sandbox.state != proto::SandboxState::Running as i32 {
            bail!(
                "CreateSandbox ({what}) returned sandbox {} in state {}, not RUNNING",
                sandbox.id,
                state_name(sandbox.state)
            );
        }
        Ok((sandbox.id, took))
    }

    /// Destroys one sandbox; returns the call's time.
    async fn destroy(&mut self, id: &str) -> Result<Duration> {
        let t = Instant::now();
        self.client
            .destroy(id)
            .await
            .with_context(|| format!("DestroySandbox {id}"))?;
        let took = t.elapsed();
        self.live.remove(id);
        Ok(took)
    }

    /// Destroys whatever is still alive; says loudly what could not be.
    async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.live) {
            if let Err(e) = self.client.destroy(id.as_str()).await {
                eprintln!("bench: WARNING: could not destroy sandbox {id} while cleaning up: {e}");
            }
        }
    }
}

fn state_name(state: i32) -> &'static str {
    proto::SandboxState::try_from(state)
        .map(|s| s.as_str_name())
        .unwrap_or("unknown")
}

/// Fails unless `true` ran and exited 0.
fn check_true(result: &proto::ExecResult, what: &str) -> Result<()> {
    if result.status != proto::ExecStatus::Exited as i32 || result.exit_code != 0 {
        let status = proto::ExecStatus::try_from(result.status)
            .map(|s| s.as_str_name())
            .unwrap_or("unknown");
        bail!(
            "{what}: `true` ended with status {status}, exit code {}{}",
            result.exit_code,
            if result.error.is_empty() {
                String::new()
            } else {
                format!(": {}", result.error)
            }
        );
    }
    Ok(())
}

/// One unary `Exec` of `true`; returns the round trip.
async fn exec_true(client: &Client, id: &str, what: &str) -> Result<Duration> {
    check_interrupt()?;
    let t = Instant::now();
    let result = client
        .exec(exec_request(id, ["true"]))
        .await
        .with_context(|| format!("Exec of `true` in {id} ({what})"))?;
    let took = t.elapsed();
    check_true(&result, what)?;
    Ok(took)
}

/// One `ExecStream` of `true`, drained to its result; returns the round trip.
async fn exec_stream_true(client: &Client, id: &str, what: &str) -> Result<Duration> {
    check_interrupt()?;
    let t = Instant::now();
    let stream = client
        .exec_stream(exec_request(id, ["true"]))
        .await
        .with_context(|| format!("ExecStream of `true` in {id} ({what})"))?;
    let result = stream
        .into_result()
        .await
        .with_context(|| format!("reading the ExecStream of `true` in {id} ({what})"))?;
    let took = t.elapsed();
    check_true(&result, what)?;
    Ok(took)
}

/// Section 1: create and destroy, timed apart.
async fn create_destroy(sb: &mut Sandboxes, plan: &Plan) -> Result<(Vec<Duration>, Vec<Duration>)> {
    for i in 0..plan.warmup {
        let (id, _) = sb.create(&format!("warm-up {i}")).await?;
        sb.destroy(&id).await?;
    }
    let (mut creates, mut destroys) = (
        Vec::with_capacity(plan.create),
        Vec::with_capacity(plan.create),
    );
    for i in 0..plan.create {
        let (id, took) = sb.create(&format!("sample {i} of {}", plan.create)).await?;
        creates.push(took);
        destroys.push(sb.destroy(&id).await?);
    }
    Ok((creates, destroys))
}

/// How the calls of a one-sandbox section are made.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// `GetSandbox`: the daemon's answer without starting any process.
    Get,
    /// Unary `Exec` of `true`, the next as soon as the last has answered.
    Exec,
    /// Unary `Exec` of `true` with [`EXEC_GAP`] of quiet before each (not timed).
    ExecSpaced,
    /// `ExecStream` of `true`, back to back.
    Stream,
}

/// Sections 2 and 3: `n` timed calls in one sandbox, after `warmup` untimed ones.
async fn calls_in_one(
    sb: &mut Sandboxes,
    call: Call,
    n: usize,
    warmup: usize,
) -> Result<Vec<Duration>> {
    let (id, _) = sb
        .create(&format!("the sandbox of the {call:?} section"))
        .await?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let what = format!("{call:?} sample {i}");
        let took = match call {
            Call::Get => {
                check_interrupt()?;
                let t = Instant::now();
                sb.client
                    .get(id.as_str())
                    .await
                    .with_context(|| format!("GetSandbox {id} ({what})"))?;
                t.elapsed()
            }
            Call::Exec => exec_true(&sb.client, &id, &what).await?,
            Call::ExecSpaced => {
                tokio::time::sleep(EXEC_GAP).await;
                exec_true(&sb.client, &id, &what).await?
            }
            Call::Stream => exec_stream_true(&sb.client, &id, &what).await?,
        };
        if i >= warmup {
            samples.push(took);
        }
    }
    sb.destroy(&id).await?;
    Ok(samples)
}

/// Sections 1–3 on one daemon.
async fn sandboxd_latency(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys = [
        Key::Create,
        Key::Destroy,
        Key::Get,
        Key::Exec,
        Key::ExecSpaced,
        Key::ExecStream,
    ];
    let daemon = match Daemon::start().await.context("starting sandboxd") {
        Ok(d) => d,
        Err(e) => return report.failed(&keys, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return report.failed(&keys, &e),
    };
    let mut sb = Sandboxes::new(client);

    eprintln!("bench: sandboxd create/destroy × {}", plan.create);
    match create_destroy(&mut sb, plan).await {
        Ok((c, d)) => {
            report.measured(Key::Create, &c);
            report.measured(Key::Destroy, &d);
        }
        Err(e) => report.failed(&[Key::Create, Key::Destroy], &e),
    }
    sb.cleanup().await;

    let sections = [
        (Key::Get, Call::Get, plan.exec),
        (Key::Exec, Call::Exec, plan.exec),
        (Key::ExecSpaced, Call::ExecSpaced, plan.spaced),
        (Key::ExecStream, Call::Stream, plan.stream),
    ];
    for (key, call, n) in sections {
        eprintln!("bench: sandboxd {call:?} × {n}");
        match calls_in_one(&mut sb, call, n, plan.warmup * 3).await {
            Ok(s) => report.measured(key, &s),
            Err(e) => report.failed(&[key], &e),
        }
        sb.cleanup().await;
    }

    report.rss_after_latency = daemon.pid().and_then(rss_bytes);
    drop(daemon);
    report
        .section_times
        .push(("sandboxd latency".into(), started.elapsed()));
}

/// PSS of `root` and every process below it, and how many processes that is.
fn pss_of_tree(root: u32) -> Option<(u64, usize)> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name may hold spaces and parentheses: the fields start after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if let Some(ppid) = rest
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u32>().ok())
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let (mut total, mut count, mut todo) = (0u64, 0usize, vec![root]);
    while let Some(pid) = todo.pop() {
        let rollup =
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        if let Some(kb) = rollup
            .lines()
            .find(|l| l.starts_with("Pss:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
        {
            total += kb * 1024;
        }
        count += 1;
        todo.extend(children.get(&pid).into_iter().flatten());
    }
    Some((total, count))
}

async fn fill_and_measure(
    sb: &mut Sandboxes,
    pid: Option<u32>,
    plan: &Plan,
    report: &mut Report,
) -> Result<Density> {
    let rss_idle = pid.and_then(rss_bytes);
    let mut ids = Vec::with_capacity(plan.live);
    let mut creates = Vec::with_capacity(plan.live);
    let t = Instant::now();
    for i in 0..plan.live {
        let (id, took) = sb
            .create(&format!("live sandbox {} of {}", i + 1, plan.live))
            .await?;
        ids.push(id);
        creates.push(took);
    }
    let create_total = t.elapsed();
    // Give the shims and inits a moment to settle, so RSS is not caught mid-fault.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_live = pid.and_then(rss_bytes);
    let pss_tree = pid.and_then(pss_of_tree);
    report.measured(Key::LiveCreate, &creates);

    let mut execs = Vec::with_capacity(ids.len() * 3);
    for round in 0..3 {
        for id in &ids {
            execs.push(
                exec_true(
                    &sb.client,
                    id,
                    &format!("round {round} across {} live", ids.len()),
                )
                .await?,
            );
        }
    }
    report.measured(Key::LiveExec, &execs);

    let mut destroys = Vec::with_capacity(ids.len());
    let t = Instant::now();
    for id in &ids {
        destroys.push(sb.destroy(id).await?);
    }
    let destroy_total = t.elapsed();
    report.measured(Key::LiveDestroy, &destroys);
    let rss_after = pid.and_then(rss_bytes);
    Ok(Density {
        live: plan.live,
        rss_idle,
        rss_live,
        pss_tree,
        create_total,
        destroy_total,
        rss_after,
    })
}

/// Section 4, on a fresh daemon so that its RSS is not that of the latency runs.
async fn sandboxd_density(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys = [Key::LiveCreate, Key::LiveExec, Key::LiveDestroy];
    eprintln!("bench: sandboxd {} live sandboxes", plan.live);
    let daemon = match Daemon::start()
        .await
        .context("starting sandboxd for the density section")
    {
        Ok(d) => d,
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            return report.failed(&keys, &e);
        }
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            return report.failed(&keys, &e);
        }
    };
    let mut sb = Sandboxes::new(client);
    let result = fill_and_measure(&mut sb, daemon.pid(), plan, report).await;
    sb.cleanup().await;
    match result {
        Ok(d) => report.density = Some(Ok(d)),
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            let missing: Vec<Key> = keys
                .into_iter()
                .filter(|k| !report.rows.contains_key(k))
                .collect();
            report.failed(&missing, &e);
        }
    }
    drop(daemon);
    report
        .section_times
        .push(("sandboxd density".into(), started.elapsed()));
}

// ---------------------------------------------------------------------------------------------
// Docker

fn docker_socket() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|h| h.strip_prefix("unix://").map(str::to_string))
        .unwrap_or_else(|| DOCKER_SOCKET.to_string())
}

/// The Docker side: the containers alive, so that each one is removed whatever happens.
struct DockerBench {
    docker: Docker,
    containers: BTreeSet<String>,
}

impl DockerBench {
    /// Connects (negotiating the API version down to the Engine's) and says which Engine it is.
    async fn connect() -> Result<(Self, String)> {
        let socket = docker_socket();
        // The Engine may be older than bollard's default API version (Debian 12 ships 1.41).
        let docker = Docker::connect_with_unix(&socket, 120, bollard::API_DEFAULT_VERSION)
            .with_context(|| format!("cannot reach Docker at {socket}"))?
            .negotiate_version()
            .await
            .with_context(|| format!("cannot reach Docker at {socket}"))?;
        let v = docker.version().await.context("Docker version")?;
        let desc = format!(
            "Engine {} (API {})",
            v.version.unwrap_or_default(),
            v.api_version.unwrap_or_default()
        );
        Ok((
            DockerBench {
                docker,
                containers: BTreeSet::new(),
            },
            desc,
        ))
    }

    /// Removes containers that an interrupted earlier run left behind.
    async fn remove_leftovers(&self) -> Result<()> {
        let filters = HashMap::from([("label".to_string(), vec![DOCKER_LABEL.to_string()])]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        for c in self
            .docker
            .list_containers(Some(options))
            .await
            .context("listing leftover bench containers")?
        {
            if let Some(id) = c.id {
                eprintln!("bench: removing container {id} left by an earlier run");
                let _ = self
                    .docker
                    .remove_container(
                        &id,
                        Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                    )
                    .await;
            }
        }
        Ok(())
    }

    /// `docker import` of the `minimal` rootfs as a tar stream: a local image, no registry.
    async fn import_image(&self) -> Result<Duration> {
        let rootfs = images_dir().join("minimal/rootfs");
        let t = Instant::now();
        let tarball = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
            let mut tar = tar::Builder::new(Vec::new());
            // Busybox's applets are symlinks: keep them links, not 300 copies of busybox.
            tar.follow_symlinks(false);
            tar.append_dir_all(".", &rootfs)
                .with_context(|| format!("packing {} into a tar stream", rootfs.display()))?;
            tar.into_inner().context("finishing the tar stream")
        })
        .await
        .context("packing the rootfs")??;
        let (repo, tag) = DOCKER_IMAGE
            .split_once(':')
            .unwrap_or((DOCKER_IMAGE, "latest"));
        let options = CreateImageOptionsBuilder::default()
            .from_src("-")
            .repo(repo)
            .tag(tag)
            .build();
        let mut progress = self.docker.create_image(
            Some(options),
            Some(bollard::body_full(tarball.into())),
            None,
        );
        while let Some(item) = progress.next().await {
            item.with_context(|| format!("importing {DOCKER_IMAGE} from the minimal rootfs"))?;
        }
        Ok(t.elapsed())
    }

    fn body(cmd: &[&str], network: Option<&str>) -> ContainerCreateBody {
        ContainerCreateBody {
            image: Some(DOCKER_IMAGE.to_string()),
            cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
            labels: Some(HashMap::from([(DOCKER_LABEL.to_string(), "1".to_string())])),
            host_config: Some(HostConfig {
                network_mode: network.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn create(&mut self, cmd: &[&str], network: Option<&str>) -> Result<String> {
        check_interrupt()?;
        let created = self
            .docker
            .create_container(
                Some(CreateContainerOptionsBuilder::default().build()),
                Self::body(cmd, network),
            )
            .await
            .with_context(|| format!("creating a container of {DOCKER_IMAGE} running {cmd:?}"))?;
        self.containers.insert(created.id.clone());
        Ok(created.id)
    }

    async fn start(&self, id: &str) -> Result<()> {
        self.docker
            .start_container(id, None)
            .await
            .with_context(|| format!("starting container {id}"))
    }

    /// `docker rm -f`; returns the call's time.
    async fn remove(&mut self, id: &str) -> Result<Duration> {
        let t = Instant::now();
        self.docker
            .remove_container(
                id,
                Some(RemoveContainerOptionsBuilder::default().force(true).build()),
            )
            .await
            .with_context(|| format!("removing container {id}"))?;
        let took = t.elapsed();
        self.containers.remove(id);
        Ok(took)
    }

    /// `docker run --rm … true`: create, start, wait for the exit, remove.
    async fn run_rm(&mut self) -> Result<Duration> {
        let t = Instant::now();
        let id = self.create(&["true"], Some("none")).await?;
        self.start(&id).await?;
        let options = WaitContainerOptionsBuilder::default()
            .condition("not-running")
            .build();
        let mut wait = self.docker.wait_container(&id, Some(options));
        while let Some(r) = wait.next().await {
            r.with_context(|| format!("waiting for container {id} (`true`) to exit"))?;
        }
        self.remove(&id).await?;
        Ok(t.elapsed())
    }

    /// Create+start of a container that stays up; returns its id and the time.
    async fn create_start(&mut self, network: Option<&str>) -> Result<(String, Duration)> {
        let t = Instant::now();
        let id = self.create(&["sleep", "3600"], network).await?;
        self.start(&id).await?;
        Ok((id, t.elapsed()))
    }

    /// `docker exec <id> true`: exec create, attached start drained to the end, inspect for the
    /// exit code — the calls the CLI makes.
    async fn exec_true(&self, id: &str) -> Result<Duration> {
        check_interrupt()?;
        let t = Instant::now();
        let config = bollard::exec::CreateExecOptions::<&str> {
            cmd: Some(vec!["true"]),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            ..Default::default()
        };
        let exec = self
            .docker
            .create_exec(id, config)
            .await
            .with_context(|| format!("creating an exec of `true` in container {id}"))?;
        match self
            .docker
            .start_exec(&exec.id, None)
            .await
            .with_context(|| format!("starting exec {} in container {id}", exec.id))?
        {
            bollard::exec::StartExecResults::Attached { mut output, .. } => {
                while let Some(chunk) = output.next().await {
                    chunk.with_context(|| format!("reading exec {} output", exec.id))?;
                }
            }
            bollard::exec::StartExecResults::Detached => bail!(
                "exec {} started detached although attached was asked",
                exec.id
            ),
        }
        let inspect = self
            .docker
            .inspect_exec(&exec.id)
            .await
            .with_context(|| format!("inspecting exec {}", exec.id))?;
        let took = t.elapsed();
        if inspect.exit_code != Some(0) {
            bail!(
                "docker exec of `true` in {id} ended with exit code {:?}",
                inspect.exit_code
            );
        }
        Ok(took)
    }

    async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.containers) {
            if let Err(e) = self
                .docker
                .remove_container(
                    &id,
                    Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                )
                .await
            {
                eprintln!("bench: WARNING: could not remove container {id} while cleaning up: {e}");
            }
        }
    }
}

async fn docker_sections(d: &mut DockerBench, plan: &Plan, report: &mut Report) -> Result<()> {
    let warmup = plan.warmup.min(2);
    eprintln!("bench: docker run --rm × {}", plan.docker_run);
    let mut runs = Vec::new();
    for i in 0..warmup + plan.docker_run {
        let took = d.run_rm().await?;
        if i >= warmup {
            runs.push(took);
        }
    }
    report.measured(Key::DockerRun, &runs);

    for (key, network) in [
        (Key::DockerCreateStart, Some("none")),
        (Key::DockerCreateStartBridge, None),
    ] {
        eprintln!(
            "bench: docker create+start ({}) × {}",
            network.unwrap_or("bridge"),
            plan.docker_create
        );
        let (mut starts, mut removes) = (Vec::new(), Vec::new());
        for i in 0..warmup + plan.docker_create {
            let (id, took) = d.create_start(network).await?;
            let removed = d.remove(&id).await?;
            if i >= warmup {
                starts.push(took);
                // `rm -f` is timed on the `--network none` containers, the ones like sandboxes.
                if network.is_some() {
                    removes.push(removed);
                }
            }
        }
        report.measured(key, &starts);
        if network.is_some() {
            report.measured(Key::DockerRemove, &removes);
        }
    }

    eprintln!("bench: docker exec × {}", plan.docker_exec);
    let (id, _) = d.create_start(Some("none")).await?;
    let mut execs = Vec::new();
    for i in 0..warmup * 3 + plan.docker_exec {
        let took = d.exec_true(&id).await?;
        if i >= warmup * 3 {
            execs.push(took);
        }
    }
    report.measured(Key::DockerExec, &execs);
    d.remove(&id).await?;
    Ok(())
}

/// Section 5. Never fails the bench: a Docker that cannot be reached or used marks its rows
/// "unavailable", loudly.
async fn docker_baseline(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let loud = |why: &str| {
        let line = format!("!!!!! DOCKER BASELINE UNAVAILABLE: {why} — its rows say \"unavailable\"; the sandboxd numbers stand alone !!!!!");
        eprintln!("{line}");
        println!("{line}");
    };
    let (mut d, version) = match DockerBench::connect().await {
        Ok(x) => x,
        Err(e) => {
            let why = format!("{e:#}");
            loud(&why);
            report.docker_unavailable = Some(why.clone());
            return report.unavailable(&Key::DOCKER, &why);
        }
    };
    report.docker = Some(version);
    if let Err(e) = d.remove_leftovers().await {
        eprintln!("bench: WARNING: {e:#}");
    }
    eprintln!("bench: docker import of the minimal rootfs as {DOCKER_IMAGE}");
    let result = match d.import_image().await {
        Ok(took) => {
            report.docker_import = Some(took);
            docker_sections(&mut d, plan, report).await
        }
        Err(e) => Err(e),
    };
    d.cleanup().await;
    if let Err(e) = result {
        let why = format!("{e:#}");
        loud(&why);
        report.docker_unavailable = Some(why.clone());
        report.unavailable(&Key::DOCKER, &why);
    }
    if report.docker_import.is_some() {
        if let Err(e) = d
            .docker
            .remove_image(
                DOCKER_IMAGE,
                Some(RemoveImageOptionsBuilder::default().force(true).build()),
                None,
            )
            .await
        {
            eprintln!("bench: WARNING: could not remove image {DOCKER_IMAGE}: {e}");
        }
    }
    report
        .section_times
        .push(("Docker".into(), started.elapsed()));
}

// ---------------------------------------------------------------------------------------------

async fn run(args: Args) -> Result<bool> {
    let plan = Plan::new(&args);
    let started = Instant::now();
    let mut machine = Machine::probe();
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("bench: interrupted; cleaning up");
            INTERRUPTED.store(true, Ordering::Relaxed);
        }
    });
    eprintln!(
        "bench: sandboxd = {}, images = {}, {}",
        machine.sandboxd_bin,
        images_dir().display(),
        if plan.quick { "quick mode" } else { "full run" }
    );

    let mut report = Report::default();
    sandboxd_latency(&plan, &mut report).await;
    sandboxd_density(&plan, &mut report).await;
    if args.no_docker {
        let why = "left out with --no-docker";
        report.docker_unavailable = Some(why.into());
        report.unavailable(&Key::DOCKER, why);
    } else {
        docker_baseline(&plan, &mut report).await;
    }
    if let Some(took) = report.docker_import {
        report
            .section_times
            .push(("(of which Docker image import)".into(), took));
    }
    machine.load_end = loadavg();

    let md = render(&report, &plan, &machine, started.elapsed());
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("bench: wrote {}", out.display());
    }
    check_interrupt()?;
    Ok(!report.any_failed())
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench: some sandboxd measurements FAILED (see the table)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench: {:#}", anyhow!(e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&sorted, 50.0), 50.0);
        assert_eq!(nearest_rank(&sorted, 99.0), 99.0);
        assert_eq!(nearest_rank(&sorted, 100.0), 100.0);
        // Fewer than 100 samples: p99 is the maximum, p50 the lower middle.
        let few = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(nearest_rank(&few, 99.0), 4.0);
        assert_eq!(nearest_rank(&few, 50.0), 2.0);
        assert_eq!(nearest_rank(&[7.0], 50.0), 7.0);
        assert_eq!(nearest_rank(&[7.0], 0.0), 7.0);
    }

    #[test]
    fn summary_sorts_and_converts_to_ms() {
        let samples = [30, 10, 20].map(Duration::from_millis);
        let s = summarize(&samples).expect("three samples");
        assert_eq!((s.n, s.p50, s.p99, s.max), (3, 20.0, 30.0, 30.0));
        assert!((s.mean - 20.0).abs() < 1e-9);
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn targets_say_miss_and_not_measured_honestly() {
        let mut report = Report::default();
        report.measured(Key::Create, &[Duration::from_millis(25)]);
        report.measured(Key::Exec, &[Duration::from_millis(2)]);
        report.measured(Key::ExecSpaced, &[Duration::from_millis(9)]);
        let t = targets(&report);
        assert!(t[0].2.contains("MISS"), "{t:?}");
        assert!(
            t[1].2.starts_with("PASS back to back") && t[1].2.contains("MISS"),
            "{t:?}"
        );
        assert_eq!(t[2].2, "not measured");
    }

    #[test]
    fn cells_stay_on_one_line() {
        assert_eq!(cell("a |b\nc"), "a \\|b c");
        assert_eq!(cell("line one\nline two"), "line one line two");
    }
}
