//! A sandbox's life: create (admission included), get, list, destroy, and the TTL reaper.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::validate::{resolve_limits, validate_image, validate_labels, validate_minimums, validate_sandbox_env, validate_user, validate_workdir};
use super::{spec_of, Manager, SandboxEntry};
use crate::admission::{HostNow, Promised};
use crate::error::Error;
use crate::ids::SandboxId;
use crate::images::display_name;
use crate::metrics::Op;
use crate::model::{CreateRequest, Isolation, Limits, OnExpiry, SandboxInfo, SandboxState};

/// The image of a create request that names none.
pub const DEFAULT_IMAGE: &str = "minimal";

impl Manager {
    /// Refuses a create past the configured capacity, the host's memory and pids, the tenant's
    /// quotas or the disk pool of `tier` (promised and really used), naming the limit. Called
    /// with the table's write lock held by the create that then inserts itself, so two
    /// concurrent creates never both take the last room.
    fn check_capacity(&self, map: &HashMap<SandboxId, Arc<SandboxEntry>>, tenant: &str, tier: Isolation, limits: &Limits) -> Result<(), Error> {
        if let Some(max) = self.cfg.policy.max_sandboxes() {
            if map.len() >= max {
                return Err(Error::ResourceExhausted(format!("policy.max_sandboxes ({max}) reached")));
            }
        }
        // Every sandbox in the table holds its promises until destroyed (FAILED ones too: their
        // layer stays), and a fork or a rolled-back sandbox as much as one made from an image.
        let (mut all, mut mine, mut pool_promised, mut count) = (Promised::default(), Promised::default(), 0u64, 0usize);
        for (owner, isolation, l) in map.values().filter_map(|e| e.read(|i| (i.tenant == tenant, i.isolation, i.limits)).ok()) {
            all.add(&l);
            if owner {
                mine.add(&l);
                count += 1;
            }
            if self.disk_pools.same_pool(isolation, tier) {
                pool_promised = pool_promised.saturating_add(l.disk_bytes);
            }
        }
        if let Some(max) = self.cfg.policy.max_sandboxes_per_tenant() {
            if count >= max {
                return Err(Error::ResourceExhausted(format!("policy.max_sandboxes_per_tenant ({max}) reached for tenant {tenant:?}")));
            }
        }
        let now = HostNow::measure();
        self.budgets.admit(&all, tenant, &mine, limits, &now).map_err(Error::ResourceExhausted)?;
        self.disk_pools.admit(tier, pool_promised, limits.disk_bytes).map_err(Error::ResourceExhausted)?;
        self.disk_pools.admit_use(tier, self.disk_pools.usage(tier)).map_err(Error::ResourceExhausted)
    }

    /// Creates a sandbox (from an image, or from a snapshot: a fork) and returns when it is ready.
    #[tracing::instrument(name = "manager.create", skip_all)]
    pub async fn create(&self, tenant: &str, req: CreateRequest) -> Result<SandboxInfo, Error> {
        // Everything a request says is checked before anything is made: a sandbox in which
        // nothing could run (no room for a command line, no pids for a shell, no disk for its
        // own files) is refused here, naming the field, rather than failing later.
        // The gRPC API answers UNAVAILABLE before it gets here (so a fleet places the create
        // on a peer); this refuses it for every other front door.
        if self.is_draining() {
            return Err(Error::FailedPrecondition(self.drain_refusal()));
        }
        let id = SandboxId::generate_on(self.node());
        // A fork inherits its tier and image from the snapshot (its layer only makes sense
        // there), and what its parent was given — limits, environment, labels, workdir, user —
        // unless the request says otherwise: a 1 GiB sandbox forks into 1 GiB, not the default.
        let (requested, image, origin) = if req.from_snapshot_id.is_empty() {
            let image = if req.image.is_empty() { DEFAULT_IMAGE.to_string() } else { req.image };
            validate_image(&image)?;
            (req.isolation, image, None)
        } else {
            let snap = self.snapshot_record(tenant, &req.from_snapshot_id)?;
            if req.isolation.is_some_and(|i| i != snap.isolation) {
                return Err(Error::invalid("isolation", format!("snapshot {} belongs to the {} tier", snap.snapshot_id, snap.isolation.name())));
            }
            if !req.image.is_empty() && req.image != display_name(&snap.image) {
                return Err(Error::invalid("image", format!("snapshot {} is of image {:?}", snap.snapshot_id, display_name(&snap.image))));
            }
            (Some(snap.isolation), snap.image, Some((snap.snapshot_id, snap.origin)))
        };
        let inherited = origin.as_ref().and_then(|(_, o)| o.as_ref());
        let from_snapshot = origin.as_ref().map(|(snap, _)| snap.clone());
        // From the catalog check until the sandbox is in the table, the image cannot be removed
        // (a removal checks the table under the write side of this lock).
        let image_held = self.image_gate.read().await;
        // A name means the image the caller sees under it (its own, else a shared one), stored
        // under a key; another tenant's is NOT_FOUND. A fork keeps its snapshot's key.
        let image = if origin.is_none() { self.image_key(tenant, &image)? } else { image };
        let image_config = self.catalog.config(&image)?;
        // The workdir: the request's, the parent's, the image's WorkingDir (one the sandbox
        // could not use, under /proc say, is ignored: an image's say-so is no request), or
        // /workspace.
        let workdir = match (req.workdir.is_empty(), inherited) {
            (false, _) => req.workdir,
            (true, Some(parent)) => parent.workdir.clone(),
            (true, None) if !image_config.workdir.is_empty() && validate_workdir(&image_config.workdir).is_ok() => image_config.workdir.clone(),
            (true, None) => "/workspace".to_string(),
        };
        validate_workdir(&workdir)?;
        // Inherited maps are the base; the request's keys override theirs.
        let (env, labels) = match inherited {
            Some(parent) => (merged(&parent.env, req.env), merged(&parent.labels, req.labels)),
            None => (req.env, req.labels),
        };
        validate_sandbox_env(&id, &image_config.env, &env)?;
        validate_labels(&labels)?;
        // Who execs run as: the request's user, the parent's, the image's USER, or root. An
        // image's USER that is no valid user spec is ignored like its workdir.
        let asked_user = !req.user.is_empty();
        let user = match (req.user.is_empty(), inherited) {
            (false, _) => Some(validate_user("user", req.user)?),
            (true, Some(parent)) => parent.user.clone(),
            (true, None) => Some(image_config.user.clone()).filter(|u| !u.is_empty() && sandbox_exec::user::is_valid_spec(u)),
        };
        let decision = self.cfg.policy.decide(requested, &labels).map_err(|e| Error::PermissionDenied(e.to_string()))?;
        if from_snapshot.is_some() && Some(decision.isolation) != requested {
            return Err(Error::PermissionDenied(format!(
                "policy requires {} for this request; the snapshot belongs to another tier",
                decision.isolation.name()
            )));
        }
        let isolation = decision.isolation;
        // The network: the request's, else the parent's, else a matching policy rule's, else
        // NONE — within every matching rule's ceiling (a fork's too: the policy may have
        // tightened since the snapshot). Every tier enforces it (see `egress`).
        let network = match (req.network, inherited) {
            (Some(n), _) => Some(n),
            (None, Some(parent)) => Some(parent.network.clone()),
            (None, None) => None,
        };
        let network = decision.network(network).map_err(|e| Error::PermissionDenied(e.to_string()))?;
        // The parent's limits stand in for the defaults, kept under today's ceilings (the
        // policy may have tightened since the snapshot).
        let defaults = match inherited {
            Some(parent) => parent.limits.capped_by(&decision.ceilings),
            None => decision.defaults,
        };
        let limits = resolve_limits(&req.limits, &defaults, &decision.ceilings)?;
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
            labels,
            env,
            created_at: now,
            workdir,
            parent_snapshot_id: from_snapshot.clone(),
            expires_at: (req.ttl_seconds > 0).then(|| now + Duration::from_secs(req.ttl_seconds.into())),
            head_snapshot: from_snapshot,
            failure_reason: None,
            user,
            image_config,
            network,
            on_expiry: req.on_expiry,
            paused_at: None,
            ttl_seconds: req.ttl_seconds,
        };
        let entry = SandboxEntry::new(info.clone());
        {
            // Admission and the claim in one critical section: once in the table, this
            // sandbox's disk_bytes count against its pool for every later create.
            let mut map = self.sandboxes.write().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
            if let Err(e) = self.check_capacity(&map, tenant, isolation, &limits) {
                tracing::info!(tenant, tier = isolation.name(), memory_bytes = limits.memory_bytes, max_pids = limits.max_pids, disk_bytes = limits.disk_bytes, reason = %e, "create refused");
                return Err(e);
            }
            map.insert(id.clone(), entry.clone());
        }
        drop(image_held);
        if let Err(e) = self.store.put_sandbox(&info) {
            if let Ok(mut map) = self.sandboxes.write() {
                map.remove(&id);
            }
            return Err(e.into());
        }

        let started = std::time::Instant::now();
        let mut created = backend.create(&spec_of(&info)).await.map_err(Error::from);
        // A user the request names must exist in the sandbox (as an exec checks it): found
        // now, the create fails naming it, rather than every exec failing later with 126.
        if let (Ok(()), true, Some(spec)) = (&created, asked_user, info.user.as_deref()) {
            if let Err(e) = user_exists(backend.as_ref(), &id, spec).await {
                if let Err(destroyed) = backend.destroy(&id).await {
                    tracing::warn!(sandbox = %id, error = %destroyed, "destroying a sandbox created for an unknown user");
                }
                created = Err(e);
            }
        }
        match created {
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
                Err(match e {
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

    /// What the sandbox uses now; None while it is neither running nor paused (creating,
    /// failed, being re-adopted) or when its tier cannot tell.
    pub async fn usage(&self, tenant: &str, id: &str) -> Result<Option<crate::model::SandboxUsage>, Error> {
        let (sid, entry) = self.entry(tenant, id)?;
        let info = entry.info()?;
        if entry.is_pending() || !info.state.is_live() {
            return Ok(None);
        }
        match self.backends.get(info.isolation)?.usage(&sid).await {
            Ok(usage) => Ok(Some(usage)),
            Err(e) => {
                tracing::debug!(sandbox = %sid, error = %e, "no usage for a sandbox");
                Ok(None)
            }
        }
    }

    /// A new lifetime for the sandbox: reaped (or paused, see [`OnExpiry`]) `ttl_seconds` from
    /// now, or never for 0. Recorded, so it holds across restarts like the create's TTL. On a
    /// paused sandbox the lifetime starts when it is resumed (its clock is stopped).
    pub fn set_ttl(&self, tenant: &str, id: &str, ttl_seconds: u32) -> Result<SandboxInfo, Error> {
        let (sid, entry) = self.entry(tenant, id)?;
        let state = entry.read(|i| i.state)?;
        if !state.can_destroy() {
            return Err(Error::IncorrectState { id: sid.to_string(), state, operation: "change its TTL" });
        }
        let now = SystemTime::now();
        let info = entry.update(|i| {
            // While paused, `expires_at` is counted from the pause (see `expiry_after_resume`).
            let from = i.paused_at.unwrap_or(now);
            i.expires_at = (ttl_seconds > 0).then(|| from + Duration::from_secs(ttl_seconds.into()));
            i.ttl_seconds = ttl_seconds;
        })?;
        self.store.put_sandbox(&info)?;
        tracing::info!(sandbox = %sid, ttl_seconds, "sandbox TTL set");
        Ok(info)
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
        let (sid, entry) = self.ready_entry(tenant, id).await?;
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
        // A paused sandbox's execs are killed with the rest; their clocks need not wait.
        entry.paused.send_replace(false);
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

    /// Destroys (or, with [`OnExpiry::Pause`], pauses) sandboxes whose TTL has passed, and
    /// logs when a host resource nears or reaches its limit (see [`Manager::watch_pressure`]).
    /// Called periodically. A paused sandbox's clock is stopped: it never expires.
    pub async fn reap_expired(&self) {
        self.watch_pressure();
        let now = SystemTime::now();
        let expired: Vec<(SandboxId, String, bool)> = match self.sandboxes.read() {
            Ok(map) => map
                .iter()
                .filter_map(|(id, e)| {
                    let i = e.info().ok()?;
                    let due = matches!(i.state, SandboxState::Running | SandboxState::Failed) && i.expires_at.is_some_and(|t| t <= now);
                    // A FAILED sandbox has nothing left to pause: it goes.
                    due.then(|| (id.clone(), i.tenant, i.on_expiry == OnExpiry::Pause && i.state == SandboxState::Running))
                })
                .collect(),
            Err(_) => return,
        };
        for (id, tenant, pause) in expired {
            if pause {
                tracing::info!(sandbox = %id, "TTL expired; pausing (on_expiry PAUSE)");
                if let Err(e) = self.pause_as(&tenant, id.as_str(), true).await {
                    tracing::warn!(sandbox = %id, error = %e, "TTL pause failed");
                }
                continue;
            }
            tracing::info!(sandbox = %id, "TTL expired; destroying");
            if let Err(e) = self.destroy(&tenant, id.as_str()).await {
                tracing::warn!(sandbox = %id, error = %e, "TTL reap failed");
            }
        }
    }

    /// Pauses a sandbox: every process frozen in place (memory kept, no CPU used), execs,
    /// sessions and file calls refused until [`Manager::resume`], its TTL clock stopped. A
    /// paused sandbox is returned as it is. Its promises stay admitted: its memory is still held.
    #[tracing::instrument(name = "manager.pause", skip_all)]
    pub async fn pause(&self, tenant: &str, id: &str) -> Result<SandboxInfo, Error> {
        self.pause_as(tenant, id, false).await
    }

    /// [`Manager::pause`]; `by_ttl` when its TTL does it (the reaper: then only a sandbox still
    /// running and still expired is paused, as a resume or SetSandboxTtl may have come first).
    async fn pause_as(&self, tenant: &str, id: &str, by_ttl: bool) -> Result<SandboxInfo, Error> {
        let (sid, entry) = self.ready_entry(tenant, id).await?;
        let started = std::time::Instant::now();
        // Serialized with snapshot, rollback, destroy and resume: a snapshot's own freeze and
        // thaw never meet a pause's.
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if info.state == SandboxState::Paused {
            return Ok(info);
        }
        if !info.state.can_pause() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "pause" });
        }
        if by_ttl && info.expires_at.is_none_or(|t| t > SystemTime::now()) {
            return Ok(info);
        }
        let backend = self.backends.get(info.isolation)?.clone();
        // PAUSED before the freeze, so no new exec or file call starts into a sandbox being
        // frozen, and the execs' clock stops with it; put back if the freeze fails.
        let now = SystemTime::now();
        let paused = entry.update(|i| {
            i.state = SandboxState::Paused;
            i.paused_at = Some(now);
        })?;
        entry.paused.send_replace(true);
        if let Err(e) = backend.pause(&sid).await {
            entry.update(|i| {
                i.state = SandboxState::Running;
                i.paused_at = None;
            })?;
            entry.paused.send_replace(false);
            tracing::warn!(sandbox = %sid, error = %e, "sandbox pause failed");
            return Err(e.into());
        }
        self.store.put_sandbox(&paused)?;
        tracing::info!(sandbox = %sid, tier = info.isolation.name(), by_ttl, ms = started.elapsed().as_millis() as u64, "sandbox paused");
        Ok(paused)
    }

    /// Resumes a paused sandbox: its processes go on where they stopped, and its TTL with what
    /// was left of it (or `ttl_seconds` from now when not 0; see
    /// [`SandboxInfo::expiry_after_resume`]). A running sandbox is returned as it is, with the
    /// new TTL when one is given.
    #[tracing::instrument(name = "manager.resume", skip_all)]
    pub async fn resume(&self, tenant: &str, id: &str, ttl_seconds: u32) -> Result<SandboxInfo, Error> {
        let (sid, entry) = self.ready_entry(tenant, id).await?;
        let started = std::time::Instant::now();
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if !info.state.can_resume() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "resume" });
        }
        if info.state == SandboxState::Running {
            if ttl_seconds == 0 {
                return Ok(info);
            }
            let info = entry.update(|i| {
                i.expires_at = Some(SystemTime::now() + Duration::from_secs(ttl_seconds.into()));
                i.ttl_seconds = ttl_seconds;
            })?;
            self.store.put_sandbox(&info)?;
            return Ok(info);
        }
        self.backends.get(info.isolation)?.resume(&sid).await.inspect_err(|e| tracing::warn!(sandbox = %sid, error = %e, "sandbox resume failed"))?;
        let now = SystemTime::now();
        let info = entry.update(|i| {
            i.expires_at = i.expiry_after_resume(now, ttl_seconds);
            if ttl_seconds > 0 {
                i.ttl_seconds = ttl_seconds;
            }
            i.state = SandboxState::Running;
            i.paused_at = None;
        })?;
        entry.paused.send_replace(false);
        self.store.put_sandbox(&info)?;
        tracing::info!(sandbox = %sid, tier = info.isolation.name(), ms = started.elapsed().as_millis() as u64, "sandbox resumed");
        Ok(info)
    }
}

/// `base` with `over`'s entries added, replacing those of the same key.
fn merged(base: &BTreeMap<String, String>, over: BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut map = base.clone();
    map.extend(over);
    map
}

/// Whether `spec` names a user (and group) of the sandbox's /etc/passwd and /etc/group, read as
/// an exec would read them; `InvalidArgument` on the field `user` when it does not.
async fn user_exists(backend: &dyn crate::backend::Backend, id: &SandboxId, spec: &str) -> Result<(), Error> {
    // The same bound the exec side reads them with.
    const MAX_DB_BYTES: u64 = 4 << 20;
    let read = |path: &'static str| async move {
        match backend.read_file(id, path, 0, MAX_DB_BYTES).await {
            Ok(chunk) => Ok(String::from_utf8_lossy(&chunk.content).into_owned()),
            Err(crate::backend::BackendError::FileNotFound { .. }) => Ok(String::new()),
            Err(e) => Err(Error::from(e)),
        }
    };
    let passwd = read("/etc/passwd").await?;
    let group = read("/etc/group").await?;
    match sandbox_exec::user::resolve_in(spec, &passwd, &group) {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::invalid("user", e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::fake::{fake_manager, fake_manager_on, with_disk};
    use crate::admission::Host;
    use crate::error::Error;
    use crate::model::{CreateRequest, ExecRequest, ExecStatus, RequestedLimits};

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_creates_never_overcommit_the_pool_and_forks_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Strict promises: an operator's choice, and the case where the last room is contended.
        let m = fake_manager(dir.path(), 8 << 30, "[admission]\ndisk_overcommit = 1.0\n");
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
        let snap = m.snapshot("t", sb.id.as_str(), "s", None).await.expect("snapshot");
        m.destroy("t", sb.id.as_str()).await.expect("destroy");
        let fork = CreateRequest { from_snapshot_id: snap.snapshot_id.to_string(), ..Default::default() };
        m.create("t", fork.clone()).await.expect("the fork fits the freed room");
        let err = m.create("t", fork).await.expect_err("a second fork does not");
        assert!(err.to_string().contains("8 GiB of 8 GiB"), "{err}");
    }

    #[tokio::test]
    async fn a_ttl_is_extended_cleared_and_kept_in_the_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let sb = m.create("t", CreateRequest { ttl_seconds: 1, ..Default::default() }).await.expect("create");
        let first = sb.expires_at.expect("a TTL");
        let longer = m.set_ttl("t", sb.id.as_str(), 3600).expect("extend");
        assert!(longer.expires_at.expect("a TTL") > first + std::time::Duration::from_secs(3000));
        m.reap_expired().await;
        assert!(m.get("t", sb.id.as_str()).is_ok(), "an extended sandbox is not reaped at its old time");
        assert!(m.set_ttl("t", sb.id.as_str(), 0).expect("clear").expires_at.is_none());
        assert!(m.store.sandboxes().expect("records").iter().any(|r| r.id == sb.id && r.expires_at.is_none()), "recorded");
        let err = m.set_ttl("other", sb.id.as_str(), 60).expect_err("another tenant's");
        assert!(matches!(err, Error::SandboxNotFound(_)), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pause_is_idempotent_refuses_work_stops_the_clocks_and_survives_a_restart() {
        use crate::model::{OnExpiry, SandboxState};
        use std::time::{Duration, Instant};
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let sb = m.create("t", CreateRequest { ttl_seconds: 3600, ..Default::default() }).await.expect("create");
        let id = sb.id.as_str();
        // A 400 ms command, started before the pause: its running time stops with the sandbox.
        let bg = m
            .exec("t", ExecRequest { sandbox_id: id.into(), argv: vec!["sleep".into(), "400".into()], background: true, ..Default::default() })
            .await
            .expect("exec");
        let t0 = Instant::now();
        let paused = m.pause("t", id).await.expect("pause");
        assert_eq!(paused.state, SandboxState::Paused);
        let again = m.pause("t", id).await.expect("pausing again is no error");
        assert_eq!(again.paused_at, paused.paused_at, "and changes nothing");
        let err = m.exec("t", ExecRequest { sandbox_id: id.into(), argv: vec!["true".into()], ..Default::default() }).await.expect_err("exec while paused");
        assert!(matches!(err, Error::IncorrectState { state: SandboxState::Paused, .. }) && err.to_string().contains("resume"), "{err}");
        let err = m.write_file("t", id, "/x", b"x", 0o644).await.expect_err("a write while paused");
        assert!(matches!(err, Error::IncorrectState { .. }), "{err}");
        assert!(matches!(m.snapshot("t", id, "s", None).await, Err(Error::IncorrectState { .. })), "no snapshot of a paused sandbox");
        // Paused for 1 s: the 400 ms command has not ended, and the TTL is not reaped.
        tokio::time::sleep(Duration::from_secs(1)).await;
        m.reap_expired().await;
        assert_eq!(m.get_exec("t", bg.exec_id.as_str(), false).await.expect("record").outcome.status, crate::model::ExecStatus::Running);
        let resumed = m.resume("t", id, 0).await.expect("resume");
        assert_eq!(resumed.state, SandboxState::Running);
        let left = resumed.expires_at.expect("a TTL").duration_since(std::time::SystemTime::now()).expect("in the future");
        assert!(left > Duration::from_secs(3590), "the TTL ran on while paused: {left:?} left");
        let ended = m.get_exec("t", bg.exec_id.as_str(), true).await.expect("record");
        assert_eq!(ended.outcome.status, crate::model::ExecStatus::Exited);
        assert!(t0.elapsed() >= Duration::from_millis(1300), "the command ended {:?} after the pause began: its clock ran on", t0.elapsed());
        assert_eq!(m.resume("t", id, 0).await.expect("resuming a running sandbox").state, SandboxState::Running);

        // On record: a daemon started over the same state has it paused, and its TTL-pause kin too.
        let by_ttl = m.create("t", CreateRequest { ttl_seconds: 1, on_expiry: OnExpiry::Pause, ..Default::default() }).await.expect("create");
        m.pause("t", id).await.expect("pause");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        m.reap_expired().await;
        assert_eq!(m.get("t", by_ttl.id.as_str()).expect("paused, not reaped").state, SandboxState::Paused);
        drop(m);
        let m = fake_manager(dir.path(), 8 << 30, "");
        m.recover().await.expect("recover");
        for sid in [id, by_ttl.id.as_str()] {
            let (_, entry) = m.ready_entry("t", sid).await.expect("re-adopted");
            assert_eq!(entry.info().expect("info").state, SandboxState::Paused, "{sid} after a restart");
            assert!(*entry.paused.borrow(), "its execs' clock is stopped");
        }
        // An expiry pause resumed without a TTL gets its TTL again.
        let back = m.resume("t", by_ttl.id.as_str(), 0).await.expect("resume");
        assert!(back.expires_at.is_some_and(|e| e > std::time::SystemTime::now()), "{back:?}");
        m.destroy("t", id).await.expect("destroying a paused sandbox");
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
        let r = m.exec("t", ExecRequest { sandbox_id: sb.id.to_string(), argv: vec!["true".into()], ..Default::default() }).await.expect("exec");
        assert_eq!(r.outcome.status, ExecStatus::Exited);
    }

    #[tokio::test]
    async fn a_fork_inherits_what_its_parent_was_given_unless_the_request_overrides_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let map = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>();
        let parent = CreateRequest {
            limits: RequestedLimits { memory_bytes: 1 << 30, cpu_millicores: 500, disk_bytes: 2 << 30, ..Default::default() },
            env: map(&[("A", "1"), ("B", "2")]),
            labels: map(&[("team", "x"), ("run", "7")]),
            workdir: "/src".into(),
            ..Default::default()
        };
        let parent = m.create("t", parent).await.expect("parent");
        let snap = m.snapshot("t", parent.id.as_str(), "s", None).await.expect("snapshot");

        let fork = m.create("t", CreateRequest { from_snapshot_id: snap.snapshot_id.to_string(), ..Default::default() }).await.expect("fork");
        assert_eq!(fork.limits, parent.limits, "limits are inherited, not the defaults");
        assert_eq!((&fork.env, &fork.labels, fork.workdir.as_str()), (&parent.env, &parent.labels, "/src"));

        let overridden = CreateRequest {
            from_snapshot_id: snap.snapshot_id.to_string(),
            limits: RequestedLimits { memory_bytes: 256 << 20, ..Default::default() },
            env: map(&[("B", "3")]),
            labels: map(&[("run", "8")]),
            workdir: "/other".into(),
            ..Default::default()
        };
        let fork = m.create("t", overridden).await.expect("fork with overrides");
        assert_eq!((fork.limits.memory_bytes, fork.limits.cpu_millicores, fork.limits.disk_bytes), (256 << 20, 500, 2 << 30));
        assert_eq!(fork.env, map(&[("A", "1"), ("B", "3")]));
        assert_eq!(fork.labels, map(&[("team", "x"), ("run", "8")]));
        assert_eq!(fork.workdir, "/other");
    }

    fn limits(memory_bytes: u64, max_pids: u32) -> CreateRequest {
        CreateRequest { limits: RequestedLimits { memory_bytes, max_pids, disk_bytes: 16 << 20, ..Default::default() }, ..Default::default() }
    }

    #[tokio::test]
    async fn memory_and_pids_are_admitted_host_wide_and_per_tenant_naming_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = Host { memory_bytes: 24 << 30, pid_max: 32_768 };
        let toml = "[admission]\nmemory_overcommit = 1.5\npids_overcommit = 1.0\nmax_memory_bytes_per_tenant = 12884901888\n";
        let m = fake_manager_on(dir.path(), 64 << 30, toml, host);
        // 20 sandboxes of 8 GiB on a 24 GiB host: (24 − 1) × 1.5 = 34.5 GiB promisable, so 4.
        let mut admitted = 0;
        for tenant in ["a", "b", "c", "d", "e"] {
            for _ in 0..4 {
                match m.create(tenant, limits(8 << 30, 64)).await {
                    Ok(_) => admitted += 1,
                    Err(Error::ResourceExhausted(msg)) => {
                        assert!(msg.contains("admission.memory_overcommit 1.5") || msg.contains("admission.max_memory_bytes_per_tenant (12 GiB)"), "{msg}");
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        assert_eq!(admitted, 4, "one 8 GiB sandbox per tenant (12 GiB tenant quota) until the host's 34.5 GiB are promised");
        // Pids: 4,096 each, within 32,768 − 2,048.
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager_on(dir.path(), 64 << 30, "[admission]\npids_overcommit = 1.0\n", host);
        for _ in 0..7 {
            m.create("t", limits(64 << 20, 4096)).await.expect("within pid_max");
        }
        match m.create("t", limits(64 << 20, 4096)).await {
            Err(Error::ResourceExhausted(msg)) => assert!(msg.contains("admission.pids_reserve 2048") && msg.contains("28672 promised"), "{msg}"),
            other => panic!("expected the pids refusal: {other:?}"),
        }
        m.create("t", limits(64 << 20, 2048)).await.expect("what is left still fits");
    }

    #[tokio::test]
    async fn the_defaults_admit_a_thousand_default_sandboxes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = Host { memory_bytes: 24 << 30, pid_max: 32_768 };
        // The pool file's default: half of 80 GB free.
        let m = fake_manager_on(dir.path(), 40_000_000_000, "", host);
        let creates = (0..1000).map(|_| {
            let m = m.clone();
            tokio::spawn(async move { m.create("t", CreateRequest::default()).await })
        });
        for (i, r) in futures::future::join_all(creates).await.into_iter().enumerate() {
            r.expect("task").unwrap_or_else(|e| panic!("sandbox {i}: {e}"));
        }
        assert!(m.render_metrics().contains("sandboxd_host_admission{kind=\"promised\",resource=\"memory\"} 536870912000"), "1,000 × 512 MiB promised");
    }
}
