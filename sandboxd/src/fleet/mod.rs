//! A fleet: several daemons behind one address (issue #27). Each daemon is a node with a name
//! ([`crate::ids::NodeName`], carried by every id it makes); its peers are the A records of one
//! DNS name (a headless Service's), resolved again every `refresh_ms` and at once when a call
//! names a node not yet known. A call that reaches a node for a sandbox, exec or snapshot of
//! another node is forwarded there in one hop ([`router`]); a create goes to a peer with room
//! when this node has none; a list fans out.
//!
//! Transport stays here, at the edge: the manager only makes ids with the node's name and
//! reports its room; it never knows that peers exist. Peers authenticate each other with the
//! fleet token, and a forwarded call names the tenant the first node authenticated
//! ([`crate::api::auth::FORWARDED_TENANT`]), which a node believes only next to that token.

pub mod dns;
pub mod images;
pub mod router;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sandbox_proto::v1 as pb;
use sandbox_proto::v1::fleet_service_client::FleetServiceClient;
use sandbox_proto::v1::sandbox_service_client::SandboxServiceClient;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::api::auth::FORWARDED_TENANT;
use crate::api::Auth;
use crate::config::FleetConfig;
use crate::manager::Manager;
use crate::model::Isolation;

/// Largest message either way on a forwarded call: the server's own bound.
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// How long a peer may take to answer GetNodeStatus once connected.
const STATUS_TIMEOUT: Duration = Duration::from_secs(3);

/// A peer as the last refresh found it.
#[derive(Clone)]
pub struct Peer {
    pub name: String,
    pub addr: SocketAddr,
    channel: Channel,
}

impl Peer {
    /// A status of a forwarded call made to name this node when the node itself did not
    /// answer (connection refused or timed out, a reset): UNAVAILABLE naming it. A node
    /// killed while our connection to it was open ends the call as CANCELLED (hyper's
    /// "operation was canceled"); no daemon answers a call it serves with CANCELLED (the
    /// caller is gone by then), so that is the node not answering too.
    pub fn explain(&self, status: Status) -> Status {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled if !status.message().starts_with("node ") => {
                Status::unavailable(format!("node {} ({}) did not answer: {}", self.name, self.addr, status.message()))
            }
            _ => status,
        }
    }

    /// A client of the peer's SandboxService.
    pub fn client(&self) -> SandboxServiceClient<Channel> {
        SandboxServiceClient::new(self.channel.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

/// What is known of the fleet.
#[derive(Default)]
struct Table {
    /// Peers by node name (this node excluded).
    by_name: HashMap<String, Peer>,
    /// One lazily connected channel per address, kept across refreshes.
    channels: HashMap<SocketAddr, Channel>,
    /// Why the last resolution failed, if it did.
    dns_error: Option<String>,
    /// Each address's answer to the last refresh's status call, and when that refresh ended:
    /// the placement's view while it is younger than `placement_cache` (see
    /// [`Fleet::placement_view`]).
    statuses: HashMap<SocketAddr, Result<pb::NodeStatus, Status>>,
    refreshed_at: Option<std::time::Instant>,
    /// Creates placed on peers so far ([`Fleet::placed`]): a refresh that one overlapped may
    /// hold a status asked before that create landed, so it leaves the view stale.
    placements: u64,
}

/// This node's view of the fleet.
pub struct Fleet {
    cfg: FleetConfig,
    auth: Arc<Auth>,
    manager: Arc<Manager>,
    table: RwLock<Table>,
    /// Serializes refreshes: a burst of calls naming an unknown node makes one, not many.
    refreshing: tokio::sync::Mutex<()>,
}

impl Fleet {
    /// This node of the fleet `cfg` describes.
    pub fn new(cfg: FleetConfig, auth: Arc<Auth>, manager: Arc<Manager>) -> Arc<Self> {
        Arc::new(Fleet { cfg, auth, manager, table: RwLock::default(), refreshing: tokio::sync::Mutex::new(()) })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        self.cfg.node.as_str()
    }

    /// How long a peer may take over its copy of an image (its own build's bound and more).
    pub fn image_copy_deadline(&self) -> Duration {
        self.manager.image_job_deadline()
    }

    /// Where an image upload is spooled for the peers.
    pub fn spool_path(&self) -> std::path::PathBuf {
        self.manager.image_upload_path()
    }

    /// How old the peers' room may be when a create is placed (`fleet.placement_cache_ms`).
    pub fn placement_cache(&self) -> Duration {
        self.cfg.placement_cache
    }

    /// This node's direct address.
    pub fn address(&self) -> &str {
        &self.cfg.address
    }

    /// Resolves the peers every `refresh_ms` (sooner after a failure) until `stop`.
    pub fn spawn_refresh(self: &Arc<Self>, stop: CancellationToken) {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let ok = me.refresh().await;
                let wait = if ok { me.cfg.refresh } else { me.cfg.refresh.min(Duration::from_secs(1)) };
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        });
    }

    /// Resolves `peers_dns` and asks every address who it is; returns whether DNS answered.
    pub async fn refresh(&self) -> bool {
        let _one = self.refreshing.lock().await;
        let addrs = match dns::resolve(&self.cfg.peers_dns, self.cfg.port, self.cfg.dns_server).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "fleet: cannot resolve the peers; keeping the last known ones");
                if let Ok(mut t) = self.table.write() {
                    t.dns_error = Some(e.to_string());
                }
                return false;
            }
        };
        let (channels, placements): (Vec<(SocketAddr, Channel)>, u64) = {
            let Ok(mut t) = self.table.write() else { return false };
            t.dns_error = None;
            t.channels.retain(|a, _| addrs.contains(a));
            (addrs.iter().filter_map(|a| self.channel(&mut t, *a).map(|c| (*a, c))).collect(), t.placements)
        };
        let asked =
            futures::future::join_all(channels.into_iter().map(|(addr, channel)| async move { (addr, channel.clone(), self.status_of(channel).await) })).await;
        let Ok(mut t) = self.table.write() else { return false };
        // A peer that did not answer keeps its place under its last known name (calls for its
        // sandboxes then say it did not answer); one whose address left DNS is forgotten.
        t.by_name.retain(|_, p| addrs.contains(&p.addr));
        t.statuses = asked.iter().map(|(addr, _, status)| (*addr, status.clone())).collect();
        // A create placed meanwhile may be missing from what a peer said (and its count in the
        // view is overwritten): the next placement asks again.
        t.refreshed_at = (t.placements == placements).then(std::time::Instant::now);
        for (addr, channel, status) in asked {
            match status {
                Ok(s) if s.node == self.node() => {}
                Ok(s) => {
                    if crate::ids::NodeName::parse(&s.node).is_err() {
                        tracing::warn!(%addr, node = %s.node.chars().take(80).collect::<String>(), "fleet: a peer reports a malformed node name; ignored");
                        continue;
                    }
                    t.by_name.retain(|_, p| p.addr != addr);
                    t.by_name.insert(s.node.clone(), Peer { name: s.node, addr, channel });
                }
                Err(e) => tracing::debug!(%addr, error = %e, "fleet: peer did not answer its status"),
            }
        }
        true
    }

    /// The lazily connected channel to `addr` (made once).
    fn channel(&self, t: &mut Table, addr: SocketAddr) -> Option<Channel> {
        if let Some(c) = t.channels.get(&addr) {
            return Some(c.clone());
        }
        let scheme = if self.cfg.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}")).ok()?;
        if let Some(tls) = &self.cfg.tls {
            let config = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&tls.ca_pem))
                .domain_name(tls.server_name.clone());
            endpoint = match endpoint.tls_config(config) {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "fleet: cannot set up TLS to a peer");
                    return None;
                }
            };
        }
        let endpoint = endpoint
            .connect_timeout(self.cfg.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .initial_stream_window_size(Some(1 << 20))
            .initial_connection_window_size(Some(4 << 20));
        let channel = endpoint.connect_lazy();
        t.channels.insert(addr, channel.clone());
        Some(channel)
    }

    async fn status_of(&self, channel: Channel) -> Result<pb::NodeStatus, Status> {
        let mut req = Request::new(pb::GetNodeStatusRequest {});
        self.sign(req.metadata_mut(), None)?;
        req.set_timeout(self.cfg.connect_timeout + STATUS_TIMEOUT);
        let mut client = FleetServiceClient::new(channel);
        match tokio::time::timeout(self.cfg.connect_timeout + STATUS_TIMEOUT, client.get_node_status(req)).await {
            Ok(r) => r.map(Response::into_inner),
            Err(_) => Err(Status::unavailable("no status within the deadline")),
        }
    }

    /// The peer named `node`; a node not known yet makes the peers be resolved again first.
    /// UNAVAILABLE naming the node when it is not among them.
    pub async fn peer(&self, node: &str) -> Result<Peer, Status> {
        if let Some(p) = self.known(node) {
            return Ok(p);
        }
        self.refresh().await;
        self.known(node).ok_or_else(|| {
            let dns = self.table.read().ok().and_then(|t| t.dns_error.clone()).map(|e| format!("; {e}")).unwrap_or_default();
            Status::unavailable(format!("node {node} is not among the fleet's reachable nodes (fleet.peers_dns = {}){dns}", self.cfg.peers_dns))
        })
    }

    fn known(&self, node: &str) -> Option<Peer> {
        self.table.read().ok()?.by_name.get(node).cloned()
    }

    /// Every peer known now.
    pub fn peers(&self) -> Vec<Peer> {
        let mut v: Vec<Peer> = self.table.read().map(|t| t.by_name.values().cloned().collect()).unwrap_or_default();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Each peer's status as a placement sees it: the last refresh's answers while they are
    /// younger than `max_age`, else a refresh now (DNS again, so a node that came up counts, and
    /// every status asked once, in parallel). A placed create that finds a peer full after all
    /// tries the next one and calls [`Fleet::stale`], so a cached view costs at most a retry.
    /// The second value says whether the view was cached (not asked for this call).
    pub async fn placement_view(&self, max_age: Duration) -> (Vec<(Peer, Result<pb::NodeStatus, Status>)>, bool) {
        let fresh = |t: &Table| t.refreshed_at.is_some_and(|at| at.elapsed() <= max_age);
        let cached = self.table.read().map(|t| fresh(&t)).unwrap_or(false);
        if !cached {
            self.refresh().await;
        }
        let Ok(t) = self.table.read() else { return (Vec::new(), cached) };
        let mut view: Vec<(Peer, Result<pb::NodeStatus, Status>)> = t
            .by_name
            .values()
            .map(|p| {
                let status = t.statuses.get(&p.addr).cloned().unwrap_or_else(|| Err(Status::unavailable("no status since it was last seen")));
                (p.clone(), status.map_err(|e| p.explain(e)))
            })
            .collect();
        view.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        (view, cached)
    }

    /// Counts a sandbox placed on `peer` in the cached view (its room is shared by its tiers),
    /// so a burst of placed creates spreads as it would with every status asked again.
    pub fn placed(&self, peer: &Peer) {
        if let Ok(mut t) = self.table.write() {
            t.placements += 1;
            if let Some(Ok(s)) = t.statuses.get_mut(&peer.addr) {
                for tier in &mut s.tiers {
                    tier.free_sandboxes = tier.free_sandboxes.saturating_sub(1);
                }
                s.sandboxes_held = s.sandboxes_held.saturating_add(1);
            }
        }
    }

    /// Forgets the cached statuses: the next placement asks every peer again.
    pub fn stale(&self) {
        if let Ok(mut t) = self.table.write() {
            t.refreshed_at = None;
        }
    }

    /// Each peer's status now (asked at once, in parallel).
    pub async fn statuses(&self) -> Vec<(Peer, Result<pb::NodeStatus, Status>)> {
        let peers = self.peers();
        futures::future::join_all(peers.into_iter().map(|p| async move {
            let s = self.status_of(p.channel.clone()).await.map_err(|s| p.explain(s));
            (p, s)
        }))
        .await
    }

    /// The request to send to a peer for `tenant`: `message` with the fleet token, the tenant
    /// and the caller's trace context (from `incoming`).
    pub fn outgoing<T>(&self, tenant: &str, incoming: &tonic::metadata::MetadataMap, message: T) -> Result<Request<T>, Status> {
        let mut out = Request::new(message);
        self.sign(out.metadata_mut(), Some(tenant))?;
        for key in ["traceparent", "tracestate"] {
            if let Some(v) = incoming.get(key) {
                out.metadata_mut().insert(key, v.clone());
            }
        }
        Ok(out)
    }

    /// The fan-out of a list: every peer asked for `tenant`'s sandboxes at once, each answer
    /// within `deadline` (a peer that does not answer in time is UNAVAILABLE naming it, so a
    /// node that is down never holds the list up). The gRPC `ListSandboxes` and the page's list
    /// both go through here.
    pub async fn list_on_peers(
        &self,
        tenant: &str,
        incoming: &tonic::metadata::MetadataMap,
        req: pb::ListSandboxesRequest,
        deadline: Duration,
    ) -> Vec<(Peer, Result<pb::ListSandboxesResponse, Status>)> {
        self.ask_every_peer(tenant, incoming, req, deadline, |mut c, r| async move { c.list_sandboxes(r).await }).await
    }

    /// `call` made on every known peer at once for `tenant` with `req`, each answer within
    /// `deadline` (one that does not answer in time is UNAVAILABLE naming it), each error
    /// explained by the peer's name.
    pub async fn ask_every_peer<Q, A, F, Fut>(
        &self,
        tenant: &str,
        incoming: &tonic::metadata::MetadataMap,
        req: Q,
        deadline: Duration,
        call: F,
    ) -> Vec<(Peer, Result<A, Status>)>
    where
        Q: Clone,
        F: Fn(SandboxServiceClient<Channel>, Request<Q>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<A>, Status>>,
    {
        let peers = self.peers();
        futures::future::join_all(peers.into_iter().map(|peer| {
            let out = self.outgoing(tenant, incoming, req.clone());
            let call = &call;
            async move {
                let answer = match out {
                    Err(e) => Err(e),
                    Ok(out) => match tokio::time::timeout(deadline, call(peer.client(), out)).await {
                        Ok(r) => r.map(Response::into_inner).map_err(|s| peer.explain(s)),
                        Err(_) => Err(Status::unavailable(format!("node {} ({}) did not answer within {} ms", peer.name, peer.addr, deadline.as_millis()))),
                    },
                };
                (peer, answer)
            }
        }))
        .await
    }

    /// Puts the fleet token and the caller's `tenant` on a call to a peer, so the peer serves
    /// it as that tenant's.
    pub fn sign(&self, metadata: &mut tonic::metadata::MetadataMap, tenant: Option<&str>) -> Result<(), Status> {
        let bearer =
            format!("Bearer {}", self.cfg.token.0).parse().map_err(|_| Status::internal("the fleet token is not a valid header value (fleet.token_file)"))?;
        metadata.insert("authorization", bearer);
        if let Some(t) = tenant {
            let value = t.parse().map_err(|_| Status::failed_precondition(format!("tenant {t:?} cannot be named to a peer (not a header value)")))?;
            metadata.insert(FORWARDED_TENANT, value);
        }
        Ok(())
    }

    /// Whether this node's policy lets it run `tier` (`policy.allowed`).
    pub fn offers(&self, tier: Isolation) -> bool {
        self.manager.tier_allowed(tier)
    }

    /// This node's status: its name, address, and room per tier.
    pub fn status(&self) -> pb::NodeStatus {
        let (held, max) = self.manager.room();
        let free = max.map_or(u32::MAX, |m| u32::try_from(m.saturating_sub(held)).unwrap_or(u32::MAX));
        let tiers = self
            .manager
            .tiers()
            .into_iter()
            .map(|(tier, availability)| {
                let (available, reason) = match availability {
                    Ok(()) if self.manager.tier_allowed(tier) => (true, String::new()),
                    Ok(()) => (false, "not allowed by policy (policy.allowed)".to_string()),
                    Err(r) => (false, r),
                };
                pb::TierCapacity { isolation: crate::api::isolation_to_proto(tier) as i32, available, free_sandboxes: if available { free } else { 0 }, reason }
            })
            .collect();
        // A draining node is not ready: placement passes it by.
        let key_metrics = crate::metrics::key_samples(&self.manager.render_metrics())
            .into_iter()
            .map(|m| pb::MetricSample { name: m.name, labels: m.labels, value: m.value })
            .collect();
        pb::NodeStatus {
            node: self.node().to_string(),
            address: self.address().to_string(),
            ready: !self.manager.is_draining(),
            tiers,
            sandboxes_held: u32::try_from(held).unwrap_or(u32::MAX),
            key_metrics,
        }
    }

    /// Whether a call comes from a peer (and so is served here, never forwarded again).
    fn is_from_peer<T>(&self, request: &Request<T>) -> bool {
        self.auth.from_fleet_peer(request.metadata().as_ref())
    }
}

/// The room a node reports for `tier`, if it can take one of it.
pub fn room_for(status: &pb::NodeStatus, tier: Isolation) -> Option<u32> {
    let want = crate::api::isolation_to_proto(tier) as i32;
    status.tiers.iter().find(|t| t.isolation == want && t.available && t.free_sandboxes > 0).map(|t| t.free_sandboxes)
}

/// `sandbox.v1.FleetService`: what peers ask each other.
pub struct FleetApi {
    fleet: Arc<Fleet>,
}

impl FleetApi {
    /// Serves `fleet`'s status to its peers.
    pub fn new(fleet: Arc<Fleet>) -> Self {
        FleetApi { fleet }
    }
}

#[tonic::async_trait]
impl pb::fleet_service_server::FleetService for FleetApi {
    async fn get_node_status(&self, request: Request<pb::GetNodeStatusRequest>) -> Result<Response<pb::NodeStatus>, Status> {
        if !self.fleet.is_from_peer(&request) {
            return Err(Status::unauthenticated("FleetService is for the fleet's nodes: present the fleet token"));
        }
        Ok(Response::new(self.fleet.status()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> Peer {
        let channel = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        Peer { name: "node-c".into(), addr: "127.0.0.1:1".parse().expect("addr"), channel }
    }

    #[tokio::test]
    async fn a_peer_that_did_not_answer_is_unavailable_naming_it() {
        let p = peer();
        // Refused, reset, and a connection cut while a call was on it (hyper's "canceled").
        for s in [Status::unavailable("connection refused"), Status::unknown("h2 protocol error"), Status::cancelled("operation was canceled")] {
            let e = p.explain(s);
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
            assert!(e.message().starts_with("node node-c (127.0.0.1:1) did not answer"), "{e}");
        }
        // What the node itself answered stays as it is, and a node's own wording is not wrapped twice.
        assert_eq!(p.explain(Status::not_found("sandbox sb-1")).code(), tonic::Code::NotFound);
        let own = p.explain(Status::unavailable("node node-b (10.0.0.2:7443) did not answer: refused"));
        assert!(own.message().starts_with("node node-b"), "{own}");
    }
}
