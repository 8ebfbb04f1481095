//! Listeners, health, reflection, TTL reaping and graceful shutdown around the API.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use sandbox_proto::v1::sandbox_service_server::SandboxServiceServer;
use tokio_util::sync::CancellationToken;

use crate::api::{Api, Auth};
use crate::audit::AuditLog;
use crate::backend::container::{docker_socket_from_env, ContainerBackend, ContainerConfig};
use crate::backend::microvm::MicroVmBackend;
use crate::backend::process::{ProcessBackend, ProcessConfig};
use crate::backend::Backends;
use crate::config::{Config, ListenAddr};
use crate::images::{Catalog, Engine};
use crate::manager::Manager;
use crate::metrics::{self, Metrics};
use crate::store::Store;
use crate::telemetry;

/// Largest gRPC message either way (WriteFile content, ExecResult with two 16 MiB streams).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The health service name that is NOT_SERVING while sandboxes on record are being re-adopted
/// after a start.
pub const RECOVERY_SERVICE: &str = "sandboxd.recovery";

/// The gRPC path of WriteFile, the call whose request carries a whole file.
const WRITE_FILE_PATH: &str = "/sandbox.v1.SandboxService/WriteFile";

/// Runs the daemon until SIGTERM or SIGINT, then shuts down cleanly.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let cfg = Arc::new(cfg);
    // Before anything writes there: the trees that will hold sandbox bytes are sealed.
    crate::hostfs::seal_state_dir(&cfg.state_dir).with_context(|| format!("sealing state dir {}", cfg.state_dir.display()))?;
    // The image catalog: the operator's images dir and the imported images under the (sealed)
    // state dir, which every tier finds its images through.
    let catalog = Arc::new(Catalog::new(&cfg.images_dir, &cfg.state_dir, crate::manager::DEFAULT_IMAGE));
    catalog.prepare().context("preparing the image store")?;
    let docker_socket = docker_socket_from_env();

    let mut backends = Backends::default();
    let process = ProcessBackend::new(ProcessConfig { state_dir: cfg.state_dir.clone(), catalog: catalog.clone(), pool_size_bytes: cfg.pool_size_bytes });
    backends.insert(Arc::new(process));
    // Never fails: without Docker the tier reports itself unavailable, with the reason.
    let container = ContainerBackend::new(ContainerConfig {
        state_dir: cfg.state_dir.clone(),
        images_dir: cfg.images_dir.clone(),
        catalog: catalog.clone(),
        docker_socket: docker_socket.clone(),
    })
    .await;
    backends.insert(Arc::new(container));
    // Never fails either: without QEMU or VM images the tier reports why.
    let microvm = MicroVmBackend::new(cfg.microvm.clone(), &cfg.state_dir, catalog.clone(), cfg.limits.default);
    backends.insert(Arc::new(microvm));
    let engine = Arc::new(Engine::new(&docker_socket));
    let store = Store::open(&cfg.state_dir.join("state.db")).context("opening the state database")?;
    let metrics = Metrics::new().context("registering metrics")?;
    let manager = Manager::new(cfg.clone(), backends, catalog, engine, store, metrics);
    let auth = Arc::new(Auth::new(&cfg.auth));
    let audit = Arc::new(AuditLog::open(&cfg.audit, cfg.state_dir.join("audit.jsonl")).context("opening the audit log")?);
    // Before serving: clean whatever a crash left behind and put the sandboxes on record back in
    // the table (lists and deletes only); they are started again after the listeners open.
    manager.recover().await.context("recovering state from the previous run")?;
    manager.log_admission();

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<SandboxServiceServer<Api>>().await;
    for (tier, status) in manager.tiers() {
        let name = format!("sandboxd.tier.{}", tier.name().to_lowercase());
        let serving = if status.is_ok() { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
        health_reporter.set_service_status(name, serving).await;
        match status {
            Ok(()) => tracing::info!(tier = tier.name(), "tier available"),
            Err(reason) => tracing::warn!(tier = tier.name(), %reason, "tier unavailable"),
        }
    }
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sandbox_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building reflection service")?;

    let stop = CancellationToken::new();
    let mut servers = tokio::task::JoinSet::new();
    let tls = match &cfg.tls {
        Some(t) => {
            let cert = std::fs::read(&t.cert).with_context(|| format!("reading TLS certificate {}", t.cert.display()))?;
            let key = std::fs::read(&t.key).with_context(|| format!("reading TLS key {}", t.key.display()))?;
            Some(tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key)))
        }
        None => None,
    };
    let mut unix_paths = Vec::new();
    // One bound for all listeners: it is the daemon's memory it protects.
    let write_limit = WriteFileLimit::new(cfg.files.max_concurrent_writes);
    tracing::info!(
        max_concurrent_writes = cfg.files.max_concurrent_writes,
        max_message_bytes = MAX_MESSAGE_BYTES,
        "WriteFile calls beyond the limit wait before their content is read"
    );
    for addr in &cfg.listen {
        let api = SandboxServiceServer::new(Api::new(manager.clone(), auth.clone(), audit.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let mut builder = tonic::transport::Server::builder().trace_fn(rpc_span);
        if let (ListenAddr::Tcp(_), Some(tls)) = (addr, &tls) {
            builder = builder.tls_config(tls.clone()).context("configuring TLS")?;
        }
        let router = builder.layer(write_limit.clone()).add_service(health_service.clone()).add_service(reflection.clone()).add_service(api);
        let shutdown = stop.clone().cancelled_owned();
        match addr {
            ListenAddr::Unix(path) => {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
                }
                match std::fs::remove_file(path) {
                    Ok(()) => tracing::info!(path = %path.display(), "removed stale socket"),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).with_context(|| format!("removing stale socket {}", path.display())),
                }
                let listener = tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
                // 0600 by default: only root connects. A wider mode lets SO_PEERCRED and the
                // configured uid/gid lists decide (see api::auth).
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(cfg.auth.unix_socket_mode))
                    .with_context(|| format!("chmod {}", path.display()))?;
                unix_paths.push(path.clone());
                // Stock gRPC clients name the socket path as :authority; see `authority`.
                let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnixListenerStream::new(listener), |conn| {
                    conn.map(crate::authority::FixAuthority::new)
                });
                servers.spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await });
            }
            ListenAddr::Tcp(sock) => {
                if !auth.tokens_required() {
                    tracing::warn!(%sock, "TCP listener without [auth] tokens: any process that can connect acts as the local tenant");
                }
                let listener = tokio::net::TcpListener::bind(sock).await.with_context(|| format!("binding {sock}"))?;
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                servers.spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await });
            }
        }
        tracing::info!(%addr, "listening");
    }

    if let Some(addr) = cfg.metrics {
        let render_manager = manager.clone();
        let render: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(move || render_manager.render_metrics());
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding metrics listener {addr}"))?;
        tracing::info!(%addr, "metrics listening");
        let metrics_stop = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(listener, render, metrics_stop).await {
                tracing::error!(error = %e, "metrics listener stopped");
            }
        });
    }

    // Re-adoption while serving: a call on a sandbox not yet back brings it back first, any
    // other call is answered at once. Health's `sandboxd.recovery` is NOT_SERVING until done.
    let recovery = {
        let manager = manager.clone();
        let stop = stop.clone();
        let health = health_reporter.clone();
        health.set_service_status(RECOVERY_SERVICE, tonic_health::ServingStatus::NotServing).await;
        tokio::spawn(async move {
            manager.readopt_all(stop).await;
            health.set_service_status(RECOVERY_SERVICE, tonic_health::ServingStatus::Serving).await;
        })
    };

    let reaper_manager = manager.clone();
    let reaper_stop = stop.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = reaper_stop.cancelled() => break,
                _ = tick.tick() => reaper_manager.reap_expired().await,
            }
        }
    });

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("installing SIGTERM handler")?;
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
        r = tokio::signal::ctrl_c() => { r.context("waiting for SIGINT")?; tracing::info!("SIGINT: shutting down") }
        Some(r) = servers.join_next() => {
            tracing::error!(result = ?r, "a listener stopped unexpectedly; shutting down");
        }
    }
    stop.cancel();
    // A re-adoption under way finishes (the rest stay on disk for the next start).
    if tokio::time::timeout(Duration::from_secs(30), recovery).await.is_err() {
        tracing::warn!("re-adoption still running at shutdown; stopping the tiers under it");
    }
    // In-flight calls get a moment to finish; sandboxes are then stopped, their files kept.
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while servers.join_next().await.is_some() {} }).await;
    manager.shutdown().await;
    crate::hostfs::unseal_state_dir(&cfg.state_dir);
    for path in unix_paths {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}

/// Admits at most N WriteFile calls at once; the others wait *before* the service reads their
/// message, so only the admitted calls' contents are ever in the daemon's memory: each up to
/// `MAX_MESSAGE_BYTES`, about twice that while it is decoded and then copied for the blocking
/// write. A waiting call's bytes stay with the client: HTTP/2 flow control stops them at the
/// stream and connection windows (1 MiB each by default). A count and not a byte budget
/// because a gRPC message's size is only known once it is read.
#[derive(Clone)]
struct WriteFileLimit {
    permits: Arc<tokio::sync::Semaphore>,
}

impl WriteFileLimit {
    fn new(max: usize) -> Self {
        WriteFileLimit { permits: Arc::new(tokio::sync::Semaphore::new(max)) }
    }
}

impl<S> tower::Layer<S> for WriteFileLimit {
    type Service = WriteFileLimited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WriteFileLimited { inner, permits: self.permits.clone() }
    }
}

/// The service [`WriteFileLimit`] wraps around the gRPC routes.
#[derive(Clone)]
struct WriteFileLimited<S> {
    inner: S,
    permits: Arc<tokio::sync::Semaphore>,
}

impl<S, B> tower::Service<http::Request<B>> for WriteFileLimited<S>
where
    S: tower::Service<http::Request<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != WRITE_FILE_PATH {
            return Box::pin(self.inner.call(req));
        }
        // The service poll_ready readied is the one to call later; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let permits = self.permits.clone();
        Box::pin(async move {
            // The semaphore is never closed, so this waits for a permit and holds it until the
            // response is made (the content is dropped by then).
            let _permit = permits.acquire_owned().await;
            inner.call(req).await
        })
    }
}

/// The span of one RPC. It carries the caller's W3C `traceparent` (trace id and parent span id),
/// so an agent's trace continues into the daemon's logs — and, with OTLP export on, into the
/// exported trace (see [`telemetry::continue_trace`]).
fn rpc_span(req: &http::Request<()>) -> tracing::Span {
    let (trace_id, parent_id) = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_traceparent)
        .map(|(t, p)| (t.to_string(), p.to_string()))
        .unwrap_or_default();
    let span = tracing::info_span!(
        "rpc",
        method = %req.uri().path(),
        trace_id = %trace_id,
        parent_span_id = %parent_id,
        otel.name = tracing::field::Empty,
        otel.kind = tracing::field::Empty,
    );
    telemetry::continue_trace(&span, req.uri().path(), req.headers());
    span
}

/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>` → (trace id, parent id).
fn parse_traceparent(v: &str) -> Option<(&str, &str)> {
    let mut parts = v.trim().split('-');
    let (version, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2) && trace.bytes().any(|b| b != b'0')).then_some((trace, parent))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route that counts how many calls run at once and holds each until `release` says so.
    #[derive(Clone)]
    struct Counting {
        now: Arc<std::sync::atomic::AtomicUsize>,
        peak: Arc<std::sync::atomic::AtomicUsize>,
        release: Arc<tokio::sync::Semaphore>,
    }

    impl tower::Service<http::Request<()>> for Counting {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<(), Self::Error>> + Send>>;

        fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _req: http::Request<()>) -> Self::Future {
            use std::sync::atomic::Ordering::SeqCst;
            let me = self.clone();
            Box::pin(async move {
                let n = me.now.fetch_add(1, SeqCst) + 1;
                me.peak.fetch_max(n, SeqCst);
                if let Ok(p) = me.release.acquire().await {
                    p.forget();
                }
                me.now.fetch_sub(1, SeqCst);
                Ok(())
            })
        }
    }

    fn request(path: &str) -> http::Request<()> {
        let mut r = http::Request::new(());
        *r.uri_mut() = path.parse().expect("uri");
        r
    }

    #[tokio::test]
    async fn write_files_past_the_limit_wait_and_other_calls_do_not() {
        use std::sync::atomic::Ordering::SeqCst;
        use tower::{Layer, Service};
        let counting = Counting { now: Arc::default(), peak: Arc::default(), release: Arc::new(tokio::sync::Semaphore::new(0)) };
        let mut svc = WriteFileLimit::new(2).layer(counting.clone());
        let mut writes = tokio::task::JoinSet::new();
        for _ in 0..6 {
            writes.spawn(svc.call(request(WRITE_FILE_PATH)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(counting.now.load(SeqCst), 2, "two writes admitted, four waiting");
        // Another RPC is not held up by the waiting writes.
        let read = tokio::spawn(svc.call(request("/sandbox.v1.SandboxService/ReadFile")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(counting.now.load(SeqCst), 3);
        counting.release.add_permits(7);
        while let Some(done) = writes.join_next().await {
            assert!(done.expect("task").is_ok());
        }
        assert!(read.await.expect("task").is_ok());
        assert_eq!(counting.peak.load(SeqCst), 3, "never more than two writes (plus the read) at once");
    }

    #[test]
    fn traceparent_parses_and_rejects_garbage() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(parse_traceparent(tp), Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")));
        assert_eq!(parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
        assert_eq!(parse_traceparent("garbage"), None);
    }
}
