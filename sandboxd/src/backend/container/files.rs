//! Files of a container sandbox, through the container's own root directory.
//!
//! Docker's archive API is not used for files: its upload removes an existing file before it
//! extracts the new one (a write the disk quota refuses would lose the old file), it has no
//! rename or delete, and its errors (an empty status 500 for a symlink loop) cannot tell a bad
//! path from a broken daemon. Instead the shared confined file code ([`backend::files`]) runs on the
//! container's root as its init sees it, `/proc/<init>/root`: every lookup is
//! `openat2(RESOLVE_IN_ROOT)` below it (`..` and symlinks, absolute ones included, never lead
//! out), only regular files are read or written (a device node in the container's `/dev` is
//! never opened), and a write goes to a hidden temporary file renamed over the target.
//!
//! Under Docker's `--userns-remap` the container's ids are a host range: what the daemon
//! writes is made as the container's root (the range's first id) and archives show the ids
//! inside, as on the process tier with its user namespaces.
//!
//! The init's pid is only trusted after its `/proc` entry — opened once, so the check and the
//! root belong to the same process — shows the container's cgroup: a pid reused by a host
//! process after the container died is refused, never read or written through.
//!
//! [`backend::files`]: crate::backend::files

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::ContainerSandbox;
use crate::backend::files as root_files;
use crate::backend::{ArchiveStats, BackendError, ByteChunks, Download, FileChunk, UploadPiece};

/// The container's root directory as its init (`init_pid`) sees it, checked to belong to
/// `container_id` (see the module docs).
fn open_root(init_pid: i32, container_id: &str) -> Result<File, BackendError> {
    let gone = |why: String| BackendError::Internal(format!("container {container_id} is not running (init pid {init_pid}): {why}"));
    let proc_dir = File::open(format!("/proc/{init_pid}")).map_err(|e| gone(e.to_string()))?;
    let at = |name: &str, flags: i32| -> Result<File, BackendError> {
        let c_name = CString::new(name).map_err(|_| BackendError::Internal(format!("bad proc entry name {name:?}")))?;
        // SAFETY: openat on a directory fd we own with a NUL-terminated single-component name.
        let fd = unsafe { libc::openat(proc_dir.as_raw_fd(), c_name.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(gone(format!("/proc/{init_pid}/{name}: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: the kernel returned a fresh descriptor that we now own.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    };
    let mut cgroup = String::new();
    at("cgroup", libc::O_RDONLY)?.take(64 << 10).read_to_string(&mut cgroup).map_err(|e| gone(e.to_string()))?;
    if container_id.is_empty() || !cgroup.contains(container_id) {
        return Err(gone("that pid is no longer the container's init".to_string()));
    }
    at("root", libc::O_RDONLY | libc::O_DIRECTORY)
}

/// Runs `op` on the container's root, off the async threads (the container's filesystem may be
/// FUSE, and a sync waits for the disk).
async fn with_root<T: Send + 'static>(sb: &ContainerSandbox, op: impl FnOnce(&File) -> Result<T, BackendError> + Send + 'static) -> Result<T, BackendError> {
    let (init_pid, container_id) = (sb.init_pid, sb.container_id.clone());
    tokio::task::spawn_blocking(move || op(&open_root(init_pid, &container_id)?)).await.map_err(|e| BackendError::Internal(format!("file task: {e}")))?
}

/// Writes a whole file (creating parents), with `mode` (0 = 0644), replacing an old one
/// atomically. Returns the bytes written.
pub async fn write_file(sb: &ContainerSandbox, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    let (workdir, path, content, ids) = (sb.spec.workdir.clone(), path.to_string(), content.to_vec(), sb.ids);
    with_root(sb, move |root| root_files::acting_as(ids, || root_files::write_file_at(root, &workdir, &path, &content, mode))).await
}

/// The container's root, held for a transfer that outlives this call.
async fn held_root(sb: &ContainerSandbox) -> Result<File, BackendError> {
    with_root(sb, |root| root.try_clone().map_err(|e| BackendError::io("holding the container's root", e))).await
}

/// Writes a file of any size as its pieces arrive; see [`root_files::upload_file_in`].
pub async fn upload_file(sb: &ContainerSandbox, path: &str, mode: u32, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<u64, BackendError> {
    root_files::upload_file_in(held_root(sb).await?, sb.spec.workdir.clone(), path.to_string(), mode, sb.ids, data).await
}

/// Opens a regular file for a streamed download, read straight from the container's root.
pub async fn download_file(sb: &ContainerSandbox, path: &str, idle: Duration) -> Result<Download, BackendError> {
    let (workdir, path) = (sb.spec.workdir.clone(), path.to_string());
    with_root(sb, move |root| {
        let (file, size) = root_files::open_for_download_at(root, &workdir, &path)?;
        Ok(root_files::stream_download(file, size, &path, idle))
    })
    .await
}

/// Extracts a tar stream into `dir`; see [`root_files::upload_archive_in`].
pub async fn upload_archive(sb: &ContainerSandbox, dir: &str, data: tokio::sync::mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, BackendError> {
    root_files::upload_archive_in(held_root(sb).await?, sb.spec.workdir.clone(), dir.to_string(), sb.ids, data).await
}

/// A tar stream of `path`, read straight from the container's root.
pub async fn download_archive(sb: &ContainerSandbox, path: &str, idle: Duration) -> Result<ByteChunks, BackendError> {
    let (workdir, path, ids) = (sb.spec.workdir.clone(), path.to_string(), sb.ids);
    with_root(sb, move |root| {
        let root = root.try_clone().map_err(|e| BackendError::io("holding the container's root", e))?;
        root_files::stream_archive(root, &workdir, &path, ids, idle)
    })
    .await
}

/// Removes a regular file or a symlink (the link itself); a missing path is fine.
pub async fn remove_file(sb: &ContainerSandbox, path: &str) -> Result<(), BackendError> {
    let (workdir, path) = (sb.spec.workdir.clone(), path.to_string());
    with_root(sb, move |root| root_files::remove_file_at(root, &workdir, &path)).await
}

/// Opens (creating, truncating) `path` inside the container for the daemon to write into: an
/// exec's spill file, which so lands in the container's own writable layer. Blocking.
pub fn create_for_write(init_pid: i32, container_id: &str, path: &str) -> Result<File, BackendError> {
    root_files::create_for_write_at(&open_root(init_pid, container_id)?, path)
}

/// Reads up to `limit` bytes (0 = 4 MiB, the most one call returns) from `offset`.
pub async fn read_file(sb: &ContainerSandbox, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    let (workdir, path) = (sb.spec.workdir.clone(), path.to_string());
    with_root(sb, move |root| root_files::read_file_at(root, &workdir, &path, offset, limit)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_pid_that_is_not_the_containers_init_is_never_used() {
        // This test's own pid is alive but in no container's cgroup.
        let me = std::process::id() as i32;
        let err = open_root(me, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef").expect_err("not the container");
        assert!(err.to_string().contains("no longer the container's init"), "{err}");
        assert!(open_root(me, "").is_err(), "an empty container id matches nothing");
        assert!(open_root(i32::MAX, "x").is_err(), "a dead pid");
        // The check reads the cgroup of that very process: a name in it passes, and the root
        // is that process's root.
        let cgroup = std::fs::read_to_string("/proc/self/cgroup").expect("cgroup");
        let name = cgroup.lines().filter_map(|l| l.rsplit('/').next()).find(|n| n.len() > 3);
        if let Some(name) = name {
            let root = open_root(me, name).expect("our own root");
            assert_eq!(root.metadata().expect("stat").ino(), std::fs::metadata("/").expect("stat").ino());
        }
    }
}
