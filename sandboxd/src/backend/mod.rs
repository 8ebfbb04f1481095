//! The contract every isolation tier implements, and the types that cross it.
//!
//! The manager owns ids, lifecycle, limits and records; a backend only knows how to make a
//! sandbox of its tier exist, run things in it, and take it apart. Dispatch over tiers happens in
//! one place: [`Backends`]. `cgroup` is shared by the tiers that account and kill through cgroups
//! (process, container); [`mountinfo`] (a module of the crate, which `hostfs` uses too) is
//! re-exported for them.

pub mod cgroup;
pub mod container;
pub mod cpus;
pub mod files;
pub mod microvm;
pub mod process;
pub mod seccomp;

// A top-level module because `hostfs` reads mounts too, and sealing the state dir is no part of
// the backend layer; the tiers keep naming it `super::mountinfo`.
pub use crate::mountinfo;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use async_trait::async_trait;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::model::Limits;

// The types that cross the trait live in `model`, shared with the manager, the store and the
// API; re-exported here so the tiers keep naming them `super::…` / `crate::backend::…`.
pub use crate::model::{CapturedOutput, ExecOutcome, ExecStatus, ExecUsage, FileChunk, Isolation, OutputChunk, SandboxUsage};

/// Longest image name.
pub const MAX_IMAGE_NAME_BYTES: usize = crate::images::MAX_NAME_BYTES;

/// Whether `image` can name an image: a directory name in the catalog, nothing hidden, no path.
/// The manager refuses others at the API; the catalog checks again before it makes a path.
pub fn is_image_name(image: &str) -> bool {
    crate::images::is_valid_name(image)
}

/// What a backend needs to create a sandbox; the manager has validated and defaulted it.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: SandboxId,
    pub image: String,
    pub limits: Limits,
    /// Absolute path inside the sandbox, created at setup.
    pub workdir: String,
    /// Start from this snapshot's filesystem instead of the image.
    pub from_snapshot: Option<SnapshotId>,
    /// Who owns it (named in the egress audit lines).
    pub tenant: String,
    /// What its network may reach; a tier that cannot enforce it refuses the create.
    pub network: crate::egress::NetworkPolicy,
}

/// One command to run, fully resolved (env merged, defaults applied).
#[derive(Debug, Clone)]
pub struct ExecSpec {
    pub exec_id: ExecId,
    /// Who it runs as (`name`, `uid`, `name:group`, `uid:gid`), resolved by the tier's runtime
    /// inside the sandbox; None = root.
    pub user: Option<String>,
    pub argv: Vec<String>,
    /// The complete environment of the process.
    pub env: Vec<(String, String)>,
    pub workdir: String,
    /// What the command reads first on its stdin; the backend takes it once and drops it as
    /// soon as it is written, so an exec does not keep its input for its whole life.
    pub stdin: Stdin,
    pub timeout: Duration,
    /// Per-stream cap on captured output.
    pub max_output_bytes: u64,
    /// How long to wait for the pipes to close after the main process ended.
    pub io_drain_timeout: Duration,
    /// Live input of an interactive session: stdin stays open after `stdin` was written, and
    /// what arrives here follows. Empty for a plain exec, whose stdin closes after `stdin`.
    pub input: SessionInputs,
    /// Run on a pseudo-terminal of this size: stdin, stdout and stderr are its slave side (so
    /// the output is one stream, reported as stdout) and it is the controlling terminal.
    pub tty: Option<TerminalSize>,
    /// The clock `timeout` is measured on: it stops while the sandbox is paused, so a paused
    /// sandbox's command is not timed out for the time it was frozen.
    pub clock: RunClock,
}

/// A sandbox's running time: wall time minus the time it spent paused. Every host-side exec
/// deadline sleeps on it (E2B's semantics: a paused sandbox's clock stops).
#[derive(Debug, Clone, Default)]
pub struct RunClock(Option<tokio::sync::watch::Receiver<bool>>);

impl RunClock {
    /// The clock of a sandbox whose paused flag `paused` follows (true while paused).
    pub fn new(paused: tokio::sync::watch::Receiver<bool>) -> Self {
        RunClock(Some(paused))
    }

    /// Returns once `d` of running time has passed: time while paused does not count. A
    /// sandbox that goes away (the flag's sender dropped) counts as running.
    pub async fn sleep(&self, d: Duration) {
        let Some(rx) = &self.0 else { return tokio::time::sleep(d).await };
        let mut rx = rx.clone();
        let mut left = d;
        loop {
            // Paused: wait for the resume; the time until then is not counted.
            let running = rx.wait_for(|p| !*p).await.is_ok();
            let since = tokio::time::Instant::now();
            if !running {
                return tokio::time::sleep(left).await;
            }
            tokio::select! {
                () = tokio::time::sleep(left) => return,
                // The guard `wait_for` returns is not Send: only whether it came is kept.
                paused = async { rx.wait_for(|p| *p).await.is_ok() } => {
                    left = left.saturating_sub(since.elapsed());
                    if !paused {
                        return tokio::time::sleep(left).await;
                    }
                }
            }
        }
    }
}

/// Rows and columns of an exec's pseudo-terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

/// One piece of live input to an interactive exec, in the order the client sent them.
#[derive(Debug)]
pub enum SessionInput {
    /// Bytes for its stdin (on a terminal: typed keys, so Ctrl-C is a SIGINT to its foreground).
    Stdin(Bytes),
    /// End of its stdin (on a terminal: the end-of-file character, as Ctrl-D).
    CloseStdin,
    /// The terminal's new size (ignored without a terminal).
    Resize(TerminalSize),
}

/// Writes `first` to an exec's stdin pipe, then the session's live input (resizes ignored);
/// dropping the pipe closes the command's stdin. A command that does not read its stdin closes
/// the pipe: EPIPE is normal here and ends the feeding. The process and container tiers' pipes.
pub(crate) async fn feed_pipe(mut w: tokio::net::unix::pipe::Sender, first: Vec<u8>, input: Option<mpsc::Receiver<SessionInput>>) {
    use tokio::io::AsyncWriteExt;
    if w.write_all(&first).await.is_err() {
        return;
    }
    // Written: not held while the session goes on.
    drop(first);
    let Some(mut input) = input else { return };
    while let Some(item) = input.recv().await {
        match item {
            SessionInput::Stdin(bytes) => {
                if w.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            SessionInput::CloseStdin => return,
            SessionInput::Resize(_) => {}
        }
    }
}

/// Reads one output stream of an exec (a pipe, or a terminal's master side) into `capture`, and
/// into the sink when streaming, until EOF or `stop`. `transform` sees each chunk as read and
/// gives what the exec's output is made of (the container tier strips its helper's failure
/// line); the process and container tiers' pumps.
pub(crate) async fn pump_output<R: tokio::io::AsyncRead + std::os::fd::AsRawFd + Unpin>(
    mut rx: R,
    capture: &mut sandbox_exec::capture::OutputCapture,
    sink: &OutputSink,
    is_stdout: bool,
    stop: &CancellationToken,
    mut transform: impl FnMut(&[u8]) -> std::borrow::Cow<'_, [u8]>,
) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = tokio::select! {
            biased;
            r = rx.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = stop.cancelled() => {
                // Told to stop waiting for EOF (a background process holds the pipe): still
                // take what is already in the pipe — a loaded machine may not have scheduled
                // this task since the main process wrote it.
                // A raw read: tokio's try_read trusts cached readiness the reactor may not have
                // delivered yet. The fd is non-blocking, so this never waits.
                while let Ok(n) = nix::unistd::read(rx.as_raw_fd(), &mut buf) {
                    if n == 0 {
                        break;
                    }
                    capture.feed(&transform(&buf[..n]));
                }
                break;
            }
        };
        let bytes = transform(&buf[..n]);
        if bytes.is_empty() {
            continue;
        }
        capture.feed(&bytes);
        if let Some(tx) = sink {
            let chunk = Bytes::copy_from_slice(&bytes);
            let event = if is_stdout { OutputChunk::Stdout(chunk) } else { OutputChunk::Stderr(chunk) };
            // A slow reader slows the command (back-pressure through the pipe); a gone reader
            // only stops the streaming, not the capture.
            tokio::select! {
                _ = tx.send(event) => {}
                _ = stop.cancelled() => break,
            }
        }
    }
}

/// The receiving end of a session's input, handed to the backend that runs the exec (which
/// takes it once). The channel closing counts as [`SessionInput::CloseStdin`].
#[derive(Debug, Clone, Default)]
pub struct SessionInputs(Arc<std::sync::Mutex<Option<mpsc::Receiver<SessionInput>>>>);

impl SessionInputs {
    /// Input arriving on `rx`.
    pub fn new(rx: mpsc::Receiver<SessionInput>) -> Self {
        SessionInputs(Arc::new(std::sync::Mutex::new(Some(rx))))
    }

    /// The receiver, once; `None` for a plain exec (or when already taken).
    pub fn take(&self) -> Option<mpsc::Receiver<SessionInput>> {
        self.0.lock().ok().and_then(|mut rx| rx.take())
    }

    /// Whether there is a receiver still to take (a session's live input).
    pub fn is_some(&self) -> bool {
        self.0.lock().map(|rx| rx.is_some()).unwrap_or(false)
    }
}

/// An exec's initial stdin, taken once by the backend that writes it (clones of the spec share
/// it, so no copy outlives the writing).
#[derive(Debug, Clone, Default)]
pub struct Stdin(Arc<std::sync::Mutex<Option<Vec<u8>>>>);

impl Stdin {
    /// `bytes` for the command's stdin.
    pub fn new(bytes: Vec<u8>) -> Self {
        Stdin(Arc::new(std::sync::Mutex::new(Some(bytes))))
    }

    /// The bytes, once (empty afterwards).
    pub fn take(&self) -> Vec<u8> {
        self.0.lock().ok().and_then(|mut b| b.take()).unwrap_or_default()
    }

    /// Whether there is nothing (left) to write.
    pub fn is_empty(&self) -> bool {
        self.0.lock().map(|b| b.as_ref().is_none_or(Vec::is_empty)).unwrap_or(true)
    }
}

/// Where streamed output goes (none for unary execs).
pub type OutputSink = Option<mpsc::Sender<OutputChunk>>;

/// Fired once the command's process runs (dropped unfired if it never started), so a
/// background exec is returned only when signals can reach it.
pub type StartSignal = Option<tokio::sync::oneshot::Sender<()>>;

/// A piece of an upload, in order. The backend replaces the old file only on `Commit`: the
/// channel closing before it (the client went away, its checksum did not match) abandons the
/// upload and leaves the old file as it was.
#[derive(Debug)]
pub enum UploadPiece {
    Data(Bytes),
    Commit,
}

/// A file being downloaded: its size, and its content in order (an `Err` ends it early).
pub struct Download {
    pub size: u64,
    pub chunks: mpsc::Receiver<Result<Bytes, BackendError>>,
}

/// The pieces of a download of unknown length (an archive), in order; an `Err` ends it early.
pub type ByteChunks = mpsc::Receiver<Result<Bytes, BackendError>>;

/// What an archive upload wrote.
pub use sandbox_exec::archive::ExtractStats as ArchiveStats;

/// How big a piece of a download is: large enough that per-message costs vanish, small enough
/// to stay far below gRPC's message limit.
pub const DOWNLOAD_CHUNK: usize = 1 << 20;

/// Errors a backend reports. The manager turns them into API errors.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No image of that name: the names there are, never a host path.
    #[error("image {image:?} not found; available: {}", if .available.is_empty() { "none".to_string() } else { .available.join(", ") })]
    ImageNotFound { image: String, available: Vec<String> },
    #[error("isolation {} unavailable: {reason}", .isolation.name())]
    Unavailable { isolation: Isolation, reason: String },
    #[error("sandbox {0} is not known to its backend")]
    NoSuchSandbox(SandboxId),
    #[error("snapshot {0} is not known to its backend")]
    NoSuchSnapshot(SnapshotId),
    #[error("exec {0} is not running")]
    NoSuchExec(ExecId),
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath { path: String, reason: String },
    #[error("no such file in the sandbox: {path}")]
    FileNotFound { path: String },
    #[error("the sandbox's disk is full (disk_bytes reached) writing {path}")]
    DiskFull { path: String },
    #[error("the upload of {path} did not complete; the old file is unchanged")]
    UploadIncomplete { path: String },
    /// The client did not read a download for `secs` seconds (`streams.idle_timeout_ms`).
    #[error("the client read nothing of {path} for {secs:.1} s (streams.idle_timeout_ms); the download was ended")]
    Idle { path: String, secs: f64 },
    #[error("archive: {0}")]
    Archive(#[from] sandbox_exec::archive::ArchiveError),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// A snapshot whose saved state cannot be restored (a memory file QEMU refused); nothing
    /// was changed: the sandbox runs on as it was.
    #[error("snapshot {snapshot} cannot be restored: {reason}")]
    SnapshotUnusable { snapshot: SnapshotId, reason: String },
    #[error("{0}")]
    Internal(String),
}

impl BackendError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BackendError::Io { context: context.into(), source }
    }

    /// A catalog error met by `tier`: an unknown image is NOT_FOUND, one the tier cannot run
    /// (yet) is the tier's unavailability for it, with the reason.
    pub fn from_image(tier: Isolation, e: crate::images::ImageError) -> Self {
        use crate::images::ImageError;
        match e {
            ImageError::NotFound { image, available } => BackendError::ImageNotFound { image, available },
            ImageError::NotReady { reason, .. } => BackendError::Unavailable { isolation: tier, reason },
            ImageError::Io { context, source } => BackendError::Io { context, source },
            e => BackendError::Internal(e.to_string()),
        }
    }
}

/// What every isolation tier provides. All methods are called with ids the manager knows.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The tier this backend serves.
    fn isolation(&self) -> Isolation;
    /// `Ok` when this host can serve the tier, else the reason it cannot.
    fn availability(&self) -> Result<(), String>;
    /// Makes the sandbox exist and ready to exec.
    async fn create(&self, spec: &SandboxSpec) -> Result<(), BackendError>;
    /// Runs one command to its end (or until `cancel` fires, which kills its process tree).
    async fn exec(
        &self,
        sandbox: &SandboxId,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError>;
    /// Sends a signal to every process of a running exec.
    async fn signal_exec(&self, sandbox: &SandboxId, exec: &ExecId, signal: i32) -> Result<(), BackendError>;
    /// Writes a whole file inside the sandbox, creating parent directories.
    async fn write_file(&self, sandbox: &SandboxId, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError>;
    /// Reads part of a file inside the sandbox.
    async fn read_file(&self, sandbox: &SandboxId, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError>;
    /// Writes a file of any size as its pieces arrive (creating parents), aside, and renames it
    /// into place on [`UploadPiece::Commit`]; returns the bytes written.
    async fn upload_file(&self, sandbox: &SandboxId, path: &str, mode: u32, data: mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError>;
    /// Opens a regular file for reading from its start, in [`DOWNLOAD_CHUNK`] pieces, each made
    /// once the receiver took the one before; a receiver that takes nothing for `idle` ends the
    /// download with [`BackendError::Idle`] (and the file is closed).
    async fn download_file(&self, sandbox: &SandboxId, path: &str, idle: Duration) -> Result<Download, BackendError>;
    /// Extracts a tar stream into the directory `dir` (created if missing) as its pieces arrive,
    /// every entry confined below it (see `sandbox_exec::archive`). All or nothing: a failure,
    /// or the channel closing before [`UploadPiece::Commit`], removes what was extracted and
    /// puts back what it replaced.
    async fn upload_archive(&self, sandbox: &SandboxId, dir: &str, data: mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError>;
    /// A tar stream of the directory (or file) `path`, produced while the receiver keeps up and
    /// ended like [`Backend::download_file`] when it stays idle.
    async fn download_archive(&self, sandbox: &SandboxId, path: &str, idle: Duration) -> Result<ByteChunks, BackendError>;
    /// Removes a regular file or a symlink (the link itself, never its target) inside the
    /// sandbox, confined like the other file operations. A path that does not exist is `Ok`; a
    /// directory or special file is `InvalidPath`. Not an API call: the daemon's own clean-up.
    async fn remove_file(&self, sandbox: &SandboxId, path: &str) -> Result<(), BackendError>;
    /// Captures the sandbox's filesystem as `snapshot` (and with `memory`, which only the
    /// microVM tier is asked for, its running memory and device state); returns the bytes it
    /// holds beyond the image.
    async fn snapshot(&self, sandbox: &SandboxId, snapshot: &SnapshotId, memory: bool) -> Result<u64, BackendError>;
    /// Puts the sandbox's filesystem back to `snapshot`; every process in it is ended (a
    /// snapshot with memory brings back the processes that ran when it was taken instead).
    async fn rollback(&self, sandbox: &SandboxId, snapshot: &SnapshotId) -> Result<(), BackendError>;
    /// Frees a snapshot no sandbox depends on any more.
    async fn delete_snapshot(&self, snapshot: &SnapshotId) -> Result<(), BackendError>;
    /// Freezes every process of the sandbox in place: memory kept, nothing scheduled. Called
    /// only on a running sandbox; `destroy` must work on a paused one (a frozen cgroup's kill
    /// thaws it, a stopped VM's QEMU is killed like a running one).
    async fn pause(&self, sandbox: &SandboxId) -> Result<(), BackendError>;
    /// Lets a paused sandbox's processes run again where they stopped.
    async fn resume(&self, sandbox: &SandboxId) -> Result<(), BackendError>;
    /// Kills every process and frees every mount, cgroup and directory of the sandbox.
    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), BackendError>;
    /// Called once at start, before any other call and before the daemon listens, with the
    /// sandboxes and snapshots on record for this tier. The backend removes what a previous run
    /// left behind — the runtime state of every sandbox (its processes died with that daemon),
    /// writable layers and snapshots not on record — and starts nothing: it holds up the
    /// listener, so it only lists and deletes.
    async fn clean(&self, sandboxes: &[SandboxSpec], snapshots: &[SnapshotId]);
    /// Brings one sandbox handed to [`Backend::clean`] back up over its preserved filesystem.
    /// Called after `clean`, while the daemon serves: other sandboxes are created, used and
    /// re-adopted meanwhile (up to [`Backend::readopt_concurrency`] at once).
    async fn readopt(&self, spec: &SandboxSpec) -> Result<(), BackendError>;
    /// What the sandbox uses now (CPU, memory, processes, disk), read from its cgroup and its
    /// writable layer.
    async fn usage(&self, sandbox: &SandboxId) -> Result<SandboxUsage, BackendError>;
    /// Called once every [`Backend::readopt`] of the start has returned: what only then can be
    /// told garbage is collected, warm pools are filled.
    async fn recovered(&self) {}
    /// How many re-adoptions the manager runs at once on this tier.
    fn readopt_concurrency(&self) -> usize {
        4
    }
    /// Whether the tier can run the catalog image `image` now (its availability included), and
    /// the reason when it cannot. Cheap: it is asked for every image of every ListImages.
    fn image_ready(&self, _image: &str) -> Result<(), String> {
        self.availability()
    }
    /// Makes the tier ready to run the catalog image `image` (already in the catalog), once, so
    /// the first sandbox of it does not wait: the container tier's Docker image, the microVM
    /// tier's base disk. Idempotent. Returns what it did, in a sentence for the user.
    async fn prepare_image(&self, _image: &str) -> Result<String, BackendError> {
        Ok("nothing to prepare".to_string())
    }
    /// Frees what the tier made for `image` (its Docker image, base disks) once no sandbox or
    /// snapshot uses it, just before the image leaves the catalog (it is still there, so the
    /// tier can tell which of its artifacts belong to this build of it); the image's own files
    /// are the catalog's.
    async fn remove_image(&self, _image: &str) -> Result<(), BackendError> {
        Ok(())
    }
    /// Why a sandbox this backend runs has stopped working on its own (its init or VM died),
    /// or `None` while it is healthy. The manager then records it as FAILED with this reason.
    fn failure(&self, _sandbox: &SandboxId) -> Option<String> {
        None
    }
    /// Called once at daemon shutdown. Sandboxes are not destroyed: their filesystems stay for
    /// the next start to recover; their processes end with the daemon.
    async fn shutdown(&self);
    /// Builds only (the container tier): makes sandbox `spec` from the Docker image `image` (a
    /// build's image so far) instead of a catalog image, confined as every sandbox of the tier.
    async fn create_build_step(&self, spec: &SandboxSpec, _image: &str) -> Result<(), BackendError> {
        Err(BackendError::Unavailable { isolation: self.isolation(), reason: format!("sandbox {}: only the container tier runs build steps", spec.id) })
    }
    /// Builds only: stops build-step sandbox `sandbox`, commits its filesystem as a Docker image
    /// `repo:tag` with the configuration of image `config_of`, and removes the sandbox. Returns
    /// the image's ID.
    async fn commit_build_step(&self, sandbox: &SandboxId, _config_of: &str, _repo: &str, _tag: &str) -> Result<String, BackendError> {
        Err(BackendError::Unavailable { isolation: self.isolation(), reason: format!("sandbox {sandbox}: only the container tier runs build steps") })
    }
}

/// The backends of this daemon, one per tier that was configured; the single dispatch point.
#[derive(Clone, Default)]
pub struct Backends {
    by_tier: HashMap<Isolation, Arc<dyn Backend>>,
}

impl Backends {
    /// Registers the backend of a tier.
    pub fn insert(&mut self, backend: Arc<dyn Backend>) {
        self.by_tier.insert(backend.isolation(), backend);
    }

    /// The backend of `tier`, for operations on sandboxes it already serves (no availability
    /// check: that may cost I/O, and these calls are the hot path).
    pub fn get(&self, tier: Isolation) -> Result<&Arc<dyn Backend>, BackendError> {
        self.by_tier.get(&tier).ok_or_else(|| BackendError::Unavailable { isolation: tier, reason: "not implemented by this build of sandboxd".to_string() })
    }

    /// The backend of `tier` if this host can serve it now, else why not: for creating
    /// sandboxes and recovering them at start.
    pub fn available(&self, tier: Isolation) -> Result<&Arc<dyn Backend>, BackendError> {
        let backend = self.get(tier)?;
        backend.availability().map_err(|reason| BackendError::Unavailable { isolation: tier, reason })?;
        Ok(backend)
    }

    /// Availability of every tier, for health reporting.
    pub fn availability(&self) -> Vec<(Isolation, Result<(), String>)> {
        Isolation::ALL
            .iter()
            .map(|&tier| {
                let status = match self.by_tier.get(&tier) {
                    Some(b) => b.availability(),
                    None => Err("not implemented by this build of sandboxd".to_string()),
                };
                (tier, status)
            })
            .collect()
    }

    /// Every registered backend.
    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Backend>> {
        self.by_tier.values()
    }
}
