//! MicroVM-tier cases beyond the shared conformance suite: what a host without QEMU answers,
//! the warm pool, and the guest's view of its own isolation (its own kernel, no network).

use agent_client::proto::{CreateSandboxRequest, Isolation, ResourceLimits, SandboxState};
use agent_client::{exec_request, Client};
use sandbox_tests::Daemon;
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
    let sb = client.create(CreateSandboxRequest { isolation: Isolation::Process as i32, image: "minimal".into(), ..Default::default() }).await.expect("process tier");
    assert_eq!(sb.state, SandboxState::Running as i32);
    assert_eq!(client.list(Default::default()).await.expect("list").len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_guest_has_its_own_kernel_no_network_and_the_pool_serves_creates() {
    let daemon = Daemon::start_with("", &["--microvm-pool", "1"]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    // Wait for the pool to hold a booted VM (the daemon logs it), then take it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !daemon.log().contains("warm pool holds a booted microVM") {
        assert!(std::time::Instant::now() < deadline, "the warm pool never filled:\n{}", daemon.log());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
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
