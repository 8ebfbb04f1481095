//! `sbx agent` as a newcomer meets it (#23): the demo model served by `sbx agent demo-model`
//! driving a real run against the real daemon; no endpoint, or one that does not answer, failing
//! at once with the variables and URL named and nothing left behind; a run that fails before
//! its first step not keeping its sandbox; `resume` of an unknown run creating nothing; `ls`
//! columns that line up.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use agent_client::agent::fixture::{FixtureServer, Reply, Script};
use agent_client::proto::SandboxState;
use sandbox_tests::{sbx_bin, Daemon};
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

/// `sbx agent …` against `daemon`, with only the given model variables, runs kept in `state`.
async fn sbx_agent(daemon: &Daemon, state: &Path, model_env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(sbx_bin().expect("locating sbx"));
    cmd.arg("--socket").arg(&daemon.address).arg("agent").args(args);
    cmd.env("SBX_AGENT_STATE_DIR", state)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_MODEL")
        .env_remove("SANDBOXD_SOCKET")
        .kill_on_drop(true);
    for (k, v) in model_env {
        cmd.env(k, v);
    }
    // Bounded so a return of the silent 600 s retry is a failure, not a hang.
    tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("sbx agent {args:?} did not finish within 300 s"))
        .expect("running sbx")
}

fn show(out: &Output) -> String {
    format!("exit={:?}\nstdout={}\nstderr={}", out.status.code(), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", show(out)))
}

/// Sandboxes the daemon still runs.
async fn running(daemon: &Daemon) -> Vec<String> {
    let client = daemon.client().await.expect("client");
    client.list(Default::default()).await.expect("list").into_iter().filter(|s| s.state == SandboxState::Running as i32).map(|s| s.id).collect()
}

/// Run directories under the state dir.
fn run_dirs(state: &Path) -> Vec<String> {
    match std::fs::read_dir(state.join("runs")) {
        Ok(entries) => entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_model_drives_a_run_to_done_and_ls_lines_up() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let state = tempfile::tempdir().expect("temp dir");
    let mut demo = tokio::process::Command::new(sbx_bin().expect("sbx"))
        .args(["agent", "demo-model", "--listen", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting sbx agent demo-model");
    let mut lines = tokio::io::BufReader::new(demo.stderr.take().expect("stderr")).lines();
    // It says where it listens once it does: wait for that line.
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.expect("reading the demo's stderr") {
            if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                return url.to_owned();
            }
        }
        panic!("sbx agent demo-model ended without saying where it listens");
    })
    .await
    .expect("demo-model did not listen within 60 s");

    let env = [("OPENAI_BASE_URL", url.as_str())];
    let out = sbx_agent(&daemon, state.path(), &env, &["run", "--task", "try the demo", "--run-id", "demo-1", "--json", "--keep-sandbox", "0"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["status"], "done", "{report}");
    assert!(report["steps"].as_u64().unwrap_or(0) >= 3, "the demo takes three steps: {report}");
    assert!(report["answer"].as_str().unwrap_or("").contains("demo finished"), "{report}");
    assert!(report["cost_usd"].is_null(), "no --price on a local endpoint: no cost: {report}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("model endpoint: {url}")), "the endpoint is named: {}", show(&out));
    let sandbox = report["sandbox_id"].as_str().expect("sandbox id").to_owned();
    let client = daemon.client().await.expect("client");
    let file = client.read_file_all(&sandbox, "/workspace/demo.txt").await.expect("the demo wrote demo.txt");
    assert_eq!(String::from_utf8_lossy(&file), "written by the sbx demo model\n");

    // A second run with a long id and a priced, stopped status: columns still line up.
    let out = sbx_agent(
        &daemon,
        state.path(),
        &env,
        &[
            "run",
            "--task",
            "again",
            "--run-id",
            "a-much-longer-run-id-than-the-first-one",
            "--max-steps",
            "1",
            "--price",
            "1,2",
            "--json",
            "--keep-sandbox",
            "0",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(3), "one step is not enough: stopped: {}", show(&out));
    let report = json_of(&out);
    assert!(report["cost_usd"].as_f64().is_some_and(|c| c > 0.0), "with --price the cost is reported: {report}");
    let out = sbx_agent(&daemon, state.path(), &env, &["ls"]).await;
    assert!(out.status.success(), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), 3, "header and two runs: {text}");
    for column in ["STATUS", "STEPS", "TOKENS", "SANDBOX", "TASK"] {
        let at = rows[0].find(column).unwrap_or_else(|| panic!("no {column} column: {text}"));
        for row in &rows[1..] {
            let before = &row[..at.min(row.len())];
            assert!(before.ends_with(' ') && !row[at..].starts_with(' '), "column {column} does not line up at {at}:\n{text}");
        }
    }
    demo.kill().await.expect("stopping the demo model");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_reachable_endpoint_sbx_agent_fails_at_once_and_leaves_nothing() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let state = tempfile::tempdir().expect("temp dir");

    let out = sbx_agent(&daemon, state.path(), &[], &["run", "--task", "x", "--run-id", "r1"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in ["OPENAI_BASE_URL", "OPENAI_API_KEY", "unset", "https://api.openai.com/v1", "demo-model"] {
        assert!(stderr.contains(needle), "the message should name {needle}: {}", show(&out));
    }

    // A port nothing listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/v1");
    let out = sbx_agent(&daemon, state.path(), &[("OPENAI_BASE_URL", &url)], &["run", "--task", "x", "--run-id", "r2", "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["reason"], "model_unreachable", "{report}");
    assert!(report["error"].as_str().unwrap_or("").contains(&url), "the URL is named: {report}");

    assert!(running(&daemon).await.is_empty(), "no sandbox for runs that could not start");
    assert!(run_dirs(state.path()).is_empty(), "no run directory for runs that could not start: {:?}", run_dirs(state.path()));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_refused_at_its_first_model_call_keeps_no_sandbox() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let state = tempfile::tempdir().expect("temp dir");
    let model = FixtureServer::start(Script::sequence(vec![Reply::Status { code: 401, body: "bad key".into(), retry_after: None }])).await.expect("fixture");
    let out = sbx_agent(
        &daemon,
        state.path(),
        &[("OPENAI_BASE_URL", &model.base_url), ("OPENAI_API_KEY", "wrong")],
        &["run", "--task", "x", "--run-id", "refused", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["steps"], 0, "{report}");
    assert_eq!(report["sandbox_id"], "", "the report names no kept sandbox: {report}");
    assert!(running(&daemon).await.is_empty(), "the sandbox of a run that took no step is removed at once, not kept for a day");
}

#[tokio::test(flavor = "multi_thread")]
async fn resume_of_an_unknown_run_creates_nothing() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let state = tempfile::tempdir().expect("temp dir");
    let out = sbx_agent(&daemon, state.path(), &[], &["resume", "no-such-run", "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(json_of(&out)["reason"], "unknown_run", "{}", show(&out));
    assert!(run_dirs(state.path()).is_empty(), "resume made {:?}", run_dirs(state.path()));
    let out = sbx_agent(&daemon, state.path(), &[], &["ls", "--json"]).await;
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(json_of(&out), serde_json::json!([]), "ls lists nothing");
}

#[tokio::test(flavor = "multi_thread")]
async fn waits_for_the_endpoint_are_printed_without_a_terminal() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let state = tempfile::tempdir().expect("temp dir");
    let model = FixtureServer::start(Script::sequence(vec![Reply::Status { code: 503, body: "busy".into(), retry_after: Some(1) }, Reply::finish("ok")]))
        .await
        .expect("fixture");
    let out =
        sbx_agent(&daemon, state.path(), &[("OPENAI_BASE_URL", &model.base_url)], &["run", "--task", "x", "--run-id", "busy", "--json", "--keep-sandbox", "0"])
            .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("waiting") && stderr.contains("(model endpoint)"), "the wait is said on a non-terminal stderr: {}", show(&out));
    assert!(!stderr.contains("-> ok"), "per-step lines stay off without a terminal: {}", show(&out));
}
