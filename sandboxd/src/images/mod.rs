//! The image store: what sandboxes start from, for all three tiers.
//!
//! The catalog ([`Catalog`]) is the union of two directories:
//!
//! * the operator's images dir (`--images-dir`), whose `<name>/{rootfs/,image.json}` the build
//!   scripts of `images/` make (and `<name>/vm/` for the microVM tier) — trusted, read-only to
//!   the daemon, never removed through the API;
//! * `<state_dir>/images/<name>/`, images imported or built through the API. Their bytes come
//!   from a client and are hostile, so they live below the sealed state dir (0700,
//!   `nosuid,nodev,noexec`, see `hostfs`) like every other tree a client controls.
//!
//! Every tier finds an image through the catalog: its rootfs (process tier: the overlay's lower
//! layer; container tier: what is imported into Docker), its image.json (whose hash tags the
//! Docker image) and its microVM files (a base disk of its own; the kernel and initramfs, which
//! carry nothing image-specific, from a script-built image).
//!
//! Imports ([`import`]) turn a `docker save` or OCI image-layout tar into a rootfs, layer by
//! layer ([`layer`], every path confined to the rootfs), in a staging dir renamed into place with
//! `image.json` written last, the same contract as `images/lib.sh`. [`engine`] talks to the
//! local Docker Engine for `docker:` imports and builds, [`build`] reads what a build needs from
//! its context. The manager orchestrates: it receives uploads, prepares each tier, and refuses
//! to remove an image a sandbox or snapshot uses.
//!
//! This module imports nothing of the backends (they import it), so the crate's layering holds.

pub mod archive;
pub mod build;
pub mod catalog;
pub mod engine;
pub mod import;
pub mod layer;
pub mod meta;
pub mod owner;
pub mod steps;
pub mod store;

pub use catalog::{is_valid_name, Catalog, ImageDir, Origin, VmFiles, MAX_NAME_BYTES};
pub use engine::Engine;
pub use meta::ImageJson;
pub use owner::{display_name, Viewer};

/// What can go wrong with an image, with enough context to tell the user what and where. Host
/// paths of the image store are never part of a message a client reads.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No image of that name; the names that exist, so the caller can pick one.
    #[error("image {image:?} not found; available: {}", if .available.is_empty() { "none".to_string() } else { .available.join(", ") })]
    NotFound { image: String, available: Vec<String> },
    /// The image exists but a tier cannot run it (yet), with the reason.
    #[error("{reason}")]
    NotReady { image: String, reason: String },
    /// A request field is wrong.
    #[error("invalid {field}: {message}")]
    Invalid { field: &'static str, message: String },
    /// The archive (or an entry of one of its layers) is malformed or hostile; names the entry.
    #[error("archive: {0}")]
    Archive(String),
    /// The operation cannot be done in the current state (in use, a script-built image, ...).
    #[error("{0}")]
    Refused(String),
    /// A configured bound was reached; names the key.
    #[error("{what}: over the limit of {limit} (images.{key})")]
    Limit { what: String, limit: String, key: &'static str },
    /// The image store (or its filesystem) has no room for this import; names the key.
    #[error("{0}")]
    StoreFull(String),
    /// A `docker:` reference the local Docker Engine does not have (nothing is ever pulled).
    #[error("Docker image {0:?} not found in the local Docker Engine (nothing is pulled; build, load or tag it there first)")]
    DockerImageNotFound(String),
    /// Docker is needed and cannot be reached.
    #[error("Docker unavailable: {0}")]
    DockerUnavailable(String),
    /// `docker build` failed; its own message (a failing step, a bad Dockerfile).
    #[error("build failed: {0}")]
    BuildFailed(String),
    /// The client went away or broke off.
    #[error("{0}")]
    Aborted(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("{0}")]
    Internal(String),
}

impl ImageError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ImageError::Io { context: context.into(), source }
    }

    /// Whether this is a full disk (the state dir's filesystem).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, ImageError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)))
    }
}

pub use crate::admission::human_bytes as human;

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_lowercase() {
        assert_eq!(super::hex(&[0, 0xab, 0x10]), "00ab10");
    }
}
