//! End to end: the operator's page (`sandboxd --web`). A real headless Chromium loads it from
//! the real daemon: it lists a sandbox created through the API, shows its exec record (text a
//! sandbox controls stays text), and updates when a new exec ends. The JSON keeps tenants apart,
//! and an exec sent with a `traceparent` carries its trace id in the record, the page's JSON and
//! `audit.jsonl`. With `[web] allow_destroy` on, a real running `sbx agent` run is steered and
//! stopped from the page's buttons; with it off, the buttons are absent and the POSTs are 403.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::Duration;

use agent_client::agent::checkpoint::{CheckpointStore, FileStore};
use agent_client::agent::fixture::{FixtureServer, Reply, Script, Turn};
use agent_client::{exec_request, proto, Client};
use sandbox_tests::browser::Browser;
use sandbox_tests::{free_port, process_sandbox, sbx_bin, Daemon};
use serde_json::Value;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN_ID: &str = "00f067aa0ba902b7";

/// A GET (or POST) on the page's listener: the status and the JSON body.
fn http(port: u16, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    http_body(port, method, path, headers, "")
}

/// [`http`] with a body.
fn http_body(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, Value) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the web listener");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// With `SANDBOXD_WEB_SCREENSHOTS=<dir>`, saves the page as it is now there (the README's).
fn screenshot(page: &mut sandbox_tests::browser::Page<'_>, name: &str) {
    if let Ok(dir) = std::env::var("SANDBOXD_WEB_SCREENSHOTS") {
        let path = std::path::Path::new(&dir).join(name);
        std::fs::write(&path, page.screenshot().expect("screenshot")).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
}

fn with_traceparent<T>(message: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut().insert("traceparent", format!("00-{TRACE_ID}-{SPAN_ID}-01").parse().expect("header"));
    req
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_lists_a_sandbox_shows_its_execs_and_updates_when_an_exec_ends() {
    let port = free_port().expect("port");
    let daemon = Daemon::start_with("", &["--web", &format!("127.0.0.1:{port}")]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    // Text a sandbox controls, which the page must show as text, never run as markup.
    let hostile = "<img src=x onerror=\"document.title='pwned'\">";
    let sb = client
        .create(proto::CreateSandboxRequest { labels: HashMap::from([("note".to_string(), hostile.to_string())]), ..process_sandbox("minimal") })
        .await
        .expect("create")
        .id;
    let first = client.exec(exec_request(&sb, ["sh", "-c", "echo hello from the page test; echo \"$1\" >&2", "sh", hostile])).await.expect("exec");

    let mut browser = tokio::task::block_in_place(Browser::start).expect("chromium");
    tokio::task::block_in_place(|| {
        let mut page = browser.open(&format!("http://127.0.0.1:{port}/#sandbox={sb}")).expect("open the page");
        let t = Duration::from_secs(30);
        // The list shows the sandbox under its tier and state, and its view its first exec.
        page.wait_for(&format!("#sandboxes tr[data-sandbox-id='{sb}']"), "minimal", t).expect("the sandbox is listed");
        page.wait_for("#sandboxes h3", "process · running", t).expect("grouped by tier and state");
        page.wait_for(&format!("#sandbox tr[data-exec-id='{}']", first.exec_id), "exited", t).expect("the exec record is shown");
        page.wait_for("#tiers tr[data-tier='process']", "available", t).expect("tier health");
        page.wait_for("#images td", "minimal", t).expect("images");
        // The hostile label is there as text, and no element came of it.
        page.wait_for(&format!("#sandboxes tr[data-sandbox-id='{sb}']"), hostile, t).expect("the label as text");
        let imgs = page.eval("document.querySelectorAll('img').length", t).expect("count img");
        assert_eq!(imgs, 0, "markup from a label or output reached the DOM");
        // Its output, on demand: the argv and stderr hold the hostile text, shown as text.
        page.eval(&format!("document.querySelector(\"tr[data-exec-id='{}'] a\").click()", first.exec_id), t).expect("click the exec");
        page.wait_for("#output pre.stdout", "hello from the page test", t).expect("stdout head");
        page.wait_for("#output pre.stderr", hostile, t).expect("stderr as text");
        assert_eq!(page.eval("document.querySelectorAll('img').length + (document.title === 'pwned' ? 100 : 0)", t).expect("count"), 0);

        // A new exec that ends appears without a reload (the long poll), with its exit code.
        let second = tokio::runtime::Handle::current().block_on(client.exec(exec_request(&sb, ["sh", "-c", "echo second; exit 3"]))).expect("second exec");
        let row = page.wait_for(&format!("#sandbox tr[data-exec-id='{}'][data-status='exited']", second.exec_id), "exited", t).expect("the new exec appears");
        assert!(row.contains("[\"sh\",\"-c\",\"echo second; exit 3\"]"), "{row}");
        let code = page.eval(&format!("document.querySelector(\"tr[data-exec-id='{}'] .exit-code\").textContent", second.exec_id), t).expect("exit code");
        assert_eq!(code, "3");
        screenshot(&mut page, "web-sandbox.png");
    });
    drop(browser);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_shows_an_agent_runs_steps_as_they_happen() {
    // A real `sbx agent` run, against the real daemon, with a scripted model over HTTP.
    let state = tempfile::Builder::new().prefix("sbx-agent-web-").tempdir().expect("state dir");
    let port = free_port().expect("port");
    let runs = state.path().display().to_string();
    let daemon = Daemon::start_with("", &["--web", &format!("127.0.0.1:{port}"), "--web-agent-runs", &runs]).await.expect("daemon");
    let model = FixtureServer::start(Script::sequence(vec![
        Reply::bash("echo step one > /workspace/one.txt"),
        Reply::bash("cat /workspace/one.txt"),
        Reply::finish("one.txt says step one"),
    ]))
    .await
    .expect("model");

    let mut browser = tokio::task::block_in_place(Browser::start).expect("chromium");
    tokio::task::block_in_place(|| {
        // The page is open before the run starts: what follows comes through the long poll.
        let mut page = browser.open(&format!("http://127.0.0.1:{port}/#run=web-run")).expect("open the page");
        let t = Duration::from_secs(60);
        page.wait_for("#runs-section h2", "Agent runs", t).expect("the runs section");
        let run = tokio::runtime::Handle::current().block_on(
            tokio::process::Command::new(sbx_bin().expect("sbx"))
                .args(["agent", "run", "--task", "write one.txt", "--run-id", "web-run", "--json", "--verify", "test -f /workspace/one.txt"])
                .env("SANDBOXD_SOCKET", &daemon.address)
                .env("OPENAI_BASE_URL", &model.base_url)
                .env("OPENAI_API_KEY", "test-key")
                .env("SBX_AGENT_STATE_DIR", state.path())
                .env_remove("OPENAI_MODEL")
                .kill_on_drop(true)
                .output(),
        );
        let run = run.expect("sbx agent run");
        assert!(run.status.success(), "{}\n{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
        page.wait_for("#runs tr[data-run-id='web-run']", "finished", t).expect("the run is listed as finished");
        page.wait_for("#run tr[data-event='step']", "echo step one > /workspace/one.txt", t).expect("the first step's action");
        page.wait_for("#run tr[data-event='step']", "cat /workspace/one.txt", t).expect("the second step's action");
        page.wait_for("#run tr[data-event='llm_call']", "prompt", t).expect("tokens per model call");
        page.wait_for("#run tr[data-event='verify']", "passed", t).expect("the verification");
        page.wait_for("#run p", "3 of 50 steps", t).expect("the budget");
        page.wait_for("#run pre", "+step one", t).expect("the final diff");
        // A step's observation is its exec's output, from the daemon.
        page.eval("[...document.querySelectorAll(\"#run tr[data-event='step'] a\")][1].click()", t).expect("click the observation");
        page.wait_for("#output pre.stdout", "step one", t).expect("the observation head");
        screenshot(&mut page, "web-agent-run.png");
    });
    drop(browser);
    drop(daemon);
}

fn token_hash(token: &str) -> String {
    use std::fmt::Write;
    let digest = <sha2::Sha256 as sha2::Digest>::digest(token.as_bytes());
    digest.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_token_shows_only_its_own_sandboxes() {
    let (grpc, web) = (free_port().expect("port"), free_port().expect("port"));
    let toml = format!(
        "[[auth.tokens]]\ntenant = \"alpha\"\nsha256 = \"{}\"\n[[auth.tokens]]\ntenant = \"beta\"\nsha256 = \"{}\"\n[web]\nallow_destroy = true\n",
        token_hash("alpha-secret"),
        token_hash("beta-secret")
    );
    let tcp = format!("tcp://127.0.0.1:{grpc}");
    let daemon = Daemon::start_with(&toml, &["--listen", &tcp, "--web", &format!("127.0.0.1:{web}")]).await.expect("daemon");
    let alpha = Client::connect(&tcp).await.expect("connect").with_token("alpha-secret").expect("token");
    let beta = Client::connect(&tcp).await.expect("connect").with_token("beta-secret").expect("token");
    let a_sb = alpha.create(process_sandbox("minimal")).await.expect("alpha creates").id;
    let a_exec = alpha.exec(exec_request(&a_sb, ["echo", "alpha's output"])).await.expect("alpha execs").exec_id;
    let b_sb = beta.create(process_sandbox("minimal")).await.expect("beta creates").id;
    let (a, b) = ([("Authorization", "Bearer alpha-secret")], [("Authorization", "Bearer beta-secret")]);

    let ids = |v: &Value| v["sandboxes"].as_array().expect("a list").iter().map(|s| s["id"].as_str().unwrap_or_default().to_string()).collect::<Vec<_>>();
    let (status, list) = tokio::task::block_in_place(|| http(web, "GET", "/api/sandboxes", &a));
    assert_eq!((status, ids(&list)), (200, vec![a_sb.clone()]));
    let (status, list) = tokio::task::block_in_place(|| http(web, "GET", "/api/sandboxes", &b));
    assert_eq!((status, ids(&list)), (200, vec![b_sb.clone()]));
    let (_, overview) = tokio::task::block_in_place(|| http(web, "GET", "/api/overview", &b));
    assert_eq!(overview["tenant"], "beta");

    // The other tenant's sandbox, exec output and destroy: not found, as if they did not exist.
    for (method, path) in
        [("GET", format!("/api/sandboxes/{a_sb}")), ("GET", format!("/api/execs/{a_exec}/output")), ("POST", format!("/api/sandboxes/{a_sb}/destroy"))]
    {
        let (status, body) = tokio::task::block_in_place(|| http(web, method, &path, &[b[0], ("X-Sandboxd-Web", "destroy")]));
        assert_eq!(status, 404, "{method} {path}: {body}");
    }
    let (status, out) = tokio::task::block_in_place(|| http(web, "GET", &format!("/api/execs/{a_exec}/output"), &a));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["stdout"]["head"], "alpha's output\n");
    // No token or a wrong one: 401.
    assert_eq!(tokio::task::block_in_place(|| http(web, "GET", "/api/sandboxes", &[])).0, 401);
    assert_eq!(tokio::task::block_in_place(|| http(web, "GET", "/api/sandboxes", &[("Authorization", "Bearer guess")])).0, 401);
    // Destroy (switched on here) needs its header, then works on the caller's own sandbox.
    let (status, body) = tokio::task::block_in_place(|| http(web, "POST", &format!("/api/sandboxes/{b_sb}/destroy"), &b));
    assert_eq!(status, 400, "{body}");
    let (status, body) = tokio::task::block_in_place(|| http(web, "POST", &format!("/api/sandboxes/{b_sb}/destroy"), &[b[0], ("X-Sandboxd-Web", "destroy")]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(beta.get(&b_sb).await.expect_err("destroyed").code(), tonic::Code::NotFound);
    assert!(alpha.get(&a_sb).await.is_ok(), "alpha's sandbox untouched");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exec_with_a_traceparent_carries_its_trace_id_in_the_record_and_the_audit_line() {
    let port = free_port().expect("port");
    let daemon = Daemon::start_with("", &["--web", &format!("127.0.0.1:{port}")]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let sb = client.create(process_sandbox("minimal")).await.expect("create").id;
    let mut raw = client.raw();
    let traced = raw.exec(with_traceparent(exec_request(&sb, ["echo", "traced"]))).await.expect("exec").into_inner();
    assert_eq!((traced.trace_id.as_str(), traced.span_id.as_str()), (TRACE_ID, SPAN_ID), "the Exec answer");
    let plain = client.exec(exec_request(&sb, ["echo", "plain"])).await.expect("exec");
    assert_eq!((plain.trace_id.as_str(), plain.span_id.as_str()), ("", ""), "no traceparent, no trace");
    // The stored record keeps it.
    let again = client.get_exec(&traced.exec_id, false).await.expect("get exec");
    assert_eq!(again.trace_id, TRACE_ID);
    let listed = client.list_execs(&sb, 0).await.expect("list execs");
    assert_eq!(listed.iter().find(|r| r.exec_id == traced.exec_id).map(|r| r.span_id.as_str()), Some(SPAN_ID));

    // The page's JSON links the exec to its trace.
    let (status, view) = tokio::task::block_in_place(|| http(port, "GET", &format!("/api/sandboxes/{sb}"), &[]));
    assert_eq!(status, 200, "{view}");
    let exec = view["execs"].as_array().expect("execs").iter().find(|e| e["exec_id"] == traced.exec_id.as_str()).cloned().expect("the traced exec");
    assert_eq!((exec["trace_id"].as_str(), exec["span_id"].as_str()), (Some(TRACE_ID), Some(SPAN_ID)));

    // And the audit line of that Exec call, written when the call ended.
    let audit = std::fs::read_to_string(daemon.state_dir().join("audit.jsonl")).expect("audit.jsonl");
    let lines: Vec<Value> = audit.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    let execs: Vec<&Value> = lines.iter().filter(|l| l["rpc"] == "Exec").collect();
    assert_eq!(execs.len(), 2, "{audit}");
    let with = execs.iter().find(|l| l["argv"][1] == "traced").expect("the traced Exec's line");
    assert_eq!((with["trace_id"].as_str(), with["span_id"].as_str()), (Some(TRACE_ID), Some(SPAN_ID)), "{audit}");
    let without = execs.iter().find(|l| l["argv"][1] == "plain").expect("the plain Exec's line");
    assert!(without.get("trace_id").is_none(), "{audit}");
    drop(daemon);
}

/// The steer the page sends, as an operator types it.
const PAGE_STEER: &str = "PAGE-STEER-5d1: write the answer to /workspace/out.txt";

/// A scripted model for a run the page acts on: step 2 holds until the test touches
/// /workspace/go (so a steer sent meanwhile waits at the next boundary whatever the machine's
/// speed), a prompt that carries the steer gets the action it asks for, and otherwise the run
/// ticks on for ever: only a stop ends it.
fn held_run_script() -> Script {
    Script::from_fn(|t: &Turn| match t.index {
        0 => Reply::bash("echo one >> /workspace/log"),
        1 => Reply::bash("for i in $(seq 1200); do [ -f /workspace/go ] && break; sleep 0.05; done; echo two >> /workspace/log"),
        _ if t.request["messages"].as_array().and_then(|m| m.last()).is_some_and(|m| m.to_string().contains("PAGE-STEER-5d1")) => {
            Reply::bash("echo steered > /workspace/out.txt")
        }
        n => Reply::bash(&format!("echo tick {n} >> /workspace/log; sleep 0.2")),
    })
}

/// `sbx agent run` in the background against `daemon` and `model`, its state in `state`.
fn spawn_agent(daemon: &Daemon, model: &FixtureServer, state: &std::path::Path, run_id: &str) -> tokio::process::Child {
    tokio::process::Command::new(sbx_bin().expect("sbx"))
        .args(["agent", "run", "--task", "append to the log until told otherwise", "--run-id", run_id, "--json"])
        .env("SANDBOXD_SOCKET", &daemon.address)
        .env("OPENAI_BASE_URL", &model.base_url)
        .env("OPENAI_API_KEY", "test-key")
        .env("SBX_AGENT_STATE_DIR", state)
        .env_remove("OPENAI_MODEL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting sbx agent run")
}

/// Waits until the model has been asked for `turns` turns; fails as soon as `agent` ends.
async fn wait_for_turns(model: &FixtureServer, turns: usize, agent: &mut tokio::process::Child) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while model.turns() < turns {
        assert!(std::time::Instant::now() < deadline, "the agent reached only turn {} of {turns}", model.turns());
        if let Some(status) = agent.try_wait().expect("try_wait") {
            panic!("the agent ended early: {status}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The requests the model got that offered tools (the turns), in order.
fn turn_requests(model: &FixtureServer) -> Vec<Value> {
    model.requests().into_iter().filter(|r| r["tools"].as_array().is_some_and(|t| !t.is_empty())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_steers_and_stops_a_running_agent_run() {
    let state = tempfile::Builder::new().prefix("sbx-agent-webact-").tempdir().expect("state dir");
    let port = free_port().expect("port");
    let runs = state.path().display().to_string();
    let daemon =
        Daemon::start_with("[web]\nallow_destroy = true\n", &["--web", &format!("127.0.0.1:{port}"), "--web-agent-runs", &runs]).await.expect("daemon");
    let model = FixtureServer::start(held_run_script()).await.expect("model");
    let mut run = spawn_agent(&daemon, &model, state.path(), "page-run");
    // Turn 1 asked: step 2 waits in the sandbox for /workspace/go.
    wait_for_turns(&model, 2, &mut run).await;
    let sid = FileStore::new(state.path()).load("page-run").expect("checkpoint").sandbox_id;
    let agent = [("X-Sandboxd-Web", "agent")];

    // What the POSTs refuse, before the page is even open.
    let steer_body = serde_json::json!({ "message": "hello" }).to_string();
    let refused = |path: &str, headers: &[(&str, &str)], body: &str| tokio::task::block_in_place(|| http_body(port, "POST", path, headers, body));
    let (status, body) = refused("/api/runs/no-such-run/steer", &agent, &steer_body);
    assert_eq!(status, 404, "an unknown run: {body}");
    for hostile in ["..", "..%2F..%2Fetc", "%2Fetc", ".hidden", "a%00b", &"x".repeat(65)] {
        let (status, body) = refused(&format!("/api/runs/{hostile}/steer"), &agent, &steer_body);
        assert_eq!(status, 404, "run id {hostile:?}: {body}");
    }
    let (status, body) = refused("/api/runs/../../steer", &agent, &steer_body);
    assert!(status == 404 || status == 400, "a path out of the runs dir: {status} {body}");
    let (status, body) = refused("/api/runs/page-run/steer", &[], &steer_body);
    assert_eq!(status, 400, "without X-Sandboxd-Web: {body}");
    let (status, body) = refused("/api/runs/page-run/steer", &agent, r#"{"message": "  "}"#);
    assert_eq!(status, 400, "an empty steer: {body}");
    let (status, body) = refused("/api/runs/page-run/stop", &agent, r#"{"status": "maybe"}"#);
    assert_eq!(status, 400, "a stop neither done nor failed: {body}");
    // A body declared larger than a steer can be is refused before a byte of it is read.
    let (status, body) = tokio::task::block_in_place(|| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        let head = format!("POST /api/runs/page-run/steer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Sandboxd-Web: agent\r\nConnection: close\r\nContent-Length: 100000000\r\n\r\n");
        s.write_all(head.as_bytes()).expect("send");
        let mut resp = String::new();
        s.read_to_string(&mut resp).expect("read");
        let status: u16 = resp.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, resp)
    });
    assert_eq!(status, 413, "an oversized body: {body}");
    assert_eq!(std::fs::read_dir(state.path().join("runs/page-run/inbox")).map(|d| d.count()).unwrap_or(0), 0, "nothing refused reached the inbox");

    let mut browser = tokio::task::block_in_place(Browser::start).expect("chromium");
    tokio::task::block_in_place(|| {
        let handle = tokio::runtime::Handle::current();
        let mut page = browser.open(&format!("http://127.0.0.1:{port}/#run=page-run")).expect("open the page");
        let t = Duration::from_secs(60);
        page.wait_for("#runs tr[data-run-id='page-run']", "running", t).expect("the run is listed as running");
        page.wait_for("#run-actions button#steer", "Steer", t).expect("the steer button");
        page.wait_for("#run-actions button#stop-done", "Stop (done)", t).expect("the stop (done) button");
        page.wait_for("#run-actions button#stop-failed", "Stop (failed)", t).expect("the stop (failed) button");

        // Steer from the page.
        page.eval(&format!("document.querySelector('#steer-message').value = {}; document.querySelector('#steer').click()", serde_json::json!(PAGE_STEER)), t)
            .expect("type and click Steer");
        let sent = page.wait_for("#run-action-result.ok", "sent", t).expect("the steer is sent");
        assert!(sent.starts_with("steer op-"), "{sent}");
        assert_eq!(page.eval("document.querySelector('#steer-message').value", t).expect("box"), "", "the box is emptied once sent");
        // Let step 2 finish: the next prompt carries the steer, pinned last.
        handle.block_on(async { daemon.client().await.expect("client").write_file(sid.as_str(), "/workspace/go", "go", 0).await.expect("go") });
        handle.block_on(wait_for_turns(&model, 3, &mut run));
        let turns = turn_requests(&model);
        assert!(!turns[1].to_string().contains("PAGE-STEER-5d1"), "the steer came before its boundary");
        let last = turns[2]["messages"].as_array().and_then(|m| m.last()).map(|m| m.to_string()).unwrap_or_default();
        assert!(last.contains(PAGE_STEER) && last.contains("[operator:"), "the steer is not the prompt's last message: {last}");
        page.wait_for("#run tr[data-event='operator']", PAGE_STEER, t).expect("the steer in the run's timeline");
        screenshot(&mut page, "web-agent-actions.png");

        // Stop it as done, with a reason, while it keeps working.
        handle.block_on(wait_for_turns(&model, 4, &mut run));
        page.eval("document.querySelector('#stop-reason').value = 'out.txt is enough'; document.querySelector('#stop-done').click()", t)
            .expect("click Stop (done)");
        page.wait_for("#run-action-result.ok", "stop op-", t).expect("the stop is sent");
        page.wait_for("#run p", "outcome operator_done", t).expect("the run ends DONE by the operator");
        page.wait_for("#runs tr[data-run-id='page-run']", "operator_done", t).expect("the list says so");
        assert_eq!(page.eval("document.querySelectorAll('#run-actions').length", t).expect("count"), 0, "no actions on an ended run");
    });
    drop(browser);

    // The run's own report: DONE by the operator, with the salvage of any end.
    let out = tokio::time::timeout(Duration::from_secs(120), run.wait_with_output()).await.expect("the run ended").expect("output");
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{r:#}");
    assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("done"), Some("operator_done")), "{r:#}");
    assert!(r["final_snapshot_id"].as_str().is_some_and(|s| s.starts_with("sn-")), "{r:#}");
    assert!(r["diff"].as_str().is_some_and(|d| d.contains("+steered")), "the steered action is in the diff: {r:#}");
    assert!(r["summary"].as_str().is_some_and(|s| s.contains("stopped by the operator: out.txt is enough")), "{r:#}");
    let ck = FileStore::new(state.path()).load("page-run").expect("checkpoint");
    assert_eq!(ck.operator.iter().map(|o| o.kind.as_str()).collect::<Vec<_>>(), ["steer", "stop"]);
    assert_eq!(std::fs::read_dir(state.path().join("runs/page-run/inbox")).expect("inbox").count(), 0, "the run took both");

    // An ended run takes nothing more: 409, and nothing is left in its inbox.
    let (status, body) = tokio::task::block_in_place(|| http_body(port, "POST", "/api/runs/page-run/steer", &agent, &steer_body));
    assert_eq!(status, 409, "{body}");
    assert_eq!(std::fs::read_dir(state.path().join("runs/page-run/inbox")).expect("inbox").count(), 0);
    // Audited, each with its request id.
    let audit = std::fs::read_to_string(daemon.state_dir().join("audit.jsonl")).expect("audit.jsonl");
    let lines: Vec<Value> = audit.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    let ok = |rpc: &str| lines.iter().filter(|l| l["rpc"] == rpc && l["status"] == "OK").count();
    assert_eq!((ok("web.SteerAgentRun"), ok("web.StopAgentRun")), (1, 1), "{audit}");
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_switch_the_page_shows_no_agent_actions_and_refuses_them() {
    let state = tempfile::Builder::new().prefix("sbx-agent-webro-").tempdir().expect("state dir");
    let port = free_port().expect("port");
    let runs = state.path().display().to_string();
    let daemon = Daemon::start_with("", &["--web", &format!("127.0.0.1:{port}"), "--web-agent-runs", &runs]).await.expect("daemon");
    let model = FixtureServer::start(held_run_script()).await.expect("model");
    let mut run = spawn_agent(&daemon, &model, state.path(), "ro-run");
    wait_for_turns(&model, 2, &mut run).await;

    let mut browser = tokio::task::block_in_place(Browser::start).expect("chromium");
    tokio::task::block_in_place(|| {
        let mut page = browser.open(&format!("http://127.0.0.1:{port}/#run=ro-run")).expect("open the page");
        let t = Duration::from_secs(60);
        page.wait_for("#runs tr[data-run-id='ro-run']", "running", t).expect("the run is listed as running");
        page.wait_for("#run tr[data-event='step']", "echo one >> /workspace/log", t).expect("its timeline is shown");
        page.wait_for("#who", "read-only", t).expect("the page says it is read-only");
        let controls = page.eval("document.querySelectorAll('#run-actions, #steer, #stop-done, #stop-failed, #destroy').length", t).expect("count");
        assert_eq!(controls, 0, "no action controls on a read-only page");
    });
    drop(browser);
    let agent = [("X-Sandboxd-Web", "agent")];
    for (path, body) in [("/api/runs/ro-run/steer", r#"{"message": "hello"}"#), ("/api/runs/ro-run/stop", r#"{"status": "done"}"#)] {
        let (status, answer) = tokio::task::block_in_place(|| http_body(port, "POST", path, &agent, body));
        assert_eq!(status, 403, "{path}: {answer}");
        assert!(answer["error"].as_str().is_some_and(|e| e.contains("allow_destroy")), "the refusal names the switch: {answer}");
    }
    assert!(
        !state.path().join("runs/ro-run/inbox").exists() || std::fs::read_dir(state.path().join("runs/ro-run/inbox")).expect("inbox").count() == 0,
        "nothing written"
    );
    assert!(run.try_wait().expect("try_wait").is_none(), "the run goes on");
    drop(run);
    drop(daemon);
}
