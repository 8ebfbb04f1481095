//! Images across the fleet: an image is usable on a node once imported there, so an
//! `ImportImage` or `BuildImage` a client sends to one node reaches every node. The node the
//! client reached imports (or builds) as usual while its messages are spooled to a file in its
//! image store; once its own import is done, the same messages are sent to every peer, signed
//! with the fleet token and the caller's tenant, all at once. The client hears each peer's
//! outcome as a progress event of phase `fleet` before the last event, which carries the image
//! as this node has it. A peer that fails (down, no room, no Docker for a build) fails only its
//! own copy: the event names it. `RemoveImage` is passed on the same way.
//!
//! A call a peer sends is served where it lands and never passed on again.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use sandbox_proto::v1 as pb;
use sandbox_proto::v1::sandbox_service_client::SandboxServiceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Status};

use super::{Fleet, Peer};
use crate::api::Inbound;

/// Largest piece of a spooled upload sent to a peer.
const REPLAY_CHUNK: usize = 1 << 20;

type Progress = std::pin::Pin<Box<dyn Stream<Item = Result<pb::ImageProgress, Status>> + Send>>;

/// A client-streaming image call (`ImportImage`, `BuildImage`): header first, then data
/// pieces, then their sha256.
pub trait ImageUpload: Clone + Send + Sync + 'static {
    fn data(&self) -> Option<&[u8]>;
    fn sha(&self) -> Option<&str>;
    fn chunk(bytes: Vec<u8>) -> Self;
    fn sha256(digest: String) -> Self;
    /// The call on a peer.
    fn send(
        client: SandboxServiceClient<Channel>,
        request: Request<ReceiverStream<Self>>,
    ) -> BoxFuture<'static, Result<tonic::Streaming<pb::ImageProgress>, Status>>;
}

macro_rules! image_upload {
    ($msg:ty, $item:ident, $method:ident) => {
        impl ImageUpload for $msg {
            fn data(&self) -> Option<&[u8]> {
                match &self.item {
                    Some(pb::$item::Item::Chunk(d)) => Some(d),
                    _ => None,
                }
            }
            fn sha(&self) -> Option<&str> {
                match &self.item {
                    Some(pb::$item::Item::Sha256(s)) => Some(s),
                    _ => None,
                }
            }
            fn chunk(bytes: Vec<u8>) -> Self {
                Self { item: Some(pb::$item::Item::Chunk(bytes.into())) }
            }
            fn sha256(digest: String) -> Self {
                Self { item: Some(pb::$item::Item::Sha256(digest)) }
            }
            fn send(
                mut client: SandboxServiceClient<Channel>,
                request: Request<ReceiverStream<Self>>,
            ) -> BoxFuture<'static, Result<tonic::Streaming<pb::ImageProgress>, Status>> {
                Box::pin(async move { client.$method(request).await.map(tonic::Response::into_inner) })
            }
        }
    };
}

image_upload!(pb::ImportImageRequest, import_image_request, import_image);
image_upload!(pb::BuildImageRequest, build_image_request, build_image);

/// What the client sent, kept for the peers: its first message, the data pieces in a file (see
/// [`SpoolFile`]), the digest it ended with, and whether every piece reached the file.
struct Spool<M> {
    first: M,
    path: PathBuf,
    digest: Option<String>,
    complete: bool,
}

/// The spool file, removed when the copies are done (or never started).
struct SpoolFile(PathBuf);

impl Drop for SpoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

type Shared<M> = Arc<std::sync::Mutex<Spool<M>>>;

/// The client's messages (`first`, then `rest`) as they come, each data piece also appended to
/// the spool's file (flushed when the digest arrives, which ends the data).
fn tee<M: ImageUpload>(first: M, rest: Inbound<M>, spool: Shared<M>) -> Inbound<M> {
    let path = spool.lock().map(|s| s.path.clone()).unwrap_or_default();
    let mark = |spool: &Shared<M>, f: &dyn Fn(&mut Spool<M>)| {
        if let Ok(mut s) = spool.lock() {
            f(&mut s);
        }
    };
    let head = futures::stream::once(std::future::ready(Ok(first)));
    let tail = futures::stream::unfold((rest, None::<tokio::fs::File>, spool, path), move |(mut rest, mut file, spool, path)| async move {
        let item = rest.next().await;
        match &item {
            Some(Ok(m)) => {
                if let Some(data) = m.data() {
                    if file.is_none() {
                        file = tokio::fs::File::create(&path).await.ok();
                    }
                    let wrote = match file.as_mut() {
                        Some(f) => f.write_all(data).await.is_ok(),
                        None => false,
                    };
                    if !wrote {
                        tracing::warn!(path = %path.display(), "fleet: cannot spool an image upload for the peers; they will not get it");
                        mark(&spool, &|s| s.complete = false);
                    }
                }
                if let Some(sha) = m.sha() {
                    let flushed = match file.as_mut() {
                        Some(f) => f.flush().await.is_ok(),
                        None => true,
                    };
                    let sha = sha.to_string();
                    mark(&spool, &|s| {
                        s.digest = Some(sha.clone());
                        s.complete &= flushed;
                    });
                }
            }
            // The client broke off: nothing goes to the peers.
            Some(Err(_)) => mark(&spool, &|s| s.complete = false),
            None => {}
        }
        item.map(|i| (i, (rest, file, spool, path)))
    });
    Box::pin(head.chain(tail))
}

/// The spooled messages again, for one peer, read from the file as the peer takes them.
fn replay<M: ImageUpload>(first: M, path: PathBuf, digest: Option<String>) -> ReceiverStream<M> {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tokio::spawn(async move {
        if tx.send(first).await.is_err() {
            return;
        }
        // No file: no data piece was sent (a `docker:` import).
        if let Ok(mut file) = tokio::fs::File::open(&path).await {
            loop {
                let mut buf = vec![0u8; REPLAY_CHUNK];
                match file.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        buf.truncate(n);
                        if tx.send(M::chunk(buf)).await.is_err() {
                            return;
                        }
                    }
                    // Ends the stream without its digest: the peer refuses the upload.
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "fleet: reading a spooled image upload");
                        return;
                    }
                }
            }
        }
        if let Some(d) = digest {
            let _ = tx.send(M::sha256(d)).await;
        }
    });
    ReceiverStream::new(rx)
}

/// One peer's copy: its import run to its end.
async fn copy_to<M: ImageUpload>(
    fleet: &Fleet,
    peer: &Peer,
    tenant: &str,
    metadata: &tonic::metadata::MetadataMap,
    spool: &Spool<M>,
) -> Result<String, String> {
    let request =
        fleet.outgoing(tenant, metadata, replay(spool.first.clone(), spool.path.clone(), spool.digest.clone())).map_err(|s| s.message().to_string())?;
    let mut events = M::send(peer.client(), request).await.map_err(|s| peer.explain(s).message().to_string())?;
    loop {
        match events.message().await {
            Ok(Some(p)) => {
                if let Some(done) = p.done {
                    return Ok(format!("{} ({})", done.name, done.digest.get(7..19).unwrap_or(&done.digest)));
                }
            }
            Ok(None) => return Err("the node ended the call without its image".into()),
            Err(s) => return Err(peer.explain(s).message().to_string()),
        }
    }
}

/// Serves a client's image upload here (`local`, fed by the stream it is given) and then on
/// every peer; see the module docs.
pub async fn everywhere<M, F, Fut>(
    fleet: Arc<Fleet>,
    tenant: String,
    metadata: tonic::metadata::MetadataMap,
    first: M,
    rest: Inbound<M>,
    spool_path: PathBuf,
    local: F,
) -> Result<Progress, Status>
where
    M: ImageUpload,
    F: FnOnce(Inbound<M>) -> Fut,
    Fut: std::future::Future<Output = Result<Progress, Status>>,
{
    let file = SpoolFile(spool_path.clone());
    let spool: Shared<M> = Arc::new(std::sync::Mutex::new(Spool { first: first.clone(), path: spool_path, digest: None, complete: true }));
    let mut events = local(tee(first, rest, spool.clone())).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::ImageProgress, Status>>(16);
    tokio::spawn(async move {
        let _file = file;
        let mut last = None;
        while let Some(event) = events.next().await {
            match event {
                Ok(p) if p.done.is_some() => last = Some(p),
                other => {
                    if tx.send(other).await.is_err() {
                        return;
                    }
                }
            }
        }
        // This node's own import failed (the error was passed on): no copies.
        let Some(last) = last else { return };
        // Done here means every piece was taken and checked against the digest.
        let spool = match spool.lock() {
            Ok(s) if s.complete => Some(Spool { first: s.first.clone(), path: s.path.clone(), digest: s.digest.clone(), complete: true }),
            _ => None,
        };
        let said = |m: String| pb::ImageProgress { phase: "fleet".into(), message: m, ..Default::default() };
        match spool {
            Some(spool) => {
                let peers = fleet.peers();
                if !peers.is_empty() {
                    let names: Vec<&str> = peers.iter().map(|p| p.name.as_str()).collect();
                    if tx.send(Ok(said(format!("copying to the other nodes: {}", names.join(", "))))).await.is_err() {
                        return;
                    }
                }
                let copies = futures::future::join_all(peers.iter().map(|p| {
                    let (fleet, spool, tenant, metadata) = (&fleet, &spool, &tenant, &metadata);
                    async move {
                        // A peer that never ends its import does not hold this call (nor the
                        // spool) for ever.
                        let deadline = fleet.image_copy_deadline();
                        let outcome = match tokio::time::timeout(deadline, copy_to(fleet, p, tenant, metadata, spool)).await {
                            Ok(r) => r,
                            Err(_) => Err(format!("no image within {} s", deadline.as_secs())),
                        };
                        (p, outcome)
                    }
                }))
                .await;
                for (peer, outcome) in copies {
                    let line = match outcome {
                        Ok(image) => format!("{}: {image} ready", peer.name),
                        Err(e) => {
                            tracing::warn!(node = %peer.name, error = %e, "fleet: an image did not reach a peer");
                            format!("{}: failed: {e}", peer.name)
                        }
                    };
                    if tx.send(Ok(said(line))).await.is_err() {
                        return;
                    }
                }
            }
            None => {
                let _ = tx.send(Ok(said("not copied to the other nodes: the upload could not be spooled".into()))).await;
            }
        }
        let _ = tx.send(Ok(last)).await;
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Where the upload of an image call is spooled for the peers: beside this node's own uploads.
pub fn spool_path(dir: &Path) -> PathBuf {
    dir.join(format!(".fleet-spool-{}", crate::ids::random_suffix(12)))
}
