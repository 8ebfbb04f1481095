//! End to end: images belong to their tenant, and builds run in a box.
//!
//! Two tenants (bearer tokens over TCP) against one real daemon: one tenant's image is
//! NOT_FOUND to the other on every image call and in CreateSandbox, both may have an image
//! named `app` with different content, and neither can replace or remove the other's. Builds:
//! an `ADD` of a loopback URL (a secret served by this test) fetches nothing and is refused, a
//! `FROM` of an image only the host's Docker has is refused, a RUN step sees its memory limit
//! and its pids bound, and two long builds of one tenant leave another tenant's import alone.
//!
//! Needs what CI has: root, a Docker Engine and the `minimal` image. Nothing is pulled.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::io::Write;
use std::path::{Path, PathBuf};

use agent_client::proto::{self, BuildImageHeader};
use agent_client::Client;
use sandbox_tests::{free_port, host_pid_of, images_dir, process_sandbox, sh_ok, text, unique, within, Daemon};
use sha2::{Digest, Sha256};
use tonic::Code;

fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The gRPC status of a client error.
fn grpc_status(e: agent_client::Error) -> tonic::Status {
    match e {
        agent_client::Error::Status(s) => s,
        other => panic!("not a gRPC status: {other}"),
    }
}

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// A daemon with tenants `alpha` and `beta` on a TCP listener, plus `extra` configuration.
async fn two_tenants(extra: &str) -> (Daemon, Client, Client) {
    let toml = format!(
        "{extra}\n[[auth.tokens]]\ntenant = \"alpha\"\nsha256 = \"{}\"\n[[auth.tokens]]\ntenant = \"beta\"\nsha256 = \"{}\"\n",
        token_hash("alpha-secret"),
        token_hash("beta-secret")
    );
    // A free port can be taken by someone else before the daemon binds it (the daemon then
    // stops at start): another port and another daemon, a few times.
    let mut last = String::new();
    for _ in 0..5 {
        let tcp = format!("tcp://127.0.0.1:{}", free_port().expect("port"));
        let daemon = Daemon::start_with(&toml, &["--listen", &tcp]).await.expect("daemon");
        match (Client::connect(&tcp).await, Client::connect(&tcp).await) {
            (Ok(a), Ok(b)) => return (daemon, a.with_token("alpha-secret").expect("token"), b.with_token("beta-secret").expect("token")),
            (Err(e), _) | (_, Err(e)) => last = format!("{e}\n{}", daemon.log()),
        }
    }
    panic!("no daemon reachable over TCP after 5 ports: {last}")
}

/// One tar member.
fn member(b: &mut tar::Builder<impl Write>, name: &str, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_cksum();
    b.append_data(&mut h, name, data).unwrap();
}

/// A `docker save` archive of the `minimal` rootfs plus `/secret` holding `secret`.
fn image_archive(dir: &Path, secret: &str) -> PathBuf {
    let base = dir.join(format!("base-{secret}.tar"));
    let out =
        std::process::Command::new("tar").args(["-C", images_dir().join("minimal/rootfs").to_str().unwrap(), "-cf", base.to_str().unwrap(), "."]).output();
    assert!(out.is_ok_and(|o| o.status.success()), "tar of the minimal rootfs");
    let base = std::fs::read(&base).unwrap();
    let mut top = tar::Builder::new(Vec::new());
    member(&mut top, "secret", secret.as_bytes());
    let top = top.into_inner().unwrap();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [digest(&base), digest(&top)]}
    }))
    .unwrap();
    let id = digest(&config)[7..].to_string();
    let manifest =
        serde_json::to_vec(&serde_json::json!([{"Config": format!("{id}.json"), "RepoTags": [], "Layers": ["l0/layer.tar", "l1/layer.tar"]}])).unwrap();
    let path = dir.join(format!("{secret}.tar"));
    let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
    member(&mut b, "l0/layer.tar", &base);
    member(&mut b, "l1/layer.tar", &top);
    member(&mut b, &format!("{id}.json"), &config);
    member(&mut b, "manifest.json", &manifest);
    b.into_inner().unwrap().flush().unwrap();
    path
}

async fn import(c: &Client, name: &str, archive: &Path) -> Result<proto::ImageInfo, tonic::Status> {
    let file = tokio::fs::File::open(archive).await.unwrap();
    let size = file.metadata().await.unwrap().len();
    within(300, c.import_image_archive(name, "image.tar", size, file, |_| {})).await.map_err(grpc_status)
}

/// A build context holding only `Dockerfile`.
fn context(dockerfile: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    member(&mut b, "Dockerfile", dockerfile.as_bytes());
    b.into_inner().unwrap()
}

async fn build(c: &Client, name: &str, dockerfile: &str, log: &mut Vec<String>) -> Result<proto::ImageInfo, tonic::Status> {
    build_with_args(c, name, dockerfile, &[], log).await
}

async fn build_with_args(c: &Client, name: &str, dockerfile: &str, args: &[(&str, &str)], log: &mut Vec<String>) -> Result<proto::ImageInfo, tonic::Status> {
    let ctx = context(dockerfile);
    let build_args = args.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let header = BuildImageHeader { name: name.into(), context_size_bytes: ctx.len() as u64, build_args, ..Default::default() };
    within(600, c.build_image(header, std::io::Cursor::new(ctx), |p| log.push(format!("[{}] {}", p.phase, p.message)))).await.map_err(grpc_status)
}

/// ImportImage of `archive` as `name` with `shared` set, through the raw API.
async fn shared_import(c: &Client, name: &str, archive: &[u8]) -> Result<proto::ImageInfo, tonic::Status> {
    use proto::import_image_request::Item;
    let header = proto::ImportImageHeader {
        name: name.into(),
        source: Some(proto::import_image_header::Source::Archive(proto::ImageArchive { size_bytes: archive.len() as u64, file_name: "shared.tar".into() })),
        shared: true,
    };
    let mut messages = vec![proto::ImportImageRequest { item: Some(Item::Header(header)) }];
    messages.extend(archive.chunks(1 << 20).map(|c| proto::ImportImageRequest { item: Some(Item::Chunk(c.to_vec())) }));
    let sum: String = Sha256::digest(archive).iter().map(|b| format!("{b:02x}")).collect();
    messages.push(proto::ImportImageRequest { item: Some(Item::Sha256(sum)) });
    let mut stream = c.raw().import_image(tokio_stream::iter(messages)).await?.into_inner();
    loop {
        match within(300, stream.message()).await? {
            Some(p) if p.done.is_some() => return Ok(p.done.unwrap()),
            Some(_) => continue,
            None => panic!("the import ended without its image"),
        }
    }
}

fn names(images: &[proto::ImageInfo]) -> Vec<String> {
    images.iter().map(|i| i.name.clone()).collect()
}

/// Tenant B never sees, uses, replaces or removes tenant A's image; both have an `app` of their
/// own with their own content; a refusal names only the caller's sandboxes; only an image
/// admin shares an image or imports from the host's Docker.
#[tokio::test(flavor = "multi_thread")]
async fn images_belong_to_their_tenant() {
    let (daemon, alpha, beta) = two_tenants("").await;
    let dir = tempfile::tempdir().unwrap();
    let (a_tar, b_tar) = (image_archive(dir.path(), "alpha-credentials"), image_archive(dir.path(), "beta-data"));

    let a_info = import(&alpha, "app", &a_tar).await.expect("alpha imports app");
    assert!(!a_info.shared && a_info.imported, "{a_info:?}");
    // Beta: not listed, NOT_FOUND to get, create from, remove; the list it is told names only
    // what it can use.
    assert!(!names(&beta.list_images().await.expect("list")).contains(&"app".to_string()));
    assert_eq!(beta.get_image("app").await.expect_err("hidden").code(), Code::NotFound);
    let err = grpc_status(beta.create(process_sandbox("app")).await.expect_err("hidden"));
    assert_eq!(err.code(), Code::NotFound, "{err}");
    let available: Vec<&str> = err.message().split("available: ").nth(1).unwrap_or_default().split(", ").collect();
    assert!(available.contains(&"minimal") && !available.contains(&"app"), "{err}");
    let err = beta.remove_image("app").await.expect_err("hidden");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    let a_sb = alpha.create(process_sandbox("app")).await.expect("alpha's sandbox").id;
    assert_eq!(sh_ok(&alpha, &a_sb, "cat /secret").await, "alpha-credentials");

    // Beta's own `app`: its content for beta, alpha's untouched.
    let b_info = import(&beta, "app", &b_tar).await.expect("beta has an app of its own");
    assert_ne!(a_info.digest, b_info.digest);
    let b_sb = beta.create(process_sandbox("app")).await.expect("beta's sandbox").id;
    assert_eq!(sh_ok(&beta, &b_sb, "cat /secret").await, "beta-data");
    assert_eq!(beta.get(&b_sb).await.expect("get").image, "app", "users see the name, never the key");
    let a_next = alpha.create(process_sandbox("app")).await.expect("alpha's next sandbox").id;
    assert_eq!(sh_ok(&alpha, &a_next, "cat /secret").await, "alpha-credentials", "beta's import replaced nothing of alpha's");
    assert_eq!(alpha.get_image("app").await.expect("alpha's").digest, a_info.digest);

    // Removal: beta's goes while alpha's is in use; alpha's refusal names only alpha's sandboxes.
    beta.destroy(&b_sb).await.expect("destroy");
    beta.remove_image("app").await.expect("beta removes its own");
    assert_eq!(beta.get_image("app").await.expect_err("gone").code(), Code::NotFound);
    let err = grpc_status(alpha.remove_image("app").await.expect_err("in use"));
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains(&a_sb) && !err.message().contains("other tenants"), "{err}");
    assert_eq!(sh_ok(&alpha, &a_next, "cat /secret").await, "alpha-credentials");

    // Sharing and `docker:` imports are for image admins: root on the UNIX socket is one.
    let shared = proto::ImportImageRequest {
        item: Some(proto::import_image_request::Item::Header(proto::ImportImageHeader {
            name: "tools".into(),
            source: Some(proto::import_image_header::Source::Archive(proto::ImageArchive { size_bytes: 0, file_name: "t.tar".into() })),
            shared: true,
        })),
    };
    let status = match beta.raw().import_image(tokio_stream::iter(vec![shared])).await {
        Err(status) => status,
        Ok(response) => {
            let mut stream = response.into_inner();
            loop {
                match within(60, stream.message()).await {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("a shared import by a tenant went through"),
                    Err(status) => break status,
                }
            }
        }
    };
    assert_eq!(status.code(), Code::PermissionDenied, "{status}");
    let err = beta.import_docker_image("busybox:latest", "bb", |_| {}).await.expect_err("not an admin");
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");
    let root = daemon.client().await.expect("root on the UNIX socket");
    let sent = shared_import(&root, "tools", &std::fs::read(&a_tar).unwrap()).await.expect("root shares an image");
    assert!(sent.shared, "{sent:?}");
    let seen = beta.get_image("tools").await.expect("a shared image is every tenant's");
    assert!(seen.shared, "{seen:?}");
    assert_eq!(beta.remove_image("tools").await.expect_err("only an admin removes a shared image").code(), Code::PermissionDenied);
}

/// Counts the connections a loopback listener receives (the secret a build must not fetch).
fn secret_server() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = hits.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = conn.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 11\r\n\r\nhost-secret");
        }
    });
    (port, hits)
}

/// Removes a Docker tag the test made, also when it fails half way.
struct DockerTag(String);

impl Drop for DockerTag {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["rmi", &self.0]).output();
    }
}

/// A build reaches nothing beyond its context: `ADD` of a loopback URL is refused before any
/// fetch (the listener sees no connection), `FROM` or `COPY --from` of an image only the host's
/// Docker has is refused, another tenant's image is NOT_FOUND; a RUN step sees its memory limit
/// and stops at its pids bound.
#[tokio::test(flavor = "multi_thread")]
async fn builds_reach_nothing_beyond_their_context_and_run_boxed() {
    let (_daemon, alpha, beta) = two_tenants("[images]\nbuild_memory_bytes = 268435456\nbuild_max_pids = 48\n").await;
    let (port, hits) = secret_server();
    let mut log = Vec::new();
    let err =
        build(&alpha, "fetch", &format!("FROM sandboxd/minimal\nRUN true\nADD http://127.0.0.1:{port}/secret /secret\n"), &mut log).await.expect_err("ADD url");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("line 3") && err.message().contains("ADD http://127.0.0.1"), "{err}");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0, "nothing fetched the loopback secret");

    // An image only the host's Docker has (an operator's private one, say).
    let private = format!("{}:secret", unique("sbx-host-only"));
    let _tag = DockerTag(private.clone());
    let rootfs = images_dir().join("minimal/rootfs");
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("tar -C {} -c . | docker import - {private}", rootfs.display())])
        .output()
        .expect("docker import");
    assert!(out.status.success(), "docker import: {}", text(&out.stderr));
    for dockerfile in [format!("FROM {private}\nRUN true\n"), format!("FROM sandboxd/minimal\nCOPY --from={private} /bin/sh /x\n")] {
        let err = build(&alpha, "private", &dockerfile, &mut log).await.expect_err("a host-only image");
        assert_eq!(err.code(), Code::InvalidArgument, "{dockerfile}: {err}");
        assert!(err.message().contains(&private), "{err}");
    }
    // Another tenant's catalog image is no base either.
    let dir = tempfile::tempdir().unwrap();
    import(&beta, "betas", &image_archive(dir.path(), "beta-only")).await.expect("beta's image");
    let err = build(&alpha, "stolen", "FROM sandboxd/betas\nRUN cat /secret\n", &mut log).await.expect_err("beta's image");
    assert_eq!(err.code(), Code::NotFound, "{err}");

    // RUN steps in the box, a container sandbox's: the memory limit is the configured one,
    // no_new_privs is set, the seccomp filter is on, the bounding set is the tier's (Docker's
    // builder gives 0, Docker's default profile and a80425fb: NET_RAW, MKNOD, AUDIT_WRITE too),
    // and a step past the pids bound cannot fork.
    let info = build(
        &alpha,
        "limits",
        "FROM sandboxd/minimal\nRUN cat /sys/fs/cgroup/memory/memory.limit_in_bytes > /limit; grep -E '^(NoNewPrivs|Seccomp|CapBnd):' /proc/self/status > /status\n",
        &mut log,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", log.join("\n")));
    assert!(!info.shared);
    assert!(log.iter().any(|l| l.contains("RUN cat /sys/fs/cgroup") && l.contains("in a container sandbox")), "{}", log.join("\n"));
    let sb = alpha.create(process_sandbox("limits")).await.expect("sandbox").id;
    assert_eq!(sh_ok(&alpha, &sb, "cat /limit").await, "268435456\n");
    assert_eq!(sh_ok(&alpha, &sb, "tr -s '\\t' ' ' < /status").await, "CapBnd: 00000000800405fb\nNoNewPrivs: 1\nSeccomp: 2\n");
    let err = build(&alpha, "bomb", "FROM sandboxd/minimal\nRUN i=0; while [ $i -lt 64 ]; do sleep 30 & i=$((i+1)); done; wait\n", &mut log)
        .await
        .expect_err("past build_max_pids");
    assert!(err.message().contains("can't fork") || err.message().contains("non-zero code"), "{err}");
    assert!(log.iter().any(|l| l.contains("can't fork")), "the step hit the bound: {}", log.join("\n"));

    // Build args reach the step that declares them and stay out of the image; ENV, WORKDIR and
    // USER of the Dockerfile hold for the steps after them; a stage copies from another.
    let info = build_with_args(
        &alpha,
        "args",
        "ARG BASE_NOTE=global\nFROM sandboxd/minimal AS one\nARG TOKEN\nARG NOTE=${TOKEN}-x\nENV KEEP=kept\nWORKDIR /work\nRUN echo \"$TOKEN $NOTE $KEEP $(pwd)\" > seen\n\
         FROM sandboxd/minimal\nARG BASE_NOTE\nCOPY --from=one /work/seen /seen\nRUN echo \"$BASE_NOTE\" >> /seen && chmod 666 /seen\nUSER 1234:1234\nRUN id -u >> /seen\n",
        &[("TOKEN", "t0k")],
        &mut log,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", log.join("\n")));
    assert!(!info.env.contains_key("TOKEN") && !info.env.contains_key("NOTE"), "build args stay out of the image: {info:?}");
    assert!(info.cmd.is_empty() && info.entrypoint.is_empty(), "no command of the step's sandbox: {info:?}");
    let sb = alpha.create(process_sandbox("args")).await.expect("sandbox").id;
    assert_eq!(sh_ok(&alpha, &sb, "cat /seen").await, "t0k t0k-x kept /work\nglobal\n1234\n");
    // Docker is left with nothing of the builds.
    let out = std::process::Command::new("docker").args(["images", "-q", "sandboxd-build"]).output().expect("docker images");
    assert_eq!(text(&out.stdout), "", "the builds' intermediate images are gone");
    // A network is refused when the daemon gives builds none.
    let ctx = context("FROM sandboxd/minimal\nRUN true\n");
    let header = BuildImageHeader {
        name: "net".into(),
        context_size_bytes: ctx.len() as u64,
        network: Some(proto::NetworkPolicy { mode: proto::NetworkMode::Open as i32, allow: vec![] }),
        ..Default::default()
    };
    let err = within(120, alpha.build_image(header, std::io::Cursor::new(ctx), |_| {})).await.map_err(grpc_status).expect_err("no network for builds");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("build_network"), "{err}");
}

/// Two builds of one tenant that never end hold only that tenant's slots: another tenant's
/// import runs meanwhile, and the tenant's own third job waits and says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenants_long_builds_do_not_block_another_tenants_import() {
    let (_daemon, alpha, beta) = two_tenants("[images]\nmax_concurrent = 3\nmax_concurrent_per_tenant = 2\nbuild_timeout_ms = 600000\n").await;
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(4);
    let mut builds = Vec::new();
    for i in 0..2 {
        let (alpha, started) = (alpha.clone(), started_tx.clone());
        builds.push(tokio::spawn(async move {
            let ctx = context("FROM sandboxd/minimal\nRUN echo sleeping; sleep 3600\n");
            let header = BuildImageHeader { name: format!("long{i}"), context_size_bytes: ctx.len() as u64, ..Default::default() };
            let mut said = false;
            let _ = alpha
                .build_image(header, std::io::Cursor::new(ctx), |p| {
                    if !said && p.message.contains("sleeping") {
                        said = true;
                        let _ = started.try_send(());
                    }
                })
                .await;
        }));
    }
    // Both builds are in their RUN step.
    for _ in 0..2 {
        within(300, started_rx.recv()).await.expect("a build reached its RUN step");
    }
    let dir = tempfile::tempdir().unwrap();
    let archive = image_archive(dir.path(), "beta-app");
    let info = import(&beta, "app", &archive).await.expect("beta's import runs while alpha's builds sleep");
    assert_eq!(info.name, "app");
    // Alpha's third job waits for one of its own slots.
    let file = tokio::fs::File::open(&archive).await.unwrap();
    let size = file.metadata().await.unwrap().len();
    let (said_tx, mut said_rx) = tokio::sync::mpsc::channel::<String>(1);
    let third = tokio::spawn({
        let alpha = alpha.clone();
        async move {
            let _ = alpha
                .import_image_archive("third", "third.tar", size, file, |p| {
                    if p.message.contains("images.max_concurrent_per_tenant") {
                        let _ = said_tx.try_send(p.message.clone());
                    }
                })
                .await;
        }
    });
    let said = within(120, said_rx.recv()).await.expect("the third job says it waits");
    assert!(said.contains("2 of your"), "{said}");
    third.abort();
    for b in builds {
        b.abort();
    }
}

/// A build past `build_timeout_ms` is RESOURCE_EXHAUSTED naming the key, what its RUN step
/// started is killed, and the tenant's slot is free again for its next build.
#[tokio::test(flavor = "multi_thread")]
async fn a_build_past_its_timeout_is_stopped_and_its_steps_killed() {
    let (_daemon, alpha, _beta) = two_tenants("[images]\nmax_concurrent_per_tenant = 1\nbuild_timeout_ms = 30000\n").await;
    let marker = format!("36{}", std::process::id() % 10_000);
    let mut log = Vec::new();
    let err = build(&alpha, "forever", &format!("FROM sandboxd/minimal\nRUN echo sleeping; sleep {marker}\n"), &mut log).await.expect_err("past the timeout");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}: {}", log.join("\n"));
    assert!(err.message().contains("build_timeout_ms"), "{err}");
    assert!(log.iter().any(|l| l.contains("sleeping")), "the RUN step never started within the timeout: {}", log.join("\n"));
    assert!(
        sandbox_tests::eventually(120, || std::future::ready(host_pid_of(&["sleep", &marker]).is_none())).await,
        "the build's RUN step (sleep {marker}) still runs after the build was stopped"
    );
    // The one slot is free: the next build runs.
    build(&alpha, "after", "FROM sandboxd/minimal\nRUN true\n", &mut log).await.unwrap_or_else(|e| panic!("{e}: {}", log.join("\n")));
}
