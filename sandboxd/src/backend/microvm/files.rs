//! Files of a microVM sandbox: requests to the guest agent, which resolves every path inside
//! the VM (the whole guest filesystem is the sandbox's), answers checked.
//!
//! Directories move as tar streams made and taken apart by the guest (protocol 4): an upload is
//! sent as `UploadArchive` pieces, each once the guest has taken the one before, so the guest's
//! extraction sets the pace and holds at most a piece or two; a download is one
//! `DownloadArchive` whose `ArchiveData` frames are forwarded as they come, and the guest (which
//! may be compromised) is held to the protocol's bounds on them.

use std::time::Duration;

use bytes::Bytes;
use guest_agent::protocol::{self, ErrorKind, Request, Response};
use tokio::sync::mpsc;

use super::agent::{AgentConn, AgentError, Reply};
use super::exec::agent_failure;
use super::vm::Vm;
use crate::backend::files::{chunk_channel, ChunkSender};
use crate::backend::{ArchiveStats, BackendError, ByteChunks, Download, FileChunk, UploadPiece};

/// Deadline of one file request.
const FILE_TIMEOUT: Duration = Duration::from_secs(60);

/// The absolute guest path of an API path: relative paths start at the sandbox's workdir, and
/// `..` is kept for the guest kernel to clamp at `/` (the same rule as the process tier's
/// RESOLVE_IN_ROOT; inside the VM the whole filesystem is the sandbox's).
fn guest_path(path: &str, workdir: &str) -> Result<String, BackendError> {
    let comps = crate::backend::files::components(path, workdir)?;
    Ok(format!("/{}", comps.join("/")))
}

/// The guest protocol that brought atomic staged writes and `RemoveFile`.
const STAGED_WRITES: u32 = 2;
/// The guest protocol that brought `UploadArchive` and `DownloadArchive`.
const ARCHIVES: u32 = 4;
/// Deadline of the last piece of an archive upload (answered once the guest has extracted the
/// rest of the stream, applied its directories' metadata and synced the disk), and longest wait
/// for the next frame of a download: other transfers' slow readers share the port and may hold
/// it up for a while, so only a guest that is stuck for good runs into this.
const ARCHIVE_PATIENCE: Duration = Duration::from_secs(600);

/// The absolute guest path of an API path that names a file (not the root, not ending in `..`).
fn guest_file_path(api_path: &str, workdir: &str) -> Result<String, BackendError> {
    let comps = crate::backend::files::components(api_path, workdir)?;
    match comps.last().map(String::as_str) {
        None => Err(BackendError::InvalidPath { path: api_path.to_string(), reason: "names the root directory".into() }),
        Some("..") => Err(BackendError::InvalidPath { path: api_path.to_string(), reason: "ends in ..".into() }),
        Some(_) => Ok(format!("/{}", comps.join("/"))),
    }
}

/// `content` in chunks of at most [`protocol::FILE_CHUNK`] (one empty chunk for no content).
fn chunks_of(content: &[u8]) -> Vec<&[u8]> {
    let mut chunks: Vec<&[u8]> = content.chunks(protocol::FILE_CHUNK as usize).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    chunks
}

/// Writes a file, replacing an old one atomically: the chunks (at most
/// [`protocol::FILE_CHUNK`] each) are staged in a temporary file in the guest, which the last
/// chunk renames over the target. A failure anywhere leaves the old file as it was. Returns the
/// bytes written.
pub async fn write_file(vm: &Vm, workdir: &str, api_path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    let path = guest_file_path(api_path, workdir)?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    if vm.hello.version < STAGED_WRITES {
        tracing::warn!(version = vm.hello.version, "the guest agent predates atomic writes: rebuild the VM images (make vm-images)");
        return write_file_in_place(vm, api_path, &path, content, mode).await;
    }
    let transfer = next_transfer();
    let chunks = chunks_of(content);
    let last = chunks.len() - 1;
    let mut offset = 0u64;
    for (i, chunk) in chunks.into_iter().enumerate() {
        match stage(vm, &transfer, &path, api_path, mode, offset, chunk, i == last).await {
            Ok(size) => offset = size,
            Err(e) => {
                abort(vm, &transfer).await;
                return Err(e);
            }
        }
    }
    Ok(content.len() as u64)
}

/// Removes a regular file or symlink in the guest (a missing one is fine).
pub async fn remove_file(vm: &Vm, workdir: &str, api_path: &str) -> Result<(), BackendError> {
    let path = guest_file_path(api_path, workdir)?;
    if vm.hello.version < STAGED_WRITES {
        return Err(BackendError::Internal(format!(
            "the guest agent of this microVM speaks protocol {}, which cannot remove files: rebuild the VM images (make vm-images)",
            vm.hello.version
        )));
    }
    let reply = vm.agent.call(&Request::RemoveFile { path }, &[], FILE_TIMEOUT).await.map_err(|e| vm.agent_error(e))?;
    match reply.msg {
        Response::Ok | Response::Error { kind: ErrorKind::NotFound, .. } => Ok(()),
        Response::Error { kind, message } => Err(agent_failure(kind, message, api_path)),
        other => Err(BackendError::Internal(format!("guest agent answered remove_file with {other:?}"))),
    }
}

/// The protocol-1 write: the first chunk truncates the file in place, the others append (not
/// atomic; only for a guest agent that knows nothing better).
async fn write_file_in_place(vm: &Vm, api_path: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    for (i, chunk) in chunks_of(content).into_iter().enumerate() {
        let req = Request::WriteFile { path: path.to_string(), mode, append: i > 0 };
        let reply = vm.agent.call(&req, chunk, FILE_TIMEOUT).await.map_err(|e| vm.agent_error(e))?;
        match reply.msg {
            Response::Written { .. } => {}
            Response::Error { kind, message } => return Err(agent_failure(kind, message, api_path)),
            other => return Err(BackendError::Internal(format!("guest agent answered write_file with {other:?}"))),
        }
    }
    Ok(content.len() as u64)
}

/// Reads up to `limit` bytes (0 = the most one ReadFile returns) from `offset`, in chunks.
pub async fn read_file(vm: &Vm, workdir: &str, api_path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    let max = crate::backend::files::MAX_READ;
    let limit = if limit == 0 { max } else { limit.min(max) };
    let path_owned = guest_path(api_path, workdir)?;
    let path = path_owned.as_str();
    let mut out = FileChunk::default();
    let mut pos = offset;
    loop {
        let want = (limit - out.content.len() as u64).min(protocol::FILE_CHUNK);
        let req = Request::ReadFile { path: path.to_string(), offset: pos, limit: want };
        let reply = vm.agent.call(&req, &[], FILE_TIMEOUT).await.map_err(|e| vm.agent_error(e))?;
        match reply.msg {
            Response::FileData { size, eof } => {
                if reply.payload.len() as u64 > want {
                    return Err(BackendError::Internal(format!("guest agent returned {} bytes for a read of {want}", reply.payload.len())));
                }
                pos += reply.payload.len() as u64;
                let got_nothing = reply.payload.is_empty();
                out.content.extend_from_slice(&reply.payload);
                out.size = size;
                out.eof = eof;
                if eof || got_nothing || out.content.len() as u64 >= limit {
                    return Ok(out);
                }
            }
            Response::Error { kind, message } => return Err(agent_failure(kind, message, api_path)),
            other => return Err(BackendError::Internal(format!("guest agent answered read_file with {other:?}"))),
        }
    }
}

/// A fresh transfer id for a staged write.
fn next_transfer() -> String {
    static TRANSFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!("w{}", TRANSFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Stages one chunk of `transfer` at `offset` (committing it with `commit`); the staged size.
#[allow(clippy::too_many_arguments)]
async fn stage(vm: &Vm, transfer: &str, path: &str, api_path: &str, mode: u32, offset: u64, chunk: &[u8], commit: bool) -> Result<u64, BackendError> {
    let req = Request::WriteStaged { transfer: transfer.to_string(), path: path.to_string(), mode, offset, commit };
    let want = offset + chunk.len() as u64;
    match vm.agent.call(&req, chunk, FILE_TIMEOUT).await {
        Ok(reply) => match reply.msg {
            Response::Written { size } if size == want => Ok(size),
            Response::Error { kind, message } => Err(agent_failure(kind, message, api_path)),
            other => Err(BackendError::Internal(format!("guest agent answered write_staged with {other:?} (expected {want} bytes staged)"))),
        },
        Err(e) => Err(vm.agent_error(e)),
    }
}

/// Drops an unfinished staged write (best effort: a guest that is gone or stuck drops
/// abandoned transfers on its own).
async fn abort(vm: &Vm, transfer: &str) {
    if let Err(e) = vm.agent.call(&Request::AbortWrite { transfer: transfer.to_string() }, &[], Duration::from_secs(5)).await {
        tracing::debug!(%transfer, error = %e, "aborting a staged write in the guest");
    }
}

/// Writes a file of any size as its pieces arrive: staged in the guest in chunks of at most
/// [`protocol::FILE_CHUNK`], renamed over the target by a final empty chunk once `Commit` came.
pub async fn upload_file(vm: &Vm, workdir: &str, api_path: &str, mode: u32, mut data: mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError> {
    let path = guest_file_path(api_path, workdir)?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    if vm.hello.version < STAGED_WRITES {
        return Err(BackendError::Internal(format!(
            "the guest agent of this microVM speaks protocol {}, which cannot stage uploads: rebuild the VM images (make vm-images)",
            vm.hello.version
        )));
    }
    let transfer = next_transfer();
    let mut offset = 0u64;
    let result = loop {
        match data.recv().await {
            Some(UploadPiece::Data(bytes)) => {
                let mut failed = None;
                for chunk in bytes.chunks(protocol::FILE_CHUNK as usize) {
                    match stage(vm, &transfer, &path, api_path, mode, offset, chunk, false).await {
                        Ok(size) => offset = size,
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = failed {
                    break Err(e);
                }
            }
            Some(UploadPiece::Commit) => break stage(vm, &transfer, &path, api_path, mode, offset, &[], true).await,
            None => break Err(BackendError::UploadIncomplete { path: api_path.to_string() }),
        }
    };
    if result.is_err() {
        abort(vm, &transfer).await;
    }
    result
}

/// Reads a file for a streamed download, [`protocol::FILE_CHUNK`] per request, each once the
/// receiver took the one before; a receiver idle for `idle` ends it (see
/// [`crate::backend::files::ChunkSender`]).
pub async fn download_file(vm: std::sync::Arc<Vm>, workdir: &str, api_path: &str, idle: Duration) -> Result<Download, BackendError> {
    let first = read_file(&vm, workdir, api_path, 0, protocol::FILE_CHUNK).await?;
    let size = first.size;
    let (mut out, chunks) = chunk_channel(idle, api_path);
    let (workdir, api_path) = (workdir.to_string(), api_path.to_string());
    tokio::spawn(async move {
        let mut pos = first.content.len() as u64;
        let mut eof = first.eof || first.content.is_empty();
        let mut next = Some(first.content);
        loop {
            let Some(room) = out.room().await else { return };
            let content = match next.take() {
                Some(content) => content,
                None => match read_file(&vm, &workdir, &api_path, pos, protocol::FILE_CHUNK).await {
                    Ok(chunk) => {
                        pos += chunk.content.len() as u64;
                        eof = chunk.eof || chunk.content.is_empty();
                        chunk.content
                    }
                    Err(e) => {
                        drop(room);
                        out.fail(e);
                        return;
                    }
                },
            };
            room.send(Ok(Bytes::from(content)));
            if eof {
                return;
            }
        }
    });
    Ok(Download { size, chunks })
}

/// What the archive transfers need of a VM: its agent connection, the protocol it speaks, and
/// how a failed call reads. (A socketpair stands in for the VM in the unit tests.)
trait ArchiveGuest: Send + Sync + 'static {
    fn agent(&self) -> &AgentConn;
    fn version(&self) -> u32;
    fn call_failed(&self, e: AgentError) -> BackendError;
}

impl ArchiveGuest for Vm {
    fn agent(&self) -> &AgentConn {
        &self.agent
    }
    fn version(&self) -> u32 {
        self.hello.version
    }
    fn call_failed(&self, e: AgentError) -> BackendError {
        self.agent_error(e)
    }
}

/// Refuses an agent too old for archives (its VM images predate them).
fn need_archives(version: u32) -> Result<(), BackendError> {
    if version < ARCHIVES {
        return Err(BackendError::Internal(format!(
            "the guest agent of this microVM speaks protocol {version}, which cannot move archives: rebuild the VM images (make vm-images)"
        )));
    }
    Ok(())
}

/// Extracts a tar stream into the directory `dir` of the VM as its pieces arrive (see the module
/// documentation). The channel closing before `Commit` is [`BackendError::UploadIncomplete`];
/// whatever fails, the guest's transfer is aborted (entries extracted before stay).
pub async fn upload_archive(vm: &Vm, workdir: &str, dir: &str, data: mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
    upload_archive_to(vm, workdir, dir, data).await
}

async fn upload_archive_to<G: ArchiveGuest>(guest: &G, workdir: &str, dir: &str, mut data: mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
    let dest = guest_path(dir, workdir)?;
    need_archives(guest.version())?;
    let transfer = next_transfer();
    let mut offset = 0u64;
    // What did not fit the previous piece (data past FILE_CHUNK, or the Commit after it).
    let mut held: Option<UploadPiece> = None;
    let result = loop {
        let piece = match held.take() {
            Some(piece) => Some(piece),
            None => data.recv().await,
        };
        let first = match piece {
            Some(UploadPiece::Data(bytes)) => bytes,
            Some(UploadPiece::Commit) => break send_archive_piece(guest, &transfer, &dest, dir, offset, &[], true).await,
            None => break Err(BackendError::UploadIncomplete { path: dir.to_string() }),
        };
        // Small pieces that are already here go together, up to a frame.
        let mut chunk = Vec::with_capacity(first.len().min(protocol::FILE_CHUNK as usize));
        held = fill_piece(&mut chunk, first);
        while held.is_none() && (chunk.len() as u64) < protocol::FILE_CHUNK {
            match data.try_recv() {
                Ok(UploadPiece::Data(more)) => held = fill_piece(&mut chunk, more),
                Ok(UploadPiece::Commit) => held = Some(UploadPiece::Commit),
                // Empty: send what there is. Closed: the next `recv` says so.
                Err(_) => break,
            }
        }
        if chunk.is_empty() {
            continue;
        }
        // The stream's last bytes carry the commit: one round trip less.
        let last = matches!(held, Some(UploadPiece::Commit));
        match send_archive_piece(guest, &transfer, &dest, dir, offset, &chunk, last).await {
            Ok(Taken::Bytes(size)) => offset = size,
            Ok(Taken::All(stats)) => break Ok(Taken::All(stats)),
            Err(e) => break Err(e),
        }
    };
    match result {
        Ok(Taken::All(stats)) => Ok(stats),
        Ok(Taken::Bytes(size)) => {
            Err(BackendError::Internal(format!("guest agent answered the last archive piece with {size} bytes taken, not the extraction's outcome")))
        }
        Err(e) => {
            abort_transfer(guest.agent(), &transfer).await;
            Err(e)
        }
    }
}

/// Appends `bytes` to `chunk` up to [`protocol::FILE_CHUNK`]; what does not fit comes back.
fn fill_piece(chunk: &mut Vec<u8>, bytes: Bytes) -> Option<UploadPiece> {
    let room = (protocol::FILE_CHUNK as usize).saturating_sub(chunk.len());
    if bytes.len() <= room {
        chunk.extend_from_slice(&bytes);
        return None;
    }
    chunk.extend_from_slice(&bytes[..room]);
    Some(UploadPiece::Data(bytes.slice(room..)))
}

/// How the guest answered an archive piece.
#[derive(Debug)]
enum Taken {
    /// The stream bytes it has taken so far.
    Bytes(u64),
    /// The last piece: what the extraction wrote.
    All(ArchiveStats),
}

/// Sends one piece of an archive upload and checks the answer.
async fn send_archive_piece<G: ArchiveGuest>(
    guest: &G,
    transfer: &str,
    dest: &str,
    dir: &str,
    offset: u64,
    chunk: &[u8],
    last: bool,
) -> Result<Taken, BackendError> {
    let req = Request::UploadArchive { transfer: transfer.to_string(), dest: dest.to_string(), offset, last };
    let want = offset + chunk.len() as u64;
    let timeout = if last { ARCHIVE_PATIENCE } else { FILE_TIMEOUT };
    let reply = guest.agent().call(&req, chunk, timeout).await.map_err(|e| guest.call_failed(e))?;
    match reply.msg {
        Response::Written { size } if !last && size == want => Ok(Taken::Bytes(size)),
        Response::Extracted(s) if last => {
            Ok(Taken::All(ArchiveStats { files: s.files, dirs: s.dirs, symlinks: s.symlinks, hardlinks: s.hardlinks, bytes: s.bytes }))
        }
        Response::Error { kind, message } => Err(agent_failure(kind, message, dir)),
        other => Err(BackendError::Internal(format!("guest agent answered upload_archive with {other:?} (expected {want} bytes taken)"))),
    }
}

/// Stops an archive transfer in the guest (best effort: a guest that is gone or stuck drops
/// abandoned uploads on its own, and a download it cannot send stops with the connection).
async fn abort_transfer(agent: &AgentConn, transfer: &str) {
    if let Err(e) = agent.call(&Request::AbortWrite { transfer: transfer.to_string() }, &[], Duration::from_secs(5)).await {
        tracing::debug!(%transfer, error = %e, "aborting an archive transfer in the guest");
    }
}

/// A tar stream of the directory (or file) `path` in the VM, forwarded as the guest makes it
/// while the receiver keeps up. A path the guest cannot archive at all (a missing one) is an
/// error here, before any byte; a failure later ends the stream with it.
pub async fn download_archive(vm: std::sync::Arc<Vm>, workdir: &str, path: &str, idle: Duration) -> Result<ByteChunks, BackendError> {
    download_archive_from(vm, workdir, path, idle).await
}

/// Most bytes a download may stream: the guest's own bounds on what it archives (file data and
/// entries, at a generous 4 KiB of headers and padding each). Past it the guest is not following
/// the protocol.
fn max_archive_stream() -> u64 {
    let limits = sandbox_exec::archive::CreateLimits::default();
    limits.max_total_bytes.saturating_add(limits.max_entries.saturating_mul(4096))
}

/// One frame of a download, checked.
enum Frame {
    Data(Bytes),
    End,
    /// The guest's error, as the other tiers would give it.
    Failed(BackendError),
}

/// Checks a frame of a download: anything but data within bounds, the end or an error is the
/// guest breaking the protocol (the `Err`).
fn download_frame(reply: Reply, api_path: &str) -> Result<Frame, BackendError> {
    match reply.msg {
        Response::ArchiveData if reply.payload.len() as u64 <= protocol::FILE_CHUNK => Ok(Frame::Data(Bytes::from(reply.payload))),
        Response::ArchiveData => Err(BackendError::Internal(format!(
            "guest agent sent an archive frame of {} bytes; at most {} are allowed",
            reply.payload.len(),
            protocol::FILE_CHUNK
        ))),
        Response::ArchiveEnd(_) => Ok(Frame::End),
        Response::Error { kind, message } => Ok(Frame::Failed(agent_failure(kind, message, api_path))),
        other => Err(BackendError::Internal(format!("guest agent answered download_archive with {other:?}"))),
    }
}

async fn download_archive_from<G: ArchiveGuest>(guest: std::sync::Arc<G>, workdir: &str, api_path: &str, idle: Duration) -> Result<ByteChunks, BackendError> {
    let src = guest_path(api_path, workdir)?;
    need_archives(guest.version())?;
    let transfer = next_transfer();
    let req = Request::DownloadArchive { transfer: transfer.clone(), path: src };
    let (id, mut replies) = match tokio::time::timeout(FILE_TIMEOUT, guest.agent().start(&req, &[])).await {
        Ok(started) => started.map_err(|e| guest.call_failed(e))?,
        Err(_) => return Err(guest.call_failed(AgentError::Timeout { what: "download_archive", timeout: FILE_TIMEOUT })),
    };
    // The first answer decides: an error means the guest sent nothing, and the caller hears it
    // before any byte.
    let first = match tokio::time::timeout(FILE_TIMEOUT, replies.recv()).await {
        Ok(Some(reply)) => download_frame(reply, api_path),
        Ok(None) => Err(guest.call_failed(AgentError::Closed("the connection closed before the guest answered download_archive".into()))),
        Err(_) => Err(guest.call_failed(AgentError::Timeout { what: "download_archive", timeout: FILE_TIMEOUT })),
    };
    let first = match first {
        Ok(Frame::Data(bytes)) => bytes,
        // Not even the end-of-archive marker: not a tar stream.
        Ok(Frame::End) => return Err(BackendError::Internal(format!("guest agent ended the archive of {api_path} without any data"))),
        Ok(Frame::Failed(e)) => return Err(e),
        Err(e) => {
            stop_download(guest.agent(), id, &transfer, replies).await;
            return Err(e);
        }
    };
    let (out, chunks) = chunk_channel(idle, api_path);
    let api_path = api_path.to_string();
    tokio::spawn(async move { forward_download(&*guest, id, &transfer, &api_path, first, replies, out).await });
    Ok(chunks)
}

/// Stops routing a download's frames here and tells the guest to stop making them. `replies`
/// goes first: the connection's reader may be waiting for room in it, and must be free to read
/// the abort's answer (and every other request's frames).
async fn stop_download(agent: &AgentConn, id: u64, transfer: &str, replies: mpsc::Receiver<Reply>) {
    agent.forget(id);
    drop(replies);
    abort_transfer(agent, transfer).await;
}

/// Forwards a download's frames, from `first` on, into `tx` until the end, an error, or a
/// receiver that went away (which stops the guest). The stream never just stops short: a
/// connection lost or a guest gone silent ends it with an error.
async fn forward_download<G: ArchiveGuest>(
    guest: &G,
    id: u64,
    transfer: &str,
    api_path: &str,
    first: Bytes,
    mut replies: mpsc::Receiver<Reply>,
    mut out: ChunkSender,
) {
    let limit = max_archive_stream();
    let mut sent = first.len() as u64;
    let mut pending = (!first.is_empty()).then_some(first);
    // Why the guest is stopped, for the caller (`None`: the caller went away or stayed idle,
    // and was told).
    let failed = loop {
        if let Some(bytes) = pending.take() {
            match out.room().await {
                Some(room) => drop(room.send(Ok(bytes))),
                None => break None,
            }
        }
        let next = tokio::select! {
            next = tokio::time::timeout(ARCHIVE_PATIENCE, replies.recv()) => next,
            // Nobody reads any more: no use waiting for the guest's next frame.
            () = out.closed() => break None,
        };
        let frame = match next {
            Ok(Some(reply)) => download_frame(reply, api_path),
            Ok(None) => {
                let lost = guest.call_failed(AgentError::Closed(format!("the connection closed during the archive download of {api_path}")));
                out.fail(lost);
                return;
            }
            Err(_) => Err(BackendError::Internal(format!("the guest agent sent nothing of the archive of {api_path} for {ARCHIVE_PATIENCE:?}"))),
        };
        let bytes = match frame {
            Ok(Frame::Data(bytes)) => bytes,
            Ok(Frame::End) => return,
            // The guest's final answer: it has stopped already.
            Ok(Frame::Failed(e)) => {
                out.fail(e);
                return;
            }
            Err(e) => break Some(e),
        };
        sent = sent.saturating_add(bytes.len() as u64);
        if sent > limit {
            break Some(BackendError::Internal(format!("guest agent sent more than {limit} bytes of archive for {api_path}")));
        }
        pending = (!bytes.is_empty()).then_some(bytes);
    };
    stop_download(guest.agent(), id, transfer, replies).await;
    // Never a stream that just stops short: the caller would take it for a whole archive.
    if let Some(e) = failed {
        out.fail(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_agent::protocol::{encode, ArchiveCreated, ArchiveExtracted, Decoded, Decoder, Envelope};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    /// The host's end of a socketpair, speaking protocol `version`.
    struct FakeVm {
        agent: AgentConn,
        version: u32,
    }

    impl ArchiveGuest for FakeVm {
        fn agent(&self) -> &AgentConn {
            &self.agent
        }
        fn version(&self) -> u32 {
            self.version
        }
        fn call_failed(&self, e: AgentError) -> BackendError {
            BackendError::Internal(e.to_string())
        }
    }

    /// The guest's end: reads requests, writes answers.
    struct Guest {
        stream: UnixStream,
        decoder: Decoder,
    }

    impl Guest {
        async fn request(&mut self) -> (u64, Request, Vec<u8>) {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                if let Some(Decoded::Frame(f)) = self.decoder.next() {
                    let env: Envelope<Request> = f.envelope().expect("the host's requests parse");
                    return (env.id, env.msg, f.payload);
                }
                let n = self.stream.read(&mut buf).await.expect("read");
                assert!(n > 0, "the host closed the connection");
                self.decoder.push(&buf[..n]);
            }
        }

        async fn answer(&mut self, id: u64, resp: &Response, payload: &[u8]) {
            self.stream.write_all(&encode(id, resp, payload).expect("encode")).await.expect("write");
        }

        /// Answers the `AbortWrite` that must come next with `Ok`; returns its transfer id.
        async fn expect_abort(&mut self) -> String {
            let (id, req, _) = self.request().await;
            let Request::AbortWrite { transfer } = req else { panic!("expected an abort, got {req:?}") };
            self.answer(id, &Response::Ok, b"").await;
            transfer
        }
    }

    fn pair(version: u32) -> (Arc<FakeVm>, Guest) {
        let (host, guest) = UnixStream::pair().expect("socketpair");
        (Arc::new(FakeVm { agent: AgentConn::over(host), version }), Guest { stream: guest, decoder: Decoder::new() })
    }

    #[tokio::test]
    async fn an_upload_goes_in_order_in_bounded_pieces_and_returns_the_stats() {
        let (vm, mut guest) = pair(protocol::VERSION);
        let (tx, rx) = mpsc::channel(8);
        let stream: Vec<u8> = (0..(2 * protocol::FILE_CHUNK as usize + 1000)).map(|i| (i % 253) as u8).collect();
        // One big piece, then small ones that travel together, then the commit.
        tx.send(UploadPiece::Data(Bytes::copy_from_slice(&stream[..2 * protocol::FILE_CHUNK as usize + 10]))).await.expect("send");
        let feeder = {
            let stream = stream.clone();
            tokio::spawn(async move {
                for piece in stream[2 * protocol::FILE_CHUNK as usize + 10..].chunks(330) {
                    tx.send(UploadPiece::Data(Bytes::copy_from_slice(piece))).await.expect("send");
                }
                tx.send(UploadPiece::Commit).await.expect("send");
            })
        };
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { upload_archive_to(&*vm, "/work", "dst", rx).await })
        };
        let mut got = Vec::new();
        let mut transfer_seen = None;
        loop {
            let (id, req, payload) = guest.request().await;
            let Request::UploadArchive { transfer, dest, offset, last } = req else { panic!("{req:?}") };
            assert_eq!(dest, "/work/dst", "resolved against the workdir");
            assert_eq!(*transfer_seen.get_or_insert(transfer.clone()), transfer, "one transfer");
            assert_eq!(offset, got.len() as u64, "in order");
            assert!(payload.len() as u64 <= protocol::FILE_CHUNK);
            got.extend_from_slice(&payload);
            if last {
                let stats = ArchiveExtracted { files: 7, dirs: 2, symlinks: 1, hardlinks: 0, bytes: 99 };
                guest.answer(id, &Response::Extracted(stats), b"").await;
                break;
            }
            guest.answer(id, &Response::Written { size: got.len() as u64 }, b"").await;
        }
        assert_eq!(got, stream);
        let stats = host.await.expect("join").expect("upload");
        assert_eq!(stats, ArchiveStats { files: 7, dirs: 2, symlinks: 1, hardlinks: 0, bytes: 99 });
        feeder.await.expect("join");
    }

    #[tokio::test]
    async fn a_broken_off_or_refused_upload_is_aborted_in_the_guest() {
        // The client goes away before its commit.
        let (vm, mut guest) = pair(protocol::VERSION);
        let (tx, rx) = mpsc::channel(8);
        tx.send(UploadPiece::Data(Bytes::from_static(b"half a tar"))).await.expect("send");
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { upload_archive_to(&*vm, "/", "/dst", rx).await })
        };
        let (id, req, _) = guest.request().await;
        let Request::UploadArchive { transfer, last: false, .. } = req else { panic!("{req:?}") };
        guest.answer(id, &Response::Written { size: 10 }, b"").await;
        drop(tx);
        assert_eq!(guest.expect_abort().await, transfer);
        let err = host.await.expect("join").expect_err("incomplete");
        assert!(matches!(err, BackendError::UploadIncomplete { ref path } if path == "/dst"), "{err}");

        // The guest refuses an entry: its error, then the abort.
        let (tx, rx) = mpsc::channel(8);
        tx.send(UploadPiece::Data(Bytes::from_static(b"evil"))).await.expect("send");
        tx.send(UploadPiece::Commit).await.expect("send");
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { upload_archive_to(&*vm, "/", "/dst", rx).await })
        };
        let (id, req, payload) = guest.request().await;
        assert!(matches!(req, Request::UploadArchive { last: true, offset: 0, .. }), "small uploads are one piece: {req:?}");
        assert_eq!(payload, b"evil");
        guest.answer(id, &Response::Error { kind: ErrorKind::InvalidPath, message: "../x: refused: `..` component".into() }, b"").await;
        guest.expect_abort().await;
        let err = host.await.expect("join").expect_err("refused");
        assert!(matches!(&err, BackendError::InvalidPath { reason, .. } if reason.contains("../x")), "{err}");

        // A guest that answers out of step is not believed.
        let (tx, rx) = mpsc::channel(8);
        tx.send(UploadPiece::Data(Bytes::from_static(b"0123456789"))).await.expect("send");
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { upload_archive_to(&*vm, "/", "/dst", rx).await })
        };
        let (id, _, _) = guest.request().await;
        guest.answer(id, &Response::Written { size: 3 }, b"").await;
        guest.expect_abort().await;
        assert!(matches!(host.await.expect("join"), Err(BackendError::Internal(_))));
        drop(tx);
    }

    #[tokio::test]
    async fn an_agent_older_than_archives_is_told_to_rebuild_the_images() {
        let (vm, _guest) = pair(3);
        let (_tx, rx) = mpsc::channel(1);
        let err = upload_archive_to(&*vm, "/", "/dst", rx).await.expect_err("too old");
        assert!(err.to_string().contains("make vm-images"), "{err}");
        let err = download_archive_from(vm, "/", "/src", Duration::from_secs(60)).await.expect_err("too old");
        assert!(err.to_string().contains("make vm-images"), "{err}");
    }

    /// Starts a download and answers its request with `frames`; returns the stream.
    async fn download_with(vm: &Arc<FakeVm>, guest: &mut Guest, frames: Vec<(Response, Vec<u8>)>) -> (Result<ByteChunks, BackendError>, String) {
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { download_archive_from(vm, "/work", "src", Duration::from_secs(60)).await })
        };
        let (id, req, _) = guest.request().await;
        let Request::DownloadArchive { transfer, path } = req else { panic!("{req:?}") };
        assert_eq!(path, "/work/src");
        for (resp, payload) in frames {
            guest.answer(id, &resp, &payload).await;
        }
        (host.await.expect("join"), transfer)
    }

    async fn drain(mut chunks: ByteChunks) -> (Vec<u8>, Option<BackendError>) {
        let mut out = Vec::new();
        while let Some(item) = chunks.recv().await {
            match item {
                Ok(bytes) => out.extend_from_slice(&bytes),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn a_download_forwards_the_frames_and_a_missing_path_fails_before_any_byte() {
        let (vm, mut guest) = pair(protocol::VERSION);
        let frames = vec![
            (Response::ArchiveData, b"first ".to_vec()),
            (Response::ArchiveData, b"second".to_vec()),
            (Response::ArchiveEnd(ArchiveCreated::default()), Vec::new()),
        ];
        let (chunks, _) = download_with(&vm, &mut guest, frames).await;
        let (bytes, error) = drain(chunks.expect("started")).await;
        assert_eq!((bytes.as_slice(), error.is_none()), (&b"first second"[..], true));

        let missing = vec![(Response::Error { kind: ErrorKind::NotFound, message: "/work/src: no such file or directory".into() }, Vec::new())];
        let (chunks, _) = download_with(&vm, &mut guest, missing).await;
        assert!(matches!(chunks, Err(BackendError::FileNotFound { ref path }) if path == "src"));

        // A failure later ends the stream with the error.
        let later = vec![(Response::ArchiveData, b"part".to_vec()), (Response::Error { kind: ErrorKind::DiskFull, message: "x".into() }, Vec::new())];
        let (chunks, _) = download_with(&vm, &mut guest, later).await;
        let (bytes, error) = drain(chunks.expect("started")).await;
        assert_eq!(bytes, b"part");
        assert!(matches!(error, Some(BackendError::DiskFull { .. })), "{error:?}");
    }

    #[tokio::test]
    async fn a_hostile_guest_cannot_send_oversized_frames_or_cut_a_stream_silently() {
        let (vm, mut guest) = pair(protocol::VERSION);
        // A frame over the bound: an error (before any byte, as it is the first), and the guest
        // is told to stop.
        let host = {
            let vm = vm.clone();
            tokio::spawn(async move { download_archive_from(vm, "/", "/src", Duration::from_secs(60)).await })
        };
        let (id, req, _) = guest.request().await;
        let Request::DownloadArchive { transfer, .. } = req else { panic!("{req:?}") };
        guest.answer(id, &Response::ArchiveData, &vec![0u8; protocol::FILE_CHUNK as usize + 1]).await;
        assert_eq!(guest.expect_abort().await, transfer);
        assert!(matches!(host.await.expect("join"), Err(BackendError::Internal(m)) if m.contains("at most")));

        // Later in the stream: the stream ends with the error.
        let frames = vec![(Response::ArchiveData, b"ok".to_vec()), (Response::ArchiveData, vec![0u8; protocol::FILE_CHUNK as usize + 1])];
        let (chunks, transfer) = download_with(&vm, &mut guest, frames).await;
        let reader = tokio::spawn(drain(chunks.expect("started")));
        assert_eq!(guest.expect_abort().await, transfer);
        let (bytes, error) = reader.await.expect("join");
        assert_eq!(bytes, b"ok");
        assert!(matches!(error, Some(BackendError::Internal(_))), "{error:?}");

        // The connection lost mid-stream: an error, never a short stream that looks whole.
        let frames = vec![(Response::ArchiveData, b"so far".to_vec())];
        let (chunks, _) = download_with(&vm, &mut guest, frames).await;
        drop(guest);
        let (bytes, error) = drain(chunks.expect("started")).await;
        assert_eq!(bytes, b"so far");
        assert!(error.is_some(), "the cut is reported");
    }

    #[tokio::test]
    async fn a_reader_that_goes_away_stops_the_guest() {
        let (vm, mut guest) = pair(protocol::VERSION);
        let frames = vec![(Response::ArchiveData, b"more than anyone reads".to_vec())];
        let (chunks, transfer) = download_with(&vm, &mut guest, frames).await;
        drop(chunks);
        assert_eq!(guest.expect_abort().await, transfer);
    }
}
