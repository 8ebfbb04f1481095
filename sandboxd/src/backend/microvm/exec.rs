//! Execs and files of a microVM sandbox: requests to the guest agent, answers checked and turned
//! into the same records the other tiers produce.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use guest_agent::protocol::{self, ErrorKind, ExecExit, ExecRequest, ExitStatus, Request, Response, Stream, StreamMeta};
use tokio_util::sync::CancellationToken;

use super::vm::Vm;
use crate::backend::{BackendError, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, FileChunk, OutputChunk, OutputSink, StartSignal};

/// How long past its own timeout an exec may go unreported before it is declared lost (the
/// guest enforces the timeout; this only catches a guest that stopped answering).
const REPORT_GRACE: Duration = Duration::from_secs(30);
/// How long to wait for the final record after a cancellation killed the command.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Deadline of one file request.
const FILE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs one command in the VM.
pub async fn run(vm: &Vm, spec: ExecSpec, sink: OutputSink, started: StartSignal, cancel: CancellationToken) -> Result<ExecOutcome, BackendError> {
    let started_at = SystemTime::now();
    let req = Request::Exec(ExecRequest {
        exec_id: spec.exec_id.to_string(),
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        workdir: spec.workdir.clone(),
        timeout_ms: spec.timeout.as_millis().min(u64::MAX as u128) as u64,
        max_output_bytes: spec.max_output_bytes,
        io_drain_ms: spec.io_drain_timeout.as_millis().min(u64::MAX as u128) as u64,
        stream: sink.is_some(),
    });
    let (id, mut rx) = match tokio::time::timeout(REPORT_GRACE, vm.agent.start(&req, &spec.stdin)).await {
        Ok(r) => r.map_err(|e| vm.agent_error(e))?,
        Err(_) => return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, "the guest agent stopped reading requests".into(), started_at)),
    };
    let mut started = started;
    let deadline = tokio::time::Instant::now() + spec.timeout + spec.io_drain_timeout + REPORT_GRACE;
    let mut cancelled_at: Option<tokio::time::Instant> = None;
    loop {
        let wait_until = cancelled_at.map_or(deadline, |c| (c + CANCEL_GRACE).min(deadline));
        let next = tokio::select! {
            r = rx.recv() => r,
            _ = cancel.cancelled(), if cancelled_at.is_none() => {
                cancelled_at = Some(tokio::time::Instant::now());
                let kill = Request::Signal { exec_id: spec.exec_id.to_string(), signal: libc::SIGKILL };
                if let Err(e) = vm.agent.call(&kill, &[], Duration::from_secs(5)).await {
                    tracing::warn!(exec = %spec.exec_id, error = %e, "killing a cancelled exec in the guest");
                }
                continue;
            }
            _ = tokio::time::sleep_until(wait_until) => {
                vm.agent.forget(id);
                let why = if cancelled_at.is_some() { "no final record from the guest after the kill" } else { "the guest agent stopped reporting on the command" };
                return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, why.into(), started_at));
            }
        };
        let Some(reply) = next else {
            let error = match (vm.lost_reason(), vm.exited()) {
                (Some(reason), _) => format!("{reason} while the command ran"),
                (None, Some(how)) => format!("the microVM went away while the command ran: {how}"),
                (None, None) => "the guest agent connection closed while the command ran".to_string(),
            };
            return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, error, started_at));
        };
        match reply.msg {
            Response::Started => {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
            }
            Response::Output { stream } => {
                if let Some(sink) = &sink {
                    let chunk = Bytes::from(reply.payload);
                    let item = match stream {
                        Stream::Stdout => OutputChunk::Stdout(chunk),
                        Stream::Stderr => OutputChunk::Stderr(chunk),
                    };
                    // A gone client does not stop the command.
                    let _ = sink.send(item).await;
                }
            }
            Response::Exited(exit) => {
                let mut outcome = outcome_of(exit, reply.payload, started_at)?;
                if cancelled_at.is_some() && outcome.status != ExecStatus::SpawnFailed {
                    outcome.status = ExecStatus::Signaled;
                    outcome.signal = libc::SIGKILL;
                    outcome.exit_code = 128 + libc::SIGKILL;
                }
                return Ok(outcome);
            }
            Response::Error { kind, message } => return Err(agent_failure(kind, message, "")),
            other => return Err(BackendError::Internal(format!("guest agent answered an exec with {other:?}"))),
        }
    }
}

/// Checks the guest's final record against its payload and builds the outcome.
pub fn outcome_of(exit: ExecExit, payload: Vec<u8>, started_at: SystemTime) -> Result<ExecOutcome, BackendError> {
    let (out_len, err_len) = (exit.stdout.len, exit.stderr.len);
    if out_len.checked_add(err_len) != Some(payload.len() as u64) {
        return Err(BackendError::Internal(format!(
            "guest agent sent an exec record claiming {out_len}+{err_len} output bytes with a payload of {}",
            payload.len()
        )));
    }
    let mut stdout_bytes = payload;
    let stderr_bytes = stdout_bytes.split_off(out_len as usize);
    let stream = |meta: StreamMeta, bytes: Vec<u8>| CapturedOutput {
        truncated: meta.truncated,
        total_bytes: meta.total_bytes.max(bytes.len() as u64),
        bytes,
        spill_path: meta.spill_path,
    };
    let (status, exit_code, signal) = match exit.status {
        ExitStatus::Exited => (ExecStatus::Exited, exit.exit_code, 0),
        ExitStatus::Signaled => (ExecStatus::Signaled, 128 + exit.signal, exit.signal),
        ExitStatus::TimedOut => (ExecStatus::TimedOut, 128 + libc::SIGKILL, libc::SIGKILL),
        ExitStatus::OomKilled => (ExecStatus::OomKilled, 128 + libc::SIGKILL, libc::SIGKILL),
        ExitStatus::SpawnFailed => (ExecStatus::SpawnFailed, exit.exit_code, 0),
        ExitStatus::Lost => (ExecStatus::Lost, -1, 0),
    };
    Ok(ExecOutcome {
        status,
        exit_code,
        signal,
        stdout: stream(exit.stdout, stdout_bytes),
        stderr: stream(exit.stderr, stderr_bytes),
        started_at,
        duration: Duration::from_millis(exit.duration_ms),
        usage: ExecUsage { cpu_user_ms: exit.cpu_user_ms, cpu_system_ms: exit.cpu_system_ms, peak_memory_bytes: exit.peak_memory_bytes },
        error: exit.error,
    })
}

/// An agent's error answer as a backend error.
pub fn agent_failure(kind: ErrorKind, message: String, path: &str) -> BackendError {
    match kind {
        ErrorKind::NotFound => BackendError::FileNotFound { path: path.to_string() },
        ErrorKind::InvalidPath => BackendError::InvalidPath { path: path.to_string(), reason: message },
        ErrorKind::DiskFull => BackendError::DiskFull { path: path.to_string() },
        ErrorKind::NoSuchExec => BackendError::Internal(format!("guest agent: {message}")),
        ErrorKind::BadRequest | ErrorKind::Internal => BackendError::Internal(format!("guest agent: {message}")),
    }
}

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
    static TRANSFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let path = guest_file_path(api_path, workdir)?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    if vm.hello.version < STAGED_WRITES {
        tracing::warn!(version = vm.hello.version, "the guest agent predates atomic writes: rebuild the VM images (make vm-images)");
        return write_file_in_place(vm, api_path, &path, content, mode).await;
    }
    let transfer = format!("w{}", TRANSFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let chunks = chunks_of(content);
    let last = chunks.len() - 1;
    let mut offset = 0u64;
    for (i, chunk) in chunks.into_iter().enumerate() {
        let req = Request::WriteStaged { transfer: transfer.clone(), path: path.clone(), mode, offset, commit: i == last };
        let failure = match vm.agent.call(&req, chunk, FILE_TIMEOUT).await {
            Ok(reply) => match reply.msg {
                Response::Written { size } if size == offset + chunk.len() as u64 => {
                    offset = size;
                    continue;
                }
                // The guest dropped the transfer itself.
                Response::Error { kind, message } => return Err(agent_failure(kind, message, api_path)),
                other => BackendError::Internal(format!("guest agent answered write_staged with {other:?} (expected {} bytes staged)", offset + chunk.len() as u64)),
            },
            Err(e) => vm.agent_error(e),
        };
        // Best effort: a guest that is gone or stuck drops abandoned transfers on its own.
        if let Err(e) = vm.agent.call(&Request::AbortWrite { transfer: transfer.clone() }, &[], Duration::from_secs(5)).await {
            tracing::debug!(%transfer, error = %e, "aborting a staged write in the guest");
        }
        return Err(failure);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(out: u64, err: u64) -> ExecExit {
        ExecExit {
            status: ExitStatus::Signaled,
            exit_code: 0,
            signal: 15,
            duration_ms: 12,
            cpu_user_ms: 1,
            cpu_system_ms: 1,
            peak_memory_bytes: 1 << 20,
            stdout: StreamMeta { len: out, total_bytes: out, ..Default::default() },
            stderr: StreamMeta { len: err, total_bytes: err, ..Default::default() },
            error: String::new(),
        }
    }

    #[test]
    fn payload_is_split_into_the_two_streams() {
        let o = outcome_of(exit(3, 2), b"outer".to_vec(), SystemTime::now()).expect("valid");
        assert_eq!(o.stdout.bytes, b"out");
        assert_eq!(o.stderr.bytes, b"er");
        assert_eq!((o.status, o.exit_code, o.signal), (ExecStatus::Signaled, 143, 15));
    }

    #[test]
    fn a_lying_guest_is_refused_not_trusted() {
        assert!(outcome_of(exit(10, 0), b"short".to_vec(), SystemTime::now()).is_err());
        assert!(outcome_of(exit(u64::MAX, 2), b"ab".to_vec(), SystemTime::now()).is_err());
    }
}
