//! The tier-conformance suite: one end-to-end suite, run for every isolation tier, checking that
//! each gives users the same API semantics — exec (output, exit codes, stdin, env, workdir,
//! start failures, timeouts, caps and spill, streaming), limits (memory, pids), bad input,
//! files (atomic overwrites under a full disk included), snapshots and rollback, forks, and a
//! daemon killed with SIGKILL and restarted.
//!
//! Each case is a function taking the isolation level; [`conformance!`] instantiates all of
//! them as `#[tokio::test]`s in a module per tier, so `cargo test --test conformance container`
//! runs one tier. Every test starts its own daemon (its own state dir), so they run in parallel.
//! Nothing skips: a tier the host cannot serve makes its tests fail with the daemon's reason —
//! CI runs as root with Docker and QEMU, where every tier here must work (MICROVM under TCG when
//! KVM does not work on the host).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, ExecRequest, ExecStatus, Isolation, ResourceLimits, SandboxState};
use sandbox_tests::{
    assert_exited, assert_hello_file_reads_back, assert_paths_stay_inside, describe, eventually, read_stream, status, tagged_execs_at_once, text, within,
    Streamed,
};
use tonic::Code;

// ---------------------------------------------------------------------------------------------
// Harness.

/// The shared harness (a daemon, a client, the daemon's log printed on a failing assertion) and
/// the tier under test. Its own `sandbox`/`sandbox_with` create in that tier. On drop the daemon
/// is stopped and, for the container tier, its containers removed (a stopped daemon keeps them
/// for re-adoption, and a test's state dir is never reused).
struct Harness {
    inner: sandbox_tests::Harness,
    isolation: Isolation,
}

impl Deref for Harness {
    type Target = sandbox_tests::Harness;

    fn deref(&self) -> &sandbox_tests::Harness {
        &self.inner
    }
}

impl DerefMut for Harness {
    fn deref_mut(&mut self) -> &mut sandbox_tests::Harness {
        &mut self.inner
    }
}

impl Harness {
    async fn start(isolation: Isolation) -> Harness {
        Harness { inner: sandbox_tests::Harness::start().await, isolation }
    }

    fn request(&self, limits: ResourceLimits) -> CreateSandboxRequest {
        CreateSandboxRequest { isolation: self.isolation as i32, image: "minimal".into(), limits: Some(limits), ..Default::default() }
    }

    /// Creates a sandbox of the tier under test; a tier the host cannot serve fails the test
    /// with the daemon's reason.
    async fn create(&self, request: CreateSandboxRequest) -> String {
        let sandbox = match within(120, self.client.create(request)).await {
            Ok(s) => s,
            Err(e) if e.code() == Code::FailedPrecondition => panic!("the {:?} tier is unavailable on this host: {e}", self.isolation),
            Err(e) => panic!("CreateSandbox: {e}"),
        };
        assert_eq!(sandbox.isolation, self.isolation as i32, "{sandbox:?}");
        assert_eq!(sandbox.state, SandboxState::Running as i32, "{sandbox:?}");
        sandbox.id
    }

    async fn sandbox_with(&self, limits: ResourceLimits) -> String {
        self.create(self.request(limits)).await
    }

    async fn sandbox(&self) -> String {
        self.sandbox_with(ResourceLimits::default()).await
    }

    /// A `debian` sandbox (python3, pytest, pytest-xdist) of the tier under test; returns the
    /// whole record, whose limits are the effective ones.
    async fn debian(&self, limits: ResourceLimits) -> agent_client::proto::Sandbox {
        let request = CreateSandboxRequest { image: "debian".into(), ..self.request(limits) };
        let id = self.create(request).await;
        self.client.get(&id).await.expect("GetSandbox")
    }
}

/// Instantiates every case of the suite for one tier, as `<tier>::<case>`.
macro_rules! conformance {
    ($tier:ident, $isolation:expr) => {
        mod $tier {
            use super::*;

            cases!(
                $isolation;
                exec_semantics,
                execs_run_as_the_requested_user,
                timeout_kills_the_whole_tree,
                output_cap_spill_and_streaming,
                memory_and_pid_limits,
                bad_input_and_path_escapes,
                files_round_trip,
                atomic_write_refused_by_the_quota_leaves_the_old_file,
                snapshot_rollback_and_forks,
                concurrent_execs_keep_their_output,
                kill9_restart_readopts,
                shm_is_sized_from_the_memory_limit,
                cpu_count_follows_the_cpu_limit,
                hostname_resolves_and_matches_etc_hostname,
                own_cgroup_is_visible_read_only,
                df_shows_what_the_tier_can,
                get_sandbox_reports_what_it_uses,
            );
        }
    };
}

/// One `#[tokio::test]` per case, running the suite's function of that name for the tier.
macro_rules! cases {
    ($isolation:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread")]
            async fn $case() {
                super::$case($isolation).await
            }
        )+
    };
}

conformance!(process, Isolation::Process);
conformance!(container, Isolation::Container);
conformance!(microvm, Isolation::Microvm);

// ---------------------------------------------------------------------------------------------
// Exec.

async fn exec_semantics(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let mut request = h.request(ResourceLimits::default());
    request.env = HashMap::from([("FROM_SANDBOX".into(), "sb".into()), ("OVERRIDDEN".into(), "sb".into())]);
    let id = h.create(request).await;

    // Output, exit codes, the record's metadata.
    let r = h.exec(exec_request(&id, ["echo", "hello"])).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"hello\n");
    assert!(r.stderr.is_empty() && r.error.is_empty(), "{}", describe(&r));
    assert_eq!((r.sandbox_id.as_str(), r.signal, r.stdout_total_bytes), (id.as_str(), 0, 6));
    assert_exited(&h.sh(&id, "exit 3").await, 3);
    let r = h.sh(&id, "echo to-stderr >&2; exit 42").await;
    assert_exited(&r, 42);
    assert_eq!(r.stderr, b"to-stderr\n");
    let r = h.sh(&id, "kill -TERM $$").await;
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::Signaled, 143, 15), "{}", describe(&r));

    // Stdin, small and bigger than a pipe buffer; none at all reads as EOF.
    let r = h.exec(ExecRequest { stdin: b"line one\nline two\n".to_vec(), ..exec_request(&id, ["cat"]) }).await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"line one\nline two\n");
    let r = h.exec(ExecRequest { stdin: vec![b'z'; 1 << 20], ..exec_request(&id, ["wc", "-c"]) }).await;
    assert_eq!(text(&r.stdout).trim(), "1048576", "{}", describe(&r));
    let r = within(10, h.client.exec(exec_request(&id, ["cat"]))).await.expect("cat without stdin returns");
    assert_exited(&r, 0);

    // Env: the sandbox's is the default, the exec's wins, and nothing else leaks in.
    let r = h
        .exec(ExecRequest {
            env: HashMap::from([("OVERRIDDEN".into(), "exec".into()), ("FROM_EXEC".into(), "ex".into())]),
            ..exec_request(&id, ["sh", "-c", "echo $FROM_SANDBOX $OVERRIDDEN $FROM_EXEC"])
        })
        .await;
    assert_eq!(text(&r.stdout), "sb exec ex\n", "{}", describe(&r));
    assert_eq!(h.sh_ok(&id, "echo $OVERRIDDEN").await, "sb\n", "the exec override must not stick");
    let env = h.exec(exec_request(&id, ["env"])).await;
    let mut names: Vec<String> = text(&env.stdout).lines().filter_map(|l| l.split_once('=')).map(|(k, _)| k.to_string()).collect();
    names.sort();
    assert_eq!(names, ["FROM_SANDBOX", "HOME", "HOSTNAME", "LANG", "OVERRIDDEN", "PATH"], "{}", describe(&env));
    // Every exec gets a UTF-8 locale unless the image or the request sets LANG (#15).
    assert!(text(&env.stdout).lines().any(|l| l == "LANG=C.UTF-8"), "{}", describe(&env));

    // Workdir: /workspace by default, per exec when asked; the hostname is the sandbox id.
    assert_eq!(h.exec(exec_request(&id, ["pwd"])).await.stdout, b"/workspace\n");
    let r = h.exec(ExecRequest { workdir: "/tmp".into(), ..exec_request(&id, ["pwd"]) }).await;
    assert_eq!(r.stdout, b"/tmp\n", "{}", describe(&r));
    assert_eq!(h.exec(exec_request(&id, ["hostname"])).await.stdout, format!("{id}\n").into_bytes());

    // Commands that cannot start are results with the same codes and sentences on every tier.
    let r = h.exec(exec_request(&id, ["does-not-exist-anywhere"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    assert_eq!(r.error, "executable not found: does-not-exist-anywhere");
    assert!(r.stderr.is_empty() && r.stdout.is_empty(), "{}", describe(&r));
    let r = h.exec(exec_request(&id, ["/bin/nope"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    h.client.write_file(&id, "/workspace/script.sh", b"#!/bin/sh\necho should-not-run\n".to_vec(), 0o644).await.expect("WriteFile");
    let r = h.exec(exec_request(&id, ["/workspace/script.sh"])).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 126), "{}", describe(&r));
    assert_eq!(r.error, "permission denied: /workspace/script.sh is not executable");
    let r = h.exec(ExecRequest { workdir: "/no/such/dir".into(), ..exec_request(&id, ["pwd"]) }).await;
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    assert_eq!(r.error, "cannot enter working directory /no/such/dir: No such file or directory");
    // A command that exits 127 by itself is not a start failure.
    assert_exited(&h.sh(&id, "exit 127").await, 127);

    // A background grandchild holding stdout does not hold the exec; it is the user's, it lives.
    let t0 = Instant::now();
    let r = h.sh(&id, "sleep 30 & echo done").await;
    assert_exited(&r, 0);
    assert_eq!(r.stdout, b"done\n");
    assert!(t0.elapsed() < Duration::from_secs(2), "the exec waited {:?} for a background sleep", t0.elapsed());
    assert!(h.sh_ok(&id, "ps -o args").await.contains("sleep 30"), "the background sleep is gone");

    // Per-exec CPU time.
    let r = h.sh(&id, "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; echo $i").await;
    assert_eq!(r.stdout, b"200000\n", "{}", describe(&r));
    assert!(r.cpu_user_ms > 0, "a busy loop reported cpu_user_ms=0: {}", describe(&r));
    assert!(r.cpu_user_ms + r.cpu_system_ms <= r.duration_ms + 200, "more CPU than wall time: {}", describe(&r));
}

async fn execs_run_as_the_requested_user(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let c = &h.client;
    let as_user = |sb: &str, user: &str, script: &str| ExecRequest { user: user.into(), ..exec_request(sb, ["sh", "-c", script]) };
    let ids = "echo $(id -u):$(id -g):$(id -G)";
    // The sandbox's default is root; an exec may name a user of the image, or bare numbers.
    let sb = h.sandbox().await;
    assert_eq!(h.sh_ok(&sb, ids).await, "0:0:0\n");
    let r = c.exec(as_user(&sb, "nobody", ids)).await.expect("exec");
    assert_eq!((status(&r), String::from_utf8_lossy(&r.stdout).as_ref()), (ExecStatus::Exited, "65534:65534:65534\n"), "{}", describe(&r));
    let r = c.exec(as_user(&sb, "1234:nogroup", ids)).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "1234:65534:65534\n", "{}", describe(&r));
    // Not root any more: no capability left to read root's files or write the image's.
    h.sh_ok(&sb, "echo secret > /root/only-root && chmod 600 /root/only-root").await;
    let r = c.exec(as_user(&sb, "nobody", "cat /root/only-root")).await.expect("exec");
    assert!(r.exit_code != 0 && r.stdout.is_empty(), "nobody read root's file: {}", describe(&r));
    let r = c.exec(as_user(&sb, "nobody", "touch /etc/x")).await.expect("exec");
    assert_ne!(r.exit_code, 0, "nobody wrote /etc: {}", describe(&r));
    // HOME: root's for root, else the user's own from the sandbox's /etc/passwd (as Docker
    // does), unless the env sets one.
    assert_eq!(h.sh_ok(&sb, "echo $HOME").await, "/root\n");
    let r = c.exec(as_user(&sb, "nobody", "echo $HOME")).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "/nonexistent\n", "{}", describe(&r));
    h.sh_ok(&sb, "echo 'app:x:1000:1000::/home/app:/bin/sh' >> /etc/passwd && mkdir -p /home/app && chown 1000:1000 /home/app").await;
    let r = c.exec(as_user(&sb, "app", "cd && touch own-file && echo $HOME && pwd")).await.expect("exec");
    assert_eq!((r.exit_code, String::from_utf8_lossy(&r.stdout).as_ref()), (0, "/home/app\n/home/app\n"), "{}", describe(&r));
    let r = c.exec(ExecRequest { env: [("HOME".to_string(), "/tmp".to_string())].into(), ..as_user(&sb, "app", "echo $HOME") }).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "/tmp\n", "{}", describe(&r));
    // A user the sandbox does not know: the same record on every tier, and nothing ran.
    let r = c.exec(as_user(&sb, "ghost", "touch /tmp/ran")).await.expect("exec");
    assert_eq!((status(&r), r.exit_code), (ExecStatus::SpawnFailed, 126), "{}", describe(&r));
    assert_eq!(r.error, "user \"ghost\" is not in the sandbox's /etc/passwd or /etc/group");
    assert_eq!(h.sh(&sb, "test -e /tmp/ran").await.exit_code, 1);
    let bad = c.exec(as_user(&sb, "a:b:c", "true")).await.expect_err("malformed user");
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad}");
    assert!(bad.to_string().contains("user"), "{bad}");

    // A sandbox's user is every exec's default (an exec may still ask for root), and a fork
    // inherits it.
    let sb = h.create(CreateSandboxRequest { user: "nobody".into(), ..h.request(ResourceLimits::default()) }).await;
    assert_eq!(c.get(&sb).await.expect("get").user, "nobody");
    assert_eq!(h.sh_ok(&sb, ids).await, "65534:65534:65534\n");
    let r = c.exec(as_user(&sb, "root", ids)).await.expect("exec");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "0:0:0\n", "{}", describe(&r));
    let snap = within(60, c.snapshot(&sb, "u")).await.expect("snapshot");
    let fork = within(120, c.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id, ..Default::default() })).await.expect("fork");
    assert_eq!(h.sh_ok(&fork.id, ids).await, "65534:65534:65534\n");
}

async fn timeout_kills_the_whole_tree(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let id = h.sandbox().await;
    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 500, ..exec_request(&id, ["sleep", "30"]) }).await;
    let elapsed = t0.elapsed();
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::TimedOut, 137, 9), "{}", describe(&r));
    assert!((Duration::from_millis(450)..Duration::from_secs(5)).contains(&elapsed), "a 500 ms timeout returned after {elapsed:?}");

    // The whole tree goes, also what left the process group and session.
    let r = h.exec(ExecRequest { timeout_ms: 700, ..exec_request(&id, ["sh", "-c", "sleep 300 & (setsid sleep 301 &); sleep 302"]) }).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
    let ps = h.sh_ok(&id, "ps -o args").await;
    assert!(!ps.contains("sleep 30"), "a timed-out exec left processes behind:\n{ps}");

    // SignalExec reaches the whole tree of a background exec.
    let bg = h.exec(ExecRequest { background: true, ..exec_request(&id, ["sh", "-c", "sleep 303 & sleep 304"]) }).await;
    assert_eq!(status(&bg), ExecStatus::Running, "{}", describe(&bg));
    within(10, h.client.signal_exec(&bg.exec_id, 15)).await.expect("SignalExec");
    let ended = within(10, h.client.get_exec(&bg.exec_id, true)).await.expect("GetExec");
    assert_eq!((status(&ended), ended.signal), (ExecStatus::Signaled, 15), "{}", describe(&ended));
    let gone = eventually(5, || async { !h.sh_ok(&id, "ps -o args").await.contains("sleep 30") }).await;
    assert!(gone, "SignalExec missed part of the tree:\n{}", h.sh_ok(&id, "ps -o args").await);

    // The sandbox's default timeout applies when the exec gives none.
    let id = h.sandbox_with(ResourceLimits { exec_timeout_ms: 400, ..Default::default() }).await;
    let r = h.exec(exec_request(&id, ["sleep", "30"])).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
}

async fn output_cap_spill_and_streaming(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let id = h.sandbox().await;
    let r = h.exec(ExecRequest { max_output_bytes: 4096, ..exec_request(&id, ["sh", "-c", "yes | head -c 5000000; echo err >&2"]) }).await;
    assert_exited(&r, 0);
    assert!(r.stdout_truncated, "{}", describe(&r));
    assert_eq!(r.stdout_total_bytes, 5_000_000);
    assert!((1024..=4096).contains(&r.stdout.len()), "kept {} bytes of stdout with a 4096 cap", r.stdout.len());
    assert!(r.stdout.starts_with(b"y\ny\n") && r.stdout.ends_with(b"y\n"), "{}", describe(&r));
    assert!(!r.stderr_truncated && r.stderr_spill_path.is_empty() && r.stderr == b"err\n", "{}", describe(&r));
    assert!(r.stdout_spill_path.starts_with("/tmp/.sandboxd/"), "spill path {:?}", r.stdout_spill_path);
    let wc = h.exec(exec_request(&id, ["wc", "-c", &r.stdout_spill_path])).await;
    assert_eq!(text(&wc.stdout).split_whitespace().next(), Some("5000000"), "{}", describe(&wc));
    let head = h.client.read_file(&id, r.stdout_spill_path.as_str(), 0, 6).await.expect("ReadFile of the spill");
    assert_eq!((head.content.as_slice(), head.size), (&b"y\ny\ny\n"[..], 5_000_000));
    let r = h.exec(ExecRequest { max_output_bytes: 4096, ..exec_request(&id, ["sh", "-c", "yes | head -c 4096"]) }).await;
    assert!(!r.stdout_truncated && r.stdout.len() == 4096 && r.stdout_spill_path.is_empty(), "{}", describe(&r));

    // Streaming: events in the order they were produced, as they are produced, then one result.
    let t0 = Instant::now();
    let stream =
        within(10, h.client.exec_stream(exec_request(&id, ["sh", "-c", "echo a; sleep 0.5; echo b >&2; sleep 0.5; echo c"]))).await.expect("ExecStream");
    let Streamed { events, first_stdout_at: first_at, result, result_at } = read_stream(stream, t0).await;
    assert_eq!(events, ["out:a\n", "err:b\n", "out:c\n"]);
    let r = result.expect("the stream ends with a result");
    assert_exited(&r, 0);
    assert!(r.stdout.is_empty() && r.stderr.is_empty(), "the result repeats streamed output: {}", describe(&r));
    let (first_at, result_at) = (first_at.expect("stdout arrived"), result_at.expect("result arrived"));
    assert!(result_at.saturating_sub(first_at) >= Duration::from_millis(800), "first line at {first_at:?}, result at {result_at:?}: not streamed");
    // A start failure streams as a result too.
    let stream = within(10, h.client.exec_stream(exec_request(&id, ["no-such-command"]))).await.expect("ExecStream");
    let r = within(30, stream.into_result()).await.expect("result");
    assert_eq!(status(&r), ExecStatus::SpawnFailed, "{}", describe(&r));
}

// ---------------------------------------------------------------------------------------------
// Limits.

async fn memory_and_pid_limits(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let limit: u64 = 64 << 20;
    let id = h.sandbox_with(ResourceLimits { memory_bytes: limit, max_pids: 64, ..Default::default() }).await;

    // A memory bomb is OOM-killed and reported as such; the sandbox survives it. (dd touches its
    // 100 MB buffer at once: a byte-at-a-time pipe to the limit takes over a minute under TCG;
    // 100 MB, not more, so a microVM of 64 MiB + its overhead lets the allocation itself happen.)
    let bomb = ["dd", "if=/dev/zero", "of=/dev/null", "bs=100M", "count=1"];
    let r = h.exec(ExecRequest { timeout_ms: 60_000, ..exec_request(&id, bomb) }).await;
    assert_eq!((status(&r), r.exit_code, r.signal), (ExecStatus::OomKilled, 137, 9), "{}", describe(&r));
    assert!(r.peak_memory_bytes > 0 && r.peak_memory_bytes <= limit + limit / 8, "peak_memory_bytes {} with a {limit}-byte limit", r.peak_memory_bytes);
    assert_eq!(h.sh_ok(&id, "echo alive").await, "alive\n");
    // A modest allocation reports a peak of its own size, not the bomb's.
    let r = h.sh(&id, "x=$(head -c 8000000 /dev/zero | tr '\\0' a); echo ${#x}").await;
    assert_eq!(r.stdout, b"8000000\n", "{}", describe(&r));
    assert!((8_000_000..limit).contains(&r.peak_memory_bytes), "peak {} for an 8 MB string", r.peak_memory_bytes);

    // A fork bomb hits the pid limit: the exec ends, the daemon answers, the sandbox recovers.
    let t0 = Instant::now();
    let r = h.exec(ExecRequest { timeout_ms: 5_000, ..exec_request(&id, ["sh", "-c", "f(){ f|f& }; f; sleep 1"]) }).await;
    assert!(t0.elapsed() < Duration::from_secs(30), "the fork bomb exec took {:?}: {}", t0.elapsed(), describe(&r));
    assert!(h.client.list(HashMap::new()).await.is_ok(), "the daemon stopped answering");
    let ok = eventually(20, || async { h.exec(exec_request(&id, ["echo", "ok"])).await.stdout == b"ok\n" }).await;
    assert!(ok, "echo keeps failing after a fork bomb: {}", describe(&h.exec(exec_request(&id, ["echo", "ok"])).await));
    // One that keeps its exec busy is killed whole at the timeout, forking as fast as it may.
    // (The exec's own process only sleeps: a shell whose fork fails exits, ending the exec early.)
    let id = h.sandbox_with(ResourceLimits { max_pids: 64, ..Default::default() }).await;
    let r = h.exec(ExecRequest { timeout_ms: 3_000, ..exec_request(&id, ["sh", "-c", "f(){ f|f; sleep 100; }; f & exec sleep 100"]) }).await;
    assert_eq!(status(&r), ExecStatus::TimedOut, "{}", describe(&r));
    let ps = h.sh_ok(&id, "ps -o args").await;
    assert!(!ps.contains("sleep 100"), "the timed-out bomb left processes behind:\n{ps}");
}

// ---------------------------------------------------------------------------------------------
// Bad input.

async fn bad_input_and_path_escapes(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let c = &h.client;
    let id = h.sandbox().await;

    for bad in ["sb-doesnotexist1", "xyz", ""] {
        assert_eq!(c.get(bad).await.expect_err("unknown id").code(), Code::NotFound, "GetSandbox({bad:?})");
        assert_eq!(c.exec(exec_request(bad, ["true"])).await.expect_err("unknown id").code(), Code::NotFound, "Exec({bad:?})");
        assert_eq!(c.destroy(bad).await.expect_err("unknown id").code(), Code::NotFound, "Destroy({bad:?})");
        assert_eq!(c.read_file(bad, "/etc/passwd", 0, 0).await.expect_err("unknown id").code(), Code::NotFound, "ReadFile({bad:?})");
    }
    let err = c.exec(exec_request(&id, Vec::<String>::new())).await.expect_err("empty argv");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("argv"), "{err}");
    assert_eq!(c.exec(exec_request(&id, [""])).await.expect_err("empty argv[0]").code(), Code::InvalidArgument);
    for (limits, field) in [
        (ResourceLimits { memory_bytes: 1 << 50, ..Default::default() }, "memory_bytes"),
        (ResourceLimits { max_pids: 1 << 30, ..Default::default() }, "max_pids"),
        (ResourceLimits { cpu_millicores: u32::MAX, ..Default::default() }, "cpu_millicores"),
    ] {
        let err = c.create(h.request(limits)).await.expect_err("over the ceiling");
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
    let err = c.create(CreateSandboxRequest { image: "no-such-image".into(), ..h.request(ResourceLimits::default()) }).await.expect_err("unknown image");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    // A name that cannot be an image (a path trick) is malformed, not unknown.
    let err = c.create(CreateSandboxRequest { image: "../minimal".into(), ..h.request(ResourceLimits::default()) }).await.expect_err("image path trick");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("image"), "{err}");

    assert_paths_stay_inside(&h, &id).await;

    // After all that the daemon still answers and the sandbox works; failed creates left nothing.
    assert_eq!(c.list(HashMap::new()).await.expect("ListSandboxes").len(), 1);
    assert_eq!(h.exec(exec_request(&id, ["echo", "still here"])).await.stdout, b"still here\n");
}

// ---------------------------------------------------------------------------------------------
// Files.

async fn files_round_trip(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let c = &h.client;
    let id = h.sandbox().await;

    assert_hello_file_reads_back(c, &id).await;
    assert_eq!(h.sh_ok(&id, "stat -c %a /workspace/a/b/c/hello.txt; stat -c %a /workspace/a/b; cat /workspace/a/b/c/hello.txt").await, "640\n755\nhello world");
    // Existing parents keep their mode; relative paths are relative to the workdir; overwriting
    // truncates; an empty file reads as empty.
    h.sh_ok(&id, "mkdir -p /workspace/private && chmod 700 /workspace/private").await;
    c.write_file(&id, "private/f", b"p".to_vec(), 0).await.expect("WriteFile");
    assert_eq!(h.sh_ok(&id, "stat -c %a /workspace/private /workspace/private/f").await, "700\n644\n");
    c.write_file(&id, "rel.txt", b"a much longer first version".to_vec(), 0).await.expect("WriteFile");
    c.write_file(&id, "rel.txt", b"short".to_vec(), 0o755).await.expect("WriteFile");
    assert_eq!(h.sh_ok(&id, "stat -c %a /workspace/rel.txt; cat /workspace/rel.txt").await, "755\nshort");
    c.write_file(&id, "/workspace/empty", Vec::new(), 0).await.expect("WriteFile empty");
    let empty = c.read_file(&id, "/workspace/empty", 0, 0).await.expect("ReadFile empty");
    assert!(empty.content.is_empty() && empty.size == 0 && empty.eof, "{empty:?}");
    // What the sandbox writes, ReadFile reads, across several slices; and a 6 MiB round trip.
    h.sh_ok(&id, "seq 1 1000000 > /workspace/seq.txt").await;
    let expected: String = (1..=1_000_000).map(|i| format!("{i}\n")).collect();
    let got = within(60, c.read_file_all(&id, "/workspace/seq.txt")).await.expect("read_file_all");
    assert!(got == expected.as_bytes(), "seq.txt read back differs ({} bytes, want {})", got.len(), expected.len());
    let big: Vec<u8> = (0..(6u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    c.write_file(&id, "/workspace/big.bin", big.clone(), 0).await.expect("WriteFile 6 MiB");
    assert!(within(60, c.read_file_all(&id, "/workspace/big.bin")).await.expect("read_file_all") == big, "6 MiB round trip differs");

    // Directories, missing files, special files.
    let err = c.read_file(&id, "/workspace", 0, 0).await.expect_err("ReadFile of a directory");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = c.read_file(&id, "/workspace/missing.txt", 0, 0).await.expect_err("missing file");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    let err = c.write_file(&id, "/workspace/a", b"x".to_vec(), 0).await.expect_err("WriteFile over a directory");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert_eq!(h.sh_ok(&id, "ls /workspace/a").await, "b\n", "the directory is untouched");
    h.sh_ok(&id, "mkfifo /workspace/fifo").await;
    let err = within(10, c.read_file(&id, "/workspace/fifo", 0, 0)).await.expect_err("ReadFile of a FIFO");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = within(10, c.write_file(&id, "/workspace/fifo", b"x".to_vec(), 0)).await.expect_err("WriteFile to a FIFO");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert_eq!(h.sh_ok(&id, "test -p /workspace/fifo && echo fifo").await, "fifo\n", "the FIFO is left as it was");

    // A name over 255 bytes and a symlink loop are the caller's mistakes, not INTERNAL: both
    // name the path, for reads and writes alike.
    let long = format!("/workspace/{}", "n".repeat(300));
    h.sh_ok(&id, "ln -s loop-b /workspace/loop-a && ln -s loop-a /workspace/loop-b").await;
    for path in [long.as_str(), "/workspace/loop-a", "/workspace/loop-a/below"] {
        let err = within(10, c.write_file(&id, path, b"x".to_vec(), 0)).await.expect_err("WriteFile of a bad path");
        assert_eq!(err.code(), Code::InvalidArgument, "WriteFile({path:.40}…): {err}");
        assert!(err.to_string().contains(&path[..path.len().min(24)]), "WriteFile({path:.40}…) does not name the path: {err}");
        let err = within(10, c.read_file(&id, path, 0, 0)).await.expect_err("ReadFile of a bad path");
        assert_eq!(err.code(), Code::InvalidArgument, "ReadFile({path:.40}…): {err}");
        assert!(err.to_string().contains(&path[..path.len().min(24)]), "ReadFile({path:.40}…) does not name the path: {err}");
    }
}

/// A WriteFile over an existing file that the disk quota refuses leaves the old file as it was
/// (the new bytes go to a temporary file renamed over it only once they are all on disk).
async fn atomic_write_refused_by_the_quota_leaves_the_old_file(isolation: Isolation) {
    const DISK: u64 = 64 << 20;
    let h = Harness::start(isolation).await;
    let c = &h.client;
    let id = h.sandbox_with(ResourceLimits { disk_bytes: DISK, shm_bytes: DISK, ..Default::default() }).await;
    // Where a write can run out of room. The container tier caps its writable layer only where
    // Docker's storage driver can (not fuse-overlayfs, as on the reference host), so there the
    // container's /dev/shm — a tmpfs of shm_bytes, 64 MiB here — fills up instead: the same
    // atomic-replace path.
    let dir = if isolation == Isolation::Container { "/dev/shm" } else { "/workspace" };
    let keep = format!("{dir}/keep.bin");
    let old: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    c.write_file(&id, &keep, old.clone(), 0o640).await.expect("WriteFile of the first version");

    // Fill the disk from inside: more than disk_bytes, so the write must stop short (bounded, so
    // a tier that does not enforce disk_bytes fails here instead of filling the host's disk).
    let fill = format!("dd if=/dev/zero of={dir}/filler bs=1M count={} 2>&1; sync", (DISK >> 20) + 32);
    let r = within(120, h.sh(&id, &fill)).await;
    let filler: u64 = h.sh_ok(&id, &format!("stat -c %s {dir}/filler")).await.trim().parse().expect("a size");
    assert!(
        filler < DISK,
        "{isolation:?}: {filler} bytes written under disk_bytes = {DISK}: the tier does not enforce disk_bytes on this host ({})\n{}",
        describe(&r),
        h.daemon.log().lines().filter(|l| l.contains("disk_bytes")).collect::<Vec<_>>().join("\n")
    );

    let bigger = vec![7u8; 4 << 20];
    let err = within(60, c.write_file(&id, &keep, bigger.clone(), 0o600)).await.expect_err("an overwrite the full disk cannot hold");
    assert_eq!(err.code(), Code::ResourceExhausted, "{isolation:?}: {err}");
    let back = within(60, c.read_file_all(&id, &keep)).await.expect("ReadFile after the refused write");
    assert!(back == old, "{isolation:?}: the old file changed: {} bytes read back, {} expected", back.len(), old.len());
    assert_eq!(h.sh_ok(&id, &format!("stat -c %a {keep}")).await, "640\n", "the old mode is kept");
    assert_eq!(h.sh_ok(&id, &format!("ls -A {dir}")).await, "filler\nkeep.bin\n", "no temporary file is left behind");

    // With room again the overwrite goes through, whole.
    h.sh_ok(&id, &format!("rm -f {dir}/filler; sync")).await;
    let written = within(60, c.write_file(&id, &keep, bigger.clone(), 0o600)).await.expect("WriteFile once there is room");
    assert_eq!(written, bigger.len() as u64);
    assert!(within(60, c.read_file_all(&id, &keep)).await.expect("ReadFile") == bigger, "the new version reads back whole");
    assert_eq!(h.sh_ok(&id, &format!("stat -c %a {keep}; ls -A {dir}")).await, "600\nkeep.bin\n");
}

// ---------------------------------------------------------------------------------------------
// Snapshots, rollback, forks.

async fn snapshot_rollback_and_forks(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let c = &h.client;
    // Given non-default limits, env, labels and workdir, which its forks inherit.
    let parent = CreateSandboxRequest {
        env: HashMap::from([("FROM_PARENT".to_string(), "yes".to_string())]),
        labels: HashMap::from([("lineage".to_string(), "parent".to_string())]),
        workdir: "/workspace/wd".into(),
        ..h.request(ResourceLimits { memory_bytes: 384 << 20, max_pids: 200, ..Default::default() })
    };
    let sb = h.create(parent).await;
    let parent = c.get(&sb).await.expect("GetSandbox");
    h.sh_ok(&sb, "echo v1 > /workspace/keep; chmod 640 /workspace/keep; mkdir -p /workspace/d; echo x > /workspace/d/f").await;
    let t0 = Instant::now();
    let snap = within(60, c.snapshot(&sb, "before")).await.expect("snapshot");
    eprintln!("{isolation:?}: snapshot took {:?}", t0.elapsed());
    assert_eq!(snap.sandbox_id, sb);
    assert!(snap.size_bytes >= 5, "the snapshot holds the written bytes: {snap:?}");

    // Changes of every kind, and a process that must not survive.
    h.sh_ok(&sb, "echo v2 > /workspace/keep; chmod 777 /workspace/keep; rm -r /workspace/d; echo new > /workspace/new; rm /bin/ls").await;
    let bg = c.exec(ExecRequest { background: true, ..exec_request(&sb, ["sleep", "300"]) }).await.expect("background exec");
    assert_eq!(status(&bg), ExecStatus::Running);
    let t0 = Instant::now();
    let after = within(60, c.rollback(&sb, &snap.snapshot_id)).await.expect("rollback");
    eprintln!("{isolation:?}: rollback took {:?}", t0.elapsed());
    assert_eq!((after.id.as_str(), after.state), (sb.as_str(), SandboxState::Running as i32));
    assert_eq!(h.sh_ok(&sb, "cat /workspace/keep; stat -c %a /workspace/keep").await, "v1\n640\n");
    assert_eq!(h.sh_ok(&sb, "cat /workspace/d/f").await, "x\n", "deleted dir is back");
    assert_eq!(h.sh(&sb, "test -e /workspace/new").await.exit_code, 1, "new file gone");
    assert_eq!(h.sh(&sb, "test -e /bin/ls").await.exit_code, 0, "deleted image file back");
    assert!(!h.sh_ok(&sb, "ps -o args").await.contains("sleep 300"), "background process gone");
    let bg_end = within(10, c.get_exec(&bg.exec_id, true)).await.expect("GetExec");
    assert_eq!(status(&bg_end), ExecStatus::Lost, "{}", describe(&bg_end));
    assert!(bg_end.error.contains("rolled back"), "{}", bg_end.error);

    // Rolling back again (agents retry) works the same, and the lineage is kept.
    h.sh_ok(&sb, "echo v3 > /workspace/keep").await;
    let t0 = Instant::now();
    within(60, c.rollback(&sb, &snap.snapshot_id)).await.expect("second rollback");
    eprintln!("{isolation:?}: second rollback took {:?}", t0.elapsed());
    assert_eq!(h.sh_ok(&sb, "cat /workspace/keep").await, "v1\n");
    let again = within(60, c.snapshot(&sb, "after")).await.expect("second snapshot");
    assert_eq!(again.parent_snapshot_id, snap.snapshot_id, "lineage");
    let names: Vec<String> = c.list_snapshots(&sb).await.expect("list").into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["before", "after"]);

    // Forks: start from the snapshot, independent both ways, and they pin it.
    let mut forks = Vec::new();
    for _ in 0..2 {
        let t0 = Instant::now();
        let f = within(120, c.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() })).await.expect("fork");
        eprintln!("{isolation:?}: fork took {:?}", t0.elapsed());
        assert_eq!((f.parent_snapshot_id.as_str(), f.image.as_str(), f.isolation), (snap.snapshot_id.as_str(), "minimal", isolation as i32));
        assert_eq!((&f.limits, &f.labels, f.workdir.as_str()), (&parent.limits, &parent.labels, "/workspace/wd"), "a fork inherits its parent's settings");
        assert_eq!(h.sh_ok(&f.id, "echo $FROM_PARENT; pwd").await, "yes\n/workspace/wd\n");
        forks.push(f.id);
    }
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(h.sh_ok(f, "cat /workspace/keep; stat -c %a /workspace/keep; cat /workspace/d/f").await, "v1\n640\nx\n");
        h.sh_ok(f, &format!("echo fork{i} > /workspace/keep")).await;
    }
    h.sh_ok(&sb, "echo origin > /workspace/keep").await;
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(h.sh_ok(f, "cat /workspace/keep").await, format!("fork{i}\n"), "writes elsewhere never appear");
    }
    assert_eq!(h.sh_ok(&sb, "cat /workspace/keep").await, "origin\n");
    let refused = c.delete_snapshot(&snap.snapshot_id).await.expect_err("snapshot in use");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    for f in &forks {
        within(60, c.destroy(f)).await.expect("destroy fork");
    }
    within(60, c.delete_snapshot(&snap.snapshot_id)).await.expect("delete once no fork depends on it");
    let gone = c.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() }).await.expect_err("deleted");
    assert_eq!(gone.code(), Code::NotFound);
    assert_eq!(c.rollback(&sb, &snap.snapshot_id).await.expect_err("deleted").code(), Code::NotFound);
    // The sandbox is fine afterwards.
    assert_eq!(h.sh_ok(&sb, "echo ok").await, "ok\n");
}

/// GetSandbox's usage: CPU and memory on every tier, the process count where the host can see
/// the processes (not inside a microVM's guest), and the writable layer's bytes where the tier
/// measures them; ListSandboxes leaves it out.
async fn get_sandbox_reports_what_it_uses(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let id = h.sandbox().await;
    let before = h.client.get(&id).await.expect("GetSandbox").usage.expect("a running sandbox reports its usage");
    // Some CPU, two sleepers, and 8 MiB written (then synced: the process tier reads its layer's
    // size as of the last commit).
    h.sh_ok(
        &id,
        "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; (sleep 600 &) ; (sleep 601 &); dd if=/dev/zero of=/tmp/eight bs=1M count=8 2>/dev/null; sync",
    )
    .await;
    let after = h.client.get(&id).await.expect("GetSandbox").usage.expect("usage");
    assert!(after.cpu_user_ms + after.cpu_system_ms > before.cpu_user_ms + before.cpu_system_ms, "no CPU time counted: {before:?} → {after:?}");
    assert!(after.memory_bytes > 0 && after.peak_memory_bytes > 0, "no memory counted: {after:?}");
    match isolation {
        Isolation::Microvm => {
            assert_eq!(after.pids, None, "a microVM's guest processes are not the host's to count");
            assert!(after.disk_bytes.is_some(), "{after:?}");
        }
        Isolation::Process => {
            assert!(after.pids.expect("pids") >= 2, "the two sleepers: {after:?}");
            assert!(after.disk_bytes.expect("disk") >= 8 * MIB, "the 8 MiB written: {after:?}");
        }
        _ => assert!(after.pids.expect("pids") >= 2, "the two sleepers: {after:?}"),
    }
    let listed = h.client.list(Default::default()).await.expect("ListSandboxes");
    assert!(listed.iter().all(|s| s.usage.is_none()), "ListSandboxes carries usage");
}

async fn concurrent_execs_keep_their_output(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let ids = [h.sandbox().await, h.sandbox().await];
    for (i, id, r) in tagged_execs_at_once(&h.client, &ids, 12).await {
        assert_exited(&r, 0);
        assert_eq!(text(&r.stdout), format!("exec {i} {id}\n"), "exec {i} got another exec's output");
        assert_eq!(r.stderr, b"done\n");
    }
}

// ---------------------------------------------------------------------------------------------
// The environment programs size themselves by (#15): /dev/shm, CPUs, hostname, cgroup, disk.

const MIB: u64 = 1 << 20;

/// The bytes of the filesystem at `path` inside the sandbox, as `statvfs` (and `df`) gives them.
async fn fs_size(h: &Harness, id: &str, path: &str) -> u64 {
    let out = h.sh_ok(id, &format!("python3 -c 'import os; s = os.statvfs(\"{path}\"); print(s.f_blocks * s.f_frsize)'")).await;
    out.trim().parse().unwrap_or_else(|_| panic!("statvfs({path}) printed {out:?}"))
}

/// `/sys/fs/cgroup`'s memory limit file: cgroup v2's `memory.max`, or v1's memory hierarchy.
const CGROUP_MEMORY_FILES: &str =
    "if [ -e /sys/fs/cgroup/memory.max ]; then d=/sys/fs/cgroup; max=memory.max; cur=memory.current; else d=/sys/fs/cgroup/memory; max=memory.limit_in_bytes; cur=memory.usage_in_bytes; fi";

async fn shm_is_sized_from_the_memory_limit(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    // The default: half of the memory limit, reported in the effective limits.
    let sb = h.debian(ResourceLimits { memory_bytes: 1 << 30, ..Default::default() }).await;
    assert_eq!(sb.limits.as_ref().map(|l| l.shm_bytes), Some(512 * MIB), "{sb:?}");
    assert_eq!(fs_size(&h, &sb.id, "/dev/shm").await, 512 * MIB, "/dev/shm of a 1 GiB sandbox");
    // A Python test writing 100 MB to /dev/shm (a file, and a POSIX shared memory segment, as
    // multiprocessing, PyTorch data loaders and Chrome make them) passes.
    let test = "import os\nfrom multiprocessing import shared_memory\n\n\
                def test_100mb_file_in_dev_shm():\n    chunk = b'x' * (1 << 20)\n    with open('/dev/shm/big', 'wb') as f:\n        for _ in range(100):\n            f.write(chunk)\n    assert os.path.getsize('/dev/shm/big') == 100 << 20\n    os.unlink('/dev/shm/big')\n\n\
                def test_100mb_shared_memory_segment():\n    seg = shared_memory.SharedMemory(create=True, size=100 << 20)\n    try:\n        seg.buf[:] = b'\\x01' * (100 << 20)\n        assert seg.buf[(100 << 20) - 1] == 1\n    finally:\n        seg.close()\n        seg.unlink()\n";
    within(60, h.client.write_file(&sb.id, "/workspace/test_shm.py", test.as_bytes().to_vec(), 0o644)).await.expect("WriteFile");
    let r = h.sh(&sb.id, "cd /workspace && python3 -m pytest -q -p no:cacheprovider test_shm.py 2>&1").await;
    assert_exited(&r, 0);
    assert!(text(&r.stdout).contains("2 passed"), "{}", describe(&r));

    // An explicit size, and what does not fit in it fails inside, as a full disk would.
    let sb = h.debian(ResourceLimits { memory_bytes: 1 << 30, shm_bytes: 200 * MIB, ..Default::default() }).await;
    assert_eq!(sb.limits.as_ref().map(|l| l.shm_bytes), Some(200 * MIB), "{sb:?}");
    assert_eq!(fs_size(&h, &sb.id, "/dev/shm").await, 200 * MIB, "/dev/shm of shm_bytes 200 MiB");
    let r = h.sh(&sb.id, "dd if=/dev/zero of=/dev/shm/over bs=1M count=300 2>&1").await;
    assert_ne!(r.exit_code, 0, "300 MiB fit in a 200 MiB /dev/shm: {}", describe(&r));
    assert!(text(&r.stdout).contains("No space left"), "{}", describe(&r));

    // Not a way around the memory limit: what /dev/shm holds is memory the sandbox uses.
    let sb = h.debian(ResourceLimits { memory_bytes: 256 * MIB, ..Default::default() }).await;
    let used = h.sh_ok(&sb.id, &format!("{CGROUP_MEMORY_FILES}; dd if=/dev/zero of=/dev/shm/fill bs=1M count=100 2>/dev/null; cat $d/$cur")).await;
    let used: u64 = used.trim().parse().unwrap_or_else(|_| panic!("memory usage {used:?}"));
    assert!(used >= 100 * MIB, "100 MiB in /dev/shm, but the sandbox's memory cgroup counts {used} bytes");

    // Larger than the memory limit: refused, naming the field.
    let err = h
        .client
        .create(CreateSandboxRequest {
            image: "debian".into(),
            ..h.request(ResourceLimits { memory_bytes: 256 * MIB, shm_bytes: 257 * MIB, ..Default::default() })
        })
        .await
        .expect_err("shm above the memory limit");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.to_string().contains("limits.shm_bytes"), "{err}");
}

/// `nproc`, `os.cpu_count()` and `len(os.sched_getaffinity(0))` in one line.
const CPU_COUNTS: &str = "echo $(nproc) $(python3 -c 'import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))')";

async fn cpu_count_follows_the_cpu_limit(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let host = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let tiny = b"def test_one():\n    pass\n\ndef test_two():\n    pass\n".to_vec();
    for (millicores, want) in [(1000, 1), (2000, host.min(2))] {
        let sb = h.debian(ResourceLimits { cpu_millicores: millicores, ..Default::default() }).await;
        let counts = h.sh_ok(&sb.id, CPU_COUNTS).await;
        assert_eq!(counts.trim(), format!("{want} {want} {want}"), "nproc, os.cpu_count(), sched_getaffinity under {millicores} millicores");
        // pytest-xdist sizes `-n auto` by the CPUs it may use: exactly that many workers.
        within(60, h.client.write_file(&sb.id, "/workspace/test_tiny.py", tiny.clone(), 0o644)).await.expect("WriteFile");
        let r = h.sh(&sb.id, "cd /workspace && python3 -m pytest -n auto -p no:cacheprovider test_tiny.py 2>&1").await;
        assert_exited(&r, 0);
        let out = text(&r.stdout);
        // xdist's status line once every worker collected the 2 tests: `gw0 [2] / gw1 [2]`.
        let workers = (0..want).map(|i| format!("gw{i} [2]")).collect::<Vec<_>>().join(" / ");
        assert!(out.lines().any(|l| l == workers), "pytest-xdist -n auto under {millicores} millicores; expected the line {workers:?}: {}", describe(&r));
    }
}

async fn hostname_resolves_and_matches_etc_hostname(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let resolve = "python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'; hostname; cat /etc/hostname; grep -c localhost /etc/hosts";
    let sb = h.debian(ResourceLimits::default()).await;
    let out = h.sh_ok(&sb.id, resolve).await;
    assert_eq!(out, format!("127.0.1.1\n{0}\n{0}\n2\n", sb.id), "resolved address, hostname, /etc/hostname, localhost lines");
    // Hostile files in the snapshot a fork starts from: /etc/hosts a link to PID 1's stderr,
    // /etc/hostname a FIFO. (A tier whose /etc/hosts is a mount refuses the change; fine too.)
    h.sh(&sb.id, "rm -f /etc/hosts /etc/hostname && ln -s /proc/1/fd/2 /etc/hosts && mkfifo /etc/hostname").await;
    let snap = within(60, h.client.snapshot(&sb.id, "hostile-etc")).await.expect("snapshot");
    let fork = within(120, h.client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() })).await.expect("fork");
    assert_ne!(fork.id, sb.id);
    assert_eq!(h.sh_ok(&fork.id, resolve).await, format!("127.0.1.1\n{0}\n{0}\n2\n", fork.id), "the fork's own name, not its parent's");
    assert_eq!(h.sh_ok(&fork.id, "test -L /etc/hosts || test -p /etc/hostname || echo replaced").await, "replaced\n");
    // A rollback starts the sandbox again: its name is its own again too.
    within(120, h.client.rollback(&sb.id, &snap.snapshot_id)).await.expect("rollback");
    assert_eq!(h.sh_ok(&sb.id, resolve).await, format!("127.0.1.1\n{0}\n{0}\n2\n", sb.id));
}

async fn own_cgroup_is_visible_read_only(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let sb = h.debian(ResourceLimits { memory_bytes: 300 * MIB, ..Default::default() }).await;
    let limit = h.sh_ok(&sb.id, &format!("{CGROUP_MEMORY_FILES}; cat $d/$max")).await;
    assert_eq!(limit.trim(), (300 * MIB).to_string(), "/sys/fs/cgroup shows the sandbox's memory limit");
    // Read-only, for root inside: the limit, a new cgroup, joining a cgroup, the view's root.
    for attempt in ["echo 1073741824 > $d/$max", "mkdir $d/escape", "echo $$ > $d/cgroup.procs", "touch /sys/fs/cgroup/x"] {
        let r = h.sh(&sb.id, &format!("{CGROUP_MEMORY_FILES}; {{ {attempt}; }} 2>&1")).await;
        assert_ne!(r.exit_code, 0, "`{attempt}` worked inside: {}", describe(&r));
        assert!(text(&r.stdout).contains("Read-only file system"), "`{attempt}`: {}", describe(&r));
    }
    let limit = h.sh_ok(&sb.id, &format!("{CGROUP_MEMORY_FILES}; cat $d/$max")).await;
    assert_eq!(limit.trim(), (300 * MIB).to_string(), "the limit is unchanged");
}

async fn df_shows_what_the_tier_can(isolation: Isolation) {
    let h = Harness::start(isolation).await;
    let disk = 2048 * MIB;
    let sb = h.debian(ResourceLimits { disk_bytes: disk, ..Default::default() }).await;
    let size = fs_size(&h, &sb.id, "/").await;
    match isolation {
        // The sandbox's own disk, less ext4's own metadata.
        Isolation::Microvm => assert!(size <= disk && size >= disk / 10 * 9, "df / of a {disk}-byte microVM disk: {size}"),
        // Documented limits (README, "The environment inside"): the process tier's writable
        // layer is a btrfs subvolume with a quota in a shared pool, and statfs of the overlay
        // reports the pool; the container tier on fuse-overlayfs has no disk limit at all and
        // shows Docker's filesystem. Both are larger than the sandbox's limit.
        _ => assert!(size > disk, "df / shows the shared filesystem, larger than disk_bytes {disk}: {size}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Restart.

async fn kill9_restart_readopts(isolation: Isolation) {
    let mut h = Harness::start(isolation).await;
    let keep = h.sandbox().await;
    let doomed = h.sandbox().await;
    h.client.write_file(&keep, "/workspace/data", b"precious".to_vec(), 0o600).await.expect("WriteFile");
    h.sh_ok(&keep, "sleep 300 & echo started").await;
    let running = h.exec(ExecRequest { background: true, ..exec_request(&keep, ["sleep", "301"]) }).await;
    assert_eq!(status(&running), ExecStatus::Running, "{}", describe(&running));

    h.daemon.kill9();
    within(90, h.daemon.restart()).await.expect("restarting sandboxd on the same state dir");
    h.client = h.daemon.client().await.expect("reconnecting");

    let lost = h.client.get_exec(&running.exec_id, false).await.expect("the record survives");
    assert_eq!(status(&lost), ExecStatus::Lost, "{}", describe(&lost));
    // Re-adopted: same id, running, files and modes kept, old processes gone, usable.
    let info = h.client.get(&keep).await.expect("re-adopted");
    assert_eq!((info.state, info.isolation), (SandboxState::Running as i32, isolation as i32));
    assert_eq!(h.sh_ok(&keep, "cat /workspace/data; stat -c %a /workspace/data").await, "precious600\n");
    let ps = h.sh_ok(&keep, "ps -o args").await;
    assert!(!ps.contains("sleep 30"), "processes of the killed daemon's time are still inside:\n{ps}");
    let mut listed: Vec<String> = h.client.list(HashMap::new()).await.expect("list").into_iter().map(|s| s.id).collect();
    listed.sort();
    let mut want = vec![keep.clone(), doomed.clone()];
    want.sort();
    assert_eq!(listed, want);

    within(60, h.client.destroy(&doomed)).await.expect("destroy after restart");
    assert_eq!(h.client.get(&doomed).await.expect_err("destroyed").code(), Code::NotFound);
    let new = h.sandbox().await;
    assert_eq!(h.sh_ok(&new, "ls -A /workspace | wc -l").await.trim(), "0", "a new sandbox starts empty");
    assert_eq!(h.sh_ok(&keep, "echo works").await, "works\n");
}
