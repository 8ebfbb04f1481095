//! Daemon configuration: command-line flags over a TOML file over built-in defaults.
//!
//! Every flag has a TOML key of the same name (dashes become underscores), so an ops team can
//! keep the whole setup in `sandboxd.toml` and still override one value on the command line.

use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;

use crate::policy::{PartialLimits, Policy, PolicyConfig};

// Defined with the other shared types; re-exported because the configuration is where it is
// set, and where the tiers look for it.
pub use crate::model::Limits;

/// Errors reading or validating the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid listen address {addr:?}: expected unix:///abs/path or tcp://host:port")]
    Listen { addr: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Command-line flags of `sandboxd`. Each is also a key of the TOML file.
#[derive(Debug, Parser, Default)]
#[command(name = "sandboxd", version, about = "Runs sandboxes (process, container, microVM) behind a gRPC API")]
pub struct Cli {
    /// Address to serve on: unix:///path/s.sock or tcp://127.0.0.1:PORT. Repeatable.
    #[arg(long = "listen")]
    pub listen: Vec<String>,
    /// Directory for the daemon's state: storage pool, run dirs, records.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Directory of images: each image is <images-dir>/<name>/rootfs.
    #[arg(long)]
    pub images_dir: Option<PathBuf>,
    /// TOML configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long)]
    pub log_format: Option<LogFormat>,
    /// Size of the sparse btrfs pool file holding the sandboxes' writable layers (default: half
    /// of the free space of the state dir's filesystem when the pool is made).
    #[arg(long)]
    pub pool_size_bytes: Option<u64>,
    /// Serve Prometheus metrics over HTTP on this address (e.g. 127.0.0.1:9477).
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve only the gRPC health service (grpc.health.v1.Health), in plaintext, on this address
    /// (e.g. 0.0.0.0:7071): for probes that cannot speak the TLS of the API's TCP listeners.
    #[arg(long)]
    pub health_listen: Option<std::net::SocketAddr>,
    /// Keep this many microVMs booted ahead of time so MICROVM creates need not wait for a boot.
    #[arg(long = "microvm-pool")]
    pub microvm_pool: Option<usize>,
    /// Export traces over OTLP/gRPC to this collector (e.g. http://127.0.0.1:4317); overrides
    /// `[telemetry] otlp_endpoint`.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Serve the E2B-compatible API on this address (e.g. 127.0.0.1:3000); overrides
    /// `[e2b] listen`.
    #[arg(long = "e2b")]
    pub e2b: Option<std::net::SocketAddr>,
    /// Instead of serving: a command to a running daemon.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Serve the operator's web page on this address (e.g. 127.0.0.1:8080); overrides
    /// `[web] listen`.
    #[arg(long = "web")]
    pub web: Option<std::net::SocketAddr>,
    /// The `sbx agent` state dir whose runs the page shows; overrides `[web] agent_runs_dir`.
    #[arg(long = "web-agent-runs")]
    pub web_agent_runs: Option<PathBuf>,
}

/// What `sandboxd <command>` does instead of serving.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Drain the daemon serving a UNIX socket, then wait for it to end: it takes no new
    /// sandboxes (creates answer UNAVAILABLE, so a fleet places them on a peer) and health's
    /// `sandbox.v1.SandboxService` turns NOT_SERVING; running execs get until `--timeout`, then
    /// the daemon is stopped with SIGTERM. Exits 0 once the daemon has ended. Run by the
    /// Kubernetes preStop hook; needs the right to signal the daemon (root).
    Drain(DrainArgs),
}

/// The options of `sandboxd drain`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrainArgs {
    /// The daemon's UNIX socket (`unix:///path` or a path). Default: the first UNIX listener
    /// of `--config`, else /run/sandboxd/sandboxd.sock.
    #[arg(long)]
    pub socket: Option<String>,
    /// Seconds the running execs may take before the daemon is stopped with SIGTERM.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Seconds the daemon may take to exit after that SIGTERM.
    #[arg(long, default_value_t = 60)]
    pub stop_timeout: u64,
}

impl DrainArgs {
    /// The socket to drain: `--socket`, else the first UNIX listener in the `config` file.
    pub fn socket_path(&self, config: Option<&Path>) -> Result<PathBuf, ConfigError> {
        if let Some(s) = &self.socket {
            return match ListenAddr::parse(s)? {
                ListenAddr::Unix(p) => Ok(p),
                ListenAddr::Tcp(_) => Err(ConfigError::Invalid(format!("drain --socket {s:?}: a drain needs the daemon's UNIX socket"))),
            };
        }
        let listen = match config {
            Some(path) => Self::listeners_of(path)?,
            None => Vec::new(),
        };
        let first_unix = listen.iter().map(|a| ListenAddr::parse(a)).find_map(|a| match a {
            Ok(ListenAddr::Unix(p)) => Some(p),
            _ => None,
        });
        Ok(first_unix.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)))
    }

    /// The `listen` list of a config file, read alone: a drain needs nothing else from it.
    fn listeners_of(path: &Path) -> Result<Vec<String>, ConfigError> {
        #[derive(Deserialize)]
        struct ListenOnly {
            listen: Option<Vec<String>>,
        }
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let file: ListenOnly = toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(file.listen.unwrap_or_default())
    }
}

/// Where the daemon listens when neither flag nor file says.
pub const DEFAULT_SOCKET: &str = "/run/sandboxd/sandboxd.sock";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The `[limits]` table: defaults and ceilings. Each names only what it changes: a field left
/// out keeps its built-in default (or ceiling).
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "RawLimitsConfig")]
pub struct LimitsConfig {
    pub default: Limits,
    pub max: Limits,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimitsConfig {
    #[serde(default)]
    default: PartialLimits,
    #[serde(default)]
    max: PartialLimits,
}

impl From<RawLimitsConfig> for LimitsConfig {
    fn from(raw: RawLimitsConfig) -> Self {
        LimitsConfig { default: raw.default.over(Limits::DEFAULTS), max: raw.max.over(Limits::CEILINGS) }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig { default: Limits::DEFAULTS, max: Limits::CEILINGS }
    }
}

/// The `[exec]` table: output and wait bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecConfig {
    /// Per-stream cap used when a request says 0.
    pub default_max_output_bytes: u64,
    /// Largest per-stream cap a request may ask for (bounds the daemon's memory per exec).
    pub max_output_bytes_ceiling: u64,
    /// How long to wait for stdout/stderr to close after the main process has exited: a
    /// grandchild left running in the background may hold them open forever.
    pub io_drain_timeout_ms: u64,
    /// Exec records kept per sandbox for ListExecs (oldest dropped first).
    pub max_records_per_sandbox: usize,
    /// Bytes of recorded stdout+stderr kept on the host per sandbox, under
    /// `<state_dir>/outputs/<sandbox>/`; past it the oldest finished records lose their output
    /// (their metadata stays, marked `output_discarded`). 0 keeps no output once an exec has
    /// returned it.
    pub max_output_storage_bytes_per_sandbox: u64,
    /// Bytes of argv an exec record keeps (ListExecs/GetExec): past it the stored argv is cut
    /// and the record says `argv_truncated`. The exec itself always runs with its whole argv.
    pub max_record_argv_bytes: usize,
    /// Remount the host's cgroup hierarchy with `favordynmods` at start (see
    /// `backend::cgroup::favor_dynamic_modifications`): moving a process into a cgroup then no
    /// longer waits for an RCU grace period (7.8 ms median per move 100 ms apart measured on a
    /// 2-CPU VM, 0.35 ms with it), which every exec on the process and container tiers does.
    /// A host-wide setting that makes fork and exit slightly dearer; on the 6.18 kernel it was
    /// measured on, migrations stayed fast after a remount without the option (until reboot).
    /// `false` leaves the host's mount as it is.
    pub favordynmods: bool,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            default_max_output_bytes: 1 << 20,
            max_output_bytes_ceiling: 16 << 20,
            io_drain_timeout_ms: 300,
            max_records_per_sandbox: 1000,
            max_output_storage_bytes_per_sandbox: 64 << 20,
            max_record_argv_bytes: 16 << 10,
            favordynmods: true,
        }
    }
}

/// The `[files]` table: WriteFile/ReadFile bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilesConfig {
    /// WriteFile calls served at once; more wait, before their message is decoded, so the
    /// daemon holds at most this many file contents (each up to the 64 MiB message limit, about
    /// twice that while it is decoded and handed to the backend) however many callers write.
    pub max_concurrent_writes: usize,
}

impl Default for FilesConfig {
    fn default() -> Self {
        FilesConfig { max_concurrent_writes: 4 }
    }
}

/// The `[connections]` table: what a client may hold, above all before it is authenticated.
/// A connection past a cap is closed at once, with a log line naming the key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// Open connections per UNIX peer uid (root and the daemon's own uid included).
    pub max_per_uid: usize,
    /// Open connections on all UNIX listeners together.
    pub max_unix: usize,
    /// Open connections per TCP source address.
    pub max_per_ip: usize,
    /// Open connections on all TCP listeners together.
    pub max_tcp: usize,
    /// A connection on which no request has been authenticated is closed after this long (a
    /// UNIX peer on the allowed lists, and TCP without tokens, are authenticated from the start).
    pub preauth_timeout_ms: u64,
    /// HTTP/2 streams (calls) open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub max_concurrent_streams: u32,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        ConnectionsConfig { max_per_uid: 256, max_unix: 1024, max_per_ip: 256, max_tcp: 1024, preauth_timeout_ms: 10_000, max_concurrent_streams: 256 }
    }
}

impl ConnectionsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let caps = [self.max_per_uid, self.max_unix, self.max_per_ip, self.max_tcp, self.max_concurrent_streams as usize];
        if caps.contains(&0) || self.preauth_timeout_ms < 100 {
            return Err(ConfigError::Invalid("connections: every max_* must be above 0 and preauth_timeout_ms at least 100".into()));
        }
        Ok(())
    }
}

/// The `[streams]` table: bounds on the streaming calls (uploads, downloads, exec sessions,
/// archive walks), so no client can hold the daemon's threads, memory or descriptors.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamsConfig {
    /// An upload with no message from the client, or a download the client does not read, for
    /// this long is ended with DEADLINE_EXCEEDED (its partial file removed, its descriptors closed).
    pub idle_timeout_ms: u64,
    /// UploadFile and UploadArchive calls at once, on the whole daemon and per tenant.
    pub max_uploads: usize,
    pub max_uploads_per_tenant: usize,
    /// DownloadFile and DownloadArchive calls at once.
    pub max_downloads: usize,
    pub max_downloads_per_tenant: usize,
    /// ExecSession calls at once.
    pub max_sessions: usize,
    pub max_sessions_per_tenant: usize,
    /// UploadArchive and DownloadArchive calls at once (each walks a tree on a thread of its own).
    pub max_archive_walks: usize,
    pub max_archive_walks_per_tenant: usize,
    /// Bytes of a session's stdin the daemon holds once the message carrying them is read.
    pub session_input_buffer_bytes: usize,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        StreamsConfig {
            idle_timeout_ms: 60_000,
            max_uploads: 256,
            max_uploads_per_tenant: 32,
            max_downloads: 256,
            max_downloads_per_tenant: 32,
            max_sessions: 512,
            max_sessions_per_tenant: 64,
            max_archive_walks: 32,
            max_archive_walks_per_tenant: 8,
            session_input_buffer_bytes: 1 << 20,
        }
    }
}

impl StreamsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(100..=3_600_000).contains(&self.idle_timeout_ms) {
            return Err(ConfigError::Invalid(format!("streams.idle_timeout_ms = {} must be between 100 and 3600000", self.idle_timeout_ms)));
        }
        let caps = [
            ("max_uploads", self.max_uploads, self.max_uploads_per_tenant),
            ("max_downloads", self.max_downloads, self.max_downloads_per_tenant),
            ("max_sessions", self.max_sessions, self.max_sessions_per_tenant),
            ("max_archive_walks", self.max_archive_walks, self.max_archive_walks_per_tenant),
        ];
        for (key, global, per_tenant) in caps {
            if !(1..=65_536).contains(&global) || !(1..=global).contains(&per_tenant) {
                return Err(ConfigError::Invalid(format!(
                    "streams.{key} = {global} and streams.{key}_per_tenant = {per_tenant}: each must be at least 1, the global one at most 65536 and not below the per-tenant one"
                )));
            }
        }
        if !(4096..=(64 << 20)).contains(&self.session_input_buffer_bytes) {
            return Err(ConfigError::Invalid(format!(
                "streams.session_input_buffer_bytes = {} must be between 4096 and 67108864",
                self.session_input_buffer_bytes
            )));
        }
        Ok(())
    }
}

/// The `[network]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Addresses for the sandboxes' links: a /30 each (the host end, the sandbox's end).
    /// Never reachable from a sandbox.
    pub subnet: String,
    /// Host-side interfaces are named this and a slot number; the nftables table is
    /// `sandboxd_<prefix>`. One daemon per prefix.
    pub interface_prefix: String,
    /// Where the daemon's DNS asks (host:port). Unset: the first `nameserver` of the host's
    /// /etc/resolv.conf, port 53.
    pub upstream_dns: Option<std::net::SocketAddr>,
    /// Ranges no sandbox reaches in any mode, allow list or not (the host itself, loopback,
    /// link-local and the sandboxes' subnet are refused anyway).
    pub deny: Vec<String>,
    /// Connections one sandbox may have open at once through the proxy.
    pub max_connections: u32,
    /// How long the proxy waits for a destination to accept.
    pub connect_timeout_ms: u64,
    /// A proxied connection that moves no byte either way for this long is closed (and one whose
    /// client sends no first request within it).
    pub idle_timeout_ms: u64,
    /// Bytes per second one sandbox may move each way through the proxy, all its connections
    /// together (a burst of one second's worth); 0 is no cap.
    pub bandwidth_bytes_per_sec: u64,
}

impl NetworkConfig {
    /// The `deny` ranges, parsed (the policy and the egress filter both hold them).
    pub fn deny_ranges(&self) -> Result<Vec<crate::netpolicy::Cidr>, String> {
        self.deny.iter().map(|d| d.parse().map_err(|e| format!("network.deny: {e}"))).collect()
    }
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            subnet: "100.96.0.0/16".into(),
            interface_prefix: "sbxe".into(),
            upstream_dns: None,
            deny: ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"].map(String::from).to_vec(),
            max_connections: 64,
            connect_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            bandwidth_bytes_per_sec: 50 << 20,
        }
    }
}

/// Whether process sandboxes get a user namespace: `auto` uses one, through idmapped mounts
/// where the kernel and the filesystems allow them and shifted copies otherwise (logging which),
/// `required` refuses to serve the tier when no user namespace can be made, `shifted` always
/// uses shifted copies (what a kernel without idmapped mounts gets), `off` keeps sandbox uids
/// host uids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum UsernsMode {
    #[default]
    Auto,
    Required,
    Shifted,
    Off,
}

/// The `[process]` table: the namespace tier.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProcessTierConfig {
    /// `auto` (default): each sandbox gets a user namespace over a host id range of its own,
    /// its files shown through idmapped mounts where the kernel and filesystems allow them and
    /// shifted on disk otherwise; `required`: the tier refuses to serve without; `shifted`:
    /// always shifted on disk; `off`: sandbox uids are host uids.
    pub user_namespaces: UsernsMode,
    /// First host uid/gid handed to sandboxes; a multiple of 65,536 that no host user or other
    /// container engine uses (the default is in the range systemd leaves to containers).
    pub userns_first_id: u32,
    /// Ranges of 65,536 ids from there: at most this many process sandboxes live at once.
    pub userns_ranges: u32,
    /// How many sandboxes keep a spare process forked ahead for their next exec: those that
    /// armed one last (each exec arms its sandbox's next). A spare takes the fork off the
    /// exec's path (~0.3 ms after a pause) but holds ~0.2 MiB of host memory, so thousands of
    /// idle sandboxes do not each keep one. 0: none (every exec forks through the init).
    pub spares: usize,
}

impl Default for ProcessTierConfig {
    fn default() -> Self {
        Self { user_namespaces: Default::default(), userns_first_id: 1 << 30, userns_ranges: 8192, spares: 256 }
    }
}

/// The `[container]` table: the Docker-based tier.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContainerTierConfig {
    /// Bytes of disk that CONTAINER sandboxes may be promised in total (the sum of their
    /// `disk_bytes`). Unset: the size of the filesystem holding Docker's data root
    /// (`/var/lib/docker`, else the state dir), measured at start — see `admission`.
    pub disk_pool_bytes: Option<u64>,
    /// Refuse container sandboxes unless Docker runs with `userns-remap` (so root in a
    /// container is not the host's root, nor uid 1000 the host's uid 1000).
    pub require_userns_remap: bool,
    /// Start every exec through Docker's exec API, as before the exec channel (see the
    /// container tier's `exec.rs`): ~10× slower per exec. For comparison, and as a way back
    /// should the channel misbehave on some host. Applies to containers created from then on.
    pub exec_through_docker: bool,
    /// Started containers kept ready for creates, per shape (image and limits) of the 4 most
    /// recently created ones: a create of a
    /// pooled shape takes ~tens of ms instead of Docker's create and start. 0 (the default):
    /// no pool. Each pooled container is an idle container (a shim, docker-init, the helper).
    pub warm_pool: usize,
}

/// The `[admission]` table: what the host may promise to sandboxes, what it keeps for itself,
/// and the per-tenant quotas (see `admission` for how each is counted). Every key has a default
/// that lets 1,000 sandboxes of the default size run on a 2-core, 24 GiB host with 80 GB free.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// The sum of the sandboxes' `memory_bytes` may reach this many times the host's memory
    /// (less `daemon_memory_reserve_bytes`). A limit is a ceiling, not an allocation (an idle
    /// process sandbox uses ~2 MiB): real use is guarded by `daemon_memory_reserve_bytes`.
    /// 1.0 promises no more than the host has.
    pub memory_overcommit: f64,
    /// Memory kept for the daemon and the host: not promised, and creates are refused while
    /// the host's available memory is below it.
    pub daemon_memory_reserve_bytes: u64,
    /// The sum of the sandboxes' `max_pids` may reach this many times `pid_max` less
    /// `pids_reserve`.
    pub pids_overcommit: f64,
    /// Pids kept for the host: not promised, and creates are refused while fewer than this
    /// are free under `kernel.pid_max`.
    pub pids_reserve: u64,
    /// The sum of the sandboxes' `disk_bytes` may reach this many times a storage pool's size.
    /// Quotas stay hard per sandbox; real use is guarded by `disk_high_water`. 1.0 is strict:
    /// every promised byte exists.
    pub disk_overcommit: f64,
    /// Share of a storage pool in real use (sandboxes' layers and snapshots) from which creates
    /// on it are refused.
    pub disk_high_water: f64,
    /// Share of a storage pool in real use from which the daemon warns (log and /metrics).
    pub disk_warn: f64,
    /// Sum of `memory_bytes` one tenant's sandboxes may be promised. Unset: no tenant quota.
    pub max_memory_bytes_per_tenant: Option<u64>,
    /// Sum of `max_pids` one tenant's sandboxes may be promised. Unset: no tenant quota.
    pub max_pids_per_tenant: Option<u64>,
    /// Sum of `disk_bytes` one tenant's sandboxes may be promised. Unset: no tenant quota.
    pub max_disk_bytes_per_tenant: Option<u64>,
    /// Snapshots kept of one sandbox (they outlive it until deleted).
    pub max_snapshots_per_sandbox: usize,
    /// Snapshots kept by one tenant.
    pub max_snapshots_per_tenant: usize,
    /// Bytes the snapshots of one sandbox may hold (their `size_bytes`).
    pub max_snapshot_bytes_per_sandbox: u64,
    /// Bytes the snapshots of one tenant may hold.
    pub max_snapshot_bytes_per_tenant: u64,
    /// The daemon's own `oom_score_adj` (-1000..=1000): the kernel kills a sandbox's processes
    /// long before the daemon. Lowering it needs CAP_SYS_RESOURCE; without it a warning is
    /// logged and `sandbox_oom_score_adj` alone keeps the daemon last.
    pub oom_score_adj: i32,
    /// The `oom_score_adj` of every process started for a sandbox (0..=1000: raising needs no
    /// privilege): under memory pressure the kernel's first choice.
    pub sandbox_oom_score_adj: i32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            memory_overcommit: 32.0,
            daemon_memory_reserve_bytes: 1 << 30,
            pids_overcommit: 16.0,
            pids_reserve: 2048,
            disk_overcommit: 100.0,
            disk_high_water: 0.90,
            disk_warn: 0.80,
            max_memory_bytes_per_tenant: None,
            max_pids_per_tenant: None,
            max_disk_bytes_per_tenant: None,
            max_snapshots_per_sandbox: 64,
            max_snapshots_per_tenant: 1024,
            max_snapshot_bytes_per_sandbox: 16 << 30,
            max_snapshot_bytes_per_tenant: 64 << 30,
            oom_score_adj: -900,
            sandbox_oom_score_adj: 500,
        }
    }
}

impl AdmissionConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, ratio) in
            [("memory_overcommit", self.memory_overcommit), ("pids_overcommit", self.pids_overcommit), ("disk_overcommit", self.disk_overcommit)]
        {
            if !(1.0..=1000.0).contains(&ratio) {
                return Err(ConfigError::Invalid(format!("admission.{key} = {ratio} must be between 1.0 (strict) and 1000")));
            }
        }
        for (key, share) in [("disk_high_water", self.disk_high_water), ("disk_warn", self.disk_warn)] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(ConfigError::Invalid(format!("admission.{key} = {share} must be a share of the pool, above 0 and at most 1")));
            }
        }
        if self.disk_warn > self.disk_high_water {
            return Err(ConfigError::Invalid(format!(
                "admission.disk_warn = {} must not be above admission.disk_high_water = {}: the warning comes first",
                self.disk_warn, self.disk_high_water
            )));
        }
        if self.max_snapshots_per_sandbox == 0 || self.max_snapshots_per_tenant == 0 {
            return Err(ConfigError::Invalid("admission.max_snapshots_per_sandbox and admission.max_snapshots_per_tenant must be > 0".into()));
        }
        if !(-1000..=1000).contains(&self.oom_score_adj) {
            return Err(ConfigError::Invalid(format!("admission.oom_score_adj = {} must be between -1000 and 1000", self.oom_score_adj)));
        }
        if !(0..=1000).contains(&self.sandbox_oom_score_adj) || self.sandbox_oom_score_adj <= self.oom_score_adj {
            return Err(ConfigError::Invalid(format!(
                "admission.sandbox_oom_score_adj = {} must be between 0 and 1000 and above admission.oom_score_adj = {}",
                self.sandbox_oom_score_adj, self.oom_score_adj
            )));
        }
        for (key, v) in [
            ("max_memory_bytes_per_tenant", self.max_memory_bytes_per_tenant),
            ("max_pids_per_tenant", self.max_pids_per_tenant),
            ("max_disk_bytes_per_tenant", self.max_disk_bytes_per_tenant),
        ] {
            if v == Some(0) {
                return Err(ConfigError::Invalid(format!("admission.{key} must be > 0 (leave it out for no tenant quota)")));
            }
        }
        Ok(())
    }
}

/// The pool file's size when neither the flag nor the file sets it, from the space free on the
/// filesystem that will hold it (the nearest existing ancestor of the state dir): see
/// [`pool_size_for_free`].
pub fn default_pool_size(state_dir: &Path) -> u64 {
    let existing = state_dir.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    match nix::sys::statvfs::statvfs(existing) {
        // Both fields are u64 or u32 depending on the libc.
        #[allow(clippy::useless_conversion)]
        Ok(st) => pool_size_for_free(u64::from(st.blocks_available()).saturating_mul(u64::from(st.fragment_size()))),
        Err(e) => {
            tracing::warn!(dir = %existing.display(), error = %e, "cannot measure the free space for the pool file; using 32 GiB (set pool_size_bytes)");
            32 << 30
        }
    }
}

/// The default pool size on a filesystem with `free` bytes available: half of it, so the other
/// half stays for images, records and the host — but at least 16 GiB (1,600 default sandboxes
/// under the default 100× disk overcommit) while that is under 80% of the free space, and never
/// under the 256 MiB mkfs.btrfs needs. The file is sparse: its size is a ceiling that real use,
/// guarded by `admission.disk_high_water`, approaches only as sandboxes write.
pub fn pool_size_for_free(free: u64) -> u64 {
    const FLOOR: u64 = 256 << 20;
    const COMFORTABLE: u64 = 16 << 30;
    (free / 2).max(COMFORTABLE.min(free / 5 * 4)).max(FLOOR)
}

/// The `[web]` table: the operator's page (see `web`). Off unless `listen` (or `--web`) is given.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct WebConfig {
    /// Where to serve the page and its JSON (plain HTTP/1.1). A loopback address unless
    /// `[auth]` has tokens: without them the page answers as the local tenant, so only this
    /// host may reach it.
    pub listen: Option<std::net::SocketAddr>,
    /// Whether the page may destroy a sandbox (its only state-changing action). Off: read-only.
    #[serde(default)]
    pub allow_destroy: bool,
    /// A state dir of `sbx agent` (the runs under `<dir>/runs/`) whose runs the page shows,
    /// read-only.
    pub agent_runs_dir: Option<PathBuf>,
    /// Where an exec's trace id links to: an `http(s)://` URL with `{trace_id}` in it (a Jaeger
    /// or Tempo trace view). Unset: the link shows the sandbox's execs of that trace.
    pub trace_url: Option<String>,
}

/// The `[e2b]` table: the E2B-compatible front door (see `e2b`). Off unless `listen` (or
/// `--e2b`) is given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct E2bConfig {
    /// Where to serve the E2B API (plain HTTP/1.1; put TLS in front for anything but loopback).
    pub listen: Option<std::net::SocketAddr>,
    /// Whether a create's metadata may choose the tier (`isolation=process|container|microvm`).
    /// Off: the policy's default tier, whatever the metadata says.
    #[serde(default)]
    pub isolation_metadata: bool,
    /// The image E2B's default template (`base`, what `Sandbox.create()` asks for) maps to: E2B's
    /// base is a Debian with bash, which the SDK runs every command through.
    #[serde(default = "default_base_template")]
    pub base_template: String,
    /// A sandbox's lifetime when a create names none (E2B's `timeout`), in seconds.
    #[serde(default = "default_timeout_seconds")]
    pub default_timeout_seconds: u32,
    /// Connections served at once; more wait in the kernel's backlog.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
}

fn default_base_template() -> String {
    "debian".into()
}

fn default_timeout_seconds() -> u32 {
    300
}

fn default_max_connections() -> usize {
    256
}

impl Default for E2bConfig {
    fn default() -> Self {
        E2bConfig {
            listen: None,
            isolation_metadata: false,
            base_template: default_base_template(),
            default_timeout_seconds: default_timeout_seconds(),
            max_connections: default_max_connections(),
        }
    }
}

/// The `[fleet]` table as written: several daemons behind one address (see `fleet`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetFileConfig {
    /// This node's name, carried by the ids it makes. Default: `$SANDBOXD_NODE_NAME`, then
    /// `$SANDBOXD_KUBE_NODE_NAME` made a node name ([`node_name_of_kube_node`]), then the
    /// hostname (lowercased).
    pub node_name: Option<String>,
    /// This node's direct address (`host:port`) as peers and clients reach it. Default:
    /// `$SANDBOXD_NODE_ADDRESS`, then the first TCP listener if it names a specific address.
    pub address: Option<String>,
    /// The DNS name whose A records are the fleet's nodes (a headless Service's name).
    pub peers_dns: String,
    /// The port every node serves the API on (TCP).
    #[serde(default = "default_fleet_port")]
    pub port: u16,
    /// A DNS server to ask instead of the system resolver (`/etc/resolv.conf`).
    pub dns_server: Option<std::net::SocketAddr>,
    /// How often the peers are resolved again (also at once after a failure).
    #[serde(default = "default_fleet_refresh_ms")]
    pub refresh_ms: u64,
    /// How long a create placed on a peer may go by the peers' room as last asked (0: ask every
    /// peer on every placed create).
    #[serde(default = "default_fleet_placement_cache_ms")]
    pub placement_cache_ms: u64,
    /// How long a connection to a peer may take before the call is UNAVAILABLE.
    #[serde(default = "default_fleet_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// A file holding the token the nodes present to each other (a Kubernetes Secret's key).
    pub token_file: PathBuf,
    /// With `[tls]` (the nodes serve TLS): the CA certificate (PEM) the nodes' certificates
    /// are checked against when they call one another.
    pub tls_ca_file: Option<PathBuf>,
    /// The name a node's certificate must carry for its peers (default: `peers_dns`, the
    /// headless Service's name, which a wildcard or SAN of the nodes' certificate covers).
    pub tls_server_name: Option<String>,
}

fn default_fleet_port() -> u16 {
    7070
}

fn default_fleet_refresh_ms() -> u64 {
    10_000
}

fn default_fleet_placement_cache_ms() -> u64 {
    2_000
}

fn default_fleet_connect_timeout_ms() -> u64 {
    2_000
}

/// A fleet node name for the Kubernetes node called `kube` (`$SANDBOXD_KUBE_NODE_NAME`, the
/// downward API's `spec.nodeName`): the node a DaemonSet pod runs on is what holds its state
/// dir, and its name survives the pod's replacement, which the pod's own name does not. Cloud
/// node names are often dotted (`ip-10-0-1-23.ec2.internal`) or longer than a node name may be:
/// the first DNS label is kept, lowercased, and one longer than [`crate::ids::MAX_NODE_NAME`] is
/// cut and given 8 hex digits of the whole name's SHA-256, so distinct names stay distinct.
pub fn node_name_of_kube_node(kube: &str) -> String {
    use sha2::Digest;
    let label = kube.split('.').next().unwrap_or_default().to_ascii_lowercase();
    if label.len() <= crate::ids::MAX_NODE_NAME {
        return label;
    }
    let digest = sha2::Sha256::digest(kube.as_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    let keep = label.get(..crate::ids::MAX_NODE_NAME - 9).unwrap_or_default().trim_end_matches('-');
    format!("{keep}-{hex}")
}

/// The fleet token, kept out of `Debug` output and logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `[fleet]`, resolved: every default filled in and the token read.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub node: crate::ids::NodeName,
    /// `host:port` of this node's API, as its peers and clients reach it.
    pub address: String,
    pub peers_dns: String,
    pub port: u16,
    pub dns_server: Option<std::net::SocketAddr>,
    pub refresh: std::time::Duration,
    pub placement_cache: std::time::Duration,
    pub connect_timeout: std::time::Duration,
    pub token: Secret,
    /// Peers are called over TLS: the CA (PEM) and the name their certificates carry.
    pub tls: Option<PeerTls>,
}

/// How a node checks its peers' certificates.
#[derive(Debug, Clone)]
pub struct PeerTls {
    pub ca_pem: Vec<u8>,
    pub server_name: String,
}

impl FleetFileConfig {
    /// Fills in the defaults (environment, hostname, listeners) and reads the token file.
    fn resolve(self, listen: &[ListenAddr], serves_tls: bool) -> Result<FleetConfig, ConfigError> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let from_kube = || env("SANDBOXD_KUBE_NODE_NAME").map(|n| node_name_of_kube_node(&n));
        let name = match self.node_name.or_else(|| env("SANDBOXD_NODE_NAME")).or_else(from_kube) {
            Some(n) => n,
            None => nix::unistd::gethostname()
                .map_err(|e| ConfigError::Invalid(format!("fleet.node_name is unset and the hostname cannot be read: {e}")))?
                .to_string_lossy()
                .to_ascii_lowercase(),
        };
        let node = crate::ids::NodeName::parse(&name).map_err(|_| {
            ConfigError::Invalid(format!(
                "fleet.node_name {name:?} is not a node name: 1-{} of a-z, 0-9 and '-', starting and ending with a letter or digit (set fleet.node_name or SANDBOXD_NODE_NAME)",
                crate::ids::MAX_NODE_NAME
            ))
        })?;
        let address = match self.address.or_else(|| env("SANDBOXD_NODE_ADDRESS")) {
            Some(a) => a,
            None => listen
                .iter()
                .find_map(|l| match l {
                    ListenAddr::Tcp(sock) if !sock.ip().is_unspecified() => Some(sock.to_string()),
                    _ => None,
                })
                .ok_or_else(|| {
                    ConfigError::Invalid(
                        "fleet.address is unset and no TCP listener names a specific address: set fleet.address or SANDBOXD_NODE_ADDRESS (host:port)".into(),
                    )
                })?,
        };
        if self.peers_dns.is_empty() || self.peers_dns.len() > 253 {
            return Err(ConfigError::Invalid(format!("fleet.peers_dns = {:?} must be a DNS name", self.peers_dns)));
        }
        if self.refresh_ms == 0 || self.connect_timeout_ms == 0 {
            return Err(ConfigError::Invalid("fleet.refresh_ms and fleet.connect_timeout_ms must be > 0".into()));
        }
        let token = std::fs::read_to_string(&self.token_file)
            .map_err(|e| ConfigError::Invalid(format!("fleet.token_file = {}: {e}", self.token_file.display())))?
            .trim()
            .to_string();
        if token.len() < 16 {
            return Err(ConfigError::Invalid(format!("fleet.token_file = {}: the token must have at least 16 characters", self.token_file.display())));
        }
        let tls = match (&self.tls_ca_file, serves_tls) {
            (Some(ca), true) => Some(PeerTls {
                ca_pem: std::fs::read(ca).map_err(|e| ConfigError::Invalid(format!("fleet.tls_ca_file = {}: {e}", ca.display())))?,
                server_name: self.tls_server_name.clone().unwrap_or_else(|| self.peers_dns.clone()),
            }),
            (None, true) => {
                return Err(ConfigError::Invalid(
                    "[tls] is set, so the nodes serve TLS and call one another over it: set fleet.tls_ca_file (the CA that signed the nodes' certificates)"
                        .into(),
                ))
            }
            (Some(_), false) => {
                return Err(ConfigError::Invalid("fleet.tls_ca_file is set but [tls] is not: the nodes serve no TLS to check".into()));
            }
            (None, false) => None,
        };
        Ok(FleetConfig {
            tls,
            node,
            address,
            peers_dns: self.peers_dns,
            port: self.port,
            dns_server: self.dns_server,
            refresh: std::time::Duration::from_millis(self.refresh_ms),
            placement_cache: std::time::Duration::from_millis(self.placement_cache_ms),
            connect_timeout: std::time::Duration::from_millis(self.connect_timeout_ms),
            token: Secret(token),
        })
    }
}

/// The TOML file, as written by users.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<Vec<String>>,
    pub state_dir: Option<PathBuf>,
    pub images_dir: Option<PathBuf>,
    pub log_format: Option<LogFormat>,
    pub pool_size_bytes: Option<u64>,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub exec: ExecConfig,
    pub metrics: Option<std::net::SocketAddr>,
    pub health_listen: Option<std::net::SocketAddr>,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub audit: AuditConfig,
    pub tls: Option<TlsConfig>,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub microvm: MicroVmConfig,
    #[serde(default)]
    pub container: ContainerTierConfig,
    #[serde(default)]
    pub process: ProcessTierConfig,
    #[serde(default)]
    pub network: NetworkConfig,
    #[serde(default)]
    pub files: FilesConfig,
    #[serde(default)]
    pub connections: ConnectionsConfig,
    #[serde(default)]
    pub streams: StreamsConfig,
    #[serde(default)]
    pub images: ImagesConfig,
    #[serde(default)]
    pub admission: AdmissionConfig,
    #[serde(default)]
    pub e2b: E2bConfig,
    #[serde(default)]
    pub web: WebConfig,
    pub fleet: Option<FleetFileConfig>,
}

/// Where the RUN steps of a `BuildImage` may connect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BuildNetwork {
    /// No network at all: a build that asks for one is refused.
    #[default]
    None,
    /// The network the build asks for (else the policy's default for a container sandbox of
    /// the caller), within the policy's ceilings and through the egress filter, exactly as a
    /// sandbox's. `"default"` (Docker's bridge, before RUN steps ran in sandboxes) means this now.
    #[serde(alias = "default")]
    Policy,
}

/// The `[images]` table: imports and builds of images through the API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImagesConfig {
    /// Largest archive or build context a client may send, and largest `docker:` export.
    pub max_archive_bytes: u64,
    /// Most bytes of file content an imported image's root filesystem may hold.
    pub max_rootfs_bytes: u64,
    /// Most entries (files, directories, links, whiteouts) across an image's layers.
    pub max_entries: u64,
    /// Imports and builds served at once; the others wait (and say so).
    pub max_concurrent: usize,
    /// Most bytes of host disk the image store may take: the imported images (rootfs and
    /// microVM base disk) and the uploads, exports and staging of the imports in flight.
    pub max_store_bytes: u64,
    /// Bytes an import leaves free on the filesystem of the state dir; below it, it stops.
    pub min_free_bytes: u64,
    /// Network of the RUN steps of builds: `none`, or `policy` (what the build asks for, under
    /// the network policy and the egress filter, like a sandbox).
    pub build_network: BuildNetwork,
    /// Of `max_concurrent`, the slots one tenant's imports and builds may hold at once (below
    /// `max_concurrent`, so one tenant's builds never hold every slot another tenant waits for).
    pub max_concurrent_per_tenant: usize,
    /// Most bytes of the image store one tenant's images and imports in flight may take.
    pub max_store_bytes_per_tenant: u64,
    /// How long a build may run (its RUN steps included) before it is stopped.
    pub build_timeout_ms: u64,
    /// Memory (and memory+swap) of each RUN step of a build.
    pub build_memory_bytes: u64,
    /// CPU of each RUN step of a build, in thousandths of a CPU.
    pub build_cpu_millicores: u32,
    /// Processes of one build's RUN steps together (a cgroup parent's `pids.max`).
    pub build_max_pids: u32,
    /// `/dev/shm` of each RUN step of a build.
    pub build_shm_bytes: u64,
    /// Local Docker images any tenant may import with `docker:` (exact references as given);
    /// other `docker:` imports need an image admin.
    pub docker_import_allowed: Vec<String>,
    /// Tenants whose callers are image admins: they may import any local Docker image
    /// (`docker:`) and share an import with every tenant (`ImportImageHeader.shared`). Root
    /// (and the daemon's own uid) on the UNIX socket always is one.
    pub admin_tenants: Vec<String>,
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig {
            max_archive_bytes: 32 << 30,
            max_rootfs_bytes: 32 << 30,
            max_entries: 2_000_000,
            max_concurrent: 4,
            max_store_bytes: 64 << 30,
            min_free_bytes: 2 << 30,
            build_network: BuildNetwork::None,
            max_concurrent_per_tenant: 2,
            max_store_bytes_per_tenant: 16 << 30,
            build_timeout_ms: 30 * 60 * 1000,
            build_memory_bytes: 2 << 30,
            build_cpu_millicores: 1000,
            build_max_pids: 1024,
            build_shm_bytes: 64 << 20,
            docker_import_allowed: Vec::new(),
            admin_tenants: Vec::new(),
        }
    }
}

/// How microVM guests run their CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MicroVmAccel {
    /// KVM when a probe boot succeeds on this host, else TCG (logged either way).
    #[default]
    Auto,
    Kvm,
    /// Software emulation: slower, works everywhere.
    Tcg,
}

/// The `[microvm]` table: the QEMU-based tier.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MicroVmConfig {
    /// The QEMU system emulator (a path, or a name looked up on PATH).
    pub qemu: PathBuf,
    /// qemu-img, for disk overlays.
    pub qemu_img: PathBuf,
    pub accel: MicroVmAccel,
    /// How long a boot may take until the guest agent answers.
    pub boot_timeout_ms: u64,
    /// How long the KVM probe boot may take before KVM is declared unusable.
    pub kvm_probe_timeout_ms: u64,
    /// VMs kept booted ahead of time (also `--microvm-pool`). 0 = none.
    pub pool_size: usize,
    /// Image of the pooled VMs.
    pub pool_image: String,
    /// Guest memory of pooled VMs: a create asking for more boots its own VM.
    pub pool_memory_bytes: u64,
    /// Boot once per image: the first create of an image (per RAM, vCPUs and network device)
    /// boots and keeps a memory snapshot of the freshly booted VM; later creates without a
    /// pooled VM restore it instead of booting. This many are kept at once, on disk under the
    /// state dir (each what the fresh guest touched, ~85 MiB for `minimal`); past it the least
    /// recently used goes. 0: every create boots.
    pub boot_snapshots: usize,
    /// Bytes of disk that MICROVM sandboxes may be promised in total (the sum of their
    /// `disk_bytes`; their qcow2 disks are sparse files under the state dir). Unset: the size
    /// of the state dir's filesystem at start — see `admission`.
    pub disk_pool_bytes: Option<u64>,
}

impl Default for MicroVmConfig {
    fn default() -> Self {
        MicroVmConfig {
            qemu: PathBuf::from("qemu-system-x86_64"),
            qemu_img: PathBuf::from("qemu-img"),
            accel: MicroVmAccel::Auto,
            boot_timeout_ms: 30_000,
            kvm_probe_timeout_ms: 5_000,
            pool_size: 0,
            pool_image: "minimal".into(),
            pool_memory_bytes: 512 << 20,
            boot_snapshots: 4,
            disk_pool_bytes: None,
        }
    }
}

impl MicroVmConfig {
    pub fn boot_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.boot_timeout_ms)
    }

    pub fn kvm_probe_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.kvm_probe_timeout_ms)
    }
}

/// One bearer token: its SHA-256 (hex) and the tenant it stands for. Tokens are never stored in
/// clear: `printf %s "$TOKEN" | sha256sum` gives the value to put here.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    pub tenant: String,
    pub sha256: String,
}

/// The `[auth]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// UNIX-socket peers (SO_PEERCRED) allowed by uid; root is always allowed.
    pub unix_allowed_uids: Vec<u32>,
    /// ... or by gid.
    pub unix_allowed_gids: Vec<u32>,
    /// The tenant of UNIX-socket callers.
    pub unix_tenant: String,
    /// Mode of the socket file: 0600 lets only root connect; widen it (e.g. 0666) to let the
    /// uid/gid lists above decide.
    pub unix_socket_mode: u32,
    /// Bearer tokens for TCP. With none, TCP callers are the `unix_tenant` (a warning is logged).
    pub tokens: Vec<TokenConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig { unix_allowed_uids: Vec::new(), unix_allowed_gids: Vec::new(), unix_tenant: "local".into(), unix_socket_mode: 0o600, tokens: Vec::new() }
    }
}

/// The `[audit]` table: one JSON line per mutating call.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// Default `<state_dir>/audit.jsonl`.
    pub path: Option<PathBuf>,
    /// Rotate when the file passes this size.
    pub max_bytes: u64,
    /// Rotated files kept (`audit.jsonl.1` … `.N`).
    pub keep: usize,
    /// Replace env values of execs with "***" in the log.
    pub redact_env: bool,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig { path: None, max_bytes: 16 << 20, keep: 5, redact_env: true }
    }
}

/// The `[tls]` table: TCP listeners serve TLS (rustls) with this certificate and key (PEM).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The `[telemetry]` table: OpenTelemetry trace export over OTLP/gRPC (see `telemetry`). Off
/// unless `otlp_endpoint` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector: `http://host:4317`, or `https://…` (TLS, webpki roots). None: no export.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute of every span.
    pub service_name: String,
    /// Share of traces the daemon starts itself (no caller `traceparent`) that are exported,
    /// 0.0 to 1.0. A caller's sampled flag is always followed, so its trace stays whole.
    pub sample_ratio: f64,
    /// Finished spans are sent in batches this often (and at shutdown).
    pub batch_delay_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig { otlp_endpoint: None, service_name: "sandboxd".into(), sample_ratio: 1.0, batch_delay_ms: 5000 }
    }
}

impl TelemetryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(endpoint) = &self.otlp_endpoint {
            // Caught here rather than by the exporter so the message names the key; a path is
            // refused because gRPC has none (the collector's service path is fixed).
            let uri = endpoint.parse::<http::Uri>().ok();
            let scheme_ok = uri.as_ref().and_then(|u| u.scheme_str()).is_some_and(|s| s == "http" || s == "https");
            let host_ok = uri.as_ref().and_then(|u| u.host()).is_some_and(|h| !h.is_empty());
            let no_path = uri.as_ref().is_some_and(|u| u.path() == "/" && u.query().is_none());
            if !(scheme_ok && host_ok && no_path) {
                return Err(ConfigError::Invalid(format!("telemetry.otlp_endpoint {endpoint:?}: expected http://host:port or https://host:port")));
            }
        }
        if self.service_name.is_empty() {
            return Err(ConfigError::Invalid("telemetry.service_name must not be empty".into()));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(ConfigError::Invalid(format!("telemetry.sample_ratio = {} must be between 0.0 and 1.0", self.sample_ratio)));
        }
        if self.batch_delay_ms == 0 {
            return Err(ConfigError::Invalid("telemetry.batch_delay_ms must be > 0".into()));
        }
        Ok(())
    }
}

/// Where the daemon listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(std::net::SocketAddr),
}

impl ListenAddr {
    /// Parses `unix:///abs/path`, `tcp://host:port`, or a bare absolute path.
    pub fn parse(addr: &str) -> Result<Self, ConfigError> {
        let bad = || ConfigError::Listen { addr: addr.to_string() };
        if let Some(path) = addr.strip_prefix("unix://") {
            let p = PathBuf::from(path);
            return if p.is_absolute() { Ok(ListenAddr::Unix(p)) } else { Err(bad()) };
        }
        if let Some(hp) = addr.strip_prefix("tcp://") {
            return hp.parse().map(ListenAddr::Tcp).map_err(|_| bad());
        }
        if addr.starts_with('/') {
            return Ok(ListenAddr::Unix(PathBuf::from(addr)));
        }
        Err(bad())
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix://{}", p.display()),
            ListenAddr::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// Where the operator's script-built images are when neither flag nor file says (`make images
/// IMAGES_DIR=…` builds them there). Not `<state_dir>/images`: that is the store of imported
/// images, and the two must never be one directory.
pub const DEFAULT_IMAGES_DIR: &str = "/var/lib/sandboxd/base-images";

/// The effective configuration the daemon runs with.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Vec<ListenAddr>,
    pub state_dir: PathBuf,
    pub images_dir: PathBuf,
    pub log_format: LogFormat,
    pub pool_size_bytes: u64,
    pub limits: LimitsConfig,
    pub exec: ExecConfig,
    pub metrics: Option<std::net::SocketAddr>,
    /// A plaintext listener serving only the gRPC health service (see `server::serve_health`).
    pub health_listen: Option<std::net::SocketAddr>,
    pub policy: Policy,
    pub auth: AuthConfig,
    pub audit: AuditConfig,
    pub tls: Option<TlsConfig>,
    pub telemetry: TelemetryConfig,
    pub microvm: MicroVmConfig,
    pub container: ContainerTierConfig,
    pub process: ProcessTierConfig,
    /// `[network]`: sandbox egress (see `egress`).
    pub network: NetworkConfig,
    pub files: FilesConfig,
    pub connections: ConnectionsConfig,
    pub streams: StreamsConfig,
    pub images: ImagesConfig,
    pub admission: AdmissionConfig,
    pub e2b: E2bConfig,
    /// `[web]`: the operator's page.
    pub web: WebConfig,
    /// `[fleet]`: this daemon is one node of several behind one address (see `fleet`).
    pub fleet: Option<FleetConfig>,
}

impl Config {
    /// Merges flags over the file (if any) over defaults, and validates the result.
    pub fn load(cli: Cli) -> Result<Config, ConfigError> {
        let (file, text) = match &cli.config {
            Some(path) => Self::read_file(path)?,
            None => (FileConfig::default(), String::new()),
        };
        let network_deny = file.network.deny_ranges().map_err(|message| ConfigError::Parse { path: cli.config.clone().unwrap_or_default(), message })?;
        let policy = Policy::new(file.policy, file.limits.default, file.limits.max).with_network_deny(network_deny);
        let line_of = |offset: usize| text.get(..offset).map(|t| t.matches('\n').count() + 1).unwrap_or(0);
        policy.validate(&line_of).map_err(|message| ConfigError::Parse { path: cli.config.clone().unwrap_or_default(), message })?;
        let listen_raw = if !cli.listen.is_empty() { cli.listen } else { file.listen.unwrap_or_else(|| vec![format!("unix://{DEFAULT_SOCKET}")]) };
        let listen = listen_raw.iter().map(|a| ListenAddr::parse(a)).collect::<Result<Vec<_>, _>>()?;
        let state_dir = cli.state_dir.or(file.state_dir).unwrap_or_else(|| PathBuf::from("/var/lib/sandboxd"));
        let pool_size_bytes = cli.pool_size_bytes.or(file.pool_size_bytes).unwrap_or_else(|| default_pool_size(&state_dir));
        let fleet = file.fleet.map(|f| f.resolve(&listen, file.tls.is_some())).transpose()?;
        let cfg = Config {
            listen,
            state_dir,
            images_dir: cli.images_dir.or(file.images_dir).unwrap_or_else(|| PathBuf::from(DEFAULT_IMAGES_DIR)),
            log_format: cli.log_format.or(file.log_format).unwrap_or_default(),
            pool_size_bytes,
            limits: file.limits,
            exec: file.exec,
            metrics: cli.metrics.or(file.metrics),
            health_listen: cli.health_listen.or(file.health_listen),
            policy,
            auth: file.auth,
            audit: file.audit,
            tls: file.tls,
            telemetry: TelemetryConfig { otlp_endpoint: cli.otlp_endpoint.or(file.telemetry.otlp_endpoint), ..file.telemetry },
            microvm: MicroVmConfig { pool_size: cli.microvm_pool.unwrap_or(file.microvm.pool_size), ..file.microvm },
            container: file.container,
            process: file.process,
            network: file.network,
            files: file.files,
            connections: file.connections,
            streams: file.streams,
            images: file.images,
            admission: file.admission,
            e2b: E2bConfig { listen: cli.e2b.or(file.e2b.listen), ..file.e2b },
            web: WebConfig { listen: cli.web.or(file.web.listen), agent_runs_dir: cli.web_agent_runs.or(file.web.agent_runs_dir), ..file.web },
            fleet,
        };
        let cfg = cfg.absolute()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every path from the flags and the file made absolute against the working directory at
    /// start, so no later reader takes it differently (Docker reads a relative bind-mount source
    /// as a volume name; a child started in another directory would miss it). A program name
    /// without a `/` (`qemu-system-x86_64`) stays a name for the PATH lookup.
    fn absolute(mut self) -> Result<Config, ConfigError> {
        fn abs(path: &mut PathBuf, key: &str) -> Result<(), ConfigError> {
            if path.is_relative() {
                *path = std::path::absolute(&*path).map_err(|e| ConfigError::Invalid(format!("{key} = {}: {e}", path.display())))?;
            }
            Ok(())
        }
        abs(&mut self.state_dir, "state_dir")?;
        abs(&mut self.images_dir, "images_dir")?;
        if let Some(path) = &mut self.audit.path {
            abs(path, "audit.path")?;
        }
        if let Some(path) = &mut self.web.agent_runs_dir {
            abs(path, "web.agent_runs_dir")?;
        }
        if let Some(tls) = &mut self.tls {
            abs(&mut tls.cert, "tls.cert")?;
            abs(&mut tls.key, "tls.key")?;
        }
        for (path, key) in [(&mut self.microvm.qemu, "microvm.qemu"), (&mut self.microvm.qemu_img, "microvm.qemu_img")] {
            if path.components().count() > 1 {
                abs(path, key)?;
            }
        }
        Ok(self)
    }

    /// `health_listen` is a port of its own: the same port as another listener of the daemon
    /// would fail at start, and a probe must never land on the API (TLS) by mistake.
    fn validate_health_listen(&self) -> Result<(), ConfigError> {
        let Some(health) = self.health_listen.filter(|h| h.port() != 0) else { return Ok(()) };
        let tcp_listen = self.listen.iter().filter_map(|l| match l {
            ListenAddr::Tcp(a) => Some(("listen", *a)),
            ListenAddr::Unix(_) => None,
        });
        let others = [("metrics", self.metrics), ("e2b.listen", self.e2b.listen), ("web.listen", self.web.listen)];
        for (key, other) in tcp_listen.chain(others.into_iter().filter_map(|(k, a)| a.map(|a| (k, a)))) {
            let same_ip = other.ip() == health.ip() || other.ip().is_unspecified() || health.ip().is_unspecified();
            if other.port() == health.port() && same_ip {
                return Err(ConfigError::Invalid(format!(
                    "health_listen = {health} takes the port of {key} ({other}): the health listener needs a port of its own"
                )));
            }
        }
        Ok(())
    }

    fn read_file(path: &Path) -> Result<(FileConfig, String), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        // toml's messages carry the line and column of the problem.
        let file = toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        Ok((file, text))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.web.trace_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) || !url.contains("{trace_id}") {
                return Err(ConfigError::Invalid(format!("web.trace_url = {url:?} must be an http(s):// URL with {{trace_id}} in it")));
            }
        }
        // Without tokens every caller of the page is the local tenant: only this host may call.
        if let Some(addr) = self.web.listen.filter(|a| !a.ip().is_loopback()) {
            if self.auth.tokens.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "web.listen = {addr} is not a loopback address and [auth] has no tokens: anyone who can reach it would act as the local tenant; listen on 127.0.0.1 or configure [[auth.tokens]]"
                )));
            }
        }
        // The import store lives in <state_dir>/images: an images_dir there would list every
        // imported image as script-built (not removable) and every script-built one as imported.
        if self.images_dir == self.state_dir.join("images") {
            return Err(ConfigError::Invalid(format!(
                "images_dir = {} is the store of imported images (<state_dir>/images): put the script-built images elsewhere (default {DEFAULT_IMAGES_DIR})",
                self.images_dir.display()
            )));
        }
        let (d, m) = (&self.limits.default, &self.limits.max);
        let checks: [(&str, u64, u64); 6] = [
            ("cpu_millicores", d.cpu_millicores.into(), m.cpu_millicores.into()),
            ("memory_bytes", d.memory_bytes, m.memory_bytes),
            ("max_pids", d.max_pids.into(), m.max_pids.into()),
            ("disk_bytes", d.disk_bytes, m.disk_bytes),
            ("exec_timeout_ms", d.exec_timeout_ms, m.exec_timeout_ms),
            ("shm_bytes", d.shm_bytes, m.shm_bytes),
        ];
        let floors = Limits::MINIMUMS;
        let floors: [u64; 6] =
            [floors.cpu_millicores.into(), floors.memory_bytes, floors.max_pids.into(), floors.disk_bytes, floors.exec_timeout_ms, floors.shm_bytes];
        if m.shm_bytes < floors[5] {
            return Err(ConfigError::Invalid(format!("limits.max.shm_bytes = {} is below the minimum {} of a /dev/shm", m.shm_bytes, floors[5])));
        }
        for ((name, default, max), floor) in checks.into_iter().zip(floors) {
            // The default /dev/shm may be 0: half of each sandbox's memory limit.
            if name == "shm_bytes" && default == 0 {
                continue;
            }
            if default == 0 || default > max {
                return Err(ConfigError::Invalid(format!("limits.default.{name} = {default} must be > 0 and <= limits.max.{name} = {max}")));
            }
            // Below the floor every create that leaves the limit at 0 would be refused.
            if default < floor {
                return Err(ConfigError::Invalid(format!("limits.default.{name} = {default} is below the minimum {floor} a sandbox needs to run anything")));
            }
        }
        for (key, value) in [
            ("pool_size_bytes", Some(self.pool_size_bytes)),
            ("microvm.disk_pool_bytes", self.microvm.disk_pool_bytes),
            ("container.disk_pool_bytes", self.container.disk_pool_bytes),
        ] {
            if value.is_some_and(|v| v < floors[3]) {
                return Err(ConfigError::Invalid(format!("{key} must be at least {} (the smallest disk_bytes a sandbox may have)", floors[3])));
            }
        }
        self.streams.validate()?;
        if !(1..=4096).contains(&self.files.max_concurrent_writes) {
            return Err(ConfigError::Invalid(format!("files.max_concurrent_writes = {} must be between 1 and 4096", self.files.max_concurrent_writes)));
        }
        if self.exec.default_max_output_bytes == 0 || self.exec.default_max_output_bytes > self.exec.max_output_bytes_ceiling {
            return Err(ConfigError::Invalid("exec.default_max_output_bytes must be > 0 and <= exec.max_output_bytes_ceiling".into()));
        }
        for t in &self.auth.tokens {
            if t.tenant.is_empty() || t.sha256.len() != 64 || !t.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ConfigError::Invalid(format!("auth.tokens: tenant {:?} needs a non-empty tenant and a 64-hex-digit sha256", t.tenant)));
            }
        }
        if self.auth.unix_socket_mode > 0o777 {
            return Err(ConfigError::Invalid(format!("auth.unix_socket_mode {:o} is not a permission mode", self.auth.unix_socket_mode)));
        }
        if self.listen.is_empty() {
            return Err(ConfigError::Invalid("no listen address".into()));
        }
        self.telemetry.validate()?;
        self.connections.validate()?;
        self.validate_health_listen()?;
        self.admission.validate()?;
        if self.microvm.boot_timeout_ms == 0 || self.microvm.kvm_probe_timeout_ms == 0 {
            return Err(ConfigError::Invalid("microvm.boot_timeout_ms and microvm.kvm_probe_timeout_ms must be > 0".into()));
        }
        if self.microvm.pool_image.is_empty() {
            return Err(ConfigError::Invalid("microvm.pool_image must name an image".into()));
        }
        let i = &self.images;
        if i.max_concurrent == 0 || i.max_concurrent > 64 || i.max_entries == 0 || i.max_archive_bytes == 0 || i.max_rootfs_bytes == 0 || i.max_store_bytes == 0
        {
            return Err(ConfigError::Invalid(
                "images: max_concurrent must be 1-64, and max_entries, max_archive_bytes, max_rootfs_bytes and max_store_bytes above 0".into(),
            ));
        }
        if i.max_concurrent_per_tenant == 0 || (i.max_concurrent > 1 && i.max_concurrent_per_tenant >= i.max_concurrent) {
            return Err(ConfigError::Invalid(format!(
                "images.max_concurrent_per_tenant = {} must be at least 1 and below images.max_concurrent ({}), so one tenant never holds every slot",
                i.max_concurrent_per_tenant, i.max_concurrent
            )));
        }
        for (key, value, floor) in [
            ("images.max_store_bytes_per_tenant", i.max_store_bytes_per_tenant, 1),
            ("images.build_timeout_ms", i.build_timeout_ms, 1000),
            // Docker refuses a memory limit below 6 MiB.
            ("images.build_memory_bytes", i.build_memory_bytes, 6 << 20),
            ("images.build_cpu_millicores", i.build_cpu_millicores.into(), 10),
            ("images.build_max_pids", i.build_max_pids.into(), 8),
            ("images.build_shm_bytes", i.build_shm_bytes, 1 << 20),
        ] {
            if value < floor {
                return Err(ConfigError::Invalid(format!("{key} = {value} is below its minimum {floor}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pool_is_half_the_free_space_but_comfortable_when_that_is_small() {
        const GIB: u64 = 1 << 30;
        assert_eq!(pool_size_for_free(100 * GIB), 50 * GIB, "half of a roomy disk");
        assert_eq!(pool_size_for_free(20 * GIB), 16 * GIB, "16 GiB while under 80% of the free space");
        assert_eq!(pool_size_for_free(10 * GIB), 10 * GIB / 5 * 4, "80% of a small disk");
        assert_eq!(pool_size_for_free(0), 256 << 20, "what mkfs.btrfs needs");
    }

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(ListenAddr::parse("unix:///tmp/s.sock").ok(), Some(ListenAddr::Unix("/tmp/s.sock".into())));
        assert!(matches!(ListenAddr::parse("tcp://127.0.0.1:7000"), Ok(ListenAddr::Tcp(_))));
        assert!(ListenAddr::parse("unix://relative.sock").is_err());
        assert!(ListenAddr::parse("http://x").is_err());
    }

    #[test]
    fn flags_override_file_and_file_overrides_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sandboxd.toml");
        std::fs::write(&path, "state_dir = \"/srv/state\"\nimages_dir = \"/srv/images\"\n[limits.default]\nmemory_bytes = 8388608\n").expect("write");
        let cli = Cli { config: Some(path), images_dir: Some("/flag/images".into()), ..Default::default() };
        let cfg = Config::load(cli).expect("load");
        assert_eq!(cfg.state_dir, PathBuf::from("/srv/state"));
        assert_eq!(cfg.images_dir, PathBuf::from("/flag/images"));
        assert_eq!(cfg.limits.default.memory_bytes, 8 << 20);
        assert_eq!(cfg.limits.default.max_pids, Limits::DEFAULTS.max_pids);
        assert_eq!(cfg.limits.max, Limits::CEILINGS, "an untouched table keeps every ceiling");
        std::fs::write(dir.path().join("max.toml"), "[limits.max]\nmemory_bytes = 1073741824\n").expect("write");
        let cfg = Config::load(Cli { config: Some(dir.path().join("max.toml")), ..Default::default() }).expect("load");
        assert_eq!(cfg.limits.max.memory_bytes, 1 << 30);
        assert_eq!(cfg.limits.max.max_pids, Limits::CEILINGS.max_pids, "unnamed ceilings stay");
    }

    #[test]
    fn relative_paths_from_flags_and_file_are_made_absolute() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sandboxd.toml");
        std::fs::write(&path, "images_dir = \"img\"\n[audit]\npath = \"logs/audit.jsonl\"\n[microvm]\nqemu = \"bin/qemu\"\n").expect("write");
        let cli = Cli { config: Some(path), state_dir: Some("st".into()), ..Default::default() };
        let cfg = Config::load(cli).expect("load");
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(cfg.state_dir, cwd.join("st"));
        assert_eq!(cfg.images_dir, cwd.join("img"));
        assert_eq!(cfg.audit.path, Some(cwd.join("logs/audit.jsonl")));
        assert_eq!(cfg.microvm.qemu, cwd.join("bin/qemu"));
        assert_eq!(cfg.microvm.qemu_img, PathBuf::from("qemu-img"), "a bare program name stays a PATH lookup");
    }

    #[test]
    fn images_dir_may_not_be_the_import_store() {
        let cli = Cli { state_dir: Some("/srv/sbx".into()), images_dir: Some("/srv/sbx/images".into()), ..Default::default() };
        let err = Config::load(cli).expect_err("the import store");
        assert!(err.to_string().contains("store of imported images"), "{err}");
        let cfg = Config::load(Cli { state_dir: Some("/var/lib/sandboxd".into()), ..Default::default() }).expect("defaults");
        assert_ne!(cfg.images_dir, cfg.state_dir.join("images"), "the defaults never collide");
    }

    #[test]
    fn the_commented_example_in_the_repo_is_valid() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sandboxd.toml.example");
        let cfg = Config::load(Cli { config: Some(example), ..Default::default() }).expect("example loads");
        assert_eq!(cfg.listen.len(), 2);
        assert_eq!(cfg.auth.tokens.len(), 1);
        assert_eq!(cfg.policy.max_sandboxes(), Some(500));
        assert_eq!(cfg.limits.max.max_pids, Limits::CEILINGS.max_pids);
        assert_eq!(cfg.telemetry.otlp_endpoint, None, "the example leaves trace export off");
    }

    #[test]
    fn the_page_off_loopback_needs_tokens_and_a_trace_url_needs_its_placeholder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("web.toml");
        let load = |toml: &str| {
            std::fs::write(&path, toml).expect("write");
            Config::load(Cli { config: Some(path.clone()), state_dir: Some(dir.path().join("st")), ..Default::default() })
        };
        let cfg = load("").expect("off by default");
        assert!(cfg.web.listen.is_none() && !cfg.web.allow_destroy);
        let cfg = load("[web]\nlisten = \"127.0.0.1:8090\"\nagent_runs_dir = \"runs\"\n").expect("loopback without tokens");
        assert!(cfg.web.agent_runs_dir.is_some_and(|d| d.is_absolute()), "made absolute");
        let err = load("[web]\nlisten = \"0.0.0.0:8090\"\n").expect_err("anyone would be the local tenant");
        assert!(err.to_string().contains("web.listen = 0.0.0.0:8090"), "{err}");
        let tokens = format!("[[auth.tokens]]\ntenant = \"a\"\nsha256 = \"{}\"\n", "0".repeat(64));
        load(&format!("{tokens}[web]\nlisten = \"0.0.0.0:8090\"\n")).expect("with tokens");
        let err = load("[web]\ntrace_url = \"javascript:alert(1)\"\n").expect_err("not http");
        assert!(err.to_string().contains("web.trace_url"), "{err}");
        load("[web]\ntrace_url = \"http://jaeger:16686/trace/{trace_id}\"\n").expect("a Jaeger link");
    }

    #[test]
    fn unknown_keys_and_bad_limits_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "stat_dir = \"/x\"\n").expect("write");
        let err = Config::load(Cli { config: Some(path.clone()), ..Default::default() }).expect_err("typo refused");
        assert!(err.to_string().contains("stat_dir"), "{err}");
        std::fs::write(&path, "[limits.default]\nmax_pids = 100000\n").expect("write");
        let err = Config::load(Cli { config: Some(path.clone()), ..Default::default() }).expect_err("default over max");
        assert!(err.to_string().contains("max_pids"), "{err}");
        // A default below the floor would make every create that leaves the limit at 0 fail.
        for (toml, key) in [
            ("[limits.default]\ndisk_bytes = 1048576\n", "limits.default.disk_bytes"),
            ("[limits.default]\nmax_pids = 2\n", "limits.default.max_pids"),
            ("[limits.default]\nshm_bytes = 4096\n", "limits.default.shm_bytes"),
            ("[limits.max]\nshm_bytes = 4096\n", "limits.max.shm_bytes"),
            ("[files]\nmax_concurrent_writes = 0\n", "files.max_concurrent_writes"),
            ("[microvm]\ndisk_pool_bytes = 0\n", "microvm.disk_pool_bytes"),
            ("[container]\ndisk_pool_bytes = 1\n", "container.disk_pool_bytes"),
            ("pool_size_bytes = 1024\n", "pool_size_bytes"),
        ] {
            std::fs::write(&path, toml).expect("write");
            let err = Config::load(Cli { config: Some(path.clone()), ..Default::default() }).expect_err(toml);
            assert!(err.to_string().contains(key), "{toml}: {err}");
        }
    }

    #[test]
    fn a_fleet_serving_tls_checks_its_peers_against_a_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).expect("write");
            p.display().to_string()
        };
        let token = file("token", "0123456789abcdef0123");
        let ca = file("ca.pem", "-----BEGIN CERTIFICATE-----\n");
        let fleet = format!("[fleet]\nnode_name = \"node-a\"\naddress = \"10.0.0.2:7070\"\npeers_dns = \"peers.test\"\ntoken_file = \"{token}\"\n");
        let tls = format!("[tls]\ncert = \"{ca}\"\nkey = \"{ca}\"\n");
        let load = |toml: String| {
            let path = file("sandboxd.toml", &toml);
            Config::load(Cli { config: Some(path.into()), ..Default::default() })
        };
        let err = load(format!("{tls}{fleet}")).expect_err("TLS without a CA for the peers");
        assert!(err.to_string().contains("fleet.tls_ca_file"), "{err}");
        let err = load(format!("{fleet}tls_ca_file = \"{ca}\"\n")).expect_err("a CA without TLS");
        assert!(err.to_string().contains("[tls] is not"), "{err}");
        let cfg = load(format!("{tls}{fleet}tls_ca_file = \"{ca}\"\n")).expect("TLS with a CA");
        let peer = cfg.fleet.and_then(|f| f.tls).expect("peers over TLS");
        assert_eq!(peer.server_name, "peers.test", "the headless name by default");
        let cfg = load(fleet.clone()).expect("neither");
        assert!(cfg.fleet.is_some_and(|f| f.tls.is_none()));
    }

    #[test]
    fn the_health_listener_takes_a_port_of_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sandboxd.toml");
        let load = |toml: &str, cli: Cli| {
            std::fs::write(&path, toml).expect("write");
            Config::load(Cli { config: Some(path.clone()), ..cli })
        };
        let cfg = load("", Cli::default()).expect("off by default");
        assert_eq!(cfg.health_listen, None);
        let listen = "listen = [\"tcp://0.0.0.0:7070\"]\nmetrics = \"127.0.0.1:9477\"\n";
        let cfg = load(&format!("{listen}health_listen = \"0.0.0.0:7071\"\n"), Cli::default()).expect("a port of its own");
        assert_eq!(cfg.health_listen, Some("0.0.0.0:7071".parse().expect("addr")));
        let flag = Cli { health_listen: Some("127.0.0.1:7072".parse().expect("addr")), ..Default::default() };
        let cfg = load(&format!("{listen}health_listen = \"0.0.0.0:7071\"\n"), flag).expect("the flag");
        assert_eq!(cfg.health_listen, Some("127.0.0.1:7072".parse().expect("addr")), "the flag wins over the file");
        for (health, key) in [("127.0.0.1:7070", "listen (0.0.0.0:7070)"), ("0.0.0.0:9477", "metrics (127.0.0.1:9477)")] {
            let err = load(&format!("{listen}health_listen = \"{health}\"\n"), Cli::default()).expect_err(health);
            assert!(err.to_string().contains(key), "{health}: {err}");
        }
        load("metrics = \"127.0.0.1:9477\"\nhealth_listen = \"127.0.0.2:9477\"\n", Cli::default()).expect("another address, the same port");
    }

    #[test]
    fn kubernetes_node_names_become_stable_fleet_node_names() {
        assert_eq!(node_name_of_kube_node("kind-worker2"), "kind-worker2");
        assert_eq!(node_name_of_kube_node("ip-10-0-1-23.eu-west-1.compute.internal"), "ip-10-0-1-23");
        assert_eq!(node_name_of_kube_node("Node-A"), "node-a");
        let long = "gke-production-cluster-default-pool-1a2b3c4d-wxyz";
        let a = node_name_of_kube_node(long);
        let b = node_name_of_kube_node("gke-production-cluster-default-pool-1a2b3c4d-wxyq");
        assert!(a.len() <= crate::ids::MAX_NODE_NAME && a.starts_with("gke-production-cluster-defau"), "{a}");
        assert_ne!(a, b, "names that differ past the cut stay distinct");
        assert_eq!(a, node_name_of_kube_node(long), "the same every start");
        for name in [a, b, node_name_of_kube_node("ip-10-0-1-23.ec2.internal")] {
            assert!(crate::ids::NodeName::parse(&name).is_ok(), "{name}");
        }
    }

    #[test]
    fn admission_keys_have_defaults_and_load() {
        let cfg = Config::load(Cli::default()).expect("defaults");
        assert_eq!(cfg.files.max_concurrent_writes, 4);
        assert_eq!((cfg.microvm.disk_pool_bytes, cfg.container.disk_pool_bytes), (None, None), "measured at start unless set");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.toml");
        std::fs::write(&path, "[files]\nmax_concurrent_writes = 1\n[microvm]\ndisk_pool_bytes = 1073741824\n[container]\ndisk_pool_bytes = 2147483648\n")
            .expect("write");
        let cfg = Config::load(Cli { config: Some(path), ..Default::default() }).expect("load");
        assert_eq!((cfg.files.max_concurrent_writes, cfg.microvm.disk_pool_bytes, cfg.container.disk_pool_bytes), (1, Some(1 << 30), Some(2 << 30)));
    }

    #[test]
    fn telemetry_is_off_by_default_and_the_flag_overrides_the_file() {
        let cfg = Config::load(Cli::default()).expect("defaults");
        assert_eq!(cfg.telemetry.otlp_endpoint, None, "no export unless asked for");
        assert_eq!(cfg.telemetry.service_name, "sandboxd");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.toml");
        std::fs::write(&path, "[telemetry]\notlp_endpoint = \"http://collector:4317\"\nservice_name = \"sbx-eu\"\nsample_ratio = 0.25\n").expect("write");
        let cfg = Config::load(Cli { config: Some(path.clone()), ..Default::default() }).expect("load");
        assert_eq!(cfg.telemetry.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        assert_eq!((cfg.telemetry.service_name.as_str(), cfg.telemetry.sample_ratio), ("sbx-eu", 0.25));
        let cli = Cli { config: Some(path), otlp_endpoint: Some("https://otel.example:4317".into()), ..Default::default() };
        let cfg = Config::load(cli).expect("load");
        assert_eq!(cfg.telemetry.otlp_endpoint.as_deref(), Some("https://otel.example:4317"));
        assert_eq!(cfg.telemetry.service_name, "sbx-eu", "the flag replaces only the endpoint");
    }

    #[test]
    fn bad_telemetry_settings_are_refused_naming_the_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.toml");
        for (toml, key) in [
            ("otlp_endpoint = \"127.0.0.1:4317\"", "otlp_endpoint"),
            ("otlp_endpoint = \"grpc://127.0.0.1:4317\"", "otlp_endpoint"),
            ("otlp_endpoint = \"http://127.0.0.1:4317/v1/traces\"", "otlp_endpoint"),
            ("sample_ratio = 1.5", "sample_ratio"),
            ("sample_ratio = -0.1", "sample_ratio"),
            ("service_name = \"\"", "service_name"),
            ("batch_delay_ms = 0", "batch_delay_ms"),
            ("endpoint = \"http://x:4317\"", "endpoint"),
        ] {
            std::fs::write(&path, format!("[telemetry]\n{toml}\n")).expect("write");
            let err = Config::load(Cli { config: Some(path.clone()), ..Default::default() }).expect_err(toml);
            assert!(err.to_string().contains(key), "{toml}: {err}");
        }
        let cli = Cli { otlp_endpoint: Some("not a url".into()), ..Default::default() };
        let err = Config::load(cli).expect_err("bad flag");
        assert!(err.to_string().contains("telemetry.otlp_endpoint"), "{err}");
    }
}
