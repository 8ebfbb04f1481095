//! `bench`: latency, snapshots, forks, exec throughput and density of `sandboxd`, with Docker
//! measured in the same run.
//!
//! Starts the real daemon (`SANDBOXD_BIN`) through the test harness, drives it with the real
//! client over its UNIX socket, measures the Docker Engine API the same way (one API client, one
//! call after another), prints a markdown report and, with `--out`, writes it to a file.
//! `make bench` runs it as `target/release/bench --out BENCHMARKS.md`. A `## Agent loop` section
//! already in that file (another bench appends it) is carried over to the end of the new one.
//!
//! Every sandbox, snapshot and container it makes is removed again, also when a section fails or
//! the run is interrupted with Ctrl-C. Docker missing is not a failure (its rows, and those of
//! sandboxd's container tier, say "unavailable"), nor is a host that cannot run microVMs, or KVM
//! that does not work (the microVM rows say why); a sandboxd section that fails is, and the exit
//! code says so. Targets that are missed are reported as MISS but do not change the exit code:
//! this is a measurement, not a gate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
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
/// Targets from the issues (foundation, snapshots, container tier).
const TARGET_CREATE_P50_MS: f64 = 20.0;
const TARGET_EXEC_P50_MS: f64 = 3.0;
const TARGET_LIVE: usize = 100;
const TARGET_RSS_BYTES: u64 = 100 << 20;
const TARGET_SNAPSHOT_P50_MS: f64 = 20.0;
const TARGET_ROLLBACK_P50_MS: f64 = 30.0;
/// How much slower snapshot and rollback may be over a 100× larger image (same bytes changed).
const TARGET_LARGE_IMAGE_FACTOR: f64 = 2.0;
/// How much a fork may cost beyond a plain create.
const TARGET_FORK_OVER_CREATE_MS: f64 = 10.0;
/// Container tier against the raw Docker API calls for the same work.
const TARGET_CONTAINER_VS_DOCKER: f64 = 1.1;
const TARGET_CONTAINER_ROLLBACK_P50_MS: f64 = 300.0;
/// MicroVM tier: boot to first exec without a pool, under TCG and under KVM; exec round trip;
/// `CreateSandbox` served from the warm pool.
const TARGET_MICROVM_TCG_BOOT_P50_MS: f64 = 2500.0;
const TARGET_MICROVM_KVM_BOOT_P50_MS: f64 = 300.0;
const TARGET_MICROVM_EXEC_P50_MS: f64 = 20.0;
const TARGET_MICROVM_POOL_CREATE_P50_MS: f64 = 100.0;

/// `RUST_LOG` directive added for the microVM daemons: `microVM booted` (with `accel=` and
/// `boot_ms=`) is a debug line of this module. Only this module, so that the daemon does not
/// log a line per exec.
const MICROVM_LOG_DIRECTIVE: &str = "sandboxd::backend::microvm=debug";
/// Log messages of the microVM tier the bench reads (sandboxd/src/backend/microvm/).
const LOG_BOOTED: &str = "microVM booted";
const LOG_POOL_READY: &str = "warm pool holds a booted microVM";
const LOG_POOL_TAKEN: &str = "microVM taken from the warm pool";
const LOG_POOL_GAVE_UP: &str = "warm pool refill stopped";
/// Boot deadline of the daemon that tries KVM where the `auto` daemon chose TCG: long enough for
/// a KVM boot, short enough not to wait the default 30 s for a guest that hangs.
const KVM_TRY_BOOT_TIMEOUT_MS: u64 = 8000;
/// How long to wait for the warm pool to hold a VM before a sample.
const POOL_FILL_TIMEOUT: Duration = Duration::from_secs(180);

/// MiB written since the image before each snapshot: a small change and a large one.
const CHANGED_SMALL_MIB: u32 = 1;
const CHANGED_LARGE_MIB: u32 = 100;
/// Forks taken of one snapshot in a row, timed together.
const FORK_BATCH: usize = 10;
/// Sandboxes the exec throughput section spreads its execs over.
const THROUGHPUT_SANDBOXES: usize = 8;

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
    /// 20 snapshot+rollbacks with 1 MiB changed and 10 with 100 MiB, 30 forks, 5 batches of 10
    /// forks, 20 container-tier creates, 100 container-tier execs, 10 container-tier
    /// snapshot+rollbacks, 30 docker runs and create+starts, 200 docker execs, 5 cold microVM
    /// boots per accelerator, 3 microVM creates from the warm pool, 50 microVM execs and 20
    /// streamed, 5 microVM snapshot+rollbacks, 3 microVM forks). The exec throughput section
    /// keeps its own counts.
    #[arg(long)]
    iterations: Option<usize>,
    /// Sandboxes kept alive at once in the density section (default 100; 10 with --quick).
    #[arg(long)]
    live: Option<usize>,
    /// Smoke mode: a few samples per section, done in seconds. Not numbers to compare.
    #[arg(long)]
    quick: bool,
    /// Leave out everything that needs Docker: the baseline and sandboxd's container tier.
    #[arg(long)]
    no_docker: bool,
    /// Leave out sandboxd's microVM tier (its boots take seconds each under TCG).
    #[arg(long)]
    no_microvm: bool,
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
    /// Snapshot+rollback samples with [`CHANGED_SMALL_MIB`] and [`CHANGED_LARGE_MIB`] written.
    snap_small: usize,
    snap_large: usize,
    /// Single forks, and batches of [`FORK_BATCH`] forks.
    fork: usize,
    fork_batches: usize,
    /// (concurrency, execs) of each level of the exec throughput section.
    throughput: [(usize, usize); 3],
    container_create: usize,
    container_exec: usize,
    container_snap: usize,
    docker_run: usize,
    docker_create: usize,
    docker_exec: usize,
    /// Cold microVM boots (per accelerator measured), creates from the warm pool, execs and
    /// streamed execs in one microVM, snapshot+rollbacks and forks.
    microvm_boot: usize,
    microvm_pool: usize,
    microvm_exec: usize,
    microvm_stream: usize,
    microvm_snap: usize,
    microvm_fork: usize,
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
                snap_small: 5,
                snap_large: 2,
                fork: 5,
                fork_batches: 1,
                throughput: [(1, 50), (8, 100), (64, 200)],
                container_create: 3,
                container_exec: 10,
                container_snap: 2,
                docker_run: 3,
                docker_create: 3,
                docker_exec: 10,
                microvm_boot: 2,
                microvm_pool: 1,
                microvm_exec: 10,
                microvm_stream: 5,
                microvm_snap: 1,
                microvm_fork: 1,
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
                snap_small: 20,
                snap_large: 10,
                fork: 30,
                fork_batches: 5,
                // Sized so that each level runs a few seconds on a small machine.
                throughput: [(1, 500), (8, 1500), (64, 2000)],
                container_create: 20,
                container_exec: 100,
                container_snap: 10,
                docker_run: 30,
                docker_create: 30,
                docker_exec: 200,
                // Modest: a boot under TCG takes seconds, and pool and rollback samples boot too.
                microvm_boot: 5,
                microvm_pool: 3,
                microvm_exec: 50,
                microvm_stream: 20,
                microvm_snap: 5,
                microvm_fork: 3,
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
            (
                p.snap_small,
                p.snap_large,
                p.fork,
                p.fork_batches,
                p.container_create,
                p.container_exec,
                p.container_snap,
            ) = (n, n, n, n, n, n, n);
            (
                p.microvm_boot,
                p.microvm_pool,
                p.microvm_exec,
                p.microvm_stream,
                p.microvm_snap,
                p.microvm_fork,
            ) = (n, n, n, n, n, n);
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

/// An image the snapshot rows are measured over: `debian` (~280 MB) is over 100× `minimal`
/// (~2 MB), which is what the "100× larger image" target needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Image {
    Minimal,
    Debian,
}

impl Image {
    fn name(self) -> &'static str {
        match self {
            Image::Minimal => "minimal",
            Image::Debian => "debian",
        }
    }
}

/// How microVM guests ran their CPUs, as the daemon logged it (`accel=` of `microVM booted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum VmAccel {
    Tcg,
    Kvm,
}

impl VmAccel {
    fn name(self) -> &'static str {
        match self {
            VmAccel::Tcg => "TCG",
            VmAccel::Kvm => "KVM",
        }
    }

    /// The value of `[microvm] accel` that forces it, also how the daemon's log spells it.
    fn config(self) -> &'static str {
        match self {
            VmAccel::Tcg => "tcg",
            VmAccel::Kvm => "kvm",
        }
    }

    fn from_log(value: &str) -> Option<VmAccel> {
        match value {
            "tcg" => Some(VmAccel::Tcg),
            "kvm" => Some(VmAccel::Kvm),
            _ => None,
        }
    }

    fn other(self) -> VmAccel {
        match self {
            VmAccel::Tcg => VmAccel::Kvm,
            VmAccel::Kvm => VmAccel::Tcg,
        }
    }
}

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
    /// `Snapshot` of a process-tier sandbox of that image with that many MiB written since it.
    Snapshot(Image, u32),
    /// `Rollback` to such a snapshot.
    Rollback(Image, u32),
    Fork,
    ForkDestroy,
    /// [`FORK_BATCH`] forks of one snapshot, one after another: one sample is the whole batch.
    ForkBatch,
    ContainerCreate,
    ContainerDestroy,
    ContainerExec,
    ContainerSnapshot,
    ContainerRollback,
    DockerRun,
    DockerCreateStart,
    DockerCreateStartBridge,
    DockerRemove,
    DockerExec,
    /// Cold microVM (no pool) under that accelerator: `CreateSandbox` + the first `Exec` of
    /// `true`, timed as one.
    MicroVmBoot(VmAccel),
    /// The `CreateSandbox` alone of those boots.
    MicroVmCreate(VmAccel),
    MicroVmDestroy,
    /// `CreateSandbox` served from the warm pool, and the same with its first `Exec` of `true`.
    MicroVmPoolCreate,
    MicroVmPoolReady,
    MicroVmExec,
    MicroVmExecStream,
    MicroVmSnapshot,
    MicroVmRollback,
    /// Fork of a snapshot whose origin still runs, and of one whose origin was destroyed.
    MicroVmFork,
    MicroVmForkOriginGone,
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
    const SNAPSHOTS: [Key; 8] = [
        Key::Snapshot(Image::Minimal, CHANGED_SMALL_MIB),
        Key::Rollback(Image::Minimal, CHANGED_SMALL_MIB),
        Key::Snapshot(Image::Minimal, CHANGED_LARGE_MIB),
        Key::Rollback(Image::Minimal, CHANGED_LARGE_MIB),
        Key::Snapshot(Image::Debian, CHANGED_SMALL_MIB),
        Key::Rollback(Image::Debian, CHANGED_SMALL_MIB),
        Key::Snapshot(Image::Debian, CHANGED_LARGE_MIB),
        Key::Rollback(Image::Debian, CHANGED_LARGE_MIB),
    ];
    const FORKS: [Key; 3] = [Key::Fork, Key::ForkDestroy, Key::ForkBatch];
    const CONTAINER: [Key; 5] = [
        Key::ContainerCreate,
        Key::ContainerDestroy,
        Key::ContainerExec,
        Key::ContainerSnapshot,
        Key::ContainerRollback,
    ];
    const DOCKER: [Key; 5] = [
        Key::DockerRun,
        Key::DockerCreateStart,
        Key::DockerCreateStartBridge,
        Key::DockerRemove,
        Key::DockerExec,
    ];
    const MICROVM: [Key; 13] = [
        Key::MicroVmBoot(VmAccel::Tcg),
        Key::MicroVmCreate(VmAccel::Tcg),
        Key::MicroVmBoot(VmAccel::Kvm),
        Key::MicroVmCreate(VmAccel::Kvm),
        Key::MicroVmDestroy,
        Key::MicroVmPoolCreate,
        Key::MicroVmPoolReady,
        Key::MicroVmExec,
        Key::MicroVmExecStream,
        Key::MicroVmSnapshot,
        Key::MicroVmRollback,
        Key::MicroVmFork,
        Key::MicroVmForkOriginGone,
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
            Key::Snapshot(image, mib) => {
                format!(
                    "sandboxd `Snapshot`, {mib} MiB changed (image {})",
                    image.name()
                )
            }
            Key::Rollback(image, mib) => {
                format!(
                    "sandboxd `Rollback`, {mib} MiB changed (image {})",
                    image.name()
                )
            }
            Key::Fork => {
                "sandboxd fork: `CreateSandbox{from_snapshot_id}` (image minimal, 1 MiB changed)"
                    .into()
            }
            Key::ForkDestroy => "sandboxd `DestroySandbox` of a fork".into(),
            Key::ForkBatch => {
                format!("sandboxd {FORK_BATCH} forks of one snapshot, one after another (total)")
            }
            Key::ContainerCreate => {
                "sandboxd container tier `CreateSandbox` (image minimal)".into()
            }
            Key::ContainerDestroy => "sandboxd container tier `DestroySandbox`".into(),
            Key::ContainerExec => "sandboxd container tier `Exec` of `true`, back to back".into(),
            Key::ContainerSnapshot => {
                format!("sandboxd container tier `Snapshot`, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::ContainerRollback => {
                format!("sandboxd container tier `Rollback`, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::DockerRun => "Docker `run --rm` of `true` (create+start+wait+remove)".into(),
            Key::DockerCreateStart => "Docker container create+start (`--network none`)".into(),
            Key::DockerCreateStartBridge => {
                "Docker container create+start (default bridge network)".into()
            }
            Key::DockerRemove => "Docker `rm -f` of a running container".into(),
            Key::DockerExec => "Docker `exec` of `true` (exec create+start+inspect)".into(),
            Key::MicroVmBoot(accel) => format!(
                "microVM boot to first exec, cold ({}, no pool): `CreateSandbox` + first `Exec` of `true`",
                accel.name()
            ),
            Key::MicroVmCreate(accel) => format!(
                "microVM `CreateSandbox` alone, cold ({}, no pool)",
                accel.name()
            ),
            Key::MicroVmDestroy => "microVM `DestroySandbox`".into(),
            Key::MicroVmPoolCreate => {
                "microVM `CreateSandbox` from the warm pool (`--microvm-pool 1`)".into()
            }
            Key::MicroVmPoolReady => {
                "microVM from the warm pool to first exec: `CreateSandbox` + first `Exec` of `true`"
                    .into()
            }
            Key::MicroVmExec => "microVM `Exec` of `true` (unary), back to back".into(),
            Key::MicroVmExecStream => "microVM `ExecStream` of `true`".into(),
            Key::MicroVmSnapshot => {
                format!("microVM `Snapshot`, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::MicroVmRollback => format!(
                "microVM `Rollback`, {CHANGED_SMALL_MIB} MiB changed (boots a new VM over the snapshot)"
            ),
            Key::MicroVmFork => format!(
                "microVM fork: `CreateSandbox{{from_snapshot_id}}`, the origin running ({CHANGED_SMALL_MIB} MiB changed)"
            ),
            Key::MicroVmForkOriginGone => format!(
                "microVM fork of a snapshot whose origin was destroyed ({CHANGED_SMALL_MIB} MiB changed)"
            ),
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

/// One concurrency level of the exec throughput section.
#[derive(Debug, Clone)]
struct Throughput {
    concurrency: usize,
    execs: usize,
    /// From the first exec sent to the last answer received.
    wall: Duration,
    /// Round trip of each exec, as its task saw it.
    latency: Summary,
}

impl Throughput {
    fn per_second(&self) -> f64 {
        self.execs as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// What the microVM section learnt from the daemons' logs, beyond its rows.
#[derive(Debug, Default)]
struct MicroVm {
    /// The accelerator the daemon left at `accel = "auto"` used, and the lines of its log that
    /// say why (KVM probe, cached verdict, no /dev/kvm).
    auto_accel: Option<VmAccel>,
    accel_log: Vec<String>,
    /// Why that daemon did not use KVM (from its log), and what a daemon forced to KVM answered.
    kvm_reason: Option<String>,
    kvm_forced: Option<String>,
    /// The daemon's own boot times of the timed cold boots (QEMU started → guest agent's hello,
    /// `boot_ms` of `microVM booted`) and the guest kernel's uptime at that hello, per accelerator.
    boot_logged: BTreeMap<VmAccel, (Vec<Duration>, Vec<Duration>)>,
    /// `boot_ms` of the VMs the warm pool booted while its rows were measured.
    pool_boot_logged: Vec<Duration>,
    /// `size_bytes` of the snapshots of the `Snapshot` row (median).
    snapshot_size: Option<u64>,
    /// Why the whole tier is unavailable.
    unavailable: Option<String>,
}

#[derive(Debug, Default)]
struct Report {
    rows: BTreeMap<Key, Outcome>,
    density: Option<Result<Density, String>>,
    /// RSS of the latency daemon once its sections were done and nothing was live.
    rss_after_latency: Option<u64>,
    /// `size_bytes` the daemon reported for the snapshots of each `Snapshot` row (median).
    snapshot_sizes: BTreeMap<Key, u64>,
    /// Each concurrency level, or why it failed.
    throughput: Vec<(usize, Result<Throughput, String>)>,
    /// Why the container tier's rows are unavailable.
    container_unavailable: Option<String>,
    /// What the microVM section found beyond its rows.
    microvm: MicroVm,
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
            || self.throughput.iter().any(|(_, r)| r.is_err())
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Like [`mib`], but small sizes stay readable.
fn mib_of(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{:.0} KiB", bytes as f64 / 1024.0)
    } else {
        mib(bytes)
    }
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

/// A difference in milliseconds, with its sign.
fn signed_ms(v: f64) -> String {
    if v < 0.0 {
        format!("-{}", ms(-v))
    } else {
        format!("+{}", ms(v))
    }
}

/// A text on one line (for a paragraph, which a newline would break).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Markdown table cells can hold neither newlines nor pipes.
fn cell(s: &str) -> String {
    let one_line = one_line(s);
    let short: String = if one_line.chars().count() > 160 {
        one_line.chars().take(160).chain("…".chars()).collect()
    } else {
        one_line
    };
    short.replace('|', "\\|")
}

/// One row of a latency table: n, p50, p99, mean, max, or why there are none.
fn table_row(w: &mut String, report: &Report, key: Key, plan: &Plan) {
    let label = key.label(plan.live);
    match report.rows.get(&key) {
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

/// p50 of some samples, for a sentence.
fn p50_of(samples: &[Duration]) -> Option<String> {
    summarize(samples).map(|s| format!("{} ms", ms(s.p50)))
}

/// The `## microVM tier` section: how the guests ran, the rows, what the daemon logged.
fn render_microvm(w: &mut String, report: &Report, plan: &Plan) {
    let vm = &report.microvm;
    let _ = writeln!(w, "\n## microVM tier\n");
    if let Some(why) = &vm.unavailable {
        let _ = writeln!(w, "**Unavailable on this host**: {}\n", cell(why));
    }
    let _ = writeln!(
        w,
        "Each sandbox is a QEMU `microvm` guest with its own kernel (`ISOLATION_MICROVM`, image \
         `minimal`, default limits). Milliseconds of wall time per API call, as the client sees it."
    );
    match vm.auto_accel {
        Some(accel) => {
            let _ = writeln!(
                w,
                "\nThe daemon left at `accel = \"auto\"` ran its guests under **{}**; it logged: {}. \
                 Every row below that names no accelerator ran on that daemon (the warm pool on one \
                 like it).\n",
                accel.name(),
                if vm.accel_log.is_empty() {
                    "nothing about KVM or TCG".to_string()
                } else {
                    vm.accel_log
                        .iter()
                        .map(|l| format!("`{}`", one_line(l).replace('`', "'")))
                        .collect::<Vec<_>>()
                        .join("; ")
                }
            );
        }
        None => {
            let _ = writeln!(w);
        }
    }
    if let Some(forced) = &vm.kvm_forced {
        let _ = writeln!(
            w,
            "KVM is unusable on this host: {}; then {}.\n",
            vm.kvm_reason
                .as_deref()
                .map(one_line)
                .unwrap_or_else(|| "the daemon left at `accel = \"auto\"` chose TCG".into()),
            one_line(forced)
        );
    }
    let _ = writeln!(
        w,
        "| measurement | n | p50 ms | p99 ms | mean ms | max ms |\n|---|---:|---:|---:|---:|---:|"
    );
    for key in Key::MICROVM {
        table_row(w, report, key, plan);
    }
    let mut notes = Vec::new();
    for (accel, (boot, uptime)) in &vm.boot_logged {
        if let (Some(b), Some(u)) = (p50_of(boot), p50_of(uptime)) {
            notes.push(format!(
                "the daemon's own boot time of the timed cold boots under {} (QEMU started → the guest \
                 agent's hello, `boot_ms` of its `{LOG_BOOTED}` lines): p50 {b}, of which the guest \
                 kernel had been up p50 {u} at the hello",
                accel.name()
            ));
        }
    }
    if let Some(b) = p50_of(&vm.pool_boot_logged) {
        notes.push(format!(
            "the warm pool's {} boots in the background (`boot_ms` of `{LOG_POOL_READY}`): p50 {b}; \
             every timed pool create was checked to be served by the pool (`{LOG_POOL_TAKEN}` for its id)",
            vm.pool_boot_logged.len()
        ));
    }
    if let Some(size) = vm.snapshot_size {
        notes.push(format!(
            "the snapshots' `size_bytes` with {CHANGED_SMALL_MIB} MiB changed (median): {}",
            mib_of(size)
        ));
    }
    if !notes.is_empty() {
        let _ = writeln!(w);
    }
    for note in notes {
        let _ = writeln!(w, "- {note}");
    }
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
    let all_rows = Key::SANDBOXD
        .iter()
        .chain(Key::SNAPSHOTS.iter())
        .chain(Key::FORKS.iter())
        .chain(Key::CONTAINER.iter())
        .chain(Key::DOCKER.iter());
    for key in all_rows {
        table_row(w, report, *key, plan);
    }
    if !report.snapshot_sizes.is_empty() {
        let sizes: Vec<String> = Key::SNAPSHOTS
            .iter()
            .filter_map(|k| match (k, report.snapshot_sizes.get(k)) {
                (Key::Snapshot(image, mib), Some(size)) => Some(format!(
                    "{} with {mib} MiB changed: {}",
                    image.name(),
                    mib_of(*size)
                )),
                _ => None,
            })
            .collect();
        let _ = writeln!(
            w,
            "\nThe snapshots' `size_bytes` as the daemon reported them (median): {}.",
            sizes.join("; ")
        );
    }

    let _ = writeln!(w, "\n## Exec throughput\n");
    if report.throughput.is_empty() {
        let _ = writeln!(w, "not run");
    } else {
        let _ = writeln!(
            w,
            "Unary `Exec` of `true` spread round-robin over {THROUGHPUT_SANDBOXES} process-tier sandboxes by \
             concurrent client tasks; execs/s is the count over the wall time from the first send to the \
             last answer, latency is each exec's round trip under that load.\n"
        );
        let _ = writeln!(
            w,
            "| concurrency | execs | wall s | execs/s | p50 ms | p99 ms | mean ms | max ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (concurrency, result) in &report.throughput {
            match result {
                Ok(t) => {
                    let _ = writeln!(
                        w,
                        "| {} | {} | {:.2} | {:.0} | {} | {} | {} | {} |",
                        t.concurrency,
                        t.execs,
                        t.wall.as_secs_f64(),
                        t.per_second(),
                        ms(t.latency.p50),
                        ms(t.latency.p99),
                        ms(t.latency.mean),
                        ms(t.latency.max)
                    );
                }
                Err(why) => {
                    let _ = writeln!(
                        w,
                        "| {concurrency} | — | | **FAILED** | | | | {} |",
                        cell(why)
                    );
                }
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

    render_microvm(w, report, plan);

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
        (
            "container tier, a sandbox ready to exec: `CreateSandbox` vs container create+start (`--network none`)",
            report.p50(Key::ContainerCreate),
            report.p50(Key::DockerCreateStart),
        ),
        (
            "container tier, run `true` in it: `Exec` vs `docker exec`",
            report.p50(Key::ContainerExec),
            report.p50(Key::DockerExec),
        ),
        (
            "container tier, tear down: `DestroySandbox` vs `rm -f`",
            report.p50(Key::ContainerDestroy),
            report.p50(Key::DockerRemove),
        ),
        (
            "microVM tier, cold: boot to first exec vs container create+start (`--network none`)",
            report
                .microvm
                .auto_accel
                .and_then(|a| report.p50(Key::MicroVmBoot(a))),
            report.p50(Key::DockerCreateStart),
        ),
        (
            "microVM tier, from the warm pool: `CreateSandbox` vs container create+start (`--network none`)",
            report.p50(Key::MicroVmPoolCreate),
            report.p50(Key::DockerCreateStart),
        ),
        (
            "microVM tier, run `true` in it: `Exec` vs `docker exec`",
            report.p50(Key::MicroVmExec),
            report.p50(Key::DockerExec),
        ),
    ];
    for (what, ours, theirs) in comparisons {
        let f = |v: Option<f64>| v.map(ms).unwrap_or_else(|| "unavailable".into());
        let ratio = match (ours, theirs) {
            // A slower sandboxd (a microVM booting) keeps two digits instead of reading 0.0×.
            (Some(o), Some(t)) if o > 0.0 && t / o < 0.1 => format!("{:.2}×", t / o),
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
        "\nSnapshots, forks and exec throughput run on a third fresh daemon. Snapshot and rollback are \
         measured in one process-tier sandbox per image (`minimal`, `debian`) and size ({CHANGED_SMALL_MIB} \
         and {CHANGED_LARGE_MIB} MiB), {} and {} samples, after one untimed round. Each sample, untimed: \
         `dd if=/dev/urandom of=/workspace/blob bs=1M count=N` and `sync` (a fresh write every time, so each \
         snapshot holds N MiB changed since the image, and `sync` keeps the write-back of dirty pages out of \
         the snapshot); then `Snapshot` (timed); then, untimed, the blob is deleted and a new file written; \
         then `Rollback` to the snapshot (timed); then, untimed, an exec checks the blob is back at its full \
         size and the new file gone, and the snapshot is deleted. Forks: one sandbox of `minimal` with \
         {CHANGED_SMALL_MIB} MiB written is snapshotted once; `CreateSandbox{{from_snapshot_id}}` of it and \
         the fork's `DestroySandbox` are timed apart ({} cycles; the first fork is checked to see the \
         origin's file), then {} batches of {FORK_BATCH} forks created one after another are timed as a \
         whole (destroyed untimed after each batch). Exec throughput: {THROUGHPUT_SANDBOXES} sandboxes, \
         a few untimed execs in each, then for each concurrency level C that many tokio tasks share one \
         client connection (HTTP/2 multiplexes their calls) and take the next of N exec numbers until all \
         are done, exec k going to sandbox k mod {THROUGHPUT_SANDBOXES}. The container tier \
         (`ISOLATION_CONTAINER`, image `minimal`) runs on a fourth daemon: one untimed create first (it may \
         import the image into Docker); if that fails the rows say unavailable with the daemon's reason \
         and the bench goes on; otherwise creates and destroys ({} cycles), execs of `true` in one sandbox \
         ({}) and snapshot+rollback with {CHANGED_SMALL_MIB} MiB changed ({}, as above) are timed the same \
         way as for the process tier.{}",
        plan.snap_small,
        plan.snap_large,
        plan.fork,
        plan.fork_batches,
        plan.container_create,
        plan.container_exec,
        plan.container_snap,
        match &report.container_unavailable {
            Some(why) => format!(" In this run the container tier was unavailable: {}.", cell(why)),
            None => String::new(),
        },
    );
    let _ = writeln!(
        w,
        "\nThe microVM tier (`ISOLATION_MICROVM`, image `minimal`, default limits) runs last, on daemons \
         of its own logging JSON with `{MICROVM_LOG_DIRECTIVE}`, so the bench reads from their logs \
         which accelerator the guests used (`accel=` of `{LOG_BOOTED}`) and why (the KVM probe lines). \
         First a daemon left at `accel = \"auto\"`: one untimed boot (it may run the KVM probe), then \
         {} cold boots with no pool, each timed from the `CreateSandbox` call to the answer of the first \
         `Exec` of `true` in the new VM (the create alone is a row too; the destroy is timed apart); \
         every boot must be logged under that accelerator. On the same daemon: unary and streamed execs \
         of `true` in one VM ({} and {}, after untimed ones), snapshot+rollback with \
         {CHANGED_SMALL_MIB} MiB changed ({} samples, as for the process tier; a microVM rollback boots \
         a new VM over the snapshot) and forks (`CreateSandbox{{from_snapshot_id}}` of one snapshot, \
         {} after an untimed one that checks the fork sees the origin's file, each destroyed before \
         the next: first while the origin runs, then again after it is destroyed). Then a daemon \
         forced to the other accelerator boots {} VMs the same way; when that is KVM and its first \
         create fails (boot deadline {KVM_TRY_BOOT_TIMEOUT_MS} ms), the KVM rows say so with the \
         reason. Last a daemon \
         with `--microvm-pool 1`: before each of {} creates (after an untimed one) the bench waits for \
         the log to show the pool holding a booted VM again (`{LOG_POOL_READY}`), times \
         `CreateSandbox` and its first exec, and checks the log says the create took the pooled VM \
         (`{LOG_POOL_TAKEN}`); the pool's refill boots in the background meanwhile, as it would in \
         use. A host that cannot run the tier at all (FAILED_PRECONDITION: no QEMU, no VM artifacts) \
         marks its rows unavailable.",
        plan.microvm_boot,
        plan.microvm_exec,
        plan.microvm_stream,
        plan.microvm_snap,
        plan.microvm_fork,
        plan.microvm_boot,
        plan.microvm_pool,
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

    // Snapshots (issue 3): absolute targets with a small change over the small image...
    let small = CHANGED_SMALL_MIB;
    for (op, key, target) in [
        (
            "`Snapshot`",
            Key::Snapshot(Image::Minimal, small),
            TARGET_SNAPSHOT_P50_MS,
        ),
        (
            "`Rollback`",
            Key::Rollback(Image::Minimal, small),
            TARGET_ROLLBACK_P50_MS,
        ),
    ] {
        let t = format!("{op} p50 ≤ {target} ms with {small} MiB changed (image minimal)");
        out.push(match report.p50(key) {
            Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= target)),
            None => (t, "not measured".into(), "not measured".into()),
        });
    }
    // ...and the same change over a 100× larger image costs at most twice as much.
    for (op, large, base) in [
        (
            "`Snapshot`",
            Key::Snapshot(Image::Debian, small),
            Key::Snapshot(Image::Minimal, small),
        ),
        (
            "`Rollback`",
            Key::Rollback(Image::Debian, small),
            Key::Rollback(Image::Minimal, small),
        ),
    ] {
        let t = format!(
            "{op} over the 100× larger image within {TARGET_LARGE_IMAGE_FACTOR}× of the small one \
             (p50, debian vs minimal, {small} MiB changed)"
        );
        out.push(match (report.p50(large), report.p50(base)) {
            (Some(l), Some(b)) => {
                let ratio = l / b.max(1e-9);
                (
                    t,
                    format!("{} ms vs {} ms: {ratio:.2}×", ms(l), ms(b)),
                    verdict(ratio <= TARGET_LARGE_IMAGE_FACTOR),
                )
            }
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    let t = format!("fork p50 ≤ `CreateSandbox` p50 + {TARGET_FORK_OVER_CREATE_MS} ms");
    out.push(match (report.p50(Key::Fork), report.p50(Key::Create)) {
        (Some(f), Some(c)) => (
            t,
            format!(
                "fork {} ms, create {} ms: {} ms",
                ms(f),
                ms(c),
                signed_ms(f - c)
            ),
            verdict(f <= c + TARGET_FORK_OVER_CREATE_MS),
        ),
        _ => (t, "not measured".into(), "not measured".into()),
    });

    // Container tier (issue 4).
    for (what, ours, theirs) in [
        (
            "container tier `CreateSandbox`",
            Key::ContainerCreate,
            Key::DockerCreateStart,
        ),
        ("container tier `Exec`", Key::ContainerExec, Key::DockerExec),
    ] {
        let t = format!(
            "{what} p50 within {TARGET_CONTAINER_VS_DOCKER}× of the raw Docker calls ({})",
            match theirs {
                Key::DockerCreateStart => "create+start",
                _ => "`docker exec`",
            }
        );
        out.push(match (report.p50(ours), report.p50(theirs)) {
            (Some(o), Some(d)) => {
                let ratio = o / d.max(1e-9);
                (
                    t,
                    format!("{} ms vs Docker {} ms: {ratio:.2}×", ms(o), ms(d)),
                    verdict(ratio <= TARGET_CONTAINER_VS_DOCKER),
                )
            }
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    let t = format!(
        "container tier `Rollback` p50 ≤ {TARGET_CONTAINER_ROLLBACK_P50_MS} ms ({small} MiB changed)"
    );
    out.push(match report.p50(Key::ContainerRollback) {
        Some(p) => (
            t,
            format!("{} ms", ms(p)),
            verdict(p <= TARGET_CONTAINER_ROLLBACK_P50_MS),
        ),
        None => (t, "not measured".into(), "not measured".into()),
    });

    // MicroVM tier, with Docker's number for the same step of this run beside each.
    let docker = |key: Key, what: &str| match report.p50(key) {
        Some(d) => format!("; Docker {what} p50 {} ms", ms(d)),
        None => String::new(),
    };
    let create_start = docker(Key::DockerCreateStart, "create+start");
    for (accel, target) in [
        (VmAccel::Tcg, TARGET_MICROVM_TCG_BOOT_P50_MS),
        (VmAccel::Kvm, TARGET_MICROVM_KVM_BOOT_P50_MS),
    ] {
        let t = format!(
            "microVM boot to first exec under {} p50 ≤ {target} ms (no pool){}",
            accel.name(),
            if accel == VmAccel::Kvm {
                ", where KVM works"
            } else {
                ""
            }
        );
        let boot = Key::MicroVmBoot(accel);
        out.push(match report.rows.get(&boot) {
            Some(Outcome::Measured(s)) => {
                let create = report.p50(Key::MicroVmCreate(accel)).map(ms);
                (
                    t,
                    format!(
                        "{} ms (`CreateSandbox` alone {} ms){create_start}",
                        ms(s.p50),
                        create.unwrap_or_else(|| "?".into())
                    ),
                    verdict(s.p50 <= target),
                )
            }
            Some(Outcome::Unavailable(why)) if accel == VmAccel::Kvm => {
                (t, why.clone(), "not measured (no usable KVM)".into())
            }
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    let t = format!("microVM exec round trip p50 ≤ {TARGET_MICROVM_EXEC_P50_MS} ms");
    out.push(match report.p50(Key::MicroVmExec) {
        Some(p) => (
            t,
            format!(
                "{} ms (unary `Exec` of `true`, back to back{}){}",
                ms(p),
                report
                    .microvm
                    .auto_accel
                    .map(|a| format!(", under {}", a.name()))
                    .unwrap_or_default(),
                docker(Key::DockerExec, "exec")
            ),
            verdict(p <= TARGET_MICROVM_EXEC_P50_MS),
        ),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!(
        "microVM `CreateSandbox` from the warm pool p50 ≤ {TARGET_MICROVM_POOL_CREATE_P50_MS} ms"
    );
    out.push(match report.p50(Key::MicroVmPoolCreate) {
        Some(p) => (
            t,
            format!("{} ms{create_start}", ms(p)),
            verdict(p <= TARGET_MICROVM_POOL_CREATE_P50_MS),
        ),
        None => (t, "not measured".into(), "not measured".into()),
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
    /// `qemu-system-x86_64 --version` and whether /dev/kvm exists (the microVM tier).
    qemu: String,
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
        let qemu_version = std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(str::to_string)
            });
        let qemu = format!(
            "{}; /dev/kvm {}",
            qemu_version.unwrap_or_else(|| "qemu-system-x86_64 not found".into()),
            if Path::new("/dev/kvm").exists() {
                "present"
            } else {
                "absent"
            }
        );
        Machine {
            qemu,
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
            ("QEMU (microVM tier)", self.qemu.clone()),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// sandboxd

/// The sandboxes and snapshots of one daemon that are alive, so that each one is removed
/// whatever happens.
struct Sandboxes {
    client: Client,
    live: BTreeSet<String>,
    snapshots: BTreeSet<String>,
}

impl Sandboxes {
    fn new(client: Client) -> Self {
        Sandboxes {
            client,
            live: BTreeSet::new(),
            snapshots: BTreeSet::new(),
        }
    }

    /// Creates a process-tier sandbox of image `minimal`; returns its id and the call's time.
    async fn create(&mut self, what: &str) -> Result<(String, Duration)> {
        self.create_with(process_sandbox("minimal"), what).await
    }

    /// Creates a sandbox as asked; returns its id and the call's time. Fails unless it is
    /// RUNNING in the tier asked for (a policy upgrade would measure another tier's numbers).
    async fn create_with(
        &mut self,
        request: proto::CreateSandboxRequest,
        what: &str,
    ) -> Result<(String, Duration)> {
        check_interrupt()?;
        let asked = request.isolation;
        let t = Instant::now();
        let sandbox = self
            .client
            .create(request)
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
        if asked != proto::Isolation::Unspecified as i32 && sandbox.isolation != asked {
            bail!(
                "CreateSandbox ({what}) asked for {} and got sandbox {} of {}{}",
                isolation_name(asked),
                sandbox.id,
                isolation_name(sandbox.isolation),
                if sandbox.isolation_reason.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", sandbox.isolation_reason)
                }
            );
        }
        Ok((sandbox.id, took))
    }

    /// Snapshots sandbox `id`; returns the snapshot's id and size and the call's time.
    async fn snapshot(&mut self, id: &str, what: &str) -> Result<(String, u64, Duration)> {
        check_interrupt()?;
        let t = Instant::now();
        let snap = self
            .client
            .snapshot(id, "")
            .await
            .with_context(|| format!("Snapshot of {id} ({what})"))?;
        let took = t.elapsed();
        self.snapshots.insert(snap.snapshot_id.clone());
        Ok((snap.snapshot_id, snap.size_bytes, took))
    }

    /// Rolls sandbox `id` back to `snapshot`; returns the call's time.
    async fn rollback(&mut self, id: &str, snapshot: &str, what: &str) -> Result<Duration> {
        check_interrupt()?;
        let t = Instant::now();
        let sandbox = self
            .client
            .rollback(id, snapshot)
            .await
            .with_context(|| format!("Rollback of {id} to {snapshot} ({what})"))?;
        let took = t.elapsed();
        if sandbox.state != proto::SandboxState::Running as i32 {
            bail!(
                "Rollback of {id} to {snapshot} ({what}) left the sandbox in state {}, not RUNNING",
                state_name(sandbox.state)
            );
        }
        Ok(took)
    }

    async fn delete_snapshot(&mut self, snapshot: &str) -> Result<()> {
        self.client
            .delete_snapshot(snapshot)
            .await
            .with_context(|| format!("DeleteSnapshot {snapshot}"))?;
        self.snapshots.remove(snapshot);
        Ok(())
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

    /// Destroys whatever is still alive, then deletes the snapshots (forks first, or their
    /// origin snapshot could not go); says loudly what could not be.
    async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.live) {
            if let Err(e) = self.client.destroy(id.as_str()).await {
                eprintln!("bench: WARNING: could not destroy sandbox {id} while cleaning up: {e}");
            }
        }
        for snap in std::mem::take(&mut self.snapshots) {
            if let Err(e) = self.client.delete_snapshot(snap.as_str()).await {
                eprintln!(
                    "bench: WARNING: could not delete snapshot {snap} while cleaning up: {e}"
                );
            }
        }
    }
}

fn isolation_name(isolation: i32) -> &'static str {
    proto::Isolation::try_from(isolation)
        .map(|i| i.as_str_name())
        .unwrap_or("unknown")
}

/// Runs `script` with `sh -c` in sandbox `id` (untimed set-up and checks); fails unless it
/// exits 0, with its stderr in the error.
async fn sh(client: &Client, id: &str, script: &str, what: &str) -> Result<()> {
    check_interrupt()?;
    let result = client
        .exec(exec_request(id, ["sh", "-c", script]))
        .await
        .with_context(|| format!("Exec of `{script}` in {id} ({what})"))?;
    if result.status != proto::ExecStatus::Exited as i32 || result.exit_code != 0 {
        let status = proto::ExecStatus::try_from(result.status)
            .map(|s| s.as_str_name())
            .unwrap_or("unknown");
        bail!(
            "{what}: `{script}` in {id} ended with status {status}, exit code {}: {}{}",
            result.exit_code,
            String::from_utf8_lossy(&result.stderr).trim(),
            result.error
        );
    }
    Ok(())
}

/// Writes `mib` MiB of fresh random bytes to /workspace/blob and flushes them to disk.
async fn write_blob(client: &Client, id: &str, mib: u32, what: &str) -> Result<()> {
    let script =
        format!("dd if=/dev/urandom of=/workspace/blob bs=1M count={mib} 2>/dev/null && sync");
    sh(client, id, &script, what).await
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

/// Snapshot and rollback samples in one new sandbox made by `request`, each over `mib` MiB
/// freshly written since the image; returns the snapshot times, the rollback times and the
/// snapshots' reported sizes. One untimed round first.
async fn snapshot_rollback(
    sb: &mut Sandboxes,
    request: proto::CreateSandboxRequest,
    mib: u32,
    n: usize,
) -> Result<(Vec<Duration>, Vec<Duration>, Vec<u64>)> {
    let section = format!(
        "snapshot+rollback, {mib} MiB changed, image {}",
        request.image
    );
    let (id, _) = sb
        .create_with(request, &format!("the sandbox of the {section} section"))
        .await?;
    let bytes = u64::from(mib) << 20;
    // After the rollback the blob must be back whole and the file written after the snapshot gone.
    let check = format!(
        "[ \"$(wc -c < /workspace/blob)\" -eq {bytes} ] && [ ! -e /workspace/after-snapshot ]"
    );
    let warmup = 1;
    let (mut snaps, mut rollbacks, mut sizes) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for i in 0..warmup + n {
        let what = format!("{section}, sample {i}");
        write_blob(&sb.client, &id, mib, &what).await?;
        let (snap, size, took_snap) = sb.snapshot(&id, &what).await?;
        sh(
            &sb.client,
            &id,
            "rm /workspace/blob && echo changed > /workspace/after-snapshot",
            &what,
        )
        .await?;
        let took_rollback = sb.rollback(&id, &snap, &what).await?;
        sh(
            &sb.client,
            &id,
            &check,
            &format!("{what}, after the rollback"),
        )
        .await
        .with_context(|| format!("rollback to {snap} did not restore the filesystem"))?;
        sb.delete_snapshot(&snap).await?;
        if i >= warmup {
            snaps.push(took_snap);
            rollbacks.push(took_rollback);
            sizes.push(size);
        }
    }
    sb.destroy(&id).await?;
    Ok((snaps, rollbacks, sizes))
}

/// What the fork section measured.
struct Forks {
    creates: Vec<Duration>,
    destroys: Vec<Duration>,
    batches: Vec<Duration>,
}

/// Forks of one snapshot of a `minimal` sandbox with [`CHANGED_SMALL_MIB`] MiB written: single
/// forks (create and destroy timed apart), then batches of [`FORK_BATCH`].
async fn forks(sb: &mut Sandboxes, plan: &Plan) -> Result<Forks> {
    let (origin, _) = sb.create("the origin of the forks").await?;
    write_blob(
        &sb.client,
        &origin,
        CHANGED_SMALL_MIB,
        "the origin of the forks",
    )
    .await?;
    let (snap, _, _) = sb.snapshot(&origin, "the snapshot to fork").await?;
    let fork_request = || proto::CreateSandboxRequest {
        from_snapshot_id: snap.clone(),
        ..process_sandbox("minimal")
    };
    let mut forks = Forks {
        creates: Vec::with_capacity(plan.fork),
        destroys: Vec::with_capacity(plan.fork),
        batches: Vec::with_capacity(plan.fork_batches),
    };
    for i in 0..plan.warmup + plan.fork {
        let (id, took) = sb
            .create_with(fork_request(), &format!("fork {i} of {snap}"))
            .await?;
        if i == 0 {
            let check = format!(
                "[ \"$(wc -c < /workspace/blob)\" -eq {} ]",
                u64::from(CHANGED_SMALL_MIB) << 20
            );
            sh(&sb.client, &id, &check, "the first fork")
                .await
                .context("a fork does not see its snapshot's files")?;
        }
        let destroyed = sb.destroy(&id).await?;
        if i >= plan.warmup {
            forks.creates.push(took);
            forks.destroys.push(destroyed);
        }
    }
    for b in 0..plan.fork_batches {
        let mut ids = Vec::with_capacity(FORK_BATCH);
        let t = Instant::now();
        for k in 0..FORK_BATCH {
            let (id, _) = sb
                .create_with(fork_request(), &format!("fork {k} of batch {b}"))
                .await?;
            ids.push(id);
        }
        forks.batches.push(t.elapsed());
        for id in &ids {
            sb.destroy(id).await?;
        }
    }
    sb.destroy(&origin).await?;
    sb.delete_snapshot(&snap).await?;
    Ok(forks)
}

/// `execs` unary execs of `true` over `ids` by `concurrency` tasks sharing one client.
async fn throughput_level(
    client: &Client,
    ids: &Arc<Vec<String>>,
    concurrency: usize,
    execs: usize,
) -> Result<Throughput> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..concurrency {
        let (client, ids, next) = (client.clone(), Arc::clone(ids), Arc::clone(&next));
        tasks.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= execs {
                    return Ok::<_, anyhow::Error>(samples);
                }
                let id = &ids[k % ids.len()];
                let what = format!("exec {k} of {execs} at concurrency {concurrency}");
                samples.push(exec_true(&client, id, &what).await?);
            }
        });
    }
    let mut samples = Vec::with_capacity(execs);
    // The first error ends the level; dropping the JoinSet aborts the other tasks.
    while let Some(joined) = tasks.join_next().await {
        samples.extend(joined.context("an exec task panicked")??);
    }
    let wall = started.elapsed();
    let latency = summarize(&samples).ok_or_else(|| anyhow!("no execs were run"))?;
    Ok(Throughput {
        concurrency,
        execs: samples.len(),
        wall,
        latency,
    })
}

/// Exec throughput at each concurrency level of the plan, over [`THROUGHPUT_SANDBOXES`]
/// sandboxes made for it.
async fn throughput(sb: &mut Sandboxes, plan: &Plan, report: &mut Report) -> Result<()> {
    let mut ids = Vec::with_capacity(THROUGHPUT_SANDBOXES);
    for i in 0..THROUGHPUT_SANDBOXES {
        let (id, _) = sb.create(&format!("throughput sandbox {i}")).await?;
        for w in 0..plan.warmup {
            exec_true(
                &sb.client,
                &id,
                &format!("warm-up {w} of throughput sandbox {i}"),
            )
            .await?;
        }
        ids.push(id);
    }
    let ids = Arc::new(ids);
    for (concurrency, execs) in plan.throughput {
        eprintln!("bench: sandboxd exec throughput, {execs} execs at concurrency {concurrency}");
        let result = throughput_level(&sb.client, &ids, concurrency, execs).await;
        if let Err(e) = &result {
            eprintln!("bench: FAILED exec throughput at concurrency {concurrency}: {e:#}");
        }
        report
            .throughput
            .push((concurrency, result.map_err(|e| format!("{e:#}"))));
        check_interrupt()?;
    }
    for id in ids.iter() {
        sb.destroy(id).await?;
    }
    Ok(())
}

/// The median of some sizes (the lower middle of an even count).
fn median(values: &[u64]) -> Option<u64> {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get(v.len().checked_sub(1)? / 2).copied()
}

/// Snapshots, forks and exec throughput on a daemon of their own, so that neither the latency
/// daemon's RSS nor the density daemon's is theirs.
async fn sandboxd_snapshots(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys: Vec<Key> = Key::SNAPSHOTS
        .iter()
        .chain(Key::FORKS.iter())
        .copied()
        .collect();
    let fail_all = |report: &mut Report, e: &anyhow::Error| {
        report.failed(&keys, e);
        for (concurrency, _) in plan.throughput {
            report.throughput.push((concurrency, Err(format!("{e:#}"))));
        }
    };
    let daemon = match Daemon::start()
        .await
        .context("starting sandboxd for the snapshot, fork and throughput sections")
    {
        Ok(d) => d,
        Err(e) => return fail_all(report, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return fail_all(report, &e),
    };
    let mut sb = Sandboxes::new(client);

    for image in [Image::Minimal, Image::Debian] {
        for (mib, n) in [
            (CHANGED_SMALL_MIB, plan.snap_small),
            (CHANGED_LARGE_MIB, plan.snap_large),
        ] {
            eprintln!(
                "bench: sandboxd snapshot+rollback, {mib} MiB changed, image {} × {n}",
                image.name()
            );
            let (snap_key, rollback_key) = (Key::Snapshot(image, mib), Key::Rollback(image, mib));
            match snapshot_rollback(&mut sb, process_sandbox(image.name()), mib, n).await {
                Ok((snaps, rollbacks, sizes)) => {
                    report.measured(snap_key, &snaps);
                    report.measured(rollback_key, &rollbacks);
                    if let Some(size) = median(&sizes) {
                        report.snapshot_sizes.insert(snap_key, size);
                    }
                }
                Err(e) => report.failed(&[snap_key, rollback_key], &e),
            }
            sb.cleanup().await;
        }
    }

    eprintln!(
        "bench: sandboxd forks × {}, batches of {FORK_BATCH} × {}",
        plan.fork, plan.fork_batches
    );
    match forks(&mut sb, plan).await {
        Ok(f) => {
            report.measured(Key::Fork, &f.creates);
            report.measured(Key::ForkDestroy, &f.destroys);
            report.measured(Key::ForkBatch, &f.batches);
        }
        Err(e) => report.failed(&Key::FORKS, &e),
    }
    sb.cleanup().await;

    if let Err(e) = throughput(&mut sb, plan, report).await {
        eprintln!("bench: FAILED exec throughput: {e:#}");
        let done: BTreeSet<usize> = report.throughput.iter().map(|(c, _)| *c).collect();
        for (concurrency, _) in plan.throughput {
            if !done.contains(&concurrency) {
                report.throughput.push((concurrency, Err(format!("{e:#}"))));
            }
        }
    }
    sb.cleanup().await;

    drop(daemon);
    report.section_times.push((
        "sandboxd snapshots, forks, throughput".into(),
        started.elapsed(),
    ));
}

/// The container tier's rows, once a first container sandbox has been created.
async fn container_sections(sb: &mut Sandboxes, plan: &Plan, report: &mut Report) -> Result<()> {
    let request = || proto::CreateSandboxRequest {
        isolation: proto::Isolation::Container as i32,
        ..process_sandbox("minimal")
    };
    eprintln!(
        "bench: sandboxd container tier create/destroy × {}",
        plan.container_create
    );
    let (mut creates, mut destroys) = (Vec::new(), Vec::new());
    for i in 0..plan.warmup.min(2) + plan.container_create {
        let (id, took) = sb
            .create_with(request(), &format!("container tier sample {i}"))
            .await?;
        let destroyed = sb.destroy(&id).await?;
        if i >= plan.warmup.min(2) {
            creates.push(took);
            destroys.push(destroyed);
        }
    }
    report.measured(Key::ContainerCreate, &creates);
    report.measured(Key::ContainerDestroy, &destroys);

    eprintln!(
        "bench: sandboxd container tier Exec × {}",
        plan.container_exec
    );
    let (id, _) = sb
        .create_with(request(), "the sandbox of the container tier exec section")
        .await?;
    let mut execs = Vec::new();
    for i in 0..plan.warmup * 3 + plan.container_exec {
        let took = exec_true(&sb.client, &id, &format!("container tier exec {i}")).await?;
        if i >= plan.warmup * 3 {
            execs.push(took);
        }
    }
    report.measured(Key::ContainerExec, &execs);
    sb.destroy(&id).await?;

    eprintln!(
        "bench: sandboxd container tier snapshot+rollback, {CHANGED_SMALL_MIB} MiB changed × {}",
        plan.container_snap
    );
    let (snaps, rollbacks, _) =
        snapshot_rollback(sb, request(), CHANGED_SMALL_MIB, plan.container_snap).await?;
    report.measured(Key::ContainerSnapshot, &snaps);
    report.measured(Key::ContainerRollback, &rollbacks);
    Ok(())
}

/// The container tier (`ISOLATION_CONTAINER`) on a daemon of its own. A container tier that
/// cannot create a sandbox (no Docker, or not finished) marks its rows unavailable, loudly;
/// one that creates and then fails is a failure like any other sandboxd section.
async fn sandboxd_container(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let unavailable = |report: &mut Report, why: String| {
        let line = format!(
            "!!!!! SANDBOXD CONTAINER TIER UNAVAILABLE: {why} — its rows say \"unavailable\" !!!!!"
        );
        eprintln!("{line}");
        println!("{line}");
        report.unavailable(&Key::CONTAINER, &why);
        report.container_unavailable = Some(why);
    };
    let daemon = match Daemon::start()
        .await
        .context("starting sandboxd for the container tier")
    {
        Ok(d) => d,
        Err(e) => return report.failed(&Key::CONTAINER, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return report.failed(&Key::CONTAINER, &e),
    };
    let mut sb = Sandboxes::new(client);
    eprintln!("bench: sandboxd container tier: a first, untimed create (may import the image)");
    let probe = proto::CreateSandboxRequest {
        isolation: proto::Isolation::Container as i32,
        ..process_sandbox("minimal")
    };
    let result = match sb.create_with(probe, "container tier, first create").await {
        Err(e) => {
            unavailable(
                report,
                format!("CreateSandbox with ISOLATION_CONTAINER failed: {e:#}"),
            );
            Ok(())
        }
        Ok((id, _)) => match sb.destroy(&id).await {
            Ok(_) => container_sections(&mut sb, plan, report).await,
            Err(e) => Err(e),
        },
    };
    sb.cleanup().await;
    if let Err(e) = result {
        let missing: Vec<Key> = Key::CONTAINER
            .into_iter()
            .filter(|k| !report.rows.contains_key(k))
            .collect();
        report.failed(&missing, &e);
    }
    drop(daemon);
    report
        .section_times
        .push(("sandboxd container tier".into(), started.elapsed()));
}

// ---------------------------------------------------------------------------------------------
// sandboxd's microVM tier

/// One line of a daemon's log, written with `--log-format json`.
#[derive(Debug)]
struct LogLine {
    timestamp: String,
    level: String,
    message: String,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl LogLine {
    fn parse(line: &str) -> Option<LogLine> {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        let mut fields = value.get("fields")?.as_object()?.clone();
        let message = fields.remove("message")?.as_str()?.to_string();
        let level = value
            .get("level")
            .and_then(|l| l.as_str())
            .unwrap_or_default()
            .to_string();
        let timestamp = value
            .get("timestamp")
            .and_then(|t| t.as_str())
            .unwrap_or_default()
            .to_string();
        Some(LogLine {
            timestamp,
            level,
            message,
            fields,
        })
    }

    /// A field as text (a string without its quotes).
    fn field(&self, key: &str) -> Option<String> {
        self.fields.get(key).map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    fn millis(&self, key: &str) -> Option<Duration> {
        self.fields.get(key)?.as_u64().map(Duration::from_millis)
    }

    /// `LEVEL message key=value …`, as the report quotes it.
    fn text(&self) -> String {
        let mut text = format!("{} {}", self.level, self.message);
        for key in self.fields.keys() {
            let _ = write!(text, " {key}={}", self.field(key).unwrap_or_default());
        }
        text
    }
}

/// The lines of a daemon's JSON log (anything else, e.g. a panic message, is left out).
fn log_lines(log: &str) -> Vec<LogLine> {
    log.lines().filter_map(LogLine::parse).collect()
}

fn count_logged(lines: &[LogLine], message: &str) -> usize {
    lines.iter().filter(|l| l.message == message).count()
}

/// The lines in which the daemon says how its microVMs run their CPUs (`decide_accel`: the
/// configured accelerator, no /dev/kvm, the KVM probe and its verdict cached for this boot).
fn accel_decision(lines: &[LogLine]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.message.contains("KVM") || l.message.contains("TCG"))
        .map(LogLine::text)
        .collect()
}

/// Says on stderr what the daemon logged, so a failing microVM section can be diagnosed after
/// the daemon and its temp dir are gone.
fn print_log_tail(daemon: &Daemon, what: &str) {
    let log = daemon.log();
    let lines: Vec<String> = log
        .lines()
        .map(|l| match LogLine::parse(l) {
            Some(parsed) => format!("{} {}", parsed.timestamp, parsed.text()),
            None => l.to_string(),
        })
        .collect();
    let tail = &lines[lines.len().saturating_sub(60)..];
    eprintln!(
        "bench: the last {} lines of the log of the {what} daemon:\n{}",
        tail.len(),
        tail.join("\n")
    );
}

/// Why a daemon left at `accel = "auto"` did not use KVM, in a few words from its log.
fn kvm_reason(lines: &[LogLine]) -> Option<String> {
    lines.iter().find_map(|l| {
        let field = |k: &str| l.field(k).unwrap_or_else(|| "?".into());
        if l.message.starts_with("KVM probe failed") {
            Some(format!(
                "the KVM probe boot failed ({}; deadline {} ms)",
                field("error"),
                field("timeout_ms")
            ))
        } else if l.message.starts_with("no usable /dev/kvm") {
            Some(format!("no usable /dev/kvm ({})", field("error")))
        } else if l
            .message
            .starts_with("microVM acceleration from this boot's KVM probe")
            && l.field("accel").as_deref() == Some("tcg")
        {
            Some(format!(
                "the KVM probe of this host boot failed (verdict cached in {})",
                field("cache")
            ))
        } else {
            None
        }
    })
}

/// The daemon's answer in an error (`CODE: message`), without the bench's context around it.
fn daemon_answer(e: &anyhow::Error) -> String {
    e.chain()
        .find_map(|c| c.downcast_ref::<agent_client::Error>())
        .map(|c| c.to_string())
        .unwrap_or_else(|| format!("{e:#}"))
}

/// Whether the daemon refused because this host cannot provide the tier (no QEMU, no VM
/// artifacts), as opposed to a tier that tried and failed.
fn is_failed_precondition(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<agent_client::Error>()
            .is_some_and(|e| e.code() == tonic::Code::FailedPrecondition)
    })
}

/// A microVM sandbox of image `minimal` with the default limits (those of the warm pool).
fn microvm_request() -> proto::CreateSandboxRequest {
    proto::CreateSandboxRequest {
        isolation: proto::Isolation::Microvm as i32,
        ..process_sandbox("minimal")
    }
}

/// Starts a daemon for the microVM tier: JSON log, with the tier's debug lines.
async fn start_microvm_daemon(toml: &str, extra_args: &[&str], what: &str) -> Result<Daemon> {
    // The harness gives the daemon `$SANDBOXD_TEST_LOG` as RUST_LOG when it spawns it. Set only
    // around that spawn, so the other sections' daemons log as before; the sections run one
    // after another, so nothing else reads the environment meanwhile.
    const VAR: &str = "SANDBOXD_TEST_LOG";
    let before = std::env::var(VAR).ok();
    let filter = format!(
        "{},{MICROVM_LOG_DIRECTIVE}",
        before.as_deref().unwrap_or("info")
    );
    std::env::set_var(VAR, filter);
    let mut args = vec!["--log-format", "json"];
    args.extend_from_slice(extra_args);
    let started = Daemon::start_with(toml, &args).await;
    match before {
        Some(v) => std::env::set_var(VAR, v),
        None => std::env::remove_var(VAR),
    }
    started.with_context(|| format!("starting sandboxd for the microVM tier ({what})"))
}

/// One `Exec` of `true` timed from `since` (the start of its `CreateSandbox`).
async fn first_exec(sb: &Sandboxes, id: &str, since: Instant, what: &str) -> Result<Duration> {
    check_interrupt()?;
    let result = sb
        .client
        .exec(exec_request(id, ["true"]))
        .await
        .with_context(|| format!("first Exec of `true` in {id} ({what})"))?;
    let took = since.elapsed();
    check_true(&result, what)?;
    Ok(took)
}

/// What the cold boots measured.
#[derive(Default)]
struct ColdBoots {
    boots: Vec<Duration>,
    creates: Vec<Duration>,
    destroys: Vec<Duration>,
    /// `boot_ms` and `guest_uptime_ms` of their `microVM booted` lines.
    logged: (Vec<Duration>, Vec<Duration>),
}

/// `n` cold boots on a daemon without a pool: `CreateSandbox` and the first `Exec` of `true`
/// timed as one (and the create alone), the destroy apart. Fails unless the daemon logged each
/// of them as booted under `accel`.
async fn cold_boots(
    daemon: &Daemon,
    sb: &mut Sandboxes,
    accel: VmAccel,
    n: usize,
) -> Result<ColdBoots> {
    let before = count_logged(&log_lines(&daemon.log()), LOG_BOOTED);
    let mut cold = ColdBoots::default();
    for i in 0..n {
        let what = format!("cold microVM boot {i} of {n} ({})", accel.name());
        let t = Instant::now();
        let (id, created) = sb.create_with(microvm_request(), &what).await?;
        let booted = first_exec(sb, &id, t, &what).await?;
        cold.destroys.push(sb.destroy(&id).await?);
        cold.boots.push(booted);
        cold.creates.push(created);
    }
    let lines = log_lines(&daemon.log());
    let booted: Vec<&LogLine> = lines
        .iter()
        .filter(|l| l.message == LOG_BOOTED)
        .skip(before)
        .collect();
    if booted.len() != n {
        bail!(
            "{n} cold boots under {} but {} `{LOG_BOOTED}` lines in the daemon's log",
            accel.name(),
            booted.len()
        );
    }
    for line in booted {
        if line.field("accel").as_deref() != Some(accel.config()) {
            bail!(
                "a cold boot meant to run under {} did not: {}",
                accel.name(),
                line.text()
            );
        }
        cold.logged.0.extend(line.millis("boot_ms"));
        cold.logged.1.extend(line.millis("guest_uptime_ms"));
    }
    Ok(cold)
}

fn record_cold_boots(report: &mut Report, accel: VmAccel, cold: ColdBoots) {
    report.measured(Key::MicroVmBoot(accel), &cold.boots);
    report.measured(Key::MicroVmCreate(accel), &cold.creates);
    report.microvm.boot_logged.insert(accel, cold.logged);
}

/// Unary and streamed execs of `true` in one microVM, after untimed ones.
async fn microvm_execs(sb: &mut Sandboxes, plan: &Plan) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let (id, _) = sb
        .create_with(microvm_request(), "the microVM of the exec rows")
        .await?;
    let warmup = plan.warmup * 3;
    let mut unary = Vec::with_capacity(plan.microvm_exec);
    for i in 0..warmup + plan.microvm_exec {
        let took = exec_true(&sb.client, &id, &format!("microVM exec {i}")).await?;
        if i >= warmup {
            unary.push(took);
        }
    }
    let mut streamed = Vec::with_capacity(plan.microvm_stream);
    for i in 0..warmup + plan.microvm_stream {
        let took = exec_stream_true(&sb.client, &id, &format!("microVM ExecStream {i}")).await?;
        if i >= warmup {
            streamed.push(took);
        }
    }
    sb.destroy(&id).await?;
    Ok((unary, streamed))
}

/// `n` forks of microVM snapshot `snap` (each destroyed before the next), after an untimed one
/// that checks the fork sees the origin's file.
async fn microvm_fork_rounds(
    sb: &mut Sandboxes,
    snap: &str,
    n: usize,
    what: &str,
) -> Result<Vec<Duration>> {
    let warmup = 1;
    let mut forks = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let request = proto::CreateSandboxRequest {
            from_snapshot_id: snap.to_string(),
            ..microvm_request()
        };
        let (id, took) = sb
            .create_with(request, &format!("microVM fork {i} of {snap}, {what}"))
            .await?;
        if i == 0 {
            let check = format!(
                "[ \"$(wc -c < /workspace/blob)\" -eq {} ]",
                u64::from(CHANGED_SMALL_MIB) << 20
            );
            sh(
                &sb.client,
                &id,
                &check,
                &format!("the first microVM fork, {what}"),
            )
            .await
            .context("a microVM fork does not see its snapshot's files")?;
        }
        sb.destroy(&id).await?;
        if i >= warmup {
            forks.push(took);
        }
    }
    Ok(forks)
}

/// Forks of one snapshot of a microVM with [`CHANGED_SMALL_MIB`] MiB written: first while the
/// origin still runs (how forks are used: the origin goes on), then once it is destroyed. The
/// second set is measured even when the first fails, so a failure there still leaves a time.
async fn microvm_forks(
    sb: &mut Sandboxes,
    n: usize,
) -> Result<(Result<Vec<Duration>>, Result<Vec<Duration>>)> {
    let (origin, _) = sb
        .create_with(microvm_request(), "the origin of the microVM forks")
        .await?;
    write_blob(
        &sb.client,
        &origin,
        CHANGED_SMALL_MIB,
        "the origin of the microVM forks",
    )
    .await?;
    let (snap, _, _) = sb.snapshot(&origin, "the microVM snapshot to fork").await?;
    let running = microvm_fork_rounds(sb, &snap, n, "origin running").await;
    // A fork that failed after its create is still alive: it goes, with the origin.
    for id in sb.live.clone() {
        sb.destroy(&id).await?;
    }
    let gone = microvm_fork_rounds(sb, &snap, n, "origin destroyed").await;
    for id in sb.live.clone() {
        sb.destroy(&id).await?;
    }
    sb.delete_snapshot(&snap).await?;
    Ok((running, gone))
}

/// Waits until the daemon has logged `count` VMs put in its warm pool.
async fn wait_for_pool(daemon: &Daemon, count: usize) -> Result<()> {
    let deadline = Instant::now() + POOL_FILL_TIMEOUT;
    loop {
        check_interrupt()?;
        let lines = log_lines(&daemon.log());
        if count_logged(&lines, LOG_POOL_READY) >= count {
            return Ok(());
        }
        let complaints = || {
            lines
                .iter()
                .filter(|l| l.level == "WARN" || l.level == "ERROR")
                .map(LogLine::text)
                .collect::<Vec<_>>()
                .join("; ")
        };
        if lines
            .iter()
            .any(|l| l.message.starts_with(LOG_POOL_GAVE_UP))
        {
            bail!("the warm pool gave up booting VMs: {}", complaints());
        }
        if Instant::now() > deadline {
            bail!(
                "the warm pool did not log its VM number {count} (`{LOG_POOL_READY}`) within {} s; warnings: {}",
                POOL_FILL_TIMEOUT.as_secs(),
                complaints()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates served by the warm pool of size 1: before each, wait for the pool to hold a VM again;
/// after it, check the daemon says this create took it. Returns the creates, the creates with
/// their first exec, and the boot times of the pool's VMs.
async fn microvm_pool_creates(
    daemon: &Daemon,
    sb: &mut Sandboxes,
    n: usize,
) -> Result<(Vec<Duration>, Vec<Duration>, Vec<Duration>)> {
    let warmup = 1;
    let (mut creates, mut readies) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..warmup + n {
        wait_for_pool(daemon, i + 1).await?;
        let what = format!("microVM create {i} from the warm pool");
        let t = Instant::now();
        let (id, created) = sb.create_with(microvm_request(), &what).await?;
        let ready = first_exec(sb, &id, t, &what).await?;
        let taken = log_lines(&daemon.log()).iter().any(|l| {
            l.message == LOG_POOL_TAKEN && l.field("sandbox").as_deref() == Some(id.as_str())
        });
        if !taken {
            bail!(
                "{what}: the pool held a booted VM, yet the daemon did not log `{LOG_POOL_TAKEN}` for \
                 sandbox {id} (it booted one of its own: not a create from the pool)"
            );
        }
        sb.destroy(&id).await?;
        if i >= warmup {
            creates.push(created);
            readies.push(ready);
        }
    }
    let pool_boots = log_lines(&daemon.log())
        .iter()
        .filter(|l| l.message == LOG_POOL_READY)
        .filter_map(|l| l.millis("boot_ms"))
        .collect();
    Ok((creates, readies, pool_boots))
}

/// The rows of the daemon left at `accel = "auto"`: cold boots, execs, snapshot+rollback and
/// forks. Returns the accelerator it chose, or `None` when this host cannot run the tier.
async fn microvm_auto(plan: &Plan, report: &mut Report) -> Result<Option<VmAccel>> {
    let daemon = start_microvm_daemon("", &[], "accel = \"auto\"").await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!("bench: sandboxd microVM tier: a first, untimed boot (may probe KVM)");
    let t = Instant::now();
    let first = match sb
        .create_with(microvm_request(), "microVM tier, first create")
        .await
    {
        Ok((id, _)) => first_exec(&sb, &id, t, "microVM tier, first boot")
            .await
            .map(|took| (id, took)),
        Err(e) => Err(e),
    };
    let lines = log_lines(&daemon.log());
    report.microvm.accel_log = accel_decision(&lines);
    report.microvm.kvm_reason = kvm_reason(&lines);
    let (id, took) = match first {
        Ok(x) => x,
        Err(e) if is_failed_precondition(&e) => {
            let why = format!("CreateSandbox with ISOLATION_MICROVM: {e:#}");
            let line = format!(
                "!!!!! SANDBOXD MICROVM TIER UNAVAILABLE: {why} — its rows say \"unavailable\" !!!!!"
            );
            eprintln!("{line}");
            println!("{line}");
            report.unavailable(&Key::MICROVM, &why);
            report.microvm.unavailable = Some(why);
            sb.cleanup().await;
            return Ok(None);
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            sb.cleanup().await;
            return Err(e.context("the first microVM create and exec"));
        }
    };
    let accel = lines
        .iter()
        .find(|l| l.message == LOG_BOOTED)
        .and_then(|l| l.field("accel"))
        .and_then(|a| VmAccel::from_log(&a));
    let Some(accel) = accel else {
        sb.cleanup().await;
        bail!("the daemon booted a microVM but logged no `{LOG_BOOTED}` line with accel=tcg or accel=kvm");
    };
    report.microvm.auto_accel = Some(accel);
    eprintln!(
        "bench: the first microVM booted under {} to first exec in {:.2} s (the daemon said: {})",
        accel.name(),
        took.as_secs_f64(),
        report.microvm.accel_log.join("; ")
    );
    sb.destroy(&id).await?;

    eprintln!(
        "bench: sandboxd microVM cold boots ({}) × {}",
        accel.name(),
        plan.microvm_boot
    );
    match cold_boots(&daemon, &mut sb, accel, plan.microvm_boot).await {
        Ok(cold) => {
            report.measured(Key::MicroVmDestroy, &cold.destroys);
            record_cold_boots(report, accel, cold);
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            let keys = [
                Key::MicroVmBoot(accel),
                Key::MicroVmCreate(accel),
                Key::MicroVmDestroy,
            ];
            report.failed(&keys, &e);
        }
    }
    sb.cleanup().await;

    eprintln!(
        "bench: sandboxd microVM Exec × {}, ExecStream × {}",
        plan.microvm_exec, plan.microvm_stream
    );
    match microvm_execs(&mut sb, plan).await {
        Ok((unary, streamed)) => {
            report.measured(Key::MicroVmExec, &unary);
            report.measured(Key::MicroVmExecStream, &streamed);
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            report.failed(&[Key::MicroVmExec, Key::MicroVmExecStream], &e);
        }
    }
    sb.cleanup().await;

    eprintln!(
        "bench: sandboxd microVM snapshot+rollback, {CHANGED_SMALL_MIB} MiB changed × {}",
        plan.microvm_snap
    );
    match snapshot_rollback(
        &mut sb,
        microvm_request(),
        CHANGED_SMALL_MIB,
        plan.microvm_snap,
    )
    .await
    {
        Ok((snaps, rollbacks, sizes)) => {
            report.measured(Key::MicroVmSnapshot, &snaps);
            report.measured(Key::MicroVmRollback, &rollbacks);
            report.microvm.snapshot_size = median(&sizes);
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            report.failed(&[Key::MicroVmSnapshot, Key::MicroVmRollback], &e);
        }
    }
    sb.cleanup().await;

    eprintln!(
        "bench: sandboxd microVM forks × {}, origin running then destroyed",
        plan.microvm_fork
    );
    let fork_keys = [Key::MicroVmFork, Key::MicroVmForkOriginGone];
    match microvm_forks(&mut sb, plan.microvm_fork).await {
        Ok((running, gone)) => {
            for (key, result) in fork_keys.into_iter().zip([running, gone]) {
                match result {
                    Ok(forks) => report.measured(key, &forks),
                    Err(e) => {
                        print_log_tail(&daemon, "microVM (auto)");
                        report.failed(&[key], &e);
                    }
                }
            }
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            report.failed(&fork_keys, &e);
        }
    }
    sb.cleanup().await;
    Ok(Some(accel))
}

/// Cold boots under the accelerator the `auto` daemon did not choose, on a daemon configured
/// for it. KVM that cannot boot a guest on this host is no failure of the bench: its rows say
/// why, with the `auto` daemon's reason and what the forced create answered.
async fn microvm_other_accel(plan: &Plan, report: &mut Report, accel: VmAccel) -> Result<()> {
    let toml = match accel {
        VmAccel::Kvm => {
            format!("[microvm]\naccel = \"kvm\"\nboot_timeout_ms = {KVM_TRY_BOOT_TIMEOUT_MS}\n")
        }
        VmAccel::Tcg => "[microvm]\naccel = \"tcg\"\n".to_string(),
    };
    let what = format!("accel = \"{}\"", accel.config());
    let daemon = start_microvm_daemon(&toml, &[], &what).await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!(
        "bench: sandboxd microVM tier under {}: a first, untimed boot",
        accel.name()
    );
    let t = Instant::now();
    let first = match sb
        .create_with(
            microvm_request(),
            &format!("first microVM create with {what}"),
        )
        .await
    {
        Ok((id, _)) => first_exec(&sb, &id, t, &format!("first microVM boot with {what}"))
            .await
            .map(|_| id),
        Err(e) => Err(e),
    };
    let result = match first {
        Ok(id) => {
            sb.destroy(&id).await?;
            eprintln!(
                "bench: sandboxd microVM cold boots ({}) × {}",
                accel.name(),
                plan.microvm_boot
            );
            match cold_boots(&daemon, &mut sb, accel, plan.microvm_boot).await {
                Ok(cold) => {
                    record_cold_boots(report, accel, cold);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        Err(e) if accel == VmAccel::Kvm => {
            let reason = report
                .microvm
                .kvm_reason
                .clone()
                .unwrap_or_else(|| "the daemon left at accel = \"auto\" chose TCG".to_string());
            let why =
                format!("KVM unusable on this host: {reason}; a boot forced to KVM failed too");
            let forced = format!(
                "a daemon with {what} and boot_timeout_ms = {KVM_TRY_BOOT_TIMEOUT_MS} failed its \
                 first create after {:.1} s: {}",
                t.elapsed().as_secs_f64(),
                daemon_answer(&e)
            );
            eprintln!("bench: {why}: {forced}");
            report.unavailable(&[Key::MicroVmBoot(accel), Key::MicroVmCreate(accel)], &why);
            report.microvm.kvm_forced = Some(forced);
            Ok(())
        }
        Err(e) => Err(e),
    };
    if result.is_err() {
        print_log_tail(&daemon, &format!("microVM ({what})"));
    }
    sb.cleanup().await;
    result
}

/// Creates from the warm pool, on a daemon started with `--microvm-pool 1`.
async fn microvm_pool(plan: &Plan, report: &mut Report) -> Result<()> {
    let daemon = start_microvm_daemon("", &["--microvm-pool", "1"], "--microvm-pool 1").await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!(
        "bench: sandboxd microVM creates from the warm pool × {}",
        plan.microvm_pool
    );
    let result = microvm_pool_creates(&daemon, &mut sb, plan.microvm_pool).await;
    sb.cleanup().await;
    match result {
        Ok((creates, readies, pool_boots)) => {
            report.measured(Key::MicroVmPoolCreate, &creates);
            report.measured(Key::MicroVmPoolReady, &readies);
            report.microvm.pool_boot_logged = pool_boots;
            Ok(())
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (--microvm-pool 1)");
            Err(e)
        }
    }
}

/// The microVM tier (`ISOLATION_MICROVM`) on daemons of its own: cold boots, execs, snapshots
/// and forks on one left at `accel = "auto"`; cold boots under the other accelerator on one
/// configured for it; creates from the warm pool on one started with `--microvm-pool 1`. A tier
/// this host cannot provide (FAILED_PRECONDITION: no QEMU, no VM artifacts) marks the rows
/// unavailable, loudly; a tier that tries and fails is a failure like any other sandboxd section.
async fn sandboxd_microvm(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let fail_missing = |report: &mut Report, e: anyhow::Error| {
        let missing: Vec<Key> = Key::MICROVM
            .into_iter()
            .filter(|k| !report.rows.contains_key(k))
            .collect();
        report.failed(&missing, &e);
    };
    match microvm_auto(plan, report).await {
        Ok(Some(accel)) => {
            if let Err(e) = microvm_other_accel(plan, report, accel.other()).await {
                let keys = [
                    Key::MicroVmBoot(accel.other()),
                    Key::MicroVmCreate(accel.other()),
                ];
                report.failed(&keys, &e);
            }
            if let Err(e) = microvm_pool(plan, report).await {
                report.failed(&[Key::MicroVmPoolCreate, Key::MicroVmPoolReady], &e);
            }
        }
        Ok(None) => {}
        Err(e) => fail_missing(report, e),
    }
    report
        .section_times
        .push(("sandboxd microVM tier".into(), started.elapsed()));
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

/// The heading this bench leaves to another one, in a file it rewrites.
const AGENT_LOOP_HEADING: &str = "## Agent loop";

/// The `## Agent loop` section of an earlier BENCHMARKS.md, verbatim: from its heading to the
/// next level-2 heading or the end of the file.
fn agent_loop_section(text: &str) -> Option<&str> {
    let mut offset = 0;
    let mut start = None;
    for line in text.split_inclusive('\n') {
        let heading = line.trim_end();
        match start {
            None if heading == AGENT_LOOP_HEADING
                || heading.starts_with(&format!("{AGENT_LOOP_HEADING} ")) =>
            {
                start = Some(offset);
            }
            Some(s) if heading.starts_with("## ") => return Some(&text[s..offset]),
            _ => {}
        }
        offset += line.len();
    }
    start.map(|s| &text[s..])
}

/// A kept section as the end of the file: one blank line before it, one newline after.
fn section_tail(section: &str) -> String {
    format!("\n{}\n", section.trim_end())
}

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
    sandboxd_snapshots(&plan, &mut report).await;
    if args.no_docker {
        let why = "left out with --no-docker";
        report.docker_unavailable = Some(why.into());
        report.unavailable(&Key::DOCKER, why);
        report.container_unavailable = Some(why.into());
        report.unavailable(&Key::CONTAINER, why);
    } else {
        sandboxd_container(&plan, &mut report).await;
        docker_baseline(&plan, &mut report).await;
    }
    // Last: its VMs are CPU-heavy under TCG and the pool boots in the background, so nothing
    // else is measured beside them.
    if args.no_microvm {
        let why = "left out with --no-microvm";
        report.microvm.unavailable = Some(why.into());
        report.unavailable(&Key::MICROVM, why);
    } else {
        sandboxd_microvm(&plan, &mut report).await;
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
        // The agent-loop bench appends its own section to the same file: keep it.
        let kept = std::fs::read_to_string(out)
            .ok()
            .and_then(|old| agent_loop_section(&old).map(str::to_string));
        let text = match kept {
            Some(section) => format!("{}\n{}", md.trim_end(), section_tail(&section)),
            None => md,
        };
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
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
    fn snapshot_and_fork_targets() {
        let mut report = Report::default();
        let ms = |v: u64| [Duration::from_millis(v)];
        report.measured(Key::Create, &ms(10));
        report.measured(Key::Fork, &ms(25));
        report.measured(Key::Snapshot(Image::Minimal, CHANGED_SMALL_MIB), &ms(5));
        report.measured(Key::Snapshot(Image::Debian, CHANGED_SMALL_MIB), &ms(9));
        report.measured(Key::Rollback(Image::Minimal, CHANGED_SMALL_MIB), &ms(31));
        report.measured(Key::Rollback(Image::Debian, CHANGED_SMALL_MIB), &ms(70));
        let t = targets(&report);
        let find = |start: &str| {
            t.iter()
                .find(|(target, _, _)| target.starts_with(start))
                .unwrap_or_else(|| panic!("no target starting {start:?} in {t:?}"))
                .clone()
        };
        assert_eq!(find("`Snapshot` p50").2, "PASS");
        assert_eq!(find("`Rollback` p50").2, "**MISS**");
        let large = find("`Snapshot` over the 100×");
        assert_eq!(large.2, "PASS", "9 ms is 1.8× of 5 ms: {large:?}");
        assert!(large.1.contains("1.80×"), "{large:?}");
        assert_eq!(find("`Rollback` over the 100×").2, "**MISS**");
        let fork = find("fork p50");
        assert_eq!(fork.2, "**MISS**", "25 ms > 10 + 10 ms: {fork:?}");
        assert!(fork.1.ends_with(": +15.0 ms"), "{fork:?}");
        assert_eq!(signed_ms(-2.5), "-2.50");
        // Container rows not measured say so rather than pass or miss.
        assert_eq!(find("container tier `Rollback`").2, "not measured");
    }

    #[test]
    fn microvm_targets_pass_miss_and_say_why_kvm_is_missing() {
        let mut report = Report::default();
        let ms = |v: u64| [Duration::from_millis(v)];
        report.measured(Key::MicroVmBoot(VmAccel::Tcg), &ms(2400));
        report.measured(Key::MicroVmCreate(VmAccel::Tcg), &ms(2300));
        report.measured(Key::MicroVmExec, &ms(25));
        report.measured(Key::MicroVmPoolCreate, &ms(40));
        report.measured(Key::DockerCreateStart, &ms(300));
        report.unavailable(
            &[Key::MicroVmBoot(VmAccel::Kvm)],
            "KVM unusable on this host: KVM probe failed",
        );
        let t = targets(&report);
        let find = |start: &str| {
            t.iter()
                .find(|(target, _, _)| target.starts_with(start))
                .unwrap_or_else(|| panic!("no target starting {start:?} in {t:?}"))
                .clone()
        };
        let tcg = find("microVM boot to first exec under TCG");
        assert_eq!(tcg.2, "PASS", "{tcg:?}");
        assert!(
            tcg.1.contains("Docker create+start p50 300.0 ms"),
            "{tcg:?}"
        );
        let kvm = find("microVM boot to first exec under KVM");
        assert_eq!(kvm.2, "not measured (no usable KVM)", "{kvm:?}");
        assert!(kvm.1.starts_with("KVM unusable on this host"), "{kvm:?}");
        assert_eq!(find("microVM exec round trip").2, "**MISS**");
        assert_eq!(find("microVM `CreateSandbox` from the warm pool").2, "PASS");
    }

    #[test]
    fn json_log_lines_give_message_fields_and_accel() {
        let log = concat!(
            "not json: a panic message\n",
            r#"{"timestamp":"t","level":"WARN","fields":{"message":"KVM probe failed (nested guests may hang here): falling back to TCG (software emulation)","error":"boot timed out","timeout_ms":5000},"target":"sandboxd::backend::microvm"}"#,
            "\n",
            r#"{"timestamp":"t","level":"DEBUG","fields":{"message":"microVM booted","vm":"vm-1","accel":"tcg","boot_ms":1834,"guest_uptime_ms":1200},"target":"sandboxd::backend::microvm"}"#,
            "\n",
            r#"{"timestamp":"t","level":"INFO","fields":{"message":"microVM taken from the warm pool","sandbox":"sb-1"},"target":"sandboxd::backend::microvm"}"#,
        );
        let lines = log_lines(log);
        assert_eq!(lines.len(), 3);
        assert_eq!(count_logged(&lines, LOG_BOOTED), 1);
        assert_eq!(lines[1].field("accel").as_deref(), Some("tcg"));
        assert_eq!(
            lines[1].millis("boot_ms"),
            Some(Duration::from_millis(1834))
        );
        assert_eq!(lines[2].field("sandbox").as_deref(), Some("sb-1"));
        let decision = accel_decision(&lines);
        assert_eq!(decision.len(), 1, "{decision:?}");
        assert!(
            decision[0].starts_with("WARN KVM probe failed")
                && decision[0].contains("error=boot timed out"),
            "{decision:?}"
        );
    }

    #[test]
    fn agent_loop_section_is_kept_verbatim() {
        let old = "# sandboxd benchmarks\n\n## Latency\n\nrows\n\n## Agent loop\n\n| a | b |\n### sub\nmore\n";
        assert_eq!(
            agent_loop_section(old),
            Some("## Agent loop\n\n| a | b |\n### sub\nmore\n")
        );
        let middle = "# x\n## Agent loop\nloop rows\n\n## How measured\ntext\n";
        assert_eq!(
            agent_loop_section(middle),
            Some("## Agent loop\nloop rows\n\n")
        );
        assert_eq!(
            agent_loop_section("# x\n## Latency\n## Agent loops\n"),
            None
        );
        assert_eq!(
            section_tail("## Agent loop\nrows\n\n"),
            "\n## Agent loop\nrows\n"
        );
    }

    #[test]
    fn median_of_sizes() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3, 1, 2]), Some(2));
        assert_eq!(median(&[4, 1, 3, 2]), Some(2));
    }

    #[test]
    fn cells_stay_on_one_line() {
        assert_eq!(cell("a |b\nc"), "a \\|b c");
        assert_eq!(cell("line one\nline two"), "line one line two");
    }
}
