//! The E2B-compatible front door: the unmodified `e2b` SDK (PyPI, npm) runs against sandboxd.
//!
//! E2B splits its API in two, and so does this module. The control plane ([`control`]) is REST
//! with JSON bodies (create, get, list, kill, timeout, connect), authenticated by `X-API-Key`,
//! whose value is one of our tenants' tokens from `[auth]`. The in-sandbox API ("envd") is
//! Connect-RPC ([`connect`]) for processes ([`process`]) and the filesystem ([`filesystem`]),
//! plus HTTP `/files` for uploads and downloads; the SDK sends it to `E2B_SANDBOX_URL` with the
//! sandbox named in an `E2b-Sandbox-Id` header and the token this module issued at create or
//! connect in `X-Access-Token`. Both halves share one listener (their paths never overlap), so
//! `E2B_API_URL` and `E2B_SANDBOX_URL` may be the same address.
//!
//! Everything is a call on the [`Manager`]'s public API with the caller's tenant: the errors,
//! limits and tenancy are the daemon's; the manager never knows this module exists.

mod connect;
mod control;
mod filesystem;
mod multipart;
mod process;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::api::Auth;
use crate::audit::{millis, AuditEntry, AuditLog};
pub use crate::config::E2bConfig;
use crate::error::Error;
use crate::manager::Manager;

/// The envd version this front door answers as. It decides which SDK features are used: 0.5.7
/// has octet-stream uploads and closing stdin; file metadata (0.6.2) and watch events with
/// entries (0.6.3) are newer, so the SDK refuses them itself with its own clear message.
pub const ENVD_VERSION: &str = "0.5.7";

/// Largest JSON body (control plane, unary RPC) read from a client.
const MAX_JSON_BODY: usize = 1 << 20;
/// How long a client may take to send a JSON body.
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The response body every handler returns: whole or streamed.
pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// What every handler shares.
pub(crate) struct State {
    manager: Arc<Manager>,
    auth: Arc<Auth>,
    audit: Arc<AuditLog>,
    cfg: E2bConfig,
    /// Keys the envd access tokens: random per start, so a token never outlives the daemon
    /// (`connect` issues a new one).
    token_key: [u8; 32],
    processes: process::Table,
    watchers: filesystem::Watchers,
}

/// Serves the E2B API on `listener` until `stop`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: E2bConfig,
    manager: Arc<Manager>,
    auth: Arc<Auth>,
    audit: Arc<AuditLog>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    if !auth.tokens_required() {
        tracing::warn!(addr = ?cfg.listen, "E2B listener without [auth] tokens: any API key acts as the local tenant");
    }
    let state = Arc::new(State {
        manager,
        auth,
        audit,
        cfg: cfg.clone(),
        token_key: rand::random(),
        processes: process::Table::default(),
        watchers: filesystem::Watchers::default(),
    });
    let connections = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            p = connections.clone().acquire_owned() => p.map_err(|e| std::io::Error::other(e.to_string()))?,
        };
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = listener.accept() => r?,
        };
        let state = state.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(state, req).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(io, service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r { tracing::debug!(%peer, error = %e, "E2B connection ended") },
                _ = stop.cancelled() => conn.as_mut().graceful_shutdown(),
            }
        });
    }
}

/// Dispatches a request: envd's paths first (Connect-RPC services, `/files`, `/health`), the
/// control plane's otherwise.
async fn route(state: Arc<State>, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let path = req.uri().path().to_string();
    if let Some(method) = path.strip_prefix("/process.Process/") {
        let method = method.to_string();
        return process::handle(&state, &method, req).await;
    }
    if let Some(method) = path.strip_prefix("/filesystem.Filesystem/") {
        let method = method.to_string();
        return filesystem::handle_rpc(&state, &method, req).await;
    }
    match path.as_str() {
        "/files" => return filesystem::handle_files(&state, req).await,
        "/health" => return health(&state, req.headers()),
        _ => {}
    }
    control::handle(&state, req).await
}

/// envd's `/health`. With a sandbox named, it answers for that sandbox as E2B's edge does: 502
/// for one that is gone (the SDK's `is_running()` is false), 401 for a bad token.
fn health(state: &State, headers: &http::HeaderMap) -> http::Response<Body> {
    if !headers.contains_key("e2b-sandbox-id") {
        return empty(http::StatusCode::NO_CONTENT);
    }
    let alive = state.envd_caller(headers).and_then(|(tenant, id)| state.manager.get(&tenant, &id));
    match alive {
        Ok(_) => empty(http::StatusCode::NO_CONTENT),
        Err(e) if is_unauthenticated(&e) => json_response(http::StatusCode::UNAUTHORIZED, &serde_json::json!({"code": 401, "message": e.to_string()})),
        Err(e) => json_response(http::StatusCode::BAD_GATEWAY, &serde_json::json!({"code": 502, "message": e.to_string()})),
    }
}

impl State {
    /// The tenant of a control-plane call: its `X-API-Key` (or `Authorization: Bearer`) is a
    /// token of `[auth]`, checked exactly as the gRPC API checks its bearer tokens.
    fn api_tenant(&self, headers: &http::HeaderMap) -> Result<String, Error> {
        let mut auth_headers = http::HeaderMap::new();
        if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
            let value = http::HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| Error::PermissionDenied("malformed X-API-Key".into()))?;
            auth_headers.insert(http::header::AUTHORIZATION, value);
        } else if let Some(v) = headers.get(http::header::AUTHORIZATION) {
            auth_headers.insert(http::header::AUTHORIZATION, v.clone());
        }
        self.auth.tenant_of_parts(&http::Extensions::new(), &auth_headers).map_err(|s| Error::PermissionDenied(format!("unauthenticated: {}", s.message())))
    }

    /// The access token for envd calls on `sandbox_id` of `tenant` (see [`issue_token`]).
    fn envd_token(&self, tenant: &str, sandbox_id: &str) -> String {
        issue_token(&self.token_key, tenant, sandbox_id)
    }

    /// The tenant and sandbox of an envd call, from `E2b-Sandbox-Id` and `X-Access-Token`.
    fn envd_caller(&self, headers: &http::HeaderMap) -> Result<(String, String), Error> {
        let sandbox_id = headers
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Error::invalid("E2b-Sandbox-Id", "missing: every envd request names its sandbox"))?
            .to_string();
        let token = headers
            .get("x-access-token")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Error::PermissionDenied("unauthenticated: missing X-Access-Token (the envdAccessToken of create or connect)".into()))?;
        let tenant = verify_token(&self.token_key, &sandbox_id, token)
            .ok_or_else(|| Error::PermissionDenied(format!("unauthenticated: invalid access token for sandbox {sandbox_id} (connect again for a new one)")))?;
        Ok((tenant, sandbox_id))
    }

    /// Writes the audit line of a call that changed state, as the gRPC API does.
    fn audit(&self, a: Audited<'_>, error: Option<&Error>, started: std::time::Instant) {
        self.audit.record(&AuditEntry {
            tenant: a.tenant,
            rpc: a.rpc,
            sandbox_id: a.sandbox_id,
            argv: a.argv,
            env: None,
            detail: a.detail,
            status: error.map(error_code_name).unwrap_or("OK"),
            duration_ms: millis(started.elapsed()),
            trace: a.trace,
        });
    }
}

/// What the audit line of a call says besides its outcome and duration.
struct Audited<'a> {
    rpc: &'a str,
    tenant: &'a str,
    sandbox_id: &'a str,
    argv: Option<&'a [String]>,
    detail: &'a str,
    /// The caller's trace, when its request carried a `traceparent`.
    trace: Option<&'a crate::model::TraceContext>,
}

/// An envd access token: the tenant in hex, a dot, and HMAC-SHA256 under `key` (random per
/// daemon start) of the tenant and the sandbox id. The token alone says whose call it is, works
/// for that one sandbox only, and cannot be made without the key.
fn issue_token(key: &[u8; 32], tenant: &str, sandbox_id: &str) -> String {
    let tenant_hex: String = tenant.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{tenant_hex}.{}", hex(&token_mac(key, tenant, sandbox_id)))
}

/// The tenant a token was issued to, if it is a token of this key for `sandbox_id`.
fn verify_token(key: &[u8; 32], sandbox_id: &str, token: &str) -> Option<String> {
    let (tenant_hex, mac) = token.split_once('.')?;
    let tenant = decode_hex(tenant_hex).and_then(|b| String::from_utf8(b).ok())?;
    let expected = hex(&token_mac(key, &tenant, sandbox_id));
    // Compared as digests of both sides, so the time taken says nothing about the token.
    (Sha256::digest(expected.as_bytes()) == Sha256::digest(mac.as_bytes())).then_some(tenant)
}

/// HMAC-SHA256 (RFC 2104) of the tenant and the sandbox id, NUL-separated.
fn token_mac(key: &[u8; 32], tenant: &str, sandbox_id: &str) -> [u8; 32] {
    let pad = |byte: u8| {
        let mut p = [byte; 64];
        p.iter_mut().zip(key).for_each(|(p, k)| *p ^= k);
        p
    };
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(tenant.as_bytes()).chain_update([0]).chain_update(sandbox_id.as_bytes()).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 512 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok())).collect()
}

/// The gRPC code name the audit log uses for an error.
fn error_code_name(e: &Error) -> &'static str {
    match e {
        Error::SandboxNotFound(_)
        | Error::ExecNotFound(_)
        | Error::SnapshotNotFound(_)
        | Error::ImageNotFound { .. }
        | Error::NotFound(_)
        | Error::FileNotFound(_) => "NOT_FOUND",
        Error::InvalidArgument { .. } => "INVALID_ARGUMENT",
        Error::IncorrectState { .. } | Error::Unavailable { .. } | Error::FailedPrecondition(_) => "FAILED_PRECONDITION",
        Error::ResourceExhausted(_) => "RESOURCE_EXHAUSTED",
        Error::PermissionDenied(_) => "PERMISSION_DENIED",
        Error::Aborted(_) => "ABORTED",
        Error::DataLoss(_) => "DATA_LOSS",
        Error::DeadlineExceeded(_) => "DEADLINE_EXCEEDED",
        Error::Internal(_) => "INTERNAL",
    }
}

/// Whether an error is the caller's failure to authenticate (our `PermissionDenied` carries
/// both; the E2B SDK wants 401 for a bad key).
fn is_unauthenticated(e: &Error) -> bool {
    matches!(e, Error::PermissionDenied(m) if m.starts_with("unauthenticated:"))
}

/// The HTTP status of a core error, as E2B's APIs use them.
fn http_status(e: &Error) -> http::StatusCode {
    use http::StatusCode as S;
    match e {
        e if is_unauthenticated(e) => S::UNAUTHORIZED,
        Error::SandboxNotFound(_)
        | Error::ExecNotFound(_)
        | Error::SnapshotNotFound(_)
        | Error::ImageNotFound { .. }
        | Error::NotFound(_)
        | Error::FileNotFound(_) => S::NOT_FOUND,
        Error::InvalidArgument { .. } => S::BAD_REQUEST,
        Error::IncorrectState { .. } | Error::FailedPrecondition(_) => S::CONFLICT,
        Error::Unavailable { .. } => S::SERVICE_UNAVAILABLE,
        Error::ResourceExhausted(_) => S::TOO_MANY_REQUESTS,
        Error::PermissionDenied(_) => S::FORBIDDEN,
        Error::Aborted(_) => S::CONFLICT,
        Error::DeadlineExceeded(_) => S::GATEWAY_TIMEOUT,
        Error::DataLoss(_) | Error::Internal(_) => S::INTERNAL_SERVER_ERROR,
    }
}

/// A whole response body.
fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

fn empty(status: http::StatusCode) -> http::Response<Body> {
    respond(status, None, Bytes::new())
}

fn respond(status: http::StatusCode, content_type: Option<&str>, body: impl Into<Bytes>) -> http::Response<Body> {
    let mut resp = http::Response::new(full(body));
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        if let Ok(v) = http::HeaderValue::from_str(ct) {
            resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
        }
    }
    resp
}

fn json_response(status: http::StatusCode, value: &serde_json::Value) -> http::Response<Body> {
    respond(status, Some("application/json"), serde_json::to_vec(value).unwrap_or_default())
}

/// A request body of at most [`MAX_JSON_BODY`] bytes, sent within [`BODY_DEADLINE`].
async fn read_body(body: hyper::body::Incoming) -> Result<Bytes, Error> {
    match tokio::time::timeout(BODY_DEADLINE, Limited::new(body, MAX_JSON_BODY).collect()).await {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) => Err(Error::invalid("body", format!("unreadable or larger than {MAX_JSON_BODY} bytes: {e}"))),
        Err(_) => Err(Error::DeadlineExceeded(format!("the request body did not arrive within {} s", BODY_DEADLINE.as_secs()))),
    }
}

/// The first value of `key` in a URL query, percent-decoded.
fn control_query(query: &str, key: &str) -> Option<String> {
    control::query_pairs(query).into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// RFC 3339 with seconds, as E2B's timestamps are.
fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// A path inside the sandbox, relative ones taken from its workdir (E2B resolves them from the
/// user's home; ours is the workdir execs start in).
fn sandbox_path(workdir: &str, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() {
        workdir.to_string()
    } else {
        format!("{}/{}", workdir.trim_end_matches('/'), path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_start_at_the_workdir() {
        assert_eq!(sandbox_path("/workspace", "a/b"), "/workspace/a/b");
        assert_eq!(sandbox_path("/workspace/", "a"), "/workspace/a");
        assert_eq!(sandbox_path("/workspace", "/etc/x"), "/etc/x");
        assert_eq!(sandbox_path("/workspace", ""), "/workspace");
    }

    #[test]
    fn a_token_works_for_its_tenant_and_sandbox_only() {
        let key = [7u8; 32];
        let token = issue_token(&key, "alice", "sb-aaaa");
        assert_eq!(verify_token(&key, "sb-aaaa", &token).as_deref(), Some("alice"));
        assert_eq!(verify_token(&key, "sb-bbbb", &token), None, "another sandbox");
        assert_eq!(verify_token(&[8u8; 32], "sb-aaaa", &token), None, "another daemon run");
        let mac = token.split_once('.').map(|(_, m)| m.to_string()).unwrap_or_default();
        assert_eq!(verify_token(&key, "sb-aaaa", &format!("{}.{mac}", hex(b"bob"))), None, "another tenant's name on alice's mac");
        assert_eq!(verify_token(&key, "sb-aaaa", "garbage"), None);
        // HMAC-SHA256 as Python's hmac computes it: hmac.new(bytes([7]*32), b"alice\0sb-aaaa", sha256).
        assert_eq!(hex(&token_mac(&key, "alice", "sb-aaaa")), "2f65ca77519d673403eafe181fb76c71735a634ee6a77a774404bbcbd7556e08");
    }

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        assert_eq!(decode_hex("6c6f63616c").as_deref(), Some(&b"local"[..]));
        assert_eq!(decode_hex("6"), None);
        assert_eq!(decode_hex("zz"), None);
    }
}
