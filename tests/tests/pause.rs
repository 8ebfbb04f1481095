//! Pause and resume on every tier: a paused sandbox's processes are frozen in place (a counter
//! stops where it was and goes on from there), nothing else runs in it (exec and file calls are
//! FAILED_PRECONDITION naming it), its clock stops (an exec's timeout and the sandbox's TTL do
//! not run on while it is paused), it can be destroyed, and it is still paused after the
//! daemon is killed and restarted. Plus the TTL's pause (`on_expiry` PAUSE) and `sbx pause` /
//! `sbx resume`.
//!
//! Each case runs for each tier as `<tier>::<case>`; every test starts its own daemon.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::time::{Duration, Instant, SystemTime};

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, ExecRequest, ExecStatus, Isolation, OnExpiry, SandboxState};
use agent_client::Client;
use sandbox_tests::{describe, eventually, run_sbx, sandbox_request, status, text, within, Harness};
use tonic::Code;

/// A counter that writes its next value to /tmp/c every 50 ms or more (never faster: `sleep`
/// waits at least that long), for as long as it runs.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.05; done";
/// The counter's period: at most one step per this much running time.
const STEP: Duration = Duration::from_millis(50);

macro_rules! tiers {
    ($($case:ident),+ $(,)?) => {
        mod process { use super::*; $( #[tokio::test(flavor = "multi_thread")] async fn $case() { super::$case(Isolation::Process).await } )+ }
        mod container { use super::*; $( #[tokio::test(flavor = "multi_thread")] async fn $case() { super::$case(Isolation::Container).await } )+ }
        mod microvm { use super::*; $( #[tokio::test(flavor = "multi_thread")] async fn $case() { super::$case(Isolation::Microvm).await } )+ }
    };
}

tiers!(pause_freezes_in_place_and_resume_goes_on, paused_time_does_not_count_against_an_exec_timeout, a_paused_sandbox_survives_a_restart_and_is_destroyed);

async fn create(client: &Client, request: CreateSandboxRequest) -> String {
    let isolation = request.isolation;
    let sb = within(180, client.create(request)).await.unwrap_or_else(|e| panic!("CreateSandbox on tier {isolation}: {e}"));
    assert_eq!(sb.state, SandboxState::Running as i32, "{sb:?}");
    sb.id
}

/// The counter's value now (0 before it first wrote).
async fn counter(client: &Client, id: &str) -> u64 {
    let r = within(120, client.exec(exec_request(id, ["cat", "/tmp/c"]))).await.expect("Exec");
    text(&r.stdout).trim().parse().unwrap_or(0)
}

/// Starts the counter in the background and waits until it has counted.
async fn start_counter(client: &Client, id: &str) -> String {
    let bg = within(120, client.exec(ExecRequest { background: true, ..exec_request(id, ["sh", "-c", COUNTER]) })).await.expect("background Exec");
    assert_eq!(status(&bg), ExecStatus::Running, "{}", describe(&bg));
    let seen = std::sync::atomic::AtomicU64::new(0);
    assert!(
        eventually(120, || async {
            let n = counter(client, id).await;
            seen.store(n, std::sync::atomic::Ordering::Relaxed);
            n >= 3
        })
        .await,
        "the counter never counted (last read {})",
        seen.into_inner()
    );
    bg.exec_id
}

/// Asserts `err` is FAILED_PRECONDITION naming the sandbox as paused and saying how to resume.
fn assert_paused_refusal(what: &str, id: &str, err: agent_client::Error) {
    assert_eq!(err.code(), Code::FailedPrecondition, "{what}: {err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(id) && msg.contains("paused") && msg.contains("resume"),
        "{what}: the refusal names neither the sandbox, its pause nor the way out: {msg}"
    );
}

async fn pause_freezes_in_place_and_resume_goes_on(isolation: Isolation) {
    let h = Harness::start().await;
    let id = create(&h.client, sandbox_request(isolation, "minimal")).await;
    let counter_exec = start_counter(&h.client, &id).await;

    // Running time between the last read before the pause and the pause taking hold.
    let t_read = Instant::now();
    let before = counter(&h.client, &id).await;
    let paused = within(60, h.client.pause(&id)).await.expect("PauseSandbox");
    let window_before = t_read.elapsed();
    assert_eq!(paused.state, SandboxState::Paused as i32, "{paused:?}");
    let paused_at = paused.paused_at.expect("paused_at is set while paused");
    // Idempotent: pausing again changes nothing.
    let again = within(60, h.client.pause(&id)).await.expect("PauseSandbox again");
    assert_eq!((again.state, again.paused_at), (SandboxState::Paused as i32, Some(paused_at)), "a second pause changed the sandbox");
    assert_eq!(h.client.get(&id).await.expect("GetSandbox").state, SandboxState::Paused as i32);

    // Nothing runs in it: exec, streaming exec, sessions' files and reads are refused at once.
    let refused = within(10, h.client.exec(exec_request(&id, ["true"]))).await.expect_err("an exec in a paused sandbox");
    assert_paused_refusal("Exec", &id, refused);
    let refused = within(10, h.client.write_file(&id, "/tmp/x", b"x".to_vec(), 0o644)).await.expect_err("a write in a paused sandbox");
    assert_paused_refusal("WriteFile", &id, refused);
    let refused = within(10, h.client.read_file(&id, "/tmp/c", 0, 0)).await.expect_err("a read in a paused sandbox");
    assert_paused_refusal("ReadFile", &id, refused);
    let refused = within(10, h.client.snapshot(&id, "while-paused")).await.expect_err("a snapshot of a paused sandbox");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");

    // No CPU while frozen (process and container: the sandbox's own cgroup; a stopped VM's QEMU
    // still keeps its main loop, so the guest is checked through the counter alone).
    let cpu = |u: &agent_client::proto::SandboxUsage| u.cpu_user_ms + u.cpu_system_ms;
    let usage_paused = h.client.get(&id).await.expect("GetSandbox").usage.expect("a paused sandbox reports its usage");
    // Long enough paused that a counter left running would have counted far past the bound
    // below: several times the running time around the pause.
    let hold = (window_before * 4).max(Duration::from_secs(3));
    tokio::time::sleep(hold).await;
    let usage_later = h.client.get(&id).await.expect("GetSandbox").usage.expect("usage");
    if isolation != Isolation::Microvm {
        assert_eq!(cpu(&usage_later), cpu(&usage_paused), "CPU was used while paused: {usage_paused:?} then {usage_later:?}");
    }

    let t_resume = Instant::now();
    let resumed = within(60, h.client.resume(&id, 0)).await.expect("ResumeSandbox");
    assert_eq!(resumed.state, SandboxState::Running as i32, "{resumed:?}");
    assert!(resumed.paused_at.is_none(), "{resumed:?}");
    let after = counter(&h.client, &id).await;
    let window_after = t_resume.elapsed();
    // At most one step per STEP of running time: the time around the pause, never the pause.
    let running = window_before + window_after;
    let bound = before + (running.as_millis() / STEP.as_millis()) as u64 + 2;
    assert!(
        after >= before && after <= bound,
        "the counter went from {before} to {after} across a {hold:?} pause; with {running:?} of running time around it, at most {bound}"
    );
    // And it goes on from there: the same process, thawed, not a new one.
    assert!(eventually(60, || async { counter(&h.client, &id).await > after }).await, "the counter did not go on after the resume");
    let bg = h.client.get_exec(&counter_exec, false).await.expect("GetExec");
    assert_eq!(status(&bg), ExecStatus::Running, "the counter's exec across the pause: {}", describe(&bg));
    // Resuming a running sandbox changes nothing.
    let again = within(60, h.client.resume(&id, 0)).await.expect("ResumeSandbox again");
    assert_eq!(again.state, SandboxState::Running as i32);
    let r = within(60, h.client.exec(exec_request(&id, ["echo", "works"]))).await.expect("Exec after resume");
    assert_eq!(text(&r.stdout), "works\n", "{}", describe(&r));

    // Destroyed while paused: at once, everything goes.
    within(60, h.client.pause(&id)).await.expect("PauseSandbox");
    within(60, h.client.destroy(&id)).await.expect("destroying a paused sandbox");
    assert_eq!(h.client.get(&id).await.expect_err("destroyed").code(), Code::NotFound);
    let ended = within(30, h.client.get_exec(&counter_exec, true)).await;
    assert!(ended.map(|r| status(&r) != ExecStatus::Running).unwrap_or(true), "the counter's exec still runs after the destroy");
}

async fn paused_time_does_not_count_against_an_exec_timeout(isolation: Isolation) {
    let h = Harness::start().await;
    let id = create(&h.client, sandbox_request(isolation, "minimal")).await;
    // Warm the tier up (a microVM's first exec is slow), so the sleep starts at once.
    within(120, h.client.exec(exec_request(&id, ["true"]))).await.expect("Exec");
    // 2 s of sleep under a 4 s timeout, paused for 5 s in the middle: the wall clock passes the
    // timeout, the sandbox's running time does not.
    let request = ExecRequest { background: true, timeout_ms: 4000, ..exec_request(&id, ["sleep", "2"]) };
    let t0 = Instant::now();
    let bg = within(120, h.client.exec(request)).await.expect("background Exec");
    within(60, h.client.pause(&id)).await.expect("PauseSandbox");
    let started_to_paused = t0.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    within(60, h.client.resume(&id, 0)).await.expect("ResumeSandbox");
    let r = within(60, h.client.get_exec(&bg.exec_id, true)).await.expect("GetExec");
    assert!(
        status(&r) == ExecStatus::Exited && r.exit_code == 0,
        "an exec paused for 5 s of its 4 s timeout ({started_to_paused:?} after it started) was not let finish: {}",
        describe(&r)
    );
    assert!(t0.elapsed() >= Duration::from_secs(5), "the exec ended before the pause did");
}

async fn a_paused_sandbox_survives_a_restart_and_is_destroyed(isolation: Isolation) {
    let mut h = Harness::start().await;
    let id = create(&h.client, CreateSandboxRequest { ttl_seconds: 3600, ..sandbox_request(isolation, "minimal") }).await;
    let other = create(&h.client, sandbox_request(isolation, "minimal")).await;
    within(60, h.client.write_file(&id, "/workspace/kept", b"kept".to_vec(), 0o644)).await.expect("WriteFile");
    let paused = within(60, h.client.pause(&id)).await.expect("PauseSandbox");
    let left = paused.expires_at.as_ref().map(|e| e.seconds).expect("a TTL") - paused.paused_at.as_ref().map(|p| p.seconds).expect("paused_at");

    h.daemon.kill9();
    within(120, h.daemon.restart()).await.expect("restarting sandboxd on the same state dir");
    h.client = h.daemon.client().await.expect("reconnecting");

    // Still paused, and refused as paused (re-adopted frozen, never let run).
    let info = h.client.get(&id).await.expect("GetSandbox after the restart");
    assert_eq!(info.state, SandboxState::Paused as i32, "{info:?}");
    let refused = within(120, h.client.exec(exec_request(&id, ["true"]))).await.expect_err("an exec in a paused sandbox after a restart");
    assert_paused_refusal("Exec after a restart", &id, refused);
    assert_eq!(h.client.get(&id).await.expect("GetSandbox").state, SandboxState::Paused as i32, "a call re-adopted it and left it paused");
    // The other one is running as usual.
    let r = within(120, h.client.exec(exec_request(&other, ["true"]))).await.expect("Exec");
    assert_eq!(status(&r), ExecStatus::Exited, "{}", describe(&r));

    // Resumed: its files are there, it runs, and its TTL is what was left at the pause.
    let resumed = within(120, h.client.resume(&id, 0)).await.expect("ResumeSandbox after the restart");
    assert_eq!(resumed.state, SandboxState::Running as i32, "{resumed:?}");
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).expect("clock").as_secs() as i64;
    let left_now = resumed.expires_at.as_ref().map(|e| e.seconds).expect("a TTL") - now;
    assert!((left - 5..=left + 1).contains(&left_now), "the TTL ran on while paused: {left} s left at the pause, {left_now} s after the resume");
    let r = within(60, h.client.exec(exec_request(&id, ["cat", "/workspace/kept"]))).await.expect("Exec after resume");
    assert_eq!(text(&r.stdout), "kept", "{}", describe(&r));

    // Paused again, then destroyed while paused.
    within(60, h.client.pause(&id)).await.expect("PauseSandbox");
    within(60, h.client.destroy(&id)).await.expect("destroying a paused sandbox");
    assert_eq!(h.client.get(&id).await.expect_err("destroyed").code(), Code::NotFound);
}

/// A TTL with `on_expiry` PAUSE pauses instead of destroying; the paused sandbox's clock is
/// stopped (it is never reaped), and a resume gives it its TTL again. Manager logic, the same
/// on every tier: checked on the process tier.
#[tokio::test(flavor = "multi_thread")]
async fn a_ttl_with_on_expiry_pause_pauses_and_a_paused_ttl_stands_still() {
    let h = Harness::start().await;
    let request = CreateSandboxRequest { ttl_seconds: 2, on_expiry: OnExpiry::Pause as i32, ..sandbox_request(Isolation::Process, "minimal") };
    let id = create(&h.client, request).await;
    let created = h.client.get(&id).await.expect("GetSandbox");
    assert_eq!(created.on_expiry, OnExpiry::Pause as i32, "{created:?}");
    assert!(
        eventually(60, || async { h.client.get(&id).await.map(|s| s.state == SandboxState::Paused as i32).unwrap_or(false) }).await,
        "the TTL did not pause the sandbox: {:?}",
        h.client.get(&id).await
    );

    // A sandbox paused by hand with 2 s left is not reaped however long it stays paused.
    let plain = create(&h.client, CreateSandboxRequest { ttl_seconds: 2, ..sandbox_request(Isolation::Process, "minimal") }).await;
    within(60, h.client.pause(&plain)).await.expect("PauseSandbox");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let still = h.client.get(&plain).await.expect("a paused sandbox is not reaped at its TTL");
    assert_eq!(still.state, SandboxState::Paused as i32, "{still:?}");
    within(60, h.client.resume(&plain, 0)).await.expect("ResumeSandbox");
    // Its 2 s run on from the resume: then it is destroyed (on_expiry DESTROY).
    assert!(eventually(60, || async { h.client.get(&plain).await.is_err_and(|e| e.code() == Code::NotFound) }).await, "the resumed sandbox was never reaped");

    // The TTL-paused one, resumed without a TTL, gets its TTL again and is paused again.
    let resumed = within(60, h.client.resume(&id, 0)).await.expect("ResumeSandbox");
    assert_eq!(resumed.state, SandboxState::Running as i32, "{resumed:?}");
    assert!(resumed.expires_at.is_some(), "{resumed:?}");
    let r = within(60, h.client.exec(exec_request(&id, ["true"]))).await;
    // Its 2 s may already be over under load: a refusal as paused is the other right answer.
    if let Err(e) = r {
        assert_paused_refusal("Exec just after a resume", &id, e);
    }
    assert!(
        eventually(60, || async { h.client.get(&id).await.map(|s| s.state == SandboxState::Paused as i32).unwrap_or(false) }).await,
        "the resumed sandbox's TTL did not pause it again"
    );
    // A resume with a TTL of its own keeps it running past the old one.
    let resumed = within(60, h.client.resume(&id, 3600)).await.expect("ResumeSandbox with a TTL");
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).expect("clock").as_secs() as i64;
    assert!(resumed.expires_at.as_ref().expect("a TTL").seconds >= now + 3500, "{resumed:?}");
}

/// `sbx pause` and `sbx resume` print the sandbox's state.
#[tokio::test(flavor = "multi_thread")]
async fn sbx_pause_and_resume() {
    let h = Harness::start().await;
    let id = create(&h.client, sandbox_request(Isolation::Process, "minimal")).await;
    let out = run_sbx(&h.daemon, &["pause", &id], 60).await;
    assert!(out.status.success(), "sbx pause: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(line.starts_with(&id) && line.contains("paused"), "sbx pause printed {line:?}");
    assert_eq!(h.client.get(&id).await.expect("GetSandbox").state, SandboxState::Paused as i32);
    let out = run_sbx(&h.daemon, &["exec", &id, "--", "true"], 60).await;
    assert!(!out.status.success(), "sbx exec in a paused sandbox succeeded");
    assert!(String::from_utf8_lossy(&out.stderr).contains("sbx resume"), "sbx exec did not say how to resume: {}", String::from_utf8_lossy(&out.stderr));
    let out = run_sbx(&h.daemon, &["resume", &id], 60).await;
    assert!(out.status.success(), "sbx resume: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("running"), "sbx resume printed {:?}", String::from_utf8_lossy(&out.stdout));
    let out = run_sbx(&h.daemon, &["exec", &id, "--", "echo", "back"], 60).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "back\n", "{}", String::from_utf8_lossy(&out.stderr));
}
