//! Applying an image layer (a tar stream, already decompressed) to a root filesystem being
//! assembled, every path confined to it.
//!
//! The layer comes from a client and is hostile: it may name `../x` or `/x`, write "through" a
//! symlink it planted one entry (or one layer) earlier, hard-link a host file, carry device
//! nodes, or be built to exhaust memory or disk. The tree it is applied to is the daemon's own
//! staging dir, which nothing else writes while the import runs, so the threat is the stream:
//!
//! - Names with a `..` component, absolute names and names longer than `PATH_MAX` are refused
//!   (an image layer has none of them; refusing beats guessing what was meant).
//! - An entry's parent directories are opened with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from the rootfs: a symlink anywhere on the way
//!   is refused, never followed, so no entry lands outside through a link. Everything else is an
//!   `*at` call on one name in such a directory, with `O_NOFOLLOW` / `AT_SYMLINK_NOFOLLOW`.
//! - What already has an entry's name is removed first (a directory stays for a directory entry,
//!   as Docker does), and files are created with `O_CREAT | O_EXCL | O_NOFOLLOW`.
//! - Symlinks are stored as given: their target is text that the sandbox resolves in its own
//!   root. Hard links may only name a non-directory already inside the rootfs, found the same
//!   confined way (a leading `/` of the target means the rootfs's root).
//! - Device nodes and FIFOs are skipped and counted (the caller logs them); sparse files are
//!   refused.
//! - Whiteouts (OCI/AUFS): `.wh.<name>` removes `<name>` from the layers below, `.wh..wh..opq`
//!   empties its directory of everything the layers below put there.
//! - Owners, modes (set-id bits included: the store and every mount of it are `nosuid`), mtimes
//!   and the `SCHILY.xattr.*` extended attributes of files are kept.
//! - Work is bounded: entries and file bytes across all layers ([`Limits`]), and the bytes the
//!   `tar` crate may read into memory for one header (long names, PAX records).

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::hash::BuildHasher;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::rc::Rc;

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::Mode;
use sandbox_exec::archive::{copy_exact, Budget, Meta, Metered};
use sandbox_exec::sys;
use tar::{Archive, EntryType};

/// Most bytes the stream may spend between two entries' data: the header, GNU long names and
/// PAX records (which the `tar` crate reads into memory), and data of entries that are skipped.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;

/// Longest entry name (Linux's `PATH_MAX`): it also bounds how deep a layer's tree can be.
const MAX_NAME_BYTES: usize = 4096;

/// Buffer for file data.
const COPY_BUF: usize = 256 << 10;

/// Bounds across all layers of one image.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of regular-file data.
    pub max_bytes: u64,
    /// Entries of any type.
    pub max_entries: u64,
}

/// What the layers applied so far took, against [`Limits`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    pub bytes: u64,
    pub entries: u64,
}

/// What one layer did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LayerStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    pub whiteouts: u64,
    /// Device nodes, FIFOs and entry types that mean nothing in a rootfs.
    pub skipped: u64,
    pub bytes: u64,
}

/// Why a layer could not be applied. Every variant names the entry as the layer spells it.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The entry would leave the rootfs or pass through a symlink.
    #[error("{path}: refused: {reason}")]
    Unsafe { path: String, reason: String },
    #[error("{path}: {kind} entries are not supported")]
    Unsupported { path: String, kind: String },
    /// A bound of [`Limits`] (`key` names the configuration key) or [`MAX_HEADER_BYTES`].
    #[error("{path}: over the limit of {limit} {what}")]
    Limit { path: String, what: &'static str, limit: u64, key: &'static str },
    #[error("{path}: malformed layer: {source}")]
    Malformed { path: String, source: io::Error },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("cancelled")]
    Cancelled,
}

fn sys_err(path: &str, e: Errno) -> LayerError {
    LayerError::Io { path: path.to_string(), source: io::Error::from(e) }
}

/// An error while copying an entry's content: the archive's side (it ends inside the file, its
/// compression is corrupt) makes the layer malformed — the client's fault, INVALID_ARGUMENT —
/// while the host's side (a full disk, an I/O error: an errno) stays an I/O error.
fn read_or_write_error(path: &str, source: io::Error) -> LayerError {
    let from_archive =
        source.raw_os_error().is_none() && matches!(source.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput);
    if from_archive {
        LayerError::Malformed { path: path.to_string(), source }
    } else {
        LayerError::Io { path: path.to_string(), source }
    }
}

fn unsafe_entry(path: &str, reason: impl Into<String>) -> LayerError {
    LayerError::Unsafe { path: path.to_string(), reason: reason.into() }
}

/// The components of a name below the root (empty for the root itself). Absolute names and
/// `..` are refused, not cleaned.
fn components<'a>(raw: &'a [u8], what: &str) -> Result<Vec<&'a [u8]>, String> {
    if raw.len() > MAX_NAME_BYTES {
        return Err(format!("{what} of {} bytes (at most {MAX_NAME_BYTES})", raw.len()));
    }
    if raw.first() == Some(&b'/') {
        return Err(format!("absolute {what} (layer entries are relative to the root)"));
    }
    if raw.contains(&0) {
        return Err(format!("NUL byte in the {what}"));
    }
    let mut comps = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(format!("`..` in the {what}")),
            c => comps.push(c),
        }
    }
    Ok(comps)
}

/// A directory whose owner, mode and mtime are set when the layer is done (children change its
/// mtime, and a read-only one must still take them).
struct PendingDir {
    path: Vec<u8>,
    depth: usize,
    meta: Meta,
}

/// One layer being applied.
struct Applier<'a> {
    root: BorrowedFd<'a>,
    /// The last parent directory opened, by path: a layer lists a directory's files together.
    cached: Option<(Vec<u8>, Rc<OwnedFd>)>,
    /// Paths this layer wrote, which an opaque whiteout in it must keep: their hashes, so a
    /// layer of two million entries costs 16 MiB here, not its names (a collision could only
    /// keep one lower-layer entry an opaque directory should hide).
    seen: HashSet<u64>,
    hasher: std::collections::hash_map::RandomState,
    dirs: Vec<PendingDir>,
    stats: LayerStats,
    buf: Vec<u8>,
}

/// Applies the layer `input` (an uncompressed tar stream) to the rootfs open at `root` (an
/// `O_RDONLY | O_DIRECTORY` descriptor), counting against `totals` and `limits`. `cancelled` is
/// polled now and then. Reading stops at the end-of-archive marker; the caller drains the rest.
pub fn apply<R: Read>(root: BorrowedFd<'_>, input: R, totals: &mut Totals, limits: &Limits, cancelled: &dyn Fn() -> bool) -> Result<LayerStats, LayerError> {
    let budget = Budget::default();
    budget.allow(MAX_HEADER_BYTES);
    let mut archive = Archive::new(Metered::new(input, &budget));
    let mut a = Applier {
        root,
        cached: None,
        seen: HashSet::new(),
        hasher: std::collections::hash_map::RandomState::new(),
        dirs: Vec::new(),
        stats: LayerStats::default(),
        buf: vec![0; COPY_BUF],
    };
    let walked = a.entries(&mut archive, &budget, totals, limits, cancelled);
    let finished = a.finish_dirs();
    walked?;
    finished?;
    Ok(a.stats)
}

impl Applier<'_> {
    /// Notes that this layer wrote `path`.
    fn saw(&mut self, path: &[u8]) {
        let h = self.hasher.hash_one(path);
        self.seen.insert(h);
    }

    fn entries<R: Read>(
        &mut self,
        archive: &mut Archive<R>,
        budget: &Budget,
        totals: &mut Totals,
        limits: &Limits,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), LayerError> {
        let mut entries = archive.entries().map_err(|source| LayerError::Malformed { path: "the first entry".into(), source })?;
        let mut prev: Option<String> = None;
        loop {
            budget.allow(MAX_HEADER_BYTES);
            let here = || prev.as_ref().map_or_else(|| "the first entry".to_string(), |p| format!("the entry after `{p}`"));
            let mut entry = match entries.next() {
                None => return Ok(()),
                Some(Ok(entry)) => entry,
                Some(Err(_)) if budget.tripped() => {
                    return Err(LayerError::Limit { path: here(), what: "bytes of header, long names and skipped data", limit: MAX_HEADER_BYTES, key: "" });
                }
                Some(Err(source)) => return Err(LayerError::Malformed { path: here(), source }),
            };
            let name = entry.path_bytes().into_owned();
            let shown = String::from_utf8_lossy(&name).into_owned();
            totals.entries += 1;
            if totals.entries > limits.max_entries {
                return Err(LayerError::Limit { path: shown, what: "entries", limit: limits.max_entries, key: "max_entries" });
            }
            if totals.entries.is_multiple_of(256) && cancelled() {
                return Err(LayerError::Cancelled);
            }
            self.entry(&mut entry, &name, &shown, budget, totals, limits)?;
            prev = Some(shown);
        }
    }

    fn entry<E: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, E>,
        name: &[u8],
        shown: &str,
        budget: &Budget,
        totals: &mut Totals,
        limits: &Limits,
    ) -> Result<(), LayerError> {
        let kind = entry.header().entry_type();
        if kind == EntryType::XGlobalHeader {
            return Ok(());
        }
        let comps = components(name, "name").map_err(|r| unsafe_entry(shown, r))?;
        if let Some(last) = comps.last() {
            if let Some(target) = last.strip_prefix(b".wh.") {
                self.stats.whiteouts += 1;
                let dirs = &comps[..comps.len() - 1];
                return if target == b".wh..opq" { self.opaque(dirs, shown) } else { self.whiteout(dirs, target, shown) };
            }
        }
        let meta = Meta::from_header(entry.header(), 0o7777).map_err(|source| LayerError::Malformed { path: shown.to_string(), source })?;
        match kind {
            EntryType::Regular | EntryType::Continuous if name.ends_with(b"/") => self.dir(&comps, meta, shown),
            EntryType::Regular | EntryType::Continuous => {
                let size = entry.size();
                if size > limits.max_bytes.saturating_sub(totals.bytes) {
                    return Err(LayerError::Limit { path: shown.to_string(), what: "bytes of file data", limit: limits.max_bytes, key: "max_rootfs_bytes" });
                }
                let xattrs = xattrs_of(entry);
                self.file(entry, &comps, meta, size, &xattrs, shown, budget)?;
                totals.bytes += size;
                Ok(())
            }
            EntryType::Directory => self.dir(&comps, meta, shown),
            EntryType::Symlink => {
                let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                self.symlink(&comps, meta, &target, shown)
            }
            EntryType::Link => {
                let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                self.hardlink(&comps, &target, shown)
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                tracing::debug!(entry = %shown, kind = ?kind, "layer: device node or FIFO skipped");
                self.stats.skipped += 1;
                Ok(())
            }
            EntryType::GNUSparse => Err(LayerError::Unsupported { path: shown.to_string(), kind: "sparse file".into() }),
            other => {
                tracing::debug!(entry = %shown, kind = ?other, "layer: entry type skipped");
                self.stats.skipped += 1;
                Ok(())
            }
        }
    }

    /// The directory `dirs` below the root, `O_PATH`, missing ones created (0755) when `create`;
    /// `None` when it is missing and not `create`. A symlink or non-directory on the way is
    /// refused.
    fn dir_fd(&mut self, dirs: &[&[u8]], create: bool, shown: &str) -> Result<Option<Rc<OwnedFd>>, LayerError> {
        let key = dirs.join(&b'/');
        if let Some((k, fd)) = &self.cached {
            if *k == key {
                return Ok(Some(Rc::clone(fd)));
            }
        }
        let fd = if dirs.is_empty() {
            self.root.try_clone_to_owned().map_err(|source| LayerError::Io { path: shown.to_string(), source })?
        } else {
            let rel = CString::new(key.clone()).map_err(|_| unsafe_entry(shown, "NUL byte in the name"))?;
            match sys::open_beneath_no_symlinks(self.root.as_raw_fd(), &rel, libc::O_PATH | libc::O_DIRECTORY) {
                Ok(fd) => fd,
                Err(_) => match self.walk(dirs, create, shown)? {
                    Some(fd) => fd,
                    None => return Ok(None),
                },
            }
        };
        let fd = Rc::new(fd);
        self.cached = Some((key, Rc::clone(&fd)));
        Ok(Some(fd))
    }

    /// One component at a time, to create what is missing and to name what is wrong.
    fn walk(&self, dirs: &[&[u8]], create: bool, shown: &str) -> Result<Option<OwnedFd>, LayerError> {
        let mut cur: Option<OwnedFd> = None;
        for (i, comp) in dirs.iter().enumerate() {
            let at = cur.as_ref().map_or(self.root.as_raw_fd(), |fd| fd.as_raw_fd());
            let name = CString::new(*comp).map_err(|_| unsafe_entry(shown, "NUL byte in the name"))?;
            let prefix = || String::from_utf8_lossy(&dirs[..=i].join(&b'/')).into_owned();
            let mut made = false;
            let next = loop {
                match sys::open_beneath_no_symlinks(at, &name, libc::O_PATH | libc::O_DIRECTORY) {
                    Ok(fd) => break fd,
                    Err(Errno::ENOENT) if !create => return Ok(None),
                    Err(Errno::ENOENT) if !made => {
                        made = true;
                        match nix::sys::stat::mkdirat(Some(at), name.as_c_str(), Mode::from_bits_truncate(0o755)) {
                            Ok(()) | Err(Errno::EEXIST) => {}
                            Err(e) => return Err(sys_err(shown, e)),
                        }
                    }
                    Err(Errno::ELOOP) => return Err(unsafe_entry(shown, format!("`{}` is a symbolic link, and no entry is written through one", prefix()))),
                    Err(Errno::ENOTDIR) => return Err(unsafe_entry(shown, format!("`{}` is not a directory", prefix()))),
                    Err(e) => return Err(sys_err(shown, e)),
                }
            };
            cur = Some(next);
        }
        Ok(cur)
    }

    /// The parent directory of an entry and its last component (an entry cannot be the root).
    fn parent_of(&mut self, comps: &[&[u8]], shown: &str) -> Result<(Rc<OwnedFd>, CString), LayerError> {
        let Some((last, dirs)) = comps.split_last() else {
            return Err(unsafe_entry(shown, "only a directory entry may name the root"));
        };
        let name = CString::new(*last).map_err(|_| unsafe_entry(shown, "NUL byte in the name"))?;
        let parent = self.dir_fd(dirs, true, shown)?.ok_or_else(|| unsafe_entry(shown, "its directory cannot be made"))?;
        Ok((parent, name))
    }

    /// Removes whatever has `name` in `dir` (a whole tree for a directory), never following a
    /// link. `keep_dir`: a directory stays.
    fn clear(&mut self, dir: RawFd, name: &CStr, keep_dir: bool, shown: &str) -> Result<(), LayerError> {
        match sys::stat_at(dir, name).map_err(|e| sys_err(shown, e))? {
            None => Ok(()),
            Some(st) if sys::file_type(&st) == libc::S_IFDIR => {
                if keep_dir {
                    return Ok(());
                }
                // Whatever was cached may be inside the tree that goes.
                self.cached = None;
                remove_tree_at(dir, name).map_err(|source| LayerError::Io { path: shown.to_string(), source })
            }
            Some(_) => sys::unlink_at(dir, name).map_err(|e| sys_err(shown, e)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn file<E: Read>(
        &mut self,
        data: &mut E,
        comps: &[&[u8]],
        meta: Meta,
        size: u64,
        xattrs: &[(CString, Vec<u8>)],
        shown: &str,
        budget: &Budget,
    ) -> Result<(), LayerError> {
        let (parent, name) = self.parent_of(comps, shown)?;
        let pfd = parent.as_raw_fd();
        self.clear(pfd, &name, false, shown)?;
        let mut file = sys::create_new_at(pfd, &name).map_err(|e| sys_err(shown, e))?;
        budget.allow(size);
        copy_exact(data, &mut file, size, &mut self.buf).map_err(|source| read_or_write_error(shown, source))?;
        for (key, value) in xattrs {
            // Best effort: a filesystem without the namespace keeps the file without it.
            // SAFETY: fsetxattr on our own open file with a NUL-terminated name and a buffer of
            // the given length.
            let rc = unsafe { libc::fsetxattr(file.as_raw_fd(), key.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
            if rc != 0 {
                tracing::debug!(entry = %shown, xattr = ?key, error = %io::Error::last_os_error(), "layer: extended attribute not kept");
            }
        }
        meta.apply_fd(file.as_raw_fd()).map_err(|e| sys_err(shown, e))?;
        self.saw(&comps.join(&b'/'));
        self.stats.files += 1;
        self.stats.bytes += size;
        Ok(())
    }

    fn dir(&mut self, comps: &[&[u8]], meta: Meta, shown: &str) -> Result<(), LayerError> {
        let path = comps.join(&b'/');
        if !comps.is_empty() {
            let (parent, name) = self.parent_of(comps, shown)?;
            let pfd = parent.as_raw_fd();
            self.clear(pfd, &name, true, shown)?;
            match nix::sys::stat::mkdirat(Some(pfd), name.as_c_str(), Mode::from_bits_truncate(0o700)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(sys_err(shown, e)),
            }
        }
        self.saw(&path);
        self.dirs.push(PendingDir { depth: comps.len(), path, meta });
        self.stats.dirs += 1;
        Ok(())
    }

    fn symlink(&mut self, comps: &[&[u8]], meta: Meta, target: &[u8], shown: &str) -> Result<(), LayerError> {
        if target.is_empty() {
            return Err(unsafe_entry(shown, "symlink with an empty target"));
        }
        let target = CString::new(target).map_err(|_| unsafe_entry(shown, "NUL byte in the symlink target"))?;
        let (parent, name) = self.parent_of(comps, shown)?;
        let pfd = parent.as_raw_fd();
        self.clear(pfd, &name, false, shown)?;
        nix::unistd::symlinkat(target.as_c_str(), Some(pfd), name.as_c_str()).map_err(|e| sys_err(shown, e))?;
        meta.apply_link(pfd, &name).map_err(|e| sys_err(shown, e))?;
        self.saw(&comps.join(&b'/'));
        self.stats.symlinks += 1;
        Ok(())
    }

    /// A hard link to a non-directory already in the rootfs (this layer's or a lower one's).
    fn hardlink(&mut self, comps: &[&[u8]], target: &[u8], shown: &str) -> Result<(), LayerError> {
        // A leading `/` means the rootfs's root (as Docker reads it); `..` is refused.
        let trimmed = target.strip_prefix(b"/").unwrap_or(target);
        let tcomps = components(trimmed, "hard link target").map_err(|r| unsafe_entry(shown, r))?;
        let Some((tlast, tdirs)) = tcomps.split_last() else {
            return Err(unsafe_entry(shown, "hard link to the root"));
        };
        if tcomps == comps {
            return Ok(());
        }
        let tname = CString::new(*tlast).map_err(|_| unsafe_entry(shown, "NUL byte in the hard link target"))?;
        let shown_target = String::from_utf8_lossy(target).into_owned();
        let missing = || unsafe_entry(shown, format!("hard link to `{shown_target}`, which is not a file in the image"));
        let tparent = self.dir_fd(tdirs, false, shown)?.ok_or_else(missing)?;
        match sys::stat_at(tparent.as_raw_fd(), &tname).map_err(|e| sys_err(shown, e))? {
            Some(st) if sys::file_type(&st) != libc::S_IFDIR => {}
            _ => return Err(missing()),
        }
        let (parent, name) = self.parent_of(comps, shown)?;
        let pfd = parent.as_raw_fd();
        self.clear(pfd, &name, false, shown)?;
        // The parent may have replaced the cached target directory's descriptor; both are
        // held by their Rc.
        nix::unistd::linkat(Some(tparent.as_raw_fd()), tname.as_c_str(), Some(pfd), name.as_c_str(), AtFlags::empty()).map_err(|e| sys_err(shown, e))?;
        self.saw(&comps.join(&b'/'));
        self.stats.hardlinks += 1;
        Ok(())
    }

    /// `.wh.<name>`: `<name>` goes, whatever it is.
    fn whiteout(&mut self, dirs: &[&[u8]], target: &[u8], shown: &str) -> Result<(), LayerError> {
        if target.is_empty() || target == b"." || target == b".." {
            return Err(unsafe_entry(shown, "whiteout of no name"));
        }
        let Some(parent) = self.dir_fd(dirs, false, shown)? else { return Ok(()) };
        let name = CString::new(target).map_err(|_| unsafe_entry(shown, "NUL byte in the name"))?;
        self.clear(parent.as_raw_fd(), &name, false, shown)
    }

    /// `.wh..wh..opq`: the directory keeps only what this layer put in it.
    fn opaque(&mut self, dirs: &[&[u8]], shown: &str) -> Result<(), LayerError> {
        let mut pending = vec![dirs.join(&b'/')];
        while let Some(rel) = pending.pop() {
            let fd = if rel.is_empty() {
                self.root.try_clone_to_owned().map_err(|source| LayerError::Io { path: shown.to_string(), source })?
            } else {
                let c = CString::new(rel.clone()).map_err(|_| unsafe_entry(shown, "NUL byte in the name"))?;
                match sys::open_beneath_no_symlinks(self.root.as_raw_fd(), &c, libc::O_RDONLY | libc::O_DIRECTORY) {
                    Ok(fd) => fd,
                    Err(Errno::ENOENT) => continue,
                    Err(Errno::ELOOP | Errno::ENOTDIR) => return Err(unsafe_entry(shown, "the opaque directory is not a directory")),
                    Err(e) => return Err(sys_err(shown, e)),
                }
            };
            let names: Vec<CString> = {
                let dup = fd.try_clone().map_err(|source| LayerError::Io { path: shown.to_string(), source })?;
                let mut dir = nix::dir::Dir::from(dup).map_err(|e| sys_err(shown, e))?;
                dir.iter().filter_map(Result::ok).map(|e| e.file_name().to_owned()).filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..").collect()
            };
            for name in names {
                let child = if rel.is_empty() { name.as_bytes().to_vec() } else { [rel.as_slice(), b"/", name.as_bytes()].concat() };
                if !self.seen.contains(&self.hasher.hash_one(child.as_slice())) {
                    self.clear(fd.as_raw_fd(), &name, false, shown)?;
                } else if sys::stat_at(fd.as_raw_fd(), &name).map_err(|e| sys_err(shown, e))?.is_some_and(|st| sys::file_type(&st) == libc::S_IFDIR) {
                    pending.push(child);
                }
            }
        }
        Ok(())
    }

    /// Owner, mode and mtime of every directory entry, deepest first.
    fn finish_dirs(&mut self) -> Result<(), LayerError> {
        self.dirs.sort_by_key(|d| std::cmp::Reverse(d.depth));
        for d in &self.dirs {
            let shown = String::from_utf8_lossy(&d.path).into_owned();
            let opened;
            let fd = if d.path.is_empty() {
                self.root.as_raw_fd()
            } else {
                let rel = CString::new(d.path.clone()).map_err(|_| unsafe_entry(&shown, "NUL byte in the name"))?;
                opened = match sys::open_beneath_no_symlinks(self.root.as_raw_fd(), &rel, libc::O_RDONLY | libc::O_DIRECTORY) {
                    Ok(fd) => fd,
                    // Replaced by a later entry of the layer, or whited out: nothing to set.
                    Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => continue,
                    Err(e) => return Err(sys_err(&shown, e)),
                };
                opened.as_raw_fd()
            };
            d.meta.apply_fd(fd).map_err(|e| sys_err(&shown, e))?;
        }
        Ok(())
    }
}

/// Extended attributes an image may carry: the user namespace, file capabilities and ACLs.
/// `trusted.*` is never set: `trusted.overlay.*` in a lower layer means something to the
/// process tier's overlayfs (redirects, opaque dirs, metacopy), and nothing of that may come
/// from a client; other `security.*` attributes (SELinux labels, IMA) are the host's business.
fn allowed_xattr(key: &[u8]) -> bool {
    key.starts_with(b"user.") || key == b"security.capability" || key == b"system.posix_acl_access" || key == b"system.posix_acl_default"
}

/// The `SCHILY.xattr.*` PAX records of an entry that [`allowed_xattr`] lets through, as names
/// and values for `fsetxattr`.
fn xattrs_of<R: Read>(entry: &mut tar::Entry<'_, R>) -> Vec<(CString, Vec<u8>)> {
    let Ok(Some(exts)) = entry.pax_extensions() else { return Vec::new() };
    exts.filter_map(Result::ok)
        .filter_map(|ext| {
            let key = ext.key_bytes().strip_prefix(b"SCHILY.xattr.")?;
            if !allowed_xattr(key) {
                tracing::debug!(xattr = %String::from_utf8_lossy(key), "layer: extended attribute not kept");
                return None;
            }
            Some((CString::new(key).ok()?, ext.value_bytes().to_vec()))
        })
        .collect()
}

/// Removes the directory `name` in `dir` and everything below it, never following a symlink:
/// std's `remove_dir_all` opens each level with `O_NOFOLLOW` relative to the one above, reached
/// here through our own descriptor of `dir`.
fn remove_tree_at(dir: RawFd, name: &CStr) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let mut path = std::path::PathBuf::from(format!("/proc/self/fd/{dir}"));
    path.push(std::ffi::OsStr::from_bytes(name.to_bytes()));
    std::fs::remove_dir_all(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::path::Path;
    use tar::Header;

    /// A tar of entries written raw (so hostile names survive: the `tar` crate's `Builder`
    /// refuses `..`).
    struct Layer(Vec<u8>);

    impl Layer {
        fn new() -> Self {
            Layer(Vec::new())
        }
        fn entry(mut self, name: &str, kind: EntryType, data: &[u8], link: &str, mode: u32) -> Self {
            let mut h = Header::new_gnu();
            {
                let gnu = h.as_gnu_mut().expect("gnu");
                gnu.name[..name.len()].copy_from_slice(name.as_bytes());
                gnu.linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(mode);
            h.set_uid(1000);
            h.set_gid(1000);
            h.set_mtime(1_700_000_000);
            h.set_cksum();
            self.0.extend_from_slice(h.as_bytes());
            self.0.extend_from_slice(data);
            self.0.resize(self.0.len().div_ceil(512) * 512, 0);
            self
        }
        fn file(self, name: &str, data: &[u8]) -> Self {
            self.entry(name, EntryType::Regular, data, "", 0o644)
        }
        fn dir(self, name: &str) -> Self {
            self.entry(name, EntryType::Directory, b"", "", 0o755)
        }
        fn symlink(self, name: &str, target: &str) -> Self {
            self.entry(name, EntryType::Symlink, b"", target, 0o777)
        }
        fn hardlink(self, name: &str, target: &str) -> Self {
            self.entry(name, EntryType::Link, b"", target, 0o644)
        }
        fn bytes(mut self) -> Vec<u8> {
            self.0.extend_from_slice(&[0; 1024]);
            self.0
        }
    }

    const LIMITS: Limits = Limits { max_bytes: 1 << 20, max_entries: 1000 };

    fn apply_to(root: &Path, layer: &[u8], totals: &mut Totals, limits: &Limits) -> Result<LayerStats, LayerError> {
        let dir = File::open(root).expect("open root");
        let fd: OwnedFd = dir.into();
        apply(fd.as_fd(), layer, totals, limits, &|| false)
    }

    use std::os::fd::AsFd;

    fn rootfs() -> (tempfile::TempDir, std::path::PathBuf) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("rootfs");
        std::fs::create_dir(&root).expect("mkdir");
        (tmp, root)
    }

    #[test]
    fn files_dirs_links_and_metadata_are_kept() {
        let (_tmp, root) = rootfs();
        let layer = Layer::new()
            .dir("etc/")
            .file("etc/hello", b"hi")
            .entry("bin/tool", EntryType::Regular, b"#!", "", 0o4755)
            .symlink("etc/link", "/etc/hello")
            .hardlink("etc/again", "etc/hello")
            .entry("dev/null", EntryType::Char, b"", "", 0o666)
            .bytes();
        let mut totals = Totals::default();
        let stats = apply_to(&root, &layer, &mut totals, &LIMITS).expect("apply");
        assert_eq!((stats.files, stats.symlinks, stats.hardlinks, stats.skipped, stats.bytes), (2, 1, 1, 1, 4));
        let m = std::fs::metadata(root.join("etc/hello")).expect("stat");
        assert_eq!((m.uid(), m.gid(), m.mtime(), m.nlink()), (1000, 1000, 1_700_000_000, 2));
        assert_eq!(std::fs::metadata(root.join("bin/tool")).expect("stat").permissions().mode() & 0o7777, 0o4755, "set-id bits are kept");
        assert_eq!(std::fs::read_link(root.join("etc/link")).expect("link").to_str(), Some("/etc/hello"));
        assert!(!root.join("dev/null").exists(), "device nodes are skipped");
        assert_eq!(std::fs::metadata(root.join("etc")).expect("stat").mtime(), 1_700_000_000, "directory mtimes are set last");
        assert_eq!((totals.entries, totals.bytes), (6, 4));
    }

    #[test]
    fn whiteouts_remove_and_opaque_dirs_hide_the_layers_below() {
        let (_tmp, root) = rootfs();
        let lower = Layer::new().file("a/keep", b"1").file("a/gone", b"2").file("b/old/deep", b"3").file("b/x", b"4").dir("c/").bytes();
        let mut totals = Totals::default();
        apply_to(&root, &lower, &mut totals, &LIMITS).expect("lower");
        let upper =
            Layer::new().file("a/.wh.gone", b"").file("b/new", b"5").file("b/.wh..wh..opq", b"").file(".wh.c", b"").file("a/.wh.never-was", b"").bytes();
        let stats = apply_to(&root, &upper, &mut totals, &LIMITS).expect("upper");
        assert_eq!(stats.whiteouts, 4);
        assert!(root.join("a/keep").exists() && !root.join("a/gone").exists());
        assert!(root.join("b/new").exists(), "the opaque dir keeps this layer's entries");
        assert!(!root.join("b/old").exists() && !root.join("b/x").exists(), "and loses the lower layers'");
        assert!(!root.join("c").exists());
        assert!(!root.join("a/.wh.gone").exists() && !root.join("b/.wh..wh..opq").exists(), "whiteout files are not written");
    }

    #[test]
    fn hostile_paths_are_refused_and_nothing_lands_outside() {
        let (tmp, root) = rootfs();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).expect("mkdir");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("dotdot", Layer::new().file("../outside/x", b"bad").bytes()),
            ("deep dotdot", Layer::new().file("a/../../outside/x", b"bad").bytes()),
            ("absolute", Layer::new().file("/tmp/x", b"bad").bytes()),
            ("through a symlink", Layer::new().symlink("esc", "../outside").file("esc/x", b"bad").bytes()),
            ("through an absolute symlink", Layer::new().symlink("esc2", outside.to_str().expect("utf8")).file("esc2/x", b"bad").bytes()),
            ("hard link out", Layer::new().hardlink("h", "../outside/target").bytes()),
            ("hard link to a missing file", Layer::new().hardlink("h", "/etc/shadow").bytes()),
            ("whiteout through a symlink", Layer::new().symlink("wl", "../outside").file("wl/.wh.x", b"").bytes()),
        ];
        std::fs::write(outside.join("target"), b"host").expect("write");
        std::fs::write(outside.join("x"), b"host").expect("write");
        for (what, layer) in cases {
            let err = apply_to(&root, &layer, &mut Totals::default(), &LIMITS).expect_err(what);
            assert!(matches!(err, LayerError::Unsafe { .. }), "{what}: {err}");
        }
        assert_eq!(std::fs::read(outside.join("x")).expect("read"), b"host", "nothing was written or removed outside");
        assert_eq!(std::fs::metadata(outside.join("target")).expect("stat").nlink(), 1);
        assert_eq!(std::fs::read_dir(&outside).expect("ls").count(), 2);
        // A symlink planted by a lower layer is no way out either.
        apply_to(&root, &Layer::new().symlink("etc", "/").bytes(), &mut Totals::default(), &LIMITS).expect("a link");
        let err = apply_to(&root, &Layer::new().file("etc/passwd", b"x").bytes(), &mut Totals::default(), &LIMITS).expect_err("through the lower link");
        assert!(err.to_string().contains("`etc` is a symbolic link"), "{err}");
        // A directory entry replaces the link instead (as Docker does), and is a real directory.
        apply_to(&root, &Layer::new().dir("etc/").file("etc/passwd", b"x").bytes(), &mut Totals::default(), &LIMITS).expect("dir over link");
        assert!(std::fs::symlink_metadata(root.join("etc")).expect("stat").is_dir());
    }

    #[test]
    fn a_name_taken_by_a_symlink_is_replaced_not_written_through() {
        let (tmp, root) = rootfs();
        let outside = tmp.path().join("victim");
        std::fs::write(&outside, b"host").expect("write");
        let layer = Layer::new().symlink("f", outside.to_str().expect("utf8")).file("f", b"payload").bytes();
        apply_to(&root, &layer, &mut Totals::default(), &LIMITS).expect("apply");
        assert_eq!(std::fs::read(&outside).expect("read"), b"host");
        assert_eq!(std::fs::read(root.join("f")).expect("read"), b"payload");
    }

    #[test]
    fn bounds_are_resource_limits_naming_the_key() {
        let (_tmp, root) = rootfs();
        let limits = Limits { max_bytes: 10, max_entries: 3 };
        let err = apply_to(&root, &Layer::new().file("a", b"123456").file("b", b"123456").bytes(), &mut Totals::default(), &limits).expect_err("bytes");
        assert!(matches!(err, LayerError::Limit { key: "max_rootfs_bytes", .. }), "{err}");
        assert!(!root.join("b").exists(), "the file over the limit was not started");
        let many = (0..5).fold(Layer::new(), |l, i| l.dir(&format!("d{i}/"))).bytes();
        let err = apply_to(&root, &many, &mut Totals::default(), &limits).expect_err("entries");
        assert!(matches!(err, LayerError::Limit { key: "max_entries", .. }), "{err}");
        // The totals carry across layers.
        let mut totals = Totals { bytes: 8, entries: 0 };
        let err = apply_to(&root, &Layer::new().file("c", b"123").bytes(), &mut totals, &limits).expect_err("across layers");
        assert!(matches!(err, LayerError::Limit { .. }), "{err}");
    }

    #[test]
    fn a_layer_cut_short_inside_a_file_is_malformed_not_an_io_error() {
        let (_tmp, root) = rootfs();
        let whole = Layer::new().file("big", &[7u8; 4096]).bytes();
        // The header and 1 KiB of the 4 KiB of content: the archive ends inside the file.
        let cut = &whole[..512 + 1024];
        let err = apply_to(&root, cut, &mut Totals::default(), &LIMITS).expect_err("truncated");
        assert!(matches!(err, LayerError::Malformed { .. }), "{err}");
        assert!(err.to_string().contains("big"), "names the entry: {err}");
    }

    #[test]
    fn a_huge_long_name_is_a_limit_not_an_allocation() {
        let (_tmp, root) = rootfs();
        // A GNU long-name entry announcing 64 MiB of name.
        let mut h = Header::new_gnu();
        h.as_gnu_mut().expect("gnu").name[..13].copy_from_slice(b"././@LongLink");
        h.set_entry_type(EntryType::GNULongName);
        h.set_size(64 << 20);
        h.set_cksum();
        let mut layer = h.as_bytes().to_vec();
        layer.extend(std::iter::repeat_n(b'a', 2 << 20));
        let err = apply_to(&root, &layer, &mut Totals::default(), &LIMITS).expect_err("long name");
        assert!(matches!(err, LayerError::Limit { .. } | LayerError::Malformed { .. }), "{err}");
    }

    #[test]
    fn user_xattrs_are_kept_and_trusted_overlay_ones_never() {
        let (_tmp, root) = rootfs();
        let mut b = tar::Builder::new(Vec::new());
        let pax: Vec<(&str, &[u8])> = vec![("SCHILY.xattr.user.origin", b"layer"), ("SCHILY.xattr.trusted.overlay.redirect", b"/etc")];
        b.append_pax_extensions(pax).expect("pax");
        let mut h = Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "f", &b"x"[..]).expect("append");
        let layer = b.into_inner().expect("tar");
        apply_to(&root, &layer, &mut Totals::default(), &LIMITS).expect("apply");
        let get = |name: &str| {
            let path = CString::new(root.join("f").to_str().expect("utf8")).expect("path");
            let key = CString::new(name).expect("key");
            let mut buf = [0u8; 64];
            // SAFETY: lgetxattr with NUL-terminated path and name into a buffer of its length.
            let n = unsafe { libc::lgetxattr(path.as_ptr(), key.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
            (n >= 0).then(|| buf[..n as usize].to_vec())
        };
        // tmpfs and ext4 both take user.* xattrs on regular files.
        assert_eq!(get("user.origin").as_deref(), Some(&b"layer"[..]));
        assert_eq!(get("trusted.overlay.redirect"), None);
    }
}
