//! A manager over a fake backend, for the unit tests of the manager: admission, validation and
//! the exec engine without root.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::Manager;
use crate::backend::{Backend, BackendError, Backends, ExecSpec, OutputSink, SandboxSpec, StartSignal};
use crate::config::Config;
use crate::ids::{ExecId, SandboxId, SnapshotId};
use crate::metrics::Metrics;
use crate::model::{CapturedOutput, CreateRequest, ExecOutcome, ExecStatus, FileChunk, Isolation, OutputChunk, RequestedLimits};
use crate::store::Store;

/// What every snapshot of the fake backend holds.
pub(super) const FAKE_SNAPSHOT_BYTES: u64 = 64 << 20;

/// A PROCESS backend that makes nothing: `sleep <ms>` runs that long on the sandbox's running
/// clock (a pause stops it; or until cancelled),
/// `echo <words>` writes the words to stdout, anything else ends at once. A sandbox whose
/// workdir is [`STUCK_WORKDIR`] never comes back from its re-adoption; others come back at once,
/// one at a time.
struct FakeBackend;

/// The workdir that makes [`FakeBackend`]'s re-adoption hang.
pub(super) const STUCK_WORKDIR: &str = "/stuck";

#[async_trait::async_trait]
impl Backend for FakeBackend {
    fn isolation(&self) -> Isolation {
        Isolation::Process
    }
    fn availability(&self) -> Result<(), String> {
        Ok(())
    }
    async fn create(&self, _spec: &SandboxSpec) -> Result<(), BackendError> {
        // Long enough for concurrent creates to overlap.
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(())
    }
    async fn exec(
        &self,
        _sandbox: &SandboxId,
        spec: ExecSpec,
        sink: OutputSink,
        started: StartSignal,
        cancel: CancellationToken,
    ) -> Result<ExecOutcome, BackendError> {
        let started_at = SystemTime::now();
        if let Some(s) = started {
            let _ = s.send(());
        }
        if spec.argv[0] == "env" {
            let text: String = spec.env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
            let mut outcome = ExecOutcome::failed(ExecStatus::Exited, 0, String::new(), started_at);
            outcome.stdout = CapturedOutput { total_bytes: text.len() as u64, bytes: text.into_bytes(), ..Default::default() };
            return Ok(outcome);
        }
        if spec.argv[0] == "echo" {
            let words = spec.argv[1..].join(" ");
            if let Some(sink) = sink {
                let _ = sink.send(OutputChunk::Stdout(words.clone().into())).await;
            }
            let mut outcome = ExecOutcome::failed(ExecStatus::Exited, 0, String::new(), started_at);
            outcome.stdout = CapturedOutput { total_bytes: words.len() as u64, bytes: words.into_bytes(), ..Default::default() };
            return Ok(outcome);
        }
        if spec.argv[0] == "sleep" {
            let ms = spec.argv.get(1).and_then(|a| a.parse().ok()).unwrap_or(0);
            tokio::select! {
                () = spec.clock.sleep(Duration::from_millis(ms)) => {}
                _ = cancel.cancelled() => return Ok(ExecOutcome::failed(ExecStatus::Signaled, 137, String::new(), started_at)),
            }
        }
        Ok(ExecOutcome::failed(ExecStatus::Exited, 0, String::new(), started_at))
    }
    async fn signal_exec(&self, _sandbox: &SandboxId, exec: &ExecId, _signal: i32) -> Result<(), BackendError> {
        Err(BackendError::NoSuchExec(exec.clone()))
    }
    async fn write_file(&self, _sandbox: &SandboxId, _path: &str, content: &[u8], _mode: u32) -> Result<u64, BackendError> {
        Ok(content.len() as u64)
    }
    async fn read_file(&self, _sandbox: &SandboxId, _path: &str, _offset: u64, _limit: u64) -> Result<FileChunk, BackendError> {
        Ok(FileChunk::default())
    }
    async fn remove_file(&self, _sandbox: &SandboxId, _path: &str) -> Result<(), BackendError> {
        Ok(())
    }
    async fn upload_file(
        &self,
        _sandbox: &SandboxId,
        _path: &str,
        _mode: u32,
        mut data: tokio::sync::mpsc::Receiver<crate::backend::UploadPiece>,
    ) -> Result<u64, BackendError> {
        let mut n = 0;
        while let Some(piece) = data.recv().await {
            match piece {
                crate::backend::UploadPiece::Data(b) => n += b.len() as u64,
                crate::backend::UploadPiece::Commit => return Ok(n),
            }
        }
        Err(BackendError::UploadIncomplete { path: _path.to_string() })
    }
    async fn upload_archive(
        &self,
        _sandbox: &SandboxId,
        _dir: &str,
        _data: tokio::sync::mpsc::Receiver<crate::backend::UploadPiece>,
    ) -> Result<crate::backend::ArchiveStats, BackendError> {
        Ok(crate::backend::ArchiveStats::default())
    }
    async fn download_archive(&self, _sandbox: &SandboxId, _path: &str, _idle: std::time::Duration) -> Result<crate::backend::ByteChunks, BackendError> {
        let (_tx, rx) = tokio::sync::mpsc::channel(1);
        Ok(rx)
    }
    async fn download_file(&self, _sandbox: &SandboxId, _path: &str, _idle: std::time::Duration) -> Result<crate::backend::Download, BackendError> {
        let (_tx, chunks) = tokio::sync::mpsc::channel(1);
        Ok(crate::backend::Download { size: 0, chunks })
    }
    async fn usage(&self, _sandbox: &SandboxId) -> Result<crate::model::SandboxUsage, BackendError> {
        Ok(crate::model::SandboxUsage::default())
    }

    async fn snapshot(&self, _sandbox: &SandboxId, _snapshot: &SnapshotId, _memory: bool) -> Result<u64, BackendError> {
        Ok(FAKE_SNAPSHOT_BYTES)
    }
    async fn rollback(&self, _sandbox: &SandboxId, _snapshot: &SnapshotId) -> Result<(), BackendError> {
        Ok(())
    }
    async fn delete_snapshot(&self, _snapshot: &SnapshotId) -> Result<(), BackendError> {
        Ok(())
    }
    async fn pause(&self, _sandbox: &SandboxId) -> Result<(), BackendError> {
        Ok(())
    }
    async fn resume(&self, _sandbox: &SandboxId) -> Result<(), BackendError> {
        Ok(())
    }
    async fn destroy(&self, _sandbox: &SandboxId) -> Result<(), BackendError> {
        Ok(())
    }
    async fn clean(&self, _sandboxes: &[SandboxSpec], _snapshots: &[SnapshotId]) {}
    async fn readopt(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        if spec.workdir == STUCK_WORKDIR {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
    fn readopt_concurrency(&self) -> usize {
        1
    }
    async fn shutdown(&self) {}
}

/// A manager over [`FakeBackend`] with a `pool_size_bytes` pool and `toml` as its config.
pub(super) fn fake_manager(dir: &std::path::Path, pool_size_bytes: u64, toml: &str) -> Arc<Manager> {
    fake_manager_on(dir, pool_size_bytes, toml, crate::admission::Host::measure())
}

/// [`fake_manager`] admitting memory and pids against `host`.
pub(super) fn fake_manager_on(dir: &std::path::Path, pool_size_bytes: u64, toml: &str, host: crate::admission::Host) -> Arc<Manager> {
    let path = dir.join("sandboxd.toml");
    std::fs::write(&path, toml).expect("write config");
    let cli = crate::config::Cli { state_dir: Some(dir.to_path_buf()), pool_size_bytes: Some(pool_size_bytes), config: Some(path), ..Default::default() };
    let cfg = Arc::new(Config::load(cli).expect("config"));
    let mut backends = Backends::default();
    backends.insert(Arc::new(FakeBackend));
    let store = Store::open(&dir.join("state.db")).expect("store");
    // The catalog: a script-built `minimal` image (an empty rootfs is enough for a backend that
    // makes nothing); imported images go to `<dir>/images`.
    let images = dir.join("script-images");
    std::fs::create_dir_all(images.join("minimal/rootfs")).expect("mkdir");
    std::fs::write(images.join("minimal/image.json"), "{}").expect("write");
    let catalog = Arc::new(crate::images::Catalog::new(&images, dir, "minimal"));
    catalog.prepare().expect("catalog");
    let engine = Arc::new(crate::images::Engine::new(std::path::Path::new("/nonexistent/docker.sock")));
    Manager::new_on_host(cfg, backends, catalog, engine, store, Metrics::new().expect("metrics"), host)
}

/// A create on the PROCESS tier asking for `disk_bytes`.
pub(super) fn with_disk(disk_bytes: u64) -> CreateRequest {
    CreateRequest { isolation: Some(Isolation::Process), limits: RequestedLimits { disk_bytes, ..Default::default() }, ..Default::default() }
}
