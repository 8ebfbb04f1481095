//! The container tier's exec channel: how the daemon asks the exec helper serving as a
//! container's keepalive (`sandbox-exec --serve`) to start a command, and what comes back.
//!
//! The helper makes a `SOCK_SEQPACKET` socket pair at start and parks the daemon's end on
//! [`CHANNEL_FD`]; the daemon takes it from there with `pidfd_getfd` (the helper is not
//! dumpable, so nothing in the container can), says [`HELLO`], and the helper closes its copy.
//! No path in the container's filesystem leads to the channel.
//!
//! Each request is one message: the fields below, NUL-separated, with the descriptors in
//! `SCM_RIGHTS` in this order: the reply socket, stdout, stderr, and stdin when
//! [`Request::stdin`] is set. Over the reply socket (one per exec, made by the daemon) the
//! forked child says [`READY`] — the daemon reads its host pid from the `SCM_CREDENTIALS` the
//! kernel attaches, not from anything the container says — and waits for [`GO`], which the
//! daemon sends once the child sits in the exec's cgroup. A helper that cannot fork says
//! [`FORK_FAILED`] followed by the errno in decimal.

/// Where the helper parks the daemon's end of the channel until the daemon has taken it.
pub const CHANNEL_FD: i32 = 3;
/// The daemon's first message; the helper answers it with the same bytes.
pub const HELLO: &[u8] = b"sandboxd-exec-channel-1";
/// First bytes of every request (a version).
const REQUEST_MAGIC: &str = "X1";
/// The child's first message on the reply socket.
pub const READY: &[u8] = b"R";
/// The daemon's answer once the child is in its cgroup.
pub const GO: &[u8] = b"G";
/// The helper's answer when the fork failed.
pub const FORK_FAILED: u8 = b'F';
/// The largest request: a message must fit in the socket's send buffer, which the daemon
/// raises to this. Bigger commands go through Docker's exec API.
pub const MAX_REQUEST_BYTES: usize = 192 << 10;
/// Descriptors a request carries at most.
pub const MAX_FDS: usize = 4;

/// One command to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `sandboxd-<exec id>`, for `ps` and logs.
    pub tag: String,
    pub workdir: String,
    /// Empty for root (the container's own user); else resolved in the container's /etc.
    pub user: String,
    /// Drop the inherited `HOME`, so the user's home from /etc/passwd applies.
    pub home_from_passwd: bool,
    /// Whether a stdin descriptor is attached (else the child reads /dev/null, as under
    /// `docker exec` without `-i`).
    pub stdin: bool,
    pub argv: Vec<String>,
    /// `KEY=value`, layered over the helper's own environment (the container's).
    pub env: Vec<String>,
}

/// Why a request could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("not an exec request")]
    Magic,
    #[error("request truncated")]
    Truncated,
    #[error("request field is not UTF-8")]
    Utf8,
    #[error("request has no command")]
    NoArgv,
    #[error("request field contains a NUL byte")]
    Nul,
    #[error("request is {0} bytes, over {MAX_REQUEST_BYTES}")]
    TooBig(usize),
}

impl Request {
    /// The message bytes.
    pub fn encode(&self) -> Result<Vec<u8>, RequestError> {
        let fixed = [REQUEST_MAGIC, &self.tag, &self.workdir, &self.user, if self.home_from_passwd { "1" } else { "0" }, if self.stdin { "1" } else { "0" }];
        let argc = self.argv.len().to_string();
        let fields =
            fixed.into_iter().chain(std::iter::once(argc.as_str())).chain(self.argv.iter().map(String::as_str)).chain(self.env.iter().map(String::as_str));
        let mut out = Vec::new();
        for f in fields {
            if f.as_bytes().contains(&0) {
                return Err(RequestError::Nul);
            }
            out.extend_from_slice(f.as_bytes());
            out.push(0);
        }
        if out.len() > MAX_REQUEST_BYTES {
            return Err(RequestError::TooBig(out.len()));
        }
        Ok(out)
    }

    /// Parses one message.
    pub fn decode(bytes: &[u8]) -> Result<Request, RequestError> {
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(RequestError::TooBig(bytes.len()));
        }
        let body = bytes.strip_suffix(&[0]).ok_or(RequestError::Truncated)?;
        let mut fields = body.split(|&b| b == 0).map(|f| std::str::from_utf8(f).map_err(|_| RequestError::Utf8));
        let mut next = || fields.next().ok_or(RequestError::Truncated)?;
        if next()? != REQUEST_MAGIC {
            return Err(RequestError::Magic);
        }
        let (tag, workdir, user) = (next()?.to_string(), next()?.to_string(), next()?.to_string());
        let home_from_passwd = next()? == "1";
        let stdin = next()? == "1";
        let argc: usize = next()?.parse().map_err(|_| RequestError::Truncated)?;
        if argc == 0 {
            return Err(RequestError::NoArgv);
        }
        let mut argv = Vec::with_capacity(argc.min(4096));
        for _ in 0..argc {
            argv.push(next()?.to_string());
        }
        let mut env = Vec::new();
        for f in fields {
            env.push(f?.to_string());
        }
        Ok(Request { tag, workdir, user, home_from_passwd, stdin, argv, env })
    }
}

/// The command's environment: `base` (the helper's own, which is what runc gives a `docker exec`
/// before the exec's variables) with `overrides` replacing or adding by name, and `HOME` taken
/// out when it is to come from /etc/passwd.
pub fn merge_env(base: Vec<(String, String)>, overrides: &[String], home_from_passwd: bool) -> Vec<(String, String)> {
    let mut env = base;
    for kv in overrides {
        let (k, v) = kv.split_once('=').unwrap_or((kv.as_str(), ""));
        match env.iter_mut().find(|(name, _)| name == k) {
            Some(slot) => slot.1 = v.to_string(),
            None => env.push((k.to_string(), v.to_string())),
        }
    }
    if home_from_passwd {
        env.retain(|(k, _)| k != "HOME");
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Request {
        Request {
            tag: "sandboxd-e1".into(),
            workdir: "/workspace".into(),
            user: "".into(),
            home_from_passwd: false,
            stdin: true,
            argv: vec!["sh".into(), "-c".into(), "".into()],
            env: vec!["A=1".into(), "EMPTY=".into()],
        }
    }

    #[test]
    fn requests_round_trip_with_empty_fields() {
        let r = sample();
        assert_eq!(Request::decode(&r.encode().expect("encode")), Ok(r));
        let mut no_env = sample();
        no_env.env.clear();
        assert_eq!(Request::decode(&no_env.encode().expect("encode")), Ok(no_env));
    }

    #[test]
    fn hostile_or_broken_messages_are_refused() {
        let good = sample().encode().expect("encode");
        assert_eq!(Request::decode(&good[..good.len() - 1]), Err(RequestError::Truncated));
        assert_eq!(Request::decode(b"Y1\0"), Err(RequestError::Magic));
        assert_eq!(Request::decode(b"X1\0t\0/\0\x000\x000\x0099\0a\0"), Err(RequestError::Truncated));
        assert_eq!(Request::decode(b"X1\0t\0/\0\x000\x000\x000\0"), Err(RequestError::NoArgv));
        assert_eq!(Request::decode(b"X1\0\xff\0"), Err(RequestError::Utf8));
        assert!(matches!(Request::decode(&vec![b'a'; MAX_REQUEST_BYTES + 1]), Err(RequestError::TooBig(_))));
        let mut nul = sample();
        nul.argv[0] = "a\0b".into();
        assert_eq!(nul.encode(), Err(RequestError::Nul));
    }

    #[test]
    fn env_overrides_replace_by_name_and_home_can_be_dropped() {
        let base = vec![("PATH".to_string(), "/bin".to_string()), ("HOME".to_string(), "/root".to_string())];
        let env = merge_env(base.clone(), &["PATH=/x".into(), "NEW=a=b".into()], false);
        assert_eq!(env, vec![("PATH".into(), "/x".into()), ("HOME".into(), "/root".into()), ("NEW".into(), "a=b".into())]);
        let env = merge_env(base, &[], true);
        assert_eq!(env, vec![("PATH".into(), "/bin".into())]);
    }
}
