//! `WriteFile` and `ReadFile`: regular files only, absolute paths only.
//!
//! Paths are resolved with `openat2(RESOLVE_IN_ROOT)` against a root directory: `/` in the guest
//! (where that is ordinary resolution), a temp dir in unit tests. The VM is the isolation boundary,
//! so symlinks are followed; what matters here is that a FIFO or device node is refused before
//! any byte moves (and without blocking on a FIFO or acquiring a terminal), and that a full disk
//! is reported as such.
//!
//! Replacing a file is atomic: the bytes go to a hidden temporary file beside the target
//! (`O_EXCL`), which is synced, given its mode and renamed over it, so a write the disk refuses
//! leaves the old file byte for byte. A big file arrives in chunks (`WriteStaged`): the
//! temporary file stays open between them under the host's transfer id, a bounded number at a
//! time, and is dropped when a chunk fails, when the host aborts, or when it sits idle too long.

use sandbox_exec::sys::{open_in_root, FileSlot, TempFile};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_agent::protocol::{ErrorKind, FILE_CHUNK, MAX_STAGED_WRITES, MAX_TRANSFER_ID};
use nix::errno::Errno;

use super::RequestError;

/// Mode of a created file when the request says 0.
const DEFAULT_MODE: u32 = 0o644;
/// A staged write with no chunk for this long was abandoned by the host; its temporary file is
/// removed when the next staged write starts.
const STAGED_IDLE: Duration = Duration::from_secs(600);

/// A file being replaced in chunks.
struct Staged {
    slot: FileSlot,
    temp: TempFile,
    /// Bytes written so far; the next chunk must start here.
    size: u64,
    touched: Instant,
}

impl Staged {
    /// Removes the temporary file (the target was never touched).
    fn discard(self) {
        let _ = sandbox_exec::sys::unlink_at(self.slot.dir.as_raw_fd(), &self.temp.name);
    }
}

/// File access below one root directory.
#[derive(Clone)]
pub struct Files {
    root: PathBuf,
    staged: Arc<Mutex<HashMap<String, Staged>>>,
}

impl std::fmt::Debug for Files {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Files").field("root", &self.root).finish_non_exhaustive()
    }
}

/// A slice of a file.
#[derive(Debug, PartialEq, Eq)]
pub struct Chunk {
    pub bytes: Vec<u8>,
    /// Size of the whole file.
    pub size: u64,
    pub eof: bool,
}

fn invalid(path: &str, reason: impl std::fmt::Display) -> RequestError {
    RequestError::new(ErrorKind::InvalidPath, format!("{path}: {reason}"))
}

fn map_errno(path: &str, e: Errno) -> RequestError {
    match e {
        Errno::ENOENT => RequestError::new(ErrorKind::NotFound, format!("{path}: no such file")),
        Errno::ENOSPC | Errno::EDQUOT => RequestError::new(ErrorKind::DiskFull, format!("{path}: {}", e.desc())),
        Errno::EISDIR => invalid(path, "is a directory"),
        Errno::ENOTDIR => invalid(path, "a parent is not a directory"),
        Errno::ELOOP => invalid(path, "too many levels of symbolic links"),
        Errno::ENAMETOOLONG => invalid(path, "file name too long"),
        Errno::EILSEQ => invalid(path, "a symbolic link on the way is not valid UTF-8"),
        Errno::EBUSY => invalid(path, "a mount point"),
        Errno::ENXIO | Errno::ENODEV | Errno::EACCES | Errno::EPERM | Errno::EROFS | Errno::ETXTBSY => invalid(path, e.desc()),
        other => RequestError::new(ErrorKind::Internal, format!("{path}: {}", other.desc())),
    }
}

fn io_errno(e: &std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// The normal components of an absolute path; `..` is kept for the kernel to clamp at the root.
fn components(path: &str) -> Result<Vec<String>, RequestError> {
    if !path.starts_with('/') {
        return Err(invalid(path, "not an absolute path"));
    }
    if path.contains('\0') {
        return Err(invalid(path, "contains a NUL byte"));
    }
    let mut out = Vec::new();
    for c in Path::new(path).components() {
        match c {
            Component::Normal(s) if s.len() > sandbox_exec::sys::NAME_MAX => return Err(map_errno(path, Errno::ENAMETOOLONG)),
            Component::Normal(s) => out.push(s.to_string_lossy().into_owned()),
            Component::ParentDir => out.push("..".to_string()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// The components of a path that names a file: not the root, not ending in `..`.
fn file_components(path: &str) -> Result<Vec<String>, RequestError> {
    let comps = components(path)?;
    match comps.last().map(String::as_str) {
        None => Err(invalid(path, "names the root directory")),
        Some("..") => Err(invalid(path, "ends in ..")),
        Some(_) => Ok(comps),
    }
}

fn ensure_regular(file: &File, path: &str) -> Result<u64, RequestError> {
    let meta = file.metadata().map_err(|e| map_errno(path, io_errno(&e)))?;
    if !meta.file_type().is_file() {
        return Err(invalid(path, "not a regular file"));
    }
    Ok(meta.len())
}

impl Files {
    /// Files below `root` (`/` in the guest).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Files { root: root.into(), staged: Arc::default() }
    }

    /// Writes /etc/hostname and /etc/hosts for `hostname` (see `sandbox_exec::etc`: nothing the
    /// sandbox planted in /etc is followed).
    pub fn write_identity(&self, hostname: &str) -> Result<(), RequestError> {
        let root = self.open_root()?;
        sandbox_exec::etc::write_identity(root.as_raw_fd(), hostname).map_err(|e| match e {
            sandbox_exec::etc::EtcError::BadHostname(_) | sandbox_exec::etc::EtcError::BadMachineId(_) => {
                RequestError::new(ErrorKind::BadRequest, e.to_string())
            }
            sandbox_exec::etc::EtcError::Sys { .. } => RequestError::new(ErrorKind::Internal, e.to_string()),
        })
    }

    /// Writes /etc/machine-id.
    pub fn write_machine_id(&self, id: &str) -> Result<(), RequestError> {
        let root = self.open_root()?;
        sandbox_exec::etc::write_machine_id(root.as_raw_fd(), id).map_err(|e| match e {
            sandbox_exec::etc::EtcError::BadMachineId(_) => RequestError::new(ErrorKind::BadRequest, e.to_string()),
            _ => RequestError::new(ErrorKind::Internal, e.to_string()),
        })
    }

    /// Writes /etc/resolv.conf naming `nameserver` (the host's filter) only.
    pub fn write_resolv_conf(&self, nameserver: std::net::Ipv4Addr) -> Result<(), RequestError> {
        let root = self.open_root()?;
        sandbox_exec::etc::write_resolv_conf(root.as_raw_fd(), nameserver).map_err(|e| RequestError::new(ErrorKind::Internal, e.to_string()))
    }

    fn open_root(&self) -> Result<File, RequestError> {
        File::open(&self.root).map_err(|e| RequestError::new(ErrorKind::Internal, format!("opening root {}: {e}", self.root.display())))
    }

    /// Creates every missing directory of `dirs`.
    fn mkdir_all(root: &File, dirs: &[String], display: &str) -> Result<(), RequestError> {
        // Components with a NUL byte were refused when the path was split.
        sandbox_exec::sys::mkdir_all_in_root(root.as_raw_fd(), dirs).map_err(|e| map_errno(display, e))
    }

    /// Opens `path` for writing, creating it and its parents; refuses anything but a regular
    /// file without opening it for I/O first.
    fn open_for_write(&self, path: &str, mode: u32, append: bool) -> Result<File, RequestError> {
        let comps = file_components(path)?;
        let root = self.open_root()?;
        Self::mkdir_all(&root, &comps[..comps.len() - 1], path)?;
        let rel = comps.join("/");
        // Look before opening: opening a device or FIFO can itself have effects.
        match open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0) {
            Ok(fd) => {
                ensure_regular(&File::from(fd), path)?;
            }
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(map_errno(path, e)),
        }
        let mut flags = libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK | libc::O_NOCTTY;
        if append {
            flags |= libc::O_APPEND;
        }
        let file = File::from(open_in_root(root.as_raw_fd(), &rel, flags, mode).map_err(|e| map_errno(path, e))?);
        ensure_regular(&file, path)?;
        Ok(file)
    }

    /// Where a write to `path` lands (parents created, last-component links followed); a
    /// directory or special file there is refused before any byte moves.
    fn writable_slot(&self, path: &str) -> Result<FileSlot, RequestError> {
        let comps = file_components(path)?;
        let root = self.open_root()?;
        Self::mkdir_all(&root, &comps[..comps.len() - 1], path)?;
        let slot = sandbox_exec::sys::resolve_file_slot(root.as_raw_fd(), &comps).map_err(|e| map_errno(path, e))?;
        if slot.existing.as_ref().is_some_and(|st| sandbox_exec::sys::file_type(st) != libc::S_IFREG) {
            return Err(invalid(path, "not a regular file"));
        }
        Ok(slot)
    }

    /// `WriteFile`: replaces `path` atomically (or appends to it in place), sets `mode`
    /// (0 = 0644) and returns the file's size afterwards.
    pub fn write(&self, path: &str, mode: u32, append: bool, bytes: &[u8]) -> Result<u64, RequestError> {
        let mode = if mode == 0 { DEFAULT_MODE } else { mode & 0o7777 };
        if !append {
            let slot = self.writable_slot(path)?;
            sandbox_exec::sys::replace_file(&slot, bytes, mode).map_err(|e| map_errno(path, e))?;
            return Ok(bytes.len() as u64);
        }
        let mut file = self.open_for_write(path, mode, append)?;
        file.write_all(bytes).map_err(|e| map_errno(path, io_errno(&e)))?;
        // Explicitly: the mode given at creation is filtered by the umask and ignored for an
        // existing file.
        file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| map_errno(path, io_errno(&e)))?;
        let size = file.metadata().map_err(|e| map_errno(path, io_errno(&e)))?.len();
        Ok(size)
    }

    /// `WriteStaged`: one chunk of an atomic replacement of `path` (see the module docs).
    /// Returns the bytes staged so far.
    pub fn write_staged(&self, transfer: &str, path: &str, mode: u32, offset: u64, commit: bool, bytes: &[u8]) -> Result<u64, RequestError> {
        if transfer.is_empty() || transfer.len() > MAX_TRANSFER_ID {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("transfer id of {} bytes (1..={MAX_TRANSFER_ID})", transfer.len())));
        }
        let mode = if mode == 0 { DEFAULT_MODE } else { mode & 0o7777 };
        let mut staged = if offset == 0 {
            self.abort_staged(transfer);
            self.reserve_staged()?;
            let slot = self.writable_slot(path)?;
            let temp = sandbox_exec::sys::create_temp_in(slot.dir.as_raw_fd()).map_err(|e| map_errno(path, e))?;
            Staged { slot, temp, size: 0, touched: Instant::now() }
        } else {
            // Out of the table while it is written: a duplicate chunk finds nothing.
            let taken = self.staged.lock().unwrap_or_else(|p| p.into_inner()).remove(transfer);
            let Some(staged) = taken else {
                return Err(RequestError::new(ErrorKind::BadRequest, format!("no staged write {transfer:?} (it failed, expired or was aborted)")));
            };
            if staged.size != offset {
                let at = staged.size;
                staged.discard();
                return Err(RequestError::new(ErrorKind::BadRequest, format!("chunk at offset {offset} of staged write {transfer:?}, which holds {at} bytes")));
            }
            staged
        };
        if let Err(e) = staged.temp.file.write_all_at(bytes, offset) {
            staged.discard();
            return Err(map_errno(path, io_errno(&e)));
        }
        staged.size += bytes.len() as u64;
        if commit {
            let size = staged.size;
            if let Err(e) = sandbox_exec::sys::commit_temp(&staged.slot, &staged.temp, mode) {
                staged.discard();
                return Err(map_errno(path, e));
            }
            return Ok(size);
        }
        staged.touched = Instant::now();
        let size = staged.size;
        self.staged.lock().unwrap_or_else(|p| p.into_inner()).insert(transfer.to_string(), staged);
        Ok(size)
    }

    /// Makes room for one more staged write: drops the abandoned ones, refuses past the bound.
    fn reserve_staged(&self) -> Result<(), RequestError> {
        let expired: Vec<Staged> = {
            let mut table = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            let old: Vec<String> = table.iter().filter(|(_, s)| s.touched.elapsed() > STAGED_IDLE).map(|(k, _)| k.clone()).collect();
            let expired = old.iter().filter_map(|k| table.remove(k)).collect();
            if table.len() >= MAX_STAGED_WRITES {
                return Err(RequestError::new(ErrorKind::Internal, format!("{MAX_STAGED_WRITES} staged writes are already in progress")));
            }
            expired
        };
        expired.into_iter().for_each(Staged::discard);
        Ok(())
    }

    /// `AbortWrite`: drops a staged write and its temporary file (nothing if there is none).
    pub fn abort_staged(&self, transfer: &str) {
        let taken = self.staged.lock().unwrap_or_else(|p| p.into_inner()).remove(transfer);
        if let Some(staged) = taken {
            staged.discard();
        }
    }

    /// `RemoveFile`: unlinks a regular file or a symlink (the link, never its target). A path
    /// that does not exist is fine; a directory or special file is refused.
    pub fn remove(&self, path: &str) -> Result<(), RequestError> {
        let comps = file_components(path)?;
        let root = self.open_root()?;
        use sandbox_exec::sys::RemoveError;
        sandbox_exec::sys::remove_file_in_root(root.as_raw_fd(), &comps).map_err(|e| match e {
            RemoveError::IsDirectory => invalid(path, "is a directory"),
            RemoveError::NotAFile => invalid(path, "not a regular file or symbolic link"),
            RemoveError::Sys(e) => map_errno(path, e),
        })
    }

    /// `ReadFile`: at most `min(limit, FILE_CHUNK)` bytes from `offset` (`limit` 0 = a chunk).
    pub fn read(&self, path: &str, offset: u64, limit: u64) -> Result<Chunk, RequestError> {
        let comps = file_components(path)?;
        let root = self.open_root()?;
        let rel = comps.join("/");
        ensure_regular(&File::from(open_in_root(root.as_raw_fd(), &rel, libc::O_PATH, 0).map_err(|e| map_errno(path, e))?), path)?;
        let file = File::from(open_in_root(root.as_raw_fd(), &rel, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0).map_err(|e| map_errno(path, e))?);
        let size = ensure_regular(&file, path)?;
        let limit = if limit == 0 { FILE_CHUNK } else { limit.min(FILE_CHUNK) };
        let want = size.saturating_sub(offset).min(limit) as usize;
        let mut bytes = vec![0u8; want];
        let mut got = 0;
        while got < want {
            match file.read_at(&mut bytes[got..], offset + got as u64) {
                Ok(0) => break, // the file shrank meanwhile
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(map_errno(path, io_errno(&e))),
            }
        }
        bytes.truncate(got);
        let eof = offset + got as u64 >= size;
        Ok(Chunk { bytes, size, eof })
    }

    /// Creates a directory and its missing parents (the sandbox's workdir).
    pub fn create_dir_all(&self, path: &str) -> Result<(), RequestError> {
        let comps = components(path)?;
        let root = self.open_root()?;
        Self::mkdir_all(&root, &comps, path)
    }

    /// Creates (truncating) a file for the agent itself to write, e.g. an output spill file.
    pub fn create(&self, path: &str) -> Result<File, RequestError> {
        let file = self.open_for_write(path, DEFAULT_MODE, false)?;
        file.set_len(0).map_err(|e| map_errno(path, io_errno(&e)))?;
        Ok(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind<T: std::fmt::Debug>(r: Result<T, RequestError>) -> ErrorKind {
        r.expect_err("expected an error").kind
    }

    #[test]
    fn write_creates_parents_sets_mode_and_reads_back_in_slices() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        assert_eq!(files.write("/a/b/c.txt", 0o600, false, b"hello").expect("write"), 5);
        let meta = std::fs::metadata(dir.path().join("a/b/c.txt")).expect("stat");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        assert_eq!(files.read("/a/b/c.txt", 1, 3).expect("read"), Chunk { bytes: b"ell".to_vec(), size: 5, eof: false });
        assert_eq!(files.read("/a/b/c.txt", 4, 0).expect("read"), Chunk { bytes: b"o".to_vec(), size: 5, eof: true });
        assert_eq!(files.read("/a/b/c.txt", 99, 10).expect("read"), Chunk { bytes: vec![], size: 5, eof: true });
    }

    #[test]
    fn append_adds_and_truncate_replaces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        files.write("/f", 0, false, b"0123456789").expect("write");
        assert_eq!(files.write("/f", 0, true, b"ab").expect("append"), 12);
        assert_eq!(files.write("/f", 0o755, false, b"xy").expect("truncate"), 2);
        assert_eq!(std::fs::read(dir.path().join("f")).expect("read"), b"xy");
        let mode = std::fs::metadata(dir.path().join("f")).expect("stat").permissions().mode();
        assert_eq!(mode & 0o7777, 0o755, "the mode of an existing file is set too");
    }

    #[test]
    fn reads_are_bounded_by_one_chunk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        let big = vec![7u8; FILE_CHUNK as usize + 10];
        files.write("/big", 0, false, &big).expect("write");
        let c = files.read("/big", 0, u64::MAX).expect("read");
        assert_eq!(c.bytes.len() as u64, FILE_CHUNK);
        assert_eq!(c.size, FILE_CHUNK + 10);
        assert!(!c.eof);
    }

    #[test]
    fn bad_paths_and_non_regular_files_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        assert_eq!(kind(files.write("relative/x", 0, false, b"")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.write("/nul\0x", 0, false, b"")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.write("/", 0, false, b"")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.read("", 0, 0)), ErrorKind::InvalidPath);
        assert_eq!(kind(files.read("/missing", 0, 0)), ErrorKind::NotFound);
        std::fs::create_dir(dir.path().join("d")).expect("mkdir");
        assert_eq!(kind(files.read("/d", 0, 0)), ErrorKind::InvalidPath);
        assert_eq!(kind(files.write("/d", 0, false, b"x")), ErrorKind::InvalidPath);
        // A FIFO with no reader: refused at once, not a write that blocks forever.
        nix::unistd::mkfifo(&dir.path().join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
        assert_eq!(kind(files.write("/fifo", 0, false, b"x")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.read("/fifo", 0, 0)), ErrorKind::InvalidPath);
        // A file where a parent directory should be.
        files.write("/plain", 0, false, b"x").expect("write");
        assert_eq!(kind(files.write("/plain/child", 0, false, b"x")), ErrorKind::InvalidPath);
    }

    #[test]
    fn dotdot_and_absolute_symlinks_stay_below_the_root() {
        let outer = tempfile::tempdir().expect("tempdir");
        let root = outer.path().join("root");
        std::fs::create_dir(&root).expect("mkdir");
        let files = Files::new(&root);
        files.write("/../../escape", 0, false, b"x").expect("write");
        assert!(root.join("escape").exists());
        assert!(!outer.path().join("escape").exists());
        std::os::unix::fs::symlink("/target", root.join("link")).expect("symlink");
        files.write("/link", 0, false, b"via link").expect("write through link");
        assert_eq!(std::fs::read(root.join("target")).expect("read"), b"via link");
        assert!(std::fs::symlink_metadata(root.join("link")).expect("lstat").file_type().is_symlink());
        // Removing the link removes the link, not what it points to.
        files.remove("/link").expect("remove");
        assert!(root.join("target").exists() && std::fs::symlink_metadata(root.join("link")).is_err());
    }

    #[test]
    fn long_names_and_loops_are_invalid_paths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        let long = format!("/{}", "x".repeat(256));
        assert_eq!(kind(files.write(&long, 0, false, b"x")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.read(&long, 0, 0)), ErrorKind::InvalidPath);
        assert_eq!(kind(files.remove(&long)), ErrorKind::InvalidPath);
        std::os::unix::fs::symlink("b", dir.path().join("a")).expect("symlink");
        std::os::unix::fs::symlink("a", dir.path().join("b")).expect("symlink");
        assert_eq!(kind(files.write("/a", 0, false, b"x")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.write_staged("t", "/a", 0, 0, true, b"x")), ErrorKind::InvalidPath);
        assert_eq!(kind(files.read("/a", 0, 0)), ErrorKind::InvalidPath);
        assert_eq!(kind(files.write("/a/f", 0, false, b"x")), ErrorKind::InvalidPath);
        assert_eq!(map_errno("/p", Errno::ENAMETOOLONG).kind, ErrorKind::InvalidPath);
    }

    #[test]
    fn staged_writes_are_bounded_and_abandoned_ones_expire() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = Files::new(dir.path());
        for i in 0..MAX_STAGED_WRITES {
            files.write_staged(&format!("t{i}"), &format!("/f{i}"), 0, 0, false, b"x").expect("stage");
        }
        assert_eq!(kind(files.write_staged("one-more", "/g", 0, 0, false, b"x")), ErrorKind::Internal);
        assert_eq!(kind(files.write_staged(&"t".repeat(MAX_TRANSFER_ID + 1), "/g", 0, 0, false, b"x")), ErrorKind::BadRequest);
        // Make every transfer look abandoned: the next one clears them all away.
        for s in files.staged.lock().expect("lock").values_mut() {
            s.touched = Instant::now() - STAGED_IDLE - Duration::from_secs(1);
        }
        files.write_staged("fresh", "/g", 0, 0, true, b"done").expect("room again");
        assert_eq!(files.staged.lock().expect("lock").len(), 0);
        let mut names: Vec<String> = std::fs::read_dir(dir.path()).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, ["g"], "expired temporary files are removed and targets never created");
    }

    #[test]
    fn a_write_the_full_disk_refuses_leaves_the_old_file_byte_for_byte() {
        use nix::mount::{mount, MsFlags};
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        // In a thread of its own with a private mount namespace: a 1 MiB tmpfs as the disk
        // (root only, as CI runs the tests).
        std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare a mount namespace (run the tests as root)");
            mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>).expect("make mounts private");
            mount(Some("tmpfs"), &root, Some("tmpfs"), MsFlags::empty(), Some("size=1048576")).expect("mount a small tmpfs");
            let files = Files::new(&root);
            let old: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            files.write("/w/f", 0o640, false, &old).expect("first version");
            let mut filler = File::create(root.join("filler")).expect("create");
            while filler.write_all(&[1u8; 64 << 10]).is_ok() {}
            drop(filler);
            assert_eq!(kind(files.write("/w/f", 0, false, &vec![2u8; 300_000])), ErrorKind::DiskFull);
            assert_eq!(files.write_staged("t", "/w/f", 0, 0, false, &vec![3u8; 150_000]).map(drop).err().map(|e| e.kind), Some(ErrorKind::DiskFull));
            // A transfer that fails at a later chunk leaves the file as it was too.
            std::fs::remove_file(root.join("filler")).expect("rm");
            let mut filler = File::create(root.join("filler")).expect("create");
            filler.write_all(&vec![1u8; 700_000]).expect("fill most");
            drop(filler);
            files.write_staged("t", "/w/f", 0, 0, false, &vec![4u8; 100_000]).expect("first chunk fits");
            assert_eq!(kind(files.write_staged("t", "/w/f", 0, 100_000, true, &vec![4u8; 300_000])), ErrorKind::DiskFull);
            assert_eq!(std::fs::read(root.join("w/f")).expect("read"), old, "the old file is intact");
            assert_eq!(std::fs::metadata(root.join("w/f")).expect("stat").permissions().mode() & 0o7777, 0o640);
            let names: Vec<String> = std::fs::read_dir(root.join("w")).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
            assert_eq!(names, ["f"], "the temporary files were removed");
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    }
}
