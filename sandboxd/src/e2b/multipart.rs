//! A streaming `multipart/form-data` reader (RFC 7578) for envd's `POST /files`: parts come out
//! as they arrive, so a 50 MiB upload is never whole in memory. Bounded: headers of a part at
//! most [`MAX_HEADER_BYTES`], the preamble at most [`MAX_PREAMBLE_BYTES`]; a part's body is held
//! only up to one delimiter's length past what has been handed out.

use bytes::{Buf, Bytes, BytesMut};

/// Most bytes of one part's headers.
pub const MAX_HEADER_BYTES: usize = 16 << 10;
/// Most bytes before the first delimiter.
const MAX_PREAMBLE_BYTES: usize = 64 << 10;
/// Longest boundary RFC 2046 allows.
const MAX_BOUNDARY: usize = 70;

/// What is wrong with a multipart body.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MultipartError {
    #[error("multipart boundary missing or longer than {MAX_BOUNDARY} bytes")]
    BadBoundary,
    #[error("multipart part headers longer than {MAX_HEADER_BYTES} bytes")]
    HeadersTooLong,
    #[error("multipart preamble longer than {MAX_PREAMBLE_BYTES} bytes, or no delimiter")]
    NoDelimiter,
    #[error("multipart part without a Content-Disposition form-data header")]
    NoDisposition,
    #[error("multipart body ended before its closing delimiter")]
    Truncated,
    #[error("malformed multipart delimiter line")]
    BadDelimiter,
}

/// One thing the reader found.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A part begins: its form field name and file name (if any).
    Part { name: String, filename: Option<String> },
    /// Bytes of the current part's body.
    Data(Bytes),
    /// The current part ended.
    PartEnd,
}

enum St {
    Preamble,
    AfterDelimiter,
    Headers,
    Body,
    Done,
}

/// The reader: [`Reader::feed`] bytes as they arrive, take [`Reader::next`] events until it
/// returns `None`, and call [`Reader::finish`] at the end of the body.
pub struct Reader {
    /// `\r\n--boundary`.
    delimiter: Vec<u8>,
    buf: BytesMut,
    st: St,
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Result<String, MultipartError> {
    let b = content_type
        .split(';')
        .skip(1)
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .ok_or(MultipartError::BadBoundary)?;
    if b.is_empty() || b.len() > MAX_BOUNDARY {
        return Err(MultipartError::BadBoundary);
    }
    Ok(b)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl Reader {
    pub fn new(boundary: &str) -> Self {
        let mut buf = BytesMut::new();
        // The first delimiter may open the body without a CRLF before it.
        buf.extend_from_slice(b"\r\n");
        Reader { delimiter: [b"\r\n--", boundary.as_bytes()].concat(), buf, st: St::Preamble }
    }

    pub fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next event, `Ok(None)` when more bytes are needed (or the body is complete).
    pub fn next(&mut self) -> Result<Option<Event>, MultipartError> {
        loop {
            match self.st {
                St::Preamble => match find(&self.buf, &self.delimiter) {
                    Some(i) => {
                        self.buf.advance(i + self.delimiter.len());
                        self.st = St::AfterDelimiter;
                    }
                    None if self.buf.len() > MAX_PREAMBLE_BYTES => return Err(MultipartError::NoDelimiter),
                    None => return Ok(None),
                },
                St::AfterDelimiter => {
                    if self.buf.len() < 2 {
                        return Ok(None);
                    }
                    if self.buf.starts_with(b"--") {
                        self.st = St::Done;
                        continue;
                    }
                    // Transport padding (spaces, tabs) may follow the boundary before its CRLF.
                    let Some(eol) = find(&self.buf, b"\r\n") else {
                        return if self.buf.len() > MAX_BOUNDARY { Err(MultipartError::BadDelimiter) } else { Ok(None) };
                    };
                    if self.buf[..eol].iter().any(|&b| b != b' ' && b != b'\t') {
                        return Err(MultipartError::BadDelimiter);
                    }
                    self.buf.advance(eol + 2);
                    self.st = St::Headers;
                }
                St::Headers => {
                    let Some(end) = find(&self.buf, b"\r\n\r\n") else {
                        return if self.buf.len() > MAX_HEADER_BYTES { Err(MultipartError::HeadersTooLong) } else { Ok(None) };
                    };
                    if end > MAX_HEADER_BYTES {
                        return Err(MultipartError::HeadersTooLong);
                    }
                    let headers = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                    self.buf.advance(end + 4);
                    self.st = St::Body;
                    return parse_disposition(&headers).map(Some);
                }
                St::Body => {
                    if let Some(i) = find(&self.buf, &self.delimiter) {
                        if i > 0 {
                            return Ok(Some(Event::Data(self.buf.split_to(i).freeze())));
                        }
                        self.buf.advance(self.delimiter.len());
                        self.st = St::AfterDelimiter;
                        return Ok(Some(Event::PartEnd));
                    }
                    // All but what could be the start of a delimiter is the part's.
                    let keep = self.delimiter.len() - 1;
                    if self.buf.len() > keep {
                        let n = self.buf.len() - keep;
                        return Ok(Some(Event::Data(self.buf.split_to(n).freeze())));
                    }
                    return Ok(None);
                }
                St::Done => return Ok(None),
            }
        }
    }

    /// Whether the body ended where it should: after the closing delimiter.
    pub fn finish(&self) -> Result<(), MultipartError> {
        match self.st {
            St::Done => Ok(()),
            _ => Err(MultipartError::Truncated),
        }
    }
}

/// The name and file name of a part, from its `Content-Disposition`.
fn parse_disposition(headers: &str) -> Result<Event, MultipartError> {
    let line = headers
        .split("\r\n")
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case("content-disposition")).map(|(_, v)| v.trim().to_string()))
        .ok_or(MultipartError::NoDisposition)?;
    let param = |key: &str| {
        line.split(';').skip(1).filter_map(|p| p.trim().split_once('=')).find(|(k, _)| k.trim().eq_ignore_ascii_case(key)).map(|(_, v)| {
            let v = v.trim();
            v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v).replace("\\\"", "\"")
        })
    };
    Ok(Event::Part { name: param("name").unwrap_or_default(), filename: param("filename") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> Vec<u8> {
        b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XyX world\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b\"\r\n\r\n\r\n--XyZ--\r\n".to_vec()
    }

    type Parts = Vec<(Option<String>, Vec<u8>)>;

    /// Feeds `body` in pieces of `step` bytes and collects the parts.
    fn parts(body: &[u8], step: usize) -> Result<Parts, MultipartError> {
        let mut r = Reader::new("XyZ");
        let mut out: Vec<(Option<String>, Vec<u8>)> = Vec::new();
        for piece in body.chunks(step) {
            r.feed(piece);
            while let Some(e) = r.next()? {
                match e {
                    Event::Part { filename, .. } => out.push((filename, Vec::new())),
                    Event::Data(d) => out.last_mut().expect("inside a part").1.extend_from_slice(&d),
                    Event::PartEnd => {}
                }
            }
        }
        r.finish()?;
        Ok(out)
    }

    #[test]
    fn parts_come_out_whole_whatever_the_piece_size() {
        for step in [1, 2, 3, 7, 64, 4096] {
            let p = parts(&body(), step).expect("parses");
            assert_eq!(p.len(), 2, "step {step}");
            assert_eq!(p[0], (Some("/tmp/a.txt".into()), b"hello\r\n--XyX world".to_vec()), "a near-delimiter stays data (step {step})");
            assert_eq!(p[1], (Some("b".into()), Vec::new()), "an empty part (step {step})");
        }
    }

    #[test]
    fn a_cut_body_and_long_headers_are_refused() {
        let b = body();
        assert_eq!(parts(&b[..b.len() - 8], 16), Err(MultipartError::Truncated));
        let mut long = b"--XyZ\r\n".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_HEADER_BYTES + 10));
        assert_eq!(parts(&long, 1024), Err(MultipartError::HeadersTooLong));
        assert_eq!(boundary("multipart/form-data; boundary=\"abc\"").as_deref(), Ok("abc"));
        assert_eq!(boundary("multipart/form-data"), Err(MultipartError::BadBoundary));
    }
}
