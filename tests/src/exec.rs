//! Running commands in a sandbox and checking what they did, with results described in full
//! when an assertion fails.

use std::time::{Duration, Instant};

use agent_client::proto::{exec_event, ExecRequest, ExecResult, ExecStatus};
use agent_client::{exec_request, Client, ExecStream};

use crate::within;

/// Output bytes as text (invalid UTF-8 replaced).
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// How an exec ended (`Unspecified` for a value this client does not know).
pub fn status(r: &ExecResult) -> ExecStatus {
    ExecStatus::try_from(r.status).unwrap_or(ExecStatus::Unspecified)
}

/// A one-line account of a result for assertion messages (output shortened).
pub fn describe(r: &ExecResult) -> String {
    let short = |b: &[u8]| {
        let s = text(b);
        if s.len() > 400 {
            format!("{}…({} bytes)", s.chars().take(400).collect::<String>(), b.len())
        } else {
            s
        }
    };
    format!(
        "argv={:?} status={:?} exit_code={} signal={} error={:?} stdout={:?} stderr={:?} duration_ms={}",
        r.argv,
        status(r),
        r.exit_code,
        r.signal,
        r.error,
        short(&r.stdout),
        short(&r.stderr),
        r.duration_ms
    )
}

/// Asserts the command ran and exited with `code`.
pub fn assert_exited(r: &ExecResult, code: i32) {
    assert_eq!((status(r), r.exit_code), (ExecStatus::Exited, code), "{}", describe(r));
}

/// One `Exec` (bounded at 120 s); the call must succeed, whatever the command did.
pub async fn exec(client: &Client, request: ExecRequest) -> ExecResult {
    within(120, client.exec(request)).await.expect("Exec")
}

/// Runs `sh -c script` in sandbox `id` and returns the result.
pub async fn sh(client: &Client, id: &str, script: &str) -> ExecResult {
    exec(client, exec_request(id, ["sh", "-c", script])).await
}

/// Runs `sh -c script` in sandbox `id`, asserts it exited 0, and returns its stdout.
pub async fn sh_ok(client: &Client, id: &str, script: &str) -> String {
    let r = sh(client, id, script).await;
    assert_exited(&r, 0);
    text(&r.stdout)
}

/// Runs `n` execs at once over `ids` (exec `i` in sandbox `ids[i % ids.len()]`, each call within
/// 60 s): exec `i` prints `exec <i> <hostname>` on stdout, sleeps 0.2 s and prints `done` on
/// stderr. Returns each exec's number, sandbox and result, in the order they were started.
pub async fn tagged_execs_at_once(client: &Client, ids: &[String], n: usize) -> Vec<(usize, String, ExecResult)> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let client = client.clone();
        let id = ids[i % ids.len()].clone();
        tasks.push(tokio::spawn(async move {
            let script = "echo \"$0 $1 $(hostname)\"; sleep 0.2; echo done >&2";
            let r = within(60, client.exec(exec_request(&id, ["sh", "-c", script, "exec", &i.to_string()]))).await.expect("Exec");
            (i, id, r)
        }));
    }
    let mut results = Vec::with_capacity(n);
    for task in tasks {
        results.push(task.await.expect("task"));
    }
    results
}

/// What an `ExecStream` delivered, in order, and when.
#[derive(Debug, Default)]
pub struct Streamed {
    /// The output events in the order they came: `out:<text>` and `err:<text>`.
    pub events: Vec<String>,
    /// When the first stdout event came, from the `t0` given to [`read_stream`].
    pub first_stdout_at: Option<Duration>,
    /// The result that ended the stream, and when it came.
    pub result: Option<ExecResult>,
    pub result_at: Option<Duration>,
}

/// Reads an `ExecStream` to its end (each event within 30 s), asserting that nothing follows
/// its result; times are measured from `t0`, the moment the stream was asked for.
pub async fn read_stream(mut stream: ExecStream, t0: Instant) -> Streamed {
    let mut read = Streamed::default();
    while let Some(event) = within(30, stream.next_event()).await.expect("stream event") {
        assert!(read.result.is_none(), "an event came after the result: {event:?}");
        match event.event.expect("an event") {
            exec_event::Event::Stdout(b) => {
                read.first_stdout_at.get_or_insert(t0.elapsed());
                read.events.push(format!("out:{}", text(&b)));
            }
            exec_event::Event::Stderr(b) => read.events.push(format!("err:{}", text(&b))),
            exec_event::Event::Result(r) => {
                read.result_at = Some(t0.elapsed());
                read.result = Some(r);
            }
        }
    }
    read
}

/// An `ExecStream` in sandbox `id` that prints `started`, then runs until `/tmp/go` exists and
/// prints `finished`: returned once `started` was read, with the stdout read so far. What a
/// drain must let finish.
pub async fn held_exec(client: &agent_client::Client, id: &str) -> (agent_client::ExecStream, String) {
    let script = "echo started; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo finished";
    let mut stream = crate::within(30, client.exec_stream(agent_client::exec_request(id, ["sh", "-c", script]))).await.expect("ExecStream");
    let mut stdout = String::new();
    while !stdout.contains("started") {
        match crate::within(30, stream.next_event()).await.expect("stream event").and_then(|e| e.event) {
            Some(crate::proto::exec_event::Event::Stdout(b)) => stdout.push_str(&text(&b)),
            other => panic!("before `started`: {other:?}"),
        }
    }
    (stream, stdout)
}
