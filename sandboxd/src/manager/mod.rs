//! The core of the daemon: sandboxes and their lifecycle, limits, exec records, TTLs.
//!
//! The manager validates what a request asks for (ids, limits against the ceilings, argv, env),
//! picks the backend of the sandbox's tier, and keeps the records users read back. It never sees
//! gRPC: `api` turns messages into these calls and the results back into messages.
//!
//! Split by concern: this file holds the [`Manager`] and its sandbox table, start (recover),
//! stop (shutdown) and health; [`lifecycle`] creates, lists and destroys sandboxes; [`execs`]
//! runs commands and keeps their records; [`snapshots`] takes, lists and restores snapshots;
//! [`files`] reads and writes files in a sandbox; [`validate`] checks what a request asks for.

mod execs;
mod files;
mod images;
mod lifecycle;
mod snapshots;
mod streams;
mod validate;

#[cfg(test)]
mod fake;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use crate::admission::{human_bytes, DiskPools, ExecSlots};
use crate::backend::{Backends, SandboxSpec};
use crate::config::Config;
use crate::error::Error;
use crate::ids::{SandboxId, SnapshotId};
use crate::images::store::StoreBudget;
use crate::images::{Catalog, Engine};
use crate::metrics::Metrics;
use crate::model::{Isolation, SandboxInfo, SandboxState};
use crate::store::Store;

use execs::Running;

pub use execs::{ExecEvents, Session};
pub use files::Held;
pub use images::{BuildRequest, ImageEvents, ImportRequest, ImportSource};
pub use lifecycle::DEFAULT_IMAGE;
pub use streams::{StreamKind, StreamSlot};

/// A sandbox in the table: its record, read and updated under a short lock, and the lock that
/// whole-sandbox operations hold across their awaits.
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

/// The daemon's core.
pub struct Manager {
    cfg: Arc<Config>,
    backends: Backends,
    store: Store,
    metrics: Arc<Metrics>,
    /// Every sandbox not destroyed: the create that inserts one is admitted under its write lock.
    sandboxes: RwLock<HashMap<SandboxId, Arc<SandboxEntry>>>,
    /// Execs in flight (see `execs`).
    running: Mutex<Running>,
    /// The storage pools `disk_bytes` are promised from (see `admission`).
    disk_pools: DiskPools,
    /// Execs running now per sandbox and tenant, against the policy's exec caps.
    exec_slots: Arc<Mutex<ExecSlots>>,
    /// The images sandboxes start from (see `images`).
    catalog: Arc<Catalog>,
    /// The local Docker Engine, for `docker:` imports and builds.
    engine: Arc<Engine>,
    /// Imports and builds at once (`images.max_concurrent`).
    image_jobs: Arc<tokio::sync::Semaphore>,
    /// The host disk the image store may take (`images.max_store_bytes`, `min_free_bytes`).
    image_store: Arc<StoreBudget>,
    /// Creates hold it (read) from their image check until the sandbox is in the table; image
    /// removals and replacements hold it (write) from their in-use check until the image is out
    /// of the catalog, so no sandbox starts from an image being removed.
    image_gate: tokio::sync::RwLock<()>,
    /// One import, build or removal of an image name at a time.
    image_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Uploads, downloads, sessions and archive walks open now, against `[streams]`.
    stream_slots: Arc<streams::StreamSlots>,
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

impl Manager {
    /// A manager over the given backends, image catalog and store. Call [`Manager::recover`]
    /// before serving.
    pub fn new(cfg: Arc<Config>, backends: Backends, catalog: Arc<Catalog>, engine: Arc<Engine>, store: Store, metrics: Arc<Metrics>) -> Arc<Self> {
        let disk_pools = DiskPools::from_config(&cfg);
        let image_jobs = Arc::new(tokio::sync::Semaphore::new(cfg.images.max_concurrent));
        let image_store = StoreBudget::new(catalog.imported_dir(), cfg.images.max_store_bytes, cfg.images.min_free_bytes);
        let stream_slots = streams::StreamSlots::new(cfg.streams.clone());
        Arc::new(Manager {
            catalog,
            engine,
            image_jobs,
            image_store,
            image_gate: tokio::sync::RwLock::new(()),
            image_locks: Mutex::new(HashMap::new()),
            cfg,
            backends,
            store,
            metrics,
            sandboxes: RwLock::new(HashMap::new()),
            running: Mutex::new(Running::default()),
            disk_pools,
            exec_slots: Arc::new(Mutex::new(ExecSlots::default())),
            stream_slots,
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

    /// Stops serving: running execs are killed (recorded as LOST by the next start if the
    /// record could not be written), and each backend stops its sandboxes' processes while
    /// keeping their filesystems for the next start.
    pub async fn shutdown(&self) {
        self.kill_running_execs().await;
        for backend in self.backends.all() {
            backend.shutdown().await;
        }
    }
}
