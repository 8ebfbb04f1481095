//! `WriteFile` and `ReadFile`: regular files only, absolute paths only.
//!
//! Paths are resolved with `openat2(RESOLVE_IN_ROOT)` against a root directory: `/` in the guest
//! (where that is ordinary resolution), a temp dir in unit tests. The VM is the isolation boundary,
//! so symlinks are followed; what matters here is that a FIFO or device node is refused before
//! any byte moves (and without blocking on a FIFO or acquiring a terminal), and that a full disk
//! is reported as such.

use guest_agent::sys::open_in_root;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use guest_agent::protocol::{ErrorKind, FILE_CHUNK};
use nix::errno::Errno;

use super::RequestError;

/// Mode of a created file when the request says 0.
const DEFAULT_MODE: u32 = 0o644;

/// File access below one root directory.
#[derive(Debug, Clone)]
pub struct Files {
    root: PathBuf,
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
        Files { root: root.into() }
    }

    fn open_root(&self) -> Result<File, RequestError> {
        File::open(&self.root).map_err(|e| RequestError::new(ErrorKind::Internal, format!("opening root {}: {e}", self.root.display())))
    }

    /// Creates every missing directory of `dirs`.
    fn mkdir_all(root: &File, dirs: &[String], display: &str) -> Result<(), RequestError> {
        // Components with a NUL byte were refused when the path was split.
        guest_agent::sys::mkdir_all_in_root(root.as_raw_fd(), dirs).map_err(|e| map_errno(display, e))
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

    /// `WriteFile`: creates or truncates (or appends to) `path`, sets `mode` (0 = 0644) and
    /// returns the file's size afterwards.
    pub fn write(&self, path: &str, mode: u32, append: bool, bytes: &[u8]) -> Result<u64, RequestError> {
        let mode = if mode == 0 { DEFAULT_MODE } else { mode & 0o7777 };
        let mut file = self.open_for_write(path, mode, append)?;
        if !append {
            file.set_len(0).map_err(|e| map_errno(path, io_errno(&e)))?;
        }
        file.write_all(bytes).map_err(|e| map_errno(path, io_errno(&e)))?;
        // Explicitly: the mode given at creation is filtered by the umask and ignored for an
        // existing file.
        file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| map_errno(path, io_errno(&e)))?;
        let size = file.metadata().map_err(|e| map_errno(path, io_errno(&e)))?.len();
        Ok(size)
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
    }
}
