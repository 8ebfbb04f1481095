//! Files and directories as streams: `UploadFile`, `DownloadFile`, `UploadArchive`,
//! `DownloadArchive`.
//!
//! Memory stays bounded whatever the size: an upload holds at most [`UPLOAD_QUEUE`] chunks of
//! [`CHUNK_SIZE`] in flight, a download writes each chunk before asking for the next.
//!
//! The one subtle point is how an upload ends. The daemon replaces the file when the request
//! stream ends, and it cannot tell a half-close from a cancelled call: dropping a client call
//! makes hyper reset the stream with CANCEL, and tonic's server decoder turns a CANCEL on a
//! request stream into a clean end of it (`codec/decode.rs`: `Direction::Request` and
//! `Code::Cancelled` give `Ok(None)`), exactly what a complete upload looks like. So
//! the request stream (`UploadBody`) ends cleanly only after the last piece has been queued;
//! cut short, it first sends a piece that makes the daemon refuse the upload (a digest that
//! cannot match, or bytes that are no tar header). And the call runs on a task of its own, so
//! the stream is never reset just because the upload's future was dropped: a failed or
//! cancelled upload never replaces anything.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::proto::{upload_request, DownloadChunk, UploadHeader, UploadRequest};

/// Size of the `data` pieces an upload sends.
pub const CHUNK_SIZE: usize = 1 << 20;

/// The next piece of an upload: a fresh buffer (it moves into the message) that `take` +
/// `read_to_end` fills to [`CHUNK_SIZE`] unless the reader ends first, so pieces are whole
/// MiBs; empty at the end.
pub(crate) async fn read_chunk<R: AsyncRead + Unpin>(reader: &mut R) -> std::io::Result<Vec<u8>> {
    let mut chunk = Vec::with_capacity(CHUNK_SIZE);
    reader
        .take(CHUNK_SIZE as u64)
        .read_to_end(&mut chunk)
        .await?;
    Ok(chunk)
}

/// Pieces an upload queues ahead of the network: with [`CHUNK_SIZE`], 4 MiB in flight at most.
pub const UPLOAD_QUEUE: usize = 4;

/// What a file transfer moved, as both sides agreed on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileTransfer {
    /// Bytes of content.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the content, checked against the daemon's.
    pub sha256: String,
}

/// One item of an upload's queue: a message, or the word that the upload is complete.
#[derive(Debug)]
pub(crate) enum Piece {
    Message(UploadRequest),
    End,
}

/// The request stream of an upload: the queued messages, then a clean end only after
/// [`Piece::End`]. When the queue is dropped before that, the stream sends `poison` before it
/// ends, so the daemon fails the upload rather than keep what arrived.
pub(crate) struct UploadBody {
    rx: mpsc::Receiver<Piece>,
    poison: Option<UploadRequest>,
    ended: bool,
}

impl UploadBody {
    pub(crate) fn new(rx: mpsc::Receiver<Piece>, poison: UploadRequest) -> Self {
        Self {
            rx,
            poison: Some(poison),
            ended: false,
        }
    }
}

impl Stream for UploadBody {
    type Item = UploadRequest;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<UploadRequest>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Piece::Message(message))) => Poll::Ready(Some(message)),
            Poll::Ready(Some(Piece::End)) => {
                self.ended = true;
                Poll::Ready(None)
            }
            // Cut short: the uploader failed or was dropped.
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(self.poison.take())
            }
        }
    }
}

/// What makes the daemon refuse a cut-short `UploadFile`: a digest no content has.
pub(crate) fn file_poison() -> UploadRequest {
    UploadRequest {
        item: Some(upload_request::Item::Sha256("0".repeat(64))),
    }
}

/// Why feeding an upload stopped early.
enum FeedError {
    /// The local reader failed.
    Local(Error),
    /// The call has ended (the daemon answered, or the connection broke): its answer says why.
    CallGone,
}

/// What was sent.
struct Fed {
    bytes: u64,
    sha256: String,
}

/// Sends `header`, then `reader`'s content in [`CHUNK_SIZE`] pieces, then (for a file) the
/// SHA-256 of it all, then [`Piece::End`].
async fn feed<R: AsyncRead + Unpin>(
    mut reader: R,
    tx: mpsc::Sender<Piece>,
    header: UploadHeader,
    send_digest: bool,
) -> std::result::Result<Fed, FeedError> {
    let what = format!("cannot read the upload of {}", header.path);
    let send = |piece: Piece| {
        let tx = &tx;
        async move { tx.send(piece).await.map_err(|_| FeedError::CallGone) }
    };
    let message = |item| Piece::Message(UploadRequest { item: Some(item) });
    send(message(upload_request::Item::Header(header))).await?;
    let mut hasher = Sha256::new();
    let mut bytes = 0u64;
    loop {
        let chunk = read_chunk(&mut reader).await.map_err(|source| {
            FeedError::Local(Error::Io {
                what: what.clone(),
                source,
            })
        })?;
        if chunk.is_empty() {
            break;
        }
        hasher.update(&chunk);
        bytes += chunk.len() as u64;
        send(message(upload_request::Item::Data(chunk))).await?;
    }
    let sha256 = format!("{:x}", hasher.finalize());
    if send_digest {
        send(message(upload_request::Item::Sha256(sha256.clone()))).await?;
    }
    send(Piece::End).await?;
    Ok(Fed { bytes, sha256 })
}

/// How long a failed upload waits for the daemon to refuse what it was sent, before giving up.
const ABORT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs one client-streaming upload: `call` gets the request stream and runs on a task of its
/// own, while `reader` is fed into it from this one (so the reader need not be `'static`).
/// Returns the daemon's answer and what was sent.
///
/// Why a task: dropping a call's future makes hyper reset the stream with CANCEL, which a
/// tonic server reads as a clean end of the request stream, i.e. as a complete upload. On its
/// own task the call outlives this future, so a cut-short upload still reaches the daemon as
/// the poison followed by the end (as long as the runtime runs).
async fn upload<R, F, Fut, T>(
    header: UploadHeader,
    reader: R,
    send_digest: bool,
    poison: UploadRequest,
    call: F,
) -> Result<(T, Fed)>
where
    R: AsyncRead + Unpin,
    F: FnOnce(UploadBody) -> Fut,
    Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>> + Send + 'static,
    T: Send + 'static,
{
    let path = header.path.clone();
    let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
    let mut call = tokio::spawn(call(UploadBody::new(rx, poison)));
    let feed = feed(reader, tx, header, send_digest);
    tokio::pin!(feed);
    let mut fed = None;
    let mut feeding = true;
    loop {
        tokio::select! {
            answer = &mut call => {
                let answer = answer.map_err(|e| {
                    Error::Protocol(format!("the upload of {path} stopped: {e}"))
                })?;
                // An error answer says more than any local symptom of it.
                let answer = answer?.into_inner();
                return match fed {
                    Some(fed) => Ok((answer, fed)),
                    None => Err(Error::Protocol(format!(
                        "the daemon answered the upload of {path} before it was complete"
                    ))),
                };
            }
            result = &mut feed, if feeding => {
                feeding = false;
                match result {
                    Ok(done) => fed = Some(done),
                    Err(FeedError::Local(err)) => {
                        // The queue is gone, so the poison is on its way: wait for the daemon
                        // to refuse it, so that when this returns the old file is known safe.
                        let _ = tokio::time::timeout(ABORT_WAIT, &mut call).await;
                        return Err(err);
                    }
                    Err(FeedError::CallGone) => {}
                }
            }
        }
    }
}

/// `UploadFile`: `reader`'s content into `header.path`, checked by SHA-256 on both sides.
pub(crate) async fn upload_file<R, F, Fut>(
    header: UploadHeader,
    reader: R,
    call: F,
) -> Result<FileTransfer>
where
    R: AsyncRead + Unpin,
    F: FnOnce(UploadBody) -> Fut,
    Fut: Future<
            Output = std::result::Result<
                tonic::Response<crate::proto::UploadFileResponse>,
                tonic::Status,
            >,
        > + Send
        + 'static,
{
    let path = header.path.clone();
    let (answer, fed) = upload(header, reader, true, file_poison(), call).await?;
    check_upload(
        &path,
        &fed.sha256,
        fed.bytes,
        &answer.sha256,
        answer.bytes_written,
    )?;
    Ok(FileTransfer {
        bytes: fed.bytes,
        sha256: fed.sha256,
    })
}

/// `UploadArchive`: `reader` (a tar stream) into the directory `header.path`.
pub(crate) async fn upload_archive<R, F, Fut>(
    header: UploadHeader,
    reader: R,
    call: F,
) -> Result<crate::proto::UploadArchiveResponse>
where
    R: AsyncRead + Unpin,
    F: FnOnce(UploadBody) -> Fut,
    Fut: Future<
            Output = std::result::Result<
                tonic::Response<crate::proto::UploadArchiveResponse>,
                tonic::Status,
            >,
        > + Send
        + 'static,
{
    // The digest ends every upload: the daemon replaces or extracts nothing without it (a
    // cancelled call reaches a server as a clean end of the stream).
    Ok(upload(header, reader, true, file_poison(), call).await?.0)
}

/// The daemon must have written what was sent: the same size and the same digest.
fn check_upload(
    path: &str,
    sent_sha: &str,
    sent: u64,
    their_sha: &str,
    written: u64,
) -> Result<()> {
    if written != sent {
        return Err(Error::Integrity {
            path: path.to_owned(),
            reason: format!("sent {sent} bytes, the daemon wrote {written}"),
        });
    }
    if !their_sha.eq_ignore_ascii_case(sent_sha) {
        return Err(Error::Integrity {
            path: path.to_owned(),
            reason: format!("sent sha256 {sent_sha}, the daemon wrote {their_sha:?}"),
        });
    }
    Ok(())
}

/// Checks a `DownloadFile` stream as it goes: the first message's `size`, the bytes that
/// follow (never more than announced) and the trailing `sha256`.
#[derive(Debug)]
pub struct DownloadCheck {
    path: String,
    size: Option<u64>,
    bytes: u64,
    hasher: Sha256,
    trailer: Option<String>,
}

impl DownloadCheck {
    /// A check of the download of `path` (named in its errors).
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            size: None,
            bytes: 0,
            hasher: Sha256::new(),
            trailer: None,
        }
    }

    fn integrity(&self, reason: String) -> Error {
        Error::Integrity {
            path: self.path.clone(),
            reason,
        }
    }

    /// Takes one message and returns its data, to be written; an error as soon as the stream
    /// breaks the contract (data after the digest, more bytes than announced).
    pub fn chunk<'a>(&mut self, chunk: &'a DownloadChunk) -> Result<&'a [u8]> {
        if self.trailer.is_some() {
            return Err(Error::Protocol(format!(
                "the download of {} went on after its sha256",
                self.path
            )));
        }
        let size = *self.size.get_or_insert(chunk.size);
        self.bytes += chunk.data.len() as u64;
        if self.bytes > size {
            return Err(self.integrity(format!(
                "the daemon announced {size} bytes and sent more ({})",
                self.bytes
            )));
        }
        self.hasher.update(&chunk.data);
        if !chunk.sha256.is_empty() {
            self.trailer = Some(chunk.sha256.clone());
        }
        Ok(&chunk.data)
    }

    /// Once the stream has ended: the size and digest must be those announced.
    pub fn finish(self) -> Result<FileTransfer> {
        let Some(size) = self.size else {
            return Err(Error::Protocol(format!(
                "the download of {} ended before its first message",
                self.path
            )));
        };
        if self.bytes != size {
            return Err(self.integrity(format!(
                "the daemon announced {size} bytes and sent {}",
                self.bytes
            )));
        }
        let Some(trailer) = self.trailer.clone() else {
            return Err(self.integrity("the stream ended without its sha256".to_owned()));
        };
        let sha256 = format!("{:x}", self.hasher.clone().finalize());
        if !trailer.eq_ignore_ascii_case(&sha256) {
            return Err(self.integrity(format!(
                "received content has sha256 {sha256}, the daemon sent {trailer:?}"
            )));
        }
        Ok(FileTransfer {
            bytes: self.bytes,
            sha256,
        })
    }
}

/// Writes a `DownloadFile` stream into `writer`, checking it; flushes and shuts the writer down
/// at the end. On an error the writer holds a part of the file (or all of it, wrong).
pub(crate) async fn download_file<W: AsyncWrite + Unpin>(
    mut stream: tonic::Streaming<DownloadChunk>,
    path: &str,
    mut writer: W,
) -> Result<FileTransfer> {
    let mut check = DownloadCheck::new(path);
    let what = || format!("cannot write the download of {path}");
    while let Some(chunk) = stream.message().await? {
        let data = check.chunk(&chunk)?;
        writer.write_all(data).await.map_err(|source| Error::Io {
            what: what(),
            source,
        })?;
    }
    let done = check.finish()?;
    writer.shutdown().await.map_err(|source| Error::Io {
        what: what(),
        source,
    })?;
    Ok(done)
}

/// Writes a `DownloadArchive` stream (a tar stream) into `writer`; returns its length.
pub(crate) async fn download_archive<W: AsyncWrite + Unpin>(
    mut stream: tonic::Streaming<DownloadChunk>,
    path: &str,
    mut writer: W,
) -> Result<u64> {
    let what = || format!("cannot write the archive of {path}");
    let mut bytes = 0u64;
    while let Some(chunk) = stream.message().await? {
        bytes += chunk.data.len() as u64;
        writer
            .write_all(&chunk.data)
            .await
            .map_err(|source| Error::Io {
                what: what(),
                source,
            })?;
    }
    writer.shutdown().await.map_err(|source| Error::Io {
        what: what(),
        source,
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn sha(data: &[u8]) -> String {
        format!("{:x}", Sha256::digest(data))
    }

    fn chunk(data: &[u8], size: u64, sha256: &str) -> DownloadChunk {
        DownloadChunk {
            data: data.to_vec(),
            size,
            sha256: sha256.to_owned(),
        }
    }

    #[test]
    fn a_download_that_matches_passes() {
        let mut check = DownloadCheck::new("/f");
        let first = chunk(b"hello ", 11, "");
        assert_eq!(check.chunk(&first).expect("ok"), b"hello ");
        let last = chunk(b"world", 0, &sha(b"hello world"));
        assert_eq!(check.chunk(&last).expect("ok"), b"world");
        let done = check.finish().expect("matches");
        assert_eq!(done.bytes, 11);
        assert_eq!(done.sha256, sha(b"hello world"));
    }

    #[test]
    fn an_empty_file_is_one_message() {
        let mut check = DownloadCheck::new("/empty");
        check.chunk(&chunk(b"", 0, &sha(b""))).expect("ok");
        assert_eq!(check.finish().expect("ok").bytes, 0);
    }

    #[test]
    fn a_wrong_digest_is_data_loss() {
        let mut check = DownloadCheck::new("/f");
        check
            .chunk(&chunk(b"abc", 3, &sha(b"abd")))
            .expect("size ok");
        let err = check.finish().expect_err("digest differs");
        assert_eq!(err.code(), tonic::Code::DataLoss);
        assert!(err.to_string().contains("/f"), "{err}");
    }

    #[test]
    fn sizes_are_checked_both_ways() {
        let mut check = DownloadCheck::new("/f");
        check.chunk(&chunk(b"ab", 3, "")).expect("ok");
        let err = check
            .chunk(&chunk(b"cd", 0, ""))
            .expect_err("more than announced");
        assert_eq!(err.code(), tonic::Code::DataLoss);

        let mut check = DownloadCheck::new("/f");
        check.chunk(&chunk(b"ab", 3, &sha(b"ab"))).expect("ok");
        let err = check.finish().expect_err("fewer than announced");
        assert!(
            err.to_string().contains("announced 3 bytes and sent 2"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_digest_or_first_message_is_an_error() {
        let mut check = DownloadCheck::new("/f");
        check.chunk(&chunk(b"ab", 2, "")).expect("ok");
        assert_eq!(
            check.finish().expect_err("no digest").code(),
            tonic::Code::DataLoss
        );
        let err = DownloadCheck::new("/f").finish().expect_err("nothing came");
        assert_eq!(err.code(), tonic::Code::Internal);
        let mut check = DownloadCheck::new("/f");
        check.chunk(&chunk(b"ab", 2, &sha(b"ab"))).expect("ok");
        assert!(
            check.chunk(&chunk(b"", 0, "")).is_err(),
            "nothing after the digest"
        );
    }

    #[test]
    fn the_daemon_must_agree_with_what_was_sent() {
        let digest = sha(b"x");
        check_upload("/f", &digest, 1, &digest.to_uppercase(), 1).expect("case does not matter");
        assert_eq!(
            check_upload("/f", &digest, 1, &sha(b"y"), 1)
                .expect_err("digest")
                .code(),
            tonic::Code::DataLoss
        );
        assert!(check_upload("/f", &digest, 1, &digest, 2).is_err(), "size");
    }

    #[tokio::test]
    async fn a_cut_short_upload_ends_with_the_poison() {
        let (tx, rx) = mpsc::channel(4);
        let mut body = UploadBody::new(rx, file_poison());
        tx.send(Piece::Message(UploadRequest::default()))
            .await
            .expect("open");
        drop(tx);
        assert_eq!(body.next().await, Some(UploadRequest::default()));
        assert_eq!(
            body.next().await,
            Some(file_poison()),
            "cut short: poisoned"
        );
        assert_eq!(body.next().await, None);

        let (tx, rx) = mpsc::channel(4);
        let mut body = UploadBody::new(rx, file_poison());
        tx.send(Piece::End).await.expect("open");
        drop(tx);
        assert_eq!(body.next().await, None, "a complete upload ends cleanly");
        assert_eq!(body.next().await, None);
    }

    #[tokio::test]
    async fn feeding_sends_header_whole_chunks_and_the_digest() {
        let content: Vec<u8> = (0..(CHUNK_SIZE * 2 + 10))
            .map(|i| (i % 251) as u8)
            .collect();
        let (tx, mut rx) = mpsc::channel(8);
        let header = UploadHeader {
            path: "/big".into(),
            ..Default::default()
        };
        let reader = std::io::Cursor::new(content.clone());
        let collect = tokio::spawn(async move {
            let mut pieces = Vec::new();
            while let Some(piece) = rx.recv().await {
                pieces.push(piece);
            }
            pieces
        });
        let fed = match feed(reader, tx, header, true).await {
            Ok(fed) => fed,
            Err(_) => panic!("feed failed"),
        };
        assert_eq!(
            (fed.bytes, fed.sha256.as_str()),
            (content.len() as u64, sha(&content).as_str())
        );
        let pieces = collect.await.expect("collector");
        let items: Vec<_> = pieces
            .iter()
            .map(|p| match p {
                Piece::Message(m) => match &m.item {
                    Some(upload_request::Item::Header(_)) => "header".to_owned(),
                    Some(upload_request::Item::Data(d)) => format!("data {}", d.len()),
                    Some(upload_request::Item::Sha256(_)) => "sha256".to_owned(),
                    None => "none".to_owned(),
                },
                Piece::End => "end".to_owned(),
            })
            .collect();
        assert_eq!(
            items,
            [
                "header",
                "data 1048576",
                "data 1048576",
                "data 10",
                "sha256",
                "end"
            ]
        );
    }
}
