//! User namespaces of the process tier: each sandbox gets a range of 65,536 host uids and gids
//! of its own, so root inside is an unprivileged, otherwise unused uid outside, and uid 1000
//! inside is not the host's uid 1000 (nor another sandbox's).
//!
//! Files stay in the ids they have inside ("canonical": a file root made is uid 0 on disk),
//! in images, writable layers and snapshots alike, so a snapshot forks or rolls back into any
//! range without a copy. The sandbox sees them through *idmapped mounts* of its image and its
//! writable layer (`mount_setattr(MOUNT_ATTR_IDMAP)`, kernel 5.12+; overlayfs takes idmapped
//! layers since 5.19): on-disk id `n` is host id `base + n`. The same mounts map the host's
//! root to an on-disk id no sandbox uses ([`DAEMON_DISK_ID`]), because overlayfs creates its
//! copy-up files as the mounter (the daemon, root) before giving them their owner; the daemon's
//! own file writes act as the sandbox's root ([`ActingAs`]), so nothing keeps that id.
//!
//! The sandbox's processes live in a user namespace mapping only the range (see
//! `init::clone_init`); the mount idmap is a separate, throwaway namespace that also names the host's
//! root, which a sandbox must never be able to become.

use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::errno::Errno;

/// Ids per sandbox: uid and gid 0 to 65,535 inside.
pub const RANGE: u32 = 65_536;
/// The on-disk id the host's root is mapped to in the mount idmap: the first id past the range,
/// never a sandbox's (inside, it shows as the overflow id, `nobody`).
pub const DAEMON_DISK_ID: u32 = RANGE;

/// Whether process sandboxes get a user namespace (the `[process] user_namespaces` key).
pub use crate::config::UsernsMode;

/// The host ids handed out to sandboxes, `count` ranges of [`RANGE`] from `first`.
pub struct IdRanges {
    first: u32,
    count: u32,
    state: Mutex<RangesState>,
}

#[derive(Default)]
struct RangesState {
    used: BTreeSet<u32>,
    /// Mount idmap namespaces by range index, made on first use and kept (the first
    /// [`MOUNT_NS_CACHE`]): a range is reused.
    mount_ns: HashMap<u32, Arc<OwnedFd>>,
}

/// How many ranges' mount namespaces are kept open for reuse.
const MOUNT_NS_CACHE: usize = 256;

/// A range held by one live sandbox; dropping it gives the range back.
pub struct IdLease {
    ranges: Arc<IdRanges>,
    index: u32,
    base: u32,
}

impl std::fmt::Debug for IdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdLease({}..{})", self.base, u64::from(self.base) + u64::from(RANGE))
    }
}

impl IdLease {
    /// Host uid (and gid) of root inside.
    pub fn base(&self) -> u32 {
        self.base
    }

    /// The namespace the sandbox's mounts are idmapped with.
    pub fn mount_userns(&self) -> io::Result<Arc<OwnedFd>> {
        self.ranges.mount_userns(self.index, self.base)
    }

    /// The archive id shift of this range.
    pub fn shift(&self) -> sandbox_exec::archive::IdShift {
        sandbox_exec::archive::IdShift { base: self.base, len: RANGE }
    }
}

impl Drop for IdLease {
    fn drop(&mut self) {
        if let Ok(mut st) = self.ranges.state.lock() {
            st.used.remove(&self.index);
        }
    }
}

impl IdRanges {
    /// Checks that the ranges fit below the largest valid id (`u32::MAX` is `-1`) and start
    /// above the ids a host gives its users (the first 65,536 ids are never handed out).
    pub fn new(first: u32, count: u32) -> Result<Arc<IdRanges>, String> {
        let end = u64::from(first) + u64::from(count) * u64::from(RANGE);
        if first < RANGE || !first.is_multiple_of(RANGE) {
            return Err(format!("userns_first_id {first} must be a multiple of {RANGE} and at least {RANGE}"));
        }
        if count == 0 || end > u64::from(u32::MAX - 1) {
            return Err(format!("{count} ranges of {RANGE} ids from {first} do not fit below {}", u32::MAX - 1));
        }
        Ok(Arc::new(IdRanges { first, count, state: Mutex::new(RangesState::default()) }))
    }

    fn base_of(&self, index: u32) -> u32 {
        self.first + index * RANGE
    }

    /// A free range: `preferred` (the base a restarted sandbox had) when it is free, else the
    /// lowest free one.
    pub fn lease(self: &Arc<Self>, preferred: Option<u32>) -> Result<IdLease, String> {
        let mut st = self.state.lock().map_err(|_| "id range table poisoned".to_string())?;
        let wanted = preferred
            .filter(|&b| b >= self.first && (b - self.first).is_multiple_of(RANGE))
            .map(|b| (b - self.first) / RANGE)
            .filter(|&i| i < self.count && !st.used.contains(&i));
        let index = match wanted {
            Some(i) => i,
            None => (0..self.count)
                .find(|i| !st.used.contains(i))
                .ok_or_else(|| format!("all {} user namespace id ranges are in use (raise [process] userns_ranges)", self.count))?,
        };
        st.used.insert(index);
        Ok(IdLease { ranges: self.clone(), index, base: self.base_of(index) })
    }

    fn mount_userns(&self, index: u32, base: u32) -> io::Result<Arc<OwnedFd>> {
        let mut st = self.state.lock().map_err(|_| io::Error::other("id range table poisoned"))?;
        if let Some(fd) = st.mount_ns.get(&index) {
            return Ok(fd.clone());
        }
        let fd = Arc::new(make_userns(&mount_idmap(base))?);
        // Each is a descriptor the daemon holds: a bounded cache keeps the daemon's descriptors
        // at a few per live sandbox. A range past it gets a namespace per call (the mounts made
        // with it keep their own reference).
        if st.mount_ns.len() < MOUNT_NS_CACHE {
            st.mount_ns.insert(index, fd.clone());
        }
        Ok(fd)
    }
}

/// The uid_map / gid_map of a sandbox's mounts: the range, and the host's root at
/// [`DAEMON_DISK_ID`].
pub fn mount_idmap(base: u32) -> String {
    format!("0 {base} {RANGE}\n{DAEMON_DISK_ID} 0 1\n")
}

/// The uid_map / gid_map of a sandbox's processes: the range only.
pub fn process_idmap(base: u32) -> String {
    format!("0 {base} {RANGE}\n")
}

/// A new user namespace with `map` as its uid and gid map, by descriptor: a child is cloned
/// into it, its maps written, the namespace opened, and the child ends.
pub fn make_userns(map: &str) -> io::Result<OwnedFd> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: a raw clone behaves like fork; the child runs only async-signal-safe system calls
    // (read, _exit) on memory it already has, so the daemon's other threads do not matter.
    let pid = unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER | libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize) };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let mut b = 0u8;
        // SAFETY: close the child's copy of the write end (or the read below never sees EOF),
        // read into a local byte, then _exit: nothing else runs in the child.
        unsafe {
            libc::close(std::os::fd::AsRawFd::as_raw_fd(&w));
            libc::read(std::os::fd::AsRawFd::as_raw_fd(&r), (&mut b as *mut u8).cast(), 1);
            libc::_exit(0)
        }
    }
    let pid = pid as libc::pid_t;
    let result = (|| {
        std::fs::write(format!("/proc/{pid}/uid_map"), map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), map)?;
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
        Ok(OwnedFd::from(ns))
    })();
    drop(w);
    drop(r);
    loop {
        let mut status = 0;
        // SAFETY: waitpid of our own child, with a pointer to a local.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        if got >= 0 || Errno::last() != Errno::EINTR {
            break;
        }
    }
    result
}

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Mounts `src` at `dst` (an existing directory) through the idmap of `userns`.
pub fn idmapped_bind(src: &Path, dst: &Path, userns: &OwnedFd) -> io::Result<()> {
    let (src_c, dst_c) = (cpath(src)?, cpath(dst)?);
    // SAFETY: open_tree with a valid C string; the result is a new descriptor we own.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, src_c.as_ptr(), OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open_tree returned a descriptor nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = MountAttr { attr_set: MOUNT_ATTR_IDMAP, attr_clr: 0, propagation: 0, userns_fd: std::os::fd::AsRawFd::as_raw_fd(userns) as u64 };
    // SAFETY: mount_setattr on the detached tree with a pointer to a live struct and its size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            std::os::fd::AsRawFd::as_raw_fd(&tree),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: move_mount of the detached tree onto a path given as a C string.
    let r = unsafe {
        libc::syscall(libc::SYS_move_mount, std::os::fd::AsRawFd::as_raw_fd(&tree), c"".as_ptr(), libc::AT_FDCWD, dst_c.as_ptr(), MOVE_MOUNT_F_EMPTY_PATH)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `dir`'s filesystem takes idmapped mounts: an idmapped bind of it is made on a
/// scratch mount point below `scratch` and taken down again.
pub fn probe(dir: &Path, scratch: &Path, userns: &OwnedFd) -> Result<(), String> {
    let target = scratch.join(".idmap-probe");
    let _ = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH);
    std::fs::create_dir_all(&target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    let result = idmapped_bind(dir, &target, userns).map_err(|e| format!("an idmapped mount of {} failed: {e}", dir.display()));
    if result.is_ok() {
        let _ = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_dir(&target);
    result
}

/// The calling thread's file system identity switched to a sandbox's root (host uid and gid
/// `base`) while it lives: what it creates belongs to the sandbox, as if root inside had made
/// it. The capabilities a change of fsuid drops from the thread's effective set are raised
/// again (the daemon still reads every file), and everything is put back on drop. Per thread
/// (setfsuid is not broadcast to the process): hold it only in synchronous code on a
/// blocking thread, never across an `.await`.
pub struct ActingAs {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ActingAs {
    pub fn root_of(base: u32) -> io::Result<ActingAs> {
        // SAFETY: setfsgid / setfsuid change only this thread's credentials.
        unsafe {
            libc::setfsgid(base);
            libc::setfsuid(base);
        }
        let guard = ActingAs { _not_send: std::marker::PhantomData };
        // setfsuid reports the previous id only: ask again (with an invalid id) to check.
        // SAFETY: as above; u32::MAX is refused and changes nothing.
        let now = unsafe { libc::setfsuid(u32::MAX) };
        if now as u32 != base {
            return Err(io::Error::other(format!("setfsuid({base}) did not take (fsuid {now})")));
        }
        let permitted = caps::read(None, caps::CapSet::Permitted).map_err(|e| io::Error::other(format!("reading capabilities: {e}")))?;
        caps::set(None, caps::CapSet::Effective, &permitted).map_err(|e| io::Error::other(format!("raising capabilities: {e}")))?;
        Ok(guard)
    }
}

impl Drop for ActingAs {
    fn drop(&mut self) {
        // Back to root: the kernel raises the file capabilities again itself.
        // SAFETY: as in `root_of`.
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
    }
}

/// Acts as the sandbox's root for `op` when it has a range; as the daemon otherwise.
pub fn as_root_of<T>(base: Option<u32>, op: impl FnOnce() -> T) -> io::Result<T> {
    let _guard = base.map(ActingAs::root_of).transpose()?;
    Ok(op())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_distinct_reused_and_bounded() {
        let r = IdRanges::new(1 << 30, 3).expect("ranges");
        let a = r.lease(None).expect("a");
        let b = r.lease(Some(a.base())).expect("b");
        assert_ne!(a.base(), b.base(), "a range in use is not handed out twice");
        let c = r.lease(Some((1 << 30) + 2 * RANGE)).expect("c");
        assert_eq!(c.base(), (1 << 30) + 2 * RANGE, "a free preferred range is taken");
        assert!(r.lease(None).expect_err("full").contains("all 3"));
        let freed = b.base();
        drop(b);
        assert_eq!(r.lease(None).expect("again").base(), freed);
        assert!(IdRanges::new(1000, 1).is_err());
        assert!(IdRanges::new(u32::MAX - RANGE + 1, 2).is_err());
    }

    #[test]
    fn maps_name_the_range_and_only_the_mount_map_names_root() {
        assert_eq!(process_idmap(1 << 30), format!("0 {} 65536\n", 1u32 << 30));
        assert!(mount_idmap(1 << 30).ends_with("65536 0 1\n"));
    }

    /// Needs root and a kernel with idmapped mounts (CI's has them: this must not pass quietly
    /// elsewhere). Runs in a mount namespace of its own thread, so nothing leaks to the host.
    #[test]
    fn an_idmapped_bind_shows_disk_ids_shifted_into_the_range() {
        use std::os::unix::fs::MetadataExt;
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let dir = tempfile::tempdir().expect("tempdir");
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        std::fs::create_dir_all(&src).expect("src");
        std::fs::create_dir_all(&dst).expect("dst");
        std::fs::write(src.join("by-root"), b"x").expect("file");
        std::os::unix::fs::chown(src.join("by-root"), Some(0), Some(0)).expect("chown");
        std::fs::write(src.join("by-1000"), b"x").expect("file");
        std::os::unix::fs::chown(src.join("by-1000"), Some(1000), Some(1000)).expect("chown");
        let base = (1u32 << 30) + 3 * RANGE;
        let ns = make_userns(&mount_idmap(base)).expect("a user namespace (the child must end)");
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("mount namespace");
                nix::mount::mount(None::<&str>, "/", None::<&str>, nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE, None::<&str>)
                    .expect("private");
                idmapped_bind(&src, &dst, &ns).expect("idmapped bind");
                let uid = |name: &str| std::fs::metadata(dst.join(name)).expect("stat").uid();
                assert_eq!(uid("by-root"), base);
                assert_eq!(uid("by-1000"), base + 1000);
                // Root's new file lands as the daemon's disk id, never as a sandbox id.
                std::fs::write(dst.join("new"), b"y").expect("create through the mount");
                assert_eq!(std::fs::metadata(src.join("new")).expect("stat").uid(), DAEMON_DISK_ID);
            })
            .join()
            .expect("thread");
        });
        // The bind lived in the thread's own mount namespace only.
        assert_eq!(std::fs::metadata(dst.join("by-root")).map(|m| m.uid()).ok(), None, "the bind leaked to the test's namespace");
    }

    /// Needs root (CI runs as root: this must not pass quietly elsewhere).
    #[test]
    fn a_thread_acting_as_a_sandbox_root_creates_its_files_and_gets_its_identity_back() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let dir = tempfile::tempdir().expect("tempdir");
        let base = (1u32 << 30) + 7 * RANGE;
        let path = dir.path().join("f");
        std::thread::scope(|s| {
            s.spawn(|| {
                as_root_of(Some(base), || std::fs::write(&path, b"x")).expect("act").expect("write");
                std::fs::write(dir.path().join("g"), b"y").expect("write as root again");
            });
        });
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&path).expect("stat");
        assert_eq!((meta.uid(), meta.gid()), (base, base));
        let meta = std::fs::metadata(dir.path().join("g")).expect("stat");
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "the guard gave the thread its identity back");
    }
}
