//! The health listener (`health_listen`) against the real daemon: next to a TCP API listener
//! that serves TLS, a plaintext port serving only `grpc.health.v1.Health` from the same reporter
//! (what the kubelet's gRPC probes reach on Kubernetes, which cannot speak TLS). Health answers
//! there over h2c; the API is UNIMPLEMENTED there; the API's port still requires TLS and the
//! health port never speaks it; a drain turns `sandbox.v1.SandboxService` NOT_SERVING there too
//! while `""` stays SERVING. And its bounds: the `[connections]` caps per source address,
//! counted apart from the API's TCP listeners, and every connection closed at
//! `preauth_timeout_ms`.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a test: a failed expectation is a failed test

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use agent_client::Client;
use sandbox_tests::{free_port, process_sandbox, sandboxd_bin, text, within, Daemon};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const API: &str = "sandbox.v1.SandboxService";
/// The client's HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A CA and a server certificate for 127.0.0.1 (and localhost), made with the host's openssl.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn make() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
            .expect("san.ext");
        #[rustfmt::skip]
        let steps: [Vec<String>; 3] = [
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sandboxd health test CA", "-keyout", &path("ca.key"), "-out", &path("ca.crt")].map(String::from).to_vec(),
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", &path("tls.key"), "-out", &path("tls.csr")].map(String::from).to_vec(),
            ["openssl", "x509", "-req", "-in", &path("tls.csr"), "-CA", &path("ca.crt"), "-CAkey", &path("ca.key"), "-CAcreateserial", "-days", "2", "-extfile", &path("san.ext"), "-out", &path("tls.crt")].map(String::from).to_vec(),
        ];
        for args in steps {
            let out = Command::new(&args[0]).args(&args[1..]).output().expect("openssl");
            assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn ca(&self) -> Vec<u8> {
        std::fs::read(self.path("ca.crt")).expect("ca.crt")
    }

    /// `[tls]` with the server certificate and key.
    fn tls_table(&self) -> String {
        format!("[tls]\ncert = \"{}\"\nkey = \"{}\"\n", self.path("tls.crt").display(), self.path("tls.key").display())
    }
}

fn two_ports() -> (u16, u16) {
    let a = free_port().expect("port");
    let b = loop {
        let b = free_port().expect("port");
        if b != a {
            break b;
        }
    };
    (a, b)
}

async fn check(channel: tonic::transport::Channel, service: &str) -> Result<ServingStatus, tonic::Status> {
    let r = within(10, HealthClient::new(channel).check(HealthCheckRequest { service: service.into() })).await?;
    Ok(ServingStatus::try_from(r.into_inner().status).expect("a known status"))
}

/// A health check on a new plaintext (h2c) connection to `port`.
async fn check_plain(port: u16, service: &str) -> ServingStatus {
    let client = within(10, Client::connect(&format!("http://127.0.0.1:{port}"))).await.expect("connect to the health port");
    check(client.channel(), service).await.expect("health check over h2c")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_health_listener_serves_health_alone_in_plaintext_next_to_a_tls_api() {
    let pki = Pki::make();
    let (api_port, health_port) = two_ports();
    // Long enough that the watch below is never cut at the deadline every health connection has.
    let toml = format!("health_listen = \"127.0.0.1:{health_port}\"\n[connections]\npreauth_timeout_ms = 120000\n{}", pki.tls_table());
    let mut daemon = Daemon::start_with(&toml, &["--listen", &format!("tcp://127.0.0.1:{api_port}")]).await.expect("daemon");
    assert!(daemon.log().contains("health listening"), "log:\n{}", daemon.log());

    // Health over plaintext h2c, the statuses of the daemon's one reporter.
    assert_eq!(check_plain(health_port, "").await, ServingStatus::Serving, "the overall status");
    assert_eq!(check_plain(health_port, API).await, ServingStatus::Serving, "readiness");
    let plain = within(10, Client::connect(&format!("http://127.0.0.1:{health_port}"))).await.expect("connect");
    let err = check(plain.channel(), "no.such.Service").await.expect_err("an unknown service");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");

    // Nothing but health: the API is not served there (no token would change that).
    let err = within(10, plain.list(HashMap::new())).await.expect_err("no API on the health port");
    let status = err.status().unwrap_or_else(|| panic!("a gRPC status: {err:?}"));
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");

    // Never TLS on the health port.
    let tls_to_health = match within(10, Client::connect_with_ca(&format!("https://127.0.0.1:{health_port}"), &pki.ca())).await {
        Ok(c) => check(c.channel(), "").await.err().map(|e| format!("{e:?}")),
        Err(e) => Some(e.to_string()),
    };
    assert!(tls_to_health.is_some(), "a TLS client must not be served by the health port");

    // The API's TCP listener still requires TLS: plaintext fails, TLS (checked against the CA) works.
    let plain_to_api = match within(10, Client::connect(&format!("http://127.0.0.1:{api_port}"))).await {
        Ok(c) => check(c.channel(), "").await.err().map(|e| format!("{e:?}")),
        Err(e) => Some(e.to_string()),
    };
    assert!(plain_to_api.is_some(), "the API's TCP port answered plaintext");
    let tls = within(10, Client::connect_with_ca(&format!("https://127.0.0.1:{api_port}"), &pki.ca())).await.expect("TLS to the API port");
    assert_eq!(check(tls.channel(), API).await.expect("health over TLS"), ServingStatus::Serving);

    // A drain while an exec runs: readiness turns off on the health port, liveness stays on.
    let client = daemon.client().await.expect("client");
    let id = within(60, client.create(process_sandbox("minimal"))).await.expect("create").id;
    let (_held, _) = sandbox_tests::held_exec(&client, &id).await;
    let mut watch = HealthClient::new(plain.channel());
    let mut watch = within(10, watch.watch(HealthCheckRequest { service: API.into() })).await.expect("health watch on the health port").into_inner();
    let first = within(10, watch.message()).await.expect("watch").expect("a first status");
    assert_eq!(first.status, ServingStatus::Serving as i32, "ready before the drain");

    let drain = tokio::process::Command::new(sandboxd_bin().expect("sandboxd binary"))
        .args(["drain", "--socket", &daemon.address, "--timeout", "120", "--stop-timeout", "60"])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("sandboxd drain");
    let next = within(30, watch.message()).await.expect("watch").expect("a change");
    assert_eq!(next.status, ServingStatus::NotServing as i32, "{API} NOT_SERVING on the health port once draining");
    assert_eq!(check_plain(health_port, API).await, ServingStatus::NotServing, "a new probe sees it too");
    assert_eq!(check_plain(health_port, "").await, ServingStatus::Serving, "liveness stays SERVING while the drain lets execs finish");

    // The exec is let go; the daemon ends by itself, and the health port with it.
    within(30, client.write_file(&id, "/tmp/go", "go", 0)).await.expect("WriteFile in the held sandbox");
    let out = within(60, drain.wait_with_output()).await.expect("sandboxd drain ran");
    assert!(out.status.success(), "sandboxd drain failed: {}", text(&out.stderr));
    let exit = daemon.exited().expect("daemon state").expect("the daemon has ended once the drain returns");
    assert!(exit.success(), "{exit:?}; log:\n{}", daemon.log());
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", health_port)).await.is_err(), "the health listener ended with the daemon");
}

/// Bytes the server sends on `s` before it closes it (reads until EOF or `enough` bytes).
async fn read_until_closed_or(s: &mut tokio::net::TcpStream, enough: usize) -> usize {
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < enough {
        match within(30, s.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_client_cannot_exhaust_the_health_listener() {
    let (api_port, health_port) = two_ports();
    let toml = format!("health_listen = \"127.0.0.1:{health_port}\"\n[connections]\nmax_per_ip = 2\npreauth_timeout_ms = 1000\n");
    let daemon = Daemon::start_with(&toml, &["--listen", &format!("tcp://127.0.0.1:{api_port}")]).await.expect("daemon");

    // Two idle connections (the preface, nothing more) hold this address's share: the server
    // answers each with its SETTINGS. A third is closed at once, unanswered.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", health_port)).await.expect("connect");
        s.write_all(PREFACE).await.expect("preface");
        assert!(read_until_closed_or(&mut s, 9).await >= 9, "an admitted connection gets the server's SETTINGS");
        held.push(s);
    }
    let mut third = tokio::net::TcpStream::connect(("127.0.0.1", health_port)).await.expect("connect");
    let _ = third.write_all(PREFACE).await;
    assert_eq!(read_until_closed_or(&mut third, 1).await, 0, "a third connection from one address is refused");
    assert!(daemon.log().contains("connections.max_per_ip = 2"), "the refusal is logged naming the key; log:\n{}", daemon.log());

    // Counted apart from the API's TCP listener: a client there is served meanwhile.
    let api = within(10, Client::connect(&format!("http://127.0.0.1:{api_port}"))).await.expect("connect to the API");
    within(10, api.list(HashMap::new())).await.expect("the API's TCP listener is not starved by the health listener");

    // Every health connection ends at preauth_timeout_ms (no request here authenticates one),
    // which gives the address its share back.
    // (`within` in the read fails the test if one stays open.)
    for s in &mut held {
        read_until_closed_or(s, usize::MAX).await;
    }
    assert_eq!(check_plain(health_port, "").await, ServingStatus::Serving, "a probe is served again");
}
