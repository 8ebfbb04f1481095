//! The cgroup a build's RUN steps run under.
//!
//! Docker's build API bounds each RUN step's container on its own (memory, CPU, `/dev/shm`) but
//! has no pids limit; what it has is `cgroupparent`, the cgroup every step's container is made
//! under. With Docker's `cgroupfs` driver that is a path below each hierarchy's root: the daemon
//! makes `sandboxd-build-<id>` there first, with `pids.max` (and the memory limit again, for
//! the steps together), so a fork bomb in a RUN step stops at the build's bound, not the host's
//! `pid_max`. Dropping it kills whatever is still inside (a build that timed out) and removes
//! the directories Docker made below it in every hierarchy.

use std::path::{Path, PathBuf};

use super::ImageError;

/// Where cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A build's cgroup parent (see the module documentation).
#[derive(Debug)]
pub struct BuildCgroup {
    name: String,
    root: PathBuf,
}

impl BuildCgroup {
    /// Makes the parent cgroup `sandboxd-build-<id>` with `max_pids` processes and
    /// `memory_bytes` of memory for all the build's steps together. Cgroup v1 (a hierarchy per
    /// controller) and v2 (one, `cgroup.controllers` at the root) alike.
    pub fn create(id: &str, max_pids: u32, memory_bytes: u64) -> Result<Self, ImageError> {
        Self::create_in(Path::new(CGROUP_ROOT), id, max_pids, memory_bytes)
    }

    fn create_in(root: &Path, id: &str, max_pids: u32, memory_bytes: u64) -> Result<Self, ImageError> {
        let cg = BuildCgroup { name: format!("sandboxd-build-{id}"), root: root.to_path_buf() };
        let limits: Vec<(PathBuf, &str, String)> = if root.join("cgroup.controllers").is_file() {
            let dir = root.join(&cg.name);
            vec![(dir.clone(), "pids.max", max_pids.to_string()), (dir, "memory.max", memory_bytes.to_string())]
        } else {
            vec![
                (root.join("pids").join(&cg.name), "pids.max", max_pids.to_string()),
                (root.join("memory").join(&cg.name), "memory.limit_in_bytes", memory_bytes.to_string()),
            ]
        };
        for (dir, file, value) in limits {
            let fail = |e: std::io::Error| ImageError::io(format!("setting {file} of the build's cgroup {}", dir.display()), e);
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(fail(e)),
            }
            std::fs::write(dir.join(file), value).map_err(fail)?;
        }
        Ok(cg)
    }

    /// The `cgroupparent` of the build request.
    pub fn parent(&self) -> String {
        format!("/{}", self.name)
    }

    /// The directories of this cgroup in every hierarchy.
    fn dirs(&self) -> Vec<PathBuf> {
        let mut out = vec![self.root.join(&self.name)];
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            out.extend(entries.flatten().map(|e| e.path().join(&self.name)));
        }
        out.retain(|d| d.is_dir());
        out
    }

    /// SIGKILL to every process left in the cgroup (a step of a build that was stopped).
    fn kill_all(&self) {
        for dir in self.dirs() {
            for procs in walk(&dir).into_iter().map(|d| d.join("cgroup.procs")) {
                let Ok(text) = std::fs::read_to_string(&procs) else { continue };
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }
}

impl Drop for BuildCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for dir in self.dirs() {
            // Deepest first: a cgroup directory goes only once it has no children.
            let mut all = walk(&dir);
            all.reverse();
            for d in all {
                if let Err(e) = std::fs::remove_dir(&d) {
                    tracing::warn!(cgroup = %d.display(), error = %e, "removing a build's cgroup");
                }
            }
        }
    }
}

/// `dir` and every directory below it, parents first.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if let Ok(entries) = std::fs::read_dir(&out[i]) {
            out.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_are_written_and_everything_is_removed() {
        // A fake v1 layout (plain directories; cgroupfs would make the files itself).
        let tmp = tempfile::tempdir().expect("tempdir");
        for c in ["pids", "memory", "cpu"] {
            std::fs::create_dir(tmp.path().join(c)).expect("mkdir");
        }
        let cg = BuildCgroup::create_in(tmp.path(), "x1", 64, 1 << 30).expect("create");
        assert_eq!(cg.parent(), "/sandboxd-build-x1");
        assert_eq!(std::fs::read_to_string(tmp.path().join("pids/sandboxd-build-x1/pids.max")).expect("pids.max"), "64");
        assert_eq!(std::fs::read_to_string(tmp.path().join("memory/sandboxd-build-x1/memory.limit_in_bytes")).expect("limit"), "1073741824");
        // What Docker makes below it in another hierarchy.
        std::fs::create_dir_all(tmp.path().join("cpu/sandboxd-build-x1/abc")).expect("mkdir");
        assert_eq!(cg.dirs().len(), 3);
        // Plain directories with files cannot be removed like cgroups; the walk still finds them.
        assert_eq!(walk(&tmp.path().join("cpu/sandboxd-build-x1")).len(), 2);
        drop(cg);
        assert!(!tmp.path().join("cpu/sandboxd-build-x1").exists(), "Docker's empty directories go");
    }
}
