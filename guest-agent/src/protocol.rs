//! The host <-> guest wire protocol, spoken over the VM's virtio-serial port (a byte stream).
//!
//! # Framing
//!
//! ```text
//! MAGIC "SBX1" | header_len: u32 BE | payload_len: u32 BE | header (JSON) | payload (raw bytes)
//! ```
//!
//! The header is a JSON [`Envelope`]: a request id chosen by the host and the message. Bulk bytes
//! (stdin, output, file contents) travel raw in the payload, never inside the JSON.
//!
//! Each side treats the other as hostile: the guest runs untrusted code and may be compromised,
//! and the agent must survive whatever arrives on its port. So the [`Decoder`] never trusts a
//! length beyond [`MAX_HEADER`] / [`MAX_PAYLOAD`], never allocates more than one frame, and after
//! garbage it resynchronizes on the next magic instead of giving up — the caller gets a
//! [`Decoded::Garbage`] event it can log and answer, and the stream goes on.
//!
//! # Conversation
//!
//! The host sends [`Request`]s, each with a fresh id. The guest answers every request with exactly
//! one *final* [`Response`] carrying the same id; an `Exec` is preceded by `Started` and, when
//! asked to stream, any number of `Output` frames with that id. Responses to different requests may
//! interleave.
//!
//! # Sessions (protocol 3)
//!
//! An [`Request::ExecSession`] is an `Exec` whose stdin stays open after its payload
//! (`interactive`) and/or that runs on a pseudo-terminal (`tty`). Its live input follows as
//! [`Request::Stdin`], [`Request::CloseStdin`] and [`Request::Resize`], addressed by exec id and
//! sent once the exec's `Started` arrived (before it, the exec may not be registered yet). The
//! guest takes these in the order their frames arrive (never on a thread each, so stdin bytes keep
//! their order), queues them per exec — at most [`MAX_INPUT_QUEUE`] requests and
//! [`MAX_INPUT_BYTES`] payload bytes, more is refused with `Error{BadRequest}` — and answers each
//! once it has been applied: `Ok` when its bytes are in the command's stdin (or were discarded
//! because the command closed it), `Error{NoSuchExec}` when the exec ended first. A host that
//! waits for each answer before sending the next input of that exec never sees the queue full,
//! and a command that stops reading slows its sender down instead of filling the guest.
//!
//! # Archives (protocol 4)
//!
//! A directory moves in or out as a tar stream (`sandbox_exec::archive`, run by the guest against
//! its own root, so every entry is confined there and nothing below the named directory is
//! followed).
//!
//! In: [`Request::UploadArchive`] pieces of one `transfer` id, each carrying the next bytes of the
//! stream (at most [`FILE_CHUNK`]) at `offset`; the first (`offset` 0) starts the extraction into
//! `dest` on a thread of its own. The guest takes the pieces in the order their frames arrive
//! (like stdin: never a thread each) and queues them for that thread — at most
//! [`MAX_ARCHIVE_QUEUE`] pieces and [`MAX_ARCHIVE_QUEUE_BYTES`] bytes, more is refused with
//! `Error{BadRequest}` — and answers each with `Written{size}` (the stream bytes taken so far)
//! once the extraction has taken its bytes. A host that waits for each answer before sending the
//! next piece never sees the queue full, and the extraction sets its pace. The `last` piece (it
//! may be empty) is answered once the stream is extracted and synced, with [`Response::Extracted`]
//! — or with the `Error` that stopped the extraction. An extraction that fails before the last
//! piece answers the next piece (any piece of that transfer still queued) with its error. An
//! unfinished upload is dropped by `AbortWrite` with its transfer id, when no piece came for
//! ten minutes, or when the host disconnects; what was extracted before stays (an archive is
//! not atomic).
//!
//! Out: [`Request::DownloadArchive`] is answered like a streaming exec: any number of
//! [`Response::ArchiveData`] frames whose payloads (at most [`FILE_CHUNK`] each) are the tar
//! stream in order, then [`Response::ArchiveEnd`] once it is complete, or an `Error` (before any
//! data when the source cannot be archived at all: a missing path is `NotFound`). The flow
//! control is the exec output's: the guest writes each frame to the port, which blocks while the
//! host does not read, so the walk goes at the pace of the host's reader. `AbortWrite` with the
//! download's transfer id stops it between two frames.
//!
//! At most [`MAX_ARCHIVE_TRANSFERS`] archive transfers (uploads and downloads together) run at
//! once; more are refused with `Error{Internal}`. An archive error is answered with the kind the
//! other tiers give it: an unsafe, unsupported or malformed entry, a path that is not a directory
//! and a limit reached are `InvalidPath`, a missing destination or source `NotFound`, a full disk
//! `DiskFull`, and the message names the entry.

use serde::{Deserialize, Serialize};

/// Start of every frame.
pub const MAGIC: [u8; 4] = *b"SBX1";
/// Bytes before the header: magic and the two lengths.
pub const PREFIX_LEN: usize = 12;
/// Largest header accepted.
pub const MAX_HEADER: u32 = 64 << 10;
/// Largest payload accepted: the final record of an exec carries both captured streams, each at
/// most the daemon's output ceiling (16 MiB), plus room.
pub const MAX_PAYLOAD: u32 = 33 << 20;
/// Largest file slice moved in one frame; larger reads and writes are split by the host.
pub const FILE_CHUNK: u64 = 1 << 20;
/// Protocol version, exchanged in `Hello`. 2 added `WriteStaged`, `AbortWrite` and
/// `RemoveFile`; 3 added `ExecSession`, `Stdin`, `CloseStdin` and `Resize` (interactive execs
/// and terminals); 4 added `UploadArchive`, `DownloadArchive` and their answers `Extracted`,
/// `ArchiveData`, `ArchiveEnd` (directories as tar streams), and lets `AbortWrite` drop an
/// archive transfer too; 5 added `shm_bytes` to `Configure` (the size of /dev/shm), and a
/// `Configure` of 5 also writes /etc/hostname and /etc/hosts for the hostname, while the guest
/// shows its sandbox's cgroup read-only at /sys/fs/cgroup; 5 also added `ExecRequest.user` (execs as
/// another user); 6 added `Resumed` (a VM restored from a memory snapshot steps its clock and
/// reseeds its RNG); 7 added `network` to `Configure` (the guest's `eth0`, default route and
/// /etc/resolv.conf when the sandbox has a filtered network) and `machine_id`. Everything of 1 is unchanged, so a
/// host speaks to any of them (and refuses what an older guest would silently leave undone).
pub const VERSION: u32 = 7;
/// Oldest guest protocol a host still accepts.
pub const MIN_VERSION: u32 = 1;
/// Longest transfer id of a `WriteStaged`.
pub const MAX_TRANSFER_ID: usize = 64;
/// Staged writes a guest keeps open at once; more are refused.
pub const MAX_STAGED_WRITES: usize = 16;
/// Input requests (`Stdin`, `CloseStdin`, `Resize`) a guest holds per exec before it refuses
/// more (protocol 3).
pub const MAX_INPUT_QUEUE: usize = 64;
/// Stdin payload bytes a guest holds per exec before it refuses more (protocol 3); a single
/// `Stdin` larger than this is refused outright.
pub const MAX_INPUT_BYTES: usize = 4 << 20;
/// Largest `Stdin` payload a host sends: live input is split (or coalesced) to this.
pub const STDIN_CHUNK: usize = 1 << 20;
/// Archive transfers (`UploadArchive`, `DownloadArchive`) a guest runs at once; more are refused
/// (protocol 4).
pub const MAX_ARCHIVE_TRANSFERS: usize = 8;
/// Pieces of one `UploadArchive` a guest holds before its extraction takes them; more are
/// refused (protocol 4).
pub const MAX_ARCHIVE_QUEUE: usize = 4;
/// Payload bytes of one `UploadArchive` a guest holds before its extraction takes them; more are
/// refused (protocol 4). Room for the piece being taken and the next one.
pub const MAX_ARCHIVE_QUEUE_BYTES: usize = 2 * FILE_CHUNK as usize;
/// Name of the virtio-serial port the agent listens on (`/sys/class/virtio-ports/*/name`).
pub const PORT_NAME: &str = "org.sandboxd.agent.0";

/// The JSON header of a frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<M> {
    /// Chosen by the host per request; responses carry the id of their request. 0 is used by the
    /// guest for events that answer no request (a garbage report).
    pub id: u64,
    pub msg: M,
}

/// What the host asks of the guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// First request on a fresh connection; answered by `Hello`.
    Hello,
    /// Limits of the sandbox inside the guest (the cgroup every exec runs under), its hostname and
    /// default workdir. Sent once after `Hello` (again after a VM is taken from the warm pool).
    /// Answered by `Ok`.
    Configure(GuestLimits),
    /// Runs a command. Payload: its stdin. Answered by `Started`, `Output`*, then `Exited`
    /// (or `Error` when the request itself is bad).
    Exec(ExecRequest),
    /// Runs a command as a session (protocol 3): as `Exec` — same payload (the first stdin bytes),
    /// same answers — plus, when `interactive`, stdin stays open after the payload for the
    /// `Stdin` / `CloseStdin` / `Resize` requests that follow; and with `tty: Some((rows, cols))`
    /// the command runs on a new pseudo-terminal of that size in the guest's devpts: its stdin,
    /// stdout and stderr are the terminal, which is its controlling terminal, and all its output
    /// comes as the `stdout` stream (`stderr` stays empty). A terminal that is not interactive
    /// gets the payload then its end-of-file character (Ctrl-D). A separate request rather than
    /// two more fields of `Exec`, so an agent older than 3 refuses it (`BadRequest`) instead of
    /// ignoring the unknown fields and running it without its terminal.
    ExecSession {
        exec: ExecRequest,
        #[serde(default)]
        tty: Option<(u16, u16)>,
        #[serde(default)]
        interactive: bool,
    },
    /// Bytes for the stdin of a running interactive exec (protocol 3). Payload: the bytes (on a
    /// terminal, typed keys: `\x03` is Ctrl-C). Answered by `Ok` once they are written, or
    /// `Error{NoSuchExec}`; see the module documentation for ordering and bounds.
    Stdin { exec_id: String },
    /// Closes the stdin of a running interactive exec (protocol 3): its pipe is closed (later
    /// `Stdin` bytes are discarded), or a terminal gets its end-of-file character (Ctrl-D; a
    /// terminal has no half-close). Answered like `Stdin`.
    CloseStdin { exec_id: String },
    /// Sets the size of a running interactive exec's terminal (protocol 3): the kernel sends its
    /// foreground process group SIGWINCH. Ignored without a terminal. Answered like `Stdin`.
    Resize { exec_id: String, rows: u16, cols: u16 },
    /// Sends a signal to every process of a running exec. Answered by `Ok` or `Error{NoSuchExec}`.
    Signal { exec_id: String, signal: i32 },
    /// Writes a file, creating parent directories. Payload: the bytes. `append = false` creates or
    /// truncates; `true` appends (the host splits big files into chunks). Answered by `Written`.
    WriteFile { path: String, mode: u32, append: bool },
    /// Reads at most `limit` (≤ [`FILE_CHUNK`]) bytes from `offset`. Answered by `FileData`.
    ReadFile { path: String, offset: u64, limit: u64 },
    /// One chunk of an atomic replacement of `path` (protocol 2). Payload: the bytes for
    /// `[offset, offset + len)`. The first chunk (`offset` 0) creates `path`'s parents, follows
    /// its last component through symlinks, refuses anything but a regular file there, and
    /// creates a hidden temporary file beside the target, kept open under `transfer` (chosen by
    /// the host, ≤ [`MAX_TRANSFER_ID`] bytes; at most [`MAX_STAGED_WRITES`] at once). Later
    /// chunks must follow on. `commit` syncs the temporary file, gives it `mode` and the old
    /// file's owner, and renames it over the target. Any failure removes the temporary file and
    /// forgets the transfer: the old file is never touched before the rename. Answered by
    /// `Written` with the bytes staged so far.
    WriteStaged { transfer: String, path: String, mode: u32, offset: u64, commit: bool },
    /// Drops an unfinished `WriteStaged` and its temporary file (protocol 2), or (protocol 4) an
    /// unfinished `UploadArchive` or `DownloadArchive` of that transfer id. Answered by `Ok`,
    /// also when there is no such transfer.
    AbortWrite { transfer: String },
    /// Removes a regular file or a symlink — the link itself, never its target (protocol 2).
    /// A path that does not exist is not an error; a directory or special file is
    /// `Error{InvalidPath}`. Answered by `Ok`.
    RemoveFile { path: String },
    /// One piece of a tar stream to extract into the directory `dest` (protocol 4; see the
    /// module documentation). Payload: the stream's bytes `[offset, offset + len)`, at most
    /// [`FILE_CHUNK`]. `transfer` is chosen by the host (≤ [`MAX_TRANSFER_ID`] bytes); `offset`
    /// 0 starts the extraction (replacing an unfinished transfer of that id), later pieces must
    /// follow on and name the same `dest`. `dest` is absolute, resolved in the guest as the
    /// sandbox sees it and created with its parents. Answered by `Written` with the stream bytes
    /// taken so far; the `last` piece by `Extracted`.
    UploadArchive { transfer: String, dest: String, offset: u64, last: bool },
    /// A tar stream of the directory or file at the absolute `path` (protocol 4; see the module
    /// documentation), under the host's `transfer` id (for `AbortWrite`). Answered by
    /// `ArchiveData`*, then `ArchiveEnd`.
    DownloadArchive { transfer: String, path: String },
    /// `sync` then freeze the root filesystem (FIFREEZE) so the disk is consistent for a
    /// snapshot. Answered by `Ok`. Always followed by `Thaw`.
    Freeze,
    /// Thaws the root filesystem (FITHAW). Answered by `Ok`.
    Thaw,
    /// (Protocol 6.) The VM was just restored from a memory snapshot: step the wall clock to
    /// the host's `unix_time_ns` (the guest's stood still while it was saved), and mix the
    /// payload (fresh host randomness, 32 to 512 bytes) into the kernel RNG, crediting it, and
    /// reseed it at once, so that two VMs restored from one snapshot never share a random
    /// stream. Answered by `Ok`.
    Resumed { unix_time_ns: u64 },
    /// Syncs and powers the VM off. Answered by `Ok` just before.
    Shutdown,
}

/// The sandbox as the guest applies it: limits on the cgroup every exec runs under, the
/// hostname (the sandbox id; from protocol 5 also written to /etc/hostname and mapped to
/// 127.0.1.1 in /etc/hosts), the default working directory, created if missing, and (protocol
/// 5) the size of /dev/shm.
///
/// An agent older than 5 ignores `shm_bytes` (serde skips unknown fields), so a host sends it
/// only to an agent that said 5 or more in `Hello`, and refuses an older one instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestLimits {
    pub memory_bytes: u64,
    pub max_pids: u32,
    pub cpu_millicores: u32,
    #[serde(default)]
    pub hostname: String,
    #[serde(default)]
    pub workdir: String,
    /// Size of the /dev/shm tmpfs (its pages count against `memory_bytes`: they are charged to
    /// the sandbox's cgroup); 0 leaves it as it is.
    #[serde(default)]
    pub shm_bytes: u64,
    /// The guest's link to the host's egress filter (protocol 7): `None` leaves the VM with
    /// loopback only (and takes down an `eth0` a restored memory snapshot may have had up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<GuestNetwork>,
    /// The sandbox's /etc/machine-id (32 lowercase hex digits; protocol 7): a VM resumed from a
    /// memory snapshot would otherwise keep its parent's. Empty leaves the file as it is.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub machine_id: String,
}

/// `eth0`'s configuration: `address`/`prefix_len` with a default route via `gateway`, which is
/// also the only nameserver /etc/resolv.conf names (the host's filter answers DNS there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNetwork {
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: std::net::Ipv4Addr,
}

/// One command to run in the guest, fully resolved by the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub exec_id: String,
    pub argv: Vec<String>,
    /// The complete environment.
    pub env: Vec<(String, String)>,
    pub workdir: String,
    pub timeout_ms: u64,
    /// Per-stream cap on captured output (≤ 16 MiB).
    pub max_output_bytes: u64,
    /// How long to wait for the pipes to close after the main process ended.
    pub io_drain_ms: u64,
    /// Send `Output` frames as the command writes.
    pub stream: bool,
    /// Who it runs as (`name`, `uid`, `name:group`, `uid:gid`), resolved by the agent in the
    /// guest's /etc; None = root. Version 5 and later; the host never sends it to older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// One of the two output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What the guest answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Hello {
        version: u32,
        kernel: String,
        uptime_ms: u64,
    },
    Ok,
    /// The exec's process runs (signals can reach it).
    Started,
    /// Payload: bytes the exec wrote to `stream`.
    Output {
        stream: Stream,
    },
    /// Final record of an exec. Payload: the captured stdout bytes, then the captured stderr
    /// bytes (`stdout.len` + `stderr.len` == payload length).
    Exited(ExecExit),
    Written {
        size: u64,
    },
    /// Payload: the bytes read.
    FileData {
        size: u64,
        eof: bool,
    },
    /// Final answer to the `last` piece of an `UploadArchive` (protocol 4): the stream was
    /// extracted and synced.
    Extracted(ArchiveExtracted),
    /// Payload: the next bytes (at most [`FILE_CHUNK`]) of a `DownloadArchive`'s tar stream
    /// (protocol 4).
    ArchiveData,
    /// Final answer to a `DownloadArchive` (protocol 4): every byte of the stream, its
    /// end-of-archive marker included, was in the `ArchiveData` before.
    ArchiveEnd(ArchiveCreated),
    Error {
        kind: ErrorKind,
        message: String,
    },
}

impl Response {
    /// True for the last frame of a request.
    pub fn is_final(&self) -> bool {
        !matches!(self, Response::Started | Response::Output { .. } | Response::ArchiveData)
    }
}

/// What an `UploadArchive` wrote (`sandbox_exec::archive::ExtractStats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveExtracted {
    /// Regular files written.
    pub files: u64,
    /// Directory entries (created or merged with an existing directory).
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    /// Bytes of regular-file data written.
    pub bytes: u64,
}

/// What a `DownloadArchive` archived (`sandbox_exec::archive::CreateStats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveCreated {
    /// Regular files archived with their data.
    pub files: u64,
    /// Directories archived (the source itself included).
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    /// Bytes of regular-file data archived.
    pub bytes: u64,
    /// Names left out: sockets, FIFOs, devices, names that vanished while the tree was walked.
    pub skipped: u64,
    /// Files that shrank while being read (their tail was archived as zeros).
    pub changed: u64,
}

/// How an exec ended in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    Exited,
    Signaled,
    TimedOut,
    OomKilled,
    SpawnFailed,
    /// Its end could not be observed (see `outcome::classify`).
    Lost,
}

/// A captured stream without its bytes (they are in the payload).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamMeta {
    pub len: u64,
    pub truncated: bool,
    pub total_bytes: u64,
    pub spill_path: Option<String>,
}

/// The final record of an exec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecExit {
    pub status: ExitStatus,
    pub exit_code: i32,
    pub signal: i32,
    pub duration_ms: u64,
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub peak_memory_bytes: u64,
    pub stdout: StreamMeta,
    pub stderr: StreamMeta,
    /// A sentence for SPAWN_FAILED.
    pub error: String,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The frame could not be understood.
    BadRequest,
    NotFound,
    InvalidPath,
    DiskFull,
    NoSuchExec,
    Internal,
}

/// A frame as it travels: header bytes are JSON of an [`Envelope`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    pub header: Vec<u8>,
    pub payload: Vec<u8>,
}

impl RawFrame {
    /// Parses the header as an envelope of `M`.
    pub fn envelope<M: for<'de> Deserialize<'de>>(&self) -> Result<Envelope<M>, serde_json::Error> {
        serde_json::from_slice(&self.header)
    }
}

/// Errors building a frame.
#[derive(Debug)]
pub enum EncodeError {
    Json(serde_json::Error),
    TooLarge { what: &'static str, len: usize, max: u32 },
}

impl std::error::Error for EncodeError {}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EncodeError::Json(e) => write!(f, "cannot encode frame header: {e}"),
            EncodeError::TooLarge { what, len, max } => write!(f, "frame {what} of {len} bytes exceeds the limit of {max}"),
        }
    }
}

/// Encodes one frame.
pub fn encode<M: Serialize>(id: u64, msg: &M, payload: &[u8]) -> Result<Vec<u8>, EncodeError> {
    let header = serde_json::to_vec(&Envelope { id, msg }).map_err(EncodeError::Json)?;
    if header.len() > MAX_HEADER as usize {
        return Err(EncodeError::TooLarge { what: "header", len: header.len(), max: MAX_HEADER });
    }
    if payload.len() > MAX_PAYLOAD as usize {
        return Err(EncodeError::TooLarge { what: "payload", len: payload.len(), max: MAX_PAYLOAD });
    }
    let mut out = Vec::with_capacity(PREFIX_LEN + header.len() + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    Ok(out)
}

/// What the decoder found in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    Frame(RawFrame),
    /// Bytes that were not a valid frame were skipped; the decoder is looking for the next magic.
    Garbage {
        skipped: usize,
        reason: String,
    },
}

/// Incremental, resynchronizing frame decoder (no I/O: feed it what was read).
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
}

impl Decoder {
    pub fn new() -> Self {
        Decoder::default()
    }

    /// Adds bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held, waiting for the rest of a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame or garbage report, or `None` until more bytes arrive.
    // Not an `Iterator`: `None` means "not yet", and the same decoder yields more after a push.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Decoded> {
        if self.buf.is_empty() {
            return None;
        }
        // Find the magic; everything before it is garbage.
        let start = match find_magic(&self.buf) {
            Some(0) => 0,
            Some(at) => return Some(self.skip(at, "bytes before the frame magic")),
            None => {
                // Keep a possible partial magic at the end.
                let keep = partial_magic_suffix(&self.buf);
                let skipped = self.buf.len() - keep;
                if skipped == 0 {
                    return None;
                }
                return Some(self.skip(skipped, "no frame magic"));
            }
        };
        debug_assert_eq!(start, 0);
        if self.buf.len() < PREFIX_LEN {
            return None;
        }
        let header_len = u32::from_be_bytes([self.buf[4], self.buf[5], self.buf[6], self.buf[7]]);
        let payload_len = u32::from_be_bytes([self.buf[8], self.buf[9], self.buf[10], self.buf[11]]);
        if header_len == 0 || header_len > MAX_HEADER {
            return Some(self.skip(MAGIC.len(), &format!("header length {header_len} outside 1..={MAX_HEADER}")));
        }
        if payload_len > MAX_PAYLOAD {
            return Some(self.skip(MAGIC.len(), &format!("payload length {payload_len} over {MAX_PAYLOAD}")));
        }
        let total = PREFIX_LEN + header_len as usize + payload_len as usize;
        if self.buf.len() < total {
            return None;
        }
        let header = self.buf[PREFIX_LEN..PREFIX_LEN + header_len as usize].to_vec();
        let payload = self.buf[PREFIX_LEN + header_len as usize..total].to_vec();
        self.buf.drain(..total);
        Some(Decoded::Frame(RawFrame { header, payload }))
    }

    fn skip(&mut self, n: usize, reason: &str) -> Decoded {
        self.buf.drain(..n);
        Decoded::Garbage { skipped: n, reason: reason.to_string() }
    }
}

fn find_magic(buf: &[u8]) -> Option<usize> {
    buf.windows(MAGIC.len()).position(|w| w == MAGIC)
}

/// Length of the longest suffix of `buf` that is a proper prefix of the magic.
fn partial_magic_suffix(buf: &[u8]) -> usize {
    (1..MAGIC.len()).rev().find(|&n| buf.len() >= n && buf[buf.len() - n..] == MAGIC[..n]).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(d: &mut Decoder) -> Vec<Decoded> {
        std::iter::from_fn(|| d.next()).collect()
    }

    #[test]
    fn round_trip_request_and_response() {
        let req = Request::Exec(ExecRequest {
            exec_id: "ex-1".into(),
            argv: vec!["echo".into(), "hi".into()],
            env: vec![("A".into(), "b".into())],
            workdir: "/work".into(),
            timeout_ms: 1000,
            max_output_bytes: 1 << 20,
            io_drain_ms: 300,
            stream: true,
            user: Some("app:staff".into()),
        });
        let bytes = encode(7, &req, b"stdin bytes").expect("encode");
        let mut d = Decoder::new();
        d.push(&bytes);
        let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
        let env: Envelope<Request> = f.envelope().expect("parse");
        assert_eq!(env.id, 7);
        assert_eq!(env.msg, req);
        assert_eq!(f.payload, b"stdin bytes");
        assert_eq!(d.next(), None);

        let resp = Response::Exited(ExecExit {
            status: ExitStatus::Exited,
            exit_code: 3,
            signal: 0,
            duration_ms: 5,
            cpu_user_ms: 1,
            cpu_system_ms: 2,
            peak_memory_bytes: 4096,
            stdout: StreamMeta { len: 2, ..Default::default() },
            stderr: StreamMeta::default(),
            error: String::new(),
        });
        d.push(&encode(7, &resp, b"hi").expect("encode"));
        let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
        assert_eq!(f.envelope::<Response>().expect("parse").msg, resp);
        assert!(resp.is_final());
        assert!(!Response::Started.is_final());
    }

    #[test]
    fn frames_split_at_every_byte_boundary_decode_the_same() {
        let a = encode(1, &Request::Hello, b"").expect("encode");
        let b = encode(2, &Request::ReadFile { path: "/x".into(), offset: 0, limit: 10 }, b"").expect("encode");
        let stream: Vec<u8> = [a, b].concat();
        for split in 0..stream.len() {
            let mut d = Decoder::new();
            d.push(&stream[..split]);
            let mut got = frames(&mut d);
            d.push(&stream[split..]);
            got.extend(frames(&mut d));
            let ids: Vec<u64> = got
                .iter()
                .map(|g| match g {
                    Decoded::Frame(f) => f.envelope::<Request>().expect("parse").id,
                    Decoded::Garbage { .. } => panic!("garbage at split {split}"),
                })
                .collect();
            assert_eq!(ids, [1, 2], "split at {split}");
        }
    }

    #[test]
    fn version_2_requests_round_trip_and_version_1_ones_are_unchanged() {
        let staged = Request::WriteStaged { transfer: "t1".into(), path: "/w/f".into(), mode: 0o644, offset: 0, commit: true };
        let json = serde_json::to_value(Envelope { id: 1, msg: &staged }).expect("json");
        assert_eq!(json["msg"]["type"], "write_staged");
        for req in [staged, Request::AbortWrite { transfer: "t1".into() }, Request::RemoveFile { path: "/w/f".into() }] {
            let mut d = Decoder::new();
            d.push(&encode(4, &req, b"x").expect("encode"));
            let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
            assert_eq!(f.envelope::<Request>().expect("parse").msg, req);
        }
        // What a version-1 host sends still parses the same.
        let v1 = br#"{"id":3,"msg":{"type":"write_file","path":"/f","mode":420,"append":false}}"#;
        let env: Envelope<Request> = serde_json::from_slice(v1).expect("v1 write_file");
        assert_eq!(env.msg, Request::WriteFile { path: "/f".into(), mode: 0o644, append: false });
        const { assert!(MIN_VERSION <= VERSION) };
    }

    #[test]
    fn version_5_configure_carries_the_shm_size_and_older_ones_parse_as_before() {
        let limits = GuestLimits {
            memory_bytes: 1 << 30,
            max_pids: 64,
            cpu_millicores: 1000,
            hostname: "sb-1".into(),
            workdir: "/w".into(),
            shm_bytes: 512 << 20,
            network: None,
            machine_id: String::new(),
        };
        let json = serde_json::to_value(Envelope { id: 1, msg: &Request::Configure(limits.clone()) }).expect("json");
        assert_eq!((json["msg"]["type"].as_str(), json["msg"]["shm_bytes"].as_u64()), (Some("configure"), Some(512 << 20)));
        // No network: no field at all, so an agent of 6 or older reads exactly what it knows.
        assert!(json["msg"].get("network").is_none(), "{json}");
        let mut d = Decoder::new();
        d.push(&encode(1, &Request::Configure(limits.clone()), b"").expect("encode"));
        let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
        assert_eq!(f.envelope::<Request>().expect("parse").msg, Request::Configure(limits));
        // A host of protocol 4 sends no size: 0, which leaves /dev/shm as it is.
        let v4 = br#"{"id":2,"msg":{"type":"configure","memory_bytes":1,"max_pids":2,"cpu_millicores":3,"hostname":"h","workdir":"/w"}}"#;
        let Request::Configure(old) = serde_json::from_slice::<Envelope<Request>>(v4).expect("v4 configure").msg else { panic!("not configure") };
        assert_eq!(old.shm_bytes, 0);
        const { assert!(VERSION >= 5) };
    }

    #[test]
    fn version_3_session_requests_round_trip_with_their_exact_shapes() {
        let exec = ExecRequest {
            exec_id: "ex-s".into(),
            argv: vec!["sh".into()],
            env: vec![],
            workdir: "/".into(),
            timeout_ms: 0,
            max_output_bytes: 1 << 20,
            io_drain_ms: 300,
            stream: true,
            user: None,
        };
        let session = Request::ExecSession { exec: exec.clone(), tty: Some((24, 80)), interactive: true };
        let json = serde_json::to_value(Envelope { id: 1, msg: &session }).expect("json");
        assert_eq!(json["msg"]["type"], "exec_session");
        assert_eq!(json["msg"]["tty"], serde_json::json!([24, 80]));
        assert_eq!(json["msg"]["interactive"], true);
        assert_eq!(json["msg"]["exec"]["exec_id"], "ex-s");
        let resize = Request::Resize { exec_id: "ex-s".into(), rows: 50, cols: 132 };
        assert_eq!(serde_json::to_value(&resize).expect("json"), serde_json::json!({"type": "resize", "exec_id": "ex-s", "rows": 50, "cols": 132}));
        assert_eq!(
            serde_json::to_value(Request::CloseStdin { exec_id: "e".into() }).expect("json"),
            serde_json::json!({"type": "close_stdin", "exec_id": "e"})
        );
        assert_eq!(serde_json::to_value(Request::Stdin { exec_id: "e".into() }).expect("json"), serde_json::json!({"type": "stdin", "exec_id": "e"}));
        for req in [session, resize, Request::Stdin { exec_id: "ex-s".into() }, Request::CloseStdin { exec_id: "ex-s".into() }] {
            let mut d = Decoder::new();
            d.push(&encode(4, &req, b"\x03typed").expect("encode"));
            let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
            assert_eq!(f.envelope::<Request>().expect("parse").msg, req);
            assert_eq!(f.payload, b"\x03typed");
        }
        // `tty` and `interactive` may be left out: a plain exec, as a session.
        let minimal = serde_json::json!({"type": "exec_session", "exec": serde_json::to_value(&exec).expect("json")});
        let parsed: Request = serde_json::from_value(minimal).expect("defaults");
        assert_eq!(parsed, Request::ExecSession { exec: exec.clone(), tty: None, interactive: false });
        // A version-2 exec is unchanged.
        let v2 = serde_json::json!({"type": "exec", "exec_id": "ex-s", "argv": ["sh"], "env": [], "workdir": "/", "timeout_ms": 0, "max_output_bytes": 1048576, "io_drain_ms": 300, "stream": true});
        assert_eq!(serde_json::from_value::<Request>(v2).expect("v2 exec"), Request::Exec(exec));
        // A bad size is refused at parse time, before reaching any terminal.
        assert!(serde_json::from_value::<Request>(serde_json::json!({"type": "resize", "exec_id": "e", "rows": 70000, "cols": 1})).is_err());
        const { assert!(MAX_INPUT_BYTES >= STDIN_CHUNK && MAX_INPUT_BYTES <= MAX_PAYLOAD as usize) };
    }

    #[test]
    fn version_4_archive_messages_round_trip_with_their_exact_shapes() {
        let piece = Request::UploadArchive { transfer: "a1".into(), dest: "/work/dst".into(), offset: 1 << 20, last: true };
        assert_eq!(
            serde_json::to_value(&piece).expect("json"),
            serde_json::json!({"type": "upload_archive", "transfer": "a1", "dest": "/work/dst", "offset": 1048576, "last": true})
        );
        let download = Request::DownloadArchive { transfer: "a2".into(), path: "/work/src".into() };
        assert_eq!(serde_json::to_value(&download).expect("json"), serde_json::json!({"type": "download_archive", "transfer": "a2", "path": "/work/src"}));
        for req in [piece, download] {
            let mut d = Decoder::new();
            d.push(&encode(11, &req, b"tar bytes").expect("encode"));
            let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
            assert_eq!(f.envelope::<Request>().expect("parse").msg, req);
            assert_eq!(f.payload, b"tar bytes");
        }
        let extracted = Response::Extracted(ArchiveExtracted { files: 3, dirs: 2, symlinks: 1, hardlinks: 0, bytes: 42 });
        assert_eq!(
            serde_json::to_value(&extracted).expect("json"),
            serde_json::json!({"type": "extracted", "files": 3, "dirs": 2, "symlinks": 1, "hardlinks": 0, "bytes": 42})
        );
        assert_eq!(serde_json::to_value(Response::ArchiveData).expect("json"), serde_json::json!({"type": "archive_data"}));
        let end = Response::ArchiveEnd(ArchiveCreated { files: 1, dirs: 1, skipped: 2, changed: 1, ..Default::default() });
        assert_eq!(serde_json::to_value(&end).expect("json")["type"], "archive_end");
        for resp in [extracted, Response::ArchiveData, end] {
            let mut d = Decoder::new();
            d.push(&encode(12, &resp, b"x").expect("encode"));
            let Some(Decoded::Frame(f)) = d.next() else { panic!("no frame") };
            assert_eq!(f.envelope::<Response>().expect("parse").msg, resp);
        }
        // Data frames are part of a stream; the end and the stats close it.
        assert!(!Response::ArchiveData.is_final());
        assert!(Response::ArchiveEnd(ArchiveCreated::default()).is_final());
        assert!(Response::Extracted(ArchiveExtracted::default()).is_final());
        // Version-2 abort is unchanged (it now drops archive transfers too).
        let v2 = br#"{"id":5,"msg":{"type":"abort_write","transfer":"a1"}}"#;
        assert_eq!(serde_json::from_slice::<Envelope<Request>>(v2).expect("v2 abort").msg, Request::AbortWrite { transfer: "a1".into() });
        const { assert!(MAX_ARCHIVE_QUEUE_BYTES >= FILE_CHUNK as usize && MAX_ARCHIVE_QUEUE_BYTES <= MAX_PAYLOAD as usize && VERSION >= 4) };
    }

    #[test]
    fn garbage_before_a_frame_is_skipped_and_reported() {
        let mut d = Decoder::new();
        d.push(b"\x00\xffnoise SB");
        d.push(&encode(5, &Request::Thaw, b"").expect("encode"));
        let got = frames(&mut d);
        assert!(matches!(&got[0], Decoded::Garbage { skipped: 10, .. }), "{got:?}");
        let Decoded::Frame(f) = &got[1] else { panic!("{got:?}") };
        assert_eq!(f.envelope::<Request>().expect("parse").msg, Request::Thaw);
    }

    #[test]
    fn oversized_lengths_never_allocate_and_resync() {
        let mut d = Decoder::new();
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&u32::MAX.to_be_bytes());
        bad.extend_from_slice(&u32::MAX.to_be_bytes());
        d.push(&bad);
        let Some(Decoded::Garbage { reason, .. }) = d.next() else { panic!("expected garbage") };
        assert!(reason.contains("header length"), "{reason}");
        let mut huge_payload = MAGIC.to_vec();
        huge_payload.extend_from_slice(&2u32.to_be_bytes());
        huge_payload.extend_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        d.push(&huge_payload);
        d.push(&encode(9, &Request::Freeze, b"").expect("encode"));
        let got = frames(&mut d);
        assert!(got.iter().any(|g| matches!(g, Decoded::Garbage { reason, .. } if reason.contains("payload length"))), "{got:?}");
        let Some(Decoded::Frame(f)) = got.last() else { panic!("{got:?}") };
        assert_eq!(f.envelope::<Request>().expect("parse").id, 9);
        assert!(d.buffered() == 0);
    }

    #[test]
    fn a_valid_frame_with_a_bad_header_is_a_frame_whose_envelope_fails() {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&5u32.to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
        bytes.extend_from_slice(b"{nope");
        let mut d = Decoder::new();
        d.push(&bytes);
        let Some(Decoded::Frame(f)) = d.next() else { panic!("expected a frame") };
        assert!(f.envelope::<Request>().is_err());
        let unknown = encode(3, &serde_json::json!({"type": "format_disk"}), b"").expect("encode");
        d.push(&unknown);
        let Some(Decoded::Frame(f)) = d.next() else { panic!("expected a frame") };
        assert!(f.envelope::<Request>().is_err());
    }

    #[test]
    fn random_bytes_never_panic_and_buffer_stays_bounded() {
        // A deterministic xorshift stream of junk, with magics sprinkled in.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut d = Decoder::new();
        for round in 0..2000 {
            let mut chunk = Vec::new();
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                chunk.push(x as u8);
            }
            if round % 7 == 0 {
                chunk.splice(10..10, MAGIC);
            }
            d.push(&chunk);
            while let Some(ev) = d.next() {
                if let Decoded::Frame(f) = ev {
                    let _ = f.envelope::<Request>();
                    let _ = f.envelope::<Response>();
                }
            }
            assert!(d.buffered() <= PREFIX_LEN + (MAX_HEADER + MAX_PAYLOAD) as usize);
        }
        assert!(encode(1, &Request::Hello, &vec![0; MAX_PAYLOAD as usize + 1]).is_err());
    }
}
