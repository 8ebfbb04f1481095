//! Running one command in a process-tier sandbox, from the daemon's side.
//!
//! The daemon makes the exec's cgroup and pipes, hands them to the sandbox's init (which forks
//! the process inside every namespace), then pumps the pipes into bounded captures while it waits
//! for the exit, the timeout or the caller's cancellation. The timeout and cancellation kill the
//! exec's cgroup: every descendant, even ones that daemonized, with no pid-reuse race.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::channel::{recv_on, ExitReply, SpareEnds};
use super::pty;
use super::wire::{encode, send_raw, Job, ToInit, WireError};
use super::ProcessSandbox;
use crate::backend::cgroup::ExecCgroup;
use crate::backend::files;
use crate::backend::{BackendError, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, OutputSink, SessionInput, StartSignal};
use sandbox_exec::capture::{OutputCapture, SpillTarget};
use sandbox_exec::spawn::{decode_failure, describe_failure, Stage};

/// How long the init may take to answer a spawn request (normally well under a millisecond;
/// joining a cgroup v1 on a loaded host can take a few).
const SPAWN_REPLY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

pub use sandbox_exec::capture::SPILL_DIR;

/// Spill file of one stream, created through the confined file API.
struct SandboxSpill {
    rootfs: PathBuf,
    path: String,
    /// The sandbox's user namespace range: the file belongs to root inside.
    ids: Option<sandbox_exec::archive::IdShift>,
}

impl SpillTarget for SandboxSpill {
    fn open(&mut self) -> std::io::Result<Box<dyn std::io::Write + Send>> {
        let file = files::acting_as(self.ids, || files::create_for_write(&self.rootfs, &self.path)).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Box::new(std::io::BufWriter::with_capacity(64 << 10, file)))
    }
    fn path(&self) -> String {
        self.path.clone()
    }
}

/// The daemon's and the command's ends of the three stdio pipes: (read, write) each.
struct Pipes {
    stdin: (OwnedFd, OwnedFd),
    stdout: (OwnedFd, OwnedFd),
    stderr: (OwnedFd, OwnedFd),
}

/// Where an exec's output is read: a pipe, or the master side of its terminal.
enum Reader {
    Pipe(tokio::net::unix::pipe::Receiver),
    Terminal(pty::PtyMaster),
}

impl AsRawFd for Reader {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Reader::Pipe(p) => p.as_raw_fd(),
            Reader::Terminal(t) => t.as_raw_fd(),
        }
    }
}

impl tokio::io::AsyncRead for Reader {
    fn poll_read(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Reader::Pipe(p) => std::pin::Pin::new(p).poll_read(cx, buf),
            Reader::Terminal(t) => std::pin::Pin::new(t).poll_read(cx, buf),
        }
    }
}

/// Where an exec's stdin is written: a pipe, or the master side of its terminal.
enum StdinWriter {
    Pipe(tokio::net::unix::pipe::Sender),
    Terminal(pty::PtyMaster),
}

/// Writes `first` to the exec's stdin, then the session's live input if it has one, then
/// closes stdin (a pipe is closed; a terminal gets its end-of-file character, as Ctrl-D, since
/// it has no half-close). A command that does not read its stdin closes the pipe: EPIPE is normal
/// here and ends the feeding.
async fn feed_stdin(tx: StdinWriter, first: Vec<u8>, input: Option<tokio::sync::mpsc::Receiver<SessionInput>>) {
    match tx {
        StdinWriter::Pipe(p) => crate::backend::feed_pipe(p, first, input).await,
        StdinWriter::Terminal(t) => match t.try_clone() {
            Ok(control) => feed_terminal(t, control, first, input).await,
            Err(e) => tracing::warn!(error = %e, "cannot write to the exec's terminal"),
        },
    }
}

/// [`feed_stdin`] for a terminal: `control` keeps the master for resizes while `w` writes.
async fn feed_terminal(mut w: pty::PtyMaster, control: pty::PtyMaster, first: Vec<u8>, input: Option<tokio::sync::mpsc::Receiver<SessionInput>>) {
    if w.write_all(&first).await.is_err() {
        return;
    }
    drop(first);
    let Some(mut input) = input else {
        let _ = w.write_all(&[pty::VEOF]).await;
        return;
    };
    while let Some(item) = input.recv().await {
        match item {
            SessionInput::Stdin(bytes) => {
                if w.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            SessionInput::CloseStdin => {
                let _ = w.write_all(&[pty::VEOF]).await;
            }
            SessionInput::Resize(size) => {
                if let Err(e) = control.resize(size) {
                    tracing::debug!(error = %e, "resizing an exec's terminal");
                }
            }
        }
    }
    // The input channel closed (the client's side ended): that is a close of stdin too.
    let _ = w.write_all(&[pty::VEOF]).await;
}

fn pipe() -> Result<(OwnedFd, OwnedFd), BackendError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| BackendError::io("creating exec pipe", e.into()))
}

/// The read side of an output pipe, or `None` (logged) if it cannot be watched.
fn pipe_reader(fd: OwnedFd) -> Option<tokio::net::unix::pipe::Receiver> {
    tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(|e| tracing::warn!(error = %e, "cannot watch exec output pipe")).ok()
}

/// Reads one stream (a pipe, or a terminal's master side) into its capture (and the sink, if
/// streaming) until EOF or `stop`.
async fn pump<R: tokio::io::AsyncRead + AsRawFd + Unpin>(
    rx: Option<R>,
    mut capture: OutputCapture,
    sink: OutputSink,
    is_stdout: bool,
    stop: CancellationToken,
) -> CapturedOutput {
    if let Some(rx) = rx {
        crate::backend::pump_output(rx, &mut capture, &sink, is_stdout, &stop, |b| std::borrow::Cow::Borrowed(b)).await;
    }
    capture.finish()
}

/// Runs a blocking cgroupfs operation off the async workers: under load (hundreds of execs) a
/// cgroup mkdir, rmdir or kill can take milliseconds, and a starved worker delays every pipe.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| BackendError::Internal(format!("blocking task: {e}")))
}

impl ProcessSandbox {
    /// Prepares a spare process for the next exec (see `ToInit::Prepare`), in the background.
    /// After an exec (`after_exec`), or wherever joining a cgroup is dear, the spare is forked
    /// into the next exec's cgroup, made now: the exec that takes it skips the mkdirs and the
    /// join (measured back to back on a 2-CPU AMD host: 2.0–2.2 ms against 2.7 ms for joining at
    /// the job). A sandbox that has not run a command yet, where joining is cheap (see
    /// [`crate::backend::cgroup::SandboxCgroup::exec_join_is_cheap`]), gets a spare that waits
    /// in the sandbox's own cgroup and joins the exec's when its job comes: an idle sandbox
    /// holds one memory cgroup, not two (each costs the kernel a map of every superblock's
    /// shrinker: with thousands of sandboxes, more than everything else an idle one holds),
    /// while the second is paid only by the sandboxes holding a spare after an exec, at most
    /// `[process] spares` of them. At most one spare is armed or being armed.
    pub(super) fn arm_spare(self: &Arc<Self>, after_exec: bool) {
        if self.spares.is_off() || self.arming.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let sb = self.clone();
        tokio::spawn(async move {
            let slot = crate::ids::ExecId::generate().to_string().replace("ex-", "slot-");
            if sb.cgroup.exec_join_is_cheap() && !after_exec {
                // Dropped if not kept: the spare exits when its end closes.
                if let Some(ends) = sb.ask_for_spare(&slot, &[]).await {
                    sb.keep_spare(slot, None, ends);
                }
            } else {
                sb.arm_spare_in_slot(slot).await;
            }
            sb.arming.store(false, std::sync::atomic::Ordering::Release);
            sb.armed.notify_waiters();
        });
    }

    /// [`ProcessSandbox::arm_spare`] where joining is dear: the next exec's cgroup made now,
    /// with the spare forked into it.
    async fn arm_spare_in_slot(self: &Arc<Self>, slot: String) {
        let made = {
            let sb = self.clone();
            let slot = slot.clone();
            blocking(move || -> Result<_, BackendError> {
                let cgroup = Arc::new(sb.cgroup.create_exec(&slot)?);
                let procs = cgroup.join_files()?;
                Ok((cgroup, procs))
            })
            .await
        };
        let (cgroup, procs) = match made.and_then(|m| m) {
            Ok(made) => made,
            Err(e) => return tracing::debug!(sandbox = %self.id, error = %e, "cannot arm an exec slot"),
        };
        let fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
        let ends = self.ask_for_spare(&slot, &fds).await;
        drop(procs);
        let kept = match ends {
            Some(ends) => self.keep_spare(slot, Some(cgroup.clone()), ends),
            None => false,
        };
        if !kept {
            let _ = blocking(move || cgroup.kill_all().and_then(|_| cgroup.remove())).await;
        }
    }

    /// Asks the init for a spare (`fds`: the join files of the cgroup it goes into at once, if
    /// any) and waits for its ends, within [`SPAWN_REPLY_DEADLINE`]; None (the request
    /// forgotten) if none came.
    async fn ask_for_spare(&self, slot: &str, fds: &[RawFd]) -> Option<SpareEnds> {
        let ends = match self.channel.prepare(slot, fds).await {
            Ok(rx) => tokio::time::timeout(SPAWN_REPLY_DEADLINE, rx).await.ok().and_then(Result::ok),
            Err(_) => None,
        };
        if ends.is_none() {
            self.channel.forget(slot);
        }
        ends
    }

    /// Keeps a spare as the armed one, in its place among the backend's spares (giving up the
    /// least recently armed others' past the limit); false (the spare dropped) if the runtime
    /// is being stopped, which must not get a spare it would leak.
    fn keep_spare(self: &Arc<Self>, slot: String, cgroup: Option<Arc<ExecCgroup>>, ends: SpareEnds) -> bool {
        let Some((ticket, evicted)) = self.spares.admit(Arc::downgrade(self)) else { return false };
        let kept = match self.spare.lock() {
            Ok(mut armed) if self.lost.lock().map(|l| l.is_none()).unwrap_or(false) => {
                *armed = Some(Spare { slot, cgroup, ends, ticket });
                true
            }
            _ => false,
        };
        if !kept {
            self.spares.release(ticket);
        }
        for (ticket, holder) in evicted {
            if let Some(other) = holder.upgrade() {
                other.give_up_spare(ticket);
            }
        }
        kept
    }

    /// Runs `spec` to its end. See the module documentation.
    pub(super) async fn run_exec(
        self: &Arc<Self>,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        let started_at = SystemTime::now();
        let exec_id = spec.exec_id.to_string();
        // Counted from here until this future ends, however it ends (see `ProcessSandbox::quiet`).
        let _under_way = UnderWay::new(self);
        // The armed slot (its spare process already inside its cgroup), or a fresh cgroup. A
        // terminal is opened by the init, so a `tty` exec leaves the slot armed for the next.
        let spare = if spec.tty.is_none() { self.spare.lock().ok().and_then(|mut s| s.take()) } else { None };
        if let Some(spare) = &spare {
            self.spares.release(spare.ticket);
        }
        let sb = self.clone();
        let id = exec_id.clone();
        let (spare, cgroup) = match spare {
            Some(Spare { slot, cgroup: Some(cgroup), ends, .. }) => (Some((slot, ends, Vec::new())), cgroup),
            // The exec's cgroup made here, inline (a mkdir per hierarchy, ~40 µs each): a trip
            // to a blocking thread would cost as much after a pause.
            Some(Spare { slot, cgroup: None, ends, .. }) => {
                let cgroup = Arc::new(self.cgroup.create_exec(&exec_id)?);
                let join = match cgroup.join_files() {
                    Ok(join) => join,
                    Err(e) => {
                        let _ = cgroup.remove();
                        return Err(e.into());
                    }
                };
                (Some((slot, ends, join)), cgroup)
            }
            None => (None, blocking(move || sb.cgroup.create_exec(&id).map(Arc::new)).await??),
        };
        let result = self.run_in_cgroup(&spec, &cgroup, spare, sink, started, cancel, started_at).await;
        // Off the answer's path: its cgroup's removal (an rmdir per hierarchy).
        self.execs.ended(&exec_id);
        let sb = self.clone();
        tokio::task::spawn_blocking(move || sb.execs.finished(&exec_id, &cgroup));
        result
    }

    /// [`ProcessSandbox::run_exec`] once the exec's cgroup (and maybe its spare) is ready.
    #[allow(clippy::too_many_arguments)] // the exec's pieces, each distinct, handed down once
    async fn run_in_cgroup(
        self: &Arc<Self>,
        spec: &ExecSpec,
        cgroup: &Arc<ExecCgroup>,
        spare: Option<(String, SpareEnds, Vec<std::fs::File>)>,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
        started_at: SystemTime,
    ) -> Result<ExecOutcome, BackendError> {
        let exec_id = spec.exec_id.to_string();
        // On a terminal the init makes the stdio (in the sandbox's devpts); else three pipes.
        let pipes = match spec.tty {
            Some(_) => None,
            None => Some(Pipes { stdin: pipe()?, stdout: pipe()?, stderr: pipe()? }),
        };
        let begin = Instant::now();
        let stdio: Vec<RawFd> = pipes.iter().flat_map(|p| [p.stdin.0.as_raw_fd(), p.stdout.1.as_raw_fd(), p.stderr.1.as_raw_fd()]).collect();
        self.execs.started(&exec_id, cgroup.clone());
        // Through the armed slot's spare, told directly; or (no spare, or it is gone) a fresh
        // fork of the init, which joins the cgroup.
        // (A `tty` exec never takes the spare: its terminal is the init's to open.)
        let direct = match spare {
            Some((slot, ends, join)) => {
                let fds: Vec<RawFd> = stdio.iter().copied().chain(join.iter().map(|f| f.as_raw_fd())).collect();
                self.start_on_spare(spec, cgroup, &slot, ends, &fds).await
            }
            None => None,
        };
        let begun = match direct {
            Some(begun) => begun,
            None => self.start_by_init(spec, cgroup, &stdio).await,
        };
        // The command holds its own copies of its ends of the pipes now; ours must close so
        // EOF means "the process is done".
        let ours = pipes.map(|p| (p.stdin.1, p.stdout.0, p.stderr.0));
        let (master, mut exited) = match begun {
            Begun::Running { master, exited } => (master, exited),
            Begun::Failed(stage, errno) => {
                let (code, error) = describe_failure(stage, nix::errno::Errno::from_raw(errno), &spec.argv[0], &spec.workdir, spec.user.as_deref());
                return Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, code, error, started_at));
            }
            Begun::Lost(error) => return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, error, started_at)),
        };
        let t0 = Instant::now();
        // Arm the next slot while this command runs, so the next exec skips the cgroup join.
        self.arm_spare(true);
        if let Some(tx) = started {
            let _ = tx.send(());
        }

        // Where stdin goes and where output comes from: the pipes, or the terminal.
        let (stdin_tx, stdout_rx, stderr_rx): (Option<StdinWriter>, Option<Reader>, Option<Reader>) = match (ours, master) {
            (Some((stdin_w, stdout_r, stderr_r)), _) => (
                tokio::net::unix::pipe::Sender::from_owned_fd(stdin_w).ok().map(StdinWriter::Pipe),
                pipe_reader(stdout_r).map(Reader::Pipe),
                pipe_reader(stderr_r).map(Reader::Pipe),
            ),
            (None, Some(master)) => {
                let reader = pty::PtyMaster::new(master).map_err(|e| BackendError::io("watching the exec's terminal", e))?;
                let writer = reader.try_clone().map_err(|e| BackendError::io("watching the exec's terminal", e))?;
                (Some(StdinWriter::Terminal(writer)), Some(Reader::Terminal(reader)), None)
            }
            (None, None) => {
                let error = "the sandbox's init started the exec without its terminal".to_string();
                return Ok(ExecOutcome::failed(ExecStatus::Lost, -1, error, started_at));
            }
        };
        if let Some(tx) = stdin_tx {
            tokio::spawn(feed_stdin(tx, spec.stdin.take(), spec.input.take()));
        }
        let cap = usize::try_from(spec.max_output_bytes).unwrap_or(usize::MAX);
        let spill = |stream: &str| -> Option<Box<dyn SpillTarget>> {
            Some(Box::new(SandboxSpill { rootfs: self.rootfs.clone(), path: format!("{SPILL_DIR}/{exec_id}.{stream}"), ids: self.ids() }))
        };
        let stop = CancellationToken::new();
        let out_task = tokio::spawn(pump(stdout_rx, OutputCapture::new(cap, spill("stdout")), sink.clone(), true, stop.clone()));
        let err_task = tokio::spawn(pump(stderr_rx, OutputCapture::new(cap, spill("stderr")), sink, false, stop.clone()));

        #[derive(Clone, Copy)]
        enum End {
            Exited(Option<i32>, Option<i32>),
            TimedOut,
            Cancelled,
            Lost,
        }
        let end = tokio::select! {
            r = &mut exited => match r { Ok((c, s)) => End::Exited(c, s), Err(_) => End::Lost },
            // The sandbox's running time: a pause does not count against the timeout.
            () = spec.clock.sleep(spec.timeout) => End::TimedOut,
            _ = cancel.cancelled() => End::Cancelled,
        };
        if matches!(end, End::TimedOut | End::Cancelled) {
            let cg = cgroup.clone();
            if let Ok(Err(e)) = blocking(move || cg.kill_all()).await {
                tracing::warn!(exec = %exec_id, error = %e, "killing exec process tree");
            }
            // The init reports the main process's death promptly once it is killed.
            if tokio::time::timeout(std::time::Duration::from_secs(5), exited).await.is_err() {
                tracing::warn!(exec = %exec_id, "no exit report 5 s after the kill");
            }
        }
        let duration = t0.elapsed();

        // Bounded wait for the pipes: a grandchild left in the background may hold them open.
        let deadline = tokio::time::Instant::now() + spec.io_drain_timeout;
        let mut out_task = out_task;
        let mut err_task = err_task;
        let stdout = match tokio::time::timeout_at(deadline, &mut out_task).await {
            Ok(r) => r,
            Err(_) => {
                stop.cancel();
                out_task.await
            }
        };
        let stderr = match tokio::time::timeout_at(deadline, &mut err_task).await {
            Ok(r) => r,
            Err(_) => {
                stop.cancel();
                err_task.await
            }
        };
        let stdout = stdout.unwrap_or_default();
        let stderr = stderr.unwrap_or_default();
        // A few small reads of cgroup files: inline, as for the slot's procs files.
        let raw = cgroup.usage();
        let us = |d: std::time::Duration| d.as_micros() as u64;
        tracing::debug!(exec = %exec_id, start_us = us(t0 - begin), run_us = us(duration), drain_us = us(t0.elapsed() - duration), "exec phases");
        let usage = ExecUsage { cpu_user_ms: raw.cpu_user_ms, cpu_system_ms: raw.cpu_system_ms, peak_memory_bytes: raw.peak_memory_bytes };

        // The runtime was taken down under this exec (rollback, destroy, shutdown): whatever
        // the kill made of it, the exec was lost with its sandbox.
        if let Some(reason) = self.lost.lock().ok().and_then(|l| l.clone()) {
            let error = format!("{reason} while the command ran");
            return Ok(ExecOutcome { status: ExecStatus::Lost, exit_code: -1, signal: 0, stdout, stderr, started_at, duration, usage, error });
        }
        use sandbox_exec::outcome::{classify, Cause, Exit, UNKNOWN_EXIT};
        let (cause, exit) = match end {
            End::Lost => {
                let error = "the sandbox's init exited while the command ran".to_string();
                return Ok(ExecOutcome { status: ExecStatus::Lost, exit_code: -1, signal: 0, stdout, stderr, started_at, duration, usage, error });
            }
            End::TimedOut => (Cause::TimedOut, Exit::Unknown),
            End::Cancelled => (Cause::Cancelled, Exit::Unknown),
            End::Exited(_, Some(s)) => (Cause::Ended, Exit::Signal(s)),
            End::Exited(Some(c), None) => (Cause::Ended, Exit::Code(c)),
            End::Exited(None, None) => (Cause::Ended, Exit::Unknown),
        };
        let end = classify(cause, exit, raw.oom_kills);
        let status = ExecStatus::from(end.status);
        let error = if status == ExecStatus::Lost { UNKNOWN_EXIT.to_string() } else { String::new() };
        Ok(ExecOutcome { status, exit_code: end.exit_code, signal: end.signal, stdout, stderr, started_at, duration, usage, error })
    }
}

/// The armed spare: its slot's name, its cgroup (the next exec's, the spare already inside;
/// None: it waits in the sandbox's own cgroup and joins the exec's with its job), and its ends.
pub(super) struct Spare {
    pub slot: String,
    pub cgroup: Option<Arc<ExecCgroup>>,
    pub ends: SpareEnds,
    /// Its place among the backend's armed spares (see [`super::spares`]).
    pub ticket: u64,
}

/// How an exec's start went.
enum Begun {
    /// The command runs; with a `tty`, the terminal's master side. Its end arrives on `exited`.
    Running { master: Option<OwnedFd>, exited: tokio::sync::oneshot::Receiver<ExitReply> },
    /// It could not be started: where, and the errno.
    Failed(Stage, i32),
    /// The sandbox did not start it (its init is gone, or never answered).
    Lost(String),
}

/// Waits on a spare's socket, its job sent: EOF (its execve closed the other end) means the
/// command runs (`None`), a message is the failure (`Some`); `Err` if nothing happened within
/// `deadline`.
async fn spare_failure(jobs: OwnedFd, deadline: std::time::Duration) -> Result<Option<(Stage, i32)>, String> {
    // SAFETY: the descriptor is an OwnedFd moved into the AsyncFd, so it stays open (and is not
    // reused) for as long as the registration lives.
    let fd = unsafe { tokio::io::unix::AsyncFd::register(jobs) }.map_err(|e| format!("watching the spare: {e}"))?;
    match tokio::time::timeout(deadline, recv_on::<64>(&fd)).await {
        Ok(Ok(None)) => Ok(None),
        Ok(Ok(Some((bytes, _)))) => Ok(Some(decode_failure(&bytes).map(|(stage, errno)| (stage, errno as i32)).unwrap_or((Stage::Setup, libc::EIO)))),
        Ok(Err(e)) => Err(format!("watching the spare: {e}")),
        Err(_) => Err(format!("the sandbox did not start the command within {} s", deadline.as_secs())),
    }
}

impl ProcessSandbox {
    /// Starts the exec on the armed slot's spare: its [`Job`] goes straight to the spare, which
    /// is already in the cgroup and only has to `execve` (no trip through the init). `None`
    /// when the spare is gone (killed, or it could not join the cgroup before the job was
    /// sent): the caller starts the exec through the init instead.
    async fn start_on_spare(&self, spec: &ExecSpec, cgroup: &Arc<ExecCgroup>, slot: &str, ends: SpareEnds, stdio: &[RawFd]) -> Option<Begun> {
        let exited = self.channel.expect_exit(slot).ok()?;
        let job = Job { argv: spec.argv.clone(), env: spec.env.clone(), workdir: spec.workdir.clone(), user: spec.user.clone() };
        // Never blocks the worker: one message into an empty socket, or an error.
        let nonblocking = nix::fcntl::fcntl(ends.jobs.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK));
        let sent = nonblocking.map_err(WireError::Io).and_then(|_| encode(&job)).and_then(|bytes| send_raw(ends.jobs.as_fd(), &bytes, stdio));
        if let Err(e) = sent {
            tracing::debug!(sandbox = %self.id, %slot, error = %e, "the armed spare is gone; starting the exec through the init");
            self.channel.forget(slot);
            return None;
        }
        match spare_failure(ends.jobs, SPAWN_REPLY_DEADLINE).await {
            Ok(None) => Some(Begun::Running { master: None, exited }),
            Ok(Some((stage, errno))) => Some(Begun::Failed(stage, errno)),
            Err(error) => Some(self.unconfirmed(slot, cgroup, error).await),
        }
    }

    /// An exec whose start was never confirmed (`key`: its exec id, or its spare's slot): its
    /// replies forgotten and whatever did start of it killed. LOST with `error`.
    async fn unconfirmed(&self, key: &str, cgroup: &Arc<ExecCgroup>, error: String) -> Begun {
        self.channel.forget(key);
        let cg = cgroup.clone();
        if let Ok(Err(e)) = blocking(move || cg.kill_all()).await {
            tracing::warn!(sandbox = %self.id, %key, error = %e, "killing an exec whose start was never confirmed");
        }
        Begun::Lost(error)
    }

    /// Starts the exec by a fresh fork of the init, which joins `cgroup` through its
    /// join files (passed with the request).
    async fn start_by_init(&self, spec: &ExecSpec, cgroup: &Arc<ExecCgroup>, stdio: &[RawFd]) -> Begun {
        let exec_id = spec.exec_id.to_string();
        let procs = match cgroup.join_files() {
            Ok(p) => p,
            Err(e) => return Begun::Lost(format!("opening the exec's cgroup: {e}")),
        };
        let mut fds = stdio.to_vec();
        fds.extend(procs.iter().map(|f| f.as_raw_fd()));
        let msg = ToInit::Spawn {
            exec_id: exec_id.clone(),
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            tty: spec.tty.map(|t| (t.rows, t.cols)),
            user: spec.user.clone(),
        };
        let waiters = self.channel.spawn(&exec_id, &msg, &fds).await;
        // The init holds its own copies now.
        drop(procs);
        let waiters = match waiters {
            Ok(w) => w,
            Err(e) => return Begun::Lost(format!("sandbox unavailable: {e}")),
        };
        // The init's answer is bounded in time like everything from inside: an init that never
        // answers must not leave the exec RUNNING forever.
        match tokio::time::timeout(SPAWN_REPLY_DEADLINE, waiters.spawned).await {
            Ok(Ok(Ok((_pid, master)))) => Begun::Running { master, exited: waiters.exited },
            Ok(Ok(Err((stage, errno)))) => Begun::Failed(stage, errno),
            Ok(Err(_)) => Begun::Lost("the sandbox's init exited before the exec started".into()),
            Err(_) => {
                let error = format!("the sandbox's init did not answer the spawn request within {} s", SPAWN_REPLY_DEADLINE.as_secs());
                self.unconfirmed(&exec_id, cgroup, error).await
            }
        }
    }
}

/// An exec under way in a sandbox, counted in its `execs_begun` and `execs_active` while it lives.
struct UnderWay<'a>(&'a ProcessSandbox);

impl<'a> UnderWay<'a> {
    fn new(sb: &'a ProcessSandbox) -> Self {
        use std::sync::atomic::Ordering::SeqCst;
        sb.execs_active.fetch_add(1, SeqCst);
        sb.execs_begun.fetch_add(1, SeqCst);
        UnderWay(sb)
    }
}

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.execs_active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
