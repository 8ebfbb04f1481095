//! The microVM tier: each sandbox is its own Linux kernel in a QEMU `microvm` machine, with the
//! guest agent (`guest-agent` crate) as PID 1 answering over a virtio-serial port.
//!
//! * [`vm`] — starting one confined QEMU and waiting for its agent; KVM or TCG.
//! * [`agent`] — the host end of the agent protocol (many requests in flight, untrusted guest).
//! * [`exec`] — execs and files as agent requests.
//! * [`qmp`] — QEMU's monitor, for disk snapshots while the VM runs.
//! * [`disk`] — qcow2 overlay chains, base copies and garbage collection.
//! * [`pool`] — VMs booted ahead of time so a create does not wait for a boot.
//! * [`guard`] — the process QEMU runs under so it dies with the daemon (`__vm-guard`).
//! * [`uids`] — the uids QEMU drops to, allocated host-wide so two daemons never share one.
//!
//! Host layout under `<state>/microvm/`: `vms/<sandbox>/` (the VM's directory and QEMU's chroot:
//! sockets, console log, `top-<gen>.qcow2`), `snapshots/<snapshot>.qcow2` (with a memory snapshot
//! also `<snapshot>.mem`, QEMU's device state, `<snapshot>.ram`, the guest RAM, and
//! `<snapshot>.vm.json`, the machine), `bases/`, `pool/`. The running VMs' RAM files are on a
//! tmpfs ([`ram::dir`]).
//!
//! KVM: `/dev/kvm` may exist where nested guests hang, so with `accel = "auto"` the first boot
//! tries KVM under a short deadline and falls back to TCG, logging which it uses; the verdict is
//! cached for this host boot in `/run/sandboxd/kvm-probe`.

mod agent;
mod basedisk;
mod disk;
mod exec;
mod files;
pub mod guard;
mod pool;
mod qmp;
mod ram;
mod uids;
mod vm;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use guest_agent::protocol::{GuestLimits, Request};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::cgroup::{CgroupLimits, CgroupRoot};
use super::{
    ArchiveStats, Backend, BackendError, ByteChunks, Download, ExecOutcome, ExecSpec, FileChunk, Isolation, OutputSink, SandboxSpec, StartSignal, UploadPiece,
};
use crate::config::{Limits, MicroVmAccel, MicroVmConfig};
use crate::egress::{Egress, NetworkMode, TapLink};
use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::images::{Catalog, ImageError, Origin};
pub use vm::Accel;
use vm::{BootFiles, Incoming, LaunchSpec, Vm};

const MIB: u64 = 1 << 20;
/// Guest RAM beyond the sandbox's memory limit: the guest kernel and the agent.
const GUEST_OVERHEAD_BYTES: u64 = 96 << 20;
/// Host memory QEMU may use beyond the guest's RAM (its own code, TCG translation cache).
const QEMU_OVERHEAD_BYTES: u64 = 512 << 20;
/// Tasks QEMU may have (vCPU, I/O worker and RCU threads).
const QEMU_MAX_TASKS: u32 = 512;
/// First uid QEMU processes drop to; each VM gets its own, unique on the host.
const UID_BASE: u32 = 400_000;
/// How many uids from [`UID_BASE`] VMs may use (every daemon on the host together).
const UID_COUNT: u32 = 1 << 16;
/// Where the KVM verdict is cached for this host boot.
const KVM_PROBE_CACHE: &str = "/run/sandboxd/kvm-probe";

/// A VM's boot files and base disk, from the catalog (`<image>/vm/vm.json`).
#[derive(Debug, Clone)]
struct VmImage {
    name: String,
    boot: BootFiles,
    disk: PathBuf,
}

/// Which VMs one boot snapshot can stand in for: the image's base disk (named after the file's
/// identity, so a rebuilt image never restores an old one), its boot files, the accelerator,
/// RAM, vCPUs and whether there is a network device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BootShape {
    image: String,
    base: PathBuf,
    boot: String,
    accel: Accel,
    memory_mib: u64,
    vcpus: u32,
    nic: bool,
}

/// A shape's boot snapshot: being taken (by the first create that booted), or ready.
enum BootSnapshot {
    Taking,
    Ready { snap: SnapshotId, used: std::time::Instant },
}

/// One microVM sandbox.
struct MicroSandbox {
    spec: SandboxSpec,
    vm: RwLock<Arc<Vm>>,
    /// Its TAP device for a filtered network, held for the sandbox's life: every QEMU of it
    /// (a rollback starts another) is given the same device, so the guest keeps its address.
    net: Option<Arc<TapLink>>,
    /// Serializes snapshot, rollback and destroy of this sandbox.
    op: tokio::sync::Mutex<()>,
}

impl MicroSandbox {
    fn vm(&self) -> Result<Arc<Vm>, BackendError> {
        self.vm.read().map(|v| v.clone()).map_err(|_| BackendError::Internal("sandbox VM slot poisoned".into()))
    }
}

pub(crate) struct Inner {
    cfg: MicroVmConfig,
    catalog: Arc<Catalog>,
    default_limits: Limits,
    vms_dir: PathBuf,
    snapshots_dir: PathBuf,
    bases_dir: PathBuf,
    pool_dir: PathBuf,
    probe_dir: PathBuf,
    /// The running VMs' RAM files ([`ram`]).
    ram_dir: PathBuf,
    /// Backing files of creates still booting (not yet a registered sandbox's disk root), with
    /// how many hold each: the garbage collection keeps them.
    pinned: Arc<Mutex<HashMap<PathBuf, usize>>>,
    /// qemu-system and qemu-img, resolved once.
    tools: Result<(PathBuf, PathBuf), String>,
    cgroups: Result<CgroupRoot, String>,
    accel: tokio::sync::OnceCell<Accel>,
    uids: uids::UidAllocator,
    sandboxes: RwLock<HashMap<SandboxId, Arc<MicroSandbox>>>,
    snapshots: Mutex<HashSet<SnapshotId>>,
    /// "Boot once per image": for each image and machine shape, the memory snapshot of a VM of
    /// it taken right after its boot, which later creates restore instead of booting. At most
    /// `cfg.boot_snapshots` are ready at once (the least recently used goes); a ready one is
    /// in `snapshots` too, so its files stay.
    boot_snapshots: Mutex<HashMap<BootShape, BootSnapshot>>,
    /// Held while disk files are created, renamed or collected.
    disk_lock: tokio::sync::Mutex<()>,
    pool: pool::Pool,
    vm_seq: std::sync::atomic::AtomicU64,
    host_cpus: u32,
    /// The daemon's egress filter, for sandboxes whose network is not NONE.
    egress: Option<Arc<Egress>>,
}

/// The microVM-tier backend.
pub struct MicroVmBackend {
    inner: Arc<Inner>,
}

/// Finds `name` as given (a path) or on PATH.
fn resolve_tool(name: &Path) -> Result<PathBuf, String> {
    if name.components().count() > 1 {
        return if name.is_file() { Ok(name.to_path_buf()) } else { Err(format!("{} not found", name.display())) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{} not found on PATH (install qemu-system-x86 and qemu-utils: make deps)", name.display()))
}

impl MicroVmBackend {
    /// Prepares the tier; never fails: a host without QEMU gets a backend that says why.
    pub fn new(cfg: MicroVmConfig, state_dir: &Path, catalog: Arc<Catalog>, default_limits: Limits, egress: Option<Arc<Egress>>) -> Self {
        let root = state_dir.join("microvm");
        let tools = resolve_tool(&cfg.qemu).and_then(|q| resolve_tool(&cfg.qemu_img).map(|i| (q, i)));
        let mut dirs_err = None;
        for d in ["vms", "snapshots", "bases", "pool", "probe"] {
            if let Err(e) = std::fs::create_dir_all(root.join(d)) {
                dirs_err.get_or_insert(format!("creating {}: {e}", root.join(d).display()));
            }
        }
        let tools = match dirs_err {
            Some(e) => Err(e),
            None => tools,
        };
        let daemon_name = super::cgroup::daemon_cgroup_name(state_dir);
        let cgroups = CgroupRoot::detect(&format!("{daemon_name}-vm")).map_err(|e| format!("cgroups: {e}"));
        let ram_dir = ram::dir(&daemon_name, root.join("ram"));
        let tools = match tools {
            Ok(t) => ram::reset_dir(&ram_dir).map(|()| t).map_err(|e| format!("creating {}: {e}", ram_dir.display())),
            Err(e) => Err(e),
        };
        if let Some(reason) = tools.as_ref().err().or(cgroups.as_ref().err()) {
            tracing::warn!(%reason, "microVM tier unavailable");
        }
        let host_cpus = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        let inner = Inner {
            pool: pool::Pool::new(cfg.pool_size),
            cfg,
            catalog,
            default_limits,
            vms_dir: root.join("vms"),
            snapshots_dir: root.join("snapshots"),
            bases_dir: root.join("bases"),
            pool_dir: root.join("pool"),
            probe_dir: root.join("probe"),
            ram_dir,
            pinned: Arc::new(Mutex::new(HashMap::new())),
            tools,
            cgroups,
            accel: tokio::sync::OnceCell::new(),
            uids: uids::UidAllocator::new(uids::UID_LOCK_DIR, UID_BASE, UID_COUNT),
            sandboxes: RwLock::new(HashMap::new()),
            snapshots: Mutex::new(HashSet::new()),
            boot_snapshots: Mutex::new(HashMap::new()),
            disk_lock: tokio::sync::Mutex::new(()),
            vm_seq: std::sync::atomic::AtomicU64::new(1),
            host_cpus,
            egress,
        };
        MicroVmBackend { inner: Arc::new(inner) }
    }
}

impl Inner {
    fn unavailable(&self, reason: String) -> BackendError {
        BackendError::Unavailable { isolation: Isolation::MicroVm, reason }
    }

    fn tools(&self) -> Result<&(PathBuf, PathBuf), BackendError> {
        self.tools.as_ref().map_err(|e| self.unavailable(e.clone()))
    }

    fn cgroups(&self) -> Result<&CgroupRoot, BackendError> {
        self.cgroups.as_ref().map_err(|e| self.unavailable(e.clone()))
    }

    /// The VM artifacts of `image`.
    fn image(&self, image: &str) -> Result<VmImage, BackendError> {
        vm_image(&self.catalog, image)
    }

    /// A uid for one QEMU, free on the whole host (see [`uids`]).
    fn alloc_uid(&self) -> Result<u32, BackendError> {
        self.uids.alloc().map_err(|e| BackendError::Internal(format!("allocating a uid for QEMU: {e}")))
    }

    fn release_uid(&self, uid: u32) {
        self.uids.release(uid);
    }

    fn sandbox(&self, id: &SandboxId) -> Result<Arc<MicroSandbox>, BackendError> {
        let map = self.sandboxes.read().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?;
        map.get(id).cloned().ok_or_else(|| BackendError::NoSuchSandbox(id.clone()))
    }

    fn snapshot_path(&self, snap: &SnapshotId) -> PathBuf {
        self.snapshots_dir.join(format!("{snap}.qcow2"))
    }

    /// The disk file of a snapshot that is on record here and present.
    fn live_snapshot(&self, snap: &SnapshotId) -> Result<PathBuf, BackendError> {
        let path = self.snapshot_path(snap);
        if path.is_file() && self.snapshots.lock().is_ok_and(|s| s.contains(snap)) {
            Ok(path)
        } else {
            Err(BackendError::NoSuchSnapshot(snap.clone()))
        }
    }

    /// The memory snapshot of `snap` (QEMU's migration stream) and the machine it needs.
    fn memory_path(&self, snap: &SnapshotId) -> PathBuf {
        self.snapshots_dir.join(format!("{snap}.mem"))
    }

    fn shape_path(&self, snap: &SnapshotId) -> PathBuf {
        self.snapshots_dir.join(format!("{snap}.vm.json"))
    }

    /// The guest RAM of `snap`'s memory snapshot.
    fn ram_path(&self, snap: &SnapshotId) -> PathBuf {
        self.snapshots_dir.join(format!("{snap}.ram"))
    }

    /// The memory snapshot of `snap`, opened (under `disk_lock`: a delete may not take it from
    /// under a restore), if it has one.
    fn open_memory(&self, snap: &SnapshotId) -> Result<Option<SavedMemory>, BackendError> {
        let file = match std::fs::File::open(self.memory_path(snap)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(BackendError::io("opening the memory snapshot", e)),
        };
        let unusable = |reason: String| BackendError::SnapshotUnusable { snapshot: snap.clone(), reason };
        let json = std::fs::read(self.shape_path(snap)).map_err(|e| unusable(format!("its machine description: {e}")))?;
        let shape: MemoryShape = serde_json::from_slice(&json).map_err(|e| unusable(format!("its machine description: {e}")))?;
        // Written by a daemon that kept guest RAM in the stream: no RAM file (`resumable` boots).
        if !shape.ram_file {
            return Ok(Some(SavedMemory { state: file, ram: None, shape }));
        }
        let ram = std::fs::File::open(self.ram_path(snap)).map_err(|e| unusable(format!("its guest RAM file {}: {e}", self.ram_path(snap).display())))?;
        let len = ram.metadata().map_err(|e| unusable(format!("its guest RAM file: {e}")))?.len();
        if len != shape.memory_mib * MIB {
            return Err(unusable(format!("its guest RAM file holds {len} bytes, not the {} MiB it was saved with", shape.memory_mib)));
        }
        Ok(Some(SavedMemory { state: file, ram: Some(ram), shape }))
    }

    /// The memory snapshot to resume for a VM of `limits`, when there is one and such a VM can
    /// be it: as many vCPUs, at least the RAM the limits need (a VM from the warm pool may have
    /// more), the same accelerator and boot files, a network device if and only if the snapshot's
    /// VM had one (a fork that changes NONE to a network, or back, boots). Otherwise the VM boots over the snapshot's
    /// disk (saved frozen: consistent on its own), which is logged.
    async fn resumable(&self, snap: &SnapshotId, memory: Option<SavedMemory>, image: &VmImage, limits: &Limits, nic: bool) -> Option<Incoming> {
        let SavedMemory { state: file, ram, shape } = memory?;
        let Some(ram) = ram else {
            tracing::info!(snapshot = %snap, "the memory snapshot keeps guest RAM in its migration stream (an older daemon wrote it): booting over its disk instead");
            return None;
        };
        let here = MemoryShape {
            memory_mib: Self::memory_mib(limits),
            vcpus: self.vcpus(limits),
            accel: self.accel(image).await,
            boot: boot_key(&image.boot),
            nic,
            ram_file: true,
            agent: None,
        };
        let fits = shape.memory_mib >= here.memory_mib && (shape.vcpus, shape.accel, &shape.boot, shape.nic) == (here.vcpus, here.accel, &here.boot, here.nic);
        if !fits {
            tracing::info!(snapshot = %snap, saved = ?shape, wanted = ?here, "the memory snapshot is of another machine: booting over its disk instead");
            return None;
        }
        let agent = shape.agent.map(|a| agent::HelloInfo { kernel: a.kernel, uptime_ms: 0, version: a.version });
        Some(Incoming { snapshot: snap.clone(), file: Arc::new(file), ram: Arc::new(ram), memory_mib: shape.memory_mib, vcpus: shape.vcpus, agent })
    }

    fn memory_mib(limits: &Limits) -> u64 {
        (limits.memory_bytes + GUEST_OVERHEAD_BYTES).div_ceil(MIB)
    }

    fn vcpus(&self, limits: &Limits) -> u32 {
        limits.cpu_millicores.div_ceil(1000).clamp(1, self.host_cpus)
    }

    /// KVM or TCG, decided once (see the module docs).
    async fn accel(&self, image: &VmImage) -> Accel {
        *self.accel.get_or_init(|| self.decide_accel(image)).await
    }

    async fn decide_accel(&self, image: &VmImage) -> Accel {
        match self.cfg.accel {
            MicroVmAccel::Tcg => {
                tracing::info!("microVMs run under TCG (software emulation): configured");
                return Accel::Tcg;
            }
            MicroVmAccel::Kvm => {
                tracing::info!("microVMs run under KVM: configured");
                return Accel::Kvm;
            }
            MicroVmAccel::Auto => {}
        }
        if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
            tracing::warn!(error = %e, "no usable /dev/kvm: microVMs run under TCG (software emulation)");
            return Accel::Tcg;
        }
        let key = probe_key(&self.tools.as_ref().map(|t| t.0.clone()).unwrap_or_default());
        if let Some(cached) = read_probe_cache(&key) {
            tracing::info!(accel = cached.name(), cache = KVM_PROBE_CACHE, "microVM acceleration from this boot's KVM probe");
            return cached;
        }
        let verdict = match self.probe_kvm(image).await {
            Ok(boot) => {
                tracing::info!(boot_ms = boot.as_millis() as u64, "KVM probe booted a guest: microVMs run under KVM");
                Accel::Kvm
            }
            Err(e) => {
                tracing::warn!(error = %e, timeout_ms = self.cfg.kvm_probe_timeout_ms, "KVM probe failed (nested guests may hang here): falling back to TCG (software emulation)");
                Accel::Tcg
            }
        };
        write_probe_cache(&key, verdict);
        verdict
    }

    /// Boots a throwaway VM under KVM with a short deadline.
    async fn probe_kvm(&self, image: &VmImage) -> Result<Duration, BackendError> {
        let dir = self.probe_dir.join(format!("probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BackendError::io("creating the probe dir", e))?;
        let result = async {
            let top = dir.join("top-0.qcow2");
            let (base, _pinned) = {
                let _g = self.disk_lock.lock().await;
                let base = disk::base_for(&image.name, &image.disk, &self.bases_dir)?;
                let pinned = self.pin(&base);
                (base, pinned)
            };
            disk::create_overlay(&self.tools()?.1, &base, &top, disk::read_header(&base)?.virtual_size).await?;
            let uid = self.alloc_uid()?;
            let spec = LaunchSpec {
                qemu: self.tools()?.0.clone(),
                dir: dir.clone(),
                top,
                gen: 0,
                boot: image.boot.clone(),
                memory_mib: 256,
                vcpus: 1,
                accel: Accel::Kvm,
                uid,
                boot_timeout: self.cfg.kvm_probe_timeout(),
                ram: None,
                incoming: None,
                tap: None,
            };
            let r = Vm::launch(&spec, None).await;
            self.release_uid(uid);
            let vm = r?;
            let t = vm.boot_time;
            vm.kill().await;
            Ok(t)
        }
        .await;
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    /// Creates a VM directory with a fresh top over `backing` and boots it.
    #[allow(clippy::too_many_arguments)] // one boot's inputs, each distinct; a struct would only rename them
    async fn boot_new(
        &self,
        name: &str,
        dir: &Path,
        gen: u64,
        backing: &Path,
        disk_bytes: u64,
        image: &VmImage,
        limits: &Limits,
        incoming: Option<Incoming>,
        tap: Option<Arc<TapLink>>,
    ) -> Result<Arc<Vm>, BackendError> {
        let (qemu, qemu_img) = self.tools()?.clone();
        std::fs::create_dir_all(dir).map_err(|e| BackendError::io(format!("creating {}", dir.display()), e))?;
        let top = dir.join(format!("top-{gen}.qcow2"));
        let size = disk_bytes.max(disk::read_header(backing)?.virtual_size);
        let (memory_mib, _) = self.machine(limits, incoming.as_ref());
        let ram = self.prepare_ram(name, memory_mib)?;
        let started = std::time::Instant::now();
        if let Err(e) = disk::create_overlay(&qemu_img, backing, &top, size).await {
            let _ = std::fs::remove_file(&ram.path);
            return Err(e);
        }
        tracing::debug!(vm = name, ms = started.elapsed().as_millis() as u64, "top disk created");
        self.boot_existing(name, dir, gen, &qemu, image, limits, incoming, tap, Some(ram)).await
    }

    /// Guest RAM and vCPUs of a VM: a resumed VM is the machine it was saved from (a pooled
    /// VM's RAM may exceed its limits).
    fn machine(&self, limits: &Limits, incoming: Option<&Incoming>) -> (u64, u32) {
        match incoming {
            Some(i) => (i.memory_mib, i.vcpus),
            None => (Self::memory_mib(limits), self.vcpus(limits)),
        }
    }

    /// Creates VM `name`'s RAM file, all holes (a resume's RAM is copied into it by the VM's
    /// guard: [`Vm::launch`]).
    fn prepare_ram(&self, name: &str, memory_mib: u64) -> Result<PreparedRam, BackendError> {
        let path = self.ram_dir.join(format!("{name}.ram"));
        let _ = std::fs::remove_file(&path);
        ram::create(&path, memory_mib * MIB).map_err(|e| BackendError::io(format!("creating the guest RAM file {}", path.display()), e))?;
        Ok(PreparedRam { path })
    }

    /// Boots a VM over the top disk `dir/top-<gen>.qcow2` that already exists (or resumes it
    /// from a memory snapshot taken over that disk's backing file).
    #[allow(clippy::too_many_arguments)] // as boot_new
    async fn boot_existing(
        &self,
        name: &str,
        dir: &Path,
        gen: u64,
        qemu: &Path,
        image: &VmImage,
        limits: &Limits,
        incoming: Option<Incoming>,
        tap: Option<Arc<TapLink>>,
        ram: Option<PreparedRam>,
    ) -> Result<Arc<Vm>, BackendError> {
        let (memory_mib, vcpus) = self.machine(limits, incoming.as_ref());
        let ram = match ram {
            Some(r) => r,
            None => self.prepare_ram(name, memory_mib)?,
        };
        let accel = self.accel(image).await;
        let uid = match self.alloc_uid() {
            Ok(u) => u,
            Err(e) => {
                let _ = std::fs::remove_file(&ram.path);
                return Err(e);
            }
        };
        let top = dir.join(format!("top-{gen}.qcow2"));
        let prepared = (|| {
            std::os::unix::fs::chown(&top, Some(uid), Some(uid)).map_err(|e| BackendError::io(format!("chown {}", top.display()), e))?;
            let memory_bytes = memory_mib * MIB + QEMU_OVERHEAD_BYTES;
            self.cgroups()?
                .create_sandbox(name, &CgroupLimits { memory_bytes, max_pids: QEMU_MAX_TASKS, cpu_millicores: 0 })
                .map_err(|e| BackendError::Internal(format!("creating the VM's cgroup: {e}")))
        })();
        let cgroup = match prepared {
            Ok(cg) => cg,
            Err(e) => {
                let _ = std::fs::remove_file(&ram.path);
                self.release_uid(uid);
                return Err(e);
            }
        };
        let spec = LaunchSpec {
            qemu: qemu.to_path_buf(),
            dir: dir.to_path_buf(),
            top,
            gen,
            boot: image.boot.clone(),
            memory_mib,
            vcpus,
            accel,
            uid,
            boot_timeout: self.cfg.boot_timeout(),
            ram: Some(ram.path),
            incoming,
            tap,
        };
        match Vm::launch(&spec, Some(cgroup)).await {
            Ok(vm) => {
                tracing::debug!(vm = name, accel = vm.accel.name(), boot_ms = vm.boot_time.as_millis() as u64, guest_kernel = %vm.hello.kernel, guest_uptime_ms = vm.hello.uptime_ms, "microVM booted");
                Ok(Arc::new(vm))
            }
            Err(e) => {
                if let Some(cg) = self.cgroups.as_ref().ok().and_then(|r| r.open_sandbox(name)) {
                    let _ = cg.kill_all();
                    let _ = cg.destroy();
                }
                self.release_uid(uid);
                Err(e)
            }
        }
    }

    fn vm_name(&self) -> String {
        format!("vm-{}", self.vm_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// Kills a VM and gives its uid back.
    async fn stop_vm(&self, vm: &Vm) {
        vm.kill().await;
        self.release_uid(vm.uid);
    }

    /// Every disk file some live thing needs: tops of sandboxes and pooled VMs, live snapshots.
    fn disk_roots(&self) -> Vec<PathBuf> {
        let mut roots = Vec::new();
        if let Ok(map) = self.sandboxes.read() {
            for sb in map.values() {
                if let Ok(vm) = sb.vm() {
                    roots.push(top_of(&vm));
                }
            }
        }
        roots.extend(self.pool.tops());
        if let Ok(snaps) = self.snapshots.lock() {
            roots.extend(snaps.iter().map(|s| self.snapshot_path(s)));
        }
        if let Ok(pinned) = self.pinned.lock() {
            roots.extend(pinned.keys().cloned());
        }
        roots
    }

    /// Keeps `backing` from the garbage collection until the guard is dropped (take it under
    /// `disk_lock`, where the file was made or found).
    fn pin(&self, backing: &Path) -> Pinned {
        if let Ok(mut p) = self.pinned.lock() {
            *p.entry(backing.to_path_buf()).or_insert(0) += 1;
        }
        Pinned { set: self.pinned.clone(), path: backing.to_path_buf() }
    }

    /// Removes snapshot files nothing needs any more.
    async fn collect_snapshots(&self) {
        let _g = self.disk_lock.lock().await;
        let removed = disk::collect_garbage(&self.disk_roots(), &[&self.snapshots_dir]);
        for p in removed {
            tracing::debug!(file = %p.display(), "unreferenced snapshot disk removed");
        }
        self.collect_memory();
    }

    /// Removes the memory files (and machine descriptions) of snapshots no longer on record.
    /// Call under `disk_lock` (a snapshot being taken is not on record yet: its `.mem.part` and
    /// `.ram.part` are never touched here).
    fn collect_memory(&self) {
        let live = self.snapshots.lock().map(|s| s.iter().map(|s| s.to_string()).collect::<HashSet<String>>()).unwrap_or_default();
        let Ok(entries) = std::fs::read_dir(&self.snapshots_dir) else { return };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(snap) = name.strip_suffix(".mem").or_else(|| name.strip_suffix(".ram")).or_else(|| name.strip_suffix(".vm.json")) else { continue };
            if !live.contains(snap) {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => tracing::debug!(file = %e.path().display(), "memory snapshot file removed"),
                    Err(err) => tracing::warn!(file = %e.path().display(), error = %err, "removing a memory snapshot file"),
                }
            }
        }
    }

    async fn create(self: &Arc<Self>, spec: &SandboxSpec) -> Result<(), BackendError> {
        self.tools()?;
        let image = self.image(&spec.image)?;
        let net = self.link_for(spec).await?;
        let created = self.create_with(spec, &image, net.clone()).await;
        if created.is_err() && net.is_some() {
            self.unlink(&spec.id).await;
        }
        created
    }

    /// A TAP link for `spec`'s network, None for NONE (see [`Egress::attach_tap`]).
    async fn link_for(&self, spec: &SandboxSpec) -> Result<Option<Arc<TapLink>>, BackendError> {
        let policy = &spec.network;
        if policy.mode == NetworkMode::None {
            return Ok(None);
        }
        let unavailable = |reason: String| BackendError::Unavailable { isolation: Isolation::MicroVm, reason };
        let egress = self.egress.as_deref().ok_or_else(|| unavailable(format!("network mode {}: the daemon has no egress filter", policy.mode.name())))?;
        let link = egress.attach_tap(spec.id.as_str(), &spec.tenant, policy).await.map_err(unavailable)?;
        Ok(Some(Arc::new(link)))
    }

    /// Takes sandbox `id`'s link away (a no-op without one).
    async fn unlink(&self, id: &SandboxId) {
        if let Some(e) = &self.egress {
            e.detach(id.as_str()).await;
        }
    }

    async fn create_with(self: &Arc<Self>, spec: &SandboxSpec, image: &VmImage, net: Option<Arc<TapLink>>) -> Result<(), BackendError> {
        let image = image.clone();
        let dir = self.vms_dir.join(spec.id.as_str());
        // The backing file stays pinned until the sandbox is registered (its top a disk root).
        // `configured`: a VM resumed from memory had its identity set as it was resumed.
        let (vm, _pinned, configured) = match &spec.from_snapshot {
            // Pooled VMs have no network device (and microvm has no hotplug): a sandbox with a
            // network boots its own.
            None => match if net.is_none() { self.pool.take(&spec.image, &spec.limits, |l| self.vcpus(l)) } else { None } {
                Some(pooled) => {
                    let vm = pooled.adopt(&dir)?;
                    tracing::info!(sandbox = %spec.id, "microVM taken from the warm pool");
                    pool::refill(self);
                    (vm, None, false)
                }
                None => {
                    let (vm, pinned, started) = self.boot_or_restore(spec, &image, &dir, net.clone()).await?;
                    (vm, Some(pinned), started.configured)
                }
            },
            Some(snap) => {
                let (vm, pinned, resumed) = self.start_from_snapshot(snap, spec, &image, &dir, net.clone()).await?;
                (vm, Some(pinned), resumed)
            }
        };
        // A booted or pooled VM gets its identity here (hostname, /etc/hosts, its own address
        // on its own link); a resumed one got it as it was resumed.
        let started = std::time::Instant::now();
        let configured = if configured { Ok(()) } else { vm.configure(guest_config(spec, net.as_deref())).await };
        tracing::debug!(sandbox = %spec.id, ms = started.elapsed().as_millis() as u64, "guest configured");
        if let Err(e) = configured {
            self.stop_vm(&vm).await;
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let sb = Arc::new(MicroSandbox { spec: spec.clone(), vm: RwLock::new(vm), net, op: tokio::sync::Mutex::new(()) });
        self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?.insert(spec.id.clone(), sb);
        Ok(())
    }

    /// A VM over snapshot `snap`'s disk in `dir`, running on from its memory when it has a
    /// memory snapshot this VM can resume (then the guest's clock and entropy are renewed and it
    /// is given `spec`'s identity), else booted over the disk (the caller configures it). Says
    /// which.
    async fn start_from_snapshot(
        &self,
        snap: &SnapshotId,
        spec: &SandboxSpec,
        image: &VmImage,
        dir: &Path,
        net: Option<Arc<TapLink>>,
    ) -> Result<(Arc<Vm>, Pinned, bool), BackendError> {
        let (backing, pinned, memory) = {
            let _g = self.disk_lock.lock().await;
            let backing = self.live_snapshot(snap)?;
            let pinned = self.pin(&backing);
            (backing, pinned, self.open_memory(snap)?)
        };
        let incoming = self.resumable(snap, memory, image, &spec.limits, net.is_some()).await;
        let resumed = incoming.is_some();
        let config = guest_config(spec, net.as_deref());
        let vm = match self.boot_new(&self.vm_name(), dir, 0, &backing, spec.limits.disk_bytes, image, &spec.limits, incoming, net).await {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(dir);
                return Err(e);
            }
        };
        // It runs on from the snapshot's memory, saved with its filesystem frozen.
        if resumed {
            if let Err(e) = after_resume(&vm, config).await {
                self.stop_vm(&vm).await;
                let _ = std::fs::remove_dir_all(dir);
                return Err(e);
            }
        }
        Ok((vm, pinned, resumed))
    }

    async fn boot_shape(&self, image: &VmImage, base: &Path, limits: &Limits, nic: bool) -> BootShape {
        BootShape {
            image: image.name.clone(),
            base: base.to_path_buf(),
            boot: boot_key(&image.boot),
            accel: self.accel(image).await,
            memory_mib: Self::memory_mib(limits),
            vcpus: self.vcpus(limits),
            nic,
        }
    }

    /// A VM for a create with neither a snapshot to start from nor a pooled VM: restored from
    /// the image's boot snapshot for this machine shape when there is one (no boot: the guest
    /// runs on from just after an earlier boot, with a clock, entropy and identity of its own),
    /// else booted, and then — the first time for this shape — snapshotted for the next
    /// create. A boot snapshot that fails to restore is dropped and the VM boots. Says whether
    /// whether the VM is already configured for `spec` (restored, or booted and then
    /// snapshotted) and whether it was restored.
    async fn boot_or_restore(
        self: &Arc<Self>,
        spec: &SandboxSpec,
        image: &VmImage,
        dir: &Path,
        net: Option<Arc<TapLink>>,
    ) -> Result<(Arc<Vm>, Pinned, Started), BackendError> {
        let (base, pinned) = {
            let _g = self.disk_lock.lock().await;
            let base = disk::base_for(&spec.image, &image.disk, &self.bases_dir)?;
            let pinned = self.pin(&base);
            (base, pinned)
        };
        let shape = match self.cfg.boot_snapshots {
            0 => None,
            _ => Some(self.boot_shape(image, &base, &spec.limits, net.is_some()).await),
        };
        let ready = shape.as_ref().and_then(|shape| {
            let mut m = self.boot_snapshots.lock().ok()?;
            match m.get_mut(shape)? {
                BootSnapshot::Ready { snap, used } => {
                    *used = std::time::Instant::now();
                    Some(snap.clone())
                }
                BootSnapshot::Taking => None,
            }
        });
        if let (Some(shape), Some(snap)) = (&shape, ready) {
            let started = std::time::Instant::now();
            match self.start_from_snapshot(&snap, spec, image, dir, net.clone()).await {
                Ok((vm, pinned, true)) => {
                    tracing::info!(sandbox = %spec.id, image = %spec.image, ms = started.elapsed().as_millis() as u64, "microVM restored from its image's boot snapshot (no boot)");
                    return Ok((vm, pinned, Started { configured: true, restored: true }));
                }
                Ok((vm, _, false)) => {
                    // Booted over the snapshot's disk: a VM all the same, but the snapshot no
                    // longer fits this shape.
                    tracing::warn!(sandbox = %spec.id, image = %spec.image, "the image's boot snapshot could not be resumed; it is dropped");
                    self.drop_boot_snapshots(|s| s == shape).await;
                    return Ok((vm, pinned, Started::default()));
                }
                Err(e) => {
                    tracing::warn!(sandbox = %spec.id, image = %spec.image, error = %e, "restoring the image's boot snapshot failed: booting, and dropping the snapshot");
                    self.drop_boot_snapshots(|s| s == shape).await;
                }
            }
        }
        let config = guest_config(spec, net.as_deref());
        let vm = self.boot_new(&self.vm_name(), dir, 0, &base, spec.limits.disk_bytes, image, &spec.limits, None, net).await?;
        let Some(shape) = shape else { return Ok((vm, pinned, Started::default())) };
        // Configured before it is saved: the guest agent remembers what it applied, so a
        // restore with the same limits writes only the new identity (see `after_resume`).
        if let Err(e) = vm.configure(config).await {
            self.stop_vm(&vm).await;
            let _ = std::fs::remove_dir_all(dir);
            return Err(e);
        }
        self.take_boot_snapshot(&vm, spec, shape).await;
        Ok((vm, pinned, Started { configured: true, restored: false }))
    }

    /// Snapshots `vm`, just booted, as its shape's boot snapshot, unless the shape has one (or
    /// another create is taking it), or the guest agent cannot renew a restored guest's clock
    /// and entropy: restores of one snapshot must never share a random stream. Then evicts the
    /// least recently used ready snapshots past `cfg.boot_snapshots`. A failure is logged; the
    /// VM is the sandbox's all the same, and a later create boots and tries again.
    async fn take_boot_snapshot(&self, vm: &Vm, spec: &SandboxSpec, shape: BootShape) {
        if vm.hello.version < RESUMED_PROTOCOL {
            tracing::info!(image = %spec.image, agent_protocol = vm.hello.version, "no boot snapshot: the guest agent cannot reseed a restored guest's RNG (`make vm-images` rebuilds it)");
            return;
        }
        let claimed = self.boot_snapshots.lock().is_ok_and(|mut m| match m.entry(shape.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(BootSnapshot::Taking);
                true
            }
        });
        if !claimed {
            return;
        }
        let started = std::time::Instant::now();
        let snap = SnapshotId::generate();
        let taken = self.snapshot_vm(vm, spec, &snap, true).await;
        let evict = self.boot_snapshots.lock().map(|mut m| {
            match &taken {
                Ok(_) => m.insert(shape.clone(), BootSnapshot::Ready { snap: snap.clone(), used: std::time::Instant::now() }),
                Err(_) => m.remove(&shape),
            };
            let mut ready: Vec<(std::time::Instant, BootShape)> =
                m.iter().filter_map(|(k, v)| if let BootSnapshot::Ready { used, .. } = v { Some((*used, k.clone())) } else { None }).collect();
            ready.sort_by_key(|(used, _)| *used);
            let over = ready.len().saturating_sub(self.cfg.boot_snapshots);
            ready.into_iter().take(over).map(|(_, k)| k).collect::<Vec<_>>()
        });
        let evict = evict.unwrap_or_default();
        match taken {
            Ok(bytes) => {
                tracing::info!(image = %spec.image, snapshot = %snap, bytes, ms = started.elapsed().as_millis() as u64, "boot snapshot taken: later creates of this image and shape restore it instead of booting")
            }
            Err(e) => tracing::warn!(image = %spec.image, error = %e, "taking the image's boot snapshot failed"),
        }
        if !evict.is_empty() {
            tracing::info!(
                evicted = evict.len(),
                kept = self.cfg.boot_snapshots,
                "boot snapshots past [microvm] boot_snapshots evicted, least recently used first"
            );
            self.drop_boot_snapshots(|s| evict.contains(s)).await;
        }
    }

    /// Forgets the ready boot snapshots of the shapes `which` picks and removes their files
    /// (what a live sandbox's disk still builds on stays until it goes).
    async fn drop_boot_snapshots(&self, which: impl Fn(&BootShape) -> bool) {
        let dropped: Vec<SnapshotId> = self
            .boot_snapshots
            .lock()
            .map(|mut m| {
                let keys: Vec<BootShape> = m.iter().filter(|(k, v)| which(k) && matches!(v, BootSnapshot::Ready { .. })).map(|(k, _)| k.clone()).collect();
                keys.iter()
                    .filter_map(|k| match m.remove(k) {
                        Some(BootSnapshot::Ready { snap, .. }) => Some(snap),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        if dropped.is_empty() {
            return;
        }
        if let Ok(mut s) = self.snapshots.lock() {
            for snap in &dropped {
                s.remove(snap);
            }
        }
        self.collect_snapshots().await;
    }

    async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId, memory: bool) -> Result<u64, BackendError> {
        let sb = self.sandbox(id)?;
        let _op = sb.op.lock().await;
        let vm = sb.vm()?;
        self.snapshot_vm(&vm, &sb.spec, snap, memory).await
    }

    /// Snapshot `snap` of a running VM (its disk, and its memory if asked), put on record.
    /// Returns the bytes it holds above the base disk.
    async fn snapshot_vm(&self, vm: &Vm, spec: &SandboxSpec, snap: &SnapshotId, memory: bool) -> Result<u64, BackendError> {
        // A consistent disk: the guest flushes and freezes its filesystem first (a memory
        // snapshot is saved frozen too, so its disk alone is as consistent as a disk-only one).
        let frozen = vm.agent.call(&Request::Freeze, &[], Duration::from_secs(30)).await.map_err(|e| vm.agent_error(e))?;
        vm::expect_ok(frozen.msg, "freeze")?;
        let taken = if memory { self.save_with_memory(vm, snap, spec).await.map(Some) } else { self.swap_top(vm, snap).await.map(|()| None) };
        if let Err(e) = thaw(vm).await {
            tracing::warn!(sandbox = %spec.id, error = %e, "thawing the guest filesystem");
        }
        let saved = taken?;
        let _g = self.disk_lock.lock().await;
        let mut memory_bytes = 0;
        if let Some((part, ram_part, shape)) = saved {
            let put = (|| {
                let json = serde_json::to_vec(&shape).map_err(|e| BackendError::Internal(format!("encoding the memory snapshot's machine: {e}")))?;
                std::fs::write(self.shape_path(snap), json).map_err(|e| BackendError::io("writing the memory snapshot's machine", e))?;
                std::fs::rename(&ram_part, self.ram_path(snap)).map_err(|e| BackendError::io("putting the memory snapshot's RAM in place", e))?;
                std::fs::rename(&part, self.memory_path(snap)).map_err(|e| BackendError::io("putting the memory snapshot in place", e))
            })();
            if let Err(e) = put {
                for f in [part, ram_part, self.shape_path(snap), self.ram_path(snap)] {
                    let _ = std::fs::remove_file(f);
                }
                return Err(e);
            }
            memory_bytes = allocated_bytes(&self.memory_path(snap)) + allocated_bytes(&self.ram_path(snap));
        }
        if let Ok(mut s) = self.snapshots.lock() {
            s.insert(snap.clone());
        }
        Ok(disk::chain_bytes_above_base(&self.snapshot_path(snap), &self.bases_dir) + memory_bytes)
    }

    /// A memory snapshot: the guest is paused, its disk snapshotted as without memory, its
    /// device state written by QEMU (a migration into the file that leaves the RAM file out),
    /// its RAM file copied, and the guest continued, so disk and memory are of one instant.
    /// Returns the device state and RAM files (still named `.part`) and the machine a restore
    /// needs.
    async fn save_with_memory(&self, vm: &Vm, snap: &SnapshotId, spec: &SandboxSpec) -> Result<(PathBuf, PathBuf, MemoryShape), BackendError> {
        use std::os::fd::AsFd;
        use std::os::unix::fs::OpenOptionsExt;
        let image = self.image(&spec.image)?;
        let Some(vm_ram) = vm.ram() else {
            return Err(BackendError::Internal("this microVM's RAM is not in a file (or QEMU is gone): it cannot be saved".into()));
        };
        let agent = Some(SavedAgent { version: vm.hello.version, kernel: vm.hello.kernel.clone() });
        let shape =
            MemoryShape { memory_mib: vm.memory_mib, vcpus: vm.vcpus, accel: vm.accel, boot: boot_key(&image.boot), nic: vm.nic, ram_file: true, agent };
        let part = self.snapshots_dir.join(format!("{snap}.mem.part"));
        let ram_part = self.snapshots_dir.join(format!("{snap}.ram.part"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&part)
            .map_err(|e| BackendError::io(format!("creating {}", part.display()), e))?;
        vm.qmp.lock().await.execute("stop", serde_json::Value::Null).await.map_err(BackendError::Internal)?;
        let saved = async {
            self.swap_top(vm, snap).await?;
            let mut qmp = vm.qmp.lock().await;
            migrate_to(&mut qmp, file.as_fd()).await.map_err(|e| BackendError::Internal(format!("saving the microVM's memory: {e}")))?;
            drop(qmp);
            // The RAM file is the live RAM: copied while the guest is still paused.
            let bytes = vm.memory_mib * MIB;
            let to = ram_part.clone();
            let copied = tokio::task::spawn_blocking(move || {
                let dst = ram::create(&to, bytes)?;
                ram::copy_sparse_nonzero(&vm_ram, &dst, bytes)
            })
            .await
            .map_err(|e| BackendError::Internal(format!("copying the microVM's RAM: {e}")))?;
            copied.map_err(|e| BackendError::io(format!("copying the microVM's RAM to {}", ram_part.display()), e))
        }
        .await;
        // The guest goes on whatever happened (after a migration QEMU takes its disks back).
        let resumed = vm.qmp.lock().await.execute("cont", serde_json::Value::Null).await;
        if let Err(e) = saved.map(drop).and(resumed.map(drop).map_err(|e| BackendError::Internal(format!("continuing the microVM after its snapshot: {e}")))) {
            let _ = std::fs::remove_file(&part);
            let _ = std::fs::remove_file(&ram_part);
            return Err(e);
        }
        Ok((part, ram_part, shape))
    }

    /// The live snapshot itself: the current top becomes the snapshot file and a new top is put
    /// over it in the running QEMU (`blockdev-add` + `blockdev-snapshot`).
    async fn swap_top(&self, vm: &Vm, snap: &SnapshotId) -> Result<(), BackendError> {
        let (_, qemu_img) = self.tools()?.clone();
        let _g = self.disk_lock.lock().await;
        let gen = *vm.gen.lock().map_err(|_| BackendError::Internal("gen poisoned".into()))?;
        let dir = vm.dir();
        let old_top = dir.join(format!("top-{gen}.qcow2"));
        let new_name = format!("top-{}.qcow2", gen + 1);
        let new_top = dir.join(&new_name);
        let snap_file = self.snapshot_path(snap);
        let size = disk::read_header(&old_top)?.virtual_size;
        disk::create_overlay(&qemu_img, &snap_file, &new_top, size).await?;
        std::os::unix::fs::chown(&new_top, Some(vm.uid), Some(vm.uid)).map_err(|e| BackendError::io("chown the new top", e))?;
        std::fs::rename(&old_top, &snap_file).map_err(|e| BackendError::io(format!("moving {} to {}", old_top.display(), snap_file.display()), e))?;
        let undo = |why: String| {
            let _ = std::fs::rename(&snap_file, &old_top);
            let _ = std::fs::remove_file(&new_top);
            BackendError::Internal(why)
        };
        let mut qmp = vm.qmp.lock().await;
        let node = format!("disk{}", gen + 1);
        // Inside QEMU's chroot the VM's directory is `/`.
        let add = json!({ "driver": "qcow2", "node-name": node, "cache": { "no-flush": true }, "file": { "driver": "file", "filename": format!("/{new_name}"), "locking": "off" }, "backing": null });
        if let Err(e) = qmp.execute("blockdev-add", add).await {
            return Err(undo(e));
        }
        if let Err(e) = qmp.execute("blockdev-snapshot", json!({ "node": format!("disk{gen}"), "overlay": node })).await {
            let _ = qmp.execute("blockdev-del", json!({ "node-name": node })).await;
            return Err(undo(e));
        }
        drop(qmp);
        if let Ok(mut g) = vm.gen.lock() {
            *g = gen + 1;
        }
        // The snapshot file is never written again; forks open it read-only as root.
        let _ = std::os::unix::fs::chown(&snap_file, Some(0), Some(0));
        let _ = std::fs::set_permissions(&snap_file, std::os::unix::fs::PermissionsExt::from_mode(0o444));
        Ok(())
    }

    async fn rollback(self: &Arc<Self>, id: &SandboxId, snap: &SnapshotId) -> Result<(), BackendError> {
        let sb = self.sandbox(id)?;
        let _op = sb.op.lock().await;
        let (backing, memory) = {
            let _g = self.disk_lock.lock().await;
            (self.live_snapshot(snap)?, self.open_memory(snap)?)
        };
        let image = self.image(&sb.spec.image)?;
        if let Some(incoming) = self.resumable(snap, memory, &image, &sb.spec.limits, sb.net.is_some()).await {
            self.rollback_resume(&sb, &backing, &image, incoming).await?;
            drop(_op);
            self.collect_snapshots().await;
            return Ok(());
        }
        let old = sb.vm()?;
        let dir = old.dir();
        let gen = *old.gen.lock().map_err(|_| BackendError::Internal("gen poisoned".into()))?;
        old.mark_lost(&format!("the sandbox was rolled back to {snap}"));
        self.stop_vm(&old).await;
        let _ = std::fs::remove_file(dir.join(format!("top-{gen}.qcow2")));
        let vm = self.boot_new(&self.vm_name(), &dir, gen + 1, &backing, sb.spec.limits.disk_bytes, &image, &sb.spec.limits, None, sb.net.clone()).await?;
        vm.configure(guest_config(&sb.spec, sb.net.as_deref())).await?;
        if let Ok(mut slot) = sb.vm.write() {
            *slot = vm;
        }
        drop(_op);
        self.collect_snapshots().await;
        Ok(())
    }

    /// Rollback to a memory snapshot: a new QEMU resumes it beside the running one, in a
    /// directory of its own, and takes the sandbox's place only once its guest answers; a
    /// memory file QEMU cannot load leaves the sandbox as it was. The old VM, no longer the
    /// sandbox's, is stopped and its directory removed after the answer, off the caller's path.
    async fn rollback_resume(self: &Arc<Self>, sb: &MicroSandbox, backing: &Path, image: &VmImage, incoming: Incoming) -> Result<(), BackendError> {
        let id = &sb.spec.id;
        let snap = incoming.snapshot.clone();
        let old = sb.vm()?;
        let dir = old.dir();
        let gen = *old.gen.lock().map_err(|_| BackendError::Internal("gen poisoned".into()))?;
        let staging = self.vms_dir.join(format!("{id}.resume"));
        let _ = std::fs::remove_dir_all(&staging);
        // The same TAP as the running VM's: for the moment both run, the link's frames go to
        // either; the old one stops once the new one answers.
        let vm = match self
            .boot_new(&self.vm_name(), &staging, gen + 1, backing, sb.spec.limits.disk_bytes, image, &sb.spec.limits, Some(incoming), sb.net.clone())
            .await
        {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(e);
            }
        };
        // Its identity set again as a boot would (hostname, /etc/hosts, limits): the snapshot's
        // files are the sandbox's own, and may have been made hostile (/etc/hosts a link to a
        // pipe) for whatever reads them next.
        if let Err(e) = after_resume(&vm, guest_config(&sb.spec, sb.net.as_deref())).await {
            self.stop_vm(&vm).await;
            let _ = std::fs::remove_dir_all(&staging);
            // The old VM runs on untouched: the sandbox is as it was.
            return Err(BackendError::SnapshotUnusable { snapshot: snap, reason: format!("the microVM resumed from it did not come up: {e}") });
        }
        // No call reaches the old VM from here on (its agent's calls fail as lost).
        old.mark_lost(&format!("the sandbox was rolled back to {snap}"));
        // The new VM's directory becomes the sandbox's, the old one's moves aside: QEMU is
        // chrooted into its directory by inode and its sockets are connected, so neither rename
        // disturbs a running VM. The old one's name carries its generation: a next rollback
        // never takes it for its own while it is being removed.
        let retired = self.vms_dir.join(format!("{id}.retired-{gen}"));
        let _ = std::fs::remove_dir_all(&retired);
        let moved = std::fs::rename(&dir, &retired).and_then(|()| std::fs::rename(&staging, &dir));
        if let Ok(mut d) = vm.dir.lock() {
            *d = if moved.is_ok() { dir.clone() } else { staging.clone() };
        }
        if let Err(e) = &moved {
            tracing::warn!(sandbox = %id, error = %e, "moving the resumed VM's directory into place");
        }
        if let Ok(mut slot) = sb.vm.write() {
            *slot = vm;
        }
        // The old VM stops after the answer (SIGKILL, reaping a QEMU with its RAM mapped, its
        // cgroup: ~30 ms of the rollback before). Until then it shares the TAP with the new one
        // as it did while the new one came up; a daemon that ends meanwhile takes it along.
        let me = self.clone();
        tokio::spawn(async move {
            me.stop_vm(&old).await;
            if retired.exists() {
                if let Err(e) = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&retired)).await.unwrap_or_else(|e| Err(std::io::Error::other(e))) {
                    tracing::warn!(error = %e, "removing a rolled-back VM's directory");
                }
            }
        });
        Ok(())
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), BackendError> {
        let sb = self.sandboxes.write().ok().and_then(|mut m| m.remove(id));
        let dir = self.vms_dir.join(id.as_str());
        let Some(sb) = sb else {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(BackendError::NoSuchSandbox(id.clone()));
        };
        let _op = sb.op.lock().await;
        if let Ok(vm) = sb.vm() {
            vm.mark_lost("the sandbox was destroyed");
            self.stop_vm(&vm).await;
        }
        if sb.net.is_some() {
            self.unlink(id).await;
        }
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "removing a VM directory");
        }
        drop(_op);
        self.collect_snapshots().await;
        Ok(())
    }

    /// Whatever ran before died with the previous daemon (see `guard`): its cgroups, pool and
    /// probe VMs and the directories of sandboxes no record knows go.
    fn clean(&self, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]) {
        if let Ok(root) = &self.cgroups {
            for name in root.list_sandboxes() {
                if let Some(cg) = root.open_sandbox(&name) {
                    let _ = cg.kill_all();
                    if let Err(e) = cg.destroy() {
                        tracing::warn!(cgroup = %name, error = %e, "removing a leftover VM cgroup");
                    }
                }
            }
        }
        for d in [&self.pool_dir, &self.probe_dir] {
            let _ = std::fs::remove_dir_all(d);
            let _ = std::fs::create_dir_all(d);
        }
        if let Ok(mut s) = self.snapshots.lock() {
            s.extend(snapshots.iter().filter(|s| self.snapshot_path(s).is_file()).cloned());
        }
        // Memory snapshots a previous run was writing when it died.
        if let Ok(entries) = std::fs::read_dir(&self.snapshots_dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".mem.part") || name.ends_with(".ram.part") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let wanted: HashSet<&str> = sandboxes.iter().map(|s| s.id.as_str()).collect();
        if let Ok(entries) = std::fs::read_dir(&self.vms_dir) {
            for e in entries.flatten() {
                if !e.file_name().to_str().is_some_and(|n| wanted.contains(n)) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// Once every recorded sandbox is back (or failed): bases and snapshot files nothing reaches
    /// any more go, and the warm pool fills.
    async fn recovered(self: &Arc<Self>) {
        {
            let _g = self.disk_lock.lock().await;
            disk::collect_garbage(&self.disk_roots(), &[&self.snapshots_dir, &self.bases_dir]);
            self.collect_memory();
        }
        pool::refill(self);
    }

    /// Boots a recorded sandbox again over its preserved top disk.
    async fn readopt(self: &Arc<Self>, spec: &SandboxSpec) -> Result<(), BackendError> {
        let (qemu, _) = self.tools()?.clone();
        let image = self.image(&spec.image)?;
        let dir = self.vms_dir.join(spec.id.as_str());
        let mut tops: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
            .map_err(|e| BackendError::io(format!("reading {}", dir.display()), e))?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                let gen = name.strip_prefix("top-")?.strip_suffix(".qcow2")?.parse().ok()?;
                Some((gen, e.path()))
            })
            .collect();
        tops.sort();
        // The newest top whose whole chain is present (a crash mid-snapshot may leave a newer
        // top whose backing was never put in place).
        let (gen, _) = tops
            .iter()
            .rev()
            .find(|(_, p)| disk::chain(p).is_ok_and(|c| c.iter().all(|f| f.is_file())))
            .cloned()
            .ok_or_else(|| BackendError::Internal(format!("sandbox {} has no usable disk in {}", spec.id, dir.display())))?;
        for (g, p) in &tops {
            if *g != gen {
                let _ = std::fs::remove_file(p);
            }
        }
        for f in ["agent.sock", "qmp.sock"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        let net = self.link_for(spec).await?;
        let booted = async {
            let vm = self.boot_existing(&self.vm_name(), &dir, gen, &qemu, &image, &spec.limits, None, net.clone(), None).await?;
            if let Err(e) = vm.configure(guest_config(spec, net.as_deref())).await {
                self.stop_vm(&vm).await;
                return Err(e);
            }
            Ok(vm)
        }
        .await;
        let vm = match booted {
            Ok(vm) => vm,
            Err(e) => {
                if net.is_some() {
                    self.unlink(&spec.id).await;
                }
                return Err(e);
            }
        };
        let sb = Arc::new(MicroSandbox { spec: spec.clone(), vm: RwLock::new(vm), net, op: tokio::sync::Mutex::new(()) });
        self.sandboxes.write().map_err(|_| BackendError::Internal("sandbox table poisoned".into()))?.insert(spec.id.clone(), sb);
        Ok(())
    }

    async fn shutdown(&self) {
        self.pool.close();
        for vm in self.pool.drain() {
            self.stop_vm(&vm).await;
        }
        let _ = std::fs::remove_dir_all(&self.pool_dir);
        let all: Vec<Arc<MicroSandbox>> = self.sandboxes.write().map(|mut m| m.drain().map(|(_, v)| v).collect()).unwrap_or_default();
        let stops = all.iter().map(|sb| async move {
            if let Ok(vm) = sb.vm() {
                vm.mark_lost("the daemon shut down");
                // Flush the guest's page cache to the disk file before QEMU goes.
                let _ = vm.agent.call(&Request::Freeze, &[], Duration::from_secs(3)).await;
                self.stop_vm(&vm).await;
            }
        });
        let _ = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(stops)).await;
        // Every VM is gone or going (they die with the daemon): the RAM files left are of VMs
        // whose start was cut short (a pool refill, a create) and are no one's. On /dev/shm the
        // directory would outlive us.
        ram::clear_dir(&self.ram_dir);
        if let Err(e) = std::fs::remove_dir(&self.ram_dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.ram_dir.display(), error = %e, "removing the microVM RAM directory");
            }
        }
        // The daemon's `-vm` cgroup, empty once every QEMU is gone; made again at start.
        if let Ok(root) = &self.cgroups {
            match root.cleanup_root() {
                Ok(true) => {}
                Ok(false) => tracing::warn!("the microVM tier's cgroup still holds a VM at shutdown; left in place"),
                Err(e) => tracing::warn!(error = %e, "removing the microVM tier's cgroup"),
            }
        }
    }
}

/// The VM artifacts of `image` from the catalog: NOT_FOUND for an unknown image,
/// FAILED_PRECONDITION (with what is missing) for an image without them.
fn vm_image(catalog: &Catalog, image: &str) -> Result<VmImage, BackendError> {
    let files = catalog.vm_files(image).map_err(|e| BackendError::from_image(Isolation::MicroVm, e))?;
    Ok(VmImage { name: image.to_string(), boot: BootFiles { kernel: files.kernel, initramfs: files.initramfs }, disk: files.disk })
}

/// The sandbox as the guest applies it.
fn guest_config(spec: &SandboxSpec, net: Option<&TapLink>) -> GuestLimits {
    let l = &spec.limits;
    GuestLimits {
        memory_bytes: l.memory_bytes,
        max_pids: l.max_pids,
        cpu_millicores: l.cpu_millicores,
        hostname: spec.id.to_string(),
        workdir: spec.workdir.clone(),
        shm_bytes: l.shm_size(),
        network: net.map(|n| guest_agent::protocol::GuestNetwork { address: n.address, prefix_len: n.prefix_len, gateway: n.gateway }),
        machine_id: machine_id(&spec.id),
    }
}

/// The sandbox's /etc/machine-id: the first 128 bits of the SHA-256 of its id, so every sandbox
/// (every fork of one memory snapshot) has its own, and keeps it across its rollbacks.
fn machine_id(id: &SandboxId) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(id.as_str().as_bytes())[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The machine a memory snapshot was saved from; a restore needs the same one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct MemoryShape {
    memory_mib: u64,
    vcpus: u32,
    accel: Accel,
    /// The kernel and initramfs (path, size, mtime): the saved RAM holds that kernel.
    boot: String,
    /// Whether the VM had a network device (absent in files written before networks: none).
    #[serde(default)]
    nic: bool,
    /// Whether the guest RAM is in `<snapshot>.ram` (the device state alone in `.mem`); absent
    /// in files written when the RAM was in the stream, which are not resumed.
    #[serde(default)]
    ram_file: bool,
    /// The guest agent running in the saved memory (absent in older files: asked at resume).
    #[serde(default)]
    agent: Option<SavedAgent>,
}

/// What the guest agent of a memory snapshot said in `Hello` when its VM started.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct SavedAgent {
    version: u32,
    kernel: String,
}

/// A VM's RAM file, made (empty) before its top disk.
struct PreparedRam {
    path: PathBuf,
}

/// A memory snapshot's files, opened: QEMU's device state, the guest RAM (None: an older
/// daemon's snapshot, RAM in the stream) and the machine they need.
struct SavedMemory {
    state: std::fs::File,
    ram: Option<std::fs::File>,
    shape: MemoryShape,
}

/// What identifies a VM's boot files (a rebuilt image gets another key).
fn boot_key(boot: &BootFiles) -> String {
    use std::os::unix::fs::MetadataExt;
    [&boot.kernel, &boot.initramfs]
        .iter()
        .map(|p| match std::fs::metadata(p) {
            Ok(m) => format!("{}:{}:{}.{}", p.display(), m.size(), m.mtime(), m.mtime_nsec()),
            Err(_) => format!("{}:missing", p.display()),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Bytes a file takes on the host (allocated, not apparent).
fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// Thaws the guest's root filesystem (after a snapshot, and in a VM resumed from one).
async fn thaw(vm: &Vm) -> Result<(), BackendError> {
    let r = vm.agent.call(&Request::Thaw, &[], Duration::from_secs(30)).await.map_err(|e| vm.agent_error(e))?;
    vm::expect_ok(r.msg, "thaw")
}

/// The first guest protocol that takes `Resumed`.
const RESUMED_PROTOCOL: u32 = 6;
/// Host randomness handed to a resumed guest's RNG.
const RESUME_ENTROPY_BYTES: usize = 64;

/// Makes a VM resumed from a memory snapshot its own again: its filesystem thawed (it was saved
/// frozen), its wall clock stepped to the host's (it stood still while saved), its kernel RNG
/// reseeded with fresh host randomness (two resumes of one snapshot share its state) and
/// `config` applied (its identity and limits).
///
/// The three requests go at once: the agent serves each on a thread of its own (the files
/// `Configure` writes wait in the guest kernel for the thaw), and right after a resume every
/// guest code path is cold under TCG (QEMU translates it anew), so each round trip waited for
/// alone would add its latency to the next one's.
async fn after_resume(vm: &Vm, config: GuestLimits) -> Result<(), BackendError> {
    let started = std::time::Instant::now();
    let ((thawed, thaw_ms), (told, resumed_ms), (configured, configure_ms)) =
        tokio::join!(clocked(started, thaw(vm)), clocked(started, tell_resumed(vm)), clocked(started, vm.configure(config)));
    thawed?;
    told?;
    configured?;
    tracing::debug!(ms = started.elapsed().as_millis() as u64, thaw_ms, resumed_ms, configure_ms, "resumed guest thawed, its clock, RNG and identity renewed");
    Ok(())
}

/// `f`'s output, and the milliseconds from `since` to its end.
async fn clocked<T>(since: std::time::Instant, f: impl std::future::Future<Output = T>) -> (T, u64) {
    let out = f.await;
    (out, since.elapsed().as_millis() as u64)
}

/// Tells the guest it was stopped (a resume from memory, or a pause's `cont`): its wall clock
/// is stepped to the host's and its RNG reseeded.
async fn tell_resumed(vm: &Vm) -> Result<(), BackendError> {
    if vm.hello.version < RESUMED_PROTOCOL {
        tracing::warn!(
            protocol = vm.hello.version,
            "the guest agent predates protocol 6: a VM resumed from memory keeps the snapshot's clock and RNG state (rebuild the VM images: make vm-images)"
        );
        return Ok(());
    }
    let mut entropy = [0u8; RESUME_ENTROPY_BYTES];
    // SAFETY: getrandom(2) writes at most `len` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(entropy.as_mut_ptr().cast(), entropy.len(), 0) };
    if n != entropy.len() as isize {
        return Err(BackendError::io("reading host randomness for a resumed VM", std::io::Error::last_os_error()));
    }
    let unix_time_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let r = vm.agent.call(&Request::Resumed { unix_time_ns }, &entropy, Duration::from_secs(10)).await.map_err(|e| vm.agent_error(e))?;
    vm::expect_ok(r.msg, "resumed")
}

/// Longest a memory snapshot may take to write (a 4 GiB guest on a slow disk fits).
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(300);
/// How often a migration's progress is polled.
const MIGRATE_POLL: Duration = Duration::from_millis(5);

/// Writes the paused VM's memory and device state into `file` (a QEMU migration to `fd:`,
/// unthrottled) and waits until it is complete.
async fn migrate_to(qmp: &mut qmp::Qmp, file: std::os::fd::BorrowedFd<'_>) -> Result<(), String> {
    // QEMU throttles a migration to 128 MiB/s by default; this one goes to a local file.
    qmp.execute("migrate-set-parameters", json!({ "max-bandwidth": 1u64 << 40 })).await?;
    // The RAM is its file (`share=on`), copied by the caller: the stream is the device state.
    qmp.execute("migrate-set-capabilities", json!({ "capabilities": [{ "capability": vm::IGNORE_SHARED, "state": true }] })).await?;
    qmp.send_fd("snapshot-memory", file).await?;
    qmp.execute("migrate", json!({ "uri": "fd:snapshot-memory" })).await?;
    let deadline = tokio::time::Instant::now() + MIGRATE_TIMEOUT;
    loop {
        let info = qmp.execute("query-migrate", serde_json::Value::Null).await?;
        match info.get("status").and_then(serde_json::Value::as_str) {
            Some("completed") => return Ok(()),
            Some(s @ ("failed" | "cancelled")) => {
                let why = info.get("error-desc").and_then(serde_json::Value::as_str).unwrap_or("no reason given");
                return Err(format!("migration {s}: {why}"));
            }
            _ => {}
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = qmp.execute("migrate_cancel", serde_json::Value::Null).await;
            return Err(format!("not written within {MIGRATE_TIMEOUT:?}"));
        }
        tokio::time::sleep(MIGRATE_POLL).await;
    }
}

/// The current top disk of a VM.
fn top_of(vm: &Vm) -> PathBuf {
    let gen = vm.gen.lock().map(|g| *g).unwrap_or(0);
    vm.dir().join(format!("top-{gen}.qcow2"))
}

/// What the KVM verdict depends on: this host boot (the hypervisor below us) and the QEMU
/// binary; not the guest kernel, so every daemon on the host shares one probe.
fn probe_key(qemu: &Path) -> String {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{} {}", boot_id.trim(), qemu.display())
}

fn read_probe_cache(key: &str) -> Option<Accel> {
    let text = std::fs::read_to_string(KVM_PROBE_CACHE).ok()?;
    let (k, v) = text.trim_end().rsplit_once('\t')?;
    if k != key {
        return None;
    }
    match v {
        "kvm" => Some(Accel::Kvm),
        "tcg" => Some(Accel::Tcg),
        _ => None,
    }
}

fn write_probe_cache(key: &str, accel: Accel) {
    let path = Path::new(KVM_PROBE_CACHE);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    if std::fs::write(&tmp, format!("{key}\t{}\n", accel.name())).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// A backing file kept from the garbage collection while a create boots over it.
/// How [`Inner::boot_or_restore`] made a VM.
#[derive(Debug, Clone, Copy, Default)]
struct Started {
    /// Configured for the create's spec already (restored, or booted and then snapshotted).
    configured: bool,
    /// Restored from the image's boot snapshot (no boot).
    restored: bool,
}

struct Pinned {
    set: Arc<Mutex<HashMap<PathBuf, usize>>>,
    path: PathBuf,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Ok(mut p) = self.set.lock() {
            if let Some(n) = p.get_mut(&self.path) {
                *n -= 1;
                if *n == 0 {
                    p.remove(&self.path);
                }
            }
        }
    }
}

/// Bytes the disk files (`*.qcow2`) of a VM's directory take on the host (allocated, not
/// apparent: qcow2 files are sparse).
fn disk_files_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let entries = std::fs::read_dir(dir).ok()?;
    Some(entries.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "qcow2")).filter_map(|e| e.metadata().ok()).map(|m| m.blocks() * 512).sum())
}

#[async_trait]
impl Backend for MicroVmBackend {
    fn isolation(&self) -> Isolation {
        Isolation::MicroVm
    }

    fn availability(&self) -> Result<(), String> {
        let inner = &self.inner;
        inner.tools.as_ref().map_err(|e| e.clone())?;
        inner.cgroups.as_ref().map_err(|e| e.clone())?;
        // Every image boots with a script-built image's kernel and initramfs.
        if inner.catalog.boot_files().is_none() {
            return Err(format!(
                "no image under {} has microVM artifacts (vm/vm.json: kernel, initramfs, disk); build them with `make images`",
                inner.catalog.images_dir().display()
            ));
        }
        Ok(())
    }

    fn image_ready(&self, image: &str) -> Result<(), String> {
        self.availability()?;
        self.inner.image(image).map(drop).map_err(|e| e.to_string())
    }

    async fn prepare_image(&self, image: &str) -> Result<String, BackendError> {
        let inner = &self.inner;
        let (_, qemu_img) = inner.tools()?;
        match inner.catalog.vm_files(image) {
            Ok(_) => Ok("base disk ready".to_string()),
            // An imported image gets its base disk here, once; a script-built one from
            // `images/build-vm.sh`.
            Err(ImageError::NotReady { .. }) if inner.catalog.imported(image).is_some() && !inner.catalog.is_script_built(image) => {
                let img = inner.catalog.resolve(image).map_err(|e| BackendError::from_image(Isolation::MicroVm, e))?;
                debug_assert_eq!(img.origin, Origin::Imported);
                let built = basedisk::build(qemu_img, image, &img.dir).await?;
                // The boot files must be there too, or the disk alone runs nothing.
                inner.image(image)?;
                Ok(built)
            }
            Err(e) => Err(BackendError::from_image(Isolation::MicroVm, e)),
        }
    }

    async fn remove_image(&self, image: &str) -> Result<(), BackendError> {
        // Its boot snapshots, and their files.
        self.inner.drop_boot_snapshots(|s| s.image == image).await;
        // The hard links of its base disk; no sandbox or snapshot needs them any more.
        let _g = self.inner.disk_lock.lock().await;
        for path in disk::bases_of(image, &self.inner.bases_dir) {
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::info!(image, file = %path.display(), "base disk removed"),
                Err(e) => tracing::warn!(image, file = %path.display(), error = %e, "removing a base disk"),
            }
        }
        Ok(())
    }

    fn failure(&self, sandbox: &SandboxId) -> Option<String> {
        // Rollback, destroy and shutdown mark a VM lost before they kill it; a VM that exited
        // without that died on its own (the guest powered off, QEMU crashed or was killed).
        let vm = self.inner.sandbox(sandbox).ok()?.vm().ok()?;
        if vm.lost_reason().is_some() {
            return None;
        }
        vm.exited().map(|how| format!("the sandbox's VM exited ({how}); nothing in it can run any more (its disk is kept: snapshot or destroy it)"))
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        Inner::create(&self.inner, spec).await
    }

    async fn exec(
        &self,
        sandbox: &SandboxId,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        let vm = self.inner.sandbox(sandbox)?.vm()?;
        exec::run(&vm, spec, sink, started, cancel).await
    }

    async fn signal_exec(&self, sandbox: &SandboxId, exec_id: &ExecId, signal: i32) -> Result<(), BackendError> {
        let vm = self.inner.sandbox(sandbox)?.vm()?;
        let req = Request::Signal { exec_id: exec_id.to_string(), signal };
        let reply = vm.agent.call(&req, &[], Duration::from_secs(10)).await.map_err(|e| vm.agent_error(e))?;
        match reply.msg {
            guest_agent::protocol::Response::Ok => Ok(()),
            guest_agent::protocol::Response::Error { kind: guest_agent::protocol::ErrorKind::NoSuchExec, .. } => Err(BackendError::NoSuchExec(exec_id.clone())),
            other => vm::expect_ok(other, "signal"),
        }
    }

    async fn write_file(&self, sandbox: &SandboxId, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::write_file(&*sb.vm()?, &sb.spec.workdir, path, content, mode).await
    }

    async fn read_file(&self, sandbox: &SandboxId, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::read_file(&*sb.vm()?, &sb.spec.workdir, path, offset, limit).await
    }

    async fn upload_file(&self, sandbox: &SandboxId, path: &str, mode: u32, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::upload_file(&*sb.vm()?, &sb.spec.workdir, path, mode, data).await
    }

    async fn download_file(&self, sandbox: &SandboxId, path: &str, idle: std::time::Duration) -> Result<Download, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::download_file(sb.vm()?, &sb.spec.workdir, path, idle).await
    }

    async fn upload_archive(&self, sandbox: &SandboxId, dir: &str, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::upload_archive(&*sb.vm()?, &sb.spec.workdir, dir, data).await
    }

    async fn download_archive(&self, sandbox: &SandboxId, path: &str, idle: std::time::Duration) -> Result<ByteChunks, BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::download_archive(sb.vm()?, &sb.spec.workdir, path, idle).await
    }

    async fn remove_file(&self, sandbox: &SandboxId, path: &str) -> Result<(), BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        files::remove_file(&*sb.vm()?, &sb.spec.workdir, path).await
    }

    async fn usage(&self, sandbox: &SandboxId) -> Result<super::SandboxUsage, BackendError> {
        let vm = self.inner.sandbox(sandbox)?.vm()?;
        // QEMU's cgroup: the guest's CPU and the RAM it touched, as the host pays for them. The
        // guest's own processes are not the host's to count.
        let mut usage = vm.cgroup.lock().ok().and_then(|c| c.as_ref().map(|c| c.usage())).unwrap_or_default();
        usage.pids = None;
        let dir = vm.dir.lock().map(|d| d.clone()).map_err(|_| BackendError::Internal("VM dir poisoned".into()))?;
        usage.disk_bytes = tokio::task::spawn_blocking(move || disk_files_bytes(&dir)).await.ok().flatten();
        Ok(usage)
    }

    async fn snapshot(&self, sandbox: &SandboxId, snapshot: &SnapshotId, memory: bool) -> Result<u64, BackendError> {
        self.inner.snapshot(sandbox, snapshot, memory).await
    }

    async fn rollback(&self, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<(), BackendError> {
        self.inner.rollback(sandbox, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &SnapshotId) -> Result<(), BackendError> {
        let known = self.inner.snapshots.lock().map(|mut s| s.remove(snapshot)).unwrap_or(false);
        if !known {
            return Err(BackendError::NoSuchSnapshot(snapshot.clone()));
        }
        self.inner.collect_snapshots().await;
        Ok(())
    }

    async fn pause(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        // QMP `stop`: the vCPUs stop and QEMU's virtual clock with them, so the guest's own
        // timers (an exec's timeout in the agent) do not run on; its RAM stays where it is.
        // Destroy kills QEMU, stopped or not.
        let sb = self.inner.sandbox(sandbox)?;
        let _op = sb.op.lock().await;
        let vm = sb.vm()?;
        let answer = vm.qmp.lock().await.execute("stop", serde_json::Value::Null).await;
        answer.map(drop).map_err(|e| BackendError::Internal(format!("stopping the microVM: {e}")))
    }

    async fn resume(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        let sb = self.inner.sandbox(sandbox)?;
        let _op = sb.op.lock().await;
        let vm = sb.vm()?;
        let answer = vm.qmp.lock().await.execute("cont", serde_json::Value::Null).await;
        answer.map(drop).map_err(|e| BackendError::Internal(format!("continuing the microVM: {e}")))?;
        // Its wall clock stood still while stopped; a guest that cannot be told keeps going
        // (behind by the pause) rather than failing a resume that happened.
        if let Err(e) = tell_resumed(&vm).await {
            tracing::warn!(sandbox = %sandbox, error = %e, "cannot step a resumed microVM's clock");
        }
        Ok(())
    }

    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), BackendError> {
        self.inner.destroy(sandbox).await
    }

    async fn clean(&self, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]) {
        self.inner.clean(sandboxes, snapshots)
    }

    async fn readopt(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        self.inner.readopt(spec).await
    }

    async fn recovered(&self) {
        Inner::recovered(&self.inner).await
    }

    /// Boots are CPU-bound under TCG: as many at a time as the host has CPUs.
    fn readopt_concurrency(&self) -> usize {
        self.inner.host_cpus as usize
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }
}
