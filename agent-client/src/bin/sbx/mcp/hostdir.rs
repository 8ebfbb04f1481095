//! The one host directory `sbx mcp --allow-host-dir DIR` lets a model copy files through.
//!
//! Every path is resolved by the kernel with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`
//! against a descriptor of DIR opened once at start: `..`, absolute symlinks and relative
//! symlinks that climb out are refused at each step of the walk, so there is no window between
//! a check and the use of what was checked (the `docker cp` symlink race, CVE-2018-15664).
//! A file written here is created under a temporary name in its (confined) parent directory and
//! renamed over the target at the end: an interrupted copy leaves no half file, and a symlink at
//! the target is replaced, never followed.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{openat2, renameat, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// Why a host path was refused or could not be used.
#[derive(Debug, thiserror::Error)]
pub enum HostDirError {
    /// The allowed directory itself cannot be opened.
    #[error("cannot open the allowed host directory {path}: {source}")]
    OpenRoot {
        /// The directory as given.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The path names something outside the allowed directory, or nothing at all.
    #[error("host path {path:?} is outside the allowed directory {root} (only paths inside it can be used)")]
    Outside {
        /// The path as given.
        path: String,
        /// The allowed directory.
        root: PathBuf,
    },
    /// The kernel refused the path while resolving it inside the allowed directory.
    #[error("host path {path:?}: {reason}")]
    Resolve {
        /// The path as given.
        path: String,
        /// What went wrong, for a reader.
        reason: String,
    },
    /// Not a regular file.
    #[error("host path {path:?} is not a regular file")]
    NotAFile {
        /// The path as given.
        path: String,
    },
}

/// A directory on the host, opened once, inside which all host paths resolve.
#[derive(Debug)]
pub struct HostDir {
    root: PathBuf,
    fd: OwnedFd,
}

/// A file being written under a temporary name; [`PendingFile::commit`] renames it into place.
#[derive(Debug)]
pub struct PendingFile {
    parent: OwnedFd,
    temp: String,
    name: String,
    done: bool,
}

const RESOLVE: ResolveFlag = ResolveFlag::RESOLVE_BENEATH.union(ResolveFlag::RESOLVE_NO_MAGICLINKS);

impl HostDir {
    /// Opens `path` (which must be a directory) as the allowed directory.
    pub fn open(path: &Path) -> Result<Self, HostDirError> {
        let open_err = |source| HostDirError::OpenRoot {
            path: path.to_owned(),
            source,
        };
        let root = std::fs::canonicalize(path).map_err(open_err)?;
        let fd = nix::fcntl::open(
            &root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| open_err(std::io::Error::from(e)))?;
        // SAFETY: `open` just returned this descriptor and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { root, fd })
    }

    /// The allowed directory, canonical.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `path` relative to the allowed directory: a relative path as it is, an absolute one only
    /// when it lies under the directory. Lexical only; the kernel does the real confinement.
    fn relative(&self, path: &str) -> Result<PathBuf, HostDirError> {
        let outside = || HostDirError::Outside {
            path: path.to_owned(),
            root: self.root.clone(),
        };
        let p = Path::new(path);
        let rel = if p.is_absolute() {
            p.strip_prefix(&self.root).map_err(|_| outside())?
        } else {
            p
        };
        let rel: PathBuf = rel
            .components()
            .filter(|c| !matches!(c, Component::CurDir))
            .collect();
        if rel.as_os_str().is_empty() {
            return Ok(PathBuf::from("."));
        }
        Ok(rel)
    }

    fn resolve_err(&self, path: &str, errno: Errno) -> HostDirError {
        match errno {
            // What RESOLVE_BENEATH answers for `..` out of the root, an absolute symlink or one
            // that climbs out.
            Errno::EXDEV => HostDirError::Outside {
                path: path.to_owned(),
                root: self.root.clone(),
            },
            Errno::ELOOP => HostDirError::Resolve {
                path: path.to_owned(),
                reason: "too many symlinks, or a /proc magic link (refused)".into(),
            },
            e => HostDirError::Resolve {
                path: path.to_owned(),
                reason: std::io::Error::from(e).to_string(),
            },
        }
    }

    fn openat(
        &self,
        dir: &OwnedFd,
        path: &str,
        rel: &Path,
        how: OpenHow,
    ) -> Result<OwnedFd, HostDirError> {
        let fd = loop {
            match openat2(dir.as_raw_fd(), rel, how) {
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                other => break other,
            }
        }
        .map_err(|e| self.resolve_err(path, e))?;
        // SAFETY: `openat2` just returned this descriptor and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Opens a regular file inside the directory for reading.
    pub fn open_file(&self, path: &str) -> Result<File, HostDirError> {
        let rel = self.relative(path)?;
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK)
            .resolve(RESOLVE);
        let fd = self.openat(&self.fd, path, &rel, how)?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| HostDirError::Resolve {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        if !meta.is_file() {
            return Err(HostDirError::NotAFile {
                path: path.to_owned(),
            });
        }
        Ok(file)
    }

    /// Starts writing the file `path` inside the directory: its parent must exist (inside the
    /// directory); the content goes to a temporary file beside it until [`PendingFile::commit`].
    pub fn create_file(&self, path: &str) -> Result<(File, PendingFile), HostDirError> {
        let rel = self.relative(path)?;
        let name = match rel.file_name().and_then(|n| n.to_str()) {
            Some(n)
                if rel
                    .components()
                    .next_back()
                    .is_some_and(|c| matches!(c, Component::Normal(_))) =>
            {
                n.to_owned()
            }
            _ => {
                return Err(HostDirError::Resolve {
                    path: path.to_owned(),
                    reason: "needs a file name at the end".into(),
                })
            }
        };
        let parent_rel = match rel.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let parent = self.openat(
            &self.fd,
            path,
            &parent_rel,
            OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
                .resolve(RESOLVE),
        )?;
        let temp = format!(".{name}.sbx-{:016x}", rand::random::<u64>());
        // O_EXCL on a fresh name in a directory we hold: nothing to follow, nothing to replace.
        let file = self.openat(
            &parent,
            path,
            Path::new(&temp),
            OpenHow::new()
                .flags(OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC)
                .mode(Mode::from_bits_truncate(0o644))
                .resolve(RESOLVE),
        )?;
        Ok((
            File::from(file),
            PendingFile {
                parent,
                temp,
                name,
                done: false,
            },
        ))
    }
}

impl PendingFile {
    /// Renames the written file over its target (a symlink there is replaced, not followed).
    pub fn commit(mut self) -> std::io::Result<()> {
        renameat(
            Some(self.parent.as_raw_fd()),
            self.temp.as_str(),
            Some(self.parent.as_raw_fd()),
            self.name.as_str(),
        )?;
        self.done = true;
        Ok(())
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.done {
            // Not committed: the copy failed, leave nothing behind.
            let _ = nix::unistd::unlinkat(
                Some(self.parent.as_raw_fd()),
                self.temp.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::symlink;

    fn setup() -> (tempfile::TempDir, HostDir) {
        let top = tempfile::tempdir().unwrap();
        std::fs::create_dir(top.path().join("allowed")).unwrap();
        std::fs::create_dir(top.path().join("allowed/sub")).unwrap();
        std::fs::write(top.path().join("secret"), "host secret").unwrap();
        std::fs::write(top.path().join("allowed/sub/ok.txt"), "fine").unwrap();
        let dir = HostDir::open(&top.path().join("allowed")).unwrap();
        (top, dir)
    }

    fn read(dir: &HostDir, path: &str) -> Result<String, HostDirError> {
        let mut s = String::new();
        dir.open_file(path)?.read_to_string(&mut s).unwrap();
        Ok(s)
    }

    #[test]
    fn paths_inside_are_read() {
        let (top, dir) = setup();
        assert_eq!(read(&dir, "sub/ok.txt").unwrap(), "fine");
        assert_eq!(read(&dir, "./sub/../sub/ok.txt").unwrap(), "fine");
        let abs = top.path().join("allowed/sub/ok.txt");
        assert_eq!(read(&dir, abs.to_str().unwrap()).unwrap(), "fine");
        assert!(matches!(
            dir.open_file("sub"),
            Err(HostDirError::NotAFile { .. })
        ));
    }

    #[test]
    fn dotdot_absolute_and_symlinks_out_are_refused() {
        let (top, dir) = setup();
        assert!(matches!(
            read(&dir, "../secret"),
            Err(HostDirError::Outside { .. })
        ));
        let abs = top.path().join("secret");
        assert!(matches!(
            read(&dir, abs.to_str().unwrap()),
            Err(HostDirError::Outside { .. })
        ));
        assert!(matches!(
            read(&dir, "/etc/passwd"),
            Err(HostDirError::Outside { .. })
        ));
        symlink(
            top.path().join("secret"),
            top.path().join("allowed/abs-link"),
        )
        .unwrap();
        symlink("../secret", top.path().join("allowed/rel-link")).unwrap();
        symlink("..", top.path().join("allowed/sub/up")).unwrap();
        assert!(read(&dir, "abs-link").is_err());
        assert!(read(&dir, "rel-link").is_err());
        assert!(
            read(&dir, "sub/up/sub/ok.txt").is_ok(),
            "a link that stays inside works"
        );
        assert!(read(&dir, "sub/up/../secret").is_err());
        // Writing through a symlinked directory that leads out is refused too.
        symlink(top.path(), top.path().join("allowed/out")).unwrap();
        assert!(dir.create_file("out/planted").is_err());
        assert!(!top.path().join("planted").exists());
        assert!(dir.create_file("../planted").is_err());
    }

    #[test]
    fn writes_land_whole_and_replace_symlinks_instead_of_following_them() {
        let (top, dir) = setup();
        symlink(top.path().join("secret"), top.path().join("allowed/target")).unwrap();
        let (mut f, pending) = dir.create_file("target").unwrap();
        f.write_all(b"new").unwrap();
        pending.commit().unwrap();
        assert_eq!(
            std::fs::read_to_string(top.path().join("secret")).unwrap(),
            "host secret"
        );
        assert_eq!(
            std::fs::read_to_string(top.path().join("allowed/target")).unwrap(),
            "new"
        );
        // Dropped without commit: no trace.
        let (mut f, pending) = dir.create_file("sub/half").unwrap();
        f.write_all(b"half").unwrap();
        drop(pending);
        let names: Vec<_> = std::fs::read_dir(top.path().join("allowed/sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ok.txt")]);
        assert!(dir.create_file("sub/missing/x").is_err());
        assert!(dir.create_file(".").is_err());
    }
}
