//! One `Exec` (or `ExecSession`), from request to final record, on the request's own thread.
//!
//! The recipe mirrors the process tier: make the exec's cgroup, fork a child that joins it and
//! execs (see [`sandbox_exec::spawn`]), say `Started`, then one poll loop feeds stdin, captures
//! both output streams (streaming them when asked) and watches for the exit, the timeout and —
//! after the exit — the bounded wait for pipes a background process may hold open. A background
//! process the command left running is the user's and lives on (as on the other tiers): its
//! cgroup is kept and removed once it is empty. A timeout or a kill takes the whole tree.
//!
//! A session differs in two places only. With a terminal, the command's stdio is the slave side
//! of a pseudo-terminal opened in the guest's devpts (its controlling terminal), and the poll
//! loop reads the master side as the one `stdout` stream (EIO there is the end of file). When
//! interactive, stdin is not written by the poll loop but by a [`Feed`] of the exec's own, which
//! the `Stdin` / `CloseStdin` / `Resize` requests reach through [`Running::input`] until the main
//! process ends.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_agent::protocol::{ErrorKind, ExecExit, ExecRequest, ExitStatus, Response, Stream, StreamMeta};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use sandbox_exec::capture::{CapturedOutput, OutputCapture, SpillTarget};

use super::cgroup::{ExecCgroup, SandboxCgroup, Usage};
use super::console::log;
use super::files::Files;
use super::input::{Answer, Feed, Input, StopOnDrop, Target};
use super::reaper::{ChildExit, Reaper};
use super::RequestError;
use sandbox_exec::spawn::{self, describe_failure, ChildFds, Command, Stage};

pub use sandbox_exec::capture::SPILL_DIR;
/// Largest `Output` frame payload, and the read size.
const CHUNK: usize = 64 << 10;
/// The daemon's ceiling per stream; both streams must fit one final frame.
const MAX_CAPTURE: u64 = 16 << 20;
/// How long a killed exec may take to be reported dead.
const KILL_GRACE: Duration = Duration::from_secs(5);
const MAX_EXEC_ID: usize = 128;
/// The `ptmx` of the devpts the guest mounts at boot: where an exec's terminal is opened.
const PTMX: &str = "/dev/pts/ptmx";

/// Execs in progress, by exec id, for `Signal` and to refuse a duplicate id.
#[derive(Default)]
pub struct Running {
    /// `None` while the exec is being set up.
    execs: Mutex<HashMap<String, Option<Arc<Group>>>>,
}

impl Running {
    /// Signals every process of a running exec; false when there is none of that id.
    pub fn signal(&self, exec_id: &str, signal: i32) -> bool {
        let group = self.execs.lock().unwrap_or_else(|p| p.into_inner()).get(exec_id).cloned().flatten();
        match group {
            Some(g) => {
                g.signal(signal);
                true
            }
            None => false,
        }
    }

    /// Queues live input (request `id`) for the running interactive exec `exec_id`; its writer
    /// answers it. An error is for the caller to answer: `NoSuchExec` when there is no such exec
    /// (any more), `BadRequest` when it is not interactive or its queue is full.
    pub fn input(&self, id: u64, exec_id: &str, input: Input) -> Result<(), RequestError> {
        let group = self.execs.lock().unwrap_or_else(|p| p.into_inner()).get(exec_id).cloned().flatten();
        let Some(group) = group else {
            return Err(RequestError::new(ErrorKind::NoSuchExec, format!("no running exec {exec_id}")));
        };
        match group.input.get() {
            Some(feed) => feed.push(id, input),
            None => Err(RequestError::new(ErrorKind::BadRequest, format!("exec {exec_id} is not interactive: its stdin was only the request's payload"))),
        }
    }

    /// Claims `exec_id`, before anything named after it (its cgroup, its spill files) is made.
    fn reserve(&self, exec_id: &str) -> Result<Reservation<'_>, RequestError> {
        let mut execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
        if execs.contains_key(exec_id) {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("exec {exec_id} is already running")));
        }
        execs.insert(exec_id.to_string(), None);
        Ok(Reservation { running: self, exec_id: exec_id.to_string() })
    }
}

/// Removes the exec from [`Running`] however its handler ends (a panic included).
struct Reservation<'a> {
    running: &'a Running,
    exec_id: String,
}

impl Reservation<'_> {
    fn set(&self, group: Arc<Group>) {
        self.running.execs.lock().unwrap_or_else(|p| p.into_inner()).insert(self.exec_id.clone(), Some(group));
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.running.execs.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.exec_id);
    }
}

/// Every process of one exec: its cgroup, or (unit tests only) its process group.
struct Group {
    cgroup: Option<ExecCgroup>,
    /// The main process, which leads its session and process group; 0 until forked.
    pid: Mutex<i32>,
    /// The stdin writer of an interactive exec, set before the command starts.
    input: std::sync::OnceLock<Arc<Feed>>,
}

impl Group {
    fn signal(&self, signal: i32) {
        match &self.cgroup {
            Some(cg) => cg.signal(signal),
            None => {
                let pid = *self.pid.lock().unwrap_or_else(|p| p.into_inner());
                if pid > 0 {
                    // SAFETY: kill(2) of a process group with plain integers.
                    unsafe { libc::kill(-pid, signal) };
                }
            }
        }
    }

    fn kill(&self) {
        match &self.cgroup {
            Some(cg) => cg.kill(),
            None => self.signal(libc::SIGKILL),
        }
    }

    fn usage(&self) -> Usage {
        self.cgroup.as_ref().map(ExecCgroup::usage).unwrap_or_default()
    }
}

impl Drop for Group {
    /// The cgroup goes with the record, unless background processes of the command still run
    /// in it: then it is kept until they are gone ([`sweep_leftovers`]).
    fn drop(&mut self) {
        if let Some(cg) = self.cgroup.take() {
            if cg.is_populated() {
                LEFTOVERS.lock().unwrap_or_else(|p| p.into_inner()).push(cg);
            } else {
                cg.remove();
            }
        }
    }
}

/// Cgroups of finished execs whose background processes still run.
static LEFTOVERS: Mutex<Vec<ExecCgroup>> = Mutex::new(Vec::new());

/// Removes the kept cgroups that have emptied since.
fn sweep_leftovers() {
    let mut left = LEFTOVERS.lock().unwrap_or_else(|p| p.into_inner());
    left.retain(|cg| {
        if cg.is_populated() {
            return true;
        }
        cg.remove();
        false
    });
}

/// Kills an exec's processes when its time is up, unless disarmed first.
struct Watchdog {
    state: Arc<(Mutex<bool>, std::sync::Condvar)>,
    fired: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn arm(after: Duration, group: Arc<Group>) -> Watchdog {
        let state = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, f) = (state.clone(), fired.clone());
        let thread = std::thread::Builder::new().name("exec-timeout".into()).stack_size(64 << 10).spawn(move || {
            let (disarmed, cv) = &*s;
            let guard = disarmed.lock().unwrap_or_else(|p| p.into_inner());
            let (guard, _) = cv.wait_timeout_while(guard, after, |d| !*d).unwrap_or_else(|p| p.into_inner());
            if !*guard {
                f.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(guard);
                // The whole tree goes, daemons included; the exit report follows.
                group.kill();
            }
        });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                log!("cannot start an exec timeout thread: {e}");
                None
            }
        };
        Watchdog { state, fired, thread }
    }

    /// Stops the watchdog; true if it had already fired.
    fn disarm(mut self) -> bool {
        let (disarmed, cv) = &*self.state;
        *disarmed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.fired.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A spill file inside the guest, opened only when a stream outgrows its cap.
struct GuestSpill {
    files: Files,
    path: String,
}

impl SpillTarget for GuestSpill {
    fn open(&mut self) -> std::io::Result<Box<dyn std::io::Write + Send>> {
        let file = self.files.create(&self.path).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Box::new(std::io::BufWriter::with_capacity(CHUNK, file)))
    }
    fn path(&self) -> String {
        self.path.clone()
    }
}

/// An exec id is a directory name in the cgroup tree and in the spill dir.
fn validate_exec_id(id: &str) -> Result<(), RequestError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_EXEC_ID
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(RequestError::new(ErrorKind::BadRequest, format!("invalid exec id {id:?}: want 1-{MAX_EXEC_ID} of [A-Za-z0-9._-], not starting with '.'")))
    }
}

/// What the exec needs from the agent.
pub struct Env<'a> {
    pub files: &'a Files,
    /// Always present in the guest; `None` only in unit tests, which cannot make cgroups.
    pub cgroup: Option<&'a SandboxCgroup>,
    pub running: &'a Running,
    /// Answers requests other than the exec's own (the input requests of an interactive exec).
    pub answer: Answer,
}

/// How the command's stdin and terminal work (all off for a plain `Exec`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Session {
    /// Run on a new pseudo-terminal of (rows, cols).
    pub tty: Option<(u16, u16)>,
    /// Stdin stays open after the payload, for `Stdin` / `CloseStdin` / `Resize`.
    pub interactive: bool,
}

/// The final record and its payload (captured stdout, then stderr).
pub type Finished = (ExecExit, Vec<u8>);

fn spawn_failed(code: i32, error: String) -> Finished {
    let exit = ExecExit {
        status: ExitStatus::SpawnFailed,
        exit_code: code,
        signal: 0,
        duration_ms: 0,
        cpu_user_ms: 0,
        cpu_system_ms: 0,
        peak_memory_bytes: 0,
        stdout: StreamMeta::default(),
        stderr: StreamMeta::default(),
        error,
    };
    (exit, Vec::new())
}

fn pipe() -> Result<(OwnedFd, OwnedFd), RequestError> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| RequestError::new(ErrorKind::Internal, format!("pipe: {e}")))
}

fn set_nonblocking(fd: &OwnedFd) {
    if let Ok(flags) = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL) {
        let _ = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK));
    }
}

/// Runs `req` to its end. `send` delivers `Started` and `Output` frames.
pub fn run(env: &Env<'_>, req: &ExecRequest, session: Session, stdin: Vec<u8>, send: &dyn Fn(&Response, &[u8])) -> Result<Finished, RequestError> {
    validate_exec_id(&req.exec_id)?;
    sweep_leftovers();
    let cmd = match Command::new(&req.argv, &req.env, &req.workdir) {
        Ok(c) if session.tty.is_some() => c.on_terminal(),
        Ok(c) => c,
        Err(why) => {
            let (code, _) = describe_failure(Stage::Setup, nix::errno::Errno::EINVAL, "", "", None);
            return Ok(spawn_failed(code, format!("cannot run the command: {why}")));
        }
    };
    // The guest's own passwd and group (the agent runs behind switch_root).
    let cmd = match req.user.as_deref().map(|u| sandbox_exec::user::resolve(u, std::path::Path::new("/etc"))).transpose() {
        Ok(Some(creds)) => cmd.as_user(&creds),
        Ok(None) => cmd,
        Err(e) => {
            let (code, error) = describe_failure(Stage::User, e.errno(), &req.argv[0], &req.workdir, req.user.as_deref());
            return Ok(spawn_failed(code, error));
        }
    };
    let reservation = env.running.reserve(&req.exec_id)?;
    let cgroup = match env.cgroup {
        Some(sandbox) => Some(sandbox.create_exec(&req.exec_id).map_err(|e| RequestError::new(ErrorKind::Internal, e.to_string()))?),
        None => None,
    };
    let group = Arc::new(Group { cgroup, pid: Mutex::new(0), input: std::sync::OnceLock::new() });
    reservation.set(group.clone());
    let result = run_in_group(env, req, session, &cmd, &group, stdin, send);
    // The exec leaves `Running` first, then its cgroup goes (dropping the last `Group`).
    drop(reservation);
    drop(group);
    result
}

/// A descriptor of its own on `fd`'s open file (a terminal's master, for its stdin writer).
fn dup(fd: &OwnedFd) -> Result<OwnedFd, RequestError> {
    fd.try_clone().map_err(|e| RequestError::new(ErrorKind::Internal, format!("dup: {e}")))
}

fn run_in_group(
    env: &Env<'_>,
    req: &ExecRequest,
    session: Session,
    cmd: &Command,
    group: &Arc<Group>,
    stdin: Vec<u8>,
    send: &dyn Fn(&Response, &[u8]),
) -> Result<Finished, RequestError> {
    // The sandbox's workdir was made at Configure; a missing per-exec workdir is a start failure
    // reported by the child's chdir, as on the other tiers.
    let procs = match &group.cgroup {
        Some(cg) => Some(cg.procs_file().map_err(|e| RequestError::new(ErrorKind::Internal, e.to_string()))?),
        None => None,
    };
    // The command's stdio (0, 1, 2: only the child keeps them), where its stdin is written and
    // where its output is read: three pipes, or a terminal whose slave is all three of the
    // command's and whose master is both of ours.
    let (theirs, stdin_to, stdout_r, stderr_r) = match session.tty {
        None => {
            let (stdin_r, stdin_w) = pipe()?;
            let (stdout_r, stdout_w) = pipe()?;
            let (stderr_r, stderr_w) = pipe()?;
            (vec![stdin_r, stdout_w, stderr_w], Target::Pipe(stdin_w), stdout_r, Some(stderr_r))
        }
        Some((rows, cols)) => match sandbox_exec::pty::open(PTMX, rows, cols) {
            Ok((master, slave)) => (vec![slave], Target::Terminal(dup(&master)?), master, None),
            Err(e) => {
                let (code, _) = describe_failure(Stage::Setup, e, &req.argv[0], &req.workdir, req.user.as_deref());
                return Ok(spawn_failed(code, format!("cannot open a terminal for {}: {}", req.argv[0], e.desc())));
            }
        },
    };
    // Stdin: the payload written by the poll loop then closed (a plain exec), or everything
    // written by the writer of an interactive exec — started before the command, so a failure
    // leaves nothing running, and registered before `Started`, after which the host may send
    // input. The writer stops when the main process ends, or when this handler ends anyhow.
    let (plain_stdin, feed) = if session.interactive {
        let feed = Feed::start(&req.exec_id, stdin_to, stdin, env.answer.clone())?;
        let _ = group.input.set(feed.clone());
        (None, Some(StopOnDrop(feed)))
    } else {
        let plain = match stdin_to {
            // No stdin: the pipe closes right here, so the command reads EOF at once.
            Target::Pipe(w) => (!stdin.is_empty()).then_some((w, stdin, 0)),
            // A terminal has no half-close: the payload, then its end-of-file character.
            Target::Terminal(w) => {
                let mut bytes = stdin;
                bytes.push(sandbox_exec::pty::VEOF);
                Some((w, bytes, 0))
            }
        };
        (plain, None)
    };
    let (err_r, err_w) = pipe()?;
    let procs_fds: Vec<_> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let fd = |i: usize| theirs[i.min(theirs.len() - 1)].as_raw_fd();
    let fds = ChildFds { stdio: [fd(0), fd(1), fd(2)], cgroup_procs: &procs_fds, err_w: err_w.as_raw_fd() };
    let spawned = Reaper::global().spawn(|| spawn::child(cmd, &fds));
    // Only the child keeps these: EOF on the pipes (EIO on the terminal's master) then means
    // "every writer is gone".
    drop((theirs, err_w, procs));
    let (pid, watch) = match spawned {
        Ok(s) => s,
        Err(e) => {
            let (code, error) = describe_failure(Stage::Setup, e.errno, &req.argv[0], &req.workdir, req.user.as_deref());
            return Ok(spawn_failed(code, error));
        }
    };
    *group.pid.lock().unwrap_or_else(|p| p.into_inner()) = pid;
    if let Some((stage, errno)) = spawn::read_failure(&err_r) {
        // The child _exits right away; wait for it so its cgroup can be removed.
        let _ = ChildExit::read(&watch);
        let (code, error) = describe_failure(stage, errno, &req.argv[0], &req.workdir, req.user.as_deref());
        return Ok(spawn_failed(code, error));
    }
    drop(err_r);
    send(&Response::Started, &[]);

    let cap = usize::try_from(req.max_output_bytes.min(MAX_CAPTURE)).unwrap_or(usize::MAX);
    let spill = |stream: &str| -> Option<Box<dyn SpillTarget>> {
        Some(Box::new(GuestSpill { files: env.files.clone(), path: format!("{SPILL_DIR}/{}.{stream}", req.exec_id) }))
    };
    let mut io = Io {
        stdin: plain_stdin,
        outputs: [
            Some(Output { fd: stdout_r, stream: Stream::Stdout, capture: OutputCapture::new(cap, spill("stdout")) }),
            // None on a terminal: everything the command writes there is one stream, as stdout.
            stderr_r.map(|fd| Output { fd, stream: Stream::Stderr, capture: OutputCapture::new(cap, spill("stderr")) }),
        ],
        finished: Vec::new(),
        stream: req.stream,
        buf: vec![0u8; CHUNK],
    };
    for o in io.outputs.iter().flatten() {
        set_nonblocking(&o.fd);
    }
    if let Some((fd, _, _)) = &io.stdin {
        set_nonblocking(fd);
    }

    let t0 = Instant::now();
    // The timeout is kept by a thread of its own: this loop can block in `send` when the host
    // reads streamed output slowly, and that must not stretch the command's time.
    let watchdog = (req.timeout_ms > 0).then(|| Watchdog::arm(Duration::from_millis(req.timeout_ms), group.clone()));
    // Past this, a killed command that is still not reported dead is given up on.
    let give_up = (req.timeout_ms > 0).then(|| t0 + Duration::from_millis(req.timeout_ms) + KILL_GRACE);
    let mut watch = Some(watch);
    let mut exit: Option<ChildExit> = None;
    let mut duration = Duration::ZERO;
    let mut drain_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if exit.is_none() && give_up.is_some_and(|g| now >= g) {
            log!("exec {}: no exit report {} s after the timeout kill", req.exec_id, KILL_GRACE.as_secs());
            duration = t0.elapsed();
            break;
        }
        if exit.is_some() && (io.outputs.iter().all(Option::is_none) || drain_until.is_some_and(|d| now >= d)) {
            break;
        }
        let wake = if exit.is_some() { drain_until } else { give_up };
        let wait = wake.map(|w| w.saturating_duration_since(now));
        if io.poll(watch.as_ref(), wait, send) {
            // The watch is readable: the main process ended.
            if let Some(w) = watch.take() {
                let ended = ChildExit::read(&w);
                duration = ended.map(|(_, at)| at.saturating_duration_since(t0)).unwrap_or_else(|| t0.elapsed());
                exit = ended.map(|(e, _)| e);
                // Its stdin is of no use any more; input arriving from now on is refused.
                io.stdin = None;
                if let Some(StopOnDrop(feed)) = &feed {
                    feed.stop();
                }
                drain_until = Some(Instant::now() + Duration::from_millis(req.io_drain_ms));
            }
        }
    }
    let timed_out = watchdog.is_some_and(Watchdog::disarm);
    // Whatever is already in the pipes still counts, even if a background process holds them.
    io.drain_ready(send);
    // Background processes the command left are the user's: they keep running (a timeout
    // already took the whole tree).
    let usage = group.usage();
    let (stdout, stderr) = io.finish();

    use sandbox_exec::outcome::{classify, Cause, EndStatus, Exit};
    let observed = match exit {
        Some(ChildExit::Code(c)) => Exit::Code(c),
        Some(ChildExit::Signal(s)) => Exit::Signal(s),
        None => Exit::Unknown,
    };
    let end = classify(if timed_out { Cause::TimedOut } else { Cause::Ended }, observed, usage.oom_kills);
    let status = match end.status {
        EndStatus::Exited => ExitStatus::Exited,
        EndStatus::Signaled => ExitStatus::Signaled,
        EndStatus::TimedOut => ExitStatus::TimedOut,
        EndStatus::OomKilled => ExitStatus::OomKilled,
        EndStatus::Lost => ExitStatus::Lost,
    };
    let (exit_code, signal) = (end.exit_code, end.signal);
    let meta =
        |c: &CapturedOutput| StreamMeta { len: c.bytes.len() as u64, truncated: c.truncated, total_bytes: c.total_bytes, spill_path: c.spill_path.clone() };
    let exit = ExecExit {
        status,
        exit_code,
        signal,
        duration_ms: duration.as_millis() as u64,
        cpu_user_ms: usage.cpu_user_ms,
        cpu_system_ms: usage.cpu_system_ms,
        peak_memory_bytes: usage.peak_memory_bytes,
        stdout: meta(&stdout),
        stderr: meta(&stderr),
        error: if end.status == EndStatus::Lost { sandbox_exec::outcome::UNKNOWN_EXIT.to_string() } else { String::new() },
    };
    let mut payload = stdout.bytes;
    payload.extend_from_slice(&stderr.bytes);
    Ok((exit, payload))
}

struct Output {
    fd: OwnedFd,
    stream: Stream,
    capture: OutputCapture,
}

/// The pipes of one running exec.
struct Io {
    /// The write end, the bytes, and how many were written.
    stdin: Option<(OwnedFd, Vec<u8>, usize)>,
    /// `None` once the stream reached EOF.
    outputs: [Option<Output>; 2],
    finished: Vec<(Stream, CapturedOutput)>,
    stream: bool,
    buf: Vec<u8>,
}

impl Io {
    /// Waits up to `wait` (forever if `None`) and moves whatever bytes are ready. True when
    /// `watch` became readable.
    fn poll(&mut self, watch: Option<&OwnedFd>, wait: Option<Duration>, send: &dyn Fn(&Response, &[u8])) -> bool {
        let timeout = match wait {
            None => PollTimeout::NONE,
            // Round up: waking a hair early would only spin.
            Some(d) => PollTimeout::try_from(d.as_millis().saturating_add(1).min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX),
        };
        let (watch_ready, stdin_ready, out_ready) = {
            let mut fds = Vec::with_capacity(4);
            if let Some(w) = watch {
                fds.push(PollFd::new(w.as_fd(), PollFlags::POLLIN));
            }
            if let Some((fd, _, _)) = &self.stdin {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLOUT));
            }
            for o in self.outputs.iter().flatten() {
                fds.push(PollFd::new(o.fd.as_fd(), PollFlags::POLLIN));
            }
            match nix::poll::poll(&mut fds, timeout) {
                Ok(_) => {}
                Err(Errno::EINTR) => return false,
                Err(e) => {
                    log!("poll: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return false;
                }
            }
            let ready: Vec<bool> = fds.iter().map(|f| f.revents().is_some_and(|r| !r.is_empty())).collect();
            let mut at = 0;
            let mut next = |present: bool| {
                if present {
                    at += 1;
                    ready[at - 1]
                } else {
                    false
                }
            };
            let watch_ready = next(watch.is_some());
            let stdin_ready = next(self.stdin.is_some());
            let present: Vec<bool> = self.outputs.iter().map(Option::is_some).collect();
            let out_ready = [next(present[0]), next(present[1])];
            (watch_ready, stdin_ready, out_ready)
        };
        if stdin_ready {
            self.feed_stdin();
        }
        for (i, ready) in out_ready.into_iter().enumerate() {
            if ready {
                self.read_output(i, send);
            }
        }
        watch_ready
    }

    fn feed_stdin(&mut self) {
        let Some((fd, bytes, written)) = &mut self.stdin else { return };
        loop {
            if *written >= bytes.len() {
                self.stdin = None; // all delivered: close, so the command sees EOF
                return;
            }
            match nix::unistd::write(&*fd, &bytes[*written..]) {
                Ok(n) => *written += n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                // EPIPE: the command does not read its stdin, which is its right.
                Err(_) => {
                    self.stdin = None;
                    return;
                }
            }
        }
    }

    /// Reads what the pipe holds right now (it is non-blocking).
    fn read_output(&mut self, i: usize, send: &dyn Fn(&Response, &[u8])) {
        let Some(out) = &mut self.outputs[i] else { return };
        loop {
            match nix::unistd::read(out.fd.as_raw_fd(), &mut self.buf) {
                Ok(0) => break,
                Ok(n) => {
                    out.capture.feed(&self.buf[..n]);
                    if self.stream {
                        send(&Response::Output { stream: out.stream }, &self.buf[..n]);
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                Err(_) => break,
            }
        }
        // EOF (or a broken pipe): this stream is complete.
        if let Some(done) = self.outputs[i].take() {
            self.finished.push((done.stream, done.capture.finish()));
        }
    }

    fn drain_ready(&mut self, send: &dyn Fn(&Response, &[u8])) {
        for i in 0..self.outputs.len() {
            self.read_output(i, send);
        }
    }

    fn finish(mut self) -> (CapturedOutput, CapturedOutput) {
        for slot in &mut self.outputs {
            if let Some(o) = slot.take() {
                self.finished.push((o.stream, o.capture.finish()));
            }
        }
        let mut stdout = CapturedOutput::default();
        let mut stderr = CapturedOutput::default();
        for (stream, c) in self.finished {
            match stream {
                Stream::Stdout => stdout = c,
                Stream::Stderr => stderr = c,
            }
        }
        (stdout, stderr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_ids_are_safe_directory_names() {
        for ok in ["ex-1", "ex_AB.9", "a"] {
            assert!(validate_exec_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            assert!(validate_exec_id(bad).is_err(), "{bad}");
        }
    }
}
