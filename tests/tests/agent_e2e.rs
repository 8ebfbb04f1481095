//! The agent loop end to end: the real `sbx agent` binary against the real daemon, with a
//! scripted OpenAI-compatible model served over HTTP from this process.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use agent_client::agent::fixture::{FixtureServer, Reply, Script, Turn};
use agent_client::agent::trace;
use anyhow::{bail, Context, Result};
use sandbox_tests::{sbx_bin, Daemon};
use serde_json::{json, Value};
use tokio::process::Child;

struct Env {
    daemon: Daemon,
    model: FixtureServer,
    state: tempfile::TempDir,
    /// Where `sbx` reaches the daemon: its socket, or a [`Cutter`] in front of it.
    socket: String,
}

impl Env {
    async fn new(script: Script) -> Result<Env> {
        Self::with_config(script, "").await
    }

    /// With the daemon started on this TOML configuration.
    async fn with_config(script: Script, toml: &str) -> Result<Env> {
        let daemon = Daemon::start_with_config(toml).await?;
        let socket = daemon.address.clone();
        Ok(Env { daemon, model: FixtureServer::start(script).await?, state: tempfile::Builder::new().prefix("sbx-agent-").tempdir()?, socket })
    }

    fn command(&self, args: &[&str]) -> Result<tokio::process::Command> {
        let mut cmd = tokio::process::Command::new(sbx_bin()?);
        cmd.args(args)
            .env("SANDBOXD_SOCKET", &self.socket)
            .env("OPENAI_BASE_URL", &self.model.base_url)
            .env("OPENAI_API_KEY", "test-key")
            .env("SBX_AGENT_STATE_DIR", self.state.path())
            .env_remove("OPENAI_MODEL")
            .kill_on_drop(true);
        Ok(cmd)
    }

    async fn sbx(&self, args: &[&str]) -> Result<Output> {
        self.command(args)?.output().await.context("running sbx")
    }

    /// `sbx agent run --task <task> --run-id <run_id> --json`, with `more` flags, to its end.
    async fn agent_run(&self, task: &str, run_id: &str, more: &[&str]) -> Result<Output> {
        let mut args = vec!["agent", "run", "--task", task, "--run-id", run_id, "--json"];
        args.extend_from_slice(more);
        self.sbx(&args).await
    }

    /// Starts `sbx` with `args` in the background, its output thrown away.
    fn spawn_quiet(&self, args: &[&str]) -> Result<Child> {
        Ok(self.command(args)?.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?)
    }

    /// Waits until the model has been asked for `turns` turns; fails once `limit` has passed, or
    /// as soon as `agent` ends.
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
}

/// Kills `agent` with SIGKILL, as a crash would, and reaps it.
async fn kill9(agent: &mut Child) -> Result<ExitStatus> {
    let pid = agent.id().context("child pid")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)?;
    Ok(agent.wait().await?)
}

/// The final JSON object of `--json`, with the exit code.
fn report(out: &Output) -> Result<(i32, Value)> {
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("stdout is not one JSON object:\n{text}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr)))?;
    Ok((out.status.code().unwrap_or(-1), v))
}

async fn file(env: &Env, sandbox_id: &str, path: &str) -> Result<String> {
    let c = env.daemon.client().await?;
    Ok(String::from_utf8_lossy(&c.read_file_all(sandbox_id, path).await?).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_step_task_completes_and_is_verified() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("mkdir -p /workspace/app && echo 'print(1)' > /workspace/app/main.txt"),
        Reply::call("write_file", json!({"path": "app/hello.txt", "content": "hello there\n"})),
        Reply::call("str_replace", json!({"path": "app/hello.txt", "old_str": "there", "new_str": "world"})),
        // Finishing before the check passes is refused…
        Reply::finish("too early"),
        Reply::bash("cat app/hello.txt && touch /workspace/app/ok"),
        // …and accepted once it does.
        Reply::finish("hello.txt says hello world"),
    ]))
    .await?;
    let out = env
        .agent_run(
            "write app/hello.txt saying hello world",
            "multi",
            &["--verify", "grep -q 'hello world' /workspace/app/hello.txt && test -f /workspace/app/ok"],
        )
        .await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["status"], "done");
    assert_eq!(r["reason"], "finished");
    assert_eq!(r["steps"], 6);
    assert_eq!(r["answer"], "hello.txt says hello world");
    assert!(r["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    assert!(r["completion_tokens"].as_u64().unwrap_or(0) > 0);
    assert!(r["final_snapshot_id"].as_str().is_some_and(|s| s.starts_with("sn-")), "{r:#}");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/app/hello.txt").await?, "hello world\n");
    assert!(r["diff"].as_str().unwrap_or_default().contains("+hello world"), "{r:#}");

    // The rejected finish reached the model with the failed check.
    let requests = env.model.requests();
    let after_reject = requests[4].to_string();
    assert!(after_reject.contains("finish REJECTED: the task check failed"), "{after_reject}");

    // `sbx agent show` prints the timeline with budget use.
    let show = env.sbx(&["agent", "show", "multi"]).await?;
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(show.status.success(), "{text}");
    assert!(text.contains("done (finished)"), "{text}");
    assert!(text.contains("6 of 50"), "{text}");
    assert!(text.contains("llm_call"), "{text}");
    assert!(text.contains("THINKING -> ACTING"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_run_then_resume_lands_the_side_effect_once() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("echo start >> /workspace/log"),
        // The agent is killed while this runs.
        Reply::bash("echo once >> /workspace/log; sleep 3"),
        Reply::bash("cat /workspace/log"),
        Reply::finish("logged"),
    ]))
    .await?;
    let mut child = env.spawn_quiet(&["agent", "run", "--task", "append to the log", "--run-id", "crashy", "--json"])?;
    // Inside the 3 s of step 2's command: its append has landed.
    wait_for_file(&env, "crashy", "/workspace/log", "once", &mut child).await?;
    let status = kill9(&mut child).await?;
    assert!(!status.success());

    let out = env.sbx(&["agent", "resume", "crashy", "--json"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["status"], "done");
    assert_eq!(r["steps"], 4);
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/log").await?, "start\nonce\n", "the append landed exactly once");

    // The daemon ran step 2 once, under the first key; nothing was re-run.
    let execs = env.daemon.client().await?.list_execs(sid, 0).await?;
    let step2: Vec<_> = execs.iter().filter(|e| e.idempotency_key.starts_with("crashy:2:act:")).collect();
    assert_eq!(step2.len(), 1, "{step2:#?}");
    assert_eq!(step2[0].idempotency_key, "crashy:2:act:0");
    // The model was told it resumed, and saw the log once.
    let requests = env.model.requests();
    let after = requests[2].to_string();
    assert!(after.contains("Resumed at step 1"), "{after}");
    let cat = requests[3].to_string();
    assert!(cat.contains("start\\nonce\\n"), "{cat}");
    let events = env.trace("crashy")?;
    assert!(events.iter().any(|e| e["decision"] == "adopt_recorded_exec"));
    Ok(())
}

/// Steps of ~1 MB output each before the kill in the long resume test.
const LONG_STEPS: usize = 105;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_a_hundred_steps_of_megabyte_outputs() -> Result<()> {
    let env = Env::new(Script::from_fn(|t: &Turn| {
        if t.index < LONG_STEPS {
            // ~1 MB each, distinct, so it is neither a stuck loop nor small.
            return Reply::bash(&format!("yes step-{} | head -c 1000000", t.index));
        }
        match t.index - LONG_STEPS {
            // The agent is killed while this runs.
            0 => Reply::bash("echo once >> /workspace/log; sleep 3"),
            1 => Reply::bash("cat /workspace/log"),
            _ => Reply::finish("logged"),
        }
    }))
    .await?;
    let mut child = env.spawn_quiet(&["agent", "run", "--task", "print a lot, then log once", "--run-id", "long", "--max-steps", "300", "--json"])?;
    env.wait_for_turns(LONG_STEPS + 1, Duration::from_secs(600), &mut child).await?;
    wait_for_file(&env, "long", "/workspace/log", "once", &mut child).await?;
    kill9(&mut child).await?;

    let started = Instant::now();
    let out = env.sbx(&["agent", "resume", "long", "--json"]).await?;
    let resume_time = started.elapsed();
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["steps"], LONG_STEPS as u64 + 3);
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/log").await?, "once\n", "landed once");
    let events = env.trace("long")?;
    assert!(events.iter().any(|e| e["decision"] == "adopt_recorded_exec"));
    // Two more model turns and the lookups: seconds, not a scan of 100 MB of outputs.
    eprintln!("resume after {LONG_STEPS} steps of 1 MB outputs: {resume_time:?}");
    assert!(resume_time < Duration::from_secs(60), "{resume_time:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_restart_mid_exec_rolls_back_and_runs_the_action_once() -> Result<()> {
    let mut env = Env::new(Script::sequence(vec![
        Reply::bash("echo start >> /workspace/log"),
        // The daemon dies while this runs: the append has happened, the exec ends LOST.
        Reply::bash("echo once >> /workspace/log; sleep 3"),
        Reply::bash("cat /workspace/log"),
        Reply::finish("logged"),
    ]))
    .await?;
    let mut child = env
        .command(&["agent", "run", "--task", "append to the log", "--run-id", "restart", "--json"])?
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    wait_for_file(&env, "restart", "/workspace/log", "once", &mut child).await?;
    env.daemon.restart().await?;
    let out = child.wait_with_output().await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["steps"], 4);
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/log").await?, "start\nonce\n", "rolled back, then appended once");
    let events = env.trace("restart")?;
    assert!(events.iter().any(|e| e["decision"] == "rollback_after_lost_exec"), "no rollback in the trace");
    let cat = env.model.requests()[3].to_string();
    assert!(cat.contains("start\\nonce\\n"), "{cat}");
    Ok(())
}

fn poll_script() -> Script {
    Script::from_fn(|t: &Turn| {
        if t.index == 0 {
            return Reply::call(
                "bash",
                json!({
                    "command": "for i in $(seq 16); do echo $i >> /workspace/progress; sleep 0.25; done; touch /workspace/done",
                    "background": true
                }),
            );
        }
        if t.last_result().starts_with("done") {
            return Reply::finish("the job finished");
        }
        Reply::bash("sleep 0.5; test -f /workspace/done && echo done || echo waiting")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_script_stops_as_no_progress_but_a_polling_one_does_not() -> Result<()> {
    let env = Env::new(Script::from_fn(|_| Reply::bash("cat /workspace/missing.txt"))).await?;
    let out = env.agent_run("read the file", "stuck", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 3, "{r:#}");
    assert_eq!(r["status"], "stopped");
    assert_eq!(r["reason"], "no_progress");
    assert_eq!(r["steps"], 4);
    assert!(r["final_snapshot_id"].as_str().is_some(), "salvage: {r:#}");
    assert!(r["summary"].as_str().unwrap_or_default().contains("same result"), "{r:#}");

    let env = Env::new(poll_script()).await?;
    let out = env.agent_run("wait for the job", "poll", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["reason"], "finished");
    let polls = r["steps"].as_u64().unwrap_or(0).saturating_sub(2);
    assert!(polls >= 4, "only {polls} identical polls: the test would not tell a stuck loop apart");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_stop_with_the_named_reason_and_a_salvage() -> Result<()> {
    let writes = || Script::from_fn(|t: &Turn| Reply::bash(&format!("echo line {} >> /workspace/notes.txt; sleep 0.3", t.index)));
    let cases: [(&[&str], &str); 3] =
        [(&["--max-tokens", "8000"], "budget_tokens"), (&["--max-time", "2"], "budget_time"), (&["--max-cost", "0.01", "--price", "1,1"], "budget_cost")];
    for (flags, reason) in cases {
        let env = Env::new(writes()).await?;
        let out = env.agent_run("take notes", "budget", flags).await?;
        let (code, r) = report(&out)?;
        assert_eq!(code, 3, "{reason}: {r:#}");
        assert_eq!(r["status"], "stopped", "{r:#}");
        assert_eq!(r["reason"], reason, "{r:#}");
        assert!(r["steps"].as_u64().unwrap_or(0) >= 1, "{r:#}");
        // Salvage: a final snapshot, the workspace diff, a summary.
        let snap = r["final_snapshot_id"].as_str().context("final snapshot")?;
        assert!(snap.starts_with("sn-"));
        assert!(r["diff"].as_str().unwrap_or_default().contains("+line 0"), "{r:#}");
        assert!(Path::new(r["diff_path"].as_str().unwrap_or_default()).is_file());
        assert!(r["summary"].as_str().unwrap_or_default().contains(reason), "{r:#}");
        // The soft warning reached the model before the stop (the time budget may jump
        // straight past it within one step).
        if reason != "budget_time" {
            let warned = env.model.requests().iter().any(|q| q.to_string().contains("BUDGET WARNING"));
            assert!(warned, "{reason}: no soft warning");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_stays_bounded_over_200_steps() -> Result<()> {
    let steps = 200;
    let script = || {
        Script::from_fn(move |t: &Turn| {
            if t.index + 1 >= steps {
                return Reply::finish("counted");
            }
            // Outputs of 60..160 lines, different each step.
            Reply::bash(&format!("seq {} {}", t.index, t.index + 60 + (t.index * 37) % 100))
        })
    };
    let window = "16000";
    let mut totals = Vec::new();
    let mut per_step = Vec::new();
    for (managed, run_id) in [(true, "ctx"), (false, "full")] {
        let env = Env::new(script()).await?;
        let mut more = vec!["--max-steps", "250"];
        if managed {
            more.extend(["--context-window", window]);
        } else {
            more.extend(["--context-window", "10000000", "--no-context-management"]);
        }
        let out = env.agent_run("count", run_id, &more).await?;
        let (code, r) = report(&out)?;
        assert_eq!(code, 0, "{r:#}");
        assert_eq!(r["steps"], steps as u64);
        let events = env.trace(run_id)?;
        let compactions = events.iter().filter(|e| e["event"] == "compaction").count();
        assert_eq!(compactions > 0, managed, "{run_id}: {compactions} compactions");
        let tokens = trace::prompt_tokens_per_call(&events);
        assert_eq!(tokens.len(), steps);
        totals.push(tokens.iter().sum::<u64>());
        per_step.push(tokens);
    }
    let (managed, full) = (&per_step[0], &per_step[1]);
    eprintln!("prompt tokens per step (managed window {window} | full history):");
    for i in (0..steps).step_by(10).chain([steps - 1]) {
        eprintln!("  step {:>3}: {:>6} | {:>7}", i + 1, managed[i], full[i]);
    }
    eprintln!("  total:    {:>7} | {:>8} ({:.1}x)", totals[0], totals[1], totals[1] as f64 / totals[0] as f64);
    // Summarization fires before a call would pass 70% of the window, so no prompt does.
    let max = managed.iter().copied().max().unwrap_or(0);
    assert!(max <= 16_000 * 7 / 10, "managed prompt reached {max} tokens");
    assert!(full[steps - 1] > 4 * max, "the full history grows without bound");
    assert!(totals[0] * 2 <= totals[1], "managed {} vs full {}", totals[0], totals[1]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_or_foreign_checkpoint_is_a_clear_error() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("echo a >> /workspace/x"),
        Reply::Status { code: 401, body: "{\"error\":{\"message\":\"invalid api key\"}}".into(), retry_after: None },
    ]))
    .await?;
    let out = env.agent_run("t", "bad", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["reason"], "fatal_error");
    assert_eq!(r["resumable"], true);
    assert!(r["error"].as_str().unwrap_or_default().contains("invalid api key"), "{r:#}");

    let path = env.run_dir("bad").join("checkpoint");
    let good = std::fs::read(&path)?;
    let mut flipped = good.clone();
    let at = flipped.len() - 20;
    flipped[at] ^= 0x04;
    std::fs::write(&path, &flipped)?;
    let out = env.sbx(&["agent", "resume", "bad", "--json"]).await?;
    let (code, r) = report(&out)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(code, 1);
    assert_eq!(r["reason"], "checkpoint_corrupt", "{r:#}");
    assert!(stderr.contains("is corrupt: checksum mismatch"), "{stderr}");

    let future = String::from_utf8_lossy(&good).replacen("SBXCKPT 1 ", "SBXCKPT 9 ", 1);
    std::fs::write(&path, future.as_bytes())?;
    let out = env.sbx(&["agent", "resume", "bad"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("schema version 9; this sbx reads version 1"), "{stderr}");

    std::fs::write(&path, &good[..good.len() / 3])?;
    let out = env.sbx(&["agent", "resume", "bad"]).await?;
    assert!(String::from_utf8_lossy(&out.stderr).contains("length mismatch"));

    // Nothing was started afresh: the run's one sandbox still has only the first step's effect.
    let labels = [("agent-run".to_owned(), "bad".to_owned())].into_iter().collect();
    let sandboxes = env.daemon.client().await?.list(labels).await?;
    assert_eq!(sandboxes.len(), 1, "no sandbox was created or forked for a refused resume: {sandboxes:#?}");
    assert_eq!(file(&env, &sandboxes[0].id, "/workspace/x").await?, "a\n");
    let execs = env.daemon.client().await?.list_execs(&sandboxes[0].id, 0).await?;
    assert!(!execs.iter().any(|e| e.idempotency_key.starts_with("bad:2:")), "no step ran after the refusals: {execs:#?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tool_calls_are_repaired_or_reasked() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        // Single quotes, a synonym and a trailing comma: repaired.
        Reply::raw("bash", "{'cmd': 'echo hi > /workspace/a.txt',}"),
        // A misspelled tool and a field alias: repaired.
        Reply::raw("write_flie", r#"{"file_path": "/workspace/b.txt", "contents": "bee"}"#),
        // Missing the required content: re-asked.
        Reply::raw("write_file", r#"{"path": "/workspace/c.txt"}"#),
        // Cut short, with a number for the text: repaired.
        Reply::raw("write_file", r#"{"path": "/workspace/c.txt", "content": 3"#),
        Reply::call("write_file", json!({"path": "/workspace/c.txt", "content": "sea"})),
        Reply::finish("three files"),
    ]))
    .await?;
    let out = env.agent_run("write three files", "sloppy", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["steps"], 5, "re-asks are not steps");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/a.txt").await?, "hi\n");
    assert_eq!(file(&env, sid, "/workspace/b.txt").await?, "bee");
    assert_eq!(file(&env, sid, "/workspace/c.txt").await?, "sea");
    let events = env.trace("sloppy")?;
    assert_eq!(events.iter().filter(|e| e["decision"] == "repaired_call").count(), 3, "3 = two repairs + the coerced number");
    assert_eq!(events.iter().filter(|e| e["decision"] == "reask").count(), 1);
    // The model got the error back, and only the latest one.
    let requests = env.model.requests();
    let reasked = requests[3].to_string();
    assert!(reasked.contains("needs the argument `content`"), "{reasked}");
    Ok(())
}

// ---- long unattended runs (issue 13) --------------------------------------------------------

/// The text of the last tool message of a request.
fn last_tool_text(request: &Value) -> String {
    request["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "tool").cloned())
        .and_then(|m| m["content"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_call_is_never_executed_and_reasoning_is_kept() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::raw("write_file", r#"{"path": "f.py", "content": "def g():\n    return f("#).cut(),
        Reply::call("write_file", json!({"path": "f.py", "content": "def g():\n    return f(1)\n"})).saying("Writing f.py in full; left: clean the build dir"),
        Reply::bash("mkdir -p /workspace/build/x && rm -rf /workspace/build && mkdir -p /workspace/bui").cut(),
        Reply::bash("ls /workspace"),
        Reply::finish("done"),
    ]))
    .await?;
    let out = env.agent_run("write f.py", "cut", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["steps"], 3, "{r:#}");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/f.py").await?, "def g():\n    return f(1)\n");
    let requests = env.model.requests();
    let told = last_tool_text(&requests[1]);
    assert!(told.contains("NOT executed") && !told.contains("wrote"), "{told}");
    assert_eq!(requests[0]["max_tokens"], 4096);
    assert_eq!(requests[1]["max_tokens"], 8192, "asked again with a larger limit");
    // The cut `mkdir -p /workspace/bui` never ran.
    let ls = last_tool_text(&requests[4]);
    assert!(!ls.contains("bui"), "{ls}");
    // The reasoning is in the next prompt and in the trace.
    assert!(requests[2].to_string().contains("Writing f.py in full; left: clean the build dir"));
    let events = env.trace("cut")?;
    assert!(events.iter().any(|e| e["event"] == "step" && e["reasoning"] == "Writing f.py in full; left: clean the build dir"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_big_read_file_is_paged_not_fatal() -> Result<()> {
    // The endpoint refuses prompts above 8k tokens, as a real one does.
    let env = Env::new(
        Script::sequence(vec![
            Reply::bash("yes x | tr -d '\\n' | head -c 400000 > /workspace/min.js"),
            Reply::call("read_file", json!({"path": "min.js"})),
            Reply::call("read_file", json!({"path": "min.js", "start_line": 1, "start_char": 500})),
            Reply::finish("read it"),
        ])
        .with_context_limit(8_000),
    )
    .await?;
    let out = env.agent_run("read min.js", "bigread", &["--context-window", "8000", "--max-completion-tokens", "1000"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let requests = env.model.requests();
    let page = last_tool_text(&requests[2]);
    assert!(page.len() < 1_500, "{}", page.len());
    assert!(page.contains("start_line=1, start_char=500"), "{page}");
    let next = last_tool_text(&requests[3]);
    assert!(next.len() < 11_000 && next.contains("start_char="), "{}", next.len());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_a_background_job_outside_the_workspace_is_not_stuck() -> Result<()> {
    // The job writes nothing in /workspace and its poll answers the same until it ends.
    let env = Env::new(Script::from_fn(|t: &Turn| {
        if t.index == 0 {
            return Reply::call("bash", json!({"command": "sleep 8; echo done > /tmp/job.out", "background": true}));
        }
        if t.last_result().starts_with("done") {
            return Reply::finish("the job finished");
        }
        Reply::Delay(Duration::from_secs(1), Box::new(Reply::bash("cat /tmp/job.out 2>/dev/null || echo waiting")))
    }))
    .await?;
    let out = env.agent_run("wait for the job", "bgpoll", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["reason"], "finished");
    assert!(r["steps"].as_u64().unwrap_or(0) >= 7, "{r:#}");

    // A real stuck loop is still stopped, after a warning one step before.
    let env = Env::new(Script::from_fn(|_| Reply::bash("cat /workspace/missing.txt"))).await?;
    let out = env.agent_run("x", "stuck", &["--stuck-after", "5"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 3, "{r:#}");
    assert_eq!(r["reason"], "no_progress");
    assert_eq!(r["steps"], 5, "--stuck-after is honoured");
    let requests = env.model.requests();
    assert!(last_tool_text(&requests[4]).contains("NO-PROGRESS WARNING"));
    assert!(!last_tool_text(&requests[3]).contains("NO-PROGRESS WARNING"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summaries_do_not_thrash_in_a_small_window() -> Result<()> {
    let env = Env::new(Script::from_fn(|t: &Turn| {
        // ~6 KB of dense output per step, each step different.
        Reply::bash(&format!(
            "seq {} 7 {} | md5sum; seq 1 1500 | sed 's/$/ {}/' | sha256sum; od -An -tx8 -N 3000 /dev/urandom",
            t.index,
            1000 + t.index,
            t.index
        ))
    }))
    .await?;
    let out = env.agent_run("print", "thrash", &["--context-window", "8000", "--max-completion-tokens", "500", "--max-steps", "25"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 3, "{r:#}");
    assert_eq!(r["reason"], "max_steps", "{r:#}");
    // Each step adds a third of the window here, so compaction is due often; a summary at
    // most every other turn (the turns between fold harder without the model).
    let summaries = env.model.summaries();
    assert!(summaries <= 13, "{summaries} summaries in 25 steps");
    // A loop that never summarizes passes the bound above; this one must.
    assert!(summaries >= 2, "only {summaries} summaries in 25 steps of a third of the window each");
    let mut turns_since = usize::MAX;
    for req in env.model.requests() {
        if req["tools"].as_array().is_some_and(|t| !t.is_empty()) {
            turns_since = turns_since.saturating_add(1);
        } else {
            assert!(turns_since >= 2, "summaries on consecutive turns");
            turns_since = 0;
        }
    }
    for e in env.trace("thrash")?.iter().filter(|e| e["event"] == "compaction") {
        assert!(e["tokens_after"].as_u64().unwrap_or(u64::MAX) < 5_600, "{e}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_outage_and_command_timeouts_are_survived() -> Result<()> {
    // The outage starts at the first request, not at the test's start: setting up the daemon
    // and the sandbox under load must not eat into it.
    let t0 = std::sync::OnceLock::new();
    let timeouts = std::sync::atomic::AtomicUsize::new(0);
    let env = Env::new(Script::from_fn(move |t: &Turn| {
        // The endpoint is down for the first 7 s.
        if t0.get_or_init(Instant::now).elapsed() < Duration::from_secs(7) {
            return Reply::Status { code: 503, body: "down".into(), retry_after: None };
        }
        // Six commands that hit their own time limit: more than the bash breaker's threshold.
        if timeouts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 6 {
            return Reply::call("bash", json!({"command": format!("sleep 5; echo {}", t.index), "timeout_secs": 1}));
        }
        if t.last_result().starts_with("hi") {
            return Reply::finish("ok");
        }
        Reply::bash("echo hi")
    }))
    .await?;
    let out = env.agent_run("x", "outage", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    let events = env.trace("outage")?;
    assert!(events.iter().filter(|e| e["event"] == "retry").count() >= 3);
    let requests = env.model.requests();
    assert!(!requests.iter().any(|r| r.to_string().contains("NOT RUN")), "bash was disabled");
    assert!(requests.iter().any(|r| last_tool_text(r).starts_with("hi")), "echo ran after the timeouts");
    let timed_out = events.iter().filter(|e| e["event"] == "step" && e["exit_code"] == 137).count();
    assert!(timed_out >= 6, "{timed_out} timeouts");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_run_continues_with_new_budgets_and_runs_are_listed() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("echo a >> /workspace/log"),
        Reply::bash("echo b >> /workspace/log"),
        Reply::bash("echo c >> /workspace/log"),
        Reply::finish("abc"),
    ]))
    .await?;
    let out = env
        .command(&["agent", "run", "--task", "log", "--run-id", "budget", "--max-steps", "2", "--keep-sandbox", "3600", "--json"])?
        .env("SBX_PROGRESS", "1")
        .output()
        .await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 3, "{r:#}");
    assert_eq!(r["reason"], "max_steps");
    // Live progress on stderr: a line per step and the end.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[budget step 1/2 · "), "{stderr}");
    assert!(stderr.contains("bash `echo b >> /workspace/log` -> ok"), "{stderr}");
    assert!(stderr.contains("stopped (max_steps)"), "{stderr}");

    let out = env.sbx(&["agent", "ls", "--json"]).await?;
    let list: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(list[0]["run_id"], "budget", "{list:#}");
    assert_eq!(list[0]["status"], "stopped");
    assert_eq!(list[0]["reason"], "max_steps");
    assert_eq!(list[0]["steps"], 2);

    let out = env.sbx(&["agent", "resume", "budget", "--max-steps", "10", "--json"]).await?;
    let (code, r2) = report(&out)?;
    assert_eq!(code, 0, "{r2:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r2["steps"], 4);
    assert_eq!(r2["sandbox_id"], r["sandbox_id"], "same sandbox");
    let sid = r2["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/log").await?, "a\nb\nc\n");

    // A damaged checkpoint: `show` tells the run from its trace.
    let path = env.run_dir("budget").join("checkpoint");
    let mut bytes = std::fs::read(&path)?;
    let at = bytes.len() - 20;
    bytes[at] ^= 0x04;
    std::fs::write(&path, &bytes)?;
    let out = env.sbx(&["agent", "show", "budget", "--json"]).await?;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(shown["from_trace"], true);
    assert_eq!(shown["reason"], "finished");
    assert_eq!(shown["steps"], 4);
    assert_eq!(shown["task"], "log");
    assert!(String::from_utf8_lossy(&out.stderr).contains("checkpoint is damaged"));
    let out = env.sbx(&["agent", "ls", "--json"]).await?;
    let list: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(list[0]["status"], "checkpoint_damaged", "{list:#}");
    assert_eq!(list[0]["steps"], 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_of_ended_runs_are_removed_after_their_keep_time() -> Result<()> {
    let env = Env::new(Script::from_fn(|_| Reply::finish("nothing to do"))).await?;
    let out = env.agent_run("t", "short", &["--keep-sandbox", "0"]).await?;
    let (code, first) = report(&out)?;
    assert_eq!(code, 0, "{first:#}");
    let out = env.agent_run("t", "kept", &[]).await?;
    let (code, second) = report(&out)?;
    assert_eq!(code, 0, "{second:#}");
    let client = env.daemon.client().await?;
    let gone = match client.get(first["sandbox_id"].as_str().unwrap_or_default()).await {
        Err(e) => e.code() == tonic::Code::NotFound,
        Ok(sb) => sb.state == agent_client::proto::SandboxState::Destroyed as i32,
    };
    assert!(gone, "the ended run's sandbox was removed by the next run");
    let kept = client.get(second["sandbox_id"].as_str().unwrap_or_default()).await?;
    assert_eq!(kept.state, agent_client::proto::SandboxState::Running as i32, "kept for a day");
    let out = env.sbx(&["agent", "ls", "--json"]).await?;
    let list: Value = serde_json::from_slice(&out.stdout)?;
    let short = list.as_array().and_then(|l| l.iter().find(|r| r["run_id"] == "short").cloned()).unwrap_or_default();
    assert_eq!(short["sandbox_removed"], true, "{list:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_follow_tails_a_running_run_to_its_end() -> Result<()> {
    let slow = |r: Reply| Reply::Delay(Duration::from_millis(600), Box::new(r));
    let env = Env::new(Script::sequence(vec![
        slow(Reply::bash("echo a >> /workspace/log")),
        slow(Reply::bash("echo b >> /workspace/log")),
        slow(Reply::finish("ab")),
    ]))
    .await?;
    let mut child = env.spawn_quiet(&["agent", "run", "--task", "log", "--run-id", "tail", "--json"])?;
    env.wait_for_turns(1, Duration::from_secs(30), &mut child).await?;
    let out = tokio::time::timeout(Duration::from_secs(60), env.sbx(&["agent", "show", "tail", "--follow"]))
        .await
        .context("show --follow did not end with the run")??;
    assert!(child.wait().await?.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("echo b >> /workspace/log"), "{text}");
    assert!(text.lines().last().is_some_and(|l| l.contains("stop")), "{text}");
    Ok(())
}

// ---- the loop against the real daemon: defects the fakes hid (issue 22) ---------------------

/// The sandbox of run `run_id`, found by its label.
async fn sandbox_of(env: &Env, run_id: &str) -> Result<Option<String>> {
    let labels = [("agent-run".to_owned(), run_id.to_owned())].into_iter().collect();
    let found = env.daemon.client().await?.list(labels).await?;
    Ok(found.into_iter().find(|s| s.state == agent_client::proto::SandboxState::Running as i32).map(|s| s.id))
}

/// Waits (bounded, failing early if `agent` ends) until `path` in run `run_id`'s sandbox
/// contains `text`: the event a test acts on, instead of a fixed sleep.
async fn wait_for_file(env: &Env, run_id: &str, path: &str, text: &str, agent: &mut Child) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(sid) = sandbox_of(env, run_id).await? {
            if let Ok(content) = file(env, &sid, path).await {
                if content.contains(text) {
                    return Ok(sid);
                }
            }
        }
        if let Some(status) = agent.try_wait()? {
            bail!("the agent ended before {path} contained {text:?}: {status}");
        }
        if Instant::now() > deadline {
            bail!("{path} never contained {text:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a [`Cutter`] does to the call it is armed for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cut {
    /// The call never reaches the daemon: the connection breaks as it is sent.
    Request,
    /// The daemon does the call; its answer is lost with the connection.
    Answer,
}

#[derive(Default)]
struct CutPlan {
    /// Bytes that mark the call (in its protobuf body: a path, a name, file content), and
    /// what to do to it.
    armed: Option<(Vec<u8>, Cut)>,
    /// After the cut, refuse every connection (a daemon that stays down) until released.
    stay_down: bool,
    down: bool,
    fired: u32,
}

type SharedPlan = std::sync::Arc<std::sync::Mutex<CutPlan>>;

fn arm(plan: &SharedPlan, marker: &str, cut: Cut, stay_down: bool) {
    let mut p = plan.lock().unwrap();
    p.armed = Some((marker.as_bytes().to_vec(), cut));
    p.stay_down = stay_down;
}

/// A UNIX-socket proxy in front of the daemon that breaks the connection at a chosen gRPC call,
/// as a daemon crash does at the worst moment. It reads just enough HTTP/2 to find the call: the
/// client's DATA frame whose (protobuf, so plain) bytes contain the marker, and the daemon's
/// first HEADERS frame on that stream, which starts its answer.
struct Cutter {
    address: String,
    plan: SharedPlan,
    _dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

const H2_PREFACE_LEN: usize = 24;
const H2_DATA: u8 = 0;
const H2_HEADERS: u8 = 1;

impl Cutter {
    async fn start(daemon_address: &str, plan: SharedPlan) -> Result<Cutter> {
        let daemon = PathBuf::from(daemon_address.strip_prefix("unix://").context("the test daemon listens on a UNIX socket")?);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("cutter.sock");
        let listener = tokio::net::UnixListener::bind(&path)?;
        let shared = plan.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if shared.lock().unwrap().down {
                    continue; // dropped: the daemon is "down"
                }
                let (daemon, plan) = (daemon.clone(), shared.clone());
                tokio::spawn(async move {
                    let _ = relay(client, &daemon, plan).await;
                });
            }
        });
        Ok(Cutter { address: format!("unix://{}", path.display()), plan, _dir: dir, task })
    }

    fn fired(&self) -> u32 {
        self.plan.lock().unwrap().fired
    }

    fn release(&self) {
        self.plan.lock().unwrap().down = false;
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_frame(r: &mut (impl tokio::io::AsyncRead + Unpin)) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut frame = vec![0u8; 9];
    r.read_exact(&mut frame).await?;
    let len = u32::from_be_bytes([0, frame[0], frame[1], frame[2]]) as usize;
    frame.resize(9 + len, 0);
    r.read_exact(&mut frame[9..]).await?;
    Ok(frame)
}

fn stream_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff
}

/// Marks the plan fired; returns nothing, the caller then drops the connection.
fn fire(plan: &SharedPlan) {
    let mut p = plan.lock().unwrap();
    p.fired += 1;
    p.down = p.stay_down;
}

async fn relay(client: tokio::net::UnixStream, daemon: &Path, plan: SharedPlan) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = tokio::net::UnixStream::connect(daemon).await?;
    let (mut cr, mut cw) = client.into_split();
    let (mut dr, mut dw) = upstream.into_split();
    let victim = std::sync::Arc::new(std::sync::Mutex::new(None::<u32>));
    let (up_plan, up_victim) = (plan.clone(), victim.clone());
    let up = async move {
        let mut preface = [0u8; H2_PREFACE_LEN];
        cr.read_exact(&mut preface).await?;
        dw.write_all(&preface).await?;
        loop {
            let frame = read_frame(&mut cr).await?;
            if frame[3] == H2_DATA {
                let cut = {
                    let mut p = up_plan.lock().unwrap();
                    match &p.armed {
                        Some((marker, cut)) if frame[9..].windows(marker.len()).any(|w| w == marker.as_slice()) => {
                            let cut = *cut;
                            p.armed = None;
                            Some(cut)
                        }
                        _ => None,
                    }
                };
                match cut {
                    Some(Cut::Request) => {
                        fire(&up_plan);
                        return Ok(());
                    }
                    Some(Cut::Answer) => *up_victim.lock().unwrap() = Some(stream_of(&frame)),
                    None => {}
                }
            }
            dw.write_all(&frame).await?;
        }
    };
    let down = async move {
        loop {
            let frame = read_frame(&mut dr).await?;
            if frame[3] == H2_HEADERS && *victim.lock().unwrap() == Some(stream_of(&frame)) {
                fire(&plan);
                return Ok(());
            }
            cw.write_all(&frame).await?;
        }
    };
    // Whichever side ends first ends both: the halves drop and both sockets close.
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

fn new_plan() -> SharedPlan {
    std::sync::Arc::new(std::sync::Mutex::new(CutPlan::default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_file_is_an_answer_for_the_model_not_a_lost_sandbox() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::call("read_file", json!({"path": "missing.txt"})),
        Reply::call("str_replace", json!({"path": "missing.txt", "old_str": "a", "new_str": "b"})),
        Reply::call("rollback", json!({"snapshot_id": "sn-doesnotexist"})),
        Reply::call("write_file", json!({"path": "missing.txt", "content": "now here\n"})),
        Reply::finish("created it"),
    ]))
    .await?;
    let out = env.agent_run("read missing.txt", "missing", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["reason"], "finished");
    let requests = env.model.requests();
    let read = last_tool_text(&requests[1]);
    assert!(read.contains("NOT_FOUND") && read.contains("/workspace/missing.txt"), "{read}");
    let edit = last_tool_text(&requests[2]);
    assert!(edit.contains("NOT_FOUND") && edit.contains("use write_file to create it"), "{edit}");
    let rollback = last_tool_text(&requests[3]);
    assert!(rollback.contains("NOT_FOUND") && rollback.contains("sn-doesnotexist"), "{rollback}");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/missing.txt").await?, "now here\n");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_cap_is_told_to_the_model_not_retried_as_an_outage() -> Result<()> {
    let background = || Reply::call("bash", json!({"command": "sleep 60", "background": true}));
    let env = Env::with_config(
        Script::sequence(vec![background(), background(), background(), Reply::finish("two jobs run; the third was refused")]),
        "[policy]\nmax_background_execs_per_sandbox = 2\n",
    )
    .await?;
    let out = env.agent_run("start three jobs", "capped", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["reason"], "finished");
    let refused = last_tool_text(&env.model.requests()[3]);
    assert!(refused.contains("RESOURCE_EXHAUSTED") && refused.contains("max_background_execs_per_sandbox"), "{refused}");
    assert!(refused.contains("not an outage"), "{refused}");
    let retries = env.trace("capped")?.into_iter().filter(|e| e["event"] == "retry").count();
    assert_eq!(retries, 0, "a cap is not waited out");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn str_replace_past_the_daemon_read_cap_edits_the_whole_file_or_refuses() -> Result<()> {
    const BIG: u64 = 9 << 20;
    let env = Env::new(Script::sequence(vec![
        Reply::bash(&format!("echo MARK=1 > big.txt && head -c {BIG} /dev/zero | tr '\\0' a >> big.txt && echo END >> big.txt")),
        Reply::call("str_replace", json!({"path": "big.txt", "old_str": "MARK=1", "new_str": "MARK=22"})),
        Reply::bash("head -c 41943040 /dev/zero > huge.bin && echo MARK=1 >> huge.bin"),
        Reply::call("str_replace", json!({"path": "huge.bin", "old_str": "MARK=1", "new_str": "MARK=2"})),
        Reply::finish("edited"),
    ]))
    .await?;
    let out = env.agent_run("edit big.txt", "bigedit", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    let client = env.daemon.client().await?;
    let big = client.read_file_all(sid, "/workspace/big.txt").await?;
    assert_eq!(big.len() as u64, 8 + BIG + 4, "the whole file was written back, one byte longer");
    assert!(big.starts_with(b"MARK=22\naaa") && big.ends_with(b"aaaEND\n"));
    let refused = last_tool_text(&env.model.requests()[4]);
    assert!(refused.contains("str_replace REFUSED") && refused.contains("32 MiB"), "{refused}");
    let huge = client.read_file(sid, "/workspace/huge.bin", 41943040, 0).await?;
    assert_eq!(huge.content, b"MARK=1\n", "the refused file is untouched");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn str_replace_keeps_bytes_that_are_not_utf8() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("printf 'caf\\351 x = 1\\nna\\357ve\\n' > latin1.txt"),
        Reply::call("str_replace", json!({"path": "latin1.txt", "old_str": "x = 1", "new_str": "x = 2"})),
        Reply::finish("edited"),
    ]))
    .await?;
    let out = env.agent_run("edit latin1.txt", "latin1", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    let bytes = env.daemon.client().await?.read_file_all(sid, "/workspace/latin1.txt").await?;
    assert_eq!(bytes, b"caf\xe9 x = 2\nna\xefve\n");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn str_replace_keeps_the_file_mode() -> Result<()> {
    let env = Env::new(Script::sequence(vec![
        Reply::bash("printf '#!/bin/sh\\necho old\\n' > run.sh && chmod 750 run.sh"),
        Reply::call("str_replace", json!({"path": "run.sh", "old_str": "old", "new_str": "new"})),
        Reply::bash("stat -c 'mode=%a' run.sh && ./run.sh"),
        Reply::finish("edited"),
    ]))
    .await?;
    let out = env.agent_run("edit run.sh", "keepmode", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let told = last_tool_text(&env.model.requests()[3]);
    assert!(told.contains("mode=750") && told.contains("new"), "{told}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_str_replace_whose_answer_was_lost_is_not_applied_twice() -> Result<()> {
    let plan = new_plan();
    let armer = plan.clone();
    let mut env = Env::new(Script::from_fn(move |t: &Turn| match t.index {
        0 => Reply::bash("printf 'x = 1\\n' > conf.txt"),
        1 => {
            // The daemon's answer to the WriteFile (the only call carrying the new text) is lost.
            arm(&armer, "y = 2", Cut::Answer, false);
            Reply::call("str_replace", json!({"path": "conf.txt", "old_str": "x = 1", "new_str": "x = 1\ny = 2"}))
        }
        _ => Reply::finish("added y"),
    }))
    .await?;
    let cutter = Cutter::start(&env.daemon.address, plan).await?;
    env.socket = cutter.address.clone();
    let out = env.agent_run("add y", "lostwrite", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(cutter.fired(), 1, "the write's answer was cut");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/conf.txt").await?, "x = 1\ny = 2\n", "applied once");
    let told = last_tool_text(&env.model.requests()[2]);
    assert!(told.contains("not applied again"), "{told}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_secs_zero_is_held_to_the_step_timeout() -> Result<()> {
    let env = Env::new(Script::sequence(vec![Reply::call("bash", json!({"command": "sleep 6; echo late", "timeout_secs": 0})), Reply::finish("done")])).await?;
    let out = env.agent_run("wait", "zero", &["--step-timeout", "2"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}");
    let told = last_tool_text(&env.model.requests()[1]);
    assert!(told.contains("TIMED OUT") && !told.contains("late"), "{told}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wild_token_count_trips_the_budget_instead_of_wrapping() -> Result<()> {
    let env = Env::new(Script::from_fn(|t: &Turn| {
        let reply = Reply::bash(&format!("echo {}", t.index));
        if t.index == 1 {
            // An endpoint whose count is garbage: near u64::MAX.
            reply.with_usage(u64::MAX - 5, 10)
        } else {
            reply
        }
    }))
    .await?;
    let out = env.agent_run("count", "wild", &["--max-tokens", "100000"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 3, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r["reason"], "budget_tokens", "{r:#}");
    assert_eq!(r["steps"], 2);
    assert!(r["prompt_tokens"].as_u64().unwrap_or(0) >= u64::MAX - 5, "{r:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_snapshot_is_told_and_a_lost_exec_then_erases_no_step() -> Result<()> {
    let plan = new_plan();
    let armer = plan.clone();
    let mut env = Env::new(Script::from_fn(move |t: &Turn| match t.index {
        0 => Reply::bash("echo one >> /workspace/log"),
        1 => {
            // The step snapshot after it never reaches the daemon.
            arm(&armer, "agent-nosnap-step-2", Cut::Request, false);
            Reply::bash("echo two >> /workspace/log")
        }
        // The daemon dies while this runs: the append has happened, the exec ends LOST.
        2 => Reply::bash("echo three >> /workspace/log; sleep 8"),
        _ => Reply::finish("logged"),
    }))
    .await?;
    let cutter = Cutter::start(&env.daemon.address, plan).await?;
    env.socket = cutter.address.clone();
    let mut child =
        env.command(&["agent", "run", "--task", "log three lines", "--run-id", "nosnap", "--json"])?.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    wait_for_file(&env, "nosnap", "/workspace/log", "three", &mut child).await?;
    env.daemon.restart().await?;
    let out = child.wait_with_output().await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(cutter.fired(), 1);
    let requests = env.model.requests();
    let warned = last_tool_text(&requests[2]);
    assert!(warned.contains("WARNING: the snapshot after this step failed"), "{warned}");
    let lost = last_tool_text(&requests[3]);
    assert!(lost.contains("NOT run again and nothing was rolled back") && lost.contains("step 2"), "{lost}");
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    assert_eq!(file(&env, sid, "/workspace/log").await?, "one\ntwo\nthree\n", "step 2 kept, step 3 not repeated");
    assert!(env.trace("nosnap")?.iter().any(|e| e["decision"] == "lost_exec_not_rolled_back"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recall_of_a_step_whose_output_the_daemon_discarded_says_so() -> Result<()> {
    let env = Env::with_config(
        Script::from_fn(|t: &Turn| match t.index {
            0..=7 => Reply::bash(&format!("seq {} 7 {} | sed 's/$/ {}/'", t.index, 20_000 + t.index, t.index)),
            8 => Reply::call("recall", json!({"step": 1})),
            _ => Reply::finish("recalled"),
        }),
        "[exec]\nmax_output_storage_bytes_per_sandbox = 65536\n",
    )
    .await?;
    let out = env.agent_run("print and recall", "discard", &["--context-window", "8000", "--max-completion-tokens", "500"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    // Turns only: the requests between are summaries.
    let turns: Vec<Value> = env.model.requests().into_iter().filter(|q| q["tools"].as_array().is_some_and(|t| !t.is_empty())).collect();
    let recalled = last_tool_text(&turns[9]);
    assert!(recalled.starts_with("step 1 (exec "), "recalled from the daemon: {recalled}");
    assert!(recalled.contains("output not kept") && !recalled.contains("no output"), "{recalled}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_start_leaves_no_sandbox_and_no_false_hint() -> Result<()> {
    let env = Env::new(Script::sequence(vec![Reply::finish("never asked")])).await?;
    let out = env.command(&["agent", "run", "--task", "t", "--run-id", "tiny", "--context-window", "400"])?.output().await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("resume with"), "{stderr}");
    assert_eq!(sandbox_of(&env, "tiny").await?, None, "no sandbox was left behind");
    assert_eq!(env.model.turns(), 0);

    // A run whose sandbox cannot be made is on disk: the hint is true, and a resume makes it.
    let out = env.command(&["agent", "run", "--task", "t", "--run-id", "noimage", "--image", "no-such-image"])?.output().await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("resume with: sbx agent resume noimage") && stderr.contains("no-such-image"), "{stderr}");
    assert_eq!(sandbox_of(&env, "noimage").await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_pin_is_refused_and_every_prompt_fits() -> Result<()> {
    let limit = 8_000;
    let env = Env::new(
        Script::sequence(vec![Reply::call("pin", json!({"key": "notes", "value": "x".repeat(40_000)})), Reply::bash("echo after"), Reply::finish("done")])
            .with_context_limit(limit),
    )
    .await?;
    let out = env.agent_run("pin a lot", "pins", &["--context-window", "8000", "--max-completion-tokens", "1000"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let requests = env.model.requests();
    assert!(last_tool_text(&requests[1]).contains("pin REFUSED"), "{}", last_tool_text(&requests[1]));
    for q in &requests {
        let chars = q["messages"].to_string().len() + q["tools"].to_string().len();
        assert!(chars / 4 <= limit, "a prompt of {} tokens was sent to an {limit}-token model", chars / 4);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_whose_answer_was_lost_is_not_taken_twice_on_resume() -> Result<()> {
    let plan = new_plan();
    let armer = plan.clone();
    let mut env = Env::new(Script::from_fn(move |t: &Turn| match t.index {
        0 => Reply::bash("echo a > /workspace/f"),
        1 => {
            // The snapshot is made, its answer lost, and the daemon stays unreachable until
            // the run gives up.
            arm(&armer, "before-change", Cut::Answer, true);
            Reply::call("snapshot", json!({"name": "before-change"}))
        }
        _ => Reply::finish("snapshotted"),
    }))
    .await?;
    let cutter = Cutter::start(&env.daemon.address, plan).await?;
    env.socket = cutter.address.clone();
    let out = env.agent_run("snapshot", "snapresume", &[]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["reason"], "fatal_error", "{r:#}");
    assert_eq!(cutter.fired(), 1);
    cutter.release();

    let out = env.sbx(&["agent", "resume", "snapresume", "--json"]).await?;
    let (code, r) = report(&out)?;
    assert_eq!(code, 0, "{r:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let sid = r["sandbox_id"].as_str().unwrap_or_default();
    let snaps = env.daemon.client().await?.list_snapshots(sid).await?;
    let taken: Vec<_> = snaps.iter().filter(|s| s.name.starts_with("before-change")).collect();
    assert_eq!(taken.len(), 1, "one snapshot, found again rather than taken twice: {snaps:#?}");
    let told = last_tool_text(&env.model.requests()[2]);
    assert!(told.contains(&taken[0].snapshot_id) && told.contains("found"), "{told}");
    Ok(())
}
