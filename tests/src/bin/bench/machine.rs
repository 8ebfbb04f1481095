//! The machine the bench ran on, for the report's first table.

use std::path::Path;
use std::time::SystemTime;

use sandbox_tests::{sandboxd_bin, workspace_root};

use crate::results::Report;

#[derive(Debug, Default)]
pub(crate) struct Machine {
    pub(crate) date: String,
    pub(crate) nproc: usize,
    cpu: String,
    memory: String,
    os: String,
    kernel: String,
    cgroups: String,
    load_start: String,
    pub(crate) load_end: String,
    pub(crate) sandboxd_bin: String,
    commit: String,
    /// `qemu-system-x86_64 --version` and whether /dev/kvm exists (the microVM tier).
    qemu: String,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_else(|_| "unknown".into())
}

/// The value of the first `key: value` (or `key=value`) line of a file.
fn field_of(path: &str, key: &str, sep: char) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(sep)?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}

pub(crate) fn loadavg() -> String {
    read_trimmed("/proc/loadavg").split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

impl Machine {
    pub(crate) fn probe() -> Self {
        let cgroups = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            "v2 (unified)".to_string()
        } else if Path::new("/sys/fs/cgroup/unified").exists() {
            "v1 (hybrid: v1 controllers under /sys/fs/cgroup/<controller>, an empty v2 at /sys/fs/cgroup/unified)".to_string()
        } else {
            "v1".to_string()
        };
        let commit = std::process::Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let dirty = std::process::Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(["status", "--porcelain", "--untracked-files=no"])
            .output()
            .ok()
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false);
        let qemu_version = std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string));
        let qemu = format!(
            "{}; /dev/kvm {}",
            qemu_version.unwrap_or_else(|| "qemu-system-x86_64 not found".into()),
            if Path::new("/dev/kvm").exists() { "present" } else { "absent" }
        );
        Machine {
            qemu,
            date: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            cpu: field_of("/proc/cpuinfo", "model name", ':').unwrap_or_else(|| "unknown".into()),
            memory: field_of("/proc/meminfo", "MemTotal", ':')
                .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| format!("{:.1} GiB", kb as f64 / (1u64 << 20) as f64))
                .unwrap_or_else(|| "unknown".into()),
            os: field_of("/etc/os-release", "PRETTY_NAME", '=').unwrap_or_else(|| "unknown".into()),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            cgroups,
            load_start: loadavg(),
            load_end: String::new(),
            sandboxd_bin: sandboxd_bin().map(|p| p.display().to_string()).unwrap_or_else(|e| format!("not found: {e}")),
            commit: match commit {
                Some(c) if dirty => format!("{c} with uncommitted changes"),
                Some(c) => c,
                None => "unknown (not a git checkout)".into(),
            },
        }
    }

    pub(crate) fn rows(&self, report: &Report) -> Vec<(&'static str, String)> {
        let docker = match (&report.docker, &report.docker_unavailable) {
            (_, Some(why)) => format!("unavailable: {why}"),
            (Some(v), None) => v.clone(),
            (None, None) => "not measured".into(),
        };
        vec![
            ("date (UTC)", self.date.clone()),
            ("CPUs (nproc)", self.nproc.to_string()),
            ("CPU", self.cpu.clone()),
            ("memory", self.memory.clone()),
            ("OS", self.os.clone()),
            ("kernel", self.kernel.clone()),
            ("cgroups", self.cgroups.clone()),
            ("load average (1, 5, 15 min) before → after", format!("{} → {}", self.load_start, self.load_end)),
            ("sandboxd", format!("{} (commit {})", self.sandboxd_bin, self.commit)),
            ("Docker", docker),
            ("QEMU (microVM tier)", self.qemu.clone()),
        ]
    }
}
