//! Snapshots, rollback and forks of container sandboxes.
//!
//! Measured on the reference machine (2 cores, Docker 20.10, fuse-overlayfs), through the API:
//! `docker commit` of a container with a few changed files takes ~0.9 s, starting a container
//! 0.4–1.0 s, creating one ~60 ms, renaming ~10 ms. So:
//!
//! * **Snapshot** = freeze the container's cgroup (no process is between two writes), `syncfs`
//!   its root (dirty FUSE pages reach the overlay's upper directory), copy the upper directory
//!   (the writable layer: changed files, whiteouts, opaque markers) to
//!   `<state>/container/snapshots/<id>`, thaw. Cost grows with the bytes changed since the image,
//!   not with the image; milliseconds for typical agent edits.
//! * **Fork** = create a container from the image, copy the snapshot into its empty upper
//!   directory before it starts, start it.
//! * **Rollback** would cost a container start (≥ 0.4 s) if done the same way. Instead, each
//!   snapshot (and each rollback target) gets a **standby**: a container of the same sandbox
//!   (same id label, limits, hostname) started from the snapshot in the background. A rollback
//!   kills the old container's processes, renames it out of the way, renames the standby to the
//!   sandbox's name and serves from it: tens of milliseconds. The old container is removed and a
//!   new standby prepared in the background. A rollback with no standby ready (a snapshot other
//!   than the latest, or one taken a moment ago) waits for it or falls back to the fork path.
//!   One standby per sandbox at most: while it waits it costs an idle container (docker-init,
//!   sh, sleep, a containerd shim and a fuse-overlayfs process).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bollard::query_parameters::RenameContainerOptions;
use tokio::task::JoinHandle;

use super::docker::{self, api_error};
use super::setup::Role;
use super::{layer, ContainerSandbox, Inner};
use crate::backend::{BackendError, SandboxSpec};
use crate::ids::{SandboxId, SnapshotId};

/// How long a rollback waits for a standby that is still starting before starting its own.
const STANDBY_WAIT: Duration = Duration::from_secs(30);

/// A container being prepared (or ready) to take over a sandbox on rollback to `snapshot`.
pub struct Standby {
    snapshot: SnapshotId,
    task: JoinHandle<Option<Arc<ContainerSandbox>>>,
}

/// Flushes the container's root filesystem: dirty pages of the FUSE mount reach fuse-overlayfs
/// and so the upper directory (fuse-overlayfs itself runs outside the frozen cgroup).
fn syncfs_root(init_pid: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let root = std::fs::File::open(format!("/proc/{init_pid}/root"))?;
    // SAFETY: syncfs only takes a descriptor we own for the duration of the call.
    if unsafe { libc::syncfs(root.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Inner {
    /// Where snapshot `snap` keeps its copy of a writable layer.
    pub(super) fn snapshot_dir(&self, snap: &SnapshotId) -> PathBuf {
        self.snapshots_dir.join(snap.as_str())
    }

    /// Captures the sandbox's writable layer as `snapshot`; returns its size in bytes.
    pub(super) async fn snapshot(self: &Arc<Self>, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<u64, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let upper = match &sb.upper_dir {
            Some(u) => u.clone(),
            None => self.upper_dir_of(&sb.container_id).await?,
        };
        let dest = self.snapshot_dir(snapshot);
        let tmp = self.snapshots_dir.join(format!(".{snapshot}.tmp"));
        let started = Instant::now();
        let sb2 = sb.clone();
        let tmp2 = tmp.clone();
        let copied = tokio::task::spawn_blocking(move || -> Result<layer::CopyStats, BackendError> {
            std::fs::create_dir(&tmp2).map_err(|e| BackendError::io(format!("creating {}", tmp2.display()), e))?;
            sb2.cgroup.freeze().map_err(|e| BackendError::Internal(format!("freezing the container for a snapshot: {e}")))?;
            let copied = syncfs_root(sb2.init_pid)
                .map_err(|e| BackendError::io("flushing the container's filesystem", e))
                .and_then(|()| layer::copy_tree(&upper, &tmp2).map_err(|e| BackendError::io("copying the writable layer", e)));
            if let Err(e) = sb2.cgroup.thaw() {
                tracing::error!(container = %sb2.container_id, error = %e, "cannot thaw the container after a snapshot");
            }
            copied
        })
        .await
        .map_err(|e| BackendError::Internal(format!("snapshot task: {e}")))?;
        let stats = match copied.and_then(|s| std::fs::rename(&tmp, &dest).map(|()| s).map_err(|e| BackendError::io("publishing the snapshot", e))) {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        tracing::debug!(sandbox = %sandbox, snapshot = %snapshot, bytes = stats.bytes, ms = started.elapsed().as_millis() as u64, "writable layer copied");
        self.prepare_standby(sb.spec.clone(), snapshot.clone());
        Ok(stats.bytes)
    }

    /// Puts the sandbox back to `snapshot`: a new container serves it, every process of the old
    /// one is killed (running execs end as LOST).
    pub(super) async fn rollback(self: &Arc<Self>, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<(), BackendError> {
        if !self.snapshot_dir(snapshot).is_dir() {
            return Err(BackendError::NoSuchSnapshot(snapshot.clone()));
        }
        let docker = self.docker()?.clone();
        let old = self.take_sandbox(sandbox).ok_or_else(|| BackendError::NoSuchSandbox(sandbox.clone()))?;
        let standby = self.take_standby(sandbox, snapshot);
        let spec = old.spec.clone();

        // The old container: processes gone now, the container itself later, out of the way.
        old.mark_lost(&format!("the sandbox was rolled back to {snapshot}"));
        super::net::detach(self, &old).await;
        old.kill_everything().await;
        old.remove_exec_cgroups();
        let replaced = format!("{}-replaced-{}", docker::active_name(sandbox), crate::ids::random_suffix(8));
        if let Err(e) = docker.rename_container(&old.container_id, RenameContainerOptions { name: replaced }).await {
            tracing::warn!(container = %old.container_id, error = %e, "cannot rename the replaced container; removing it now");
            self.remove_container(&old.container_id).await;
        }
        let background = self.clone();
        let old_id = old.container_id.clone();
        self.spawn_background(async move { background.remove_container(&old_id).await });

        let mut served = None;
        if let Some(mut task) = standby {
            match tokio::time::timeout(STANDBY_WAIT, &mut task).await {
                Ok(Ok(Some(sb))) => match self.promote(&sb).await {
                    Ok(()) => served = Some(sb),
                    Err(e) => {
                        tracing::warn!(sandbox = %sandbox, error = %e, "standby unusable; starting from the snapshot");
                        self.remove_container(&sb.container_id).await;
                    }
                },
                Ok(_) => tracing::warn!(sandbox = %sandbox, "standby failed to start; starting from the snapshot"),
                Err(_) => {
                    tracing::warn!(sandbox = %sandbox, "standby not ready in time; starting from the snapshot");
                    // Still starting: removed once it has (not left running beside its sandbox).
                    self.spawn_discard(Standby { snapshot: snapshot.clone(), task });
                }
            }
        }
        let sb = match served {
            Some(sb) => sb,
            None => self.launch(&spec, &Role::Active, Some(snapshot)).await?,
        };
        // The new container's namespace gets the link (a standby never has one: it was made
        // before anyone knew it would serve).
        if let Err(e) = super::net::attach(self, &sb).await {
            self.tear_down(&sb, "network setup failed").await;
            return Err(e);
        }
        self.insert_sandbox(sb)?;
        // Agents retry: the next rollback to the same snapshot should be as fast.
        self.prepare_standby(spec, snapshot.clone());
        Ok(())
    }

    /// Makes a standby the sandbox's serving container (it already runs).
    async fn promote(&self, sb: &Arc<ContainerSandbox>) -> Result<(), BackendError> {
        let docker = self.docker()?;
        let name = docker::active_name(&sb.spec.id);
        docker
            .rename_container(&sb.container_id, RenameContainerOptions { name })
            .await
            .map_err(|e| api_error(format!("renaming standby {}", sb.container_id), e))?;
        if std::fs::metadata(format!("/proc/{}", sb.init_pid)).is_err() {
            return Err(BackendError::Internal(format!("standby container {} is no longer running", sb.container_id)));
        }
        Ok(())
    }

    /// Starts preparing a standby of `spec`'s sandbox at `snapshot`, replacing one for another
    /// snapshot.
    pub(super) fn prepare_standby(self: &Arc<Self>, spec: SandboxSpec, snapshot: SnapshotId) {
        let Ok(mut map) = self.standbys.lock() else { return };
        if map.get(&spec.id).is_some_and(|s| s.snapshot == snapshot) {
            return;
        }
        if let Some(old) = map.remove(&spec.id) {
            self.spawn_discard(old);
        }
        let inner = self.clone();
        let id = spec.id.clone();
        let snap = snapshot.clone();
        let task = tokio::spawn(async move {
            match inner.launch(&spec, &Role::Standby(snap.clone()), Some(&snap)).await {
                Ok(sb) => Some(sb),
                Err(e) => {
                    tracing::warn!(sandbox = %spec.id, snapshot = %snap, error = %e, "cannot prepare a standby container");
                    None
                }
            }
        });
        map.insert(id, Standby { snapshot, task });
    }

    fn take_standby(&self, sandbox: &SandboxId, snapshot: &SnapshotId) -> Option<JoinHandle<Option<Arc<ContainerSandbox>>>> {
        let mut map = self.standbys.lock().ok()?;
        if map.get(sandbox).is_some_and(|s| &s.snapshot == snapshot) {
            return map.remove(sandbox).map(|s| s.task);
        }
        None
    }

    /// Removes a standby's container once it has started (in the background).
    fn spawn_discard(self: &Arc<Self>, standby: Standby) {
        let inner = self.clone();
        self.spawn_background(async move { inner.discard(standby).await });
    }

    async fn discard(&self, standby: Standby) {
        if let Ok(Some(sb)) = standby.task.await {
            self.remove_unlinked(&sb, "the standby was discarded").await;
        }
    }

    /// Drops the standby of a sandbox (being destroyed).
    pub(super) fn discard_standby(self: &Arc<Self>, sandbox: &SandboxId) {
        let standby = self.standbys.lock().ok().and_then(|mut m| m.remove(sandbox));
        if let Some(s) = standby {
            self.spawn_discard(s);
        }
    }

    /// Drops every standby and waits for their containers to go (shutdown).
    pub(super) async fn discard_all_standbys(&self) {
        let all: Vec<Standby> = self.standbys.lock().map(|mut m| m.drain().map(|(_, s)| s).collect()).unwrap_or_default();
        let _ = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(all.into_iter().map(|s| self.discard(s)))).await;
    }

    /// Frees a snapshot (and any standby started from it).
    pub(super) async fn delete_snapshot(self: &Arc<Self>, snapshot: &SnapshotId) -> Result<(), BackendError> {
        let standbys: Vec<Standby> = match self.standbys.lock() {
            Ok(mut map) => {
                let ids: Vec<SandboxId> = map.iter().filter(|(_, s)| &s.snapshot == snapshot).map(|(id, _)| id.clone()).collect();
                ids.iter().filter_map(|id| map.remove(id)).collect()
            }
            Err(_) => Vec::new(),
        };
        for s in standbys {
            self.spawn_discard(s);
        }
        let dir = self.snapshot_dir(snapshot);
        if !dir.is_dir() {
            return Err(BackendError::NoSuchSnapshot(snapshot.clone()));
        }
        tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir).map_err(|e| BackendError::io(format!("removing {}", dir.display()), e)))
            .await
            .map_err(|e| BackendError::Internal(format!("delete task: {e}")))?
    }
}
