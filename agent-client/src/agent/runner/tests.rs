//! The loop against the in-memory sandbox and the in-process scripted model: every resume path,
//! stops, repairs and re-asks, without a daemon.

use std::sync::Arc;

use serde_json::{json, Value};

use super::*;
use crate::agent::fixture::{Reply, Script, ScriptedLlm};
use crate::agent::sandbox::{basic_handler, FakeSandbox};

fn spec(task: &str) -> RunSpec {
    RunSpec {
        task: task.into(),
        model: "gpt-4o".into(),
        isolation: String::new(),
        image: String::new(),
        verify: None,
        max_steps: 30,
        context_window: 16_000,
        managed_context: true,
        max_tokens: None,
        max_cost: None,
        max_time_secs: None,
        price: None,
        step_timeout_secs: 30,
        max_completion_tokens: 1_000,
    }
}

fn opts(dir: &std::path::Path) -> RunOptions {
    let mut o = RunOptions::new(dir);
    o.backoff = Backoff {
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        max_attempts: 4,
        patience: None,
    };
    o.llm_backoff = Backoff {
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        max_attempts: u32::MAX,
        patience: Some(Duration::from_secs(5)),
    };
    o.llm_breaker_cooldown = Duration::from_millis(20);
    o
}

fn llm(replies: Vec<Reply>) -> Arc<ScriptedLlm> {
    Arc::new(ScriptedLlm::new(Script::sequence(replies), "gpt-4o"))
}

async fn run(
    fake: &FakeSandbox,
    spec: RunSpec,
    replies: Vec<Reply>,
    dir: &std::path::Path,
) -> (RunReport, Arc<ScriptedLlm>) {
    let model = llm(replies);
    let report = start(
        fake.clone(),
        model.clone(),
        spec,
        Some("r1".into()),
        opts(dir),
    )
    .await
    .expect("run starts");
    (report, model)
}

fn log_file(fake: &FakeSandbox, report: &RunReport) -> String {
    String::from_utf8(
        fake.file(&report.sandbox_id, "/workspace/log")
            .unwrap_or_default(),
    )
    .unwrap_or_default()
}

#[tokio::test]
async fn a_multi_step_task_completes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, _) = run(
        &fake,
        spec("append two lines and show them"),
        vec![
            Reply::bash("echo one >> log"),
            Reply::bash("echo two >> log"),
            Reply::call("read_file", json!({"path": "log"})),
            Reply::finish("one, two"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.reason, StopReason::Finished);
    assert_eq!(report.steps, 4);
    assert_eq!(report.answer.as_deref(), Some("one, two"));
    assert!(report.final_snapshot_id.is_some());
    assert!(report.prompt_tokens > 0 && report.completion_tokens > 0);
    assert_eq!(log_file(&fake, &report), "one\ntwo\n");
    // Every exec of a step carries the run's key.
    let keys: Vec<String> = fake
        .execs()
        .iter()
        .map(|e| e.idempotency_key.clone())
        .filter(|k| k.contains(":act:"))
        .collect();
    assert_eq!(keys, vec!["r1:1:act:0", "r1:2:act:0"]);
    // The trace has the transitions and the model calls.
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    assert!(events
        .iter()
        .any(|e| e["event"] == "transition" && e["to"] == "VERIFYING"));
    assert_eq!(
        crate::agent::trace::prompt_tokens_per_call(&events).len(),
        4
    );
}

#[tokio::test]
async fn finish_is_accepted_only_when_the_task_check_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(Arc::new(
        |cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
            if cmd == "test -f /workspace/done" {
                return if files.contains_key("/workspace/done") {
                    (0, String::new())
                } else {
                    (1, "not done\n".into())
                };
            }
            (basic_handler())(cmd, files)
        },
    ));
    let mut s = spec("make done exist");
    s.verify = Some("test -f /workspace/done".into());
    let (report, model) = run(
        &fake,
        s,
        vec![
            Reply::finish("done already"),
            Reply::call("write_file", json!({"path": "done", "content": "yes"})),
            Reply::finish("now done"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.answer.as_deref(), Some("now done"));
    let log = model.log.lock().map(|l| l.clone()).unwrap_or_default();
    let second = log[1].to_string();
    assert!(
        second.contains("finish REJECTED: the task check failed"),
        "{second}"
    );
    assert!(
        second.contains(r#"\"expected\":\"exit code 0\""#),
        "{second}"
    );
}

#[tokio::test]
async fn repeated_rejections_fail_with_verify_failed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut s = spec("x");
    s.verify = Some("exit 1".into());
    let (report, _) = run(
        &fake,
        s,
        vec![Reply::finish("a"), Reply::finish("b"), Reply::finish("c")],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Failed);
    assert_eq!(report.reason, StopReason::VerifyFailed);
}

#[tokio::test]
async fn malformed_calls_are_repaired_or_reasked_with_only_the_latest_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, model) = run(
        &fake,
        spec("x"),
        vec![
            // Repairable: trailing comma, synonym field.
            Reply::raw("bash", r#"{"cmd": "echo one >> log",}"#),
            // Not repairable: the required argument is missing. Twice.
            Reply::raw("write_file", r#"{"path": "a"}"#),
            Reply::raw("write_file", r#"{"path": "b"}"#),
            // Prose instead of a call.
            Reply::Text("I think I am done.".into()),
            Reply::finish("ok"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(log_file(&fake, &report), "one\n");
    let log = model.log.lock().map(|l| l.clone()).unwrap_or_default();
    // The request after the second bad call holds its error and not the first one's.
    let third = log[3].to_string();
    assert!(third.contains("needs the argument `content`"), "{third}");
    assert_eq!(third.matches("could not be used").count(), 1, "{third}");
    // The repaired call is kept as it should have been written.
    assert!(
        log[1]
            .to_string()
            .contains(r#"{\"command\":\"echo one >> log\"}"#),
        "{}",
        log[1]
    );
    let fourth = log[4].to_string();
    assert!(fourth.contains("did not call a tool"), "{fourth}");
    assert!(
        !fourth.contains("needs the argument"),
        "old errors are dropped: {fourth}"
    );
}

#[tokio::test]
async fn endless_garbage_stops_as_malformed_output() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, _) = run(
        &fake,
        spec("x"),
        vec![Reply::raw("nope", "{}"); 10],
        dir.path(),
    )
    .await;
    assert_eq!(report.reason, StopReason::MalformedOutput);
    assert_eq!(report.status, RunStatus::Failed);
}

#[tokio::test]
async fn a_stuck_loop_stops_as_no_progress_with_a_salvage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, _) = run(
        &fake,
        spec("x"),
        vec![Reply::bash("cat missing"); 20],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Stopped);
    assert_eq!(report.reason, StopReason::NoProgress);
    assert_eq!(report.steps, 4);
    assert!(report.final_snapshot_id.is_some());
    assert!(report.summary.contains("no_progress"), "{}", report.summary);
}

#[tokio::test]
async fn budgets_stop_with_their_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut s = spec("x");
    s.max_tokens = Some(6_000);
    let replies: Vec<Reply> = (0..50)
        .map(|i| Reply::bash(&format!("echo {i} >> log")))
        .collect();
    let (report, model) = run(&fake, s, replies, dir.path()).await;
    assert_eq!(report.reason, StopReason::BudgetTokens, "{report:?}");
    assert_eq!(report.status, RunStatus::Stopped);
    assert!(report.final_snapshot_id.is_some());
    let log = model.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(
        log.iter().any(|r| r.to_string().contains("BUDGET WARNING")),
        "soft warning before the stop"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = spec("x");
    s.max_steps = 3;
    let (report, _) = run(
        &fake,
        s,
        vec![
            Reply::bash("echo a >> log"),
            Reply::bash("echo b >> log"),
            Reply::bash("echo c >> log"),
            Reply::bash("echo d >> log"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.reason, StopReason::MaxSteps);
    assert_eq!(report.steps, 3);
}

#[tokio::test]
async fn retryable_model_errors_are_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let busy = Reply::Status {
        code: 503,
        body: "busy".into(),
        retry_after: None,
    };
    let (report, _) = run(
        &fake,
        spec("x"),
        vec![busy.clone(), busy, Reply::finish("ok")],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    assert_eq!(events.iter().filter(|e| e["event"] == "retry").count(), 2);
}

#[tokio::test]
async fn auth_failure_is_fatal_and_resumable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, _) = run(
        &fake,
        spec("x"),
        vec![
            Reply::bash("echo one >> log"),
            Reply::Status {
                code: 401,
                body: "bad key".into(),
                retry_after: None,
            },
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.reason, StopReason::FatalError);
    assert!(report.resumable);
    assert!(
        report
            .error
            .as_deref()
            .is_some_and(|e| e.contains("bad key")),
        "{report:?}"
    );
    let resumed = resume(
        fake.clone(),
        |_| Ok(llm(vec![Reply::finish("ok")]) as Arc<dyn LlmProvider>),
        "r1",
        opts(dir.path()),
    )
    .await
    .expect("resume");
    assert_eq!(resumed.status, RunStatus::Done, "{resumed:?}");
    assert_eq!(resumed.steps, 2);
    assert_eq!(log_file(&fake, &resumed), "one\n");
}

/// Leaves run r1 as a crash would: step 1 done, step 2 (`echo two >> log`) pending.
async fn crashed_run(dir: &std::path::Path, fake: &FakeSandbox) -> Checkpoint {
    let (report, _) = run(
        fake,
        spec("x"),
        vec![
            Reply::bash("echo one >> log"),
            Reply::Status {
                code: 401,
                body: "x".into(),
                retry_after: None,
            },
        ],
        dir,
    )
    .await;
    assert_eq!(report.steps, 1);
    let store = FileStore::new(dir);
    let mut ck = store.load("r1").expect("checkpoint");
    ck.outcome = None;
    ck.state = LoopState::Acting;
    let action = Action::Bash {
        command: "echo two >> log".into(),
        timeout_secs: None,
        background: false,
    };
    ck.pending = Some(PendingAction {
        step: 2,
        call_id: "call_x".into(),
        call_name: "bash".into(),
        call_arguments: r#"{"command":"echo two >> log"}"#.into(),
        action,
        idempotency_key: idempotency_key("r1", 2, 0, "act"),
        attempt: 0,
        verifying: false,
        reasoning: String::new(),
        expect_sha256: None,
    });
    store.save(&ck).expect("save");
    ck
}

async fn resume_to_end(dir: &std::path::Path, fake: &FakeSandbox) -> (RunReport, Arc<ScriptedLlm>) {
    let model = llm(vec![Reply::finish("ok")]);
    let m = model.clone();
    let report = resume(
        fake.clone(),
        move |_| Ok(m as Arc<dyn LlmProvider>),
        "r1",
        opts(dir),
    )
    .await
    .expect("resume");
    (report, model)
}

#[tokio::test]
async fn resume_adopts_an_exec_the_daemon_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let ck = crashed_run(dir.path(), &fake).await;
    // The crash came after the exec was sent: the daemon ran it.
    let req = ExecRequest {
        idempotency_key: idempotency_key("r1", 2, 0, "act"),
        ..crate::exec_request(ck.sandbox_id.as_str(), ["sh", "-c", "echo two >> log"])
    };
    fake.exec(req).await.expect("exec");
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.steps, 3);
    assert_eq!(
        log_file(&fake, &report),
        "one\ntwo\n",
        "the effect landed once"
    );
    let prompt = model
        .log
        .lock()
        .map(|l| l[0].to_string())
        .unwrap_or_default();
    assert!(prompt.contains("Resumed at step 1"), "{prompt}");
    assert!(prompt.contains("recorded result is used"), "{prompt}");
}

#[tokio::test]
async fn resume_shows_the_adopted_exec_output_though_listexecs_has_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let ck = crashed_run(dir.path(), &fake).await;
    // The recorded exec printed something; ListExecs returns metadata only, so the output has
    // to come from GetExec.
    let req = ExecRequest {
        idempotency_key: idempotency_key("r1", 2, 0, "act"),
        ..crate::exec_request(ck.sandbox_id.as_str(), ["sh", "-c", "seq 3"])
    };
    fake.exec(req).await.expect("exec");
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let prompt = model
        .log
        .lock()
        .map(|l| l[0].to_string())
        .unwrap_or_default();
    assert!(prompt.contains("recorded result is used"), "{prompt}");
    assert!(
        prompt.contains("1\\n2\\n3"),
        "the adopted exec's output: {prompt}"
    );
}

#[tokio::test]
async fn resume_reruns_an_action_that_never_started() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    crashed_run(dir.path(), &fake).await;
    let (report, _) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(log_file(&fake, &report), "one\ntwo\n");
    assert!(
        fake.execs()
            .iter()
            .any(|e| e.idempotency_key == "r1:2:act:1"),
        "re-run under a new key"
    );
}

#[tokio::test]
async fn resume_rolls_back_a_lost_exec_before_running_it_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let ck = crashed_run(dir.path(), &fake).await;
    // The exec started, wrote half its effect, and was lost with the daemon.
    fake.lose_next_exec();
    let req = ExecRequest {
        idempotency_key: idempotency_key("r1", 2, 0, "act"),
        ..crate::exec_request(ck.sandbox_id.as_str(), ["sh", "-c", "echo two >> log"])
    };
    fake.exec(req).await.expect("lost exec");
    fake.write_file(&ck.sandbox_id, "/workspace/log", b"one\ntw".to_vec(), 0)
        .await
        .expect("half a write");
    let (report, _) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(
        log_file(&fake, &report),
        "one\ntwo\n",
        "rolled back, then run once"
    );
}

#[tokio::test]
async fn resume_forks_when_the_sandbox_is_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let ck = crashed_run(dir.path(), &fake).await;
    fake.destroy(&ck.sandbox_id);
    let (report, _) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_ne!(report.sandbox_id, ck.sandbox_id);
    assert_eq!(log_file(&fake, &report), "one\ntwo\n");
}

#[tokio::test]
async fn corrupt_checkpoint_is_a_clear_error_not_a_fresh_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    crashed_run(dir.path(), &fake).await;
    let path = FileStore::new(dir.path()).path("r1");
    let mut bytes = std::fs::read(&path).expect("read");
    let n = bytes.len();
    bytes[n - 10] ^= 0x20;
    std::fs::write(&path, bytes).expect("write");
    let err = resume(
        fake.clone(),
        |_| Ok(llm(vec![]) as Arc<dyn LlmProvider>),
        "r1",
        opts(dir.path()),
    )
    .await
    .expect_err("refused");
    assert!(
        err.to_string().contains("is corrupt: checksum mismatch"),
        "{err}"
    );
}

#[tokio::test]
async fn a_finished_run_is_reported_not_rerun() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (first, _) = run(&fake, spec("x"), vec![Reply::finish("42")], dir.path()).await;
    let execs = fake.execs().len();
    let again = resume(
        fake.clone(),
        |_| Ok(llm(vec![]) as Arc<dyn LlmProvider>),
        "r1",
        opts(dir.path()),
    )
    .await
    .expect("report");
    assert_eq!(again.answer.as_deref(), Some("42"));
    assert_eq!(again.status, first.status);
    assert_eq!(fake.execs().len(), execs);
    let err = start(
        fake.clone(),
        llm(vec![]),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect_err("exists");
    assert!(matches!(err, AgentError::RunExists(_)), "{err}");
}

#[tokio::test]
async fn context_stays_bounded_over_many_steps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut s = spec("count");
    s.max_steps = 120;
    s.context_window = 8_000;
    let replies: Vec<Reply> = (0..130)
        .map(|i| Reply::bash(&format!("seq {}", 40 + i % 7)))
        .collect();
    let (report, _) = run(&fake, s, replies, dir.path()).await;
    assert_eq!(report.reason, StopReason::MaxSteps, "{report:?}");
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    let per_call = crate::agent::trace::prompt_tokens_per_call(&events);
    assert_eq!(per_call.len(), 120);
    let max = per_call.iter().copied().max().unwrap_or(0);
    assert!(max <= 8_000 * 7 / 10 + 600, "prompt grew to {max}");
    assert!(events.iter().any(|e| e["event"] == "compaction"));
}

#[tokio::test]
async fn a_daemon_outage_goes_through_retrying_with_the_same_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    fake.refuse_execs(":act:", 2);
    let (report, _) = run(
        &fake,
        spec("x"),
        vec![Reply::bash("echo one >> log"), Reply::finish("ok")],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(log_file(&fake, &report), "one\n");
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    let retries = events
        .iter()
        .filter(|e| {
            e["event"] == "transition"
                && e["to"] == "RETRYING"
                && e["why"]
                    .as_str()
                    .is_some_and(|w| w.contains("daemon unavailable"))
        })
        .count();
    assert_eq!(retries, 2);
    let keys: Vec<String> = fake
        .execs()
        .iter()
        .map(|e| e.idempotency_key.clone())
        .filter(|k| k.contains(":act:"))
        .collect();
    assert_eq!(
        keys,
        vec!["r1:1:act:0"],
        "re-sent under the same key, run once"
    );
}

#[tokio::test]
async fn a_lost_exec_during_a_run_is_rolled_back_and_run_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    // Step 2's exec is lost (the daemon died under it); step 1 runs normally first.
    fake.lose_exec_keyed("r1:2:act:0");
    let replies = vec![
        Reply::bash("echo one >> log"),
        Reply::bash("echo two >> log"),
        Reply::finish("ok"),
    ];
    let (report, _) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(log_file(&fake, &report), "one\ntwo\n");
    let keys: Vec<String> = fake
        .execs()
        .iter()
        .map(|e| e.idempotency_key.clone())
        .filter(|k| k.contains(":act:"))
        .collect();
    assert_eq!(keys, vec!["r1:1:act:0", "r1:2:act:0", "r1:2:act:1"]);
}

// ---- long unattended runs (issue 13) --------------------------------------------------------

fn requests_of(model: &ScriptedLlm) -> Vec<Value> {
    model.log.lock().map(|l| l.clone()).unwrap_or_default()
}

#[tokio::test]
async fn a_call_cut_off_by_the_length_limit_is_never_executed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, model) = run(
        &fake,
        spec("write f.py, clean the build dir"),
        vec![
            // A half write_file: the repairer could close this JSON, but it must not be run.
            Reply::raw(
                "write_file",
                r#"{"path": "f.py", "content": "def g():\n    return f("#,
            )
            .cut(),
            Reply::call(
                "write_file",
                json!({"path": "f.py", "content": "def g():\n    return f(1)\n"}),
            ),
            Reply::bash("rm -rf /workspace/build && mkdir -p /workspace/bui").cut(),
            Reply::bash("rm -rf /workspace/build && mkdir -p /workspace/build"),
            Reply::finish("done"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.steps, 3, "the cut replies are not steps");
    let content = fake
        .file(&report.sandbox_id, "/workspace/f.py")
        .unwrap_or_default();
    assert_eq!(
        String::from_utf8_lossy(&content),
        "def g():\n    return f(1)\n"
    );
    let commands: Vec<String> = fake.execs().iter().map(|e| e.argv.join(" ")).collect();
    assert!(
        !commands
            .iter()
            .any(|c| c.contains("/workspace/bui ") || c.ends_with("/workspace/bui")),
        "the cut command ran: {commands:?}"
    );
    let log = requests_of(&model);
    // The model is told, and the next call gets a larger completion limit.
    let told = log[1].to_string();
    assert!(
        told.contains("cut off at the completion limit of 1000 tokens"),
        "{told}"
    );
    assert!(told.contains("NOT executed"), "{told}");
    assert!(!told.contains("wrote "), "{told}");
    assert_eq!(log[0]["max_tokens"], 1000);
    assert_eq!(log[1]["max_tokens"], 2000);
    assert_eq!(
        log[2]["max_tokens"], 1000,
        "back to the configured limit once a call is accepted"
    );
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    assert_eq!(
        events
            .iter()
            .filter(|e| e["decision"] == "cut_off_reply")
            .count(),
        2
    );
}

/// A handler that also makes a 400 KB single-line file and prints long distinct outputs.
fn big_handler() -> crate::agent::sandbox::FakeHandler {
    Arc::new(|cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
        if cmd == "make-min-js" {
            files.insert("/workspace/min.js".into(), "x".repeat(400_000).into_bytes());
            return (0, String::new());
        }
        if let Some(n) = cmd
            .strip_prefix("lines ")
            .and_then(|n| n.trim().parse::<usize>().ok())
        {
            // Dense text (hex words): few characters per token, as in real logs with hashes.
            let out: String = (0..n)
                .map(|i| {
                    let h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n as u64;
                    format!("{i} {h:016x} {:016x} {n}\n", h.rotate_left(17))
                })
                .collect();
            return (0, format!("{out}MARKER-{n}\n"));
        }
        (basic_handler())(cmd, files)
    })
}

#[tokio::test]
async fn one_big_read_file_does_not_kill_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(big_handler());
    let mut s = spec("read the minified file");
    s.context_window = 8_000;
    let (report, model) = run(
        &fake,
        s,
        vec![
            Reply::bash("make-min-js"),
            Reply::call("read_file", json!({"path": "min.js"})),
            Reply::call(
                "read_file",
                json!({"path": "min.js", "start_line": 1, "start_char": 500}),
            ),
            Reply::finish("read it"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let log = requests_of(&model);
    let tool_result = |r: &Value| {
        r["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "tool").cloned())
            .and_then(|m| m["content"].as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    let first_page = tool_result(&log[2]);
    assert!(first_page.len() < 1_500, "{}", first_page.len());
    assert!(
        first_page.contains("start_line=1, start_char=500"),
        "{first_page}"
    );
    let second_page = tool_result(&log[3]);
    assert!(
        second_page.len() < 11_000 && second_page.len() > 5_000,
        "{}",
        second_page.len()
    );
    assert!(
        second_page.contains("start_char=9800"),
        "the next page is named"
    );
    for r in &log {
        assert!(
            r.to_string().len() < 8_000 * 4,
            "a prompt of {} chars in a window of 8000 tokens",
            r.to_string().len()
        );
    }
}

#[tokio::test]
async fn a_checkpoint_whose_prompt_cannot_fit_is_repaired_on_resume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut ck = crashed_run(dir.path(), &fake).await;
    // The state a run without observation caps left behind: one 400 KB result in the tail.
    let mut ctx = ContextManager::restore(
        context_config(&ck.spec, &opts(dir.path())),
        TokenCounter::for_model(&ck.spec.model),
        tool_wire(),
        ck.context.clone(),
    );
    ctx.push_step(
        1,
        crate::agent::llm::ToolCall {
            id: "big".into(),
            kind: "function".into(),
            function: crate::agent::llm::FunctionCall {
                name: "read_file".into(),
                arguments: r#"{"path":"min.js"}"#.into(),
            },
        },
        "read_file min.js".into(),
        "x".repeat(400_000),
        None,
        true,
    );
    assert!(ctx.prompt_tokens() > ck.spec.context_window);
    ck.context = ctx.state().clone();
    FileStore::new(dir.path()).save(&ck).expect("save");
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let log = requests_of(&model);
    assert!(!log.is_empty());
    for r in &log {
        let chars = r["messages"].to_string().len();
        assert!(
            chars < ck.spec.context_window * 4,
            "prompt of {chars} chars"
        );
    }
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    assert!(events.iter().any(|e| e["decision"] == "context_repaired"));
}

#[tokio::test]
async fn summaries_have_hysteresis_in_a_small_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(big_handler());
    let mut s = spec("print a lot");
    s.context_window = 8_000;
    s.max_steps = 25;
    let replies: Vec<Reply> = (0..30)
        .map(|i| Reply::bash(&format!("lines {}", 60 + i)))
        .collect();
    let (report, model) = run(&fake, s, replies, dir.path()).await;
    assert_eq!(report.reason, StopReason::MaxSteps, "{report:?}");
    let log = requests_of(&model);
    let kinds: Vec<bool> = log
        .iter()
        .map(|r| r["tools"].as_array().is_some_and(|t| !t.is_empty()))
        .collect();
    let summaries = kinds.iter().filter(|k| !**k).count();
    assert!(summaries <= 8, "{summaries} summaries in 25 steps");
    // …and the model does summarize: the bound above holds for a loop that never does.
    assert!(
        summaries >= 2,
        "only {summaries} summaries in 25 steps of a third of the window each"
    );
    // Between two summaries at least two model turns.
    let mut turns_since = usize::MAX;
    for is_turn in kinds {
        if is_turn {
            turns_since = turns_since.saturating_add(1);
        } else {
            assert!(turns_since >= 2, "summaries on consecutive turns");
            turns_since = 0;
        }
    }
    // After each compaction the prompt is below the trigger.
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    for e in events.iter().filter(|e| e["event"] == "compaction") {
        assert!(
            e["tokens_after"].as_u64().unwrap_or(u64::MAX) < 5_600,
            "{e}"
        );
    }
    for t in crate::agent::trace::prompt_tokens_per_call(&events) {
        assert!(t < 8_000 - 1_000, "a prompt of {t} tokens");
    }
}

#[tokio::test]
async fn reasoning_is_kept_in_history_trace_checkpoint_and_summaries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(big_handler());
    let mut s = spec("print a lot");
    s.context_window = 8_000;
    s.max_steps = 14;
    let replies: Vec<Reply> = (0..20)
        .map(|i| {
            Reply::bash(&format!("lines {}", 60 + i)).saying(&format!(
                "Plan {i}: print {} rows; left: the rows after it",
                60 + i
            ))
        })
        .collect();
    let (report, model) = run(&fake, s, replies, dir.path()).await;
    assert_eq!(report.reason, StopReason::MaxSteps, "{report:?}");
    let log = requests_of(&model);
    // In the next prompt, as the assistant's content beside its call.
    let second = &log[1]["messages"];
    assert!(
        second
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "assistant"
                && m["content"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("Plan 0: print 60 rows")))),
        "{second}"
    );
    // In the trace and the checkpoint.
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    assert!(events.iter().any(|e| e["event"] == "step"
        && e["reasoning"] == "Plan 3: print 63 rows; left: the rows after it"));
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    let held: Vec<&str> = ck
        .context
        .first
        .iter()
        .chain(ck.context.working.iter())
        .map(|e| e.reasoning.as_str())
        .collect();
    assert!(held.iter().all(|r| r.starts_with("Plan ")), "{held:?}");
    // Summaries are made from the reasoning and the results of the folded steps, not stubs.
    let summary_requests: Vec<String> = log
        .iter()
        .filter(|r| r["tools"].as_array().is_none_or(|t| t.is_empty()))
        .map(|r| r["messages"].to_string())
        .collect();
    assert!(!summary_requests.is_empty(), "a compaction happened");
    let first = &summary_requests[0];
    assert!(
        first.contains("reasoning: Plan 1: print 61 rows"),
        "{first}"
    );
    assert!(
        first.contains("MARKER-61"),
        "the end of a folded result reaches the summary: {first}"
    );
    assert!(first.contains("latest stated plan"), "{first}");
}

fn poll_replies(polls: usize) -> Vec<Reply> {
    let mut replies = vec![Reply::call(
        "bash",
        json!({"command": "build-job", "background": true}),
    )];
    replies.extend((0..polls).map(|_| Reply::bash("cat status")));
    replies.push(Reply::finish("the job finished"));
    replies
}

#[tokio::test]
async fn polling_a_running_background_job_is_progress() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(Arc::new(
        |cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
            if cmd == "cat status" {
                return (0, "waiting\n".into());
            }
            (basic_handler())(cmd, files)
        },
    ));
    // Running through 6 probes, then it has ended.
    fake.background_runs_for(6);
    let (report, _) = run(&fake, spec("wait for the job"), poll_replies(8), dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.steps, 10);
}

#[tokio::test]
async fn the_model_is_warned_one_step_before_a_no_progress_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let (report, model) = run(
        &fake,
        spec("x"),
        vec![Reply::bash("cat missing"); 20],
        dir.path(),
    )
    .await;
    assert_eq!(report.reason, StopReason::NoProgress);
    assert_eq!(report.steps, 4);
    let log = requests_of(&model);
    assert!(
        !log[2].to_string().contains("NO-PROGRESS WARNING"),
        "not before it is due"
    );
    assert!(
        log[3].to_string().contains("NO-PROGRESS WARNING"),
        "{}",
        log[3]
    );

    // An explicit wait makes a poll slower to call stuck; the thresholds are options.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut o = opts(dir.path());
    o.detector.repeat_waiting = 6;
    let model = llm(vec![Reply::bash("sleep 1; cat missing"); 20]);
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run starts");
    assert_eq!(report.reason, StopReason::NoProgress);
    assert_eq!(report.steps, 6);
}

#[tokio::test]
async fn command_timeouts_never_disable_the_bash_tool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(Arc::new(
        |cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
            if cmd.starts_with("slow") {
                return (crate::agent::sandbox::FAKE_TIMED_OUT, String::new());
            }
            (basic_handler())(cmd, files)
        },
    ));
    let mut replies: Vec<Reply> = (0..6).map(|i| Reply::bash(&format!("slow {i}"))).collect();
    replies.push(Reply::bash("echo hi >> log"));
    replies.push(Reply::finish("ok"));
    let (report, model) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(log_file(&fake, &report), "hi\n");
    assert!(!requests_of(&model)
        .iter()
        .any(|r| r.to_string().contains("NOT RUN")));
}

#[tokio::test]
async fn a_long_model_outage_is_waited_out_with_retry_after_and_a_breaker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let busy = Reply::Status {
        code: 503,
        body: "overloaded".into(),
        retry_after: None,
    };
    let mut replies = vec![busy; 12];
    // A Retry-After longer than the backoff's cap is honoured.
    replies.push(Reply::Status {
        code: 429,
        body: "slow down".into(),
        retry_after: Some(1),
    });
    replies.push(Reply::finish("ok"));
    let (report, _) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    let delays: Vec<u64> = events
        .iter()
        .filter(|e| e["event"] == "retry")
        .filter_map(|e| e["delay_ms"].as_u64())
        .collect();
    assert!(delays.len() >= 13, "{delays:?}");
    assert!(
        delays.contains(&1_000),
        "Retry-After: 1 honoured: {delays:?}"
    );
    assert!(
        events.iter().any(|e| e["decision"] == "llm_breaker_open"),
        "the endpoint's breaker opened"
    );
}

#[tokio::test]
async fn an_outage_longer_than_the_patience_stops_resumably() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut o = opts(dir.path());
    o.llm_backoff.patience = Some(Duration::from_millis(200));
    let model = Arc::new(ScriptedLlm::new(
        Script::from_fn(|_| Reply::Status {
            code: 502,
            body: "bad gateway".into(),
            retry_after: None,
        }),
        "gpt-4o",
    ));
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run starts");
    assert_eq!(report.reason, StopReason::FatalError, "{report:?}");
    assert!(report.resumable);
    assert!(
        report
            .error
            .as_deref()
            .is_some_and(|e| e.contains("kept failing for") || e.contains("has been failing")),
        "{report:?}"
    );
}

#[tokio::test]
async fn a_stopped_run_continues_with_new_budgets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut s = spec("append");
    s.max_steps = 2;
    let (report, _) = run(
        &fake,
        s,
        vec![Reply::bash("echo a >> log"), Reply::bash("echo b >> log")],
        dir.path(),
    )
    .await;
    assert_eq!(report.reason, StopReason::MaxSteps);
    // Without new budgets it is reported as it ended.
    let model = llm(vec![Reply::bash("echo c >> log"), Reply::finish("abc")]);
    let m = model.clone();
    let again = resume(
        fake.clone(),
        move |_| Ok(m as Arc<dyn LlmProvider>),
        "r1",
        opts(dir.path()),
    )
    .await
    .expect("report");
    assert_eq!(again.reason, StopReason::MaxSteps);
    assert!(requests_of(&model).is_empty());
    // With them it goes on in the same sandbox.
    let mut o = opts(dir.path());
    o.new_budgets.max_steps = Some(10);
    let m = model.clone();
    let resumed = resume(
        fake.clone(),
        move |_| Ok(m as Arc<dyn LlmProvider>),
        "r1",
        o,
    )
    .await
    .expect("resume");
    assert_eq!(resumed.status, RunStatus::Done, "{resumed:?}");
    assert_eq!(resumed.steps, 4);
    assert_eq!(resumed.sandbox_id, report.sandbox_id);
    assert_eq!(log_file(&fake, &resumed), "a\nb\nc\n");
}

#[tokio::test]
async fn sandboxes_of_ended_runs_are_removed_after_their_keep_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut o = opts(dir.path());
    o.keep_sandbox = Some(Duration::ZERO);
    let model = llm(vec![Reply::bash("echo a >> log"), Reply::finish("a")]);
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run");
    assert_eq!(report.status, RunStatus::Done);
    // A run kept for a day is left alone.
    let mut o = opts(dir.path());
    o.keep_sandbox = Some(Duration::from_secs(86_400));
    let model = llm(vec![Reply::finish("b")]);
    let kept = start(fake.clone(), model, spec("y"), Some("r2".into()), o)
        .await
        .expect("run");
    let removed = reap_finished_sandboxes(&fake, dir.path()).await;
    assert_eq!(removed, vec![("r1".to_owned(), report.sandbox_id.clone())]);
    assert!(fake.get(&report.sandbox_id).await.is_err(), "removed");
    assert!(fake.get(&kept.sandbox_id).await.is_ok(), "kept");
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert!(ck.sandbox_removed);
    assert!(
        reap_finished_sandboxes(&fake, dir.path()).await.is_empty(),
        "once"
    );
}

#[tokio::test]
async fn progress_lines_tell_each_step_and_the_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let lines = Arc::new(std::sync::Mutex::new(Vec::<Progress>::new()));
    let sink = lines.clone();
    let mut o = opts(dir.path());
    o.progress = Some(ProgressSink(Arc::new(move |p: &Progress| {
        if let Ok(mut l) = sink.lock() {
            l.push(p.clone());
        }
    })));
    let model = llm(vec![
        Reply::bash("echo a >> log"),
        Reply::bash("exit 3"),
        Reply::finish("a"),
    ]);
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run");
    assert_eq!(report.status, RunStatus::Done);
    let got: Vec<(u64, String)> = lines
        .lock()
        .map(|l| l.iter().map(|p| (p.step, p.line.clone())).collect())
        .unwrap_or_default();
    assert_eq!(
        got,
        vec![
            (1, "bash `echo a >> log` -> ok".to_owned()),
            (2, "bash `exit 3` -> exit code 3".to_owned()),
            (3, "done (finished)".to_owned()),
        ]
    );
    assert!(lines
        .lock()
        .map(|l| l[1].tokens > 0 && l[1].max_steps == 30)
        .unwrap_or(false));
}

#[tokio::test]
async fn a_stated_plan_to_wait_makes_repeated_checks_polls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut o = opts(dir.path());
    o.detector.repeat_waiting = 7;
    let model = llm(vec![
        Reply::bash("cat missing").saying(
            "The job is still running, I will poll until it is done."
        );
        20
    ]);
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run starts");
    assert_eq!(report.reason, StopReason::NoProgress);
    assert_eq!(report.steps, 7, "the waiting threshold, not the plain one");
}

// ---- against the daemon's own answers (issue 22) --------------------------------------------

#[tokio::test]
async fn a_prompt_the_endpoint_calls_too_long_shrinks_the_window_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(big_handler());
    // The run believes in 16k tokens; the endpoint takes 3k (its count, 4 characters a token).
    let replies: Vec<Reply> = (0..8)
        .map(|i| Reply::bash(&format!("lines {}", 150 + i)))
        .chain([Reply::finish("done")])
        .collect();
    let model = Arc::new(ScriptedLlm::new(
        Script::sequence(replies).with_context_limit(3_000),
        "gpt-4o",
    ));
    let report = start(
        fake.clone(),
        model.clone(),
        spec("print"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run starts");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let events = crate::agent::trace::read(&dir.path().join("runs/r1/trace.jsonl")).expect("trace");
    let shrunk = events
        .iter()
        .filter(|e| e["decision"] == "window_shrunk")
        .count();
    assert!(
        shrunk >= 1,
        "the endpoint refused a prompt and the window shrank"
    );
    // Once shrunk, no prompt above the endpoint's limit is sent again.
    let log = requests_of(&model);
    let last_refused = log
        .iter()
        .rposition(|q| (q["messages"].to_string().len() + q["tools"].to_string().len()) / 4 > 3_000)
        .expect("at least one prompt was refused");
    assert!(
        last_refused < log.len() - 1,
        "the run went on after the refusals"
    );
}

#[tokio::test]
async fn a_lost_exec_after_a_failed_step_snapshot_is_not_rolled_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    fake.lose_exec_keyed("r1:3:act:0");
    // Step 1's snapshot works; step 2's fails (the daemon restarting); step 3's exec is lost.
    let replies = vec![
        Reply::bash("echo one >> log"),
        Reply::bash("echo two >> log"),
        Reply::bash("echo three >> log"),
        Reply::finish("ok"),
    ];
    let model = llm(replies);
    // Base and step 1 snapshots are taken; the one after step 2 is refused.
    fake.refuse_snapshots_after(2, 1);
    let report = start(
        fake.clone(),
        model.clone(),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run starts");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    // Step 2 is not erased by a rollback to step 1's snapshot, and step 3 ran once.
    assert_eq!(log_file(&fake, &report), "one\ntwo\nthree\n");
    let log = requests_of(&model);
    let warned = log[2].to_string();
    assert!(
        warned.contains("the snapshot after this step failed"),
        "{warned}"
    );
    let lost = log[3].to_string();
    assert!(
        lost.contains("NOT run again and nothing was rolled back"),
        "{lost}"
    );
}

#[tokio::test]
async fn str_replace_reads_past_the_daemon_cap_and_keeps_every_byte() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(Arc::new(
        |cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
            if cmd == "make" {
                let mut big = b"MARK=1 caf\xe9\n".to_vec();
                big.resize(9 << 20, b'a');
                files.insert("/workspace/big".into(), big);
            }
            (0, String::new())
        },
    ));
    let replies = vec![
        Reply::bash("make"),
        Reply::call(
            "str_replace",
            json!({"path": "big", "old_str": "MARK=1", "new_str": "MARK=2"}),
        ),
        Reply::finish("ok"),
    ];
    let (report, _) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let big = fake
        .file(&report.sandbox_id, "/workspace/big")
        .unwrap_or_default();
    assert_eq!(big.len(), 9 << 20, "the whole file, not the first 4 MiB");
    assert!(big.starts_with(b"MARK=2 caf\xe9\naaa"));
}

#[tokio::test]
async fn a_snapshot_whose_reply_was_lost_is_found_not_taken_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    // The model's snapshot is made but its reply is lost once.
    fake.lose_snapshot_replies_named("mine", 1);
    let replies = vec![
        Reply::call("snapshot", json!({"name": "mine"})),
        Reply::finish("ok"),
    ];
    let (report, model) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let snaps = fake.list_snapshots(&report.sandbox_id).await.expect("list");
    let mine: Vec<_> = snaps
        .iter()
        .filter(|s| s.name.starts_with("mine"))
        .collect();
    assert_eq!(mine.len(), 1, "{snaps:?}");
    let told = requests_of(&model)[1].to_string();
    assert!(told.contains(&mine[0].snapshot_id), "{told}");
}

#[tokio::test]
async fn a_missing_file_and_a_cap_are_answers_a_missing_sandbox_is_fatal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let background = || Reply::call("bash", json!({"command": "sleep 60", "background": true}));
    let mut replies = vec![Reply::call("read_file", json!({"path": "missing.txt"}))];
    fake.background_runs_for(1_000);
    replies.extend((0..crate::agent::sandbox::FAKE_MAX_BACKGROUND + 1).map(|_| background()));
    replies.push(Reply::finish("ok"));
    let mut s = spec("x");
    s.max_steps = 60;
    let mut o = opts(dir.path());
    o.detector.repeat = 100;
    o.detector.repeat_waiting = 100;
    o.detector.alternations = 100;
    let model = llm(replies);
    let report = start(fake.clone(), model.clone(), s, Some("r1".into()), o)
        .await
        .expect("run starts");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let log = requests_of(&model);
    assert!(log[1]
        .to_string()
        .contains("NOT_FOUND: no such file in sandbox: /workspace/missing.txt"));
    let capped = log[crate::agent::sandbox::FAKE_MAX_BACKGROUND + 2].to_string();
    assert!(
        capped.contains("RESOURCE_EXHAUSTED") && capped.contains("not an outage"),
        "{capped}"
    );

    // The sandbox itself gone: fatal, whatever the call.
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(Arc::new(
        |_: &str, _: &mut crate::agent::sandbox::FakeFiles| (0, String::new()),
    ));
    let gone = fake.clone();
    let model = Arc::new(ScriptedLlm::new(
        Script::from_fn(move |t: &crate::agent::fixture::Turn| {
            if t.index == 1 {
                gone.destroy_all();
            }
            Reply::call("read_file", json!({"path": "a.txt"}))
        }),
        "gpt-4o",
    ));
    let report = start(
        fake.clone(),
        model,
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run starts");
    assert_eq!(report.reason, StopReason::FatalError, "{report:?}");
    assert!(report.error.unwrap_or_default().contains("is gone"));
}

// ---- the operator's hand: steer and stop ------------------------------------------------

fn steer_cmd(text: &str) -> crate::agent::inbox::Command {
    crate::agent::inbox::Command::Steer {
        message: text.into(),
    }
}

fn stop_cmd(done: bool, reason: &str) -> crate::agent::inbox::Command {
    crate::agent::inbox::Command::Stop {
        status: if done {
            crate::agent::inbox::StopAs::Done
        } else {
            crate::agent::inbox::StopAs::Failed
        },
        reason: Some(reason.into()),
    }
}

/// A model that, while answering turn `at`, has the operator send `commands` to run r1 (as
/// `sbx agent steer`/`stop` from another process would), then plays `replies`.
fn model_with_operator(
    dir: &std::path::Path,
    at: usize,
    commands: Vec<crate::agent::inbox::Command>,
    replies: Vec<Reply>,
) -> Arc<ScriptedLlm> {
    let store = FileStore::new(dir);
    Arc::new(ScriptedLlm::new(
        Script::from_fn(move |t| {
            if t.index == at {
                for c in &commands {
                    crate::agent::inbox::send(&store, "r1", c.clone()).expect("send");
                }
            }
            replies
                .get(t.index)
                .cloned()
                .unwrap_or_else(|| Reply::finish("script exhausted"))
        }),
        "gpt-4o",
    ))
}

fn trace_of(dir: &std::path::Path) -> Vec<Value> {
    crate::agent::trace::read(&dir.join("runs/r1/trace.jsonl")).expect("trace")
}

fn inbox_left(dir: &std::path::Path) -> Vec<String> {
    crate::agent::inbox::Inbox::of(&FileStore::new(dir).run_dir("r1"))
        .pending()
        .expect("inbox")
}

#[tokio::test]
async fn a_steer_reaches_the_next_prompt_and_is_kept_once_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let model = model_with_operator(
        dir.path(),
        1,
        vec![steer_cmd("STEER-1: write to out.txt, not log")],
        vec![
            Reply::bash("echo one >> log"),
            Reply::bash("echo two >> log"),
            Reply::bash("echo three > out.txt"),
            Reply::finish("done"),
        ],
    );
    let report = start(
        fake.clone(),
        model.clone(),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let requests = requests_of(&model);
    // Sent during turn 1: not in it, pinned last in turn 2, in the history (before step 3's
    // call, the one that answered it) in turn 3.
    assert!(!requests[1].to_string().contains("STEER-1"));
    let last = requests[2]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["role"], "user");
    assert!(
        last["content"]
            .as_str()
            .is_some_and(|c| c.contains("[operator:") && c.contains("STEER-1")),
        "{last}"
    );
    let messages = requests[3]["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let at = messages
        .iter()
        .position(|m| m["content"].as_str().is_some_and(|c| c.contains("STEER-1")))
        .expect("kept in the history");
    assert_eq!(
        requests[3].to_string().matches("STEER-1").count(),
        1,
        "once, not pinned any more"
    );
    assert_eq!(
        messages[at + 1]["tool_calls"][0]["function"]["arguments"],
        r#"{"command":"echo three > out.txt"}"#
    );
    // Recorded in the checkpoint (with the step that answered it) and the trace; the inbox
    // is empty.
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert_eq!(ck.operator.len(), 1);
    assert_eq!(ck.operator[0].kind, "steer");
    // Taken at the boundary before step 2's action (one step done), answered by step 3.
    assert_eq!(ck.operator[0].step, 1);
    assert_eq!(ck.operator[0].acked_step, Some(3));
    assert!(ck.context.steers.is_empty());
    let events = trace_of(dir.path());
    assert!(events.iter().any(|e| e["event"] == "operator"
        && e["decision"] == "steer"
        && e["message"] == "STEER-1: write to out.txt, not log"));
    assert!(events.iter().any(|e| e["event"] == "operator"
        && e["decision"] == "acknowledged"
        && e["acked_step"] == 3));
    assert!(inbox_left(dir.path()).is_empty());
}

#[tokio::test]
async fn a_steer_stays_pinned_through_re_asks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let model = model_with_operator(
        dir.path(),
        0,
        vec![steer_cmd("STEER-2: be brief")],
        vec![
            Reply::bash("echo one >> log"),
            Reply::Text("I am thinking".into()),
            Reply::bash("echo two >> log"),
            Reply::finish("done"),
        ],
    );
    let report = start(
        fake.clone(),
        model.clone(),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let requests = requests_of(&model);
    let pinned_last = |r: &Value| {
        r["messages"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["content"].as_str())
            .is_some_and(|c| c.contains("STEER-2"))
    };
    assert!(pinned_last(&requests[1]), "pinned");
    assert!(
        pinned_last(&requests[2]),
        "a prose answer did not acknowledge it"
    );
    assert!(!pinned_last(&requests[3]), "the call of step 2 did");
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert_eq!(ck.operator[0].acked_step, Some(2));
}

#[tokio::test]
async fn stop_done_ends_the_run_at_the_next_boundary_with_a_salvage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let model = model_with_operator(
        dir.path(),
        1,
        vec![
            stop_cmd(true, "good enough"),
            // Sent after the stop: never applied, said in the trace.
            steer_cmd("too late"),
        ],
        vec![
            Reply::bash("echo one >> log"),
            Reply::bash("echo two >> log"),
            Reply::bash("echo three >> log"),
        ],
    );
    let report = start(
        fake.clone(),
        model.clone(),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.reason, StopReason::OperatorDone);
    assert!(!report.resumable);
    // The stop arrived while the model chose step 2: that action is not sent, and no model
    // turn follows.
    assert_eq!(report.steps, 1);
    assert_eq!(requests_of(&model).len(), 2);
    assert_eq!(log_file(&fake, &report), "one\n");
    assert_eq!(
        fake.execs()
            .iter()
            .filter(|e| e.idempotency_key.contains(":act:"))
            .count(),
        1
    );
    // The salvage of any end: final snapshot, diff, summary naming the operator's reason.
    assert!(report.final_snapshot_id.is_some(), "{report:?}");
    assert!(
        report
            .summary
            .contains("stopped by the operator: good enough"),
        "{}",
        report.summary
    );
    assert!(report.error.is_none(), "{report:?}");
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert_eq!(
        ck.outcome.as_ref().map(|o| o.reason),
        Some(StopReason::OperatorDone)
    );
    assert_eq!(ck.state, LoopState::Done);
    assert_eq!(ck.operator.len(), 1, "{:?}", ck.operator);
    assert_eq!(ck.operator[0].kind, "stop");
    let events = trace_of(dir.path());
    assert!(events.iter().any(|e| e["event"] == "transition"
        && e["from"] == "ACTING"
        && e["to"] == "DONE"
        && e["why"] == "operator stop"));
    assert!(events
        .iter()
        .any(|e| e["event"] == "decision" && e["reason"] == "operator_done"));
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "operator" && e["decision"] == "dropped"),
        "the steer after the stop"
    );
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "operator" && e["decision"] == "pending_abandoned"),
        "step 2's call, never sent"
    );
    assert!(inbox_left(dir.path()).is_empty());
}

#[tokio::test]
async fn a_stop_ends_a_retry_wait_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let model = model_with_operator(
        dir.path(),
        1,
        vec![stop_cmd(false, "the endpoint is down for the day")],
        vec![
            Reply::bash("echo one >> log"),
            Reply::Status {
                code: 503,
                body: "overloaded".into(),
                retry_after: None,
            },
        ],
    );
    let mut o = opts(dir.path());
    // A long wait: the stop must not sit it out.
    o.llm_backoff = Backoff {
        base: Duration::from_secs(60),
        cap: Duration::from_secs(60),
        max_attempts: u32::MAX,
        patience: Some(Duration::from_secs(600)),
    };
    let started = Instant::now();
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(report.status, RunStatus::Failed, "{report:?}");
    assert_eq!(report.reason, StopReason::OperatorFailed);
    assert!(!report.resumable);
    let events = trace_of(dir.path());
    assert!(events
        .iter()
        .any(|e| e["event"] == "transition" && e["from"] == "RETRYING" && e["to"] == "FAILED"));
}

/// Run r1 left as a crash leaves it (step 1 done, step 2 pending), with a steer in its inbox.
async fn crashed_run_with_a_steer(dir: &std::path::Path, fake: &FakeSandbox) -> String {
    crashed_run(dir, fake).await;
    crate::agent::inbox::send(
        &FileStore::new(dir),
        "r1",
        steer_cmd("STEER-3: check the log"),
    )
    .expect("send")
    .id
}

#[tokio::test]
async fn a_steer_sent_while_the_run_is_down_is_applied_on_resume_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    crashed_run_with_a_steer(dir.path(), &fake).await;
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let first = requests_of(&model)[0].to_string();
    assert_eq!(first.matches("STEER-3").count(), 1, "{first}");
    assert!(inbox_left(dir.path()).is_empty());
}

#[tokio::test]
async fn a_crash_after_the_checkpoint_took_a_request_does_not_apply_it_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let id = crashed_run_with_a_steer(dir.path(), &fake).await;
    // The crash came after the checkpoint took the steer and before its file was removed.
    let store = FileStore::new(dir.path());
    let mut ck = store.load("r1").expect("load");
    ck.context.steers.push(crate::agent::context::Steer {
        id: id.clone(),
        text: "STEER-3: check the log".into(),
        at_step: 1,
        acked_step: None,
    });
    ck.operator.push(crate::agent::inbox::OperatorRecord {
        id: id.clone(),
        kind: "steer".into(),
        step: 1,
        sent_at_ms: 0,
        applied_at_ms: 0,
        text: "STEER-3: check the log".into(),
        acked_step: None,
    });
    store.save(&ck).expect("save");
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let first = requests_of(&model)[0].to_string();
    assert_eq!(first.matches("STEER-3").count(), 1, "{first}");
    let ck = store.load("r1").expect("load");
    assert_eq!(ck.operator.iter().filter(|r| r.id == id).count(), 1);
    assert!(trace_of(dir.path())
        .iter()
        .any(|e| e["decision"] == "already_applied"));
    assert!(inbox_left(dir.path()).is_empty());
}

#[tokio::test]
async fn a_stop_taken_before_a_crash_still_ends_the_run_on_resume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    crashed_run(dir.path(), &fake).await;
    // The boundary took the stop (durable) and the process died before the salvage.
    let store = FileStore::new(dir.path());
    let mut ck = store.load("r1").expect("load");
    ck.pending = None;
    ck.state = LoopState::Thinking;
    ck.stop_requested = Some(crate::agent::inbox::StopRequest {
        id: "op-1".into(),
        reason: StopReason::OperatorFailed,
        detail: "stopped by the operator: wrong task".into(),
    });
    store.save(&ck).expect("save");
    let (report, model) = resume_to_end(dir.path(), &fake).await;
    assert_eq!(report.reason, StopReason::OperatorFailed, "{report:?}");
    assert_eq!(report.steps, 1);
    assert!(
        requests_of(&model).is_empty(),
        "no model turn after the stop"
    );
    assert!(report.summary.contains("wrong task"), "{}", report.summary);
}

#[tokio::test]
async fn a_finish_called_while_a_steer_arrived_is_held_until_the_model_saw_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let model = model_with_operator(
        dir.path(),
        1,
        vec![steer_cmd("STEER-4: also write out.txt")],
        vec![
            Reply::bash("echo one >> log"),
            Reply::finish("early"),
            Reply::bash("echo x > out.txt"),
            Reply::finish("with out.txt"),
        ],
    );
    let report = start(
        fake.clone(),
        model.clone(),
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.answer.as_deref(), Some("with out.txt"));
    let requests = requests_of(&model);
    let third = requests[2].to_string();
    assert!(third.contains("finish NOT accepted yet"), "{third}");
    let last = requests[2]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert!(last.to_string().contains("STEER-4"), "{last}");
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert_eq!(ck.rejected_finishes, 0, "a held finish is no rejection");
    assert_eq!(ck.operator[0].acked_step, Some(3));
    assert!(trace_of(dir.path())
        .iter()
        .any(|e| e["decision"] == "finish_held"));
}

#[tokio::test]
async fn a_bad_inbox_file_is_rejected_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let inbox_dir = dir.path().join("runs/r1/inbox");
    let bad = inbox_dir.clone();
    let model = Arc::new(ScriptedLlm::new(
        Script::from_fn(move |t| {
            if t.index == 0 {
                std::fs::create_dir_all(&bad).expect("inbox");
                std::fs::write(bad.join("x1.json"), b"{\"kind\":\"stop\"").expect("write");
                std::fs::write(
                    bad.join("x2.json"),
                    br#"{"id":"x2","sent_at_ms":1,"kind":"launch_missiles"}"#,
                )
                .expect("write");
            }
            [
                Reply::bash("echo one >> log"),
                Reply::bash("echo two >> log"),
            ]
            .get(t.index)
            .cloned()
            .unwrap_or_else(|| Reply::finish("done"))
        }),
        "gpt-4o",
    ));
    let report = start(
        fake.clone(),
        model,
        spec("x"),
        Some("r1".into()),
        opts(dir.path()),
    )
    .await
    .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert_eq!(report.steps, 3);
    let rejected: Vec<String> = trace_of(dir.path())
        .iter()
        .filter(|e| e["event"] == "operator" && e["decision"] == "rejected")
        .filter_map(|e| e["file"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(rejected, ["x1.json", "x2.json"]);
    assert_eq!(std::fs::read_dir(&inbox_dir).expect("inbox").count(), 0);
    assert!(FileStore::new(dir.path())
        .load("r1")
        .expect("ck")
        .operator
        .is_empty());
}

#[tokio::test]
async fn a_pin_with_a_huge_key_is_refused_and_never_reaches_a_prompt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    // Many distinct words: thousands of tokens, more than the pins' share of the window.
    let key: String = (0..3_000).map(|i| format!("fact{i} ")).collect();
    let (report, model) = run(
        &fake,
        spec("remember things"),
        vec![
            Reply::call("pin", json!({"key": key, "value": "v"})),
            Reply::call("pin", json!({"key": key})),
            Reply::call("pin", json!({"key": "short", "value": "kept"})),
            Reply::finish("done"),
        ],
        dir.path(),
    )
    .await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let ck = FileStore::new(dir.path()).load("r1").expect("checkpoint");
    assert!(
        !ck.context.pinned.contains_key(&key),
        "the huge key was pinned"
    );
    assert_eq!(
        ck.context.pinned.get("short").map(String::as_str),
        Some("kept")
    );
    let requests = requests_of(&model);
    assert_eq!(requests.len(), 4);
    let told = requests[1].to_string();
    assert!(
        told.contains("pin REFUSED: the key is"),
        "the model is told why: {told:.300}"
    );
    // Neither the pin, its refusal, the unpin nor the action lines carry the key along.
    let long_piece = &key[..600];
    for (i, r) in requests.iter().enumerate().skip(1) {
        assert!(
            !r.to_string().contains(long_piece),
            "request {i} carries the huge key"
        );
    }
}

/// Directory fsyncs under `dir` done on the calling thread (the test's current-thread
/// runtime, as `sbx`'s), from the `from`th on.
fn syncs_on_this_thread(dir: &std::path::Path, from: usize) -> Vec<std::path::PathBuf> {
    let here = std::thread::current().id();
    crate::agent::checkpoint::tests::dir_syncs_under(dir)[from..]
        .iter()
        .filter(|(_, t)| *t == here)
        .map(|(p, _)| p.clone())
        .collect()
}

#[tokio::test]
async fn checkpoint_writes_never_block_the_runtime_thread() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let mut o = opts(dir.path());
    o.keep_sandbox = Some(Duration::ZERO);
    let model = llm(vec![Reply::bash("echo a >> log"), Reply::finish("a")]);
    let report = start(fake.clone(), model, spec("x"), Some("r1".into()), o)
        .await
        .expect("run");
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    assert!(report.diff_path.is_some(), "final.diff written");
    let all = crate::agent::checkpoint::tests::dir_syncs_under(dir.path());
    assert!(all.len() > 3, "{all:?}");
    // The run: its directory, checkpoints, final diff.
    assert_eq!(syncs_on_this_thread(dir.path(), 0), Vec::<PathBuf>::new());
    // The sweep that marks a removed sandbox in the checkpoint.
    let from = all.len();
    assert_eq!(reap_finished_sandboxes(&fake, dir.path()).await.len(), 1);
    assert_eq!(
        syncs_on_this_thread(dir.path(), from),
        Vec::<PathBuf>::new()
    );
    // The removal of an unused sandbox (a run that ended before its first step).
    let sb = fake.create(Default::default()).await.expect("create");
    let mut ck = crate::agent::checkpoint::tests::sample("r2");
    ck.step = 0;
    ck.sandbox_id = sb.id.clone();
    ck.outcome = FileStore::new(dir.path())
        .load("r1")
        .expect("checkpoint")
        .outcome;
    FileStore::new(dir.path()).save(&ck).expect("save");
    let from = crate::agent::checkpoint::tests::dir_syncs_under(dir.path()).len();
    let removed = remove_unused_sandbox(&fake, dir.path(), "r2")
        .await
        .expect("remove");
    assert_eq!(removed, Some(sb.id));
    assert_eq!(
        syncs_on_this_thread(dir.path(), from),
        Vec::<PathBuf>::new()
    );
}

#[tokio::test]
async fn str_replace_keeps_the_file_mode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = FakeSandbox::new(basic_handler());
    let replies = vec![
        Reply::call(
            "write_file",
            json!({"path": "run.sh", "content": "#!/bin/sh\necho old\n"}),
        ),
        Reply::bash("chmod 750 run.sh"),
        Reply::call(
            "str_replace",
            json!({"path": "run.sh", "old_str": "old", "new_str": "new"}),
        ),
        Reply::finish("ok"),
    ];
    let (report, model) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let told = requests_of(&model)[3].to_string();
    assert!(told.contains("replaced 1 occurrence"), "{told}");
    assert_eq!(
        fake.file(&report.sandbox_id, "/workspace/run.sh"),
        Some(b"#!/bin/sh\necho new\n".to_vec())
    );
    assert_eq!(
        fake.mode(&report.sandbox_id, "/workspace/run.sh"),
        Some(0o750)
    );
}

#[tokio::test]
async fn str_replace_is_not_made_when_the_mode_cannot_be_learned() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A sandbox without a working stat.
    let fake = FakeSandbox::new(Arc::new(
        |cmd: &str, files: &mut crate::agent::sandbox::FakeFiles| {
            if cmd == "make" {
                files.insert("/workspace/a.txt".into(), b"x = 1\n".to_vec());
            }
            (0, String::new())
        },
    ));
    fake.break_stat();
    let replies = vec![
        Reply::bash("make"),
        Reply::call(
            "str_replace",
            json!({"path": "a.txt", "old_str": "x = 1", "new_str": "x = 2"}),
        ),
        Reply::finish("ok"),
    ];
    let (report, model) = run(&fake, spec("x"), replies, dir.path()).await;
    assert_eq!(report.status, RunStatus::Done, "{report:?}");
    let told = requests_of(&model)[2].to_string();
    assert!(
        told.contains(
            "str_replace in /workspace/a.txt NOT done: its permissions could not be learned"
        ),
        "{told}"
    );
    assert_eq!(
        fake.file(&report.sandbox_id, "/workspace/a.txt"),
        Some(b"x = 1\n".to_vec()),
        "unchanged"
    );
}
