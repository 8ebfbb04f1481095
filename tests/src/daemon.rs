//! The real `sandboxd` binary, started on a UNIX socket in a temp dir of its own, and where its
//! binaries and images are found.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent_client::Client;
use anyhow::{bail, Context, Result};

use crate::host::mounts_under;

/// The workspace root (this crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// The `sandboxd` binary: `$SANDBOXD_BIN`, else next to this test executable's target dir.
pub fn sandboxd_bin() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("SANDBOXD_BIN") {
        return Ok(PathBuf::from(p));
    }
    // Test binaries run from target/<profile>/deps/; binaries sit in target/<profile>/.
    let exe = std::env::current_exe().context("locating the test executable")?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("sandboxd");
    if !bin.is_file() {
        bail!("sandboxd binary not found at {} — run `cargo build -p sandboxd` (make test does) or set SANDBOXD_BIN", bin.display());
    }
    Ok(bin)
}

/// The `sbx` command line, built next to `sandboxd` (by `cargo build -p agent-client`).
pub fn sbx_bin() -> Result<PathBuf> {
    let bin = sandboxd_bin()?.with_file_name("sbx");
    if !bin.is_file() {
        bail!("sbx binary not found at {} — run `cargo build -p agent-client` (or `cargo build --workspace --bins`)", bin.display());
    }
    Ok(bin)
}

/// The images directory: `$SANDBOXD_IMAGES_DIR`, else `<root>/images/build`.
pub fn images_dir() -> PathBuf {
    std::env::var("SANDBOXD_IMAGES_DIR").map(PathBuf::from).unwrap_or_else(|_| workspace_root().join("images/build"))
}

/// Fails loudly when the machine cannot run the end-to-end tests.
pub fn require_environment() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("end-to-end tests need root (namespaces, cgroups, mounts); run them as root, as CI does");
    }
    let minimal = images_dir().join("minimal/image.json");
    if !minimal.is_file() {
        bail!("image 'minimal' is not built ({} missing) — run `make images`", minimal.display());
    }
    Ok(())
}

/// The storage pool of a test daemon unless the test passes `--pool-size-bytes` itself.
pub const TEST_POOL_BYTES: u64 = 256 << 30;

/// A running daemon with its own state dir and socket.
pub struct Daemon {
    child: Option<Child>,
    dir: tempfile::TempDir,
    config: Option<PathBuf>,
    extra_args: Vec<String>,
    /// A host file the daemon inherits open (read-write) as fd 9, as if started with `9<>file`.
    inherited: Option<PathBuf>,
    /// Leave the pool file at the daemon's default size (no `--pool-size-bytes`).
    default_pool: bool,
    /// A named network namespace (`ip netns add`) to run the daemon in.
    netns: Option<String>,
    /// Environment variables of the daemon beyond the test's own (e.g. `DOCKER_HOST`).
    env: Vec<(String, String)>,
    /// `unix:///…/sandboxd.sock`
    pub address: String,
}

impl Daemon {
    /// Starts a daemon with the default configuration.
    pub async fn start() -> Result<Daemon> {
        Self::start_with_config("").await
    }

    /// Starts a daemon with extra TOML configuration (e.g. `[limits.max]` ceilings).
    pub async fn start_with_config(toml: &str) -> Result<Daemon> {
        Self::start_with(toml, &[]).await
    }

    /// Starts a daemon with extra TOML configuration and extra command-line flags (e.g. another
    /// `--listen tcp://…`, `--metrics …`, `--log-format json`).
    pub async fn start_with(toml: &str, extra_args: &[&str]) -> Result<Daemon> {
        require_environment()?;
        let dir = tempfile::Builder::new().prefix("sandboxd-test-").tempdir().context("creating temp dir")?;
        let config = if toml.is_empty() {
            None
        } else {
            let path = dir.path().join("sandboxd.toml");
            std::fs::write(&path, toml).context("writing config")?;
            Some(path)
        };
        let address = format!("unix://{}", dir.path().join("sandboxd.sock").display());
        let extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        let mut daemon = Daemon { child: None, dir, config, extra_args, inherited: None, default_pool: false, netns: None, env: Vec::new(), address };
        daemon.spawn().await?;
        Ok(daemon)
    }

    /// Starts a daemon with extra TOML configuration and `env` in its environment (e.g.
    /// `DOCKER_HOST` naming another Docker Engine).
    pub async fn start_with_env(toml: &str, env: &[(&str, &str)]) -> Result<Daemon> {
        require_environment()?;
        let dir = tempfile::Builder::new().prefix("sandboxd-test-").tempdir().context("creating temp dir")?;
        let path = dir.path().join("sandboxd.toml");
        std::fs::write(&path, toml).context("writing config")?;
        let address = format!("unix://{}", dir.path().join("sandboxd.sock").display());
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut daemon =
            Daemon { child: None, dir, config: Some(path), extra_args: Vec::new(), inherited: None, default_pool: false, netns: None, env, address };
        daemon.spawn().await?;
        Ok(daemon)
    }

    /// Starts a daemon inside the network namespace `netns` (made by `ip netns add`; only the
    /// network is switched, with `nsenter --net`, so the daemon sees the host's mounts and
    /// cgroups), with its UNIX socket outside as usual. `toml` is written to the daemon's dir
    /// after `{dir}` in it is replaced by that dir.
    pub async fn start_in_netns(netns: &str, toml: &str, extra_args: &[&str]) -> Result<Daemon> {
        require_environment()?;
        let dir = tempfile::Builder::new().prefix("sandboxd-test-").tempdir().context("creating temp dir")?;
        let path = dir.path().join("sandboxd.toml");
        std::fs::write(&path, toml.replace("{dir}", &dir.path().display().to_string())).context("writing config")?;
        let address = format!("unix://{}", dir.path().join("sandboxd.sock").display());
        let extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        let mut daemon = Daemon {
            child: None,
            dir,
            config: Some(path),
            extra_args,
            inherited: None,
            default_pool: false,
            netns: Some(netns.to_string()),
            env: Vec::new(),
            address,
        };
        daemon.spawn().await?;
        Ok(daemon)
    }

    /// Starts a daemon exactly as configured by `toml` (empty: every built-in default, the pool
    /// file's size included), for the tests of what the defaults allow.
    pub async fn start_with_defaults(toml: &str) -> Result<Daemon> {
        require_environment()?;
        let dir = tempfile::Builder::new().prefix("sandboxd-test-").tempdir().context("creating temp dir")?;
        let config = if toml.is_empty() {
            None
        } else {
            let path = dir.path().join("sandboxd.toml");
            std::fs::write(&path, toml).context("writing config")?;
            Some(path)
        };
        let address = format!("unix://{}", dir.path().join("sandboxd.sock").display());
        let mut daemon =
            Daemon { child: None, dir, config, extra_args: Vec::new(), inherited: None, default_pool: true, netns: None, env: Vec::new(), address };
        daemon.spawn().await?;
        Ok(daemon)
    }

    /// Starts a daemon that inherits `host_file` open read-write on fd 9 (not close-on-exec),
    /// the way a careless service manager or shell redirection would hand it one.
    pub async fn start_inheriting(host_file: &Path) -> Result<Daemon> {
        require_environment()?;
        let dir = tempfile::Builder::new().prefix("sandboxd-test-").tempdir().context("creating temp dir")?;
        let address = format!("unix://{}", dir.path().join("sandboxd.sock").display());
        let mut daemon = Daemon {
            child: None,
            dir,
            config: None,
            extra_args: Vec::new(),
            inherited: Some(host_file.to_path_buf()),
            default_pool: false,
            netns: None,
            env: Vec::new(),
            address,
        };
        daemon.spawn().await?;
        Ok(daemon)
    }

    /// The temp dir holding the socket, state dir and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The daemon's state dir.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The daemon's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn socket_path(&self) -> PathBuf {
        self.dir.path().join("sandboxd.sock")
    }

    async fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("sandboxd.log")).context("opening daemon log")?;
        let mut cmd = match &self.netns {
            // nsenter execs the daemon in place: the child's pid is the daemon's.
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(sandboxd_bin()?);
                c
            }
            None => Command::new(sandboxd_bin()?),
        };
        cmd.arg("--listen")
            .arg(&self.address)
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--images-dir")
            .arg(images_dir())
            .env("RUST_LOG", std::env::var("SANDBOXD_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(c) = &self.config {
            cmd.arg("--config").arg(c);
        }
        // Sparse: only what sandboxes write is ever allocated. Large, because the daemon admits
        // no more sandboxes than the pool holds at their disk_bytes (1 GiB by default) and load
        // tests keep a hundred alive; a test about the pool passes its own size.
        if !self.default_pool && !self.extra_args.iter().any(|a| a.starts_with("--pool-size-bytes")) {
            cmd.arg("--pool-size-bytes").arg(TEST_POOL_BYTES.to_string());
        }
        cmd.args(&self.extra_args);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let inherited = match &self.inherited {
            Some(path) => Some(std::fs::OpenOptions::new().read(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?),
            None => None,
        };
        if let Some(file) = &inherited {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let fd = file.as_raw_fd();
            // SAFETY: dup2 is async-signal-safe; it only places the file on fd 9 (without
            // CLOEXEC) in the child between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::dup2(fd, 9) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let _ = std::fs::remove_file(self.socket_path());
        self.child = Some(cmd.spawn().context("starting sandboxd")?);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.socket_path().exists() {
                if let Ok(c) = Client::connect(&self.address).await {
                    if c.list(Default::default()).await.is_ok() {
                        return Ok(());
                    }
                }
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    bail!("sandboxd exited during startup ({status}); log:\n{}", self.log());
                }
            }
            if Instant::now() > deadline {
                bail!("sandboxd not answering after 20 s; log:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A new client connection.
    pub async fn client(&self) -> Result<Client> {
        Client::connect(&self.address).await.context("connecting to sandboxd")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sandboxd.log")).unwrap_or_default()
    }

    /// Kills the daemon with SIGKILL (no cleanup) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the daemon again on the same state dir and socket.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill9();
        self.spawn().await
    }

    /// The daemon's exit status if it has ended (by itself: a drain), reaping it; None while it
    /// runs.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        let Some(child) = self.child.as_mut() else { bail!("daemon not started") };
        let status = child.try_wait().context("checking whether the daemon has ended")?;
        if status.is_some() {
            self.child = None;
        }
        Ok(status)
    }

    /// Graceful stop: SIGTERM, then wait (bounded). Returns the exit status.
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        let Some(mut child) = self.child.take() else { bail!("daemon not running") };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).context("sending SIGTERM")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("sandboxd did not stop within 30 s of SIGTERM; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.is_some() {
            // Graceful, so the daemon unmounts its pool and removes its cgroups.
            let _ = self.stop();
        }
        // A stopped daemon keeps its containers for re-adoption, and a test's state dir is never
        // reused: remove them, or every run of the container-tier tests leaves some behind.
        crate::host::remove_containers_of(&self.state_dir());
        // A killed daemon leaves its mounts (the state dir's own bind mount, the pool, overlay
        // roots); never let TempDir recurse into a mount. Deepest first.
        let mut mounts = mounts_under(&self.state_dir());
        mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Runs `sbx --socket <daemon> args…` (none of the caller's `SANDBOXD_*` settings) to completion
/// within `secs` and returns its output; a hang is a failure naming the command.
pub async fn run_sbx(daemon: &Daemon, args: &[&str], secs: u64) -> std::process::Output {
    let run = tokio::process::Command::new(sbx_bin().expect("locating sbx"))
        .arg("--socket")
        .arg(&daemon.address)
        .args(args)
        .env_remove("SANDBOXD_SOCKET")
        .env_remove("SANDBOXD_TOKEN")
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(std::time::Duration::from_secs(secs), run).await {
        Ok(out) => out.expect("running sbx"),
        Err(_) => panic!("sbx {args:?} did not finish within {secs} s"),
    }
}
