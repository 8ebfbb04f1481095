//! `--json` output: hand-written conversions of the protobuf messages.
//!
//! Written out field by field rather than derived, so the JSON shape is a deliberate interface:
//! enums appear under their proto names (`EXEC_STATUS_EXITED`), bytes as UTF-8 strings when they
//! are UTF-8 and base64 otherwise (with `<field>_encoding` saying which: nothing is lost), and
//! timestamps as RFC 3339 strings (`null` when unset).

use std::collections::HashMap;

use agent_client::proto::{
    ExecResult, ExecStatus, ImageInfo, Isolation, OnExpiry, ResourceLimits, Sandbox, SandboxState,
    SnapshotInfo,
};
use prost_types::Timestamp;
use serde_json::{json, Map, Value};

/// A sandbox.
pub fn sandbox(s: &Sandbox) -> Value {
    json!({
        "id": s.id,
        "isolation": isolation_name(s.isolation),
        "image": s.image,
        "state": state_name(s.state),
        "limits": s.limits.as_ref().map(limits),
        "labels": string_map(&s.labels),
        "created_at": timestamp(s.created_at.as_ref()),
        "expires_at": timestamp(s.expires_at.as_ref()),
        "workdir": s.workdir,
        "user": s.user,
        "parent_snapshot_id": s.parent_snapshot_id,
        "isolation_reason": s.isolation_reason,
        "failure_reason": s.failure_reason,
        "on_expiry": on_expiry_name(s.on_expiry),
        "paused_at": timestamp(s.paused_at.as_ref()),
        "usage": s.usage.as_ref().map(|u| json!({
            "cpu_user_ms": u.cpu_user_ms,
            "cpu_system_ms": u.cpu_system_ms,
            "memory_bytes": u.memory_bytes,
            "peak_memory_bytes": u.peak_memory_bytes,
            "pids": u.pids,
            "disk_bytes": u.disk_bytes,
        })),
        "network": s.network.as_ref().map(|n| json!({
            "mode": network_mode_name(n.mode),
            "allow": n.allow,
        })),
    })
}

/// `NETWORK_MODE_ALLOWLIST` → "ALLOWLIST".
pub fn network_mode_name(mode: i32) -> &'static str {
    use agent_client::proto::NetworkMode;
    match NetworkMode::try_from(mode) {
        Ok(NetworkMode::None) | Ok(NetworkMode::Unspecified) => "NONE",
        Ok(NetworkMode::Allowlist) => "ALLOWLIST",
        Ok(NetworkMode::Open) => "OPEN",
        Err(_) => "UNKNOWN",
    }
}

/// A network event.
pub fn network_event(e: &agent_client::proto::NetworkEvent) -> Value {
    json!({
        "time": timestamp(e.time.as_ref()),
        "kind": e.kind,
        "name": e.name,
        "addr": e.addr,
        "port": e.port,
        "allowed": e.allowed,
        "rule": e.rule,
        "detail": e.detail,
        "bytes_out": e.bytes_out,
        "bytes_in": e.bytes_in,
        "duration_ms": e.duration_ms,
    })
}

/// Resource limits.
pub fn limits(l: &ResourceLimits) -> Value {
    json!({
        "cpu_millicores": l.cpu_millicores,
        "memory_bytes": l.memory_bytes,
        "max_pids": l.max_pids,
        "disk_bytes": l.disk_bytes,
        "exec_timeout_ms": l.exec_timeout_ms,
        "shm_bytes": l.shm_bytes,
    })
}

/// An exec's result, output included.
pub fn exec_result(r: &ExecResult) -> Value {
    let (stdout, stdout_encoding) = bytes_text(&r.stdout);
    let (stderr, stderr_encoding) = bytes_text(&r.stderr);
    json!({
        "exec_id": r.exec_id,
        "sandbox_id": r.sandbox_id,
        "argv": r.argv,
        "status": exec_status_name(r.status),
        "exit_code": r.exit_code,
        "signal": r.signal,
        "stdout": stdout,
        "stdout_encoding": stdout_encoding,
        "stderr": stderr,
        "stderr_encoding": stderr_encoding,
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
        "stdout_total_bytes": r.stdout_total_bytes,
        "stderr_total_bytes": r.stderr_total_bytes,
        "started_at": timestamp(r.started_at.as_ref()),
        "duration_ms": r.duration_ms,
        "cpu_user_ms": r.cpu_user_ms,
        "cpu_system_ms": r.cpu_system_ms,
        "peak_memory_bytes": r.peak_memory_bytes,
        "error": r.error,
        "idempotency_key": r.idempotency_key,
        "stdout_spill_path": r.stdout_spill_path,
        "stderr_spill_path": r.stderr_spill_path,
        "output_discarded": r.output_discarded,
        "argv_truncated": r.argv_truncated,
    })
}

/// Output bytes as JSON text without loss: the text itself when it is UTF-8, else base64.
pub fn bytes_text(bytes: &[u8]) -> (String, &'static str) {
    match std::str::from_utf8(bytes) {
        Ok(text) => (text.to_string(), "utf-8"),
        Err(_) => {
            use base64::Engine;
            (
                base64::engine::general_purpose::STANDARD.encode(bytes),
                "base64",
            )
        }
    }
}

/// An image.
pub fn image(i: &ImageInfo) -> Value {
    json!({
        "name": i.name,
        "digest": i.digest,
        "size_bytes": i.size_bytes,
        "created_at": timestamp(i.created_at.as_ref()),
        "source": i.source,
        "ready_tiers": i.ready_tiers.iter().map(|t| isolation_name(*t)).collect::<Vec<_>>(),
        "env": string_map(&i.env),
        "workdir": i.workdir,
        "user": i.user,
        "entrypoint": i.entrypoint,
        "cmd": i.cmd,
        "imported": i.imported,
        "shared": i.shared,
        "nodes": i.nodes,
    })
}

/// A snapshot.
pub fn snapshot(s: &SnapshotInfo) -> Value {
    json!({
        "snapshot_id": s.snapshot_id,
        "sandbox_id": s.sandbox_id,
        "name": s.name,
        "created_at": timestamp(s.created_at.as_ref()),
        "size_bytes": s.size_bytes,
        "parent_snapshot_id": s.parent_snapshot_id,
        "includes_memory": s.includes_memory,
    })
}

/// RFC 3339, or `null` when unset.
fn timestamp(t: Option<&Timestamp>) -> Value {
    t.map_or(Value::Null, |t| Value::String(t.to_string()))
}

/// A string map as a JSON object (sorted by key, as `serde_json::Map` is).
fn string_map(map: &HashMap<String, String>) -> Value {
    Value::Object(
        map.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<Map<_, _>>(),
    )
}

// A value the daemon sends that this build does not know stays visible as its number.

fn isolation_name(v: i32) -> Value {
    Isolation::try_from(v).map_or_else(|_| json!(v), |e| json!(e.as_str_name()))
}

/// `ON_EXPIRY_PAUSE` → "PAUSE" (unset: "DESTROY", what it means).
fn on_expiry_name(v: i32) -> Value {
    match OnExpiry::try_from(v) {
        Ok(OnExpiry::Unspecified) => json!("DESTROY"),
        Ok(e) => json!(e.as_str_name().trim_start_matches("ON_EXPIRY_")),
        Err(_) => json!(v),
    }
}

fn state_name(v: i32) -> Value {
    SandboxState::try_from(v).map_or_else(|_| json!(v), |e| json!(e.as_str_name()))
}

fn exec_status_name(v: i32) -> Value {
    ExecStatus::try_from(v).map_or_else(|_| json!(v), |e| json!(e.as_str_name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_result_fields() {
        let result = ExecResult {
            exec_id: "ex-1".into(),
            sandbox_id: "sb-1".into(),
            argv: vec!["sh".into(), "-c".into(), "echo hi; exit 3".into()],
            status: ExecStatus::Exited as i32,
            exit_code: 3,
            stdout: b"hi\n".to_vec(),
            stderr: vec![0xff, b'x'],
            stdout_total_bytes: 3,
            started_at: Some(Timestamp {
                seconds: 1_700_000_000,
                nanos: 0,
            }),
            duration_ms: 12,
            ..Default::default()
        };
        let v = exec_result(&result);
        assert_eq!(v["exec_id"], "ex-1");
        assert_eq!(v["argv"], json!(["sh", "-c", "echo hi; exit 3"]));
        assert_eq!(v["status"], "EXEC_STATUS_EXITED");
        assert_eq!(v["exit_code"], 3);
        assert_eq!(v["stdout"], "hi\n");
        assert_eq!(v["stdout_encoding"], "utf-8");
        // Not UTF-8: base64, never a lossy replacement character.
        assert_eq!(
            (v["stderr"].as_str(), v["stderr_encoding"].as_str()),
            (Some("/3g="), Some("base64"))
        );
        assert_eq!(v["stdout_truncated"], false);
        assert_eq!(v["started_at"], "2023-11-14T22:13:20Z");
        assert_eq!(v["duration_ms"], 12);
        assert_eq!(v["error"], "");
        assert_eq!(
            v.as_object().map(Map::len),
            Some(25),
            "one key per ExecResult field, plus the two output encodings"
        );
    }

    #[test]
    fn unknown_enum_values_stay_numbers() {
        let result = ExecResult {
            status: 42,
            ..Default::default()
        };
        assert_eq!(exec_result(&result)["status"], 42);
        assert_eq!(exec_result(&result)["started_at"], Value::Null);
    }

    #[test]
    fn binary_output_is_base64_and_says_so() {
        let bytes: Vec<u8> = vec![0xff, 0x00, b'a', 0xc3, 0x28];
        let result = ExecResult {
            stdout: bytes.clone(),
            stderr: "ünïcode\n".as_bytes().to_vec(),
            ..Default::default()
        };
        let v = exec_result(&result);
        assert_eq!(v["stdout_encoding"], "base64");
        use base64::Engine;
        let back = base64::engine::general_purpose::STANDARD
            .decode(v["stdout"].as_str().expect("a string"))
            .expect("base64");
        assert_eq!(back, bytes, "nothing is lost");
        assert_eq!(
            (v["stderr"].as_str(), v["stderr_encoding"].as_str()),
            (Some("ünïcode\n"), Some("utf-8"))
        );
    }

    #[test]
    fn sandbox_fields() {
        let sb = Sandbox {
            id: "sb-1".into(),
            isolation: Isolation::Process as i32,
            state: SandboxState::Running as i32,
            labels: HashMap::from([("team".to_owned(), "infra".to_owned())]),
            limits: Some(ResourceLimits {
                memory_bytes: 512 << 20,
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = sandbox(&sb);
        assert_eq!(v["isolation"], "ISOLATION_PROCESS");
        assert_eq!(v["state"], "SANDBOX_STATE_RUNNING");
        assert_eq!(v["labels"], json!({"team": "infra"}));
        assert_eq!(v["limits"]["memory_bytes"], 512u64 << 20);
        assert_eq!(v["expires_at"], Value::Null);
    }
}
