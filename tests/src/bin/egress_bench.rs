//! `egress_bench`: what the egress filter (issue #24) costs a sandbox's connections, against a
//! direct connection from the host measured in the same run.
//!
//! One client program (`tests/egress/bench_client.py`) runs directly on the host and inside an
//! OPEN sandbox of `debian` on each tier, against the echo server of the test internet
//! ([`sandbox_tests::Internet`], a network namespace behind a veth): connect + 1-byte echo round
//! trips (median, p99), a bulk echo (MB/s each way) and raw DNS queries for an allowed name (to
//! the internet's server directly from the host, to the daemon's DNS server from a sandbox). The
//! daemon runs with `[network] bandwidth_bytes_per_sec = 0` (no cap) so the proxy itself is
//! measured; a second daemon with the default cap (50 MiB/s) gives one more row, so the cap is
//! visible. An ALLOWLIST process sandbox (`pypi.test:7000`, reached by name) adds the allowlist's
//! own path: its DNS answer is recorded and every connection checked against it. `make bench`
//! runs it and writes the `## Egress` section of BENCHMARKS.md (`--out FILE`).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, ExecRequest, Isolation, NetworkMode, NetworkPolicy, ResourceLimits};
use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use sandbox_tests::{images_dir, process_sandbox, replace_section, sandboxd_bin, Harness, Internet};

const CLIENT_PY: &str = include_str!("../../egress/bench_client.py");

/// The echo server's port in `internet.py`.
const ECHO_PORT: &str = "7000";

/// The internet's `n`: the egress tests use 0-6, so a bench beside them never shares a namespace.
const INTERNET_N: u8 = 7;

#[derive(Parser)]
#[command(about = "Connect latency, throughput and DNS through the egress filter vs direct")]
struct Args {
    /// Connect + 1-byte echo round trips per path.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// MiB echoed by each bulk transfer.
    #[arg(long, default_value_t = 64)]
    bulk_mib: u64,
    /// Bulk transfers per path (the median is reported).
    #[arg(long, default_value_t = 3)]
    bulk_runs: usize,
    /// MiB echoed by the bulk transfer under the default cap: well beyond the cap's one-second
    /// burst, or the cap does not show.
    #[arg(long, default_value_t = 512)]
    cap_bulk_mib: u64,
    /// DNS queries per path.
    #[arg(long, default_value_t = 100)]
    dns_rounds: usize,
    /// Markdown file whose `## Egress` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// What one run of the client measured.
struct Measured {
    echo_ms: Vec<f64>,
    bulk_mb_s: f64,
    dns_ms: Vec<f64>,
}

/// Parses the client's JSON line; `path` names where it ran, for errors.
fn parse(path: &str, stdout: &[u8]) -> Result<Measured> {
    let v: serde_json::Value =
        serde_json::from_slice(stdout).with_context(|| format!("{path}: the client's output is not JSON: {}", String::from_utf8_lossy(stdout)))?;
    let resolution = v["clock_resolution_s"].as_f64().with_context(|| format!("{path}: no clock_resolution_s in {v}"))?;
    ensure!(resolution <= 1e-5, "{path}: the client's clock reads time in steps of {resolution} s, too coarse to time a round trip");
    let list = |key: &str| -> Result<Vec<f64>> {
        let mut xs: Vec<f64> = v[key]
            .as_array()
            .with_context(|| format!("{path}: no {key} in {v}"))?
            .iter()
            .map(|x| x.as_f64().with_context(|| format!("{path}: {key} holds {x}")))
            .collect::<Result<_>>()?;
        ensure!(!xs.is_empty(), "{path}: {key} is empty");
        xs.sort_by(f64::total_cmp);
        Ok(xs)
    };
    let bytes = v["bulk_bytes"].as_f64().with_context(|| format!("{path}: no bulk_bytes in {v}"))?;
    let seconds = list("bulk_seconds")?;
    ensure!(seconds[0] > 0.0, "{path}: a bulk transfer took {} s", seconds[0]);
    Ok(Measured { echo_ms: list("echo_ms")?, bulk_mb_s: bytes / quantile(&seconds, 0.5) / 1e6, dns_ms: list("dns_ms")? })
}

/// The `q` quantile of sorted `xs` (nearest rank).
fn quantile(xs: &[f64], q: f64) -> f64 {
    let rank = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    xs[rank - 1]
}

/// How much the bulk transfers move: MiB per run, runs.
#[derive(Clone, Copy)]
struct Bulk(u64, usize);

/// The client's arguments after the script's path.
fn client_args(args: &Args, bulk: Bulk, host: &str, dns_server: &str) -> Vec<String> {
    [
        host,
        ECHO_PORT,
        "--rounds",
        &args.rounds.to_string(),
        "--bulk",
        &(bulk.0 << 20).to_string(),
        "--bulk-runs",
        &bulk.1.to_string(),
        "--dns-server",
        dns_server,
        "--dns-name",
        "pypi.test",
        "--dns-rounds",
        &args.dns_rounds.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// What every run needs: the options, the test internet, the client's copy on the host.
struct Bench {
    args: Args,
    inet: Internet,
    script: PathBuf,
    _dir: tempfile::TempDir,
}

/// The client run directly on the host (python3 of the host).
async fn direct(b: &Bench) -> Result<Measured> {
    let (args, inet, script) = (&b.args, &b.inet, &b.script);
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new("python3")
            .arg(script)
            .args(client_args(args, Bulk(args.bulk_mib, args.bulk_runs), &inet.addr(), &inet.addr()))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("the client on the host did not finish within 600 s")?
    .context("running python3 on the host")?;
    ensure!(out.status.success(), "the client on the host: {}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    parse("direct from the host", &out.stdout)
}

/// The host's CPUs, which a process or container sandbox gets all of: the direct client is not
/// limited either.
fn cpus() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1))
}

/// A microVM gets one vCPU: under TCG a guest with two marks its TSC unstable and falls back to
/// a jiffies clock (4 ms steps), which cannot time a round trip.
const MICROVM_CPUS: u32 = 1;

/// The accelerator the daemon logged for its microVMs (`accel="kvm"` or `"tcg"`), if it did.
fn accel(log: &str) -> Option<String> {
    let rest = &log[log.rfind("accel=\"")? + "accel=\"".len()..];
    Some(rest[..rest.find('"')?].to_uppercase())
}

/// The client run in a new `debian` sandbox on `tier` with `network`, which is then destroyed,
/// and the median connect + echo of a direct run made just before it (before the create: an idle
/// TCG guest still costs CPU), so that a row's added latency is measured against the machine's
/// load of the moment.
async fn in_sandbox(b: &Bench, bulk: Bulk, h: &Harness, label: &str, tier: Isolation, network: NetworkPolicy, host: &str) -> Result<(Measured, f64)> {
    let before = direct(b).await?;
    let vcpus = if tier == Isolation::Microvm { MICROVM_CPUS } else { cpus() };
    let limits = ResourceLimits { cpu_millicores: vcpus * 1000, ..Default::default() };
    let request = CreateSandboxRequest { isolation: tier as i32, network: Some(network), limits: Some(limits), ..process_sandbox("debian") };
    let id = tokio::time::timeout(Duration::from_secs(180), h.client.create(request))
        .await
        .with_context(|| format!("{label}: CreateSandbox did not return within 180 s"))?
        .with_context(|| format!("{label}: CreateSandbox"))?
        .id;
    let measured = async {
        h.client.write_file(&id, "/bench_client.py", CLIENT_PY, 0o644).await.with_context(|| format!("{label}: writing the client"))?;
        let mut argv = vec!["python3".to_string(), "/bench_client.py".to_string()];
        argv.extend(client_args(&b.args, bulk, host, "resolv"));
        let request = ExecRequest { timeout_ms: 600_000, ..exec_request(&id, argv) };
        let r = h.client.exec(request).await.with_context(|| format!("{label}: Exec"))?;
        ensure!(r.exit_code == 0, "{label}: the client exited {}: {}", r.exit_code, String::from_utf8_lossy(&r.stderr));
        Ok((parse(label, &r.stdout)?, quantile(&before.echo_ms, 0.5)))
    }
    .await;
    h.client.destroy(&id).await.with_context(|| format!("{label}: DestroySandbox {id}"))?;
    measured
}

fn open() -> NetworkPolicy {
    NetworkPolicy { mode: NetworkMode::Open as i32, allow: vec![] }
}

/// A table row; `direct_p50` is the direct run's median to compare with (none for a direct row).
fn row(path: &str, m: &Measured, direct_p50: Option<f64>) -> String {
    let p50 = quantile(&m.echo_ms, 0.5);
    let added = direct_p50.map_or("—".to_string(), |d| format!("{:+.2} ms (direct {d:.2} ms)", p50 - d));
    format!("| {path} | {p50:.2} ms | {:.2} ms | {added} | {:.0} MB/s | {:.2} ms |", quantile(&m.echo_ms, 0.99), m.bulk_mb_s, quantile(&m.dns_ms, 0.5))
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg has them.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_else(|e| format!("unknown ({e})"))
}

/// Which build of the daemon ran, from its path.
fn build_of(bin: &Path) -> String {
    let has = |name: &str| bin.components().any(|c| c.as_os_str() == name);
    if has("release") {
        "a release build".into()
    } else if has("debug") {
        "a **debug** build".into()
    } else {
        format!("the binary at `{}`", bin.display())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let image = images_dir().join("debian/image.json");
    if !image.is_file() {
        bail!("image 'debian' is not built ({} missing) — run `make image-debian`", image.display());
    }
    let bin = sandboxd_bin()?;
    let inet = Internet::start(INTERNET_N).await;
    let dir = tempfile::tempdir().context("tempdir")?;
    let script = dir.path().join("bench_client.py");
    std::fs::write(&script, CLIENT_PY).context("writing bench_client.py")?;
    let b = Bench { args, inet, script, _dir: dir };
    let (args, addr) = (&b.args, b.inet.addr());
    let bulk = Bulk(args.bulk_mib, args.bulk_runs);
    let load_before = loadavg();
    let mut rows = Vec::new();

    eprintln!("egress_bench: direct from the host");
    rows.push(row("direct from host (first)", &direct(&b).await?, None));
    {
        let h = b.inet.daemon_with("bandwidth_bytes_per_sec = 0\n", &[]).await;
        for (label, tier) in [("process OPEN", Isolation::Process), ("container OPEN", Isolation::Container), ("microVM OPEN", Isolation::Microvm)] {
            eprintln!("egress_bench: {label}");
            let (m, d) = in_sandbox(&b, bulk, &h, label, tier, open(), &addr).await?;
            let label = match accel(&h.daemon.log()) {
                Some(a) if tier == Isolation::Microvm => format!("{label} ({a}, {MICROVM_CPUS} vCPU)"),
                _ => label.to_string(),
            };
            rows.push(row(&label, &m, Some(d)));
        }
        let label = "process ALLOWLIST `pypi.test:7000`";
        eprintln!("egress_bench: {label}");
        let allow = NetworkPolicy { mode: NetworkMode::Allowlist as i32, allow: vec![format!("pypi.test:{ECHO_PORT}")] };
        let (m, d) = in_sandbox(&b, bulk, &h, label, Isolation::Process, allow, "pypi.test").await?;
        rows.push(row(label, &m, Some(d)));
    }
    {
        // The same internet and prefix: the first daemon is gone (its sandboxes destroyed) and
        // this one replaces its nftables table at its first networked sandbox.
        let h = b.inet.daemon(&[]).await;
        let label = format!("process OPEN, default cap (50 MiB/s; bulk: one run of {} MiB)", args.cap_bulk_mib);
        eprintln!("egress_bench: {label}");
        let (m, d) = in_sandbox(&b, Bulk(args.cap_bulk_mib, 1), &h, &label, Isolation::Process, open(), &addr).await?;
        rows.push(row(&label, &m, Some(d)));
    }
    eprintln!("egress_bench: direct from the host, again");
    rows.push(row("direct from host (last)", &direct(&b).await?, None));

    let section = format!(
        "## Egress\n\n\
         `egress_bench`: what the egress filter (README, Network) adds to a sandbox's connections, against a direct connection \
         in the same run. One Python client (`tests/egress/bench_client.py`, the same code everywhere) runs directly on the host \
         and inside a `debian` sandbox on each tier, against the TCP echo server of a test internet (Python, in a network \
         namespace behind a veth: the egress tests' `Internet`). A sandbox's connections go through the daemon's nftables \
         redirect and transparent proxy, its DNS queries through the daemon's DNS server (which asks the test internet's server \
         a query of its own); the host's go to the test internet directly. The daemon is {build}, run with \
         `[network] bandwidth_bytes_per_sec = 0` (no cap) except in the *default cap* row.\n\n\
         - *connect + echo*: connect, send 1 byte, read it back; {rounds} rounds after 3 warm-up rounds. *added*: its median \
           minus the median of a direct run made just before it (before its sandbox was created), in parentheses.\n\
         - *bulk*: {bulk} MiB sent from one thread and read back in another over one connection, MB/s (10^6 bytes) each way, \
           median of {bulk_runs} runs. Under the cap the first 50 MiB pass at once (the token bucket holds one second's \
           worth), so that row moves {cap_bulk} MiB once to show the steady rate.\n\
         - *DNS*: median of {dns} A queries for an allowed name (`pypi.test`).\n\
         - The ALLOWLIST row reaches the echo server by name (`pypi.test:7000`), so every connection is checked against the \
           address the daemon's DNS gave that sandbox.\n\
         - Sandboxes get all {cpus} CPUs, as the host's client has, except a microVM: {MICROVM_CPUS} vCPU, because under TCG \
           (software emulation, used when KVM is not usable) a guest with two marks its TSC unstable and falls back to a 4 ms \
           clock that cannot time a round trip. Under TCG the guest's client and its virtio-net device are emulated too.\n\
         - The direct rows, first and last, show the drift over the run. Nothing else on the machine is stopped (builds and \
           tests of others may load it), and the echo server, the proxy and the client share its {cpus} CPUs: compare the rows \
           of one run rather than runs. Load average (1, 5, 15 min) before → after: {load_before} → {load_after}.\n\n\
         | path | connect + echo p50 | p99 | added to p50 | bulk | DNS p50 |\n|---|---|---|---|---|---|\n{rows}\n",
        build = build_of(&bin),
        load_after = loadavg(),
        cpus = cpus(),
        rounds = args.rounds,
        bulk = args.bulk_mib,
        bulk_runs = args.bulk_runs,
        cap_bulk = args.cap_bulk_mib,
        dns = args.dns_rounds,
        rows = rows.join("\n"),
    );
    println!("{section}");
    if let Some(out) = &args.out {
        replace_section(out, "## Egress", &section)?;
    }
    Ok(())
}
