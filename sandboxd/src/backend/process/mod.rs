//! The process tier: Linux namespaces, a cgroup per sandbox and per exec, capabilities,
//! no_new_privs and seccomp, over an overlay root filesystem whose writable layer is a
//! size-limited btrfs subvolume.
//!
//! Layout on the host (all under `--state-dir`):
//! * `pool/` — the btrfs pool ([`storage`]); `pool/sandboxes/<id>/{upper,work}` is a sandbox's
//!   writable layer, `pool/snapshots/<id>` a read-only snapshot of one;
//! * `run/<id>/rootfs` — the merged overlay (image rootfs below, the subvolume above), which
//!   becomes `/` in the sandbox; `run/<id>/init.log` — the init's stderr.
//!
//! A sandbox is a shim + init pair started from this binary ([`init`]); the daemon talks to the
//! init over a socket pair ([`channel`]).

pub mod cgroup;
mod channel;
mod exec;
pub mod files;
pub mod init;
pub mod seccomp;
pub mod storage;
mod wire;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use tokio_util::sync::CancellationToken;

use self::cgroup::{CgroupLimits, CgroupRoot, ExecCgroup, SandboxCgroup};
use self::channel::InitChannel;
use self::storage::Pool;
use super::{Backend, BackendError, ExecOutcome, ExecSpec, FileChunk, Isolation, OutputSink, SandboxSpec};
use crate::ids::{ExecId, SandboxId, SnapshotId};

/// How long sandbox setup may take before it is abandoned.
const SETUP_DEADLINE: Duration = Duration::from_secs(10);

impl From<cgroup::CgroupError> for BackendError {
    fn from(e: cgroup::CgroupError) -> Self {
        BackendError::Internal(format!("cgroup: {e}"))
    }
}

impl From<storage::StorageError> for BackendError {
    fn from(e: storage::StorageError) -> Self {
        BackendError::Internal(format!("storage: {e}"))
    }
}

/// Settings of the process tier.
#[derive(Debug, Clone)]
pub struct ProcessConfig {
    pub state_dir: PathBuf,
    pub images_dir: PathBuf,
    pub pool_size_bytes: u64,
}

/// One live process-tier sandbox.
pub(crate) struct ProcessSandbox {
    id: SandboxId,
    /// Host path of the merged overlay (the sandbox's `/`).
    rootfs: PathBuf,
    run_dir: PathBuf,
    workdir: String,
    cgroup: SandboxCgroup,
    channel: InitChannel,
    shim: tokio::sync::Mutex<Option<tokio::process::Child>>,
    /// Cgroups of execs still running, for SignalExec.
    running: Mutex<HashMap<String, Arc<ExecCgroup>>>,
    /// Cgroups of finished execs whose background processes live on.
    leftovers: Mutex<Vec<Arc<ExecCgroup>>>,
}

/// The process-tier backend.
pub struct ProcessBackend {
    cfg: ProcessConfig,
    /// Why this host cannot run the tier, if it cannot.
    unavailable: Option<String>,
    pool: Option<Pool>,
    cgroups: Option<CgroupRoot>,
    sandboxes: RwLock<HashMap<SandboxId, Arc<ProcessSandbox>>>,
}

fn subvolume_of(id: &SandboxId) -> String {
    format!("sandboxes/{id}")
}

/// Name of this daemon's cgroup: derived from the state dir, so two daemons (say, parallel test
/// runs) never touch each other's sandboxes.
fn cgroup_name(state_dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    state_dir.hash(&mut h);
    format!("sandboxd-{:012x}", h.finish() & 0xffff_ffff_ffff)
}

fn is_mount_point(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let target = path.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4) == Some(&*target))
}

impl ProcessBackend {
    /// Prepares the tier: the cgroup root and the storage pool. A host that cannot provide them
    /// gets a backend that reports why on every create (the daemon still serves other tiers).
    pub fn new(cfg: ProcessConfig) -> Self {
        let mut backend = ProcessBackend { cfg, unavailable: None, pool: None, cgroups: None, sandboxes: RwLock::new(HashMap::new()) };
        if let Err(reason) = backend.prepare() {
            tracing::error!(%reason, "process tier unavailable");
            backend.unavailable = Some(reason);
        }
        backend
    }

    fn prepare(&mut self) -> Result<(), String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("sandboxd must run as root for the process tier".to_string());
        }
        let cgroups = CgroupRoot::detect(&cgroup_name(&self.cfg.state_dir)).map_err(|e| format!("cgroups: {e}"))?;
        tracing::info!(version = ?cgroups.version(), "cgroup hierarchy detected");
        let pool = Pool::open_or_create(&self.cfg.state_dir.join("pool"), self.cfg.pool_size_bytes).map_err(|e| format!("storage pool: {e}"))?;
        std::fs::create_dir_all(self.cfg.state_dir.join("run")).map_err(|e| format!("creating run dir: {e}"))?;
        self.cgroups = Some(cgroups);
        self.pool = Some(pool);
        self.reconcile();
        Ok(())
    }

    /// Removes what a previous daemon on this state dir left behind: it died without destroying
    /// its sandboxes (their inits exited with it, as the control channel closed).
    fn reconcile(&self) {
        let (Some(cgroups), Some(pool)) = (&self.cgroups, &self.pool) else { return };
        for name in cgroups.list_sandboxes() {
            if let Some(cg) = cgroups.open_sandbox(&name) {
                tracing::info!(sandbox = %name, "removing cgroup left by a previous run");
                if let Err(e) = cg.destroy() {
                    tracing::warn!(sandbox = %name, error = %e, "cannot remove stale cgroup");
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(self.cfg.state_dir.join("run")) {
            for entry in entries.flatten() {
                let dir = entry.path();
                teardown_mount(&dir.join("rootfs"));
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove stale run dir");
                }
            }
        }
        for name in pool.subvolumes("sandboxes") {
            tracing::info!(sandbox = %name, "removing writable layer left by a previous run");
            if let Err(e) = pool.delete_subvolume(&format!("sandboxes/{name}")) {
                tracing::warn!(sandbox = %name, error = %e, "cannot remove stale subvolume");
            }
        }
    }

    fn pool(&self) -> Result<&Pool, BackendError> {
        self.pool.as_ref().ok_or_else(|| self.unavailable_error())
    }

    fn cgroups(&self) -> Result<&CgroupRoot, BackendError> {
        self.cgroups.as_ref().ok_or_else(|| self.unavailable_error())
    }

    fn unavailable_error(&self) -> BackendError {
        BackendError::Unavailable { isolation: Isolation::Process, reason: self.unavailable.clone().unwrap_or_default() }
    }

    fn sandbox(&self, id: &SandboxId) -> Result<Arc<ProcessSandbox>, BackendError> {
        let map = self.sandboxes.read().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?;
        map.get(id).cloned().ok_or_else(|| BackendError::NoSuchSandbox(id.clone()))
    }

    fn image_rootfs(&self, image: &str) -> Result<PathBuf, BackendError> {
        let not_found = || BackendError::ImageNotFound { image: image.to_string(), dir: self.cfg.images_dir.display().to_string() };
        let valid = !image.is_empty() && image.len() <= 64 && image.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) && !image.starts_with('.');
        if !valid {
            return Err(not_found());
        }
        let dir = self.cfg.images_dir.join(image);
        let rootfs = dir.join("rootfs");
        // image.json is written last by the build scripts: without it the image is incomplete.
        if !rootfs.is_dir() || !dir.join("image.json").is_file() {
            return Err(not_found());
        }
        let rootfs = rootfs.canonicalize().map_err(|e| BackendError::io(format!("resolving image {image}"), e))?;
        if rootfs.to_string_lossy().contains([',', ':']) {
            return Err(BackendError::Internal(format!("image path {} contains ',' or ':', which overlayfs options cannot carry", rootfs.display())));
        }
        Ok(rootfs)
    }

    /// The sandbox setup, from the daemon's side. Each step undoes itself on failure through
    /// [`teardown`], which tolerates steps that never happened.
    async fn setup(&self, spec: &SandboxSpec) -> Result<Arc<ProcessSandbox>, BackendError> {
        let pool = self.pool()?;
        let lower = self.image_rootfs(&spec.image)?;
        let id = &spec.id;

        // 1. The writable layer: a fresh subvolume (or a writable snapshot, for a fork), capped
        //    at disk_bytes by a qgroup so a full sandbox gets a write error, never a full host.
        let subvol = subvolume_of(id);
        let layer = match &spec.from_snapshot {
            Some(snap) => pool.snapshot(&format!("snapshots/{snap}"), &subvol, false)?,
            None => pool.create_subvolume(&subvol)?,
        };
        pool.set_limit(&subvol, spec.limits.disk_bytes)?;
        for d in ["upper", "work"] {
            std::fs::create_dir_all(layer.join(d)).map_err(|e| BackendError::io(format!("creating {d} dir"), e))?;
        }

        // 2. The root filesystem: overlay of the read-only image under the writable layer,
        //    mounted nosuid,nodev on the host so the daemon's file API can never open a device
        //    node the sandbox planted.
        let run_dir = self.cfg.state_dir.join("run").join(id.as_str());
        let rootfs = run_dir.join("rootfs");
        std::fs::create_dir_all(&rootfs).map_err(|e| BackendError::io("creating rootfs mount point", e))?;
        let opts = format!("lowerdir={},upperdir={},workdir={}", lower.display(), layer.join("upper").display(), layer.join("work").display());
        mount(Some("overlay"), &rootfs, Some("overlay"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(opts.as_str()))
            .map_err(|e| BackendError::io("mounting overlay root filesystem", e.into()))?;
        for dir in ["proc", "dev", "tmp", &spec.workdir] {
            files::create_dir_all(&rootfs, dir)?;
        }
        let tmp = rootfs.join("tmp");
        let _ = std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o1777));

        // 3. The cgroup, with the memory, pids and cpu limits.
        let limits = CgroupLimits { memory_bytes: spec.limits.memory_bytes, max_pids: spec.limits.max_pids, cpu_millicores: spec.limits.cpu_millicores };
        let cgroup = self.cgroups()?.create_sandbox(id.as_str(), &limits)?;

        // 4. The shim + init, from this same binary (see init.rs for the in-sandbox recipe).
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| BackendError::io("creating control socket", e.into()))?;
        let log = std::fs::File::create(run_dir.join("init.log")).map_err(|e| BackendError::io("creating init log", e))?;
        let exe = std::env::current_exe().map_err(|e| BackendError::io("locating sandboxd binary", e))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg(init::INIT_ARG).env_clear().stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(log);
        let child_fd = theirs.as_raw_fd();
        // SAFETY: dup2 is async-signal-safe; it only places the control socket on fd 3 (clearing
        // CLOEXEC) in the child between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(child_fd, init::CONTROL_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let shim = tokio::process::Command::from(cmd).spawn().map_err(|e| BackendError::io("starting sandbox init", e))?;
        drop(theirs);
        let channel = InitChannel::new(ours).map_err(|e| BackendError::io("control socket", e))?;
        let sandbox = Arc::new(ProcessSandbox {
            id: id.clone(),
            rootfs: rootfs.clone(),
            run_dir,
            workdir: spec.workdir.clone(),
            cgroup,
            channel,
            shim: tokio::sync::Mutex::new(Some(shim)),
            running: Mutex::new(HashMap::new()),
            leftovers: Mutex::new(Vec::new()),
        });
        let config = wire::encode(&wire::InitConfig { rootfs: rootfs.display().to_string(), hostname: id.to_string() })
            .map_err(|e| BackendError::Internal(e.to_string()))?;
        let procs = sandbox.cgroup.procs_files()?;
        let fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
        if let Err(reason) = sandbox.channel.handshake(&config, &fds, SETUP_DEADLINE).await {
            let log_tail = std::fs::read_to_string(sandbox.run_dir.join("init.log")).unwrap_or_default();
            let log_tail: String = log_tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            self.teardown(&sandbox).await;
            return Err(BackendError::Internal(format!("sandbox {id} setup: {reason} (init log: {log_tail})")));
        }
        sandbox.channel.start_reader(id.to_string());
        Ok(sandbox)
    }

    /// Takes a sandbox apart: processes, cgroups, mount, writable layer, run dir. Idempotent.
    async fn teardown(&self, sb: &ProcessSandbox) {
        sb.channel.close();
        // Killing the cgroup ends the init (and with it the pid namespace) and every process.
        if let Err(e) = sb.cgroup.kill_all() {
            tracing::warn!(sandbox = %sb.id, error = %e, "killing sandbox processes");
        }
        if let Some(mut shim) = sb.shim.lock().await.take() {
            match tokio::time::timeout(Duration::from_secs(5), shim.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    tracing::warn!(sandbox = %sb.id, "shim still running 5 s after the kill; killing it");
                    let _ = shim.kill().await;
                }
            }
        }
        let leftovers: Vec<_> = sb.leftovers.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default();
        for cg in leftovers {
            if let Err(e) = cg.remove() {
                tracing::warn!(sandbox = %sb.id, error = %e, "removing exec cgroup");
            }
        }
        if let Err(e) = self.cgroups().map_err(|e| e.to_string()).and_then(|c| c.open_sandbox(sb.id.as_str()).map(|cg| cg.destroy().map_err(|e| e.to_string())).unwrap_or(Ok(()))) {
            tracing::warn!(sandbox = %sb.id, error = %e, "removing sandbox cgroup");
        }
        teardown_mount(&sb.rootfs);
        if let Ok(pool) = self.pool() {
            if let Err(e) = pool.delete_subvolume(&subvolume_of(&sb.id)) {
                tracing::warn!(sandbox = %sb.id, error = %e, "deleting writable layer");
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&sb.run_dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox = %sb.id, error = %e, "removing run dir");
            }
        }
    }
}

/// Unmounts a sandbox's rootfs; lazily if something still holds it, so it never blocks destroy.
fn teardown_mount(rootfs: &Path) {
    if !is_mount_point(rootfs) {
        return;
    }
    if let Err(e) = umount2(rootfs, MntFlags::empty()) {
        tracing::debug!(path = %rootfs.display(), error = %e, "umount busy; detaching");
        if let Err(e) = umount2(rootfs, MntFlags::MNT_DETACH) {
            tracing::warn!(path = %rootfs.display(), error = %e, "cannot unmount sandbox rootfs");
        }
    }
}

#[async_trait]
impl Backend for ProcessBackend {
    fn isolation(&self) -> Isolation {
        Isolation::Process
    }

    fn availability(&self) -> Result<(), String> {
        match &self.unavailable {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        let sandbox = match self.setup(spec).await {
            Ok(sb) => sb,
            Err(e) => {
                // Undo whatever part of the setup happened before the failure.
                let partial = self.cgroups.as_ref().and_then(|c| c.open_sandbox(spec.id.as_str()));
                if let Some(cg) = partial {
                    let _ = cg.destroy();
                }
                teardown_mount(&self.cfg.state_dir.join("run").join(spec.id.as_str()).join("rootfs"));
                let _ = std::fs::remove_dir_all(self.cfg.state_dir.join("run").join(spec.id.as_str()));
                if let Ok(pool) = self.pool() {
                    let _ = pool.delete_subvolume(&subvolume_of(&spec.id));
                }
                return Err(e);
            }
        };
        self.sandboxes
            .write()
            .map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?
            .insert(spec.id.clone(), sandbox);
        Ok(())
    }

    async fn exec(&self, sandbox: &SandboxId, spec: ExecSpec, sink: OutputSink, cancel: CancellationToken) -> Result<ExecOutcome, BackendError> {
        self.sandbox(sandbox)?.run_exec(spec, sink, cancel).await
    }

    async fn signal_exec(&self, sandbox: &SandboxId, exec: &ExecId, signal: i32) -> Result<(), BackendError> {
        let sb = self.sandbox(sandbox)?;
        let cg = sb.running.lock().ok().and_then(|r| r.get(exec.as_str()).cloned()).ok_or_else(|| BackendError::NoSuchExec(exec.clone()))?;
        let sig = nix::sys::signal::Signal::try_from(signal).map_err(|_| BackendError::InvalidPath { path: String::new(), reason: format!("invalid signal {signal}") })?;
        cg.signal_all(sig)?;
        Ok(())
    }

    async fn write_file(&self, sandbox: &SandboxId, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let (path, content) = (path.to_string(), content.to_vec());
        tokio::task::spawn_blocking(move || files::write_file(&sb.rootfs, &sb.workdir, &path, &content, mode))
            .await
            .map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    async fn read_file(&self, sandbox: &SandboxId, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || files::read_file(&sb.rootfs, &sb.workdir, &path, offset, limit))
            .await
            .map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    async fn snapshot(&self, sandbox: &SandboxId, _snapshot: &SnapshotId) -> Result<u64, BackendError> {
        self.sandbox(sandbox)?;
        Err(BackendError::Internal("snapshots are not implemented yet".into()))
    }

    async fn rollback(&self, sandbox: &SandboxId, _snapshot: &SnapshotId) -> Result<(), BackendError> {
        self.sandbox(sandbox)?;
        Err(BackendError::Internal("rollback is not implemented yet".into()))
    }

    async fn delete_snapshot(&self, snapshot: &SnapshotId) -> Result<(), BackendError> {
        Err(BackendError::NoSuchSnapshot(snapshot.clone()))
    }

    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let sb = {
            let mut map = self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?;
            map.remove(sandbox).ok_or_else(|| BackendError::NoSuchSandbox(sandbox.clone()))?
        };
        self.teardown(&sb).await;
        Ok(())
    }

    async fn shutdown(&self) {
        let all: Vec<_> = match self.sandboxes.write() {
            Ok(mut map) => map.drain().map(|(_, sb)| sb).collect(),
            Err(_) => Vec::new(),
        };
        for sb in all {
            self.teardown(&sb).await;
        }
        // The pool is unmounted (its loop device auto-clears); it is mounted again at start.
        if self.pool.is_some() {
            let pool_dir = self.cfg.state_dir.join("pool");
            if let Err(e) = umount2(&pool_dir, MntFlags::empty()) {
                tracing::warn!(path = %pool_dir.display(), error = %e, "unmounting storage pool");
            }
        }
        if let Some(cg) = &self.cgroups {
            if let Err(e) = cg.cleanup_root() {
                tracing::warn!(error = %e, "removing the daemon's cgroup");
            }
        }
    }
}
