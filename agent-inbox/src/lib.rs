//! The operator inbox of an `sbx agent` run: its on-disk format, its bounds, and its crash-safe
//! writer and reader.
//!
//! The command line (`sbx agent steer` / `stop`), the operator's page (`sandboxd --web`) and the
//! run talk through the run's directory, so a request works from another process and while the
//! run is down. A request is one file `<run dir>/inbox/<id>.json`, written under a temporary
//! name, made durable and renamed into place, so a reader sees all of it or nothing. The loop
//! reads the inbox at step boundaries, records what it applied in its checkpoint, and only then
//! removes the files (agent-client's `runner::operator`), so each request takes effect once.
//!
//! Both sides treat the other as untrusted. The reader takes only `<id>.json` with a plain id;
//! links, other non-regular files, oversized, malformed or mislabelled files are rejected. The
//! writer may run as root (the daemon's page) in a directory a user owns: it walks from the
//! state directory to the inbox with `openat(O_NOFOLLOW)` one component at a time, creates its
//! temporary with `O_EXCL`, renames inside the inbox it opened, and gives what it creates to
//! the run directory's owner, so a link swapped in anywhere below the state directory never
//! makes it write elsewhere, and the run can remove what it took.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use serde::{Deserialize, Serialize};

/// The inbox directory inside a run's directory.
pub const INBOX_DIR: &str = "inbox";
/// Longest steer message, bytes.
pub const MAX_MESSAGE_BYTES: usize = 4_000;
/// Longest stop reason, bytes.
pub const MAX_REASON_BYTES: usize = 1_000;
/// Requests that may wait in an inbox at once; the loop also takes at most this many per
/// boundary.
pub const MAX_PENDING: usize = 16;
/// Largest request file read: a message of [`MAX_MESSAGE_BYTES`] with JSON escaping fits.
pub const MAX_FILE_BYTES: u64 = 32 * 1024;
/// Longest request id.
const MAX_ID_CHARS: usize = 64;
/// Longest run id.
pub const MAX_RUN_ID_CHARS: usize = 64;
const SUFFIX: &str = ".json";

/// The stop reasons (as a checkpoint's `outcome.reason` names them) after which `sbx agent
/// resume` may pick a run up again: such a run still takes requests, applied on resume. Any
/// other outcome ends the run for good.
pub const RESUMABLE_REASONS: &[&str] = &["fatal_error"];

/// Whether a run whose checkpoint has `outcome_reason` (None: no outcome, the run goes on)
/// still takes operator requests.
pub fn takes_requests(outcome_reason: Option<&str>) -> bool {
    outcome_reason.is_none_or(|r| RESUMABLE_REASONS.contains(&r))
}

/// What can go wrong writing or checking a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run id that could leave the runs directory, or is not one `sbx agent` makes.
    #[error("invalid run id {0:?}: 1-64 ASCII letters, digits, '.', '_' or '-', not starting with '.'")]
    InvalidRunId(String),
    /// A steer without text.
    #[error("the steer message is empty")]
    EmptyMessage,
    /// A steer too long.
    #[error("the steer message is {len} bytes; at most {MAX_MESSAGE_BYTES}")]
    MessageTooLong {
        /// Its length.
        len: usize,
    },
    /// A stop reason too long.
    #[error("the stop reason is {len} bytes; at most {MAX_REASON_BYTES}")]
    ReasonTooLong {
        /// Its length.
        len: usize,
    },
    /// Too many requests wait already.
    #[error("{pending} operator requests are waiting already (at most {MAX_PENDING}); the run takes them at its next step boundary")]
    Full {
        /// Requests waiting.
        pending: usize,
    },
    /// An I/O error on the inbox.
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
}

/// Checks a run id before it becomes part of a path: 1-64 ASCII letters, digits, `.`, `_` or
/// `-`, not starting with `.` (so never `.`, `..`, a hidden name, a `/` or a NUL).
pub fn valid_run_id(id: &str) -> bool {
    (1..=MAX_RUN_ID_CHARS).contains(&id.len()) && !id.starts_with('.') && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// How a stop ends the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopAs {
    /// DONE (`sbx agent stop --done`).
    Done,
    /// FAILED (`sbx agent stop --failed`, the default).
    Failed,
}

/// What the operator asks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Command {
    /// A correction put into the model's context at the next boundary.
    Steer {
        /// The text.
        message: String,
    },
    /// End the run at the next boundary, with the salvage of any end.
    Stop {
        /// DONE or FAILED.
        status: StopAs,
        /// Why, in the operator's words.
        #[serde(default)]
        reason: Option<String>,
    },
}

impl Command {
    /// `steer` or `stop`.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Steer { .. } => "steer",
            Command::Stop { .. } => "stop",
        }
    }

    /// Checks the bounds: a request outside them is refused by the sender and rejected by the
    /// run.
    pub fn check(&self) -> Result<(), Error> {
        match self {
            Command::Steer { message } if message.trim().is_empty() => Err(Error::EmptyMessage),
            Command::Steer { message } if message.len() > MAX_MESSAGE_BYTES => Err(Error::MessageTooLong { len: message.len() }),
            Command::Stop { reason: Some(r), .. } if r.len() > MAX_REASON_BYTES => Err(Error::ReasonTooLong { len: r.len() }),
            _ => Ok(()),
        }
    }
}

/// One request file's content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Its id, also its file name.
    pub id: String,
    /// When it was sent, ms since the epoch.
    pub sent_at_ms: u64,
    /// What it asks.
    #[serde(flatten)]
    pub command: Command,
}

/// Checks a request id before it becomes part of a path: 1-64 ASCII letters, digits, `-` or
/// `_`, starting with a letter or digit.
pub fn valid_request_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_CHARS
        && id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// A fresh request id: `op-<ns since the epoch, 20 digits>-<random>`, so names sort in the
/// order they were sent (requests sent in one go by one process included).
pub fn new_request_id() -> String {
    let ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("op-{ns:020}-{:06x}", rand::random::<u32>() & 0xff_ffff)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The file name of request `id`.
pub fn file_name(id: &str) -> String {
    format!("{id}{SUFFIX}")
}

/// The id in a request file name, if it is one.
fn request_id_of(name: &str) -> Option<&str> {
    name.strip_suffix(SUFFIX).filter(|id| valid_request_id(id))
}

/// What the loop finds in the inbox.
#[derive(Clone, Debug, PartialEq)]
pub enum Incoming {
    /// A well-formed request.
    Request(Request),
    /// A file that is not one, with the reason; removed like a taken request.
    Rejected {
        /// The file name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
}

/// A run's inbox directory.
#[derive(Clone, Debug)]
pub struct Inbox {
    /// Where the walk to the run directory starts (trusted: the caller's own directory, or
    /// the one the operator configured).
    root: PathBuf,
    /// The components from `root` to the run directory, each opened without following a link.
    below: Vec<String>,
    /// `root/below…/inbox`, for the reader.
    dir: PathBuf,
}

impl Inbox {
    /// The inbox of the run whose directory is `run_dir` (only its last component is opened
    /// without following a link when writing).
    pub fn of(run_dir: &Path) -> Self {
        Inbox { root: run_dir.to_path_buf(), below: Vec::new(), dir: run_dir.join(INBOX_DIR) }
    }

    /// The inbox of run `run_id` under the state directory `state_dir`
    /// (`<state_dir>/runs/<run_id>/inbox`): the run id is checked, and a writer opens `runs`
    /// and the run's directory without following links.
    pub fn of_run(state_dir: &Path, run_id: &str) -> Result<Self, Error> {
        if !valid_run_id(run_id) {
            return Err(Error::InvalidRunId(run_id.chars().take(80).collect()));
        }
        Ok(Inbox { root: state_dir.to_path_buf(), below: vec!["runs".to_owned(), run_id.to_owned()], dir: state_dir.join("runs").join(run_id).join(INBOX_DIR) })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of request `id`.
    pub fn path_of(&self, id: &str) -> PathBuf {
        self.dir.join(file_name(id))
    }

    fn io(&self, what: &'static str, path: &Path, e: Errno) -> Error {
        let source = match e {
            Errno::ELOOP | Errno::ENOTDIR => {
                std::io::Error::other("not a plain directory (a link or a file in its place): the inbox must be a plain directory")
            }
            e => std::io::Error::from(e),
        };
        Error::Io { what, path: path.to_path_buf(), source }
    }

    /// The run directory, opened: `root`, then each component below it with `O_NOFOLLOW`.
    fn open_run_dir(&self) -> Result<OwnedFd, Error> {
        let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let mut fd = open_at(None, self.root.as_os_str(), dir_flags, Mode::empty()).map_err(|e| self.io("cannot open", &self.root, e))?;
        let mut path = self.root.clone();
        for part in &self.below {
            path.push(part);
            fd = open_at(Some(&fd), OsStr::new(part), dir_flags | OFlag::O_NOFOLLOW, Mode::empty()).map_err(|e| self.io("cannot open", &path, e))?;
        }
        Ok(fd)
    }

    /// The inbox directory, opened without following a link; created first (owned like the
    /// run directory) when `create`.
    fn open_inbox(&self, create: bool) -> Result<(OwnedFd, Owner), Error> {
        let run = self.open_run_dir()?;
        let owner = Owner::of(&run).map_err(|e| self.io("cannot look at", &self.root, e))?;
        if create {
            match nix::sys::stat::mkdirat(Some(run.as_raw_fd()), INBOX_DIR, Mode::from_bits_truncate(0o700)) {
                Ok(()) => owner.give_at(&run, INBOX_DIR).map_err(|e| self.io("cannot give to the run's owner", &self.dir, e))?,
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(self.io("cannot create", &self.dir, e)),
            }
        }
        let fd = open_at(Some(&run), OsStr::new(INBOX_DIR), OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| self.io("cannot open", &self.dir, e))?;
        Ok((fd, owner))
    }

    /// Creates the directory if missing (the run's directory must exist); refuses anything
    /// but a real directory in its place.
    pub fn create(&self) -> Result<(), Error> {
        self.open_inbox(true).map(drop)
    }

    /// Writes `command` into the inbox as a new request and returns it: checked against the
    /// bounds, refused when [`MAX_PENDING`] wait already, then written under a temporary name,
    /// made durable and renamed into place (then the directory made durable), so the run sees
    /// all of it or nothing, and a crash of the writer leaves at most a dot file the reader
    /// skips. Whether the run may take requests (it exists, it has not ended) is the caller's
    /// to check, before and after.
    pub fn deliver(&self, command: Command) -> Result<Request, Error> {
        command.check()?;
        let (inbox, owner) = self.open_inbox(true)?;
        let pending = self.pending_in(&inbox)?;
        if pending >= MAX_PENDING {
            return Err(Error::Full { pending });
        }
        let request = Request { id: new_request_id(), sent_at_ms: now_ms(), command };
        let name = file_name(&request.id);
        let path = self.dir.join(&name);
        let body = serde_json::to_vec(&request).map_err(|e| Error::Io { what: "cannot encode", path: path.clone(), source: std::io::Error::other(e) })?;
        // Unique without a lock: the id is.
        let tmp = format!(".{name}.tmp-{}", std::process::id());
        let tmp_path = self.dir.join(&tmp);
        let fd = open_at(
            Some(&inbox),
            OsStr::new(&tmp),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| self.io("cannot create", &tmp_path, e))?;
        let written = owner.give(&fd).map_err(|e| self.io("cannot give to the run's owner", &tmp_path, e)).and_then(|()| {
            let mut file = File::from(fd);
            // Data first, then the name: a rename that reaches the disk before the data
            // would leave an empty request under the real name after a power loss.
            file.write_all(&body).and_then(|()| file.sync_data()).map_err(|source| Error::Io { what: "cannot write", path: tmp_path.clone(), source })
        });
        if let Err(e) = written {
            if let Err(rm) = nix::unistd::unlinkat(Some(inbox.as_raw_fd()), tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir) {
                tracing::warn!(path = %tmp_path.display(), error = %rm, "cannot remove a failed request write");
            }
            return Err(e);
        }
        nix::fcntl::renameat(Some(inbox.as_raw_fd()), tmp.as_str(), Some(inbox.as_raw_fd()), name.as_str())
            .map_err(|e| self.io("cannot rename into", &path, e))?;
        nix::unistd::fsync(inbox.as_raw_fd()).map_err(|e| self.io("cannot fsync directory", &self.dir, e))?;
        Ok(request)
    }

    /// Takes back request `id` (a run that ended meanwhile will never read it). Whether it was
    /// still there: false when the run took it first.
    pub fn withdraw(&self, id: &str) -> Result<bool, Error> {
        if !valid_request_id(id) {
            return Ok(false);
        }
        let (inbox, _) = self.open_inbox(false)?;
        match nix::unistd::unlinkat(Some(inbox.as_raw_fd()), file_name(id).as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(self.io("cannot withdraw", &self.path_of(id), e)),
        }
    }

    /// Requests waiting in the opened inbox.
    fn pending_in(&self, inbox: &OwnedFd) -> Result<usize, Error> {
        let dir = nix::dir::Dir::openat(Some(inbox.as_raw_fd()), ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| self.io("cannot list", &self.dir, e))?;
        let mut dir = dir;
        Ok(dir.iter().filter_map(Result::ok).filter(|e| std::str::from_utf8(e.file_name().to_bytes()).ok().and_then(request_id_of).is_some()).count())
    }

    /// The ids of the requests waiting, oldest first. A missing inbox holds none.
    pub fn pending(&self) -> Result<Vec<String>, Error> {
        Ok(self.names()?.into_iter().filter_map(|n| request_id_of(&n).map(str::to_owned)).collect())
    }

    /// Names in the inbox other than temporaries of a write in progress (dot files) and
    /// directories, sorted (request ids sort in the order they were sent).
    fn names(&self) -> Result<Vec<String>, Error> {
        // A link in the inbox's place would have the loop read and remove files elsewhere.
        match fs::symlink_metadata(&self.dir) {
            Ok(meta) if !meta.is_dir() => {
                return Err(Error::Io {
                    what: "not a directory:",
                    path: self.dir.clone(),
                    source: std::io::Error::other("the inbox must be a plain directory"),
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(Error::Io { what: "cannot look at", path: self.dir.clone(), source }),
        }
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(Error::Io { what: "cannot list", path: self.dir.clone(), source }),
        };
        let mut names: Vec<String> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Reads up to `limit` entries, oldest first, without removing anything: the caller
    /// removes each with [`Inbox::discard`] once what it did about it is durable.
    pub fn read_batch(&self, limit: usize) -> Vec<Incoming> {
        let names = match self.names() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the operator inbox");
                return Vec::new();
            }
        };
        names
            .into_iter()
            .take(limit)
            .map(|name| match self.read_one(&name) {
                Ok(r) => Incoming::Request(r),
                Err(why) => Incoming::Rejected { name, why },
            })
            .collect()
    }

    fn read_one(&self, name: &str) -> Result<Request, String> {
        let id = request_id_of(name).ok_or_else(|| "not a request file name (<id>.json with a plain id)".to_owned())?;
        let path = self.dir.join(name);
        // No link is followed, and a FIFO put there cannot block the loop.
        let file =
            OpenOptions::new().read(true).custom_flags(libc_flags::O_NOFOLLOW | libc_flags::O_NONBLOCK).open(&path).map_err(|e| match e.raw_os_error() {
                Some(code) if code == Errno::ELOOP as i32 => "a symbolic link, not a request file".to_owned(),
                _ => format!("cannot open: {e}"),
            })?;
        let meta = file.metadata().map_err(|e| format!("cannot stat: {e}"))?;
        if !meta.is_file() {
            return Err("not a regular file".into());
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(format!("{} bytes; a request file is at most {MAX_FILE_BYTES}", meta.len()));
        }
        let mut bytes = Vec::new();
        read_bounded(file, &mut bytes)?;
        let request: Request = serde_json::from_slice(&bytes).map_err(|e| format!("not a request: {e}"))?;
        if request.id != id {
            return Err(format!("its id {:?} is not its file name", request.id.chars().take(80).collect::<String>()));
        }
        request.command.check().map_err(|e| e.to_string())?;
        Ok(request)
    }

    /// Removes an entry taken (or rejected); one already gone is fine.
    pub fn discard(&self, name: &str) {
        if name.contains('/') || name.starts_with('.') {
            return;
        }
        let path = self.dir.join(name);
        if let Err(e) = fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove an operator request");
            }
        }
    }
}

/// The open flags `OpenOptions::custom_flags` takes, from nix's (no libc dependency here).
mod libc_flags {
    pub const O_NOFOLLOW: i32 = nix::fcntl::OFlag::O_NOFOLLOW.bits();
    pub const O_NONBLOCK: i32 = nix::fcntl::OFlag::O_NONBLOCK.bits();
}

/// `openat(2)` into an owned descriptor.
fn open_at(dir: Option<&OwnedFd>, name: &OsStr, flags: OFlag, mode: Mode) -> Result<OwnedFd, Errno> {
    if name.as_bytes().contains(&0) {
        return Err(Errno::EINVAL);
    }
    let fd = nix::fcntl::openat(dir.map(AsRawFd::as_raw_fd), name, flags, mode)?;
    // SAFETY: openat just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The run directory's owner: what a writer running as root creates is given to it, so the
/// run (its owner) can read and remove it.
#[derive(Clone, Copy, Debug)]
struct Owner {
    uid: nix::unistd::Uid,
    gid: nix::unistd::Gid,
    /// Whether to give anything away: only a writer that is root and not the owner.
    give: bool,
}

impl Owner {
    fn of(dir: &OwnedFd) -> Result<Owner, Errno> {
        let st = nix::sys::stat::fstat(dir.as_raw_fd())?;
        let (uid, gid) = (nix::unistd::Uid::from_raw(st.st_uid), nix::unistd::Gid::from_raw(st.st_gid));
        let me = nix::unistd::geteuid();
        Ok(Owner { uid, gid, give: me.is_root() && (uid != me || gid != nix::unistd::getegid()) })
    }

    fn give(&self, fd: &OwnedFd) -> Result<(), Errno> {
        if self.give {
            nix::unistd::fchown(fd.as_raw_fd(), Some(self.uid), Some(self.gid))?;
        }
        Ok(())
    }

    fn give_at(&self, dir: &OwnedFd, name: &str) -> Result<(), Errno> {
        if self.give {
            nix::unistd::fchownat(Some(dir.as_raw_fd()), name, Some(self.uid), Some(self.gid), AtFlags::AT_SYMLINK_NOFOLLOW)?;
        }
        Ok(())
    }
}

/// Reads at most [`MAX_FILE_BYTES`]: the file may grow after it was looked at.
fn read_bounded(file: File, out: &mut Vec<u8>) -> Result<(), String> {
    file.take(MAX_FILE_BYTES + 1).read_to_end(out).map_err(|e| format!("cannot read: {e}"))?;
    if out.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("a request file is at most {MAX_FILE_BYTES} bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]
    use super::*;

    fn steer(text: &str) -> Command {
        Command::Steer { message: text.into() }
    }

    fn run_dir(state: &Path, id: &str) -> PathBuf {
        let d = state.join("runs").join(id);
        fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn request_ids_are_plain() {
        assert!(valid_request_id("op-0001700000000000-0badcafe"));
        for bad in ["", "../x", "a/b", ".a", "-a", "a b", "é", &"a".repeat(65)] {
            assert!(!valid_request_id(bad), "{bad:?}");
        }
        assert_eq!(request_id_of("a1.json"), Some("a1"));
        assert_eq!(request_id_of("a1.json.json"), None);
        assert_eq!(request_id_of("a1.txt"), None);
    }

    #[test]
    fn run_ids_cannot_leave_the_runs_dir() {
        assert!(valid_run_id("r-1.a_b"));
        assert!(valid_run_id(&"x".repeat(64)));
        for bad in ["", ".", "..", "../r", "r/../../x", "/etc", "/", ".hidden", "a/b", "a%2fb", "a\0b", "a\\b", "é", " r", &"x".repeat(65), &"x".repeat(10_000)]
        {
            assert!(!valid_run_id(bad), "{bad:?}");
            assert!(matches!(Inbox::of_run(Path::new("/tmp"), bad), Err(Error::InvalidRunId(_))), "{bad:?}");
        }
    }

    #[test]
    fn only_a_resumable_end_takes_requests() {
        assert!(takes_requests(None));
        assert!(takes_requests(Some("fatal_error")));
        for ended in ["finished", "operator_done", "operator_failed", "max_steps", ""] {
            assert!(!takes_requests(Some(ended)), "{ended}");
        }
    }

    #[test]
    fn a_delivered_request_reads_back_whole_with_no_temporary_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        run_dir(dir.path(), "r");
        let inbox = Inbox::of_run(dir.path(), "r").expect("inbox");
        let sent = inbox.deliver(steer("use python3")).expect("deliver");
        assert!(valid_request_id(&sent.id));
        let batch = inbox.read_batch(MAX_PENDING);
        assert_eq!(batch, vec![Incoming::Request(sent.clone())]);
        let names: Vec<_> = fs::read_dir(inbox.dir()).expect("dir").filter_map(Result::ok).map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(inbox.withdraw(&sent.id).expect("withdraw"));
        assert!(!inbox.withdraw(&sent.id).expect("withdraw again"), "already gone");
        assert!(inbox.pending().expect("pending").is_empty());
    }

    #[test]
    fn a_link_anywhere_below_the_state_dir_is_never_written_through() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().expect("tempdir");
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir_all(elsewhere.join("r").join(INBOX_DIR)).expect("mkdir");
        // `runs` itself a link.
        let state = dir.path().join("state");
        fs::create_dir(&state).expect("mkdir");
        symlink(&elsewhere, state.join("runs")).expect("symlink");
        let err = Inbox::of_run(&state, "r").expect("inbox").deliver(steer("x")).expect_err("runs is a link");
        assert!(err.to_string().contains("plain directory"), "{err}");
        // The run's directory a link.
        let state2 = dir.path().join("state2");
        fs::create_dir_all(state2.join("runs")).expect("mkdir");
        symlink(elsewhere.join("r"), state2.join("runs").join("r")).expect("symlink");
        assert!(Inbox::of_run(&state2, "r").expect("inbox").deliver(steer("x")).is_err());
        // The inbox a link.
        let state3 = dir.path().join("state3");
        let r = run_dir(&state3, "r");
        symlink(elsewhere.join("r").join(INBOX_DIR), r.join(INBOX_DIR)).expect("symlink");
        let err = Inbox::of_run(&state3, "r").expect("inbox").deliver(steer("x")).expect_err("inbox is a link");
        assert!(err.to_string().contains("plain directory"), "{err}");
        assert_eq!(fs::read_dir(elsewhere.join("r").join(INBOX_DIR)).expect("dir").count(), 0, "nothing written elsewhere");
        // A missing run directory is not created.
        let state4 = dir.path().join("state4");
        fs::create_dir_all(state4.join("runs")).expect("mkdir");
        assert!(Inbox::of_run(&state4, "nope").expect("inbox").deliver(steer("x")).is_err());
        assert!(!state4.join("runs").join("nope").exists());
    }

    #[test]
    fn the_writer_refuses_past_the_bounds() {
        let dir = tempfile::tempdir().expect("tempdir");
        run_dir(dir.path(), "r");
        let inbox = Inbox::of_run(dir.path(), "r").expect("inbox");
        assert!(matches!(inbox.deliver(steer(" \n")), Err(Error::EmptyMessage)));
        assert!(matches!(inbox.deliver(steer(&"x".repeat(MAX_MESSAGE_BYTES + 1))), Err(Error::MessageTooLong { .. })));
        let stop = Command::Stop { status: StopAs::Done, reason: Some("y".repeat(MAX_REASON_BYTES + 1)) };
        assert!(matches!(inbox.deliver(stop), Err(Error::ReasonTooLong { .. })));
        for i in 0..MAX_PENDING {
            inbox.deliver(steer(&format!("m{i}"))).expect("room");
        }
        assert!(matches!(inbox.deliver(steer("one too many")), Err(Error::Full { pending: MAX_PENDING })));
    }

    #[test]
    fn what_a_root_writer_creates_belongs_to_the_runs_owner() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let r = run_dir(dir.path(), "r");
        if !nix::unistd::geteuid().is_root() {
            // As the run's owner (not root) there is nothing to give away: what is written is ours.
            let sent = Inbox::of_run(dir.path(), "r").expect("inbox").deliver(steer("x")).expect("deliver");
            let meta = fs::metadata(r.join(INBOX_DIR).join(file_name(&sent.id))).expect("meta");
            assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
            return;
        }
        nix::unistd::chown(&r, Some(nix::unistd::Uid::from_raw(4321)), Some(nix::unistd::Gid::from_raw(4322))).expect("chown");
        let inbox = Inbox::of_run(dir.path(), "r").expect("inbox");
        let sent = inbox.deliver(steer("x")).expect("deliver");
        for path in [r.join(INBOX_DIR), r.join(INBOX_DIR).join(file_name(&sent.id))] {
            let meta = fs::metadata(&path).expect("meta");
            assert_eq!((meta.uid(), meta.gid()), (4321, 4322), "{}", path.display());
        }
        assert_eq!(fs::metadata(r.join(INBOX_DIR).join(file_name(&sent.id))).expect("meta").mode() & 0o777, 0o600);
    }
}
