//! The end of every run: final snapshot, workspace diff, summary, final checkpoint.

use serde_json::json;

use super::{report_of, Agent, RunReport, AGENT_DIR};
use crate::agent::checkpoint::{FileStore, Outcome};
use crate::agent::sandbox::SandboxApi;
use crate::agent::state::StopReason;
use crate::agent::tools;
use crate::proto::ExecRequest;

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    // ---- the end -----------------------------------------------------------------------

    /// Every stop ends here: final snapshot, workspace diff, summary, final checkpoint.
    pub(super) async fn salvage(mut self) -> RunReport {
        let (reason, detail) = self
            .stop
            .clone()
            .unwrap_or((StopReason::FatalError, "stopped".into()));
        if let Err(e) = self.writer.flush().await {
            tracing::warn!(error = %e, "a checkpoint write failed before the salvage");
        }
        let mut errors = Vec::new();
        if reason == StopReason::FatalError {
            errors.push(detail.clone());
        }
        let final_snapshot_id = match self
            .sandbox
            .snapshot(
                &self.ck.sandbox_id,
                &format!("agent-{}-final", self.ck.run_id),
            )
            .await
        {
            Ok(info) => Some(info.snapshot_id),
            Err(e) => {
                errors.push(format!("final snapshot failed: {e}"));
                self.ck.snapshot_id.clone()
            }
        };
        let diff_cmd = format!(
            "cd {AGENT_DIR}/base 2>/dev/null || exit 0; diff -ruN . {} 2>&1; true",
            tools::shell_quote(&self.workdir)
        );
        let diff = match self
            .exec(ExecRequest {
                max_output_bytes: 4 << 20,
                timeout_ms: 60_000,
                ..crate::exec_request(self.ck.sandbox_id.as_str(), ["sh", "-c", diff_cmd.as_str()])
            })
            .await
        {
            Ok(r) => String::from_utf8_lossy(&r.stdout).into_owned(),
            Err(e) => {
                errors.push(format!("workspace diff failed: {e}"));
                String::new()
            }
        };
        let run_dir = self.store.run_dir(&self.ck.run_id);
        if !diff.is_empty() {
            let path = run_dir.join("final.diff");
            if let Err(e) =
                FileStore::write_atomic_off_runtime(path, diff.clone().into_bytes()).await
            {
                errors.push(format!("cannot save the diff: {e}"));
            }
        }
        let files_changed = diff.lines().filter(|l| l.starts_with("+++ ")).count();
        let summary = format!(
            "{} after {} steps ({}): {}. {} file{} changed. {}",
            reason.status().as_str(),
            self.ck.step,
            reason,
            detail,
            files_changed,
            if files_changed == 1 { "" } else { "s" },
            self.ctx.brief(5)
        );
        self.ck.outcome = Some(Outcome {
            reason,
            answer: self.answer.clone(),
            final_snapshot_id,
            diff,
            summary,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
            finished_at_ms: Some(super::now_ms()),
        });
        self.progress(format!("{} ({reason})", reason.status().as_str()));
        let ck = self.checkpoint();
        if let Err(e) = self.writer.write_now(ck.clone()).await {
            tracing::error!(error = %e, "cannot write the final checkpoint");
        }
        self.trace_event("stop", json!({"reason": reason.as_str(), "status": reason.status().as_str(), "detail": detail,
            "prompt_tokens": ck.budget.prompt_tokens, "completion_tokens": ck.budget.completion_tokens}));
        if !reason.resumable() {
            self.drop_waiting_requests();
        }
        report_of(
            &ck,
            &self.store,
            self.writer.latencies(),
            self.writer.stalls(),
        )
    }
}
