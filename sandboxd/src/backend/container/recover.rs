//! Reconciling with Docker when the daemon starts.
//!
//! Docker keeps containers across a daemon crash (and the daemon stops, without removing, its
//! containers on a clean shutdown). At start, every container carrying this daemon's owner label
//! is either re-adopted — it is named `sandboxd-<id>` and `<id>` is a sandbox on record — or
//! removed (standbys, replaced containers, sandboxes no record knows). A re-adopted container is
//! restarted, so like the process tier its filesystem is kept and its processes are not: the
//! execs that ran in it were recorded LOST by the manager. Snapshot copies no record knows are
//! deleted, and so are spill files of execs that never finished.
//!
//! The exec channel (see `exec.rs`) does not survive a daemon restart (its end died with the old
//! daemon); the restart starts a new keepalive, whose channel `attach` takes like a new
//! container's. A container created before the channel existed restarts with its old keepalive
//! (`--pause`) and its execs keep going through Docker's exec API until it is recreated.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bollard::query_parameters::{ListContainersOptions, RestartContainerOptions};

use super::docker::{self, api_error, LABEL_OWNER};
use super::Inner;
use crate::backend::{BackendError, SandboxSpec};
use crate::ids::{SandboxId, SnapshotId};

impl Inner {
    /// Lists this daemon's containers, removes those no record wants, and remembers the others
    /// for [`Inner::readopt`]. See the module documentation.
    pub(super) async fn clean(self: &Arc<Self>, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]) {
        let Ok(docker) = self.docker().cloned() else { return };
        self.remove_unknown_snapshots(snapshots);
        let filters = HashMap::from([("label".to_string(), vec![format!("{LABEL_OWNER}={}", self.owner)])]);
        let options = ListContainersOptions { all: true, filters: Some(filters), ..Default::default() };
        let listed = match docker.list_containers(Some(options)).await {
            Ok(l) => l,
            Err(e) => {
                // Nothing is removed: a container not found here is re-adopted as "gone".
                tracing::warn!(error = %e, "docker: listing this daemon's containers at start");
                return;
            }
        };
        let wanted: HashMap<String, &SandboxSpec> = sandboxes.iter().map(|s| (format!("/{}", docker::active_name(&s.id)), s)).collect();
        let mut adopt: HashMap<SandboxId, String> = HashMap::new();
        let mut remove = Vec::new();
        for c in listed {
            let Some(id) = c.id else { continue };
            match c.names.unwrap_or_default().iter().find_map(|n| wanted.get(n)) {
                Some(spec) => {
                    adopt.insert(spec.id.clone(), id);
                }
                None => remove.push(id),
            }
        }
        let removals = remove.iter().map(|id| async move {
            tracing::info!(container = %id, "removing a container no record refers to");
            self.remove_container(id).await;
        });
        futures::future::join_all(removals).await;
        if let Ok(mut found) = self.found.lock() {
            *found = adopt;
        }
    }

    /// Restarts the container of a recorded sandbox: the processes of the previous daemon's time
    /// end, the writable layer stays. A stopped container simply starts.
    pub(super) async fn readopt(self: &Arc<Self>, spec: &SandboxSpec) -> Result<(), BackendError> {
        let docker = self.docker()?.clone();
        let container = self.found.lock().ok().and_then(|mut f| f.remove(&spec.id));
        let Some(container) = container else {
            return Err(BackendError::Internal(format!("the container of {} is gone", spec.id)));
        };
        self.kill_frozen_leftovers(&docker, &container).await;
        let options = RestartContainerOptions { t: Some(0), signal: None };
        match docker.restart_container(&container, Some(options)).await {
            Ok(()) => {
                let sb = self.attach(spec, &container).await?;
                // A container taken from the warm pool was created under another hostname,
                // which its restart gave it back: the sandbox's again.
                let configured = docker.inspect_container(&container, None).await.ok().and_then(|i| i.config).and_then(|c| c.hostname).unwrap_or_default();
                if !configured.is_empty() && configured != spec.id.as_str() {
                    if let Err(e) = self.set_identity(&container, sb.init_pid, &configured, spec.id.as_str()).await {
                        sb.mark_lost("its hostname could not be set");
                        sb.kill_everything().await;
                        return Err(e);
                    }
                }
                // The restart made a new network namespace: the link is given again.
                if let Err(e) = super::net::attach(self, &sb).await {
                    // Stopped, not removed: its writable layer is the sandbox's disk.
                    sb.mark_lost("network setup failed");
                    sb.kill_everything().await;
                    return Err(e);
                }
                self.insert_sandbox(sb)
            }
            Err(e) => Err(api_error(format!("restarting container {container}"), e)),
        }
    }

    /// Kills what still runs in a container a killed daemon left, through its cgroup. A
    /// sandbox paused when that daemon died (SIGKILL: no shutdown thawed it) is still frozen by
    /// our freezer, and on cgroup v1 a frozen task never acts on the SIGKILL of Docker's
    /// restart; `kill_all` thaws what it killed, so the restart finds it gone.
    async fn kill_frozen_leftovers(&self, docker: &bollard::Docker, container: &str) {
        let Ok(info) = docker.inspect_container(container, None).await else { return };
        let Some(pid) = info.state.and_then(|s| s.pid).and_then(|p| i32::try_from(p).ok()).filter(|&p| p > 0) else { return };
        let Ok(cgroup) = self.cgroup_of(container, pid) else { return };
        match tokio::task::spawn_blocking(move || cgroup.kill_all()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(%container, error = %e, "killing a left container's processes before its restart"),
            Err(e) => tracing::warn!(%container, error = %e, "kill task failed"),
        }
    }

    fn remove_unknown_snapshots(&self, snapshots: &[SnapshotId]) {
        let keep: HashSet<&str> = snapshots.iter().map(|s| s.as_str()).collect();
        let Ok(entries) = std::fs::read_dir(&self.snapshots_dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !keep.contains(name.as_str()) {
                tracing::info!(snapshot = %name, "removing a snapshot no record refers to");
                if let Err(e) = std::fs::remove_dir_all(entry.path()) {
                    tracing::warn!(path = %entry.path().display(), error = %e, "cannot remove stale snapshot");
                }
            }
        }
    }
}
