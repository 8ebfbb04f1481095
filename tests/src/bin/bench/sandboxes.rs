//! Driving one daemon: the sandboxes and snapshots the bench made on it (removed whatever
//! happens), and the timed and untimed calls every section makes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use agent_client::{exec_request, Client};
use anyhow::{bail, Context, Result};
use sandbox_tests::{process_sandbox, proto};

use crate::check_interrupt;

/// The sandboxes and snapshots of one daemon that are alive, so that each one is removed
/// whatever happens.
pub(crate) struct Sandboxes {
    pub(crate) client: Client,
    pub(crate) live: BTreeSet<String>,
    pub(crate) snapshots: BTreeSet<String>,
}

impl Sandboxes {
    pub(crate) fn new(client: Client) -> Self {
        Sandboxes { client, live: BTreeSet::new(), snapshots: BTreeSet::new() }
    }

    /// Creates a process-tier sandbox of image `minimal`; returns its id and the call's time.
    pub(crate) async fn create(&mut self, what: &str) -> Result<(String, Duration)> {
        self.create_with(process_sandbox("minimal"), what).await
    }

    /// Creates a sandbox as asked; returns its id and the call's time. Fails unless it is
    /// RUNNING in the tier asked for (a policy upgrade would measure another tier's numbers).
    pub(crate) async fn create_with(&mut self, request: proto::CreateSandboxRequest, what: &str) -> Result<(String, Duration)> {
        check_interrupt()?;
        let asked = request.isolation;
        let t = Instant::now();
        let sandbox = self.client.create(request).await.with_context(|| format!("CreateSandbox ({what})"))?;
        let took = t.elapsed();
        self.live.insert(sandbox.id.clone());
        if sandbox.state != proto::SandboxState::Running as i32 {
            bail!("CreateSandbox ({what}) returned sandbox {} in state {}, not RUNNING", sandbox.id, state_name(sandbox.state));
        }
        if asked != proto::Isolation::Unspecified as i32 && sandbox.isolation != asked {
            bail!(
                "CreateSandbox ({what}) asked for {} and got sandbox {} of {}{}",
                isolation_name(asked),
                sandbox.id,
                isolation_name(sandbox.isolation),
                if sandbox.isolation_reason.is_empty() { String::new() } else { format!(" ({})", sandbox.isolation_reason) }
            );
        }
        Ok((sandbox.id, took))
    }

    /// Snapshots sandbox `id`; returns the snapshot's id and size and the call's time.
    pub(crate) async fn snapshot(&mut self, id: &str, what: &str) -> Result<(String, u64, Duration)> {
        self.snapshot_with(id, what, None).await
    }

    /// [`Sandboxes::snapshot`] with `include_memory` as given (`None`: the tier's default).
    pub(crate) async fn snapshot_with(&mut self, id: &str, what: &str, include_memory: Option<bool>) -> Result<(String, u64, Duration)> {
        check_interrupt()?;
        let t = Instant::now();
        let snap = self.client.snapshot_with(id, "", include_memory).await.with_context(|| format!("Snapshot of {id} ({what})"))?;
        if let Some(want) = include_memory {
            if snap.includes_memory != want {
                bail!("Snapshot of {id} ({what}) asked for include_memory={want} and got a snapshot with includes_memory={}", snap.includes_memory);
            }
        }
        let took = t.elapsed();
        self.snapshots.insert(snap.snapshot_id.clone());
        Ok((snap.snapshot_id, snap.size_bytes, took))
    }

    /// Rolls sandbox `id` back to `snapshot`; returns the call's time.
    pub(crate) async fn rollback(&mut self, id: &str, snapshot: &str, what: &str) -> Result<Duration> {
        check_interrupt()?;
        let t = Instant::now();
        let sandbox = self.client.rollback(id, snapshot).await.with_context(|| format!("Rollback of {id} to {snapshot} ({what})"))?;
        let took = t.elapsed();
        if sandbox.state != proto::SandboxState::Running as i32 {
            bail!("Rollback of {id} to {snapshot} ({what}) left the sandbox in state {}, not RUNNING", state_name(sandbox.state));
        }
        Ok(took)
    }

    pub(crate) async fn delete_snapshot(&mut self, snapshot: &str) -> Result<()> {
        self.client.delete_snapshot(snapshot).await.with_context(|| format!("DeleteSnapshot {snapshot}"))?;
        self.snapshots.remove(snapshot);
        Ok(())
    }

    /// Destroys one sandbox; returns the call's time.
    pub(crate) async fn destroy(&mut self, id: &str) -> Result<Duration> {
        let t = Instant::now();
        self.client.destroy(id).await.with_context(|| format!("DestroySandbox {id}"))?;
        let took = t.elapsed();
        self.live.remove(id);
        Ok(took)
    }

    /// Destroys whatever is still alive, then deletes the snapshots (forks first, or their
    /// origin snapshot could not go); says loudly what could not be.
    pub(crate) async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.live) {
            if let Err(e) = self.client.destroy(id.as_str()).await {
                eprintln!("bench: WARNING: could not destroy sandbox {id} while cleaning up: {e}");
            }
        }
        for snap in std::mem::take(&mut self.snapshots) {
            if let Err(e) = self.client.delete_snapshot(snap.as_str()).await {
                eprintln!("bench: WARNING: could not delete snapshot {snap} while cleaning up: {e}");
            }
        }
    }
}

fn isolation_name(isolation: i32) -> &'static str {
    proto::Isolation::try_from(isolation).map(|i| i.as_str_name()).unwrap_or("unknown")
}

/// Runs `script` with `sh -c` in sandbox `id` (untimed set-up and checks); fails unless it
/// exits 0, with its stderr in the error.
pub(crate) async fn sh(client: &Client, id: &str, script: &str, what: &str) -> Result<()> {
    check_interrupt()?;
    let result = client.exec(exec_request(id, ["sh", "-c", script])).await.with_context(|| format!("Exec of `{script}` in {id} ({what})"))?;
    if result.status != proto::ExecStatus::Exited as i32 || result.exit_code != 0 {
        let status = proto::ExecStatus::try_from(result.status).map(|s| s.as_str_name()).unwrap_or("unknown");
        bail!(
            "{what}: `{script}` in {id} ended with status {status}, exit code {}: {}{}",
            result.exit_code,
            String::from_utf8_lossy(&result.stderr).trim(),
            result.error
        );
    }
    Ok(())
}

/// Writes `mib` MiB of fresh random bytes to /workspace/blob and flushes them to disk.
pub(crate) async fn write_blob(client: &Client, id: &str, mib: u32, what: &str) -> Result<()> {
    let script = format!("dd if=/dev/urandom of=/workspace/blob bs=1M count={mib} 2>/dev/null && sync");
    sh(client, id, &script, what).await
}

fn state_name(state: i32) -> &'static str {
    proto::SandboxState::try_from(state).map(|s| s.as_str_name()).unwrap_or("unknown")
}

/// Fails unless `true` ran and exited 0.
pub(crate) fn check_true(result: &proto::ExecResult, what: &str) -> Result<()> {
    if result.status != proto::ExecStatus::Exited as i32 || result.exit_code != 0 {
        let status = proto::ExecStatus::try_from(result.status).map(|s| s.as_str_name()).unwrap_or("unknown");
        bail!(
            "{what}: `true` ended with status {status}, exit code {}{}",
            result.exit_code,
            if result.error.is_empty() { String::new() } else { format!(": {}", result.error) }
        );
    }
    Ok(())
}

/// One unary `Exec` of `true`; returns the round trip.
pub(crate) async fn exec_true(client: &Client, id: &str, what: &str) -> Result<Duration> {
    check_interrupt()?;
    let t = Instant::now();
    let result = client.exec(exec_request(id, ["true"])).await.with_context(|| format!("Exec of `true` in {id} ({what})"))?;
    let took = t.elapsed();
    check_true(&result, what)?;
    Ok(took)
}

/// One `ExecStream` of `true`, drained to its result; returns the round trip.
pub(crate) async fn exec_stream_true(client: &Client, id: &str, what: &str) -> Result<Duration> {
    check_interrupt()?;
    let t = Instant::now();
    let stream = client.exec_stream(exec_request(id, ["true"])).await.with_context(|| format!("ExecStream of `true` in {id} ({what})"))?;
    let result = stream.into_result().await.with_context(|| format!("reading the ExecStream of `true` in {id} ({what})"))?;
    let took = t.elapsed();
    check_true(&result, what)?;
    Ok(took)
}
