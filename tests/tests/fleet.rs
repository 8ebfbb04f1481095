//! A fleet (issue #27): three daemons in three network namespaces this test makes, joined by a
//! bridge, whose peers come from a real DNS server (dnsmasq) answering one name with their
//! three addresses, as cluster DNS answers a headless Service. Every call goes through node A's
//! TCP address with a tenant's token: creates fill all three nodes by capacity, calls on
//! sandboxes of other nodes (unary, streams, 100 MiB up and down, snapshots, rollback, fork)
//! are forwarded, lists fan out, tenants stay apart, and a node killed with SIGKILL makes its
//! sandboxes UNAVAILABLE naming it while the others keep working, until it comes back.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::{BTreeMap, HashMap};

use agent_client::{exec_request, Client};
use sandbox_tests::fleet::{Net, NODES, PORT, TOKEN_A, TOKEN_B, WEB_PORT};
use sandbox_tests::proto::{exec_event, CreateSandboxRequest, ExecSessionStart, Isolation, Sandbox};
use sandbox_tests::{eventually, process_sandbox, sandbox_request, sh_ok, text, within, Daemon};
use sha2::{Digest, Sha256};
use tonic::Code;

/// Sandboxes each node holds at most (policy.max_sandboxes).
const PER_NODE: usize = 3;

/// Node `i`: nodes A and B offer only the process tier, node C the container tier too.
async fn start_node(net: &Net, i: usize) -> Daemon {
    let allowed = if i == 2 { "allowed = [\"process\", \"container\"]\n" } else { "allowed = [\"process\"]\n" };
    sandbox_tests::fleet::start_node_with(net, i, PER_NODE, allowed).await.expect("starting a fleet node")
}

async fn tenant(net: &Net, token: &str) -> Client {
    sandbox_tests::fleet::client_of(net, 0, token).await.expect("connecting to node A")
}

/// A GET on a node's page listener with a tenant's token: the JSON body.
fn page_json(host: &str, path: &str, token: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect((host, WEB_PORT)).expect("connect to the page");
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).expect("timeout");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}:{WEB_PORT}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {resp}"))
}

fn labelled(i: usize) -> CreateSandboxRequest {
    let mut r = process_sandbox("minimal");
    r.labels = HashMap::from([("n".to_string(), i.to_string())]);
    r
}

fn by_node(list: &[Sandbox]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for s in list {
        *m.entry(s.node.clone()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn three_nodes_behind_one_address() {
    sandbox_tests::require_environment().expect("environment");
    let net = Net::setup().expect("the fleet's network");
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start_node(&net, i).await);
    }
    let a = tenant(&net, TOKEN_A).await;
    let b = tenant(&net, TOKEN_B).await;

    // A stock grpcio client (Python, gRPC C core) with node A's address only, over TLS with a
    // token: sandboxes on every node, each exec'd, streamed, snapshotted and rolled back.
    let script = sandbox_tests::workspace_root().join("tests/python/grpcio_fleet.py");
    let args = [
        sandbox_tests::workspace_root().display().to_string(),
        format!("{}:{PORT}", net.addr(0)),
        net.ca_path().display().to_string(),
        TOKEN_A.to_string(),
        NODES.join(","),
    ];
    let out = tokio::task::spawn_blocking(move || std::process::Command::new("python3").arg(&script).args(&args).output())
        .await
        .expect("join")
        .expect("running python3 (grpcio and grpcio-tools: python3 -m pip install grpcio grpcio-tools)");
    assert!(
        out.status.success() && text(&out.stdout).ends_with("OK\n"),
        "grpcio through node A ({}):\n{}\n{}\nnode A's log:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr),
        nodes[0].log()
    );

    // A tier only one node offers (node C's policy allows the container tier, A's and B's do
    // not) lands there through A; one no node offers is refused naming why on every node.
    let on_c = within(180, a.create(sandbox_request(Isolation::Container, "minimal")))
        .await
        .unwrap_or_else(|e| panic!("a container create through A: {e}\nnode A's log:\n{}", nodes[0].log()));
    assert_eq!(on_c.node, "node-c", "the only node offering the container tier: {on_c:?}");
    assert_eq!(sh_ok(&a, &on_c.id, "echo boxed").await, "boxed\n");
    within(120, a.destroy(on_c.id.clone())).await.expect("destroy the container sandbox");
    let e = within(120, a.create(sandbox_request(Isolation::Microvm, "minimal"))).await.expect_err("no node offers the microVM tier");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    for n in NODES {
        assert!(e.to_string().contains(n), "the refusal names every node: {e}");
    }
    assert!(e.to_string().contains("MICROVM unavailable: not allowed by policy"), "{e}");

    // Creates through A fill A first, then the peer with the most room: all three get some.
    let mut mine = Vec::new();
    for i in 0..7 {
        let sb = within(120, a.create(labelled(i))).await.unwrap_or_else(|e| panic!("create {i}: {e}\nnode A's log:\n{}", nodes[0].log()));
        assert!(NODES.contains(&sb.node.as_str()), "a sandbox names its node: {sb:?}");
        assert!(sb.id.ends_with(&format!("_{}", sb.node)), "the id names the node: {} on {}", sb.id, sb.node);
        let i = NODES.iter().position(|n| *n == sb.node).unwrap();
        assert_eq!(sb.node_address, format!("{}:{PORT}", net.addr(i)), "the node's direct address");
        mine.push(sb);
    }
    let spread = by_node(&mine);
    assert_eq!(spread.get("node-a"), Some(&PER_NODE), "A fills first: {spread:?}");
    assert!(spread.get("node-b").is_some_and(|n| *n >= 1) && spread.get("node-c").is_some_and(|n| *n >= 1), "{spread:?}");
    // Node A's page shows every node of the fleet with its readiness and room per tier.
    let overview = page_json(&net.addr(0), "/api/overview", TOKEN_A);
    let fleet = overview["fleet"].as_array().unwrap_or_else(|| panic!("no fleet in the page's overview: {overview}"));
    let mut names: Vec<&str> = fleet.iter().filter_map(|n| n["node"].as_str()).collect();
    names.sort();
    assert_eq!(names, NODES.to_vec(), "{overview}");
    assert!(fleet.iter().all(|n| n["status"]["ready"] == true && n["status"]["tiers"].as_array().is_some_and(|t| !t.is_empty())), "{overview}");
    let on = |node: &str| mine.iter().find(|s| s.node == node).cloned().unwrap();
    let (sb_b, sb_c) = (on("node-b"), on("node-c"));

    // Unary calls on sandboxes of other nodes, through A.
    let out = sh_ok(&a, &sb_c.id, "cat /proc/sys/kernel/hostname; echo from-c > /workspace/f; cat /workspace/f").await;
    assert_eq!(out, format!("{}\nfrom-c\n", sb_c.id), "ran on C's sandbox");
    assert_eq!(a.get(&sb_c.id).await.expect("get").node, "node-c");
    let r = within(60, a.exec(sandbox_tests::proto::ExecRequest { background: true, ..exec_request(&sb_b.id, ["sh", "-c", "sleep 30"]) }))
        .await
        .expect("background exec");
    within(30, a.signal_exec(&r.exec_id, 9)).await.expect("SignalExec forwarded by the exec id");
    let ended = within(60, a.get_exec(&r.exec_id, true)).await.expect("GetExec");
    assert_eq!(ended.signal, 9, "{ended:?}");

    // ExecStream.
    let mut stream = within(60, a.exec_stream(exec_request(&sb_c.id, ["sh", "-c", "echo one; echo two >&2"]))).await.expect("ExecStream");
    let (mut stdout, mut result) = (Vec::new(), None);
    while let Some(ev) = within(60, stream.next_event()).await.expect("event") {
        match ev.event {
            Some(exec_event::Event::Stdout(b)) => stdout.extend(b),
            Some(exec_event::Event::Result(r)) => result = Some(r),
            _ => {}
        }
    }
    assert_eq!(text(&stdout), "one\n");
    assert_eq!(result.expect("result").exit_code, 0);

    // ExecSession on a terminal.
    let start = ExecSessionStart { exec: Some(exec_request(&sb_b.id, ["cat"])), tty: true, size: None };
    let mut session = within(60, a.exec_session(start)).await.expect("ExecSession");
    session.input().stdin(b"hello-session\n".to_vec()).await.expect("stdin");
    session.input().close_stdin().await.expect("close");
    let mut seen = Vec::new();
    let mut finished = None;
    while let Some(ev) = within(60, session.next_event()).await.expect("session event") {
        match ev {
            agent_client::SessionEvent::Stdout(b) => seen.extend(b),
            agent_client::SessionEvent::Finished(r) => finished = Some(r),
            _ => {}
        }
    }
    assert!(text(&seen).contains("hello-session"), "{}", text(&seen));
    assert_eq!(finished.expect("finished").exit_code, 0);

    // 100 MiB up to C and back, through A.
    let content: Vec<u8> = (0..100u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    let digest = hex(&Sha256::digest(&content));
    let up = within(300, a.upload_file(&sb_c.id, "/workspace/big", 0, &content[..])).await.expect("upload 100 MiB");
    assert_eq!(up.sha256, digest);
    let mut back = Vec::new();
    let down = within(300, a.download_file(&sb_c.id, "/workspace/big", &mut back)).await.expect("download 100 MiB");
    assert_eq!((down.sha256.as_str(), back.len()), (digest.as_str(), content.len()));
    drop((content, back));

    // Snapshot, rollback and fork of B's sandbox, through A: the fork lands on B.
    let snap = within(120, a.snapshot(&sb_b.id, "s1")).await.expect("snapshot");
    assert!(snap.snapshot_id.ends_with("_node-b"), "{}", snap.snapshot_id);
    sh_ok(&a, &sb_b.id, "echo later > /workspace/later").await;
    within(120, a.rollback(&sb_b.id, &snap.snapshot_id)).await.expect("rollback");
    assert_eq!(sh_ok(&a, &sb_b.id, "ls /workspace/later 2>/dev/null || echo gone").await, "gone\n");
    let mut fork = process_sandbox("minimal");
    fork.image = String::new();
    fork.from_snapshot_id = snap.snapshot_id.clone();
    let forked = within(120, a.create(fork)).await.expect("fork");
    assert_eq!(forked.node, "node-b", "a fork is made where its snapshot is");

    // Team B's sandbox takes the last room; one more create finds none and says where.
    let theirs = within(120, b.create(labelled(99))).await.expect("team-b create");
    let err = within(120, a.create(labelled(100))).await.expect_err("the fleet is full");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    for n in NODES {
        assert!(err.to_string().contains(n), "the refusal names every node: {err}");
    }

    // Lists fan out, per tenant.
    let list_a = within(60, a.raw().list_sandboxes(sandbox_tests::proto::ListSandboxesRequest::default())).await.expect("list").into_inner();
    assert!(list_a.unreachable_nodes.is_empty(), "{:?}", list_a.unreachable_nodes);
    assert_eq!(list_a.sandboxes.len(), mine.len() + 1, "team-a sees its own on every node");
    assert!(!list_a.sandboxes.iter().any(|s| s.id == theirs.id));
    let list_b = within(60, b.list(HashMap::new())).await.expect("list b");
    assert_eq!(list_b.iter().map(|s| s.id.clone()).collect::<Vec<_>>(), vec![theirs.id.clone()]);
    // Node A's page lists through the same fan-out: the tenant's sandboxes of every node, each
    // naming its node; and each node's health with its sandboxes and key metrics.
    let page = page_json(&net.addr(0), "/api/sandboxes", TOKEN_A);
    let page_list = page["sandboxes"].as_array().unwrap_or_else(|| panic!("{page}"));
    let mut page_ids: Vec<&str> = page_list.iter().filter_map(|s| s["id"].as_str()).collect();
    page_ids.sort();
    let mut grpc_ids: Vec<&str> = list_a.sandboxes.iter().map(|s| s.id.as_str()).collect();
    grpc_ids.sort();
    assert_eq!(page_ids, grpc_ids, "the page lists what ListSandboxes lists");
    assert!(page["unreachable_nodes"].as_array().is_some_and(|u| u.is_empty()), "{page}");
    for s in page_list {
        let id = s["id"].as_str().unwrap_or_default();
        assert!(s["node"].as_str().is_some_and(|n| id.ends_with(&format!("_{n}"))), "each row names its node: {s}");
    }
    let overview = page_json(&net.addr(0), "/api/overview", TOKEN_A);
    for n in overview["fleet"].as_array().expect("fleet") {
        assert!(n["status"]["sandboxes_held"].as_u64().is_some_and(|h| h >= 1), "every node holds some: {n}");
        assert!(n["status"]["metrics"].as_array().is_some_and(|m| m.iter().any(|m| m["name"] == "sandboxd_admission_pressure")), "key metrics per node: {n}");
    }

    // Tenants stay apart across nodes: another tenant's sandbox is NOT_FOUND, forwarded or not.
    for id in [&sb_c.id, &sb_b.id] {
        let e = within(60, b.get(id.clone())).await.expect_err("another tenant's");
        assert_eq!(e.code(), Code::NotFound, "{e}");
        let e = within(60, b.exec(exec_request(id, ["true"]))).await.expect_err("another tenant's");
        assert_eq!(e.code(), Code::NotFound, "{e}");
    }

    // An image imported through A reaches every node (each says so in A's progress), with the
    // same digest and its tenant's; removed through A, it is gone from all three.
    let dir = tempfile::tempdir().expect("tempdir");
    let archive = one_file_image(dir.path());
    let size = std::fs::metadata(&archive).expect("archive").len();
    let mut fleet_lines = Vec::new();
    let file = tokio::fs::File::open(&archive).await.expect("archive");
    let info = within(
        300,
        a.import_image_archive("shipped", "shipped.tar", size, file, |p| {
            if p.phase == "fleet" {
                fleet_lines.push(p.message.clone());
            }
        }),
    )
    .await
    .expect("an import through A");
    for n in ["node-b", "node-c"] {
        assert!(fleet_lines.iter().any(|l| l.starts_with(&format!("{n}: shipped")) && l.ends_with("ready")), "{n}: {fleet_lines:?}");
        let direct = sandbox_tests::fleet::client_of(&net, NODES.iter().position(|x| *x == n).unwrap(), TOKEN_A).await.expect("a node directly");
        let there = within(60, direct.get_image("shipped")).await.unwrap_or_else(|e| panic!("the image on {n}: {e}"));
        assert_eq!(there.digest, info.digest, "{n}");
        let other = sandbox_tests::fleet::client_of(&net, NODES.iter().position(|x| *x == n).unwrap(), TOKEN_B).await.expect("a node directly");
        assert_eq!(within(60, other.get_image("shipped")).await.expect_err("team-a's image").code(), Code::NotFound, "{n}: another tenant's");
    }
    // A list through A asks every node and names the nodes holding each image.
    let listed = within(60, a.list_images_fleet()).await.expect("ListImages through A");
    assert!(listed.unreachable_nodes.is_empty(), "{:?}", listed.unreachable_nodes);
    for name in ["shipped", "minimal"] {
        let i = listed.images.iter().find(|i| i.name == name).unwrap_or_else(|| panic!("{name} listed: {:?}", listed.images));
        assert_eq!(i.nodes, NODES.to_vec(), "{name} is on every node");
    }
    let theirs_images = within(60, b.list_images_fleet()).await.expect("team-b's ListImages");
    assert!(!theirs_images.images.iter().any(|i| i.name == "shipped"), "another tenant's image is not listed to team-b");
    within(120, a.remove_image("shipped")).await.expect("remove through A");
    for (i, node) in NODES.iter().enumerate() {
        let direct = sandbox_tests::fleet::client_of(&net, i, TOKEN_A).await.expect("a node directly");
        let e = within(60, direct.get_image("shipped")).await.expect_err("removed everywhere");
        assert_eq!(e.code(), Code::NotFound, "{node}: {e}");
    }

    // A node killed with SIGKILL: its sandboxes are UNAVAILABLE naming it, the others work.
    nodes[2].kill9();
    let e = within(10, a.get(&sb_c.id)).await.expect_err("node C is down");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.to_string().contains("node-c"), "names the node: {e}");
    let e = within(10, a.exec(exec_request(&sb_c.id, ["true"]))).await.expect_err("node C is down");
    assert!(e.code() == Code::Unavailable && e.to_string().contains("node-c"), "{e}");
    assert_eq!(sh_ok(&a, &sb_b.id, "echo alive").await, "alive\n");
    let partial = within(30, a.raw().list_sandboxes(sandbox_tests::proto::ListSandboxesRequest::default())).await.expect("list").into_inner();
    assert_eq!(partial.unreachable_nodes.iter().map(|n| n.node.as_str()).collect::<Vec<_>>(), vec!["node-c"], "the list names the missing node");
    assert!(partial.sandboxes.iter().all(|s| s.node != "node-c"));
    let images = within(30, a.list_images_fleet()).await.expect("ListImages with node C down");
    assert_eq!(images.unreachable_nodes.iter().map(|n| n.node.as_str()).collect::<Vec<_>>(), vec!["node-c"], "the image list names the missing node");
    let minimal = images.images.iter().find(|i| i.name == "minimal").expect("minimal listed");
    assert_eq!(minimal.nodes, vec!["node-a", "node-b"], "the nodes that answered");
    // `sbx ls` says so too, rather than showing a shorter list as if it were whole.
    let out = sandbox_tests::run_sbx(&nodes[0], &["ls"], 30).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let warned = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(warned.contains("node node-c did not answer") && warned.contains("not listed"), "{warned}");
    // The page says so too, at once: node C unreachable in its list and its health, the rest listed.
    let asked = std::time::Instant::now();
    let page = page_json(&net.addr(0), "/api/sandboxes", TOKEN_A);
    let took = asked.elapsed();
    let missing: Vec<&str> = page["unreachable_nodes"].as_array().expect("unreachable_nodes").iter().filter_map(|n| n["node"].as_str()).collect();
    assert_eq!(missing, vec!["node-c"], "{page}");
    let shown = page["sandboxes"].as_array().expect("sandboxes");
    assert!(!shown.is_empty() && shown.iter().all(|s| s["node"] != "node-c"), "{page}");
    assert!(took < std::time::Duration::from_secs(10), "the page's list waited {took:?} for a dead node");
    eprintln!("node A's page list with node C down answered in {took:?}");
    let overview = page_json(&net.addr(0), "/api/overview", TOKEN_A);
    let c = overview["fleet"].as_array().expect("fleet").iter().find(|n| n["node"] == "node-c").cloned().expect("node C still listed");
    assert_eq!(c["unreachable"], true, "{c}");
    let mut browser = tokio::task::block_in_place(sandbox_tests::browser::Browser::start).expect("chromium");
    tokio::task::block_in_place(|| {
        let mut page = browser.open(&format!("http://{}:{WEB_PORT}/#token={TOKEN_A}", net.addr(0))).expect("open node A's page");
        let t = std::time::Duration::from_secs(60);
        page.wait_for("#sandboxes p.unreachable[data-node='node-c']", "unreachable", t).expect("the list names node C unreachable");
        page.wait_for("#fleet tr[data-node='node-c']", "unreachable", t).expect("the health table marks node C");
        page.wait_for(&format!("#sandboxes tr[data-sandbox-id='{}']", sb_b.id), "node-b", t).expect("node B's sandbox is listed with its node");
    });
    drop(browser);

    // It comes back: its sandboxes are re-adopted and reachable through A again, files kept.
    within(60, nodes[2].restart()).await.expect("restarting node C");
    assert!(
        eventually(60, || async { matches!(a.get(&sb_c.id).await, Ok(s) if s.state == sandbox_tests::proto::SandboxState::Running as i32) }).await,
        "node C's sandbox is back through A"
    );
    assert_eq!(sh_ok(&a, &sb_c.id, "cat /workspace/f").await, "from-c\n");
}

/// A `docker save` archive of an image whose one layer holds `hello.txt`.
fn one_file_image(dir: &std::path::Path) -> std::path::PathBuf {
    fn member(b: &mut tar::Builder<impl std::io::Write>, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).expect("tar member");
    }
    let digest = |b: &[u8]| format!("sha256:{}", hex(&Sha256::digest(b)));
    let mut layer = tar::Builder::new(Vec::new());
    member(&mut layer, "hello.txt", b"shipped to every node\n");
    let layer = layer.into_inner().expect("layer");
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [digest(&layer)]}
    }))
    .expect("config");
    let id = digest(&config)[7..].to_string();
    let manifest = serde_json::to_vec(&serde_json::json!([{"Config": format!("{id}.json"), "RepoTags": [], "Layers": ["l0/layer.tar"]}])).expect("manifest");
    let path = dir.join("shipped.tar");
    let mut b = tar::Builder::new(std::fs::File::create(&path).expect("archive"));
    member(&mut b, "l0/layer.tar", &layer);
    member(&mut b, &format!("{id}.json"), &config);
    member(&mut b, "manifest.json", &manifest);
    b.into_inner().expect("archive");
    path
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
