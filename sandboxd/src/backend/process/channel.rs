//! The daemon's end of a sandbox's control channel: async sends, and a reader task that routes
//! the init's replies to the exec waiting for them.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::wire::{decode, encode, recv_raw, send_raw, FromInit, ToInit, WireError};

/// How a spawn request ended: the pid (and the terminal's master side for a `tty` spawn), or
/// where and why it failed.
pub type SpawnReply = Result<(i32, Option<OwnedFd>), (sandbox_exec::spawn::Stage, i32)>;
/// How the main process of an exec ended: (exit code, signal).
pub type ExitReply = (Option<i32>, Option<i32>);

/// A spare the init forked into a slot's cgroup: the daemon's end of its socket, where its job
/// goes and a failure comes back (its successful execve closes the other end).
pub struct SpareEnds {
    pub jobs: OwnedFd,
}

#[derive(Default)]
struct Pending {
    spawns: HashMap<String, oneshot::Sender<SpawnReply>>,
    exits: HashMap<String, oneshot::Sender<ExitReply>>,
    prepared: HashMap<String, oneshot::Sender<SpareEnds>>,
}

/// Receivers for one exec's replies. Both fail (RecvError) if the init dies first.
pub struct ExecWaiters {
    pub spawned: oneshot::Receiver<SpawnReply>,
    pub exited: oneshot::Receiver<ExitReply>,
}

/// The control channel of one sandbox.
pub struct InitChannel {
    fd: Arc<AsyncFd<OwnedFd>>,
    send_lock: tokio::sync::Mutex<()>,
    pending: Arc<Mutex<Pending>>,
    closed: CancellationToken,
}

fn would_block(e: WireError) -> std::io::Error {
    match e {
        WireError::Io(nix::errno::Errno::EAGAIN) => std::io::ErrorKind::WouldBlock.into(),
        // One bad message (oversized, truncated): the channel itself is still sound.
        WireError::TooLarge(_) | WireError::Malformed(_) => std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        other => std::io::Error::other(other.to_string()),
    }
}

/// How much of the init's stderr is kept for diagnostics, and how many lines are logged.
const LOG_TAIL_BYTES: usize = 4096;
const LOG_LINES: usize = 64;

/// The last bytes the init wrote to its stderr (a pipe to the daemon, never a host file that
/// code in the sandbox could write through, and bounded however much arrives).
#[derive(Clone, Default)]
pub struct InitLog(Arc<Mutex<String>>);

impl InitLog {
    /// Drains the read end of the init's stderr pipe until EOF: every line is logged (the first
    /// [`LOG_LINES`]), the last [`LOG_TAIL_BYTES`] kept. Draining never stops, so the init can
    /// never block on a full pipe.
    pub fn drain(fd: OwnedFd, sandbox: String) -> std::io::Result<InitLog> {
        let log = InitLog::default();
        let tail = log.0.clone();
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(fd)?;
        tokio::spawn(async move {
            let mut lines = 0usize;
            loop {
                // A buffer only while reading: an init is quiet most of its life.
                if rx.readable().await.is_err() {
                    break;
                }
                let text = {
                    let mut buf = [0u8; 4096];
                    match rx.try_read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(_) => break,
                    }
                };
                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                    lines += 1;
                    if lines <= LOG_LINES {
                        tracing::warn!(%sandbox, line = %line.chars().take(512).collect::<String>(), "sandbox init");
                    } else if lines == LOG_LINES + 1 {
                        tracing::warn!(%sandbox, "sandbox init: further lines are not logged");
                    }
                }
                if let Ok(mut t) = tail.lock() {
                    t.push_str(&text);
                    if t.len() > LOG_TAIL_BYTES {
                        let mut cut = t.len() - LOG_TAIL_BYTES;
                        while !t.is_char_boundary(cut) {
                            cut += 1;
                        }
                        t.drain(..cut);
                    }
                }
            }
        });
        Ok(log)
    }

    /// The last few lines, joined on one line.
    pub fn tail(&self) -> String {
        let text = self.0.lock().map(|t| t.clone()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }
}

pub(super) async fn send_on(fd: &AsyncFd<OwnedFd>, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    loop {
        let mut guard = fd.writable().await?;
        match guard.try_io(|inner| send_raw(inner.get_ref().as_fd(), bytes, fds).map_err(would_block)) {
            Ok(result) => return result,
            Err(_would_block) => continue,
        }
    }
}

/// Receives one message of at most `N` bytes (and its descriptors); None at EOF. The buffer
/// exists only while the message is read, so a reader that waits most of its life (one per live
/// sandbox) holds none while it waits.
pub(super) async fn recv_on<const N: usize>(fd: &AsyncFd<OwnedFd>) -> std::io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    loop {
        let mut guard = fd.readable().await?;
        let read = guard.try_io(|inner| {
            let mut buf = [0u8; N];
            let got = recv_raw(inner.get_ref().as_fd(), &mut buf).map_err(would_block)?;
            Ok(got.map(|(n, fds)| (buf[..n].to_vec(), fds)))
        });
        match read {
            Ok(result) => return result,
            Err(_would_block) => continue,
        }
    }
}

impl InitChannel {
    /// Wraps the daemon's end (set non-blocking here).
    pub fn new(sock: OwnedFd) -> std::io::Result<Self> {
        let flags = nix::fcntl::fcntl(sock.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL).map_err(std::io::Error::from)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(sock.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags)).map_err(std::io::Error::from)?;
        // SAFETY: the descriptor is an OwnedFd moved into the AsyncFd, so it stays open (and is
        // not reused) for as long as the registration lives.
        let fd = unsafe { AsyncFd::register(sock) }.map_err(std::io::Error::from)?;
        Ok(InitChannel {
            fd: Arc::new(fd),
            send_lock: tokio::sync::Mutex::new(()),
            pending: Arc::new(Mutex::new(Pending::default())),
            closed: CancellationToken::new(),
        })
    }

    /// Sends the setup configuration (with the cgroup fds) and waits for the init to be ready.
    pub async fn handshake(&self, config: &[u8], fds: &[RawFd], deadline: Duration) -> Result<(), String> {
        send_on(&self.fd, config, fds).await.map_err(|e| format!("sending setup config: {e}"))?;
        let first = tokio::time::timeout(deadline, recv_on::<{ 16 << 10 }>(&self.fd))
            .await
            .map_err(|_| format!("init not ready within {deadline:?}"))?
            .map_err(|e| format!("reading init's answer: {e}"))?;
        match first {
            None => Err("init exited during setup".to_string()),
            Some((bytes, _)) => match decode::<FromInit>(&bytes) {
                Ok(FromInit::Ready) => Ok(()),
                Ok(FromInit::SetupFailed { stage, message }) => Err(format!("setup failed at {stage}: {message}")),
                Ok(other) => Err(format!("unexpected first message from init: {other:?}")),
                Err(e) => Err(e.to_string()),
            },
        }
    }

    /// Starts the task routing the init's messages. Ends when the init closes the channel.
    pub fn start_reader(&self, sandbox: String) {
        let fd = self.fd.clone();
        let pending = self.pending.clone();
        let closed = self.closed.clone();
        tokio::spawn(async move {
            // Messages from the init are small; a compromised init sending garbage only hurts its
            // own sandbox: malformed messages are logged and dropped.
            loop {
                let msg = tokio::select! {
                    _ = closed.cancelled() => break,
                    r = recv_on::<4096>(&fd) => r,
                };
                let (bytes, mut fds) = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                        tracing::warn!(%sandbox, error = %e, "dropping a bad message from init");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(%sandbox, error = %e, "control channel read failed");
                        break;
                    }
                };
                let parsed = decode::<FromInit>(&bytes);
                let Ok(mut p) = pending.lock() else { break };
                match parsed {
                    Ok(FromInit::Spawned { exec_id, pid }) => {
                        if let Some(tx) = p.spawns.remove(&exec_id) {
                            let _ = tx.send(Ok((pid, fds.pop())));
                        }
                    }
                    Ok(FromInit::SpawnFailed { exec_id, stage, errno }) => {
                        p.exits.remove(&exec_id);
                        if let Some(tx) = p.spawns.remove(&exec_id) {
                            let _ = tx.send(Err((stage, errno)));
                        }
                    }
                    Ok(FromInit::Exited { exec_id, code, signal }) => {
                        if let Some(tx) = p.exits.remove(&exec_id) {
                            let _ = tx.send((code, signal));
                        }
                    }
                    Ok(FromInit::Prepared { slot, .. }) => {
                        // Exactly its socket, or the slot is not armed (the spare, never sent a
                        // job, exits when its end is dropped here).
                        let tx = p.prepared.remove(&slot);
                        if let (Some(tx), 1) = (tx, fds.len()) {
                            if let Some(jobs) = fds.pop() {
                                let _ = tx.send(SpareEnds { jobs });
                            }
                        }
                    }
                    Ok(other) => tracing::warn!(%sandbox, ?other, "unexpected message from init"),
                    Err(e) => tracing::warn!(%sandbox, error = %e, "malformed message from init"),
                }
            }
            closed.cancel();
            // Dropping every sender tells each waiting exec that its sandbox is gone.
            if let Ok(mut p) = pending.lock() {
                p.spawns.clear();
                p.exits.clear();
                p.prepared.clear();
            }
            tracing::debug!(%sandbox, "control channel closed");
        });
    }

    /// Asks the init to start a process; returns where its replies will arrive.
    pub async fn spawn(&self, exec_id: &str, msg: &ToInit, fds: &[RawFd]) -> Result<ExecWaiters, String> {
        let bytes = encode(msg).map_err(|e| e.to_string())?;
        let (spawn_tx, spawned) = oneshot::channel();
        let (exit_tx, exited) = oneshot::channel();
        {
            let mut p = self.pending.lock().map_err(|_| "control channel state poisoned".to_string())?;
            if self.closed.is_cancelled() {
                return Err("the sandbox's init is gone".to_string());
            }
            p.spawns.insert(exec_id.to_string(), spawn_tx);
            p.exits.insert(exec_id.to_string(), exit_tx);
        }
        let _guard = self.send_lock.lock().await;
        if let Err(e) = send_on(&self.fd, &bytes, fds).await {
            if let Ok(mut p) = self.pending.lock() {
                p.spawns.remove(exec_id);
                p.exits.remove(exec_id);
            }
            return Err(format!("sending spawn request: {e}"));
        }
        Ok(ExecWaiters { spawned, exited })
    }

    /// Asks the init to fork a spare into `slot`'s cgroup (`fds`: its `cgroup.procs` files);
    /// returns where the spare's ends will arrive.
    pub async fn prepare(&self, slot: &str, fds: &[RawFd]) -> Result<oneshot::Receiver<SpareEnds>, String> {
        let bytes = encode(&ToInit::Prepare { slot: slot.to_string() }).map_err(|e| e.to_string())?;
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.pending.lock().map_err(|_| "control channel state poisoned".to_string())?;
            if self.closed.is_cancelled() {
                return Err("the sandbox's init is gone".to_string());
            }
            p.prepared.insert(slot.to_string(), tx);
        }
        let _guard = self.send_lock.lock().await;
        if let Err(e) = send_on(&self.fd, &bytes, fds).await {
            self.forget(slot);
            return Err(format!("sending prepare request: {e}"));
        }
        Ok(rx)
    }

    /// Where the end of the process that runs as `key` (a spare's slot) will be reported.
    pub fn expect_exit(&self, key: &str) -> Result<oneshot::Receiver<ExitReply>, String> {
        let (tx, rx) = oneshot::channel();
        let mut p = self.pending.lock().map_err(|_| "control channel state poisoned".to_string())?;
        if self.closed.is_cancelled() {
            return Err("the sandbox's init is gone".to_string());
        }
        p.exits.insert(key.to_string(), tx);
        Ok(rx)
    }

    /// Stops the reader; the init sees EOF once the channel is dropped.
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// Whether the channel is closed: by [`InitChannel::close`], or because the init is gone.
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Forgets an exec's or a slot's pending replies (they never came in time, or are not
    /// wanted any more).
    pub fn forget(&self, key: &str) {
        if let Ok(mut p) = self.pending.lock() {
            p.spawns.remove(key);
            p.exits.remove(key);
            p.prepared.remove(key);
        }
    }
}
