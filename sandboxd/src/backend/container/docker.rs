//! The connection to the Docker Engine, and the conversions every other file of the tier needs:
//! labels, names, error classification.

use std::path::Path;
use std::time::Duration;

use bollard::Docker;

use crate::backend::BackendError;
use crate::ids::SandboxId;

/// Label carrying the sandbox id a container belongs to.
pub const LABEL_ID: &str = "sandboxd.id";
/// Label carrying the owning daemon (a hash of its state dir), so two daemons on one Docker
/// host never adopt or remove each other's containers.
pub const LABEL_OWNER: &str = "sandboxd.owner";
/// Label carrying the image name the container was made from.
pub const LABEL_IMAGE: &str = "sandboxd.image";
/// Label set on a standby container (see `snapshot.rs`): the snapshot it was started from.
pub const LABEL_STANDBY: &str = "sandboxd.standby";

/// How long the daemon waits for Docker to answer at start before declaring the tier unavailable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of any single Docker API request (image imports of large rootfs included).
const REQUEST_TIMEOUT_SECS: u64 = 300;

/// What the daemon learned about the Docker host at start.
#[derive(Debug, Clone)]
pub struct DockerHost {
    pub server_version: String,
    pub api_version: String,
    pub storage_driver: String,
    pub cgroup_driver: String,
    /// Whether the engine runs containers in a user namespace (`dockerd --userns-remap`): then
    /// root in a container is an unprivileged host uid, as on the process tier.
    pub userns_remap: bool,
}

/// Connects to the Docker Engine on `socket`, settles the API version with it (Docker 20.10
/// speaks 1.41, older than bollard's default) and checks that it answers.
pub async fn connect(socket: &Path) -> Result<(Docker, DockerHost), String> {
    let unreachable = |e: &dyn std::fmt::Display| format!("cannot reach Docker at {}: {e}", socket.display());
    if !socket.exists() {
        return Err(unreachable(&"no such socket"));
    }
    let path = socket.to_str().ok_or_else(|| unreachable(&"socket path is not UTF-8"))?;
    let docker = Docker::connect_with_unix(path, REQUEST_TIMEOUT_SECS, bollard::API_DEFAULT_VERSION).map_err(|e| unreachable(&e))?;
    let probe = async {
        let docker = docker.negotiate_version().await?;
        let info = docker.info().await?;
        Ok::<_, bollard::errors::Error>((docker, info))
    };
    let (docker, info) = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(unreachable(&e)),
        Err(_) => return Err(unreachable(&format!("no answer within {} s", PROBE_TIMEOUT.as_secs()))),
    };
    let host = DockerHost {
        server_version: info.server_version.unwrap_or_default(),
        api_version: docker.client_version().to_string(),
        storage_driver: info.driver.unwrap_or_default(),
        cgroup_driver: info.cgroup_driver.map(|d| d.to_string()).unwrap_or_default(),
        userns_remap: userns_remapped(&info.security_options.unwrap_or_default()),
    };
    Ok((docker, host))
}

/// Whether `docker info`'s security options (`["name=seccomp,profile=builtin", "name=userns"]`)
/// say the engine remaps user namespaces.
fn userns_remapped(options: &[String]) -> bool {
    options.iter().any(|o| o.split(',').any(|kv| kv.trim() == "name=userns"))
}

/// FNV-1a, 64 bits: a hash that never changes between builds (std's `DefaultHasher` may), for
/// values that outlive the daemon such as Docker labels and image tags.
pub use crate::images::engine::stable_hash;

/// The owner label value of a daemon with this state dir.
pub fn owner_of(state_dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    format!("{:016x}", stable_hash(state_dir.as_os_str().as_bytes()))
}

/// Name of the container that currently serves a sandbox. A restarted daemon recognizes the
/// serving container by this name; every other container of the sandbox (standby, replaced)
/// carries a suffix.
pub fn active_name(id: &SandboxId) -> String {
    format!("sandboxd-{id}")
}

/// Whether Docker answered 404 (no such container, image, exec or path).
pub fn is_not_found(e: &bollard::errors::Error) -> bool {
    matches!(e, bollard::errors::Error::DockerResponseServerError { status_code: 404, .. })
}

/// Whether Docker answered 409 (conflict: name in use, container not running, ...).
pub fn is_conflict(e: &bollard::errors::Error) -> bool {
    matches!(e, bollard::errors::Error::DockerResponseServerError { status_code: 409, .. })
}

/// A Docker API failure while doing `what`.
pub fn api_error(what: impl std::fmt::Display, e: bollard::errors::Error) -> BackendError {
    BackendError::Internal(format!("docker: {what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userns_remap_is_read_from_the_security_options() {
        let opts = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(!userns_remapped(&opts(&["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"])));
        assert!(userns_remapped(&opts(&["name=seccomp,profile=builtin", "name=userns"])));
        assert!(!userns_remapped(&opts(&["name=usernsx"])));
    }

    #[test]
    fn stable_hash_is_fnv1a() {
        // Reference values of FNV-1a 64.
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(owner_of(Path::new("/var/lib/sandboxd")).len(), 16);
        assert_ne!(owner_of(Path::new("/a")), owner_of(Path::new("/b")));
    }

    #[tokio::test]
    async fn an_unreachable_docker_is_a_reason_not_a_failure() {
        let err = connect(Path::new("/nonexistent/docker.sock")).await.expect_err("no Docker there");
        assert!(err.starts_with("cannot reach Docker at /nonexistent/docker.sock: "), "{err}");
        // A socket nobody answers on.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("docker.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let err = connect(&path).await.expect_err("silent socket");
        assert!(err.contains("cannot reach Docker at"), "{err}");
    }
}
