//! The operator's hand on agent runs, end to end: `sbx agent steer` and `sbx agent stop` sent
//! from separate `sbx` processes to a run driven by another `sbx` process, against the real
//! daemon and a scripted OpenAI-compatible model served over HTTP from this process.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use agent_client::agent::checkpoint::{CheckpointStore, FileStore};
use agent_client::agent::fixture::{FixtureServer, Reply, Script, Turn};
use agent_client::agent::trace;
use anyhow::{bail, Context, Result};
use sandbox_tests::{sbx_bin, Daemon};
use serde_json::Value;
use tokio::process::Child;

/// The steer of the first test, as the operator types it.
const STEER: &str = "OPERATOR-STEER-7f3: write the result to /workspace/out.txt, not the log";
/// The steer sent while the second test's run is down.
const STEER_DOWN: &str = "OPERATOR-STEER-down-19c: check the log before going on";

struct Env {
    daemon: Daemon,
    model: FixtureServer,
    state: tempfile::TempDir,
}

impl Env {
    async fn new(script: Script) -> Result<Env> {
        let daemon = Daemon::start_with_config("").await?;
        Ok(Env { daemon, model: FixtureServer::start(script).await?, state: tempfile::Builder::new().prefix("sbx-steer-").tempdir()? })
    }

    fn command(&self, args: &[&str]) -> Result<tokio::process::Command> {
        let mut cmd = tokio::process::Command::new(sbx_bin()?);
        cmd.args(args)
            .env("SANDBOXD_SOCKET", &self.daemon.address)
            .env("OPENAI_BASE_URL", &self.model.base_url)
            .env("OPENAI_API_KEY", "test-key")
            .env("SBX_AGENT_STATE_DIR", self.state.path())
            .env_remove("OPENAI_MODEL")
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// `sbx args…` to its end.
    async fn sbx(&self, args: &[&str]) -> Result<Output> {
        self.command(args)?.output().await.context("running sbx")
    }

    /// `sbx agent run` in the background; its report is read from its stdout at the end.
    fn spawn_run(&self, run_id: &str) -> Result<Child> {
        Ok(self
            .command(&["agent", "run", "--task", "append to the log until told otherwise", "--run-id", run_id, "--json"])?
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?)
    }

    /// Waits until the model has been asked for `turns` turns; fails after `limit`, or as soon
    /// as `agent` ends.
    async fn wait_for_turns(&self, turns: usize, limit: Duration, agent: &mut Child) -> Result<()> {
        let deadline = Instant::now() + limit;
        while self.model.turns() < turns {
            if Instant::now() > deadline {
                bail!("the agent reached only turn {} of {turns} within {limit:?}", self.model.turns());
            }
            if let Some(status) = agent.try_wait()? {
                bail!("the agent ended early: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    fn run_dir(&self, run_id: &str) -> PathBuf {
        self.state.path().join("runs").join(run_id)
    }

    fn trace(&self, run_id: &str) -> Result<Vec<Value>> {
        Ok(trace::read(&self.run_dir(run_id).join("trace.jsonl"))?)
    }

    /// The requests the model got that offered tools (the turns), in order.
    fn turn_requests(&self) -> Vec<Value> {
        self.model.requests().into_iter().filter(|r| r["tools"].as_array().is_some_and(|t| !t.is_empty())).collect()
    }
}

/// The last message of a request: where a pinned steer goes.
fn last_message(request: &Value) -> String {
    request["messages"].as_array().and_then(|m| m.last()).map(|m| m.to_string()).unwrap_or_default()
}

/// Waits (bounded) for `child` to end and parses the one JSON object it printed.
async fn report_of(child: Child, limit: Duration) -> Result<(i32, Value)> {
    let out = tokio::time::timeout(limit, child.wait_with_output()).await.context("the run did not end")??;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("stdout is not one JSON object:\n{text}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr)))?;
    Ok((out.status.code().unwrap_or(-1), v))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steer_reaches_the_next_prompt_and_stop_done_ends_the_run_with_a_salvage() -> Result<()> {
    sandbox_tests::require_environment()?;
    let env = Env::new(Script::from_fn(|t: &Turn| match t.index {
        0 => Reply::bash("echo one >> /workspace/log"),
        // Holds the step until the test has sent the steer (it touches /workspace/go), so the
        // steer is waiting at the next boundary whatever the machine's speed.
        1 => Reply::bash("for i in $(seq 1200); do [ -f /workspace/go ] && break; sleep 0.05; done; echo two >> /workspace/log"),
        2 => Reply::bash("echo three > /workspace/out.txt"),
        // Then it would go on for ever: only the stop ends the run.
        n => Reply::bash(&format!("echo tick {n} >> /workspace/log; sleep 0.2")),
    }))
    .await?;

    // Unknown runs are refused, and nothing is made for them.
    let out = env.sbx(&["agent", "steer", "no-such-run", "hello"]).await?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("unknown run no-such-run"), "{}", stderr(&out));
    let out = env.sbx(&["--json", "agent", "stop", "no-such-run", "--done"]).await?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let refused: Value = serde_json::from_slice(&out.stdout).with_context(|| stderr(&out))?;
    assert_eq!(refused["reason"], "unknown_run", "{refused}");
    assert!(!env.run_dir("no-such-run").exists());
    let out = env.sbx(&["agent", "steer", "../escape", "hello"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("invalid run id"), "{}", stderr(&out));

    let mut run = env.spawn_run("live")?;
    // Turn 1 asked: step 2 waits in the sandbox for /workspace/go.
    env.wait_for_turns(2, Duration::from_secs(120), &mut run).await?;
    let out = env.sbx(&["agent", "steer", "live", STEER]).await?;
    assert!(out.status.success(), "{}", stderr(&out));
    let request_id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(request_id.starts_with("op-"), "{request_id}");
    assert!(stderr(&out).contains("taken at its next step boundary"), "{}", stderr(&out));
    // Let step 2 finish.
    let sid = FileStore::new(env.state.path()).load("live")?.sandbox_id;
    env.daemon.client().await?.write_file(sid.as_str(), "/workspace/go", "go", 0).await?;

    // The very next prompt carries the steer, pinned last; the one before did not.
    env.wait_for_turns(3, Duration::from_secs(120), &mut run).await?;
    let turns = env.turn_requests();
    assert!(!turns[1].to_string().contains("OPERATOR-STEER-7f3"));
    let last = last_message(&turns[2]);
    assert!(last.contains(STEER) && last.contains("[operator:"), "{last}");
    // Answered by the call of step 3, it moves into the history: once, before that call.
    env.wait_for_turns(4, Duration::from_secs(120), &mut run).await?;
    let fourth = env.turn_requests()[3].to_string();
    assert_eq!(fourth.matches("OPERATOR-STEER-7f3").count(), 1, "{fourth}");
    assert!(!last_message(&env.turn_requests()[3]).contains("OPERATOR-STEER-7f3"));

    // Stop it as done, from another process, while it keeps working.
    let out = env.sbx(&["agent", "stop", "live", "--done", "--reason", "out.txt is all we need"]).await?;
    assert!(out.status.success(), "{}", stderr(&out));
    let (code, r) = report_of(run, Duration::from_secs(120)).await?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["status"], "done", "{r:#}");
    assert_eq!(r["reason"], "operator_done", "{r:#}");
    assert_eq!(r["resumable"], false);
    // The salvage of any end: a final snapshot, the diff, a summary with the operator's reason.
    assert!(r["final_snapshot_id"].as_str().is_some_and(|s| s.starts_with("sn-")), "{r:#}");
    let diff = r["diff"].as_str().unwrap_or_default();
    assert!(diff.contains("+one") && diff.contains("+three"), "{diff}");
    assert!(r["summary"].as_str().is_some_and(|s| s.contains("stopped by the operator: out.txt is all we need")), "{r:#}");
    let c = env.daemon.client().await?;
    let out_txt = String::from_utf8_lossy(&c.read_file_all(sid.as_str(), "/workspace/out.txt").await?).into_owned();
    assert_eq!(out_txt, "three\n");

    // Recorded in the trace and the checkpoint; nothing left waiting.
    let events = env.trace("live")?;
    assert!(events.iter().any(|e| e["event"] == "operator" && e["decision"] == "steer" && e["request"] == request_id.as_str()), "{events:#?}");
    assert!(events.iter().any(|e| e["event"] == "operator" && e["decision"] == "acknowledged" && e["acked_step"] == 3));
    assert!(events.iter().any(|e| e["event"] == "transition" && e["to"] == "DONE" && e["why"] == "operator stop"));
    let ck = FileStore::new(env.state.path()).load("live")?;
    let kinds: Vec<&str> = ck.operator.iter().map(|o| o.kind.as_str()).collect();
    assert_eq!(kinds, ["steer", "stop"]);
    assert_eq!(ck.operator[0].acked_step, Some(3));
    let inbox = env.run_dir("live").join("inbox");
    assert_eq!(std::fs::read_dir(&inbox)?.count(), 0, "inbox left non-empty");

    // `show` lists them; a finished run takes no more.
    let show = env.sbx(&["agent", "show", "live"]).await?;
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(text.contains("Operator requests:") && text.contains("answered at step 3"), "{text}");
    let out = env.sbx(&["agent", "steer", "live", "one more thing"]).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("run live is finished (done: operator_done)"), "{}", stderr(&out));
    assert_eq!(std::fs::read_dir(&inbox)?.count(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_queued_while_the_run_is_down_is_applied_on_resume() -> Result<()> {
    sandbox_tests::require_environment()?;
    let env = Env::new(Script::from_fn(|t: &Turn| match t.index {
        0 => Reply::bash("echo one >> /workspace/log"),
        // The run is killed while this runs.
        1 => Reply::bash("echo two >> /workspace/log; sleep 2"),
        n if t.request.to_string().contains("OPERATOR-STEER-down-19c") => Reply::finish(&format!("saw the operator at turn {n}")),
        n => Reply::bash(&format!("echo tick {n} >> /workspace/log")),
    }))
    .await?;
    let mut run = env.spawn_run("down")?;
    env.wait_for_turns(2, Duration::from_secs(120), &mut run).await?;
    let pid = run.id().context("pid")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)?;
    run.wait().await?;

    let out = env.sbx(&["--json", "agent", "steer", "down", STEER_DOWN]).await?;
    assert!(out.status.success(), "{}", stderr(&out));
    let sent: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(sent["run"], "down", "{sent}");
    let before = env.turn_requests().len();

    let out = env.sbx(&["agent", "resume", "down", "--json"]).await?;
    let r: Value = serde_json::from_slice(&out.stdout).with_context(|| stderr(&out))?;
    assert_eq!(out.status.code(), Some(0), "{r:#}\n{}", stderr(&out));
    assert_eq!(r["status"], "done");
    // The first prompt of the resumed run carries it, and the model acted on it there.
    let turns = env.turn_requests();
    assert!(turns.len() > before, "the resume asked the model nothing");
    assert!(last_message(&turns[before]).contains(STEER_DOWN), "{}", last_message(&turns[before]));
    assert_eq!(r["answer"], format!("saw the operator at turn {before}"));
    let events = env.trace("down")?;
    assert!(events.iter().any(|e| e["event"] == "operator" && e["decision"] == "steer" && e["session"] == 1), "applied in the resumed session");
    assert_eq!(std::fs::read_dir(env.run_dir("down").join("inbox"))?.count(), 0);
    Ok(())
}
