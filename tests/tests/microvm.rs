//! MicroVM-tier cases beyond the shared conformance suite: what a host without QEMU answers,
//! the warm pool, the guest's view of its own isolation (its own kernel, no network), QEMU
//! dying with a daemon killed by SIGKILL, QEMU uids never shared by two daemons, and memory
//! snapshots (processes running on after a rollback or in a fork; a corrupt memory file).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

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
    // The pool's VMs get more RAM than the default limits need (a create still takes one).
    let daemon = Daemon::start_with("[microvm]\npool_memory_bytes = 671088640\n", &["--microvm-pool", "1"]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    // Wait for the pool to hold a booted VM (the daemon logs it), then take it.
    let filled = eventually(120, || async { daemon.log().contains("warm pool holds a booted microVM") }).await;
    assert!(filled, "the warm pool never filled:\n{}", daemon.log());
    let sb = client.create(microvm("minimal")).await.expect("create from the pool");
    assert!(daemon.log().contains("microVM taken from the warm pool"), "{}", daemon.log());
    // The refill restores the boot snapshot the pool's first boot took: no second boot.
    let refilled =
        eventually(120, || async { daemon.log().lines().any(|l| l.contains("warm pool holds a booted microVM") && l.contains("restored=true")) }).await;
    assert!(refilled, "the pool was not refilled from its boot snapshot:\n{}", daemon.log());
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
    // A pooled VM (booted with the pool's RAM, not its sandbox's) resumes from its memory too.
    let mark = client.exec(exec_request(&sb.id, ["sh", "-c", "echo kept > /dev/shm/mark"])).await.expect("exec");
    assert_eq!(mark.exit_code, 0, "{mark:?}");
    let snap = client.snapshot(&sb.id, "pooled").await.expect("snapshot of a pooled VM");
    assert!(snap.includes_memory);
    client.rollback(&sb.id, &snap.snapshot_id).await.expect("rollback of a pooled VM");
    let kept = client.exec(exec_request(&sb.id, ["cat", "/dev/shm/mark"])).await.expect("exec");
    assert_eq!(kept.stdout, b"kept\n", "the rollback booted instead of resuming: {kept:?}\n{}", daemon.log());
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

/// Starts, in the background of sandbox `id`, a shell that counts in its memory and publishes
/// "<its pid> <count>" in /dev/shm/count every 100 ms (a tmpfs: only the guest's RAM holds it).
async fn start_counter(client: &Client, id: &str) {
    let script = "i=0; while :; do i=$((i+1)); echo \"$$ $i\" > /dev/shm/count.new && mv /dev/shm/count.new /dev/shm/count; sleep 0.1; done";
    let r = client.exec(exec_request(id, ["sh", "-c", &format!("sh -c '{script}' </dev/null >/dev/null 2>&1 &")])).await.expect("starting the counter");
    assert_eq!(r.exit_code, 0, "{r:?}");
}

/// The counter's pid and count, if it has published one.
async fn counter(client: &Client, id: &str) -> Option<(u32, u64)> {
    let r = client.exec(exec_request(id, ["cat", "/dev/shm/count"])).await.expect("reading the counter");
    if r.exit_code != 0 {
        return None;
    }
    let text = String::from_utf8_lossy(&r.stdout).into_owned();
    let mut words = text.split_whitespace();
    Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
}

/// Waits until the counter of `id` shows more than `past`; returns what it showed then.
async fn count_past(client: &Client, id: &str, past: u64) -> (u32, u64) {
    let last = std::sync::Mutex::new(None);
    let last_ref = &last;
    let passed = eventually(180, || async move {
        let c = counter(client, id).await;
        *last_ref.lock().unwrap() = c;
        c.is_some_and(|(_, n)| n > past)
    })
    .await;
    let seen = *last.lock().unwrap();
    assert!(passed, "the counter of {id} never passed {past} (last seen {seen:?})");
    seen.unwrap()
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs()
}

async fn guest_unix_secs(client: &Client, id: &str) -> u64 {
    let r = client.exec(exec_request(id, ["date", "+%s"])).await.expect("date");
    String::from_utf8_lossy(&r.stdout).trim().parse().expect("seconds")
}

async fn uuid(client: &Client, id: &str) -> String {
    let r = client.exec(exec_request(id, ["cat", "/proc/sys/kernel/random/uuid"])).await.expect("uuid");
    assert_eq!(r.exit_code, 0, "{r:?}");
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

async fn hostname(client: &Client, id: &str) -> String {
    let r = client.exec(exec_request(id, ["hostname"])).await.expect("hostname");
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

fn snapshot_files(daemon: &Daemon, snap: &str) -> (PathBuf, PathBuf) {
    let dir = daemon.state_dir().join("microvm").join("snapshots");
    (dir.join(format!("{snap}.mem")), dir.join(format!("{snap}.vm.json")))
}

/// The guest RAM file of a memory snapshot.
fn snapshot_ram(daemon: &Daemon, snap: &str) -> PathBuf {
    daemon.state_dir().join("microvm").join("snapshots").join(format!("{snap}.ram"))
}

/// The guest RAM files of the daemon's running QEMUs (`mem-path=` of their command lines),
/// with whether QEMU still maps it.
fn ram_files_of(daemon: &Daemon) -> Vec<(PathBuf, bool)> {
    qemus_of(&daemon.state_dir())
        .iter()
        .flat_map(|q| {
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", q.pid)).unwrap_or_default();
            q.argv
                .iter()
                .filter_map(|a| a.split(',').find_map(|o| o.strip_prefix("mem-path=")).map(PathBuf::from))
                .map(|f| {
                    let mapped = maps.contains(&format!("{} (deleted)", f.display()));
                    (f, mapped)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_memory_snapshot_resumes_running_processes_on_rollback_and_in_a_fork() {
    let daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let sb = client.create(microvm("minimal")).await.expect("create");
    client.write_file(&sb.id, "/workspace/f", b"v1".to_vec(), 0).await.expect("write");
    start_counter(&client, &sb.id).await;
    let (pid, before) = count_past(&client, &sb.id, 2).await;

    // The default snapshot of a microVM holds its memory: a file beside the disk, counted in
    // the snapshot's size.
    let snap = client.snapshot(&sb.id, "live").await.expect("snapshot");
    assert!(snap.includes_memory, "{snap:?}");
    let (mem, shape) = snapshot_files(&daemon, &snap.snapshot_id);
    let mem_bytes = std::fs::metadata(&mem).expect("the memory file").blocks() * 512;
    assert!(shape.is_file() && mem_bytes > 0 && snap.size_bytes >= mem_bytes, "{} bytes of memory, snapshot {snap:?}", mem_bytes);
    // The guest RAM is a file of its own (the device state alone is small), counted too.
    let ram = snapshot_ram(&daemon, &snap.snapshot_id);
    let ram_bytes = std::fs::metadata(&ram).expect("the snapshot's RAM file").blocks() * 512;
    assert!(ram_bytes > mem_bytes && snap.size_bytes >= mem_bytes + ram_bytes, "{ram_bytes} bytes of RAM, {mem_bytes} of state, snapshot {snap:?}");
    let (_, after) = count_past(&client, &sb.id, 0).await;
    assert!(after >= before);
    // The origin counts on, well past the snapshot, and its disk changes.
    let (_, later) = count_past(&client, &sb.id, after + 50).await;
    client.write_file(&sb.id, "/workspace/f", b"v2".to_vec(), 0).await.expect("write");

    // Rollback: the same process runs on, from the count it had at the snapshot.
    let host_rollback = unix_secs();
    let rolled = client.rollback(&sb.id, &snap.snapshot_id).await.expect("rollback");
    assert_eq!(rolled.state, SandboxState::Running as i32);
    let (pid_back, resumed) = count_past(&client, &sb.id, 0).await;
    assert_eq!(pid_back, pid, "another process counts after the rollback");
    assert!(
        resumed >= before && resumed < later,
        "after the rollback the count is {resumed}: at the snapshot it was in {before}..={after}, before the rollback {later}"
    );
    count_past(&client, &sb.id, resumed).await;
    assert_eq!(client.read_file(&sb.id, "/workspace/f", 0, 0).await.expect("read").content, b"v1");
    assert_eq!(hostname(&client, &sb.id).await, sb.id);
    let guest_now = guest_unix_secs(&client, &sb.id).await;
    assert!(guest_now + 1 >= host_rollback, "after the rollback the guest's clock says {guest_now}, the host said {host_rollback} before it");

    // A fork has the process too, with its own identity, and goes its own way.
    let fork = client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() }).await.expect("fork");
    let (pid_fork, forked) = count_past(&client, &fork.id, 0).await;
    assert_eq!(pid_fork, pid);
    assert!(forked >= before && forked < later, "the fork's count is {forked}: at the snapshot it was in {before}..={after}");
    assert_eq!(hostname(&client, &fork.id).await, fork.id, "the fork keeps the origin's hostname");
    assert_eq!(client.read_file(&fork.id, "/workspace/f", 0, 0).await.expect("read").content, b"v1");
    client.write_file(&fork.id, "/workspace/f", b"fork".to_vec(), 0).await.expect("write");
    // A second fork of the same memory is a machine of its own: its name, its random stream,
    // and a clock stepped to the host's (the snapshot's clock is 5 s and more behind by now).
    let host_before = unix_secs();
    let fork2 = client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() }).await.expect("second fork");
    assert_eq!(hostname(&client, &fork2.id).await, fork2.id);
    let guest_now = guest_unix_secs(&client, &fork2.id).await;
    assert!(guest_now + 1 >= host_before, "the fork's clock says {guest_now}, the host said {host_before} before the fork");
    let (u1, u2) = (uuid(&client, &fork.id).await, uuid(&client, &fork2.id).await);
    assert_ne!(u1, u2, "two forks of one memory snapshot share their random stream");
    let machine_id = |id: String| {
        let client = client.clone();
        async move { client.read_file(&id, "/etc/machine-id", 0, 0).await.expect("machine-id").content }
    };
    let (m0, m1, m2) = (machine_id(sb.id.clone()).await, machine_id(fork.id.clone()).await, machine_id(fork2.id.clone()).await);
    assert_eq!(m1.len(), 33, "{:?}", String::from_utf8_lossy(&m1));
    assert!(m0 != m1 && m1 != m2 && m0 != m2, "forks share a machine-id: {m0:?} {m1:?} {m2:?}");
    // Every VM has its own RAM file, mapped by its QEMU alone: its name is gone once the guest
    // runs, so the RAM goes with QEMU however the daemon ends. (The VM the rollback replaced is
    // stopped after the rollback's answer: waited for, it leaves three.)
    assert!(eventually(30, || async { ram_files_of(&daemon).len() == 3 }).await, "{:?}", ram_files_of(&daemon));
    let live_ram = ram_files_of(&daemon);
    assert_eq!(live_ram.len(), 3, "{live_ram:?}");
    assert!(live_ram.iter().all(|(f, mapped)| *mapped && !f.exists()), "{live_ram:?}");
    let mut unique: Vec<&PathBuf> = live_ram.iter().map(|(f, _)| f).collect();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 3, "{live_ram:?}");
    client.destroy(&fork2.id).await.expect("destroy the second fork");
    let kill = client.exec(exec_request(&fork.id, ["kill", &pid.to_string()])).await.expect("kill in the fork");
    assert_eq!(kill.exit_code, 0, "{kill:?}");
    let (_, origin_now) = count_past(&client, &sb.id, resumed).await;
    count_past(&client, &sb.id, origin_now).await;
    assert_eq!(client.read_file(&sb.id, "/workspace/f", 0, 0).await.expect("read").content, b"v1");

    // Without memory: today's semantics, a fresh boot over the snapshot's disk.
    client.write_file(&sb.id, "/workspace/f", b"v3".to_vec(), 0).await.expect("write");
    let disk_only = client.snapshot_with(&sb.id, "disk", Some(false)).await.expect("snapshot without memory");
    assert!(!disk_only.includes_memory, "{disk_only:?}");
    assert!(!snapshot_files(&daemon, &disk_only.snapshot_id).0.exists(), "a snapshot without memory has no memory file");
    client.write_file(&sb.id, "/workspace/f", b"v4".to_vec(), 0).await.expect("write");
    client.rollback(&sb.id, &disk_only.snapshot_id).await.expect("rollback without memory");
    assert_eq!(client.read_file(&sb.id, "/workspace/f", 0, 0).await.expect("read").content, b"v3");
    assert_eq!(counter(&client, &sb.id).await, None, "a rollback without memory boots: no process of before runs");

    // Another tier has no memory to snapshot.
    let process = client.create(process_sandbox("minimal")).await.expect("process sandbox");
    let err = client.snapshot_with(&process.id, "", Some(true)).await.expect_err("memory of a process sandbox");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(!client.snapshot(&process.id, "").await.expect("default snapshot").includes_memory);

    // Deleting the snapshot deletes its memory file.
    client.destroy(&fork.id).await.expect("destroy the fork");
    client.delete_snapshot(&snap.snapshot_id).await.expect("delete");
    assert!(!mem.exists() && !shape.exists() && !ram.exists(), "the memory snapshot's files outlive it");
    client.destroy(&sb.id).await.expect("destroy");
    // The VMs' RAM goes with them.
    assert!(ram_files_of(&daemon).is_empty());
    let left: Vec<&PathBuf> = live_ram.iter().map(|(f, _)| f).filter(|f| f.exists()).collect();
    assert!(left.is_empty(), "RAM files of destroyed VMs: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_memory_snapshot_is_refused_and_the_sandbox_runs_on() {
    let daemon = Daemon::start().await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let sb = client.create(microvm("minimal")).await.expect("create");
    start_counter(&client, &sb.id).await;
    let (pid, _) = count_past(&client, &sb.id, 2).await;
    let snap = client.snapshot(&sb.id, "s").await.expect("snapshot");
    let (mem, _) = snapshot_files(&daemon, &snap.snapshot_id);
    let len = std::fs::metadata(&mem).expect("memory file").len();
    std::fs::OpenOptions::new().write(true).open(&mem).and_then(|f| f.set_len(len / 2)).expect("truncating the memory file");
    let (_, before) = count_past(&client, &sb.id, 0).await;

    // The time limits only keep a hang from stalling the suite.
    let limit = std::time::Duration::from_secs(300);
    let err = tokio::time::timeout(limit, client.rollback(&sb.id, &snap.snapshot_id)).await.expect("the rollback hung").expect_err("a truncated memory file");
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    let text = err.to_string();
    assert!(text.contains("cannot be restored") && text.contains(&snap.snapshot_id), "{text}");
    // Nothing changed: the sandbox runs, its process counts on.
    let info = client.get(&sb.id).await.expect("get");
    assert_eq!(info.state, SandboxState::Running as i32, "{info:?}");
    let (pid_now, _) = count_past(&client, &sb.id, before).await;
    assert_eq!(pid_now, pid);

    let fork = tokio::time::timeout(limit, client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() }))
        .await
        .expect("the fork hung");
    let err = fork.expect_err("a fork of a truncated memory file");
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    assert_eq!(client.list(Default::default()).await.expect("list").len(), 1, "the failed fork is left over");
    let vms: Vec<String> = std::fs::read_dir(daemon.state_dir().join("microvm").join("vms"))
        .expect("vms dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(vms, std::slice::from_ref(&sb.id), "VM directories left behind");

    // A RAM file cut short is refused as well, before any QEMU starts over it.
    let snap = client.snapshot(&sb.id, "s2").await.expect("second snapshot");
    std::fs::OpenOptions::new().write(true).open(snapshot_ram(&daemon, &snap.snapshot_id)).and_then(|f| f.set_len(4096)).expect("truncating the RAM file");
    let err = client.rollback(&sb.id, &snap.snapshot_id).await.expect_err("a truncated RAM file");
    assert_eq!(err.code(), Code::DataLoss, "{err}");
    assert!(err.to_string().contains("RAM"), "{err}");
    let (pid_now, _) = count_past(&client, &sb.id, 0).await;
    assert_eq!(pid_now, pid);
    client.destroy(&sb.id).await.expect("destroy");
}

/// Boot once per image: the first create of `minimal` boots and snapshots the fresh VM; the
/// next creates of the same shape restore that snapshot instead of booting, each with a
/// hostname, machine-id, random stream and clock of its own and none of the first sandbox's
/// later files; a create of another shape (more RAM) boots and snapshots its own, and with
/// `boot_snapshots = 1` the older snapshot is evicted, its memory file removed.
#[tokio::test(flavor = "multi_thread")]
async fn creates_after_the_first_restore_the_images_boot_snapshot() {
    let daemon = Daemon::start_with_config("[microvm]\nboot_snapshots = 1\n").await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let taken = |log: &str| log.matches("boot snapshot taken").count();
    let restored = |log: &str| log.matches("restored from its image's boot snapshot").count();

    let a = client.create(microvm("minimal")).await.expect("first create");
    assert_eq!((taken(&daemon.log()), restored(&daemon.log())), (1, 0), "{}", daemon.log());
    let log = daemon.log();
    let first = log
        .lines()
        .find(|l| l.contains("boot snapshot taken"))
        .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("snapshot=")))
        .expect("the boot snapshot's id in the log")
        .to_string();
    let (first_memory, _) = snapshot_files(&daemon, &first);
    assert!(first_memory.is_file(), "{} missing", first_memory.display());
    client.write_file(&a.id, "/workspace/a-only", b"a".to_vec(), 0o644).await.expect("write in a");

    let b = client.create(microvm("minimal")).await.expect("second create");
    assert_eq!((taken(&daemon.log()), restored(&daemon.log())), (1, 1), "the second create did not restore:\n{}", daemon.log());
    let c = client.create(microvm("minimal")).await.expect("third create");
    assert_eq!(restored(&daemon.log()), 2, "{}", daemon.log());

    // Each its own identity.
    let ids = [&a.id, &b.id, &c.id];
    let mut hostnames = Vec::new();
    let mut uuids = Vec::new();
    let mut machine_ids = Vec::new();
    for id in ids {
        hostnames.push(hostname(&client, id).await);
        uuids.push(uuid(&client, id).await);
        let r = client.exec(exec_request(id, ["cat", "/etc/machine-id"])).await.expect("machine-id");
        machine_ids.push(String::from_utf8_lossy(&r.stdout).trim().to_string());
    }
    for list in [&hostnames, &uuids, &machine_ids] {
        let mut unique = list.to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 3, "shared between restored VMs: {list:?}");
    }
    // Not the first sandbox's files written after its boot snapshot; a clock of now.
    let r = client.exec(exec_request(&b.id, ["ls", "/workspace"])).await.expect("ls");
    assert!(!String::from_utf8_lossy(&r.stdout).contains("a-only"), "{r:?}");
    let skew = guest_unix_secs(&client, &b.id).await.abs_diff(unix_secs());
    assert!(skew <= 5, "the restored guest's clock is {skew} s off");
    client.write_file(&b.id, "/workspace/b", b"bee".to_vec(), 0o600).await.expect("write in b");
    assert_eq!(client.read_file(&b.id, "/workspace/b", 0, 0).await.expect("read in b").content, b"bee");

    // The snapshot outlives the sandbox it was taken from.
    client.destroy(&a.id).await.expect("destroy a");
    let d = client.create(microvm("minimal")).await.expect("fourth create");
    assert_eq!(restored(&daemon.log()), 3, "{}", daemon.log());
    assert!(!hostname(&client, &d.id).await.is_empty());
    // The snapshot was saved configured for the first sandbox; a restore with other limits
    // gets its own (the agent skips only what is already so), one with the same keeps them.
    let own = CreateSandboxRequest { limits: Some(ResourceLimits { max_pids: 77, ..Default::default() }), ..microvm("minimal") };
    let e = client.create(own).await.expect("a create with its own pids limit");
    assert_eq!(restored(&daemon.log()), 4, "{}", daemon.log());
    let pids_max = |id: String| {
        let client = client.clone();
        async move {
            let r = client.exec(exec_request(&id, ["cat", "/sys/fs/cgroup/pids.max"])).await.expect("pids.max");
            String::from_utf8_lossy(&r.stdout).trim().to_string()
        }
    };
    assert_eq!(pids_max(e.id.clone()).await, "77");
    assert_eq!(pids_max(d.id.clone()).await, pids_max(b.id.clone()).await, "same limits, same cgroup");
    assert_ne!(pids_max(d.id.clone()).await, "77");
    // No module loader in the guest: every module it needs was loaded at boot, and a name the
    // sandbox asks for (an interface, a socket family) makes the kernel run nothing.
    let r = client.exec(exec_request(&e.id, ["cat", "/proc/sys/kernel/modprobe"])).await.expect("modprobe sysctl");
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "", "{r:?}");
    client.destroy(&e.id).await.expect("destroy e");

    // Another machine shape boots and gets a snapshot of its own.
    let bigger = CreateSandboxRequest { limits: Some(ResourceLimits { memory_bytes: 768 << 20, ..Default::default() }), ..microvm("minimal") };
    client.create(bigger).await.expect("a bigger VM");
    assert_eq!((taken(&daemon.log()), restored(&daemon.log())), (2, 4), "{}", daemon.log());
    // One is kept: the older (least recently used) is evicted with its memory file, and the
    // next create of its shape boots again.
    assert!(daemon.log().contains("boot snapshots past [microvm] boot_snapshots evicted"), "{}", daemon.log());
    assert!(!first_memory.exists(), "the evicted snapshot's memory file {} is still there", first_memory.display());
    client.create(microvm("minimal")).await.expect("a create after the eviction");
    assert_eq!((taken(&daemon.log()), restored(&daemon.log())), (3, 4), "{}", daemon.log());
}
