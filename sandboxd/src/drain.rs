//! `sandboxd drain`: tells the daemon serving a UNIX socket to drain, and waits for it to end.
//!
//! The daemon is found by its socket, not by a pid file: the kernel names the process that
//! listens there (`SO_PEERCRED` on a connection to it). A pidfd on that process is opened
//! before anything is sent, so the signals reach that daemon and no process that took its pid
//! later. SIGUSR1 starts the drain (see `server`: creates refused, readiness off, the daemon
//! ends once no exec runs); at the deadline SIGTERM ends it the usual way (running execs killed,
//! sandboxes kept for the next start). The pidfd turns readable when the daemon has exited,
//! which is what is waited for: no polling of `/proc`.
//!
//! Kubernetes runs it as the DaemonSet's preStop hook (`deploy/kubernetes/`); the pod's
//! `terminationGracePeriodSeconds` must exceed `--timeout` plus the time a SIGTERM shutdown takes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Errors of a drain.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("cannot connect to the daemon's socket {path}: {source} (is sandboxd running and listening there?)")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("cannot learn which process serves {path}: {source}")]
    PeerCred { path: PathBuf, source: nix::Error },
    #[error("cannot open the daemon's process (pid {pid}): {source}")]
    Pidfd { pid: i32, source: std::io::Error },
    #[error("cannot send {signal} to the daemon (pid {pid}): {source}")]
    Signal { pid: i32, signal: &'static str, source: std::io::Error },
    #[error("waiting for the daemon (pid {pid}) to end: {source}")]
    Wait { pid: i32, source: std::io::Error },
    #[error("the daemon (pid {pid}) has not ended {secs} s after SIGTERM")]
    NotEnded { pid: i32, secs: u64 },
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every exec ended within the deadline and the daemon then exited by itself.
    Quiet { pid: i32, after: Duration },
    /// Execs were still running at the deadline: the daemon was stopped with SIGTERM.
    Stopped { pid: i32, after: Duration },
}

/// Drains the daemon listening on `socket`: its execs get up to `deadline`, then SIGTERM, after
/// which it has `stop_timeout` to exit.
pub fn drain(socket: &Path, deadline: Duration, stop_timeout: Duration) -> Result<Drained, DrainError> {
    let started = Instant::now();
    let (pid, pidfd) = daemon_of(socket)?;
    tracing::info!(pid, socket = %socket.display(), deadline_secs = deadline.as_secs(), "draining the daemon");
    send(&pidfd, pid, libc::SIGUSR1, "SIGUSR1")?;
    if exited_within(&pidfd, pid, deadline)? {
        return Ok(Drained::Quiet { pid, after: started.elapsed() });
    }
    tracing::warn!(pid, deadline_secs = deadline.as_secs(), "execs still running at the deadline: stopping the daemon with SIGTERM");
    send(&pidfd, pid, libc::SIGTERM, "SIGTERM")?;
    if exited_within(&pidfd, pid, stop_timeout)? {
        return Ok(Drained::Stopped { pid, after: started.elapsed() });
    }
    Err(DrainError::NotEnded { pid, secs: stop_timeout.as_secs() })
}

/// The pid of the process listening on `socket`, and a pidfd on it.
fn daemon_of(socket: &Path) -> Result<(i32, OwnedFd), DrainError> {
    let conn = std::os::unix::net::UnixStream::connect(socket).map_err(|source| DrainError::Connect { path: socket.to_path_buf(), source })?;
    // The credentials the listener had when it called listen(): the daemon's.
    let cred = nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|source| DrainError::PeerCred { path: socket.to_path_buf(), source })?;
    let pid = cred.pid();
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(DrainError::Pidfd { pid, source: std::io::Error::last_os_error() });
    }
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // The connection is closed only now: while it was open the process it names could not
    // have gone and been replaced, so the pidfd is the listener's.
    drop(conn);
    Ok((pid, pidfd))
}

fn send(pidfd: &OwnedFd, pid: i32, signal: i32, name: &'static str) -> Result<(), DrainError> {
    // SAFETY: pidfd_send_signal takes a pidfd, a signal number, a null siginfo and no flags.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), signal, std::ptr::null::<libc::siginfo_t>(), 0u32) };
    if rc < 0 {
        return Err(DrainError::Signal { pid, signal: name, source: std::io::Error::last_os_error() });
    }
    Ok(())
}

/// Whether the process ends within `limit` (its pidfd turns readable when it does).
fn exited_within(pidfd: &OwnedFd, pid: i32, limit: Duration) -> Result<bool, DrainError> {
    let until = Instant::now() + limit;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let mut fds = [libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: poll reads and writes exactly the one pollfd of the array it is given.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        if rc > 0 {
            return Ok(true);
        }
        if rc == 0 {
            return Ok(false);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(DrainError::Wait { pid, source: e });
        }
    }
}
