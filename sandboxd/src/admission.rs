//! Admission: what the daemon promises before it says yes, so that no sandbox or tenant can take
//! what every other one was promised.
//!
//! * **Disk.** Every sandbox draws its `disk_bytes` from one storage pool. The sum of the
//!   `disk_bytes` of the sandboxes of a pool (creating, running or failed: until destroyed, each
//!   keeps its writable layer), plus a new request, never exceeds the pool's capacity; past it a
//!   create is RESOURCE_EXHAUSTED naming the config key that sizes the pool. Otherwise one
//!   sandbox filling its quota could fill the pool and every other sandbox would get `ENOSPC`
//!   well under its own quota. Snapshots are not promised: a snapshot holds at most what its
//!   sandbox had written, within that sandbox's quota, and is freed by DeleteSnapshot.
//! * **Exec slots.** Each running exec holds daemon resources (on the process tier two pipe
//!   descriptors, on every tier an output buffer and a task), so running and background execs
//!   are capped per sandbox and per tenant (`[policy]`, see [`ExecCaps`]). An exec holds its
//!   slot until its process has ended.
//!
//! The pools, per tier:
//!
//! | tier | pool | capacity |
//! |---|---|---|
//! | PROCESS | the btrfs pool file (`<state_dir>/pool`) | `pool_size_bytes` |
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
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::ids::SandboxId;
use crate::model::Isolation;
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
}

/// The daemon's disk pools and which tier draws from which. A tier without a pool (its size
/// could not be measured; logged) is not disk-admitted.
#[derive(Debug, Clone, Default)]
pub struct DiskPools {
    pools: Vec<DiskPool>,
    by_tier: HashMap<Isolation, usize>,
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

impl DiskPools {
    /// Pools from explicit parts (tests, and [`DiskPools::from_config`]).
    pub fn new(pools: Vec<DiskPool>, by_tier: HashMap<Isolation, usize>) -> Self {
        DiskPools { pools, by_tier }
    }

    /// The pools this configuration gives, measuring the filesystems of the tiers whose
    /// capacity is not configured (see the module doc for the rule).
    pub fn from_config(cfg: &Config) -> Self {
        let mut pools = vec![DiskPool {
            key: "pool_size_bytes".into(),
            capacity: cfg.pool_size_bytes,
            origin: format!("the btrfs pool file under {}", cfg.state_dir.join("pool").display()),
        }];
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
                pools.push(DiskPool { key: key.into(), capacity, origin: "configured".into() });
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
            pools.push(DiskPool { key: key.into(), capacity: fs.size, origin });
            by_tier.insert(tier, pools.len() - 1);
            by_dev.insert(fs.dev, pools.len() - 1);
        }
        DiskPools { pools, by_tier }
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

    /// Whether `disk_bytes` more fits the pool of `tier`, which has `promised` bytes promised
    /// already; else the sentence to refuse with.
    pub fn admit(&self, tier: Isolation, promised: u64, disk_bytes: u64) -> Result<(), String> {
        let Some(pool) = self.pool_of(tier) else { return Ok(()) };
        if promised.saturating_add(disk_bytes) <= pool.capacity {
            return Ok(());
        }
        Err(format!(
            "storage pool full: {} of {} promised to sandboxes; disk_bytes {} does not fit ({})",
            human_bytes(promised),
            human_bytes(pool.capacity),
            human_bytes(disk_bytes),
            pool.key
        ))
    }
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

    fn pools() -> DiskPools {
        DiskPools::new(
            vec![
                DiskPool { key: "pool_size_bytes".into(), capacity: 8 << 30, origin: String::new() },
                DiskPool { key: "microvm.disk_pool_bytes, container.disk_pool_bytes".into(), capacity: 100 << 30, origin: String::new() },
            ],
            HashMap::from([(Isolation::Process, 0), (Isolation::MicroVm, 1), (Isolation::Container, 1)]),
        )
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
        assert!(unpooled.admit(Isolation::Container, u64::MAX, 1).is_ok(), "a tier without a pool is not disk-admitted");
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
