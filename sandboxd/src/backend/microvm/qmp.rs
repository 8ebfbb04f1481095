//! A minimal QMP (QEMU Machine Protocol) client: JSON lines over the VM's QMP UNIX socket, one
//! command at a time, asynchronous events skipped.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// A QMP session in command mode.
pub struct Qmp {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
}

/// Longest QMP line accepted (QEMU's answers here are small).
const MAX_LINE: usize = 1 << 20;
/// How long one command may take (a blockdev-snapshot on a busy disk drains its I/O first).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Qmp {
    /// Connects, reads the greeting and leaves capabilities negotiation.
    pub async fn connect(socket: &Path) -> Result<Qmp, String> {
        let stream = UnixStream::connect(socket).await.map_err(|e| format!("connecting to QMP at {}: {e}", socket.display()))?;
        let (rd, wr) = stream.into_split();
        let mut qmp = Qmp { rd: BufReader::new(rd), wr };
        let greeting = qmp.read_line().await?;
        if greeting.get("QMP").is_none() {
            return Err(format!("QMP greeting expected, got {greeting}"));
        }
        qmp.execute("qmp_capabilities", Value::Null).await?;
        Ok(qmp)
    }

    async fn read_line(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        let n = tokio::time::timeout(COMMAND_TIMEOUT, (&mut self.rd).take(MAX_LINE as u64).read_line(&mut line))
            .await
            .map_err(|_| "QMP did not answer in time".to_string())?
            .map_err(|e| format!("reading QMP: {e}"))?;
        if n == 0 {
            return Err("QMP connection closed (QEMU exited?)".into());
        }
        serde_json::from_str(&line).map_err(|e| format!("QMP sent invalid JSON: {e}"))
    }

    /// Runs one command and returns its `return` value, or QEMU's error description.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, String> {
        let line = Self::line(command, arguments);
        self.wr.write_all(line.as_bytes()).await.map_err(|e| format!("writing QMP: {e}"))?;
        self.answer(command).await
    }

    /// Hands QEMU a file descriptor under `name` (`getfd`, the descriptor travelling as
    /// SCM_RIGHTS with the command), for a later `fd:<name>` URI.
    pub async fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), String> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let line = Self::line("getfd", json!({ "fdname": name }));
        let fds = [fd.as_raw_fd()];
        let stream: &UnixStream = self.wr.as_ref();
        let mut sent = false;
        while !sent {
            stream.writable().await.map_err(|e| format!("writing QMP: {e}"))?;
            let iov = [std::io::IoSlice::new(line.as_bytes())];
            match stream.try_io(tokio::io::Interest::WRITABLE, || {
                sendmsg::<()>(stream.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::MSG_NOSIGNAL, None).map_err(std::io::Error::from)
            }) {
                // The line is far shorter than a socket buffer: a short write would split the
                // descriptor from the rest of its command, so it is refused.
                Ok(n) if n == line.len() => sent = true,
                Ok(n) => return Err(format!("QMP getfd: short write ({n} of {} bytes)", line.len())),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("writing QMP: {e}")),
            }
        }
        self.answer("getfd").await.map(drop)
    }

    fn line(command: &str, arguments: Value) -> String {
        let msg = if arguments.is_null() { json!({ "execute": command }) } else { json!({ "execute": command, "arguments": arguments }) };
        let mut line = msg.to_string();
        line.push('\n');
        line
    }

    /// The answer to the command just sent, skipping events.
    async fn answer(&mut self, command: &str) -> Result<Value, String> {
        loop {
            let v = self.read_line().await?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let desc = e.get("desc").and_then(Value::as_str).unwrap_or("unknown error");
                return Err(format!("QMP {command}: {desc}"));
            }
            // An event ({"event": ...}): not ours to handle.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[tokio::test]
    async fn negotiates_skips_events_and_reports_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.expect("accept");
            let (rd, mut wr) = s.into_split();
            let mut rd = BufReader::new(rd);
            wr.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n").await.expect("greet");
            let mut line = String::new();
            rd.read_line(&mut line).await.expect("read");
            assert!(line.contains("qmp_capabilities"));
            wr.write_all(b"{\"return\": {}}\n").await.expect("write");
            line.clear();
            rd.read_line(&mut line).await.expect("read");
            assert!(line.contains("\"stop\""));
            wr.write_all(b"{\"event\": \"STOP\", \"timestamp\": {}}\n{\"return\": {}}\n").await.expect("write");
            line.clear();
            rd.read_line(&mut line).await.expect("read");
            wr.write_all(b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such node\"}}\n").await.expect("write");
        });
        let mut qmp = Qmp::connect(&path).await.expect("connect");
        qmp.execute("stop", Value::Null).await.expect("stop");
        let err = qmp.execute("blockdev-snapshot", json!({"node": "x", "overlay": "y"})).await.expect_err("error");
        assert!(err.contains("no such node"), "{err}");
        server.await.expect("server");
    }
}
