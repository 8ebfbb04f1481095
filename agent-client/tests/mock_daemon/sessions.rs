//! ExecSession through the client, `sbx exec -i`, `sbx exec -it` and `sbx shell`.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agent_client::proto::{ExecSessionStart, ExecStatus};
use agent_client::{exec_request, Client, SessionEvent};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{text, Daemon};

const PATIENCE: Duration = Duration::from_secs(10);

fn start(argv: &[&str]) -> ExecSessionStart {
    ExecSessionStart {
        exec: Some(exec_request("sb-1", argv.iter().copied())),
        ..Default::default()
    }
}

/// The next event, within [`PATIENCE`].
async fn next(events: &mut agent_client::SessionEvents) -> SessionEvent {
    tokio::time::timeout(PATIENCE, events.next_event())
        .await
        .expect("an event in time")
        .expect("no error")
        .expect("not the end")
}

#[tokio::test]
async fn a_session_echoes_each_line_as_it_is_sent() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    let session = client.exec_session(start(&["cat"])).await.expect("started");
    assert_eq!(session.exec_id(), "ex-s1");
    let (input, mut events) = session.split();

    input.stdin("one\n").await.expect("send");
    assert_eq!(
        next(&mut events).await,
        SessionEvent::Stdout(b"one\n".to_vec())
    );
    let first = Instant::now();
    // The first line's echo is in before the second line is even sent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    input.stdin("two\n").await.expect("send");
    assert_eq!(
        next(&mut events).await,
        SessionEvent::Stdout(b"two\n".to_vec())
    );
    let gap = first.elapsed();
    assert!(
        gap >= Duration::from_millis(900),
        "the second line came {gap:?} after the first"
    );

    input.close_stdin().await.expect("close");
    let SessionEvent::Finished(result) = next(&mut events).await else {
        panic!("expected the result")
    };
    assert_eq!((result.status(), result.exit_code), (ExecStatus::Exited, 0));
    assert_eq!(
        events.next_event().await.expect("no error"),
        None,
        "nothing after the result"
    );
    let err = input.stdin("late").await.expect_err("the session is over");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn a_session_takes_signals_and_reports_them() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    let mut session = client
        .exec_session(start(&["sleep"]))
        .await
        .expect("started");
    session.input().signal(15).await.expect("signal");
    let Some(SessionEvent::Finished(result)) = session.next_event().await.expect("event") else {
        panic!("expected the result")
    };
    assert_eq!(
        (result.status(), result.exit_code, result.signal),
        (ExecStatus::Signaled, 143, 15)
    );
    assert!(daemon.mock.state().log.contains(&"signal 15".to_owned()));

    let err = client.exec_session(start(&["cat"])).await;
    assert!(err.is_ok());
    let bad = ExecSessionStart {
        exec: Some(exec_request("sb-404", ["cat"])),
        ..Default::default()
    };
    let err = client.exec_session(bad).await.expect_err("unknown sandbox");
    assert_eq!(err.code(), tonic::Code::NotFound);
}

/// `sbx exec -i`: each line reaches the command as it is typed, not at end of input.
#[tokio::test]
async fn sbx_exec_i_streams_stdin_live() {
    let daemon = Daemon::start().await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
        .args(["exec", "-i", "sb-1", "--", "cat"])
        .env("SANDBOXD_SOCKET", daemon.addr())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sbx");
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();

    stdin.write_all(b"one\n").await.expect("write");
    tokio::time::timeout(PATIENCE, stdout.read_line(&mut line))
        .await
        .expect("in time")
        .expect("read");
    assert_eq!(
        line, "one\n",
        "the first line is echoed while stdin is still open"
    );
    let first = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    line.clear();
    stdin.write_all(b"two\n").await.expect("write");
    tokio::time::timeout(PATIENCE, stdout.read_line(&mut line))
        .await
        .expect("in time")
        .expect("read");
    assert_eq!(line, "two\n");
    assert!(first.elapsed() >= Duration::from_millis(900));

    drop(stdin); // local EOF: close_stdin, and cat exits 0.
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(status.code(), Some(0));
    let log = daemon.mock.state().log.clone();
    let close = log
        .iter()
        .position(|l| l == "close_stdin")
        .expect("close_stdin sent");
    assert_eq!(
        &log[close - 2..close],
        ["stdin \"one\\n\"", "stdin \"two\\n\""]
    );
}

#[tokio::test]
async fn sbx_exec_i_exit_codes_and_json() {
    let daemon = Daemon::start().await;
    let out = daemon
        .sbx(&["exec", "-i", "sb-1", "--", "cat"], b"piped through")
        .await;
    assert_eq!(
        (out.status.code(), text(&out.stdout)),
        (Some(0), "piped through".to_owned())
    );

    let out = daemon
        .sbx(&["exec", "-i", "sb-1", "--", "missing"], b"")
        .await;
    assert_eq!(out.status.code(), Some(127));
    assert!(
        text(&out.stderr).contains("executable not found: missing"),
        "{}",
        text(&out.stderr)
    );

    let out = daemon
        .sbx(&["--json", "exec", "-i", "sb-1", "--", "cat"], b"abc")
        .await;
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(
        (v["stdout"].as_str(), v["exec_id"].as_str()),
        (Some("abc"), Some("ex-s1"))
    );

    let out = daemon.sbx(&["exec", "-t", "sb-1", "--", "cat"], b"").await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("not a terminal"),
        "{}",
        text(&out.stderr)
    );

    let out = daemon
        .sbx(&["exec", "-i", "--stdin", "sb-1", "--", "cat"], b"")
        .await;
    assert_eq!(out.status.code(), Some(2), "-i and --stdin conflict");
}

/// `sbx exec -i` forwards a signal sent to sbx to the command and exits with its code.
#[tokio::test]
async fn sbx_exec_i_forwards_signals() {
    let daemon = Daemon::start().await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
        .args(["exec", "-i", "sb-1", "--", "sleep"])
        .env("SANDBOXD_SOCKET", daemon.addr())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sbx");
    let pid = nix::unistd::Pid::from_raw(child.id().expect("running") as i32);
    // sbx handles SIGINT once its session has started: wait until the kernel says it catches
    // it (bit 2 of SigCgt), or the signal would simply kill it.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc");
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & (1 << (libc::SIGINT - 1)) != 0);
        let started = daemon
            .mock
            .state()
            .log
            .iter()
            .any(|l| l.starts_with("start"));
        if caught && started {
            break;
        }
        assert!(Instant::now() < deadline, "sbx never got ready for signals");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("kill");
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(
        status.code(),
        Some(130),
        "the command's code, not sbx killed"
    );
    assert!(daemon.mock.state().log.contains(&"signal 2".to_owned()));
}

/// A pseudo-terminal for `sbx`: the test holds the master side.
struct Pty {
    master: std::fs::File,
    slave: OwnedFd,
}

impl Pty {
    fn open(rows: u16, cols: u16) -> Pty {
        let size = nix::pty::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).expect("openpty");
        Pty {
            master: std::fs::File::from(pty.master),
            slave: pty.slave,
        }
    }

    fn stdio(&self) -> Stdio {
        Stdio::from(self.slave.try_clone().expect("dup"))
    }

    fn canonical(&self) -> bool {
        let attrs = nix::sys::termios::tcgetattr(self.slave.as_fd()).expect("tcgetattr");
        attrs
            .local_flags
            .contains(nix::sys::termios::LocalFlags::ICANON | nix::sys::termios::LocalFlags::ECHO)
    }

    fn resize(&self, rows: u16, cols: u16) {
        nix::ioctl_write_ptr_bad!(tiocswinsz, libc::TIOCSWINSZ, nix::pty::Winsize);
        let size = nix::pty::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor and a valid winsize for TIOCSWINSZ.
        unsafe { tiocswinsz(self.master.as_raw_fd(), &size) }.expect("TIOCSWINSZ");
    }

    /// Everything the master side reads, from a thread of its own.
    fn reader(&self) -> tokio::sync::mpsc::UnboundedReceiver<Vec<u8>> {
        let mut master = self.master.try_clone().expect("dup");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = master.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        rx
    }
}

/// Reads until `seen` holds `want`, within [`PATIENCE`].
async fn wait_for(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
    seen: &mut String,
    want: &str,
) {
    let deadline = Instant::now() + PATIENCE;
    while !seen.contains(want) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(bytes)) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            _ => panic!("never saw {want:?}; the terminal showed {seen:?}"),
        }
    }
}

#[tokio::test]
async fn sbx_exec_it_is_a_real_terminal() {
    let daemon = Daemon::start().await;
    let pty = Pty::open(40, 120);
    let mut rx = pty.reader();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
        .args(["exec", "-it", "sb-1", "--", "sh"])
        .env("SANDBOXD_SOCKET", daemon.addr())
        .env("TERM", "xterm-test")
        .stdin(pty.stdio())
        .stdout(pty.stdio())
        .stderr(pty.stdio())
        .spawn()
        .expect("spawn sbx");
    let mut seen = String::new();
    wait_for(
        &mut rx,
        &mut seen,
        "[tty 40x120 TERM=xterm-test argv=[\"sh\"]]",
    )
    .await;
    assert!(!pty.canonical(), "raw mode while the session runs");

    let mut master = pty.master.try_clone().expect("dup");
    master.write_all(b"hi").expect("type");
    wait_for(&mut rx, &mut seen, "]\r\nhi").await;

    pty.resize(30, 100);
    let pid = nix::unistd::Pid::from_raw(child.id().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGWINCH).expect("SIGWINCH");
    wait_for(&mut rx, &mut seen, "[resize 30x100]").await;

    // Ctrl-C is a key: it goes to the remote terminal, whose command ends by SIGINT.
    master.write_all(b"\x03").expect("type");
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(status.code(), Some(130));
    assert!(
        daemon
            .mock
            .state()
            .log
            .contains(&"stdin \"\\u{3}\"".to_owned()),
        "{:?}",
        daemon.mock.state().log
    );
    assert!(pty.canonical(), "the terminal is restored");
    assert_eq!(seen.matches("hi").count(), 1, "no local echo: {seen:?}");
}

#[tokio::test]
async fn sbx_shell_opens_the_sandbox_shell_on_a_terminal() {
    let daemon = Daemon::start().await;
    let pty = Pty::open(24, 80);
    let mut rx = pty.reader();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
        .args(["shell", "sb-1"])
        .env("SANDBOXD_SOCKET", daemon.addr())
        .stdin(pty.stdio())
        .stdout(pty.stdio())
        .stderr(pty.stdio())
        .spawn()
        .expect("spawn sbx");
    let mut seen = String::new();
    wait_for(&mut rx, &mut seen, "[tty 24x80").await;
    wait_for(&mut rx, &mut seen, "argv=[\"/bin/sh\", \"-c\"").await;
    let mut master = pty.master.try_clone().expect("dup");
    master.write_all(b"\x04").expect("Ctrl-D");
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(status.code(), Some(0));
    assert!(pty.canonical(), "the terminal is restored");
    let start = daemon
        .mock
        .state()
        .log
        .iter()
        .find(|l| l.starts_with("start"))
        .cloned()
        .expect("started");
    assert!(
        start.contains("tty=true") && start.contains("bash"),
        "{start}"
    );
}
