//! Connect-RPC (connectrpc.com) over HTTP/1.1 with the JSON codec, as envd speaks it: unary
//! calls are a JSON body each way; a server stream answers with enveloped JSON messages (a flag
//! byte, a big-endian length, the message) and ends with an end-of-stream envelope that carries
//! the error, if any.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, StreamBody};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::{is_unauthenticated, read_body, respond, Body};
use crate::error::Error;

/// Envelope flag of the last message of a stream.
const END_STREAM: u8 = 0x02;
/// Envelope flag of a compressed message (never sent: the SDK disables compression).
const COMPRESSED: u8 = 0x01;
/// A stream with nothing to say sends a keepalive this often, so proxies and the client's
/// read timeouts see a live stream.
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// The Connect error code of a core error.
pub fn code(e: &Error) -> &'static str {
    match e {
        e if is_unauthenticated(e) => "unauthenticated",
        Error::SandboxNotFound(_)
        | Error::ExecNotFound(_)
        | Error::SnapshotNotFound(_)
        | Error::ImageNotFound { .. }
        | Error::NotFound(_)
        | Error::FileNotFound(_) => "not_found",
        Error::InvalidArgument { .. } => "invalid_argument",
        Error::IncorrectState { .. } | Error::Unavailable { .. } | Error::FailedPrecondition(_) => "failed_precondition",
        Error::ResourceExhausted(_) => "resource_exhausted",
        Error::PermissionDenied(_) => "permission_denied",
        Error::Aborted(_) => "aborted",
        Error::DataLoss(_) => "data_loss",
        Error::DeadlineExceeded(_) => "deadline_exceeded",
        Error::Internal(_) => "internal",
    }
}

/// The HTTP status Connect gives a code in a unary response.
fn status_of(code: &str) -> http::StatusCode {
    use http::StatusCode as S;
    match code {
        "invalid_argument" | "failed_precondition" | "out_of_range" => S::BAD_REQUEST,
        "unauthenticated" => S::UNAUTHORIZED,
        "permission_denied" => S::FORBIDDEN,
        "not_found" => S::NOT_FOUND,
        "already_exists" | "aborted" => S::CONFLICT,
        "resource_exhausted" => S::TOO_MANY_REQUESTS,
        "unimplemented" => S::NOT_IMPLEMENTED,
        "unavailable" => S::SERVICE_UNAVAILABLE,
        "deadline_exceeded" => S::GATEWAY_TIMEOUT,
        _ => S::INTERNAL_SERVER_ERROR,
    }
}

/// A Connect error: a code and a sentence.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        RpcError { code, message: message.into() }
    }

    /// A feature of envd that sandboxd does not have, said as such.
    pub fn unsupported(what: &str, why: &str) -> Self {
        RpcError::new("unimplemented", format!("{what} is not supported by sandboxd: {why}"))
    }

    fn to_json(&self) -> Value {
        json!({ "code": self.code, "message": self.message })
    }
}

impl From<Error> for RpcError {
    fn from(e: Error) -> Self {
        RpcError { code: code(&e), message: e.to_string() }
    }
}

/// The unary error response.
pub fn unary_error(e: RpcError) -> http::Response<Body> {
    respond(status_of(e.code), Some("application/json"), serde_json::to_vec(&e.to_json()).unwrap_or_default())
}

/// The unary success response.
pub fn unary_ok(message: &Value) -> http::Response<Body> {
    respond(http::StatusCode::OK, Some("application/json"), serde_json::to_vec(message).unwrap_or_default())
}

/// Reads a unary request's JSON message (an empty body is the empty message).
pub async fn unary_request<T: DeserializeOwned>(req: http::Request<hyper::body::Incoming>) -> Result<T, RpcError> {
    let body = read_body(req.into_body()).await.map_err(RpcError::from)?;
    let body: &[u8] = if body.is_empty() { b"{}" } else { &body };
    serde_json::from_slice(body).map_err(|e| RpcError::new("invalid_argument", format!("request is not the expected JSON message: {e}")))
}

/// Reads a server-stream request: one enveloped JSON message.
pub async fn stream_request<T: DeserializeOwned>(req: http::Request<hyper::body::Incoming>) -> Result<T, RpcError> {
    let body = read_body(req.into_body()).await.map_err(RpcError::from)?;
    let message = unenvelope(&body)?;
    let message: &[u8] = if message.is_empty() { b"{}" } else { message };
    serde_json::from_slice(message).map_err(|e| RpcError::new("invalid_argument", format!("request is not the expected JSON message: {e}")))
}

/// The message of the first envelope of `body`.
fn unenvelope(body: &[u8]) -> Result<&[u8], RpcError> {
    let (&flags, rest) = body.split_first().ok_or_else(|| RpcError::new("invalid_argument", "empty request: expected an enveloped message"))?;
    if flags & COMPRESSED != 0 {
        return Err(RpcError::new("unimplemented", "compressed messages are not supported"));
    }
    let len =
        rest.get(..4).map(|l| u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize).ok_or_else(|| RpcError::new("invalid_argument", "truncated envelope"))?;
    rest.get(4..4 + len).ok_or_else(|| RpcError::new("invalid_argument", "envelope longer than the request"))
}

/// One envelope.
fn envelope(flags: u8, message: &Value) -> Bytes {
    let payload = serde_json::to_vec(message).unwrap_or_default();
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(flags);
    out.put_u32(payload.len() as u32);
    out.put_slice(&payload);
    out.freeze()
}

/// A server-stream response: the messages of `events` (each `Ok` a message, an `Err` the error
/// that ends the stream), then the end-of-stream envelope. A stream idle for [`KEEPALIVE`] gets
/// `keepalive` inserted.
pub fn stream_response<S>(events: S, keepalive: Option<Value>) -> http::Response<Body>
where
    S: Stream<Item = Result<Value, RpcError>> + Send + Unpin + 'static,
{
    struct St<S> {
        events: S,
        done: bool,
        keepalive: Option<Value>,
    }
    let body = futures::stream::unfold(St { events, done: false, keepalive }, |mut st| async move {
        if st.done {
            return None;
        }
        let next = match &st.keepalive {
            Some(k) => match tokio::time::timeout(KEEPALIVE, st.events.next()).await {
                Ok(n) => n,
                Err(_) => return Some((Ok(hyper::body::Frame::data(envelope(0, k))), st)),
            },
            None => st.events.next().await,
        };
        let frame = match next {
            Some(Ok(msg)) => envelope(0, &msg),
            Some(Err(e)) => {
                st.done = true;
                envelope(END_STREAM, &json!({ "error": e.to_json() }))
            }
            None => {
                st.done = true;
                envelope(END_STREAM, &json!({}))
            }
        };
        Some((Ok::<_, std::io::Error>(hyper::body::Frame::data(frame)), st))
    });
    let mut resp = http::Response::new(BodyExt::boxed_unsync(StreamBody::new(body)));
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/connect+json"));
    resp
}

/// A server stream that fails before its first message.
pub fn stream_error(e: RpcError) -> http::Response<Body> {
    stream_response(futures::stream::iter([Err(e)]), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let e = envelope(0, &json!({"a": 1}));
        assert_eq!(e[0], 0);
        assert_eq!(unenvelope(&e).expect("one message"), br#"{"a":1}"#);
        assert!(unenvelope(&e[..3]).is_err(), "a cut envelope is refused");
        assert!(unenvelope(&[COMPRESSED, 0, 0, 0, 0]).is_err(), "compression is refused");
    }
}
