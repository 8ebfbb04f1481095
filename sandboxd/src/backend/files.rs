//! File access inside a sandbox's root filesystem, from the daemon, without ever leaving it.
//!
//! The daemon reaches a sandbox's files through the host path of its merged overlay. A path from a
//! client (or a symlink planted by code in the sandbox) could point anywhere on the host, so every
//! lookup goes through `openat2(RESOLVE_IN_ROOT)`: the kernel resolves `..` and symlinks — absolute
//! ones included — as if the sandbox root were `/`. Only regular files are read or written; a FIFO
//! or device node planted by the sandbox is refused before any byte moves (and the overlay is
//! mounted `nodev` besides).
//!
//! A write never changes the old file in place: the bytes go to a hidden temporary file beside
//! the target (`O_EXCL`), which is synced and renamed over it, so a write the disk quota refuses
//! leaves the old file exactly as it was. The container tier uses the same code through the
//! container's root (`/proc/<init>/root`).

use sandbox_exec::sys::{open_in_root, FileSlot, NAME_MAX};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sandbox_exec::archive::IdShift;
use tokio::sync::mpsc;

use crate::backend::{ArchiveStats, BackendError, ByteChunks, Download, FileChunk, UploadPiece, DOWNLOAD_CHUNK};

/// Largest slice one ReadFile returns.
pub const MAX_READ: u64 = 4 << 20;

/// Splits a sandbox path into its normal components, resolving it against `workdir` when relative.
/// `..` is kept for the kernel to clamp at the root; empty and NUL-containing paths are refused.
pub(crate) fn components(path: &str, workdir: &str) -> Result<Vec<String>, BackendError> {
    let invalid = |reason: &str| BackendError::InvalidPath { path: path.to_string(), reason: reason.to_string() };
    if path.is_empty() {
        return Err(invalid("empty"));
    }
    if path.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    if path.len() >= libc::PATH_MAX as usize {
        return Err(invalid(&format!("longer than {} bytes", libc::PATH_MAX - 1)));
    }
    let full: PathBuf = if path.starts_with('/') { PathBuf::from(path) } else { Path::new(workdir).join(path) };
    let mut out = Vec::new();
    for c in full.components() {
        match c {
            Component::Normal(s) if s.len() > NAME_MAX => return Err(invalid(&format!("a component is longer than {NAME_MAX} bytes"))),
            Component::Normal(s) => out.push(s.to_string_lossy().into_owned()),
            Component::ParentDir => out.push("..".to_string()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// The API error of a failed system call on `path`: what the caller can fix (a bad path, a
/// loop, a name too long, a full disk) is never INTERNAL.
pub(crate) fn map_errno(path: &str, e: Errno) -> BackendError {
    let invalid = |reason: &str| BackendError::InvalidPath { path: path.to_string(), reason: reason.to_string() };
    match e {
        Errno::ENOENT => BackendError::FileNotFound { path: path.to_string() },
        Errno::ENOSPC | Errno::EDQUOT => BackendError::DiskFull { path: path.to_string() },
        Errno::EISDIR => invalid("is a directory"),
        Errno::ENOTDIR => invalid("a parent is not a directory"),
        Errno::ELOOP => invalid("too many levels of symbolic links"),
        Errno::ENAMETOOLONG => invalid("file name too long"),
        Errno::EILSEQ => invalid("a symbolic link on the way is not valid UTF-8"),
        Errno::EROFS => invalid("on a read-only file system"),
        Errno::EBUSY => invalid("a mount point"),
        Errno::ENXIO | Errno::ENODEV | Errno::EACCES | Errno::EPERM => invalid(&format!("not accessible: {}", e.desc())),
        other => BackendError::io(format!("accessing {path} in the sandbox"), std::io::Error::from(other)),
    }
}

/// The sandbox root at `root`, opened as the directory every confined lookup starts from.
pub(crate) fn open_root(root: &Path) -> Result<File, BackendError> {
    File::open(root).map_err(|e| BackendError::io(format!("opening sandbox root {}", root.display()), e))
}

fn ensure_regular(file: &File, path: &str) -> Result<u64, BackendError> {
    let meta = file.metadata().map_err(|e| BackendError::io(format!("stat {path}"), e))?;
    if !meta.file_type().is_file() {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "not a regular file".into() });
    }
    Ok(meta.len())
}

/// Refuses a file of a kernel pseudo-filesystem (a container's `/proc` and `/sys` are reachable
/// through its root): the daemon opens files as host root, which would read what code in the
/// sandbox itself may not (kernel addresses in `/proc/kallsyms`, other processes' state).
fn refuse_kernel_fs(file: &File, path: &str) -> Result<(), BackendError> {
    use nix::sys::statfs::{fstatfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC, DEBUGFS_MAGIC, PROC_SUPER_MAGIC, SECURITYFS_MAGIC, SYSFS_MAGIC};
    let fs = fstatfs(file).map_err(|e| map_errno(path, e))?.filesystem_type();
    if [PROC_SUPER_MAGIC, SYSFS_MAGIC, CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, DEBUGFS_MAGIC, SECURITYFS_MAGIC].contains(&fs) {
        return Err(BackendError::InvalidPath {
            path: path.to_string(),
            reason: "is on a kernel filesystem (/proc, /sys), which the file API does not read; read it with an exec".into(),
        });
    }
    Ok(())
}

/// Creates every missing directory of `dirs` (already split), each lookup confined to `root`.
fn mkdir_all(root: &File, dirs: &[String], display: &str) -> Result<(), BackendError> {
    sandbox_exec::sys::mkdir_all_in_root(root.as_raw_fd(), dirs).map_err(|e| map_errno(display, e))
}

/// Creates a directory and its parents inside the root (used at setup for the workdir).
pub fn create_dir_all(root: &Path, path: &str) -> Result<(), BackendError> {
    let comps = components(path, "/")?;
    let root_file = open_root(root)?;
    mkdir_all(&root_file, &comps, path)
}

/// Makes `name`, one component directly below `root`, a real directory to mount on: a symlink,
/// file or special file the sandbox put there is removed first (every such name is mounted over
/// when the sandbox runs, so nothing of the sandbox's is lost), and a missing one made (0755).
/// A mount follows symlinks in its target: without this a sandbox could point its `/sys` or
/// `/proc` anywhere in the next start's (fork's, rollback's) mount namespace.
pub fn ensure_mount_point(root: &Path, name: &str) -> Result<(), BackendError> {
    let root_file = open_root(root)?;
    let dir = root_file.as_raw_fd();
    let c_name = std::ffi::CString::new(name).map_err(|_| BackendError::InvalidPath { path: name.to_string(), reason: "contains NUL".into() })?;
    let err = |op: &str, e: nix::errno::Errno| BackendError::io(format!("{op} mount point /{name}"), std::io::Error::from_raw_os_error(e as i32));
    match sandbox_exec::sys::stat_at(dir, &c_name).map_err(|e| err("inspecting", e))? {
        Some(st) if sandbox_exec::sys::file_type(&st) == libc::S_IFDIR => return Ok(()),
        Some(_) => sandbox_exec::sys::unlink_at(dir, &c_name).map_err(|e| err("removing what is at", e))?,
        None => {}
    }
    // SAFETY: mkdirat with a directory fd we own and a NUL-terminated single-component name.
    nix::errno::Errno::result(unsafe { libc::mkdirat(dir, c_name.as_ptr(), 0o755) }).map(drop).map_err(|e| err("creating", e))
}

/// The components of a path that names a file: not the root, not ending in `..`.
fn file_components(path: &str, workdir: &str) -> Result<Vec<String>, BackendError> {
    let comps = components(path, workdir)?;
    match comps.last().map(String::as_str) {
        None => Err(BackendError::InvalidPath { path: path.to_string(), reason: "names the root directory".into() }),
        Some("..") => Err(BackendError::InvalidPath { path: path.to_string(), reason: "ends in ..".into() }),
        Some(_) => Ok(comps),
    }
}

/// Where a write to `comps` lands; anything there but a regular file is refused before any
/// byte moves.
fn writable_slot(root: &File, comps: &[String], path: &str) -> Result<FileSlot, BackendError> {
    let slot = sandbox_exec::sys::resolve_file_slot(root.as_raw_fd(), comps).map_err(|e| map_errno(path, e))?;
    if slot.existing.as_ref().is_some_and(|st| sandbox_exec::sys::file_type(st) != libc::S_IFREG) {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "not a regular file".into() });
    }
    Ok(slot)
}

/// Writes a whole file (creating parents), with `mode` (0 = 0644), replacing any old one
/// atomically (see the module docs). Returns the bytes written.
pub fn write_file(root: &Path, workdir: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    write_file_at(&open_root(root)?, workdir, path, content, mode)
}

/// [`write_file`] below an open root directory.
pub(crate) fn write_file_at(root: &File, workdir: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    let comps = file_components(path, workdir)?;
    mkdir_all(root, &comps[..comps.len() - 1], path)?;
    let slot = writable_slot(root, &comps, path)?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    sandbox_exec::sys::replace_file(&slot, content, mode).map_err(|e| map_errno(path, e))?;
    Ok(content.len() as u64)
}

/// Removes a regular file or a symlink (the link itself, never its target). A path that does
/// not exist is not an error; a directory or special file is refused.
pub fn remove_file(root: &Path, workdir: &str, path: &str) -> Result<(), BackendError> {
    remove_file_at(&open_root(root)?, workdir, path)
}

/// [`remove_file`] below an open root directory.
pub(crate) fn remove_file_at(root: &File, workdir: &str, path: &str) -> Result<(), BackendError> {
    let comps = file_components(path, workdir)?;
    use sandbox_exec::sys::RemoveError;
    sandbox_exec::sys::remove_file_in_root(root.as_raw_fd(), &comps).map_err(|e| match e {
        RemoveError::IsDirectory => map_errno(path, Errno::EISDIR),
        RemoveError::NotAFile => BackendError::InvalidPath { path: path.to_string(), reason: "not a regular file or symbolic link".into() },
        RemoveError::Sys(e) => map_errno(path, e),
    })
}

/// Reads up to `limit` bytes (0 = [`MAX_READ`]) from `offset`.
pub fn read_file(root: &Path, workdir: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    read_file_at(&open_root(root)?, workdir, path, offset, limit)
}

/// [`read_file`] below an open root directory. What the path names is looked at (`O_PATH`)
/// before it is opened, and exactly that inode is then opened through `/proc/self/fd`: a device
/// node (a container's `/dev` has real ones) or FIFO is never opened, not even in a race.
pub(crate) fn read_file_at(root: &File, workdir: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    let comps = components(path, workdir)?;
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    let found = File::from(open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0).map_err(|e| map_errno(path, e))?);
    ensure_regular(&found, path)?;
    refuse_kernel_fs(&found, path)?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", found.as_raw_fd()))
        .map_err(|e| map_errno(path, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    let size = ensure_regular(&file, path)?;
    let limit = if limit == 0 { MAX_READ } else { limit.min(MAX_READ) };
    let want = size.saturating_sub(offset).min(limit);
    let mut content = Vec::with_capacity(want as usize);
    if want > 0 {
        file.seek(SeekFrom::Start(offset)).map_err(|e| BackendError::io(format!("seek {path}"), e))?;
        file.take(want).read_to_end(&mut content).map_err(|e| BackendError::io(format!("read {path}"), e))?;
    }
    let eof = offset + content.len() as u64 >= size;
    Ok(FileChunk { content, size, eof })
}

/// Most bytes of an upload written to the file in one step on a blocking thread: pieces that
/// arrive together are written together, so tiny messages do not cost a thread hop each.
const UPLOAD_WRITE: usize = 1 << 20;

/// Writes a file of any size from `data` (see [`UploadPiece`]) below the root directory
/// `root`: parents are created, the bytes go to a hidden temporary file beside the target, and
/// only a `Commit` renames it over the old file; anything else removes the temporary file.
///
/// The waiting for the client is async: a blocking thread is held only while a piece is
/// written (at most [`UPLOAD_WRITE`] bytes), never while the client is silent.
///
/// With `ids` (a process sandbox's user namespace range) what is created belongs to root inside.
pub(crate) async fn upload_file_in(
    root: File,
    workdir: String,
    path: String,
    mode: u32,
    ids: Option<IdShift>,
    mut data: mpsc::Receiver<UploadPiece>,
) -> Result<u64, BackendError> {
    let p = path.clone();
    let target = blocking(move || -> Result<_, BackendError> {
        acting_as(ids, || {
            let comps = file_components(&p, &workdir)?;
            mkdir_all(&root, &comps[..comps.len() - 1], &p)?;
            let slot = writable_slot(&root, &comps, &p)?;
            let temp = sandbox_exec::sys::create_temp_in(slot.dir.as_raw_fd()).map_err(|e| map_errno(&p, e))?;
            Ok(Arc::new((slot, temp)))
        })
    })
    .await?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    let mut written = 0u64;
    let result = loop {
        let first = match data.recv().await {
            Some(UploadPiece::Data(bytes)) => bytes,
            Some(UploadPiece::Commit) => {
                let (t, p) = (target.clone(), path.clone());
                break blocking(move || sandbox_exec::sys::commit_temp(&t.0, &t.1, mode).map_err(|e| map_errno(&p, e))).await.map(|()| written);
            }
            None => break Err(BackendError::UploadIncomplete { path: path.clone() }),
        };
        // What else has arrived already goes in the same write.
        let mut pieces = vec![first];
        let mut commit = false;
        let mut size = pieces[0].len();
        while size < UPLOAD_WRITE {
            match data.try_recv() {
                Ok(UploadPiece::Data(bytes)) => {
                    size += bytes.len();
                    pieces.push(bytes);
                }
                Ok(UploadPiece::Commit) => {
                    commit = true;
                    break;
                }
                Err(_) => break,
            }
        }
        let (t, p) = (target.clone(), path.clone());
        let wrote = blocking(move || -> Result<(), BackendError> {
            use std::io::Write;
            let mut file = &t.1.file;
            for piece in &pieces {
                file.write_all(piece).map_err(|e| map_errno(&p, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = wrote {
            break Err(e);
        }
        written += size as u64;
        if commit {
            let (t, p) = (target.clone(), path.clone());
            break blocking(move || sandbox_exec::sys::commit_temp(&t.0, &t.1, mode).map_err(|e| map_errno(&p, e))).await.map(|()| written);
        }
    };
    if result.is_err() {
        let t = target.clone();
        let _ = blocking(move || Ok(sandbox_exec::sys::unlink_at(t.0.dir.as_raw_fd(), &t.1.name))).await;
    }
    result
}

/// Runs `op` acting as root inside the user namespace of `ids` (see
/// `process::idmap::ActingAs`), or as the daemon without. Synchronous code only.
pub(crate) fn acting_as<T>(ids: Option<IdShift>, op: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
    super::process::idmap::as_root_of(ids.map(|i| i.base), op).map_err(|e| BackendError::io("acting as the sandbox's root", e))?
}

/// Runs a bounded piece of file work on a blocking thread.
async fn blocking<T: Send + 'static>(op: impl FnOnce() -> Result<T, BackendError> + Send + 'static) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(op).await.map_err(|e| BackendError::Internal(format!("file task: {e}")))?
}

/// Opens a regular file below an open root directory for a download (checked like
/// [`read_file_at`]: never a device node, FIFO or kernel file), with its size.
pub(crate) fn open_for_download_at(root: &File, workdir: &str, path: &str) -> Result<(File, u64), BackendError> {
    let comps = components(path, workdir)?;
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    let found = File::from(open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0).map_err(|e| map_errno(path, e))?);
    ensure_regular(&found, path)?;
    refuse_kernel_fs(&found, path)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", found.as_raw_fd()))
        .map_err(|e| map_errno(path, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    let size = ensure_regular(&file, path)?;
    Ok((file, size))
}

type Chunk = Result<Bytes, BackendError>;

/// The producing side of a download's chunks ([`chunk_channel`]). Two bounds hold whatever the
/// client does: a chunk is made only once the one before was taken (nothing is read ahead of
/// the client), and a client that takes nothing for `idle` ends the download with
/// [`BackendError::Idle`], sent through a slot kept free for that last word from the start, so
/// it is said even to a client that stopped reading.
pub(crate) struct ChunkSender {
    tx: mpsc::Sender<Chunk>,
    last: Option<mpsc::OwnedPermit<Chunk>>,
    idle: Duration,
    path: String,
}

/// A download channel: one chunk in flight, plus the slot for its last word.
pub(crate) fn chunk_channel(idle: Duration, path: &str) -> (ChunkSender, ByteChunks) {
    let (tx, rx) = mpsc::channel(2);
    let last = tx.clone().try_reserve_owned().ok();
    (ChunkSender { tx, last, idle, path: path.to_string() }, rx)
}

impl ChunkSender {
    /// Room for the next chunk, once the client took the one before; `None` when the client is
    /// gone or stayed idle (then it has been told).
    pub(crate) async fn room(&mut self) -> Option<mpsc::OwnedPermit<Chunk>> {
        match tokio::time::timeout(self.idle, self.tx.clone().reserve_owned()).await {
            Ok(Ok(permit)) => Some(permit),
            Ok(Err(_)) => None,
            Err(_) => {
                self.idle_out();
                None
            }
        }
    }

    /// Resolves once the receiver is gone.
    pub(crate) async fn closed(&self) {
        self.tx.closed().await
    }

    /// [`ChunkSender::room`] from a thread outside the runtime (an archive walk).
    fn blocking_room(&mut self, runtime: &tokio::runtime::Handle) -> Option<mpsc::OwnedPermit<Chunk>> {
        runtime.block_on(self.room())
    }

    fn idle_out(&mut self) {
        tracing::info!(path = %self.path, secs = self.idle.as_secs_f64(), "a download the client stopped reading was ended");
        self.fail(BackendError::Idle { path: self.path.clone(), secs: self.idle.as_secs_f64() });
    }

    /// Ends the download with `e` (the last word; the client sees it after what it has not read).
    pub(crate) fn fail(&mut self, e: BackendError) {
        if let Some(last) = self.last.take() {
            last.send(Err(e));
        }
    }
}

/// Streams an opened file into a [`Download`] in [`DOWNLOAD_CHUNK`] pieces, each read on a
/// blocking thread only once the client took the one before (see [`ChunkSender`]): a slow
/// client slows the reading, an idle one ends it, and the file is closed either way. Call it
/// on the runtime.
pub(crate) fn stream_download(file: File, size: u64, path: &str, idle: Duration) -> Download {
    let (mut out, chunks) = chunk_channel(idle, path);
    let file = Arc::new(file);
    let path = path.to_string();
    tokio::spawn(async move {
        let mut offset = 0u64;
        loop {
            let Some(room) = out.room().await else { return };
            let (f, p) = (file.clone(), path.clone());
            let read = blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; DOWNLOAD_CHUNK];
                loop {
                    match f.read_at(&mut buf, offset) {
                        Ok(n) => {
                            buf.truncate(n);
                            return Ok(buf);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(BackendError::io(format!("reading {p}"), e)),
                    }
                }
            })
            .await;
            match read {
                Ok(buf) if buf.is_empty() => return,
                Ok(buf) => {
                    offset += buf.len() as u64;
                    room.send(Ok(Bytes::from(buf)));
                }
                Err(e) => {
                    drop(room);
                    out.fail(e);
                    return;
                }
            }
        }
    });
    Download { size, chunks }
}

/// Reads an upload's pieces as one byte stream: its end is the `Commit`; the channel closing
/// before it is an error ([`std::io::ErrorKind::ConnectionAborted`]). Used on a thread of its
/// own (see [`upload_archive_in`]).
struct PieceReader<'a> {
    rx: &'a mut mpsc::Receiver<UploadPiece>,
    buf: Bytes,
    committed: bool,
}

impl Read for PieceReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.buf.is_empty() {
            if self.committed {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(UploadPiece::Data(bytes)) => self.buf = bytes,
                Some(UploadPiece::Commit) => self.committed = true,
                None => return Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the upload did not complete")),
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf.split_to(n));
        Ok(n)
    }
}

/// Runs `op` on a thread of its own and waits for it without holding a runtime thread. The
/// `tar` parser and writer are synchronous, so an archive transfer needs a thread for its
/// whole life; it gets its own rather than one of the blocking pool, which the file calls of
/// every tenant share (the `[streams] max_archive_walks` caps how many run).
async fn on_own_thread<T: Send + 'static>(name: &str, op: impl FnOnce() -> Result<T, BackendError> + Send + 'static) -> Result<T, BackendError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let _ = tx.send(op());
        })
        .map_err(|e| BackendError::io("starting an archive thread", e))?;
    rx.await.map_err(|_| BackendError::Internal("the archive thread ended without an answer".into()))?
}

/// Extracts an uploaded tar stream into `dir` below the root directory `root` (see
/// `sandbox_exec::archive::extract_staged`), on a thread of its own. What follows the
/// archive's end (tar's zero padding) is read and dropped; only a stream that reached its
/// `Commit` keeps what was extracted: an archive refused part way, or a stream cut before its
/// `Commit` (the client went away, was idle past `streams.idle_timeout_ms`, or sent a wrong
/// checksum) takes out everything it extracted and puts back what it replaced.
///
/// With `ids` the archive's owners are ids inside that range, and what is created without an
/// owner belongs to root inside.
pub(crate) async fn upload_archive_in(
    root: File,
    workdir: String,
    dir: String,
    ids: Option<IdShift>,
    mut data: mpsc::Receiver<UploadPiece>,
) -> Result<ArchiveStats, BackendError> {
    on_own_thread("sbx-untar", move || {
        acting_as(ids, || {
            use std::os::fd::AsFd;
            let comps = components(&dir, &workdir)?;
            let dest = format!("/{}", comps.join("/"));
            let mut reader = PieceReader { rx: &mut data, buf: Bytes::new(), committed: false };
            let limits = sandbox_exec::archive::ExtractLimits { ids: ids.unwrap_or_default(), ..Default::default() };
            let staged = sandbox_exec::archive::extract_staged(root.as_fd(), &dest, &mut reader, &limits)?;
            // Dropping `staged` on this error undoes the extraction.
            std::io::copy(&mut reader, &mut std::io::sink()).map_err(|_| BackendError::UploadIncomplete { path: dir.clone() })?;
            Ok(staged.commit()?)
        })
    })
    .await
}

/// Writes into a download's [`ChunkSender`] in [`DOWNLOAD_CHUNK`] pieces, each once the client
/// took the one before; a client that went away or stayed idle is a broken pipe, which stops
/// the writer.
struct ChunkWriter {
    out: ChunkSender,
    runtime: tokio::runtime::Handle,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let Some(room) = self.out.blocking_room(&self.runtime) else {
            return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        };
        room.send(Ok(Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(DOWNLOAD_CHUNK)))));
        Ok(())
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(DOWNLOAD_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= DOWNLOAD_CHUNK {
            self.send()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// A tar stream of `path` below the root `root` (owned: the stream outlives the call), made on
/// a thread of its own while the client keeps up (see [`ChunkSender`]; the walk holds at most
/// `sandbox_exec::archive::MAX_OPEN_DIRS` directories open). A missing path is an error here,
/// before any byte; a failure later ends the stream with it. Call it on the runtime.
///
/// With `ids` the archive shows the owners as ids inside that range.
pub(crate) fn stream_archive(root: File, workdir: &str, path: &str, ids: Option<IdShift>, idle: Duration) -> Result<ByteChunks, BackendError> {
    use std::io::Write;
    use std::os::fd::AsFd;
    let comps = components(path, workdir)?;
    let src = format!("/{}", comps.join("/"));
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0).map_err(|e| map_errno(path, e))?;
    let runtime = tokio::runtime::Handle::try_current().map_err(|e| BackendError::Internal(format!("archive download outside the runtime: {e}")))?;
    let (out, rx) = chunk_channel(idle, path);
    let mut out = ChunkWriter { out, runtime, buf: Vec::with_capacity(DOWNLOAD_CHUNK) };
    std::thread::Builder::new()
        .name("sbx-tar".into())
        .spawn(move || {
            let limits = sandbox_exec::archive::CreateLimits { ids: ids.unwrap_or_default(), ..Default::default() };
            let result = sandbox_exec::archive::create(root.as_fd(), &src, &mut out, &limits)
                .map_err(BackendError::from)
                .and_then(|_| out.flush().map_err(|e| BackendError::io("sending the archive", e)));
            if let Err(e) = result {
                // After an idle end the last word was said already; this is then a no-op.
                out.out.fail(e);
            }
        })
        .map_err(|e| BackendError::io("starting an archive thread", e))?;
    Ok(rx)
}

/// Opens (creating, truncating) a file for the daemon to write into, e.g. an output spill file.
pub fn create_for_write(root: &Path, path: &str) -> Result<File, BackendError> {
    create_for_write_at(&open_root(root)?, path)
}

/// [`create_for_write`] below an open root directory.
pub(crate) fn create_for_write_at(root_file: &File, path: &str) -> Result<File, BackendError> {
    let comps = components(path, "/")?;
    let Some((_, dirs)) = comps.split_last() else {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "names the root directory".into() });
    };
    mkdir_all(root_file, dirs, path)?;
    let fd = open_in_root(root_file.as_raw_fd(), &comps.join("/"), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NONBLOCK, 0o644)
        .map_err(|e| map_errno(path, e))?;
    let file = File::from(fd);
    ensure_regular(&file, path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

    fn root() -> tempfile::TempDir {
        tempfile::tempdir().expect("tempdir")
    }

    #[tokio::test]
    async fn a_download_nobody_reads_is_not_read_ahead_and_ends_idle() {
        let r = root();
        let path = r.path().join("big");
        std::fs::write(&path, vec![5u8; 3 * DOWNLOAD_CHUNK + 10]).expect("write");
        let file = File::open(&path).expect("open");
        let Download { size, mut chunks } = stream_download(file, 3 * DOWNLOAD_CHUNK as u64 + 10, "/big", Duration::from_millis(300));
        assert_eq!(size, 3 * DOWNLOAD_CHUNK as u64 + 10);
        // Nobody reads: one chunk is made, then nothing more until the idle end is said.
        let first = chunks.recv().await.expect("a chunk").expect("data");
        assert_eq!(first.len(), DOWNLOAD_CHUNK);
        // Waits for the event, not a time: the second chunk and the idle end are both queued.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while chunks.len() < 2 {
            assert!(std::time::Instant::now() < deadline, "the idle end never came");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let second = chunks.recv().await.expect("the chunk made before the idle end").expect("data");
        assert_eq!(second.len(), DOWNLOAD_CHUNK);
        match chunks.recv().await {
            Some(Err(BackendError::Idle { path, .. })) => assert_eq!(path, "/big"),
            other => panic!("expected the idle end, got {other:?}"),
        }
        assert!(chunks.recv().await.is_none(), "nothing after the idle end");
        // A reader that keeps up gets the whole file and a clean end.
        let file = File::open(&path).expect("open");
        let Download { mut chunks, .. } = stream_download(file, 0, "/big", Duration::from_secs(30));
        let mut total = 0;
        while let Some(chunk) = chunks.recv().await {
            total += chunk.expect("data").len();
        }
        assert_eq!(total, 3 * DOWNLOAD_CHUNK + 10);
    }

    #[tokio::test]
    async fn an_upload_cut_short_removes_its_temporary_file() {
        let r = root();
        std::fs::write(r.path().join("f"), b"old").expect("write");
        let (tx, rx) = mpsc::channel(4);
        let upload = tokio::spawn(upload_file_in(open_root(r.path()).expect("root"), "/".into(), "/f".into(), 0, None, rx));
        tx.send(UploadPiece::Data(Bytes::from_static(b"new content"))).await.expect("send");
        drop(tx);
        let err = upload.await.expect("join").expect_err("no commit");
        assert!(matches!(err, BackendError::UploadIncomplete { .. }), "{err:?}");
        let names: Vec<String> = std::fs::read_dir(r.path()).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["f"], "only the old file");
        assert_eq!(std::fs::read(r.path().join("f")).expect("read"), b"old");
        let (tx, rx) = mpsc::channel(4);
        let upload = tokio::spawn(upload_file_in(open_root(r.path()).expect("root"), "/".into(), "/f".into(), 0o600, None, rx));
        for piece in [&b"new "[..], b"content"] {
            tx.send(UploadPiece::Data(Bytes::copy_from_slice(piece))).await.expect("send");
        }
        tx.send(UploadPiece::Commit).await.expect("commit");
        assert_eq!(upload.await.expect("join").expect("uploaded"), 11);
        assert_eq!(std::fs::read(r.path().join("f")).expect("read"), b"new content");
    }

    #[test]
    fn mount_points_become_real_directories() {
        let root = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("outside");
        std::os::unix::fs::symlink(outside.path(), root.path().join("sys")).expect("link");
        std::fs::write(root.path().join("proc"), b"file").expect("file");
        std::fs::create_dir(root.path().join("dev")).expect("dir");
        std::fs::write(root.path().join("dev/keep"), b"x").expect("in dev");
        for name in ["sys", "proc", "dev", "new"] {
            ensure_mount_point(root.path(), name).expect(name);
            assert!(std::fs::symlink_metadata(root.path().join(name)).expect(name).is_dir(), "{name}");
        }
        assert!(root.path().join("dev/keep").is_file(), "a directory is left as it is");
        assert!(outside.path().is_dir(), "the link's target is untouched");
    }

    #[test]
    fn write_then_read_back_with_parents_and_mode() {
        let r = root();
        assert_eq!(write_file(r.path(), "/workspace", "a/b/c.txt", b"hello", 0o600).expect("write"), 5);
        let meta = std::fs::metadata(r.path().join("workspace/a/b/c.txt")).expect("stat");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let chunk = read_file(r.path(), "/workspace", "/workspace/a/b/c.txt", 1, 3).expect("read");
        assert_eq!(chunk.content, b"ell");
        assert_eq!(chunk.size, 5);
        assert!(!chunk.eof);
        let rest = read_file(r.path(), "/", "/workspace/a/b/c.txt", 4, 0).expect("read");
        assert_eq!(rest.content, b"o");
        assert!(rest.eof);
    }

    #[test]
    fn dotdot_is_clamped_at_the_root() {
        let outer = root();
        let r = outer.path().join("rootfs");
        std::fs::create_dir(&r).expect("mkdir");
        write_file(&r, "/", "../../../escape.txt", b"x", 0).expect("write");
        assert!(r.join("escape.txt").exists(), "landed inside the root");
        assert!(!outer.path().join("escape.txt").exists(), "never outside");
    }

    #[test]
    fn symlinks_pointing_out_resolve_inside() {
        let outer = root();
        let r = outer.path().join("rootfs");
        std::fs::create_dir_all(r.join("etc")).expect("mkdir");
        std::fs::write(outer.path().join("secret"), b"host secret").expect("write");
        std::fs::write(r.join("etc/secret"), b"sandbox file").expect("write");
        // An absolute symlink to the host's file, and a relative one climbing out.
        std::os::unix::fs::symlink(outer.path().join("secret"), r.join("abs")).expect("symlink");
        std::os::unix::fs::symlink("../../../../../../etc/secret", r.join("rel")).expect("symlink");
        let abs = read_file(&r, "/", "/abs", 0, 0);
        assert!(matches!(abs, Err(BackendError::FileNotFound { .. })), "absolute link re-rooted: {abs:?}");
        let rel = read_file(&r, "/", "/rel", 0, 0).expect("relative link resolves inside");
        assert_eq!(rel.content, b"sandbox file");
        // Writing through a link to a host directory stays inside too.
        std::os::unix::fs::symlink(outer.path(), r.join("hostdir")).expect("symlink");
        // The link dangles inside the root, so the write fails, as it would on a real system.
        let planted = write_file(&r, "/", "/hostdir/planted", b"x", 0);
        assert!(planted.is_err(), "{planted:?}");
        assert!(!outer.path().join("planted").exists());
    }

    #[test]
    fn fifos_and_directories_are_refused() {
        let r = root();
        nix::unistd::mkfifo(&r.path().join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
        assert!(matches!(read_file(r.path(), "/", "/fifo", 0, 0), Err(BackendError::InvalidPath { .. })));
        std::fs::create_dir(r.path().join("d")).expect("mkdir");
        assert!(matches!(read_file(r.path(), "/", "/d", 0, 0), Err(BackendError::InvalidPath { .. })));
        assert!(matches!(write_file(r.path(), "/", "/", b"x", 0), Err(BackendError::InvalidPath { .. })));
        assert!(matches!(read_file(r.path(), "/", "", 0, 0), Err(BackendError::InvalidPath { .. })));
        // A FIFO is refused for writes too, and left a FIFO.
        assert!(matches!(write_file(r.path(), "/", "/fifo", b"x", 0), Err(BackendError::InvalidPath { .. })));
        assert!(std::fs::symlink_metadata(r.path().join("fifo")).expect("lstat").file_type().is_fifo());
    }

    #[test]
    fn long_names_and_symlink_loops_are_invalid_arguments_naming_the_path() {
        let r = root();
        let long = format!("/workspace/{}", "n".repeat(300));
        std::fs::create_dir_all(r.path().join("workspace")).expect("mkdir");
        std::os::unix::fs::symlink("loop-b", r.path().join("workspace/loop-a")).expect("symlink");
        std::os::unix::fs::symlink("loop-a", r.path().join("workspace/loop-b")).expect("symlink");
        let cases: Vec<(&str, Result<(), BackendError>)> = vec![
            ("write long", write_file(r.path(), "/", &long, b"x", 0).map(drop)),
            ("read long", read_file(r.path(), "/", &long, 0, 0).map(drop)),
            ("remove long", remove_file(r.path(), "/", &long)),
            ("write loop", write_file(r.path(), "/", "/workspace/loop-a", b"x", 0).map(drop)),
            ("read loop", read_file(r.path(), "/", "/workspace/loop-a", 0, 0).map(drop)),
            ("write below a loop", write_file(r.path(), "/", "/workspace/loop-a/f", b"x", 0).map(drop)),
        ];
        // InvalidPath becomes INVALID_ARGUMENT with the path in its message (api::status tests
        // that mapping); here, that the error is InvalidPath and carries the path.
        for (what, result) in cases {
            let err = result.expect_err(what);
            assert!(matches!(&err, BackendError::InvalidPath { path, .. } if path.contains("/workspace/")), "{what}: {err:?}");
        }
        // The kernel's own ENAMETOOLONG and ELOOP map the same way.
        for e in [Errno::ENAMETOOLONG, Errno::ELOOP] {
            assert!(matches!(map_errno("/p", e), BackendError::InvalidPath { .. }), "{e}");
        }
        assert!(matches!(map_errno("/p", Errno::ENOSPC), BackendError::DiskFull { .. }));
    }

    #[test]
    fn overwrite_replaces_the_file_atomically_and_keeps_links_and_owner() {
        let r = root();
        std::fs::create_dir_all(r.path().join("w")).expect("mkdir");
        std::fs::write(r.path().join("w/f"), b"a much longer first version").expect("write");
        std::os::unix::fs::chown(r.path().join("w/f"), Some(1000), Some(1000)).expect("chown");
        let before = std::fs::metadata(r.path().join("w/f")).expect("stat").ino();
        write_file(r.path(), "/", "/w/f", b"short", 0o600).expect("overwrite");
        let meta = std::fs::metadata(r.path().join("w/f")).expect("stat");
        assert_eq!(std::fs::read(r.path().join("w/f")).expect("read"), b"short");
        assert_ne!(meta.ino(), before, "a new file was renamed into place");
        assert_eq!((meta.uid(), meta.gid(), meta.permissions().mode() & 0o7777), (1000, 1000, 0o600));
        // A link as the last component is written through (inside the root), and stays a link.
        std::os::unix::fs::symlink("/w/f", r.path().join("w/link")).expect("symlink");
        write_file(r.path(), "/", "/w/link", b"via link", 0).expect("write through link");
        assert_eq!(std::fs::read(r.path().join("w/f")).expect("read"), b"via link");
        assert!(std::fs::symlink_metadata(r.path().join("w/link")).expect("lstat").file_type().is_symlink());
        let names: Vec<String> = std::fs::read_dir(r.path().join("w")).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "temporary files left: {names:?}");
    }

    #[test]
    fn remove_file_unlinks_files_and_links_only() {
        let outer = root();
        let r = outer.path().join("rootfs");
        std::fs::create_dir_all(r.join("d")).expect("mkdir");
        std::fs::write(outer.path().join("host"), b"host").expect("write");
        std::fs::write(r.join("f"), b"x").expect("write");
        std::os::unix::fs::symlink(outer.path().join("host"), r.join("link")).expect("symlink");
        remove_file(&r, "/", "/f").expect("remove a file");
        assert!(!r.join("f").exists());
        remove_file(&r, "/", "/link").expect("remove a link");
        assert!(std::fs::symlink_metadata(r.join("link")).is_err(), "the link is gone");
        assert_eq!(std::fs::read(outer.path().join("host")).expect("read"), b"host", "its target is not touched");
        remove_file(&r, "/", "/f").expect("a missing file is fine");
        remove_file(&r, "/", "/no/such/dir/f").expect("a missing parent is fine");
        remove_file(&r, "/w", "../../../f").expect("clamped at the root");
        assert!(matches!(remove_file(&r, "/", "/d"), Err(BackendError::InvalidPath { .. })));
        assert!(r.join("d").is_dir());
        nix::unistd::mkfifo(&r.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
        assert!(matches!(remove_file(&r, "/", "/fifo"), Err(BackendError::InvalidPath { .. })));
        assert!(matches!(remove_file(&r, "/", "/"), Err(BackendError::InvalidPath { .. })));
        // Through a directory link that points out of the root: resolved inside, nothing there.
        std::os::unix::fs::symlink(outer.path(), r.join("hostdir")).expect("symlink");
        remove_file(&r, "/", "/hostdir/host").expect("nothing inside by that name");
        assert!(outer.path().join("host").exists(), "the host's file is untouched");
    }

    /// Runs `f` in this thread with a private mount namespace holding a tmpfs of `bytes` (root
    /// only, as CI runs: a test that cannot get one fails).
    fn with_small_fs(bytes: u64, f: impl FnOnce(&Path) + Send) {
        use nix::mount::{mount, MsFlags};
        let dir = root();
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare a mount namespace (run the tests as root)");
                mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>).expect("make mounts private");
                mount(Some("tmpfs"), dir.path(), Some("tmpfs"), MsFlags::empty(), Some(format!("size={bytes}").as_str())).expect("mount a small tmpfs");
                f(dir.path());
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        });
    }

    #[test]
    fn a_write_the_full_disk_refuses_leaves_the_old_file_byte_for_byte() {
        with_small_fs(1 << 20, |r| {
            let old: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            write_file(r, "/", "/w/f", &old, 0o640).expect("first version");
            // Fill the rest of the disk.
            let mut filler = std::fs::File::create(r.join("filler")).expect("create");
            let block = vec![1u8; 64 << 10];
            while std::io::Write::write_all(&mut filler, &block).is_ok() {}
            drop(filler);
            let err = write_file(r, "/", "/w/f", &vec![2u8; 300_000], 0).expect_err("no room for the new version");
            assert!(matches!(err, BackendError::DiskFull { .. }), "{err:?}");
            assert_eq!(std::fs::read(r.join("w/f")).expect("read"), old, "the old file is intact");
            assert_eq!(std::fs::metadata(r.join("w/f")).expect("stat").permissions().mode() & 0o7777, 0o640);
            let names: Vec<String> = std::fs::read_dir(r.join("w")).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
            assert_eq!(names, ["f"], "the temporary file was removed");
        });
    }
}
