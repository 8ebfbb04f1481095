//! The daemon's end of a container's exec channel (see `sandbox_exec::serve` for the wire and
//! `exec.rs` for why execs go through it): taking it from the exec helper once the container
//! runs, sending requests, and reading the one-message answers of each exec's reply socket.
//!
//! Everything that comes back is hostile: one message of a few bytes, bounded in time; the pid
//! of a started child is the kernel's (`SCM_CREDENTIALS`, translated into the daemon's pid
//! namespace), and the daemon checks it is a process of this container before it moves it.

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, recvmsg, send, sendmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, SockType};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::exec::HELPER_IN_CONTAINER;
use sandbox_exec::serve;

/// How long a started container's helper may take to offer the channel.
const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

/// A request's send buffer: a whole request must fit (SEQPACKET sends are atomic), and a few
/// may wait while the helper forks.
const SEND_BUFFER: usize = 4 * serve::MAX_REQUEST_BYTES;

/// The channel to one container's exec helper.
pub(super) struct HelperChannel {
    sock: AsyncFd<OwnedFd>,
}

/// What a container's keepalive is.
enum Keepalive {
    /// `--serve`, with this host pid.
    Serving(i32),
    /// `--pause` (a container made before the channel existed).
    Pausing,
}

fn cmdline(pid: i32) -> Option<Vec<Vec<u8>>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(<[u8]>::to_vec).collect())
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()
}

/// The children of `pid` (`/proc/<pid>/task/<pid>/children`).
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|s| s.split_whitespace().filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

/// The container's keepalive: the child of its init (docker-init) running the helper.
fn find_keepalive(pids: &[i32], init_pid: i32) -> Option<Keepalive> {
    for &pid in pids {
        if parent_of(pid) != Some(init_pid) {
            continue;
        }
        match cmdline(pid).as_deref() {
            Some([helper, mode]) if helper == HELPER_IN_CONTAINER.as_bytes() && mode == b"--serve" => return Some(Keepalive::Serving(pid)),
            Some([helper, mode]) if helper == HELPER_IN_CONTAINER.as_bytes() && mode == b"--pause" => return Some(Keepalive::Pausing),
            _ => {}
        }
    }
    None
}

fn pidfd_getfd(pidfd: &OwnedFd, target: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags; it returns a new
    // descriptor (close-on-exec) or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

pub(super) fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Waits up to `timeout` for `fd` to be readable.
fn poll_in(fd: &OwnedFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: poll on one pollfd of ours.
    let rc = unsafe { libc::poll(&mut p, 1, i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX)) };
    rc == 1
}

/// Takes the channel from a just-started container's helper (blocking: polls /proc and waits
/// for the helper's greeting, bounded). `Ok(None)` for a container whose keepalive predates
/// the channel, or a kernel whose pidfds do not keep exit statuses (Linux < 6.15): their execs
/// go through Docker's exec API.
pub(super) fn take(init_pid: i32) -> Result<Option<OwnedFd>, String> {
    let started = Instant::now();
    let helper = loop {
        match find_keepalive(&children_of(init_pid), init_pid) {
            Some(Keepalive::Serving(pid)) => break pid,
            Some(Keepalive::Pausing) => return Ok(None),
            None if started.elapsed() > CONNECT_DEADLINE => return Err("the container's exec helper did not start".into()),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    let pidfd = super::exec::pidfd_open(helper).map_err(|e| format!("pidfd_open of the exec helper: {e}"))?;
    if !super::exec::pidfd_keeps_exit(&pidfd) {
        tracing::info!("this kernel's pidfds do not keep exit statuses (Linux < 6.15): container execs go through Docker's exec API");
        return Ok(None);
    }
    let sock = loop {
        match pidfd_getfd(&pidfd, serve::CHANNEL_FD) {
            Ok(fd) if getsockopt(&fd, sockopt::SockType).ok() == Some(SockType::SeqPacket) => break fd,
            // Not there yet (the helper is still starting), or not yet the socket.
            Ok(_) | Err(_) if started.elapsed() < CONNECT_DEADLINE => std::thread::sleep(Duration::from_millis(1)),
            Ok(_) => return Err(format!("descriptor {} of the exec helper is not its channel", serve::CHANNEL_FD)),
            Err(e) => return Err(format!("taking the exec helper's channel: {e}")),
        }
    };
    // Root may exceed the system's default maximum; a request is refused (and goes through
    // Docker) rather than split if this fails.
    if let Err(e) = setsockopt(&sock, sockopt::SndBufForce, &SEND_BUFFER) {
        tracing::debug!(error = %e, "raising the exec channel's send buffer");
    }
    send(sock.as_raw_fd(), serve::HELLO, MsgFlags::MSG_DONTWAIT).map_err(|e| format!("greeting the exec helper: {e}"))?;
    let left = CONNECT_DEADLINE.saturating_sub(started.elapsed());
    let mut buf = [0u8; 64];
    if !poll_in(&sock, left) {
        return Err("the exec helper did not answer the greeting".into());
    }
    let n = nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT).map_err(|e| format!("reading the exec helper's greeting: {e}"))?;
    if &buf[..n] != serve::HELLO {
        return Err("the exec helper answered the greeting with something else".into());
    }
    set_nonblocking(&sock).map_err(|e| format!("exec channel: {e}"))?;
    Ok(Some(sock))
}

impl HelperChannel {
    /// Wraps a channel [`take`] returned (needs the runtime).
    pub(super) fn new(sock: OwnedFd) -> std::io::Result<HelperChannel> {
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open until it is dropped.
        let sock = unsafe { AsyncFd::register_with_interest(sock, Interest::WRITABLE) }.map_err(std::io::Error::from)?;
        Ok(HelperChannel { sock })
    }

    /// Sends one request with its descriptors (whole or not at all).
    pub(super) async fn send(&self, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let iov = [std::io::IoSlice::new(bytes)];
        let cmsg = [ControlMessage::ScmRights(fds)];
        loop {
            let mut guard = self.sock.writable().await?;
            match guard
                .try_io(|s| sendmsg::<()>(s.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL, None).map_err(std::io::Error::from))
            {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }
}

/// The one message an exec's reply socket gets first.
pub(super) enum Reply {
    /// The child is there, with this host pid.
    Ready(i32),
    /// The helper could not fork (errno).
    ForkFailed(i32),
    /// The socket closed or said something else: the helper is gone or not ours to believe.
    Broken(String),
}

/// Reads the first message of an exec's reply socket (non-blocking, `SO_PASSCRED` set).
pub(super) async fn read_reply(sock: &AsyncFd<OwnedFd>) -> Reply {
    loop {
        let mut guard = match sock.readable().await {
            Ok(g) => g,
            Err(e) => return Reply::Broken(format!("waiting for the exec helper: {e}")),
        };
        let got = guard.try_io(|s| {
            let mut buf = [0u8; 32];
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!(nix::sys::socket::UnixCredentials, [RawFd; 4]);
            let msg =
                recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC).map_err(std::io::Error::from)?;
            let mut pid = None;
            for c in msg.cmsgs().map_err(std::io::Error::from)? {
                match c {
                    ControlMessageOwned::ScmCredentials(creds) => pid = Some(creds.pid()),
                    // SAFETY: descriptors the kernel installed for us; closed at once, never used.
                    ControlMessageOwned::ScmRights(fds) => fds.into_iter().for_each(|fd| drop(unsafe { OwnedFd::from_raw_fd(fd) })),
                    _ => {}
                }
            }
            let n = msg.bytes;
            Ok((buf, n, pid))
        });
        let (buf, n, pid) = match got {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Reply::Broken(format!("reading the exec helper's reply: {e}")),
            Err(_would_block) => continue,
        };
        return match (&buf[..n], pid) {
            ([], _) => Reply::Broken("the exec helper closed the exec's reply socket".into()),
            (b, Some(pid)) if b == serve::READY && pid > 0 => Reply::Ready(pid),
            ([f, rest @ ..], _) if *f == serve::FORK_FAILED => {
                std::str::from_utf8(rest).ok().and_then(|s| s.parse().ok()).map(Reply::ForkFailed).unwrap_or_else(|| Reply::Broken("a malformed reply".into()))
            }
            _ => Reply::Broken("an unexpected reply from the exec helper".into()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keepalive_is_found_by_its_parent_and_arguments() {
        // This test process is no container's keepalive, whatever its parent.
        let me = std::process::id() as i32;
        let parent = parent_of(me).expect("own parent");
        assert!(children_of(parent).contains(&me), "a process is among its parent's children");
        assert!(find_keepalive(&[me], parent).is_none());
        assert!(find_keepalive(&[], 1).is_none());
    }
}
