//! The in-sandbox side of the process tier: the sandbox's PID 1.
//!
//! Every init is forked by the zygote ([`super::zygote`]), one small single-threaded process
//! the daemon starts once, which clones it straight into a new pid namespace (and user
//! namespace) with the control socket on fd 3: everything after that clone is safe here, unlike
//! forking the multi-threaded daemon, and no per-sandbox shim stays behind (the zygote reaps
//! every init and tells the daemon). The init reads its [`InitConfig`], builds the sandbox
//! around itself ([`setup`], one linear recipe) and then serves `Spawn` requests: each exec is
//! a fork of this process, which already sits in every namespace, behind pivot_root, with
//! capabilities dropped and seccomp on — the exec child inherits all of it and only has to join
//! its own cgroup and `execve`.
//!
//! Nothing here may panic or `unwrap`: after the fork an error that is not sent back over the
//! control socket is lost, so every failure becomes a `SetupFailed` / `SpawnFailed` message.

use sandbox_exec::sys::loopback_up;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{fork, ForkResult, Pid};

use super::wire::{decode, encode, recv_raw, send_raw, FromInit, InitConfig, ToInit, MAX_MESSAGE};
use crate::backend::cgroup::CgroupView;
use crate::backend::seccomp;

/// The control socket's descriptor number in the init.
pub const CONTROL_FD: RawFd = 3;

use sandbox_exec::spawn::{self, ChildFds, Command, Stage};

/// Capabilities processes in a sandbox keep: Docker's default set minus CAP_MKNOD (device nodes
/// are provided; one made by the sandbox could be opened by the daemon's file API) and CAP_NET_RAW.
const KEPT_CAPS: [caps::Capability; 11] = [
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_FOWNER,
    caps::Capability::CAP_FSETID,
    caps::Capability::CAP_KILL,
    caps::Capability::CAP_SETGID,
    caps::Capability::CAP_SETUID,
    caps::Capability::CAP_SETPCAP,
    caps::Capability::CAP_NET_BIND_SERVICE,
    caps::Capability::CAP_SYS_CHROOT,
    caps::Capability::CAP_SETFCAP,
];

/// Sends `msg` with `fd` attached (the terminal of a `tty` spawn).
fn report_with(ctrl: &OwnedFd, msg: &FromInit, fd: Option<&OwnedFd>) {
    let fds: Vec<RawFd> = fd.map(|f| f.as_raw_fd()).into_iter().collect();
    report_fds(ctrl, msg, &fds)
}

fn report(ctrl: &OwnedFd, msg: &FromInit) {
    report_with(ctrl, msg, None)
}

/// Sends `msg` with `fds` attached.
fn report_fds(ctrl: &OwnedFd, msg: &FromInit, fds: &[RawFd]) {
    if let Err(e) = encode(msg).and_then(|bytes| send_raw(ctrl.as_fd(), &bytes, fds)) {
        eprintln!("sandbox-init: cannot report {msg:?}: {e}");
    }
}

fn setup_failed(ctrl: &OwnedFd, stage: &str, err: impl std::fmt::Display) -> i32 {
    let message = err.to_string();
    eprintln!("sandbox-init: setup failed at {stage}: {message}");
    report(ctrl, &FromInit::SetupFailed { stage: stage.to_string(), message });
    1
}

/// The init, from its first step: the zygote's clone put it in its namespaces with the control
/// socket on fd 3 and nothing else open but stdio. Reads the configuration (and the cgroup
/// fds) the daemon sends, then sets up and serves. Returns the exit code.
pub(super) fn run(ctrl: OwnedFd) -> i32 {
    let mut buf = vec![0u8; 64 << 10];
    let (n, cgroup_fds) = match recv_raw(ctrl.as_fd(), &mut buf) {
        Ok(Some(m)) => m,
        Ok(None) => return 1,
        Err(e) => return setup_failed(&ctrl, "config", e),
    };
    let cfg: InitConfig = match decode(&buf[..n]) {
        Ok(c) => c,
        Err(e) => return setup_failed(&ctrl, "config", e),
    };
    drop(buf);
    init(ctrl, cfg, cgroup_fds)
}

/// Clones the init into a new pid namespace, and with `id_base` a new user namespace too,
/// created together so the pid namespace is the user namespace's (root inside may then mount
/// its /proc). A raw clone rather than `unshare` + `fork`: the caller (the zygote) clones many
/// inits, and `unshare(CLONE_NEWPID)` could be done only once. The child returns only once its
/// uid and gid maps are written. The caller must be single-threaded.
pub(super) fn clone_init(id_base: Option<u32>) -> Result<ForkResult, (&'static str, Errno)> {
    let Some(base) = id_base else {
        // SAFETY: a raw clone behaves like fork here (no new stack, SIGCHLD); the caller is
        // single-threaded, so the child may do anything after it.
        let pid = unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWPID | libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize) };
        return match pid {
            0 => Ok(ForkResult::Child),
            p if p < 0 => Err(("clone the init into a pid namespace", Errno::last())),
            p => Ok(ForkResult::Parent { child: Pid::from_raw(p as libc::pid_t) }),
        };
    };
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| ("pipe", e))?;
    // A user namespace belongs to the effective uid that creates it, and what the kernel counts
    // per user for it (inotify instances and watches, user namespaces, message queues) is
    // charged to that uid: the range's root, not the host's. The file system uid stays 0 so the
    // init still reaches the rootfs and the CPU list below the daemon's 0700 state dir (as their
    // owner) until it becomes root inside (`become_root_inside`).
    // SAFETY: setresuid / setfsuid with integer arguments; the real and saved uids stay 0, so
    // the effective uid (and the capabilities) come back below.
    Errno::result(unsafe { libc::setresuid(u32::MAX, base, u32::MAX) }).map_err(|e| ("take the range's uid", e))?;
    // SAFETY: as above.
    unsafe { libc::setfsuid(0) };
    // SAFETY: a raw clone behaves like fork here (no new stack, SIGCHLD); the caller is
    // single-threaded, so the child may do anything after it.
    let pid = unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize) };
    let clone_errno = Errno::last();
    if pid == 0 {
        drop(ready_w);
        let mut byte = [0u8; 1];
        return match nix::unistd::read(ready_r.as_raw_fd(), &mut byte) {
            Ok(1) => Ok(ForkResult::Child),
            // The zygote could not write the maps (and said so): nothing to do here.
            _ => std::process::exit(1),
        };
    }
    // SAFETY: back to root: the real uid is 0, so this is always allowed.
    Errno::result(unsafe { libc::setresuid(u32::MAX, 0, u32::MAX) }).map_err(|e| ("give back the range's uid", e))?;
    if pid < 0 {
        return Err(("clone the init into user and pid namespaces", clone_errno));
    }
    let child = Pid::from_raw(pid as libc::pid_t);
    let map = super::idmap::process_idmap(base);
    let written = std::fs::write(format!("/proc/{pid}/uid_map"), &map).and_then(|()| std::fs::write(format!("/proc/{pid}/gid_map"), &map));
    if let Err(e) = written {
        let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
        return Err(("write the user namespace's id maps", Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))));
    }
    nix::unistd::write(&ready_w, b"1").map_err(|e| ("start the init", e))?;
    Ok(ForkResult::Parent { child })
}

/// In a user namespace, becomes root inside (the range's first id outside) with no
/// supplementary groups. From here the file system ids are the range's: files the init creates
/// belong to root inside, and paths only the host's root may reach are out of reach.
fn become_root_inside() -> StageResult {
    // SAFETY: setgroups with an empty list (a null pointer is fine for 0 entries).
    stage("setgroups", Errno::result(unsafe { libc::setgroups(0, std::ptr::null()) }))?;
    // SAFETY: setresgid / setresuid with integer arguments; 0 is mapped in our namespace.
    stage("setresgid", Errno::result(unsafe { libc::setresgid(0, 0, 0) }))?;
    // SAFETY: as above.
    stage("setresuid", Errno::result(unsafe { libc::setresuid(0, 0, 0) }))?;
    // A credential change clears the parent-death signal: set it again.
    // SAFETY: prctl with integer arguments only.
    stage("pdeathsig", Errno::result(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) }))?;
    Ok(())
}

/// A child that ended: its exit code, or the signal that killed it.
pub(super) struct Ended {
    pub pid: Pid,
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// `waitpid(pid, flags)` for an ended child (stopped and continued children are skipped).
/// Raw rather than nix's, which refuses to decode a death by a real-time signal (34-64) — and
/// by then the child is already reaped, so its end would be lost and its exec never finish.
pub(super) fn wait_child(pid: libc::pid_t, flags: libc::c_int) -> Result<Option<Ended>, Errno> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid pointer to a local.
        let got = Errno::result(unsafe { libc::waitpid(pid, &mut status, flags) })?;
        if got == 0 {
            return Ok(None);
        }
        let pid = Pid::from_raw(got);
        if libc::WIFEXITED(status) {
            return Ok(Some(Ended { pid, code: Some(libc::WEXITSTATUS(status)), signal: None }));
        }
        if libc::WIFSIGNALED(status) {
            return Ok(Some(Ended { pid, code: None, signal: Some(libc::WTERMSIG(status)) }));
        }
    }
}

/// PID 1 of the sandbox: set up, say ready, serve.
fn init(ctrl: OwnedFd, cfg: InitConfig, cgroup_fds: Vec<OwnedFd>) -> i32 {
    if let Err((stage, err)) = setup(&cfg, cgroup_fds) {
        return setup_failed(&ctrl, stage, err);
    }
    // What setup allocated is garbage now, but its pages stay this process's own copies (written
    // after the fork from the zygote) until given back: ~40 KiB per idle sandbox.
    drop(cfg);
    trim_heap();
    report(&ctrl, &FromInit::Ready);
    serve(ctrl)
}

/// Gives the heap's free pages back to the kernel.
fn trim_heap() {
    // SAFETY: malloc_trim only releases memory malloc holds free; no live allocation moves.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

type StageResult = Result<(), (&'static str, String)>;

fn stage<T, E: std::fmt::Display>(name: &'static str, r: Result<T, E>) -> Result<T, (&'static str, String)> {
    r.map_err(|e| (name, e.to_string()))
}

/// Builds the sandbox around this process. The order matters; each step says why it is here.
fn setup(cfg: &InitConfig, cgroup_fds: Vec<OwnedFd>) -> StageResult {
    // If the zygote dies (killed from outside, or the daemon went away), take the sandbox down
    // with it rather than leave an init nobody waits for. The zygote is single-threaded, so
    // "parent thread exits" cannot fire early.
    // SAFETY: prctl with integer arguments only.
    stage("pdeathsig", Errno::result(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) }))?;

    // Join the sandbox cgroup before unsharing the cgroup namespace, so the namespace's root is
    // the sandbox's cgroup and processes inside cannot see or name the host's hierarchy: its
    // /sys/fs/cgroup (mounted below) shows the sandbox's own limits at its top.
    let (before, after) = cgroup_fds.split_at(cfg.join_before_unshare.min(cgroup_fds.len()));
    for fd in before {
        stage("join cgroup", nix::unistd::write(fd, b"0"))?;
    }
    stage(
        "unshare namespaces",
        unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWCGROUP),
    )?;
    // v2: on into the leaf, so the sandbox's cgroup holds no process and the daemon can enable
    // its controllers for the exec cgroups ("no internal processes").
    for fd in after {
        stage("join leaf cgroup", nix::unistd::write(fd, b"0"))?;
    }
    drop(cgroup_fds);
    // The CPUs programs see (nproc, sched_getaffinity, the JVM, Go): the limit rounded up, on
    // the CPUs the daemon chose. Every exec is a fork of this process and inherits it. The CFS
    // quota stays the real limit; this is what programs size their thread pools by.
    stage("set CPU affinity", set_affinity(&cfg.cpus))?;

    // Nothing mounted from here on may propagate back to the host (its / is usually shared).
    stage("make mounts private", mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>))?;
    stage("sethostname", nix::unistd::sethostname(&cfg.hostname))?;
    // A new network namespace has only `lo`, and it is down.
    stage("bring up lo", loopback_up())?;

    // From here on the rootfs is the working directory and everything below it is named
    // relative to it: with a user namespace, the host path (below the daemon's 0700 state dir)
    // is reachable only until the init becomes root inside.
    // The rootfs bound onto itself first: a mount made in this namespace, which pivot_root
    // takes (the copy of the daemon's overlay mount is locked in a user namespace).
    let rootfs = Path::new(&cfg.rootfs);
    stage("bind the rootfs onto itself", mount(Some(rootfs), rootfs, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>))?;
    stage("chdir rootfs", nix::unistd::chdir(rootfs))?;
    let root = Path::new(".");
    // /sys after the network namespace (sysfs shows its devices) and the cgroup namespace (the
    // cgroup mounts show its root).
    mount_sys(root, cfg)?;
    if cfg.id_base.is_some() {
        become_root_inside()?;
    }
    // /dev before /proc: masking /proc files binds /dev/null over them.
    mount_dev(root, cfg.shm_bytes, cfg.id_base.is_some())?;
    mask_sys(root)?;
    bind_cpu_list(root, cfg)?;
    mount_proc(root)?;
    mount_cgroup(root, cfg)?;

    // pivot_root, not chroot: afterwards the old root is unmounted and unreachable, even for a
    // process that keeps a directory fd or has CAP_SYS_CHROOT.
    // SAFETY: pivot_root with two valid C strings; "." "." stacks the old root under the new one.
    stage("pivot_root", Errno::result(unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) }))?;
    stage("unmount old root", umount2(".", MntFlags::MNT_DETACH))?;
    stage("chdir /", nix::unistd::chdir("/"))?;

    // /etc/hostname and /etc/hosts name this sandbox (a fork's files name its parent): written
    // here, where no path leads out of the sandbox, and without following anything in /etc
    // (see sandbox_exec::etc). A sandbox that broke its own /etc gets a line in the init log
    // and starts anyway: the name not resolving is its own doing, not less isolation.
    match std::fs::File::open("/") {
        Ok(dir) => {
            if let Err(e) = sandbox_exec::etc::write_identity(dir.as_raw_fd(), &cfg.hostname) {
                eprintln!("sandbox-init: cannot write /etc/hostname and /etc/hosts: {e}");
            }
        }
        Err(e) => eprintln!("sandbox-init: cannot open /: {e}"),
    }

    use nix::sys::resource::{setrlimit, Resource};
    // Bounded open files per process (lowering is always allowed; raising may not be).
    let (_, hard) = stage("getrlimit nofile", nix::sys::resource::getrlimit(Resource::RLIMIT_NOFILE))?;
    let nofile = hard.min(65_536);
    stage("rlimit nofile", setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile))?;
    stage("rlimit core", setrlimit(Resource::RLIMIT_CORE, 0, 0))?;
    nix::sys::stat::umask(Mode::from_bits_truncate(0o022));

    // (SIGCHLD is blocked and read through a signalfd by the serve loop, `child_signals`; exec
    // children unblock it again.)

    // Capabilities last among the privileged steps: mounts and hostname above needed them.
    drop_capabilities()?;
    // SAFETY: prctl with integer arguments only.
    stage("no_new_privs", Errno::result(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }))?;
    // Out of reach of the code it runs: exec'd code has the init's uid and capabilities, so
    // only dumpability stands between it and ptrace, pidfd_getfd, /proc/1/{fd,mem,exe,environ}
    // of the init (and so the control socket). A non-dumpable process can be inspected only with
    // CAP_SYS_PTRACE, which nothing in the sandbox has. Set after every credential change above
    // (a capset may reset it); exec children get a dumpable state again from their own execve,
    // so strace and gdb work on them inside.
    // SAFETY: prctl with integer arguments only.
    stage("not dumpable", Errno::result(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }))?;
    // Seccomp at the very end: the filter denies mount and friends, which setup used.
    stage("seccomp", seccomp::install())?;
    Ok(())
}

fn mount_proc(root: &Path) -> StageResult {
    let proc_dir = root.join("proc");
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // Mounted after the pid namespace exists, so it shows the sandbox's processes only.
    stage("mount /proc", mount(Some("proc"), &proc_dir, Some("proc"), nosuid_nodev_noexec, None::<&str>))?;
    // Hide what leaks host state or lets root inside poke the kernel (as Docker does).
    for masked in ["kcore", "keys", "timer_list", "sched_debug"] {
        let target = proc_dir.join(masked);
        if target.exists() {
            stage("mask /proc file", mount(Some(&root.join("dev/null")), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
        }
    }
    for ro in ["sys", "sysrq-trigger", "irq", "bus", "fs"] {
        let target = proc_dir.join(ro);
        if target.exists() {
            stage("bind /proc read-only", mount(Some(&target), &target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>))?;
            stage(
                "remount /proc read-only",
                mount(None::<&str>, &target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid_nodev_noexec, None::<&str>),
            )?;
        }
    }
    Ok(())
}

/// A minimal /dev on its own tmpfs: the usual character devices, a private devpts and
/// `/dev/shm`. In a user namespace no device node can be made (mknod needs the host's
/// CAP_MKNOD): the host's own nodes are bound instead, which root inside can open but not
/// change (they belong to an id its namespace does not map).
///
/// `/dev/shm` is a directory of the same tmpfs, which is `shm_bytes` large (what `df /dev/shm`
/// shows; the few entries of /dev take no blocks): one superblock less per sandbox. Every
/// superblock registers a shrinker, and every memory cgroup on the host keeps a map of them
/// all, so with thousands of sandboxes each superblock per sandbox costs the kernel ~16 bytes ×
/// sandboxes × memory cgroups. Nothing is lost by sharing: /dev is as writable as /dev/shm, and
/// not `nodev` either way (the device nodes are on it).
fn mount_dev(root: &Path, shm_bytes: u64, in_userns: bool) -> StageResult {
    let dev = root.join("dev");
    // Sized from the sandbox's limits (half of its memory by default). Not a way around the
    // memory limit: tmpfs pages are charged to the memory cgroup of the process that first
    // touches them, the sandbox's, so a full /dev/shm counts as memory the sandbox uses (and
    // the size is never above its memory limit). 0 would mean "unlimited" to tmpfs: refused.
    if shm_bytes == 0 {
        return Err(("mount /dev", "a /dev/shm of 0 bytes would have no size limit".to_string()));
    }
    let opts = format!("mode=755,size={shm_bytes}");
    stage("mount /dev", mount(Some("tmpfs"), &dev, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME, Some(opts.as_str())))?;
    for (name, major, minor) in [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)] {
        let path = dev.join(name);
        if in_userns {
            stage("create a device's mount point", std::fs::File::create(&path))?;
            stage("bind a host device", mount(Some(&Path::new("/dev").join(name)), &path, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
            continue;
        }
        stage("mknod", mknod(&path, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(major, minor)))?;
        stage("chmod device", nix::sys::stat::fchmodat(None, &path, Mode::from_bits_truncate(0o666), nix::sys::stat::FchmodatFlags::FollowSymlink))?;
    }
    for dir in ["pts", "shm"] {
        stage("mkdir /dev subdir", nix::unistd::mkdir(&dev.join(dir), Mode::from_bits_truncate(0o755)))?;
    }
    stage(
        "mount devpts",
        mount(Some("devpts"), &dev.join("pts"), Some("devpts"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("newinstance,ptmxmode=0666,mode=0620")),
    )?;
    stage("chmod /dev/shm", nix::sys::stat::fchmodat(None, &dev.join("shm"), Mode::from_bits_truncate(0o1777), nix::sys::stat::FchmodatFlags::FollowSymlink))?;
    for (link, target) in
        [("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]
    {
        stage("symlink in /dev", std::os::unix::fs::symlink(target, dev.join(link)))?;
    }
    Ok(())
}

/// /sys as Docker shows it: sysfs read-only (of the sandbox's network namespace: only `lo`
/// under class/net; without a link, the daemon's shared one, which shows the same), Docker's
/// masked paths covered, the sandbox's own cgroup read-only at /sys/fs/cgroup, and the CPU
/// list of `online` saying the CPUs the sandbox runs on.
///
/// Read-only holds: nothing inside has CAP_SYS_ADMIN and seccomp denies mount and the new mount
/// API, so no process can remount any of it writable or mount cgroupfs again (release_agent).
fn mount_sys(root: &Path, cfg: &InitConfig) -> StageResult {
    let sys = root.join("sys");
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    match &cfg.shared_sysfs {
        // The daemon's (no link: the same devices as this namespace), bound while its host path
        // is still reachable; read-only, which a bind of it stays.
        Some(shared) => {
            stage("bind the shared /sys", mount(Some(shared.as_str()), &sys, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
            stage("remount /sys read-only", mount(None::<&str>, &sys, None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | ro, None::<&str>))?;
        }
        None => stage("mount /sys", mount(Some("sysfs"), &sys, Some("sysfs"), ro, None::<&str>))?,
    }
    // v1: the daemon's shared layout, bound while its host path is still reachable (before
    // the init becomes root inside a user namespace); `mount_cgroup` fills it.
    if let CgroupView::V1 { .. } = &cfg.cgroup_view {
        let Some(layout) = &cfg.cgroup_skeleton else {
            return Err(("bind the /sys/fs/cgroup layout", "the daemon sent no layout".to_string()));
        };
        stage("bind the /sys/fs/cgroup layout", mount(Some(layout.as_str()), &sys.join("fs/cgroup"), None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
    }
    Ok(())
}

/// Docker's masked /sys directories covered by an empty read-only directory (after
/// `mount_dev`): one made on the sandbox's /dev tmpfs, bound, then removed, so it costs no
/// superblock of its own (see `mount_dev`) and shows no host path in the sandbox's mountinfo.
fn mask_sys(root: &Path) -> StageResult {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let empty = root.join("dev/.masked");
    stage("make the mask's directory", nix::unistd::mkdir(&empty, Mode::from_bits_truncate(0o555)))?;
    for masked in ["firmware", "devices/virtual/powercap"] {
        let target = root.join("sys").join(masked);
        if target.is_dir() {
            stage("mask /sys dir", mount(Some(&empty), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
            stage("remount a /sys mask read-only", mount(None::<&str>, &target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | ro, None::<&str>))?;
        }
    }
    stage("remove the mask's directory", std::fs::remove_dir(&empty))?;
    Ok(())
}

/// The sandbox's CPU list at /sys/devices/system/cpu/online, read-only (after `mount_dev`): a
/// file written on the sandbox's own /dev tmpfs, bound, then unlinked, so no host path shows in
/// its mountinfo.
fn bind_cpu_list(root: &Path, cfg: &InitConfig) -> StageResult {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let file = root.join("dev/.cpus-online");
    stage("write the CPU list", std::fs::write(&file, format!("{}\n", crate::backend::cpus::format_list(&cfg.cpus))))?;
    let online = root.join("sys/devices/system/cpu/online");
    stage("bind the CPU list", mount(Some(&file), &online, None::<&str>, MsFlags::MS_BIND, None::<&str>))?;
    stage("remount the CPU list read-only", mount(None::<&str>, &online, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | ro, None::<&str>))?;
    stage("unlink the CPU list's source", std::fs::remove_file(&file))?;
    Ok(())
}

/// The sandbox's own cgroup, read-only at /sys/fs/cgroup (after `mount_sys`; with a user
/// namespace, once the init is root inside: v1 hierarchies are mounted on the daemon's shared
/// layout, which `mount_sys` bound).
fn mount_cgroup(root: &Path, cfg: &InitConfig) -> StageResult {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let cgroup = root.join("sys/fs/cgroup");
    match &cfg.cgroup_view {
        CgroupView::V2 => stage("mount /sys/fs/cgroup", mount(Some("cgroup2"), &cgroup, Some("cgroup2"), ro, None::<&str>))?,
        CgroupView::V1 { hierarchies } => {
            // On the daemon's layout, bound there by `mount_sys`: a directory per hierarchy.
            for controllers in hierarchies {
                // Inside the cgroup namespace the mount's root is the sandbox's cgroup in that
                // hierarchy, not the hierarchy's root.
                let dir = cgroup.join(controllers);
                stage("mount a cgroup hierarchy", mount(Some("cgroup"), &dir, Some("cgroup"), ro, Some(controllers.as_str())))?;
            }
            stage("remount /sys/fs/cgroup read-only", mount(None::<&str>, &cgroup, None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | ro, None::<&str>))?;
        }
    }
    Ok(())
}

/// Pins this process (and so every process forked from it) to `cpus`.
fn set_affinity(cpus: &[usize]) -> Result<(), Errno> {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        set.set(cpu)?;
    }
    if cpus.is_empty() {
        return Err(Errno::EINVAL);
    }
    nix::sched::sched_setaffinity(Pid::from_raw(0), &set)
}

fn drop_capabilities() -> StageResult {
    use caps::CapSet;
    let kept: caps::CapsHashSet = KEPT_CAPS.iter().copied().collect();
    // The bounding set first, while CAP_SETPCAP is still effective: it caps what any later
    // execve (even of a setuid binary) can regain.
    for cap in caps::all() {
        if !kept.contains(&cap) {
            stage("drop bounding capability", caps::drop(None, CapSet::Bounding, cap))?;
        }
    }
    stage("clear ambient capabilities", caps::clear(None, CapSet::Ambient))?;
    stage("set inheritable capabilities", caps::set(None, CapSet::Inheritable, &kept))?;
    stage("set effective capabilities", caps::set(None, CapSet::Effective, &kept))?;
    stage("set permitted capabilities", caps::set(None, CapSet::Permitted, &kept))?;
    Ok(())
}

/// The init's state while serving.
struct Server {
    ctrl: OwnedFd,
    /// Main processes of running execs by pid, and spares by pid under their slot's name (the
    /// daemon hands a spare its command directly). Other processes that end up here (orphans
    /// re-parented to PID 1) are reaped silently.
    running: HashMap<Pid, String>,
}

/// SIGCHLD blocked and read through a signalfd instead (by the init's and the zygote's loops).
pub(super) fn child_signals() -> Result<SignalFd, Errno> {
    let mut chld = SigSet::empty();
    chld.add(Signal::SIGCHLD);
    nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&chld), None)?;
    SignalFd::with_flags(&chld, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
}

/// Waits until the control socket or the SIGCHLD signalfd is readable (or hung up): which of the
/// two are. EINTR is waited through.
pub(super) fn wait_ctrl_or_child(ctrl: &OwnedFd, sfd: &SignalFd) -> Result<(bool, bool), Errno> {
    loop {
        let mut fds = [PollFd::new(ctrl.as_fd(), PollFlags::POLLIN), PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {
                let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
                return Ok((ready(&fds[0]), ready(&fds[1])));
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The serve loop: spawn and prepare requests from the daemon, child exits from the kernel.
fn serve(ctrl: OwnedFd) -> i32 {
    let sfd = match child_signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandbox-init: signalfd: {e}");
            return 1;
        }
    };
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut server = Server { ctrl, running: HashMap::new() };
    loop {
        let (ctrl_ready, chld_ready) = match wait_ctrl_or_child(&server.ctrl, &sfd) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("sandbox-init: poll: {e}");
                return 1;
            }
        };
        if chld_ready {
            while let Ok(Some(_)) = sfd.read_signal() {}
            server.reap();
        }
        if ctrl_ready {
            match recv_raw(server.ctrl.as_fd(), &mut buf) {
                // The daemon is gone: exiting as PID 1 kills everything in the sandbox.
                Ok(None) => return 0,
                Ok(Some((n, fds))) => match decode::<ToInit>(&buf[..n]) {
                    Ok(ToInit::Spawn { exec_id, argv, env, workdir, tty, user }) => {
                        let (reply, master) = server.spawn(&exec_id, &argv, &env, &workdir, tty, user.as_deref(), fds);
                        let master = master.filter(|_| matches!(reply, FromInit::Spawned { .. }));
                        report_with(&server.ctrl, &reply, master.as_ref());
                    }
                    Ok(ToInit::Prepare { slot }) => server.prepare(slot, fds),
                    Err(e) => eprintln!("sandbox-init: ignoring malformed request: {e}"),
                },
                Err(e) => {
                    eprintln!("sandbox-init: control channel: {e}");
                    if matches!(e, super::wire::WireError::Io(Errno::EAGAIN | Errno::EINTR)) {
                        continue;
                    }
                    return 1;
                }
            }
        }
    }
}

/// Reads an exec child's error pipe: EOF (nothing) means execve succeeded.
fn spawn_reply(exec_id: &str, pid: Pid, err_r: &OwnedFd, running: &mut HashMap<Pid, String>) -> FromInit {
    if let Some((stage, errno)) = spawn::read_failure(err_r) {
        return FromInit::SpawnFailed { exec_id: exec_id.to_string(), stage, errno: errno as i32 };
    }
    running.insert(pid, exec_id.to_string());
    FromInit::Spawned { exec_id: exec_id.to_string(), pid: pid.as_raw() }
}

impl Server {
    fn reap(&mut self) {
        loop {
            let (pid, code, signal) = match wait_child(-1, libc::WNOHANG) {
                Ok(Some(Ended { pid, code, signal })) => (pid, code, signal),
                Ok(None) | Err(Errno::ECHILD) => return,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    eprintln!("sandbox-init: waitpid: {e}");
                    return;
                }
            };
            if let Some(exec_id) = self.running.remove(&pid) {
                report(&self.ctrl, &FromInit::Exited { exec_id, code, signal });
            }
        }
    }

    /// Forks a spare into a slot's cgroup; it waits for its job (see [`spare_main`]), which the
    /// daemon sends it directly: the other end of the spare's socket goes back to the daemon
    /// with `Prepared`. The init only reaps it, and reports its end under the slot's name. A
    /// spare the daemon drops reads EOF and exits.
    fn prepare(&mut self, slot: String, cgroup_fds: Vec<OwnedFd>) {
        let pair = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        );
        let Ok((jobs, jobs_child)) = pair else {
            eprintln!("sandbox-init: cannot prepare slot {slot}: out of descriptors");
            return;
        };
        // SAFETY: the init is single-threaded; the child only makes syscalls and allocates.
        match unsafe { fork() } {
            Err(e) => eprintln!("sandbox-init: cannot fork spare for {slot}: {e}"),
            Ok(ForkResult::Child) => {
                drop(jobs);
                spare_main(jobs_child, cgroup_fds)
            }
            Ok(ForkResult::Parent { child }) => {
                drop(jobs_child);
                report_fds(&self.ctrl, &FromInit::Prepared { slot: slot.clone(), pid: child.as_raw() }, &[jobs.as_raw_fd()]);
                self.running.insert(child, slot);
            }
        }
    }

    /// Starts one command by a fresh fork, which joins the exec's cgroup through the passed fds.
    /// Returns the reply, and for a `tty` spawn that started the terminal's master side.
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        &mut self,
        exec_id: &str,
        argv: &[String],
        env: &[(String, String)],
        workdir: &str,
        tty: Option<(u16, u16)>,
        user: Option<&str>,
        mut fds: Vec<OwnedFd>,
    ) -> (FromInit, Option<OwnedFd>) {
        let failed_at = |stage: Stage, errno: Errno| (FromInit::SpawnFailed { exec_id: exec_id.to_string(), stage, errno: errno as i32 }, None);
        let failed = |errno: Errno| failed_at(Stage::Setup, errno);
        // Resolved here, behind pivot_root: the sandbox's own passwd and group.
        let creds = match user.map(|u| sandbox_exec::user::resolve(u, std::path::Path::new("/etc"))).transpose() {
            Ok(creds) => creds,
            Err(e) => return failed_at(Stage::User, e.errno()),
        };
        // The command's stdio: the daemon's three descriptors, or a new terminal's slave side.
        let (stdio, master) = match tty {
            None if fds.len() >= 3 => {
                let rest = fds.split_off(3);
                (std::mem::replace(&mut fds, rest), None)
            }
            None => return failed(Errno::EINVAL),
            // The sandbox's own devpts (mounted by `mount_dev`), by its path.
            Some((rows, cols)) => match sandbox_exec::pty::open("/dev/pts/ptmx", rows, cols) {
                Ok((master, slave)) => (vec![slave], Some(master)),
                Err(e) => return failed(e),
            },
        };
        // `fds` now holds only the cgroup's `cgroup.procs` files.
        if argv.is_empty() {
            return failed(Errno::EINVAL);
        }
        let stdio_raw: [RawFd; 3] = match stdio.as_slice() {
            // A terminal's slave side is all three.
            [tty] => [tty.as_raw_fd(); 3],
            [stdin, stdout, stderr] => [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            _ => return failed(Errno::EINVAL),
        };
        // Prepared before fork, so the child only makes syscalls.
        let cmd = match Command::new(argv, env, workdir) {
            Ok(cmd) if tty.is_some() => cmd.on_terminal(),
            Ok(cmd) => cmd,
            Err(_) => return failed(Errno::EINVAL),
        };
        let cmd = match &creds {
            Some(creds) => cmd.as_user(creds),
            None => cmd,
        };
        let (err_r, err_w) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
            Ok(p) => p,
            Err(e) => return failed(e),
        };
        let procs: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: the init is single-threaded; the child only makes syscalls before execve/_exit.
        match unsafe { fork() } {
            Err(e) => failed(e),
            Ok(ForkResult::Child) => {
                drop(err_r);
                let child_fds = ChildFds { stdio: stdio_raw, cgroup_procs: &procs, err_w: err_w.as_raw_fd() };
                spawn::child(&cmd, &child_fds)
            }
            Ok(ForkResult::Parent { child }) => {
                drop(err_w);
                drop((fds, stdio));
                (spawn_reply(exec_id, child, &err_r, &mut self.running), master)
            }
        }
    }
}

/// A spare: join the slot's cgroup now (if given), then wait for the job, join the exec's
/// cgroup if the job names one, and become it. Never returns.
/// `jobs` is also where a failure is reported (stage and errno, one message, as on an exec
/// child's error pipe); it is close-on-exec, so the daemon reads EOF once the command runs.
fn spare_main(jobs: OwnedFd, cgroup_fds: Vec<OwnedFd>) -> ! {
    let err_w = jobs.as_raw_fd();
    let procs: Vec<RawFd> = cgroup_fds.iter().map(|f| f.as_raw_fd()).collect();
    spawn::enter(&procs, err_w);
    drop(cgroup_fds);
    let mut buf = vec![0u8; MAX_MESSAGE];
    let (n, mut stdio) = match recv_raw(jobs.as_fd(), &mut buf) {
        Ok(Some(m)) => m,
        // Never used (superseded, or the sandbox is going away).
        _ => {
            // SAFETY: _exit in a forked child.
            unsafe { libc::_exit(0) }
        }
    };
    let Ok(job) = decode::<super::wire::Job>(&buf[..n]) else { spawn::fail(err_w, Stage::Setup, Errno::EINVAL) };
    drop(buf);
    // The exec's cgroup first, so nothing the command does escapes its accounting and limits.
    let join = stdio.split_off(stdio.len().min(3));
    spawn::join(&join.iter().map(|f| f.as_raw_fd()).collect::<Vec<_>>(), err_w);
    drop(join);
    // Resolved here, behind pivot_root: the sandbox's own passwd and group.
    let creds = match job.user.as_deref().map(|u| sandbox_exec::user::resolve(u, std::path::Path::new("/etc"))).transpose() {
        Ok(creds) => creds,
        Err(e) => spawn::fail(err_w, Stage::User, e.errno()),
    };
    // Never a terminal: a `tty` exec is forked by the init, which opens it.
    let cmd = Command::new(&job.argv, &job.env, &job.workdir).ok().map(|cmd| match &creds {
        Some(creds) => cmd.as_user(creds),
        None => cmd,
    });
    match cmd {
        Some(cmd) if stdio.len() == 3 => spawn::exec(&cmd, [stdio[0].as_raw_fd(), stdio[1].as_raw_fd(), stdio[2].as_raw_fd()], err_w),
        _ => spawn::fail(err_w, Stage::Setup, Errno::EINVAL),
    }
}
