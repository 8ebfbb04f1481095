//! File access inside a sandbox's root filesystem, from the daemon, without ever leaving it.
//!
//! The daemon reaches a sandbox's files through the host path of its merged overlay. A path from a
//! client (or a symlink planted by code in the sandbox) could point anywhere on the host, so every
//! lookup goes through `openat2(RESOLVE_IN_ROOT)`: the kernel resolves `..` and symlinks — absolute
//! ones included — as if the sandbox root were `/`. Only regular files are read or written; a FIFO
//! or device node planted by the sandbox is refused before any byte moves (and the overlay is
//! mounted `nodev` besides).

use guest_agent::sys::open_in_root;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;

use crate::backend::{BackendError, FileChunk};

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
    let full: PathBuf = if path.starts_with('/') { PathBuf::from(path) } else { Path::new(workdir).join(path) };
    let mut out = Vec::new();
    for c in full.components() {
        match c {
            Component::Normal(s) => out.push(s.to_string_lossy().into_owned()),
            Component::ParentDir => out.push("..".to_string()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

fn map_errno(path: &str, e: Errno) -> BackendError {
    match e {
        Errno::ENOENT => BackendError::FileNotFound { path: path.to_string() },
        Errno::ENOSPC | Errno::EDQUOT => BackendError::DiskFull { path: path.to_string() },
        Errno::EISDIR => BackendError::InvalidPath { path: path.to_string(), reason: "is a directory".into() },
        Errno::ENOTDIR => BackendError::InvalidPath { path: path.to_string(), reason: "a parent is not a directory".into() },
        Errno::ELOOP => BackendError::InvalidPath { path: path.to_string(), reason: "too many levels of symbolic links".into() },
        Errno::ENXIO | Errno::ENODEV | Errno::EACCES | Errno::EPERM => {
            BackendError::InvalidPath { path: path.to_string(), reason: format!("not accessible: {}", e.desc()) }
        }
        other => BackendError::io(format!("accessing {path} in the sandbox"), std::io::Error::from(other)),
    }
}

fn open_root(root: &Path) -> Result<File, BackendError> {
    File::open(root).map_err(|e| BackendError::io(format!("opening sandbox root {}", root.display()), e))
}

fn ensure_regular(file: &File, path: &str) -> Result<u64, BackendError> {
    let meta = file.metadata().map_err(|e| BackendError::io(format!("stat {path}"), e))?;
    if !meta.file_type().is_file() {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "not a regular file".into() });
    }
    Ok(meta.len())
}

/// Creates every missing directory of `dirs` (already split), each lookup confined to `root`.
fn mkdir_all(root: &File, dirs: &[String], display: &str) -> Result<(), BackendError> {
    guest_agent::sys::mkdir_all_in_root(root.as_raw_fd(), dirs).map_err(|e| map_errno(display, e))
}

/// Creates a directory and its parents inside the root (used at setup for the workdir).
pub fn create_dir_all(root: &Path, path: &str) -> Result<(), BackendError> {
    let comps = components(path, "/")?;
    let root_file = open_root(root)?;
    mkdir_all(&root_file, &comps, path)
}

/// Writes a whole file (creating parents), with `mode` (0 = 0644). Returns the bytes written.
pub fn write_file(root: &Path, workdir: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    let comps = components(path, workdir)?;
    let Some((name, dirs)) = comps.split_last() else {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "names the root directory".into() });
    };
    if name == ".." {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "ends in ..".into() });
    }
    let root_file = open_root(root)?;
    mkdir_all(&root_file, dirs, path)?;
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    let fd = open_in_root(root_file.as_raw_fd(), &comps.join("/"), libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK, mode)
        .map_err(|e| map_errno(path, e))?;
    let mut file = File::from(fd);
    ensure_regular(&file, path)?;
    file.set_len(0).map_err(|e| map_errno(path, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    file.write_all(content).map_err(|e| map_errno(path, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|e| BackendError::io(format!("chmod {path}"), e))?;
    Ok(content.len() as u64)
}

/// Reads up to `limit` bytes (0 = [`MAX_READ`]) from `offset`.
pub fn read_file(root: &Path, workdir: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    let comps = components(path, workdir)?;
    let root_file = open_root(root)?;
    let rel = if comps.is_empty() { ".".to_string() } else { comps.join("/") };
    let fd = open_in_root(root_file.as_raw_fd(), &rel, libc::O_RDONLY | libc::O_NONBLOCK, 0).map_err(|e| map_errno(path, e))?;
    let mut file = File::from(fd);
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

/// Opens (creating, truncating) a file for the daemon to write into, e.g. an output spill file.
pub fn create_for_write(root: &Path, path: &str) -> Result<File, BackendError> {
    let comps = components(path, "/")?;
    let Some((_, dirs)) = comps.split_last() else {
        return Err(BackendError::InvalidPath { path: path.to_string(), reason: "names the root directory".into() });
    };
    let root_file = open_root(root)?;
    mkdir_all(&root_file, dirs, path)?;
    let fd = open_in_root(root_file.as_raw_fd(), &comps.join("/"), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NONBLOCK, 0o644)
        .map_err(|e| map_errno(path, e))?;
    let file = File::from(fd);
    ensure_regular(&file, path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> tempfile::TempDir {
        tempfile::tempdir().expect("tempdir")
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
    }
}
