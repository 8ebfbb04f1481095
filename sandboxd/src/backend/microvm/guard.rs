//! `sandboxd __vm-guard`: makes QEMU die with the daemon, whatever `-runas` does.
//!
//! `PR_SET_PDEATHSIG` on QEMU itself does not hold: the kernel clears it when a process changes
//! its credentials, and QEMU does exactly that (`-runas`) after start-up, so a daemon killed with
//! SIGKILL used to leave its VMs running until the next start. Instead the daemon starts this
//! small guard (the daemon's own binary, a fresh single-threaded process that never changes its
//! uid, so the death signal the daemon set before `exec` stays):
//!
//! ```text
//! sandboxd ──(PDEATHSIG=SIGKILL)──▶ guard ──unshare(CLONE_NEWPID), fork──▶ PID 1 of a new pid
//!                                                      namespace (PDEATHSIG=SIGKILL) ──fork+exec──▶ QEMU
//! ```
//!
//! The daemon dies → the kernel kills the guard → the guard's death kills PID 1 → a pid
//! namespace whose PID 1 is gone is torn down by the kernel, every process in it SIGKILLed, the
//! setuid'ed QEMU included. No step depends on anything QEMU does to its own credentials.
//!
//! For the daemon nothing else changes: the guard is its child and exits as QEMU did (a QEMU
//! killed by a signal makes the guard die of the same signal), its stdout and stderr are QEMU's
//! (`qemu.log`, where the guard's own rare errors go too), it joined the VM's cgroup before
//! `exec` so all three are in it, and killing the guard kills QEMU.

use std::ffi::{CString, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

/// The hidden first argument that turns the `sandboxd` binary into a VM guard:
/// `sandboxd __vm-guard <daemon pid> [--ram-copy=…] <qemu> [qemu args…]`.
pub const GUARD_ARG: &str = "__vm-guard";
/// `--ram-copy=<from fd>:<to fd>:<bytes>:<report fd>`: before QEMU starts, a child of the guard
/// copies a memory snapshot's guest RAM (descriptor `from`) into the VM's RAM file (`to`),
/// beside QEMU's start-up, and writes `ok <bytes copied>` or `error: <why>` to `report`. Done
/// here, in the VM's cgroup, so the pages are charged to the VM as the RAM it touches is.
pub const RAM_COPY_ARG: &str = "--ram-copy=";
/// The guard's `argv[0]`, what `ps` shows.
pub const GUARD_ARG0: &str = "sandboxd-vm-guard";
/// Exit code of a guard that could not start QEMU at all (the reason is in `qemu.log`).
const GUARD_FAILED: i32 = 125;
/// Exit code of PID 1 when `execve` of QEMU failed.
const EXEC_FAILED: i32 = 127;

/// Entry point of `sandboxd __vm-guard`. Must run before any thread exists (it forks). Never
/// returns.
pub fn main() -> ! {
    let code = match guard(std::env::args_os().skip(2).collect()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{GUARD_ARG0}: {e}");
            GUARD_FAILED
        }
    };
    std::process::exit(code)
}

/// The guard's work; returns its exit code (or dies of QEMU's signal).
fn guard(args: Vec<OsString>) -> Result<i32, String> {
    let (daemon, command) = args.split_first().ok_or("usage: __vm-guard <daemon pid> <qemu> [args…]")?;
    let daemon: i32 = daemon.to_str().and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad daemon pid {daemon:?}"))?;
    let (ram_copy, command) = match command.split_first() {
        Some((first, rest)) if first.as_bytes().starts_with(RAM_COPY_ARG.as_bytes()) => (Some(parse_ram_copy(first)?), rest),
        _ => (None, command),
    };
    if command.is_empty() {
        return Err("no QEMU command given".into());
    }
    let argv: Vec<CString> =
        command.iter().map(|a| CString::new(a.as_bytes()).map_err(|_| format!("argument {a:?} contains a NUL byte"))).collect::<Result<_, _>>()?;
    // The daemon set this before exec; set again so the guard holds it whatever started it,
    // then make sure the daemon did not die before it took effect.
    // SAFETY: prctl with integer arguments only.
    Errno::result(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) }).map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    if nix::unistd::getppid().as_raw() != daemon {
        return Err(format!("the daemon (pid {daemon}) is gone"));
    }
    let copier = match ram_copy {
        Some(copy) => Some(start_ram_copy(copy)?),
        None => None,
    };
    // PID 1 watches this pipe's write end, held by the guard alone, to learn whether the guard
    // died before PID 1 set its own death signal.
    let (alive_r, alive_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    unshare(CloneFlags::CLONE_NEWPID).map_err(|e| format!("unshare(CLONE_NEWPID): {e}"))?;
    // SAFETY: this process is single-threaded (main dispatches here before anything else
    // starts), so the child may run any code.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            drop(alive_w);
            std::process::exit(pid1(&alive_r, &argv))
        }
        ForkResult::Parent { child } => {
            drop(alive_r);
            // The RAM copier (when there is one) is reaped too; it reports to the daemon itself.
            let wait_for = if copier.is_some() { Pid::from_raw(-1) } else { child };
            let code = loop {
                match waitpid(wait_for, None) {
                    Ok(WaitStatus::Exited(pid, code)) if pid == child => break code,
                    Ok(WaitStatus::Signaled(pid, signal, _)) if pid == child => die_of(signal as i32),
                    Ok(_) | Err(Errno::EINTR) => continue,
                    Err(e) => return Err(format!("waiting for PID 1: {e}")),
                }
            };
            drop(alive_w);
            // PID 1 reports a QEMU killed by a signal as 128 + the signal (it cannot die of a
            // signal it sends itself): pass that on as the signal, as if QEMU were the child.
            if (129..=128 + 64).contains(&code) {
                die_of(code - 128);
            }
            Ok(code)
        }
    }
}

/// What `--ram-copy=` names: descriptors inherited from the daemon, and the length.
struct RamCopy {
    from: OwnedFd,
    to: OwnedFd,
    bytes: u64,
    report: OwnedFd,
}

fn parse_ram_copy(arg: &OsString) -> Result<RamCopy, String> {
    let bad = || format!("bad {RAM_COPY_ARG}: {arg:?}");
    let spec = arg.to_str().and_then(|a| a.strip_prefix(RAM_COPY_ARG)).ok_or_else(bad)?;
    let parts: Vec<&str> = spec.split(':').collect();
    let [from, to, bytes, report] = parts.as_slice() else { return Err(bad()) };
    let fd = |s: &str| -> Result<OwnedFd, String> {
        let n: i32 = s.parse().map_err(|_| bad())?;
        if n < 3 {
            return Err(bad());
        }
        // SAFETY: the daemon passed these descriptors open (inherited across exec) for this use
        // alone; nothing else in this process owns them.
        Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(n) })
    };
    let bytes: u64 = bytes.parse().map_err(|_| bad())?;
    Ok(RamCopy { from: fd(from)?, to: fd(to)?, bytes, report: fd(report)? })
}

/// Forks the child that copies the RAM and reports; the guard keeps none of the descriptors
/// (QEMU must not inherit them). Returns the child.
fn start_ram_copy(copy: RamCopy) -> Result<Pid, String> {
    // SAFETY: single-threaded (see `guard`), so the child may run any code.
    match unsafe { fork() }.map_err(|e| format!("fork (RAM copy): {e}"))? {
        ForkResult::Child => {
            let (from, to) = (std::fs::File::from(copy.from), std::fs::File::from(copy.to));
            let line = match super::ram::copy_sparse(&from, &to, copy.bytes) {
                Ok(n) => format!("ok {n}\n"),
                Err(e) => format!("error: {e}\n"),
            };
            let mut report = std::fs::File::from(copy.report);
            let code = if std::io::Write::write_all(&mut report, line.as_bytes()).is_ok() { 0 } else { 1 };
            // SAFETY: _exit ends this child at once, without running anything of the parent's.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => Ok(child),
    }
}

/// PID 1 of the VM's pid namespace: starts QEMU and lives exactly as long as it does. Returns
/// the exit code for the guard.
fn pid1(alive: &OwnedFd, argv: &[CString]) -> i32 {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) } != 0 {
        eprintln!("{GUARD_ARG0}: PR_SET_PDEATHSIG in PID 1: {}", Errno::last());
        return GUARD_FAILED;
    }
    // If the guard died before the prctl above, nobody would kill us: its end of the pipe is
    // closed then.
    let mut fds = [PollFd::new(alive.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(0) => {}
        Ok(_) => return GUARD_FAILED,
        Err(e) => {
            eprintln!("{GUARD_ARG0}: poll: {e}");
            return GUARD_FAILED;
        }
    }
    // SAFETY: still single-threaded (a fork of the single-threaded guard).
    let qemu = match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            let e = nix::unistd::execv(&argv[0], argv).err().unwrap_or(Errno::UnknownErrno);
            eprintln!("{GUARD_ARG0}: cannot execute {:?}: {e}", argv[0]);
            // SAFETY: _exit ends this child at once, without running anything of the parent's.
            unsafe { libc::_exit(EXEC_FAILED) }
        }
        Ok(ForkResult::Parent { child }) => child,
        Err(e) => {
            eprintln!("{GUARD_ARG0}: fork: {e}");
            return GUARD_FAILED;
        }
    };
    // Reap everything (a pid namespace's init inherits its orphans) until QEMU is gone.
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == qemu => return code,
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == qemu => return 128 + signal as i32,
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("{GUARD_ARG0}: waiting for QEMU: {e}");
                return GUARD_FAILED;
            }
        }
    }
}

/// Ends the guard with `signal`, so the daemon sees what killed QEMU.
fn die_of(signal: i32) -> ! {
    if let Ok(sig) = Signal::try_from(signal) {
        // SAFETY: restoring the default action and raising a signal at ourselves; nothing in
        // this single-threaded process relies on a handler for it.
        unsafe {
            libc::signal(sig as i32, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig as i32);
            libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(sig as i32);
        }
    }
    std::process::exit(128 + signal)
}
