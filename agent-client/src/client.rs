//! [`Client`]: one async method per `SandboxService` RPC.

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::address::Address;
use crate::error::{Error, Result};
use crate::proto::sandbox_service_client::SandboxServiceClient;
use crate::proto::{
    exec_event, CreateSandboxRequest, DeleteSnapshotRequest, DestroySandboxRequest,
    DownloadRequest, ExecEvent, ExecRequest, ExecResult, ExecSessionStart, GetExecRequest,
    GetSandboxRequest, ListExecsRequest, ListExecsResponse, ListSandboxesRequest,
    ListSnapshotsRequest, PauseSandboxRequest, ReadFileRequest, ReadFileResponse,
    ResumeSandboxRequest, RollbackRequest, Sandbox, SetSandboxTtlRequest, SignalExecRequest,
    SnapshotInfo, SnapshotRequest, UploadArchiveResponse, UploadHeader, WriteFileRequest,
};
use crate::session::ExecSession;
use crate::transfer::{self, FileTransfer};

/// How long dialling the daemon may take before [`Client::connect`] gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest response accepted. tonic's default of 4 MiB is too small: an `ExecResult` carries
/// both output streams, each up to the request's `max_output_bytes`.
const MAX_DECODING_MESSAGE_SIZE: usize = 256 * 1024 * 1024;

/// The generated stub as [`Client`] uses it: a channel behind the [`AuthInterceptor`].
pub type RawClient = SandboxServiceClient<InterceptedService<Channel, AuthInterceptor>>;

/// Adds `authorization: Bearer <token>` to every request when a token is set.
#[derive(Clone, Debug, Default)]
pub struct AuthInterceptor {
    header: Option<MetadataValue<Ascii>>,
}

impl AuthInterceptor {
    /// An interceptor sending `token` as a bearer token.
    pub fn bearer(token: &str) -> Result<Self> {
        let header = format!("Bearer {token}")
            .parse()
            .map_err(|_| Error::InvalidToken)?;
        Ok(Self {
            header: Some(header),
        })
    }
}

impl Interceptor for AuthInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert("authorization", header.clone());
        }
        Ok(request)
    }
}

/// A connection to `sandboxd`.
///
/// Cheap to clone; clones share one HTTP/2 connection and may be used from many tasks at once,
/// which is why every method takes `&self`.
#[derive(Clone, Debug)]
pub struct Client {
    channel: Channel,
    inner: RawClient,
}

impl Client {
    /// Connects to the daemon at `addr` (any form [`Address::parse`] accepts), without a token.
    pub async fn connect(addr: &str) -> Result<Self> {
        Self::connect_to(&Address::parse(addr)?).await
    }

    /// Connects to an already parsed address, without a token.
    pub async fn connect_to(addr: &Address) -> Result<Self> {
        Self::connect_to_with(addr, None).await
    }

    async fn connect_to_with(addr: &Address, ca: Option<&[u8]>) -> Result<Self> {
        let connect_err = |source| Error::Connect {
            addr: addr.to_string(),
            source,
        };
        let channel = match addr {
            Address::Unix(path) => {
                // The URI is a placeholder that hyper requires; the connector ignores it and
                // dials the socket instead.
                let endpoint =
                    Endpoint::from_static("http://[::]:50051").connect_timeout(CONNECT_TIMEOUT);
                let path = path.clone();
                endpoint
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            let stream = tokio::net::UnixStream::connect(path).await?;
                            Ok::<_, std::io::Error>(TokioIo::new(stream))
                        }
                    }))
                    .await
                    .map_err(connect_err)?
            }
            Address::Http(uri) | Address::Https(uri) => {
                let mut endpoint =
                    Endpoint::from_shared(uri.clone()).map_err(|e| Error::InvalidAddress {
                        addr: uri.clone(),
                        reason: e.to_string(),
                    })?;
                if matches!(addr, Address::Https(_)) {
                    endpoint = endpoint.tls_config(tls_config(uri, ca)?).map_err(|e| {
                        Error::InvalidAddress {
                            addr: uri.clone(),
                            reason: format!("TLS: {e}"),
                        }
                    })?;
                }
                endpoint
                    .connect_timeout(CONNECT_TIMEOUT)
                    .connect()
                    .await
                    .map_err(connect_err)?
            }
        };
        Ok(Self::from_channel(channel))
    }

    /// Connects to `addr` (as [`Client::connect`]) trusting `ca_pem` (PEM certificates) as
    /// well for an `https://` address: a daemon whose `[tls]` certificate a private CA signed.
    pub async fn connect_with_ca(addr: &str, ca_pem: &[u8]) -> Result<Self> {
        Self::connect_to_with(&Address::parse(addr)?, Some(ca_pem)).await
    }

    /// The underlying gRPC channel, for the daemon's other services (e.g. `grpc.health.v1`).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Connects using the environment: the address in `SANDBOXD_SOCKET` (default
    /// [`crate::default_socket`]: `./.sandboxd/sandboxd.sock` if it exists, else
    /// `/run/sandboxd/sandboxd.sock`) and the
    /// bearer token in `SANDBOXD_TOKEN`, if set and non-empty.
    pub async fn from_env() -> Result<Self> {
        let addr = std::env::var(crate::SOCKET_ENV)
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| crate::default_socket().to_owned());
        let client = Self::connect(&addr).await?;
        match std::env::var(crate::TOKEN_ENV) {
            Ok(token) if !token.is_empty() => client.with_token(&token),
            _ => Ok(client),
        }
    }

    /// Wraps an existing channel (e.g. one built with custom [`Endpoint`] settings), without a token.
    pub fn from_channel(channel: Channel) -> Self {
        let inner = Self::stub(channel.clone(), AuthInterceptor::default());
        Self { channel, inner }
    }

    /// Sends `token` as `authorization: Bearer <token>` with every call from now on.
    pub fn with_token(mut self, token: &str) -> Result<Self> {
        self.inner = Self::stub(self.channel.clone(), AuthInterceptor::bearer(token)?);
        Ok(self)
    }

    /// The generated stub, for anything this wrapper does not cover (e.g. per-call metadata).
    pub fn raw(&self) -> RawClient {
        self.inner.clone()
    }

    fn stub(channel: Channel, auth: AuthInterceptor) -> RawClient {
        SandboxServiceClient::with_interceptor(channel, auth)
            .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
    }

    // Sandboxes.

    /// Creates a sandbox; returns once it is ready to exec.
    pub async fn create(&self, request: CreateSandboxRequest) -> Result<Sandbox> {
        Ok(self.raw().create_sandbox(request).await?.into_inner())
    }

    /// Returns the sandbox `sandbox_id`.
    pub async fn get(&self, sandbox_id: impl Into<String>) -> Result<Sandbox> {
        let request = GetSandboxRequest {
            sandbox_id: sandbox_id.into(),
        };
        Ok(self.raw().get_sandbox(request).await?.into_inner())
    }

    /// The sandbox's most recent `limit` network events (0: all the daemon keeps), oldest
    /// first; empty for a sandbox without a network.
    pub async fn network_log(
        &self,
        sandbox_id: impl Into<String>,
        limit: u32,
    ) -> Result<Vec<crate::proto::NetworkEvent>> {
        let request = crate::proto::GetNetworkLogRequest {
            sandbox_id: sandbox_id.into(),
            limit,
        };
        Ok(self
            .raw()
            .get_network_log(request)
            .await?
            .into_inner()
            .events)
    }

    /// Gives the sandbox a new lifetime from now: reaped `ttl_seconds` later, never for 0.
    pub async fn set_ttl(
        &self,
        sandbox_id: impl Into<String>,
        ttl_seconds: u32,
    ) -> Result<Sandbox> {
        let request = SetSandboxTtlRequest {
            sandbox_id: sandbox_id.into(),
            ttl_seconds,
        };
        Ok(self.raw().set_sandbox_ttl(request).await?.into_inner())
    }

    /// Pauses the sandbox: every process frozen in place (memory kept, no CPU used, its TTL
    /// stopped); execs and file calls are refused until [`Client::resume`]. Pausing a paused
    /// sandbox changes nothing.
    pub async fn pause(&self, sandbox_id: impl Into<String>) -> Result<Sandbox> {
        let request = PauseSandboxRequest {
            sandbox_id: sandbox_id.into(),
        };
        Ok(self.raw().pause_sandbox(request).await?.into_inner())
    }

    /// Resumes a paused sandbox where it stopped, with `ttl_seconds` from now as its new TTL
    /// (0 = what was left of it at the pause). Resuming a running sandbox changes nothing but
    /// the TTL when one is given.
    pub async fn resume(&self, sandbox_id: impl Into<String>, ttl_seconds: u32) -> Result<Sandbox> {
        let request = ResumeSandboxRequest {
            sandbox_id: sandbox_id.into(),
            ttl_seconds,
        };
        Ok(self.raw().resume_sandbox(request).await?.into_inner())
    }

    /// Lists the sandboxes carrying every label in `label_selector` (all of them if it is empty).
    pub async fn list(&self, label_selector: HashMap<String, String>) -> Result<Vec<Sandbox>> {
        Ok(self.list_fleet(label_selector).await?.sandboxes)
    }

    /// Lists sandboxes as [`Client::list`] does, with the fleet nodes that did not answer
    /// (`unreachable_nodes`: their sandboxes are missing from the list).
    pub async fn list_fleet(
        &self,
        label_selector: HashMap<String, String>,
    ) -> Result<crate::proto::ListSandboxesResponse> {
        let request = ListSandboxesRequest { label_selector };
        Ok(self.raw().list_sandboxes(request).await?.into_inner())
    }

    /// Destroys a sandbox: kills its processes and frees everything it held.
    pub async fn destroy(&self, sandbox_id: impl Into<String>) -> Result<()> {
        let request = DestroySandboxRequest {
            sandbox_id: sandbox_id.into(),
        };
        self.raw().destroy_sandbox(request).await?;
        Ok(())
    }

    // Execs.

    /// Runs a command and waits for it to end (or, with `background`, returns at once with
    /// status `EXEC_STATUS_RUNNING`).
    ///
    /// A command that fails inside the sandbox is not an error: inspect the result's `status`
    /// and `exit_code`.
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        Ok(self.raw().exec(request).await?.into_inner())
    }

    /// Runs a command, streaming its output as it is produced.
    ///
    /// Use [`ExecStream::into_result`] when only the end result matters.
    pub async fn exec_stream(&self, request: ExecRequest) -> Result<ExecStream> {
        let inner = self.raw().exec_stream(request).await?.into_inner();
        Ok(ExecStream { inner })
    }

    /// Returns an exec's record; with `wait`, blocks until the exec has ended.
    pub async fn get_exec(&self, exec_id: impl Into<String>, wait: bool) -> Result<ExecResult> {
        let request = GetExecRequest {
            exec_id: exec_id.into(),
            wait,
        };
        Ok(self.raw().get_exec(request).await?.into_inner())
    }

    /// Sends `signal` (a Linux signal number) to an exec's whole process tree.
    pub async fn signal_exec(&self, exec_id: impl Into<String>, signal: i32) -> Result<()> {
        let request = SignalExecRequest {
            exec_id: exec_id.into(),
            signal,
        };
        self.raw().signal_exec(request).await?;
        Ok(())
    }

    /// Lists a sandbox's exec records, oldest first (the newest `limit`; 0 means all), following
    /// the pages to the end. Records come without their output (`stdout`/`stderr` empty): use
    /// [`Client::get_exec`] for one record's output, or [`Client::list_execs_page`] with
    /// `include_output`.
    pub async fn list_execs(
        &self,
        sandbox_id: impl Into<String>,
        limit: u32,
    ) -> Result<Vec<ExecResult>> {
        let mut request = ListExecsRequest {
            sandbox_id: sandbox_id.into(),
            limit,
            ..Default::default()
        };
        let mut execs = Vec::new();
        loop {
            let page = self.list_execs_page(request.clone()).await?;
            execs.extend(page.execs);
            if page.next_page_token.is_empty() {
                return Ok(execs);
            }
            request.page_token = page.next_page_token;
        }
    }

    /// One page of a sandbox's exec records, oldest first. Pass the response's
    /// `next_page_token` as the next request's `page_token` (same `sandbox_id`) until it comes
    /// back empty; a page holds at most 100 records, and with `include_output` stops before
    /// about 4 MiB of output.
    pub async fn list_execs_page(&self, request: ListExecsRequest) -> Result<ListExecsResponse> {
        Ok(self.raw().list_execs(request).await?.into_inner())
    }

    /// Starts an interactive exec: `start.exec` says what to run (not in the background),
    /// `start.tty` whether on a terminal of `start.size`. Returns once the daemon has started
    /// the command, with its exec id; then send input and read output through the
    /// [`ExecSession`] (see [`crate::session`] for how to drive both without a deadlock).
    pub async fn exec_session(&self, start: ExecSessionStart) -> Result<ExecSession> {
        crate::session::open(&mut self.raw(), start).await
    }

    // Files.

    /// Writes `content` to a file inside the sandbox, streamed in 1 MiB pieces whatever its
    /// size, with its SHA-256 computed on the way and sent last; `mode` 0 means `0644`. The
    /// file is replaced only once all of it has arrived and matched its digest: a failed or
    /// cancelled upload leaves the old file as it was. After a reader error this returns once
    /// the daemon has refused the upload (or 10 s); when this future is dropped, the call goes
    /// on in a task of its own until the daemon has refused it, for as long as the runtime runs
    /// (see [`crate::transfer`]). Returns the bytes sent and their SHA-256, which the daemon's
    /// own answer must match ([`Error::Integrity`] otherwise).
    pub async fn upload_file(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
        mode: u32,
        content: impl AsyncRead + Unpin,
    ) -> Result<FileTransfer> {
        let header = UploadHeader {
            sandbox_id: sandbox_id.into(),
            path: path.into(),
            mode,
        };
        let mut raw = self.raw();
        transfer::upload_file(header, content, |body| async move {
            raw.upload_file(body).await
        })
        .await
    }

    /// Streams a file out of the sandbox into `out`, checking its size and SHA-256 against what
    /// the daemon announced, then flushes and shuts `out` down. Whatever the size, only one
    /// chunk is held at a time. On an error (`Error::Integrity` for a size or digest that
    /// differs) `out` has received part of the content, or a wrong one: discard it.
    pub async fn download_file(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
        out: impl AsyncWrite + Unpin,
    ) -> Result<FileTransfer> {
        let request = DownloadRequest {
            sandbox_id: sandbox_id.into(),
            path: path.into(),
        };
        let path = request.path.clone();
        let stream = self.raw().download_file(request).await?.into_inner();
        transfer::download_file(stream, &path, out).await
    }

    /// Extracts a tar stream (ustar, GNU or pax) read from `archive` into the directory `dir`
    /// inside the sandbox (created if missing). The daemon refuses entries that would leave the
    /// directory and device nodes. A failed or cancelled upload ends in a way the daemon
    /// reports as an error, never as a clean end of the archive (see [`crate::transfer`]); what
    /// it had extracted by then may stay.
    pub async fn upload_archive(
        &self,
        sandbox_id: impl Into<String>,
        dir: impl Into<String>,
        archive: impl AsyncRead + Unpin,
    ) -> Result<UploadArchiveResponse> {
        let header = UploadHeader {
            sandbox_id: sandbox_id.into(),
            path: dir.into(),
            mode: 0,
        };
        let mut raw = self.raw();
        transfer::upload_archive(header, archive, |body| async move {
            raw.upload_archive(body).await
        })
        .await
    }

    /// Streams a directory of the sandbox (or one file) as a tar stream into `out`, then
    /// flushes and shuts `out` down; returns the archive's length. The archive comes from
    /// inside the sandbox: extract it with [`crate::archive::unpack`], which refuses what
    /// would land outside the target.
    pub async fn download_archive(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
        out: impl AsyncWrite + Unpin,
    ) -> Result<u64> {
        let request = DownloadRequest {
            sandbox_id: sandbox_id.into(),
            path: path.into(),
        };
        let path = request.path.clone();
        let stream = self.raw().download_archive(request).await?.into_inner();
        transfer::download_archive(stream, &path, out).await
    }

    /// Writes a whole file inside the sandbox, creating its parents; `mode` 0 means `0644`.
    /// Returns the number of bytes written.
    pub async fn write_file(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
        content: impl Into<Vec<u8>>,
        mode: u32,
    ) -> Result<u64> {
        let request = WriteFileRequest {
            sandbox_id: sandbox_id.into(),
            path: path.into(),
            content: content.into(),
            mode,
        };
        Ok(self
            .raw()
            .write_file(request)
            .await?
            .into_inner()
            .bytes_written)
    }

    /// Reads up to `limit` bytes (0 = the daemon's maximum) of a file inside the sandbox, from
    /// `offset`.
    pub async fn read_file(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
        offset: u64,
        limit: u64,
    ) -> Result<ReadFileResponse> {
        let request = ReadFileRequest {
            sandbox_id: sandbox_id.into(),
            path: path.into(),
            offset,
            limit,
        };
        Ok(self.raw().read_file(request).await?.into_inner())
    }

    /// Reads a whole file inside the sandbox, in as many `ReadFile` calls as it takes.
    pub async fn read_file_all(
        &self,
        sandbox_id: impl Into<String>,
        path: impl Into<String>,
    ) -> Result<Vec<u8>> {
        let (sandbox_id, path) = (sandbox_id.into(), path.into());
        let mut content = Vec::new();
        loop {
            let chunk = self
                .read_file(sandbox_id.as_str(), path.as_str(), content.len() as u64, 0)
                .await?;
            let progressed = !chunk.content.is_empty();
            content.extend_from_slice(&chunk.content);
            if chunk.eof {
                return Ok(content);
            }
            // Without this a daemon that keeps answering "no data, not eof" would spin us forever.
            if !progressed {
                return Err(Error::Protocol(format!(
                    "ReadFile of {path} returned no data before end of file at offset {}",
                    content.len()
                )));
            }
        }
    }

    // Snapshots.

    /// Snapshots the sandbox's filesystem as it is now; `name` may be empty.
    pub async fn snapshot(
        &self,
        sandbox_id: impl Into<String>,
        name: impl Into<String>,
    ) -> Result<SnapshotInfo> {
        self.snapshot_with(sandbox_id, name, None).await
    }

    /// Snapshots the sandbox; `include_memory` `Some(false)` takes only the filesystem of a
    /// microVM, `None` the tier's default (memory too on the microVM tier).
    pub async fn snapshot_with(
        &self,
        sandbox_id: impl Into<String>,
        name: impl Into<String>,
        include_memory: Option<bool>,
    ) -> Result<SnapshotInfo> {
        let request = SnapshotRequest {
            sandbox_id: sandbox_id.into(),
            name: name.into(),
            include_memory,
        };
        Ok(self.raw().snapshot(request).await?.into_inner())
    }

    /// Lists a sandbox's snapshots.
    pub async fn list_snapshots(&self, sandbox_id: impl Into<String>) -> Result<Vec<SnapshotInfo>> {
        let request = ListSnapshotsRequest {
            sandbox_id: sandbox_id.into(),
        };
        Ok(self
            .raw()
            .list_snapshots(request)
            .await?
            .into_inner()
            .snapshots)
    }

    /// Puts the sandbox's filesystem back to a snapshot; its running execs end as `LOST`.
    pub async fn rollback(
        &self,
        sandbox_id: impl Into<String>,
        snapshot_id: impl Into<String>,
    ) -> Result<Sandbox> {
        let request = RollbackRequest {
            sandbox_id: sandbox_id.into(),
            snapshot_id: snapshot_id.into(),
        };
        Ok(self.raw().rollback(request).await?.into_inner())
    }

    /// Deletes a snapshot (`FAILED_PRECONDITION` while a sandbox forked from it needs it).
    pub async fn delete_snapshot(&self, snapshot_id: impl Into<String>) -> Result<()> {
        let request = DeleteSnapshotRequest {
            snapshot_id: snapshot_id.into(),
        };
        self.raw().delete_snapshot(request).await?;
        Ok(())
    }
}

/// An `ExecRequest` for `argv` in `sandbox_id`, every other field at its default (the sandbox's
/// env, workdir and timeout, no stdin, 1 MiB of output per stream, foreground).
///
/// Set the rest with struct update syntax:
/// `ExecRequest { stdin: b"data".to_vec(), ..exec_request(id, ["cat"]) }`.
pub fn exec_request<S: Into<String>>(
    sandbox_id: impl Into<String>,
    argv: impl IntoIterator<Item = S>,
) -> ExecRequest {
    ExecRequest {
        sandbox_id: sandbox_id.into(),
        argv: argv.into_iter().map(Into::into).collect(),
        ..Default::default()
    }
}

/// The events of an `ExecStream` call: output chunks, then exactly one result.
///
/// A [`Stream`] of [`ExecEvent`]s, with status errors turned into [`Error`].
#[derive(Debug)]
pub struct ExecStream {
    inner: tonic::Streaming<ExecEvent>,
}

impl ExecStream {
    /// The next event, or `None` once the daemon has closed the stream.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>> {
        Ok(self.inner.message().await?)
    }

    /// Drains the stream and returns its result with `stdout` and `stderr` filled in from the
    /// streamed chunks, so it reads like the answer of a unary `Exec`.
    pub async fn into_result(mut self) -> Result<ExecResult> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(event) = self.next_event().await? {
            match event.event {
                Some(exec_event::Event::Stdout(chunk)) => stdout.extend_from_slice(&chunk),
                Some(exec_event::Event::Stderr(chunk)) => stderr.extend_from_slice(&chunk),
                Some(exec_event::Event::Result(mut result)) => {
                    result.stdout = stdout;
                    result.stderr = stderr;
                    return Ok(result);
                }
                None => {}
            }
        }
        Err(Error::Protocol("exec stream ended without a result".into()))
    }
}

impl Stream for ExecStream {
    type Item = Result<ExecEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner)
            .poll_next(cx)
            .map(|item| item.map(|r| r.map_err(Error::from)))
    }
}

/// The TLS settings of an `https://` address: the system's roots, the CA `ca` (PEM) when given,
/// else the one in `$SBX_CA_CERT` when that names a file.
fn tls_config(uri: &str, ca: Option<&[u8]>) -> Result<tonic::transport::ClientTlsConfig> {
    let mut config = tonic::transport::ClientTlsConfig::new().with_native_roots();
    let from_env = match (ca, std::env::var_os("SBX_CA_CERT")) {
        (Some(_), _) | (None, None) => None,
        (None, Some(path)) => Some(std::fs::read(&path).map_err(|e| Error::InvalidAddress {
            addr: uri.to_string(),
            reason: format!("SBX_CA_CERT={}: {e}", std::path::Path::new(&path).display()),
        })?),
    };
    if let Some(pem) = ca.map(<[u8]>::to_vec).or(from_env) {
        config = config.ca_certificate(tonic::transport::Certificate::from_pem(pem));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_defaults() {
        let req = exec_request("sb-1", ["echo", "hi"]);
        assert_eq!(req.sandbox_id, "sb-1");
        assert_eq!(req.argv, vec!["echo".to_owned(), "hi".to_owned()]);
        assert!(!req.background);
        assert_eq!(req.timeout_ms, 0);
        let owned = exec_request(String::from("sb-1"), vec![String::from("true")]);
        assert_eq!(owned.argv, vec!["true".to_owned()]);
    }

    #[test]
    fn bearer_header_is_added() {
        let mut auth = AuthInterceptor::bearer("s3cret").expect("valid token");
        let request = auth
            .call(tonic::Request::new(()))
            .expect("interceptor never fails");
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.to_str().ok());
        assert_eq!(header, Some(Some("Bearer s3cret")));
        assert!(matches!(
            AuthInterceptor::bearer("bad\ntoken"),
            Err(Error::InvalidToken)
        ));
    }

    #[test]
    fn no_token_no_header() {
        let request = AuthInterceptor::default()
            .call(tonic::Request::new(()))
            .expect("never fails");
        assert!(request.metadata().get("authorization").is_none());
    }

    #[tokio::test]
    async fn connect_reports_the_address() {
        let dir = std::env::temp_dir().join(format!("agent-client-test-{}", std::process::id()));
        let sock = dir.join("missing.sock");
        let err = Client::connect(&format!("unix://{}", sock.display()))
            .await
            .expect_err("no daemon there");
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(err.to_string().contains("missing.sock"), "{err}");
    }
}
