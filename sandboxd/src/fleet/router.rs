//! The SandboxService every listener serves: each call is served here ([`Api`]) or forwarded
//! in one hop to the node its id names. Without `[fleet]` every call is served here, unchanged.
//!
//! Which node: the node part of the call's sandbox, exec or snapshot id ([`crate::ids::node_of`]);
//! none, or this node's name, is here. A call from a peer is always served here (one hop: a
//! node never forwards what was forwarded to it). Streams are forwarded message by message:
//! the forwarding node holds at most the message in hand each way, and HTTP/2 flow control
//! holds the rest with the client or the peer. A client-streaming call's first message (a
//! session's `start`, an upload's header) is read here to learn where the call goes, and is
//! handed on with the rest.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use sandbox_proto::v1 as pb;
use sandbox_proto::v1::sandbox_service_server::SandboxService;
use tonic::{Request, Response, Status};

use super::{room_for, Fleet, Peer};
use crate::api::{Api, Auth, Inbound};
use crate::model::Isolation;

/// How long a client-streaming call may take to send the message that says where it goes.
const FIRST_MESSAGE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a peer may take to answer its part of a fan-out list.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(10);

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The routed service.
pub struct Routed {
    local: Api,
    fleet: Option<Arc<Fleet>>,
    auth: Arc<Auth>,
}

impl Routed {
    /// Serves `local` here and, with a `fleet`, forwards what belongs to its other nodes.
    pub fn new(local: Api, fleet: Option<Arc<Fleet>>, auth: Arc<Auth>) -> Self {
        Routed { local, fleet, auth }
    }

    /// Where a call about `id` goes: None = here; else the peer and the tenant to name to it.
    async fn route<T>(&self, request: &Request<T>, id: &str) -> Result<Option<(Peer, String)>, Status> {
        let Some(fleet) = &self.fleet else { return Ok(None) };
        let Some(node) = crate::ids::node_of(id) else { return Ok(None) };
        // A malformed node part is served here, where the id is NOT_FOUND like any unknown one.
        if node == fleet.node() || fleet.is_from_peer(request) || crate::ids::NodeName::parse(node).is_err() {
            return Ok(None);
        }
        let tenant = self.auth.tenant(request)?;
        Ok(Some((fleet.peer(node).await?, tenant)))
    }

    /// The request to send to a peer: `message` with the fleet token, the tenant and the
    /// caller's trace context.
    fn outgoing<T>(&self, tenant: &str, incoming: &tonic::metadata::MetadataMap, message: T) -> Result<Request<T>, Status> {
        match &self.fleet {
            Some(fleet) => fleet.outgoing(tenant, incoming, message),
            None => Ok(Request::new(message)),
        }
    }

    /// Whether `id` names this node (or none): what is served here is stamped with this node.
    fn is_local(&self, id: &str) -> bool {
        crate::ids::node_of(id).is_none_or(|n| self.fleet.as_ref().is_none_or(|f| n == f.node()))
    }

    /// A sandbox served here, stamped with this node's name and address.
    fn stamp(&self, mut sandbox: pb::Sandbox) -> pb::Sandbox {
        if let Some(f) = &self.fleet {
            sandbox.node = f.node().to_string();
            sandbox.node_address = f.address().to_string();
        }
        sandbox
    }

    /// Reads a client stream's first message (within [`FIRST_MESSAGE_DEADLINE`]) and returns
    /// it with the stream it came from, the request's parts kept for the call made with it.
    async fn first<M: Send + 'static>(
        request: Request<tonic::Streaming<M>>,
        rpc: &str,
    ) -> Result<(tonic::metadata::MetadataMap, tonic::Extensions, M, Inbound<M>), Status> {
        let (metadata, extensions, stream) = request.into_parts();
        let mut stream: Inbound<M> = Box::pin(stream);
        let first = match tokio::time::timeout(FIRST_MESSAGE_DEADLINE, stream.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(status))) => return Err(status),
            Ok(None) => return Err(Status::invalid_argument(format!("{rpc}: the stream ended before its first message"))),
            Err(_) => return Err(Status::deadline_exceeded(format!("{rpc}: no first message within {} s", FIRST_MESSAGE_DEADLINE.as_secs()))),
        };
        Ok((metadata, extensions, first, stream))
    }

    /// A peer's stream, its errors naming the peer when the peer stopped answering.
    fn relay<T: Send + 'static>(peer: Peer, stream: tonic::Streaming<T>) -> Boxed<T> {
        Box::pin(stream.map(move |item| item.map_err(|s| peer.explain(s))))
    }

    /// What a client sends after the first message, to a peer: the messages until the stream
    /// ends. An error (the client broke off) ends what is sent without a clean end: the call
    /// is dropped with the client's, which resets the peer's stream, so an upload there is
    /// never taken for complete.
    fn onward<M: Send + 'static>(first: M, rest: Inbound<M>) -> impl Stream<Item = M> + Send + 'static {
        futures::stream::once(std::future::ready(first)).chain(futures::stream::unfold(rest, |mut rest| async move {
            match rest.next().await {
                Some(Ok(m)) => Some((m, rest)),
                // The client broke off: pend (never a clean end) until the call is dropped.
                Some(Err(_)) => futures::future::pending().await,
                None => None,
            }
        }))
    }

    /// Creates on a peer with room for `tier` (largest free room first), after this node said
    /// `local` (RESOURCE_EXHAUSTED, FAILED_PRECONDITION, or UNAVAILABLE while it drains).
    /// RESOURCE_EXHAUSTED naming what each node lacks when none has room.
    async fn place(
        &self,
        fleet: &Fleet,
        tenant: &str,
        metadata: &tonic::metadata::MetadataMap,
        req: pb::CreateSandboxRequest,
        local: Status,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let tier = crate::api::isolation_from_proto(req.isolation)?;
        let here = format!("{} (here): {}", fleet.node(), local.message());
        // The peers and their room as the last refresh found them, at most
        // `fleet.placement_cache_ms` ago; when that view has no room or its candidates are full
        // after all (a node may have come up or freed room since), DNS and every status are
        // asked again, once.
        let mut max_age = fleet.placement_cache();
        loop {
            let (view, cached) = fleet.placement_view(max_age).await;
            let (mut why, mut candidates) = candidates_for(view, tier, &here);
            candidates.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.name.cmp(&b.1.name)));
            for (_, peer) in candidates {
                let out = self.outgoing(tenant, metadata, req.clone())?;
                match peer.client().create_sandbox(out).await {
                    Ok(r) => {
                        fleet.placed(&peer);
                        tracing::info!(node = %peer.name, cached, "fleet: create placed on a peer");
                        return Ok(r);
                    }
                    // Another create took the room first, or the tier went away: the next one.
                    Err(s) if matches!(s.code(), tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition | tonic::Code::Unavailable) => {
                        // The view was older than this peer's room: the next placement asks again.
                        fleet.stale();
                        why.push(format!("{}: {}", peer.name, peer.explain(s).message()));
                    }
                    Err(s) => return Err(s),
                }
            }
            if cached {
                max_age = Duration::ZERO;
                continue;
            }
            return Err(Status::resource_exhausted(format!("no node of the fleet has room for this sandbox: {}", why.join("; "))));
        }
    }
}

/// The peers of `view` with room for `tier` (their free slots first), and why each other one
/// cannot take the sandbox (after `here`, this node's own reason).
fn candidates_for(view: Vec<(Peer, Result<pb::NodeStatus, Status>)>, tier: Option<Isolation>, here: &str) -> (Vec<String>, Vec<(u32, Peer)>) {
    let mut why = vec![here.to_string()];
    let mut candidates = Vec::new();
    for (peer, status) in view {
        match status {
            Ok(s) if !s.ready => why.push(format!("{}: not ready", peer.name)),
            Ok(s) => {
                // UNSPECIFIED: the peer's policy decides the tier; any room will do.
                let room = match tier {
                    Some(t) => room_for(&s, t),
                    None => s.tiers.iter().filter(|t| t.available).map(|t| t.free_sandboxes).max().filter(|n| *n > 0),
                };
                match room {
                    Some(free) => candidates.push((free, peer)),
                    None => why.push(format!("{}: {}", peer.name, short_of(&s, tier))),
                }
            }
            Err(e) => why.push(format!("{}: {}", peer.name, e.message())),
        }
    }
    (why, candidates)
}

/// The image lists of several nodes as one: an entry per name and digest, naming every node
/// that holds it (ready on a tier if it is on any node), sorted by name then digest.
fn merge_image_lists(lists: Vec<pb::ListImagesResponse>) -> Vec<pb::ImageInfo> {
    let mut merged: std::collections::BTreeMap<(String, String), pb::ImageInfo> = std::collections::BTreeMap::new();
    for image in lists.into_iter().flat_map(|l| l.images) {
        match merged.entry((image.name.clone(), image.digest.clone())) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(image);
            }
            std::collections::btree_map::Entry::Occupied(mut o) => {
                let have = o.get_mut();
                for node in image.nodes {
                    if !have.nodes.contains(&node) {
                        have.nodes.push(node);
                    }
                }
                for tier in image.ready_tiers {
                    if !have.ready_tiers.contains(&tier) {
                        have.ready_tiers.push(tier);
                    }
                }
            }
        }
    }
    merged
        .into_values()
        .map(|mut i| {
            i.nodes.sort();
            i.ready_tiers.sort();
            i
        })
        .collect()
}

/// What a node's status says it lacks for `tier`.
fn short_of(s: &pb::NodeStatus, tier: Option<Isolation>) -> String {
    let Some(tier) = tier else { return "no room in any tier".into() };
    let want = crate::api::isolation_to_proto(tier) as i32;
    match s.tiers.iter().find(|t| t.isolation == want) {
        Some(t) if !t.available => format!("{} unavailable: {}", tier.name(), t.reason),
        Some(_) => format!("no room for {} (policy.max_sandboxes)", tier.name()),
        None => format!("{} unknown", tier.name()),
    }
}

/// Unary calls about one id: served here or forwarded as they are.
macro_rules! by_id {
    ($self:ident, $request:ident, $method:ident, $id:expr) => {{
        let id: String = $id;
        match $self.route(&$request, &id).await? {
            None => $self.local.$method($request).await,
            Some((peer, tenant)) => {
                let (metadata, _, message) = $request.into_parts();
                let out = $self.outgoing(&tenant, &metadata, message)?;
                peer.client().$method(out).await.map_err(|s| peer.explain(s))
            }
        }
    }};
}

/// Server-streaming calls about one id: the local stream, or the peer's relayed.
macro_rules! stream_by_id {
    ($self:ident, $request:ident, $method:ident, $id:expr) => {{
        let id: String = $id;
        match $self.route(&$request, &id).await? {
            None => $self.local.$method($request).await,
            Some((peer, tenant)) => {
                let (metadata, _, message) = $request.into_parts();
                let out = $self.outgoing(&tenant, &metadata, message)?;
                let stream = peer.client().$method(out).await.map_err(|s| peer.explain(s))?.into_inner();
                Ok(Response::new(Routed::relay(peer, stream)))
            }
        }
    }};
}

/// Client-streaming calls whose first message names the sandbox.
macro_rules! upload {
    ($self:ident, $request:ident, $method:ident, $local:ident, $rpc:literal) => {{
        if $self.fleet.is_none() {
            return $self.local.$method($request).await;
        }
        let (metadata, extensions, first, rest) = Routed::first($request, $rpc).await?;
        let id = match &first.item {
            Some(pb::upload_request::Item::Header(h)) => h.sandbox_id.clone(),
            _ => String::new(),
        };
        let probe = Request::from_parts(metadata, extensions, ());
        match $self.route(&probe, &id).await? {
            None => {
                let (metadata, extensions, ()) = probe.into_parts();
                let inbound: Inbound<_> = Box::pin(futures::stream::once(std::future::ready(Ok(first))).chain(rest));
                $self.local.$local(Request::from_parts(metadata, extensions, inbound)).await
            }
            Some((peer, tenant)) => {
                let out = $self.outgoing(&tenant, probe.metadata(), Routed::onward(first, rest))?;
                peer.client().$method(out).await.map_err(|s| peer.explain(s))
            }
        }
    }};
}

#[tonic::async_trait]
impl SandboxService for Routed {
    async fn create_sandbox(&self, request: Request<pb::CreateSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let Some(fleet) = self.fleet.clone() else { return self.local.create_sandbox(request).await };
        // A fork is made where its snapshot is.
        let from = request.get_ref().from_snapshot_id.clone();
        if !from.is_empty() {
            let local = self.is_local(&from);
            let r = by_id!(self, request, create_sandbox, from)?;
            return Ok(if local { r.map(|s| self.stamp(s)) } else { r });
        }
        if fleet.is_from_peer(&request) {
            return self.local.create_sandbox(request).await.map(|r| r.map(|s| self.stamp(s)));
        }
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, req) = request.into_parts();
        // A tier this node's policy does not offer (`policy.allowed`: in a fleet, which nodes
        // run which tier) is a peer's to make, not a refusal.
        if let Ok(Some(tier)) = crate::api::isolation_from_proto(req.isolation) {
            if !fleet.offers(tier) {
                let here = Status::failed_precondition(format!("isolation {} is not allowed by this node's policy (policy.allowed)", tier.name()));
                return self.place(&fleet, &tenant, &metadata, req, here).await;
            }
        }
        match self.local.create_sandbox(Request::from_parts(metadata.clone(), extensions, req.clone())).await {
            Ok(r) => Ok(r.map(|s| self.stamp(s))),
            // No room here, not the tier, or this node is draining: a peer with room.
            Err(s) if matches!(s.code(), tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition | tonic::Code::Unavailable) => {
                self.place(&fleet, &tenant, &metadata, req, s).await
            }
            Err(s) => Err(s),
        }
    }

    async fn get_sandbox(&self, request: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let local = self.is_local(&id);
        let r = by_id!(self, request, get_sandbox, id)?;
        Ok(if local { r.map(|s| self.stamp(s)) } else { r })
    }

    async fn set_sandbox_ttl(&self, request: Request<pb::SetSandboxTtlRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let local = self.is_local(&id);
        let r = by_id!(self, request, set_sandbox_ttl, id)?;
        Ok(if local { r.map(|s| self.stamp(s)) } else { r })
    }

    async fn pause_sandbox(&self, request: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let local = self.is_local(&id);
        let r = by_id!(self, request, pause_sandbox, id)?;
        Ok(if local { r.map(|s| self.stamp(s)) } else { r })
    }

    async fn resume_sandbox(&self, request: Request<pb::ResumeSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let local = self.is_local(&id);
        let r = by_id!(self, request, resume_sandbox, id)?;
        Ok(if local { r.map(|s| self.stamp(s)) } else { r })
    }

    async fn get_network_log(&self, request: Request<pb::GetNetworkLogRequest>) -> Result<Response<pb::GetNetworkLogResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, get_network_log, id)
    }

    async fn list_sandboxes(&self, request: Request<pb::ListSandboxesRequest>) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let Some(fleet) = self.fleet.clone() else { return self.local.list_sandboxes(request).await };
        if fleet.is_from_peer(&request) {
            let mut r = self.local.list_sandboxes(request).await?;
            let stamped = std::mem::take(&mut r.get_mut().sandboxes).into_iter().map(|s| self.stamp(s)).collect();
            r.get_mut().sandboxes = stamped;
            return Ok(r);
        }
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, req) = request.into_parts();
        let (mine, theirs) = tokio::join!(
            self.local.list_sandboxes(Request::from_parts(metadata.clone(), extensions, req.clone())),
            fleet.list_on_peers(&tenant, &metadata, req, LIST_TIMEOUT)
        );
        let mut out = mine?.into_inner();
        out.sandboxes = out.sandboxes.into_iter().map(|s| self.stamp(s)).collect();
        for (peer, answer) in theirs {
            match answer {
                Ok(r) => out.sandboxes.extend(r.sandboxes),
                Err(e) => out.unreachable_nodes.push(pb::NodeError { node: peer.name.clone(), error: e.message().to_string() }),
            }
        }
        Ok(Response::new(out))
    }

    async fn destroy_sandbox(&self, request: Request<pb::DestroySandboxRequest>) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let destroyed = by_id!(self, request, destroy_sandbox, id.clone());
        // A peer has room again that the cached view (which counted the sandbox when it was
        // placed) does not show: the next placement asks every peer instead of filling another
        // node first.
        if destroyed.is_ok() && !self.is_local(&id) {
            if let Some(fleet) = &self.fleet {
                fleet.stale();
            }
        }
        destroyed
    }

    async fn exec(&self, request: Request<pb::ExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, exec, id)
    }

    type ExecStreamStream = Boxed<pb::ExecEvent>;

    async fn exec_stream(&self, request: Request<pb::ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        stream_by_id!(self, request, exec_stream, id)
    }

    async fn get_exec(&self, request: Request<pb::GetExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        let id = request.get_ref().exec_id.clone();
        by_id!(self, request, get_exec, id)
    }

    async fn signal_exec(&self, request: Request<pb::SignalExecRequest>) -> Result<Response<pb::SignalExecResponse>, Status> {
        let id = request.get_ref().exec_id.clone();
        by_id!(self, request, signal_exec, id)
    }

    async fn list_execs(&self, request: Request<pb::ListExecsRequest>) -> Result<Response<pb::ListExecsResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, list_execs, id)
    }

    async fn write_file(&self, request: Request<pb::WriteFileRequest>) -> Result<Response<pb::WriteFileResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, write_file, id)
    }

    async fn read_file(&self, request: Request<pb::ReadFileRequest>) -> Result<Response<pb::ReadFileResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, read_file, id)
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotInfo>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, snapshot, id)
    }

    async fn list_snapshots(&self, request: Request<pb::ListSnapshotsRequest>) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        by_id!(self, request, list_snapshots, id)
    }

    async fn rollback(&self, request: Request<pb::RollbackRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        let local = self.is_local(&id);
        let r = by_id!(self, request, rollback, id)?;
        Ok(if local { r.map(|s| self.stamp(s)) } else { r })
    }

    async fn delete_snapshot(&self, request: Request<pb::DeleteSnapshotRequest>) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let id = request.get_ref().snapshot_id.clone();
        by_id!(self, request, delete_snapshot, id)
    }

    type ExecSessionStream = Boxed<pb::ExecSessionEvent>;

    async fn exec_session(&self, request: Request<tonic::Streaming<pb::ExecSessionRequest>>) -> Result<Response<Self::ExecSessionStream>, Status> {
        use pb::exec_session_request::Item;
        if self.fleet.is_none() {
            return self.local.exec_session(request).await;
        }
        let (metadata, extensions, first, rest) = Routed::first(request, "ExecSession").await?;
        let id = match &first.item {
            Some(Item::Start(pb::ExecSessionStart { exec: Some(exec), .. })) => exec.sandbox_id.clone(),
            _ => String::new(),
        };
        let probe = Request::from_parts(metadata, extensions, ());
        match self.route(&probe, &id).await? {
            None => {
                let (metadata, extensions, ()) = probe.into_parts();
                let inbound: Inbound<_> = Box::pin(futures::stream::once(std::future::ready(Ok(first))).chain(rest));
                self.local.exec_session_from(Request::from_parts(metadata, extensions, inbound)).await
            }
            Some((peer, tenant)) => {
                let out = self.outgoing(&tenant, probe.metadata(), Routed::onward(first, rest))?;
                let stream = peer.client().exec_session(out).await.map_err(|s| peer.explain(s))?.into_inner();
                Ok(Response::new(Routed::relay(peer, stream)))
            }
        }
    }

    async fn upload_file(&self, request: Request<tonic::Streaming<pb::UploadRequest>>) -> Result<Response<pb::UploadFileResponse>, Status> {
        upload!(self, request, upload_file, upload_file_from, "UploadFile")
    }

    type DownloadFileStream = Boxed<pb::DownloadChunk>;

    async fn download_file(&self, request: Request<pb::DownloadRequest>) -> Result<Response<Self::DownloadFileStream>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        stream_by_id!(self, request, download_file, id)
    }

    async fn upload_archive(&self, request: Request<tonic::Streaming<pb::UploadRequest>>) -> Result<Response<pb::UploadArchiveResponse>, Status> {
        upload!(self, request, upload_archive, upload_archive_from, "UploadArchive")
    }

    type DownloadArchiveStream = Boxed<pb::DownloadChunk>;

    async fn download_archive(&self, request: Request<pb::DownloadRequest>) -> Result<Response<Self::DownloadArchiveStream>, Status> {
        let id = request.get_ref().sandbox_id.clone();
        stream_by_id!(self, request, download_archive, id)
    }

    // An image is usable on the node that imported it: imports, builds and removals a client
    // sends reach every node (see `fleet::images`). A list asks every node and says which
    // holds what (a node down during an import lacks that image); a get is answered here.
    async fn list_images(&self, request: Request<pb::ListImagesRequest>) -> Result<Response<pb::ListImagesResponse>, Status> {
        let Some(fleet) = self.fleet.clone() else { return self.local.list_images(request).await };
        let here = |mut list: pb::ListImagesResponse| {
            for image in &mut list.images {
                image.nodes = vec![fleet.node().to_string()];
            }
            list
        };
        if fleet.is_from_peer(&request) {
            return Ok(Response::new(here(self.local.list_images(request).await?.into_inner())));
        }
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, req) = request.into_parts();
        let (mine, theirs) = tokio::join!(
            self.local.list_images(Request::from_parts(metadata.clone(), extensions, req)),
            fleet.ask_every_peer(&tenant, &metadata, req, LIST_TIMEOUT, |mut c, r| async move { c.list_images(r).await })
        );
        let mut lists = vec![here(mine?.into_inner())];
        let mut unreachable = Vec::new();
        for (peer, answer) in theirs {
            match answer {
                Ok(r) => lists.push(r),
                Err(e) => unreachable.push(pb::NodeError { node: peer.name.clone(), error: e.message().to_string() }),
            }
        }
        Ok(Response::new(pb::ListImagesResponse { images: merge_image_lists(lists), unreachable_nodes: unreachable }))
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::ImageInfo>, Status> {
        self.local.get_image(request).await
    }

    async fn remove_image(&self, request: Request<pb::RemoveImageRequest>) -> Result<Response<pb::RemoveImageResponse>, Status> {
        let Some(fleet) = self.fleet.clone().filter(|f| !f.is_from_peer(&request)) else { return self.local.remove_image(request).await };
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, req) = request.into_parts();
        let removed = self.local.remove_image(Request::from_parts(metadata.clone(), extensions, req.clone())).await?;
        // Then every peer's copy; one that is gone already, or a peer that does not answer, is
        // logged (an image left on a node is only space: its next import replaces it).
        let removals = fleet.peers().into_iter().map(|peer| {
            let out = fleet.outgoing(&tenant, &metadata, req.clone());
            let name = req.name.clone();
            async move {
                let result = match out {
                    Ok(out) => peer.client().remove_image(out).await.map(drop),
                    Err(s) => Err(s),
                };
                match result {
                    Ok(()) => {}
                    Err(s) if s.code() == tonic::Code::NotFound => {}
                    Err(s) => tracing::warn!(node = %peer.name, error = %peer.explain(s).message(), image = %name, "fleet: removing an image on a peer"),
                }
            }
        });
        futures::future::join_all(removals).await;
        Ok(removed)
    }

    type ImportImageStream = <Api as SandboxService>::ImportImageStream;

    async fn import_image(&self, request: Request<tonic::Streaming<pb::ImportImageRequest>>) -> Result<Response<Self::ImportImageStream>, Status> {
        let Some(fleet) = self.fleet.clone().filter(|f| !f.is_from_peer(&request)) else { return self.local.import_image(request).await };
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, first, rest) = Routed::first(request, "ImportImage").await?;
        let local = &self.local;
        let parts = metadata.clone();
        let spool = fleet.spool_path();
        let events = super::images::everywhere(fleet, tenant, metadata, first, rest, spool, |inbound| async move {
            local.import_image_from(Request::from_parts(parts, extensions, inbound)).await.map(Response::into_inner)
        })
        .await?;
        Ok(Response::new(events))
    }

    type BuildImageStream = <Api as SandboxService>::BuildImageStream;

    async fn build_image(&self, request: Request<tonic::Streaming<pb::BuildImageRequest>>) -> Result<Response<Self::BuildImageStream>, Status> {
        let Some(fleet) = self.fleet.clone().filter(|f| !f.is_from_peer(&request)) else { return self.local.build_image(request).await };
        let tenant = self.auth.tenant(&request)?;
        let (metadata, extensions, first, rest) = Routed::first(request, "BuildImage").await?;
        let local = &self.local;
        let parts = metadata.clone();
        let spool = fleet.spool_path();
        let events = super::images::everywhere(fleet, tenant, metadata, first, rest, spool, |inbound| async move {
            local.build_image_from(Request::from_parts(parts, extensions, inbound)).await.map(Response::into_inner)
        })
        .await?;
        Ok(Response::new(events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(name: &str, digest: &str, node: &str, tiers: &[i32]) -> pb::ImageInfo {
        pb::ImageInfo { name: name.into(), digest: digest.into(), nodes: vec![node.into()], ready_tiers: tiers.to_vec(), ..Default::default() }
    }

    #[test]
    fn image_lists_merge_by_name_and_digest_naming_their_nodes() {
        let a = pb::ListImagesResponse {
            images: vec![image("app", "sha256:1", "node-a", &[1]), image("minimal", "sha256:m", "node-a", &[1, 2])],
            ..Default::default()
        };
        let b = pb::ListImagesResponse {
            images: vec![image("minimal", "sha256:m", "node-b", &[1, 3]), image("app", "sha256:2", "node-b", &[1])],
            ..Default::default()
        };
        let c = pb::ListImagesResponse { images: vec![image("minimal", "sha256:m", "node-c", &[1])], ..Default::default() };
        let merged = merge_image_lists(vec![c, a, b]);
        let view: Vec<(&str, &str, Vec<&str>, Vec<i32>)> =
            merged.iter().map(|i| (i.name.as_str(), i.digest.as_str(), i.nodes.iter().map(String::as_str).collect(), i.ready_tiers.clone())).collect();
        assert_eq!(
            view,
            vec![
                ("app", "sha256:1", vec!["node-a"], vec![1]),
                ("app", "sha256:2", vec!["node-b"], vec![1]),
                ("minimal", "sha256:m", vec!["node-a", "node-b", "node-c"], vec![1, 2, 3]),
            ]
        );
    }
}
