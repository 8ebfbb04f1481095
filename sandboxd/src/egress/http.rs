//! The `Host` of a plain HTTP/1 request, read from the first bytes a sandbox sends: under an
//! allow list, a request over plain HTTP must name (in `Host`, or in a `CONNECT` target) a name
//! that resolved to the address it goes to, as TLS must in its server name. Only the first
//! request of a connection is read; the caps and audit line cover the rest.

/// Most bytes of a request head read before giving up on finding its end.
pub const MAX_HEAD: usize = 16 << 10;

const METHODS: [&str; 9] = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE"];

/// What the first bytes of a connection say about HTTP.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// Not an HTTP/1 request: some other protocol.
    NotHttp,
    /// The start of a request whose head has not ended yet: read more.
    Partial,
    /// A request head, with the host it names (lowercase, no port, no trailing dot), if any.
    Request { host: Option<String> },
    /// A request head longer than [`MAX_HEAD`], or not text.
    Malformed,
}

/// Looks at the first bytes a client sent.
pub fn request_head(buf: &[u8]) -> Head {
    let method_end = buf.iter().position(|&b| b == b' ');
    let method = &buf[..method_end.unwrap_or(buf.len())];
    let known = METHODS.iter().any(|m| if method_end.is_some() { m.as_bytes() == method } else { m.as_bytes().starts_with(method) });
    if !known || method.is_empty() {
        return Head::NotHttp;
    }
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD { Head::Malformed } else { Head::Partial };
    };
    let Ok(head) = std::str::from_utf8(&buf[..end]) else { return Head::Malformed };
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (verb, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Head::NotHttp;
    }
    let host = if verb == "CONNECT" {
        Some(target)
    } else {
        lines.filter_map(|l| l.split_once(':')).find(|(k, _)| k.trim().eq_ignore_ascii_case("host")).map(|(_, v)| v.trim())
    };
    Head::Request { host: host.map(normalize).filter(|h| !h.is_empty()) }
}

/// `Example.com.:8080` → `example.com`; `[v6]:port` stays bracketed (never a name).
fn normalize(authority: &str) -> String {
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next().unwrap_or(authority)
    } else {
        authority.rsplit_once(':').map(|(h, _)| h).unwrap_or(authority)
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_read_from_complete_heads_only() {
        assert_eq!(request_head(b"GET / HTTP/1.1\r\nHost: PyPI.test:8080\r\nAccept: */*\r\n\r\n"), Head::Request { host: Some("pypi.test".into()) });
        assert_eq!(request_head(b"GET / HTTP/1.1\r\nhost:evil.test.\r\n\r\nbody"), Head::Request { host: Some("evil.test".into()) });
        assert_eq!(request_head(b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n"), Head::Request { host: Some("evil.test".into()) });
        assert_eq!(request_head(b"GET / HTTP/1.0\r\n\r\n"), Head::Request { host: None });
        assert_eq!(request_head(b"GET / HTTP/1.1\r\nHost: a"), Head::Partial);
        assert_eq!(request_head(b"GE"), Head::Partial);
        assert_eq!(request_head(b"SSH-2.0-OpenSSH\r\n"), Head::NotHttp);
        assert_eq!(request_head(b"\x16\x03\x01"), Head::NotHttp);
        assert_eq!(request_head(b"GET /a b c\r\n\r\n"), Head::NotHttp);
        let mut long = b"GET / HTTP/1.1\r\nX: ".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        assert_eq!(request_head(&long), Head::Malformed);
        assert_eq!(request_head(b"GET / HTTP/1.1\r\nHost: \xff\r\n\r\n"), Head::Malformed);
    }
}
