//! End to end: what the defaults allow, and what admission refuses — 1,000 sandboxes of the
//! default size with the default configuration, memory and pids admitted against the host,
//! snapshot and exec-record caps, a full storage pool named as the cause of a refused write,
//! and a soak of concurrent clients that meets no refusal below the configured quotas.
//!
//! Each test starts its own daemon with the configuration it is about. Timings are printed
//! (run with `--nocapture` to see them), never asserted.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, ExecStatus, ResourceLimits};
use agent_client::Client;
use futures::StreamExt;
use sandbox_tests::{eventually, free_port, process_sandbox, within, Daemon, Harness};
use tonic::Code;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Asserts `result` is an error with `code` whose message mentions every one of `words`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, agent_client::Error>, code: Code, words: &[&str]) {
    let err = result.expect_err("the request must be refused");
    assert_eq!(err.code(), code, "{err}");
    for w in words {
        assert!(err.to_string().contains(w), "{w:?} not in: {err}");
    }
}

/// The `p`-th percentile of sorted durations.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or_default()
}

/// Descriptors the process `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect metrics");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.expect("write");
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.expect("read");
    let (head, body) = buf.split_once("\r\n\r\n").expect("http response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// `MemTotal` of this host in bytes.
fn host_memory() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let line = text.lines().find(|l| l.starts_with("MemTotal:")).expect("MemTotal");
    line.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()).expect("kB") * 1024
}

// ---------------------------------------------------------------------------------------------
// The defaults.

/// With no configuration at all (the pool file sized by the daemon), 1,000 sandboxes of the
/// default size are created, all run, and all are destroyed. On the code before thin
/// provisioning the 33rd create was RESOURCE_EXHAUSTED ("32 GiB of 32 GiB promised").
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_default_sandboxes_with_the_default_config() {
    const N: usize = 1000;
    const AT_ONCE: usize = 16;
    let daemon = Daemon::start_with_defaults("").await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let pid = daemon.pid().expect("pid");
    let fds_before = open_fds(pid);

    let started = Instant::now();
    let creates = futures::stream::iter(0..N)
        .map(|i| {
            let client = client.clone();
            async move {
                let t = Instant::now();
                let r = within(300, client.create(process_sandbox("minimal"))).await;
                (i, r, t.elapsed())
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let create_total = started.elapsed();
    let mut ids = Vec::with_capacity(N);
    let mut latencies = Vec::with_capacity(N);
    for (i, r, took) in creates {
        match r {
            Ok(sb) => {
                ids.push(sb.id);
                latencies.push(took);
            }
            Err(e) => panic!("create {i} of {N} with the default config: {e}\n---- log tail ----\n{}", tail(&daemon.log(), 40)),
        }
    }
    latencies.sort();
    let fds_at_n = open_fds(pid);
    let rss = sandbox_tests::rss_bytes(pid).unwrap_or(0);

    // Every one of them runs commands: the first, the last and a few between.
    for id in ids.iter().step_by(N / 8).chain(ids.last()) {
        let r = within(60, client.exec(exec_request(id, ["sh", "-c", "echo ok"]))).await.expect("exec");
        assert_eq!((r.status, r.stdout.as_slice()), (ExecStatus::Exited as i32, &b"ok\n"[..]), "{r:?}");
    }
    assert_eq!(within(60, client.list(HashMap::new())).await.expect("list").len(), N);

    let started = Instant::now();
    let destroys = futures::stream::iter(ids)
        .map(|id| {
            let client = client.clone();
            async move { (within(300, client.destroy(&id)).await, id) }
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let destroy_total = started.elapsed();
    for (r, id) in destroys {
        r.unwrap_or_else(|e| panic!("destroy {id}: {e}"));
    }
    assert!(within(60, client.list(HashMap::new())).await.expect("list").is_empty(), "all destroyed");
    eprintln!(
        "scale: {N} default sandboxes ({AT_ONCE} at once): created in {:.1} s (p50 {} ms, p99 {} ms), destroyed in {:.1} s; \
         daemon RSS {} MiB and {} descriptors at {N} (+{} over {N} sandboxes)",
        create_total.as_secs_f64(),
        percentile(&latencies, 0.5).as_millis(),
        percentile(&latencies, 0.99).as_millis(),
        destroy_total.as_secs_f64(),
        rss >> 20,
        fds_at_n,
        fds_at_n.saturating_sub(fds_before),
    );
    let log = daemon.log();
    assert!(log.contains("memory admission") && log.contains("pids admission"), "the start log says what is promisable");
    assert!(log.contains("oom_score_adj"), "the daemon protects itself and says so");
}

/// Whether `pid` holds CAP_SYS_RESOURCE (bit 24 of CapEff), which lowering oom_score_adj needs.
fn has_cap_sys_resource(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).expect("CapEff");
    u64::from_str_radix(eff.trim(), 16).expect("hex") & (1 << 24) != 0
}

/// The daemon's own `oom_score_adj` is -900 when the host lets it lower it (else it says why in
/// its log), and a sandbox's processes have 500: the OOM killer takes them first either way.
fn assert_oom_order(daemon: &Daemon, sandbox_adj: &str) {
    let pid = daemon.pid().expect("pid");
    assert_eq!(sandbox_adj, "500", "a sandbox's processes");
    let own = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj")).expect("read");
    if has_cap_sys_resource(pid) {
        assert_eq!(own.trim(), "-900", "the daemon's own oom_score_adj");
    } else {
        eprintln!("NOTE: this host withholds CAP_SYS_RESOURCE from root: the daemon keeps oom_score_adj {}", own.trim());
        assert!(daemon.log().contains("cannot lower the daemon's oom_score_adj"), "the daemon says it could not");
        assert!(own.trim().parse::<i32>().expect("number") < 500);
    }
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// Memory, pids, and the daemon's own protection.

#[tokio::test(flavor = "multi_thread")]
async fn memory_and_pids_are_admitted_against_the_host_naming_the_key() {
    let reserve = GIB;
    let toml = format!("[admission]\nmemory_overcommit = 1.0\npids_overcommit = 1.0\ndaemon_memory_reserve_bytes = {reserve}\n");
    let h = Harness::start_with(&toml, &[]).await;
    // Strict memory: as many 8 GiB sandboxes as (MemTotal − reserve) holds, and not one more.
    let fit = ((host_memory() - reserve) / (8 * GIB)) as usize;
    let big = || CreateSandboxRequest { limits: Some(ResourceLimits { memory_bytes: 8 * GIB, ..Default::default() }), ..process_sandbox("minimal") };
    let mut held = Vec::new();
    for i in 0..fit {
        held.push(within(120, h.client.create(big())).await.unwrap_or_else(|e| panic!("8 GiB sandbox {i} of {fit}: {e}")).id);
    }
    assert_refused(
        within(120, h.client.create(big())).await,
        Code::ResourceExhausted,
        &["memory_bytes 8 GiB does not fit", "admission.memory_overcommit 1", "admission.daemon_memory_reserve_bytes"],
    );
    // A sandbox's processes are the OOM killer's choice, never the daemon.
    let r = within(60, h.client.exec(exec_request(&held[0], ["cat", "/proc/self/oom_score_adj"]))).await.expect("exec");
    assert_oom_order(&h.daemon, String::from_utf8_lossy(&r.stdout).trim());
    for id in held {
        h.client.destroy(&id).await.expect("destroy");
    }

    // Strict pids: (pid_max − 2048) / 16384 sandboxes of the 16,384-pid ceiling fit.
    let pid_max: usize = std::fs::read_to_string("/proc/sys/kernel/pid_max").expect("pid_max").trim().parse().expect("number");
    let fit = (pid_max - 2048) / 16_384;
    let many = || CreateSandboxRequest { limits: Some(ResourceLimits { max_pids: 16_384, ..Default::default() }), ..process_sandbox("minimal") };
    for i in 0..fit {
        within(120, h.client.create(many())).await.unwrap_or_else(|e| panic!("16,384-pid sandbox {i} of {fit}: {e}"));
    }
    assert_refused(
        within(120, h.client.create(many())).await,
        Code::ResourceExhausted,
        &["max_pids 16384 does not fit", "kernel.pid_max", "admission.pids_reserve 2048"],
    );
    // Small ones still fit beside them.
    within(120, h.client.create(process_sandbox("minimal"))).await.expect("a default sandbox");
}

// ---------------------------------------------------------------------------------------------
// Snapshots and exec records.

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_are_capped_by_count_and_bytes() {
    let toml = format!("[admission]\nmax_snapshots_per_sandbox = 2\nmax_snapshots_per_tenant = 3\nmax_snapshot_bytes_per_sandbox = {}\n", 8 * MIB);
    let h = Harness::start_with(&toml, &[]).await;
    let (a, b, c) = (h.sandbox().await, h.sandbox().await, h.sandbox().await);
    h.client.snapshot(&a, "1").await.expect("1st");
    let second = h.client.snapshot(&a, "2").await.expect("2nd");
    assert_refused(h.client.snapshot(&a, "3").await, Code::ResourceExhausted, &["admission.max_snapshots_per_sandbox (2)"]);
    h.client.snapshot(&b, "1").await.expect("the tenant's 3rd");
    assert_refused(h.client.snapshot(&c, "1").await, Code::ResourceExhausted, &["admission.max_snapshots_per_tenant (3)"]);
    h.client.delete_snapshot(&second.snapshot_id).await.expect("delete");

    // Bytes: 6 MiB fit the sandbox's 8 MiB of snapshots once, not twice; the refused one is gone.
    h.sh_ok(&c, "head -c 6291456 /dev/urandom > /workspace/blob").await;
    let snap = h.client.snapshot(&c, "6m").await.expect("6 MiB");
    assert!(snap.size_bytes >= 6 * MIB, "{snap:?}");
    h.client.delete_snapshot(&h.client.list_snapshots(&a).await.expect("list")[0].snapshot_id).await.expect("room in the count");
    assert_refused(h.client.snapshot(&c, "12m").await, Code::ResourceExhausted, &["admission.max_snapshot_bytes_per_sandbox (8 MiB)", "this one 6"]);
    assert_eq!(h.client.list_snapshots(&c).await.expect("list").len(), 1, "the refused snapshot was deleted");
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_records_keep_argv_within_their_cap() {
    let h = Harness::start_with("[exec]\nmax_record_argv_bytes = 1024\n", &[]).await;
    let id = h.sandbox().await;
    let long = "x".repeat(100 << 10);
    let r = within(60, h.client.exec(exec_request(&id, ["sh", "-c", "printf %s \"$1\" | wc -c", "sh", &long]))).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), (100 << 10).to_string(), "the exec ran with all of its argv");
    let recorded = within(60, h.client.get_exec(&r.exec_id, false)).await.expect("get");
    assert!(recorded.argv_truncated, "{:?}", &recorded.argv[..2]);
    assert_eq!(recorded.argv.iter().map(String::len).sum::<usize>(), 1024);
    assert_eq!(&recorded.argv[..4], &["sh", "-c", "printf %s \"$1\" | wc -c", "sh"]);
    let listed = h.client.list_execs(&id, 0).await.expect("list");
    assert!(listed.iter().all(|e| e.argv_truncated && e.argv.iter().map(String::len).sum::<usize>() == 1024), "ListExecs too");
    let short = within(60, h.client.exec(exec_request(&id, ["true"]))).await.expect("exec");
    assert!(!within(60, h.client.get_exec(&short.exec_id, false)).await.expect("get").argv_truncated);
}

// ---------------------------------------------------------------------------------------------
// Thin disk.

/// Two sandboxes promised 1 GiB each from a 512 MiB pool (overcommitted): when one fills the
/// pool, the other's write is refused naming the pool, not its own quota; /metrics and the log
/// say the pool is at its limit and creates are refused naming the high-water mark. A write
/// past a sandbox's own quota still says disk_bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_pool_is_named_and_refuses_creates() {
    let port = free_port().expect("port");
    let metrics = format!("127.0.0.1:{port}");
    let h = Harness::start_with("", &["--pool-size-bytes", &(512 * MIB).to_string(), "--metrics", &metrics]).await;
    let gib = ResourceLimits { disk_bytes: GIB, ..Default::default() };
    let (filler, victim) = (h.sandbox_with("minimal", gib).await, h.sandbox_with("minimal", gib).await);
    h.client.write_file(&victim, "/workspace/small", vec![1u8; MIB as usize], 0).await.expect("room at first");
    let r = h.sh(&filler, "dd if=/dev/zero of=/workspace/fill bs=1M count=1024 2>&1; sync").await;
    assert!(String::from_utf8_lossy(&r.stdout).contains("No space left on device"), "the pool fills before the 1 GiB quota: {r:?}");
    assert_refused(
        h.client.write_file(&victim, "/workspace/eight", vec![2u8; 8 * MIB as usize], 0).await,
        Code::ResourceExhausted,
        &["storage pool is full", "pool_size_bytes", "not this sandbox's disk_bytes (1 GiB)"],
    );
    assert_refused(
        within(120, h.client.create(process_sandbox("minimal"))).await,
        Code::ResourceExhausted,
        &["admission.disk_high_water (90%)", "pool_size_bytes"],
    );
    let body = http_get(&metrics, "/metrics").await;
    assert!(body.contains("sandboxd_admission_pressure{resource=\"pool:pool_size_bytes\"} 2"), "{body}");
    assert!(body.contains("sandboxd_pool_bytes{kind=\"used\",pool=\"pool_size_bytes\"}"), "{body}");
    assert!(eventually(30, || async { h.daemon.log().contains("host resource at its limit") }).await, "the log says the pool reached its limit");
    // Freed room is usable again, and the pool is no longer named.
    h.sh_ok(&filler, "rm /workspace/fill; sync").await;
    assert!(
        eventually(60, || async { h.client.write_file(&victim, "/workspace/eight", vec![2u8; 8 * MIB as usize], 0).await.is_ok() }).await,
        "the write fits once the pool has room"
    );

    // A sandbox's own quota, in a pool with room, is named as such.
    let small = h.sandbox_with("minimal", ResourceLimits { disk_bytes: 16 * MIB, ..Default::default() }).await;
    assert_refused(
        h.client.write_file(&small, "/workspace/big", vec![3u8; 32 * MIB as usize], 0).await,
        Code::ResourceExhausted,
        &["disk_bytes 16 MiB reached"],
    );
}

// ---------------------------------------------------------------------------------------------
// Soak.

/// Eight clients, each creating, running a command in and destroying its own sandboxes for
/// 20 s, with quotas set above what they hold at most (two live sandboxes each): not one call
/// is refused, and nothing is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn soak_under_the_quotas_meets_no_refusal() {
    const CLIENTS: usize = 8;
    const SOAK: Duration = Duration::from_secs(20);
    let toml = format!("[policy]\nmax_sandboxes_per_tenant = {}\nmax_sandboxes = {}\n", 2 * CLIENTS, 2 * CLIENTS);
    let daemon = Daemon::start_with_defaults(&toml).await.expect("daemon");
    let ops = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + SOAK;
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..CLIENTS {
        let client: Client = daemon.client().await.expect("client");
        let ops = ops.clone();
        tasks.spawn(async move {
            let mut refusals = Vec::new();
            while Instant::now() < end {
                let (a, b) = (within(120, client.create(process_sandbox("minimal"))).await, within(120, client.create(process_sandbox("minimal"))).await);
                for r in [&a, &b] {
                    match r {
                        Ok(sb) => {
                            let out = within(60, client.exec(exec_request(&sb.id, ["sh", "-c", "echo $$"]))).await;
                            match out {
                                Ok(r) if r.status == ExecStatus::Exited as i32 => {}
                                Ok(r) => refusals.push(format!("client {c}: exec {r:?}")),
                                Err(e) => refusals.push(format!("client {c}: exec: {e}")),
                            }
                            if let Err(e) = within(120, client.destroy(&sb.id)).await {
                                refusals.push(format!("client {c}: destroy: {e}"));
                            }
                            ops.fetch_add(3, Ordering::Relaxed);
                        }
                        Err(e) => refusals.push(format!("client {c}: create: {} {e}", e.code())),
                    }
                }
            }
            refusals
        });
    }
    let mut refusals = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        refusals.extend(joined.expect("client task"));
    }
    let done = ops.load(Ordering::Relaxed);
    eprintln!("soak: {CLIENTS} clients for {} s: {done} operations (create, exec, destroy), {} refused", SOAK.as_secs(), refusals.len());
    assert!(refusals.is_empty(), "{} calls failed below the quotas, e.g. {:?}", refusals.len(), &refusals[..refusals.len().min(5)]);
    assert!(done > 0);
    let c = daemon.client().await.expect("client");
    assert!(c.list(HashMap::new()).await.expect("list").is_empty(), "nothing left behind");
}
