//! What the host shows of a daemon and its sandboxes: mounts, cgroups, processes' memory, files
//! below a directory, free ports, names no other run uses.

use std::fs::FileType;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};

use crate::Daemon;

/// Whether `path` is a mount point (from /proc/self/mountinfo).
pub fn mounted(path: &Path) -> bool {
    mounts_under(path).iter().any(|m| m == path)
}

/// Mount points at or below `path`.
pub fn mounts_under(path: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().filter_map(|l| l.split(' ').nth(4)).map(PathBuf::from).filter(|m| m.starts_with(path)).collect()
}

/// Mount points under the daemon's state dir that belong to `sandbox_id`.
pub fn mounts_of(daemon: &Daemon, sandbox_id: &str) -> Vec<PathBuf> {
    mounts_under(&daemon.state_dir()).into_iter().filter(|m| m.to_string_lossy().contains(sandbox_id)).collect()
}

/// Entries below `root`, recursively and never following symlinks, that `wanted` accepts (it
/// is given each entry's path and type).
pub fn find_under(root: &Path, wanted: impl Fn(&Path, &FileType) -> bool) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(ft) = entry.file_type() else { continue };
            let path = entry.path();
            if wanted(&path, &ft) {
                found.push(path.clone());
            }
            if ft.is_dir() {
                stack.push(path);
            }
        }
    }
    found
}

/// Directories under `root` (recursively, not following symlinks) whose name contains `needle`.
pub fn dirs_named(root: &Path, needle: &str) -> Vec<PathBuf> {
    find_under(root, |path, ft| ft.is_dir() && path.file_name().is_some_and(|n| n.to_string_lossy().contains(needle)))
}

/// Cgroup directories anywhere under /sys/fs/cgroup (every v1 controller and the v2 tree) that
/// are named after `sandbox_id`.
pub fn cgroups_of(sandbox_id: &str) -> Vec<PathBuf> {
    dirs_named(Path::new("/sys/fs/cgroup"), sandbox_id)
}

/// A `/proc/<pid>/status` field given in kB (`VmRSS:`, `VmHWM:` …), in bytes.
pub fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident memory of a process, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    proc_status_bytes(pid, "VmRSS:")
}

/// The highest resident memory of a process, sampled in the background until [`PeakRss::stop`].
pub struct PeakRss {
    done: Arc<AtomicBool>,
    sampler: tokio::task::JoinHandle<u64>,
}

impl PeakRss {
    /// Starts sampling `pid`'s RSS every `every` (an unreadable sample counts as 0).
    pub fn start(pid: u32, every: Duration) -> PeakRss {
        let done = Arc::new(AtomicBool::new(false));
        let sampler = {
            let done = done.clone();
            tokio::spawn(async move {
                let mut peak = 0;
                while !done.load(Ordering::Relaxed) {
                    peak = peak.max(rss_bytes(pid).unwrap_or(0));
                    tokio::time::sleep(every).await;
                }
                peak
            })
        };
        PeakRss { done, sampler }
    }

    /// Stops sampling; the highest RSS seen, in bytes.
    pub async fn stop(self) -> u64 {
        self.done.store(true, Ordering::Relaxed);
        self.sampler.await.expect("the RSS sampler panicked")
    }
}

/// A TCP port free right now on 127.0.0.1 (for a daemon listener), below the kernel's ephemeral
/// range: a listener bound to port 0 (the daemon's own egress listeners, anything else on the
/// host) is never given it between this probe and the daemon's bind, as it could be a port the
/// kernel handed out for port 0 and took back.
pub fn free_port() -> Result<u16> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    if ephemeral_low <= FIRST + 1 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding a probe socket")?;
        return Ok(l.local_addr()?.port());
    }
    let span = u32::from(ephemeral_low - FIRST);
    // Spread over the range by process (test binaries run one after another, tests within one
    // in parallel: the counter keeps those apart).
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..span {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (seed.wrapping_add(i.wrapping_mul(7_919)) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port on 127.0.0.1 between {FIRST} and {ephemeral_low}")
}

/// `<prefix>-<pid>-<nanoseconds>`: a name (of a host file, a label) no other run uses.
pub fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The owner label sandboxd puts on its containers: FNV-1a 64 of its state dir (see
/// `sandboxd::backend::container::docker::owner_of`).
pub fn owner_label(state_dir: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Removes every container of the daemon that used `state_dir` (from a plain thread: this runs
/// in `Drop`, possibly inside a runtime).
pub fn remove_containers_of(state_dir: &std::path::Path) {
    let owner = owner_label(state_dir);
    let cleanup = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async move {
            let Ok(docker) = bollard::Docker::connect_with_local_defaults() else { return };
            let Ok(docker) = docker.negotiate_version().await else { return };
            let filters = std::collections::HashMap::from([("label".to_string(), vec![format!("sandboxd.owner={owner}")])]);
            let options = bollard::query_parameters::ListContainersOptions { all: true, filters: Some(filters), ..Default::default() };
            for c in docker.list_containers(Some(options)).await.unwrap_or_default() {
                if let Some(id) = c.id {
                    let rm = bollard::query_parameters::RemoveContainerOptions { force: true, v: true, ..Default::default() };
                    let _ = docker.remove_container(&id, Some(rm)).await;
                }
            }
        });
    });
    let _ = cleanup.join();
}

/// The host pid of the one process whose command line is exactly `argv`.
pub fn host_pid_of(argv: &[&str]) -> Option<i32> {
    let want: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        (std::fs::read(e.path().join("cmdline")).ok()? == want).then_some(pid)
    })
}
