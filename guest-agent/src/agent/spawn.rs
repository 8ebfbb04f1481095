//! Fork and exec of one command, with the process tier's semantics: argv[0] looked up in the
//! `PATH` of the command's own environment, exactly that environment, its own session, the exec
//! cgroup joined before `execve`, and why it could not start reported as (stage, errno).
//!
//! The agent is multi-threaded, so between `fork` and `execve` the child may only make
//! async-signal-safe calls: everything it needs (C strings, pointer arrays, candidate paths) is
//! prepared in [`Command::new`] before the fork, and the child itself only makes raw syscalls.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

use guest_agent::capture::DEFAULT_PATH;

pub use guest_agent::spawn_failure::{describe_failure, Stage};

/// A command ready to be exec'd from a forked child.
pub struct Command {
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    _env: Vec<CString>,
    env_ptrs: Vec<*const libc::c_char>,
    candidates: Vec<CString>,
    workdir: CString,
}

fn cstring(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"))
}

impl Command {
    /// Prepares `argv` with exactly `env`, to run in `workdir`. Fails (with a sentence) on an
    /// empty argv or a NUL byte anywhere.
    pub fn new(argv: &[String], env: &[(String, String)], workdir: &str) -> Result<Command, String> {
        let first = argv.first().ok_or_else(|| "empty argv".to_string())?;
        if first.is_empty() {
            return Err("empty program name".to_string());
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
        Ok(Command { _argv: argv_c, argv_ptrs, _env: env_c, env_ptrs, candidates, workdir: cstring(workdir)? })
    }
}

/// The descriptors a child gets.
pub struct ChildFds {
    /// Become the command's 0, 1 and 2.
    pub stdio: [RawFd; 3],
    /// The exec cgroup's `cgroup.procs`, opened for writing (only ever absent in unit tests).
    pub cgroup_procs: Option<RawFd>,
    /// Closed by a successful execve; gets (stage, errno) otherwise.
    pub err_w: RawFd,
}

/// Runs in the forked child: join the cgroup, set up the process, exec. Never returns.
/// Only raw syscalls from here on (see the module documentation).
pub fn child(cmd: &Command, fds: &ChildFds) -> ! {
    // SAFETY (whole function): only async-signal-safe libc calls on descriptors and memory that
    // were prepared before the fork and stay valid until execve or _exit.
    unsafe {
        // A session of its own: a signal to its process group reaches the whole tree, and a shell
        // without a terminal does not stop on job control.
        libc::setsid();
        // First, so nothing the command does escapes its accounting and limits.
        if let Some(procs) = fds.cgroup_procs {
            if libc::write(procs, b"0".as_ptr().cast(), 1) != 1 {
                fail(fds.err_w, Stage::Cgroup, Errno::last());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            fail(fds.err_w, Stage::Stdio, Errno::last());
        }
        // Default dispositions: the Rust runtime ignores SIGPIPE, and an ignored signal stays
        // ignored across execve (`yes | head` would print EPIPE errors).
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        for (target, &fd) in fds.stdio.iter().enumerate() {
            let target = target as RawFd;
            let rc = if fd == target { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, target) };
            if rc < 0 {
                fail(fds.err_w, Stage::Stdio, Errno::last());
            }
        }
        if libc::chdir(cmd.workdir.as_ptr()) != 0 {
            fail(fds.err_w, Stage::Workdir, Errno::last());
        }
        // Nothing of the agent (the port, other execs' pipes) may leak into the command.
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        let mut last = Errno::ENOENT;
        let mut saw_eacces = false;
        for path in &cmd.candidates {
            libc::execve(path.as_ptr(), cmd.argv_ptrs.as_ptr(), cmd.env_ptrs.as_ptr());
            match Errno::last() {
                Errno::EACCES => saw_eacces = true,
                Errno::ENOENT | Errno::ENOTDIR => {}
                other => fail(fds.err_w, Stage::Exec, other),
            }
            last = Errno::last();
        }
        fail(fds.err_w, Stage::Exec, if saw_eacces { Errno::EACCES } else { last })
    }
}

/// Reports (stage, errno) to the parent and exits the child.
fn fail(err_w: RawFd, stage: Stage, errno: Errno) -> ! {
    let mut msg = [0u8; 5];
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
pub fn outcome(err_r: &OwnedFd) -> Option<(Stage, Errno)> {
    let mut buf = [0u8; 5];
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(err_r.as_raw_fd(), &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    if got < buf.len() {
        return None;
    }
    Some((Stage::from_byte(buf[0]), Errno::from_raw(i32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]))))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(describe_failure(Stage::Exec, Errno::ENOENT, "nope", "/").0, 127);
        assert_eq!(describe_failure(Stage::Exec, Errno::EACCES, "x", "/").0, 126);
        let (code, msg) = describe_failure(Stage::Workdir, Errno::ENOTDIR, "x", "/w");
        assert_eq!(code, 127);
        assert!(msg.contains("/w"), "{msg}");
    }
}
