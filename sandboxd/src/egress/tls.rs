//! The server name (SNI) of a TLS ClientHello, read from the first record a sandbox sends.

/// What the first bytes of a connection say about TLS.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// Not a TLS handshake record: a plain protocol.
    NotTls,
    /// A handshake record that is not complete yet: read more (up to `need` bytes in all).
    Partial { need: usize },
    /// A ClientHello, with its server name if it has one.
    ClientHello { sni: Option<String> },
    /// A handshake record that is no ClientHello we can read.
    Malformed,
}

/// Largest TLS record: 16 KiB of payload and the 5-byte header.
pub const MAX_RECORD: usize = 16_384 + 5;

/// Looks at the first bytes a client sent.
pub fn client_hello(buf: &[u8]) -> Hello {
    if buf.first() != Some(&0x16) {
        return Hello::NotTls;
    }
    if buf.len() < 5 {
        return Hello::Partial { need: 5 };
    }
    let need = 5 + u16::from_be_bytes([buf[3], buf[4]]) as usize;
    if buf[1] != 3 || need > MAX_RECORD {
        return Hello::Malformed;
    }
    if buf.len() < need {
        return Hello::Partial { need };
    }
    parse(&buf[5..need]).unwrap_or(Hello::Malformed)
}

fn parse(hs: &[u8]) -> Option<Hello> {
    let mut r = Reader { buf: hs, pos: 0 };
    if r.u8()? != 1 {
        return None;
    }
    let len = r.u24()?;
    let body = r.take(len)?;
    let mut r = Reader { buf: body, pos: 0 };
    r.take(2 + 32)?;
    let sid = r.u8()? as usize;
    r.take(sid)?;
    let suites = r.u16()? as usize;
    r.take(suites)?;
    let comp = r.u8()? as usize;
    r.take(comp)?;
    if r.pos == body.len() {
        return Some(Hello::ClientHello { sni: None });
    }
    let ext_len = r.u16()? as usize;
    let mut exts = Reader { buf: r.take(ext_len)?, pos: 0 };
    while exts.pos < exts.buf.len() {
        let (ty, len) = (exts.u16()?, exts.u16()? as usize);
        let data = exts.take(len)?;
        if ty == 0 {
            let mut d = Reader { buf: data, pos: 0 };
            let list = d.u16()? as usize;
            let mut l = Reader { buf: d.take(list)?, pos: 0 };
            while l.pos < l.buf.len() {
                let (kind, n) = (l.u8()?, l.u16()? as usize);
                let name = l.take(n)?;
                if kind == 0 {
                    let name = std::str::from_utf8(name).ok()?;
                    return Some(Hello::ClientHello { sni: Some(name.trim_end_matches('.').to_ascii_lowercase()) });
                }
            }
        }
    }
    Some(Hello::ClientHello { sni: None })
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.buf.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u24(&mut self) -> Option<usize> {
        self.take(3).map(|b| (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello with `sni`.
    fn hello(sni: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let mut entry = vec![0u8];
            entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
            entry.extend_from_slice(name.as_bytes());
            let mut data = (entry.len() as u16).to_be_bytes().to_vec();
            data.extend_from_slice(&entry);
            exts.extend_from_slice(&0u16.to_be_bytes());
            exts.extend_from_slice(&(data.len() as u16).to_be_bytes());
            exts.extend_from_slice(&data);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0, (body.len() >> 8) as u8, body.len() as u8];
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn reads_the_server_name() {
        assert_eq!(client_hello(&hello(Some("PyPI.test"))), Hello::ClientHello { sni: Some("pypi.test".into()) });
        assert_eq!(client_hello(&hello(None)), Hello::ClientHello { sni: None });
        let full = hello(Some("a.test"));
        assert_eq!(client_hello(&full[..10]), Hello::Partial { need: full.len() });
        assert_eq!(client_hello(b"GET / HTTP/1.1\r\n"), Hello::NotTls);
        let mut bad = full.clone();
        bad[5] = 2;
        assert_eq!(client_hello(&bad), Hello::Malformed);
    }
}
