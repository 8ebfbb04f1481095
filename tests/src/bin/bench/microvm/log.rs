//! The microVM daemons' JSON log, which says what the API does not: the accelerator a guest
//! ran under and why, boot times, and whether a create took the warm pool's VM.

use std::fmt::Write as _;
use std::time::Duration;

use sandbox_tests::Daemon;

/// One line of a daemon's log, written with `--log-format json`.
#[derive(Debug)]
pub(crate) struct LogLine {
    timestamp: String,
    pub(crate) level: String,
    pub(crate) message: String,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl LogLine {
    pub(crate) fn parse(line: &str) -> Option<LogLine> {
        let value: serde_json::Value = serde_json::from_str(line).ok()?;
        let mut fields = value.get("fields")?.as_object()?.clone();
        let message = fields.remove("message")?.as_str()?.to_string();
        let level = value.get("level").and_then(|l| l.as_str()).unwrap_or_default().to_string();
        let timestamp = value.get("timestamp").and_then(|t| t.as_str()).unwrap_or_default().to_string();
        Some(LogLine { timestamp, level, message, fields })
    }

    /// A field as text (a string without its quotes).
    pub(crate) fn field(&self, key: &str) -> Option<String> {
        self.fields.get(key).map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    pub(crate) fn millis(&self, key: &str) -> Option<Duration> {
        self.fields.get(key)?.as_u64().map(Duration::from_millis)
    }

    /// `LEVEL message key=value …`, as the report quotes it.
    pub(crate) fn text(&self) -> String {
        let mut text = format!("{} {}", self.level, self.message);
        for key in self.fields.keys() {
            let _ = write!(text, " {key}={}", self.field(key).unwrap_or_default());
        }
        text
    }
}

/// The lines of a daemon's JSON log (anything else, e.g. a panic message, is left out).
pub(crate) fn log_lines(log: &str) -> Vec<LogLine> {
    log.lines().filter_map(LogLine::parse).collect()
}

pub(crate) fn count_logged(lines: &[LogLine], message: &str) -> usize {
    lines.iter().filter(|l| l.message == message).count()
}

/// The lines in which the daemon says how its microVMs run their CPUs (`decide_accel`: the
/// configured accelerator, no /dev/kvm, the KVM probe and its verdict cached for this boot).
pub(crate) fn accel_decision(lines: &[LogLine]) -> Vec<String> {
    lines.iter().filter(|l| l.message.contains("KVM") || l.message.contains("TCG")).map(LogLine::text).collect()
}

/// Says on stderr what the daemon logged, so a failing microVM section can be diagnosed after
/// the daemon and its temp dir are gone.
pub(crate) fn print_log_tail(daemon: &Daemon, what: &str) {
    let log = daemon.log();
    let lines: Vec<String> = log
        .lines()
        .map(|l| match LogLine::parse(l) {
            Some(parsed) => format!("{} {}", parsed.timestamp, parsed.text()),
            None => l.to_string(),
        })
        .collect();
    let tail = &lines[lines.len().saturating_sub(60)..];
    eprintln!("bench: the last {} lines of the log of the {what} daemon:\n{}", tail.len(), tail.join("\n"));
}

/// Why a daemon left at `accel = "auto"` did not use KVM, in a few words from its log.
pub(crate) fn kvm_reason(lines: &[LogLine]) -> Option<String> {
    lines.iter().find_map(|l| {
        let field = |k: &str| l.field(k).unwrap_or_else(|| "?".into());
        if l.message.starts_with("KVM probe failed") {
            Some(format!("the KVM probe boot failed ({}; deadline {} ms)", field("error"), field("timeout_ms")))
        } else if l.message.starts_with("no usable /dev/kvm") {
            Some(format!("no usable /dev/kvm ({})", field("error")))
        } else if l.message.starts_with("microVM acceleration from this boot's KVM probe") && l.field("accel").as_deref() == Some("tcg") {
            Some(format!("the KVM probe of this host boot failed (verdict cached in {})", field("cache")))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use crate::microvm::LOG_BOOTED;

    use super::*;

    #[test]
    fn json_log_lines_give_message_fields_and_accel() {
        let log = concat!(
            "not json: a panic message\n",
            r#"{"timestamp":"t","level":"WARN","fields":{"message":"KVM probe failed (nested guests may hang here): falling back to TCG (software emulation)","error":"boot timed out","timeout_ms":5000},"target":"sandboxd::backend::microvm"}"#,
            "\n",
            r#"{"timestamp":"t","level":"DEBUG","fields":{"message":"microVM booted","vm":"vm-1","accel":"tcg","boot_ms":1834,"guest_uptime_ms":1200},"target":"sandboxd::backend::microvm"}"#,
            "\n",
            r#"{"timestamp":"t","level":"INFO","fields":{"message":"microVM taken from the warm pool","sandbox":"sb-1"},"target":"sandboxd::backend::microvm"}"#,
        );
        let lines = log_lines(log);
        assert_eq!(lines.len(), 3);
        assert_eq!(count_logged(&lines, LOG_BOOTED), 1);
        assert_eq!(lines[1].field("accel").as_deref(), Some("tcg"));
        assert_eq!(lines[1].millis("boot_ms"), Some(Duration::from_millis(1834)));
        assert_eq!(lines[2].field("sandbox").as_deref(), Some("sb-1"));
        let decision = accel_decision(&lines);
        assert_eq!(decision.len(), 1, "{decision:?}");
        assert!(decision[0].starts_with("WARN KVM probe failed") && decision[0].contains("error=boot timed out"), "{decision:?}");
    }
}
