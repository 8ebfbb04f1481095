//! `sbx cp`: one file into or out of a sandbox.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::parse::Location;
use crate::{output, Ctx};

/// Copies `src` to `dst`, exactly one of which is `ID:/path`.
pub async fn copy(ctx: &Ctx, src: &str, dst: &str) -> Result<u8> {
    let parse =
        |side: &str, s: &str| Location::parse(s).map_err(|e| anyhow::anyhow!("cp: {side}: {e}"));
    match (parse("SRC", src)?, parse("DST", dst)?) {
        (Location::Remote { .. }, Location::Remote { .. }) => {
            bail!("cp: both sides are inside a sandbox; copy through a local file")
        }
        (local, Location::Remote { sandbox_id, path }) => upload(ctx, local, &sandbox_id, path).await,
        (Location::Remote { sandbox_id, path }, local) => download(ctx, &sandbox_id, &path, local).await,
        _ => bail!("cp: one side must be inside a sandbox, written ID:/path (a local name with a colon is written ./name)"),
    }
}

/// Sends a local file (or stdin) to the sandbox, keeping the file's permission bits.
async fn upload(ctx: &Ctx, local: Location, sandbox_id: &str, mut path: String) -> Result<u8> {
    let (content, mode) = match &local {
        Location::Local(file) => {
            let meta = tokio::fs::metadata(file)
                .await
                .with_context(|| format!("cp: cannot read {}", file.display()))?;
            if meta.is_dir() {
                bail!(
                    "cp: {} is a directory; sbx cp copies a single file",
                    file.display()
                );
            }
            // Keep the permission bits (rwx, setuid/setgid/sticky), as `cp -p` would, so an
            // uploaded script stays executable.
            let mode = meta.permissions().mode() & 0o7777;
            let content = tokio::fs::read(file)
                .await
                .with_context(|| format!("cp: cannot read {}", file.display()))?;
            if path.ends_with('/') {
                let name = file
                    .file_name()
                    .with_context(|| format!("cp: {} has no file name", file.display()))?;
                path.push_str(&name.to_string_lossy());
            }
            (content, mode)
        }
        _ => {
            if path.ends_with('/') {
                bail!("cp: {sandbox_id}:{path} is a directory; give a file name when copying from stdin");
            }
            let mut content = Vec::new();
            tokio::io::stdin()
                .read_to_end(&mut content)
                .await
                .context("cp: cannot read stdin")?;
            (content, 0) // 0: the daemon's default, 0644.
        }
    };
    let written = ctx
        .client()
        .await?
        .write_file(sandbox_id, path.as_str(), content, mode)
        .await?;
    if ctx.json {
        output::json(&json!({ "sandbox_id": sandbox_id, "path": path, "bytes_written": written }))?;
    }
    Ok(0)
}

/// Fetches a file from the sandbox into a local file (or stdout), chunk by chunk.
async fn download(ctx: &Ctx, sandbox_id: &str, path: &str, local: Location) -> Result<u8> {
    let client = ctx.client().await?;
    let target = match &local {
        Location::Local(file) => Some(local_target(file, path).await),
        _ => None,
    };
    // With --json the content cannot go to stdout raw, so it is gathered into the JSON object.
    let mut gathered = Vec::new();
    let mut file: Option<tokio::fs::File> = None;
    let mut offset = 0u64;
    loop {
        let chunk = client.read_file(sandbox_id, path, offset, 0).await?;
        offset += chunk.content.len() as u64;
        match &target {
            Some(target) => {
                // Opened only once the first read succeeded, so a missing remote file leaves no
                // empty local one behind.
                if file.is_none() {
                    let created = tokio::fs::File::create(target)
                        .await
                        .with_context(|| format!("cp: cannot create {}", target.display()))?;
                    file = Some(created);
                }
                if let Some(f) = file.as_mut() {
                    f.write_all(&chunk.content)
                        .await
                        .with_context(|| format!("cp: cannot write {}", target.display()))?;
                }
            }
            None if ctx.json => gathered.extend_from_slice(&chunk.content),
            None => output::stdout(&chunk.content)?,
        }
        if chunk.eof {
            break;
        }
        if chunk.content.is_empty() {
            bail!("cp: the daemon returned no data before the end of {sandbox_id}:{path} (offset {offset})");
        }
    }
    if let (Some(f), Some(target)) = (file.as_mut(), &target) {
        f.flush()
            .await
            .with_context(|| format!("cp: cannot write {}", target.display()))?;
    }
    if ctx.json {
        let mut report = json!({ "sandbox_id": sandbox_id, "path": path, "bytes": offset });
        match &target {
            Some(target) => report["local_path"] = json!(target.display().to_string()),
            None => {
                let (content, encoding) = crate::json::bytes_text(&gathered);
                report["content"] = json!(content);
                report["content_encoding"] = json!(encoding);
            }
        }
        output::json(&report)?;
    }
    Ok(0)
}

/// Where a download lands: `file`, or inside it under the remote name when it is a directory.
async fn local_target(file: &Path, remote_path: &str) -> PathBuf {
    let is_dir = tokio::fs::metadata(file)
        .await
        .map(|m| m.is_dir())
        .unwrap_or(false);
    match Path::new(remote_path).file_name() {
        Some(name) if is_dir => file.join(name),
        _ => file.to_path_buf(),
    }
}
