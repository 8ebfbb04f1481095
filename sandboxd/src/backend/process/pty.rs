//! The daemon's end of an exec's pseudo-terminal: the master side the sandbox's init opened in
//! the sandbox's own devpts and passed back (see `init::open_terminal`), read and written
//! asynchronously.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::backend::TerminalSize;

pub use sandbox_exec::pty::VEOF;

/// A terminal's master side, non-blocking.
pub struct PtyMaster(AsyncFd<OwnedFd>);

impl PtyMaster {
    /// Takes ownership of `fd` and makes it non-blocking.
    pub fn new(fd: OwnedFd) -> io::Result<PtyMaster> {
        let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
        Self::register(fd)
    }

    fn register(fd: OwnedFd) -> io::Result<PtyMaster> {
        // SAFETY: the descriptor is an OwnedFd moved into the AsyncFd, so it stays open (and is
        // not reused) for as long as the registration lives.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)?;
        Ok(PtyMaster(fd))
    }

    /// A second handle on the same terminal (one task reads while another writes).
    pub fn try_clone(&self) -> io::Result<PtyMaster> {
        // The duplicate shares the open file description, so it is non-blocking too.
        Self::register(self.0.get_ref().try_clone()?)
    }

    /// Sets the terminal's size; the kernel sends SIGWINCH to its foreground process group.
    pub fn resize(&self, size: TerminalSize) -> io::Result<()> {
        sandbox_exec::pty::resize(self.0.get_ref(), size.rows, size.cols).map_err(io::Error::from)
    }
}

impl AsRawFd for PtyMaster {
    fn as_raw_fd(&self) -> RawFd {
        self.0.get_ref().as_raw_fd()
    }
}

impl AsyncRead for PtyMaster {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| nix::unistd::read(fd.get_ref().as_raw_fd(), unfilled).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Every slave descriptor is closed: the terminal's end of file.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Poll::Ready(Ok(())),
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PtyMaster {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
