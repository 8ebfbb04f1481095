//! envd's `filesystem.Filesystem` service and its `/files` upload and download.
//!
//! Uploads and downloads go through the daemon's file streams (`upload_file`,
//! `download_file`), which resolve paths inside the sandbox and hold stream slots. Stat, list,
//! make-dir, move and remove have no call of their own in the manager: they run as small
//! commands inside the sandbox (`stat`, `find`, `mkdir`, `mv`, `rm`, present in every image,
//! busybox included), so they see exactly what the sandbox's processes see, as the user the
//! client names, and never touch the host. Paths reach them as arguments, never as shell text.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::connect::{self, RpcError};
use super::multipart::{self, Event};
use super::process::basic_user;
use super::{http_status, json_response, sandbox_path, Audited, Body, State};
use crate::backend::UploadPiece;
use crate::error::Error;
use crate::model::{ExecRequest, ExecStatus, SandboxInfo};

/// What `stat -c` prints per entry; the name comes last so that a `|` in it survives.
const STAT_FORMAT: &str = "%F|%s|%f|%A|%U|%G|%Y|%n";
/// Exit codes of the scripts below for the cases envd reports with a code of their own.
const EXIT_NOT_FOUND: i32 = 3;
const EXIT_NOT_DIR: i32 = 4;
const EXIT_EXISTS: i32 = 5;
/// The most a listing may print (each entry is a line of [`STAT_FORMAT`]).
const MAX_LISTING_BYTES: u64 = 8 << 20;
/// Deepest `ListDir` depth honoured.
const MAX_DEPTH: u32 = 64;
/// Pieces of an upload waiting for the sandbox's disk.
const UPLOAD_BUFFER: usize = 8;

const STAT_SCRIPT: &str = r#"[ -e "$1" ] || [ -L "$1" ] || { echo "no such file or directory: $1" >&2; exit 3; }; exec stat -c "$2" -- "$1""#;
const LIST_SCRIPT: &str = r#"[ -e "$1" ] || { echo "no such file or directory: $1" >&2; exit 3; }; [ -d "$1" ] || { echo "not a directory: $1" >&2; exit 4; }; exec find "$1" -mindepth 1 -maxdepth "$2" -exec stat -c "$3" -- {} +"#;
const MKDIR_SCRIPT: &str = r#"[ -e "$1" ] && { echo "already exists: $1" >&2; exit 5; }; mkdir -p -- "$1" && exec stat -c "$2" -- "$1""#;
const MOVE_SCRIPT: &str =
    r#"[ -e "$1" ] || [ -L "$1" ] || { echo "no such file or directory: $1" >&2; exit 3; }; mv -- "$1" "$2" && exec stat -c "$3" -- "$2""#;
const REMOVE_SCRIPT: &str = r#"[ -e "$1" ] || [ -L "$1" ] || { echo "no such file or directory: $1" >&2; exit 3; }; exec rm -rf -- "$1""#;

/// Who calls and on what: the tenant, the sandbox, the user named by basic auth.
struct Caller {
    tenant: String,
    info: SandboxInfo,
    user: String,
}

fn caller(state: &State, headers: &http::HeaderMap) -> Result<Caller, Error> {
    let (tenant, sandbox_id) = state.envd_caller(headers)?;
    let info = state.manager.get(&tenant, &sandbox_id)?;
    Ok(Caller { tenant, info, user: basic_user(headers) })
}

/// Serves one `filesystem.Filesystem` call.
pub async fn handle_rpc(state: &Arc<State>, method: &str, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let c = match caller(state, req.headers()) {
        Ok(c) => c,
        Err(e) if method == "WatchDir" => return connect::stream_error(e.into()),
        Err(e) => return connect::unary_error(e.into()),
    };
    if method == "WatchDir" {
        return watch_dir(state, c, req).await;
    }
    let result = match method {
        "Stat" => stat(state, &c, req).await,
        "ListDir" => list_dir(state, &c, req).await,
        "MakeDir" => make_dir(state, &c, req).await,
        "Move" => move_entry(state, &c, req).await,
        "Remove" => remove(state, &c, req).await,
        "CreateWatcher" => create_watcher(state, &c, req).await,
        "GetWatcherEvents" => watcher_events(state, &c, req).await,
        "RemoveWatcher" => remove_watcher(state, &c, req).await,
        other => Err(RpcError::new("unimplemented", format!("filesystem.Filesystem/{other} does not exist"))),
    };
    match result {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => connect::unary_error(e),
    }
}

/// Runs `script` with `args` in the sandbox; its stdout, or the error its exit code means.
async fn run(state: &State, c: &Caller, script: &str, args: &[&str]) -> Result<String, RpcError> {
    let started = std::time::Instant::now();
    let result = run_unaudited(state, c, script, args).await;
    let rpc = match script {
        MKDIR_SCRIPT => Some("e2b.filesystem.MakeDir"),
        MOVE_SCRIPT => Some("e2b.filesystem.Move"),
        REMOVE_SCRIPT => Some("e2b.filesystem.Remove"),
        _ => None,
    };
    if let Some(rpc) = rpc {
        let detail = format!("paths={:?}", args.iter().take_while(|a| **a != STAT_FORMAT).collect::<Vec<_>>());
        let error = result.as_ref().err().map(|e| Error::FailedPrecondition(format!("{}: {}", e.code, e.message)));
        state.audit(Audited { rpc, tenant: &c.tenant, sandbox_id: c.info.id.as_str(), argv: None, detail: &detail, trace: None }, error.as_ref(), started);
    }
    result
}

/// [`run`] without the audit line.
async fn run_unaudited(state: &State, c: &Caller, script: &str, args: &[&str]) -> Result<String, RpcError> {
    let mut argv: Vec<String> = vec!["/bin/sh".into(), "-c".into(), script.into(), "sh".into()];
    argv.extend(args.iter().map(|a| a.to_string()));
    let req = ExecRequest { sandbox_id: c.info.id.to_string(), argv, user: c.user.clone(), max_output_bytes: MAX_LISTING_BYTES, ..Default::default() };
    let record = state.manager.exec(&c.tenant, req).await?;
    let o = &record.outcome;
    let stderr = String::from_utf8_lossy(&o.stderr.bytes).trim().to_string();
    match (o.status, o.exit_code) {
        (ExecStatus::Exited, 0) if o.stdout.truncated => {
            Err(RpcError::new("resource_exhausted", format!("the listing is longer than {MAX_LISTING_BYTES} bytes; list a smaller depth")))
        }
        (ExecStatus::Exited, 0) => Ok(String::from_utf8_lossy(&o.stdout.bytes).into_owned()),
        (ExecStatus::Exited, EXIT_NOT_FOUND) => Err(RpcError::new("not_found", stderr)),
        (ExecStatus::Exited, EXIT_NOT_DIR) => Err(RpcError::new("invalid_argument", stderr)),
        (ExecStatus::Exited, EXIT_EXISTS) => Err(RpcError::new("already_exists", stderr)),
        (ExecStatus::Exited, code) => Err(RpcError::new("failed_precondition", format!("exit code {code}: {stderr}"))),
        (status, _) => Err(RpcError::new("failed_precondition", format!("the file operation's command ended {}: {} {stderr}", status.name(), o.error))),
    }
}

/// One `EntryInfo` from a line of [`STAT_FORMAT`].
fn entry(line: &str) -> Option<Value> {
    let mut f = line.splitn(8, '|');
    let (kind, size, raw_mode, perms, owner, group, mtime, path) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let kind = match kind {
        "directory" => "FILE_TYPE_DIRECTORY",
        "symbolic link" => "FILE_TYPE_SYMLINK",
        k if k.contains("regular") => "FILE_TYPE_FILE",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mode = u32::from_str_radix(raw_mode, 16).ok()? & 0o7777;
    let mtime = std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime.parse().ok()?);
    let name = path.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or(path);
    Some(json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": size.parse::<i64>().ok()?,
        "mode": mode,
        "permissions": perms,
        "owner": owner,
        "group": group,
        "modifiedTime": super::rfc3339(mtime),
    }))
}

fn entries(out: &str) -> Vec<Value> {
    out.lines().filter_map(entry).collect()
}

fn one_entry(out: &str) -> Result<Value, RpcError> {
    entries(out).into_iter().next().ok_or_else(|| RpcError::new("internal", format!("unreadable stat output: {:?}", out.chars().take(200).collect::<String>())))
}

/// A path from a request field, inside the sandbox, without trailing slashes.
fn path_field(c: &Caller, body: &Value, field: &str) -> Result<String, RpcError> {
    let raw =
        body.get(field).and_then(Value::as_str).filter(|p| !p.is_empty()).ok_or_else(|| RpcError::new("invalid_argument", format!("{field} is required")))?;
    let p = sandbox_path(&c.info.workdir, raw);
    let trimmed = p.trim_end_matches('/');
    Ok(if trimmed.is_empty() { "/".to_string() } else { trimmed.to_string() })
}

async fn stat(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let path = path_field(c, &body, "path")?;
    let out = run(state, c, STAT_SCRIPT, &[&path, STAT_FORMAT]).await?;
    Ok(json!({ "entry": one_entry(&out)? }))
}

async fn list_dir(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let path = path_field(c, &body, "path")?;
    let depth = body.get("depth").and_then(Value::as_u64).unwrap_or(1).clamp(1, MAX_DEPTH.into()).to_string();
    let out = run(state, c, LIST_SCRIPT, &[&path, &depth, STAT_FORMAT]).await?;
    Ok(json!({ "entries": entries(&out) }))
}

async fn make_dir(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let path = path_field(c, &body, "path")?;
    let out = run(state, c, MKDIR_SCRIPT, &[&path, STAT_FORMAT]).await?;
    Ok(json!({ "entry": one_entry(&out)? }))
}

async fn move_entry(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let (source, destination) = (path_field(c, &body, "source")?, path_field(c, &body, "destination")?);
    let out = run(state, c, MOVE_SCRIPT, &[&source, &destination, STAT_FORMAT]).await?;
    Ok(json!({ "entry": one_entry(&out)? }))
}

async fn remove(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let path = path_field(c, &body, "path")?;
    run(state, c, REMOVE_SCRIPT, &[&path]).await?;
    Ok(json!({}))
}

/// One listing of a watched directory: path → (type, size, mode, mtime) of each entry.
type Listing = BTreeMap<String, (String, i64, u64, String)>;

/// A directory watched by polling: each look lists it inside the sandbox and compares with the
/// last listing. There is no inotify bridge out of a sandbox (and none could cross a microVM),
/// so events are changes between two looks: a rename is a remove and a create, a file written
/// twice between looks is one write, and a write that keeps the size within the same second of
/// mtime is missed.
struct Watcher {
    tenant: String,
    sandbox_id: String,
    path: String,
    depth: String,
    last: Listing,
}

/// Watchers by id.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Watcher>>,
}

impl Watchers {
    /// Drops the watchers of a destroyed sandbox.
    pub fn forget_sandbox(&self, sandbox_id: &str) {
        if let Ok(mut m) = self.map.lock() {
            m.retain(|_, w| w.sandbox_id != sandbox_id);
        }
    }
}

/// Most watchers one tenant may hold (each look is an exec in its sandbox).
const MAX_WATCHERS_PER_TENANT: usize = 32;
/// How often a `WatchDir` stream looks.
const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

async fn look(state: &State, c: &Caller, path: &str, depth: &str) -> Result<Listing, RpcError> {
    let out = run(state, c, LIST_SCRIPT, &[path, depth, STAT_FORMAT]).await?;
    Ok(entries(&out)
        .into_iter()
        .filter_map(|e| {
            let p = e["path"].as_str()?.to_string();
            Some((p, (e["type"].as_str()?.to_string(), e["size"].as_i64()?, e["mode"].as_u64()?, e["modifiedTime"].as_str()?.to_string())))
        })
        .collect())
}

/// The events between two listings of `root`, named relative to it as envd names them.
fn diff(root: &str, before: &Listing, after: &Listing) -> Vec<Value> {
    let name = |p: &str| p.strip_prefix(root).unwrap_or(p).trim_start_matches('/').to_string();
    let mut out = Vec::new();
    for (p, now) in after {
        match before.get(p) {
            None => out.push(json!({"name": name(p), "type": "EVENT_TYPE_CREATE"})),
            Some(was) if was.0 != now.0 || was.1 != now.1 || was.3 != now.3 => out.push(json!({"name": name(p), "type": "EVENT_TYPE_WRITE"})),
            Some(was) if was.2 != now.2 => out.push(json!({"name": name(p), "type": "EVENT_TYPE_CHMOD"})),
            Some(_) => {}
        }
    }
    for p in before.keys().filter(|p| !after.contains_key(*p)) {
        out.push(json!({"name": name(p), "type": "EVENT_TYPE_REMOVE"}));
    }
    out
}

/// The directory and depth a watch request names.
fn watch_target(c: &Caller, body: &Value) -> Result<(String, String), RpcError> {
    if body.get("allowNetworkMounts").and_then(Value::as_bool).unwrap_or(false) || body.get("includeEntry").and_then(Value::as_bool).unwrap_or(false) {
        return Err(RpcError::unsupported("includeEntry and allowNetworkMounts", "watch events carry names only"));
    }
    let depth = if body.get("recursive").and_then(Value::as_bool).unwrap_or(false) { MAX_DEPTH } else { 1 };
    Ok((path_field(c, body, "path")?, depth.to_string()))
}

async fn create_watcher(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let (path, depth) = watch_target(c, &body)?;
    // Watchers of sandboxes that are gone (killed, reaped at their TTL) no longer count.
    let held = state
        .watchers
        .map
        .lock()
        .map(|mut m| {
            m.retain(|_, w| w.tenant != c.tenant || state.manager.get(&w.tenant, &w.sandbox_id).is_ok());
            m.values().filter(|w| w.tenant == c.tenant).count()
        })
        .unwrap_or(0);
    if held >= MAX_WATCHERS_PER_TENANT {
        return Err(RpcError::new("resource_exhausted", format!("tenant {} holds {held} watchers, the most allowed; stop one first", c.tenant)));
    }
    let last = look(state, c, &path, &depth).await?;
    let id = format!("w-{:016x}", rand::random::<u64>());
    let watcher = Watcher { tenant: c.tenant.clone(), sandbox_id: c.info.id.to_string(), path, depth, last };
    state.watchers.map.lock().map_err(|_| RpcError::new("internal", "watcher table poisoned"))?.insert(id.clone(), watcher);
    Ok(json!({ "watcherId": id }))
}

/// The watcher a request names (its id, path, depth and last listing), if it is this caller's.
fn watcher_of(state: &State, c: &Caller, body: &Value) -> Result<(String, String, String, Listing), RpcError> {
    let id = body.get("watcherId").and_then(Value::as_str).unwrap_or("");
    let map = state.watchers.map.lock().map_err(|_| RpcError::new("internal", "watcher table poisoned"))?;
    match map.get(id) {
        Some(w) if w.tenant == c.tenant && w.sandbox_id == c.info.id.as_str() => Ok((id.to_string(), w.path.clone(), w.depth.clone(), w.last.clone())),
        _ => Err(RpcError::new("not_found", format!("watcher {id:?} not found"))),
    }
}

async fn watcher_events(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let (id, path, depth, before) = watcher_of(state, c, &body)?;
    let after = look(state, c, &path, &depth).await?;
    let events = diff(&path, &before, &after);
    if let Ok(mut m) = state.watchers.map.lock() {
        if let Some(w) = m.get_mut(&id) {
            w.last = after;
        }
    }
    Ok(json!({ "events": events }))
}

async fn remove_watcher(state: &State, c: &Caller, req: http::Request<hyper::body::Incoming>) -> Result<Value, RpcError> {
    let body: Value = connect::unary_request(req).await?;
    let (id, ..) = watcher_of(state, c, &body)?;
    if let Ok(mut m) = state.watchers.map.lock() {
        m.remove(&id);
    }
    Ok(json!({}))
}

/// `WatchDir`: a stream of the changes seen every [`WATCH_INTERVAL`] until the client goes away
/// or the sandbox does.
async fn watch_dir(state: &Arc<State>, c: Caller, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let body: Value = match connect::stream_request(req).await {
        Ok(b) => b,
        Err(e) => return connect::stream_error(e),
    };
    let (path, depth) = match watch_target(&c, &body) {
        Ok(t) => t,
        Err(e) => return connect::stream_error(e),
    };
    let mut before = match look(state, &c, &path, &depth).await {
        Ok(l) => l,
        Err(e) => return connect::stream_error(e),
    };
    let (tx, rx) = mpsc::channel(16);
    let state = state.clone();
    tokio::spawn(async move {
        if tx.send(Ok(json!({"start": {}}))).await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            }
            let after = match look(&state, &c, &path, &depth).await {
                Ok(l) => l,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            for event in diff(&path, &before, &after) {
                if tx.send(Ok(json!({ "filesystem": event }))).await.is_err() {
                    return;
                }
            }
            before = after;
        }
    });
    connect::stream_response(tokio_stream::wrappers::ReceiverStream::new(rx), Some(json!({"keepalive": {}})))
}

/// envd's HTTP error body: `{code, message}` with the status.
fn files_error(e: &Error) -> http::Response<Body> {
    let status = http_status(e);
    json_response(status, &json!({ "code": status.as_u16(), "message": e.to_string() }))
}

/// `GET /files?path=…` (download) and `POST /files?path=…` (upload: a raw body, or multipart
/// form data whose file names are the paths).
pub async fn handle_files(state: &Arc<State>, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let c = match caller(state, req.headers()) {
        Ok(c) => c,
        Err(e) => return files_error(&e),
    };
    let path = super::control_query(req.uri().query().unwrap_or(""), "path");
    let result = match *req.method() {
        http::Method::GET => download(state, &c, path).await,
        http::Method::POST => upload(state, &c, path, req).await,
        _ => Err(Error::invalid("method", "/files takes GET (download) or POST (upload)")),
    };
    result.unwrap_or_else(|e| files_error(&e))
}

async fn download(state: &State, c: &Caller, path: Option<String>) -> Result<http::Response<Body>, Error> {
    let path = path.filter(|p| !p.is_empty()).ok_or_else(|| Error::invalid("path", "required"))?;
    let path = sandbox_path(&c.info.workdir, &path);
    let held = state.manager.download_file(&c.tenant, c.info.id.as_str(), &path).await?;
    let size = held.value.size;
    // The stream slots are held for as long as the body is being sent.
    let slots = held.slots;
    let chunks = tokio_stream::wrappers::ReceiverStream::new(held.value.chunks).map(move |r| {
        let _held = &slots;
        r.map(hyper::body::Frame::data).map_err(|e| std::io::Error::other(e.to_string()))
    });
    let mut resp = http::Response::new(BodyExt::boxed_unsync(StreamBody::new(chunks)));
    let headers = resp.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/octet-stream"));
    headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(size));
    Ok(resp)
}

/// What `POST /files` answers for each file written.
fn write_info(path: &str) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    json!({ "name": name, "type": "file", "path": path })
}

async fn upload(state: &State, c: &Caller, path: Option<String>, req: http::Request<hyper::body::Incoming>) -> Result<http::Response<Body>, Error> {
    let started = std::time::Instant::now();
    if let Some(enc) = req.headers().get(http::header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) {
        if !enc.eq_ignore_ascii_case("identity") {
            return Err(Error::invalid("Content-Encoding", format!("{enc:?} is not supported by sandboxd: upload without gzip=True")));
        }
    }
    let content_type = req.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let mut body = req.into_body();
    let mut written = Vec::new();
    let result = if content_type.to_ascii_lowercase().starts_with("multipart/form-data") {
        upload_multipart(state, c, path.as_deref(), &content_type, &mut body, &mut written).await
    } else {
        let path = path.filter(|p| !p.is_empty()).ok_or_else(|| Error::invalid("path", "required for a raw upload"))?;
        let path = sandbox_path(&c.info.workdir, &path);
        let (tx, rx) = mpsc::channel(UPLOAD_BUFFER);
        let idle = state.manager.stream_idle_timeout();
        let feed = async move {
            loop {
                // A client that stops sending loses its upload (not committed: undone).
                let frame = match tokio::time::timeout(idle, body.frame()).await {
                    Ok(Some(frame)) => frame,
                    Ok(None) => break,
                    Err(_) => return tracing::debug!("upload body idle past the stream idle timeout"),
                };
                let Ok(data) = frame.map_err(|e| tracing::debug!(error = %e, "upload body broke off")) else { return };
                if let Ok(data) = data.into_data() {
                    if tx.send(UploadPiece::Data(data)).await.is_err() {
                        return;
                    }
                }
            }
            let _ = tx.send(UploadPiece::Commit).await;
        };
        let (_, r) = tokio::join!(feed, state.manager.upload_file(&c.tenant, c.info.id.as_str(), &path, 0o644, rx));
        r.map(|_| written.push(path))
    };
    state.audit(
        Audited { rpc: "e2b.files.Upload", tenant: &c.tenant, sandbox_id: c.info.id.as_str(), argv: None, detail: &format!("paths={written:?}"), trace: None },
        result.as_ref().err(),
        started,
    );
    result?;
    Ok(json_response(http::StatusCode::OK, &Value::Array(written.iter().map(|p| write_info(p)).collect())))
}

/// The part being written: its path, the feed into its upload and the upload itself.
struct PartUpload {
    path: String,
    tx: mpsc::Sender<UploadPiece>,
    task: tokio::task::JoinHandle<Result<u64, Error>>,
}

/// Each file part of a multipart body, streamed into its own upload. The part's file name is its
/// path, unless the query names the path (a single file).
async fn upload_multipart(
    state: &State,
    c: &Caller,
    query_path: Option<&str>,
    content_type: &str,
    body: &mut hyper::body::Incoming,
    written: &mut Vec<String>,
) -> Result<(), Error> {
    let bad = |e: multipart::MultipartError| Error::invalid("body", e.to_string());
    let mut reader = multipart::Reader::new(&multipart::boundary(content_type).map_err(bad)?);
    let mut current: Option<PartUpload> = None;
    let mut ended = false;
    loop {
        while let Some(event) = reader.next().map_err(bad)? {
            match event {
                Event::Part { filename, name } => {
                    let raw = match (query_path, filename) {
                        (Some(p), _) if !p.is_empty() && written.is_empty() => p.to_string(),
                        (_, Some(f)) if !f.is_empty() => f,
                        _ => return Err(Error::invalid("body", format!("part {name:?} has no file name to use as its path"))),
                    };
                    let path = sandbox_path(&c.info.workdir, &raw);
                    let (tx, rx) = mpsc::channel(UPLOAD_BUFFER);
                    let (manager, tenant, sandbox, p) = (state.manager.clone(), c.tenant.clone(), c.info.id.to_string(), path.clone());
                    let task = tokio::spawn(async move { manager.upload_file(&tenant, &sandbox, &p, 0o644, rx).await });
                    current = Some(PartUpload { path, tx, task });
                }
                Event::Data(d) => {
                    if let Some(PartUpload { tx, .. }) = &current {
                        // A failed send means the upload gave up: its error comes from the task.
                        let _ = tx.send(UploadPiece::Data(d)).await;
                    }
                }
                Event::PartEnd => {
                    if let Some(PartUpload { path, tx, task }) = current.take() {
                        let _ = tx.send(UploadPiece::Commit).await;
                        drop(tx);
                        task.await.map_err(|e| Error::Internal(format!("upload task: {e}")))??;
                        written.push(path);
                    }
                }
            }
        }
        if ended {
            break;
        }
        let frame = tokio::time::timeout(state.manager.stream_idle_timeout(), body.frame())
            .await
            .map_err(|_| Error::DeadlineExceeded("the upload's body stopped arriving (streams.idle_timeout_ms)".into()))?;
        match frame {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    reader.feed(&data);
                }
            }
            Some(Err(e)) => return Err(Error::Aborted(format!("the upload broke off: {e}"))),
            None => ended = true,
        }
    }
    // A part cut short is not committed: its upload task sees its feed close and is undone.
    drop(current);
    reader.finish().map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_diff_into_envd_events() {
        let l = |items: &[(&str, i64, u64)]| -> Listing {
            items.iter().map(|(p, size, mode)| (p.to_string(), ("FILE_TYPE_FILE".to_string(), *size, *mode, "t".to_string()))).collect()
        };
        let before = l(&[("/w/a", 1, 0o644), ("/w/b", 1, 0o644), ("/w/c", 1, 0o644)]);
        let after = l(&[("/w/a", 2, 0o644), ("/w/b", 1, 0o600), ("/w/sub/d", 0, 0o644)]);
        let events: Vec<(String, String)> =
            diff("/w", &before, &after).iter().map(|e| (e["name"].as_str().unwrap_or("").to_string(), e["type"].as_str().unwrap_or("").to_string())).collect();
        let expected = [("a", "EVENT_TYPE_WRITE"), ("b", "EVENT_TYPE_CHMOD"), ("sub/d", "EVENT_TYPE_CREATE"), ("c", "EVENT_TYPE_REMOVE")];
        assert_eq!(events, expected.map(|(n, t)| (n.to_string(), t.to_string())).to_vec());
    }

    #[test]
    fn stat_lines_become_entries() {
        let e = entry("regular file|5|81a4|-rw-r--r--|root|root|1700000000|/workspace/a|b.txt").expect("parses");
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(e["name"], "a|b.txt", "a | in the name survives");
        assert_eq!(e["path"], "/workspace/a|b.txt");
        assert_eq!(e["size"], 5);
        assert_eq!(e["mode"], 0o644);
        let d = entry("directory|4096|41ed|drwxr-xr-x|root|root|1700000000|/tmp").expect("parses");
        assert_eq!(d["type"], "FILE_TYPE_DIRECTORY");
        assert!(entry("garbage").is_none());
    }
}
