//! The operator's page: a small HTML/JS page embedded in the binary and the JSON it reads, on a
//! listener of its own (`sandboxd --web 127.0.0.1:PORT`, `[web]`), off by default.
//!
//! It shows what `sbx ls`, `sbx execs`, `sbx image ls`, the metrics and `sbx agent show` show:
//! the caller's sandboxes by tier and state, one sandbox's exec records (output head and tail on
//! demand) and snapshots, images with their tier readiness, each tier's health, key metrics
//! (and on a fleet each node's status), and the `sbx agent` runs of `[web] agent_runs_dir`.
//! Live updates are long polls ([`wait`]): bounded per client address and in all, each with a
//! deadline.
//!
//! Security: the caller is authenticated exactly as on the gRPC API ([`Auth`]: a bearer token
//! of `[auth]`, or, when the API has no tokens, the local tenant — and then the listener must be
//! on loopback, which the config enforces, and the `Host` header must name it, so a web page
//! elsewhere cannot reach it through DNS rebinding). A tenant sees only its own sandboxes (on
//! a fleet, on every node, through the same fan-out as the gRPC list) and the agent runs whose
//! sandbox is theirs. The state-changing calls, destroy and an agent run's steer and stop,
//! exist only with `[web] allow_destroy = true`, and each needs a custom header no cross-site
//! form can send. Everything a sandbox produced is hostile: the page puts it in the DOM as
//! text only (never as HTML) and the Content-Security-Policy allows no script but the page's
//! own.
//!
//! Like the E2B front door, everything here is a call on the [`Manager`]'s public API (or, for
//! a steer or stop, a file in the run's inbox, through `agent-inbox`); the
//! manager never knows this module exists.

mod runs;
mod views;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use tokio_util::sync::CancellationToken;

use crate::api::Auth;
use crate::audit::{millis, AuditEntry, AuditLog};
pub use crate::config::WebConfig;
use crate::error::Error;
use crate::fleet::Fleet;
use crate::manager::Manager;

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a client may take to send a request's body (a steer or stop: a few KiB).
const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// Connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 64;
/// Long polls waiting at once, in all and per client address.
const MAX_WAITS: usize = 16;
const MAX_WAITS_PER_CLIENT: usize = 4;
/// The longest a long poll is held before it answers "nothing changed".
const WAIT_DEADLINE: Duration = Duration::from_secs(20);
/// How often a long poll looks again.
const WAIT_INTERVAL: Duration = Duration::from_millis(500);

/// The page's files, embedded: nothing is read from disk, nothing comes from a CDN.
const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// No script, style, frame or connection but the page's own; no inline script at all, so text
/// a sandbox wrote can never run even if it reached the DOM as markup.
const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

type Body = Full<Bytes>;
type Response = http::Response<Body>;

/// What every request shares.
struct State {
    manager: Arc<Manager>,
    auth: Arc<Auth>,
    audit: Arc<AuditLog>,
    fleet: Option<Arc<Fleet>>,
    cfg: WebConfig,
    /// The `Host` values a request may carry when the page answers without tokens.
    hosts: Vec<String>,
    waits: Arc<tokio::sync::Semaphore>,
    waits_by_client: Mutex<HashMap<IpAddr, usize>>,
}

/// Serves the page on `listener` until `stop`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: WebConfig,
    manager: Arc<Manager>,
    auth: Arc<Auth>,
    audit: Arc<AuditLog>,
    fleet: Option<Arc<Fleet>>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let local = listener.local_addr()?;
    let state = Arc::new(State {
        manager,
        auth,
        audit,
        fleet,
        cfg,
        hosts: allowed_hosts(local),
        waits: Arc::new(tokio::sync::Semaphore::new(MAX_WAITS)),
        waits_by_client: Mutex::new(HashMap::new()),
    });
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
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
                async move { Ok::<_, Infallible>(with_headers(route(&state, peer, req).await)) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(io, service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r { tracing::debug!(%peer, error = %e, "web connection ended") },
                _ = stop.cancelled() => conn.as_mut().graceful_shutdown(),
            }
        });
    }
}

/// The `Host` header values that name this listener: its address, and `localhost` on loopback.
fn allowed_hosts(local: SocketAddr) -> Vec<String> {
    let mut hosts = vec![local.to_string()];
    if local.ip().is_loopback() {
        hosts.push(format!("localhost:{}", local.port()));
    }
    hosts
}

/// Dispatches a request: the page's files, then the JSON API under `/api/`.
async fn route(state: &State, peer: SocketAddr, req: http::Request<hyper::body::Incoming>) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    // Without tokens any caller is the local tenant: only a page this listener served may ask.
    if !state.auth.tokens_required() {
        let host = req.headers().get(http::header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
        if !state.hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return error(http::StatusCode::MISDIRECTED_REQUEST, &format!("Host {host:?} does not name this listener (expected one of {:?})", state.hosts));
        }
    }
    match (&method, path.as_str()) {
        (&http::Method::GET, "/") => return asset("text/html; charset=utf-8", INDEX_HTML),
        (&http::Method::GET, "/app.js") => return asset("text/javascript; charset=utf-8", APP_JS),
        (&http::Method::GET, "/app.css") => return asset("text/css; charset=utf-8", APP_CSS),
        _ => {}
    }
    let Some(api_path) = path.strip_prefix("/api/") else {
        return error(http::StatusCode::NOT_FOUND, &format!("no page at {path}"));
    };
    let tenant = match state.auth.tenant_of_parts(&http::Extensions::new(), req.headers()) {
        Ok(t) => t,
        Err(status) => return error(http::StatusCode::UNAUTHORIZED, &format!("unauthenticated: {}", status.message())),
    };
    let parts: Vec<&str> = api_path.split('/').collect();
    let result = match (&method, parts.as_slice()) {
        (&http::Method::GET, ["overview"]) => Ok(views::overview(state, &tenant).await),
        (&http::Method::GET, ["sandboxes"]) => views::sandboxes(state, &tenant, req.headers()).await,
        (&http::Method::GET, ["sandboxes", id]) => views::sandbox(state, &tenant, id).await,
        (&http::Method::POST, ["sandboxes", id, "destroy"]) => destroy(state, &tenant, id, req.headers()).await,
        (&http::Method::GET, ["execs", id, "output"]) => views::output(state, &tenant, id).await,
        (&http::Method::GET, ["images"]) => views::images(state, &tenant),
        (&http::Method::GET, ["wait"]) => wait(state, &tenant, peer.ip(), &query).await,
        (&http::Method::GET, ["runs"]) => runs::list(state, &tenant).await,
        (&http::Method::GET, ["runs", id]) => runs::show(state, &tenant, id).await,
        (&http::Method::POST, ["runs", id, kind @ ("steer" | "stop")]) => {
            let headers = req.headers().clone();
            match read_body(req, runs::MAX_ACTION_BODY).await {
                Ok(body) => runs::act(state, &tenant, id, kind, &headers, &body).await,
                Err(resp) => return resp,
            }
        }
        (&http::Method::GET | &http::Method::POST, _) => Err(Error::NotFound(format!("no API at {path}"))),
        _ => return error(http::StatusCode::METHOD_NOT_ALLOWED, &format!("{method} is not served here")),
    };
    match result {
        Ok(value) => json(http::StatusCode::OK, &value),
        Err(e) => error(http_status(&e), &e.to_string()),
    }
}

/// A request's body, at most `max` bytes (413 past it) and within [`BODY_DEADLINE`] (408).
async fn read_body(req: http::Request<hyper::body::Incoming>, max: usize) -> Result<Bytes, Response> {
    use http_body_util::BodyExt;
    let too_large = || error(http::StatusCode::PAYLOAD_TOO_LARGE, &format!("the body is larger than {max} bytes"));
    let declared = req.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(BODY_DEADLINE, http_body_util::Limited::new(req.into_body(), max).collect()).await {
        Ok(Ok(body)) => Ok(body.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(e)) => Err(error(http::StatusCode::BAD_REQUEST, &format!("cannot read the body: {e}"))),
        Err(_) => Err(error(http::StatusCode::REQUEST_TIMEOUT, &format!("the body did not arrive within {} s", BODY_DEADLINE.as_secs()))),
    }
}

/// The page's action on a sandbox: destroys one of the caller's, when `[web] allow_destroy` is on.
/// The `X-Sandboxd-Web: destroy` header it requires makes a browser ask first (CORS preflight),
/// which this listener never grants, so no other site's page can send it.
async fn destroy(state: &State, tenant: &str, id: &str, headers: &http::HeaderMap) -> Result<serde_json::Value, Error> {
    if !state.cfg.allow_destroy {
        return Err(Error::PermissionDenied("the page is read-only: set [web] allow_destroy = true to destroy sandboxes from it".into()));
    }
    if headers.get("x-sandboxd-web").and_then(|v| v.to_str().ok()) != Some("destroy") {
        return Err(Error::invalid("X-Sandboxd-Web", "a destroy must carry `X-Sandboxd-Web: destroy`"));
    }
    let started = Instant::now();
    let result = state.manager.destroy(tenant, id).await;
    let trace = crate::telemetry::caller_trace(headers);
    state.audit.record(&AuditEntry {
        tenant,
        rpc: "web.DestroySandbox",
        sandbox_id: id,
        argv: None,
        env: None,
        detail: "",
        status: result.as_ref().err().map(code_name).unwrap_or("OK"),
        duration_ms: millis(started.elapsed()),
        trace: trace.as_ref(),
    });
    result.map(|()| serde_json::json!({ "destroyed": id }))
}

/// The long poll: answers once what the caller's view shows (its sandboxes, with `sandbox=ID`
/// that sandbox's execs and snapshots, and the agent runs' traces) differs from the `seen` fingerprint, or after
/// [`WAIT_DEADLINE`] with the unchanged one. At most [`MAX_WAITS_PER_CLIENT`] per client address
/// and [`MAX_WAITS`] in all wait at once; more are refused (429), not queued.
async fn wait(state: &State, tenant: &str, client: IpAddr, query: &str) -> Result<serde_json::Value, Error> {
    let sandbox = query_value(query, "sandbox").unwrap_or_default();
    let run = query_value(query, "run").unwrap_or_default();
    let seen = query_value(query, "seen").unwrap_or_default();
    let _slot = WaitSlot::take(state, client)?;
    let deadline = Instant::now() + WAIT_DEADLINE;
    let runs = match &state.cfg.agent_runs_dir {
        Some(dir) => runs::watchable(state, tenant, &run).await.map(|(run, only)| (dir.clone(), run, only)),
        None => None,
    };
    loop {
        let mut now = views::fingerprint(state, tenant, &sandbox)?;
        if let Some((dir, run, only)) = &runs {
            now.push('.');
            now.push_str(&runs::fingerprint(dir, run, *only));
        }
        if now != seen || Instant::now() >= deadline {
            return Ok(serde_json::json!({ "fingerprint": now, "changed": now != seen }));
        }
        tokio::time::sleep(WAIT_INTERVAL).await;
    }
}

/// One client's place among the long polls, given back when dropped.
struct WaitSlot<'a> {
    state: &'a State,
    client: IpAddr,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl<'a> WaitSlot<'a> {
    fn take(state: &'a State, client: IpAddr) -> Result<Self, Error> {
        let permit = state.waits.try_acquire().map_err(|_| Error::ResourceExhausted(format!("{MAX_WAITS} long polls are waiting already; try again")))?;
        let mut by_client = state.waits_by_client.lock().map_err(|_| Error::Internal("wait table poisoned".into()))?;
        let n = by_client.entry(client).or_insert(0);
        if *n >= MAX_WAITS_PER_CLIENT {
            return Err(Error::ResourceExhausted(format!("{client} has {MAX_WAITS_PER_CLIENT} long polls waiting already")));
        }
        *n += 1;
        Ok(WaitSlot { state, client, _permit: permit })
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        if let Ok(mut by_client) = self.state.waits_by_client.lock() {
            if let Some(n) = by_client.get_mut(&self.client) {
                *n -= 1;
                if *n == 0 {
                    by_client.remove(&self.client);
                }
            }
        }
    }
}

/// The first value of `key` in a URL query, percent-decoded.
fn query_value(query: &str, key: &str) -> Option<String> {
    query.split('&').filter_map(|pair| pair.split_once('=')).find(|(k, _)| *k == key).map(|(_, v)| percent_decode(v))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => {
                    out.push(b);
                    i += 3;
                    continue;
                }
                None => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The audit log's name for an error's code.
fn code_name(e: &Error) -> &'static str {
    match http_status(e) {
        http::StatusCode::NOT_FOUND => "NOT_FOUND",
        http::StatusCode::BAD_REQUEST => "INVALID_ARGUMENT",
        http::StatusCode::FORBIDDEN => "PERMISSION_DENIED",
        http::StatusCode::CONFLICT => "FAILED_PRECONDITION",
        http::StatusCode::TOO_MANY_REQUESTS => "RESOURCE_EXHAUSTED",
        _ => "INTERNAL",
    }
}

/// The HTTP status of a core error.
fn http_status(e: &Error) -> http::StatusCode {
    use http::StatusCode as S;
    match e {
        Error::SandboxNotFound(_)
        | Error::ExecNotFound(_)
        | Error::SnapshotNotFound(_)
        | Error::ImageNotFound { .. }
        | Error::NotFound(_)
        | Error::FileNotFound(_) => S::NOT_FOUND,
        Error::InvalidArgument { .. } => S::BAD_REQUEST,
        Error::IncorrectState { .. } | Error::FailedPrecondition(_) | Error::Aborted(_) => S::CONFLICT,
        Error::Unavailable { .. } => S::SERVICE_UNAVAILABLE,
        Error::ResourceExhausted(_) => S::TOO_MANY_REQUESTS,
        Error::PermissionDenied(_) => S::FORBIDDEN,
        Error::DeadlineExceeded(_) => S::GATEWAY_TIMEOUT,
        Error::DataLoss(_) | Error::Internal(_) => S::INTERNAL_SERVER_ERROR,
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = http::Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    resp
}

fn json(status: http::StatusCode, value: &serde_json::Value) -> Response {
    let mut resp = http::Response::new(Full::new(Bytes::from(serde_json::to_vec(value).unwrap_or_default())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    resp
}

fn error(status: http::StatusCode, message: &str) -> Response {
    json(status, &serde_json::json!({ "error": message }))
}

/// The headers of every answer: the CSP, no sniffing, no framing, no caching of tenant data.
fn with_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(http::header::CONTENT_SECURITY_POLICY, http::HeaderValue::from_static(CSP));
    h.insert(http::header::X_CONTENT_TYPE_OPTIONS, http::HeaderValue::from_static("nosniff"));
    h.insert(http::header::X_FRAME_OPTIONS, http::HeaderValue::from_static("DENY"));
    h.insert(http::header::REFERRER_POLICY, http::HeaderValue::from_static("no-referrer"));
    h.insert(http::header::CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_and_hosts_name_the_listener() {
        assert_eq!(query_value("sandbox=sb-1&seen=ab%2Fc+d", "seen").as_deref(), Some("ab/c d"));
        assert_eq!(query_value("sandbox=sb-1", "seen"), None);
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
        let hosts = allowed_hosts("127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(hosts, vec!["127.0.0.1:8080".to_string(), "localhost:8080".to_string()]);
        assert_eq!(allowed_hosts("10.0.0.1:80".parse().expect("addr")), vec!["10.0.0.1:80".to_string()]);
    }

    #[test]
    fn every_answer_carries_a_strict_csp() {
        let resp = with_headers(error(http::StatusCode::NOT_FOUND, "<script>"));
        let csp = resp.headers().get(http::header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()).unwrap_or_default();
        assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline") && csp.contains("default-src 'none'"), "{csp}");
        assert_eq!(resp.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()), Some("application/json"));
    }

    #[test]
    fn the_page_puts_no_sandbox_text_into_html() {
        // The script builds the DOM with textContent only: innerHTML, outerHTML,
        // insertAdjacentHTML and document.write would parse text a sandbox wrote as markup.
        for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("] {
            assert!(!APP_JS.contains(sink), "app.js uses {sink}");
        }
        assert!(!INDEX_HTML.contains("<script>") && !INDEX_HTML.contains("style="), "no inline script or style: the CSP would refuse it");
    }
}
