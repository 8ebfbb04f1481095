//! The guest's cgroups (v2 only: the agent mounts the hierarchy itself).
//!
//! ```text
//! /run/sandboxd/cgroup/        the whole hierarchy, the agent's (PID 1 stays in the root)
//!   sandbox/                   Configure's limits: memory.max, pids.max, cpu.max
//!     <exec id>/               one per exec: usage, OOM count, and a kill that reaches all
//! ```
//!
//! Limits sit on `sandbox/` so every exec shares them, as in the other tiers; each exec gets its
//! own child for per-exec accounting and for `cgroup.kill`, which reaches every descendant even
//! after it daemonized, with no pid-reuse race.
//!
//! What the sandbox's programs see at `/sys/fs/cgroup` is `sandbox/`, bound read-only ([`VIEW`]):
//! its `memory.max` is the sandbox's limit, as on the other tiers. Guest root could remount it
//! (it holds every capability in its own kernel); the microVM's boundary is the VM, not this.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guest_agent::protocol::GuestLimits;

use crate::agent::console::log;

/// Where the agent mounts cgroup2 for itself.
pub const MOUNT: &str = "/run/sandboxd/cgroup";
/// Where programs in the sandbox look for their cgroup: the sandbox's own, read-only.
pub const VIEW: &str = "/sys/fs/cgroup";
const SANDBOX: &str = "sandbox";
const CONTROLLERS: &str = "+cpu +memory +pids";
const CPU_PERIOD_US: u64 = 100_000;
/// The kernel refuses CFS quotas below 1 ms.
const MIN_CPU_QUOTA_US: u64 = 1_000;
/// Dying tasks keep a cgroup populated for a moment after the kill.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A cgroupfs operation that failed, with the file it was about.
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {source}")]
pub struct CgroupError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError { op, path: path.to_path_buf(), source }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    // One write(2) per value: cgroupfs parses each write on its own.
    OpenOptions::new().write(true).open(path).and_then(|mut f| f.write_all(value.as_bytes())).map_err(err("write", path))
}

/// The `sandbox` cgroup every exec runs under.
#[derive(Debug, Clone)]
pub struct SandboxCgroup {
    dir: PathBuf,
}

impl SandboxCgroup {
    /// Creates `sandbox/` under the cgroup2 mount at `mount` and enables the cpu, memory and pids
    /// controllers for it and for the execs below it.
    pub fn create(mount: &Path) -> Result<Self, CgroupError> {
        write(&mount.join("cgroup.subtree_control"), CONTROLLERS)?;
        let dir = mount.join(SANDBOX);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(err("mkdir", &dir)(e)),
        }
        write(&dir.join("cgroup.subtree_control"), CONTROLLERS)?;
        Ok(SandboxCgroup { dir })
    }

    /// The sandbox's cgroup directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Applies the sandbox's limits; 0 means no limit for that resource.
    pub fn configure(&self, limits: &GuestLimits) -> Result<(), CgroupError> {
        let memory = if limits.memory_bytes == 0 { "max".to_string() } else { limits.memory_bytes.to_string() };
        let pids = if limits.max_pids == 0 { "max".to_string() } else { limits.max_pids.to_string() };
        write(&self.dir.join("memory.max"), &memory)?;
        write(&self.dir.join("pids.max"), &pids)?;
        write(&self.dir.join("cpu.max"), &cpu_max(limits.cpu_millicores))?;
        Ok(())
    }

    /// Makes the cgroup of one exec. `name` must already be a valid directory name.
    pub fn create_exec(&self, name: &str) -> Result<ExecCgroup, CgroupError> {
        let dir = self.dir.join(name);
        if dir.exists() {
            // Left over from an exec of the same id whose cleanup failed: start clean.
            let stale = ExecCgroup { dir: dir.clone() };
            stale.kill();
            stale.remove();
        }
        std::fs::create_dir(&dir).map_err(err("mkdir", &dir))?;
        Ok(ExecCgroup { dir })
    }
}

/// `cpu.max` for a number of thousandths of a CPU.
fn cpu_max(millicores: u32) -> String {
    if millicores == 0 {
        return format!("max {CPU_PERIOD_US}");
    }
    let quota = (u64::from(millicores) * CPU_PERIOD_US / 1000).max(MIN_CPU_QUOTA_US);
    format!("{quota} {CPU_PERIOD_US}")
}

/// Usage of one exec's cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub peak_memory_bytes: u64,
    pub oom_kills: u64,
}

/// The cgroup of one exec.
#[derive(Debug)]
pub struct ExecCgroup {
    dir: PathBuf,
}

impl ExecCgroup {
    /// `cgroup.procs`, opened for the child to write "0" into between fork and exec.
    pub fn procs_file(&self) -> Result<File, CgroupError> {
        let path = self.dir.join("cgroup.procs");
        // Rust opens with O_CLOEXEC: the child's execve closes it.
        OpenOptions::new().write(true).open(&path).map_err(err("open", &path))
    }

    /// Pids of every process in this cgroup (and below, should a command create sub-cgroups).
    pub fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        collect_pids(&self.dir, &mut out);
        out
    }

    /// Sends `signal` to every process of the exec.
    ///
    /// The cgroup is frozen while the pids are read and signalled, so a process forked in
    /// between cannot escape the signal (a background child of a shell that is being killed
    /// would otherwise outlive it); it is thawed again afterwards.
    pub fn signal(&self, signal: i32) {
        let frozen = self.set_frozen(true);
        for pid in self.pids() {
            // SAFETY: kill(2) with plain integers; a pid that is gone gives ESRCH, ignored.
            unsafe { libc::kill(pid, signal) };
        }
        if frozen {
            self.set_frozen(false);
        }
    }

    /// Freezes or thaws the cgroup (cgroup.freeze) and waits, bounded, until it is so.
    fn set_frozen(&self, frozen: bool) -> bool {
        if let Err(e) = write(&self.dir.join("cgroup.freeze"), if frozen { "1" } else { "0" }) {
            log!("{e}");
            return false;
        }
        let want = u64::from(frozen);
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut pause = Duration::from_micros(100);
        while std::fs::read_to_string(self.dir.join("cgroup.events")).ok().and_then(|s| keyed(&s, "frozen")) != Some(want) {
            if Instant::now() >= deadline {
                log!("cgroup {} not {} after {} ms", self.dir.display(), if frozen { "frozen" } else { "thawed" }, DRAIN_TIMEOUT.as_millis());
                return frozen;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
        true
    }

    /// Kills every process of the exec (atomic against forks) and waits, bounded, until the
    /// cgroup is empty.
    pub fn kill(&self) {
        let path = self.dir.join("cgroup.kill");
        if let Err(e) = write(&path, "1") {
            log!("{e}");
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut pause = Duration::from_micros(200);
        while self.populated() {
            if Instant::now() >= deadline {
                log!("cgroup {} still populated {} ms after cgroup.kill", self.dir.display(), DRAIN_TIMEOUT.as_millis());
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// True while any process is in the cgroup.
    pub fn is_populated(&self) -> bool {
        self.populated()
    }

    fn populated(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events")).ok().and_then(|s| keyed(&s, "populated")).unwrap_or(0) != 0
    }

    /// CPU time, peak memory and OOM kills so far.
    pub fn usage(&self) -> Usage {
        let read = |file: &str| std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        let cpu = read("cpu.stat");
        let events = read("memory.events");
        Usage {
            cpu_user_ms: keyed(&cpu, "user_usec").unwrap_or(0) / 1000,
            cpu_system_ms: keyed(&cpu, "system_usec").unwrap_or(0) / 1000,
            peak_memory_bytes: read("memory.peak").trim().parse().unwrap_or(0),
            oom_kills: keyed(&events, "oom_kill").unwrap_or(0),
        }
    }

    /// Removes the (empty) cgroup, and any sub-cgroups a command made, deepest first.
    pub fn remove(&self) {
        if let Err(e) = remove_tree(&self.dir) {
            log!("removing cgroup {}: {e}", self.dir.display());
        }
    }
}

fn remove_tree(dir: &Path) -> io::Result<()> {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&entry.path())?;
            }
        }
    }
    // A cgroup whose last task was just reaped can be busy for a moment.
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(e),
        }
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(s) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_pids(&entry.path(), out);
            }
        }
    }
}

/// The value of `key` in a flat-keyed cgroup file ("key value" per line).
fn keyed(content: &str, key: &str) -> Option<u64> {
    content.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        if k == key {
            v.trim().parse().ok()
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_max_scales_millicores_and_respects_the_kernel_minimum() {
        assert_eq!(cpu_max(0), "max 100000");
        assert_eq!(cpu_max(500), "50000 100000");
        assert_eq!(cpu_max(2000), "200000 100000");
        assert_eq!(cpu_max(1), "1000 100000");
    }

    #[test]
    fn keyed_files_parse_by_exact_key() {
        let stat = "usage_usec 3500\nuser_usec 2000\nsystem_usec 1500\n";
        assert_eq!(keyed(stat, "user_usec"), Some(2000));
        assert_eq!(keyed(stat, "system_usec"), Some(1500));
        assert_eq!(keyed("oom 1\noom_kill 2\n", "oom_kill"), Some(2));
        assert_eq!(keyed("oom_kill_x 2\n", "oom_kill"), None);
    }

    #[test]
    fn configure_writes_the_limit_files_of_the_sandbox_cgroup() {
        // A plain directory stands in for cgroupfs (whose files always exist): the writes are
        // what is checked.
        let root = tempfile::tempdir().expect("tempdir");
        let files = ["cgroup.subtree_control", "memory.max", "pids.max", "cpu.max"];
        let blank = |dir: &Path| files.iter().for_each(|f| std::fs::write(dir.join(f), "").expect("write"));
        std::fs::create_dir(root.path().join(SANDBOX)).expect("mkdir");
        blank(root.path());
        blank(&root.path().join(SANDBOX));
        let cg = SandboxCgroup::create(root.path()).expect("create");
        cg.configure(&GuestLimits {
            memory_bytes: 256 << 20,
            max_pids: 64,
            cpu_millicores: 1500,
            hostname: String::new(),
            workdir: String::new(),
            shm_bytes: 0,
            network: None,
            machine_id: String::new(),
        })
        .expect("configure");
        let read = |f: &str| std::fs::read_to_string(root.path().join(SANDBOX).join(f)).expect("read");
        assert_eq!(read("memory.max"), "268435456");
        assert_eq!(read("pids.max"), "64");
        assert_eq!(read("cpu.max"), "150000 100000");
        assert_eq!(read("cgroup.subtree_control"), "+cpu +memory +pids");
        blank(&root.path().join(SANDBOX));
        cg.configure(&GuestLimits {
            memory_bytes: 0,
            max_pids: 0,
            cpu_millicores: 0,
            hostname: String::new(),
            workdir: String::new(),
            shm_bytes: 0,
            network: None,
            machine_id: String::new(),
        })
        .expect("configure");
        assert_eq!(read("memory.max"), "max");
        assert_eq!(read("pids.max"), "max");
    }
}
