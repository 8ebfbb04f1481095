//! The stand-in's image calls: a fixed catalog, and imports/builds that check their upload's
//! sha256 the way sandboxd does (ABORTED without it, DATA_LOSS when it differs) and answer with
//! progress and a `done` event. Tests of `sbx image …` and the client's image methods.

use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::*;

pub type ProgressStream = ReceiverStream<Result<ImageProgress, Status>>;

fn info(name: &str, imported: bool) -> ImageInfo {
    ImageInfo {
        name: name.into(),
        digest: format!("sha256:{}", "ab".repeat(32)),
        size_bytes: 3 << 20,
        source: if imported {
            "archive:x.tar".into()
        } else {
            "busybox".into()
        },
        ready_tiers: vec![Isolation::Process as i32, Isolation::Container as i32],
        imported,
        env: [("LANG".to_string(), "C.UTF-8".to_string())].into(),
        ..Default::default()
    }
}

pub fn list() -> ListImagesResponse {
    ListImagesResponse {
        images: vec![info("minimal", false), info("py", true)],
        unreachable_nodes: Vec::new(),
    }
}

pub fn get(name: &str) -> Result<ImageInfo, Status> {
    match name {
        "minimal" => Ok(info("minimal", false)),
        "py" => Ok(info("py", true)),
        _ => Err(Status::not_found(format!(
            "image {name:?} not found; available: minimal, py"
        ))),
    }
}

pub fn remove(name: &str) -> Result<RemoveImageResponse, Status> {
    match name {
        "py" => Ok(RemoveImageResponse {
            freed_bytes: 3 << 20,
        }),
        "minimal" => Err(Status::failed_precondition(
            "image \"minimal\" is in use by sandbox sb-1",
        )),
        _ => Err(Status::not_found(format!(
            "image {name:?} not found; available: minimal, py"
        ))),
    }
}

/// Chunks until the end, then the digest check; the byte count.
async fn received<M>(
    stream: &mut Streaming<M>,
    split: impl Fn(M) -> (Option<Vec<u8>>, Option<String>),
) -> Result<u64, Status> {
    let mut hasher = Sha256::new();
    let mut n = 0u64;
    let mut expected = None;
    while let Some(m) = stream.message().await? {
        let (chunk, sum) = split(m);
        if let Some(c) = chunk {
            hasher.update(&c);
            n += c.len() as u64;
        }
        if sum.is_some() {
            expected = sum;
        }
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    match expected {
        None => Err(Status::aborted("upload without its sha256")),
        Some(e) if e != digest => Err(Status::data_loss("sha256 mismatch")),
        Some(_) => Ok(n),
    }
}

fn events(list: Vec<ImageProgress>) -> ProgressStream {
    let (tx, rx) = mpsc::channel(list.len().max(1));
    for e in list {
        let _ = tx.try_send(Ok(e));
    }
    ReceiverStream::new(rx)
}

pub async fn import(mut stream: Streaming<ImportImageRequest>) -> Result<ProgressStream, Status> {
    use import_image_header::Source;
    use import_image_request::Item;
    let Some(ImportImageRequest {
        item: Some(Item::Header(header)),
    }) = stream.message().await?
    else {
        return Err(Status::invalid_argument("header first"));
    };
    let (name, source, bytes) = match header.source {
        Some(Source::DockerImage(r)) => {
            let name = if header.name.is_empty() {
                r.split(':').next().unwrap_or_default().to_string()
            } else {
                header.name
            };
            (name, format!("docker:{r}"), 0)
        }
        Some(Source::Archive(a)) => {
            let n = received(&mut stream, |m| match m.item {
                Some(Item::Chunk(c)) => (Some(c), None),
                Some(Item::Sha256(s)) => (None, Some(s)),
                _ => (None, None),
            })
            .await?;
            let name = if header.name.is_empty() {
                a.file_name.trim_end_matches(".tar").to_string()
            } else {
                header.name
            };
            (name, format!("archive:{}", a.file_name), n)
        }
        None => return Err(Status::invalid_argument("no source")),
    };
    let mut done = info(&name, true);
    done.source = source;
    done.size_bytes = bytes;
    Ok(events(vec![
        ImageProgress {
            phase: "receive".into(),
            message: format!("{bytes} bytes received"),
            bytes,
            ..Default::default()
        },
        ImageProgress {
            phase: "done".into(),
            message: "ready".into(),
            done: Some(done),
            ..Default::default()
        },
    ]))
}

pub async fn build(mut stream: Streaming<BuildImageRequest>) -> Result<ProgressStream, Status> {
    use build_image_request::Item;
    let Some(BuildImageRequest {
        item: Some(Item::Header(header)),
    }) = stream.message().await?
    else {
        return Err(Status::invalid_argument("header first"));
    };
    let n = received(&mut stream, |m| match m.item {
        Some(Item::Chunk(c)) => (Some(c), None),
        Some(Item::Sha256(s)) => (None, Some(s)),
        _ => (None, None),
    })
    .await?;
    let mut done = info(&header.name, true);
    done.source = format!("build:{}", header.name);
    done.size_bytes = n;
    Ok(events(vec![
        ImageProgress {
            phase: "build".into(),
            message: format!(
                "Step 1/1 : FROM sandboxd/minimal ({} bytes of context, {})",
                n, header.dockerfile
            ),
            ..Default::default()
        },
        ImageProgress {
            phase: "done".into(),
            message: "ready".into(),
            done: Some(done),
            ..Default::default()
        },
    ]))
}

#[tokio::test]
async fn sbx_image_ls_get_rm() {
    let daemon = Daemon::start().await;
    let out = daemon.sbx(&["image", "ls"], b"").await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.starts_with("NAME"), "{table}");
    assert!(
        table.contains("py")
            && table.contains("abababababab")
            && table.contains("process,container"),
        "{table}"
    );
    let out = daemon.sbx(&["--json", "image", "get", "py"], b"").await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["imported"], serde_json::json!(true));
    assert_eq!(v["ready_tiers"][0], serde_json::json!("ISOLATION_PROCESS"));
    let out = daemon.sbx(&["image", "rm", "minimal"], b"").await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("FAILED_PRECONDITION"),
        "{}",
        text(&out.stderr)
    );
    let out = daemon.sbx(&["image", "rm", "nope"], b"").await;
    assert!(
        text(&out.stderr).contains("available: minimal, py"),
        "{}",
        text(&out.stderr)
    );
    assert!(daemon
        .sbx(&["image", "rm", "py"], b"")
        .await
        .status
        .success());
}

#[tokio::test]
async fn sbx_image_import_and_build_stream_with_their_digest() {
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tar = dir.path().join("myimg.tar");
    std::fs::write(&tar, vec![7u8; 3 << 20]).expect("write");
    let out = daemon
        .sbx(&["image", "import", tar.to_str().expect("utf8")], b"")
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "myimg\n",
        "named after the file by default"
    );
    assert!(
        text(&out.stderr).contains("[receive] 3145728 bytes received"),
        "{}",
        text(&out.stderr)
    );
    let out = daemon
        .sbx(
            &[
                "--json",
                "image",
                "import",
                "docker:debian:12",
                "--name",
                "deb",
            ],
            b"",
        )
        .await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (v["name"].as_str(), v["source"].as_str()),
        (Some("deb"), Some("docker:debian:12"))
    );
    let out = daemon
        .sbx(&["image", "import", "/nonexistent.tar"], b"")
        .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot open /nonexistent.tar"),
        "{}",
        text(&out.stderr)
    );

    let ctx = dir.path().join("ctx");
    std::fs::create_dir(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), "FROM sandboxd/minimal\n").expect("write");
    let out = daemon
        .sbx(
            &["image", "build", "-t", "tool", ctx.to_str().expect("utf8")],
            b"",
        )
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "tool\n");
    assert!(
        text(&out.stderr).contains("Step 1/1 : FROM sandboxd/minimal"),
        "{}",
        text(&out.stderr)
    );
    let out = daemon
        .sbx(
            &[
                "image",
                "build",
                "-t",
                "tool",
                dir.path().to_str().expect("utf8"),
            ],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(1), "no Dockerfile there");
}

#[tokio::test]
async fn an_import_whose_reader_fails_is_refused_not_completed() {
    struct Failing(u32);
    impl tokio::io::AsyncRead for Failing {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0 == 0 {
                return std::task::Poll::Ready(Err(std::io::Error::other("disk on fire")));
            }
            self.0 -= 1;
            buf.put_slice(&[1u8; 4096]);
            std::task::Poll::Ready(Ok(()))
        }
    }
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    let err = client
        .import_image_archive("x", "x.tar", 0, Failing(3), |_| {})
        .await
        .expect_err("reader failed");
    assert!(
        err.to_string().contains("cannot read the image upload"),
        "{err}"
    );
}
