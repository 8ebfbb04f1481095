//! Sandbox images as local Docker images, without a registry.
//!
//! The source of truth for an image is the same as for the process tier: its rootfs plus its
//! `image.json` in the catalog (`crate::images`; script-built or imported). On first use of a
//! name (or eagerly, when an image is imported) the daemon looks for the local Docker image
//! `sandboxd/<name>:<hash of image.json>`; when it is missing, the rootfs is streamed as a tar
//! into Docker's image import (`POST /images/create?fromSrc=-`), which makes a one-layer image.
//! Rebuilding or re-importing an image rewrites `image.json`, so the tag changes and the next
//! sandbox gets the new image; sandboxes already running keep the old one. Preparing an image
//! also tags it `sandboxd/<name>:latest` (for the operator's own use on the host: a build through
//! the API pins its bases by image ID instead, see `images::build`).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bollard::query_parameters::CreateImageOptions;
use bollard::Docker;
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;

use super::docker::{api_error, is_not_found, stable_hash};
use crate::backend::{BackendError, Isolation};
use crate::images::engine::{docker_reference, valid_repo_component};
use crate::images::Catalog;

/// Chunk size of the tar stream sent to Docker.
const CHUNK: usize = 256 << 10;

/// Docker images already known to exist, by sandbox image name, and a lock per name so two
/// creates of a new image import it once.
#[derive(Default)]
pub struct ImageCache {
    ready: Mutex<HashMap<String, String>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// The Docker reference of image `name` whose `image.json` hashes to `hash` (named in
/// `images::engine`, whose builds pin a `FROM` to it).
fn reference(name: &str, hash: u64) -> String {
    docker_reference(name, hash)
}

/// A `Write` that hands the tar stream to the async side in chunks.
struct ChannelWriter {
    tx: mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx.blocking_send(Ok(chunk)).map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "Docker stopped reading the image"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// Writes `rootfs` as a tar (paths relative to it, symlinks kept as links, device nodes and
/// FIFOs as such) into `tx`; a failure is sent down the stream so the import fails with it.
fn stream_rootfs(rootfs: PathBuf, tx: mpsc::Sender<std::io::Result<Bytes>>) {
    let err_tx = tx.clone();
    let result = (|| -> std::io::Result<()> {
        let mut builder = tar::Builder::new(ChannelWriter { tx, buf: Vec::with_capacity(CHUNK) });
        builder.follow_symlinks(false);
        builder.append_dir_all(".", &rootfs)?;
        let mut w = builder.into_inner()?;
        w.flush()
    })();
    if let Err(e) = result {
        let _ = err_tx.blocking_send(Err(std::io::Error::new(e.kind(), format!("reading {}: {e}", rootfs.display()))));
    }
}

impl ImageCache {
    /// The Docker image for sandbox image `name`, imported from its rootfs on first use.
    pub async fn ensure(&self, docker: &Docker, catalog: &Catalog, name: &str) -> Result<String, BackendError> {
        let img = catalog.resolve(name).map_err(|e| BackendError::from_image(Isolation::Container, e))?;
        let rootfs = img.rootfs();
        let tag = reference(name, stable_hash(&img.meta));
        if self.ready.lock().ok().and_then(|r| r.get(name).cloned()).as_deref() == Some(tag.as_str()) {
            return Ok(tag);
        }
        let lock = self.locks.lock().map_err(|_| BackendError::Internal("image lock table poisoned".into()))?.entry(name.to_string()).or_default().clone();
        let _guard = lock.lock().await;
        match docker.inspect_image(&tag).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => self.import(docker, &rootfs, &tag).await?,
            Err(e) => return Err(api_error(format!("inspecting image {tag}"), e)),
        }
        if let Ok(mut ready) = self.ready.lock() {
            ready.insert(name.to_string(), tag.clone());
        }
        Ok(tag)
    }

    /// Tags the Docker image of `name` (`tag`, from [`ImageCache::ensure`]) as
    /// `sandboxd/<name>:latest` (a name Docker can take only; a tenant's key is hashed).
    pub async fn tag_latest(&self, docker: &Docker, name: &str, tag: &str) -> Result<(), BackendError> {
        let Some((repo, _)) = tag.rsplit_once(':') else { return Ok(()) };
        if !valid_repo_component(name) {
            return Ok(());
        }
        let options = bollard::query_parameters::TagImageOptions { repo: Some(repo.to_string()), tag: Some("latest".to_string()) };
        docker.tag_image(tag, Some(options)).await.map_err(|e| api_error(format!("tagging {tag} as {repo}:latest"), e))
    }

    /// Removes the Docker image this daemon made of catalog image `name` (its tag, and
    /// `:latest` when that is the same image). Only that one: another daemon on this Docker
    /// host may hold an image of the same name, built from other bytes, under another tag.
    /// Called while the image is still in the catalog (its `image.json` gives the tag).
    pub async fn remove(&self, docker: &Docker, catalog: &Catalog, name: &str) -> Result<(), BackendError> {
        if let Ok(mut ready) = self.ready.lock() {
            ready.remove(name);
        }
        let Ok(img) = catalog.resolve(name) else { return Ok(()) };
        let tag = reference(name, stable_hash(&img.meta));
        let id = match docker.inspect_image(&tag).await {
            Ok(info) => info.id,
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => return Err(api_error(format!("inspecting {tag}"), e)),
        };
        let mut tags = vec![tag.clone()];
        if let Some((repo, _)) = tag.rsplit_once(':') {
            let latest = format!("{repo}:latest");
            if docker.inspect_image(&latest).await.ok().and_then(|i| i.id).is_some_and(|l| Some(l) == id) {
                tags.insert(0, latest);
            }
        }
        for t in tags {
            match docker.remove_image(&t, None::<bollard::query_parameters::RemoveImageOptions>, None).await {
                Ok(_) => tracing::info!(image = %t, "Docker image removed"),
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(api_error(format!("removing {t}"), e)),
            }
        }
        Ok(())
    }

    async fn import(&self, docker: &Docker, rootfs: &Path, tag: &str) -> Result<(), BackendError> {
        let started = Instant::now();
        tracing::info!(image = %tag, rootfs = %rootfs.display(), "Docker image missing; importing it from the image's rootfs (first use)");
        let (repo, version) = tag.rsplit_once(':').unwrap_or((tag, "latest"));
        let (tx, rx) = mpsc::channel(8);
        let src = rootfs.to_path_buf();
        let producer = tokio::task::spawn_blocking(move || stream_rootfs(src, tx));
        let options = CreateImageOptions {
            from_src: Some("-".to_string()),
            repo: Some(repo.to_string()),
            tag: Some(version.to_string()),
            message: Some(format!("imported by sandboxd from {}", rootfs.display())),
            ..Default::default()
        };
        let body = bollard::body_try_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut progress = docker.create_image(Some(options), Some(body), None);
        let mut failure = None;
        while let Some(item) = progress.next().await {
            if let Err(e) = item {
                failure = Some(e);
                break;
            }
        }
        // Dropping the stream ends the upload; the producer then sees a closed channel.
        drop(progress);
        let _ = producer.await;
        if let Some(e) = failure {
            return Err(api_error(format!("importing {} as {tag}", rootfs.display()), e));
        }
        docker.inspect_image(tag).await.map_err(|e| api_error(format!("image {tag} after import"), e))?;
        tracing::info!(image = %tag, ms = started.elapsed().as_millis() as u64, "Docker image imported");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_valid_docker_names() {
        assert_eq!(reference("minimal", 0xab), "sandboxd/minimal:00000000000000ab");
        assert!(reference("My_Image", 1).starts_with("sandboxd/image-"));
        assert!(reference("a..b", 1).starts_with("sandboxd/image-"));
        assert!(valid_repo_component("debian-12.slim"));
        assert!(!valid_repo_component("-x"));
        assert!(!valid_repo_component("x_"));
    }
}
