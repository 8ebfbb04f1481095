//! The image calls' edge: ImportImage and BuildImage read their header, feed the uploaded bytes
//! (checked against their sha256, as UploadFile's) to the manager, and stream its progress back;
//! their audit line is written when the call ends, with how it ended.

use super::streams::Inbound;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::{Future, Stream, StreamExt};
use sandbox_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::streams::{feed_upload, FeedError, UploadMessage};
use super::{convert, record_audit, Audited, FIRST_MESSAGE_DEADLINE};
use crate::audit::AuditLog;
use crate::backend::UploadPiece;
use crate::images::Viewer;
use crate::manager::{BuildRequest, ImageEvents, ImportRequest, ImportSource, Manager};

/// The progress stream of an import or build.
pub type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::ImageProgress, Status>> + Send>>;

/// Uploaded pieces waiting for the manager (4 MiB with the client's 1 MiB chunks).
const PIECES: usize = 4;

/// The first message of a client stream, within [`FIRST_MESSAGE_DEADLINE`].
pub async fn first_message<M>(stream: &mut Inbound<M>, rpc: &str) -> Result<M, Status> {
    use futures::StreamExt;
    match tokio::time::timeout(FIRST_MESSAGE_DEADLINE, stream.next()).await {
        Ok(Some(Ok(m))) => Ok(m),
        Ok(None) => Err(Status::invalid_argument(format!("{rpc}: the stream ended before its first message"))),
        Ok(Some(Err(status))) => Err(status),
        Err(_) => Err(Status::invalid_argument(format!("{rpc}: no first message within {} s", FIRST_MESSAGE_DEADLINE.as_secs()))),
    }
}

/// What an ImportImage header asks for, with the audit line's detail.
pub fn import_request(header: pb::ImportImageHeader) -> Result<(ImportRequest, Option<mpsc::Sender<UploadPiece>>, String), Status> {
    use pb::import_image_header::Source;
    match header.source {
        Some(Source::DockerImage(reference)) => {
            let detail = format!("name={} docker={} shared={}", header.name, reference.chars().take(200).collect::<String>(), header.shared);
            Ok((ImportRequest { name: header.name, source: ImportSource::Docker(reference), shared: header.shared }, None, detail))
        }
        Some(Source::Archive(a)) => {
            let (tx, rx) = mpsc::channel(PIECES);
            let detail =
                format!("name={} archive={} bytes={} shared={}", header.name, a.file_name.chars().take(200).collect::<String>(), a.size_bytes, header.shared);
            let source = ImportSource::Archive { file_name: a.file_name, size: a.size_bytes, data: rx };
            Ok((ImportRequest { name: header.name, source, shared: header.shared }, Some(tx), detail))
        }
        None => Err(Status::invalid_argument("invalid header.source: docker_image or archive")),
    }
}

/// What a BuildImage header asks for, the sender of its context, and the audit line's detail.
pub fn build_request(header: pb::BuildImageHeader) -> Result<(BuildRequest, mpsc::Sender<UploadPiece>, String), Status> {
    let (tx, rx) = mpsc::channel(PIECES);
    let detail = format!("name={} dockerfile={} context_bytes={}", header.name, header.dockerfile, header.context_size_bytes);
    let req = BuildRequest {
        name: header.name,
        dockerfile: header.dockerfile,
        build_args: header.build_args.into_iter().collect(),
        network: super::convert::network_from_proto(header.network)?,
        size: header.context_size_bytes,
        data: rx,
    };
    Ok((req, tx, detail))
}

/// The feeding of an upload: its content's digest once complete.
pub type Feed = Pin<Box<dyn Future<Output = Result<String, FeedError>> + Send>>;

/// Feeds the rest of `stream` (chunks, then the sha256) to `tx`.
pub fn feed<M: UploadMessage + Send + 'static>(stream: Inbound<M>, tx: mpsc::Sender<UploadPiece>) -> Feed {
    Box::pin(feed_upload(stream, tx))
}

/// Everything needed to audit a streaming call when it ends.
pub struct CallEnd {
    pub audit: Arc<AuditLog>,
    pub rpc: &'static str,
    pub tenant: String,
    pub audited: Audited,
    pub started: Instant,
}

/// The manager's events as the client's stream, while the upload (if any) is fed. The client's
/// own fault (it broke off, a bad checksum) is the answer when it happens; otherwise the
/// manager's events run to their `done` or error. The audit line is written at the end.
pub fn progress(events: ImageEvents, feed: Option<Feed>, end: CallEnd) -> ProgressStream {
    let (out, rx) = mpsc::channel::<Result<pb::ImageProgress, Status>>(16);
    tokio::spawn(async move {
        let mut events = events;
        let mut feed = feed;
        let mut failure: Option<Status> = None;
        let mut done = false;
        loop {
            tokio::select! {
                fed = async { match feed.as_mut() { Some(f) => f.await, None => std::future::pending().await } } => {
                    feed = None;
                    if let Err(FeedError::Client(status)) = fed {
                        failure = Some(status);
                        break;
                    }
                    // A manager that stopped taking pieces says why on `events`.
                }
                event = events.next() => match event {
                    Some(Ok(p)) => {
                        let last = p.done.is_some();
                        if out.send(Ok(convert::image_progress(&p))).await.is_err() {
                            failure = Some(Status::cancelled("the client went away"));
                            break;
                        }
                        if last {
                            done = true;
                            break;
                        }
                    }
                    Some(Err(e)) => {
                        failure = Some(e.into());
                        break;
                    }
                    None => break,
                }
            }
        }
        if !done && failure.is_none() {
            failure = Some(Status::internal(format!("{}: the import ended without its result", end.rpc)));
        }
        if let Some(status) = &failure {
            let _ = out.send(Err(status.clone())).await;
        }
        record_audit(&end.audit, end.rpc, Some(&end.tenant), &end.audited, failure.as_ref(), end.started);
    });
    Box::pin(ReceiverStream::new(rx))
}

/// The audit line of a call refused before its stream started.
pub fn refused(end: &CallEnd, status: &Status) {
    record_audit(&end.audit, end.rpc, Some(&end.tenant), &end.audited, Some(status), end.started);
}

/// Starts the manager's import of `req`.
pub fn start_import(manager: &Arc<Manager>, viewer: &Viewer, req: ImportRequest) -> Result<ImageEvents, Status> {
    manager.import_image(viewer, req).map_err(Status::from)
}

/// Starts the manager's build of `req`.
pub fn start_build(manager: &Arc<Manager>, viewer: &Viewer, req: BuildRequest) -> Result<ImageEvents, Status> {
    manager.build_image(viewer, req).map_err(Status::from)
}

/// Whether the caller is root (or the daemon's own uid) on the UNIX socket, by its
/// kernel-verified credentials: always an image admin, like the operator at the console.
pub fn root_peer<T>(req: &tonic::Request<T>) -> bool {
    match crate::connections::Peer::of(req.extensions()) {
        Some(crate::connections::Peer { transport: crate::connections::Transport::Unix(Some(cred)), .. }) => {
            cred.uid() == 0 || cred.uid() == nix::unistd::geteuid().as_raw()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_requests() {
        let h = pb::ImportImageHeader { name: "x".into(), source: Some(pb::import_image_header::Source::DockerImage("debian:12".into())), shared: false };
        let (req, feed, detail) = import_request(h).expect("docker");
        assert!(feed.is_none() && matches!(req.source, ImportSource::Docker(ref r) if r == "debian:12"));
        assert!(detail.contains("docker=debian:12"), "{detail}");
        let h = pb::ImportImageHeader { name: String::new(), source: None, shared: false };
        assert_eq!(import_request(h).err().map(|s| s.code()), Some(tonic::Code::InvalidArgument));
    }
}
