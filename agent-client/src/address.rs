//! Where `sandboxd` listens: a UNIX socket or an HTTP/2 (plaintext) TCP endpoint.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// A parsed daemon address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A UNIX domain socket, always an absolute path.
    Unix(PathBuf),
    /// A TCP endpoint as an `http://host:port` URI.
    Http(String),
    /// A TCP endpoint served with TLS, as an `https://host:port` URI: the server's certificate
    /// is checked against the system's roots, plus the CA in `$SBX_CA_CERT` (a PEM file) when set.
    Https(String),
}

impl Address {
    /// Parses an address, resolving a relative socket path against the current directory.
    ///
    /// Accepted forms: `unix:///abs/path.sock`, `unix://./rel/path.sock` (also `unix:PATH`), a
    /// bare path starting with `/`, `./` or `../` (a UNIX socket), `tcp://host:port` and
    /// `http://host:port`.
    pub fn parse(addr: &str) -> Result<Self> {
        Self::parse_with(addr, std::env::current_dir)
    }

    /// Like [`Address::parse`], resolving relative socket paths against `cwd`.
    pub fn parse_in(addr: &str, cwd: &Path) -> Result<Self> {
        Self::parse_with(addr, || Ok(cwd.to_path_buf()))
    }

    fn parse_with(addr: &str, cwd: impl FnOnce() -> std::io::Result<PathBuf>) -> Result<Self> {
        let invalid = |reason: &str| Error::InvalidAddress {
            addr: addr.to_owned(),
            reason: reason.to_owned(),
        };
        let unix_path = if let Some(rest) = addr.strip_prefix("unix://") {
            Some(rest)
        } else if let Some(rest) = addr.strip_prefix("unix:") {
            Some(rest)
        } else if addr.starts_with('/') || addr.starts_with("./") || addr.starts_with("../") {
            Some(addr)
        } else {
            None
        };
        if let Some(path) = unix_path {
            if path.is_empty() {
                return Err(invalid("empty socket path"));
            }
            let path = Path::new(path);
            if path.is_absolute() {
                return Ok(Address::Unix(normalize(path)));
            }
            // Resolved now rather than at connect time: the channel may reconnect later, after
            // the caller changed directory.
            let cwd = cwd().map_err(|source| Error::CurrentDir {
                path: addr.to_owned(),
                source,
            })?;
            return Ok(Address::Unix(normalize(&cwd.join(path))));
        }
        let (authority, tls) = if let Some(rest) = addr.strip_prefix("tcp://") {
            (rest, false)
        } else if let Some(rest) = addr.strip_prefix("http://") {
            (rest, false)
        } else if let Some(rest) = addr.strip_prefix("https://") {
            (rest, true)
        } else {
            return Err(invalid(
                "expected unix:///path.sock, an absolute socket path, tcp://host:port or http://host:port",
            ));
        };
        let authority = authority.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(invalid("expected host:port after the scheme"));
        }
        Ok(if tls {
            Address::Https(format!("https://{authority}"))
        } else {
            Address::Http(format!("http://{authority}"))
        })
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix://{}", path.display()),
            Address::Http(uri) | Address::Https(uri) => f.write_str(uri),
        }
    }
}

/// Drops `.` components; `..` is kept, since resolving it lexically can be wrong across symlinks.
fn normalize(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(addr: &str) -> Result<Address> {
        Address::parse_in(addr, Path::new("/home/me/proj"))
    }

    #[test]
    fn unix_forms() {
        let want = Address::Unix("/run/sandboxd.sock".into());
        assert_eq!(parse("unix:///run/sandboxd.sock").ok(), Some(want.clone()));
        assert_eq!(parse("unix:/run/sandboxd.sock").ok(), Some(want.clone()));
        assert_eq!(parse("/run/sandboxd.sock").ok(), Some(want));
    }

    #[test]
    fn relative_unix_paths_resolve_against_cwd() {
        let want = Address::Unix("/home/me/proj/.sandboxd/sandboxd.sock".into());
        assert_eq!(parse(crate::DEFAULT_SOCKET).ok(), Some(want.clone()));
        assert_eq!(parse("./.sandboxd/sandboxd.sock").ok(), Some(want));
        assert_eq!(
            parse("unix://../x.sock").ok(),
            Some(Address::Unix("/home/me/proj/../x.sock".into()))
        );
    }

    #[test]
    fn tcp_forms() {
        let want = Address::Http("http://127.0.0.1:50051".into());
        assert_eq!(parse("tcp://127.0.0.1:50051").ok(), Some(want.clone()));
        assert_eq!(parse("http://127.0.0.1:50051/").ok(), Some(want));
    }

    #[test]
    fn https_is_tls() {
        assert_eq!(
            parse("https://node-a.example:7070/").ok(),
            Some(Address::Https("https://node-a.example:7070".into()))
        );
    }

    #[test]
    fn rejects_unknown_forms() {
        for bad in [
            "",
            "unix://",
            "localhost:50051",
            "https://",
            "https://h:1/x",
            "tcp://",
            "http://h:1/x",
            "sock",
        ] {
            assert!(
                matches!(parse(bad), Err(Error::InvalidAddress { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn displays_as_uri() {
        assert_eq!(
            Address::Unix("/a.sock".into()).to_string(),
            "unix:///a.sock"
        );
    }
}
