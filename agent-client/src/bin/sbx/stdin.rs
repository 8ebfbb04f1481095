//! Standard input read on a thread of its own.
//!
//! tokio's stdin reads on its blocking pool, and that read cannot be cancelled: once the work
//! is done (the command ended, the user pressed Ctrl-C) the runtime would wait at exit until
//! the next line arrives. A plain thread is simply left behind when `sbx` exits.

use std::io::Read;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::mpsc;

/// Bytes read at once: what one `read` returns, a key or a pipe's worth.
const CHUNK: usize = 64 * 1024;

/// Reads stdin on its own thread, each read passed on as soon as it returns (a line from a
/// cooked terminal, a key from a raw one, whatever a pipe holds). The channel closes at the
/// end of input or on a read error (a terminal that went away ends input like Ctrl-D).
pub fn chunks() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(8);
    let spawned = std::thread::Builder::new()
        .name("sbx-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin();
            let mut buf = vec![0u8; CHUNK];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if tx.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        });
    // Without the thread the sender is dropped with the closure, so the channel is closed at
    // once: an empty stdin rather than a hang.
    if spawned.is_err() {
        let _ = crate::output::note("cannot start a thread to read stdin; sending none");
    }
    rx
}

/// Stdin as an [`AsyncRead`], over [`chunks`].
pub struct Stdin {
    rx: mpsc::Receiver<Vec<u8>>,
    pending: Vec<u8>,
    at: usize,
}

impl Stdin {
    /// Starts reading stdin.
    pub fn new() -> Stdin {
        Stdin {
            rx: chunks(),
            pending: Vec::new(),
            at: 0,
        }
    }
}

impl AsyncRead for Stdin {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at == self.pending.len() {
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                // End of input: nothing added is EOF.
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Ready(Some(chunk)) => {
                    self.pending = chunk;
                    self.at = 0;
                }
            }
        }
        let n = buf.remaining().min(self.pending.len() - self.at);
        let at = self.at;
        buf.put_slice(&self.pending[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}
