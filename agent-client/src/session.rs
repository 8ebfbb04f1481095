//! Interactive exec sessions (`ExecSession`): stdin, signals and terminal sizes flow in while
//! output flows out.
//!
//! [`Client::exec_session`](crate::Client::exec_session) returns an [`ExecSession`] once the
//! daemon has started the command. It splits into a [`SessionInput`] (cheap to clone, usable
//! from any task) and [`SessionEvents`], the output ending with the result. Read the events
//! from their own task or loop, never only after sending all input: a command blocked on a full
//! stdout stops reading its stdin, and input would then wait forever.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::proto::{
    exec_session_event, exec_session_request, ExecResult, ExecSessionEvent, ExecSessionRequest,
    TerminalSize,
};

/// Input messages queued ahead of the network. Small: stdin already arrives in pieces, and a
/// short queue makes a slow command push back on whoever feeds it.
pub(crate) const SESSION_QUEUE: usize = 16;

/// One piece of a session's output.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionEvent {
    /// Bytes the command wrote to stdout (with a terminal: everything it wrote).
    Stdout(Vec<u8>),
    /// Bytes the command wrote to stderr (never with a terminal).
    Stderr(Vec<u8>),
    /// The command has ended; always the last event. Its `stdout`/`stderr` are empty: they
    /// were streamed. (Boxed: a result is ten times the size of the other events.)
    Finished(Box<ExecResult>),
}

/// A running interactive exec: its input and its output.
#[derive(Debug)]
pub struct ExecSession {
    input: SessionInput,
    events: SessionEvents,
}

impl ExecSession {
    /// The exec's id (as in `ListExecs` and `GetExec`).
    pub fn exec_id(&self) -> &str {
        self.events.exec_id()
    }

    /// The input handle and the output stream, to be driven from separate tasks or branches.
    pub fn split(self) -> (SessionInput, SessionEvents) {
        (self.input, self.events)
    }

    /// The input handle (clone it to keep one).
    pub fn input(&self) -> &SessionInput {
        &self.input
    }

    /// The next output event; `None` after [`SessionEvent::Finished`].
    pub async fn next_event(&mut self) -> Result<Option<SessionEvent>> {
        self.events.next_event().await
    }
}

/// Sends input to a session. Clones share the session.
///
/// Every method waits while the queue to the daemon is full and fails with
/// [`Error::SessionClosed`] once the session is over.
#[derive(Clone, Debug)]
pub struct SessionInput {
    tx: mpsc::Sender<ExecSessionRequest>,
}

impl SessionInput {
    async fn send(&self, item: exec_session_request::Item) -> Result<()> {
        self.tx
            .send(ExecSessionRequest { item: Some(item) })
            .await
            .map_err(|_| Error::SessionClosed)
    }

    /// Bytes for the command's stdin (on a terminal: keys, so `b"\x03"` is Ctrl-C).
    pub async fn stdin(&self, data: impl Into<Vec<u8>>) -> Result<()> {
        self.send(exec_session_request::Item::Stdin(data.into()))
            .await
    }

    /// Ends the command's stdin (on a terminal: the end-of-file character, as Ctrl-D).
    pub async fn close_stdin(&self) -> Result<()> {
        self.send(exec_session_request::Item::CloseStdin(true))
            .await
    }

    /// Sends a signal (a Linux signal number) to the command's whole process tree.
    pub async fn signal(&self, signal: i32) -> Result<()> {
        self.send(exec_session_request::Item::Signal(signal)).await
    }

    /// Tells the command's terminal its new size (ignored without a terminal).
    pub async fn resize(&self, rows: u32, cols: u32) -> Result<()> {
        self.send(exec_session_request::Item::Resize(TerminalSize {
            rows,
            cols,
        }))
        .await
    }
}

/// A session's output: [`SessionEvent`]s, the last one [`SessionEvent::Finished`].
///
/// Also a [`Stream`] of them. While this is alive the request stream stays open, even once
/// every [`SessionInput`] is dropped: so dropping the input is never mistaken for anything
/// (close stdin with [`SessionInput::close_stdin`]). Dropping this before the result has come
/// cancels the call, and the daemon ends the command (unless it has an idempotency key).
#[derive(Debug)]
pub struct SessionEvents {
    inner: tonic::Streaming<ExecSessionEvent>,
    exec_id: String,
    /// An event that came before `started` was seen (kept, not lost).
    pending: Option<SessionEvent>,
    finished: bool,
    /// Dropped with this, which lets the request stream end.
    _hold_open: oneshot::Sender<()>,
}

impl SessionEvents {
    /// The exec's id.
    pub fn exec_id(&self) -> &str {
        &self.exec_id
    }

    /// The next event; `None` after [`SessionEvent::Finished`]. A stream that ends without a
    /// result is an error.
    pub async fn next_event(&mut self) -> Result<Option<SessionEvent>> {
        if let Some(event) = self.pending.take() {
            return Ok(Some(self.seen(event)));
        }
        if self.finished {
            return Ok(None);
        }
        loop {
            let Some(message) = self.inner.message().await? else {
                return Err(Error::Protocol(format!(
                    "exec session {} ended without a result",
                    self.exec_id
                )));
            };
            if let Some(event) = convert(message) {
                return Ok(Some(self.seen(event)));
            }
        }
    }

    fn seen(&mut self, event: SessionEvent) -> SessionEvent {
        if matches!(event, SessionEvent::Finished(_)) {
            self.finished = true;
        }
        event
    }

    /// Reads to the end and returns the result with `stdout` and `stderr` filled in from the
    /// streamed output, keeping at most `limit` bytes of each (the rest is counted in the
    /// result's `*_total_bytes` and marked `*_truncated`).
    pub async fn into_result(mut self, limit: usize) -> Result<ExecResult> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let (mut out_cut, mut err_cut) = (false, false);
        let keep = |buf: &mut Vec<u8>, cut: &mut bool, chunk: &[u8]| {
            let room = limit.saturating_sub(buf.len());
            buf.extend_from_slice(&chunk[..room.min(chunk.len())]);
            *cut |= chunk.len() > room;
        };
        while let Some(event) = self.next_event().await? {
            match event {
                SessionEvent::Stdout(chunk) => keep(&mut stdout, &mut out_cut, &chunk),
                SessionEvent::Stderr(chunk) => keep(&mut stderr, &mut err_cut, &chunk),
                SessionEvent::Finished(result) => {
                    let mut result = *result;
                    result.stdout = stdout;
                    result.stderr = stderr;
                    result.stdout_truncated |= out_cut;
                    result.stderr_truncated |= err_cut;
                    return Ok(result);
                }
            }
        }
        Err(Error::Protocol(format!(
            "exec session {} was read past its result",
            self.exec_id
        )))
    }
}

impl Stream for SessionEvents {
    type Item = Result<SessionEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(event) = self.pending.take() {
            return Poll::Ready(Some(Ok(self.seen(event))));
        }
        if self.finished {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(status))) => return Poll::Ready(Some(Err(status.into()))),
                Poll::Ready(None) => {
                    self.finished = true;
                    return Poll::Ready(Some(Err(Error::Protocol(format!(
                        "exec session {} ended without a result",
                        self.exec_id
                    )))));
                }
                Poll::Ready(Some(Ok(message))) => {
                    if let Some(event) = convert(message) {
                        return Poll::Ready(Some(Ok(self.seen(event))));
                    }
                }
            }
        }
    }
}

/// A daemon message as a [`SessionEvent`]; `None` for what carries nothing for the caller (a
/// repeated `started`, an event this build does not know).
fn convert(message: ExecSessionEvent) -> Option<SessionEvent> {
    match message.event? {
        exec_session_event::Event::Stdout(data) => Some(SessionEvent::Stdout(data)),
        exec_session_event::Event::Stderr(data) => Some(SessionEvent::Stderr(data)),
        exec_session_event::Event::Result(result) => Some(SessionEvent::Finished(Box::new(result))),
        exec_session_event::Event::Started(_) => None,
    }
}

/// Starts a session on the generated stub: sends `start`, then waits for `started`.
pub(crate) async fn open(
    raw: &mut crate::client::RawClient,
    start: crate::proto::ExecSessionStart,
) -> Result<ExecSession> {
    let (tx, rx) = mpsc::channel(SESSION_QUEUE);
    let (hold_open, released) = oneshot::channel::<()>();
    // Queued before the call so the daemon has it as soon as the stream opens; the receiver
    // is alive, so this cannot fail.
    tx.send(ExecSessionRequest {
        item: Some(exec_session_request::Item::Start(start)),
    })
    .await
    .map_err(|_| Error::SessionClosed)?;
    // The request stream: the input, then, once every input handle is gone, nothing until the
    // events are dropped (`released` resolves when `hold_open` is dropped).
    let requests = tokio_stream::wrappers::ReceiverStream::new(rx).chain(
        futures::stream::once(released)
            .filter_map(|_| futures::future::ready(None::<ExecSessionRequest>)),
    );
    let mut inner = raw.exec_session(requests).await?.into_inner();
    // The contract says `started` comes first. Should anything else come first, keep it.
    let (exec_id, pending) = match inner.message().await? {
        None => {
            return Err(Error::Protocol(
                "exec session ended before the command started".into(),
            ))
        }
        Some(ExecSessionEvent {
            event: Some(exec_session_event::Event::Started(started)),
        }) => (started.exec_id, None),
        Some(ExecSessionEvent {
            event: Some(exec_session_event::Event::Result(result)),
        }) => (result.exec_id.clone(), convert_result(result)),
        Some(other) => (String::new(), convert(other)),
    };
    Ok(ExecSession {
        input: SessionInput { tx },
        events: SessionEvents {
            inner,
            exec_id,
            pending,
            finished: false,
            _hold_open: hold_open,
        },
    })
}

fn convert_result(result: ExecResult) -> Option<SessionEvent> {
    Some(SessionEvent::Finished(Box::new(result)))
}
