//! Snapshots of a sandbox's filesystem: take, list, roll back to, delete.

use std::time::SystemTime;

use super::validate::validate_snapshot_name;
use super::Manager;
use crate::error::Error;
use crate::ids::{SandboxId, SnapshotId};
use crate::metrics::Op;
use crate::model::{SandboxInfo, SandboxOrigin, SandboxState, SnapshotRecord};

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
    pub async fn snapshot(&self, tenant: &str, sandbox_id: &str, name: &str) -> Result<SnapshotRecord, Error> {
        let (sid, entry) = self.ready_entry(tenant, sandbox_id).await?;
        validate_snapshot_name(name)?;
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
            origin: Some(SandboxOrigin {
                limits: info.limits,
                env: info.env.clone(),
                labels: info.labels.clone(),
                workdir: info.workdir.clone(),
                user: info.user.clone(),
            }),
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
