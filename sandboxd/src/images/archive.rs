//! Reading an image archive on disk: a `docker save` tar (`manifest.json`, `<id>.json`,
//! `<id>/layer.tar`) or an OCI image-layout tar (`oci-layout`, `index.json`, `blobs/sha256/…`).
//! When both are there (Docker 25 writes both) `manifest.json` is used.
//!
//! The archive is indexed once (member → offset and size, without reading data: the file is
//! seekable), its small JSON documents are read into memory under a bound, and each layer is
//! later read straight from its place in the file ([`ImageArchive::layer_reader`]), so nothing
//! is held in memory whatever the image's size. The archive is a client's: its names, digests
//! and sizes are checked, never trusted to name a path on the host.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{hex, ImageError};
use crate::model::ImageConfig;

/// Largest JSON document read from an archive (manifest, index, config).
const MAX_JSON_BYTES: u64 = 8 << 20;
/// Most members the outer archive may have (a `docker save` of one image has a few per layer).
const MAX_MEMBERS: usize = 100_000;
/// Most bytes of headers and long names per member of the outer archive.
const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Longest variable of an image's env (the kernel's MAX_ARG_STRLEN).
const MAX_ENV_VAR_BYTES: usize = 32 * 4096;
/// Most bytes of an image's whole env: the sandbox's env and a command line need room too.
const MAX_IMAGE_ENV_BYTES: usize = 64 << 10;
/// Most links followed to find a member (`docker save` links layers shared between images).
const MAX_LINK_HOPS: usize = 8;

/// Which layout the archive has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    DockerSave,
    Oci,
}

impl Format {
    /// Its name in `image.json`.
    pub fn name(self) -> &'static str {
        match self {
            Format::DockerSave => "docker-save",
            Format::Oci => "oci",
        }
    }
}

/// A regular member of the archive: where its data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    offset: u64,
    size: u64,
}

/// One layer, in the order the image applies them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRef {
    /// The member's name in the archive (for messages).
    pub member: String,
    offset: u64,
    /// Bytes as stored (compressed or not).
    pub size: u64,
    /// `sha256:<hex>` of the stored bytes, when the manifest says (OCI descriptors).
    pub blob_digest: Option<String>,
    /// `sha256:<hex>` of the uncompressed tar, from the config's `rootfs.diff_ids`.
    pub diff_id: Option<String>,
}

/// What the archive holds.
#[derive(Debug, Clone)]
pub struct ImageArchive {
    pub format: Format,
    /// `sha256:<hex>` of the image config, computed here (the Docker image ID).
    pub digest: String,
    pub config: ImageConfig,
    /// The config's `created`.
    pub created: Option<String>,
    pub layers: Vec<LayerRef>,
    /// References the archive gives the image (RepoTags, OCI ref-name annotations), for a
    /// default name.
    pub references: Vec<String>,
    /// Images in the archive (the first is the one read).
    pub images: usize,
}

/// A read budget over the outer archive: the `tar` crate reads long names and PAX records into
/// memory, so each member may only cost so much; data is skipped by seeking.
struct Metered<'b, R> {
    inner: R,
    left: &'b std::cell::Cell<u64>,
}

impl<R: Read> Read for Metered<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left.get();
        if left == 0 {
            return Err(io::Error::other("archive header budget exhausted"));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left.set(left - n as u64);
        Ok(n)
    }
}

impl<R: Seek> Seek for Metered<'_, R> {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.inner.seek(pos)
    }
}

fn malformed(what: impl std::fmt::Display) -> ImageError {
    ImageError::Archive(what.to_string())
}

/// A member name as a key: no leading `./` or `/`, no trailing `/`, `.` components dropped,
/// `..` resolved textually (never above the archive's root).
fn normalize(name: &str) -> Option<String> {
    let mut out: Vec<&str> = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop()?;
            }
            c => out.push(c),
        }
    }
    Some(out.join("/"))
}

/// Indexes the archive's regular members and symlinks.
/// Regular members by name, and links by name with their target.
type Index = (HashMap<String, Member>, HashMap<String, String>);

fn index(file: &File) -> Result<Index, ImageError> {
    let budget = std::cell::Cell::new(MAX_HEADER_BYTES);
    let mut reader = Metered { inner: BufReader::new(file), left: &budget };
    reader.seek(SeekFrom::Start(0)).map_err(|e| ImageError::io("reading the archive", e))?;
    let mut archive = tar::Archive::new(reader);
    let mut members = HashMap::new();
    let mut links = HashMap::new();
    let mut entries = archive.entries_with_seek().map_err(|e| malformed(format!("not a tar archive: {e}")))?;
    let mut count = 0usize;
    loop {
        budget.set(MAX_HEADER_BYTES);
        let entry = match entries.next() {
            None => break,
            Some(Ok(e)) => e,
            Some(Err(e)) => return Err(malformed(format!("not a readable tar archive after {count} members: {e}"))),
        };
        count += 1;
        if count > MAX_MEMBERS {
            return Err(malformed(format!("more than {MAX_MEMBERS} members: not an image archive")));
        }
        let Some(name) = String::from_utf8(entry.path_bytes().into_owned()).ok().and_then(|n| normalize(&n)) else { continue };
        match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                members.insert(name, Member { offset: entry.raw_file_position(), size: entry.size() });
            }
            tar::EntryType::Symlink | tar::EntryType::Link => {
                if let Some(target) = entry.link_name_bytes().and_then(|t| String::from_utf8(t.into_owned()).ok()) {
                    // A symlink is relative to its directory; a hard link names a member.
                    let full = if entry.header().entry_type() == tar::EntryType::Symlink {
                        match name.rsplit_once('/') {
                            Some((dir, _)) => format!("{dir}/{target}"),
                            None => target,
                        }
                    } else {
                        target
                    };
                    if let Some(full) = normalize(&full) {
                        links.insert(name, full);
                    }
                }
            }
            _ => {}
        }
    }
    Ok((members, links))
}

impl ImageArchive {
    /// Reads what the archive at `path` holds.
    pub fn open(path: &Path) -> Result<ImageArchive, ImageError> {
        let file = File::open(path).map_err(|e| ImageError::io("opening the archive", e))?;
        let (members, links) = index(&file)?;
        let reader = Reader { file: &file, members: &members, links: &links };
        if reader.find("manifest.json").is_some() {
            reader.docker_save()
        } else if reader.find("index.json").is_some() {
            reader.oci()
        } else {
            Err(malformed("neither manifest.json (docker save) nor index.json (OCI image layout) in the archive"))
        }
    }

    /// The stored bytes of layer `layer` from the archive at `path`.
    pub fn layer_reader(path: &Path, layer: &LayerRef) -> Result<io::Take<File>, ImageError> {
        let mut file = File::open(path).map_err(|e| ImageError::io("opening the archive", e))?;
        file.seek(SeekFrom::Start(layer.offset)).map_err(|e| ImageError::io("reading the archive", e))?;
        Ok(file.take(layer.size))
    }
}

/// Lookups in an indexed archive.
struct Reader<'a> {
    file: &'a File,
    members: &'a HashMap<String, Member>,
    links: &'a HashMap<String, String>,
}

#[derive(Deserialize)]
struct DockerManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    digest: String,
    #[serde(default)]
    annotations: HashMap<String, String>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize, Default)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

/// An OCI index or manifest (both shapes; which one it is shows in its fields).
#[derive(Deserialize, Default)]
struct OciDocument {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

/// The parts of an image config the store reads.
#[derive(Deserialize, Default)]
struct ConfigJson {
    #[serde(default)]
    created: Option<String>,
    #[serde(default)]
    config: Option<RunConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Deserialize, Default)]
struct RunConfig {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// `sha256:<64 hex>`'s hex, or `None`.
fn sha256_hex(digest: &str) -> Option<&str> {
    let h = digest.strip_prefix("sha256:")?;
    (h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())).then_some(h)
}

impl Reader<'_> {
    /// The member `name`, through links.
    fn find(&self, name: &str) -> Option<(String, Member)> {
        let mut name = normalize(name)?;
        for _ in 0..MAX_LINK_HOPS {
            if let Some(m) = self.members.get(&name) {
                return Some((name, *m));
            }
            name = self.links.get(&name)?.clone();
        }
        None
    }

    /// A whole (small) member.
    fn read(&self, name: &str) -> Result<Vec<u8>, ImageError> {
        let (_, m) = self.find(name).ok_or_else(|| malformed(format!("{name} is missing")))?;
        if m.size > MAX_JSON_BYTES {
            return Err(malformed(format!("{name} is {} bytes; at most {MAX_JSON_BYTES}", m.size)));
        }
        let mut buf = vec![0; m.size as usize];
        std::os::unix::fs::FileExt::read_exact_at(self.file, &mut buf, m.offset).map_err(|e| ImageError::io(format!("reading {name} from the archive"), e))?;
        Ok(buf)
    }

    fn json<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<T, ImageError> {
        serde_json::from_slice(&self.read(name)?).map_err(|e| malformed(format!("{name}: {e}")))
    }

    fn blob_name(digest: &str) -> Result<String, ImageError> {
        let h = sha256_hex(digest).ok_or_else(|| malformed(format!("digest {digest:?} is not sha256:<64 lowercase hex>")))?;
        Ok(format!("blobs/sha256/{h}"))
    }

    fn layer(&self, name: &str, blob_digest: Option<String>) -> Result<LayerRef, ImageError> {
        let (member, m) = self.find(name).ok_or_else(|| malformed(format!("layer {name} is missing")))?;
        Ok(LayerRef { member, offset: m.offset, size: m.size, blob_digest, diff_id: None })
    }

    fn docker_save(&self) -> Result<ImageArchive, ImageError> {
        let manifests: Vec<DockerManifest> = self.json("manifest.json")?;
        let images = manifests.len();
        let first = manifests.into_iter().next().ok_or_else(|| malformed("manifest.json lists no image"))?;
        let config = self.read(&first.config)?;
        // `<id>.json` or `blobs/sha256/<id>`: the name is the config's digest, checked.
        let named = first.config.trim_end_matches(".json").rsplit('/').next().unwrap_or_default().to_string();
        let layers = first.layers.iter().map(|l| self.layer(l, None)).collect::<Result<Vec<_>, _>>()?;
        let mut archive = finish(Format::DockerSave, &config, layers, first.repo_tags.unwrap_or_default(), images)?;
        if named.len() == 64 && named.bytes().all(|b| b.is_ascii_hexdigit()) && archive.digest != format!("sha256:{named}") {
            return Err(malformed(format!("config {} does not have the digest its name says ({})", first.config, archive.digest)));
        }
        archive.format = Format::DockerSave;
        Ok(archive)
    }

    fn oci(&self) -> Result<ImageArchive, ImageError> {
        let index: OciDocument = self.json("index.json")?;
        let images = index.manifests.len();
        let mut refs = Vec::new();
        // Down through nested indexes (a multi-platform image) to one manifest: linux/amd64 if
        // listed, else the first.
        let mut doc = index;
        for _ in 0..4 {
            if doc.config.is_some() {
                break;
            }
            let pick = doc.manifests.iter().position(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64")).unwrap_or(0);
            let desc = doc.manifests.get(pick).ok_or_else(|| malformed("the OCI index lists no manifest"))?;
            for key in ["io.containerd.image.name", "org.opencontainers.image.ref.name"] {
                if let Some(v) = desc.annotations.get(key) {
                    refs.push(v.clone());
                }
            }
            let name = Self::blob_name(&desc.digest)?;
            let bytes = self.read(&name)?;
            check_digest(&bytes, &desc.digest, &name)?;
            doc = serde_json::from_slice(&bytes).map_err(|e| malformed(format!("{name}: {e}")))?;
        }
        let Some(config_desc) = doc.config.as_ref() else {
            return Err(malformed(format!("no image manifest found in the OCI layout (media type {:?})", doc.media_type)));
        };
        let config_name = Self::blob_name(&config_desc.digest)?;
        let config = self.read(&config_name)?;
        check_digest(&config, &config_desc.digest, &config_name)?;
        let mut layers = Vec::new();
        for l in &doc.layers {
            if !(l.media_type.is_empty() || l.media_type.contains("tar")) {
                return Err(malformed(format!("layer {} has media type {:?}, not a tar", l.digest, l.media_type)));
            }
            layers.push(self.layer(&Self::blob_name(&l.digest)?, Some(l.digest.clone()))?);
        }
        finish(Format::Oci, &config, layers, refs, images)
    }
}

/// Refuses a document whose bytes do not have the digest it is known by.
fn check_digest(bytes: &[u8], digest: &str, name: &str) -> Result<(), ImageError> {
    let actual = format!("sha256:{}", hex(&Sha256::digest(bytes)));
    if actual != digest {
        return Err(malformed(format!("{name} has digest {actual}, not {digest}")));
    }
    Ok(())
}

/// The archive's image from its config and layers.
fn finish(format: Format, config: &[u8], mut layers: Vec<LayerRef>, references: Vec<String>, images: usize) -> Result<ImageArchive, ImageError> {
    let digest = format!("sha256:{}", hex(&Sha256::digest(config)));
    let parsed: ConfigJson = serde_json::from_slice(config).map_err(|e| malformed(format!("image config: {e}")))?;
    let diff_ids = parsed.rootfs.map(|r| r.diff_ids).unwrap_or_default();
    if !diff_ids.is_empty() {
        if diff_ids.len() != layers.len() {
            return Err(malformed(format!("the config lists {} layers, the manifest {}", diff_ids.len(), layers.len())));
        }
        for (layer, id) in layers.iter_mut().zip(diff_ids) {
            sha256_hex(&id).ok_or_else(|| malformed(format!("diff_id {id:?} is not sha256:<64 lowercase hex>")))?;
            layer.diff_id = Some(id);
        }
    }
    let run = parsed.config.unwrap_or_default();
    // The env becomes every exec's: variables execve would refuse are dropped, and the whole of
    // it stays small enough to leave room for the sandbox's own env and a command line.
    let mut env = std::collections::BTreeMap::new();
    let mut env_bytes = 0usize;
    for kv in run.env.unwrap_or_default() {
        let Some((k, v)) = kv.split_once('=') else { continue };
        if k.is_empty() || kv.contains('\0') || kv.len() + 1 > MAX_ENV_VAR_BYTES || env_bytes + kv.len() + 1 > MAX_IMAGE_ENV_BYTES {
            tracing::warn!(variable = %k.chars().take(64).collect::<String>(), "an image's env variable is dropped (empty name, NUL, or over the size bound)");
            continue;
        }
        env_bytes += kv.len() + 1;
        env.insert(k.to_string(), v.to_string());
    }
    let config = ImageConfig {
        env,
        workdir: run.working_dir.filter(|w| w.starts_with('/') && !w.contains('\0')).unwrap_or_default(),
        user: run.user.unwrap_or_default(),
        entrypoint: run.entrypoint.unwrap_or_default(),
        cmd: run.cmd.unwrap_or_default(),
    };
    Ok(ImageArchive { format, digest, config, created: parsed.created, layers, references, images })
}

/// How a layer is compressed, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
}

/// Looks at the first bytes of a layer: gzip, or a plain tar; zstd and others are refused.
pub fn compression<R: BufRead>(reader: &mut R, member: &str) -> Result<Compression, ImageError> {
    let head = reader.fill_buf().map_err(|e| ImageError::io(format!("reading layer {member}"), e))?;
    match head {
        [0x1f, 0x8b, ..] => Ok(Compression::Gzip),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => {
            Err(malformed(format!("layer {member} is zstd-compressed, which is not supported (re-save it with gzip or uncompressed)")))
        }
        [b'B', b'Z', b'h', ..] | [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => {
            Err(malformed(format!("layer {member} is bzip2/xz-compressed, which is not supported")))
        }
        _ => Ok(Compression::None),
    }
}

/// A reader that hashes what passes through it.
pub struct Hashing<R> {
    pub inner: R,
    pub hasher: Sha256,
}

impl<R> Hashing<R> {
    pub fn new(inner: R) -> Self {
        Hashing { inner, hasher: Sha256::new() }
    }

    /// `sha256:<hex>` of what was read.
    pub fn digest(&self) -> String {
        format!("sha256:{}", hex(&self.hasher.clone().finalize()))
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// A name for the image from a reference: the last path component of the repository, without
/// tag or digest (`docker.io/library/debian:bookworm` → `debian`), if it is a valid name.
pub fn name_from_reference(reference: &str) -> Option<String> {
    let no_digest = reference.split('@').next().unwrap_or_default();
    let last = no_digest.rsplit('/').next().unwrap_or_default();
    let repo = last.split(':').next().unwrap_or_default();
    super::is_valid_name(repo).then(|| repo.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a tar of `(name, bytes)` members to a file in `dir`.
    pub(crate) fn tar_file(dir: &Path, members: &[(&str, Vec<u8>)]) -> std::path::PathBuf {
        let path = dir.join("image.tar");
        let mut b = tar::Builder::new(File::create(&path).expect("create"));
        for (name, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data.as_slice()).expect("append");
        }
        b.finish().expect("finish");
        path
    }

    fn layer_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "hello", &b"hi"[..]).expect("append");
        b.into_inner().expect("tar")
    }

    fn digest(bytes: &[u8]) -> String {
        format!("sha256:{}", hex(&Sha256::digest(bytes)))
    }

    fn config(diff_id: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "created": "2024-05-06T07:08:09Z",
            "config": {"Env": ["PATH=/usr/bin", "LANG=en_US.UTF-8"], "WorkingDir": "/app", "User": "app", "Cmd": ["python3"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]}
        }))
        .expect("json")
    }

    #[test]
    fn docker_save_manifest_is_read_and_its_config_checked() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let layer = layer_tar();
        let cfg = config(&digest(&layer));
        let id = digest(&cfg).trim_start_matches("sha256:").to_string();
        let manifest = serde_json::json!([{"Config": format!("{id}.json"), "RepoTags": ["registry.example/team/py-app:1.0"], "Layers": ["abc/layer.tar"]}]);
        let path = tar_file(
            tmp.path(),
            &[("abc/layer.tar", layer.clone()), (&format!("{id}.json"), cfg.clone()), ("manifest.json", serde_json::to_vec(&manifest).expect("json"))],
        );
        let a = ImageArchive::open(&path).expect("open");
        assert_eq!((a.format, a.digest.clone(), a.layers.len(), a.images), (Format::DockerSave, format!("sha256:{id}"), 1, 1));
        assert_eq!(a.config.workdir, "/app");
        assert_eq!(a.config.env.get("LANG").map(String::as_str), Some("en_US.UTF-8"));
        assert_eq!(a.layers[0].diff_id.as_deref(), Some(digest(&layer).as_str()));
        assert_eq!(name_from_reference(&a.references[0]).as_deref(), Some("py-app"));
        let mut stored = Vec::new();
        ImageArchive::layer_reader(&path, &a.layers[0]).expect("layer").read_to_end(&mut stored).expect("read");
        assert_eq!(stored, layer);
        // A config that is not what its name says.
        let path = tar_file(
            tmp.path(),
            &[
                ("abc/layer.tar", layer),
                (&format!("{}.json", "0".repeat(64)), cfg),
                (
                    "manifest.json",
                    serde_json::to_vec(&serde_json::json!([{"Config": format!("{}.json", "0".repeat(64)), "Layers": ["abc/layer.tar"]}])).expect("json"),
                ),
            ],
        );
        let err = ImageArchive::open(&path).expect_err("bad config name").to_string();
        assert!(err.contains("digest"), "{err}");
    }

    #[test]
    fn oci_layout_index_manifest_and_gzip_layers() {
        use std::io::Write;
        let tmp = tempfile::tempdir().expect("tempdir");
        let layer = layer_tar();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).expect("gz");
        let gz = gz.finish().expect("gz");
        let cfg = config(&digest(&layer));
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&cfg), "size": cfg.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest(&gz), "size": gz.len()}]
        }))
        .expect("json");
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(&manifest), "size": manifest.len(),
                           "annotations": {"io.containerd.image.name": "docker.io/library/tool:2", "org.opencontainers.image.ref.name": "2"}}]
        }))
        .expect("json");
        let blob = |d: &str| format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        let path = tar_file(
            tmp.path(),
            &[
                ("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
                ("index.json", index),
                (&blob(&digest(&manifest)), manifest.clone()),
                (&blob(&digest(&cfg)), cfg.clone()),
                (&blob(&digest(&gz)), gz.clone()),
            ],
        );
        let a = ImageArchive::open(&path).expect("open");
        assert_eq!((a.format, a.digest.clone()), (Format::Oci, digest(&cfg)));
        assert_eq!(a.layers[0].blob_digest.as_deref(), Some(digest(&gz).as_str()));
        assert_eq!(name_from_reference(&a.references[0]).as_deref(), Some("tool"));
        let mut r = BufReader::new(ImageArchive::layer_reader(&path, &a.layers[0]).expect("layer"));
        assert_eq!(compression(&mut r, "l").expect("kind"), Compression::Gzip);
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(r).read_to_end(&mut plain).expect("gunzip");
        assert_eq!(plain, layer);
        // A manifest blob whose bytes are not its digest.
        let bad_index = serde_json::to_vec(&serde_json::json!({"manifests": [{"digest": digest(b"other")}]})).expect("json");
        let path = tar_file(tmp.path(), &[("index.json", bad_index), (&blob(&digest(b"other")), manifest)]);
        assert!(ImageArchive::open(&path).expect_err("digest").to_string().contains("digest"));
        // Path games in a digest never name a file.
        let evil = serde_json::to_vec(&serde_json::json!({"manifests": [{"digest": "sha256:../../../etc/passwd"}]})).expect("json");
        let path = tar_file(tmp.path(), &[("index.json", evil)]);
        assert!(ImageArchive::open(&path).expect_err("evil digest").to_string().contains("not sha256"));
    }

    #[test]
    fn names_and_garbage() {
        assert_eq!(name_from_reference("debian").as_deref(), Some("debian"));
        assert_eq!(name_from_reference("localhost:5000/a/b:tag").as_deref(), Some("b"));
        assert_eq!(name_from_reference("x@sha256:00").as_deref(), Some("x"));
        assert_eq!(name_from_reference("2"), Some("2".to_string()));
        assert_eq!(normalize("./a/../b/"), Some("b".to_string()));
        assert_eq!(normalize("../x"), None);
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("junk.tar");
        std::fs::write(&path, vec![7u8; 4096]).expect("write");
        assert!(matches!(ImageArchive::open(&path), Err(ImageError::Archive(_))));
        let path = tar_file(tmp.path(), &[("hello", b"x".to_vec())]);
        assert!(ImageArchive::open(&path).expect_err("no manifest").to_string().contains("manifest.json"));
    }
}
