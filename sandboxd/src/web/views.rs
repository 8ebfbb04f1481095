//! The JSON the page reads, each view made from the manager's public API for one tenant.
//!
//! A sandbox's env is never shown (it may hold secrets the caller passed); the rest of what the
//! API returns about a sandbox is. Output is shown as a head and a tail of at most
//! [`OUTPUT_PIECE`] bytes each, on demand.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::State;
use crate::error::Error;
use crate::model::{ExecRecord, ListExecsQuery, SandboxState, SnapshotRecord};

/// Exec records a sandbox's view lists (the newest).
const EXECS_SHOWN: u32 = 100;
/// Bytes of output in an exec's head, and in its tail.
pub const OUTPUT_PIECE: usize = 4096;
fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Creating => "creating",
        SandboxState::Running => "running",
        SandboxState::Failed => "failed",
        SandboxState::Destroyed => "destroyed",
        SandboxState::Paused => "paused",
    }
}

/// One sandbox as the list and its own view show it: from the API's record of it (what
/// ListSandboxes answers, here or on a peer), with the node that holds it on a fleet.
fn sandbox_json(s: &sandbox_proto::v1::Sandbox) -> Value {
    use sandbox_proto::v1::{Isolation, SandboxState};
    let time = |t: Option<prost_types::Timestamp>| t.and_then(|t| SystemTime::try_from(t).ok());
    let created = time(s.created_at);
    let l = s.limits.unwrap_or_default();
    let nonempty = |v: &str| if v.is_empty() { Value::Null } else { json!(v) };
    let mut v = json!({
        "id": s.id,
        "isolation": Isolation::try_from(s.isolation).map(|t| t.as_str_name().trim_start_matches("ISOLATION_").to_lowercase()).unwrap_or_default(),
        "isolation_reason": nonempty(&s.isolation_reason),
        "image": s.image,
        "state": SandboxState::try_from(s.state).map(|t| t.as_str_name().trim_start_matches("SANDBOX_STATE_").to_lowercase()).unwrap_or_default(),
        "failure_reason": nonempty(&s.failure_reason),
        "limits": {
            "cpu_millicores": l.cpu_millicores,
            "memory_bytes": l.memory_bytes,
            "max_pids": l.max_pids,
            "disk_bytes": l.disk_bytes,
            "exec_timeout_ms": l.exec_timeout_ms,
        },
        "labels": s.labels,
        "created_at": created.map(rfc3339),
        "age_seconds": created.and_then(|c| c.elapsed().ok()).map(|d| d.as_secs()).unwrap_or(0),
        "expires_at": time(s.expires_at).map(rfc3339),
        "user": nonempty(&s.user),
        "workdir": s.workdir,
        "parent_snapshot_id": nonempty(&s.parent_snapshot_id),
    });
    if !s.node.is_empty() {
        v["node"] = json!(s.node);
        v["node_address"] = json!(s.node_address);
    }
    v
}

/// One exec record, without its output.
pub fn exec_json(r: &ExecRecord) -> Value {
    let o = &r.outcome;
    json!({
        "exec_id": r.exec_id.as_str(),
        "argv": r.argv,
        "argv_truncated": r.argv_truncated,
        "status": o.status.name(),
        "exit_code": o.exit_code,
        "signal": o.signal,
        "started_at": rfc3339(o.started_at),
        "duration_ms": if o.status == crate::model::ExecStatus::Running { o.started_at.elapsed().unwrap_or_default() } else { o.duration }.as_millis() as u64,
        "cpu_user_ms": o.usage.cpu_user_ms,
        "cpu_system_ms": o.usage.cpu_system_ms,
        "peak_memory_bytes": o.usage.peak_memory_bytes,
        "stdout_total_bytes": o.stdout.total_bytes,
        "stderr_total_bytes": o.stderr.total_bytes,
        "stdout_truncated": o.stdout.truncated,
        "stderr_truncated": o.stderr.truncated,
        "output_discarded": r.output_discarded,
        "error": o.error,
        "trace_id": r.trace.as_ref().map(|t| t.trace_id.as_str()),
        "span_id": r.trace.as_ref().map(|t| t.span_id.as_str()),
    })
}

fn snapshot_json(s: &SnapshotRecord) -> Value {
    json!({
        "snapshot_id": s.snapshot_id.as_str(),
        "name": s.name,
        "created_at": rfc3339(s.created_at),
        "size_bytes": s.size_bytes,
        "memory": s.memory,
        "parent_snapshot_id": s.parent_snapshot_id.as_ref().map(|p| p.as_str()),
    })
}

/// How long a peer may take to answer the page's fan-out list: shorter than the gRPC list's,
/// because the page asks again at every change anyway.
const PEER_LIST_DEADLINE: Duration = Duration::from_secs(3);

/// The caller's sandboxes, newest first, and on a fleet those on every node (asked of the peers
/// as the gRPC list asks them): `{"sandboxes": [...], "unreachable_nodes": [{node, address,
/// error}]}`, a node that did not answer within [`PEER_LIST_DEADLINE`] named there, never
/// waited for longer.
pub async fn sandboxes(state: &State, tenant: &str, headers: &http::HeaderMap) -> Result<Value, Error> {
    let mut list: Vec<(SystemTime, Value)> =
        state.manager.list(tenant, &BTreeMap::new())?.iter().map(|s| (s.created_at, sandbox_json(&crate::api::convert::sandbox(s)))).collect();
    let mut unreachable = Vec::new();
    if let Some(f) = &state.fleet {
        for (_, v) in &mut list {
            v["node"] = json!(f.node());
            v["node_address"] = json!(f.address());
        }
        let metadata = tonic::metadata::MetadataMap::from_headers(headers.clone());
        for (peer, answer) in f.list_on_peers(tenant, &metadata, Default::default(), PEER_LIST_DEADLINE).await {
            match answer {
                Ok(r) => list.extend(
                    r.sandboxes.iter().map(|s| (s.created_at.and_then(|t| SystemTime::try_from(t).ok()).unwrap_or(SystemTime::UNIX_EPOCH), sandbox_json(s))),
                ),
                Err(e) => unreachable.push(json!({ "node": peer.name, "address": peer.addr.to_string(), "error": e.message() })),
            }
        }
    }
    list.sort_by_key(|(created, _)| std::cmp::Reverse(*created));
    Ok(json!({ "sandboxes": list.into_iter().map(|(_, v)| v).collect::<Vec<_>>(), "unreachable_nodes": unreachable }))
}

/// One sandbox: what it is, what it uses now, its newest exec records and its snapshots.
pub async fn sandbox(state: &State, tenant: &str, id: &str) -> Result<Value, Error> {
    let info = state.manager.get(tenant, id)?;
    let usage = state.manager.usage(tenant, id).await.ok().flatten();
    let execs = recent_execs(state, tenant, id)?;
    let snapshots = state.manager.list_snapshots(tenant, id)?;
    let mut v = sandbox_json(&crate::api::convert::sandbox(&info));
    v["usage"] = match usage {
        Some(u) => json!({
            "cpu_user_ms": u.cpu_user_ms, "cpu_system_ms": u.cpu_system_ms, "memory_bytes": u.memory_bytes,
            "peak_memory_bytes": u.peak_memory_bytes, "pids": u.pids, "disk_bytes": u.disk_bytes,
        }),
        None => Value::Null,
    };
    // Newest first, as an operator reads them.
    v["execs"] = Value::Array(execs.iter().rev().map(exec_json).collect());
    v["snapshots"] = Value::Array(snapshots.iter().map(snapshot_json).collect());
    Ok(v)
}

/// The newest [`EXECS_SHOWN`] records of a sandbox, oldest first, without output.
fn recent_execs(state: &State, tenant: &str, id: &str) -> Result<Vec<ExecRecord>, Error> {
    let q = ListExecsQuery { sandbox_id: id.to_string(), limit: EXECS_SHOWN, page_size: EXECS_SHOWN, ..Default::default() };
    Ok(state.manager.list_execs(tenant, &q)?.records)
}

/// An exec's record with the head and tail of its stdout and stderr.
pub async fn output(state: &State, tenant: &str, exec_id: &str) -> Result<Value, Error> {
    let r = state.manager.get_exec(tenant, exec_id, false).await?;
    let mut v = exec_json(&r);
    v["sandbox_id"] = json!(r.sandbox_id.as_str());
    v["stdout"] = head_tail(&r.outcome.stdout.bytes);
    v["stderr"] = head_tail(&r.outcome.stderr.bytes);
    Ok(v)
}

/// The first and last [`OUTPUT_PIECE`] bytes of a stream (one piece when it is short), as text.
pub fn head_tail(bytes: &[u8]) -> Value {
    if bytes.len() <= 2 * OUTPUT_PIECE {
        return json!({ "head": String::from_utf8_lossy(bytes), "tail": null, "kept_bytes": bytes.len() });
    }
    json!({
        "head": String::from_utf8_lossy(&bytes[..OUTPUT_PIECE]),
        "tail": String::from_utf8_lossy(&bytes[bytes.len() - OUTPUT_PIECE..]),
        "kept_bytes": bytes.len(),
    })
}

/// The images the caller can use, with their size and the tiers ready to run each.
pub fn images(state: &State, tenant: &str) -> Result<Value, Error> {
    let viewer = state.manager.image_viewer(tenant, false);
    let list = state.manager.list_images(&viewer)?;
    Ok(Value::Array(
        list.iter()
            .map(|i| {
                json!({
                    "name": i.name, "digest": i.digest, "size_bytes": i.size_bytes, "created_at": rfc3339(i.created_at),
                    "source": i.source, "imported": i.imported, "shared": i.shared,
                    "ready_tiers": i.ready_tiers.iter().map(|t| t.name().to_lowercase()).collect::<Vec<_>>(),
                })
            })
            .collect(),
    ))
}

/// Health per tier, room, the key metrics, and on a fleet each node's status.
pub async fn overview(state: &State, tenant: &str) -> Value {
    let tiers: Vec<Value> = state
        .manager
        .tiers()
        .into_iter()
        .map(|(tier, status)| {
            json!({
                "tier": tier.name().to_lowercase(),
                "available": status.is_ok(),
                "reason": status.err(),
                "allowed": state.manager.tier_allowed(tier),
            })
        })
        .collect();
    let (held, max) = state.manager.room();
    let fleet = match &state.fleet {
        Some(f) => {
            let mut nodes = vec![json!({ "node": f.node(), "address": f.address(), "self": true, "status": node_status(&f.status()) })];
            for (peer, status) in f.statuses().await {
                nodes.push(match status {
                    Ok(s) => json!({ "node": peer.name, "address": peer.addr.to_string(), "status": node_status(&s) }),
                    Err(e) => json!({ "node": peer.name, "address": peer.addr.to_string(), "unreachable": true, "error": e.message() }),
                });
            }
            Value::Array(nodes)
        }
        None => Value::Null,
    };
    json!({
        "tenant": tenant,
        "version": env!("CARGO_PKG_VERSION"),
        "allow_destroy": state.cfg.allow_destroy,
        // The same switch allows steering and stopping agent runs.
        "allow_agent_actions": state.cfg.allow_destroy && state.cfg.agent_runs_dir.is_some(),
        "agent_runs": state.cfg.agent_runs_dir.is_some(),
        "trace_url": state.cfg.trace_url,
        "tiers": tiers,
        "sandboxes_held": held,
        "max_sandboxes": max,
        "metrics": key_metrics(&state.manager.render_metrics()),
        "fleet": fleet,
    })
}

fn node_status(s: &sandbox_proto::v1::NodeStatus) -> Value {
    let tier = |i: i32| sandbox_proto::v1::Isolation::try_from(i).map(|t| t.as_str_name().trim_start_matches("ISOLATION_").to_lowercase()).unwrap_or_default();
    json!({
        "ready": s.ready,
        "sandboxes_held": s.sandboxes_held,
        "metrics": s.key_metrics.iter().map(|m| json!({ "name": m.name, "labels": m.labels, "value": m.value })).collect::<Vec<_>>(),
        "tiers": s.tiers.iter().map(|t| json!({ "tier": tier(t.isolation), "available": t.available, "free_sandboxes": t.free_sandboxes, "reason": t.reason })).collect::<Vec<_>>(),
    })
}

/// The samples of the key metrics (see [`crate::metrics::key_samples`]) as the page shows them.
fn key_metrics(text: &str) -> Vec<Value> {
    crate::metrics::key_samples(text).into_iter().map(|m| json!({ "name": m.name, "labels": m.labels, "value": m.value })).collect()
}

/// What the caller's view shows, hashed: its sandboxes and their states, and with `sandbox`
/// that sandbox's exec records (ids and statuses) and snapshots. The long poll answers when it
/// changes.
pub fn fingerprint(state: &State, tenant: &str, sandbox: &str) -> Result<String, Error> {
    let mut h = Sha256::new();
    let mut list = state.manager.list(tenant, &BTreeMap::new())?;
    list.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
    for s in &list {
        h.update(s.id.as_str());
        h.update(state_name(s.state));
        h.update([0]);
    }
    if !sandbox.is_empty() {
        // A sandbox destroyed meanwhile changes the list above; its records are gone with it.
        if let Ok(execs) = recent_execs(state, tenant, sandbox) {
            for r in &execs {
                h.update(r.exec_id.as_str());
                h.update(r.outcome.status.name());
                h.update([0]);
            }
        }
        if let Ok(snaps) = state.manager.list_snapshots(tenant, sandbox) {
            for s in &snaps {
                h.update(s.snapshot_id.as_str());
            }
        }
    }
    Ok(h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_output_is_a_head_and_a_tail() {
        let short = head_tail(b"hello");
        assert_eq!(short["head"], "hello");
        assert!(short["tail"].is_null());
        let mut long = vec![b'a'; OUTPUT_PIECE];
        long.extend(vec![b'b'; 10_000]);
        long.extend(vec![b'c'; OUTPUT_PIECE]);
        let v = head_tail(&long);
        assert_eq!(v["head"].as_str().map(str::len), Some(OUTPUT_PIECE));
        assert!(v["head"].as_str().is_some_and(|h| h.bytes().all(|b| b == b'a')));
        assert!(v["tail"].as_str().is_some_and(|t| t.len() == OUTPUT_PIECE && t.bytes().all(|b| b == b'c')));
        assert_eq!(v["kept_bytes"], long.len());
    }

    #[test]
    fn key_metrics_are_picked_from_the_prometheus_text() {
        let text = "# HELP sandboxd_execs_total x\nsandboxd_execs_total{status=\"exited\"} 3\nsandboxd_execs_total_other 1\nsandboxd_oom_kills_total 0\nsandboxd_sandboxes{tier=\"process\"} 2\n";
        let m = key_metrics(text);
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(m[0]["name"], "sandboxd_execs_total");
        assert_eq!(m[0]["labels"], "status=\"exited\"");
        assert_eq!(m[0]["value"], 3.0);
        assert_eq!(m[1]["name"], "sandboxd_oom_kills_total");
    }
}
