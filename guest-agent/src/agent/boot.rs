//! Boot of the guest, as PID 1 of the initramfs: from a bare kernel to a root filesystem on the
//! sandbox's disk with cgroups, and the port to the host found.
//!
//! One linear recipe, [`boot`]; each step says why it sits where it does. Any failure is fatal
//! (the caller prints it on the console and powers off): a guest without its disk, its cgroups
//! or its port is of no use, and must not run commands with less isolation than asked for.

use sandbox_exec::sys::loopback_up;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{mount, MsFlags};

use super::cgroup::{self, SandboxCgroup};
use super::console::{self, log};
use super::machine::{self, Guest};
use super::{port, Agent};

/// Modules to load, one file name of `/modules` per line, in dependency order (written by
/// images/build-vm.sh from the kernel's modules.dep).
const MODULE_ORDER: &str = "/modules.order";
const MODULE_DIR: &str = "/modules";
/// The sandbox's disk: the first (only) virtio-blk device.
const ROOT_DEV: &str = "/dev/vda";
const NEWROOT: &str = "/newroot";
const DISK_TIMEOUT: Duration = Duration::from_secs(5);
const PORT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_HOSTNAME: &str = "sandbox";
/// Open files per process (the process tier's value).
const NOFILE: u64 = 65_536;

/// `_IOR(0x12, 114, size_t)`: size of a block device in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `_IOW('f', 16, __u64)`: grow a mounted ext4 filesystem to a number of blocks.
const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;

/// A boot step that failed.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {message}")]
pub struct BootError {
    pub step: &'static str,
    pub message: String,
}

fn step<T, E: std::fmt::Display>(step: &'static str, r: Result<T, E>) -> Result<T, BootError> {
    r.map_err(|e| BootError { step, message: e.to_string() })
}

/// A booted guest: the agent, and the device of the host's port.
pub struct Booted {
    pub agent: Arc<Agent>,
    pub port: PathBuf,
}

/// The program the kernel runs to load a module on demand; empty turns that off.
const MODPROBE_SYSCTL: &str = "/proc/sys/kernel/modprobe";

/// The recipe. See the module documentation.
pub fn boot() -> Result<Booted, BootError> {
    let t0 = Instant::now();
    // /dev first: the console for every later message, and the disk's device node.
    mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, Some("mode=0755"))?;
    console::open();
    stdio_to_console();
    mount_fs("proc", "/proc", "proc", MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)?;
    mount_fs("sysfs", "/sys", "sysfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)?;
    log!("kernel {} up {} ms", machine::kernel_release(), machine::uptime_ms());

    // The kernel is modular (the distribution's own): virtio transport, console and block
    // drivers, then ext4 and what it needs. Loading a driver probes its devices.
    load_modules(Path::new(MODULE_ORDER), Path::new(MODULE_DIR))?;
    let modules_ms = t0.elapsed().as_millis();

    let disk = wait_for(Path::new(ROOT_DEV), DISK_TIMEOUT)
        .ok_or(BootError { step: "wait for the disk", message: format!("{ROOT_DEV} did not appear within {} s", DISK_TIMEOUT.as_secs()) })?;
    mount_fs(disk.to_str().unwrap_or(ROOT_DEV), NEWROOT, "ext4", MsFlags::MS_NOATIME, None)?;
    let mounted_ms = t0.elapsed().as_millis();
    // The host sizes the disk to the sandbox's disk limit; the filesystem on the image is only
    // as big as its content. Growing online is a few writes of group descriptors.
    grow_filesystem(&disk, Path::new(NEWROOT))?;

    // The initramfs stays in memory after the switch; drop what we no longer need of it.
    free_initramfs();
    switch_root(Path::new(NEWROOT))?;
    // Every module the VM needs is loaded; the kernel must not start a usermode `modprobe`
    // for a name someone asks for (an interface, a socket family, a binary format). Such a
    // spawn is a process exec in the guest: 70-110 ms under TCG for a `SIOCGIFFLAGS` on an
    // absent eth0, and a way for code in the sandbox to make the kernel run a program.
    if let Err(e) = std::fs::write(MODPROBE_SYSCTL, "\n") {
        log!("cannot turn off module autoloading ({MODPROBE_SYSCTL}): {e}");
    }

    // Mounts that belong to the running system, now on the real root. /run first: the agent's
    // own cgroup2 mount lives below it.
    ensure_dir("/run", 0o755)?;
    mount_fs("tmpfs", "/run", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))?;
    ensure_dir("/run/sandboxd", 0o700)?;
    mount_fs("cgroup2", cgroup::MOUNT, "cgroup2", MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, Some("nsdelegate"))?;
    ensure_dir("/run/lock", 0o1777)?;
    ensure_dir("/tmp", 0o1777)?;
    populate_dev()?;
    set_hostname();
    // As in the process tier: plenty of open files per process, no core dumps. Every exec
    // inherits these from the agent.
    use nix::sys::resource::{setrlimit, Resource};
    step("rlimit nofile", setrlimit(Resource::RLIMIT_NOFILE, NOFILE, NOFILE))?;
    step("rlimit core", setrlimit(Resource::RLIMIT_CORE, 0, 0))?;
    if let Err(e) = loopback_up() {
        log!("cannot bring up lo: {e}");
    }

    // Every exec runs below this cgroup; without it there are no limits, so no agent.
    let sandbox = step("create the sandbox cgroup", SandboxCgroup::create(Path::new(cgroup::MOUNT)))?;
    // What programs inside read at /sys/fs/cgroup: the sandbox's cgroup (its limits at the top,
    // as the other tiers show theirs), read-only.
    bind_read_only(sandbox.dir(), Path::new(cgroup::VIEW))?;
    let root = step("open /", File::open("/"))?;
    let port = port::find(PORT_TIMEOUT).ok_or(BootError {
        step: "find the host port",
        message: format!("no virtio-serial port named {} within {} s", guest_agent::protocol::PORT_NAME, PORT_TIMEOUT.as_secs()),
    })?;
    log!("booted in {} ms (modules {modules_ms} ms, disk mounted at {mounted_ms} ms); kernel uptime {} ms", t0.elapsed().as_millis(), machine::uptime_ms());
    Ok(Booted { agent: Agent::new(sandbox, Box::new(Guest::new(root))), port })
}

/// Binds `source` over `target`, then makes that mount read-only (a bind takes no flags of its
/// own until remounted).
fn bind_read_only(source: &Path, target: &Path) -> Result<(), BootError> {
    let bind = |flags: MsFlags| {
        mount(Some(source), target, None::<&str>, flags, None::<&str>).map_err(|e| format!("{} on {}: {}", source.display(), target.display(), e.desc()))
    };
    step("bind", bind(MsFlags::MS_BIND))?;
    let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    step("remount read-only", mount(None::<&str>, target, None::<&str>, ro, None::<&str>).map_err(|e| format!("{}: {}", target.display(), e.desc())))
}

fn mount_fs(source: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) -> Result<(), BootError> {
    ensure_dir(target, 0o755)?;
    step("mount", mount(Some(source), target, Some(fstype), flags, data).map_err(|e| format!("{fstype} on {target}: {}", e.desc())))
}

fn ensure_dir(path: &str, mode: u32) -> Result<(), BootError> {
    match std::fs::create_dir(path) {
        Ok(()) => step("chmod", std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| format!("{path}: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(BootError { step: "mkdir", message: format!("{path}: {e}") }),
    }
}

/// fd 1 and 2 to the console (a panic message ends up there), fd 0 to /dev/null.
fn stdio_to_console() {
    let open = |path: &str, write: bool| std::fs::OpenOptions::new().read(!write).write(write).open(path);
    if let (Ok(null), Ok(console)) = (open("/dev/null", false), open("/dev/console", true)) {
        // SAFETY: dup2 onto the standard descriptors of this process, from fds we own.
        unsafe {
            libc::dup2(null.as_raw_fd(), 0);
            libc::dup2(console.as_raw_fd(), 1);
            libc::dup2(console.as_raw_fd(), 2);
        }
    }
}

/// Loads each module named in `order` from `dir`. A module that is already there (built in, or
/// loaded as a dependency) is fine; any other failure is logged and boot goes on — the step that
/// needs the module says what is missing.
fn load_modules(order: &Path, dir: &Path) -> Result<(), BootError> {
    let list = step("read the module list", std::fs::read_to_string(order).map_err(|e| format!("{}: {e}", order.display())))?;
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let path = dir.join(name);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                log!("module {}: {e}", path.display());
                continue;
            }
        };
        // SAFETY: finit_module with an fd we own and an empty NUL-terminated parameter string.
        let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), c"".as_ptr(), 0) };
        match Errno::result(rc) {
            Ok(_) | Err(Errno::EEXIST) => {}
            // A CPU-specific variant (crc32c-intel without SSE4.2): the generic one serves.
            Err(Errno::ENODEV) => log!("module {name}: no matching hardware, skipped"),
            Err(e) => log!("module {name}: {}", e.desc()),
        }
    }
    Ok(())
}

/// Waits, bounded, for a device node to appear.
fn wait_for(path: &Path, timeout: Duration) -> Option<PathBuf> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(500);
    loop {
        if path.exists() {
            return Some(path.to_path_buf());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Block count and block size from the ext4 superblock on `dev` (statfs leaves out the
/// filesystem's own metadata, so it cannot say whether the disk is bigger than the filesystem).
fn ext4_size(dev: &File) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::FileExt;
    let mut sb = [0u8; 1024];
    dev.read_exact_at(&mut sb, 1024)?;
    let le32 = |at: usize| u64::from(u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]));
    if sb[0x38..0x3a] != [0x53, 0xef] {
        return Err(std::io::Error::other("no ext4 superblock"));
    }
    let block_size = 1024u64 << le32(0x18);
    let incompat_64bit = le32(0x60) & 0x80 != 0;
    let blocks = le32(0x04) | if incompat_64bit { le32(0x150) << 32 } else { 0 };
    Ok((blocks, block_size))
}

/// Grows the ext4 filesystem on `disk`, mounted at `mountpoint`, to the whole disk, online.
fn grow_filesystem(disk: &Path, mountpoint: &Path) -> Result<(), BootError> {
    let dev = step("open the disk", File::open(disk))?;
    let mut disk_bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 into the pointed-to local.
    step("BLKGETSIZE64", Errno::result(unsafe { libc::ioctl(dev.as_raw_fd(), BLKGETSIZE64, &mut disk_bytes) }))?;
    let (blocks, block_size) = step("read the superblock", ext4_size(&dev))?;
    let target = disk_bytes / block_size;
    if target <= blocks {
        return Ok(());
    }
    let t0 = Instant::now();
    let dir = step("open the root", File::open(mountpoint))?;
    // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 from the pointed-to local.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), EXT4_IOC_RESIZE_FS, &target) };
    match Errno::result(rc) {
        Ok(_) => {
            let now = ext4_size(&dev).map(|(b, _)| b).unwrap_or(0);
            log!("grew the root filesystem from {} to {} MiB in {} ms", (blocks * block_size) >> 20, (now * block_size) >> 20, t0.elapsed().as_millis());
            Ok(())
        }
        // Not fatal: the sandbox runs, with less disk than its limit.
        Err(e) => {
            log!("cannot grow the root filesystem to {} MiB: {}", disk_bytes >> 20, e.desc());
            Ok(())
        }
    }
}

/// Deletes the agent binary, the modules and their list from the initramfs (its memory is not
/// freed otherwise). The running agent keeps its own inode.
fn free_initramfs() {
    let _ = std::fs::remove_dir_all(MODULE_DIR);
    let _ = std::fs::remove_file(MODULE_ORDER);
    let _ = std::fs::remove_file("/init");
}

/// Makes `new` the root: /dev, /proc and /sys move along, then `new` is moved over `/` and
/// entered. (pivot_root does not work from the initramfs, which cannot be unmounted.)
fn switch_root(new: &Path) -> Result<(), BootError> {
    for dir in ["dev", "proc", "sys"] {
        let target = new.join(dir);
        ensure_dir(target.to_str().unwrap_or_default(), 0o755)?;
        step(
            "move a mount into the new root",
            mount(Some(Path::new("/").join(dir).as_path()), &target, None::<&str>, MsFlags::MS_MOVE, None::<&str>).map_err(|e| format!("/{dir}: {}", e.desc())),
        )?;
    }
    step("chdir to the new root", nix::unistd::chdir(new))?;
    step("move the new root to /", mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>))?;
    step("chroot", nix::unistd::chroot("."))?;
    step("chdir /", nix::unistd::chdir("/"))?;
    Ok(())
}

/// What devtmpfs lacks and programs expect: ptys, /dev/shm, and the /dev/fd links (bash's
/// process substitution needs them).
fn populate_dev() -> Result<(), BootError> {
    ensure_dir("/dev/pts", 0o755)?;
    step("mount devpts", mount(Some("devpts"), "/dev/pts", Some("devpts"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("ptmxmode=0666,mode=0620,gid=5")))?;
    ensure_dir("/dev/shm", 0o1777)?;
    step("mount /dev/shm", mount(Some("shm"), "/dev/shm", Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777")))?;
    for (link, target) in
        [("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2")]
    {
        match std::os::unix::fs::symlink(target, link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(BootError { step: "symlink in /dev", message: format!("{link}: {e}") }),
        }
    }
    Ok(())
}

/// `sandbox`, until `Configure` names the sandbox (and writes its /etc/hostname). Not read from
/// the disk's /etc/hostname: that is sandbox content, and a fork's disk may hold a FIFO there,
/// on which a read would hang the boot.
fn set_hostname() {
    if let Err(e) = nix::unistd::sethostname(DEFAULT_HOSTNAME) {
        log!("sethostname {DEFAULT_HOSTNAME}: {e}");
    }
}

/// After a fatal boot error: give the console a moment, then power off, so the host sees the VM
/// end instead of waiting for an answer that will never come.
pub fn halt() -> ! {
    std::thread::sleep(Duration::from_millis(100));
    machine::sync();
    loop {
        // SAFETY: reboot(2) with a constant command.
        unsafe { libc::reboot(libc::RB_POWER_OFF) };
        std::thread::sleep(Duration::from_secs(1));
    }
}
