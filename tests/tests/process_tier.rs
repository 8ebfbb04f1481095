//! End-to-end tests of the process tier: the real `sandboxd` binary on a UNIX socket in a temp
//! dir, driven through the real client, checking what a user of the API would check.
//!
//! Every test starts its own daemon (its own state dir, pool and cgroup root), so they run in
//! parallel without seeing each other. Nothing skips: without root or without the images the
//! harness fails the test and says what is missing.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use agent_client::exec_request;
use agent_client::proto::{exec_event, ExecRequest, ExecResult, ExecStatus, Isolation, ResourceLimits, SandboxState};
use sandbox_tests::{
    assert_exited, assert_hello_file_reads_back, assert_paths_stay_inside, cgroups_of, describe, dirs_named, eventually, find_under, mounts_of, mounts_under,
    process_sandbox, read_stream, rss_bytes, status, tagged_execs_at_once, text, unique, within, Harness, PeakRss, Streamed,
};
use tonic::Code;

// ---------------------------------------------------------------------------------------------
// 1. The basics a user relies on first.

#[tokio::test(flavor = "multi_thread")]
async fn exec_basics_env_workdir_hostname_and_sandbox_lifecycle() {
    let h = Harness::start().await;
    let c = &h.client;
    let tag = unique("basics");
    let mut request = process_sandbox("minimal");
    request.env = HashMap::from([("FROM_SANDBOX".into(), "sb".into()), ("OVERRIDDEN".into(), "sb".into())]);
    request.labels = HashMap::from([("suite".into(), tag.clone()), ("role".into(), "main".into())]);
    let before = SystemTime::now();
    let sandbox = within(60, c.create(request)).await.expect("CreateSandbox");
    let id = sandbox.id.clone();
    assert_eq!(sandbox.state, SandboxState::Running as i32, "{sandbox:?}");
    assert_eq!(sandbox.isolation, Isolation::Process as i32);
    assert_eq!(sandbox.image, "minimal");
    assert_eq!(sandbox.workdir, "/workspace");

    // echo: output, status, exit code, the record's metadata.
    let r = h.exec(exec_request(&id, ["echo", "hello"])).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"hello\n");
    assert!(r.stderr.is_empty(), "{}", describe(&r));
    assert!(r.exec_id.starts_with("ex-"), "exec id {:?}", r.exec_id);
    assert_eq!(r.sandbox_id, id);
    assert_eq!(r.argv, ["echo", "hello"]);
    assert_eq!(r.signal, 0);
    assert!(r.error.is_empty(), "{}", describe(&r));
    assert_eq!((r.stdout_total_bytes, r.stdout_truncated), (6, false));
    let started = r.started_at.expect("started_at is set");
    let started = SystemTime::UNIX_EPOCH + Duration::new(started.seconds as u64, started.nanos as u32);
    let slack = Duration::from_secs(5);
    assert!(started + slack >= before && started <= SystemTime::now() + slack, "started_at {started:?} is not around now");
    assert!(r.duration_ms < 10_000, "{}", describe(&r));
    let r = h.sh(&id, "sleep 0.3").await;
    assert_exited(&r, 0);
    assert!((250..10_000).contains(&r.duration_ms), "a 300 ms sleep took duration_ms={}", r.duration_ms);

    // Exit codes propagate.
    assert_exited(&h.sh(&id, "exit 3").await, 3);
    let r = h.sh(&id, "echo to-stderr >&2; exit 42").await;
    assert_exited(&r, 42);
    assert_eq!(r.stderr, b"to-stderr\n");

    // Stdin is delivered, small and bigger than a pipe buffer.
    let r = h.exec(ExecRequest { stdin: b"line one\nline two\n".to_vec(), ..exec_request(&id, ["cat"]) }).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"line one\nline two\n");
    let r = h.exec(ExecRequest { stdin: vec![b'z'; 1 << 20], ..exec_request(&id, ["wc", "-c"]) }).await;
    assert_exited(&r, 0);
    assert_eq!(text(&r.stdout).trim(), "1048576");

    // Env: the sandbox's env is the default, the exec's wins on conflicts.
    let r = h
        .exec(ExecRequest {
            env: HashMap::from([("OVERRIDDEN".into(), "exec".into()), ("FROM_EXEC".into(), "ex".into())]),
            ..exec_request(&id, ["sh", "-c", "echo $FROM_SANDBOX $OVERRIDDEN $FROM_EXEC"])
        })
        .await;
    assert_exited(&r, 0);
    assert_eq!(text(&r.stdout), "sb exec ex\n");
    assert_eq!(h.sh_ok(&id, "echo $OVERRIDDEN").await, "sb\n", "the exec override must not stick to the sandbox");

    // Workdir: /workspace by default, per exec when asked.
    assert_eq!(h.exec(exec_request(&id, ["pwd"])).await.stdout, b"/workspace\n");
    let r = h.exec(ExecRequest { workdir: "/tmp".into(), ..exec_request(&id, ["pwd"]) }).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"/tmp\n");

    // The hostname is the sandbox id.
    assert_eq!(h.exec(exec_request(&id, ["hostname"])).await.stdout, format!("{id}\n").into_bytes());

    // GetSandbox and ListSandboxes with a label selector.
    let got = c.get(&id).await.expect("GetSandbox");
    assert_eq!(got.id, id);
    assert_eq!(got.state, SandboxState::Running as i32);
    assert_eq!(got.labels.get("role").map(String::as_str), Some("main"));
    let limits = got.limits.expect("effective limits are reported");
    assert!(limits.memory_bytes > 0 && limits.max_pids > 0 && limits.exec_timeout_ms > 0, "{limits:?}");
    let mut other = process_sandbox("minimal");
    other.labels = HashMap::from([("suite".into(), tag.clone()), ("role".into(), "other".into())]);
    let other = within(60, c.create(other)).await.expect("CreateSandbox").id;
    let ids = |list: Vec<agent_client::proto::Sandbox>| {
        let mut v: Vec<String> = list.into_iter().map(|s| s.id).collect();
        v.sort();
        v
    };
    let mut both = vec![id.clone(), other.clone()];
    both.sort();
    assert_eq!(ids(c.list(HashMap::new()).await.expect("list all")), both);
    assert_eq!(ids(c.list(HashMap::from([("suite".into(), tag.clone())])).await.expect("list")), both);
    let main_only = HashMap::from([("suite".into(), tag.clone()), ("role".into(), "main".into())]);
    assert_eq!(ids(c.list(main_only).await.expect("list")), vec![id.clone()]);
    assert!(c.list(HashMap::from([("role".into(), "nope".into())])).await.expect("list").is_empty());

    // Destroy: gone from Get, List and Exec.
    within(30, c.destroy(&id)).await.expect("DestroySandbox");
    assert_eq!(c.get(&id).await.expect_err("destroyed sandbox").code(), Code::NotFound);
    assert_eq!(c.exec(exec_request(&id, ["true"])).await.expect_err("exec in destroyed sandbox").code(), Code::NotFound);
    assert_eq!(ids(c.list(HashMap::new()).await.expect("list")), vec![other.clone()]);
    assert_eq!(c.destroy(&id).await.expect_err("second destroy").code(), Code::NotFound);
}

// ---------------------------------------------------------------------------------------------
// 2. Isolation, as seen from inside.

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_is_isolated_from_the_host() {
    let h = Harness::start().await;
    let id = h.sandbox().await;

    // PID namespace: PID 1 is the sandbox's init, the process list is the sandbox's own.
    let ps = h.sh_ok(&id, "ps -o pid,args").await;
    let rows: Vec<(u32, String)> = ps
        .lines()
        .skip(1)
        .filter_map(|l| {
            let l = l.trim_start();
            let (pid, args) = l.split_once(char::is_whitespace)?;
            Some((pid.parse().ok()?, args.trim().to_string()))
        })
        .collect();
    let init = rows.iter().find(|(pid, _)| *pid == 1).map(|(_, args)| args.as_str());
    assert!(init.is_some_and(|a| a.contains("init")), "PID 1 in the sandbox is not its init:\n{ps}");
    assert!(rows.len() <= 6, "the sandbox sees more processes than its own:\n{ps}");
    let daemon_pid = h.daemon.pid().expect("daemon running");
    for (pid, args) in &rows {
        assert!(!args.contains("--state-dir") && !args.contains("cargo") && !args.contains("process_tier"), "a host process is visible inside:\n{ps}");
        if *pid != 1 {
            // Besides the command itself, only the spare the init keeps ready for the next
            // exec (a fork of the init, waiting for its job) may be there.
            assert!(args.contains("ps") || args.contains("sh") || args.contains("sandbox-init"), "unexpected process inside:\n{ps}");
        }
    }
    let proc_pids = h.sh_ok(&id, "ls /proc | grep -E '^[0-9]+$'").await;
    let host_daemon = format!("{daemon_pid}");
    let count = proc_pids.lines().count();
    assert!(count <= 6, "/proc inside lists {count} processes:\n{proc_pids}");
    assert!(!proc_pids.lines().any(|p| p == host_daemon) || daemon_pid < 10, "the daemon's host pid {daemon_pid} appears in the sandbox's /proc");

    // Network namespace: only loopback.
    let links = h.sh_ok(&id, "ip link").await;
    let names: Vec<&str> = links.lines().filter(|l| !l.starts_with(' ')).filter_map(|l| l.split(": ").nth(1)).collect();
    assert_eq!(names, ["lo"], "interfaces inside:\n{links}");
    let dev = h.sh_ok(&id, "cat /proc/net/dev").await;
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "/proc/net/dev inside:\n{dev}");

    // Privileges: no CAP_SYS_ADMIN, no_new_privs, seccomp filter mode.
    let st = h.sh_ok(&id, "cat /proc/self/status").await;
    let field =
        |name: &str| st.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_else(|| panic!("{name} missing from:\n{st}"));
    let cap_eff = u64::from_str_radix(&field("CapEff:"), 16).expect("CapEff is hex");
    assert_eq!(cap_eff & (1 << 21), 0, "CAP_SYS_ADMIN is effective inside (CapEff {cap_eff:x})");
    let cap_bnd = u64::from_str_radix(&field("CapBnd:"), 16).expect("CapBnd is hex");
    assert_eq!(cap_bnd & (1 << 21), 0, "CAP_SYS_ADMIN is in the bounding set (CapBnd {cap_bnd:x})");
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2");

    // Mounting is refused, and nothing got mounted.
    let r = h.sh(&id, "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m").await;
    assert_eq!(status(&r), ExecStatus::Exited, "{}", describe(&r));
    assert_ne!(r.exit_code, 0, "mount succeeded inside the sandbox: {}", describe(&r));
    assert!(!h.sh_ok(&id, "cat /proc/mounts").await.contains("/tmp/m"), "a tmpfs got mounted at /tmp/m");

    // Writes land in the sandbox's own filesystem, never on the host.
    let marker = format!("/tmp/{}", unique("sandboxd-marker"));
    let r = h.sh(&id, &format!("echo inside > {marker} && cat {marker}")).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"inside\n");
    assert!(!Path::new(&marker).exists(), "{marker} written inside the sandbox appeared on the host");
    let host_only = std::env::current_exe().expect("test exe");
    let r = h.exec(exec_request(&id, ["ls", &host_only.display().to_string()])).await;
    assert_ne!(r.exit_code, 0, "the host's {} is visible inside: {}", host_only.display(), describe(&r));
}

// ---------------------------------------------------------------------------------------------
// 3. Bad input gets the right status, and never hurts the daemon.

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_with_the_right_code() {
    let h = Harness::start().await;
    let c = &h.client;
    let id = h.sandbox().await;

    for bad in ["sb-doesnotexist1", "xyz", "", "sb-../../etc"] {
        assert_eq!(c.get(bad).await.expect_err("unknown id").code(), Code::NotFound, "GetSandbox({bad:?})");
        assert_eq!(c.exec(exec_request(bad, ["true"])).await.expect_err("unknown id").code(), Code::NotFound, "Exec({bad:?})");
        assert_eq!(c.destroy(bad).await.expect_err("unknown id").code(), Code::NotFound, "Destroy({bad:?})");
        assert_eq!(c.read_file(bad, "/etc/passwd", 0, 0).await.expect_err("unknown id").code(), Code::NotFound, "ReadFile({bad:?})");
        assert_eq!(c.list_execs(bad, 0).await.expect_err("unknown id").code(), Code::NotFound, "ListExecs({bad:?})");
    }
    assert_eq!(c.get_exec("ex-doesnotexist1", false).await.expect_err("unknown exec").code(), Code::NotFound);

    // Empty argv, argv[0] empty.
    let err = c.exec(exec_request(&id, Vec::<String>::new())).await.expect_err("empty argv");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("argv"), "{err}");
    assert_eq!(c.exec(exec_request(&id, [""])).await.expect_err("empty argv[0]").code(), Code::InvalidArgument);

    // Limits above the ceilings name the field.
    let over = |limits: ResourceLimits| agent_client::proto::CreateSandboxRequest { limits: Some(limits), ..process_sandbox("minimal") };
    let err = c.create(over(ResourceLimits { memory_bytes: 1 << 50, ..Default::default() })).await.expect_err("memory over ceiling");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("memory_bytes"), "{err}");
    let err = c.create(over(ResourceLimits { max_pids: 1 << 30, ..Default::default() })).await.expect_err("pids over ceiling");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("max_pids"), "{err}");
    let err = c.create(over(ResourceLimits { disk_bytes: 1 << 60, ..Default::default() })).await.expect_err("disk over ceiling");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("disk_bytes"), "{err}");
    let err = c.exec(ExecRequest { timeout_ms: u64::MAX / 2, ..exec_request(&id, ["true"]) }).await.expect_err("timeout over ceiling");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("timeout_ms"), "{err}");

    // Unknown image; invalid isolation number.
    let err = c.create(process_sandbox("no-such-image")).await.expect_err("unknown image");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    // A name that cannot be an image (a path trick) is malformed, not unknown.
    let err = c.create(process_sandbox("../minimal")).await.expect_err("image path trick");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("image"), "{err}");
    let err = c.create(agent_client::proto::CreateSandboxRequest { isolation: 42, ..process_sandbox("minimal") }).await.expect_err("isolation 42");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("isolation"), "{err}");

    // Commands that cannot start are results, not gRPC errors.
    let r = h.exec(exec_request(&id, ["does-not-exist-anywhere"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    assert!(r.error.contains("not found"), "{}", describe(&r));
    let r = h.exec(exec_request(&id, ["/bin/nope"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    c.write_file(&id, "/workspace/script.sh", b"#!/bin/sh\necho should-not-run\n".to_vec(), 0o644).await.expect("WriteFile");
    let r = h.exec(exec_request(&id, ["/workspace/script.sh"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 126), "{}", describe(&r));
    assert!(!r.error.is_empty(), "{}", describe(&r));
    assert!(r.stdout.is_empty(), "{}", describe(&r));
    let r = h.exec(ExecRequest { workdir: "/no/such/dir".into(), ..exec_request(&id, ["pwd"]) }).await;
    assert_eq!(status(&r), ExecStatus::SpawnFailed, "{}", describe(&r));
    assert!(r.error.contains("/no/such/dir"), "{}", describe(&r));
    let err = c.exec(ExecRequest { workdir: "relative/dir".into(), ..exec_request(&id, ["pwd"]) }).await.expect_err("relative workdir");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");

    // After all that the daemon still answers, and the sandbox still works.
    let list = c.list(HashMap::new()).await.expect("ListSandboxes");
    assert_eq!(list.len(), 1, "failed creates left sandboxes behind: {list:?}");
    assert_eq!(h.exec(exec_request(&id, ["echo", "still here"])).await.stdout, b"still here\n");
    assert!(mounts_under(&h.daemon.state_dir()).iter().filter(|m| m.to_string_lossy().contains("/run/")).count() == 1, "failed creates left mounts");
}

#[tokio::test(flavor = "multi_thread")]
async fn configured_ceilings_apply_field_by_field() {
    // An operator lowers one ceiling; every other ceiling must stay the built-in one.
    let h = Harness::start_with_config("[limits.max]\nmemory_bytes = 1073741824\n").await;
    let c = &h.client;
    let create = |limits: ResourceLimits| c.create(agent_client::proto::CreateSandboxRequest { limits: Some(limits), ..process_sandbox("minimal") });
    let err = create(ResourceLimits { memory_bytes: 2 << 30, ..Default::default() }).await.expect_err("memory above the configured ceiling");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("memory_bytes"), "{err}");
    let ok = create(ResourceLimits { memory_bytes: 1 << 30, ..Default::default() }).await.expect("memory at the configured ceiling");
    assert_eq!(ok.limits.map(|l| l.memory_bytes), Some(1 << 30));
    // Not lowered by the operator: 1000 pids, 2 GiB of disk and a 1 h timeout are far below
    // the built-in ceilings (16384 pids, 64 GiB, 24 h).
    let sandbox = create(ResourceLimits { max_pids: 1000, disk_bytes: 2 << 30, exec_timeout_ms: 3_600_000, ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("a [limits.max] table naming only memory_bytes lowered the other ceilings: {e}"));
    let limits = sandbox.limits.expect("limits");
    assert_eq!((limits.max_pids, limits.disk_bytes, limits.exec_timeout_ms), (1000, 2 << 30, 3_600_000));
}

// ---------------------------------------------------------------------------------------------
// 4. Files.

#[tokio::test(flavor = "multi_thread")]
async fn files_round_trip_and_never_leave_the_sandbox() {
    let h = Harness::start().await;
    let c = &h.client;
    let id = h.sandbox().await;

    // Round trip with offset/limit, eof and size; mode kept; parents created.
    assert_hello_file_reads_back(c, &id).await;
    assert_eq!(h.sh_ok(&id, "stat -c %a /workspace/a/b/c/hello.txt; cat /workspace/a/b/c/hello.txt").await, "640\nhello world");
    // Relative paths are relative to the workdir; overwriting truncates.
    c.write_file(&id, "rel.txt", b"a much longer first version".to_vec(), 0).await.expect("WriteFile");
    c.write_file(&id, "rel.txt", b"short".to_vec(), 0o755).await.expect("WriteFile");
    assert_eq!(h.sh_ok(&id, "stat -c %a /workspace/rel.txt; cat /workspace/rel.txt").await, "755\nshort");
    // What the sandbox writes, ReadFile reads; more than one chunk goes through read_file_all.
    h.sh_ok(&id, "seq 1 1000000 > /workspace/seq.txt").await;
    let expected: String = (1..=1_000_000).map(|i| format!("{i}\n")).collect();
    let got = within(60, c.read_file_all(&id, "/workspace/seq.txt")).await.expect("read_file_all");
    assert_eq!(got.len(), expected.len());
    assert!(got == expected.as_bytes(), "seq.txt read back differs");
    let big: Vec<u8> = (0..(6u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    c.write_file(&id, "/workspace/big.bin", big.clone(), 0).await.expect("WriteFile 6 MiB");
    assert!(within(60, c.read_file_all(&id, "/workspace/big.bin")).await.expect("read_file_all") == big, "6 MiB round trip differs");

    assert_paths_stay_inside(&h, &id).await;

    // Directories and missing files.
    let err = c.read_file(&id, "/workspace", 0, 0).await.expect_err("ReadFile of a directory");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = c.read_file(&id, "/workspace/missing.txt", 0, 0).await.expect_err("missing file");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    let err = c.write_file(&id, "/workspace/a", b"x".to_vec(), 0).await.expect_err("WriteFile over a directory");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    // A FIFO planted inside is refused rather than blocking the daemon.
    h.sh_ok(&id, "mkfifo /workspace/fifo").await;
    let err = within(10, c.read_file(&id, "/workspace/fifo", 0, 0)).await.expect_err("ReadFile of a FIFO");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
}

// ---------------------------------------------------------------------------------------------
// 5. Limits.

#[tokio::test(flavor = "multi_thread")]
async fn fork_bomb_is_contained_by_max_pids() {
    let h = Harness::start().await;
    let limits = ResourceLimits { max_pids: 64, ..Default::default() };

    // A bomb that forks into the background and leaves: the exec ends, the daemon answers, and
    // the sandbox can run commands again once the bomb has burnt out against the pid limit.
    let id = h.sandbox_with("minimal", limits).await;
    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 5_000, ..exec_request(&id, ["sh", "-c", "f(){ f|f& }; f; sleep 1"]) }).await;
    assert!(t0.elapsed() < Duration::from_secs(30), "the fork bomb exec took {:?}: {}", t0.elapsed(), describe(&r));
    assert!(h.client.list(HashMap::new()).await.is_ok(), "the daemon stopped answering");
    let ok = eventually(15, || async { h.exec(exec_request(&id, ["echo", "ok"])).await.stdout == b"ok\n" }).await;
    let last = h.exec(exec_request(&id, ["echo", "ok"])).await;
    assert!(ok, "echo ok keeps failing after a fork bomb: {}", describe(&last));

    // The same bomb under a main process that never ends (a loop of shell builtins, which
    // needs no fork): the timeout fires while the bomb is still forking as fast as the limit
    // allows, and its kill must reach every process of the tree. The bomb starts from a
    // subshell, the main process's only fork (made before any bomb exists): the shell exits
    // when a fork of its own fails, and the bomb's first children could fill the pid limit
    // before the main shell had forked the second half of its pipeline.
    let id = h.sandbox_with("minimal", limits).await;
    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 1_500, ..exec_request(&id, ["sh", "-c", "(f(){ f|f& }; f); while :; do :; done"]) }).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
    assert!(t0.elapsed() < Duration::from_secs(15), "a 1.5 s timeout returned after {:?}", t0.elapsed());
    let ps = h.sh_ok(&id, "ps -o pid,args").await;
    assert!(ps.lines().count() <= 4, "the timed-out bomb left processes behind:\n{ps}");
    assert_eq!(h.sh_ok(&id, "echo ok").await, "ok\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_is_oom_killed_and_reported() {
    let h = Harness::start().await;
    let limit: u64 = 64 << 20;
    let id = h.sandbox_with("debian", ResourceLimits { memory_bytes: limit, ..Default::default() }).await;
    let r = h.exec(ExecRequest { timeout_ms: 60_000, ..exec_request(&id, ["python3", "-c", "x = b'a' * (400 << 20); print(len(x))"]) }).await;
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::OomKilled, 137, 9), "{}", describe(&r));
    assert!(r.peak_memory_bytes > 0, "peak_memory_bytes not reported: {}", r.peak_memory_bytes);
    assert!(r.peak_memory_bytes <= limit + limit / 8, "peak_memory_bytes {} is well above the {limit}-byte limit", r.peak_memory_bytes);
    // The sandbox survives its OOM.
    assert_eq!(h.sh_ok(&id, "echo alive").await, "alive\n");
    // A modest allocation reports a peak in the right range.
    let r = h.exec(exec_request(&id, ["python3", "-c", "x = b'a' * (20 << 20); print(len(x))"])).await;
    assert_exited(&r, 0);
    assert!(r.peak_memory_bytes >= 20 << 20 && r.peak_memory_bytes <= limit + limit / 8, "peak {} for a 20 MiB allocation", r.peak_memory_bytes);
    // The same bomb written in shell, in the minimal image.
    let id = h.sandbox_with("minimal", ResourceLimits { memory_bytes: limit, ..Default::default() }).await;
    let r = h.exec(ExecRequest { timeout_ms: 60_000, ..exec_request(&id, ["sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}"]) }).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::OomKilled, 137), "{}", describe(&r));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exec_still_starts_when_the_sandbox_killed_the_spare_waiting_for_it() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    assert_exited(&h.sh(&id, "true").await, 0);
    // The spare for the next exec (a fork of the init, waiting for the daemon's job in the
    // sandbox's cgroup or in that exec's) is a process of the sandbox: code in it may kill it.
    // Wait for it to appear while this exec runs, then kill it.
    let killer = r#"while :; do
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = 1 ] || [ "$p" = $$ ] && continue
    if tr '\0' ' ' < $d/cmdline 2>/dev/null | grep -q '^sandbox-init'; then kill -9 $p && echo killed && exit 0; fi
  done
  sleep 0.01
done"#;
    let r = h.sh(&id, killer).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"killed\n");
    // The next exec finds its spare gone and starts through the init instead; the ones after it
    // get spares again.
    for _ in 0..3 {
        let r = h.sh(&id, "echo ok; id -u").await;
        assert_exited(&r, 0);
        assert_eq!(r.stdout, b"ok\n0\n", "{}", describe(&r));
    }
}

/// Every exec runs in a cgroup of its own below the sandbox's (its CPU time, peak memory, OOM
/// kills and kill are its own), a new one each time: also when the spare that runs it waited in
/// the sandbox's own cgroup and joined the exec's itself. On v1 a hierarchy of `cpu` or `pids`
/// alone stays the sandbox's (the quota and the pid limit are the sandbox's).
#[tokio::test(flavor = "multi_thread")]
async fn each_exec_runs_in_a_cgroup_of_its_own() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        // The command's own descriptors too: the cgroup files its spare joined through are
        // closed before it runs.
        let r = h.sh(&id, "ls -l /proc/$$/fd >&2; cat /proc/self/cgroup").await;
        assert_exited(&r, 0);
        let fds = String::from_utf8_lossy(&r.stderr).to_string();
        assert!(fds.contains("0 -> ") && fds.contains("2 -> "), "no descriptors listed:\n{fds}");
        assert!(!fds.contains("tasks") && !fds.contains("cgroup.procs") && !fds.contains("/sys/fs/cgroup"), "a cgroup file is open in the exec:\n{fds}");
        let text = String::from_utf8_lossy(&r.stdout).to_string();
        // (hierarchy's controllers, path inside the sandbox's cgroup namespace)
        let lines: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| {
                let mut parts = l.splitn(3, ':');
                let _ = parts.next()?;
                Some((parts.next()?.to_string(), parts.next()?.to_string()))
            })
            .collect();
        let v1 = lines.iter().any(|(c, _)| !c.is_empty());
        let mut own = None;
        for (controllers, path) in &lines {
            let names: Vec<&str> = controllers.split(',').collect();
            let accounted = if v1 { names.iter().any(|c| ["memory", "freezer", "cpuacct"].contains(c)) } else { controllers.is_empty() };
            if v1 && (names == ["cpu"] || names == ["pids"]) {
                assert_eq!(path, "/", "the exec left the sandbox's cgroup of {controllers}:\n{text}");
            } else if accounted {
                assert!(path.starts_with("/x-") && !path[1..].contains('/'), "not an exec cgroup below the sandbox's: {controllers}:{path}\n{text}");
                match &own {
                    None => own = Some(path.clone()),
                    Some(p) => assert_eq!(p, path, "one exec in two cgroups:\n{text}"),
                }
            }
        }
        let own = own.unwrap_or_else(|| panic!("no exec cgroup in /proc/self/cgroup:\n{text}"));
        assert!(!seen.contains(&own), "two execs in one cgroup ({own})");
        seen.push(own);
    }
}

/// Only the sandboxes that armed a spare last keep it (`[process] spares`): the others hold
/// their init alone and still run every exec (through the init), arming a spare again as they
/// do, which another gives up.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_sandboxes_used_last_keep_a_spare() {
    let h = Harness::start_with_config("[process]\nspares = 2\n").await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(h.sandbox().await);
    }
    let counts = |ids: &[String]| ids.iter().map(|id| host_pids_of(id).len()).collect::<Vec<_>>();
    // Each sandbox's init, and two spares among them.
    let settled = eventually(30, || async { counts(&ids).iter().sum::<usize>() == 6 }).await;
    assert!(settled, "processes per sandbox after 4 creates with spares = 2: {:?}", counts(&ids));
    // Inits and spares run from `sandbox-init`, the small binary built beside the daemon's.
    let beside = sandbox_tests::sandboxd_bin().expect("sandboxd binary").with_file_name("sandbox-init");
    let init_binary = std::fs::canonicalize(&beside).unwrap_or_else(|e| panic!("{}: {e}", beside.display()));
    for pid in ids.iter().flat_map(|id| host_pids_of(id)) {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("an init's exe");
        assert_eq!(exe, init_binary, "process {pid} of a sandbox runs from {}", exe.display());
    }
    for round in 0..2 {
        for (i, id) in ids.iter().enumerate() {
            let r = h.sh(id, "echo ran").await;
            assert_exited(&r, 0);
            assert_eq!(text(&r.stdout), "ran\n");
            // The sandbox just used holds a spare again, and the others one between them.
            let settled = eventually(30, || async { host_pids_of(id).len() == 2 && counts(&ids).iter().sum::<usize>() == 6 }).await;
            assert!(settled, "round {round}, after an exec in sandbox {i}: processes per sandbox {:?}", counts(&ids));
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cpu_time_is_accounted() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let r = h.sh(&id, "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; echo $i").await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"200000\n");
    assert!(r.cpu_user_ms > 0, "a busy loop reported cpu_user_ms=0 (duration {} ms)", r.duration_ms);
    assert!(r.cpu_user_ms + r.cpu_system_ms <= r.duration_ms + 200, "more CPU ({} + {}) than wall time ({})", r.cpu_user_ms, r.cpu_system_ms, r.duration_ms);
    let idle = h.sh(&id, "sleep 0.5").await;
    assert!(idle.cpu_user_ms < 200, "sleeping used {} ms of user CPU", idle.cpu_user_ms);
}

#[tokio::test(flavor = "multi_thread")]
async fn disk_quota_stops_writes_and_frees_on_delete() {
    let h = Harness::start().await;
    let id = h.sandbox_with("minimal", ResourceLimits { disk_bytes: 32 << 20, ..Default::default() }).await;
    let r = h.sh(&id, "dd if=/dev/zero of=/workspace/big bs=1M count=64").await;
    assert_eq!(status(&r), ExecStatus::Exited, "{}", describe(&r));
    assert_ne!(r.exit_code, 0, "64 MiB written under a 32 MiB quota: {}", describe(&r));
    let err = text(&r.stderr).to_lowercase();
    assert!(err.contains("quota") || err.contains("space"), "dd's error does not say why: {}", describe(&r));
    let size: u64 = h.sh_ok(&id, "stat -c %s /workspace/big").await.trim().parse().expect("a size");
    assert!(size <= 40 << 20, "{size} bytes landed under a 32 MiB quota");
    // WriteFile over the quota is RESOURCE_EXHAUSTED, not INTERNAL.
    let e = h.client.write_file(&id, "/workspace/also-big", vec![0u8; 16 << 20], 0).await.expect_err("WriteFile over quota");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    // Deleting frees the space again.
    h.sh_ok(&id, "rm -f /workspace/big /workspace/also-big").await;
    let r = h.sh(&id, "dd if=/dev/zero of=/workspace/again bs=1M count=8 && echo written").await;
    assert_exited(&r, 0);
    assert!(text(&r.stdout).contains("written"), "{}", describe(&r));
}

// ---------------------------------------------------------------------------------------------
// 6. Output.

#[tokio::test(flavor = "multi_thread")]
async fn output_flood_is_truncated_and_spilled_whole() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let r = h.exec(ExecRequest { max_output_bytes: 4096, ..exec_request(&id, ["sh", "-c", "yes | head -c 50000000"]) }).await;
    assert_exited(&r, 0);
    assert!(r.stdout_truncated, "{}", describe(&r));
    assert_eq!(r.stdout_total_bytes, 50_000_000);
    assert!(r.stdout.len() <= 4096 && r.stdout.len() >= 1024, "kept {} bytes of stdout with a 4096 cap", r.stdout.len());
    assert!(r.stdout.starts_with(b"y\ny\n") && r.stdout.ends_with(b"y\n"), "{}", describe(&r));
    assert!(!r.stderr_truncated && r.stderr_spill_path.is_empty(), "{}", describe(&r));
    assert!(!r.stdout_spill_path.is_empty(), "no spill path for a truncated stream");
    let wc = h.exec(exec_request(&id, ["wc", "-c", &r.stdout_spill_path])).await;
    assert_exited(&wc, 0);
    assert_eq!(text(&wc.stdout).split_whitespace().next(), Some("50000000"), "{}", describe(&wc));
    let head = h.client.read_file(&id, r.stdout_spill_path.as_str(), 0, 6).await.expect("ReadFile of the spill");
    assert_eq!((head.content.as_slice(), head.size), (&b"y\ny\ny\n"[..], 50_000_000));
    // An exec that stays under the cap is not truncated and spills nothing.
    let r = h.exec(ExecRequest { max_output_bytes: 4096, ..exec_request(&id, ["sh", "-c", "yes | head -c 4096"]) }).await;
    assert!(!r.stdout_truncated && r.stdout.len() == 4096 && r.stdout_spill_path.is_empty(), "{}", describe(&r));
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_floods_keep_daemon_memory_bounded() {
    let h = Harness::start().await;
    let pid = h.daemon.pid().expect("daemon running");
    let (a, b) = (h.sandbox().await, h.sandbox().await);
    let baseline = rss_bytes(pid).expect("daemon RSS");
    let sampler = PeakRss::start(pid, Duration::from_millis(20));
    let flood = |id: String| {
        let c = h.client.clone();
        async move { within(150, c.exec(exec_request(&id, ["sh", "-c", "yes | head -c 200000000"]))).await.expect("Exec") }
    };
    let (ra, rb) = tokio::join!(flood(a), flood(b));
    let peak = sampler.stop().await;
    for r in [&ra, &rb] {
        assert_exited(r, 0);
        assert_eq!(r.stdout_total_bytes, 200_000_000);
        assert!(r.stdout_truncated && r.stdout.len() <= 1 << 20, "{} bytes kept with the default 1 MiB cap", r.stdout.len());
    }
    let after = rss_bytes(pid).expect("daemon RSS");
    assert!(peak < 150 << 20, "daemon RSS peaked at {} MiB during two 200 MB floods (baseline {} MiB)", peak >> 20, baseline >> 20);
    assert!(after < 150 << 20, "daemon RSS is {} MiB after the floods", after >> 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn background_grandchild_does_not_hold_the_exec() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let t0 = Instant::now();
    let r = h.sh(&id, "sleep 30 & echo done").await;
    let elapsed = t0.elapsed();
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"done\n");
    assert!(elapsed < Duration::from_secs(2), "the exec waited {elapsed:?} for a background sleep holding stdout");
    // The background process was left running (it is the user's), and the sandbox works.
    assert!(h.sh_ok(&id, "ps -o args").await.contains("sleep 30"), "the background sleep is gone");
    assert_eq!(h.sh_ok(&id, "echo next").await, "next\n");
}

// ---------------------------------------------------------------------------------------------
// Background execs, signals, idempotency and TTL: the rest of the exec lifecycle.

#[tokio::test(flavor = "multi_thread")]
async fn background_exec_idempotency_and_ttl() {
    let h = Harness::start().await;
    let c = &h.client;
    let id = h.sandbox().await;

    // A command killed by a signal is SIGNALED with 128+signal.
    let r = h.sh(&id, "kill -TERM $$").await;
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::Signaled, 143, 15), "{}", describe(&r));

    // Background: RUNNING at once, GetExec(wait) gives the end, with its output.
    let t0 = Instant::now();
    let bg = h.exec(ExecRequest { background: true, ..exec_request(&id, ["sh", "-c", "sleep 0.5; echo later"]) }).await;
    assert!(t0.elapsed() < Duration::from_millis(450), "a background exec took {:?} to return", t0.elapsed());
    assert_eq!(status(&bg), ExecStatus::Running, "{}", describe(&bg));
    let done = within(30, c.get_exec(&bg.exec_id, true)).await.expect("GetExec wait");
    assert_exited(&done, 0);
    assert_eq!(done.stdout, b"later\n");
    assert_eq!(done.exec_id, bg.exec_id);

    // An idempotency key runs the command once and replays its result.
    let keyed =
        || ExecRequest { idempotency_key: "once".into(), ..exec_request(&id, ["sh", "-c", "echo run >> /workspace/runs; cat /workspace/runs | wc -l"]) };
    let first = h.exec(keyed()).await;
    let second = h.exec(keyed()).await;
    assert_exited(&first, 0);
    assert_eq!(first.exec_id, second.exec_id, "a repeated idempotency key ran again");
    assert_eq!(second.stdout, first.stdout);
    assert_eq!(h.sh_ok(&id, "wc -l < /workspace/runs").await.trim(), "1", "the command ran twice");

    // ListExecs: oldest first, limit keeps the newest.
    let all = c.list_execs(&id, 0).await.expect("ListExecs");
    assert_eq!(all.len(), 4, "records: {:?}", all.iter().map(|e| &e.argv).collect::<Vec<_>>());
    assert_eq!(all[0].argv, ["sh", "-c", "kill -TERM $$"], "the oldest record comes first");
    let newest = c.list_execs(&id, 1).await.expect("ListExecs limit 1");
    assert_eq!(newest.len(), 1);
    assert_eq!(newest[0].exec_id, all[all.len() - 1].exec_id);

    // A sandbox with a TTL is reaped, with its mount and cgroups.
    let request = agent_client::proto::CreateSandboxRequest { ttl_seconds: 1, ..process_sandbox("minimal") };
    let ephemeral = within(60, c.create(request)).await.expect("CreateSandbox with TTL").id;
    let reaped = eventually(10, || async { c.get(&ephemeral).await.is_err_and(|e| e.code() == Code::NotFound) }).await;
    assert!(reaped, "a sandbox with ttl_seconds=1 still exists after 10 s");
    // The reaper takes the sandbox out of the table before it tears it down: allow it a moment.
    let freed = eventually(5, || async { mounts_of(&h.daemon, &ephemeral).is_empty() && cgroups_of(&ephemeral).is_empty() }).await;
    assert!(freed, "the reaped sandbox still holds mounts {:?} / cgroups {:?}", mounts_of(&h.daemon, &ephemeral), cgroups_of(&ephemeral));
}

#[tokio::test(flavor = "multi_thread")]
async fn signal_exec_reaches_the_whole_tree() {
    let h = Harness::start().await;
    let c = &h.client;
    let id = h.sandbox().await;
    let script = ["sh", "-c", "sleep 300 & sleep 300; echo unreachable"];

    // Signalled once its processes are up: the whole tree gets it.
    let bg = h.exec(ExecRequest { background: true, ..exec_request(&id, script) }).await;
    assert_eq!(status(&bg), ExecStatus::Running, "{}", describe(&bg));
    let up = eventually(5, || async { h.sh_ok(&id, "ps -o args").await.lines().filter(|l| l.trim() == "sleep 300").count() == 2 }).await;
    assert!(up, "the background exec's processes never showed up");
    c.signal_exec(&bg.exec_id, 15).await.expect("SignalExec");
    let done = within(10, c.get_exec(&bg.exec_id, true)).await.expect("GetExec wait");
    assert_eq!((status(&done), done.exit_code, done.signal), (ExecStatus::Signaled, 143, 15), "{}", describe(&done));
    let quiet = eventually(5, || async { !h.sh_ok(&id, "ps -o args").await.contains("sleep 300") }).await;
    assert!(quiet, "SignalExec left part of the tree running:\n{}", h.sh_ok(&id, "ps -o args").await);
    let err = c.signal_exec(&bg.exec_id, 15).await.expect_err("signal to an ended exec");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    let err = c.signal_exec(&bg.exec_id, 0).await.expect_err("signal 0");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");

    // Signalled the moment the background Exec returns (as `sbx exec --background` followed by
    // `sbx kill` does): a SignalExec that answers OK must have reached the command. Twenty at
    // once, because a lost signal is a race and one try may win it by luck.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (c, id) = (c.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            let bg = within(30, c.exec(ExecRequest { background: true, ..exec_request(&id, ["sleep", "300"]) })).await.expect("Exec");
            assert_eq!(status(&bg), ExecStatus::Running, "{}", describe(&bg));
            if let Err(e) = c.signal_exec(&bg.exec_id, 15).await {
                // Clean up so the sandbox does not keep it; the failure is reported below.
                let _ = eventually(5, || async { c.signal_exec(&bg.exec_id, 9).await.is_ok() }).await;
                return format!("{}: SignalExec of an exec reported RUNNING failed: {e}", bg.exec_id);
            }
            match tokio::time::timeout(Duration::from_secs(10), c.get_exec(&bg.exec_id, true)).await {
                Ok(Ok(r)) if (status(&r), r.signal) == (ExecStatus::Signaled, 15) => String::new(),
                Ok(Ok(r)) => format!("{}: ended unexpectedly: {}", bg.exec_id, describe(&r)),
                Ok(Err(e)) => format!("{}: GetExec failed: {e}", bg.exec_id),
                Err(_) => format!("{}: SignalExec answered OK but the exec still ran 10 s later", bg.exec_id),
            }
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        let outcome = task.await.expect("task");
        if !outcome.is_empty() {
            failures.push(outcome);
        }
    }
    assert!(failures.is_empty(), "signalling 20 background execs right after they started:\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 7. Timeouts.

#[tokio::test(flavor = "multi_thread")]
async fn timeout_kills_the_whole_tree() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 500, ..exec_request(&id, ["sleep", "30"]) }).await;
    let elapsed = t0.elapsed();
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::TimedOut, 137, 9), "{}", describe(&r));
    assert!(elapsed < Duration::from_secs(5), "a 500 ms timeout returned after {elapsed:?}");
    assert!(elapsed >= Duration::from_millis(450), "a 500 ms timeout fired after {elapsed:?}");

    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 500, ..exec_request(&id, ["sh", "-c", "sleep 300 & sleep 300"]) }).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
    assert!(t0.elapsed() < Duration::from_secs(5), "returned after {:?}", t0.elapsed());
    let ps = h.sh_ok(&id, "ps -o args").await;
    assert!(!ps.contains("sleep"), "a timed-out exec left processes behind:\n{ps}");

    // The sandbox's default timeout applies when the exec gives none.
    let id = h.sandbox_with("minimal", ResourceLimits { exec_timeout_ms: 400, ..Default::default() }).await;
    let r = h.exec(exec_request(&id, ["sleep", "30"])).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
}

// ---------------------------------------------------------------------------------------------
// 8. Streaming.

#[tokio::test(flavor = "multi_thread")]
async fn exec_stream_delivers_output_in_order_then_the_result() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let t0 = Instant::now();
    let stream =
        within(10, h.client.exec_stream(exec_request(&id, ["sh", "-c", "echo a; sleep 0.5; echo b >&2; sleep 0.5; echo c"]))).await.expect("ExecStream");
    let Streamed { events, first_stdout_at: first_at, result, result_at } = read_stream(stream, t0).await;
    assert_eq!(events, ["out:a\n", "err:b\n", "out:c\n"]);
    let r = result.expect("the stream ends with a result");
    assert_exited(&r, 0);
    assert!(r.stdout.is_empty() && r.stderr.is_empty(), "the result repeats streamed output: {}", describe(&r));
    assert_eq!((r.stdout_total_bytes, r.stderr_total_bytes), (4, 2));
    let (first_at, result_at) = (first_at.expect("stdout arrived"), result_at.expect("result arrived"));
    assert!(
        result_at.saturating_sub(first_at) >= Duration::from_millis(800),
        "the first line arrived at {first_at:?}, the result at {result_at:?}: output is not streamed as it is produced"
    );

    // The last event is the result for every kind of end.
    let cases: [(ExecRequest, ExecStatus); 3] = [
        (exec_request(&id, ["sh", "-c", "echo x; exit 7"]), ExecStatus::Exited),
        (ExecRequest { timeout_ms: 300, ..exec_request(&id, ["sh", "-c", "echo x; sleep 30"]) }, ExecStatus::TimedOut),
        (exec_request(&id, ["no-such-command"]), ExecStatus::SpawnFailed),
    ];
    for (request, expected) in cases {
        let argv = request.argv.clone();
        let stream = within(10, h.client.exec_stream(request)).await.expect("ExecStream");
        let mut events = Vec::new();
        let mut stream = stream;
        while let Some(e) = within(30, stream.next_event()).await.expect("stream event") {
            events.push(e.event.expect("an event"));
        }
        match events.last() {
            Some(exec_event::Event::Result(r)) => assert_eq!(status(r), expected, "{argv:?}: {}", describe(r)),
            other => panic!("{argv:?}: the stream ended with {other:?}, not a result"),
        }
        let results = events.iter().filter(|e| matches!(e, exec_event::Event::Result(_))).count();
        assert_eq!(results, 1, "{argv:?}: {results} results in one stream");
    }

    // A stream for an unknown sandbox is a NOT_FOUND.
    let err = match h.client.exec_stream(exec_request("sb-doesnotexist1", ["true"])).await {
        Err(e) => e,
        Ok(s) => s.into_result().await.expect_err("unknown sandbox"),
    };
    assert_eq!(err.code(), Code::NotFound, "{err}");
}

// ---------------------------------------------------------------------------------------------
// 9. A client that goes away takes its exec with it.

#[tokio::test(flavor = "multi_thread")]
async fn dropped_stream_kills_the_exec() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    let argv = ["sh", "-c", "echo started; sleep 300"];
    {
        let dedicated = h.daemon.client().await.expect("second client");
        let mut stream = within(10, dedicated.exec_stream(exec_request(&id, argv))).await.expect("ExecStream");
        let first = within(10, stream.next_event()).await.expect("first event").expect("an event");
        assert!(matches!(&first.event, Some(exec_event::Event::Stdout(b)) if b == b"started\n"), "{first:?}");
        // Dropping both ends the HTTP/2 stream and the connection.
    }
    let exec_of = |execs: Vec<ExecResult>| execs.into_iter().find(|e| e.argv == argv);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (record, ended) = loop {
        let execs = h.client.list_execs(&id, 0).await.expect("ListExecs");
        let record = exec_of(execs).expect("the dropped exec is recorded");
        let ended = status(&record) != ExecStatus::Running;
        if ended || Instant::now() > deadline {
            break (record, ended);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(ended, "the exec of a client that went away still runs: {}", describe(&record));
    let ps = h.sh_ok(&id, "ps -o args").await;
    assert!(!ps.contains("sleep 300"), "the dropped exec's process lives on:\n{ps}");
    let got = h.client.get_exec(&record.exec_id, false).await.expect("GetExec");
    assert_ne!(status(&got), ExecStatus::Running);
}

// ---------------------------------------------------------------------------------------------
// 10. Cleanup: nothing is left on the host.

#[tokio::test(flavor = "multi_thread")]
async fn graceful_stop_leaves_no_mounts_or_cgroups() {
    let mut h = Harness::start().await;
    let ids = [h.sandbox().await, h.sandbox().await, h.sandbox().await];
    for id in &ids {
        assert!(!mounts_of(&h.daemon, id).is_empty(), "no rootfs mount found for live sandbox {id}");
        assert!(!cgroups_of(id).is_empty(), "no cgroup found for live sandbox {id}");
    }
    // A sandbox with something running in the background at stop time.
    h.sh_ok(&ids[1], "sleep 300 & echo started").await;

    within(30, h.client.destroy(&ids[0])).await.expect("DestroySandbox");
    assert!(mounts_of(&h.daemon, &ids[0]).is_empty(), "destroy left mounts: {:?}", mounts_of(&h.daemon, &ids[0]));
    assert!(cgroups_of(&ids[0]).is_empty(), "destroy left cgroups: {:?}", cgroups_of(&ids[0]));

    // The daemon's own cgroups, found through a live sandbox's: `sandboxd-<hash>` holds the
    // process and container tiers' sandboxes, `sandboxd-<hash>-vm` the microVM tier's QEMUs.
    let daemon_cgroup = cgroups_of(&ids[1])
        .iter()
        .flat_map(|p| p.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect::<Vec<_>>())
        .find(|c| c.starts_with("sandboxd-"))
        .expect("a sandbox cgroup below the daemon's");
    let daemon_cgroups = || {
        let names = [daemon_cgroup.clone(), format!("{daemon_cgroup}-vm")];
        find_under(Path::new("/sys/fs/cgroup"), |p, ft| ft.is_dir() && p.file_name().is_some_and(|n| names.iter().any(|d| n == d.as_str())))
    };
    assert!(!daemon_cgroups().is_empty(), "the daemon's cgroup {daemon_cgroup} not found while it runs");

    let state_dir = h.daemon.state_dir();
    let status = h.daemon.stop().expect("stopping sandboxd");
    assert!(status.success(), "sandboxd exited with {status} on SIGTERM; log:\n{}", h.daemon.log());
    assert!(mounts_under(&state_dir).is_empty(), "mounts left after stop: {:?}", mounts_under(&state_dir));
    for id in &ids {
        assert!(cgroups_of(id).is_empty(), "cgroups of {id} left after stop: {:?}", cgroups_of(id));
    }
    assert!(daemon_cgroups().is_empty(), "the daemon's cgroups left after stop: {:?}", daemon_cgroups());
    let leftover_runs: Vec<_> = std::fs::read_dir(state_dir.join("run")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(leftover_runs.is_empty(), "run dirs left after stop: {leftover_runs:?}");
    let socket = h.daemon.address.trim_start_matches("unix://").to_string();
    assert!(!Path::new(&socket).exists(), "the socket {socket} is left after stop");
}

/// Host pids in the cgroups named after `sandbox_id` (any controller).
fn host_pids_of(sandbox_id: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for dir in cgroups_of(sandbox_id) {
        for sub in std::iter::once(dir.clone()).chain(dirs_named(&dir, "")) {
            let procs = std::fs::read_to_string(sub.join("cgroup.procs")).unwrap_or_default();
            pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn is_sleep_300(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).map(|c| c == b"sleep\x00300\x00").unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_after_kill9_leaves_no_orphans() {
    let mut h = Harness::start().await;
    let old = h.sandbox().await;
    h.client.write_file(&old, "/workspace/keep.txt", b"kept".to_vec(), 0).await.expect("WriteFile");
    h.sh_ok(&old, "sleep 300 & echo started").await;
    let running = h.exec(ExecRequest { background: true, ..exec_request(&old, ["sleep", "300"]) }).await;
    assert_eq!(status(&running), ExecStatus::Running, "{}", describe(&running));
    assert!(!mounts_of(&h.daemon, &old).is_empty(), "no rootfs mount for {old}");
    // The background exec returned at once; give its process a moment to appear.
    let sleepers = || host_pids_of(&old).into_iter().filter(|p| is_sleep_300(*p)).collect::<Vec<u32>>();
    let both = eventually(5, || async { sleepers().len() == 2 }).await;
    let sleepers = sleepers();
    assert!(both, "expected the two sleeps among the host pids of {old}, found {sleepers:?}");

    h.daemon.kill9();
    within(60, h.daemon.restart()).await.expect("restarting sandboxd on the same state dir");
    h.client = h.daemon.client().await.expect("reconnecting");

    // Whatever became of the old sandbox, its processes died with the daemon that ran them.
    let dead = eventually(10, || async { !sleepers.iter().any(|p| is_sleep_300(*p)) }).await;
    assert!(dead, "processes of the killed daemon's sandbox still run on the host: {sleepers:?}");

    // The API has not settled whether a restarted daemon re-adopts its predecessor's sandboxes
    // or destroys them; either way what it reports and what the host holds must agree.
    let listed: Vec<String> = h.client.list(HashMap::new()).await.expect("ListSandboxes").into_iter().map(|s| s.id).collect();
    if listed.contains(&old) {
        let sandbox = h.client.get(&old).await.expect("GetSandbox");
        assert_eq!(sandbox.state, SandboxState::Running as i32, "re-adopted sandbox: {sandbox:?}");
        assert_eq!(listed, vec![old.clone()]);
        assert_eq!(h.sh_ok(&old, "cat /workspace/keep.txt").await, "kept", "a re-adopted sandbox keeps its files");
        let ps = h.sh_ok(&old, "ps -o args").await;
        assert!(!ps.contains("sleep 300"), "the old processes are still inside:\n{ps}");
        let lost = h.client.get_exec(&running.exec_id, false).await.expect("GetExec of the exec the crash interrupted");
        assert_eq!(status(&lost), ExecStatus::Lost, "{}", describe(&lost));
        assert_eq!(mounts_of(&h.daemon, &old).len(), 1, "mounts of the re-adopted sandbox: {:?}", mounts_of(&h.daemon, &old));
        within(30, h.client.destroy(&old)).await.expect("DestroySandbox");
    } else {
        assert!(listed.is_empty(), "unexpected sandboxes after restart: {listed:?}");
        assert_eq!(h.client.get(&old).await.expect_err("old sandbox").code(), Code::NotFound);
    }
    assert!(mounts_of(&h.daemon, &old).is_empty(), "the old sandbox's rootfs is still mounted: {:?}", mounts_of(&h.daemon, &old));
    let gone = eventually(10, || async { cgroups_of(&old).is_empty() }).await;
    assert!(gone, "the old sandbox's cgroups are still there: {:?}", cgroups_of(&old));

    let new = h.sandbox().await;
    assert_eq!(h.sh_ok(&new, "echo works").await, "works\n");
    assert_eq!(h.sh_ok(&new, "ls -A /workspace | wc -l").await.trim(), "0", "a new sandbox starts empty");
}

// ---------------------------------------------------------------------------------------------
// 11. Concurrency.

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_execs_across_sandboxes() {
    let h = Harness::start().await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(h.sandbox().await);
    }
    for (i, id, r) in tagged_execs_at_once(&h.client, &ids, 20).await {
        assert_exited(&r, 0);
        assert_eq!(text(&r.stdout), format!("exec {i} {id}\n"), "exec {i} got another exec's output");
        assert_eq!(r.stderr, b"done\n");
        assert_eq!(r.sandbox_id, id);
    }
    for id in &ids {
        assert_eq!(h.client.list_execs(id, 0).await.expect("ListExecs").len(), 5, "{id} should have 5 exec records");
    }
}

// ---------------------------------------------------------------------------------------------
// 12. The socket.

#[tokio::test(flavor = "multi_thread")]
async fn unix_socket_is_private_to_root() {
    let h = Harness::start().await;
    let path = h.daemon.address.strip_prefix("unix://").expect("a unix address").to_string();
    let meta = std::fs::metadata(&path).expect("socket exists");
    assert!(meta.file_type().is_socket(), "{path} is not a socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode is {:o}", meta.permissions().mode() & 0o777);
}
