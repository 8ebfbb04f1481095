//! Execs of a microVM sandbox: requests to the guest agent, answers checked and turned into the
//! same records the other tiers produce.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use guest_agent::protocol::{ErrorKind, ExecExit, ExecRequest, ExitStatus, Request, Response, Stream, StreamMeta};
use tokio_util::sync::CancellationToken;

use super::vm::Vm;
use crate::backend::{BackendError, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, OutputChunk, OutputSink, StartSignal};

/// How long past its own timeout an exec may go unreported before it is declared lost (the
/// guest enforces the timeout; this only catches a guest that stopped answering).
const REPORT_GRACE: Duration = Duration::from_secs(30);
/// How long to wait for the final record after a cancellation killed the command.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

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
