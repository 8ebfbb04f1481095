//! A daemon and a client connected to it, for the suites that drive one sandbox tier through
//! many calls.

use agent_client::proto::{CreateSandboxRequest, ExecRequest, ExecResult, Isolation, ResourceLimits};
use agent_client::Client;

use crate::{exec, process_sandbox, sandbox_request, sh, sh_ok, within, Daemon};

/// A daemon with the default configuration, a client, and one sandbox of `isolation` (image
/// `minimal`, created within 120 s) on it; panics when any of that fails.
pub async fn daemon_with_sandbox(isolation: Isolation) -> (Daemon, Client, String) {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let id = within(120, client.create(sandbox_request(isolation, "minimal"))).await.expect("CreateSandbox").id;
    (daemon, client, id)
}

/// A daemon and a client connected to it. On a failing assertion the daemon's log is printed,
/// because "exit 137" alone rarely says why.
pub struct Harness {
    /// The daemon, started for this test alone.
    pub daemon: Daemon,
    /// A client connected to it (replace it after a restart).
    pub client: Client,
}

impl Harness {
    /// A daemon with the default configuration; panics when it cannot start.
    pub async fn start() -> Harness {
        Self::start_with_config("").await
    }

    /// A daemon with extra TOML configuration; panics when it cannot start.
    pub async fn start_with_config(toml: &str) -> Harness {
        Self::start_with(toml, &[]).await
    }

    /// A daemon with extra TOML configuration and command-line flags; panics when it cannot start.
    pub async fn start_with(toml: &str, args: &[&str]) -> Harness {
        let daemon = Daemon::start_with(toml, args).await.expect("starting sandboxd");
        let client = daemon.client().await.expect("connecting to sandboxd");
        Harness { daemon, client }
    }

    /// Creates a process-tier sandbox of `image` with `limits` and returns its id.
    pub async fn sandbox_with(&self, image: &str, limits: ResourceLimits) -> String {
        let request = CreateSandboxRequest { limits: Some(limits), ..process_sandbox(image) };
        let sandbox = within(60, self.client.create(request)).await.expect("CreateSandbox");
        assert!(sandbox.id.starts_with("sb-"), "sandbox id {:?}", sandbox.id);
        sandbox.id
    }

    /// Creates a default process-tier sandbox of `minimal` and returns its id.
    pub async fn sandbox(&self) -> String {
        self.sandbox_with("minimal", ResourceLimits::default()).await
    }

    /// One `Exec` (bounded); the call must succeed, whatever the command did.
    pub async fn exec(&self, request: ExecRequest) -> ExecResult {
        exec(&self.client, request).await
    }

    /// Runs `sh -c script` and returns the result.
    pub async fn sh(&self, id: &str, script: &str) -> ExecResult {
        sh(&self.client, id, script).await
    }

    /// Runs `sh -c script`, asserts it exited 0, and returns its stdout.
    pub async fn sh_ok(&self, id: &str, script: &str) -> String {
        sh_ok(&self.client, id, script).await
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- sandboxd log ----\n{}\n---- end of sandboxd log ----", self.daemon.log());
        }
    }
}
