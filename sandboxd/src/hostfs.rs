//! The host side of the boundary: where the bytes a sandbox controls live on the host.
//!
//! Every tier keeps sandbox-written bytes under the state dir: the process tier's btrfs pool
//! (its own mount), run dirs with the overlay roots, the container tier's snapshot copies, the
//! microVM tier's disks and snapshots, exec outputs. A sandbox is root inside and can make any
//! file it likes (`chown 0 f; chmod 4755 f`), so on the host these trees must never be usable by
//! anyone else:
//!
//! * the state dir is `0700` root, so no other local user can traverse into any of it;
//! * the state dir is a bind mount of itself with `nosuid,nodev,noexec`, so a setuid file or a
//!   device node planted by a sandbox means nothing on the host even to a root process that
//!   stumbles on it, whatever the directory modes below (Docker's snapshot copies keep modes);
//! * the bind mount is private, so the mounts the daemon makes below it (pool, overlays) never
//!   propagate to the rest of the host.
//!
//! The daemon refuses to start when it cannot establish this: running with less isolation than
//! promised is worse than not running.
//!
//! It also measures those trees ([`tree_size`]): image sizes, snapshot sizes, disk sizes.

use std::collections::HashSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::mountinfo;

/// What [`tree_size`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Bytes of regular-file content.
    Content,
    /// Allocated blocks of every entry, directories included, like `du -sk`.
    Allocated,
}

/// The size of the tree below `root`, never following a symlink; a file with several names
/// counts once. Entries that cannot be read are skipped (the tree may change while measured).
/// Blocks; call from `spawn_blocking`.
pub fn tree_size(root: &Path, measure: Measure) -> u64 {
    let mut total = 0u64;
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            // DirEntry::metadata does not follow a symlink.
            let Ok(m) = entry.metadata() else { continue };
            if m.is_dir() {
                stack.push(entry.path());
            }
            let bytes = match measure {
                Measure::Content if m.is_file() => m.len(),
                Measure::Content => continue,
                Measure::Allocated => m.blocks() * 512,
            };
            if m.is_dir() || m.nlink() < 2 || seen.insert((m.dev(), m.ino())) {
                total = total.saturating_add(bytes);
            }
        }
    }
    total
}

/// Errors sealing the state dir.
#[derive(Debug, thiserror::Error)]
pub enum HostFsError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{op} {path}: {source}")]
    Sys { op: &'static str, path: PathBuf, source: nix::Error },
    #[error("state dir {path} is still mounted without {missing} after the remount")]
    NotSealed { path: PathBuf, missing: &'static str },
}

/// The mount flags every host tree holding sandbox bytes carries.
pub const SEALED_FLAGS: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC);

/// Creates the state dir if needed and seals it (see the module documentation). Idempotent: a
/// state dir left sealed by a daemon that was killed is re-sealed in place.
pub fn seal_state_dir(dir: &Path) -> Result<PathBuf, HostFsError> {
    std::fs::create_dir_all(dir).map_err(|source| HostFsError::Io { op: "creating", path: dir.to_path_buf(), source })?;
    let dir = dir.canonicalize().map_err(|source| HostFsError::Io { op: "resolving", path: dir.to_path_buf(), source })?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| HostFsError::Io { op: "chmod 0700", path: dir.clone(), source })?;
    let sys = |op: &'static str| {
        let path = dir.clone();
        move |source| HostFsError::Sys { op, path, source }
    };
    // A mount point already there is either our own bind mount (a daemon killed with -9 left
    // it) or the operator's (a dedicated disk): both are sealed in place, neither stacked on.
    if !mountinfo::is_mount_point(&dir) {
        mount(Some(&dir), &dir, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(sys("bind-mounting"))?;
    }
    // Private before anything is mounted below it, so the pool and overlays stay ours.
    mount(None::<&str>, &dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>).map_err(sys("making private"))?;
    mount(None::<&str>, &dir, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | SEALED_FLAGS, None::<&str>)
        .map_err(sys("remounting nosuid,nodev,noexec"))?;
    check_sealed(&dir)?;
    tracing::info!(state_dir = %dir.display(), "state dir sealed: 0700, nosuid,nodev,noexec, private");
    Ok(dir)
}

/// Verifies from the kernel's own view that `dir` is mounted nosuid, nodev and noexec.
pub fn check_sealed(dir: &Path) -> Result<(), HostFsError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|source| HostFsError::Sys { op: "statvfs", path: dir.to_path_buf(), source })?;
    let flags = st.flags();
    use nix::sys::statvfs::FsFlags;
    for (flag, name) in [(FsFlags::ST_NOSUID, "nosuid"), (FsFlags::ST_NODEV, "nodev"), (FsFlags::ST_NOEXEC, "noexec")] {
        if !flags.contains(flag) {
            return Err(HostFsError::NotSealed { path: dir.to_path_buf(), missing: name });
        }
    }
    Ok(())
}

/// Detaches the state dir's bind mount at shutdown (lazily: the store may still hold files) —
/// only our own: an operator's filesystem mounted there stays.
pub fn unseal_state_dir(dir: &Path) {
    let dir = &dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    if is_self_bind(dir) {
        if let Err(e) = umount2(dir, MntFlags::MNT_DETACH) {
            tracing::warn!(state_dir = %dir.display(), error = %e, "cannot detach the state dir's bind mount");
        }
    }
}

/// One line of mountinfo, the fields [`is_self_bind`] compares.
struct MountLine {
    id: u32,
    parent: u32,
    device: String,
    root: PathBuf,
    mount_point: PathBuf,
}

fn mount_lines(text: &str) -> Vec<MountLine> {
    text.lines()
        .filter_map(|line| {
            // "id parent maj:min root mount_point options ..."
            let mut f = line.split(' ');
            Some(MountLine {
                id: f.next()?.parse().ok()?,
                parent: f.next()?.parse().ok()?,
                device: f.next()?.to_string(),
                root: mountinfo::unescape(f.next()?),
                mount_point: mountinfo::unescape(f.next()?),
            })
        })
        .collect()
}

/// Whether the topmost mount at `dir` is a bind mount of `dir` onto itself (what
/// [`seal_state_dir`] makes): the same filesystem as its parent mount, showing exactly the
/// directory that sits under it. An operator's own filesystem mounted there never is.
fn is_self_bind(dir: &Path) -> bool {
    let lines = mount_lines(&std::fs::read_to_string(mountinfo::PATH).unwrap_or_default());
    self_bind_in(&lines, dir)
}

fn self_bind_in(lines: &[MountLine], dir: &Path) -> bool {
    let Some(m) = lines.iter().rev().find(|l| l.mount_point == dir) else { return false };
    let Some(parent) = lines.iter().find(|l| l.id == m.parent) else { return false };
    let Ok(rel) = dir.strip_prefix(&parent.mount_point) else { return false };
    m.device == parent.device && m.root == parent.root.join(rel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_self_bind_counts_as_ours() {
        let text = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
                    30 22 8:1 /var/lib/sandboxd /var/lib/sandboxd rw - ext4 /dev/sda1 rw\n\
                    31 22 8:17 / /srv/state rw - xfs /dev/sdb1 rw\n\
                    32 22 8:1 /elsewhere /srv/other rw - ext4 /dev/sda1 rw\n";
        let lines = mount_lines(text);
        assert!(self_bind_in(&lines, Path::new("/var/lib/sandboxd")), "the daemon's own bind");
        assert!(!self_bind_in(&lines, Path::new("/srv/state")), "an operator's disk");
        assert!(!self_bind_in(&lines, Path::new("/srv/other")), "a bind of another directory");
        assert!(!self_bind_in(&lines, Path::new("/not/mounted")));
    }

    #[test]
    fn an_operators_own_mount_is_sealed_but_left_mounted_at_shutdown() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (mounts); CI runs as root");
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("disk");
        std::fs::create_dir_all(&dir).expect("mkdir");
        mount(Some("tmpfs"), &dir, Some("tmpfs"), MsFlags::empty(), Some("size=1m")).expect("mount tmpfs");
        let sealed = seal_state_dir(&dir).expect("seal");
        check_sealed(&sealed).expect("sealed");
        let count = mountinfo::read().iter().filter(|m| m.mount_point == sealed).count();
        assert_eq!(count, 1, "no bind stacked on the operator's mount");
        unseal_state_dir(&sealed);
        assert!(mountinfo::is_mount_point(&sealed), "the operator's filesystem must stay mounted");
        umount2(&sealed, MntFlags::MNT_DETACH).expect("cleanup");
    }

    #[test]
    fn a_sealed_state_dir_is_0700_nosuid_nodev_noexec_and_resealing_is_idempotent() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test needs root (mounts); CI runs as root");
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("state");
        let sealed = seal_state_dir(&dir).expect("seal");
        // Twice, as after a daemon killed with -9.
        let again = seal_state_dir(&dir).expect("reseal");
        assert_eq!(sealed, again);
        let mode = std::fs::metadata(&sealed).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700);
        check_sealed(&sealed).expect("sealed");
        // One bind mount, not two stacked ones.
        let count = mountinfo::read().iter().filter(|m| m.mount_point == sealed).count();
        assert_eq!(count, 1, "exactly one mount at the state dir");
        unseal_state_dir(&sealed);
        assert!(!mountinfo::is_mount_point(&sealed));
    }
}
