//! The gRPC edge: each handler authenticates the caller, turns the protobuf message into a core
//! call and the result back into a message, and audits what it mutated. Every decision about
//! what a call does (validation, idempotency, what a dropped stream means) is the manager's.

pub mod auth;
pub(crate) mod convert;
mod images;
mod status;
mod streams;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::{Stream, StreamExt};
use sandbox_proto::v1 as pb;
use sandbox_proto::v1::sandbox_service_server::SandboxService;
use tonic::{Request, Response, Status};

use crate::audit::{millis, AuditEntry, AuditLog};
use crate::manager::Manager;
use crate::model::{ExecRequest, TraceContext};
use crate::telemetry::caller_trace;

pub use auth::Auth;
pub use convert::{exec_request, isolation_from_proto, isolation_to_proto};
pub use streams::Inbound;

/// The `sandbox.v1.SandboxService` implementation.
pub struct Api {
    manager: Arc<Manager>,
    auth: Arc<Auth>,
    audit: Arc<AuditLog>,
    /// The egress filter, whose per-sandbox events `GetNetworkLog` reads.
    egress: Option<Arc<crate::egress::Egress>>,
}

impl Api {
    /// Serves `manager` to callers `auth` admits, auditing into `audit`.
    pub fn new(manager: Arc<Manager>, auth: Arc<Auth>, audit: Arc<AuditLog>) -> Self {
        Api { manager, auth, audit, egress: None }
    }

    /// Also answers `GetNetworkLog` from `egress`.
    pub fn with_egress(mut self, egress: Arc<crate::egress::Egress>) -> Self {
        self.egress = Some(egress);
        self
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ExecEvent, Status>> + Send>>;
pub type SessionStream = Pin<Box<dyn Stream<Item = Result<pb::ExecSessionEvent, Status>> + Send>>;
type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::DownloadChunk, Status>> + Send>>;

/// How long a client-streaming call may take to send its first message.
const FIRST_MESSAGE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// What the audit line of a mutating call says besides tenant, RPC, status and duration.
#[derive(Default)]
struct Audited {
    sandbox_id: String,
    argv: Option<Vec<String>>,
    env: Option<std::collections::BTreeMap<String, String>>,
    detail: String,
    /// The caller's trace (its `traceparent`), set by [`Api::call`] and [`Api::call_streaming`].
    trace: Option<TraceContext>,
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

impl Api {
    /// Authenticates, runs `f` with the caller's tenant, and writes the audit line for mutating
    /// calls (`audited` is Some) whatever the outcome.
    async fn call<T, R, F, Fut>(&self, rpc: &'static str, request: Request<T>, audited: Option<Audited>, f: F) -> Result<Response<R>, Status>
    where
        F: FnOnce(String, T) -> Fut,
        Fut: Future<Output = Result<R, Status>>,
    {
        let started = Instant::now();
        let tenant = self.auth.tenant(&request);
        let trace = caller_trace(request.metadata().as_ref());
        let result = match &tenant {
            Ok(t) => f(t.clone(), request.into_inner()).await,
            Err(e) => Err(e.clone()),
        };
        if let Some(mut a) = audited {
            a.trace = trace;
            self.record(rpc, tenant.as_deref().ok(), &a, result.as_ref().err(), started);
        }
        result.map(Response::new)
    }

    /// [`Api::call`] for a client-streaming call whose first message says what it is about (an
    /// upload's header, a session's command): that message is read first (within
    /// [`FIRST_MESSAGE_DEADLINE`] or `streams.idle_timeout_ms`, whichever is shorter: past it
    /// DEADLINE_EXCEEDED; a stream that ends without one is INVALID_ARGUMENT), the audit line is
    /// made from it, and `f` gets it with the rest of the stream.
    async fn call_streaming<M, R, F, Fut>(
        &self,
        rpc: &'static str,
        request: Request<Inbound<M>>,
        audit_of: impl FnOnce(&M) -> Audited,
        f: F,
    ) -> Result<Response<R>, Status>
    where
        F: FnOnce(String, M, Inbound<M>) -> Fut,
        Fut: Future<Output = Result<R, Status>>,
    {
        let started = Instant::now();
        let tenant = self.auth.tenant(&request)?;
        let trace = caller_trace(request.metadata().as_ref());
        let mut stream = request.into_inner();
        // The first message is waited for like any other of a stream: `streams.idle_timeout_ms`.
        let deadline = FIRST_MESSAGE_DEADLINE.min(self.manager.stream_idle_timeout());
        let first = match tokio::time::timeout(deadline, streams::next_message(&mut stream)).await {
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None)) => return Err(Status::invalid_argument(format!("{rpc}: the stream ended before its first message"))),
            Ok(Err(status)) => return Err(status),
            Err(_) => {
                return Err(Status::deadline_exceeded(format!("{rpc}: no first message within {:.1} s (streams.idle_timeout_ms)", deadline.as_secs_f64())))
            }
        };
        let audited = Audited { trace, ..audit_of(&first) };
        let result = f(tenant.clone(), first, stream).await;
        self.record(rpc, Some(&tenant), &audited, result.as_ref().err(), started);
        result.map(Response::new)
    }

    /// Writes the audit line of a mutating call.
    fn record(&self, rpc: &'static str, tenant: Option<&str>, a: &Audited, error: Option<&Status>, started: Instant) {
        record_audit(&self.audit, rpc, tenant, a, error, started);
    }

    fn audited_exec(&self, req: &pb::ExecRequest) -> Audited {
        Audited {
            sandbox_id: req.sandbox_id.clone(),
            argv: Some(req.argv.clone()),
            env: self.audit.env(&req.env),
            detail: if req.background { "background".into() } else { String::new() },
            trace: None,
        }
    }
}

/// Writes the audit line of a mutating call into `audit`.
fn record_audit(audit: &AuditLog, rpc: &'static str, tenant: Option<&str>, a: &Audited, error: Option<&Status>, started: Instant) {
    audit.record(&AuditEntry {
        tenant: tenant.unwrap_or("-"),
        rpc,
        sandbox_id: &a.sandbox_id,
        argv: a.argv.as_deref(),
        env: a.env.clone(),
        detail: &a.detail,
        status: error.map(|s| code_name(s.code())).unwrap_or("OK"),
        duration_ms: millis(started.elapsed()),
        trace: a.trace.as_ref(),
    });
}

/// The audit line of an upload, from its header.
fn upload_audit(first: &pb::UploadRequest) -> Audited {
    match &first.item {
        Some(pb::upload_request::Item::Header(h)) => Audited { sandbox_id: h.sandbox_id.clone(), detail: format!("path={}", h.path), ..Default::default() },
        _ => Audited { detail: "upload without header".into(), ..Default::default() },
    }
}

/// The header an upload stream must start with.
fn upload_header(first: pb::UploadRequest) -> Result<pb::UploadHeader, Status> {
    match first.item {
        Some(pb::upload_request::Item::Header(h)) => Ok(h),
        _ => Err(Status::invalid_argument("the first message of an upload must be `header`")),
    }
}

fn sandbox_only(id: &str) -> Option<Audited> {
    Some(Audited { sandbox_id: id.to_string(), ..Default::default() })
}

#[tonic::async_trait]
impl SandboxService for Api {
    async fn create_sandbox(&self, request: Request<pb::CreateSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let m = self.manager.clone();
        let r = request.get_ref();
        let detail = format!("isolation={} image={} from_snapshot={}", r.isolation, r.image, r.from_snapshot_id);
        self.call("CreateSandbox", request, Some(Audited { detail, ..Default::default() }), |tenant, req| async move {
            // UNAVAILABLE, not FAILED_PRECONDITION: the node will not take it, another one may
            // (the fleet's router places it on a ready peer).
            if m.is_draining() {
                return Err(Status::unavailable(m.drain_refusal()));
            }
            let info = m.create(&tenant, convert::create_request(req)?).await?;
            Ok(convert::sandbox(&info))
        })
        .await
    }

    async fn get_sandbox(&self, request: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.call("GetSandbox", request, None, |tenant, req| async move {
            let mut sandbox = convert::sandbox(&self.manager.get(&tenant, &req.sandbox_id)?);
            sandbox.usage = self.manager.usage(&tenant, &req.sandbox_id).await?.as_ref().map(convert::sandbox_usage);
            Ok(sandbox)
        })
        .await
    }

    async fn get_network_log(&self, request: Request<pb::GetNetworkLogRequest>) -> Result<Response<pb::GetNetworkLogResponse>, Status> {
        self.call("GetNetworkLog", request, None, |tenant, req| async move {
            // The caller's own sandbox, else NOT_FOUND like every other call.
            self.manager.get(&tenant, &req.sandbox_id)?;
            let events = self.egress.as_ref().map(|e| e.recent(&req.sandbox_id, req.limit as usize)).unwrap_or_default();
            Ok(pb::GetNetworkLogResponse { events: events.iter().map(convert::network_event).collect() })
        })
        .await
    }

    async fn set_sandbox_ttl(&self, request: Request<pb::SetSandboxTtlRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let audited = sandbox_only(&request.get_ref().sandbox_id);
        self.call("SetSandboxTtl", request, audited, |tenant, req| async move {
            Ok(convert::sandbox(&self.manager.set_ttl(&tenant, &req.sandbox_id, req.ttl_seconds)?))
        })
        .await
    }

    async fn pause_sandbox(&self, request: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let audited = sandbox_only(&request.get_ref().sandbox_id);
        self.call("PauseSandbox", request, audited, |tenant, req| async move { Ok(convert::sandbox(&self.manager.pause(&tenant, &req.sandbox_id).await?)) })
            .await
    }

    async fn resume_sandbox(&self, request: Request<pb::ResumeSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let audited = sandbox_only(&request.get_ref().sandbox_id);
        self.call("ResumeSandbox", request, audited, |tenant, req| async move {
            Ok(convert::sandbox(&self.manager.resume(&tenant, &req.sandbox_id, req.ttl_seconds).await?))
        })
        .await
    }

    async fn list_sandboxes(&self, request: Request<pb::ListSandboxesRequest>) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        self.call("ListSandboxes", request, None, |tenant, req| async move {
            let list = self.manager.list(&tenant, &req.label_selector.into_iter().collect())?;
            Ok(pb::ListSandboxesResponse { sandboxes: list.iter().map(convert::sandbox).collect(), unreachable_nodes: Vec::new() })
        })
        .await
    }

    async fn destroy_sandbox(&self, request: Request<pb::DestroySandboxRequest>) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        let audited = sandbox_only(&request.get_ref().sandbox_id);
        self.call("DestroySandbox", request, audited, |tenant, req| async move {
            self.manager.destroy(&tenant, &req.sandbox_id).await?;
            Ok(pb::DestroySandboxResponse {})
        })
        .await
    }

    async fn exec(&self, request: Request<pb::ExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        let audited = Some(self.audited_exec(request.get_ref()));
        let trace = caller_trace(request.metadata().as_ref());
        self.call("Exec", request, audited, |tenant, req| async move {
            let record = self.manager.exec(&tenant, ExecRequest { trace, ..exec_request(req) }).await?;
            Ok(convert::exec_result(&record, true))
        })
        .await
    }

    type ExecStreamStream = EventStream;

    async fn exec_stream(&self, request: Request<pb::ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        let audited = Some(self.audited_exec(request.get_ref()));
        let trace = caller_trace(request.metadata().as_ref());
        self.call("ExecStream", request, audited, |tenant, req| async move {
            let events = self.manager.exec_stream(&tenant, ExecRequest { trace, ..exec_request(req) })?;
            Ok(Box::pin(events.filter_map(|e| std::future::ready(convert::exec_event(e).transpose()))) as EventStream)
        })
        .await
    }

    async fn get_exec(&self, request: Request<pb::GetExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        self.call("GetExec", request, None, |tenant, req| async move {
            Ok(convert::exec_result(&self.manager.get_exec(&tenant, &req.exec_id, req.wait).await?, true))
        })
        .await
    }

    async fn signal_exec(&self, request: Request<pb::SignalExecRequest>) -> Result<Response<pb::SignalExecResponse>, Status> {
        let r = request.get_ref();
        let audited = Some(Audited { detail: format!("exec={} signal={}", r.exec_id, r.signal), ..Default::default() });
        self.call("SignalExec", request, audited, |tenant, req| async move {
            self.manager.signal_exec(&tenant, &req.exec_id, req.signal).await?;
            Ok(pb::SignalExecResponse {})
        })
        .await
    }

    async fn list_execs(&self, request: Request<pb::ListExecsRequest>) -> Result<Response<pb::ListExecsResponse>, Status> {
        self.call("ListExecs", request, None, |tenant, req| async move {
            let page = self.manager.list_execs(&tenant, &convert::list_execs_query(req))?;
            // Bodies are empty unless the query asked for them.
            Ok(pb::ListExecsResponse { execs: page.records.iter().map(|r| convert::exec_result(r, true)).collect(), next_page_token: page.next_page_token })
        })
        .await
    }

    async fn write_file(&self, request: Request<pb::WriteFileRequest>) -> Result<Response<pb::WriteFileResponse>, Status> {
        let r = request.get_ref();
        let audited = Some(Audited { sandbox_id: r.sandbox_id.clone(), detail: format!("path={} bytes={}", r.path, r.content.len()), ..Default::default() });
        self.call("WriteFile", request, audited, |tenant, req| async move {
            let n = self.manager.write_file(&tenant, &req.sandbox_id, &req.path, &req.content, req.mode).await?;
            Ok(pb::WriteFileResponse { bytes_written: n })
        })
        .await
    }

    async fn read_file(&self, request: Request<pb::ReadFileRequest>) -> Result<Response<pb::ReadFileResponse>, Status> {
        self.call("ReadFile", request, None, |tenant, req| async move {
            let chunk = self.manager.read_file(&tenant, &req.sandbox_id, &req.path, req.offset, req.limit).await?;
            Ok(pb::ReadFileResponse { content: chunk.content, size: chunk.size, eof: chunk.eof })
        })
        .await
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotInfo>, Status> {
        let audited = sandbox_only(&request.get_ref().sandbox_id);
        self.call("Snapshot", request, audited, |tenant, req| async move {
            Ok(convert::snapshot(&self.manager.snapshot(&tenant, &req.sandbox_id, &req.name, req.include_memory).await?))
        })
        .await
    }

    async fn list_snapshots(&self, request: Request<pb::ListSnapshotsRequest>) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        self.call("ListSnapshots", request, None, |tenant, req| async move {
            let snaps = self.manager.list_snapshots(&tenant, &req.sandbox_id)?;
            Ok(pb::ListSnapshotsResponse { snapshots: snaps.iter().map(convert::snapshot).collect() })
        })
        .await
    }

    async fn rollback(&self, request: Request<pb::RollbackRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let r = request.get_ref();
        let audited = Some(Audited { sandbox_id: r.sandbox_id.clone(), detail: format!("snapshot={}", r.snapshot_id), ..Default::default() });
        self.call("Rollback", request, audited, |tenant, req| async move {
            Ok(convert::sandbox(&self.manager.rollback(&tenant, &req.sandbox_id, &req.snapshot_id).await?))
        })
        .await
    }

    async fn delete_snapshot(&self, request: Request<pb::DeleteSnapshotRequest>) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let audited = Some(Audited { detail: format!("snapshot={}", request.get_ref().snapshot_id), ..Default::default() });
        self.call("DeleteSnapshot", request, audited, |tenant, req| async move {
            self.manager.delete_snapshot(&tenant, &req.snapshot_id).await?;
            Ok(pb::DeleteSnapshotResponse {})
        })
        .await
    }

    type ExecSessionStream = SessionStream;

    async fn exec_session(&self, request: Request<tonic::Streaming<pb::ExecSessionRequest>>) -> Result<Response<Self::ExecSessionStream>, Status> {
        self.exec_session_from(request.map(|s| Box::pin(s) as Inbound<_>)).await
    }

    async fn upload_file(&self, request: Request<tonic::Streaming<pb::UploadRequest>>) -> Result<Response<pb::UploadFileResponse>, Status> {
        self.upload_file_from(request.map(|s| Box::pin(s) as Inbound<_>)).await
    }

    async fn upload_archive(&self, request: Request<tonic::Streaming<pb::UploadRequest>>) -> Result<Response<pb::UploadArchiveResponse>, Status> {
        self.upload_archive_from(request.map(|s| Box::pin(s) as Inbound<_>)).await
    }
    type DownloadFileStream = ChunkStream;

    async fn download_file(&self, request: Request<pb::DownloadRequest>) -> Result<Response<Self::DownloadFileStream>, Status> {
        self.call("DownloadFile", request, None, |tenant, req| async move {
            let download = self.manager.download_file(&tenant, &req.sandbox_id, &req.path).await?;
            Ok(Box::pin(streams::download_chunks(download)) as ChunkStream)
        })
        .await
    }

    type DownloadArchiveStream = ChunkStream;

    async fn download_archive(&self, request: Request<pb::DownloadRequest>) -> Result<Response<Self::DownloadArchiveStream>, Status> {
        self.call("DownloadArchive", request, None, |tenant, req| async move {
            let chunks = self.manager.download_archive(&tenant, &req.sandbox_id, &req.path).await?;
            Ok(Box::pin(streams::archive_chunks(chunks)) as ChunkStream)
        })
        .await
    }
    async fn list_images(&self, request: Request<pb::ListImagesRequest>) -> Result<Response<pb::ListImagesResponse>, Status> {
        let root = images::root_peer(&request);
        self.call("ListImages", request, None, |tenant, _req| async move {
            let viewer = self.manager.image_viewer(&tenant, root);
            Ok(pb::ListImagesResponse { images: self.manager.list_images(&viewer)?.iter().map(convert::image).collect(), unreachable_nodes: Vec::new() })
        })
        .await
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::ImageInfo>, Status> {
        let root = images::root_peer(&request);
        self.call("GetImage", request, None, |tenant, req| async move {
            Ok(convert::image(&self.manager.get_image(&self.manager.image_viewer(&tenant, root), &req.name)?))
        })
        .await
    }

    async fn remove_image(&self, request: Request<pb::RemoveImageRequest>) -> Result<Response<pb::RemoveImageResponse>, Status> {
        let audited = Some(Audited { detail: format!("image={}", request.get_ref().name.chars().take(80).collect::<String>()), ..Default::default() });
        let root = images::root_peer(&request);
        self.call("RemoveImage", request, audited, |tenant, req| async move {
            Ok(pb::RemoveImageResponse { freed_bytes: self.manager.remove_image(&self.manager.image_viewer(&tenant, root), &req.name).await? })
        })
        .await
    }

    type ImportImageStream = images::ProgressStream;

    async fn import_image(&self, request: Request<tonic::Streaming<pb::ImportImageRequest>>) -> Result<Response<Self::ImportImageStream>, Status> {
        let (metadata, extensions, stream) = request.into_parts();
        self.import_image_from(Request::from_parts(metadata, extensions, Box::pin(stream))).await
    }

    type BuildImageStream = images::ProgressStream;

    async fn build_image(&self, request: Request<tonic::Streaming<pb::BuildImageRequest>>) -> Result<Response<Self::BuildImageStream>, Status> {
        let (metadata, extensions, stream) = request.into_parts();
        self.build_image_from(Request::from_parts(metadata, extensions, Box::pin(stream))).await
    }
}

/// The client-streaming calls over any stream of their messages, for the fleet's router.
impl Api {
    /// `ImportImage` over any stream of its messages (see [`Inbound`]).
    pub async fn import_image_from(&self, request: Request<Inbound<pb::ImportImageRequest>>) -> Result<Response<images::ProgressStream>, Status> {
        use pb::import_image_request::Item;
        let started = Instant::now();
        let tenant = self.auth.tenant(&request)?;
        let viewer = self.manager.image_viewer(&tenant, images::root_peer(&request));
        let trace = caller_trace(request.metadata().as_ref());
        let mut stream = request.into_inner();
        let first = images::first_message(&mut stream, "ImportImage").await?;
        let Some(Item::Header(header)) = first.item else {
            return Err(Status::invalid_argument("the first message of ImportImage must be `header`"));
        };
        let (req, pieces, detail) = images::import_request(header)?;
        let end = images::CallEnd {
            audit: self.audit.clone(),
            rpc: "ImportImage",
            tenant: tenant.clone(),
            audited: Audited { detail, trace, ..Default::default() },
            started,
        };
        let events = match images::start_import(&self.manager, &viewer, req) {
            Ok(events) => events,
            Err(status) => {
                images::refused(&end, &status);
                return Err(status);
            }
        };
        let feed = pieces.map(|tx| images::feed(stream, tx));
        Ok(Response::new(images::progress(events, feed, end)))
    }

    /// `BuildImage` over any stream of its messages (see [`Inbound`]).
    pub async fn build_image_from(&self, request: Request<Inbound<pb::BuildImageRequest>>) -> Result<Response<images::ProgressStream>, Status> {
        use pb::build_image_request::Item;
        let started = Instant::now();
        let tenant = self.auth.tenant(&request)?;
        let viewer = self.manager.image_viewer(&tenant, images::root_peer(&request));
        let trace = caller_trace(request.metadata().as_ref());
        let mut stream = request.into_inner();
        let first = images::first_message(&mut stream, "BuildImage").await?;
        let Some(Item::Header(header)) = first.item else {
            return Err(Status::invalid_argument("the first message of BuildImage must be `header`"));
        };
        let (req, pieces, detail) = images::build_request(header)?;
        let end = images::CallEnd {
            audit: self.audit.clone(),
            rpc: "BuildImage",
            tenant: tenant.clone(),
            audited: Audited { detail, trace, ..Default::default() },
            started,
        };
        let events = match images::start_build(&self.manager, &viewer, req) {
            Ok(events) => events,
            Err(status) => {
                images::refused(&end, &status);
                return Err(status);
            }
        };
        Ok(Response::new(images::progress(events, Some(images::feed(stream, pieces)), end)))
    }

    /// `ExecSession` over any stream of its messages (see [`Inbound`]).
    pub async fn exec_session_from(&self, request: Request<Inbound<pb::ExecSessionRequest>>) -> Result<Response<SessionStream>, Status> {
        use pb::exec_session_request::Item;
        let audit_of = |first: &pb::ExecSessionRequest| match &first.item {
            Some(Item::Start(pb::ExecSessionStart { exec: Some(exec), tty, .. })) => {
                let mut a = self.audited_exec(exec);
                a.detail = if *tty { "session tty".into() } else { "session".into() };
                a
            }
            _ => Audited { detail: "session without start".into(), ..Default::default() },
        };
        let trace = caller_trace(request.metadata().as_ref());
        self.call_streaming("ExecSession", request, audit_of, |tenant, first, stream| async move {
            let Some(Item::Start(start)) = first.item else {
                return Err(Status::invalid_argument("the first message of an exec session must be `start`"));
            };
            let exec = start.exec.ok_or_else(|| Status::invalid_argument("invalid start.exec: missing"))?;
            let tty = streams::terminal(start.tty, start.size)?;
            let (started_tx, started_rx) = tokio::sync::watch::channel(None);
            let input = streams::session_input(self.manager.clone(), tenant.clone(), stream, started_rx, self.manager.session_input_buffer());
            let events = self.manager.exec_session(&tenant, ExecRequest { trace, ..exec_request(exec) }, crate::manager::Session { input, tty })?;
            let events = events.map(move |event| {
                if let Ok(crate::model::ExecEvent::Started(id)) = &event {
                    let _ = started_tx.send(Some(id.clone()));
                }
                convert::session_event(event)
            });
            Ok(Box::pin(events) as SessionStream)
        })
        .await
    }

    /// `UploadFile` over any stream of its messages.
    pub async fn upload_file_from(&self, request: Request<Inbound<pb::UploadRequest>>) -> Result<Response<pb::UploadFileResponse>, Status> {
        self.call_streaming("UploadFile", request, upload_audit, |tenant, first, stream| async move {
            let header = upload_header(first)?;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let upload = self.manager.upload_file(&tenant, &header.sandbox_id, &header.path, header.mode, rx);
            let idle = Some(self.manager.stream_idle_timeout());
            let (fed, written) = streams::run_upload(streams::feed_upload_within(stream, tx, idle), upload).await;
            let (sha256, bytes_written) = streams::upload_result(fed, written)?;
            Ok(pb::UploadFileResponse { bytes_written, sha256 })
        })
        .await
    }

    /// `UploadArchive` over any stream of its messages.
    pub async fn upload_archive_from(&self, request: Request<Inbound<pb::UploadRequest>>) -> Result<Response<pb::UploadArchiveResponse>, Status> {
        self.call_streaming("UploadArchive", request, upload_audit, |tenant, first, stream| async move {
            let header = upload_header(first)?;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let upload = self.manager.upload_archive(&tenant, &header.sandbox_id, &header.path, rx);
            let idle = Some(self.manager.stream_idle_timeout());
            let (fed, stats) = streams::run_upload(streams::feed_upload_within(stream, tx, idle), upload).await;
            let (_, s) = streams::upload_result(fed, stats)?;
            Ok(pb::UploadArchiveResponse { files: s.files + s.hardlinks, directories: s.dirs, symlinks: s.symlinks, bytes: s.bytes })
        })
        .await
    }
}
