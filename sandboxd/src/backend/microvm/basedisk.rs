//! The base disk of an imported image, made the way `images/build-vm.sh` makes a script-built
//! image's: `mkfs.ext4 -d` of the rootfs on a file of its content plus 15% and 48 MiB (4 KiB
//! blocks, one inode per 16 KiB, no root reserve, inode tables zeroed now), converted to qcow2,
//! read-only (0444), and `vm/vm.json` written last. Unlike the script it does not normalize
//! timestamps for a reproducible disk: the disk is made once per import, on this host.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::backend::BackendError;
use crate::hostfs;
use crate::images::meta::VmJson;

/// Most output of a tool kept for an error message.
const MAX_TOOL_OUTPUT: usize = 4096;

/// `mkfs.ext4`, on PATH or in the sbin directories a daemon's PATH may lack.
fn mkfs() -> Result<PathBuf, BackendError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
        .ok_or_else(|| BackendError::Internal("mkfs.ext4 not found (install e2fsprogs: make deps)".into()))
}

/// Size of the ext4 file for `content` bytes: content plus 15% and 48 MiB, in whole 4 MiB.
pub fn disk_bytes(content: u64) -> u64 {
    let kib = content / 1024;
    let mib = (kib * 115 / 100 / 1024 + 48).div_ceil(4) * 4;
    mib << 20
}

async fn run(cmd: &mut tokio::process::Command, what: &str) -> Result<(), BackendError> {
    let out = cmd.stdin(std::process::Stdio::null()).output().await.map_err(|e| BackendError::io(format!("running {what}"), e))?;
    if !out.status.success() {
        let mut text = String::from_utf8_lossy(&out.stderr).trim().to_string();
        text.truncate(MAX_TOOL_OUTPUT);
        return Err(BackendError::Internal(format!("{what} failed ({}): {text}", out.status)));
    }
    Ok(())
}

/// Builds `<image_dir>/vm/` (`rootfs.qcow2`, `vm.json`) from `<image_dir>/rootfs`, in a
/// staging dir renamed into place. Returns what it made, in a sentence.
pub async fn build(qemu_img: &Path, image: &str, image_dir: &Path) -> Result<String, BackendError> {
    let started = Instant::now();
    let mkfs = mkfs()?;
    let rootfs = image_dir.join("rootfs");
    let staging = image_dir.join(format!(".vm.tmp-{}", std::process::id()));
    let _ = tokio::fs::remove_dir_all(&staging).await;
    tokio::fs::create_dir(&staging).await.map_err(|e| BackendError::io("creating the VM staging dir", e))?;
    let result = async {
        let measured = rootfs.clone();
        let content = tokio::task::spawn_blocking(move || hostfs::tree_size(&measured, hostfs::Measure::Allocated))
            .await
            .map_err(|e| BackendError::Internal(format!("measuring the rootfs: {e}")))?;
        let size = disk_bytes(content);
        let raw = staging.join("rootfs.raw");
        let file = std::fs::File::create(&raw).map_err(|e| BackendError::io("creating the raw disk", e))?;
        file.set_len(size).map_err(|e| BackendError::io("sizing the raw disk", e))?;
        drop(file);
        // The label is at most 16 bytes; the guest mounts /dev/vda, not a label.
        let label: String = image.chars().take(16).collect();
        let mkfs_started = Instant::now();
        run(
            tokio::process::Command::new(&mkfs)
                .args(["-q", "-F", "-b", "4096", "-i", "16384", "-I", "256", "-m", "0", "-L", &label])
                .args(["-E", "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0", "-d"])
                .arg(&rootfs)
                .arg(&raw),
            "mkfs.ext4",
        )
        .await?;
        let mkfs_ms = mkfs_started.elapsed().as_millis();
        let qcow2 = staging.join("rootfs.qcow2");
        let convert_started = Instant::now();
        run(tokio::process::Command::new(qemu_img).args(["convert", "-q", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(&qcow2), "qemu-img convert").await?;
        let convert_ms = convert_started.elapsed().as_millis();
        let _ = std::fs::remove_file(&raw);
        std::fs::set_permissions(&qcow2, std::fs::Permissions::from_mode(0o444)).map_err(|e| BackendError::io("chmod 0444 the base disk", e))?;
        let stored = std::fs::metadata(&qcow2).map(|m| m.blocks() * 512).unwrap_or(0);
        // vm.json last, as the script does.
        let json = VmJson { disk: "rootfs.qcow2".into(), disk_bytes: size, ..Default::default() };
        let text = serde_json::to_vec_pretty(&json).map_err(|e| BackendError::Internal(format!("encoding vm.json: {e}")))?;
        std::fs::write(staging.join("vm.json.tmp"), text).map_err(|e| BackendError::io("writing vm.json", e))?;
        std::fs::rename(staging.join("vm.json.tmp"), staging.join("vm.json")).map_err(|e| BackendError::io("writing vm.json", e))?;
        let vm = image_dir.join("vm");
        if vm.exists() {
            // A vm/ without vm.json: an earlier attempt that did not finish.
            std::fs::remove_dir_all(&vm).map_err(|e| BackendError::io("removing an unfinished vm dir", e))?;
        }
        std::fs::rename(&staging, &vm).map_err(|e| BackendError::io("putting vm/ in place", e))?;
        tracing::info!(
            image,
            content_bytes = content,
            disk_bytes = size,
            qcow2_bytes = stored,
            mkfs_ms = mkfs_ms as u64,
            convert_ms = convert_ms as u64,
            "microVM base disk built"
        );
        Ok(format!(
            "base disk: ext4 of {} MiB (mkfs {mkfs_ms} ms), qcow2 of {} MiB (convert {convert_ms} ms), {} ms in all",
            size >> 20,
            stored >> 20,
            started.elapsed().as_millis()
        ))
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_dir_all(&staging).await;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_size_follows_the_build_script() {
        // build-vm.sh: ((kib * 115 / 100 / 1024 + 48 + 3) / 4 * 4) MiB.
        assert_eq!(disk_bytes(0), 48 << 20);
        assert_eq!(disk_bytes(2 << 20), 52 << 20);
        assert_eq!(disk_bytes(300 << 20), 396 << 20);
    }
}
