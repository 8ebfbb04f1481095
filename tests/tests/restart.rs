//! A restart keeps the service available: the daemon listens before it brings its sandboxes back,
//! a call on one sandbox re-adopts that one at once, health says when all are back, and every
//! sandbox comes back with its files.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use agent_client::{exec_request, Client};
use sandbox_tests::{eventually, process_sandbox, sh_ok, within, Daemon};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Sandboxes alive when the daemon is killed: enough that re-adopting them all takes a while.
const SANDBOXES: usize = 60;

async fn recovery_health(client: &Client) -> ServingStatus {
    let mut health = HealthClient::new(client.channel());
    match health.check(HealthCheckRequest { service: "sandboxd.recovery".into() }).await {
        Ok(r) => ServingStatus::try_from(r.into_inner().status).unwrap_or(ServingStatus::Unknown),
        Err(_) => ServingStatus::Unknown,
    }
}

/// The position of the first log line containing `needle`.
fn line_of(log: &str, needle: &str) -> Option<usize> {
    log.lines().position(|l| l.contains(needle))
}

#[tokio::test(flavor = "multi_thread")]
async fn after_kill9_the_daemon_listens_first_and_brings_every_sandbox_back() {
    let mut daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let mut ids = Vec::new();
    for i in 0..SANDBOXES {
        let sb = within(60, client.create(process_sandbox("minimal"))).await.expect("create");
        within(30, client.write_file(&sb.id, "/workspace/n", i.to_string().into_bytes(), 0)).await.expect("WriteFile");
        ids.push(sb.id);
    }
    let before = daemon.log().lines().count();

    // What a sandbox the store no longer knows left behind (a run dir with its rootfs mount
    // point): swept once re-adoption is done, never by a create or re-adoption in between.
    daemon.kill9();
    let leftover = daemon.state_dir().join("run").join("sb-leftover00");
    std::fs::create_dir_all(leftover.join("rootfs")).expect("a stale run dir");
    daemon.restart().await.expect("restart after SIGKILL");
    let client = daemon.client().await.expect("client");
    // The last one created, asked for first: it is brought back for this call.
    let last = ids.last().expect("a sandbox").clone();
    let out = within(60, sh_ok(&client, &last, "cat /workspace/n")).await;
    assert_eq!(out, (SANDBOXES - 1).to_string(), "the sandbox's files are back");

    assert!(
        eventually(120, || async { recovery_health(&client).await == ServingStatus::Serving }).await,
        "health's sandboxd.recovery never became SERVING; log:\n{}",
        daemon.log()
    );
    let log: String = daemon.log().lines().skip(before).collect::<Vec<_>>().join("\n");
    let listening = line_of(&log, "listening").expect("a listening line after the restart");
    let all_back = line_of(&log, "every sandbox on record re-adopted").expect("the re-adoption's end is logged");
    assert!(listening < all_back, "the daemon listened only after re-adopting its sandboxes:\n{log}");
    assert_eq!(log.matches("sandbox re-adopted").count(), SANDBOXES, "each sandbox re-adopted once:\n{log}");
    assert!(
        eventually(60, || async { !leftover.exists() }).await,
        "the stale run dir {} is still there once every sandbox is back; log:\n{log}",
        leftover.display()
    );

    // Every sandbox runs again, with what was written in it.
    for (i, id) in ids.iter().enumerate() {
        let r = within(60, client.exec(exec_request(id, ["cat", "/workspace/n"]))).await.expect("exec");
        assert_eq!(String::from_utf8_lossy(&r.stdout), i.to_string(), "sandbox {id}: {r:?}");
    }
}
