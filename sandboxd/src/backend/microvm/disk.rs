//! The microVM tier's disks: qcow2 overlay chains on a read-only base per image.
//!
//! ```text
//! <state>/microvm/bases/<image>-<key>.qcow2     hard link (or copy) of the image's rootfs.qcow2
//! <state>/microvm/snapshots/<snapshot>.qcow2    a frozen former top of some sandbox
//! <state>/microvm/vms/<sandbox>/top-<gen>.qcow2 the sandbox's writable top (highest gen wins)
//! ```
//!
//! A snapshot turns the sandbox's current top into the snapshot file (it is never written
//! again) and puts a fresh top over it; rollback and fork put a fresh top over a snapshot file.
//! Chains are followed through the backing-file name in each qcow2 header, which is always an
//! absolute path. A snapshot file deleted through the API may still back other files; it is
//! removed by [`collect_garbage`] once nothing reaches it.

use std::collections::HashSet;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::backend::BackendError;

const QCOW2_MAGIC: [u8; 4] = [b'Q', b'F', b'I', 0xfb];
/// Backing names longer than this are not ours (QEMU's own limit is 1023).
const MAX_BACKING_NAME: u32 = 4096;
/// Backing chains longer than this are treated as broken (each snapshot adds one link).
pub const MAX_CHAIN: usize = 1000;

/// What a qcow2 header says about the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qcow2Header {
    pub virtual_size: u64,
    pub backing: Option<PathBuf>,
}

/// Reads the header of a qcow2 file (only the fields the chain needs).
pub fn read_header(path: &Path) -> Result<Qcow2Header, BackendError> {
    let ctx = || format!("reading qcow2 header of {}", path.display());
    let mut f = std::fs::File::open(path).map_err(|e| BackendError::io(ctx(), e))?;
    let mut head = [0u8; 32];
    f.read_exact(&mut head).map_err(|e| BackendError::io(ctx(), e))?;
    parse_header(&head, |offset, len| {
        use std::os::unix::fs::FileExt;
        let mut name = vec![0u8; len];
        f.read_exact_at(&mut name, offset).map_err(|e| BackendError::io(ctx(), e))?;
        Ok(name)
    })
    .map_err(|e| match e {
        BackendError::Internal(m) => BackendError::Internal(format!("{}: {m}", path.display())),
        other => other,
    })
}

fn parse_header(head: &[u8; 32], read_at: impl FnOnce(u64, usize) -> Result<Vec<u8>, BackendError>) -> Result<Qcow2Header, BackendError> {
    if head[..4] != QCOW2_MAGIC {
        return Err(BackendError::Internal("not a qcow2 file".into()));
    }
    let be64 = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().unwrap_or_default());
    let be32 = |at: usize| u32::from_be_bytes(head[at..at + 4].try_into().unwrap_or_default());
    let backing_offset = be64(8);
    let backing_len = be32(16);
    let virtual_size = be64(24);
    let backing = if backing_offset == 0 || backing_len == 0 {
        None
    } else if backing_len > MAX_BACKING_NAME {
        return Err(BackendError::Internal(format!("backing file name of {backing_len} bytes")));
    } else {
        let raw = read_at(backing_offset, backing_len as usize)?;
        let name = String::from_utf8(raw).map_err(|_| BackendError::Internal("backing file name is not UTF-8".into()))?;
        Some(PathBuf::from(name))
    };
    Ok(Qcow2Header { virtual_size, backing })
}

/// The files of a chain, top first, base last.
pub fn chain(top: &Path) -> Result<Vec<PathBuf>, BackendError> {
    let mut out = vec![top.to_path_buf()];
    let mut cur = top.to_path_buf();
    while let Some(next) = read_header(&cur)?.backing {
        if out.len() >= MAX_CHAIN || out.contains(&next) {
            return Err(BackendError::Internal(format!("backing chain of {} loops or exceeds {MAX_CHAIN} files", top.display())));
        }
        out.push(next.clone());
        cur = next;
    }
    Ok(out)
}

/// Creates `path` as a qcow2 overlay of `backing` (absolute) with the given virtual size. The
/// backing file is not opened (it may be held by a running QEMU).
pub async fn create_overlay(qemu_img: &Path, backing: &Path, path: &Path, size: u64) -> Result<(), BackendError> {
    let out = tokio::process::Command::new(qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-u", "-b"])
        .arg(backing)
        .arg(path)
        .arg(size.to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| BackendError::io(format!("running {}", qemu_img.display()), e))?;
    if !out.status.success() {
        return Err(BackendError::Internal(format!("qemu-img create {} failed: {}", path.display(), String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Bytes allocated on the host by the chain above the base (the top and the snapshots under it).
pub fn chain_bytes_above_base(top: &Path, bases_dir: &Path) -> u64 {
    chain(top).unwrap_or_default().iter().filter(|p| !p.starts_with(bases_dir)).filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.blocks() * 512).sum()
}

/// A stable, private copy of an image's base disk: a hard link (or a copy across filesystems)
/// named after the file's identity, so rebuilding the image later never changes the bytes under
/// existing overlays.
pub fn base_for(image: &str, source: &Path, bases_dir: &Path) -> Result<PathBuf, BackendError> {
    let meta = std::fs::metadata(source).map_err(|e| BackendError::io(format!("reading {}", source.display()), e))?;
    let key = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(meta.dev().to_le_bytes());
        h.update(meta.ino().to_le_bytes());
        h.update(meta.size().to_le_bytes());
        h.update(meta.mtime().to_le_bytes());
        h.update(meta.mtime_nsec().to_le_bytes());
        let d = h.finalize();
        d.iter().take(8).map(|b| format!("{b:02x}")).collect::<String>()
    };
    let dest = bases_dir.join(format!("{image}-{key}.qcow2"));
    if dest.exists() {
        return Ok(dest);
    }
    let tmp = bases_dir.join(format!(".{image}-{key}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    if std::fs::hard_link(source, &tmp).is_err() {
        std::fs::copy(source, &tmp).map_err(|e| BackendError::io(format!("copying {} to {}", source.display(), tmp.display()), e))?;
    }
    std::fs::rename(&tmp, &dest).map_err(|e| BackendError::io(format!("placing {}", dest.display()), e))?;
    Ok(dest)
}

/// The base disks [`base_for`] made for `image` (`<image>-<16 hex>.qcow2`).
pub fn bases_of(image: &str, bases_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(bases_dir) else { return Vec::new() };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let Some(name) = p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".qcow2")) else { return false };
            name.rsplit_once('-').is_some_and(|(img, key)| img == image && key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .collect()
}

/// Deletes the files in `dirs` that no chain from `roots` reaches. Roots whose chain cannot be
/// read keep everything they might reach (only the files already followed are known), so a
/// broken header never causes a deletion it should not.
pub fn collect_garbage(roots: &[PathBuf], dirs: &[&Path]) -> Vec<PathBuf> {
    let mut keep: HashSet<PathBuf> = HashSet::new();
    let mut unsure = false;
    for root in roots {
        let mut cur = Some(root.clone());
        while let Some(p) = cur.take() {
            if !keep.insert(p.clone()) {
                break;
            }
            match read_header(&p) {
                Ok(h) => cur = h.backing,
                Err(e) => {
                    if p.exists() {
                        tracing::warn!(file = %p.display(), error = %e, "cannot follow a backing chain; not collecting garbage now");
                        unsure = true;
                    }
                }
            }
        }
    }
    if unsure {
        return Vec::new();
    }
    let mut removed = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let is_disk = p.extension().is_some_and(|x| x == "qcow2");
            if is_disk && !keep.contains(&p) && std::fs::remove_file(&p).is_ok() {
                removed.push(p);
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(backing: Option<&str>, size: u64) -> Vec<u8> {
        let mut h = vec![0u8; 512];
        h[..4].copy_from_slice(&QCOW2_MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        if let Some(b) = backing {
            h[8..16].copy_from_slice(&200u64.to_be_bytes());
            h[16..20].copy_from_slice(&(b.len() as u32).to_be_bytes());
            h[200..200 + b.len()].copy_from_slice(b.as_bytes());
        }
        h[24..32].copy_from_slice(&size.to_be_bytes());
        h
    }

    #[test]
    fn headers_chains_and_garbage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let base = d.join("base.qcow2");
        let s1 = d.join("s1.qcow2");
        let s2 = d.join("s2.qcow2");
        let top = d.join("top.qcow2");
        let orphan = d.join("orphan.qcow2");
        std::fs::write(&base, header(None, 1 << 30)).expect("write");
        std::fs::write(&s1, header(Some(base.to_str().expect("utf8")), 1 << 30)).expect("write");
        std::fs::write(&s2, header(Some(s1.to_str().expect("utf8")), 2 << 30)).expect("write");
        std::fs::write(&top, header(Some(s2.to_str().expect("utf8")), 2 << 30)).expect("write");
        std::fs::write(&orphan, header(Some(s1.to_str().expect("utf8")), 1 << 30)).expect("write");
        assert_eq!(read_header(&top).expect("header"), Qcow2Header { virtual_size: 2 << 30, backing: Some(s2.clone()) });
        assert_eq!(chain(&top).expect("chain"), vec![top.clone(), s2.clone(), s1.clone(), base.clone()]);
        // s1 is still needed by top's chain though no root names it; orphan is not.
        let removed = collect_garbage(std::slice::from_ref(&top), &[d]);
        assert_eq!(removed, vec![orphan.clone()]);
        assert!(s1.exists() && base.exists());
    }

    #[test]
    fn bases_of_an_image_are_its_own_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["py-0123456789abcdef.qcow2", "py-app-0123456789abcdef.qcow2", "py-xyz.qcow2", ".py-0123456789abcdef.1.tmp"] {
            std::fs::write(dir.path().join(name), b"").expect("write");
        }
        assert_eq!(bases_of("py", dir.path()), vec![dir.path().join("py-0123456789abcdef.qcow2")]);
        assert_eq!(bases_of("py-app", dir.path()), vec![dir.path().join("py-app-0123456789abcdef.qcow2")]);
    }

    #[test]
    fn loops_and_junk_are_errors_not_hangs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.qcow2");
        let b = dir.path().join("b.qcow2");
        std::fs::write(&a, header(Some(b.to_str().expect("utf8")), 1)).expect("write");
        std::fs::write(&b, header(Some(a.to_str().expect("utf8")), 1)).expect("write");
        assert!(chain(&a).is_err());
        let junk = dir.path().join("junk.qcow2");
        std::fs::write(&junk, b"not a disk at all, really not one").expect("write");
        assert!(read_header(&junk).is_err());
        // A root with an unreadable chain stops garbage collection altogether.
        let other = dir.path().join("other.qcow2");
        std::fs::write(&other, header(None, 1)).expect("write");
        assert!(collect_garbage(std::slice::from_ref(&junk), &[dir.path()]).is_empty());
        assert!(other.exists());
    }
}
