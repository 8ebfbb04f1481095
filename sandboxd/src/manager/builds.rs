//! Running a build's plan (see `images::steps`): segments through Docker's classic builder,
//! every RUN step in a container sandbox of the caller (the container tier's confinement and
//! the build's network under the egress filter), committed as the next image.
//!
//! Every Docker image a build makes is tagged `sandboxd-build:<build>-<n>`; the tags go when
//! the build ends, whatever its end (the images with them, as nothing else names them). A step
//! whose build is stopped (the client went away, `images.build_timeout_ms`) is destroyed with
//! everything it started.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, ExecSpec, SandboxSpec};
use crate::egress::NetworkPolicy;
use crate::error::Error;
use crate::ids::{ExecId, SandboxId};
use crate::images::engine::{BuildSpec, Engine};
use crate::images::steps::{self, Arg, Plan, RunCommand, Stage, Step};
use crate::images::{build, human, ImageError};
use crate::model::{ExecStatus, Limits, OutputChunk};

/// The Docker repository of a build's intermediate images.
pub const BUILD_REPO: &str = "sandboxd-build";
/// Output of a RUN step kept in its record (its log goes to the client as it comes).
const STEP_OUTPUT_BYTES: u64 = 64 << 10;
/// Longest log line passed on (a step printing megabytes without a newline).
const MAX_LINE: usize = 4096;
/// How long a step's pipes may stay open after its command ended.
const IO_DRAIN: Duration = Duration::from_secs(5);

/// What every step of one build shares.
pub(super) struct StepBuilder<'a> {
    pub engine: &'a Engine,
    pub backend: Arc<dyn Backend>,
    /// The build's id: the suffix of its Docker tags.
    pub id: String,
    /// The client's context (with the segments' Dockerfiles appended as they come).
    pub context: PathBuf,
    /// Where a segment that reads no context gets its own small one.
    pub scratch_dir: PathBuf,
    pub build_args: BTreeMap<String, String>,
    pub tenant: String,
    pub image_name: String,
    pub limits: Limits,
    pub network: NetworkPolicy,
    pub timeout: Duration,
    /// Where the log lines go (a closed channel stops the build).
    pub log: mpsc::Sender<String>,
    /// Every tag made so far, oldest first (shared: a stopped build's are removed too).
    pub tags: Arc<Mutex<Vec<String>>>,
}

/// A build-step sandbox, destroyed if the build stops while it exists.
struct StepSandbox {
    backend: Arc<dyn Backend>,
    id: Option<SandboxId>,
}

impl Drop for StepSandbox {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let backend = self.backend.clone();
            tokio::spawn(async move {
                if let Err(e) = backend.destroy(&id).await {
                    tracing::warn!(sandbox = %id, error = %e, "destroying a stopped build's step");
                }
            });
        }
    }
}

fn failed(message: String) -> Error {
    Error::from(ImageError::BuildFailed(message))
}

impl StepBuilder<'_> {
    async fn say(&self, line: String) -> Result<(), Error> {
        self.log.send(line).await.map_err(|_| Error::from(ImageError::Aborted("the client went away during the build".into())))
    }

    /// The next tag of this build, recorded for removal.
    fn next_tag(&self) -> Result<String, Error> {
        let mut tags = self.tags.lock().map_err(|_| Error::Internal("build tag list poisoned".into()))?;
        let tag = format!("{}-{}", self.id, tags.len() + 1);
        tags.push(format!("{BUILD_REPO}:{tag}"));
        Ok(tag)
    }

    /// Runs the plan; returns the Docker image ID of its last stage.
    pub async fn run(&self, plan: &Plan) -> Result<String, Error> {
        let globals = steps::global_values(&plan.global_args, &self.build_args);
        let runs = plan.stages.iter().flat_map(|s| s.steps.iter()).filter(|s| matches!(s, Step::Run { .. })).count();
        let mut finals: Vec<(Option<String>, Option<String>)> = Vec::new();
        let mut run_no = 0;
        for (index, stage) in plan.stages.iter().enumerate() {
            let lookup = |name: &str| -> Option<String> {
                let i = name.parse::<usize>().ok().or_else(|| finals.iter().position(|(n, _)| n.as_deref() == Some(name)))?;
                finals.get(i).and_then(|(_, image)| image.clone())
            };
            let mut current = self.base(stage, &lookup).await?;
            let mut earlier: Vec<&Arg> = Vec::new();
            let mut pending: Vec<&Step> = Vec::new();
            let mut declared: Vec<&Arg> = Vec::new();
            for step in &stage.steps {
                match step {
                    Step::Arg(a) => {
                        declared.push(a);
                        pending.push(step);
                    }
                    Step::Other { .. } => pending.push(step),
                    Step::Run { line, command } => {
                        current = self.flush(plan, stage, current, &mut earlier, &mut pending, &lookup).await?;
                        let image = current.ok_or_else(|| {
                            failed(format!("line {line}: RUN in a stage that starts FROM scratch and has no files yet: nothing to run it with"))
                        })?;
                        run_no += 1;
                        current = Some(self.run_step(&image, *line, command, &declared, &globals, run_no, runs).await?);
                    }
                }
            }
            current = self.flush(plan, stage, current, &mut earlier, &mut pending, &lookup).await?;
            tracing::debug!(build = %self.id, stage = index, image = ?current, "stage built");
            finals.push((stage.name.clone(), current));
        }
        finals.pop().and_then(|(_, image)| image).ok_or_else(|| failed("the last stage is FROM scratch with nothing in it: there is no image to keep".into()))
    }

    /// The image a stage starts from: a pinned catalog image (refused if it carries ONBUILD
    /// triggers: Docker would run them outside any box), an earlier stage's, or none (scratch).
    async fn base(&self, stage: &Stage, lookup: &(dyn Fn(&str) -> Option<String> + Sync)) -> Result<Option<String>, Error> {
        let base = stage.base.as_str();
        if base.eq_ignore_ascii_case("scratch") {
            return Ok(None);
        }
        if base.starts_with("sha256:") {
            if self.engine.image_config(base).await?.has_onbuild {
                return Err(failed(format!("FROM {base}: the image carries ONBUILD triggers, which would run outside the build's box")));
            }
            return Ok(Some(base.to_string()));
        }
        match lookup(&base.to_ascii_lowercase()) {
            Some(image) => Ok(Some(image)),
            None => Err(failed(format!("FROM {base}: that stage has no image (it is FROM scratch with nothing in it)"))),
        }
    }

    /// Builds what is pending as a segment on `current` (nothing when only ARGs are pending:
    /// they change no image); returns the image after it.
    async fn flush<'p>(
        &self,
        plan: &Plan,
        stage: &Stage,
        current: Option<String>,
        earlier: &mut Vec<&'p Arg>,
        pending: &mut Vec<&'p Step>,
        lookup: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> Result<Option<String>, Error> {
        let changes = pending.iter().any(|s| matches!(s, Step::Other { .. }));
        if changes {
            let base = current.as_deref().unwrap_or("scratch");
            let text = steps::segment(plan, &stage.flags, base, earlier, pending, lookup)?;
            let tag = self.next_tag()?;
            let name = format!(".sandboxd-dockerfile-{tag}");
            // A segment that reads no file of the context is sent a context of its own
            // Dockerfile only: the client's may be large, and is sent once per segment.
            let context = if pending.iter().any(|s| s.reads_context()) {
                let (path, name, text) = (self.context.clone(), name.clone(), text.clone());
                tokio::task::spawn_blocking(move || build::append_to_context(&path, &name, &text))
                    .await
                    .map_err(|e| Error::Internal(format!("writing a segment's Dockerfile: {e}")))??;
                self.context.clone()
            } else {
                let path = self.scratch_dir.join(format!("sandboxd-segment-{tag}.tar"));
                write_small_context(&path, &name, &text).map_err(|e| Error::Internal(format!("writing a segment's context: {e}")))?;
                path
            };
            for step in pending.iter() {
                if let Step::Other { line, text } = step {
                    self.say(format!("line {line}: {text}")).await?;
                }
            }
            let spec = BuildSpec { dockerfile: name, tag: format!("{BUILD_REPO}:{tag}"), build_args: self.build_args.clone().into_iter().collect() };
            let built = self.engine.build(&context, &spec, &self.log).await;
            if context != self.context {
                let _ = std::fs::remove_file(&context);
            }
            built?;
            let image = self.engine.image_id(&spec.tag).await?;
            earlier.extend(pending.drain(..).filter_map(|s| if let Step::Arg(a) = s { Some(a) } else { None }));
            return Ok(Some(image));
        }
        earlier.extend(pending.drain(..).filter_map(|s| if let Step::Arg(a) = s { Some(a) } else { None }));
        Ok(current)
    }

    /// Runs one RUN step on `image` in a container sandbox; returns the committed image.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        &self,
        image: &str,
        line: usize,
        command: &RunCommand,
        declared: &[&Arg],
        globals: &BTreeMap<String, String>,
        n: usize,
        of: usize,
    ) -> Result<String, Error> {
        let config = self.engine.image_config(image).await?;
        let shown = command.display();
        self.say(format!("line {line}: RUN {shown}  (step {n}/{of}, in a container sandbox, network {})", self.network.mode.name())).await?;
        let workdir = if config.workdir.is_empty() { "/".to_string() } else { config.workdir.clone() };
        let id = SandboxId::generate();
        let spec = SandboxSpec {
            id: id.clone(),
            image: format!("build:{}", self.image_name),
            limits: self.limits,
            workdir: workdir.clone(),
            from_snapshot: None,
            tenant: self.tenant.clone(),
            network: self.network.clone(),
        };
        self.backend.create_build_step(&spec, image).await?;
        let mut guard = StepSandbox { backend: self.backend.clone(), id: Some(id.clone()) };
        let exec = ExecSpec {
            exec_id: ExecId::generate(),
            user: (!config.user.is_empty()).then(|| config.user.clone()),
            argv: command.argv(&config.shell),
            env: steps::run_env(&config.env, declared, globals, &self.build_args),
            workdir,
            stdin: Default::default(),
            timeout: self.timeout,
            max_output_bytes: STEP_OUTPUT_BYTES,
            io_drain_timeout: IO_DRAIN,
            input: Default::default(),
            tty: None,
            clock: Default::default(),
        };
        let (sink, chunks) = mpsc::channel::<OutputChunk>(64);
        let forward = tokio::spawn(forward_lines(chunks, self.log.clone()));
        let outcome = self.backend.exec(&id, exec, Some(sink), None, CancellationToken::new()).await;
        let _ = forward.await;
        let outcome = outcome?;
        let what = format!("line {line}: RUN {shown}");
        let refusal = match outcome.status {
            ExecStatus::Exited if outcome.exit_code == 0 => None,
            ExecStatus::Exited => Some(format!("{what} returned a non-zero code: {}", outcome.exit_code)),
            ExecStatus::OomKilled => Some(format!("{what} ran out of memory (images.build_memory_bytes = {})", human(self.limits.memory_bytes))),
            ExecStatus::Signaled => Some(format!("{what} was killed by signal {}", outcome.signal)),
            ExecStatus::TimedOut => Some(format!("{what} ran past the build's time")),
            ExecStatus::SpawnFailed | ExecStatus::Lost | ExecStatus::Running => Some(format!("{what} could not run: {}", outcome.error)),
        };
        if let Some(message) = refusal {
            if let Some(id) = guard.id.take() {
                if let Err(e) = self.backend.destroy(&id).await {
                    tracing::warn!(sandbox = %id, error = %e, "destroying a failed build step");
                }
            }
            return Err(failed(message));
        }
        let tag = self.next_tag()?;
        guard.id = None;
        let committed = self.backend.commit_build_step(&id, image, BUILD_REPO, &tag).await?;
        tracing::debug!(build = %self.id, line, image = %committed, ms = outcome.duration.as_millis() as u64, "build step committed");
        Ok(committed)
    }
}

/// A tar holding only `name` with `text`: the context of a segment that reads no file.
fn write_small_context(path: &Path, name: &str, text: &str) -> std::io::Result<()> {
    let mut builder = tar::Builder::new(std::fs::File::create(path)?);
    let mut header = tar::Header::new_gnu();
    header.set_size(text.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_cksum();
    builder.append_data(&mut header, name, text.as_bytes())?;
    builder.into_inner()?.sync_all()
}

/// Passes a step's output on as log lines, per stream, each at most [`MAX_LINE`] bytes.
async fn forward_lines(mut chunks: mpsc::Receiver<OutputChunk>, log: mpsc::Sender<String>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut alive = true;
    while let Some(chunk) = chunks.recv().await {
        let (buf, bytes) = match &chunk {
            OutputChunk::Stdout(b) => (&mut out, b),
            OutputChunk::Stderr(b) => (&mut err, b),
        };
        buf.extend_from_slice(bytes);
        for line in take_lines(buf) {
            // A client gone stops the build elsewhere; the rest of the output is drained.
            alive = alive && log.send(line).await.is_ok();
        }
    }
    for buf in [out, err] {
        if alive && !buf.is_empty() {
            let _ = log.send(String::from_utf8_lossy(&buf).trim_end().to_string()).await;
        }
    }
}

/// The complete lines at the front of `buf` (and pieces of [`MAX_LINE`] of an overlong one),
/// taken out of it.
fn take_lines(buf: &mut Vec<u8>) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        match buf.iter().position(|b| *b == b'\n') {
            Some(i) if i <= MAX_LINE => {
                let line: Vec<u8> = buf.drain(..=i).collect();
                lines.push(String::from_utf8_lossy(&line).trim_end().to_string());
            }
            _ if buf.len() > MAX_LINE => {
                let piece: Vec<u8> = buf.drain(..MAX_LINE).collect();
                lines.push(String::from_utf8_lossy(&piece).to_string());
            }
            _ => return lines,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_becomes_lines_and_an_overlong_one_is_cut() {
        let mut buf = b"a\nbc\r\nrest".to_vec();
        assert_eq!(take_lines(&mut buf), ["a", "bc"]);
        assert_eq!(buf, b"rest");
        let mut long = vec![b'x'; MAX_LINE * 2 + 10];
        let lines = take_lines(&mut long);
        assert_eq!((lines.len(), lines[0].len(), long.len()), (2, MAX_LINE, 10));
    }
}
