//! The two listeners nftables sends sandbox traffic to: the DNS server and the transparent
//! TCP proxy.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::pump::{pump, Activity};
use super::{decide, dns, http, tls, Egress, NetworkMode, Outcome, SandboxNet};
use std::sync::atomic::AtomicU64;

/// Queries answered at once (all sandboxes); more wait in the socket's buffer.
const DNS_IN_FLIGHT: usize = 128;
/// How long the daemon waits for its upstream, per try (two tries).
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// TTL handed out at most; the daemon remembers an answer this much longer than that.
const MAX_TTL: u32 = 300;
const REMEMBER_EXTRA: Duration = Duration::from_secs(300);

/// Answers sandboxes' DNS queries, forever.
pub(super) async fn serve_dns(e: Arc<Egress>, sock: Arc<UdpSocket>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(DNS_IN_FLIGHT));
    let mut buf = vec![0u8; dns::MAX_MESSAGE];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "egress DNS receive");
                continue;
            }
        };
        let SocketAddr::V4(peer) = peer else { continue };
        // Only a sandbox's own address (nftables checks the interface it came in on).
        let Some(net) = e.sandbox_at(*peer.ip()) else { continue };
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (e, sock, msg) = (e.clone(), sock.clone(), buf[..n].to_vec());
        tokio::spawn(async move {
            let _permit = permit;
            let started = Instant::now();
            let query = match dns::parse_query(&msg) {
                Ok(q) => q,
                Err(err) => {
                    let detail = err.to_string();
                    e.record(
                        &net,
                        "egress.dns",
                        &Outcome {
                            name: "",
                            addr: String::new(),
                            port: 0,
                            allowed: false,
                            rule: "",
                            detail: &detail,
                            bytes: (0, 0),
                            duration: started.elapsed(),
                        },
                    );
                    return;
                }
            };
            let reply = answer(&e, &net, &query, started).await;
            if let Err(err) = sock.send_to(&reply, SocketAddr::V4(peer)).await {
                tracing::debug!(sandbox = %net.id, error = %err, "egress DNS reply");
            }
        });
    }
}

async fn answer(e: &Egress, net: &SandboxNet, q: &dns::Query, started: Instant) -> Vec<u8> {
    let deny = |detail: String, rcode: u8| {
        e.record(
            net,
            "egress.dns",
            &Outcome { name: &q.name, addr: String::new(), port: 0, allowed: false, rule: "", detail: &detail, bytes: (0, 0), duration: started.elapsed() },
        );
        dns::response(q, rcode, &[])
    };
    if q.qtype != dns::TYPE_A && q.qtype != dns::TYPE_AAAA {
        return deny(format!("query type {} (only A and AAAA are answered)", q.qtype), dns::REFUSED);
    }
    let rule = match net.policy.mode {
        NetworkMode::Open => "open".to_string(),
        _ => match net.policy.name_rule(&q.name, None) {
            Some(r) => r.to_string(),
            None => return deny("no rule allows this name".into(), dns::REFUSED),
        },
    };
    if q.qtype == dns::TYPE_AAAA {
        // No IPv6 egress: an empty answer, so clients go on to A.
        return dns::response(q, dns::NOERROR, &[]);
    }
    match resolve(e.upstream, &q.name).await {
        Ok((rcode, addrs)) => {
            let addrs: Vec<(Ipv4Addr, u32)> = addrs.into_iter().map(|(a, ttl)| (a, ttl.min(MAX_TTL))).collect();
            net.remember(&q.name, &addrs, Duration::from_secs(MAX_TTL.into()) + REMEMBER_EXTRA);
            let shown = addrs.iter().map(|(a, _)| a.to_string()).collect::<Vec<_>>().join(",");
            let detail = if rcode == dns::NOERROR { String::new() } else { format!("upstream rcode {rcode}") };
            e.record(
                net,
                "egress.dns",
                &Outcome { name: &q.name, addr: shown, port: 0, allowed: true, rule: &rule, detail: &detail, bytes: (0, 0), duration: started.elapsed() },
            );
            dns::response(
                q,
                if rcode == dns::NXDOMAIN {
                    dns::NXDOMAIN
                } else if rcode == dns::NOERROR {
                    dns::NOERROR
                } else {
                    dns::SERVFAIL
                },
                &addrs,
            )
        }
        Err(err) => {
            tracing::warn!(sandbox = %net.id, name = %q.name, error = %err, "egress DNS upstream");
            e.record(
                net,
                "egress.dns",
                &Outcome { name: &q.name, addr: String::new(), port: 0, allowed: true, rule: &rule, detail: &err, bytes: (0, 0), duration: started.elapsed() },
            );
            dns::response(q, dns::SERVFAIL, &[])
        }
    }
}

/// Asks the upstream for `name`'s A records with a query of the daemon's own.
async fn resolve(upstream: SocketAddr, name: &str) -> Result<(u8, Vec<(Ipv4Addr, u32)>), String> {
    let sock = UdpSocket::bind("0.0.0.0:0").await.map_err(|e| format!("DNS client socket: {e}"))?;
    sock.connect(upstream).await.map_err(|e| format!("DNS upstream {upstream}: {e}"))?;
    let id: u16 = rand::random();
    let query = dns::a_query(id, name);
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        sock.send(&query).await.map_err(|e| format!("DNS upstream {upstream}: {e}"))?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                Err(_) => break,
                Ok(Err(e)) => return Err(format!("DNS upstream {upstream}: {e}")),
                Ok(Ok(n)) => match dns::parse_a_response(&buf[..n], id) {
                    Ok(r) => return Ok(r),
                    // Not ours (a late answer to the first try is fine too): keep waiting.
                    Err(_) => continue,
                },
            }
        }
    }
    Err(format!("DNS upstream {upstream}: no answer"))
}

/// Takes the sandboxes' TCP connections, forever.
pub(super) async fn serve_proxy(e: Arc<Egress>, listener: TcpListener) {
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(err) => {
                tracing::warn!(error = %err, "egress proxy accept");
                // EMFILE and friends: give the host a moment rather than spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer) = peer else { continue };
        let Some(net) = e.sandbox_at(*peer.ip()) else { continue };
        tokio::spawn(connection(e.clone(), net, client));
    }
}

/// Where the sandbox meant to connect, before nftables redirected it here.
fn original_dst(s: &TcpStream) -> Result<SocketAddrV4, String> {
    let raw = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::OriginalDst).map_err(|e| format!("SO_ORIGINAL_DST: {e}"))?;
    Ok(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(raw.sin_addr.s_addr)), u16::from_be(raw.sin_port)))
}

struct Active<'a>(&'a SandboxNet);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn connection(e: Arc<Egress>, net: Arc<SandboxNet>, client: TcpStream) {
    let started = Instant::now();
    let dst = match original_dst(&client) {
        Ok(d) => d,
        Err(err) => return tracing::warn!(sandbox = %net.id, error = %err, "egress proxy"),
    };
    let addr = dst.ip().to_string();
    let deny = |detail: &str, rule: &str, bytes: (u64, u64)| {
        e.record(
            &net,
            "egress.connect",
            &Outcome { name: "", addr: addr.clone(), port: dst.port(), allowed: false, rule, detail, bytes, duration: started.elapsed() },
        );
    };
    let (rule, tls_names) = match decide(&e, &net, dst) {
        Ok(d) => d,
        Err(why) => return deny(&why, "", (0, 0)),
    };
    let before = net.active.fetch_add(1, Ordering::SeqCst);
    let _active = Active(&net);
    if before >= e.max_connections {
        return deny(&format!("over network.max_connections ({})", e.max_connections), &rule, (0, 0));
    }
    let Ok(_slot) = e.all_connections.clone().try_acquire_owned() else {
        return deny(&format!("the daemon's proxy holds its limit of {} connections (all sandboxes together)", super::MAX_PROXIED_CONNECTIONS), &rule, (0, 0));
    };
    let server = match tokio::time::timeout(e.connect_timeout, TcpStream::connect(dst)).await {
        Ok(Ok(s)) => s,
        Ok(Err(err)) => return deny(&format!("connect: {err}"), &rule, (0, 0)),
        Err(_) => return deny("connect timed out", &rule, (0, 0)),
    };
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let activity = Arc::new(Activity::new());
    let inbound = Arc::new(AtomicU64::new(0));
    // The server may speak first (SSH, SMTP): its bytes flow at once; the client's first bytes
    // are held until they are known not to be a TLS hello or HTTP request for another name.
    let mut downstream = {
        let (net, activity, inbound) = (net.clone(), activity.clone(), inbound.clone());
        tokio::spawn(async move {
            let _ = pump(&mut sr, &mut cw, &net.rate_in, &activity, &inbound).await;
        })
    };
    // However this ends (a refusal, the idle deadline), the server's side goes with it.
    let _downstream_guard = AbortOnDrop(downstream.abort_handle());
    let idle = e.idle_timeout;
    let held = tokio::select! {
        r = first_bytes(&mut cr, tls_names.is_some(), &activity) => r,
        () = activity.idle_for(idle) => Err(format!("idle for network.idle_timeout_ms ({} ms) before its first request", idle.as_millis())),
    };
    let (first, sni, http_host) = match held {
        Ok(f) => f,
        Err(why) => return deny(&why, &rule, (0, inbound.load(Ordering::Relaxed))),
    };
    let is_tls = first.first() == Some(&0x16);
    let name = sni.clone().or(http_host.clone()).unwrap_or_default();
    if let Some(names) = &tls_names {
        let refusal = if is_tls && !sni.as_ref().is_some_and(|s| names.contains(s)) {
            Some(format!("TLS server name {:?} is not a name that resolved to this address ({})", sni.unwrap_or_default(), names.join(",")))
        } else if http_host.as_ref().is_some_and(|h| !names.contains(h)) {
            Some(format!("HTTP Host {:?} is not a name that resolved to this address ({})", http_host.unwrap_or_default(), names.join(",")))
        } else {
            None
        };
        if let Some(detail) = refusal {
            return e.record(
                &net,
                "egress.connect",
                &Outcome { name: &name, addr, port: dst.port(), allowed: false, rule: &rule, detail: &detail, bytes: (0, 0), duration: started.elapsed() },
            );
        }
    }
    let names = tls_names.map(|n| n.join(",")).unwrap_or_default();
    let shown = if name.is_empty() { names.as_str() } else { name.as_str() };
    let outbound = AtomicU64::new(0);
    let up = async {
        if !first.is_empty() {
            net.rate_out.take(first.len()).await;
            sw.write_all(&first).await?;
            outbound.fetch_add(first.len() as u64, Ordering::Relaxed);
        }
        pump(&mut cr, &mut sw, &net.rate_out, &activity, &outbound).await?;
        // The server's side ends on its own (or by the idle deadline).
        let _ = (&mut downstream).await;
        Ok::<(), std::io::Error>(())
    };
    let detail = tokio::select! {
        r = up => match r {
            Ok(()) => String::new(),
            Err(err) => format!("ended by an error: {err}"),
        },
        () = activity.idle_for(idle) => format!("idle for network.idle_timeout_ms ({} ms): closed", idle.as_millis()),
    };
    e.record(
        &net,
        "egress.connect",
        &Outcome {
            name: shown,
            addr,
            port: dst.port(),
            allowed: true,
            rule: &rule,
            detail: &detail,
            bytes: (outbound.load(Ordering::Relaxed), inbound.load(Ordering::Relaxed)),
            duration: started.elapsed(),
        },
    );
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The first request of a connection (the server's bytes flow meanwhile).
type FirstBytes = (Vec<u8>, Option<String>, Option<String>);

/// Reads the client's first bytes until they are known to be a TLS ClientHello (with its server
/// name), an HTTP/1 request head (with its host), or something else; the end of the client's
/// stream ends it too. When names are checked (an allow-list name rule), a handshake or request
/// head that cannot be read is refused.
async fn first_bytes(cr: &mut tokio::net::tcp::OwnedReadHalf, names_checked: bool, activity: &Activity) -> Result<FirstBytes, String> {
    let mut first = Vec::with_capacity(2048);
    let mut chunk = vec![0u8; 4096];
    loop {
        if !first.is_empty() {
            match tls::client_hello(&first) {
                tls::Hello::ClientHello { sni } => return Ok((first, sni, None)),
                tls::Hello::Malformed if names_checked => return Err("a TLS handshake that is no readable ClientHello".into()),
                tls::Hello::Malformed => return Ok((first, None, None)),
                tls::Hello::Partial { .. } => {}
                tls::Hello::NotTls => match http::request_head(&first) {
                    http::Head::NotHttp => return Ok((first, None, None)),
                    http::Head::Request { host } => return Ok((first, None, host)),
                    http::Head::Malformed if names_checked => {
                        return Err(format!("an HTTP request head that cannot be read (over {} bytes, or not text)", http::MAX_HEAD))
                    }
                    http::Head::Malformed => return Ok((first, None, None)),
                    http::Head::Partial => {}
                },
            }
        }
        match cr.read(&mut chunk).await {
            Ok(0) | Err(_) => return Ok((first, None, None)),
            Ok(n) => {
                activity.touch();
                first.extend_from_slice(&chunk[..n]);
            }
        }
    }
}
