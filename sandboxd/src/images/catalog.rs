//! The catalog: which images exist, where each tier finds their files, and the imported half's
//! directory (staging, commit, removal).
//!
//! ```text
//! <images_dir>/<name>/{rootfs/, image.json, vm/}            script-built (the operator's)
//! <state_dir>/images/<name>/{rootfs/, image.json, vm/}      imported or built through the API
//! <state_dir>/images/.staging-<name>-<rand>/                an import being assembled
//! <state_dir>/images/.upload-<rand>                         an archive or context arriving
//! <state_dir>/images/.trash-<name>-<rand>/                  a removed or replaced image going
//! ```
//!
//! A name is one directory name (1-64 of `[A-Za-z0-9._-]`, not starting with `.`), checked
//! before any path is made from it; an imported image's directory is its key (`owner`):
//! `<name>~<tenant tag>` for a tenant's, `<name>` for a shared one. A directory is an image once its `image.json` exists (it is
//! written last) next to a `rootfs/`. When both halves have a name, the script-built image wins
//! (the operator's word), and the daemon warns at start.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::meta::{ImageJson, VmJson};
use super::owner::{self, Viewer};
use super::{hex, ImageError};
use crate::hostfs;
use crate::model::{ImageConfig, ImageRecord};

/// Longest image name.
pub const MAX_NAME_BYTES: usize = 64;

/// Whether `name` can name an image: one directory name, nothing hidden, no path.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_BYTES && !name.starts_with('.') && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Which half of the catalog an image is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The operator's images dir, made by the build scripts.
    Script,
    /// Imported or built through the API, under the state dir.
    Imported,
}

/// An image found in the catalog.
#[derive(Debug, Clone)]
pub struct ImageDir {
    /// Its key (see `owner`): the name, with the owner's tag for a tenant's image.
    pub name: String,
    pub origin: Origin,
    /// `<base>/<name>`.
    pub dir: PathBuf,
    /// The bytes of its `image.json` (they change with every build or import).
    pub meta: Vec<u8>,
}

impl ImageDir {
    /// The root filesystem every tier starts from.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    /// `image.json`, parsed.
    pub fn json(&self) -> ImageJson {
        ImageJson::parse(&self.meta)
    }
}

/// What a microVM boots for an image: the kernel and initramfs (the same for every image) and
/// the image's read-only base disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmFiles {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub disk: PathBuf,
}

/// The image catalog (see the module documentation).
#[derive(Debug)]
pub struct Catalog {
    images_dir: PathBuf,
    imported_dir: PathBuf,
    /// The image whose kernel and initramfs imported images boot with (the policy's default),
    /// falling back to any script-built image that has them.
    default_image: String,
    /// Sizes of script-built rootfs (a walk of the tree), by name, with the image.json hash
    /// they were measured for.
    sizes: Mutex<HashMap<String, ([u8; 32], u64)>>,
}

impl Catalog {
    /// The catalog over the operator's `images_dir` and `<state_dir>/images`.
    pub fn new(images_dir: &Path, state_dir: &Path, default_image: &str) -> Self {
        Catalog {
            images_dir: images_dir.to_path_buf(),
            imported_dir: state_dir.join("images"),
            default_image: default_image.to_string(),
            sizes: Mutex::new(HashMap::new()),
        }
    }

    /// Creates the imported half's directory (0700) and removes what an interrupted import or
    /// removal left behind. Called once at start, before serving.
    pub fn prepare(&self) -> Result<(), ImageError> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&self.imported_dir).map_err(|e| ImageError::io("creating the image store", e))?;
        std::fs::set_permissions(&self.imported_dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| ImageError::io("chmod 0700 the image store", e))?;
        let entries = std::fs::read_dir(&self.imported_dir).map_err(|e| ImageError::io("reading the image store", e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".staging-") || name.starts_with(".upload-") || name.starts_with(".trash-") {
                tracing::info!(entry = %name, "removing what an interrupted image import or removal left behind");
                remove_any(&entry.path());
            }
        }
        for name in self.names_in(&self.imported_dir) {
            // A base disk being made when the daemon stopped (the microVM tier's staging dir).
            if let Ok(inside) = std::fs::read_dir(self.imported_dir.join(&name)) {
                for entry in inside.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(".vm.tmp-")) {
                    remove_any(&entry.path());
                }
            }
            if self.lookup(Origin::Script, &name).is_some() {
                tracing::warn!(image = %name, "an imported image has the name of a script-built one, which wins; remove the imported one with `sbx image rm` after renaming the script's");
            }
        }
        Ok(())
    }

    /// The operator's images dir.
    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    /// Where imported images live.
    pub fn imported_dir(&self) -> &Path {
        &self.imported_dir
    }

    fn base(&self, origin: Origin) -> &Path {
        match origin {
            Origin::Script => &self.images_dir,
            Origin::Imported => &self.imported_dir,
        }
    }

    /// The image stored under `key` in one half of the catalog, if it is complete.
    fn lookup(&self, origin: Origin, key: &str) -> Option<ImageDir> {
        let valid = match origin {
            Origin::Script => is_valid_name(key),
            Origin::Imported => owner::is_valid_key(key),
        };
        if !valid {
            return None;
        }
        let dir = self.base(origin).join(key);
        // image.json is written last: without it the image is unfinished.
        let meta = std::fs::read(dir.join("image.json")).ok()?;
        dir.join("rootfs").is_dir().then(|| ImageDir { name: key.to_string(), origin, dir, meta })
    }

    /// The image stored under `key` (what sandboxes, snapshots and the tiers record), whoever
    /// owns it: the caller checked the key's owner when it chose it. NOT_FOUND lists only the
    /// images every tenant sees.
    pub fn resolve(&self, key: &str) -> Result<ImageDir, ImageError> {
        let script = if owner::split_key(key).1.is_none() { self.lookup(Origin::Script, key) } else { None };
        script.or_else(|| self.lookup(Origin::Imported, key)).ok_or_else(|| {
            let shared = self.candidates().into_iter().filter(|(_, img)| img.origin == Origin::Script || img.json().shared);
            ImageError::NotFound { image: owner::display_name(key).chars().take(80).collect(), available: names_of(shared) }
        })
    }

    /// The image `name` as `viewer` sees it: its own image of that name, else a script-built
    /// one, else a shared (or, for the UNIX tenant, a legacy) import. Another tenant's image is
    /// NOT_FOUND exactly like a name nobody has.
    pub fn find(&self, viewer: &Viewer, name: &str) -> Result<ImageDir, ImageError> {
        let found = if is_valid_name(name) {
            self.lookup(Origin::Imported, &viewer.key(name))
                .or_else(|| self.lookup(Origin::Script, name))
                .or_else(|| self.lookup(Origin::Imported, name).filter(|img| self.can_see(viewer, img)))
        } else {
            None
        };
        found.ok_or_else(|| self.not_found_for(viewer, name))
    }

    /// Whether `viewer` may see `img` at all.
    pub fn can_see(&self, viewer: &Viewer, img: &ImageDir) -> bool {
        match (img.origin, owner::split_key(&img.name).1) {
            (Origin::Script, _) => true,
            (Origin::Imported, Some(tag)) => tag == viewer.tag(),
            (Origin::Imported, None) => {
                let json = img.json();
                viewer.owns(&json.owner, json.shared)
            }
        }
    }

    /// The imported image stored under `key`, if there is one (shadowed or not).
    pub fn imported(&self, key: &str) -> Option<ImageDir> {
        self.lookup(Origin::Imported, key)
    }

    /// Whether a script-built image has this name.
    pub fn is_script_built(&self, name: &str) -> bool {
        self.lookup(Origin::Script, name).is_some()
    }

    /// The NOT_FOUND of `name` for `viewer`: the name (cut, it comes from a client) and the
    /// names `viewer` can use.
    pub fn not_found_for(&self, viewer: &Viewer, name: &str) -> ImageError {
        ImageError::NotFound {
            image: name.chars().take(80).collect(),
            available: self.visible(viewer).iter().map(|i| owner::display_name(&i.name).to_string()).collect(),
        }
    }

    fn names_in(&self, base: &Path) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(base) else { return Vec::new() };
        entries.flatten().filter_map(|e| e.file_name().to_str().map(str::to_string)).filter(|n| owner::is_valid_key(n)).collect()
    }

    /// Every complete image `viewer` sees, one per name (its own before a script-built one
    /// before a shared import), sorted by name.
    pub fn visible(&self, viewer: &Viewer) -> Vec<ImageDir> {
        let mine = self.candidates().into_iter().filter(|(_, img)| self.can_see(viewer, img));
        first_per_name(mine).into_values().collect()
    }

    /// Every complete image with its rank when names meet: a tenant's own (0), script-built
    /// (1), shared or legacy import (2).
    fn candidates(&self) -> Vec<(u8, ImageDir)> {
        let mut out: Vec<(u8, ImageDir)> = Vec::new();
        for key in self.names_in(&self.images_dir) {
            out.extend(self.lookup(Origin::Script, &key).map(|i| (1, i)));
        }
        for key in self.names_in(&self.imported_dir) {
            let rank = if owner::split_key(&key).1.is_some() { 0 } else { 2 };
            out.extend(self.lookup(Origin::Imported, &key).map(|i| (rank, i)));
        }
        out
    }

    /// What a user reads about the image stored under `key` (its `ready_tiers` are the
    /// manager's to fill in).
    pub fn record(&self, key: &str) -> Result<ImageRecord, ImageError> {
        let img = self.resolve(key)?;
        let name = owner::display_name(&img.name).to_string();
        let json = img.json();
        let created_at =
            json.created_at().or_else(|| std::fs::metadata(img.dir.join("image.json")).and_then(|m| m.modified()).ok()).unwrap_or(SystemTime::UNIX_EPOCH);
        Ok(match img.origin {
            Origin::Imported => ImageRecord {
                name,
                shared: json.shared,
                digest: json.digest.clone(),
                size_bytes: json.size_bytes,
                created_at,
                source: json.source.clone(),
                config: json.config.clone(),
                imported: true,
                ready_tiers: Vec::new(),
            },
            Origin::Script => {
                let sum: [u8; 32] = Sha256::digest(&img.meta).into();
                ImageRecord {
                    name,
                    shared: true,
                    digest: format!("sha256:{}", hex(&sum)),
                    size_bytes: self.script_size(&img, sum),
                    created_at,
                    source: if json.source.is_empty() { "images dir".to_string() } else { json.source.clone() },
                    config: json.config.clone(),
                    imported: false,
                    ready_tiers: Vec::new(),
                }
            }
        })
    }

    /// The image's config (env, workdir, user, entrypoint, cmd); empty for script-built images.
    pub fn config(&self, name: &str) -> Result<ImageConfig, ImageError> {
        Ok(self.resolve(name)?.json().config)
    }

    /// Bytes of file content in a script-built rootfs, measured once per build of it.
    fn script_size(&self, img: &ImageDir, sum: [u8; 32]) -> u64 {
        if let Some((s, size)) = self.sizes.lock().ok().and_then(|m| m.get(&img.name).copied()) {
            if s == sum {
                return size;
            }
        }
        let size = hostfs::tree_size(&img.rootfs(), hostfs::Measure::Content);
        if let Ok(mut m) = self.sizes.lock() {
            m.insert(img.name.clone(), (sum, size));
        }
        size
    }

    /// What a microVM boots for `name`: NOT_FOUND for an unknown image, NotReady (with what is
    /// missing) for one without a base disk or without a kernel to boot it.
    pub fn vm_files(&self, name: &str) -> Result<VmFiles, ImageError> {
        let img = self.resolve(name)?;
        let not_ready = |reason: String| ImageError::NotReady { image: name.to_string(), reason };
        let vm_dir = img.dir.join("vm");
        let manifest = match read_vm_json(&vm_dir) {
            Some(m) => m,
            None if img.origin == Origin::Script => {
                return Err(not_ready(format!("image {name:?} has no microVM artifacts (vm/vm.json: kernel, initramfs, disk); build them with `make images`")))
            }
            None => {
                return Err(not_ready(format!(
                "image {name:?} has no microVM base disk: preparing it failed at import (see the daemon log); import it again once mkfs.ext4 and qemu-img work"
            )))
            }
        };
        if manifest.disk.is_empty() || manifest.disk.contains('/') {
            return Err(not_ready(format!("image {name:?}: vm/vm.json names no disk")));
        }
        let disk = vm_dir.join(&manifest.disk);
        if !disk.is_file() {
            return Err(not_ready(format!("image {name:?}: vm/{} is missing", manifest.disk)));
        }
        // The kernel and initramfs carry nothing of the image (the initramfs is the guest agent
        // and modules): an image without its own boots with a script-built image's, so a
        // rebuild of those (`make vm-images`) serves imported images too.
        let (kernel, initramfs) = if img.origin == Origin::Script && !manifest.kernel.is_empty() {
            let files = (vm_dir.join(&manifest.kernel), vm_dir.join(&manifest.initramfs));
            for (f, what) in [(&manifest.kernel, &files.0), (&manifest.initramfs, &files.1)] {
                if f.is_empty() || f.contains('/') || !what.is_file() {
                    return Err(not_ready(format!("image {name:?}: vm/{f} is missing (kernel, initramfs and disk are needed)")));
                }
            }
            files
        } else {
            self.boot_files().ok_or_else(|| {
                not_ready(format!("no script-built image has a kernel and initramfs for image {name:?} to boot with; build them with `make images`"))
            })?
        };
        Ok(VmFiles { kernel, initramfs, disk })
    }

    /// The kernel and initramfs of the default image, else of the first script-built image
    /// that has both.
    pub fn boot_files(&self) -> Option<(PathBuf, PathBuf)> {
        let mut names = self.names_in(&self.images_dir);
        names.sort();
        let order = std::iter::once(self.default_image.clone()).chain(names);
        for name in order {
            let Some(img) = self.lookup(Origin::Script, &name) else { continue };
            let vm_dir = img.dir.join("vm");
            let Some(m) = read_vm_json(&vm_dir) else { continue };
            if m.kernel.is_empty() || m.initramfs.is_empty() || m.kernel.contains('/') || m.initramfs.contains('/') {
                continue;
            }
            let (k, i) = (vm_dir.join(&m.kernel), vm_dir.join(&m.initramfs));
            if k.is_file() && i.is_file() {
                return Some((k, i));
            }
        }
        None
    }

    /// A fresh staging dir for an import of `name` (not created).
    pub fn staging_path(&self, name: &str) -> PathBuf {
        self.imported_dir.join(format!(".staging-{name}-{}", crate::ids::random_suffix(8)))
    }

    /// A fresh path for an upload (not created).
    pub fn upload_path(&self) -> PathBuf {
        self.imported_dir.join(format!(".upload-{}", crate::ids::random_suffix(8)))
    }

    /// Puts the finished staging dir in place as the imported image `name`. An imported image
    /// of that name already there is swapped out atomically (`RENAME_EXCHANGE`), so the name
    /// always means a complete image, and its old tree is returned for removal.
    pub fn commit(&self, staging: &Path, name: &str) -> Result<Option<PathBuf>, ImageError> {
        if !owner::is_valid_key(name) {
            return Err(ImageError::Invalid { field: "name", message: format!("{name:?} is not an image name") });
        }
        let target = self.imported_dir.join(name);
        match std::fs::symlink_metadata(&target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::rename(staging, &target).map_err(|e| ImageError::io(format!("putting image {name} in place"), e))?;
                Ok(None)
            }
            Err(e) => Err(ImageError::io(format!("looking at image {name}"), e)),
            Ok(_) => {
                nix::fcntl::renameat2(None, staging, None, &target, nix::fcntl::RenameFlags::RENAME_EXCHANGE)
                    .map_err(|e| ImageError::io(format!("swapping image {name} in place"), e.into()))?;
                let trash = self.imported_dir.join(format!(".trash-{name}-{}", crate::ids::random_suffix(8)));
                std::fs::rename(staging, &trash).map_err(|e| ImageError::io(format!("moving the old image {name} aside"), e))?;
                Ok(Some(trash))
            }
        }
    }

    /// Takes the imported image `name` out of the catalog (one rename, so it is gone at once)
    /// and returns where its tree now is, for removal.
    pub fn take_out(&self, name: &str) -> Result<PathBuf, ImageError> {
        let img = self.imported(name).ok_or_else(|| ImageError::NotFound { image: owner::display_name(name).to_string(), available: Vec::new() })?;
        let trash = self.imported_dir.join(format!(".trash-{name}-{}", crate::ids::random_suffix(8)));
        std::fs::rename(&img.dir, &trash).map_err(|e| ImageError::io(format!("taking image {name} out of the catalog"), e))?;
        Ok(trash)
    }
}

/// The best-ranked image of each name.
fn first_per_name(candidates: impl Iterator<Item = (u8, ImageDir)>) -> BTreeMap<String, ImageDir> {
    let mut all: Vec<(u8, ImageDir)> = candidates.collect();
    all.sort_by_key(|(rank, _)| *rank);
    let mut by_name = BTreeMap::new();
    for (_, img) in all {
        by_name.entry(owner::display_name(&img.name).to_string()).or_insert(img);
    }
    by_name
}

/// The names of `candidates`, sorted, once each.
fn names_of(candidates: impl Iterator<Item = (u8, ImageDir)>) -> Vec<String> {
    first_per_name(candidates).into_keys().collect()
}

/// `vm/vm.json`, when it is there and parses.
fn read_vm_json(vm_dir: &Path) -> Option<VmJson> {
    let text = std::fs::read(vm_dir.join("vm.json")).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Removes a file or a whole tree, never following a symlink (std's `remove_dir_all` opens
/// every level with `O_NOFOLLOW`); failures are logged.
pub fn remove_any(path: &Path) {
    let result = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tracing::warn!(path = %path.display(), error = %e, "removing an image tree");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(base: &Path, name: &str, json: &str) -> PathBuf {
        let dir = base.join(name);
        std::fs::create_dir_all(dir.join("rootfs/bin")).expect("mkdir");
        std::fs::write(dir.join("rootfs/bin/sh"), b"12345").expect("write");
        std::fs::write(dir.join("image.json"), json).expect("write");
        dir
    }

    fn setup() -> (tempfile::TempDir, Catalog) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (images, state) = (tmp.path().join("images"), tmp.path().join("state"));
        std::fs::create_dir_all(&images).expect("mkdir");
        let c = Catalog::new(&images, &state, "minimal");
        c.prepare().expect("prepare");
        (tmp, c)
    }

    #[test]
    fn unknown_names_list_what_exists_and_no_host_path() {
        let (tmp, c) = setup();
        image(c.images_dir(), "minimal", r#"{"name":"minimal","built_at":"2025-01-01T00:00:00Z"}"#);
        image(c.images_dir(), "debian", "{}");
        // Unfinished (no image.json), hidden, and a name no API call could make.
        std::fs::create_dir_all(c.images_dir().join("half/rootfs")).expect("mkdir");
        std::fs::create_dir_all(c.images_dir().join(".tools")).expect("mkdir");
        // From before owners were recorded: the UNIX socket tenant's.
        image(c.imported_dir(), "py", r#"{"name":"py","digest":"sha256:00","size_bytes":7}"#);
        let local = Viewer { tenant: "local".into(), owns_legacy: true, admin: true };
        let names = |v: &Viewer| c.visible(v).iter().map(|i| owner::display_name(&i.name).to_string()).collect::<Vec<_>>();
        assert_eq!(names(&local), ["debian", "minimal", "py"]);
        for bad in ["nope", "../minimal", "half", ".tools", ""] {
            let err = c.find(&local, bad).expect_err(bad).to_string();
            assert!(err.contains("available: debian, minimal, py"), "{err}");
            assert!(!err.contains(&tmp.path().display().to_string()) && !err.contains('/') || bad.contains('/'), "{err}");
        }
        assert_eq!(c.find(&local, "py").expect("imported").origin, Origin::Imported);
        let other = Viewer { tenant: "b".into(), owns_legacy: false, admin: false };
        assert_eq!(names(&other), ["debian", "minimal"]);
        assert!(c.find(&other, "py").is_err());
        let r = c.record("minimal").expect("record");
        assert!(r.digest.starts_with("sha256:") && r.digest.len() == 71, "{}", r.digest);
        assert_eq!((r.size_bytes, r.imported), (5, false));
        let r = c.record("py").expect("record");
        assert_eq!((r.size_bytes, r.imported, r.digest.as_str()), (7, true, "sha256:00"));
    }

    #[test]
    fn vm_files_come_from_the_image_or_a_script_built_kernel() {
        let (_tmp, c) = setup();
        let bare = image(c.images_dir(), "bare", "{}");
        match c.vm_files("bare") {
            Err(ImageError::NotReady { reason, .. }) => assert!(reason.contains("vm.json") && reason.contains("make images"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(c.vm_files("nope"), Err(ImageError::NotFound { .. })));
        assert!(matches!(c.vm_files("nope~0123"), Err(ImageError::NotFound { .. })));
        assert!(matches!(c.vm_files("../bare"), Err(ImageError::NotFound { .. })));
        std::fs::create_dir_all(bare.join("vm")).expect("mkdir");
        std::fs::write(bare.join("vm/vm.json"), r#"{"kernel":"vmlinuz","initramfs":"initramfs.img","disk":"rootfs.qcow2"}"#).expect("write");
        match c.vm_files("bare") {
            Err(ImageError::NotReady { reason, .. }) => assert!(reason.contains("rootfs.qcow2"), "{reason}"),
            other => panic!("{other:?}"),
        }
        for f in ["vmlinuz", "initramfs.img", "rootfs.qcow2"] {
            std::fs::write(bare.join("vm").join(f), b"x").expect("write");
        }
        assert_eq!(c.vm_files("bare").expect("complete").kernel, bare.join("vm/vmlinuz"));
        // An imported image: its own disk, the script-built image's kernel.
        let py = image(c.imported_dir(), "py", "{}");
        assert!(matches!(c.vm_files("py"), Err(ImageError::NotReady { .. })));
        std::fs::create_dir_all(py.join("vm")).expect("mkdir");
        std::fs::write(py.join("vm/vm.json"), r#"{"disk":"rootfs.qcow2","disk_bytes":1}"#).expect("write");
        std::fs::write(py.join("vm/rootfs.qcow2"), b"x").expect("write");
        let files = c.vm_files("py").expect("imported");
        assert_eq!((files.disk, files.kernel), (py.join("vm/rootfs.qcow2"), bare.join("vm/vmlinuz")));
    }

    #[test]
    fn commit_swaps_atomically_and_take_out_removes_from_the_catalog() {
        let (_tmp, c) = setup();
        let staging = c.staging_path("py");
        image(staging.parent().expect("parent"), staging.file_name().and_then(|n| n.to_str()).expect("name"), r#"{"digest":"sha256:01"}"#);
        assert_eq!(c.commit(&staging, "py").expect("commit"), None);
        assert_eq!(c.record("py").expect("py").digest, "sha256:01");
        let staging = c.staging_path("py");
        image(staging.parent().expect("parent"), staging.file_name().and_then(|n| n.to_str()).expect("name"), r#"{"digest":"sha256:02"}"#);
        let old = c.commit(&staging, "py").expect("commit").expect("the old one moved aside");
        assert_eq!(c.record("py").expect("py").digest, "sha256:02");
        assert!(std::fs::read_to_string(old.join("image.json")).expect("old").contains("sha256:01"));
        remove_any(&old);
        let trash = c.take_out("py").expect("take out");
        assert!(matches!(c.resolve("py"), Err(ImageError::NotFound { .. })));
        remove_any(&trash);
        assert!(!trash.exists());
        // Leftovers go at the next start.
        std::fs::create_dir_all(c.imported_dir().join(".staging-x-1/rootfs")).expect("mkdir");
        c.prepare().expect("prepare");
        assert!(!c.imported_dir().join(".staging-x-1").exists());
    }

    #[test]
    fn tenants_see_their_own_images_and_shared_ones_under_their_names() {
        let (_tmp, c) = setup();
        image(c.images_dir(), "minimal", "{}");
        let v = |t: &str| Viewer { tenant: t.into(), owns_legacy: false, admin: false };
        let (a, b) = (v("a"), v("b"));
        image(c.imported_dir(), &a.key("app"), r#"{"name":"app","owner":"a","digest":"sha256:aa"}"#);
        image(c.imported_dir(), &b.key("app"), r#"{"name":"app","owner":"b","digest":"sha256:bb"}"#);
        image(c.imported_dir(), "tools", r#"{"name":"tools","owner":"admin","shared":true,"digest":"sha256:cc"}"#);
        image(c.imported_dir(), "secret", r#"{"name":"secret","owner":"admin","digest":"sha256:dd"}"#);
        // A tenant's own image shadows a shared one of the same name, for it alone.
        image(c.imported_dir(), &b.key("tools"), r#"{"name":"tools","owner":"b","digest":"sha256:ee"}"#);
        for (viewer, app, tools) in [(&a, "sha256:aa", "sha256:cc"), (&b, "sha256:bb", "sha256:ee")] {
            let seen: Vec<(String, String)> =
                c.visible(viewer).iter().map(|i| (owner::display_name(&i.name).to_string(), c.record(&i.name).expect("record").digest)).collect();
            assert_eq!(seen.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["app", "minimal", "tools"], "{viewer:?}");
            assert_eq!(c.record(&c.find(viewer, "app").expect("own").name).expect("record").digest, app);
            assert_eq!(c.record(&c.find(viewer, "tools").expect("tools").name).expect("record").digest, tools);
            let err = c.find(viewer, "secret").expect_err("another tenant's").to_string();
            assert!(err.contains("available: app, minimal, tools"), "{err}");
        }
        let r = c.record(&a.key("app")).expect("record");
        assert_eq!((r.name.as_str(), r.shared, r.imported), ("app", false, true));
        assert!(c.record("tools").expect("record").shared && c.record("minimal").expect("record").shared);
        // The tiers resolve keys; their NOT_FOUND names only what everyone sees.
        let err = c.resolve(&a.key("gone")).expect_err("gone").to_string();
        assert!(err.contains("\"gone\"") && err.contains("available: minimal, tools") && !err.contains('~'), "{err}");
    }
}
