//! Shifted copies: user namespaces on kernels without idmapped mounts.
//!
//! Files are stored *canonical* (a file root made inside is uid 0 on disk, see `idmap`). Where
//! the kernel cannot idmap the image and the writable layer into the sandbox's range, the daemon
//! rewrites the owners on disk instead: before a sandbox starts, its image (a snapshot of a
//! copy of it kept in the pool) and its writable layer are shifted into its range, and a
//! snapshot taken of it is shifted back, so snapshots stay canonical and fork or roll back into
//! any range.
//!
//! The mapping is the one the idmapped mounts use: on-disk id `n` below [`RANGE`] is host id
//! `base + n`, and [`DAEMON_DISK_ID`] is the host's root (what overlayfs itself creates, e.g.
//! whiteouts, belongs to the mounter); any other id is left as it is. A chown clears a file's
//! set-user-ID and set-group-ID bits, so they are put back; a file capability names the root
//! it is valid for (`security.capability` v3 `rootid`), so it is rewritten for the range (v3
//! with `rootid = base`) and back (v2, valid for whichever root the file is shown to).
//!
//! Only trees no sandbox can reach while they are walked are shifted (an image copy, a layer
//! before its sandbox starts, a snapshot): there is no race with a process changing them. The
//! walk goes by directory descriptor, never by path, so a tree of any path length is walked; a
//! tree deeper than [`MAX_DEPTH`] is refused, as is any entry that cannot be shifted: a half
//! shifted tree must never be used.

use std::collections::HashSet;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use super::idmap::{DAEMON_DISK_ID, RANGE};

/// Directories below the root a shifted tree may have (each open while its subtree is walked).
pub const MAX_DEPTH: usize = 1024;

/// Which way a tree is shifted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shift {
    /// Canonical (on-disk ids inside) to the range whose root is host id `base`.
    Into(u32),
    /// The range whose root is host id `base` back to canonical.
    Out(u32),
}

impl Shift {
    /// The id `id` becomes.
    pub fn id(self, id: u32) -> u32 {
        match self {
            Shift::Into(base) if id < RANGE => base + id,
            Shift::Into(_) if id == DAEMON_DISK_ID => 0,
            Shift::Out(base) if id >= base && id - base < RANGE => id - base,
            Shift::Out(_) if id == 0 => DAEMON_DISK_ID,
            _ => id,
        }
    }
}

/// What a shift did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Shifted {
    /// Entries looked at (the root included).
    pub entries: u64,
    /// Entries whose owner changed.
    pub changed: u64,
}

/// Shifts the owners of `root` and everything below it (on the same filesystem) by `shift`.
pub fn shift_tree(root: &Path, shift: Shift) -> io::Result<Shifted> {
    let dir = open_dir_at(libc::AT_FDCWD, &cstring(root.as_os_str().as_encoded_bytes())?)
        .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", root.display())))?;
    let st = fstat(dir.as_raw_fd())?;
    let mut walk = Walk { shift, dev: st.st_dev, seen: HashSet::new(), done: Shifted::default() };
    walk.owner_of_dir(dir.as_raw_fd(), &st).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", root.display())))?;
    // Each frame: an open directory and the names in it still to visit.
    let mut stack: Vec<(OwnedFd, Vec<Vec<u8>>)> = vec![(dir.try_clone()?, names(dir)?)];
    while let Some((dir, pending)) = stack.last_mut() {
        let Some(name) = pending.pop() else {
            stack.pop();
            continue;
        };
        let dfd = dir.as_raw_fd();
        let cname = cstring(&name)?;
        let at = |e: io::Error| io::Error::new(e.kind(), format!("{}/…/{}: {e}", root.display(), String::from_utf8_lossy(&name)));
        let st = fstatat(dfd, &cname).map_err(at)?;
        if st.st_dev != walk.dev {
            // A mount point (none is expected in a layer or an image): not ours to change.
            continue;
        }
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                if stack.len() > MAX_DEPTH {
                    return Err(io::Error::other(format!("{} is deeper than {MAX_DEPTH} directories", root.display())));
                }
                let sub = open_dir_at(dfd, &cname).map_err(at)?;
                walk.owner_of_dir(sub.as_raw_fd(), &st).map_err(at)?;
                let listed = names(sub.try_clone()?).map_err(at)?;
                stack.push((sub, listed));
            }
            libc::S_IFREG => walk.owner_of_file(dfd, &cname, &st).map_err(at)?,
            _ => walk.owner_of_other(dfd, &cname, &st).map_err(at)?,
        }
    }
    Ok(walk.done)
}

struct Walk {
    shift: Shift,
    dev: libc::dev_t,
    /// Inodes with more than one link already shifted: a second name must not shift again.
    seen: HashSet<u64>,
    done: Shifted,
}

impl Walk {
    /// The owner `st` shows shifted, or None when it stays (or the inode was done already).
    fn wanted(&mut self, st: &libc::stat) -> Option<(u32, u32)> {
        self.done.entries += 1;
        if (st.st_mode & libc::S_IFMT) != libc::S_IFDIR && st.st_nlink > 1 && !self.seen.insert(st.st_ino) {
            return None;
        }
        let (uid, gid) = (self.shift.id(st.st_uid), self.shift.id(st.st_gid));
        if (uid, gid) == (st.st_uid, st.st_gid) {
            return None;
        }
        self.done.changed += 1;
        Some((uid, gid))
    }

    fn owner_of_dir(&mut self, fd: RawFd, st: &libc::stat) -> io::Result<()> {
        let Some((uid, gid)) = self.wanted(st) else { return Ok(()) };
        // A directory keeps its set-group-ID bit through a chown.
        // SAFETY: fchown on a descriptor we hold.
        check(unsafe { libc::fchown(fd, uid, gid) })
    }

    fn owner_of_other(&mut self, dir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
        let Some((uid, gid)) = self.wanted(st) else { return Ok(()) };
        // A symlink, device node (an overlay whiteout), FIFO or socket: its own owner.
        // SAFETY: fchownat relative to a directory we hold, with a NUL-terminated name.
        check(unsafe { libc::fchownat(dir, name.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW) })
    }

    fn owner_of_file(&mut self, dir: RawFd, name: &CStr, st: &libc::stat) -> io::Result<()> {
        let Some((uid, gid)) = self.wanted(st) else { return Ok(()) };
        // SAFETY: openat relative to a directory we hold; O_NOFOLLOW keeps it to this entry.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: openat returned a descriptor nothing else owns.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let fd = file.as_raw_fd();
        let capability = get_capability(fd)?;
        // SAFETY: fchown on a descriptor we hold.
        check(unsafe { libc::fchown(fd, uid, gid) })?;
        if st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
            // SAFETY: fchmod on a descriptor we hold.
            check(unsafe { libc::fchmod(fd, st.st_mode & 0o7777) })?;
        }
        if let Some(cap) = capability {
            let rewritten = match self.shift {
                Shift::Into(base) => capability_for_root(&cap, Some(base)),
                Shift::Out(_) => capability_for_root(&cap, None),
            };
            set_capability(fd, &rewritten)?;
        }
        Ok(())
    }
}

const CAPABILITY_XATTR: &CStr = c"security.capability";
const VFS_CAP_REVISION_MASK: u32 = 0xFF00_0000;
const VFS_CAP_REVISION_2: u32 = 0x0200_0000;
const VFS_CAP_REVISION_3: u32 = 0x0300_0000;
const VFS_CAP_V2_BYTES: usize = 20;

/// `cap` (a `security.capability` value) as v3 valid for the namespace whose root is host id
/// `root`, or as v2 (for any root) when `root` is None. A value of another revision is kept.
pub fn capability_for_root(cap: &[u8], root: Option<u32>) -> Vec<u8> {
    if cap.len() < VFS_CAP_V2_BYTES {
        return cap.to_vec();
    }
    let magic = u32::from_le_bytes([cap[0], cap[1], cap[2], cap[3]]);
    if !matches!(magic & VFS_CAP_REVISION_MASK, VFS_CAP_REVISION_2 | VFS_CAP_REVISION_3) {
        return cap.to_vec();
    }
    let flags = magic & !VFS_CAP_REVISION_MASK;
    let mut out = Vec::with_capacity(24);
    match root {
        Some(rootid) => {
            out.extend_from_slice(&(VFS_CAP_REVISION_3 | flags).to_le_bytes());
            out.extend_from_slice(&cap[4..VFS_CAP_V2_BYTES]);
            out.extend_from_slice(&rootid.to_le_bytes());
        }
        None => {
            out.extend_from_slice(&(VFS_CAP_REVISION_2 | flags).to_le_bytes());
            out.extend_from_slice(&cap[4..VFS_CAP_V2_BYTES]);
        }
    }
    out
}

fn get_capability(fd: RawFd) -> io::Result<Option<Vec<u8>>> {
    let mut buf = [0u8; 64];
    // SAFETY: fgetxattr into a local buffer of the size given.
    let n = unsafe { libc::fgetxattr(fd, CAPABILITY_XATTR.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::EOPNOTSUPP) => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(buf[..n as usize].to_vec()))
}

fn set_capability(fd: RawFd, value: &[u8]) -> io::Result<()> {
    // SAFETY: fsetxattr from a live slice of the length given.
    check(unsafe { libc::fsetxattr(fd, CAPABILITY_XATTR.as_ptr(), value.as_ptr().cast(), value.len(), 0) })
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn cstring(b: &[u8]) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(b).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn open_dir_at(dir: RawFd, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: openat with a NUL-terminated name; O_NOFOLLOW|O_DIRECTORY: this directory only.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: a stat struct is plain data, all zeroes a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat into a local struct.
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

fn fstatat(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: a stat struct is plain data, all zeroes a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat relative to a directory we hold, into a local struct.
    check(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

/// The names in the directory `dir` (consumed), `.` and `..` left out.
fn names(dir: OwnedFd) -> io::Result<Vec<Vec<u8>>> {
    let mut d = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(dir)).map_err(io::Error::from)?;
    let mut out = Vec::new();
    for entry in d.iter() {
        let entry = entry.map_err(io::Error::from)?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            out.push(name.to_vec());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn ids_shift_into_the_range_and_back() {
        let base = 1 << 30;
        for id in [0, 1, 1000, 65_535] {
            assert_eq!(Shift::Into(base).id(id), base + id);
            assert_eq!(Shift::Out(base).id(base + id), id);
        }
        assert_eq!(Shift::Into(base).id(DAEMON_DISK_ID), 0, "the mounter's id is the host's root");
        assert_eq!(Shift::Out(base).id(0), DAEMON_DISK_ID);
        assert_eq!(Shift::Into(base).id(70_000), 70_000, "other ids stay");
        assert_eq!(Shift::Out(base).id(base + RANGE), base + RANGE, "another range's ids stay");
        assert_eq!(Shift::Out(base).id(1000), 1000);
    }

    #[test]
    fn a_capability_is_rewritten_for_the_range_root_and_back() {
        // v2, effective flag set, CAP_NET_BIND_SERVICE permitted.
        let mut v2 = (VFS_CAP_REVISION_2 | 1).to_le_bytes().to_vec();
        v2.extend_from_slice(&[0x00, 0x04, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let v3 = capability_for_root(&v2, Some(1 << 30));
        assert_eq!(v3.len(), 24);
        assert_eq!(u32::from_le_bytes([v3[0], v3[1], v3[2], v3[3]]), VFS_CAP_REVISION_3 | 1);
        assert_eq!(u32::from_le_bytes([v3[20], v3[21], v3[22], v3[23]]), 1 << 30);
        assert_eq!(capability_for_root(&v3, None), v2);
        assert_eq!(capability_for_root(b"short", None), b"short".to_vec());
    }

    /// Needs root (chown). A tree with a hard link, a symlink, a set-user-ID file, a FIFO and
    /// a deep path goes into a range and back unchanged.
    #[test]
    fn a_tree_goes_into_the_range_and_back_to_what_it_was() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let base: u32 = 3 << 30;
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("t");
        std::fs::create_dir(&root).expect("root");
        std::fs::write(root.join("a"), b"a").expect("a");
        std::fs::hard_link(root.join("a"), root.join("a-link")).expect("link");
        std::os::unix::fs::symlink("/etc/passwd", root.join("s")).expect("symlink");
        std::fs::write(root.join("suid"), b"x").expect("suid");
        std::os::unix::fs::lchown(root.join("suid"), Some(1000), Some(1000)).expect("own");
        std::fs::set_permissions(root.join("suid"), std::fs::Permissions::from_mode(0o4755)).expect("mode");
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("fifo");
        let mut deep = root.clone();
        for i in 0..40 {
            deep = deep.join(format!("{i:0>100}"));
        }
        // Deeper than PATH_MAX (40 × 101 bytes): only a descriptor walk reaches it.
        let mut d = std::fs::File::open(&root).expect("open");
        for i in 0..40 {
            let name = format!("{i:0>100}");
            nix::sys::stat::mkdirat(Some(d.as_raw_fd()), name.as_str(), nix::sys::stat::Mode::from_bits_truncate(0o755)).expect("mkdirat");
            let fd = nix::fcntl::openat(Some(d.as_raw_fd()), name.as_str(), nix::fcntl::OFlag::O_DIRECTORY, nix::sys::stat::Mode::empty()).expect("openat");
            // SAFETY: openat returned a descriptor nothing else owns.
            d = unsafe { std::fs::File::from_raw_fd(fd) };
        }
        let before = owners(&root);

        let into = shift_tree(&root, Shift::Into(base)).expect("into");
        assert_eq!((into.entries, into.changed), (6 + 40, 6 + 40 - 1), "every entry (the root too), the hard link's second name too: {into:?}");
        let m = std::fs::symlink_metadata(root.join("suid")).expect("suid");
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (base + 1000, base + 1000, 0o4755), "set-user-ID kept through the chown");
        assert_eq!(std::fs::symlink_metadata(root.join("a")).expect("a").uid(), base, "a hard link is shifted once");
        assert_eq!(std::fs::symlink_metadata(root.join("s")).expect("s").uid(), base, "the symlink itself");
        assert_eq!(std::fs::metadata("/etc/passwd").expect("passwd").uid(), 0, "never its target");
        assert_eq!(nix::sys::stat::fstat(d.as_raw_fd()).expect("deep").st_uid, base, "the deepest directory");

        shift_tree(&root, Shift::Out(base)).expect("out");
        assert_eq!(owners(&root), before, "back to what it was");
    }

    fn owners(root: &Path) -> Vec<(std::path::PathBuf, u32, u32, u32)> {
        let mut v = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(p) = stack.pop() {
            let Ok(m) = std::fs::symlink_metadata(&p) else { continue };
            v.push((p.clone(), m.uid(), m.gid(), m.mode()));
            if m.is_dir() {
                if let Ok(rd) = std::fs::read_dir(&p) {
                    stack.extend(rd.flatten().map(|e| e.path()));
                }
            }
        }
        v.sort();
        v
    }
}
