//! The live stdin of an interactive exec (protocol 3): a bounded queue filled by the request
//! reader and a writer thread of the exec's own that empties it into the command's stdin.
//!
//! Why a thread per exec: writing to a command's stdin blocks as long as the command does not
//! read, and the request reader must never block on one command (every other exec, `Signal`
//! included, would stall behind it). Why the reader queues instead of handing each request a
//! thread like the others: threads could run in any order, and stdin bytes must not. The reader
//! only appends (a mutex held for a push, never across I/O); the writer applies the requests in
//! order and answers each once applied, which is the host's flow control: a host that waits for
//! the answer before sending more never overfills the queue, and a command that stops reading
//! stops its sender. A host that does not wait is refused past [`MAX_INPUT_QUEUE`] requests or
//! [`MAX_INPUT_BYTES`] bytes.
//!
//! The writer never blocks for good either: it writes non-blocking and polls the descriptor
//! together with a stop pipe that [`Feed::stop`] closes when the exec's main process ends, so a
//! background process that holds the pipe without reading cannot keep the thread (or its
//! descriptor) alive. What is still queued then is answered `Error{NoSuchExec}`.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};

use guest_agent::protocol::{ErrorKind, Response, MAX_INPUT_BYTES, MAX_INPUT_QUEUE};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::console::log;
use super::RequestError;

/// Stack of a writer thread: it writes, polls and encodes small answers.
const WRITER_STACK: usize = 128 << 10;

/// Sends a frame answering request `id` (the agent's connection, shared by every thread).
pub type Answer = Arc<dyn Fn(u64, &Response, &[u8]) + Send + Sync>;

/// One input request, as the writer applies it.
#[derive(Debug)]
pub enum Input {
    /// `Stdin`: bytes to write.
    Bytes(Vec<u8>),
    /// `CloseStdin`: close the pipe, or type the terminal's end-of-file character.
    Close,
    /// `Resize`: the terminal's new size (nothing without a terminal).
    Resize { rows: u16, cols: u16 },
}

impl Input {
    fn len(&self) -> usize {
        match self {
            Input::Bytes(b) => b.len(),
            _ => 0,
        }
    }
}

/// Where the command's stdin is.
pub enum Target {
    /// The write end of its stdin pipe: closing it is the command's end of file.
    Pipe(OwnedFd),
    /// The master side of its terminal (a descriptor of its own, sharing the file description
    /// the exec's output is read from).
    Terminal(OwnedFd),
}

struct State {
    queue: VecDeque<(u64, Input)>,
    /// Payload bytes in `queue`.
    bytes: usize,
    stopped: bool,
}

/// The input side of one interactive exec; see the module documentation.
pub struct Feed {
    exec_id: String,
    state: Mutex<State>,
    wake: Condvar,
    /// Dropped by [`Feed::stop`]: the writer's poll then sees its read end hang up.
    stop_w: Mutex<Option<OwnedFd>>,
}

impl Feed {
    /// Starts the writer thread of `exec_id`: it writes `first` (the exec's payload), then what
    /// is [`push`](Feed::push)ed, answering through `answer`. Fails only when the pipe or the
    /// thread cannot be made — before the command is started, so nothing is left running.
    pub fn start(exec_id: &str, target: Target, first: Vec<u8>, answer: Answer) -> Result<Arc<Feed>, RequestError> {
        let internal = |what: &str, e: &dyn std::fmt::Display| RequestError::new(ErrorKind::Internal, format!("{what} for the stdin of exec {exec_id}: {e}"));
        let (stop_r, stop_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| internal("cannot make a pipe", &e))?;
        let fd = match &target {
            Target::Pipe(fd) | Target::Terminal(fd) => fd,
        };
        set_nonblocking(fd).map_err(|e| internal("cannot make the descriptor non-blocking", &e))?;
        let feed = Arc::new(Feed {
            exec_id: exec_id.to_string(),
            state: Mutex::new(State { queue: VecDeque::new(), bytes: 0, stopped: false }),
            wake: Condvar::new(),
            stop_w: Mutex::new(Some(stop_w)),
        });
        let writer = Writer { target: Some(target), stop_r };
        let thread_feed = feed.clone();
        std::thread::Builder::new()
            .name(format!("stdin-{exec_id}"))
            .stack_size(WRITER_STACK)
            .spawn(move || thread_feed.run(writer, first, &answer))
            .map_err(|e| internal("cannot start the writer thread", &e))?;
        Ok(feed)
    }

    /// Queues request `id` for the writer, which answers it. Refused (for the caller to answer)
    /// once the exec's main process has ended, or when the queue is at its bounds.
    pub fn push(&self, id: u64, input: Input) -> Result<(), RequestError> {
        let len = input.len();
        if len > MAX_INPUT_BYTES {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("{len} stdin bytes in one request; at most {MAX_INPUT_BYTES}")));
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.stopped {
            return Err(RequestError::new(ErrorKind::NoSuchExec, format!("exec {} has ended", self.exec_id)));
        }
        if st.queue.len() >= MAX_INPUT_QUEUE || st.bytes + len > MAX_INPUT_BYTES {
            return Err(RequestError::new(
                ErrorKind::BadRequest,
                format!("the input queue of exec {} is full ({} requests, {} bytes): wait for the answers", self.exec_id, st.queue.len(), st.bytes),
            ));
        }
        st.bytes += len;
        st.queue.push_back((id, input));
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    /// The exec's main process ended: the writer stops (a write in progress included), answers
    /// what is still queued with `NoSuchExec`, closes its descriptor and exits; later pushes are
    /// refused. Idempotent.
    pub fn stop(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        self.stop_w.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.wake.notify_all();
    }

    /// The next request, waiting for one; `None` once stopped.
    fn next(&self) -> Option<(u64, Input)> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.stopped {
                return None;
            }
            if let Some((id, input)) = st.queue.pop_front() {
                st.bytes -= input.len();
                return Some((id, input));
            }
            st = self.wake.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn gone(&self) -> Response {
        Response::Error { kind: ErrorKind::NoSuchExec, message: format!("exec {} ended before the input was written", self.exec_id) }
    }

    /// The writer thread.
    fn run(&self, mut writer: Writer, first: Vec<u8>, answer: &Answer) {
        let mut stopped = writer.write_all(&first).is_err();
        while !stopped {
            let Some((id, input)) = self.next() else { break };
            let applied = match input {
                Input::Bytes(bytes) => writer.write_all(&bytes),
                Input::Close => writer.close(),
                Input::Resize { rows, cols } => {
                    writer.resize(rows, cols);
                    Ok(())
                }
            };
            stopped = applied.is_err();
            answer(id, &if stopped { self.gone() } else { Response::Ok }, &[]);
        }
        // Whatever `stop` left in the queue: also what a push raced in before `stopped` was set.
        let left: Vec<u64> = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.stopped = true;
            st.bytes = 0;
            st.queue.drain(..).map(|(id, _)| id).collect()
        };
        // The command's stdin closes here, before the answers (which may wait on the host).
        drop(writer);
        for id in left {
            answer(id, &self.gone(), &[]);
        }
    }
}

/// The exec's main process ended first.
struct Stopped;

/// The writer thread's side: the command's stdin and the stop pipe.
struct Writer {
    /// `None` once closed (by `CloseStdin` on a pipe, or because the command closed its end):
    /// later bytes are discarded, as on a pipe nobody reads.
    target: Option<Target>,
    stop_r: OwnedFd,
}

impl Writer {
    fn fd(&self) -> Option<&OwnedFd> {
        match &self.target {
            Some(Target::Pipe(fd) | Target::Terminal(fd)) => Some(fd),
            None => None,
        }
    }

    /// Writes all of `bytes`, waiting for room as long as the exec runs.
    fn write_all(&mut self, mut bytes: &[u8]) -> Result<(), Stopped> {
        while !bytes.is_empty() {
            let Some(fd) = self.fd() else { return Ok(()) };
            match nix::unistd::write(fd, bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => self.wait_writable()?,
                // EPIPE: the command closed its stdin, which is its right; EIO: its terminal
                // hung up. Either way nothing more can be delivered.
                Err(_) => self.target = None,
            }
        }
        Ok(())
    }

    /// Waits until the descriptor takes bytes again, or the exec is over.
    fn wait_writable(&self) -> Result<(), Stopped> {
        let Some(fd) = self.fd() else { return Ok(()) };
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT), PollFd::new(self.stop_r.as_fd(), PollFlags::POLLIN)];
        match nix::poll::poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                log!("poll on the stdin of an exec: {e}");
                return Err(Stopped);
            }
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            return Err(Stopped);
        }
        Ok(())
    }

    /// A pipe is closed; a terminal, which has no half-close, gets its end-of-file character.
    fn close(&mut self) -> Result<(), Stopped> {
        match &self.target {
            Some(Target::Terminal(_)) => self.write_all(&[sandbox_exec::pty::VEOF]),
            Some(Target::Pipe(_)) | None => {
                self.target = None;
                Ok(())
            }
        }
    }

    fn resize(&self, rows: u16, cols: u16) {
        if let Some(Target::Terminal(master)) = &self.target {
            if let Err(e) = sandbox_exec::pty::resize(master, rows, cols) {
                log!("resizing the terminal of an exec: {e}");
            }
        }
    }
}

/// Sets O_NONBLOCK on `fd` (on a terminal's master: on the file description the output is read
/// from too, which the exec reads non-blocking anyway).
pub fn set_nonblocking(fd: &OwnedFd) -> Result<(), Errno> {
    let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK)).map(drop)
}

/// Stops a feed however the exec's handler ends (a panic included).
pub struct StopOnDrop(pub Arc<Feed>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn answers() -> (Answer, mpsc::Receiver<(u64, Response)>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let answer: Answer = Arc::new(move |id, resp: &Response, _: &[u8]| {
            let _ = tx.lock().expect("lock").send((id, resp.clone()));
        });
        (answer, rx)
    }

    fn read_all(fd: &OwnedFd) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => return out,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(Errno::EINTR) => {}
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    #[test]
    fn bytes_arrive_in_order_and_close_ends_the_pipe() {
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).expect("pipe");
        let (answer, rx) = answers();
        let feed = Feed::start("ex-t", Target::Pipe(w), b"first;".to_vec(), answer).expect("start");
        for i in 0..20u64 {
            feed.push(i, Input::Bytes(format!("{i};").into_bytes())).expect("push");
        }
        feed.push(20, Input::Resize { rows: 1, cols: 1 }).expect("a resize of a pipe is ignored");
        feed.push(21, Input::Close).expect("push");
        feed.push(22, Input::Bytes(b"discarded".to_vec())).expect("push");
        let expected: String = std::iter::once("first;".to_string()).chain((0..20).map(|i| format!("{i};"))).collect();
        assert_eq!(read_all(&r), expected.as_bytes(), "EOF after the close");
        let got: Vec<(u64, Response)> = (0..23).map(|_| rx.recv_timeout(Duration::from_secs(5)).expect("answer")).collect();
        assert_eq!(got, (0..23).map(|i| (i, Response::Ok)).collect::<Vec<_>>(), "one Ok per request, in order");
        feed.stop();
        let refused = feed.push(23, Input::Bytes(b"late".to_vec())).expect_err("stopped");
        assert_eq!(refused.kind, ErrorKind::NoSuchExec);
    }

    #[test]
    fn a_stuck_reader_fills_the_bounded_queue_and_stop_answers_the_rest() {
        let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).expect("pipe");
        let (answer, rx) = answers();
        // Nobody reads `r`: the pipe fills, the writer waits, the queue fills behind it.
        let feed = Feed::start("ex-stuck", Target::Pipe(w), vec![b'x'; 1 << 20], answer).expect("start");
        let chunk = MAX_INPUT_BYTES / 4;
        let mut queued = Vec::new();
        let refused = loop {
            let id = queued.len() as u64;
            match feed.push(id, Input::Bytes(vec![b'y'; chunk])) {
                Ok(()) => queued.push(id),
                Err(e) => break e,
            }
            assert!(queued.len() <= MAX_INPUT_QUEUE, "unbounded");
        };
        assert_eq!(refused.kind, ErrorKind::BadRequest, "{refused}");
        assert!(queued.len() <= 4, "{} queued", queued.len());
        assert!(feed.push(99, Input::Bytes(vec![0; MAX_INPUT_BYTES + 1])).is_err());
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "nothing was written, nothing answered");
        feed.stop();
        let got: Vec<(u64, Response)> = queued.iter().map(|_| rx.recv_timeout(Duration::from_secs(5)).expect("answer")).collect();
        for (i, (id, resp)) in got.iter().enumerate() {
            assert_eq!(*id, i as u64);
            assert!(matches!(resp, Response::Error { kind: ErrorKind::NoSuchExec, .. }), "{resp:?}");
        }
        // The writer let go of the pipe: its reader sees EOF once the buffered bytes are read.
        set_nonblocking(&r).expect("nonblock");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match nix::unistd::read(r.as_raw_fd(), &mut buf) {
                Ok(0) => break,
                Ok(_) | Err(Errno::EAGAIN) => {}
                Err(e) => panic!("read: {e}"),
            }
            assert!(std::time::Instant::now() < deadline, "the writer kept the pipe");
        }
    }
}
