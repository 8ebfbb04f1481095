//! envd's `process.Process` service on exec sessions.
//!
//! An E2B process outlives the stream that started it: a client may go away and `Connect` to it
//! later by pid, another may send it input or a signal. So each process is an exec session the
//! manager runs (its stdin, terminal and signals are the daemon's), whose events a task of this
//! module reads for its whole life and hands to whoever is attached now. The pid is this
//! module's own number (per sandbox, from 1000): the exec's real pid lives in another pid
//! namespace, or another kernel, and means nothing to the client.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::connect::{self, RpcError};
use super::{Audited, Body, State};
use crate::backend::{SessionInput, TerminalSize};
use crate::error::Error;
use crate::manager::Session;
use crate::model::{ExecEvent, ExecRecord, ExecRequest, ExecStatus, OutputChunk};

/// What an attached client reads: a message, or the error that ends its stream.
type Event = Result<Value, RpcError>;

/// The first pid handed out in a sandbox.
const FIRST_PID: u32 = 1000;
/// Messages waiting for each attached client; a slow one slows the process's output.
const SUBSCRIBER_BUFFER: usize = 16;
/// Input waiting for the process (`SendInput`, `CloseStdin`, `Update`).
const INPUT_BUFFER: usize = 64;

/// The processes of every sandbox this front door started.
#[derive(Default)]
pub struct Table {
    sandboxes: Mutex<HashMap<String, Procs>>,
}

#[derive(Default)]
struct Procs {
    next_pid: u32,
    by_pid: BTreeMap<u32, Arc<Proc>>,
}

/// One process: what it runs, its input, and the clients attached to its output.
struct Proc {
    pid: u32,
    tag: Option<String>,
    /// Its `ProcessConfig`, as `List` returns it.
    config: Value,
    tty: bool,
    input: mpsc::Sender<SessionInput>,
    exec_id: Mutex<Option<String>>,
    subscribers: Mutex<Vec<mpsc::Sender<Event>>>,
}

impl Table {
    fn insert(&self, sandbox_id: &str, make: impl FnOnce(u32) -> Proc) -> Result<Arc<Proc>, Error> {
        let mut map = self.sandboxes.lock().map_err(|_| Error::Internal("process table poisoned".into()))?;
        let procs = map.entry(sandbox_id.to_string()).or_default();
        let pid = procs.next_pid.max(FIRST_PID);
        procs.next_pid = pid + 1;
        let proc = Arc::new(make(pid));
        procs.by_pid.insert(pid, proc.clone());
        Ok(proc)
    }

    fn remove(&self, sandbox_id: &str, pid: u32) {
        if let Ok(mut map) = self.sandboxes.lock() {
            if let Some(procs) = map.get_mut(sandbox_id) {
                procs.by_pid.remove(&pid);
                // No entry outlives a sandbox's last process (a sandbox the reaper destroyed
                // never passes through `forget_sandbox`).
                if procs.by_pid.is_empty() {
                    map.remove(sandbox_id);
                }
            }
        }
    }

    /// Drops a destroyed sandbox's entry (its processes' tasks end with their execs).
    pub fn forget_sandbox(&self, sandbox_id: &str) {
        if let Ok(mut map) = self.sandboxes.lock() {
            map.remove(sandbox_id);
        }
    }

    fn list(&self, sandbox_id: &str) -> Vec<Arc<Proc>> {
        self.sandboxes.lock().map(|m| m.get(sandbox_id).map(|p| p.by_pid.values().cloned().collect()).unwrap_or_default()).unwrap_or_default()
    }

    /// The process a `ProcessSelector` names.
    fn select(&self, sandbox_id: &str, selector: Option<&Value>) -> Result<Arc<Proc>, RpcError> {
        let selector = selector.ok_or_else(|| RpcError::new("invalid_argument", "process: a selector (pid or tag) is required"))?;
        let procs = self.list(sandbox_id);
        let found = if let Some(pid) = selector.get("pid").and_then(as_u32) {
            procs.into_iter().find(|p| p.pid == pid)
        } else if let Some(tag) = selector.get("tag").and_then(Value::as_str) {
            procs.into_iter().find(|p| p.tag.as_deref() == Some(tag))
        } else {
            return Err(RpcError::new("invalid_argument", "process: a selector (pid or tag) is required"));
        };
        found.ok_or_else(|| RpcError::new("not_found", format!("process {selector} not found (it ended, or was never started here)")))
    }
}

impl Proc {
    /// Hands `message` to every attached client, dropping those that are gone or that took
    /// longer than `idle` to make room for it.
    async fn broadcast(&self, message: &Event, idle: Duration) {
        let subscribers: Vec<mpsc::Sender<Event>> = self.subscribers.lock().map(|s| s.clone()).unwrap_or_default();
        let mut gone = Vec::new();
        for (i, s) in subscribers.iter().enumerate() {
            if !matches!(tokio::time::timeout(idle, s.send(message.clone())).await, Ok(Ok(()))) {
                gone.push(i);
            }
        }
        if !gone.is_empty() {
            if let Ok(mut subs) = self.subscribers.lock() {
                subs.retain(|s| !s.is_closed() && !gone.iter().any(|&i| subscribers.get(i).is_some_and(|g| g.same_channel(s))));
            }
        }
    }

    fn subscribe(&self) -> mpsc::Receiver<Event> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        if let Ok(mut subs) = self.subscribers.lock() {
            subs.push(tx);
        }
        rx
    }

    async fn send_input(&self, input: SessionInput) -> Result<(), RpcError> {
        self.input.send(input).await.map_err(|_| RpcError::new("not_found", format!("process {} has ended", self.pid)))
    }
}

fn as_u32(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// A proto3 JSON `bytes` field.
pub(super) fn decode_bytes(v: Option<&Value>) -> Result<Bytes, RpcError> {
    let s = v.and_then(Value::as_str).unwrap_or("");
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(s))
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(s))
        .map(Bytes::from)
        .map_err(|e| RpcError::new("invalid_argument", format!("input is not base64: {e}")))
}

fn encode_bytes(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// The user an envd call acts as: HTTP basic auth's user name (the SDK's `user=`), or the
/// sandbox's own user when it names none.
pub(super) fn basic_user(headers: &http::HeaderMap) -> String {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .map(|s| s.split(':').next().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// Serves one `process.Process` call.
pub async fn handle(state: &Arc<State>, method: &str, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let streaming = matches!(method, "Start" | "Connect");
    let caller = state.envd_caller(req.headers()).and_then(|(tenant, sandbox)| state.manager.get(&tenant, &sandbox).map(|i| (tenant, i)));
    let (tenant, info) = match caller {
        Ok(c) => c,
        Err(e) if streaming => return connect::stream_error(e.into()),
        Err(e) => return connect::unary_error(e.into()),
    };
    let sandbox_id = info.id.to_string();
    let result = match method {
        "Start" => return start(state, &tenant, &sandbox_id, req).await,
        "Connect" => return attach(state, &sandbox_id, req).await,
        "List" => Ok(list(state, &sandbox_id)),
        "SendInput" => send_input(state, &sandbox_id, req).await,
        "CloseStdin" => close_stdin(state, &sandbox_id, req).await,
        "Update" => update(state, &sandbox_id, req).await,
        "SendSignal" => send_signal(state, &tenant, &sandbox_id, req).await,
        "StreamInput" => Err(RpcError::unsupported("StreamInput (a client stream)", "send input with SendInput, one call per chunk")),
        other => Err(RpcError::new("unimplemented", format!("process.Process/{other} does not exist"))),
    };
    match result {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => connect::unary_error(e),
    }
}

/// `Start`: runs the command as an exec session and streams its events from the start event on.
async fn start(state: &Arc<State>, tenant: &str, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let started = Instant::now();
    let user = basic_user(req.headers());
    let trace = crate::telemetry::caller_trace(req.headers());
    let body: Value = match connect::stream_request(req).await {
        Ok(b) => b,
        Err(e) => return connect::stream_error(e),
    };
    let process = body.get("process").cloned().unwrap_or(Value::Null);
    let cmd = process.get("cmd").and_then(Value::as_str).unwrap_or("").to_string();
    let mut argv = vec![cmd.clone()];
    if let Some(args) = process.get("args").and_then(Value::as_array) {
        argv.extend(args.iter().map(|a| a.as_str().unwrap_or("").to_string()));
    }
    let env: BTreeMap<String, String> = process
        .get("envs")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string())).collect())
        .unwrap_or_default();
    let workdir = process.get("cwd").and_then(Value::as_str).unwrap_or("").to_string();
    let tty = body.get("pty").filter(|p| !p.is_null()).map(|p| {
        let size = p.get("size");
        let dim = |k: &str| size.and_then(|s| s.get(k)).and_then(as_u32).and_then(|n| u16::try_from(n).ok()).unwrap_or(0);
        TerminalSize { rows: dim("rows").max(1), cols: dim("cols").max(1) }
    });
    let tag = body.get("tag").and_then(Value::as_str).map(str::to_string);
    // envd keeps stdin open only when asked (`stdin: true`) or on a terminal.
    let keep_stdin = tty.is_some() || body.get("stdin").and_then(Value::as_bool).unwrap_or(false);
    let exec = ExecRequest { sandbox_id: sandbox_id.to_string(), argv: argv.clone(), env, workdir, user, trace: trace.clone(), ..Default::default() };
    let (input_tx, input_rx) = mpsc::channel(INPUT_BUFFER);
    let events = state.manager.exec_session(tenant, exec, Session { input: input_rx, tty });
    state.audit(Audited { rpc: "e2b.process.Start", tenant, sandbox_id, argv: Some(&argv), detail: "", trace: trace.as_ref() }, events.as_ref().err(), started);
    let mut exec_id = None;
    let mut events = match events {
        Ok(e) => e,
        Err(e) => return connect::stream_error(e.into()),
    };
    if !keep_stdin && input_tx.send(SessionInput::CloseStdin).await.is_err() {
        return connect::stream_error(RpcError::new("internal", "the session's input closed before it started"));
    }
    // A session's first event says it runs, with the exec's id (which signals need): the
    // client learns the pid only after that, so a kill right after a start finds its exec.
    let first = match events.next().await {
        Some(Ok(ExecEvent::Started(id))) => {
            exec_id = Some(id.to_string());
            None
        }
        other => other,
    };
    let config = process.clone();
    let proc = match state.processes.insert(sandbox_id, |pid| Proc {
        pid,
        tag,
        config,
        tty: tty.is_some(),
        input: input_tx,
        exec_id: Mutex::new(exec_id),
        subscribers: Mutex::new(Vec::new()),
    }) {
        Ok(p) => p,
        Err(e) => return connect::stream_error(e.into()),
    };
    let rx = proc.subscribe();
    let pid = proc.pid;
    tracing::debug!(sandbox = sandbox_id, pid, argv = ?argv, "E2B process started");
    // The process's life: its events to whoever is attached, until it ends.
    let (state2, sandbox) = (state.clone(), sandbox_id.to_string());
    let idle = state.manager.stream_idle_timeout();
    tokio::spawn(async move {
        let mut first = first;
        let end = loop {
            let next = match first.take() {
                Some(event) => Some(event),
                None => events.next().await,
            };
            match next {
                Some(Ok(ExecEvent::Started(id))) => {
                    if let Ok(mut e) = proc.exec_id.lock() {
                        *e = Some(id.to_string());
                    }
                }
                Some(Ok(ExecEvent::Output(chunk))) => proc.broadcast(&Ok(data_event(&chunk, proc.tty)), idle).await,
                Some(Ok(ExecEvent::Ended(record))) => break end_event(&record),
                Some(Err(e)) => break Err(RpcError::from(e)),
                None => break Err(RpcError::new("unavailable", "the exec's stream ended without a result")),
            }
        };
        state2.processes.remove(&sandbox, proc.pid);
        proc.broadcast(&end, idle).await;
        tracing::debug!(sandbox, pid = proc.pid, "E2B process ended");
    });
    attached_stream(pid, rx)
}

/// The stream an attached client reads: the start event with the pid, then the process's events.
fn attached_stream(pid: u32, rx: mpsc::Receiver<Event>) -> http::Response<Body> {
    let first = futures::stream::once(async move { Ok(json!({"event": {"start": {"pid": pid}}})) });
    let rest = tokio_stream::wrappers::ReceiverStream::new(rx);
    connect::stream_response(Box::pin(first.chain(rest)), Some(json!({"event": {"keepalive": {}}})))
}

fn data_event(chunk: &OutputChunk, tty: bool) -> Value {
    match (chunk, tty) {
        // A terminal has one stream: everything the process wrote to it.
        (OutputChunk::Stdout(b) | OutputChunk::Stderr(b), true) => json!({"event": {"data": {"pty": encode_bytes(b)}}}),
        (OutputChunk::Stdout(b), false) => json!({"event": {"data": {"stdout": encode_bytes(b)}}}),
        (OutputChunk::Stderr(b), false) => json!({"event": {"data": {"stderr": encode_bytes(b)}}}),
    }
}

/// envd's end event from our record: the exit code, whether the process exited by itself, and
/// a status in the words Go's `os.ProcessState` uses, which envd reports. An exec that ran past
/// its timeout ends the stream with DEADLINE_EXCEEDED instead: the SDK's timeout exception.
fn end_event(r: &ExecRecord) -> Event {
    let o = &r.outcome;
    if o.status == ExecStatus::TimedOut {
        return Err(RpcError::new(
            "deadline_exceeded",
            format!("the command ran past its exec timeout ({} ms, [limits] exec_timeout_ms) and was killed", o.duration.as_millis()),
        ));
    }
    let (exited, status) = match o.status {
        ExecStatus::Exited => (true, format!("exit status {}", o.exit_code)),
        ExecStatus::Signaled => (false, format!("signal: {}", signal_name(o.signal))),
        ExecStatus::TimedOut => (false, "signal: killed (the exec timeout passed)".to_string()),
        ExecStatus::OomKilled => (false, "signal: killed (out of memory)".to_string()),
        ExecStatus::SpawnFailed => (false, "failed to start".to_string()),
        ExecStatus::Lost => (false, "lost".to_string()),
        ExecStatus::Running => (false, "running".to_string()),
    };
    let mut end = json!({"exitCode": o.exit_code, "exited": exited, "status": status});
    let error = match o.status {
        ExecStatus::Exited => String::new(),
        _ if !o.error.is_empty() => o.error.clone(),
        _ => status.clone(),
    };
    if !error.is_empty() {
        end["error"] = Value::String(error);
    }
    Ok(json!({"event": {"end": end}}))
}

fn signal_name(signal: i32) -> String {
    match signal {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        1 => "hangup".into(),
        n => format!("signal {n}"),
    }
}

/// `Connect`: attaches to a running process (its output from now on).
async fn attach(state: &Arc<State>, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let body: Value = match connect::stream_request(req).await {
        Ok(b) => b,
        Err(e) => return connect::stream_error(e),
    };
    match state.processes.select(sandbox_id, body.get("process")) {
        Ok(proc) => attached_stream(proc.pid, proc.subscribe()),
        Err(e) => connect::stream_error(e),
    }
}

fn list(state: &State, sandbox_id: &str) -> Value {
    let processes: Vec<Value> = state
        .processes
        .list(sandbox_id)
        .iter()
        .map(|p| {
            let mut v = json!({"pid": p.pid, "config": p.config});
            if let Some(tag) = &p.tag {
                v["tag"] = Value::String(tag.clone());
            }
            v
        })
        .collect();
    json!({ "processes": processes })
}

async fn send_input(state: &State, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let proc = state.processes.select(sandbox_id, body.get("process"))?;
    let input = body.get("input").ok_or_else(|| RpcError::new("invalid_argument", "input is required"))?;
    let data = decode_bytes(input.get("stdin").or_else(|| input.get("pty")))?;
    proc.send_input(SessionInput::Stdin(data)).await?;
    Ok(json!({}))
}

async fn close_stdin(state: &State, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let proc = state.processes.select(sandbox_id, body.get("process"))?;
    proc.send_input(SessionInput::CloseStdin).await?;
    Ok(json!({}))
}

async fn update(state: &State, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let proc = state.processes.select(sandbox_id, body.get("process"))?;
    let size = body.get("pty").and_then(|p| p.get("size")).ok_or_else(|| RpcError::new("invalid_argument", "pty.size is required"))?;
    let dim = |k: &str| size.get(k).and_then(as_u32).and_then(|n| u16::try_from(n).ok()).unwrap_or(0);
    if !proc.tty {
        return Err(RpcError::new("failed_precondition", format!("process {} has no terminal to resize", proc.pid)));
    }
    proc.send_input(SessionInput::Resize(TerminalSize { rows: dim("rows").max(1), cols: dim("cols").max(1) })).await?;
    Ok(json!({}))
}

async fn send_signal(state: &State, tenant: &str, sandbox_id: &str, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let started = Instant::now();
    let body: Value = connect::unary_request(req).await?;
    let proc = state.processes.select(sandbox_id, body.get("process"))?;
    let signal = match body.get("signal") {
        Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
        Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
        Some(v) => match as_u32(v).and_then(|n| i32::try_from(n).ok()) {
            Some(n @ (libc::SIGKILL | libc::SIGTERM)) => n,
            _ => return Err(RpcError::new("invalid_argument", format!("signal {v}: SIGNAL_SIGTERM or SIGNAL_SIGKILL"))),
        },
        None => return Err(RpcError::new("invalid_argument", "signal is required")),
    };
    let exec_id = proc
        .exec_id
        .lock()
        .ok()
        .and_then(|e| e.clone())
        .ok_or_else(|| RpcError::new("failed_precondition", format!("process {} has not started yet", proc.pid)))?;
    let result = state.manager.signal_exec(tenant, &exec_id, signal).await;
    state.audit(
        Audited { rpc: "e2b.process.SendSignal", tenant, sandbox_id, argv: None, detail: &format!("pid={} signal={signal}", proc.pid), trace: None },
        result.as_ref().err(),
        started,
    );
    match result {
        Ok(()) => Ok(json!({})),
        // It ended between the lookup and the signal: as envd, the process is not there.
        Err(Error::FailedPrecondition(m)) => Err(RpcError::new("not_found", m)),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ExecId, SandboxId};
    use crate::model::ExecOutcome;

    fn record(status: ExecStatus, code: i32, signal: i32) -> ExecRecord {
        let mut r = ExecRecord::running(ExecId::generate(), SandboxId::generate(), vec!["x".into()], String::new());
        r.outcome = ExecOutcome { status, exit_code: code, signal, ..ExecOutcome::failed(status, code, String::new(), std::time::SystemTime::now()) };
        r
    }

    #[test]
    fn end_events_carry_exit_codes_and_go_style_statuses() {
        let e = end_event(&record(ExecStatus::Exited, 3, 0)).expect("an end event");
        assert_eq!(e["event"]["end"]["exitCode"], 3);
        assert_eq!(e["event"]["end"]["exited"], true);
        assert_eq!(e["event"]["end"]["status"], "exit status 3");
        assert!(e["event"]["end"].get("error").is_none());
        let k = end_event(&record(ExecStatus::Signaled, 137, 9)).expect("an end event");
        assert_eq!(k["event"]["end"]["status"], "signal: killed");
        assert_eq!(k["event"]["end"]["exited"], false);
        let t = end_event(&record(ExecStatus::TimedOut, 137, 9)).expect_err("a timeout ends the stream");
        assert_eq!(t.code, "deadline_exceeded");
    }

    #[test]
    fn basic_auth_names_the_user() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Basic cm9vdDo="));
        assert_eq!(basic_user(&h), "root");
        assert_eq!(basic_user(&http::HeaderMap::new()), "");
    }
}
