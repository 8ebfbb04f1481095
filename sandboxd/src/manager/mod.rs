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

mod builds;
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

use crate::admission::{human_bytes, Budgets, DiskPools, ExecSlots, Host, HostNow, Pressure, PressureLog, Promised};
use crate::backend::{Backends, SandboxSpec};
use crate::config::Config;
use crate::error::Error;
use crate::ids::{SandboxId, SnapshotId};
use crate::images::store::StoreBudget;
use crate::images::{Catalog, Engine};
use crate::metrics::{AdmissionGauges, Metrics, PoolGauge};
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
    /// A sandbox on record at start that is not back up yet: what its backend needs to bring it
    /// back. Whoever needs the sandbox first — the start's background re-adoption or a call on
    /// it — takes the spec and re-adopts it under this lock; everyone else waits for that (see
    /// [`Manager::adopted`]). `None` for every sandbox created by this daemon.
    pending: tokio::sync::Mutex<Option<SandboxSpec>>,
    /// True while the sandbox is paused: the running clock of its execs' deadlines
    /// ([`crate::backend::RunClock`]) stops meanwhile.
    paused: tokio::sync::watch::Sender<bool>,
}

impl SandboxEntry {
    fn new(info: SandboxInfo) -> Arc<Self> {
        Self::recorded(info, None)
    }

    fn recorded(info: SandboxInfo, pending: Option<SandboxSpec>) -> Arc<Self> {
        let paused = tokio::sync::watch::Sender::new(info.state == SandboxState::Paused);
        Arc::new(SandboxEntry { info: Mutex::new(info), op: tokio::sync::Mutex::new(()), pending: tokio::sync::Mutex::new(pending), paused })
    }

    /// Whether the sandbox still waits for its re-adoption (or is being re-adopted now).
    fn is_pending(&self) -> bool {
        self.pending.try_lock().map(|p| p.is_some()).unwrap_or(true)
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
    /// Memory, pids and per-tenant admission (see `admission`).
    budgets: Budgets,
    /// Which host resources were last seen near or at their limit, so each change is logged once.
    pressure: PressureLog,
    /// Execs running now per sandbox and tenant, against the policy's exec caps.
    exec_slots: Arc<Mutex<ExecSlots>>,
    /// The images sandboxes start from (see `images`).
    catalog: Arc<Catalog>,
    /// The local Docker Engine, for `docker:` imports and builds.
    engine: Arc<Engine>,
    /// Imports and builds at once (`images.max_concurrent`).
    image_jobs: Arc<tokio::sync::Semaphore>,
    /// Of those, one tenant's at once (`images.max_concurrent_per_tenant`), by tenant.
    tenant_image_jobs: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// The host disk the image store may take (`images.max_store_bytes`, `min_free_bytes`).
    image_store: Arc<StoreBudget>,
    /// Creates hold it (read) from their image check until the sandbox is in the table; image
    /// removals and replacements hold it (write) from their in-use check until the image is out
    /// of the catalog, so no sandbox starts from an image being removed.
    image_gate: tokio::sync::RwLock<()>,
    /// One import, build or removal of an image name at a time.
    image_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One snapshot admission per tenant at a time (see `snapshots`).
    snapshot_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Uploads, downloads, sessions and archive walks open now, against `[streams]`.
    stream_slots: Arc<streams::StreamSlots>,
    /// Set once by a drain (`sandboxd drain`): this daemon takes no new sandboxes from then on.
    draining: std::sync::atomic::AtomicBool,
}

/// What the backend needs to (re)build a sandbox.
fn spec_of(info: &SandboxInfo) -> SandboxSpec {
    SandboxSpec {
        id: info.id.clone(),
        image: info.image.clone(),
        limits: info.limits,
        workdir: info.workdir.clone(),
        from_snapshot: info.parent_snapshot_id.clone(),
        tenant: info.tenant.clone(),
        network: info.network.clone(),
    }
}

impl Manager {
    /// A manager over the given backends, image catalog and store. Call [`Manager::recover`]
    /// before serving.
    pub fn new(cfg: Arc<Config>, backends: Backends, catalog: Arc<Catalog>, engine: Arc<Engine>, store: Store, metrics: Arc<Metrics>) -> Arc<Self> {
        Self::new_on_host(cfg, backends, catalog, engine, store, metrics, Host::measure())
    }

    /// [`Manager::new`] admitting memory and pids against `host` instead of this machine's.
    pub fn new_on_host(
        cfg: Arc<Config>,
        backends: Backends,
        catalog: Arc<Catalog>,
        engine: Arc<Engine>,
        store: Store,
        metrics: Arc<Metrics>,
        host: Host,
    ) -> Arc<Self> {
        let disk_pools = DiskPools::from_config(&cfg);
        let budgets = Budgets::new(host, cfg.admission.clone());
        store.set_max_record_argv_bytes(cfg.exec.max_record_argv_bytes);
        let image_jobs = Arc::new(tokio::sync::Semaphore::new(cfg.images.max_concurrent));
        let i = &cfg.images;
        let image_store = StoreBudget::new(catalog.imported_dir(), i.max_store_bytes, i.min_free_bytes, i.max_store_bytes_per_tenant, &cfg.auth.unix_tenant);
        let stream_slots = streams::StreamSlots::new(cfg.streams.clone());
        Arc::new(Manager {
            catalog,
            engine,
            image_jobs,
            tenant_image_jobs: Mutex::new(HashMap::new()),
            image_store,
            image_gate: tokio::sync::RwLock::new(()),
            image_locks: Mutex::new(HashMap::new()),
            snapshot_locks: Mutex::new(HashMap::new()),
            cfg,
            backends,
            store,
            metrics,
            sandboxes: RwLock::new(HashMap::new()),
            running: Mutex::new(Running::default()),
            disk_pools,
            budgets,
            pressure: PressureLog::default(),
            exec_slots: Arc::new(Mutex::new(ExecSlots::default())),
            stream_slots,
            draining: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// What every sandbox on record is promised (host-wide), and per pool of disk.
    fn promised(&self) -> (Promised, Vec<(usize, u64)>) {
        let mut all = Promised::default();
        let pools = self.disk_pools.pools();
        let mut per_pool: Vec<(usize, u64)> = (0..pools.len()).map(|i| (i, 0)).collect();
        if let Ok(map) = self.sandboxes.read() {
            for (isolation, limits) in map.values().filter_map(|e| e.read(|i| (i.isolation, i.limits)).ok()) {
                all.add(&limits);
                if let Some(i) = pools.iter().position(|(_, tiers)| tiers.first().is_some_and(|t| self.disk_pools.same_pool(*t, isolation))) {
                    per_pool[i].1 = per_pool[i].1.saturating_add(limits.disk_bytes);
                }
            }
        }
        (all, per_pool)
    }

    /// What admission counts now: promises, real use and pressure of every resource.
    fn admission_gauges(&self) -> AdmissionGauges {
        let (all, per_pool) = self.promised();
        let now = HostNow::measure();
        let (memory, pids) = self.budgets.pressure(&now);
        let level = |p: Pressure| p as u8;
        let pools = self
            .disk_pools
            .pools()
            .into_iter()
            .zip(per_pool)
            .map(|((pool, tiers), (_, promised))| {
                let usage = tiers.first().and_then(|t| self.disk_pools.usage(*t));
                PoolGauge {
                    key: pool.key.clone(),
                    capacity: pool.capacity,
                    promisable: self.disk_pools.promisable(pool),
                    promised,
                    used: usage.map(|u| u.used),
                    pressure: usage.map(|u| level(self.disk_pools.pressure(u))).unwrap_or(0),
                }
            })
            .collect();
        AdmissionGauges {
            pools,
            memory_promised: all.memory_bytes,
            memory_promisable: self.budgets.memory_capacity(),
            memory_available: now.memory_available,
            pids_promised: all.max_pids,
            pids_promisable: self.budgets.pids_capacity(),
            tasks: now.tasks,
            memory_pressure: level(memory),
            pids_pressure: level(pids),
        }
    }

    /// Logs once, clearly, when the host's memory, pids or a storage pool nears its limit (a
    /// warning) or reaches it (an error: creates are refused), and when it is back.
    pub fn watch_pressure(&self) {
        let g = self.admission_gauges();
        let levels = [Pressure::Ok, Pressure::Near, Pressure::Over];
        let at = |l: u8| levels.get(usize::from(l)).copied().unwrap_or(Pressure::Ok);
        let reserve = human_bytes(self.cfg.admission.daemon_memory_reserve_bytes);
        let avail = g.memory_available.map(human_bytes).unwrap_or_else(|| "?".into());
        self.pressure.note("memory", at(g.memory_pressure), &format!("{avail} available; admission.daemon_memory_reserve_bytes {reserve}"));
        let tasks = g.tasks.map(|t| t.to_string()).unwrap_or_else(|| "?".into());
        self.pressure.note(
            "pids",
            at(g.pids_pressure),
            &format!("{tasks} tasks of kernel.pid_max {}; admission.pids_reserve {}", self.budgets.host().pid_max, self.cfg.admission.pids_reserve),
        );
        for p in &g.pools {
            let used = p.used.map(human_bytes).unwrap_or_else(|| "?".into());
            self.pressure.note(
                &format!("disk pool ({})", p.key),
                at(p.pressure),
                &format!(
                    "{used} of {} used; admission.disk_warn {:.0}%, admission.disk_high_water {:.0}%",
                    human_bytes(p.capacity),
                    self.cfg.admission.disk_warn * 100.0,
                    self.cfg.admission.disk_high_water * 100.0
                ),
            );
        }
    }

    /// The metrics text, with the state gauges filled in.
    pub fn render_metrics(&self) -> String {
        let sandboxes: Vec<(Isolation, SandboxState)> = match self.sandboxes.read() {
            Ok(map) => map.values().filter_map(|e| e.info().ok()).map(|i| (i.isolation, i.state)).collect(),
            Err(_) => Vec::new(),
        };
        let tiers: Vec<(Isolation, bool)> = self.backends.availability().into_iter().map(|(t, r)| (t, r.is_ok())).collect();
        self.metrics.set_admission(&self.admission_gauges());
        self.metrics.render(&sandboxes, &tiers)
    }

    /// Brings back what the store remembers, in the part that must come before the daemon
    /// listens: execs that were running are recorded as LOST (their processes died with the
    /// previous daemon), each tier removes what no record knows, and every sandbox on record is
    /// in the table again — a running one as pending, to be re-adopted by
    /// [`Manager::readopt_all`] (or by the first call that needs it), a tier that cannot run any
    /// more marks its sandboxes FAILED with the reason. Lists and deletes only: no sandbox is
    /// started here, so the socket opens in about the same time with 10 sandboxes or 5,000.
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
            let backend = self.backends.available(tier);
            // A paused sandbox is brought back like a running one (and frozen again once back).
            let specs: Vec<SandboxSpec> = mine.iter().filter(|i| i.state.is_live()).map(spec_of).collect();
            if let Ok(backend) = &backend {
                let snaps: Vec<SnapshotId> = snapshots.iter().filter(|s| s.isolation == tier).map(|s| s.snapshot_id.clone()).collect();
                backend.clean(&specs, &snaps).await;
            }
            let mut table = self.sandboxes.write().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
            for mut info in mine {
                let pending = match (&backend, info.state.is_live()) {
                    (Ok(_), true) => Some(spec_of(&info)),
                    (Err(e), true) => {
                        tracing::warn!(sandbox = %info.id, reason = %e, "sandbox could not be re-adopted; marked FAILED");
                        info.state = SandboxState::Failed;
                        info.paused_at = None;
                        info.failure_reason = Some(format!("could not be brought back after a daemon restart: {e}"));
                        self.store.put_sandbox(&info)?;
                        None
                    }
                    _ => None,
                };
                table.insert(info.id.clone(), SandboxEntry::recorded(info, pending));
            }
        }
        Ok(())
    }

    /// Re-adopts every sandbox [`Manager::recover`] left pending, a tier at a time with the
    /// tier's own concurrency, while the daemon serves; a call on a pending sandbox re-adopts it
    /// at once instead of waiting its turn. Returns when all are back or FAILED (or `stop` was
    /// cancelled: the rest then stay pending, and shutdown leaves them as they are on disk).
    pub async fn readopt_all(self: &Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        use futures::StreamExt;
        let started = std::time::Instant::now();
        let pending: Vec<(Isolation, Arc<SandboxEntry>)> = match self.sandboxes.read() {
            Ok(map) => map.values().filter(|e| e.is_pending()).filter_map(|e| Some((e.read(|i| i.isolation).ok()?, e.clone()))).collect(),
            Err(_) => Vec::new(),
        };
        let total = pending.len();
        let mut done = 0;
        if total > 0 {
            tracing::info!(sandboxes = total, "re-adopting the sandboxes on record while serving");
        }
        for tier in Isolation::ALL {
            let Ok(backend) = self.backends.available(tier) else { continue };
            let mine: Vec<Arc<SandboxEntry>> = pending.iter().filter(|(t, _)| *t == tier).map(|(_, e)| e.clone()).collect();
            let mut adoptions = futures::stream::iter(mine.into_iter().map(|entry| {
                let stop = stop.clone();
                async move {
                    if !stop.is_cancelled() {
                        self.adopted(&entry).await;
                    }
                }
            }))
            .buffer_unordered(backend.readopt_concurrency().max(1));
            while adoptions.next().await.is_some() {
                done += 1;
                if done % 100 == 0 {
                    tracing::info!(done, total, "re-adopting sandboxes");
                }
            }
            drop(adoptions);
            if stop.is_cancelled() {
                return;
            }
            backend.recovered().await;
        }
        if total > 0 {
            tracing::info!(sandboxes = total, elapsed_ms = started.elapsed().as_millis() as u64, "every sandbox on record re-adopted or marked FAILED");
        }
    }

    /// Waits until `entry` is no longer pending, re-adopting it here if nobody is yet: the
    /// sandbox is then running in its backend, or FAILED with the reason.
    async fn adopted(&self, entry: &SandboxEntry) {
        let mut pending = entry.pending.lock().await;
        let Some(spec) = pending.take() else { return };
        let Ok((isolation, paused)) = entry.read(|i| (i.isolation, i.state == SandboxState::Paused)) else { return };
        let result = match self.backends.available(isolation) {
            Ok(backend) => match backend.readopt(&spec).await {
                // A paused sandbox stays paused across the restart: its processes (new ones,
                // as after every restart) are frozen before anything can run them, so recovery
                // never lets its TTL or anything else run on.
                Ok(()) if paused => backend.pause(&spec.id).await.map_err(|e| format!("it was paused, and could not be paused again: {e}")),
                Ok(()) => Ok(()),
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        let updated = entry.update(|info| match &result {
            Ok(()) => tracing::info!(sandbox = %info.id, paused, "sandbox re-adopted"),
            Err(reason) => {
                tracing::warn!(sandbox = %info.id, %reason, "sandbox could not be re-adopted; marked FAILED");
                info.state = SandboxState::Failed;
                info.paused_at = None;
                info.failure_reason = Some(format!("could not be brought back after a daemon restart: {reason}"));
            }
        });
        if result.is_err() {
            entry.paused.send_replace(false);
        }
        if let (Err(_), Ok(info)) = (&result, updated) {
            if let Err(e) = self.store.put_sandbox(&info) {
                tracing::error!(sandbox = %info.id, error = %e, "cannot record a sandbox that failed its re-adoption");
            }
        }
    }

    /// The node name new ids carry (`[fleet] node_name`), if this daemon is a fleet's node. Ids
    /// are opaque names below the API; only the fleet's router reads their node part.
    fn node(&self) -> Option<&crate::ids::NodeName> {
        self.cfg.fleet.as_ref().map(|f| &f.node)
    }

    /// Room for sandboxes: how many this daemon holds (every tenant's, FAILED ones too, as the
    /// capacity check counts them) and `policy.max_sandboxes`.
    pub fn room(&self) -> (usize, Option<usize>) {
        let held = self.sandboxes.read().map(|m| m.len()).unwrap_or(usize::MAX);
        (held, self.cfg.policy.max_sandboxes())
    }

    /// Starts a drain: from now on every create is refused (see [`Manager::is_draining`]); the
    /// sandboxes held and their execs are served as before. There is no way back: a drained
    /// daemon ends once its execs have (see `server`).
    pub fn drain(&self) {
        self.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a drain has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Why a create is refused during a drain, naming this node.
    pub fn drain_refusal(&self) -> String {
        let node = self.node().map(|n| format!("node {n}")).unwrap_or_else(|| "this daemon".into());
        format!("{node} is draining (sandboxd drain): it takes no new sandboxes; create on another node")
    }

    /// Whether the policy allows `tier` on this daemon at all.
    pub fn tier_allowed(&self, tier: Isolation) -> bool {
        self.cfg.policy.allows(tier)
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

    /// [`Manager::entry`] for a call that uses the sandbox: one still pending since the start is
    /// re-adopted first (or waited for), so the call finds it running — or FAILED with the reason.
    async fn ready_entry(&self, tenant: &str, id: &str) -> Result<(SandboxId, Arc<SandboxEntry>), Error> {
        let (sid, entry) = self.entry(tenant, id)?;
        if entry.is_pending() {
            self.adopted(&entry).await;
            self.note_failure(&entry);
        }
        Ok((sid, entry))
    }

    /// Records a running sandbox whose backend reports it dead (its init or VM is gone) as FAILED
    /// with the reason, so it never shows `running` while nothing in it can run.
    fn note_failure(&self, entry: &SandboxEntry) {
        let Ok((id, isolation, state)) = entry.read(|i| (i.id.clone(), i.isolation, i.state)) else { return };
        // A sandbox not yet re-adopted is unknown to its backend, not dead. A paused one is
        // (a frozen init is alive; a stopped VM's QEMU runs).
        if !state.is_live() || entry.is_pending() {
            return;
        }
        let Some(reason) = self.backends.get(isolation).ok().and_then(|b| b.failure(&id)) else { return };
        tracing::warn!(sandbox = %id, %reason, "sandbox failed");
        entry.paused.send_replace(false);
        match entry.update(|i| {
            i.state = SandboxState::Failed;
            i.paused_at = None;
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
            let promisable = self.disk_pools.promisable(pool);
            let (capacity, promisable_h, promised_h) = (human_bytes(pool.capacity), human_bytes(promisable), human_bytes(promised));
            let overcommit = self.cfg.admission.disk_overcommit;
            if promised > promisable {
                tracing::warn!(tiers = ?names, key = %pool.key, capacity = %capacity, overcommit, promisable = %promisable_h, promised = %promised_h, sandboxes = mine.len(), "storage pool overcommitted by the sandboxes on record: creates on it are refused until enough are destroyed");
            } else {
                tracing::info!(tiers = ?names, key = %pool.key, capacity = %capacity, overcommit, promisable = %promisable_h, origin = %pool.origin, promised = %promised_h, sandboxes = mine.len(), "storage pool admission");
            }
        }
        let (all, _) = self.promised();
        let (host, a) = (self.budgets.host(), &self.cfg.admission);
        tracing::info!(
            host_memory = %human_bytes(host.memory_bytes),
            reserve = %human_bytes(a.daemon_memory_reserve_bytes),
            overcommit = a.memory_overcommit,
            promisable = %human_bytes(self.budgets.memory_capacity()),
            promised = %human_bytes(all.memory_bytes),
            "memory admission"
        );
        tracing::info!(
            pid_max = host.pid_max,
            reserve = a.pids_reserve,
            overcommit = a.pids_overcommit,
            promisable = self.budgets.pids_capacity(),
            promised = all.max_pids,
            "pids admission"
        );
        self.watch_pressure();
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::fake::{fake_manager, STUCK_WORKDIR};
    use crate::model::{CreateRequest, SandboxState};

    /// After a restart, a call on one sandbox is answered while another one's re-adoption hangs:
    /// nobody waits for the whole table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_waits_only_for_its_own_sandbox_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (stuck, ready) = {
            let m = fake_manager(dir.path(), 8 << 30, "");
            let stuck = m.create("t", CreateRequest { workdir: STUCK_WORKDIR.into(), ..Default::default() }).await.expect("create");
            let ready = m.create("t", CreateRequest::default()).await.expect("create");
            (stuck.id, ready.id)
        };
        // The daemon comes back over the same state.
        let m = fake_manager(dir.path(), 8 << 30, "");
        m.recover().await.expect("recover");
        let pending = |id: &crate::ids::SandboxId| m.entry("t", id.as_str()).expect("entry").1.is_pending();
        assert!(pending(&stuck) && pending(&ready), "recover starts nothing");
        assert_eq!(m.get("t", ready.as_str()).expect("get").state, SandboxState::Running, "a pending sandbox is listed as on record");
        let stop = tokio_util::sync::CancellationToken::new();
        let background = tokio::spawn({
            let (m, stop) = (m.clone(), stop.clone());
            async move { m.readopt_all(stop).await }
        });
        // Whichever the background re-adoption took first, `ready` is answered.
        let (_, entry) = tokio::time::timeout(Duration::from_secs(30), m.ready_entry("t", ready.as_str())).await.expect("not held up").expect("entry");
        assert!(!entry.is_pending());
        assert_eq!(entry.info().expect("info").state, SandboxState::Running);
        assert!(pending(&stuck), "the hanging one is still being re-adopted");
        assert!(!background.is_finished(), "and the background re-adoption waits for it");
        stop.cancel();
        background.abort();
    }
}
