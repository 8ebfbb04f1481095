//! MicroVM-tier cases beyond the shared conformance suite: what a host without QEMU answers,
//! the warm pool, the guest's view of its own isolation (its own kernel, no network), QEMU
//! dying with a daemon killed by SIGKILL, and QEMU uids never shared by two daemons.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use agent_client::proto::{CreateSandboxRequest, Isolation, ResourceLimits, SandboxState};
use agent_client::{exec_request, Client};
use sandbox_tests::{eventually, process_sandbox, Daemon};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn microvm(image: &str) -> CreateSandboxRequest {
    CreateSandboxRequest { isolation: Isolation::Microvm as i32, image: image.into(), limits: Some(ResourceLimits::default()), ..Default::default() }
}

async fn tier_health(client: &Client) -> ServingStatus {
    let mut health = HealthClient::new(client.channel());
    let r = health.check(HealthCheckRequest { service: "sandboxd.tier.microvm".into() }).await.expect("health check");
    ServingStatus::try_from(r.into_inner().status).unwrap_or(ServingStatus::Unknown)
}

#[tokio::test(flavor = "multi_thread")]
async fn without_qemu_create_is_failed_precondition_and_health_says_so() {
    let daemon = Daemon::start_with_config("[microvm]\nqemu = \"/nonexistent/qemu-system-x86_64\"\n").await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let err = client.create(microvm("minimal")).await.expect_err("no QEMU");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    let text = err.to_string();
    assert!(text.contains("MICROVM") && text.contains("/nonexistent/qemu-system-x86_64"), "{text}");
    assert_eq!(tier_health(&client).await, ServingStatus::NotServing);
    // The other tiers are unaffected and nothing was left behind.
    let sb = client.create(process_sandbox("minimal")).await.expect("process tier");
    assert_eq!(sb.state, SandboxState::Running as i32);
    assert_eq!(client.list(Default::default()).await.expect("list").len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_guest_has_its_own_kernel_no_network_and_the_pool_serves_creates() {
    let daemon = Daemon::start_with("", &["--microvm-pool", "1"]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    // Wait for the pool to hold a booted VM (the daemon logs it), then take it.
    let filled = eventually(120, || async { daemon.log().contains("warm pool holds a booted microVM") }).await;
    assert!(filled, "the warm pool never filled:\n{}", daemon.log());
    let sb = client.create(microvm("minimal")).await.expect("create from the pool");
    assert!(daemon.log().contains("microVM taken from the warm pool"), "{}", daemon.log());
    // Its own kernel: its own boot id.
    let boot_id = client.exec(exec_request(&sb.id, ["cat", "/proc/sys/kernel/random/boot_id"])).await.expect("exec");
    assert_eq!((boot_id.exit_code, boot_id.stdout.len()), (0, 37), "{boot_id:?}");
    let host_boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("host boot id");
    assert_ne!(boot_id.stdout, host_boot_id.as_bytes(), "the guest shares the host's kernel");
    // No network device but loopback.
    let ifaces = client.exec(exec_request(&sb.id, ["ls", "/sys/class/net"])).await.expect("exec");
    let names: Vec<String> = String::from_utf8_lossy(&ifaces.stdout).split_whitespace().map(str::to_string).collect();
    assert_eq!(names, ["lo"], "network interfaces in the guest: {ifaces:?}");
    // The hostname is the sandbox id, limits apply inside (the pool VM was booted before them).
    let host = client.exec(exec_request(&sb.id, ["hostname"])).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&host.stdout).trim(), sb.id);
    // A second create while the pool refills boots its own VM and works the same.
    let other = client.create(microvm("minimal")).await.expect("second create");
    let r = client.exec(exec_request(&other.id, ["echo", "ok"])).await.expect("exec");
    assert_eq!(r.stdout, b"ok\n");
    client.destroy(&sb.id).await.expect("destroy");
    client.destroy(&other.id).await.expect("destroy");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_boots_while_the_origin_still_runs_on_the_snapshot() {
    // The snapshot file stays open in the origin's QEMU (as the backing file of its new top)
    // while the fork's QEMU opens it too.
    let daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let origin = client.create(microvm("minimal")).await.expect("create");
    client.write_file(&origin.id, "/workspace/f", b"v1".to_vec(), 0).await.expect("write");
    let snap = client.snapshot(&origin.id, "s").await.expect("snapshot");
    client.write_file(&origin.id, "/workspace/f", b"v2".to_vec(), 0).await.expect("write");
    let fork = client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() }).await.expect("fork");
    let read = |id: String| {
        let client = client.clone();
        async move { client.read_file(&id, "/workspace/f", 0, 0).await.expect("read").content }
    };
    assert_eq!(read(fork.id.clone()).await, b"v1");
    assert_eq!(read(origin.id.clone()).await, b"v2");
    // A second snapshot of the origin chains on the first; the fork is unaffected.
    client.snapshot(&origin.id, "s2").await.expect("second snapshot");
    client.write_file(&fork.id, "/workspace/f", b"fork".to_vec(), 0).await.expect("write");
    assert_eq!(read(origin.id.clone()).await, b"v2");
    assert_eq!(read(fork.id.clone()).await, b"fork");
}

/// A process on the host: pid, uid, argv.
#[derive(Debug)]
struct HostProcess {
    pid: u32,
    uid: u32,
    argv: Vec<String>,
}

/// Every process on the host whose command line mentions `needle` (a daemon's state dir: QEMU
/// runs chrooted into `<state>/microvm/vms/<id>`, and its guard carries QEMU's command line).
fn processes_mentioning(needle: &str) -> Vec<HostProcess> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("reading /proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let argv: Vec<String> = cmdline.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if !argv.iter().any(|a| a.contains(needle)) {
            continue;
        }
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let uid =
            status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().next()).and_then(|u| u.parse().ok()).unwrap_or(u32::MAX);
        found.push(HostProcess { pid, uid, argv });
    }
    found
}

/// The QEMU processes (not their guards) of the daemon with state dir `state`.
fn qemus_of(state: &std::path::Path) -> Vec<HostProcess> {
    let needle = format!("{}/", state.join("microvm").display());
    processes_mentioning(&needle).into_iter().filter(|p| p.argv.first().is_some_and(|a| a.contains("qemu-system"))).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn qemu_dies_with_a_daemon_killed_by_sigkill() {
    let mut daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let sb = client.create(microvm("minimal")).await.expect("create");
    let state = daemon.state_dir();
    let needle = format!("{}/", state.join("microvm").display());
    let qemus = qemus_of(&state);
    assert_eq!(qemus.len(), 1, "one QEMU for one VM: {qemus:?}");
    // The case that used to leak: QEMU changed its uid (-runas), which clears PR_SET_PDEATHSIG.
    assert!(qemus[0].uid >= 400_000, "QEMU runs as its own uid: {qemus:?}");
    let daemon_pid = daemon.pid().expect("daemon pid");
    let ppid =
        |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| s.rsplit(')').next()?.split_whitespace().nth(1)?.parse::<u32>().ok());
    assert_ne!(ppid(qemus[0].pid), Some(daemon_pid), "QEMU runs under its guard, not directly under the daemon");

    daemon.kill9();
    let gone = eventually(5, || async { processes_mentioning(&needle).is_empty() }).await;
    assert!(gone, "5 s after the daemon was killed, its VM processes still run: {:?}", processes_mentioning(&needle));

    // The next start brings the sandbox back over its disk, as before.
    daemon.restart().await.expect("restart");
    let client = daemon.client().await.expect("client");
    let r = client.exec(exec_request(&sb.id, ["echo", "back"])).await.expect("exec after restart");
    assert_eq!(r.stdout, b"back\n", "{r:?}");
    assert_eq!(qemus_of(&state).len(), 1);
    client.destroy(&sb.id).await.expect("destroy");
    assert!(qemus_of(&state).is_empty(), "destroy leaves no QEMU");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_daemons_never_hand_out_the_same_qemu_uid() {
    let (a, b) = tokio::join!(Daemon::start(), Daemon::start());
    let (a, b) = (a.expect("daemon a"), b.expect("daemon b"));
    let (ca, cb) = (a.client().await.expect("client"), b.client().await.expect("client"));
    // Each daemon's first VM: with per-daemon allocation both got uid 400000.
    let (sa, sb) = tokio::join!(ca.create(microvm("minimal")), cb.create(microvm("minimal")));
    let (sa, sb) = (sa.expect("create on a"), sb.expect("create on b"));
    let uids = |d: &Daemon| -> Vec<u32> { qemus_of(&d.state_dir()).iter().map(|p| p.uid).collect() };
    let (ua, ub) = (uids(&a), uids(&b));
    assert_eq!((ua.len(), ub.len()), (1, 1), "one QEMU each: {ua:?} {ub:?}");
    assert_ne!(ua[0], ub[0], "two daemons' QEMUs share uid {}", ua[0]);
    assert!(ua.iter().chain(&ub).all(|&u| u >= 400_000), "{ua:?} {ub:?}");
    // A second VM of b while a's runs: still none shared (other daemons on the host may hold
    // uids too, so which ones is not fixed).
    let again = cb.create(microvm("minimal")).await.expect("second create on b");
    let ub2 = uids(&b);
    assert_eq!(ub2.len(), 2, "{ub2:?}");
    assert!(ub2[0] != ub2[1] && !ub2.contains(&ua[0]), "uids shared: a {ua:?}, b {ub2:?}");
    ca.destroy(&sa.id).await.expect("destroy");
    cb.destroy(&sb.id).await.expect("destroy");
    cb.destroy(&again.id).await.expect("destroy");
}
