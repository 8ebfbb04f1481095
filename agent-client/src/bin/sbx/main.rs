//! `sbx`: the command line of sandboxd.
//!
//! Exit codes: 0 on success; for `exec`, `shell` and `wait`, the command's own exit code; 1
//! when `sbx` itself fails (connection, gRPC status, local I/O, a refused archive), with
//! `sbx: <message>` on stderr; 2 for usage errors (clap's convention).

mod agent;
mod cli;
mod exec;
mod files;
mod image;
mod json;
mod mcp;
mod output;
mod parse;
mod sandbox;
mod session;
mod snapshot;
mod stdin;
mod terminal;

use std::process::ExitCode;

use agent_client::Client;
use anyhow::Result;
use clap::Parser;

use crate::cli::{Cli, Command};

/// What every command needs: how to reach the daemon and how to print.
pub struct Ctx {
    socket: Option<String>,
    token: Option<String>,
    /// `--json`: machine output.
    pub json: bool,
}

impl Ctx {
    /// Connects to the daemon. Commands call this only after checking their own arguments, so a
    /// usage mistake is reported as such even when no daemon is running.
    pub async fn client(&self) -> Result<Client> {
        let default = agent_client::default_socket();
        let addr = self
            .socket
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(default);
        let client = Client::connect(addr).await?;
        match self.token.as_deref().filter(|t| !t.is_empty()) {
            Some(token) => Ok(client.with_token(token)?),
            None => Ok(client),
        }
    }
}

async fn run(cli: Cli) -> Result<u8> {
    let ctx = Ctx {
        socket: cli.socket,
        token: cli.token,
        json: cli.json,
    };
    match cli.command {
        Command::Create(args) => {
            sandbox::create(&ctx, args.spec.to_request(args.from_snapshot)).await
        }
        Command::Fork { snapshot, spec } => {
            sandbox::create(&ctx, spec.to_request(Some(snapshot))).await
        }
        Command::Ls { labels } => sandbox::list(&ctx, labels).await,
        Command::Get { id } => sandbox::get(&ctx, id).await,
        Command::Ttl { id, secs } => sandbox::set_ttl(&ctx, id, secs).await,
        Command::Pause { id } => sandbox::pause(&ctx, id).await,
        Command::Resume { id, ttl } => sandbox::resume(&ctx, id, ttl).await,
        Command::Net {
            command: cli::NetCommand::Log { id, limit },
        } => sandbox::network_log(&ctx, id, limit).await,
        Command::Rm { ids } => sandbox::remove(&ctx, ids).await,
        Command::Exec(args) => exec::exec(&ctx, args).await,
        Command::Wait { exec_id } => exec::wait(&ctx, exec_id).await,
        Command::Kill { exec_id, signal } => exec::kill(&ctx, exec_id, signal).await,
        Command::Execs { id, limit } => exec::list(&ctx, id, limit).await,
        Command::Cp {
            recursive,
            src,
            dst,
        } => files::copy(&ctx, &src, &dst, recursive).await,
        Command::Shell(args) => session::run(&ctx, args.into_exec()).await,
        Command::Snapshot {
            id,
            name,
            no_memory,
        } => snapshot::create(&ctx, id, name, no_memory).await,
        Command::Snapshots { id } => snapshot::list(&ctx, id).await,
        Command::Rollback { id, snapshot } => snapshot::rollback(&ctx, id, snapshot).await,
        Command::Rmsnap { snapshot } => snapshot::delete(&ctx, snapshot).await,
        Command::Agent(command) => agent::agent(&ctx, command).await,
        Command::Image(command) => image::image(&ctx, command).await,
        Command::Mcp(args) => mcp::serve(&ctx, args).await,
    }
}

// One thread is plenty: `sbx` does one call at a time.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            let _ = output::stderr(format!("sbx: {}\n", message(&err)).as_bytes());
            ExitCode::from(1)
        }
    }
}

/// The error and its causes on one line, `outer: inner: …`.
///
/// Like anyhow's `{:#}`, except that a cause repeating the one before it is left out: tonic's
/// transport errors nest the same I/O error twice ("No such file or directory … : No such file
/// or directory …").
fn message(err: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_causes_are_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let err = anyhow::Error::new(io)
            .context("no such file")
            .context("cannot connect");
        assert_eq!(message(&err), "cannot connect: no such file");
    }

    #[test]
    fn status_errors_show_code_and_message() {
        let err = anyhow::Error::new(agent_client::Error::from(tonic::Status::not_found(
            "sandbox sb-123 not found",
        )));
        assert_eq!(message(&err), "NOT_FOUND: sandbox sb-123 not found");
    }
}
