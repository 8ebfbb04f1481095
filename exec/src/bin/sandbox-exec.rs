//! `sandbox-exec`: how the container tier starts a command, with the spawn every tier shares.
//!
//! Docker's exec API starts this (statically linked, bind-mounted read-only into every container
//! in `/.sandboxd` (the directory is the mount point, so code inside cannot move it aside), so it needs nothing from the image — not even a shell) as
//! `sandbox-exec TAG WORKDIR USER HOME ARGV...` with exactly the command's environment (USER
//! empty for root, else resolved in the container's own /etc/passwd and /etc/group; HOME
//! `passwd` when the command's `HOME` is the user's home, since runc puts root's `HOME` into the
//! environment of every exec that has none, else empty). It stops itself
//! first, so the daemon can find it by TAG (`sandboxd-<exec id>`), move it into the exec's own
//! cgroup before anything forks, and continue it. Then it takes its own session and becomes the
//! command through `sandbox_exec::spawn`, like the process tier's init and the microVM's guest
//! agent. When it cannot, it writes one failure line on stderr (stage and errno, which the daemon
//! strips and turns into the same exit code and sentence as the other tiers) and exits 127/126.
//!
//! `sandbox-exec --serve` is the container's keepalive (its main process under docker-init) and
//! how execs start without Docker's exec API: it serves the daemon's requests over the channel of
//! `sandbox_exec::serve`, forking each command from itself — already inside every namespace, the
//! cgroup, the capabilities, seccomp filter, no-new-privileges and AppArmor profile Docker gave the
//! container. It is not dumpable, so code in the container can neither take the channel from its
//! descriptors nor reach its executable through `/proc/<pid>/exe`. It never waits on anything
//! the container controls: the child, not the server, reads /etc/passwd and enters the workdir.
//!
//! `sandbox-exec --pause` is the keepalive of containers made before the channel existed: it
//! waits for signals forever (their execs go through Docker's exec API).

use std::os::unix::ffi::OsStringExt;

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{recvmsg, send, socketpair, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType};
use sandbox_exec::serve::{self, Request};
use sandbox_exec::spawn::{self, Command, Stage};

fn report(stage: Stage, errno: Errno) -> ! {
    report_on(2, stage, errno)
}

/// Writes the failure line on `err` and exits with the stage's code.
fn report_on(err: RawFd, stage: Stage, errno: Errno) -> ! {
    let line = spawn::failure_line(stage, errno);
    // SAFETY: write of a buffer this function owns to a descriptor of this process, then _exit.
    unsafe {
        libc::write(err, line.as_ptr().cast(), line.len());
        libc::_exit(stage.exit_code(errno))
    }
}

/// The environment of this process, as strings (the daemon's API only carries UTF-8).
fn own_env() -> Vec<(String, String)> {
    std::env::vars_os().map(|(k, v)| (String::from_utf8_lossy(&k.into_vec()).into_owned(), String::from_utf8_lossy(&v.into_vec()).into_owned())).collect()
}

fn wait_forever() -> ! {
    loop {
        // SAFETY: pause only waits for a signal; default dispositions end the process.
        unsafe { libc::pause() };
    }
}

/// `--serve`: see the module documentation. Runs until a signal ends it, like `--pause`.
fn serve_forever() -> ! {
    // SAFETY: prctl and signal change only this process's own attributes. Not dumpable: its
    // /proc/<pid>/fd, /proc/<pid>/exe and pidfd_getfd need CAP_SYS_PTRACE, which no container
    // has. SIGCHLD ignored: the kernel reaps the children (the daemon reads their exit status
    // from its pidfds), so nothing here ever waits on them.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
    }
    let Ok((first, theirs)) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC) else { wait_forever() };
    // Our end away from the agreed slot first: with only stdio open it *is* descriptor 3, and
    // the dup3 below would close it.
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor (or -1), owned from here on.
    let mine = match unsafe { libc::fcntl(first.as_raw_fd(), libc::F_DUPFD_CLOEXEC, serve::CHANNEL_FD + 1) } {
        -1 => wait_forever(),
        // SAFETY: a fresh descriptor of ours.
        fd => unsafe { OwnedFd::from_raw_fd(fd) },
    };
    drop(first);
    // SAFETY: dup3 onto the agreed slot; the old descriptor is closed right after.
    if unsafe { libc::dup3(theirs.as_raw_fd(), serve::CHANNEL_FD, libc::O_CLOEXEC) } != serve::CHANNEL_FD {
        wait_forever()
    }
    drop(theirs);
    let mut buf = vec![0u8; serve::MAX_REQUEST_BYTES];
    let mut greeted = false;
    loop {
        let (len, fds) = match receive(&mine, &mut buf) {
            Ok(Some(m)) => m,
            Ok(None) => wait_forever(), // the daemon is gone: no more execs, stay up like --pause
            Err(Errno::EINTR) => continue,
            Err(_) => wait_forever(),
        };
        if !greeted {
            if &buf[..len] == serve::HELLO && fds.is_empty() {
                greeted = true;
                // SAFETY: closes the daemon's parked end; the daemon holds its own copy now.
                unsafe { libc::close(serve::CHANNEL_FD) };
                let _ = send(mine.as_raw_fd(), serve::HELLO, MsgFlags::MSG_DONTWAIT);
            }
            continue;
        }
        let Ok(req) = Request::decode(&buf[..len]) else { continue };
        let want = 3 + usize::from(req.stdin);
        if fds.len() != want {
            continue;
        }
        let mut fds = fds.into_iter();
        let (Some(reply), Some(out), Some(err)) = (fds.next(), fds.next(), fds.next()) else { continue };
        let stdin = fds.next();
        // SAFETY: this process is single-threaded, so the child may allocate after the fork.
        match unsafe { libc::fork() } {
            0 => child(&mine, req, reply, out, err, stdin),
            -1 => {
                let msg = format!("{}{}", char::from(serve::FORK_FAILED), Errno::last() as i32);
                let _ = send(reply.as_raw_fd(), msg.as_bytes(), MsgFlags::MSG_DONTWAIT);
            }
            _ => {} // the descriptors close here; the child holds its copies
        }
    }
}

/// One message and the descriptors it carried (close-on-exec); None at the end of the channel.
fn receive(sock: &OwnedFd, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>, Errno> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; serve::MAX_FDS]);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(|_| Errno::EINVAL)? {
        if let ControlMessageOwned::ScmRights(list) = c {
            // SAFETY: the kernel installed these descriptors for us; each is owned once.
            fds.extend(list.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_TRUNC) || msg.flags.contains(MsgFlags::MSG_CTRUNC);
    Ok(Some((if truncated { 0 } else { msg.bytes }, fds)))
}

/// The forked child: says it is there (the kernel tells the daemon its pid), waits until the
/// daemon has moved it into the exec's cgroup, then becomes the command. Never returns.
fn child(channel: &OwnedFd, req: Request, reply: OwnedFd, out: OwnedFd, err: OwnedFd, stdin: Option<OwnedFd>) -> ! {
    // SAFETY: closes this child's copy of the server's channel (it is close-on-exec too).
    unsafe { libc::close(channel.as_raw_fd()) };
    let err_fd = err.as_raw_fd();
    if send(reply.as_raw_fd(), serve::READY, MsgFlags::empty()).is_err() {
        // SAFETY: nothing to clean up.
        unsafe { libc::_exit(127) }
    }
    let mut go = [0u8; 1];
    loop {
        // SAFETY: reads into a buffer of this function.
        let n = unsafe { libc::read(reply.as_raw_fd(), go.as_mut_ptr().cast(), 1) };
        if n == 1 && go == *serve::GO {
            break;
        }
        if n < 0 && Errno::last() == Errno::EINTR {
            continue;
        }
        // SAFETY: the daemon gave up on this exec: leave without a trace.
        unsafe { libc::_exit(127) }
    }
    drop(reply);
    // SAFETY: setsid only changes this process's session.
    unsafe { libc::setsid() };
    let stdin = match stdin {
        Some(fd) => fd,
        None => match std::fs::File::open("/dev/null") {
            Ok(f) => f.into(),
            Err(e) => report_on(err_fd, Stage::Stdio, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))),
        },
    };
    let env = serve::merge_env(own_env(), &req.env, req.home_from_passwd);
    let cmd = match Command::new(&req.argv, &env, &req.workdir) {
        Ok(cmd) => cmd,
        Err(_) => report_on(err_fd, Stage::Setup, Errno::EINVAL),
    };
    let cmd = match req.user.as_str() {
        "" => cmd,
        user => match sandbox_exec::user::resolve(user, std::path::Path::new("/etc")) {
            Ok(creds) => cmd.as_user(&creds),
            Err(e) => report_on(err_fd, Stage::User, e.errno()),
        },
    };
    let (stage, errno) = spawn::attempt(&cmd, [stdin.as_raw_fd(), out.as_raw_fd(), err_fd]);
    report_on(err_fd, stage, errno)
}

fn main() {
    let args: Vec<String> = std::env::args_os().map(|a| String::from_utf8_lossy(&a.into_vec()).into_owned()).collect();
    if args.len() == 2 && args[1] == "--pause" {
        wait_forever()
    }
    if args.len() == 2 && args[1] == "--serve" {
        serve_forever()
    }
    if args.len() < 6 {
        eprintln!("usage: sandbox-exec TAG WORKDIR USER HOME PROGRAM [ARG...] (the container tier's exec helper; sandboxd runs it)");
        std::process::exit(2);
    }
    // SAFETY: raise stops this single-threaded process until the daemon continues it.
    unsafe { libc::raise(libc::SIGSTOP) };
    // Environment strings come from the daemon's API, which only carries UTF-8.
    let home_from_passwd = args[4] == "passwd";
    let env: Vec<(String, String)> = std::env::vars_os()
        .map(|(k, v)| (String::from_utf8_lossy(&k.into_vec()).into_owned(), String::from_utf8_lossy(&v.into_vec()).into_owned()))
        .filter(|(k, _)| !(home_from_passwd && k == "HOME"))
        .collect();
    let cmd = match Command::new(&args[5..], &env, &args[2]) {
        Ok(cmd) => cmd,
        Err(_) => report(Stage::Setup, Errno::EINVAL),
    };
    let cmd = match args[3].as_str() {
        "" => cmd,
        user => match sandbox_exec::user::resolve(user, std::path::Path::new("/etc")) {
            Ok(creds) => cmd.as_user(&creds),
            Err(e) => report(Stage::User, e.errno()),
        },
    };
    // No cgroup to join here (the daemon moved this process while it was stopped); the session
    // is the same as on every other tier.
    // SAFETY: setsid only changes this process's session.
    unsafe { libc::setsid() };
    let (stage, errno) = spawn::attempt(&cmd, [0, 1, 2]);
    report(stage, errno)
}
