//! Files inside a running sandbox: WriteFile and ReadFile, and files of any size as streams.

use std::sync::Arc;

use super::streams::{StreamKind, StreamSlot};
use super::validate::{refuse_kernel_mounts, validate_mode};
use super::{Manager, SandboxEntry};
use crate::backend::{ArchiveStats, BackendError, ByteChunks, Download, UploadPiece};
use crate::error::Error;
use crate::ids::SandboxId;
use crate::model::{FileChunk, SandboxInfo};
use tokio::sync::mpsc;

impl Manager {
    /// The sandbox `sandbox_id` of `tenant` if it can take file operations now (`op` names the
    /// operation in the IncorrectState error).
    async fn running_entry(&self, tenant: &str, sandbox_id: &str, op: &'static str) -> Result<(SandboxId, Arc<SandboxEntry>, SandboxInfo), Error> {
        let (sid, entry) = self.ready_entry(tenant, sandbox_id).await?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: op });
        }
        Ok((sid, entry, info))
    }

    /// A write's error, with a full disk said to be the pool's when the pool is what is full
    /// (the backend sees ENOSPC or EDQUOT alike from inside the sandbox).
    fn write_error(&self, info: &SandboxInfo, e: BackendError) -> Error {
        let full_at = match &e {
            BackendError::DiskFull { path } => Some(path.clone()),
            BackendError::Archive(sandbox_exec::archive::ArchiveError::Io { path, source })
                if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
            {
                Some(path.clone())
            }
            _ => None,
        };
        match full_at {
            Some(path) => Error::ResourceExhausted(self.disk_pools.explain_full(info.isolation, &path, info.limits.disk_bytes)),
            None => e.into(),
        }
    }

    /// Writes a file inside the sandbox.
    pub async fn write_file(&self, tenant: &str, sandbox_id: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "write files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, path)?;
        validate_mode(mode)?;
        self.backends.get(info.isolation)?.write_file(&sid, path, content, mode).await.map_err(|e| self.write_error(&info, e))
    }

    /// Reads part of a file inside the sandbox.
    pub async fn read_file(&self, tenant: &str, sandbox_id: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "read files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, path)?;
        Ok(self.backends.get(info.isolation)?.read_file(&sid, path, offset, limit).await?)
    }

    /// Writes a file of any size from `data`, replacing the old one only when `data` ends with
    /// [`UploadPiece::Commit`] (an upload cut short leaves the old file). Holds an upload slot
    /// of `tenant` (`[streams] max_uploads`) until it ends.
    pub async fn upload_file(&self, tenant: &str, sandbox_id: &str, path: &str, mode: u32, data: mpsc::Receiver<UploadPiece>) -> Result<u64, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "write files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, path)?;
        validate_mode(mode)?;
        let _slot = self.stream_slots.take(StreamKind::Upload, tenant)?;
        self.backends.get(info.isolation)?.upload_file(&sid, path, mode, data).await.map_err(|e| self.write_error(&info, e))
    }

    /// Opens a file of any size for a streamed download; the download holds its slots
    /// (`[streams] max_downloads`) until it is dropped.
    pub async fn download_file(&self, tenant: &str, sandbox_id: &str, path: &str) -> Result<Held<Download>, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "read files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, path)?;
        let slots = vec![self.stream_slots.take(StreamKind::Download, tenant)?];
        let value = self.backends.get(info.isolation)?.download_file(&sid, path, self.stream_slots.idle_timeout()).await?;
        Ok(Held { value, slots })
    }

    /// Extracts a tar stream into the directory `dir` of the sandbox: all of it once `data`
    /// ends with [`UploadPiece::Commit`], none of it otherwise. Holds an upload and an archive
    /// walk slot until it ends.
    pub async fn upload_archive(&self, tenant: &str, sandbox_id: &str, dir: &str, data: mpsc::Receiver<UploadPiece>) -> Result<ArchiveStats, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "write files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, dir)?;
        // The walk's cap is the scarcer one: checked first, a refusal names it whatever the
        // plain uploads are doing.
        let _slots = (self.stream_slots.take(StreamKind::ArchiveWalk, tenant)?, self.stream_slots.take(StreamKind::Upload, tenant)?);
        self.backends.get(info.isolation)?.upload_archive(&sid, dir, data).await.map_err(|e| self.write_error(&info, e))
    }

    /// A tar stream of a directory (or file) of the sandbox, holding a download and an archive
    /// walk slot until it is dropped.
    pub async fn download_archive(&self, tenant: &str, sandbox_id: &str, path: &str) -> Result<Held<ByteChunks>, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "read files").await?;
        refuse_kernel_mounts(info.isolation, &info.workdir, path)?;
        let slots = vec![self.stream_slots.take(StreamKind::ArchiveWalk, tenant)?, self.stream_slots.take(StreamKind::Download, tenant)?];
        let value = self.backends.get(info.isolation)?.download_archive(&sid, path, self.stream_slots.idle_timeout()).await?;
        Ok(Held { value, slots })
    }

    /// How long a stream may stay idle (`streams.idle_timeout_ms`).
    pub fn stream_idle_timeout(&self) -> std::time::Duration {
        self.stream_slots.idle_timeout()
    }

    /// Bytes of a session's input held once read (`streams.session_input_buffer_bytes`).
    pub fn session_input_buffer(&self) -> usize {
        self.stream_slots.session_input_buffer()
    }
}

/// A stream with the slots it holds: dropping it frees them.
pub struct Held<T> {
    pub value: T,
    pub slots: Vec<StreamSlot>,
}
