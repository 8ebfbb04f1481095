//! Who is calling: UNIX-socket peers by their kernel-verified credentials (SO_PEERCRED), TCP
//! callers by a bearer token from the config (stored as SHA-256, compared as hashes). The answer
//! is a tenant name; a tenant only ever sees its own sandboxes, snapshots and execs.
//!
//! The check runs twice on every SandboxService call, and costs a lookup or one SHA-256 each
//! time: in the server's gate layer, before the call's body is read or any admission permit is
//! taken ([`Auth::tenant_of_parts`]), and in the handler, which needs the tenant. UNIX peers are
//! also checked once when they connect ([`Auth::unix_peer_allowed`]), so that a connection the
//! kernel vouches for starts authenticated.
//!
//! In a fleet, a node that forwards a call presents the fleet token (`[fleet] token_file`) and
//! names the caller's tenant in [`FORWARDED_TENANT`]; that header is believed only next to the
//! fleet token, and ignored on any other call.

use std::collections::HashMap;

use sha2::{Digest, Sha256};
use tokio::net::unix::UCred;
use tonic::{Request, Status};

use crate::config::AuthConfig;
use crate::connections::{Peer, Transport};

/// Authenticates requests.
pub struct Auth {
    allowed_uids: Vec<u32>,
    allowed_gids: Vec<u32>,
    unix_tenant: String,
    /// SHA-256 of each token → tenant.
    tokens: HashMap<[u8; 32], String>,
    /// SHA-256 of the fleet token, when this daemon is a fleet's node.
    fleet: Option<[u8; 32]>,
}

/// The header in which a forwarding fleet node names the tenant it authenticated.
pub const FORWARDED_TENANT: &str = "x-sandboxd-tenant";
/// Longest tenant name a forwarded call may carry.
const MAX_TENANT_BYTES: usize = 256;

fn parse_hex(hex: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Auth {
    /// From the `[auth]` table (validated by the config loader).
    pub fn new(cfg: &AuthConfig) -> Self {
        let tokens = cfg.tokens.iter().filter_map(|t| parse_hex(&t.sha256).map(|h| (h, t.tenant.clone()))).collect();
        let mut allowed_uids = cfg.unix_allowed_uids.clone();
        // Root, and whoever runs the daemon, may always use its socket.
        allowed_uids.extend([0, nix::unistd::geteuid().as_raw()]);
        Auth { allowed_uids, allowed_gids: cfg.unix_allowed_gids.clone(), unix_tenant: cfg.unix_tenant.clone(), tokens, fleet: None }
    }

    /// Also admits the fleet's peers, who present `token` and name the tenant they forward for.
    pub fn with_fleet_token(mut self, token: &str) -> Self {
        self.fleet = Some(Sha256::digest(token.as_bytes()).into());
        self
    }

    /// Whether a call comes from a fleet peer (it presents the fleet token).
    pub fn from_fleet_peer(&self, headers: &http::HeaderMap) -> bool {
        let Some(fleet) = &self.fleet else { return false };
        bearer(headers).is_some_and(|t| <[u8; 32]>::from(Sha256::digest(t.as_bytes())) == *fleet)
    }

    /// Whether TCP callers must present a token.
    pub fn tokens_required(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whether a UNIX peer with these credentials may call (root and the daemon's uid always).
    pub fn unix_peer_allowed(&self, cred: Option<&UCred>) -> bool {
        cred.is_some_and(|c| self.allowed_uids.contains(&c.uid()) || self.allowed_gids.contains(&c.gid()))
    }

    /// The caller's tenant, or why it may not call.
    pub fn tenant<T>(&self, req: &Request<T>) -> Result<String, Status> {
        self.tenant_of_parts(req.extensions(), req.metadata().as_ref())
    }

    /// [`Auth::tenant`] from a request's parts: what the gate layer has before any body is read.
    pub fn tenant_of_parts(&self, extensions: &http::Extensions, headers: &http::HeaderMap) -> Result<String, Status> {
        if let Some(Peer { transport: Transport::Unix(cred), .. }) = Peer::of(extensions) {
            let cred = cred.as_ref().ok_or_else(|| Status::unauthenticated("no peer credentials on the UNIX socket"))?;
            if self.unix_peer_allowed(Some(cred)) {
                return Ok(self.unix_tenant.clone());
            }
            let (uid, gid) = (cred.uid(), cred.gid());
            return Err(Status::permission_denied(format!("uid {uid} (gid {gid}) is not allowed on this socket (auth.unix_allowed_uids/gids)")));
        }
        if self.from_fleet_peer(headers) {
            let tenant = headers
                .get(FORWARDED_TENANT)
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty() && t.len() <= MAX_TENANT_BYTES && !t.chars().any(char::is_control))
                .ok_or_else(|| Status::unauthenticated(format!("a fleet peer's call must name its tenant in {FORWARDED_TENANT}")))?;
            return Ok(tenant.to_string());
        }
        if self.tokens.is_empty() {
            return Ok(self.unix_tenant.clone());
        }
        let header = headers.get("authorization").ok_or_else(|| Status::unauthenticated("missing bearer token (authorization: Bearer …)"))?;
        let token = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .ok_or_else(|| Status::unauthenticated("malformed authorization header: expected `Bearer <token>`"))?;
        let digest: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        self.tokens.get(&digest).cloned().ok_or_else(|| Status::unauthenticated("invalid bearer token"))
    }
}

/// The token of an `authorization: Bearer <token>` header.
fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let v = headers.get("authorization")?.to_str().ok()?;
    Some(v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer "))?.trim())
}

/// Hex SHA-256 of a token, as the config stores it.
pub fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenConfig;

    fn auth() -> Auth {
        Auth::new(&AuthConfig { tokens: vec![TokenConfig { tenant: "team-a".into(), sha256: token_hash("secret-a") }], ..AuthConfig::default() })
    }

    #[test]
    fn tokens_map_to_tenants_and_bad_ones_are_unauthenticated() {
        let a = auth();
        let mut req = Request::new(());
        req.metadata_mut().insert("authorization", "Bearer secret-a".parse().expect("header"));
        assert_eq!(a.tenant(&req).expect("valid"), "team-a");
        let mut wrong = Request::new(());
        wrong.metadata_mut().insert("authorization", "Bearer nope".parse().expect("header"));
        assert_eq!(a.tenant(&wrong).expect_err("invalid").code(), tonic::Code::Unauthenticated);
        assert_eq!(a.tenant(&Request::new(())).expect_err("missing").code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn the_forwarded_tenant_is_believed_only_with_the_fleet_token() {
        let a = auth().with_fleet_token("fleet-secret-0123456789");
        let mut peer = Request::new(());
        peer.metadata_mut().insert("authorization", "Bearer fleet-secret-0123456789".parse().expect("header"));
        peer.metadata_mut().insert(FORWARDED_TENANT, "team-b".parse().expect("header"));
        assert_eq!(a.tenant(&peer).expect("peer"), "team-b");
        // A tenant's own token with the header: the header is ignored.
        let mut spoof = Request::new(());
        spoof.metadata_mut().insert("authorization", "Bearer secret-a".parse().expect("header"));
        spoof.metadata_mut().insert(FORWARDED_TENANT, "team-b".parse().expect("header"));
        assert_eq!(a.tenant(&spoof).expect("tenant"), "team-a");
        // The fleet token without a tenant is refused, and a daemon without [fleet] knows no peer.
        let mut bare = Request::new(());
        bare.metadata_mut().insert("authorization", "Bearer fleet-secret-0123456789".parse().expect("header"));
        assert_eq!(a.tenant(&bare).expect_err("no tenant").code(), tonic::Code::Unauthenticated);
        assert_eq!(auth().tenant(&peer).expect_err("no fleet").code(), tonic::Code::Unauthenticated);
        assert!(!auth().from_fleet_peer(peer.metadata().as_ref()));
    }

    #[test]
    fn without_tokens_tcp_callers_are_the_local_tenant() {
        let a = Auth::new(&AuthConfig::default());
        assert_eq!(a.tenant(&Request::new(())).expect("open"), "local");
    }
}
