//! The client and `sbx` against an in-process stand-in for sandboxd on a UNIX socket.
//!
//! The stand-in is not sandboxd: it fakes a few commands (`echo`, `cat`, `exit N`, `missing`,
//! `die`) and keeps files in memory, read back in 3-byte chunks so that chunked reads are
//! exercised. Its streaming RPCs (sessions, uploads, downloads, archives) are in
//! `mock_daemon/streams.rs`, their tests in `mock_daemon/transfers.rs` and
//! `mock_daemon/sessions.rs`. It checks what this crate is responsible for — transport, metadata, request
//! building, result handling and the CLI's output and exit codes — without needing root, images
//! or a real daemon. The real end-to-end tests live in the workspace's `tests/` crate.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use agent_client::proto::sandbox_service_server::{SandboxService, SandboxServiceServer};
use agent_client::proto::*;
use agent_client::{exec_request, Client};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status, Streaming};

#[path = "mock_daemon/images.rs"]
mod images;
#[path = "mock_daemon/sessions.rs"]
mod sessions;
#[path = "mock_daemon/streams.rs"]
mod streams;
#[path = "mock_daemon/transfers.rs"]
mod transfers;

#[derive(Default)]
struct State {
    files: HashMap<String, (Vec<u8>, u32)>,
    authorization: Option<String>,
    /// Session messages as they arrived (`stdin "…"`, `signal 2`, `resize 30x100`, …).
    log: Vec<String>,
    /// How each upload ended: `ok PATH`, `refused PATH: why`, `broken PATH`.
    outcomes: Vec<String>,
    /// The largest `data` piece an upload sent, and all upload bytes received.
    max_piece: usize,
    received: u64,
    /// The sandbox's filesystem for archives, and a directory of the test's that hostile
    /// archives aim at.
    root: PathBuf,
    outside: PathBuf,
}

#[derive(Clone, Default)]
struct Mock {
    state: Arc<Mutex<State>>,
}

impl Mock {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self, line: String) {
        self.state().log.push(line);
    }

    fn outcome(&self, line: String) {
        self.state().outcomes.push(line);
    }

    fn root(&self) -> PathBuf {
        self.state().root.clone()
    }

    fn outside(&self) -> PathBuf {
        self.state().outside.clone()
    }

    fn seen<T>(&self, request: &Request<T>) {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.state().authorization = auth;
    }
}

fn sandbox(id: &str) -> Result<Sandbox, Status> {
    if id != "sb-1" {
        return Err(Status::not_found(format!("sandbox {id} not found")));
    }
    Ok(Sandbox {
        id: id.into(),
        isolation: Isolation::Process as i32,
        image: "minimal".into(),
        state: SandboxState::Running as i32,
        workdir: "/workspace".into(),
        ..Default::default()
    })
}

/// Fakes running `req.argv`.
fn run(req: &ExecRequest) -> Result<ExecResult, Status> {
    sandbox(&req.sandbox_id)?;
    let mut result = ExecResult {
        exec_id: "ex-1".into(),
        sandbox_id: req.sandbox_id.clone(),
        argv: req.argv.clone(),
        status: ExecStatus::Exited as i32,
        ..Default::default()
    };
    match req.argv.first().map(String::as_str) {
        Some("echo") => result.stdout = format!("{}\n", req.argv[1..].join(" ")).into_bytes(),
        Some("cat") => result.stdout = req.stdin.clone(),
        Some("exit") => {
            result.exit_code = req.argv.get(1).and_then(|c| c.parse().ok()).unwrap_or(1)
        }
        Some("die") => {
            result.status = ExecStatus::Signaled as i32;
            result.exit_code = 137;
            result.signal = 9;
            result.stderr = b"dying\n".to_vec();
        }
        Some(other) => {
            result.status = ExecStatus::SpawnFailed as i32;
            result.exit_code = 127;
            result.error = format!("executable not found: {other}");
        }
        None => return Err(Status::invalid_argument("argv: must not be empty")),
    }
    if req.background {
        result.status = ExecStatus::Running as i32;
    }
    Ok(result)
}

#[tonic::async_trait]
impl SandboxService for Mock {
    async fn create_sandbox(
        &self,
        r: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.seen(&r);
        let req = r.into_inner();
        Ok(Response::new(Sandbox {
            labels: req.labels,
            limits: req.limits,
            ..sandbox("sb-1")?
        }))
    }
    async fn get_sandbox(
        &self,
        r: Request<GetSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.seen(&r);
        Ok(Response::new(sandbox(&r.into_inner().sandbox_id)?))
    }

    async fn get_network_log(
        &self,
        r: Request<agent_client::proto::GetNetworkLogRequest>,
    ) -> Result<Response<agent_client::proto::GetNetworkLogResponse>, Status> {
        self.seen(&r);
        Ok(Response::new(Default::default()))
    }

    async fn set_sandbox_ttl(
        &self,
        r: Request<SetSandboxTtlRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.seen(&r);
        Ok(Response::new(sandbox(&r.into_inner().sandbox_id)?))
    }
    async fn pause_sandbox(
        &self,
        r: Request<PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.seen(&r);
        let mut sb = sandbox(&r.into_inner().sandbox_id)?;
        sb.state = SandboxState::Paused as i32;
        Ok(Response::new(sb))
    }
    async fn resume_sandbox(
        &self,
        r: Request<ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        self.seen(&r);
        Ok(Response::new(sandbox(&r.into_inner().sandbox_id)?))
    }
    async fn list_sandboxes(
        &self,
        r: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        self.seen(&r);
        let matches = r.into_inner().label_selector.is_empty();
        let sandboxes = if matches {
            vec![sandbox("sb-1")?]
        } else {
            vec![]
        };
        Ok(Response::new(ListSandboxesResponse {
            sandboxes,
            ..Default::default()
        }))
    }
    async fn destroy_sandbox(
        &self,
        r: Request<DestroySandboxRequest>,
    ) -> Result<Response<DestroySandboxResponse>, Status> {
        sandbox(&r.into_inner().sandbox_id)?;
        Ok(Response::new(DestroySandboxResponse {}))
    }
    async fn exec(&self, r: Request<ExecRequest>) -> Result<Response<ExecResult>, Status> {
        self.seen(&r);
        Ok(Response::new(run(r.get_ref())?))
    }
    type ExecStreamStream = tokio_stream::Iter<std::vec::IntoIter<Result<ExecEvent, Status>>>;
    async fn exec_stream(
        &self,
        r: Request<ExecRequest>,
    ) -> Result<Response<Self::ExecStreamStream>, Status> {
        let mut result = run(r.get_ref())?;
        let event = |e| Ok(ExecEvent { event: Some(e) });
        let mut events = Vec::new();
        // Output in two chunks, to check that they are put back together in order.
        let stdout = std::mem::take(&mut result.stdout);
        let (a, b) = stdout.split_at(stdout.len() / 2);
        events.push(event(exec_event::Event::Stdout(a.to_vec())));
        events.push(event(exec_event::Event::Stdout(b.to_vec())));
        events.push(event(exec_event::Event::Stderr(std::mem::take(
            &mut result.stderr,
        ))));
        events.push(event(exec_event::Event::Result(result)));
        Ok(Response::new(tokio_stream::iter(events)))
    }
    async fn get_exec(&self, r: Request<GetExecRequest>) -> Result<Response<ExecResult>, Status> {
        let id = r.into_inner().exec_id;
        if id != "ex-1" {
            return Err(Status::not_found(format!("exec {id} not found")));
        }
        Ok(Response::new(run(&exec_request("sb-1", ["exit", "4"]))?))
    }
    async fn signal_exec(
        &self,
        _: Request<SignalExecRequest>,
    ) -> Result<Response<SignalExecResponse>, Status> {
        Ok(Response::new(SignalExecResponse {}))
    }
    async fn list_execs(
        &self,
        r: Request<ListExecsRequest>,
    ) -> Result<Response<ListExecsResponse>, Status> {
        // Two pages of one record each, like a daemon with more records than a page holds.
        let req = r.into_inner();
        sandbox(&req.sandbox_id)?;
        let (word, exec_id, next) = match req.page_token.as_str() {
            "" => ("a", "ex-1", "page-2"),
            "page-2" => ("b", "ex-2", ""),
            other => return Err(Status::invalid_argument(format!("page_token {other:?}"))),
        };
        let mut record = run(&exec_request("sb-1", ["echo", word]))?;
        record.exec_id = exec_id.into();
        if !req.include_output {
            record.stdout.clear();
        }
        Ok(Response::new(ListExecsResponse {
            execs: vec![record],
            next_page_token: next.into(),
        }))
    }
    async fn write_file(
        &self,
        r: Request<WriteFileRequest>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let req = r.into_inner();
        sandbox(&req.sandbox_id)?;
        let bytes_written = req.content.len() as u64;
        self.state().files.insert(req.path, (req.content, req.mode));
        Ok(Response::new(WriteFileResponse { bytes_written }))
    }
    async fn read_file(
        &self,
        r: Request<ReadFileRequest>,
    ) -> Result<Response<ReadFileResponse>, Status> {
        let req = r.into_inner();
        sandbox(&req.sandbox_id)?;
        let state = self.state();
        let (content, _) = state
            .files
            .get(&req.path)
            .ok_or_else(|| Status::not_found(format!("{} not found", req.path)))?;
        let start = (req.offset as usize).min(content.len());
        let end = (start + 3).min(content.len());
        let size = content.len() as u64;
        Ok(Response::new(ReadFileResponse {
            content: content[start..end].to_vec(),
            size,
            eof: end == content.len(),
        }))
    }
    async fn snapshot(
        &self,
        r: Request<SnapshotRequest>,
    ) -> Result<Response<SnapshotInfo>, Status> {
        let req = r.into_inner();
        Ok(Response::new(SnapshotInfo {
            snapshot_id: "snap-1".into(),
            sandbox_id: req.sandbox_id,
            name: req.name,
            ..Default::default()
        }))
    }
    async fn list_snapshots(
        &self,
        _: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        Ok(Response::new(ListSnapshotsResponse { snapshots: vec![] }))
    }
    async fn rollback(&self, r: Request<RollbackRequest>) -> Result<Response<Sandbox>, Status> {
        Ok(Response::new(sandbox(&r.into_inner().sandbox_id)?))
    }
    async fn delete_snapshot(
        &self,
        _: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        Err(Status::failed_precondition(
            "snapshot snap-1 is needed by sandbox sb-2",
        ))
    }
    type ExecSessionStream = streams::EventStream<ExecSessionEvent>;
    async fn exec_session(
        &self,
        r: Request<Streaming<ExecSessionRequest>>,
    ) -> Result<Response<Self::ExecSessionStream>, Status> {
        self.seen(&r);
        Ok(Response::new(
            streams::exec_session(self, r.into_inner()).await?,
        ))
    }
    async fn upload_file(
        &self,
        r: Request<Streaming<UploadRequest>>,
    ) -> Result<Response<UploadFileResponse>, Status> {
        Ok(Response::new(
            streams::upload_file(self, r.into_inner()).await?,
        ))
    }
    type DownloadFileStream = streams::EventStream<DownloadChunk>;
    async fn download_file(
        &self,
        r: Request<DownloadRequest>,
    ) -> Result<Response<Self::DownloadFileStream>, Status> {
        Ok(Response::new(
            streams::download_file(self, r.into_inner()).await?,
        ))
    }
    async fn upload_archive(
        &self,
        r: Request<Streaming<UploadRequest>>,
    ) -> Result<Response<UploadArchiveResponse>, Status> {
        Ok(Response::new(
            streams::upload_archive(self, r.into_inner()).await?,
        ))
    }
    type DownloadArchiveStream = streams::EventStream<DownloadChunk>;
    async fn download_archive(
        &self,
        r: Request<DownloadRequest>,
    ) -> Result<Response<Self::DownloadArchiveStream>, Status> {
        Ok(Response::new(
            streams::download_archive(self, r.into_inner()).await?,
        ))
    }
    async fn list_images(
        &self,
        _r: Request<ListImagesRequest>,
    ) -> Result<Response<ListImagesResponse>, Status> {
        Ok(Response::new(images::list()))
    }
    async fn get_image(&self, r: Request<GetImageRequest>) -> Result<Response<ImageInfo>, Status> {
        Ok(Response::new(images::get(&r.into_inner().name)?))
    }
    async fn remove_image(
        &self,
        r: Request<RemoveImageRequest>,
    ) -> Result<Response<RemoveImageResponse>, Status> {
        Ok(Response::new(images::remove(&r.into_inner().name)?))
    }
    type ImportImageStream = images::ProgressStream;
    async fn import_image(
        &self,
        r: Request<Streaming<ImportImageRequest>>,
    ) -> Result<Response<Self::ImportImageStream>, Status> {
        Ok(Response::new(images::import(r.into_inner()).await?))
    }
    type BuildImageStream = images::ProgressStream;
    async fn build_image(
        &self,
        r: Request<Streaming<BuildImageRequest>>,
    ) -> Result<Response<Self::BuildImageStream>, Status> {
        Ok(Response::new(images::build(r.into_inner()).await?))
    }
}

/// A running stand-in, serving until the test's runtime ends.
struct Daemon {
    mock: Mock,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    async fn start() -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("sandboxd.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind socket");
        let mock = Mock::default();
        let root = dir.path().join("fs");
        std::fs::create_dir(&root).expect("mock filesystem");
        mock.state().root = root;
        mock.state().outside = PathBuf::from("/nonexistent");
        let service = SandboxServiceServer::new(mock.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        Daemon {
            mock,
            socket,
            _dir: dir,
        }
    }

    fn addr(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Runs `sbx args…` against this daemon, feeding it `stdin`.
    async fn sbx(&self, args: &[&str], stdin: &[u8]) -> Output {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sbx"))
            .args(args)
            .env("SANDBOXD_SOCKET", self.addr())
            .env_remove("SANDBOXD_TOKEN")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sbx");
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(stdin).await.expect("write stdin");
        drop(pipe);
        child.wait_with_output().await.expect("sbx output")
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn client_round_trips() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.addr()).await.expect("connect");
    let sandbox = client
        .create(CreateSandboxRequest::default())
        .await
        .expect("create");
    assert_eq!(sandbox.id, "sb-1");
    assert_eq!(client.get("sb-1").await.expect("get").workdir, "/workspace");
    assert_eq!(client.list(HashMap::new()).await.expect("list").len(), 1);

    let err = client.get("sb-404").await.expect_err("unknown sandbox");
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert_eq!(err.to_string(), "NOT_FOUND: sandbox sb-404 not found");

    let result = client
        .exec(exec_request("sb-1", ["echo", "hello"]))
        .await
        .expect("exec");
    assert_eq!(result.stdout, b"hello\n");
    assert_eq!(result.status(), ExecStatus::Exited);

    let streamed = client
        .exec_stream(exec_request("sb-1", ["echo", "streamed"]))
        .await
        .expect("stream");
    let result = streamed.into_result().await.expect("result");
    assert_eq!(result.stdout, b"streamed\n", "chunks reassembled in order");

    let stdin = ExecRequest {
        stdin: b"piped".to_vec(),
        ..exec_request("sb-1", ["cat"])
    };
    assert_eq!(client.exec(stdin).await.expect("cat").stdout, b"piped");

    let content = b"more than three bytes".to_vec();
    assert_eq!(
        client
            .write_file("sb-1", "/w/f", content.clone(), 0o755)
            .await
            .expect("write"),
        content.len() as u64
    );
    assert_eq!(
        client
            .read_file_all("sb-1", "/w/f")
            .await
            .expect("read all"),
        content
    );
    let first = client.read_file("sb-1", "/w/f", 0, 0).await.expect("read");
    assert_eq!((first.content.as_slice(), first.eof), (&b"mor"[..], false));

    let execs = client.list_execs("sb-1", 0).await.expect("list execs");
    assert_eq!(
        execs.iter().map(|e| e.exec_id.as_str()).collect::<Vec<_>>(),
        ["ex-1", "ex-2"],
        "every page, in order"
    );
    assert!(execs.iter().all(|e| e.stdout.is_empty()), "metadata only");

    let err = client.delete_snapshot("snap-1").await.expect_err("in use");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn bare_paths_and_tokens() {
    let daemon = Daemon::start().await;
    let client = Client::connect(&daemon.socket.display().to_string())
        .await
        .expect("bare path");
    client.list(HashMap::new()).await.expect("list");
    assert_eq!(daemon.mock.state().authorization, None);
    let client = client.with_token("s3cret").expect("token");
    client.list(HashMap::new()).await.expect("list");
    assert_eq!(
        daemon.mock.state().authorization.as_deref(),
        Some("Bearer s3cret")
    );
}

#[tokio::test]
async fn sbx_exec_streams_output_and_exits_with_the_code() {
    let daemon = Daemon::start().await;
    let out = daemon
        .sbx(&["exec", "sb-1", "--", "echo", "hi", "there"], b"")
        .await;
    assert_eq!(
        (out.status.code(), text(&out.stdout)),
        (Some(0), "hi there\n".to_owned())
    );

    let out = daemon.sbx(&["exec", "sb-1", "--", "exit", "3"], b"").await;
    assert_eq!(out.status.code(), Some(3));

    let out = daemon.sbx(&["exec", "sb-1", "--", "die"], b"").await;
    assert_eq!(out.status.code(), Some(137));
    assert!(
        text(&out.stderr).contains("dying\n"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stderr).contains("killed by SIGKILL"),
        "{}",
        text(&out.stderr)
    );

    let out = daemon.sbx(&["exec", "sb-1", "--", "nosuchcmd"], b"").await;
    assert_eq!(out.status.code(), Some(127));
    assert!(
        text(&out.stderr).contains("executable not found: nosuchcmd"),
        "{}",
        text(&out.stderr)
    );

    let out = daemon
        .sbx(&["exec", "--stdin", "sb-1", "--", "cat"], b"from stdin")
        .await;
    assert_eq!(text(&out.stdout), "from stdin");

    let out = daemon
        .sbx(&["exec", "--background", "sb-1", "--", "echo"], b"")
        .await;
    assert_eq!(
        (out.status.code(), text(&out.stdout)),
        (Some(0), "ex-1\n".to_owned())
    );

    let out = daemon.sbx(&["wait", "ex-1"], b"").await;
    assert_eq!(out.status.code(), Some(4));
}

#[tokio::test]
async fn sbx_json_output() {
    let daemon = Daemon::start().await;
    let out = daemon
        .sbx(&["--json", "exec", "sb-1", "--", "exit", "5"], b"")
        .await;
    assert_eq!(out.status.code(), Some(5));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(v["status"], "EXEC_STATUS_EXITED");
    assert_eq!(v["exit_code"], 5);

    let out = daemon.sbx(&["execs", "--json", "sb-1"], b"").await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(v[1]["exec_id"], "ex-2", "sbx execs follows the pages: {v}");
    assert_eq!(v[1]["output_discarded"], false);

    let out = daemon.sbx(&["ls", "--json"], b"").await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(v[0]["id"], "sb-1");
    assert_eq!(v[0]["isolation"], "ISOLATION_PROCESS");

    let out = daemon
        .sbx(
            &["create", "--json", "--memory", "64Ki", "--label", "a=b"],
            b"",
        )
        .await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON value");
    assert_eq!(v["limits"]["memory_bytes"], 65536);
    assert_eq!(v["labels"]["a"], "b");
}

#[tokio::test]
async fn sbx_reports_status_errors() {
    let daemon = Daemon::start().await;
    let out = daemon.sbx(&["get", "sb-123"], b"").await;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "sbx: NOT_FOUND: sandbox sb-123 not found\n"
    );

    let out = daemon.sbx(&["rm", "sb-1", "sb-9"], b"").await;
    assert_eq!(out.status.code(), Some(1), "one of two failed");
    assert_eq!(
        text(&out.stderr),
        "sbx: sb-9: NOT_FOUND: sandbox sb-9 not found\n"
    );

    let out = daemon.sbx(&["ls"], b"").await;
    let table = text(&out.stdout);
    assert!(table.starts_with("ID "), "{table}");
    assert!(table.contains("sb-1   process"), "{table}");
}

#[tokio::test]
async fn sbx_cp_round_trip_keeps_the_mode() {
    use std::os::unix::fs::PermissionsExt;
    let daemon = Daemon::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let script = dir.path().join("run.sh");
    std::fs::write(&script, b"#!/bin/sh\necho hi\n").expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o750)).expect("chmod");

    let local = script.display().to_string();
    let out = daemon.sbx(&["cp", &local, "sb-1:/workspace/"], b"").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (content, mode) = daemon
        .mock
        .state()
        .files
        .get("/workspace/run.sh")
        .cloned()
        .expect("uploaded under its name");
    assert_eq!(
        (content.as_slice(), mode),
        (&b"#!/bin/sh\necho hi\n"[..], 0o750)
    );

    let out = daemon
        .sbx(&["cp", "sb-1:/workspace/run.sh", "-"], b"")
        .await;
    assert_eq!(text(&out.stdout), "#!/bin/sh\necho hi\n");

    let back = dir.path().join("back.sh");
    let out = daemon
        .sbx(
            &["cp", "sb-1:/workspace/run.sh", &back.display().to_string()],
            b"",
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read(&back).expect("downloaded"),
        b"#!/bin/sh\necho hi\n"
    );

    let out = daemon
        .sbx(&["cp", "-", "sb-1:/in.txt"], b"stdin data")
        .await;
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        daemon
            .mock
            .state()
            .files
            .get("/in.txt")
            .map(|(c, m)| (c.clone(), *m)),
        Some((b"stdin data".to_vec(), 0))
    );

    let missing = dir.path().join("never");
    let out = daemon
        .sbx(&["cp", "sb-1:/nope", &missing.display().to_string()], b"")
        .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        !Path::new(&missing).exists(),
        "no empty local file left behind"
    );
}
