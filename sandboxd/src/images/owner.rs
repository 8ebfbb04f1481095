//! Whose an image is: every image imported or built through the API belongs to the caller's
//! tenant, except one an image admin shares; the operator's script-built images are everyone's.
//!
//! A tenant's names are its own (two tenants may both have `app`), so the catalog stores an
//! image under a *key* that cannot collide: `<name>~<tag>` for a tenant's image, where `<tag>`
//! is the first 128 bits of the SHA-256 of the tenant's name in hex (tenant names may hold any
//! character; the tag is safe in a path, a file name and a Docker tag alike), and the bare
//! `<name>` for a shared image. The key is what sandboxes, snapshots and the tiers record and
//! resolve; users only ever see the name. `~` is no character of a name, so a key never reads
//! as another name.

use sha2::{Digest, Sha256};

use super::catalog::{is_valid_name, MAX_NAME_BYTES};

/// Between the name and the tenant tag of a key.
const SEP: char = '~';
/// Hex digits of a tenant tag.
const TAG_LEN: usize = 32;

/// Who is looking at the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Viewer {
    pub tenant: String,
    /// Whether this is the UNIX socket's tenant, which owns the images imported before owners
    /// were recorded (see [`Viewer::owns`]).
    pub owns_legacy: bool,
    /// An image admin: may import any local Docker image and share imports with every tenant.
    pub admin: bool,
}

impl Viewer {
    /// The tag of this viewer's keys.
    pub fn tag(&self) -> String {
        tenant_tag(&self.tenant)
    }

    /// The key this viewer's own image `name` is stored under.
    pub fn key(&self, name: &str) -> String {
        format!("{name}{SEP}{}", self.tag())
    }

    /// Whether an imported image recorded as `owner` (empty: imported before owners were
    /// recorded) and `shared` is visible to this viewer. An image from before owners were
    /// recorded is the UNIX socket's tenant's: whoever imported it, the operator's own tenant
    /// is the one that could, and treating it as shared would keep the leak this closes.
    pub fn owns(&self, owner: &str, shared: bool) -> bool {
        shared || if owner.is_empty() { self.owns_legacy } else { owner == self.tenant }
    }
}

/// The tag of a tenant's keys.
pub fn tenant_tag(tenant: &str) -> String {
    super::hex(&Sha256::digest(tenant.as_bytes())[..TAG_LEN / 2])
}

/// A key's name and tenant tag (`None` for a shared image's key).
pub fn split_key(key: &str) -> (&str, Option<&str>) {
    match key.rsplit_once(SEP) {
        Some((name, tag)) => (name, Some(tag)),
        None => (key, None),
    }
}

/// The name users see of the image stored under `key`.
pub fn display_name(key: &str) -> &str {
    split_key(key).0
}

/// Whether `key` can be a catalog key: a name, or a name and a tenant tag.
pub fn is_valid_key(key: &str) -> bool {
    match split_key(key) {
        (name, None) => is_valid_name(name),
        (name, Some(tag)) => {
            is_valid_name(name) && name.len() <= MAX_NAME_BYTES && tag.len() == TAG_LEN && tag.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_tenants_apart_and_read_back_as_names() {
        let a = Viewer { tenant: "team a/../x\n".into(), owns_legacy: false, admin: false };
        let b = Viewer { tenant: "team-b".into(), owns_legacy: true, admin: false };
        let (ka, kb) = (a.key("app"), b.key("app"));
        assert_ne!(ka, kb);
        for k in [&ka, &kb] {
            assert!(is_valid_key(k) && !k.contains('/') && !k.contains(' '), "{k}");
            assert_eq!(display_name(k), "app");
        }
        assert_eq!(split_key(&ka).1, Some(a.tag().as_str()));
        assert!(is_valid_key("app") && !is_valid_key("app~x") && !is_valid_key("../a~0123") && !is_valid_key(&format!("a~{}", "A".repeat(32))));
        assert_eq!(split_key("app"), ("app", None));
        // Legacy images (no owner recorded) are the UNIX tenant's; shared ones everyone's.
        assert!(b.owns("", false) && !a.owns("", false));
        assert!(a.owns("team-b", true) && !a.owns("team-b", false) && b.owns("team-b", false));
    }
}
