//! End to end: snapshots, rollback, fork, background and idempotent execs, durable state across
//! daemon restarts, TTLs — through the gRPC API of a real daemon.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use agent_client::{exec_request, proto};
use sandbox_tests::{daemon_with_sandbox, eventually, find_under, mounts_of, mounts_under, process_sandbox, sh, sh_ok, Daemon};
use tonic::Code;

/// Cgroup directories (any controller) named exactly `id`.
fn cgroup_dirs_named(id: &str) -> Vec<std::path::PathBuf> {
    find_under(Path::new("/sys/fs/cgroup"), |path, ft| ft.is_dir() && path.file_name().is_some_and(|n| n.to_string_lossy() == id))
}

#[tokio::test(flavor = "multi_thread")]
async fn rollback_restores_content_deletions_and_modes() {
    let (_daemon, c, sb) = daemon_with_sandbox(proto::Isolation::Process).await;
    sh_ok(&c, &sb, "echo v1 > /workspace/keep; chmod 640 /workspace/keep; mkdir -p /workspace/d; echo x > /workspace/d/f").await;
    let snap = c.snapshot(&sb, "before").await.expect("snapshot");
    assert_eq!(snap.sandbox_id, sb);
    assert!(snap.size_bytes >= 5, "the snapshot holds the written bytes: {snap:?}");

    sh_ok(&c, &sb, "echo v2 > /workspace/keep; chmod 777 /workspace/keep; rm -r /workspace/d; echo new > /workspace/new; rm /bin/ls").await;
    // A background process that must not survive the rollback.
    let bg = c.exec(proto::ExecRequest { background: true, ..exec_request(&sb, ["sleep", "300"]) }).await.expect("background exec");
    assert_eq!(bg.status, proto::ExecStatus::Running as i32);

    let after = c.rollback(&sb, &snap.snapshot_id).await.expect("rollback");
    assert_eq!(after.id, sb, "same id");
    assert_eq!(after.state, proto::SandboxState::Running as i32);

    assert_eq!(sh_ok(&c, &sb, "cat /workspace/keep; stat -c %a /workspace/keep").await, "v1\n640\n");
    assert_eq!(sh_ok(&c, &sb, "cat /workspace/d/f").await, "x\n", "deleted dir is back");
    assert_eq!(sh(&c, &sb, "test -e /workspace/new").await.exit_code, 1, "new file gone");
    assert_eq!(sh(&c, &sb, "test -e /bin/ls").await.exit_code, 0, "deleted image file back");
    assert!(!sh_ok(&c, &sb, "ps").await.contains("sleep 300"), "background process gone");
    let bg_end = c.get_exec(&bg.exec_id, true).await.expect("get exec");
    assert_eq!(bg_end.status, proto::ExecStatus::Lost as i32, "running exec ends as LOST: {bg_end:?}");
    assert!(bg_end.error.contains("rolled back"), "{}", bg_end.error);

    // The sandbox keeps its limits and labels and stays usable for new snapshots.
    let again = c.snapshot(&sb, "after").await.expect("second snapshot");
    assert_eq!(again.parent_snapshot_id, snap.snapshot_id, "lineage");
    let list = c.list_snapshots(&sb).await.expect("list");
    assert_eq!(list.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["before", "after"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn forks_are_independent_both_ways_and_pin_their_snapshot() {
    let (_daemon, c, origin) = daemon_with_sandbox(proto::Isolation::Process).await;
    sh_ok(&c, &origin, "echo base > /workspace/f").await;
    let snap = c.snapshot(&origin, "base").await.expect("snapshot").snapshot_id;

    let mut forks = Vec::new();
    for _ in 0..3 {
        let f = c.create(proto::CreateSandboxRequest { from_snapshot_id: snap.clone(), ..Default::default() }).await.expect("fork");
        assert_eq!(f.parent_snapshot_id, snap);
        assert_eq!(f.image, "minimal", "a fork inherits the snapshot's image");
        forks.push(f.id);
    }
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(sh_ok(&c, f, "cat /workspace/f").await, "base\n");
        sh_ok(&c, f, &format!("echo fork{i} > /workspace/f")).await;
    }
    sh_ok(&c, &origin, "echo origin > /workspace/f").await;
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(sh_ok(&c, f, "cat /workspace/f").await, format!("fork{i}\n"), "writes elsewhere never appear");
    }
    assert_eq!(sh_ok(&c, &origin, "cat /workspace/f").await, "origin\n");

    let refused = c.delete_snapshot(&snap).await.expect_err("snapshot in use");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    for f in &forks {
        c.destroy(f).await.expect("destroy fork");
    }
    c.delete_snapshot(&snap).await.expect("delete once no fork depends on it");
    let gone = c.create(proto::CreateSandboxRequest { from_snapshot_id: snap.clone(), ..Default::default() }).await.expect_err("deleted");
    assert_eq!(gone.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_snapshots_are_not_found() {
    let (_daemon, c, sb) = daemon_with_sandbox(proto::Isolation::Process).await;
    for bad in ["sn-doesnotexist1", "garbage"] {
        assert_eq!(c.rollback(&sb, bad).await.expect_err("rollback").code(), Code::NotFound);
        assert_eq!(c.delete_snapshot(bad).await.expect_err("delete").code(), Code::NotFound);
        let fork = c.create(proto::CreateSandboxRequest { from_snapshot_id: bad.into(), ..Default::default() }).await;
        assert_eq!(fork.expect_err("fork").code(), Code::NotFound);
    }
    assert_eq!(c.snapshot("sb-doesnotexist1", "x").await.expect_err("snapshot").code(), Code::NotFound);
    // The daemon is fine afterwards.
    assert_eq!(sh_ok(&c, &sb, "echo ok").await, "ok\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_during_heavy_writes_is_consistent() {
    let (_daemon, c, sb) = daemon_with_sandbox(proto::Isolation::Process).await;
    // Two invariants a point-in-time snapshot keeps and a copy made file by file while the
    // writer runs does not: each 64 KiB file is whole with its checksum (written to a temp
    // name and renamed), and the round counters c0..c49, written in that order every round,
    // read as a run of i+1 followed by a run of i — never rising, never two rounds apart.
    let writer = "i=0; while true; do i=$((i+1)); head -c 65536 /dev/urandom > /workspace/t; \
                  sum=$(sha256sum /workspace/t | cut -d' ' -f1); echo $sum >> /workspace/t; \
                  mv /workspace/t /workspace/f$((i % 20)); \
                  for n in $(seq 0 49); do echo $i > /workspace/.c; mv /workspace/.c /workspace/c$n; done; done";
    let bg = c.exec(proto::ExecRequest { background: true, ..exec_request(&sb, ["sh", "-c", writer]) }).await.expect("writer");
    // A round counter of the writer, once it has finished a round (no fixed wait).
    let round = |c: agent_client::Client, sb: String| async move { sh(&c, &sb, "cat /workspace/c49 2>/dev/null").await.stdout };
    assert!(
        eventually(60, || {
            let (c, sb) = (c.clone(), sb.clone());
            async move { !round(c, sb).await.is_empty() }
        })
        .await,
        "the writer finished no round"
    );
    let mut snaps = Vec::new();
    for i in 0..3 {
        let before = round(c.clone(), sb.clone()).await;
        snaps.push(c.snapshot(&sb, &format!("s{i}")).await.expect("snapshot").snapshot_id);
        // The next snapshot only once the writer has moved on.
        assert!(
            eventually(60, || {
                let (c, sb, before) = (c.clone(), sb.clone(), before.clone());
                async move { round(c, sb).await != before }
            })
            .await,
            "the writer stopped"
        );
    }
    c.signal_exec(&bg.exec_id, 9).await.expect("stop writer");
    let check = "for f in /workspace/f*; do n=$(wc -c < $f); want=$(tail -c 65 $f | head -c 64); \
                 got=$(head -c 65536 $f | sha256sum | cut -d' ' -f1); \
                 [ \"$n\" = 65601 ] && [ \"$want\" = \"$got\" ] || { echo TORN $f $n; exit 1; }; done; \
                 prev=; for n in $(seq 0 49); do v=$(cat /workspace/c$n); \
                 if [ -n \"$prev\" ] && { [ $v -gt $prev ] || [ $((prev - v)) -gt 1 ]; }; then echo SKEW c$n $prev $v; exit 1; fi; prev=$v; done; \
                 ls /workspace | wc -l";
    for snap in snaps {
        let fork = c.create(proto::CreateSandboxRequest { from_snapshot_id: snap, ..Default::default() }).await.expect("fork").id;
        let files: u32 = sh_ok(&c, &fork, check).await.trim().parse().expect("count");
        assert!(files >= 51, "the writer had written a round: {files} files");
        c.destroy(&fork).await.expect("destroy");
    }
}

/// A snapshot freezes the sandbox only when something in it could be writing: a quiet one (no
/// exec under way, no process but its init and the armed spare) is snapshotted as it is, a
/// process an exec left behind makes the next snapshot freeze, and once it is gone the sandbox
/// is quiet again. (`snapshot_during_heavy_writes_is_consistent` checks what the freeze keeps.)
#[tokio::test(flavor = "multi_thread")]
async fn only_a_sandbox_that_could_be_writing_is_frozen_for_a_snapshot() {
    let daemon = Daemon::start_with_env("", &[("RUST_LOG", "info,sandboxd::backend::process=debug")]).await.expect("daemon");
    let c = daemon.client().await.expect("client");
    let sb = c.create(process_sandbox("minimal")).await.expect("create").id;
    let quiet = |log: String| -> Vec<bool> {
        log.lines().filter(|l| l.contains("snapshot phases") && l.contains(sb.as_str())).map(|l| l.contains("quiet=true")).collect()
    };
    sh_ok(&c, &sb, "echo 1 > /workspace/a").await;
    c.snapshot(&sb, "quiet").await.expect("snapshot");
    assert_eq!(quiet(daemon.log()), [true], "{}", daemon.log());
    sh_ok(&c, &sb, "sleep 300 > /dev/null 2>&1 &").await;
    let busy = c.snapshot(&sb, "busy").await.expect("snapshot with a process left behind");
    assert_eq!(quiet(daemon.log()), [true, false], "{}", daemon.log());
    assert!(daemon.log().lines().any(|l| l.contains("snapshot phases") && l.contains("quiet=false") && !l.contains("freeze_us=0 ")), "{}", daemon.log());
    sh_ok(&c, &sb, "kill -9 $(pidof sleep)").await;
    // Gone once the init has reaped it; then a snapshot is quiet again.
    let daemon = &daemon;
    assert!(
        eventually(60, || {
            let (c, sb) = (c.clone(), sb.clone());
            async move {
                let snap = c.snapshot(&sb, "").await.expect("snapshot");
                c.delete_snapshot(&snap.snapshot_id).await.expect("delete");
                quiet(daemon.log()).last() == Some(&true)
            }
        })
        .await,
        "{}",
        daemon.log()
    );
    // Both snapshots hold what was written before them.
    let fork = c.create(proto::CreateSandboxRequest { from_snapshot_id: busy.snapshot_id, ..Default::default() }).await.expect("fork").id;
    assert_eq!(sh_ok(&c, &fork, "cat /workspace/a").await, "1\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn background_exec_survives_its_client_and_can_be_signalled() {
    let daemon = Daemon::start().await.expect("daemon");
    let sb = {
        let c = daemon.client().await.expect("client");
        c.create(process_sandbox("minimal")).await.expect("create").id
    };
    let exec_id = {
        // This client goes away right after starting the exec.
        let c = daemon.client().await.expect("client");
        let r = c.exec(proto::ExecRequest { background: true, ..exec_request(&sb, ["sh", "-c", "sleep 1; echo finished"]) }).await.expect("bg");
        assert_eq!(r.status, proto::ExecStatus::Running as i32);
        r.exec_id
    };
    let c = daemon.client().await.expect("client");
    let done = c.get_exec(&exec_id, true).await.expect("wait");
    assert_eq!(done.status, proto::ExecStatus::Exited as i32);
    assert_eq!(String::from_utf8_lossy(&done.stdout), "finished\n");

    let long = c.exec(proto::ExecRequest { background: true, ..exec_request(&sb, ["sh", "-c", "sleep 300 & sleep 300"]) }).await.expect("bg");
    c.signal_exec(&long.exec_id, 15).await.expect("signal");
    let ended = c.get_exec(&long.exec_id, true).await.expect("wait");
    assert_eq!(ended.status, proto::ExecStatus::Signaled as i32, "{ended:?}");
    assert_eq!(ended.signal, 15);
    assert!(!sh_ok(&c, &sb, "ps").await.contains("sleep 300"), "the whole tree got the signal");
    let again = c.signal_exec(&long.exec_id, 15).await.expect_err("already ended");
    assert_eq!(again.code(), Code::FailedPrecondition);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotent_exec_runs_once_even_across_a_daemon_kill() {
    let (mut daemon, c, sb) = daemon_with_sandbox(proto::Isolation::Process).await;
    let append = |key: &str| proto::ExecRequest {
        idempotency_key: key.into(),
        ..exec_request(&sb, ["sh", "-c", "echo line >> /workspace/log; wc -l < /workspace/log"])
    };
    let first = c.exec(append("step-1")).await.expect("first");
    let replay = c.exec(append("step-1")).await.expect("replay");
    assert_eq!(replay.exec_id, first.exec_id, "the recorded exec is returned");
    assert_eq!(replay.stdout, b"1\n");

    daemon.kill9();
    daemon.restart().await.expect("restart");
    let c = daemon.client().await.expect("client");
    let after = c.exec(append("step-1")).await.expect("replay after restart");
    assert_eq!(after.exec_id, first.exec_id);
    c.exec(append("step-2")).await.expect("new key runs");
    assert_eq!(sh_ok(&c, &sb, "cat /workspace/log").await, "line\nline\n", "each key's effect landed once");
    let execs = c.list_execs(&sb, 0).await.expect("list execs");
    assert!(execs.iter().any(|e| e.exec_id == first.exec_id), "records survive the restart");
}

#[tokio::test(flavor = "multi_thread")]
async fn keyed_exec_outlives_its_client_and_unkeyed_does_not() {
    let (daemon, c, sb) = daemon_with_sandbox(proto::Isolation::Process).await;
    let keyed = proto::ExecRequest { idempotency_key: "k".into(), ..exec_request(&sb, ["sh", "-c", "sleep 1; echo done > /workspace/keyed"]) };
    let unkeyed = exec_request(&sb, ["sh", "-c", "sleep 1; echo done > /workspace/unkeyed"]);
    for req in [keyed.clone(), unkeyed] {
        let other = daemon.client().await.expect("client");
        // The call is abandoned mid-exec, as a crashing client would.
        let _ = tokio::time::timeout(Duration::from_millis(300), other.exec(req)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(sh_ok(&c, &sb, "cat /workspace/keyed").await, "done\n", "keyed exec ran on");
    assert_eq!(sh(&c, &sb, "test -e /workspace/unkeyed").await.exit_code, 1, "unkeyed exec was killed");
    let collected = c.exec(keyed).await.expect("collect by key");
    assert_eq!(collected.status, proto::ExecStatus::Exited as i32);
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_mid_exec_then_restart_readopts_and_leaks_nothing() {
    let (mut daemon, c, keep) = daemon_with_sandbox(proto::Isolation::Process).await;
    let doomed = c.create(process_sandbox("minimal")).await.expect("create").id;
    sh_ok(&c, &keep, "echo precious > /workspace/data").await;
    let running = c.exec(proto::ExecRequest { background: true, ..exec_request(&keep, ["sleep", "300"]) }).await.expect("bg");

    daemon.kill9();
    daemon.restart().await.expect("restart");
    let c = daemon.client().await.expect("client");
    let lost = c.get_exec(&running.exec_id, false).await.expect("record survives");
    assert_eq!(lost.status, proto::ExecStatus::Lost as i32);
    // Re-adopted: same id, files kept, processes gone, usable.
    let info = c.get(&keep).await.expect("re-adopted");
    assert_eq!(info.state, proto::SandboxState::Running as i32);
    assert_eq!(sh_ok(&c, &keep, "cat /workspace/data").await, "precious\n");
    assert!(!sh_ok(&c, &keep, "ps").await.contains("sleep 300"));

    c.destroy(&doomed).await.expect("destroy");
    let state = daemon.state_dir();
    assert!(!state.join("pool/sandboxes").join(&doomed).exists(), "writable layer removed");
    assert!(!state.join("run").join(&doomed).exists(), "run dir removed");
    assert!(mounts_of(&daemon, &doomed).is_empty(), "no mount left");
    assert!(cgroup_dirs_named(&doomed).is_empty(), "no cgroup left: {:?}", cgroup_dirs_named(&doomed));
    // Exactly one overlay per live sandbox (the stale ones of the killed daemon are gone).
    let overlays = mounts_under(&state.join("run"));
    assert_eq!(overlays.len(), 1, "{overlays:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ttl_reaps_sandboxes_also_across_restarts() {
    let mut daemon = Daemon::start().await.expect("daemon");
    let c = daemon.client().await.expect("client");
    let short = c.create(proto::CreateSandboxRequest { ttl_seconds: 1, ..process_sandbox("minimal") }).await.expect("create");
    assert!(short.expires_at.is_some());
    let later = c.create(proto::CreateSandboxRequest { ttl_seconds: 4, ..process_sandbox("minimal") }).await.expect("create").id;
    let forever = c.create(process_sandbox("minimal")).await.expect("create").id;
    let reaped = eventually(10, || async { c.get(&short.id).await.is_err() }).await;
    assert!(reaped, "TTL 1 s sandbox still there after 10 s");
    daemon.kill9();
    daemon.restart().await.expect("restart");
    let c = daemon.client().await.expect("client");
    let reaped = eventually(15, || async { c.get(&later).await.is_err() }).await;
    assert!(reaped, "TTL sandbox not reaped after a restart");
    assert!(c.get(&forever).await.is_ok());
    let all = c.list(HashMap::new()).await.expect("list");
    assert_eq!(all.len(), 1);
}
