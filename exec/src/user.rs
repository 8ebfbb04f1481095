//! The user an exec runs as: `USER` of an image, or `ExecRequest.user`, resolved the way Docker
//! resolves it — inside the sandbox, against the sandbox's own `/etc/passwd` and `/etc/group`.
//!
//! Forms: `name`, `uid`, `name:group`, `uid:gid` (and mixes). A name must be in the files; a
//! number need not be (a uid without a passwd line runs with gid 0, as in Docker). Supplementary
//! groups are the groups listing the user by name in `/etc/group`, plus its primary group.
//!
//! Both files are written by the sandbox's own code, so they are read bounded ([`MAX_FILE_BYTES`],
//! [`MAX_GROUPS`]) and parsed leniently: a malformed line is skipped, never trusted. Resolution
//! happens in the runtime that starts the command (the process tier's init, the container tier's
//! exec helper, the guest agent), each already inside the sandbox's root, so the paths are the
//! sandbox's and never the host's.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Longest user specification accepted.
pub const MAX_SPEC_BYTES: usize = 256;
/// How much of `/etc/passwd` or `/etc/group` is read.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Most supplementary groups set (the kernel's NGROUPS_MAX is 65536; nothing needs that many).
pub const MAX_GROUPS: usize = 256;

/// Numeric credentials a command runs with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary one included).
    pub groups: Vec<u32>,
    /// The user's home directory from `/etc/passwd` (`/` for a uid without a line, as in
    /// Docker): the command's `HOME` unless its env sets one.
    #[serde(default = "root_dir")]
    pub home: String,
}

fn root_dir() -> String {
    "/".to_string()
}

/// Why a user specification does not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    #[error("user {0:?} is malformed: expected name, uid, name:group or uid:gid")]
    Malformed(String),
    #[error("no user {0:?} in the sandbox's /etc/passwd")]
    NoSuchUser(String),
    #[error("no group {0:?} in the sandbox's /etc/group")]
    NoSuchGroup(String),
}

impl UserError {
    /// The errno a runtime reports this as (the sentence is rebuilt from the request).
    pub fn errno(&self) -> nix::errno::Errno {
        match self {
            UserError::Malformed(_) => nix::errno::Errno::EINVAL,
            UserError::NoSuchUser(_) | UserError::NoSuchGroup(_) => nix::errno::Errno::ENOENT,
        }
    }
}

/// Whether `spec` is a user specification worth resolving (the daemon checks this at the API).
pub fn is_valid_spec(spec: &str) -> bool {
    let part_ok = |p: &str| !p.is_empty() && p.len() <= 64 && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) && !p.starts_with('-');
    spec.len() <= MAX_SPEC_BYTES
        && match spec.split_once(':') {
            Some((u, g)) => part_ok(u) && part_ok(g),
            None => part_ok(spec),
        }
}

/// Resolves `spec` against `<etc>/passwd` and `<etc>/group` (`etc` is `/etc` in a runtime).
pub fn resolve(spec: &str, etc: &Path) -> Result<Credentials, UserError> {
    if !is_valid_spec(spec) {
        return Err(UserError::Malformed(spec.chars().take(80).collect()));
    }
    let passwd = read_bounded(&etc.join("passwd"));
    let group = read_bounded(&etc.join("group"));
    resolve_in(spec, &passwd, &group)
}

/// [`resolve`] over the files' contents.
pub fn resolve_in(spec: &str, passwd: &str, group: &str) -> Result<Credentials, UserError> {
    let (user, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    // A name that is a number is still a name first (Docker does the same).
    let entry = match (passwd_lines(passwd).find(|e| e.name == user), user.parse::<u32>()) {
        (Some(e), _) => Some(e),
        (None, Ok(uid)) => passwd_lines(passwd).find(|e| e.uid == uid),
        (None, Err(_)) => return Err(UserError::NoSuchUser(user.to_string())),
    };
    let (uid, primary, name, home) = match entry {
        Some(e) => (e.uid, e.gid, Some(e.name), e.home),
        // Only a number gets here without a line.
        None => (user.parse::<u32>().map_err(|_| UserError::NoSuchUser(user.to_string()))?, 0, None, "/"),
    };
    let gid = match group_part {
        None => primary,
        Some(g) => match group_lines(group).find(|e| e.name == g) {
            Some(e) => e.gid,
            None => g.parse::<u32>().map_err(|_| UserError::NoSuchGroup(g.to_string()))?,
        },
    };
    let mut groups = vec![gid];
    if let Some(name) = name {
        for e in group_lines(group).filter(|e| e.members.split(',').any(|m| m == name)) {
            if groups.len() >= MAX_GROUPS {
                break;
            }
            if !groups.contains(&e.gid) {
                groups.push(e.gid);
            }
        }
    }
    // Written by the sandbox: an absolute path of sane length, or `/`.
    let home = if home.starts_with('/') && home.len() <= 4096 { home } else { "/" };
    Ok(Credentials { uid, gid, groups, home: home.to_string() })
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

struct GroupEntry<'a> {
    name: &'a str,
    gid: u32,
    members: &'a str,
}

fn passwd_lines(text: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    text.lines().filter_map(|line| {
        let mut f = line.split(':');
        let name = f.next()?;
        let _password = f.next()?;
        let uid = f.next()?.parse().ok()?;
        let gid = f.next()?.parse().ok()?;
        let _gecos = f.next();
        let home = f.next().unwrap_or("/");
        (!name.is_empty()).then_some(PasswdEntry { name, uid, gid, home })
    })
}

fn group_lines(text: &str) -> impl Iterator<Item = GroupEntry<'_>> {
    text.lines().filter_map(|line| {
        let mut f = line.split(':');
        let name = f.next()?;
        let _password = f.next()?;
        let gid = f.next()?.parse().ok()?;
        let members = f.next().unwrap_or("");
        (!name.is_empty()).then_some(GroupEntry { name, gid, members })
    })
}

/// The file's first [`MAX_FILE_BYTES`], lossily decoded; empty when it cannot be read (an image
/// without `/etc/group` still runs numeric users) or is not a regular file: the sandbox may have
/// made it a FIFO, a device or a link to one, which must not block, flood or be opened by the
/// runtime that reads it. The name is looked up with `O_PATH` (links followed, as Docker does,
/// inside the sandbox's own root; nothing is opened), then only a regular file is reopened for
/// reading ([`crate::sys::reopen_regular_for_reading`]).
fn read_bounded(path: &Path) -> String {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return String::new() };
    // SAFETY: open with a NUL-terminated path; O_PATH opens nothing but the name.
    let Ok(fd) = nix::errno::Errno::result(unsafe { libc::open(c_path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) }) else { return String::new() };
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    let path_fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut bytes = Vec::new();
    if let Ok((file, _)) = crate::sys::reopen_regular_for_reading(path_fd.as_raw_fd()) {
        let _ = file.take(MAX_FILE_BYTES).read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\napp:x:1000:1000::/home/app:/bin/sh\nbroken line\n1234:x:1500:1500::/:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nadm:x:4:app,other\napp:x:1000:\ndocker:x:999:app\nstaff:x:50:\nnogid:x:notanumber:app\n";

    fn creds(uid: u32, gid: u32, groups: &[u32]) -> Credentials {
        let home = match uid {
            0 => "/root",
            65534 => "/nonexistent",
            1000 => "/home/app",
            _ => "/",
        };
        Credentials { uid, gid, groups: groups.to_vec(), home: home.to_string() }
    }

    #[test]
    fn names_and_numbers_resolve_like_docker() {
        assert_eq!(resolve_in("app", PASSWD, GROUP), Ok(creds(1000, 1000, &[1000, 4, 999])));
        assert_eq!(resolve_in("1000", PASSWD, GROUP), Ok(creds(1000, 1000, &[1000, 4, 999])), "a known uid gets its entry's groups");
        assert_eq!(resolve_in("4242", PASSWD, GROUP), Ok(creds(4242, 0, &[0])), "an unknown uid runs with gid 0");
        assert_eq!(resolve_in("app:staff", PASSWD, GROUP), Ok(creds(1000, 50, &[50, 4, 999])));
        assert_eq!(resolve_in("app:77", PASSWD, GROUP), Ok(creds(1000, 77, &[77, 4, 999])));
        assert_eq!(resolve_in("0:0", PASSWD, GROUP), Ok(creds(0, 0, &[0])));
        assert_eq!(resolve_in("1234", PASSWD, GROUP), Ok(creds(1500, 1500, &[1500])), "a numeric name is a name first");
        let home = |passwd: &str| resolve_in("w", passwd, "").map(|c| c.home);
        assert_eq!(home("w:x:7:7::relative:/bin/sh\n"), Ok("/".into()), "a home that is not absolute");
        assert_eq!(home("w:x:7:7\n"), Ok("/".into()), "a line without a home");
        assert_eq!(home("w:x:7:7:W:/srv/w:/bin/sh\n"), Ok("/srv/w".into()));
    }

    #[test]
    fn unknown_or_malformed_users_are_errors_naming_them() {
        assert_eq!(resolve_in("ghost", PASSWD, GROUP), Err(UserError::NoSuchUser("ghost".into())));
        assert_eq!(resolve_in("app:ghosts", PASSWD, GROUP), Err(UserError::NoSuchGroup("ghosts".into())));
        for bad in ["", ":", "a:", ":b", "a:b:c", "-rf", "a b", "../etc", &"x".repeat(300)] {
            assert!(!is_valid_spec(bad), "{bad:?}");
            assert!(matches!(resolve(bad, Path::new("/nonexistent")), Err(UserError::Malformed(_))), "{bad:?}");
        }
        assert_eq!(resolve("7", Path::new("/nonexistent")), Ok(creds(7, 0, &[0])), "no files: numbers still work");
    }

    #[test]
    fn files_the_sandbox_made_odd_are_not_read() {
        let etc = tempfile::tempdir().expect("tempdir");
        nix::unistd::mkfifo(&etc.path().join("passwd"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
        std::fs::write(etc.path().join("group"), GROUP).expect("group");
        // A FIFO nobody writes would block a plain read forever.
        assert_eq!(resolve("app", etc.path()), Err(UserError::NoSuchUser("app".into())));
        assert_eq!(resolve("5:docker", etc.path()), Ok(creds(5, 999, &[999])));
        // A link to a device is never opened (an endless /dev/zero, or one whose open acts);
        // a link to a regular file is followed, as Docker does.
        std::fs::remove_file(etc.path().join("passwd")).expect("rm");
        std::os::unix::fs::symlink("/dev/zero", etc.path().join("passwd")).expect("symlink");
        assert_eq!(resolve("app", etc.path()), Err(UserError::NoSuchUser("app".into())));
        std::fs::remove_file(etc.path().join("passwd")).expect("rm");
        std::fs::write(etc.path().join("real-passwd"), PASSWD).expect("passwd");
        std::os::unix::fs::symlink("real-passwd", etc.path().join("passwd")).expect("symlink");
        assert_eq!(resolve("app", etc.path()).map(|c| c.uid), Ok(1000));
    }
}
