//! Snapshot and rollback over two images and two sizes of change, and forks, on a daemon of
//! their own (which then runs the [`crate::throughput`] section too).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sandbox_tests::{process_sandbox, proto, Daemon};

use crate::cli::Plan;
use crate::results::{Image, Key, Report};
use crate::sandboxes::{sh, write_blob, Sandboxes};
use crate::stats::median;
use crate::throughput::throughput;

/// MiB written since the image before each snapshot: a small change and a large one.
pub(crate) const CHANGED_SMALL_MIB: u32 = 1;
pub(crate) const CHANGED_LARGE_MIB: u32 = 100;
/// Forks taken of one snapshot in a row, timed together.
pub(crate) const FORK_BATCH: usize = 10;

/// Snapshot and rollback samples in one new sandbox made by `request`, each over `mib` MiB
/// freshly written since the image; returns the snapshot times, the rollback times and the
/// snapshots' reported sizes. One untimed round first.
pub(crate) async fn snapshot_rollback(
    sb: &mut Sandboxes,
    request: proto::CreateSandboxRequest,
    mib: u32,
    n: usize,
    include_memory: Option<bool>,
) -> Result<(Vec<Duration>, Vec<Duration>, Vec<u64>)> {
    let section = format!("snapshot+rollback, {mib} MiB changed, image {}", request.image);
    let (id, _) = sb.create_with(request, &format!("the sandbox of the {section} section")).await?;
    let bytes = u64::from(mib) << 20;
    // After the rollback the blob must be back whole and the file written after the snapshot gone.
    let check = format!("[ \"$(wc -c < /workspace/blob)\" -eq {bytes} ] && [ ! -e /workspace/after-snapshot ]");
    let warmup = 1;
    let (mut snaps, mut rollbacks, mut sizes) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..warmup + n {
        let what = format!("{section}, sample {i}");
        write_blob(&sb.client, &id, mib, &what).await?;
        let (snap, size, took_snap) = sb.snapshot_with(&id, &what, include_memory).await?;
        sh(&sb.client, &id, "rm /workspace/blob && echo changed > /workspace/after-snapshot", &what).await?;
        let took_rollback = sb.rollback(&id, &snap, &what).await?;
        sh(&sb.client, &id, &check, &format!("{what}, after the rollback"))
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
    write_blob(&sb.client, &origin, CHANGED_SMALL_MIB, "the origin of the forks").await?;
    let (snap, _, _) = sb.snapshot(&origin, "the snapshot to fork").await?;
    let fork_request = || proto::CreateSandboxRequest { from_snapshot_id: snap.clone(), ..process_sandbox("minimal") };
    let mut forks = Forks { creates: Vec::with_capacity(plan.fork), destroys: Vec::with_capacity(plan.fork), batches: Vec::with_capacity(plan.fork_batches) };
    for i in 0..plan.warmup + plan.fork {
        let (id, took) = sb.create_with(fork_request(), &format!("fork {i} of {snap}")).await?;
        if i == 0 {
            let check = format!("[ \"$(wc -c < /workspace/blob)\" -eq {} ]", u64::from(CHANGED_SMALL_MIB) << 20);
            sh(&sb.client, &id, &check, "the first fork").await.context("a fork does not see its snapshot's files")?;
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
            let (id, _) = sb.create_with(fork_request(), &format!("fork {k} of batch {b}")).await?;
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

/// Snapshots, forks and exec throughput on a daemon of their own, so that neither the latency
/// daemon's RSS nor the density daemon's is theirs.
pub(crate) async fn sandboxd_snapshots(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys: Vec<Key> = Key::SNAPSHOTS.iter().chain(Key::FORKS.iter()).copied().collect();
    let fail_all = |report: &mut Report, e: &anyhow::Error| {
        report.failed(&keys, e);
        for (concurrency, _) in plan.throughput {
            report.throughput.push((concurrency, Err(format!("{e:#}"))));
        }
    };
    let daemon = match Daemon::start().await.context("starting sandboxd for the snapshot, fork and throughput sections") {
        Ok(d) => d,
        Err(e) => return fail_all(report, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return fail_all(report, &e),
    };
    let mut sb = Sandboxes::new(client);

    for image in [Image::Minimal, Image::Debian] {
        for (mib, n) in [(CHANGED_SMALL_MIB, plan.snap_small), (CHANGED_LARGE_MIB, plan.snap_large)] {
            eprintln!("bench: sandboxd snapshot+rollback, {mib} MiB changed, image {} × {n}", image.name());
            let (snap_key, rollback_key) = (Key::Snapshot(image, mib), Key::Rollback(image, mib));
            match snapshot_rollback(&mut sb, process_sandbox(image.name()), mib, n, None).await {
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

    eprintln!("bench: sandboxd forks × {}, batches of {FORK_BATCH} × {}", plan.fork, plan.fork_batches);
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
    report.section_times.push(("sandboxd snapshots, forks, throughput".into(), started.elapsed()));
}

/// Create and a 1 MiB snapshot on a daemon without user namespaces, and on one whose user
/// namespaces go without idmapped mounts (files shifted on disk), for the rows that show what a
/// user namespace per sandbox costs either way (the other rows have idmapped ones, the default).
pub(crate) async fn sandboxd_without_userns(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    userns_variant(plan, report, "off", "without user namespaces", [Key::CreateNoUserns, Key::SnapshotNoUserns]).await;
    report.section_times.push(("sandboxd without user namespaces".into(), started.elapsed()));
    let started = Instant::now();
    userns_variant(plan, report, "shifted", "with shifted copies", [Key::CreateShifted, Key::SnapshotShifted]).await;
    report.section_times.push(("sandboxd with shifted copies".into(), started.elapsed()));
}

/// Create and a 1 MiB snapshot on a daemon with `[process] user_namespaces = mode`, as rows
/// `keys` (create, snapshot).
async fn userns_variant(plan: &Plan, report: &mut Report, mode: &str, what: &str, keys: [Key; 2]) {
    let daemon = match Daemon::start_with_config(&format!("[process]\nuser_namespaces = \"{mode}\"\n")).await.context(format!("starting sandboxd {what}")) {
        Ok(d) => d,
        Err(e) => return report.failed(&keys, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return report.failed(&keys, &e),
    };
    let mut sb = Sandboxes::new(client);
    eprintln!("bench: sandboxd create × {} {what}", plan.create);
    let creates = crate::latency::create_destroy(&mut sb, plan).await.map(|(creates, _)| creates);
    match creates {
        Ok(c) => report.measured(keys[0], &c),
        Err(e) => report.failed(&[keys[0]], &e),
    }
    sb.cleanup().await;
    eprintln!("bench: sandboxd snapshot, {CHANGED_SMALL_MIB} MiB changed × {} {what}", plan.snap_small);
    match snapshot_rollback(&mut sb, process_sandbox(Image::Minimal.name()), CHANGED_SMALL_MIB, plan.snap_small, None).await {
        Ok((snaps, _, _)) => report.measured(keys[1], &snaps),
        Err(e) => report.failed(&[keys[1]], &e),
    }
    sb.cleanup().await;
    drop(daemon);
}
