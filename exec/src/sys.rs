//! Small Linux helpers the process tier's init (in sandboxd) and the microVM guest agent share.
//!
//! The file helpers below work inside a root directory: every lookup of a path with more than
//! one component goes through [`open_in_root`], and everything else is an `*at` call on a
//! directory opened that way with a single-component name, so nothing outside the root is ever
//! reached, whatever symlinks the sandbox plants.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;

/// Symlinks followed at the end of a path before giving up with `ELOOP` (the kernel's limit).
pub const MAX_LINK_HOPS: usize = 40;
/// Longest name of one path component (`NAME_MAX`).
pub const NAME_MAX: usize = 255;

/// Opens `rel` below the directory `root` with `openat2(RESOLVE_IN_ROOT)`: `..` and symlinks,
/// absolute ones included, resolve as if `root` were `/`, so nothing outside is ever reached.
/// `O_CLOEXEC` is always added; `mode` applies with `O_CREAT`.
pub fn open_in_root(root: RawFd, rel: &str, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
    let c_path = CString::new(rel).map_err(|_| Errno::EINVAL)?;
    // SAFETY: open_how is plain old data; zero is valid for every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & libc::O_CREAT != 0 { u64::from(mode) } else { 0 };
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: openat2 with a valid dirfd, a NUL-terminated path and an open_how of the size
        // we pass.
        let fd = unsafe { libc::syscall(libc::SYS_openat2, root, c_path.as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>()) };
        match Errno::result(fd) {
            // SAFETY: the kernel returned a fresh descriptor that we now own.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
            Err(Errno::EAGAIN | Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Brings up the loopback interface of the current network namespace (sandboxes have no other
/// network, but programs expect localhost to work).
pub fn loopback_up() -> Result<(), Errno> {
    // SAFETY: plain socket call; the fd is wrapped in OwnedFd right away.
    let raw = Errno::result(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `raw` is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we pass, which outlives the calls.
    unsafe {
        Errno::result(libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr))?;
        ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        Errno::result(libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr))?;
    }
    Ok(())
}

/// An `AF_INET` datagram socket, the handle the interface and route ioctls take.
fn inet_socket() -> Result<OwnedFd, Errno> {
    // SAFETY: plain socket call; the fd is wrapped in OwnedFd right away.
    let raw = Errno::result(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `raw` is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// An `ifreq` naming `ifname` (at most 15 bytes, no NUL).
fn ifreq_for(ifname: &str) -> Result<libc::ifreq, Errno> {
    if ifname.is_empty() || ifname.len() >= libc::IFNAMSIZ || ifname.contains('\0') {
        return Err(Errno::EINVAL);
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(ifname.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(ifr)
}

/// A `sockaddr` holding the IPv4 address `addr` (port 0).
fn sockaddr_v4(addr: std::net::Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(addr).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain old data; the kernel reads
    // the family and then the sockaddr_in layout.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// The kernel's `struct rtentry` (linux/route.h), for `SIOCADDRT`/`SIOCDELRT`: glibc's libc
/// bindings do not carry it.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

// linux/route.h's layout on 64-bit targets.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<RtEntry>() == 120);

/// The default route via `gateway`, for `SIOCADDRT`/`SIOCDELRT`.
fn default_route(gateway: std::net::Ipv4Addr) -> RtEntry {
    let any = sockaddr_v4(std::net::Ipv4Addr::UNSPECIFIED);
    RtEntry {
        rt_pad1: 0,
        rt_dst: any,
        rt_gateway: sockaddr_v4(gateway),
        rt_genmask: any,
        rt_flags: libc::RTF_UP | libc::RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: std::ptr::null_mut(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    }
}

/// Gives interface `ifname` the address `addr`/`prefix_len` (replacing the one it had, and the
/// routes that went with it), brings it up, and makes `gateway` the default route — replacing a
/// default route an earlier configuration left. Used by the microVM guest agent at every
/// `Configure`: a VM resumed from a memory snapshot still holds its parent's address.
pub fn configure_ipv4(ifname: &str, addr: std::net::Ipv4Addr, prefix_len: u8, gateway: std::net::Ipv4Addr) -> Result<(), Errno> {
    if prefix_len == 0 || prefix_len > 30 {
        return Err(Errno::EINVAL);
    }
    let sock = inet_socket()?;
    let fd = sock.as_raw_fd();
    let mask = std::net::Ipv4Addr::from(u32::MAX << (32 - u32::from(prefix_len)));
    // SAFETY: each ioctl below reads or writes the ifreq/rtentry we pass, which outlives the
    // call; `fd` is our socket.
    unsafe {
        // Any default route first: it may name a gateway of the previous address.
        loop {
            let mut old = default_route(std::net::Ipv4Addr::UNSPECIFIED);
            old.rt_flags = libc::RTF_UP;
            match Errno::result(libc::ioctl(fd, libc::SIOCDELRT, &mut old)) {
                Ok(_) => continue,
                Err(Errno::ESRCH) => break,
                Err(e) => return Err(e),
            }
        }
        let mut ifr = ifreq_for(ifname)?;
        ifr.ifr_ifru.ifru_addr = sockaddr_v4(addr);
        Errno::result(libc::ioctl(fd, libc::SIOCSIFADDR, &ifr))?;
        let mut ifr = ifreq_for(ifname)?;
        ifr.ifr_ifru.ifru_netmask = sockaddr_v4(mask);
        Errno::result(libc::ioctl(fd, libc::SIOCSIFNETMASK, &ifr))?;
        let mut ifr = ifreq_for(ifname)?;
        Errno::result(libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr))?;
        ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        Errno::result(libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr))?;
        let mut route = default_route(gateway);
        match Errno::result(libc::ioctl(fd, libc::SIOCADDRT, &mut route)) {
            Ok(_) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Takes interface `ifname` down; one that does not exist is already down.
pub fn link_down(ifname: &str) -> Result<(), Errno> {
    let sock = inet_socket()?;
    let mut ifr = ifreq_for(ifname)?;
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we pass, which outlives the calls.
    unsafe {
        match Errno::result(libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr)) {
            Ok(_) => {}
            Err(Errno::ENODEV) => return Ok(()),
            Err(e) => return Err(e),
        }
        ifr.ifr_ifru.ifru_flags &= !((libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short);
        Errno::result(libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr))?;
    }
    Ok(())
}

/// Creates every missing directory of `dirs` (path components, already split) below `root`,
/// mode 0755, leaving existing ones as they are. Each lookup is confined to `root` and each
/// `mkdirat` creates one name in a directory opened that way, so nothing outside is touched.
/// A NUL byte in a component is `EINVAL`.
pub fn mkdir_all_in_root(root: RawFd, dirs: &[String]) -> Result<(), Errno> {
    for i in 0..dirs.len() {
        let prefix = dirs[..=i].join("/");
        match open_in_root(root, &prefix, libc::O_PATH | libc::O_DIRECTORY, 0) {
            Ok(_) => continue,
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(e),
        }
        let parent = if i == 0 { ".".to_string() } else { dirs[..i].join("/") };
        let parent_fd = open_in_root(root, &parent, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let name = CString::new(dirs[i].as_str()).map_err(|_| Errno::EINVAL)?;
        // SAFETY: mkdirat on a directory fd we own with a single-component name (no slash).
        let rc = unsafe { libc::mkdirat(parent_fd.as_raw_fd(), name.as_ptr(), 0o755) };
        match Errno::result(rc) {
            Ok(_) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where a file that is about to be written lives: its directory, opened confined to the root,
/// and its name there, once the last component was followed through symlinks (inside the root,
/// as `open(2)` would follow them).
#[derive(Debug)]
pub struct FileSlot {
    /// `O_PATH` descriptor of the directory that holds the file.
    pub dir: OwnedFd,
    /// The file's name in `dir`: one component.
    pub name: CString,
    /// What is there now, never a symlink or a directory; `None` when nothing is.
    pub existing: Option<libc::stat>,
}

/// `rel` of a list of components for [`open_in_root`] (`.` for none).
fn rel_path(comps: &[String]) -> String {
    if comps.is_empty() {
        ".".to_string()
    } else {
        comps.join("/")
    }
}

/// Splits a symlink target the way the kernel reads it: empty and `.` components dropped.
fn split_target(target: &str) -> impl Iterator<Item = String> + '_ {
    target.split('/').filter(|c| !c.is_empty() && *c != ".").map(str::to_string)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; `None` when nothing has that name.
pub fn stat_at(dir: RawFd, name: &CStr) -> Result<Option<libc::stat>, Errno> {
    // SAFETY: stat is plain old data; the kernel fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat on a directory fd with a NUL-terminated name, writing into `st`, which
    // outlives the call.
    let rc = unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    match Errno::result(rc) {
        Ok(_) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The file type bits of a stat (`S_IFREG`, `S_IFDIR`, …).
pub fn file_type(st: &libc::stat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

/// The target of the symlink `name` in `dir`. A target that is not UTF-8 is `EILSEQ`.
fn readlink_at(dir: RawFd, name: &CStr) -> Result<String, Errno> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: readlinkat writes at most `buf.len()` bytes into the buffer we own.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let n = Errno::result(n)? as usize;
    if n >= buf.len() {
        return Err(Errno::ENAMETOOLONG);
    }
    buf.truncate(n);
    String::from_utf8(buf).map_err(|_| Errno::EILSEQ)
}

/// Finds where a write to `comps` (below `root`) lands. A symlink as the last component is
/// followed, inside the root, up to [`MAX_LINK_HOPS`] times (`ELOOP` after); a directory, the
/// root itself or a path ending in `..` is `EISDIR`. Parents are not created here.
pub fn resolve_file_slot(root: RawFd, comps: &[String]) -> Result<FileSlot, Errno> {
    let mut comps = comps.to_vec();
    for _ in 0..=MAX_LINK_HOPS {
        let Some((name, dirs)) = comps.split_last() else { return Err(Errno::EISDIR) };
        if name == ".." {
            return Err(Errno::EISDIR);
        }
        let dir = open_in_root(root, &rel_path(dirs), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let c_name = CString::new(name.as_str()).map_err(|_| Errno::EINVAL)?;
        match stat_at(dir.as_raw_fd(), &c_name)? {
            None => return Ok(FileSlot { dir, name: c_name, existing: None }),
            Some(st) if file_type(&st) == libc::S_IFLNK => {
                let target = readlink_at(dir.as_raw_fd(), &c_name)?;
                // A relative target is relative to the link's directory: the same lexical
                // prefix, which `open_in_root` resolves to that directory again.
                let mut next: Vec<String> = if target.starts_with('/') { Vec::new() } else { dirs.to_vec() };
                next.extend(split_target(&target));
                comps = next;
            }
            Some(st) if file_type(&st) == libc::S_IFDIR => return Err(Errno::EISDIR),
            Some(st) => return Ok(FileSlot { dir, name: c_name, existing: Some(st) }),
        }
    }
    Err(Errno::ELOOP)
}

/// Opens the directory holding the last component of `comps` (confined to `root`) and returns
/// it with that component's name, without following the last component. The root itself and
/// a path ending in `..` are `EISDIR`.
pub fn open_parent_in_root(root: RawFd, comps: &[String]) -> Result<(OwnedFd, CString), Errno> {
    let Some((name, dirs)) = comps.split_last() else { return Err(Errno::EISDIR) };
    if name == ".." {
        return Err(Errno::EISDIR);
    }
    let dir = open_in_root(root, &rel_path(dirs), libc::O_PATH | libc::O_DIRECTORY, 0)?;
    let c_name = CString::new(name.as_str()).map_err(|_| Errno::EINVAL)?;
    Ok((dir, c_name))
}

/// `unlinkat(dir, name, 0)`: removes a file or symlink (never what a symlink points to).
pub fn unlink_at(dir: RawFd, name: &CStr) -> Result<(), Errno> {
    // SAFETY: unlinkat on a directory fd with a NUL-terminated single-component name.
    Errno::result(unsafe { libc::unlinkat(dir, name.as_ptr(), 0) }).map(drop)
}

/// Why [`remove_file_in_root`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveError {
    /// A directory: never removed through the file API.
    IsDirectory,
    /// A device, FIFO or socket.
    NotAFile,
    /// The lookup or the unlink failed.
    Sys(Errno),
}

/// Removes the regular file or symbolic link (the link itself, never its target) that `comps`
/// names below `root`, every lookup confined to it. A path that does not exist is not an error.
pub fn remove_file_in_root(root: RawFd, comps: &[String]) -> Result<(), RemoveError> {
    let (dir, name) = match open_parent_in_root(root, comps) {
        Ok(parent) => parent,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(RemoveError::Sys(e)),
    };
    let st = match stat_at(dir.as_raw_fd(), &name) {
        Ok(Some(st)) => st,
        Ok(None) => return Ok(()),
        Err(e) => return Err(RemoveError::Sys(e)),
    };
    match file_type(&st) {
        libc::S_IFREG | libc::S_IFLNK => {}
        libc::S_IFDIR => return Err(RemoveError::IsDirectory),
        _ => return Err(RemoveError::NotAFile),
    }
    match unlink_at(dir.as_raw_fd(), &name) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(RemoveError::Sys(e)),
    }
}

/// A temporary file being filled before it replaces its target.
#[derive(Debug)]
pub struct TempFile {
    /// Its name in the slot's directory (hidden, unique).
    pub name: CString,
    pub file: File,
}

/// Creates a hidden, uniquely named, empty file (mode 0600) in `dir` with `O_EXCL`: nothing
/// that already has the name — a file, a symlink planted by the sandbox — is ever opened.
pub fn create_temp_in(dir: RawFd) -> Result<TempFile, Errno> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    for _ in 0..8 {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(format!(".sbx-write-{}-{seq}-{nanos:08x}.tmp", std::process::id())).map_err(|_| Errno::EINVAL)?;
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: openat on a directory fd with a NUL-terminated single-component name.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, 0o600 as libc::c_uint) };
        match Errno::result(fd) {
            // SAFETY: the kernel returned a fresh descriptor that we now own.
            Ok(fd) => return Ok(TempFile { name, file: File::from(unsafe { OwnedFd::from_raw_fd(fd) }) }),
            Err(Errno::EEXIST | Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EEXIST)
}

/// Puts a filled temporary file in place of the slot's file: the owner of the file it replaces
/// (if any) is kept, `mode` is set (after the chown, which clears set-id bits), the data is
/// synced, and `renameat` swaps it in — atomically: a reader sees the old file or the new one,
/// never a mix. A symlink put there meanwhile is replaced itself, never followed. On error the
/// temporary file is left for the caller to remove.
pub fn commit_temp(slot: &FileSlot, temp: &TempFile, mode: u32) -> Result<(), Errno> {
    let fd = temp.file.as_raw_fd();
    if let Some(st) = &slot.existing {
        // SAFETY: fchown on a descriptor we own.
        Errno::result(unsafe { libc::fchown(fd, st.st_uid, st.st_gid) })?;
    }
    // SAFETY: fchmod on a descriptor we own.
    Errno::result(unsafe { libc::fchmod(fd, (mode & 0o7777) as libc::mode_t) })?;
    temp.file.sync_all().map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let dir = slot.dir.as_raw_fd();
    // SAFETY: renameat between two single-component names in the same directory fd.
    Errno::result(unsafe { libc::renameat(dir, temp.name.as_ptr(), dir, slot.name.as_ptr()) }).map(drop)
}

/// Writes `content` to a fresh temporary file beside the slot's file and replaces it with
/// [`commit_temp`]. On any failure the temporary file is removed and the old file (if any) is
/// exactly as it was.
pub fn replace_file(slot: &FileSlot, content: &[u8], mode: u32) -> Result<(), Errno> {
    use std::io::Write;
    let mut temp = create_temp_in(slot.dir.as_raw_fd())?;
    let done = temp.file.write_all(content).map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))).and_then(|()| commit_temp(slot, &temp, mode));
    if done.is_err() {
        let _ = unlink_at(slot.dir.as_raw_fd(), &temp.name);
    }
    done
}

/// `openat2` of `rel` below the directory `dir` with no symbolic link anywhere on the way, the
/// last component included (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`): a symlink is `ELOOP`, a
/// `..` or absolute path leaving `dir` is `EXDEV`. Unlike [`open_in_root`], which resolves the
/// sandbox's links the way the sandbox would, this is for paths that must be made of real
/// directories (an archive's entries): following any link there would let an earlier entry, or
/// the sandbox, redirect a later one. `O_CLOEXEC` is always added.
pub fn open_beneath_no_symlinks(dir: RawFd, rel: &CStr, flags: i32) -> Result<OwnedFd, Errno> {
    // SAFETY: open_how is plain old data; zero is valid for every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: openat2 with a directory fd, a NUL-terminated path and an open_how of the size
        // we pass.
        let fd = unsafe { libc::syscall(libc::SYS_openat2, dir, rel.as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>()) };
        match Errno::result(fd) {
            // SAFETY: the kernel returned a fresh descriptor that we now own.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
            Err(Errno::EAGAIN | Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// `fstat` of a descriptor (`O_PATH` ones included).
pub fn fstat_fd(fd: RawFd) -> Result<libc::stat, Errno> {
    // SAFETY: stat is plain old data; the kernel fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into `st`, which outlives the call.
    Errno::result(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

/// The target of the symlink `name` in `dir`, as raw bytes (a sandbox's link targets need not
/// be UTF-8). A target of `PATH_MAX` bytes or more is `ENAMETOOLONG`.
pub fn readlink_bytes_at(dir: RawFd, name: &CStr) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: readlinkat writes at most `buf.len()` bytes into the buffer we own.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let n = Errno::result(n)? as usize;
    if n >= buf.len() {
        return Err(Errno::ENAMETOOLONG);
    }
    buf.truncate(n);
    Ok(buf)
}

/// Whether `fd` lives on a kernel pseudo-filesystem (procfs, sysfs, cgroupfs, debugfs, tracefs,
/// securityfs, bpffs, selinuxfs, smackfs). A container's `/proc` and `/sys` are reachable through
/// its root, and the daemon acting there as host root would read or change what code in the
/// sandbox itself may not.
pub fn on_kernel_fs(fd: RawFd) -> Result<bool, Errno> {
    use nix::sys::statfs::{self as sfs, FsType};
    const KERNEL: [FsType; 10] = [
        sfs::PROC_SUPER_MAGIC,
        sfs::SYSFS_MAGIC,
        sfs::CGROUP_SUPER_MAGIC,
        sfs::CGROUP2_SUPER_MAGIC,
        sfs::DEBUGFS_MAGIC,
        sfs::TRACEFS_MAGIC,
        sfs::SECURITYFS_MAGIC,
        sfs::BPF_FS_MAGIC,
        sfs::SELINUX_MAGIC,
        sfs::SMACK_MAGIC,
    ];
    // SAFETY: the caller's descriptor stays open for this call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    Ok(KERNEL.contains(&sfs::fstatfs(fd)?.filesystem_type()))
}

/// Opens for reading exactly the inode an `O_PATH` descriptor refers to, through
/// `/proc/self/fd`, and checks it is a regular file. Looking at a name with `O_PATH` first and
/// reopening it this way means a device node or FIFO swapped in by the sandbox is never opened
/// (opening some devices acts: a watchdog arms itself); `O_NONBLOCK | O_NOCTTY` besides, in case.
/// Anything but a regular file is `EINVAL`; a `/proc` that yields another inode is `EXDEV`.
pub fn reopen_regular_for_reading(path_fd: RawFd) -> Result<(File, libc::stat), Errno> {
    let before = fstat_fd(path_fd)?;
    if file_type(&before) != libc::S_IFREG {
        return Err(Errno::EINVAL);
    }
    let proc_path = CString::new(format!("/proc/self/fd/{path_fd}")).map_err(|_| Errno::EINVAL)?;
    // SAFETY: open with a NUL-terminated path; the descriptor is wrapped right away.
    let fd = Errno::result(unsafe { libc::open(proc_path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK) })?;
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let after = fstat_fd(file.as_raw_fd())?;
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) {
        return Err(Errno::EXDEV);
    }
    Ok((file, after))
}

/// `openat(dir, name, flags)` of one name (no slash) in a directory we hold, `O_CLOEXEC` added.
/// The caller adds `O_NOFOLLOW` (and `O_DIRECTORY` or `O_PATH`) to say what may be opened.
pub fn open_at(dir: RawFd, name: &CStr, flags: i32) -> Result<OwnedFd, Errno> {
    loop {
        // SAFETY: openat on a directory fd with a NUL-terminated name; no O_CREAT, so no mode.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC) };
        match Errno::result(fd) {
            // SAFETY: the kernel returned a fresh descriptor that we now own.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Creates the file `name` in `dir` (mode 0600 until the caller sets its own) with
/// `O_CREAT | O_EXCL | O_NOFOLLOW`: it fails with `EEXIST` when anything has that name, a
/// dangling symlink included, so nothing existing is ever opened for writing.
pub fn create_new_at(dir: RawFd, name: &CStr) -> Result<File, Errno> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC;
    loop {
        // SAFETY: openat on a directory fd with a NUL-terminated single-component name.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, 0o600 as libc::c_uint) };
        match Errno::result(fd) {
            // SAFETY: the kernel returned a fresh descriptor that we now own.
            Ok(fd) => return Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) })),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn comps(path: &str) -> Vec<String> {
        path.split('/').filter(|c| !c.is_empty()).map(str::to_string).collect()
    }

    fn root_fd(dir: &std::path::Path) -> File {
        File::open(dir).expect("open root")
    }

    #[test]
    fn replace_keeps_the_owner_sets_the_mode_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("f"), b"old").expect("write");
        std::os::unix::fs::chown(dir.path().join("f"), Some(1234), Some(4321)).ok();
        let owner = std::fs::metadata(dir.path().join("f")).map(|m| (m.uid(), m.gid())).expect("stat");
        let root = root_fd(dir.path());
        let slot = resolve_file_slot(root.as_raw_fd(), &comps("f")).expect("slot");
        assert!(slot.existing.is_some());
        replace_file(&slot, b"new content", 0o640).expect("replace");
        let meta = std::fs::metadata(dir.path().join("f")).expect("stat");
        assert_eq!(std::fs::read(dir.path().join("f")).expect("read"), b"new content");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
        assert_eq!((meta.uid(), meta.gid()), owner);
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, ["f"], "no temporary file is left");
    }

    #[test]
    fn last_component_links_are_followed_inside_the_root_and_loops_end() {
        let outer = tempfile::tempdir().expect("tempdir");
        let r = outer.path().join("root");
        std::fs::create_dir_all(r.join("d")).expect("mkdir");
        std::os::unix::fs::symlink("/d/target", r.join("abs")).expect("symlink");
        std::os::unix::fs::symlink("../../../d/rel-target", r.join("d/rel")).expect("symlink");
        std::os::unix::fs::symlink("loop-b", r.join("loop-a")).expect("symlink");
        std::os::unix::fs::symlink("loop-a", r.join("loop-b")).expect("symlink");
        std::os::unix::fs::symlink("/d", r.join("to-dir")).expect("symlink");
        let root = root_fd(&r);
        let slot = resolve_file_slot(root.as_raw_fd(), &comps("abs")).expect("abs");
        replace_file(&slot, b"a", 0o644).expect("write");
        assert_eq!(std::fs::read(r.join("d/target")).expect("read"), b"a");
        let slot = resolve_file_slot(root.as_raw_fd(), &comps("d/rel")).expect("rel");
        replace_file(&slot, b"b", 0o644).expect("write");
        assert_eq!(std::fs::read(r.join("d/rel-target")).expect("read"), b"b", "`..` clamped at the root");
        assert!(std::fs::symlink_metadata(r.join("abs")).expect("lstat").file_type().is_symlink(), "the link itself stays");
        assert_eq!(resolve_file_slot(root.as_raw_fd(), &comps("loop-a")).map(drop), Err(Errno::ELOOP));
        assert_eq!(resolve_file_slot(root.as_raw_fd(), &comps("to-dir")).map(drop), Err(Errno::EISDIR));
        assert_eq!(resolve_file_slot(root.as_raw_fd(), &[]).map(drop), Err(Errno::EISDIR));
        assert_eq!(resolve_file_slot(root.as_raw_fd(), &comps("d/..")).map(drop), Err(Errno::EISDIR));
    }

    #[test]
    fn temp_names_are_exclusive_and_unlink_does_not_follow_links() {
        let outer = tempfile::tempdir().expect("tempdir");
        std::fs::write(outer.path().join("precious"), b"keep").expect("write");
        let dir = File::open(outer.path()).expect("open");
        let a = create_temp_in(dir.as_raw_fd()).expect("temp");
        let b = create_temp_in(dir.as_raw_fd()).expect("temp");
        assert_ne!(a.name, b.name);
        assert!(a.name.to_bytes().starts_with(b"."), "hidden");
        std::os::unix::fs::symlink(outer.path().join("precious"), outer.path().join("link")).expect("symlink");
        let link = CString::new("link").expect("cstring");
        unlink_at(dir.as_raw_fd(), &link).expect("unlink");
        assert_eq!(std::fs::read(outer.path().join("precious")).expect("read"), b"keep");
        assert_eq!(stat_at(dir.as_raw_fd(), &link), Ok(None));
    }
}
