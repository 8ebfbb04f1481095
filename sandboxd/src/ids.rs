//! Typed identifiers, validated once at the API boundary.
//!
//! Ids are short random strings with a kind prefix (`sb-`, `ex-`, `sn-`) so a user who pastes the
//! wrong one gets a NOT_FOUND that names the kind, and so they are safe to use as path and cgroup
//! components (lowercase alphanumerics and one dash only).
//!
//! In a fleet (`[fleet]`), an id also names the node that holds it: `sb-<random>_<node>`, where
//! `<node>` is a [`NodeName`]. Neither part holds a `_`, so it splits them; `_` and not `.`
//! because ids are cgroup and container names, which take letters, digits, `-` and `_` only.
//! An id without a node part (every id made before the fleet existed) means "this node". The
//! node part is what the fleet's router reads to forward a call; everything below the router
//! treats the whole id as an opaque name.

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
    let Some(rest) = s.strip_prefix(prefix) else { return false };
    let (random, node) = match rest.split_once('_') {
        Some((random, node)) => (random, Some(node)),
        None => (rest, None),
    };
    !random.is_empty()
        && random.len() <= 32
        && random.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && node.is_none_or(|n| NodeName::parse(n).is_ok())
}

/// The node part of an id string (`sb-abc_node-1` → `node-1`), if it has one. For routing only:
/// it does not validate the rest of the id.
pub fn node_of(id: &str) -> Option<&str> {
    id.split_once('_').map(|(_, node)| node)
}

/// The name of a fleet node, as ids carry it: 1-40 bytes of lowercase letters, digits and `-`,
/// starting and ending with a letter or digit (a DNS label, as Kubernetes pod names are). No
/// dot: ids are cgroup names. 40 and not 63: an id is a path component of sockets whose paths
/// the kernel limits to 108 bytes, and a sandbox's hostname (64 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeName(String);

/// The longest node name (see [`NodeName`]).
pub const MAX_NODE_NAME: usize = 40;

impl NodeName {
    /// Validates a node name from the config or from a client's id.
    pub fn parse(s: &str) -> Result<Self, BadId> {
        let bad = || BadId { kind: "node", value: s.chars().take(80).collect() };
        if s.is_empty() || s.len() > MAX_NODE_NAME {
            return Err(bad());
        }
        let ok = s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') && !s.starts_with('-') && !s.ends_with('-');
        if ok {
            Ok(NodeName(s.to_string()))
        } else {
            Err(bad())
        }
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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
            /// A fresh random id naming `node` as its holder (`None`: no node part).
            pub fn generate_on(node: Option<&NodeName>) -> Self {
                match node {
                    Some(n) => $name(format!("{}{}_{}", $prefix, random_suffix(12), n)),
                    None => Self::generate(),
                }
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

    #[test]
    fn ids_name_their_node_and_old_ids_name_none() {
        let node = NodeName::parse("node-a-pool-1").expect("valid");
        let id = SandboxId::generate_on(Some(&node));
        assert!(id.as_str().ends_with("_node-a-pool-1"), "{id}");
        assert_eq!(SandboxId::parse(id.as_str()).ok(), Some(id.clone()));
        assert_eq!(node_of(id.as_str()), Some("node-a-pool-1"));
        assert_eq!(node_of("sb-0123abc"), None);
        assert!(SnapshotId::parse(SnapshotId::generate_on(Some(&node)).as_str()).is_ok());
    }

    #[test]
    fn node_names_are_strict() {
        for good in ["a", "node-1", "ip-10-0-1-23", "x9", "sandboxd-7x2kq"] {
            assert!(NodeName::parse(good).is_ok(), "{good}");
        }
        let long = "a".repeat(MAX_NODE_NAME + 1);
        for bad in ["", "-a", "a-", "A", "a.b", ".a", "a/b", "a_b", "a b", "ä", long.as_str()] {
            assert!(NodeName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(SandboxId::parse("sb-abc_").is_err());
        assert!(SandboxId::parse("sb-abc_/x").is_err());
        assert!(SandboxId::parse("sb-abc_Node").is_err());
        assert!(SandboxId::parse("sb-_node").is_err());
        assert!(SandboxId::parse("sb-abc_a_b").is_err());
    }
}
