//! The local Docker Engine as a source of images: `docker:` imports (`GET /images/{name}/get`)
//! and builds (`POST /build`), through the Engine API with `bollard` (never the docker CLI),
//! on the same socket as the container tier. Nothing is ever pulled from a registry.
//!
//! The connection is made on first use, so a Docker that starts after the daemon still serves
//! imports; a Docker that is down is FAILED_PRECONDITION with the reason.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bollard::query_parameters::{BuildImageOptions, RemoveImageOptions};
use bollard::Docker;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::{human, ImageError};
use crate::config::BuildNetwork;

/// How long connecting to Docker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of one Engine API request: a build or an export of a large image takes long.
const REQUEST_TIMEOUT_SECS: u64 = 6 * 3600;

/// The local Docker Engine.
pub struct Engine {
    socket: PathBuf,
    docker: tokio::sync::Mutex<Option<Docker>>,
}

/// What a build is asked to do.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    /// The Dockerfile's path inside the context.
    pub dockerfile: String,
    /// The (intermediate) tag of the result.
    pub tag: String,
    pub build_args: HashMap<String, String>,
    pub network: BuildNetwork,
}

fn api_error(what: impl std::fmt::Display, e: bollard::errors::Error) -> ImageError {
    ImageError::Internal(format!("docker: {what}: {e}"))
}

fn is_not_found(e: &bollard::errors::Error) -> bool {
    matches!(e, bollard::errors::Error::DockerResponseServerError { status_code: 404, .. })
}

impl Engine {
    /// The Engine on the UNIX socket `socket` (not connected yet).
    pub fn new(socket: &Path) -> Self {
        Engine { socket: socket.to_path_buf(), docker: tokio::sync::Mutex::new(None) }
    }

    /// A connection, made (and its API version settled) on first use.
    async fn docker(&self) -> Result<Docker, ImageError> {
        let mut slot = self.docker.lock().await;
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let unreachable = |e: &dyn std::fmt::Display| ImageError::DockerUnavailable(format!("cannot reach Docker at {}: {e}", self.socket.display()));
        let path = self.socket.to_str().ok_or_else(|| unreachable(&"socket path is not UTF-8"))?;
        if !self.socket.exists() {
            return Err(unreachable(&"no such socket"));
        }
        let docker = Docker::connect_with_unix(path, REQUEST_TIMEOUT_SECS, bollard::API_DEFAULT_VERSION).map_err(|e| unreachable(&e))?;
        let docker = match tokio::time::timeout(CONNECT_TIMEOUT, docker.negotiate_version()).await {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => return Err(unreachable(&e)),
            Err(_) => return Err(unreachable(&format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()))),
        };
        *slot = Some(docker.clone());
        Ok(docker)
    }

    /// The image ID (`sha256:…`) of a local image, or NOT_FOUND.
    pub async fn image_id(&self, reference: &str) -> Result<String, ImageError> {
        let docker = self.docker().await?;
        match docker.inspect_image(reference).await {
            Ok(info) => info.id.ok_or_else(|| ImageError::Internal(format!("docker: image {reference} has no id"))),
            Err(e) if is_not_found(&e) => Err(ImageError::DockerImageNotFound(reference.chars().take(200).collect())),
            Err(e) => Err(api_error(format!("inspecting {reference}"), e)),
        }
    }

    /// Writes `docker save <reference>` to `dest` (at most `max_bytes`), reporting the bytes
    /// written so far through `progress`.
    pub async fn export(&self, reference: &str, dest: &Path, max_bytes: u64, mut progress: impl FnMut(u64)) -> Result<u64, ImageError> {
        let docker = self.docker().await?;
        let mut file = tokio::fs::File::create(dest).await.map_err(|e| ImageError::io("creating the export file", e))?;
        let mut stream = docker.export_image(reference);
        let mut written = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                if is_not_found(&e) {
                    ImageError::DockerImageNotFound(reference.to_string())
                } else {
                    api_error(format!("exporting {reference}"), e)
                }
            })?;
            written += chunk.len() as u64;
            if written > max_bytes {
                return Err(ImageError::Limit { what: format!("the export of {reference}"), limit: human(max_bytes), key: "max_archive_bytes" });
            }
            file.write_all(&chunk).await.map_err(|e| ImageError::io("writing the export file", e))?;
            progress(written);
        }
        file.flush().await.map_err(|e| ImageError::io("writing the export file", e))?;
        Ok(written)
    }

    /// Builds the context tar at `context` as `spec.tag`, with the classic builder (no
    /// BuildKit session needed, no pull), sending each line of its log to `log` (a reader that
    /// went away stops the build). A failing step is [`ImageError::BuildFailed`] with Docker's
    /// message.
    pub async fn build(&self, context: &Path, spec: &BuildSpec, log: &tokio::sync::mpsc::Sender<String>) -> Result<(), ImageError> {
        let docker = self.docker().await?;
        let file = tokio::fs::File::open(context).await.map_err(|e| ImageError::io("opening the build context", e))?;
        let body = bollard::body_try_stream(tokio_util::io::ReaderStream::new(file));
        let options = BuildImageOptions {
            dockerfile: spec.dockerfile.clone(),
            t: Some(spec.tag.clone()),
            rm: true,
            forcerm: true,
            // Nothing is pulled: FROM names a local image (a catalog image is tagged there first).
            pull: None,
            buildargs: Some(spec.build_args.clone()),
            networkmode: Some(match spec.network {
                BuildNetwork::None => "none".to_string(),
                BuildNetwork::Default => "default".to_string(),
            }),
            labels: Some(HashMap::from([("sandboxd.build".to_string(), "1".to_string())])),
            ..Default::default()
        };
        let mut stream = docker.build_image(options, None, Some(body));
        let mut partial = String::new();
        while let Some(item) = stream.next().await {
            let info = match item {
                Ok(info) => info,
                Err(bollard::errors::Error::DockerStreamError { error }) => return Err(ImageError::BuildFailed(error)),
                Err(e) => return Err(api_error("building", e)),
            };
            if let Some(detail) = info.error_detail.and_then(|d| d.message) {
                return Err(ImageError::BuildFailed(detail.trim().to_string()));
            }
            if let Some(text) = info.stream {
                partial.push_str(&text);
                while let Some(i) = partial.find('\n') {
                    let line: String = partial.drain(..=i).collect();
                    let line = line.trim_end();
                    if !line.is_empty() && log.send(line.to_string()).await.is_err() {
                        return Err(ImageError::Aborted("the client went away during the build".into()));
                    }
                }
            }
        }
        if !partial.trim().is_empty() {
            let _ = log.send(partial.trim().to_string()).await;
        }
        Ok(())
    }

    /// Removes the tag (or image) `reference`; an image nothing else names goes with it.
    pub async fn remove(&self, reference: &str) -> Result<(), ImageError> {
        let docker = self.docker().await?;
        match docker.remove_image(reference, Some(RemoveImageOptions { force: false, noprune: false, ..Default::default() }), None).await {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(api_error(format!("removing {reference}"), e)),
        }
    }
}
