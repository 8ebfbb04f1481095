//! `/proc/self/mountinfo`, parsed once for everything the tiers and the state-dir sealing
//! (`hostfs`) ask of it: which cgroup hierarchies are mounted where, what filesystem a directory
//! is, whether a path is a mount point.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Where the kernel describes this process's mounts.
pub const PATH: &str = "/proc/self/mountinfo";

/// One line of mountinfo, the fields we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub super_options: Vec<String>,
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` octal.
pub(crate) fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = std::str::from_utf8(&b[i + 1..i + 4]).ok();
            if let Some(v) = oct.and_then(|o| u8::from_str_radix(o, 8).ok()) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    PathBuf::from(OsStr::from_bytes(&out))
}

/// Parses mountinfo text (malformed lines are skipped).
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            // "id parent maj:min root mount_point options [optional...] - fstype source super_options"
            let (left, right) = line.split_once(" - ")?;
            let mount_point = unescape(left.split(' ').nth(4)?);
            let mut r = right.split(' ');
            let fstype = r.next()?.to_string();
            let _source = r.next();
            let super_options = r.next().map(|o| o.split(',').map(str::to_string).collect()).unwrap_or_default();
            Some(Mount { mount_point, fstype, super_options })
        })
        .collect()
}

/// The current mounts (empty if mountinfo cannot be read).
pub fn read() -> Vec<Mount> {
    std::fs::read_to_string(PATH).map(|t| parse(&t)).unwrap_or_default()
}

/// Filesystem type of the mount whose mount point is exactly `dir` (the last one: later mounts
/// stack on top).
pub fn fstype_at(mounts: &[Mount], dir: &Path) -> Option<String> {
    mounts.iter().rev().find(|m| m.mount_point == dir).map(|m| m.fstype.clone())
}

/// Whether `path` is a mount point now.
pub fn is_mount_point(path: &Path) -> bool {
    // statx says it for the path alone (Linux 5.8+); the whole mount table is read only where
    // the kernel cannot, since a daemon with thousands of mounts would read it for each path.
    match statx_mount_root(path) {
        Some(root) => root,
        None => read().iter().any(|m| m.mount_point == path),
    }
}

/// Whether `path` is the root of a mount, by `statx(STATX_ATTR_MOUNT_ROOT)`; None when the
/// kernel does not say (or the path cannot be looked at).
fn statx_mount_root(path: &Path) -> Option<bool> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statx is plain old data: all zeroes is a valid value.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx with a valid C string and a pointer to a live struct of the right type.
    let r = unsafe { libc::statx(libc::AT_FDCWD, c.as_ptr(), libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT, 0, &mut st) };
    let bit = libc::STATX_ATTR_MOUNT_ROOT as u64;
    (r == 0 && st.stx_attributes_mask & bit != 0).then_some(st.stx_attributes & bit != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_roots_are_told_apart_from_plain_directories() {
        assert!(is_mount_point(Path::new("/proc")));
        assert!(is_mount_point(Path::new("/")));
        assert!(!is_mount_point(Path::new("/proc/self")));
        let dir = std::env::temp_dir();
        assert_eq!(is_mount_point(&dir), read().iter().any(|m| m.mount_point == dir), "statx and the mount table agree on {}", dir.display());
    }

    #[test]
    fn lines_parse_with_escapes_and_optional_fields() {
        let mi = "22 1 0:21 / /proc rw - proc proc rw\n\
                  90 23 0:50 / /tmp/st\\040x/pool rw,noatime shared:5 master:1 - btrfs /dev/loop3 rw,quota\n\
                  32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
                  garbage line\n";
        let m = parse(mi);
        assert_eq!(m.len(), 3);
        assert_eq!(fstype_at(&m, Path::new("/tmp/st x/pool")).as_deref(), Some("btrfs"));
        assert_eq!(m[2].super_options, ["rw", "cpu", "cpuacct"]);
        assert_eq!(fstype_at(&m, Path::new("/tmp/st")), None);
        assert_eq!(unescape("/a\\040b\\134c"), Path::new("/a b\\c"));
        assert_eq!(unescape("/tail\\04"), Path::new("/tail\\04"));
    }
}
