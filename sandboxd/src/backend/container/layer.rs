//! Copying a container's writable layer (the overlay "upper" directory) to and from snapshots.
//!
//! A snapshot of a container is a copy of its upper directory taken while the container is
//! frozen; a fork or rollback copies it into the (still empty) upper directory of a container
//! created from the same image, before that container starts. The copy must reproduce what the
//! overlay driver reads back, not just file contents: whiteouts are character devices 0/0,
//! opaque directories are marked by xattrs or `.wh..wh..opq` files, and owners, modes, times and
//! hard links all matter to the programs in the sandbox. Sockets are skipped (they cannot be
//! recreated meaningfully and nothing can be connected to them after a restart anyway).
//!
//! Everything here is blocking; callers run it under `spawn_blocking`.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use nix::sys::stat::{utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;

/// What a copy moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Bytes of regular file content (hard links counted once).
    pub bytes: u64,
    /// Entries created (directories, files, links, device nodes).
    pub entries: u64,
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Names of the extended attributes of `path` (not following symlinks).
fn xattr_names(path: &Path) -> io::Result<Vec<CString>> {
    let c = cpath(path)?;
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: the buffer is valid for `buf.len()` bytes and `c` is NUL-terminated.
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            break;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ERANGE) => buf.resize(buf.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(err),
        }
    }
    Ok(buf.split(|&b| b == 0).filter(|s| !s.is_empty()).filter_map(|s| CString::new(s).ok()).collect())
}

/// Copies every extended attribute (overlay opaque markers, capabilities, ACLs) from `src` to
/// `dst`. Attributes the destination filesystem refuses are skipped: the copy must not fail
/// over, say, a `security.selinux` label on a host without SELinux.
fn copy_xattrs(src: &Path, dst: &Path) -> io::Result<()> {
    let (cs, cd) = (cpath(src)?, cpath(dst)?);
    for name in xattr_names(src)? {
        let mut value = vec![0u8; 256];
        let len = loop {
            // SAFETY: valid NUL-terminated strings and a buffer of `value.len()` bytes.
            let n = unsafe { libc::lgetxattr(cs.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
            if n >= 0 {
                break n as usize;
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ERANGE) {
                value.resize(value.len() * 4, 0);
                continue;
            }
            return Err(err);
        };
        // SAFETY: valid NUL-terminated strings and `len` initialised bytes of `value`.
        let rc = unsafe { libc::lsetxattr(cd.as_ptr(), name.as_ptr(), value.as_ptr().cast(), len, 0) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            tracing::debug!(path = %dst.display(), attr = ?name, error = %err, "extended attribute not copied");
        }
    }
    Ok(())
}

/// Owner, times (and mode, for what `create` did not set) of `dst` from `meta`.
fn copy_attributes(src: &Path, dst: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid()))?;
    if !meta.file_type().is_symlink() {
        // After chown: chown clears setuid/setgid bits, which the mode restores.
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    copy_xattrs(src, dst)?;
    let atime = TimeSpec::new(meta.atime(), meta.atime_nsec());
    let mtime = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    utimensat(None, dst, &atime, &mtime, UtimensatFlags::NoFollowSymlink).map_err(io::Error::from)
}

fn mknod(dst: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    let c = cpath(dst)?;
    let kind = meta.mode() & libc::S_IFMT;
    // SAFETY: a NUL-terminated path; mode and device number come from an existing node.
    let rc = unsafe { libc::mknod(c.as_ptr(), kind | (meta.mode() & 0o7777), meta.rdev()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

struct Copier {
    stats: CopyStats,
    /// (device, inode) of multiply-linked files already copied → where the copy is.
    links: HashMap<(u64, u64), std::path::PathBuf>,
}

impl Copier {
    fn copy_dir_contents(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        for entry in std::fs::read_dir(src)? {
            let entry = entry?;
            self.copy_entry(&entry.path(), &dst.join(entry.file_name()))?;
        }
        Ok(())
    }

    fn copy_entry(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        let context = |e: io::Error| io::Error::new(e.kind(), format!("copying {} to {}: {e}", src.display(), dst.display()));
        let meta = std::fs::symlink_metadata(src).map_err(context)?;
        let ft = meta.file_type();
        // What Docker made in a fresh layer before the copy (the working directory it creates at
        // container create, with fuse-overlayfs' opaque marker inside) gives way to the copy; a
        // directory on both sides is merged into.
        match std::fs::symlink_metadata(dst) {
            Ok(m) if m.is_dir() && ft.is_dir() => {}
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(dst).map_err(context)?,
            Ok(_) => std::fs::remove_file(dst).map_err(context)?,
            Err(_) => {}
        }
        if ft.is_dir() {
            match std::fs::create_dir(dst) {
                Ok(()) => self.stats.entries += 1,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(context(e)),
            }
            self.copy_dir_contents(src, dst)?;
            // Times last: creating the children changed the directory's mtime.
            return copy_attributes(src, dst, &meta).map_err(context);
        }
        if ft.is_socket() {
            return Ok(());
        }

        if meta.nlink() > 1 && !ft.is_symlink() {
            if let Some(first) = self.links.get(&(meta.dev(), meta.ino())) {
                std::fs::hard_link(first, dst).map_err(context)?;
                self.stats.entries += 1;
                return Ok(());
            }
            self.links.insert((meta.dev(), meta.ino()), dst.to_path_buf());
        }
        if ft.is_file() {
            std::fs::copy(src, dst).map_err(context)?;
            self.stats.bytes += meta.len();
        } else if ft.is_symlink() {
            let target = std::fs::read_link(src).map_err(context)?;
            std::os::unix::fs::symlink(target, dst).map_err(context)?;
        } else {
            // Character devices (overlay whiteouts are 0/0), block devices and FIFOs.
            mknod(dst, &meta).map_err(context)?;
        }
        self.stats.entries += 1;
        copy_attributes(src, dst, &meta).map_err(context)
    }
}

/// Copies the contents of directory `src` into the existing directory `dst` (whose own owner,
/// mode and times become those of `src`). Entries already in `dst` with other names are kept;
/// one with the same name is replaced (a directory is merged into when both are directories).
pub fn copy_tree(src: &Path, dst: &Path) -> io::Result<CopyStats> {
    let mut copier = Copier { stats: CopyStats::default(), links: HashMap::new() };
    copier.copy_dir_contents(src, dst)?;
    let meta = std::fs::symlink_metadata(src)?;
    copy_attributes(src, dst, &meta)?;
    Ok(copier.stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn copies_contents_modes_links_and_whiteouts() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        std::fs::create_dir_all(src.join("a/b")).expect("mkdir");
        std::fs::create_dir(&dst).expect("mkdir");
        std::fs::write(src.join("a/file"), b"hello").expect("write");
        std::fs::set_permissions(src.join("a/file"), std::fs::Permissions::from_mode(0o4750)).expect("chmod");
        std::fs::hard_link(src.join("a/file"), src.join("a/b/link")).expect("link");
        std::os::unix::fs::symlink("../file", src.join("a/b/sym")).expect("symlink");
        nix::unistd::mkfifo(&src.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
        // A whiteout, as overlayfs writes it: a character device 0/0 (needs root, as the
        // daemon and the tests have).
        let wh = cpath(&src.join("gone")).expect("path");
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, 0) }, 0, "mknod whiteout");

        let stats = copy_tree(&src, &dst).expect("copy");
        assert_eq!(stats.bytes, 5, "hard links count once");
        assert_eq!(std::fs::read(dst.join("a/b/link")).expect("read"), b"hello");
        let (m1, m2) = (std::fs::metadata(dst.join("a/file")).expect("stat"), std::fs::metadata(dst.join("a/b/link")).expect("stat"));
        assert_eq!(m1.ino(), m2.ino(), "hard link preserved");
        assert_eq!(m1.mode() & 0o7777, 0o4750, "mode incl. setuid kept");
        assert_eq!(std::fs::read_link(dst.join("a/b/sym")).expect("readlink"), Path::new("../file"));
        assert!(std::fs::symlink_metadata(dst.join("fifo")).expect("stat").file_type().is_fifo());
        let gone = std::fs::symlink_metadata(dst.join("gone")).expect("stat");
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0, "whiteout kept");
    }

    #[test]
    fn what_a_fresh_layer_already_holds_gives_way_to_the_copy() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        std::fs::create_dir_all(src.join("work/wd")).expect("mkdir");
        std::fs::write(src.join("work/wd/.wh..opq"), b"").expect("marker");
        std::fs::write(src.join("work/file"), b"snapshot").expect("write");
        std::fs::create_dir(src.join("was-a-file")).expect("mkdir");
        // Docker created the working directory (with its opaque marker) in the new layer.
        std::fs::create_dir_all(dst.join("work/wd")).expect("mkdir");
        std::fs::write(dst.join("work/wd/.wh..opq"), b"").expect("marker");
        std::os::unix::fs::symlink("/elsewhere", dst.join("work/file")).expect("symlink");
        std::fs::write(dst.join("was-a-file"), b"x").expect("write");
        std::fs::write(dst.join("kept"), b"k").expect("write");
        copy_tree(&src, &dst).expect("copy over what is there");
        assert_eq!(std::fs::read(dst.join("work/file")).expect("read"), b"snapshot", "the symlink was replaced, not followed");
        assert!(dst.join("work/wd/.wh..opq").is_file() && dst.join("was-a-file").is_dir() && dst.join("kept").is_file());
    }
}
