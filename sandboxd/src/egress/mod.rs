//! Egress under policy: what a sandbox's network may reach, enforced by the daemon.
//!
//! A process sandbox with mode ALLOWLIST or OPEN gets an `eth0` (a veth pair, see [`link`])
//! whose only way out is the daemon: nftables redirects every TCP connection to the daemon's
//! transparent proxy and every UDP/53 query to its DNS server, and drops everything else. The
//! DNS server answers only names the policy allows, with addresses it asked its upstream for
//! itself; the proxy lets a connection through only to an address that one of those names
//! resolved to (on the rule's port), or to an allowed CIDR — and for TLS only when the
//! ClientHello's server name is such a name too. The host, link-local (metadata), other
//! sandboxes and the operator's denied ranges are refused in every mode. Every query and
//! connection is an audit line and a counter. Mode NONE adds nothing: loopback only.
//!
//! The manager never knows this exists: the process and container backends call
//! [`Egress::attach`] once the sandbox's network namespace is there, the microVM backend
//! [`Egress::attach_tap`] before each QEMU of the sandbox starts (a TAP device instead of a veth,
//! held by QEMU's virtio-net; the guest agent configures the VM's side), and all call
//! [`Egress::detach`] when it stops.

pub mod dns;
mod http;
pub mod link;
mod proxy;
mod pump;
pub mod tls;

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, Opts};
use serde::Serialize;

use crate::audit::AuditLog;
pub use crate::config::NetworkConfig;
pub use crate::netpolicy as rules;
pub use rules::{AllowRule, Cidr, NetworkMode, NetworkPolicy};

/// A sandbox's link and what it has been told by DNS.
struct SandboxNet {
    id: String,
    tenant: String,
    policy: NetworkPolicy,
    slot: u32,
    addr: Ipv4Addr,
    /// Addresses handed out by the daemon's DNS, and the names they were for, until when.
    resolved: Mutex<HashMap<Ipv4Addr, Vec<(String, Instant)>>>,
    active: AtomicU32,
    /// Its bandwidth caps, shared by all its connections: sandbox to world, and back.
    rate_out: pump::RateLimit,
    rate_in: pump::RateLimit,
    /// The last [`LOG_EVENTS`] queries and connections, for `GetNetworkLog`.
    log: Mutex<std::collections::VecDeque<NetEvent>>,
}

/// Every sandbox link is a /30: the host end, the sandbox's end.
pub const LINK_PREFIX: u8 = 30;

/// A microVM's link: the TAP device's descriptor (for QEMU) and what the guest is to configure.
#[derive(Debug)]
pub struct TapLink {
    pub fd: std::os::fd::OwnedFd,
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
}

/// Events kept per sandbox for `GetNetworkLog` (the audit log keeps them all).
pub const LOG_EVENTS: usize = 256;

/// One DNS query or connection attempt, as `GetNetworkLog` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetEvent {
    pub time: std::time::SystemTime,
    /// "dns" or "connect".
    pub kind: &'static str,
    pub name: String,
    pub addr: String,
    pub port: u16,
    pub allowed: bool,
    pub rule: String,
    pub detail: String,
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub duration_ms: u64,
}

impl SandboxNet {
    /// The names (still valid) that resolved to `addr` for this sandbox.
    fn names_for(&self, addr: Ipv4Addr) -> Vec<String> {
        let now = Instant::now();
        self.resolved
            .lock()
            .map(|m| m.get(&addr).map(|v| v.iter().filter(|(_, t)| *t > now).map(|(n, _)| n.clone()).collect()).unwrap_or_default())
            .unwrap_or_default()
    }

    fn remember(&self, name: &str, addrs: &[(Ipv4Addr, u32)], keep: Duration) {
        let Ok(mut m) = self.resolved.lock() else { return };
        let now = Instant::now();
        // Bounded: expired entries go whenever something is added.
        m.retain(|_, v| {
            v.retain(|(_, t)| *t > now);
            !v.is_empty()
        });
        if m.len() > 4096 {
            return;
        }
        for (a, _) in addrs {
            let v = m.entry(*a).or_default();
            v.retain(|(n, _)| n != name);
            v.push((name.to_string(), now + keep));
        }
    }
}

#[derive(Default)]
struct Table {
    by_addr: HashMap<Ipv4Addr, Arc<SandboxNet>>,
    by_id: HashMap<String, Arc<SandboxNet>>,
    slots: BTreeSet<u32>,
}

struct Counters {
    connections: IntCounterVec,
    queries: IntCounterVec,
    bytes: IntCounterVec,
}

/// Proxied connections the daemon holds at once, all sandboxes together (two descriptors each,
/// well inside the descriptor budget the daemon raises its limit to at start).
pub(crate) const MAX_PROXIED_CONNECTIONS: usize = 4096;

/// The daemon's egress filter: DNS server, proxy, and the table of sandbox links.
pub struct Egress {
    subnet: Cidr,
    names: link::Names,
    /// The listeners' ports, for the table (installed at the first attach: a daemon whose
    /// sandboxes have no network changes nothing on the host).
    ports: Mutex<Option<(u16, u16)>>,
    table_installed: tokio::sync::Mutex<bool>,
    deny: Vec<Cidr>,
    upstream: SocketAddr,
    max_connections: u32,
    /// Proxied connections of all sandboxes together: each holds two of the daemon's descriptors,
    /// so one tenant's many sandboxes cannot spend the descriptors every other call needs.
    all_connections: Arc<tokio::sync::Semaphore>,
    connect_timeout: Duration,
    /// A proxied connection that moves no byte either way for this long is closed.
    idle_timeout: Duration,
    /// Bytes per second each way per sandbox (0: no cap).
    bandwidth: u64,
    /// Why sandboxes cannot have a network on this host, if they cannot.
    unavailable: Mutex<Option<String>>,
    table: Mutex<Table>,
    audit: Arc<AuditLog>,
    counters: Counters,
}

/// One line of the audit log for a query or a connection.
#[derive(Debug, Serialize)]
struct NetAudit<'a> {
    tenant: &'a str,
    rpc: &'a str,
    sandbox_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    addr: &'a str,
    #[serde(skip_serializing_if = "is_zero")]
    port: u16,
    verdict: &'a str,
    rule: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    detail: &'a str,
    bytes_out: u64,
    bytes_in: u64,
    duration_ms: u64,
    status: &'a str,
}

fn is_zero(p: &u16) -> bool {
    *p == 0
}

/// What a connection or query came to.
pub(crate) struct Outcome<'a> {
    pub name: &'a str,
    pub addr: String,
    pub port: u16,
    pub allowed: bool,
    pub rule: &'a str,
    pub detail: &'a str,
    pub bytes: (u64, u64),
    pub duration: Duration,
}

fn first_nameserver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .find(|a| a.is_ipv4())
        .map(|a| SocketAddr::new(a, 53))
}

impl Egress {
    /// Checks the configuration, registers the counters and, where the host allows, starts the
    /// DNS server and proxy and installs the nftables table. A host without the tools or the
    /// privileges gets an `Egress` that refuses every attach with the reason.
    pub async fn start(cfg: &NetworkConfig, audit: Arc<AuditLog>, registry: &prometheus::Registry) -> Result<Arc<Egress>, String> {
        let subnet: Cidr = cfg.subnet.parse().map_err(|e| format!("network.subnet: {e}"))?;
        if subnet.prefix > 29 {
            return Err(format!("network.subnet {subnet}: too small (at least a /29)"));
        }
        let names = link::Names::new(&cfg.interface_prefix)?;
        let deny = cfg.deny_ranges()?;
        let upstream = cfg.upstream_dns.or_else(first_nameserver).unwrap_or(SocketAddr::from(([127, 0, 0, 1], 53)));
        let counters = Counters {
            connections: IntCounterVec::new(Opts::new("egress_connections_total", "Sandbox connections through the egress proxy, by verdict"), &["verdict"])
                .map_err(|e| e.to_string())?,
            queries: IntCounterVec::new(Opts::new("egress_dns_queries_total", "Sandbox DNS queries, by verdict"), &["verdict"]).map_err(|e| e.to_string())?,
            bytes: IntCounterVec::new(Opts::new("egress_bytes_total", "Bytes through the egress proxy, by direction"), &["direction"])
                .map_err(|e| e.to_string())?,
        };
        for c in [&counters.connections, &counters.queries, &counters.bytes] {
            registry.register(Box::new(c.clone())).map_err(|e| format!("registering egress metrics: {e}"))?;
        }
        let egress = Arc::new(Egress {
            subnet,
            names,
            ports: Mutex::new(None),
            table_installed: tokio::sync::Mutex::new(false),
            deny,
            upstream,
            max_connections: cfg.max_connections.max(1),
            all_connections: Arc::new(tokio::sync::Semaphore::new(MAX_PROXIED_CONNECTIONS)),
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.max(1)),
            idle_timeout: Duration::from_millis(cfg.idle_timeout_ms.max(1)),
            bandwidth: cfg.bandwidth_bytes_per_sec,
            unavailable: Mutex::new(None),
            table: Mutex::new(Table::default()),
            audit,
            counters,
        });
        if let Err(reason) = egress.clone().serve().await {
            tracing::warn!(%reason, "sandbox networks (ALLOWLIST, OPEN) unavailable");
            if let Ok(mut u) = egress.unavailable.lock() {
                *u = Some(reason);
            }
        } else {
            tracing::info!(subnet = %subnet, upstream_dns = %upstream, "egress filter ready");
        }
        Ok(egress)
    }

    async fn serve(self: Arc<Self>) -> Result<(), String> {
        link::tools_present()?;
        let udp = tokio::net::UdpSocket::bind("0.0.0.0:0").await.map_err(|e| format!("binding the DNS socket: {e}"))?;
        let tcp = tokio::net::TcpListener::bind("0.0.0.0:0").await.map_err(|e| format!("binding the proxy: {e}"))?;
        let dns_port = udp.local_addr().map_err(|e| e.to_string())?.port();
        let proxy_port = tcp.local_addr().map_err(|e| e.to_string())?.port();
        if let Ok(mut p) = self.ports.lock() {
            *p = Some((proxy_port, dns_port));
        }
        tracing::info!(dns_port, proxy_port, table = %self.names.table, "egress listeners");
        tokio::spawn(proxy::serve_dns(self.clone(), Arc::new(udp)));
        tokio::spawn(proxy::serve_proxy(self, tcp));
        Ok(())
    }

    /// Why networks cannot be given here, if they cannot.
    pub fn unavailable(&self) -> Option<String> {
        self.unavailable.lock().ok().and_then(|u| u.clone())
    }

    /// Gives sandbox `id`'s network namespace (that of process `pid`) a link under `policy`.
    /// Returns the address of its DNS server (its gateway) for /etc/resolv.conf.
    pub async fn attach(&self, id: &str, tenant: &str, policy: &NetworkPolicy, pid: i32) -> Result<Ipv4Addr, String> {
        let net = self.reserve(id, tenant, policy).await?;
        let gw = self.gateway_of(&net);
        let (slot, addr, names) = (net.slot, net.addr, self.names.clone());
        let linked = tokio::task::spawn_blocking(move || link::attach(&names, slot, pid, gw, addr)).await.map_err(|e| e.to_string()).and_then(|r| r);
        if let Err(e) = linked {
            self.forget(id);
            return Err(format!("giving sandbox {id} its network: {e}"));
        }
        tracing::info!(sandbox = id, mode = policy.mode.name(), addr = %addr, interface = %self.names.ifname(slot), "sandbox network attached");
        Ok(gw)
    }

    /// Gives sandbox `id` (a microVM) a TAP device under `policy`, held by the descriptor
    /// returned (QEMU's virtio-net backend): the device, and with it the link, goes when the
    /// last holder closes it. The guest configures its side as [`TapLink`] says.
    pub async fn attach_tap(&self, id: &str, tenant: &str, policy: &NetworkPolicy) -> Result<TapLink, String> {
        let net = self.reserve(id, tenant, policy).await?;
        let gw = self.gateway_of(&net);
        let (slot, addr, names) = (net.slot, net.addr, self.names.clone());
        let linked = tokio::task::spawn_blocking(move || link::attach_tap(&names, slot, gw, addr)).await.map_err(|e| e.to_string()).and_then(|r| r);
        match linked {
            Ok(fd) => {
                tracing::info!(sandbox = id, mode = policy.mode.name(), addr = %addr, interface = %self.names.ifname(slot), "sandbox network attached (TAP)");
                Ok(TapLink { fd, address: addr, prefix_len: LINK_PREFIX, gateway: gw })
            }
            Err(e) => {
                self.forget(id);
                Err(format!("giving sandbox {id} its network: {e}"))
            }
        }
    }

    /// Takes a slot of the subnet for sandbox `id`, installing the table first if need be.
    async fn reserve(&self, id: &str, tenant: &str, policy: &NetworkPolicy) -> Result<Arc<SandboxNet>, String> {
        if let Some(reason) = self.unavailable() {
            return Err(format!("network mode {} unavailable: {reason}", policy.mode.name()));
        }
        self.install_table().await?;
        let slots = (self.subnet.size() / 4) as u32;
        let mut t = self.table.lock().map_err(|_| "egress table poisoned".to_string())?;
        if t.by_id.contains_key(id) {
            return Err(format!("sandbox {id} already has a network"));
        }
        let slot = (0..slots).find(|s| !t.slots.contains(s)).ok_or_else(|| format!("network.subnet {} is full ({slots} sandboxes)", self.subnet))?;
        let net = Arc::new(SandboxNet {
            id: id.to_string(),
            tenant: tenant.to_string(),
            policy: policy.clone(),
            slot,
            addr: self.subnet.nth(slot * 4 + 2),
            resolved: Mutex::new(HashMap::new()),
            active: AtomicU32::new(0),
            rate_out: pump::RateLimit::new(self.bandwidth),
            rate_in: pump::RateLimit::new(self.bandwidth),
            log: Mutex::new(std::collections::VecDeque::new()),
        });
        t.slots.insert(slot);
        t.by_addr.insert(net.addr, net.clone());
        t.by_id.insert(id.to_string(), net.clone());
        Ok(net)
    }

    /// The host end of a slot's /30: the sandbox's gateway and nameserver.
    fn gateway_of(&self, net: &SandboxNet) -> Ipv4Addr {
        self.subnet.nth(net.slot * 4 + 1)
    }

    /// Installs the nftables table once (replacing one a previous run left).
    async fn install_table(&self) -> Result<(), String> {
        let mut installed = self.table_installed.lock().await;
        if *installed {
            return Ok(());
        }
        let (proxy_port, dns_port) = self.ports.lock().ok().and_then(|p| *p).ok_or("the egress listeners are not running")?;
        let names = self.names.clone();
        tokio::task::spawn_blocking(move || link::install_table(&names, proxy_port, dns_port)).await.map_err(|e| e.to_string())??;
        tracing::info!(table = %self.names.table, proxy_port, dns_port, "egress nftables table installed");
        *installed = true;
        Ok(())
    }

    fn forget(&self, id: &str) -> Option<Arc<SandboxNet>> {
        let mut t = self.table.lock().ok()?;
        let net = t.by_id.remove(id)?;
        t.by_addr.remove(&net.addr);
        t.slots.remove(&net.slot);
        Some(net)
    }

    /// Takes sandbox `id`'s link away; nothing if it has none.
    pub async fn detach(&self, id: &str) {
        if let Some(net) = self.forget(id) {
            let (slot, addr, names) = (net.slot, net.addr, self.names.clone());
            let _ = tokio::task::spawn_blocking(move || link::detach(&names, slot, addr)).await;
        }
    }

    /// Sandbox `id`'s most recent `limit` events (0: all kept), oldest first; none without a
    /// network.
    pub fn recent(&self, id: &str, limit: usize) -> Vec<NetEvent> {
        let Some(net) = self.table.lock().ok().and_then(|t| t.by_id.get(id).cloned()) else { return Vec::new() };
        let Ok(log) = net.log.lock() else { return Vec::new() };
        let skip = if limit == 0 { 0 } else { log.len().saturating_sub(limit) };
        log.iter().skip(skip).cloned().collect()
    }

    fn sandbox_at(&self, addr: Ipv4Addr) -> Option<Arc<SandboxNet>> {
        self.table.lock().ok()?.by_addr.get(&addr).cloned()
    }

    fn record(&self, net: &SandboxNet, rpc: &str, o: &Outcome<'_>) {
        let verdict = if o.allowed { "allowed" } else { "denied" };
        self.audit.record_value(&NetAudit {
            tenant: &net.tenant,
            rpc,
            sandbox_id: &net.id,
            name: o.name,
            addr: &o.addr,
            port: o.port,
            verdict,
            rule: o.rule,
            detail: o.detail,
            bytes_out: o.bytes.0,
            bytes_in: o.bytes.1,
            duration_ms: crate::audit::millis(o.duration),
            status: if o.allowed { "OK" } else { "PERMISSION_DENIED" },
        });
        if let Ok(mut log) = net.log.lock() {
            if log.len() >= LOG_EVENTS {
                log.pop_front();
            }
            log.push_back(NetEvent {
                time: std::time::SystemTime::now(),
                kind: if rpc == "egress.dns" { "dns" } else { "connect" },
                name: o.name.to_string(),
                addr: o.addr.clone(),
                port: o.port,
                allowed: o.allowed,
                rule: o.rule.to_string(),
                detail: o.detail.to_string(),
                bytes_out: o.bytes.0,
                bytes_in: o.bytes.1,
                duration_ms: crate::audit::millis(o.duration),
            });
        }
        if rpc == "egress.dns" {
            self.counters.queries.with_label_values(&[verdict]).inc();
        } else {
            self.counters.connections.with_label_values(&[verdict]).inc();
            self.counters.bytes.with_label_values(&["out"]).inc_by(o.bytes.0);
            self.counters.bytes.with_label_values(&["in"]).inc_by(o.bytes.1);
        }
        tracing::debug!(sandbox = %net.id, rpc, name = o.name, addr = %o.addr, port = o.port, verdict, rule = o.rule, detail = o.detail, "egress");
    }

    /// The host's own IPv4 addresses, now.
    fn host_addrs() -> Vec<Ipv4Addr> {
        match nix::ifaddrs::getifaddrs() {
            Ok(addrs) => addrs.filter_map(|a| a.address.and_then(|s| s.as_sockaddr_in().map(|s| s.ip()))).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "listing the host's addresses");
                Vec::new()
            }
        }
    }
}

/// Whether the proxy lets `net` reach `dst`: Ok(rule, names to hold TLS to) or Err(reason).
fn decide(e: &Egress, net: &SandboxNet, dst: SocketAddrV4) -> Result<(String, Option<Vec<String>>), String> {
    if let Some(why) = rules::always_denied(*dst.ip(), &Egress::host_addrs(), &e.subnet, &e.deny) {
        return Err(why);
    }
    match net.policy.mode {
        NetworkMode::None => Err("mode NONE".into()),
        NetworkMode::Open => Ok(("open".into(), None)),
        NetworkMode::Allowlist => {
            if let Some(r) = net.policy.cidr_rule(*dst.ip(), dst.port()) {
                return Ok((r.to_string(), None));
            }
            let names: Vec<String> = net.names_for(*dst.ip()).into_iter().filter(|n| net.policy.name_rule(n, Some(dst.port())).is_some()).collect();
            match names.first().and_then(|n| net.policy.name_rule(n, Some(dst.port()))) {
                Some(r) => Ok((r.to_string(), Some(names))),
                None => Err("no rule allows this address and port (not resolved from an allowed name)".into()),
            }
        }
    }
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress").field("subnet", &self.subnet).field("upstream", &self.upstream).finish_non_exhaustive()
    }
}
