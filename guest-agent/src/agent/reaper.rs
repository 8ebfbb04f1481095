//! The one place that calls `waitpid`: PID 1 must reap every zombie (orphans are re-parented to
//! it), yet an exec must still learn its own child's exit status.
//!
//! One thread waits for any child (`waitpid(-1)`). Children we forked are *registered* with a
//! pipe; the reaper writes their raw wait status into it and forgets them. Any other child (an
//! orphan, a spawn whose exec failed and that nobody waits for) is reaped and dropped.
//!
//! A child may exit before its parent gets to register it. [`Reaper::spawn`] therefore forks
//! while holding the registry lock and registers before releasing it: if the reaper collects the
//! status first, it blocks on the lock, then finds the registration. No status is ever lost and
//! none is stolen.
//!
//! Consequently nothing else in the agent may fork and wait on its own: `std::process::Command`
//! in particular would find its child already reaped (and panics on a failed spawn then).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;

use super::console::log;

/// How a registered child ended, decoded from its raw wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildExit {
    Code(i32),
    Signal(i32),
}

impl ChildExit {
    fn from_raw(status: i32) -> Self {
        if libc::WIFSIGNALED(status) {
            ChildExit::Signal(libc::WTERMSIG(status))
        } else {
            ChildExit::Code(libc::WEXITSTATUS(status))
        }
    }

    /// Reads the status the reaper wrote into `watch` (blocking until it is there), and when
    /// the child was reaped: a reader may be busy elsewhere when it happens.
    pub fn read(watch: &OwnedFd) -> Option<(ChildExit, Instant)> {
        let mut buf = [0u8; 12];
        let mut got = 0;
        while got < buf.len() {
            match nix::unistd::read(watch.as_raw_fd(), &mut buf[got..]) {
                Ok(0) => return None,
                Ok(n) => got += n,
                Err(Errno::EINTR) => continue,
                Err(_) => return None,
            }
        }
        let status = i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let mut nanos = [0u8; 8];
        nanos.copy_from_slice(&buf[4..]);
        Some((ChildExit::from_raw(status), *base() + Duration::from_nanos(u64::from_ne_bytes(nanos))))
    }
}

/// What reap times are measured from (pipes carry numbers, not `Instant`s).
fn base() -> &'static Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now)
}

#[derive(Default)]
struct Registry {
    /// Registered children: where to write their status.
    waiting: HashMap<i32, OwnedFd>,
    /// Bumped after every fork, so a reaper that found no children knows to look again.
    forks: u64,
}

/// The process-wide reaper (see the module documentation).
pub struct Reaper {
    registry: Mutex<Registry>,
    forked: Condvar,
}

/// Error of [`Reaper::spawn`]: the fork itself, or the pipe for the status.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {errno}")]
pub struct SpawnError {
    pub op: &'static str,
    pub errno: Errno,
}

impl Reaper {
    /// The reaper of this process; its thread starts on first use.
    pub fn global() -> &'static Reaper {
        static REAPER: OnceLock<&'static Reaper> = OnceLock::new();
        REAPER.get_or_init(|| {
            let reaper: &'static Reaper = Box::leak(Box::new(Reaper { registry: Mutex::new(Registry::default()), forked: Condvar::new() }));
            if let Err(e) = std::thread::Builder::new().name("reaper".into()).stack_size(64 << 10).spawn(move || reaper.run()) {
                // Without a reaper nothing could ever be waited for; this is fatal at boot.
                log!("cannot start the reaper thread: {e}");
            }
            reaper
        })
    }

    /// Forks; `child` runs in the new process and must not return (it execs or `_exit`s; should
    /// it return, the child `_exit`s with 127) and must only make async-signal-safe calls (the
    /// agent is multi-threaded). Returns the child's
    /// pid and a pipe that yields its wait status (see [`ChildExit::read`]) once it ended.
    pub fn spawn(&self, child: impl FnOnce()) -> Result<(i32, OwnedFd), SpawnError> {
        let (watch_r, watch_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|errno| SpawnError { op: "status pipe", errno })?;
        let mut registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the child only runs `child`, which per this function's contract makes only
        // async-signal-safe calls before execve/_exit. The registry lock stays held by this
        // thread in the parent; the child never touches it.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            child();
            // SAFETY: _exit in the forked child.
            unsafe { libc::_exit(127) };
        }
        if pid < 0 {
            return Err(SpawnError { op: "fork", errno: Errno::last() });
        }
        registry.waiting.insert(pid, watch_w);
        registry.forks += 1;
        drop(registry);
        self.forked.notify_all();
        Ok((pid, watch_r))
    }

    fn run(&self) {
        loop {
            // Read before waiting: a fork after this point either shows up in waitpid or bumps
            // the counter we compare against below.
            let forks = self.registry.lock().unwrap_or_else(|p| p.into_inner()).forks;
            let mut status = 0;
            // SAFETY: waitpid with a valid pointer to a local.
            let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
            if pid > 0 {
                if !libc::WIFEXITED(status) && !libc::WIFSIGNALED(status) {
                    continue; // stopped/continued: not an end
                }
                let reaped = base().elapsed().as_nanos() as u64;
                let watch = self.registry.lock().unwrap_or_else(|p| p.into_inner()).waiting.remove(&pid);
                if let Some(w) = watch {
                    let mut msg = [0u8; 12];
                    msg[..4].copy_from_slice(&status.to_ne_bytes());
                    msg[4..].copy_from_slice(&reaped.to_ne_bytes());
                    // A 12-byte write into an empty pipe cannot block or be split.
                    let _ = nix::unistd::write(&w, &msg);
                }
                continue;
            }
            match Errno::last() {
                Errno::EINTR => {}
                Errno::ECHILD => {
                    // No children: sleep until the next fork (the timeout is only a safety net).
                    let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = self.forked.wait_timeout_while(registry, Duration::from_secs(5), |r| r.forks == forks);
                }
                e => {
                    log!("waitpid: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit_now(code: i32) -> ! {
        // SAFETY: _exit in the forked child.
        unsafe { libc::_exit(code) }
    }

    #[test]
    fn a_child_that_exits_at_once_is_never_missed() {
        // Many children that exit before the parent could possibly register them.
        let watches: Vec<_> = (0..50).map(|i| Reaper::global().spawn(move || exit_now(i)).expect("spawn")).collect();
        for (i, (_, w)) in watches.iter().enumerate() {
            assert_eq!(ChildExit::read(w).map(|e| e.0), Some(ChildExit::Code(i as i32)));
        }
    }

    #[test]
    fn signal_deaths_are_reported_as_signals() {
        let (pid, w) = Reaper::global()
            .spawn(|| {
                // SAFETY: pause/_exit in the forked child.
                unsafe { libc::pause() };
                exit_now(0)
            })
            .expect("spawn");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).expect("kill");
        let before = Instant::now();
        let (exit, at) = ChildExit::read(&w).expect("status");
        assert_eq!(exit, ChildExit::Signal(libc::SIGTERM));
        assert!(at <= Instant::now() && at + Duration::from_secs(5) > before, "reaped at a sensible time");
    }

    #[test]
    fn orphans_and_unwatched_children_are_reaped() {
        // Make this test process the orphans' new parent, as PID 1 is in the guest.
        // SAFETY: prctl with integer arguments.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }, 0);
        let (gpipe_r, gpipe_w) = nix::unistd::pipe().expect("pipe");
        let (_, w) = Reaper::global()
            .spawn(move || {
                // SAFETY: fork in a single-threaded child; the grandchild only _exits.
                let g = unsafe { libc::fork() };
                if g == 0 {
                    // SAFETY: usleep/_exit are async-signal-safe.
                    unsafe { libc::usleep(50_000) };
                    exit_now(0);
                }
                let _ = nix::unistd::write(&gpipe_w, &g.to_ne_bytes());
                exit_now(3)
            })
            .expect("spawn");
        assert_eq!(ChildExit::read(&w).map(|e| e.0), Some(ChildExit::Code(3)));
        let mut buf = [0u8; 4];
        assert_eq!(nix::unistd::read(gpipe_r.as_raw_fd(), &mut buf).expect("read"), 4);
        let grandchild = i32::from_ne_bytes(buf);
        // A registered child whose watcher is gone: its status goes nowhere, harmlessly.
        let forgotten = Reaper::global().spawn(|| exit_now(0)).expect("spawn").0;
        // Both end up reaped: no zombie is left behind in /proc.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for pid in [grandchild, forgotten] {
            while std::path::Path::new(&format!("/proc/{pid}")).exists() {
                assert!(std::time::Instant::now() < deadline, "pid {pid} was never reaped");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
