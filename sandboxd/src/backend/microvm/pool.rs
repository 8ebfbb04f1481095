//! The warm pool: VMs of one image booted ahead of time (`--microvm-pool N`), so a create that
//! fits them takes one instead of waiting for a boot.
//!
//! A pooled VM is booted with the pool's memory and the default CPU limit; the sandbox's own limits are
//! applied inside the guest when it is taken (its cgroup), so any request at or below the pool's
//! memory, with as many vCPUs and with the default disk size fits. Taking a VM renames its directory to the
//! sandbox's (QEMU, chrooted there, is unaffected) and starts a refill in the background. A
//! refill restores the image's boot snapshot of the pool's machine shape when there is one (no
//! boot: ~0.2 s under TCG instead of seconds), else boots, and that boot is then taken as the
//! shape's boot snapshot, as a create's would be.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::vm::Vm;
use super::{top_of, Inner, Pinned, Started};
use crate::backend::{BackendError, SandboxSpec};
use crate::config::Limits;
use crate::ids::SandboxId;

/// A booted VM waiting for a sandbox.
pub struct Pooled {
    vm: Arc<Vm>,
    image: String,
    limits: Limits,
    /// Restored from the image's boot snapshot rather than booted.
    restored: bool,
}

impl Pooled {
    /// Moves the VM's directory to `dir` and hands the VM over.
    pub fn adopt(self, dir: &Path) -> Result<Arc<Vm>, BackendError> {
        let from = self.vm.dir();
        std::fs::rename(&from, dir).map_err(|e| BackendError::io(format!("moving pooled VM {} to {}", from.display(), dir.display()), e))?;
        if let Ok(mut d) = self.vm.dir.lock() {
            *d = dir.to_path_buf();
        }
        Ok(self.vm)
    }
}

/// Ready VMs and the state of the refill.
pub struct Pool {
    size: usize,
    ready: Mutex<Vec<Pooled>>,
    filling: AtomicBool,
    closed: AtomicBool,
}

impl Pool {
    pub fn new(size: usize) -> Pool {
        Pool { size, ready: Mutex::new(Vec::new()), filling: AtomicBool::new(false), closed: AtomicBool::new(false) }
    }

    /// A ready VM that can serve a sandbox of `image` with `limits`. Its vCPUs are what
    /// programs inside count (`nproc`, `os.cpu_count()`), so they must be the sandbox's own
    /// (`vcpus` of each set of limits), not merely enough: the CPU quota is set inside.
    pub fn take(&self, image: &str, limits: &Limits, vcpus: impl Fn(&Limits) -> u32) -> Option<Pooled> {
        let mut ready = self.ready.lock().ok()?;
        let fits = |p: &Pooled| {
            p.image == image
                && limits.memory_bytes <= p.limits.memory_bytes
                && vcpus(limits) == vcpus(&p.limits)
                && limits.disk_bytes == p.limits.disk_bytes
                && p.vm.exited().is_none()
                && p.vm.agent.is_open()
        };
        let at = ready.iter().position(fits)?;
        Some(ready.swap_remove(at))
    }

    /// Top disks of the pooled VMs (garbage collection roots).
    pub fn tops(&self) -> Vec<PathBuf> {
        self.ready.lock().map(|r| r.iter().map(|p| top_of(&p.vm)).collect()).unwrap_or_default()
    }

    fn len(&self) -> usize {
        self.ready.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// Stops refilling (shutdown).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Takes every ready VM out (shutdown).
    pub fn drain(&self) -> Vec<Arc<Vm>> {
        self.ready.lock().map(|mut r| r.drain(..).map(|p| p.vm).collect()).unwrap_or_default()
    }
}

/// Boots VMs in the background until the pool is full (no-op when a refill already runs).
pub fn refill(inner: &Arc<Inner>) {
    let pool = &inner.pool;
    if pool.size == 0 || pool.closed.load(Ordering::SeqCst) || pool.filling.swap(true, Ordering::SeqCst) {
        return;
    }
    let inner = inner.clone();
    tokio::spawn(async move {
        let mut failures = 0u32;
        while inner.pool.len() < inner.pool.size && !inner.pool.closed.load(Ordering::SeqCst) {
            match boot_one(&inner).await {
                Ok((p, pinned)) => {
                    failures = 0;
                    if inner.pool.closed.load(Ordering::SeqCst) {
                        inner.stop_vm(&p.vm).await;
                        let _ = std::fs::remove_dir_all(p.vm.dir());
                        break;
                    }
                    let (dir, boot_ms, restored) = (p.vm.dir(), p.vm.boot_time.as_millis() as u64, p.restored);
                    if let Ok(mut r) = inner.pool.ready.lock() {
                        r.push(p);
                    }
                    // Its top is a garbage-collection root now: the backing needs no pin.
                    drop(pinned);
                    tracing::info!(vm = %dir.display(), boot_ms, restored, "warm pool holds a booted microVM");
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, failures, "booting a VM for the warm pool");
                    if failures >= 3 {
                        tracing::error!("warm pool refill stopped after 3 failures in a row; creates boot their own VM");
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
        inner.pool.filling.store(false, Ordering::SeqCst);
    });
}

/// One throwaway exec, so the first exec of the sandbox that takes the VM does not pay for the
/// guest's cold page cache (the shell, libc, the cgroup code paths): ~150 ms under TCG here.
async fn warm_up(vm: &Vm) {
    let req = guest_agent::protocol::Request::Exec(guest_agent::protocol::ExecRequest {
        exec_id: "pool-warm-up".into(),
        argv: vec!["sh".into(), "-c".into(), "true".into()],
        env: vec![("PATH".into(), sandbox_exec::capture::DEFAULT_PATH.into())],
        workdir: "/".into(),
        timeout_ms: 10_000,
        max_output_bytes: 4096,
        io_drain_ms: 100,
        stream: false,
        user: None,
    });
    if let Err(e) = vm.agent.call(&req, &[], Duration::from_secs(15)).await {
        tracing::debug!(error = %e, "warm-up exec in a pooled VM");
    }
}

/// A VM for the pool: restored from the boot snapshot of the pool's machine shape, or booted
/// (and snapshotted for the next); with a placeholder identity until a sandbox takes it. Its
/// backing file stays pinned until the VM is in the pool (its top a root).
async fn boot_one(inner: &Arc<Inner>) -> Result<(Pooled, Pinned), BackendError> {
    let image_name = inner.cfg.pool_image.clone();
    let image = inner.image(&image_name)?;
    let limits = Limits {
        memory_bytes: inner.cfg.pool_memory_bytes.max(inner.default_limits.memory_bytes),
        // One vCPU, as a default sandbox: SMP guests under TCG on a loaded 2-core host were seen
        // spinning on both vCPUs for minutes.
        cpu_millicores: inner.default_limits.cpu_millicores,
        ..inner.default_limits
    };
    let name = inner.vm_name();
    let dir = inner.pool_dir.join(&name);
    let placeholder = SandboxSpec {
        id: SandboxId::generate(),
        image: image_name.clone(),
        limits,
        workdir: "/".into(),
        from_snapshot: None,
        tenant: String::new(),
        network: Default::default(),
    };
    match inner.boot_or_restore(&placeholder, &image, &dir, None).await {
        Ok((vm, pinned, Started { restored, .. })) => {
            warm_up(&vm).await;
            Ok((Pooled { vm, image: image_name, limits, restored }, pinned))
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}
