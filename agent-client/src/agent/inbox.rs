//! Operator requests to a run: `sbx agent steer` and `sbx agent stop`.
//!
//! The request format, its bounds and the crash-safe writer and reader live in the
//! `agent-inbox` crate (re-exported here), which the operator's page of `sandboxd --web` uses
//! too. This module adds what needs the run's checkpoint: a request goes only to a run that
//! exists and has not ended ([`send`]), and the checkpoint remembers what the run applied
//! ([`OperatorRecord`], [`StopRequest`]).
//!
//! The loop reads the inbox at step boundaries (before each model turn, and while it waits out
//! a retry), applies what it finds, records the request ids in the checkpoint, makes that
//! checkpoint durable, and only then removes the files. A crash before the checkpoint leaves
//! the files, applied on resume; a crash after it leaves files whose ids the checkpoint holds,
//! removed without being applied again. Each request takes effect exactly once.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use agent_inbox::{
    file_name, new_request_id, takes_requests, valid_request_id, Command, Inbox, Incoming, Request,
    StopAs, INBOX_DIR, MAX_FILE_BYTES, MAX_MESSAGE_BYTES, MAX_PENDING, MAX_REASON_BYTES,
};

use super::checkpoint::{
    validate_run_id, Checkpoint, CheckpointError, CheckpointStore, FileStore, RunLock,
};
use super::state::StopReason;

/// Operator requests a checkpoint remembers (newest kept). More than [`MAX_PENDING`]: the ids
/// of a batch must still be there when its files are removed after a crash.
pub const MAX_RECORDS: usize = 64;

/// What can go wrong sending a request.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// A bad run id, or a checkpoint that cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// No such run.
    #[error("unknown run {run_id}: no run of that id under {dir}")]
    UnknownRun {
        /// The run.
        run_id: String,
        /// The state directory looked in.
        dir: PathBuf,
    },
    /// The run has ended for good.
    #[error("run {run_id} is finished ({status}: {reason}); a {kind} cannot reach it")]
    Finished {
        /// The run.
        run_id: String,
        /// `done`, `failed` or `stopped`.
        status: &'static str,
        /// Why it ended.
        reason: StopReason,
        /// `steer` or `stop`.
        kind: &'static str,
    },
    /// Too many requests wait already.
    #[error("run {run_id} already has {pending} operator requests waiting (at most {MAX_PENDING}); the run takes them at its next step boundary")]
    Full {
        /// The run.
        run_id: String,
        /// Requests waiting.
        pending: usize,
    },
    /// A request the inbox refused (empty or too long), or its I/O failed.
    #[error(transparent)]
    Inbox(agent_inbox::Error),
}

impl InboxError {
    /// The writer's error about run `run_id`, as this module names it.
    fn of(run_id: &str, e: agent_inbox::Error) -> InboxError {
        match e {
            agent_inbox::Error::InvalidRunId(id) => {
                InboxError::Checkpoint(CheckpointError::InvalidRunId(id))
            }
            agent_inbox::Error::Full { pending } => InboxError::Full {
                run_id: run_id.to_owned(),
                pending,
            },
            other => InboxError::Inbox(other),
        }
    }
}

/// The reason a stop ends the run with.
pub fn stop_reason(status: StopAs) -> StopReason {
    match status {
        StopAs::Done => StopReason::OperatorDone,
        StopAs::Failed => StopReason::OperatorFailed,
    }
}

/// A request the run applied, as its checkpoint remembers it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OperatorRecord {
    /// The request id.
    pub id: String,
    /// `steer` or `stop`.
    pub kind: String,
    /// Steps done when it was applied.
    pub step: u64,
    /// When it was sent, ms since the epoch.
    pub sent_at_ms: u64,
    /// When it was applied, ms since the epoch.
    pub applied_at_ms: u64,
    /// The message or the stop's reason, cut short.
    pub text: String,
    /// A steer: the step the model took after seeing it.
    #[serde(default)]
    pub acked_step: Option<u64>,
}

/// A stop applied at a boundary and not yet carried out: kept in the checkpoint, so a crash
/// before the salvage still ends the run on resume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StopRequest {
    /// The request id.
    pub id: String,
    /// `operator_done` or `operator_failed`.
    pub reason: StopReason,
    /// What the run's outcome says about it.
    pub detail: String,
}

/// Whether the run a request went to is being driven now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Liveness {
    /// A process drives it: the request is taken at its next step boundary.
    Running,
    /// Nothing drives it (it crashed, or stopped on an error it can resume from): the request
    /// is taken when `sbx agent resume` continues it.
    Down,
}

/// A request delivered to a run's inbox.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sent {
    /// The request id.
    pub id: String,
    /// Whether the run is running.
    pub run: Liveness,
}

/// Refuses a request to a run that has ended for good (one that stopped on an error it can
/// resume from still takes them: they are applied on resume).
fn ensure_open(ck: &Checkpoint, kind: &'static str) -> Result<(), InboxError> {
    match &ck.outcome {
        Some(o) if !takes_requests(Some(o.reason.as_str())) => Err(InboxError::Finished {
            run_id: ck.run_id.clone(),
            status: o.reason.status().as_str(),
            reason: o.reason,
            kind,
        }),
        _ => Ok(()),
    }
}

/// Sends `command` to run `run_id` under `store`: checked, then written atomically into the
/// run's inbox. An unknown run is refused and nothing is created for it; so is a run that has
/// ended (also one that ends while the request is being written, unless it took the request).
pub fn send(store: &FileStore, run_id: &str, command: Command) -> Result<Sent, InboxError> {
    send_with(store, run_id, command, || {})
}

/// [`send`] with `landed` called once the file is in place, before the re-check (a test ends
/// the run there).
fn send_with(
    store: &FileStore,
    run_id: &str,
    command: Command,
    landed: impl FnOnce(),
) -> Result<Sent, InboxError> {
    validate_run_id(run_id)?;
    command.check().map_err(|e| InboxError::of(run_id, e))?;
    let kind = command.kind();
    let unknown = || InboxError::UnknownRun {
        run_id: run_id.to_owned(),
        dir: store
            .run_dir(run_id)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
    };
    if !store.run_dir(run_id).is_dir() {
        return Err(unknown());
    }
    let ck = match store.load(run_id) {
        Ok(ck) => ck,
        // A directory without a checkpoint is no run (an older `resume` of a mistyped id
        // left such directories behind).
        Err(CheckpointError::NotFound { .. }) => return Err(unknown()),
        Err(e) => return Err(e.into()),
    };
    ensure_open(&ck, kind)?;
    let run = match RunLock::acquire_existing(store, run_id) {
        Err(CheckpointError::Locked(_)) => Liveness::Running,
        // Released at once: holding it would only make a resume fail meanwhile.
        _ => Liveness::Down,
    };
    let inbox = Inbox::of_run(store.root(), run_id).map_err(|e| InboxError::of(run_id, e))?;
    let request = inbox
        .deliver(command)
        .map_err(|e| InboxError::of(run_id, e))?;
    landed();
    // The run may have ended between the check and the rename. If the request is still
    // there, it was not taken: withdraw it and say so. If it is gone, the run either took it
    // (its checkpoint lists it) or dropped it when it ended.
    if let Ok(now) = store.load(run_id) {
        if let Err(finished) = ensure_open(&now, kind) {
            let taken = now.operator.iter().any(|r| r.id == request.id);
            if !taken {
                if let Err(e) = inbox.withdraw(&request.id) {
                    tracing::warn!(run = %run_id, error = %e, "cannot withdraw a request to an ended run");
                }
                return Err(finished);
            }
        }
    }
    Ok(Sent {
        id: request.id,
        run,
    })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::agent::checkpoint::{tests::sample, Outcome};

    fn store_with_run(dir: &Path, run_id: &str) -> FileStore {
        let store = FileStore::new(dir);
        store.save(&sample(run_id)).expect("save");
        store
    }

    fn steer(text: &str) -> Command {
        Command::Steer {
            message: text.into(),
        }
    }

    fn outcome(reason: StopReason) -> Outcome {
        Outcome {
            reason,
            answer: None,
            final_snapshot_id: None,
            diff: String::new(),
            summary: String::new(),
            error: None,
            finished_at_ms: None,
        }
    }

    #[test]
    fn a_request_lands_whole_and_is_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let sent = send(&store, "r", steer("use python3, not python")).expect("sent");
        assert_eq!(sent.run, Liveness::Down, "nothing holds the run");
        assert!(valid_request_id(&sent.id), "{}", sent.id);
        let inbox = Inbox::of(&store.run_dir("r"));
        assert_eq!(inbox.pending().expect("pending"), vec![sent.id.clone()]);
        let batch = inbox.read_batch(MAX_PENDING);
        assert_eq!(batch.len(), 1);
        let Incoming::Request(r) = &batch[0] else {
            panic!("{batch:?}")
        };
        assert_eq!(r.id, sent.id);
        assert_eq!(r.command, steer("use python3, not python"));
        // No temporary is left beside it.
        let names: Vec<_> = fs::read_dir(inbox.dir())
            .expect("dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        inbox.discard(&file_name(&r.id));
        assert!(inbox.pending().expect("pending").is_empty());
    }

    #[test]
    fn requests_are_read_in_the_order_they_were_sent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let mut ids = Vec::new();
        for i in 0..5 {
            ids.push(send(&store, "r", steer(&format!("m{i}"))).expect("sent").id);
        }
        assert_eq!(
            Inbox::of(&store.run_dir("r")).pending().expect("pending"),
            ids
        );
    }

    #[test]
    fn a_held_run_is_running() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let _held = RunLock::acquire_existing(&store, "r").expect("lock");
        let sent = send(&store, "r", steer("x")).expect("sent");
        assert_eq!(sent.run, Liveness::Running);
    }

    #[test]
    fn an_unknown_run_is_refused_and_nothing_is_created() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        let err = send(&store, "nope", steer("x")).expect_err("unknown");
        assert!(matches!(err, InboxError::UnknownRun { .. }), "{err}");
        assert!(err.to_string().contains("unknown run nope"), "{err}");
        assert!(!store.run_dir("nope").exists());
        assert!(
            !dir.path().join("runs").exists(),
            "not even the runs directory"
        );
        // A directory without a checkpoint is no run either, and gets no inbox.
        fs::create_dir_all(store.run_dir("empty")).expect("mkdir");
        let err = send(&store, "empty", steer("x")).expect_err("no checkpoint");
        assert!(matches!(err, InboxError::UnknownRun { .. }), "{err}");
        assert!(!store.run_dir("empty").join(INBOX_DIR).exists());
        // Path tricks in the run id never reach the filesystem.
        for bad in ["../r", "r/../../x", ".hidden", ""] {
            let err = send(&store, bad, steer("x")).expect_err(bad);
            assert!(
                matches!(
                    err,
                    InboxError::Checkpoint(CheckpointError::InvalidRunId(_))
                ),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_finished_run_is_refused_but_a_resumable_one_queues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::new(dir.path());
        let mut ck = sample("done");
        ck.outcome = Some(outcome(StopReason::Finished));
        store.save(&ck).expect("save");
        let err = send(&store, "done", steer("x")).expect_err("finished");
        assert!(
            err.to_string()
                .contains("run done is finished (done: finished)"),
            "{err}"
        );
        let stop = Command::Stop {
            status: StopAs::Failed,
            reason: None,
        };
        assert!(matches!(
            send(&store, "done", stop.clone()),
            Err(InboxError::Finished { kind: "stop", .. })
        ));
        assert!(!store.run_dir("done").join(INBOX_DIR).exists());

        let mut ck = sample("broken");
        ck.outcome = Some(outcome(StopReason::FatalError));
        store.save(&ck).expect("save");
        let sent = send(&store, "broken", stop).expect("a resumable run takes it on resume");
        assert_eq!(sent.run, Liveness::Down);
    }

    #[test]
    fn bounds_are_enforced_by_the_sender() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        assert!(matches!(
            send(&store, "r", steer("  \n")),
            Err(InboxError::Inbox(agent_inbox::Error::EmptyMessage))
        ));
        let long = "x".repeat(MAX_MESSAGE_BYTES + 1);
        assert!(matches!(
            send(&store, "r", steer(&long)),
            Err(InboxError::Inbox(agent_inbox::Error::MessageTooLong { .. }))
        ));
        let stop = Command::Stop {
            status: StopAs::Done,
            reason: Some("y".repeat(MAX_REASON_BYTES + 1)),
        };
        assert!(matches!(
            send(&store, "r", stop),
            Err(InboxError::Inbox(agent_inbox::Error::ReasonTooLong { .. }))
        ));
        assert!(send(&store, "r", steer(&"x".repeat(MAX_MESSAGE_BYTES))).is_ok());
        for i in 1..MAX_PENDING {
            send(&store, "r", steer(&format!("m{i}"))).expect("room");
        }
        let err = send(&store, "r", steer("one too many")).expect_err("full");
        assert!(
            matches!(err, InboxError::Full { pending, .. } if pending == MAX_PENDING),
            "{err}"
        );
    }

    #[test]
    fn untrusted_files_are_rejected_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let inbox = Inbox::of(&store.run_dir("r"));
        inbox.create().expect("create");
        let d = inbox.dir().to_path_buf();
        let secret = dir.path().join("secret");
        fs::write(
            &secret,
            br#"{"id":"a1","sent_at_ms":1,"kind":"steer","message":"leak"}"#,
        )
        .expect("write");
        std::os::unix::fs::symlink(&secret, d.join("a1.json")).expect("symlink");
        fs::write(d.join("a2.json"), b"{not json").expect("write");
        fs::write(
            d.join("a3.json"),
            br#"{"id":"other","sent_at_ms":1,"kind":"steer","message":"m"}"#,
        )
        .expect("write");
        fs::write(d.join("a4.json"), vec![b' '; MAX_FILE_BYTES as usize + 1]).expect("write");
        fs::write(
            d.join("a5.json"),
            br#"{"id":"a5","sent_at_ms":1,"kind":"steer","message":"   "}"#,
        )
        .expect("write");
        fs::write(d.join("notes.txt"), b"hello").expect("write");
        nix::unistd::mkfifo(&d.join("a6.json"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        fs::write(d.join(".a7.json.tmp-1"), b"half").expect("write");
        fs::create_dir(d.join("a8.json")).expect("mkdir");
        fs::write(
            d.join("a9.json"),
            br#"{"id":"a9","sent_at_ms":1,"kind":"stop","status":"done","reason":"enough"}"#,
        )
        .expect("write");

        let batch = inbox.read_batch(100);
        let why = |name: &str| {
            batch.iter().find_map(|i| match i {
                Incoming::Rejected { name: n, why } if n == name => Some(why.clone()),
                _ => None,
            })
        };
        assert!(
            why("a1.json").is_some_and(|w| w.contains("symbolic link")),
            "{batch:?}"
        );
        assert!(
            why("a2.json").is_some_and(|w| w.contains("not a request")),
            "{batch:?}"
        );
        assert!(
            why("a3.json").is_some_and(|w| w.contains("not its file name")),
            "{batch:?}"
        );
        assert!(
            why("a4.json").is_some_and(|w| w.contains("at most")),
            "{batch:?}"
        );
        assert!(
            why("a5.json").is_some_and(|w| w.contains("empty")),
            "{batch:?}"
        );
        assert!(
            why("a6.json").is_some_and(|w| w.contains("not a regular file")),
            "{batch:?}"
        );
        assert!(why("notes.txt").is_some(), "{batch:?}");
        assert!(
            why(".a7.json.tmp-1").is_none(),
            "a write in progress is left alone"
        );
        assert!(why("a8.json").is_none(), "directories are not entries");
        let good: Vec<_> = batch
            .iter()
            .filter_map(|i| match i {
                Incoming::Request(r) => Some(r.id.clone()),
                Incoming::Rejected { .. } => None,
            })
            .collect();
        assert_eq!(good, vec!["a9".to_owned()]);
        // Discarding a rejected link removes the link, never what it points to.
        inbox.discard("a1.json");
        assert!(secret.exists());
        assert!(!d.join("a1.json").exists());
        // Names with path tricks are never removed.
        inbox.discard("../checkpoint");
        assert!(store.path("r").exists());
    }

    #[test]
    fn an_inbox_that_is_a_link_is_neither_read_nor_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir(&elsewhere).expect("mkdir");
        fs::write(
            elsewhere.join("a1.json"),
            br#"{"id":"a1","sent_at_ms":1,"kind":"steer","message":"m"}"#,
        )
        .expect("write");
        std::os::unix::fs::symlink(&elsewhere, store.run_dir("r").join(INBOX_DIR))
            .expect("symlink");
        let inbox = Inbox::of(&store.run_dir("r"));
        assert!(inbox.read_batch(MAX_PENDING).is_empty());
        assert!(inbox.pending().is_err());
        let err = send(&store, "r", steer("x")).expect_err("refused");
        assert!(err.to_string().contains("plain directory"), "{err}");
        assert_eq!(fs::read_dir(&elsewhere).expect("dir").count(), 1);
    }

    #[test]
    fn a_request_to_a_run_that_ends_meanwhile_is_withdrawn_unless_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with_run(dir.path(), "r");
        let end = |taken: Option<&Path>| {
            let mut ck = store.load("r").expect("load");
            ck.outcome = Some(outcome(StopReason::MaxSteps));
            if let Some(path) = taken {
                // The run took it before it ended: its checkpoint lists it, the file is gone.
                let id = path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or_default()
                    .to_owned();
                ck.operator.push(OperatorRecord {
                    id,
                    kind: "steer".into(),
                    step: 3,
                    sent_at_ms: 0,
                    applied_at_ms: 0,
                    text: String::new(),
                    acked_step: None,
                });
                fs::remove_file(path).expect("take");
            }
            store.save(&ck).expect("save");
        };
        let inbox = Inbox::of(&store.run_dir("r"));
        let err = send_with(&store, "r", steer("late"), || end(None)).expect_err("withdrawn");
        assert!(matches!(err, InboxError::Finished { .. }), "{err}");
        assert!(inbox.pending().expect("pending").is_empty(), "withdrawn");

        // Taken just before the end: delivered.
        let mut ck = store.load("r").expect("load");
        ck.outcome = None;
        store.save(&ck).expect("save");
        let sent = send_with(&store, "r", steer("just in time"), || {
            let ids = inbox.pending().expect("pending");
            end(Some(&inbox.path_of(&ids[0])));
        })
        .expect("taken counts as delivered");
        assert!(store
            .load("r")
            .expect("load")
            .operator
            .iter()
            .any(|r| r.id == sent.id));
    }
}
