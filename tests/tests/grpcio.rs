//! A stock gRPC client that is not ours: Python's grpcio (gRPC C core), the most common client
//! of agent frameworks, on the daemon's UNIX socket with no channel options. It sends the socket
//! path as `:authority`, which the HTTP/2 server would refuse without `sandboxd::authority`.
//! It also prepares an image the way a remote client would: a `docker save` archive it writes
//! itself, streamed through ImportImage (bidirectional streaming), then listed, run and removed.
//! grpcio and grpcio-tools come from PyPI (`make test` installs them); missing, the test fails.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::process::Command;

use sandbox_tests::{images_dir, workspace_root, Daemon};

#[tokio::test(flavor = "multi_thread")]
async fn python_grpcio_works_on_the_unix_socket_with_no_options() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let root = workspace_root();
    let script = root.join("tests/python/grpcio_client.py");
    let address = daemon.address.clone();
    let rootfs = images_dir().join("minimal/rootfs");
    let out = tokio::task::spawn_blocking(move || Command::new("python3").arg(&script).arg(&root).arg(&address).arg(&rootfs).output())
        .await
        .expect("join")
        .expect("running python3 (grpcio and grpcio-tools: python3 -m pip install grpcio grpcio-tools)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.contains("OK"), "grpcio client failed ({}):\n{stdout}\n{stderr}\ndaemon log:\n{}", out.status, daemon.log());
}
