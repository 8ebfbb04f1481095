//! Host-wide allocation of the uids QEMU processes drop to (`-runas`).
//!
//! Each VM's QEMU runs as a uid of its own, so one VM's QEMU cannot signal, trace or read the
//! files of another's. That only holds if no two daemons on one host hand out the same uid, so
//! the allocation is not per daemon but per host: uid `N` is taken while some process holds an
//! exclusive `flock` on `<dir>/N` (default [`UID_LOCK_DIR`], root-owned, 0700). A daemon holds
//! the lock for the VM's lifetime; the kernel drops it when the daemon dies, however it dies,
//! which is also when its VMs die (see `guard`). Lock files are left in place: a file without a
//! lock is a free uid, and their number stays the most VMs ever run at once.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;

/// Where the lock files of every daemon on this host live.
pub const UID_LOCK_DIR: &str = "/run/sandboxd/vm-uids";

/// Hands out uids from `base..base + count` that no other allocator on the host holds.
pub struct UidAllocator {
    dir: PathBuf,
    base: u32,
    count: u32,
    /// The locks this allocator holds, by uid.
    held: Mutex<HashMap<u32, File>>,
}

impl UidAllocator {
    pub fn new(dir: impl Into<PathBuf>, base: u32, count: u32) -> Self {
        UidAllocator { dir: dir.into(), base, count, held: Mutex::new(HashMap::new()) }
    }

    /// Creates the lock directory (0700) and refuses one that is not a directory of ours: a
    /// directory someone else controls could hand out uids that are in use.
    fn prepare_dir(&self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("creating {}: {e}", self.dir.display()))?;
        let meta = std::fs::symlink_metadata(&self.dir).map_err(|e| format!("stat {}: {e}", self.dir.display()))?;
        if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
            return Err(format!("{} is not a directory owned by this user", self.dir.display()));
        }
        if meta.permissions().mode() & 0o777 != 0o700 {
            std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| format!("chmod 0700 {}: {e}", self.dir.display()))?;
        }
        Ok(())
    }

    /// The lowest uid free on the whole host, held until [`release`](Self::release).
    pub fn alloc(&self) -> Result<u32, String> {
        self.prepare_dir()?;
        let mut held = self.held.lock().map_err(|_| "uid table poisoned".to_string())?;
        for uid in self.base..self.base.saturating_add(self.count) {
            if held.contains_key(&uid) {
                continue;
            }
            if let Some(lock) = try_lock(&self.dir.join(uid.to_string()))? {
                held.insert(uid, lock);
                return Ok(uid);
            }
        }
        Err(format!("all {} uids from {} are in use on this host ({})", self.count, self.base, self.dir.display()))
    }

    /// Gives `uid` back (its lock is dropped).
    pub fn release(&self, uid: u32) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(&uid);
        }
    }
}

/// Takes the exclusive lock of `path` without waiting; `None` when another holds it.
fn try_lock(path: &Path) -> Result<Option<File>, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    loop {
        // SAFETY: flock on a descriptor we own.
        match Errno::result(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }) {
            Ok(_) => return Ok(Some(file)),
            Err(Errno::EWOULDBLOCK) => return Ok(None),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(format!("locking {}: {e}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_allocator_skips_the_uids_the_first_holds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let locks = dir.path().join("vm-uids");
        // Two daemons on one host: two allocators over one directory.
        let first = UidAllocator::new(&locks, 500, 4);
        let second = UidAllocator::new(&locks, 500, 4);
        assert_eq!(first.alloc().expect("alloc"), 500);
        assert_eq!(first.alloc().expect("alloc"), 501);
        assert_eq!(second.alloc().expect("alloc"), 502, "the first one's uids are skipped");
        first.release(500);
        assert_eq!(second.alloc().expect("alloc"), 500, "a released uid is free again");
        assert_eq!(first.alloc().expect("alloc"), 503);
        let full = second.alloc().expect_err("the range is used up");
        assert!(full.contains("in use"), "{full}");
        // A daemon that dies drops its locks with its descriptors.
        drop(first);
        assert_eq!(second.alloc().expect("alloc"), 501);
        assert_eq!(std::fs::metadata(&locks).expect("stat").permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn a_lock_dir_that_is_a_symlink_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("elsewhere")).expect("mkdir");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), dir.path().join("vm-uids")).expect("symlink");
        let err = UidAllocator::new(dir.path().join("vm-uids"), 500, 4).alloc().expect_err("a symlink");
        assert!(err.contains("not a directory"), "{err}");
    }
}
