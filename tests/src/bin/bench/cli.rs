//! The command line, and the plan it makes: how many samples each section takes.

use crate::targets::TARGET_LIVE;
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(about = "Latency and density of sandboxd, with Docker measured in the same run")]
pub(crate) struct Args {
    /// Also write the report (markdown) to this file, e.g. BENCHMARKS.md.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Samples in every latency section. Default: each section's own (100 creates, 1,000
    /// GetSandbox calls and execs back to back, 100 GetSandbox calls and 100 execs 100 ms apart, 200 streamed execs,
    /// 20 snapshot+rollbacks with 1 MiB changed and 10 with 100 MiB, 30 forks, 5 batches of 10
    /// forks, 20 container-tier creates, 100 container-tier execs, 10 container-tier
    /// snapshot+rollbacks, 30 docker runs and create+starts, 200 docker execs, 5 cold microVM
    /// boots per accelerator, 3 microVM creates from the warm pool, 50 microVM execs and 20
    /// streamed, 5 microVM snapshot+rollbacks, 3 microVM forks without memory and 10 of a memory snapshot). The exec throughput section
    /// keeps its own counts.
    #[arg(long)]
    iterations: Option<usize>,
    /// Sandboxes kept alive at once in the density section (default 100; 10 with --quick).
    #[arg(long)]
    pub(crate) live: Option<usize>,
    /// Smoke mode: a few samples per section, done in seconds. Not numbers to compare.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Leave out everything that needs Docker: the baseline and sandboxd's container tier.
    #[arg(long)]
    pub(crate) no_docker: bool,
    /// Leave out sandboxd's microVM tier (its boots take seconds each under TCG).
    #[arg(long)]
    pub(crate) no_microvm: bool,
    /// Only sandboxd's container tier and the Docker baseline it is compared with (no process
    /// tier sections, no microVM tier): for work on the container tier. Not a report to keep.
    #[arg(long)]
    pub(crate) container_only: bool,
    /// Only sandboxd's microVM tier (no process or container tier, no Docker): for work on
    /// the microVM tier. Not a report to keep.
    #[arg(long, conflicts_with = "container_only")]
    pub(crate) microvm_only: bool,
    /// Only one process-tier section: `latency` (create, get, exec, streamed exec; half a
    /// minute) or `density` (`--live` sandboxes at once): for A/B work on those paths. Not a
    /// report to keep.
    #[arg(long, value_enum, conflicts_with_all = ["container_only", "microvm_only"])]
    pub(crate) only: Option<Section>,
}

/// A section `--only` runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Section {
    Latency,
    Density,
}

/// How many samples each section takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) quick: bool,
    pub(crate) create: usize,
    pub(crate) exec: usize,
    pub(crate) stream: usize,
    pub(crate) spaced: usize,
    pub(crate) live: usize,
    /// Snapshot+rollback samples with [`CHANGED_SMALL_MIB`] and [`CHANGED_LARGE_MIB`] written.
    pub(crate) snap_small: usize,
    pub(crate) snap_large: usize,
    /// Single forks, and batches of [`FORK_BATCH`] forks.
    pub(crate) fork: usize,
    pub(crate) fork_batches: usize,
    /// (concurrency, execs) of each level of the exec throughput section.
    pub(crate) throughput: [(usize, usize); 3],
    pub(crate) container_create: usize,
    pub(crate) container_exec: usize,
    pub(crate) container_snap: usize,
    pub(crate) docker_run: usize,
    pub(crate) docker_create: usize,
    pub(crate) docker_exec: usize,
    /// Cold microVM boots (per accelerator measured), creates from the warm pool, execs and
    /// streamed execs in one microVM, snapshot+rollbacks and forks.
    pub(crate) microvm_boot: usize,
    pub(crate) microvm_pool: usize,
    pub(crate) microvm_exec: usize,
    pub(crate) microvm_stream: usize,
    pub(crate) microvm_snap: usize,
    pub(crate) microvm_fork: usize,
    /// Forks of one memory snapshot (each resumes; the "10 forks of one snapshot").
    pub(crate) microvm_fork_memory: usize,
    /// Untimed calls before each section, so one-off costs (page faults, first connection,
    /// lazily built state) do not land in the first sample.
    pub(crate) warmup: usize,
}

impl Plan {
    pub(crate) fn new(args: &Args) -> Self {
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
                microvm_fork_memory: 2,
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
                microvm_fork_memory: 10,
                warmup: 3,
            }
        };
        if let Some(n) = args.iterations {
            let n = n.max(1);
            (p.create, p.exec, p.stream, p.spaced, p.docker_run, p.docker_create, p.docker_exec) = (n, n, n, n, n, n, n);
            (p.snap_small, p.snap_large, p.fork, p.fork_batches, p.container_create, p.container_exec, p.container_snap) = (n, n, n, n, n, n, n);
            (p.microvm_boot, p.microvm_pool, p.microvm_exec, p.microvm_stream, p.microvm_snap, p.microvm_fork, p.microvm_fork_memory) = (n, n, n, n, n, n, n);
        }
        if let Some(n) = args.live {
            p.live = n.max(1);
        }
        p
    }
}
