//! End-to-end tests of the `sbx` command line: the real binary against a real daemon, checked the
//! way a user at a terminal (or a script) would check it — stdout, stderr, exit code.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::os::unix::fs::PermissionsExt;
use std::process::Output;
use std::time::Duration;

use sandbox_tests::{run_sbx, sbx_bin, Daemon};

/// Runs `sbx --socket <daemon> args…` within 60 s.
async fn sbx(daemon: &Daemon, args: &[&str]) -> Output {
    run_sbx(daemon, args, 60).await
}

fn show(out: &Output) -> String {
    format!("exit={:?} stdout={:?} stderr={:?}", out.status.code(), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// `sbx create`, asserting success; returns the printed id.
async fn create(daemon: &Daemon) -> String {
    let out = sbx(daemon, &["create"]).await;
    assert!(out.status.success(), "sbx create: {}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let id = stdout.trim().to_string();
    assert!(id.starts_with("sb-") && !id.contains(char::is_whitespace), "sbx create printed {stdout:?}, not one id");
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn sbx_create_ls_rm() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let id = create(&daemon).await;

    let out = sbx(&daemon, &["--json", "ls"]).await;
    assert!(out.status.success(), "sbx --json ls: {}", show(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("sbx --json ls is not JSON ({e}): {}", show(&out)));
    let entries = list.as_array().unwrap_or_else(|| panic!("sbx --json ls is not an array: {list}"));
    assert_eq!(entries.len(), 1, "{list}");
    assert_eq!(entries[0]["id"], serde_json::json!(id), "{list}");
    assert_eq!(entries[0]["state"], serde_json::json!("SANDBOX_STATE_RUNNING"), "{list}");

    let out = sbx(&daemon, &["ls"]).await;
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(&id), "sbx ls: {}", show(&out));

    let out = sbx(&daemon, &["rm", &id]).await;
    assert!(out.status.success(), "sbx rm: {}", show(&out));
    let out = sbx(&daemon, &["exec", &id, "--", "true"]).await;
    assert!(!out.status.success(), "sbx exec in a removed sandbox succeeded: {}", show(&out));
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("NOT_FOUND"), "stderr should name NOT_FOUND: {}", show(&out));
    let out = sbx(&daemon, &["--json", "ls"]).await;
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(list, serde_json::json!([]), "removed sandbox still listed");
    let out = sbx(&daemon, &["rm", &id]).await;
    assert_eq!(out.status.code(), Some(1), "sbx rm of a removed sandbox: {}", show(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn sbx_ttl_extends_and_clears_a_lifetime() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let out = sbx(&daemon, &["create", "--ttl", "600"]).await;
    assert!(out.status.success(), "sbx create --ttl: {}", show(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let expires = |out: &Output| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", show(out)));
        v["expires_at"].clone()
    };
    let before = expires(&sbx(&daemon, &["--json", "get", &id]).await);
    let out = sbx(&daemon, &["--json", "ttl", &id, "3600"]).await;
    assert!(out.status.success(), "sbx ttl: {}", show(&out));
    let after = expires(&out);
    assert!(after.is_string() && after != before, "the lifetime moved: {before} -> {after}");
    // The reaper going by the new time is the manager's unit test (`a_ttl_is_extended_…`).
    let out = sbx(&daemon, &["ttl", &id, "0"]).await;
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "-", "sbx ttl 0: {}", show(&out));
    let out = sbx(&daemon, &["ttl", "sb-nosuchsandbox", "60"]).await;
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("NOT_FOUND"), "{}", show(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn sbx_exec_passes_output_and_exit_code_through() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let id = create(&daemon).await;

    let out = sbx(&daemon, &["exec", &id, "--", "sh", "-c", "echo out; echo err >&2; exit 5"]).await;
    assert_eq!(out.status.code(), Some(5), "{}", show(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n", "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("err\n"), "{}", show(&out));

    let out = sbx(&daemon, &["exec", &id, "--", "sh", "-c", "echo ok"]).await;
    assert_eq!((out.status.code(), out.stdout.as_slice()), (Some(0), &b"ok\n"[..]), "{}", show(&out));

    let out = sbx(&daemon, &["--json", "exec", &id, "--", "sh", "-c", "echo json; exit 3"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", show(&out)));
    assert_eq!(result["stdout"], serde_json::json!("json\n"), "{result}");
    assert_eq!(result["exit_code"], serde_json::json!(3), "{result}");
    assert_eq!(result["status"], serde_json::json!("EXEC_STATUS_EXITED"), "{result}");
    // Binary output survives --json: base64, flagged, never a lossy replacement character.
    let out = sbx(&daemon, &["--json", "exec", &id, "--", "printf", "\\377\\000x"]).await;
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", show(&out)));
    assert_eq!((result["stdout"].as_str(), result["stdout_encoding"].as_str()), (Some("/wB4"), Some("base64")), "{result}");
    assert_eq!(result["stderr_encoding"], serde_json::json!("utf-8"), "{result}");

    let out = sbx(&daemon, &["exec", &id, "--", "no-such-command"]).await;
    assert_eq!(out.status.code(), Some(127), "{}", show(&out));

    // -u: another user of the image; one it lacks is exit 126 with the reason on stderr.
    let out = sbx(&daemon, &["exec", "-u", "nobody", &id, "--", "id", "-u"]).await;
    assert_eq!((out.status.code(), out.stdout.as_slice()), (Some(0), &b"65534\n"[..]), "{}", show(&out));
    let out = sbx(&daemon, &["exec", "-u", "ghost", &id, "--", "true"]).await;
    assert_eq!(out.status.code(), Some(126), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("user \"ghost\" is not in the sandbox's /etc/passwd"), "{}", show(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn sbx_fork_inherits_and_says_so() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let out = sbx(&daemon, &["fork", "--help"]).await;
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !help.contains("minimal") && help.contains("[default: the parent's]"), "{}", show(&out));

    let out = sbx(&daemon, &["create", "--memory", "300M", "-e", "A=1", "-l", "team=x", "--workdir", "/srv", "-u", "nobody"]).await;
    assert!(out.status.success(), "{}", show(&out));
    let parent = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = sbx(&daemon, &["snapshot", &parent]).await;
    assert!(out.status.success(), "{}", show(&out));
    let snap = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = sbx(&daemon, &["fork", &snap, "-e", "B=2"]).await;
    assert!(out.status.success(), "{}", show(&out));
    let fork = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = sbx(&daemon, &["exec", &fork, "--", "sh", "-c", "echo $A$B $(pwd) $(id -u)"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "12 /srv 65534\n", "{}", show(&out));
    let out = sbx(&daemon, &["--json", "get", &fork]).await;
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", show(&out)));
    assert_eq!(
        (got["limits"]["memory_bytes"].as_u64(), got["labels"]["team"].as_str(), got["user"].as_str()),
        (Some(314_572_800), Some("x"), Some("nobody")),
        "{got}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sbx_cp_round_trip_is_byte_identical() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let id = create(&daemon).await;
    let dir = tempfile::tempdir().expect("tempdir");
    // Every byte value, and more than one ReadFile chunk's worth.
    let content: Vec<u8> = (0..(5u32 << 20) + 123).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let src = dir.path().join("in.bin");
    std::fs::write(&src, &content).expect("writing local file");
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o750)).expect("chmod");

    let remote = format!("{id}:/workspace/sub/copied.bin");
    let out = sbx(&daemon, &["cp", &src.display().to_string(), &remote]).await;
    assert!(out.status.success(), "sbx cp in: {}", show(&out));
    let out = sbx(&daemon, &["exec", &id, "--", "stat", "-c", "%s %a", "/workspace/sub/copied.bin"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{} 750\n", content.len()), "{}", show(&out));

    let back = dir.path().join("out.bin");
    let out = sbx(&daemon, &["cp", &remote, &back.display().to_string()]).await;
    assert!(out.status.success(), "sbx cp out: {}", show(&out));
    let got = std::fs::read(&back).expect("reading the copy");
    assert_eq!(got.len(), content.len());
    assert!(got == content, "the file copied in and back out differs");

    let missing = format!("{id}:/workspace/missing");
    let target = dir.path().join("missing.out");
    let out = sbx(&daemon, &["cp", &missing, &target.display().to_string()]).await;
    assert!(!out.status.success(), "copying a missing file succeeded: {}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("NOT_FOUND"), "{}", show(&out));
    assert!(!target.exists(), "a failed copy left an empty local file");
}

/// `sbx exec -i` streams stdin live: `(echo a; sleep 3; echo b) | sbx exec -i` has the command
/// answer `a` before `b` is even written, and `b` about 3 s later.
#[tokio::test(flavor = "multi_thread")]
async fn sbx_exec_i_streams_stdin_live() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let id = create(&daemon).await;
    let mut child = tokio::process::Command::new(sbx_bin().expect("locating sbx"))
        .args(["--socket", &daemon.address, "exec", "-i", &id, "--", "sh", "-c", "while read l; do echo got:$l; done"])
        .env_remove("SANDBOXD_SOCKET")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("running sbx exec -i");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let t0 = std::time::Instant::now();
    stdin.write_all(b"a\n").await.expect("write a");
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("got:a within 30 s").expect("read");
    let at_a = t0.elapsed();
    assert_eq!(first.as_deref(), Some("got:a"), "the answer to a arrived while stdin was still open");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stdin.write_all(b"b\n").await.expect("write b");
    let second = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("got:b within 30 s").expect("read");
    let at_b = t0.elapsed();
    assert_eq!(second.as_deref(), Some("got:b"));
    assert!(at_b - at_a >= Duration::from_millis(2500), "a at {at_a:?}, b at {at_b:?}: not live");
    drop(stdin);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await.expect("sbx ends at EOF").expect("wait");
    assert_eq!(status.code(), Some(0), "the command's exit code is sbx's");
}

/// `sbx exec -it … python3` on a real terminal (a pseudo-terminal on the client side): the
/// interactive interpreter prompts, evaluates, and exits with the code it was given.
#[tokio::test(flavor = "multi_thread")]
async fn sbx_exec_it_runs_python_interactively() {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, OwnedFd};
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let out = sbx(&daemon, &["create", "--image", "debian"]).await;
    assert!(out.status.success(), "sbx create --image debian: {}", show(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();

    let pty = nix::pty::openpty(Some(&nix::pty::Winsize { ws_row: 24, ws_col: 80, ws_xpixel: 0, ws_ypixel: 0 }), None).expect("openpty");
    let slave: OwnedFd = pty.slave;
    let fd = |f: &OwnedFd| std::process::Stdio::from(f.try_clone().expect("dup"));
    let mut cmd = std::process::Command::new(sbx_bin().expect("locating sbx"));
    cmd.args(["--socket", &daemon.address, "exec", "-it", &id, "--", "python3", "-q"])
        .env_remove("SANDBOXD_SOCKET")
        .stdin(fd(&slave))
        .stdout(fd(&slave))
        .stderr(fd(&slave));
    let slave_raw = slave.as_raw_fd();
    // SAFETY: between fork and exec the child only makes async-signal-safe calls: a session of
    // its own with the terminal as its controlling terminal, as a shell would give it.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            if libc::setsid() < 0 || libc::ioctl(slave_raw, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("running sbx exec -it");
    drop(slave);
    let mut master = std::fs::File::from(pty.master);
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut reader = master.try_clone().expect("dup master");
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = String::new();
    let expect = |want: &str, seen: &mut String| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !seen.contains(want) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(b) => seen.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => panic!("{want:?} not seen on the terminal within 60 s; saw {seen:?}"),
            }
        }
    };
    expect(">>> ", &mut seen);
    master.write_all(b"print(6*7)\r").expect("type");
    expect("42", &mut seen);
    master.write_all(b"exit(5)\r").expect("type");
    let status = (0..600).find_map(|_| {
        std::thread::sleep(Duration::from_millis(100));
        child.try_wait().expect("wait")
    });
    let status = status.unwrap_or_else(|| panic!("sbx exec -it did not end; the terminal showed {seen:?}"));
    assert_eq!(status.code(), Some(5), "python's exit code is sbx's; the terminal showed {seen:?}");
}

/// A user the sandbox lacks fails the create (naming `user`, leaving no sandbox), and a known
/// one is accepted; the file API refuses the sandbox's own mounts (/dev/shm, /proc) by name
/// instead of writing where nothing inside would see it.
#[tokio::test(flavor = "multi_thread")]
async fn create_checks_its_user_and_cp_refuses_the_sandboxs_own_mounts() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let out = sbx(&daemon, &["create", "-u", "nosuchuser"]).await;
    assert!(!out.status.success(), "create -u nosuchuser succeeded: {}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("INVALID_ARGUMENT") && stderr.contains("nosuchuser"), "{}", show(&out));
    let out = sbx(&daemon, &["--json", "ls"]).await;
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON"), serde_json::json!([]), "the refused create left a sandbox");
    let out = sbx(&daemon, &["create", "-u", "nobody"]).await;
    assert!(out.status.success(), "create -u nobody: {}", show(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = sbx(&daemon, &["exec", &id, "--", "id", "-u"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "65534", "{}", show(&out));

    let dir = tempfile::tempdir().expect("tempdir");
    let local = dir.path().join("f");
    std::fs::write(&local, b"x").expect("local file");
    let local = local.display().to_string();
    for target in ["/dev/shm/f", "/proc/f"] {
        let out = sbx(&daemon, &["cp", &local, &format!("{id}:{target}")]).await;
        assert!(!out.status.success(), "sbx cp into {target} succeeded: {}", show(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("INVALID_ARGUMENT") && stderr.contains("use an exec"), "{}", show(&out));
    }
    let out = sbx(&daemon, &["exec", &id, "--", "sh", "-c", "echo y > /dev/shm/g"]).await;
    assert!(out.status.success(), "{}", show(&out));
    let out = sbx(&daemon, &["cp", &format!("{id}:/dev/shm/g"), &dir.path().join("g").display().to_string()]).await;
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("INVALID_ARGUMENT"), "{}", show(&out));
}
