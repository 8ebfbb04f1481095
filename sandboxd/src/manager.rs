//! The core of the daemon: sandboxes and their lifecycle, limits, exec records, TTLs.
//!
//! The manager validates what a request asks for (ids, limits against the ceilings, argv, env),
//! picks the backend of the sandbox's tier, and keeps the records users read back. It never sees
//! gRPC: `api` turns messages into these calls and the results back into messages.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::admission::{human_bytes, DiskPools, ExecSlot, ExecSlots};
use crate::backend::{Backends, ExecSpec, OutputSink, SandboxSpec};
use crate::config::Config;
use crate::error::Error;
use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::metrics::{Metrics, Op};
use crate::model::{
    CreateRequest, ExecList, ExecOutcome, ExecRecord, ExecRequest, ExecStatus, FileChunk, Isolation, Limits, ListExecsQuery, RequestedLimits, SandboxInfo, SandboxState, SnapshotRecord,
    MAX_EXECS_PAGE_BYTES, MAX_EXECS_PAGE_SIZE,
};
use crate::store::{PageQuery, PageToken, Retention, Store, Trimmed};

/// A running exec: its record, a signal when it ends, and the way to stop it. Finished execs
/// live in the store only, so the daemon's memory does not grow with history.
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
    /// Serializes the operations that change the whole sandbox (snapshot, rollback, destroy).
    op: tokio::sync::Mutex<()>,
}

impl SandboxEntry {
    fn new(info: SandboxInfo) -> Arc<Self> {
        Arc::new(SandboxEntry { info: Mutex::new(info), op: tokio::sync::Mutex::new(()) })
    }

    fn info(&self) -> Result<SandboxInfo, Error> {
        self.read(SandboxInfo::clone)
    }

    /// Reads part of the record without cloning the whole of it (labels, env).
    fn read<T>(&self, f: impl FnOnce(&SandboxInfo) -> T) -> Result<T, Error> {
        self.info.lock().map(|i| f(&i)).map_err(|_| Error::Internal("sandbox record poisoned".into()))
    }

    fn update(&self, f: impl FnOnce(&mut SandboxInfo)) -> Result<SandboxInfo, Error> {
        let mut info = self.info.lock().map_err(|_| Error::Internal("sandbox record poisoned".into()))?;
        f(&mut info);
        Ok(info.clone())
    }
}

/// Execs in flight, by id and by idempotency key.
#[derive(Default)]
struct Running {
    by_id: HashMap<ExecId, Arc<ExecEntry>>,
    by_key: HashMap<(SandboxId, String), Arc<ExecEntry>>,
}

/// The daemon's core.
pub struct Manager {
    cfg: Arc<Config>,
    backends: Backends,
    store: Store,
    metrics: Arc<Metrics>,
    sandboxes: RwLock<HashMap<SandboxId, Arc<SandboxEntry>>>,
    running: Mutex<Running>,
    /// The storage pools `disk_bytes` are promised from (see `admission`).
    disk_pools: DiskPools,
    /// Execs running now per sandbox and tenant, against the policy's exec caps.
    exec_slots: Arc<Mutex<ExecSlots>>,
}

/// What the backend needs to (re)build a sandbox.
fn spec_of(info: &SandboxInfo) -> SandboxSpec {
    SandboxSpec {
        id: info.id.clone(),
        image: info.image.clone(),
        limits: info.limits,
        workdir: info.workdir.clone(),
        from_snapshot: info.parent_snapshot_id.clone(),
    }
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

/// What argv and env of one exec may take together (the kernel allows more, but this keeps a
/// request's command line a command line: large data goes on stdin or in a file).
const MAX_ARGV_ENV_BYTES: usize = 256 << 10;
/// The kernel's MAX_ARG_STRLEN: one argument or `NAME=value` string (with its NUL) longer than
/// this makes execve fail with E2BIG.
const MAX_ARG_STRLEN: usize = 32 * 4096;
/// Room a sandbox's env must leave within [`MAX_ARGV_ENV_BYTES`] for the argv of its execs.
const ARGV_ROOM_BYTES: usize = 4 << 10;
/// Longest workdir (the kernel's PATH_MAX, with its NUL) and path component (NAME_MAX).
const PATH_MAX: usize = 4095;
const NAME_MAX: usize = 255;
/// Bounds of labels: they are stored with the sandbox and matched on every ListSandboxes.
const MAX_LABELS: usize = 64;
const MAX_LABEL_KEY_BYTES: usize = 128;
const MAX_LABEL_VALUE_BYTES: usize = 1024;
/// Longest idempotency key (it is stored with the exec record and looked up by value).
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;

/// The variables every exec starts with, under the sandbox's and the request's own.
fn base_env(id: &SandboxId) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("PATH".to_string(), guest_agent::capture::DEFAULT_PATH.to_string()),
        ("HOME".to_string(), "/root".to_string()),
        ("HOSTNAME".to_string(), id.to_string()),
    ])
}

/// Bytes an environment takes in an exec's argv+env budget (`NAME=value\0` each).
fn env_bytes<'a>(env: impl IntoIterator<Item = (&'a String, &'a String)>) -> usize {
    env.into_iter().map(|(k, v)| k.len() + v.len() + 2).sum()
}

fn validate_env(field: &str, env: &BTreeMap<String, String>) -> Result<(), Error> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(Error::invalid(field, format!("bad variable {:?}: names must be non-empty without '=' or NUL", k.chars().take(64).collect::<String>())));
        }
        if k.len() + v.len() + 2 > MAX_ARG_STRLEN {
            return Err(Error::invalid(
                field,
                format!("variable {:?} is {} bytes; one variable may take at most {MAX_ARG_STRLEN} (execve refuses longer)", k.chars().take(64).collect::<String>(), k.len() + v.len() + 2),
            ));
        }
    }
    Ok(())
}

fn validate_abs_path(field: &str, path: &str) -> Result<(), Error> {
    if !path.starts_with('/') || path.contains('\0') || path.split('/').any(|c| c == "..") {
        return Err(Error::invalid(field, format!("{:?} must be an absolute path without '..'", path.chars().take(256).collect::<String>())));
    }
    if path.len() > PATH_MAX || path.split('/').any(|c| c.len() > NAME_MAX) {
        return Err(Error::invalid(field, format!("path of {} bytes: at most {PATH_MAX} bytes, {NAME_MAX} per component", path.len())));
    }
    Ok(())
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), Error> {
    if labels.len() > MAX_LABELS {
        return Err(Error::invalid("labels", format!("{} labels; at most {MAX_LABELS}", labels.len())));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty() && k.len() <= MAX_LABEL_KEY_BYTES && !k.chars().any(char::is_control);
        if !key_ok || v.len() > MAX_LABEL_VALUE_BYTES || v.contains('\0') {
            return Err(Error::invalid(
                "labels",
                format!(
                    "label {:?}: keys are 1-{MAX_LABEL_KEY_BYTES} bytes without control characters, values at most {MAX_LABEL_VALUE_BYTES} bytes without NUL",
                    k.chars().take(64).collect::<String>()
                ),
            ));
        }
    }
    Ok(())
}

/// Image names are directory names under the images dir: no path, nothing hidden.
fn validate_image(image: &str) -> Result<(), Error> {
    if !crate::backend::is_image_name(image) {
        return Err(Error::invalid(
            "image",
            format!("{:?}: 1-{} of [A-Za-z0-9._-], not starting with '.'", image.chars().take(80).collect::<String>(), crate::backend::MAX_IMAGE_NAME_BYTES),
        ));
    }
    Ok(())
}

/// Refuses limits below [`Limits::MINIMUMS`]: a sandbox with them could not run anything.
fn validate_minimums(limits: &Limits) -> Result<(), Error> {
    let m = Limits::MINIMUMS;
    if limits.memory_bytes < m.memory_bytes {
        return Err(Error::invalid("limits.memory_bytes", format!("{} is below the minimum {}", limits.memory_bytes, human_bytes(m.memory_bytes))));
    }
    if limits.max_pids < m.max_pids {
        return Err(Error::invalid("limits.max_pids", format!("{} is below the minimum {} (a shell running a pipeline needs that many)", limits.max_pids, m.max_pids)));
    }
    if limits.disk_bytes < m.disk_bytes {
        return Err(Error::invalid(
            "limits.disk_bytes",
            format!("{} is below the minimum {} (the writable layer must hold the sandbox's own files)", limits.disk_bytes, human_bytes(m.disk_bytes)),
        ));
    }
    Ok(())
}

impl Manager {
    /// A manager over the given backends and store. Call [`Manager::recover`] before serving.
    pub fn new(cfg: Arc<Config>, backends: Backends, store: Store, metrics: Arc<Metrics>) -> Arc<Self> {
        let disk_pools = DiskPools::from_config(&cfg);
        Arc::new(Manager {
            cfg,
            backends,
            store,
            metrics,
            sandboxes: RwLock::new(HashMap::new()),
            running: Mutex::new(Running::default()),
            disk_pools,
            exec_slots: Arc::new(Mutex::new(ExecSlots::default())),
        })
    }

    /// The metrics text, with the state gauges filled in.
    pub fn render_metrics(&self) -> String {
        let sandboxes: Vec<(Isolation, SandboxState)> = match self.sandboxes.read() {
            Ok(map) => map.values().filter_map(|e| e.info().ok()).map(|i| (i.isolation, i.state)).collect(),
            Err(_) => Vec::new(),
        };
        let tiers: Vec<(Isolation, bool)> = self.backends.availability().into_iter().map(|(t, r)| (t, r.is_ok())).collect();
        self.metrics.render(&sandboxes, &tiers)
    }

    /// Brings back what the store remembers: execs that were running are recorded as LOST (their
    /// processes died with the previous daemon), and every sandbox is re-adopted — filesystem, id,
    /// limits and labels kept, processes started afresh — or marked FAILED with the reason logged.
    pub async fn recover(&self) -> Result<(), Error> {
        let lost = self.store.mark_running_lost("the daemon stopped while the exec ran")?;
        if lost > 0 {
            tracing::warn!(count = lost, "execs running when the daemon stopped recorded as LOST");
        }
        let pruned = self.store.prune_orphans()?;
        if pruned > 0 {
            tracing::info!(count = pruned, "orphaned exec records and output files removed");
        }
        let records = self.store.sandboxes()?;
        let snapshots = self.store.snapshots(None)?;
        // A sandbox still being created when the daemon died was never handed to anyone.
        for info in records.iter().filter(|r| r.state == SandboxState::Creating) {
            self.store.delete_sandbox(info.id.as_str())?;
        }
        for tier in Isolation::ALL {
            let mine: Vec<SandboxInfo> = records.iter().filter(|r| r.isolation == tier && r.state != SandboxState::Creating).cloned().collect();
            let results: HashMap<SandboxId, Result<(), String>> = match self.backends.available(tier) {
                Ok(backend) => {
                    let specs: Vec<SandboxSpec> = mine.iter().filter(|i| i.state == SandboxState::Running).map(spec_of).collect();
                    let snaps: Vec<SnapshotId> = snapshots.iter().filter(|s| s.isolation == tier).map(|s| s.snapshot_id.clone()).collect();
                    backend.recover(&specs, &snaps).await.into_iter().map(|(id, r)| (id, r.map_err(|e| e.to_string()))).collect()
                }
                Err(e) => mine.iter().map(|i| (i.id.clone(), Err(e.to_string()))).collect(),
            };
            for mut info in mine {
                match results.get(&info.id) {
                    Some(Ok(())) => {
                        tracing::info!(sandbox = %info.id, "sandbox re-adopted");
                        info.state = SandboxState::Running;
                    }
                    Some(Err(reason)) => {
                        tracing::warn!(sandbox = %info.id, %reason, "sandbox could not be re-adopted; marked FAILED");
                        info.state = SandboxState::Failed;
                        info.failure_reason = Some(format!("could not be brought back after a daemon restart: {reason}"));
                    }
                    None => info.state = SandboxState::Failed,
                }
                self.store.put_sandbox(&info)?;
                let id = info.id.clone();
                self.sandboxes.write().map_err(|_| Error::Internal("sandbox table poisoned".into()))?.insert(id, SandboxEntry::new(info));
            }
        }
        Ok(())
    }

    /// Availability of each tier.
    pub fn tiers(&self) -> Vec<(Isolation, Result<(), String>)> {
        self.backends.availability()
    }

    /// The sandbox `id` if it belongs to `tenant`; another tenant's sandbox is NOT_FOUND, exactly
    /// like one that does not exist, so ids cannot be probed across tenants.
    fn entry(&self, tenant: &str, id: &str) -> Result<(SandboxId, Arc<SandboxEntry>), Error> {
        let sid = SandboxId::parse(id).map_err(|_| Error::SandboxNotFound(id.chars().take(80).collect()))?;
        let map = self.sandboxes.read().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
        let entry = map.get(&sid).cloned().ok_or_else(|| Error::SandboxNotFound(sid.to_string()))?;
        drop(map);
        if entry.read(|i| i.tenant != tenant)? {
            return Err(Error::SandboxNotFound(sid.to_string()));
        }
        self.note_failure(&entry);
        Ok((sid, entry))
    }

    /// Records a running sandbox whose backend reports it dead (its init or VM is gone) as FAILED
    /// with the reason, so it never shows `running` while nothing in it can run.
    fn note_failure(&self, entry: &SandboxEntry) {
        let Ok((id, isolation, state)) = entry.read(|i| (i.id.clone(), i.isolation, i.state)) else { return };
        if state != SandboxState::Running {
            return;
        }
        let Some(reason) = self.backends.get(isolation).ok().and_then(|b| b.failure(&id)) else { return };
        tracing::warn!(sandbox = %id, %reason, "sandbox failed");
        match entry.update(|i| {
            i.state = SandboxState::Failed;
            i.failure_reason = Some(reason);
        }) {
            Ok(updated) => {
                if let Err(e) = self.store.put_sandbox(&updated) {
                    tracing::error!(sandbox = %id, error = %e, "cannot record failed sandbox");
                }
            }
            Err(e) => tracing::error!(sandbox = %id, error = %e, "cannot mark sandbox failed"),
        }
    }

    fn resolve_limits(&self, r: &RequestedLimits, d: &Limits, m: &Limits) -> Result<Limits, Error> {
        Ok(Limits {
            cpu_millicores: resolve_limit("cpu_millicores", r.cpu_millicores, d.cpu_millicores, m.cpu_millicores)?,
            memory_bytes: resolve_limit("memory_bytes", r.memory_bytes, d.memory_bytes, m.memory_bytes)?,
            max_pids: resolve_limit("max_pids", r.max_pids, d.max_pids, m.max_pids)?,
            disk_bytes: resolve_limit("disk_bytes", r.disk_bytes, d.disk_bytes, m.disk_bytes)?,
            exec_timeout_ms: resolve_limit("exec_timeout_ms", r.exec_timeout_ms, d.exec_timeout_ms, m.exec_timeout_ms)?,
        })
    }

    fn snapshot_record(&self, tenant: &str, id: &str) -> Result<SnapshotRecord, Error> {
        let sid = SnapshotId::parse(id).map_err(|_| Error::SnapshotNotFound(id.chars().take(80).collect()))?;
        match self.store.snapshot(sid.as_str())? {
            Some(snap) if snap.tenant == tenant => Ok(snap),
            _ => Err(Error::SnapshotNotFound(sid.to_string())),
        }
    }

    /// Refuses a create past the configured capacity or the disk pool of `tier`, naming the
    /// limit. Called with the table's write lock held by the create that then inserts itself, so
    /// two concurrent creates never both take the last room.
    fn check_capacity(&self, map: &HashMap<SandboxId, Arc<SandboxEntry>>, tenant: &str, tier: Isolation, disk_bytes: u64) -> Result<(), Error> {
        if let Some(max) = self.cfg.policy.max_sandboxes() {
            if map.len() >= max {
                return Err(Error::ResourceExhausted(format!("policy.max_sandboxes ({max}) reached")));
            }
        }
        if let Some(max) = self.cfg.policy.max_sandboxes_per_tenant() {
            let mine = map.values().filter(|e| e.read(|i| i.tenant == tenant).unwrap_or(false)).count();
            if mine >= max {
                return Err(Error::ResourceExhausted(format!("policy.max_sandboxes_per_tenant ({max}) reached for tenant {tenant:?}")));
            }
        }
        // Every sandbox in the table holds its layer until destroyed (FAILED ones too), and a
        // fork or a rolled-back sandbox as much as one made from an image.
        let promised: u64 = map
            .values()
            .filter_map(|e| e.read(|i| (i.isolation, i.limits.disk_bytes)).ok())
            .filter(|(isolation, _)| self.disk_pools.same_pool(*isolation, tier))
            .map(|(_, disk_bytes)| disk_bytes)
            .fold(0, u64::saturating_add);
        self.disk_pools.admit(tier, promised, disk_bytes).map_err(Error::ResourceExhausted)
    }

    /// Logs each storage pool with what is promised from it (at start, after recovery: the
    /// re-adopted sandboxes count), warning when a smaller pool than last time is overcommitted.
    pub fn log_admission(&self) {
        let infos: Vec<SandboxInfo> = match self.sandboxes.read() {
            Ok(map) => map.values().filter_map(|e| e.info().ok()).collect(),
            Err(_) => return,
        };
        for (pool, tiers) in self.disk_pools.pools() {
            let Some(&first) = tiers.first() else { continue };
            let mine: Vec<&SandboxInfo> = infos.iter().filter(|i| self.disk_pools.same_pool(i.isolation, first)).collect();
            let promised = mine.iter().map(|i| i.limits.disk_bytes).fold(0, u64::saturating_add);
            let names: Vec<&str> = tiers.iter().map(|t| t.name()).collect();
            let (capacity, promised_h) = (human_bytes(pool.capacity), human_bytes(promised));
            if promised > pool.capacity {
                tracing::warn!(tiers = ?names, key = %pool.key, capacity = %capacity, promised = %promised_h, sandboxes = mine.len(), "storage pool overcommitted by the sandboxes on record: creates on it are refused until enough are destroyed");
            } else {
                tracing::info!(tiers = ?names, key = %pool.key, capacity = %capacity, origin = %pool.origin, promised = %promised_h, sandboxes = mine.len(), "storage pool admission");
            }
        }
        let caps = self.cfg.policy.exec_caps();
        tracing::info!(
            running_per_sandbox = caps.running_per_sandbox,
            background_per_sandbox = caps.background_per_sandbox,
            running_per_tenant = caps.running_per_tenant,
            background_per_tenant = caps.background_per_tenant,
            "exec caps"
        );
    }

    /// Creates a sandbox (from an image, or from a snapshot: a fork) and returns when it is ready.
    #[tracing::instrument(name = "manager.create", skip_all)]
    pub async fn create(&self, tenant: &str, req: CreateRequest) -> Result<SandboxInfo, Error> {
        // Everything a request says is checked before anything is made: a sandbox in which
        // nothing could run (no room for a command line, no pids for a shell, no disk for its
        // own files) is refused here, naming the field, rather than failing later.
        let workdir = if req.workdir.is_empty() { "/workspace".to_string() } else { req.workdir };
        validate_abs_path("workdir", &workdir)?;
        // The sandbox's /proc, /dev and /sys are mounted over whatever the layer holds there, so
        // a workdir made below them would not exist once the sandbox runs.
        if let Some(top) = ["/proc", "/dev", "/sys"].into_iter().find(|m| workdir == *m || workdir.starts_with(&format!("{m}/"))) {
            return Err(Error::invalid("workdir", format!("{workdir:?} is under {top}, which the sandbox's own mount hides")));
        }
        validate_env("env", &req.env)?;
        let id = SandboxId::generate();
        let env_size = env_bytes(base_env(&id).iter().chain(req.env.iter()));
        if env_size + ARGV_ROOM_BYTES > MAX_ARGV_ENV_BYTES {
            return Err(Error::invalid(
                "env",
                format!(
                    "{env_size} bytes with the default variables; every exec's argv and env must fit in {} KiB, so the sandbox env may take at most {} bytes (pass large data as a file)",
                    MAX_ARGV_ENV_BYTES >> 10,
                    MAX_ARGV_ENV_BYTES - ARGV_ROOM_BYTES
                ),
            ));
        }
        validate_labels(&req.labels)?;
        // A fork inherits its tier and image from the snapshot: its layer only makes sense there.
        let (requested, image, from_snapshot) = if req.from_snapshot_id.is_empty() {
            let image = if req.image.is_empty() { "minimal".to_string() } else { req.image };
            validate_image(&image)?;
            (req.isolation, image, None)
        } else {
            let snap = self.snapshot_record(tenant, &req.from_snapshot_id)?;
            if req.isolation.is_some_and(|i| i != snap.isolation) {
                return Err(Error::invalid("isolation", format!("snapshot {} belongs to the {} tier", snap.snapshot_id, snap.isolation.name())));
            }
            if !req.image.is_empty() && req.image != snap.image {
                return Err(Error::invalid("image", format!("snapshot {} is of image {:?}", snap.snapshot_id, snap.image)));
            }
            (Some(snap.isolation), snap.image, Some(snap.snapshot_id))
        };
        let decision = self.cfg.policy.decide(requested, &req.labels).map_err(|e| Error::PermissionDenied(e.to_string()))?;
        if from_snapshot.is_some() && Some(decision.isolation) != requested {
            return Err(Error::PermissionDenied(format!("policy requires {} for this request; the snapshot belongs to another tier", decision.isolation.name())));
        }
        let isolation = decision.isolation;
        let limits = self.resolve_limits(&req.limits, &decision.defaults, &decision.ceilings)?;
        validate_minimums(&limits)?;
        // Never a weaker tier than decided: an unavailable tier is an error, not a fallback.
        let backend = self.backends.available(isolation)?.clone();

        let now = SystemTime::now();
        let info = SandboxInfo {
            id: id.clone(),
            tenant: tenant.to_string(),
            isolation,
            isolation_reason: decision.reason,
            image,
            state: SandboxState::Creating,
            limits,
            labels: req.labels,
            env: req.env,
            created_at: now,
            workdir,
            parent_snapshot_id: from_snapshot.clone(),
            expires_at: (req.ttl_seconds > 0).then(|| now + Duration::from_secs(req.ttl_seconds.into())),
            head_snapshot: from_snapshot,
            failure_reason: None,
        };
        let entry = SandboxEntry::new(info.clone());
        {
            // Admission and the claim in one critical section: once in the table, this
            // sandbox's disk_bytes count against its pool for every later create.
            let mut map = self.sandboxes.write().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
            if let Err(e) = self.check_capacity(&map, tenant, isolation, limits.disk_bytes) {
                tracing::info!(tenant, tier = isolation.name(), disk_bytes = limits.disk_bytes, reason = %e, "create refused");
                return Err(e);
            }
            map.insert(id.clone(), entry.clone());
        }
        if let Err(e) = self.store.put_sandbox(&info) {
            if let Ok(mut map) = self.sandboxes.write() {
                map.remove(&id);
            }
            return Err(e.into());
        }

        let started = std::time::Instant::now();
        match backend.create(&spec_of(&info)).await {
            Ok(()) => {
                let info = entry.update(|i| i.state = SandboxState::Running)?;
                self.store.put_sandbox(&info)?;
                self.metrics.observe(Op::Create, isolation, started.elapsed());
                tracing::info!(sandbox = %id, tier = isolation.name(), ms = started.elapsed().as_millis() as u64, "sandbox created");
                Ok(info)
            }
            Err(e) => {
                // A failed create leaves nothing behind: the backend undid its part, and the
                // record goes too, so the id does not linger as a FAILED sandbox nobody owns.
                if let Ok(mut map) = self.sandboxes.write() {
                    map.remove(&id);
                }
                self.store.delete_sandbox(id.as_str())?;
                tracing::warn!(sandbox = %id, error = %e, "sandbox create failed");
                // The only path a create hands its backend is the workdir (e.g. one under a file
                // of the image): name the request field.
                Err(match Error::from(e) {
                    Error::InvalidArgument { field, message } if field == "path" => Error::invalid("workdir", message),
                    e => e,
                })
            }
        }
    }

    /// The sandbox's current description.
    pub fn get(&self, tenant: &str, id: &str) -> Result<SandboxInfo, Error> {
        self.entry(tenant, id)?.1.info()
    }

    /// Sandboxes whose labels include every pair of `selector`.
    pub fn list(&self, tenant: &str, selector: &BTreeMap<String, String>) -> Result<Vec<SandboxInfo>, Error> {
        let map = self.sandboxes.read().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
        let mut out: Vec<SandboxInfo> = map
            .values()
            .filter_map(|e| {
                self.note_failure(e);
                e.info().ok()
            })
            .filter(|i| i.tenant == tenant && selector.iter().all(|(k, v)| i.labels.get(k) == Some(v)))
            .collect();
        out.sort_by(|a, b| a.created_at.cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    /// Destroys a sandbox: every process, mount, cgroup and exec record goes (snapshots stay).
    #[tracing::instrument(name = "manager.destroy", skip_all)]
    pub async fn destroy(&self, tenant: &str, id: &str) -> Result<(), Error> {
        let (sid, entry) = self.entry(tenant, id)?;
        let started = std::time::Instant::now();
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if !info.state.can_destroy() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "destroy" });
        }
        // Removed from the table first, so no new exec can start while it is taken apart.
        if let Ok(mut map) = self.sandboxes.write() {
            map.remove(&sid);
        }
        entry.update(|i| i.state = SandboxState::Destroyed)?;
        let result = match self.backends.get(info.isolation) {
            Ok(backend) => backend.destroy(&sid).await.map_err(Error::from),
            Err(e) => Err(e.into()),
        };
        // The backend killed its execs; once they have ended (and, the sandbox being out of the
        // table, recorded nothing) its records and output files can go for good.
        self.wait_for_execs_of(&sid, Duration::from_secs(5)).await;
        self.store.delete_sandbox(sid.as_str())?;
        self.metrics.observe(Op::Destroy, info.isolation, started.elapsed());
        tracing::info!(sandbox = %sid, "sandbox destroyed");
        match result {
            // A sandbox its backend no longer runs (a FAILED one) is gone all the same.
            Err(Error::SandboxNotFound(_)) => Ok(()),
            other => other,
        }
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
        if let Some((i, a)) = req.argv.iter().enumerate().find(|(_, a)| a.len() + 1 > MAX_ARG_STRLEN) {
            return Err(Error::invalid("argv", format!("argv[{i}] is {} bytes; one argument may take at most {MAX_ARG_STRLEN} (execve refuses longer)", a.len())));
        }
        validate_env("env", &req.env)?;
        if req.idempotency_key.len() > MAX_IDEMPOTENCY_KEY_BYTES || req.idempotency_key.contains('\0') {
            return Err(Error::invalid("idempotency_key", format!("{} bytes: at most {MAX_IDEMPOTENCY_KEY_BYTES}, without NUL", req.idempotency_key.len())));
        }
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
        let mut env = base_env(&info.id);
        env.extend(info.env.clone());
        env.extend(req.env.clone());
        let argv_size: usize = req.argv.iter().map(|a| a.len() + 1).sum();
        let size = argv_size + env_bytes(&env);
        if size > MAX_ARGV_ENV_BYTES {
            // Named after the part the request made large.
            let field = if env_bytes(&req.env) > argv_size { "env" } else { "argv" };
            return Err(Error::invalid(
                field,
                format!("argv and env together are {size} bytes; the limit is {} KiB (pass large data on stdin or as a file)", MAX_ARGV_ENV_BYTES >> 10),
            ));
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
    /// still runs) instead of running again — also after a daemon restart, from the store.
    /// `sink` receives output as it is produced.
    ///
    /// Dropping the returned future (a client that went away) kills a foreground exec without an
    /// idempotency key; one with a key runs on so its result can be collected later.
    #[tracing::instrument(name = "manager.exec", skip_all)]
    pub async fn exec(self: &Arc<Self>, tenant: &str, req: ExecRequest, sink: OutputSink) -> Result<ExecRecord, Error> {
        let (sid, entry) = self.entry(tenant, &req.sandbox_id)?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "exec" });
        }
        let exec_id = ExecId::generate();
        let spec = self.exec_spec(&info, &req, exec_id.clone())?;
        let backend = self.backends.get(info.isolation)?.clone();

        let (done_tx, done_rx) = watch::channel(false);
        let cancel = CancellationToken::new();
        let record = ExecRecord::running(exec_id.clone(), sid.clone(), req.argv.clone(), req.idempotency_key.clone());
        let exec = Arc::new(ExecEntry { record: Mutex::new(record.clone()), done: done_rx, cancel: cancel.clone() });
        let key = (!req.idempotency_key.is_empty()).then(|| (sid.clone(), req.idempotency_key.clone()));
        // The exec's claim on its sandbox's and tenant's exec slots, held by the task that runs
        // it until the process has ended.
        let mut slot: Option<ExecSlot> = None;
        // Check and claim the key under one lock, so two racing calls run the command once.
        let replay: Option<Arc<ExecEntry>> = {
            let mut running = self.running.lock().map_err(|_| Error::Internal("exec table poisoned".into()))?;
            match key.as_ref().and_then(|k| running.by_key.get(k).cloned()) {
                Some(existing) => Some(existing),
                None => {
                    if let Some(k) = &key {
                        if let Some(recorded) = self.store.exec_by_key(sid.as_str(), &k.1)? {
                            tracing::debug!(sandbox = %sid, key = %k.1, "idempotent replay from the record");
                            return Ok(recorded);
                        }
                        running.by_key.insert(k.clone(), exec.clone());
                    }
                    if let Some(max) = self.cfg.policy.max_concurrent_execs() {
                        if running.by_id.len() >= max {
                            if let Some(k) = &key {
                                running.by_key.remove(k);
                            }
                            return Err(Error::ResourceExhausted(format!("policy.max_concurrent_execs ({max}) reached")));
                        }
                    }
                    match ExecSlot::take(&self.exec_slots, &self.cfg.policy.exec_caps(), tenant, &sid, req.background) {
                        Ok(s) => slot = Some(s),
                        Err(reason) => {
                            if let Some(k) = &key {
                                running.by_key.remove(k);
                            }
                            tracing::info!(sandbox = %sid, tenant, background = req.background, %reason, "exec refused");
                            return Err(Error::ResourceExhausted(reason));
                        }
                    }
                    running.by_id.insert(exec_id.clone(), exec.clone());
                    // Recorded before it starts: a crash from here on leaves a LOST record.
                    if let Err(e) = self.store.put_exec(&record) {
                        running.by_id.remove(&exec_id);
                        if let Some(k) = &key {
                            running.by_key.remove(k);
                        }
                        return Err(e.into());
                    }
                    None
                }
            }
        };
        if let Some(existing) = replay {
            tracing::debug!(sandbox = %sid, "idempotent replay of a running exec");
            return if req.background { existing.snapshot() } else { existing.wait().await };
        }

        let manager = self.clone();
        let task_exec = exec.clone();
        let tier = info.isolation;
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let started_at = SystemTime::now();
            let outcome = match backend.exec(&sid, spec, sink, Some(started_tx), cancel).await {
                Ok(o) => o,
                Err(e) => ExecOutcome::failed(ExecStatus::Lost, -1, e.to_string(), started_at),
            };
            // The process has ended: its slot is free before anyone can see the end.
            drop(slot);
            let finished = task_exec.record.lock().map(|mut r| {
                r.outcome = outcome;
                r.clone()
            });
            if let Ok(r) = finished {
                manager.metrics.exec_ended(tier, r.outcome.status, r.outcome.duration);
                tracing::debug!(exec = %r.exec_id, status = ?r.outcome.status, code = r.outcome.exit_code, ms = r.outcome.duration.as_millis() as u64, "exec ended");
                manager.exec_finished(&r, key.as_ref());
            }
            let _ = done_tx.send(true);
        });

        if req.background {
            // Returned once the process runs, so a SignalExec right after reaches it; one that
            // could not start is returned with its final record.
            return match started_rx.await {
                Ok(()) => exec.snapshot(),
                Err(_) => exec.wait().await,
            };
        }
        // Kill on disconnect: this guard fires if the caller's future is dropped before the end.
        let guard = req.idempotency_key.is_empty().then(|| exec.cancel.clone().drop_guard());
        let record = exec.wait().await;
        if let Some(g) = guard {
            g.disarm();
        }
        record
    }

    /// Persists an ended exec and applies the sandbox's record retention, then drops it from the
    /// in-flight tables (in that order, so an idempotent retry always finds it in one place or
    /// the other). An exec whose sandbox is being destroyed is not recorded: its records are
    /// about to go, and writing them now would leave orphans behind.
    fn exec_finished(&self, record: &ExecRecord, key: Option<&(SandboxId, String)>) {
        let live = self.sandboxes.read().ok().and_then(|m| m.get(&record.sandbox_id).and_then(|e| e.read(|i| (i.isolation, i.state)).ok()));
        if let Some((isolation, state)) = live {
            if let Err(e) = self.store.put_exec(record) {
                tracing::error!(exec = %record.exec_id, error = %e, "cannot record exec result");
            }
            let retention = Retention {
                max_records: self.cfg.exec.max_records_per_sandbox,
                max_output_bytes: self.cfg.exec.max_output_storage_bytes_per_sandbox,
            };
            match self.store.trim_execs(record.sandbox_id.as_str(), retention) {
                Ok(trimmed) if state.can_exec() => self.remove_spill_files(&record.sandbox_id, isolation, trimmed),
                Ok(_) => {}
                Err(e) => tracing::warn!(sandbox = %record.sandbox_id, error = %e, "cannot trim exec records"),
            }
        }
        if let Ok(mut running) = self.running.lock() {
            running.by_id.remove(&record.exec_id);
            if let Some(key) = key {
                running.by_key.remove(key);
            }
        }
    }

    /// Removes, in the background, the spill files inside the sandbox of records trimmed from the
    /// store: they count against the sandbox's disk quota and nothing names them any more. Best
    /// effort: a failure is logged, and never holds up the end of the exec that caused the trim.
    fn remove_spill_files(&self, sandbox: &SandboxId, isolation: Isolation, trimmed: Vec<Trimmed>) {
        let paths: Vec<String> = trimmed.into_iter().flat_map(|t| t.spill_paths).collect();
        if paths.is_empty() {
            return;
        }
        let Ok(backend) = self.backends.get(isolation).cloned() else { return };
        let sid = sandbox.clone();
        tokio::spawn(async move {
            for path in paths {
                if let Err(e) = backend.remove_file(&sid, &path).await {
                    tracing::warn!(sandbox = %sid, %path, error = %e, "cannot remove the spill file of a trimmed exec record");
                }
            }
        });
    }

    /// Waits, up to `timeout` in all, for the in-flight execs of a sandbox to end.
    async fn wait_for_execs_of(&self, sid: &SandboxId, timeout: Duration) {
        let execs: Vec<Arc<ExecEntry>> = match self.running.lock() {
            Ok(r) => r.by_id.values().filter(|e| e.snapshot().is_ok_and(|r| &r.sandbox_id == sid)).cloned().collect(),
            Err(_) => return,
        };
        let all = futures::future::join_all(execs.iter().map(|e| e.wait()));
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!(sandbox = %sid, "execs still running after destroy; their records may outlive the sandbox until the next start");
        }
    }

    fn running_exec(&self, exec_id: &ExecId) -> Option<Arc<ExecEntry>> {
        self.running.lock().ok().and_then(|r| r.by_id.get(exec_id).cloned())
    }

    /// A recorded exec; with `wait`, once it has ended.
    pub async fn get_exec(&self, tenant: &str, exec_id: &str, wait: bool) -> Result<ExecRecord, Error> {
        let eid = ExecId::parse(exec_id).map_err(|_| Error::ExecNotFound(exec_id.chars().take(80).collect()))?;
        if let Some(exec) = self.running_exec(&eid) {
            self.check_exec_tenant(tenant, &exec.snapshot()?)?;
            return if wait { exec.wait().await } else { exec.snapshot() };
        }
        let record = self.store.exec(eid.as_str())?.ok_or_else(|| Error::ExecNotFound(eid.to_string()))?;
        self.check_exec_tenant(tenant, &record)?;
        Ok(record)
    }

    /// An exec belongs to its sandbox's tenant.
    fn check_exec_tenant(&self, tenant: &str, record: &ExecRecord) -> Result<(), Error> {
        self.entry(tenant, record.sandbox_id.as_str()).map(|_| ()).map_err(|_| Error::ExecNotFound(record.exec_id.to_string()))
    }

    /// Sends a signal to every process of a running exec.
    pub async fn signal_exec(&self, tenant: &str, exec_id: &str, signal: i32) -> Result<(), Error> {
        if !(1..=64).contains(&signal) {
            return Err(Error::invalid("signal", format!("{signal} is not a signal number (1-64)")));
        }
        let eid = ExecId::parse(exec_id).map_err(|_| Error::ExecNotFound(exec_id.chars().take(80).collect()))?;
        let Some(exec) = self.running_exec(&eid) else {
            return match self.store.exec_meta(eid.as_str())? {
                Some(r) => {
                    self.check_exec_tenant(tenant, &r)?;
                    Err(Error::FailedPrecondition(format!("exec {eid} has already ended")))
                }
                None => Err(Error::ExecNotFound(eid.to_string())),
            };
        };
        let record = exec.snapshot()?;
        self.check_exec_tenant(tenant, &record)?;
        let info = self.get(tenant, record.sandbox_id.as_str())?;
        let backend = self.backends.get(info.isolation)?.clone();
        backend.signal_exec(&record.sandbox_id, &record.exec_id, signal).await?;
        Ok(())
    }

    /// One page of the sandbox's exec records, oldest first (see [`ListExecsQuery`]). Memory and
    /// the response stay O(page): at most [`MAX_EXECS_PAGE_SIZE`] records, and a page stops
    /// before [`MAX_EXECS_PAGE_BYTES`] of records (with at least one record on it).
    pub fn list_execs(&self, tenant: &str, q: &ListExecsQuery) -> Result<ExecList, Error> {
        let (sid, _) = self.entry(tenant, &q.sandbox_id)?;
        let token = match q.page_token.as_str() {
            "" => None,
            t => Some(PageToken::parse(t).ok_or_else(|| Error::invalid("page_token", "not a token from a previous ListExecs response"))?),
        };
        let page_size = match q.page_size {
            0 => MAX_EXECS_PAGE_SIZE,
            n => (n as usize).min(MAX_EXECS_PAGE_SIZE),
        };
        let query = PageQuery { limit: q.limit, token, page_size, include_output: q.include_output, max_bytes: MAX_EXECS_PAGE_BYTES };
        let page = self.store.exec_page(sid.as_str(), &query)?;
        let mut records = page.records;
        // Running ones are stored as they started; show their live state (no output until the end).
        for r in &mut records {
            if r.outcome.status == ExecStatus::Running {
                if let Some(live) = self.running_exec(&r.exec_id).and_then(|e| e.snapshot().ok()) {
                    *r = live;
                }
            }
        }
        Ok(ExecList { records, next_page_token: page.next.map(|t| t.encode()).unwrap_or_default() })
    }

    fn running_entry(&self, tenant: &str, sandbox_id: &str, op: &'static str) -> Result<(SandboxId, Arc<SandboxEntry>, SandboxInfo), Error> {
        let (sid, entry) = self.entry(tenant, sandbox_id)?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: op });
        }
        Ok((sid, entry, info))
    }

    /// Writes a file inside the sandbox.
    pub async fn write_file(&self, tenant: &str, sandbox_id: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "write files")?;
        if mode > 0o7777 {
            return Err(Error::invalid("mode", format!("{mode:o} is not a permission mode")));
        }
        Ok(self.backends.get(info.isolation)?.write_file(&sid, path, content, mode).await?)
    }

    /// Reads part of a file inside the sandbox.
    pub async fn read_file(&self, tenant: &str, sandbox_id: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "read files")?;
        Ok(self.backends.get(info.isolation)?.read_file(&sid, path, offset, limit).await?)
    }

    /// Captures the sandbox's filesystem as a new snapshot.
    #[tracing::instrument(name = "manager.snapshot", skip_all)]
    pub async fn snapshot(&self, tenant: &str, sandbox_id: &str, name: &str) -> Result<SnapshotRecord, Error> {
        let (sid, entry) = self.entry(tenant, sandbox_id)?;
        if name.len() > 256 {
            return Err(Error::invalid("name", "at most 256 bytes"));
        }
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if !info.state.can_snapshot() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "snapshot" });
        }
        let snap_id = SnapshotId::generate();
        let started = std::time::Instant::now();
        let size_bytes = self.backends.get(info.isolation)?.snapshot(&sid, &snap_id).await?;
        self.metrics.observe(Op::Snapshot, info.isolation, started.elapsed());
        let record = SnapshotRecord {
            snapshot_id: snap_id.clone(),
            sandbox_id: sid.clone(),
            tenant: tenant.to_string(),
            name: name.to_string(),
            created_at: SystemTime::now(),
            size_bytes,
            parent_snapshot_id: info.head_snapshot.clone(),
            isolation: info.isolation,
            image: info.image.clone(),
        };
        self.store.put_snapshot(&record)?;
        let info = entry.update(|i| i.head_snapshot = Some(snap_id.clone()))?;
        self.store.put_sandbox(&info)?;
        tracing::info!(sandbox = %sid, snapshot = %snap_id, size_bytes, ms = started.elapsed().as_millis() as u64, "snapshot taken");
        Ok(record)
    }

    /// Snapshots taken of a sandbox, oldest first. They outlive the sandbox, so a destroyed
    /// sandbox's snapshots are still listed (NOT_FOUND only if there is neither).
    pub fn list_snapshots(&self, tenant: &str, sandbox_id: &str) -> Result<Vec<SnapshotRecord>, Error> {
        let sid = SandboxId::parse(sandbox_id).map_err(|_| Error::SandboxNotFound(sandbox_id.chars().take(80).collect()))?;
        let snaps: Vec<SnapshotRecord> = self.store.snapshots(Some(sid.as_str()))?.into_iter().filter(|s| s.tenant == tenant).collect();
        if snaps.is_empty() && self.entry(tenant, sandbox_id).is_err() {
            return Err(Error::SandboxNotFound(sid.to_string()));
        }
        Ok(snaps)
    }

    /// Puts the sandbox's filesystem back to a snapshot. Running execs end as LOST; background
    /// processes are gone; id, limits and labels stay.
    #[tracing::instrument(name = "manager.rollback", skip_all)]
    pub async fn rollback(&self, tenant: &str, sandbox_id: &str, snapshot_id: &str) -> Result<SandboxInfo, Error> {
        let (sid, entry) = self.entry(tenant, sandbox_id)?;
        let snap = self.snapshot_record(tenant, snapshot_id)?;
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if !info.state.can_snapshot() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "roll back" });
        }
        if snap.isolation != info.isolation || snap.image != info.image {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {} is of image {:?} ({}); sandbox {sid} runs {:?} ({})",
                snap.snapshot_id,
                snap.image,
                snap.isolation.name(),
                info.image,
                info.isolation.name()
            )));
        }
        let started = std::time::Instant::now();
        let result = self.backends.get(info.isolation)?.rollback(&sid, &snap.snapshot_id).await;
        let info = match result {
            Ok(()) => entry.update(|i| i.head_snapshot = Some(snap.snapshot_id.clone()))?,
            Err(e) => {
                // The old runtime is gone; without a new one the sandbox cannot serve.
                let info = entry.update(|i| i.state = SandboxState::Failed)?;
                self.store.put_sandbox(&info)?;
                return Err(e.into());
            }
        };
        self.store.put_sandbox(&info)?;
        self.metrics.observe(Op::Rollback, info.isolation, started.elapsed());
        tracing::info!(sandbox = %sid, snapshot = %snap.snapshot_id, ms = started.elapsed().as_millis() as u64, "rolled back");
        Ok(info)
    }

    /// Deletes a snapshot no live sandbox was forked from.
    pub async fn delete_snapshot(&self, tenant: &str, snapshot_id: &str) -> Result<(), Error> {
        let snap = self.snapshot_record(tenant, snapshot_id)?;
        let dependents: Vec<String> = match self.sandboxes.read() {
            Ok(map) => map
                .values()
                .filter_map(|e| e.info().ok())
                .filter(|i| i.parent_snapshot_id.as_ref() == Some(&snap.snapshot_id))
                .map(|i| i.id.to_string())
                .collect(),
            Err(_) => return Err(Error::Internal("sandbox table poisoned".into())),
        };
        if !dependents.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {} is the origin of live sandbox(es) {}; destroy them first",
                snap.snapshot_id,
                dependents.join(", ")
            )));
        }
        self.backends.get(snap.isolation)?.delete_snapshot(&snap.snapshot_id).await?;
        self.store.delete_snapshot(snap.snapshot_id.as_str())?;
        Ok(())
    }

    /// Destroys sandboxes whose TTL has passed. Called periodically.
    pub async fn reap_expired(&self) {
        let now = SystemTime::now();
        let expired: Vec<(SandboxId, String)> = match self.sandboxes.read() {
            Ok(map) => map
                .iter()
                .filter_map(|(id, e)| e.info().ok().filter(|i| i.state.can_destroy() && i.expires_at.is_some_and(|t| t <= now)).map(|i| (id.clone(), i.tenant)))
                .collect(),
            Err(_) => return,
        };
        for (id, tenant) in expired {
            tracing::info!(sandbox = %id, "TTL expired; destroying");
            if let Err(e) = self.destroy(&tenant, id.as_str()).await {
                tracing::warn!(sandbox = %id, error = %e, "TTL reap failed");
            }
        }
    }

    /// Stops serving: running execs are killed (recorded as LOST by the next start if the
    /// record could not be written), and each backend stops its sandboxes' processes while
    /// keeping their filesystems for the next start.
    pub async fn shutdown(&self) {
        let running: Vec<Arc<ExecEntry>> = self.running.lock().map(|r| r.by_id.values().cloned().collect()).unwrap_or_default();
        for exec in &running {
            exec.cancel.cancel();
        }
        for exec in &running {
            let _ = tokio::time::timeout(Duration::from_secs(5), exec.wait()).await;
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
    fn env_and_paths_are_validated() {
        let mut env = BTreeMap::new();
        env.insert("A=B".to_string(), "x".to_string());
        assert!(validate_env("env", &env).is_err());
        assert!(validate_abs_path("workdir", "relative").is_err());
        assert!(validate_abs_path("workdir", "/a/../b").is_err());
        assert!(validate_abs_path("workdir", "/workspace/x").is_ok());
        assert!(validate_abs_path("workdir", &format!("/{}", "x".repeat(256))).is_err(), "component over NAME_MAX");
        assert!(validate_abs_path("workdir", &"/x".repeat(2100)).is_err(), "over PATH_MAX");
        let big = BTreeMap::from([("BIG".to_string(), "x".repeat(MAX_ARG_STRLEN))]);
        assert!(validate_env("env", &big).is_err(), "one variable over MAX_ARG_STRLEN");
    }

    #[test]
    fn create_time_floors_and_names_are_validated() {
        let ok = Limits::DEFAULTS;
        assert!(validate_minimums(&ok).is_ok());
        assert!(validate_minimums(&Limits::MINIMUMS).is_ok(), "the floors themselves are allowed");
        for (limits, field) in [
            (Limits { disk_bytes: 1, ..ok }, "limits.disk_bytes"),
            (Limits { max_pids: 7, ..ok }, "limits.max_pids"),
            (Limits { memory_bytes: 1 << 20, ..ok }, "limits.memory_bytes"),
        ] {
            let err = validate_minimums(&limits).expect_err(field);
            assert!(err.to_string().contains(field), "{err}");
        }
        for good in ["minimal", "debian-12", "img_v1.2"] {
            assert!(validate_image(good).is_ok(), "{good}");
        }
        for bad in ["", "../etc", "a/b", ".hidden", "with space", &"x".repeat(65)] {
            assert!(validate_image(bad).is_err(), "{bad:?}");
        }
        assert!(validate_labels(&BTreeMap::from([("team".to_string(), "ci".to_string())])).is_ok());
        assert!(validate_labels(&BTreeMap::from([("x".repeat(129), String::new())])).is_err());
        assert!(validate_labels(&BTreeMap::from([("a\nb".to_string(), String::new())])).is_err());
        assert!(validate_labels(&(0..=MAX_LABELS).map(|i| (format!("k{i}"), String::new())).collect()).is_err());
    }

    // ---- The manager over a fake backend: admission without root. ----

    use crate::backend::{Backend, BackendError, StartSignal};
    use crate::ids::{ExecId, SnapshotId};

    /// A PROCESS backend that makes nothing: `sleep <ms>` runs that long (or until cancelled),
    /// anything else ends at once.
    struct FakeBackend;

    #[async_trait::async_trait]
    impl Backend for FakeBackend {
        fn isolation(&self) -> Isolation {
            Isolation::Process
        }
        fn availability(&self) -> Result<(), String> {
            Ok(())
        }
        async fn create(&self, _spec: &SandboxSpec) -> Result<(), BackendError> {
            // Long enough for concurrent creates to overlap.
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(())
        }
        async fn exec(&self, _sandbox: &SandboxId, spec: ExecSpec, _sink: OutputSink, started: StartSignal, cancel: CancellationToken) -> Result<ExecOutcome, BackendError> {
            let started_at = SystemTime::now();
            if let Some(s) = started {
                let _ = s.send(());
            }
            if spec.argv[0] == "sleep" {
                let ms = spec.argv.get(1).and_then(|a| a.parse().ok()).unwrap_or(0);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    _ = cancel.cancelled() => return Ok(ExecOutcome::failed(ExecStatus::Signaled, 137, String::new(), started_at)),
                }
            }
            Ok(ExecOutcome::failed(ExecStatus::Exited, 0, String::new(), started_at))
        }
        async fn signal_exec(&self, _sandbox: &SandboxId, exec: &ExecId, _signal: i32) -> Result<(), BackendError> {
            Err(BackendError::NoSuchExec(exec.clone()))
        }
        async fn write_file(&self, _sandbox: &SandboxId, _path: &str, content: &[u8], _mode: u32) -> Result<u64, BackendError> {
            Ok(content.len() as u64)
        }
        async fn read_file(&self, _sandbox: &SandboxId, _path: &str, _offset: u64, _limit: u64) -> Result<FileChunk, BackendError> {
            Ok(FileChunk::default())
        }
        async fn remove_file(&self, _sandbox: &SandboxId, _path: &str) -> Result<(), BackendError> {
            Ok(())
        }
        async fn snapshot(&self, _sandbox: &SandboxId, _snapshot: &SnapshotId) -> Result<u64, BackendError> {
            Ok(0)
        }
        async fn rollback(&self, _sandbox: &SandboxId, _snapshot: &SnapshotId) -> Result<(), BackendError> {
            Ok(())
        }
        async fn delete_snapshot(&self, _snapshot: &SnapshotId) -> Result<(), BackendError> {
            Ok(())
        }
        async fn destroy(&self, _sandbox: &SandboxId) -> Result<(), BackendError> {
            Ok(())
        }
        async fn recover(&self, sandboxes: &[SandboxSpec], _snapshots: &[SnapshotId]) -> Vec<(SandboxId, Result<(), BackendError>)> {
            sandboxes.iter().map(|s| (s.id.clone(), Ok(()))).collect()
        }
        async fn shutdown(&self) {}
    }

    /// A manager over [`FakeBackend`] with a `pool_size_bytes` pool and `toml` as its config.
    fn fake_manager(dir: &std::path::Path, pool_size_bytes: u64, toml: &str) -> Arc<Manager> {
        let path = dir.join("sandboxd.toml");
        std::fs::write(&path, toml).expect("write config");
        let cli = crate::config::Cli { state_dir: Some(dir.to_path_buf()), pool_size_bytes: Some(pool_size_bytes), config: Some(path), ..Default::default() };
        let cfg = Arc::new(Config::load(cli).expect("config"));
        let mut backends = Backends::default();
        backends.insert(Arc::new(FakeBackend));
        let store = Store::open(&dir.join("state.db")).expect("store");
        Manager::new(cfg, backends, store, Metrics::new().expect("metrics"))
    }

    fn with_disk(disk_bytes: u64) -> CreateRequest {
        CreateRequest { isolation: Some(Isolation::Process), limits: RequestedLimits { disk_bytes, ..Default::default() }, ..Default::default() }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_creates_never_overcommit_the_pool_and_forks_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let creates = (0..12).map(|_| {
            let m = m.clone();
            tokio::spawn(async move { m.create("t", with_disk(1 << 30)).await })
        });
        let results = futures::future::join_all(creates).await;
        let (ok, refused): (Vec<_>, Vec<_>) = results.into_iter().map(|r| r.expect("task")).partition(|r| r.is_ok());
        assert_eq!((ok.len(), refused.len()), (8, 4), "exactly the pool's worth is admitted");
        for r in refused {
            let err = r.expect_err("refused");
            assert!(matches!(err, Error::ResourceExhausted(_)) && err.to_string().contains("(pool_size_bytes)"), "{err}");
        }
        let first = ok.into_iter().next().and_then(Result::ok).expect("a sandbox");
        m.destroy("t", first.id.as_str()).await.expect("destroy");
        let sb = m.create("t", with_disk(1 << 30)).await.expect("a destroy frees its disk");
        let snap = m.snapshot("t", sb.id.as_str(), "s").await.expect("snapshot");
        m.destroy("t", sb.id.as_str()).await.expect("destroy");
        let fork = CreateRequest { from_snapshot_id: snap.snapshot_id.to_string(), ..Default::default() };
        m.create("t", fork.clone()).await.expect("the fork fits the freed room");
        let err = m.create("t", fork).await.expect_err("a second fork does not");
        assert!(err.to_string().contains("8 GiB of 8 GiB"), "{err}");
    }

    #[tokio::test]
    async fn create_refuses_what_could_not_run_naming_the_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let cases: Vec<(CreateRequest, &str)> = vec![
            (with_disk(1), "limits.disk_bytes"),
            (CreateRequest { limits: RequestedLimits { max_pids: 1, ..Default::default() }, ..Default::default() }, "limits.max_pids"),
            (CreateRequest { env: BTreeMap::from([("BIG".into(), "x".repeat(130 << 10))]), ..Default::default() }, "env"),
            (CreateRequest { env: (0..3000).map(|i| (format!("V{i}"), "x".repeat(96))).collect(), ..Default::default() }, "env"),
            (CreateRequest { image: "../x".into(), ..Default::default() }, "image"),
            (CreateRequest { workdir: format!("/{}", "w".repeat(300)), ..Default::default() }, "workdir"),
        ];
        for (req, field) in cases {
            let Err(err) = m.create("t", req).await else { panic!("{field}: accepted") };
            assert!(matches!(&err, Error::InvalidArgument { field: f, .. } if f == field), "{field}: {err}");
        }
        // An env that leaves room for a command line is fine, and every exec then fits.
        let env = BTreeMap::from([("DATA".to_string(), "x".repeat(120 << 10))]);
        let sb = m.create("t", CreateRequest { env, ..Default::default() }).await.expect("120 KiB of env");
        let r = m.exec("t", ExecRequest { sandbox_id: sb.id.to_string(), argv: vec!["true".into()], ..Default::default() }, None).await.expect("exec");
        assert_eq!(r.outcome.status, ExecStatus::Exited);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exec_caps_refuse_naming_the_key_and_free_when_execs_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "[policy]\nmax_background_execs_per_sandbox = 2\nmax_running_execs_per_tenant = 3\n");
        let a = m.create("t", CreateRequest::default()).await.expect("a").id.to_string();
        let b = m.create("t", CreateRequest::default()).await.expect("b").id.to_string();
        let run = |sandbox: &str, argv: &[&str], background: bool| ExecRequest {
            sandbox_id: sandbox.to_string(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            background,
            ..Default::default()
        };
        for _ in 0..2 {
            let r = m.exec("t", run(&a, &["sleep", "300"], true), None).await.expect("background");
            assert_eq!(r.outcome.status, ExecStatus::Running);
        }
        let err = m.exec("t", run(&a, &["sleep", "300"], true), None).await.expect_err("third background");
        assert!(matches!(&err, Error::ResourceExhausted(m) if m.contains("policy.max_background_execs_per_sandbox (2)")), "{err}");
        m.exec("t", run(&b, &["true"], false), None).await.expect("a foreground exec elsewhere runs");
        m.exec("t", run(&b, &["sleep", "300"], true), None).await.expect("the tenant's third");
        let err = m.exec("t", run(&b, &["true"], false), None).await.expect_err("the tenant's fourth");
        assert!(err.to_string().contains("policy.max_running_execs_per_tenant (3)"), "{err}");
        // Ended execs free their slots.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let slots = m.exec_slots.lock().map(|s| (s.of_tenant("t").running, s.of_tenant("t").background)).expect("lock");
        assert_eq!(slots, (0, 0), "nothing runs any more");
        m.exec("t", run(&a, &["true"], false), None).await.expect("room again");
    }
}
