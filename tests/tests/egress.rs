//! Egress under policy (issue #24), end to end on every tier: a sandbox's network mode
//! NONE, ALLOWLIST or OPEN, enforced at the network layer by the daemon (a veth, nftables, its
//! DNS server and transparent proxy), against an "internet" this test builds itself: a network
//! namespace holding DNS, HTTP and raw TCP servers at 198.18.x.2 (the benchmarking range, never a
//! real address), reached from the host over a veth. The daemon's upstream resolver is that
//! namespace's DNS server, which logs every query it gets, so the test sees what left
//! ([`sandbox_tests::Internet`], shared with `egress_bench`).
//!
//! Programs in the sandboxes are the `debian` image's python3 running `tests/egress/probe.py`:
//! plain sockets and the system resolver, no proxy variables, so what is refused is refused by
//! the network, not by politeness.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::process::Command;

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, Isolation, NetworkMode, NetworkPolicy, SnapshotInfo};
use sandbox_tests::{eventually, exec, images_dir, process_sandbox, run_sbx, text, within, Harness, Internet};

const PROBE_PY: &str = include_str!("../egress/probe.py");

fn network(mode: NetworkMode, allow: &[String]) -> Option<NetworkPolicy> {
    Some(NetworkPolicy { mode: mode as i32, allow: allow.to_vec() })
}

fn require_debian() {
    let image = images_dir().join("debian/image.json");
    assert!(image.is_file(), "image 'debian' is not built ({} missing) — run `make image-debian`", image.display());
}

/// A process sandbox of `debian` with `network`, the probe in /probe.py.
async fn sandbox(h: &Harness, network: Option<NetworkPolicy>) -> String {
    sandbox_on(h, Isolation::Process, network).await
}

/// A sandbox of `debian` on `tier` with `network`, the probe in /probe.py.
async fn sandbox_on(h: &Harness, tier: Isolation, network: Option<NetworkPolicy>) -> String {
    let request = CreateSandboxRequest { network, isolation: tier as i32, ..process_sandbox("debian") };
    let id = within(60, h.client.create(request)).await.expect("CreateSandbox").id;
    within(30, h.client.write_file(&id, "/probe.py", PROBE_PY, 0o644)).await.expect("writing the probe");
    id
}

/// Runs the probe's attempts; one line per attempt, in order.
async fn probe(h: &Harness, id: &str, attempts: &[&str]) -> Vec<String> {
    let mut argv = vec!["python3", "/probe.py"];
    argv.extend_from_slice(attempts);
    let r = exec(&h.client, exec_request(id, argv)).await;
    assert_eq!(r.exit_code, 0, "{}", sandbox_tests::describe(&r));
    text(&r.stdout).lines().map(str::to_string).collect()
}

fn assert_ok(line: &str, wanted: &str) {
    assert!(line.starts_with("OK") && line.contains(wanted), "expected success with {wanted:?}: {line}");
}

fn assert_fail(line: &str) {
    assert!(line.starts_with("FAIL"), "expected a refusal: {line}");
}

/// The audit log's egress lines for `sandbox`.
fn audit_lines(h: &Harness, sandbox: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(h.daemon.state_dir().join("audit.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["sandbox_id"] == sandbox && v["rpc"].as_str().is_some_and(|r| r.starts_with("egress.")))
        .collect()
}

/// pip as a user runs it, with the test index by name; --target keeps Debian's system site alone.
const PIP_INSTALL: &str = "python3 -m pip install --no-cache-dir --disable-pip-version-check --retries 0 --timeout 20 \
    --break-system-packages --index-url http://pypi.test:8080/simple/ --trusted-host pypi.test --target /workspace/site egresshello \
    && PYTHONPATH=/workspace/site python3 -c 'import egresshello; print(egresshello.GREETING)'";

/// A host service: a listener on every host address; whether anything connected to it.
struct HostService(std::net::TcpListener);

impl HostService {
    fn start() -> HostService {
        Self::bind("0.0.0.0:0")
    }
    /// One that listens on the host's loopback only (a local database, an admin port).
    fn loopback() -> HostService {
        Self::bind("127.0.0.1:0")
    }
    fn bind(addr: &str) -> HostService {
        let l = std::net::TcpListener::bind(addr).expect("binding the host service");
        l.set_nonblocking(true).expect("nonblocking");
        HostService(l)
    }
    fn port(&self) -> String {
        self.0.local_addr().expect("addr").port().to_string()
    }
    fn was_reached(&self) -> bool {
        self.0.accept().is_ok()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn allowlist_reaches_exactly_the_listed_names_and_ports() {
    require_debian();
    let inet = Internet::start(0).await;
    let h = inet.daemon(&[]).await;
    let host = HostService::start();
    let port = host.port();
    let local = HostService::loopback();
    let local_port = local.port();
    let allow: Vec<String> =
        ["pypi.test:8080", "pypi.test:7000", "host.test:PORT", "meta.test:80", "169.254.169.254/32:80", "pypi.test:8443", "local.test:LOCAL"]
            .iter()
            .map(|a| a.replace("PORT", &port).replace("LOCAL", &local_port))
            .collect();
    let id = sandbox(&h, network(NetworkMode::Allowlist, &allow)).await;
    within(30, h.client.write_file(&id, "/ca.pem", inet.ca_pem(), 0o644)).await.expect("writing the test CA");
    let info = h.client.get(&id).await.expect("GetSandbox");
    let n = info.network.expect("Sandbox.network");
    assert_eq!(
        (n.mode, n.allow.clone()),
        (
            NetworkMode::Allowlist as i32,
            vec![
                allow[0].clone(),
                allow[1].clone(),
                allow[2].clone(),
                "meta.test:80".into(),
                "169.254.169.254/32:80".into(),
                "pypi.test:8443".into(),
                allow[6].clone()
            ]
        )
    );

    // A second sandbox under the same list that never asked the daemon's DNS: an IP literal
    // is refused, even the address of an allowed name on its port.
    let literal = sandbox(&h, network(NetworkMode::Allowlist, &allow)).await;
    let addr = inet.addr();
    let lines = probe(&h, &literal, &["http", &addr, "8080", "echo", &addr, "7000"]).await;
    assert_fail(&lines[0]);
    assert_fail(&lines[1]);

    let gw = {
        let conf = h.client.read_file(&id, "/etc/resolv.conf", 0, 0).await.expect("resolv.conf").content;
        let conf = String::from_utf8_lossy(&conf).to_string();
        conf.lines().find_map(|l| l.strip_prefix("nameserver ")).expect("a nameserver in resolv.conf").trim().to_string()
    };
    let tunnel = format!("{}.tunnel.test", "a".repeat(60));
    let host_addr = inet.host_addr();
    let lines = probe(
        &h,
        &id,
        &[
            "resolve",
            "pypi.test", // 0
            "http",
            "pypi.test",
            "8080", // 1
            "echo",
            "pypi.test",
            "7000", // 2
            "tls",
            "pypi.test",
            "7000",
            "pypi.test", // 3: a ClientHello naming the allowed name
            "tls",
            "pypi.test",
            "7000",
            "evil.test", // 4: SNI of another name at the same address
            "resolve",
            "evil.test", // 5: resolves upstream to the allowed address, not listed
            "http",
            &addr,
            "8081", // 6: the allowed address, another port
            "dns",
            "16",
            "pypi.test", // 7: TXT
            "dns",
            "1",
            &tunnel, // 8: a long label under an unlisted name
            "http",
            "host.test",
            &port, // 9: listed, but the name is the host's address
            "http",
            &gw,
            &port, // 10: the gateway (the host) itself
            "http",
            &host_addr,
            &port, // 11
            "connect",
            "meta.test",
            "80", // 12: listed, resolves to the metadata address
            "connect",
            "169.254.169.254",
            "80", // 13: listed as a CIDR, still the metadata address
            "https",
            "pypi.test",
            "8443",
            "evil.test", // 14: real HTTPS naming another name at the allowed address (its certificate would do)
            "https",
            "pypi.test",
            "8443",
            "pypi.test", // 15: real HTTPS to the allowed name, checked against the test CA
            "http",
            "local.test",
            &local_port, // 16: listed, resolves to 127.0.0.1: a service on the host's loopback only
        ],
    )
    .await;
    assert_eq!(lines.len(), 17, "{lines:#?}");
    assert_ok(&lines[0], &addr);
    assert_ok(&lines[1], "200 OK hello from the test internet");
    assert_ok(&lines[2], "ping");
    assert_ok(&lines[3], "echoed");
    for l in &lines[4..15] {
        assert_fail(l);
    }
    assert_ok(&lines[15], "200 OK hello from the test internet");
    assert_fail(&lines[16]);
    assert!(!host.was_reached(), "a sandbox reached a host service");
    assert!(!local.was_reached(), "a sandbox reached a service on the host's loopback");

    // Nothing but allowed A queries reached the upstream: no TXT, no tunnel, no evil.test.
    let queries = inet.queries();
    assert!(queries.contains("query pypi.test 1"), "{queries}");
    for leaked in ["tunnel", "evil.test", " 16\n"] {
        assert!(!queries.contains(leaked), "{leaked:?} reached the upstream resolver:\n{queries}");
    }

    // Every attempt is an audit line: allowed with the rule and bytes, denied with why.
    let lines = audit_lines(&h, &id);
    let connect_ok =
        lines.iter().find(|l| l["rpc"] == "egress.connect" && l["verdict"] == "allowed" && l["port"] == 8080).expect("an allowed connection in the audit log");
    assert_eq!(connect_ok["rule"], "pypi.test:8080", "{connect_ok}");
    assert_eq!(connect_ok["addr"], addr.as_str(), "{connect_ok}");
    assert!(connect_ok["bytes_in"].as_u64().unwrap_or(0) > 0 && connect_ok["bytes_out"].as_u64().unwrap_or(0) > 0, "{connect_ok}");
    assert_eq!(connect_ok["tenant"], "local");
    let denied = |pred: &dyn Fn(&serde_json::Value) -> bool| lines.iter().any(|l| l["verdict"] == "denied" && pred(l));
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["name"] == "evil.test"), "no SNI refusal in {lines:#?}");
    assert!(denied(&|l| l["rpc"] == "egress.dns" && l["name"] == "evil.test"), "no DNS refusal of evil.test");
    assert!(denied(&|l| l["rpc"] == "egress.dns" && l["detail"].as_str().unwrap_or("").contains("type 16")), "no TXT refusal");
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["addr"] == "169.254.169.254"), "no metadata refusal");
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["addr"] == host_addr.as_str() && l["detail"] == "the host"), "no host refusal");
    assert!(audit_lines(&h, &literal).iter().any(|l| l["verdict"] == "denied" && l["addr"] == addr.as_str() && l["port"] == 8080), "no IP-literal refusal");
}

#[tokio::test(flavor = "multi_thread")]
async fn none_reaches_nothing_and_open_reaches_the_internet_but_not_the_host_metadata_or_neighbours() {
    require_debian();
    let inet = Internet::start(1).await;
    let metrics = format!("0.0.0.0:{}", sandbox_tests::free_port().expect("port"));
    let h = inet.daemon(&["--metrics", &metrics]).await;
    let metrics_port = metrics.rsplit(':').next().unwrap_or_default().to_string();
    let addr = inet.addr();

    // NONE (the default): loopback only — no interface but lo, no name, no address.
    let none = sandbox(&h, None).await;
    let info = h.client.get(&none).await.expect("GetSandbox");
    assert_eq!(info.network.expect("Sandbox.network").mode, NetworkMode::None as i32);
    let lines = probe(&h, &none, &["resolve", "pypi.test", "http", &addr, "8080", "echo", &addr, "7000", "connect", "169.254.169.254", "80"]).await;
    for l in &lines {
        assert_fail(l);
    }
    let ifaces = sandbox_tests::sh_ok(&h.client, &none, "ls /sys/class/net").await;
    assert_eq!(ifaces.split_whitespace().collect::<Vec<_>>(), ["lo"], "NONE has interfaces: {ifaces}");

    // OPEN: the same attempts get through — so the refusals above are the mode's doing.
    let open = sandbox(&h, network(NetworkMode::Open, &[])).await;
    let neighbour = sandbox(&h, network(NetworkMode::Open, &[])).await;
    // The neighbour serves HTTP on every address of its own; it answers itself.
    let server =
        exec(&h.client, agent_client::proto::ExecRequest { background: true, ..exec_request(&neighbour, ["python3", "-m", "http.server", "8000"]) }).await;
    assert!(server.exec_id.len() > 1);
    assert!(
        eventually(30, || async { probe(&h, &neighbour, &["http", "127.0.0.1", "8000"]).await[0].starts_with("OK") }).await,
        "the neighbour's server never answered itself"
    );
    let neighbour_conf = h.client.read_file(&neighbour, "/etc/resolv.conf", 0, 0).await.expect("resolv.conf").content;
    let neighbour_gw: std::net::Ipv4Addr = String::from_utf8_lossy(&neighbour_conf)
        .lines()
        .find_map(|l| l.strip_prefix("nameserver "))
        .expect("nameserver")
        .trim()
        .parse()
        .expect("gateway address");
    let neighbour_addr = std::net::Ipv4Addr::from(u32::from(neighbour_gw) + 1).to_string();
    let gw = neighbour_gw.to_string();
    let host = HostService::start();
    let port = host.port();
    let lines = probe(
        &h,
        &open,
        &[
            "resolve",
            "evil.test", // 0
            "http",
            &addr,
            "8080", // 1: by address
            "http",
            "pypi.test",
            "8080", // 2: by name
            "echo",
            &addr,
            "7000", // 3
            "connect",
            &addr,
            "7000", // 4: the `connect` probe sees an open connection as open
            "connect",
            "169.254.169.254",
            "80", // 5
            "connect",
            "meta.test",
            "80", // 6
            "http",
            &neighbour_addr,
            "8000", // 7: the neighbour sandbox
            "http",
            &gw,
            &port, // 8: a host service at the gateway
            "http",
            &inet.host_addr(),
            &port, // 9: the same at the host end of the internet link
            "http",
            &gw,
            &metrics_port, // 10: the daemon's own metrics listener
            "dns",
            "16",
            "pypi.test", // 11: TXT is refused in every mode
        ],
    )
    .await;
    assert_ok(&lines[0], &addr);
    assert_ok(&lines[1], "hello from the test internet");
    assert_ok(&lines[2], "hello from the test internet");
    assert_ok(&lines[3], "ping");
    assert_ok(&lines[4], "open");
    for l in &lines[5..] {
        assert_fail(l);
    }
    assert_eq!(lines.len(), 12, "{lines:#?}");
    assert!(!host.was_reached(), "a sandbox reached a host service");
    let denied: Vec<_> = audit_lines(&h, &open).into_iter().filter(|l| l["verdict"] == "denied").collect();
    assert!(denied.iter().any(|l| l["addr"] == neighbour_addr.as_str() && l["detail"] == "the sandboxes' network"), "{denied:#?}");

    // The counters say the same.
    let body = http_get(&format!("127.0.0.1:{metrics_port}")).await;
    let count = |name: &str, verdict: &str| {
        body.lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("verdict=\"{verdict}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(count("sandboxd_egress_connections_total", "allowed") >= 3.0, "{body}");
    assert!(count("sandboxd_egress_connections_total", "denied") >= 6.0, "{body}");
    assert!(count("sandboxd_egress_dns_queries_total", "denied") >= 1.0, "{body}");
}

async fn http_get(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect metrics");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.expect("read");
    buf
}

#[tokio::test(flavor = "multi_thread")]
async fn forks_inherit_the_network_and_restarts_keep_it() {
    require_debian();
    let inet = Internet::start(2).await;
    let mut h = inet.daemon(&[]).await;
    let allow = vec!["pypi.test:8080".to_string()];

    // Malformed entries name the field.
    for (mode, entry) in [(NetworkMode::Allowlist, "pypi.test"), (NetworkMode::Allowlist, "10.0.0.0/40:1"), (NetworkMode::Open, "pypi.test:443")] {
        let request = CreateSandboxRequest { network: network(mode, &[entry.to_string()]), ..process_sandbox("debian") };
        let err = within(60, h.client.create(request)).await.expect_err("a bad allow entry");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(err.to_string().contains("network.allow"), "{err}");
    }

    let parent = sandbox(&h, network(NetworkMode::Allowlist, &allow)).await;
    let snap: SnapshotInfo = within(60, h.client.snapshot(&parent, "")).await.expect("Snapshot");
    let fork = within(60, h.client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() })).await.expect("fork");
    let n = fork.network.expect("network");
    assert_eq!((n.mode, n.allow), (NetworkMode::Allowlist as i32, allow.clone()));
    // Enforced in the fork, not only reported.
    let lines = probe(&h, &fork.id, &["http", "pypi.test", "8080", "http", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    // A fork may say otherwise.
    let closed = within(
        60,
        h.client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id, network: network(NetworkMode::None, &[]), ..Default::default() }),
    )
    .await
    .expect("fork with NONE");
    assert_eq!(closed.network.expect("network").mode, NetworkMode::None as i32);
    assert_fail(&probe(&h, &closed.id, &["http", "pypi.test", "8080"]).await[0]);

    // GetNetworkLog / `sbx net log`: the fork's own attempts, allowed and denied, oldest first.
    let events = within(30, h.client.network_log(&fork.id, 0)).await.expect("GetNetworkLog");
    let connects: Vec<_> = events.iter().filter(|e| e.kind == "connect").collect();
    assert_eq!(connects.iter().map(|e| (e.port, e.allowed)).collect::<Vec<_>>(), [(8080, true), (7000, false)], "{events:#?}");
    assert_eq!(connects[0].rule, "pypi.test:8080");
    assert!(connects[0].bytes_in > 0, "{:?}", connects[0]);
    assert!(events.iter().any(|e| e.kind == "dns" && e.name == "pypi.test" && e.allowed), "{events:#?}");
    assert!(within(30, h.client.network_log(&closed.id, 0)).await.expect("GetNetworkLog").is_empty());
    let out = run_sbx(&h.daemon, &["net", "log", &fork.id], 30).await;
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(table.lines().any(|l| l.contains("connect") && l.contains("allowed") && l.contains("pypi.test:8080")), "{table}");
    assert!(table.lines().any(|l| l.contains("connect") && l.contains("denied") && l.contains("7000")), "{table}");
    let other = h.client.network_log("sb-nosuchsandbox", 0).await.expect_err("an unknown sandbox");
    assert_eq!(other.code(), tonic::Code::NotFound, "{other}");

    // A daemon restart re-adopts the sandbox with the same network, enforced again.
    h.daemon.restart().await.expect("restarting sandboxd");
    h.client = h.daemon.client().await.expect("reconnecting");
    let running = eventually(120, || async { h.client.get(&fork.id).await.is_ok_and(|s| s.state == agent_client::proto::SandboxState::Running as i32) }).await;
    assert!(running, "the fork was not re-adopted: {:?}", h.client.get(&fork.id).await);
    assert_eq!(h.client.get(&fork.id).await.expect("get").network.expect("network").allow, allow);
    let lines = probe(&h, &fork.id, &["http", "pypi.test", "8080", "http", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);

    // The command line: --allow implies ALLOWLIST, and `sbx get --json` reports it.
    let out =
        run_sbx(&h.daemon, &["create", "--isolation", "process", "--image", "debian", "--allow", "pypi.test:8080", "--allow", "*.pypi.test:443"], 60).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = run_sbx(&h.daemon, &["--json", "get", &id], 30).await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["network"]["mode"], "ALLOWLIST", "{v}");
    assert_eq!(v["network"]["allow"], serde_json::json!(["pypi.test:8080", "*.pypi.test:443"]), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn pip_installs_from_an_allowed_index_and_not_without_a_network() {
    require_debian();
    let inet = Internet::start(3).await;
    let h = inet.daemon(&[]).await;
    let allowed = sandbox(&h, network(NetworkMode::Allowlist, &["pypi.test:8080".to_string()])).await;
    let out = sandbox_tests::sh_ok(&h.client, &allowed, PIP_INSTALL).await;
    assert!(out.contains("installed from the test index"), "{out}");
    let audit = audit_lines(&h, &allowed);
    assert!(audit.iter().any(|l| l["rpc"] == "egress.connect" && l["verdict"] == "allowed" && l["bytes_in"].as_u64().unwrap_or(0) > 500), "{audit:#?}");

    let none = sandbox(&h, None).await;
    let r = sandbox_tests::sh(&h.client, &none, PIP_INSTALL).await;
    assert_ne!(r.exit_code, 0, "pip installed without a network: {}", sandbox_tests::describe(&r));
    // The same index under an allow list without its port is no better.
    let wrong_port = sandbox(&h, network(NetworkMode::Allowlist, &["pypi.test:443".to_string()])).await;
    let r = sandbox_tests::sh(&h.client, &wrong_port, PIP_INSTALL).await;
    assert_ne!(r.exit_code, 0, "pip installed through an unlisted port: {}", sandbox_tests::describe(&r));

    // The container tier: the same install through the same filter, and none without it.
    let container = sandbox_on(&h, Isolation::Container, network(NetworkMode::Allowlist, &["pypi.test:8080".to_string()])).await;
    let out = sandbox_tests::sh_ok(&h.client, &container, PIP_INSTALL).await;
    assert!(out.contains("installed from the test index"), "{out}");
    let none = sandbox_on(&h, Isolation::Container, None).await;
    let r = sandbox_tests::sh(&h.client, &none, PIP_INSTALL).await;
    assert_ne!(r.exit_code, 0, "pip installed in a container without a network: {}", sandbox_tests::describe(&r));
}

/// A build's RUN steps get the network the build asks for, under the policy and through the
/// same filter as a sandbox (`[images] build_network = "policy"`): pip installs from the listed
/// index in a RUN step, and a name the list leaves out is refused to the next one.
#[tokio::test(flavor = "multi_thread")]
async fn a_builds_run_steps_reach_the_listed_index_and_nothing_else() {
    require_debian();
    let inet = Internet::start(7).await;
    let h = inet.daemon_with("[images]\nbuild_network = \"policy\"\n", &[]).await;
    let dockerfile = format!(
        "FROM sandboxd/debian\nRUN {}\nRUN (python3 -c \"import urllib.request; urllib.request.urlopen('http://evil.test:8080/', timeout=10)\" && echo REACHED || echo REFUSED) > /opt/evil.txt\n",
        PIP_INSTALL.replace("/workspace/site", "/opt/site").split(" && ").next().expect("the pip command")
    );
    let mut b = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(dockerfile.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    b.append_data(&mut header, "Dockerfile", dockerfile.as_bytes()).expect("tar");
    let ctx = b.into_inner().expect("tar");
    let request = agent_client::proto::BuildImageHeader {
        name: "pipbuild".into(),
        context_size_bytes: ctx.len() as u64,
        network: network(NetworkMode::Allowlist, &["pypi.test:8080".to_string()]),
        ..Default::default()
    };
    let mut log = Vec::new();
    let built = within(900, h.client.build_image(request, std::io::Cursor::new(ctx), |p| log.push(p.message.clone()))).await;
    assert!(built.is_ok(), "{built:?}: {}", log.join("\n"));
    assert!(log.iter().any(|l| l.contains("network ALLOWLIST")), "{}", log.join("\n"));
    let id = within(60, h.client.create(CreateSandboxRequest { ..process_sandbox("pipbuild") })).await.expect("CreateSandbox").id;
    let out =
        sandbox_tests::sh_ok(&h.client, &id, "PYTHONPATH=/opt/site python3 -c 'import egresshello; print(egresshello.GREETING)'; cat /opt/evil.txt").await;
    assert!(out.contains("installed from the test index") && out.ends_with("REFUSED\n"), "{out}");
}

/// The nameserver a sandbox's /etc/resolv.conf names: its gateway, the host end of its link.
async fn nameserver(h: &Harness, id: &str) -> std::net::Ipv4Addr {
    let conf = within(30, h.client.read_file(id, "/etc/resolv.conf", 0, 0)).await.expect("resolv.conf").content;
    let conf = String::from_utf8_lossy(&conf).to_string();
    conf.lines().find_map(|l| l.strip_prefix("nameserver ")).unwrap_or_else(|| panic!("no nameserver in {conf:?}")).trim().parse().expect("an address")
}

/// The allow list of the container and microVM tests: HTTP, HTTPS and a raw TCP port of the
/// test internet, the host's service (`port`) by name, and the metadata address as a CIDR.
fn tier_allow(port: &str) -> Vec<String> {
    vec![
        "pypi.test:8080".to_string(),
        format!("host.test:{port}"),
        "169.254.169.254/32:80".to_string(),
        "pypi.test:8443".to_string(),
        "pypi.test:7001".to_string(),
    ]
}

/// What an ALLOWLIST sandbox `id` of [`tier_allow`] reaches, the same on every tier: exactly
/// the listed names and ports (HTTP, verified HTTPS, raw TCP), and nothing by IP literal, on
/// an unlisted port, by an unlisted name, on the host or its gateway, at the metadata address,
/// by SNI of another name, or through TXT or long-label DNS (which never reach upstream).
async fn allowlist_is_held(h: &Harness, inet: &Internet, id: &str, port: &str, what: &str) {
    within(60, h.client.write_file(id, "/ca.pem", inet.ca_pem(), 0o644)).await.expect("writing the test CA");
    let (addr, gw) = (inet.addr(), nameserver(h, id).await.to_string());
    let tunnel = format!("{}.tunnel.test", "b".repeat(60));
    #[rustfmt::skip]
    let attempts = [
        "http", &addr, "8080",                   // 0: an IP literal nobody resolved
        "http", "pypi.test", "8080",             // 1: listed
        "echo", "pypi.test", "7000",             // 2: the listed name on another port
        "resolve", "evil.test",                  // 3: not listed (resolves upstream to the same address)
        "http", "host.test", port,               // 4: listed, but the host
        "http", &gw, port,                       // 5: the gateway (the host)
        "connect", "169.254.169.254", "80",      // 6: listed as a CIDR, still the metadata address
        "https", "pypi.test", "8443", "evil.test", // 7: real HTTPS naming an unlisted name at the allowed address
        "dns", "16", "pypi.test",                // 8: TXT of the listed name
        "dns", "1", &tunnel,                     // 9: a long label under an unlisted name
        "https", "pypi.test", "8443", "pypi.test", // 10: real HTTPS to the listed name, checked against the test CA
        "echo", "pypi.test", "7001",             // 11: a listed raw TCP port
    ];
    let lines = probe(h, id, &attempts).await;
    assert_eq!(lines.len(), 12, "{what}: {lines:#?}");
    assert_fail(&lines[0]);
    assert_ok(&lines[1], "200 OK hello from the test internet");
    for l in &lines[2..10] {
        assert_fail(l);
    }
    assert_ok(&lines[10], "200 OK hello from the test internet");
    assert_ok(&lines[11], "ping");
    let queries = inet.queries();
    for leaked in ["tunnel", " 16\n"] {
        assert!(!queries.contains(leaked), "{leaked:?} reached the upstream resolver from {what}:\n{queries}");
    }
}

/// Returns once every sandbox of the daemon is back after a restart. A listing is no sign: a
/// sandbox waiting for its re-adoption is listed in its recorded state (RUNNING) before its
/// container or VM, and its link, are back; an exec waits for (or does) the re-adoption.
async fn every_sandbox_readopted(h: &Harness) {
    let all = within(60, h.client.list(Default::default())).await.expect("ListSandboxes");
    for s in all {
        let r = within(180, h.client.exec(exec_request(&s.id, ["true"]))).await.expect("Exec");
        assert_eq!(r.exit_code, 0, "{}: not back after the restart: {}", s.id, r.error);
    }
}

/// Whether Docker has a container of exactly this name (running or not).
fn container_exists(name: &str) -> bool {
    let out = Command::new("docker").args(["ps", "-a", "--format", "{{.Names}}"]).output().expect("docker ps");
    text(&out.stdout).lines().any(|l| l == name)
}

/// The host-side interfaces of the daemon's sandbox links (named `<prefix><slot>`).
fn host_links(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["-o", "link", "show"]).output().expect("ip link show");
    text(&out.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap_or_default().to_string())
        .filter(|n| n.strip_prefix(prefix).is_some_and(|slot| !slot.is_empty() && slot.bytes().all(|b| b.is_ascii_digit())))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_container_tier_is_held_the_same_through_fork_rollback_restart_and_destroy() {
    require_debian();
    let inet = Internet::start(4).await;
    let mut h = inet.daemon(&[]).await;
    let (addr, prefix) = (inet.addr(), inet.prefix());
    let host = HostService::start();
    let port = host.port();

    // NONE (the default): Docker's `none` network, nothing but lo, no link on the host.
    let none = sandbox_on(&h, Isolation::Container, None).await;
    let lines = probe(&h, &none, &["resolve", "pypi.test", "http", &addr, "8080", "connect", "169.254.169.254", "80"]).await;
    assert_eq!(lines.len(), 3, "{lines:#?}");
    for l in &lines {
        assert_fail(l);
    }
    let ifaces = sandbox_tests::sh_ok(&h.client, &none, "ls /sys/class/net").await;
    assert_eq!(ifaces.split_whitespace().collect::<Vec<_>>(), ["lo"], "NONE has interfaces: {ifaces}");
    assert!(host_links(&prefix).is_empty(), "a NONE container got a link: {:?}", host_links(&prefix));

    // ALLOWLIST: exactly the listed name and port, through the daemon's DNS and proxy.
    let allow = tier_allow(&port);
    let id = sandbox_on(&h, Isolation::Container, network(NetworkMode::Allowlist, &allow)).await;
    assert_eq!(host_links(&prefix).len(), 1, "{:?}", host_links(&prefix));
    allowlist_is_held(&h, &inet, &id, &port, "a container").await;
    let gw = nameserver(&h, &id).await.to_string();
    assert!(!host.was_reached(), "a container reached a host service");
    let audit = audit_lines(&h, &id);
    let ok = audit.iter().find(|l| l["rpc"] == "egress.connect" && l["verdict"] == "allowed").expect("an allowed connection in the audit log");
    assert_eq!((ok["rule"].as_str(), ok["port"].as_u64()), (Some("pypi.test:8080"), Some(8080)), "{ok}");
    let denied = |pred: &dyn Fn(&serde_json::Value) -> bool| audit.iter().any(|l| l["verdict"] == "denied" && pred(l));
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["addr"] == addr.as_str() && l["port"] == 8080), "no IP-literal refusal: {audit:#?}");
    assert!(denied(&|l| l["rpc"] == "egress.dns" && l["name"] == "evil.test"), "no DNS refusal: {audit:#?}");
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["addr"] == "169.254.169.254"), "no metadata refusal: {audit:#?}");
    assert!(!inet.queries().contains("evil.test"), "an unlisted name reached the upstream resolver");

    // OPEN: the test internet, but not the host, the metadata address or a neighbour.
    let open = sandbox_on(&h, Isolation::Container, network(NetworkMode::Open, &[])).await;
    let neighbour = sandbox_on(&h, Isolation::Container, network(NetworkMode::Open, &[])).await;
    let server =
        exec(&h.client, agent_client::proto::ExecRequest { background: true, ..exec_request(&neighbour, ["python3", "-m", "http.server", "8000"]) }).await;
    assert!(server.exec_id.len() > 1);
    assert!(
        eventually(30, || async { probe(&h, &neighbour, &["http", "127.0.0.1", "8000"]).await[0].starts_with("OK") }).await,
        "the neighbour's server never answered itself"
    );
    let neighbour_addr = std::net::Ipv4Addr::from(u32::from(nameserver(&h, &neighbour).await) + 1).to_string();
    let open_gw = nameserver(&h, &open).await.to_string();
    let lines = probe(
        &h,
        &open,
        &[
            "http",
            &addr,
            "8080", // 0
            "http",
            "pypi.test",
            "8080", // 1
            "connect",
            "169.254.169.254",
            "80", // 2
            "http",
            &neighbour_addr,
            "8000", // 3
            "http",
            &open_gw,
            &port, // 4
            "http",
            &inet.host_addr(),
            &port, // 5
        ],
    )
    .await;
    assert_eq!(lines.len(), 6, "{lines:#?}");
    assert_ok(&lines[0], "hello from the test internet");
    assert_ok(&lines[1], "hello from the test internet");
    for l in &lines[2..] {
        assert_fail(l);
    }
    assert!(!host.was_reached(), "a container reached a host service");
    let denied: Vec<_> = audit_lines(&h, &open).into_iter().filter(|l| l["verdict"] == "denied").collect();
    assert!(denied.iter().any(|l| l["addr"] == neighbour_addr.as_str() && l["detail"] == "the sandboxes' network"), "{denied:#?}");

    // A fork inherits the list, on a link of its own.
    let snap: SnapshotInfo = within(60, h.client.snapshot(&id, "")).await.expect("Snapshot");
    let fork = within(60, h.client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() })).await.expect("fork");
    assert_eq!(fork.network.clone().expect("network").allow, allow);
    assert_ne!(nameserver(&h, &fork.id).await.to_string(), gw, "the fork shares its parent's link");
    let lines = probe(&h, &fork.id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);

    // A rollback's new container gets the link again (the old one's went with its namespace).
    let links = host_links(&prefix).len();
    within(120, h.client.rollback(&id, &snap.snapshot_id)).await.expect("Rollback");
    assert_eq!(host_links(&prefix).len(), links, "{:?}", host_links(&prefix));
    let lines = probe(&h, &id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000", "connect", "169.254.169.254", "80"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    assert_fail(&lines[2]);

    // The rollback prepared a standby for the next one; a newer snapshot discards it. The
    // standby carries the sandbox's id but no link: discarding it leaves the serving
    // container's link alone.
    let standby = format!("sandboxd-{id}-standby-{}", snap.snapshot_id);
    assert!(eventually(120, || async { container_exists(&standby) }).await, "the rollback prepared no standby {standby}");
    let links = host_links(&prefix);
    within(60, h.client.snapshot(&id, "")).await.expect("Snapshot");
    assert!(eventually(120, || async { !container_exists(&standby) }).await, "the replaced standby {standby} was not removed");
    assert_eq!(host_links(&prefix), links, "discarding a standby changed the links");
    let lines = probe(&h, &id, &["http", "pypi.test", "8080"]).await;
    assert_ok(&lines[0], "hello from the test internet");

    // A daemon restart restarts the container (a new namespace): re-adopted with its link.
    h.daemon.restart().await.expect("restarting sandboxd");
    h.client = h.daemon.client().await.expect("reconnecting");
    let running = eventually(120, || async { h.client.get(&id).await.is_ok_and(|s| s.state == agent_client::proto::SandboxState::Running as i32) }).await;
    assert!(running, "the container was not re-adopted: {:?}", h.client.get(&id).await);
    let lines = probe(&h, &id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000", "http", &addr, "8081"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    assert_fail(&lines[2]);
    let lines = probe(&h, &none, &["http", &addr, "8080"]).await;
    assert_fail(&lines[0]);

    // Destroy takes the link away — counted once every sandbox is back: the restart's
    // re-adoption of the others gives them links meanwhile.
    every_sandbox_readopted(&h).await;
    let before = host_links(&prefix).len();
    within(60, h.client.destroy(&id)).await.expect("Destroy");
    assert_eq!(host_links(&prefix).len(), before - 1, "{:?}", host_links(&prefix));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_microvm_tier_is_held_the_same_through_fork_rollback_restart_and_destroy() {
    require_debian();
    let inet = Internet::start(5).await;
    let mut h = inet.daemon(&[]).await;
    let (addr, prefix) = (inet.addr(), inet.prefix());
    let host = HostService::start();
    let port = host.port();

    // NONE (the default): no network device at all, no link on the host.
    let none = sandbox_on(&h, Isolation::Microvm, None).await;
    let lines = probe(&h, &none, &["resolve", "pypi.test", "http", &addr, "8080"]).await;
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for l in &lines {
        assert_fail(l);
    }
    let ifaces = sandbox_tests::sh_ok(&h.client, &none, "ls /sys/class/net").await;
    assert_eq!(ifaces.split_whitespace().collect::<Vec<_>>(), ["lo"], "NONE has interfaces: {ifaces}");
    assert!(host_links(&prefix).is_empty(), "a NONE microVM got a link: {:?}", host_links(&prefix));
    within(60, h.client.destroy(&none)).await.expect("Destroy");

    // ALLOWLIST: a virtio-net device on a TAP, held by the same filter as the other tiers.
    let allow = tier_allow(&port);
    let id = sandbox_on(&h, Isolation::Microvm, network(NetworkMode::Allowlist, &allow)).await;
    assert_eq!(host_links(&prefix).len(), 1, "{:?}", host_links(&prefix));
    allowlist_is_held(&h, &inet, &id, &port, "a microVM").await;
    let gw = nameserver(&h, &id).await.to_string();
    assert!(!host.was_reached(), "a microVM reached a host service");
    // pip from the test index, as on the other tiers.
    let out = sandbox_tests::sh_ok(&h.client, &id, PIP_INSTALL).await;
    assert!(out.contains("installed from the test index"), "{out}");
    let audit = audit_lines(&h, &id);
    let ok = audit.iter().find(|l| l["rpc"] == "egress.connect" && l["verdict"] == "allowed").expect("an allowed connection in the audit log");
    assert_eq!((ok["rule"].as_str(), ok["port"].as_u64()), (Some("pypi.test:8080"), Some(8080)), "{ok}");
    let denied = |pred: &dyn Fn(&serde_json::Value) -> bool| audit.iter().any(|l| l["verdict"] == "denied" && pred(l));
    assert!(denied(&|l| l["rpc"] == "egress.connect" && l["addr"] == addr.as_str() && l["port"] == 8080), "no IP-literal refusal: {audit:#?}");
    assert!(denied(&|l| l["rpc"] == "egress.dns" && l["name"] == "evil.test"), "no DNS refusal: {audit:#?}");
    assert!(!inet.queries().contains("evil.test"), "an unlisted name reached the upstream resolver");
    // OPEN: the test internet, but not the host, the metadata address or a neighbour (a
    // process sandbox: every tier's links are in one subnet, and none reaches another).
    let open = sandbox_on(&h, Isolation::Microvm, network(NetworkMode::Open, &[])).await;
    let neighbour = sandbox_on(&h, Isolation::Process, network(NetworkMode::Open, &[])).await;
    let server =
        exec(&h.client, agent_client::proto::ExecRequest { background: true, ..exec_request(&neighbour, ["python3", "-m", "http.server", "8000"]) }).await;
    assert!(server.exec_id.len() > 1);
    assert!(
        eventually(30, || async { probe(&h, &neighbour, &["http", "127.0.0.1", "8000"]).await[0].starts_with("OK") }).await,
        "the neighbour's server never answered itself"
    );
    let neighbour_addr = std::net::Ipv4Addr::from(u32::from(nameserver(&h, &neighbour).await) + 1).to_string();
    let open_gw = nameserver(&h, &open).await.to_string();
    let lines = probe(
        &h,
        &open,
        &["http", &addr, "8080", "http", "pypi.test", "8080", "connect", "169.254.169.254", "80", "http", &neighbour_addr, "8000", "http", &open_gw, &port],
    )
    .await;
    assert_eq!(lines.len(), 5, "{lines:#?}");
    assert_ok(&lines[0], "hello from the test internet");
    assert_ok(&lines[1], "hello from the test internet");
    for l in &lines[2..] {
        assert_fail(l);
    }
    assert!(!host.was_reached(), "a microVM reached a host service");
    within(60, h.client.destroy(&open)).await.expect("Destroy");
    within(60, h.client.destroy(&neighbour)).await.expect("Destroy");

    // A fork resumes the snapshot's memory on a link of its own: its own address, same list.
    let snap: SnapshotInfo = within(120, h.client.snapshot(&id, "")).await.expect("Snapshot");
    assert!(snap.includes_memory, "a microVM snapshot holds its memory by default: {snap:?}");
    let fork = within(120, h.client.create(CreateSandboxRequest { from_snapshot_id: snap.snapshot_id.clone(), ..Default::default() })).await.expect("fork");
    assert_eq!(fork.network.clone().expect("network").allow, allow);
    let fork_gw = nameserver(&h, &fork.id).await.to_string();
    assert_ne!(fork_gw, gw, "the fork shares its parent's link");
    // (The image has no iproute2: SIOCGIFADDR from python.)
    let fork_addr = sandbox_tests::sh_ok(
        &h.client,
        &fork.id,
        "python3 -c \"import fcntl,socket,struct; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); print(socket.inet_ntoa(fcntl.ioctl(s.fileno(),0x8915,struct.pack('256s',b'eth0'))[20:24]))\"",
    )
    .await;
    assert!(fork_addr.contains(&std::net::Ipv4Addr::from(u32::from(fork_gw.parse::<std::net::Ipv4Addr>().expect("gw")) + 1).to_string()), "{fork_addr}");
    let lines = probe(&h, &fork.id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);

    // A rollback resumes the memory in a new QEMU on the sandbox's own link.
    let links = host_links(&prefix).len();
    within(120, h.client.rollback(&id, &snap.snapshot_id)).await.expect("Rollback");
    assert_eq!(host_links(&prefix).len(), links, "{:?}", host_links(&prefix));
    let lines = probe(&h, &id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000", "connect", "169.254.169.254", "80"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    assert_fail(&lines[2]);

    // A daemon restart boots the VM again: re-adopted with a link, enforced again.
    h.daemon.restart().await.expect("restarting sandboxd");
    h.client = h.daemon.client().await.expect("reconnecting");
    let running = eventually(180, || async { h.client.get(&id).await.is_ok_and(|s| s.state == agent_client::proto::SandboxState::Running as i32) }).await;
    assert!(running, "the microVM was not re-adopted: {:?}", h.client.get(&id).await);
    let lines = probe(&h, &id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000", "http", &addr, "8081"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    assert_fail(&lines[2]);

    // Destroy takes the link away — counted once every sandbox is back: the restart's
    // re-adoption of the others gives them links meanwhile.
    every_sandbox_readopted(&h).await;
    let before = host_links(&prefix).len();
    within(60, h.client.destroy(&id)).await.expect("Destroy");
    assert_eq!(host_links(&prefix).len(), before - 1, "{:?}", host_links(&prefix));
}

#[tokio::test(flavor = "multi_thread")]
async fn policy_rules_grant_and_bound_networks_idle_connections_close_bandwidth_is_capped_and_http_must_name_an_allowed_host() {
    require_debian();
    let inet = Internet::start(6).await;
    let rules = "[[policy.rules]]\nname = \"ci\"\nmatch_labels = { team = \"ci\" }\nnetwork_allow = [\"pypi.test:8080\"]\n";
    let h = inet.daemon_with(&format!("idle_timeout_ms = 1500\nbandwidth_bytes_per_sec = 1048576\nmax_connections = 3\n{rules}"), &[]).await;

    // A policy rule by label: a CI sandbox that asks for no network gets the rule's list, and
    // cannot ask for more.
    let ci = |network: Option<NetworkPolicy>| CreateSandboxRequest {
        network,
        labels: [("team".to_string(), "ci".to_string())].into_iter().collect(),
        ..process_sandbox("debian")
    };
    let granted = within(60, h.client.create(ci(None))).await.expect("CreateSandbox with the rule's network");
    let n = granted.network.clone().expect("network");
    assert_eq!((n.mode, n.allow), (NetworkMode::Allowlist as i32, vec!["pypi.test:8080".to_string()]));
    within(30, h.client.write_file(&granted.id, "/probe.py", PROBE_PY, 0o644)).await.expect("writing the probe");
    let lines = probe(&h, &granted.id, &["http", "pypi.test", "8080", "echo", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "hello from the test internet");
    assert_fail(&lines[1]);
    let err = within(60, h.client.create(ci(network(NetworkMode::Open, &[])))).await.expect_err("OPEN over the rule");
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    let msg = err.to_string();
    assert!(msg.contains("policy rule \"ci\"") && msg.contains("OPEN"), "{err}");
    // Deny wins over allow: a listed range wholly inside `[network] deny` (10.0.0.0/8 by
    // default) could reach nothing, and is refused at create rather than left to fail later.
    let err = within(
        60,
        h.client.create(CreateSandboxRequest { network: network(NetworkMode::Allowlist, &["10.1.0.0/16:5432".to_string()]), ..process_sandbox("debian") }),
    )
    .await
    .expect_err("inside a denied range");
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    assert!(err.to_string().contains("10.1.0.0/16:5432") && err.to_string().contains("10.0.0.0/8"), "{err}");

    let allow = vec!["pypi.test:8080".to_string(), "pypi.test:7000".to_string()];
    let id = sandbox(&h, network(NetworkMode::Allowlist, &allow)).await;
    let lines = probe(
        &h,
        &id,
        &[
            "httphost",
            "pypi.test",
            "8080",
            "pypi.test:8080", // 0: the name it resolved
            "httphost",
            "pypi.test",
            "8080",
            "evil.test", // 1: the allowed address, another name in Host
            "idle",
            "pypi.test",
            "7000", // 2: a connection that says nothing is closed after the idle timeout
            "bulk",
            "pypi.test",
            "7000",
            "3145728", // 3: 3 MiB each way at 1 MiB/s (a burst of 1 MiB): at least 2 s
        ],
    )
    .await;
    assert_eq!(lines.len(), 4, "{lines:#?}");
    assert_ok(&lines[0], "200");
    assert_fail(&lines[1]);
    assert_ok(&lines[2], "closed after");
    assert_ok(&lines[3], "3145728 bytes");
    let seconds: f64 = lines[3].rsplit(" in ").next().and_then(|t| t.trim_end_matches(" s").parse().ok()).expect("seconds");
    assert!(seconds >= 1.8, "3 MiB through a 1 MiB/s cap took {seconds} s: {}", lines[3]);
    let audit = audit_lines(&h, &id);
    assert!(
        audit.iter().any(|l| l["verdict"] == "denied" && l["name"] == "evil.test" && l["detail"].as_str().unwrap_or("").contains("HTTP Host")),
        "no Host refusal: {audit:#?}"
    );
    assert!(audit.iter().any(|l| l["detail"].as_str().unwrap_or("").contains("idle_timeout_ms")), "no idle close: {audit:#?}");
    let bulk = audit.iter().find(|l| l["verdict"] == "allowed" && l["bytes_out"].as_u64() == Some(3_145_728)).expect("the bulk connection's line");
    assert_eq!(bulk["bytes_in"].as_u64(), Some(3_145_728), "{bulk}");

    // max_connections: a sandbox holding 3 connections gets its 4th closed unanswered (a
    // sandbox of its own, so no earlier connection is still being counted down).
    let held = sandbox(&h, network(NetworkMode::Allowlist, &["pypi.test:7000".to_string()])).await;
    let lines = probe(&h, &held, &["many", "4", "pypi.test", "7000"]).await;
    assert_ok(&lines[0], "3 of 4 echoed");
    assert!(
        audit_lines(&h, &held).iter().any(|l| l["verdict"] == "denied" && l["detail"].as_str().unwrap_or("").contains("over network.max_connections (3)")),
        "no max_connections refusal in the audit log"
    );
    // Once they are closed, the sandbox connects again.
    let again = eventually(60, || async { probe(&h, &held, &["echo", "pypi.test", "7000"]).await[0].starts_with("OK") }).await;
    assert!(again, "the sandbox could not connect again after closing its connections");

    // The host's connection tracking holds at most 1024 flows of one sandbox: 1500 DNS
    // queries, each from a socket of its own (a flow each, tracked for 30 s), leave no more.
    let lines = probe(&h, &held, &["flows", "1500", "pypi.test"]).await;
    assert_ok(&lines[0], "from ");
    let me = lines[0].rsplit(' ').next().unwrap_or_default().to_string();
    let tracked = std::fs::read_to_string("/proc/net/nf_conntrack").expect("/proc/net/nf_conntrack");
    let dns_flows = tracked.lines().filter(|l| l.contains(" udp ") && l.contains(&format!(" src={me} ")) && l.contains(" dport=53 ")).count();
    assert!(dns_flows > 0, "no DNS flow of {me} is tracked: the count below proves nothing");
    assert!(dns_flows <= 1024, "the host tracks {dns_flows} DNS flows of one sandbox ({me}), over the cap of 1024");
}

/// Sandboxes without a link (network NONE) share one read-only sysfs, the daemon's: one
/// superblock for all, showing what their own namespace has (`lo`, up) and no host path. One
/// with a link mounts its own, which shows its `eth0`. The shared one outlives any sandbox.
#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_without_a_link_share_one_sysfs_and_one_with_a_link_has_its_own() {
    let h = Harness::start().await;
    let create = |network: Option<NetworkPolicy>| async {
        let request = CreateSandboxRequest { network, ..process_sandbox("minimal") };
        within(60, h.client.create(request)).await.expect("CreateSandbox").id
    };
    let (a, b) = (create(None).await, create(None).await);
    let linked = create(network(NetworkMode::Open, &[])).await;
    let state = h.daemon.state_dir().display().to_string();
    let mut devices = Vec::new();
    for id in [&a, &b, &linked] {
        devices.push(h.sh_ok(id, "stat -c %d /sys").await);
        let devs = h.sh_ok(id, "ls /sys/class/net").await;
        let expected = if id == &linked { "eth0\nlo\n" } else { "lo\n" };
        assert_eq!(devs, expected, "{id}: /sys/class/net");
        assert_eq!(h.sh_ok(id, "cat /sys/class/net/lo/flags").await, "0x9\n", "{id}: lo is up and a loopback");
        let mountinfo = h.sh_ok(id, "cat /proc/self/mountinfo").await;
        let sys = mountinfo.lines().find(|l| l.split(' ').nth(4) == Some("/sys")).unwrap_or_else(|| panic!("{id}: no /sys in\n{mountinfo}"));
        assert!(sys.split(' ').nth(5).is_some_and(|o| o.split(',').any(|o| o == "ro")), "{id}: /sys not read-only: {sys}");
        assert!(!mountinfo.contains("sysfs-") && !mountinfo.contains(&state), "{id}: a host path in the mountinfo:\n{mountinfo}");
        let r = h.sh(id, "touch /sys/x || exit 3; echo WROTE").await;
        assert_eq!((r.exit_code, text(&r.stdout)), (3, String::new()), "{id}: wrote in /sys");
    }
    assert_eq!(devices[0], devices[1], "two sandboxes without a link do not share their sysfs");
    assert_ne!(devices[0], devices[2], "the sandbox with a link shows the shared sysfs, not its own");
    within(60, h.client.destroy(&a)).await.expect("DestroySandbox");
    assert_eq!(h.sh_ok(&b, "ls /sys/class/net").await, "lo\n", "the shared sysfs lost its namespace with a sandbox");
}
