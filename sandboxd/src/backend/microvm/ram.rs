//! Guest RAM in files: every VM's RAM is a `memory-backend-file` (`share=on`) on a tmpfs the
//! daemon owns, so a memory snapshot saves only QEMU's device state (`x-ignore-shared`, tens of
//! kilobytes) and copies the RAM file while the guest is paused, and a restore copies a
//! snapshot's RAM into the new VM's own file, where QEMU finds it without reading a page of the
//! migration stream. Each VM writes only its own file: two forks of one snapshot never share
//! a page they write.
//!
//! The copies are sparse (only the file's data extents: the pages the guest ever touched), so
//! they cost what the guest used, not what it was given.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where the running VMs' RAM files live: a directory of this daemon's own (named after its
/// state directory, as its cgroups are) on `/dev/shm` when that is a tmpfs, else `fallback`
/// (under the state directory: it works, but the host then writes guest RAM back to disk).
pub fn dir(daemon_name: &str, fallback: PathBuf) -> PathBuf {
    let shm = Path::new("/dev/shm");
    if is_tmpfs(shm) {
        shm.join(format!("{daemon_name}-vm-ram"))
    } else {
        tracing::warn!(dir = %fallback.display(), "/dev/shm is not a tmpfs: microVM guest RAM files live under the state directory");
        fallback
    }
}

fn is_tmpfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// Makes `dir` (mode 0700, root's) and empties it: at start-up every VM of a previous run is
/// gone (they die with the daemon), and so is any use of their RAM. (A running VM's file is
/// unlinked once its guest answers; only a daemon that died while a VM started leaves one.)
pub fn reset_dir(dir: &Path) -> io::Result<()> {
    clear_dir(dir);
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
}

/// Removes the RAM files (`*.ram`) in `dir`. A QEMU that still maps one keeps its pages until
/// it exits.
pub fn clear_dir(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().ends_with(".ram") {
            if let Err(err) = std::fs::remove_file(e.path()) {
                tracing::warn!(file = %e.path().display(), error = %err, "removing a leftover microVM RAM file");
            }
        }
    }
}

/// Creates a new RAM file of `bytes` (sparse: all holes), mode 0600, for QEMU (root until it
/// drops privileges) to map.
pub fn create(path: &Path, bytes: u64) -> io::Result<File> {
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
    if let Err(e) = file.set_len(bytes) {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(file)
}

/// Copies the data extents of `src` (its first `len` bytes) into the same offsets of `dst`,
/// leaving its holes holes. Returns the bytes copied.
pub fn copy_sparse(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    let mut off = 0u64;
    let mut copied = 0u64;
    while off < len {
        let Some(start) = seek(src, off, libc::SEEK_DATA)? else { break };
        if start >= len {
            break;
        }
        let end = seek(src, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        copy_range(src, dst, start, end - start)?;
        copied += end - start;
        off = end;
    }
    Ok(copied)
}

/// Copies `src` (its first `len` bytes) as [`copy_sparse`] does, but leaves a hole for every
/// all-zero page of its data too: a guest's RAM holds many (about a third of an idle guest's
/// touched pages), and a resume copies only the data (with `copy_sparse`). Returns the bytes
/// written.
pub fn copy_sparse_nonzero(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    const PAGE: usize = 4096;
    let mut buf = vec![0u8; 1 << 20];
    let (mut off, mut written) = (0u64, 0u64);
    while off < len {
        let Some(start) = seek(src, off, libc::SEEK_DATA)? else { break };
        if start >= len {
            break;
        }
        let end = seek(src, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = start;
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = src.read_at(&mut buf[..want], at)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the RAM file ended early"));
            }
            // Runs of pages with data, written one run at a time.
            let mut run: Option<usize> = None;
            for (i, page) in buf[..n].chunks(PAGE).enumerate() {
                let zero = page.iter().all(|&b| b == 0);
                match (zero, run) {
                    (false, None) => run = Some(i * PAGE),
                    (true, Some(from)) => {
                        dst.write_all_at(&buf[from..i * PAGE], at + from as u64)?;
                        written += (i * PAGE - from) as u64;
                        run = None;
                    }
                    _ => {}
                }
            }
            if let Some(from) = run {
                dst.write_all_at(&buf[from..n], at + from as u64)?;
                written += (n - from) as u64;
            }
            at += n as u64;
        }
        off = end;
    }
    Ok(written)
}

/// lseek(2) with SEEK_DATA or SEEK_HOLE; None past the last data (ENXIO).
fn seek(f: &File, off: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let off = libc::off_t::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek on a descriptor we own; no memory is passed.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
    }
    Ok(Some(r as u64))
}

/// Copies `len` bytes at `off` of `src` to `off` of `dst`: in the kernel (copy_file_range)
/// where it can, through a buffer where it cannot (another filesystem on older kernels).
fn copy_range(src: &File, dst: &File, off: u64, len: u64) -> io::Result<()> {
    let (mut done, mut kernel) = (0u64, true);
    let mut buf = Vec::new();
    while done < len {
        let at = off + done;
        let want = (len - done).min(1 << 30) as usize;
        if kernel {
            let (mut o_in, mut o_out) = (at as libc::loff_t, at as libc::loff_t);
            // SAFETY: both descriptors are ours; the offsets are our own variables.
            let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut o_in, dst.as_raw_fd(), &mut o_out, want, 0) };
            if n > 0 {
                done += n as u64;
                continue;
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the RAM file ended early"));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => kernel = false,
                Some(libc::EINTR) => {}
                _ => return Err(e),
            }
            continue;
        }
        if buf.is_empty() {
            buf = vec![0u8; 1 << 20];
        }
        let chunk = want.min(buf.len());
        let n = src.read_at(&mut buf[..chunk], at)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the RAM file ended early"));
        }
        dst.write_all_at(&buf[..n], at)?;
        done += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_copy_keeps_data_and_holes() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (a, b) = (dir.path().join("a.ram"), dir.path().join("b.ram"));
        let len = 64 << 20;
        let src = create(&a, len).expect("the source");
        src.write_all_at(&[7u8; 4096], 8 << 20).expect("a page");
        src.write_all_at(&[9u8; 8192], 40 << 20).expect("two pages");
        let dst = create(&b, len).expect("the copy");
        let copied = copy_sparse(&src, &dst, len).expect("copied");
        assert!((12288..4 << 20).contains(&copied), "{copied}");
        let mut page = [0u8; 4096];
        dst.read_exact_at(&mut page, 8 << 20).expect("read");
        assert_eq!(page, [7u8; 4096]);
        dst.read_exact_at(&mut page, (40 << 20) + 4096).expect("read");
        assert_eq!(page, [9u8; 4096]);
        dst.read_exact_at(&mut page, 20 << 20).expect("read");
        assert_eq!(page, [0u8; 4096]);
        assert_eq!(dst.metadata().expect("stat").len(), len);
        assert!(create(&b, len).is_err(), "never over an existing file");
    }

    #[test]
    fn zero_pages_of_the_data_are_left_holes() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (a, b) = (dir.path().join("a.ram"), dir.path().join("b.ram"));
        let len = 8 << 20;
        let src = create(&a, len).expect("the source");
        // Data pages: 3 zero, 1 with a byte at its end, 2 zero, 2 full; then a hole, then one
        // last page that ends the file.
        let mut data = vec![0u8; 8 * 4096];
        data[4 * 4096 - 1] = 1;
        data[6 * 4096..].fill(5);
        src.write_all_at(&data, 1 << 20).expect("data");
        src.write_all_at(&[3u8; 4096], len - 4096).expect("the last page");
        let dst = create(&b, len).expect("the copy");
        let written = copy_sparse_nonzero(&src, &dst, len).expect("copied");
        assert_eq!(written, 4 * 4096, "only the pages with data");
        let mut back = vec![0u8; data.len()];
        dst.read_exact_at(&mut back, 1 << 20).expect("read");
        assert_eq!(back, data, "the same bytes");
        let mut page = [0u8; 4096];
        dst.read_exact_at(&mut page, len - 4096).expect("read");
        assert_eq!(page, [3u8; 4096]);
        let allocated = std::os::unix::fs::MetadataExt::blocks(&dst.metadata().expect("stat")) * 512;
        assert!(allocated <= 5 * 4096, "the zero pages take no space: {allocated} bytes allocated");
    }
}
