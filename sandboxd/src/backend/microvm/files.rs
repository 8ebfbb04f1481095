//! Files of a microVM sandbox: requests to the guest agent, which resolves every path inside
//! the VM (the whole guest filesystem is the sandbox's), answers checked.

use std::time::Duration;

use bytes::Bytes;
use guest_agent::protocol::{self, ErrorKind, Request, Response};
use tokio::sync::mpsc;

use super::exec::agent_failure;
use super::vm::Vm;
use crate::backend::{BackendError, Download, FileChunk, UploadPiece};

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

/// Reads a file for a streamed download, [`protocol::FILE_CHUNK`] per request, while the
/// receiver keeps up.
pub async fn download_file(vm: std::sync::Arc<Vm>, workdir: &str, api_path: &str) -> Result<Download, BackendError> {
    let first = read_file(&vm, workdir, api_path, 0, protocol::FILE_CHUNK).await?;
    let size = first.size;
    let (tx, chunks) = mpsc::channel(4);
    let (workdir, api_path) = (workdir.to_string(), api_path.to_string());
    tokio::spawn(async move {
        let mut pos = first.content.len() as u64;
        let mut eof = first.eof || first.content.is_empty();
        if tx.send(Ok(Bytes::from(first.content))).await.is_err() {
            return;
        }
        while !eof {
            match read_file(&vm, &workdir, &api_path, pos, protocol::FILE_CHUNK).await {
                Ok(chunk) => {
                    pos += chunk.content.len() as u64;
                    eof = chunk.eof || chunk.content.is_empty();
                    if tx.send(Ok(Bytes::from(chunk.content))).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            }
        }
    });
    Ok(Download { size, chunks })
}

/// PLACEHOLDER (being replaced by the guest protocol's archive requests): refuses.
pub async fn upload_archive(_vm: &Vm, _workdir: &str, dir: &str, _data: mpsc::Receiver<UploadPiece>) -> Result<crate::backend::ArchiveStats, BackendError> {
    Err(BackendError::Internal(format!("archive upload into {dir}: not yet on the microVM tier")))
}

/// PLACEHOLDER (being replaced by the guest protocol's archive requests): refuses.
pub async fn download_archive(_vm: std::sync::Arc<Vm>, _workdir: &str, path: &str) -> Result<crate::backend::ByteChunks, BackendError> {
    Err(BackendError::Internal(format!("archive download of {path}: not yet on the microVM tier")))
}
