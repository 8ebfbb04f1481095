//! The command line, as clap derive types.

use agent_client::proto::{
    CreateSandboxRequest, Isolation, NetworkMode, NetworkPolicy, OnExpiry, ResourceLimits,
};
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::parse::{parse_cpus, parse_kv, parse_signal, parse_size};

/// Command line for sandboxd: create sandboxes, run commands in them, copy files, snapshot.
#[derive(Debug, Parser)]
#[command(name = "sbx", version, propagate_version = true)]
pub struct Cli {
    /// Daemon address: unix:///path.sock, /path.sock, tcp://host:port, http://host:port or https://host:port (TLS; a private CA in $SBX_CA_CERT)
    /// [default: ./.sandboxd/sandboxd.sock if it exists (make run), else /run/sandboxd/sandboxd.sock]
    #[arg(long, global = true, help_heading = "Global options", env = agent_client::SOCKET_ENV, value_name = "ADDR")]
    pub socket: Option<String>,

    /// Bearer token sent with every call.
    #[arg(long, global = true, help_heading = "Global options", env = agent_client::TOKEN_ENV, hide_env_values = true, value_name = "TOKEN")]
    pub token: Option<String>,

    /// Machine output: one JSON object or array on stdout.
    #[arg(long, global = true, help_heading = "Global options")]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// Run a command in a sandbox, streaming its output; exits with the command's code.
    ///
    /// Without -i the command's stdin is empty (or, with --stdin, all of sbx's stdin, read
    /// first). With -i sbx's stdin is streamed to the command as it arrives and closed at its
    /// end; signals sent to sbx (INT, TERM, HUP, QUIT) are passed to the command, and a third
    /// one ends sbx at once (the daemon then ends the command). With -t (which implies -i)
    /// the command runs on a terminal: the local one is put in raw mode, so every key, Ctrl-C
    /// included, goes to the remote terminal, whose size follows the local window; stdout and
    /// stderr arrive as one stream. -t needs stdin to be a terminal. With --json (not with
    /// -t) the output is gathered into the printed result, up to --max-output per stream.
    Exec(ExecArgs),
    /// List sandboxes.
    #[command(visible_alias = "list")]
    Ls {
        /// Only sandboxes with this label (all given labels must match).
        #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_kv)]
        labels: Vec<(String, String)>,
    },
    /// Show a sandbox.
    Get {
        /// Sandbox id.
        id: String,
    },
    /// A sandbox's network: `sbx net log ID` shows its recent DNS queries and connections.
    Net {
        #[command(subcommand)]
        command: NetCommand,
    },
    /// Give a sandbox a new lifetime from now (reaped SECS later; 0 = never).
    Ttl {
        /// Sandbox id.
        id: String,
        /// Seconds from now; 0 removes the TTL.
        secs: u32,
    },
    /// Pause a sandbox: every process frozen in place (memory kept, no CPU, TTL stopped).
    Pause {
        /// Sandbox id.
        id: String,
    },
    /// Resume a paused sandbox where it stopped.
    Resume {
        /// Sandbox id.
        id: String,
        /// A new TTL from now [default: what was left of it at the pause].
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        ttl: u32,
    },
    /// Destroy sandboxes.
    #[command(visible_alias = "destroy")]
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// List a sandbox's execs, oldest first: every page, without their output (`sbx wait EXEC`
    /// prints one exec's output).
    Execs {
        /// Sandbox id.
        id: String,
        /// Show at most this many (0 = all).
        #[arg(long, default_value_t = 0)]
        limit: u32,
    },
    /// Copy a file or (with -r) a directory into or out of a sandbox.
    ///
    /// Files of any size are streamed in 1 MiB pieces and checked end to end by SHA-256: an
    /// upload replaces the file in the sandbox only once all of it has arrived intact, a
    /// download is written to a temp file beside the target and renamed at the end, so an
    /// interrupted copy leaves neither a half file nor a damaged old one. A destination ending
    /// in `/` (or a local directory) receives the file under its own name. `-` is stdin or
    /// stdout. With --json: the path, bytes and sha256.
    ///
    /// With -r, SRC is a directory sent as a tar stream built on the fly: symlinks stay
    /// symlinks, modes and mtimes are kept, sockets, fifos and devices are left out. DST is the
    /// directory that receives SRC's contents (created if missing, merged into if it exists);
    /// a DST ending in `/`, `.` or `..` receives them in a directory named after SRC. A
    /// download is extracted refusing what a hostile sandbox could use to write outside DST
    /// (absolute paths, `..`, paths through symlinks, device nodes, hard links to files the
    /// archive did not write); into a new DST it is extracted beside it and renamed at the end.
    ///
    /// Examples: `sbx cp ./a ID:/workspace/a`, `sbx cp ID:/log -`,
    /// `sbx cp -r ./src ID:/workspace/src`, `sbx cp -r ID:/workspace/out ./out`.
    Cp {
        /// Copy a directory (as a tar stream).
        #[arg(long, short = 'r')]
        recursive: bool,
        /// Source: ID:/path, a local path, or - for stdin.
        src: String,
        /// Destination: ID:/path, a local path, or - for stdout.
        dst: String,
    },
    /// Open an interactive shell in a sandbox, on a terminal (`exec -it` of its shell).
    ///
    /// Runs bash when the sandbox has it, else sh, in the sandbox's working directory. The
    /// local terminal is in raw mode until the shell exits: every key, Ctrl-C and Ctrl-D
    /// included, goes to the shell, and the window size follows the local one. Exits with the
    /// shell's exit code. Like every exec it is bound by the sandbox's exec timeout unless
    /// --timeout-ms asks for another (up to the daemon's ceiling).
    Shell(ShellArgs),
    /// Snapshot a sandbox's filesystem (a microVM's memory too) and print the snapshot id.
    Snapshot {
        /// Sandbox id.
        id: String,
        /// A name for the snapshot.
        #[arg(long)]
        name: Option<String>,
        /// Leave a microVM's memory out: a rollback or fork of the snapshot boots over its disk.
        #[arg(long)]
        no_memory: bool,
    },
    /// List a sandbox's snapshots.
    Snapshots {
        /// Sandbox id.
        id: String,
    },
    /// Put a sandbox's filesystem back to a snapshot (running execs end as LOST).
    Rollback {
        /// Sandbox id.
        id: String,
        /// Snapshot id.
        snapshot: String,
    },
    /// Create a sandbox from a snapshot and print its id. The fork runs on the snapshot's tier
    /// and image, and inherits its parent's limits, environment, labels and workdir; options
    /// given here override them (environment and labels key by key).
    #[command(
        mut_arg("image", |a| a.help("Image: must be the snapshot's (the default)")),
        mut_arg("isolation", |a| a.help("Isolation tier: must be the snapshot's (the default)")),
        mut_arg("memory", |a| a.help("Memory limit, e.g. 512M or 1G [default: the parent's]")),
        mut_arg("cpus", |a| a.help("CPU limit in CPUs, e.g. 0.5 [default: the parent's]")),
        mut_arg("cpu_millicores", |a| a.help("CPU limit in thousandths of a CPU [default: the parent's]")),
        mut_arg("pids", |a| a.help("Maximum number of processes [default: the parent's]")),
        mut_arg("disk", |a| a.help("Disk limit, e.g. 1G [default: the parent's]")),
        mut_arg("shm", |a| a.help("Size of /dev/shm, e.g. 256M [default: the parent's; half of the memory limit if it had none]")),
        mut_arg("timeout_ms", |a| a.help("Default timeout of each exec, in milliseconds [default: the parent's]")),
        mut_arg("env", |a| a.help("Environment of every exec, added to the parent's (repeatable)")),
        mut_arg("labels", |a| a.help("Label, added to the parent's (repeatable)")),
        mut_arg("workdir", |a| a.help("Working directory of every exec [default: the parent's]")),
        mut_arg("user", |a| a.help("Who every exec runs as: name, uid, name:group or uid:gid [default: the parent's]"))
    )]
    Fork {
        /// Snapshot id.
        snapshot: String,
        #[command(flatten)]
        spec: SandboxSpec,
    },
    /// Delete a snapshot.
    Rmsnap {
        /// Snapshot id.
        snapshot: String,
    },
    /// Wait for an exec to end, print its output and exit with its code.
    Wait {
        /// Exec id.
        exec_id: String,
    },
    /// Drive an AI agent in a sandbox: `sbx agent run --task TEXT`, `resume RUN_ID`, `show RUN_ID`.
    #[command(subcommand)]
    Agent(AgentCommand),
    /// Images: `sbx image ls`, `rm NAME`, `get NAME`, `import SRC`, `build -t NAME DIR`.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Serve the Model Context Protocol on stdin/stdout (or, with --http, on a loopback port),
    /// so an agent such as Claude Code, Codex CLI or Goose can use sandboxes as tools.
    ///
    /// Tools: create_sandbox, run_command, read_file, write_file, list_dir, snapshot, rollback,
    /// fork, list_execs, list_sandboxes, destroy_sandbox; upload and download only with
    /// --allow-host-dir. A default sandbox (shaped by the options below) is created on the
    /// first call that needs one. Every sandbox the session created is destroyed when the
    /// session ends (stdin closed, SIGTERM or SIGINT), except those created with keep=true.
    /// Logs go to stderr (SBX_LOG, default: warn).
    Mcp(McpArgs),
    /// Send a signal to an exec's process tree.
    Kill {
        /// Exec id.
        exec_id: String,
        /// TERM, KILL, INT, … or a number.
        #[arg(long, short, default_value = "TERM", value_parser = parse_signal)]
        signal: i32,
    },
}

/// `sbx image …`.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// List the daemon's images: NAME DIGEST SIZE CREATED TIERS (the tiers that can run it).
    #[command(visible_alias = "list")]
    Ls,
    /// Show one image: digest, size, source, ready tiers, env, workdir, user, entrypoint, cmd.
    #[command(visible_alias = "inspect")]
    Get {
        /// Image name.
        name: String,
    },
    /// Remove an imported image (refused while a sandbox or snapshot uses it, and for the
    /// operator's script-built images).
    #[command(visible_alias = "remove")]
    Rm {
        /// Image name.
        name: String,
    },
    /// Import an image: `docker:NAME[:TAG]` from the daemon host's Docker Engine (nothing is
    /// pulled), or a local `docker save` / OCI image-layout tar, streamed to the daemon.
    /// Progress goes to stderr; the image's name to stdout.
    Import {
        /// `docker:REFERENCE` or the path of a .tar file.
        source: String,
        /// The image's name [default: the archive's RepoTags or ref-name annotation, the
        /// reference's repository, or the file name's stem].
        #[arg(long)]
        name: Option<String>,
    },
    /// Build an image from a directory with a Dockerfile on the daemon host's Docker Engine
    /// (`FROM sandboxd/<name>` starts from a sandboxd image; RUN steps have no network unless
    /// the daemon allows it), then import it. The build log and progress go to stderr.
    Build {
        /// The image's name.
        #[arg(short = 't', long = "tag", value_name = "NAME")]
        name: String,
        /// The Dockerfile, relative to DIR.
        #[arg(
            short = 'f',
            long = "file",
            value_name = "PATH",
            default_value = "Dockerfile"
        )]
        dockerfile: String,
        /// A build argument, K=V (repeatable).
        #[arg(long = "build-arg", value_name = "K=V", value_parser = parse_kv)]
        build_args: Vec<(String, String)>,
        /// Network of the RUN steps, under the daemon's policy (it must give builds one:
        /// `[images] build_network = "policy"`); unset = the policy's default, else none.
        #[arg(long, value_enum)]
        network: Option<NetworkArg>,
        /// What RUN steps may reach (repeatable, implies --network allowlist): NAME:PORT, '*.SUFFIX:PORT', A.B.C.D:PORT, A.B.C.D/NN:PORT.
        #[arg(long = "allow", value_name = "DEST:PORT")]
        allow: Vec<String>,
        /// The build context (its .dockerignore is honoured).
        dir: PathBuf,
    },
}

/// `sbx agent …`.
#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Run the agent on a task in a new sandbox until it is done, stopped or fails.
    ///
    /// The model endpoint is OPENAI_BASE_URL, any OpenAI-compatible server (llama.cpp's
    /// llama-server: http://127.0.0.1:8080/v1, Ollama: http://127.0.0.1:11434/v1, `sbx agent
    /// demo-model`: http://127.0.0.1:8089/v1), with the key in OPENAI_API_KEY if it needs one;
    /// OpenAI's API when only OPENAI_API_KEY is set. With neither, or when nothing answers at
    /// the endpoint, sbx stops at once, before making a sandbox. Exit code 0 only when the run
    /// is done; 3 when a budget, the step limit or no progress stopped it; 1 when it failed.
    Run(Box<AgentRunArgs>),
    /// Serve a scripted stand-in for a model on an OpenAI-compatible endpoint, to see the loop
    /// work without one: it looks around the sandbox, writes a file, checks it and finishes.
    ///
    /// Runs until interrupted; in another terminal:
    /// `OPENAI_BASE_URL=http://127.0.0.1:8089/v1 sbx agent run --task "try the demo"`.
    DemoModel {
        /// Address to listen on (port 0: any free port, printed).
        #[arg(long, default_value = "127.0.0.1:8089", value_name = "ADDR")]
        listen: std::net::SocketAddr,
    },
    /// Continue an interrupted run from its checkpoint, without repeating side effects.
    Resume {
        /// The run id.
        run_id: String,
        /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
        #[command(flatten)]
        tuning: LoopTuning,
        /// New step budget (total): continues a run the step limit, a budget or the
        /// no-progress detector stopped.
        #[arg(long, value_name = "N")]
        max_steps: Option<u64>,
        /// New token budget (total), as --max-steps.
        #[arg(long, value_name = "N")]
        max_tokens: Option<u64>,
        /// New wall-time budget (total), seconds, as --max-steps.
        #[arg(long, value_name = "SECS")]
        max_time: Option<u64>,
        /// New cost budget (total), USD, as --max-steps.
        #[arg(long, value_name = "USD")]
        max_cost: Option<f64>,
    },
    /// Print a run's timeline with token and budget use (from the trace alone when the
    /// checkpoint is damaged).
    Show {
        /// The run id.
        run_id: String,
        /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
        /// Keep printing the timeline as the run goes, until it stops (with --json: one
        /// trace event per line).
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Send a correction to a run: the loop puts it into the model's next prompt, pinned
    /// until the model answers it with a tool call.
    ///
    /// Taken at the run's next step boundary (before its next model turn); a run that is not
    /// running takes it when `sbx agent resume` continues it. Prints the request id.
    Steer {
        /// The run id.
        run_id: String,
        /// The correction, at most 4000 bytes.
        message: String,
        /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
    /// End a run at its next step boundary, as DONE or FAILED, with the final snapshot, diff
    /// and summary every end gets.
    ///
    /// A running or retrying run stops at its next boundary; one that is not running stops
    /// when `sbx agent resume` continues it. Prints the request id.
    Stop {
        /// The run id.
        run_id: String,
        /// End it as DONE.
        #[arg(long, conflicts_with = "failed")]
        done: bool,
        /// End it as FAILED (the default).
        #[arg(long)]
        failed: bool,
        /// Why, kept in the run's outcome and trace (at most 1000 bytes).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
    /// List the runs with their status, steps and sandbox.
    Ls {
        /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
}

/// `sbx agent run`.
#[derive(Debug, Args)]
pub struct AgentRunArgs {
    /// What the agent should do.
    #[arg(long, value_name = "TEXT")]
    pub task: String,
    /// Id of the run [default: generated].
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Model name, as the endpoint knows it.
    #[arg(
        long,
        env = "OPENAI_MODEL",
        default_value = "gpt-4o-mini",
        value_name = "NAME"
    )]
    pub model: String,
    /// Isolation tier of the sandbox [default: the daemon's policy].
    #[arg(long, value_enum)]
    pub isolation: Option<IsolationArg>,
    /// Image of the sandbox [default: minimal].
    #[arg(long, value_name = "NAME")]
    pub image: Option<String>,
    /// Shell command that must pass (exit 0) before `finish` is accepted, e.g. "make test".
    #[arg(long, value_name = "CMD")]
    pub verify: Option<String>,
    /// Step budget.
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub max_steps: u64,
    /// The model's context window in tokens [default: known for gpt-* models, else 32768].
    #[arg(long, value_name = "TOKENS")]
    pub context_window: Option<usize>,
    /// Where runs are kept [env: SBX_AGENT_STATE_DIR; default: ./.sandboxd/agent].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Token budget of the task (prompt + completion).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u64>,
    /// Cost budget of the task, USD (needs a known model price or --price).
    #[arg(long, value_name = "USD")]
    pub max_cost: Option<f64>,
    /// Wall-time budget of the task, seconds.
    #[arg(long, value_name = "SECS")]
    pub max_time: Option<u64>,
    /// Price per million prompt and completion tokens, USD: IN,OUT.
    #[arg(long, value_name = "IN,OUT")]
    pub price: Option<String>,
    /// Wall-time budget of one step (its command's timeout), seconds.
    #[arg(long, default_value_t = 300, value_name = "SECS")]
    pub step_timeout: u64,
    /// Completion tokens one model call may produce.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub max_completion_tokens: u32,
    /// Results of steps older than this many are folded to one line.
    #[arg(long, value_name = "N")]
    pub fold_after: Option<usize>,
    /// Model calls per second (token-bucket rate limit).
    #[arg(long, value_name = "N")]
    pub llm_rate: Option<f64>,
    /// Keep the full history in every prompt (no folding, no summaries): for comparisons.
    #[arg(long, hide = true)]
    pub no_context_management: bool,
    #[command(flatten)]
    pub tuning: LoopTuning,
}

/// Knobs of the loop that are not part of the run (given again on `resume`).
#[derive(Debug, Args, Default)]
pub struct LoopTuning {
    /// The same action with the same result this many times in a row, with no progress
    /// signal, stops the run as no_progress [default: 4].
    #[arg(long, value_name = "N")]
    pub stuck_after: Option<usize>,
    /// Like --stuck-after for actions that wait explicitly (sleep, wait) [default: 12].
    #[arg(long, value_name = "N")]
    pub stuck_after_waiting: Option<usize>,
    /// Two actions alternating this many times with the same results stop the run [default: 3].
    #[arg(long, value_name = "N")]
    pub stuck_alternations: Option<usize>,
    /// How long a model endpoint outage is waited out (backoff, Retry-After) before the run
    /// stops as fatal_error, seconds [default: 600].
    #[arg(long, value_name = "SECS")]
    pub llm_patience: Option<u64>,
    /// Keep the run's sandbox this long once the run has ended, then remove it (at the next
    /// `sbx agent run` or `resume`; the snapshots stay, so a resume forks a new one), seconds
    /// [default for a new run: 86400].
    #[arg(long, value_name = "SECS")]
    pub keep_sandbox: Option<u64>,
}

/// `sbx mcp`.
#[derive(Debug, Args)]
pub struct McpArgs {
    /// Let the model copy files between this host directory and its sandboxes (the upload and
    /// download tools). Paths resolve inside it; `..` and symlinks never lead out. Without it
    /// the model has no access to host files.
    #[arg(long, value_name = "DIR")]
    pub allow_host_dir: Option<PathBuf>,
    /// Serve streamable HTTP on this loopback address (e.g. 127.0.0.1:8765, path /mcp) instead
    /// of stdio. Every request must carry `Authorization: Bearer TOKEN`: SBX_MCP_TOKEN, or a
    /// token sbx generates and prints on stderr. All clients share one session, which ends
    /// when sbx stops.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
    /// Output of run_command shown to the model per stream; the rest is kept in a file inside
    /// the sandbox whose path the result names.
    #[arg(long, default_value = "16K", value_name = "SIZE", value_parser = parse_size)]
    pub output_limit: u64,
    /// The default sandbox, created on first use.
    #[command(
        flatten,
        next_help_heading = "The default sandbox (created on first use)"
    )]
    pub spec: SandboxSpec,
}

/// `sbx create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub spec: SandboxSpec,
    /// Start from this snapshot's filesystem instead of the image (like `sbx fork`).
    #[arg(long, value_name = "SNAP")]
    pub from_snapshot: Option<String>,
}

/// What a new sandbox looks like; shared by `create` and `fork`.
#[derive(Debug, Args)]
pub struct SandboxSpec {
    /// Isolation tier [default: the daemon's policy].
    #[arg(long, value_enum)]
    pub isolation: Option<IsolationArg>,
    /// Image name [default: minimal].
    #[arg(long)]
    pub image: Option<String>,
    /// Memory limit, e.g. 512M or 1G.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub memory: Option<u64>,
    /// CPU limit in CPUs, e.g. 0.5.
    #[arg(long, value_name = "N", value_parser = parse_cpus, conflicts_with = "cpu_millicores")]
    pub cpus: Option<u32>,
    /// CPU limit in thousandths of a CPU.
    #[arg(long, value_name = "N")]
    pub cpu_millicores: Option<u32>,
    /// Maximum number of processes.
    #[arg(long, value_name = "N")]
    pub pids: Option<u32>,
    /// Disk limit, e.g. 1G.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub disk: Option<u64>,
    /// Size of /dev/shm, e.g. 256M [default: half of the memory limit; at most the memory limit].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub shm: Option<u64>,
    /// Default timeout of each exec, in milliseconds.
    #[arg(long, value_name = "MS")]
    pub timeout_ms: Option<u64>,
    /// Environment of every exec (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Label (repeatable).
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Working directory of every exec [default: /workspace].
    #[arg(long, value_name = "PATH")]
    pub workdir: Option<String>,
    /// Destroy the sandbox after this many seconds (or pause it: --on-expiry pause).
    #[arg(long, value_name = "SECS")]
    pub ttl: Option<u32>,
    /// What the TTL's passing does: destroy the sandbox, or pause it (resume with `sbx resume`).
    #[arg(long, value_enum, value_name = "ACTION")]
    pub on_expiry: Option<OnExpiryArg>,
    /// Who every exec runs as: name, uid, name:group or uid:gid [default: the image's USER, else root].
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// Network mode [default: none (loopback only); a fork: its parent's; with --allow: allowlist].
    #[arg(long, value_enum)]
    pub network: Option<NetworkArg>,
    /// What an allowlist network may reach (repeatable): NAME:PORT, '*.SUFFIX:PORT', A.B.C.D:PORT, A.B.C.D/NN:PORT.
    #[arg(long = "allow", value_name = "DEST:PORT")]
    pub allow: Vec<String>,
}

/// `sbx net …`.
#[derive(Debug, Subcommand)]
pub enum NetCommand {
    /// Recent DNS queries and connection attempts, oldest first, allowed or not (the daemon keeps
    /// the last 256 per sandbox; the audit log has them all).
    Log {
        /// Sandbox id.
        id: String,
        /// Show at most the last this many (0 = all kept).
        #[arg(long, default_value_t = 0)]
        limit: u32,
    },
}

/// `--network` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum NetworkArg {
    /// Loopback only.
    None,
    /// Only the --allow destinations, through the daemon's DNS and proxy.
    Allowlist,
    /// Everything but the host, metadata addresses, other sandboxes and denied ranges.
    Open,
}

/// The network part of a request from `--network` and `--allow`: unset when neither is given.
pub fn network_policy(network: Option<NetworkArg>, allow: &[String]) -> Option<NetworkPolicy> {
    let mode = match (network, allow.is_empty()) {
        (None, true) => return None,
        (None, false) | (Some(NetworkArg::Allowlist), _) => NetworkMode::Allowlist,
        (Some(NetworkArg::None), _) => NetworkMode::None,
        (Some(NetworkArg::Open), _) => NetworkMode::Open,
    };
    Some(NetworkPolicy {
        mode: mode as i32,
        allow: allow.to_vec(),
    })
}

impl SandboxSpec {
    /// The network part of the request: unset when neither --network nor --allow is given.
    fn network(&self) -> Option<NetworkPolicy> {
        network_policy(self.network, &self.allow)
    }
}

impl SandboxSpec {
    /// The request creating this sandbox, optionally from a snapshot. Unset values are left at
    /// 0 or empty, which the API defines as "the daemon's default".
    pub fn to_request(&self, from_snapshot_id: Option<String>) -> CreateSandboxRequest {
        CreateSandboxRequest {
            isolation: self
                .isolation
                .map_or(Isolation::Unspecified, Isolation::from) as i32,
            image: self.image.clone().unwrap_or_default(),
            limits: Some(ResourceLimits {
                cpu_millicores: self.cpus.or(self.cpu_millicores).unwrap_or(0),
                memory_bytes: self.memory.unwrap_or(0),
                max_pids: self.pids.unwrap_or(0),
                disk_bytes: self.disk.unwrap_or(0),
                exec_timeout_ms: self.timeout_ms.unwrap_or(0),
                shm_bytes: self.shm.unwrap_or(0),
            }),
            env: self.env.iter().cloned().collect(),
            workdir: self.workdir.clone().unwrap_or_default(),
            labels: self.labels.iter().cloned().collect(),
            ttl_seconds: self.ttl.unwrap_or(0),
            from_snapshot_id: from_snapshot_id.unwrap_or_default(),
            user: self.user.clone().unwrap_or_default(),
            network: self.network(),
            on_expiry: match self.on_expiry {
                None => OnExpiry::Unspecified,
                Some(OnExpiryArg::Destroy) => OnExpiry::Destroy,
                Some(OnExpiryArg::Pause) => OnExpiry::Pause,
            } as i32,
        }
    }
}

/// `--on-expiry` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnExpiryArg {
    /// Destroy the sandbox (the default).
    Destroy,
    /// Pause it; it stays paused until resumed or destroyed.
    Pause,
}

/// `--isolation` values.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum IsolationArg {
    /// Namespaces, cgroups and seccomp.
    Process,
    /// A Docker container.
    Container,
    /// A microVM with its own kernel.
    Microvm,
}

impl From<IsolationArg> for Isolation {
    fn from(arg: IsolationArg) -> Self {
        match arg {
            IsolationArg::Process => Isolation::Process,
            IsolationArg::Container => Isolation::Container,
            IsolationArg::Microvm => Isolation::Microvm,
        }
    }
}

/// `sbx exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Extra environment (repeatable), over the sandbox's.
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Working directory [default: the sandbox's].
    #[arg(long, short = 'w', value_name = "PATH")]
    pub workdir: Option<String>,
    /// Kill the command after this many milliseconds [default: the sandbox's].
    #[arg(long, value_name = "MS")]
    pub timeout_ms: Option<u64>,
    /// Output kept per stream, e.g. 4M [default: 1MiB].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    pub max_output: Option<u64>,
    /// Read all of stdin and send it to the command.
    #[arg(long, conflicts_with_all = ["interactive", "tty"])]
    pub stdin: bool,
    /// Stream stdin to the command as it arrives (an interactive session).
    #[arg(long, short = 'i', conflicts_with = "background")]
    pub interactive: bool,
    /// Run the command on a terminal, with the local terminal in raw mode (implies -i).
    #[arg(long, short = 't', conflicts_with = "background")]
    pub tty: bool,
    /// Run at most once per key: a repeated request returns the first result.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// Start the command, print its exec id and return at once.
    #[arg(long)]
    pub background: bool,
    /// Run as this user: name, uid, name:group or uid:gid [default: the sandbox's].
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// The command and its arguments (no shell is implied).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGV"
    )]
    pub argv: Vec<String>,
}

/// `sbx shell`.
#[derive(Debug, Args)]
pub struct ShellArgs {
    /// Sandbox id.
    pub id: String,
    /// Extra environment (repeatable), over the sandbox's.
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Working directory [default: the sandbox's].
    #[arg(long, short = 'w', value_name = "PATH")]
    pub workdir: Option<String>,
    /// End the shell after this many milliseconds [default: the sandbox's exec timeout].
    #[arg(long, value_name = "MS")]
    pub timeout_ms: Option<u64>,
    /// Run as this user: name, uid, name:group or uid:gid [default: the sandbox's].
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
}

/// The command `sbx shell` runs: bash when there is one, else sh. `exec` of a missing
/// program would end a non-interactive sh, hence the test first.
pub const SHELL_SCRIPT: &str =
    "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi";

impl ShellArgs {
    /// The same session as `sbx exec -it ID -- /bin/sh -c SHELL_SCRIPT`.
    pub fn into_exec(self) -> ExecArgs {
        ExecArgs {
            id: self.id,
            env: self.env,
            workdir: self.workdir,
            timeout_ms: self.timeout_ms,
            max_output: None,
            stdin: false,
            interactive: true,
            tty: true,
            idempotency_key: None,
            background: false,
            user: self.user,
            argv: vec!["/bin/sh".into(), "-c".into(), SHELL_SCRIPT.into()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("sbx").chain(args.iter().copied()))
    }

    #[test]
    fn definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn fork_help_documents_the_user_flag() {
        let mut cmd = Cli::command();
        let fork = cmd.find_subcommand_mut("fork").expect("fork");
        let help = fork.render_long_help().to_string();
        assert!(help.contains("-u, --user <USER>"), "{help}");
        assert!(help.contains("the parent's"), "{help}");
        assert!(parse(&["fork", "snap-1", "-u", "1000:1000"]).is_ok());
    }

    #[test]
    fn mcp_takes_the_host_dir_and_the_default_sandbox() {
        let cli = parse(&[
            "mcp",
            "--allow-host-dir",
            "/tmp",
            "--image",
            "debian",
            "--memory",
            "1G",
        ])
        .expect("valid");
        let Command::Mcp(args) = cli.command else {
            panic!("not mcp")
        };
        assert_eq!(args.allow_host_dir, Some(PathBuf::from("/tmp")));
        let req = args.spec.to_request(None);
        assert_eq!(req.image, "debian");
        assert_eq!(req.limits.unwrap_or_default().memory_bytes, 1 << 30);
        assert_eq!(args.output_limit, 16 << 10);
        assert!(parse(&["mcp", "--http", "not-an-address"]).is_err());
    }

    #[test]
    fn create_flags_fill_the_request() {
        let cli = parse(&[
            "create",
            "--isolation",
            "container",
            "--memory",
            "512M",
            "--cpus",
            "0.5",
            "--disk",
            "1G",
            "--shm",
            "256M",
            "--env",
            "A=1",
            "--label",
            "team=infra",
            "--ttl",
            "60",
        ])
        .expect("valid");
        let Command::Create(args) = cli.command else {
            panic!("not create")
        };
        let req = args.spec.to_request(args.from_snapshot);
        assert_eq!(req.isolation, Isolation::Container as i32);
        let limits = req.limits.unwrap_or_default();
        assert_eq!(limits.memory_bytes, 512 << 20);
        assert_eq!(limits.cpu_millicores, 500);
        assert_eq!(limits.disk_bytes, 1 << 30);
        assert_eq!(limits.shm_bytes, 256 << 20);
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.labels.get("team").map(String::as_str), Some("infra"));
        assert_eq!(req.ttl_seconds, 60);
    }

    #[test]
    fn bad_values_are_usage_errors() {
        assert!(parse(&["create", "--memory", "12X"]).is_err());
        assert!(parse(&["create", "--cpus", "1", "--cpu-millicores", "500"]).is_err());
        assert!(parse(&["kill", "ex-1", "--signal", "BOGUS"]).is_err());
    }

    #[test]
    fn agent_run_takes_the_documented_flags() {
        let cli = parse(&[
            "agent",
            "run",
            "--task",
            "fix it",
            "--run-id",
            "r1",
            "--model",
            "gpt-4o",
            "--isolation",
            "process",
            "--image",
            "debian",
            "--verify",
            "make test",
            "--max-steps",
            "7",
            "--context-window",
            "8000",
            "--state-dir",
            "/tmp/s",
            "--json",
        ])
        .expect("valid");
        assert!(cli.json);
        let Command::Agent(AgentCommand::Run(args)) = cli.command else {
            panic!("not agent run")
        };
        assert_eq!(args.task, "fix it");
        assert_eq!(args.run_id.as_deref(), Some("r1"));
        assert_eq!(args.verify.as_deref(), Some("make test"));
        assert_eq!(args.max_steps, 7);
        assert_eq!(args.context_window, Some(8000));
        assert_eq!(args.state_dir, Some(PathBuf::from("/tmp/s")));
        let cli =
            parse(&["agent", "resume", "r1", "--json", "--state-dir", "/tmp/s"]).expect("valid");
        assert!(
            matches!(cli.command, Command::Agent(AgentCommand::Resume { ref run_id, .. }) if run_id == "r1")
        );
        assert!(parse(&["agent", "run"]).is_err(), "--task is required");
        assert!(parse(&["agent", "show"]).is_err(), "RUN_ID is required");
        assert!(matches!(
            parse(&["agent", "steer", "r1", "use python3"]).expect("valid").command,
            Command::Agent(AgentCommand::Steer { ref run_id, ref message, .. }) if run_id == "r1" && message == "use python3"
        ));
        assert!(
            parse(&["agent", "steer", "r1"]).is_err(),
            "MESSAGE is required"
        );
        assert!(matches!(
            parse(&["agent", "stop", "r1", "--done", "--reason", "good enough"]).expect("valid").command,
            Command::Agent(AgentCommand::Stop { done: true, failed: false, ref reason, .. }) if reason.as_deref() == Some("good enough")
        ));
        assert!(
            parse(&["agent", "stop", "r1", "--done", "--failed"]).is_err(),
            "one end or the other"
        );
    }

    #[test]
    fn exec_argv_keeps_its_flags() {
        let cli = parse(&[
            "exec",
            "sb-1",
            "--workdir",
            "/tmp",
            "--",
            "ls",
            "-la",
            "--json",
        ])
        .expect("valid");
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.argv, ["ls", "-la", "--json"]);
        assert_eq!(args.workdir.as_deref(), Some("/tmp"));
        assert!(!cli.json);
        let cli =
            parse(&["--json", "exec", "sb-1", "sh", "-c", "exit 3"]).expect("valid without --");
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.argv, ["sh", "-c", "exit 3"]);
        assert!(cli.json);
        assert!(parse(&["exec", "sb-1"]).is_err(), "argv is required");
    }

    #[test]
    fn interactive_flags_cluster_and_conflict() {
        let cli = parse(&["exec", "-it", "sb-1", "--", "bash"]).expect("valid");
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert!(args.interactive && args.tty);
        assert_eq!(args.argv, ["bash"]);
        assert!(parse(&["exec", "-i", "--stdin", "sb-1", "cat"]).is_err());
        assert!(parse(&["exec", "-t", "--background", "sb-1", "cat"]).is_err());
        let cli = parse(&["cp", "-r", "./d", "sb-1:/w/d"]).expect("valid");
        assert!(matches!(
            cli.command,
            Command::Cp {
                recursive: true,
                ..
            }
        ));
        let cli = parse(&["shell", "sb-1", "-w", "/tmp"]).expect("valid");
        let Command::Shell(args) = cli.command else {
            panic!("not shell")
        };
        let exec = args.into_exec();
        assert!(exec.tty && exec.interactive);
        assert_eq!(exec.argv[..2], ["/bin/sh", "-c"]);
        assert_eq!(exec.workdir.as_deref(), Some("/tmp"));
    }
}
