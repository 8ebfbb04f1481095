//! UploadFile, DownloadFile, UploadArchive and DownloadArchive through the client and `sbx cp`.

use std::io;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use agent_client::Client;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, ReadBuf};

use super::{text, Daemon};

/// Bytes that do not repeat with any short period, so a misplaced chunk shows.
fn content(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn sha(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// Waits (up to 5 s) until the stand-in has logged an upload outcome starting with `prefix`.
async fn outcome(daemon: &Daemon, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = daemon
            .mock
            .state()
            .outcomes
            .iter()
            .find(|o| o.starts_with(prefix))
            .cloned();
        if let Some(found) = found {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "no outcome {prefix:?}: {:?}",
            daemon.mock.state().outcomes
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A reader that gives `data`, then fails (or, with `hang`, never ends).
struct Breaks {
    data: io::Cursor<Vec<u8>>,
    hang: bool,
}

impl AsyncRead for Breaks {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.data).poll_read(cx, buf);
        if buf.filled().len() > before {
            return poll;
        }
        if self.hang {
            return Poll::Pending;
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::BrokenPipe,
            "the source broke",
        )))
    }
}

#[tokio::test]
async fn a_few_mib_go_up_and_down_in_bounded_pieces() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    let data = content(5 * (1 << 20) + 123);

    let sent = client
        .upload_file("sb-1", "/workspace/big.bin", 0o600, data.as_slice())
        .await
        .expect("upload");
    assert_eq!(
        (sent.bytes, sent.sha256.clone()),
        (data.len() as u64, sha(&data))
    );
    {
        let state = daemon.mock.state();
        let (stored, mode) = state.files.get("/workspace/big.bin").expect("stored");
        assert!(stored == &data, "the daemon has the same bytes");
        assert_eq!(*mode, 0o600);
        assert_eq!(
            state.max_piece,
            1 << 20,
            "pieces of 1 MiB, never the whole file"
        );
    }

    let mut back = Vec::new();
    let got = client
        .download_file("sb-1", "/workspace/big.bin", &mut back)
        .await
        .expect("download");
    assert!(back == data, "downloaded bytes differ");
    assert_eq!(got, sent, "same size and digest both ways");

    let err = client
        .download_file("sb-1", "/nope", &mut Vec::new())
        .await
        .expect_err("missing");
    assert_eq!(err.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn a_download_that_does_not_match_is_an_error() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    for path in ["/corrupt", "/short"] {
        daemon
            .mock
            .state()
            .files
            .insert(path.into(), (content(200_000), 0));
        let err = client
            .download_file("sb-1", path, &mut Vec::new())
            .await
            .expect_err("must not match");
        assert_eq!(err.code(), tonic::Code::DataLoss, "{path}: {err}");
        assert!(err.to_string().contains(path), "{err}");
    }
}

#[tokio::test]
async fn an_upload_that_breaks_or_is_dropped_keeps_the_old_file() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    daemon
        .mock
        .state()
        .files
        .insert("/keep".into(), (b"old".to_vec(), 0o644));

    // The local source fails after 6.5 MiB: more than the client queues, so the upload is
    // under way by then.
    let reader = Breaks {
        data: io::Cursor::new(content(13 << 19)),
        hang: false,
    };
    let err = client
        .upload_file("sb-1", "/keep", 0, reader)
        .await
        .expect_err("source broke");
    assert!(
        err.to_string().contains("cannot read the upload of /keep"),
        "{err}"
    );
    assert!(outcome(&daemon, "refused /keep").await.contains("sha256"));
    assert_eq!(
        daemon.mock.state().files.get("/keep").map(|f| f.0.clone()),
        Some(b"old".to_vec())
    );

    // The upload's future is dropped half-way (its caller gave up).
    daemon.mock.state().outcomes.clear();
    let reader = Breaks {
        data: io::Cursor::new(content(3 << 20)),
        hang: true,
    };
    let upload = client.upload_file("sb-1", "/keep", 0, reader);
    let gave_up = tokio::time::timeout(Duration::from_millis(500), upload).await;
    assert!(gave_up.is_err(), "still waiting for the source");
    assert!(
        daemon.mock.state().received >= 3 << 20,
        "the data had gone out"
    );
    assert!(outcome(&daemon, "refused /keep").await.contains("sha256"));
    assert_eq!(
        daemon.mock.state().files.get("/keep").map(|f| f.0.clone()),
        Some(b"old".to_vec())
    );
}

#[tokio::test]
async fn sbx_cp_streams_files_of_any_size() {
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("tmp");
    let data = content(3 * (1 << 20) + 7);
    let local = dir.path().join("big.bin");
    std::fs::write(&local, &data).expect("write");
    let local = local.display().to_string();

    let out = daemon
        .sbx(&["cp", "--json", &local, "sb-1:/workspace/"], b"")
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(v["path"], "/workspace/big.bin");
    assert_eq!(v["bytes"], data.len() as u64);
    assert_eq!(v["sha256"], sha(&data));
    assert!(daemon
        .mock
        .state()
        .files
        .get("/workspace/big.bin")
        .is_some_and(|f| f.0 == data));

    // Into a directory: under the remote name, through a temp file that is renamed at the end.
    let out = daemon
        .sbx(
            &[
                "cp",
                "sb-1:/workspace/big.bin",
                &dir.path().display().to_string(),
            ],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(std::fs::read(dir.path().join("big.bin")).expect("read") == data);

    let out = daemon
        .sbx(&["cp", "sb-1:/workspace/big.bin", "-"], b"")
        .await;
    assert!(out.stdout == data, "to stdout");

    // From stdin.
    let out = daemon.sbx(&["cp", "-", "sb-1:/from-stdin"], &data).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(daemon
        .mock
        .state()
        .files
        .get("/from-stdin")
        .is_some_and(|f| f.0 == data));
}

#[tokio::test]
async fn sbx_cp_leaves_no_half_file() {
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("tmp");
    daemon
        .mock
        .state()
        .files
        .insert("/corrupt".into(), (content(300_000), 0));
    let target = dir.path().join("target");
    std::fs::write(&target, b"precious").expect("write");

    let out = daemon
        .sbx(&["cp", "sb-1:/corrupt", &target.display().to_string()], b"")
        .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("integrity check of /corrupt failed"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read(&target).expect("read"),
        b"precious",
        "the old file stays"
    );
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["target"], "no temp file left beside it");
}

/// `sbx cp - ID:/keep` fed 3 MiB and then stopped by `signal`, before its stdin ends.
async fn stop_an_upload(
    daemon: &Daemon,
    signal: nix::sys::signal::Signal,
) -> std::process::ExitStatus {
    use tokio::io::AsyncWriteExt;
    daemon.mock.state().received = 0;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
        .args(["cp", "-", "sb-1:/keep"])
        .env("SANDBOXD_SOCKET", daemon.addr())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn sbx");
    let mut stdin = child.stdin.take().expect("piped");
    stdin.write_all(&content(3 << 20)).await.expect("write");
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.mock.state().received < 2 << 20 {
        assert!(Instant::now() < deadline, "the upload never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = nix::unistd::Pid::from_raw(child.id().expect("running") as i32);
    nix::sys::signal::kill(pid, signal).expect("signal sbx");
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("sbx ends")
        .expect("wait");
    drop(stdin);
    status
}

#[tokio::test]
async fn sbx_cp_stopped_mid_upload_keeps_the_old_file() {
    let daemon = Daemon::start().await;
    daemon
        .mock
        .state()
        .files
        .insert("/keep".into(), (b"old".to_vec(), 0o644));

    // Ctrl-C: sbx stops the upload so that the daemon refuses it, then exits 130.
    let status = stop_an_upload(&daemon, nix::sys::signal::Signal::SIGINT).await;
    assert_eq!(status.code(), Some(130));
    assert_eq!(
        outcome(&daemon, "refused /keep").await,
        "refused /keep: sha256"
    );
    assert_eq!(
        daemon.mock.state().files.get("/keep").map(|f| f.0.clone()),
        Some(b"old".to_vec())
    );

    // SIGKILL: nothing runs in sbx, the connection just breaks.
    let status = stop_an_upload(&daemon, nix::sys::signal::Signal::SIGKILL).await;
    assert_eq!(status.code(), None, "killed");
    assert_eq!(outcome(&daemon, "broken /keep").await, "broken /keep");
    assert_eq!(
        daemon.mock.state().files.get("/keep").map(|f| f.0.clone()),
        Some(b"old".to_vec())
    );
}

#[tokio::test]
async fn sbx_cp_r_round_trips_a_directory() {
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("sub/deeper")).expect("mkdir");
    std::fs::write(src.join("sub/run.sh"), b"#!/bin/sh\n").expect("write");
    std::fs::set_permissions(
        src.join("sub/run.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .expect("chmod");
    std::fs::write(src.join("sub/deeper/big"), content(2 << 20)).expect("write");
    symlink("sub/run.sh", src.join("link")).expect("symlink");
    let old = std::time::UNIX_EPOCH + Duration::from_secs(1_500_000_000);
    std::fs::File::open(src.join("sub/run.sh"))
        .and_then(|f| f.set_modified(old))
        .expect("mtime");

    let out = daemon
        .sbx(
            &[
                "cp",
                "-r",
                "--json",
                &src.display().to_string(),
                "sb-1:/workspace/dir",
            ],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(
        (v["files"].as_u64(), v["symlinks"].as_u64()),
        (Some(2), Some(1)),
        "{v}"
    );
    let remote = daemon.mock.root().join("workspace/dir");
    assert_eq!(
        std::fs::read_link(remote.join("link")).expect("a symlink"),
        Path::new("sub/run.sh")
    );
    let meta = std::fs::metadata(remote.join("sub/run.sh")).expect("meta");
    assert_eq!(meta.permissions().mode() & 0o777, 0o755, "mode kept");
    assert_eq!(meta.modified().expect("mtime"), old, "mtime kept");
    assert!(std::fs::read(remote.join("sub/deeper/big")).expect("read") == content(2 << 20));

    let back = dir.path().join("back");
    let out = daemon
        .sbx(
            &[
                "cp",
                "-r",
                "sb-1:/workspace/dir",
                &back.display().to_string(),
            ],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_link(back.join("link")).expect("a symlink"),
        Path::new("sub/run.sh")
    );
    assert_eq!(
        std::fs::read(back.join("sub/run.sh")).expect("read"),
        b"#!/bin/sh\n"
    );
    assert!(std::fs::read(back.join("sub/deeper/big")).expect("read") == content(2 << 20));
    let meta = std::fs::metadata(back.join("sub/run.sh")).expect("meta");
    assert_eq!(
        (
            meta.permissions().mode() & 0o777,
            meta.modified().expect("mtime")
        ),
        (0o755, old)
    );

    // Without -r a directory is refused, with a hint.
    let out = daemon
        .sbx(
            &["cp", &src.display().to_string(), "sb-1:/workspace/x"],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("-r"), "{}", text(&out.stderr));
}

#[tokio::test]
async fn sbx_cp_r_refuses_a_hostile_archive() {
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("tmp");
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).expect("mkdir");
    std::fs::write(outside.join("victim"), b"safe").expect("write");
    daemon.mock.state().outside = outside.clone();
    for (kind, says) in [
        ("abs", "absolute path"),
        ("dotdot", ".."),
        ("symlink", "goes through the symlink esc"),
        ("device", "device node"),
        ("hardlink", "absolute path"),
    ] {
        let target = dir.path().join("out");
        let out = daemon
            .sbx(
                &[
                    "cp",
                    "-r",
                    &format!("sb-1:/hostile/{kind}"),
                    &target.display().to_string(),
                ],
                b"",
            )
            .await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{kind}: {stderr}");
        assert!(
            stderr.contains("refused archive entry") && stderr.contains(says),
            "{kind}: {stderr}"
        );
        assert_eq!(
            std::fs::read(outside.join("victim")).expect("read"),
            b"safe",
            "{kind}"
        );
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["outside"],
            "{kind}: nothing left, not even a half directory"
        );
        let outside_names: Vec<_> = std::fs::read_dir(&outside)
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(outside_names, ["victim"], "{kind}");
    }
}
