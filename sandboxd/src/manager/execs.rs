//! The exec engine: running a command in a sandbox (foreground, background or streamed), its
//! idempotency, the records of execs in flight and ended, signals, listing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::validate::{exec_spec, validate_signal};
use super::Manager;
use crate::admission::ExecSlot;
use crate::backend::{OutputSink, SessionInput, SessionInputs, TerminalSize};
use crate::error::Error;
use crate::ids::{ExecId, SandboxId};
use crate::model::{
    ExecEvent, ExecList, ExecOutcome, ExecRecord, ExecRequest, ExecStatus, Isolation, ListExecsQuery, OutputChunk, MAX_EXECS_PAGE_BYTES, MAX_EXECS_PAGE_SIZE,
};
use crate::store::{PageQuery, PageToken, Retention, Trimmed};

/// How far an exec in flight has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Running,
    /// Its outcome is in its record: a caller may have it.
    Ended,
    /// Its record is stored and it has left the in-flight tables.
    Settled,
}

/// A running exec: its record, its [`Stage`], and the way to stop it. Finished execs live in
/// the store only, so the daemon's memory does not grow with history.
struct ExecEntry {
    record: Mutex<ExecRecord>,
    stage: watch::Receiver<Stage>,
    cancel: CancellationToken,
}

impl ExecEntry {
    fn snapshot(&self) -> Result<ExecRecord, Error> {
        self.record.lock().map(|r| r.clone()).map_err(|_| Error::Internal("exec record poisoned".into()))
    }

    /// Its record once it has ended.
    async fn wait(&self) -> Result<ExecRecord, Error> {
        self.reach(Stage::Ended).await;
        self.snapshot()
    }

    /// Once its record is stored (what a destroy or a shutdown waits for).
    async fn settled(&self) {
        self.reach(Stage::Settled).await
    }

    async fn reach(&self, stage: Stage) {
        let mut rx = self.stage.clone();
        // An Err means the sender is gone, which only happens after it sent `Settled`.
        let _ = rx.wait_for(|s| *s >= stage).await;
    }
}

/// Execs in flight, by id and by idempotency key.
#[derive(Default)]
pub(super) struct Running {
    by_id: HashMap<ExecId, Arc<ExecEntry>>,
    by_key: HashMap<(SandboxId, String), Arc<ExecEntry>>,
}

/// The events of a streamed exec (see [`Manager::exec_stream`]). Dropping it is how a reader
/// that went away says so.
pub type ExecEvents = ReceiverStream<Result<ExecEvent, Error>>;

/// What makes a streamed exec a session: its live input and its terminal.
pub struct Session {
    pub input: mpsc::Receiver<SessionInput>,
    pub tty: Option<TerminalSize>,
}

/// Events of a streamed exec waiting for its reader; the exec's output waits in the same number
/// of chunks before it, so a slow reader slows the command's output rather than growing memory.
const STREAM_BUFFER: usize = 16;

impl Manager {
    /// Runs a command. Foreground execs return when it ends; background ones at once with status
    /// Running. A repeated idempotency key returns the first exec's record (waiting for it if it
    /// still runs) instead of running again — also after a daemon restart, from the store.
    ///
    /// Dropping the returned future (a client that went away) kills a foreground exec without an
    /// idempotency key; one with a key runs on so its result can be collected later.
    pub async fn exec(self: &Arc<Self>, tenant: &str, req: ExecRequest) -> Result<ExecRecord, Error> {
        self.run_exec(tenant, req, None).await
    }

    /// Runs a command like [`Manager::exec`], streaming its output as it is produced and then its
    /// record. A bad sandbox id is refused here, before any event, so it is an error of the
    /// call rather than of the stream.
    ///
    /// Dropping the returned stream (a client that went away) kills an exec without an
    /// idempotency key, as dropping [`Manager::exec`]'s future does. An idempotent replay
    /// produces no output of its own: the recorded output is sent before the record instead, so
    /// a retried stream reads the same as the first.
    pub fn exec_stream(self: &Arc<Self>, tenant: &str, req: ExecRequest) -> Result<ExecEvents, Error> {
        self.stream_exec(tenant, req, None, None)
    }

    /// An interactive exec: like [`Manager::exec_stream`], and besides its stdin stays open for
    /// `session.input` (live stdin, its end, terminal sizes) and it may run on a terminal. The
    /// first event is [`ExecEvent::Started`] with the exec's id (for signals). A session is
    /// never a background exec; a client that goes away ends it unless it has an idempotency key.
    /// It holds a session slot of `tenant` (`[streams] max_sessions`) until its stream ends.
    pub fn exec_session(self: &Arc<Self>, tenant: &str, req: ExecRequest, session: Session) -> Result<ExecEvents, Error> {
        if req.background {
            return Err(Error::invalid("exec.background", "a session streams its exec; start a background exec with Exec"));
        }
        self.get(tenant, &req.sandbox_id)?;
        let slot = self.stream_slots.take(super::StreamKind::Session, tenant)?;
        self.stream_exec(tenant, req, Some(session), Some(slot))
    }

    fn stream_exec(self: &Arc<Self>, tenant: &str, req: ExecRequest, session: Option<Session>, slot: Option<super::StreamSlot>) -> Result<ExecEvents, Error> {
        self.get(tenant, &req.sandbox_id)?;
        let (chunk_tx, mut chunk_rx) = mpsc::channel::<OutputChunk>(STREAM_BUFFER);
        let (event_tx, event_rx) = mpsc::channel::<Result<ExecEvent, Error>>(STREAM_BUFFER);
        let manager = self.clone();
        let tenant = tenant.to_string();
        let (started_tx, mut started_rx) = match session.is_some() {
            true => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        tokio::spawn(async move {
            // Held until the stream's task ends, however it ends.
            let _slot = slot;
            let exec = manager.run_exec_with(&tenant, req, Some(chunk_tx), session.map(|s| (s, started_tx)));
            tokio::pin!(exec);
            let mut streamed = false;
            let result = loop {
                tokio::select! {
                    r = &mut exec => break r,
                    Ok(id) = async { match started_rx.as_mut() { Some(rx) => rx.await, None => std::future::pending().await } } => {
                        started_rx = None;
                        if event_tx.send(Ok(ExecEvent::Started(id))).await.is_err() {
                            return;
                        }
                    }
                    // The reader went away: returning drops `exec`, which kills the command.
                    _ = event_tx.closed() => return,
                    Some(chunk) = chunk_rx.recv() => {
                        streamed = true;
                        if event_tx.send(Ok(ExecEvent::Output(chunk))).await.is_err() {
                            return;
                        }
                    }
                }
            };
            // Output still queued after the exec ended.
            while let Ok(chunk) = chunk_rx.try_recv() {
                streamed = true;
                if event_tx.send(Ok(ExecEvent::Output(chunk))).await.is_err() {
                    return;
                }
            }
            let last = match result {
                Ok(record) => {
                    // A replayed idempotent exec streamed nothing: send its recorded output first.
                    if !streamed {
                        let out = &record.outcome;
                        let replay = [
                            (!out.stdout.bytes.is_empty()).then(|| OutputChunk::Stdout(Bytes::from(out.stdout.bytes.clone()))),
                            (!out.stderr.bytes.is_empty()).then(|| OutputChunk::Stderr(Bytes::from(out.stderr.bytes.clone()))),
                        ];
                        for chunk in replay.into_iter().flatten() {
                            if event_tx.send(Ok(ExecEvent::Output(chunk))).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(ExecEvent::Ended(Box::new(record)))
                }
                Err(e) => Err(e),
            };
            let _ = event_tx.send(last).await;
        });
        Ok(ReceiverStream::new(event_rx))
    }

    /// The exec engine behind [`Manager::exec`] and [`Manager::exec_stream`]; `sink` receives
    /// output as it is produced.
    #[tracing::instrument(name = "manager.exec", skip_all)]
    async fn run_exec(self: &Arc<Self>, tenant: &str, req: ExecRequest, sink: OutputSink) -> Result<ExecRecord, Error> {
        self.run_exec_with(tenant, req, sink, None).await
    }

    /// [`Manager::run_exec`] of a session: its input and terminal go to the backend, and its id
    /// to `started` once the command runs.
    async fn run_exec_with(
        self: &Arc<Self>,
        tenant: &str,
        mut req: ExecRequest,
        sink: OutputSink,
        session: Option<(Session, Option<tokio::sync::oneshot::Sender<ExecId>>)>,
    ) -> Result<ExecRecord, Error> {
        let begin = std::time::Instant::now();
        let (sid, entry) = self.ready_entry(tenant, &req.sandbox_id).await?;
        let info = entry.info()?;
        if !info.state.can_exec() {
            return Err(Error::IncorrectState { id: sid.to_string(), state: info.state, operation: "exec" });
        }
        let exec_id = ExecId::generate_on(self.node());
        let mut spec = exec_spec(&self.cfg, &info, &req, exec_id.clone())?;
        spec.clock = crate::backend::RunClock::new(entry.paused.subscribe());
        // Moved, not copied: the request lives as long as a foreground exec, and its stdin (up
        // to the 64 MiB message limit) must go once it is written.
        spec.stdin = crate::backend::Stdin::new(std::mem::take(&mut req.stdin));
        let mut notify_started = None;
        let is_session = session.is_some();
        if let Some((session, started)) = session {
            spec.input = SessionInputs::new(session.input);
            spec.tty = session.tty;
            notify_started = started;
        }
        let backend = self.backends.get(info.isolation)?.clone();

        let (stage_tx, stage_rx) = watch::channel(Stage::Running);
        let cancel = CancellationToken::new();
        let mut record = ExecRecord::running(exec_id.clone(), sid.clone(), req.argv.clone(), req.idempotency_key.clone());
        record.trace = req.trace.clone();
        let exec = Arc::new(ExecEntry { record: Mutex::new(record.clone()), stage: stage_rx, cancel: cancel.clone() });
        let key = (!req.idempotency_key.is_empty()).then(|| (sid.clone(), req.idempotency_key.clone()));
        // A plain foreground exec (no idempotency key, no session, not in the background) is
        // recorded off its answer's path: its running record is written while it runs (and
        // before its answer), its end after the answer. Nothing can name it before its answer
        // (its id comes with it); until its end is stored, GetExec and ListExecs show it from
        // the in-flight table. A daemon killed between the answer and that write leaves it
        // recorded as LOST, though its caller had the result. Every other exec is recorded
        // before it starts, and its answer waits for its end's record, so a retry with its key
        // after a crash, or a ListExecs after a background start, always finds it.
        let recorded_aside = key.is_none() && !req.background && !is_session && sink.is_none();
        // The exec's claim on its sandbox's and tenant's exec slots, held by the task that runs
        // it until the process has ended.
        let mut slot: Option<ExecSlot> = None;
        // Check and claim the key under one lock, so two racing calls run the command once.
        let replay: Option<Arc<ExecEntry>> = {
            let mut running = self.running.lock().map_err(|_| Error::Internal("exec table poisoned".into()))?;
            match key.as_ref().and_then(|k| running.by_key.get(k).cloned()) {
                Some(existing) => Some(existing),
                None => {
                    if let Some(k) = &key {
                        if let Some(recorded) = self.store.exec_by_key(sid.as_str(), &k.1)? {
                            tracing::debug!(sandbox = %sid, key = %k.1, "idempotent replay from the record");
                            return Ok(recorded);
                        }
                        running.by_key.insert(k.clone(), exec.clone());
                    }
                    if let Some(max) = self.cfg.policy.max_concurrent_execs() {
                        if running.by_id.len() >= max {
                            if let Some(k) = &key {
                                running.by_key.remove(k);
                            }
                            return Err(Error::ResourceExhausted(format!("policy.max_concurrent_execs ({max}) reached")));
                        }
                    }
                    match ExecSlot::take(&self.exec_slots, &self.cfg.policy.exec_caps(), tenant, &sid, req.background) {
                        Ok(s) => slot = Some(s),
                        Err(reason) => {
                            if let Some(k) = &key {
                                running.by_key.remove(k);
                            }
                            tracing::info!(sandbox = %sid, tenant, background = req.background, %reason, "exec refused");
                            return Err(Error::ResourceExhausted(reason));
                        }
                    }
                    running.by_id.insert(exec_id.clone(), exec.clone());
                    // Recorded before it starts: a crash from here on leaves a LOST record.
                    if !recorded_aside {
                        if let Err(e) = self.store.put_exec(&record) {
                            running.by_id.remove(&exec_id);
                            if let Some(k) = &key {
                                running.by_key.remove(k);
                            }
                            return Err(e.into());
                        }
                    }
                    None
                }
            }
        };
        if let Some(existing) = replay {
            tracing::debug!(sandbox = %sid, "idempotent replay of a running exec");
            return if req.background { existing.snapshot() } else { existing.wait().await };
        }

        let manager = self.clone();
        let task_exec = exec.clone();
        let tier = info.isolation;
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let recorded = begin.elapsed();
        // The running record of an exec recorded aside, written on a blocking thread while the
        // command starts; its end is written after it.
        let running_record = recorded_aside.then(|| {
            let manager = self.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = manager.store.put_exec(&record) {
                    tracing::error!(exec = %record.exec_id, error = %e, "cannot record a starting exec");
                }
            })
        });
        tokio::spawn(async move {
            let started_at = SystemTime::now();
            let ran = std::time::Instant::now();
            let outcome = match backend.exec(&sid, spec, sink, Some(started_tx), cancel).await {
                Ok(o) => o,
                Err(e) => ExecOutcome::failed(ExecStatus::Lost, -1, e.to_string(), started_at),
            };
            // The process has ended: its slot is free before anyone can see the end.
            drop(slot);
            let finished = task_exec
                .record
                .lock()
                .map(|mut r| {
                    r.outcome = outcome;
                    r.clone()
                })
                .ok();
            if let Some(r) = finished {
                manager.metrics.exec_ended(tier, r.outcome.status, r.outcome.duration);
                let backend_us = ran.elapsed().as_micros() as u64;
                let t = std::time::Instant::now();
                match running_record {
                    Some(write) => {
                        // The start's record, written while the command ran, is in the store
                        // before the answer goes (so a ListExecs after it lists the exec) and
                        // before the end's (which it must not overtake). The end's is written
                        // on a blocking thread after the answer, so the worker is free to send it.
                        let _ = write.await;
                        let _ = stage_tx.send(Stage::Ended);
                        let (m, ended) = (manager.clone(), r.clone());
                        let _ = tokio::task::spawn_blocking(move || m.exec_finished(&ended, None)).await;
                    }
                    None => manager.exec_finished(&r, key.as_ref()),
                }
                tracing::debug!(
                    exec = %r.exec_id,
                    status = ?r.outcome.status,
                    code = r.outcome.exit_code,
                    ms = r.outcome.duration.as_millis() as u64,
                    record_us = recorded.as_micros() as u64,
                    backend_us,
                    finish_us = t.elapsed().as_micros() as u64,
                    "exec ended"
                );
            }
            let _ = stage_tx.send(Stage::Settled);
        });

        if req.background {
            // Returned once the process runs, so a SignalExec right after reaches it; one that
            // could not start is returned with its final record.
            return match started_rx.await {
                Ok(()) => exec.snapshot(),
                Err(_) => exec.wait().await,
            };
        }
        if let Some(notify) = notify_started {
            let id = exec_id.clone();
            tokio::spawn(async move {
                if started_rx.await.is_ok() {
                    let _ = notify.send(id);
                }
            });
        }
        // Kill on disconnect: this guard fires if the caller's future is dropped before the end.
        let guard = req.idempotency_key.is_empty().then(|| exec.cancel.clone().drop_guard());
        let record = exec.wait().await;
        if let Some(g) = guard {
            g.disarm();
        }
        record
    }

    /// Persists an ended exec and applies the sandbox's record retention, then drops it from the
    /// in-flight tables (in that order, so an idempotent retry always finds it in one place or
    /// the other). An exec whose sandbox is being destroyed is not recorded: its records are
    /// about to go, and writing them now would leave orphans behind.
    fn exec_finished(&self, record: &ExecRecord, key: Option<&(SandboxId, String)>) {
        let live = self.sandboxes.read().ok().and_then(|m| m.get(&record.sandbox_id).and_then(|e| e.read(|i| (i.isolation, i.state)).ok()));
        if let Some((isolation, state)) = live {
            if let Err(e) = self.store.put_exec(record) {
                tracing::error!(exec = %record.exec_id, error = %e, "cannot record exec result");
            }
            let retention =
                Retention { max_records: self.cfg.exec.max_records_per_sandbox, max_output_bytes: self.cfg.exec.max_output_storage_bytes_per_sandbox };
            match self.store.trim_execs(record.sandbox_id.as_str(), retention) {
                Ok(trimmed) if state.can_exec() => self.remove_spill_files(&record.sandbox_id, isolation, trimmed),
                Ok(_) => {}
                Err(e) => tracing::warn!(sandbox = %record.sandbox_id, error = %e, "cannot trim exec records"),
            }
        }
        if let Ok(mut running) = self.running.lock() {
            running.by_id.remove(&record.exec_id);
            if let Some(key) = key {
                running.by_key.remove(key);
            }
        }
    }

    /// Removes, in the background, the spill files inside the sandbox of records trimmed from the
    /// store: they count against the sandbox's disk quota and nothing names them any more. Best
    /// effort: a failure is logged, and never holds up the end of the exec that caused the trim.
    fn remove_spill_files(&self, sandbox: &SandboxId, isolation: Isolation, trimmed: Vec<Trimmed>) {
        let paths: Vec<String> = trimmed.into_iter().flat_map(|t| t.spill_paths).collect();
        if paths.is_empty() {
            return;
        }
        let Ok(backend) = self.backends.get(isolation).cloned() else { return };
        let sid = sandbox.clone();
        tokio::spawn(async move {
            for path in paths {
                if let Err(e) = backend.remove_file(&sid, &path).await {
                    tracing::warn!(sandbox = %sid, %path, error = %e, "cannot remove the spill file of a trimmed exec record");
                }
            }
        });
    }

    /// Kills every exec in flight and waits, up to 5 s each, for it to end (at shutdown).
    pub(super) async fn kill_running_execs(&self) {
        let running: Vec<Arc<ExecEntry>> = self.running.lock().map(|r| r.by_id.values().cloned().collect()).unwrap_or_default();
        for exec in &running {
            exec.cancel.cancel();
        }
        for exec in &running {
            let _ = tokio::time::timeout(Duration::from_secs(5), exec.settled()).await;
        }
    }

    /// Execs in flight now (foreground, background and streamed).
    pub fn running_execs(&self) -> usize {
        self.running.lock().map(|r| r.by_id.len()).unwrap_or(0)
    }

    /// Returns once no exec is in flight: waits for the execs running now, then for any that
    /// started meanwhile (a drain still serves execs in the sandboxes it holds), until a look
    /// finds none. The caller bounds it.
    pub async fn execs_ended(&self) {
        loop {
            let running: Vec<Arc<ExecEntry>> = match self.running.lock() {
                Ok(r) => r.by_id.values().cloned().collect(),
                Err(_) => return,
            };
            if running.is_empty() {
                return;
            }
            futures::future::join_all(running.iter().map(|e| e.settled())).await;
        }
    }

    /// Waits, up to `timeout` in all, for the in-flight execs of a sandbox to end.
    pub(super) async fn wait_for_execs_of(&self, sid: &SandboxId, timeout: Duration) {
        let execs: Vec<Arc<ExecEntry>> = match self.running.lock() {
            Ok(r) => r.by_id.values().filter(|e| e.snapshot().is_ok_and(|r| &r.sandbox_id == sid)).cloned().collect(),
            Err(_) => return,
        };
        let all = futures::future::join_all(execs.iter().map(|e| e.settled()));
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!(sandbox = %sid, "execs still running after destroy; their records may outlive the sandbox until the next start");
        }
    }

    /// An exec in flight.
    fn running_exec(&self, exec_id: &ExecId) -> Option<Arc<ExecEntry>> {
        self.running.lock().ok().and_then(|r| r.by_id.get(exec_id).cloned())
    }

    /// A recorded exec; with `wait`, once it has ended.
    pub async fn get_exec(&self, tenant: &str, exec_id: &str, wait: bool) -> Result<ExecRecord, Error> {
        let eid = ExecId::parse(exec_id).map_err(|_| Error::ExecNotFound(exec_id.chars().take(80).collect()))?;
        if let Some(exec) = self.running_exec(&eid) {
            self.check_exec_tenant(tenant, &exec.snapshot()?)?;
            return if wait { exec.wait().await } else { exec.snapshot() };
        }
        let record = self.store.exec(eid.as_str())?.ok_or_else(|| Error::ExecNotFound(eid.to_string()))?;
        self.check_exec_tenant(tenant, &record)?;
        Ok(record)
    }

    /// An exec belongs to its sandbox's tenant.
    fn check_exec_tenant(&self, tenant: &str, record: &ExecRecord) -> Result<(), Error> {
        self.entry(tenant, record.sandbox_id.as_str()).map(|_| ()).map_err(|_| Error::ExecNotFound(record.exec_id.to_string()))
    }

    /// Sends a signal to every process of a running exec.
    pub async fn signal_exec(&self, tenant: &str, exec_id: &str, signal: i32) -> Result<(), Error> {
        validate_signal(signal)?;
        let eid = ExecId::parse(exec_id).map_err(|_| Error::ExecNotFound(exec_id.chars().take(80).collect()))?;
        let Some(exec) = self.running_exec(&eid) else {
            return match self.store.exec_meta(eid.as_str())? {
                Some(r) => {
                    self.check_exec_tenant(tenant, &r)?;
                    Err(Error::FailedPrecondition(format!("exec {eid} has already ended")))
                }
                None => Err(Error::ExecNotFound(eid.to_string())),
            };
        };
        let record = exec.snapshot()?;
        self.check_exec_tenant(tenant, &record)?;
        let info = self.get(tenant, record.sandbox_id.as_str())?;
        let backend = self.backends.get(info.isolation)?.clone();
        backend.signal_exec(&record.sandbox_id, &record.exec_id, signal).await?;
        Ok(())
    }

    /// One page of the sandbox's exec records, oldest first (see [`ListExecsQuery`]). Memory and
    /// the response stay O(page): at most [`MAX_EXECS_PAGE_SIZE`] records, and a page stops
    /// before [`MAX_EXECS_PAGE_BYTES`] of records (with at least one record on it).
    pub fn list_execs(&self, tenant: &str, q: &ListExecsQuery) -> Result<ExecList, Error> {
        let (sid, _) = self.entry(tenant, &q.sandbox_id)?;
        let token = match q.page_token.as_str() {
            "" => None,
            t => Some(PageToken::parse(t).ok_or_else(|| Error::invalid("page_token", "not a token from a previous ListExecs response"))?),
        };
        let page_size = match q.page_size {
            0 => MAX_EXECS_PAGE_SIZE,
            n => (n as usize).min(MAX_EXECS_PAGE_SIZE),
        };
        let query = PageQuery { limit: q.limit, token, page_size, include_output: q.include_output, max_bytes: MAX_EXECS_PAGE_BYTES };
        let page = self.store.exec_page(sid.as_str(), &query)?;
        let mut records = page.records;
        // Running ones are stored as they started; show their live state (no output until the end).
        for r in &mut records {
            if r.outcome.status == ExecStatus::Running {
                if let Some(live) = self.running_exec(&r.exec_id).and_then(|e| e.snapshot().ok()) {
                    *r = live;
                }
            }
        }
        Ok(ExecList { records, next_page_token: page.next.map(|t| t.encode()).unwrap_or_default() })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;

    use super::super::fake::fake_manager;
    use super::super::Manager;
    use crate::error::Error;
    use crate::model::{CreateRequest, ExecEvent, ExecRecord, ExecRequest, ExecStatus, ListExecsQuery, OutputChunk};

    /// A plain exec (recorded off its answer's path) is listed with its end, and found with its
    /// output, the moment its answer comes; a destroy right after leaves no record of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plain_exec_is_listed_with_its_end_as_it_answers_and_goes_with_its_sandbox() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        for round in 0..20 {
            let id = m.create("t", CreateRequest::default()).await.expect("create").id.to_string();
            let words = format!("round {round}");
            let req = ExecRequest { sandbox_id: id.clone(), argv: vec!["echo".into(), words.clone()], ..Default::default() };
            let r = m.exec("t", req).await.expect("exec");
            assert_eq!(r.outcome.status, ExecStatus::Exited, "round {round}");
            let listed = m.list_execs("t", &ListExecsQuery { sandbox_id: id.clone(), ..Default::default() }).expect("ListExecs");
            let seen: Vec<_> = listed.records.iter().map(|e| (e.exec_id.clone(), e.outcome.status)).collect();
            assert_eq!(seen, vec![(r.exec_id.clone(), ExecStatus::Exited)], "round {round}: listed right after its answer");
            let got = m.get_exec("t", r.exec_id.as_str(), false).await.expect("GetExec");
            assert_eq!(got.outcome.stdout.bytes, words.into_bytes(), "round {round}");
            m.destroy("t", &id).await.expect("destroy");
            assert!(m.store.exec(r.exec_id.as_str()).expect("store").is_none(), "round {round}: the record outlived its sandbox");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exec_caps_refuse_naming_the_key_and_free_when_execs_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "[policy]\nmax_background_execs_per_sandbox = 2\nmax_running_execs_per_tenant = 3\n");
        let a = m.create("t", CreateRequest::default()).await.expect("a").id.to_string();
        let b = m.create("t", CreateRequest::default()).await.expect("b").id.to_string();
        let run = |sandbox: &str, argv: &[&str], background: bool| ExecRequest {
            sandbox_id: sandbox.to_string(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            background,
            ..Default::default()
        };
        for _ in 0..2 {
            let r = m.exec("t", run(&a, &["sleep", "300"], true)).await.expect("background");
            assert_eq!(r.outcome.status, ExecStatus::Running);
        }
        let err = m.exec("t", run(&a, &["sleep", "300"], true)).await.expect_err("third background");
        assert!(matches!(&err, Error::ResourceExhausted(m) if m.contains("policy.max_background_execs_per_sandbox (2)")), "{err}");
        m.exec("t", run(&b, &["true"], false)).await.expect("a foreground exec elsewhere runs");
        m.exec("t", run(&b, &["sleep", "300"], true)).await.expect("the tenant's third");
        let err = m.exec("t", run(&b, &["true"], false)).await.expect_err("the tenant's fourth");
        assert!(err.to_string().contains("policy.max_running_execs_per_tenant (3)"), "{err}");
        // Ended execs free their slots.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let slots = m.exec_slots.lock().map(|s| (s.of_tenant("t").running, s.of_tenant("t").background)).expect("lock");
        assert_eq!(slots, (0, 0), "nothing runs any more");
        m.exec("t", run(&a, &["true"], false)).await.expect("room again");
    }

    /// The sandbox's exec records once `done` holds for them (polled, for at most 5 s).
    async fn records_when(m: &Manager, sandbox: &str, done: impl Fn(&[ExecRecord]) -> bool) -> Vec<ExecRecord> {
        let query = ListExecsQuery { sandbox_id: sandbox.to_string(), ..Default::default() };
        for _ in 0..250 {
            let records = m.list_execs("t", &query).expect("list").records;
            if done(&records) {
                return records;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("exec records never got there: {:?}", m.list_execs("t", &query).map(|l| l.records));
    }

    #[tokio::test]
    async fn a_stream_replayed_by_idempotency_key_reads_the_same_as_the_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let sb = m.create("t", CreateRequest::default()).await.expect("sandbox").id.to_string();
        let req = ExecRequest { sandbox_id: sb.clone(), argv: vec!["echo".into(), "hello".into()], idempotency_key: "k".into(), ..Default::default() };
        let mut reads = Vec::new();
        for _ in 0..2 {
            let events: Vec<_> = m.exec_stream("t", req.clone()).expect("stream").collect().await;
            let read: Vec<String> = events
                .into_iter()
                .map(|e| match e.expect("event") {
                    ExecEvent::Output(OutputChunk::Stdout(b)) => format!("stdout {}", String::from_utf8_lossy(&b)),
                    ExecEvent::Output(OutputChunk::Stderr(b)) => format!("stderr {}", String::from_utf8_lossy(&b)),
                    ExecEvent::Ended(r) => format!("ended {} {:?}", r.exec_id, r.outcome.status),
                    ExecEvent::Started(id) => format!("started {id} (only sessions report it)"),
                })
                .collect();
            reads.push(read);
        }
        assert_eq!((reads[0].len(), reads[0][0].as_str()), (2, "stdout hello"), "{reads:?}");
        assert_eq!(reads[0], reads[1], "the replay sends the recorded output, then the same record");
        // A sandbox the caller cannot see is refused before any stream exists.
        let err = m.exec_stream("other", req).expect_err("another tenant's sandbox");
        assert!(matches!(err, Error::SandboxNotFound(_)), "{err}");
    }

    #[tokio::test]
    async fn dropping_a_stream_kills_its_exec_unless_it_has_an_idempotency_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let sb = m.create("t", CreateRequest::default()).await.expect("sandbox").id.to_string();
        let sleep =
            |key: &str| ExecRequest { sandbox_id: sb.clone(), argv: vec!["sleep".into(), "1000".into()], idempotency_key: key.into(), ..Default::default() };
        let unkeyed = m.exec_stream("t", sleep("")).expect("stream");
        let keyed = m.exec_stream("t", sleep("k")).expect("stream");
        records_when(&m, &sb, |r| r.len() == 2).await;
        drop((unkeyed, keyed));
        let records = records_when(&m, &sb, |r| r.iter().any(|r| r.outcome.status != ExecStatus::Running)).await;
        let status = |key: &str| records.iter().find(|r| r.idempotency_key == key).map(|r| r.outcome.status);
        assert_eq!(status(""), Some(ExecStatus::Signaled), "the reader went away: killed");
        assert_eq!(status("k"), Some(ExecStatus::Running), "a keyed exec runs on for a retry to collect");
        let keyed = records.iter().find(|r| r.idempotency_key == "k").expect("keyed record");
        let end = m.get_exec("t", keyed.exec_id.as_str(), true).await.expect("wait");
        assert_eq!(end.outcome.status, ExecStatus::Exited);
    }
}
