//! Protobuf messages ↔ core types. Validation of ids and values happens in the core; here only
//! what the wire format itself can get wrong (an unknown enum number) is refused.

use crate::egress::{NetworkMode, NetworkPolicy};
use std::time::SystemTime;

use sandbox_proto::v1 as pb;
use tonic::Status;

use crate::error::Error;
use crate::model::{
    CreateRequest, ExecEvent, ExecRecord, ExecRequest, ExecStatus, ImageProgress, ImageRecord, Isolation, ListExecsQuery, OnExpiry, OutputChunk,
    RequestedLimits, SandboxInfo, SandboxState, SnapshotRecord,
};

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

/// Proto isolation → core; UNSPECIFIED is `None` (the policy's default).
pub fn isolation_from_proto(value: i32) -> Result<Option<Isolation>, Status> {
    match pb::Isolation::try_from(value) {
        Ok(pb::Isolation::Unspecified) => Ok(None),
        Ok(pb::Isolation::Process) => Ok(Some(Isolation::Process)),
        Ok(pb::Isolation::Container) => Ok(Some(Isolation::Container)),
        Ok(pb::Isolation::Microvm) => Ok(Some(Isolation::MicroVm)),
        Err(_) => Err(Status::invalid_argument(format!("invalid isolation: unknown value {value}"))),
    }
}

pub fn isolation_to_proto(i: Isolation) -> pb::Isolation {
    match i {
        Isolation::Process => pb::Isolation::Process,
        Isolation::Container => pb::Isolation::Container,
        Isolation::MicroVm => pb::Isolation::Microvm,
    }
}

fn state_to_proto(s: SandboxState) -> pb::SandboxState {
    match s {
        SandboxState::Creating => pb::SandboxState::Creating,
        SandboxState::Running => pb::SandboxState::Running,
        SandboxState::Failed => pb::SandboxState::Failed,
        SandboxState::Destroyed => pb::SandboxState::Destroyed,
        SandboxState::Paused => pb::SandboxState::Paused,
    }
}

fn on_expiry_to_proto(o: OnExpiry) -> pb::OnExpiry {
    match o {
        OnExpiry::Destroy => pb::OnExpiry::Destroy,
        OnExpiry::Pause => pb::OnExpiry::Pause,
    }
}

/// A create's `on_expiry`: unset is DESTROY, as before the field.
fn on_expiry_from_proto(v: i32) -> Result<OnExpiry, Status> {
    match pb::OnExpiry::try_from(v) {
        Ok(pb::OnExpiry::Unspecified | pb::OnExpiry::Destroy) => Ok(OnExpiry::Destroy),
        Ok(pb::OnExpiry::Pause) => Ok(OnExpiry::Pause),
        Err(_) => Err(Status::invalid_argument(format!("invalid on_expiry: unknown value {v}"))),
    }
}

fn status_to_proto(s: ExecStatus) -> pb::ExecStatus {
    match s {
        ExecStatus::Exited => pb::ExecStatus::Exited,
        ExecStatus::Signaled => pb::ExecStatus::Signaled,
        ExecStatus::TimedOut => pb::ExecStatus::TimedOut,
        ExecStatus::OomKilled => pb::ExecStatus::OomKilled,
        ExecStatus::SpawnFailed => pb::ExecStatus::SpawnFailed,
        ExecStatus::Running => pb::ExecStatus::Running,
        ExecStatus::Lost => pb::ExecStatus::Lost,
    }
}

/// CreateSandboxRequest → core.
pub fn create_request(r: pb::CreateSandboxRequest) -> Result<CreateRequest, Status> {
    let l = r.limits.unwrap_or_default();
    Ok(CreateRequest {
        isolation: isolation_from_proto(r.isolation)?,
        image: r.image,
        limits: RequestedLimits {
            cpu_millicores: l.cpu_millicores,
            memory_bytes: l.memory_bytes,
            max_pids: l.max_pids,
            disk_bytes: l.disk_bytes,
            exec_timeout_ms: l.exec_timeout_ms,
            shm_bytes: l.shm_bytes,
        },
        env: r.env.into_iter().collect(),
        workdir: r.workdir,
        labels: r.labels.into_iter().collect(),
        ttl_seconds: r.ttl_seconds,
        from_snapshot_id: r.from_snapshot_id,
        user: r.user,
        network: network_from_proto(r.network)?,
        on_expiry: on_expiry_from_proto(r.on_expiry)?,
    })
}

/// The request's network: None when it names no mode (the default, or a fork's parent's).
pub(super) fn network_from_proto(n: Option<pb::NetworkPolicy>) -> Result<Option<NetworkPolicy>, Status> {
    let Some(n) = n else { return Ok(None) };
    let mode = match pb::NetworkMode::try_from(n.mode) {
        Ok(pb::NetworkMode::Unspecified) if n.allow.is_empty() => return Ok(None),
        Ok(pb::NetworkMode::Unspecified) => return Err(Status::invalid_argument("invalid network.mode: allow entries need mode NETWORK_MODE_ALLOWLIST")),
        Ok(pb::NetworkMode::None) => NetworkMode::None,
        Ok(pb::NetworkMode::Allowlist) => NetworkMode::Allowlist,
        Ok(pb::NetworkMode::Open) => NetworkMode::Open,
        Err(_) => return Err(Status::invalid_argument(format!("invalid network.mode: unknown value {}", n.mode))),
    };
    NetworkPolicy::new(mode, &n.allow).map(Some).map_err(|e| Status::invalid_argument(format!("invalid network.allow: {e}")))
}

/// A sandbox's network → proto.
fn network_to_proto(n: &NetworkPolicy) -> pb::NetworkPolicy {
    let mode = match n.mode {
        NetworkMode::None => pb::NetworkMode::None,
        NetworkMode::Allowlist => pb::NetworkMode::Allowlist,
        NetworkMode::Open => pb::NetworkMode::Open,
    };
    pb::NetworkPolicy { mode: mode as i32, allow: n.allow.iter().map(|a| a.to_string()).collect() }
}

/// Core sandbox → proto.
pub fn sandbox(i: &SandboxInfo) -> pb::Sandbox {
    pb::Sandbox {
        id: i.id.to_string(),
        isolation: isolation_to_proto(i.isolation) as i32,
        // The catalog key a sandbox records carries its owner's tag; users see the name.
        image: crate::images::display_name(&i.image).to_string(),
        state: state_to_proto(i.state) as i32,
        limits: Some(pb::ResourceLimits {
            cpu_millicores: i.limits.cpu_millicores,
            memory_bytes: i.limits.memory_bytes,
            max_pids: i.limits.max_pids,
            disk_bytes: i.limits.disk_bytes,
            exec_timeout_ms: i.limits.exec_timeout_ms,
            shm_bytes: i.limits.shm_size(),
        }),
        labels: i.labels.clone().into_iter().collect(),
        created_at: Some(timestamp(i.created_at)),
        workdir: i.workdir.clone(),
        parent_snapshot_id: i.parent_snapshot_id.as_ref().map(|s| s.to_string()).unwrap_or_default(),
        expires_at: i.expires_at.map(timestamp),
        isolation_reason: i.isolation_reason.clone().unwrap_or_default(),
        failure_reason: i.failure_reason.clone().unwrap_or_default(),
        user: i.user.clone().unwrap_or_default(),
        network: Some(network_to_proto(&i.network)),
        usage: None,
        // Stamped by the fleet's router (it knows the node; the core does not).
        node: String::new(),
        node_address: String::new(),
        on_expiry: on_expiry_to_proto(i.on_expiry) as i32,
        paused_at: i.paused_at.map(timestamp),
    }
}

/// A sandbox's usage → proto.
pub fn sandbox_usage(u: &crate::model::SandboxUsage) -> pb::SandboxUsage {
    pb::SandboxUsage {
        cpu_user_ms: u.cpu_user_ms,
        cpu_system_ms: u.cpu_system_ms,
        memory_bytes: u.memory_bytes,
        peak_memory_bytes: u.peak_memory_bytes,
        pids: u.pids,
        disk_bytes: u.disk_bytes,
    }
}

/// ExecRequest → core.
pub fn exec_request(r: pb::ExecRequest) -> ExecRequest {
    ExecRequest {
        sandbox_id: r.sandbox_id,
        argv: r.argv,
        env: r.env.into_iter().collect(),
        workdir: r.workdir,
        stdin: r.stdin,
        timeout_ms: r.timeout_ms,
        max_output_bytes: r.max_output_bytes,
        idempotency_key: r.idempotency_key,
        background: r.background,
        user: r.user,
        trace: None,
    }
}

/// Core exec record → proto; `with_output` false for the last event of a stream.
pub fn exec_result(record: &ExecRecord, with_output: bool) -> pb::ExecResult {
    let r = &record.outcome;
    pb::ExecResult {
        exec_id: record.exec_id.to_string(),
        sandbox_id: record.sandbox_id.to_string(),
        argv: record.argv.clone(),
        status: status_to_proto(r.status) as i32,
        exit_code: r.exit_code,
        signal: r.signal,
        stdout: if with_output { r.stdout.bytes.clone() } else { Vec::new() },
        stderr: if with_output { r.stderr.bytes.clone() } else { Vec::new() },
        stdout_truncated: r.stdout.truncated,
        stderr_truncated: r.stderr.truncated,
        stdout_total_bytes: r.stdout.total_bytes,
        stderr_total_bytes: r.stderr.total_bytes,
        started_at: Some(timestamp(r.started_at)),
        duration_ms: r.duration.as_millis() as u64,
        cpu_user_ms: r.usage.cpu_user_ms,
        cpu_system_ms: r.usage.cpu_system_ms,
        peak_memory_bytes: r.usage.peak_memory_bytes,
        error: r.error.clone(),
        idempotency_key: record.idempotency_key.clone(),
        stdout_spill_path: r.stdout.spill_path.clone().unwrap_or_default(),
        stderr_spill_path: r.stderr.spill_path.clone().unwrap_or_default(),
        output_discarded: record.output_discarded,
        argv_truncated: record.argv_truncated,
        trace_id: record.trace.as_ref().map(|t| t.trace_id.clone()).unwrap_or_default(),
        span_id: record.trace.as_ref().map(|t| t.span_id.clone()).unwrap_or_default(),
    }
}

/// Core exec stream event → proto. The record that ends a stream carries no output: it was
/// streamed before it.
pub fn exec_event(event: Result<ExecEvent, Error>) -> Result<Option<pb::ExecEvent>, Status> {
    let event = match event? {
        // `Vec::from` takes the bytes without a copy when the chunk is their only owner.
        ExecEvent::Output(OutputChunk::Stdout(b)) => pb::exec_event::Event::Stdout(Vec::from(b)),
        ExecEvent::Output(OutputChunk::Stderr(b)) => pb::exec_event::Event::Stderr(Vec::from(b)),
        ExecEvent::Ended(record) => pb::exec_event::Event::Result(exec_result(&record, false)),
        // ExecStream has no such event (only sessions report it).
        ExecEvent::Started(_) => return Ok(None),
    };
    Ok(Some(pb::ExecEvent { event: Some(event) }))
}

/// Core session event → proto.
pub fn session_event(event: Result<ExecEvent, Error>) -> Result<pb::ExecSessionEvent, Status> {
    use pb::exec_session_event::Event;
    let event = match event? {
        ExecEvent::Started(id) => Event::Started(pb::ExecStarted { exec_id: id.to_string() }),
        ExecEvent::Output(OutputChunk::Stdout(b)) => Event::Stdout(Vec::from(b)),
        ExecEvent::Output(OutputChunk::Stderr(b)) => Event::Stderr(Vec::from(b)),
        ExecEvent::Ended(record) => Event::Result(exec_result(&record, false)),
    };
    Ok(pb::ExecSessionEvent { event: Some(event) })
}

/// ListExecsRequest → core.
pub fn list_execs_query(r: pb::ListExecsRequest) -> ListExecsQuery {
    ListExecsQuery { sandbox_id: r.sandbox_id, limit: r.limit, page_token: r.page_token, page_size: r.page_size, include_output: r.include_output }
}

/// Core snapshot → proto.
pub fn snapshot(s: &SnapshotRecord) -> pb::SnapshotInfo {
    pb::SnapshotInfo {
        snapshot_id: s.snapshot_id.to_string(),
        sandbox_id: s.sandbox_id.to_string(),
        name: s.name.clone(),
        created_at: Some(timestamp(s.created_at)),
        size_bytes: s.size_bytes,
        parent_snapshot_id: s.parent_snapshot_id.as_ref().map(|p| p.to_string()).unwrap_or_default(),
        includes_memory: s.memory,
    }
}

/// Core image → proto.
pub fn image(r: &ImageRecord) -> pb::ImageInfo {
    pb::ImageInfo {
        name: r.name.clone(),
        digest: r.digest.clone(),
        size_bytes: r.size_bytes,
        created_at: Some(timestamp(r.created_at)),
        source: r.source.clone(),
        ready_tiers: r.ready_tiers.iter().map(|t| isolation_to_proto(*t) as i32).collect(),
        env: r.config.env.clone().into_iter().collect(),
        workdir: r.config.workdir.clone(),
        user: r.config.user.clone(),
        entrypoint: r.config.entrypoint.clone(),
        cmd: r.config.cmd.clone(),
        imported: r.imported,
        shared: r.shared,
        nodes: Vec::new(),
    }
}

/// Core image progress → proto.
pub fn image_progress(p: &ImageProgress) -> pb::ImageProgress {
    pb::ImageProgress {
        phase: p.phase.to_string(),
        message: p.message.clone(),
        bytes: p.bytes,
        total_bytes: p.total_bytes,
        count: p.count,
        total_count: p.total_count,
        done: p.done.as_deref().map(image),
    }
}

/// An egress event → proto.
pub fn network_event(e: &crate::egress::NetEvent) -> pb::NetworkEvent {
    pb::NetworkEvent {
        time: Some(timestamp(e.time)),
        kind: e.kind.to_string(),
        name: e.name.clone(),
        addr: e.addr.clone(),
        port: e.port.into(),
        allowed: e.allowed,
        rule: e.rule.clone(),
        detail: e.detail.clone(),
        bytes_out: e.bytes_out,
        bytes_in: e.bytes_in,
        duration_ms: e.duration_ms,
    }
}
