//! A container sandbox's network: Docker keeps the container on its `none` network (Docker never
//! routes it, and never will: it knows of no interface but `lo`), and with mode ALLOWLIST or
//! OPEN the daemon's egress filter gives the container's network namespace — its init's,
//! `/proc/<init>/ns/net` — the same `eth0` (veth, host end `sbxe<N>`, a /30) as a process
//! sandbox. The one nftables table, DNS server and proxy of [`crate::egress`] then hold it
//! exactly as they hold a process sandbox. `/etc/resolv.conf` is Docker's per-container file
//! (`ResolvConfPath`), bind-mounted read-only into the container: the daemon rewrites it on the
//! host, in place, to name its DNS (nothing inside can change it back — nor would that help:
//! every UDP/53 packet reaches the daemon's DNS whatever address it is sent to).
//!
//! A new network namespace comes with every start of the container (create, a re-adoption's
//! restart, a rollback's new container), so the link is given again each time; the old one went
//! with its namespace, and its slot is given back by [`detach`].

use crate::egress::NetworkMode;

use super::{BackendError, ContainerSandbox, Inner, Isolation};

fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable { isolation: Isolation::Container, reason }
}

/// Gives a running container (before it is reported ready: no exec has run in this start of
/// it) the network its spec asks for. On failure nothing of the link is left.
pub(super) async fn attach(inner: &Inner, sb: &ContainerSandbox) -> Result<(), BackendError> {
    let policy = &sb.spec.network;
    if policy.mode == NetworkMode::None {
        return Ok(());
    }
    let egress = inner.cfg.egress.as_deref().ok_or_else(|| unavailable(format!("network mode {}: the daemon has no egress filter", policy.mode.name())))?;
    let id = sb.spec.id.as_str();
    let gw = egress.attach(id, &sb.spec.tenant, policy, sb.init_pid).await.map_err(unavailable)?;
    let resolv = format!("# written by sandboxd: the daemon's DNS answers only what the network policy allows\nnameserver {gw}\n");
    if let Err(e) = write_resolv_conf(inner, sb, resolv).await {
        egress.detach(id).await;
        return Err(BackendError::Internal(format!("sandbox {id}: writing /etc/resolv.conf: {e}")));
    }
    Ok(())
}

/// Writes the container's resolv.conf: the host file Docker made for it, in place (the bind
/// mount holds its inode, so a rename would not be seen).
async fn write_resolv_conf(inner: &Inner, sb: &ContainerSandbox, text: String) -> Result<(), String> {
    let docker = inner.docker().map_err(|e| e.to_string())?;
    let info = docker.inspect_container(&sb.container_id, None).await.map_err(|e| format!("inspecting container {}: {e}", sb.container_id))?;
    let path = info.resolv_conf_path.filter(|p| !p.is_empty()).ok_or("Docker names no resolv.conf for the container")?;
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::OpenOptions::new().write(true).truncate(true).open(&path).map_err(|e| format!("{path}: {e}"))?;
        std::io::Write::write_all(&mut file, text.as_bytes()).map_err(|e| format!("{path}: {e}"))
    })
    .await
    .map_err(|e| format!("resolv.conf task: {e}"))?
}

/// Takes sandbox `sb`'s link away and gives its slot back (a no-op without one).
pub(super) async fn detach(inner: &Inner, sb: &ContainerSandbox) {
    if let Some(e) = inner.cfg.egress.as_deref() {
        e.detach(sb.spec.id.as_str()).await;
    }
}
