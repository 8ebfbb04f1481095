//! Fork and exec of one command, the same on every tier: the process tier's init, the microVM's
//! guest agent and the container tier's exec helper all start commands through this module.
//!
//! The semantics: argv[0] looked up in the `PATH` of the command's own environment (like
//! `execvp`, [`DEFAULT_PATH`] when it has none), exactly that environment, its own session, the
//! exec's cgroup joined before anything else, default signal dispositions, no descriptor of the
//! runtime leaking in — and when it cannot start, the [`Stage`] it failed at and the errno, sent
//! back over an error pipe and turned into an exit code (127 not found, 126 not executable, as
//! shells use) and the sentence a user reads in `ExecResult.error` by [`describe_failure`].
//!
//! A runtime may be multi-threaded (the guest agent is), so between `fork` and `execve` the child
//! may only make async-signal-safe calls: everything it needs (C strings, pointer arrays,
//! candidate paths) is prepared in [`Command::new`] before the fork, and the child itself only
//! makes raw syscalls.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

use crate::capture::DEFAULT_PATH;

/// Where a child failed before it became the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Cgroup = 1,
    Workdir = 2,
    Exec = 3,
    Stdio = 4,
    /// Before there was a child: the runtime could not make the pipe or fork, or could not use
    /// the request.
    Setup = 5,
    /// The exec's user: not in the sandbox's passwd/group, or the switch to it failed.
    User = 6,
}

impl Stage {
    /// The stage a child wrote as its first error byte (unknown bytes count as `Exec`).
    pub fn from_byte(b: u8) -> Stage {
        match b {
            1 => Stage::Cgroup,
            2 => Stage::Workdir,
            4 => Stage::Stdio,
            5 => Stage::Setup,
            6 => Stage::User,
            _ => Stage::Exec,
        }
    }

    /// Its name on a wire (the process tier's control messages).
    pub fn name(self) -> &'static str {
        match self {
            Stage::Cgroup => "cgroup",
            Stage::Workdir => "workdir",
            Stage::Exec => "exec",
            Stage::Stdio => "stdio",
            Stage::Setup => "setup",
            Stage::User => "user",
        }
    }

    /// The stage named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Stage> {
        [Stage::Cgroup, Stage::Workdir, Stage::Exec, Stage::Stdio, Stage::Setup, Stage::User].into_iter().find(|s| s.name() == name)
    }

    /// The exit code a child failing here ends with.
    pub fn exit_code(self, errno: Errno) -> i32 {
        // Docker's `exec -u nobody-here` ends 126 too: the command exists, it cannot be run so.
        if self == Stage::User || (self == Stage::Exec && errno != Errno::ENOENT && errno != Errno::ENOTDIR) {
            126
        } else {
            127
        }
    }
}

/// Why a command did not start: exit code and a sentence.
pub fn describe_failure(stage: Stage, errno: Errno, argv0: &str, workdir: &str, user: Option<&str>) -> (i32, String) {
    let user = user.unwrap_or("root");
    let sentence = match (stage, errno) {
        (Stage::Exec, Errno::ENOENT | Errno::ENOTDIR) => format!("executable not found: {argv0}"),
        (Stage::Exec, Errno::EACCES) => format!("permission denied: {argv0} is not executable"),
        (Stage::Exec, Errno::ENOEXEC) => format!("{argv0} is not an executable format (a script without #!?)"),
        (Stage::Exec, e) => format!("cannot execute {argv0}: {}", e.desc()),
        (Stage::Workdir, e) => format!("cannot enter working directory {workdir}: {}", e.desc()),
        (Stage::Cgroup, e) => format!("cannot join the exec's cgroup: {}", e.desc()),
        (Stage::Stdio, e) => format!("cannot set up the command's stdio: {}", e.desc()),
        (Stage::Setup, e) => format!("cannot start {argv0}: {}", e.desc()),
        (Stage::User, Errno::ENOENT) => format!("user {user:?} is not in the sandbox's /etc/passwd or /etc/group"),
        (Stage::User, Errno::EINVAL) => format!("user {user:?} is malformed: expected name, uid, name:group or uid:gid"),
        (Stage::User, e) => format!("cannot switch to user {user:?}: {}", e.desc()),
    };
    (stage.exit_code(errno), sentence)
}

/// A command ready to be exec'd from a forked child.
pub struct Command {
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    /// Owns the strings `env_ptrs` points to.
    env: Vec<CString>,
    env_ptrs: Vec<*const libc::c_char>,
    candidates: Vec<CString>,
    workdir: CString,
    /// Make stdin (a terminal's slave side) the controlling terminal of the command's session.
    controlling_tty: bool,
    /// Switch to these before anything of the command's (none: the runtime's own, root).
    user: Option<(libc::uid_t, libc::gid_t, Vec<libc::gid_t>)>,
}

/// Why a command cannot even be prepared (the daemon validates requests, so these are a
/// runtime's last line of defence, reported as [`Stage::Setup`] with `EINVAL`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("empty argv")]
    EmptyArgv,
    #[error("empty program name")]
    EmptyProgram,
    #[error("{0:?} contains a NUL byte")]
    NulByte(String),
}

fn cstring(s: &str) -> Result<CString, CommandError> {
    CString::new(s).map_err(|_| CommandError::NulByte(s.to_string()))
}

impl Command {
    /// Prepares `argv` with exactly `env`, to run in `workdir`. Fails (with a sentence) on an
    /// empty argv or a NUL byte anywhere.
    pub fn new(argv: &[String], env: &[(String, String)], workdir: &str) -> Result<Command, CommandError> {
        let first = argv.first().ok_or(CommandError::EmptyArgv)?;
        if first.is_empty() {
            return Err(CommandError::EmptyProgram);
        }
        let argv_c = argv.iter().map(|a| cstring(a)).collect::<Result<Vec<_>, _>>()?;
        let env_c = env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<Result<Vec<_>, _>>()?;
        let path = env.iter().rev().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or(DEFAULT_PATH);
        let candidates = if first.contains('/') {
            vec![cstring(first)?]
        } else {
            path.split(':').map(|dir| if dir.is_empty() { "." } else { dir }).map(|dir| cstring(&format!("{dir}/{first}"))).collect::<Result<Vec<_>, _>>()?
        };
        let mut argv_ptrs: Vec<_> = argv_c.iter().map(|c| c.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        let mut env_ptrs: Vec<_> = env_c.iter().map(|c| c.as_ptr()).collect();
        env_ptrs.push(std::ptr::null());
        Ok(Command { _argv: argv_c, argv_ptrs, env: env_c, env_ptrs, candidates, workdir: cstring(workdir)?, controlling_tty: false, user: None })
    }
}

impl Command {
    /// The command runs on a terminal: its stdin (the slave side of a pseudo-terminal, which its
    /// stdout and stderr usually are too) becomes the controlling terminal of its session, so
    /// job control works and Ctrl-C on the terminal reaches its foreground process group.
    pub fn on_terminal(mut self) -> Command {
        self.controlling_tty = true;
        self
    }

    /// The command runs with these credentials (groups, then gid, then uid, all three of each
    /// id: a process cannot switch back). A non-root uid loses every capability at the switch.
    /// Its `HOME` is the user's home unless its env has one (as Docker does: the daemon leaves
    /// `HOME` out of a non-root exec's defaults).
    pub fn as_user(mut self, creds: &crate::user::Credentials) -> Command {
        self.user = Some((creds.uid, creds.gid, creds.groups.clone()));
        if !self.env.iter().any(|e| e.as_bytes().starts_with(b"HOME=")) {
            if let Ok(home) = cstring(&format!("HOME={}", creds.home)) {
                self.env.push(home);
                // The strings' bytes stay where they were; only the pointer list is new.
                self.env_ptrs = self.env.iter().map(|c| c.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
            }
        }
        self
    }
}

/// The descriptors a child gets.
pub struct ChildFds<'a> {
    /// Become the command's 0, 1 and 2.
    pub stdio: [RawFd; 3],
    /// `cgroup.procs` of the exec's cgroup, opened for writing: one per hierarchy on cgroup v1,
    /// one on v2, none where the runtime has no per-exec cgroup (unit tests).
    pub cgroup_procs: &'a [RawFd],
    /// Closed by a successful execve (it must be close-on-exec); gets (stage, errno) otherwise.
    pub err_w: RawFd,
}

/// Runs in the forked child: [`enter`] its session and cgroup, then [`exec`]. Never returns.
pub fn child(cmd: &Command, fds: &ChildFds) -> ! {
    enter(fds.cgroup_procs, fds.err_w);
    exec(cmd, fds.stdio, fds.err_w)
}

/// The first steps of a child, which a runtime may take ahead of time (the process tier's init
/// forks a spare into the next exec's cgroup before the command is known): a session of its own
/// — a signal to its process group reaches the whole tree, and a shell without a terminal does
/// not stop on job control — and the exec's cgroup, first, so nothing the command does escapes
/// its accounting and limits. Reports a failure and exits.
pub fn enter(cgroup_procs: &[RawFd], err_w: RawFd) {
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        libc::setsid();
    }
    join(cgroup_procs, err_w);
}

/// Joins a cgroup by writing "0" to each of its `cgroup.procs` (or, for a single-threaded
/// process, v1 `tasks`) files. Reports a failure and exits. Async-signal-safe.
pub fn join(files: &[RawFd], err_w: RawFd) {
    for &file in files {
        // SAFETY: write is async-signal-safe; the descriptors belong to this child.
        if unsafe { libc::write(file, b"0".as_ptr().cast(), 1) } != 1 {
            fail(err_w, Stage::Cgroup, Errno::last());
        }
    }
}

/// Becomes the command, in a child that has [`enter`]ed: see [`attempt`]. Never returns; a
/// failure is reported on `err_w` as the stage and errno, and the child exits with the code
/// [`Stage::exit_code`] gives.
pub fn exec(cmd: &Command, stdio: [RawFd; 3], err_w: RawFd) -> ! {
    let (stage, errno) = attempt(cmd, stdio);
    fail(err_w, stage, errno)
}

/// Tries to become the command: signal mask and dispositions reset, stdio in place, the working
/// directory entered, every other descriptor close-on-exec, and argv[0] tried along the `PATH`.
/// Returns only if that failed, with where and why. Async-signal-safe.
pub fn attempt(cmd: &Command, stdio: [RawFd; 3]) -> (Stage, Errno) {
    // SAFETY: (the whole function) only async-signal-safe libc calls on descriptors and memory
    // that were prepared before the fork and stay valid until execve or _exit.
    unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            return (Stage::Stdio, Errno::last());
        }
        // Default dispositions: the Rust runtime ignores SIGPIPE, and an ignored signal stays
        // ignored across execve (`yes | head` would print EPIPE errors).
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        // A descriptor already at its place only loses close-on-exec; dup2 onto itself would not.
        for (target, &fd) in stdio.iter().enumerate() {
            let target = target as RawFd;
            let rc = if fd == target { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, target) };
            if rc < 0 {
                return (Stage::Stdio, Errno::last());
            }
        }
        // The session was made by `enter` (or by the runtime that started us); a session leader
        // without a controlling terminal acquires the one it names here.
        if cmd.controlling_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
            return (Stage::Stdio, Errno::last());
        }
        // Raw syscalls, not glibc's wrappers: those signal every thread of a multi-threaded
        // process (the guest agent), and only this thread exists in the child. Before chdir, so
        // the working directory is entered with the user's permissions.
        if let Some((uid, gid, groups)) = &cmd.user {
            if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
                || libc::syscall(libc::SYS_setresgid, *gid, *gid, *gid) != 0
                || libc::syscall(libc::SYS_setresuid, *uid, *uid, *uid) != 0
            {
                return (Stage::User, Errno::last());
            }
        }
        if libc::chdir(cmd.workdir.as_ptr()) != 0 {
            return (Stage::Workdir, Errno::last());
        }
        // Nothing of the runtime (its control channel, other execs' pipes) may leak in.
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        let mut last = Errno::ENOENT;
        let mut saw_eacces = false;
        for path in &cmd.candidates {
            libc::execve(path.as_ptr(), cmd.argv_ptrs.as_ptr(), cmd.env_ptrs.as_ptr());
            match Errno::last() {
                Errno::EACCES => saw_eacces = true,
                Errno::ENOENT | Errno::ENOTDIR => {}
                other => return (Stage::Exec, other),
            }
            last = Errno::last();
        }
        (Stage::Exec, if saw_eacces { Errno::EACCES } else { last })
    }
}

/// Start of the line a runtime without an error pipe (the container tier's exec helper, which
/// Docker starts) writes on the command's stderr when it cannot become the command. The unit
/// separator byte keeps it from matching anything a user would print first.
pub const FAILURE_LINE_PREFIX: &[u8] = b"\x1fsandboxd-spawn ";

/// The whole failure line for (stage, errno), newline included.
pub fn failure_line(stage: Stage, errno: Errno) -> Vec<u8> {
    let mut line = FAILURE_LINE_PREFIX.to_vec();
    line.extend_from_slice(format!("{} {}\n", stage.name(), errno as i32).as_bytes());
    line
}

/// Parses what followed [`FAILURE_LINE_PREFIX`] (without the newline); `None` if it is not a
/// line [`failure_line`] wrote.
pub fn parse_failure_line(rest: &str) -> Option<(Stage, Errno)> {
    let mut words = rest.split_whitespace();
    let stage = Stage::from_name(words.next()?)?;
    let errno = words.next()?.parse::<i32>().ok()?;
    words.next().is_none().then_some((stage, Errno::from_raw(errno)))
}

/// Reports (stage, errno) to the parent and exits the child with the stage's exit code.
pub fn fail(err_w: RawFd, stage: Stage, errno: Errno) -> ! {
    let mut msg = [0u8; FAILURE_LEN];
    msg[0] = stage as u8;
    msg[1..].copy_from_slice(&(errno as i32).to_le_bytes());
    let code = stage.exit_code(errno);
    // SAFETY: write and _exit are async-signal-safe; msg lives on this stack.
    unsafe {
        libc::write(err_w, msg.as_ptr().cast(), msg.len());
        libc::_exit(code)
    }
}

/// Reads the child's error pipe: `None` (EOF) once execve succeeded, else where it failed.
pub fn read_failure(err_r: &OwnedFd) -> Option<(Stage, Errno)> {
    let mut buf = [0u8; FAILURE_LEN];
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(err_r.as_raw_fd(), &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    decode_failure(&buf[..got])
}

/// The length of the failure record a child writes to its error pipe before it exits.
pub const FAILURE_LEN: usize = 5;

/// The failure record read from an error pipe up to its EOF: `None` (nothing, or less than a
/// whole record) means execve succeeded.
pub fn decode_failure(buf: &[u8]) -> Option<(Stage, Errno)> {
    match buf {
        [stage, a, b, c, d, ..] => Some((Stage::from_byte(*stage), Errno::from_raw(i32::from_le_bytes([*a, *b, *c, *d])))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_of_codes_and_sentences() {
        let cases = [
            (Stage::Exec, Errno::ENOENT, 127, "executable not found: prog"),
            (Stage::Exec, Errno::ENOTDIR, 127, "executable not found: prog"),
            (Stage::Exec, Errno::EACCES, 126, "permission denied: prog is not executable"),
            (Stage::Exec, Errno::ENOEXEC, 126, "prog is not an executable format (a script without #!?)"),
            (Stage::Exec, Errno::E2BIG, 126, "cannot execute prog: Argument list too long"),
            (Stage::Workdir, Errno::ENOENT, 127, "cannot enter working directory /w: No such file or directory"),
            (Stage::Workdir, Errno::ENOTDIR, 127, "cannot enter working directory /w: Not a directory"),
            (Stage::Cgroup, Errno::ENOSPC, 127, "cannot join the exec's cgroup: No space left on device"),
            (Stage::Stdio, Errno::EBADF, 127, "cannot set up the command's stdio: Bad file number"),
            (Stage::User, Errno::ENOENT, 126, "user \"ghost\" is not in the sandbox's /etc/passwd or /etc/group"),
            (Stage::User, Errno::EPERM, 126, "cannot switch to user \"ghost\": Operation not permitted"),
        ];
        for (stage, errno, code, sentence) in cases {
            assert_eq!(describe_failure(stage, errno, "prog", "/w", Some("ghost")), (code, sentence.to_string()), "{stage:?} {errno:?}");
        }
        assert_eq!(describe_failure(Stage::Setup, Errno::EMFILE, "prog", "/w", Some("ghost")), (127, "cannot start prog: Too many open files".to_string()));
        for stage in [Stage::Cgroup, Stage::Workdir, Stage::Exec, Stage::Stdio, Stage::Setup, Stage::User] {
            assert_eq!(Stage::from_byte(stage as u8), stage);
            assert_eq!(Stage::from_name(stage.name()), Some(stage));
            let line = failure_line(stage, Errno::ENOENT);
            let rest = std::str::from_utf8(&line[FAILURE_LINE_PREFIX.len()..]).expect("utf8");
            assert_eq!(parse_failure_line(rest.trim_end()), Some((stage, Errno::ENOENT)));
            let json = serde_json::to_string(&stage).expect("json");
            assert_eq!(json, format!("\"{}\"", stage.name()));
        }
    }

    #[test]
    fn foreign_failure_lines_are_not_parsed() {
        for rest in ["", "exec", "exec x", "fork 2", "exec 2 3", "notfound"] {
            assert_eq!(parse_failure_line(rest), None, "{rest:?}");
        }
    }

    #[test]
    fn argv0_is_resolved_in_the_commands_own_path() {
        let env = vec![("PATH".to_string(), "/opt/x::/bin".to_string())];
        let cmd = Command::new(&["tool".into()], &env, "/").expect("command");
        let got: Vec<_> = cmd.candidates.iter().map(|c| c.to_str().expect("utf8").to_string()).collect();
        assert_eq!(got, ["/opt/x/tool", "./tool", "/bin/tool"]);
        let abs = Command::new(&["/usr/bin/env".into()], &env, "/").expect("command");
        assert_eq!(abs.candidates.len(), 1);
        let default = Command::new(&["sh".into()], &[], "/").expect("command");
        assert_eq!(default.candidates.len(), DEFAULT_PATH.split(':').count());
    }

    #[test]
    fn empty_argv_and_nul_bytes_are_refused() {
        assert!(Command::new(&[], &[], "/").is_err());
        assert!(Command::new(&["".into()], &[], "/").is_err());
        assert!(Command::new(&["a\0b".into()], &[], "/").is_err());
        assert!(Command::new(&["sh".into()], &[("K".into(), "v\0".into())], "/").is_err());
    }

    #[test]
    fn failures_map_to_the_shell_exit_codes() {
        assert_eq!(describe_failure(Stage::Exec, Errno::ENOENT, "nope", "/", None).0, 127);
        assert_eq!(describe_failure(Stage::Exec, Errno::EACCES, "x", "/", None).0, 126);
        let (code, msg) = describe_failure(Stage::Workdir, Errno::ENOTDIR, "x", "/w", None);
        assert_eq!(code, 127);
        assert!(msg.contains("/w"), "{msg}");
    }

    /// Forks a child through [`child`] with /dev/null as stdio; returns its error-pipe report
    /// and its wait status.
    fn run(argv: &[&str], workdir: &str) -> (Option<(Stage, Errno)>, i32) {
        run_as(argv, workdir, None)
    }

    fn run_as(argv: &[&str], workdir: &str, user: Option<&crate::user::Credentials>) -> (Option<(Stage, Errno)>, i32) {
        let argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
        let env = vec![("PATH".to_string(), "/nonexistent:/usr/bin:/bin".to_string())];
        let cmd = Command::new(&argv, &env, workdir).expect("command");
        let cmd = match user {
            Some(creds) => cmd.as_user(creds),
            None => cmd,
        };
        let null = std::fs::File::open("/dev/null").expect("/dev/null");
        let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let fd = null.as_raw_fd();
        let fds = ChildFds { stdio: [fd, fd, fd], cgroup_procs: &[], err_w: err_w.as_raw_fd() };
        // SAFETY: the child only runs `child`, which makes raw syscalls until execve or _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            child(&cmd, &fds);
        }
        drop(err_w);
        let report = read_failure(&err_r);
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        (report, status)
    }

    #[test]
    fn a_child_switches_to_its_user_before_it_runs() {
        // Needs root (CI is root): the switch is what is tested.
        assert!(nix::unistd::geteuid().is_root(), "this test runs as root");
        let nobody = crate::user::Credentials { uid: 65534, gid: 65534, groups: vec![65534, 4], home: "/nonexistent".into() };
        let check = "test \"$(id -u):$(id -g):$(id -G)\" = '65534:65534:65534 4' && ! cat /proc/self/status | grep -q '^CapEff:.*[1-9a-f]' && test \"$HOME\" = /nonexistent";
        assert_eq!(run_as(&["sh", "-c", check], "/", Some(&nobody)), (None, 0), "uid, gid, groups set; no capability left");
        // The working directory is entered as the user: one only root may enter is refused.
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).expect("chmod");
        let workdir = dir.path().to_str().expect("utf8");
        assert_eq!(run_as(&["true"], workdir, Some(&nobody)).0, Some((Stage::Workdir, Errno::EACCES)));
        assert_eq!(run_as(&["true"], workdir, None), (None, 0));
    }

    #[test]
    fn a_child_becomes_its_command_or_reports_where_it_failed() {
        let (report, status) = run(&["sh", "-c", "exit 3"], "/");
        assert_eq!(report, None);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 3, "status {status:#x}");

        let (report, status) = run(&["no-such-program-anywhere"], "/");
        assert_eq!(report, Some((Stage::Exec, Errno::ENOENT)));
        assert_eq!(libc::WEXITSTATUS(status), 127);

        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "not a program").expect("write");
        let (report, status) = run(&[plain.to_str().expect("utf8")], "/");
        assert_eq!(report, Some((Stage::Exec, Errno::EACCES)));
        assert_eq!(libc::WEXITSTATUS(status), 126);

        let (report, status) = run(&["sh", "-c", "true"], "/no/such/dir");
        assert_eq!(report, Some((Stage::Workdir, Errno::ENOENT)));
        assert_eq!(libc::WEXITSTATUS(status), 127);
    }

    /// Runs a shell on a fresh pseudo-terminal that exits 7 when the terminal is its controlling
    /// terminal (/dev/tty opens only then), 1 otherwise.
    fn exit_code_on_a_terminal(on_terminal: bool) -> i32 {
        // SAFETY: posix_openpt/grantpt/unlockpt/ptsname_r/open on a fresh master descriptor.
        let (master, slave) = unsafe {
            let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            assert!(master >= 0, "posix_openpt");
            assert_eq!(libc::grantpt(master), 0);
            assert_eq!(libc::unlockpt(master), 0);
            let mut name = [0 as libc::c_char; 64];
            assert_eq!(libc::ptsname_r(master, name.as_mut_ptr(), name.len()), 0);
            (master, libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC))
        };
        assert!(slave >= 0, "open slave");
        let argv: Vec<String> = ["sh", "-c", "test -t 0 && (exec 3</dev/tty) 2>/dev/null && exit 7; exit 1"].iter().map(|a| a.to_string()).collect();
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let mut cmd = Command::new(&argv, &env, "/").expect("command");
        if on_terminal {
            cmd = cmd.on_terminal();
        }
        let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let fds = ChildFds { stdio: [slave, slave, slave], cgroup_procs: &[], err_w: err_w.as_raw_fd() };
        // SAFETY: the child only runs `child`, which makes raw syscalls until execve or _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            child(&cmd, &fds);
        }
        drop(err_w);
        assert_eq!(read_failure(&err_r), None);
        let mut status = 0;
        // SAFETY: waits for the child forked above; then closes the two pty descriptors.
        unsafe {
            libc::waitpid(pid, &mut status, 0);
            libc::close(slave);
            libc::close(master);
        }
        libc::WEXITSTATUS(status)
    }

    #[test]
    fn a_command_on_a_terminal_gets_it_as_its_controlling_terminal() {
        assert_eq!(exit_code_on_a_terminal(true), 7);
        assert_eq!(exit_code_on_a_terminal(false), 1, "without on_terminal the session has no terminal");
    }
}
