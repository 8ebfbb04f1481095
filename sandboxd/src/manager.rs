//! The core of the daemon: sandboxes and their lifecycle, limits, exec records, TTLs.
//!
//! The manager validates what a request asks for (ids, limits against the ceilings, argv, env),
//! picks the backend of the sandbox's tier, and keeps the records users read back. It never sees
//! gRPC: `api` turns messages into these calls and the results back into messages.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backends, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, FileChunk, Isolation, OutputSink, SandboxSpec};
use crate::config::{Config, Limits};
use crate::error::Error;
use crate::ids::{ExecId, SandboxId, SnapshotId};

/// Lifecycle of a sandbox. Transitions: Creating → Running | Failed; Running → Destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Creating,
    Running,
    Failed,
    Destroyed,
}

impl SandboxState {
    /// Whether execs and file operations are allowed.
    pub fn can_exec(self) -> bool {
        self == SandboxState::Running
    }
    /// Whether the sandbox may be destroyed now (a sandbox being created is not yet).
    pub fn can_destroy(self) -> bool {
        matches!(self, SandboxState::Running | SandboxState::Failed)
    }
}

/// Limits as a request gives them: 0 means "the default".
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestedLimits {
    pub cpu_millicores: u32,
    pub memory_bytes: u64,
    pub max_pids: u32,
    pub disk_bytes: u64,
    pub exec_timeout_ms: u64,
}

/// A CreateSandbox call.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// None = the policy's default.
    pub isolation: Option<Isolation>,
    pub image: String,
    pub limits: RequestedLimits,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub labels: BTreeMap<String, String>,
    pub ttl_seconds: u32,
    pub from_snapshot_id: String,
}

/// What a sandbox is, as users read it back.
#[derive(Debug, Clone)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub isolation: Isolation,
    pub image: String,
    pub state: SandboxState,
    pub limits: Limits,
    pub labels: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub created_at: SystemTime,
    pub workdir: String,
    pub parent_snapshot_id: Option<SnapshotId>,
    pub expires_at: Option<SystemTime>,
}

/// An Exec call.
#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    pub sandbox_id: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub stdin: Vec<u8>,
    pub timeout_ms: u64,
    pub max_output_bytes: u64,
    pub idempotency_key: String,
    pub background: bool,
}

/// The record of one exec: what ran and how it ended (status Running until it does).
#[derive(Debug, Clone)]
pub struct ExecRecord {
    pub exec_id: ExecId,
    pub sandbox_id: SandboxId,
    pub argv: Vec<String>,
    pub idempotency_key: String,
    pub status: ExecStatus,
    pub exit_code: i32,
    pub signal: i32,
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
    pub started_at: SystemTime,
    pub duration: Duration,
    pub usage: ExecUsage,
    pub error: String,
}

impl ExecRecord {
    fn running(exec_id: ExecId, sandbox_id: SandboxId, argv: Vec<String>, idempotency_key: String) -> Self {
        ExecRecord {
            exec_id,
            sandbox_id,
            argv,
            idempotency_key,
            status: ExecStatus::Running,
            exit_code: 0,
            signal: 0,
            stdout: CapturedOutput::default(),
            stderr: CapturedOutput::default(),
            started_at: SystemTime::now(),
            duration: Duration::ZERO,
            usage: ExecUsage::default(),
            error: String::new(),
        }
    }

    fn finish(&mut self, o: ExecOutcome) {
        self.status = o.status;
        self.exit_code = o.exit_code;
        self.signal = o.signal;
        self.stdout = o.stdout;
        self.stderr = o.stderr;
        self.started_at = o.started_at;
        self.duration = o.duration;
        self.usage = o.usage;
        self.error = o.error;
    }
}

/// A live or finished exec: its record, a signal when it ends, and the way to stop it.
struct ExecEntry {
    record: Mutex<ExecRecord>,
    done: watch::Receiver<bool>,
    cancel: CancellationToken,
}

impl ExecEntry {
    fn snapshot(&self) -> Result<ExecRecord, Error> {
        self.record.lock().map(|r| r.clone()).map_err(|_| Error::Internal("exec record poisoned".into()))
    }

    async fn wait(&self) -> Result<ExecRecord, Error> {
        let mut done = self.done.clone();
        // An Err means the sender is gone, which only happens after it sent `true`.
        let _ = done.wait_for(|d| *d).await;
        self.snapshot()
    }
}

struct SandboxEntry {
    info: Mutex<SandboxInfo>,
    /// Exec records, oldest first, bounded by `exec.max_records_per_sandbox`.
    execs: Mutex<VecDeque<Arc<ExecEntry>>>,
    by_key: Mutex<HashMap<String, Arc<ExecEntry>>>,
}

impl SandboxEntry {
    fn info(&self) -> Result<SandboxInfo, Error> {
        self.info.lock().map(|i| i.clone()).map_err(|_| Error::Internal("sandbox record poisoned".into()))
    }

    fn set_state(&self, state: SandboxState) {
        if let Ok(mut i) = self.info.lock() {
            i.state = state;
        }
    }
}

/// The daemon's core.
pub struct Manager {
    cfg: Arc<Config>,
    backends: Backends,
    sandboxes: RwLock<HashMap<SandboxId, Arc<SandboxEntry>>>,
    execs: RwLock<HashMap<ExecId, Arc<ExecEntry>>>,
}

fn resolve_limit<T: Copy + PartialOrd + Default + Into<u64>>(field: &str, requested: T, default: T, max: T) -> Result<T, Error> {
    if requested == T::default() {
        return Ok(default);
    }
    if requested > max {
        return Err(Error::invalid(
            format!("limits.{field}"),
            format!("{} is above the configured ceiling {}", requested.into(), max.into()),
        ));
    }
    Ok(requested)
}

fn validate_env(field: &str, env: &BTreeMap<String, String>) -> Result<(), Error> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(Error::invalid(field, format!("bad variable {:?}: names must be non-empty without '=' or NUL", k.chars().take(64).collect::<String>())));
        }
    }
    Ok(())
}

fn validate_abs_path(field: &str, path: &str) -> Result<(), Error> {
    if !path.starts_with('/') || path.contains('\0') || path.split('/').any(|c| c == "..") {
        return Err(Error::invalid(field, format!("{path:?} must be an absolute path without '..'")));
    }
    Ok(())
}

impl Manager {
    /// A manager over the given backends.
    pub fn new(cfg: Arc<Config>, backends: Backends) -> Arc<Self> {
        Arc::new(Manager { cfg, backends, sandboxes: RwLock::new(HashMap::new()), execs: RwLock::new(HashMap::new()) })
    }

    /// Availability of each tier.
    pub fn tiers(&self) -> Vec<(Isolation, Result<(), String>)> {
        self.backends.availability()
    }

    fn entry(&self, id: &str) -> Result<(SandboxId, Arc<SandboxEntry>), Error> {
        let sid = SandboxId::parse(id).map_err(|_| Error::SandboxNotFound(id.chars().take(80).collect()))?;
        let map = self.sandboxes.read().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
        let entry = map.get(&sid).cloned().ok_or_else(|| Error::SandboxNotFound(sid.to_string()))?;
        Ok((sid, entry))
    }

    fn resolve_limits(&self, r: &RequestedLimits) -> Result<Limits, Error> {
        let (d, m) = (&self.cfg.limits.default, &self.cfg.limits.max);
        Ok(Limits {
            cpu_millicores: resolve_limit("cpu_millicores", r.cpu_millicores, d.cpu_millicores, m.cpu_millicores)?,
            memory_bytes: resolve_limit("memory_bytes", r.memory_bytes, d.memory_bytes, m.memory_bytes)?,
            max_pids: resolve_limit("max_pids", r.max_pids, d.max_pids, m.max_pids)?,
            disk_bytes: resolve_limit("disk_bytes", r.disk_bytes, d.disk_bytes, m.disk_bytes)?,
            exec_timeout_ms: resolve_limit("exec_timeout_ms", r.exec_timeout_ms, d.exec_timeout_ms, m.exec_timeout_ms)?,
        })
    }

    /// Creates a sandbox and returns when it is ready to exec.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxInfo, Error> {
        let isolation = req.isolation.unwrap_or(Isolation::Process);
        let limits = self.resolve_limits(&req.limits)?;
        if limits.memory_bytes < 4 << 20 {
            return Err(Error::invalid("limits.memory_bytes", "must be at least 4 MiB"));
        }
        let image = if req.image.is_empty() { "minimal".to_string() } else { req.image };
        let workdir = if req.workdir.is_empty() { "/workspace".to_string() } else { req.workdir };
        validate_abs_path("workdir", &workdir)?;
        validate_env("env", &req.env)?;
        for (k, v) in &req.labels {
            if k.is_empty() || k.len() > 128 || v.len() > 1024 {
                return Err(Error::invalid("labels", format!("label {k:?}: keys are 1-128 bytes, values at most 1024")));
            }
        }
        let from_snapshot = if req.from_snapshot_id.is_empty() {
            None
        } else {
            Some(SnapshotId::parse(&req.from_snapshot_id).map_err(|_| Error::SnapshotNotFound(req.from_snapshot_id.clone()))?)
        };
        let backend = self.backends.get(isolation)?.clone();

        let id = SandboxId::generate();
        let now = SystemTime::now();
        let info = SandboxInfo {
            id: id.clone(),
            isolation,
            image: image.clone(),
            state: SandboxState::Creating,
            limits,
            labels: req.labels,
            env: req.env,
            created_at: now,
            workdir: workdir.clone(),
            parent_snapshot_id: from_snapshot.clone(),
            expires_at: (req.ttl_seconds > 0).then(|| now + Duration::from_secs(req.ttl_seconds.into())),
        };
        let entry = Arc::new(SandboxEntry { info: Mutex::new(info), execs: Mutex::new(VecDeque::new()), by_key: Mutex::new(HashMap::new()) });
        self.sandboxes.write().map_err(|_| Error::Internal("sandbox table poisoned".into()))?.insert(id.clone(), entry.clone());

        let spec = SandboxSpec { id: id.clone(), image, limits, workdir, from_snapshot };
        let started = std::time::Instant::now();
        match backend.create(&spec).await {
            Ok(()) => {
                entry.set_state(SandboxState::Running);
                tracing::info!(sandbox = %id, tier = isolation.name(), ms = started.elapsed().as_millis() as u64, "sandbox created");
                entry.info()
            }
            Err(e) => {
                // A failed create leaves nothing behind: the backend undid its part, and the
                // record goes too, so the id does not linger as a FAILED sandbox nobody owns.
                if let Ok(mut map) = self.sandboxes.write() {
                    map.remove(&id);
                }
                tracing::warn!(sandbox = %id, error = %e, "sandbox create failed");
                Err(e.into())
            }
        }
    }

    /// The sandbox's current description.
    pub fn get(&self, id: &str) -> Result<SandboxInfo, Error> {
        self.entry(id)?.1.info()
    }

    /// Sandboxes whose labels include every pair of `selector`.
    pub fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<SandboxInfo>, Error> {
        let map = self.sandboxes.read().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
        let mut out: Vec<SandboxInfo> = map
            .values()
            .filter_map(|e| e.info().ok())
            .filter(|i| selector.iter().all(|(k, v)| i.labels.get(k) == Some(v)))
            .collect();
        out.sort_by(|a, b| a.created_at.cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    /// Destroys a sandbox: every process, mount, cgroup and record goes.
    pub async fn destroy(&self, id: &str) -> Result<(), Error> {
        let (sid, entry) = self.entry(id)?;
        let info = entry.info()?;
        if !info.state.can_destroy() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "destroy" });
        }
        // Removed from the table first, so no new exec can start while it is taken apart.
        if let Ok(mut map) = self.sandboxes.write() {
            map.remove(&sid);
        }
        entry.set_state(SandboxState::Destroyed);
        let backend = self.backends.get(info.isolation)?.clone();
        let result = backend.destroy(&sid).await;
        let execs: Vec<Arc<ExecEntry>> = entry.execs.lock().map(|e| e.iter().cloned().collect()).unwrap_or_default();
        if let Ok(mut index) = self.execs.write() {
            for e in &execs {
                if let Ok(r) = e.record.lock() {
                    index.remove(&r.exec_id);
                }
            }
        }
        tracing::info!(sandbox = %sid, "sandbox destroyed");
        result.map_err(Error::from)
    }

    /// Validates an exec request against its sandbox and resolves every default.
    fn exec_spec(&self, info: &SandboxInfo, req: &ExecRequest, exec_id: ExecId) -> Result<ExecSpec, Error> {
        if req.argv.is_empty() {
            return Err(Error::invalid("argv", "must not be empty"));
        }
        if req.argv[0].is_empty() {
            return Err(Error::invalid("argv", "argv[0] must not be empty"));
        }
        if req.argv.iter().any(|a| a.contains('\0')) {
            return Err(Error::invalid("argv", "arguments must not contain NUL bytes"));
        }
        validate_env("env", &req.env)?;
        let workdir = if req.workdir.is_empty() { info.workdir.clone() } else { req.workdir.clone() };
        validate_abs_path("workdir", &workdir)?;
        let timeout_ms = if req.timeout_ms == 0 { info.limits.exec_timeout_ms } else { req.timeout_ms };
        if timeout_ms > self.cfg.limits.max.exec_timeout_ms {
            return Err(Error::invalid("timeout_ms", format!("{timeout_ms} is above the configured ceiling {}", self.cfg.limits.max.exec_timeout_ms)));
        }
        let max_output = if req.max_output_bytes == 0 { self.cfg.exec.default_max_output_bytes } else { req.max_output_bytes };
        if max_output > self.cfg.exec.max_output_bytes_ceiling {
            return Err(Error::invalid(
                "max_output_bytes",
                format!("{max_output} is above the configured ceiling {}", self.cfg.exec.max_output_bytes_ceiling),
            ));
        }
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
        env.insert("HOME".into(), "/root".into());
        env.insert("HOSTNAME".into(), info.id.to_string());
        env.extend(info.env.clone());
        env.extend(req.env.clone());
        let size: usize = req.argv.iter().map(|a| a.len() + 1).sum::<usize>() + env.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>();
        if size > 256 << 10 {
            return Err(Error::invalid("argv", format!("argv and env together are {size} bytes; the limit is 256 KiB (pass large data on stdin or as a file)")));
        }
        Ok(ExecSpec {
            exec_id,
            argv: req.argv.clone(),
            env: env.into_iter().collect(),
            workdir,
            stdin: req.stdin.clone(),
            timeout: Duration::from_millis(timeout_ms),
            max_output_bytes: max_output,
            io_drain_timeout: Duration::from_millis(self.cfg.exec.io_drain_timeout_ms),
        })
    }

    /// Runs a command. Foreground execs return when it ends; background ones at once with status
    /// Running. A repeated idempotency key returns the first exec's record (waiting for it if it
    /// still runs) instead of running again. `sink` receives output as it is produced.
    ///
    /// Dropping the returned future (a client that went away) kills a foreground exec without an
    /// idempotency key; one with a key runs on so its result can be collected later.
    pub async fn exec(&self, req: ExecRequest, sink: OutputSink) -> Result<ExecRecord, Error> {
        let (sid, entry) = self.entry(&req.sandbox_id)?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "exec" });
        }
        if !req.idempotency_key.is_empty() {
            let existing = entry.by_key.lock().ok().and_then(|m| m.get(&req.idempotency_key).cloned());
            if let Some(existing) = existing {
                tracing::debug!(sandbox = %sid, key = %req.idempotency_key, "idempotent replay");
                return if req.background { existing.snapshot() } else { existing.wait().await };
            }
        }
        let exec_id = ExecId::generate();
        let spec = self.exec_spec(&info, &req, exec_id.clone())?;
        let backend = self.backends.get(info.isolation)?.clone();

        let (done_tx, done_rx) = watch::channel(false);
        let cancel = CancellationToken::new();
        let exec = Arc::new(ExecEntry {
            record: Mutex::new(ExecRecord::running(exec_id.clone(), sid.clone(), req.argv.clone(), req.idempotency_key.clone())),
            done: done_rx,
            cancel: cancel.clone(),
        });
        self.remember(&entry, &exec, &req.idempotency_key)?;

        let task_exec = exec.clone();
        let task_sid = sid.clone();
        tokio::spawn(async move {
            let started_at = SystemTime::now();
            let outcome = match backend.exec(&task_sid, spec, sink, cancel).await {
                Ok(o) => o,
                Err(e) => ExecOutcome::failed(ExecStatus::Lost, -1, e.to_string(), started_at),
            };
            if let Ok(mut r) = task_exec.record.lock() {
                r.finish(outcome);
                tracing::debug!(exec = %r.exec_id, status = ?r.status, code = r.exit_code, ms = r.duration.as_millis() as u64, "exec ended");
            }
            let _ = done_tx.send(true);
        });

        if req.background {
            return exec.snapshot();
        }
        // Kill on disconnect: this guard fires if the caller's future is dropped before the end.
        let guard = (req.idempotency_key.is_empty()).then(|| exec.cancel.clone().drop_guard());
        let record = exec.wait().await;
        if let Some(g) = guard {
            g.disarm();
        }
        record
    }

    fn remember(&self, entry: &SandboxEntry, exec: &Arc<ExecEntry>, key: &str) -> Result<(), Error> {
        let exec_id = exec.snapshot()?.exec_id;
        let evicted = {
            let mut list = entry.execs.lock().map_err(|_| Error::Internal("exec list poisoned".into()))?;
            list.push_back(exec.clone());
            let mut evicted = Vec::new();
            while list.len() > self.cfg.exec.max_records_per_sandbox {
                // Only finished records are dropped; a long-running exec keeps its place.
                match list.iter().position(|e| e.done.borrow().to_owned()) {
                    Some(i) => evicted.extend(list.remove(i)),
                    None => break,
                }
            }
            evicted
        };
        let mut index = self.execs.write().map_err(|_| Error::Internal("exec index poisoned".into()))?;
        index.insert(exec_id, exec.clone());
        for e in &evicted {
            if let Ok(r) = e.record.lock() {
                index.remove(&r.exec_id);
            }
        }
        if !key.is_empty() {
            if let Ok(mut by_key) = entry.by_key.lock() {
                by_key.insert(key.to_string(), exec.clone());
            }
        }
        Ok(())
    }

    fn exec_entry(&self, exec_id: &str) -> Result<Arc<ExecEntry>, Error> {
        let eid = ExecId::parse(exec_id).map_err(|_| Error::ExecNotFound(exec_id.chars().take(80).collect()))?;
        let index = self.execs.read().map_err(|_| Error::Internal("exec index poisoned".into()))?;
        index.get(&eid).cloned().ok_or_else(|| Error::ExecNotFound(eid.to_string()))
    }

    /// A recorded exec; with `wait`, once it has ended.
    pub async fn get_exec(&self, exec_id: &str, wait: bool) -> Result<ExecRecord, Error> {
        let exec = self.exec_entry(exec_id)?;
        if wait {
            exec.wait().await
        } else {
            exec.snapshot()
        }
    }

    /// Sends a signal to every process of a running exec.
    pub async fn signal_exec(&self, exec_id: &str, signal: i32) -> Result<(), Error> {
        if !(1..=64).contains(&signal) {
            return Err(Error::invalid("signal", format!("{signal} is not a signal number (1-64)")));
        }
        let exec = self.exec_entry(exec_id)?;
        let record = exec.snapshot()?;
        if record.status != ExecStatus::Running {
            return Err(Error::FailedPrecondition(format!("exec {exec_id} has already ended")));
        }
        let info = self.get(record.sandbox_id.as_str())?;
        let backend = self.backends.get(info.isolation)?.clone();
        backend.signal_exec(&record.sandbox_id, &record.exec_id, signal).await?;
        Ok(())
    }

    /// The sandbox's exec records, oldest first; `limit` > 0 keeps the newest `limit`.
    pub fn list_execs(&self, sandbox_id: &str, limit: u32) -> Result<Vec<ExecRecord>, Error> {
        let (_, entry) = self.entry(sandbox_id)?;
        let list = entry.execs.lock().map_err(|_| Error::Internal("exec list poisoned".into()))?;
        let skip = if limit == 0 { 0 } else { list.len().saturating_sub(limit as usize) };
        list.iter().skip(skip).map(|e| e.snapshot()).collect()
    }

    fn running_entry(&self, sandbox_id: &str, op: &'static str) -> Result<(SandboxId, SandboxInfo), Error> {
        let (sid, entry) = self.entry(sandbox_id)?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: op });
        }
        Ok((sid, info))
    }

    /// Writes a file inside the sandbox.
    pub async fn write_file(&self, sandbox_id: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, Error> {
        let (sid, info) = self.running_entry(sandbox_id, "write files")?;
        if mode > 0o7777 {
            return Err(Error::invalid("mode", format!("{mode:o} is not a permission mode")));
        }
        Ok(self.backends.get(info.isolation)?.write_file(&sid, path, content, mode).await?)
    }

    /// Reads part of a file inside the sandbox.
    pub async fn read_file(&self, sandbox_id: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, Error> {
        let (sid, info) = self.running_entry(sandbox_id, "read files")?;
        Ok(self.backends.get(info.isolation)?.read_file(&sid, path, offset, limit).await?)
    }

    /// Destroys sandboxes whose TTL has passed. Called periodically.
    pub async fn reap_expired(&self) {
        let now = SystemTime::now();
        let expired: Vec<SandboxId> = match self.sandboxes.read() {
            Ok(map) => map
                .iter()
                .filter_map(|(id, e)| e.info().ok().filter(|i| i.state.can_destroy() && i.expires_at.is_some_and(|t| t <= now)).map(|_| id.clone()))
                .collect(),
            Err(_) => return,
        };
        for id in expired {
            tracing::info!(sandbox = %id, "TTL expired; destroying");
            if let Err(e) = self.destroy(id.as_str()).await {
                tracing::warn!(sandbox = %id, error = %e, "TTL reap failed");
            }
        }
    }

    /// Destroys every sandbox this daemon created, then lets each backend release its resources.
    pub async fn shutdown(&self) {
        let ids: Vec<SandboxId> = self.sandboxes.read().map(|m| m.keys().cloned().collect()).unwrap_or_default();
        for id in ids {
            if let Err(e) = self.destroy(id.as_str()).await {
                tracing::warn!(sandbox = %id, error = %e, "destroy at shutdown failed");
            }
        }
        for backend in self.backends.all() {
            backend.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_default_and_ceiling() {
        assert_eq!(resolve_limit("max_pids", 0u32, 10, 100).ok(), Some(10));
        assert_eq!(resolve_limit("max_pids", 50u32, 10, 100).ok(), Some(50));
        let err = resolve_limit("memory_bytes", 1u64 << 40, 1, 1 << 30).expect_err("over ceiling");
        assert!(err.to_string().contains("limits.memory_bytes"), "{err}");
    }

    #[test]
    fn lifecycle_checks() {
        assert!(SandboxState::Running.can_exec());
        assert!(!SandboxState::Creating.can_exec());
        assert!(!SandboxState::Creating.can_destroy());
        assert!(SandboxState::Failed.can_destroy());
    }

    #[test]
    fn env_and_paths_are_validated() {
        let mut env = BTreeMap::new();
        env.insert("A=B".to_string(), "x".to_string());
        assert!(validate_env("env", &env).is_err());
        assert!(validate_abs_path("workdir", "relative").is_err());
        assert!(validate_abs_path("workdir", "/a/../b").is_err());
        assert!(validate_abs_path("workdir", "/workspace/x").is_ok());
    }
}
