//! Listeners, health, reflection, TTL reaping and graceful shutdown around the API.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use sandbox_proto::v1::sandbox_service_server::SandboxServiceServer;
use tokio_util::sync::CancellationToken;

use crate::api::Api;
use crate::backend::process::{ProcessBackend, ProcessConfig};
use crate::backend::Backends;
use crate::config::{Config, ListenAddr};
use crate::manager::Manager;
use crate::store::Store;

/// Largest gRPC message either way (WriteFile content, ExecResult with two 16 MiB streams).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Runs the daemon until SIGTERM or SIGINT, then shuts down cleanly.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let cfg = Arc::new(cfg);
    std::fs::create_dir_all(&cfg.state_dir).with_context(|| format!("creating state dir {}", cfg.state_dir.display()))?;

    let mut backends = Backends::default();
    let process = ProcessBackend::new(ProcessConfig {
        state_dir: cfg.state_dir.clone(),
        images_dir: cfg.images_dir.clone(),
        pool_size_bytes: cfg.pool_size_bytes,
    });
    backends.insert(Arc::new(process));
    let store = Store::open(&cfg.state_dir.join("state.db")).context("opening the state database")?;
    let manager = Manager::new(cfg.clone(), backends, store);
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
    let mut unix_paths = Vec::new();
    for addr in &cfg.listen {
        let api = SandboxServiceServer::new(Api::new(manager.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let router = tonic::transport::Server::builder().add_service(health_service.clone()).add_service(reflection.clone()).add_service(api);
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
                // Only root (the daemon's owner) may connect until auth lands.
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).with_context(|| format!("chmod {}", path.display()))?;
                unix_paths.push(path.clone());
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                servers.spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await });
            }
            ListenAddr::Tcp(sock) => {
                let listener = tokio::net::TcpListener::bind(sock).await.with_context(|| format!("binding {sock}"))?;
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                servers.spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await });
            }
        }
        tracing::info!(%addr, "listening");
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
    for path in unix_paths {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}
