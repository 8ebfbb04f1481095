//! The DNS wire format, as little of it as the daemon's resolver needs: one question in, A
//! records out. Hand-written (RFC 1035 §4) rather than a DNS library: the daemon never relays a
//! sandbox's bytes upstream; it reads a name, decides, asks its upstream a fresh question of its
//! own and builds the answer itself, so a query can carry nothing out but an allowed name.

use std::net::Ipv4Addr;

/// Record types the daemon knows by name.
pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
const CLASS_IN: u16 = 1;

/// Response codes.
pub const NOERROR: u8 = 0;
pub const SERVFAIL: u8 = 2;
pub const NXDOMAIN: u8 = 3;
pub const REFUSED: u8 = 5;

/// Largest message read or written (plain UDP DNS).
pub const MAX_MESSAGE: usize = 512;

/// One question from a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    pub recursion_desired: bool,
    /// Lowercase, no trailing dot; empty for the root.
    pub name: String,
    pub qtype: u16,
    /// The question section as sent, echoed in the answer.
    question: Vec<u8>,
}

/// Why a message was not a query we answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed DNS message: {0}")]
pub struct Malformed(pub &'static str);

/// Reads a name at `pos` (no compression: a query has nothing to point at). Returns the name
/// and the offset after it. Labels must be hostname labels: anything else (binary, over 63
/// bytes) is refused before it is looked at twice.
fn read_plain_name(buf: &[u8], mut pos: usize) -> Result<(String, usize), Malformed> {
    let mut name = String::new();
    loop {
        let len = *buf.get(pos).ok_or(Malformed("name runs past the end"))? as usize;
        pos += 1;
        if len == 0 {
            return Ok((name, pos));
        }
        if len > 63 {
            return Err(Malformed("label longer than 63 bytes or compressed"));
        }
        let label = buf.get(pos..pos + len).ok_or(Malformed("label runs past the end"))?;
        if !label.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_') {
            return Err(Malformed("label is not a hostname label"));
        }
        if !name.is_empty() {
            name.push('.');
        }
        name.push_str(&String::from_utf8_lossy(label).to_ascii_lowercase());
        if name.len() > 253 {
            return Err(Malformed("name longer than 253 bytes"));
        }
        pos += len;
    }
}

/// Parses a query: a standard query (opcode 0) with exactly one question of class IN.
pub fn parse_query(buf: &[u8]) -> Result<Query, Malformed> {
    if buf.len() < 12 {
        return Err(Malformed("shorter than a header"));
    }
    let id = u16::from_be_bytes([buf[0], buf[1]]);
    let flags = u16::from_be_bytes([buf[2], buf[3]]);
    if flags & 0x8000 != 0 || (flags >> 11) & 0xf != 0 {
        return Err(Malformed("not a standard query"));
    }
    let count = |i: usize| u16::from_be_bytes([buf[i], buf[i + 1]]);
    if count(4) != 1 || count(6) != 0 || count(8) != 0 {
        return Err(Malformed("not exactly one question"));
    }
    let (name, end) = read_plain_name(buf, 12)?;
    let fixed = buf.get(end..end + 4).ok_or(Malformed("question runs past the end"))?;
    let qtype = u16::from_be_bytes([fixed[0], fixed[1]]);
    if u16::from_be_bytes([fixed[2], fixed[3]]) != CLASS_IN {
        return Err(Malformed("class is not IN"));
    }
    Ok(Query { id, recursion_desired: flags & 0x0100 != 0, name, qtype, question: buf[12..end + 4].to_vec() })
}

/// The answer to `q`: `rcode` and, for NOERROR, A records (pointing at the question's name).
pub fn response(q: &Query, rcode: u8, answers: &[(Ipv4Addr, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + q.question.len() + answers.len() * 16);
    out.extend_from_slice(&q.id.to_be_bytes());
    // QR, RD as asked, RA, the code.
    let flags: u16 = 0x8000 | if q.recursion_desired { 0x0100 } else { 0 } | 0x0080 | u16::from(rcode & 0xf);
    out.extend_from_slice(&flags.to_be_bytes());
    let n = if rcode == NOERROR { answers.len().min(32) } else { 0 };
    for c in [1u16, n as u16, 0, 0] {
        out.extend_from_slice(&c.to_be_bytes());
    }
    out.extend_from_slice(&q.question);
    for (addr, ttl) in answers.iter().take(n) {
        out.extend_from_slice(&[0xc0, 0x0c]);
        out.extend_from_slice(&TYPE_A.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&4u16.to_be_bytes());
        out.extend_from_slice(&addr.octets());
    }
    out
}

/// A query of our own for `name`'s A records, to send upstream.
pub fn a_query(id: u16, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(18 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes());
    for c in [1u16, 0, 0, 0] {
        out.extend_from_slice(&c.to_be_bytes());
    }
    for label in name.split('.').filter(|l| !l.is_empty()) {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&TYPE_A.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out
}

/// Skips a (possibly compressed) name at `pos`; the offset after it.
fn skip_name(buf: &[u8], mut pos: usize) -> Result<usize, Malformed> {
    for _ in 0..128 {
        let len = *buf.get(pos).ok_or(Malformed("name runs past the end"))?;
        match len {
            0 => return Ok(pos + 1),
            l if l & 0xc0 == 0xc0 => return Ok(pos + 2),
            l if l & 0xc0 != 0 => return Err(Malformed("reserved label type")),
            l => pos += 1 + l as usize,
        }
    }
    Err(Malformed("too many labels"))
}

/// The upstream's answer to [`a_query`] `id`: its code and the A records of its answer section.
pub fn parse_a_response(buf: &[u8], id: u16) -> Result<(u8, Vec<(Ipv4Addr, u32)>), Malformed> {
    if buf.len() < 12 || u16::from_be_bytes([buf[0], buf[1]]) != id || buf[2] & 0x80 == 0 {
        return Err(Malformed("not the answer to our query"));
    }
    let rcode = buf[3] & 0xf;
    let count = |i: usize| u16::from_be_bytes([buf[i], buf[i + 1]]);
    let (qd, an) = (count(4), count(6));
    let mut pos = 12;
    for _ in 0..qd {
        pos = skip_name(buf, pos)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        pos = skip_name(buf, pos)?;
        let rr = buf.get(pos..pos + 10).ok_or(Malformed("record runs past the end"))?;
        let (rtype, class) = (u16::from_be_bytes([rr[0], rr[1]]), u16::from_be_bytes([rr[2], rr[3]]));
        let ttl = u32::from_be_bytes([rr[4], rr[5], rr[6], rr[7]]);
        let len = u16::from_be_bytes([rr[8], rr[9]]) as usize;
        let data = buf.get(pos + 10..pos + 10 + len).ok_or(Malformed("record data runs past the end"))?;
        if rtype == TYPE_A && class == CLASS_IN && len == 4 {
            addrs.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        pos += 10 + len;
    }
    Ok((rcode, addrs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_round_trips_through_parse_and_response() {
        let q = parse_query(&a_query(0x1234, "PyPI.test")).expect("query");
        assert_eq!((q.id, q.name.as_str(), q.qtype, q.recursion_desired), (0x1234, "pypi.test", TYPE_A, true));
        let resp = response(&q, NOERROR, &[(Ipv4Addr::new(198, 18, 0, 2), 30)]);
        let (rcode, addrs) = parse_a_response(&resp, 0x1234).expect("response");
        assert_eq!((rcode, addrs), (NOERROR, vec![(Ipv4Addr::new(198, 18, 0, 2), 30)]));
        let refused = response(&q, REFUSED, &[(Ipv4Addr::new(1, 2, 3, 4), 1)]);
        assert_eq!(parse_a_response(&refused, 0x1234).expect("response"), (REFUSED, vec![]));
    }

    #[test]
    fn odd_queries_are_refused_before_anything_else() {
        let mut long = a_query(1, "x.test");
        long[12] = 64;
        assert!(parse_query(&long).is_err());
        let mut binary = a_query(1, "x.test");
        binary[13] = 0xff;
        assert!(parse_query(&binary).is_err());
        let mut two = a_query(1, "x.test");
        two[5] = 2;
        assert!(parse_query(&two).is_err());
        assert!(parse_query(&[0; 11]).is_err());
        let mut truncated = a_query(1, "x.test");
        truncated.truncate(truncated.len() - 2);
        assert!(parse_query(&truncated).is_err());
    }
}
