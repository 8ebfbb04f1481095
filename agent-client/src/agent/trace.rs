//! The run's trace: one JSON object per line in `<run dir>/trace.jsonl`, appended as the run
//! goes (state transitions, model calls with tokens and latency, actions with exec ids,
//! decisions), and the readable timeline `sbx agent show` prints from it.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

/// What can go wrong with a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// An I/O error on the trace file.
    #[error("trace {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Appends events to a run's trace.
#[derive(Debug)]
pub struct Trace {
    file: File,
    path: PathBuf,
    trace_id: String,
    run_id: String,
    session: u32,
}

impl Trace {
    /// Opens (creating) the trace of a run for appending.
    pub fn open(
        path: &Path,
        trace_id: &str,
        run_id: &str,
        session: u32,
    ) -> Result<Self, TraceError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| TraceError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Trace {
            file,
            path: path.to_path_buf(),
            trace_id: trace_id.to_owned(),
            run_id: run_id.to_owned(),
            session,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event. `fields` must be a JSON object; the common fields are added.
    ///
    /// A failing trace write is logged, not fatal: losing a trace line must not lose the run.
    pub fn event(&mut self, kind: &str, step: u64, state: &str, fields: Value) {
        let mut obj = Map::new();
        obj.insert(
            "ts_ms".into(),
            json!(SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)),
        );
        obj.insert("trace_id".into(), json!(self.trace_id));
        obj.insert("run_id".into(), json!(self.run_id));
        obj.insert("session".into(), json!(self.session));
        obj.insert("step".into(), json!(step));
        obj.insert("state".into(), json!(state));
        obj.insert("event".into(), json!(kind));
        if let Value::Object(extra) = fields {
            obj.extend(extra.into_iter().filter(|(_, v)| !v.is_null()));
        }
        let mut line = Value::Object(obj).to_string();
        line.push('\n');
        // One write per line, so a crash never leaves half a line followed by another.
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot append to the trace");
        }
    }
}

/// Reads a trace; lines that do not parse (a torn last line after a crash) are skipped.
pub fn read(path: &Path) -> Result<Vec<Value>, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect())
}

/// Per-step prompt tokens of the model calls in a trace (as counted by the loop), in order.
pub fn prompt_tokens_per_call(events: &[Value]) -> Vec<u64> {
    events
        .iter()
        .filter(|e| e["event"] == "llm_call" && e["purpose"] == "step")
        .filter_map(|e| e["counted_prompt_tokens"].as_u64())
        .collect()
}

/// What a trace alone says about a run: enough for `sbx agent show` and `sbx agent ls` when
/// the checkpoint is damaged (the trace is appended line by line, so it survives what tears a
/// checkpoint).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Digest {
    /// The run.
    pub run_id: String,
    /// The task, from the `start` event.
    pub task: Option<String>,
    /// The model.
    pub model: Option<String>,
    /// The sandbox the run works in (the latest, after forks).
    pub sandbox_id: Option<String>,
    /// Highest step seen.
    pub steps: u64,
    /// Sessions (the first one included).
    pub sessions: u64,
    /// Prompt tokens over all model calls.
    pub prompt_tokens: u64,
    /// Completion tokens over all model calls.
    pub completion_tokens: u64,
    /// The reason of the last stop, when the last session stopped.
    pub reason: Option<String>,
    /// Its detail.
    pub detail: Option<String>,
    /// The last actions, oldest first (at most 10).
    pub last_actions: Vec<String>,
    /// Milliseconds since the epoch of the last event.
    pub last_event_ms: Option<u64>,
}

/// Sums up a trace.
pub fn digest(events: &[Value]) -> Digest {
    let mut d = Digest::default();
    let mut sessions = std::collections::BTreeSet::new();
    for e in events {
        if d.run_id.is_empty() {
            d.run_id = e["run_id"].as_str().unwrap_or_default().to_owned();
        }
        if let Some(s) = e["session"].as_u64() {
            sessions.insert(s);
        }
        d.steps = d.steps.max(e["step"].as_u64().unwrap_or(0));
        d.last_event_ms = e["ts_ms"].as_u64().or(d.last_event_ms);
        match e["event"].as_str().unwrap_or_default() {
            "start" => {
                d.task = e["task"].as_str().map(str::to_owned);
                d.model = e["model"].as_str().map(str::to_owned);
                d.sandbox_id = e["sandbox_id"].as_str().map(str::to_owned);
            }
            "resume" => {
                // A new session: the previous stop no longer holds.
                d.reason = None;
                d.detail = None;
            }
            "llm_call" => {
                d.prompt_tokens += e["prompt_tokens"].as_u64().unwrap_or(0);
                d.completion_tokens += e["completion_tokens"].as_u64().unwrap_or(0);
            }
            "step" => {
                if let Some(a) = e["action"].as_str() {
                    d.last_actions.push(format!("step {}: {a}", e["step"]));
                    if d.last_actions.len() > 10 {
                        d.last_actions.remove(0);
                    }
                }
            }
            "decision" if e["decision"] == "stop" => {
                d.reason = e["reason"].as_str().map(str::to_owned);
                d.detail = e["detail"].as_str().map(str::to_owned);
            }
            "decision" if e["decision"] == "fork" => {
                d.sandbox_id = e["new_sandbox"].as_str().map(str::to_owned);
            }
            _ => {}
        }
    }
    d.sessions = sessions.len() as u64;
    d
}

/// Renders a trace as a timeline, one line per notable event.
pub fn timeline(events: &[Value]) -> String {
    let t0 = events
        .first()
        .and_then(|e| e["ts_ms"].as_u64())
        .unwrap_or(0);
    let mut out = timeline_header();
    for e in events {
        out.push_str(&timeline_line(e, t0).unwrap_or_default());
    }
    out
}

/// The header line of [`timeline`].
pub fn timeline_header() -> String {
    format!(
        "{:>8}  {:>4}  {:<10}  {:<12}  {}\n",
        "T+S", "STEP", "STATE", "EVENT", "DETAIL"
    )
}

/// One event as a line of [`timeline`] (with its newline), times relative to `t0` (ms since
/// the epoch); `None` for events the timeline leaves out.
pub fn timeline_line(e: &Value, t0: u64) -> Option<String> {
    let kind = e["event"].as_str().unwrap_or("?");
    let detail = match kind {
        "transition" => format!(
            "{} -> {}{}",
            e["from"].as_str().unwrap_or("?"),
            e["to"].as_str().unwrap_or("?"),
            e["why"]
                .as_str()
                .map(|w| format!(" ({w})"))
                .unwrap_or_default()
        ),
        "llm_call" => format!(
            "{}: prompt {} tok (counted {}), completion {} tok, {} ms{}",
            e["purpose"].as_str().unwrap_or("step"),
            e["prompt_tokens"].as_u64().unwrap_or(0),
            e["counted_prompt_tokens"].as_u64().unwrap_or(0),
            e["completion_tokens"].as_u64().unwrap_or(0),
            e["latency_ms"].as_u64().unwrap_or(0),
            e["error"]
                .as_str()
                .map(|x| format!(", error: {x}"))
                .unwrap_or_default()
        ),
        "action" | "step" => format!(
            "{}{}{}",
            e["action"].as_str().unwrap_or(""),
            e["exec_id"]
                .as_str()
                .map(|x| format!(" [{x}]"))
                .unwrap_or_default(),
            e["result"]
                .as_str()
                .map(|x| format!(" -> {x}"))
                .unwrap_or_default()
        ),
        _ => e["detail"].as_str().map(str::to_owned).unwrap_or_else(|| {
            let mut o = e.as_object().cloned().unwrap_or_default();
            for k in [
                "ts_ms", "trace_id", "run_id", "session", "step", "state", "event",
            ] {
                o.remove(k);
            }
            if o.is_empty() {
                String::new()
            } else {
                Value::Object(o).to_string()
            }
        }),
    };
    if kind == "transition" && e["to"] == "OBSERVING" {
        return None;
    }
    let secs = e["ts_ms"].as_u64().unwrap_or(t0).saturating_sub(t0) as f64 / 1000.0;
    Some(format!(
        "{:>8.1}  {:>4}  {:<10}  {:<12}  {}\n",
        secs,
        e["step"].as_u64().unwrap_or(0),
        e["state"].as_str().unwrap_or(""),
        kind,
        detail
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_tells_the_run_without_its_checkpoint() {
        let lines = [
            json!({"run_id": "r", "session": 0, "step": 0, "event": "start", "task": "t", "model": "m", "sandbox_id": "sb1", "ts_ms": 1}),
            json!({"run_id": "r", "session": 0, "step": 1, "event": "llm_call", "prompt_tokens": 100, "completion_tokens": 5}),
            json!({"run_id": "r", "session": 0, "step": 1, "event": "step", "action": "bash `ls`"}),
            json!({"run_id": "r", "session": 0, "step": 1, "event": "decision", "decision": "stop", "reason": "fatal_error", "detail": "x"}),
            json!({"run_id": "r", "session": 1, "step": 1, "event": "resume"}),
            json!({"run_id": "r", "session": 1, "step": 1, "event": "decision", "decision": "fork", "new_sandbox": "sb2"}),
            json!({"run_id": "r", "session": 1, "step": 2, "event": "llm_call", "prompt_tokens": 50, "completion_tokens": 5}),
            json!({"run_id": "r", "session": 1, "step": 2, "event": "decision", "decision": "stop", "reason": "finished", "detail": "ok", "ts_ms": 9}),
        ];
        let d = digest(&lines);
        assert_eq!(d.run_id, "r");
        assert_eq!(d.task.as_deref(), Some("t"));
        assert_eq!(d.sandbox_id.as_deref(), Some("sb2"));
        assert_eq!((d.steps, d.sessions), (2, 2));
        assert_eq!((d.prompt_tokens, d.completion_tokens), (150, 10));
        assert_eq!(d.reason.as_deref(), Some("finished"));
        assert_eq!(d.last_actions, vec!["step 1: bash `ls`".to_owned()]);
        assert_eq!(d.last_event_ms, Some(9));
    }

    #[test]
    fn events_are_appended_and_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("trace.jsonl");
        let mut t = Trace::open(&path, "tr-1", "run-1", 0).expect("open");
        t.event(
            "llm_call",
            1,
            "THINKING",
            json!({"purpose": "step", "counted_prompt_tokens": 120, "prompt_tokens": 118, "completion_tokens": 9, "latency_ms": 5}),
        );
        t.event(
            "step",
            1,
            "OBSERVING",
            json!({"action": "bash `ls`", "exec_id": "ex-1", "result": "ok", "nothing": null}),
        );
        drop(t);
        // A torn line, as a crash mid-write would leave.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"{\"event\": \"tr"))
            .expect("append");
        let events = read(&path).expect("read");
        assert_eq!(events.len(), 2);
        assert_eq!(events[0]["trace_id"], "tr-1");
        assert!(events[1].get("nothing").is_none());
        assert_eq!(prompt_tokens_per_call(&events), vec![120]);
        let text = timeline(&events);
        assert!(text.contains("prompt 118 tok (counted 120)"), "{text}");
        assert!(text.contains("bash `ls` [ex-1] -> ok"), "{text}");
    }
}
