//! Pseudo-terminals for execs that run on one: opened by the runtime that starts the command
//! (the process tier's init inside the sandbox, the microVM's guest agent), in the devpts
//! instance the command sees, so the command's terminal has a name there (`tty` works) and
//! nothing of the host's devpts is reachable from inside.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::errno::Errno;

/// Opens a pseudo-terminal of `rows` × `cols` through `ptmx`, which must be the `ptmx` node of a
/// mounted devpts (e.g. `/dev/pts/ptmx`: a path, not the `/dev/ptmx` symlink code inside could
/// have replaced; checked by the filesystem's magic number). Returns its master and slave
/// sides, both close-on-exec; the slave is found from the master (`TIOCGPTPEER`), never by a
/// path lookup.
pub fn open(ptmx: &str, rows: u16, cols: u16) -> Result<(OwnedFd, OwnedFd), Errno> {
    use nix::fcntl::OFlag;
    let master = nix::fcntl::open(ptmx, OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
    // SAFETY: a descriptor open() just returned, owned from here on.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    let fs = nix::sys::statfs::fstatfs(&master)?;
    if fs.filesystem_type() != nix::sys::statfs::DEVPTS_SUPER_MAGIC {
        return Err(Errno::ENOTTY);
    }
    let unlock: libc::c_int = 0;
    // SAFETY: ioctls on the master this function owns, with a pointer to a local that outlives it.
    let slave = unsafe {
        Errno::result(libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock))?;
        Errno::result(libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC))?
    };
    // SAFETY: TIOCGPTPEER returned a fresh descriptor.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    resize(&master, rows, cols)?;
    Ok((master, slave))
}

/// Sets a terminal's size (through either side); the kernel sends SIGWINCH to its foreground
/// process group.
pub fn resize(fd: &OwnedFd, rows: u16, cols: u16) -> Result<(), Errno> {
    let size = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize that lives on this stack for the call.
    Errno::result(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) }).map(drop)
}

/// The end-of-file character of a terminal in canonical mode (Ctrl-D): how "close stdin" reaches
/// a program reading a terminal, which has no half-close.
pub const VEOF: u8 = 0x04;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_has_the_size_asked_for_and_refuses_a_non_devpts_ptmx() {
        let (master, slave) = open("/dev/pts/ptmx", 33, 101).expect("open");
        let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCGWINSZ writes a winsize into this local.
        assert_eq!(unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) }, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (33, 101));
        resize(&master, 10, 20).expect("resize");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) }, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (10, 20));
        assert_eq!(open("/dev/null", 1, 1).err(), Some(Errno::ENOTTY));
    }
}
