//! The streaming calls' conversions: an exec session's messages into live input and signals,
//! uploads into pieces (with their checksum), downloads into chunks. What each call does is the
//! manager's and the backends'; here messages only become core values and back.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sandbox_proto::v1 as pb;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::backend::{ByteChunks, Download, SessionInput, TerminalSize, UploadPiece};
use crate::ids::ExecId;
use crate::images::hex;
use crate::manager::{Held, Manager};

/// A client's stream of messages, from tonic or from the fleet's router (which reads a stream's
/// first message to learn where it goes, and hands on that message and the rest).
pub type Inbound<M> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<M, Status>> + Send>>;

/// The next message of `stream` (None at its end), as `tonic::Streaming::message` says it.
pub async fn next_message<M>(stream: &mut Inbound<M>) -> Result<Option<M>, Status> {
    futures::StreamExt::next(stream).await.transpose()
}

/// A session's stdin is handed to the backend in copies of at most this many bytes, so what
/// waits for the command is counted in bytes (`streams.session_input_buffer_bytes`), not in
/// messages of up to 64 MiB each.
const INPUT_PIECE: usize = 64 << 10;

/// A session's terminal: `tty` with `size` (0 = 24 × 80), or none.
pub fn terminal(tty: bool, size: Option<pb::TerminalSize>) -> Result<Option<TerminalSize>, Status> {
    if !tty {
        return Ok(None);
    }
    Ok(Some(terminal_size(size.unwrap_or_default(), "start.size")?))
}

fn terminal_size(size: pb::TerminalSize, field: &str) -> Result<TerminalSize, Status> {
    let dim = |v: u32, default: u16, what: &str| -> Result<u16, Status> {
        match v {
            0 => Ok(default),
            1..=4096 => Ok(v as u16),
            _ => Err(Status::invalid_argument(format!("invalid {field}.{what}: {v} is above 4096"))),
        }
    };
    Ok(TerminalSize { rows: dim(size.rows, 24, "rows")?, cols: dim(size.cols, 80, "cols")? })
}

/// The session's input channel, fed from the client's messages after `start` by a task that
/// ends with the client's stream. Signals go to the exec once it has an id (`started`), through
/// the manager like SignalExec. A malformed message ends the input (as a close of stdin) and is
/// logged; the command's own fate is decided by its stdin and the client's presence.
///
/// The next message is read only once the one before is handed on, and at most about
/// `buffer_bytes` of stdin wait for the command (in [`INPUT_PIECE`] copies): a client that
/// types faster than the command reads is held back by HTTP/2 flow control, and the daemon
/// holds the message being handed on plus that buffer, whatever the client sends.
pub fn session_input(
    manager: Arc<Manager>,
    tenant: String,
    mut stream: Inbound<pb::ExecSessionRequest>,
    started: watch::Receiver<Option<ExecId>>,
    buffer_bytes: usize,
) -> mpsc::Receiver<SessionInput> {
    use pb::exec_session_request::Item;
    let (tx, rx) = mpsc::channel((buffer_bytes / INPUT_PIECE).max(1));
    tokio::spawn(async move {
        loop {
            let item = match next_message(&mut stream).await {
                Ok(Some(pb::ExecSessionRequest { item: Some(item) })) => item,
                Ok(Some(pb::ExecSessionRequest { item: None })) => continue,
                // The client half-closed its side: no more input, the output still flows.
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(%status, "exec session input ended");
                    break;
                }
            };
            let input = match item {
                Item::Stdin(bytes) => {
                    for piece in bytes.chunks(INPUT_PIECE) {
                        if tx.send(SessionInput::Stdin(Bytes::copy_from_slice(piece))).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                Item::CloseStdin(_) => SessionInput::CloseStdin,
                Item::Resize(size) => match terminal_size(size, "resize") {
                    Ok(size) => SessionInput::Resize(size),
                    Err(status) => {
                        tracing::debug!(%status, "ignoring a bad resize");
                        continue;
                    }
                },
                Item::Signal(signal) => {
                    let mut started = started.clone();
                    let (manager, tenant) = (manager.clone(), tenant.clone());
                    // Delivered once the command runs, without holding up the input behind it.
                    tokio::spawn(async move {
                        let Ok(id) = started.wait_for(Option::is_some).await.map(|id| id.clone()) else { return };
                        if let Some(id) = id {
                            if let Err(e) = manager.signal_exec(&tenant, id.as_str(), signal).await {
                                tracing::debug!(exec = %id, signal, error = %e, "session signal not delivered");
                            }
                        }
                    });
                    continue;
                }
                Item::Start(_) => {
                    tracing::debug!("a second `start` in an exec session ends its input");
                    break;
                }
            };
            if tx.send(input).await.is_err() {
                break;
            }
        }
    });
    rx
}

/// One message of an upload stream after its header, whatever the call.
pub enum Piece {
    Data(Vec<u8>),
    Sha256(String),
    /// A second header.
    Header,
    Empty,
}

/// The messages of the calls that upload: UploadFile and UploadArchive, ImportImage and
/// BuildImage.
pub trait UploadMessage {
    fn piece(self) -> Piece;
}

/// `UploadMessage` for a request whose `item` oneof is `header`, a data field and `sha256`.
macro_rules! upload_message {
    ($($msg:ty => $item:ident :: $data:ident),* $(,)?) => {$(
        impl UploadMessage for $msg {
            fn piece(self) -> Piece {
                use pb::$item::Item;
                match self.item {
                    Some(Item::$data(d)) => Piece::Data(d),
                    Some(Item::Sha256(s)) => Piece::Sha256(s),
                    Some(Item::Header(_)) => Piece::Header,
                    None => Piece::Empty,
                }
            }
        }
    )*};
}

upload_message! {
    pb::UploadRequest => upload_request::Data,
    pb::ImportImageRequest => import_image_request::Chunk,
    pb::BuildImageRequest => build_image_request::Chunk,
}

/// What an upload stream brought, checked: its pieces go to `tx` as they arrive, and `Commit`
/// only once the client half-closed the stream and its `sha256` (required) matched. Returns the
/// hex digest of the content; an error (the client broke off, a second header, a bad checksum)
/// drops `tx` without a commit, so the backend abandons the upload.
pub async fn feed_upload<M: UploadMessage>(stream: Inbound<M>, tx: mpsc::Sender<UploadPiece>) -> Result<String, FeedError> {
    feed_upload_within(stream, tx, None).await
}

/// [`feed_upload`] with an idle deadline: a client that sends nothing for `idle` ends the
/// upload with DEADLINE_EXCEEDED (and `tx` dropped without a commit, the backend removes what
/// it wrote).
pub async fn feed_upload_within<M: UploadMessage>(mut stream: Inbound<M>, tx: mpsc::Sender<UploadPiece>, idle: Option<Duration>) -> Result<String, FeedError> {
    let mut hasher = Sha256::new();
    let mut expected: Option<String> = None;
    loop {
        let next = match idle {
            Some(idle) => match tokio::time::timeout(idle, next_message(&mut stream)).await {
                Ok(next) => next,
                Err(_) => {
                    return Err(FeedError::Client(Status::deadline_exceeded(format!(
                        "upload: no message from the client for {:.1} s (streams.idle_timeout_ms); nothing was kept",
                        idle.as_secs_f64()
                    ))))
                }
            },
            None => next_message(&mut stream).await,
        };
        match next.map_err(FeedError::Client)?.map(UploadMessage::piece) {
            Some(Piece::Data(data)) => {
                if expected.is_some() {
                    return Err(FeedError::Client(Status::invalid_argument("upload: data after the sha256 message")));
                }
                hasher.update(&data);
                if tx.send(UploadPiece::Data(Bytes::from(data))).await.is_err() {
                    return Err(FeedError::BackendStopped);
                }
            }
            Some(Piece::Sha256(sum)) => expected = Some(sum.trim().to_ascii_lowercase()),
            Some(Piece::Header) => return Err(FeedError::Client(Status::invalid_argument("upload: a second header"))),
            Some(Piece::Empty) => {}
            None => break,
        }
    }
    let digest = hex(&hasher.finalize());
    // Required: a client that cancels its call (rather than dying) reaches the server as a clean
    // end of the stream (tonic reads the HTTP/2 reset as the end), so the end alone cannot mean
    // "complete"; the digest, sent last, can.
    let Some(expected) = expected else {
        return Err(FeedError::Client(Status::aborted(
            "upload: the stream ended without its sha256 message, so it may have been cut short; nothing was replaced (send the lowercase hex SHA-256 of the content last)",
        )));
    };
    {
        if expected != digest {
            return Err(FeedError::Client(Status::data_loss(format!(
                "upload: sha256 of the received content is {digest}, the client said {expected}; the old file is unchanged"
            ))));
        }
    }
    tx.send(UploadPiece::Commit).await.map_err(|_| FeedError::BackendStopped)?;
    Ok(digest)
}

/// Runs an upload's feeding and its backend side together. A backend side that fails first (a
/// cap reached, a bad path) is the answer at once: the client's stream is dropped rather than
/// read on, so a refused upload does not wait for a client that sends nothing more.
pub async fn run_upload<T>(
    feed: impl std::future::Future<Output = Result<String, FeedError>>,
    upload: impl std::future::Future<Output = Result<T, crate::error::Error>>,
) -> (Result<String, FeedError>, Result<T, crate::error::Error>) {
    tokio::pin!(feed, upload);
    tokio::select! {
        done = &mut upload => match done {
            Err(e) => (Err(FeedError::BackendStopped), Err(e)),
            Ok(v) => (feed.await, Ok(v)),
        },
        fed = &mut feed => (fed, upload.await),
    }
}

/// Why [`feed_upload`] stopped early.
pub enum FeedError {
    /// The client's stream broke off or was wrong: its status is the answer.
    Client(Status),
    /// The backend stopped taking pieces: its own error is the answer.
    BackendStopped,
}

/// The answer of an upload from what the feeding and the backend each ended with: the client's
/// fault (broke off, bad checksum) names the problem better than the backend's "did not
/// complete" that follows from it, and the backend's error is the answer when it stopped first.
pub fn upload_result<T>(fed: Result<String, FeedError>, done: Result<T, crate::error::Error>) -> Result<(String, T), Status> {
    match (fed, done) {
        (Ok(sha256), Ok(v)) => Ok((sha256, v)),
        (Err(FeedError::Client(status)), _) => Err(status),
        (_, Err(e)) => Err(e.into()),
        (Err(FeedError::BackendStopped), Ok(_)) => Err(Status::internal("upload: the sandbox stopped taking data without an error")),
    }
}

/// A download as messages: `size` first, the data, then the `sha256` of what was sent. Each
/// message is made when the transport asks for it (nothing is queued here), and the download's
/// slots are held until the stream is dropped.
pub fn download_chunks(download: Held<Download>) -> impl futures::Stream<Item = Result<pb::DownloadChunk, Status>> {
    enum Next {
        Size(u64),
        Data,
        Done,
    }
    let Held { value: Download { size, chunks }, slots } = download;
    futures::stream::unfold((Next::Size(size), chunks, Sha256::new(), slots), |(next, mut chunks, mut hasher, slots)| async move {
        let (msg, then) = match next {
            Next::Size(size) => (Ok(pb::DownloadChunk { size, ..Default::default() }), Next::Data),
            Next::Data => match chunks.recv().await {
                Some(Ok(bytes)) => {
                    hasher.update(&bytes);
                    (Ok(pb::DownloadChunk { data: Vec::from(bytes), ..Default::default() }), Next::Data)
                }
                Some(Err(e)) => (Err(Status::from(crate::error::Error::from(e))), Next::Done),
                None => (Ok(pb::DownloadChunk { sha256: hex(&hasher.clone().finalize()), ..Default::default() }), Next::Done),
            },
            Next::Done => return None,
        };
        Some((msg, (then, chunks, hasher, slots)))
    })
}

/// An archive download as messages: `data` only, made when the transport asks; the slots are
/// held until the stream is dropped.
pub fn archive_chunks(chunks: Held<ByteChunks>) -> impl futures::Stream<Item = Result<pb::DownloadChunk, Status>> {
    use futures::StreamExt;
    let Held { value, slots } = chunks;
    ReceiverStream::new(value).map(move |chunk| {
        let _held = &slots;
        match chunk {
            Ok(bytes) => Ok(pb::DownloadChunk { data: Vec::from(bytes), ..Default::default() }),
            Err(e) => Err(Status::from(crate::error::Error::from(e))),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_sizes_default_and_are_bounded() {
        assert_eq!(terminal(false, None).ok(), Some(None));
        assert_eq!(terminal(true, None).ok().flatten(), Some(TerminalSize { rows: 24, cols: 80 }));
        let size = pb::TerminalSize { rows: 50, cols: 0 };
        assert_eq!(terminal(true, Some(size)).ok().flatten(), Some(TerminalSize { rows: 50, cols: 80 }));
        let err = terminal(true, Some(pb::TerminalSize { rows: 1, cols: 5000 })).err().map(|s| s.message().to_string());
        assert!(err.is_some_and(|m| m.contains("start.size.cols")));
    }
}
