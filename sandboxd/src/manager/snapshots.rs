//! Snapshots of a sandbox's filesystem: take, list, roll back to, delete.

use std::time::SystemTime;

use super::validate::validate_snapshot_name;
use super::Manager;
use crate::admission::human_bytes;
use crate::backend::BackendError;
use crate::error::Error;
use crate::ids::{SandboxId, SnapshotId};
use crate::metrics::Op;
use crate::model::{Isolation, SandboxInfo, SandboxOrigin, SandboxState, SnapshotRecord};

/// Snapshots a tenant and one of its sandboxes hold: counts and `size_bytes`.
#[derive(Debug, Default)]
struct SnapshotHoldings {
    sandbox_count: usize,
    sandbox_bytes: u64,
    tenant_count: usize,
    tenant_bytes: u64,
}

impl Manager {
    /// The snapshot `id` if it belongs to `tenant` (NOT_FOUND otherwise, like the sandboxes).
    pub(super) fn snapshot_record(&self, tenant: &str, id: &str) -> Result<SnapshotRecord, Error> {
        let sid = SnapshotId::parse(id).map_err(|_| Error::SnapshotNotFound(id.chars().take(80).collect()))?;
        match self.store.snapshot(sid.as_str())? {
            Some(snap) if snap.tenant == tenant => Ok(snap),
            _ => Err(Error::SnapshotNotFound(sid.to_string())),
        }
    }

    /// Captures the sandbox's filesystem as a new snapshot.
    #[tracing::instrument(name = "manager.snapshot", skip_all)]
    pub async fn snapshot(&self, tenant: &str, sandbox_id: &str, name: &str, include_memory: Option<bool>) -> Result<SnapshotRecord, Error> {
        let (sid, entry) = self.ready_entry(tenant, sandbox_id).await?;
        validate_snapshot_name(name)?;
        let _op = entry.op.lock().await;
        let info = entry.info()?;
        if !info.state.can_snapshot() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "snapshot" });
        }
        // One snapshot of a tenant at a time from its admission until it is on record, so two
        // concurrent snapshots never both take the tenant's last room.
        // Memory (and device state) only a microVM has to give; it is that tier's default.
        let memory = include_memory.unwrap_or(info.isolation == Isolation::MicroVm);
        if memory && info.isolation != Isolation::MicroVm {
            return Err(Error::invalid("include_memory", format!("only a microVM sandbox's memory can be snapshotted; {sid} is {:?}", info.isolation)));
        }
        let tenant_lock = self.snapshot_lock(tenant)?;
        let _admitted = tenant_lock.lock().await;
        let held = self.snapshot_holdings(tenant, &sid)?;
        self.admit_snapshot(tenant, &sid, &held, 0)?;
        let snap_id = SnapshotId::generate_on(self.node());
        let started = std::time::Instant::now();
        let backend = self.backends.get(info.isolation)?;
        let size_bytes = backend.snapshot(&sid, &snap_id, memory).await?;
        // Its size is known once it exists: one that does not fit goes again.
        if let Err(e) = self.admit_snapshot(tenant, &sid, &held, size_bytes) {
            if let Err(del) = backend.delete_snapshot(&snap_id).await {
                tracing::error!(snapshot = %snap_id, error = %del, "cannot delete a snapshot refused by admission");
            }
            return Err(e);
        }
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
            origin: Some(SandboxOrigin {
                limits: info.limits,
                env: info.env.clone(),
                labels: info.labels.clone(),
                workdir: info.workdir.clone(),
                user: info.user.clone(),
                network: info.network.clone(),
            }),
            memory,
        };
        self.store.put_snapshot(&record)?;
        let info = entry.update(|i| i.head_snapshot = Some(snap_id.clone()))?;
        self.store.put_sandbox(&info)?;
        tracing::info!(sandbox = %sid, snapshot = %snap_id, size_bytes, ms = started.elapsed().as_millis() as u64, "snapshot taken");
        Ok(record)
    }

    /// The per-tenant lock of snapshot admission.
    fn snapshot_lock(&self, tenant: &str) -> Result<std::sync::Arc<tokio::sync::Mutex<()>>, Error> {
        let mut locks = self.snapshot_locks.lock().map_err(|_| Error::Internal("snapshot locks poisoned".into()))?;
        Ok(locks.entry(tenant.to_string()).or_default().clone())
    }

    /// What `tenant` and its sandbox `sid` hold in snapshots now.
    fn snapshot_holdings(&self, tenant: &str, sid: &SandboxId) -> Result<SnapshotHoldings, Error> {
        let mut held = SnapshotHoldings::default();
        for s in self.store.snapshots(None)?.into_iter().filter(|s| s.tenant == tenant) {
            held.tenant_count += 1;
            held.tenant_bytes = held.tenant_bytes.saturating_add(s.size_bytes);
            if &s.sandbox_id == sid {
                held.sandbox_count += 1;
                held.sandbox_bytes = held.sandbox_bytes.saturating_add(s.size_bytes);
            }
        }
        Ok(held)
    }

    /// Whether one more snapshot of `size_bytes` (0 before it is taken) fits the snapshot
    /// quotas of the sandbox and the tenant, naming the key and the numbers when it does not.
    fn admit_snapshot(&self, tenant: &str, sid: &SandboxId, held: &SnapshotHoldings, size_bytes: u64) -> Result<(), Error> {
        let a = &self.cfg.admission;
        let hint = "delete snapshots with DeleteSnapshot";
        if held.sandbox_count >= a.max_snapshots_per_sandbox {
            return Err(Error::ResourceExhausted(format!(
                "admission.max_snapshots_per_sandbox ({}) reached: sandbox {sid} has {} snapshots; {hint}",
                a.max_snapshots_per_sandbox, held.sandbox_count
            )));
        }
        if held.tenant_count >= a.max_snapshots_per_tenant {
            return Err(Error::ResourceExhausted(format!(
                "admission.max_snapshots_per_tenant ({}) reached: tenant {tenant:?} has {} snapshots; {hint}",
                a.max_snapshots_per_tenant, held.tenant_count
            )));
        }
        // Before the snapshot exists (size 0) a quota already used up refuses it; after, its
        // own bytes must fit.
        let over = |held: u64, max: u64| if size_bytes == 0 { held >= max } else { held.saturating_add(size_bytes) > max };
        if over(held.sandbox_bytes, a.max_snapshot_bytes_per_sandbox) {
            return Err(Error::ResourceExhausted(format!(
                "admission.max_snapshot_bytes_per_sandbox ({}) reached: the snapshots of sandbox {sid} hold {}, this one {}; {hint}",
                human_bytes(a.max_snapshot_bytes_per_sandbox),
                human_bytes(held.sandbox_bytes),
                human_bytes(size_bytes)
            )));
        }
        if over(held.tenant_bytes, a.max_snapshot_bytes_per_tenant) {
            return Err(Error::ResourceExhausted(format!(
                "admission.max_snapshot_bytes_per_tenant ({}) reached: the snapshots of tenant {tenant:?} hold {}, this one {}; {hint}",
                human_bytes(a.max_snapshot_bytes_per_tenant),
                human_bytes(held.tenant_bytes),
                human_bytes(size_bytes)
            )));
        }
        Ok(())
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
        let (sid, entry) = self.ready_entry(tenant, sandbox_id).await?;
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
            // Refused before anything changed: the sandbox runs on as it was.
            Err(e @ BackendError::SnapshotUnusable { .. }) => return Err(e.into()),
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
}

#[cfg(test)]
mod tests {
    use super::super::fake::{fake_manager, with_disk, FAKE_SNAPSHOT_BYTES};
    use crate::error::Error;

    fn refused(r: Result<impl std::fmt::Debug, Error>, key: &str) {
        match r {
            Err(Error::ResourceExhausted(m)) => assert!(m.contains(key), "{key} not in: {m}"),
            other => panic!("expected RESOURCE_EXHAUSTED naming {key}, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn snapshots_are_capped_by_count_per_sandbox_and_tenant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 64 << 30, "[admission]\nmax_snapshots_per_sandbox = 2\nmax_snapshots_per_tenant = 3\n");
        let a = m.create("t", with_disk(1 << 30)).await.expect("a");
        let b = m.create("t", with_disk(1 << 30)).await.expect("b");
        let first = m.snapshot("t", a.id.as_str(), "1", None).await.expect("1st of a");
        m.snapshot("t", a.id.as_str(), "2", None).await.expect("2nd of a");
        refused(m.snapshot("t", a.id.as_str(), "3", None).await, "admission.max_snapshots_per_sandbox (2)");
        m.snapshot("t", b.id.as_str(), "1", None).await.expect("1st of b");
        refused(m.snapshot("t", b.id.as_str(), "2", None).await, "admission.max_snapshots_per_tenant (3)");
        let other = m.create("u", with_disk(1 << 30)).await.expect("another tenant");
        m.snapshot("u", other.id.as_str(), "1", None).await.expect("another tenant's quota is its own");
        // A deleted snapshot gives its room back; a destroyed sandbox's snapshots still count.
        m.delete_snapshot("t", first.snapshot_id.as_str()).await.expect("delete");
        m.snapshot("t", a.id.as_str(), "3", None).await.expect("room again");
        m.destroy("t", b.id.as_str()).await.expect("destroy b");
        let c = m.create("t", with_disk(1 << 30)).await.expect("c");
        refused(m.snapshot("t", c.id.as_str(), "1", None).await, "admission.max_snapshots_per_tenant (3)");
        assert_eq!(m.store.snapshots(None).expect("list").len(), 4, "a refused snapshot leaves nothing behind");
    }

    #[tokio::test]
    async fn snapshots_are_capped_by_bytes_and_one_that_does_not_fit_is_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let toml =
            format!("[admission]\nmax_snapshot_bytes_per_sandbox = {}\nmax_snapshot_bytes_per_tenant = {}\n", 2 * FAKE_SNAPSHOT_BYTES, 3 * FAKE_SNAPSHOT_BYTES);
        let m = fake_manager(dir.path(), 64 << 30, &toml);
        let a = m.create("t", with_disk(1 << 30)).await.expect("a");
        let b = m.create("t", with_disk(1 << 30)).await.expect("b");
        m.snapshot("t", a.id.as_str(), "1", None).await.expect("64 MiB");
        m.snapshot("t", a.id.as_str(), "2", None).await.expect("128 MiB: exactly the sandbox's quota");
        refused(m.snapshot("t", a.id.as_str(), "3", None).await, "admission.max_snapshot_bytes_per_sandbox (128 MiB)");
        m.snapshot("t", b.id.as_str(), "1", None).await.expect("the tenant's 192 MiB");
        refused(m.snapshot("t", b.id.as_str(), "2", None).await, "admission.max_snapshot_bytes_per_tenant (192 MiB)");
        assert_eq!(m.store.snapshots(None).expect("list").len(), 3);
    }
}
