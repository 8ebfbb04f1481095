//! The audit log: one JSON line per mutating call — who (tenant), what (RPC, sandbox, argv), how
//! it ended (gRPC code) and how long it took, and the caller's trace id and span when its call
//! carried a W3C `traceparent` — rotated by size.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::config::AuditConfig;

/// One audited call.
#[derive(Debug, Serialize)]
pub struct AuditEntry<'a> {
    pub tenant: &'a str,
    pub rpc: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub sandbox_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub argv: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env: Option<std::collections::BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub detail: &'a str,
    /// gRPC code name ("OK", "NOT_FOUND", …).
    pub status: &'a str,
    pub duration_ms: u64,
    /// The caller's trace (`trace_id`, `span_id`), when its call carried a `traceparent`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub trace: Option<&'a crate::model::TraceContext>,
}

struct Sink {
    file: File,
    written: u64,
}

/// The audit log writer.
pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    keep: usize,
    redact_env: bool,
    sink: Mutex<Option<Sink>>,
}

impl AuditLog {
    /// Opens (appending) the log at the configured path or `default_path`.
    pub fn open(cfg: &AuditConfig, default_path: PathBuf) -> std::io::Result<Self> {
        let path = cfg.path.clone().unwrap_or(default_path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let written = file.metadata()?.len();
        Ok(AuditLog { path, max_bytes: cfg.max_bytes.max(1024), keep: cfg.keep, redact_env: cfg.redact_env, sink: Mutex::new(Some(Sink { file, written })) })
    }

    /// Env as it should appear in the log.
    pub fn env(&self, env: &std::collections::HashMap<String, String>) -> Option<std::collections::BTreeMap<String, String>> {
        if env.is_empty() {
            return None;
        }
        Some(env.iter().map(|(k, v)| (k.clone(), if self.redact_env { "***".to_string() } else { v.clone() })).collect())
    }

    /// Appends one entry (errors are logged, never returned: auditing must not fail a call).
    pub fn record(&self, entry: &AuditEntry<'_>) {
        self.record_value(entry)
    }

    /// Appends one line of any shape (the egress filter's connection lines), stamped like
    /// [`AuditLog::record`]'s.
    pub fn record_value<T: Serialize>(&self, entry: &T) {
        #[derive(Serialize)]
        struct Line<'a, T: Serialize> {
            ts: String,
            #[serde(flatten)]
            entry: &'a T,
        }
        let ts = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
        let mut line = match serde_json::to_vec(&Line { ts, entry }) {
            Ok(l) => l,
            Err(e) => return tracing::warn!(error = %e, "encoding audit entry"),
        };
        line.push(b'\n');
        let Ok(mut guard) = self.sink.lock() else { return };
        if guard.as_ref().is_some_and(|s| s.written + line.len() as u64 > self.max_bytes) {
            *guard = None;
            if let Err(e) = self.rotate() {
                tracing::warn!(error = %e, path = %self.path.display(), "rotating audit log");
            }
        }
        if guard.is_none() {
            match OpenOptions::new().create(true).append(true).open(&self.path) {
                Ok(file) => *guard = Some(Sink { file, written: 0 }),
                Err(e) => return tracing::warn!(error = %e, path = %self.path.display(), "opening audit log"),
            }
        }
        if let Some(sink) = guard.as_mut() {
            match sink.file.write_all(&line) {
                Ok(()) => sink.written += line.len() as u64,
                Err(e) => tracing::warn!(error = %e, "writing audit log"),
            }
        }
    }

    /// audit.jsonl → .1 → .2 … (the oldest beyond `keep` dropped).
    fn rotate(&self) -> std::io::Result<()> {
        let name = |i: usize| PathBuf::from(format!("{}.{i}", self.path.display()));
        if self.keep == 0 {
            return std::fs::remove_file(&self.path);
        }
        let _ = std::fs::remove_file(name(self.keep));
        for i in (1..self.keep).rev() {
            if name(i).exists() {
                std::fs::rename(name(i), name(i + 1))?;
            }
        }
        std::fs::rename(&self.path, name(1))
    }
}

/// Duration as whole milliseconds.
pub fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_with_redacted_env_and_rotate_by_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.jsonl");
        let cfg = AuditConfig { path: Some(path.clone()), max_bytes: 1024, keep: 2, redact_env: true };
        let log = AuditLog::open(&cfg, PathBuf::new()).expect("open");
        let env: std::collections::HashMap<String, String> = [("TOKEN".to_string(), "s3cret".to_string())].into();
        let argv = vec!["echo".to_string(), "hi".to_string()];
        let trace = crate::model::TraceContext { trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(), span_id: "00f067aa0ba902b7".into() };
        for i in 0..20 {
            log.record(&AuditEntry {
                tenant: "t",
                rpc: "Exec",
                sandbox_id: "sb-1",
                argv: Some(&argv),
                env: log.env(&env),
                detail: "",
                status: "OK",
                duration_ms: 3,
                trace: (i % 2 == 0).then_some(&trace),
            });
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let first: serde_json::Value = serde_json::from_str(text.lines().next().expect("a line")).expect("json");
        assert_eq!(first["rpc"], "Exec");
        assert_eq!(first["env"]["TOKEN"], "***");
        // Every other line came with a traceparent: its trace id and span, and the others none.
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        let traced = lines.iter().filter(|l| l["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" && l["span_id"] == "00f067aa0ba902b7").count();
        let bare = lines.iter().filter(|l| l.get("trace_id").is_none() && l.get("span_id").is_none()).count();
        assert!(traced > 0 && bare > 0 && traced + bare == lines.len(), "{text}");
        assert!(!text.contains("s3cret"));
        assert!(PathBuf::from(format!("{}.1", path.display())).exists(), "rotated");
        assert!(!PathBuf::from(format!("{}.3", path.display())).exists(), "keep = 2");
        assert!(std::fs::metadata(&path).expect("stat").len() <= 1024);
    }
}
