//! Resume: making the sandbox agree with the checkpoint before the loop goes on.

use serde_json::json;

use super::{idempotency_key, is_background, Agent, AgentError, RUN_LABEL};
use crate::agent::observe;
use crate::agent::sandbox::SandboxApi;
use crate::agent::state::LoopState;
use crate::agent::tools::Action;
use crate::proto::{CreateSandboxRequest, ExecResult, ExecStatus, SandboxState};

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    // ---- resume ------------------------------------------------------------------------

    /// Makes the sandbox agree with the checkpoint: the sandbox exists (forked from the last
    /// snapshot if not), and the pending action's effect is there exactly once.
    pub(super) async fn reconcile(&mut self) -> Result<(), AgentError> {
        let mut notes = Vec::new();
        let sandbox = match self.sandbox.get(&self.ck.sandbox_id).await {
            Ok(sb) if sb.state == SandboxState::Running as i32 => Some(sb),
            Ok(_) => None,
            Err(e) if e.code() == tonic::Code::NotFound => None,
            Err(source) => {
                return Err(AgentError::Daemon {
                    what: format!("cannot look up sandbox {}", self.ck.sandbox_id),
                    source,
                })
            }
        };
        let forked = match sandbox {
            Some(sb) => {
                self.workdir = sb.workdir;
                false
            }
            None => {
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
                notes.push(format!(
                    "sandbox {} was gone; continued in {} forked from snapshot {snap} (the state after step {})",
                    self.ck.sandbox_id, sb.id, self.ck.step
                ));
                self.trace_event("decision", json!({"decision": "fork", "old_sandbox": self.ck.sandbox_id, "new_sandbox": sb.id, "snapshot": snap}));
                self.ck.sandbox_id = sb.id;
                self.ck.sandbox_removed = false;
                self.workdir = sb.workdir;
                true
            }
        };
        if self.workdir.is_empty() {
            self.workdir = "/workspace".into();
        }

        let mut next = LoopState::Thinking;
        if let Some(pending) = self.ck.pending.clone() {
            let recorded =
                if forked || !matches!(pending.action, Action::Bash { .. }) && !pending.verifying {
                    None
                } else {
                    self.recorded_exec(&pending.idempotency_key).await?
                };
            match recorded {
                Some(r) if r.status != ExecStatus::Lost as i32 => {
                    // The daemon ran it (or still runs it): its effect is in the filesystem
                    // already, so take its result instead of running it again.
                    let r = if r.status == ExecStatus::Running as i32
                        && !is_background(&pending.action)
                    {
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
                        "the action of step {} ({}) had already run as exec {}; its recorded result is used",
                        pending.step,
                        pending.action.describe(),
                        r.exec_id
                    ));
                    self.trace_event("decision", json!({"decision": "adopt_recorded_exec", "exec_id": r.exec_id, "key": pending.idempotency_key}));
                    if pending.verifying {
                        next = LoopState::Verifying;
                    } else {
                        let mut obs = observe::exec(&r, self.opts.observe);
                        self.spill(&mut obs, pending.step).await;
                        self.last_obs = Some(obs);
                        next = LoopState::Acting; // straight to OBSERVING below
                    }
                }
                other => {
                    // Never started, or LOST half-way: put the files back to the last step's
                    // snapshot so a half-done effect cannot stack, then run it again under a
                    // new key.
                    let why = if other.is_some() {
                        "ended LOST"
                    } else {
                        "never started"
                    };
                    // A fork starts from that snapshot already.
                    let needs_rollback = pending.action.may_mutate() && !forked;
                    if needs_rollback {
                        if let Some(snap) = self.ck.snapshot_id.clone() {
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
                        }
                    }
                    let mut p = pending.clone();
                    p.attempt += 1;
                    p.idempotency_key = idempotency_key(
                        &self.ck.run_id,
                        p.step,
                        p.attempt,
                        if p.verifying { "verify" } else { "act" },
                    );
                    notes.push(format!(
                        "the action of step {} ({}) {why}; {}it is run again",
                        p.step,
                        p.action.describe(),
                        if needs_rollback {
                            "the sandbox was rolled back to the last step's snapshot and "
                        } else {
                            ""
                        }
                    ));
                    next = if p.verifying {
                        LoopState::Verifying
                    } else {
                        LoopState::Acting
                    };
                    self.ck.pending = Some(p);
                }
            }
        }
        let done: Vec<String> = vec![self.ctx.brief(5)];
        let note = format!(
            "Resumed at step {} after an interruption (session {}). {} Done so far: {}",
            self.ck.step,
            self.ck.sessions,
            notes.join(". "),
            done.join("; ")
        );
        self.ctx
            .pin("recovery note", &observe::cut_chars(&note, 1_500));
        self.trace_event("recovery", json!({"detail": note}));
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
