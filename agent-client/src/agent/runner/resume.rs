//! Resume: making the sandbox agree with the checkpoint before the loop goes on.
//!
//! In three steps: find the sandbox (or fork the last snapshot, or make it if the run never
//! got one), settle the pending action by what its tool declares about repeating it
//! ([`Repeat`]), and tell the model what happened.

use serde_json::json;

use super::{idempotency_key, is_background, Agent, AgentError, RUN_LABEL};
use crate::agent::checkpoint::PendingAction;
use crate::agent::classify::{classify, Class, Op};
use crate::agent::observe;
use crate::agent::sandbox::SandboxApi;
use crate::agent::state::LoopState;
use crate::agent::tools::Repeat;
use crate::proto::{CreateSandboxRequest, ExecResult, ExecStatus, SandboxState};

/// Where the resumed run's sandbox came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The run's own sandbox, still running.
    Same,
    /// A fork of the last snapshot: the state after the last completed step, nothing of the
    /// pending action.
    Forked,
    /// Made now: the run had none.
    Made,
}

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    /// Makes the sandbox agree with the checkpoint: the sandbox exists (forked from the last
    /// snapshot if not), and the pending action's effect is there exactly once.
    pub(super) async fn reconcile(&mut self) -> Result<(), AgentError> {
        let mut notes = Vec::new();
        let found = self.find_sandbox(&mut notes).await?;
        let next = match self.ck.pending.clone() {
            Some(pending) => self.settle_pending(pending, found, &mut notes).await?,
            None => LoopState::Thinking,
        };
        self.tell_the_model(&notes);
        self.state = LoopState::Idle;
        self.writer.write_now(self.checkpoint()).await?;
        match next {
            LoopState::Acting if self.last_obs.is_some() => {
                // The result is known: go through ACTING without sending anything.
                self.go(LoopState::Acting, "resume: pending action already ran")?;
                self.go(LoopState::Observing, "resume: recorded result")?;
            }
            other => self.go(other, "resume")?,
        }
        Ok(())
    }

    /// Step 1: the run's sandbox if it still runs; else a fork of the last snapshot; else (the
    /// run never got one) a new one.
    async fn find_sandbox(&mut self, notes: &mut Vec<String>) -> Result<Found, AgentError> {
        if self.ck.sandbox_id.is_empty() {
            self.make_sandbox().await?;
            notes.push(format!(
                "the run's sandbox {} was made now",
                self.ck.sandbox_id
            ));
            return Ok(Found::Made);
        }
        let running = match self.sandbox.get(&self.ck.sandbox_id).await {
            Ok(sb) if sb.state == SandboxState::Running as i32 => Some(sb),
            Ok(_) => None,
            Err(e) if classify(Op::GetSandbox, &e) == Class::SandboxGone => None,
            Err(source) => {
                return Err(AgentError::Daemon {
                    what: format!("cannot look up sandbox {}", self.ck.sandbox_id),
                    source,
                })
            }
        };
        if let Some(sb) = running {
            self.workdir = or_workspace(sb.workdir);
            return Ok(Found::Same);
        }
        let snap = self
            .ck
            .snapshot_id
            .clone()
            .ok_or_else(|| AgentError::CannotResume {
                run_id: self.ck.run_id.clone(),
                reason: format!(
                    "sandbox {} is gone and no snapshot was taken",
                    self.ck.sandbox_id
                ),
            })?;
        let sb = self
            .sandbox
            .create(CreateSandboxRequest {
                from_snapshot_id: snap.clone(),
                labels: [(RUN_LABEL.to_owned(), self.ck.run_id.clone())]
                    .into_iter()
                    .collect(),
                ..Default::default()
            })
            .await
            .map_err(|source| AgentError::Daemon {
                what: format!(
                    "sandbox {} is gone and forking snapshot {snap} failed",
                    self.ck.sandbox_id
                ),
                source,
            })?;
        let lost = if self.ck.unsnapshotted_steps.is_empty() {
            String::new()
        } else {
            format!(
                "; the changes of steps {:?} were not in any snapshot and are lost",
                self.ck.unsnapshotted_steps
            )
        };
        notes.push(format!(
            "sandbox {} was gone; continued in {} forked from snapshot {snap} (the state after step {}){lost}",
            self.ck.sandbox_id, sb.id, self.ck.step
        ));
        self.trace_event("decision", json!({"decision": "fork", "old_sandbox": self.ck.sandbox_id, "new_sandbox": sb.id, "snapshot": snap}));
        self.ck.sandbox_id = sb.id;
        self.ck.sandbox_removed = false;
        self.ck.unsnapshotted_steps.clear();
        self.workdir = or_workspace(sb.workdir);
        Ok(Found::Forked)
    }

    /// Step 2: the pending action may have happened, in full or in part. What is done about
    /// it is what its tool declares ([`Repeat`]); returns the state to go on in.
    async fn settle_pending(
        &mut self,
        pending: PendingAction,
        found: Found,
        notes: &mut Vec<String>,
    ) -> Result<LoopState, AgentError> {
        let what = format!(
            "the action of step {} ({})",
            pending.step,
            pending.action.describe()
        );
        if pending.verifying {
            // The checks go with keys of this attempt: the daemon answers a check that ran
            // with its recorded result and runs one that did not.
            notes.push(format!("{what} was being verified; the check is run again"));
            return Ok(LoopState::Verifying);
        }
        match pending.action.repeat() {
            Repeat::Keyed if is_bash(&pending) => {
                self.settle_exec(pending, found, what, notes).await
            }
            Repeat::Keyed => {
                // Its checks replay under the same key: sending it again cannot run one twice.
                notes.push(format!("{what} is sent again under the same key"));
                Ok(LoopState::Acting)
            }
            Repeat::CheckFirst => {
                // str_replace looks at the file's digest before it writes anything.
                notes.push(format!(
                    "{what} is checked: applied only if its write had not landed"
                ));
                Ok(LoopState::Acting)
            }
            Repeat::LookUpFirst => {
                notes.push(format!(
                    "{what} is looked up first, so it is not made twice"
                ));
                Ok(LoopState::Acting)
            }
            Repeat::Safe => {
                notes.push(format!("{what} is run again (it is safe to repeat)"));
                Ok(LoopState::Acting)
            }
        }
    }

    /// A pending bash command: the daemon's record under its key says whether it ran. A
    /// recorded result is used; a command that never started runs; one that ended LOST runs
    /// again after a rollback to the last step's snapshot, unless that rollback would erase
    /// steps (then the model is told and decides).
    async fn settle_exec(
        &mut self,
        pending: PendingAction,
        found: Found,
        what: String,
        notes: &mut Vec<String>,
    ) -> Result<LoopState, AgentError> {
        // A fork or a new sandbox holds no record of it, and nothing of it.
        let recorded = if found == Found::Same {
            self.recorded_exec(&pending.idempotency_key).await?
        } else {
            None
        };
        match recorded {
            Some(r) if r.status != ExecStatus::Lost as i32 => {
                self.adopt(&pending, r, &what, notes).await?;
                Ok(LoopState::Acting)
            }
            recorded => {
                let lost = recorded.is_some();
                let why = if lost { "ended LOST" } else { "never started" };
                let needs_rollback = found == Found::Same;
                if needs_rollback && !self.ck.unsnapshotted_steps.is_empty() {
                    if let Some(r) = recorded {
                        // Half done, and no snapshot to undo it with that keeps the steps
                        // since: the model decides.
                        let reason =
                            self.no_rollback_reason(self.ck.snapshot_id.clone().as_deref());
                        let mut obs = observe::exec(&r, self.opts.observe);
                        obs.text = format!(
                            "{}\nThe command was interrupted and may have run in part. It was NOT run again and nothing was rolled back: {reason}. Check the state of the files, then decide.",
                            obs.text
                        );
                        obs.ok = false;
                        obs.lost = false;
                        self.last_obs = Some(obs);
                        notes.push(format!("{what} ended LOST; it was not run again: {reason}"));
                        self.trace_event("decision", json!({"decision": "lost_exec_not_rolled_back", "exec_id": r.exec_id, "why": reason}));
                        return Ok(LoopState::Acting);
                    }
                    // Never started: nothing to undo.
                    notes.push(format!("{what} never started; it is run now"));
                    self.rekey_pending(&pending);
                    return Ok(LoopState::Acting);
                }
                let rolled_back = match self.ck.snapshot_id.clone() {
                    Some(snap) if needs_rollback => {
                        self.sandbox
                            .rollback(&self.ck.sandbox_id, &snap)
                            .await
                            .map_err(|source| AgentError::Daemon {
                                what: format!("cannot roll back to snapshot {snap}"),
                                source,
                            })?;
                        self.trace_event(
                            "decision",
                            json!({"decision": "rollback", "snapshot": snap, "why": why}),
                        );
                        true
                    }
                    _ => false,
                };
                notes.push(format!(
                    "{what} {why}; {}it is run again",
                    if rolled_back {
                        "the sandbox was rolled back to the last step's snapshot and "
                    } else {
                        ""
                    }
                ));
                self.rekey_pending(&pending);
                Ok(LoopState::Acting)
            }
        }
    }

    /// The daemon ran it (or still runs it): its effect is in the filesystem already, so its
    /// result is taken instead of running it again.
    async fn adopt(
        &mut self,
        pending: &PendingAction,
        r: ExecResult,
        what: &str,
        notes: &mut Vec<String>,
    ) -> Result<(), AgentError> {
        let r = if r.status == ExecStatus::Running as i32 && !is_background(&pending.action) {
            self.sandbox
                .get_exec(&r.exec_id, true)
                .await
                .map_err(|source| AgentError::Daemon {
                    what: format!("cannot wait for exec {}", r.exec_id),
                    source,
                })?
        } else {
            r
        };
        notes.push(format!(
            "{what} had already run as exec {}; its recorded result is used",
            r.exec_id
        ));
        self.trace_event("decision", json!({"decision": "adopt_recorded_exec", "exec_id": r.exec_id, "key": pending.idempotency_key}));
        let mut obs = observe::exec(&r, self.opts.observe);
        self.spill(&mut obs, pending.step).await;
        self.last_obs = Some(obs);
        Ok(())
    }

    /// The pending action again, under a new key: the old key's record (if any) is of an
    /// attempt that is being undone or never ran.
    fn rekey_pending(&mut self, pending: &PendingAction) {
        let mut p = pending.clone();
        p.attempt += 1;
        p.idempotency_key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "act");
        self.ck.pending = Some(p);
    }

    /// Step 3: the model learns it was interrupted and what was done about it.
    fn tell_the_model(&mut self, notes: &[String]) {
        let note = format!(
            "Resumed at step {} after an interruption (session {}). {} Done so far: {}",
            self.ck.step,
            self.ck.sessions,
            notes.join(". "),
            self.ctx.brief(5)
        );
        self.ctx
            .pin("recovery note", &observe::cut_chars(&note, 1_500));
        self.trace_event("recovery", json!({"detail": note}));
    }

    /// The newest exec recorded under `key`, with its output once it has ended (ListExecs
    /// returns metadata only, so the one record needed is read again with GetExec).
    async fn recorded_exec(&self, key: &str) -> Result<Option<ExecResult>, AgentError> {
        let execs = self
            .sandbox
            .list_execs(&self.ck.sandbox_id)
            .await
            .map_err(|source| AgentError::Daemon {
                what: format!("cannot list the execs of sandbox {}", self.ck.sandbox_id),
                source,
            })?;
        let Some(found) = execs.into_iter().rev().find(|r| r.idempotency_key == key) else {
            return Ok(None);
        };
        if found.status == ExecStatus::Running as i32 {
            // The caller waits for it with GetExec when it needs the end.
            return Ok(Some(found));
        }
        let full = self
            .sandbox
            .get_exec(&found.exec_id, false)
            .await
            .map_err(|source| AgentError::Daemon {
                what: format!("cannot read exec {}", found.exec_id),
                source,
            })?;
        Ok(Some(full))
    }
}

fn is_bash(p: &PendingAction) -> bool {
    p.action.tool() == "bash"
}

fn or_workspace(workdir: String) -> String {
    if workdir.is_empty() {
        "/workspace".into()
    } else {
        workdir
    }
}
