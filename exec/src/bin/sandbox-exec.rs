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
//! `sandbox-exec --pause` is the container's keepalive (its main process under docker-init): it
//! waits for signals forever, so a container needs no shell or `sleep` from its image to stay up.

use std::os::unix::ffi::OsStringExt;

use nix::errno::Errno;
use sandbox_exec::spawn::{self, Command, Stage};

fn report(stage: Stage, errno: Errno) -> ! {
    let line = spawn::failure_line(stage, errno);
    // SAFETY: write of a buffer this function owns to the inherited stderr, then _exit.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        libc::_exit(stage.exit_code(errno))
    }
}

fn main() {
    let args: Vec<String> = std::env::args_os().map(|a| String::from_utf8_lossy(&a.into_vec()).into_owned()).collect();
    if args.len() == 2 && args[1] == "--pause" {
        loop {
            // SAFETY: pause only waits for a signal; default dispositions end the process.
            unsafe { libc::pause() };
        }
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
