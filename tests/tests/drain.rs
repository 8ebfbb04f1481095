//! `sandboxd drain` against the real daemon: while an exec runs, the drain turns health's
//! `sandbox.v1.SandboxService` NOT_SERVING (the overall status stays SERVING for liveness),
//! a create is refused UNAVAILABLE naming the drain, the exec and its sandbox keep being served
//! and the exec completes, and then the daemon ends by itself and `sandboxd drain` says so.
//! A drain past its deadline stops the daemon with SIGTERM.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a test: a failed expectation is a failed test

use std::time::Instant;

use agent_client::exec_request;
use sandbox_tests::proto::exec_event;
use sandbox_tests::{process_sandbox, sandboxd_bin, text, within, Daemon};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const API: &str = "sandbox.v1.SandboxService";

fn drain_command(daemon: &Daemon, timeout_secs: u64) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(sandboxd_bin().expect("sandboxd binary"));
    cmd.args(["drain", "--socket", &daemon.address, "--timeout", &timeout_secs.to_string(), "--stop-timeout", "60"]).kill_on_drop(true);
    cmd
}

async fn health(client: &agent_client::Client, service: &str) -> ServingStatus {
    let mut health = HealthClient::new(client.channel());
    let r = within(10, health.check(HealthCheckRequest { service: service.into() })).await.expect("health check");
    ServingStatus::try_from(r.into_inner().status).expect("a known status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_lets_the_running_exec_finish_refuses_creates_and_ends_the_daemon() {
    let mut daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let id = within(60, client.create(process_sandbox("minimal"))).await.expect("create").id;

    // An exec that says it started, then runs until the test lets it end.
    let (mut stream, mut stdout) = sandbox_tests::held_exec(&client, &id).await;

    let mut watch = HealthClient::new(client.channel());
    let mut watch = within(10, watch.watch(HealthCheckRequest { service: API.into() })).await.expect("health watch").into_inner();
    let first = within(10, watch.message()).await.expect("watch").expect("a first status");
    assert_eq!(first.status, ServingStatus::Serving as i32, "ready before the drain");

    let started = Instant::now();
    let drain = drain_command(&daemon, 120).stderr(std::process::Stdio::piped()).spawn().expect("sandboxd drain");

    // Readiness turns off (the watch's next change), liveness does not.
    let next = within(30, watch.message()).await.expect("watch").expect("a change");
    assert_eq!(next.status, ServingStatus::NotServing as i32, "{API} NOT_SERVING once draining");
    assert_eq!(health(&client, "").await, ServingStatus::Serving, "the overall status stays SERVING for liveness probes");

    // A create is refused, naming the drain; the sandbox held here is still served.
    let err = within(30, client.create(process_sandbox("minimal"))).await.expect_err("no create while draining");
    let status = err.status().expect("a gRPC status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("draining") && status.message().contains("sandboxd drain"), "{status:?}");
    assert!(daemon.exited().expect("daemon state").is_none(), "the daemon waits for the running exec; log:\n{}", daemon.log());
    within(30, client.write_file(&id, "/tmp/go", "go", 0)).await.expect("WriteFile in a held sandbox while draining");

    // The exec completes, whole.
    let result = loop {
        match within(30, stream.next_event()).await.expect("stream event").and_then(|e| e.event) {
            Some(exec_event::Event::Stdout(b)) => stdout.push_str(&text(&b)),
            Some(exec_event::Event::Stderr(b)) => panic!("stderr: {}", text(&b)),
            Some(exec_event::Event::Result(r)) => break r,
            None => panic!("the stream ended without a result; stdout so far {stdout:?}"),
        }
    };
    assert_eq!(result.exit_code, 0, "{result:?}");
    assert!(stdout.contains("finished"), "{stdout:?}");

    // Then the daemon ends by itself, and the drain reports it.
    let out = within(60, drain.wait_with_output()).await.expect("sandboxd drain ran");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "sandboxd drain failed: {said}");
    assert!(said.contains("drained: every exec ended"), "{said}");
    let exit = daemon.exited().expect("daemon state").expect("the daemon has ended once the drain returns");
    assert!(exit.success(), "the daemon exits cleanly after a drain: {exit:?}; log:\n{}", daemon.log());
    assert!(daemon.log().contains("drained: no exec is running"), "log:\n{}", daemon.log());
    eprintln!("drain with one running exec: {:.2} s from `sandboxd drain` to the daemon's exit", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_past_its_deadline_stops_the_daemon_with_sigterm() {
    let mut daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let id = within(60, client.create(process_sandbox("minimal"))).await.expect("create").id;
    let mut background = exec_request(&id, ["sleep", "600"]);
    background.background = true;
    within(30, client.exec(background)).await.expect("a background exec");

    let out = within(90, drain_command(&daemon, 1).stderr(std::process::Stdio::piped()).output()).await.expect("sandboxd drain ran");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "sandboxd drain failed: {said}");
    assert!(said.contains("stopped with SIGTERM"), "{said}");
    assert!(daemon.exited().expect("daemon state").is_some(), "the daemon has ended; log:\n{}", daemon.log());
    assert!(daemon.log().contains("SIGTERM while draining"), "log:\n{}", daemon.log());

    // Nothing listens any more: a drain now says what it could not reach.
    let out = within(30, drain_command(&daemon, 1).stderr(std::process::Stdio::piped()).output()).await.expect("sandboxd drain ran");
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && said.contains("cannot connect to the daemon's socket"), "{said}");
}

/// A two-node fleet in one network namespace this test makes (nodes at 127.0.0.2 and .3, peers
/// from dnsmasq at 127.0.0.1 answering one name with both), reached through each node's UNIX
/// socket. Removed on drop.
struct TwoNodes {
    netns: String,
    dns: Option<std::process::Child>,
    dir: tempfile::TempDir,
}

impl TwoNodes {
    fn new() -> TwoNodes {
        let netns = format!("sbxd{}", std::process::id() % 100_000);
        let _ = std::process::Command::new("ip").args(["netns", "del", &netns]).stderr(std::process::Stdio::null()).status();
        for args in [vec!["ip", "netns", "add", &netns], vec!["ip", "-n", &netns, "link", "set", "lo", "up"]] {
            let out = std::process::Command::new(args[0]).args(&args[1..]).output().expect("ip (iproute2)");
            assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("hosts"), "127.0.0.2 peers.drain.test\n127.0.0.3 peers.drain.test\n").expect("hosts");
        std::fs::write(dir.path().join("fleet-token"), "fleet-token-for-the-drain-test").expect("token");
        let dns = std::process::Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args(["--", "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces"])
            .args(["--listen-address=127.0.0.1", "--port=53"])
            .arg(format!("--addn-hosts={}", dir.path().join("hosts").display()))
            .arg(format!("--pid-file={}", dir.path().join("dnsmasq.pid").display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("dnsmasq (dnsmasq-base, images/deps.sh)");
        TwoNodes { netns, dns: Some(dns), dir }
    }

    async fn node(&self, i: usize) -> Daemon {
        let name = ["a", "b"][i];
        let toml = format!(
            r#"
[policy]
max_sandboxes = 2
[network]
interface_prefix = "sbd{name}"
subnet = "100.{octet}.0.0/16"
[fleet]
node_name = "node-{name}"
peers_dns = "peers.drain.test"
port = 7070
dns_server = "127.0.0.1:53"
refresh_ms = 1000
connect_timeout_ms = 1000
token_file = "{token}"
"#,
            octet = 90 + i,
            token = self.dir.path().join("fleet-token").display(),
        );
        let listen = format!("tcp://127.0.0.{}:7070", i + 2);
        within(60, Daemon::start_in_netns(&self.netns, &toml, &["--listen", &listen])).await.expect("a fleet node")
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        if let Some(mut d) = self.dns.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.netns]).stderr(std::process::Stdio::null()).status();
    }
}

/// In a fleet, a draining node's creates go to a peer, and placement passes the draining node by
/// (its NodeStatus says not ready) even when it would have room.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_fleet_creates_go_around_a_draining_node() {
    let net = TwoNodes::new();
    let a = net.node(0).await;
    let mut b = net.node(1).await;
    let (ca, cb) = (a.client().await.expect("client A"), b.client().await.expect("client B"));

    // B holds a sandbox with an exec running, so its drain lasts until the test lets it end.
    let held = within(60, cb.create(process_sandbox("minimal"))).await.expect("create on B");
    assert_eq!(held.node, "node-b");
    let script = "echo started; while [ ! -e /tmp/go ]; do sleep 0.05; done";
    let mut stream = within(30, cb.exec_stream(exec_request(&held.id, ["sh", "-c", script]))).await.expect("ExecStream");
    let mut stdout = String::new();
    while !stdout.contains("started") {
        match within(30, stream.next_event()).await.expect("stream event").and_then(|e| e.event) {
            Some(exec_event::Event::Stdout(b)) => stdout.push_str(&text(&b)),
            other => panic!("before `started`: {other:?}"),
        }
    }
    let drain = drain_command(&b, 120).stderr(std::process::Stdio::piped()).spawn().expect("sandboxd drain");
    assert!(
        sandbox_tests::eventually(30, || async { health(&cb, API).await == ServingStatus::NotServing }).await,
        "B never went NOT_SERVING; log:\n{}",
        b.log()
    );

    // A create that reaches the draining node is placed on its peer.
    let placed = within(60, cb.create(process_sandbox("minimal"))).await.expect("a create through draining B");
    assert_eq!(placed.node, "node-a", "placed on the ready peer: {placed:?}");
    // A fills up (max_sandboxes = 2); B has room but is draining: nobody takes the next one.
    within(60, ca.create(process_sandbox("minimal"))).await.expect("A's second sandbox");
    let err = within(60, ca.create(process_sandbox("minimal"))).await.expect_err("the fleet has no ready room");
    let status = err.status().expect("a gRPC status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("node-b: not ready"), "{status:?}");
    // The held sandbox is still reachable through A while B drains.
    let listed = within(30, ca.get(&held.id)).await.expect("B's sandbox through A while B drains");
    assert_eq!(listed.node, "node-b");

    within(30, cb.write_file(&held.id, "/tmp/go", "go", 0)).await.expect("let the exec end");
    let out = within(60, drain.wait_with_output()).await.expect("sandboxd drain ran");
    assert!(out.status.success(), "sandboxd drain: {}", text(&out.stderr));
    assert!(b.exited().expect("B's state").is_some(), "B has ended; log:\n{}", b.log());
}
