//! The files in a sandbox's `/etc` that say who it is: `/etc/hostname` holds the name `hostname`
//! prints, and `/etc/hosts` maps that name to `127.0.1.1` (the Debian convention for a host
//! without a fixed address) next to `localhost`, so `gethostbyname(gethostname())` works with no
//! network at all. Both are rewritten at every start of a sandbox: a fork or a rolled-back
//! sandbox starts from files that name another sandbox, or the image.
//!
//! The files are sandbox content, so the code that writes them treats them as hostile: `/etc`
//! is looked up confined to the sandbox's root and on the root's own filesystem (never into
//! `/proc`, `/dev` or `/sys`), and each file is replaced by a rename of a new file made with
//! `O_EXCL` — a symlink planted at `/etc/hosts` is replaced itself, never followed; a
//! FIFO or device there is never opened. The process tier's init calls this after
//! `pivot_root`, inside the sandbox's own mount namespace; the microVM guest agent on its root.

use std::ffi::CStr;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

use crate::sys::{create_temp_in, file_type, stat_at, unlink_at};

/// The address a sandbox's own name resolves to.
pub const SELF_ADDRESS: &str = "127.0.1.1";
/// Most bytes of an image's `/etc/hosts` that are kept; the rest is dropped.
pub const MAX_HOSTS_BYTES: usize = 64 << 10;

/// Why the identity files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum EtcError {
    #[error("{0:?} is not a valid hostname (1-64 of [A-Za-z0-9.-])")]
    BadHostname(String),
    #[error("{0:?} is not a machine id (32 lowercase hex digits)")]
    BadMachineId(String),
    #[error("{op} {path}: {errno}")]
    Sys { op: &'static str, path: &'static str, errno: Errno },
}

fn sys(op: &'static str, path: &'static str) -> impl FnOnce(Errno) -> EtcError {
    move |errno| EtcError::Sys { op, path, errno }
}

/// A name the kernel takes as a hostname and a resolver reads as one token of a hosts line.
fn valid_hostname(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// The new `/etc/hosts`: `old`'s lines kept, except the ones for [`SELF_ADDRESS`] (they name a
/// previous hostname), with `localhost` on `127.0.0.1` and `::1` when `old` does not map them,
/// and `hostname` on [`SELF_ADDRESS`].
pub fn hosts_content(old: &str, hostname: &str) -> String {
    let address_of = |line: &str| line.split('#').next().and_then(|l| l.split_whitespace().next().map(str::to_string));
    let names_localhost = |line: &str, addr: &str| {
        let mut fields = line.split('#').next().unwrap_or("").split_whitespace();
        fields.next() == Some(addr) && fields.any(|n| n == "localhost")
    };
    let kept: Vec<&str> = old.lines().filter(|l| address_of(l).as_deref() != Some(SELF_ADDRESS)).collect();
    let mut out = String::new();
    if !kept.iter().any(|l| names_localhost(l, "127.0.0.1")) {
        out.push_str("127.0.0.1\tlocalhost\n");
    }
    if !kept.iter().any(|l| names_localhost(l, "::1")) {
        out.push_str("::1\tlocalhost\n");
    }
    for line in kept {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(&format!("{SELF_ADDRESS}\t{hostname}\n"));
    out
}

/// `/etc` below `root`: confined to it (`RESOLVE_IN_ROOT`), never through a magic link and never
/// onto another filesystem (`RESOLVE_NO_XDEV`), so a sandbox that made `/etc` a link into
/// `/proc` or `/dev` gets an error, not a write there. Created (0755) when missing.
fn open_etc(root: RawFd) -> Result<OwnedFd, EtcError> {
    let open = || {
        // SAFETY: open_how is plain old data; zero is valid for every field.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS | libc::RESOLVE_NO_XDEV;
        loop {
            // SAFETY: openat2 with a valid dirfd, a NUL-terminated path and an open_how of the
            // size we pass.
            let fd = unsafe { libc::syscall(libc::SYS_openat2, root, c"etc".as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>()) };
            match Errno::result(fd) {
                // SAFETY: the kernel returned a fresh descriptor that we now own.
                Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }),
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    };
    match open() {
        Err(Errno::ENOENT) => {
            // SAFETY: mkdirat with the root fd and a NUL-terminated single-component name.
            match Errno::result(unsafe { libc::mkdirat(root, c"etc".as_ptr(), 0o755) }) {
                Ok(_) | Err(Errno::EEXIST) => open().map_err(sys("open", "/etc")),
                Err(e) => Err(sys("mkdir", "/etc")(e)),
            }
        }
        other => other.map_err(sys("open", "/etc")),
    }
}

/// What `/etc/<name>` holds now, when it is a regular file (at most [`MAX_HOSTS_BYTES`]);
/// empty for anything else (a symlink is not followed, a FIFO or device never opened).
fn read_regular(etc: RawFd, name: &CStr) -> String {
    match stat_at(etc, name) {
        Ok(Some(st)) if file_type(&st) == libc::S_IFREG => {}
        _ => return String::new(),
    }
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: openat on a directory fd with a NUL-terminated single-component name.
    let Ok(fd) = Errno::result(unsafe { libc::openat(etc, name.as_ptr(), flags) }) else { return String::new() };
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut bytes = Vec::new();
    // Swapped for something else between the stat and the open: the descriptor says.
    if file.metadata().map(|m| m.is_file()).unwrap_or(false) {
        let _ = file.take(MAX_HOSTS_BYTES as u64).read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Replaces `/etc/<name>` with `content` (mode 0644): a new file made with `O_EXCL` beside it,
/// renamed over whatever has the name. Not synced: the file is written again at every start.
fn replace(etc: RawFd, name: &'static CStr, path: &'static str, content: &str) -> Result<(), EtcError> {
    let mut temp = create_temp_in(etc).map_err(sys("create a file beside", path))?;
    let written = temp
        .file
        .write_all(content.as_bytes())
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
        // SAFETY: fchmod on a descriptor we own.
        .and_then(|()| Errno::result(unsafe { libc::fchmod(temp.file.as_raw_fd(), 0o644) }).map(drop))
        // SAFETY: renameat between two single-component names in the same directory fd.
        .and_then(|()| Errno::result(unsafe { libc::renameat(etc, temp.name.as_ptr(), etc, name.as_ptr()) }).map(drop));
    if let Err(e) = written {
        let _ = unlink_at(etc, &temp.name);
        return Err(sys("replace", path)(e));
    }
    Ok(())
}

/// Writes `/etc/hostname` and `/etc/hosts` below `root` for `hostname` (see the module
/// documentation).
pub fn write_identity(root: RawFd, hostname: &str) -> Result<(), EtcError> {
    if !valid_hostname(hostname) {
        return Err(EtcError::BadHostname(hostname.chars().take(80).collect()));
    }
    let etc = open_etc(root)?;
    replace(etc.as_raw_fd(), c"hostname", "/etc/hostname", &format!("{hostname}\n"))?;
    let old = read_regular(etc.as_raw_fd(), c"hosts");
    replace(etc.as_raw_fd(), c"hosts", "/etc/hosts", &hosts_content(&old, hostname))
}

/// Writes `/etc/resolv.conf` below `root` naming `nameserver` only: the host's egress filter,
/// whose DNS answers what the sandbox's network policy allows. Replaced like the identity files
/// (a link planted there is replaced, never followed).
pub fn write_resolv_conf(root: RawFd, nameserver: std::net::Ipv4Addr) -> Result<(), EtcError> {
    let etc = open_etc(root)?;
    let text = format!("# written by sandboxd: the daemon's DNS answers only what the network policy allows\nnameserver {nameserver}\n");
    replace(etc.as_raw_fd(), c"resolv.conf", "/etc/resolv.conf", &text)
}

/// Writes `/etc/machine-id` below `root`: `id`, 32 lowercase hex digits, as systemd and D-Bus
/// read it. Replaced like the identity files.
pub fn write_machine_id(root: RawFd, id: &str) -> Result<(), EtcError> {
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(EtcError::BadMachineId(id.chars().take(40).collect()));
    }
    let etc = open_etc(root)?;
    replace(etc.as_raw_fd(), c"machine-id", "/etc/machine-id", &format!("{id}\n"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    #[test]
    fn hosts_keep_the_image_lines_and_name_the_sandbox_once() {
        let debian = "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\t\tlocalhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\n";
        let new = hosts_content(debian, "sb-1");
        assert_eq!(new, "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\n127.0.1.1\tsb-1\n");
        // A fork rewrites its parent's line; nothing doubles up.
        assert_eq!(hosts_content(&new, "sb-2"), new.replace("sb-1", "sb-2"));
        // An empty or odd file still gets localhost on both families.
        assert_eq!(hosts_content("", "x"), "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tx\n");
        let odd = "# comment 127.0.1.1\n10.0.0.1 db  # 127.0.0.1 localhost\n  127.0.1.1  old # indented\n";
        assert_eq!(hosts_content(odd, "x"), "127.0.0.1\tlocalhost\n::1\tlocalhost\n# comment 127.0.1.1\n10.0.0.1 db  # 127.0.0.1 localhost\n127.0.1.1\tx\n");
    }

    #[test]
    fn hostnames_are_checked() {
        assert!(valid_hostname("sb-0123abcd"));
        for bad in ["", "a b", "a\nb", "a\t127.0.0.1", &"x".repeat(65)] {
            assert!(!valid_hostname(bad), "{bad:?}");
        }
    }

    fn root() -> (tempfile::TempDir, std::fs::File) {
        let dir = tempfile::tempdir().expect("tempdir");
        let fd = std::fs::File::open(dir.path()).expect("open root");
        (dir, fd)
    }

    #[test]
    fn files_are_written_and_rewritten() {
        let (dir, fd) = root();
        std::fs::create_dir(dir.path().join("etc")).expect("etc");
        std::fs::write(dir.path().join("etc/hosts"), "127.0.0.1 localhost\n10.1.1.1 kept\n").expect("hosts");
        write_identity(fd.as_raw_fd(), "sb-1").expect("write");
        assert_eq!(std::fs::read_to_string(dir.path().join("etc/hostname")).expect("hostname"), "sb-1\n");
        let hosts = std::fs::read_to_string(dir.path().join("etc/hosts")).expect("hosts");
        assert_eq!(hosts, "::1\tlocalhost\n127.0.0.1 localhost\n10.1.1.1 kept\n127.0.1.1\tsb-1\n");
        assert_eq!(std::fs::metadata(dir.path().join("etc/hosts")).expect("meta").permissions().mode() & 0o777, 0o644);
        write_identity(fd.as_raw_fd(), "sb-2").expect("again");
        assert!(std::fs::read_to_string(dir.path().join("etc/hosts")).expect("hosts").ends_with("10.1.1.1 kept\n127.0.1.1\tsb-2\n"));
        // Nothing left behind but the two files.
        assert_eq!(std::fs::read_dir(dir.path().join("etc")).expect("ls").count(), 2);
        assert!(write_identity(fd.as_raw_fd(), "bad name").is_err());
    }

    #[test]
    fn machine_ids_are_checked_and_written() {
        let (dir, fd) = root();
        std::fs::create_dir(dir.path().join("etc")).expect("etc");
        write_machine_id(fd.as_raw_fd(), "0123456789abcdef0123456789abcdef").expect("write");
        assert_eq!(std::fs::read_to_string(dir.path().join("etc/machine-id")).expect("read"), "0123456789abcdef0123456789abcdef\n");
        for bad in ["", "0123", "0123456789ABCDEF0123456789ABCDEF", "0123456789abcdef0123456789abcdeg", "0123456789abcdef0123456789abcdef\n"] {
            assert!(matches!(write_machine_id(fd.as_raw_fd(), bad), Err(EtcError::BadMachineId(_))), "{bad:?}");
        }
    }

    #[test]
    fn resolv_conf_names_only_the_gateway_and_replaces_a_planted_link() {
        let (dir, fd) = root();
        let outside = tempfile::tempdir().expect("outside");
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "host file\n").expect("victim");
        std::fs::create_dir(dir.path().join("etc")).expect("etc");
        symlink(&victim, dir.path().join("etc/resolv.conf")).expect("link");
        write_resolv_conf(fd.as_raw_fd(), std::net::Ipv4Addr::new(100, 96, 0, 1)).expect("write");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "host file\n", "the link's target was written");
        let conf = std::fs::read_to_string(dir.path().join("etc/resolv.conf")).expect("resolv.conf");
        assert_eq!(conf.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>(), ["nameserver 100.96.0.1"]);
    }

    #[test]
    fn planted_links_are_replaced_never_followed() {
        let (dir, fd) = root();
        let outside = tempfile::tempdir().expect("outside");
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "host file\n").expect("victim");
        std::fs::create_dir(dir.path().join("etc")).expect("etc");
        symlink(&victim, dir.path().join("etc/hosts")).expect("link");
        symlink(&victim, dir.path().join("etc/hostname")).expect("link");
        write_identity(fd.as_raw_fd(), "sb-1").expect("write");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "host file\n", "the link's target was written");
        assert!(std::fs::symlink_metadata(dir.path().join("etc/hosts")).expect("meta").is_file());
        assert_eq!(std::fs::read_to_string(dir.path().join("etc/hosts")).expect("hosts"), "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tsb-1\n");
        // `/etc` itself a link out of the root: it resolves inside the root (here: missing).
        let (dir2, fd2) = root();
        symlink(outside.path(), dir2.path().join("etc")).expect("etc link");
        let _ = write_identity(fd2.as_raw_fd(), "sb-2");
        assert_eq!(std::fs::read_dir(outside.path()).expect("ls").count(), 1, "nothing was written outside the root");
        // A FIFO at /etc/hosts is never opened (that would block); it is replaced.
        let (dir3, fd3) = root();
        std::fs::create_dir(dir3.path().join("etc")).expect("etc");
        nix::unistd::mkfifo(&dir3.path().join("etc/hosts"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("fifo");
        write_identity(fd3.as_raw_fd(), "sb-3").expect("write over a fifo");
        assert!(std::fs::symlink_metadata(dir3.path().join("etc/hosts")).expect("meta").is_file());
    }

    #[test]
    fn a_missing_etc_is_made() {
        let (dir, fd) = root();
        write_identity(fd.as_raw_fd(), "sb-1").expect("write");
        assert_eq!(std::fs::read_to_string(dir.path().join("etc/hostname")).expect("hostname"), "sb-1\n");
    }
}
