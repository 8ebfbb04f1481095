//! `image.json`, the file that makes a directory an image (written last), and `vm/vm.json`.
//!
//! The build scripts write `{"name", "built_at", "source", "arch"}` (`images/lib.sh`); imports
//! add what the image's config said and what the import measured. Unknown keys are ignored and
//! missing ones default, so either kind reads as an [`ImageJson`].

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::model::ImageConfig;

/// The contents of `image.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageJson {
    pub name: String,
    /// Script-built images: when the script finished (RFC 3339).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub built_at: String,
    pub source: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub arch: String,
    /// Imported images: `sha256:<hex>` of the image config (the Docker image ID).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub digest: String,
    /// Imported images: bytes of file content in the rootfs.
    #[serde(skip_serializing_if = "is_zero")]
    pub size_bytes: u64,
    /// Imported images: the config's `created` (RFC 3339), or the import time without one.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub created: String,
    /// Imported images: when the import finished (RFC 3339).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub imported_at: String,
    /// Imported images: `docker-save` or `oci`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub format: String,
    #[serde(skip_serializing_if = "is_zero")]
    pub layers: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub entries: u64,
    pub config: ImageConfig,
    /// Imported images: the tenant that imported or built it (empty: imported before owners
    /// were recorded, see `owner::Viewer::owns`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub owner: String,
    /// Imported images: shared by an image admin with every tenant.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl ImageJson {
    /// Parses `image.json`; a file that is no JSON object reads as empty (the build scripts'
    /// contract is only that the file exists, last).
    pub fn parse(bytes: &[u8]) -> ImageJson {
        serde_json::from_slice(bytes).unwrap_or_default()
    }

    /// When the image was made: `created`, else `built_at`, else `None`.
    pub fn created_at(&self) -> Option<SystemTime> {
        [&self.created, &self.built_at].into_iter().filter(|s| !s.is_empty()).find_map(|s| humantime::parse_rfc3339_weak(s).ok())
    }
}

/// An RFC 3339 time, to the second.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The contents of `vm/vm.json` (paths relative to `vm/`). Imported images have only a disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmJson {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub kernel: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub initramfs: String,
    pub disk: String,
    pub disk_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_and_imported_image_json_both_read() {
        let script = br#"{"name": "minimal", "built_at": "2025-05-20T12:00:00Z", "source": "busybox", "arch": "x86_64"}"#;
        let j = ImageJson::parse(script);
        assert_eq!(j.name, "minimal");
        assert!(j.created_at().is_some());
        assert!(j.digest.is_empty());
        let imported = ImageJson {
            name: "py".into(),
            digest: "sha256:ab".into(),
            created: "2024-01-02T03:04:05Z".into(),
            config: ImageConfig { user: "app".into(), ..Default::default() },
            ..Default::default()
        };
        let text = serde_json::to_vec(&imported).expect("json");
        assert_eq!(ImageJson::parse(&text), imported);
        assert_eq!(ImageJson::parse(b"not json"), ImageJson::default());
    }
}
