//! Small Linux helpers the process tier's init (in sandboxd) and the microVM guest agent share.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

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
