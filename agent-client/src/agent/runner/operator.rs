//! The operator's hand on a running loop: `sbx agent steer` and `sbx agent stop` requests,
//! taken from the run's inbox ([`crate::agent::inbox`]) at step boundaries.
//!
//! A boundary is a point where nothing is half done: before each model turn (THINKING),
//! before an action or a task check is sent (ACTING, VERIFYING), and throughout a retry's wait
//! (RETRYING). A model call or a command in flight is not interrupted; a stop that arrives
//! while the model thinks keeps the action it then chooses from being sent.

use serde_json::json;

use super::{now_ms, Agent, AgentError};
use crate::agent::inbox::{
    Command, Inbox, Incoming, OperatorRecord, StopRequest, MAX_PENDING, MAX_RECORDS,
};
use crate::agent::llm::{FunctionCall, ToolCall};
use crate::agent::observe;
use crate::agent::sandbox::SandboxApi;
use crate::agent::state::{LoopState, RunStatus};

/// Characters of a message or reason kept in the checkpoint's record and the trace line.
const RECORD_CHARS: usize = 200;

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    /// A step boundary: applies the operator's waiting requests, in the order they were sent.
    /// A steer is pinned into the context; a stop ends the run (with the salvage every end
    /// gets). What was applied is durable in the checkpoint before the request files are
    /// removed, so a crash neither loses nor repeats one. Returns whether the run is stopping
    /// (the loop is then in a terminal state).
    pub(super) async fn operator_boundary(&mut self) -> Result<bool, AgentError> {
        if self.ck.stop_requested.is_none() {
            self.take_requests().await?;
        }
        match self.ck.stop_requested.clone() {
            Some(stop) => {
                self.intervene(stop)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn take_requests(&mut self) -> Result<(), AgentError> {
        let inbox = Inbox::of(&self.store.run_dir(&self.ck.run_id));
        let batch = inbox.read_batch(MAX_PENDING);
        if batch.is_empty() {
            return Ok(());
        }
        // Trace lines wait for the checkpoint: the trace says applied only what is.
        let mut lines = Vec::new();
        let mut taken = Vec::new();
        for item in batch {
            let request = match item {
                Incoming::Rejected { name, why } => {
                    tracing::warn!(run = %self.ck.run_id, file = %name, %why, "rejected an operator request");
                    lines.push(json!({"decision": "rejected", "file": name, "detail": format!("operator request {name} rejected: {why}")}));
                    taken.push(name);
                    continue;
                }
                Incoming::Request(r) => r,
            };
            let name = crate::agent::inbox::file_name(&request.id);
            if self.ck.operator.iter().any(|r| r.id == request.id) {
                // Applied before a crash that came before its file was removed.
                lines.push(json!({"decision": "already_applied", "request": request.id, "detail": format!("operator request {} was applied before the interruption", request.id)}));
                taken.push(name);
                continue;
            }
            if self.ck.stop_requested.is_some() {
                // Nothing after a stop is applied: the end drops it, and says so.
                break;
            }
            let (text, line) = match &request.command {
                Command::Steer { message } => {
                    let cut = self.ctx.steer(&request.id, message, self.ck.step);
                    let shown = observe::cut_chars(message, RECORD_CHARS);
                    (
                        shown.clone(),
                        json!({"decision": "steer", "request": request.id, "cut": cut, "message": message, "detail": format!("steer {}: {}", request.id, shown)}),
                    )
                }
                Command::Stop { status, reason } => {
                    let reason_text = reason.as_deref().map(str::trim).unwrap_or_default();
                    let detail = if reason_text.is_empty() {
                        "stopped by the operator".to_owned()
                    } else {
                        format!("stopped by the operator: {reason_text}")
                    };
                    self.ck.stop_requested = Some(StopRequest {
                        id: request.id.clone(),
                        reason: crate::agent::inbox::stop_reason(*status),
                        detail: detail.clone(),
                    });
                    // The run ends here: an action in flight (a retry's) is not taken up
                    // again, by this session or a resume.
                    if let Some(p) = self.ck.pending.take() {
                        lines.push(json!({"decision": "pending_abandoned", "action": p.action.describe(), "detail": format!("the action of step {} is abandoned by the stop", p.step)}));
                    }
                    (
                        observe::cut_chars(reason_text, RECORD_CHARS),
                        json!({"decision": "stop", "request": request.id, "status": crate::agent::inbox::stop_reason(*status).status().as_str(), "detail": format!("stop {} ({}): {}", request.id, crate::agent::inbox::stop_reason(*status).status().as_str(), detail)}),
                    )
                }
            };
            tracing::info!(run = %self.ck.run_id, request = %request.id, kind = request.command.kind(), "operator request applied");
            self.ck.operator.push(OperatorRecord {
                id: request.id.clone(),
                kind: request.command.kind().to_owned(),
                step: self.ck.step,
                sent_at_ms: request.sent_at_ms,
                applied_at_ms: now_ms(),
                text,
                acked_step: None,
            });
            let excess = self.ck.operator.len().saturating_sub(MAX_RECORDS);
            self.ck.operator.drain(..excess);
            lines.push(line);
            taken.push(name);
        }
        self.writer.write_now(self.checkpoint()).await?;
        for line in lines {
            self.trace_event("operator", line);
        }
        for name in taken {
            inbox.discard(&name);
        }
        Ok(())
    }

    /// The operator's stop: the "intervene" transition, from wherever the loop is to DONE or
    /// FAILED ([`LoopState::can_intervene`]).
    fn intervene(&mut self, stop: StopRequest) -> Result<(), AgentError> {
        tracing::info!(run = %self.ck.run_id, reason = %stop.reason, detail = %stop.detail, "stopping on the operator's request");
        self.trace_event(
            "decision",
            json!({"decision": "stop", "reason": stop.reason.as_str(), "detail": stop.detail, "request": stop.id}),
        );
        let to = if stop.reason.status() == RunStatus::Done {
            LoopState::Done
        } else {
            LoopState::Failed
        };
        let from = self.state;
        self.state = from.check_intervention(to)?;
        self.trace_event(
            "transition",
            json!({"from": from.to_string(), "to": to.to_string(), "why": "operator stop"}),
        );
        self.stop = Some((stop.reason, stop.detail));
        Ok(())
    }

    /// `finish` was called while an operator's steer the model has not seen arrived: it is
    /// not checked, and the model is told why, with the steer pinned in that same prompt.
    pub(super) async fn hold_finish(&mut self) -> Result<(), AgentError> {
        let Some(pending) = self.ck.pending.take() else {
            return self.go(LoopState::Thinking, "nothing to verify");
        };
        let call = ToolCall {
            id: pending.call_id.clone(),
            kind: "function".into(),
            function: FunctionCall {
                name: pending.call_name.clone(),
                arguments: pending.call_arguments.clone(),
            },
        };
        self.ck.step = pending.step;
        self.ctx.push_reasoned_step(
            pending.step,
            call,
            pending.reasoning.clone(),
            pending.action.describe(),
            "finish NOT accepted yet: the operator sent a correction while it was being checked (the operator's message below). Take it into account, then call finish again.".into(),
            None,
            false,
        );
        self.trace_event(
            "operator",
            json!({"decision": "finish_held", "detail": format!("finish of step {} held: an operator's steer arrived first", pending.step)}),
        );
        self.writer.start(self.checkpoint()).await?;
        self.go(LoopState::Thinking, "finish held for an operator's steer")
    }

    /// The model answered the prompt that carried the pinned steers with a usable call for
    /// `step`: they are acknowledged (recorded with the step in the checkpoint and the trace).
    pub(super) fn acknowledge_steers(&mut self, step: u64) {
        for id in self.ctx.acknowledge_steers(step) {
            if let Some(r) = self.ck.operator.iter_mut().find(|r| r.id == id) {
                r.acked_step = Some(step);
            }
            self.trace_event(
                "operator",
                json!({"decision": "acknowledged", "request": id, "acked_step": step, "detail": format!("steer {id} acknowledged by the call of step {step}")}),
            );
        }
    }

    /// At the end of a run that cannot be resumed: requests still waiting will never be
    /// applied; each is said in the trace and removed. (A resumable run keeps them for its
    /// resume.)
    pub(super) fn drop_waiting_requests(&mut self) {
        let inbox = Inbox::of(&self.store.run_dir(&self.ck.run_id));
        loop {
            let batch = inbox.read_batch(MAX_PENDING);
            if batch.is_empty() {
                return;
            }
            for item in batch {
                let (name, line) = match item {
                    Incoming::Request(r) if self.ck.operator.iter().any(|o| o.id == r.id) => {
                        (crate::agent::inbox::file_name(&r.id), None)
                    }
                    Incoming::Request(r) => (
                        crate::agent::inbox::file_name(&r.id),
                        Some(
                            json!({"decision": "dropped", "request": r.id, "detail": format!("{} {} not applied: the run ended first", r.command.kind(), r.id)}),
                        ),
                    ),
                    Incoming::Rejected { name, why } => (
                        name.clone(),
                        Some(
                            json!({"decision": "rejected", "file": name, "detail": format!("operator request {name} rejected: {why}")}),
                        ),
                    ),
                };
                if let Some(line) = line {
                    self.trace_event("operator", line);
                }
                let path = inbox.dir().join(&name);
                inbox.discard(&name);
                if std::fs::symlink_metadata(&path).is_ok() {
                    // Cannot be removed: stop rather than loop on it.
                    return;
                }
            }
        }
    }
}
