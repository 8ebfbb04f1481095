//! A process sandbox's network: with mode ALLOWLIST or OPEN, the daemon's egress filter gives
//! the init's network namespace an `eth0` (see [`crate::egress`]) and /etc/resolv.conf names
//! the daemon's DNS. Mode NONE leaves the namespace as the init made it: `lo` only.

use crate::egress::{Egress, NetworkMode};

use super::{files, BackendError, Isolation, ProcessSandbox};

fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable { isolation: Isolation::Process, reason }
}

/// The init's host pid, as the zygote that cloned it reported it.
async fn init_pid(sb: &ProcessSandbox) -> Result<i32, BackendError> {
    sb.init.lock().await.as_ref().map(|i| i.pid()).ok_or_else(|| BackendError::Internal(format!("sandbox {}: its init is gone", sb.id)))
}

/// Gives a freshly set-up sandbox the network its spec asks for. Before the sandbox is
/// reported ready, so nothing in it runs yet.
pub(super) async fn attach(egress: Option<&Egress>, sb: &ProcessSandbox) -> Result<(), BackendError> {
    let policy = &sb.spec.network;
    if policy.mode == NetworkMode::None {
        return Ok(());
    }
    let egress = egress.ok_or_else(|| unavailable(format!("network mode {}: the daemon has no egress filter", policy.mode.name())))?;
    let pid = init_pid(sb).await?;
    let gw = egress.attach(sb.id.as_str(), &sb.spec.tenant, policy, pid).await.map_err(unavailable)?;
    // Any nameserver would reach the daemon (nftables sends all UDP/53 there); the gateway is
    // the honest one to name.
    let resolv = format!("# written by sandboxd: the daemon's DNS answers only what the network policy allows\nnameserver {gw}\n");
    let (rootfs, ids) = (sb.rootfs.clone(), sb.ids());
    let written = tokio::task::spawn_blocking(move || files::acting_as(ids, || files::write_file(&rootfs, "/", "/etc/resolv.conf", resolv.as_bytes(), 0o644)))
        .await
        .map_err(|e| BackendError::Internal(format!("resolv.conf task: {e}")))?;
    if let Err(e) = written {
        egress.detach(sb.id.as_str()).await;
        return Err(BackendError::Internal(format!("sandbox {}: writing /etc/resolv.conf: {e}", sb.id)));
    }
    Ok(())
}

/// Takes the sandbox's link away (a no-op without one).
pub(super) async fn detach(egress: Option<&Egress>, sb: &ProcessSandbox) {
    if let Some(e) = egress {
        e.detach(sb.id.as_str()).await;
    }
}
