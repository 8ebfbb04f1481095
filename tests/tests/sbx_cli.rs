//! End-to-end tests of the `sbx` command line: the real binary against a real daemon, checked the
//! way a user at a terminal (or a script) would check it — stdout, stderr, exit code.

use std::os::unix::fs::PermissionsExt;
use std::process::Output;
use std::time::Duration;

use sandbox_tests::{sbx_bin, Daemon};

/// Runs `sbx --socket <daemon> args…` to completion (bounded) and returns its output.
async fn sbx(daemon: &Daemon, args: &[&str]) -> Output {
    let run = tokio::process::Command::new(sbx_bin().expect("locating sbx"))
        .arg("--socket")
        .arg(&daemon.address)
        .args(args)
        .env_remove("SANDBOXD_SOCKET")
        .env_remove("SANDBOXD_TOKEN")
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(out) => out.expect("running sbx"),
        Err(_) => panic!("sbx {args:?} did not finish within 60 s"),
    }
}

fn show(out: &Output) -> String {
    format!(
        "exit={:?} stdout={:?} stderr={:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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
