//! End to end: admission and create-time validation — what keeps one sandbox or tenant from
//! taking what the others were promised (disk of the storage pool, exec slots and descriptors,
//! the daemon's memory for file writes), and what refuses a sandbox in which nothing could run.
//!
//! Each test starts its own daemon with the configuration it is about.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, ExecRequest, ExecStatus, ResourceLimits};
use sandbox_tests::{eventually, proc_status_bytes, process_sandbox, within, Harness};
use tonic::Code;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// The creates of this suite: process tier, image `minimal`, a refusal returned to check.
trait Creates {
    async fn create(&self, limits: ResourceLimits) -> Result<String, agent_client::Error>;
    async fn create_disk(&self, disk_bytes: u64) -> Result<String, agent_client::Error>;
}

impl Creates for Harness {
    async fn create(&self, limits: ResourceLimits) -> Result<String, agent_client::Error> {
        let request = CreateSandboxRequest { limits: Some(limits), ..process_sandbox("minimal") };
        within(120, self.client.create(request)).await.map(|s| s.id)
    }

    async fn create_disk(&self, disk_bytes: u64) -> Result<String, agent_client::Error> {
        self.create(ResourceLimits { disk_bytes, ..Default::default() }).await
    }
}

/// Asserts `result` is an error with `code` whose message mentions every one of `words`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, agent_client::Error>, code: Code, words: &[&str]) {
    let err = result.expect_err("the request must be refused");
    assert_eq!(err.code(), code, "{err}");
    for w in words {
        assert!(err.to_string().contains(w), "{w:?} not in: {err}");
    }
}

/// A `/proc/<pid>/status` field in bytes (`VmHWM`, `VmRSS`); fails the test when unreadable.
fn daemon_status_bytes(pid: u32, field: &str) -> u64 {
    proc_status_bytes(pid, field).unwrap_or_else(|| panic!("no {field} readable in /proc/{pid}/status"))
}

// ---------------------------------------------------------------------------------------------
// Disk.

#[tokio::test(flavor = "multi_thread")]
async fn the_storage_pool_is_never_promised_twice() {
    // Strict promises (an operator's choice; the default overcommits): every promised byte exists.
    let mut h = Harness::start_with("[admission]\ndisk_overcommit = 1.0\n", &["--pool-size-bytes", &(8 * GIB).to_string()]).await;
    let big = h.create_disk(6 * GIB).await.expect("6 GiB of an empty 8 GiB pool");
    assert_refused(h.create_disk(3 * GIB).await, Code::ResourceExhausted, &["storage pool full", "6 GiB of 8 GiB", "disk_bytes 3 GiB", "pool_size_bytes"]);
    assert_refused(h.create_disk(64 * GIB).await, Code::ResourceExhausted, &["pool_size_bytes"]);
    let fits = h.create_disk(2 * GIB).await.expect("2 GiB fits exactly");
    assert_refused(h.create(ResourceLimits::default()).await, Code::ResourceExhausted, &["8 GiB of 8 GiB", "pool_size_bytes"]);

    // Destroying gives the room back; a fork is promised its disk_bytes like any create.
    h.client.destroy(&big).await.expect("destroy");
    let snap = h.client.snapshot(&fits, "base").await.expect("snapshot");
    let fork_request = |disk_bytes| CreateSandboxRequest {
        from_snapshot_id: snap.snapshot_id.clone(),
        limits: Some(ResourceLimits { disk_bytes, ..Default::default() }),
        ..Default::default()
    };
    assert_refused(within(120, h.client.create(fork_request(7 * GIB))).await, Code::ResourceExhausted, &["2 GiB of 8 GiB", "pool_size_bytes"]);
    let fork = within(120, h.client.create(fork_request(2 * GIB))).await.expect("fork");
    assert_eq!(fork.limits.as_ref().map(|l| l.disk_bytes), Some(2 * GIB));
    // 4 GiB left: of eight concurrent 1 GiB creates exactly four get in.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let client = h.client.clone();
        tasks.spawn(async move {
            client.create(CreateSandboxRequest { limits: Some(ResourceLimits { disk_bytes: GIB, ..Default::default() }), ..process_sandbox("minimal") }).await
        });
    }
    let (mut admitted, mut refused) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            Ok(_) => admitted += 1,
            Err(e) if e.code() == Code::ResourceExhausted => refused += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!((admitted, refused), (4, 4), "concurrent creates never overcommit the pool");

    // The sandboxes re-adopted after a restart are promised their disk as before.
    h.daemon.restart().await.expect("restart");
    h.client = h.daemon.client().await.expect("client");
    assert!(h.daemon.log().contains("storage pool admission"), "the start log names the pools");
    assert_refused(h.create_disk(16 * MIB).await, Code::ResourceExhausted, &["8 GiB of 8 GiB", "pool_size_bytes"]);
    h.client.destroy(&fork.id).await.expect("destroy the fork");
    h.create_disk(2 * GIB).await.expect("room again after a destroy");
}

// ---------------------------------------------------------------------------------------------
// Execs.

#[tokio::test(flavor = "multi_thread")]
async fn background_execs_are_capped_per_sandbox_and_tenant() {
    let toml = "[policy]\nmax_background_execs_per_sandbox = 4\nmax_background_execs_per_tenant = 6\n";
    let h = Harness::start_with(toml, &[]).await;
    let (a, b) = (h.create(ResourceLimits::default()).await.expect("a"), h.create(ResourceLimits::default()).await.expect("b"));
    let background = |id: &str| ExecRequest { background: true, ..exec_request(id, ["sleep", "300"]) };
    let mut in_a = Vec::new();
    for _ in 0..4 {
        let r = within(60, h.client.exec(background(&a))).await.expect("background exec");
        assert_eq!(r.status, ExecStatus::Running as i32, "{r:?}");
        in_a.push(r.exec_id);
    }
    assert_refused(within(60, h.client.exec(background(&a))).await, Code::ResourceExhausted, &["policy.max_background_execs_per_sandbox", "(4)"]);
    // Foreground execs still run, in this sandbox and in another.
    for id in [&a, &b] {
        let r = within(60, h.client.exec(exec_request(id, ["sh", "-c", "echo ok"]))).await.expect("foreground exec");
        assert_eq!((r.status, r.stdout.as_slice()), (ExecStatus::Exited as i32, &b"ok\n"[..]), "{r:?}");
    }
    // The tenant's cap spans its sandboxes.
    for _ in 0..2 {
        within(60, h.client.exec(background(&b))).await.expect("background exec in b");
    }
    assert_refused(within(60, h.client.exec(background(&b))).await, Code::ResourceExhausted, &["policy.max_background_execs_per_tenant", "(6)"]);
    // A killed exec frees its slot once it has ended.
    h.client.signal_exec(&in_a[0], 9).await.expect("kill one");
    let ended = within(60, h.client.get_exec(&in_a[0], true)).await.expect("wait for it");
    assert_eq!(ended.status, ExecStatus::Signaled as i32, "{ended:?}");
    let r = within(60, h.client.exec(background(&a))).await.expect("a slot is free again");
    assert_eq!(r.status, ExecStatus::Running as i32);
    let quick = ExecRequest { background: true, ..exec_request(&b, ["true"]) };
    assert_refused(within(60, h.client.exec(quick.clone())).await, Code::ResourceExhausted, &["policy.max_background_execs_per_tenant"]);
    // So does one that ends on its own.
    h.client.signal_exec(&in_a[1], 9).await.expect("kill another");
    within(60, h.client.get_exec(&in_a[1], true)).await.expect("wait for it");
    let r = within(60, h.client.exec(quick)).await.expect("room for one");
    let ended = within(60, h.client.get_exec(&r.exec_id, true)).await.expect("wait for `true`");
    assert_eq!(ended.status, ExecStatus::Exited as i32, "{ended:?}");
    within(60, h.client.exec(background(&b))).await.expect("the ended exec's slot is free");
    assert_refused(within(60, h.client.exec(background(&b))).await, Code::ResourceExhausted, &["policy.max_background_execs_per_tenant"]);

    // The daemon raised its soft open-file limit to the hard one and said how far it goes.
    let pid = h.daemon.pid().expect("pid");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("Max open files");
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.get(3), fields.get(4), "soft = hard: {line}");
    assert!(h.daemon.log().contains("open-file limit raised"), "the budget is logged");
}

#[tokio::test(flavor = "multi_thread")]
async fn running_execs_are_capped_per_sandbox() {
    let h = Harness::start_with("[policy]\nmax_running_execs_per_sandbox = 3\n", &[]).await;
    let (a, b) = (h.create(ResourceLimits::default()).await.expect("a"), h.create(ResourceLimits::default()).await.expect("b"));
    let mut slow = Vec::new();
    for _ in 0..3 {
        let client = h.client.clone();
        let a = a.clone();
        slow.push(tokio::spawn(async move { client.exec(exec_request(&a, ["sleep", "600"])).await }));
    }
    // Wait until the three run: each is recorded RUNNING once it holds its slot.
    let running = || async {
        let execs = h.client.list_execs(&a, 0).await.expect("list execs");
        execs.into_iter().filter(|e| e.status == ExecStatus::Running as i32).map(|e| e.exec_id).collect::<Vec<_>>()
    };
    assert!(eventually(60, || async { running().await.len() == 3 }).await, "the three execs never all ran");
    assert_refused(within(60, h.client.exec(exec_request(&a, ["true"]))).await, Code::ResourceExhausted, &["policy.max_running_execs_per_sandbox", "(3)"]);
    let r = within(60, h.client.exec(exec_request(&b, ["true"]))).await.expect("another sandbox");
    assert_eq!(r.status, ExecStatus::Exited as i32);
    // End them (no waiting for a clock): each frees its slot once it has ended.
    for id in running().await {
        h.client.signal_exec(&id, 9).await.expect("kill");
    }
    for t in slow {
        let r = within(60, t).await.expect("task").expect("slow exec");
        assert_eq!(r.status, ExecStatus::Signaled as i32, "{r:?}");
    }
    let r = within(60, h.client.exec(exec_request(&a, ["true"]))).await.expect("the slots are free once they ended");
    assert_eq!(r.status, ExecStatus::Exited as i32);
}

// ---------------------------------------------------------------------------------------------
// Create-time validation.

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_that_could_not_run_anything_is_refused_at_create() {
    let h = Harness::start_with("", &[]).await;
    assert_refused(h.create_disk(1).await, Code::InvalidArgument, &["limits.disk_bytes"]);
    assert_refused(h.create(ResourceLimits { max_pids: 1, ..Default::default() }).await, Code::InvalidArgument, &["limits.max_pids"]);
    assert_refused(h.create(ResourceLimits { memory_bytes: 1 << 20, ..Default::default() }).await, Code::InvalidArgument, &["limits.memory_bytes"]);
    // 300 KiB of env: in small variables, and in one.
    let many: HashMap<String, String> = (0..3000).map(|i| (format!("V{i:05}"), "x".repeat(96))).collect();
    let one: HashMap<String, String> = HashMap::from([("BIG".to_string(), "x".repeat(300 << 10))]);
    for env in [many, one] {
        let request = CreateSandboxRequest { env, ..process_sandbox("minimal") };
        assert_refused(within(60, h.client.create(request)).await, Code::InvalidArgument, &["env"]);
    }

    // At the floors a sandbox runs a shell pipeline and keeps its files.
    let id = h.create(ResourceLimits { disk_bytes: 16 * MIB, max_pids: 8, ..Default::default() }).await.expect("the minimums are accepted");
    let r = within(60, h.client.exec(exec_request(&id, ["sh", "-c", "echo hello | cat | wc -c > n; cat n"]))).await.expect("exec");
    assert_eq!((r.status, String::from_utf8_lossy(&r.stdout).trim()), (ExecStatus::Exited as i32, "6"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_requests_name_their_field_and_are_never_internal() {
    let h = Harness::start_with("", &[]).await;
    let long = "x".repeat(300);
    let create = |f: &dyn Fn(&mut CreateSandboxRequest)| {
        let mut r = process_sandbox("minimal");
        f(&mut r);
        r
    };
    let cases: Vec<(&str, CreateSandboxRequest)> = vec![
        ("image", create(&|r| r.image = "../../etc".into())),
        ("image", create(&|r| r.image = long.clone())),
        ("image", create(&|r| r.image = "a/b".into())),
        ("image", create(&|r| r.image = ".hidden".into())),
        ("workdir", create(&|r| r.workdir = "relative".into())),
        ("workdir", create(&|r| r.workdir = format!("/{long}"))),
        ("workdir", create(&|r| r.workdir = format!("/a{}", "/b".repeat(3000)))),
        ("workdir", create(&|r| r.workdir = "/a/../b".into())),
        ("workdir", create(&|r| r.workdir = "/a\0b".into())),
        ("workdir", create(&|r| r.workdir = "/etc/passwd".into())),
        ("workdir", create(&|r| r.workdir = "/etc/passwd/x".into())),
        ("workdir", create(&|r| r.workdir = "/dev/null/x".into())),
        ("workdir", create(&|r| r.workdir = "/proc/self".into())),
        ("workdir", create(&|r| r.workdir = "/sys".into())),
        ("labels", create(&|r| r.labels = HashMap::from([(long.clone(), "v".into())]))),
        ("labels", create(&|r| r.labels = HashMap::from([(String::new(), "v".into())]))),
        ("labels", create(&|r| r.labels = HashMap::from([("k".into(), "v".repeat(2000))]))),
        ("labels", create(&|r| r.labels = (0..100).map(|i| (format!("k{i}"), "v".into())).collect())),
        ("env", create(&|r| r.env = HashMap::from([("A=B".into(), "v".into())]))),
        ("env", create(&|r| r.env = HashMap::from([(String::new(), "v".into())]))),
        ("env", create(&|r| r.env = HashMap::from([("A".into(), "v\0".into())]))),
        ("limits.disk_bytes", create(&|r| r.limits = Some(ResourceLimits { disk_bytes: 15 * MIB, ..Default::default() }))),
        ("limits.disk_bytes", create(&|r| r.limits = Some(ResourceLimits { disk_bytes: u64::MAX, ..Default::default() }))),
        ("limits.max_pids", create(&|r| r.limits = Some(ResourceLimits { max_pids: 7, ..Default::default() }))),
        ("limits.max_pids", create(&|r| r.limits = Some(ResourceLimits { max_pids: u32::MAX, ..Default::default() }))),
        ("limits.cpu_millicores", create(&|r| r.limits = Some(ResourceLimits { cpu_millicores: u32::MAX, ..Default::default() }))),
        ("limits.exec_timeout_ms", create(&|r| r.limits = Some(ResourceLimits { exec_timeout_ms: u64::MAX, ..Default::default() }))),
        ("isolation", create(&|r| r.isolation = 99)),
    ];
    for (field, request) in cases {
        let err = within(60, h.client.create(request)).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(err.to_string().contains(field), "{field} not named: {err}");
    }
    // Odd but valid values are served, or refused for what they are: never INTERNAL.
    let odd: Vec<CreateSandboxRequest> = vec![
        create(&|r| r.workdir = "/".into()),
        create(&|r| r.workdir = "/devices".into()),
        create(&|r| r.workdir = "/with space/and,comma:colon".into()),
        create(&|r| r.limits = Some(ResourceLimits { cpu_millicores: 1, exec_timeout_ms: 1, ..Default::default() })),
        create(&|r| r.ttl_seconds = u32::MAX),
        create(&|r| r.from_snapshot_id = "sn-doesnotexist".into()),
        create(&|r| r.from_snapshot_id = long.clone()),
        create(&|r| r.image = "doesnotexist".into()),
    ];
    for request in odd {
        let shown = format!(
            "workdir={:?} limits={:?} ttl={} from={:?} image={:?}",
            request.workdir, request.limits, request.ttl_seconds, request.from_snapshot_id, request.image
        );
        match within(120, h.client.create(request)).await {
            Ok(sb) => h.client.destroy(&sb.id).await.expect("destroy"),
            Err(e) => assert!(!matches!(e.code(), Code::Internal | Code::Unknown), "{shown}: {e}"),
        }
    }

    let id = h.create(ResourceLimits::default()).await.expect("create");
    let exec = |f: &dyn Fn(&mut ExecRequest)| {
        let mut r = exec_request(&id, ["true"]);
        f(&mut r);
        r
    };
    let cases: Vec<(&str, ExecRequest)> = vec![
        ("argv", exec(&|r| r.argv = vec![])),
        ("argv", exec(&|r| r.argv = vec![String::new()])),
        ("argv", exec(&|r| r.argv = vec!["a\0b".into()])),
        ("argv", exec(&|r| r.argv = vec!["echo".into(), "x".repeat(200 << 10)])),
        ("argv", exec(&|r| r.argv = std::iter::once("echo".to_string()).chain((0..3000).map(|_| "x".repeat(100))).collect())),
        ("env", exec(&|r| r.env = (0..3000).map(|i| (format!("V{i}"), "x".repeat(100))).collect())),
        ("env", exec(&|r| r.env = HashMap::from([("A=B".into(), "v".into())]))),
        ("workdir", exec(&|r| r.workdir = "relative".into())),
        ("workdir", exec(&|r| r.workdir = format!("/{long}"))),
        ("timeout_ms", exec(&|r| r.timeout_ms = u64::MAX)),
        ("max_output_bytes", exec(&|r| r.max_output_bytes = u64::MAX)),
        ("idempotency_key", exec(&|r| r.idempotency_key = "k".repeat(1000))),
    ];
    for (field, request) in cases {
        let err = within(60, h.client.exec(request)).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(err.to_string().contains(field), "{field} not named: {err}");
    }
    // Valid requests that cannot start are an ExecResult, not a gRPC error.
    for request in [exec(&|r| r.workdir = "/etc/passwd".into()), exec(&|r| r.argv = vec!["/nonexistent".into()]), exec(&|r| r.workdir = "/proc/1/x".into())] {
        let r = within(60, h.client.exec(request)).await.expect("an ExecResult");
        assert_eq!(r.status, ExecStatus::SpawnFailed as i32, "{r:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Memory of file writes.

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_large_writes_stay_within_the_configured_memory_bound() {
    const WRITERS: usize = 8;
    const SIZE: u64 = 32 * MIB;
    const MAX_CONCURRENT_WRITES: u64 = 2;
    let h = Harness::start_with(&format!("[files]\nmax_concurrent_writes = {MAX_CONCURRENT_WRITES}\n"), &[]).await;
    let id = h.create_disk(GIB).await.expect("create");
    let pid = h.daemon.pid().expect("pid");
    // Warm up the write path once, so the baseline includes what any write costs once.
    h.client.write_file(&id, "/workspace/warmup", vec![1u8; MIB as usize], 0).await.expect("warm-up write");
    let before = daemon_status_bytes(pid, "VmHWM:");

    // One connection per writer: the hardest case, as each connection has its own flow-control
    // window and nothing but the daemon's limit holds the contents back.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..WRITERS {
        let client = h.daemon.client().await.expect("client");
        let id = id.clone();
        tasks.spawn(async move {
            let content = vec![b'a' + i as u8; SIZE as usize];
            (i, client.write_file(&id, format!("/workspace/big{i}"), content, 0).await)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        let (i, written) = joined.expect("task");
        assert_eq!(written.unwrap_or_else(|e| panic!("write {i}: {e}")), SIZE, "write {i}");
    }
    let after = daemon_status_bytes(pid, "VmHWM:");

    // Each admitted write holds its content about three times at most (the decoded message,
    // tonic's decode buffer while decoding, the copy handed to the blocking write), and each
    // connection's waiting bytes stop at its 1 MiB flow-control windows.
    let bound = MAX_CONCURRENT_WRITES * 3 * SIZE + WRITERS as u64 * 2 * MIB + 32 * MIB;
    let grew = after.saturating_sub(before);
    assert!(grew <= bound, "peak RSS grew {} MiB for {WRITERS} × {} MiB writes; bound {} MiB", grew >> 20, SIZE >> 20, bound >> 20);
    assert!(grew < WRITERS as u64 * SIZE, "the writes were not all held at once");

    let r = within(60, h.client.exec(exec_request(&id, ["sh", "-c", "wc -c /workspace/big* | tail -1"]))).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout).split_whitespace().next(), Some((WRITERS as u64 * SIZE).to_string().as_str()), "{r:?}");
}
