//! `sbx agent` runs, read from the state dir `[web] agent_runs_dir` names, and the operator's
//! two actions on a run that goes on: steer and stop ([`act`]).
//!
//! The format is agent-client's: `<dir>/runs/<run id>/` holds `checkpoint` (a header line
//! `SBXCKPT <version> sha256=<hex> len=<n>` and a JSON body), `trace.jsonl` (one JSON event per
//! line, appended as the run goes; a torn last line is skipped) and, once the run has stopped,
//! `final.diff`. Only the fields the page shows are taken from them, by name, so a newer
//! agent-client that adds fields changes nothing here.
//!
//! A run is shown to the tenant that owns its sandbox; when the API has no tokens (one local
//! operator) every run is shown. The same rule says who may act on it.
//!
//! The page writes only into a run's `inbox/`, through the `agent-inbox` crate, which owns that
//! format and writes without following a link anywhere below the state dir: the run (another
//! process, maybe another user's) takes the request at its next step boundary, records it in its
//! trace and checkpoint, and removes the file.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::State;
use crate::audit::{millis, AuditEntry};
use crate::error::Error;

/// Runs listed at most (the newest by their last event).
const MAX_RUNS: usize = 500;
/// Bytes of a trace read at most (its end, where a running run's latest steps are).
const MAX_TRACE_BYTES: u64 = 8 << 20;
/// Events of one run sent at most (the newest).
const MAX_EVENTS: usize = 2000;
/// Longest string of an event sent (model reasoning, commands); longer ones are cut.
const MAX_FIELD_CHARS: usize = 2000;
/// Bytes of a checkpoint, and of a final diff, read at most.
const MAX_CHECKPOINT_BYTES: u64 = 64 << 20;
const MAX_DIFF_BYTES: u64 = 256 << 10;

/// What the list shows of each run.
pub async fn list(state: &State, tenant: &str) -> Result<Value, Error> {
    let Some(dir) = state.cfg.agent_runs_dir.clone() else {
        return Err(Error::NotFound("no agent runs: [web] agent_runs_dir is not set".into()));
    };
    let runs = tokio::task::spawn_blocking(move || read_all(&dir)).await.map_err(|e| Error::Internal(format!("reading agent runs: {e}")))??;
    let mut shown: Vec<Value> = runs.into_iter().filter(|r| visible(state, tenant, r)).collect();
    shown.sort_by_key(|r| std::cmp::Reverse(r["last_event_ms"].as_u64().unwrap_or(0)));
    Ok(Value::Array(shown))
}

/// One run: its summary, budget, the timeline of its events, and its final diff.
pub async fn show(state: &State, tenant: &str, run_id: &str) -> Result<Value, Error> {
    find(state, tenant, run_id, true).await
}

/// Run `run_id` as [`read_run`] reads it, if `tenant` may see it: an id that is not a run id
/// (it could leave the runs dir), a run that does not exist and another tenant's run are all
/// NOT_FOUND alike.
async fn find(state: &State, tenant: &str, run_id: &str, detail: bool) -> Result<Value, Error> {
    let Some(dir) = state.cfg.agent_runs_dir.clone() else {
        return Err(Error::NotFound("no agent runs: [web] agent_runs_dir is not set".into()));
    };
    let run_dir = run_dir(&dir, run_id)?;
    let run = tokio::task::spawn_blocking(move || read_run(&run_dir, detail)).await.map_err(|e| Error::Internal(format!("reading agent run: {e}")))??;
    // Another tenant's run is not found, exactly like one that does not exist.
    if !visible(state, tenant, &run) {
        return Err(Error::NotFound(format!("run {run_id}")));
    }
    Ok(run)
}

/// The directory of run `run_id` under the state dir `dir`; NOT_FOUND for anything that is not
/// a run id (`..`, a path, a NUL, too long), which names no run and must not name a path.
fn run_dir(dir: &Path, run_id: &str) -> Result<PathBuf, Error> {
    if !valid_run_id(run_id) {
        return Err(Error::NotFound(format!("run {:?}", run_id.chars().take(80).collect::<String>())));
    }
    Ok(dir.join("runs").join(run_id))
}

/// Longest body of a steer or a stop: a message of [`agent_inbox::MAX_MESSAGE_BYTES`] with
/// JSON escaping fits.
pub const MAX_ACTION_BODY: usize = agent_inbox::MAX_FILE_BYTES as usize;

/// What the page sends to steer a run.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SteerBody {
    message: String,
}

/// What the page sends to stop a run.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StopBody {
    /// `done` or `failed`.
    status: agent_inbox::StopAs,
    #[serde(default)]
    reason: Option<String>,
}

/// The operator's request `kind` (`steer` or `stop`) from a POST body.
fn command(kind: &str, body: &[u8]) -> Result<agent_inbox::Command, Error> {
    let command = match kind {
        "steer" => serde_json::from_slice::<SteerBody>(body)
            .map(|b| agent_inbox::Command::Steer { message: b.message })
            .map_err(|e| Error::invalid("body", format!("a steer is {{\"message\": TEXT}}: {e}")))?,
        "stop" => serde_json::from_slice::<StopBody>(body)
            .map(|b| agent_inbox::Command::Stop { status: b.status, reason: b.reason.filter(|r| !r.trim().is_empty()) })
            .map_err(|e| Error::invalid("body", format!("a stop is {{\"status\": \"done\"|\"failed\", \"reason\": TEXT}}: {e}")))?,
        other => return Err(Error::NotFound(format!("no action {other:?} on a run"))),
    };
    command.check().map_err(|e| Error::invalid(if kind == "steer" { "message" } else { "reason" }, e.to_string()))?;
    Ok(command)
}

/// Whether a run (as [`read_run`] reads it) still takes requests: it has a readable checkpoint
/// and no outcome, or one it can resume from. Else why not.
fn open_for_requests(run: &Value) -> Result<(), Error> {
    let id = run["run_id"].as_str().unwrap_or_default();
    if let Some(e) = run["checkpoint_error"].as_str() {
        return Err(Error::FailedPrecondition(format!("run {id} cannot take requests: its checkpoint is unreadable ({e})")));
    }
    let reason = run["outcome"]["reason"].as_str();
    if !agent_inbox::takes_requests(reason) {
        return Err(Error::FailedPrecondition(format!("run {id} has ended ({}); a steer or stop cannot reach it", reason.unwrap_or_default())));
    }
    Ok(())
}

/// Steers or stops run `run_id` (`kind`: `steer` or `stop`, `body` its JSON), for `tenant`: the
/// request goes into the run's inbox, which the run reads at its next step boundary (or on
/// resume, if it is down). Refused unless `[web] allow_destroy` is on (PERMISSION_DENIED), for
/// a run the tenant cannot see (NOT_FOUND), and for one that has ended (FAILED_PRECONDITION),
/// also one that ends while the request is written, unless it took it. Audited.
pub async fn act(state: &State, tenant: &str, run_id: &str, kind: &str, headers: &http::HeaderMap, body: &[u8]) -> Result<Value, Error> {
    if !state.cfg.allow_destroy {
        return Err(Error::PermissionDenied(
            "the page is read-only: set [web] allow_destroy = true to destroy sandboxes and steer or stop agent runs from it".into(),
        ));
    }
    if headers.get("x-sandboxd-web").and_then(|v| v.to_str().ok()) != Some("agent") {
        return Err(Error::invalid("X-Sandboxd-Web", "a steer or stop must carry `X-Sandboxd-Web: agent`"));
    }
    let started = std::time::Instant::now();
    let result = deliver(state, tenant, run_id, kind, body).await;
    let (sandbox_id, answer) = match result {
        Ok((sandbox, v)) => (sandbox, Ok(v)),
        Err(e) => (String::new(), Err(e)),
    };
    let trace = crate::telemetry::caller_trace(headers);
    let detail = match &answer {
        Ok(v) => format!("run {run_id} request {}", v["request_id"].as_str().unwrap_or_default()),
        Err(_) => format!("run {}", run_id.chars().take(80).collect::<String>()),
    };
    state.audit.record(&AuditEntry {
        tenant,
        rpc: if kind == "steer" { "web.SteerAgentRun" } else { "web.StopAgentRun" },
        sandbox_id: &sandbox_id,
        argv: None,
        env: None,
        detail: &detail,
        status: answer.as_ref().err().map(super::code_name).unwrap_or("OK"),
        duration_ms: millis(started.elapsed()),
        trace: trace.as_ref(),
    });
    answer
}

/// [`act`]'s work: the run's sandbox id and the answer.
async fn deliver(state: &State, tenant: &str, run_id: &str, kind: &str, body: &[u8]) -> Result<(String, Value), Error> {
    let command = command(kind, body)?;
    let run = find(state, tenant, run_id, false).await?;
    let sandbox = run["sandbox_id"].as_str().unwrap_or_default().to_string();
    let dir = state.cfg.agent_runs_dir.clone().ok_or_else(|| Error::NotFound("no agent runs".into()))?;
    if !run_dir(&dir, run_id)?.join("checkpoint").is_file() {
        // A directory without a checkpoint is no run (agent-client says the same).
        return Err(Error::NotFound(format!("run {run_id}")));
    }
    open_for_requests(&run)?;
    let id = run_id.to_string();
    let request = tokio::task::spawn_blocking(move || -> Result<agent_inbox::Request, Error> {
        let inbox = agent_inbox::Inbox::of_run(&dir, &id).map_err(|e| Error::NotFound(e.to_string()))?;
        let request = inbox.deliver(command).map_err(|e| match e {
            agent_inbox::Error::InvalidRunId(_) => Error::NotFound(format!("run {id}")),
            agent_inbox::Error::Full { .. } => Error::ResourceExhausted(format!("run {id}: {e}")),
            agent_inbox::Error::EmptyMessage | agent_inbox::Error::MessageTooLong { .. } | agent_inbox::Error::ReasonTooLong { .. } => {
                Error::invalid("body", e.to_string())
            }
            agent_inbox::Error::Io { .. } => Error::Internal(format!("writing to run {id}'s inbox: {e}")),
        })?;
        // The run may have ended between the check and the rename: a request it did not take
        // is withdrawn, and the answer says the run has ended.
        let run_dir = dir.join("runs").join(&id);
        if let Ok(ck) = read_checkpoint(&run_dir.join("checkpoint")) {
            let taken = ck["operator"].as_array().is_some_and(|ops| ops.iter().any(|o| o["id"] == request.id.as_str()));
            let reason = ck["outcome"]["reason"].as_str();
            if !agent_inbox::takes_requests(reason) && !taken {
                if let Err(e) = inbox.withdraw(&request.id) {
                    tracing::warn!(run = %id, error = %e, "cannot withdraw a request to an ended run");
                }
                return Err(Error::FailedPrecondition(format!("run {id} has ended ({}); a steer or stop cannot reach it", reason.unwrap_or_default())));
            }
        }
        Ok(request)
    })
    .await
    .map_err(|e| Error::Internal(format!("writing to an agent run's inbox: {e}")))??;
    tracing::info!(run = %run_id, request = %request.id, kind, %tenant, "web: operator request sent to an agent run");
    Ok((sandbox, json!({ "run_id": run_id, "request_id": request.id, "kind": kind, "sent_at_ms": request.sent_at_ms })))
}

/// The agent runs as the long poll watches them: each run's trace length and time (a trace only
/// grows while its run goes on) and with `run` that run's checkpoint and diff too. Metadata only.
/// With `only_run` just that run: a tenant's poll must not wake on other tenants' runs.
pub fn fingerprint(dir: &Path, run: &str, only_run: bool) -> String {
    let mut h = Sha256::new();
    let runs = dir.join("runs");
    let mut names: Vec<String> = if only_run {
        vec![run.to_string()]
    } else {
        std::fs::read_dir(&runs).map(|e| e.flatten().take(MAX_RUNS).map(|e| e.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default()
    };
    names.retain(|n| valid_run_id(n));
    names.sort();
    let stamp = |p: PathBuf| std::fs::metadata(p).map(|m| (m.len(), m.modified().ok())).ok();
    for name in &names {
        h.update(format!("{name}:{:?};", stamp(runs.join(name).join("trace.jsonl"))));
    }
    if valid_run_id(run) {
        for file in ["checkpoint", "final.diff"] {
            h.update(format!("{file}:{:?};", stamp(runs.join(run).join(file))));
        }
    }
    h.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// Which runs a tenant's long poll may watch: all of them when the API has no tenants to keep
/// apart; else only the run it shows, if that run is the tenant's (read once per poll), or none.
pub async fn watchable(state: &State, tenant: &str, run: &str) -> Option<(String, bool)> {
    if !state.auth.tokens_required() {
        return Some((run.to_string(), false));
    }
    show(state, tenant, run).await.ok().map(|_| (run.to_string(), true))
}

/// Whether `tenant` may see a run: its sandbox is theirs, or the API has no tenants to keep
/// apart.
fn visible(state: &State, tenant: &str, run: &Value) -> bool {
    if !state.auth.tokens_required() {
        return true;
    }
    run["sandbox_id"].as_str().is_some_and(|id| state.manager.get(tenant, id).is_ok())
}

/// A run id as agent-client allows it: 1-64 letters, digits, '.', '_' or '-', not starting
/// with '.' (the rule is agent-inbox's, shared with every writer of a run's directory).
fn valid_run_id(id: &str) -> bool {
    agent_inbox::valid_run_id(id)
}

fn read_all(dir: &Path) -> Result<Vec<Value>, Error> {
    let runs = dir.join("runs");
    let entries = match std::fs::read_dir(&runs) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Internal(format!("listing {}: {e}", runs.display()))),
    };
    let mut out = Vec::new();
    for entry in entries.flatten().take(MAX_RUNS) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !valid_run_id(&name) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match read_run(&entry.path(), false) {
            Ok(r) => out.push(r),
            Err(e) => out.push(json!({ "run_id": name, "error": e.to_string() })),
        }
    }
    Ok(out)
}

/// A run's summary; with `detail` also its events and final diff.
fn read_run(run_dir: &Path, detail: bool) -> Result<Value, Error> {
    let run_id = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !run_dir.is_dir() {
        return Err(Error::NotFound(format!("run {run_id}")));
    }
    let events = read_trace(&run_dir.join("trace.jsonl"));
    let (checkpoint, checkpoint_error) = match read_checkpoint(&run_dir.join("checkpoint")) {
        Ok(c) => (c, None),
        Err(e) => (Value::Null, Some(e)),
    };
    let mut v = summary(&run_id, &events, &checkpoint);
    // Whether a steer or stop can still reach it: the page offers them only then.
    v["takes_requests"] = json!(checkpoint_error.is_none() && agent_inbox::takes_requests(checkpoint["outcome"]["reason"].as_str()));
    v["checkpoint_error"] = json!(checkpoint_error);
    if detail {
        let skip = events.len().saturating_sub(MAX_EVENTS);
        v["events"] = Value::Array(events.into_iter().skip(skip).map(cut_strings).collect());
        v["diff"] = json!(read_capped(&run_dir.join("final.diff"), MAX_DIFF_BYTES).map(|b| String::from_utf8_lossy(&b).into_owned()));
    }
    Ok(v)
}

/// What the trace and the checkpoint say about a run, the checkpoint winning where both do.
fn summary(run_id: &str, events: &[Value], ck: &Value) -> Value {
    let mut s = json!({ "run_id": run_id, "steps": 0, "prompt_tokens": 0, "completion_tokens": 0 });
    let (mut prompt, mut completion, mut steps) = (0u64, 0u64, 0u64);
    for e in events {
        steps = steps.max(e["step"].as_u64().unwrap_or(0));
        s["last_event_ms"] = e["ts_ms"].clone();
        match e["event"].as_str().unwrap_or_default() {
            "start" => {
                s["task"] = e["task"].clone();
                s["model"] = e["model"].clone();
                s["trace_id"] = e["trace_id"].clone();
            }
            "sandbox" => s["sandbox_id"] = e["sandbox_id"].clone(),
            "decision" if e["decision"] == "fork" => s["sandbox_id"] = e["new_sandbox"].clone(),
            "llm_call" => {
                prompt += e["prompt_tokens"].as_u64().unwrap_or(0);
                completion += e["completion_tokens"].as_u64().unwrap_or(0);
            }
            "stop" => {
                s["status"] = e["status"].clone();
                s["reason"] = e["reason"].clone();
                s["detail"] = e["detail"].clone();
            }
            "resume" => {
                for k in ["status", "reason", "detail"] {
                    s[k] = Value::Null;
                }
            }
            _ => {}
        }
    }
    s["steps"] = json!(steps);
    s["prompt_tokens"] = json!(prompt);
    s["completion_tokens"] = json!(completion);
    if ck.is_object() {
        for (key, from) in [("state", &ck["state"]), ("sandbox_id", &ck["sandbox_id"]), ("trace_id", &ck["trace_id"]), ("steps", &ck["step"])] {
            if !from.is_null() {
                s[key] = from.clone();
            }
        }
        let spec = &ck["spec"];
        s["task"] = spec["task"].clone();
        s["model"] = spec["model"].clone();
        s["budget"] = json!({
            "used": ck["budget"].clone(),
            "max_steps": spec["max_steps"].clone(),
            "max_tokens": spec["max_tokens"].clone(),
            "max_cost": spec["max_cost"].clone(),
            "max_time_secs": spec["max_time_secs"].clone(),
            "verify": spec["verify"].clone(),
        });
        let outcome = &ck["outcome"];
        if outcome.is_object() {
            s["outcome"] = json!({
                "reason": outcome["reason"].clone(),
                "summary": outcome["summary"].clone(),
                "answer": outcome["answer"].clone(),
                "error": outcome["error"].clone(),
                "final_snapshot_id": outcome["final_snapshot_id"].clone(),
            });
        }
    }
    s
}

/// The trace's events (its last [`MAX_TRACE_BYTES`]); lines that do not parse are skipped.
fn read_trace(path: &Path) -> Vec<Value> {
    let Ok(mut file) = std::fs::File::open(path) else { return Vec::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(MAX_TRACE_BYTES);
    if start > 0 {
        use std::io::Seek;
        if file.seek(std::io::SeekFrom::Start(start)).is_err() {
            return Vec::new();
        }
    }
    let mut text = Vec::new();
    if file.take(MAX_TRACE_BYTES).read_to_end(&mut text).is_err() {
        return Vec::new();
    }
    String::from_utf8_lossy(&text).lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(Value::is_object).collect()
}

/// The checkpoint's JSON body, its header's length and checksum checked.
fn read_checkpoint(path: &Path) -> Result<Value, String> {
    let bytes = read_capped(path, MAX_CHECKPOINT_BYTES).ok_or_else(|| format!("no readable checkpoint at {}", path.display()))?;
    let nl = bytes.iter().position(|&b| b == b'\n').ok_or("no header line")?;
    let header = String::from_utf8_lossy(&bytes[..nl]).into_owned();
    let body = &bytes[nl + 1..];
    let mut fields = header.split(' ');
    if fields.next() != Some("SBXCKPT") {
        return Err("not a checkpoint (no SBXCKPT header)".into());
    }
    let _version = fields.next();
    for f in fields {
        if let Some(hex) = f.strip_prefix("sha256=") {
            let actual: String = Sha256::digest(body).iter().map(|b| format!("{b:02x}")).collect();
            if actual != hex {
                return Err("its checksum does not match (torn or altered)".into());
            }
        } else if let Some(n) = f.strip_prefix("len=") {
            if n.parse::<usize>().ok() != Some(body.len()) {
                return Err("its length does not match (torn)".into());
            }
        }
    }
    serde_json::from_slice(body).map_err(|e| format!("its body is not JSON: {e}"))
}

/// At most `max` bytes of a file, or None when it cannot be read.
fn read_capped(path: &Path, max: u64) -> Option<Vec<u8>> {
    let file = std::fs::File::open(path).ok()?;
    let mut out = Vec::new();
    file.take(max).read_to_end(&mut out).ok()?;
    Some(out)
}

/// An event with every string longer than [`MAX_FIELD_CHARS`] cut.
fn cut_strings(v: Value) -> Value {
    match v {
        Value::String(s) if s.chars().count() > MAX_FIELD_CHARS => Value::String(s.chars().take(MAX_FIELD_CHARS).chain("…".chars()).collect()),
        Value::Object(m) => Value::Object(m.into_iter().map(|(k, v)| (k, cut_strings(v))).collect::<Map<_, _>>()),
        Value::Array(a) => Value::Array(a.into_iter().map(cut_strings).collect()),
        v => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint_file(body: &str) -> String {
        let sum: String = Sha256::digest(body.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        format!("SBXCKPT 1 sha256={sum} len={}\n{body}", body.len())
    }

    #[test]
    fn a_run_dir_reads_as_summary_timeline_and_diff() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path().join("runs").join("r-1");
        std::fs::create_dir_all(&run).expect("mkdir");
        let trace = [
            json!({"ts_ms": 1, "event": "start", "step": 0, "task": "fix it", "model": "m", "trace_id": "t"}),
            json!({"ts_ms": 2, "event": "sandbox", "step": 0, "sandbox_id": "sb-1"}),
            json!({"ts_ms": 3, "event": "llm_call", "step": 1, "prompt_tokens": 10, "completion_tokens": 5}),
            json!({"ts_ms": 4, "event": "step", "step": 1, "action": "x".repeat(5000), "exec_id": "ex-1"}),
            json!({"ts_ms": 5, "event": "stop", "step": 1, "status": "DONE", "reason": "finished"}),
        ];
        let mut text: String = trace.iter().map(|e| format!("{e}\n")).collect();
        text.push_str("{\"torn");
        std::fs::write(run.join("trace.jsonl"), text).expect("trace");
        let body = json!({"state": "Done", "step": 1, "sandbox_id": "sb-1", "spec": {"task": "fix it", "model": "m", "max_steps": 30},
            "budget": {"prompt_tokens": 10, "completion_tokens": 5}, "outcome": {"reason": "finished", "summary": "ok", "diff": ""}});
        std::fs::write(run.join("checkpoint"), checkpoint_file(&body.to_string())).expect("checkpoint");
        std::fs::write(run.join("final.diff"), "+++ b/x\n").expect("diff");

        let v = read_run(&run, true).expect("run");
        assert_eq!(v["run_id"], "r-1");
        assert_eq!(v["sandbox_id"], "sb-1");
        assert_eq!(v["state"], "Done");
        assert_eq!(v["status"], "DONE");
        assert_eq!(v["prompt_tokens"], 10);
        assert_eq!(v["budget"]["max_steps"], 30);
        assert_eq!(v["outcome"]["summary"], "ok");
        assert_eq!(v["diff"], "+++ b/x\n");
        assert!(v["checkpoint_error"].is_null());
        let events = v["events"].as_array().expect("events");
        assert_eq!(events.len(), 5, "the torn line is skipped");
        assert_eq!(events[3]["action"].as_str().map(|a| a.chars().count()), Some(MAX_FIELD_CHARS + 1), "long strings are cut");

        // A damaged checkpoint is said so; the trace still gives the summary.
        std::fs::write(run.join("checkpoint"), checkpoint_file(&body.to_string()).replace("Done", "Gone")).expect("tamper");
        let v = read_run(&run, false).expect("run");
        assert!(v["checkpoint_error"].as_str().is_some_and(|e| e.contains("checksum")), "{v}");
        assert_eq!(v["task"], "fix it");
        assert!(v.get("events").is_none());
        assert_eq!(read_all(dir.path()).expect("all").len(), 1);
    }

    #[test]
    fn run_ids_cannot_leave_the_runs_dir() {
        assert!(valid_run_id("r-1.a_b"));
        let dir = Path::new("/srv/agent");
        assert_eq!(run_dir(dir, "r-1").expect("a run id"), Path::new("/srv/agent/runs/r-1"));
        for bad in ["", ".", "..", "../x", "../../etc", ".hidden", "a/b", "/etc/passwd", "a%2fb", "a\0b", "a\\b", "é", &"x".repeat(65), &"y".repeat(1 << 16)] {
            assert!(!valid_run_id(bad), "{bad:?}");
            assert!(matches!(run_dir(dir, bad), Err(Error::NotFound(_))), "{bad:?}");
        }
    }

    #[test]
    fn action_bodies_are_parsed_and_bounded() {
        let steer = command("steer", br#"{"message": "use python3"}"#).expect("steer");
        assert_eq!(steer, agent_inbox::Command::Steer { message: "use python3".into() });
        let stop = command("stop", br#"{"status": "done", "reason": "enough"}"#).expect("stop");
        assert_eq!(stop, agent_inbox::Command::Stop { status: agent_inbox::StopAs::Done, reason: Some("enough".into()) });
        // A blank reason is no reason.
        let stop = command("stop", br#"{"status": "failed", "reason": "  "}"#).expect("stop");
        assert_eq!(stop, agent_inbox::Command::Stop { status: agent_inbox::StopAs::Failed, reason: None });
        for (kind, body) in [
            ("steer", &br#"{"message": "   "}"#[..]),
            ("steer", br#"{"message": 3}"#),
            ("steer", br#"{"message": "x", "extra": 1}"#),
            ("steer", b"not json"),
            ("steer", b""),
            ("stop", br#"{"status": "maybe"}"#),
            ("stop", br#"{}"#),
        ] {
            assert!(matches!(command(kind, body), Err(Error::InvalidArgument { .. })), "{kind} {:?}", String::from_utf8_lossy(body));
        }
        let long = serde_json::json!({ "message": "x".repeat(agent_inbox::MAX_MESSAGE_BYTES + 1) }).to_string();
        assert!(matches!(command("steer", long.as_bytes()), Err(Error::InvalidArgument { .. })));
        let long = serde_json::json!({ "status": "done", "reason": "x".repeat(agent_inbox::MAX_REASON_BYTES + 1) }).to_string();
        assert!(matches!(command("stop", long.as_bytes()), Err(Error::InvalidArgument { .. })));
        // The largest steer fits in the largest body.
        let max = serde_json::json!({ "message": "\"".repeat(agent_inbox::MAX_MESSAGE_BYTES) }).to_string();
        assert!(max.len() <= MAX_ACTION_BODY, "{}", max.len());
        assert!(matches!(command("pause", b"{}"), Err(Error::NotFound(_))));
    }

    #[test]
    fn only_a_run_that_goes_on_takes_requests() {
        let run = |ck: Value| {
            let dir = tempfile::tempdir().expect("tempdir");
            let r = dir.path().join("runs").join("r");
            std::fs::create_dir_all(&r).expect("mkdir");
            std::fs::write(r.join("checkpoint"), checkpoint_file(&ck.to_string())).expect("checkpoint");
            read_run(&r, false).expect("run")
        };
        let going = run(json!({"state": "Thinking", "step": 2}));
        assert_eq!(going["takes_requests"], true);
        assert!(open_for_requests(&going).is_ok());
        let down = run(json!({"state": "Failed", "outcome": {"reason": "fatal_error"}}));
        assert_eq!(down["takes_requests"], true, "a resumable run takes them on resume");
        for reason in ["finished", "operator_done", "operator_failed", "max_steps"] {
            let ended = run(json!({"state": "Done", "outcome": {"reason": reason}}));
            assert_eq!(ended["takes_requests"], false, "{reason}");
            assert!(matches!(open_for_requests(&ended), Err(Error::FailedPrecondition(_))), "{reason}");
        }
    }
}
