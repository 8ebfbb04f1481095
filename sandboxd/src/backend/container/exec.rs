//! Running one command in a container sandbox, from the daemon's side.
//!
//! **Design: the container's own keepalive starts every exec.** Each container's main process
//! under docker-init is the exec helper (`sandbox-exec --serve`, a static binary of the
//! `sandbox-exec` crate in a directory bind-mounted read-only at [`HELPER_DIR_IN_CONTAINER`]).
//! Right after start, before anything of the sandbox runs, the daemon takes the helper's end of
//! a socket pair out of it with `pidfd_getfd` (`channel.rs`; the wire is
//! `sandbox_exec::serve`), and the helper closes its copy: the channel is a descriptor only the
//! daemon and the helper hold, never a path in the container, and the helper is not dumpable, so
//! root inside (same pid namespace, but no `CAP_SYS_PTRACE`) can neither open its
//! `/proc/<pid>/fd` nor `pidfd_getfd` from it. An exec then is:
//!
//! 1. the daemon makes the exec's cgroup, its pipes and a reply socket and sends the request
//!    with them (one message);
//! 2. the helper forks. The child is a copy of a process that already sits in every namespace,
//!    behind the capabilities, seccomp filter, no-new-privileges and AppArmor profile Docker
//!    gave the container — exactly what `docker exec` gives its process, by construction (a test
//!    compares the two: `tests/tests/conformance.rs`). It says "ready" on the reply socket; the
//!    kernel attaches its pid as the daemon sees it (`SCM_CREDENTIALS`), the daemon checks it is
//!    a process of this container, moves it into the exec's cgroup while it cannot fork, opens a
//!    pidfd on it, and says "go";
//! 3. the child takes its own session, resolves the user in the container's /etc, and becomes
//!    the command through `sandbox_exec::spawn`, exactly as the process tier's init and the
//!    microVM's guest agent do; or, if it cannot, writes a failure line (stage and errno) on
//!    stderr, which the daemon strips and describes like every tier;
//! 4. the daemon pumps the pipes into bounded captures while it waits on the pidfd for the exit,
//!    the timeout or cancellation — the last two kill the exec's cgroup: every descendant,
//!    daemonized or not;
//! 5. the raw wait status comes from the pidfd (`PIDFD_GET_INFO`: the helper ignores SIGCHLD, so
//!    the kernel reaps), CPU and peak memory from the exec's cgroup; spilled output was written
//!    into the container as it came. Usage is the exec's own, not the container's.
//!
//! Nothing the helper says is believed beyond its own container: replies are one bounded
//! message, time-limited, and the pid comes from the kernel. The helper never blocks on anything
//! the container controls (the child, not the helper, reads /etc/passwd). Code inside can kill
//! or stop the helper: that ends or stalls its own sandbox's execs (they fail to start within
//! [`START_DEADLINE`]), nothing else.
//!
//! The runc way (the daemon entering the namespaces with `setns` and re-applying capabilities,
//! seccomp, no-new-privileges and AppArmor itself) was not taken: it would duplicate what Docker
//! already applied to the helper, and any field it missed would be a confinement gap.
//!
//! **Through Docker's exec API** go: execs on a terminal (Docker makes the pty in the
//! container's devpts and its controlling terminal), requests too large for one channel message,
//! containers made before the channel (their keepalive is `--pause`; a re-adopted container is
//! restarted with its old command, see `recover.rs`, and keeps this path until it is recreated),
//! and kernels whose pidfds do not keep exit statuses (Linux < 6.15). There the exec starts as
//! the helper, which stops itself; the daemon finds its host pid through the container's cgroup,
//! moves it into the exec's cgroup, continues it, and steps 3–5 follow with Docker's stream in
//! place of the pipes (Docker's exit code where the pidfd has none). Anything Docker writes on
//! the stream before step 3 (an "OCI runtime exec failed" when the sandbox is out of pids) is a
//! start failure, never the user's output.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::Docker;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::docker::{api_error, is_conflict, is_not_found};
use super::process_cgroup::ExecCgroup;
use super::{ContainerSandbox, Inner};
use crate::backend::{BackendError, CapturedOutput, ExecOutcome, ExecSpec, ExecStatus, ExecUsage, OutputChunk, OutputSink, StartSignal};
use nix::sys::socket::{send, setsockopt, socketpair, sockopt, AddressFamily, MsgFlags, SockFlag, SockType};
use sandbox_exec::capture::{OutputCapture, SpillTarget};
use sandbox_exec::serve;
use sandbox_exec::spawn;

pub use sandbox_exec::capture::SPILL_DIR;

/// How long an exec may take to reach the stopped helper before it counts as failed to start.
const START_DEADLINE: Duration = Duration::from_secs(10);
/// How long the output of an exec whose processes are all gone may take to arrive through
/// Docker's stream (see the drain in `run`).
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(10);
/// How long to wait for the exit after the exec's cgroup was killed.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Where the helper's directory is mounted (read-only) in every container. A directory, not the
/// file: a mount point cannot be renamed (EBUSY), so code in the container cannot move it aside
/// and plant its own `/.sandboxd/sandbox-exec` for later execs to start through — one that forks
/// before the daemon has moved it into the exec's cgroup would leave processes no timeout kills.
/// A bind-mounted file's parent directory, by contrast, is an ordinary directory of the image.
pub const HELPER_DIR_IN_CONTAINER: &str = "/.sandboxd";
/// The helper, inside that directory.
pub const HELPER_IN_CONTAINER: &str = "/.sandboxd/sandbox-exec";
/// The helper's first argument is this followed by the exec id: how the daemon finds it on the
/// host, and what `ps` inside the sandbox shows until the command replaces it.
const TAG_PREFIX: &str = "sandboxd-";
/// The host directory holding the helper, relative to the images directory
/// (`images/build-exec-helper.sh` installs it there; it holds nothing else).
const HELPER_DIR_ON_HOST: &str = ".tools";

/// The host directory mounted at [`HELPER_DIR_IN_CONTAINER`] for `images_dir`.
pub fn helper_dir(images_dir: &Path) -> PathBuf {
    images_dir.join(HELPER_DIR_ON_HOST)
}

/// The host path of the exec helper for `images_dir`.
pub fn helper_path(images_dir: &Path) -> PathBuf {
    helper_dir(images_dir).join("sandbox-exec")
}

/// The exit code and error sentence of a start failure the helper reported (the sentences every
/// tier uses, `sandbox_exec::spawn`).
fn describe_failure_line(line: &str, argv0: &str, workdir: &str, user: Option<&str>) -> (i32, String) {
    match spawn::parse_failure_line(line) {
        Some((stage, errno)) => spawn::describe_failure(stage, errno, argv0, workdir, user),
        None => (127, format!("exec setup failed: {line}")),
    }
}

/// Holds back the first bytes of stderr until they are known not to be the helper's marker.
#[derive(Default)]
struct MarkerFilter {
    /// Some while undecided.
    pending: Option<Vec<u8>>,
    found: Option<String>,
}

impl MarkerFilter {
    fn new() -> Self {
        MarkerFilter { pending: Some(Vec::new()), found: None }
    }

    /// The bytes of `chunk` (and of earlier held-back chunks) that are the command's.
    fn filter(&mut self, chunk: &[u8]) -> Vec<u8> {
        let Some(mut held) = self.pending.take() else { return chunk.to_vec() };
        held.extend_from_slice(chunk);
        if held.len() < spawn::FAILURE_LINE_PREFIX.len() {
            if spawn::FAILURE_LINE_PREFIX.starts_with(&held) {
                self.pending = Some(held);
                return Vec::new();
            }
            return held;
        }
        if !held.starts_with(spawn::FAILURE_LINE_PREFIX) {
            return held;
        }
        match held.iter().position(|&b| b == b'\n') {
            Some(nl) => {
                self.found = Some(String::from_utf8_lossy(&held[spawn::FAILURE_LINE_PREFIX.len()..nl]).into_owned());
                held[nl + 1..].to_vec()
            }
            // A marker line is short; this is not one.
            None if held.len() > 256 => held,
            None => {
                self.pending = Some(held);
                Vec::new()
            }
        }
    }

    fn finish(&mut self) -> Vec<u8> {
        self.pending.take().unwrap_or_default()
    }
}

/// Spill file of one stream, written straight into the container's writable layer through its
/// checked root (never on the host, where it would be outside every quota), and capped at the
/// sandbox's `disk_bytes` for storage drivers that do not enforce that.
struct ContainerSpill {
    init_pid: i32,
    container_id: String,
    path: String,
    cap: u64,
}

struct CappedWriter {
    out: std::io::BufWriter<File>,
    left: u64,
}

impl Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(std::io::Error::other("the spill reached the sandbox's disk_bytes"));
        }
        self.left -= buf.len() as u64;
        self.out.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl SpillTarget for ContainerSpill {
    fn open(&mut self) -> std::io::Result<Box<dyn Write + Send>> {
        let file = super::files::create_for_write(self.init_pid, &self.container_id, &self.path).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Box::new(CappedWriter { out: std::io::BufWriter::with_capacity(64 << 10, file), left: self.cap }))
    }
    fn path(&self) -> String {
        self.path.clone()
    }
}

/// What the output pump collected.
struct Pumped {
    stdout: CapturedOutput,
    stderr: CapturedOutput,
    marker: Option<String>,
}

type OutputStream = Pin<Box<dyn Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>;

/// Reads the exec's multiplexed output into the captures (and the sink, if streaming) until EOF
/// or `stop`.
async fn pump(mut output: OutputStream, mut out: OutputCapture, mut err: OutputCapture, sink: OutputSink, stop: CancellationToken) -> Pumped {
    let mut marker = MarkerFilter::new();
    loop {
        let item = tokio::select! {
            biased;
            item = output.next() => item,
            _ = stop.cancelled() => break,
        };
        let (bytes, is_stdout) = match item {
            Some(Ok(LogOutput::StdOut { message })) => (message, true),
            // On a terminal everything is one stream, the helper's failure line included.
            Some(Ok(LogOutput::Console { message })) => (Bytes::from(marker.filter(&message)), true),
            Some(Ok(LogOutput::StdErr { message })) => (Bytes::from(marker.filter(&message)), false),
            Some(Ok(LogOutput::StdIn { .. })) => continue,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "exec output stream ended with an error");
                break;
            }
            None => break,
        };
        if bytes.is_empty() {
            continue;
        }
        if is_stdout {
            out.feed(&bytes)
        } else {
            err.feed(&bytes)
        }
        if let Some(tx) = &sink {
            let event = if is_stdout { OutputChunk::Stdout(bytes) } else { OutputChunk::Stderr(bytes) };
            // A slow reader slows the command (back-pressure through Docker's pipe); a gone
            // reader only stops the streaming, not the capture.
            tokio::select! {
                _ = tx.send(event) => {}
                _ = stop.cancelled() => break,
            }
        }
    }
    let rest = marker.finish();
    if !rest.is_empty() {
        err.feed(&rest);
        if let Some(tx) = &sink {
            let _ = tx.try_send(OutputChunk::Stderr(Bytes::from(rest)));
        }
    }
    Pumped { stdout: out.finish(), stderr: err.finish(), marker: marker.found }
}

/// The scheduler state of a process (`R`, `S`, `T`, …), None when it is gone.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

pub(super) fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `struct pidfd_info` of `<linux/pidfd.h>`, the first version (64 bytes).
#[repr(C)]
#[derive(Default)]
struct PidfdInfo {
    mask: u64,
    cgroupid: u64,
    ids: [u32; 11],
    exit_code: i32,
}
const PIDFD_INFO_EXIT: u64 = 1 << 3;
/// `_IOWR(0xFF, 11, struct pidfd_info)`.
const PIDFD_GET_INFO: libc::c_ulong = 0xC040_FF0B;

/// What the pidfd tells about an exited process's wait status.
enum PidfdExit {
    Status(i32),
    /// Not reaped yet by its parent (containerd's shim reaps within microseconds).
    NotYet,
    /// The kernel predates `PIDFD_INFO_EXIT`.
    Unsupported,
}

/// Whether this kernel's pidfds keep a process's exit status (`PIDFD_INFO_EXIT`, Linux 6.15+),
/// asked of a live process's pidfd.
pub(super) fn pidfd_keeps_exit(fd: &OwnedFd) -> bool {
    !matches!(pidfd_exit(fd), PidfdExit::Unsupported)
}

fn pidfd_exit(fd: &OwnedFd) -> PidfdExit {
    let mut info = PidfdInfo { mask: PIDFD_INFO_EXIT, ..Default::default() };
    // SAFETY: PIDFD_GET_INFO writes at most size_of::<PidfdInfo>() bytes (encoded in the request
    // number) into the struct we pass.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), PIDFD_GET_INFO, &mut info as *mut PidfdInfo) };
    if rc != 0 {
        return PidfdExit::Unsupported;
    }
    if info.mask & PIDFD_INFO_EXIT != 0 {
        PidfdExit::Status(info.exit_code)
    } else {
        PidfdExit::NotYet
    }
}

/// How the command's main process ended (the type every tier classifies).
use sandbox_exec::outcome::Exit;

fn decode_wait_status(status: i32) -> Exit {
    if libc::WIFSIGNALED(status) {
        Exit::Signal(libc::WTERMSIG(status))
    } else {
        Exit::Code(libc::WEXITSTATUS(status))
    }
}

/// How the helper's start went.
enum Start {
    /// Stopped at its first line, with this host pid.
    Stopped(i32),
    /// It never got there; Docker's exit code if it has one.
    Failed(Option<i64>),
}

/// Whether `pid` is the exec helper tagged `name` (its first argument, which carries the exec id).
fn is_helper(pid: i32, name: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.split(|&b| b == 0).nth(1) == Some(name.as_bytes()))
}

/// Waits for the helper to appear in the container's cgroup and stop itself. The container's
/// `cgroup.procs` is polled every millisecond (a few small reads; a Docker API round trip per
/// poll would cost more than the exec); Docker is asked only now and then, to notice an exec
/// that failed to start (the sandbox out of pids, say).
async fn await_stopped_helper(docker: &Docker, exec: &str, sb: &ContainerSandbox, name: &str) -> Result<Start, bollard::errors::Error> {
    let started = Instant::now();
    let mut next_inspect = Duration::from_millis(20);
    let mut found: Option<i32> = None;
    loop {
        if found.is_none() {
            found = sb.cgroup.pids().into_iter().find(|&p| is_helper(p, name));
        }
        if let Some(pid) = found {
            match proc_state(pid) {
                Some('T') => return Ok(Start::Stopped(pid)),
                None | Some('Z' | 'X') => return Ok(Start::Failed(None)),
                Some(_) => {}
            }
        }
        let elapsed = started.elapsed();
        if elapsed > START_DEADLINE {
            return Ok(Start::Failed(None));
        }
        if elapsed > next_inspect {
            next_inspect = elapsed + Duration::from_millis(100);
            let info = docker.inspect_exec(exec).await?;
            if info.running == Some(false) && info.exit_code.is_some() {
                return Ok(Start::Failed(info.exit_code));
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Moves the stopped helper into the exec's cgroup (every hierarchy) and opens a pidfd on it.
/// Blocking: on cgroup v1 a migration can wait for an RCU grace period (~10 ms here; joining the
/// hierarchies in parallel was measured and does not help, they serialize in the kernel).
fn join_cgroup(cgroup: &ExecCgroup, pid: i32) -> Result<OwnedFd, String> {
    for mut procs in cgroup.procs_files().map_err(|e| e.to_string())? {
        procs.write_all(pid.to_string().as_bytes()).map_err(|e| format!("joining the exec cgroup: {e}"))?;
    }
    pidfd_open(pid).map_err(|e| format!("pidfd_open({pid}): {e}"))
}

/// Sets the size of an exec's terminal.
async fn resize(docker: &Docker, docker_exec: &str, size: crate::backend::TerminalSize) {
    let options = bollard::exec::ResizeExecOptions { height: size.rows, width: size.cols };
    if let Err(e) = docker.resize_exec(docker_exec, options).await {
        tracing::debug!(exec = %docker_exec, error = %e, "resizing an exec's terminal");
    }
}

/// Writes `first` to the exec's stdin, then the session's live input if it has one, then closes
/// stdin: half-closing the connection is how Docker learns to close the process's stdin; a
/// terminal gets its end-of-file character (Ctrl-D) instead. `terminal` is set for a tty exec
/// (resizes go to Docker). A command that does not read its stdin closes it: a failed write is
/// normal and ends the feeding.
async fn feed_stdin(
    mut input: Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    first: Vec<u8>,
    session: Option<tokio::sync::mpsc::Receiver<crate::backend::SessionInput>>,
    terminal: Option<(Docker, String)>,
) {
    use crate::backend::SessionInput;
    const VEOF: u8 = 0x04;
    if input.write_all(&first).await.is_err() {
        return;
    }
    // Written: not held while the session goes on.
    drop(first);
    if let Some(mut session) = session {
        while let Some(item) = session.recv().await {
            match item {
                SessionInput::Stdin(bytes) => {
                    if input.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
                SessionInput::CloseStdin if terminal.is_some() => {
                    let _ = input.write_all(&[VEOF]).await;
                }
                SessionInput::CloseStdin => break,
                SessionInput::Resize(size) => {
                    if let Some((docker, exec)) = &terminal {
                        resize(docker, exec, size).await;
                    }
                }
            }
        }
        // The input channel closed (the client's side ended): that is a close of stdin too.
        if terminal.is_some() {
            let _ = input.write_all(&[VEOF]).await;
        }
    } else if terminal.is_some() {
        let _ = input.write_all(&[VEOF]).await;
        return;
    }
    if terminal.is_none() {
        let _ = input.shutdown().await;
    }
}

/// Whatever Docker wrote on the stream of an exec that never started (bounded in time and size).
async fn drain_start_error(output: &mut OutputStream) -> String {
    let mut text = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(300), async {
        while let Some(Ok(item)) = output.next().await {
            text.extend_from_slice(&item.into_bytes());
            if text.len() > 4096 {
                break;
            }
        }
    })
    .await;
    String::from_utf8_lossy(&text).trim().chars().take(500).collect()
}

/// The exec channel's request for `spec` (an error when it is too large for one message).
fn helper_request(spec: &ExecSpec) -> Result<serve::Request, serve::RequestError> {
    let request = serve::Request {
        tag: format!("{TAG_PREFIX}{}", spec.exec_id),
        workdir: spec.workdir.clone(),
        user: spec.user.clone().unwrap_or_default(),
        // As through Docker (see `exec_in_cgroup`): a non-root exec without HOME in its env
        // gets the user's home from /etc/passwd, not the container's root one.
        home_from_passwd: spec.user.is_some() && !spec.env.iter().any(|(k, _)| k == "HOME"),
        stdin: !spec.stdin.is_empty() || spec.input.is_some(),
        argv: spec.argv.clone(),
        env: spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
    };
    request.encode()?;
    Ok(request)
}

fn pipe() -> Result<(OwnedFd, OwnedFd), BackendError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| BackendError::io("creating exec pipe", e.into()))
}

/// Moves a process that cannot fork yet into the exec's cgroup (every hierarchy). Blocking: see
/// [`join_cgroup`].
fn move_into(cgroup: &ExecCgroup, pid: i32) -> Result<(), String> {
    for mut procs in cgroup.procs_files().map_err(|e| e.to_string())? {
        procs.write_all(pid.to_string().as_bytes()).map_err(|e| format!("joining the exec cgroup: {e}"))?;
    }
    Ok(())
}

/// Reads one output pipe into its capture (and the sink), stripping the helper's failure line
/// from the start of stderr, until EOF or `stop`. What is already in the pipe at `stop` is
/// still taken.
async fn pump_pipe(fd: OwnedFd, mut capture: OutputCapture, sink: OutputSink, is_stdout: bool, stop: CancellationToken) -> (CapturedOutput, Option<String>) {
    let mut marker = (!is_stdout).then(MarkerFilter::new);
    let rx = match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
        Ok(rx) => rx,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch exec output pipe");
            return (capture.finish(), None);
        }
    };
    crate::backend::pump_output(rx, &mut capture, &sink, is_stdout, &stop, |b| match marker.as_mut() {
        Some(m) => std::borrow::Cow::Owned(m.filter(b)),
        None => std::borrow::Cow::Borrowed(b),
    })
    .await;
    let found = marker.as_mut().and_then(|m| {
        let rest = m.finish();
        if !rest.is_empty() {
            capture.feed(&rest);
            if let Some(tx) = &sink {
                let _ = tx.try_send(OutputChunk::Stderr(Bytes::from(rest)));
            }
        }
        m.found.take()
    });
    (capture.finish(), found)
}

/// Both output pipes of an exec started through the exec channel.
async fn pump_pipes(out: OwnedFd, err: OwnedFd, out_cap: OutputCapture, err_cap: OutputCapture, sink: OutputSink, stop: CancellationToken) -> Pumped {
    let ((stdout, _), (stderr, marker)) = tokio::join!(pump_pipe(out, out_cap, sink.clone(), true, stop.clone()), pump_pipe(err, err_cap, sink, false, stop));
    Pumped { stdout, stderr, marker }
}

impl ContainerSandbox {
    /// Runs `spec` to its end. See the module documentation.
    pub(super) async fn run_exec(
        self: &Arc<Self>,
        inner: &Inner,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        let started_at = SystemTime::now();
        let exec_id = spec.exec_id.to_string();
        let cgroup = Arc::new(self.cgroup.create_exec(&exec_id).map_err(|e| BackendError::Internal(format!("exec cgroup: {e}")))?);
        let result = self.exec_in_cgroup(inner, &spec, &cgroup, sink, started, cancel, started_at).await;
        self.execs.finished(&exec_id, &cgroup);
        result
    }

    /// The outcome of an exec whose container went away (or was never reachable).
    fn lost_outcome(&self, fallback: impl FnOnce() -> String, started_at: SystemTime) -> ExecOutcome {
        let error = match self.lost_reason() {
            Some(reason) => format!("{reason} while the command ran"),
            None => fallback(),
        };
        ExecOutcome::failed(ExecStatus::Lost, -1, error, started_at)
    }

    #[allow(clippy::too_many_arguments)]
    async fn exec_in_cgroup(
        self: &Arc<Self>,
        inner: &Inner,
        spec: &ExecSpec,
        cgroup: &Arc<ExecCgroup>,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
        started_at: SystemTime,
    ) -> Result<ExecOutcome, BackendError> {
        if let (Some(channel), None) = (&self.channel, spec.tty) {
            match helper_request(spec) {
                Ok(request) => return self.exec_through_helper(channel, request, spec, cgroup, sink, started, cancel, started_at).await,
                Err(e) => tracing::debug!(exec = %spec.exec_id, error = %e, "exec too large for the exec channel: through Docker's exec API"),
            }
        }
        let docker = inner.docker()?;
        let exec_id = spec.exec_id.to_string();
        let phase0 = Instant::now();
        let tag = format!("{TAG_PREFIX}{exec_id}");
        // USER and HOME are fixed slots ("" for root, and for an env that has its HOME), so no
        // argv[0] can be mistaken for them. The daemon leaves HOME out of a non-root exec's
        // env for the runtime to take from /etc/passwd; runc would put root's there first.
        let home = if spec.user.is_some() && !spec.env.iter().any(|(k, _)| k == "HOME") { "passwd" } else { "" };
        let mut cmd = vec![HELPER_IN_CONTAINER.to_string(), tag.clone(), spec.workdir.clone(), spec.user.clone().unwrap_or_default(), home.to_string()];
        cmd.extend(spec.argv.iter().cloned());
        let env: Vec<String> = spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let session = spec.input.take();
        let with_stdin = !spec.stdin.is_empty() || session.is_some();
        // On a terminal Docker makes the pty (in the container's devpts) and its controlling
        // terminal; output then arrives as one stream.
        let tty = spec.tty.is_some();
        let options = CreateExecOptions {
            attach_stdin: Some(with_stdin),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(tty),
            env: Some(env),
            cmd: Some(cmd),
            // The helper changes into the exec's directory itself, so a missing one is reported
            // like every other tier does rather than as Docker's error.
            working_dir: Some("/".to_string()),
            ..Default::default()
        };
        let docker_exec = match docker.create_exec(&self.container_id, options).await {
            Ok(r) => r.id,
            Err(e) if is_not_found(&e) || is_conflict(&e) => {
                return Ok(self.lost_outcome(|| format!("the sandbox's container is not running: {e}"), started_at));
            }
            Err(e) => return Err(api_error("creating exec", e)),
        };
        let start = StartExecOptions { detach: false, tty, output_capacity: Some(64 << 10) };
        let (mut output, input) = match docker.start_exec(&docker_exec, Some(start)).await {
            Ok(StartExecResults::Attached { output, input }) => (output, input),
            Ok(StartExecResults::Detached) => return Err(BackendError::Internal("Docker started the exec detached".into())),
            Err(e) if is_not_found(&e) || is_conflict(&e) => {
                return Ok(self.lost_outcome(|| format!("the sandbox's container is not running: {e}"), started_at));
            }
            Err(e) => return Err(api_error("starting exec", e)),
        };

        let started_ms = phase0.elapsed().as_micros() as u64;
        let pid = match await_stopped_helper(docker, &docker_exec, self, &tag).await {
            Ok(Start::Stopped(pid)) => pid,
            Ok(Start::Failed(code)) => {
                if self.lost_reason().is_some() {
                    return Ok(self.lost_outcome(String::new, started_at));
                }
                let said = drain_start_error(&mut output).await;
                let error = if said.is_empty() {
                    format!("the command could not be started (Docker exit code {code:?})")
                } else {
                    format!("the command could not be started: {said}")
                };
                return Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, 126, error, started_at));
            }
            Err(e) => return Ok(self.lost_outcome(|| format!("the sandbox's container stopped answering: {e}"), started_at)),
        };
        let stopped_ms = phase0.elapsed().as_micros() as u64;
        let continue_or_kill = |sig: Signal| {
            if let Err(e) = kill(Pid::from_raw(pid), sig) {
                tracing::debug!(exec = %exec_id, pid, error = %e, "signalling the stopped helper");
            }
        };
        // 2. Into its own cgroup while it cannot fork, then a pidfd that outlives its reaping.
        let cg = cgroup.clone();
        let joined = tokio::task::spawn_blocking(move || join_cgroup(&cg, pid)).await.unwrap_or_else(|e| Err(format!("join task: {e}")));
        let pidfd = match joined {
            Ok(fd) => fd,
            Err(e) => {
                continue_or_kill(Signal::SIGKILL);
                return Err(BackendError::Internal(format!("exec {exec_id} setup: {e}")));
            }
        };
        // SAFETY: an OwnedFd stays open and keeps returning the same descriptor until the
        // AsyncFd that owns it is dropped.
        let pidfd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
            .map_err(|e| BackendError::io("watching the exec's pidfd", e.into()))?;
        self.execs.started(&exec_id, cgroup.clone());
        // The terminal's size before the command runs: it may read it first thing.
        if let Some(size) = spec.tty {
            resize(docker, &docker_exec, size).await;
        }
        // 3. Go.
        continue_or_kill(Signal::SIGCONT);
        let continued_ms = phase0.elapsed().as_micros() as u64;
        let t0 = Instant::now();
        if let Some(tx) = started {
            let _ = tx.send(());
        }
        if with_stdin {
            tokio::spawn(feed_stdin(input, spec.stdin.take(), session, tty.then(|| (docker.clone(), docker_exec.clone()))));
        } else {
            drop(input);
        }

        // 4. Output and the end.
        let stop = CancellationToken::new();
        let (out, err) = self.captures(spec);
        let pump_task = tokio::spawn(pump(output, out, err, sink, stop.clone()));
        tracing::debug!(exec = %exec_id, started_us = started_ms, stopped_us = stopped_ms, continued_us = continued_ms, "exec phases (Docker's exec API)");
        self.finish(spec, cgroup, cancel, started_at, t0, pidfd, pump_task, stop, Some((docker, docker_exec.as_str()))).await
    }

    /// The output captures of an exec, each spilling into the container past the cap.
    fn captures(&self, spec: &ExecSpec) -> (OutputCapture, OutputCapture) {
        let exec_id = spec.exec_id.to_string();
        let cap = usize::try_from(spec.max_output_bytes).unwrap_or(usize::MAX);
        let spill = |stream: &str| -> Option<Box<dyn SpillTarget>> {
            Some(Box::new(ContainerSpill {
                init_pid: self.init_pid,
                container_id: self.container_id.clone(),
                path: format!("{SPILL_DIR}/{exec_id}.{stream}"),
                cap: self.spec.limits.disk_bytes,
            }))
        };
        (OutputCapture::new(cap, spill("stdout")), OutputCapture::new(cap, spill("stderr")))
    }

    /// Starts `request` through the exec channel (the module documentation's steps 1–3 for
    /// containers with one), then [`Self::finish`].
    #[allow(clippy::too_many_arguments)]
    async fn exec_through_helper(
        &self,
        channel: &super::channel::HelperChannel,
        request: serve::Request,
        spec: &ExecSpec,
        cgroup: &Arc<ExecCgroup>,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
        started_at: SystemTime,
    ) -> Result<ExecOutcome, BackendError> {
        use super::channel::Reply;
        let exec_id = spec.exec_id.to_string();
        let phase0 = Instant::now();
        let session = spec.input.take();
        // 1. The request, with the exec's reply socket and pipes (all the daemon's: nothing of
        //    the container's filesystem is opened by the daemon).
        // Non-blocking on the daemon's end only: the child blocks on its end until the go.
        let (reply, reply_theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| BackendError::io("creating an exec's reply socket", e.into()))?;
        super::channel::set_nonblocking(&reply).map_err(|e| BackendError::io("an exec's reply socket", e))?;
        setsockopt(&reply, sockopt::PassCred, &true).map_err(|e| BackendError::io("SO_PASSCRED on an exec's reply socket", e.into()))?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let stdin = if request.stdin { Some(pipe()?) } else { None };
        let mut fds = vec![reply_theirs.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()];
        if let Some((r, _)) = &stdin {
            fds.push(r.as_raw_fd());
        }
        let bytes = request.encode().map_err(|e| BackendError::Internal(format!("exec request: {e}")))?;
        // Bounded: a helper stopped from inside stops reading, and the channel fills.
        match tokio::time::timeout(START_DEADLINE, channel.send(&bytes, &fds)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Ok(self.lost_outcome(|| format!("the sandbox's exec helper is gone: {e}"), started_at)),
            Err(_) => {
                let error = format!("the command could not be started: the sandbox's exec helper took no request for {} s", START_DEADLINE.as_secs());
                return Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, 126, error, started_at));
            }
        }
        drop((reply_theirs, out_w, err_w));
        let stdin_w = stdin.map(|(r, w)| {
            drop(r);
            w
        });
        // 2. The child's greeting, whose pid the kernel vouches for.
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open until it is dropped.
        let reply = unsafe { tokio::io::unix::AsyncFd::register_with_interest(reply, tokio::io::Interest::READABLE) }
            .map_err(|e| BackendError::io("watching an exec's reply socket", e.into()))?;
        let pid = match tokio::time::timeout(START_DEADLINE, super::channel::read_reply(&reply)).await {
            Ok(Reply::Ready(pid)) => pid,
            Ok(Reply::ForkFailed(errno)) => {
                let error = format!("the command could not be started: fork: {}", std::io::Error::from_raw_os_error(errno));
                return Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, 126, error, started_at));
            }
            Ok(Reply::Broken(why)) => return Ok(self.lost_outcome(|| format!("the sandbox's exec helper did not start the command: {why}"), started_at)),
            Err(_) => {
                let error = format!("the command could not be started: the sandbox's exec helper did not answer within {} s", START_DEADLINE.as_secs());
                return Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, 126, error, started_at));
            }
        };
        let greeted_us = phase0.elapsed().as_micros() as u64;
        // Into the exec's cgroup while it waits for the go (it cannot fork before), after
        // checking that the pid is a process of this container: the helper's word about
        // anything else is never taken.
        // (Code inside may kill the waiting child: then it simply did not start.)
        let not_started = |why: String| Ok(ExecOutcome::failed(ExecStatus::SpawnFailed, 126, format!("the command could not be started: {why}"), started_at));
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => return not_started(format!("its process ended before it started ({e})")),
        };
        if !self.cgroup.pids().contains(&pid) {
            tracing::warn!(exec = %exec_id, pid, "the exec helper's child is not a process of its container: not started");
            return not_started("the exec helper answered with a process outside its container".into());
        }
        let cg = cgroup.clone();
        tokio::task::spawn_blocking(move || move_into(&cg, pid))
            .await
            .unwrap_or_else(|e| Err(format!("join task: {e}")))
            .map_err(|e| BackendError::Internal(format!("exec {exec_id} setup: {e}")))?;
        let joined_us = phase0.elapsed().as_micros() as u64;
        // SAFETY: an OwnedFd stays open and keeps returning the same descriptor until the
        // AsyncFd that owns it is dropped.
        let pidfd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
            .map_err(|e| BackendError::io("watching the exec's pidfd", e.into()))?;
        self.execs.started(&exec_id, cgroup.clone());
        // 3. Go. (A child killed from inside meanwhile simply ends: its pidfd says how.)
        if let Err(e) = send(reply.get_ref().as_raw_fd(), serve::GO, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL) {
            tracing::debug!(exec = %exec_id, error = %e, "the exec's child is gone before its start");
        }
        drop(reply);
        let t0 = Instant::now();
        if let Some(tx) = started {
            let _ = tx.send(());
        }
        if let Some(w) = stdin_w {
            match tokio::net::unix::pipe::Sender::from_owned_fd(w) {
                Ok(w) => {
                    tokio::spawn(crate::backend::feed_pipe(w, spec.stdin.take(), session));
                }
                Err(e) => tracing::warn!(exec = %exec_id, error = %e, "cannot write the exec's stdin"),
            }
        }
        // 4. Output and the end.
        let stop = CancellationToken::new();
        let (out, err) = self.captures(spec);
        let pump_task = tokio::spawn(pump_pipes(out_r, err_r, out, err, sink, stop.clone()));
        tracing::debug!(exec = %exec_id, greeted_us, joined_us, "exec phases (exec channel)");
        self.finish(spec, cgroup, cancel, started_at, t0, pidfd, pump_task, stop, None).await
    }

    /// 4–5 of the module documentation, the same for both ways of starting: waits for the
    /// exit, the timeout or cancellation (the last two kill the exec's cgroup), drains the
    /// output (bounded), and classifies the end.
    #[allow(clippy::too_many_arguments)]
    async fn finish(
        &self,
        spec: &ExecSpec,
        cgroup: &Arc<ExecCgroup>,
        cancel: CancellationToken,
        started_at: SystemTime,
        t0: Instant,
        pidfd: tokio::io::unix::AsyncFd<OwnedFd>,
        mut pump_task: tokio::task::JoinHandle<Pumped>,
        stop: CancellationToken,
        docker_exec: Option<(&Docker, &str)>,
    ) -> Result<ExecOutcome, BackendError> {
        let exec_id = spec.exec_id.to_string();
        #[derive(Clone, Copy, PartialEq)]
        enum End {
            Exited,
            TimedOut,
            Cancelled,
        }
        let end = tokio::select! {
            r = pidfd.readable() => {
                if let Err(e) = r {
                    tracing::warn!(exec = %exec_id, error = %e, "waiting on the exec's pidfd");
                }
                End::Exited
            }
            // The sandbox's running time: a pause does not count against the timeout.
            () = spec.clock.sleep(spec.timeout) => End::TimedOut,
            _ = cancel.cancelled() => End::Cancelled,
        };
        if end != End::Exited {
            let cg = cgroup.clone();
            match tokio::task::spawn_blocking(move || cg.kill_all()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(exec = %exec_id, error = %e, "killing exec process tree"),
                Err(e) => tracing::warn!(exec = %exec_id, error = %e, "kill task failed"),
            }
            if tokio::time::timeout(KILL_WAIT, pidfd.readable()).await.is_err() {
                tracing::warn!(exec = %exec_id, "the exec's process is still there {} s after the kill", KILL_WAIT.as_secs());
            }
        }
        let duration = t0.elapsed();

        // Bounded wait for the output: a grandchild left in the background may hold the pipes,
        // and then `io_drain_timeout` is all it gets. With nothing left in the exec's cgroup
        // nobody holds them: what is still missing is only on its way through Docker (slow
        // under load), so the stream is waited for until it ends — bounded still. Otherwise a
        // busy host would cut the helper's failure line and a start failure would read as a
        // silent exit 127.
        let drain_started = Instant::now();
        let pumped = loop {
            match tokio::time::timeout(spec.io_drain_timeout, &mut pump_task).await {
                Ok(r) => break r,
                Err(_) if cgroup.is_empty() && drain_started.elapsed() < DRAIN_AFTER_EXIT => continue,
                Err(_) => {
                    stop.cancel();
                    break pump_task.await;
                }
            }
        };
        let Pumped { stdout, stderr, marker } = pumped.map_err(|e| BackendError::Internal(format!("output task: {e}")))?;
        let exit = exit_of(docker_exec, pidfd.get_ref()).await;
        let raw = cgroup.usage();
        let usage = ExecUsage { cpu_user_ms: raw.cpu_user_ms, cpu_system_ms: raw.cpu_system_ms, peak_memory_bytes: raw.peak_memory_bytes };

        // The container was taken down under this exec (rollback, destroy, shutdown): whatever
        // the kill made of it, the exec was lost with its sandbox.
        if let Some(reason) = self.lost_reason() {
            let error = format!("{reason} while the command ran");
            return Ok(ExecOutcome { status: ExecStatus::Lost, exit_code: -1, signal: 0, stdout, stderr, started_at, duration, usage, error });
        }
        if let (Some(m), Exit::Code(126 | 127)) = (&marker, exit) {
            let (code, error) = describe_failure_line(m, &spec.argv[0], &spec.workdir, spec.user.as_deref());
            return Ok(ExecOutcome { status: ExecStatus::SpawnFailed, exit_code: code, signal: 0, stdout, stderr, started_at, duration, usage, error });
        }
        use sandbox_exec::outcome::{classify, Cause, UNKNOWN_EXIT};
        let cause = match end {
            End::TimedOut => Cause::TimedOut,
            End::Cancelled => Cause::Cancelled,
            _ => Cause::Ended,
        };
        let end = classify(cause, exit, raw.oom_kills);
        let status = ExecStatus::from(end.status);
        let error = if status == ExecStatus::Lost { UNKNOWN_EXIT.to_string() } else { String::new() };
        Ok(ExecOutcome { status, exit_code: end.exit_code, signal: end.signal, stdout, stderr, started_at, duration, usage, error })
    }
}

/// The main process's end: from the pidfd when the kernel keeps it (exact), else from Docker
/// (which reports a signal death as 128+n, so on such kernels a command that exits with a code
/// above 128 is reported as signaled). Execs through the exec channel only run on kernels that
/// keep it (see `channel::take`).
async fn exit_of(docker_exec: Option<(&Docker, &str)>, pidfd: &OwnedFd) -> Exit {
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        match pidfd_exit(pidfd) {
            PidfdExit::Status(s) => return decode_wait_status(s),
            PidfdExit::Unsupported => break,
            PidfdExit::NotYet if Instant::now() > deadline => break,
            PidfdExit::NotYet => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    let Some((docker, docker_exec)) = docker_exec else { return Exit::Unknown };
    // Docker holds the record until the streams close (at most ~2 s after the exit).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match docker.inspect_exec(docker_exec).await {
            Ok(info) if info.running == Some(false) => {
                return match info.exit_code.and_then(|c| i32::try_from(c).ok()) {
                    Some(c) if (129..=128 + 64).contains(&c) => Exit::Signal(c - 128),
                    Some(c) => Exit::Code(c),
                    None => Exit::Unknown,
                };
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "inspecting an ended exec");
                return Exit::Unknown;
            }
        }
        if Instant::now() > deadline {
            return Exit::Unknown;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_is_stripped_and_ordinary_stderr_passes() {
        let mut f = MarkerFilter::new();
        assert!(f.filter(b"\x1fsandboxd").is_empty(), "a possible marker prefix is held back");
        assert_eq!(f.filter(b"-spawn exec 2\n"), b"");
        assert_eq!(f.found.as_deref(), Some("exec 2"));

        let mut f = MarkerFilter::new();
        assert_eq!(f.filter(b"hello"), b"hello");
        assert_eq!(f.filter(b"\x1fsandboxd-spawn x\n"), b"\x1fsandboxd-spawn x\n", "only the first bytes can be a marker");
        assert!(f.found.is_none());

        let mut f = MarkerFilter::new();
        assert!(f.filter(b"\x1f").is_empty());
        assert_eq!(f.finish(), b"\x1f", "held bytes are released at the end");
    }

    #[test]
    fn failure_lines_become_the_sentences_of_every_tier() {
        use nix::errno::Errno;
        let line = |stage, errno| {
            let bytes = spawn::failure_line(stage, errno);
            String::from_utf8_lossy(&bytes[spawn::FAILURE_LINE_PREFIX.len()..]).trim_end().to_string()
        };
        assert_eq!(describe_failure_line(&line(spawn::Stage::Exec, Errno::ENOENT), "nope", "/w", None), (127, "executable not found: nope".into()));
        assert_eq!(describe_failure_line(&line(spawn::Stage::Exec, Errno::EACCES), "/x.sh", "/w", None).0, 126);
        let (code, text) = describe_failure_line(&line(spawn::Stage::Workdir, Errno::ENOENT), "pwd", "/no/such/dir", None);
        assert_eq!(code, 127);
        assert!(text.contains("/no/such/dir"), "{text}");
        assert_eq!(describe_failure_line("garbage", "x", "/", None).0, 127);
    }

    #[test]
    fn wait_status_decoding() {
        assert!(matches!(decode_wait_status(3 << 8), Exit::Code(3)));
        assert!(matches!(decode_wait_status(libc::SIGTERM), Exit::Signal(15)));
    }
}
