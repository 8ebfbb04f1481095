//! The daemon calls the loop makes, behind a trait: [`crate::Client`] in production, an
//! in-memory [`FakeSandbox`] in unit tests and the benchmark, so the loop's logic (resume
//! paths, termination, context) is testable without root or a daemon.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::error::{Error, Result};
use crate::proto::{
    CreateSandboxRequest, ExecRequest, ExecResult, ExecStatus, ReadFileResponse, Sandbox,
    SandboxState, SnapshotInfo,
};
use crate::Client;

/// What the agent loop needs from `sandboxd`.
#[async_trait]
pub trait SandboxApi: Send + Sync {
    /// CreateSandbox.
    async fn create(&self, request: CreateSandboxRequest) -> Result<Sandbox>;
    /// GetSandbox.
    async fn get(&self, sandbox_id: &str) -> Result<Sandbox>;
    /// Exec.
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult>;
    /// GetExec.
    async fn get_exec(&self, exec_id: &str, wait: bool) -> Result<ExecResult>;
    /// ListExecs, all of them (every page), without their output: GetExec has it.
    async fn list_execs(&self, sandbox_id: &str) -> Result<Vec<ExecResult>>;
    /// ReadFile.
    async fn read_file(
        &self,
        sandbox_id: &str,
        path: &str,
        offset: u64,
        limit: u64,
    ) -> Result<ReadFileResponse>;
    /// WriteFile, replacing the file with permission bits `mode` (0 means 0644, the daemon's
    /// default).
    async fn write_file(
        &self,
        sandbox_id: &str,
        path: &str,
        content: Vec<u8>,
        mode: u32,
    ) -> Result<u64>;
    /// Snapshot.
    async fn snapshot(&self, sandbox_id: &str, name: &str) -> Result<SnapshotInfo>;
    /// ListSnapshots of a sandbox.
    async fn list_snapshots(&self, sandbox_id: &str) -> Result<Vec<SnapshotInfo>>;
    /// Rollback.
    async fn rollback(&self, sandbox_id: &str, snapshot_id: &str) -> Result<Sandbox>;
    /// DeleteSnapshot.
    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<()>;
    /// DestroySandbox.
    async fn destroy(&self, sandbox_id: &str) -> Result<()>;
}

#[async_trait]
impl SandboxApi for Client {
    async fn create(&self, request: CreateSandboxRequest) -> Result<Sandbox> {
        Client::create(self, request).await
    }
    async fn get(&self, sandbox_id: &str) -> Result<Sandbox> {
        Client::get(self, sandbox_id).await
    }
    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        Client::exec(self, request).await
    }
    async fn get_exec(&self, exec_id: &str, wait: bool) -> Result<ExecResult> {
        Client::get_exec(self, exec_id, wait).await
    }
    async fn list_execs(&self, sandbox_id: &str) -> Result<Vec<ExecResult>> {
        Client::list_execs(self, sandbox_id, 0).await
    }
    async fn read_file(
        &self,
        sandbox_id: &str,
        path: &str,
        offset: u64,
        limit: u64,
    ) -> Result<ReadFileResponse> {
        Client::read_file(self, sandbox_id, path, offset, limit).await
    }
    async fn write_file(
        &self,
        sandbox_id: &str,
        path: &str,
        content: Vec<u8>,
        mode: u32,
    ) -> Result<u64> {
        Client::write_file(self, sandbox_id, path, content, mode).await
    }
    async fn snapshot(&self, sandbox_id: &str, name: &str) -> Result<SnapshotInfo> {
        Client::snapshot(self, sandbox_id, name).await
    }
    async fn list_snapshots(&self, sandbox_id: &str) -> Result<Vec<SnapshotInfo>> {
        Client::list_snapshots(self, sandbox_id).await
    }
    async fn rollback(&self, sandbox_id: &str, snapshot_id: &str) -> Result<Sandbox> {
        Client::rollback(self, sandbox_id, snapshot_id).await
    }
    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        Client::delete_snapshot(self, snapshot_id).await
    }
    async fn destroy(&self, sandbox_id: &str) -> Result<()> {
        Client::destroy(self, sandbox_id).await
    }
}

/// Files of a fake sandbox, by absolute path.
pub type FakeFiles = HashMap<String, Vec<u8>>;

/// Runs a command in the fake: gets the shell command line (the `-c` argument) and the files.
pub type FakeHandler = Arc<dyn Fn(&str, &mut FakeFiles) -> (i32, String) + Send + Sync>;

#[derive(Default)]
struct FakeState {
    sandboxes: HashMap<String, FakeFiles>,
    /// Permission bits by (sandbox, path), for files written with a mode or chmodded; any
    /// other file is 0644. Snapshots do not keep them.
    modes: HashMap<(String, String), u32>,
    /// `stat` is not found (an image without it).
    no_stat: bool,
    execs: Vec<ExecResult>,
    snapshots: HashMap<String, (SnapshotInfo, FakeFiles)>,
    next_id: u64,
    /// The next exec with a key is recorded as started but ends LOST (a daemon crash).
    lose_next: bool,
    /// The exec with exactly this key ends LOST.
    lose_key: Option<String>,
    /// Execs whose key contains the pattern are refused with UNAVAILABLE this many times (a
    /// daemon restarting).
    unavailable: Option<(String, u32)>,
    /// A background exec stays RUNNING for this many GetExec calls, then has exited.
    background_polls: u32,
    /// Snapshots let through before `refuse_snapshots` of them are refused with UNAVAILABLE.
    snapshots_before_refusal: u32,
    /// Snapshots are refused with UNAVAILABLE this many times.
    refuse_snapshots: u32,
    /// Snapshots named with this prefix are made, but their reply is lost (UNAVAILABLE) this
    /// many times.
    lose_snapshot_replies: Option<(String, u32)>,
}

/// What the daemon's `[exec]`/`[files]` code reads at most per ReadFile (`backend::files::MAX_READ`).
pub const FAKE_MAX_READ: u64 = 4 << 20;
/// `policy.max_background_execs_per_sandbox` of the daemon's default configuration.
pub const FAKE_MAX_BACKGROUND: usize = 32;

/// Exit code a [`FakeHandler`] returns to make its command end TIMED_OUT.
pub const FAKE_TIMED_OUT: i32 = -1;

/// An in-memory stand-in for `sandboxd`: files in a map, commands run by a handler, snapshots
/// as copies, idempotency keys replayed from the exec records like the daemon does.
#[derive(Clone)]
pub struct FakeSandbox {
    state: Arc<Mutex<FakeState>>,
    handler: FakeHandler,
}

impl FakeSandbox {
    /// A fake whose commands are run by `handler`.
    pub fn new(handler: FakeHandler) -> Self {
        FakeSandbox {
            state: Arc::new(Mutex::new(FakeState::default())),
            handler,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A file's permission bits (0644 unless written with a mode or chmodded).
    pub fn mode(&self, sandbox_id: &str, path: &str) -> Option<u32> {
        let s = self.lock();
        let exists = s
            .sandboxes
            .get(sandbox_id)
            .is_some_and(|f| f.contains_key(path));
        exists.then(|| {
            s.modes
                .get(&(sandbox_id.to_owned(), path.to_owned()))
                .copied()
                .unwrap_or(0o644)
        })
    }

    /// Makes `stat` a command not found, as in an image without it.
    pub fn break_stat(&self) {
        self.lock().no_stat = true;
    }

    /// A file's content.
    pub fn file(&self, sandbox_id: &str, path: &str) -> Option<Vec<u8>> {
        self.lock()
            .sandboxes
            .get(sandbox_id)
            .and_then(|f| f.get(path).cloned())
    }

    /// Destroys a sandbox (its snapshots stay), as a daemon losing it would.
    pub fn destroy(&self, sandbox_id: &str) {
        self.lock().sandboxes.remove(sandbox_id);
    }

    /// Makes the next keyed exec end LOST; like a daemon dying under it, the command has run
    /// (its effects are in the files) but its result is lost.
    pub fn lose_next_exec(&self) {
        self.lock().lose_next = true;
    }

    /// Makes the exec with idempotency key `key` end LOST, its effects landed.
    pub fn lose_exec_keyed(&self, key: &str) {
        self.lock().lose_key = Some(key.to_owned());
    }

    /// Refuses the next `n` execs whose idempotency key contains `pattern` with UNAVAILABLE,
    /// as a restarting daemon would.
    pub fn refuse_execs(&self, pattern: &str, n: u32) {
        self.lock().unavailable = Some((pattern.to_owned(), n));
    }

    /// Background execs stay RUNNING for `polls` GetExec calls each, then have exited 0
    /// (the default: they end at once).
    pub fn background_runs_for(&self, polls: u32) {
        self.lock().background_polls = polls;
    }

    /// Every exec record, oldest first.
    pub fn execs(&self) -> Vec<ExecResult> {
        self.lock().execs.clone()
    }

    /// Lets `skip` Snapshot calls through, then refuses `n` with UNAVAILABLE (a daemon
    /// restarting).
    pub fn refuse_snapshots_after(&self, skip: u32, n: u32) {
        let mut s = self.lock();
        s.snapshots_before_refusal = skip;
        s.refuse_snapshots = n;
    }

    /// Snapshots whose name starts with `prefix` are made but answered with UNAVAILABLE, `n`
    /// times: the reply lost after the daemon did the work.
    pub fn lose_snapshot_replies_named(&self, prefix: &str, n: u32) {
        self.lock().lose_snapshot_replies = Some((prefix.to_owned(), n));
    }

    /// Destroys every sandbox (their snapshots stay): a daemon that lost them all.
    pub fn destroy_all(&self) {
        self.lock().sandboxes.clear();
    }

    /// Drops the recorded output of `exec_id`, as the daemon does past a sandbox's output
    /// storage (`exec.max_output_storage_bytes_per_sandbox`): the record stays, marked.
    pub fn discard_output(&self, exec_id: &str) {
        if let Some(r) = self.lock().execs.iter_mut().find(|r| r.exec_id == exec_id) {
            r.stdout.clear();
            r.stderr.clear();
            r.output_discarded = true;
        }
    }

    // The daemon's own texts (sandboxd `Error`'s Display), with its codes.
    fn no_sandbox(id: &str) -> Error {
        Error::Status(tonic::Status::not_found(format!("sandbox {id} not found")))
    }
    fn no_exec(id: &str) -> Error {
        Error::Status(tonic::Status::not_found(format!("exec {id} not found")))
    }
    fn no_snapshot(id: &str) -> Error {
        Error::Status(tonic::Status::not_found(format!("snapshot {id} not found")))
    }
    fn no_file(path: &str) -> Error {
        Error::Status(tonic::Status::not_found(format!(
            "no such file in sandbox: {path}"
        )))
    }
}

fn sandbox(id: &str) -> Sandbox {
    Sandbox {
        id: id.to_owned(),
        state: SandboxState::Running as i32,
        workdir: "/workspace".into(),
        ..Default::default()
    }
}

#[async_trait]
impl SandboxApi for FakeSandbox {
    async fn create(&self, request: CreateSandboxRequest) -> Result<Sandbox> {
        let mut s = self.lock();
        s.next_id += 1;
        let id = format!("sb-fake{}", s.next_id);
        let files = if request.from_snapshot_id.is_empty() {
            FakeFiles::new()
        } else {
            s.snapshots
                .get(&request.from_snapshot_id)
                .map(|(_, files)| files.clone())
                .ok_or_else(|| Self::no_snapshot(&request.from_snapshot_id))?
        };
        s.sandboxes.insert(id.clone(), files);
        Ok(sandbox(&id))
    }

    async fn get(&self, sandbox_id: &str) -> Result<Sandbox> {
        if self.lock().sandboxes.contains_key(sandbox_id) {
            Ok(sandbox(sandbox_id))
        } else {
            Err(Self::no_sandbox(sandbox_id))
        }
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecResult> {
        let mut s = self.lock();
        if let Some((pattern, n)) = s.unavailable.as_mut() {
            if *n > 0 && request.idempotency_key.contains(pattern.as_str()) {
                *n -= 1;
                return Err(Error::Status(tonic::Status::unavailable(
                    "daemon restarting",
                )));
            }
        }
        if !request.idempotency_key.is_empty() {
            if let Some(r) = s.execs.iter().find(|r| {
                r.sandbox_id == request.sandbox_id && r.idempotency_key == request.idempotency_key
            }) {
                return Ok(r.clone());
            }
        }
        if !s.sandboxes.contains_key(&request.sandbox_id) {
            return Err(Self::no_sandbox(&request.sandbox_id));
        }
        if request.background {
            let running = s
                .execs
                .iter()
                .filter(|r| {
                    r.sandbox_id == request.sandbox_id && r.status == ExecStatus::Running as i32
                })
                .count();
            if running >= FAKE_MAX_BACKGROUND {
                return Err(Error::Status(tonic::Status::resource_exhausted(format!(
                    "policy.max_background_execs_per_sandbox ({FAKE_MAX_BACKGROUND}) reached: sandbox {} runs {running} background execs; wait for one to end",
                    request.sandbox_id
                ))));
            }
        }
        s.next_id += 1;
        let exec_id = format!("ex-fake{}", s.next_id);
        let lose_by_key = s.lose_key.as_deref() == Some(request.idempotency_key.as_str());
        let lose = lose_by_key || (s.lose_next && !request.idempotency_key.is_empty());
        if lose_by_key {
            s.lose_key = None;
        } else if lose {
            s.lose_next = false;
        }
        let command = request.argv.last().cloned().unwrap_or_default();
        let builtin = fake_mode_command(&mut s, &request.sandbox_id, &command);
        let files = s
            .sandboxes
            .get_mut(&request.sandbox_id)
            .ok_or_else(|| Self::no_sandbox(&request.sandbox_id))?;
        let run = |command: &str, files: &mut FakeFiles| match builtin.clone() {
            Some(answer) => answer,
            None => (self.handler)(command, files),
        };
        let mut result = ExecResult {
            exec_id,
            sandbox_id: request.sandbox_id.clone(),
            argv: request.argv.clone(),
            idempotency_key: request.idempotency_key.clone(),
            ..Default::default()
        };
        if lose {
            // What the daemon reports after dying under an exec: it ran, maybe only in part;
            // here its effects are all there, the worst case for a re-run.
            let _ = run(&command, files);
            result.status = ExecStatus::Lost as i32;
            result.error = "the daemon restarted while the exec ran".into();
        } else {
            let (code, out) = run(&command, files);
            result.status = ExecStatus::Exited as i32;
            result.exit_code = code;
            if code == FAKE_TIMED_OUT {
                result.status = ExecStatus::TimedOut as i32;
                result.exit_code = 137;
                result.signal = 9;
            }
            result.stdout = out.into_bytes();
            result.stdout_total_bytes = result.stdout.len() as u64;
            if request.background && s.background_polls > 0 {
                result.status = ExecStatus::Running as i32;
                result.error = format!("polls:{}", s.background_polls);
            }
        }
        s.execs.push(result.clone());
        Ok(result)
    }

    async fn get_exec(&self, exec_id: &str, wait: bool) -> Result<ExecResult> {
        let mut s = self.lock();
        let r = s
            .execs
            .iter_mut()
            .find(|r| r.exec_id == exec_id)
            .ok_or_else(|| Self::no_exec(exec_id))?;
        if r.status == ExecStatus::Running as i32 {
            // The countdown of a running background exec lives in its error field.
            let left: u32 = r
                .error
                .strip_prefix("polls:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if wait || left <= 1 {
                r.status = ExecStatus::Exited as i32;
                r.error.clear();
            } else {
                r.error = format!("polls:{}", left - 1);
            }
        }
        Ok(r.clone())
    }

    async fn list_execs(&self, sandbox_id: &str) -> Result<Vec<ExecResult>> {
        // Like the daemon: metadata only.
        Ok(self
            .lock()
            .execs
            .iter()
            .filter(|r| r.sandbox_id == sandbox_id)
            .map(|r| ExecResult {
                stdout: Vec::new(),
                stderr: Vec::new(),
                ..r.clone()
            })
            .collect())
    }

    async fn read_file(
        &self,
        sandbox_id: &str,
        path: &str,
        offset: u64,
        limit: u64,
    ) -> Result<ReadFileResponse> {
        let s = self.lock();
        let files = s
            .sandboxes
            .get(sandbox_id)
            .ok_or_else(|| Self::no_sandbox(sandbox_id))?;
        let content = files.get(path).ok_or_else(|| Self::no_file(path))?;
        // Like the daemon: at most FAKE_MAX_READ per call, 0 meaning that much.
        let limit = if limit == 0 {
            FAKE_MAX_READ
        } else {
            limit.min(FAKE_MAX_READ)
        };
        let start = (offset as usize).min(content.len());
        let end = (start + limit as usize).min(content.len());
        Ok(ReadFileResponse {
            content: content[start..end].to_vec(),
            size: content.len() as u64,
            eof: end == content.len(),
        })
    }

    async fn write_file(
        &self,
        sandbox_id: &str,
        path: &str,
        content: Vec<u8>,
        mode: u32,
    ) -> Result<u64> {
        let mut s = self.lock();
        let files = s
            .sandboxes
            .get_mut(sandbox_id)
            .ok_or_else(|| Self::no_sandbox(sandbox_id))?;
        let n = content.len() as u64;
        files.insert(path.to_owned(), content);
        // Like the daemon: 0 is 0644, and the file is replaced with exactly that mode.
        let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
        s.modes
            .insert((sandbox_id.to_owned(), path.to_owned()), mode);
        Ok(n)
    }

    async fn snapshot(&self, sandbox_id: &str, name: &str) -> Result<SnapshotInfo> {
        let mut s = self.lock();
        if s.snapshots_before_refusal > 0 {
            s.snapshots_before_refusal -= 1;
        } else if s.refuse_snapshots > 0 {
            s.refuse_snapshots -= 1;
            return Err(Error::Status(tonic::Status::unavailable(
                "daemon restarting",
            )));
        }
        let files = s
            .sandboxes
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| Self::no_sandbox(sandbox_id))?;
        s.next_id += 1;
        let id = format!("sn-fake{}", s.next_id);
        let info = SnapshotInfo {
            snapshot_id: id.clone(),
            sandbox_id: sandbox_id.to_owned(),
            name: name.to_owned(),
            ..Default::default()
        };
        s.snapshots.insert(id, (info.clone(), files));
        if let Some((prefix, n)) = s.lose_snapshot_replies.as_mut() {
            if *n > 0 && name.starts_with(prefix.as_str()) {
                *n -= 1;
                return Err(Error::Status(tonic::Status::unavailable(
                    "connection reset",
                )));
            }
        }
        Ok(info)
    }

    async fn list_snapshots(&self, sandbox_id: &str) -> Result<Vec<SnapshotInfo>> {
        let s = self.lock();
        if !s.sandboxes.contains_key(sandbox_id) {
            return Err(Self::no_sandbox(sandbox_id));
        }
        let mut list: Vec<SnapshotInfo> = s
            .snapshots
            .values()
            .filter(|(info, _)| info.sandbox_id == sandbox_id)
            .map(|(info, _)| info.clone())
            .collect();
        list.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        Ok(list)
    }

    async fn rollback(&self, sandbox_id: &str, snapshot_id: &str) -> Result<Sandbox> {
        let mut s = self.lock();
        let files = s
            .snapshots
            .get(snapshot_id)
            .map(|(_, files)| files.clone())
            .ok_or_else(|| Self::no_snapshot(snapshot_id))?;
        if !s.sandboxes.contains_key(sandbox_id) {
            return Err(Self::no_sandbox(sandbox_id));
        }
        s.sandboxes.insert(sandbox_id.to_owned(), files);
        Ok(sandbox(sandbox_id))
    }

    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        match self.lock().snapshots.remove(snapshot_id) {
            Some(_) => Ok(()),
            None => Err(Self::no_snapshot(snapshot_id)),
        }
    }
    async fn destroy(&self, sandbox_id: &str) -> Result<()> {
        match self.lock().sandboxes.remove(sandbox_id) {
            Some(_) => Ok(()),
            None => Err(Self::no_sandbox(sandbox_id)),
        }
    }
}

/// A handler understanding a few shell forms, enough for tests and the benchmark:
/// `echo TEXT >> FILE` appends a line, `cat FILE` prints a file, `seq N` prints N lines,
/// `exit N` fails, anything else succeeds printing `ran: CMD`.
pub fn basic_handler() -> FakeHandler {
    Arc::new(|cmd: &str, files: &mut FakeFiles| {
        let cmd = cmd.trim();
        if let Some((text, file)) = cmd
            .strip_prefix("echo ")
            .and_then(|rest| rest.split_once(" >> "))
        {
            let path = absolute(file.trim());
            let entry = files.entry(path).or_default();
            entry.extend_from_slice(text.trim().trim_matches('\'').as_bytes());
            entry.push(b'\n');
            return (0, String::new());
        }
        if let Some(file) = cmd.strip_prefix("cat ") {
            return match files.get(&absolute(file.trim())) {
                Some(c) => (0, String::from_utf8_lossy(c).into_owned()),
                None => (
                    1,
                    format!("cat: {}: No such file or directory\n", file.trim()),
                ),
            };
        }
        if let Some(n) = cmd
            .strip_prefix("seq ")
            .and_then(|n| n.trim().parse::<u64>().ok())
        {
            return (0, (1..=n).map(|i| format!("{i}\n")).collect());
        }
        if let Some(code) = cmd
            .strip_prefix("exit ")
            .and_then(|n| n.trim().parse::<i32>().ok())
        {
            return (code, String::new());
        }
        (0, format!("ran: {cmd}\n"))
    })
}

/// The fake's own `stat -L -c %a -- <path>` and `chmod <octal> <path>` (the commands the loop
/// and tests use for permission bits, which a [`FakeHandler`] cannot see): the answer, or
/// `None` for any other command.
fn fake_mode_command(s: &mut FakeState, sandbox_id: &str, command: &str) -> Option<(i32, String)> {
    let unquote = |p: &str| {
        let p = p.trim();
        match p.strip_prefix('\'').and_then(|p| p.strip_suffix('\'')) {
            Some(inner) => inner.replace(r"'\''", "'"),
            None => p.to_owned(),
        }
    };
    let exists = |s: &FakeState, path: &str| {
        s.sandboxes
            .get(sandbox_id)
            .is_some_and(|f| f.contains_key(path))
    };
    if let Some(path) = command.strip_prefix("stat -L -c %a -- ") {
        if s.no_stat {
            return Some((127, "sh: stat: not found\n".into()));
        }
        let path = absolute(&unquote(path));
        if !exists(s, &path) {
            return Some((
                1,
                format!("stat: cannot statx '{path}': No such file or directory\n"),
            ));
        }
        let mode = s
            .modes
            .get(&(sandbox_id.to_owned(), path))
            .copied()
            .unwrap_or(0o644);
        return Some((0, format!("{mode:o}\n")));
    }
    let (mode, path) = command.strip_prefix("chmod ")?.split_once(' ')?;
    let mode = u32::from_str_radix(mode, 8).ok()?;
    let path = absolute(&unquote(path));
    if !exists(s, &path) {
        return Some((
            1,
            format!("chmod: cannot access '{path}': No such file or directory\n"),
        ));
    }
    s.modes.insert((sandbox_id.to_owned(), path), mode & 0o7777);
    Some((0, String::new()))
}

fn absolute(path: &str) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/workspace/{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(sandbox_id: &str, cmd: &str, key: &str) -> ExecRequest {
        ExecRequest {
            idempotency_key: key.into(),
            ..crate::exec_request(sandbox_id, ["sh", "-c", cmd])
        }
    }

    #[tokio::test]
    async fn keys_replay_snapshots_restore() {
        let fake = FakeSandbox::new(basic_handler());
        let sb = fake.create(Default::default()).await.expect("create");
        fake.exec(sh(&sb.id, "echo a >> f", "k1"))
            .await
            .expect("exec");
        fake.exec(sh(&sb.id, "echo a >> f", "k1"))
            .await
            .expect("replay");
        assert_eq!(fake.file(&sb.id, "/workspace/f"), Some(b"a\n".to_vec()));
        let snap = fake.snapshot(&sb.id, "").await.expect("snap");
        fake.exec(sh(&sb.id, "echo b >> f", ""))
            .await
            .expect("exec");
        fake.rollback(&sb.id, &snap.snapshot_id)
            .await
            .expect("rollback");
        let out = fake.exec(sh(&sb.id, "cat f", "")).await.expect("cat");
        assert_eq!(out.stdout, b"a\n");
        fake.lose_next_exec();
        let lost = fake
            .exec(sh(&sb.id, "echo c >> f", "k2"))
            .await
            .expect("lost");
        assert_eq!(lost.status, ExecStatus::Lost as i32);
        fake.destroy(&sb.id);
        assert!(fake.get(&sb.id).await.is_err());
        let fork = fake
            .create(CreateSandboxRequest {
                from_snapshot_id: snap.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .expect("fork");
        assert_eq!(fake.file(&fork.id, "/workspace/f"), Some(b"a\n".to_vec()));
    }
}
