//! An image archive on disk → an imported image's tree in a staging dir, ready to be put in
//! place: name, layers applied in order (each checked against its digests), `image.json` last.
//!
//! Blocking code (file I/O all the way): the manager runs it on a blocking thread and passes a
//! progress callback that reports whether the client is still there.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use super::archive::{self, Compression, Hashing, ImageArchive};
use super::catalog::remove_any;
use super::layer::{self, LayerError, Limits, Totals};
use super::meta::{rfc3339, ImageJson};
use super::{human, is_valid_name, Catalog, ImageError, Viewer};
use crate::config::ImagesConfig;
use crate::model::ImageProgress;

/// Most bytes read after a layer's end-of-archive marker (tar pads to 10 KiB records).
const MAX_TRAILER_BYTES: u64 = 1 << 20;

/// What is being imported.
#[derive(Debug, Clone)]
pub struct ImportSpec {
    /// The name asked for; empty: from the archive's references, else from `name_hint`.
    pub name: String,
    /// The name of last resort (a file stem, a Docker reference).
    pub name_hint: String,
    /// Where it came from, for `image.json` and ImageInfo.
    pub source: String,
    /// Who imports it: the image is its tenant's, stored under its key (see `owner`) ...
    pub viewer: Viewer,
    /// ... unless shared with every tenant (an image admin's choice, checked by the caller).
    pub shared: bool,
}

impl ImportSpec {
    /// The catalog key the image `name` of this import is stored under.
    pub fn key(&self, name: &str) -> String {
        if self.shared {
            name.to_string()
        } else {
            self.viewer.key(name)
        }
    }
}

/// An image assembled in a staging dir, not yet in the catalog. Dropping it removes the
/// staging dir unless it was committed (renamed away).
#[derive(Debug)]
pub struct Staged {
    /// The catalog key (see `owner`).
    pub name: String,
    pub dir: PathBuf,
    pub json: ImageJson,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.dir.exists() {
            remove_any(&self.dir);
        }
    }
}

/// What the import found to do.
#[derive(Debug)]
pub enum Prepared {
    /// An imported image of that name has that digest already: nothing was done.
    Unchanged {
        /// The catalog key.
        name: String,
        digest: String,
    },
    Staged(Box<Staged>),
}

/// Where progress goes; `false` means the client went away (the import stops).
pub type Progress<'a> = &'a mut dyn FnMut(ImageProgress) -> bool;

/// The catalog name of the import: the one asked for, else the archive's first usable
/// reference, else the hint.
pub fn choose_name(spec: &ImportSpec, archive: &ImageArchive) -> Result<String, ImageError> {
    if !spec.name.is_empty() {
        if !is_valid_name(&spec.name) {
            return Err(ImageError::Invalid {
                field: "name",
                message: format!("{:?}: 1-{} of [A-Za-z0-9._-], not starting with '.'", spec.name.chars().take(80).collect::<String>(), super::MAX_NAME_BYTES),
            });
        }
        return Ok(spec.name.clone());
    }
    archive
        .references
        .iter()
        .filter(|r| r.contains(':') || r.contains('/'))
        .find_map(|r| archive::name_from_reference(r))
        // An image ID (`sha256:…`) names no image.
        .or_else(|| if spec.name_hint.starts_with("sha256:") { None } else { archive::name_from_reference(&spec.name_hint) })
        .ok_or_else(|| ImageError::Invalid { field: "name", message: "the archive names no image and none was given; pass a name".into() })
}

/// Reads the archive at `path` and, unless the same image is already imported under its name,
/// assembles it in a staging dir of at most `room` bytes of file data (what is left of the
/// image store's budget, see `store`) and `images.max_rootfs_bytes`. `gone` says whether the
/// client went away (polled while a layer is applied, so a long layer stops soon after).
#[allow(clippy::too_many_arguments)]
pub fn stage(
    catalog: &Catalog,
    cfg: &ImagesConfig,
    room: u64,
    path: &Path,
    spec: &ImportSpec,
    progress: Progress<'_>,
    gone: &dyn Fn() -> bool,
) -> Result<Prepared, ImageError> {
    let started = Instant::now();
    let archive = ImageArchive::open(path)?;
    let name = choose_name(spec, &archive)?;
    if catalog.is_script_built(&name) {
        return Err(ImageError::Refused(format!("image {name:?} is a script-built image of the operator's images dir; import under another name")));
    }
    let display = name;
    let name = spec.key(&display);
    if archive.images > 1 {
        progress(ImageProgress::say("metadata", format!("the archive holds {} images; importing the first", archive.images)));
    }
    if let Some(existing) = catalog.imported(&name) {
        if existing.json().digest == archive.digest {
            return Ok(Prepared::Unchanged { name, digest: archive.digest });
        }
    }
    // Sizes from the archive's headers: client data, so added without overflow.
    let total = archive.layers.iter().fold(0u64, |a, l| a.saturating_add(l.size));
    let go_on = progress(ImageProgress {
        phase: "layers",
        message: format!("{} ({}), {} layers, {}", display, archive.format.name(), archive.layers.len(), human(total)),
        total_bytes: total,
        total_count: archive.layers.len() as u64,
        ..Default::default()
    });
    if !go_on {
        return Err(ImageError::Aborted("the client went away".into()));
    }

    let mut staging = Staged { name: name.clone(), dir: catalog.staging_path(&name), json: ImageJson::default() };
    let rootfs = staging.dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).map_err(|e| ImageError::io("creating the staging dir", e))?;
    std::fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(|e| ImageError::io("chmod the rootfs", e))?;
    let root = File::open(&rootfs).map_err(|e| ImageError::io("opening the rootfs", e))?;
    let limits = Limits { max_bytes: cfg.max_rootfs_bytes.min(room), max_entries: cfg.max_entries };
    // The store's room, not the image's own bound, is what a "max_rootfs_bytes" stop meant.
    let store_full = |e: ImageError| {
        match e {
        ImageError::Limit { key: "max_rootfs_bytes", .. } if room < cfg.max_rootfs_bytes => ImageError::StoreFull(format!(
            "the image store is full: the layers of {display} hold more than the {} left of images.max_store_bytes (or of your images.max_store_bytes_per_tenant); remove images (sbx image rm) or raise the limit",
            human(room)
        )),
        e => e,
    }
    };
    let mut totals = Totals::default();
    let mut done = 0u64;
    for (i, l) in archive.layers.iter().enumerate() {
        if gone() {
            return Err(ImageError::Aborted("the client went away".into()));
        }
        let layer_started = Instant::now();
        let mut raw = Hashing::new(ImageArchive::layer_reader(path, l)?);
        let stats = {
            let mut buffered = BufReader::with_capacity(256 << 10, &mut raw);
            let stats = match archive::compression(&mut buffered, &l.member)? {
                Compression::Gzip => {
                    apply_checked(root.as_fd(), flate2::read::GzDecoder::new(&mut buffered), l, &mut totals, &limits, gone).map_err(store_full)?
                }
                Compression::None => apply_checked(root.as_fd(), &mut buffered, l, &mut totals, &limits, gone).map_err(store_full)?,
            };
            io::copy(&mut buffered, &mut io::sink()).map_err(|e| ImageError::io(format!("reading layer {}", l.member), e))?;
            stats
        };
        if let Some(want) = &l.blob_digest {
            if &raw.digest() != want {
                return Err(ImageError::Archive(format!("layer {} has digest {}, not {want}", l.member, raw.digest())));
            }
        }
        done = done.saturating_add(l.size);
        if stats.skipped > 0 {
            tracing::info!(image = %name, layer = %l.member, skipped = stats.skipped, "device nodes, FIFOs or other special entries skipped");
        }
        let go_on = progress(ImageProgress {
            phase: "layers",
            message: format!(
                "layer {}/{}: {} files, {} dirs, {} links, {} whiteouts, {} skipped, {} ({} ms)",
                i + 1,
                archive.layers.len(),
                stats.files,
                stats.dirs,
                stats.symlinks + stats.hardlinks,
                stats.whiteouts,
                stats.skipped,
                human(stats.bytes),
                layer_started.elapsed().as_millis()
            ),
            bytes: done,
            total_bytes: total,
            count: i as u64 + 1,
            total_count: archive.layers.len() as u64,
            ..Default::default()
        });
        if !go_on {
            return Err(ImageError::Aborted("the client went away".into()));
        }
    }
    let now = SystemTime::now();
    let json = ImageJson {
        name: display.clone(),
        owner: spec.viewer.tenant.clone(),
        shared: spec.shared,
        source: spec.source.clone(),
        digest: archive.digest.clone(),
        size_bytes: totals.bytes,
        created: archive.created.clone().filter(|c| humantime::parse_rfc3339_weak(c).is_ok()).unwrap_or_else(|| rfc3339(now)),
        imported_at: rfc3339(now),
        format: archive.format.name().to_string(),
        layers: archive.layers.len() as u64,
        entries: totals.entries,
        config: archive.config.clone(),
        ..Default::default()
    };
    // image.json last: it is what makes the directory an image.
    let text = serde_json::to_vec_pretty(&json).map_err(|e| ImageError::Internal(format!("encoding image.json: {e}")))?;
    let tmp = staging.dir.join("image.json.tmp");
    std::fs::write(&tmp, text).map_err(|e| ImageError::io("writing image.json", e))?;
    std::fs::rename(&tmp, staging.dir.join("image.json")).map_err(|e| ImageError::io("writing image.json", e))?;
    tracing::info!(image = %name, digest = %archive.digest, layers = archive.layers.len(), entries = totals.entries, bytes = totals.bytes, ms = started.elapsed().as_millis() as u64, "image layers applied");
    staging.json = json;
    Ok(Prepared::Staged(Box::new(staging)))
}

/// Applies one (decompressed) layer, drains what follows its end marker, and checks the
/// uncompressed digest against the config's `diff_id`.
fn apply_checked<R: Read>(
    root: std::os::fd::BorrowedFd<'_>,
    input: R,
    l: &archive::LayerRef,
    totals: &mut Totals,
    limits: &Limits,
    gone: &dyn Fn() -> bool,
) -> Result<layer::LayerStats, ImageError> {
    let mut plain = Hashing::new(input);
    let stats = layer::apply(root, &mut plain, totals, limits, gone).map_err(|e| layer_error(&l.member, e))?;
    let trailer =
        io::copy(&mut (&mut plain).take(MAX_TRAILER_BYTES + 1), &mut io::sink()).map_err(|e| ImageError::Archive(format!("layer {}: {e}", l.member)))?;
    if trailer > MAX_TRAILER_BYTES {
        return Err(ImageError::Archive(format!("layer {}: more than {} after its end-of-archive marker", l.member, human(MAX_TRAILER_BYTES))));
    }
    if let Some(want) = &l.diff_id {
        if &plain.digest() != want {
            return Err(ImageError::Archive(format!("layer {}: its content has digest {}, the config says {want}", l.member, plain.digest())));
        }
    }
    Ok(stats)
}

/// A layer's error as the image's.
fn layer_error(member: &str, e: LayerError) -> ImageError {
    match e {
        LayerError::Limit { path, what, limit, key } => {
            let key = if key.is_empty() { "max_entries" } else { key };
            let limit = if what.starts_with("bytes") { human(limit) } else { limit.to_string() };
            ImageError::Limit { what: format!("layer {member}, entry {path}: {what}"), limit, key }
        }
        LayerError::Io { path, source } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            ImageError::io(format!("layer {member}, entry {path}: the image store's disk is full"), source)
        }
        LayerError::Io { path, source } => ImageError::io(format!("layer {member}, entry {path}"), source),
        LayerError::Cancelled => ImageError::Aborted("the client went away".into()),
        e @ (LayerError::Unsafe { .. } | LayerError::Unsupported { .. } | LayerError::Malformed { .. }) => ImageError::Archive(format!("layer {member}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o755);
            h.set_cksum();
            b.append_data(&mut h, name, *data).expect("append");
        }
        b.into_inner().expect("tar")
    }

    fn digest(bytes: &[u8]) -> String {
        format!("sha256:{}", super::super::hex(&Sha256::digest(bytes)))
    }

    /// A `docker save` archive of the given layers, written into `dir`.
    fn docker_save(dir: &Path, layers: &[Vec<u8>], env: &[&str], tag: &str) -> PathBuf {
        let diff_ids: Vec<String> = layers.iter().map(|l| digest(l)).collect();
        let cfg = serde_json::to_vec(&serde_json::json!({"config": {"Env": env, "WorkingDir": "/srv"}, "rootfs": {"diff_ids": diff_ids}})).expect("json");
        let id = digest(&cfg).trim_start_matches("sha256:").to_string();
        let names: Vec<String> = (0..layers.len()).map(|i| format!("l{i}/layer.tar")).collect();
        let manifest = serde_json::to_vec(&serde_json::json!([{"Config": format!("{id}.json"), "RepoTags": [tag], "Layers": names}])).expect("json");
        let path = dir.join(format!("{}.tar", tag.replace([':', '/'], "_")));
        let mut b = tar::Builder::new(File::create(&path).expect("create"));
        let mut add = |name: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data).expect("append");
        };
        for (n, l) in names.iter().zip(layers) {
            add(n, l);
        }
        add(&format!("{id}.json"), &cfg);
        add("manifest.json", &manifest);
        b.finish().expect("finish");
        path
    }

    fn catalog(tmp: &Path) -> Catalog {
        std::fs::create_dir_all(tmp.join("images/minimal/rootfs")).expect("mkdir");
        std::fs::write(tmp.join("images/minimal/image.json"), "{}").expect("write");
        let c = Catalog::new(&tmp.join("images"), &tmp.join("state"), "minimal");
        c.prepare().expect("prepare");
        c
    }

    fn spec(name: &str) -> ImportSpec {
        // Shared, so the keys are the names.
        ImportSpec { name: name.into(), name_hint: "file".into(), source: "archive:test.tar".into(), viewer: viewer(), shared: true }
    }

    fn viewer() -> Viewer {
        Viewer { tenant: "t".into(), owns_legacy: false, admin: true }
    }

    #[test]
    fn an_archive_becomes_a_staged_image_and_the_same_digest_is_a_no_op() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let c = catalog(tmp.path());
        let path = docker_save(
            tmp.path(),
            &[layer(&[("bin/tool", b"v1"), ("etc/x", b"1")]), layer(&[("bin/tool", b"v2"), ("etc/.wh.x", b"")])],
            &["A=1"],
            "reg/app:3",
        );
        let mut events = Vec::new();
        let prepared = stage(
            &c,
            &ImagesConfig::default(),
            u64::MAX,
            &path,
            &spec(""),
            &mut |e| {
                events.push(e);
                true
            },
            &|| false,
        )
        .expect("stage");
        let Prepared::Staged(staged) = prepared else { panic!("not staged") };
        assert_eq!(staged.name, "app", "named after RepoTags");
        assert_eq!(std::fs::read(staged.dir.join("rootfs/bin/tool")).expect("read"), b"v2");
        assert!(!staged.dir.join("rootfs/etc/x").exists());
        assert_eq!(staged.json.config.env.get("A").map(String::as_str), Some("1"));
        assert_eq!((staged.json.layers, staged.json.size_bytes), (2, 5));
        assert!(events.iter().any(|e| e.phase == "layers" && e.count == 2 && e.total_count == 2), "{events:?}");
        let dir = staged.dir.clone();
        c.commit(&dir, "app").expect("commit");
        drop(staged);
        assert!(c.resolve("app").expect("in the catalog").rootfs().join("bin/tool").exists(), "a committed image is not removed");
        let again = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec("app"), &mut |_| true, &|| false).expect("again");
        assert!(matches!(again, Prepared::Unchanged { .. }), "{again:?}");
        // A script-built name is refused; a dropped staging dir is removed.
        let err = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec("minimal"), &mut |_| true, &|| false).expect_err("script name");
        assert!(matches!(err, ImageError::Refused(_)), "{err}");
        match stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec("other"), &mut |_| true, &|| false).expect("other") {
            Prepared::Staged(s) => {
                let d = s.dir.clone();
                drop(s);
                assert!(!d.exists());
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn a_layer_that_is_not_its_diff_id_and_a_hostile_layer_are_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let c = catalog(tmp.path());
        // The config names one layer, the archive carries another under its name.
        let good = layer(&[("a", b"1")]);
        let path = docker_save(tmp.path(), std::slice::from_ref(&good), &[], "x:1");
        let bytes = std::fs::read(&path).expect("read");
        let swapped = layer(&[("b", b"2")]);
        assert_eq!(good.len(), swapped.len());
        let at = bytes.windows(good.len()).position(|w| w == good.as_slice()).expect("layer in archive");
        let mut forged = bytes.clone();
        forged[at..at + good.len()].copy_from_slice(&swapped);
        std::fs::write(&path, forged).expect("write");
        let err = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec("x"), &mut |_| true, &|| false).expect_err("forged");
        assert!(err.to_string().contains("digest"), "{err}");
        assert_eq!(std::fs::read_dir(c.imported_dir()).expect("ls").count(), 0, "no staging dir left behind");
        // `..` in a layer: refused, nothing outside the staging dir.
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().expect("gnu").name[..12].copy_from_slice(b"../../escape");
        h.set_size(1);
        h.set_mode(0o644);
        h.set_cksum();
        let mut evil = h.as_bytes().to_vec();
        evil.extend_from_slice(b"x");
        evil.resize(1024, 0);
        evil.extend_from_slice(&[0; 1024]);
        let path = docker_save(tmp.path(), &[evil], &[], "evil:1");
        let err = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec(""), &mut |_| true, &|| false).expect_err("evil");
        assert!(matches!(err, ImageError::Archive(_)) && err.to_string().contains("escape"), "{err}");
        assert!(!tmp.path().join("escape").exists() && !tmp.path().join("state/escape").exists());
        // Bounds are the configured keys.
        let path = docker_save(tmp.path(), &[layer(&[("big", &[0u8; 4096])])], &[], "big:1");
        let small = ImagesConfig { max_rootfs_bytes: 1000, ..Default::default() };
        let err = stage(&c, &small, u64::MAX, &path, &spec(""), &mut |_| true, &|| false).expect_err("bound");
        assert!(matches!(err, ImageError::Limit { key: "max_rootfs_bytes", .. }), "{err}");
        // The store's room, when smaller, stops it as a full store.
        let err = stage(&c, &ImagesConfig::default(), 1000, &path, &spec(""), &mut |_| true, &|| false).expect_err("room");
        assert!(matches!(&err, ImageError::StoreFull(m) if m.contains("images.max_store_bytes")), "{err}");
    }

    #[test]
    fn an_oci_layout_with_gzip_layers_is_applied() {
        use std::io::Write;
        let tmp = tempfile::tempdir().expect("tempdir");
        let c = catalog(tmp.path());
        let plain = [layer(&[("usr/bin/tool", b"gz-ok")]), layer(&[("usr/bin/.wh.tool", b""), ("etc/conf", b"1")])];
        let gz: Vec<Vec<u8>> = plain
            .iter()
            .map(|l| {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(l).expect("gz");
                e.finish().expect("gz")
            })
            .collect();
        let cfg =
            serde_json::to_vec(&serde_json::json!({"config": {"Cmd": ["tool"]}, "rootfs": {"diff_ids": plain.iter().map(|l| digest(l)).collect::<Vec<_>>()}}))
                .expect("json");
        let manifest = serde_json::to_vec(&serde_json::json!({
            "config": {"digest": digest(&cfg)},
            "layers": gz.iter().map(|g| serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest(g)})).collect::<Vec<_>>()
        }))
        .expect("json");
        let index = serde_json::to_vec(
            &serde_json::json!({"manifests": [{"digest": digest(&manifest), "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}),
        )
        .expect("json");
        let path = tmp.path().join("oci.tar");
        let mut b = tar::Builder::new(File::create(&path).expect("create"));
        let blob = |d: &str| format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        let mut members = vec![
            ("index.json".to_string(), index),
            ("oci-layout".to_string(), b"{}".to_vec()),
            (blob(&digest(&manifest)), manifest.clone()),
            (blob(&digest(&cfg)), cfg.clone()),
        ];
        members.extend(gz.iter().map(|g| (blob(&digest(g)), g.clone())));
        for (name, data) in &members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data.as_slice()).expect("append");
        }
        b.finish().expect("finish");
        drop(b);
        // No usable reference in the archive ("latest" is a tag): the file's stem names it.
        let spec = ImportSpec { name: String::new(), name_hint: "oci-tool".into(), source: "archive:oci-tool.tar".into(), viewer: viewer(), shared: true };
        let Prepared::Staged(staged) = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec, &mut |_| true, &|| false).expect("stage") else {
            panic!("not staged")
        };
        assert_eq!((staged.name.as_str(), staged.json.format.as_str(), staged.json.layers), ("oci-tool", "oci", 2));
        assert!(!staged.dir.join("rootfs/usr/bin/tool").exists(), "whited out by the second gzip layer");
        assert_eq!(std::fs::read(staged.dir.join("rootfs/etc/conf")).expect("read"), b"1");
        assert_eq!(staged.json.config.cmd, ["tool"]);
        // A client that goes away stops the import.
        let err = stage(&c, &ImagesConfig::default(), u64::MAX, &path, &spec, &mut |_| true, &|| true).expect_err("gone");
        assert!(matches!(err, ImageError::Aborted(_)), "{err}");
    }
}
