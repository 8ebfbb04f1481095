//! WriteFile and ReadFile through Docker's archive API.
//!
//! Docker resolves every path inside the container's root (symlinks included, absolute ones
//! re-rooted), so `..` and links planted by the sandbox never lead to the host. The daemon only
//! normalizes the path lexically (relative to the workdir, `..` clamped at `/`), asks Docker what
//! is there (`HEAD /containers/{id}/archive`), refuses anything but regular files, and moves
//! bytes as a one-file tar. Writes create missing parents (each with mode 0755) by sending them
//! as directory entries rooted at the deepest directory that exists — never re-sending an
//! existing directory, whose owner and mode Docker would otherwise overwrite.
//!
//! A read streams the file from its start and keeps `[offset, offset + limit)`, so reading a big
//! file in many slices costs more than one pass; slices are capped at 4 MiB.

use bollard::container::PathStatResponse;
use bollard::query_parameters::{ContainerArchiveInfoOptions, DownloadFromContainerOptions, UploadToContainerOptions};
use bollard::Docker;
use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::docker::is_not_found;
use super::ContainerSandbox;
use crate::backend::process::files::MAX_READ;
use crate::backend::{BackendError, FileChunk};

/// Go's `os.FileMode` type bits, as Docker reports them in a path stat.
const MODE_DIR: u32 = 1 << 31;
const MODE_SYMLINK: u32 = 1 << 27;
const MODE_TYPE: u32 = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19);
/// Symlink hops followed before giving up (as the kernel's ELOOP limit).
const MAX_LINKS: usize = 40;

/// What is at a path in the container.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Regular { size: u64 },
    Dir,
    Symlink { target: String },
    Other,
}

fn kind_of(stat: &PathStatResponse) -> Kind {
    let mode = stat.file_mode;
    if mode & MODE_DIR != 0 {
        Kind::Dir
    } else if mode & MODE_SYMLINK != 0 {
        Kind::Symlink { target: stat.link_target.clone() }
    } else if mode & MODE_TYPE == 0 {
        Kind::Regular { size: u64::try_from(stat.size).unwrap_or(0) }
    } else {
        Kind::Other
    }
}

fn invalid(path: &str, reason: &str) -> BackendError {
    BackendError::InvalidPath { path: path.to_string(), reason: reason.to_string() }
}

/// The absolute, lexically normalized form of `path` (relative to `workdir`; `..` stops at `/`).
fn normalize(path: &str, workdir: &str) -> Result<String, BackendError> {
    if path.is_empty() {
        return Err(invalid(path, "empty"));
    }
    if path.contains('\0') {
        return Err(invalid(path, "contains a NUL byte"));
    }
    let full = if path.starts_with('/') { path.to_string() } else { format!("{workdir}/{path}") };
    let mut parts: Vec<&str> = Vec::new();
    for c in full.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

fn parent_and_name(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some(("", name)) => ("/", name),
        Some((parent, name)) => (parent, name),
        None => ("/", path),
    }
}

fn map_docker_error(path: &str, e: bollard::errors::Error) -> BackendError {
    let text = e.to_string();
    let lower = text.to_lowercase();
    if is_not_found(&e) {
        BackendError::FileNotFound { path: path.to_string() }
    } else if lower.contains("no space left") || lower.contains("quota") {
        BackendError::DiskFull { path: path.to_string() }
    } else if lower.contains("not a directory") {
        invalid(path, "a parent is not a directory")
    } else {
        BackendError::Internal(format!("docker: accessing {path} in the sandbox: {text}"))
    }
}

async fn stat(docker: &Docker, container: &str, path: &str) -> Result<Option<Kind>, BackendError> {
    let options = ContainerArchiveInfoOptions { path: path.to_string() };
    match docker.get_container_archive_info(container, Some(options)).await {
        Ok(s) => Ok(Some(kind_of(&s))),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(map_docker_error(path, e)),
    }
}

/// Follows `path` through symlinks (Docker resolves each target inside the container) to what
/// it finally names.
async fn resolve(docker: &Docker, container: &str, display: &str, path: String) -> Result<(String, Option<Kind>), BackendError> {
    let mut path = path;
    for _ in 0..MAX_LINKS {
        match stat(docker, container, &path).await? {
            Some(Kind::Symlink { target }) if !target.is_empty() && target != path => path = target,
            Some(Kind::Symlink { .. }) => return Err(invalid(display, "a symbolic link that cannot be resolved")),
            other => return Ok((path, other)),
        }
    }
    Err(invalid(display, "too many levels of symbolic links"))
}

fn tar_header(path: &str, kind: tar::EntryType, mode: u32, size: u64) -> Result<tar::Header, BackendError> {
    let mut h = tar::Header::new_gnu();
    h.set_path(path).map_err(|e| invalid(path, &format!("cannot be archived: {e}")))?;
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0));
    h.set_cksum();
    Ok(h)
}

/// Writes a whole file (creating parents), with `mode` (0 = 0644). Returns the bytes written.
pub async fn write_file(docker: &Docker, sb: &ContainerSandbox, path: &str, content: &[u8], mode: u32) -> Result<u64, BackendError> {
    let container = sb.container_id.as_str();
    let mut target = normalize(path, &sb.spec.workdir)?;
    if target == "/" {
        return Err(invalid(path, "names the root directory"));
    }
    // What is there now decides where the bytes go: a link is written through (as open(2)
    // would), a directory or special file is refused.
    match resolve(docker, container, path, target.clone()).await? {
        (_, Some(Kind::Dir)) => return Err(invalid(path, "is a directory")),
        (_, Some(Kind::Other)) => return Err(invalid(path, "not a regular file")),
        (resolved, _) => target = resolved,
    }
    let (parent, name) = parent_and_name(&target);
    let (parent, name) = (parent.to_string(), name.to_string());

    // The deepest existing ancestor, and the directories to create below it.
    let mut base = parent.clone();
    let mut missing: Vec<String> = Vec::new();
    loop {
        match stat(docker, container, &base).await? {
            Some(Kind::Dir | Kind::Symlink { .. }) => break,
            Some(_) => return Err(invalid(path, "a parent is not a directory")),
            None if base == "/" => return Err(BackendError::FileNotFound { path: path.to_string() }),
            None => {
                let (up, dir) = parent_and_name(&base);
                missing.push(dir.to_string());
                base = up.to_string();
            }
        }
    }
    missing.reverse();

    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    let mut builder = tar::Builder::new(Vec::with_capacity(content.len() + 2048));
    let mut rel = String::new();
    for dir in &missing {
        rel.push_str(dir);
        rel.push('/');
        let header = tar_header(&rel, tar::EntryType::Directory, 0o755, 0)?;
        builder.append(&header, std::io::empty()).map_err(|e| BackendError::io("building the upload", e))?;
    }
    rel.push_str(&name);
    let header = tar_header(&rel, tar::EntryType::Regular, mode, content.len() as u64)?;
    builder.append(&header, content).map_err(|e| BackendError::io("building the upload", e))?;
    let archive = builder.into_inner().map_err(|e| BackendError::io("building the upload", e))?;
    let options = UploadToContainerOptions { path: base, no_overwrite_dir_non_dir: Some("true".to_string()), ..Default::default() };
    docker
        .upload_to_container(container, Some(options), bollard::body_full(Bytes::from(archive)))
        .await
        .map_err(|e| map_docker_error(path, e))?;
    Ok(content.len() as u64)
}

/// Reads up to `limit` bytes (0 = 4 MiB, the most one call returns) from `offset`.
pub async fn read_file(docker: &Docker, sb: &ContainerSandbox, path: &str, offset: u64, limit: u64) -> Result<FileChunk, BackendError> {
    let container = sb.container_id.as_str();
    let normalized = normalize(path, &sb.spec.workdir)?;
    let (target, size) = match resolve(docker, container, path, normalized).await? {
        (_, None) => return Err(BackendError::FileNotFound { path: path.to_string() }),
        (_, Some(Kind::Dir)) => return Err(invalid(path, "is a directory")),
        (_, Some(Kind::Other | Kind::Symlink { .. })) => return Err(invalid(path, "not a regular file")),
        (t, Some(Kind::Regular { size })) => (t, size),
    };
    let limit = if limit == 0 { MAX_READ } else { limit.min(MAX_READ) };
    if size.saturating_sub(offset) == 0 {
        return Ok(FileChunk { content: Vec::new(), size, eof: true });
    }
    let options = DownloadFromContainerOptions { path: target };
    let mut tar = TarStream { inner: Box::pin(docker.download_from_container(container, Some(options))), buf: Bytes::new(), display: path.to_string() };
    // The file may have changed since the stat: the archive's header is what counts.
    let size = tar.first_regular_entry().await?;
    let want = size.saturating_sub(offset).min(limit);
    tar.skip(offset.min(size)).await?;
    let content = tar.take(want).await?;
    let eof = offset + content.len() as u64 >= size;
    Ok(FileChunk { content, size, eof })
}

type ByteStream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, bollard::errors::Error>> + Send>>;

/// Just enough of a streaming tar reader for one-file archives: headers, PAX/GNU extensions
/// skipped, data read or skipped without holding more than is asked for.
struct TarStream {
    inner: ByteStream,
    buf: Bytes,
    display: String,
}

impl TarStream {
    /// Makes `buf` non-empty; false at the end of the stream.
    async fn fill(&mut self) -> Result<bool, BackendError> {
        while self.buf.is_empty() {
            match self.inner.next().await {
                Some(Ok(b)) => self.buf = b,
                Some(Err(e)) => return Err(map_docker_error(&self.display, e)),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    async fn take(&mut self, n: u64) -> Result<Vec<u8>, BackendError> {
        let mut out = Vec::with_capacity(usize::try_from(n).unwrap_or(0).min(MAX_READ as usize));
        while (out.len() as u64) < n {
            if !self.fill().await? {
                return Err(BackendError::Internal(format!("the archive of {} ended early", self.display)));
            }
            let k = (n - out.len() as u64).min(self.buf.len() as u64) as usize;
            out.extend_from_slice(&self.buf.split_to(k));
        }
        Ok(out)
    }

    async fn skip(&mut self, mut n: u64) -> Result<(), BackendError> {
        while n > 0 {
            if !self.fill().await? {
                return Err(BackendError::Internal(format!("the archive of {} ended early", self.display)));
            }
            let k = n.min(self.buf.len() as u64) as usize;
            let _ = self.buf.split_to(k);
            n -= k as u64;
        }
        Ok(())
    }

    /// Reads headers up to the first file entry and returns its size (data follows).
    async fn first_regular_entry(&mut self) -> Result<u64, BackendError> {
        let mut size_override = None;
        loop {
            let block = self.take(512).await?;
            if block.iter().all(|&b| b == 0) {
                return Err(BackendError::FileNotFound { path: self.display.clone() });
            }
            let header = tar::Header::from_byte_slice(&block);
            let size = header.size().map_err(|e| BackendError::Internal(format!("archive of {}: {e}", self.display)))?;
            let padded = size.div_ceil(512) * 512;
            match header.entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => return Ok(size_override.unwrap_or(size)),
                tar::EntryType::XHeader if size <= 64 << 10 => {
                    let data = self.take(padded).await?;
                    size_override = pax_size(&data[..size as usize]).or(size_override);
                }
                tar::EntryType::XGlobalHeader | tar::EntryType::GNULongName | tar::EntryType::GNULongLink | tar::EntryType::XHeader => self.skip(padded).await?,
                _ => return Err(invalid(&self.display, "not a regular file")),
            }
        }
    }
}

/// The `size` record of a PAX extended header (used for files over 8 GiB).
fn pax_size(data: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(data).lines().find_map(|rec| rec.split_once(' ').and_then(|(_, kv)| kv.strip_prefix("size=")).and_then(|v| v.trim().parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_normalize_inside_the_root() {
        assert_eq!(normalize("a/b/../c", "/workspace").ok().as_deref(), Some("/workspace/a/c"));
        assert_eq!(normalize("../../../../etc/x", "/workspace").ok().as_deref(), Some("/etc/x"));
        assert_eq!(normalize("/./tmp//f", "/w").ok().as_deref(), Some("/tmp/f"));
        assert_eq!(normalize("..", "/").ok().as_deref(), Some("/"));
        assert!(normalize("", "/").is_err());
        assert!(normalize("a\0b", "/").is_err());
        assert_eq!(parent_and_name("/f"), ("/", "f"));
        assert_eq!(parent_and_name("/a/b"), ("/a", "b"));
    }

    #[test]
    fn go_file_modes_are_classified() {
        let stat = |mode: u32| PathStatResponse { name: "x".into(), size: 3, file_mode: mode, modification_time: None, link_target: "/t".into() };
        assert_eq!(kind_of(&stat(0o644)), Kind::Regular { size: 3 });
        assert_eq!(kind_of(&stat(MODE_DIR | 0o755)), Kind::Dir);
        assert_eq!(kind_of(&stat(MODE_SYMLINK | 0o777)), Kind::Symlink { target: "/t".into() });
        assert_eq!(kind_of(&stat((1 << 25) | 0o644)), Kind::Other, "a FIFO");
        assert_eq!(pax_size(b"20 size=12345678901\n"), Some(12_345_678_901));
    }
}
