//! The local terminal for `sbx exec -t` and `sbx shell`: raw mode behind a guard, and the
//! window size.

use std::io::IsTerminal;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use anyhow::{Context, Result};
use nix::sys::termios::{self, SetArg, Termios};

/// Whether stdin is a terminal.
pub fn stdin_is_terminal() -> bool {
    std::io::stdin().is_terminal()
}

/// Raw mode on stdin's terminal while this lives; the saved settings are put back on drop,
/// so every way out of a session — its end, an error, a panic unwinding, a signal sbx
/// handles — restores the terminal.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Saves stdin's terminal settings and switches it to raw mode: no echo, no line editing,
    /// no signals from keys (Ctrl-C and Ctrl-Z are bytes like any other), no output
    /// processing (the remote terminal already turned `\n` into `\r\n`).
    pub fn enable() -> Result<RawMode> {
        let stdin = std::io::stdin();
        let saved =
            termios::tcgetattr(stdin.as_fd()).context("cannot read the terminal's settings")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)
            .context("cannot put the terminal in raw mode")?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // TCSADRAIN: output already written is shown with the settings it was written under.
        // Nothing is left to do when this fails (the terminal is gone).
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSADRAIN, &self.saved);
    }
}

nix::ioctl_read_bad!(tiocgwinsz, libc::TIOCGWINSZ, libc::winsize);

fn size_of(fd: BorrowedFd<'_>) -> Option<(u32, u32)> {
    let mut size = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which points at one; the
    // descriptor is borrowed, so open for the call.
    unsafe { tiocgwinsz(fd.as_raw_fd(), &mut size) }.ok()?;
    (size.ws_row > 0 && size.ws_col > 0).then(|| (u32::from(size.ws_row), u32::from(size.ws_col)))
}

/// Rows and columns of the local terminal: stdin's, else stdout's; `None` when neither is a
/// terminal with a size (the daemon then uses 24x80).
pub fn size() -> Option<(u32, u32)> {
    size_of(std::io::stdin().as_fd()).or_else(|| size_of(std::io::stdout().as_fd()))
}
