//! `sbx cp`: files (UploadFile/DownloadFile) and, with `-r`, directories
//! (UploadArchive/DownloadArchive) into or out of a sandbox, streamed whatever their size.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use agent_client::archive::{self, ArchiveError};
use agent_client::Client;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::json;
use tokio::io::{AsyncRead, ReadBuf};
use tokio_util::io::SyncIoBridge;

use crate::parse::Location;
use crate::{output, Ctx};

/// Room in the pipe between the tar code (on a blocking thread) and the network.
const PIPE_SIZE: usize = 256 * 1024;

/// Exit code when sbx is interrupted mid-copy (after cleaning up), as a shell reports SIGINT.
const EXIT_INTERRUPTED: u8 = 130;

/// Copies `src` to `dst`, exactly one of which is `ID:/path`.
pub async fn copy(ctx: &Ctx, src: &str, dst: &str, recursive: bool) -> Result<u8> {
    let parse = |side: &str, s: &str| Location::parse(s).map_err(|e| anyhow!("cp: {side}: {e}"));
    let (src, dst) = (parse("SRC", src)?, parse("DST", dst)?);
    if recursive && (src == Location::Stdio || dst == Location::Stdio) {
        bail!("cp: -r copies directories; - (stdin or stdout) is for a single file");
    }
    if let (true, Location::Remote { sandbox_id, path }, Location::Local(dir)) =
        (recursive, &src, &dst)
    {
        // Handles interruption itself: its extraction runs on a thread that must be waited for.
        return download_dir(ctx, sandbox_id, path, dir).await;
    }
    match (src, dst) {
        (Location::Remote { .. }, Location::Remote { .. }) => {
            bail!("cp: both sides are inside a sandbox; copy through a local file")
        }
        // Uploads stop at a signal through their reader (see `UntilInterrupted`).
        (Location::Local(dir), Location::Remote { sandbox_id, path })
            if recursive && dir.is_dir() =>
        {
            upload_dir(ctx, &dir, &sandbox_id, path).await
        }
        (local, Location::Remote { sandbox_id, path }) => {
            upload(ctx, local, &sandbox_id, path).await
        }
        // A download stopped at a signal is dropped: its temp file goes with it.
        (Location::Remote { sandbox_id, path }, local) => tokio::select! {
            done = download(ctx, &sandbox_id, &path, local) => done,
            _ = interrupted() => interrupted_note(),
        },
        _ => bail!("cp: one side must be inside a sandbox, written ID:/path (a local name with a colon is written ./name)"),
    }
}

/// The error an [`UntilInterrupted`] reader fails with.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// A reader that fails once sbx gets SIGINT, SIGTERM or SIGHUP. An upload is stopped this way
/// rather than by dropping it, so it ends the way the client library makes safe: the daemon is
/// sent what makes it refuse the upload, and has refused it, before sbx exits.
struct UntilInterrupted<R> {
    inner: R,
    signal: std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>,
}

impl<R> UntilInterrupted<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            signal: Box::pin(interrupted()),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for UntilInterrupted<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.signal.as_mut().poll(cx).is_ready() {
            return std::task::Poll::Ready(Err(std::io::Error::other(Interrupted)));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

/// Whether an upload failed because sbx was interrupted.
fn was_interrupted(err: &agent_client::Error) -> bool {
    matches!(err, agent_client::Error::Io { source, .. }
        if source.get_ref().is_some_and(|e| e.is::<Interrupted>()))
}

fn interrupted_note() -> Result<u8> {
    output::note("cp: interrupted; nothing was replaced or left half-written")?;
    Ok(EXIT_INTERRUPTED)
}

/// Resolves at SIGINT, SIGTERM or SIGHUP.
async fn interrupted() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = hup.recv() => {}
    }
    Ok(())
}

/// `path`, or `path` + the name of `local` when it ends with `/`.
fn remote_target(path: String, local: &Path) -> Result<String> {
    if !path.ends_with('/') {
        return Ok(path);
    }
    let name = local
        .file_name()
        .with_context(|| format!("cp: {} has no name to copy it under", local.display()))?;
    Ok(format!("{path}{}", name.to_string_lossy()))
}

/// Sends a local file (or stdin) to the sandbox, keeping the file's permission bits.
async fn upload(ctx: &Ctx, local: Location, sandbox_id: &str, path: String) -> Result<u8> {
    // The local side is checked before the daemon is dialled, so a mistake there is reported
    // as such even with no daemon running.
    type Source = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
    let (source, mode, path, local_path): (Source, u32, String, Option<String>) = match &local {
        Location::Local(file) => {
            let meta = tokio::fs::metadata(file)
                .await
                .with_context(|| format!("cp: cannot read {}", file.display()))?;
            if meta.is_dir() {
                bail!(
                    "cp: {} is a directory; use sbx cp -r to copy a directory",
                    file.display()
                );
            }
            // Keep the permission bits (rwx, setuid/setgid/sticky), as `cp -p` would, so an
            // uploaded script stays executable.
            let mode = meta.permissions().mode() & 0o7777;
            let path = remote_target(path, file)?;
            let reader = tokio::fs::File::open(file)
                .await
                .with_context(|| format!("cp: cannot read {}", file.display()))?;
            let local_path = Some(file.display().to_string());
            (Box::new(reader), mode, path, local_path)
        }
        _ => {
            if path.ends_with('/') {
                bail!("cp: {sandbox_id}:{path} is a directory; give a file name when copying from stdin");
            }
            // 0: the daemon's default, 0644.
            (Box::new(crate::stdin::Stdin::new()), 0, path, None)
        }
    };
    let sent = ctx
        .client()
        .await?
        .upload_file(
            sandbox_id,
            path.as_str(),
            mode,
            UntilInterrupted::new(source),
        )
        .await;
    let sent = match sent {
        Ok(sent) => sent,
        Err(err) if was_interrupted(&err) => return interrupted_note(),
        Err(err) => return Err(err.into()),
    };
    if ctx.json {
        output::json(&json!({
            "sandbox_id": sandbox_id,
            "path": path,
            "local_path": local_path,
            "bytes": sent.bytes,
            // The name the first `sbx cp --json` used, kept for scripts written against it.
            "bytes_written": sent.bytes,
            "sha256": sent.sha256,
        }))?;
    }
    Ok(0)
}

/// Fetches a file from the sandbox into a local file (through a temp file beside it, renamed
/// once the content is complete and checked) or stdout.
async fn download(ctx: &Ctx, sandbox_id: &str, path: &str, local: Location) -> Result<u8> {
    let client = ctx.client().await?;
    let Location::Local(file) = local else {
        return download_to_stdout(ctx, &client, sandbox_id, path).await;
    };
    let target = local_target(&file, path).await;
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = target
        .file_name()
        .with_context(|| format!("cp: {} has no file name", target.display()))?;
    // Hidden, beside the target so the rename cannot cross filesystems, created 0666 less the
    // umask like any new file; removed on drop, i.e. on every way out but the rename.
    let temp = tempfile::Builder::new()
        .prefix(&format!(".{}.sbx-", name.to_string_lossy()))
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(&parent)
        .with_context(|| format!("cp: cannot create a file in {}", parent.display()))?;
    let writer = tokio::fs::File::from_std(
        temp.as_file()
            .try_clone()
            .with_context(|| format!("cp: cannot write {}", temp.path().display()))?,
    );
    let got = client.download_file(sandbox_id, path, writer).await?;
    temp.as_file()
        .sync_all()
        .with_context(|| format!("cp: cannot write {}", temp.path().display()))?;
    // Overwriting keeps the old file's permission bits, as cp does.
    if let Ok(old) = std::fs::metadata(&target) {
        if old.is_file() {
            let _ = temp.as_file().set_permissions(old.permissions());
        }
    }
    temp.persist(&target)
        .map_err(|e| e.error)
        .with_context(|| format!("cp: cannot write {}", target.display()))?;
    if ctx.json {
        output::json(&json!({
            "sandbox_id": sandbox_id,
            "path": path,
            "local_path": target.display().to_string(),
            "bytes": got.bytes,
            "sha256": got.sha256,
        }))?;
    }
    Ok(0)
}

async fn download_to_stdout(
    ctx: &Ctx,
    client: &Client,
    sandbox_id: &str,
    path: &str,
) -> Result<u8> {
    if ctx.json {
        // The content cannot go to stdout raw beside the JSON, so it is gathered into it.
        let mut gathered = Vec::new();
        let got = client
            .download_file(sandbox_id, path, &mut gathered)
            .await?;
        let (content, encoding) = crate::json::bytes_text(&gathered);
        output::json(&json!({
            "sandbox_id": sandbox_id,
            "path": path,
            "bytes": got.bytes,
            "sha256": got.sha256,
            "content": content,
            "content_encoding": encoding,
        }))?;
        return Ok(0);
    }
    match client
        .download_file(sandbox_id, path, tokio::io::stdout())
        .await
    {
        Ok(_) => Ok(0),
        // `sbx cp ID:/log - | head`: whoever reads has seen enough.
        Err(agent_client::Error::Io { source, .. })
            if source.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            Ok(0)
        }
        Err(err) => Err(err.into()),
    }
}

/// Where a download lands: `file`, or inside it under the remote name when it is a directory.
async fn local_target(file: &Path, remote_path: &str) -> PathBuf {
    let is_dir = tokio::fs::metadata(file)
        .await
        .map(|m| m.is_dir())
        .unwrap_or(false);
    match Path::new(remote_path.trim_end_matches('/')).file_name() {
        Some(name) if is_dir => file.join(name),
        _ => file.to_path_buf(),
    }
}

/// The directory that receives a copied directory's contents: `dst` itself, or a directory
/// named after the source inside it when `dst` ends with `/`, `.` or `..`.
fn receiving_dir(dst: &str, src_name: Option<&std::ffi::OsStr>) -> Result<String> {
    let inside = dst.ends_with('/')
        || matches!(
            Path::new(dst).components().next_back(),
            Some(std::path::Component::CurDir | std::path::Component::ParentDir)
        )
        || dst == ".";
    if !inside {
        return Ok(dst.to_owned());
    }
    let name = src_name.context("cp: the source has no name to copy it under")?;
    let sep = if dst.ends_with('/') { "" } else { "/" };
    Ok(format!("{dst}{sep}{}", name.to_string_lossy()))
}

/// Reads the pipe from the tar builder; its end is an end of input only once the builder
/// said it finished, so a local failure can never look like a complete archive to the daemon.
struct PackedReader {
    pipe: tokio::io::DuplexStream,
    finished: Arc<AtomicBool>,
}

impl AsyncRead for PackedReader {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = std::pin::Pin::new(&mut self.pipe).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = poll {
            if buf.filled().len() == before && !self.finished.load(Ordering::Acquire) {
                return std::task::Poll::Ready(Err(std::io::Error::other(
                    "the local directory could not be read to the end",
                )));
            }
        }
        poll
    }
}

/// Sends a local directory as a tar stream built on the fly.
async fn upload_dir(ctx: &Ctx, dir: &Path, sandbox_id: &str, path: String) -> Result<u8> {
    let client = ctx.client().await?;
    let path = receiving_dir(&path, dir.file_name())?;
    let (pipe_in, pipe_out) = tokio::io::duplex(PIPE_SIZE);
    let finished = Arc::new(AtomicBool::new(false));
    let packer = {
        let (dir, finished) = (dir.to_path_buf(), finished.clone());
        tokio::task::spawn_blocking(move || {
            let mut bridge = SyncIoBridge::new(pipe_in);
            let report = archive::pack(&dir, &mut bridge)?;
            std::io::Write::flush(&mut bridge).map_err(ArchiveError::Tar)?;
            // Before the pipe closes: the reader must see this by the time it sees the end.
            finished.store(true, Ordering::Release);
            Ok::<_, ArchiveError>(report)
        })
    };
    let reader = UntilInterrupted::new(PackedReader {
        pipe: pipe_out,
        finished,
    });
    let uploaded = client
        .upload_archive(sandbox_id, path.as_str(), reader)
        .await;
    let packed = packer.await.context("cp: the archive builder failed")?;
    if uploaded.as_ref().is_err_and(was_interrupted) {
        // The daemon keeps what it had extracted; it was told the archive is broken.
        output::note("cp: interrupted; the directory in the sandbox may hold part of the copy")?;
        return Ok(EXIT_INTERRUPTED);
    }
    // The daemon's refusal explains more than the broken pipe it causes on this side.
    let (uploaded, packed) = match (uploaded, packed) {
        (Ok(up), Ok(packed)) => (up, packed),
        (Err(err @ agent_client::Error::Status(_)), _) => return Err(err.into()),
        (_, Err(err)) => return Err(anyhow!(err).context(format!("cp: {}", dir.display()))),
        (Err(err), Ok(_)) => return Err(err.into()),
    };
    for skipped in &packed.skipped {
        output::note(&format!(
            "cp: left out {} (not a file, directory or symlink)",
            dir.join(skipped).display()
        ))?;
    }
    if ctx.json {
        output::json(&json!({
            "sandbox_id": sandbox_id,
            "path": path,
            "local_path": dir.display().to_string(),
            "files": uploaded.files,
            "directories": uploaded.directories,
            "symlinks": uploaded.symlinks,
            "bytes": uploaded.bytes,
            "skipped": packed.skipped.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        }))?;
    }
    Ok(0)
}

/// Fetches a sandbox directory as a tar stream and extracts it with the hostile-archive
/// guard of [`archive::unpack`]. A new directory is extracted beside its place and renamed
/// into it at the end; an existing one is extracted into directly.
async fn download_dir(ctx: &Ctx, sandbox_id: &str, path: &str, local: &Path) -> Result<u8> {
    let client = ctx.client().await?;
    let remote_name = Path::new(path.trim_end_matches('/')).file_name();
    let target = PathBuf::from(receiving_dir(&local.to_string_lossy(), remote_name)?);
    let existing = match std::fs::symlink_metadata(&target) {
        Ok(meta) if meta.is_dir() => true,
        Ok(_) => bail!("cp: {} exists and is not a directory", target.display()),
        Err(_) => false,
    };
    let temp = if existing {
        None
    } else {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Some(
            tempfile::Builder::new()
                .prefix(&format!(".{name}.sbx-"))
                .permissions(std::fs::Permissions::from_mode(0o777))
                .tempdir_in(&parent)
                .with_context(|| {
                    format!("cp: cannot create a directory in {}", parent.display())
                })?,
        )
    };
    let into = temp
        .as_ref()
        .map_or(target.clone(), |t| t.path().to_path_buf());

    let (pipe_in, pipe_out) = tokio::io::duplex(PIPE_SIZE);
    let unpacker = {
        let into = into.clone();
        tokio::task::spawn_blocking(move || archive::unpack(SyncIoBridge::new(pipe_out), &into))
    };
    let downloaded = tokio::select! {
        done = client.download_archive(sandbox_id, path, pipe_in) => Some(done),
        _ = interrupted() => None,
    };
    // Always waited for (the pipe's end stops it), so nothing is still writing into the temp
    // directory when it goes.
    let unpacked = unpacker.await.context("cp: the extraction failed")?;
    let Some(downloaded) = downloaded else {
        drop(temp);
        return interrupted_note();
    };
    let report = match (downloaded, unpacked) {
        (_, Err(err @ ArchiveError::Refused { .. })) => {
            return Err(anyhow!(err).context(format!("cp: {sandbox_id}:{path}")))
        }
        (Err(err), _) => return Err(err.into()),
        (Ok(_), Err(err)) => return Err(anyhow!(err).context(format!("cp: {sandbox_id}:{path}"))),
        (Ok(_), Ok(report)) => report,
    };
    if let Some(temp) = temp {
        let kept = temp.keep();
        if let Err(err) = std::fs::rename(&kept, &target) {
            let _ = std::fs::remove_dir_all(&kept);
            return Err(anyhow!(err).context(format!("cp: cannot create {}", target.display())));
        }
    }
    if ctx.json {
        output::json(&json!({
            "sandbox_id": sandbox_id,
            "path": path,
            "local_path": target.display().to_string(),
            "files": report.files,
            "directories": report.directories,
            "symlinks": report.symlinks,
            "bytes": report.bytes,
        }))?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_land_in_dst_or_inside_it() {
        let name = Some(std::ffi::OsStr::new("src"));
        assert_eq!(
            receiving_dir("/w/dir", name).ok().as_deref(),
            Some("/w/dir")
        );
        assert_eq!(receiving_dir("/w/", name).ok().as_deref(), Some("/w/src"));
        assert_eq!(receiving_dir(".", name).ok().as_deref(), Some("./src"));
        assert_eq!(
            receiving_dir("a/..", name).ok().as_deref(),
            Some("a/../src")
        );
        assert!(receiving_dir("/w/", None).is_err());
    }

    #[tokio::test]
    async fn a_pack_that_did_not_finish_never_reads_as_a_complete_archive() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for finished in [false, true] {
            let (mut pipe_in, pipe_out) = tokio::io::duplex(64);
            let mut reader = PackedReader {
                pipe: pipe_out,
                finished: Arc::new(AtomicBool::new(finished)),
            };
            pipe_in.write_all(b"some tar").await.expect("write");
            drop(pipe_in);
            let mut got = Vec::new();
            let end = reader.read_to_end(&mut got).await;
            assert_eq!(got, b"some tar");
            assert_eq!(
                end.is_ok(),
                finished,
                "the end is an error unless the pack finished"
            );
        }
    }

    #[test]
    fn remote_targets_take_the_local_name_after_a_slash() {
        let local = Path::new("/tmp/run.sh");
        assert_eq!(
            remote_target("/w/".into(), local).ok().as_deref(),
            Some("/w/run.sh")
        );
        assert_eq!(
            remote_target("/w/x".into(), local).ok().as_deref(),
            Some("/w/x")
        );
    }
}
