//! What only the real VM may do — freeze the root filesystem, power off — behind a small trait,
//! so request handling is testable on a developer's machine without freezing or powering off
//! that machine.

use std::fs::File;
use std::os::fd::AsRawFd;

use guest_agent::protocol::{ErrorKind, GuestNetwork};
use nix::errno::Errno;

use super::console::log;
use super::RequestError;

/// `_IOWR('X', 119, int)`: freeze a filesystem (flushes it first).
const FIFREEZE: libc::c_ulong = 0xC004_5877;
/// `_IOWR('X', 120, int)`: thaw it.
const FITHAW: libc::c_ulong = 0xC004_5878;

/// The VM-wide operations of the protocol.
pub trait Machine: Send + Sync {
    /// `sync`, then freeze the root filesystem.
    fn freeze(&self) -> Result<(), RequestError>;
    /// Thaw the root filesystem; thawing one that is not frozen is not an error.
    fn thaw(&self) -> Result<(), RequestError>;
    /// Sync and power off. Only returns where powering off is not possible (tests).
    fn power_off(&self);
    /// Steps the wall clock and reseeds the kernel RNG with `entropy` (see `Request::Resumed`).
    fn resumed(&self, unix_time_ns: u64, entropy: &[u8]) -> Result<(), RequestError>;
    /// Sets the hostname (the sandbox's id).
    fn set_hostname(&self, name: &str) -> Result<(), RequestError>;
    /// Sizes /dev/shm (a remount of its tmpfs).
    fn size_shm(&self, bytes: u64) -> Result<(), RequestError>;
    /// Configures `eth0` as `network` says, or takes it down (if there is one) for `None`.
    fn configure_network(&self, network: Option<&GuestNetwork>) -> Result<(), RequestError>;
}

/// The guest's network interface (the virtio-net device the host adds for a filtered network).
pub const NETWORK_INTERFACE: &str = "eth0";

/// The real VM: the root filesystem is the disk the agent switched into.
pub struct Guest {
    /// `/`, opened once after the switch of root (the ioctls need any fd on the filesystem).
    root: File,
}

impl Guest {
    pub fn new(root: File) -> Self {
        Guest { root }
    }

    fn ioctl(&self, request: libc::c_ulong) -> Result<(), Errno> {
        // SAFETY: FIFREEZE/FITHAW take no argument that is dereferenced; the fd is ours.
        Errno::result(unsafe { libc::ioctl(self.root.as_raw_fd(), request, 0) }).map(drop)
    }
}

impl Machine for Guest {
    fn freeze(&self) -> Result<(), RequestError> {
        sync();
        match self.ioctl(FIFREEZE) {
            // EBUSY: already frozen, which is what was asked.
            Ok(()) | Err(Errno::EBUSY) => Ok(()),
            Err(e) => Err(RequestError::new(ErrorKind::Internal, format!("FIFREEZE /: {}", e.desc()))),
        }
    }

    fn thaw(&self) -> Result<(), RequestError> {
        match self.ioctl(FITHAW) {
            // EINVAL: not frozen.
            Ok(()) | Err(Errno::EINVAL) => Ok(()),
            Err(e) => Err(RequestError::new(ErrorKind::Internal, format!("FITHAW /: {}", e.desc()))),
        }
    }

    fn power_off(&self) {
        // A frozen filesystem would make the sync wait forever.
        let _ = self.thaw();
        sync();
        log!("powering off");
        // SAFETY: reboot(2) with a constant command; the agent is PID 1 and holds CAP_SYS_BOOT.
        unsafe { libc::reboot(libc::RB_POWER_OFF) };
        // Not reached on success; if it failed there is nothing better to do than to halt here.
        log!("power off failed: {}", Errno::last());
    }

    fn set_hostname(&self, name: &str) -> Result<(), RequestError> {
        nix::unistd::sethostname(name).map_err(|e| RequestError::new(ErrorKind::BadRequest, format!("cannot set hostname {name:?}: {}", e.desc())))
    }

    fn resumed(&self, unix_time_ns: u64, entropy: &[u8]) -> Result<(), RequestError> {
        let internal = |what: &str, e: Errno| RequestError::new(ErrorKind::Internal, format!("{what}: {}", e.desc()));
        let ts = libc::timespec { tv_sec: (unix_time_ns / 1_000_000_000) as libc::time_t, tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long };
        // SAFETY: clock_settime reads the timespec we own.
        Errno::result(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) }).map_err(|e| internal("setting the clock", e))?;
        reseed(entropy).map_err(|e| internal("reseeding the kernel RNG", e))
    }

    fn configure_network(&self, network: Option<&GuestNetwork>) -> Result<(), RequestError> {
        let internal = |what: String, e: Errno| RequestError::new(ErrorKind::Internal, format!("{what}: {}", e.desc()));
        match network {
            Some(n) => {
                // The device's driver is loaded at boot; a VM the host gave a network has it.
                sandbox_exec::sys::configure_ipv4(NETWORK_INTERFACE, n.address, n.prefix_len, n.gateway)
                    .map_err(|e| internal(format!("configuring {NETWORK_INTERFACE} as {}/{} via {}", n.address, n.prefix_len, n.gateway), e))?;
                log!("{NETWORK_INTERFACE}: {}/{} via {}", n.address, n.prefix_len, n.gateway);
                Ok(())
            }
            None => sandbox_exec::sys::link_down(NETWORK_INTERFACE).map_err(|e| internal(format!("taking {NETWORK_INTERFACE} down"), e)),
        }
    }

    fn size_shm(&self, bytes: u64) -> Result<(), RequestError> {
        // Tmpfs pages are charged to the memory cgroup of the process that writes them, an
        // exec's under the sandbox's: a full /dev/shm is memory the sandbox uses, within its
        // limit, not more.
        let opts = format!("size={bytes}");
        let flags = nix::mount::MsFlags::MS_REMOUNT | nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV;
        nix::mount::mount(None::<&str>, "/dev/shm", None::<&str>, flags, Some(opts.as_str()))
            .map_err(|e| RequestError::new(ErrorKind::Internal, format!("cannot size /dev/shm to {bytes} bytes: {}", e.desc())))
    }
}

/// `_IOW('R', 0x03, int[2])`: add entropy to the input pool, credited.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// Most entropy bytes taken from the host at once.
pub const MAX_ENTROPY: usize = 512;

/// Credits `entropy` to the kernel's input pool and reseeds the CRNG from it at once.
fn reseed(entropy: &[u8]) -> Result<(), Errno> {
    if entropy.len() < 32 || entropy.len() > MAX_ENTROPY {
        return Err(Errno::EINVAL);
    }
    // struct rand_pool_info { int entropy_count (bits); int buf_size (bytes); u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    let random = std::fs::OpenOptions::new().write(true).open("/dev/urandom").map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of the size its header gives, which `info`
    // holds whole. The fd is ours.
    Errno::result(unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) })?;
    // SAFETY: RNDRESEEDCRNG takes no argument. The fd is ours.
    Errno::result(unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG, 0) }).map(drop)
}

/// Flushes every filesystem.
pub fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// The running kernel's release (`uname -r`).
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain old data; uname fills it and its fields are NUL-terminated.
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return String::new();
        }
        std::ffi::CStr::from_ptr(u.release.as_ptr()).to_string_lossy().into_owned()
    }
}

/// Milliseconds since the kernel booted, from /proc/uptime.
pub fn uptime_ms() -> u64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|f| f.parse::<f64>().ok()))
        .map(|secs| (secs * 1000.0) as u64)
        .unwrap_or(0)
}
