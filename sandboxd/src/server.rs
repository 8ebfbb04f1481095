//! Listeners, health, reflection, TTL reaping and graceful shutdown around the API.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use sandbox_proto::v1::fleet_service_server::FleetServiceServer;
use sandbox_proto::v1::sandbox_service_server::SandboxServiceServer;
use tokio_util::sync::CancellationToken;

use crate::api::{Api, Auth};
use crate::audit::AuditLog;
use crate::authority;
use crate::backend::container::{docker_socket_from_env, ContainerBackend, ContainerConfig};
use crate::backend::microvm::MicroVmBackend;
use crate::backend::process::{ProcessBackend, ProcessConfig};
use crate::backend::Backends;
use crate::config::{Config, ConnectionsConfig, ListenAddr};
use crate::connections::{ConnLimits, Guarded, Peer, PeerKey, Transport, PREAUTH_READ_BYTES};
use crate::fleet::router::Routed;
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
/// The paths the gate authenticates (health and reflection stay open, as probes expect).
const SANDBOX_SERVICE_PREFIX: &str = "/sandbox.v1.SandboxService/";
/// The fleet's own service: only peers with the fleet token may call it.
const FLEET_SERVICE_PREFIX: &str = "/sandbox.v1.FleetService/";
/// HTTP/2 flow-control windows (hyper's defaults, set here so the bound is visible): how much of
/// a call's body, and of all calls on one connection, the daemon accepts before the handler reads.
const HTTP2_WINDOW_BYTES: u32 = 1 << 20;
/// Streams a client may open and reset before the server has accepted them (rapid reset,
/// CVE-2023-44487): h2's default, set explicitly.
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset for a client's protocol errors before it ends the connection.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 256;
/// An idle connection is pinged this often, and closed if the ping is not answered in time.
const HTTP2_KEEPALIVE: (Duration, Duration) = (Duration::from_secs(60), Duration::from_secs(20));
/// Calls open at once on one connection of the health listener: a probe makes one per
/// connection, a watcher one per service it watches.
const HEALTH_MAX_CONCURRENT_STREAMS: u32 = 16;

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

    // The audit log and metrics first: the egress filter writes to both.
    let metrics = Metrics::new().context("registering metrics")?;
    let audit = Arc::new(AuditLog::open(&cfg.audit, cfg.state_dir.join("audit.jsonl")).context("opening the audit log")?);
    let egress = crate::egress::Egress::start(&cfg.network, audit.clone(), metrics.registry())
        .await
        .map_err(anyhow::Error::msg)
        .context("starting the egress filter")?;
    if cfg.exec.favordynmods {
        use crate::backend::cgroup::{favor_dynamic_modifications, Favor};
        match favor_dynamic_modifications() {
            Ok(Favor::Already(mount)) => tracing::debug!(mount = %mount.display(), "cgroup favordynmods already on"),
            Ok(Favor::Remounted(mount)) => tracing::info!(
                mount = %mount.display(),
                "remounted the cgroup hierarchy with favordynmods: moving an exec into its cgroup no longer waits for an RCU grace period (exec.favordynmods = false leaves it)"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot turn on cgroup favordynmods: an exec after a pause may wait for an RCU grace period (~8 ms)"),
        }
    }
    let mut backends = Backends::default();
    let process = ProcessBackend::new(ProcessConfig {
        state_dir: cfg.state_dir.clone(),
        catalog: catalog.clone(),
        pool_size_bytes: cfg.pool_size_bytes,
        userns: cfg.process.user_namespaces,
        userns_first_id: cfg.process.userns_first_id,
        userns_ranges: cfg.process.userns_ranges,
        egress: Some(egress.clone()),
        spares: cfg.process.spares,
    });
    backends.insert(Arc::new(process));
    // Never fails: without Docker the tier reports itself unavailable, with the reason.
    let container = ContainerBackend::new(ContainerConfig {
        state_dir: cfg.state_dir.clone(),
        images_dir: cfg.images_dir.clone(),
        catalog: catalog.clone(),
        docker_socket: docker_socket.clone(),
        require_userns_remap: cfg.container.require_userns_remap,
        exec_through_docker: cfg.container.exec_through_docker,
        warm_pool: cfg.container.warm_pool,
        egress: Some(egress.clone()),
    })
    .await;
    backends.insert(Arc::new(container));
    // Never fails either: without QEMU or VM images the tier reports why.
    let microvm = MicroVmBackend::new(cfg.microvm.clone(), &cfg.state_dir, catalog.clone(), cfg.limits.default, Some(egress.clone()));
    backends.insert(Arc::new(microvm));
    let engine = Arc::new(Engine::new(&docker_socket));
    let store = Store::open(&cfg.state_dir.join("state.db")).context("opening the state database")?;
    let manager = Manager::new(cfg.clone(), backends, catalog, engine, store, metrics);
    let auth = match &cfg.fleet {
        Some(f) => Arc::new(Auth::new(&cfg.auth).with_fleet_token(&f.token.0)),
        None => Arc::new(Auth::new(&cfg.auth)),
    };
    // A fleet's node: its peers from DNS, forwarding in the router (see `fleet`).
    let fleet = cfg.fleet.clone().map(|f| {
        tracing::info!(node = %f.node, address = %f.address, peers_dns = %f.peers_dns, port = f.port, "fleet node");
        crate::fleet::Fleet::new(f, auth.clone(), manager.clone())
    });
    // Before serving: clean whatever a crash left behind and put the sandboxes on record back in
    // the table (lists and deletes only); they are started again after the listeners open.
    manager.recover().await.context("recovering state from the previous run")?;
    manager.log_admission();

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<SandboxServiceServer<Routed>>().await;
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
    let gate = Gate::new(auth.clone(), cfg.files.max_concurrent_writes);
    tracing::info!(
        max_concurrent_writes = cfg.files.max_concurrent_writes,
        max_message_bytes = MAX_MESSAGE_BYTES,
        "WriteFile calls beyond the limit wait before their content is read"
    );
    // All UNIX listeners share one set of connection caps, all TCP ones another.
    let (unix_limits, tcp_limits) = (ConnLimits::unix(&cfg.connections), ConnLimits::tcp(&cfg.connections));
    let preauth = Duration::from_millis(cfg.connections.preauth_timeout_ms);
    tracing::info!(connections = ?cfg.connections, preauth_read_bytes = PREAUTH_READ_BYTES, "connection caps");
    for addr in &cfg.listen {
        let local = Api::new(manager.clone(), auth.clone(), audit.clone()).with_egress(egress.clone());
        let api = SandboxServiceServer::new(Routed::new(local, fleet.clone(), auth.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let mut builder = bounded_server(cfg.connections.max_concurrent_streams).trace_fn(rpc_span);
        if let (ListenAddr::Tcp(_), Some(tls)) = (addr, &tls) {
            builder = builder.tls_config(tls.clone()).context("configuring TLS")?;
        }
        let fleet_api = fleet.clone().map(|f| FleetServiceServer::new(crate::fleet::FleetApi::new(f)));
        let router =
            builder.layer(gate.clone()).add_service(health_service.clone()).add_service(reflection.clone()).add_service(api).add_optional_service(fleet_api);
        let shutdown = stop.clone().cancelled_owned();
        let name = addr.to_string();
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
                let (limits, auth) = (unix_limits.clone(), auth.clone());
                // Counted per uid, then (stock gRPC clients name the socket path as :authority)
                // through the rewriter; see `authority`. A peer on the allowed lists is
                // authenticated by the kernel; any other gets PERMISSION_DENIED for each call and
                // the pre-authentication bounds until its connection ends.
                let incoming = tokio_stream::StreamExt::filter_map(tokio_stream::wrappers::UnixListenerStream::new(listener), move |conn| {
                    let conn = match conn {
                        Ok(conn) => conn,
                        Err(e) => return Some(Err(e)),
                    };
                    let cred = conn.peer_cred().ok();
                    match limits.admit(PeerKey::Uid(cred.map(|c| c.uid()))) {
                        Ok(permit) => {
                            let trusted = auth.unix_peer_allowed(cred.as_ref());
                            Some(Ok(authority::FixAuthority::new(Guarded::new(conn, Transport::Unix(cred), trusted, permit, preauth))))
                        }
                        Err(why) => {
                            limits.log_refusal(&name, &why);
                            None
                        }
                    }
                });
                servers.spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await });
            }
            ListenAddr::Tcp(sock) => {
                if !auth.tokens_required() {
                    tracing::warn!(%sock, "TCP listener without [auth] tokens: any process that can connect acts as the local tenant");
                }
                let listener = tokio::net::TcpListener::bind(sock).await.with_context(|| format!("binding {sock}"))?;
                let incoming = admitted_tcp(listener, tcp_limits.clone(), !auth.tokens_required(), preauth, name);
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

    // The probes' door, when configured: health alone, in plaintext, on a port of its own.
    if let Some(addr) = cfg.health_listen {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding health listener {addr}"))?;
        tracing::info!(%addr, "health listening (plaintext, grpc.health.v1.Health only)");
        servers.spawn(serve_health(listener, tonic::service::Routes::new(health_service.clone()), cfg.connections.clone(), stop.clone()));
    }

    // The E2B-compatible front door, when configured: its own listener over the same manager.
    if let Some(addr) = cfg.e2b.listen {
        let (manager, auth, audit, stop) = (manager.clone(), auth.clone(), audit.clone(), stop.clone());
        let e2b_cfg = cfg.e2b.clone();
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding E2B listener {addr}"))?;
        tracing::info!(%addr, "E2B-compatible API listening");
        tokio::spawn(async move {
            if let Err(e) = crate::e2b::serve(listener, e2b_cfg, manager, auth, audit, stop).await {
                tracing::error!(error = %e, "E2B listener stopped");
            }
        });
    }

    // The operator's page, when configured: its own listener over the same manager.
    if let Some(addr) = cfg.web.listen {
        let (manager, auth, audit, fleet, stop) = (manager.clone(), auth.clone(), audit.clone(), fleet.clone(), stop.clone());
        let web_cfg = cfg.web.clone();
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding web listener {addr}"))?;
        tracing::info!(%addr, allow_destroy = web_cfg.allow_destroy, "web page listening");
        tokio::spawn(async move {
            if let Err(e) = crate::web::serve(listener, web_cfg, manager, auth, audit, fleet, stop).await {
                tracing::error!(error = %e, "web listener stopped");
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

    if let Some(f) = &fleet {
        f.spawn_refresh(stop.clone());
    }

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
    let mut sigusr1 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1()).context("installing SIGUSR1 handler")?;
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
        r = tokio::signal::ctrl_c() => { r.context("waiting for SIGINT")?; tracing::info!("SIGINT: shutting down") }
        Some(r) = servers.join_next() => {
            tracing::error!(result = ?r, "a listener stopped unexpectedly; shutting down");
        }
        _ = sigusr1.recv() => {
            start_drain(&manager, &health_reporter).await;
            tokio::select! {
                _ = manager.execs_ended() => tracing::info!("drained: no exec is running; shutting down"),
                _ = sigterm.recv() => tracing::info!(running_execs = manager.running_execs(), "SIGTERM while draining: shutting down now"),
                r = tokio::signal::ctrl_c() => { r.context("waiting for SIGINT")?; tracing::info!("SIGINT while draining: shutting down now") }
                Some(r) = servers.join_next() => {
                    tracing::error!(result = ?r, "a listener stopped unexpectedly while draining; shutting down");
                }
            }
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

/// The connections `listener` accepts that `limits` admit (per source address and in total), each
/// guarded: `open` when no token is required on it, else read at most [`PREAUTH_READ_BYTES`] and
/// closed at `preauth` until a call authenticates it. A refusal is logged under `name`.
fn admitted_tcp(
    listener: tokio::net::TcpListener,
    limits: ConnLimits,
    open: bool,
    preauth: Duration,
    name: String,
) -> impl tokio_stream::Stream<Item = std::io::Result<Guarded<tokio::net::TcpStream>>> {
    tokio_stream::StreamExt::filter_map(tokio_stream::wrappers::TcpListenerStream::new(listener), move |conn| {
        let conn = match conn {
            Ok(conn) => conn,
            Err(e) => return Some(Err(e)),
        };
        let addr = conn.peer_addr().ok();
        match limits.admit(PeerKey::Ip(addr.map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip()))) {
            Ok(permit) => Some(Ok(Guarded::new(conn, Transport::Tcp(addr), open, permit, preauth))),
            Err(why) => {
                limits.log_refusal(&name, &why);
                None
            }
        }
    })
}

/// A gRPC server with every HTTP/2 bound set here rather than left to a library's default: they
/// are what an unauthenticated client can make the daemon hold. The frame and header list sizes
/// are the ones the UNIX rewriter (`authority`) enforces before the server sees a byte.
fn bounded_server(max_concurrent_streams: u32) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_frame_size(authority::MAX_FRAME_SIZE as u32)
        .http2_max_header_list_size(authority::MAX_HEADER_LIST_BYTES as u32)
        .max_concurrent_streams(max_concurrent_streams)
        .initial_stream_window_size(HTTP2_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_WINDOW_BYTES)
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_keepalive_interval(Some(HTTP2_KEEPALIVE.0))
        .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE.1))
}

/// The health listener (`health_listen`): `grpc.health.v1.Health` and nothing else, in
/// plaintext (never `[tls]`), for probes that cannot speak the API's TLS, such as the kubelet's
/// gRPC probes. `health` routes to the reporter the API's listeners serve, so it answers the
/// same statuses (a drain's NOT_SERVING included); any other service is UNIMPLEMENTED, and no
/// call on it is authenticated or reaches the API.
///
/// Bounds: the HTTP/2 ones of every listener, at most [`HEALTH_MAX_CONCURRENT_STREAMS`] calls
/// per connection, and the `[connections]` caps per source address and in total (`max_per_ip`,
/// `max_tcp`) counted apart from the API's TCP listeners, so a flood of either never starves the
/// other. No request here authenticates its connection, so each one reads at most
/// [`PREAUTH_READ_BYTES`] and is closed at `preauth_timeout_ms`: probes open one per check, a
/// watcher reconnects. Ends when `stop` fires.
async fn serve_health(
    listener: tokio::net::TcpListener,
    health: tonic::service::Routes,
    connections: ConnectionsConfig,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let preauth = Duration::from_millis(connections.preauth_timeout_ms);
    let incoming = admitted_tcp(listener, ConnLimits::tcp(&connections), false, preauth, "health".to_string());
    // No `trace_fn`: a probe every few seconds would be a span (and an exported trace) each.
    bounded_server(HEALTH_MAX_CONCURRENT_STREAMS.min(connections.max_concurrent_streams))
        .add_routes(health)
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
        .await
}

/// A drain (SIGUSR1, sent by `sandboxd drain`): creates are refused from now on (UNAVAILABLE
/// naming the drain, so a fleet places them on a peer, which also sees this node not ready in its
/// `NodeStatus`), and health's `sandbox.v1.SandboxService` turns NOT_SERVING, which takes the pod
/// out of a Kubernetes Service that routes by readiness. The overall status (`""`) stays
/// SERVING: a liveness probe must not restart a daemon that is finishing its execs. Everything
/// else is served as before, execs in the sandboxes held here included, until the caller ends
/// the daemon: when no exec runs any more, or at SIGTERM (`sandboxd drain` sends it at its
/// deadline; Kubernetes at the end of the grace period).
///
/// A signal rather than an RPC: only a process allowed to signal the daemon (root, or its own
/// uid) can start a drain, no tenant's token can, and no new API surface is needed.
async fn start_drain(manager: &Manager, health: &tonic_health::server::HealthReporter) {
    tracing::info!(running_execs = manager.running_execs(), "SIGUSR1: draining: no new sandboxes, readiness off; ending once no exec runs");
    manager.drain();
    health.set_not_serving::<SandboxServiceServer<Routed>>().await;
}

/// What every call passes before its handler: SandboxService calls are authenticated from
/// their headers alone — the body is not read, no permit is taken, and a refused call is answered
/// here (UNAUTHENTICATED or PERMISSION_DENIED) — and the connection is marked authenticated (its
/// pre-authentication bounds lifted, see `connections`). Then at most N WriteFile calls run at
/// once; the others wait *before* the service reads their message, so only the admitted calls'
/// contents are ever in the daemon's memory: each up to `MAX_MESSAGE_BYTES`, about twice that
/// while it is decoded and then copied for the blocking write. A waiting call's bytes stay with
/// the client: HTTP/2 flow control stops them at the stream and connection windows
/// ([`HTTP2_WINDOW_BYTES`]). A count and not a byte budget because a gRPC message's size is only
/// known once it is read.
#[derive(Clone)]
struct Gate {
    auth: Arc<Auth>,
    write_permits: Arc<tokio::sync::Semaphore>,
}

impl Gate {
    fn new(auth: Arc<Auth>, max_writes: usize) -> Self {
        Gate { auth, write_permits: Arc::new(tokio::sync::Semaphore::new(max_writes)) }
    }
}

impl<S> tower::Layer<S> for Gate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Gated { inner, gate: self.clone() }
    }
}

/// The service [`Gate`] wraps around the gRPC routes.
#[derive(Clone)]
struct Gated<S> {
    inner: S,
    gate: Gate,
}

impl<S, B, R> tower::Service<http::Request<B>> for Gated<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        if path.starts_with(FLEET_SERVICE_PREFIX) {
            if !self.gate.auth.from_fleet_peer(req.headers()) {
                return Box::pin(std::future::ready(Ok(
                    tonic::Status::unauthenticated("FleetService is for the fleet's nodes: present the fleet token").into_http()
                )));
            }
            if let Some(peer) = Peer::of(req.extensions()) {
                peer.session.authenticate();
            }
            return Box::pin(self.inner.call(req));
        }
        if !path.starts_with(SANDBOX_SERVICE_PREFIX) {
            return Box::pin(self.inner.call(req));
        }
        if let Err(status) = self.gate.auth.tenant_of_parts(req.extensions(), req.headers()) {
            // Dropping the request drops its unread body: h2 resets the stream after the answer.
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        if let Some(peer) = Peer::of(req.extensions()) {
            peer.session.authenticate();
        }
        if path != WRITE_FILE_PATH {
            return Box::pin(self.inner.call(req));
        }
        // The service poll_ready readied is the one to call later; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let permits = self.gate.write_permits.clone();
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
        .and_then(telemetry::parse_traceparent)
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
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

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
                Ok(http::Response::new("called".into()))
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
        let mut svc = Gate::new(Arc::new(Auth::new(&Default::default())), 2).layer(counting.clone());
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

    fn counting() -> Counting {
        Counting { now: Arc::default(), peak: Arc::default(), release: Arc::new(tokio::sync::Semaphore::new(0)) }
    }

    fn with_token(path: &str, token: &str) -> http::Request<()> {
        let mut r = request(path);
        r.headers_mut().insert("authorization", format!("Bearer {token}").parse().expect("header"));
        r
    }

    fn grpc_status(r: &http::Response<String>) -> Option<&str> {
        r.headers().get("grpc-status").and_then(|v| v.to_str().ok())
    }

    /// Issue 20: four WriteFile calls without a valid token used to hold every permit. Now they
    /// are answered UNAUTHENTICATED at once, never reach the handler, and a tenant's writes are
    /// admitted as before.
    #[tokio::test]
    async fn unauthenticated_calls_are_answered_before_the_handler_and_take_no_permit() {
        use crate::config::{AuthConfig, TokenConfig};
        use std::sync::atomic::Ordering::SeqCst;
        use tower::{Layer, Service};
        let auth =
            Auth::new(&AuthConfig { tokens: vec![TokenConfig { tenant: "a".into(), sha256: crate::api::auth::token_hash("good") }], ..Default::default() });
        let counting = counting();
        let mut svc = Gate::new(Arc::new(auth), 1).layer(counting.clone());
        for r in [request(WRITE_FILE_PATH), with_token(WRITE_FILE_PATH, "bad"), with_token("/sandbox.v1.SandboxService/ListSandboxes", "bad")] {
            let answer = svc.call(r).await.expect("answered");
            assert_eq!(grpc_status(&answer), Some("16"), "UNAUTHENTICATED");
            assert_eq!(answer.body(), "", "the handler never ran");
        }
        assert_eq!(counting.peak.load(SeqCst), 0);
        // The tenant's write gets the one permit while unauthenticated writes keep coming.
        let write = tokio::spawn(svc.call(with_token(WRITE_FILE_PATH, "good")));
        for _ in 0..8 {
            let answer = svc.call(request(WRITE_FILE_PATH)).await.expect("answered");
            assert_eq!(grpc_status(&answer), Some("16"));
        }
        counting.release.add_permits(1);
        assert_eq!(write.await.expect("task").expect("served").body(), "called");
        // Health and reflection stay open.
        counting.release.add_permits(1);
        assert_eq!(svc.call(request("/grpc.health.v1.Health/Check")).await.expect("served").body(), "called");
    }

    /// A call that passes authentication lifts its connection's pre-authentication bounds.
    #[tokio::test]
    async fn an_authenticated_call_marks_its_connection() {
        use crate::config::{AuthConfig, TokenConfig};
        use tower::{Layer, Service};
        let auth =
            Auth::new(&AuthConfig { tokens: vec![TokenConfig { tenant: "a".into(), sha256: crate::api::auth::token_hash("good") }], ..Default::default() });
        let limits = ConnLimits::tcp(&Default::default());
        let (_client, server) = tokio::io::duplex(64);
        let permit = limits.admit(PeerKey::Ip(std::net::Ipv4Addr::LOCALHOST.into())).expect("admit");
        let conn = Guarded::new(server, Transport::Tcp(None), false, permit, Duration::from_secs(60));
        let peer = tonic::transport::server::Connected::connect_info(&conn);
        let counting = counting();
        counting.release.add_permits(2);
        let mut svc = Gate::new(Arc::new(auth), 1).layer(counting.clone());
        let mut bad = with_token("/sandbox.v1.SandboxService/ListSandboxes", "bad");
        bad.extensions_mut().insert(peer.clone());
        svc.call(bad).await.expect("answered");
        assert!(!peer.session.is_authenticated());
        let mut good = with_token("/sandbox.v1.SandboxService/ListSandboxes", "good");
        good.extensions_mut().insert(peer.clone());
        assert_eq!(svc.call(good).await.expect("served").body(), "called");
        assert!(peer.session.is_authenticated());
    }
}
