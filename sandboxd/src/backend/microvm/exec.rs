//! Execs of a microVM sandbox: requests to the guest agent, answers checked and turned into the
//! same records the other tiers produce.
//!
//! An interactive exec (a session's live input) or one on a terminal is sent as an
//! `ExecSession` (guest protocol 3); while it runs, [`forward_input`] turns the session's input
//! into `Stdin` / `CloseStdin` / `Resize` requests, one at a time, each sent once the guest has
//! applied the one before: the order holds, and a command that does not read its stdin holds up
//! its own sender — not the guest, nor this VM's other requests.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use guest_agent::protocol::{ErrorKind, ExecExit, ExecRequest, ExitStatus, Request, Response, Stream, StreamMeta, STDIN_CHUNK};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::agent::AgentConn;
use super::vm::Vm;
use crate::backend::{BackendError, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, OutputChunk, OutputSink, SessionInput, StartSignal};

/// How long past its own timeout an exec may go unreported before it is declared lost (the
/// guest enforces the timeout; this only catches a guest that stopped answering).
const REPORT_GRACE: Duration = Duration::from_secs(30);
/// How long to wait for the final record after a cancellation killed the command.
const CANCEL_GRACE: Duration = Duration::from_secs(5);
/// The guest protocol that brought sessions: `ExecSession`, `Stdin`, `CloseStdin`, `Resize`.
const SESSIONS: u32 = 3;
/// The guest protocol that brought `ExecRequest.user`.
const USERS: u32 = 5;

/// Runs one command in the VM.
pub async fn run(vm: &Vm, spec: ExecSpec, sink: OutputSink, started: StartSignal, cancel: CancellationToken) -> Result<ExecOutcome, BackendError> {
    let started_at = SystemTime::now();
    let exec = ExecRequest {
        exec_id: spec.exec_id.to_string(),
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        workdir: spec.workdir.clone(),
        timeout_ms: spec.timeout.as_millis().min(u64::MAX as u128) as u64,
        max_output_bytes: spec.max_output_bytes,
        io_drain_ms: spec.io_drain_timeout.as_millis().min(u64::MAX as u128) as u64,
        stream: sink.is_some(),
        user: spec.user.clone(),
    };
    // An older agent would ignore the user and run the command as root.
    if exec.user.is_some() && vm.hello.version < USERS {
        return Err(BackendError::Internal(format!(
            "the guest agent of this microVM speaks protocol {}, which cannot run execs as another user: rebuild the VM images (make vm-images)",
            vm.hello.version
        )));
    }
    let input = spec.input.take();
    let req = if input.is_some() || spec.tty.is_some() {
        if vm.hello.version < SESSIONS {
            return Err(BackendError::Internal(format!(
                "the guest agent of this microVM speaks protocol {}, which has no interactive execs or terminals: rebuild the VM images (make vm-images)",
                vm.hello.version
            )));
        }
        Request::ExecSession { exec, tty: spec.tty.map(|t| (t.rows, t.cols)), interactive: input.is_some() }
    } else {
        Request::Exec(exec)
    };
    // The stdin goes with the start request and is dropped once written, not kept for the
    // exec's life.
    let stdin = spec.stdin.take();
    let started_req = tokio::time::timeout(REPORT_GRACE, vm.agent.start(&req, &stdin)).await;
    drop(stdin);
    let (id, mut rx) = match started_req {
        Ok(r) => r.map_err(|e| vm.agent_error(e))?,
        Err(_) => return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, "the guest agent stopped reading requests".into(), started_at)),
    };
    // The live input goes once the command runs (the guest takes it from `Started` on), until
    // this function returns with the exec's end (dropping the future stops it; a frame it was
    // writing is still written whole, see `AgentConn::start`).
    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let mut running_tx = Some(running_tx);
    let exec_id = spec.exec_id.to_string();
    let forward = async {
        let Some(input) = input else { return };
        if running_rx.await.is_ok() {
            forward_input(&vm.agent, &exec_id, input, spec.tty.is_some()).await;
        }
    };
    tokio::pin!(forward);
    let mut forwarding = true;
    let mut started = started;
    // The guest's own clock stops while the VM is stopped (a pause), and so does this one:
    // the sandbox's running time, not the wall clock.
    let deadline = spec.clock.sleep(spec.timeout + spec.io_drain_timeout + REPORT_GRACE);
    tokio::pin!(deadline);
    let mut cancelled_at: Option<tokio::time::Instant> = None;
    loop {
        let grace_until = cancelled_at.map(|c| c + CANCEL_GRACE);
        let next = tokio::select! {
            r = rx.recv() => r,
            () = &mut forward, if forwarding => {
                forwarding = false;
                continue;
            }
            _ = cancel.cancelled(), if cancelled_at.is_none() => {
                cancelled_at = Some(tokio::time::Instant::now());
                let kill = Request::Signal { exec_id: spec.exec_id.to_string(), signal: libc::SIGKILL };
                if let Err(e) = vm.agent.call(&kill, &[], Duration::from_secs(5)).await {
                    tracing::warn!(exec = %spec.exec_id, error = %e, "killing a cancelled exec in the guest");
                }
                continue;
            }
            () = &mut deadline => {
                vm.agent.forget(id);
                let why = if cancelled_at.is_some() { "no final record from the guest after the kill" } else { "the guest agent stopped reporting on the command" };
                return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, why.into(), started_at));
            }
            _ = tokio::time::sleep_until(grace_until.unwrap_or_else(tokio::time::Instant::now)), if grace_until.is_some() => {
                vm.agent.forget(id);
                return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, "no final record from the guest after the kill".into(), started_at));
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
                if let Some(tx) = running_tx.take() {
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

/// Sends a session's live input to exec `exec_id` in the guest, in order, each request once the
/// guest answered the one before (see the module documentation). Consecutive stdin bytes go
/// together, up to [`STDIN_CHUNK`] a frame. Returns when the input ends (the channel closing is
/// sent as a `CloseStdin`, as the backend contract has it), when stdin can take nothing more
/// (closed, without a terminal), or when the guest says the exec is gone or answers anything but
/// `Ok`.
async fn forward_input(agent: &AgentConn, exec_id: &str, mut input: mpsc::Receiver<SessionInput>, tty: bool) {
    let mut held: Option<SessionInput> = None;
    loop {
        let (item, channel_closed) = match held.take() {
            Some(item) => (item, false),
            None => match input.recv().await {
                Some(item) => (item, false),
                None => (SessionInput::CloseStdin, true),
            },
        };
        let id = exec_id.to_string();
        let (req, payload) = match item {
            SessionInput::Stdin(bytes) => {
                let mut payload = Vec::with_capacity(bytes.len().min(STDIN_CHUNK));
                held = take_up_to(&mut payload, bytes);
                while held.is_none() && payload.len() < STDIN_CHUNK {
                    match input.try_recv() {
                        Ok(SessionInput::Stdin(more)) => held = take_up_to(&mut payload, more),
                        Ok(other) => held = Some(other),
                        Err(_) => break,
                    }
                }
                if payload.is_empty() {
                    continue;
                }
                (Request::Stdin { exec_id: id }, payload)
            }
            SessionInput::CloseStdin => (Request::CloseStdin { exec_id: id }, Vec::new()),
            SessionInput::Resize(size) if tty => (Request::Resize { exec_id: id, rows: size.rows, cols: size.cols }, Vec::new()),
            // Without a terminal there is nothing to resize.
            SessionInput::Resize(_) => continue,
        };
        // Without a terminal stdin is a pipe: once closed, nothing more can reach it.
        let last = channel_closed || (!tty && matches!(req, Request::CloseStdin { .. }));
        let (_, mut replies) = match agent.start(&req, &payload).await {
            Ok(started) => started,
            Err(e) => {
                tracing::debug!(exec = %exec_id, error = %e, "sending an exec's input to the guest");
                return;
            }
        };
        // Only the final answer counts; a guest that sends others is read past, one bounded
        // frame at a time.
        let answer = loop {
            match replies.recv().await {
                Some(reply) if reply.msg.is_final() => break Some(reply.msg),
                Some(_) => continue,
                None => break None,
            }
        };
        match answer {
            Some(Response::Ok) => {}
            // The exec ended (its record is on its way), or the connection is gone.
            Some(Response::Error { kind: ErrorKind::NoSuchExec, .. }) | None => return,
            Some(other) => {
                tracing::warn!(exec = %exec_id, answer = ?other, "the guest refused an exec's input; the rest is dropped");
                return;
            }
        }
        if last {
            return;
        }
    }
}

/// Appends `bytes` to `payload` up to [`STDIN_CHUNK`]; what does not fit comes back, for the
/// next frame.
fn take_up_to(payload: &mut Vec<u8>, bytes: Bytes) -> Option<SessionInput> {
    let room = STDIN_CHUNK.saturating_sub(payload.len());
    if bytes.len() <= room {
        payload.extend_from_slice(&bytes);
        return None;
    }
    payload.extend_from_slice(&bytes[..room]);
    Some(SessionInput::Stdin(bytes.slice(room..)))
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

    use crate::backend::TerminalSize;
    use guest_agent::protocol::{encode, Decoded, Decoder, Envelope};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    /// The guest's end: reads the next request.
    async fn next_request(guest: &mut UnixStream, dec: &mut Decoder) -> Option<(u64, Request, Vec<u8>)> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            if let Some(Decoded::Frame(f)) = dec.next() {
                let env: Envelope<Request> = f.envelope().expect("request parses");
                return Some((env.id, env.msg, f.payload));
            }
            let n = guest.read(&mut buf).await.expect("read");
            if n == 0 {
                return None;
            }
            dec.push(&buf[..n]);
        }
    }

    async fn answer(guest: &mut UnixStream, id: u64, resp: Response) {
        guest.write_all(&encode(id, &resp, b"").expect("encode")).await.expect("write");
    }

    #[tokio::test]
    async fn live_input_is_sent_in_order_one_request_at_a_time_and_coalesced() {
        let (a, mut guest) = UnixStream::pair().expect("socketpair");
        let conn = AgentConn::over(a);
        let (tx, rx) = mpsc::channel(1024);
        // Queued before anything is sent: consecutive bytes go as one frame, and a resize
        // without a terminal is not sent at all.
        for chunk in [&b"ab"[..], b"cd", b"ef"] {
            tx.send(SessionInput::Stdin(Bytes::from_static(chunk))).await.expect("send");
        }
        tx.send(SessionInput::Resize(TerminalSize { rows: 1, cols: 2 })).await.expect("send");
        tx.send(SessionInput::Stdin(Bytes::from(vec![b'x'; STDIN_CHUNK + 10]))).await.expect("send");
        drop(tx);
        let guest_side = tokio::spawn(async move {
            let mut dec = Decoder::new();
            let mut seen = Vec::new();
            while let Some((id, req, payload)) = next_request(&mut guest, &mut dec).await {
                seen.push((req, payload.len(), payload.first().copied()));
                // Nothing more may arrive before this is answered.
                let early = tokio::time::timeout(Duration::from_millis(30), guest.read(&mut [0u8; 1])).await;
                assert!(early.is_err(), "a second request before the answer");
                answer(&mut guest, id, Response::Ok).await;
            }
            seen
        });
        forward_input(&conn, "ex-1", rx, false).await;
        drop(conn);
        let seen = guest_side.await.expect("guest");
        let stdin = |len, first| (Request::Stdin { exec_id: "ex-1".into() }, len, Some(first));
        assert_eq!(
            seen,
            [
                (Request::Stdin { exec_id: "ex-1".into() }, 6, Some(b'a')),
                stdin(STDIN_CHUNK, b'x'),
                stdin(10, b'x'),
                // The channel closing is the end of stdin.
                (Request::CloseStdin { exec_id: "ex-1".into() }, 0, None),
            ]
        );
    }

    #[tokio::test]
    async fn a_terminal_keeps_its_input_after_ctrl_d_and_an_ended_exec_stops_the_forwarding() {
        let (a, mut guest) = UnixStream::pair().expect("socketpair");
        let conn = AgentConn::over(a);
        let (tx, rx) = mpsc::channel(16);
        tx.send(SessionInput::CloseStdin).await.expect("send");
        tx.send(SessionInput::Resize(TerminalSize { rows: 40, cols: 120 })).await.expect("send");
        tx.send(SessionInput::Stdin(Bytes::from_static(b"\x03"))).await.expect("send");
        tx.send(SessionInput::Stdin(Bytes::from_static(b"typed"))).await.expect("send");
        let guest_side = tokio::spawn(async move {
            let mut dec = Decoder::new();
            let mut seen = Vec::new();
            while let Some((id, req, payload)) = next_request(&mut guest, &mut dec).await {
                let stdin = matches!(req, Request::Stdin { .. });
                seen.push((req, payload));
                let resp = if stdin {
                    Response::Error { kind: ErrorKind::NoSuchExec, message: "ended".into() }
                } else {
                    // A hostile guest may interleave non-final frames: they are read past.
                    answer(&mut guest, id, Response::Started).await;
                    Response::Ok
                };
                answer(&mut guest, id, resp).await;
            }
            seen
        });
        // The session's input stays open: only the guest's NoSuchExec ends the forwarding.
        tokio::time::timeout(Duration::from_secs(10), forward_input(&conn, "ex-t", rx, true)).await.expect("the forwarder stops when the exec is gone");
        assert!(tx.send(SessionInput::CloseStdin).await.is_err(), "and lets go of the input");
        drop(conn);
        let seen = guest_side.await.expect("guest");
        assert_eq!(
            seen,
            [
                (Request::CloseStdin { exec_id: "ex-t".into() }, vec![]),
                (Request::Resize { exec_id: "ex-t".into(), rows: 40, cols: 120 }, vec![]),
                (Request::Stdin { exec_id: "ex-t".into() }, b"\x03typed".to_vec()),
            ]
        );
    }
}
