//! E2B's control plane (its OpenAPI `/sandboxes`, `/v2/sandboxes`, `/templates`) on the
//! manager: a template is an image, metadata are labels, `timeout` is the TTL, `autoPause` is
//! the TTL's on-expiry action, pause/resume/connect are PauseSandbox/ResumeSandbox.

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime};

use serde_json::{json, Value};

use super::{http_status, json_response, read_body, rfc3339, Audited, Body, State, ENVD_VERSION};
use crate::error::Error;
use crate::model::{CreateRequest, Isolation, OnExpiry, SandboxInfo, SandboxState};

/// What `clientID` says in every sandbox (E2B's id of the node that runs it).
const CLIENT_ID: &str = "sandboxd";
/// E2B's default template; here `[e2b] base_template`.
const E2B_DEFAULT_TEMPLATE: &str = "base";
/// Most sandboxes on one page of a list.
const MAX_PAGE: usize = 100;
/// The metadata key that names the tier when `[e2b] isolation_metadata` allows it.
const ISOLATION_KEY: &str = "isolation";

/// A control-plane error: E2B's `{code, message}` body with the matching status.
fn error_response(e: &Error) -> http::Response<Body> {
    let status = http_status(e);
    json_response(status, &json!({ "code": status.as_u16(), "message": e.to_string() }))
}

/// A feature of E2B's API that sandboxd does not have: 501 with the reason.
fn unsupported(what: &str, why: &str) -> http::Response<Body> {
    json_response(
        http::StatusCode::NOT_IMPLEMENTED,
        &json!({ "code": 501, "message": format!("{what} is not supported by sandboxd: {why} (see the README's E2B table)") }),
    )
}

/// Serves one control-plane request.
pub async fn handle(state: &State, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let tenant = match state.api_tenant(req.headers()) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    // `/v2/sandboxes/...` and `/sandboxes/...` answer alike here.
    let segments: &[&str] = match segments.as_slice() {
        ["v2", rest @ ..] => rest,
        s => s,
    };
    use http::Method as M;
    let result = match (&method, segments) {
        (&M::POST, ["sandboxes"]) => create(state, &tenant, req).await,
        (&M::GET, ["sandboxes"]) => list(state, &tenant, &query),
        (&M::GET, ["sandboxes", "metrics"]) | (&M::GET, ["sandboxes", _, "logs" | "metrics"]) => {
            Ok(unsupported("sandbox logs and metrics", "exec records (ListExecs) and the daemon's Prometheus metrics hold them"))
        }
        (&M::GET, ["sandboxes", id]) => state.manager.get(&tenant, id).map(|i| json_response(http::StatusCode::OK, &detail(state, &i))),
        (&M::DELETE, ["sandboxes", id]) => kill(state, &tenant, id).await,
        (&M::POST, ["sandboxes", id, "timeout"]) => set_timeout(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", id, "refreshes"]) => refresh(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", id, "connect"]) => connect(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", id, "pause"]) => pause(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", id, "resume"]) => resume(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", id, "fork"]) => fork(state, &tenant, id, req).await,
        (&M::POST, ["sandboxes", _, "snapshots"]) | (_, ["snapshots", ..]) => {
            Ok(unsupported("E2B's snapshot API", "use Sandbox.fork(), or sandboxd's Snapshot and CreateSandbox(from_snapshot_id) over gRPC"))
        }
        (&M::PUT, ["sandboxes", _, "network"]) => Ok(unsupported("network rules", "sandboxes have no network")),
        (&M::GET, ["templates"]) => templates(state, &tenant),
        (_, ["templates", ..]) => Ok(unsupported("template builds", "images come from the operator's image scripts or ImportImage/BuildImage over gRPC")),
        _ => Err(Error::NotFound(format!("no E2B API route {method} {path}"))),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// The body of a request as a JSON object (an empty body is `{}`).
async fn json_body(req: http::Request<hyper::body::Incoming>) -> Result<serde_json::Map<String, Value>, Error> {
    let body = read_body(req.into_body()).await?;
    if body.is_empty() {
        return Ok(Default::default());
    }
    match serde_json::from_slice(&body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Error::invalid("body", "expected a JSON object")),
        Err(e) => Err(Error::invalid("body", format!("not JSON: {e}"))),
    }
}

/// A map of strings from a JSON field (absent or null: empty).
fn string_map(body: &serde_json::Map<String, Value>, field: &str) -> Result<BTreeMap<String, String>, Error> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(Error::invalid(field, format!("{k:?}: values are strings"))),
            })
            .collect(),
        Some(_) => Err(Error::invalid(field, "expected an object of strings")),
    }
}

/// A timeout in seconds from a JSON field, if given.
fn seconds(body: &serde_json::Map<String, Value>, field: &str) -> Result<Option<u32>, Error> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| Error::invalid(field, "expected a whole number of seconds")),
    }
}

/// Fields of E2B's create that ask for something sandboxd cannot give: refused with the reason
/// rather than ignored. A field at its "off" value asks for nothing and passes.
fn refuse_unsupported(body: &serde_json::Map<String, Value>) -> Result<(), Error> {
    let asks = |field: &str| match body.get(field) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    let reasons = [
        ("autoResume", "a paused sandbox is resumed by connect or resume, not by traffic"),
        // The SDK sends this one in snake case; E2B's spec spells it in camel case.
        ("allow_internet_access", "sandboxes have no network"),
        ("allowInternetAccess", "sandboxes have no network"),
        ("network", "sandboxes have no network"),
        ("mcp", "there is no MCP gateway inside sandboxes"),
        ("volumeMounts", "volumes are not supported; upload files or fork from a snapshot"),
        ("iam", "workload identity is not supported"),
    ];
    for (field, why) in reasons {
        if asks(field) {
            return Err(Error::invalid(field, format!("not supported by sandboxd: {why}")));
        }
    }
    Ok(())
}

async fn create(state: &State, tenant: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let started = Instant::now();
    let body = json_body(req).await?;
    refuse_unsupported(&body)?;
    let template = match body.get("templateID") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => E2B_DEFAULT_TEMPLATE.to_string(),
        Some(_) => return Err(Error::invalid("templateID", "expected a string")),
    };
    let labels = string_map(&body, "metadata")?;
    let isolation = match labels.get(ISOLATION_KEY) {
        Some(v) if state.cfg.isolation_metadata => Some(match v.to_ascii_lowercase().as_str() {
            "process" => Isolation::Process,
            "container" => Isolation::Container,
            "microvm" => Isolation::MicroVm,
            other => return Err(Error::invalid("metadata.isolation", format!("{other:?}: expected process, container or microvm"))),
        }),
        _ => None,
    };
    let ttl_seconds = seconds(&body, "timeout")?.unwrap_or(state.cfg.default_timeout_seconds);
    if ttl_seconds == 0 {
        return Err(Error::invalid("timeout", "must be at least 1 second"));
    }
    // `lifecycle.on_timeout = "pause"` arrives as `autoPause: true`: the TTL pauses instead of
    // killing. A pause here always keeps the memory (the processes are frozen in place).
    let on_expiry = if flag(&body, "autoPause")? { OnExpiry::Pause } else { OnExpiry::Destroy };
    refuse_filesystem_only(&body, "autoPauseMemory")?;
    let request = CreateRequest {
        isolation,
        image: if template == E2B_DEFAULT_TEMPLATE { state.cfg.base_template.clone() } else { template.clone() },
        env: string_map(&body, "envVars")?,
        labels,
        ttl_seconds,
        on_expiry,
        ..Default::default()
    };
    let result = state.manager.create(tenant, request).await;
    let id = result.as_ref().map(|i| i.id.to_string()).unwrap_or_default();
    state.audit(
        Audited { rpc: "e2b.CreateSandbox", tenant, sandbox_id: &id, argv: None, detail: &format!("template={template}"), trace: None },
        result.as_ref().err(),
        started,
    );
    let info = result?;
    tracing::info!(sandbox = %info.id, tenant, template, "E2B sandbox created");
    Ok(json_response(http::StatusCode::CREATED, &created(state, &info)))
}

/// E2B's `Sandbox`: what create and connect return.
fn created(state: &State, info: &SandboxInfo) -> Value {
    json!({
        "templateID": info.image,
        "alias": info.image,
        "sandboxID": info.id.as_str(),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": state.envd_token(&info.tenant, info.id.as_str()),
        "domain": null,
    })
}

/// When the sandbox ends: its TTL, or a century on for one without (E2B always has an end).
fn end_at(info: &SandboxInfo) -> SystemTime {
    info.expires_at.unwrap_or_else(|| SystemTime::now() + std::time::Duration::from_secs(100 * 365 * 86_400))
}

/// E2B's `ListedSandbox` (and without the token, the fields of `SandboxDetail`).
fn listed(info: &SandboxInfo) -> Value {
    json!({
        "templateID": info.image,
        "alias": info.image,
        "sandboxID": info.id.as_str(),
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(info.created_at),
        "endAt": rfc3339(end_at(info)),
        "cpuCount": info.limits.cpu_millicores.div_ceil(1000).max(1),
        "memoryMB": info.limits.memory_bytes >> 20,
        "diskSizeMB": info.limits.disk_bytes >> 20,
        // E2B knows running and paused; a FAILED one is listed as running, as it was.
        "state": e2b_state(info.state),
        "envdVersion": ENVD_VERSION,
        "metadata": info.labels,
        "lifecycle": {
            "onTimeout": if info.on_expiry == OnExpiry::Pause { "pause" } else { "kill" },
            "autoResume": false,
        },
    })
}

/// E2B's name of a sandbox's state: `paused`, else `running`.
fn e2b_state(s: SandboxState) -> &'static str {
    if s == SandboxState::Paused {
        "paused"
    } else {
        "running"
    }
}

/// E2B's `SandboxDetail`.
fn detail(state: &State, info: &SandboxInfo) -> Value {
    let mut v = listed(info);
    if let Value::Object(m) = &mut v {
        m.insert("envdAccessToken".into(), Value::String(state.envd_token(&info.tenant, info.id.as_str())));
        m.insert("domain".into(), Value::Null);
        if info.state == SandboxState::Paused {
            // Processes frozen with their memory: what E2B calls a full pause.
            m.insert("pauseMode".into(), Value::String("full".into()));
        }
    }
    v
}

/// `GET /sandboxes` (an array) and `GET /v2/sandboxes` (pages by `limit` and `nextToken`, the
/// next page's token in `x-next-token`), filtered by `metadata` (`k=v&k2=v2`, URL-encoded) and
/// `state`.
fn list(state: &State, tenant: &str, query: &str) -> Result<http::Response<Body>, Error> {
    let mut selector = BTreeMap::new();
    let mut states: Vec<String> = Vec::new();
    let mut limit = MAX_PAGE;
    let mut after: Option<String> = None;
    for (k, v) in query_pairs(query) {
        match k.as_str() {
            "metadata" | "query" => {
                for (mk, mv) in query_pairs(&v) {
                    selector.insert(mk, mv);
                }
            }
            "state" => states.extend(v.split(',').map(str::to_string)),
            "limit" => limit = v.parse::<usize>().map_err(|_| Error::invalid("limit", "expected a number"))?.clamp(1, MAX_PAGE),
            "nextToken" => after = Some(v),
            _ => {}
        }
    }
    let mut all = state.manager.list(tenant, &selector)?;
    all.retain(|i| matches!(i.state, SandboxState::Running | SandboxState::Creating | SandboxState::Paused));
    if !states.is_empty() {
        all.retain(|i| states.iter().any(|s| s == e2b_state(i.state)));
    }
    let start = match &after {
        Some(token) => {
            all.iter().position(|i| i.id.as_str() == token).map(|p| p + 1).ok_or_else(|| Error::invalid("nextToken", "not a token of a previous page"))?
        }
        None => 0,
    };
    let page: Vec<&SandboxInfo> = all.iter().skip(start).take(limit).collect();
    let more = start + page.len() < all.len();
    let mut resp = json_response(http::StatusCode::OK, &Value::Array(page.iter().map(|i| listed(i)).collect()));
    if let (true, Some(last)) = (more, page.last()) {
        if let Ok(v) = http::HeaderValue::from_str(last.id.as_str()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

async fn kill(state: &State, tenant: &str, id: &str) -> Result<http::Response<Body>, Error> {
    let started = Instant::now();
    let result = state.manager.destroy(tenant, id).await;
    state.audit(Audited { rpc: "e2b.KillSandbox", tenant, sandbox_id: id, argv: None, detail: "", trace: None }, result.as_ref().err(), started);
    result?;
    state.processes.forget_sandbox(id);
    state.watchers.forget_sandbox(id);
    Ok(super::empty(http::StatusCode::NO_CONTENT))
}

async fn set_timeout(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let started = Instant::now();
    let body = json_body(req).await?;
    let timeout = seconds(&body, "timeout")?.ok_or_else(|| Error::invalid("timeout", "required"))?;
    if timeout == 0 {
        return Err(Error::invalid("timeout", "must be at least 1 second"));
    }
    let result = state.manager.set_ttl(tenant, id, timeout);
    state.audit(
        Audited { rpc: "e2b.SetTimeout", tenant, sandbox_id: id, argv: None, detail: &format!("timeout={timeout}"), trace: None },
        result.as_ref().err(),
        started,
    );
    result?;
    Ok(super::empty(http::StatusCode::NO_CONTENT))
}

async fn refresh(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let body = json_body(req).await?;
    let duration = seconds(&body, "duration")?.unwrap_or(state.cfg.default_timeout_seconds);
    extend(state, tenant, id, duration)?;
    Ok(super::empty(http::StatusCode::NO_CONTENT))
}

/// Makes the sandbox live at least `seconds` from now (a longer TTL stays).
fn extend(state: &State, tenant: &str, id: &str, seconds: u32) -> Result<SandboxInfo, Error> {
    let started = Instant::now();
    let info = state.manager.get(tenant, id)?;
    let wanted = SystemTime::now() + std::time::Duration::from_secs(seconds.into());
    if info.expires_at.is_none_or(|e| e >= wanted) {
        return Ok(info);
    }
    let result = state.manager.set_ttl(tenant, id, seconds);
    state.audit(
        Audited { rpc: "e2b.SetTimeout", tenant, sandbox_id: id, argv: None, detail: &format!("timeout={seconds}"), trace: None },
        result.as_ref().err(),
        started,
    );
    result
}

/// `POST /sandboxes/{id}/connect`: a running sandbox is returned (200) with its timeout
/// extended to `timeout` from now if that is longer; a paused one is resumed (201) with
/// `timeout` from now (or what was left of its TTL at the pause).
async fn connect(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let body = json_body(req).await?;
    refuse_filesystem_only(&body, "memory")?;
    let timeout = seconds(&body, "timeout")?.filter(|t| *t > 0);
    if state.manager.get(tenant, id)?.state == SandboxState::Paused {
        let info = resumed(state, tenant, id, timeout.unwrap_or(0), "e2b.Connect").await?;
        return Ok(json_response(http::StatusCode::CREATED, &created(state, &info)));
    }
    let info = match timeout {
        Some(t) => extend(state, tenant, id, t)?,
        None => state.manager.get(tenant, id)?,
    };
    Ok(json_response(http::StatusCode::OK, &created(state, &info)))
}

/// `POST /sandboxes/{id}/pause`: 204 once paused; 409 when it already was (the SDK's `pause()`
/// then answers False). `memory: false` (a filesystem-only pause) is refused: the processes
/// are frozen in place with their memory, never dropped.
async fn pause(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let started = Instant::now();
    let body = json_body(req).await?;
    refuse_filesystem_only(&body, "memory")?;
    if state.manager.get(tenant, id)?.state == SandboxState::Paused {
        return Err(Error::FailedPrecondition(format!("sandbox {id} is already paused")));
    }
    let result = state.manager.pause(tenant, id).await;
    state.audit(Audited { rpc: "e2b.PauseSandbox", tenant, sandbox_id: id, argv: None, detail: "", trace: None }, result.as_ref().err(), started);
    result?;
    Ok(super::empty(http::StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/resume` (E2B's older call, which `connect` replaced): 201 with the
/// sandbox once resumed with `timeout` from now; 409 when it is not paused. `autoPause` sets
/// what its next timeout does.
async fn resume(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let body = json_body(req).await?;
    refuse_filesystem_only(&body, "memory")?;
    let info = state.manager.get(tenant, id)?;
    let auto_pause = body.get("autoPause").is_some_and(|v| !v.is_null()).then(|| flag(&body, "autoPause")).transpose()?;
    if auto_pause.is_some_and(|a| a != (info.on_expiry == OnExpiry::Pause)) {
        return Err(Error::invalid("autoPause", "not supported by sandboxd: what a timeout does is set at create (lifecycle.on_timeout)"));
    }
    if info.state != SandboxState::Paused {
        return Err(Error::FailedPrecondition(format!("sandbox {id} is not paused")));
    }
    let timeout = seconds(&body, "timeout")?.filter(|t| *t > 0).unwrap_or(state.cfg.default_timeout_seconds);
    let info = resumed(state, tenant, id, timeout, "e2b.ResumeSandbox").await?;
    Ok(json_response(http::StatusCode::CREATED, &created(state, &info)))
}

/// Resumes a paused sandbox with `ttl_seconds` from now (0: what its TTL had left), audited.
async fn resumed(state: &State, tenant: &str, id: &str, ttl_seconds: u32, rpc: &'static str) -> Result<SandboxInfo, Error> {
    let started = Instant::now();
    let result = state.manager.resume(tenant, id, ttl_seconds).await;
    state.audit(Audited { rpc, tenant, sandbox_id: id, argv: None, detail: &format!("timeout={ttl_seconds}"), trace: None }, result.as_ref().err(), started);
    result
}

/// A boolean field (absent or null: false).
fn flag(body: &serde_json::Map<String, Value>, field: &str) -> Result<bool, Error> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(Error::invalid(field, "expected true or false")),
    }
}

/// Refuses `field: false`: E2B's filesystem-only pause (or resume by reboot), which would drop
/// the processes. Here a pause freezes them with their memory, and a resume continues them.
fn refuse_filesystem_only(body: &serde_json::Map<String, Value>, field: &str) -> Result<(), Error> {
    match body.get(field) {
        Some(Value::Bool(false)) => Err(Error::invalid(
            field,
            "not supported by sandboxd: a pause keeps the memory (its processes are frozen in place) and a resume continues them; filesystem-only pause and reboot on resume are not offered",
        )),
        _ => Ok(()),
    }
}

/// Most sandboxes one fork makes.
const MAX_FORKS: u32 = 16;

/// `POST /sandboxes/{id}/fork`: a snapshot of the sandbox's filesystem now, and `count` new
/// sandboxes started from it (their tier, image, limits, env and labels the source's). The
/// snapshot stays (named `e2b-fork-…`): the forks' filesystems are layered on it, and it can be
/// deleted over gRPC once they are gone. Each fork's outcome is reported on its own.
async fn fork(state: &State, tenant: &str, id: &str, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let started = Instant::now();
    let body = json_body(req).await?;
    let count = match body.get("count") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| (1..=MAX_FORKS).contains(n))
            .ok_or_else(|| Error::invalid("count", format!("1 to {MAX_FORKS}")))?,
    };
    let ttl_seconds = seconds(&body, "timeout")?.filter(|t| *t > 0).unwrap_or(state.cfg.default_timeout_seconds);
    let name = format!("e2b-fork-{}", humantime::format_rfc3339_millis(SystemTime::now()));
    let snap = state.manager.snapshot(tenant, id, &name, None).await;
    state.audit(Audited { rpc: "e2b.Fork.Snapshot", tenant, sandbox_id: id, argv: None, detail: &name, trace: None }, snap.as_ref().err(), started);
    let snap = snap?;
    let mut results = Vec::new();
    for _ in 0..count {
        let started = Instant::now();
        let request = CreateRequest { from_snapshot_id: snap.snapshot_id.to_string(), ttl_seconds, ..Default::default() };
        let result = state.manager.create(tenant, request).await;
        let new_id = result.as_ref().map(|i| i.id.to_string()).unwrap_or_default();
        let detail = format!("from={id} snapshot={}", snap.snapshot_id);
        state.audit(
            Audited { rpc: "e2b.Fork.CreateSandbox", tenant, sandbox_id: &new_id, argv: None, detail: &detail, trace: None },
            result.as_ref().err(),
            started,
        );
        results.push(match result {
            Ok(info) => json!({ "sandbox": created(state, &info) }),
            Err(e) => json!({ "error": { "code": http_status(&e).as_u16(), "message": e.to_string() } }),
        });
    }
    Ok(json_response(http::StatusCode::CREATED, &Value::Array(results)))
}

/// `GET /templates`: the images this tenant can start from.
fn templates(state: &State, tenant: &str) -> Result<http::Response<Body>, Error> {
    let viewer = state.manager.image_viewer(tenant, false);
    let images = state.manager.list_images(&viewer)?;
    let out: Vec<Value> = images
        .iter()
        .map(|i| {
            json!({
                "templateID": i.name,
                "buildID": i.digest,
                "aliases": [i.name],
                "names": [i.name],
                "public": i.shared,
                "createdAt": rfc3339(i.created_at),
                "updatedAt": rfc3339(i.created_at),
                "envdVersion": ENVD_VERSION,
                "buildStatus": "ready",
            })
        })
        .collect();
    Ok(json_response(http::StatusCode::OK, &Value::Array(out)))
}

/// The `key=value` pairs of a URL query, percent-decoded (`+` is a space).
pub(super) fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_twice_as_the_sdk_encodes() {
        // The SDK quotes each key and value, then URL-encodes the pairs into one parameter.
        let pairs = query_pairs("metadata=user%3Dalice%26app%3Dmy%2520app&limit=5");
        assert_eq!(pairs[0].0, "metadata");
        let inner = query_pairs(&pairs[0].1);
        assert_eq!(inner, vec![("user".to_string(), "alice".to_string()), ("app".to_string(), "my app".to_string())]);
        assert_eq!(pairs[1], ("limit".to_string(), "5".to_string()));
        assert_eq!(percent_decode("100%"), "100%", "a stray percent stays");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn unsupported_create_fields_are_refused_and_off_values_pass() {
        let body = |v: Value| v.as_object().cloned().unwrap_or_default();
        assert!(refuse_unsupported(&body(json!({"autoPause": false, "volumeMounts": [], "metadata": {}}))).is_ok());
        assert!(refuse_unsupported(&body(json!({"autoPause": true}))).is_ok(), "autoPause is the on-expiry action");
        let err = refuse_unsupported(&body(json!({"autoResume": {"enabled": true}}))).expect_err("refused");
        assert!(err.to_string().contains("autoResume"), "{err}");
        assert!(refuse_filesystem_only(&body(json!({"memory": false})), "memory").is_err(), "a filesystem-only pause is refused");
        assert!(refuse_filesystem_only(&body(json!({"memory": true})), "memory").is_ok());
        assert!(refuse_unsupported(&body(json!({"allowInternetAccess": true}))).is_err());
    }
}
