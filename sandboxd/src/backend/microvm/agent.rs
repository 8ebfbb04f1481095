//! The host's end of the guest-agent connection: one UNIX socket (QEMU's chardev behind the
//! VM's virtio-serial port), many requests in flight, demultiplexed by request id.
//!
//! The guest is untrusted. Nothing it sends can make the daemon allocate more than one frame
//! ([`guest_agent::protocol::Decoder`] bounds it), panic, or block a call forever: every call has a
//! deadline, a frame that does not parse is logged and dropped, and a connection that breaks
//! fails every call in flight with the reason.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_agent::protocol::{self, Decoded, Decoder, Envelope, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// One frame from the guest: the message and its raw payload.
#[derive(Debug)]
pub struct Reply {
    pub msg: Response,
    pub payload: Vec<u8>,
}

/// Why a call to the guest agent failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AgentError {
    #[error("guest agent connection lost: {0}")]
    Closed(String),
    #[error("guest agent did not answer {what} within {timeout:?}")]
    Timeout { what: &'static str, timeout: Duration },
    #[error("guest agent protocol error: {0}")]
    Protocol(String),
}

type Pending = Arc<Mutex<HashMap<u64, mpsc::Sender<Reply>>>>;

/// Replies buffered per request before the reader waits for the caller (output frames of a
/// streaming exec are ≤ 64 KiB each).
const REPLY_QUEUE: usize = 64;
/// Garbage reports logged per connection before going quiet.
const GARBAGE_LOG_LIMIT: u32 = 10;

/// A live connection to one VM's agent.
pub struct AgentConn {
    /// Shared with the task that writes each frame (see [`AgentConn::start`]).
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    next_id: AtomicU64,
    /// Set by the reader when the stream ends, with the reason.
    closed: Arc<Mutex<Option<String>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for AgentConn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// What the agent said in `Hello`.
#[derive(Debug, Clone)]
pub struct HelloInfo {
    pub kernel: String,
    pub uptime_ms: u64,
    /// The protocol the agent speaks ([`protocol::MIN_VERSION`]..=[`protocol::VERSION`]).
    pub version: u32,
}

impl AgentConn {
    /// Connects to the agent socket QEMU serves and waits until the agent answers `Hello`.
    ///
    /// `Hello` is repeated every `retry` until one is answered or `deadline` passes (QEMU holds
    /// what is sent before the agent opens its port and the agent then answers every queued one;
    /// the answers to the older ids are dropped). `alive` is polled between attempts so a QEMU
    /// that died fails fast with its reason.
    pub async fn connect(
        socket: &Path,
        deadline: tokio::time::Instant,
        retry: Duration,
        mut alive: impl FnMut() -> Result<(), String>,
    ) -> Result<(AgentConn, HelloInfo), AgentError> {
        let started = tokio::time::Instant::now();
        let stream = Self::connect_socket(socket, deadline, &mut alive).await?;
        let conn = AgentConn::over(stream);
        // For messages: the whole wait, not one retry.
        let boot_timeout = deadline.saturating_duration_since(started);
        loop {
            alive().map_err(AgentError::Closed)?;
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(AgentError::Timeout { what: "hello", timeout: boot_timeout });
            }
            let wait = retry.min(deadline - now);
            match conn.call(&Request::Hello, &[], wait).await {
                Ok(Reply { msg: Response::Hello { version, kernel, uptime_ms }, .. }) => {
                    // Newer protocols only add requests, so an older agent is served with
                    // what it knows (see the callers of `HelloInfo::version`).
                    if !(protocol::MIN_VERSION..=protocol::VERSION).contains(&version) {
                        return Err(AgentError::Protocol(format!(
                            "guest agent speaks protocol {version}, sandboxd {}..={}",
                            protocol::MIN_VERSION,
                            protocol::VERSION
                        )));
                    }
                    return Ok((conn, HelloInfo { kernel, uptime_ms, version }));
                }
                Ok(other) => return Err(AgentError::Protocol(format!("unexpected answer to hello: {:?}", other.msg))),
                Err(AgentError::Timeout { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Connects to the agent of a VM resumed from a memory snapshot, whose agent is known
    /// (`hello`, as it answered when the snapshot's VM started) and has its port open: no
    /// `Hello` round trip, so the first requests go at once (under TCG every round trip in a
    /// freshly resumed guest runs cold code). They are its readiness check.
    pub async fn connect_resumed(
        socket: &Path,
        deadline: tokio::time::Instant,
        mut alive: impl FnMut() -> Result<(), String>,
        hello: HelloInfo,
    ) -> Result<(AgentConn, HelloInfo), AgentError> {
        let stream = Self::connect_socket(socket, deadline, &mut alive).await?;
        Ok((AgentConn::over(stream), hello))
    }

    /// The agent socket QEMU serves, connected once it is there.
    async fn connect_socket(socket: &Path, deadline: tokio::time::Instant, alive: &mut impl FnMut() -> Result<(), String>) -> Result<UnixStream, AgentError> {
        loop {
            alive().map_err(AgentError::Closed)?;
            match UnixStream::connect(socket).await {
                Ok(s) => return Ok(s),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(AgentError::Closed(format!("cannot connect to {}: {e}", socket.display())));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }

    /// Wraps a connected stream (also used by tests with a socketpair).
    pub fn over(stream: UnixStream) -> AgentConn {
        let (mut rd, wr) = stream.into_split();
        let pending: Pending = Arc::default();
        let closed: Arc<Mutex<Option<String>>> = Arc::default();
        let reader = {
            let pending = pending.clone();
            let closed = closed.clone();
            tokio::spawn(async move {
                let reason = read_loop(&mut rd, &pending).await;
                tracing::debug!(%reason, "guest agent connection ended");
                if let Ok(mut c) = closed.lock() {
                    *c = Some(reason);
                }
                // Dropping the senders fails every call in flight.
                if let Ok(mut p) = pending.lock() {
                    p.clear();
                }
            })
        };
        AgentConn { writer: Arc::new(tokio::sync::Mutex::new(wr)), pending, next_id: AtomicU64::new(first_request_id()), closed, reader }
    }

    fn closed_reason(&self) -> Option<String> {
        self.closed.lock().ok().and_then(|c| c.clone())
    }

    /// True while the connection is up.
    pub fn is_open(&self) -> bool {
        self.closed_reason().is_none()
    }

    /// Sends a request; its replies arrive on the returned receiver, the last one final.
    ///
    /// The frame is written by a task of its own, whole, even when the caller stops waiting (a
    /// timeout, a `select!` that went elsewhere): half a frame would make the guest take the
    /// next frame's bytes for the rest of it, and a caller that is not being polled must not hold
    /// the connection's writer (an interactive exec's input is sent from inside its exec loop).
    pub async fn start(&self, req: &Request, payload: &[u8]) -> Result<(u64, mpsc::Receiver<Reply>), AgentError> {
        if let Some(reason) = self.closed_reason() {
            return Err(AgentError::Closed(reason));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = protocol::encode(id, req, payload).map_err(|e| AgentError::Protocol(e.to_string()))?;
        let (tx, rx) = mpsc::channel(REPLY_QUEUE);
        self.pending.lock().map_err(|_| AgentError::Closed("pending table poisoned".into()))?.insert(id, tx);
        let writer = self.writer.clone();
        let written = tokio::spawn(async move { writer.lock().await.write_all(&frame).await }).await;
        let failed = match written {
            Ok(Ok(())) => return Ok((id, rx)),
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        self.forget(id);
        Err(AgentError::Closed(format!("writing to the agent: {failed}")))
    }

    /// Stops routing replies of request `id` (the caller gave up on it).
    pub fn forget(&self, id: u64) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(&id);
        }
    }

    /// Sends a request and waits for its final reply.
    pub async fn call(&self, req: &Request, payload: &[u8], timeout: Duration) -> Result<Reply, AgentError> {
        let what = request_name(req);
        let deadline = tokio::time::Instant::now() + timeout;
        // A guest that stops reading fills the socket: the write is under the deadline too.
        let (id, mut rx) = match tokio::time::timeout_at(deadline, self.start(req, payload)).await {
            Ok(r) => r?,
            Err(_) => return Err(AgentError::Timeout { what, timeout }),
        };
        let result = tokio::time::timeout_at(deadline, async {
            loop {
                match rx.recv().await {
                    Some(r) if r.msg.is_final() => return Ok(r),
                    Some(_) => continue,
                    None => return Err(AgentError::Closed(self.closed_reason().unwrap_or_else(|| "closed".into()))),
                }
            }
        })
        .await;
        match result {
            Ok(r) => r,
            Err(_) => {
                self.forget(id);
                Err(AgentError::Timeout { what, timeout })
            }
        }
    }
}

/// Where a connection's request ids start: at random. A guest resumed from a memory snapshot
/// still answers, now and then, requests of the connection it had when it was saved (an exec
/// that was streaming); ids that started at 1 would collide with this connection's own.
fn first_request_id() -> u64 {
    let mut r = [0u8; 4];
    // SAFETY: getrandom(2) writes at most `len` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    let r = if n == r.len() as isize { u32::from_ne_bytes(r) } else { std::process::id() };
    // Below 2^53 (JSON numbers stay exact anywhere), far apart for two connections.
    (u64::from(r) << 16) + 1
}

/// Short name of a request for messages.
pub fn request_name(req: &Request) -> &'static str {
    match req {
        Request::Hello => "hello",
        Request::Configure(_) => "configure",
        Request::Exec(_) => "exec",
        Request::ExecSession { .. } => "exec_session",
        Request::Stdin { .. } => "stdin",
        Request::CloseStdin { .. } => "close_stdin",
        Request::Resize { .. } => "resize",
        Request::Signal { .. } => "signal",
        Request::WriteFile { .. } => "write_file",
        Request::ReadFile { .. } => "read_file",
        Request::WriteStaged { .. } => "write_staged",
        Request::AbortWrite { .. } => "abort_write",
        Request::RemoveFile { .. } => "remove_file",
        Request::UploadArchive { .. } => "upload_archive",
        Request::DownloadArchive { .. } => "download_archive",
        Request::Freeze => "freeze",
        Request::Thaw => "thaw",
        Request::Resumed { .. } => "resumed",
        Request::Shutdown => "shutdown",
    }
}

/// Reads frames until the stream ends; returns why it ended.
async fn read_loop(rd: &mut tokio::net::unix::OwnedReadHalf, pending: &Pending) -> String {
    let mut decoder = Decoder::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut garbage_logged = 0u32;
    loop {
        let n = match rd.read(&mut buf).await {
            Ok(0) => return "the VM closed the agent port".into(),
            Ok(n) => n,
            Err(e) => return format!("reading from the agent: {e}"),
        };
        decoder.push(&buf[..n]);
        while let Some(ev) = decoder.next() {
            match ev {
                Decoded::Frame(f) => match f.envelope::<Response>() {
                    Ok(Envelope { id, msg }) => route(pending, id, Reply { msg, payload: f.payload }).await,
                    Err(e) => {
                        if garbage_logged < GARBAGE_LOG_LIMIT {
                            garbage_logged += 1;
                            tracing::warn!(error = %e, "guest agent sent a frame that does not parse; dropped");
                        }
                    }
                },
                Decoded::Garbage { skipped, reason } => {
                    if garbage_logged < GARBAGE_LOG_LIMIT {
                        garbage_logged += 1;
                        tracing::warn!(skipped, %reason, "guest agent sent bytes that are not a frame; skipped");
                    }
                }
            }
        }
    }
}

async fn route(pending: &Pending, id: u64, reply: Reply) {
    let is_final = reply.msg.is_final();
    let tx = match pending.lock() {
        Ok(mut p) if is_final => p.remove(&id),
        Ok(p) => p.get(&id).cloned(),
        Err(_) => None,
    };
    match tx {
        // A full queue means a slow caller: wait for it (backpressure on the socket), but never
        // for a caller that went away.
        Some(tx) => {
            let _ = tx.send(reply).await;
        }
        None => tracing::debug!(id, "reply for a request nobody waits for; dropped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_agent::protocol::encode;

    async fn pair() -> (AgentConn, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socketpair");
        (AgentConn::over(a), b)
    }

    async fn read_request(guest: &mut UnixStream, dec: &mut Decoder) -> (u64, Request, Vec<u8>) {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(Decoded::Frame(f)) = dec.next() {
                let env: Envelope<Request> = f.envelope().expect("request parses");
                return (env.id, env.msg, f.payload);
            }
            let n = guest.read(&mut buf).await.expect("read");
            assert!(n > 0, "host closed");
            dec.push(&buf[..n]);
        }
    }

    #[tokio::test]
    async fn replies_are_routed_by_id_and_garbage_is_survived() {
        let (conn, mut guest) = pair().await;
        let conn = Arc::new(conn);
        let c2 = conn.clone();
        let call = tokio::spawn(async move { c2.call(&Request::Freeze, &[], Duration::from_secs(5)).await });
        let mut dec = Decoder::new();
        let (id, req, _) = read_request(&mut guest, &mut dec).await;
        assert_eq!(req, Request::Freeze);
        // A compromised guest: junk, a frame with a bad header, a reply to an unknown id, a
        // huge declared length — then the real answer.
        guest.write_all(b"\x00\x01garbage").await.expect("write");
        let mut bad = protocol::MAGIC.to_vec();
        bad.extend_from_slice(&3u32.to_be_bytes());
        bad.extend_from_slice(&0u32.to_be_bytes());
        bad.extend_from_slice(b"{{{");
        guest.write_all(&bad).await.expect("write");
        guest.write_all(&encode(id + 100, &Response::Ok, b"").expect("encode")).await.expect("write");
        let mut huge = protocol::MAGIC.to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        guest.write_all(&huge).await.expect("write");
        guest.write_all(&encode(id, &Response::Ok, b"").expect("encode")).await.expect("write");
        let reply = call.await.expect("join").expect("call succeeds");
        assert_eq!(reply.msg, Response::Ok);
        assert!(conn.is_open());
    }

    #[tokio::test]
    async fn a_silent_guest_times_out_and_a_closed_one_fails_calls_in_flight() {
        let (conn, guest) = pair().await;
        let err = conn.call(&Request::Thaw, &[], Duration::from_millis(50)).await.expect_err("no answer");
        assert!(matches!(err, AgentError::Timeout { what: "thaw", .. }), "{err}");
        let conn = Arc::new(conn);
        let c2 = conn.clone();
        let call = tokio::spawn(async move { c2.call(&Request::Thaw, &[], Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(guest);
        let err = call.await.expect("join").expect_err("connection closed");
        assert!(matches!(err, AgentError::Closed(_)), "{err}");
        assert!(!conn.is_open());
        assert!(matches!(conn.call(&Request::Thaw, &[], Duration::from_secs(1)).await, Err(AgentError::Closed(_))));
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_never_cuts_a_frame() {
        let (conn, mut guest) = pair().await;
        // Far more than the socket buffers: the write blocks until the guest reads.
        let big = vec![7u8; 8 << 20];
        let req = Request::Stdin { exec_id: "ex-1".into() };
        let gave_up = tokio::time::timeout(Duration::from_millis(50), conn.start(&req, &big)).await;
        assert!(gave_up.is_err(), "the write cannot have finished yet");
        let conn = Arc::new(conn);
        let c2 = conn.clone();
        let next = tokio::spawn(async move { c2.start(&Request::Thaw, &[]).await.map(|(id, _)| id) });
        let mut dec = Decoder::new();
        let (_, first, payload) = read_request(&mut guest, &mut dec).await;
        assert_eq!((first, payload.len()), (req, big.len()), "the whole frame, though its caller left");
        let (id, second, _) = read_request(&mut guest, &mut dec).await;
        assert_eq!(second, Request::Thaw, "the next frame is intact");
        assert_eq!(next.await.expect("join").expect("sent"), id);
    }

    #[tokio::test]
    async fn streaming_replies_arrive_in_order_before_the_final_one() {
        let (conn, mut guest) = pair().await;
        let req = Request::Signal { exec_id: "ex-1".into(), signal: 9 };
        let (_, mut rx) = conn.start(&req, &[]).await.expect("start");
        let mut dec = Decoder::new();
        let (id, _, _) = read_request(&mut guest, &mut dec).await;
        guest.write_all(&encode(id, &Response::Started, b"").expect("encode")).await.expect("write");
        guest.write_all(&encode(id, &Response::Output { stream: protocol::Stream::Stdout }, b"abc").expect("encode")).await.expect("write");
        guest.write_all(&encode(id, &Response::Ok, b"").expect("encode")).await.expect("write");
        let a = rx.recv().await.expect("started");
        let b = rx.recv().await.expect("output");
        let c = rx.recv().await.expect("final");
        assert_eq!(a.msg, Response::Started);
        assert_eq!(b.payload, b"abc");
        assert_eq!(c.msg, Response::Ok);
        assert!(rx.recv().await.is_none(), "the final reply closes the stream");
    }
}
