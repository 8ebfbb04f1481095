//! Admission: what the daemon promises before it says yes, so that no sandbox or tenant can take
//! what every other one was promised, and the host and the daemon keep what they need to run.
//!
//! Provisioning is thin, as in LVM thin pools or Kubernetes' requests and limits: a sandbox's
//! limits are hard ceilings it can never pass, but the sum of everyone's ceilings may exceed
//! what the host has by a configured ratio, because an idle sandbox uses a small part of them
//! (measured: ~2 MiB of memory, one pid, a few KiB of disk). What protects the host is real use:
//! past a high-water mark creates are refused, naming the key, whatever is promised. Each ratio
//! at 1.0 is strict (nothing promised that does not exist).
//!
//! * **Sandboxes.** `policy.max_sandboxes` and `policy.max_sandboxes_per_tenant` (defaults 4096
//!   and 2048).
//! * **Memory.** The sum of the `memory_bytes` of every sandbox not destroyed, plus a new
//!   request, stays within (host memory − `admission.daemon_memory_reserve_bytes`) ×
//!   `admission.memory_overcommit`, and within `admission.max_memory_bytes_per_tenant` per
//!   tenant. Creates are refused while the host's available memory is below the reserve. The
//!   daemon's `oom_score_adj` (`admission.oom_score_adj`, -900, when the host grants
//!   CAP_SYS_RESOURCE) and its sandboxes' (`admission.sandbox_oom_score_adj`, 500, set in every
//!   process started for one) make the kernel kill a sandbox's processes before the daemon.
//! * **Pids.** The sum of `max_pids` stays within (`kernel.pid_max` − `admission.pids_reserve`)
//!   × `admission.pids_overcommit` (per tenant: `admission.max_pids_per_tenant`); creates are
//!   refused while fewer than `pids_reserve` pids are free.
//! * **Disk.** Every sandbox draws its `disk_bytes` from one storage pool. The sum of the
//!   `disk_bytes` of the sandboxes of a pool (creating, running or failed: until destroyed, each
//!   keeps its writable layer) plus a new request stays within the pool's capacity ×
//!   `admission.disk_overcommit` (per tenant: `admission.max_disk_bytes_per_tenant`). Quotas stay
//!   hard per sandbox (a btrfs qgroup on the process tier). Real use of the pool — layers and
//!   snapshots alike — is measured at each create: from `admission.disk_warn` (80%) the daemon
//!   warns in its log and `/metrics`, from `admission.disk_high_water` (90%) creates on the pool
//!   are refused (a pool that is a filesystem of its own, the process tier's; a shared host
//!   filesystem only warns). A write refused because the pool (not the sandbox's quota) is full
//!   says so.
//! * **Snapshots.** Count and bytes (`size_bytes`) per sandbox and per tenant
//!   (`admission.max_snapshots_per_*`, `admission.max_snapshot_bytes_per_*`); snapshots live in
//!   the pool, so they count in its real use too.
//! * **Exec slots.** Each running exec holds daemon resources (on the process tier two pipe
//!   descriptors, on every tier an output buffer and a task), so running and background execs
//!   are capped per sandbox and per tenant (`[policy]`, see [`ExecCaps`]). An exec holds its
//!   slot until its process has ended.
//! * **Exec records.** A stored record keeps at most `exec.max_record_argv_bytes` of argv and
//!   says `argv_truncated` past it.
//!
//! The pools, per tier:
//!
//! | tier | pool | capacity |
//! |---|---|---|
//! | PROCESS | the btrfs pool file (`<state_dir>/pool`) | `pool_size_bytes` (default: half of the free space of the state dir's filesystem when the file is made, at least 16 GiB while that is under 80% of it) |
//! | MICROVM | the state dir's filesystem (sparse qcow2 disks) | `microvm.disk_pool_bytes`, else the filesystem's size at start |
//! | CONTAINER | Docker's data root (writable layers) | `container.disk_pool_bytes`, else the size at start of the filesystem of `/var/lib/docker` (of the state dir when there is none) |
//!
//! When neither tier's key is set and both measured filesystems are the same one, MICROVM and
//! CONTAINER sandboxes share a single pool, so two tiers never promise the same bytes twice. The
//! measured size is the whole filesystem, which also holds the process tier's sparse pool file
//! and whatever else the host keeps there: a host that runs several tiers at scale sets the keys
//! to its split of the disk. A microVM's disk is at least its image's size; the promise is
//! `disk_bytes`.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::config::{AdmissionConfig, Config};
use crate::ids::SandboxId;
use crate::model::{Isolation, Limits};
use crate::policy::ExecCaps;

/// Where Docker keeps images and containers unless configured otherwise.
const DOCKER_DATA_ROOT: &str = "/var/lib/docker";

/// Bytes in a human unit: "512 B", "16 MiB", "7.5 GiB".
pub fn human_bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if n >= size {
            return if n.is_multiple_of(size) { format!("{} {unit}", n / size) } else { format!("{:.1} {unit}", n as f64 / size as f64) };
        }
    }
    format!("{n} B")
}

/// A pool of disk that the sandboxes of one or more tiers draw their `disk_bytes` from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskPool {
    /// The config key(s) sizing it, named when a create does not fit.
    pub key: String,
    /// Bytes that may be promised in total.
    pub capacity: u64,
    /// Where the capacity comes from, for the start-up log.
    pub origin: String,
    /// The directory whose filesystem holds the pool's bytes, measured for real use (None:
    /// only promises are admitted).
    pub path: Option<PathBuf>,
    /// The pool is a filesystem of its own mounted at `path` (the process tier's btrfs pool):
    /// until it is, `path` shows its parent's filesystem, which says nothing of the pool.
    pub own_mount: bool,
}

/// A pool's real use, measured now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUse {
    /// Bytes not available to the pool's sandboxes (size − available): layers, snapshots,
    /// metadata, and on a shared filesystem whatever else the host keeps there.
    pub used: u64,
    pub size: u64,
}

impl PoolUse {
    /// The used share, 0.0 to 1.0.
    pub fn share(&self) -> f64 {
        if self.size == 0 {
            return 1.0;
        }
        self.used as f64 / self.size as f64
    }
}

/// The daemon's disk pools and which tier draws from which. A tier without a pool (its size
/// could not be measured; logged) is not disk-admitted.
#[derive(Debug, Clone)]
pub struct DiskPools {
    pools: Vec<DiskPool>,
    by_tier: HashMap<Isolation, usize>,
    /// `admission.disk_overcommit`.
    overcommit: f64,
    /// `admission.disk_high_water` and `admission.disk_warn`.
    high_water: f64,
    warn: f64,
}

impl Default for DiskPools {
    fn default() -> Self {
        let cfg = AdmissionConfig::default();
        DiskPools { pools: Vec::new(), by_tier: HashMap::new(), overcommit: cfg.disk_overcommit, high_water: cfg.disk_high_water, warn: cfg.disk_warn }
    }
}

/// A filesystem as measured at start.
struct Filesystem {
    dev: u64,
    size: u64,
}

fn measure(path: &Path) -> Result<Filesystem, String> {
    let dev = std::fs::metadata(path).map_err(|e| format!("stat {}: {e}", path.display()))?.dev();
    let st = nix::sys::statvfs::statvfs(path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    // Both fields are u64 or u32 depending on the libc; the product cannot overflow a u64 for
    // any real filesystem, and saturates if one lies.
    #[allow(clippy::useless_conversion)]
    let size = u64::from(st.blocks()).saturating_mul(u64::from(st.fragment_size()));
    Ok(Filesystem { dev, size })
}

/// Size and use of the filesystem holding `path` (None when it cannot be measured, or, with
/// `own_mount`, when `path` is not yet a filesystem of its own).
fn measure_use(path: &Path, own_mount: bool) -> Option<PoolUse> {
    if own_mount {
        let parent = path.parent()?;
        if std::fs::metadata(path).ok()?.dev() == std::fs::metadata(parent).ok()?.dev() {
            return None;
        }
    }
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    #[allow(clippy::useless_conversion)]
    let (size, available) =
        (u64::from(st.blocks()).saturating_mul(u64::from(st.fragment_size())), u64::from(st.blocks_available()).saturating_mul(u64::from(st.fragment_size())));
    Some(PoolUse { used: size.saturating_sub(available), size })
}

/// How close to its limit a resource is, for the log and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pressure {
    Ok,
    /// Past the warning level: creates still admitted.
    Near,
    /// Past the refusal level: creates refused.
    Over,
}

impl DiskPools {
    /// Pools from explicit parts (tests, and [`DiskPools::from_config`]).
    pub fn new(pools: Vec<DiskPool>, by_tier: HashMap<Isolation, usize>) -> Self {
        DiskPools { pools, by_tier, ..Default::default() }
    }

    /// The same pools admitted with `cfg`'s ratio and marks.
    pub fn with_admission(self, cfg: &AdmissionConfig) -> Self {
        DiskPools { overcommit: cfg.disk_overcommit, high_water: cfg.disk_high_water, warn: cfg.disk_warn, ..self }
    }

    /// The pools this configuration gives, measuring the filesystems of the tiers whose
    /// capacity is not configured (see the module doc for the rule).
    pub fn from_config(cfg: &Config) -> Self {
        let pool_dir = cfg.state_dir.join("pool");
        // A pool file made earlier keeps its size whatever pool_size_bytes (or its default,
        // from today's free space) says now.
        let image = cfg.state_dir.join("pool.img");
        let (capacity, origin) = match std::fs::metadata(&image) {
            Ok(m) if m.is_file() => (m.len(), format!("the btrfs pool file {}", image.display())),
            _ => (cfg.pool_size_bytes, format!("the btrfs pool file {} (to be made)", image.display())),
        };
        let mut pools = vec![DiskPool { key: "pool_size_bytes".into(), capacity, origin, path: Some(pool_dir), own_mount: true }];
        let mut by_tier = HashMap::from([(Isolation::Process, 0)]);
        // (tier, key, configured capacity, filesystem its disks live on)
        let docker_root = Path::new(DOCKER_DATA_ROOT);
        let docker_dir = if docker_root.is_dir() { docker_root } else { cfg.state_dir.as_path() };
        let tiers = [
            (Isolation::MicroVm, "microvm.disk_pool_bytes", cfg.microvm.disk_pool_bytes, cfg.state_dir.as_path()),
            (Isolation::Container, "container.disk_pool_bytes", cfg.container.disk_pool_bytes, docker_dir),
        ];
        // Measured pools by filesystem, so tiers on one filesystem share one pool.
        let mut by_dev: HashMap<u64, usize> = HashMap::new();
        for (tier, key, configured, dir) in tiers {
            if let Some(capacity) = configured {
                pools.push(DiskPool { key: key.into(), capacity, origin: "configured".into(), path: Some(dir.to_path_buf()), own_mount: false });
                by_tier.insert(tier, pools.len() - 1);
                continue;
            }
            let fs = match measure(dir) {
                Ok(fs) => fs,
                Err(e) => {
                    tracing::warn!(tier = tier.name(), error = %e, "cannot measure the filesystem of this tier's disks: its disk_bytes are not admitted against a pool; set {key}");
                    continue;
                }
            };
            if let Some(&i) = by_dev.get(&fs.dev) {
                pools[i].key.push_str(&format!(", {key}"));
                by_tier.insert(tier, i);
                continue;
            }
            let origin = format!("the size of the filesystem of {}", dir.display());
            pools.push(DiskPool { key: key.into(), capacity: fs.size, origin, path: Some(dir.to_path_buf()), own_mount: false });
            by_tier.insert(tier, pools.len() - 1);
            by_dev.insert(fs.dev, pools.len() - 1);
        }
        DiskPools { pools, by_tier, ..Default::default() }.with_admission(&cfg.admission)
    }

    /// The pool `tier` draws from.
    pub fn pool_of(&self, tier: Isolation) -> Option<&DiskPool> {
        self.by_tier.get(&tier).and_then(|&i| self.pools.get(i))
    }

    /// Whether sandboxes of `a` and `b` draw from the same pool.
    pub fn same_pool(&self, a: Isolation, b: Isolation) -> bool {
        match (self.by_tier.get(&a), self.by_tier.get(&b)) {
            (Some(x), Some(y)) => x == y,
            _ => false,
        }
    }

    /// Every pool with the tiers drawing from it, for the start-up log.
    pub fn pools(&self) -> Vec<(&DiskPool, Vec<Isolation>)> {
        self.pools.iter().enumerate().map(|(i, p)| (p, Isolation::ALL.into_iter().filter(|t| self.by_tier.get(t) == Some(&i)).collect())).collect()
    }

    /// Bytes that may be promised from `pool`: its capacity × the overcommit ratio.
    pub fn promisable(&self, pool: &DiskPool) -> u64 {
        scale(pool.capacity, self.overcommit)
    }

    /// Whether `disk_bytes` more fits the pool of `tier`, which has `promised` bytes promised
    /// already; else the sentence to refuse with.
    pub fn admit(&self, tier: Isolation, promised: u64, disk_bytes: u64) -> Result<(), String> {
        let Some(pool) = self.pool_of(tier) else { return Ok(()) };
        let promisable = self.promisable(pool);
        if promised.saturating_add(disk_bytes) <= promisable {
            return Ok(());
        }
        // Strict promises need no explanation of where the number comes from.
        let from = if self.overcommit == 1.0 {
            String::new()
        } else {
            format!(" ({} pool × admission.disk_overcommit {})", human_bytes(pool.capacity), self.overcommit)
        };
        Err(format!(
            "storage pool full: {} of {} promised to sandboxes{from}; disk_bytes {} does not fit ({})",
            human_bytes(promised),
            human_bytes(promisable),
            human_bytes(disk_bytes),
            pool.key
        ))
    }

    /// The real use of the pool of `tier` now, if it can be measured.
    pub fn usage(&self, tier: Isolation) -> Option<PoolUse> {
        let pool = self.pool_of(tier)?;
        measure_use(pool.path.as_deref()?, pool.own_mount)
    }

    /// Where `usage` stands against the warning and refusal marks.
    pub fn pressure(&self, usage: PoolUse) -> Pressure {
        let share = usage.share();
        if share >= self.high_water {
            Pressure::Over
        } else if share >= self.warn {
            Pressure::Near
        } else {
            Pressure::Ok
        }
    }

    /// Whether the real use of `tier`'s pool (`usage`, measured now) leaves room for a create;
    /// else the sentence to refuse with.
    /// Only a pool that is a filesystem of its own (the process tier's) refuses: on a shared
    /// filesystem (MICROVM, CONTAINER) the used share counts whatever else the host keeps there
    /// (and blocks reserved for root), so it only warns.
    pub fn admit_use(&self, tier: Isolation, usage: Option<PoolUse>) -> Result<(), String> {
        let (Some(pool), Some(usage)) = (self.pool_of(tier), usage) else { return Ok(()) };
        if !pool.own_mount || self.pressure(usage) < Pressure::Over {
            return Ok(());
        }
        Err(format!(
            "storage pool {:.0}% used ({} of {}, sandboxes' layers and snapshots), at or above admission.disk_high_water ({:.0}%): \
             creates on it are refused until sandboxes or snapshots are deleted ({})",
            usage.share() * 100.0,
            human_bytes(usage.used),
            human_bytes(usage.size),
            self.high_water * 100.0,
            pool.key
        ))
    }

    /// The sentence for a write refused with ENOSPC/EDQUOT in a sandbox of `tier` writing
    /// `path`: when the pool itself is (nearly) full it was the pool, not the sandbox's own
    /// `disk_bytes`, and saying "disk_bytes reached" would send the user after the wrong limit.
    pub fn explain_full(&self, tier: Isolation, path: &str, disk_bytes: u64) -> String {
        explain_full(self.pool_of(tier), self.usage(tier), path, disk_bytes)
    }
}

/// The sentence for a full disk (see [`DiskPools::explain_full`]), from what was measured.
fn explain_full(pool: Option<&DiskPool>, usage: Option<PoolUse>, path: &str, disk_bytes: u64) -> String {
    // btrfs keeps a global reserve and allocates in chunks: a pool that refuses writes still
    // shows some bytes available, so "full" is within 1% or 64 MiB, whichever is larger.
    let slack = |u: &PoolUse| (u.size / 100).max(64 << 20);
    match (pool, usage) {
        (Some(pool), Some(u)) if u.size.saturating_sub(u.used) <= slack(&u) => format!(
            "the storage pool is full ({} of {} used by all sandboxes and snapshots; {}), not this sandbox's disk_bytes ({}): writing {path}",
            human_bytes(u.used),
            human_bytes(u.size),
            pool.key,
            human_bytes(disk_bytes)
        ),
        _ => format!("the sandbox's disk is full (disk_bytes {} reached) writing {path}", human_bytes(disk_bytes)),
    }
}

/// `n × ratio`, saturating.
fn scale(n: u64, ratio: f64) -> u64 {
    let v = n as f64 * ratio;
    if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        v as u64
    }
}

/// What the host has, measured once at start: what memory and pids admission divide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    /// `MemTotal` of /proc/meminfo.
    pub memory_bytes: u64,
    /// `kernel.pid_max`.
    pub pid_max: u64,
}

/// A field of /proc/meminfo in bytes ("MemTotal", "MemAvailable").
fn meminfo(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split(':').nth(1)?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib.saturating_mul(1024))
}

impl Host {
    /// Measures this host; a value that cannot be read is logged and taken as unlimited
    /// (memory) or the kernel's default (32,768 pids), so the daemon still starts.
    pub fn measure() -> Host {
        let memory_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| meminfo(&t, "MemTotal")).unwrap_or_else(|| {
            tracing::warn!("cannot read MemTotal from /proc/meminfo: memory is not admitted");
            u64::MAX
        });
        let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max").ok().and_then(|t| t.trim().parse().ok()).unwrap_or_else(|| {
            tracing::warn!("cannot read /proc/sys/kernel/pid_max: assuming 32768");
            32_768
        });
        Host { memory_bytes, pid_max }
    }
}

/// What the host has free now, measured at each create and each pressure check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostNow {
    /// `MemAvailable` of /proc/meminfo.
    pub memory_available: Option<u64>,
    /// Threads and processes that exist (the second number of the fourth field of
    /// /proc/loadavg): each holds a pid.
    pub tasks: Option<u64>,
}

impl HostNow {
    /// Reads /proc/meminfo and /proc/loadavg.
    pub fn measure() -> HostNow {
        let memory_available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| meminfo(&t, "MemAvailable"));
        let tasks = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|t| t.split_whitespace().nth(3).and_then(|f| f.split('/').nth(1)).and_then(|n| n.parse().ok()));
        HostNow { memory_available, tasks }
    }
}

/// What the sandboxes on record are promised, summed (host-wide or for one tenant).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Promised {
    pub memory_bytes: u64,
    pub max_pids: u64,
    pub disk_bytes: u64,
}

impl Promised {
    /// Adds one sandbox's limits.
    pub fn add(&mut self, limits: &Limits) {
        self.memory_bytes = self.memory_bytes.saturating_add(limits.memory_bytes);
        self.max_pids = self.max_pids.saturating_add(limits.max_pids.into());
        self.disk_bytes = self.disk_bytes.saturating_add(limits.disk_bytes);
    }
}

/// Memory, pids and per-tenant admission (disk pools are [`DiskPools`]).
#[derive(Debug, Clone)]
pub struct Budgets {
    host: Host,
    cfg: AdmissionConfig,
}

impl Budgets {
    /// Budgets of `host` under `cfg`.
    pub fn new(host: Host, cfg: AdmissionConfig) -> Self {
        Budgets { host, cfg }
    }

    /// The host measured at start.
    pub fn host(&self) -> Host {
        self.host
    }

    /// Bytes of `memory_bytes` that may be promised in all.
    pub fn memory_capacity(&self) -> u64 {
        scale(self.host.memory_bytes.saturating_sub(self.cfg.daemon_memory_reserve_bytes), self.cfg.memory_overcommit)
    }

    /// Pids (`max_pids`) that may be promised in all.
    pub fn pids_capacity(&self) -> u64 {
        scale(self.host.pid_max.saturating_sub(self.cfg.pids_reserve), self.cfg.pids_overcommit)
    }

    /// Whether a sandbox with `limits` fits beside what is promised host-wide (`all`) and to its
    /// tenant (`tenant`), and what the host has free `now`; else the sentence to refuse with,
    /// naming the config key and the numbers.
    pub fn admit(&self, all: &Promised, tenant_name: &str, tenant: &Promised, limits: &Limits, now: &HostNow) -> Result<(), String> {
        let c = &self.cfg;
        let mem = limits.memory_bytes;
        let cap = self.memory_capacity();
        if all.memory_bytes.saturating_add(mem) > cap {
            return Err(format!(
                "memory: {} promised to sandboxes; memory_bytes {} does not fit in {} (host memory {} − admission.daemon_memory_reserve_bytes {}, × admission.memory_overcommit {})",
                human_bytes(all.memory_bytes),
                human_bytes(mem),
                human_bytes(cap),
                human_bytes(self.host.memory_bytes),
                human_bytes(c.daemon_memory_reserve_bytes),
                c.memory_overcommit
            ));
        }
        if let Some(max) = c.max_memory_bytes_per_tenant {
            if tenant.memory_bytes.saturating_add(mem) > max {
                return Err(format!(
                    "admission.max_memory_bytes_per_tenant ({}) reached: tenant {tenant_name:?} has {} promised; memory_bytes {} does not fit",
                    human_bytes(max),
                    human_bytes(tenant.memory_bytes),
                    human_bytes(mem)
                ));
            }
        }
        let pids = u64::from(limits.max_pids);
        let cap = self.pids_capacity();
        if all.max_pids.saturating_add(pids) > cap {
            return Err(format!(
                "pids: {} promised to sandboxes; max_pids {pids} does not fit in {cap} (kernel.pid_max {} − admission.pids_reserve {}, × admission.pids_overcommit {})",
                all.max_pids, self.host.pid_max, c.pids_reserve, c.pids_overcommit
            ));
        }
        if let Some(max) = c.max_pids_per_tenant {
            if tenant.max_pids.saturating_add(pids) > max {
                return Err(format!(
                    "admission.max_pids_per_tenant ({max}) reached: tenant {tenant_name:?} has {} promised; max_pids {pids} does not fit",
                    tenant.max_pids
                ));
            }
        }
        if let Some(max) = c.max_disk_bytes_per_tenant {
            if tenant.disk_bytes.saturating_add(limits.disk_bytes) > max {
                return Err(format!(
                    "admission.max_disk_bytes_per_tenant ({}) reached: tenant {tenant_name:?} has {} promised; disk_bytes {} does not fit",
                    human_bytes(max),
                    human_bytes(tenant.disk_bytes),
                    human_bytes(limits.disk_bytes)
                ));
            }
        }
        self.memory_use(now)?;
        self.pids_use(now)
    }

    /// Real memory use: refused while the host's available memory is below the reserve.
    fn memory_use(&self, now: &HostNow) -> Result<(), String> {
        match now.memory_available {
            Some(avail) if avail < self.cfg.daemon_memory_reserve_bytes => Err(format!(
                "host memory nearly exhausted: {} available, below admission.daemon_memory_reserve_bytes ({}); creates are refused until sandboxes free memory",
                human_bytes(avail),
                human_bytes(self.cfg.daemon_memory_reserve_bytes)
            )),
            _ => Ok(()),
        }
    }

    /// Real pid use: refused while fewer than the reserve are free under pid_max.
    fn pids_use(&self, now: &HostNow) -> Result<(), String> {
        match now.tasks {
            Some(tasks) if self.host.pid_max.saturating_sub(tasks) < self.cfg.pids_reserve => Err(format!(
                "host pids nearly exhausted: {tasks} of kernel.pid_max {} in use, fewer than admission.pids_reserve ({}) free; creates are refused until processes end",
                self.host.pid_max, self.cfg.pids_reserve
            )),
            _ => Ok(()),
        }
    }

    /// Where the host's memory and pids stand now: (memory, pids). Near: less than twice the
    /// reserve left.
    pub fn pressure(&self, now: &HostNow) -> (Pressure, Pressure) {
        let reserve = self.cfg.daemon_memory_reserve_bytes;
        let memory = match now.memory_available {
            Some(a) if a < reserve => Pressure::Over,
            Some(a) if a < reserve.saturating_mul(2) => Pressure::Near,
            _ => Pressure::Ok,
        };
        let free_pids = now.tasks.map(|t| self.host.pid_max.saturating_sub(t));
        let pids = match free_pids {
            Some(f) if f < self.cfg.pids_reserve => Pressure::Over,
            Some(f) if f < self.cfg.pids_reserve.saturating_mul(2) => Pressure::Near,
            _ => Pressure::Ok,
        };
        (memory, pids)
    }
}

/// Logs a resource's pressure when it changes (not at every check), so the log says once, and
/// clearly, when a host resource nears or reaches its limit and when it is back.
#[derive(Debug, Default)]
pub struct PressureLog {
    last: Mutex<HashMap<String, Pressure>>,
}

impl PressureLog {
    /// Records `level` for `resource`; logs `detail` when the level changed. Returns whether it
    /// did.
    pub fn note(&self, resource: &str, level: Pressure, detail: &str) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let before = last.insert(resource.to_string(), level).unwrap_or(Pressure::Ok);
        if before == level {
            return false;
        }
        match level {
            Pressure::Over => tracing::error!(resource, %detail, "host resource at its limit: creates are refused"),
            Pressure::Near => tracing::warn!(resource, %detail, "host resource nearing its limit"),
            Pressure::Ok => tracing::info!(resource, %detail, "host resource back under its warning level"),
        }
        true
    }
}

/// Sets the daemon's own `oom_score_adj`, so that under memory pressure the kernel kills a
/// sandbox's processes before the daemon that serves every tenant. Lowering it needs
/// CAP_SYS_RESOURCE (which some hosts withhold even from root): then the sandboxes' higher
/// value (below) is what keeps the daemon last.
pub fn set_oom_score_adj(value: i32) -> Result<(), String> {
    std::fs::write("/proc/self/oom_score_adj", value.to_string()).map_err(|e| format!("writing /proc/self/oom_score_adj: {e}"))
}

/// The `oom_score_adj` every process started for a sandbox gets (`admission.sandbox_oom_score_adj`).
static SANDBOX_OOM_SCORE_ADJ: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(500);

/// Sets the value [`set_sandbox_oom_score_adj_in_child`] writes (at start, from the config).
pub fn set_sandbox_oom_score_adj(value: i32) {
    SANDBOX_OOM_SCORE_ADJ.store(value, std::sync::atomic::Ordering::Relaxed);
}

/// The `oom_score_adj` of a sandbox's processes.
pub fn sandbox_oom_score_adj() -> i32 {
    SANDBOX_OOM_SCORE_ADJ.load(std::sync::atomic::Ordering::Relaxed)
}

/// `value` in decimal into `buf`, without allocating (for use after fork); the digits' length.
fn decimal(value: i32, buf: &mut [u8; 12]) -> usize {
    let mut n = value.unsigned_abs();
    let mut digits = [0u8; 12];
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut out = 0;
    if value < 0 {
        buf[0] = b'-';
        out = 1;
    }
    for d in digits[..len].iter().rev() {
        buf[out] = *d;
        out += 1;
    }
    out
}

/// Sets `oom_score_adj` to `admission.sandbox_oom_score_adj` in a child between fork and exec:
/// the daemon's value is inherited, and a sandbox's init, QEMU or anything else spawned for a
/// sandbox must never share its protection. Raising the value needs no privilege.
///
/// Only async-signal-safe calls (an atomic load, open, write, close) and no allocation.
pub fn set_sandbox_oom_score_adj_in_child() -> std::io::Result<()> {
    const PATH: &std::ffi::CStr = c"/proc/self/oom_score_adj";
    let mut buf = [0u8; 12];
    let len = decimal(SANDBOX_OOM_SCORE_ADJ.load(std::sync::atomic::Ordering::Relaxed), &mut buf);
    // SAFETY: PATH is a C string and buf holds len initialised bytes; open/write/close are
    // async-signal-safe and touch only this descriptor.
    unsafe {
        let fd = libc::open(PATH.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, buf.as_ptr().cast(), len);
        libc::close(fd);
        if written != len as isize {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Running and background execs of one sandbox or tenant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ExecCounts {
    pub running: usize,
    pub background: usize,
}

impl ExecCounts {
    fn add(&mut self, background: bool) {
        self.running += 1;
        self.background += usize::from(background);
    }

    fn remove(&mut self, background: bool) {
        self.running = self.running.saturating_sub(1);
        if background {
            self.background = self.background.saturating_sub(1);
        }
    }
}

/// The execs running now, counted per sandbox and per tenant. Entries that reach zero are
/// dropped, so the table is as large as what runs.
#[derive(Debug, Default)]
pub struct ExecSlots {
    sandboxes: HashMap<SandboxId, ExecCounts>,
    tenants: HashMap<String, ExecCounts>,
}

impl ExecSlots {
    /// What runs in `sandbox` now.
    pub fn in_sandbox(&self, sandbox: &SandboxId) -> ExecCounts {
        self.sandboxes.get(sandbox).copied().unwrap_or_default()
    }

    /// What `tenant` runs now, over all its sandboxes.
    pub fn of_tenant(&self, tenant: &str) -> ExecCounts {
        self.tenants.get(tenant).copied().unwrap_or_default()
    }

    /// Claims a slot, or says which cap (by its config key) is reached.
    fn take(&mut self, caps: &ExecCaps, tenant: &str, sandbox: &SandboxId, background: bool) -> Result<(), String> {
        let sb = self.in_sandbox(sandbox);
        let tn = self.of_tenant(tenant);
        let hint = "wait for one to end or stop it with SignalExec";
        if sb.running >= caps.running_per_sandbox {
            return Err(format!(
                "policy.max_running_execs_per_sandbox ({}) reached: sandbox {sandbox} runs {} execs; {hint}",
                caps.running_per_sandbox, sb.running
            ));
        }
        if background && sb.background >= caps.background_per_sandbox {
            return Err(format!(
                "policy.max_background_execs_per_sandbox ({}) reached: sandbox {sandbox} runs {} background execs; {hint}",
                caps.background_per_sandbox, sb.background
            ));
        }
        if tn.running >= caps.running_per_tenant {
            return Err(format!(
                "policy.max_running_execs_per_tenant ({}) reached: tenant {tenant:?} runs {} execs; {hint}",
                caps.running_per_tenant, tn.running
            ));
        }
        if background && tn.background >= caps.background_per_tenant {
            return Err(format!(
                "policy.max_background_execs_per_tenant ({}) reached: tenant {tenant:?} runs {} background execs; {hint}",
                caps.background_per_tenant, tn.background
            ));
        }
        self.sandboxes.entry(sandbox.clone()).or_default().add(background);
        self.tenants.entry(tenant.to_string()).or_default().add(background);
        Ok(())
    }

    fn give_back(&mut self, tenant: &str, sandbox: &SandboxId, background: bool) {
        if let Some(c) = self.sandboxes.get_mut(sandbox) {
            c.remove(background);
            if c.running == 0 {
                self.sandboxes.remove(sandbox);
            }
        }
        if let Some(c) = self.tenants.get_mut(tenant) {
            c.remove(background);
            if c.running == 0 {
                self.tenants.remove(tenant);
            }
        }
    }
}

/// One exec's claim on its slots; dropping it (when the exec has ended, or if it never
/// started) gives them back.
#[derive(Debug)]
pub struct ExecSlot {
    slots: Arc<Mutex<ExecSlots>>,
    tenant: String,
    sandbox: SandboxId,
    background: bool,
}

impl ExecSlot {
    /// Claims a slot for an exec of `tenant` in `sandbox`, or says which cap is reached.
    pub fn take(slots: &Arc<Mutex<ExecSlots>>, caps: &ExecCaps, tenant: &str, sandbox: &SandboxId, background: bool) -> Result<ExecSlot, String> {
        // The counts are plain integers updated without any call that can panic in between, so
        // a poisoned lock still holds consistent numbers.
        slots.lock().unwrap_or_else(|p| p.into_inner()).take(caps, tenant, sandbox, background)?;
        Ok(ExecSlot { slots: slots.clone(), tenant: tenant.to_string(), sandbox: sandbox.clone(), background })
    }
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).give_back(&self.tenant, &self.sandbox, self.background);
    }
}

/// Descriptors the daemon keeps for itself whatever runs: listeners, connections, the store,
/// and each sandbox's control socket, log pipe and cgroup directories.
const FD_RESERVE: u64 = 1024;
/// Descriptors one running exec holds in the daemon (its stdout and stderr pipes on the process
/// tier; a connection on the others).
pub const FDS_PER_EXEC: u64 = 2;

/// The open-file limit after [`raise_nofile_limit`]: soft (now in force) and hard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    pub previous_soft: u64,
    pub soft: u64,
    pub hard: u64,
}

impl NofileLimit {
    /// About how many execs can run at once before the daemon runs out of descriptors.
    pub fn exec_budget(&self) -> u64 {
        self.soft.saturating_sub(FD_RESERVE) / FDS_PER_EXEC
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit (capped by the kernel's `fs.nr_open`, as an
/// unlimited hard limit cannot be a soft one). The default soft limit (often 1024) is a
/// compatibility value for `select(2)`, which the daemon does not use; with it a few hundred
/// running execs end every exec of every tenant with "Too many open files".
pub fn raise_nofile_limit() -> Result<NofileLimit, String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (previous_soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit(RLIMIT_NOFILE): {e}"))?;
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(1 << 20);
    let target = hard.min(nr_open).max(previous_soft);
    if target > previous_soft {
        setrlimit(Resource::RLIMIT_NOFILE, target, hard).map_err(|e| format!("setrlimit(RLIMIT_NOFILE, {target}, {hard}): {e}"))?;
    }
    Ok(NofileLimit { previous_soft, soft: target, hard })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SandboxId {
        SandboxId::parse(s).expect("valid id")
    }

    fn pool(key: &str, capacity: u64) -> DiskPool {
        DiskPool { key: key.into(), capacity, origin: String::new(), path: None, own_mount: false }
    }

    /// Strict pools (overcommit 1.0) of 8 and 100 GiB.
    fn pools() -> DiskPools {
        let strict = AdmissionConfig { disk_overcommit: 1.0, ..Default::default() };
        DiskPools::new(
            vec![pool("pool_size_bytes", 8 << 30), pool("microvm.disk_pool_bytes, container.disk_pool_bytes", 100 << 30)],
            HashMap::from([(Isolation::Process, 0), (Isolation::MicroVm, 1), (Isolation::Container, 1)]),
        )
        .with_admission(&strict)
    }

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn host() -> Host {
        Host { memory_bytes: 24 * GIB, pid_max: 32_768 }
    }

    fn plenty() -> HostNow {
        HostNow { memory_available: Some(20 * GIB), tasks: Some(300) }
    }

    #[test]
    fn an_overcommitted_pool_admits_its_ratio_and_says_it() {
        let cfg = AdmissionConfig { disk_overcommit: 4.0, ..Default::default() };
        let p = DiskPools::new(vec![pool("pool_size_bytes", 8 * GIB)], HashMap::from([(Isolation::Process, 0)])).with_admission(&cfg);
        assert!(p.admit(Isolation::Process, 31 * GIB, GIB).is_ok(), "4 × 8 GiB may be promised");
        let err = p.admit(Isolation::Process, 32 * GIB, GIB).expect_err("past the ratio");
        assert_eq!(err, "storage pool full: 32 GiB of 32 GiB promised to sandboxes (8 GiB pool × admission.disk_overcommit 4); disk_bytes 1 GiB does not fit (pool_size_bytes)");
    }

    #[test]
    fn real_use_warns_then_refuses_naming_the_key() {
        let own = DiskPool { own_mount: true, ..pool("pool_size_bytes", 100 * GIB) };
        let shared = pool("microvm.disk_pool_bytes", 100 * GIB);
        let p = DiskPools::new(vec![own, shared], HashMap::from([(Isolation::Process, 0), (Isolation::MicroVm, 1)]));
        let at = |used: u64| Some(PoolUse { used, size: 100 * GIB });
        assert!(p.admit_use(Isolation::Process, at(79 * GIB)).is_ok());
        assert_eq!(p.pressure(PoolUse { used: 80 * GIB, size: 100 * GIB }), Pressure::Near, "warned from disk_warn");
        assert!(p.admit_use(Isolation::Process, at(89 * GIB)).is_ok(), "still admitted below the high-water mark");
        let err = p.admit_use(Isolation::Process, at(90 * GIB)).expect_err("at the high-water mark");
        assert!(err.contains("admission.disk_high_water (90%)") && err.contains("90 GiB of 100 GiB") && err.contains("pool_size_bytes"), "{err}");
        assert!(p.admit_use(Isolation::Process, None).is_ok(), "unmeasurable: promises alone");
        assert!(p.admit_use(Isolation::MicroVm, at(95 * GIB)).is_ok(), "a shared host filesystem only warns");
    }

    #[test]
    fn a_full_pool_is_named_as_the_cause_not_the_quota() {
        let p = pool("pool_size_bytes", 8 * GIB);
        let full = PoolUse { used: 8 * GIB - 10 * MIB, size: 8 * GIB };
        let msg = explain_full(Some(&p), Some(full), "/workspace/x", 256 * MIB);
        assert!(msg.contains("storage pool is full") && msg.contains("not this sandbox's disk_bytes (256 MiB)") && msg.contains("pool_size_bytes"), "{msg}");
        assert!(!msg.contains("disk_bytes 256 MiB reached"), "{msg}");
        let roomy = PoolUse { used: GIB, size: 8 * GIB };
        let msg = explain_full(Some(&p), Some(roomy), "/workspace/x", 256 * MIB);
        assert_eq!(msg, "the sandbox's disk is full (disk_bytes 256 MiB reached) writing /workspace/x");
    }

    #[test]
    fn memory_and_pids_are_admitted_by_ratio_naming_the_key() {
        let cfg = AdmissionConfig { memory_overcommit: 1.5, pids_overcommit: 1.0, ..Default::default() };
        let b = Budgets::new(host(), cfg);
        assert_eq!(b.memory_capacity(), 34 * GIB + GIB / 2, "(24 − 1) GiB × 1.5");
        assert_eq!(b.pids_capacity(), 32_768 - 2048);
        let big = Limits { memory_bytes: 8 * GIB, max_pids: 4096, ..Limits::DEFAULTS };
        let mut all = Promised::default();
        for _ in 0..4 {
            b.admit(&all, "t", &all, &big, &plenty()).expect("fits");
            all.add(&big);
        }
        let err = b.admit(&all, "t", &all, &big, &plenty()).expect_err("the 5th 8 GiB sandbox");
        assert!(
            err.contains("admission.memory_overcommit 1.5") && err.contains("32 GiB promised") && err.contains("admission.daemon_memory_reserve_bytes"),
            "{err}"
        );
        let many_pids = Limits { max_pids: 16_384, ..Limits::DEFAULTS };
        let half = Promised { max_pids: 16_000, ..Default::default() };
        let err = b.admit(&half, "t", &half, &many_pids, &plenty()).expect_err("pids");
        assert!(err.contains("kernel.pid_max 32768") && err.contains("admission.pids_reserve 2048") && err.contains("max_pids 16384"), "{err}");
    }

    #[test]
    fn the_defaults_admit_a_thousand_default_sandboxes_on_a_24_gib_host() {
        let b = Budgets::new(host(), AdmissionConfig::default());
        let mut all = Promised::default();
        for i in 0..1000 {
            b.admit(&all, "t", &all, &Limits::DEFAULTS, &plenty()).unwrap_or_else(|e| panic!("sandbox {i}: {e}"));
            all.add(&Limits::DEFAULTS);
        }
        // 25 GB free (what this machine had left under load): a 12.5 GB pool file, promised 100
        // times over.
        let cfg = AdmissionConfig::default();
        let p = DiskPools::new(vec![pool("pool_size_bytes", 12_500_000_000)], HashMap::from([(Isolation::Process, 0)])).with_admission(&cfg);
        assert!(p.admit(Isolation::Process, 999 * GIB, GIB).is_ok());
    }

    #[test]
    fn tenant_quotas_and_real_use_refuse_naming_the_key() {
        let cfg = AdmissionConfig {
            max_memory_bytes_per_tenant: Some(GIB),
            max_pids_per_tenant: Some(600),
            max_disk_bytes_per_tenant: Some(2 * GIB),
            ..Default::default()
        };
        let b = Budgets::new(host(), cfg);
        let l = Limits::DEFAULTS;
        let mut mine = Promised::default();
        mine.add(&l);
        mine.add(&l);
        let err = b.admit(&mine, "a", &mine, &l, &plenty()).expect_err("3rd 512 MiB of a 1 GiB tenant quota");
        assert!(err.contains("admission.max_memory_bytes_per_tenant (1 GiB)") && err.contains("\"a\""), "{err}");
        assert!(b.admit(&mine, "b", &Promised::default(), &l, &plenty()).is_ok(), "another tenant");
        let small = Limits { memory_bytes: 64 * MIB, ..l };
        let err = b.admit(&mine, "a", &Promised { max_pids: 512, ..Default::default() }, &small, &plenty()).expect_err("pids");
        assert!(err.contains("admission.max_pids_per_tenant (600)"), "{err}");
        let err = b.admit(&mine, "a", &Promised { disk_bytes: 2 * GIB, ..Default::default() }, &small, &plenty()).expect_err("disk");
        assert!(err.contains("admission.max_disk_bytes_per_tenant (2 GiB)"), "{err}");
        let low = HostNow { memory_available: Some(512 * MIB), tasks: Some(300) };
        let err = b.admit(&Promised::default(), "c", &Promised::default(), &small, &low).expect_err("memory really short");
        assert!(err.contains("admission.daemon_memory_reserve_bytes (1 GiB)") && err.contains("512 MiB available"), "{err}");
        let busy = HostNow { memory_available: Some(20 * GIB), tasks: Some(31_000) };
        let err = b.admit(&Promised::default(), "c", &Promised::default(), &small, &busy).expect_err("pids really short");
        assert!(err.contains("admission.pids_reserve (2048)") && err.contains("31000 of kernel.pid_max 32768"), "{err}");
        assert_eq!(b.pressure(&HostNow { memory_available: Some(1536 * MIB), tasks: Some(29_000) }), (Pressure::Near, Pressure::Near));
        assert_eq!(b.pressure(&plenty()), (Pressure::Ok, Pressure::Ok));
    }

    #[test]
    fn pressure_is_logged_on_change_only() {
        let log = PressureLog::default();
        assert!(!log.note("memory", Pressure::Ok, "fine"), "ok at first says nothing");
        assert!(log.note("memory", Pressure::Near, "1.5 GiB"));
        assert!(!log.note("memory", Pressure::Near, "1.4 GiB"), "once per change");
        assert!(log.note("memory", Pressure::Over, "0.9 GiB"));
        assert!(log.note("memory", Pressure::Ok, "back"));
    }

    #[test]
    fn meminfo_fields_parse() {
        let text = "MemTotal:       24683584 kB\nMemFree:        21274800 kB\nMemAvailable:   23728660 kB\n";
        assert_eq!(meminfo(text, "MemTotal"), Some(24_683_584 * 1024));
        assert_eq!(meminfo(text, "MemAvailable"), Some(23_728_660 * 1024));
        assert_eq!(meminfo(text, "Mem"), None);
        let now = HostNow::measure();
        assert!(now.memory_available.is_some_and(|m| m > 0) && now.tasks.is_some_and(|t| t > 0), "{now:?}");
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(16 << 20), "16 MiB");
        assert_eq!(human_bytes(8 << 30), "8 GiB");
        assert_eq!(human_bytes((15 << 30) / 2), "7.5 GiB");
    }

    #[test]
    fn a_pool_admits_up_to_its_capacity_and_names_its_key() {
        let p = pools();
        assert!(p.admit(Isolation::Process, 7 << 30, 1 << 30).is_ok(), "exactly full is fine");
        let err = p.admit(Isolation::Process, (15 << 30) / 2, 1 << 30).expect_err("over");
        assert_eq!(err, "storage pool full: 7.5 GiB of 8 GiB promised to sandboxes; disk_bytes 1 GiB does not fit (pool_size_bytes)");
        let err = p.admit(Isolation::Process, 0, 64 << 30).expect_err("larger than the pool");
        assert!(err.contains("pool_size_bytes"), "{err}");
        assert!(p.admit(Isolation::MicroVm, 0, 64 << 30).is_ok(), "another pool");
        assert!(p.admit(Isolation::Process, u64::MAX, u64::MAX).is_err(), "no overflow");
    }

    #[test]
    fn tiers_on_one_filesystem_share_a_pool() {
        let p = pools();
        assert!(p.same_pool(Isolation::MicroVm, Isolation::Container));
        assert!(!p.same_pool(Isolation::Process, Isolation::MicroVm));
        let listed = p.pools();
        assert_eq!(listed[1].1, vec![Isolation::Container, Isolation::MicroVm]);
        let unpooled = DiskPools::default();
        assert!(unpooled.usage(Isolation::Process).is_none());
        assert!(unpooled.admit(Isolation::Container, u64::MAX, 1).is_ok(), "a tier without a pool is not disk-admitted");
    }

    #[test]
    fn decimals_are_written_without_allocating() {
        for v in [0, 7, 500, -900, -1000, 1000, i32::MIN, i32::MAX] {
            let mut buf = [0u8; 12];
            let n = decimal(v, &mut buf);
            assert_eq!(std::str::from_utf8(&buf[..n]).ok(), Some(v.to_string().as_str()));
        }
    }

    #[test]
    fn a_child_gets_the_sandbox_oom_score_adj() {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("cat");
        cmd.arg("/proc/self/oom_score_adj");
        // SAFETY: the hook only makes async-signal-safe calls (open, write, close) on static
        // data.
        unsafe {
            cmd.pre_exec(set_sandbox_oom_score_adj_in_child);
        }
        let out = cmd.output().expect("cat");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "500", "the built-in default");
    }

    #[test]
    fn a_configured_pool_size_is_used_as_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cli = crate::config::Cli { state_dir: Some(dir.path().to_path_buf()), pool_size_bytes: Some(8 << 30), ..Default::default() };
        let mut cfg = Config::load(cli).expect("config");
        cfg.microvm.disk_pool_bytes = Some(3 << 30);
        cfg.container.disk_pool_bytes = Some(5 << 30);
        let p = DiskPools::from_config(&cfg);
        assert_eq!(p.pool_of(Isolation::Process).map(|p| p.capacity), Some(8 << 30));
        assert_eq!(p.pool_of(Isolation::MicroVm).map(|p| (p.capacity, p.key.as_str())), Some((3 << 30, "microvm.disk_pool_bytes")));
        assert_eq!(p.pool_of(Isolation::Container).map(|p| p.capacity), Some(5 << 30));
        assert!(!p.same_pool(Isolation::MicroVm, Isolation::Container), "configured pools stand alone");
        // Unset: the size of the filesystem, measured.
        cfg.microvm.disk_pool_bytes = None;
        let p = DiskPools::from_config(&cfg);
        let fs = measure(dir.path()).expect("statvfs");
        assert_eq!(p.pool_of(Isolation::MicroVm).map(|p| p.capacity), Some(fs.size));
        assert!(fs.size > 0);
    }

    #[test]
    fn exec_slots_cap_per_sandbox_and_tenant_and_free_on_drop() {
        let caps = ExecCaps { running_per_sandbox: 3, background_per_sandbox: 2, running_per_tenant: 4, background_per_tenant: 3 };
        let slots = Arc::new(Mutex::new(ExecSlots::default()));
        let (a, b) = (sid("sb-aaaaaaaaaaaa"), sid("sb-bbbbbbbbbbbb"));
        let bg1 = ExecSlot::take(&slots, &caps, "t", &a, true).expect("bg 1");
        let _bg2 = ExecSlot::take(&slots, &caps, "t", &a, true).expect("bg 2");
        let err = ExecSlot::take(&slots, &caps, "t", &a, true).expect_err("bg cap");
        assert!(err.contains("policy.max_background_execs_per_sandbox (2)"), "{err}");
        let _fg = ExecSlot::take(&slots, &caps, "t", &a, false).expect("a foreground exec still fits");
        let err = ExecSlot::take(&slots, &caps, "t", &a, false).expect_err("running cap");
        assert!(err.contains("policy.max_running_execs_per_sandbox (3)"), "{err}");
        let _other = ExecSlot::take(&slots, &caps, "t", &b, false).expect("another sandbox");
        let err = ExecSlot::take(&slots, &caps, "t", &b, false).expect_err("tenant cap");
        assert!(err.contains("policy.max_running_execs_per_tenant (4)"), "{err}");
        assert!(ExecSlot::take(&slots, &caps, "u", &b, false).is_ok(), "another tenant is not affected");
        drop(bg1);
        let counts = slots.lock().map(|s| s.in_sandbox(&a)).expect("lock");
        assert_eq!(counts, ExecCounts { running: 2, background: 1 }, "an ended exec frees its slot");
        assert!(ExecSlot::take(&slots, &caps, "t", &b, true).is_ok(), "room again");
    }

    #[test]
    fn slots_of_ended_execs_leave_no_entries() {
        let slots = Arc::new(Mutex::new(ExecSlots::default()));
        let a = sid("sb-aaaaaaaaaaaa");
        drop(ExecSlot::take(&slots, &ExecCaps::DEFAULTS, "t", &a, true).expect("slot"));
        let s = slots.lock().expect("lock");
        assert!(s.sandboxes.is_empty() && s.tenants.is_empty());
    }

    #[test]
    fn nofile_budget() {
        let l = NofileLimit { previous_soft: 1024, soft: 20_000, hard: 20_000 };
        assert_eq!(l.exec_budget(), (20_000 - FD_RESERVE) / 2);
        assert_eq!(NofileLimit { previous_soft: 10, soft: 10, hard: 10 }.exec_budget(), 0);
    }
}
