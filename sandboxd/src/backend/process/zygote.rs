//! The zygote: one small process that clones every process-tier sandbox's init.
//!
//! The daemon is multi-threaded, so it cannot fork an init itself; it used to start a fresh
//! `sandboxd` per sandbox (a shim that cloned the init and stayed behind to wait for it). That
//! cost an exec of the whole binary on every create and a process per live sandbox holding its
//! own copy of the binary's relocated data. Instead the daemon starts this binary once, as the
//! zygote (single-threaded, started with nothing but its control socket, no runtime): on each
//! `Start` it clones an init straight into new pid (and user) namespaces, with the sandbox's
//! control socket on fd 3 and its log pipe as stderr, and the init goes on from there
//! ([`super::init::run`]). The inits share the zygote's pages until they write them. The zygote
//! is every init's parent: it reaps them and tells the daemon (`Exited`), which is how the daemon
//! knows a sandbox's pid namespace is empty.
//!
//! If the zygote dies, every init gets SIGKILL (their parent-death signal) and their sandboxes end
//! as if their inits had been killed; the next create starts a new zygote. The zygote exits when
//! the daemon goes away (its control socket reads EOF), which ends every sandbox, as before.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::unistd::ForkResult;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::channel::{recv_on, send_on};
use super::init::{self, CONTROL_FD};
use super::wire::{decode, encode, recv_raw, send_raw, FromZygote, ToZygote, WireError};

/// The hidden first argument that turns the `sandboxd` binary into the zygote. Its name is the
/// one the per-sandbox init had: every init is a fork of the zygote, so this is the command line
/// a sandbox sees for its PID 1.
pub const ZYGOTE_ARG: &str = "__sandbox-init";

/// How long the zygote may take to answer a `Start` (a clone and two small writes).
const START_DEADLINE: Duration = Duration::from_secs(10);

/// This build's fingerprint of its sources (build.rs). `sandbox-init` runs as the zygote only
/// when it prints the same: one left from another build could speak another protocol to the
/// daemon, or lack a fix to the code every sandbox's PID 1 runs.
pub const BUILD: &str = env!("SANDBOXD_BUILD");

/// The argument that makes `sandbox-init` print its build and exit.
pub const BUILD_ARG: &str = "--build";

/// The init's own binary, looked for beside the daemon's (src/bin/sandbox-init.rs).
const INIT_BINARY: &str = "sandbox-init";

/// How long `sandbox-init --build` may take to answer.
const BUILD_CHECK_DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The zygote's side: a fresh, single-threaded process.

/// Entry point of `sandboxd __sandbox-init`. Never returns.
pub fn main() -> ! {
    // SAFETY: the daemon put the control socket on fd 3 for us (dup2 in pre_exec); nothing else
    // in this fresh process owns it.
    let ctrl = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    std::process::exit(serve(ctrl))
}

fn send(ctrl: &OwnedFd, msg: &FromZygote) {
    if let Err(e) = encode(msg).and_then(|bytes| send_raw(ctrl.as_fd(), &bytes, &[])) {
        eprintln!("sandbox-zygote: cannot send {msg:?}: {e}");
    }
}

/// Sets the calling thread's name (what `ps -o comm` shows), best effort.
fn set_name(name: &std::ffi::CStr) {
    // SAFETY: prctl with a valid C string, which the kernel copies.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) };
}

/// The zygote's loop: `Start` and `Kill` from the daemon, child exits from the kernel.
fn serve(ctrl: OwnedFd) -> i32 {
    set_name(c"sandbox-zygote");
    // Only stdio and the control socket: a descriptor the daemon inherited from whoever started
    // it must not become an init's.
    // SAFETY: close_range only closes descriptors; none above 3 is owned by anything here.
    if unsafe { libc::syscall(libc::SYS_close_range, (CONTROL_FD + 1) as u32, u32::MAX, 0u32) } != 0 {
        eprintln!("sandbox-zygote: close_range: {}", Errno::last());
        return 1;
    }
    let sfd = match init::child_signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandbox-zygote: signalfd: {e}");
            return 1;
        }
    };
    // Inits by host pid, and the other way round.
    let mut tokens: HashMap<libc::pid_t, u64> = HashMap::new();
    let mut pids: HashMap<u64, libc::pid_t> = HashMap::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let (ctrl_ready, chld_ready) = match init::wait_ctrl_or_child(&ctrl, &sfd) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("sandbox-zygote: poll: {e}");
                return 1;
            }
        };
        if chld_ready {
            while let Ok(Some(_)) = sfd.read_signal() {}
            loop {
                match init::wait_child(-1, libc::WNOHANG) {
                    Ok(Some(ended)) => {
                        if let Some(token) = tokens.remove(&ended.pid.as_raw()) {
                            pids.remove(&token);
                            send(&ctrl, &FromZygote::Exited { token, code: ended.code, signal: ended.signal });
                        }
                    }
                    Err(Errno::EINTR) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
        }
        if !ctrl_ready {
            continue;
        }
        let (n, fds) = match recv_raw(ctrl.as_fd(), &mut buf) {
            // The daemon is gone: exiting kills every init (their parent-death signal).
            Ok(None) => return 0,
            Ok(Some(m)) => m,
            // One bad message (oversized, truncated): the socket itself is still sound.
            Err(e @ (WireError::TooLarge(_) | WireError::Malformed(_) | WireError::Io(Errno::EINTR | Errno::EAGAIN))) => {
                eprintln!("sandbox-zygote: reading a request: {e}");
                continue;
            }
            Err(e) => {
                eprintln!("sandbox-zygote: control socket: {e}");
                return 1;
            }
        };
        match decode::<ToZygote>(&buf[..n]) {
            Ok(ToZygote::Start { token, id_base, oom_score_adj }) => match start(fds, id_base, oom_score_adj) {
                Ok(pid) => {
                    tokens.insert(pid, token);
                    pids.insert(token, pid);
                    send(&ctrl, &FromZygote::Started { token, pid });
                }
                Err((stage, errno)) => send(&ctrl, &FromZygote::StartFailed { token, stage: stage.to_string(), errno: errno as i32 }),
            },
            Ok(ToZygote::Kill { token }) => {
                if let Some(&pid) = pids.get(&token) {
                    // Not yet reaped (that happens only here), so the pid is still the init's.
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            Err(e) => eprintln!("sandbox-zygote: bad request: {e}"),
        }
    }
}

/// Clones one init; in the parent returns its host pid. `fds`: the init's control socket and
/// the write end of its log pipe.
fn start(fds: Vec<OwnedFd>, id_base: Option<u32>, oom_score_adj: i32) -> Result<libc::pid_t, (&'static str, Errno)> {
    let mut fds = fds.into_iter();
    let (Some(ctrl), Some(log), None) = (fds.next(), fds.next(), fds.next()) else {
        return Err(("the start request's descriptors", Errno::EINVAL));
    };
    match init::clone_init(id_base)? {
        ForkResult::Child => std::process::exit(child(ctrl, log, oom_score_adj)),
        // The parent's copies close here: only the init holds its ends.
        ForkResult::Parent { child } => Ok(child.as_raw()),
    }
}

/// The init's first steps, in the clone: the descriptors a fresh exec would have, the sandbox's
/// OOM score, then the init proper.
fn child(ctrl: OwnedFd, log: OwnedFd, oom_score_adj: i32) -> i32 {
    set_name(c"sandbox-init");
    // The zygote blocks SIGCHLD for its signalfd; the init starts as an exec would, with none.
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    let null = match std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
        Ok(f) => OwnedFd::from(f),
        Err(e) => {
            eprintln!("sandbox-init: opening /dev/null: {e}");
            return 1;
        }
    };
    // Released from their owners: close_range below closes them, and nothing may close a number
    // twice. Every received descriptor is above 3 (0-2 are stdio and 3 the zygote's socket).
    let (ctrl, log, null): (RawFd, RawFd, RawFd) = (ctrl.into_raw_fd(), log.into_raw_fd(), null.into_raw_fd());
    for (from, to) in [(null, 0), (null, 1), (log, 2), (ctrl, CONTROL_FD)] {
        // SAFETY: dup2 on descriptors this process holds; the target numbers are replaced.
        if unsafe { libc::dup2(from, to) } < 0 {
            return 1;
        }
    }
    // SAFETY: close_range only closes descriptors: the zygote's (its socket was replaced on 3,
    // its signalfd), and the originals of those just placed.
    if unsafe { libc::syscall(libc::SYS_close_range, (CONTROL_FD + 1) as u32, u32::MAX, 0u32) } != 0 {
        return 1;
    }
    // SAFETY: fd 3 now holds the init's control socket, owned by nothing else here.
    let ctrl = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    // The daemon's low score is the zygote's: processes in a sandbox must be the kernel's choice
    // under memory pressure before it (raising one's own score needs no privilege).
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", oom_score_adj.to_string()) {
        eprintln!("sandbox-init: setting oom_score_adj: {e}");
    }
    init::run(ctrl)
}

// ---------------------------------------------------------------------------------------------
// The daemon's side.

/// The daemon's handle on the zygote: started on first use, and again after it died.
#[derive(Default)]
pub(super) struct Zygote {
    running: tokio::sync::Mutex<Option<Arc<Running>>>,
    next_token: AtomicU64,
    /// What the zygote runs, chosen once ([`zygote_exe`]).
    exe: tokio::sync::OnceCell<PathBuf>,
}

/// What the daemon waits for from one zygote.
#[derive(Default)]
struct Waiting {
    starts: HashMap<u64, oneshot::Sender<Result<i32, String>>>,
    exits: HashMap<u64, oneshot::Sender<()>>,
}

/// One zygote process and its control socket.
struct Running {
    fd: Arc<AsyncFd<OwnedFd>>,
    send_lock: tokio::sync::Mutex<()>,
    waiting: Arc<Mutex<Waiting>>,
    gone: CancellationToken,
}

/// Why `path` cannot serve as the zygote, or `Ok` when it is a `sandbox-init` of this build.
async fn check_init_binary(path: &Path, deadline: Duration) -> Result<(), String> {
    if !path.is_file() {
        return Err(format!("{} not found", path.display()));
    }
    use tokio::io::AsyncReadExt;
    let mut cmd = tokio::process::Command::new(path);
    cmd.arg(BUILD_ARG)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let answer = async {
        let mut child = cmd.spawn()?;
        // A build is 16 hex digits and a newline: read no more than a line's worth.
        let mut out = Vec::new();
        if let Some(stdout) = child.stdout.take() {
            stdout.take(256).read_to_end(&mut out).await?;
        }
        Ok::<_, std::io::Error>((out, child.wait().await?))
    };
    let (out, status) = match tokio::time::timeout(deadline, answer).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return Err(format!("running {} {BUILD_ARG}: {e}", path.display())),
        Err(_) => return Err(format!("{} {BUILD_ARG} did not answer within {deadline:?}", path.display())),
    };
    let build = String::from_utf8_lossy(&out);
    match build.trim() {
        b if status.success() && b == BUILD => Ok(()),
        b => Err(format!("{} is of another build ({:?}, this daemon's is {BUILD}, {status})", path.display(), b.chars().take(64).collect::<String>())),
    }
}

/// The executable the zygote runs: `sandbox-init` beside the daemon's binary when it is of this
/// build, else the daemon's own binary (which holds the same code), with a warning saying why.
async fn zygote_exe() -> Result<PathBuf, String> {
    let daemon = std::env::current_exe().map_err(|e| format!("locating the sandboxd binary: {e}"))?;
    let init = daemon.with_file_name(INIT_BINARY);
    match check_init_binary(&init, BUILD_CHECK_DEADLINE).await {
        Ok(()) => {
            tracing::info!(path = %init.display(), "process-tier inits run from sandbox-init");
            Ok(init)
        }
        Err(why) => {
            tracing::warn!(
                %why,
                daemon = %daemon.display(),
                "process-tier inits run from the daemon's own binary, ~40 KiB more page tables per live sandbox: install sandbox-init \
                 of the same build beside sandboxd (cargo build --bins builds both)"
            );
            Ok(daemon)
        }
    }
}

impl Running {
    fn spawn(exe: &Path) -> Result<Arc<Running>, String> {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).map_err(|e| format!("control socket: {e}"))?;
        let mut cmd = std::process::Command::new(exe);
        // argv[0] is a name, not the daemon's host path, which a sandbox has no business seeing
        // (every init is a fork of this process, with its command line).
        cmd.arg0("sandbox-init").arg(ZYGOTE_ARG).env_clear().stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
        let child_fd = theirs.as_raw_fd();
        // SAFETY: dup2 is async-signal-safe; the closure only places the control socket on fd 3
        // (clearing CLOEXEC) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(child_fd, CONTROL_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = tokio::process::Command::from(cmd).kill_on_drop(true).spawn().map_err(|e| format!("starting the sandbox zygote: {e}"))?;
        drop(theirs);
        let flags = nix::fcntl::fcntl(ours.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL).map_err(|e| format!("control socket: {e}"))?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(ours.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags)).map_err(|e| format!("control socket: {e}"))?;
        // SAFETY: the descriptor is an OwnedFd moved into the AsyncFd, which keeps it open.
        let fd = Arc::new(unsafe { AsyncFd::register(ours) }.map_err(|e| format!("control socket: {e}"))?);
        let running = Arc::new(Running { fd: fd.clone(), send_lock: Default::default(), waiting: Default::default(), gone: CancellationToken::new() });
        let (waiting, gone) = (running.waiting.clone(), running.gone.clone());
        tracing::debug!(pid = child.id(), "sandbox zygote started");
        tokio::spawn(async move {
            loop {
                let (bytes, _) = match recv_on::<4096>(&fd).await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                        tracing::warn!(error = %e, "dropping a bad message from the sandbox zygote");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading from the sandbox zygote");
                        break;
                    }
                };
                let Ok(mut w) = waiting.lock() else { break };
                match decode::<FromZygote>(&bytes) {
                    Ok(FromZygote::Started { token, pid }) => {
                        if let Some(tx) = w.starts.remove(&token) {
                            let _ = tx.send(Ok(pid));
                        }
                    }
                    Ok(FromZygote::StartFailed { token, stage, errno }) => {
                        w.exits.remove(&token);
                        if let Some(tx) = w.starts.remove(&token) {
                            let _ = tx.send(Err(format!("{stage}: {}", Errno::from_raw(errno))));
                        }
                    }
                    Ok(FromZygote::Exited { token, .. }) => {
                        w.exits.remove(&token);
                    }
                    Err(e) => tracing::warn!(error = %e, "malformed message from the sandbox zygote"),
                }
            }
            gone.cancel();
            // Dropping the senders wakes every waiter: with the zygote, every init died.
            let live = waiting.lock().map(|mut w| std::mem::take(&mut *w).exits.len()).unwrap_or(0);
            let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            tracing::error!(?status, live, "the sandbox zygote exited; the sandboxes it started are gone (the next create starts another)");
        });
        Ok(running)
    }
}

/// A started init as the daemon holds it.
pub(super) struct InitHandle {
    token: u64,
    pid: i32,
    exited: Option<oneshot::Receiver<()>>,
    zygote: Arc<Running>,
}

impl InitHandle {
    /// The init's host pid. It names the init until the sandbox is stopped: only the zygote can
    /// reap it, and the zygote tells this handle when it does.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Waits until the init has ended and been reaped, so its pid namespace is empty (or until
    /// the zygote is gone, which kills every init).
    pub async fn wait(&mut self) {
        if let Some(rx) = self.exited.as_mut() {
            let _ = rx.await;
        }
        self.exited = None;
    }

    /// Has the zygote SIGKILL the init, if it still runs.
    pub async fn kill(&self) {
        if let Ok(bytes) = encode(&ToZygote::Kill { token: self.token }) {
            let _guard = self.zygote.send_lock.lock().await;
            if let Err(e) = send_on(&self.zygote.fd, &bytes, &[]).await {
                tracing::debug!(error = %e, "asking the sandbox zygote to kill an init");
            }
        }
    }
}

/// A `Start` sent, its answer not yet read.
pub(super) struct PendingStart {
    token: u64,
    started: oneshot::Receiver<Result<i32, String>>,
    exited: oneshot::Receiver<()>,
    zygote: Arc<Running>,
}

impl PendingStart {
    /// The zygote's answer: the init's handle and host pid, or why it could not be started.
    pub async fn started(self) -> Result<InitHandle, String> {
        let pid = match tokio::time::timeout(START_DEADLINE, self.started).await {
            Ok(Ok(r)) => r?,
            Ok(Err(_)) => return Err("the sandbox zygote exited".to_string()),
            Err(_) => return Err(format!("the sandbox zygote did not answer within {START_DEADLINE:?}")),
        };
        Ok(InitHandle { token: self.token, pid, exited: Some(self.exited), zygote: self.zygote })
    }
}

impl Zygote {
    /// Asks the zygote (started first if none runs) to clone an init with `ctrl` (the init's end
    /// of its control socket) on fd 3 and `log` as its stderr.
    pub async fn start(&self, ctrl: &OwnedFd, log: &OwnedFd, id_base: Option<u32>, oom_score_adj: i32) -> Result<PendingStart, String> {
        let zygote = self.running().await?;
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let bytes = encode(&ToZygote::Start { token, id_base, oom_score_adj }).map_err(|e| e.to_string())?;
        let (start_tx, started) = oneshot::channel();
        let (exit_tx, exited) = oneshot::channel();
        {
            let mut w = zygote.waiting.lock().map_err(|_| "zygote state poisoned".to_string())?;
            if zygote.gone.is_cancelled() {
                return Err("the sandbox zygote exited".to_string());
            }
            w.starts.insert(token, start_tx);
            w.exits.insert(token, exit_tx);
        }
        let sent = {
            let _guard = zygote.send_lock.lock().await;
            send_on(&zygote.fd, &bytes, &[ctrl.as_raw_fd(), log.as_raw_fd()]).await
        };
        if let Err(e) = sent {
            if let Ok(mut w) = zygote.waiting.lock() {
                w.starts.remove(&token);
                w.exits.remove(&token);
            }
            return Err(format!("sending to the sandbox zygote: {e}"));
        }
        Ok(PendingStart { token, started, exited, zygote })
    }

    async fn running(&self) -> Result<Arc<Running>, String> {
        let mut running = self.running.lock().await;
        if let Some(r) = running.as_ref().filter(|r| !r.gone.is_cancelled()) {
            return Ok(r.clone());
        }
        let exe = self.exe.get_or_try_init(zygote_exe).await?;
        let r = Running::spawn(exe)?;
        *running = Some(r.clone());
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// An executable shell script at `dir/name`.
    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("writing the script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    /// [`check_init_binary`], again while the script is still open for writing somewhere: a
    /// test thread forking elsewhere in this process can hold it for a moment (ETXTBSY).
    async fn check(path: &Path, deadline: Duration) -> Result<(), String> {
        for _ in 0..50 {
            match check_init_binary(path, deadline).await {
                Err(e) if e.contains("busy") => tokio::time::sleep(Duration::from_millis(20)).await,
                r => return r,
            }
        }
        check_init_binary(path, deadline).await
    }

    #[tokio::test]
    async fn only_a_sandbox_init_of_this_build_is_chosen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deadline = Duration::from_secs(10);
        let same = script(dir.path(), "same", &format!("[ \"$1\" = {BUILD_ARG} ] && echo {BUILD}"));
        let other = script(dir.path(), "other", "echo 0123456789abcdef");
        let failing = script(dir.path(), "failing", &format!("echo {BUILD}; exit 3"));
        let flood = script(dir.path(), "flood", &format!("echo {BUILD}; exec yes"));
        let silent = script(dir.path(), "silent", "exec sleep 30");

        assert_eq!(check(&same, deadline).await, Ok(()));

        let missing = check(&dir.path().join("absent"), deadline).await.expect_err("a missing file");
        assert!(missing.contains("not found"), "{missing}");

        let err = check(&other, deadline).await.expect_err("another build");
        assert!(err.contains("another build") && err.contains("0123456789abcdef"), "{err}");

        // The right build but a failing exit is not trusted either.
        assert!(check(&failing, deadline).await.is_err());

        // Endless output is read no further than a line's worth: the check ends at once (the
        // writer dies on the closed pipe) with a mismatch, long before the deadline.
        let err = check(&flood, deadline).await.expect_err("endless output");
        assert!(err.contains("another build"), "{err}");

        let err = check(&silent, Duration::from_millis(200)).await.expect_err("a hung binary");
        assert!(err.contains("did not answer"), "{err}");
    }
}
