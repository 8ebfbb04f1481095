//! The loop against the in-memory sandbox and the in-process scripted model: every resume path,
//! stops, repairs and re-asks, without a daemon.

use std::sync::Arc;

use serde_json::json;

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
    };
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
    fake.write_file(&ck.sandbox_id, "/workspace/log", b"one\ntw".to_vec())
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
