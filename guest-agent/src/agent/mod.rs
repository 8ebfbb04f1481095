//! `sandbox-agent`, PID 1 of a sandboxd microVM: boots the guest ([`boot`]), then serves the
//! host's requests ([`guest_agent::protocol`]) on a virtio-serial port ([`port`]).
//!
//! One reader turns the byte stream into frames; every request runs on its own thread (execs run
//! concurrently) and answers through the shared [`Conn`], whose lock keeps each frame whole —
//! except the live input of interactive execs (`Stdin`, `CloseStdin`, `Resize`), which the
//! reader hands, in arrival order, to the exec's own writer ([`input`]), and the pieces of an
//! archive upload, which it hands the same way to the upload's extraction thread ([`archive`]):
//! stdin bytes and tar streams must not race each other on separate threads. What
//! the host sends is never trusted: garbage and malformed headers are answered with
//! `Error{BadRequest}`, a panic while handling a request with `Error{Internal}`, and the agent
//! goes on — PID 1 must never exit.

pub mod archive;
pub mod boot;
pub mod cgroup;
pub mod console;
pub mod exec;
pub mod files;
pub mod input;
pub mod machine;
pub mod port;
pub mod reaper;
pub mod workers;

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use guest_agent::protocol::{encode, Decoded, Decoder, Envelope, ErrorKind, Request, Response, VERSION};

use console::log;

/// Stack of a request thread: request handlers are shallow, and a small VM runs many execs.
const REQUEST_STACK: usize = 256 << 10;

/// Why a request failed, as the host will see it.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RequestError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        RequestError { kind, message: message.into() }
    }
}

/// The sending half of the connection to the host, shared by every request thread.
pub struct Conn {
    writer: Mutex<Box<dyn Write + Send>>,
}

impl Conn {
    pub fn new(writer: impl Write + Send + 'static) -> Arc<Self> {
        Arc::new(Conn { writer: Mutex::new(Box::new(writer)) })
    }

    /// Sends one frame. A frame that cannot be encoded becomes an `Error{Internal}`; a write
    /// that fails is logged (the host is gone; it will ask again).
    pub fn send(&self, id: u64, resp: &Response, payload: &[u8]) {
        let frame = encode(id, resp, payload).or_else(|e| {
            log!("cannot encode the answer to request {id}: {e}");
            encode(id, &Response::Error { kind: ErrorKind::Internal, message: e.to_string() }, &[])
        });
        let Ok(frame) = frame else { return };
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = w.write_all(&frame).and_then(|()| w.flush()) {
            log!("cannot send the answer to request {id}: {e}");
        }
    }
}

/// Everything a request may touch.
pub struct Agent {
    files: files::Files,
    archives: archive::Archives,
    /// Always present in the guest (boot fails without it); `None` only in unit tests.
    cgroup: Option<cgroup::SandboxCgroup>,
    running: exec::Running,
    machine: Box<dyn machine::Machine>,
    /// What `Configure` last applied to the machine, so a repeat leaves it alone.
    applied: Mutex<Applied>,
    /// The threads requests run on.
    workers: Arc<workers::Workers>,
}

/// The machine settings the last `Configure` applied. It is in the agent's memory, so a VM
/// resumed from a memory snapshot knows what its cgroup, /dev/shm and eth0 hold: a restore of
/// the image's boot snapshot (configured before it was saved) with the same limits skips the
/// writes, each a cold kernel path that QEMU's TCG translates anew in a resumed VM (40-110 ms).
#[derive(Default)]
struct Applied {
    /// Memory, pids and CPU of the sandbox cgroup.
    limits: Option<(u64, u32, u32)>,
    shm_bytes: Option<u64>,
    /// `Some(None)`: eth0 known down (or absent).
    network: Option<Option<guest_agent::protocol::GuestNetwork>>,
}

impl Agent {
    /// The agent of a booted guest: files under `/`, execs under `cgroup`.
    pub fn new(cgroup: cgroup::SandboxCgroup, machine: Box<dyn machine::Machine>) -> Arc<Self> {
        Arc::new(Agent {
            files: files::Files::new("/"),
            archives: archive::Archives::new("/"),
            cgroup: Some(cgroup),
            running: exec::Running::default(),
            machine,
            applied: Mutex::default(),
            workers: workers::Workers::new(REQUEST_STACK),
        })
    }

    /// Handles one event of the stream. A request gets a thread of its own; everything else is
    /// answered here.
    pub fn on_event(self: &Arc<Self>, event: Decoded, conn: &Arc<Conn>) {
        let frame = match event {
            Decoded::Frame(f) => f,
            Decoded::Garbage { skipped, reason } => {
                log!("skipped {skipped} bytes from the host: {reason}");
                let message = format!("skipped {skipped} bytes: {reason}");
                conn.send(0, &Response::Error { kind: ErrorKind::BadRequest, message }, &[]);
                return;
            }
        };
        let envelope: Envelope<Request> = match frame.envelope() {
            Ok(e) => e,
            Err(e) => {
                // Answer with the request's id if at least that much can be read.
                let id = serde_json::from_slice::<serde_json::Value>(&frame.header).ok().and_then(|v| v.get("id")?.as_u64()).unwrap_or(0);
                let message = format!("cannot parse the request: {e}");
                conn.send(id, &Response::Error { kind: ErrorKind::BadRequest, message }, &[]);
                return;
            }
        };
        let id = envelope.id;
        let payload = frame.payload;
        // Live input is queued here, on the reader, so it keeps the order it was sent in; the
        // exec's writer answers it. Only a refusal is answered from here (on a thread: the
        // reader must not wait on the host).
        let input = match envelope.msg {
            // Pieces of a tar stream, likewise in order; the extraction thread answers them.
            Request::UploadArchive { transfer, dest, offset, last } => {
                let answer_conn = conn.clone();
                let answer: input::Answer = Arc::new(move |id, resp: &Response, bytes: &[u8]| answer_conn.send(id, resp, bytes));
                if let Err(e) = self.archives.upload(id, &transfer, &dest, offset, last, payload, &answer) {
                    answer_later(id, Response::Error { kind: e.kind, message: e.message }, conn);
                }
                None
            }
            Request::Stdin { exec_id } => Some((exec_id, input::Input::Bytes(payload))),
            Request::CloseStdin { exec_id } => Some((exec_id, input::Input::Close)),
            Request::Resize { exec_id, rows, cols } => Some((exec_id, input::Input::Resize { rows, cols })),
            msg => {
                self.spawn_handler(id, msg, payload, conn);
                None
            }
        };
        if let Some((exec_id, input)) = input {
            if let Err(e) = self.running.input(id, &exec_id, input) {
                answer_later(id, Response::Error { kind: e.kind, message: e.message }, conn);
            }
        }
    }

    /// Handles a request on a thread of its own.
    fn spawn_handler(self: &Arc<Self>, id: u64, msg: Request, payload: Vec<u8>, conn: &Arc<Conn>) {
        let (agent, thread_conn) = (self.clone(), conn.clone());
        let spawned = self.workers.run(Box::new(move || agent.handle(id, msg, payload, &thread_conn)));
        if let Err(e) = spawned {
            conn.send(id, &Response::Error { kind: ErrorKind::Internal, message: format!("cannot start a thread for the request: {e}") }, &[]);
        }
    }

    /// Answers one request with its final frame, whatever happens while handling it.
    fn handle(&self, id: u64, req: Request, payload: Vec<u8>, conn: &Arc<Conn>) {
        if req == Request::Shutdown {
            conn.send(id, &Response::Ok, &[]);
            self.machine.power_off();
            return;
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.dispatch(id, req, payload, conn)));
        let (resp, payload) = match outcome {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => (Response::Error { kind: e.kind, message: e.message }, Vec::new()),
            Err(panic) => {
                let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
                log!("request {id} panicked: {what}");
                (Response::Error { kind: ErrorKind::Internal, message: format!("the agent failed handling the request: {what}") }, Vec::new())
            }
        };
        conn.send(id, &resp, &payload);
    }

    fn dispatch(&self, id: u64, req: Request, payload: Vec<u8>, conn: &Arc<Conn>) -> Result<(Response, Vec<u8>), RequestError> {
        let ok = Ok((Response::Ok, Vec::new()));
        match req {
            Request::Hello => Ok((Response::Hello { version: VERSION, kernel: machine::kernel_release(), uptime_ms: machine::uptime_ms() }, Vec::new())),
            Request::Configure(limits) => {
                let mut applied = self.applied.lock().unwrap_or_else(|p| p.into_inner());
                let wanted = (limits.memory_bytes, limits.max_pids, limits.cpu_millicores);
                if let Some(cg) = self.cgroup.as_ref().filter(|_| applied.limits != Some(wanted)) {
                    cg.configure(&limits).map_err(|e| RequestError::new(ErrorKind::Internal, e.to_string()))?;
                    applied.limits = Some(wanted);
                }
                if limits.shm_bytes > 0 && applied.shm_bytes != Some(limits.shm_bytes) {
                    self.machine.size_shm(limits.shm_bytes)?;
                    applied.shm_bytes = Some(limits.shm_bytes);
                }
                if !limits.hostname.is_empty() {
                    self.machine.set_hostname(&limits.hostname)?;
                    // The name resolves and /etc/hostname agrees (a fork's disk names its
                    // parent, a pooled VM's the image).
                    self.files.write_identity(&limits.hostname)?;
                }
                if !limits.workdir.is_empty() {
                    self.files.create_dir_all(&limits.workdir)?;
                }
                if !limits.machine_id.is_empty() {
                    self.files.write_machine_id(&limits.machine_id)?;
                }
                if applied.network != Some(limits.network) {
                    // Unknown until it is applied: a failure leaves it so.
                    applied.network = None;
                    self.machine.configure_network(limits.network.as_ref())?;
                    applied.network = Some(limits.network);
                }
                if let Some(n) = &limits.network {
                    self.files.write_resolv_conf(n.gateway)?;
                }
                ok
            }
            Request::Exec(req) => self.exec(id, &req, exec::Session::default(), payload, conn),
            Request::ExecSession { exec, tty, interactive } => self.exec(id, &exec, exec::Session { tty, interactive }, payload, conn),
            // Queued by the reader (`on_event`); never handled on a thread of their own.
            Request::Stdin { .. } | Request::CloseStdin { .. } | Request::Resize { .. } => {
                Err(RequestError::new(ErrorKind::Internal, "exec input reached a request thread"))
            }
            Request::UploadArchive { .. } => Err(RequestError::new(ErrorKind::Internal, "an archive piece reached a request thread")),
            Request::DownloadArchive { transfer, path } => {
                let send = |resp: &Response, bytes: &[u8]| conn.send(id, resp, bytes);
                let made = self.archives.download(&transfer, &path, &send)?;
                Ok((Response::ArchiveEnd(made), Vec::new()))
            }
            Request::Signal { exec_id, signal } => {
                if !(1..=64).contains(&signal) {
                    return Err(RequestError::new(ErrorKind::BadRequest, format!("invalid signal number {signal}")));
                }
                if self.running.signal(&exec_id, signal) {
                    ok
                } else {
                    Err(RequestError::new(ErrorKind::NoSuchExec, format!("no running exec {exec_id}")))
                }
            }
            Request::WriteFile { path, mode, append } => {
                let size = self.files.write(&path, mode, append, &payload)?;
                persist();
                Ok((Response::Written { size }, Vec::new()))
            }
            Request::WriteStaged { transfer, path, mode, offset, commit } => {
                let size = self.files.write_staged(&transfer, &path, mode, offset, commit, &payload)?;
                if commit {
                    persist();
                }
                Ok((Response::Written { size }, Vec::new()))
            }
            Request::AbortWrite { transfer } => {
                // One namespace of transfer ids: whichever kind goes by this one stops.
                self.files.abort_staged(&transfer);
                self.archives.abort(&transfer);
                ok
            }
            Request::RemoveFile { path } => {
                self.files.remove(&path)?;
                persist();
                ok
            }
            Request::ReadFile { path, offset, limit } => {
                let chunk = self.files.read(&path, offset, limit)?;
                Ok((Response::FileData { size: chunk.size, eof: chunk.eof }, chunk.bytes))
            }
            Request::Freeze => self.machine.freeze().and(ok),
            Request::Thaw => self.machine.thaw().and(ok),
            Request::Resumed { unix_time_ns } => self.machine.resumed(unix_time_ns, &payload).and(ok),
            // Answered in `handle`, before the power goes.
            Request::Shutdown => ok,
        }
    }

    /// Runs an exec (request `id`) to its final record.
    fn exec(
        &self,
        id: u64,
        req: &guest_agent::protocol::ExecRequest,
        session: exec::Session,
        payload: Vec<u8>,
        conn: &Arc<Conn>,
    ) -> Result<(Response, Vec<u8>), RequestError> {
        let answer_conn = conn.clone();
        let answer: input::Answer = Arc::new(move |id, resp: &Response, bytes: &[u8]| answer_conn.send(id, resp, bytes));
        let env = exec::Env { files: &self.files, cgroup: self.cgroup.as_ref(), running: &self.running, answer };
        let send = |resp: &Response, bytes: &[u8]| conn.send(id, resp, bytes);
        let (exit, out) = exec::run(&env, req, session, payload, &send)?;
        persist();
        Ok((Response::Exited(exit), out))
    }
}

/// Sends `resp` to request `id` from a short-lived thread, so the caller (the reader) never
/// waits for a host that reads slowly; inline only when no thread can be made.
fn answer_later(id: u64, resp: Response, conn: &Arc<Conn>) {
    let (thread_conn, thread_resp) = (conn.clone(), resp.clone());
    let spawned = std::thread::Builder::new().name(format!("ans-{id}")).stack_size(REQUEST_STACK).spawn(move || thread_conn.send(id, &thread_resp, &[]));
    if spawned.is_err() {
        conn.send(id, &resp, &[]);
    }
}

/// Pushes what an exec or a file write changed out of the guest's page cache to the disk, before
/// the answer: the host keeps the disk image in its own page cache (QEMU ignores flushes there),
/// so a finished exec's files survive QEMU or the daemon being killed, as on the other tiers,
/// for the cost of a `sync` (a few ms, nothing when nothing changed).
fn persist() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// The receiving half of a connection: bytes in, requests dispatched.
pub struct Session {
    decoder: Decoder,
    agent: Arc<Agent>,
    conn: Arc<Conn>,
}

impl Session {
    pub fn new(agent: Arc<Agent>, conn: Arc<Conn>) -> Self {
        Session { decoder: Decoder::new(), agent, conn }
    }

    /// Handles every complete frame (or garbage) in what was read so far.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.decoder.push(bytes);
        while let Some(event) = self.decoder.next() {
            self.agent.on_event(event, &self.conn);
        }
    }

    /// The host went away: half a frame of the old connection must not prefix the new one's,
    /// and its archive transfers are orphans (a new host cannot know their ids; an upload would
    /// otherwise hold its slot until it expires).
    pub fn reset(&mut self) {
        self.decoder = Decoder::new();
        self.agent.archives.abort_all();
    }
}

#[cfg(test)]
mod tests;
