//! Directories in and out of a sandbox as tar streams, confined to the sandbox's root.
//!
//! The daemon runs this against a sandbox root opened on the host (the process tier's merged
//! overlay, the container tier's `/proc/<init>/root`) and the microVM guest agent runs it inside
//! the guest against `/`. Both the stream and the tree already in the sandbox are hostile: the
//! archive may name `../x`, `/x`, or write "through" a symlink it planted one entry earlier, and
//! code in the sandbox may have planted symlinks, device nodes and FIFOs and may swap them in
//! while we work. So:
//!
//! - The destination ([`extract`]) and source ([`create`]) paths are the caller's: they resolve
//!   with `openat2(RESOLVE_IN_ROOT)` ([`sys::open_in_root`]), links included, as the sandbox sees
//!   them, never outside the root.
//! - Below them, nothing is ever followed. An entry's parent directories are opened with
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` ([`sys::open_beneath_no_symlinks`]) and everything
//!   else is an `*at` call on one name in a directory opened that way, with `O_NOFOLLOW` or
//!   `AT_SYMLINK_NOFOLLOW`. A symlink in an archive is stored as given (its target is text; the
//!   sandbox resolves it inside its own root) and any later entry whose path crosses it is refused.
//! - Nothing existing is ever opened for writing. A new file is created with
//!   `O_CREAT | O_EXCL | O_NOFOLLOW`; when the name is taken, the file, symlink or hard link is
//!   made under a hidden temporary name and `renameat` over it, so whatever the sandbox put
//!   there (a link, a device, a second name of another file) is replaced, not written through.
//! - Nothing but regular files and directories is opened for reading: a name is looked at with
//!   `O_PATH` first and only a regular file is reopened, through `/proc/self/fd`
//!   ([`sys::reopen_regular_for_reading`]), so a device swapped in is never opened (opening some
//!   devices acts on the hardware).
//! - Kernel pseudo-filesystems (a container's `/proc`, `/sys`) are never written into nor read.
//! - Work is bounded: entries, file bytes, the bytes of headers and long names per entry, depth.
//!
//! Archives are GNU tar (the `tar` crate's `Builder`; GNU long names and link targets past 100
//! bytes). [`create`] names entries like `tar -C SRC -cf - .` does: `./` for the source directory
//! itself, then `a`, `a/b/`, `a/b/c` relative to it, sorted by name in each directory so the same
//! tree gives the same bytes. `tar -C DEST -xf -` and [`extract`] both put SRC's contents in DEST.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{Mode, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid};
use tar::{Archive, Builder, EntryType, Header};

use crate::sys;

/// Most bytes the stream may spend between two entries' data: the header itself, GNU long
/// name and long link entries, PAX extension records, padding, and any data a non-file entry
/// carries. The `tar` crate reads long names and PAX records into memory, so this is also the
/// memory a hostile header can make us allocate.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;

/// Buffer for file data, in both directions.
const COPY_BUF: usize = 256 << 10;

/// Permission bits kept from an archive: set-user-ID and set-group-ID never survive extraction
/// (a setuid binary planted through the daemon would be one more way up), the sticky bit does.
pub const MODE_MASK: u32 = 0o1777;

/// Why an archive could not be extracted or created. Every variant names the entry (as it is
/// spelled in the archive, or relative to the source directory) or the path it is about.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// The entry would leave the destination, pass through a symlink, or land somewhere it must
    /// not (a kernel filesystem, the destination directory itself as a non-directory).
    #[error("{path}: refused: {reason}")]
    Unsafe { path: String, reason: String },
    /// An entry type this module does not create: devices, FIFOs, sparse files, volume labels.
    #[error("{path}: {kind} entries are not supported")]
    Unsupported { path: String, kind: String },
    /// A bound of [`ExtractLimits`] / [`CreateLimits`] (or [`MAX_HEADER_BYTES`]) was reached.
    #[error("{path}: over the limit of {limit} {what}")]
    Limit { path: String, what: &'static str, limit: u64 },
    /// `component` (the destination, or a directory on an entry's path) is not a directory.
    #[error("{path}: `{component}` is not a directory")]
    NotADirectory { path: String, component: String },
    /// The source does not exist in the sandbox.
    #[error("{path}: no such file or directory")]
    NotFound { path: String },
    /// The stream is not a valid tar archive at this point (bad checksum, bad number, truncated
    /// header).
    #[error("{path}: malformed archive: {source}")]
    Malformed { path: String, source: io::Error },
    /// A system call or the stream failed while handling the entry.
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

/// Bounds on the work one [`extract`] may do.
#[derive(Debug, Clone)]
pub struct ExtractLimits {
    /// Entries of any type, the ones refused included (the first one past it is the error).
    pub max_entries: u64,
    /// Total bytes of regular-file data written.
    pub max_total_bytes: u64,
    /// How the header's owners become ids on disk (a user namespace's range; see [`IdShift`]).
    pub ids: IdShift,
}

impl Default for ExtractLimits {
    fn default() -> Self {
        Self { max_entries: 1_000_000, max_total_bytes: 16 << 30, ids: IdShift::default() }
    }
}

/// The ids of a tree as seen from inside a user namespace whose id 0 is `base` outside, over
/// `len` ids: an archive holds the inside ids (what `ls -n` shows in the sandbox), the files on
/// disk are chowned to the outside ones. The default is the identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdShift {
    pub base: u32,
    pub len: u32,
}

impl Default for IdShift {
    fn default() -> Self {
        Self { base: 0, len: u32::MAX }
    }
}

/// What the kernel shows for an id with no mapping in a user namespace.
pub const OVERFLOW_ID: u32 = 65534;

impl IdShift {
    /// The outside id of inside id `id`, if the range maps it.
    pub fn outside(&self, id: u64) -> Option<u32> {
        let id = u32::try_from(id).ok().filter(|&i| i < self.len)?;
        self.base.checked_add(id)
    }

    /// The inside id of outside id `id`; [`OVERFLOW_ID`] when the range does not map it.
    pub fn inside(&self, id: u32) -> u32 {
        id.checked_sub(self.base).filter(|&i| i < self.len).unwrap_or(OVERFLOW_ID)
    }
}

/// What one [`extract`] wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExtractStats {
    /// Regular files written.
    pub files: u64,
    /// Directory entries (created or merged with an existing directory).
    pub dirs: u64,
    /// Symlinks created.
    pub symlinks: u64,
    /// Hard links created.
    pub hardlinks: u64,
    /// Bytes of regular-file data written.
    pub bytes: u64,
}

/// Bounds on the work one [`create`] may do.
#[derive(Debug, Clone)]
pub struct CreateLimits {
    /// Names found in the tree (every directory entry read counts, skipped ones included).
    pub max_entries: u64,
    /// Total bytes of regular-file data archived.
    pub max_total_bytes: u64,
    /// Directory depth below the source. The walk keeps at most [`MAX_OPEN_DIRS`] directories
    /// open whatever the depth; this bounds the work of reopening them and the names held.
    pub max_depth: usize,
    /// How owners on disk become the archive's (inside) owners; see [`IdShift`].
    pub ids: IdShift,
}

impl Default for CreateLimits {
    fn default() -> Self {
        Self { max_entries: 1_000_000, max_total_bytes: 16 << 30, max_depth: 256, ids: IdShift::default() }
    }
}

/// What one [`create`] archived.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CreateStats {
    /// Regular files archived with their data.
    pub files: u64,
    /// Directories archived (the source itself included).
    pub dirs: u64,
    /// Symlinks archived.
    pub symlinks: u64,
    /// Further names of a file already archived, stored as hard links.
    pub hardlinks: u64,
    /// Bytes of regular-file data archived.
    pub bytes: u64,
    /// Names left out: sockets, FIFOs, devices, names that vanished or changed type while
    /// the tree was walked, and the contents of kernel filesystems mounted in the tree.
    pub skipped: u64,
    /// Files that shrank while being read; the missing tail was written as zeros, so the
    /// archive stays well-formed.
    pub changed: u64,
}

/// An error about `path`, from an errno.
fn sys_err(path: &str, e: Errno) -> ArchiveError {
    ArchiveError::Io { path: path.to_string(), source: io::Error::from(e) }
}

/// An error about `path`, from an I/O error.
fn io_err(path: &str) -> impl FnOnce(io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io { path: path.to_string(), source }
}

/// Bytes as text for messages (archive names need not be UTF-8).
fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The components of the caller's destination or source path: absolute inside the root, no
/// `..` (it would resolve inside the root anyway, but "the parent of a link" means something
/// different to a reader than to `RESOLVE_IN_ROOT`).
fn sandbox_path(path: &str) -> Result<Vec<String>, ArchiveError> {
    let unsafe_path = |reason: &str| ArchiveError::Unsafe { path: path.to_string(), reason: reason.to_string() };
    if !path.starts_with('/') {
        return Err(unsafe_path("not an absolute path inside the sandbox"));
    }
    if path.contains('\0') {
        return Err(unsafe_path("NUL byte in the path"));
    }
    let mut comps = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(unsafe_path("`..` component")),
            c => comps.push(c.to_string()),
        }
    }
    Ok(comps)
}

/// The components of an archive member's name below the destination (empty for the
/// destination itself: `.` or `./`). Absolute names and any `..` are refused rather than
/// stripped, so a hostile archive fails loudly instead of half-extracting (GNU tar also refuses
/// members with `..`).
fn member_components(raw: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if raw.is_empty() {
        return Err("empty name");
    }
    if raw[0] == b'/' {
        return Err("absolute path (entries must be relative to the destination)");
    }
    if raw.contains(&0) {
        return Err("NUL byte in the name");
    }
    let mut comps = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("`..` component"),
            c => comps.push(c),
        }
    }
    Ok(comps)
}

/// A name for a C call; callers have already refused NUL bytes.
fn c_name(bytes: &[u8], path: &str) -> Result<CString, ArchiveError> {
    CString::new(bytes).map_err(|_| ArchiveError::Unsafe { path: path.to_string(), reason: "NUL byte in the name".into() })
}

/// Runs `make` with fresh hidden names in a directory until one is free. Used for symlinks and
/// hard links, which are made under a temporary name and renamed over their final one so that
/// whatever had that name is replaced atomically, never followed.
fn with_temp_name(mut make: impl FnMut(&CStr) -> Result<(), Errno>) -> Result<CString, Errno> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    for _ in 0..8 {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(format!(".sbx-archive-{}-{seq}.tmp", std::process::id())).map_err(|_| Errno::EINVAL)?;
        match make(&name) {
            Ok(()) => return Ok(name),
            Err(Errno::EEXIST) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EEXIST)
}

/// Owner, permissions and modification time of an entry, from its header. Shared with the
/// daemon's image layer applier, which keeps more mode bits (`mode_mask`).
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
}

impl Meta {
    /// The header's mode bits within `mode_mask`; blank owner and time fields (some writers
    /// leave them empty) read as 0. A malformed mode is an error.
    pub fn from_header(h: &Header, mode_mask: u32) -> io::Result<Self> {
        Ok(Self { mode: h.mode()? & mode_mask, uid: h.uid().unwrap_or(0), gid: h.gid().unwrap_or(0), mtime: h.mtime().unwrap_or(0) })
    }

    /// The owners moved to the outside ids of `ids`; an owner the range does not map is left
    /// as the extractor's own (not set at all).
    pub fn shifted(self, ids: IdShift) -> Self {
        if ids == IdShift::default() {
            return self;
        }
        match (ids.outside(self.uid), ids.outside(self.gid)) {
            (Some(uid), Some(gid)) => Self { uid: u64::from(uid), gid: u64::from(gid), ..self },
            _ => Self { uid: u64::MAX, gid: u64::MAX, ..self },
        }
    }

    /// Header ids as ids for `chown`; `None` when they do not fit (left as they are then).
    fn ids(&self) -> Option<(Uid, Gid)> {
        Some((Uid::from_raw(u32::try_from(self.uid).ok()?), Gid::from_raw(u32::try_from(self.gid).ok()?)))
    }

    fn mtime(&self) -> TimeSpec {
        TimeSpec::new(i64::try_from(self.mtime).unwrap_or(i64::MAX), 0)
    }

    /// Owner, then mode (a chown clears set-id bits, and the mode must be exactly ours), then
    /// mtime, on an open file or directory.
    pub fn apply_fd(&self, fd: RawFd) -> Result<(), Errno> {
        if let Some((uid, gid)) = self.ids() {
            ignore_chown_refusal(nix::unistd::fchown(fd, Some(uid), Some(gid)))?;
        }
        nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(self.mode))?;
        nix::sys::stat::futimens(fd, &TimeSpec::UTIME_OMIT, &self.mtime())
    }

    /// Owner and mtime of the symlink `name` in `dir` (a symlink has no mode of its own).
    pub fn apply_link(&self, dir: RawFd, name: &CStr) -> Result<(), Errno> {
        if let Some((uid, gid)) = self.ids() {
            ignore_chown_refusal(nix::unistd::fchownat(Some(dir), name, Some(uid), Some(gid), AtFlags::AT_SYMLINK_NOFOLLOW))?;
        }
        nix::sys::stat::utimensat(Some(dir), name, &TimeSpec::UTIME_OMIT, &self.mtime(), UtimensatFlags::NoFollowSymlink)
    }
}

/// Not being allowed to give a file away is fine: an unprivileged extractor keeps its own ids,
/// and an id without a mapping in our user namespace (`EINVAL`) cannot be set by anyone.
fn ignore_chown_refusal(r: Result<(), Errno>) -> Result<(), Errno> {
    match r {
        Ok(()) | Err(Errno::EPERM | Errno::EINVAL) => Ok(()),
        Err(e) => Err(e),
    }
}

/// How many bytes the `tar` crate may pull from the stream before we look again. It reads long
/// names and PAX records into memory whole and skips data of entries we do not read, so
/// without this a single header could make it allocate or read without end. (The daemon's
/// image layers are read through the same meter.)
#[derive(Debug, Default)]
pub struct Budget {
    consumed: Cell<u64>,
    allowed: Cell<u64>,
    tripped: Cell<bool>,
}

impl Budget {
    /// Lets `n` more bytes through from where the stream is now.
    pub fn allow(&self, n: u64) {
        self.allowed.set(self.consumed.get().saturating_add(n));
        self.tripped.set(false);
    }

    /// Whether a read was cut off since the last [`Budget::allow`].
    pub fn tripped(&self) -> bool {
        self.tripped.get()
    }
}

/// The input as the `tar` crate sees it, cut off where the [`Budget`] ends.
pub struct Metered<'b, R> {
    inner: R,
    budget: &'b Budget,
}

impl<'b, R> Metered<'b, R> {
    /// `inner`, metered by `budget`.
    pub fn new(inner: R, budget: &'b Budget) -> Self {
        Metered { inner, budget }
    }
}

impl<R: Read> Read for Metered<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let room = self.budget.allowed.get().saturating_sub(self.budget.consumed.get());
        if room == 0 {
            self.budget.tripped.set(true);
            return Err(io::Error::other("tar read budget exhausted"));
        }
        let want = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.budget.consumed.set(self.budget.consumed.get() + n as u64);
        Ok(n)
    }
}

/// Why an entry's directory could not be opened.
enum WalkError {
    /// This prefix of the path is a symlink.
    Symlink(String),
    /// This prefix of the path is not a directory.
    NotDir(String),
    /// The directory is on a kernel filesystem.
    KernelFs,
    Sys(Errno),
}

impl WalkError {
    fn for_entry(self, path: &str) -> ArchiveError {
        match self {
            WalkError::Symlink(prefix) => {
                ArchiveError::Unsafe { path: path.to_string(), reason: format!("`{prefix}` is a symbolic link, and no entry is written through one") }
            }
            WalkError::NotDir(component) => ArchiveError::NotADirectory { path: path.to_string(), component },
            WalkError::KernelFs => {
                ArchiveError::Unsafe { path: path.to_string(), reason: "it would land on a kernel filesystem (proc, sys, cgroup, ...)".into() }
            }
            WalkError::Sys(e) => sys_err(path, e),
        }
    }
}

/// The directories below the destination, opened without following anything. The last one
/// is kept open: archives list a directory's files together, so most entries reuse it.
struct Tree {
    dest: OwnedFd,
    cached: Option<(Vec<u8>, Rc<OwnedFd>)>,
    /// What the extraction changed so far, oldest first.
    undo: Vec<Undo>,
}

impl Tree {
    /// `O_PATH` descriptor of the directory `dirs` below the destination, missing ones created
    /// (0755) when `create`. A symlink anywhere on the way is an error, not followed; a
    /// directory held open stays inside the sandbox whatever is renamed meanwhile, since the
    /// sandbox cannot move anything out of its own root.
    fn dir(&mut self, dirs: &[&[u8]], create: bool) -> Result<Rc<OwnedFd>, WalkError> {
        let key = dirs.join(&b'/');
        if let Some((k, fd)) = &self.cached {
            if *k == key {
                return Ok(Rc::clone(fd));
            }
        }
        let fd = if dirs.is_empty() {
            self.dest.try_clone().map_err(|e| WalkError::Sys(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?
        } else {
            let rel = CString::new(key.clone()).map_err(|_| WalkError::Sys(Errno::EINVAL))?;
            // One openat2 for the whole path first; the walk below is for what is missing, and
            // for naming the component that is wrong.
            match sys::open_beneath_no_symlinks(self.dest.as_raw_fd(), &rel, libc::O_PATH | libc::O_DIRECTORY) {
                Ok(fd) => fd,
                Err(_) => self.walk(dirs, create)?,
            }
        };
        if sys::on_kernel_fs(fd.as_raw_fd()).map_err(WalkError::Sys)? {
            return Err(WalkError::KernelFs);
        }
        let fd = Rc::new(fd);
        self.cached = Some((key, Rc::clone(&fd)));
        Ok(fd)
    }

    /// One component at a time, creating what is missing.
    fn walk(&mut self, dirs: &[&[u8]], create: bool) -> Result<OwnedFd, WalkError> {
        let mut cur: Option<OwnedFd> = None;
        for (i, comp) in dirs.iter().enumerate() {
            let at = cur.as_ref().map_or(self.dest.as_raw_fd(), |fd| fd.as_raw_fd());
            let name = CString::new(*comp).map_err(|_| WalkError::Sys(Errno::EINVAL))?;
            let prefix = || show(&dirs[..=i].join(&b'/'));
            let mut made = false;
            let next = loop {
                match sys::open_beneath_no_symlinks(at, &name, libc::O_PATH | libc::O_DIRECTORY) {
                    Ok(fd) => break fd,
                    Err(Errno::ENOENT) if create && !made => {
                        made = true;
                        match nix::sys::stat::mkdirat(Some(at), name.as_c_str(), Mode::from_bits_truncate(0o755)) {
                            Ok(()) => {
                                let parents = dirs[..i].iter().map(|d| d.to_vec()).collect();
                                self.undo.push(Undo::Created { dirs: parents, name: name.clone(), dir: true });
                            }
                            Err(Errno::EEXIST) => {}
                            Err(e) => return Err(WalkError::Sys(e)),
                        }
                    }
                    Err(Errno::ELOOP) => return Err(WalkError::Symlink(prefix())),
                    Err(Errno::ENOTDIR) => return Err(WalkError::NotDir(prefix())),
                    Err(e) => return Err(WalkError::Sys(e)),
                }
            };
            cur = Some(next);
        }
        cur.ok_or(WalkError::Sys(Errno::EINVAL))
    }
}

/// A directory whose owner, mode and mtime are set once everything below it is in place:
/// creating children changes a directory's mtime, and a read-only directory must still
/// receive them.
struct PendingDir {
    path: Vec<u8>,
    depth: usize,
    meta: Meta,
    shown: String,
}

/// What an extraction changed, undone in reverse order if it does not complete.
enum Undo {
    /// A name that was free: removed again (a directory only once it is empty).
    Created { dirs: Vec<Vec<u8>>, name: CString, dir: bool },
    /// A name whose old entry was given a second, hidden name (`backup`) before it was
    /// replaced: renamed back over it.
    Replaced { dirs: Vec<Vec<u8>>, name: CString, backup: CString },
}

/// The state of one [`extract`].
struct Extractor<'l> {
    tree: Tree,
    /// Regular files this archive wrote (path below the destination, and which inode), the
    /// only things a hard link entry may point at.
    files: HashMap<Vec<u8>, (u64, u64)>,
    dirs: Vec<PendingDir>,
    stats: ExtractStats,
    limits: &'l ExtractLimits,
    buf: Vec<u8>,
}

/// Extracts the tar stream `input` into the directory `dest` of the sandbox whose root is
/// `root`.
///
/// `dest` is an absolute path inside the root, resolved as the sandbox would (its symlinks
/// followed, confined to the root) and created with its parents (0755) when missing. Below it,
/// entries are placed without following any symlink: an entry whose path crosses one (planted by
/// the sandbox or by an earlier entry) is refused, as are absolute names, `..` components, hard
/// links to anything but a file extracted earlier from this archive, devices, FIFOs and sparse
/// files. The first refusal stops the extraction and undoes it (see [`Staged`]): what it created
/// is removed and what it replaced is put back.
///
/// Regular files, symlinks and hard links replace whatever non-directory has their name (a
/// directory in the way is an error); a directory entry merges with an existing directory and
/// replaces a non-directory. Modes keep the permission and sticky bits only (never set-id),
/// owners come from the header when the process may set them, mtimes are kept (directories'
/// last, deepest first). Global PAX headers are ignored.
///
/// Reading stops at the end-of-archive marker; anything after it is left unread in `input`.
pub fn extract<R: Read>(root: BorrowedFd<'_>, dest: &str, input: R, limits: &ExtractLimits) -> Result<ExtractStats, ArchiveError> {
    extract_staged(root, dest, input, limits)?.commit()
}

/// [`extract`] without its last step: the entries are in place, and the returned [`Staged`]
/// either keeps them ([`Staged::commit`]) or, dropped, takes them out again — for a caller
/// that learns only after the archive's end whether the transfer as a whole completed. On an
/// error the extraction is undone before this returns.
pub fn extract_staged<R: Read>(root: BorrowedFd<'_>, dest: &str, input: R, limits: &ExtractLimits) -> Result<Staged, ArchiveError> {
    let dest_fd = open_dest(root, dest)?;
    let budget = Budget::default();
    budget.allow(MAX_HEADER_BYTES);
    let mut archive = Archive::new(Metered::new(BufReader::with_capacity(COPY_BUF, input), &budget));
    let mut x = Extractor {
        tree: Tree { dest: dest_fd, cached: None, undo: Vec::new() },
        files: HashMap::new(),
        dirs: Vec::new(),
        stats: ExtractStats::default(),
        limits,
        buf: vec![0; COPY_BUF],
    };
    let walked = x.entries(&mut archive, &budget);
    let staged = Staged { tree: x.tree, dirs: x.dirs, stats: x.stats, done: false };
    // Dropping `staged` undoes what the entries before the failing one did.
    walked?;
    Ok(staged)
}

/// An extraction in place but not yet final: committing applies the directories' modes and
/// mtimes and drops the hidden names that kept the replaced entries; dropping it instead
/// removes every name the extraction created (directories once empty) and puts every replaced
/// entry back under its name. Either way only names below the destination are touched, each by
/// an `*at` call in a directory opened without following links.
pub struct Staged {
    tree: Tree,
    dirs: Vec<PendingDir>,
    stats: ExtractStats,
    done: bool,
}

impl Staged {
    /// What the extraction wrote.
    pub fn stats(&self) -> &ExtractStats {
        &self.stats
    }

    /// Keeps the extraction. A directory that cannot take its mode (the sandbox swapped it for
    /// a link meanwhile) is an error, and the extraction is undone.
    pub fn commit(mut self) -> Result<ExtractStats, ArchiveError> {
        finish_dirs(&self.tree, &mut self.dirs)?;
        self.done = true;
        for undo in std::mem::take(&mut self.tree.undo) {
            if let Undo::Replaced { dirs, backup, .. } = undo {
                let comps: Vec<&[u8]> = dirs.iter().map(Vec::as_slice).collect();
                if let Ok(parent) = self.tree.dir(&comps, false) {
                    let _ = sys::unlink_at(parent.as_raw_fd(), &backup);
                }
            }
        }
        Ok(std::mem::take(&mut self.stats))
    }

    /// Undoes the extraction, newest change first. Best effort: a name the sandbox changed
    /// meanwhile, or a directory it put something into, stays. Names and contents come back;
    /// the mtimes of directories names were added to and removed from again do not.
    fn rollback(&mut self) {
        use nix::unistd::UnlinkatFlags;
        while let Some(undo) = self.tree.undo.pop() {
            let (dirs, name) = match &undo {
                Undo::Created { dirs, name, .. } | Undo::Replaced { dirs, name, .. } => (dirs, name),
            };
            let comps: Vec<&[u8]> = dirs.iter().map(Vec::as_slice).collect();
            let Ok(parent) = self.tree.dir(&comps, false) else { continue };
            let pfd = parent.as_raw_fd();
            let _ = match &undo {
                Undo::Created { dir: true, .. } => nix::unistd::unlinkat(Some(pfd), name.as_c_str(), UnlinkatFlags::RemoveDir),
                Undo::Created { dir: false, .. } => nix::unistd::unlinkat(Some(pfd), name.as_c_str(), UnlinkatFlags::NoRemoveDir),
                Undo::Replaced { backup, .. } => nix::fcntl::renameat(Some(pfd), backup.as_c_str(), Some(pfd), name.as_c_str()),
            };
            // A directory removed here may be the one the cache holds.
            drop(parent);
            self.tree.cached = None;
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            self.rollback();
        }
    }
}

/// Opens (creating it and its parents if needed) the destination directory, resolved inside
/// the root.
fn open_dest(root: BorrowedFd<'_>, dest: &str) -> Result<OwnedFd, ArchiveError> {
    let comps = sandbox_path(dest)?;
    let not_dir = || ArchiveError::NotADirectory { path: dest.to_string(), component: dest.to_string() };
    sys::mkdir_all_in_root(root.as_raw_fd(), &comps).map_err(|e| if e == Errno::ENOTDIR { not_dir() } else { sys_err(dest, e) })?;
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    let fd = sys::open_in_root(root.as_raw_fd(), &rel, libc::O_RDONLY | libc::O_DIRECTORY, 0).map_err(|e| match e {
        Errno::ENOTDIR => not_dir(),
        Errno::ENOENT => ArchiveError::NotFound { path: dest.to_string() },
        e => sys_err(dest, e),
    })?;
    if sys::on_kernel_fs(fd.as_raw_fd()).map_err(|e| sys_err(dest, e))? {
        return Err(ArchiveError::Unsafe { path: dest.to_string(), reason: "on a kernel filesystem (proc, sys, cgroup, ...)".into() });
    }
    Ok(fd)
}

impl Extractor<'_> {
    /// Records a name placed in `dirs`: created where there was none, or over an old entry
    /// kept under `backup`.
    fn placed(&mut self, dirs: &[&[u8]], name: CString, backup: Option<CString>) {
        let dirs = dirs.iter().map(|d| d.to_vec()).collect();
        self.tree.undo.push(match backup {
            Some(backup) => Undo::Replaced { dirs, name, backup },
            None => Undo::Created { dirs, name, dir: false },
        });
    }

    /// Every entry of the archive, in order, until the end-of-archive marker or the first error.
    fn entries<R: Read>(&mut self, archive: &mut Archive<R>, budget: &Budget) -> Result<(), ArchiveError> {
        let mut entries = archive.entries().map_err(|source| ArchiveError::Malformed { path: "the first entry".into(), source })?;
        let mut count: u64 = 0;
        let mut prev: Option<String> = None;
        loop {
            budget.allow(MAX_HEADER_BYTES);
            let here = || prev.as_ref().map_or_else(|| "the first entry".to_string(), |p| format!("the entry after `{p}`"));
            let mut entry = match entries.next() {
                None => return Ok(()),
                Some(Ok(entry)) => entry,
                Some(Err(_)) if budget.tripped() => {
                    return Err(ArchiveError::Limit {
                        path: here(),
                        what: "bytes of header, long names and skipped data for one entry",
                        limit: MAX_HEADER_BYTES,
                    });
                }
                Some(Err(source)) => return Err(ArchiveError::Malformed { path: here(), source }),
            };
            let name = entry.path_bytes().into_owned();
            let shown = show(&name);
            count += 1;
            if count > self.limits.max_entries {
                return Err(ArchiveError::Limit { path: shown, what: "entries", limit: self.limits.max_entries });
            }
            self.entry(&mut entry, &name, &shown, budget)?;
            prev = Some(shown);
        }
    }

    fn entry<E: Read>(&mut self, entry: &mut tar::Entry<'_, E>, name: &[u8], shown: &str, budget: &Budget) -> Result<(), ArchiveError> {
        let kind = entry.header().entry_type();
        // A global PAX header (`git archive` writes one with the commit id) describes the
        // archive, not a file; long names and per-file PAX records were already applied by
        // the `tar` crate.
        if kind == EntryType::XGlobalHeader {
            return Ok(());
        }
        let comps = member_components(name).map_err(|reason| ArchiveError::Unsafe { path: shown.to_string(), reason: reason.to_string() })?;
        let meta = Meta::from_header(entry.header(), MODE_MASK)
            .map_err(|source| ArchiveError::Malformed { path: shown.to_string(), source })?
            .shifted(self.limits.ids);
        let unsupported = |kind: &str| Err(ArchiveError::Unsupported { path: shown.to_string(), kind: kind.to_string() });
        match kind {
            // Pre-POSIX archives mark directories with a trailing slash only.
            EntryType::Regular | EntryType::Continuous if name.ends_with(b"/") => self.dir(&comps, shown, meta),
            EntryType::Regular | EntryType::Continuous => {
                let size = entry.size();
                self.file(entry, &comps, shown, meta, size, budget)
            }
            EntryType::Directory => self.dir(&comps, shown, meta),
            EntryType::Symlink => {
                let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                self.symlink(&comps, shown, meta, &target)
            }
            EntryType::Link => {
                let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                self.hardlink(&comps, shown, &target)
            }
            EntryType::Char => unsupported("character device"),
            EntryType::Block => unsupported("block device"),
            EntryType::Fifo => unsupported("FIFO"),
            EntryType::GNUSparse => unsupported("sparse file"),
            other => unsupported(&format!("type {:?}", other.as_byte() as char)),
        }
    }

    /// A regular file. A free name is created with `O_EXCL | O_NOFOLLOW` and filled in place
    /// (as tar does); a taken one is replaced atomically: data into a fresh hidden file beside
    /// it, then a rename over the name, so a program in the sandbox using the old file never
    /// sees half of the new one. Either way nothing that existed is opened.
    fn file<E: Read>(&mut self, data: &mut E, comps: &[&[u8]], shown: &str, meta: Meta, size: u64, budget: &Budget) -> Result<(), ArchiveError> {
        let Some((last, dirs)) = comps.split_last() else {
            return Err(ArchiveError::Unsafe { path: shown.to_string(), reason: "a file cannot replace the destination directory".into() });
        };
        // Before any byte is written, so a file over the limit leaves nothing behind.
        if size > self.limits.max_total_bytes.saturating_sub(self.stats.bytes) {
            return Err(ArchiveError::Limit { path: shown.to_string(), what: "bytes of file data", limit: self.limits.max_total_bytes });
        }
        let name = c_name(last, shown)?;
        let parent = self.tree.dir(dirs, true).map_err(|e| e.for_entry(shown))?;
        let pfd = parent.as_raw_fd();
        let (mut file, temp) = match sys::create_new_at(pfd, &name) {
            Ok(file) => (file, None),
            Err(Errno::EEXIST) => {
                refuse_directory_at(pfd, &name, shown)?;
                let temp = sys::create_temp_in(pfd).map_err(|e| sys_err(shown, e))?;
                (temp.file, Some(temp.name))
            }
            Err(e) => return Err(sys_err(shown, e)),
        };
        let mut backup = None;
        budget.allow(size);
        let written = copy_exact(data, &mut file, size, &mut self.buf).map_err(io_err(shown)).and_then(|()| {
            let fd = file.as_raw_fd();
            meta.apply_fd(fd).map_err(|e| sys_err(shown, e))?;
            let st = sys::fstat_fd(fd).map_err(|e| sys_err(shown, e))?;
            if let Some(temp) = &temp {
                backup = keep_aside(pfd, &name).map_err(|e| sys_err(shown, e))?;
                nix::fcntl::renameat(Some(pfd), temp.as_c_str(), Some(pfd), name.as_c_str()).map_err(|e| sys_err(shown, e))?;
            }
            Ok(st)
        });
        let st = match written {
            Ok(st) => st,
            Err(e) => {
                // The file we made (never anything else: if the sandbox renamed it meanwhile,
                // this removes only a name in its own tree), and the second name we gave the
                // old one.
                let _ = sys::unlink_at(pfd, temp.as_ref().unwrap_or(&name));
                if let Some(backup) = &backup {
                    let _ = sys::unlink_at(pfd, backup);
                }
                return Err(e);
            }
        };
        self.placed(dirs, name, backup);
        self.files.insert(comps.join(&b'/'), (st.st_dev, st.st_ino));
        self.stats.files += 1;
        self.stats.bytes += size;
        Ok(())
    }

    /// A directory: created (0700 until its own mode is applied at the end), or merged with the
    /// existing one; a non-directory of that name (a symlink the sandbox planted, say) is
    /// replaced, as GNU tar does, never followed.
    fn dir(&mut self, comps: &[&[u8]], shown: &str, meta: Meta) -> Result<(), ArchiveError> {
        let path = comps.join(&b'/');
        if let Some((last, dirs)) = comps.split_last() {
            let name = c_name(last, shown)?;
            let parent = self.tree.dir(dirs, true).map_err(|e| e.for_entry(shown))?;
            match make_dir_at(parent.as_raw_fd(), &name).map_err(|e| sys_err(shown, e))? {
                MadeDir::Existing => {}
                MadeDir::Created { replaced } => {
                    let dirs: Vec<Vec<u8>> = dirs.iter().map(|d| d.to_vec()).collect();
                    if let Some(backup) = replaced {
                        self.tree.undo.push(Undo::Replaced { dirs: dirs.clone(), name: name.clone(), backup });
                    }
                    self.tree.undo.push(Undo::Created { dirs, name, dir: true });
                }
            }
        }
        self.files.remove(&path);
        self.dirs.push(PendingDir { path, depth: comps.len(), meta, shown: shown.to_string() });
        self.stats.dirs += 1;
        Ok(())
    }

    /// A symlink, stored as given: nothing follows it here, and the sandbox resolves it inside
    /// its own root.
    fn symlink(&mut self, comps: &[&[u8]], shown: &str, meta: Meta, target: &[u8]) -> Result<(), ArchiveError> {
        let refuse = |reason: &str| ArchiveError::Unsafe { path: shown.to_string(), reason: reason.to_string() };
        if target.is_empty() {
            return Err(refuse("symlink with an empty target"));
        }
        let target = CString::new(target).map_err(|_| refuse("NUL byte in the symlink target"))?;
        let Some((last, dirs)) = comps.split_last() else {
            return Err(refuse("the destination directory cannot become a symlink"));
        };
        let name = c_name(last, shown)?;
        let parent = self.tree.dir(dirs, true).map_err(|e| e.for_entry(shown))?;
        let pfd = parent.as_raw_fd();
        let temp = with_temp_name(|tmp| nix::unistd::symlinkat(target.as_c_str(), Some(pfd), tmp)).map_err(|e| sys_err(shown, e))?;
        let mut backup = None;
        let placed = meta.apply_link(pfd, &temp).and_then(|()| {
            refuse_directory_at(pfd, &name, shown).map_err(|_| Errno::EISDIR)?;
            backup = keep_aside(pfd, &name)?;
            nix::fcntl::renameat(Some(pfd), temp.as_c_str(), Some(pfd), name.as_c_str())
        });
        if let Err(e) = placed {
            let _ = sys::unlink_at(pfd, &temp);
            if let Some(backup) = &backup {
                let _ = sys::unlink_at(pfd, backup);
            }
            return Err(sys_err(shown, e));
        }
        self.placed(dirs, name, backup);
        self.files.remove(&comps.join(&b'/'));
        self.stats.symlinks += 1;
        Ok(())
    }

    /// A hard link: only to a regular file this archive wrote, still the same inode, found
    /// without following anything. Anything else could name a file the sandbox planted as a
    /// second name of something it must not change.
    fn hardlink(&mut self, comps: &[&[u8]], shown: &str, target: &[u8]) -> Result<(), ArchiveError> {
        let refuse = |reason: String| ArchiveError::Unsafe { path: shown.to_string(), reason };
        let tcomps = member_components(target).map_err(|r| refuse(format!("hard link target `{}`: {r}", show(target))))?;
        let key = tcomps.join(&b'/');
        let Some(&(dev, ino)) = self.files.get(&key) else {
            return Err(refuse(format!("hard link to `{}`, which is not a file extracted earlier from this archive", show(target))));
        };
        let (Some((tlast, tdirs)), Some((last, dirs))) = (tcomps.split_last(), comps.split_last()) else {
            return Err(refuse("hard link to or as the destination directory".into()));
        };
        let tname = c_name(tlast, shown)?;
        let name = c_name(last, shown)?;
        let tparent = self.tree.dir(tdirs, false).map_err(|e| e.for_entry(shown))?;
        match sys::stat_at(tparent.as_raw_fd(), &tname).map_err(|e| sys_err(shown, e))? {
            Some(st) if sys::file_type(&st) == libc::S_IFREG && (st.st_dev, st.st_ino) == (dev, ino) => {}
            _ => return Err(refuse(format!("hard link to `{}`, which changed since it was extracted", show(target)))),
        }
        let parent = self.tree.dir(dirs, true).map_err(|e| e.for_entry(shown))?;
        let pfd = parent.as_raw_fd();
        let temp = with_temp_name(|tmp| nix::unistd::linkat(Some(tparent.as_raw_fd()), tname.as_c_str(), Some(pfd), tmp, AtFlags::empty()))
            .map_err(|e| sys_err(shown, e))?;
        let backup = match refuse_directory_at(pfd, &name, shown).and_then(|()| keep_aside(pfd, &name).map_err(|e| sys_err(shown, e))) {
            Ok(backup) => backup,
            Err(e) => {
                let _ = sys::unlink_at(pfd, &temp);
                return Err(e);
            }
        };
        let renamed = nix::fcntl::renameat(Some(pfd), temp.as_c_str(), Some(pfd), name.as_c_str());
        // Renaming one name of an inode over another name of the same inode succeeds and does
        // nothing, leaving the temporary name: remove it whatever happened.
        let removed = sys::unlink_at(pfd, &temp);
        if let Err(e) = renamed.and(match removed {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }) {
            if let Some(backup) = &backup {
                let _ = sys::unlink_at(pfd, backup);
            }
            return Err(sys_err(shown, e));
        }
        self.placed(dirs, name, backup);
        self.files.insert(comps.join(&b'/'), (dev, ino));
        self.stats.hardlinks += 1;
        Ok(())
    }
}

/// Owner, mode and mtime of every directory entry, deepest first (a stable sort keeps
/// archive order among equals, so a directory listed twice ends with its last header).
fn finish_dirs(tree: &Tree, dirs: &mut [PendingDir]) -> Result<(), ArchiveError> {
    dirs.sort_by_key(|d| std::cmp::Reverse(d.depth));
    for d in dirs.iter() {
        let opened;
        let fd = if d.path.is_empty() {
            tree.dest.as_raw_fd()
        } else {
            let rel = c_name(&d.path, &d.shown)?;
            opened = sys::open_beneath_no_symlinks(tree.dest.as_raw_fd(), &rel, libc::O_RDONLY | libc::O_DIRECTORY).map_err(|e| match e {
                // The sandbox swapped it for a link while we worked.
                Errno::ELOOP => ArchiveError::Unsafe { path: d.shown.clone(), reason: "became a symbolic link during extraction".into() },
                e => sys_err(&d.shown, e),
            })?;
            opened.as_raw_fd()
        };
        d.meta.apply_fd(fd).map_err(|e| sys_err(&d.shown, e))?;
    }
    Ok(())
}

/// Refuses an entry whose name is taken by a directory (checked before writing data; the final
/// rename would refuse it too, later).
fn refuse_directory_at(dir: RawFd, name: &CStr, shown: &str) -> Result<(), ArchiveError> {
    match sys::stat_at(dir, name).map_err(|e| sys_err(shown, e))? {
        Some(st) if sys::file_type(&st) == libc::S_IFDIR => Err(sys_err(shown, Errno::EISDIR)),
        _ => Ok(()),
    }
}

/// What [`make_dir_at`] found.
enum MadeDir {
    Existing,
    /// Made; `replaced` is the hidden name the non-directory that was there now has.
    Created {
        replaced: Option<CString>,
    },
}

/// `mkdirat(name, 0700)`, keeping an existing directory and replacing anything else (kept
/// under a hidden second name, so a failed extraction can put it back). A few rounds, in case
/// the sandbox keeps putting a link back.
fn make_dir_at(dir: RawFd, name: &CStr) -> Result<MadeDir, Errno> {
    let mut replaced = None;
    for _ in 0..4 {
        match nix::sys::stat::mkdirat(Some(dir), name, Mode::from_bits_truncate(0o700)) {
            Ok(()) => return Ok(MadeDir::Created { replaced }),
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(e),
        }
        match sys::stat_at(dir, name)? {
            Some(st) if sys::file_type(&st) == libc::S_IFDIR => return Ok(MadeDir::Existing),
            Some(_) if replaced.is_none() => {
                replaced = keep_aside(dir, name)?;
                match sys::unlink_at(dir, name) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
            Some(_) => match sys::unlink_at(dir, name) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => return Err(e),
            },
            None => {}
        }
    }
    if let Some(backup) = &replaced {
        let _ = sys::unlink_at(dir, backup);
    }
    Err(Errno::EEXIST)
}

/// Gives the non-directory `name` in `dir` a second, hidden name (a hard link to it, never
/// following a symlink), so it can be put back if the extraction fails; `None` when nothing
/// has that name.
fn keep_aside(dir: RawFd, name: &CStr) -> Result<Option<CString>, Errno> {
    match sys::stat_at(dir, name)? {
        None => return Ok(None),
        Some(st) if sys::file_type(&st) == libc::S_IFDIR => return Err(Errno::EISDIR),
        Some(_) => {}
    }
    match with_temp_name(|tmp| nix::unistd::linkat(Some(dir), name, Some(dir), tmp, AtFlags::empty())) {
        Ok(backup) => Ok(Some(backup)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Copies exactly `size` bytes of a tar entry through `buf`; a stream that ends sooner is an
/// error (the archive was cut). The image layer applier uses it too.
pub fn copy_exact(from: &mut impl Read, to: &mut impl Write, size: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut left = size;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = match from.read(&mut buf[..want]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the archive ends inside this file")),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// The output, which can be shut: after an error nothing more reaches it, not even the
/// end-of-archive blocks the `tar` crate writes when its `Builder` is dropped, so a failed
/// archive never looks complete.
struct Gate<W> {
    inner: W,
    shut: bool,
}

impl<W: Write> Write for Gate<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.shut {
            return Err(io::Error::other("archive output closed after an error"));
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.shut {
            return Err(io::Error::other("archive output closed after an error"));
        }
        self.inner.flush()
    }
}

/// A file's data as the archive needs it: exactly the size its header announced. A file that
/// grew is cut there; one that shrank is padded with zeros.
struct ExactReader {
    file: File,
    left: u64,
    shrunk: bool,
}

impl Read for ExactReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let mut n = if self.shrunk { 0 } else { self.file.read(&mut buf[..want])? };
        if n == 0 {
            self.shrunk = true;
            buf[..want].fill(0);
            n = want;
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Directory descriptors one [`create`] keeps open, whatever the depth of the tree: the source
/// and the deepest levels of the walk. A level further up is closed and opened again by name
/// when the walk comes back to it (see [`Writer::reopen`]).
pub const MAX_OPEN_DIRS: usize = 16;

/// One directory being archived: its descriptor while open (every name in it is opened
/// relative to it), its sorted names not yet visited, and its path in the archive.
struct Level {
    dir: Option<OwnedFd>,
    /// Its name in the level above (empty for the source).
    name: CString,
    /// Which directory it is, so one reopened by name is known to be the one that was listed.
    dev: u64,
    ino: u64,
    names: std::vec::IntoIter<CString>,
    /// `""` for the source, else `a/b/`.
    prefix: Vec<u8>,
}

/// The state of one [`create`].
struct Writer<'l, W: Write> {
    builder: Builder<BufWriter<Gate<W>>>,
    stats: CreateStats,
    limits: &'l CreateLimits,
    /// Names read so far, against `limits.max_entries`.
    entries: u64,
    /// Files with more than one name: the archive name of the first one seen.
    links: HashMap<(u64, u64), Vec<u8>>,
}

/// Writes the tree at `src` in the sandbox whose root is `root` to `output` as a tar stream.
///
/// `src` is an absolute path inside the root, resolved as the sandbox would (symlinks followed,
/// confined to the root). A directory gives `./` and then its contents named relative to it
/// (`a`, `a/b/`, `a/b/c`, sorted per directory); a regular file gives one entry named by the
/// last component of `src`. Below `src` nothing is followed: symlinks are stored as symlinks,
/// further names of a file as hard links, and sockets, FIFOs and devices are skipped (counted in
/// [`CreateStats::skipped`]); the contents of kernel filesystems mounted in the tree are never
/// read. Modes, owners (numeric) and mtimes are kept.
///
/// The walk holds one directory's names at a time per level and streams file data, so memory
/// stays bounded whatever the tree. On error the output is incomplete, without the
/// end-of-archive marker: the caller must discard it.
pub fn create<W: Write>(root: BorrowedFd<'_>, src: &str, output: W, limits: &CreateLimits) -> Result<CreateStats, ArchiveError> {
    let comps = sandbox_path(src)?;
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    let found = sys::open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0).map_err(|e| match e {
        Errno::ENOENT | Errno::ENOTDIR => ArchiveError::NotFound { path: src.to_string() },
        e => sys_err(src, e),
    })?;
    if sys::on_kernel_fs(found.as_raw_fd()).map_err(|e| sys_err(src, e))? {
        return Err(ArchiveError::Unsafe { path: src.to_string(), reason: "on a kernel filesystem (proc, sys, cgroup, ...)".into() });
    }
    let st = sys::fstat_fd(found.as_raw_fd()).map_err(|e| sys_err(src, e))?;
    let mut w = Writer {
        builder: Builder::new(BufWriter::with_capacity(COPY_BUF, Gate { inner: output, shut: false })),
        stats: CreateStats::default(),
        limits,
        entries: 0,
        links: HashMap::new(),
    };
    let done = match sys::file_type(&st) {
        libc::S_IFDIR => {
            // Reopen the very directory that was looked at, readable ("." of an O_PATH
            // descriptor is that directory, whatever was renamed since).
            match sys::open_at(found.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY) {
                Ok(fd) => w.tree(fd, &st),
                Err(e) => Err(sys_err(src, e)),
            }
        }
        libc::S_IFREG => {
            let name = comps.last().map(|c| c.as_bytes().to_vec()).unwrap_or_default();
            match sys::reopen_regular_for_reading(found.as_raw_fd()) {
                Ok((file, st)) => w.file(&name, file, &st),
                Err(e) => Err(sys_err(src, e)),
            }
        }
        libc::S_IFIFO => Err(ArchiveError::Unsupported { path: src.to_string(), kind: "FIFO".into() }),
        libc::S_IFSOCK => Err(ArchiveError::Unsupported { path: src.to_string(), kind: "socket".into() }),
        _ => Err(ArchiveError::Unsupported { path: src.to_string(), kind: "device".into() }),
    };
    let finished = done.and_then(|()| {
        w.builder.finish().map_err(io_err(src))?;
        w.builder.get_mut().flush().map_err(io_err(src))
    });
    if let Err(e) = finished {
        w.builder.get_mut().get_mut().shut = true;
        return Err(e);
    }
    Ok(w.stats)
}

/// Closes the descriptors of the shallowest open levels (never the source's) until at most
/// [`MAX_OPEN_DIRS`] are open: the walk needs the deepest ones next.
fn close_shallow(stack: &mut [Level]) {
    let mut open = stack.iter().filter(|l| l.dir.is_some()).count();
    for level in stack.iter_mut().skip(1) {
        if open <= MAX_OPEN_DIRS {
            break;
        }
        if level.dir.take().is_some() {
            open -= 1;
        }
    }
}

/// Opens the deepest level of `stack` again, and the closed ones on the way to it, one name at
/// a time from the nearest open level above, each with `O_DIRECTORY | O_NOFOLLOW` (nothing is
/// followed, nothing leaves the tree) and checked to be the directory that was listed. `false`
/// when one was removed, renamed or replaced meanwhile (the sandbox may change its tree while
/// we walk it); an error for anything else, with the path it concerns.
fn reopen(stack: &mut [Level]) -> Result<bool, (String, Errno)> {
    let Some(from) = stack.iter().rposition(|l| l.dir.is_some()) else {
        return Ok(false);
    };
    for k in from + 1..stack.len() {
        let Some(at) = stack[k - 1].dir.as_ref().map(AsRawFd::as_raw_fd) else { return Ok(false) };
        let shown = show(&stack[k].prefix);
        let fd = match sys::open_at(at, &stack[k].name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
            Ok(fd) => fd,
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => return Ok(false),
            Err(e) => return Err((shown, e)),
        };
        let st = sys::fstat_fd(fd.as_raw_fd()).map_err(|e| (shown, e))?;
        if (st.st_dev, st.st_ino) != (stack[k].dev, stack[k].ino) {
            return Ok(false);
        }
        stack[k].dir = Some(fd);
    }
    close_shallow(stack);
    Ok(true)
}

/// An archive name as the `tar` crate takes it.
fn tar_path(bytes: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(bytes))
}

/// A GNU header for an entry of `kind` with the metadata of `st`.
fn header_for(kind: EntryType, st: &libc::stat, size: u64, ids: IdShift) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o7777);
    h.set_uid(u64::from(ids.inside(st.st_uid)));
    h.set_gid(u64::from(ids.inside(st.st_gid)));
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_size(size);
    h
}

impl<W: Write> Writer<'_, W> {
    /// Counts names against the limit.
    fn count(&mut self, n: u64, path: &[u8]) -> Result<(), ArchiveError> {
        self.entries += n;
        if self.entries > self.limits.max_entries {
            return Err(ArchiveError::Limit { path: show(path), what: "entries", limit: self.limits.max_entries });
        }
        Ok(())
    }

    /// Reads and sorts the names of a directory (sorted so the same tree gives the same archive).
    /// The listing reads through a second descriptor of it, closed before this returns.
    fn level(&mut self, fd: OwnedFd, name: CString, prefix: Vec<u8>, st: &libc::stat) -> Result<Level, ArchiveError> {
        let shown = if prefix.is_empty() { "./".to_string() } else { show(&prefix) };
        let listing = fd.try_clone().map_err(|e| sys_err(&shown, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
        let mut dir = nix::dir::Dir::from(listing).map_err(|e| sys_err(&shown, e))?;
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry.map_err(|e| sys_err(&shown, e))?;
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            // Counted as they are read: a directory of ten million names fails at the limit
            // rather than after listing them all.
            self.count(1, &prefix)?;
            names.push(name.to_owned());
        }
        names.sort_unstable();
        Ok(Level { dir: Some(fd), name, dev: st.st_dev, ino: st.st_ino, names: names.into_iter(), prefix })
    }

    /// The source directory and everything below it, depth first, with at most
    /// [`MAX_OPEN_DIRS`] directories open however deep the tree goes.
    fn tree(&mut self, top: OwnedFd, st: &libc::stat) -> Result<(), ArchiveError> {
        self.count(1, b"./")?;
        self.dir_entry(b"./", st)?;
        let mut stack = vec![self.level(top, CString::default(), Vec::new(), st)?];
        while let Some(level) = stack.last_mut() {
            let Some(name) = level.names.next() else {
                stack.pop();
                continue;
            };
            if level.dir.is_none() && !reopen(&mut stack).map_err(|(path, e)| sys_err(&path, e))? {
                // Gone or replaced since it was listed: what is left of it is not archived.
                if let Some(gone) = stack.pop() {
                    self.stats.skipped += 1 + gone.names.len() as u64;
                }
                continue;
            }
            let Some(level) = stack.last() else { break };
            let Some(dfd) = level.dir.as_ref().map(AsRawFd::as_raw_fd) else { break };
            let parent_dev = level.dev;
            let mut rel = level.prefix.clone();
            rel.extend_from_slice(name.to_bytes());
            let shown = show(&rel);
            // Gone since it was listed: nothing to archive.
            let Some(st) = sys::stat_at(dfd, &name).map_err(|e| sys_err(&shown, e))? else {
                self.stats.skipped += 1;
                continue;
            };
            match sys::file_type(&st) {
                libc::S_IFDIR => {
                    // O_DIRECTORY | O_NOFOLLOW: a symlink or anything else swapped in since the
                    // stat fails here instead of being entered.
                    let fd = match sys::open_at(dfd, &name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
                        Ok(fd) => fd,
                        Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => {
                            self.stats.skipped += 1;
                            continue;
                        }
                        Err(e) => return Err(sys_err(&shown, e)),
                    };
                    let st = sys::fstat_fd(fd.as_raw_fd()).map_err(|e| sys_err(&shown, e))?;
                    rel.push(b'/');
                    self.dir_entry(&rel, &st)?;
                    // A mount point: a kernel filesystem is stored as an empty directory.
                    if st.st_dev != parent_dev && sys::on_kernel_fs(fd.as_raw_fd()).map_err(|e| sys_err(&shown, e))? {
                        self.stats.skipped += 1;
                        continue;
                    }
                    // `stack.len()` is the new directory's depth below the source.
                    if stack.len() > self.limits.max_depth {
                        return Err(ArchiveError::Limit { path: shown, what: "directory levels", limit: self.limits.max_depth as u64 });
                    }
                    let level = self.level(fd, name, rel, &st)?;
                    stack.push(level);
                    close_shallow(&mut stack);
                }
                libc::S_IFREG => {
                    let found = match sys::open_at(dfd, &name, libc::O_PATH | libc::O_NOFOLLOW) {
                        Ok(fd) => fd,
                        Err(Errno::ENOENT) => {
                            self.stats.skipped += 1;
                            continue;
                        }
                        Err(e) => return Err(sys_err(&shown, e)),
                    };
                    // A single file bind-mounted from a kernel filesystem is not read either.
                    if st.st_dev != parent_dev && sys::on_kernel_fs(found.as_raw_fd()).map_err(|e| sys_err(&shown, e))? {
                        self.stats.skipped += 1;
                        continue;
                    }
                    match sys::reopen_regular_for_reading(found.as_raw_fd()) {
                        Ok((file, st)) => self.file(&rel, file, &st)?,
                        // Swapped for something else since the stat: skipped, never opened.
                        Err(Errno::EINVAL) => self.stats.skipped += 1,
                        Err(e) => return Err(sys_err(&shown, e)),
                    }
                }
                libc::S_IFLNK => match sys::readlink_bytes_at(dfd, &name) {
                    Ok(target) => self.symlink(&rel, &target, &st)?,
                    Err(Errno::ENOENT | Errno::EINVAL) => self.stats.skipped += 1,
                    Err(e) => return Err(sys_err(&shown, e)),
                },
                // Sockets, FIFOs, devices: nothing an archive of files should carry.
                _ => self.stats.skipped += 1,
            }
        }
        Ok(())
    }

    fn dir_entry(&mut self, rel: &[u8], st: &libc::stat) -> Result<(), ArchiveError> {
        let mut h = header_for(EntryType::Directory, st, 0, self.limits.ids);
        self.builder.append_data(&mut h, tar_path(rel), io::empty()).map_err(io_err(&show(rel)))?;
        self.stats.dirs += 1;
        Ok(())
    }

    fn symlink(&mut self, rel: &[u8], target: &[u8], st: &libc::stat) -> Result<(), ArchiveError> {
        let mut h = header_for(EntryType::Symlink, st, 0, self.limits.ids);
        self.builder.append_link(&mut h, tar_path(rel), tar_path(target)).map_err(io_err(&show(rel)))?;
        self.stats.symlinks += 1;
        Ok(())
    }

    /// A regular file, opened already; `st` is of the open file, so the header describes what
    /// is read.
    fn file(&mut self, rel: &[u8], file: File, st: &libc::stat) -> Result<(), ArchiveError> {
        let shown = show(rel);
        if st.st_nlink > 1 {
            if let Some(first) = self.links.get(&(st.st_dev, st.st_ino)) {
                let mut h = header_for(EntryType::Link, st, 0, self.limits.ids);
                self.builder.append_link(&mut h, tar_path(rel), tar_path(first)).map_err(io_err(&shown))?;
                self.stats.hardlinks += 1;
                return Ok(());
            }
            self.links.insert((st.st_dev, st.st_ino), rel.to_vec());
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size > self.limits.max_total_bytes.saturating_sub(self.stats.bytes) {
            return Err(ArchiveError::Limit { path: shown, what: "bytes of file data", limit: self.limits.max_total_bytes });
        }
        let mut h = header_for(EntryType::Regular, st, size, self.limits.ids);
        let mut data = ExactReader { file, left: size, shrunk: false };
        self.builder.append_data(&mut h, tar_path(rel), &mut data).map_err(io_err(&shown))?;
        if data.shrunk {
            self.stats.changed += 1;
        }
        self.stats.files += 1;
        self.stats.bytes += size;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::collections::{BTreeMap, BTreeSet};
    use std::fs;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};

    #[test]
    fn id_shift_maps_a_range_and_nothing_outside_it() {
        let ids = IdShift { base: 1 << 30, len: 65536 };
        assert_eq!(ids.outside(0), Some(1 << 30));
        assert_eq!(ids.outside(1000), Some((1 << 30) + 1000));
        assert_eq!(ids.outside(65536), None);
        assert_eq!(ids.outside(u64::MAX), None);
        assert_eq!(ids.inside((1 << 30) + 1000), 1000);
        // The host's root and anything past the range show as the overflow id, as the kernel does.
        assert_eq!(ids.inside(0), OVERFLOW_ID);
        assert_eq!(ids.inside((1 << 30) + 65536), OVERFLOW_ID);
        let meta = Meta { mode: 0o644, uid: 1000, gid: 1000, mtime: 0 };
        let moved = meta.shifted(ids);
        assert_eq!((moved.uid, moved.gid), ((1 << 30) + 1000, (1 << 30) + 1000));
        // An owner the range cannot hold is not set at all (the extractor's own ids stay).
        assert_eq!(Meta { uid: 70000, ..meta }.shifted(ids).ids(), None);
        // The default is the identity.
        assert_eq!(meta.shifted(IdShift::default()).uid, 1000);
        assert_eq!(IdShift::default().inside(1000), 1000);
    }
    use std::path::PathBuf;
    use std::time::Instant;

    /// A sandbox root and, beside it, a directory standing for the host (with a canary file)
    /// that no extraction may touch.
    struct Fixture {
        _tmp: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
        root_file: File,
    }

    fn fixture() -> Fixture {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        fs::create_dir_all(&root).expect("mkdir root");
        fs::create_dir_all(outside.join("etc")).expect("mkdir outside");
        fs::write(outside.join("canary"), b"canary").expect("canary");
        fs::write(outside.join("etc/passwd"), b"root:x:0:0").expect("passwd");
        let root_file = File::open(&root).expect("open root");
        Fixture { _tmp: tmp, root, outside, root_file }
    }

    impl Fixture {
        fn extract(&self, dest: &str, tar: &[u8]) -> Result<ExtractStats, ArchiveError> {
            extract(self.root_file.as_fd(), dest, tar, &ExtractLimits::default())
        }

        fn outside_abs(&self) -> String {
            self.outside.to_string_lossy().into_owned()
        }

        /// Runs `f` and checks that neither the outside directory nor the temp dir holding the
        /// root changed.
        fn untouched_outside<T>(&self, f: impl FnOnce() -> T) -> T {
            let before = describe(&self.outside);
            let siblings = names(self.root.parent().expect("parent"));
            let out = f();
            assert_eq!(describe(&self.outside), before, "the outside directory changed");
            assert_eq!(names(self.root.parent().expect("parent")), siblings, "something appeared beside the root");
            assert_eq!(fs::metadata(self.outside.join("canary")).expect("canary").nlink(), 1, "the canary got a second name");
            out
        }
    }

    fn names(dir: &Path) -> BTreeSet<String> {
        fs::read_dir(dir).expect("ls").map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect()
    }

    fn sha256_file(p: &Path) -> String {
        let mut h = Sha256::new();
        let mut f = File::open(p).expect("open");
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Everything a user would compare between two trees: type, content hash or link target,
    /// permission bits, owner and mtime of every name.
    fn describe(dir: &Path) -> BTreeMap<Vec<u8>, String> {
        fn walk(base: &Path, p: &Path, out: &mut BTreeMap<Vec<u8>, String>) {
            let m = fs::symlink_metadata(p).expect("lstat");
            let rel = p.strip_prefix(base).expect("prefix").as_os_str().as_bytes().to_vec();
            let ft = m.file_type();
            let what = if ft.is_dir() {
                "dir".to_string()
            } else if ft.is_symlink() {
                format!("symlink -> {}", show(fs::read_link(p).expect("readlink").as_os_str().as_bytes()))
            } else if ft.is_file() {
                format!("file {} bytes sha256 {}", m.len(), sha256_file(p))
            } else {
                format!("other {:o}", m.mode())
            };
            out.insert(rel, format!("{what}, mode {:o}, owner {}:{}, mtime {}", m.mode() & 0o7777, m.uid(), m.gid(), m.mtime()));
            if ft.is_dir() {
                for e in fs::read_dir(p).expect("ls") {
                    walk(base, &e.expect("entry").path(), out);
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(dir, dir, &mut out);
        out
    }

    fn assert_same_tree(a: &Path, b: &Path) {
        let (da, db) = (describe(a), describe(b));
        let keys: BTreeSet<&Vec<u8>> = da.keys().chain(db.keys()).collect();
        let diffs: Vec<String> =
            keys.into_iter().filter(|k| da.get(*k) != db.get(*k)).take(8).map(|k| format!("{}: {:?} != {:?}", show(k), da.get(k), db.get(k))).collect();
        assert!(diffs.is_empty(), "trees differ:\n{}", diffs.join("\n"));
    }

    fn set_mtime(p: &Path, secs: i64) {
        nix::sys::stat::utimensat(None, p, &TimeSpec::UTIME_OMIT, &TimeSpec::new(secs, 0), UtimensatFlags::NoFollowSymlink).expect("utimensat");
    }

    fn is_root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    /// A test that needs root (chown, mknod) says so; under CI it must not quietly pass.
    fn need_root(what: &str) -> bool {
        if is_root() {
            return true;
        }
        eprintln!("!!! NOT CHECKED: {what} needs root");
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{what} needs root, and CI runs as root");
        false
    }

    /// Pseudo-random bytes (xorshift), so a big file is not all zeros or a repeated block.
    fn write_noise(p: &Path, len: usize) {
        let mut f = File::create(p).expect("create");
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut chunk = vec![0u8; 1 << 20];
        let mut left = len;
        while left > 0 {
            for w in chunk.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
            }
            let n = left.min(chunk.len());
            f.write_all(&chunk[..n]).expect("write");
            left -= n;
        }
    }

    /// Hand-made archives, for what `tar::Builder` refuses to write (`..`, absolute names).
    #[derive(Default)]
    struct RawTar(Vec<u8>);

    impl RawTar {
        fn entry(&mut self, name: &[u8], kind: EntryType, link: &[u8], data: &[u8]) -> &mut Self {
            self.entry_sized(name, kind, link, data, data.len() as u64)
        }

        fn entry_sized(&mut self, name: &[u8], kind: EntryType, link: &[u8], data: &[u8], size: u64) -> &mut Self {
            let mut h = Header::new_gnu();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
            h.set_entry_type(kind);
            h.set_size(size);
            if let Some(gnu) = h.as_gnu_mut() {
                // Only read for sparse entries, but then it must be a number.
                gnu.set_real_size(size);
                gnu.set_is_extended(false);
            }
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_600_000_000);
            h.set_cksum();
            self.0.extend_from_slice(h.as_bytes());
            self.0.extend_from_slice(data);
            self.0.resize(self.0.len().div_ceil(512) * 512, 0);
            self
        }

        fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
            self.entry(name.as_bytes(), EntryType::Regular, b"", data)
        }

        fn end(&mut self) -> Vec<u8> {
            self.0.extend_from_slice(&[0; 1024]);
            std::mem::take(&mut self.0)
        }
    }

    fn unsafe_path(r: Result<ExtractStats, ArchiveError>) -> (String, String) {
        match r {
            Err(ArchiveError::Unsafe { path, reason }) => (path, reason),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// The source tree of the round trip: nested and empty directories, modes, owners, old
    /// mtimes, a symlink pointing out, a hard link, long and non-UTF-8 names, a 10,000-file
    /// directory and a 50 MiB file.
    fn build_tree(src: &Path, many: usize, big: usize) {
        fs::create_dir_all(src.join("a/b/c")).expect("mkdir");
        fs::create_dir_all(src.join("empty")).expect("mkdir");
        fs::write(src.join("a/b/c/deep.txt"), b"deep").expect("write");
        fs::write(src.join("exec750"), b"#!/bin/sh\n").expect("write");
        fs::set_permissions(src.join("exec750"), fs::Permissions::from_mode(0o750)).expect("chmod");
        symlink("../../etc/passwd", src.join("a/b/link")).expect("symlink");
        fs::write(src.join("hard1"), b"two names").expect("write");
        fs::hard_link(src.join("hard1"), src.join("a/hard2")).expect("link");
        let long_dir = src.join("l".repeat(120));
        fs::create_dir_all(&long_dir).expect("mkdir");
        fs::write(long_dir.join("n".repeat(200)), b"long name").expect("write");
        symlink("t".repeat(300), src.join("long-target")).expect("symlink");
        fs::write(src.join(OsStr::from_bytes(b"caf\xe9")), b"latin-1 name").expect("write");
        fs::create_dir(src.join("sticky")).expect("mkdir");
        fs::set_permissions(src.join("sticky"), fs::Permissions::from_mode(0o1777)).expect("chmod");
        fs::create_dir(src.join("many")).expect("mkdir");
        for i in 0..many {
            fs::write(src.join(format!("many/f{i:05}")), format!("file {i}\n")).expect("write");
        }
        if big > 0 {
            write_noise(&src.join("big.bin"), big);
        }
        if is_root() {
            std::os::unix::fs::chown(src.join("a/b/c/deep.txt"), Some(1234), Some(5678)).expect("chown");
            std::os::unix::fs::lchown(src.join("a/b/link"), Some(42), Some(43)).expect("lchown");
            std::os::unix::fs::chown(src.join("empty"), Some(7), Some(8)).expect("chown");
        }
        set_mtime(&src.join("a/b/c/deep.txt"), 1_000_000_000);
        set_mtime(&src.join("a/b/link"), 1_000_000_001);
        set_mtime(&src.join("a/b/c"), 1_000_000_002);
        set_mtime(&src.join("empty"), 1_000_000_003);
        set_mtime(&src.join("a"), 1_000_000_004);
    }

    #[test]
    fn round_trip_preserves_the_tree() {
        let f = fixture();
        let src = f.root.join("src");
        build_tree(&src, 10_000, 50 << 20);
        let mut archive = tempfile::tempfile().expect("tempfile");
        let started = Instant::now();
        let made = create(f.root_file.as_fd(), "/src", &mut archive, &CreateLimits::default()).expect("create");
        let create_time = started.elapsed();
        assert_eq!(made.files, 10_000 + 6, "{made:?}");
        assert_eq!((made.hardlinks, made.symlinks, made.skipped, made.changed), (1, 2, 0, 0), "{made:?}");
        assert_eq!(made.dirs, 8, "./, a, a/b, a/b/c, empty, lll…, sticky, many, and nothing else: {made:?}");
        std::io::Seek::rewind(&mut archive).expect("rewind");
        let started = Instant::now();
        let stats = f.untouched_outside(|| extract(f.root_file.as_fd(), "/restored/here", &archive, &ExtractLimits::default())).expect("extract");
        let extract_time = started.elapsed();
        assert_eq!((stats.files, stats.hardlinks, stats.symlinks, stats.dirs), (made.files, 1, 2, 8), "{stats:?}");
        assert_eq!(stats.bytes, made.bytes);
        let dest = f.root.join("restored/here");
        assert_same_tree(&src, &dest);
        assert_eq!(sha256_file(&src.join("big.bin")), sha256_file(&dest.join("big.bin")));
        let (h1, h2) = (fs::metadata(dest.join("hard1")).expect("stat"), fs::metadata(dest.join("a/hard2")).expect("stat"));
        assert_eq!((h1.ino(), h1.nlink()), (h2.ino(), 2), "the hard link is one inode again");
        assert_eq!(fs::read_link(dest.join("a/b/link")).expect("readlink"), Path::new("../../etc/passwd"), "stored, not followed");
        assert_eq!(fs::metadata(dest.join("exec750")).expect("stat").mode() & 0o7777, 0o750);
        assert_eq!(fs::read_dir(dest.join("many")).expect("ls").count(), 10_000);
        eprintln!("round trip (debug build): create {create_time:?}, extract {extract_time:?} for {} files, {} bytes", made.files, made.bytes);
    }

    #[test]
    fn gnu_tar_and_this_module_read_each_other() {
        let Ok(out) = std::process::Command::new("tar").arg("--version").output() else {
            eprintln!("!!! NOT CHECKED: no `tar` binary");
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI must have GNU tar");
            return;
        };
        assert!(out.status.success());
        let f = fixture();
        let src = f.root.join("src");
        build_tree(&src, 50, 3 << 20);
        // Ours, unpacked by GNU tar.
        let archive_path = f.root.join("ours.tar");
        let made = create(f.root_file.as_fd(), "/src", File::create(&archive_path).expect("create"), &CreateLimits::default()).expect("create");
        assert!(made.files > 50);
        fs::create_dir(f.root.join("by-gnu")).expect("mkdir");
        let st = std::process::Command::new("tar").arg("-xpf").arg(&archive_path).arg("-C").arg(f.root.join("by-gnu")).status().expect("tar");
        assert!(st.success(), "GNU tar refused our archive");
        assert_same_tree(&src, &f.root.join("by-gnu"));
        // GNU tar's (POSIX format, PAX long names), unpacked by us.
        let gnu_path = f.root.join("gnu.tar");
        let st = std::process::Command::new("tar").args(["--format=posix", "-cf"]).arg(&gnu_path).arg("-C").arg(&src).arg(".").status().expect("tar");
        assert!(st.success());
        extract(f.root_file.as_fd(), "/by-us", File::open(&gnu_path).expect("open"), &ExtractLimits::default()).expect("extract GNU tar's archive");
        assert_same_tree(&src, &f.root.join("by-us"));
    }

    #[test]
    fn names_that_leave_the_destination_are_refused() {
        for name in ["../escape", "/abs", "a/../../x", "..", "a/..", "OUTSIDE/pwned", "./../escape"] {
            let f = fixture();
            // An absolute host path into this fixture's outside directory.
            let name = name.replace("OUTSIDE", &f.outside_abs());
            let name = name.as_str();
            let tar = RawTar::default().file("fine", b"ok").file(name, b"evil").end();
            let (path, reason) = f.untouched_outside(|| unsafe_path(f.extract("/dest", &tar)));
            assert_eq!(path, name, "the error names the entry ({reason})");
            assert_eq!(names(&f.root), BTreeSet::from(["dest".to_string()]), "nothing written beside dest for {name}");
            assert_eq!(names(&f.root.join("dest")), BTreeSet::new(), "the entries before the bad one were taken out again for {name}");
        }
    }

    /// A PAX record: `LEN key=value\n`, LEN counting itself.
    fn pax_record(key: &str, value: &str) -> Vec<u8> {
        let body = format!(" {key}={value}\n");
        let mut len = body.len() + 1;
        while format!("{len}").len() + body.len() != len {
            len += 1;
        }
        format!("{len}{body}").into_bytes()
    }

    #[test]
    fn long_names_are_checked_like_short_ones() {
        let long_escape = format!("../{}", "a".repeat(200));
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                RawTar::default().entry(b"././@LongLink", EntryType::GNULongName, b"", long_escape.as_bytes()).file("innocent", b"evil").end(),
                long_escape.as_str(),
            ),
            (RawTar::default().entry(b"pax", EntryType::XHeader, b"", &pax_record("path", "../pax-escape")).file("innocent", b"evil").end(), "../pax-escape"),
            (RawTar::default().entry(b"pax", EntryType::XHeader, b"", &pax_record("path", "/abs-pax")).file("innocent", b"evil").end(), "/abs-pax"),
            (
                RawTar::default()
                    .entry(b"pax", EntryType::XHeader, b"", &pax_record("linkpath", "/etc/passwd"))
                    .entry(b"h", EntryType::Link, b"innocent", b"")
                    .end(),
                "h",
            ),
            (
                RawTar::default()
                    .entry(b"././@LongLink", EntryType::GNULongLink, b"", format!("../{}", "b".repeat(150)).as_bytes())
                    .entry(b"h", EntryType::Link, b"x", b"")
                    .end(),
                "h",
            ),
        ];
        for (tar, name) in cases {
            let f = fixture();
            let (path, reason) = f.untouched_outside(|| unsafe_path(f.extract("/dest", &tar)));
            assert_eq!(path, name, "{reason}");
            assert!(names(&f.root.join("dest")).is_empty(), "{name}: nothing written");
        }
    }

    #[test]
    fn a_symlink_from_the_archive_is_stored_and_never_written_through() {
        let outside = fixture().outside_abs();
        let cases = [("/", "link/etc/evil"), (outside.as_str(), "link/canary"), ("../../outside", "link/canary"), ("/", "link/sub/")];
        for (target, through) in cases {
            let f = fixture();
            // Each fixture has its own outside dir: point at this one.
            let target = if target == outside { f.outside_abs() } else { target.to_string() };
            let mut raw = RawTar::default();
            raw.entry(b"link", EntryType::Symlink, target.as_bytes(), b"");
            if through.ends_with('/') {
                raw.entry(through.as_bytes(), EntryType::Directory, b"", b"");
            } else {
                raw.file(through, b"evil");
            }
            let tar = raw.end();
            let (path, reason) = f.untouched_outside(|| unsafe_path(f.extract("/dest", &tar)));
            assert_eq!(path, through);
            assert!(reason.contains("`link` is a symbolic link"), "{reason}");
            assert!(fs::symlink_metadata(f.root.join("dest/link")).is_err(), "the failed extraction took its link out again");
        }
    }

    #[test]
    fn hard_links_only_to_files_of_this_archive() {
        let f = fixture();
        fs::create_dir_all(f.root.join("dest")).expect("mkdir");
        fs::write(f.root.join("dest/planted"), b"sandbox's").expect("write");
        symlink(f.outside.join("canary"), f.root.join("dest/to-canary")).expect("symlink");
        let outside_canary = f.outside.join("canary").to_string_lossy().into_owned();
        for target in ["/etc/passwd", "../outside/canary", outside_canary.as_str(), "planted", "to-canary", "missing", "dir/.."] {
            let tar = RawTar::default().entry(b"h", EntryType::Link, target.as_bytes(), b"").end();
            let (path, reason) = f.untouched_outside(|| unsafe_path(f.extract("/dest", &tar)));
            assert_eq!(path, "h", "{target}: {reason}");
            assert!(!f.root.join("dest/h").exists(), "{target}: nothing made");
        }
        assert_eq!(fs::metadata("/etc/passwd").expect("passwd").nlink(), 1);
        // A link to a file of the same archive works, twice over and onto itself.
        let tar = RawTar::default()
            .file("f", b"data")
            .entry(b"g", EntryType::Link, b"f", b"")
            .entry(b"g2", EntryType::Link, b"g", b"")
            .entry(b"f", EntryType::Link, b"f", b"")
            .end();
        let stats = f.extract("/dest", &tar).expect("extract");
        assert_eq!((stats.files, stats.hardlinks), (1, 3));
        let ino = |n: &str| fs::metadata(f.root.join("dest").join(n)).expect("stat").ino();
        assert_eq!((ino("g"), ino("g2")), (ino("f"), ino("f")));
        assert_eq!(fs::metadata(f.root.join("dest/f")).expect("stat").nlink(), 3, "no temporary name left behind");
        let leftovers: Vec<_> = names(&f.root.join("dest")).into_iter().filter(|n| n.starts_with('.')).collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn devices_fifos_and_unknown_types_are_refused() {
        let cases: [(&[u8], EntryType, &str); 5] = [
            (b"chr", EntryType::Char, "character device"),
            (b"blk", EntryType::Block, "block device"),
            (b"fifo", EntryType::Fifo, "FIFO"),
            (b"sparse", EntryType::GNUSparse, "sparse file"),
            (b"label", EntryType::new(b'V'), "type 'V'"),
        ];
        for (name, kind, what) in cases {
            let f = fixture();
            let tar = RawTar::default().entry(name, kind, b"", b"").end();
            match f.untouched_outside(|| f.extract("/dest", &tar)) {
                Err(ArchiveError::Unsupported { path, kind }) => assert_eq!((path.as_bytes(), kind.as_str()), (name, what)),
                other => panic!("{what}: {other:?}"),
            }
            assert!(names(&f.root.join("dest")).is_empty(), "{what}: nothing created");
        }
    }

    #[test]
    fn limits_stop_the_work_and_name_the_entry() {
        let f = fixture();
        let tar = RawTar::default().file("f0", b"").file("f1", b"").file("f2", b"").file("f3", b"").end();
        let limits = ExtractLimits { max_entries: 3, ..ExtractLimits::default() };
        match extract(f.root_file.as_fd(), "/count", &tar[..], &limits) {
            Err(ArchiveError::Limit { path, what: "entries", limit: 3 }) => assert_eq!(path, "f3"),
            other => panic!("{other:?}"),
        }
        assert!(!f.root.join("count/f3").exists());

        let tar = RawTar::default().entry(b"d/", EntryType::Directory, b"", b"").file("d/small", &[1; 600]).file("big", &[1; 600]).end();
        let limits = ExtractLimits { max_total_bytes: 1000, ..ExtractLimits::default() };
        match extract(f.root_file.as_fd(), "/bytes", &tar[..], &limits) {
            Err(ArchiveError::Limit { path, what: "bytes of file data", limit: 1000 }) => assert_eq!(path, "big"),
            other => panic!("{other:?}"),
        }
        assert_eq!(names(&f.root.join("bytes")), BTreeSet::new(), "no partial or temporary file, and what came before is gone");

        // A GNU long name and a PAX record of 2 MiB each: refused after 1 MiB, not buffered whole.
        for kind in [EntryType::GNULongName, EntryType::XHeader] {
            let huge = vec![b'a'; 2 << 20];
            let tar = RawTar::default().file("first", b"1").entry(b"././@LongLink", kind, b"", &huge).file("x", b"").end();
            match f.extract("/huge", &tar) {
                Err(ArchiveError::Limit { path, limit: MAX_HEADER_BYTES, .. }) => assert_eq!(path, "the entry after `first`"),
                other => panic!("{kind:?}: {other:?}"),
            }
        }
        // Data hidden in a directory entry is skipped within the same budget.
        let tar = RawTar::default().entry(b"d/", EntryType::Directory, b"", &vec![0; 2 << 20]).file("x", b"").end();
        assert!(matches!(f.extract("/hidden", &tar), Err(ArchiveError::Limit { .. })));
    }

    #[test]
    fn a_failed_extraction_puts_back_what_it_replaced_and_removes_what_it_made() {
        let f = fixture();
        let dest = f.root.join("dest");
        fs::create_dir_all(dest.join("keep")).expect("mkdir");
        fs::set_permissions(dest.join("keep"), fs::Permissions::from_mode(0o751)).expect("chmod");
        fs::write(dest.join("file"), b"old file").expect("write");
        symlink("old-target", dest.join("link")).expect("symlink");
        fs::write(dest.join("was-file"), b"becomes a dir").expect("write");
        // Names, contents, modes and owners come back; the mtime of a directory whose entries
        // were changed and changed back is now (a second may have passed).
        let undone = |dir: &Path| {
            let mut tree = describe(dir);
            for v in tree.values_mut() {
                if v.starts_with("dir,") {
                    if let Some(i) = v.find(", mtime ") {
                        v.truncate(i);
                    }
                }
            }
            tree
        };
        let before = undone(&dest);
        let mut tar = RawTar::default();
        tar.file("file", b"new file")
            .entry(b"link", EntryType::Regular, b"", b"a file over a link")
            .entry(b"was-file/", EntryType::Directory, b"", b"")
            .file("was-file/inner", b"x")
            .file("new/deep/er/file", b"made with its parents")
            .file("keep/added", b"y")
            .entry(b"keep/", EntryType::Directory, b"", b"")
            .entry(b"hl", EntryType::Link, b"file", b"")
            .file("file", b"replaced twice");
        tar.entry(b"dev", EntryType::Char, b"", b"");
        let tar = tar.end();
        assert!(matches!(f.extract("/dest", &tar), Err(ArchiveError::Unsupported { .. })));
        assert_eq!(undone(&dest), before, "the tree is as it was");
        assert_eq!(fs::metadata(dest.join("keep")).expect("stat").mode() & 0o7777, 0o751, "a merged directory keeps its mode");
        assert_eq!(fs::read_link(dest.join("link")).expect("readlink"), Path::new("old-target"));
        // A staged extraction that is dropped (the transfer broke off after the archive's end)
        // is undone too; a committed one stays.
        let ok = RawTar::default().file("file", b"new").file("n/x", b"x").end();
        drop(extract_staged(f.root_file.as_fd(), "/dest", &ok[..], &ExtractLimits::default()).expect("staged"));
        assert_eq!(undone(&dest), before, "dropped: undone");
        let staged = extract_staged(f.root_file.as_fd(), "/dest", &ok[..], &ExtractLimits::default()).expect("staged");
        assert_eq!(staged.stats().files, 2);
        staged.commit().expect("commit");
        assert_eq!(fs::read(dest.join("file")).expect("read"), b"new");
        assert!(names(&dest).iter().all(|n| !n.starts_with(".sbx")), "no hidden second names left: {:?}", names(&dest));
    }

    #[test]
    fn a_deep_tree_is_archived_with_a_bounded_number_of_descriptors() {
        let f = fixture();
        let top = f.root.join("deep");
        let mut dir = top.clone();
        for i in 0..200 {
            dir.push(format!("d{}", i % 7));
        }
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(dir.join("bottom"), vec![9u8; 3 << 20]).expect("write");
        fs::write(top.join("d0/top"), b"t").expect("write");
        /// Counts, at every write, the descriptors of this process open on the tree.
        struct Probe {
            tree: PathBuf,
            max: usize,
            bytes: u64,
        }
        impl Write for Probe {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                let open = fs::read_dir("/proc/self/fd")?.flatten().filter(|e| fs::read_link(e.path()).is_ok_and(|t| t.starts_with(&self.tree))).count();
                self.max = self.max.max(open);
                self.bytes += buf.len() as u64;
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut probe = Probe { tree: top.clone(), max: 0, bytes: 0 };
        let stats = create(f.root_file.as_fd(), "/deep", &mut probe, &CreateLimits::default()).expect("create");
        assert_eq!((stats.dirs, stats.files), (201, 2));
        assert!(probe.max <= MAX_OPEN_DIRS + 3, "{} descriptors open on the tree at once", probe.max);
        // What came back is the whole tree, the names after the deep part included.
        let mut out = Vec::new();
        create(f.root_file.as_fd(), "/deep", &mut out, &CreateLimits::default()).expect("create");
        let dest = f.root.join("copy");
        fs::create_dir(&dest).expect("mkdir");
        f.extract("/copy", &out).expect("extract");
        assert_same_tree(&top, &dest);
    }

    #[test]
    fn a_cut_archive_leaves_no_partial_file() {
        let f = fixture();
        let mut tar = RawTar::default().file("whole", b"ok").end();
        tar.truncate(tar.len() - 1024);
        let mut cut = RawTar(tar);
        cut.entry_sized(b"cut", EntryType::Regular, b"", &[7; 100], 10_000);
        match f.extract("/dest", &cut.0) {
            Err(ArchiveError::Io { path, source }) => assert_eq!((path.as_str(), source.kind()), ("cut", io::ErrorKind::UnexpectedEof)),
            other => panic!("{other:?}"),
        }
        assert_eq!(names(&f.root.join("dest")), BTreeSet::new(), "the whole file before the cut was taken out again");
        // Cut inside a file that replaces an existing one: the old one stays as it was.
        fs::write(f.root.join("dest/whole"), b"ok").expect("write");
        let mut cut = RawTar::default();
        cut.entry_sized(b"whole", EntryType::Regular, b"", &[7; 100], 10_000);
        assert!(matches!(f.extract("/dest", &cut.0), Err(ArchiveError::Io { path, .. }) if path == "whole"));
        assert_eq!(fs::read(f.root.join("dest/whole")).expect("read"), b"ok");
        assert_eq!(names(&f.root.join("dest")), BTreeSet::from(["whole".to_string()]), "no temporary file left");
        // Garbage where a header should be.
        let mut bad = RawTar::default().file("whole", b"ok").end();
        bad[512 * 2..512 * 3].fill(b'z');
        assert!(matches!(f.extract("/bad", &bad), Err(ArchiveError::Malformed { path, .. }) if path == "the entry after `whole`"));
    }

    #[test]
    fn planted_symlinks_in_the_destination_are_not_followed() {
        let f = fixture();
        fs::create_dir_all(f.root.join("dest")).expect("mkdir");
        symlink(&f.outside, f.root.join("dest/sub")).expect("symlink");
        symlink(f.outside.join("canary"), f.root.join("dest/file")).expect("symlink");
        // Through the planted directory link: refused.
        let tar = RawTar::default().file("sub/canary", b"evil").end();
        let (path, reason) = f.untouched_outside(|| unsafe_path(f.extract("/dest", &tar)));
        assert_eq!(path, "sub/canary", "{reason}");
        // A file over a planted file link replaces the link; a directory entry replaces the
        // directory link, and what goes below lands in the new directory.
        let tar = RawTar::default().file("file", b"mine").entry(b"sub/", EntryType::Directory, b"", b"").file("sub/canary", b"inside").end();
        f.untouched_outside(|| f.extract("/dest", &tar)).expect("extract");
        assert!(fs::symlink_metadata(f.root.join("dest/file")).expect("lstat").is_file());
        assert_eq!(fs::read(f.root.join("dest/file")).expect("read"), b"mine");
        assert!(fs::symlink_metadata(f.root.join("dest/sub")).expect("lstat").is_dir());
        assert_eq!(fs::read(f.root.join("dest/sub/canary")).expect("read"), b"inside");
        // A destination that is itself a link to a host path resolves inside the root: while
        // that path does not exist in the root, there is no destination; once it does, that is
        // where the files go.
        symlink(&f.outside, f.root.join("d")).expect("symlink");
        let tar = RawTar::default().file("canary", b"inside").end();
        assert!(matches!(f.untouched_outside(|| f.extract("/d", &tar)), Err(ArchiveError::NotFound { .. })));
        let inside = f.root.join(f.outside.strip_prefix("/").expect("absolute"));
        fs::create_dir_all(&inside).expect("mkdir");
        f.untouched_outside(|| f.extract("/d", &tar)).expect("extract");
        assert_eq!(fs::read(inside.join("canary")).expect("read"), b"inside");
    }

    #[test]
    fn destinations_and_names_in_the_way() {
        let f = fixture();
        fs::write(f.root.join("file"), b"x").expect("write");
        for dest in ["/file", "/file/sub"] {
            assert!(matches!(f.extract(dest, &RawTar::default().end()), Err(ArchiveError::NotADirectory { .. })), "{dest}");
        }
        for dest in ["relative", "/a/../b"] {
            assert!(matches!(f.extract(dest, &RawTar::default().end()), Err(ArchiveError::Unsafe { .. })), "{dest}");
        }
        fs::create_dir_all(f.root.join("dest/d")).expect("mkdir");
        fs::write(f.root.join("dest/plain"), b"x").expect("write");
        match f.extract("/dest", &RawTar::default().file("d", b"x").end()) {
            Err(ArchiveError::Io { path, source }) => assert_eq!((path.as_str(), source.raw_os_error()), ("d", Some(libc::EISDIR))),
            other => panic!("{other:?}"),
        }
        match f.extract("/dest", &RawTar::default().file("plain/x", b"x").end()) {
            Err(ArchiveError::NotADirectory { path, component }) => assert_eq!((path.as_str(), component.as_str()), ("plain/x", "plain")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(f.extract("/dest", &RawTar::default().file(".", b"x").end()), Err(ArchiveError::Unsafe { .. })));
        let left: Vec<_> = names(&f.root.join("dest")).into_iter().filter(|n| n.starts_with('.')).collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    #[test]
    fn modes_lose_set_id_bits_and_owners_come_from_the_header() {
        let f = fixture();
        let mut raw = RawTar::default();
        let mut h = Header::new_gnu();
        for (name, kind, mode) in [("suid", EntryType::Regular, 0o4755), ("sgid-dir/", EntryType::Directory, 0o2775), ("tmp/", EntryType::Directory, 0o1777)] {
            h.set_path(name).expect("path");
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(1234);
            h.set_gid(5678);
            h.set_mtime(1_500_000_000);
            h.set_size(0);
            h.set_cksum();
            raw.0.extend_from_slice(h.as_bytes());
        }
        f.extract("/dest", &raw.end()).expect("extract");
        let meta = |n: &str| fs::metadata(f.root.join("dest").join(n)).expect("stat");
        assert_eq!(meta("suid").mode() & 0o7777, 0o755);
        assert_eq!(meta("sgid-dir").mode() & 0o7777, 0o775);
        assert_eq!(meta("tmp").mode() & 0o7777, 0o1777);
        assert_eq!(meta("sgid-dir").mtime(), 1_500_000_000);
        if need_root("chown from the header") {
            assert_eq!((meta("suid").uid(), meta("suid").gid()), (1234, 5678));
            assert_eq!((meta("tmp").uid(), meta("tmp").gid()), (1234, 5678));
        }
    }

    /// (path, type, link target) of every entry of an archive.
    fn listing(tar: &[u8]) -> Vec<(String, EntryType, String)> {
        let mut archive = Archive::new(tar);
        archive
            .entries()
            .expect("entries")
            .map(|e| {
                let e = e.expect("entry");
                let link = e.link_name_bytes().map(|l| show(&l)).unwrap_or_default();
                (show(&e.path_bytes()), e.header().entry_type(), link)
            })
            .collect()
    }

    #[test]
    fn create_stores_symlinks_and_never_follows_them() {
        let f = fixture();
        fs::write(f.outside.join("secret"), b"host secret").expect("write");
        fs::create_dir_all(f.root.join("src/inner")).expect("mkdir");
        fs::write(f.root.join("src/inner/own"), b"mine").expect("write");
        symlink(&f.outside, f.root.join("src/escape")).expect("symlink");
        symlink("../../outside", f.root.join("src/inner/rel")).expect("symlink");
        symlink("/src", f.root.join("alias")).expect("symlink");
        let mut tar = Vec::new();
        create(f.root_file.as_fd(), "/src", &mut tar, &CreateLimits::default()).expect("create");
        let list = listing(&tar);
        let expected = vec![
            ("./".to_string(), EntryType::Directory, String::new()),
            ("escape".to_string(), EntryType::Symlink, f.outside_abs()),
            ("inner/".to_string(), EntryType::Directory, String::new()),
            ("inner/own".to_string(), EntryType::Regular, String::new()),
            ("inner/rel".to_string(), EntryType::Symlink, "../../outside".to_string()),
        ];
        assert_eq!(list, expected);
        assert!(!tar.windows(b"host secret".len()).any(|w| w == b"host secret"), "outside data never read");
        // The source path itself resolves as the sandbox sees it: through `alias`, inside the
        // root; `escape` points at a host path that does not exist inside the root.
        let mut again = Vec::new();
        create(f.root_file.as_fd(), "/alias", &mut again, &CreateLimits::default()).expect("create via alias");
        assert_eq!(again, tar, "same tree, same bytes");
        assert!(matches!(create(f.root_file.as_fd(), "/src/escape", Vec::new(), &CreateLimits::default()), Err(ArchiveError::NotFound { .. })));
        assert!(matches!(create(f.root_file.as_fd(), "/missing", Vec::new(), &CreateLimits::default()), Err(ArchiveError::NotFound { .. })));
    }

    #[test]
    fn create_skips_sockets_fifos_and_devices() {
        let f = fixture();
        let src = f.root.join("src");
        fs::create_dir_all(&src).expect("mkdir");
        fs::write(src.join("keep"), b"data").expect("write");
        nix::unistd::mkfifo(&src.join("fifo"), Mode::from_bits_truncate(0o644)).expect("mkfifo");
        let _sock = std::os::unix::net::UnixListener::bind(src.join("sock")).expect("bind");
        let mut expected_skips = 2;
        if need_root("mknod") {
            nix::sys::stat::mknod(&src.join("null"), nix::sys::stat::SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), nix::sys::stat::makedev(1, 3))
                .expect("mknod");
            expected_skips += 1;
        }
        let mut tar = Vec::new();
        let stats = create(f.root_file.as_fd(), "/src", &mut tar, &CreateLimits::default()).expect("create");
        assert_eq!((stats.files, stats.skipped), (1, expected_skips), "{stats:?}");
        let names: Vec<String> = listing(&tar).into_iter().map(|(p, ..)| p).collect();
        assert_eq!(names, ["./", "keep"]);
        // The FIFO as the source itself is refused, not opened (which would block).
        assert!(matches!(create(f.root_file.as_fd(), "/src/fifo", Vec::new(), &CreateLimits::default()), Err(ArchiveError::Unsupported { .. })));
    }

    #[test]
    fn create_of_one_file_and_the_limits() {
        let f = fixture();
        fs::create_dir_all(f.root.join("src/d/e")).expect("mkdir");
        fs::write(f.root.join("src/d/e/file.txt"), b"hello").expect("write");
        fs::write(f.root.join("src/z"), vec![0; 2000]).expect("write");
        let mut tar = Vec::new();
        let stats = create(f.root_file.as_fd(), "/src/d/e/file.txt", &mut tar, &CreateLimits::default()).expect("create");
        assert_eq!((stats.files, stats.dirs, stats.bytes), (1, 0, 5));
        assert_eq!(listing(&tar), [("file.txt".to_string(), EntryType::Regular, String::new())]);
        let stats = f.extract("/one", &tar).expect("extract");
        assert_eq!(stats.files, 1);
        assert_eq!(fs::read(f.root.join("one/file.txt")).expect("read"), b"hello");

        let run = |limits: CreateLimits| {
            let mut out = Vec::new();
            let r = create(f.root_file.as_fd(), "/src", &mut out, &limits);
            (r, out)
        };
        let (r, out) = run(CreateLimits { max_entries: 3, ..CreateLimits::default() });
        assert!(matches!(r, Err(ArchiveError::Limit { what: "entries", .. })), "{r:?}");
        assert!(!out.ends_with(&[0; 1024]), "a failed archive has no end-of-archive marker");
        let (r, _) = run(CreateLimits { max_total_bytes: 1000, ..CreateLimits::default() });
        assert!(matches!(r, Err(ArchiveError::Limit { ref path, what: "bytes of file data", .. }) if path == "z"), "{r:?}");
        let (r, _) = run(CreateLimits { max_depth: 1, ..CreateLimits::default() });
        assert!(matches!(r, Err(ArchiveError::Limit { ref path, what: "directory levels", .. }) if path == "d/e"), "{r:?}");
    }

    #[test]
    fn kernel_filesystems_are_neither_read_nor_written() {
        let host_root = File::open("/").expect("open /");
        if !fs::metadata("/proc/self").is_ok_and(|m| m.is_dir()) {
            eprintln!("!!! NOT CHECKED: no /proc");
            return;
        }
        let r = create(host_root.as_fd(), "/proc/self", Vec::new(), &CreateLimits::default());
        assert!(matches!(r, Err(ArchiveError::Unsafe { .. })), "{r:?}");
        // procfs refuses new files anyway; what is checked is that nothing is attempted.
        let r = extract(host_root.as_fd(), "/proc", &RawTar::default().file("x", b"").end()[..], &ExtractLimits::default());
        assert!(matches!(r, Err(ArchiveError::Unsafe { .. })), "{r:?}");
    }

    #[test]
    fn races_with_the_sandbox_never_reach_outside() {
        use nix::fcntl::{renameat2, RenameFlags};
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let f = fixture();
        fs::write(f.outside.join("secret"), b"HOST-SECRET").expect("write");
        let src = f.root.join("src");
        fs::create_dir_all(src.join("d")).expect("mkdir");
        fs::write(src.join("d/x"), b"benign").expect("write");
        fs::write(src.join("f"), b"benign").expect("write");
        // The swap partners: each exchange flips a real file/directory with a link out.
        symlink(f.outside.join("secret"), src.join("f.alt")).expect("symlink");
        symlink(&f.outside, src.join("d.alt")).expect("symlink");
        fs::create_dir_all(f.root.join("dest/sub")).expect("mkdir");
        symlink(&f.outside, f.root.join("dest/sub.alt")).expect("symlink");
        let stop = Arc::new(AtomicBool::new(false));
        let swapper = {
            let (stop, src, dest) = (Arc::clone(&stop), src.clone(), f.root.join("dest"));
            std::thread::spawn(move || {
                let mut swaps = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (dir, a, b) in [(&src, "f", "f.alt"), (&src, "d", "d.alt"), (&dest, "sub", "sub.alt")] {
                        renameat2(None, &dir.join(a), None, &dir.join(b), RenameFlags::RENAME_EXCHANGE).expect("exchange");
                        swaps += 1;
                    }
                }
                swaps
            })
        };
        let mut raw = RawTar::default();
        for i in 0..50 {
            raw.file(&format!("sub/f{i}"), b"payload");
        }
        let tar = raw.end();
        let before = describe(&f.outside);
        let deadline = Instant::now() + std::time::Duration::from_secs(2);
        let mut rounds = 0;
        while Instant::now() < deadline {
            let mut out = Vec::new();
            create(f.root_file.as_fd(), "/src", &mut out, &CreateLimits::default()).expect("create");
            assert!(!out.windows(11).any(|w| w == b"HOST-SECRET"), "a file outside the root was read");
            assert!(!listing(&out).iter().any(|(p, ..)| p.contains("canary") || p.contains("secret")), "a directory outside the root was listed");
            // Refusals are fine here (the link may be in place); writing outside is not.
            let _ = f.extract("/dest", &tar);
            rounds += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let swaps = swapper.join().expect("swapper");
        assert_eq!(describe(&f.outside), before, "the outside directory changed");
        eprintln!("{rounds} rounds against {swaps} swaps");
        assert!(rounds > 10 && swaps > 100, "the race did not run ({rounds} rounds, {swaps} swaps)");
    }

    /// Throughput of both directions on the two trees the brief names. Run it optimised:
    /// `cargo test -p sandbox-exec --release -- --ignored --nocapture archive::tests::throughput`
    #[test]
    #[ignore = "timing, run by hand"]
    fn throughput() {
        for (label, many, big) in [("one 50 MiB file", 0, 50 << 20), ("10,000 small files", 10_000, 0)] {
            let f = fixture();
            let src = f.root.join("src");
            fs::create_dir_all(src.join("many")).expect("mkdir");
            for i in 0..many {
                fs::write(src.join(format!("many/f{i:05}")), format!("file {i}\n")).expect("write");
            }
            if big > 0 {
                write_noise(&src.join("big.bin"), big);
            }
            let mut archive = tempfile::tempfile().expect("tempfile");
            let t = Instant::now();
            let made = create(f.root_file.as_fd(), "/src", &mut archive, &CreateLimits::default()).expect("create");
            let c = t.elapsed();
            std::io::Seek::rewind(&mut archive).expect("rewind");
            let t = Instant::now();
            let got = extract(f.root_file.as_fd(), "/dest", &archive, &ExtractLimits::default()).expect("extract");
            let x = t.elapsed();
            assert_eq!(got.files, made.files);
            // GNU tar on the same archive, same disk, same moment: the reference.
            std::io::Seek::rewind(&mut archive).expect("rewind");
            fs::create_dir(f.root.join("gnu")).expect("mkdir");
            let t = Instant::now();
            let gnu =
                std::process::Command::new("tar").arg("-xpf").arg("-").arg("-C").arg(f.root.join("gnu")).stdin(archive.try_clone().expect("dup")).status();
            let g = t.elapsed();
            let mib = made.bytes as f64 / (1 << 20) as f64;
            if gnu.is_ok_and(|st| st.success()) {
                eprintln!("{label}: GNU tar -x of the same archive {g:?}");
            }
            eprintln!(
                "{label}: create {c:?} ({:.0} MiB/s, {:.0} files/s), extract {x:?} ({:.0} MiB/s, {:.0} files/s)",
                mib / c.as_secs_f64(),
                made.files as f64 / c.as_secs_f64(),
                mib / x.as_secs_f64(),
                got.files as f64 / x.as_secs_f64()
            );
        }
    }
}
