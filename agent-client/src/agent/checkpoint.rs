//! Crash-safe checkpoints of a run.
//!
//! A checkpoint file is one header line and a JSON body:
//! `SBXCKPT <schema version> sha256=<hex of the body> len=<body bytes>\n<body>`. It is written to
//! a temporary file in the same directory, fsynced, renamed over the old one and the directory
//! fsynced, so a crash at any point leaves either the old checkpoint or the new one, never a
//! mix. Reading checks the version, the length and the checksum and says which one failed:
//! a damaged or foreign checkpoint is an error, never a silent fresh start.
//!
//! The store is a trait ([`CheckpointStore`]) so a database can replace the files.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::budget::BudgetUsed;
use super::context::ContextState;
use super::inbox::{OperatorRecord, StopRequest};
use super::state::{LoopState, StopReason};
use super::termination::DetectorState;
use super::tools::Action;

/// Version of the checkpoint format this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

const MAGIC: &str = "SBXCKPT";
const FILE_NAME: &str = "checkpoint";

/// What can go wrong storing or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// No checkpoint for this run.
    #[error("no checkpoint for run {run_id} in {dir}")]
    NotFound {
        /// The run.
        run_id: String,
        /// Where it was looked for.
        dir: PathBuf,
    },
    /// The file is damaged: truncated, altered, or not a checkpoint at all.
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The file was written by a different format version.
    #[error(
        "checkpoint {path} has schema version {found}; this sbx reads version {SCHEMA_VERSION}"
    )]
    Incompatible {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// A run id that cannot be a directory name.
    #[error(
        "invalid run id {0:?}: use 1-64 letters, digits, '.', '_' or '-', not starting with '.'"
    )]
    InvalidRunId(String),
    /// An I/O error.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Another process holds the run.
    #[error("run {0} is in use by another sbx process")]
    Locked(String),
}

/// The action being carried out when the checkpoint was written: saved before it is sent, so
/// a resume knows what may or may not have happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingAction {
    /// The step it belongs to.
    pub step: u64,
    /// The model's call id.
    pub call_id: String,
    /// The call as the model made it (name and raw arguments), for the history.
    pub call_name: String,
    /// Raw arguments.
    pub call_arguments: String,
    /// The parsed action.
    pub action: Action,
    /// Idempotency key of its exec (derived from run id, step and attempt).
    pub idempotency_key: String,
    /// Attempt number: a re-run after a rollback gets a new key.
    pub attempt: u32,
    /// Set when the action is the task check run for `finish`.
    #[serde(default)]
    pub verifying: bool,
    /// What the model wrote alongside the call: its reasoning, kept with the step.
    #[serde(default)]
    pub reasoning: String,
    /// A read-modify-write (str_replace): the SHA-256 of the file as it will be once the write
    /// lands, on disk before the write is sent, so a retry or a resume can tell whether it
    /// landed instead of applying it twice.
    #[serde(default)]
    pub expect_sha256: Option<String>,
}

/// What a run was started with; fixed for its lifetime.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunSpec {
    /// The task text.
    pub task: String,
    /// Model name.
    pub model: String,
    /// Isolation tier name (`process`, …) or empty for the daemon's default.
    pub isolation: String,
    /// Image name or empty.
    pub image: String,
    /// Task-level check command.
    pub verify: Option<String>,
    /// Step budget.
    pub max_steps: u64,
    /// Context window, tokens.
    pub context_window: usize,
    /// Whether context management is on.
    pub managed_context: bool,
    /// Token budget of the task (prompt + completion).
    pub max_tokens: Option<u64>,
    /// Cost budget, USD.
    pub max_cost: Option<f64>,
    /// Wall-time budget, seconds.
    pub max_time_secs: Option<u64>,
    /// Price per million prompt and completion tokens, USD.
    pub price: Option<(f64, f64)>,
    /// Per-step wall-time budget (the exec timeout), seconds.
    pub step_timeout_secs: u64,
    /// Per-call completion budget, tokens.
    pub max_completion_tokens: u32,
}

/// The final result of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Why it ended.
    pub reason: StopReason,
    /// The answer given to `finish`, if any.
    pub answer: Option<String>,
    /// Snapshot of the sandbox at the end.
    pub final_snapshot_id: Option<String>,
    /// What changed in the workspace, as a diff (bounded).
    pub diff: String,
    /// What was done, in a few lines.
    pub summary: String,
    /// The error behind a `fatal_error`.
    pub error: Option<String>,
    /// When the run ended, ms since the epoch (the sandbox's keep time counts from it).
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
}

/// Everything needed to pick a run up where it stopped.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The run id (also the task id).
    pub run_id: String,
    /// Trace id shared by every session of the run.
    pub trace_id: String,
    /// What the run was started with.
    pub spec: RunSpec,
    /// Steps completed.
    pub step: u64,
    /// The loop's state when written.
    pub state: LoopState,
    /// The context layers (pinned facts included).
    pub context: ContextState,
    /// Budget used so far.
    pub budget: BudgetUsed,
    /// The action in flight, if any.
    pub pending: Option<PendingAction>,
    /// The sandbox the run works in.
    pub sandbox_id: String,
    /// Snapshot taken after the last completed step that may have changed files.
    pub snapshot_id: Option<String>,
    /// Steps that may have changed files since `snapshot_id` was taken (their own snapshot
    /// failed, or step snapshots are off): a rollback to `snapshot_id` would erase them, so it
    /// is never done silently.
    #[serde(default)]
    pub unsnapshotted_steps: Vec<u64>,
    /// Snapshots the agent took on its own (per-step), oldest first; pruned as it goes.
    pub auto_snapshots: Vec<String>,
    /// No-progress detector state.
    pub detector: DetectorState,
    /// Exec id of each step that ran one, for `recall` after the step left the context.
    pub exec_ids: BTreeMap<u64, String>,
    /// `finish` calls rejected by the task check.
    pub rejected_finishes: u32,
    /// Times the run was resumed.
    pub sessions: u32,
    /// Set once the run has ended.
    pub outcome: Option<Outcome>,
    /// Whether `bash` exists in the sandbox (else `sh`).
    pub has_bash: bool,
    /// Current subtask's check command.
    pub subtask_check: Option<String>,
    /// Background execs the run started that had not ended when last looked at: while one
    /// runs, polling it is progress.
    #[serde(default)]
    pub background_execs: Vec<String>,
    /// How long the sandbox is kept once the run has ended, seconds; `None` keeps it.
    #[serde(default)]
    pub keep_sandbox_secs: Option<u64>,
    /// The sandbox was removed after its keep time (a resume forks one from the last
    /// snapshot).
    #[serde(default)]
    pub sandbox_removed: bool,
    /// Operator requests applied (`sbx agent steer`, `stop`), oldest first, the last
    /// [`super::inbox::MAX_RECORDS`]: a request whose id is here is never applied again.
    #[serde(default)]
    pub operator: Vec<OperatorRecord>,
    /// An operator's stop taken at a boundary and not yet carried out.
    #[serde(default)]
    pub stop_requested: Option<StopRequest>,
}

/// Where checkpoints live.
pub trait CheckpointStore: Send + Sync {
    /// Saves a checkpoint durably (atomic: the old one or the new one survives a crash).
    fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError>;
    /// Loads and verifies a run's checkpoint.
    fn load(&self, run_id: &str) -> Result<Checkpoint, CheckpointError>;
    /// Whether a run has a checkpoint.
    fn exists(&self, run_id: &str) -> bool;
}

/// Checks a run id before it becomes part of a path.
pub fn validate_run_id(run_id: &str) -> Result<(), CheckpointError> {
    // One rule for every writer of a run's directory (the page of `sandboxd --web` too).
    if agent_inbox::valid_run_id(run_id) {
        Ok(())
    } else {
        Err(CheckpointError::InvalidRunId(
            run_id.chars().take(80).collect(),
        ))
    }
}

/// Checkpoints as files: `<state dir>/runs/<run id>/checkpoint`.
#[derive(Clone, Debug)]
pub struct FileStore {
    root: PathBuf,
}

impl FileStore {
    /// A store under `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        FileStore {
            root: state_dir.into(),
        }
    }

    /// The state directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of a run (its checkpoint, trace and salvage files).
    pub fn run_dir(&self, run_id: &str) -> PathBuf {
        self.root.join("runs").join(run_id)
    }

    /// The checkpoint file of a run.
    pub fn path(&self, run_id: &str) -> PathBuf {
        self.run_dir(run_id).join(FILE_NAME)
    }

    /// Writes bytes atomically: temp file, fsync, rename, fsync of the directory.
    pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
        Self::write_atomic_with(path, bytes, |file, bytes| file.write_all(bytes))
    }

    /// [`FileStore::write_atomic`] with the write of the content done by `write` (a test makes
    /// it fail half-way). Whatever happens, the old file stays whole until the rename, and a
    /// failed write leaves no temp file behind.
    fn write_atomic_with(
        path: &Path,
        bytes: &[u8],
        write: impl FnOnce(&mut File, &[u8]) -> std::io::Result<()>,
    ) -> Result<(), CheckpointError> {
        let dir = parent_or_dot(path);
        create_dir_durable(dir)?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("ckpt"),
            std::process::id()
        ));
        let io = |what, source| CheckpointError::Io {
            what,
            path: tmp.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| io("cannot create", e))?;
        let written = write(&mut file, bytes)
            .map_err(|e| io("cannot write", e))
            // Data first, then the name: a rename that reaches the disk before the data would
            // leave an empty file under the real name after a power loss.
            .and_then(|()| file.sync_data().map_err(|e| io("cannot fsync", e)));
        drop(file);
        if let Err(e) = written {
            if let Err(rm) = fs::remove_file(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %rm, "cannot remove a failed checkpoint write");
            }
            return Err(e);
        }
        fs::rename(&tmp, path).map_err(|source| CheckpointError::Io {
            what: "cannot rename into",
            path: path.to_path_buf(),
            source,
        })?;
        sync_dir(dir)
    }
}

impl FileStore {
    /// [`CheckpointStore::save`] on the blocking pool: for async code, which must not block
    /// its runtime's thread on writes and fsyncs (`sbx` runs a current-thread runtime).
    pub async fn save_off_runtime(&self, checkpoint: Checkpoint) -> Result<(), CheckpointError> {
        let store = self.clone();
        let path = self.path(&checkpoint.run_id);
        off_runtime("cannot save checkpoint", path, move || {
            store.save(&checkpoint)
        })
        .await
    }

    /// [`FileStore::write_atomic`] on the blocking pool (see [`FileStore::save_off_runtime`]).
    pub async fn write_atomic_off_runtime(
        path: PathBuf,
        bytes: Vec<u8>,
    ) -> Result<(), CheckpointError> {
        let at = path.clone();
        off_runtime("cannot write", at, move || {
            Self::write_atomic(&path, &bytes)
        })
        .await
    }
}

/// Runs blocking file work (writes, fsyncs, directories made durable) on tokio's blocking
/// pool and waits for it. Never `block_in_place`: it panics on a current-thread runtime. A
/// task that panicked or was cancelled is an error about `path`, saying what was being done.
pub async fn off_runtime<T: Send + 'static>(
    what: &'static str,
    path: PathBuf,
    work: impl FnOnce() -> Result<T, CheckpointError> + Send + 'static,
) -> Result<T, CheckpointError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| CheckpointError::Io {
            what,
            path,
            source: std::io::Error::other(format!("the blocking task did not finish: {e}")),
        })?
}

/// The directory `path` is in (`.` for a bare name).
fn parent_or_dot(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// fsyncs a directory, so the entries made in it (a new file or directory, a rename) survive
/// a power loss.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(test)]
    tests::note_dir_sync(dir);
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| CheckpointError::Io {
            what: "cannot fsync directory",
            path: dir.to_path_buf(),
            source,
        })
}

/// Creates `dir` and its missing parents, fsyncing the parent of each one made: a new
/// directory is an entry of its parent, and without that fsync it can vanish on a power loss
/// with everything written in it since.
fn create_dir_durable(dir: &Path) -> Result<(), CheckpointError> {
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.is_dir() {
        missing.push(at);
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => break,
        }
    }
    for made in missing.into_iter().rev() {
        if let Err(source) = fs::create_dir(made) {
            // Made meanwhile by another process: its entry is synced below all the same.
            if !(source.kind() == std::io::ErrorKind::AlreadyExists && made.is_dir()) {
                return Err(CheckpointError::Io {
                    what: "cannot create",
                    path: made.to_path_buf(),
                    source,
                });
            }
        }
        sync_dir(parent_or_dot(made))?;
    }
    Ok(())
}

/// Encodes a checkpoint as header + body.
pub fn encode(checkpoint: &Checkpoint) -> Vec<u8> {
    let body = serde_json::to_vec(checkpoint).unwrap_or_default();
    let digest = hex(&Sha256::digest(&body));
    let mut out = format!(
        "{MAGIC} {SCHEMA_VERSION} sha256={digest} len={}\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Decodes and verifies a checkpoint file's bytes.
pub fn decode(path: &Path, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let newline = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| corrupt("no header line (empty or truncated file)".into()))?;
    let header =
        std::str::from_utf8(&bytes[..newline]).map_err(|_| corrupt("header is not text".into()))?;
    let mut fields = header.split(' ');
    if fields.next() != Some(MAGIC) {
        return Err(corrupt(format!(
            "not a checkpoint file (header {:?})",
            header.chars().take(40).collect::<String>()
        )));
    }
    let version: u32 = fields
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| corrupt("header has no schema version".into()))?;
    if version != SCHEMA_VERSION {
        return Err(CheckpointError::Incompatible {
            path: path.to_path_buf(),
            found: version,
        });
    }
    let mut sum = None;
    let mut len = None;
    for f in fields {
        if let Some(v) = f.strip_prefix("sha256=") {
            sum = Some(v.to_owned());
        } else if let Some(v) = f.strip_prefix("len=") {
            len = v.parse::<usize>().ok();
        }
    }
    let sum = sum.ok_or_else(|| corrupt("header has no checksum".into()))?;
    let len = len.ok_or_else(|| corrupt("header has no length".into()))?;
    let body = &bytes[newline + 1..];
    if body.len() != len {
        return Err(corrupt(format!(
            "length mismatch: header says {len} bytes, file holds {} (truncated or appended to)",
            body.len()
        )));
    }
    let actual = hex(&Sha256::digest(body));
    if actual != sum {
        return Err(corrupt(format!(
            "checksum mismatch: header says sha256={sum}, content hashes to {actual}"
        )));
    }
    serde_json::from_slice(body).map_err(|e| {
        corrupt(format!(
            "checksum matches but the content does not parse as a version {SCHEMA_VERSION} checkpoint: {e}"
        ))
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl CheckpointStore for FileStore {
    fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        validate_run_id(&checkpoint.run_id)?;
        let path = self.path(&checkpoint.run_id);
        let first = !path.exists();
        Self::write_atomic(&path, &encode(checkpoint))?;
        if first {
            // The run's first checkpoint: its directory, and `runs/`, may have been made
            // without their entries reaching the disk (by a process that died before its
            // fsync); the checkpoint is durable only once they are.
            let run_dir = self.run_dir(&checkpoint.run_id);
            sync_dir(parent_or_dot(&run_dir))?;
            sync_dir(&self.root)?;
        }
        Ok(())
    }

    fn load(&self, run_id: &str) -> Result<Checkpoint, CheckpointError> {
        validate_run_id(run_id)?;
        let path = self.path(run_id);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CheckpointError::NotFound {
                    run_id: run_id.to_owned(),
                    dir: self.root.clone(),
                })
            }
            Err(source) => {
                return Err(CheckpointError::Io {
                    what: "cannot read",
                    path,
                    source,
                })
            }
        };
        let checkpoint = decode(&path, &bytes)?;
        if checkpoint.run_id != run_id {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!("it belongs to run {:?}", checkpoint.run_id),
            });
        }
        Ok(checkpoint)
    }

    fn exists(&self, run_id: &str) -> bool {
        validate_run_id(run_id).is_ok() && self.path(run_id).exists()
    }
}

/// Writes checkpoints off the loop's hot path: a write is started on the blocking pool and
/// awaited only before the next step acts, so it overlaps the model call.
pub struct Writer {
    store: Arc<dyn CheckpointStore>,
    in_flight: Option<tokio::task::JoinHandle<Result<Duration, CheckpointError>>>,
    latencies: Vec<Duration>,
    stalls: Vec<Duration>,
}

impl Writer {
    /// A writer into `store`.
    pub fn new(store: Arc<dyn CheckpointStore>) -> Self {
        Writer {
            store,
            in_flight: None,
            latencies: Vec::new(),
            stalls: Vec::new(),
        }
    }

    /// Starts writing `checkpoint` in the background, after the previous write has finished
    /// (so writes land in order).
    pub async fn start(&mut self, checkpoint: Checkpoint) -> Result<(), CheckpointError> {
        self.flush().await?;
        let store = self.store.clone();
        self.in_flight = Some(tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            store.save(&checkpoint)?;
            Ok(started.elapsed())
        }));
        Ok(())
    }

    /// Waits until the last started write is durable. The time spent waiting here is the
    /// loop's stall on a background write (see [`Writer::stalls`]).
    pub async fn flush(&mut self) -> Result<(), CheckpointError> {
        let started = Instant::now();
        let waited = self.in_flight.is_some();
        self.wait().await?;
        if waited {
            self.stalls.push(started.elapsed());
        }
        Ok(())
    }

    async fn wait(&mut self) -> Result<(), CheckpointError> {
        if let Some(handle) = self.in_flight.take() {
            let took = handle.await.map_err(|e| CheckpointError::Io {
                what: "checkpoint writer failed for",
                path: PathBuf::from("<background task>"),
                source: std::io::Error::other(e.to_string()),
            })??;
            self.latencies.push(took);
        }
        Ok(())
    }

    /// Writes `checkpoint` and waits until it is durable (for the pending action, which must
    /// be on disk before the action is sent).
    pub async fn write_now(&mut self, checkpoint: Checkpoint) -> Result<(), CheckpointError> {
        self.start(checkpoint).await?;
        self.wait().await
    }

    /// How long each completed write took (serialization, checksum, write, fsyncs, rename).
    pub fn latencies(&self) -> &[Duration] {
        &self.latencies
    }

    /// How long the loop waited for each background write it had to wait for: near zero when
    /// the write overlapped the model call as intended.
    pub fn stalls(&self) -> &[Duration] {
        &self.stalls
    }
}

/// An exclusive lock on a run, held while a process drives it (released when dropped, also
/// when the process dies, since it is an `flock`).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
}

impl RunLock {
    /// Locks run `run_id` in `store`, failing at once if another process holds it. Creates the
    /// run's directory: for a new run.
    pub fn acquire(store: &FileStore, run_id: &str) -> Result<Self, CheckpointError> {
        validate_run_id(run_id)?;
        let dir = store.run_dir(run_id);
        create_dir_durable(&dir)?;
        Self::lock(&dir, run_id)
    }

    /// Locks a run that exists: an unknown run is `NotFound`, and nothing is created for it (a
    /// directory made for a mistyped id would be listed as a damaged run afterwards).
    pub fn acquire_existing(store: &FileStore, run_id: &str) -> Result<Self, CheckpointError> {
        validate_run_id(run_id)?;
        let dir = store.run_dir(run_id);
        if !dir.is_dir() {
            return Err(CheckpointError::NotFound {
                run_id: run_id.to_owned(),
                dir: store.root.clone(),
            });
        }
        Self::lock(&dir, run_id)
    }

    fn lock(dir: &Path, run_id: &str) -> Result<Self, CheckpointError> {
        let path = dir.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| CheckpointError::Io {
                what: "cannot open",
                path: path.clone(),
                source,
            })?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor we own and keep open for the lock's lifetime.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Err(CheckpointError::Locked(run_id.to_owned()));
        }
        Ok(RunLock { _file: file })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::agent::context::ContextState;
    use std::sync::Mutex;
    use std::thread::ThreadId;

    /// Every directory fsync of the tests' processes, and the thread that did it.
    static DIR_SYNCS: Mutex<Vec<(PathBuf, ThreadId)>> = Mutex::new(Vec::new());

    pub(super) fn note_dir_sync(dir: &Path) {
        DIR_SYNCS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((dir.to_path_buf(), std::thread::current().id()));
    }

    /// The directory fsyncs so far at or below `root` (a test's temporary directory), in order.
    pub(crate) fn dir_syncs_under(root: &Path) -> Vec<(PathBuf, ThreadId)> {
        DIR_SYNCS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(p, _)| p.starts_with(root))
            .cloned()
            .collect()
    }

    fn synced_paths(root: &Path) -> Vec<PathBuf> {
        dir_syncs_under(root).into_iter().map(|(p, _)| p).collect()
    }

    #[test]
    fn a_new_run_directory_is_fsynced_in_its_parent() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("state");
        let store = FileStore::new(&root);
        let _lock = RunLock::acquire(&store, "r1").expect("lock");
        // Each directory made has its entry fsynced in its parent.
        let synced = synced_paths(tmp.path());
        for dir in [tmp.path().to_path_buf(), root.clone(), root.join("runs")] {
            assert!(
                synced.contains(&dir),
                "{} not synced: {synced:?}",
                dir.display()
            );
        }
    }

    #[test]
    fn the_first_checkpoint_of_a_run_fsyncs_the_run_directory_entry() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(tmp.path());
        // The run directory exists, made without any fsync (as by a process that died).
        fs::create_dir_all(store.run_dir("r1")).expect("mkdir");
        store.save(&sample("r1")).expect("save");
        let runs = tmp.path().join("runs");
        let synced = synced_paths(tmp.path());
        // The checkpoint's entry in the run directory, the run directory's in `runs/`,
        // `runs/`'s in the state directory.
        for dir in [store.run_dir("r1"), runs.clone(), tmp.path().to_path_buf()] {
            assert!(
                synced.contains(&dir),
                "{} not synced: {synced:?}",
                dir.display()
            );
        }
        // Later checkpoints sync only the run directory.
        let before = synced.len();
        store.save(&sample("r1")).expect("save");
        assert_eq!(synced_paths(tmp.path())[before..], [store.run_dir("r1")]);
    }

    pub(crate) fn sample(run_id: &str) -> Checkpoint {
        Checkpoint {
            run_id: run_id.into(),
            trace_id: "t".into(),
            spec: RunSpec {
                task: "do it".into(),
                model: "gpt-4o".into(),
                isolation: String::new(),
                image: String::new(),
                verify: None,
                max_steps: 10,
                context_window: 1000,
                managed_context: true,
                max_tokens: None,
                max_cost: None,
                max_time_secs: None,
                price: None,
                step_timeout_secs: 60,
                max_completion_tokens: 1000,
            },
            step: 3,
            state: LoopState::Thinking,
            context: ContextState::default(),
            budget: BudgetUsed::default(),
            pending: None,
            sandbox_id: "sb-1".into(),
            snapshot_id: Some("sn-1".into()),
            unsnapshotted_steps: Vec::new(),
            auto_snapshots: vec![],
            detector: DetectorState::default(),
            exec_ids: BTreeMap::new(),
            rejected_finishes: 0,
            sessions: 0,
            outcome: None,
            has_bash: false,
            subtask_check: None,
            background_execs: Vec::new(),
            keep_sandbox_secs: None,
            sandbox_removed: false,
            operator: Vec::new(),
            stop_requested: None,
        }
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        store.save(&sample("run-1")).expect("save");
        let back = store.load("run-1").expect("load");
        assert_eq!(back.step, 3);
        assert_eq!(back.snapshot_id.as_deref(), Some("sn-1"));
        assert!(store.exists("run-1"));
        assert!(matches!(
            store.load("run-2"),
            Err(CheckpointError::NotFound { .. })
        ));
    }

    #[test]
    fn damage_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        store.save(&sample("r")).expect("save");
        let path = store.path("r");
        let good = fs::read(&path).expect("read");

        // One flipped byte in the body.
        let mut bad = good.clone();
        let last = bad.len() - 2;
        bad[last] ^= 0x01;
        fs::write(&path, &bad).expect("write");
        let err = store.load("r").expect_err("corrupt");
        assert!(err.to_string().contains("checksum mismatch"), "{err}");

        // Truncated.
        fs::write(&path, &good[..good.len() / 2]).expect("write");
        let err = store.load("r").expect_err("truncated");
        assert!(err.to_string().contains("length mismatch"), "{err}");

        // Not a checkpoint.
        fs::write(&path, b"{\"hello\": 1}\n").expect("write");
        assert!(store
            .load("r")
            .expect_err("foreign")
            .to_string()
            .contains("not a checkpoint"));

        // Empty.
        fs::write(&path, b"").expect("write");
        assert!(matches!(
            store.load("r"),
            Err(CheckpointError::Corrupt { .. })
        ));

        // Future version.
        let text = String::from_utf8_lossy(&good).replacen("SBXCKPT 1 ", "SBXCKPT 7 ", 1);
        fs::write(&path, text.as_bytes()).expect("write");
        let err = store.load("r").expect_err("incompatible");
        assert!(
            matches!(err, CheckpointError::Incompatible { found: 7, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("schema version 7"), "{err}");
    }

    #[test]
    fn no_temp_files_are_left_and_old_survives_a_failed_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        store.save(&sample("r")).expect("save");
        let mut next = sample("r");
        next.step = 4;
        store.save(&next).expect("save");
        let names = || -> Vec<String> {
            fs::read_dir(store.run_dir("r"))
                .expect("dir")
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names(), vec!["checkpoint".to_owned()]);
        assert_eq!(store.load("r").expect("load").step, 4);

        // The disk fills half-way through the next write: the last good checkpoint stays
        // whole and loadable, and nothing else is left in the run directory.
        let path = store.run_dir("r").join("checkpoint");
        let before = fs::read(&path).expect("read");
        let mut later = sample("r");
        later.step = 9;
        let err = FileStore::write_atomic_with(&path, &encode(&later), |file, bytes| {
            file.write_all(&bytes[..bytes.len() / 2])?;
            Err(std::io::Error::from_raw_os_error(libc_enospc()))
        })
        .expect_err("the write failed");
        assert!(err.to_string().contains("cannot write"), "{err}");
        assert_eq!(
            fs::read(&path).expect("read"),
            before,
            "the old checkpoint is untouched"
        );
        assert_eq!(store.load("r").expect("load").step, 4);
        assert_eq!(names(), vec!["checkpoint".to_owned()]);
    }

    /// ENOSPC ("No space left on device") on Linux.
    fn libc_enospc() -> i32 {
        28
    }

    #[test]
    fn run_ids_are_checked() {
        for bad in ["", "../x", ".hidden", "a/b", &"x".repeat(65)] {
            assert!(validate_run_id(bad).is_err(), "{bad}");
        }
        assert!(validate_run_id("run-20240101.1_a").is_ok());
    }

    #[test]
    fn a_run_is_locked_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        let lock = RunLock::acquire(&store, "r").expect("first");
        assert!(matches!(
            RunLock::acquire(&store, "r"),
            Err(CheckpointError::Locked(_))
        ));
        drop(lock);
        assert!(RunLock::acquire(&store, "r").is_ok());
    }

    #[test]
    fn locking_an_unknown_run_creates_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        assert!(matches!(
            RunLock::acquire_existing(&store, "nope"),
            Err(CheckpointError::NotFound { .. })
        ));
        assert!(!store.run_dir("nope").exists());
        let held = RunLock::acquire(&store, "r").expect("new run");
        assert!(matches!(
            RunLock::acquire_existing(&store, "r"),
            Err(CheckpointError::Locked(_))
        ));
        drop(held);
        assert!(RunLock::acquire_existing(&store, "r").is_ok());
    }

    #[tokio::test]
    async fn background_writes_land_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(FileStore::new(dir.path()));
        let mut w = Writer::new(store.clone());
        for step in 0..5 {
            let mut c = sample("r");
            c.step = step;
            w.start(c).await.expect("start");
        }
        w.flush().await.expect("flush");
        assert_eq!(store.load("r").expect("load").step, 4);
        assert_eq!(w.latencies().len(), 5);
    }
}
