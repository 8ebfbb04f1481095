//! The escape suite: hostile probes against the host boundary, run the way an attacker would
//! (as root inside a sandbox, knowing our source) and the way an unprivileged local user on
//! the host would. Each probe is a small static program (tests/probes/escape_probe.c) built by
//! the test, copied into a sandbox and run there; it prints `ESCAPE: …` when an attack works.
//! A test here fails — never skips — when any probe gets through.
//!
//! The rest of the suite for issue #11 lives beside the features it checks: bounded exec
//! records (records.rs), admission and fairness (admission.rs), atomic writes (conformance.rs),
//! QEMU dying with the daemon (microvm.rs), the seccomp list (a unit test per syscall family in
//! sandboxd's backend/process/seccomp.rs).
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agent_client::proto::{ExecResult, ExecStatus, Isolation, SandboxState};
use agent_client::{exec_request, Client};
use sandbox_tests::{build_probe, daemon_with_sandbox, exec, find_under, process_sandbox, sandbox_request, within, Daemon};

const PROBE: &str = "/workspace/escape_probe";

fn text(r: &ExecResult) -> String {
    format!(
        "status {:?} code {} error {:?}\nstdout: {}\nstderr: {}",
        r.status(),
        r.exit_code,
        r.error,
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    )
}

/// Creates a sandbox of `isolation` with the probe in /workspace; returns its id.
async fn sandbox_with_probe(client: &Client, isolation: Isolation, probe: &[u8]) -> String {
    let sandbox = within(120, client.create(sandbox_request(isolation, "minimal"))).await.expect("CreateSandbox");
    within(60, client.write_file(&sandbox.id, PROBE, probe.to_vec(), 0o755)).await.expect("uploading the probe");
    sandbox.id
}

async fn run(client: &Client, id: &str, argv: &[&str]) -> ExecResult {
    exec(client, exec_request(id, argv.iter().copied())).await
}

/// The escape probe built into `dir`, and a daemon that inherits `dir/host-secret` (holding
/// `host secret`) open on fd 9, as `sandboxd 9>>file` would give it; with the file's path and
/// a client.
async fn probe_and_daemon_inheriting(dir: &Path) -> (Vec<u8>, PathBuf, Daemon, Client) {
    let probe = build_probe("escape_probe", dir).expect("building the probe");
    let host_file = dir.join("host-secret");
    std::fs::write(&host_file, b"host secret\n").expect("host file");
    let daemon = Daemon::start_inheriting(&host_file).await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    (probe, host_file, daemon, client)
}

/// Runs one probe attack and asserts that it was blocked (and that it really ran).
async fn assert_blocked(client: &Client, id: &str, attack: &str) -> ExecResult {
    let r = run(client, id, &[PROBE, attack]).await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(!out.contains("ESCAPE"), "probe {attack} got through:\n{}", text(&r));
    assert_eq!((r.status(), r.exit_code), (ExecStatus::Exited, 0), "probe {attack} did not run to the end:\n{}", text(&r));
    assert!(out.contains("BLOCKED"), "probe {attack} reported nothing:\n{}", text(&r));
    r
}

/// Runs `path` (held open by this root process as an O_PATH descriptor) as user nobody through
/// /proc/self/fd: the exec reaches the file without traversing any directory, so only the
/// mount's nosuid stands between a setuid-root file and a root shell for nobody.
fn run_as_nobody_through_fd(path: &Path) -> String {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let fd = file.as_raw_fd();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "/proc/self/fd/7", "setuid"]);
    // SAFETY: dup2 is async-signal-safe; it only places the O_PATH fd on 7 (without CLOEXEC).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 7) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("running setpriv");
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Files named `name` below `root` (not following symlinks).
fn find_named(root: &Path, name: &str) -> Vec<PathBuf> {
    find_under(root, |path, ft| !ft.is_dir() && path.file_name().is_some_and(|n| n == name))
}

/// Makes a setuid-root copy of the probe inside the sandbox, the way hostile code would.
async fn plant_setuid_file(client: &Client, id: &str) {
    let r = run(client, id, &["sh", "-c", "cp /workspace/escape_probe /workspace/suidprobe && chown 0:0 /workspace/suidprobe && chmod 4755 /workspace/suidprobe && ls -ln /workspace/suidprobe"]).await;
    assert_eq!((r.status(), r.exit_code), (ExecStatus::Exited, 0), "planting the setuid file:\n{}", text(&r));
}

/// The planted file as the host sees it must be setuid root (the attack's precondition, so the
/// test cannot pass vacuously), unreachable for other users, and inert even when reached.
fn assert_setuid_file_is_inert(state_dir: &Path, host_copy: &Path) {
    let meta = std::fs::metadata(host_copy).expect("stat planted file");
    assert_eq!(meta.uid(), 0, "{} owner", host_copy.display());
    assert_eq!(meta.mode() & 0o4000, 0o4000, "{} kept its setuid bit on the host (the precondition)", host_copy.display());
    let state_mode = std::fs::metadata(state_dir).expect("stat state dir").permissions().mode() & 0o777;
    assert_eq!(state_mode, 0o700, "the state dir must not be traversable by other users");
    // As nobody by path: the 0700 state dir stops it.
    let by_path = Command::new("setpriv").args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(host_copy).arg("setuid").output().expect("setpriv");
    let by_path = format!("{}{}", String::from_utf8_lossy(&by_path.stdout), String::from_utf8_lossy(&by_path.stderr));
    assert!(!by_path.contains("euid=0"), "nobody ran the sandbox's setuid file as root by path: {by_path}");
    // As nobody through a descriptor (no traversal): the nosuid mount stops it.
    let by_fd = run_as_nobody_through_fd(host_copy);
    assert!(!by_fd.contains("euid=0"), "nobody ran the sandbox's setuid file as root: {by_fd}");
}

#[tokio::test(flavor = "multi_thread")]
async fn setuid_files_made_inside_are_inert_on_the_host_process_tier() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let probe = build_probe("escape_probe", tmp.path()).expect("building the probe");
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let id = sandbox_with_probe(&client, Isolation::Process, &probe).await;
    plant_setuid_file(&client, &id).await;
    let state = daemon.state_dir();
    let host_copy = state.join("pool/sandboxes").join(&id).join("upper/workspace/suidprobe");
    assert_setuid_file_is_inert(&state, &host_copy);
    // Snapshots hold the same bytes: same rule.
    let snap = within(60, client.snapshot(&id, "s")).await.expect("Snapshot");
    let snap_copy = state.join("pool/snapshots").join(&snap.snapshot_id).join("upper/workspace/suidprobe");
    assert_setuid_file_is_inert(&state, &snap_copy);
}

#[tokio::test(flavor = "multi_thread")]
async fn setuid_files_made_inside_are_inert_on_the_host_container_snapshots() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let probe = build_probe("escape_probe", tmp.path()).expect("building the probe");
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let id = sandbox_with_probe(&client, Isolation::Container, &probe).await;
    plant_setuid_file(&client, &id).await;
    within(120, client.snapshot(&id, "s")).await.expect("Snapshot");
    let state = daemon.state_dir();
    let copies = find_named(&state.join("container"), "suidprobe");
    assert!(!copies.is_empty(), "the container snapshot holds no copy of the planted file under {}", state.join("container").display());
    for copy in copies {
        assert_setuid_file_is_inert(&state, &copy);
    }
    within(120, client.destroy(&id)).await.expect("DestroySandbox");
}

#[tokio::test(flavor = "multi_thread")]
async fn pid1_fds_and_kernel_surface_are_out_of_reach_process_tier() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // The daemon inherits a host file on fd 9, as `sandboxd 9>>file` would give it.
    let (probe, host_file, _daemon, client) = probe_and_daemon_inheriting(tmp.path()).await;
    // PID 1 and its spares run from `sandbox-init` beside the daemon: a host binary that must
    // come out of every attack below byte for byte the same.
    let init_binary = sandbox_tests::sandboxd_bin().expect("sandboxd binary").with_file_name("sandbox-init");
    let init_bytes = std::fs::read(&init_binary).unwrap_or_else(|e| panic!("reading {}: {e}", init_binary.display()));
    let id = sandbox_with_probe(&client, Isolation::Process, &probe).await;

    assert_blocked(&client, &id, "fds").await;
    assert_blocked(&client, &id, "pid1").await;
    assert_blocked(&client, &id, "io_uring").await;
    assert_blocked(&client, &id, "vsock").await;
    assert_blocked(&client, &id, "personality").await;
    // What must keep working: tracing one's own children (strace, gdb inside the sandbox).
    let r = run(&client, &id, &[PROBE, "ptrace_child"]).await;
    assert!(r.exit_code == 0 && String::from_utf8_lossy(&r.stdout).contains("OK: traced own child"), "{}", text(&r));

    // The quota bypass through PID 1's stderr and the daemon's inherited descriptor.
    for target in ["/proc/1/fd/2", "/proc/1/fd/9"] {
        let r = run(&client, &id, &["sh", "-c", &format!("dd if=/dev/zero of={target} bs=1M count=20 2>&1; echo done")]).await;
        let out = String::from_utf8_lossy(&r.stdout).to_string();
        assert!(!out.contains("20+0 records out"), "wrote 20 MiB through {target}:\n{}", text(&r));
    }
    let r = run(&client, &id, &["sh", "-c", "cat /proc/1/fd/9 2>&1; true"]).await;
    assert!(!String::from_utf8_lossy(&r.stdout).contains("host secret"), "read the daemon's inherited file:\n{}", text(&r));
    assert_eq!(std::fs::read(&host_file).expect("host file"), b"host secret\n", "the host file was changed from inside");

    // The spare waiting for the next exec (a fork of the init, holding its socket to the
    // daemon) is as far out of reach as the init: its descriptors, memory, environment and
    // executable (the host's `sandbox-init`: read, or opened for writing).
    let spare = r#"while :; do
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = 1 ] || [ "$p" = $$ ] && continue
    tr '\0' ' ' < $d/cmdline 2>/dev/null | grep -q '^sandbox-init' || continue
    for f in fd/0 fd/1 fd/2 fd/3 fd/4 fd/5 mem environ exe; do
      if cat $d/$f </dev/null >/dev/null 2>&1; then echo "READ $f"; fi
    done
    if (: >> $d/exe) 2>/dev/null; then echo "READ exe for writing"; fi
    ls $d/fd/ >/dev/null 2>&1 && echo "LISTED fd"
    echo "spare $p checked"; exit 0
  done
  sleep 0.01
done"#;
    let r = run(&client, &id, &["sh", "-c", spare]).await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(out.contains("checked") && !out.contains("READ") && !out.contains("LISTED"), "the spare's descriptors or memory were reachable:\n{}", text(&r));

    assert!(std::fs::read(&init_binary).expect("sandbox-init") == init_bytes, "{} changed", init_binary.display());

    // The sandbox still works after all that: the init survived every attack.
    let r = run(&client, &id, &["echo", "alive"]).await;
    assert_eq!((r.status(), String::from_utf8_lossy(&r.stdout).trim().to_string()), (ExecStatus::Exited, "alive".to_string()), "{}", text(&r));
}

#[tokio::test(flavor = "multi_thread")]
async fn container_and_microvm_execs_get_only_their_stdio() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (probe, _host_file, daemon, client) = probe_and_daemon_inheriting(tmp.path()).await;
    let container = sandbox_with_probe(&client, Isolation::Container, &probe).await;
    assert_blocked(&client, &container, "fds").await;
    assert_blocked(&client, &container, "io_uring").await;
    assert_blocked(&client, &container, "vsock").await;
    assert_blocked(&client, &container, "personality").await;
    // The daemon reads files as host root: never the container's /proc or /sys (kernel
    // addresses in /proc/kallsyms would be real ones for it).
    for path in ["/proc/kallsyms", "/proc/1/environ", "/sys/kernel/notes"] {
        let err = within(30, client.read_file(&container, path, 0, 0)).await.expect_err(path);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "ReadFile {path}: {err:?}");
    }
    // A flood's whole stream is kept inside the container, never on the host outside its quota.
    // Checked while the exec still runs, when a spill kept on the host would be there.
    let mut flood = exec_request(&container, ["sh", "-c", "head -c 3000000 /dev/zero; sleep 3"]);
    flood.max_output_bytes = 64 << 10;
    flood.background = true;
    let started = within(60, client.exec(flood)).await.expect("Exec");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spill = format!("{}.stdout", started.exec_id);
    let on_host = find_named(&daemon.state_dir(), &spill);
    assert!(on_host.is_empty(), "the spill is on the host: {on_host:?}");
    let inside = within(60, client.read_file_all(&container, &format!("/tmp/.sandboxd/{spill}"))).await.expect("the spill inside the container");
    assert!(inside.len() >= 3_000_000 - (64 << 10), "the spill is written inside as the stream comes (all but the write buffer): {}", inside.len());
    let r = within(60, client.get_exec(&started.exec_id, true)).await.expect("GetExec");
    assert!(r.stdout_truncated && r.stdout_spill_path == format!("/tmp/.sandboxd/{spill}"), "{}", text(&r));
    let kept = within(60, client.read_file_all(&container, &r.stdout_spill_path)).await.expect("reading the spill file");
    assert_eq!(kept.len(), 3_000_000, "the spill holds the whole stream");
    within(120, client.destroy(&container)).await.expect("DestroySandbox");
    let vm = sandbox_with_probe(&client, Isolation::Microvm, &probe).await;
    assert_blocked(&client, &vm, "fds").await;
    within(120, client.destroy(&vm)).await.expect("DestroySandbox");
}

/// The sandbox's cgroup view (`/sys/fs/cgroup`, issue #15) on the tiers that share the host's
/// kernel: no write to a limit, `cgroup.procs`, `release_agent` or the view's own directory, no
/// cgroupfs or sysfs mounted again (also not from a new user namespace, CVE-2022-0492), no
/// remount read-write, no unmount revealing what is below.
#[tokio::test(flavor = "multi_thread")]
async fn the_cgroup_view_stays_read_only_and_no_cgroupfs_can_be_mounted() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let probe = build_probe("escape_probe", tmp.path()).expect("building the probe");
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    // On cgroup v1 every process-tier sandbox binds one read-only tmpfs of the daemon's as its
    // /sys/fs/cgroup layout, and every one without a network link one sysfs of the daemon's at
    // /sys: a witness sandbox sees both the same before and after the attacks.
    let witness = sandbox_with_probe(&client, Isolation::Process, &probe).await;
    let layout = "ls -a /sys/fs/cgroup /sys/firmware /sys/class/net; cat /sys/class/net/lo/mtu /sys/class/net/lo/flags /sys/class/net/lo/tx_queue_len";
    let before = run(&client, &witness, &["sh", "-c", layout]).await;
    for isolation in [Isolation::Process, Isolation::Container] {
        let id = sandbox_with_probe(&client, isolation, &probe).await;
        if isolation == Isolation::Process {
            // The layout and the /sys masks refuse new entries, and no host path shows.
            let r = run(
                &client,
                &id,
                &[
                    "sh",
                    "-c",
                    "for d in /sys/fs/cgroup /sys/fs/cgroup/memory /sys/firmware; do mkdir $d/x 2>&1; touch $d/y 2>&1; done; cat /proc/self/mountinfo",
                ],
            )
            .await;
            let out = String::from_utf8_lossy(&r.stdout).to_string();
            assert_eq!(out.matches("mkdir: can't create directory").count(), 3, "a mkdir went through:\n{out}");
            assert_eq!(out.matches("touch: ").count(), 3, "a touch went through:\n{out}");
            assert!(!out.contains("cgroup-view") && !out.contains("sandboxd-test"), "a host path shows in the sandbox's mountinfo:\n{out}");
            // The shared sysfs: its network namespace's `lo` cannot be changed, nor the mount
            // taken away or made writable.
            let attacks = "for f in mtu flags tx_queue_len; do echo 1 > /sys/class/net/lo/$f || echo refused; done; \
                           umount /sys || echo refused; umount -l /sys || echo refused; mount -o remount,rw /sys || echo refused; \
                           touch /sys/class/net/x || echo refused";
            let r = run(&client, &id, &["sh", "-c", attacks]).await;
            let out = String::from_utf8_lossy(&r.stdout).to_string();
            let err = String::from_utf8_lossy(&r.stderr).to_string();
            assert!(!err.contains("not found"), "an attack did not run:\n{err}");
            assert_eq!(out.matches("refused").count(), 7, "an attack on the shared sysfs went through:\n{out}\n{err}");
        }
        let r = assert_blocked(&client, &id, "cgroup").await;
        // It attacked the real view (present, refused as read-only), not a missing file.
        let out = String::from_utf8_lossy(&r.stdout).to_string();
        let refused = |file: &str| out.contains(&format!("BLOCKED: write 1 to {file} (Read-only file system)"));
        assert!(
            refused("/sys/fs/cgroup/memory/memory.limit_in_bytes") || refused("/sys/fs/cgroup/memory.max"),
            "{isolation:?}: the memory limit file was not refused as read-only:\n{}",
            text(&r)
        );
        let limit = run(&client, &id, &["sh", "-c", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"]).await;
        let want = (512u64 << 20).to_string();
        assert_eq!(String::from_utf8_lossy(&limit.stdout).trim(), want, "{isolation:?}: the limit after the attacks:\n{}", text(&limit));
        within(120, client.destroy(&id)).await.expect("DestroySandbox");
    }
    let after = run(&client, &witness, &["sh", "-c", layout]).await;
    assert_eq!(String::from_utf8_lossy(&after.stdout), String::from_utf8_lossy(&before.stdout), "another sandbox's attacks changed what this one sees");
    within(120, client.destroy(&witness)).await.expect("DestroySandbox");
}

/// The sandbox once it shows FAILED (polled for 5 s); panics if it still shows anything else.
async fn failed_within_5s(client: &Client, id: &str) -> agent_client::proto::Sandbox {
    for _ in 0..100 {
        let sb = within(10, client.get(id)).await.expect("GetSandbox");
        if sb.state() == SandboxState::Failed {
            return sb;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("sandbox {id} does not show FAILED 5 s after what runs it died");
}

/// The pid of the init of process-tier sandbox `id`: a child of the zygote (a child of the
/// daemon) whose root is the sandbox's rootfs.
fn init_pid_of(daemon_pid: u32, id: &str) -> Option<i32> {
    let children = |pid: i32| -> Vec<i32> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
            .collect()
    };
    for zygote in children(daemon_pid as i32) {
        for init in children(zygote) {
            // Its cgroup path (as the host sees it) names the sandbox.
            let cgroups = std::fs::read_to_string(format!("/proc/{init}/cgroup")).unwrap_or_default();
            if cgroups.contains(id) {
                return Some(init);
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_init_makes_the_sandbox_failed_with_a_reason() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let victim = within(60, client.create(process_sandbox("minimal"))).await.expect("CreateSandbox").id;
    let bystander = within(60, client.create(process_sandbox("minimal"))).await.expect("CreateSandbox").id;
    let init = init_pid_of(daemon.pid().expect("daemon pid"), &victim).expect("finding the sandbox's init");
    // Something outside the sandbox's control kills its init (the OOM killer, an operator).
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::Signal::SIGKILL).expect("kill init");
    let sb = failed_within_5s(&client, &victim).await;
    assert!(sb.failure_reason.contains("init exited"), "failure reason: {:?}", sb.failure_reason);
    // It says so on exec instead of recording a LOST exec, and can still be destroyed.
    let err = within(30, client.exec(exec_request(&victim, ["true"]))).await.expect_err("exec in a failed sandbox");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    // The listing agrees, the other sandbox is untouched, and the failed one is destroyable.
    let listed = within(10, client.list(Default::default())).await.expect("ListSandboxes");
    assert!(listed.iter().any(|s| s.id == victim && s.state() == SandboxState::Failed));
    let r = run(&client, &bystander, &["echo", "ok"]).await;
    assert_eq!(r.status(), ExecStatus::Exited, "{}", text(&r));
    within(60, client.destroy(&victim)).await.expect("destroying the failed sandbox");
}

/// The daemon's zygote (the process that clones every process-tier init): its child named so.
fn zygote_pid_of(daemon_pid: u32) -> Option<i32> {
    let tasks = std::fs::read_dir(format!("/proc/{daemon_pid}/task")).ok()?;
    let children: Vec<i32> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
        .collect();
    children.into_iter().find(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sandbox-zygote"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_zygote_fails_its_sandboxes_and_the_next_create_starts_another() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let first = within(60, client.create(process_sandbox("minimal"))).await.expect("CreateSandbox").id;
    let daemon_pid = daemon.pid().expect("daemon pid");
    let zygote = zygote_pid_of(daemon_pid).expect("finding the zygote");
    let init = init_pid_of(daemon_pid, &first).expect("finding the sandbox's init");
    // The init is the zygote's child, and no per-sandbox process sits between them.
    let stat = std::fs::read_to_string(format!("/proc/{init}/stat")).expect("init stat");
    let ppid: i32 = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)).and_then(|p| p.parse().ok()).expect("ppid");
    assert_eq!(ppid, zygote, "the init's parent");
    // Something outside every sandbox kills the zygote: each init dies with it (parent-death
    // signal), and its sandbox says so.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(zygote), nix::sys::signal::Signal::SIGKILL).expect("kill zygote");
    let sb = failed_within_5s(&client, &first).await;
    assert!(sb.failure_reason.contains("init exited"), "failure reason: {:?}", sb.failure_reason);
    // The daemon is still up, and the next create starts a new zygote and works.
    let second = within(60, client.create(process_sandbox("minimal"))).await.expect("CreateSandbox after the zygote died").id;
    let r = run(&client, &second, &["echo", "ok"]).await;
    assert_eq!((r.status(), String::from_utf8_lossy(&r.stdout).trim()), (ExecStatus::Exited, "ok"), "{}", text(&r));
    let again = zygote_pid_of(daemon_pid).expect("a new zygote");
    assert_ne!(again, zygote, "a new zygote process");
    within(60, client.destroy(&first)).await.expect("destroying the failed sandbox");
    within(60, client.destroy(&second)).await.expect("DestroySandbox");
}

#[tokio::test(flavor = "multi_thread")]
async fn real_time_signals_reach_the_exec() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let id = within(60, client.create(process_sandbox("minimal"))).await.expect("CreateSandbox").id;
    for signal in [34, 40, 64] {
        let mut request = exec_request(&id, ["sleep", "30"]);
        request.background = true;
        let started = within(30, client.exec(request)).await.expect("background exec");
        within(10, client.signal_exec(&started.exec_id, signal)).await.unwrap_or_else(|e| panic!("SignalExec {signal}: {e:?}"));
        let ended = within(30, client.get_exec(&started.exec_id, true)).await.expect("GetExec");
        assert_eq!((ended.status(), ended.signal), (ExecStatus::Signaled, signal), "{}", text(&ended));
    }
    // Out of range stays INVALID_ARGUMENT naming the field.
    let mut request = exec_request(&id, ["sleep", "30"]);
    request.background = true;
    let started = within(30, client.exec(request)).await.expect("background exec");
    let err = within(10, client.signal_exec(&started.exec_id, 65)).await.expect_err("signal 65");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.to_string().contains("signal"), "{err}");
}

/// Sandbox `id`, whatever ran it having died, shows FAILED with a reason mentioning `reason`,
/// says so on exec (FAILED_PRECONDITION), and can still be destroyed.
async fn assert_failed_and_destroyable(client: &Client, id: &str, reason: &str) {
    let sb = failed_within_5s(client, id).await;
    assert!(sb.failure_reason.contains(reason), "failure reason: {:?}", sb.failure_reason);
    let err = within(30, client.exec(exec_request(id, ["true"]))).await.expect_err("exec in a failed sandbox");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    within(120, client.destroy(id)).await.expect("destroying the failed sandbox");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_whose_init_is_ended_from_inside_becomes_failed() {
    let (_daemon, client, id) = daemon_with_sandbox(Isolation::Container).await;
    // docker-init forwards SIGTERM to the keepalive, which dies, and docker-init exits with it.
    let r = run(&client, &id, &["sh", "-c", "kill -TERM 1; sleep 2; echo still-here"]).await;
    assert_ne!(r.status(), ExecStatus::Exited, "the exec outlived its container: {}", text(&r));
    assert_failed_and_destroyable(&client, &id, "init").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_rebooted_from_inside_becomes_failed() {
    let (_daemon, client, id) = daemon_with_sandbox(Isolation::Microvm).await;
    // Guest root may end its own VM (QEMU runs with -no-reboot, so a reboot is an exit): the
    // sandbox must then say it failed, not show RUNNING with every exec LOST.
    let r = run(&client, &id, &["reboot", "-f"]).await;
    assert_ne!(r.status(), ExecStatus::Exited, "the exec outlived its VM: {}", text(&r));
    assert_failed_and_destroyable(&client, &id, "VM exited").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_flooding_its_serial_console_stays_bounded_on_the_host() {
    let (daemon, client, id) = daemon_with_sandbox(Isolation::Microvm).await;
    // Guest root writes to its serial port, which QEMU keeps in a host file outside every quota.
    let r = run(&client, &id, &["sh", "-c", "dd if=/dev/zero of=/dev/ttyS0 bs=64k count=80 2>&1 | tail -1"]).await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    // busybox dd's last line: "<full>+<partial> records out", of 64 KiB each.
    let written: u64 = out.split('+').next().and_then(|n| n.trim().parse::<u64>().ok()).unwrap_or(0) * (64 << 10);
    // The precondition, so the test cannot pass by writing nothing: several MiB went out.
    assert!(written > 3 << 20, "the guest wrote only {written} bytes to its console: {}", text(&r));
    let console = daemon.state_dir().join("microvm/vms").join(&id).join("console.log");
    let on_host = std::fs::metadata(&console).unwrap_or_else(|e| panic!("{}: {e}", console.display())).len();
    assert!(on_host <= 2 << 20, "the host keeps {on_host} bytes of the {written} the guest wrote to its console");
    within(120, client.destroy(&id)).await.expect("DestroySandbox");
}

/// The container tier's exec helper (a host file, mounted into every container) cannot be
/// changed, moved aside or replaced from inside: every later exec still starts through the real
/// one, so its cgroup join — what a timeout's kill reaches — cannot be skipped by a planted
/// look-alike, and the host's file is byte for byte the same.
#[tokio::test(flavor = "multi_thread")]
async fn the_container_exec_helper_cannot_be_changed_or_moved_aside_from_inside() {
    let (_daemon, client, id) = daemon_with_sandbox(Isolation::Container).await;
    let host_helper = sandbox_tests::images_dir().join(".tools/sandbox-exec");
    let before = std::fs::read(&host_helper).expect("the host's exec helper");
    let attack = r#"
        echo planted > /.sandboxd/sandbox-exec && echo "ESCAPE: wrote the helper"
        chmod 777 /.sandboxd/sandbox-exec && echo "ESCAPE: chmod of the helper"
        rm -f /.sandboxd/sandbox-exec && echo "ESCAPE: removed the helper"
        mv /.sandboxd /moved-aside && echo "ESCAPE: moved the helper's directory aside"
        mkdir -p /.sandboxd 2>/dev/null
        printf '#!/bin/sh\necho planted-helper-ran\n' > /.sandboxd/sandbox-exec 2>/dev/null && echo "ESCAPE: planted a helper"
        true"#;
    let r = run(&client, &id, &["sh", "-c", attack]).await;
    assert_eq!(r.status(), ExecStatus::Exited, "{}", text(&r));
    assert!(!String::from_utf8_lossy(&r.stdout).contains("ESCAPE"), "{}", text(&r));
    let after = run(&client, &id, &["echo", "the real helper"]).await;
    assert_eq!(String::from_utf8_lossy(&after.stdout), "the real helper\n", "{}", text(&after));
    assert!(std::fs::read(&host_helper).expect("the host's exec helper") == before, "the host's exec helper changed");
}

/// runc CVE-2019-5736 and its class on the container tier: root inside, scanning /proc while
/// execs start, can neither open the executable of PID 1 (docker-init), of the exec helper that
/// serves execs, or of a process being started for writing — directly or by re-opening an
/// O_PATH descriptor — nor reach the helper's executable or descriptors (the daemon's channel)
/// at all: the helper is not dumpable. The host's copies of the helper, of docker-init and of
/// sandboxd are byte for byte the same afterwards, and execs still start.
#[tokio::test(flavor = "multi_thread")]
async fn no_host_binary_is_reachable_through_proc_exe_of_a_container_process() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (probe, _host_file, _daemon, client) = probe_and_daemon_inheriting(tmp.path()).await;
    let host_files = [
        sandbox_tests::images_dir().join(".tools/sandbox-exec"),
        sandbox_tests::sandboxd_bin().expect("sandboxd binary"),
        PathBuf::from("/usr/bin/docker-init"),
    ];
    let before: Vec<Vec<u8>> = host_files.iter().map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))).collect();
    let id = sandbox_with_probe(&client, Isolation::Container, &probe).await;
    // The scan runs for 3 s in the background while execs start beside it, so processes caught
    // between the helper's fork and their execve are tried too.
    let mut scan = exec_request(&id, [PROBE, "exe", "3000"]);
    scan.background = true;
    let scan = within(60, client.exec(scan)).await.expect("Exec");
    for _ in 0..30 {
        let r = run(&client, &id, &["true"]).await;
        assert_eq!(r.status(), ExecStatus::Exited, "{}", text(&r));
    }
    let r = within(60, client.get_exec(&scan.exec_id, true)).await.expect("GetExec");
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(!out.contains("ESCAPE"), "{}", text(&r));
    assert_eq!((r.status(), r.exit_code), (ExecStatus::Exited, 0), "the probe ran to its end: {}", text(&r));
    assert!(out.contains("BLOCKED: O_PATH open of the exec helper's"), "the helper was found and tried: {}", text(&r));
    for (path, old) in host_files.iter().zip(&before) {
        assert!(std::fs::read(path).expect("host file") == *old, "{} changed", path.display());
    }
    let after = run(&client, &id, &["echo", "still starting"]).await;
    assert_eq!(String::from_utf8_lossy(&after.stdout), "still starting\n", "{}", text(&after));
}

/// The sandbox's own /etc/passwd is read by the runtime that starts an exec as a user (PID 1 on
/// the process tier, the exec helper, the guest agent). Made hostile — a FIFO nobody writes, a
/// link to an endless device, a link to the kernel log, a huge file — it must neither block nor
/// flood the runtime: the exec is refused promptly (SPAWN_FAILED, 126) and the next exec runs.
/// On the container tier /etc/hosts is read-only too (Docker binds it from a host file).
#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_etc_passwd_neither_blocks_nor_floods_the_runtime() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let as_nobody = |id: &str| agent_client::proto::ExecRequest { user: "nobody".into(), timeout_ms: 20_000, ..exec_request(id, ["id", "-u"]) };
    for isolation in [Isolation::Process, Isolation::Container, Isolation::Microvm] {
        let mut id = within(300, client.create(sandbox_request(isolation, "minimal"))).await.expect("CreateSandbox").id;
        let cases = [
            ("a FIFO", "mkfifo /tmp/p"),
            ("a link to /dev/zero", "ln -s /dev/zero /tmp/p"),
            ("a link to /proc/kmsg", "ln -s /proc/kmsg /tmp/p"),
            ("a 64 MiB file of one line", "head -c 67108864 /dev/zero | tr '\\0' x > /tmp/p"),
        ];
        for (what, make) in cases {
            // Known and left to Docker: runc reads the container's /etc/passwd itself for every
            // exec, and one that blocks (a FIFO, /proc/kmsg) holds each `docker exec` (root's
            // too): the daemon's start deadline answers the exec after 10 s and the sandbox stays
            // stuck until destroyed. Only the sandbox itself is hurt; the daemon answers.
            if isolation == Isolation::Container && (what == "a FIFO" || what == "a link to /proc/kmsg") {
                continue;
            }
            let setup =
                run(&client, &id, &["sh", "-c", &format!("rm -f /tmp/p; {make} && cp /etc/passwd /tmp/passwd.orig && ln -sf /tmp/p /etc/passwd")]).await;
            assert_eq!(setup.exit_code, 0, "{isolation:?} {what}: setup:\n{}", text(&setup));
            let started = std::time::Instant::now();
            let r = within(30, client.exec(as_nobody(&id))).await.expect("Exec");
            assert_eq!((r.status(), r.exit_code), (ExecStatus::SpawnFailed, 126), "{isolation:?} {what}:\n{}", text(&r));
            assert!(started.elapsed() < Duration::from_secs(10), "{isolation:?} {what}: took {:?}:\n{}", started.elapsed(), text(&r));
            eprintln!("{isolation:?} {what}: refused in {:?}: {}", started.elapsed(), r.error);
            if isolation == Isolation::Container {
                // runc refuses every exec (root's too) while /etc/passwd is broken: a new sandbox.
                within(120, client.destroy(&id)).await.expect("DestroySandbox");
                id = within(300, client.create(sandbox_request(isolation, "minimal"))).await.expect("CreateSandbox").id;
            } else {
                let restore = run(&client, &id, &["sh", "-c", "rm -f /etc/passwd && cp /tmp/passwd.orig /etc/passwd"]).await;
                assert_eq!(restore.exit_code, 0, "{isolation:?} {what}: restore:\n{}", text(&restore));
            }
            let r = within(30, client.exec(as_nobody(&id))).await.expect("Exec");
            assert_eq!((r.exit_code, String::from_utf8_lossy(&r.stdout).as_ref()), (0, "65534\n"), "{isolation:?} after {what}:\n{}", text(&r));
        }
        if isolation == Isolation::Container {
            let r = run(
                &client,
                &id,
                &["sh", "-c", "echo 10.0.0.1 evil >> /etc/hosts || echo refused; mount -o remount,rw,bind /etc/hosts 2>/dev/null || echo remount-refused"],
            )
            .await;
            assert_eq!(String::from_utf8_lossy(&r.stdout), "refused\nremount-refused\n", "{}", text(&r));
        }
        within(120, client.destroy(&id)).await.expect("DestroySandbox");
    }
}
