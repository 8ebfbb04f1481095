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

/// How a spawn request ended.
pub type SpawnReply = Result<i32, (String, i32)>;
/// How the main process of an exec ended: (exit code, signal).
pub type ExitReply = (Option<i32>, Option<i32>);

#[derive(Default)]
struct Pending {
    spawns: HashMap<String, oneshot::Sender<SpawnReply>>,
    exits: HashMap<String, oneshot::Sender<ExitReply>>,
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
        other => std::io::Error::other(other.to_string()),
    }
}

async fn send_on(fd: &AsyncFd<OwnedFd>, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    loop {
        let mut guard = fd.writable().await?;
        match guard.try_io(|inner| send_raw(inner.get_ref().as_fd(), bytes, fds).map_err(would_block)) {
            Ok(result) => return result,
            Err(_would_block) => continue,
        }
    }
}

async fn recv_on(fd: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> std::io::Result<Option<(usize, Vec<OwnedFd>)>> {
    loop {
        let mut guard = fd.readable().await?;
        match guard.try_io(|inner| recv_raw(inner.get_ref().as_fd(), buf).map_err(would_block)) {
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
        let mut buf = vec![0u8; 16 << 10];
        let first = tokio::time::timeout(deadline, recv_on(&self.fd, &mut buf))
            .await
            .map_err(|_| format!("init not ready within {deadline:?}"))?
            .map_err(|e| format!("reading init's answer: {e}"))?;
        match first {
            None => Err("init exited during setup".to_string()),
            Some((n, _)) => match decode::<FromInit>(&buf[..n]) {
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
            let mut buf = vec![0u8; 4096];
            loop {
                let msg = tokio::select! {
                    _ = closed.cancelled() => break,
                    r = recv_on(&fd, &mut buf) => r,
                };
                let (n, _fds) = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(%sandbox, error = %e, "control channel read failed");
                        break;
                    }
                };
                let parsed = decode::<FromInit>(&buf[..n]);
                let Ok(mut p) = pending.lock() else { break };
                match parsed {
                    Ok(FromInit::Spawned { exec_id, pid }) => {
                        if let Some(tx) = p.spawns.remove(&exec_id) {
                            let _ = tx.send(Ok(pid));
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
                    Ok(other) => tracing::warn!(%sandbox, ?other, "unexpected message from init"),
                    Err(e) => tracing::warn!(%sandbox, error = %e, "malformed message from init"),
                }
            }
            closed.cancel();
            // Dropping every sender tells each waiting exec that its sandbox is gone.
            if let Ok(mut p) = pending.lock() {
                p.spawns.clear();
                p.exits.clear();
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

    /// Sends a message that has no reply.
    pub async fn send(&self, msg: &ToInit, fds: &[RawFd]) -> Result<(), String> {
        let bytes = encode(msg).map_err(|e| e.to_string())?;
        if self.closed.is_cancelled() {
            return Err("the sandbox's init is gone".to_string());
        }
        let _guard = self.send_lock.lock().await;
        send_on(&self.fd, &bytes, fds).await.map_err(|e| format!("sending to init: {e}"))
    }

    /// Stops the reader; the init sees EOF once the channel is dropped.
    pub fn close(&self) {
        self.closed.cancel();
    }
}
