//! The container tier: each sandbox is a Docker container, driven through the Docker Engine API
//! with `bollard` (never the docker CLI).
//!
//! * [`image`] — sandbox images become local Docker images, imported from the same rootfs the
//!   process tier uses (no registry).
//! * [`setup`] — the container recipe: limits, capabilities, no-new-privileges, a
//!   seccomp profile built from the same deny list as the process tier (`backend::seccomp`),
//!   network `none`, an init that reaps zombies, labels marking it as ours.
//! * [`exec`] — commands run through the exec API, each moved into its own child cgroup of the
//!   container's, which gives per-exec CPU and peak memory, OOM detection and a kill that reaches
//!   the whole process tree.
//! * [`files`] — WriteFile/ReadFile through the container's root (`/proc/<init>/root`) with
//!   the process tier's confined lookups; writes replace files atomically.
//! * [`snapshot`] and [`layer`] — snapshots copy the container's writable layer; rollback swaps
//!   in a standby container prepared from the snapshot in the background.
//!
//! Containers are labelled `sandboxd.id=<sandbox>` and `sandboxd.owner=<hash of the state dir>`,
//! and the container serving a sandbox is named `sandboxd-<sandbox>`; a restarted daemon finds
//! its own by these ([`Backend::recover`]). Host layout under `--state-dir`:
//! `container/snapshots/<snapshot>/` (copies of writable layers). Output spilled while an exec runs
//! is written straight into the container (its own writable layer), never on the host.

mod build;
mod channel;
mod docker;
mod exec;
mod files;
mod image;
mod layer;
mod net;
mod pool;
mod recover;
mod setup;
mod snapshot;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use tokio_util::sync::CancellationToken;

use super::cgroup as process_cgroup;
use super::{
    ArchiveStats, Backend, BackendError, ByteChunks, Download, ExecOutcome, ExecSpec, FileChunk, Isolation, OutputSink, SandboxSpec, StartSignal, UploadPiece,
};
use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::images::Catalog;
use process_cgroup::{CgroupRoot, SandboxCgroup};

/// Where the Docker Engine listens by default.
pub const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";

/// Settings of the container tier.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// The daemon's state dir: snapshots live below it, and its hash marks our containers.
    pub state_dir: PathBuf,
    /// The operator's images dir: the exec helper lives in its `.tools/`.
    pub images_dir: PathBuf,
    /// Where images are found (as for the process tier).
    pub catalog: Arc<Catalog>,
    /// The Docker Engine's UNIX socket.
    pub docker_socket: PathBuf,
    /// Refuse the tier unless Docker remaps container uids (`dockerd --userns-remap`).
    pub require_userns_remap: bool,
    /// Create containers whose execs go through Docker's exec API (`[container]
    /// exec_through_docker`): their keepalive only waits, it serves no exec channel.
    pub exec_through_docker: bool,
    /// Started containers kept ready per shape (image and limits) for creates (see `pool`);
    /// 0: none.
    pub warm_pool: usize,
    /// The daemon's egress filter, for sandboxes whose network is not NONE (see [`net`]).
    pub egress: Option<Arc<crate::egress::Egress>>,
}

/// The Docker socket to use: `DOCKER_HOST` when it names a UNIX socket (as the docker CLI
/// reads it), else [`DEFAULT_DOCKER_SOCKET`].
pub fn docker_socket_from_env() -> PathBuf {
    std::env::var("DOCKER_HOST").ok().and_then(|h| h.strip_prefix("unix://").map(PathBuf::from)).unwrap_or_else(|| PathBuf::from(DEFAULT_DOCKER_SOCKET))
}

/// Whether Docker can cap a container's writable layer (`StorageOpt size`): it depends on the
/// storage driver (overlay2 on xfs with pquota, btrfs, zfs, devicemapper), and is learned from
/// the driver's name or from the first create that asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DiskLimits {
    Unknown,
    Enforced,
    Unsupported,
}

/// One live container sandbox: the container serving it now, and the execs running in it.
pub(crate) struct ContainerSandbox {
    spec: SandboxSpec,
    container_id: String,
    /// Host pid of the container's init (docker-init), for `/proc/<pid>/root`.
    init_pid: i32,
    /// The container's cgroup; exec cgroups are created below it.
    cgroup: SandboxCgroup,
    /// The container's writable layer on the host (overlay upper dir), when the storage driver
    /// has one.
    upper_dir: Option<PathBuf>,
    /// Set (with the reason) when the container is taken down under running execs, which then
    /// end as LOST rather than as whatever the kill made of them.
    lost: Mutex<Option<String>>,
    /// Cgroups of running execs and of finished ones with processes left behind.
    execs: process_cgroup::ExecCgroups,
    /// The channel to its exec helper, through which execs start (see `exec`); None for a
    /// container made before the channel existed, whose execs go through Docker's exec API.
    channel: Option<channel::HelperChannel>,
    /// The host CPUs of its cpuset; given back when the container goes.
    #[allow(dead_code)] // held for its Drop
    cpus: super::cpus::CpuLease,
    /// The host ids of its user namespace (Docker's `--userns-remap`), when it has one: files
    /// the daemon writes into it are made as its root, and archives show its ids.
    ids: Option<sandbox_exec::archive::IdShift>,
}

impl ContainerSandbox {
    /// Records why the container is going away, before it does (first reason wins).
    fn mark_lost(&self, reason: &str) {
        if let Ok(mut lost) = self.lost.lock() {
            lost.get_or_insert_with(|| reason.to_string());
        }
    }

    fn lost_reason(&self) -> Option<String> {
        self.lost.lock().ok().and_then(|l| l.clone())
    }

    /// SIGKILLs every process of the container (its init included, so the container stops),
    /// race-free against forks through the freezer. Running execs see their process end.
    async fn kill_everything(self: &Arc<Self>) {
        let sb = self.clone();
        let killed = tokio::task::spawn_blocking(move || sb.cgroup.kill_all()).await;
        match killed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(container = %self.container_id, error = %e, "killing the container's processes"),
            Err(e) => tracing::warn!(container = %self.container_id, error = %e, "kill task failed"),
        }
    }

    /// Removes the cgroups execs left behind (Docker removes the container's own).
    fn remove_exec_cgroups(&self) {
        self.execs.remove_leftovers();
    }
}

/// The state shared by the backend and its background tasks (standby preparation, removals).
pub(crate) struct Inner {
    cfg: ContainerConfig,
    docker: Option<Docker>,
    /// Why this host cannot run the tier, if it cannot.
    unavailable: Option<String>,
    owner: String,
    images: image::ImageCache,
    disk_limits: Mutex<DiskLimits>,
    sandboxes: RwLock<HashMap<SandboxId, Arc<ContainerSandbox>>>,
    standbys: Mutex<HashMap<SandboxId, snapshot::Standby>>,
    /// Cgroup parents of containers (`docker` with the cgroupfs driver), opened once.
    cgroup_roots: Mutex<HashMap<String, CgroupRoot>>,
    snapshots_dir: PathBuf,
    /// Clean-ups left running after a call returned (removing replaced containers, discarding
    /// standbys), which shutdown waits for so none is cut off half way.
    background: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The containers found at start for the recorded sandboxes (sandbox → container id), each
    /// taken by its re-adoption (see `recover`).
    found: Mutex<HashMap<SandboxId, String>>,
    /// The warm pool (see `pool`).
    pool: Mutex<pool::Pools>,
}

/// The container-tier backend.
pub struct ContainerBackend {
    inner: Arc<Inner>,
}

impl ContainerBackend {
    /// Connects to Docker. A host where Docker is unreachable gets a backend that reports why on
    /// every create (the daemon still serves the other tiers); this never fails.
    pub async fn new(cfg: ContainerConfig) -> Self {
        let root = cfg.state_dir.join("container");
        let snapshots_dir = root.join("snapshots");
        let owner = docker::owner_of(&cfg.state_dir);
        let mut unavailable = None;
        let (mut docker, mut host) = (None, None);
        match docker::connect(&cfg.docker_socket).await {
            Ok((d, h)) => {
                tracing::info!(version = %h.server_version, api = %h.api_version, storage_driver = %h.storage_driver, cgroup_driver = %h.cgroup_driver, userns_remap = h.userns_remap, "Docker reachable");
                if !h.userns_remap {
                    if cfg.require_userns_remap {
                        unavailable = Some("[container] require_userns_remap is set but Docker does not remap user namespaces: start dockerd with --userns-remap=default (see the README)".to_string());
                    } else {
                        tracing::warn!("Docker runs without --userns-remap: uids in a container sandbox are host uids (root inside is the host's root, confined only by Docker's capabilities and seccomp); see the README's \"User namespaces\" section");
                    }
                }
                docker = Some(d);
                host = Some(h);
            }
            Err(reason) => unavailable = Some(reason),
        }
        for dir in [&snapshots_dir] {
            if let Err(e) = std::fs::create_dir_all(dir) {
                unavailable.get_or_insert_with(|| format!("creating {}: {e}", dir.display()));
            }
        }
        // Every command starts through the exec helper: without it no exec could run.
        let helper = exec::helper_path(&cfg.images_dir);
        if !helper.is_file() {
            unavailable.get_or_insert_with(|| {
                format!("the exec helper {} is missing: build it with `make exec-helper` (make run and make test do)", helper.display())
            });
        }
        if let Some(reason) = &unavailable {
            tracing::error!(%reason, "container tier unavailable");
        }
        let driver = host.as_ref().map(|h| h.storage_driver.clone()).unwrap_or_default();
        let disk_limits = match driver.as_str() {
            // fuse-overlayfs and vfs have no quota support at all (overlay2 has it only on xfs
            // with pquota, which the first create finds out).
            "fuse-overlayfs" | "vfs" => {
                tracing::warn!(%driver, "Docker's storage driver cannot limit a container's disk: disk_bytes is not enforced for CONTAINER sandboxes");
                DiskLimits::Unsupported
            }
            _ => DiskLimits::Unknown,
        };
        let inner = Inner {
            cfg,
            docker,
            unavailable,
            owner,
            images: image::ImageCache::default(),
            disk_limits: Mutex::new(disk_limits),
            sandboxes: RwLock::new(HashMap::new()),
            standbys: Mutex::new(HashMap::new()),
            cgroup_roots: Mutex::new(HashMap::new()),
            snapshots_dir,
            background: Mutex::new(Vec::new()),
            found: Mutex::new(HashMap::new()),
            pool: Mutex::new(pool::Pools::default()),
        };
        ContainerBackend { inner: Arc::new(inner) }
    }
}

impl Inner {
    /// Runs a clean-up after the current call returns; shutdown waits for it.
    fn spawn_background(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        if let Ok(mut tasks) = self.background.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(tokio::spawn(task));
        }
    }

    /// Waits (bounded) for the clean-ups still running.
    async fn finish_background(&self) {
        let tasks: Vec<_> = self.background.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
        let _ = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(tasks)).await;
    }

    fn docker(&self) -> Result<&Docker, BackendError> {
        self.docker.as_ref().ok_or_else(|| self.unavailable_error())
    }

    fn unavailable_error(&self) -> BackendError {
        BackendError::Unavailable { isolation: Isolation::Container, reason: self.unavailable.clone().unwrap_or_default() }
    }

    fn sandbox(&self, id: &SandboxId) -> Result<Arc<ContainerSandbox>, BackendError> {
        let map = self.sandboxes.read().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?;
        map.get(id).cloned().ok_or_else(|| BackendError::NoSuchSandbox(id.clone()))
    }

    fn take_sandbox(&self, id: &SandboxId) -> Option<Arc<ContainerSandbox>> {
        self.sandboxes.write().ok().and_then(|mut m| m.remove(id))
    }

    fn insert_sandbox(&self, sb: Arc<ContainerSandbox>) -> Result<(), BackendError> {
        self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?.insert(sb.spec.id.clone(), sb);
        Ok(())
    }

    /// Removes a container (killing what runs in it), tolerating one that is already gone.
    async fn remove_container(&self, container: &str) {
        let Ok(docker) = self.docker() else { return };
        let options = bollard::query_parameters::RemoveContainerOptions { force: true, v: true, ..Default::default() };
        match docker.remove_container(container, Some(options)).await {
            Ok(()) => tracing::debug!(%container, "container removed"),
            Err(e) if docker::is_not_found(&e) => {}
            Err(e) => tracing::warn!(%container, error = %e, "cannot remove container"),
        }
    }

    /// Takes a sandbox's serving container down: execs end as LOST with `reason`, the
    /// sandbox's network link goes, every process dies, the container is removed. Idempotent.
    async fn tear_down(&self, sb: &Arc<ContainerSandbox>, reason: &str) {
        net::detach(self, sb).await;
        self.remove_unlinked(sb, reason).await;
    }

    /// Takes down a container that holds no link of its own: a standby, which shares its
    /// sandbox's id with the serving container, so detaching by that id would cut the serving
    /// container's network.
    async fn remove_unlinked(&self, sb: &Arc<ContainerSandbox>, reason: &str) {
        sb.mark_lost(reason);
        sb.kill_everything().await;
        sb.remove_exec_cgroups();
        self.remove_container(&sb.container_id).await;
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    fn isolation(&self) -> Isolation {
        Isolation::Container
    }

    fn availability(&self) -> Result<(), String> {
        match &self.inner.unavailable {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }

    fn image_ready(&self, image: &str) -> Result<(), String> {
        // The Docker image is made on first use if an import could not make it: a reachable
        // Docker and the image's rootfs are all it takes.
        self.availability()?;
        self.inner.cfg.catalog.resolve(image).map(drop).map_err(|e| e.to_string())
    }

    async fn prepare_image(&self, image: &str) -> Result<String, BackendError> {
        let docker = self.inner.docker()?;
        let tag = self.inner.images.ensure(docker, &self.inner.cfg.catalog, image).await?;
        self.inner.images.tag_latest(docker, image, &tag).await?;
        Ok(format!("Docker image {tag}"))
    }

    async fn remove_image(&self, image: &str) -> Result<(), BackendError> {
        let docker = self.inner.docker()?;
        self.inner.images.remove(docker, &self.inner.cfg.catalog, image).await
    }

    fn failure(&self, sandbox: &SandboxId) -> Option<String> {
        // Rollback and destroy take a sandbox out of the table (and mark it lost) before they
        // kill its container, so a dead init here died on its own: code inside can end it
        // (docker-init forwards a SIGTERM from inside to the keepalive and exits with it).
        let sb = self.inner.sandbox(sandbox).ok()?;
        if sb.lost_reason().is_some() {
            return None;
        }
        // SAFETY: kill with signal 0 sends nothing; it only asks whether the pid exists.
        let gone = unsafe { libc::kill(sb.init_pid, 0) } == -1 && nix::errno::Errno::last() == nix::errno::Errno::ESRCH;
        gone.then(|| {
            format!(
                "the container's init (host pid {}) exited, so the container stopped; nothing in it can run any more (destroy it; its snapshots are kept)",
                sb.init_pid
            )
        })
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        let inner = &self.inner;
        inner.docker()?;
        if let Some(snap) = &spec.from_snapshot {
            if !inner.snapshot_dir(snap).is_dir() {
                return Err(BackendError::NoSuchSnapshot(snap.clone()));
            }
        }
        let sb = match inner.take_pooled(spec).await {
            Some(sb) => sb,
            None => inner.launch(spec, &setup::Role::Active, spec.from_snapshot.as_ref()).await?,
        };
        // The next create of this shape may find a container ready.
        inner.refill(spec);
        if let Err(e) = net::attach(inner, &sb).await {
            inner.tear_down(&sb, "network setup failed").await;
            return Err(e);
        }
        inner.insert_sandbox(sb)
    }

    async fn exec(
        &self,
        sandbox: &SandboxId,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        sb.run_exec(&self.inner, spec, sink, started, cancel).await
    }

    async fn signal_exec(&self, sandbox: &SandboxId, exec: &ExecId, signal: i32) -> Result<(), BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        let cg = sb.execs.running(exec.as_str()).ok_or_else(|| BackendError::NoSuchExec(exec.clone()))?;
        // The manager admits 1-64 only.
        cg.signal_all(signal).map_err(|e| BackendError::Internal(format!("signalling exec {exec}: {e}")))
    }

    async fn write_file(&self, sandbox: &SandboxId, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::write_file(&sb, path, content, mode).await
    }

    async fn read_file(&self, sandbox: &SandboxId, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::read_file(&sb, path, offset, limit).await
    }

    async fn upload_file(&self, sandbox: &SandboxId, path: &str, mode: u32, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::upload_file(&sb, path, mode, data).await
    }

    async fn download_file(&self, sandbox: &SandboxId, path: &str, idle: std::time::Duration) -> Result<Download, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::download_file(&sb, path, idle).await
    }

    async fn upload_archive(&self, sandbox: &SandboxId, dir: &str, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::upload_archive(&sb, dir, data).await
    }

    async fn download_archive(&self, sandbox: &SandboxId, path: &str, idle: std::time::Duration) -> Result<ByteChunks, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::download_archive(&sb, path, idle).await
    }

    async fn remove_file(&self, sandbox: &SandboxId, path: &str) -> Result<(), BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::remove_file(&sb, path).await
    }

    async fn usage(&self, sandbox: &SandboxId) -> Result<super::SandboxUsage, BackendError> {
        // The container's own cgroup, read directly: Docker's stats API takes a sample interval.
        // Its writable layer is not measured (Docker does it only by walking every file).
        Ok(self.inner.sandbox(sandbox)?.cgroup.usage())
    }

    async fn snapshot(&self, sandbox: &SandboxId, snapshot: &SnapshotId, _memory: bool) -> Result<u64, BackendError> {
        Inner::snapshot(&self.inner, sandbox, snapshot).await
    }

    async fn rollback(&self, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<(), BackendError> {
        Inner::rollback(&self.inner, sandbox, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &SnapshotId) -> Result<(), BackendError> {
        self.inner.delete_snapshot(snapshot).await
    }

    async fn pause(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        // The container's cgroup is frozen here, as the process tier freezes its own, rather
        // than through Docker's pause: the exec cgroups are ours, below the container's, and a
        // freezer is hierarchical, so they stop with it and our kill path (freeze, SIGKILL,
        // thaw) keeps working on them. A container Docker believes paused would refuse the
        // exec API and need an unpause before the stop, restart and removal that destroy,
        // shutdown and re-adoption do; Docker never learns of this freeze, and `kill_all`
        // thaws what it kills.
        let sb = self.inner.sandbox(sandbox)?;
        tokio::task::spawn_blocking(move || sb.cgroup.freeze()).await.map_err(|e| BackendError::Internal(format!("freeze task: {e}")))??;
        Ok(())
    }

    async fn resume(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        tokio::task::spawn_blocking(move || sb.cgroup.thaw()).await.map_err(|e| BackendError::Internal(format!("thaw task: {e}")))??;
        Ok(())
    }

    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let inner = &self.inner;
        inner.discard_standby(sandbox);
        match inner.take_sandbox(sandbox) {
            Some(sb) => {
                inner.tear_down(&sb, "the sandbox was destroyed").await;
                Ok(())
            }
            None => {
                // A FAILED sandbox may still have a (stopped) container: it goes all the same.
                inner.remove_container(&docker::active_name(sandbox)).await;
                Err(BackendError::NoSuchSandbox(sandbox.clone()))
            }
        }
    }

    async fn clean(&self, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]) {
        self.inner.clean(sandboxes, snapshots).await
    }

    async fn readopt(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        self.inner.readopt(spec).await
    }

    async fn create_build_step(&self, spec: &SandboxSpec, image: &str) -> Result<(), BackendError> {
        self.inner.docker()?;
        self.inner.create_build_step(spec, image).await
    }

    async fn commit_build_step(&self, sandbox: &SandboxId, config_of: &str, repo: &str, tag: &str) -> Result<String, BackendError> {
        self.inner.commit_build_step(sandbox, config_of, repo, tag).await
    }

    async fn shutdown(&self) {
        let inner = &self.inner;
        inner.drain_pool().await;
        inner.discard_all_standbys().await;
        inner.finish_background().await;
        let all: Vec<_> = match inner.sandboxes.write() {
            Ok(mut map) => map.drain().map(|(_, sb)| sb).collect(),
            Err(_) => Vec::new(),
        };
        // Containers are stopped, not removed: their writable layers are the sandboxes' disks,
        // and the next start re-adopts them. Killing through the cgroup takes milliseconds.
        let stops = all.iter().map(|sb| async move {
            sb.mark_lost("the daemon shut down");
            net::detach(inner, sb).await;
            sb.kill_everything().await;
            sb.remove_exec_cgroups();
        });
        let _ = tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(stops)).await;
    }
}
