//! The process tier: Linux namespaces, a cgroup per sandbox and per exec, capabilities,
//! no_new_privs and seccomp, over an overlay root filesystem whose writable layer is a
//! size-limited btrfs subvolume.
//!
//! Layout on the host (all under `--state-dir`):
//! * `pool/` — the btrfs pool ([`storage`]); `pool/sandboxes/<id>/{upper,work}` is a sandbox's
//!   writable layer, `pool/snapshots/<id>` a read-only snapshot of one;
//! * `pool/shifted/` — without idmapped mounts ([`shift`]): `image-<key>` a canonical copy of an
//!   image, `<id>` its snapshot shifted into sandbox `<id>`'s id range (its lower layer);
//! * `run/<id>/rootfs` — the merged overlay (image rootfs below, the subvolume above), which
//!   becomes `/` in the sandbox. The init's stderr is a pipe to the daemon (see
//!   [`channel::InitLog`]), never a host file.
//!
//! The state dir is 0700 and mounted nosuid,nodev,noexec ([`crate::hostfs`]), the pool too.
//!
//! A sandbox's PID 1 is an init cloned by the zygote ([`zygote`]), a process the daemon starts
//! once from this binary; the daemon talks to each init over a socket pair ([`channel`]).

mod channel;
mod exec;
pub mod idmap;
pub mod init;
mod net;
mod pty;
pub mod shift;
mod spares;
pub mod storage;
mod wire;
pub mod zygote;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use tokio_util::sync::CancellationToken;

use self::channel::InitChannel;
use self::storage::Pool;
use super::cgroup::{self, CgroupLimits, CgroupRoot, CgroupView, ExecCgroups, SandboxCgroup};
use super::files;
use super::mountinfo;
use super::{
    ArchiveStats, Backend, BackendError, ByteChunks, Download, ExecOutcome, ExecSpec, FileChunk, Isolation, OutputSink, SandboxSpec, SandboxUsage, StartSignal,
    UploadPiece,
};
use crate::hostfs;
use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::images::Catalog;

/// How long sandbox setup may take before it is abandoned.
const SETUP_DEADLINE: Duration = Duration::from_secs(10);

/// How long a snapshot waits for a spare being armed before it judges whether the sandbox is
/// quiet (arming takes well under a millisecond to a few; past this the snapshot freezes).
const ARMING_SETTLE: Duration = Duration::from_secs(1);

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
    /// Where images are found (their rootfs is the overlay's lower layer).
    pub catalog: Arc<Catalog>,
    pub pool_size_bytes: u64,
    /// User namespaces for the sandboxes, and the host ids they are given (see [`idmap`]).
    pub userns: idmap::UsernsMode,
    pub userns_first_id: u32,
    pub userns_ranges: u32,
    /// The daemon's egress filter, for sandboxes whose network is not NONE.
    pub egress: Option<Arc<crate::egress::Egress>>,
    /// How many sandboxes keep a spare forked ahead for their next exec (see [`spares`]).
    pub spares: usize,
}

/// Where a sandbox's writable layer comes from at setup.
#[derive(Debug, Clone, Copy)]
enum Layer<'a> {
    /// A new, empty layer over the image.
    Fresh,
    /// A writable snapshot of a snapshot (a fork, or a rollback).
    From(&'a SnapshotId),
    /// The layer already on disk (re-adoption after a restart).
    Existing,
}

/// One live process-tier sandbox: its runtime (processes, cgroup, mount) over its layer.
pub(crate) struct ProcessSandbox {
    id: SandboxId,
    spec: SandboxSpec,
    /// Set (with the reason) when the runtime is being taken down under running execs, which
    /// then end as LOST rather than as whatever the kill made of them.
    lost: Mutex<Option<String>>,
    /// Host path of the merged overlay (the sandbox's `/`).
    rootfs: PathBuf,
    run_dir: PathBuf,
    workdir: String,
    cgroup: SandboxCgroup,
    channel: InitChannel,
    /// The tail of the init's stderr, for error messages.
    log: channel::InitLog,
    /// The init, as the zygote that cloned it reports it (its end means the sandbox's pid
    /// namespace is empty). None until the zygote has answered the start.
    init: tokio::sync::Mutex<Option<zygote::InitHandle>>,
    /// Cgroups of running execs and of finished ones with processes left behind.
    execs: ExecCgroups,
    /// The armed spare, and maybe its slot's cgroup (see `arm_spare`).
    spare: Mutex<Option<exec::Spare>>,
    /// A slot is being armed.
    arming: std::sync::atomic::AtomicBool,
    /// Told when an arming ends (see [`ProcessSandbox::settle_arming`]).
    armed: tokio::sync::Notify,
    /// The backend's count of armed spares, which this sandbox's spare takes a place in.
    spares: Arc<spares::Spares>,
    /// Execs begun (ever) and not yet ended: what [`ProcessSandbox::is_quiet`] reads.
    execs_begun: std::sync::atomic::AtomicU64,
    execs_active: std::sync::atomic::AtomicU64,
    /// The host CPUs its processes run on; given back when the runtime goes.
    cpus: super::cpus::CpuLease,
    /// Its user namespace's host id range (none without user namespaces); given back when the
    /// runtime goes.
    ids: Option<idmap::IdLease>,
}

impl ProcessSandbox {
    /// Waits (at most [`ARMING_SETTLE`]) for a spare being armed to be kept: between its fork
    /// and its keeping it is a process [`ProcessSandbox::quiet`] cannot account for, and an
    /// exec just ended always has the next one being armed.
    async fn settle_arming(&self) {
        let armed = self.armed.notified();
        if self.arming.load(std::sync::atomic::Ordering::Acquire) {
            let _ = tokio::time::timeout(ARMING_SETTLE, armed).await;
        }
    }

    /// The count of execs begun so far, when nothing in the sandbox can be writing to its
    /// filesystem: no exec is under way and no process is there but the init and the armed
    /// spare, which only wait for the daemon. A background process an exec left, a spare
    /// between its fork and its slot: not quiet.
    fn quiet(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        let begun = self.execs_begun.load(SeqCst);
        // Every exec counts in `execs_active` from before its cgroup is taken until it has ended.
        if self.execs_active.load(SeqCst) != 0 {
            return None;
        }
        // The spare is in its slot's cgroup, or (`cgroup` None) in the sandbox's own with the init.
        let (spare, own_max) = match self.spare.lock().ok()?.as_ref() {
            Some(exec::Spare { cgroup: Some(slot), .. }) => (slot.pids(), 1),
            Some(exec::Spare { cgroup: None, .. }) => (Vec::new(), 2),
            None => (Vec::new(), 1),
        };
        let own = self.cgroup.own_pids();
        let all = self.cgroup.pids();
        (own.len() <= own_max && all.iter().all(|p| own.contains(p) || spare.contains(p))).then_some(begun)
    }

    /// The id shift of its user namespace, if it has one.
    fn ids(&self) -> Option<sandbox_exec::archive::IdShift> {
        self.ids.as_ref().map(idmap::IdLease::shift)
    }
}

/// The process-tier backend.
pub struct ProcessBackend {
    cfg: ProcessConfig,
    /// Why this host cannot run the tier, if it cannot.
    unavailable: Option<String>,
    pool: Option<Pool>,
    cgroups: Option<CgroupRoot>,
    /// The host id ranges of user namespaces, when sandboxes get them.
    ids: Option<Arc<idmap::IdRanges>>,
    /// Whether sandboxes' files are shifted on disk into their ranges ([`shift`]) rather than
    /// shown through idmapped mounts.
    shifting: bool,
    /// Held while an image's canonical copy in `pool/shifted/` is made (one copy per image).
    image_copies: Arc<Mutex<()>>,
    /// Clones every sandbox's init.
    zygote: zygote::Zygote,
    /// The sandboxes that keep a spare for their next exec.
    spares: Arc<spares::Spares>,
    sandboxes: RwLock<HashMap<SandboxId, Arc<ProcessSandbox>>>,
    /// v1: the read-only tmpfs every sandbox binds at `/sys/fs/cgroup` (see [`cgroup_skeleton`]).
    cgroup_skeleton: Option<PathBuf>,
    /// The read-only sysfs every sandbox without a network link binds at `/sys` (see
    /// [`shared_sysfs`]); None: each mounts its own.
    shared_sysfs: Option<SharedSysfs>,
    /// Names of sandboxes whose runtime state (cgroup, run dir) a previous daemon left, listed
    /// before serving and removed once re-adoption is done ([`Backend::recovered`]).
    stale: std::sync::Mutex<Vec<String>>,
}

/// Mounts, at `path`, the read-only tmpfs that every sandbox on a cgroup v1 host binds at its
/// `/sys/fs/cgroup`: a directory per hierarchy (named by its controllers, as its mount options
/// say: `cpu,cpuacct`) and a symlink for each controller of a co-mounted one (`cpu ->
/// cpu,cpuacct`). Each sandbox's init mounts its own cgroup of every hierarchy on those
/// directories, in its own mount namespace. One tmpfs for all instead of one each: every
/// superblock registers a shrinker, and every memory cgroup on the host keeps a map of all of
/// them, so a superblock per sandbox costs the kernel memory that grows with the square of the
/// sandboxes alive. A tmpfs a previous daemon left there is detached first (sandboxes that bound
/// it keep theirs).
fn cgroup_skeleton(path: &Path, hierarchies: &[String]) -> Result<(), String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("{what} {}: {e}", path.display());
    std::fs::create_dir_all(path).map_err(|e| fail("creating", &e))?;
    detach_all(path)?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("tmpfs"), path, Some("tmpfs"), flags, Some("mode=755,size=64k")).map_err(|e| fail("mounting a tmpfs at", &e))?;
    // Nothing below it propagates to or from the host's mounts.
    mount(None::<&str>, path, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).map_err(|e| fail("making private", &e))?;
    let layout = || -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        for controllers in hierarchies {
            std::fs::DirBuilder::new().mode(0o555).create(path.join(controllers))?;
            for name in controllers.split(',').filter(|c| c != controllers) {
                std::os::unix::fs::symlink(controllers, path.join(name))?;
            }
        }
        Ok(())
    };
    layout().map_err(|e| fail("laying out", &e))?;
    mount(None::<&str>, path, None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags, None::<&str>).map_err(|e| fail("remounting read-only", &e))
}

/// Detaches whatever is mounted at `path` (a previous daemon's shared mount; sandboxes that
/// bound it keep theirs), however many mounts are stacked there.
fn detach_all(path: &Path) -> Result<(), String> {
    while mountinfo::is_mount_point(path) {
        umount2(path, MntFlags::MNT_DETACH).map_err(|e| format!("detaching the previous mount at {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The read-only sysfs that every sandbox without a network link (network NONE) binds at its
/// `/sys`, mounted at `<state>/sysfs-view`: one superblock for all of them, not one each (each
/// superblock costs the kernel a shrinker, and every memory cgroup a map of all shrinkers, so
/// the cost grows with the square of the sandboxes alive). sysfs shows the network devices of
/// the namespace it was mounted in, so this one is mounted from a network namespace of its own,
/// which has what such a sandbox's own has: `lo`, up. The namespace is kept alive (sysfs holds
/// only a passive reference) by a bind of it at `<state>/sysfs-netns`. Both are made at start
/// (a previous pair detached) and detached at shutdown. Sandboxes with a link mount a sysfs of
/// their own, so their `/sys/class/net` shows it.
fn shared_sysfs(state_dir: &Path) -> Result<SharedSysfs, String> {
    let (view, netns) = (state_dir.join("sysfs-view"), state_dir.join("sysfs-netns"));
    let fail = |what: &str, path: &Path, e: &dyn std::fmt::Display| format!("{what} {}: {e}", path.display());
    detach_all(&view)?;
    detach_all(&netns)?;
    std::fs::create_dir_all(&view).map_err(|e| fail("creating", &view, &e))?;
    std::fs::write(&netns, b"").map_err(|e| fail("creating", &netns, &e))?;
    let shared = SharedSysfs { view, netns };
    let (v, n) = (shared.view.clone(), shared.netns.clone());
    // A thread of its own: a network namespace is per thread. The thread stays in the host's
    // mount namespace, so both mounts are the host's.
    let made = std::thread::spawn(move || -> Result<(), String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare(CLONE_NEWNET): {e}"))?;
        sandbox_exec::sys::loopback_up().map_err(|e| format!("bringing lo up: {e}"))?;
        mount(Some("/proc/thread-self/ns/net"), &n, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(|e| fail("binding the namespace at", &n, &e))?;
        let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(Some("sysfs"), &v, Some("sysfs"), flags, None::<&str>).map_err(|e| fail("mounting sysfs at", &v, &e))?;
        // Nothing below it propagates to or from the host's mounts.
        mount(None::<&str>, &v, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).map_err(|e| fail("making private", &v, &e))
    })
    .join()
    .map_err(|_| "the thread mounting it panicked".to_string())
    .and_then(|mounted| mounted);
    match made {
        Ok(()) => Ok(shared),
        Err(e) => {
            // Half made (the namespace bound, sysfs not): nothing of it is left mounted.
            shared.detach();
            Err(e)
        }
    }
}

/// The shared sysfs and the bind that keeps its network namespace alive.
struct SharedSysfs {
    view: PathBuf,
    netns: PathBuf,
}

impl SharedSysfs {
    /// Detaches both (sandboxes that bound the view keep theirs).
    fn detach(&self) {
        for path in [&self.view, &self.netns] {
            if let Err(e) = detach_all(path) {
                tracing::warn!(error = %e, "detaching the shared sysfs");
            }
        }
    }
}

/// The file in a writable layer (beside `upper/` and `work/`) that records the host id range
/// the sandbox had, so a restart can give it the same one.
const IDS_FILE: &str = "idrange";

/// What [`IDS_FILE`] records: the range's base, and whether the layer's files are shifted into
/// it on disk (else canonical, see [`shift`]). Written as `<base>` or `<base> shifted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LayerIds {
    base: u32,
    shifted: bool,
}

impl LayerIds {
    fn read(layer: &Path) -> Option<LayerIds> {
        let text = std::fs::read_to_string(layer.join(IDS_FILE)).ok()?;
        let mut words = text.split_whitespace();
        let base = words.next()?.parse().ok()?;
        Some(LayerIds { base, shifted: words.next() == Some("shifted") })
    }

    fn write(&self, layer: &Path) -> Result<(), BackendError> {
        let text = if self.shifted { format!("{} shifted\n", self.base) } else { format!("{}\n", self.base) };
        std::fs::write(layer.join(IDS_FILE), text).map_err(|e| BackendError::io("recording the id range", e))
    }
}

/// `f` on a blocking thread; its I/O error says what was being done.
async fn run_blocking<T: Send + 'static>(what: &'static str, f: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| BackendError::Internal(format!("{what}: {e}")))?.map_err(|e| BackendError::io(what, e))
}

/// Makes subvolume `rel` of `pool` unless it exists: `make` builds it under the name `tmp`
/// (removed first, and again when `make` fails) and it is renamed into place, all under `lock`,
/// so a half-made one is never found under `rel`.
fn made_once(pool: &Pool, lock: &Mutex<()>, rel: &str, tmp: &str, make: impl FnOnce(&str) -> std::io::Result<PathBuf>) -> std::io::Result<()> {
    if pool.root().join(rel).is_dir() {
        return Ok(());
    }
    let _held = lock.lock().map_err(|_| std::io::Error::other("image copy lock poisoned"))?;
    if pool.root().join(rel).is_dir() {
        return Ok(());
    }
    let storage = |e: storage::StorageError| std::io::Error::other(e.to_string());
    pool.delete_subvolume(tmp).map_err(storage)?;
    match make(tmp) {
        Ok(made) => std::fs::rename(made, pool.root().join(rel)),
        Err(e) => {
            if let Err(d) = pool.delete_subvolume(tmp) {
                tracing::warn!(subvolume = tmp, error = %d, "cannot remove a half-made image copy");
            }
            Err(e)
        }
    }
}

/// Sandbox `name`'s lower layer without idmapped mounts: a read-only snapshot of the image's
/// copy shifted into the range at `base` (`image-<key>-r<base>`, itself a snapshot of the
/// image's canonical copy `image-<key>`; each made on first use, under `lock`). Made afresh for
/// every setup (the range may differ), removed with the sandbox.
fn shifted_lower(pool: &Pool, lock: &Mutex<()>, image_rootfs: &Path, name: &str, base: u32) -> std::io::Result<PathBuf> {
    use sha2::Digest;
    use std::os::unix::fs::MetadataExt;
    let storage = |e: storage::StorageError| std::io::Error::other(e.to_string());
    // The copy is named by the image's path and by its root directory's inode and change time
    // (an image built or imported again is another directory): one copy per path is kept.
    let m = std::fs::metadata(image_rootfs)?;
    let hex = |parts: &[&[u8]]| -> String {
        let mut h = sha2::Sha256::new();
        for p in parts {
            h.update(p);
            h.update([0]);
        }
        h.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect()
    };
    let of_path = hex(&[image_rootfs.as_os_str().as_encoded_bytes()]);
    let version = hex(&[format!("{} {} {}", m.ino(), m.ctime(), m.ctime_nsec()).as_bytes()]);
    let key = format!("{of_path}-{version}");
    let image = format!("shifted/image-{key}");
    made_once(pool, lock, &image, &format!("shifted/tmp-{key}"), |tmp| {
        let t0 = std::time::Instant::now();
        let dst = pool.create_subvolume(tmp).map_err(storage)?;
        let mut src = image_rootfs.as_os_str().to_owned();
        src.push("/.");
        let out = std::process::Command::new("cp").arg("-a").arg("--reflink=auto").arg("--").arg(&src).arg(&dst).output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "copying {}: cp {}: {}",
                image_rootfs.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        // Earlier copies of the same path (the image was replaced) are stale.
        for old in pool.subvolumes("shifted").into_iter().filter(|n| n.starts_with(&format!("image-{of_path}-")) && !n.starts_with(&format!("image-{key}"))) {
            if let Err(e) = pool.delete_subvolume(&format!("shifted/{old}")) {
                tracing::warn!(copy = %old, error = %e, "cannot remove a stale image copy");
            }
        }
        tracing::info!(image = %image_rootfs.display(), copy = %image, ms = t0.elapsed().as_millis() as u64, "image copied into the pool, to be shifted into sandboxes' id ranges");
        Ok(dst)
    })?;
    // The copy shifted into this range, made on the range's first use and kept: a range freed
    // is the next one leased, so creates after destroys find it.
    let ranged = format!("shifted/image-{key}-r{base}");
    made_once(pool, lock, &ranged, &format!("shifted/tmp-{key}-r{base}"), |tmp| {
        let path = pool.snapshot(&image, tmp, false).map_err(storage)?;
        let t0 = std::time::Instant::now();
        let done = shift::shift_tree(&path, shift::Shift::Into(base))?;
        tracing::info!(copy = %ranged, entries = done.entries, ms = t0.elapsed().as_millis() as u64, "image shifted into an id range");
        Ok(path)
    })?;
    // The sandbox's own read-only snapshot of it: O(1), removed with the sandbox.
    let lower = format!("shifted/{name}");
    pool.delete_subvolume(&lower).map_err(storage)?;
    pool.snapshot(&ranged, &lower, true).map_err(storage)
}

fn subvolume_of(id: &SandboxId) -> String {
    format!("sandboxes/{id}")
}

fn snapshot_of(id: &SnapshotId) -> String {
    format!("snapshots/{id}")
}

impl ProcessBackend {
    /// Prepares the tier: the cgroup root and the storage pool. A host that cannot provide them
    /// gets a backend that reports why on every create (the daemon still serves other tiers).
    pub fn new(cfg: ProcessConfig) -> Self {
        let mut backend = ProcessBackend {
            spares: Arc::new(spares::Spares::new(cfg.spares)),
            cfg,
            unavailable: None,
            pool: None,
            cgroups: None,
            ids: None,
            shifting: false,
            image_copies: Default::default(),
            zygote: Default::default(),
            sandboxes: RwLock::new(HashMap::new()),
            cgroup_skeleton: None,
            shared_sysfs: None,
            stale: Default::default(),
        };
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
        let cgroups = CgroupRoot::detect(&cgroup::daemon_cgroup_name(&self.cfg.state_dir)).map_err(|e| format!("cgroups: {e}"))?;
        tracing::info!(version = ?cgroups.version(), "cgroup hierarchy detected");
        let pool = Pool::open_or_create(&self.cfg.state_dir.join("pool"), self.cfg.pool_size_bytes).map_err(|e| format!("storage pool: {e}"))?;
        std::fs::create_dir_all(self.cfg.state_dir.join("run")).map_err(|e| format!("creating run dir: {e}"))?;
        (self.ids, self.shifting) = match self.prepare_userns(&pool)? {
            Some((ranges, shifting)) => (Some(ranges), shifting),
            None => (None, false),
        };
        if let CgroupView::V1 { hierarchies } = cgroups.sandbox_view() {
            let path = self.cfg.state_dir.join("cgroup-view");
            cgroup_skeleton(&path, &hierarchies).map_err(|e| format!("the sandboxes' /sys/fs/cgroup layout: {e}"))?;
            self.cgroup_skeleton = Some(path);
        }
        self.shared_sysfs = match shared_sysfs(&self.cfg.state_dir) {
            Ok(view) => Some(view),
            Err(e) => {
                tracing::warn!(error = %e, "no shared sysfs: each sandbox mounts its own");
                None
            }
        };
        self.cgroups = Some(cgroups);
        self.pool = Some(pool);
        // What a previous daemon left (cgroups, overlay mounts, run dirs) is listed now, before
        // any create can be setting up a sandbox of its own, and removed later: a sandbox's own
        // leftovers when it is re-adopted, the rest once all are back. Removing them here took
        // ~4 s before the daemon listened with 1,000 sandboxes; listing them after serving would
        // take a create's half-made cgroup and mount for leftovers.
        let stale = self.list_stale_runtime();
        if let Ok(mut list) = self.stale.lock() {
            *list = stale;
        }
        Ok(())
    }

    /// The id ranges, and whether files are shifted on disk: idmapped mounts when one of the
    /// pool and of each image directory could be made, shifted copies otherwise (`auto`,
    /// `required`) or when asked (`shifted`). Without a user namespace at all, `auto` logs why
    /// and goes on without, `required` fails the tier.
    fn prepare_userns(&self, pool: &Pool) -> Result<Option<(Arc<idmap::IdRanges>, bool)>, String> {
        use idmap::UsernsMode;
        if self.cfg.userns == UsernsMode::Off {
            tracing::warn!(
                "user namespaces are off ([process] user_namespaces = \"off\"): root in a process sandbox is the host's root, uid 1000 the host's uid 1000"
            );
            return Ok(None);
        }
        let ranges = idmap::IdRanges::new(self.cfg.userns_first_id, self.cfg.userns_ranges)?;
        let probe = || -> Result<(), String> {
            if self.cfg.userns == UsernsMode::Shifted {
                return Err("[process] user_namespaces = \"shifted\"".to_string());
            }
            let lease = ranges.lease(None)?;
            let ns = lease.mount_userns().map_err(|e| format!("creating a user namespace: {e}"))?;
            let scratch = self.cfg.state_dir.join("run");
            std::fs::create_dir_all(&scratch).map_err(|e| format!("creating {}: {e}", scratch.display()))?;
            idmap::probe(pool.root(), &scratch, &ns)?;
            for dir in [self.cfg.catalog.images_dir().to_path_buf(), self.cfg.catalog.imported_dir().to_path_buf()] {
                if dir.is_dir() {
                    idmap::probe(&dir, &scratch, &ns)?;
                }
            }
            Ok(())
        };
        let shifting = match probe() {
            Ok(()) => false,
            Err(reason) => {
                // Shifted copies need only a user namespace: one must be possible.
                if let Err(e) = idmap::make_userns(&idmap::process_idmap(self.cfg.userns_first_id)) {
                    let reason = format!("{reason}; and no user namespace can be made: {e}");
                    if self.cfg.userns == UsernsMode::Required {
                        return Err(format!("user namespaces are required but unusable here: {reason}"));
                    }
                    tracing::warn!(%reason, "user namespaces unusable here: process sandboxes run without one (sandbox uids are host uids); set [process] user_namespaces = \"off\" to say so, or \"required\" to refuse");
                    return Ok(None);
                }
                tracing::warn!(
                    %reason,
                    "no idmapped mounts: each process sandbox's image and writable layer are shifted into its id range on disk (a copy of each image, a shift per create and snapshot; see README, User namespaces)"
                );
                true
            }
        };
        tracing::info!(
            first_id = self.cfg.userns_first_id,
            ranges = self.cfg.userns_ranges,
            shifted = shifting,
            "process sandboxes get a user namespace each: root inside is an unprivileged host uid of its own range"
        );
        Ok(Some((ranges, shifting)))
    }

    /// The sandboxes a previous daemon on this state dir left runtime state of: their processes
    /// died with it (each init exits when its control socket closes), but cgroups, overlay
    /// mounts and run dirs remain. Writable layers are for [`Backend::clean`] to judge.
    fn list_stale_runtime(&self) -> Vec<String> {
        let mut names: Vec<String> = self.cgroups.as_ref().map(|c| c.list_sandboxes()).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir(self.cfg.state_dir.join("run")) {
            names.extend(entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()));
        }
        names.sort();
        names.dedup();
        names
    }

    /// Removes the leftovers of `names` (see [`ProcessBackend::list_stale_runtime`]) except
    /// those of sandboxes running now: a re-adopted one cleared its own before it started, and
    /// no new sandbox can have a listed name (ids are never reused).
    fn clean_stale_runtime(&self, names: Vec<String>) {
        let live: std::collections::HashSet<String> = match self.sandboxes.read() {
            Ok(map) => map.keys().map(|id| id.to_string()).collect(),
            Err(_) => return,
        };
        let run = self.cfg.state_dir.join("run");
        for name in names.into_iter().filter(|n| !live.contains(n)) {
            if let Some(cg) = self.cgroups.as_ref().and_then(|c| c.open_sandbox(&name)) {
                tracing::debug!(sandbox = %name, "removing cgroup left by a previous run");
                if let Err(e) = cg.destroy() {
                    tracing::warn!(sandbox = %name, error = %e, "cannot remove stale cgroup");
                }
            }
            let dir = run.join(&name);
            if dir.exists() {
                teardown_mount(&dir.join("rootfs"));
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove stale run dir");
                }
            }
        }
    }

    /// Removes what a previous daemon left of sandbox `id` (its cgroup, rootfs mount and run
    /// dir) before it is set up again.
    fn clean_stale_one(&self, id: &SandboxId) {
        if let Some(cg) = self.cgroups.as_ref().and_then(|c| c.open_sandbox(id.as_str())) {
            if let Err(e) = cg.destroy() {
                tracing::warn!(sandbox = %id, error = %e, "cannot remove stale cgroup");
            }
        }
        let dir = self.cfg.state_dir.join("run").join(id.as_str());
        if dir.exists() {
            teardown_mount(&dir.join("rootfs"));
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove stale run dir");
            }
        }
    }

    /// Deletes subvolumes under `dir` ("sandboxes" or "snapshots") whose names are not in `keep`.
    fn delete_unknown_subvolumes(&self, dir: &str, keep: &std::collections::HashSet<String>) {
        let Some(pool) = &self.pool else { return };
        for name in pool.subvolumes(dir) {
            if !keep.contains(&name) {
                tracing::info!(subvolume = %format!("{dir}/{name}"), "removing a layer no record refers to");
                if let Err(e) = pool.delete_subvolume(&format!("{dir}/{name}")) {
                    tracing::warn!(subvolume = %name, error = %e, "cannot remove stale subvolume");
                }
            }
        }
    }

    /// Removes sandbox `id`'s shifted lower layer, if it has one (its overlay must be gone).
    fn delete_shifted_lower(&self, id: &SandboxId) {
        if let Some(pool) = &self.pool {
            if let Err(e) = pool.delete_subvolume(&format!("shifted/{id}")) {
                tracing::warn!(sandbox = %id, error = %e, "cannot remove the shifted image of a sandbox");
            }
        }
    }

    /// Undoes a setup that failed part way (each step tolerates never having happened).
    fn undo_setup(&self, id: &SandboxId, delete_layer: bool) {
        if let Some(cg) = self.cgroups.as_ref().and_then(|c| c.open_sandbox(id.as_str())) {
            if let Err(e) = cg.destroy() {
                tracing::warn!(sandbox = %id, error = %e, "removing cgroup of a failed setup");
            }
        }
        let run_dir = self.cfg.state_dir.join("run").join(id.as_str());
        teardown_mount(&run_dir.join("rootfs"));
        let _ = std::fs::remove_dir_all(&run_dir);
        self.delete_shifted_lower(id);
        if delete_layer {
            if let Ok(pool) = self.pool() {
                if let Err(e) = pool.delete_subvolume(&subvolume_of(id)) {
                    tracing::warn!(sandbox = %id, error = %e, "removing layer of a failed setup");
                }
            }
        }
    }

    /// Sets a sandbox up and registers it; undoes everything on failure.
    async fn start(&self, spec: &SandboxSpec, source: Layer<'_>) -> Result<(), BackendError> {
        match self.setup(spec, source).await {
            Ok(sandbox) => {
                self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?.insert(spec.id.clone(), sandbox);
                Ok(())
            }
            Err(e) => {
                // An existing layer holds the user's files: a failed restart must not delete it.
                self.undo_setup(&spec.id, !matches!(source, Layer::Existing));
                Err(e)
            }
        }
    }

    fn take_sandbox(&self, id: &SandboxId) -> Result<Arc<ProcessSandbox>, BackendError> {
        let mut map = self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?;
        map.remove(id).ok_or_else(|| BackendError::NoSuchSandbox(id.clone()))
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

    /// The sandbox's root directory, opened on a blocking thread (the open waits for the disk).
    async fn root_of(&self, sb: &ProcessSandbox) -> Result<std::fs::File, BackendError> {
        let rootfs = sb.rootfs.clone();
        tokio::task::spawn_blocking(move || files::open_root(&rootfs)).await.map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    /// The image's rootfs, the overlay's lower layer. An imported image's lies on the sealed
    /// (`noexec`) state dir: that is no obstacle, the exec check is the overlay mount's own.
    fn image_rootfs(&self, image: &str) -> Result<PathBuf, BackendError> {
        let img = self.cfg.catalog.resolve(image).map_err(|e| BackendError::from_image(Isolation::Process, e))?;
        let rootfs = img.rootfs().canonicalize().map_err(|e| BackendError::io(format!("resolving image {image}"), e))?;
        if rootfs.to_string_lossy().contains([',', ':']) {
            return Err(BackendError::Internal(format!("image path {} contains ',' or ':', which overlayfs options cannot carry", rootfs.display())));
        }
        Ok(rootfs)
    }

    /// The sandbox setup, from the daemon's side. On failure the caller undoes the partial
    /// setup with [`ProcessBackend::undo_setup`], which tolerates steps that never happened.
    async fn setup(&self, spec: &SandboxSpec, source: Layer<'_>) -> Result<Arc<ProcessSandbox>, BackendError> {
        let pool = self.pool()?;
        let t0 = std::time::Instant::now();
        let lower = self.image_rootfs(&spec.image)?;
        let id = &spec.id;

        // 1. The writable layer: a fresh subvolume, a writable snapshot (fork, rollback) or the
        //    one already there (restart); capped at disk_bytes by a qgroup so a full sandbox gets
        //    a write error, never a full host.
        let subvol = subvolume_of(id);
        let layer = match source {
            Layer::Fresh => pool.create_subvolume(&subvol)?,
            Layer::From(snap) => pool.snapshot(&snapshot_of(snap), &subvol, false)?,
            Layer::Existing => pool.root().join(&subvol),
        };
        pool.set_limit(&subvol, spec.limits.disk_bytes)?;
        for d in ["upper", "work"] {
            std::fs::create_dir_all(layer.join(d)).map_err(|e| BackendError::io(format!("creating {d} dir"), e))?;
        }

        let layered = t0.elapsed();
        // 2. The root filesystem: overlay of the read-only image under the writable layer,
        //    mounted nosuid,nodev on the host so the daemon's file API can never open a device
        //    node the sandbox planted. With user namespaces both layers are idmapped mounts of
        //    this sandbox's id range (see `idmap`); the range is kept in the layer, so a
        //    restart gives the sandbox the same one when it is free.
        let run_dir = self.cfg.state_dir.join("run").join(id.as_str());
        let rootfs = run_dir.join("rootfs");
        std::fs::create_dir_all(&rootfs).map_err(|e| BackendError::io("creating rootfs mount point", e))?;
        let recorded = LayerIds::read(&layer);
        let ids = match &self.ids {
            Some(ranges) => {
                let lease = ranges.lease(recorded.map(|r| r.base)).map_err(|reason| BackendError::Unavailable { isolation: Isolation::Process, reason })?;
                Some(lease)
            }
            None => None,
        };
        // Where the writable layer's files must be: shifted into the range (without idmapped
        // mounts), or canonical; a layer from elsewhere (a snapshot, a restart) is shifted so.
        let shifted_into = ids.as_ref().filter(|_| self.shifting).map(idmap::IdLease::base);
        let now = recorded.filter(|r| r.shifted).map(|r| r.base);
        if now != shifted_into {
            let upper = layer.join("upper");
            let moved = run_blocking("shifting the writable layer", move || {
                if let Some(b) = now {
                    shift::shift_tree(&upper, shift::Shift::Out(b))?;
                }
                if let Some(b) = shifted_into {
                    shift::shift_tree(&upper, shift::Shift::Into(b))?;
                }
                Ok(())
            })
            .await;
            moved?;
        }
        if let Some(lease) = &ids {
            LayerIds { base: lease.base(), shifted: shifted_into.is_some() }.write(&layer)?;
        } else if recorded.is_some() {
            let _ = std::fs::remove_file(layer.join(IDS_FILE));
        }
        let (lower, upper_dir) = match &ids {
            Some(lease) if self.shifting => {
                let pool = pool.try_clone().map_err(|e| BackendError::io("opening the pool", e))?;
                let (lock, name, base) = (self.image_copies.clone(), id.to_string(), lease.base());
                let shifted = run_blocking("shifting the image into the range", move || shifted_lower(&pool, &lock, &lower, &name, base)).await?;
                (shifted, layer.clone())
            }
            Some(lease) => {
                let ns = lease.mount_userns().map_err(|e| BackendError::io("creating the mount idmap", e))?;
                let (lower_mnt, layer_mnt) = (run_dir.join("lower"), run_dir.join("layer"));
                for (src, dst) in [(&lower, &lower_mnt), (&layer, &layer_mnt)] {
                    std::fs::create_dir_all(dst).map_err(|e| BackendError::io("creating an idmapped mount point", e))?;
                    idmap::idmapped_bind(src, dst, &ns).map_err(|e| BackendError::io(format!("idmapped mount of {}", src.display()), e))?;
                }
                (lower_mnt, layer_mnt)
            }
            None => (lower.clone(), layer.clone()),
        };
        // The layers are named by descriptor: the options are what the sandbox reads in its
        // /proc/self/mountinfo, and host paths (the state and image dirs) have no business there.
        let open_dir = |p: PathBuf| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                .open(&p)
                .map_err(|e| BackendError::io(format!("opening {}", p.display()), e))
        };
        let layer_dirs = [open_dir(lower.clone())?, open_dir(upper_dir.join("upper"))?, open_dir(upper_dir.join("work"))?];
        let [lower_fd, upper_fd, work_fd] = layer_dirs.each_ref().map(|f| f.as_raw_fd());
        let opts = format!("lowerdir=/proc/self/fd/{lower_fd},upperdir=/proc/self/fd/{upper_fd},workdir=/proc/self/fd/{work_fd}");
        let mounted = mount(Some("overlay"), &rootfs, Some("overlay"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(opts.as_str()));
        drop(layer_dirs);
        if ids.is_some() && !self.shifting {
            // The overlay holds private clones of its layers: the idmapped mounts can go.
            for dir in [&lower, &upper_dir] {
                let _ = umount2(dir, MntFlags::MNT_DETACH);
                let _ = std::fs::remove_dir(dir);
            }
        }
        mounted.map_err(|e| BackendError::io("mounting overlay root filesystem", e.into()))?;
        // The init mounts /proc, /dev and /sys there, by host path, before pivot_root: real
        // directories, whatever a snapshot this starts from holds. Made as root inside.
        files::acting_as(ids.as_ref().map(idmap::IdLease::shift), || {
            for dir in ["proc", "dev", "sys"] {
                files::ensure_mount_point(&rootfs, dir)?;
            }
            for dir in ["tmp", &spec.workdir] {
                files::create_dir_all(&rootfs, dir)?;
            }
            Ok(())
        })?;
        let tmp = rootfs.join("tmp");
        let _ = std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o1777));

        let mounted = t0.elapsed();
        // 3. The cgroup, with the memory, pids and cpu limits.
        let limits = CgroupLimits { memory_bytes: spec.limits.memory_bytes, max_pids: spec.limits.max_pids, cpu_millicores: spec.limits.cpu_millicores };
        let cgroup = self.cgroups()?.create_namespaced_sandbox(id.as_str(), &limits)?;

        // The CPUs the sandbox runs on (its limit rounded up, spread over the host); its /sys
        // shows them as the CPU list (the init writes it).
        let cpus = super::cpus::place(spec.limits.cpu_millicores);

        let grouped = t0.elapsed();
        // 4. The init, cloned by the zygote (see init.rs for the in-sandbox recipe).
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| BackendError::io("creating control socket", e.into()))?;
        // The init's stderr is a pipe the daemon drains, bounded; a file on the host would be a
        // way out of the disk quota for whoever could write to it.
        let (log_r, log_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| BackendError::io("creating init log pipe", e.into()))?;
        let oom = crate::admission::sandbox_oom_score_adj();
        let starting = self
            .zygote
            .start(&theirs, &log_w, ids.as_ref().map(idmap::IdLease::base), oom)
            .await
            .map_err(|e| BackendError::Internal(format!("starting sandbox init: {e}")))?;
        // The zygote holds its own copies now: only the init keeps them, so the daemon sees EOF
        // exactly when the init dies.
        drop((theirs, log_w));
        let log = channel::InitLog::drain(log_r, id.to_string()).map_err(|e| BackendError::io("init log pipe", e))?;
        let channel = InitChannel::new(ours).map_err(|e| BackendError::io("control socket", e))?;
        let sandbox = Arc::new(ProcessSandbox {
            id: id.clone(),
            spec: spec.clone(),
            lost: Mutex::new(None),
            rootfs: rootfs.clone(),
            run_dir,
            workdir: spec.workdir.clone(),
            cgroup,
            channel,
            log,
            init: tokio::sync::Mutex::new(None),
            execs: ExecCgroups::default(),
            spare: Mutex::new(None),
            arming: std::sync::atomic::AtomicBool::new(false),
            armed: tokio::sync::Notify::new(),
            spares: self.spares.clone(),
            execs_begun: std::sync::atomic::AtomicU64::new(0),
            execs_active: std::sync::atomic::AtomicU64::new(0),
            cpus,
            ids,
        });
        let (join_first, join_then) = sandbox.cgroup.init_join_files()?;
        let config = wire::encode(&wire::InitConfig {
            rootfs: rootfs.display().to_string(),
            hostname: id.to_string(),
            join_before_unshare: join_first.len(),
            shm_bytes: spec.limits.shm_size(),
            cpus: sandbox.cpus.cpus().to_vec(),
            cgroup_view: self.cgroups()?.sandbox_view(),
            cgroup_skeleton: self.cgroup_skeleton.as_ref().map(|p| p.display().to_string()),
            shared_sysfs: self.shared_sysfs.as_ref().filter(|_| spec.network.mode == crate::egress::NetworkMode::None).map(|s| s.view.display().to_string()),
            id_base: sandbox.ids.as_ref().map(idmap::IdLease::base),
        })
        .map_err(|e| BackendError::Internal(e.to_string()))?;
        let fds: Vec<i32> = join_first.iter().chain(&join_then).map(|f| f.as_raw_fd()).collect();
        let spawned = t0.elapsed();
        // The configuration waits in the socket for the init the zygote is cloning meanwhile.
        let ready = sandbox.channel.handshake(&config, &fds, SETUP_DEADLINE).await;
        let handshaken = t0.elapsed();
        drop((join_first, join_then));
        let ready = match starting.started().await {
            Ok(handle) => {
                *sandbox.init.lock().await = Some(handle);
                ready
            }
            // Why the init never answered: the zygote could not start it.
            Err(e) => Err(match ready {
                Ok(()) => format!("starting the init: {e}"),
                Err(r) => format!("{r} (zygote: {e})"),
            }),
        };
        // v2: the init has moved on into its leaf, so the exec cgroups may get the controllers.
        let ready = ready.and_then(|()| sandbox.cgroup.enable_children().map_err(|e| format!("enabling the exec cgroups' controllers: {e}")));
        if let Err(reason) = ready {
            let log_tail = sandbox.log.tail();
            self.stop_runtime(&sandbox, "setup failed").await;
            return Err(BackendError::Internal(format!("sandbox {id} setup: {reason} (init log: {log_tail})")));
        }
        if let Err(e) = net::attach(self.cfg.egress.as_deref(), &sandbox).await {
            self.stop_runtime(&sandbox, "network setup failed").await;
            return Err(e);
        }
        sandbox.channel.start_reader(id.to_string());
        sandbox.arm_spare(false);
        let us = |d: std::time::Duration| d.as_micros() as u64;
        tracing::debug!(
            sandbox = %id,
            layer_us = us(layered),
            mount_us = us(mounted - layered),
            cgroup_us = us(grouped - mounted),
            spawn_us = us(spawned - grouped),
            init_us = us(handshaken - spawned),
            rest_us = us(t0.elapsed() - handshaken),
            "setup phases"
        );
        Ok(sandbox)
    }

    /// Stops a sandbox's runtime: processes, cgroups, mount, run dir — not its writable layer.
    /// Execs still running end as LOST with `reason`. Idempotent.
    async fn stop_runtime(&self, sb: &ProcessSandbox, reason: &str) {
        if let Ok(mut lost) = sb.lost.lock() {
            lost.get_or_insert_with(|| reason.to_string());
        }
        sb.channel.close();
        // Its place among the armed spares goes to others (the spare itself dies with the init).
        if let Some(spare) = sb.spare.lock().ok().and_then(|mut s| s.take()) {
            self.spares.release(spare.ticket);
        }
        net::detach(self.cfg.egress.as_deref(), sb).await;
        // Killing the init ends the pid namespace and every process in it.
        if let Err(e) = sb.cgroup.kill_namespace() {
            tracing::warn!(sandbox = %sb.id, error = %e, "killing sandbox processes");
        }
        if let Some(mut init) = sb.init.lock().await.take() {
            if tokio::time::timeout(Duration::from_secs(5), init.wait()).await.is_err() {
                tracing::warn!(sandbox = %sb.id, "init still running 5 s after the kill; killing it");
                init.kill().await;
                if tokio::time::timeout(Duration::from_secs(5), init.wait()).await.is_err() {
                    tracing::warn!(sandbox = %sb.id, "init still running 5 s after SIGKILL");
                }
            }
        }
        sb.execs.remove_leftovers();
        if let Err(e) = self
            .cgroups()
            .map_err(|e| e.to_string())
            .and_then(|c| c.open_sandbox(sb.id.as_str()).map(|cg| cg.destroy().map_err(|e| e.to_string())).unwrap_or(Ok(())))
        {
            tracing::warn!(sandbox = %sb.id, error = %e, "removing sandbox cgroup");
        }
        teardown_mount(&sb.rootfs);
        if let Err(e) = std::fs::remove_dir_all(&sb.run_dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox = %sb.id, error = %e, "removing run dir");
            }
        }
    }
}

/// Unmounts a sandbox's rootfs; lazily if something still holds it, so it never blocks destroy.
fn teardown_mount(rootfs: &Path) {
    if !mountinfo::is_mount_point(rootfs) {
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

    fn image_ready(&self, image: &str) -> Result<(), String> {
        self.availability()?;
        self.image_rootfs(image).map(drop).map_err(|e| e.to_string())
    }

    async fn prepare_image(&self, image: &str) -> Result<String, BackendError> {
        // The rootfs is the lower layer as it is: nothing to make, only to check.
        self.image_rootfs(image)?;
        Ok("the rootfs is the overlay's lower layer".to_string())
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        match &spec.from_snapshot {
            Some(snap) => {
                if !self.pool()?.root().join(snapshot_of(snap)).is_dir() {
                    return Err(BackendError::NoSuchSnapshot(snap.clone()));
                }
                self.start(spec, Layer::From(snap)).await
            }
            None => self.start(spec, Layer::Fresh).await,
        }
    }

    fn failure(&self, sandbox: &SandboxId) -> Option<String> {
        // Sandboxes being stopped on purpose are out of the table before their channel closes,
        // so a closed channel here means the init died on its own.
        let sb = self.sandbox(sandbox).ok()?;
        if !sb.channel.is_closed() {
            return None;
        }
        let tail = sb.log.tail();
        let said = if tail.is_empty() { String::new() } else { format!(" (it said: {tail})") };
        Some(format!("the sandbox's init exited{said}; nothing in it can run any more (its files are kept: snapshot, roll back or destroy it)"))
    }

    async fn exec(
        &self,
        sandbox: &SandboxId,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        self.sandbox(sandbox)?.run_exec(spec, sink, started, cancel).await
    }

    async fn signal_exec(&self, sandbox: &SandboxId, exec: &ExecId, signal: i32) -> Result<(), BackendError> {
        let sb = self.sandbox(sandbox)?;
        let cg = sb.execs.running(exec.as_str()).ok_or_else(|| BackendError::NoSuchExec(exec.clone()))?;
        // The manager admits 1-64 only.
        cg.signal_all(signal)?;
        Ok(())
    }

    async fn write_file(&self, sandbox: &SandboxId, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let (path, content) = (path.to_string(), content.to_vec());
        tokio::task::spawn_blocking(move || files::acting_as(sb.ids(), || files::write_file(&sb.rootfs, &sb.workdir, &path, &content, mode)))
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

    async fn upload_file(&self, sandbox: &SandboxId, path: &str, mode: u32, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let root = self.root_of(&sb).await?;
        files::upload_file_in(root, sb.workdir.clone(), path.to_string(), mode, sb.ids(), data).await
    }

    async fn download_file(&self, sandbox: &SandboxId, path: &str, idle: Duration) -> Result<Download, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || {
            let (file, size) = files::open_for_download_at(&files::open_root(&sb.rootfs)?, &sb.workdir, &path)?;
            Ok(files::stream_download(file, size, &path, idle))
        })
        .await
        .map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    async fn upload_archive(&self, sandbox: &SandboxId, dir: &str, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let root = self.root_of(&sb).await?;
        files::upload_archive_in(root, sb.workdir.clone(), dir.to_string(), sb.ids(), data).await
    }

    async fn download_archive(&self, sandbox: &SandboxId, path: &str, idle: Duration) -> Result<ByteChunks, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || files::stream_archive(files::open_root(&sb.rootfs)?, &sb.workdir, &path, sb.ids(), idle))
            .await
            .map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    async fn remove_file(&self, sandbox: &SandboxId, path: &str) -> Result<(), BackendError> {
        let sb = self.sandbox(sandbox)?;
        let path = path.to_string();
        tokio::task::spawn_blocking(move || files::remove_file(&sb.rootfs, &sb.workdir, &path))
            .await
            .map_err(|e| BackendError::Internal(format!("file task: {e}")))?
    }

    async fn usage(&self, sandbox: &SandboxId) -> Result<SandboxUsage, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let mut usage = sb.cgroup.usage();
        // As of the pool's last commit (btrfs commits at least every 30 s): committing here
        // would make every GetSandbox wait for the disk.
        usage.disk_bytes = self.pool()?.referenced_bytes(&subvolume_of(sandbox)).ok();
        Ok(usage)
    }

    async fn snapshot(&self, sandbox: &SandboxId, snapshot: &SnapshotId, _memory: bool) -> Result<u64, BackendError> {
        let sb = self.sandbox(sandbox)?;
        let pool = self.pool()?;
        // Frozen while the snapshot is taken, so no process is between two writes of a
        // multi-step update; btrfs flushes the subvolume's dirty data as part of the snapshot.
        // A read-only snapshot of the whole layer subvolume is O(1) in the bytes changed.
        let t0 = std::time::Instant::now();
        // A quiet sandbox (no exec under way, no process but the init and the spare) is not
        // frozen: nothing in it can write, and a freeze right after an exec waits ~15 ms on
        // cgroup v1 (the exec's removed cgroup goes offline one RCU grace period later). If
        // an exec began meanwhile, the snapshot is taken again, frozen.
        sb.settle_arming().await;
        let quiet = sb.quiet();
        let (name, layer) = (snapshot_of(snapshot), subvolume_of(sandbox));
        let mut freeze = std::time::Duration::ZERO;
        // Without idmapped mounts the layer's files are shifted into the sandbox's range: the
        // snapshot is taken writable, shifted back to canonical, then made read-only.
        let shifted = sb.ids.as_ref().filter(|_| self.shifting).map(idmap::IdLease::base);
        let readonly = shifted.is_none();
        let taken = match quiet.map(|begun| (begun, pool.snapshot(&layer, &name, readonly))) {
            Some((begun, Ok(path))) if sb.quiet() == Some(begun) => Ok(path),
            unquiet => {
                if matches!(unquiet, Some((_, Ok(_)))) {
                    pool.delete_subvolume(&name)?;
                }
                let f = std::time::Instant::now();
                sb.cgroup.freeze()?;
                freeze = f.elapsed();
                let t = pool.snapshot(&layer, &name, readonly);
                if let Err(e) = sb.cgroup.thaw() {
                    tracing::error!(sandbox = %sandbox, error = %e, "cannot thaw sandbox after snapshot");
                }
                t
            }
        };
        let snapshotted = t0.elapsed();
        let path = taken?;
        if let Some(base) = shifted {
            let (pool2, snap, name2) = (pool.try_clone().map_err(|e| BackendError::io("opening the pool", e))?, path.clone(), name.clone());
            let canonical = run_blocking("shifting the snapshot back", move || {
                shift::shift_tree(&snap.join("upper"), shift::Shift::Out(base))?;
                LayerIds { base, shifted: false }.write(&snap).map_err(|e| std::io::Error::other(e.to_string()))?;
                pool2.make_readonly(&name2).map_err(|e| std::io::Error::other(e.to_string()))
            })
            .await;
            if let Err(e) = canonical {
                if let Err(d) = pool.delete_subvolume(&name) {
                    tracing::warn!(snapshot = %snapshot, error = %d, "cannot remove a snapshot that could not be shifted back");
                }
                return Err(e);
            }
        }
        let upper = path.join("upper");
        let size = tokio::task::spawn_blocking(move || hostfs::tree_size(&upper, hostfs::Measure::Content))
            .await
            .map_err(|e| BackendError::Internal(format!("size task: {e}")))?;
        tracing::debug!(
            sandbox = %sandbox,
            quiet = quiet.is_some(),
            freeze_us = freeze.as_micros() as u64,
            snapshot_us = snapshotted.as_micros() as u64,
            size_us = (t0.elapsed() - snapshotted).as_micros() as u64,
            "snapshot phases"
        );
        Ok(size)
    }

    async fn rollback(&self, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<(), BackendError> {
        let pool = self.pool()?;
        if !pool.root().join(snapshot_of(snapshot)).is_dir() {
            return Err(BackendError::NoSuchSnapshot(snapshot.clone()));
        }
        // Rollback = stop the runtime, swap the writable layer for a writable snapshot of the
        // snapshot (O(1) on btrfs), start the runtime again with the same id and limits.
        let sb = self.take_sandbox(sandbox)?;
        let t0 = std::time::Instant::now();
        self.stop_runtime(&sb, &format!("the sandbox was rolled back to {snapshot}")).await;
        let stopped = t0.elapsed();
        pool.delete_subvolume(&subvolume_of(sandbox))?;
        let deleted = t0.elapsed();
        let started = self.start(&sb.spec, Layer::From(snapshot)).await;
        tracing::debug!(
            sandbox = %sandbox,
            stop_us = stopped.as_micros() as u64,
            delete_us = (deleted - stopped).as_micros() as u64,
            start_us = (t0.elapsed() - deleted).as_micros() as u64,
            "rollback phases"
        );
        started
    }

    async fn delete_snapshot(&self, snapshot: &SnapshotId) -> Result<(), BackendError> {
        Ok(self.pool()?.delete_subvolume(&snapshot_of(snapshot))?)
    }

    async fn pause(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        // The sandbox's cgroup freezer (v1 `freezer.state`, v2 `cgroup.freeze`) is hierarchical:
        // its init, every exec cgroup below it and the armed spare stop together, and an exec
        // cgroup made meanwhile starts frozen. A kill still works (`kill_all` thaws after its
        // SIGKILLs, and v2's `cgroup.kill` reaches frozen tasks), so destroy needs no resume.
        let sb = self.sandbox(sandbox)?;
        tokio::task::spawn_blocking(move || sb.cgroup.freeze()).await.map_err(|e| BackendError::Internal(format!("freeze task: {e}")))??;
        Ok(())
    }

    async fn resume(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let sb = self.sandbox(sandbox)?;
        tokio::task::spawn_blocking(move || sb.cgroup.thaw()).await.map_err(|e| BackendError::Internal(format!("thaw task: {e}")))??;
        Ok(())
    }

    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let sb = self.take_sandbox(sandbox);
        if let Ok(sb) = &sb {
            self.stop_runtime(sb, "the sandbox was destroyed").await;
        }
        // The layer goes even when the runtime was not up (a FAILED sandbox).
        self.delete_shifted_lower(sandbox);
        if let Ok(pool) = self.pool() {
            pool.delete_subvolume(&subvolume_of(sandbox))?;
        }
        sb.map(|_| ())
    }

    async fn clean(&self, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]) {
        let keep_layers: std::collections::HashSet<String> = sandboxes.iter().map(|s| s.id.to_string()).collect();
        self.delete_unknown_subvolumes("sandboxes", &keep_layers);
        let keep_snaps = snapshots.iter().map(|s| s.to_string()).collect();
        self.delete_unknown_subvolumes("snapshots", &keep_snaps);
        // Shifted images of sandboxes that are gone, and copies cut short; image copies stay.
        let mut keep_shifted = keep_layers;
        if let Some(pool) = &self.pool {
            keep_shifted.extend(pool.subvolumes("shifted").into_iter().filter(|n| n.starts_with("image-")));
        }
        self.delete_unknown_subvolumes("shifted", &keep_shifted);
    }

    async fn readopt(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        // Its leftovers are cleared here, and its name leaves the sweep's list: the sweep must
        // never touch a sandbox that is back (a rollback of it may be rebuilding its cgroup).
        if let Ok(mut stale) = self.stale.lock() {
            stale.retain(|n| n != spec.id.as_str());
        }
        self.clean_stale_one(&spec.id);
        match self.pool() {
            Ok(pool) if pool.root().join(subvolume_of(&spec.id)).is_dir() => self.start(spec, Layer::Existing).await,
            Ok(_) => Err(BackendError::Internal(format!("the writable layer of {} is missing", spec.id))),
            Err(e) => Err(e),
        }
    }

    async fn recovered(&self) {
        // Whatever no re-adopted sandbox claimed: sandboxes without a record, or FAILED ones.
        let names = self.stale.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default();
        if names.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        let count = names.len();
        // Seconds of rmdir/umount at thousands of sandboxes: off the async workers that serve.
        if tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
            tokio::task::block_in_place(|| self.clean_stale_runtime(names));
        } else {
            self.clean_stale_runtime(names);
        }
        tracing::info!(listed = count, ms = started.elapsed().as_millis() as u64, "leftovers of the previous run removed");
    }

    async fn shutdown(&self) {
        let all: Vec<_> = match self.sandboxes.write() {
            Ok(mut map) => map.drain().map(|(_, sb)| sb).collect(),
            Err(_) => Vec::new(),
        };
        for sb in all {
            self.stop_runtime(&sb, "the daemon shut down").await;
        }
        // The pool is unmounted (its loop device auto-clears); it is mounted again at start.
        // Detached rather than unmounted: the pool's own directory fd stays open until the daemon
        // exits, which would make a plain unmount EBUSY.
        if self.pool.is_some() {
            let pool_dir = self.cfg.state_dir.join("pool");
            if let Err(e) = umount2(&pool_dir, MntFlags::MNT_DETACH) {
                tracing::warn!(path = %pool_dir.display(), error = %e, "unmounting storage pool");
            }
        }
        // The shared /sys/fs/cgroup layout, sysfs and its network namespace go too (made again
        // at start).
        if let Some(skeleton) = &self.cgroup_skeleton {
            if let Err(e) = umount2(skeleton, MntFlags::MNT_DETACH) {
                tracing::warn!(path = %skeleton.display(), error = %e, "unmounting the shared /sys/fs/cgroup layout");
            }
        }
        if let Some(sysfs) = &self.shared_sysfs {
            sysfs.detach();
        }
        if let Some(cg) = &self.cgroups {
            if let Err(e) = cg.cleanup_root() {
                tracing::warn!(error = %e, "removing the daemon's cgroup");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared v1 layout: a directory per hierarchy and a symlink per co-mounted controller,
    /// read-only; made again over a previous one (a restart), and gone once detached.
    #[test]
    fn the_shared_cgroup_layout_is_read_only_and_made_again_over_a_previous_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cgroup-view");
        let hierarchies = ["memory".to_string(), "cpu,cpuacct".to_string()];
        for round in 0..2 {
            cgroup_skeleton(&path, &hierarchies).expect("the layout");
            assert!(path.join("memory").is_dir() && path.join("cpu,cpuacct").is_dir(), "round {round}");
            assert_eq!(std::fs::read_link(path.join("cpuacct")).expect("symlink"), Path::new("cpu,cpuacct"));
            assert_eq!(std::fs::read_link(path.join("cpu")).expect("symlink"), Path::new("cpu,cpuacct"));
            let err = std::fs::create_dir(path.join("x")).expect_err("a read-only layout");
            assert_eq!(err.raw_os_error(), Some(libc::EROFS), "round {round}: {err}");
        }
        // One mount, not two: the second call detached the first.
        umount2(&path, MntFlags::MNT_DETACH).expect("detach");
        assert!(!mountinfo::is_mount_point(&path), "a second layout was stacked on the first");
    }
}
