//! `sbx mcp` driven by the official MCP Python client (`mcp` from PyPI) over stdio, against the
//! real daemon: every tool a model uses (tests/python/mcp_client.py checks each answer), then,
//! from here, that the session's sandboxes are gone once the client has disconnected, and the
//! one created with `keep` is not.
//!
//! The client runs in the virtualenv `make mcpdeps` creates (`.venv` at the workspace root, or
//! `$SANDBOXD_TEST_PYTHON`); without it the test fails, naming the make target.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use agent_client::proto::SandboxState;
use sandbox_tests::{sbx_bin, workspace_root, Daemon};

/// The Python that has the `mcp` package.
fn python() -> PathBuf {
    let path = std::env::var_os("SANDBOXD_TEST_PYTHON").map(PathBuf::from).unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    assert!(path.is_file(), "{} not found: run `make mcpdeps` (a virtualenv with the `mcp` package from PyPI) or set SANDBOXD_TEST_PYTHON", path.display());
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn mcp_tools_work_with_the_official_python_client_and_the_session_cleans_up() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let python = python();
    let host = tempfile::tempdir().expect("temp dir");
    let script = workspace_root().join("tests/python/mcp_client.py");
    let sbx = sbx_bin().expect("locating sbx");
    let address = daemon.address.clone();
    let host_dir = host.path().to_owned();
    let run = tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(sbx).arg(address).arg(host_dir).output());
    // Generous: a loaded CI machine; the script's own calls time out at 120 s each.
    let out = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("the MCP client script did not finish within 600 s")
        .expect("join")
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "MCP client failed ({}):\n{stdout}\n{stderr}\ndaemon log:\n{}", out.status, daemon.log());

    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("last line is not the JSON summary ({e}):\n{stdout}"));
    let created = summary["created"].as_object().expect("created map");
    assert!(created.len() >= 3, "default, created and forked sandboxes expected: {summary}");
    let client = daemon.client().await.expect("client");
    // The script returns once the client has closed stdin and seen the server exit, so the
    // clean-up has happened already; nothing to wait for.
    for (id, keep) in created {
        let got = client.get(id.as_str()).await;
        if keep.as_bool() == Some(true) {
            let sandbox = got.unwrap_or_else(|e| panic!("sandbox {id} created with keep is gone after the session: {e}"));
            assert_eq!(sandbox.state, SandboxState::Running as i32, "kept sandbox {id} should still run");
            assert_eq!(sandbox.labels.get("created-by").map(String::as_str), Some("sbx-mcp"), "{sandbox:?}");
            client.destroy(id.as_str()).await.expect("destroying the kept sandbox");
        } else {
            match got {
                Err(e) => assert_eq!(e.code(), tonic::Code::NotFound, "sandbox {id}: {e}"),
                Ok(s) => assert_eq!(s.state, SandboxState::Destroyed as i32, "sandbox {id} of the ended session still exists: {s:?}\nsbx stderr:\n{stderr}"),
            }
        }
    }
    let left = client.list(Default::default()).await.expect("list");
    assert!(left.iter().all(|s| s.state == SandboxState::Destroyed as i32), "sandboxes left after the session: {left:?}");
}

/// Over streamable HTTP (a loopback port) every request needs the bearer token sbx printed, and
/// the session is the server's life: a SIGTERM ends it, and the sandbox it created is destroyed
/// before `sbx` exits.
#[tokio::test(flavor = "multi_thread")]
async fn mcp_over_http_serves_the_python_client_and_cleans_up_on_sigterm() {
    use tokio::io::AsyncBufReadExt;

    let daemon = Daemon::start().await.expect("starting sandboxd");
    let python = python();
    let mut server = tokio::process::Command::new(sbx_bin().expect("locating sbx"))
        .args(["--socket", &daemon.address, "mcp", "--http", "127.0.0.1:0"])
        .env("SBX_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting sbx mcp --http");
    let mut lines = tokio::io::BufReader::new(server.stderr.take().expect("stderr")).lines();
    // The server says its address once it listens: wait for that line, not for a time.
    let (url, token) = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.expect("reading sbx's stderr") {
            if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                let token = line.rsplit("Bearer ").next().expect("the token is printed").trim().to_owned();
                return (url.to_owned(), token);
            }
        }
        panic!("sbx mcp --http ended without saying where it listens");
    })
    .await
    .expect("sbx mcp --http did not start listening within 60 s");
    let log = tokio::spawn(async move {
        let mut all = String::new();
        while let Ok(Some(line)) = lines.next_line().await {
            all.push_str(&line);
            all.push('\n');
        }
        all
    });

    let script = workspace_root().join("tests/python/mcp_http_client.py");
    let out = tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(url).arg(token).output());
    let out =
        tokio::time::timeout(Duration::from_secs(300), out).await.expect("the HTTP client did not finish within 300 s").expect("join").expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "MCP HTTP client failed ({}):\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    let id = stdout.lines().last().unwrap_or("").trim().to_owned();
    let client = daemon.client().await.expect("client");
    let sandbox = client.get(id.as_str()).await.expect("the session's sandbox exists while the server runs");
    assert_eq!(sandbox.state, SandboxState::Running as i32);

    let pid = nix::unistd::Pid::from_raw(server.id().expect("pid") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(120), server.wait()).await.expect("sbx mcp did not exit within 120 s of SIGTERM").expect("wait");
    let log = log.await.unwrap_or_default();
    assert!(status.success(), "sbx mcp exited with {status} after SIGTERM:\n{log}");
    match client.get(id.as_str()).await {
        Err(e) => assert_eq!(e.code(), tonic::Code::NotFound, "{e}"),
        Ok(s) => assert_eq!(s.state, SandboxState::Destroyed as i32, "the session's sandbox survived SIGTERM: {s:?}\n{log}"),
    }
}
