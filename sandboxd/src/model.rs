//! The plain data every layer shares: tiers, limits, the lifecycle state, the records users read
//! back and the requests that make them.
//!
//! Only types and their own small rules live here (a state's `can_*` checks, a status's name),
//! never behaviour: `model` imports nothing from the crate but [`crate::ids`], so the store, the
//! metrics, the errors, the policy and the backends can all speak these types without importing
//! the manager, or each other, and the module graph stays free of cycles (`tests/layering.rs`).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::ids::{ExecId, SandboxId, SnapshotId};

pub use sandbox_exec::capture::CapturedOutput;

/// Isolation level of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    Process,
    Container,
    MicroVm,
}

impl Isolation {
    /// All tiers, weakest first.
    pub const ALL: [Isolation; 3] = [Isolation::Process, Isolation::Container, Isolation::MicroVm];

    /// Upper-case name used in messages ("PROCESS").
    pub fn name(self) -> &'static str {
        match self {
            Isolation::Process => "PROCESS",
            Isolation::Container => "CONTAINER",
            Isolation::MicroVm => "MICROVM",
        }
    }
}

/// Resource limits as configured (defaults and ceilings). 0 in a request means "the default".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub struct Limits {
    pub cpu_millicores: u32,
    pub memory_bytes: u64,
    pub max_pids: u32,
    pub disk_bytes: u64,
    pub exec_timeout_ms: u64,
    /// Size of the sandbox's `/dev/shm`. Its pages are charged to the sandbox's memory cgroup
    /// (or live in the guest's RAM), so it is a share of `memory_bytes`, never more memory.
    /// As a default (`[limits.default]`), 0 means half of the sandbox's memory limit; a
    /// sandbox's effective limits always hold the size (records written before this field
    /// existed read as 0: see [`Limits::shm_size`]).
    #[serde(default)]
    pub shm_bytes: u64,
}

impl Limits {
    /// Built-in defaults applied when a request leaves a limit at 0 (`/dev/shm`: half of the
    /// memory limit, as `shm_bytes` 0 says).
    pub const DEFAULTS: Limits =
        Limits { cpu_millicores: 1000, memory_bytes: 512 << 20, max_pids: 256, disk_bytes: 1 << 30, exec_timeout_ms: 300_000, shm_bytes: 0 };
    /// Built-in ceilings: a request above one is refused. `/dev/shm` can never be larger than
    /// the sandbox's own memory limit either.
    pub const CEILINGS: Limits = Limits {
        cpu_millicores: 64_000,
        memory_bytes: 16 << 30,
        max_pids: 16_384,
        disk_bytes: 64 << 30,
        exec_timeout_ms: 24 * 3600 * 1000,
        shm_bytes: 16 << 30,
    };
    /// Floors: a sandbox below one could not run anything, so a request below one is refused
    /// at create (INVALID_ARGUMENT naming the field) and a configured default or ceiling below
    /// one stops the daemon at start. 4 MiB of memory runs a shell; 8 pids let a shell run a
    /// pipeline next to the sandbox's init; 16 MiB of disk hold the writable layer's own files
    /// (workdir, spilled output) with room to work; 1 MiB of `/dev/shm` holds the semaphores
    /// and small shared buffers programs make there (and is never 0, which a tmpfs would read
    /// as "no size limit").
    pub const MINIMUMS: Limits = Limits { cpu_millicores: 1, memory_bytes: 4 << 20, max_pids: 8, disk_bytes: 16 << 20, exec_timeout_ms: 1, shm_bytes: 1 << 20 };

    /// The size of `/dev/shm` these limits give a sandbox: `shm_bytes`, or half of the memory
    /// limit when it is 0 (a default, or a record from before the field), never 0 and never
    /// above the memory limit.
    pub fn shm_size(&self) -> u64 {
        let size = if self.shm_bytes == 0 { self.memory_bytes / 2 } else { self.shm_bytes };
        size.min(self.memory_bytes).max(Self::MINIMUMS.shm_bytes)
    }

    /// Each limit, or the ceiling's where that is lower.
    pub fn capped_by(&self, ceilings: &Limits) -> Limits {
        Limits {
            cpu_millicores: self.cpu_millicores.min(ceilings.cpu_millicores),
            memory_bytes: self.memory_bytes.min(ceilings.memory_bytes),
            max_pids: self.max_pids.min(ceilings.max_pids),
            disk_bytes: self.disk_bytes.min(ceilings.disk_bytes),
            exec_timeout_ms: self.exec_timeout_ms.min(ceilings.exec_timeout_ms),
            shm_bytes: self.shm_bytes.min(ceilings.shm_bytes),
        }
    }
}

/// Lifecycle of a sandbox. Transitions: Creating → Running | Failed; Running → Destroyed;
/// Running ⇄ Paused (PauseSandbox, ResumeSandbox, or a TTL with [`OnExpiry::Pause`]);
/// Paused → Destroyed; Running | Paused → Failed when a restart or rollback cannot bring it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SandboxState {
    Creating,
    Running,
    Failed,
    Destroyed,
    /// Every process frozen in place (memory kept, no CPU used), its TTL clock stopped.
    Paused,
}

impl SandboxState {
    /// Whether execs and file operations are allowed.
    pub fn can_exec(self) -> bool {
        self == SandboxState::Running
    }
    /// Whether the sandbox may be destroyed now (a sandbox being created is not yet).
    pub fn can_destroy(self) -> bool {
        matches!(self, SandboxState::Running | SandboxState::Failed | SandboxState::Paused)
    }
    /// Whether its filesystem may be snapshotted or rolled back. Not while paused: a snapshot
    /// freezes and thaws the sandbox itself (process and container tiers) or stops and continues
    /// its VM, which would wake a paused one.
    pub fn can_snapshot(self) -> bool {
        self == SandboxState::Running
    }
    /// Whether it may be paused now (a paused one again: that changes nothing).
    pub fn can_pause(self) -> bool {
        matches!(self, SandboxState::Running | SandboxState::Paused)
    }
    /// Whether it may be resumed now (a running one again: that changes nothing).
    pub fn can_resume(self) -> bool {
        matches!(self, SandboxState::Running | SandboxState::Paused)
    }
    /// Whether its processes hold memory and exist (a sandbox a restart brings back, and whose
    /// promises admission counts as in use).
    pub fn is_live(self) -> bool {
        matches!(self, SandboxState::Running | SandboxState::Paused)
    }
}

/// What a sandbox's TTL does when it passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExpiry {
    /// The sandbox is destroyed (the only behaviour before pause existed).
    #[default]
    Destroy,
    /// The sandbox is paused, and stays so until resumed or destroyed.
    Pause,
}

/// Limits as a request gives them: 0 means "the default".
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestedLimits {
    pub cpu_millicores: u32,
    pub memory_bytes: u64,
    pub max_pids: u32,
    pub disk_bytes: u64,
    pub exec_timeout_ms: u64,
    pub shm_bytes: u64,
}

/// A CreateSandbox call.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// None = the policy's default.
    pub isolation: Option<Isolation>,
    pub image: String,
    pub limits: RequestedLimits,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub labels: BTreeMap<String, String>,
    pub ttl_seconds: u32,
    pub from_snapshot_id: String,
    /// Empty = the image's, else root.
    pub user: String,
    /// None = the parent's (a fork), else NONE.
    pub network: Option<crate::netpolicy::NetworkPolicy>,
    /// What its TTL's passing does.
    pub on_expiry: OnExpiry,
}

/// What a sandbox is, as users read it back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: SandboxId,
    /// Who owns it: only calls from this tenant see or touch it.
    pub tenant: String,
    pub isolation: Isolation,
    /// Why the isolation differs from what was asked (a policy upgrade), if it does.
    pub isolation_reason: Option<String>,
    pub image: String,
    pub state: SandboxState,
    pub limits: Limits,
    pub labels: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub created_at: SystemTime,
    pub workdir: String,
    pub parent_snapshot_id: Option<SnapshotId>,
    pub expires_at: Option<SystemTime>,
    /// The snapshot the filesystem last descended from (taken, rolled back to, or forked from):
    /// the parent of the next snapshot.
    pub head_snapshot: Option<SnapshotId>,
    /// Why the sandbox is FAILED, when it is.
    #[serde(default)]
    pub failure_reason: Option<String>,
    /// Who execs run as unless they say otherwise (None: root), as given (resolved in the
    /// sandbox at each exec, since its /etc/passwd is its own).
    #[serde(default)]
    pub user: Option<String>,
    /// What the image's config said when the sandbox was made: its env is the base of every
    /// exec's (its `user` became the sandbox's `user` unless the request named one).
    #[serde(default)]
    pub image_config: ImageConfig,
    /// Its network mode and allow list (a record from before networks: NONE).
    #[serde(default)]
    pub network: crate::netpolicy::NetworkPolicy,
    /// What its TTL's passing does (a record from before pause: destroy).
    #[serde(default)]
    pub on_expiry: OnExpiry,
    /// Since when it is paused (None while it is not). `expires_at` stays where the TTL stood
    /// at the pause; a resume moves it by the time spent paused, so the clock stops meanwhile.
    #[serde(default)]
    pub paused_at: Option<SystemTime>,
    /// The TTL it was last given (create or SetSandboxTtl), in seconds; 0 = none. A sandbox its
    /// TTL paused gets it again when resumed without a new one.
    #[serde(default)]
    pub ttl_seconds: u32,
}

impl SandboxInfo {
    /// Its TTL after a resume at `now`: `ttl_seconds` from now when given (0 = keep), else
    /// what was left at the pause — or, when nothing was left (its TTL paused it), the TTL it
    /// was last given, from now. A sandbox without a TTL keeps none.
    pub fn expiry_after_resume(&self, now: SystemTime, ttl_seconds: u32) -> Option<SystemTime> {
        if ttl_seconds > 0 {
            return Some(now + Duration::from_secs(ttl_seconds.into()));
        }
        let expires = self.expires_at?;
        let left = expires.duration_since(self.paused_at.unwrap_or(now)).unwrap_or_default();
        if left.is_zero() {
            return (self.ttl_seconds > 0).then(|| now + Duration::from_secs(self.ttl_seconds.into()));
        }
        Some(now + left)
    }
}

/// How an image says it wants to be run (from an OCI/Docker image config; empty for a
/// script-built image).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    /// `Env`: the base environment of every exec (the sandbox's and the request's env win).
    pub env: BTreeMap<String, String>,
    /// `WorkingDir`: the sandbox's workdir when the create request gives none.
    pub workdir: String,
    /// `User`: who execs run as unless the sandbox or the exec names another.
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// One image of the catalog, as users read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub name: String,
    /// `sha256:<hex>`.
    pub digest: String,
    pub size_bytes: u64,
    pub created_at: SystemTime,
    /// Where it came from (`docker:<ref>`, `archive:<file>`, `build:<name>`, a script's words).
    pub source: String,
    pub config: ImageConfig,
    /// Imported or built through the API (removable), not one of the operator's scripts.
    pub imported: bool,
    /// Visible to every tenant: script-built, or an import an image admin shared.
    pub shared: bool,
    /// The tiers that can run it now.
    pub ready_tiers: Vec<Isolation>,
}

/// One progress event of an image import or build (see the API's `ImageProgress`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageProgress {
    pub phase: &'static str,
    pub message: String,
    pub bytes: u64,
    pub total_bytes: u64,
    pub count: u64,
    pub total_count: u64,
    /// The last event: the image as it now is in the catalog.
    pub done: Option<Box<ImageRecord>>,
}

impl ImageProgress {
    /// An event with only a phase and a sentence.
    pub fn say(phase: &'static str, message: impl Into<String>) -> Self {
        ImageProgress { phase, message: message.into(), ..Default::default() }
    }
}

/// A snapshot of a sandbox's filesystem.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub snapshot_id: SnapshotId,
    pub sandbox_id: SandboxId,
    pub tenant: String,
    pub name: String,
    pub created_at: SystemTime,
    /// Bytes the snapshot holds beyond its image.
    pub size_bytes: u64,
    pub parent_snapshot_id: Option<SnapshotId>,
    /// A snapshot only makes sense over the same tier and image it was taken from.
    pub isolation: Isolation,
    pub image: String,
    /// What its sandbox was given, which a fork inherits unless its request says otherwise.
    /// Absent in records written before forks inherited (they fork with the defaults).
    #[serde(default)]
    pub origin: Option<SandboxOrigin>,
    /// The snapshot holds the memory and device state of its microVM as well as its disk.
    #[serde(default)]
    pub memory: bool,
}

/// The settings of a sandbox that a fork of its snapshot inherits: its limits, environment,
/// labels and workdir at the time of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxOrigin {
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub workdir: String,
    #[serde(default)]
    pub user: Option<String>,
    /// Its network policy; a fork that names none gets this one.
    #[serde(default)]
    pub network: crate::netpolicy::NetworkPolicy,
}

/// An Exec call.
#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    pub sandbox_id: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub stdin: Vec<u8>,
    pub timeout_ms: u64,
    pub max_output_bytes: u64,
    pub idempotency_key: String,
    pub background: bool,
    /// Empty = the sandbox's user.
    pub user: String,
    /// The caller's trace, when its call carried a W3C `traceparent`: kept in the exec's record.
    pub trace: Option<TraceContext>,
}

/// The caller's W3C trace context (from the `traceparent` of its call): the trace id and the
/// caller's own span (the header's parent id), so what the daemon did can be joined to the
/// caller's step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// 32 lower-case hex digits.
    pub trace_id: String,
    /// 16 lower-case hex digits.
    pub span_id: String,
}

/// Why an exec ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExecStatus {
    Exited,
    Signaled,
    TimedOut,
    OomKilled,
    SpawnFailed,
    Running,
    Lost,
}

impl ExecStatus {
    /// Its lower-case name: a metrics label and the store's status column.
    pub fn name(self) -> &'static str {
        match self {
            ExecStatus::Exited => "exited",
            ExecStatus::Signaled => "signaled",
            ExecStatus::TimedOut => "timed_out",
            ExecStatus::OomKilled => "oom_killed",
            ExecStatus::SpawnFailed => "spawn_failed",
            ExecStatus::Running => "running",
            ExecStatus::Lost => "lost",
        }
    }
}

impl From<sandbox_exec::outcome::EndStatus> for ExecStatus {
    fn from(s: sandbox_exec::outcome::EndStatus) -> Self {
        use sandbox_exec::outcome::EndStatus;
        match s {
            EndStatus::Exited => ExecStatus::Exited,
            EndStatus::Signaled => ExecStatus::Signaled,
            EndStatus::TimedOut => ExecStatus::TimedOut,
            EndStatus::OomKilled => ExecStatus::OomKilled,
            EndStatus::Lost => ExecStatus::Lost,
        }
    }
}

/// Resource use of one exec, from its own cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecUsage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub peak_memory_bytes: u64,
}

/// What a whole sandbox uses now (see `SandboxUsage` in the proto for each field).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxUsage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub memory_bytes: u64,
    pub peak_memory_bytes: u64,
    /// None where the daemon cannot count them (a microVM's guest).
    pub pids: Option<u32>,
    /// None where the tier cannot measure its writable layer.
    pub disk_bytes: Option<u64>,
}

/// How an exec ended, as the backend saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecOutcome {
    pub status: ExecStatus,
    pub exit_code: i32,
    pub signal: i32,
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
    pub started_at: SystemTime,
    pub duration: Duration,
    pub usage: ExecUsage,
    /// A human sentence for SPAWN_FAILED and LOST.
    pub error: String,
}

impl ExecOutcome {
    /// An exec that never got to run or whose end could not be observed.
    pub fn failed(status: ExecStatus, exit_code: i32, error: String, started_at: SystemTime) -> Self {
        ExecOutcome {
            status,
            exit_code,
            signal: 0,
            stdout: CapturedOutput::default(),
            stderr: CapturedOutput::default(),
            started_at,
            duration: started_at.elapsed().unwrap_or_default(),
            usage: ExecUsage::default(),
            error,
        }
    }
}

/// The record of one exec: what ran and how it ended (status Running until it does).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecRecord {
    pub exec_id: ExecId,
    pub sandbox_id: SandboxId,
    pub argv: Vec<String>,
    /// The stored argv was cut to `exec.max_record_argv_bytes` (the exec ran with all of it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub argv_truncated: bool,
    pub idempotency_key: String,
    #[serde(flatten)]
    pub outcome: ExecOutcome,
    /// The stdout/stderr bodies were dropped to keep the sandbox's stored output within
    /// `exec.max_output_storage_bytes_per_sandbox` (the rest of the record stays). Kept by the
    /// store in a column of its own, not in the JSON document.
    #[serde(skip)]
    pub output_discarded: bool,
    /// The trace of the call that started the exec, when it carried one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceContext>,
}

impl ExecRecord {
    /// The record of an exec that is starting now.
    pub fn running(exec_id: ExecId, sandbox_id: SandboxId, argv: Vec<String>, idempotency_key: String) -> Self {
        let outcome = ExecOutcome::failed(ExecStatus::Running, 0, String::new(), SystemTime::now());
        ExecRecord { exec_id, sandbox_id, argv, argv_truncated: false, idempotency_key, outcome, output_discarded: false, trace: None }
    }
}

/// A piece of output, streamed as it is produced.
#[derive(Debug, Clone)]
pub enum OutputChunk {
    Stdout(Bytes),
    Stderr(Bytes),
}

/// What a streamed exec reports, in order: its output as it comes, then its record once it has
/// ended (the last event; boxed, as it is much larger than a chunk and comes once).
#[derive(Debug, Clone)]
pub enum ExecEvent {
    /// The command runs (sessions report it first, so the client learns the exec's id).
    Started(ExecId),
    Output(OutputChunk),
    Ended(Box<ExecRecord>),
}

/// Most records on one ListExecs page (also what `page_size` 0 means).
pub const MAX_EXECS_PAGE_SIZE: usize = 100;

/// A ListExecs page stops before its records pass this many bytes, far below the gRPC message
/// limit: 100 records of 16 MiB output each would not fit in any response.
pub const MAX_EXECS_PAGE_BYTES: u64 = 4 << 20;

/// A ListExecs call.
///
/// Without a token, the listing is the newest `limit` records (0 = all) as of this call, oldest
/// first; its first page is returned with a `next_page_token` while records remain. Passing the
/// token (with the same sandbox id) returns the next page of that same listing: `limit` and
/// records started after the first page play no part any more, records trimmed meanwhile are
/// skipped, and no record comes twice.
#[derive(Debug, Clone, Default)]
pub struct ListExecsQuery {
    pub sandbox_id: String,
    pub limit: u32,
    pub page_token: String,
    /// Records per page; 0 or above [`MAX_EXECS_PAGE_SIZE`] means that maximum.
    pub page_size: u32,
    /// Read stdout/stderr too (otherwise they are empty; GetExec returns them for one record).
    pub include_output: bool,
}

/// One ListExecs page.
#[derive(Debug, Clone, Default)]
pub struct ExecList {
    pub records: Vec<ExecRecord>,
    /// Empty on the last page.
    pub next_page_token: String,
}

/// A slice of a file read from a sandbox.
#[derive(Debug, Clone, Default)]
pub struct FileChunk {
    pub content: Vec<u8>,
    pub size: u64,
    pub eof: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_size_is_half_the_memory_unless_given() {
        let l = Limits { memory_bytes: 1 << 30, ..Limits::DEFAULTS };
        assert_eq!(l.shm_size(), 512 << 20, "0 means half of the memory limit");
        assert_eq!(Limits { shm_bytes: 100 << 20, ..l }.shm_size(), 100 << 20);
        assert_eq!(Limits { shm_bytes: 2 << 30, ..l }.shm_size(), 1 << 30, "never above the memory limit");
        assert_eq!(Limits { memory_bytes: 1 << 20, ..Limits::DEFAULTS }.shm_size(), Limits::MINIMUMS.shm_bytes, "never 0 (unlimited to a tmpfs)");
    }

    #[test]
    fn lifecycle_checks() {
        assert!(SandboxState::Running.can_exec());
        assert!(!SandboxState::Creating.can_exec());
        assert!(!SandboxState::Creating.can_destroy());
        assert!(SandboxState::Failed.can_destroy());
        let paused = SandboxState::Paused;
        assert!(!paused.can_exec() && !paused.can_snapshot(), "nothing runs in a paused sandbox");
        assert!(paused.can_destroy() && paused.can_pause() && paused.can_resume(), "destroy works; pause and resume are idempotent");
        assert!(SandboxState::Running.can_resume(), "resuming a running sandbox is a no-op, not an error");
        for s in [SandboxState::Creating, SandboxState::Failed, SandboxState::Destroyed] {
            assert!(!s.can_pause() && !s.can_resume(), "{s:?}");
        }
    }

    #[test]
    fn a_paused_ttl_clock_stops_and_an_expiry_pause_gets_its_ttl_again() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let info = |expires: Option<u64>, paused: Option<u64>, ttl: u32| SandboxInfo {
            id: crate::ids::SandboxId::generate_on(None),
            tenant: String::new(),
            isolation: Isolation::Process,
            isolation_reason: None,
            image: String::new(),
            state: SandboxState::Paused,
            limits: Limits::DEFAULTS,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            created_at: t0,
            workdir: String::new(),
            parent_snapshot_id: None,
            expires_at: expires.map(|s| t0 + Duration::from_secs(s)),
            head_snapshot: None,
            failure_reason: None,
            user: None,
            image_config: ImageConfig::default(),
            network: Default::default(),
            on_expiry: OnExpiry::Pause,
            paused_at: paused.map(|s| t0 + Duration::from_secs(s)),
            ttl_seconds: ttl,
        };
        let now = t0 + Duration::from_secs(5000);
        // Paused at 100 s with 200 s left: 200 s left from the resume, however long it slept.
        assert_eq!(info(Some(300), Some(100), 300).expiry_after_resume(now, 0), Some(now + Duration::from_secs(200)));
        // Paused by its TTL (nothing left): its TTL again.
        assert_eq!(info(Some(300), Some(300), 300).expiry_after_resume(now, 0), Some(now + Duration::from_secs(300)));
        // A new TTL wins; no TTL stays none.
        assert_eq!(info(Some(300), Some(100), 300).expiry_after_resume(now, 7), Some(now + Duration::from_secs(7)));
        assert_eq!(info(None, Some(100), 0).expiry_after_resume(now, 0), None);
    }
}
