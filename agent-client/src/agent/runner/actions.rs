//! Carrying out one action in the sandbox: the tools behind the model's calls.
//!
//! [`Agent::execute`] returns the daemon's errors tagged with the call that got them
//! ([`OpError`]); what they mean is decided once, in [`crate::agent::classify`], by the loop.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{idempotency_key, Agent, AgentError, AGENT_DIR};
use crate::agent::checkpoint::PendingAction;
use crate::agent::classify::{self, at, Class, Op, OpError};
use crate::agent::observe::{self, Observation};
use crate::agent::sandbox::SandboxApi;
use crate::agent::tools::{self, Action};
use crate::agent::verify::{self, Level};
use crate::proto::{ExecStatus, SandboxState};

/// What one ReadFile returns at most: the daemon's cap (`backend::files::MAX_READ`).
pub(super) const DAEMON_READ_CAP: u64 = 4 << 20;
/// Largest file str_replace edits. It reads the whole file and writes it back in one message
/// (the daemon takes messages up to 64 MiB); a larger file is refused, never cut.
pub(super) const MAX_EDIT_BYTES: u64 = 32 << 20;
/// Longest value the model may pin: pinned facts are in every prompt and survive every
/// summary, so a big one would crowd out everything else.
pub(super) const MAX_PIN_CHARS: usize = 2_000;
/// Longest key the model may pin (or unpin) under: the key is in every prompt with its value,
/// and a refusal must not echo an unbounded key back either.
pub(super) const MAX_PIN_KEY_CHARS: usize = 200;

/// The SHA-256 of `bytes`, hex.
fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Offsets of the non-overlapping occurrences of `needle` in `hay`, at most `limit` of them.
fn find_all(hay: &[u8], needle: &[u8], limit: usize) -> Vec<usize> {
    let mut found = Vec::new();
    if needle.is_empty() {
        return found;
    }
    let mut at = 0;
    while found.len() < limit && at + needle.len() <= hay.len() {
        match hay[at..].windows(needle.len()).position(|w| w == needle) {
            Some(i) => {
                found.push(at + i);
                at += i + needle.len();
            }
            None => break,
        }
    }
    found
}

/// `hay` with the occurrences at `offsets` (of a `len`-byte needle) replaced by `with`.
fn replace_at(hay: &[u8], offsets: &[usize], len: usize, with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + offsets.len() * with.len());
    let mut from = 0;
    for &o in offsets {
        out.extend_from_slice(&hay[from..o]);
        out.extend_from_slice(with);
        from = o + len;
    }
    out.extend_from_slice(&hay[from..]);
    out
}

/// Lines around the first replacement, numbered, for the model to check its edit. Bytes that
/// are not UTF-8 are shown as U+FFFD here only; the file keeps them.
fn snippet(updated: &[u8], first: Option<usize>, new_lines: usize) -> String {
    let at = first.map_or(1, |i| {
        updated[..i].iter().filter(|&&b| b == b'\n').count() + 1
    });
    let from = at.saturating_sub(3);
    String::from_utf8_lossy(updated)
        .lines()
        .enumerate()
        .skip(from)
        .take(new_lines + 5)
        .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1))
        .collect()
}

/// The name a `snapshot` action's snapshot gets: the model's label and the step's key, so a
/// retry or a resume finds the one it made instead of making another.
pub(super) fn snapshot_name(label: &str, key: &str) -> String {
    let label: String = label.chars().take(100).collect();
    format!("{label} [{key}]")
}

impl<S: SandboxApi + Clone + 'static> Agent<S> {
    /// Runs one action. Daemon errors come back tagged with their call; failures inside the
    /// sandbox are observations.
    pub(super) async fn execute(&mut self, p: &PendingAction) -> Result<Observation, OpError> {
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
                let r = self.sandbox.exec(req).await.map_err(at(Op::Exec))?;
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
                let resp = self
                    .sandbox
                    .read_file(&sid, &path, 0, DAEMON_READ_CAP)
                    .await
                    .map_err(at(Op::ReadFile))?;
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
                    view.push_str(&format!(
                        "\n(the file is {} bytes; only its first {} MiB were read: use bash with sed -n or tail for the rest)",
                        resp.size,
                        DAEMON_READ_CAP >> 20
                    ));
                }
                Observation::ok(view)
            }
            Action::WriteFile { path, content } => {
                let path = self.abs_path(path);
                let n = self
                    .sandbox
                    .write_file(&sid, &path, content.clone().into_bytes(), 0)
                    .await
                    .map_err(at(Op::WriteFile))?;
                Observation::ok(format!("wrote {n} bytes to {path}"))
            }
            Action::StrReplace {
                path,
                old_str,
                new_str,
                replace_all,
            } => {
                self.str_replace(p, path, old_str, new_str, *replace_all)
                    .await?
            }
            Action::Snapshot { name } => {
                let label = name.clone().unwrap_or_else(|| format!("step {}", p.step));
                let full = snapshot_name(&label, &p.idempotency_key);
                // Each Snapshot call makes a new one: the one this step may have made already
                // (its reply lost, or the agent stopped) is taken instead of a second.
                let existing = self
                    .sandbox
                    .list_snapshots(&sid)
                    .await
                    .map_err(at(Op::ListSnapshots))?
                    .into_iter()
                    .find(|s| s.name == full);
                let (info, again) = match existing {
                    Some(info) => (info, true),
                    None => (
                        self.sandbox
                            .snapshot(&sid, &full)
                            .await
                            .map_err(at(Op::Snapshot))?,
                        false,
                    ),
                };
                self.ctx
                    .pin(&format!("snapshot {label}"), &info.snapshot_id);
                Observation::ok(format!(
                    "snapshot {} taken{} (pinned as \"snapshot {label}\")",
                    info.snapshot_id,
                    if again {
                        " (found: it had been taken before the interruption)"
                    } else {
                        ""
                    }
                ))
            }
            Action::Rollback { snapshot_id } => {
                self.sandbox
                    .rollback(&sid, snapshot_id)
                    .await
                    .map_err(at(Op::Rollback))?;
                Observation::ok(format!(
                    "rolled back to {snapshot_id}; processes that were running were stopped"
                ))
            }
            Action::Pin { key, .. } if key.chars().count() > MAX_PIN_KEY_CHARS => {
                Observation::error(format!(
                    "pin REFUSED: the key is {} characters ({}); a pin key may have at most {MAX_PIN_KEY_CHARS} (pins are in every prompt). Use a short name as the key and put the fact in the value.",
                    key.chars().count(),
                    observe::cut_chars(key, 40)
                ))
            }
            Action::Pin { key, value } => match value {
                Some(v) if v.chars().count() > MAX_PIN_CHARS => Observation::error(format!(
                    "pin REFUSED: the value is {} characters; a pinned fact may have at most {MAX_PIN_CHARS} (pins are in every prompt). Keep the key fact short, or write the details to a file and pin its path.",
                    v.chars().count()
                )),
                Some(v) => {
                    // A new value for a key frees the old one's room.
                    let had = self.ctx.pinned().get(key).map_or(0, |old| {
                        self.ctx.counter().count(key) + self.ctx.counter().count(old)
                    });
                    let room = self.ctx.pin_room() + had;
                    let adds = self.ctx.counter().count(key) + self.ctx.counter().count(v);
                    if adds > room {
                        Observation::error(format!(
                            "pin REFUSED: pinned facts would take more than their share of the context window ({adds} tokens more, {room} left). Unpin facts you no longer need, or shorten this one."
                        ))
                    } else {
                        self.ctx.pin(key, v);
                        Observation::ok(format!("pinned {key}"))
                    }
                }
                None => {
                    self.ctx.unpin(key);
                    Observation::ok(format!("unpinned {key}"))
                }
            },
            Action::Subtask { title, check } => {
                if let Some(previous) = self.ck.subtask_check.clone() {
                    // Keyed: run again after an interruption, the daemon answers with the
                    // check it ran already.
                    let key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "subtask-check");
                    let r = self
                        .exec(self.sh_request(&previous, key, self.budget.limits.step_time))
                        .await
                        .map_err(at(Op::Exec))?;
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
                    let r = self
                        .sandbox
                        .get_exec(&exec_id, false)
                        .await
                        .map_err(at(Op::GetExec))?;
                    // observe::exec says so when the daemon discarded the output.
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

    /// str_replace as a read-modify-write of the whole file, bytes in and bytes out (a file
    /// that is not UTF-8 keeps every byte). The digest of the result is on disk before the
    /// write goes out, so a retry after a lost reply, or a resume, sees that the write landed
    /// instead of applying it a second time.
    async fn str_replace(
        &mut self,
        p: &PendingAction,
        path: &str,
        old_str: &str,
        new_str: &str,
        replace_all: bool,
    ) -> Result<Observation, OpError> {
        let sid = self.ck.sandbox_id.clone();
        let path = self.abs_path(path);
        let content = match self.read_whole(&sid, &path).await? {
            Ok(c) => c,
            Err(too_big) => return Ok(too_big),
        };
        if p.expect_sha256.as_deref() == Some(sha256_hex(&content).as_str()) {
            let first = find_all(&content, new_str.as_bytes(), 1).first().copied();
            return Ok(Observation::ok(format!(
                "replaced in {path} (the write had landed before its reply was lost; it was not applied again):\n{}",
                snippet(&content, first, new_str.lines().count())
            )));
        }
        let offsets = find_all(&content, old_str.as_bytes(), usize::MAX);
        let count = offsets.len();
        if count == 0 {
            return Ok(Observation::error(format!("str_replace in {path}: old_str was not found; read the file and copy the text exactly (whitespace included)")));
        }
        if count > 1 && !replace_all {
            return Ok(Observation::error(format!("str_replace in {path}: old_str occurs {count} times; include more surrounding text to make it unique, or set replace_all")));
        }
        let updated = replace_at(&content, &offsets, old_str.len(), new_str.as_bytes());
        let mode = match self.file_mode(p, &path).await? {
            Ok(mode) => mode,
            Err(unknown) => return Ok(unknown),
        };
        let expect = sha256_hex(&updated);
        if let Some(pending) = self.ck.pending.as_mut() {
            pending.expect_sha256 = Some(expect);
        }
        // A checkpoint that cannot be written means the run cannot keep its promises: the
        // write is not sent (the loop stops on the next durable write anyway).
        if let Err(e) = self.writer.write_now(self.checkpoint()).await {
            return Ok(Observation::error(format!(
                "str_replace in {path} NOT done: the run's checkpoint cannot be written ({e})"
            )));
        }
        let first = offsets.first().copied();
        self.sandbox
            .write_file(&sid, &path, updated.clone(), mode)
            .await
            .map_err(at(Op::WriteFile))?;
        Ok(Observation::ok(format!(
            "replaced {count} occurrence{} in {path}:\n{}",
            if count == 1 { "" } else { "s" },
            snippet(&updated, first, new_str.lines().count())
        )))
    }

    /// The permission bits of `path`, for a rewrite to keep them: WriteFile replaces the file
    /// with the mode it is given (0644 when none), so an executable script would lose its
    /// exec bit. ReadFile does not report the mode, so the sandbox's `stat` is asked (`-L`:
    /// of the file a link leads to, as ReadFile reads it), keyed like the step. A mode that
    /// cannot be learned, or that WriteFile cannot express (0), means the edit is not made:
    /// never a silent chmod.
    async fn file_mode(
        &mut self,
        p: &PendingAction,
        path: &str,
    ) -> Result<Result<u32, Observation>, OpError> {
        let command = format!("stat -L -c %a -- {}", tools::shell_quote(path));
        let key = idempotency_key(&self.ck.run_id, p.step, p.attempt, "mode");
        let r = self
            .exec(self.sh_request(&command, key, self.budget.limits.step_time))
            .await
            .map_err(at(Op::Exec))?;
        let out = String::from_utf8_lossy(&r.stdout);
        let mode = (r.status == ExecStatus::Exited as i32 && r.exit_code == 0)
            .then(|| u32::from_str_radix(out.trim(), 8).ok())
            .flatten()
            .filter(|m| (1..=0o7777).contains(m));
        Ok(mode.ok_or_else(|| {
            let said = format!("{}{}", out.trim(), String::from_utf8_lossy(&r.stderr).trim());
            tracing::warn!(path, exit_code = r.exit_code, said = %said, "cannot learn a file's mode for str_replace");
            Observation::error(format!(
                "str_replace in {path} NOT done: its permissions could not be learned to keep them (`{command}` exited {}: {}). Make the edit with bash (sed -i keeps the mode).",
                r.exit_code,
                observe::cut_chars(&said, 200)
            ))
        }))
    }

    /// The whole file, read in the daemon's 4 MiB pieces; a file over [`MAX_EDIT_BYTES`] is
    /// refused with an observation saying so (never edited from its first part).
    async fn read_whole(
        &mut self,
        sid: &str,
        path: &str,
    ) -> Result<Result<Vec<u8>, Observation>, OpError> {
        let refuse = |size: u64| {
            Observation::error(format!(
                "str_replace REFUSED: {path} is {size} bytes; str_replace edits files of at most {} MiB. Use bash (sed -i, or a script) for a file this large.",
                MAX_EDIT_BYTES >> 20
            ))
        };
        let mut content = Vec::new();
        loop {
            let r = self
                .sandbox
                .read_file(sid, path, content.len() as u64, DAEMON_READ_CAP)
                .await
                .map_err(at(Op::ReadFile))?;
            if r.size > MAX_EDIT_BYTES {
                return Ok(Err(refuse(r.size)));
            }
            let got = r.content.len();
            content.extend_from_slice(&r.content);
            if content.len() as u64 > MAX_EDIT_BYTES {
                return Ok(Err(refuse(content.len() as u64)));
            }
            if r.eof {
                return Ok(Ok(content));
            }
            if got == 0 {
                // Not at its end and nothing more: the file shrank while it was read. Edit
                // nothing rather than a mix of two versions.
                return Ok(Err(Observation::error(format!(
                    "str_replace in {path} NOT done: the file changed while it was read; try again"
                ))));
            }
        }
    }

    /// What the model is told when the daemon refused a call of its action (a cap, a bad
    /// argument, a missing file or snapshot): the daemon's code and words, and what to do.
    pub(super) fn refusal(&self, action: &Action, e: &OpError) -> Observation {
        let code = crate::code_name(e.source.code());
        let message = classify::message(&e.source);
        let hint = match (action, e.op, e.class()) {
            (Action::StrReplace { .. }, Op::ReadFile, Class::TargetMissing) => {
                " The file does not exist: use write_file to create it."
            }
            (_, _, Class::TargetMissing) => " It does not exist; check the name.",
            (_, _, _) if e.source.code() == tonic::Code::ResourceExhausted => {
                " This is a limit of the sandbox or the daemon's policy, not an outage: free what it names (wait for or stop background jobs, remove files) or do without."
            }
            _ => "",
        };
        Observation::error(format!(
            "ERROR from the sandbox daemon ({} for {}): {code}: {message}.{hint}",
            e.op.name(),
            action.tool()
        ))
    }

    /// Whether the run's sandbox is there and running: tells a missing file, exec or snapshot
    /// from a missing sandbox without reading the daemon's words.
    pub(super) async fn sandbox_alive(&self) -> Result<bool, OpError> {
        match self.sandbox.get(&self.ck.sandbox_id).await {
            Ok(sb) => Ok(sb.state == SandboxState::Running as i32),
            Err(e) if classify::classify(Op::GetSandbox, &e) == Class::SandboxGone => Ok(false),
            Err(e) => Err(OpError::new(Op::GetSandbox, e)),
        }
    }

    /// The fatal error for a sandbox that is gone.
    pub(super) fn sandbox_gone(&self, e: OpError) -> AgentError {
        AgentError::Daemon {
            what: format!("sandbox {} is gone ({})", self.ck.sandbox_id, e.op.name()),
            source: e.source,
        }
    }

    /// Writes streams the observation cut (and the daemon did not spill) into the sandbox so
    /// the model can page them, and fills in the path.
    pub(super) async fn spill(&mut self, obs: &mut Observation, step: u64) {
        for (stream, text) in std::mem::take(&mut obs.to_spill) {
            let path = format!("{AGENT_DIR}/spill/step-{step}.{stream}");
            let shown = match self
                .sandbox
                .write_file(&self.ck.sandbox_id, &path, text.into_bytes(), 0)
                .await
            {
                Ok(_) => path,
                Err(e) => format!("(not kept: {e})"),
            };
            observe::fill_spill_path(obs, &stream, &shown);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_replacement_keeps_bytes_that_are_not_utf8() {
        let latin1 = b"caf\xe9 x = 1\nna\xefve x = 1\n";
        let at = find_all(latin1, b"x = 1", usize::MAX);
        assert_eq!(at.len(), 2);
        let out = replace_at(latin1, &at, 5, b"x = 2");
        assert_eq!(out, b"caf\xe9 x = 2\nna\xefve x = 2\n");
        // Non-overlapping, left to right, as str::replace.
        assert_eq!(find_all(b"aaaa", b"aa", usize::MAX), vec![0, 2]);
        assert_eq!(find_all(b"abc", b"", usize::MAX), Vec::<usize>::new());
    }

    #[test]
    fn snapshot_names_carry_the_key_and_stay_short() {
        let n = snapshot_name(&"x".repeat(500), "run-1:3:act:0");
        assert!(n.ends_with(" [run-1:3:act:0]"));
        assert!(n.len() <= 256);
    }
}
