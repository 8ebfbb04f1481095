//! Stock gRPC clients on the UNIX socket: an `:authority` the HTTP/2 server would refuse is
//! replaced by `localhost` before the server reads it.
//!
//! gRPC's C core (Python's grpcio, and so most agent frameworks), grpc-java and Bazel name a
//! `unix:` target's authority after the socket path, percent-encoded (`tmp%2Fs.sock`). The `h2`
//! server parses `:authority` as a URI authority, finds `%` outside an IPv6 literal invalid, and
//! resets the stream with PROTOCOL_ERROR (hyperium/h2 PR 487, still open), so every call of such a
//! client fails unless its user knows to set `grpc.default_authority`. On a UNIX socket the
//! authority names nothing anyway (the socket is the destination), so the daemon normalizes it.
//!
//! [`FixAuthority`] wraps each accepted UNIX connection and rewrites the client-to-server byte
//! stream at the HTTP/2 frame level: frames pass through untouched except header blocks (HEADERS
//! plus CONTINUATION), which are HPACK-decoded, get `:authority: localhost` if theirs is not a
//! valid authority, and are re-encoded as literals that never touch the dynamic table (so the
//! server's decoder state can never disagree with ours), in frames no larger than the protocol's
//! minimum maximum (16 KiB). Everything a client sends is bounded: one frame at a time (at most
//! the protocol's 16 MiB), one header block of at most [`MAX_HEADER_BLOCK`]. A malformed stream
//! ends that connection with an I/O error; the daemon and other connections are unaffected. TCP
//! listeners are not wrapped: clients there send a real authority.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What every HTTP/2 client sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload HTTP/2 allows at all (2^24 - 1).
const MAX_FRAME_PAYLOAD: usize = (1 << 24) - 1;
/// Frames we write carry at most this much (every peer accepts 16 KiB).
const OUT_FRAME_PAYLOAD: usize = 16 << 10;
/// Largest header block accumulated across CONTINUATION frames.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What replaces an authority the server would refuse.
const LOCAL_AUTHORITY: &[u8] = b"localhost";

/// A header block being collected (HEADERS seen, END_HEADERS not yet).
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// The client-to-server transformation, fed raw bytes, producing the bytes the server reads.
pub struct Rewriter {
    preface_left: usize,
    input: BytesMut,
    pending: Option<PendingBlock>,
    decoder: hpack::Decoder<'static>,
}

fn protocol_error(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 from the client: {}", what.into()))
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter { preface_left: PREFACE.len(), input: BytesMut::new(), pending: None, decoder: hpack::Decoder::new() }
    }
}

impl Rewriter {
    /// Consumes `data` from the client and appends what the server should read to `out`.
    pub fn feed(&mut self, data: &[u8], out: &mut BytesMut) -> io::Result<()> {
        self.input.extend_from_slice(data);
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.input.len());
            let done = PREFACE.len() - self.preface_left;
            if self.input[..n] != PREFACE[done..done + n] {
                return Err(protocol_error("not an HTTP/2 connection preface"));
            }
            out.extend_from_slice(&self.input.split_to(n));
            self.preface_left -= n;
        }
        while self.preface_left == 0 && self.input.len() >= FRAME_HEADER_LEN {
            let len = (usize::from(self.input[0]) << 16) | (usize::from(self.input[1]) << 8) | usize::from(self.input[2]);
            if len > MAX_FRAME_PAYLOAD {
                return Err(protocol_error("frame too large"));
            }
            if self.input.len() < FRAME_HEADER_LEN + len {
                break;
            }
            let frame = self.input.split_to(FRAME_HEADER_LEN + len);
            let (kind, flags) = (frame[3], frame[4]);
            let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
            let payload = &frame[FRAME_HEADER_LEN..];
            match (kind, self.pending.is_some()) {
                (TYPE_HEADERS, false) => self.start_block(stream_id, flags, payload, out)?,
                (TYPE_CONTINUATION, true) => self.continue_block(stream_id, flags, payload, out)?,
                (_, true) => return Err(protocol_error("a header block interrupted by another frame")),
                (TYPE_CONTINUATION, false) => return Err(protocol_error("CONTINUATION without HEADERS")),
                _ => out.extend_from_slice(&frame),
            }
        }
        Ok(())
    }

    fn start_block(&mut self, stream_id: u32, flags: u8, payload: &[u8], out: &mut BytesMut) -> io::Result<()> {
        let mut body = payload;
        let mut pad = 0;
        if flags & FLAG_PADDED != 0 {
            let (&n, rest) = body.split_first().ok_or_else(|| protocol_error("HEADERS without its pad length"))?;
            pad = usize::from(n);
            body = rest;
        }
        let priority = if flags & FLAG_PRIORITY != 0 {
            let (p, rest) = body.split_at_checked(5).ok_or_else(|| protocol_error("HEADERS without its priority"))?;
            body = rest;
            let mut fields = [0u8; 5];
            fields.copy_from_slice(p);
            Some(fields)
        } else {
            None
        };
        let fragment = body.len().checked_sub(pad).map(|n| &body[..n]).ok_or_else(|| protocol_error("padding longer than the frame"))?;
        self.pending = Some(PendingBlock { stream_id, end_stream: flags & FLAG_END_STREAM != 0, priority, block: Vec::new() });
        self.continue_block(stream_id, flags, fragment, out)
    }

    fn continue_block(&mut self, stream_id: u32, flags: u8, fragment: &[u8], out: &mut BytesMut) -> io::Result<()> {
        let pending = self.pending.as_mut().ok_or_else(|| protocol_error("CONTINUATION without HEADERS"))?;
        if pending.stream_id != stream_id {
            return Err(protocol_error("CONTINUATION of another stream"));
        }
        if pending.block.len() + fragment.len() > MAX_HEADER_BLOCK {
            return Err(protocol_error(format!("header block over {MAX_HEADER_BLOCK} bytes")));
        }
        pending.block.extend_from_slice(fragment);
        if flags & FLAG_END_HEADERS != 0 {
            if let Some(done) = self.pending.take() {
                self.finish_block(done, out)?;
            }
        }
        Ok(())
    }

    fn finish_block(&mut self, done: PendingBlock, out: &mut BytesMut) -> io::Result<()> {
        let mut headers = self.decoder.decode(&done.block).map_err(|e| protocol_error(format!("bad HPACK header block: {e:?}")))?;
        for (name, value) in headers.iter_mut() {
            if name.as_slice() == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err() {
                *value = LOCAL_AUTHORITY.to_vec();
            }
        }
        let mut block = Vec::with_capacity(done.block.len() + 16);
        for (name, value) in &headers {
            encode_literal(&mut block, name, value);
        }
        write_header_frames(out, done.stream_id, done.end_stream, done.priority, &block);
        Ok(())
    }
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 5.1); `first` holds the bits above it.
fn encode_int(out: &mut Vec<u8>, first: u8, prefix_bits: u32, mut value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A "literal header field without indexing, new name" (RFC 7541 6.2.2), strings raw: the
/// dynamic table is never touched.
fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    for s in [name, value] {
        encode_int(out, 0x00, 7, s.len());
        out.extend_from_slice(s);
    }
}

fn frame_header(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream_id: u32) {
    out.put_u8((len >> 16) as u8);
    out.put_u8((len >> 8) as u8);
    out.put_u8(len as u8);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream_id);
}

/// A HEADERS frame and as many CONTINUATION frames as `block` needs.
fn write_header_frames(out: &mut BytesMut, stream_id: u32, end_stream: bool, priority: Option<[u8; 5]>, block: &[u8]) {
    let room = OUT_FRAME_PAYLOAD - if priority.is_some() { 5 } else { 0 };
    let (first, mut rest) = block.split_at(block.len().min(room));
    let mut flags = if end_stream { FLAG_END_STREAM } else { 0 };
    if priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    frame_header(out, first.len() + if priority.is_some() { 5 } else { 0 }, TYPE_HEADERS, flags, stream_id);
    if let Some(p) = priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, more) = rest.split_at(rest.len().min(OUT_FRAME_PAYLOAD));
        frame_header(out, chunk.len(), TYPE_CONTINUATION, if more.is_empty() { FLAG_END_HEADERS } else { 0 }, stream_id);
        out.extend_from_slice(chunk);
        rest = more;
    }
}

/// An accepted connection whose client-to-server bytes go through a [`Rewriter`].
pub struct FixAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    ready: BytesMut,
    eof: bool,
}

impl<S> FixAuthority<S> {
    /// Wraps a freshly accepted connection.
    pub fn new(inner: S) -> Self {
        FixAuthority { inner, rewriter: Rewriter::default(), ready: BytesMut::new(), eof: false }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FixAuthority<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 16 << 10];
            let mut raw = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut raw))?;
            if raw.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.rewriter.feed(raw.filled(), &mut this.ready)?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FixAuthority<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for FixAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's HEADERS for `authority`, HPACK-encoded the way a client with a dynamic table
    /// would (with indexing, so a second block can refer to the first).
    fn client_block(encoder: &mut hpack::Encoder<'_>, authority: &[u8]) -> Vec<u8> {
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/sandbox.v1.SandboxService/ListSandboxes"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        encoder.encode(headers)
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        frame_header(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    /// Splits the server-side bytes into (type, flags, stream, payload) frames after the preface.
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        bytes = &bytes[PREFACE.len()..];
        let mut out = Vec::new();
        while bytes.len() >= FRAME_HEADER_LEN {
            let len = (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            out.push((bytes[3], bytes[4], stream, bytes[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len].to_vec()));
            bytes = &bytes[FRAME_HEADER_LEN + len..];
        }
        out
    }

    #[test]
    fn a_path_authority_becomes_localhost_and_everything_else_passes() {
        let mut encoder = hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &client_block(&mut encoder, b"tmp%2Fsandboxd.sock")));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0")); // DATA
                                                                     // The second request's block refers to the client's dynamic table entries.
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &client_block(&mut encoder, b"localhost:7070")));
        let mut rewriter = Rewriter::default();
        let mut out = BytesMut::new();
        // Byte by byte: frames split anywhere must come out the same.
        for b in &input {
            rewriter.feed(std::slice::from_ref(b), &mut out).expect("feed");
        }
        assert!(out.starts_with(PREFACE));
        let frames = frames(&out);
        assert_eq!(frames.iter().map(|f| (f.0, f.2)).collect::<Vec<_>>(), vec![(0x4, 0), (TYPE_HEADERS, 1), (0x0, 1), (TYPE_HEADERS, 3)]);
        let mut server = hpack::Decoder::new();
        let first = server.decode(&frames[1].3).expect("server decodes the first block");
        assert!(first.contains(&(b":authority".to_vec(), b"localhost".to_vec())), "{first:?}");
        assert!(first.contains(&(b":path".to_vec(), b"/sandbox.v1.SandboxService/ListSandboxes".to_vec())));
        assert_eq!(frames[2].3, b"\0\0\0\0\0", "DATA passes unchanged");
        let second = server.decode(&frames[3].3).expect("server decodes the second block");
        assert!(second.contains(&(b":authority".to_vec(), b"localhost:7070".to_vec())), "a valid authority is kept: {second:?}");
        assert_eq!(first.len(), 6);
    }

    #[test]
    fn continuation_padding_and_priority_are_handled() {
        let mut encoder = hpack::Encoder::new();
        let block = client_block(&mut encoder, b"tmp%2Fs.sock");
        let (a, b) = block.split_at(block.len() / 2);
        let mut headers = vec![3u8]; // pad length
        headers.extend_from_slice(&[0, 0, 0, 0, 16]); // priority
        headers.extend_from_slice(a);
        headers.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM, 5, &headers));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let mut out = BytesMut::new();
        Rewriter::default().feed(&input, &mut out).expect("feed");
        let frames = frames(&out);
        assert_eq!(frames.len(), 1);
        let (kind, flags, stream, payload) = &frames[0];
        assert_eq!((*kind, *stream), (TYPE_HEADERS, 5));
        assert_eq!(*flags, FLAG_END_STREAM | FLAG_PRIORITY | FLAG_END_HEADERS);
        assert_eq!(&payload[..5], &[0, 0, 0, 0, 16]);
        let decoded = hpack::Decoder::new().decode(&payload[5..]).expect("decode");
        assert!(decoded.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
    }

    #[test]
    fn a_large_block_is_split_into_continuations() {
        let big = vec![b'x'; 40 << 10];
        let mut block = Vec::new();
        encode_literal(&mut block, b":authority", b"tmp%2Fs.sock");
        encode_literal(&mut block, b"x-big", &big);
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        let mut out = BytesMut::new();
        Rewriter::default().feed(&input, &mut out).expect("feed");
        let frames = frames(&out);
        assert!(frames.len() >= 3 && frames.iter().all(|f| f.3.len() <= OUT_FRAME_PAYLOAD));
        assert_eq!(frames.last().map(|f| f.1 & FLAG_END_HEADERS), Some(FLAG_END_HEADERS));
        let whole: Vec<u8> = frames.iter().flat_map(|f| f.3.clone()).collect();
        let decoded = hpack::Decoder::new().decode(&whole).expect("decode");
        assert_eq!(decoded[0], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(decoded[1].1.len(), big.len());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut out = BytesMut::new();
        assert!(Rewriter::default().feed(b"GET / HTTP/1.1\r\n\r\n", &mut out).is_err(), "not HTTP/2");
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]));
        assert!(Rewriter::default().feed(&input, &mut BytesMut::new()).is_err(), "bad HPACK");
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b"x"));
        assert!(Rewriter::default().feed(&input, &mut BytesMut::new()).is_err(), "CONTINUATION alone");
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_END_HEADERS, 1, &[9, 1, 2]));
        assert!(Rewriter::default().feed(&input, &mut BytesMut::new()).is_err(), "padding past the end");
        // A header block that never ends is bounded.
        let mut rewriter = Rewriter::default();
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &[0u8; 1 << 14]));
        rewriter.feed(&input, &mut BytesMut::new()).expect("first fragment");
        let mut result = Ok(());
        for _ in 0..80 {
            result = rewriter.feed(&frame(TYPE_CONTINUATION, 0, 1, &[0u8; 1 << 14]), &mut BytesMut::new());
            if result.is_err() {
                break;
            }
        }
        assert!(result.is_err(), "an endless header block is refused");
    }
}
