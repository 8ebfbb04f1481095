//! sandboxd's microVM tier (`ISOLATION_MICROVM`) on daemons of its own: cold boots under each
//! accelerator, execs, snapshot+rollback and forks, and creates from the warm pool.

pub(crate) mod log;

use std::time::{Duration, Instant};

use agent_client::exec_request;
use anyhow::{bail, Context, Result};
use sandbox_tests::{process_sandbox, proto, Daemon};

use self::log::{accel_decision, count_logged, kvm_reason, log_lines, print_log_tail, LogLine};
use crate::check_interrupt;
use crate::cli::Plan;
use crate::results::{Key, Report, VmAccel, SIZED_MIB};
use crate::sandboxes::{check_true, exec_stream_true, exec_true, sh, write_blob, Sandboxes};
use crate::snapshots::{snapshot_rollback, CHANGED_SMALL_MIB};
use crate::stats::median;

/// `RUST_LOG` directive added for the microVM daemons: `microVM booted` (with `accel=` and
/// `boot_ms=`) is a debug line of this module. Only this module, so that the daemon does not
/// log a line per exec.
pub(crate) const MICROVM_LOG_DIRECTIVE: &str = "sandboxd::backend::microvm=debug";
/// Log messages of the microVM tier the bench reads (sandboxd/src/backend/microvm/).
pub(crate) const LOG_BOOTED: &str = "microVM booted";
pub(crate) const LOG_POOL_READY: &str = "warm pool holds a booted microVM";
pub(crate) const LOG_POOL_TAKEN: &str = "microVM taken from the warm pool";
const LOG_POOL_GAVE_UP: &str = "warm pool refill stopped";
/// Boot deadline of the daemon that tries KVM where the `auto` daemon chose TCG: long enough for
/// a KVM boot, short enough not to wait the default 30 s for a guest that hangs.
pub(crate) const KVM_TRY_BOOT_TIMEOUT_MS: u64 = 8000;
/// How long to wait for the warm pool to hold a VM before a sample.
const POOL_FILL_TIMEOUT: Duration = Duration::from_secs(180);

/// The daemon's answer in an error (`CODE: message`), without the bench's context around it.
fn daemon_answer(e: &anyhow::Error) -> String {
    e.chain().find_map(|c| c.downcast_ref::<agent_client::Error>()).map(|c| c.to_string()).unwrap_or_else(|| format!("{e:#}"))
}

/// Whether the daemon refused because this host cannot provide the tier (no QEMU, no VM
/// artifacts), as opposed to a tier that tried and failed.
fn is_failed_precondition(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<agent_client::Error>().is_some_and(|e| e.code() == tonic::Code::FailedPrecondition))
}

/// A microVM sandbox of image `minimal` with the default limits (those of the warm pool).
fn microvm_request() -> proto::CreateSandboxRequest {
    proto::CreateSandboxRequest { isolation: proto::Isolation::Microvm as i32, ..process_sandbox("minimal") }
}

/// Starts a daemon for the microVM tier: JSON log, with the tier's debug lines.
async fn start_microvm_daemon(toml: &str, extra_args: &[&str], what: &str) -> Result<Daemon> {
    // The harness gives the daemon `$SANDBOXD_TEST_LOG` as RUST_LOG when it spawns it. Set only
    // around that spawn, so the other sections' daemons log as before; the sections run one
    // after another, so nothing else reads the environment meanwhile.
    const VAR: &str = "SANDBOXD_TEST_LOG";
    let before = std::env::var(VAR).ok();
    let filter = format!("{},{MICROVM_LOG_DIRECTIVE}", before.as_deref().unwrap_or("info"));
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
    let result = sb.client.exec(exec_request(id, ["true"])).await.with_context(|| format!("first Exec of `true` in {id} ({what})"))?;
    let took = since.elapsed();
    check_true(&result, what)?;
    Ok(took)
}

/// What the cold boots measured.
#[derive(Default)]
struct ColdBoots {
    boots: Vec<Duration>,
    pub(crate) creates: Vec<Duration>,
    pub(crate) destroys: Vec<Duration>,
    /// `boot_ms` and `guest_uptime_ms` of their `microVM booted` lines.
    pub(crate) logged: (Vec<Duration>, Vec<Duration>),
}

/// `n` cold boots on a daemon without a pool: `CreateSandbox` and the first `Exec` of `true`
/// timed as one (and the create alone), the destroy apart. Fails unless the daemon logged each
/// of them as booted under `accel`.
async fn cold_boots(daemon: &Daemon, sb: &mut Sandboxes, accel: VmAccel, n: usize) -> Result<ColdBoots> {
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
    let booted: Vec<&LogLine> = lines.iter().filter(|l| l.message == LOG_BOOTED).skip(before).collect();
    if booted.len() != n {
        bail!("{n} cold boots under {} but {} `{LOG_BOOTED}` lines in the daemon's log", accel.name(), booted.len());
    }
    for line in booted {
        if line.field("accel").as_deref() != Some(accel.config()) {
            bail!("a cold boot meant to run under {} did not: {}", accel.name(), line.text());
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
    let (id, _) = sb.create_with(microvm_request(), "the microVM of the exec rows").await?;
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
async fn microvm_fork_rounds(sb: &mut Sandboxes, snap: &str, n: usize, what: &str) -> Result<Vec<Duration>> {
    let warmup = 1;
    let mut forks = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let request = proto::CreateSandboxRequest { from_snapshot_id: snap.to_string(), ..microvm_request() };
        let (id, took) = sb.create_with(request, &format!("microVM fork {i} of {snap}, {what}")).await?;
        if i == 0 {
            let check = format!("[ \"$(wc -c < /workspace/blob)\" -eq {} ]", u64::from(CHANGED_SMALL_MIB) << 20);
            sh(&sb.client, &id, &check, &format!("the first microVM fork, {what}")).await.context("a microVM fork does not see its snapshot's files")?;
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
async fn microvm_forks(sb: &mut Sandboxes, n: usize, include_memory: bool) -> Result<(Result<Vec<Duration>>, Result<Vec<Duration>>)> {
    let (origin, _) = sb.create_with(microvm_request(), "the origin of the microVM forks").await?;
    write_blob(&sb.client, &origin, CHANGED_SMALL_MIB, "the origin of the microVM forks").await?;
    let (snap, _, _) = sb.snapshot_with(&origin, "the microVM snapshot to fork", Some(include_memory)).await?;
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
        let complaints = || lines.iter().filter(|l| l.level == "WARN" || l.level == "ERROR").map(LogLine::text).collect::<Vec<_>>().join("; ");
        if lines.iter().any(|l| l.message.starts_with(LOG_POOL_GAVE_UP)) {
            bail!("the warm pool gave up booting VMs: {}", complaints());
        }
        if Instant::now() > deadline {
            bail!("the warm pool did not log its VM number {count} (`{LOG_POOL_READY}`) within {} s; warnings: {}", POOL_FILL_TIMEOUT.as_secs(), complaints());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates served by the warm pool of size 1: before each, wait for the pool to hold a VM again;
/// after it, check the daemon says this create took it. Returns the creates, the creates with
/// their first exec, and the boot times of the pool's VMs.
async fn microvm_pool_creates(daemon: &Daemon, sb: &mut Sandboxes, n: usize) -> Result<(Vec<Duration>, Vec<Duration>, Vec<Duration>)> {
    let warmup = 1;
    let (mut creates, mut readies) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..warmup + n {
        wait_for_pool(daemon, i + 1).await?;
        let what = format!("microVM create {i} from the warm pool");
        let t = Instant::now();
        let (id, created) = sb.create_with(microvm_request(), &what).await?;
        let ready = first_exec(sb, &id, t, &what).await?;
        let taken = log_lines(&daemon.log()).iter().any(|l| l.message == LOG_POOL_TAKEN && l.field("sandbox").as_deref() == Some(id.as_str()));
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
    let pool_boots = log_lines(&daemon.log()).iter().filter(|l| l.message == LOG_POOL_READY).filter_map(|l| l.millis("boot_ms")).collect();
    Ok((creates, readies, pool_boots))
}

/// The rows of the daemon left at `accel = "auto"`: cold boots, execs, snapshot+rollback and
/// forks. Returns the accelerator it chose, or `None` when this host cannot run the tier.
async fn microvm_auto(plan: &Plan, report: &mut Report) -> Result<Option<VmAccel>> {
    // Cold boots: every create boots (no boot snapshot; those have rows of their own).
    let daemon = start_microvm_daemon(NO_BOOT_SNAPSHOTS, &[], "accel = \"auto\"").await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!("bench: sandboxd microVM tier: a first, untimed boot (may probe KVM)");
    let t = Instant::now();
    let first = match sb.create_with(microvm_request(), "microVM tier, first create").await {
        Ok((id, _)) => first_exec(&sb, &id, t, "microVM tier, first boot").await.map(|took| (id, took)),
        Err(e) => Err(e),
    };
    let lines = log_lines(&daemon.log());
    report.microvm.accel_log = accel_decision(&lines);
    report.microvm.kvm_reason = kvm_reason(&lines);
    let (id, took) = match first {
        Ok(x) => x,
        Err(e) if is_failed_precondition(&e) => {
            let why = format!("CreateSandbox with ISOLATION_MICROVM: {e:#}");
            let line = format!("!!!!! SANDBOXD MICROVM TIER UNAVAILABLE: {why} — its rows say \"unavailable\" !!!!!");
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
    let accel = lines.iter().find(|l| l.message == LOG_BOOTED).and_then(|l| l.field("accel")).and_then(|a| VmAccel::from_log(&a));
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

    eprintln!("bench: sandboxd microVM cold boots ({}) × {}", accel.name(), plan.microvm_boot);
    match cold_boots(&daemon, &mut sb, accel, plan.microvm_boot).await {
        Ok(cold) => {
            report.measured(Key::MicroVmDestroy, &cold.destroys);
            record_cold_boots(report, accel, cold);
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (auto)");
            let keys = [Key::MicroVmBoot(accel), Key::MicroVmCreate(accel), Key::MicroVmDestroy];
            report.failed(&keys, &e);
        }
    }
    sb.cleanup().await;

    eprintln!("bench: sandboxd microVM Exec × {}, ExecStream × {}", plan.microvm_exec, plan.microvm_stream);
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

    // Without memory (a boot over the snapshot's disk) and with it (the saved VM resumes), one
    // after the other on the same daemon.
    for memory in [false, true] {
        let (snap_key, rollback_key) =
            if memory { (Key::MicroVmSnapshotMemory, Key::MicroVmRollbackMemory) } else { (Key::MicroVmSnapshot, Key::MicroVmRollback) };
        let with = if memory { "with memory" } else { "without memory" };
        eprintln!("bench: sandboxd microVM snapshot+rollback {with}, {CHANGED_SMALL_MIB} MiB changed × {}", plan.microvm_snap);
        match snapshot_rollback(&mut sb, microvm_request(), CHANGED_SMALL_MIB, plan.microvm_snap, Some(memory)).await {
            Ok((snaps, rollbacks, sizes)) => {
                report.measured(snap_key, &snaps);
                report.measured(rollback_key, &rollbacks);
                if memory {
                    report.microvm.memory_snapshot_size = median(&sizes);
                } else {
                    report.microvm.snapshot_size = median(&sizes);
                }
            }
            Err(e) => {
                print_log_tail(&daemon, "microVM (auto)");
                report.failed(&[snap_key, rollback_key], &e);
            }
        }
        sb.cleanup().await;

        let forks = if memory { plan.microvm_fork_memory } else { plan.microvm_fork };
        eprintln!("bench: sandboxd microVM forks {with} × {forks}, origin running then destroyed");
        let fork_keys = if memory { [Key::MicroVmForkMemory, Key::MicroVmForkMemoryOriginGone] } else { [Key::MicroVmFork, Key::MicroVmForkOriginGone] };
        match microvm_forks(&mut sb, forks, memory).await {
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
    }
    Ok(Some(accel))
}

/// Cold boots under the accelerator the `auto` daemon did not choose, on a daemon configured
/// for it. KVM that cannot boot a guest on this host is no failure of the bench: its rows say
/// why, with the `auto` daemon's reason and what the forced create answered.
async fn microvm_other_accel(plan: &Plan, report: &mut Report, accel: VmAccel) -> Result<()> {
    let toml = match accel {
        VmAccel::Kvm => {
            format!("{NO_BOOT_SNAPSHOTS}accel = \"kvm\"\nboot_timeout_ms = {KVM_TRY_BOOT_TIMEOUT_MS}\n")
        }
        VmAccel::Tcg => format!("{NO_BOOT_SNAPSHOTS}accel = \"tcg\"\n"),
    };
    let what = format!("accel = \"{}\"", accel.config());
    let daemon = start_microvm_daemon(&toml, &[], &what).await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!("bench: sandboxd microVM tier under {}: a first, untimed boot", accel.name());
    let t = Instant::now();
    let first = match sb.create_with(microvm_request(), &format!("first microVM create with {what}")).await {
        Ok((id, _)) => first_exec(&sb, &id, t, &format!("first microVM boot with {what}")).await.map(|_| id),
        Err(e) => Err(e),
    };
    let result = match first {
        Ok(id) => {
            sb.destroy(&id).await?;
            eprintln!("bench: sandboxd microVM cold boots ({}) × {}", accel.name(), plan.microvm_boot);
            match cold_boots(&daemon, &mut sb, accel, plan.microvm_boot).await {
                Ok(cold) => {
                    record_cold_boots(report, accel, cold);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        Err(e) if accel == VmAccel::Kvm => {
            let reason = report.microvm.kvm_reason.clone().unwrap_or_else(|| "the daemon left at accel = \"auto\" chose TCG".to_string());
            let why = format!("KVM unusable on this host: {reason}; a boot forced to KVM failed too");
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

/// The `[microvm]` table of a daemon whose every create boots.
const NO_BOOT_SNAPSHOTS: &str = "[microvm]\nboot_snapshots = 0\n";
/// What the daemon logs for a create restored from the image's boot snapshot.
const LOG_BOOT_SNAPSHOT_RESTORED: &str = "microVM restored from its image's boot snapshot (no boot)";

/// Creates restored from the image's boot snapshot, on a daemon with the defaults (no pool):
/// a first, untimed create boots and takes the snapshot; then `n` creates, each timed alone
/// and with its first `Exec` of `true`. Fails unless the daemon logged each as restored.
async fn microvm_boot_snapshots(plan: &Plan, report: &mut Report) -> Result<()> {
    let daemon = start_microvm_daemon("", &[], "boot snapshots (the default)").await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    let n = plan.microvm_boot;
    eprintln!("bench: sandboxd microVM creates restored from the image's boot snapshot × {n}");
    let result = async {
        let (first, _) = sb.create_with(microvm_request(), "the create that boots and takes the boot snapshot").await?;
        sb.destroy(&first).await?;
        let before = count_logged(&log_lines(&daemon.log()), LOG_BOOT_SNAPSHOT_RESTORED);
        let (mut creates, mut readies) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let what = format!("microVM create {i} of {n} from the boot snapshot");
            let t = Instant::now();
            let (id, created) = sb.create_with(microvm_request(), &what).await?;
            readies.push(first_exec(&sb, &id, t, &what).await?);
            creates.push(created);
            sb.destroy(&id).await?;
        }
        let restored = count_logged(&log_lines(&daemon.log()), LOG_BOOT_SNAPSHOT_RESTORED) - before;
        if restored != n {
            bail!("{n} creates after the boot snapshot but {restored} `{LOG_BOOT_SNAPSHOT_RESTORED}` lines in the daemon's log");
        }
        Ok((creates, readies))
    }
    .await;
    sb.cleanup().await;
    match result {
        Ok((creates, readies)) => {
            report.measured(Key::MicroVmBootSnapshotCreate, &creates);
            report.measured(Key::MicroVmBootSnapshotReady, &readies);
            Ok(())
        }
        Err(e) => {
            print_log_tail(&daemon, "microVM (boot snapshots)");
            Err(e)
        }
    }
}

/// The memory-snapshot rows with the memory limit at `mib` MiB, on a daemon with the defaults
/// (boot snapshots, no pool): a first, untimed create boots that shape and takes its boot
/// snapshot; then creates restored from it, a snapshot with memory and rollbacks to it, and
/// forks of it (the origin running).
async fn microvm_sized(plan: &Plan, report: &mut Report, mib: u32) -> Result<()> {
    let daemon = start_microvm_daemon("", &[], &format!("memory limit {mib} MiB")).await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    let request = || {
        let mut r = microvm_request();
        r.limits = Some(proto::ResourceLimits { memory_bytes: u64::from(mib) << 20, ..Default::default() });
        r
    };
    let n = plan.microvm_boot;
    eprintln!(
        "bench: sandboxd microVM at {mib} MiB: creates from its boot snapshot × {n}, snapshot+rollback × {}, forks × {}",
        plan.microvm_snap, plan.microvm_fork_memory
    );
    let [create_key, snap_key, rollback_key, fork_key] = Key::sized(mib);
    let result = async {
        let (first, _) = sb.create_with(request(), &format!("the {mib} MiB create that boots and takes the boot snapshot")).await?;
        sb.destroy(&first).await?;
        let before = count_logged(&log_lines(&daemon.log()), LOG_BOOT_SNAPSHOT_RESTORED);
        let mut creates = Vec::with_capacity(n);
        for i in 0..n {
            let (id, created) = sb.create_with(request(), &format!("{mib} MiB microVM create {i} of {n} from the boot snapshot")).await?;
            creates.push(created);
            sb.destroy(&id).await?;
        }
        let restored = count_logged(&log_lines(&daemon.log()), LOG_BOOT_SNAPSHOT_RESTORED) - before;
        if restored != n {
            bail!("{n} creates at {mib} MiB after its boot snapshot but {restored} `{LOG_BOOT_SNAPSHOT_RESTORED}` lines in the daemon's log");
        }
        report.measured(create_key, &creates);
        let (snaps, rollbacks, _) = snapshot_rollback(&mut sb, request(), CHANGED_SMALL_MIB, plan.microvm_snap, Some(true)).await?;
        report.measured(snap_key, &snaps);
        report.measured(rollback_key, &rollbacks);
        sb.cleanup().await;
        let (origin, _) = sb.create_with(request(), &format!("the origin of the {mib} MiB forks")).await?;
        write_blob(&sb.client, &origin, CHANGED_SMALL_MIB, "the origin of the microVM forks").await?;
        let (snap, _, _) = sb.snapshot_with(&origin, &format!("the {mib} MiB snapshot to fork"), Some(true)).await?;
        let forks = microvm_fork_rounds(&mut sb, &snap, plan.microvm_fork_memory, &format!("{mib} MiB, origin running")).await?;
        report.measured(fork_key, &forks);
        Ok(())
    }
    .await;
    sb.cleanup().await;
    if result.is_err() {
        print_log_tail(&daemon, &format!("microVM ({mib} MiB)"));
    }
    result
}

/// Creates from the warm pool, on a daemon started with `--microvm-pool 1`.
async fn microvm_pool(plan: &Plan, report: &mut Report) -> Result<()> {
    let daemon = start_microvm_daemon("", &["--microvm-pool", "1"], "--microvm-pool 1").await?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    eprintln!("bench: sandboxd microVM creates from the warm pool × {}", plan.microvm_pool);
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
pub(crate) async fn sandboxd_microvm(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    match microvm_auto(plan, report).await {
        Ok(Some(accel)) => {
            if let Err(e) = microvm_other_accel(plan, report, accel.other()).await {
                let keys = [Key::MicroVmBoot(accel.other()), Key::MicroVmCreate(accel.other())];
                report.failed(&keys, &e);
            }
            if let Err(e) = microvm_pool(plan, report).await {
                report.failed(&[Key::MicroVmPoolCreate, Key::MicroVmPoolReady], &e);
            }
            if let Err(e) = microvm_boot_snapshots(plan, report).await {
                report.failed(&[Key::MicroVmBootSnapshotCreate, Key::MicroVmBootSnapshotReady], &e);
            }
            for mib in SIZED_MIB {
                if let Err(e) = microvm_sized(plan, report, mib).await {
                    report.failed_unless_done(&Key::sized(mib), &e);
                }
            }
        }
        Ok(None) => {}
        Err(e) => report.failed_unless_done(&Key::MICROVM, &e),
    }
    report.section_times.push(("sandboxd microVM tier".into(), started.elapsed()));
}
