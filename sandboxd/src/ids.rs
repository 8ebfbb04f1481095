//! Typed identifiers, validated once at the API boundary.
//!
//! Ids are short random strings with a kind prefix (`sb-`, `ex-`, `sn-`) so a user who pastes the
//! wrong one gets a NOT_FOUND that names the kind, and so they are safe to use as path and cgroup
//! components (lowercase alphanumerics and one dash only).

use std::fmt;

use rand::Rng;

/// An id string that does not have the expected shape.
#[derive(Debug, thiserror::Error)]
#[error("malformed {kind} id {value:?}")]
pub struct BadId {
    pub kind: &'static str,
    pub value: String,
}

/// `len` random lowercase letters and digits: ids, and names that must not collide.
pub fn random_suffix(len: usize) -> String {
    const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::thread_rng();
    (0..len).map(|_| char::from(ALPHABET[rng.gen_range(0..ALPHABET.len())])).collect()
}

fn well_formed(prefix: &str, s: &str) -> bool {
    match s.strip_prefix(prefix) {
        Some(rest) => !rest.is_empty() && rest.len() <= 32 && rest.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        None => false,
    }
}

macro_rules! typed_id {
    ($name:ident, $prefix:literal, $kind:literal) => {
        #[doc = concat!("Identifier of a ", $kind, " (`", $prefix, "…`).")]
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// A fresh random id.
            pub fn generate() -> Self {
                $name(format!("{}{}", $prefix, random_suffix(12)))
            }
            /// Validates an id received from a client.
            pub fn parse(s: &str) -> Result<Self, BadId> {
                if well_formed($prefix, s) {
                    Ok($name(s.to_string()))
                } else {
                    Err(BadId { kind: $kind, value: s.chars().take(80).collect() })
                }
            }
            /// The id as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

typed_id!(SandboxId, "sb-", "sandbox");
typed_id!(ExecId, "ex-", "exec");
typed_id!(SnapshotId, "sn-", "snapshot");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_parse_back() {
        let id = SandboxId::generate();
        assert_eq!(SandboxId::parse(id.as_str()).ok(), Some(id));
    }

    #[test]
    fn wrong_kind_and_path_tricks_are_rejected() {
        assert!(SandboxId::parse("ex-abc").is_err());
        assert!(SandboxId::parse("sb-../../etc").is_err());
        assert!(SandboxId::parse("sb-").is_err());
        assert!(SandboxId::parse("sb-ABC").is_err());
        assert!(ExecId::parse("ex-0123abc").is_ok());
    }
}
