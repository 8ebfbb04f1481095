//! `restart_bench`: how long a daemon killed with SIGKILL takes to serve again with N live
//! process-tier sandboxes on record, at 100 and 1,000 sandboxes (`--sizes`).
//!
//! For each size: a fresh daemon is filled with N sandboxes (each with a file written in it),
//! killed with SIGKILL and started again over the same state dir. Measured from the new process's
//! start: **serving** (the first ListSandboxes answered), **first exec** (an exec in a sandbox
//! picked at random from the N, answered: it is re-adopted for that call), and **all back**
//! (health's `sandboxd.recovery` SERVING: every sandbox re-adopted). Each restart is repeated
//! `--rounds` times on the same daemon. `make bench` runs it after the other benches and writes
//! the `## Restart` section of BENCHMARKS.md (`--out FILE`).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agent_client::proto::{CreateSandboxRequest, ResourceLimits};
use agent_client::{exec_request, Client};
use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use sandbox_tests::{process_sandbox, replace_section, Daemon};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

#[derive(Parser)]
#[command(about = "Restart to serving with live sandboxes on record")]
struct Args {
    /// Numbers of live sandboxes to measure a restart with.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    sizes: Vec<usize>,
    /// Restarts per size.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Markdown file whose `## Restart` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Creates at once while filling.
const CREATE_PARALLEL: usize = 8;

struct Round {
    serving: Duration,
    first_exec: Duration,
    all_back: Duration,
}

async fn recovered(client: &Client) -> bool {
    let mut health = HealthClient::new(client.channel());
    health.check(HealthCheckRequest { service: "sandboxd.recovery".into() }).await.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
}

async fn fill(client: &Client, n: usize) -> Result<Vec<String>> {
    use futures::StreamExt;
    let creates = futures::stream::iter(0..n)
        .map(|i| async move {
            // Small disks: a thousand of them fit any pool the harness gives.
            let request = CreateSandboxRequest { limits: Some(ResourceLimits { disk_bytes: 64 << 20, ..Default::default() }), ..process_sandbox("minimal") };
            let sb = client.create(request).await.with_context(|| format!("creating sandbox {} of {n}", i + 1))?;
            client.write_file(&sb.id, "/workspace/n", i.to_string().into_bytes(), 0).await.context("WriteFile")?;
            Ok::<_, anyhow::Error>(sb.id)
        })
        .buffer_unordered(CREATE_PARALLEL)
        .collect::<Vec<_>>()
        .await;
    creates.into_iter().collect()
}

/// A cheap pseudo-random index (no RNG dependency for one pick per round).
fn pick(n: usize, round: usize) -> usize {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos() as usize).unwrap_or(0);
    (nanos ^ round.wrapping_mul(0x9E37_79B9)) % n
}

async fn restart_once(daemon: &mut Daemon, ids: &[String], round: usize) -> Result<Round> {
    // The old process is gone (reaped) before the clock starts: a killed daemon with 1,000
    // sandboxes takes a while to die (its descriptors and mappings), which is the kernel's time,
    // not the new daemon's.
    daemon.kill9();
    let t = Instant::now();
    daemon.restart().await.context("restarting")?;
    let serving = t.elapsed();
    let client = daemon.client().await?;
    let id = &ids[pick(ids.len(), round)];
    let r = client.exec(exec_request(id, ["cat", "/workspace/n"])).await.context("the first exec after the restart")?;
    let first_exec = t.elapsed();
    ensure!(r.exit_code == 0, "exec in {id} after the restart: {r:?}");
    let deadline = Instant::now() + Duration::from_secs(600);
    while !recovered(&client).await {
        if Instant::now() > deadline {
            bail!("not every sandbox back 600 s after the restart");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(Round { serving, first_exec, all_back: t.elapsed() })
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn measure(n: usize, rounds: usize) -> Result<String> {
    let mut daemon = Daemon::start().await?;
    let client = daemon.client().await?;
    eprintln!("restart_bench: filling a daemon with {n} sandboxes");
    let t = Instant::now();
    let ids = fill(&client, n).await?;
    let fill_took = t.elapsed();
    let mut results = Vec::new();
    for round in 0..rounds {
        eprintln!("restart_bench: {n} sandboxes, restart {} of {rounds}", round + 1);
        results.push(restart_once(&mut daemon, &ids, round).await?);
    }
    let worst = |f: fn(&Round) -> Duration| results.iter().map(f).max().unwrap_or_default();
    let row = format!(
        "| {n} | {} (max {}) | {} (max {}) | {} (max {}) | {} |",
        ms(median(results.iter().map(|r| r.serving).collect())),
        ms(worst(|r| r.serving)),
        ms(median(results.iter().map(|r| r.first_exec).collect())),
        ms(worst(|r| r.first_exec)),
        ms(median(results.iter().map(|r| r.all_back).collect())),
        ms(worst(|r| r.all_back)),
        ms(fill_took),
    );
    // Destroying the sandboxes is the harness's: a dropped daemon stops and its temp dir goes.
    Ok(row)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let mut rows = Vec::new();
    for &n in &args.sizes {
        rows.push(measure(n, args.rounds).await?);
    }
    let section = format!(
        "## Restart\n\n\
         `restart_bench`: a daemon with N live process-tier sandboxes is killed with SIGKILL and started again over the same state \
         (median of {} restarts, max in brackets). *Serving*: the first ListSandboxes answered; *first exec*: an exec in a sandbox \
         picked at random, answered (it is re-adopted for that call); *all back*: health's `sandboxd.recovery` SERVING. \
         Docker has no counterpart in this run (its containers outlive dockerd with live-restore).\n\n\
         | sandboxes | serving | first exec | all back | filling (create + write) |\n|---|---|---|---|---|\n{}\n",
        args.rounds,
        rows.join("\n")
    );
    println!("{section}");
    if let Some(out) = &args.out {
        replace_section(out, "## Restart", &section)?;
    }
    Ok(())
}
