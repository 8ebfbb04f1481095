//! Listeners, health, reflection, TTL reaping and graceful shutdown around the API.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use sandbox_proto::v1::sandbox_service_server::SandboxServiceServer;
use tokio_util::sync::CancellationToken;

use crate::api::{Api, Auth};
use crate::audit::AuditLog;
use crate::metrics::{self, Metrics};
use crate::backend::container::{docker_socket_from_env, ContainerBackend, ContainerConfig};
use crate::backend::process::{ProcessBackend, ProcessConfig};
use crate::backend::microvm::MicroVmBackend;
use crate::backend::Backends;
use crate::config::{Config, ListenAddr};
use crate::manager::Manager;
use crate::store::Store;
use crate::telemetry;

/// Largest gRPC message either way (WriteFile content, ExecResult with two 16 MiB streams).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Runs the daemon until SIGTERM or SIGINT, then shuts down cleanly.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let cfg = Arc::new(cfg);
    // Before anything writes there: the trees that will hold sandbox bytes are sealed.
    crate::hostfs::seal_state_dir(&cfg.state_dir).with_context(|| format!("sealing state dir {}", cfg.state_dir.display()))?;

    let mut backends = Backends::default();
    let process = ProcessBackend::new(ProcessConfig {
        state_dir: cfg.state_dir.clone(),
        images_dir: cfg.images_dir.clone(),
        pool_size_bytes: cfg.pool_size_bytes,
    });
    backends.insert(Arc::new(process));
    // Never fails: without Docker the tier reports itself unavailable, with the reason.
    let container = ContainerBackend::new(ContainerConfig {
        state_dir: cfg.state_dir.clone(),
        images_dir: cfg.images_dir.clone(),
        docker_socket: docker_socket_from_env(),
    })
    .await;
    backends.insert(Arc::new(container));
    // Never fails either: without QEMU or VM images the tier reports why.
    let microvm = MicroVmBackend::new(cfg.microvm.clone(), &cfg.state_dir, &cfg.images_dir, cfg.limits.default);
    backends.insert(Arc::new(microvm));
    let store = Store::open(&cfg.state_dir.join("state.db")).context("opening the state database")?;
    let metrics = Metrics::new().context("registering metrics")?;
    let manager = Manager::new(cfg.clone(), backends, store, metrics);
    let auth = Arc::new(Auth::new(&cfg.auth));
    let audit = Arc::new(AuditLog::open(&cfg.audit, cfg.state_dir.join("audit.jsonl")).context("opening the audit log")?);
    // Before serving: re-adopt the sandboxes on record and clean whatever a crash left behind.
    manager.recover().await.context("recovering state from the previous run")?;

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
    for addr in &cfg.listen {
        let api = SandboxServiceServer::new(Api::new(manager.clone(), auth.clone(), audit.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let mut builder = tonic::transport::Server::builder().trace_fn(rpc_span);
        if let (ListenAddr::Tcp(_), Some(tls)) = (addr, &tls) {
            builder = builder.tls_config(tls.clone()).context("configuring TLS")?;
        }
        let router = builder.add_service(health_service.clone()).add_service(reflection.clone()).add_service(api);
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
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(cfg.auth.unix_socket_mode)).with_context(|| format!("chmod {}", path.display()))?;
                unix_paths.push(path.clone());
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
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

    #[test]
    fn traceparent_parses_and_rejects_garbage() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(parse_traceparent(tp), Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")));
        assert_eq!(parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
        assert_eq!(parse_traceparent("garbage"), None);
    }
}
