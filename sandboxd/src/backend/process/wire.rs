//! The control channel between the daemon and a sandbox's init: JSON messages over a
//! `SOCK_SEQPACKET` socket pair, file descriptors passed alongside with `SCM_RIGHTS`.
//!
//! SEQPACKET keeps message boundaries, so no framing is needed, and the socket pair gives both
//! sides death detection for free: when the daemon goes away the init reads EOF and exits (taking
//! the whole pid namespace with it); when the init dies the daemon reads EOF and marks every exec
//! still running as LOST.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use sandbox_exec::spawn::Stage;

use crate::backend::cgroup::CgroupView;
use serde::{Deserialize, Serialize};

/// Largest control message; argv plus env of one exec must fit.
pub const MAX_MESSAGE: usize = 512 << 10;
/// Most descriptors passed with one message (stdio + one per cgroup hierarchy).
pub const MAX_FDS: usize = 16;

/// How the init should set up the sandbox. Sent once, with the `cgroup.procs` fds it joins:
/// the first `join_before_unshare` before it unshares its cgroup namespace (the sandbox's own
/// cgroup, which becomes the namespace's root), the rest right after (v2: its leaf).
#[derive(Debug, Serialize, Deserialize)]
pub struct InitConfig {
    /// The merged overlay, as a host path: becomes `/` after pivot_root.
    pub rootfs: String,
    pub hostname: String,
    pub join_before_unshare: usize,
    /// Size of the `/dev/shm` tmpfs.
    pub shm_bytes: u64,
    /// The CPUs the init (and so every exec) runs on; also listed, as the kernel does (`0-1`),
    /// in a read-only `/sys/devices/system/cpu/online`, which glibc reads for
    /// `sysconf(_SC_NPROCESSORS_ONLN)`.
    pub cpus: Vec<usize>,
    /// How the sandbox's cgroup is mounted at `/sys/fs/cgroup`.
    pub cgroup_view: CgroupView,
    /// v1: the host path of the read-only tmpfs every sandbox shares as its `/sys/fs/cgroup`,
    /// laid out for `cgroup_view` (see `ProcessBackend::cgroup_skeleton`); None on v2.
    #[serde(default)]
    pub cgroup_skeleton: Option<String>,
    /// The host path of the read-only sysfs shared by sandboxes without a network link (see
    /// `ProcessBackend::shared_sysfs`), bound at `/sys`; None: the init mounts a sysfs of its
    /// network namespace (it has a link, or the daemon could not make the shared one).
    #[serde(default)]
    pub shared_sysfs: Option<String>,
    /// The host uid and gid of root inside: the sandbox gets a user namespace mapping
    /// `super::idmap::RANGE` ids from here (see `init::clone_init`). None: no user namespace.
    pub id_base: Option<u32>,
}

/// Daemon → init.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToInit {
    /// Start a process by a fresh fork, which joins the exec's cgroup through the passed fds.
    /// Fds: stdin, stdout, stderr (none with `tty`), then the exec cgroup's `cgroup.procs`
    /// files. With `tty` (rows, columns) the init opens a pseudo-terminal of that size in the
    /// sandbox's own devpts, runs the process on it, and returns the master side with
    /// `Spawned`. (An exec with a prepared spare does not come here: the daemon sends the
    /// spare its [`Job`].)
    Spawn {
        exec_id: String,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        workdir: String,
        #[serde(default)]
        tty: Option<(u16, u16)>,
        /// Who it runs as, resolved by the init in the sandbox's /etc (None: root).
        #[serde(default)]
        user: Option<String>,
    },
    /// Fork a spare process for the next exec now, off the exec's critical path. Fds: the join
    /// files of the next exec's cgroup, which the spare joins at once (where joining waits for
    /// an RCU grace period: no `favordynmods`, and v2 or a v1 `cpu` co-mounted with `cpuacct`);
    /// or none: the spare waits in the sandbox's own cgroup and joins the exec's with its
    /// [`Job`] (see `SandboxCgroup::exec_join_is_cheap`). Answered by `Prepared`.
    Prepare { slot: String },
}

/// Daemon → spare: the command the spare becomes. Fds: stdin, stdout, stderr, then (a spare
/// prepared without a cgroup) the join files of the exec's cgroup, joined first. The spare
/// runs the init's code until it execs (confined like the init), so its parsing of this is as
/// safe as the init's.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub workdir: String,
    /// Who it runs as, resolved by the spare in the sandbox's /etc (None: root).
    #[serde(default)]
    pub user: Option<String>,
}

/// Init → daemon.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromInit {
    /// Setup finished; the sandbox accepts execs.
    Ready,
    /// Setup failed at `stage`; the init exits.
    SetupFailed { stage: String, message: String },
    /// The process runs (exec succeeded). Fds: the terminal's master side, for a `tty` spawn.
    Spawned { exec_id: String, pid: i32 },
    /// The process could not be started.
    SpawnFailed { exec_id: String, stage: Stage, errno: i32 },
    /// The main process of an exec ended (`exec_id` is the slot's name for a spare's).
    Exited { exec_id: String, code: Option<i32>, signal: Option<i32> },
    /// A spare waits in `slot`'s cgroup as `pid`. Fds: the other end of its `SOCK_SEQPACKET`
    /// socket, where its [`Job`] goes; a failure comes back on it (stage and errno), and its
    /// successful execve closes it.
    Prepared { slot: String, pid: i32 },
}

/// Daemon → zygote (see [`super::zygote`]).
#[derive(Debug, Serialize, Deserialize)]
pub enum ToZygote {
    /// Clone a sandbox's init. Fds: the init's end of its control socket, then the write end
    /// of its log pipe (its stderr).
    Start { token: u64, id_base: Option<u32>, oom_score_adj: i32 },
    /// SIGKILL the init started for `token`, if it has not been reaped yet.
    Kill { token: u64 },
}

/// Zygote → daemon.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromZygote {
    /// The init of `token` runs, as host pid `pid`.
    Started { token: u64, pid: i32 },
    /// The init of `token` could not be started.
    StartFailed { token: u64, stage: String, errno: i32 },
    /// The init of `token` ended and was reaped: its pid namespace is empty.
    Exited { token: u64, code: Option<i32>, signal: Option<i32> },
}

/// Errors on the control channel.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("control message too large ({0} bytes, max {MAX_MESSAGE})")]
    TooLarge(usize),
    #[error("malformed control message: {0}")]
    Malformed(String),
    #[error("control channel i/o: {0}")]
    Io(#[from] nix::Error),
}

/// Serializes a message.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    let bytes = serde_json::to_vec(msg).map_err(|e| WireError::Malformed(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE {
        return Err(WireError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Parses a message.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    serde_json::from_slice(bytes).map_err(|e| WireError::Malformed(e.to_string()))
}

/// Sends one message with descriptors. Returns `WouldBlock` as `Io(EAGAIN)` on a non-blocking socket.
pub fn send_raw(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd]) -> Result<(), WireError> {
    let iov = [IoSlice::new(bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Receives one message and the descriptors that came with it. `Ok(None)` on EOF.
pub fn recv_raw(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>, WireError> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed this descriptor in our table for us; nobody else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_TRUNC) || msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(WireError::TooLarge(msg.bytes));
    }
    let n = msg.bytes;
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((n, fds)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    use std::os::fd::AsFd;

    #[test]
    fn messages_and_fds_cross_the_pair() {
        let (a, b) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("socketpair");
        let msg = ToInit::Spawn { exec_id: "ex-1".into(), argv: vec!["true".into()], env: vec![], workdir: "/".into(), tty: None, user: None };
        let devnull = std::fs::File::open("/dev/null").expect("open");
        send_raw(a.as_fd(), &encode(&msg).expect("encode"), &[devnull.as_raw_fd()]).expect("send");
        let mut buf = vec![0u8; 4096];
        let (n, fds) = recv_raw(b.as_fd(), &mut buf).expect("recv").expect("not eof");
        assert_eq!(fds.len(), 1);
        let ToInit::Spawn { exec_id, .. } = decode::<ToInit>(&buf[..n]).expect("decode") else { panic!("not a spawn") };
        assert_eq!(exec_id, "ex-1");
        drop(a);
        assert!(recv_raw(b.as_fd(), &mut buf).expect("recv").is_none(), "EOF after close");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode::<FromInit>(b"\xff{not json").is_err());
        assert!(decode::<FromInit>(br#"{"Exited":{"exec_id":5}}"#).is_err());
    }
}
