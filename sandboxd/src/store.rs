//! Durable state: sandboxes, snapshots and exec records in SQLite under `--state-dir`, exec
//! output bodies in files beside it.
//!
//! SQLite (bundled, WAL, `synchronous=NORMAL`) because the records must survive a `kill -9` of
//! the daemon — idempotent execs are replayed from here after a restart — and because ListExecs
//! wants ordered range scans per sandbox. A commit in WAL mode is an append to the log, well under
//! a millisecond, so it sits on the exec path without hurting the round trip; `NORMAL` loses at
//! most the last commits on power loss, never on a process crash.
//!
//! Each record is a JSON document (the core types derive serde) plus the columns queries need.
//! Exec output (up to two streams of `exec.max_output_bytes_ceiling` each) does not go into the
//! database: a row holds only the metadata and the body lengths, the bodies live in
//! `<state_dir>/outputs/<sandbox_id>/<exec_id>.{out,err}` (directories 0700, files 0600). In the
//! database they made every page of the file, every VACUUM-less delete and every ListExecs scan
//! pay for megabytes nobody asked for; as files they cost nothing until GetExec reads them, they
//! go with one `remove_dir_all` when the sandbox does, and their total per sandbox is bounded by
//! [`Retention::max_output_bytes`]. A body is written to a temporary name and renamed into place,
//! so a crash leaves either the old file, the new one or a `.tmp` that the next start removes
//! ([`Store::prune_orphans`]); like the database's `NORMAL` mode, no fsync is paid on the exec
//! path, so a power loss may lose the newest bodies (the record then reads as output discarded).
//!
//! Schema history: version 1 kept the bodies in BLOB columns `execs.stdout`/`execs.stderr`.
//! Opening a version-1 database moves every body out into its file (kept, not dropped: an
//! idempotent replay after the upgrade still returns the output), drops the two columns in one
//! transaction and VACUUMs, so the space goes back to the host.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};

use crate::ids::{ExecId, SandboxId};
use crate::model::{CapturedOutput, ExecOutcome, ExecRecord, ExecStatus, SandboxInfo, SnapshotRecord};

/// Version of the schema this build writes. A newer database is refused, not silently misread.
const SCHEMA_VERSION: i64 = 2;

/// The directory under the state dir that holds exec output bodies.
const OUTPUTS_DIR: &str = "outputs";

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("state database {path} has schema version {found}, newer than this sandboxd ({SCHEMA_VERSION})")]
    TooNew { path: PathBuf, found: i64 },
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("state database record {id}: {message}")]
    Corrupt { id: String, message: String },
    #[error("exec output file {path}: {source}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error("state database lock poisoned")]
    Poisoned,
}

/// How much exec history a sandbox keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Records kept; the oldest finished ones beyond it are deleted, metadata and output.
    pub max_records: usize,
    /// Bytes of stdout+stderr bodies kept on disk for the sandbox; beyond it the oldest finished
    /// records lose their bodies (their metadata stays, marked `output_discarded`).
    pub max_output_bytes: u64,
}

/// A record trimmed by [`Store::trim_execs`] (deleted, or its output discarded): its spill files
/// inside the sandbox are no longer referenced and should be removed too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trimmed {
    pub exec_id: String,
    /// Paths inside the sandbox (`stdout_spill_path`, `stderr_spill_path`) that were set.
    pub spill_paths: Vec<String>,
}

/// Where a ListExecs listing is: records with `after < seq <= last` remain. Fixed by the first
/// page (so `limit` keeps its meaning across pages and records added meanwhile do not shift
/// anything), carried by the client as an opaque string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageToken {
    after: i64,
    last: i64,
}

impl PageToken {
    /// The token as the client carries it.
    pub fn encode(&self) -> String {
        format!("{}.{}", self.after, self.last)
    }

    /// A token produced by [`PageToken::encode`], or None when `s` is not one.
    pub fn parse(s: &str) -> Option<PageToken> {
        let (after, last) = s.split_once('.')?;
        let (after, last): (i64, i64) = (after.parse().ok()?, last.parse().ok()?);
        (0 <= after && after < last).then_some(PageToken { after, last })
    }
}

/// One ListExecs page request, resolved by the manager.
#[derive(Debug, Clone, Copy)]
pub struct PageQuery {
    /// The newest `limit` records (0 = all); used only when there is no token.
    pub limit: u32,
    /// Where the previous page stopped.
    pub token: Option<PageToken>,
    /// Most records on the page (at least 1).
    pub page_size: usize,
    /// Read the bodies from their files too.
    pub include_output: bool,
    /// A page stops before its records (JSON metadata, plus bodies when included) would pass this
    /// many bytes; it always holds at least one record, so a listing always makes progress.
    pub max_bytes: u64,
}

/// One ListExecs page, oldest first.
#[derive(Debug, Default)]
pub struct ExecPage {
    pub records: Vec<ExecRecord>,
    /// Set when records remain after this page.
    pub next: Option<PageToken>,
}

/// What a sandbox's exec records hold: their count, and the bytes of the bodies not discarded.
/// Counted once (by the first trim of the sandbox after the store opens), then kept exact by
/// every write under the database lock, so that [`Store::trim_execs`] after every exec costs
/// a few index lookups instead of a walk over all of the sandbox's records (up to
/// `max_records_per_sandbox` of them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    records: u64,
    bytes: u64,
}

/// The daemon's durable state.
pub struct Store {
    conn: Mutex<Connection>,
    /// [`Held`] per sandbox id; taken only while holding `conn`'s lock.
    held: Mutex<HashMap<String, Held>>,
    /// `<state_dir>/outputs`: one directory per sandbox with recorded output.
    outputs: PathBuf,
    /// Bytes of argv a stored exec record keeps (`exec.max_record_argv_bytes`).
    max_record_argv: std::sync::atomic::AtomicUsize,
}

fn encode<T: serde::Serialize>(id: &str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt { id: id.to_string(), message: e.to_string() })
}

fn decode<T: serde::de::DeserializeOwned>(id: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt { id: id.to_string(), message: e.to_string() })
}

/// `argv` cut so its strings hold at most `max` bytes: whole arguments while they fit, then
/// the start of the first that does not (at a character boundary); whether anything was cut.
/// One exec may carry up to ~256 KiB of argv, which every stored record would otherwise keep.
pub fn cap_argv(argv: &[String], max: usize) -> (Vec<String>, bool) {
    let mut out = Vec::new();
    let mut left = max;
    for arg in argv {
        if arg.len() <= left {
            left -= arg.len();
            out.push(arg.clone());
            continue;
        }
        let mut cut = left;
        while !arg.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut > 0 {
            out.push(arg[..cut].to_string());
        }
        return (out, true);
    }
    (out, false)
}

/// A record's metadata: everything but the output bodies (which are not cloned), with its argv
/// within `max_argv` bytes.
fn without_bodies(rec: &ExecRecord, max_argv: usize) -> ExecRecord {
    let (argv, cut) = cap_argv(&rec.argv, max_argv);
    let meta = |c: &CapturedOutput| CapturedOutput { bytes: Vec::new(), truncated: c.truncated, total_bytes: c.total_bytes, spill_path: c.spill_path.clone() };
    let o = &rec.outcome;
    ExecRecord {
        exec_id: rec.exec_id.clone(),
        sandbox_id: rec.sandbox_id.clone(),
        argv,
        argv_truncated: rec.argv_truncated || cut,
        idempotency_key: rec.idempotency_key.clone(),
        outcome: ExecOutcome {
            status: o.status,
            exit_code: o.exit_code,
            signal: o.signal,
            stdout: meta(&o.stdout),
            stderr: meta(&o.stderr),
            started_at: o.started_at,
            duration: o.duration,
            usage: o.usage,
            error: o.error.clone(),
        },
        output_discarded: false,
        trace: rec.trace.clone(),
    }
}

/// The spill paths a record names.
fn spill_paths(rec: &ExecRecord) -> Vec<String> {
    [&rec.outcome.stdout.spill_path, &rec.outcome.stderr.spill_path].into_iter().flatten().cloned().collect()
}

fn output_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Output { path: path.to_path_buf(), source }
}

/// Removes a file, a missing one included.
fn remove_if_present(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(output_err(path)(e)),
        _ => Ok(()),
    }
}

/// Writes `bytes` to `<path>.tmp` (0600), to be renamed into place.
fn write_tmp(path: &Path, bytes: &[u8]) -> Result<PathBuf, StoreError> {
    let tmp = path.with_extension(format!("{}.tmp", path.extension().and_then(|e| e.to_str()).unwrap_or_default()));
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(output_err(&tmp))?;
    f.write_all(bytes).map_err(output_err(&tmp))?;
    Ok(tmp)
}

/// A body from its file: None when the file is gone (trimmed meanwhile, or lost to a crash).
fn read_body(path: &Path, len: i64) -> Result<Option<Vec<u8>>, StoreError> {
    if len == 0 {
        return Ok(Some(Vec::new()));
    }
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(output_err(path)(e)),
    }
}

/// A row of `execs` as queries read it: metadata, body lengths and whether they were discarded.
struct ExecRow {
    seq: i64,
    exec_id: String,
    data: String,
    stdout_len: i64,
    stderr_len: i64,
    discarded: bool,
}

/// The columns [`ExecRow::from_row`] reads, in order.
const EXEC_COLUMNS: &str = "seq, exec_id, data, stdout_len, stderr_len, discarded";

impl ExecRow {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ExecRow> {
        Ok(ExecRow { seq: r.get(0)?, exec_id: r.get(1)?, data: r.get(2)?, stdout_len: r.get(3)?, stderr_len: r.get(4)?, discarded: r.get(5)? })
    }

    fn body_bytes(&self) -> u64 {
        u64::try_from(self.stdout_len.saturating_add(self.stderr_len)).unwrap_or(0)
    }

    /// The record's metadata. A discarded record's spill files were removed with its output, so
    /// it no longer points at them.
    fn decode(&self) -> Result<ExecRecord, StoreError> {
        let mut rec: ExecRecord = decode(&self.exec_id, &self.data)?;
        if self.discarded {
            rec.output_discarded = true;
            rec.outcome.stdout.spill_path = None;
            rec.outcome.stderr.spill_path = None;
        }
        Ok(rec)
    }
}

impl Store {
    /// Opens (creating) the database at `path`; exec output bodies go to `outputs/` beside it.
    /// A version-1 database is migrated (see the module doc).
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let open_err = |source| StoreError::Open { path: path.to_path_buf(), source };
        let conn = Connection::open(path).map_err(open_err)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(open_err)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(open_err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(open_err)?;
        let found: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(open_err)?;
        if found > SCHEMA_VERSION {
            return Err(StoreError::TooNew { path: path.to_path_buf(), found });
        }
        let outputs = path.parent().unwrap_or(Path::new(".")).join(OUTPUTS_DIR);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&outputs).map_err(output_err(&outputs))?;
        // The mode above applies only when the directory is created.
        std::fs::set_permissions(&outputs, std::fs::Permissions::from_mode(0o700)).map_err(output_err(&outputs))?;
        let max_record_argv = std::sync::atomic::AtomicUsize::new(crate::config::ExecConfig::default().max_record_argv_bytes);
        let store = Store { conn: Mutex::new(conn), held: Mutex::new(HashMap::new()), outputs, max_record_argv };
        if found == 1 {
            store.migrate_from_v1(path)?;
        }
        let conn = store.conn()?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, data TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS snapshots (id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, data TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS snapshots_by_sandbox ON snapshots(sandbox_id);
             CREATE TABLE IF NOT EXISTS execs (
                 seq INTEGER PRIMARY KEY AUTOINCREMENT,
                 exec_id TEXT NOT NULL UNIQUE,
                 sandbox_id TEXT NOT NULL,
                 idem_key TEXT NOT NULL,
                 status TEXT NOT NULL,
                 data TEXT NOT NULL,
                 stdout_len INTEGER NOT NULL DEFAULT 0,
                 stderr_len INTEGER NOT NULL DEFAULT 0,
                 discarded INTEGER NOT NULL DEFAULT 0);
             CREATE INDEX IF NOT EXISTS execs_by_sandbox ON execs(sandbox_id, seq);
             CREATE INDEX IF NOT EXISTS execs_by_key ON execs(sandbox_id, idem_key);",
        )
        .map_err(open_err)?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(open_err)?;
        drop(conn);
        Ok(store)
    }

    /// Version 1 → 2: every output body moves from its BLOB column into its file (one row at a
    /// time, so memory stays at one record), then the columns go in one transaction and the
    /// file is compacted. Interrupted before the commit, the next start does it again (the file
    /// writes are idempotent); after it, there is nothing left to do.
    fn migrate_from_v1(&self, path: &Path) -> Result<(), StoreError> {
        let open_err = |source| StoreError::Open { path: path.to_path_buf(), source };
        let (mut moved, mut bytes, mut seq) = (0u64, 0u64, 0i64);
        loop {
            type Blobs = (i64, String, String, Vec<u8>, Vec<u8>);
            let row: Option<Blobs> = self
                .conn()?
                .query_row(
                    "SELECT seq, exec_id, sandbox_id, stdout, stderr FROM execs
                     WHERE seq > ?1 AND length(stdout) + length(stderr) > 0 ORDER BY seq LIMIT 1",
                    params![seq],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
                )
                .optional()
                .map_err(open_err)?;
            let Some((next, exec_id, sandbox_id, stdout, stderr)) = row else { break };
            seq = next;
            let (out, err) = match self.body_paths(&sandbox_id, &exec_id) {
                Ok(paths) => paths,
                Err(e) => {
                    // Its length columns still say there was output, so it reads as discarded.
                    tracing::warn!(exec = %exec_id, error = %e, "exec output of a malformed record dropped in the migration");
                    continue;
                }
            };
            self.create_sandbox_dir(&sandbox_id)?;
            for (file, body) in [(&out, &stdout), (&err, &stderr)] {
                if !body.is_empty() {
                    let tmp = write_tmp(file, body)?;
                    std::fs::rename(&tmp, file).map_err(output_err(file))?;
                }
            }
            moved += 1;
            bytes += (stdout.len() + stderr.len()) as u64;
        }
        {
            let mut conn = self.conn()?;
            let tx = conn.transaction().map_err(open_err)?;
            tx.execute_batch(
                "ALTER TABLE execs ADD COLUMN stdout_len INTEGER NOT NULL DEFAULT 0;
                 ALTER TABLE execs ADD COLUMN stderr_len INTEGER NOT NULL DEFAULT 0;
                 ALTER TABLE execs ADD COLUMN discarded INTEGER NOT NULL DEFAULT 0;
                 UPDATE execs SET stdout_len = length(stdout), stderr_len = length(stderr);
                 ALTER TABLE execs DROP COLUMN stdout;
                 ALTER TABLE execs DROP COLUMN stderr;
                 PRAGMA user_version = 2;",
            )
            .map_err(open_err)?;
            tx.commit().map_err(open_err)?;
            // Gives the pages the bodies held back to the host.
            conn.execute_batch("VACUUM").map_err(open_err)?;
        }
        tracing::info!(records = moved, bytes, outputs = %self.outputs.display(), "state database migrated to schema 2: exec output moved to files");
        Ok(())
    }

    fn conn(&self) -> Result<std::sync::MutexGuard<'_, Connection>, StoreError> {
        self.conn.lock().map_err(|_| StoreError::Poisoned)
    }

    /// The [`Held`] table; take it only while holding the database lock.
    fn held(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Held>>, StoreError> {
        self.held.lock().map_err(|_| StoreError::Poisoned)
    }

    /// The directory of a sandbox's output bodies. Ids read back from the database are checked
    /// again before they become path components.
    fn sandbox_dir(&self, sandbox_id: &str) -> Result<PathBuf, StoreError> {
        let sid = SandboxId::parse(sandbox_id).map_err(|e| StoreError::Corrupt { id: sandbox_id.to_string(), message: e.to_string() })?;
        Ok(self.outputs.join(sid.as_str()))
    }

    /// Where an exec's stdout and stderr bodies live.
    fn body_paths(&self, sandbox_id: &str, exec_id: &str) -> Result<(PathBuf, PathBuf), StoreError> {
        let eid = ExecId::parse(exec_id).map_err(|e| StoreError::Corrupt { id: exec_id.to_string(), message: e.to_string() })?;
        let dir = self.sandbox_dir(sandbox_id)?;
        Ok((dir.join(format!("{eid}.out")), dir.join(format!("{eid}.err"))))
    }

    fn create_sandbox_dir(&self, sandbox_id: &str) -> Result<(), StoreError> {
        let dir = self.sandbox_dir(sandbox_id)?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(output_err(&dir))
    }

    /// Inserts or replaces a sandbox.
    pub fn put_sandbox(&self, info: &SandboxInfo) -> Result<(), StoreError> {
        let id = info.id.to_string();
        let data = encode(&id, info)?;
        self.conn()?.execute("INSERT INTO sandboxes (id, data) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET data = excluded.data", params![id, data])?;
        Ok(())
    }

    /// Forgets a sandbox, its exec records and their output files (its snapshots stay: forks
    /// may use them). Output files that cannot be removed are logged and left for
    /// [`Store::prune_orphans`] at the next start: the sandbox is gone either way.
    pub fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        {
            let mut conn = self.conn()?;
            let tx = conn.transaction()?;
            tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
            tx.execute("DELETE FROM execs WHERE sandbox_id = ?1", params![id])?;
            tx.commit()?;
            self.held()?.remove(id);
        }
        if let Ok(dir) = self.sandbox_dir(id) {
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(sandbox = id, dir = %dir.display(), error = %e, "cannot remove the exec output directory");
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Every sandbox on record.
    pub fn sandboxes(&self) -> Result<Vec<SandboxInfo>, StoreError> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare("SELECT id, data FROM sandboxes")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        rows.map(|row| {
            let (id, data) = row?;
            decode(&id, &data)
        })
        .collect()
    }

    /// Inserts or replaces a snapshot record.
    pub fn put_snapshot(&self, snap: &SnapshotRecord) -> Result<(), StoreError> {
        let id = snap.snapshot_id.to_string();
        let data = encode(&id, snap)?;
        self.conn()?.execute(
            "INSERT INTO snapshots (id, sandbox_id, data) VALUES (?1, ?2, ?3) ON CONFLICT(id) DO UPDATE SET data = excluded.data",
            params![id, snap.sandbox_id.to_string(), data],
        )?;
        Ok(())
    }

    /// Forgets a snapshot.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), StoreError> {
        self.conn()?.execute("DELETE FROM snapshots WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// One snapshot.
    pub fn snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        let data: Option<String> = self.conn()?.query_row("SELECT data FROM snapshots WHERE id = ?1", params![id], |r| r.get(0)).optional()?;
        data.map(|d| decode(id, &d)).transpose()
    }

    /// Snapshots taken of a sandbox (or, with None, all), oldest first.
    pub fn snapshots(&self, sandbox_id: Option<&str>) -> Result<Vec<SnapshotRecord>, StoreError> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare("SELECT id, data FROM snapshots WHERE (?1 IS NULL OR sandbox_id = ?1)")?;
        let rows = stmt.query_map(params![sandbox_id], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = rows
            .map(|row| {
                let (id, data) = row?;
                decode::<SnapshotRecord>(&id, &data)
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.sort_by_key(|s| s.created_at);
        Ok(out)
    }

    /// Sets how many bytes of argv each exec record stored from now on keeps (the rest is cut
    /// and the record marked `argv_truncated`).
    pub fn set_max_record_argv_bytes(&self, max: usize) {
        self.max_record_argv.store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// Inserts or updates an exec record, bodies included: they replace the record's output
    /// files (its position in ListExecs is fixed by the first insert).
    ///
    /// The bodies are written to temporary files before the database lock is taken (they can be
    /// tens of MiB) and renamed into place under it, so a concurrent [`Store::delete_sandbox`]
    /// either sees the files (and removes them) or makes the rename fail.
    pub fn put_exec(&self, rec: &ExecRecord) -> Result<(), StoreError> {
        let id = rec.exec_id.to_string();
        let sandbox_id = rec.sandbox_id.to_string();
        let data = encode(&id, &without_bodies(rec, self.max_record_argv.load(std::sync::atomic::Ordering::Relaxed)))?;
        let (out, err) = self.body_paths(&sandbox_id, &id)?;
        let bodies = [(&out, &rec.outcome.stdout.bytes), (&err, &rec.outcome.stderr.bytes)];
        if bodies.iter().any(|(_, b)| !b.is_empty()) {
            self.create_sandbox_dir(&sandbox_id)?;
        }
        let mut staged = Vec::new();
        for (file, body) in bodies {
            if !body.is_empty() {
                match write_tmp(file, body) {
                    Ok(tmp) => staged.push((tmp, file)),
                    Err(e) => {
                        for (tmp, _) in &staged {
                            let _ = std::fs::remove_file(tmp);
                        }
                        return Err(e);
                    }
                }
            }
        }
        let conn = self.conn()?;
        // What the row held before (an update replaces its bodies and un-discards it).
        // Both statements run for every exec: cached, so SQLite parses them once per connection.
        let before: Option<(i64, bool)> = conn
            .prepare_cached("SELECT stdout_len + stderr_len, discarded FROM execs WHERE exec_id = ?1")?
            .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        for (tmp, file) in &staged {
            std::fs::rename(tmp, file).map_err(output_err(file))?;
        }
        for (file, body) in bodies {
            if body.is_empty() {
                remove_if_present(file)?;
            }
        }
        conn.prepare_cached(
            "INSERT INTO execs (exec_id, sandbox_id, idem_key, status, data, stdout_len, stderr_len, discarded) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 0)
             ON CONFLICT(exec_id) DO UPDATE SET status = excluded.status, data = excluded.data,
                 stdout_len = excluded.stdout_len, stderr_len = excluded.stderr_len, discarded = 0",
        )?
        .execute(params![
            id,
            sandbox_id,
            rec.idempotency_key,
            rec.outcome.status.name(),
            data,
            rec.outcome.stdout.bytes.len() as i64,
            rec.outcome.stderr.bytes.len() as i64
        ])?;
        if let Some(held) = self.held()?.get_mut(&sandbox_id) {
            let old = match before {
                Some((bytes, false)) => u64::try_from(bytes).unwrap_or(0),
                _ => 0,
            };
            held.records += u64::from(before.is_none());
            held.bytes = held.bytes.saturating_sub(old) + (rec.outcome.stdout.bytes.len() + rec.outcome.stderr.bytes.len()) as u64;
        }
        Ok(())
    }

    /// A record with its bodies read from their files. A body whose file is gone (trimmed since
    /// the row was read, or lost to a crash) makes the record read as output discarded.
    fn with_bodies(&self, row: &ExecRow, mut rec: ExecRecord) -> Result<ExecRecord, StoreError> {
        if rec.output_discarded {
            return Ok(rec);
        }
        let (out, err) = self.body_paths(rec.sandbox_id.as_str(), &row.exec_id)?;
        match (read_body(&out, row.stdout_len)?, read_body(&err, row.stderr_len)?) {
            (Some(stdout), Some(stderr)) => {
                rec.outcome.stdout.bytes = stdout;
                rec.outcome.stderr.bytes = stderr;
            }
            _ => {
                tracing::debug!(exec = %row.exec_id, "exec output file missing; reported as discarded");
                rec.output_discarded = true;
            }
        }
        Ok(rec)
    }

    fn exec_where(&self, clause: &str, args: impl rusqlite::Params) -> Result<Option<ExecRecord>, StoreError> {
        let sql = format!("SELECT {EXEC_COLUMNS} FROM execs WHERE {clause}");
        let row = self.conn()?.query_row(&sql, args, ExecRow::from_row).optional()?;
        // The files are read after the lock is released.
        row.map(|row| self.with_bodies(&row, row.decode()?)).transpose()
    }

    /// One exec record, output included.
    pub fn exec(&self, exec_id: &str) -> Result<Option<ExecRecord>, StoreError> {
        self.exec_where("exec_id = ?1", params![exec_id])
    }

    /// One exec record without its output (bodies empty), for callers that need only its state.
    pub fn exec_meta(&self, exec_id: &str) -> Result<Option<ExecRecord>, StoreError> {
        let sql = format!("SELECT {EXEC_COLUMNS} FROM execs WHERE exec_id = ?1");
        let row = self.conn()?.query_row(&sql, params![exec_id], ExecRow::from_row).optional()?;
        row.map(|row| row.decode()).transpose()
    }

    /// The exec that used `key` in a sandbox, if any, output included.
    pub fn exec_by_key(&self, sandbox_id: &str, key: &str) -> Result<Option<ExecRecord>, StoreError> {
        self.exec_where("sandbox_id = ?1 AND idem_key = ?2 ORDER BY seq LIMIT 1", params![sandbox_id, key])
    }

    /// One page of a sandbox's exec records, oldest first (see [`PageQuery`]). Reads at most
    /// `page_size + 1` rows from the index and only the bodies of the records it returns.
    pub fn exec_page(&self, sandbox_id: &str, q: &PageQuery) -> Result<ExecPage, StoreError> {
        let page_size = q.page_size.max(1);
        let (rows, range) = {
            let conn = self.conn()?;
            let range = match q.token {
                Some(t) => t,
                None => {
                    let last: Option<i64> = conn.query_row("SELECT MAX(seq) FROM execs WHERE sandbox_id = ?1", params![sandbox_id], |r| r.get(0))?;
                    let Some(last) = last else { return Ok(ExecPage::default()) };
                    // The record just older than the newest `limit` bounds the listing from below.
                    let after: Option<i64> = if q.limit == 0 {
                        None
                    } else {
                        conn.query_row(
                            "SELECT seq FROM execs WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2",
                            params![sandbox_id, i64::from(q.limit)],
                            |r| r.get(0),
                        )
                        .optional()?
                    };
                    PageToken { after: after.unwrap_or(0), last }
                }
            };
            let mut stmt = conn.prepare(&format!("SELECT {EXEC_COLUMNS} FROM execs WHERE sandbox_id = ?1 AND seq > ?2 AND seq <= ?3 ORDER BY seq LIMIT ?4"))?;
            let rows = stmt.query_map(params![sandbox_id, range.after, range.last, page_size as i64 + 1], ExecRow::from_row)?.collect::<Result<Vec<_>, _>>()?;
            (rows, range)
        };
        let mut page = ExecPage::default();
        let mut bytes = 0u64;
        for row in &rows {
            let cost = row.data.len() as u64 + if q.include_output && !row.discarded { row.body_bytes() } else { 0 };
            if page.records.len() == page_size || (!page.records.is_empty() && bytes + cost > q.max_bytes) {
                let after = page.records.len().checked_sub(1).map(|i| rows[i].seq).unwrap_or(range.after);
                page.next = Some(PageToken { after, last: range.last });
                break;
            }
            bytes += cost;
            let rec = row.decode()?;
            page.records.push(if q.include_output { self.with_bodies(row, rec)? } else { rec });
        }
        Ok(page)
    }

    /// Applies a sandbox's [`Retention`] after a record was added: first the oldest finished
    /// records beyond `max_records` are deleted, then, while the bodies still on disk exceed
    /// `max_output_bytes`, the oldest finished records lose theirs (marked `discarded`; the
    /// newest record too if it alone is over the budget). Running records are never touched.
    /// Returns what was trimmed, for the caller to remove the spill files inside the sandbox.
    pub fn trim_execs(&self, sandbox_id: &str, retention: Retention) -> Result<Vec<Trimmed>, StoreError> {
        let mut trimmed = Vec::new();
        // Output files of trimmed records, removed once the database no longer names them.
        let mut files = Vec::new();
        {
            let mut conn = self.conn()?;
            let tx = conn.transaction()?;
            let mut table = self.held()?;
            let mut held = match table.get(sandbox_id) {
                Some(held) => *held,
                None => {
                    let (records, bytes): (i64, i64) = tx.query_row(
                        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN discarded = 0 THEN stdout_len + stderr_len ELSE 0 END), 0) FROM execs WHERE sandbox_id = ?1",
                        params![sandbox_id],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )?;
                    Held { records: u64::try_from(records).unwrap_or(0), bytes: u64::try_from(bytes).unwrap_or(0) }
                }
            };
            let max_records = retention.max_records as u64;
            if held.records > max_records {
                // The newest record beyond `max_records`, found from the oldest end: as many
                // records are older than it as the sandbox holds beyond `max_records + 1`.
                let cutoff: Option<i64> = tx
                    .query_row(
                        "SELECT seq FROM execs WHERE sandbox_id = ?1 ORDER BY seq LIMIT 1 OFFSET ?2",
                        params![sandbox_id, i64::try_from(held.records - max_records - 1).unwrap_or(i64::MAX)],
                        |r| r.get(0),
                    )
                    .optional()?;
                if let Some(cutoff) = cutoff {
                    let doomed: Vec<ExecRow> = tx
                        .prepare(&format!("SELECT {EXEC_COLUMNS} FROM execs WHERE sandbox_id = ?1 AND seq <= ?2 AND status <> 'running' ORDER BY seq"))?
                        .query_map(params![sandbox_id, cutoff], ExecRow::from_row)?
                        .collect::<Result<_, _>>()?;
                    for row in &doomed {
                        tx.execute("DELETE FROM execs WHERE seq = ?1", params![row.seq])?;
                        held.records = held.records.saturating_sub(1);
                        if !row.discarded {
                            held.bytes = held.bytes.saturating_sub(row.body_bytes());
                        }
                        trimmed.push(self.trimmed(sandbox_id, row, &mut files)?);
                    }
                }
            }
            let mut stored = held.bytes;
            if stored > retention.max_output_bytes {
                let candidates = {
                    let mut stmt = tx.prepare(&format!(
                        "SELECT {EXEC_COLUMNS} FROM execs
                         WHERE sandbox_id = ?1 AND discarded = 0 AND status <> 'running' AND stdout_len + stderr_len > 0 ORDER BY seq"
                    ))?;
                    // Lazily: usually one or two rows are enough.
                    let mut rows = stmt.query(params![sandbox_id])?;
                    let mut out = Vec::new();
                    while stored > retention.max_output_bytes {
                        let Some(r) = rows.next()? else { break };
                        let row = ExecRow::from_row(r)?;
                        stored = stored.saturating_sub(row.body_bytes());
                        out.push(row);
                    }
                    out
                };
                for row in &candidates {
                    tx.execute("UPDATE execs SET discarded = 1 WHERE seq = ?1", params![row.seq])?;
                    trimmed.push(self.trimmed(sandbox_id, row, &mut files)?);
                }
            }
            held.bytes = stored;
            tx.commit()?;
            table.insert(sandbox_id.to_string(), held);
        }
        for file in files {
            if let Err(e) = remove_if_present(&file) {
                tracing::warn!(sandbox = sandbox_id, error = %e, "cannot remove a trimmed exec output file");
            }
        }
        Ok(trimmed)
    }

    /// What trimming `row` leaves to clean up: its output files (queued in `files`) and, unless
    /// an earlier trim already discarded them, its spill files.
    fn trimmed(&self, sandbox_id: &str, row: &ExecRow, files: &mut Vec<PathBuf>) -> Result<Trimmed, StoreError> {
        let rec = row.decode()?;
        if !row.discarded {
            let (out, err) = self.body_paths(sandbox_id, &row.exec_id)?;
            files.extend([out, err]);
        }
        Ok(Trimmed { exec_id: row.exec_id.clone(), spill_paths: if row.discarded { Vec::new() } else { spill_paths(&rec) } })
    }

    /// Records every exec still marked running as LOST (the daemon that ran them is gone).
    /// Returns how many there were.
    pub fn mark_running_lost(&self, reason: &str) -> Result<usize, StoreError> {
        let running: Vec<ExecRow> = {
            let conn = self.conn()?;
            let mut stmt = conn.prepare(&format!("SELECT {EXEC_COLUMNS} FROM execs WHERE status = 'running'"))?;
            let rows = stmt.query_map([], ExecRow::from_row)?;
            rows.collect::<Result<_, _>>()?
        };
        let n = running.len();
        for row in running {
            // A running record has no output yet: its bodies come with its end.
            let mut rec = row.decode()?;
            rec.outcome.status = ExecStatus::Lost;
            rec.outcome.exit_code = -1;
            rec.outcome.error = reason.to_string();
            self.put_exec(&rec)?;
        }
        Ok(n)
    }

    /// Cleans up after a crash: exec records of sandboxes no longer on record (an exec that
    /// ended while its sandbox was being destroyed), output directories and files no record
    /// names, and `.tmp` files of interrupted writes. Problems are logged, never fatal.
    /// Returns how many rows and files went.
    pub fn prune_orphans(&self) -> Result<usize, StoreError> {
        let mut pruned = {
            let conn = self.conn()?;
            let pruned = conn.execute("DELETE FROM execs WHERE sandbox_id NOT IN (SELECT id FROM sandboxes)", [])?;
            self.held()?.clear();
            pruned
        };
        let dirs = match std::fs::read_dir(&self.outputs) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(dir = %self.outputs.display(), error = %e, "cannot list exec output directories");
                return Ok(pruned);
            }
        };
        for dir in dirs.flatten() {
            let path = dir.path();
            let name = dir.file_name().to_string_lossy().into_owned();
            let known: std::collections::HashSet<String> = {
                let conn = self.conn()?;
                let mut stmt = conn.prepare("SELECT exec_id FROM execs WHERE sandbox_id = ?1 AND discarded = 0")?;
                let rows = stmt.query_map(params![name], |r| r.get::<_, String>(0))?;
                rows.collect::<Result<_, _>>()?
            };
            let gone = if known.is_empty() {
                std::fs::remove_dir_all(&path).map(|()| 1)
            } else {
                std::fs::read_dir(&path).map(|files| {
                    let mut n = 0;
                    for f in files.flatten() {
                        let file = f.file_name().to_string_lossy().into_owned();
                        let keep = match file.rsplit_once('.') {
                            Some((stem, "out" | "err")) => known.contains(stem),
                            _ => false,
                        };
                        if !keep && std::fs::remove_file(f.path()).is_ok() {
                            n += 1;
                        }
                    }
                    n
                })
            };
            match gone {
                Ok(n) => pruned += n,
                Err(e) => tracing::warn!(dir = %path.display(), error = %e, "cannot prune exec output files"),
            }
        }
        Ok(pruned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ExecId, SandboxId};
    use std::time::SystemTime;

    fn record(sandbox: &SandboxId, key: &str, status: ExecStatus) -> ExecRecord {
        let mut outcome = ExecOutcome::failed(status, 0, String::new(), SystemTime::now());
        if status != ExecStatus::Running {
            outcome.stdout = CapturedOutput { bytes: b"hi\n".to_vec(), truncated: false, total_bytes: 3, spill_path: None };
        }
        ExecRecord {
            exec_id: ExecId::generate(),
            sandbox_id: sandbox.clone(),
            argv: vec!["echo".into(), "hi".into()],
            argv_truncated: false,
            idempotency_key: key.into(),
            outcome,
            output_discarded: false,
            trace: None,
        }
    }

    /// A finished record with `n` bytes of stdout and stderr each, truncated with spill files.
    fn big(sandbox: &SandboxId, n: usize) -> ExecRecord {
        let mut r = record(sandbox, "", ExecStatus::Exited);
        let spill = |s: &str| Some(format!("/tmp/.sandboxd/{}.{s}", r.exec_id));
        r.outcome.stdout = CapturedOutput { bytes: vec![b'o'; n], truncated: true, total_bytes: 2 * n as u64, spill_path: spill("stdout") };
        r.outcome.stderr = CapturedOutput { bytes: vec![b'e'; n], truncated: true, total_bytes: 2 * n as u64, spill_path: spill("stderr") };
        r
    }

    fn all(store: &Store, sb: &SandboxId, limit: u32) -> Vec<ExecRecord> {
        let q = PageQuery { limit, token: None, page_size: 10_000, include_output: true, max_bytes: u64::MAX };
        let page = store.exec_page(sb.as_str(), &q).expect("page");
        assert!(page.next.is_none(), "one page holds everything here");
        page.records
    }

    fn ids(records: &[ExecRecord]) -> Vec<ExecId> {
        records.iter().map(|r| r.exec_id.clone()).collect()
    }

    fn keep(max_records: usize, max_output_bytes: u64) -> Retention {
        Retention { max_records, max_output_bytes }
    }

    #[test]
    fn exec_records_round_trip_in_order_and_survive_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let sb = SandboxId::generate();
        let (mut a, b) = (record(&sb, "k1", ExecStatus::Exited), record(&sb, "", ExecStatus::Running));
        a.trace = Some(crate::model::TraceContext { trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(), span_id: "00f067aa0ba902b7".into() });
        {
            let store = Store::open(&path).expect("open");
            store.put_exec(&a).expect("put a");
            store.put_exec(&b).expect("put b");
        }
        let store = Store::open(&path).expect("reopen");
        let list = all(&store, &sb, 0);
        assert_eq!(ids(&list), vec![a.exec_id.clone(), b.exec_id.clone()]);
        assert_eq!(list[0].outcome.stdout.bytes, b"hi\n");
        assert_eq!(list[0].trace, a.trace, "the caller's trace is kept");
        assert_eq!(list[1].trace, None);
        let by_key = store.exec_by_key(sb.as_str(), "k1").expect("query").expect("found");
        assert_eq!(by_key.exec_id, a.exec_id);
        assert_eq!(by_key.outcome.stdout.bytes, b"hi\n", "a replay gets the output");
        assert_eq!(store.mark_running_lost("daemon restarted").expect("mark"), 1);
        let lost = store.exec(b.exec_id.as_str()).expect("query").expect("found");
        assert_eq!(lost.outcome.status, ExecStatus::Lost);
        assert_eq!(ids(&all(&store, &sb, 1)), vec![b.exec_id.clone()], "limit keeps the newest");
    }

    #[test]
    fn bodies_live_in_private_files_not_in_the_database() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let store = Store::open(&path).expect("open");
        let sb = SandboxId::generate();
        let r = big(&sb, 4 << 20);
        store.put_exec(&r).expect("put");
        let sdir = dir.path().join("outputs").join(sb.as_str());
        let out = sdir.join(format!("{}.out", r.exec_id));
        assert_eq!(std::fs::read(&out).expect("stdout file"), r.outcome.stdout.bytes);
        assert_eq!(std::fs::metadata(&out).expect("stat").permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&sdir).expect("stat").permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(dir.path().join("outputs")).expect("stat").permissions().mode() & 0o777, 0o700);
        let db_bytes: u64 = ["state.db", "state.db-wal"].iter().filter_map(|f| std::fs::metadata(dir.path().join(f)).ok()).map(|m| m.len()).sum();
        assert!(db_bytes < 1 << 20, "8 MiB of output made the database {db_bytes} bytes");
        let back = store.exec(r.exec_id.as_str()).expect("query").expect("found");
        assert_eq!(back.outcome.stdout.bytes, r.outcome.stdout.bytes);
        assert_eq!(back.outcome.stderr.bytes, r.outcome.stderr.bytes);
        assert!(!back.output_discarded);
        // No leftovers of the write-then-rename.
        let names: Vec<String> = std::fs::read_dir(&sdir).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn trimming_by_count_keeps_the_newest_and_running_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let sb = SandboxId::generate();
        let running = record(&sb, "", ExecStatus::Running);
        store.put_exec(&running).expect("put");
        let finished: Vec<ExecRecord> = (0..5).map(|_| big(&sb, 10)).collect();
        for r in &finished {
            store.put_exec(r).expect("put");
        }
        let trimmed = store.trim_execs(sb.as_str(), keep(2, u64::MAX)).expect("trim");
        assert_eq!(trimmed.iter().map(|t| t.exec_id.clone()).collect::<Vec<_>>(), finished[..3].iter().map(|r| r.exec_id.to_string()).collect::<Vec<_>>());
        assert_eq!(trimmed[0].spill_paths, spill_paths(&finished[0]), "its spill files are reported for removal");
        let left = all(&store, &sb, 0);
        assert_eq!(ids(&left), vec![running.exec_id.clone(), finished[3].exec_id.clone(), finished[4].exec_id.clone()]);
        assert!(store.exec(finished[0].exec_id.as_str()).expect("query").is_none());
        let files = std::fs::read_dir(dir.path().join("outputs").join(sb.as_str())).expect("ls").count();
        assert_eq!(files, 4, "the deleted records' output files went with them");
    }

    /// What the store keeps of a sandbox's records, against what the database says.
    fn held_is_exact(store: &Store, sb: &SandboxId, what: &str) {
        let conn = store.conn().expect("conn");
        let truth: (i64, i64) = conn
            .query_row(
                "SELECT COUNT(*), COALESCE(SUM(CASE WHEN discarded = 0 THEN stdout_len + stderr_len ELSE 0 END), 0) FROM execs WHERE sandbox_id = ?1",
                params![sb.as_str()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("count");
        let held = store.held().expect("held").get(sb.as_str()).copied();
        assert_eq!(held, Some(Held { records: truth.0 as u64, bytes: truth.1 as u64 }), "{what}");
    }

    /// Trimmed after every write, as the daemon does (from what the store keeps of each
    /// sandbox, not by counting its records each time): the bounds hold at each step, what is
    /// kept stays exact through records written twice (running, then ended), discards,
    /// deletions and a running record older than the rest, and a destroyed sandbox starts over.
    #[test]
    fn trimming_after_every_write_holds_the_bounds_at_each_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let sb = SandboxId::generate();
        for round in 0..2 {
            let old_running = record(&sb, "", ExecStatus::Running);
            store.put_exec(&old_running).expect("put");
            for i in 0..10 {
                let mut r = big(&sb, 20);
                r.outcome.status = ExecStatus::Running;
                store.put_exec(&r).expect("put, running");
                r.outcome.status = ExecStatus::Exited;
                store.put_exec(&r).expect("put, ended");
                store.trim_execs(sb.as_str(), keep(3, 100)).expect("trim");
                let what = format!("round {round}, step {i}");
                held_is_exact(&store, &sb, &what);
                let left = all(&store, &sb, 0);
                assert_eq!(left.len(), (i + 2).min(4), "{what}: the running record and the newest three");
                assert_eq!(left[0].exec_id, old_running.exec_id, "{what}: the running record stays");
                let kept: u64 = left.iter().filter(|r| !r.output_discarded).map(|r| (r.outcome.stdout.bytes.len() + r.outcome.stderr.bytes.len()) as u64).sum();
                assert!(kept <= 100, "{what}: {kept} bytes kept");
            }
            store.delete_sandbox(sb.as_str()).expect("delete");
            assert!(all(&store, &sb, 0).is_empty());
        }
    }

    #[test]
    fn the_output_budget_discards_the_oldest_bodies_first_and_keeps_the_metadata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let (sb, other) = (SandboxId::generate(), SandboxId::generate());
        let running = record(&sb, "", ExecStatus::Running);
        store.put_exec(&running).expect("put");
        let rs: Vec<ExecRecord> = (0..5).map(|_| big(&sb, 50)).collect(); // 100 bytes each
        let mut trimmed = Vec::new();
        for r in &rs {
            store.put_exec(r).expect("put");
            trimmed.extend(store.trim_execs(sb.as_str(), keep(1000, 250)).expect("trim"));
        }
        // The other sandbox's output counts against its own budget only.
        store.put_exec(&big(&other, 50)).expect("put");
        assert!(store.trim_execs(other.as_str(), keep(1000, 250)).expect("trim").is_empty());

        let gone: Vec<String> = rs[..3].iter().map(|r| r.exec_id.to_string()).collect();
        assert_eq!(trimmed.iter().map(|t| t.exec_id.clone()).collect::<Vec<_>>(), gone, "oldest first, each once");
        assert_eq!(trimmed[0].spill_paths.len(), 2);
        for r in &rs[..3] {
            let back = store.exec(r.exec_id.as_str()).expect("query").expect("metadata stays");
            assert!(back.output_discarded);
            assert!(back.outcome.stdout.bytes.is_empty() && back.outcome.stderr.bytes.is_empty());
            assert_eq!(back.outcome.stdout.total_bytes, 100, "what the process wrote is still said");
            assert_eq!(back.outcome.stdout.spill_path, None, "its spill file went too");
            assert!(!dir.path().join("outputs").join(sb.as_str()).join(format!("{}.out", r.exec_id)).exists());
        }
        for r in &rs[3..] {
            let back = store.exec(r.exec_id.as_str()).expect("query").expect("found");
            assert!(!back.output_discarded);
            assert_eq!(back.outcome.stdout.bytes.len(), 50);
        }
        // A record alone over the budget loses its output too; the running one is untouched.
        let huge = big(&sb, 1000);
        store.put_exec(&huge).expect("put");
        let t = store.trim_execs(sb.as_str(), keep(1000, 250)).expect("trim");
        assert_eq!(
            t.iter().map(|t| t.exec_id.clone()).collect::<Vec<_>>(),
            vec![rs[3].exec_id.to_string(), rs[4].exec_id.to_string(), huge.exec_id.to_string()]
        );
        assert!(store.exec(huge.exec_id.as_str()).expect("query").expect("found").output_discarded);
        assert_eq!(all(&store, &sb, 0).len(), 7, "no record was deleted, only bodies");
        assert!(store.trim_execs(sb.as_str(), keep(1000, 250)).expect("trim").is_empty(), "nothing is trimmed twice");
    }

    #[test]
    fn pages_return_every_record_once_in_order_within_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let (sb, other) = (SandboxId::generate(), SandboxId::generate());
        let mut recs = Vec::new();
        for i in 0..250 {
            let r = record(&sb, "", ExecStatus::Exited);
            store.put_exec(&r).expect("put");
            recs.push(r.exec_id);
            if i % 7 == 0 {
                store.put_exec(&record(&other, "", ExecStatus::Exited)).expect("interleaved");
            }
        }
        let list = |limit: u32, page_size: usize, include_output: bool, max_bytes: u64, grow: bool| {
            let mut seen = Vec::new();
            let mut token = None;
            let mut pages = 0;
            loop {
                let q = PageQuery { limit, token, page_size, include_output, max_bytes };
                let page = store.exec_page(sb.as_str(), &q).expect("page");
                assert!(page.records.len() <= page_size);
                assert!(!page.records.is_empty() || seen.is_empty(), "an empty page ends a listing, it never comes after a token");
                for r in &page.records {
                    assert_eq!(r.outcome.stdout.bytes.is_empty(), !include_output, "bodies only when asked for");
                }
                seen.extend(ids(&page.records));
                pages += 1;
                if grow {
                    // Records added while paging belong to the next listing.
                    store.put_exec(&record(&sb, "", ExecStatus::Exited)).expect("put");
                }
                match page.next {
                    Some(t) => token = Some(PageToken::parse(&t.encode()).expect("the token round-trips")),
                    None => break (seen, pages),
                }
            }
        };
        let (seen, pages) = list(0, 100, false, u64::MAX, false);
        assert_eq!((seen.as_slice(), pages), (recs.as_slice(), 3));
        let (seen, pages) = list(120, 100, true, u64::MAX, true);
        assert_eq!((seen.as_slice(), pages), (&recs[130..], 2), "limit: the newest 120, oldest first, across pages");
        // A byte bound smaller than one record still makes progress, one record a page.
        let (seen, pages) = list(5, 100, true, 1, false);
        let mut newest = all(&store, &sb, 5);
        newest.truncate(5);
        assert_eq!((seen, pages), (ids(&newest), 5));
        assert!(PageToken::parse("").is_none() && PageToken::parse("x.1").is_none() && PageToken::parse("5.2").is_none());
        let empty = store.exec_page(SandboxId::generate().as_str(), &PageQuery { limit: 0, token: None, page_size: 10, include_output: false, max_bytes: 1 });
        assert!(empty.expect("page").records.is_empty());
    }

    #[test]
    fn deleting_a_sandbox_removes_its_records_and_output_dir_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let (sb, other) = (SandboxId::generate(), SandboxId::generate());
        store.put_exec(&big(&sb, 100)).expect("put");
        store.put_exec(&big(&other, 100)).expect("put");
        store.delete_sandbox(sb.as_str()).expect("delete");
        assert!(!dir.path().join("outputs").join(sb.as_str()).exists());
        assert!(all(&store, &sb, 0).is_empty());
        assert!(dir.path().join("outputs").join(other.as_str()).exists());
        assert_eq!(all(&store, &other, 0).len(), 1);
    }

    #[test]
    fn orphans_are_pruned_at_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let (sb, gone) = (SandboxId::generate(), SandboxId::generate());
        // Only the id of a sandbox row matters here.
        store.conn().expect("conn").execute("INSERT INTO sandboxes (id, data) VALUES (?1, '{}')", params![sb.as_str()]).expect("put sandbox");
        let kept = big(&sb, 10);
        store.put_exec(&kept).expect("put");
        store.put_exec(&big(&gone, 10)).expect("put");
        let sdir = dir.path().join("outputs").join(sb.as_str());
        std::fs::write(sdir.join("ex-stray.out"), b"x").expect("stray");
        std::fs::write(sdir.join(format!("{}.out.tmp", kept.exec_id)), b"x").expect("tmp");
        assert_eq!(store.prune_orphans().expect("prune"), 1 + 1 + 2);
        assert!(!dir.path().join("outputs").join(gone.as_str()).exists());
        assert_eq!(std::fs::read_dir(&sdir).expect("ls").count(), 2);
        assert!(store.exec(kept.exec_id.as_str()).expect("query").is_some_and(|r| !r.output_discarded));
    }

    #[test]
    fn a_version_1_database_moves_its_output_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let sb = SandboxId::generate();
        let r = big(&sb, 64 << 10);
        {
            let conn = Connection::open(&path).expect("open");
            conn.execute_batch(
                "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, data TEXT NOT NULL);
                 CREATE TABLE snapshots (id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, data TEXT NOT NULL);
                 CREATE TABLE execs (seq INTEGER PRIMARY KEY AUTOINCREMENT, exec_id TEXT NOT NULL UNIQUE, sandbox_id TEXT NOT NULL,
                     idem_key TEXT NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL, stdout BLOB NOT NULL, stderr BLOB NOT NULL);
                 CREATE INDEX execs_by_sandbox ON execs(sandbox_id, seq);
                 CREATE INDEX execs_by_key ON execs(sandbox_id, idem_key);
                 PRAGMA user_version = 1;",
            )
            .expect("v1 schema");
            let data = encode("x", &without_bodies(&r, usize::MAX)).expect("encode");
            conn.execute(
                "INSERT INTO execs (exec_id, sandbox_id, idem_key, status, data, stdout, stderr) VALUES (?1, ?2, '', 'exited', ?3, ?4, ?5)",
                params![r.exec_id.as_str(), sb.as_str(), data, r.outcome.stdout.bytes, r.outcome.stderr.bytes],
            )
            .expect("v1 row");
        }
        let store = Store::open(&path).expect("migrate");
        let back = store.exec(r.exec_id.as_str()).expect("query").expect("found");
        assert_eq!(back.outcome.stdout.bytes, r.outcome.stdout.bytes, "the body moved, it was not dropped");
        assert_eq!(back.outcome.stderr.bytes, r.outcome.stderr.bytes);
        assert!(dir.path().join("outputs").join(sb.as_str()).join(format!("{}.err", r.exec_id)).exists());
        let conn = store.conn().expect("conn");
        let version: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0)).expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        assert!(conn.prepare("SELECT stdout FROM execs").is_err(), "the blob columns are gone");
        drop(conn);
        // The new record goes after the migrated one.
        let next = record(&sb, "", ExecStatus::Exited);
        store.put_exec(&next).expect("put");
        assert_eq!(ids(&all(&store, &sb, 0)), vec![r.exec_id.clone(), next.exec_id]);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        Connection::open(&path).expect("open").pragma_update(None, "user_version", 99).expect("set");
        assert!(matches!(Store::open(&path), Err(StoreError::TooNew { found: 99, .. })));
    }

    #[test]
    fn argv_is_capped_whole_arguments_first_at_a_char_boundary() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(cap_argv(&argv(&["echo", "hi"]), 6), (argv(&["echo", "hi"]), false), "exactly the cap is kept whole");
        assert_eq!(cap_argv(&argv(&["echo", "hello"]), 6), (argv(&["echo", "he"]), true));
        assert_eq!(cap_argv(&argv(&["echo", "x", "y"]), 4), (argv(&["echo"]), true), "no empty argument is kept");
        assert_eq!(cap_argv(&argv(&["é"]), 1), (Vec::<String>::new(), true), "never half a character");
        assert_eq!(cap_argv(&argv(&["aé"]), 2), (argv(&["a"]), true));
    }

    #[test]
    fn stored_records_keep_argv_within_the_cap_and_say_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        store.set_max_record_argv_bytes(1024);
        let sb = SandboxId::generate();
        let mut big = record(&sb, "", ExecStatus::Exited);
        big.argv = vec!["echo".into(), "x".repeat(200 << 10)];
        store.put_exec(&big).expect("put");
        let back = store.exec(big.exec_id.as_str()).expect("query").expect("found");
        assert!(back.argv_truncated, "the record says its argv was cut");
        assert_eq!(back.argv.iter().map(String::len).sum::<usize>(), 1024);
        assert_eq!(back.argv[0], "echo");
        let small = record(&sb, "", ExecStatus::Exited);
        store.put_exec(&small).expect("put");
        let back = store.exec(small.exec_id.as_str()).expect("query").expect("found");
        assert_eq!((back.argv, back.argv_truncated), (small.argv, false));
        // 200 records of 200 KiB of argv grow the database by a few hundred KiB, not 40 MiB.
        for _ in 0..200 {
            store.put_exec(&ExecRecord { exec_id: ExecId::generate(), ..big.clone() }).expect("put");
        }
        let conn = store.conn().expect("conn");
        let stored: i64 = conn.query_row("SELECT SUM(LENGTH(data)) FROM execs", [], |r| r.get(0)).expect("sum");
        assert!(stored < 201 * 2048, "{stored} bytes of records");
    }
}
