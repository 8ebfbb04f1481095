//! End to end: images built or saved by Docker, imported into a real daemon through `sbx image`
//! and the API, run on all three tiers, listed, removed — and hostile archives refused with
//! nothing landing outside the image store.
//!
//! Needs what CI has: root, a Docker Engine, QEMU, the `minimal` and `debian` images (with their
//! `vm/`) and `dpkg-deb`. Nothing is pulled: the build starts `FROM sandboxd/debian`, and the
//! archive test saves an image made with `docker import` from the `minimal` rootfs.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Instant;

use agent_client::proto::{self, Isolation};
use agent_client::{exec_request, Client};
use sandbox_tests::{describe, exec, images_dir, run_sbx as sbx, sandbox_request, sh_ok, text, unique, within, Daemon};
use sha2::{Digest, Sha256};
use tonic::Code;

/// The end of a long text (stderr of a build), for assertion messages.
fn tail(bytes: &[u8]) -> String {
    let s = text(bytes);
    let start = s.len().saturating_sub(3000);
    let start = (start..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(s.len());
    s[start..].to_string()
}

fn show(out: &Output) -> String {
    format!("exit={:?} stdout={:?} stderr(tail)={}", out.status.code(), tail(&out.stdout), tail(&out.stderr))
}

/// Runs a host command, asserting success.
fn host(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd} {args:?}: {e} (CI has it; install it)"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", show(&out));
    text(&out.stdout)
}

/// Fails (never skips) when the images the suite starts from are missing.
fn require_images() {
    for f in ["debian/image.json", "debian/vm/vm.json", "minimal/image.json", ".tools/sandbox-exec"] {
        let p = images_dir().join(f);
        assert!(p.is_file(), "{} is missing: build the images (`make images image-debian exec-helper`) — CI has them", p.display());
    }
}

/// A sandbox of `image` on `tier` (bounded: a microVM boots under TCG here).
async fn sandbox(c: &Client, tier: Isolation, image: &str) -> String {
    within(300, c.create(sandbox_request(tier, image))).await.unwrap_or_else(|e| panic!("CreateSandbox {tier:?} {image}: {e}")).id
}

/// A tiny Debian package made here (no network): `/usr/bin/<prog>` printing `greeting`.
fn build_deb(dir: &Path, package: &str, prog: &str, greeting: &str) -> PathBuf {
    let root = dir.join("pkg");
    std::fs::create_dir_all(root.join("DEBIAN")).expect("mkdir");
    std::fs::create_dir_all(root.join("usr/bin")).expect("mkdir");
    std::fs::write(
        root.join("DEBIAN/control"),
        format!("Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: sandboxd tests <tests@localhost>\nDescription: test package\n"),
    )
    .expect("control");
    let bin = root.join("usr/bin").join(prog);
    std::fs::write(&bin, format!("#!/bin/sh\necho {greeting}\n")).expect("program");
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let deb = dir.join(format!("{package}.deb"));
    host("dpkg-deb", &["--root-owner-group", "--build", root.to_str().unwrap(), deb.to_str().unwrap()]);
    std::fs::remove_dir_all(&root).expect("rm pkg");
    deb
}

/// The image `name` from ListImages.
async fn listed(c: &Client, name: &str) -> Option<proto::ImageInfo> {
    c.list_images().await.expect("ListImages").into_iter().find(|i| i.name == name)
}

fn tiers(info: &proto::ImageInfo) -> Vec<Isolation> {
    info.ready_tiers.iter().filter_map(|t| Isolation::try_from(*t).ok()).collect()
}

/// Removes Docker images a test made (its tags, and the `sandboxd/<name>` ones the daemon made
/// for it) when the test ends, also when it fails half way.
struct DockerCleanup(Vec<String>);

impl Drop for DockerCleanup {
    fn drop(&mut self) {
        for repo in &self.0 {
            let tags = std::process::Command::new("docker").args(["images", "--format", "{{.Repository}}:{{.Tag}}", repo]).output();
            for tag in tags.map(|o| text(&o.stdout)).unwrap_or_default().lines() {
                let _ = std::process::Command::new("docker").args(["rmi", tag]).output();
            }
        }
    }
}

/// The catalog key of an image the local tenant (root on the UNIX socket) imported: its name
/// and the tenant's tag (`sandboxd::images::owner`), which also names its directory.
fn local_key(name: &str) -> String {
    let tag: String = Sha256::digest(b"local")[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{name}~{tag}")
}

/// The Docker repository the container tier gives a catalog key Docker cannot take as it is
/// (`sandboxd/image-<FNV-1a 64 of the key>`).
fn docker_repo_of_key(key: &str) -> String {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("sandboxd/image-{h:016x}")
}

/// Docker image tags of repository `repo`.
fn docker_tags(repo: &str) -> Vec<String> {
    host("docker", &["images", "--format", "{{.Repository}}:{{.Tag}}", repo]).lines().map(str::to_string).collect()
}

/// (a) + (c) + (d): a Dockerfile `FROM sandboxd/debian` that installs a package built here runs
/// on every tier; it is listed with its digest and tiers; removal is refused while it is used.
#[tokio::test(flavor = "multi_thread")]
async fn a_built_image_runs_its_package_on_every_tier_and_is_removed_when_unused() {
    require_images();
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let c = daemon.client().await.expect("client");
    let name = unique("hello-deb");
    let _cleanup = DockerCleanup(vec![docker_repo_of_key(&local_key(&name))]);
    let ctx = tempfile::tempdir().expect("tempdir");
    build_deb(ctx.path(), "sbx-hello", "sbx-hello", "hello-from-deb");
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sandboxd/debian\nCOPY sbx-hello.deb /tmp/\nRUN dpkg -i /tmp/sbx-hello.deb && rm /tmp/sbx-hello.deb\nENV GREETING=hi\nWORKDIR /srv\n",
    )
    .expect("Dockerfile");
    // Left out of the context by .dockerignore: the build would fail on a COPY of it.
    std::fs::write(ctx.path().join("junk.log"), "x").expect("junk");
    std::fs::write(ctx.path().join(".dockerignore"), "*.log\n").expect("dockerignore");

    let t0 = Instant::now();
    let out = sbx(&daemon, &["image", "build", "-t", &name, ctx.path().to_str().unwrap()], 1200).await;
    let build_secs = t0.elapsed().as_secs_f64();
    assert!(out.status.success(), "sbx image build: {}", show(&out));
    assert_eq!(text(&out.stdout), format!("{name}\n"));
    let log = text(&out.stderr);
    for expected in [
        "Step 1/",
        "FROM sandboxd/debian: the catalog image debian, as Docker image",
        ": FROM sha256:",
        "Setting up sbx-hello",
        "[layers]",
        "[process]",
        "[container] Docker image",
        "[microvm] base disk",
        "[done]",
    ] {
        assert!(log.contains(expected), "the build's stderr lacks {expected:?}: {}", tail(&out.stderr));
    }
    eprintln!(
        "MEASURED build of {name} (FROM sandboxd/debian + a .deb) end to end: {build_secs:.1} s; phases:\n{}",
        log.lines().filter(|l| l.starts_with('[')).collect::<Vec<_>>().join("\n")
    );
    assert!(docker_tags("sandboxd-build").is_empty(), "the intermediate build tag is removed: {:?}", docker_tags("sandboxd-build"));

    let info = listed(&c, &name).await.expect("the built image is listed");
    assert!(info.digest.starts_with("sha256:") && info.digest.len() == 71, "{info:?}");
    assert_eq!(tiers(&info), [Isolation::Process, Isolation::Container, Isolation::Microvm], "{info:?}");
    assert!(info.imported && info.size_bytes > 100 << 20 && info.source == format!("build:{name}"), "{info:?}");
    assert_eq!((info.workdir.as_str(), info.env.get("GREETING").map(String::as_str)), ("/srv", Some("hi")), "{info:?}");
    // The same in `sbx image ls`.
    let out = sbx(&daemon, &["image", "ls"], 60).await;
    let row = text(&out.stdout).lines().find(|l| l.starts_with(&name)).map(str::to_string).unwrap_or_default();
    assert!(row.contains(&info.digest[7..19]) && row.contains("process,container,microvm"), "sbx image ls: {}", show(&out));

    // The package's program on every tier; the image's env and WorkingDir; LANG.
    let mut ids = Vec::new();
    for tier in [Isolation::Process, Isolation::Container, Isolation::Microvm] {
        let t = Instant::now();
        let id = sandbox(&c, tier, &name).await;
        let out = sh_ok(&c, &id, "sbx-hello; echo $GREETING $LANG; pwd; test -x /usr/bin/python3 && echo debian").await;
        assert_eq!(out, "hello-from-deb\nhi C.UTF-8\n/srv\ndebian\n", "{tier:?}");
        eprintln!("MEASURED {tier:?} sandbox of the built image: create + first exec {:.1} s", t.elapsed().as_secs_f64());
        ids.push(id);
    }
    // A request's env wins over the image's.
    let r = exec(&c, proto::ExecRequest { env: [("GREETING".to_string(), "req".to_string())].into(), ..exec_request(&ids[0], ["sh", "-c", "echo $GREETING"]) })
        .await;
    assert_eq!(text(&r.stdout), "req\n", "{}", describe(&r));

    // (d) In use: refused, naming the users.
    let snap = c.snapshot(&ids[0], "s").await.expect("snapshot").snapshot_id;
    let err = c.remove_image(&name).await.expect_err("in use");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.to_string().contains(&ids[0]) && err.to_string().contains(&snap), "names its users: {err}");
    for id in &ids {
        c.destroy(id.as_str()).await.expect("destroy");
    }
    let err = c.remove_image(&name).await.expect_err("a snapshot still uses it");
    assert!(err.to_string().contains(&snap) && !err.to_string().contains(&ids[0]), "{err}");
    c.delete_snapshot(&snap).await.expect("delete snapshot");
    let out = sbx(&daemon, &["image", "rm", &name], 120).await;
    assert!(out.status.success(), "sbx image rm: {}", show(&out));
    assert!(listed(&c, &name).await.is_none());
    let key = local_key(&name);
    assert!(daemon.state_dir().join("images").read_dir().expect("store").next().is_none(), "its files are gone");
    let repo = docker_repo_of_key(&key);
    assert!(docker_tags(&repo).is_empty(), "its Docker image is gone: {:?}", docker_tags(&repo));
    let bases: Vec<_> = std::fs::read_dir(daemon.state_dir().join("microvm/bases"))
        .expect("bases")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&format!("{key}-")))
        .collect();
    assert!(bases.is_empty(), "its microVM base disk is gone: {bases:?}");
    let err = c.create(sandbox_request(Isolation::Process, &name)).await.expect_err("removed");
    assert_eq!(err.code(), Code::NotFound, "{err}");
}

/// (b) + (c) + (e): a `docker save` archive imports with `sbx image import ./x.tar` and runs;
/// the same image straight from Docker (`docker:`) is the same digest; unknown names are
/// NOT_FOUND with the list and no host path; script-built images are not removable.
#[tokio::test(flavor = "multi_thread")]
async fn a_docker_save_archive_and_a_docker_image_import_and_run() {
    require_images();
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let c = daemon.client().await.expect("client");
    let tag = format!("{}:v1", unique("sbx-test-saved"));
    let repo = tag.split(':').next().unwrap().to_string();
    let _cleanup = DockerCleanup(vec![repo.clone(), docker_repo_of_key(&local_key(&repo)), docker_repo_of_key(&local_key(&format!("{repo}-d")))]);
    let dir = tempfile::tempdir().expect("tempdir");
    // A Docker image of the minimal rootfs with a config of its own.
    let rootfs_tar = dir.path().join("rootfs.tar");
    host("tar", &["-C", images_dir().join("minimal/rootfs").to_str().unwrap(), "-cf", rootfs_tar.to_str().unwrap(), "."]);
    host(
        "docker",
        &[
            "import",
            "--change",
            "ENV SAVED=yes",
            "--change",
            "WORKDIR /opt/app",
            "--change",
            "USER nobody",
            "--change",
            "CMD [\"sh\"]",
            rootfs_tar.to_str().unwrap(),
            &tag,
        ],
    );
    let archive = dir.path().join("x.tar");
    host("docker", &["save", "-o", archive.to_str().unwrap(), &tag]);

    let t0 = Instant::now();
    let out = sbx(&daemon, &["image", "import", archive.to_str().unwrap()], 600).await;
    assert!(out.status.success(), "sbx image import: {}", show(&out));
    let name = text(&out.stdout).trim().to_string();
    assert_eq!(name, repo, "named after the archive's RepoTags");
    assert!(text(&out.stderr).contains("[receive]") && text(&out.stderr).contains("[layers] layer 1/1"), "{}", show(&out));
    eprintln!("MEASURED import of a docker save of minimal: {:.1} s:\n{}", t0.elapsed().as_secs_f64(), text(&out.stderr));

    let info = c.get_image(&name).await.expect("GetImage");
    let docker_id = host("docker", &["inspect", "--format", "{{.Id}}", &tag]).trim().to_string();
    assert_eq!(info.digest, docker_id, "the digest is Docker's image ID");
    assert_eq!((info.user.as_str(), info.cmd.clone()), ("nobody", vec!["sh".to_string()]), "{info:?}");
    assert!(tiers(&info).contains(&Isolation::Process) && tiers(&info).contains(&Isolation::Container), "{info:?}");
    // The imported rootfs lies on the sealed state dir, mounted noexec; the process tier's
    // overlay over it still runs its programs (the exec check is the overlay mount's).
    let store = daemon.state_dir().join("images").join(local_key(&name)).join("rootfs");
    let flags = nix::sys::statvfs::statvfs(&store).expect("statvfs").flags();
    assert!(flags.contains(nix::sys::statvfs::FsFlags::ST_NOEXEC) && flags.contains(nix::sys::statvfs::FsFlags::ST_NOSUID), "{flags:?}");
    for tier in [Isolation::Process, Isolation::Container] {
        let id = sandbox(&c, tier, &name).await;
        // The image's USER runs the execs (the sandbox says so), its env and WorkingDir apply.
        assert_eq!(c.get(&id).await.expect("get").user, "nobody", "{tier:?}");
        assert_eq!(sh_ok(&c, &id, "echo $SAVED; pwd; busybox | head -1 | cut -d' ' -f1; id -u").await, "yes\n/opt/app\nBusyBox\n65534\n", "{tier:?}");
        c.destroy(id.as_str()).await.expect("destroy");
    }
    // Importing the same archive again under the same name: nothing to do, and it says so.
    let out = sbx(&daemon, &["image", "import", archive.to_str().unwrap()], 300).await;
    assert!(out.status.success() && text(&out.stderr).contains("nothing to do"), "{}", show(&out));
    // The same image from Docker directly.
    let out = sbx(&daemon, &["--json", "image", "import", &format!("docker:{tag}"), "--name", &format!("{name}-d")], 600).await;
    assert!(out.status.success(), "sbx image import docker:: {}", show(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!((v["digest"].as_str(), v["source"].as_str()), (Some(docker_id.as_str()), Some(format!("docker:{tag}").as_str())));
    let err = c.import_docker_image("sbx-no-such-image:never", "", |_| {}).await.expect_err("not in Docker");
    assert_eq!(err.code(), Code::NotFound, "{err}");

    // (c) Both listed, with digests and ready tiers, next to the script-built ones.
    let all = c.list_images().await.expect("ListImages");
    let names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
    for n in ["minimal", "debian", name.as_str(), &format!("{name}-d")] {
        assert!(names.contains(&n), "{n} listed: {names:?}");
    }
    assert!(all.iter().all(|i| i.digest.starts_with("sha256:") && !i.ready_tiers.is_empty()), "{all:?}");
    assert!(all.iter().any(|i| i.name == "minimal" && !i.imported), "{all:?}");

    // (e) Unknown images: NOT_FOUND naming them and what exists, never a host path.
    let check = |e: agent_client::Error, what: &str| {
        assert_eq!(e.code(), Code::NotFound, "{what}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("\"no-such-image\"") && m.contains("available: ") && m.contains("debian") && m.contains("minimal") && m.contains(&name),
            "{what}: {m}"
        );
        assert!(!m.contains('/'), "{what}: a host path in {m}");
    };
    check(c.create(sandbox_request(Isolation::Process, "no-such-image")).await.expect_err("create"), "CreateSandbox");
    check(c.create(sandbox_request(Isolation::Container, "no-such-image")).await.expect_err("create"), "CreateSandbox CONTAINER");
    check(c.get_image("no-such-image").await.expect_err("get"), "GetImage");
    check(c.remove_image("no-such-image").await.expect_err("rm"), "RemoveImage");
    let out = sbx(&daemon, &["image", "rm", "minimal"], 60).await;
    assert!(!out.status.success() && text(&out.stderr).contains("FAILED_PRECONDITION"), "script-built images are the operator's: {}", show(&out));

    for n in [name.clone(), format!("{name}-d")] {
        c.remove_image(&n).await.expect("remove");
        assert!(docker_tags(&format!("sandboxd/{n}")).is_empty(), "RemoveImage removes the Docker image of {n}");
    }
}

/// One raw layer entry: name, type, link target, data.
type Entry<'a> = (&'a str, tar::EntryType, &'a str, &'a [u8]);

/// A `docker save`-shaped archive of `layers` (each a list of raw tar entries), written raw so
/// hostile names survive.
fn hostile_archive(dir: &Path, layers: &[Vec<Entry<'_>>]) -> PathBuf {
    let mut layer_tars = Vec::new();
    for entries in layers {
        let mut out = Vec::new();
        for (name, kind, link, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
            h.as_gnu_mut().unwrap().linkname[..link.len()].copy_from_slice(link.as_bytes());
            h.set_entry_type(*kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.extend_from_slice(&[0; 1024]);
        layer_tars.push(out);
    }
    let digest = |b: &[u8]| format!("sha256:{}", Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect::<String>());
    let config =
        serde_json::to_vec(&serde_json::json!({"rootfs": {"type": "layers", "diff_ids": layer_tars.iter().map(|l| digest(l)).collect::<Vec<_>>()}})).unwrap();
    let id = digest(&config)[7..].to_string();
    let names: Vec<String> = (0..layer_tars.len()).map(|i| format!("l{i}/layer.tar")).collect();
    let manifest = serde_json::to_vec(&serde_json::json!([{"Config": format!("{id}.json"), "RepoTags": ["evil:1"], "Layers": names}])).unwrap();
    let path = dir.join(format!("evil-{}.tar", layers.len()));
    let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
    };
    for (n, l) in names.iter().zip(&layer_tars) {
        add(n, l);
    }
    add(&format!("{id}.json"), &config);
    add("manifest.json", &manifest);
    b.into_inner().unwrap().flush().unwrap();
    path
}

/// (f) Hostile archives: path traversal, a symlink planted by one layer and written through by
/// the next, a hard link out: refused as INVALID_ARGUMENT naming the entry, nothing outside the
/// store, no image, no staging dir left. A cut upload is ABORTED, a wrong checksum DATA_LOSS.
#[tokio::test(flavor = "multi_thread")]
async fn hostile_archives_are_refused_and_nothing_lands_outside() {
    require_images();
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let c = daemon.client().await.expect("client");
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let victim = target.join("victim");
    std::fs::write(&victim, "host").unwrap();
    let marker = unique("pwned");
    // From the staging rootfs, enough `..` to reach `/`, then /tmp.
    let escape_rel = format!("../../../../../../../../../../../../tmp/{marker}");
    let abs_link = target.to_str().unwrap().to_string();
    let planted_through = format!("link/{marker}");
    let cases: Vec<(&str, Vec<Vec<Entry<'_>>>)> = vec![
        ("dot-dot", vec![vec![(escape_rel.as_str(), tar::EntryType::Regular, "", b"x".as_slice())]]),
        (
            "symlink then a file through it, across layers",
            vec![
                vec![("link", tar::EntryType::Symlink, abs_link.as_str(), b"".as_slice())],
                vec![(planted_through.as_str(), tar::EntryType::Regular, "", b"x".as_slice())],
            ],
        ),
        ("hard link out", vec![vec![("h", tar::EntryType::Link, "../../../../../../etc/shadow", b"".as_slice())]]),
        ("absolute name", vec![vec![("/etc/cron.d/evil", tar::EntryType::Regular, "", b"x".as_slice())]]),
    ];
    for (what, layers) in cases {
        let path = hostile_archive(dir.path(), &layers);
        let file = tokio::fs::File::open(&path).await.unwrap();
        let size = file.metadata().await.unwrap().len();
        let err = within(120, c.import_image_archive("evil", "evil.tar", size, file, |_| {})).await.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err}");
        assert!(err.to_string().contains("refused"), "{what}: {err}");
    }
    assert!(!Path::new("/tmp").join(&marker).exists(), "nothing escaped through `..`");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host");
    assert_eq!(std::fs::read_dir(&target).unwrap().count(), 1, "nothing was written next to the victim");
    assert!(!Path::new("/etc/cron.d/evil").exists());
    let store: Vec<String> =
        std::fs::read_dir(daemon.state_dir().join("images")).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(store.is_empty(), "no image, staging dir or upload left: {store:?}");
    assert!(listed(&c, "evil").await.is_none());

    // A cut upload (no digest at the end) and a wrong digest, through the raw API.
    let header = proto::ImportImageRequest {
        item: Some(proto::import_image_request::Item::Header(proto::ImportImageHeader {
            name: "cut".into(),
            source: Some(proto::import_image_header::Source::Archive(proto::ImageArchive { size_bytes: 3, file_name: "cut.tar".into() })),
            shared: false,
        })),
    };
    let chunk = proto::ImportImageRequest { item: Some(proto::import_image_request::Item::Chunk(b"abc".to_vec())) };
    let wrong = proto::ImportImageRequest { item: Some(proto::import_image_request::Item::Sha256("0".repeat(64))) };
    for (messages, code) in [(vec![header.clone(), chunk.clone()], Code::Aborted), (vec![header, chunk, wrong], Code::DataLoss)] {
        let mut stream = c.raw().import_image(tokio_stream::iter(messages)).await.expect("call").into_inner();
        let status = loop {
            match within(60, stream.message()).await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the import ended without an error"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), code, "{status:?}");
    }
    let audit = std::fs::read_to_string(daemon.state_dir().join("audit.jsonl")).unwrap();
    assert!(audit.lines().filter(|l| l.contains("\"rpc\":\"ImportImage\"")).count() >= 6, "every import is audited");
    assert!(audit.contains("\"status\":\"DATA_LOSS\"") && audit.contains("\"status\":\"INVALID_ARGUMENT\""), "with how it ended");
}

/// The image store's budget (`images.max_store_bytes`): an upload that says it is too long is
/// refused before a byte is written, one that does not say stops once it passes the budget, and
/// layers that would pass it stop while they are applied. Each is RESOURCE_EXHAUSTED naming the
/// key, leaves nothing in the store, and the daemon goes on; an import that fits still works.
#[tokio::test(flavor = "multi_thread")]
async fn the_image_store_keeps_to_its_budget() {
    require_images();
    let daemon = Daemon::start_with_config("[images]\nmax_store_bytes = 5242880\n").await.expect("starting sandboxd");
    let c = daemon.client().await.expect("client");
    let dir = tempfile::tempdir().expect("tempdir");
    let archive = |sub: &str, bytes: usize| {
        let d = dir.path().join(sub);
        std::fs::create_dir(&d).unwrap();
        let data = vec![7u8; bytes];
        hostile_archive(&d, &[vec![("data.bin", tar::EntryType::Regular, "", data.as_slice())]])
    };
    let over = archive("over", 6 << 20);
    let half = archive("half", 3 << 20);
    let fits = archive("fits", 64 << 10);
    let store = daemon.state_dir().join("images");
    let left = || -> Vec<String> { std::fs::read_dir(&store).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect() };

    let cases = [
        ("an upload that says it is 6 MiB", &over, true, "images.max_store_bytes"),
        ("an upload of 6 MiB that does not say", &over, false, "images.max_store_bytes"),
        ("3 MiB uploaded, then 3 MiB of layers", &half, true, "the layers of"),
    ];
    for (what, path, say_size, needle) in cases {
        let file = tokio::fs::File::open(path).await.unwrap();
        let size = if say_size { file.metadata().await.unwrap().len() } else { 0 };
        let mut phases = Vec::new();
        let err =
            within(120, c.import_image_archive("big", "big.tar", size, file, |p| phases.push((p.phase.clone(), p.message.clone())))).await.expect_err(what);
        assert_eq!(err.code(), Code::ResourceExhausted, "{what}: {err}");
        let m = err.to_string();
        assert!(m.contains(needle) && m.contains("sbx image rm") && !m.contains(&store.display().to_string()), "{what}: {m}");
        assert!(left().is_empty(), "{what}: no upload or staging dir left: {:?}", left());
        if !say_size {
            // Receive progress is reported by time, so the list may be empty; what proves the
            // upload was stopped part-way is that it never reported the upload whole ("… received
            // in N ms") nor any phase after it.
            assert!(
                phases.iter().all(|(phase, message)| phase == "receive" && !message.contains("received in")),
                "{what}: stopped while receiving: {phases:?}"
            );
        }
    }
    assert!(listed(&c, "big").await.is_none());

    // What fits is imported, and the budget counts it.
    let file = tokio::fs::File::open(&fits).await.unwrap();
    let size = file.metadata().await.unwrap().len();
    let info = within(300, c.import_image_archive("fits", "fits.tar", size, file, |_| {})).await.expect("an image that fits");
    assert!(tiers(&info).contains(&Isolation::Process), "{info:?}");
    c.remove_image("fits").await.expect("remove");
    assert!(left().is_empty(), "removed: {:?}", left());
}
