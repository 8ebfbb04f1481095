//! Directories as tar streams, both ways, for `UploadArchive` and `DownloadArchive`.
//!
//! [`pack`] writes a local directory as a tar stream: regular files, directories and symlinks
//! (stored as symlinks, never followed), with their modes, mtimes and owners; sockets, fifos and
//! devices are left out and listed in the report.
//!
//! [`unpack`] extracts a tar stream that comes from inside a sandbox, so it treats it as
//! hostile. It refuses — stopping at the entry, with an error naming it — :
//!
//! - an absolute path, or one with a `..` component (in an entry's name or a hard link's target);
//! - an entry whose path goes through a symlink (whether the archive made it or it was there):
//!   every parent of every entry must be a real directory;
//! - device nodes, fifos and every other kind but regular files, directories, symlinks and hard
//!   links;
//! - a hard link to anything but a regular file this same archive extracted.
//!
//! An entry never writes through what is already at its path: a file or symlink there is
//! removed and the file is created anew (`O_EXCL`, which does not follow a symlink); a directory
//! in the way of anything but a directory is an error. Symlinks are created as they are, their
//! targets unchecked (`../x`, `/etc`): creating a link writes nothing through it, and no later
//! entry may pass through it. Modes lose setuid, setgid and sticky; owners are not applied;
//! mtimes are. Directories keep owner `rwx` until the end, then get their own mode.
//!
//! The `tar` crate's `unpack_in` is not enough on its own: it silently skips `..` entries and
//! strips a leading `/` (where this module refuses the archive), and it lets an entry pass
//! through a symlink as long as the symlink's target stays inside the directory.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use tar::{EntryType, Header, HeaderMode};

/// Why packing or unpacking failed.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// The archive holds an entry this module does not extract (see the module docs).
    #[error("refused archive entry {entry:?}: {reason}")]
    Refused {
        /// The entry's name as the archive gives it.
        entry: String,
        /// Why it is refused.
        reason: String,
    },
    /// Reading or writing a local file failed.
    #[error("{path}: {source}")]
    Io {
        /// The local path.
        path: String,
        /// The operating system's reason.
        #[source]
        source: io::Error,
    },
    /// The tar stream itself is broken or could not be read or written.
    #[error("bad tar stream: {0}")]
    Tar(#[source] io::Error),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What [`pack`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackReport {
    /// Regular files.
    pub files: u64,
    /// Directories below the root.
    pub directories: u64,
    /// Symlinks.
    pub symlinks: u64,
    /// Bytes of file content.
    pub bytes: u64,
    /// Entries left out (sockets, fifos, devices), relative to the root.
    pub skipped: Vec<PathBuf>,
}

/// Writes the contents of `dir` (not `dir` itself: entry names are relative to it) as a tar
/// stream into `out`, finished with the end-of-archive blocks. Walks in name order, each
/// directory before what it holds; never follows a symlink, the root's included.
pub fn pack<W: Write>(dir: &Path, out: W) -> Result<PackReport, ArchiveError> {
    pack_filtered(dir, out, &|_, _| true)
}

/// [`pack`], leaving out every entry (and a directory's whole contents) for which `keep`,
/// given the path relative to `dir` and whether it is a directory, says `false`.
pub fn pack_filtered<W: Write>(
    dir: &Path,
    out: W,
    keep: &dyn Fn(&Path, bool) -> bool,
) -> Result<PackReport, ArchiveError> {
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    if !meta.is_dir() {
        return Err(ArchiveError::Io {
            path: dir.display().to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not a directory"),
        });
    }
    let mut builder = tar::Builder::new(out);
    builder.mode(HeaderMode::Complete);
    builder.follow_symlinks(false);
    let mut report = PackReport::default();
    pack_dir(&mut builder, dir, Path::new(""), &mut report, keep)?;
    builder.into_inner().map_err(ArchiveError::Tar)?;
    Ok(report)
}

fn pack_dir<W: Write>(
    builder: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    report: &mut PackReport,
    keep: &dyn Fn(&Path, bool) -> bool,
) -> Result<(), ArchiveError> {
    let here = root.join(rel);
    let mut names: Vec<OsString> = fs::read_dir(&here)
        .map_err(io_err(&here))?
        .map(|entry| entry.map(|e| e.file_name()))
        .collect::<io::Result<_>>()
        .map_err(io_err(&here))?;
    names.sort();
    for name in names {
        let rel = rel.join(&name);
        let path = root.join(&rel);
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path))?;
        let kind = meta.file_type();
        if !keep(&rel, kind.is_dir()) {
            continue;
        }
        if kind.is_symlink() {
            let target = fs::read_link(&path).map_err(io_err(&path))?;
            let mut header = header_from(&meta, EntryType::Symlink);
            builder
                .append_link(&mut header, &rel, &target)
                .map_err(ArchiveError::Tar)?;
            report.symlinks += 1;
        } else if kind.is_dir() {
            builder.append_dir(&rel, &path).map_err(ArchiveError::Tar)?;
            report.directories += 1;
            pack_dir(builder, root, &rel, report, keep)?;
        } else if kind.is_file() {
            let mut file = fs::File::open(&path).map_err(io_err(&path))?;
            // The size in the header is the one this handle sees, so a file that grows while
            // it is read is cut at that size rather than breaking the stream.
            let meta = file.metadata().map_err(io_err(&path))?;
            let mut header = header_from(&meta, EntryType::Regular);
            builder
                .append_data(&mut header, &rel, (&mut file).take(meta.len()))
                .map_err(|e| match e.kind() {
                    // A file that shrank: tar pads nothing for us, so the stream is broken.
                    io::ErrorKind::UnexpectedEof => ArchiveError::Io {
                        path: path.display().to_string(),
                        source: io::Error::new(e.kind(), "the file shrank while it was read"),
                    },
                    _ => ArchiveError::Tar(e),
                })?;
            report.files += 1;
            report.bytes += meta.len();
        } else {
            report.skipped.push(rel);
        }
    }
    Ok(())
}

/// A GNU header for `kind` with the mode, owners and mtime of `meta` (GNU, so long names and
/// link targets fit).
fn header_from(meta: &fs::Metadata, kind: EntryType) -> Header {
    let mut header = Header::new_gnu();
    header.set_metadata_in_mode(meta, HeaderMode::Complete);
    header.set_entry_type(kind);
    if kind != EntryType::Regular {
        header.set_size(0);
    }
    header
}

/// What [`unpack`] extracted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnpackReport {
    /// Regular files (hard links included).
    pub files: u64,
    /// Directories.
    pub directories: u64,
    /// Symlinks.
    pub symlinks: u64,
    /// Bytes of file content.
    pub bytes: u64,
}

/// Extracts the tar stream `input` into the existing directory `dst`, refusing what the module
/// docs list. Stops at the first refused or failing entry; what was extracted before it stays.
pub fn unpack<R: Read>(input: R, dst: &Path) -> Result<UnpackReport, ArchiveError> {
    let meta = fs::symlink_metadata(dst).map_err(io_err(dst))?;
    if !meta.is_dir() {
        return Err(ArchiveError::Io {
            path: dst.display().to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not a directory"),
        });
    }
    let mut archive = tar::Archive::new(input);
    let mut report = UnpackReport::default();
    // Regular files this archive created, for hard links to point at.
    let mut extracted: HashSet<PathBuf> = HashSet::new();
    // Directories with their final mode and mtime, applied at the end (deepest first) so a
    // read-only directory does not stop its own contents from being written.
    let mut directories: Vec<(PathBuf, u32, u64)> = Vec::new();
    for entry in archive.entries().map_err(ArchiveError::Tar)? {
        let mut entry = entry.map_err(ArchiveError::Tar)?;
        let kind = entry.header().entry_type();
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let refuse = |reason: &str| ArchiveError::Refused {
            entry: name.clone(),
            reason: reason.to_owned(),
        };
        // Metadata for the next entry; the tar crate applies long names and pax paths itself.
        if matches!(
            kind,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            continue;
        }
        let path = entry.path().map_err(ArchiveError::Tar)?.into_owned();
        let rel = relative(&path).map_err(&refuse)?;
        if rel.as_os_str().is_empty() {
            // The root itself (`./`): it exists already.
            if kind == EntryType::Directory {
                continue;
            }
            return Err(refuse("an entry with no name"));
        }
        let target = dst.join(&rel);
        make_parents(dst, &rel).map_err(|e| name_it(e, &name))?;
        let mode = entry.header().mode().map_err(ArchiveError::Tar)? & 0o777;
        let mtime = entry.header().mtime().unwrap_or(0);
        let existing = match fs::symlink_metadata(&target) {
            Ok(meta) => Some(meta),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&target)(e)),
        };
        // Whatever is at the path goes, unless it is a directory, so no entry is ever written
        // through an existing file or symlink.
        let in_the_way = existing.as_ref().is_some_and(|m| m.is_dir());
        if existing.is_some() && !in_the_way {
            fs::remove_file(&target).map_err(io_err(&target))?;
            extracted.remove(&rel);
        }
        match kind {
            EntryType::Directory => {
                if !in_the_way {
                    fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&target)
                        .map_err(io_err(&target))?;
                }
                directories.push((target, mode, mtime));
                report.directories += 1;
            }
            _ if in_the_way => return Err(refuse("a directory is in the way")),
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let mut file = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&target)
                    .map_err(io_err(&target))?;
                let bytes = io::copy(&mut entry, &mut file).map_err(ArchiveError::Tar)?;
                file.set_permissions(fs::Permissions::from_mode(mode))
                    .map_err(io_err(&target))?;
                file.set_modified(system_time(mtime))
                    .map_err(io_err(&target))?;
                extracted.insert(rel);
                report.files += 1;
                report.bytes += bytes;
            }
            EntryType::Symlink => {
                let link = entry
                    .link_name()
                    .map_err(ArchiveError::Tar)?
                    .ok_or_else(|| refuse("a symlink without a target"))?;
                if link.as_os_str().is_empty() {
                    return Err(refuse("a symlink without a target"));
                }
                std::os::unix::fs::symlink(&link, &target).map_err(io_err(&target))?;
                set_symlink_mtime(&target, mtime)?;
                report.symlinks += 1;
            }
            EntryType::Link => {
                let link = entry
                    .link_name()
                    .map_err(ArchiveError::Tar)?
                    .ok_or_else(|| refuse("a hard link without a target"))?;
                let link_rel =
                    relative(&link).map_err(|reason| refuse(&format!("its target: {reason}")))?;
                if !extracted.contains(&link_rel) {
                    return Err(refuse(
                        "a hard link to something this archive did not extract as a file",
                    ));
                }
                let source = dst.join(&link_rel);
                // Linking does not follow a symlink, and `extracted` only holds files, but
                // a parent may not have been checked since: check it again.
                make_parents(dst, &link_rel).map_err(|e| name_it(e, &name))?;
                fs::hard_link(&source, &target).map_err(io_err(&target))?;
                extracted.insert(rel);
                report.files += 1;
            }
            EntryType::Char | EntryType::Block => return Err(refuse("a device node")),
            EntryType::Fifo => return Err(refuse("a fifo")),
            _ => return Err(refuse("an entry of a kind this client does not extract")),
        }
    }
    for (dir, mode, mtime) in directories.iter().rev() {
        fs::set_permissions(dir, fs::Permissions::from_mode(*mode)).map_err(io_err(dir))?;
        let handle = fs::File::open(dir).map_err(io_err(dir))?;
        handle
            .set_modified(system_time(*mtime))
            .map_err(io_err(dir))?;
    }
    Ok(report)
}

/// `path` as a relative path of plain names (`.` dropped); the reason when it is absolute or
/// has `..`.
fn relative(path: &Path) -> Result<PathBuf, &'static str> {
    let mut rel = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(name) => rel.push(name),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err("an absolute path"),
            Component::ParentDir => return Err("a path with .."),
        }
    }
    Ok(rel)
}

/// Makes sure every parent of `rel` under `dst` is a real directory, creating those missing.
/// A symlink (or anything else) among them is refused: nothing is written through it.
fn make_parents(dst: &Path, rel: &Path) -> Result<(), ArchiveError> {
    let mut here = dst.to_path_buf();
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    for part in parent.components() {
        here.push(part);
        match fs::symlink_metadata(&here) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(ArchiveError::Refused {
                    entry: String::new(),
                    reason: format!(
                        "its path goes through the symlink {}",
                        here.strip_prefix(dst).unwrap_or(&here).display()
                    ),
                })
            }
            Ok(_) => {
                return Err(ArchiveError::Refused {
                    entry: String::new(),
                    reason: format!(
                        "its parent {} is not a directory",
                        here.strip_prefix(dst).unwrap_or(&here).display()
                    ),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new()
                .mode(0o755)
                .create(&here)
                .map_err(io_err(&here))?,
            Err(e) => return Err(io_err(&here)(e)),
        }
    }
    Ok(())
}

/// Fills in the entry's name of a refusal raised without it.
fn name_it(err: ArchiveError, name: &str) -> ArchiveError {
    match err {
        ArchiveError::Refused { entry, reason } if entry.is_empty() => ArchiveError::Refused {
            entry: name.to_owned(),
            reason,
        },
        other => other,
    }
}

fn system_time(mtime: u64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime)
}

/// A symlink's own mtime (not its target's).
fn set_symlink_mtime(path: &Path, mtime: u64) -> Result<(), ArchiveError> {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    let when = TimeSpec::new(i64::try_from(mtime).unwrap_or(i64::MAX), 0);
    utimensat(None, path, &when, &when, UtimensatFlags::NoFollowSymlink)
        .map_err(|errno| io_err(path)(io::Error::from(errno)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A tar stream built entry by entry, as a hostile sandbox could write it: raw names, no
    /// checks.
    struct Hostile {
        builder: tar::Builder<Vec<u8>>,
    }

    impl Hostile {
        fn new() -> Self {
            Self {
                builder: tar::Builder::new(Vec::new()),
            }
        }

        fn entry(mut self, kind: EntryType, name: &str, link: Option<&str>, data: &[u8]) -> Self {
            let mut header = Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(0o644);
            header.set_size(data.len() as u64);
            // Raw bytes: `set_path` would refuse `..` and absolute names.
            let raw = &mut header.as_old_mut().name;
            raw[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(link) = link {
                let raw = &mut header.as_old_mut().linkname;
                raw[..link.len()].copy_from_slice(link.as_bytes());
            }
            header.set_cksum();
            self.builder.append(&header, data).expect("append");
            self
        }

        fn file(self, name: &str, data: &[u8]) -> Self {
            self.entry(EntryType::Regular, name, None, data)
        }

        fn bytes(self) -> Vec<u8> {
            self.builder.into_inner().expect("finish")
        }
    }

    fn refused(archive: Vec<u8>, dst: &Path) -> String {
        match unpack(archive.as_slice(), dst) {
            Err(err @ ArchiveError::Refused { .. }) => err.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn pack_then_unpack_keeps_everything() {
        let src = tempfile::tempdir().expect("tmp");
        let root = src.path();
        fs::create_dir_all(root.join("a/b")).expect("mkdir");
        fs::write(root.join("a/b/run.sh"), b"#!/bin/sh\n").expect("write");
        fs::set_permissions(root.join("a/b/run.sh"), fs::Permissions::from_mode(0o751))
            .expect("chmod");
        fs::write(root.join("top.txt"), vec![7u8; 100_000]).expect("write");
        symlink("a/b/run.sh", root.join("link")).expect("symlink");
        symlink("/nowhere/at/all", root.join("dangling")).expect("symlink");
        let long = "n".repeat(150);
        fs::write(root.join(&long), b"long name").expect("write");
        let fifo = root.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644))
            .expect("mkfifo");
        let old = system_time(1_000_000_000);
        fs::File::open(root.join("top.txt"))
            .and_then(|f| f.set_modified(old))
            .expect("mtime");

        let mut tar = Vec::new();
        let packed = pack(root, &mut tar).expect("pack");
        assert_eq!(
            (
                packed.files,
                packed.directories,
                packed.symlinks,
                packed.bytes
            ),
            (3, 2, 2, 100_000 + 10 + 9)
        );
        assert_eq!(
            packed.skipped,
            [PathBuf::from("fifo")],
            "a fifo is left out"
        );

        let names: Vec<String> = tar::Archive::new(tar.as_slice())
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        let a = names.iter().position(|n| n == "a").expect("a");
        let run = names
            .iter()
            .position(|n| n == "a/b/run.sh")
            .expect("run.sh");
        assert!(a < run, "directories come before their contents: {names:?}");

        let out = tempfile::tempdir().expect("tmp");
        let got = unpack(tar.as_slice(), out.path()).expect("unpack");
        assert_eq!((got.files, got.directories, got.symlinks), (3, 2, 2));
        let dst = out.path();
        assert_eq!(
            fs::read(dst.join("a/b/run.sh")).expect("read"),
            b"#!/bin/sh\n"
        );
        let mode = fs::metadata(dst.join("a/b/run.sh"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o751, "mode kept");
        assert_eq!(
            fs::read_link(dst.join("link")).expect("link"),
            Path::new("a/b/run.sh")
        );
        assert_eq!(
            fs::read_link(dst.join("dangling")).expect("link"),
            Path::new("/nowhere/at/all"),
            "a symlink is stored as a symlink, never followed"
        );
        assert_eq!(fs::read(dst.join(&long)).expect("long name"), b"long name");
        let mtime = fs::metadata(dst.join("top.txt"))
            .expect("meta")
            .modified()
            .expect("mtime");
        assert_eq!(mtime, old, "mtime kept");
    }

    #[test]
    fn setuid_is_dropped_and_read_only_directories_still_fill() {
        let src = tempfile::tempdir().expect("tmp");
        let root = src.path();
        fs::create_dir(root.join("ro")).expect("mkdir");
        fs::write(root.join("ro/f"), b"x").expect("write");
        fs::write(root.join("suid"), b"x").expect("write");
        fs::set_permissions(root.join("suid"), fs::Permissions::from_mode(0o4755)).expect("chmod");
        fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o555)).expect("chmod");
        let mut tar = Vec::new();
        pack(root, &mut tar).expect("pack");
        fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o755)).expect("chmod");

        let out = tempfile::tempdir().expect("tmp");
        unpack(tar.as_slice(), out.path()).expect("unpack");
        let mode = |p: &str| {
            fs::symlink_metadata(out.path().join(p))
                .expect("meta")
                .permissions()
                .mode()
                & 0o7777
        };
        assert_eq!(mode("suid"), 0o755);
        assert_eq!(mode("ro"), 0o555);
        assert_eq!(fs::read(out.path().join("ro/f")).expect("read"), b"x");
        fs::set_permissions(out.path().join("ro"), fs::Permissions::from_mode(0o755))
            .expect("chmod");
    }

    #[test]
    fn absolute_and_dotdot_names_are_refused() {
        let outer = tempfile::tempdir().expect("tmp");
        let dst = outer.path().join("dst");
        fs::create_dir(&dst).expect("mkdir");
        let err = refused(Hostile::new().file("/abs", b"x").bytes(), &dst);
        assert!(
            err.contains("\"/abs\"") && err.contains("absolute"),
            "{err}"
        );
        let err = refused(Hostile::new().file("ok/../../escape", b"x").bytes(), &dst);
        assert!(err.contains(".."), "{err}");
        assert!(!outer.path().join("escape").exists());
    }

    #[test]
    fn nothing_is_written_through_a_symlink() {
        let outer = tempfile::tempdir().expect("tmp");
        let dst = outer.path().join("dst");
        let outside = outer.path().join("outside");
        fs::create_dir(&dst).expect("mkdir");
        fs::create_dir(&outside).expect("mkdir");
        fs::write(outside.join("victim"), b"safe").expect("write");
        let outside_str = outside.display().to_string();

        // A symlink to a directory outside, then a file through it.
        let archive = Hostile::new()
            .entry(EntryType::Symlink, "esc", Some(&outside_str), b"")
            .file("esc/victim", b"owned")
            .bytes();
        let err = refused(archive, &dst);
        assert!(
            err.contains("esc/victim") && err.contains("symlink esc"),
            "{err}"
        );
        assert_eq!(fs::read(outside.join("victim")).expect("read"), b"safe");

        // A symlink to a file outside, then a file of the same name: the link is replaced,
        // never written through.
        let victim = outside.join("victim").display().to_string();
        let archive = Hostile::new()
            .entry(EntryType::Symlink, "f", Some(&victim), b"")
            .file("f", b"owned")
            .bytes();
        unpack(archive.as_slice(), &dst).expect("a plain replacement");
        assert_eq!(fs::read(outside.join("victim")).expect("read"), b"safe");
        assert_eq!(fs::read(dst.join("f")).expect("read"), b"owned");
        assert!(!fs::symlink_metadata(dst.join("f"))
            .expect("meta")
            .file_type()
            .is_symlink());

        // Even a symlink that stays inside is not passed through.
        let archive = Hostile::new()
            .entry(EntryType::Directory, "real", None, b"")
            .entry(EntryType::Symlink, "alias", Some("real"), b"")
            .file("alias/x", b"x")
            .bytes();
        refused(archive, &dst);
        assert!(!dst.join("real/x").exists());

        // A symlink that was already there (not from the archive) is no way out either.
        symlink(&outside, dst.join("pre")).expect("symlink");
        refused(Hostile::new().file("pre/victim", b"owned").bytes(), &dst);
        assert_eq!(fs::read(outside.join("victim")).expect("read"), b"safe");
    }

    #[test]
    fn devices_fifos_and_stray_hard_links_are_refused() {
        let outer = tempfile::tempdir().expect("tmp");
        let dst = outer.path().join("dst");
        fs::create_dir(&dst).expect("mkdir");
        let err = refused(
            Hostile::new()
                .entry(EntryType::Char, "null", None, b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains("device node"), "{err}");
        let err = refused(
            Hostile::new()
                .entry(EntryType::Block, "sda", None, b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains("device node"), "{err}");
        let err = refused(
            Hostile::new()
                .entry(EntryType::Fifo, "p", None, b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains("fifo"), "{err}");

        let secret = outer.path().join("secret");
        fs::write(&secret, b"secret").expect("write");
        let target = secret.display().to_string();
        let err = refused(
            Hostile::new()
                .entry(EntryType::Link, "h", Some(&target), b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains("absolute"), "{err}");
        let err = refused(
            Hostile::new()
                .entry(EntryType::Link, "h", Some("../secret"), b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains(".."), "{err}");
        // A hard link to an existing local file the archive did not write.
        fs::write(dst.join("mine"), b"mine").expect("write");
        let err = refused(
            Hostile::new()
                .entry(EntryType::Link, "h", Some("mine"), b"")
                .bytes(),
            &dst,
        );
        assert!(err.contains("did not extract"), "{err}");

        // A hard link to a file of the archive is fine.
        let archive = Hostile::new()
            .file("orig", b"data")
            .entry(EntryType::Link, "copy", Some("orig"), b"")
            .bytes();
        let got = unpack(archive.as_slice(), &dst).expect("unpack");
        assert_eq!(got.files, 2);
        assert_eq!(fs::read(dst.join("copy")).expect("read"), b"data");
    }

    #[test]
    fn a_truncated_stream_is_an_error() {
        let src = tempfile::tempdir().expect("tmp");
        fs::write(src.path().join("f"), vec![1u8; 10_000]).expect("write");
        let mut tar = Vec::new();
        pack(src.path(), &mut tar).expect("pack");
        tar.truncate(3000);
        let out = tempfile::tempdir().expect("tmp");
        assert!(unpack(tar.as_slice(), out.path()).is_err());
    }
}
