//! The fleet's peers from DNS: the A records of one name (a Kubernetes headless Service's, which
//! cluster DNS answers with one record per ready pod). Either through the system resolver (what
//! a pod's `/etc/resolv.conf` names) or by asking one server directly: over UDP, and again over
//! TCP when the UDP answer was truncated (a 512-byte answer holds 28 A records; a fleet has more).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

/// How long one query to a DNS server may take; it is tried twice.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest answer read over UDP (EDNS is not asked for, so servers keep to 512 bytes and set
/// TC past it; 4 KiB leaves room for servers that do not). Over TCP an answer is at most 64 KiB
/// (its two-byte length), about 4,000 A records.
const MAX_ANSWER: usize = 4096;

/// Why the peers could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("resolving {name}: {reason}")]
    Lookup { name: String, reason: String },
    #[error("resolving {name} at {server}: no answer within {} s (tried twice)", QUERY_TIMEOUT.as_secs())]
    Timeout { name: String, server: SocketAddr },
    #[error("resolving {name} at {server}: malformed answer: {reason}")]
    Malformed { name: String, server: SocketAddr, reason: &'static str },
    #[error("resolving {name} at {server}: the server answered rcode {rcode}")]
    Rcode { name: String, server: SocketAddr, rcode: u8 },
}

/// The addresses `name` resolves to, each with `port`, sorted and without duplicates.
pub async fn resolve(name: &str, port: u16, server: Option<SocketAddr>) -> Result<Vec<SocketAddr>, DnsError> {
    let mut addrs: Vec<SocketAddr> = match server {
        None => tokio::net::lookup_host((name, port)).await.map_err(|e| DnsError::Lookup { name: name.to_string(), reason: e.to_string() })?.collect(),
        Some(server) => query_a(name, server).await?.into_iter().map(|ip| SocketAddr::from((ip, port))).collect(),
    };
    addrs.sort();
    addrs.dedup();
    Ok(addrs)
}

/// Asks `server` for the A records of `name` over UDP.
async fn query_a(name: &str, server: SocketAddr) -> Result<Vec<Ipv4Addr>, DnsError> {
    let id: u16 = rand::random();
    let query = encode_query(id, name).ok_or_else(|| DnsError::Lookup { name: name.to_string(), reason: "not a DNS name".into() })?;
    let bind: SocketAddr = if server.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = tokio::net::UdpSocket::bind(bind).await.map_err(|e| DnsError::Lookup { name: name.to_string(), reason: e.to_string() })?;
    socket.connect(server).await.map_err(|e| DnsError::Lookup { name: name.to_string(), reason: format!("{server}: {e}") })?;
    let mut buf = vec![0u8; MAX_ANSWER];
    for _ in 0..2 {
        socket.send(&query).await.map_err(|e| DnsError::Lookup { name: name.to_string(), reason: format!("{server}: {e}") })?;
        let deadline = tokio::time::Instant::now() + QUERY_TIMEOUT;
        // Answers to other ids (a late answer to the first try) are skipped, not believed.
        while let Ok(got) = tokio::time::timeout_at(deadline, socket.recv(&mut buf)).await {
            let n = got.map_err(|e| DnsError::Lookup { name: name.to_string(), reason: format!("{server}: {e}") })?;
            match parse_answer(id, &buf[..n]) {
                // Truncated (TC): the whole answer over TCP.
                Ok(Some(_)) if truncated(&buf[..n]) => return query_a_tcp(name, server, id, &query).await,
                Ok(Some(ips)) => return Ok(ips),
                Ok(None) => continue,
                Err(Parse::Rcode(rcode)) => return Err(DnsError::Rcode { name: name.to_string(), server, rcode }),
                Err(Parse::Malformed(reason)) => return Err(DnsError::Malformed { name: name.to_string(), server, reason }),
            }
        }
    }
    Err(DnsError::Timeout { name: name.to_string(), server })
}

/// Whether an answer has its TC (truncated) bit set.
fn truncated(msg: &[u8]) -> bool {
    msg.get(2).is_some_and(|b| b & 0x02 != 0)
}

/// Asks `server` for `query` (id `id`) over TCP: the answer a truncated UDP one stood for.
async fn query_a_tcp(name: &str, server: SocketAddr, id: u16, query: &[u8]) -> Result<Vec<Ipv4Addr>, DnsError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = |e: std::io::Error| DnsError::Lookup { name: name.to_string(), reason: format!("{server} (TCP): {e}") };
    let asked = async {
        let mut stream = tokio::net::TcpStream::connect(server).await.map_err(io)?;
        let mut framed = Vec::with_capacity(query.len() + 2);
        framed.extend_from_slice(&(query.len() as u16).to_be_bytes());
        framed.extend_from_slice(query);
        stream.write_all(&framed).await.map_err(io)?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await.map_err(io)?;
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut msg).await.map_err(io)?;
        Ok::<_, DnsError>(msg)
    };
    let msg = tokio::time::timeout(QUERY_TIMEOUT, asked).await.map_err(|_| DnsError::Timeout { name: name.to_string(), server })??;
    match parse_answer(id, &msg) {
        Ok(Some(ips)) => Ok(ips),
        Ok(None) => Err(DnsError::Malformed { name: name.to_string(), server, reason: "a TCP answer to another query" }),
        Err(Parse::Rcode(rcode)) => Err(DnsError::Rcode { name: name.to_string(), server, rcode }),
        Err(Parse::Malformed(reason)) => Err(DnsError::Malformed { name: name.to_string(), server, reason }),
    }
}

/// A standard query (recursion desired) for the A records of `name`.
fn encode_query(id: u16, name: &str) -> Option<Vec<u8>> {
    let mut q = Vec::with_capacity(18 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return None;
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 || !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return None;
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    Some(q)
}

enum Parse {
    Rcode(u8),
    Malformed(&'static str),
}

/// The A records of an answer to query `id` (None: the answer is to another query). Every
/// length is checked against the message: an answer is bytes from the network.
fn parse_answer(id: u16, msg: &[u8]) -> Result<Option<Vec<Ipv4Addr>>, Parse> {
    let short = Parse::Malformed("truncated message");
    let u16_at = |i: usize| msg.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    let got_id = u16_at(0).ok_or(short)?;
    if got_id != id {
        return Ok(None);
    }
    let flags = u16_at(2).ok_or(Parse::Malformed("truncated message"))?;
    if flags & 0x8000 == 0 {
        return Ok(None);
    }
    let rcode = (flags & 0x000f) as u8;
    // NXDOMAIN for a headless Service without ready pods: no peers, not an error.
    if rcode == 3 {
        return Ok(Some(Vec::new()));
    }
    if rcode != 0 {
        return Err(Parse::Rcode(rcode));
    }
    let qd = u16_at(4).ok_or(Parse::Malformed("truncated message"))?;
    let an = u16_at(6).ok_or(Parse::Malformed("truncated message"))?;
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(msg, at)?;
        at += 4;
    }
    let mut ips = Vec::new();
    for _ in 0..an {
        at = skip_name(msg, at)?;
        let (rtype, class) = (u16_at(at).ok_or(Parse::Malformed("truncated record"))?, u16_at(at + 2).ok_or(Parse::Malformed("truncated record"))?);
        let len = usize::from(u16_at(at + 8).ok_or(Parse::Malformed("truncated record"))?);
        let data = msg.get(at + 10..at + 10 + len).ok_or(Parse::Malformed("record longer than the message"))?;
        if rtype == 1 && class == 1 {
            let octets: [u8; 4] = data.try_into().map_err(|_| Parse::Malformed("an A record that is not 4 bytes"))?;
            ips.push(Ipv4Addr::from(octets));
        }
        at += 10 + len;
    }
    Ok(Some(ips))
}

/// The offset after the (possibly compressed) name at `at`.
fn skip_name(msg: &[u8], mut at: usize) -> Result<usize, Parse> {
    // A name is at most 255 bytes: 128 labels bound the walk whatever the bytes say.
    for _ in 0..128 {
        let len = *msg.get(at).ok_or(Parse::Malformed("truncated name"))?;
        match len {
            0 => return Ok(at + 1),
            l if l & 0xc0 == 0xc0 => {
                msg.get(at + 1).ok_or(Parse::Malformed("truncated name"))?;
                return Ok(at + 2);
            }
            l if l & 0xc0 == 0 => at += 1 + usize::from(l),
            _ => return Err(Parse::Malformed("unknown label type")),
        }
    }
    Err(Parse::Malformed("name too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as a server makes it: the question echoed, then A records whose names point
    /// back at it.
    fn answer(id: u16, name: &str, ips: &[[u8; 4]]) -> Vec<u8> {
        let q = encode_query(id, name).expect("name");
        let mut m = q.clone();
        m[2] = 0x81;
        m[3] = 0x80;
        m[6..8].copy_from_slice(&(ips.len() as u16).to_be_bytes());
        for ip in ips {
            m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
            m.extend_from_slice(ip);
        }
        m
    }

    #[test]
    fn answers_give_their_a_records() {
        let m = answer(7, "peers.fleet.test", &[[10, 0, 0, 2], [10, 0, 0, 3]]);
        let ips = parse_answer(7, &m).ok().flatten().expect("parsed");
        assert_eq!(ips, vec![Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 3)]);
        assert!(matches!(parse_answer(8, &m), Ok(None)), "another query's answer is skipped");
    }

    #[test]
    fn hostile_answers_are_refused_not_believed() {
        let m = answer(7, "peers.fleet.test", &[[10, 0, 0, 2]]);
        for cut in 0..m.len() {
            // Every prefix either parses to fewer records or is refused; none panics.
            let _ = parse_answer(7, &m[..cut]);
        }
        let mut looped = answer(7, "a", &[]);
        looped[6..8].copy_from_slice(&1u16.to_be_bytes());
        looped.extend_from_slice(&[0xc0, 12]);
        assert!(parse_answer(7, &looped).is_err());
        let mut nx = answer(7, "a", &[]);
        nx[3] = 0x83;
        assert_eq!(parse_answer(7, &nx).ok().flatten(), Some(vec![]));
        assert!(encode_query(1, "bad name").is_none());
        assert!(encode_query(1, &"a".repeat(64)).is_none());
    }

    /// A server that answers UDP with the first 28 records and TC set, and TCP with all of them,
    /// as dnsmasq does for a headless Service of 1,000 pods.
    #[tokio::test]
    async fn a_truncated_udp_answer_is_asked_again_over_tcp() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("tcp");
        let server = tcp.local_addr().expect("addr");
        let udp = tokio::net::UdpSocket::bind(server).await.expect("udp on the same port");
        let ips: Vec<[u8; 4]> = (0..1000u32).map(|i| [10, 1, (i >> 8) as u8, i as u8]).collect();
        let all = ips.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, peer) = udp.recv_from(&mut buf).await.expect("udp query");
            let id = u16::from_be_bytes([buf[0], buf[1]]);
            let mut m = answer(id, "peers.fleet.test", &all[..28]);
            assert!(n > 12);
            m[2] |= 0x02;
            udp.send_to(&m, peer).await.expect("udp answer");
        });
        tokio::spawn(async move {
            let (mut s, _) = tcp.accept().await.expect("tcp query");
            let mut len = [0u8; 2];
            s.read_exact(&mut len).await.expect("len");
            let mut q = vec![0u8; usize::from(u16::from_be_bytes(len))];
            s.read_exact(&mut q).await.expect("query");
            let m = answer(u16::from_be_bytes([q[0], q[1]]), "peers.fleet.test", &ips);
            s.write_all(&(m.len() as u16).to_be_bytes()).await.expect("write");
            s.write_all(&m).await.expect("write");
        });
        let got = resolve("peers.fleet.test", 7070, Some(server)).await.expect("resolved");
        assert_eq!(got.len(), 1000, "all the peers, not the 28 a UDP answer holds");
    }
}
