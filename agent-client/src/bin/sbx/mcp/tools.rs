//! The MCP tools: one method per tool, each a few client calls and a text result written for a
//! model. A failure is a tool error (`isError: true`) whose text is the daemon's message, so
//! the model can read it and try again; nothing here ends the server.

use std::collections::HashMap;
use std::sync::Arc;

use agent_client::exec_request;
use agent_client::proto::{CreateSandboxRequest, Isolation, ResourceLimits};
use anyhow::{Context, Result};
use base64::Engine as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler};
use serde::Deserialize;

use super::format;
use super::Session;

/// Largest page `read_file` returns.
const MAX_READ: u64 = 1 << 20;
/// Page `read_file` returns when the call does not say.
const DEFAULT_READ: u64 = 64 << 10;

/// The MCP server's handler: the tools, over one [`Session`].
#[derive(Clone)]
pub struct SandboxTools {
    session: Arc<Session>,
    tool_router: ToolRouter<Self>,
}

/// Isolation tiers, as a model names them.
#[derive(Debug, Clone, Copy, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Linux namespaces, cgroups and seccomp (fastest).
    Process,
    /// A Docker container.
    Container,
    /// A microVM with its own kernel (strongest).
    Microvm,
}

/// Network modes, as a model names them.
#[derive(Debug, Clone, Copy, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// Loopback only (the default).
    None,
    /// Only the destinations in `allow`.
    Allowlist,
    /// Everything but the host, metadata addresses and other sandboxes.
    Open,
}

/// Arguments of create_sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct CreateParams {
    /// Isolation tier; omit for the daemon's default.
    pub isolation: Option<Tier>,
    /// Image name; omit for "minimal" (busybox). "debian" has bash, python3 and git where the daemon has it.
    pub image: Option<String>,
    /// Memory limit in MiB; omit for the daemon's default.
    pub memory_mb: Option<u64>,
    /// CPU limit in CPUs, e.g. 0.5 or 2; omit for the daemon's default.
    pub cpus: Option<f64>,
    /// Maximum number of processes.
    pub max_pids: Option<u32>,
    /// Disk limit in MiB.
    pub disk_mb: Option<u64>,
    /// Default timeout of each command, seconds.
    pub command_timeout_seconds: Option<u64>,
    /// Environment variables of every command.
    pub env: Option<HashMap<String, String>>,
    /// Working directory of every command (default /workspace).
    pub workdir: Option<String>,
    /// Destroy the sandbox after this many seconds.
    pub ttl_seconds: Option<u32>,
    /// Network: none (default), allowlist (only `allow`) or open. The daemon's policy may refuse more.
    pub network: Option<Network>,
    /// With allowlist (implied by giving it): destinations as "host:port", "*.suffix:port" or "10.0.0.0/8:port".
    pub allow: Option<Vec<String>>,
    /// Keep the sandbox after this session ends (default false: destroyed at the end).
    #[serde(default)]
    pub keep: bool,
    /// Make it the sandbox that calls without sandbox_id use (default true).
    pub make_default: Option<bool>,
}

/// Arguments of run_command.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct RunParams {
    /// Sandbox id; omit for the default sandbox (created on first use).
    pub sandbox_id: Option<String>,
    /// Shell command line, run with /bin/sh -c. Give this or argv.
    pub command: Option<String>,
    /// Program and arguments, run without a shell. Give this or command.
    pub argv: Option<Vec<String>>,
    /// Working directory (default: the sandbox's, /workspace).
    pub workdir: Option<String>,
    /// Kill the command after this many seconds (default: the sandbox's timeout).
    pub timeout_seconds: Option<u64>,
    /// Extra environment variables.
    pub env: Option<HashMap<String, String>>,
    /// Text given to the command on stdin (default: empty stdin).
    pub stdin: Option<String>,
}

/// Arguments of read_file.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ReadParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// Path inside the sandbox (relative paths are under /workspace).
    pub path: String,
    /// Byte offset to start at (default 0).
    pub offset: Option<u64>,
    /// Bytes to read (default 65536, at most 1048576).
    pub limit: Option<u64>,
}

/// Arguments of write_file.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct WriteParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// Path inside the sandbox; parent directories are created.
    pub path: String,
    /// The whole new content of the file.
    pub content: String,
    /// True when content is base64 (for binary files).
    #[serde(default)]
    pub base64: bool,
    /// Permission bits in octal, e.g. "755" (default "644").
    pub mode: Option<String>,
}

/// Arguments naming a path in a sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ListDirParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// Directory inside the sandbox (default: the working directory).
    pub path: Option<String>,
}

/// Arguments of snapshot.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct SnapshotParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// A name to remember the snapshot by.
    pub name: Option<String>,
}

/// Arguments of rollback.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct RollbackParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// The snapshot to go back to (from snapshot).
    pub snapshot_id: String,
}

/// Arguments of fork.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ForkParams {
    /// The snapshot the new sandbox starts from.
    pub snapshot_id: String,
    /// Keep the new sandbox after this session ends (default false).
    #[serde(default)]
    pub keep: bool,
    /// Make the new sandbox the default one (default false).
    #[serde(default)]
    pub make_default: bool,
}

/// Arguments of list_execs.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct ListExecsParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// Show the newest this many (default 20).
    pub limit: Option<u32>,
}

/// Arguments of destroy_sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct DestroyParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
}

/// Arguments of upload.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct UploadParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// File on the host, relative to the allowed host directory.
    pub host_path: String,
    /// Where the file goes in the sandbox; parents are created.
    pub sandbox_path: String,
}

/// Arguments of download.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub struct DownloadParams {
    /// Sandbox id; omit for the default sandbox.
    pub sandbox_id: Option<String>,
    /// File in the sandbox.
    pub sandbox_path: String,
    /// Where it goes on the host, relative to the allowed host directory (its directory must exist).
    pub host_path: String,
}

/// A tool's answer: the text on success, the error's chain as a tool error otherwise.
fn reply(result: Result<String>) -> CallToolResult {
    match result {
        Ok(text) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Err(e) => {
            let text = format!("Error: {}", crate::message(&e));
            tracing::debug!(error = %text, "tool call failed");
            CallToolResult::error(vec![ContentBlock::text(text)])
        }
    }
}

fn parse_mode(mode: Option<&str>) -> Result<u32> {
    match mode.map(str::trim).filter(|m| !m.is_empty()) {
        None => Ok(0),
        Some(m) => u32::from_str_radix(m.trim_start_matches("0o"), 8)
            .ok()
            .filter(|v| *v <= 0o7777)
            .with_context(|| {
                format!("mode {m:?} is not octal permission bits like \"644\" or \"755\"")
            }),
    }
}

#[tool_router]
impl SandboxTools {
    /// The tools over `session`; upload and download only when it has a host directory.
    pub fn new(session: Arc<Session>) -> Self {
        let mut tool_router = Self::tool_router();
        if session.host_dir().is_none() {
            tool_router.remove_route("upload");
            tool_router.remove_route("download");
        }
        Self {
            session,
            tool_router,
        }
    }

    #[tool(
        description = "Create a sandbox: an isolated Linux machine to run commands in. Optional: isolation (process|container|microvm), image, memory_mb, cpus, max_pids, disk_mb, command_timeout_seconds, env, workdir, ttl_seconds, network (none|allowlist|open; default none: no network) with allow (destinations such as \"pypi.org:443\"). Limits above the daemon's policy are refused with the reason. Destroyed when this session ends unless keep=true. Becomes the default sandbox unless make_default=false. You do not need this for simple work: the first call without sandbox_id creates a default sandbox."
    )]
    async fn create_sandbox(&self, Parameters(p): Parameters<CreateParams>) -> CallToolResult {
        reply(self.create(p).await)
    }

    #[tool(
        description = "Run a command in a sandbox and wait for it. Give command (a shell line, run with /bin/sh -c) or argv. The result starts with exit_code and status; stdout and stderr follow, each cut to a bounded size with the path of the full output inside the sandbox when longer. A non-zero exit_code means the command failed.",
        annotations(open_world_hint = false)
    )]
    async fn run_command(&self, Parameters(p): Parameters<RunParams>) -> CallToolResult {
        reply(self.run(p).await)
    }

    #[tool(
        description = "Read a file in a sandbox, one page at a time (offset, limit; default 64 KiB). The first line says which bytes of the file's size you got and the offset to read next when there is more. Binary content comes as base64.",
        annotations(read_only_hint = true)
    )]
    async fn read_file(&self, Parameters(p): Parameters<ReadParams>) -> CallToolResult {
        reply(self.read(p).await)
    }

    #[tool(
        description = "Write a whole file in a sandbox (replacing it; parent directories are created). content is text, or base64 with base64=true; mode in octal, e.g. \"755\"."
    )]
    async fn write_file(&self, Parameters(p): Parameters<WriteParams>) -> CallToolResult {
        reply(self.write(p).await)
    }

    #[tool(
        description = "List a directory in a sandbox (ls -la): names, sizes, permissions. Default: the working directory.",
        annotations(read_only_hint = true)
    )]
    async fn list_dir(&self, Parameters(p): Parameters<ListDirParams>) -> CallToolResult {
        reply(self.list_dir_inner(p).await)
    }

    #[tool(
        description = "Snapshot a sandbox's whole filesystem. Returns a snapshot_id for rollback (undo everything since) or fork (a new sandbox starting from it)."
    )]
    async fn snapshot(&self, Parameters(p): Parameters<SnapshotParams>) -> CallToolResult {
        reply(self.snapshot_inner(p).await)
    }

    #[tool(
        description = "Put a sandbox's filesystem back to a snapshot: every file change since is undone. Commands still running in it are ended."
    )]
    async fn rollback(&self, Parameters(p): Parameters<RollbackParams>) -> CallToolResult {
        reply(self.rollback_inner(p).await)
    }

    #[tool(
        description = "Create a new sandbox starting from a snapshot's filesystem (same tier and image as its parent), to try something without touching the original. Destroyed when this session ends unless keep=true."
    )]
    async fn fork(&self, Parameters(p): Parameters<ForkParams>) -> CallToolResult {
        reply(self.fork_inner(p).await)
    }

    #[tool(
        description = "List the commands run in a sandbox, oldest first: exec id, status, exit code, duration, command.",
        annotations(read_only_hint = true)
    )]
    async fn list_execs(&self, Parameters(p): Parameters<ListExecsParams>) -> CallToolResult {
        reply(self.list_execs_inner(p).await)
    }

    #[tool(
        description = "List the sandboxes this session created, and which one is the default.",
        annotations(read_only_hint = true)
    )]
    async fn list_sandboxes(&self) -> CallToolResult {
        reply(self.list_sandboxes_inner().await)
    }

    #[tool(
        description = "Destroy a sandbox now: its processes, files and state are gone. Default: the default sandbox (a new one is created on the next call that needs it).",
        annotations(destructive_hint = true)
    )]
    async fn destroy_sandbox(&self, Parameters(p): Parameters<DestroyParams>) -> CallToolResult {
        reply(self.destroy(p).await)
    }

    #[tool(
        description = "Copy a file from the host's allowed directory into a sandbox. host_path is relative to that directory; paths that lead out of it (.., symlinks) are refused."
    )]
    async fn upload(&self, Parameters(p): Parameters<UploadParams>) -> CallToolResult {
        reply(self.upload_inner(p).await)
    }

    #[tool(
        description = "Copy a file from a sandbox to the host's allowed directory (replacing a file there). host_path is relative to that directory, whose subdirectory must exist; paths that lead out of it are refused."
    )]
    async fn download(&self, Parameters(p): Parameters<DownloadParams>) -> CallToolResult {
        reply(self.download_inner(p).await)
    }
}

impl SandboxTools {
    async fn create(&self, p: CreateParams) -> Result<String> {
        let cpus = match p.cpus {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                anyhow::bail!("cpus must be a positive number, e.g. 0.5 or 2")
            }
            Some(c) => (c * 1000.0).round() as u32,
            None => 0,
        };
        let request = CreateSandboxRequest {
            isolation: p.isolation.map_or(Isolation::Unspecified, |t| match t {
                Tier::Process => Isolation::Process,
                Tier::Container => Isolation::Container,
                Tier::Microvm => Isolation::Microvm,
            }) as i32,
            image: p.image.unwrap_or_default(),
            limits: Some(ResourceLimits {
                cpu_millicores: cpus,
                memory_bytes: p.memory_mb.unwrap_or(0).saturating_mul(1 << 20),
                max_pids: p.max_pids.unwrap_or(0),
                disk_bytes: p.disk_mb.unwrap_or(0).saturating_mul(1 << 20),
                exec_timeout_ms: p.command_timeout_seconds.unwrap_or(0).saturating_mul(1000),
                shm_bytes: 0,
            }),
            env: p.env.unwrap_or_default(),
            workdir: p.workdir.unwrap_or_default(),
            ttl_seconds: p.ttl_seconds.unwrap_or(0),
            network: match (p.network, p.allow) {
                (None, None) => None,
                (mode, allow) => Some(agent_client::proto::NetworkPolicy {
                    mode: match mode.unwrap_or(Network::Allowlist) {
                        Network::None => agent_client::proto::NetworkMode::None,
                        Network::Allowlist => agent_client::proto::NetworkMode::Allowlist,
                        Network::Open => agent_client::proto::NetworkMode::Open,
                    } as i32,
                    allow: allow.unwrap_or_default(),
                }),
            },
            ..Default::default()
        };
        let sandbox = self.session.create(request, p.keep).await?;
        let mut text = format!("Created sandbox {}", format::sandbox_line(&sandbox));
        if p.make_default.unwrap_or(true) {
            self.session.set_default(&sandbox.id).await;
            text.push_str("; it is now the default sandbox");
        }
        text.push_str(if p.keep {
            "; kept after this session."
        } else {
            "; destroyed when this session ends."
        });
        Ok(text)
    }

    async fn run(&self, p: RunParams) -> Result<String> {
        let argv = match (p.command, p.argv) {
            (Some(c), None) if !c.trim().is_empty() => {
                vec!["/bin/sh".to_owned(), "-c".to_owned(), c]
            }
            (None, Some(a)) if !a.is_empty() => a,
            (Some(_), Some(_)) => anyhow::bail!("give command or argv, not both"),
            _ => anyhow::bail!("give command (a shell line) or argv (a non-empty list)"),
        };
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let limit = self.session.output_limit();
        let mut request = exec_request(&id, argv);
        request.env = p.env.unwrap_or_default();
        request.workdir = p.workdir.unwrap_or_default();
        request.timeout_ms = p.timeout_seconds.unwrap_or(0).saturating_mul(1000);
        request.stdin = p.stdin.unwrap_or_default().into_bytes();
        // The daemon keeps the whole stream in a spill file past this bound, and the result
        // names it; the model sees the first `limit` bytes.
        request.max_output_bytes = limit;
        let result = self
            .session
            .client()
            .exec(request)
            .await
            .with_context(|| format!("cannot run the command in sandbox {id}"))?;
        let mut text = format::exec_result(&result, usize::try_from(limit).unwrap_or(usize::MAX));
        if p.sandbox_id.is_none() {
            text.push_str(&format!("(sandbox {id})\n"));
        }
        Ok(text)
    }

    async fn read(&self, p: ReadParams) -> Result<String> {
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let offset = p.offset.unwrap_or(0);
        let limit = p
            .limit
            .filter(|l| *l > 0)
            .unwrap_or(DEFAULT_READ)
            .min(MAX_READ);
        let page = self
            .session
            .client()
            .read_file(&id, &p.path, offset, limit)
            .await
            .with_context(|| format!("cannot read {} in sandbox {id}", p.path))?;
        let (body, taken, kind) = match format::text_prefix(&page.content) {
            Some(text) => (text.to_owned(), text.len() as u64, "text"),
            None => (
                base64::engine::general_purpose::STANDARD.encode(&page.content),
                page.content.len() as u64,
                "binary, base64",
            ),
        };
        let end = offset + taken;
        let more = if page.eof && taken == page.content.len() as u64 {
            "end of file".to_owned()
        } else {
            format!("more: read again with offset={end}")
        };
        Ok(format!(
            "{}: bytes {offset}-{end} of {} ({kind}; {more})\n{body}",
            p.path, page.size
        ))
    }

    async fn write(&self, p: WriteParams) -> Result<String> {
        let mode = parse_mode(p.mode.as_deref())?;
        let content = if p.base64 {
            base64::engine::general_purpose::STANDARD
                .decode(p.content.trim())
                .context("content is not valid base64")?
        } else {
            p.content.into_bytes()
        };
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let n = self
            .session
            .client()
            .write_file(&id, &p.path, content, mode)
            .await
            .with_context(|| format!("cannot write {} in sandbox {id}", p.path))?;
        Ok(format!("Wrote {n} bytes to {} in sandbox {id}.", p.path))
    }

    async fn list_dir_inner(&self, p: ListDirParams) -> Result<String> {
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let path = p
            .path
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| ".".into());
        let mut request = exec_request(&id, ["ls", "-la", "--", path.as_str()]);
        request.max_output_bytes = self.session.output_limit();
        let r = self
            .session
            .client()
            .exec(request)
            .await
            .with_context(|| format!("cannot list {path} in sandbox {id}"))?;
        if r.exit_code != 0 {
            anyhow::bail!(
                "cannot list {path} in sandbox {id}: {}",
                String::from_utf8_lossy(&r.stderr).trim()
            );
        }
        let limit = usize::try_from(self.session.output_limit()).unwrap_or(usize::MAX);
        let mut text = format!("{path} in sandbox {id}:\n");
        text.push_str(&String::from_utf8_lossy(
            &r.stdout[..r.stdout.len().min(limit)],
        ));
        if r.stdout_total_bytes > limit as u64 {
            text.push_str(&format!(
                "[listing cut at {limit} of {} bytes; the whole of it is at {}]\n",
                r.stdout_total_bytes, r.stdout_spill_path
            ));
        }
        Ok(text)
    }

    async fn snapshot_inner(&self, p: SnapshotParams) -> Result<String> {
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let snap = self
            .session
            .client()
            .snapshot(&id, p.name.unwrap_or_default())
            .await
            .with_context(|| format!("cannot snapshot sandbox {id}"))?;
        Ok(format!(
            "Snapshot {} of sandbox {id}{}. Use rollback with this snapshot_id to undo later changes, or fork to start a new sandbox from it.",
            snap.snapshot_id,
            if snap.name.is_empty() { String::new() } else { format!(" (name {:?})", snap.name) }
        ))
    }

    async fn rollback_inner(&self, p: RollbackParams) -> Result<String> {
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        self.session
            .client()
            .rollback(&id, &p.snapshot_id)
            .await
            .with_context(|| format!("cannot roll sandbox {id} back to {}", p.snapshot_id))?;
        Ok(format!(
            "Sandbox {id} is back at snapshot {}: changes made since are gone.",
            p.snapshot_id
        ))
    }

    async fn fork_inner(&self, p: ForkParams) -> Result<String> {
        let request = CreateSandboxRequest {
            from_snapshot_id: p.snapshot_id.clone(),
            ..Default::default()
        };
        let sandbox = self
            .session
            .create(request, p.keep)
            .await
            .with_context(|| format!("cannot fork snapshot {}", p.snapshot_id))?;
        let mut text = format!(
            "Forked snapshot {} into new sandbox {}",
            p.snapshot_id,
            format::sandbox_line(&sandbox)
        );
        if p.make_default {
            self.session.set_default(&sandbox.id).await;
            text.push_str("; it is now the default sandbox");
        } else {
            text.push_str("; pass its sandbox_id to use it");
        }
        text.push_str(if p.keep {
            "; kept after this session."
        } else {
            "; destroyed when this session ends."
        });
        Ok(text)
    }

    async fn list_execs_inner(&self, p: ListExecsParams) -> Result<String> {
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let limit = p.limit.filter(|l| *l > 0).unwrap_or(20);
        let execs = self
            .session
            .client()
            .list_execs(&id, limit)
            .await
            .with_context(|| format!("cannot list the commands of sandbox {id}"))?;
        if execs.is_empty() {
            return Ok(format!("No commands have run in sandbox {id}."));
        }
        let mut text =
            format!("Commands in sandbox {id}, oldest first (newest {limit} at most):\n");
        for e in &execs {
            text.push_str(&format!(
                "{}  {}  exit_code={}  {} ms  {}\n",
                e.exec_id,
                crate::output::exec_status(e.status),
                e.exit_code,
                e.duration_ms,
                crate::output::ellipsize(&e.argv.join(" "), 160)
            ));
        }
        Ok(text)
    }

    async fn list_sandboxes_inner(&self) -> Result<String> {
        let default = self.session.default_id().await;
        let mut selector = HashMap::new();
        selector.insert(
            super::CREATED_BY_LABEL.0.to_owned(),
            super::CREATED_BY_LABEL.1.to_owned(),
        );
        let all = self
            .session
            .client()
            .list(selector)
            .await
            .context("cannot list sandboxes")?;
        let mut text = String::new();
        for s in &all {
            let Some(keep) = self.session.ownership(&s.id) else {
                continue;
            };
            text.push_str(&format!(
                "{}{}{}\n",
                format::sandbox_line(s),
                if keep { ", kept after the session" } else { "" },
                if default.as_deref() == Some(s.id.as_str()) {
                    ", DEFAULT"
                } else {
                    ""
                }
            ));
        }
        if text.is_empty() {
            text.push_str("This session has no sandboxes yet; the first call without sandbox_id creates the default one.");
        }
        Ok(text)
    }

    async fn destroy(&self, p: DestroyParams) -> Result<String> {
        let id = match p
            .sandbox_id
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            Some(id) => id.to_owned(),
            None => self
                .session
                .default_id()
                .await
                .context("there is no default sandbox to destroy; pass sandbox_id")?,
        };
        self.session
            .destroy(&id)
            .await
            .with_context(|| format!("cannot destroy sandbox {id}"))?;
        Ok(format!("Destroyed sandbox {id}."))
    }

    async fn upload_inner(&self, p: UploadParams) -> Result<String> {
        let dir = self
            .session
            .host_dir()
            .context("host file access is off (the operator did not pass --allow-host-dir)")?;
        let file = dir.open_file(&p.host_path)?;
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            file.metadata()
                .map(|m| m.permissions().mode() & 0o7777)
                .unwrap_or(0)
        };
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let done = self
            .session
            .client()
            .upload_file(&id, &p.sandbox_path, mode, tokio::fs::File::from_std(file))
            .await
            .with_context(|| {
                format!(
                    "cannot upload {} to {} in sandbox {id}",
                    p.host_path, p.sandbox_path
                )
            })?;
        Ok(format!(
            "Uploaded {} ({} bytes, sha256 {}) to {} in sandbox {id}.",
            p.host_path, done.bytes, done.sha256, p.sandbox_path
        ))
    }

    async fn download_inner(&self, p: DownloadParams) -> Result<String> {
        let dir = self
            .session
            .host_dir()
            .context("host file access is off (the operator did not pass --allow-host-dir)")?;
        let id = self.session.sandbox(p.sandbox_id.as_deref()).await?;
        let (file, pending) = dir.create_file(&p.host_path)?;
        let done = self
            .session
            .client()
            .download_file(&id, &p.sandbox_path, tokio::fs::File::from_std(file))
            .await
            .with_context(|| format!("cannot download {} from sandbox {id}", p.sandbox_path))?;
        pending
            .commit()
            .with_context(|| format!("cannot put the file in place at {}", p.host_path))?;
        Ok(format!(
            "Downloaded {} from sandbox {id} to {} ({} bytes, sha256 {}).",
            p.sandbox_path,
            dir.root().join(&p.host_path).display(),
            done.bytes,
            done.sha256
        ))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandboxTools {
    fn get_info(&self) -> ServerConfig {
        let mut text = String::from(
            "Sandboxes from sandboxd: isolated Linux machines to run commands and edit files in. \
             Calls without sandbox_id use a default sandbox, created on first use. Snapshot before \
             risky changes; rollback undoes them, fork tries an alternative in a new sandbox. \
             Sandboxes created in this session are destroyed when it ends unless created with keep=true.",
        );
        if let Some(dir) = self.session.host_dir() {
            text.push_str(&format!(
                " upload/download copy files between the sandbox and the host directory {}.",
                dir.root().display()
            ));
        }
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("sbx-mcp", env!("CARGO_PKG_VERSION")))
            .with_instructions(text)
    }
}
