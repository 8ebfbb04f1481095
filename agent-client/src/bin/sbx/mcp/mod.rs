//! `sbx mcp`: sandboxes as Model Context Protocol tools, for agents such as Claude Code, Codex
//! CLI or Goose.
//!
//! A front door like the CLI itself: every tool is a call of the typed [`Client`], nothing
//! here knows the daemon's insides. The server speaks MCP over stdio (one session per process:
//! the session ends when stdin closes or a SIGTERM/SIGINT arrives) or over streamable HTTP on a
//! loopback port (one session shared by all clients, ending when `sbx` stops). Either way, the
//! sandboxes the session created are destroyed at its end, except those created with
//! `keep: true`, and a call that fails is an MCP tool error carrying the daemon's message: the
//! server itself never goes down because of a call.

mod format;
mod hostdir;
mod tools;

use std::sync::Arc;

use agent_client::proto::CreateSandboxRequest;
use agent_client::{Client, Error as ClientError};
use anyhow::{Context, Result};
use rmcp::ServiceExt;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::McpArgs;
use crate::Ctx;

pub use hostdir::HostDir;
pub use tools::SandboxTools;

/// The label every sandbox created through `sbx mcp` carries, so an operator can find them.
pub const CREATED_BY_LABEL: (&str, &str) = ("created-by", "sbx-mcp");

/// A sandbox this session created.
#[derive(Debug, Clone)]
struct Owned {
    id: String,
    keep: bool,
}

/// What one MCP session knows: the daemon, its default sandbox, the sandboxes it created.
#[derive(Debug)]
pub struct Session {
    client: Client,
    /// How the default sandbox is made (from `sbx mcp`'s options).
    default_spec: CreateSandboxRequest,
    /// The sandbox calls without a `sandbox_id` use. Held across its creation, so two first
    /// calls arriving together make one sandbox, not two.
    default: tokio::sync::Mutex<Option<String>>,
    created: std::sync::Mutex<Vec<Owned>>,
    host_dir: Option<HostDir>,
    output_limit: u64,
}

impl Session {
    /// A session on `client`; `default_spec` shapes the sandbox created on first use.
    pub fn new(
        client: Client,
        mut default_spec: CreateSandboxRequest,
        host_dir: Option<HostDir>,
        output_limit: u64,
    ) -> Self {
        default_spec
            .labels
            .entry(CREATED_BY_LABEL.0.into())
            .or_insert_with(|| CREATED_BY_LABEL.1.into());
        Self {
            client,
            default_spec,
            default: tokio::sync::Mutex::new(None),
            created: std::sync::Mutex::new(Vec::new()),
            host_dir,
            output_limit,
        }
    }

    fn created(&self) -> std::sync::MutexGuard<'_, Vec<Owned>> {
        // A panic while holding this lock cannot leave the list half-changed (each change is
        // one push or retain), so a poisoned lock is still good.
        self.created
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The sandbox a call names, or the default one, created now if there is none yet.
    pub async fn sandbox(&self, given: Option<&str>) -> Result<String> {
        if let Some(id) = given.map(str::trim).filter(|s| !s.is_empty()) {
            return Ok(id.to_owned());
        }
        let mut default = self.default.lock().await;
        if let Some(id) = default.as_ref() {
            return Ok(id.clone());
        }
        let sandbox = self
            .create(self.default_spec.clone(), false)
            .await
            .context("cannot create the default sandbox")?;
        tracing::info!(sandbox = %sandbox.id, "created the session's default sandbox");
        *default = Some(sandbox.id.clone());
        Ok(sandbox.id)
    }

    /// The current default sandbox, if one was made or chosen.
    pub async fn default_id(&self) -> Option<String> {
        self.default.lock().await.clone()
    }

    /// Makes `id` the sandbox calls without a `sandbox_id` use.
    pub async fn set_default(&self, id: &str) {
        *self.default.lock().await = Some(id.to_owned());
    }

    /// Creates a sandbox and records it as this session's (destroyed at the end unless `keep`).
    pub async fn create(
        &self,
        mut request: CreateSandboxRequest,
        keep: bool,
    ) -> Result<agent_client::proto::Sandbox, ClientError> {
        request
            .labels
            .entry(CREATED_BY_LABEL.0.into())
            .or_insert_with(|| CREATED_BY_LABEL.1.into());
        let sandbox = self.client.create(request).await?;
        self.created().push(Owned {
            id: sandbox.id.clone(),
            keep,
        });
        Ok(sandbox)
    }

    /// Destroys a sandbox and forgets it (as the default, as the session's).
    pub async fn destroy(&self, id: &str) -> Result<(), ClientError> {
        self.client.destroy(id).await?;
        self.created().retain(|o| o.id != id);
        let mut default = self.default.lock().await;
        if default.as_deref() == Some(id) {
            *default = None;
        }
        Ok(())
    }

    /// Whether this session created `id`, and whether it is kept after the session.
    pub fn ownership(&self, id: &str) -> Option<bool> {
        self.created().iter().find(|o| o.id == id).map(|o| o.keep)
    }

    /// Destroys every sandbox the session created without `keep`, all at once (the client may
    /// give a closing server only a few seconds). A sandbox already gone counts as destroyed.
    pub async fn end(&self) {
        let doomed: Vec<String> = self
            .created()
            .iter()
            .filter(|o| !o.keep)
            .map(|o| o.id.clone())
            .collect();
        let results =
            futures::future::join_all(doomed.iter().map(|id| self.client.destroy(id))).await;
        for (id, result) in doomed.iter().zip(results) {
            match result {
                Ok(()) => tracing::info!(sandbox = %id, "session ended: destroyed its sandbox"),
                Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {}
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "session ended: cannot destroy its sandbox")
                }
            }
        }
        self.created().retain(|o| o.keep);
    }

    /// The daemon client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The allowed host directory, if the operator gave one.
    pub fn host_dir(&self) -> Option<&HostDir> {
        self.host_dir.as_ref()
    }

    /// Output of run_command shown per stream.
    pub fn output_limit(&self) -> u64 {
        self.output_limit
    }
}

/// Logs go to stderr (stdout carries the protocol), filtered by `SBX_LOG` (default: warn).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SBX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// Runs `sbx mcp` until its session ends.
pub async fn serve(ctx: &Ctx, args: McpArgs) -> Result<u8> {
    init_logging();
    let host_dir = args
        .allow_host_dir
        .as_deref()
        .map(HostDir::open)
        .transpose()?;
    if let Some(addr) = args.http {
        if !addr.ip().is_loopback() {
            anyhow::bail!("--http {addr}: only a loopback address is served (the endpoint's only guard is a bearer token, sent in clear text)");
        }
    }
    // Connecting first makes a wrong socket a clear start-up failure the MCP host shows,
    // rather than an error on every tool call.
    let client = ctx.client().await?;
    let session = Arc::new(Session::new(
        client,
        args.spec.to_request(None),
        host_dir,
        args.output_limit.max(256),
    ));
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let by_signal = match args.http {
        None => serve_stdio(session.clone(), &mut term, &mut int).await?,
        Some(addr) => serve_http(session.clone(), addr, &mut term, &mut int).await?,
    };
    // The signal handlers stay installed, so a second SIGTERM (an MCP client escalating after
    // closing stdin) does not cut the clean-up short.
    session.end().await;
    if by_signal {
        // A read of stdin may still be pending on a blocking thread, which would hold the
        // runtime's shutdown until the next line arrives.
        std::process::exit(0);
    }
    Ok(0)
}

/// Serves one session on stdin/stdout; true when a signal ended it.
async fn serve_stdio(
    session: Arc<Session>,
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
) -> Result<bool> {
    let running = SandboxTools::new(session)
        .serve(rmcp::transport::stdio_pipes())
        .await
        .context("MCP session on stdio failed to start")?;
    let token = running.cancellation_token();
    let waiting = running.waiting();
    tokio::pin!(waiting);
    let by_signal = tokio::select! {
        r = &mut waiting => {
            tracing::info!(reason = ?r, "MCP client closed the session");
            false
        }
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    if by_signal {
        tracing::info!("signal: ending the MCP session");
        token.cancel();
        let _ = waiting.await;
    }
    Ok(by_signal)
}

/// The bearer token `sbx mcp --http` requires; generated (and printed) when unset.
pub const TOKEN_ENV: &str = "SBX_MCP_TOKEN";

/// Equal bytes, compared in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves streamable HTTP at `addr` (path `/mcp`) until a signal; true (always a signal).
async fn serve_http(
    session: Arc<Session>,
    addr: std::net::SocketAddr,
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
) -> Result<bool> {
    use rmcp::transport::streamable_http_server::{
        session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let service: StreamableHttpService<SandboxTools, LocalSessionManager> =
        StreamableHttpService::new(
            move || Ok(SandboxTools::new(session.clone())),
            Default::default(),
            StreamableHttpServerConfig::default().with_cancellation_token(stop.child_token()),
        );
    // Loopback is not private: any local user could reach the port, and through it the
    // operator's daemon access and allowed host directory. Every request needs the token.
    let token = match std::env::var(TOKEN_ENV) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_owned(),
        _ => format!("{:032x}", rand::random::<u128>()),
    };
    let expected = Arc::new(format!("Bearer {token}"));
    let router = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let expected = expected.clone();
                async move {
                    let given = req
                        .headers()
                        .get(axum::http::header::AUTHORIZATION)
                        .map(|v| v.as_bytes())
                        .unwrap_or_default();
                    if same(given, expected.as_bytes()) {
                        next.run(req).await
                    } else {
                        use axum::response::IntoResponse;
                        (
                            axum::http::StatusCode::UNAUTHORIZED,
                            format!("sbx mcp: send Authorization: Bearer <token> (the token sbx printed, or {TOKEN_ENV})\n"),
                        )
                            .into_response()
                    }
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr().unwrap_or(addr);
    crate::output::note(&format!(
        "sbx mcp: streamable HTTP on http://{bound}/mcp with header: Authorization: Bearer {token}"
    ))?;
    let shutdown = stop.clone();
    let server = axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled_owned().await });
    let server = std::future::IntoFuture::into_future(server);
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => { r.context("the HTTP server failed")?; }
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    stop.cancel();
    Ok(true)
}
