//! The local Docker Engine as a source of images: `docker:` imports (`GET /images/{name}/get`)
//! and builds (`POST /build`), through the Engine API with `bollard` (never the docker CLI),
//! on the same socket as the container tier. Nothing is ever pulled from a registry.
//!
//! The connection is made on first use, so a Docker that starts after the daemon still serves
//! imports; a Docker that is down is FAILED_PRECONDITION with the reason.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bollard::query_parameters::RemoveImageOptions;
use bollard::Docker;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::{human, ImageError};

/// How long connecting to Docker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of one Engine API request: a build or an export of a large image takes long.
const REQUEST_TIMEOUT_SECS: u64 = 6 * 3600;

/// The local Docker Engine.
pub struct Engine {
    socket: PathBuf,
    docker: tokio::sync::Mutex<Option<Docker>>,
}

/// What a segment build (see `images::steps`) is asked to do: no RUN steps, so no process of
/// the build's runs, and no network.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    /// The Dockerfile's path inside the context.
    pub dockerfile: String,
    /// The (intermediate) tag of the result.
    pub tag: String,
    pub build_args: HashMap<String, String>,
}

/// What a RUN step needs of the image it runs on: its configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `K=V` strings.
    pub env: Vec<String>,
    pub user: String,
    pub workdir: String,
    /// The SHELL of shell-form RUN steps (empty: `/bin/sh -c`).
    pub shell: Vec<String>,
    /// Whether it carries ONBUILD triggers (Docker would run them in a build from it).
    pub has_onbuild: bool,
}

/// One JSON message of Docker's build output.
#[derive(Debug, Default, serde::Deserialize)]
struct BuildMessage {
    stream: Option<String>,
    error: Option<String>,
    message: Option<String>,
    #[serde(rename = "errorDetail")]
    error_detail: Option<ErrorDetail>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct ErrorDetail {
    message: Option<String>,
}

/// The query of `POST /build` for `spec`.
fn build_query(spec: &BuildSpec) -> String {
    let json = |m: &HashMap<String, String>| serde_json::to_string(m).unwrap_or_else(|_| "{}".into());
    let q: Vec<(&str, String)> = vec![
        ("dockerfile", spec.dockerfile.clone()),
        ("t", spec.tag.clone()),
        ("rm", "1".into()),
        ("forcerm", "1".into()),
        // The classic builder: BuildKit would need a session.
        ("version", "1".into()),
        ("buildargs", json(&spec.build_args)),
        ("labels", json(&HashMap::from([("sandboxd.build".to_string(), "1".to_string())]))),
        // A segment runs nothing; should Docker ever start a container for one, it has no network.
        ("networkmode", "none".into()),
    ];
    q.iter().map(|(k, v)| format!("{k}={}", percent_encode(v))).collect::<Vec<_>>().join("&")
}

/// `s` with every byte but the unreserved ones (RFC 3986) percent-encoded.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// FNV-1a 64: a hash that stays the same across builds and hosts (names of Docker images).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether `s` can be a path component of a Docker repository name (lowercase alphanumerics
/// separated by single `.`, `_` or `-`).
pub fn valid_repo_component(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && !bytes.windows(2).any(|w| b"._-".contains(&w[0]) && b"._-".contains(&w[1]))
}

/// The Docker reference the container tier gives catalog image `key` whose `image.json`
/// hashes to `hash`: `sandboxd/<key>:<hash>`, the key hashed when Docker could not take it
/// (upper case, a tenant's `~`).
pub fn docker_reference(key: &str, hash: u64) -> String {
    let repo = if valid_repo_component(key) { key.to_string() } else { format!("image-{:016x}", stable_hash(key.as_bytes())) };
    format!("sandboxd/{repo}:{hash:016x}")
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

    /// Builds the context tar at `context` as `spec.tag` with the classic builder (no
    /// BuildKit session, nothing pulled: every FROM was pinned to a local image ID before),
    /// sending each line of its log to `log` (a reader that went away stops the build). A
    /// failing instruction is [`ImageError::BuildFailed`] with Docker's message. Only segments
    /// are built this way (no RUN: see `images::steps`).
    ///
    /// The request is made here, on a connection of its own, rather than through `bollard`,
    /// whose build stream cannot be read line by line as it comes. Dropping the future closes
    /// the connection, which cancels the build in Docker.
    pub async fn build(&self, context: &Path, spec: &BuildSpec, log: &tokio::sync::mpsc::Sender<String>) -> Result<(), ImageError> {
        use http_body_util::BodyExt;
        // Settles that Docker is there, with the same error as every other call.
        self.docker().await?;
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|e| ImageError::DockerUnavailable(format!("cannot reach Docker at {}: {e}", self.socket.display())))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| ImageError::Internal(format!("docker: connecting for a build: {e}")))?;
        let connection = tokio::spawn(conn);
        let file = tokio::fs::File::open(context).await.map_err(|e| ImageError::io("opening the build context", e))?;
        let body = http_body_util::StreamBody::new(tokio_util::io::ReaderStream::new(file).map(|chunk| chunk.map(hyper::body::Frame::data)));
        let request = http::Request::post(format!("/build?{}", build_query(spec)))
            .header(http::header::HOST, "docker")
            .header(http::header::CONTENT_TYPE, "application/x-tar")
            .body(body)
            .map_err(|e| ImageError::Internal(format!("docker: build request: {e}")))?;
        let result = async {
            let response = sender.send_request(request).await.map_err(|e| ImageError::Internal(format!("docker: building: {e}")))?;
            let status = response.status();
            let mut body = response.into_body();
            let mut partial = Vec::new();
            let mut log_text = String::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ImageError::Internal(format!("docker: reading the build's output: {e}")))?;
                let Ok(data) = frame.into_data() else { continue };
                partial.extend_from_slice(&data);
                while let Some(i) = partial.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = partial.drain(..=i).collect();
                    if !status.is_success() {
                        log_text.push_str(&String::from_utf8_lossy(&line));
                        continue;
                    }
                    let Ok(msg) = serde_json::from_slice::<BuildMessage>(&line) else { continue };
                    if let Some(m) = msg.error_detail.and_then(|d| d.message).or(msg.error) {
                        return Err(ImageError::BuildFailed(m.trim().to_string()));
                    }
                    if let Some(text) = msg.stream {
                        log_text.push_str(&text);
                        while let Some(i) = log_text.find('\n') {
                            let line: String = log_text.drain(..=i).collect();
                            let line = line.trim_end();
                            if !line.is_empty() && log.send(line.to_string()).await.is_err() {
                                return Err(ImageError::Aborted("the client went away during the build".into()));
                            }
                        }
                    }
                }
            }
            if !status.is_success() {
                log_text.push_str(&String::from_utf8_lossy(&partial));
                let message = serde_json::from_str::<BuildMessage>(log_text.trim()).ok().and_then(|m| m.message).unwrap_or(log_text);
                return Err(ImageError::BuildFailed(format!("Docker answered {status}: {}", message.trim())));
            }
            if !log_text.trim().is_empty() {
                let _ = log.send(log_text.trim().to_string()).await;
            }
            Ok(())
        }
        .await;
        connection.abort();
        result
    }

    /// The configuration of image `reference` a RUN step on it needs.
    pub async fn image_config(&self, reference: &str) -> Result<ImageConfig, ImageError> {
        let docker = self.docker().await?;
        let info = match docker.inspect_image(reference).await {
            Ok(info) => info,
            Err(e) if is_not_found(&e) => return Err(ImageError::DockerImageNotFound(reference.chars().take(200).collect())),
            Err(e) => return Err(api_error(format!("inspecting {reference}"), e)),
        };
        let c = info.config.unwrap_or_default();
        Ok(ImageConfig {
            env: c.env.unwrap_or_default(),
            user: c.user.unwrap_or_default(),
            workdir: c.working_dir.unwrap_or_default(),
            shell: c.shell.unwrap_or_default(),
            has_onbuild: c.on_build.is_some_and(|t| !t.is_empty()),
        })
    }

    /// Tags image `id` as `repo:tag`.
    pub async fn tag(&self, id: &str, repo: &str, tag: &str) -> Result<(), ImageError> {
        let docker = self.docker().await?;
        let options = bollard::query_parameters::TagImageOptions { repo: Some(repo.to_string()), tag: Some(tag.to_string()) };
        docker.tag_image(id, Some(options)).await.map_err(|e| api_error(format!("tagging {id} as {repo}:{tag}"), e))
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
