//! Carrying out one action in the sandbox: the tools behind the model's calls.

use std::time::{Duration, Instant};

use super::{idempotency_key, Agent, AGENT_DIR};
use crate::agent::checkpoint::PendingAction;
use crate::agent::observe::{self, Observation};
use crate::agent::sandbox::SandboxApi;
use crate::agent::tools::Action;
use crate::agent::verify::{self, Level};
use crate::proto::ExecStatus;

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    /// Runs one action. Errors are daemon errors; failures inside the sandbox are observations.
    pub(super) async fn execute(&mut self, p: &PendingAction) -> Result<Observation, crate::Error> {
        let sid = self.ck.sandbox_id.clone();
        let obs = match &p.action {
            Action::Bash {
                command,
                timeout_secs,
                background,
            } => {
                // A command may not outlive the task's time budget either.
                let mut timeout = self.budget.step_timeout(*timeout_secs);
                if let Some(max) = self.budget.limits.max_time {
                    let left =
                        max.saturating_sub(self.budget.elapsed(self.session_start.elapsed()));
                    timeout = timeout.min(left.max(Duration::from_secs(1)));
                }
                let mut req = self.sh_request(command, p.idempotency_key.clone(), timeout);
                req.background = *background;
                // Not `self.exec`: a daemon outage goes through RETRYING, visibly.
                let r = self.sandbox.exec(req).await?;
                // A command that ran into its own time limit says nothing about the tool: the
                // next command may be quick. Only a tool that cannot run commands counts.
                let failed_tool = matches!(
                    ExecStatus::try_from(r.status),
                    Ok(ExecStatus::SpawnFailed | ExecStatus::Lost)
                );
                self.breakers.record("bash", !failed_tool, Instant::now());
                let mut obs = observe::exec(&r, self.opts.observe);
                self.spill(&mut obs, p.step).await;
                obs
            }
            Action::ReadFile {
                path,
                start_line,
                max_lines,
                start_char,
            } => {
                let path = self.abs_path(path);
                match self.sandbox.read_file(&sid, &path, 0, 8 << 20).await {
                    Ok(resp) => {
                        let text = String::from_utf8_lossy(&resp.content);
                        let mut view = observe::file_view(
                            &path,
                            &text,
                            *start_line,
                            *max_lines,
                            *start_char,
                            self.opts.observe,
                        );
                        if !resp.eof {
                            view.push_str("\n(file larger than 8 MiB: only its start was read; use bash with sed -n or tail for the rest)");
                        }
                        Observation::ok(view)
                    }
                    Err(e)
                        if matches!(
                            e.code(),
                            tonic::Code::NotFound
                                | tonic::Code::InvalidArgument
                                | tonic::Code::FailedPrecondition
                        ) && !e.to_string().contains("sandbox") =>
                    {
                        Observation::error(format!(
                            "cannot read {path}: {}",
                            e.status()
                                .map_or_else(|| e.to_string(), |s| s.message().to_owned())
                        ))
                    }
                    Err(e) => return Err(e),
                }
            }
            Action::WriteFile { path, content } => {
                let path = self.abs_path(path);
                let n = self
                    .sandbox
                    .write_file(&sid, &path, content.clone().into_bytes())
                    .await?;
                Observation::ok(format!("wrote {n} bytes to {path}"))
            }
            Action::StrReplace {
                path,
                old_str,
                new_str,
                replace_all,
            } => {
                let path = self.abs_path(path);
                let content = match self.sandbox.read_file(&sid, &path, 0, 8 << 20).await {
                    Ok(r) => String::from_utf8_lossy(&r.content).into_owned(),
                    Err(e)
                        if e.code() == tonic::Code::NotFound
                            && !e.to_string().contains("sandbox") =>
                    {
                        return Ok(Observation::error(format!(
                            "cannot edit {path}: it does not exist (use write_file to create it)"
                        )));
                    }
                    Err(e) => return Err(e),
                };
                let count = if old_str.is_empty() {
                    0
                } else {
                    content.matches(old_str.as_str()).count()
                };
                if count == 0 {
                    Observation::error(format!("str_replace in {path}: old_str was not found; read the file and copy the text exactly (whitespace included)"))
                } else if count > 1 && !replace_all {
                    Observation::error(format!("str_replace in {path}: old_str occurs {count} times; include more surrounding text to make it unique, or set replace_all"))
                } else {
                    let updated = if *replace_all {
                        content.replace(old_str.as_str(), new_str)
                    } else {
                        content.replacen(old_str.as_str(), new_str, 1)
                    };
                    self.sandbox
                        .write_file(&sid, &path, updated.clone().into_bytes())
                        .await?;
                    let at = updated
                        .find(new_str.as_str())
                        .map_or(1, |i| updated[..i].lines().count().max(1));
                    let snippet: String = updated
                        .lines()
                        .enumerate()
                        .skip(at.saturating_sub(3))
                        .take(new_str.lines().count() + 5)
                        .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1))
                        .collect();
                    Observation::ok(format!(
                        "replaced {count} occurrence{} in {path}:\n{snippet}",
                        if count == 1 { "" } else { "s" }
                    ))
                }
            }
            Action::Snapshot { name } => {
                let info = self
                    .sandbox
                    .snapshot(&sid, name.as_deref().unwrap_or(""))
                    .await?;
                let label = name.clone().unwrap_or_else(|| format!("step {}", p.step));
                self.ctx
                    .pin(&format!("snapshot {label}"), &info.snapshot_id);
                Observation::ok(format!(
                    "snapshot {} taken (pinned as \"snapshot {label}\")",
                    info.snapshot_id
                ))
            }
            Action::Rollback { snapshot_id } => {
                match self.sandbox.rollback(&sid, snapshot_id).await {
                    Ok(_) => Observation::ok(format!(
                        "rolled back to {snapshot_id}; processes that were running were stopped"
                    )),
                    Err(e)
                        if e.code() == tonic::Code::NotFound
                            && e.to_string().contains("snapshot") =>
                    {
                        Observation::error(format!("no snapshot {snapshot_id}"))
                    }
                    Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                        Observation::error(format!("cannot roll back: {e}"))
                    }
                    Err(e) => return Err(e),
                }
            }
            Action::Pin { key, value } => match value {
                Some(v) => {
                    self.ctx.pin(key, v);
                    Observation::ok(format!("pinned {key}"))
                }
                None => {
                    self.ctx.unpin(key);
                    Observation::ok(format!("unpinned {key}"))
                }
            },
            Action::Subtask { title, check } => {
                if let Some(previous) = self.ck.subtask_check.clone() {
                    let key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "subtask-check");
                    let r = self
                        .exec(self.sh_request(&previous, key, self.budget.limits.step_time))
                        .await?;
                    let c = verify::judge(Level::Subtask, &previous, &r);
                    if !c.passed {
                        return Ok(Observation::error(c.rejection("starting a new subtask")));
                    }
                    let prev_title = self
                        .ctx
                        .pinned()
                        .get("subtask")
                        .cloned()
                        .unwrap_or_default();
                    self.ctx.pin(
                        &format!("verified: {prev_title}"),
                        &format!("check `{previous}` passed at step {}", p.step),
                    );
                }
                self.ctx.pin("subtask", title);
                self.ck.subtask_check = check.clone();
                Observation::ok(match check {
                    Some(c) => format!("subtask set: {title} (check: `{c}`, run before the next subtask or finish)"),
                    None => format!("subtask set: {title}"),
                })
            }
            Action::Recall { step } => {
                if let Some(e) = self.ctx.find_step(*step) {
                    Observation::ok(format!(
                        "step {step} ({}):\n{}",
                        e.action_line, e.observation
                    ))
                } else if let Some(exec_id) = self.ck.exec_ids.get(step).cloned() {
                    let r = self.sandbox.get_exec(&exec_id, false).await?;
                    let mut obs = observe::exec(&r, self.opts.observe);
                    self.spill(&mut obs, p.step).await;
                    obs.ok = true;
                    obs.text = format!("step {step} (exec {exec_id}):\n{}", obs.text);
                    obs
                } else {
                    Observation::error(format!("step {step} ran no command and its result is no longer held; its summary is all that is left"))
                }
            }
            Action::Finish { .. } => Observation::error("finish is handled by verification"),
        };
        Ok(obs)
    }

    /// Writes streams the observation cut (and the daemon did not spill) into the sandbox so
    /// the model can page them, and fills in the path.
    pub(super) async fn spill(&mut self, obs: &mut Observation, step: u64) {
        for (stream, text) in std::mem::take(&mut obs.to_spill) {
            let path = format!("{AGENT_DIR}/spill/step-{step}.{stream}");
            let shown = match self
                .sandbox
                .write_file(&self.ck.sandbox_id, &path, text.into_bytes())
                .await
            {
                Ok(_) => path,
                Err(e) => format!("(not kept: {e})"),
            };
            observe::fill_spill_path(obs, &stream, &shown);
        }
    }
}
