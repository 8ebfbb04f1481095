//! `bench`: latency, snapshots, forks, exec throughput and density of `sandboxd`, with Docker
//! measured in the same run.
//!
//! Starts the real daemon (`SANDBOXD_BIN`) through the test harness, drives it with the real
//! client over its UNIX socket, measures the Docker Engine API the same way (one API client, one
//! call after another), prints a markdown report and, with `--out`, writes it to a file.
//! `make bench` runs it as `target/release/bench --out BENCHMARKS.md`. The sections other benches
//! wrote into that file (agent loop, images, transfers, restart, E2B, egress, fleet) are carried
//! over to the end of the new one.
//!
//! Every sandbox, snapshot and container it makes is removed again, also when a section fails or
//! the run is interrupted with Ctrl-C. Docker missing is not a failure (its rows, and those of
//! sandboxd's container tier, say "unavailable"), nor is a host that cannot run microVMs, or KVM
//! that does not work (the microVM rows say why); a sandboxd section that fails is, and the exit
//! code says so. Targets that are missed are reported as MISS but do not change the exit code:
//! this is a measurement, not a gate.
//!
//! The modules, in the order a run goes: [`cli`] (flags, and the [`cli::Plan`] of how many
//! samples each section takes); the measured areas, each on a daemon of its own — [`latency`]
//! (process tier: create, destroy, GetSandbox, execs), [`density`] (live sandboxes, RSS),
//! [`snapshots`] (snapshot, rollback, forks; [`throughput`] runs on the same daemon),
//! [`container`] (container tier), [`docker`] (the Docker Engine baseline), [`microvm`]
//! (microVM tier, read partly from the daemon's log: [`microvm::log`]) — all driving the daemon
//! through [`sandboxes`]; then [`results`] (what a run measured, by row), [`stats`]
//! (percentiles, number formats), [`targets`] (the issues' targets), [`machine`] (the host) and
//! [`report`] (the markdown, and BENCHMARKS.md).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

mod cli;
mod container;
mod density;
mod docker;
mod latency;
mod machine;
mod microvm;
mod report;
mod results;
mod sandboxes;
mod snapshots;
mod stats;
mod targets;
mod throughput;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use clap::Parser;
use sandbox_tests::images_dir;

use crate::cli::{Args, Plan, Section};
use crate::machine::{loadavg, Machine};
use crate::results::{Key, Report};

/// Set by Ctrl-C; every measuring loop checks it so the normal error path cleans up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Fails once Ctrl-C was pressed.
fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted (Ctrl-C)");
    }
    Ok(())
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
    eprintln!("bench: sandboxd = {}, images = {}, {}", machine.sandboxd_bin, images_dir().display(), if plan.quick { "quick mode" } else { "full run" });

    let mut report = Report::default();
    if let Some(only) = args.only {
        match only {
            Section::Latency => latency::sandboxd_latency(&plan, &mut report).await,
            Section::Density => density::sandboxd_density(&plan, &mut report).await,
        }
        println!("{}", report::render(&report, &plan, &machine, started.elapsed()));
        return Ok(!report.any_failed());
    }
    if !args.container_only && !args.microvm_only {
        latency::sandboxd_latency(&plan, &mut report).await;
        density::sandboxd_density(&plan, &mut report).await;
        snapshots::sandboxd_snapshots(&plan, &mut report).await;
        snapshots::sandboxd_without_userns(&plan, &mut report).await;
    }
    if args.no_docker || args.microvm_only {
        let why = if args.microvm_only { "left out with --microvm-only" } else { "left out with --no-docker" };
        report.docker_unavailable = Some(why.into());
        report.unavailable(&Key::DOCKER, why);
        report.container_unavailable = Some(why.into());
        report.unavailable(&Key::CONTAINER, why);
    } else {
        container::sandboxd_container(&plan, &mut report).await;
        docker::docker_baseline(&plan, &mut report).await;
    }
    // Last: its VMs are CPU-heavy under TCG and the pool boots in the background, so nothing
    // else is measured beside them.
    if args.no_microvm || args.container_only {
        let why = if args.container_only { "left out with --container-only" } else { "left out with --no-microvm" };
        report.microvm.unavailable = Some(why.into());
        report.unavailable(&Key::MICROVM, why);
    } else {
        microvm::sandboxd_microvm(&plan, &mut report).await;
    }
    if let Some(took) = report.docker_import {
        report.section_times.push(("(of which Docker image import)".into(), took));
    }
    machine.load_end = loadavg();

    let md = report::render(&report, &plan, &machine, started.elapsed());
    println!("{md}");
    if let Some(out) = &args.out {
        report::write(out, md)?;
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
