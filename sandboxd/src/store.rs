//! Durable state: sandboxes, snapshots and exec records in SQLite under `--state-dir`.
//!
//! SQLite (bundled, WAL, `synchronous=NORMAL`) because the records must survive a `kill -9` of
//! the daemon — idempotent execs are replayed from here after a restart — and because ListExecs
//! wants ordered range scans per sandbox. A commit in WAL mode is an append to the log, well under
//! a millisecond, so it sits on the exec path without hurting the round trip; `NORMAL` loses at
//! most the last commits on power loss, never on a process crash.
//!
//! Each record is a JSON document (the core types derive serde) plus the columns queries need;
//! exec output goes in BLOB columns rather than JSON arrays of numbers.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};

use crate::backend::ExecStatus;
use crate::manager::{ExecRecord, SandboxInfo, SnapshotRecord};

/// Version of the schema this build writes. A newer database is refused, not silently misread.
const SCHEMA_VERSION: i64 = 1;

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
    #[error("state database lock poisoned")]
    Poisoned,
}

/// The daemon's durable state.
pub struct Store {
    conn: Mutex<Connection>,
}

fn encode<T: serde::Serialize>(id: &str, value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt { id: id.to_string(), message: e.to_string() })
}

fn decode<T: serde::de::DeserializeOwned>(id: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt { id: id.to_string(), message: e.to_string() })
}

fn status_name(s: ExecStatus) -> &'static str {
    match s {
        ExecStatus::Exited => "exited",
        ExecStatus::Signaled => "signaled",
        ExecStatus::TimedOut => "timed_out",
        ExecStatus::OomKilled => "oom_killed",
        ExecStatus::SpawnFailed => "spawn_failed",
        ExecStatus::Running => "running",
        ExecStatus::Lost => "lost",
    }
}

impl Store {
    /// Opens (creating) the database at `path`.
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
                 stdout BLOB NOT NULL,
                 stderr BLOB NOT NULL);
             CREATE INDEX IF NOT EXISTS execs_by_sandbox ON execs(sandbox_id, seq);
             CREATE INDEX IF NOT EXISTS execs_by_key ON execs(sandbox_id, idem_key);",
        )
        .map_err(open_err)?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(open_err)?;
        Ok(Store { conn: Mutex::new(conn) })
    }

    fn conn(&self) -> Result<std::sync::MutexGuard<'_, Connection>, StoreError> {
        self.conn.lock().map_err(|_| StoreError::Poisoned)
    }

    /// Inserts or replaces a sandbox.
    pub fn put_sandbox(&self, info: &SandboxInfo) -> Result<(), StoreError> {
        let id = info.id.to_string();
        let data = encode(&id, info)?;
        self.conn()?.execute("INSERT INTO sandboxes (id, data) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET data = excluded.data", params![id, data])?;
        Ok(())
    }

    /// Forgets a sandbox and its exec records (its snapshots stay: forks may use them).
    pub fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        let conn = self.conn()?;
        conn.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        conn.execute("DELETE FROM execs WHERE sandbox_id = ?1", params![id])?;
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

    /// Inserts or updates an exec record (its position in ListExecs is fixed by the first insert).
    pub fn put_exec(&self, rec: &ExecRecord) -> Result<(), StoreError> {
        let id = rec.exec_id.to_string();
        let mut meta = rec.clone();
        let stdout = std::mem::take(&mut meta.outcome.stdout.bytes);
        let stderr = std::mem::take(&mut meta.outcome.stderr.bytes);
        let data = encode(&id, &meta)?;
        self.conn()?.execute(
            "INSERT INTO execs (exec_id, sandbox_id, idem_key, status, data, stdout, stderr) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT(exec_id) DO UPDATE SET status = excluded.status, data = excluded.data, stdout = excluded.stdout, stderr = excluded.stderr",
            params![id, rec.sandbox_id.to_string(), rec.idempotency_key, status_name(rec.outcome.status), data, stdout, stderr],
        )?;
        Ok(())
    }

    fn exec_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(String, String, Vec<u8>, Vec<u8>)> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    }

    fn decode_exec((id, data, stdout, stderr): (String, String, Vec<u8>, Vec<u8>)) -> Result<ExecRecord, StoreError> {
        let mut rec: ExecRecord = decode(&id, &data)?;
        rec.outcome.stdout.bytes = stdout;
        rec.outcome.stderr.bytes = stderr;
        Ok(rec)
    }

    /// One exec record.
    pub fn exec(&self, exec_id: &str) -> Result<Option<ExecRecord>, StoreError> {
        let row = self
            .conn()?
            .query_row("SELECT exec_id, data, stdout, stderr FROM execs WHERE exec_id = ?1", params![exec_id], Self::exec_from_row)
            .optional()?;
        row.map(Self::decode_exec).transpose()
    }

    /// The exec that used `key` in a sandbox, if any.
    pub fn exec_by_key(&self, sandbox_id: &str, key: &str) -> Result<Option<ExecRecord>, StoreError> {
        let row = self
            .conn()?
            .query_row(
                "SELECT exec_id, data, stdout, stderr FROM execs WHERE sandbox_id = ?1 AND idem_key = ?2 ORDER BY seq LIMIT 1",
                params![sandbox_id, key],
                Self::exec_from_row,
            )
            .optional()?;
        row.map(Self::decode_exec).transpose()
    }

    /// A sandbox's exec records, oldest first; `limit` > 0 keeps the newest `limit`.
    pub fn execs(&self, sandbox_id: &str, limit: u32) -> Result<Vec<ExecRecord>, StoreError> {
        let conn = self.conn()?;
        let limit: i64 = if limit == 0 { -1 } else { i64::from(limit) };
        let mut stmt = conn.prepare(
            "SELECT exec_id, data, stdout, stderr FROM
               (SELECT seq, exec_id, data, stdout, stderr FROM execs WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT ?2)
             ORDER BY seq ASC",
        )?;
        let rows = stmt.query_map(params![sandbox_id, limit], Self::exec_from_row)?;
        rows.map(|r| Self::decode_exec(r?)).collect()
    }

    /// Drops the oldest finished records of a sandbox beyond `keep`.
    pub fn trim_execs(&self, sandbox_id: &str, keep: usize) -> Result<(), StoreError> {
        self.conn()?.execute(
            "DELETE FROM execs WHERE sandbox_id = ?1 AND status <> 'running' AND seq NOT IN
               (SELECT seq FROM execs WHERE sandbox_id = ?1 ORDER BY seq DESC LIMIT ?2)",
            params![sandbox_id, keep as i64],
        )?;
        Ok(())
    }

    /// Records every exec still marked running as LOST (the daemon that ran them is gone).
    /// Returns how many there were.
    pub fn mark_running_lost(&self, reason: &str) -> Result<usize, StoreError> {
        let running: Vec<(String, String, Vec<u8>, Vec<u8>)> = {
            let conn = self.conn()?;
            let mut stmt = conn.prepare("SELECT exec_id, data, stdout, stderr FROM execs WHERE status = 'running'")?;
            let rows = stmt.query_map([], Self::exec_from_row)?;
            rows.collect::<Result<_, _>>()?
        };
        let n = running.len();
        for row in running {
            let mut rec = Self::decode_exec(row)?;
            rec.outcome.status = ExecStatus::Lost;
            rec.outcome.exit_code = -1;
            rec.outcome.error = reason.to_string();
            self.put_exec(&rec)?;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CapturedOutput, ExecOutcome};
    use crate::ids::{ExecId, SandboxId};
    use std::time::SystemTime;

    fn record(sandbox: &SandboxId, key: &str, status: ExecStatus) -> ExecRecord {
        let mut outcome = ExecOutcome::failed(status, 0, String::new(), SystemTime::now());
        outcome.stdout = CapturedOutput { bytes: b"hi\n".to_vec(), truncated: false, total_bytes: 3, spill_path: None };
        ExecRecord { exec_id: ExecId::generate(), sandbox_id: sandbox.clone(), argv: vec!["echo".into(), "hi".into()], idempotency_key: key.into(), outcome }
    }

    #[test]
    fn exec_records_round_trip_in_order_and_survive_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let sb = SandboxId::generate();
        let (a, b) = (record(&sb, "k1", ExecStatus::Exited), record(&sb, "", ExecStatus::Running));
        {
            let store = Store::open(&path).expect("open");
            store.put_exec(&a).expect("put a");
            store.put_exec(&b).expect("put b");
        }
        let store = Store::open(&path).expect("reopen");
        let list = store.execs(sb.as_str(), 0).expect("list");
        assert_eq!(list.iter().map(|r| r.exec_id.clone()).collect::<Vec<_>>(), vec![a.exec_id.clone(), b.exec_id.clone()]);
        assert_eq!(list[0].outcome.stdout.bytes, b"hi\n");
        let by_key = store.exec_by_key(sb.as_str(), "k1").expect("query").expect("found");
        assert_eq!(by_key.exec_id, a.exec_id);
        assert_eq!(store.mark_running_lost("daemon restarted").expect("mark"), 1);
        let lost = store.exec(b.exec_id.as_str()).expect("query").expect("found");
        assert_eq!(lost.outcome.status, ExecStatus::Lost);
        assert_eq!(store.execs(sb.as_str(), 1).expect("list")[0].exec_id, b.exec_id, "limit keeps the newest");
    }

    #[test]
    fn trimming_keeps_the_newest_and_running_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let sb = SandboxId::generate();
        let running = record(&sb, "", ExecStatus::Running);
        store.put_exec(&running).expect("put");
        for _ in 0..5 {
            store.put_exec(&record(&sb, "", ExecStatus::Exited)).expect("put");
        }
        store.trim_execs(sb.as_str(), 2).expect("trim");
        let left = store.execs(sb.as_str(), 0).expect("list");
        assert_eq!(left.len(), 3);
        assert_eq!(left[0].exec_id, running.exec_id);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        Connection::open(&path).expect("open").pragma_update(None, "user_version", 99).expect("set");
        assert!(matches!(Store::open(&path), Err(StoreError::TooNew { found: 99, .. })));
    }
}
