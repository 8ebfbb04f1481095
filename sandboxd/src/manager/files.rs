//! Files inside a running sandbox: WriteFile and ReadFile.

use std::sync::Arc;

use super::validate::validate_mode;
use super::{Manager, SandboxEntry};
use crate::error::Error;
use crate::ids::SandboxId;
use crate::model::{FileChunk, SandboxInfo};

impl Manager {
    /// The sandbox `sandbox_id` of `tenant` if it can take file operations now (`op` names the
    /// operation in the IncorrectState error).
    fn running_entry(&self, tenant: &str, sandbox_id: &str, op: &'static str) -> Result<(SandboxId, Arc<SandboxEntry>, SandboxInfo), Error> {
        let (sid, entry) = self.entry(tenant, sandbox_id)?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: op });
        }
        Ok((sid, entry, info))
    }

    /// Writes a file inside the sandbox.
    pub async fn write_file(&self, tenant: &str, sandbox_id: &str, path: &str, content: &[u8], mode: u32) -> Result<u64, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "write files")?;
        validate_mode(mode)?;
        Ok(self.backends.get(info.isolation)?.write_file(&sid, path, content, mode).await?)
    }

    /// Reads part of a file inside the sandbox.
    pub async fn read_file(&self, tenant: &str, sandbox_id: &str, path: &str, offset: u64, limit: u64) -> Result<FileChunk, Error> {
        let (sid, _, info) = self.running_entry(tenant, sandbox_id, "read files")?;
        Ok(self.backends.get(info.isolation)?.read_file(&sid, path, offset, limit).await?)
    }
}
