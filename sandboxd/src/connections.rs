//! Connections before and after authentication: how many each peer may hold, what an
//! unauthenticated one may cost, and how long it may stay.
//!
//! Every accepted connection is admitted against two caps — per peer (a UNIX uid, a TCP source
//! address) and in total for its kind of listener — and refused (closed at once, with a log
//! line) past either. An admitted connection is [`Guarded`]: until the gRPC layer has
//! authenticated one request on it ([`Session::authenticate`]), the daemon reads at most
//! [`PREAUTH_READ_BYTES`] from it and keeps it at most `preauth_timeout_ms`. A connection whose
//! peer is authenticated by the kernel (a UNIX peer on the allowed uid/gid lists) or needs no
//! authentication (TCP without tokens) starts authenticated.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::unix::UCred;

use crate::config::ConnectionsConfig;

/// Bytes read from a connection before it is authenticated: a client's preface, SETTINGS and
/// first request headers fit many times over. Past it the daemon stops reading (the bytes stay
/// in the client's socket buffer) until a request is authenticated or the deadline closes it,
/// so an unauthenticated connection never has more than this in the daemon's buffers.
pub const PREAUTH_READ_BYTES: u64 = 64 << 10;

/// Who is at the other end of a connection, as the transport says.
#[derive(Debug, Clone)]
pub enum Transport {
    /// A UNIX-socket peer and its kernel-verified credentials (none if SO_PEERCRED failed).
    Unix(Option<UCred>),
    /// A TCP peer and its address.
    Tcp(Option<SocketAddr>),
}

/// What every request on a connection carries in its extensions (tonic's connect info).
#[derive(Debug, Clone)]
pub struct Peer {
    /// The transport and what it says about the peer.
    pub transport: Transport,
    /// The connection's state, shared with its [`Guarded`] stream.
    pub session: Arc<Session>,
}

impl Peer {
    /// The peer of a request, from its extensions (TLS connections wrap it in their own info).
    pub fn of(ext: &http::Extensions) -> Option<&Peer> {
        ext.get::<Peer>().or_else(|| ext.get::<tonic::transport::server::TlsConnectInfo<Peer>>().map(|t| t.get_ref()))
    }
}

/// Whether a connection has been authenticated, and who to wake when it is.
#[derive(Debug, Default)]
pub struct Session {
    authenticated: AtomicBool,
    reader: AtomicWaker,
}

impl Session {
    fn new(authenticated: bool) -> Arc<Session> {
        Arc::new(Session { authenticated: AtomicBool::new(authenticated), reader: AtomicWaker::new() })
    }

    /// Marks the connection authenticated: its read budget and deadline no longer apply.
    pub fn authenticate(&self) {
        if !self.authenticated.swap(true, Ordering::AcqRel) {
            self.reader.wake();
        }
    }

    /// Whether a request on this connection has been authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }
}

/// Whose connections are counted together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A UNIX peer's uid (`None`: credentials unavailable; all such peers share one count).
    Uid(Option<u32>),
    /// A TCP peer's address.
    Ip(IpAddr),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Uid(Some(uid)) => write!(f, "uid {uid}"),
            PeerKey::Uid(None) => write!(f, "a peer without credentials"),
            PeerKey::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Why a connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The peer already holds its share.
    #[error("{peer} already holds {open} connections (connections.{key} = {cap})")]
    PerPeer { peer: PeerKey, open: usize, key: &'static str, cap: usize },
    /// The listener's kind holds all it may.
    #[error("{open} connections are open (connections.{key} = {cap})")]
    Total { open: usize, key: &'static str, cap: usize },
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_peer: HashMap<PeerKey, usize>,
}

/// The caps of one kind of listener (all UNIX listeners share one, all TCP ones another).
#[derive(Clone)]
pub struct ConnLimits {
    counts: Arc<Mutex<Counts>>,
    per_peer: (usize, &'static str),
    total: (usize, &'static str),
    /// Unix seconds of the last refusal logged, so a flood of refusals logs one line a second.
    last_log: Arc<AtomicU64>,
    suppressed: Arc<AtomicU64>,
}

impl ConnLimits {
    /// The caps of UNIX listeners: per uid and in total.
    pub fn unix(cfg: &ConnectionsConfig) -> Self {
        Self::new((cfg.max_per_uid, "max_per_uid"), (cfg.max_unix, "max_unix"))
    }

    /// The caps of TCP listeners: per source address and in total.
    pub fn tcp(cfg: &ConnectionsConfig) -> Self {
        Self::new((cfg.max_per_ip, "max_per_ip"), (cfg.max_tcp, "max_tcp"))
    }

    fn new(per_peer: (usize, &'static str), total: (usize, &'static str)) -> Self {
        ConnLimits { counts: Arc::default(), per_peer, total, last_log: Arc::default(), suppressed: Arc::default() }
    }

    /// Counts a new connection of `peer`, or refuses it. The count lasts as long as the permit.
    pub fn admit(&self, peer: PeerKey) -> Result<ConnPermit, Refused> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if counts.total >= self.total.0 {
            return Err(Refused::Total { open: counts.total, key: self.total.1, cap: self.total.0 });
        }
        let open = counts.by_peer.get(&peer).copied().unwrap_or(0);
        if open >= self.per_peer.0 {
            return Err(Refused::PerPeer { peer, open, key: self.per_peer.1, cap: self.per_peer.0 });
        }
        counts.total += 1;
        counts.by_peer.insert(peer, open + 1);
        Ok(ConnPermit { counts: self.counts.clone(), peer })
    }

    /// Logs a refusal, at most one line a second (with how many were not logged).
    pub fn log_refusal(&self, listener: &str, why: &Refused) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if self.last_log.swap(now, Ordering::Relaxed) == now {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let also = self.suppressed.swap(0, Ordering::Relaxed);
        tracing::warn!(%listener, reason = %why, refused_since_last_line = also, "connection refused");
    }

    /// Open connections of `peer` (for tests and logs).
    pub fn open(&self, peer: PeerKey) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).by_peer.get(&peer).copied().unwrap_or(0)
    }
}

/// One admitted connection's place in its [`ConnLimits`]; given back on drop.
pub struct ConnPermit {
    counts: Arc<Mutex<Counts>>,
    peer: PeerKey,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                counts.by_peer.remove(&self.peer);
            }
        }
    }
}

/// An admitted connection: holds its permit, and until authenticated reads at most
/// [`PREAUTH_READ_BYTES`] and ends at its deadline.
pub struct Guarded<S> {
    inner: S,
    peer: Peer,
    _permit: ConnPermit,
    /// Bytes read while unauthenticated.
    read: u64,
    /// The end of an unauthenticated connection.
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<S> Guarded<S> {
    /// Wraps an admitted connection. `authenticated`: whether the peer needs no request to be
    /// authenticated (a UNIX peer the kernel vouches for, TCP without tokens).
    pub fn new(inner: S, transport: Transport, authenticated: bool, permit: ConnPermit, preauth_timeout: Duration) -> Self {
        let peer = Peer { transport, session: Session::new(authenticated) };
        Guarded { inner, peer, _permit: permit, read: 0, deadline: Box::pin(tokio::time::sleep(preauth_timeout)) }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.peer.session.is_authenticated() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        // Registered before the checks below, so an authentication between them wakes us.
        this.peer.session.reader.register(cx.waker());
        if this.deadline.as_mut().poll(cx).is_ready() && !this.peer.session.is_authenticated() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "no request authenticated before connections.preauth_timeout_ms")));
        }
        if this.peer.session.is_authenticated() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let room = PREAUTH_READ_BYTES.saturating_sub(this.read);
        if room == 0 {
            // Not an error: the first request may be authenticated any moment (its headers are
            // read; the layer that checks them runs on another task). The deadline or the
            // session wakes us.
            return Poll::Pending;
        }
        let limit = usize::try_from(room).unwrap_or(usize::MAX).min(buf.remaining());
        let mut limited = ReadBuf::new(buf.initialize_unfilled_to(limit));
        let result = Pin::new(&mut this.inner).poll_read(cx, &mut limited);
        let n = limited.filled().len();
        buf.advance(n);
        this.read += n as u64;
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S> tonic::transport::server::Connected for Guarded<S> {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn cfg() -> ConnectionsConfig {
        ConnectionsConfig { max_per_uid: 2, max_unix: 3, ..ConnectionsConfig::default() }
    }

    #[test]
    fn caps_per_peer_and_in_total_and_permits_give_back() {
        let limits = ConnLimits::unix(&cfg());
        let a1 = limits.admit(PeerKey::Uid(Some(1000))).expect("first");
        let _a2 = limits.admit(PeerKey::Uid(Some(1000))).expect("second");
        let refused = limits.admit(PeerKey::Uid(Some(1000))).err().expect("third is over the per-uid cap");
        assert!(refused.to_string().contains("connections.max_per_uid = 2"), "{refused}");
        let _b = limits.admit(PeerKey::Uid(Some(1001))).expect("another uid");
        let refused = limits.admit(PeerKey::Uid(Some(1002))).err().expect("over the total");
        assert!(refused.to_string().contains("connections.max_unix = 3"), "{refused}");
        drop(a1);
        assert_eq!(limits.open(PeerKey::Uid(Some(1000))), 1);
        limits.admit(PeerKey::Uid(Some(1000))).expect("room again");
    }

    #[tokio::test]
    async fn an_unauthenticated_connection_reads_its_budget_then_waits_for_authentication() {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let limits = ConnLimits::unix(&cfg());
        let permit = limits.admit(PeerKey::Uid(Some(7))).expect("admit");
        let mut guarded = Guarded::new(server, Transport::Unix(None), false, permit, Duration::from_secs(3600));
        let session = guarded.peer.session.clone();
        client.write_all(&vec![1u8; 200 << 10]).await.expect("write");
        let mut got = vec![0u8; 1 << 20];
        let mut total = 0;
        while total < PREAUTH_READ_BYTES as usize {
            total += guarded.read(&mut got).await.expect("read");
        }
        assert_eq!(total as u64, PREAUTH_READ_BYTES);
        // Nothing more until the session is authenticated: the read stays pending.
        let mut read = Box::pin(guarded.read(&mut got));
        assert!(futures::poll!(read.as_mut()).is_pending());
        session.authenticate();
        let more = read.await.expect("read after authentication");
        assert!(more > 0);
    }

    /// Both connections get the same short deadline; the idle one ending is the event after
    /// which the authenticated one must still be open.
    #[tokio::test]
    async fn an_unauthenticated_connection_ends_at_its_deadline_and_an_authenticated_one_does_not() {
        let limits = ConnLimits::unix(&cfg());
        let (_client, server) = tokio::io::duplex(1024);
        let mut idle = Guarded::new(server, Transport::Unix(None), false, limits.admit(PeerKey::Uid(Some(7))).expect("admit"), Duration::from_millis(200));
        let (mut client, server) = tokio::io::duplex(1024);
        let mut trusted = Guarded::new(server, Transport::Unix(None), true, limits.admit(PeerKey::Uid(Some(7))).expect("admit"), Duration::from_millis(200));
        let err = idle.read(&mut [0u8; 16]).await.expect_err("closed at the deadline");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        client.write_all(b"hello").await.expect("write");
        let mut buf = [0u8; 16];
        assert_eq!(trusted.read(&mut buf).await.expect("still open"), 5);
    }
}
