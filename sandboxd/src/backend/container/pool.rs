//! A warm pool of started containers (`[container] warm_pool`, off by default): creating and
//! starting a container through Docker costs ~250 ms, about all of a container create. The
//! first create of a shape (image and limits, which fix a container's cgroup limits,
//! `/dev/shm` and disk at Docker's create) fills a pool of `warm_pool` containers of that
//! shape in the background; a later create of the same shape takes one: it is renamed to the
//! sandbox's name, given the sandbox's hostname (in its UTS namespace, and Docker's
//! `/etc/hostname` and `/etc/hosts` of it rewritten in place), its workdir and its network, and
//! the pool is filled again. Pools of the [`MAX_SHAPES`] most recently asked shapes are kept;
//! an older shape's containers are removed.
//!
//! A pooled container is an ordinary container sandbox that no one owns yet (same host config,
//! confinement and exec channel); the daemon's restart removes the ones it finds (their names
//! are no sandbox's) and re-adopts a taken one by its name like any other.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{ContainerSandbox, Inner};
use crate::backend::{BackendError, SandboxSpec};
use crate::ids::SandboxId;

/// Shapes whose pools are kept at once.
pub const MAX_SHAPES: usize = 4;

/// Starts a refill tries in a row before it gives up until the next create.
const POOL_START_ATTEMPTS: u32 = 3;

/// What a pooled container must match to serve a create: its image and limits.
pub(super) fn shape_of(spec: &SandboxSpec) -> String {
    format!("{}\u{0}{:?}", spec.image, spec.limits)
}

/// The pools, by shape, most recently asked last.
#[derive(Default)]
pub(super) struct Pools {
    shapes: VecDeque<(String, VecDeque<Arc<ContainerSandbox>>)>,
    /// Shapes being filled now (one filler per shape).
    filling: Vec<String>,
}

impl Pools {
    /// A ready container of `shape`, if one is pooled; the shape becomes the most recent.
    pub(super) fn take(&mut self, shape: &str) -> Option<Arc<ContainerSandbox>> {
        let i = self.shapes.iter().position(|(s, _)| s == shape)?;
        let mut entry = self.shapes.remove(i)?;
        let taken = entry.1.pop_front();
        self.shapes.push_back(entry);
        taken
    }

    /// Marks `shape` asked for: its pool becomes the most recent (made empty if new). Returns
    /// the containers of the shapes that fell out of the [`MAX_SHAPES`], to be removed, and
    /// whether a filler should start for `shape`.
    pub(super) fn asked(&mut self, shape: &str) -> (Vec<Arc<ContainerSandbox>>, bool) {
        if let Some(i) = self.shapes.iter().position(|(s, _)| s == shape) {
            if let Some(entry) = self.shapes.remove(i) {
                self.shapes.push_back(entry);
            }
        } else {
            self.shapes.push_back((shape.to_string(), VecDeque::new()));
        }
        let mut evicted = Vec::new();
        while self.shapes.len() > MAX_SHAPES {
            if let Some((_, containers)) = self.shapes.pop_front() {
                evicted.extend(containers);
            }
        }
        let start = !self.filling.iter().any(|s| s == shape);
        if start {
            self.filling.push(shape.to_string());
        }
        (evicted, start)
    }

    /// How many containers of `shape` are pooled; `None` once the shape was evicted.
    pub(super) fn len(&self, shape: &str) -> Option<usize> {
        self.shapes.iter().find(|(s, _)| s == shape).map(|(_, c)| c.len())
    }

    /// Adds a started container to `shape`'s pool; gives it back if the shape was evicted.
    pub(super) fn put(&mut self, shape: &str, sb: Arc<ContainerSandbox>) -> Option<Arc<ContainerSandbox>> {
        match self.shapes.iter_mut().find(|(s, _)| s == shape) {
            Some((_, c)) => {
                c.push_back(sb);
                None
            }
            None => Some(sb),
        }
    }

    pub(super) fn done_filling(&mut self, shape: &str) {
        self.filling.retain(|s| s != shape);
    }

    /// Every pooled container (shutdown).
    pub(super) fn drain(&mut self) -> Vec<Arc<ContainerSandbox>> {
        self.shapes.drain(..).flat_map(|(_, c)| c).collect()
    }
}

impl Inner {
    /// Marks `spec`'s shape asked for and starts filling its pool in the background (no-op
    /// without a pool).
    pub(super) fn refill(self: &Arc<Self>, spec: &SandboxSpec) {
        if self.cfg.warm_pool == 0 || spec.from_snapshot.is_some() {
            return;
        }
        let shape = shape_of(spec);
        let (evicted, start) = match self.pool.lock() {
            Ok(mut p) => p.asked(&shape),
            Err(_) => return,
        };
        for sb in evicted {
            let me = self.clone();
            self.spawn_background(async move { me.remove_unlinked(&sb, "its warm pool was dropped").await });
        }
        if !start {
            return;
        }
        let me = self.clone();
        let template = SandboxSpec {
            id: SandboxId::generate(),
            image: spec.image.clone(),
            limits: spec.limits,
            workdir: "/".to_string(),
            from_snapshot: None,
            tenant: String::new(),
            network: Default::default(),
        };
        tokio::spawn(async move {
            // A start that fails (a container slow to greet on a loaded host) is tried again a
            // few times, waiting longer each time, before the pool waits for the next create.
            let mut failures = 0u32;
            loop {
                let want = me.cfg.warm_pool;
                let have = me.pool.lock().ok().and_then(|p| p.len(&shape));
                if have.is_none_or(|n| n >= want) {
                    break;
                }
                let spec = SandboxSpec { id: SandboxId::generate(), ..template.clone() };
                match me.launch(&spec, &super::setup::Role::Active, None).await {
                    Ok(sb) => {
                        let back = me.pool.lock().ok().and_then(|mut p| p.put(&shape, sb.clone()));
                        if let Some(sb) = back {
                            me.remove_unlinked(&sb, "its warm pool was dropped").await;
                            break;
                        }
                        let ready = me.pool.lock().ok().and_then(|p| p.len(&shape)).unwrap_or(0);
                        tracing::info!(image = %spec.image, ready, "container warm pool: a container is ready");
                    }
                    Err(e) => {
                        failures += 1;
                        if failures >= POOL_START_ATTEMPTS {
                            tracing::warn!(image = %spec.image, error = %e, failures, "container warm pool: cannot start a container; the next create refills it");
                            break;
                        }
                        tracing::warn!(image = %spec.image, error = %e, failures, "container warm pool: cannot start a container; trying again");
                        tokio::time::sleep(std::time::Duration::from_secs(u64::from(failures))).await;
                    }
                }
            }
            if let Ok(mut p) = me.pool.lock() {
                p.done_filling(&shape);
            }
        });
    }

    /// A pooled container made sandbox `spec`'s, if one of its shape is ready.
    pub(super) async fn take_pooled(self: &Arc<Self>, spec: &SandboxSpec) -> Option<Arc<ContainerSandbox>> {
        if self.cfg.warm_pool == 0 || spec.from_snapshot.is_some() {
            return None;
        }
        let pooled = self.pool.lock().ok()?.take(&shape_of(spec))?;
        if let Err(e) = self.make_own(&pooled, spec).await {
            tracing::warn!(sandbox = %spec.id, error = %e, "container warm pool: a pooled container could not be taken; creating one");
            self.remove_unlinked(&pooled, "it could not be taken from the warm pool").await;
            return None;
        }
        let container = pooled.container_id.clone();
        match Arc::try_unwrap(pooled) {
            Ok(mut owned) => {
                owned.spec = spec.clone();
                tracing::info!(sandbox = %spec.id, %container, "container sandbox taken from the warm pool");
                Some(Arc::new(owned))
            }
            Err(shared) => {
                tracing::warn!(sandbox = %spec.id, %container, "container warm pool: a pooled container is still in use elsewhere; creating one");
                self.remove_unlinked(&shared, "it could not be taken from the warm pool").await;
                None
            }
        }
    }

    /// Gives pooled container `sb` the identity of sandbox `spec`: its name, hostname and
    /// workdir (its network is attached by the create, as for a new container).
    async fn make_own(&self, sb: &ContainerSandbox, spec: &SandboxSpec) -> Result<(), BackendError> {
        let docker = self.docker()?;
        let name = super::docker::active_name(&spec.id);
        let options = bollard::query_parameters::RenameContainerOptions { name: name.clone() };
        docker
            .rename_container(&sb.container_id, options)
            .await
            .map_err(|e| super::docker::api_error(format!("renaming container {} to {name}", sb.container_id), e))?;
        self.set_identity(&sb.container_id, sb.init_pid, sb.spec.id.as_str(), spec.id.as_str()).await?;
        let (pid, workdir, ids) = (sb.init_pid, spec.workdir.clone(), sb.ids);
        tokio::task::spawn_blocking(move || {
            crate::backend::files::acting_as(ids, || crate::backend::files::create_dir_all(std::path::Path::new(&format!("/proc/{pid}/root")), &workdir))
        })
        .await
        .map_err(|e| BackendError::Internal(format!("workdir task: {e}")))?
    }

    /// Renames the host of the container whose init is `pid` from `old` to `new`: the UTS
    /// namespace's hostname, and Docker's `/etc/hostname` and `/etc/hosts` for it, in place
    /// (they are bind mounts of those host files).
    pub(super) async fn set_identity(&self, container: &str, pid: i32, old: &str, new: &str) -> Result<(), BackendError> {
        let docker = self.docker()?;
        let info = docker.inspect_container(container, None).await.map_err(|e| super::docker::api_error(format!("inspecting container {container}"), e))?;
        let (hostname_path, hosts_path) = (info.hostname_path.unwrap_or_default(), info.hosts_path.unwrap_or_default());
        let (old, new) = (old.to_string(), new.to_string());
        tokio::task::spawn_blocking(move || {
            // nsenter execs `hostname` in the container's UTS namespace only: no thread of the
            // daemon ever changes namespace.
            let out = std::process::Command::new("nsenter")
                .args(["-t", &pid.to_string(), "--uts", "hostname", &new])
                .output()
                .map_err(|e| BackendError::io("running nsenter to set a container's hostname", e))?;
            if !out.status.success() {
                return Err(BackendError::Internal(format!("setting the hostname of a pooled container: {}", String::from_utf8_lossy(&out.stderr).trim())));
            }
            for path in [hostname_path, hosts_path].into_iter().filter(|p| !p.is_empty()) {
                let text = std::fs::read_to_string(&path).map_err(|e| BackendError::io(format!("reading {path}"), e))?;
                let mut file =
                    std::fs::OpenOptions::new().write(true).truncate(true).open(&path).map_err(|e| BackendError::io(format!("writing {path}"), e))?;
                std::io::Write::write_all(&mut file, text.replace(&old, &new).as_bytes()).map_err(|e| BackendError::io(format!("writing {path}"), e))?;
            }
            Ok(())
        })
        .await
        .map_err(|e| BackendError::Internal(format!("hostname task: {e}")))?
    }

    /// Removes every pooled container (shutdown).
    pub(super) async fn drain_pool(&self) {
        let all = self.pool.lock().map(|mut p| p.drain()).unwrap_or_default();
        futures::future::join_all(all.iter().map(|sb| self.remove_unlinked(sb, "the daemon shut down"))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_kept_most_recent_last_and_bounded() {
        let mut p = Pools::default();
        let (evicted, start) = p.asked("a");
        assert!(evicted.is_empty() && start);
        assert!(!p.asked("a").1, "one filler per shape");
        p.done_filling("a");
        assert!(p.asked("a").1);
        for s in ["b", "c", "d", "e"] {
            p.asked(s);
        }
        assert_eq!(p.len("a"), None, "the oldest shape fell out");
        assert_eq!(p.len("e"), Some(0));
        assert!(p.take("e").is_none(), "an empty pool gives nothing");
        assert!(p.take("zzz").is_none());
    }
}
