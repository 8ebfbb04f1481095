//! The virtio-serial port the host talks through.
//!
//! The port is a character device whose other end is a UNIX socket on the host that the daemon
//! connects to, and may disconnect from and reconnect to at any time (a daemon restart, say).
//! While no host is connected, `read` returns 0 at once (and `write` blocks until one is): so
//! end-of-file here means "nobody there right now", never "stop". The reader backs off for a few
//! milliseconds and reads again, forever.

use std::fs::OpenOptions;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_agent::protocol::PORT_NAME;

use super::console::log;
use super::{Agent, Conn, Session};

const PORTS: &str = "/sys/class/virtio-ports";
/// Longest pause between two reads while no host is connected: the latency a reconnecting host
/// sees before its first frame is read.
const MAX_IDLE_BACKOFF: Duration = Duration::from_millis(10);

/// The device of the port named [`PORT_NAME`] (`/dev/vportNpM`), waiting up to `timeout` for
/// the device to announce it.
pub fn find(timeout: Duration) -> Option<PathBuf> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(entries) = std::fs::read_dir(PORTS) {
            for entry in entries.flatten() {
                let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
                if name.trim_end() == PORT_NAME {
                    let dev = Path::new("/dev").join(entry.file_name());
                    if dev.exists() {
                        return Some(dev);
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Serves the host on the port at `dev`. Never returns.
pub fn serve(agent: Arc<Agent>, dev: &Path) -> ! {
    // Reader and writer are two fds of one open file, so a writer blocked on a gone host never
    // holds up the reader.
    let (mut port, writer) = loop {
        match OpenOptions::new().read(true).write(true).open(dev).and_then(|f| Ok((f.try_clone()?, f))) {
            Ok(p) => break p,
            Err(e) => {
                log!("cannot open {}: {e}; retrying", dev.display());
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    let mut session = Session::new(agent, Conn::new(writer));
    log!("listening on {} ({PORT_NAME})", dev.display());
    let mut buf = vec![0u8; 64 << 10];
    let mut connected = false;
    let mut backoff = Duration::from_millis(1);
    loop {
        match port.read(&mut buf) {
            Ok(n) if n > 0 => {
                if !connected {
                    log!("host connected");
                    connected = true;
                }
                backoff = Duration::from_millis(1);
                session.feed(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => {
                if connected {
                    match other {
                        Err(e) => log!("host disconnected ({e})"),
                        _ => log!("host disconnected"),
                    }
                    connected = false;
                    session.reset();
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_IDLE_BACKOFF);
            }
        }
    }
}
