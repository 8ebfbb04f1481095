//! `sbx exec`, `wait`, `kill` and `execs`.

use agent_client::proto::{exec_event, ExecRequest, ExecResult, ExecStatus};
use anyhow::{bail, Context, Result};
use tokio::io::AsyncReadExt;

use crate::cli::ExecArgs;
use crate::parse::signal_name;
use crate::{json, output, Ctx};

/// Exit code when the exec's outcome is unknown: LOST, or a status this build does not know.
const EXIT_UNKNOWN: u8 = 255;

/// Runs a command. In the foreground without `--json` its output is streamed as it comes.
pub async fn exec(ctx: &Ctx, args: ExecArgs) -> Result<u8> {
    if args.interactive || args.tty {
        return crate::session::run(ctx, args).await;
    }
    let mut request = ExecRequest {
        env: args.env.into_iter().collect(),
        workdir: args.workdir.unwrap_or_default(),
        timeout_ms: args.timeout_ms.unwrap_or(0),
        max_output_bytes: args.max_output.unwrap_or(0),
        idempotency_key: args.idempotency_key.unwrap_or_default(),
        background: args.background,
        user: args.user.unwrap_or_default(),
        ..agent_client::exec_request(args.id, args.argv)
    };
    if args.stdin {
        tokio::io::stdin()
            .read_to_end(&mut request.stdin)
            .await
            .context("cannot read stdin")?;
    }
    let client = ctx.client().await?;

    if args.background {
        let result = client.exec(request).await?;
        if ctx.json {
            output::json(&json::exec_result(&result))?;
        } else {
            output::line(&result.exec_id)?;
        }
        return Ok(0);
    }
    if ctx.json {
        let result = client.exec(request).await?;
        output::json(&json::exec_result(&result))?;
        return Ok(exit_code(&result));
    }

    let mut stream = client.exec_stream(request).await?;
    while let Some(event) = stream.next_event().await? {
        match event.event {
            Some(exec_event::Event::Stdout(chunk)) => output::stdout(&chunk)?,
            Some(exec_event::Event::Stderr(chunk)) => output::stderr(&chunk)?,
            Some(exec_event::Event::Result(result)) => return report(&result),
            None => {}
        }
    }
    bail!("the exec stream ended without a result (was the daemon stopped?)")
}

/// Waits for an exec and presents its result like `sbx exec` does.
pub async fn wait(ctx: &Ctx, exec_id: String) -> Result<u8> {
    let result = ctx.client().await?.get_exec(exec_id, true).await?;
    if ctx.json {
        output::json(&json::exec_result(&result))?;
        return Ok(exit_code(&result));
    }
    output::stdout(&result.stdout)?;
    output::stderr(&result.stderr)?;
    report(&result)
}

/// Sends a signal to an exec.
pub async fn kill(ctx: &Ctx, exec_id: String, signal: i32) -> Result<u8> {
    ctx.client()
        .await?
        .signal_exec(exec_id.as_str(), signal)
        .await?;
    if ctx.json {
        output::json(&serde_json::json!({ "exec_id": exec_id, "signal": signal }))?;
    }
    Ok(0)
}

/// Lists a sandbox's execs, following ListExecs' pages to the end (metadata only, so the
/// whole history of a sandbox stays small).
pub async fn list(ctx: &Ctx, sandbox_id: String, limit: u32) -> Result<u8> {
    let execs = ctx.client().await?.list_execs(sandbox_id, limit).await?;
    if ctx.json {
        output::json(&execs.iter().map(json::exec_result).collect())?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = execs
        .iter()
        .map(|e| {
            vec![
                e.exec_id.clone(),
                output::exec_status(e.status),
                e.exit_code.to_string(),
                output::time(e.started_at.as_ref()),
                format!("{}ms", e.duration_ms),
                output::ellipsize(&e.argv.join(" "), 60),
            ]
        })
        .collect();
    output::stdout(
        output::table(
            &["EXEC_ID", "STATUS", "CODE", "STARTED", "DURATION", "ARGV"],
            &rows,
        )
        .as_bytes(),
    )?;
    Ok(0)
}

/// Explains on stderr how the exec ended, unless it simply exited, and returns its exit code.
pub fn report(result: &ExecResult) -> Result<u8> {
    for (stream, truncated, total, spill) in [
        (
            "stdout",
            result.stdout_truncated,
            result.stdout_total_bytes,
            &result.stdout_spill_path,
        ),
        (
            "stderr",
            result.stderr_truncated,
            result.stderr_total_bytes,
            &result.stderr_spill_path,
        ),
    ] {
        if truncated {
            let kept = if spill.is_empty() {
                String::new()
            } else {
                format!("; all of it is in the sandbox at {spill}")
            };
            output::note(&format!(
                "{stream} truncated: the command wrote {}{kept}",
                output::size(total)
            ))?;
        }
    }
    let signal =
        || signal_name(result.signal).unwrap_or_else(|| format!("signal {}", result.signal));
    match ExecStatus::try_from(result.status) {
        Ok(ExecStatus::Exited) => {}
        Ok(ExecStatus::Signaled) => output::note(&format!("killed by {}", signal()))?,
        Ok(ExecStatus::TimedOut) => {
            output::note(&format!("timed out after {}ms", result.duration_ms))?
        }
        Ok(ExecStatus::OomKilled) => output::note("killed: out of memory")?,
        Ok(ExecStatus::SpawnFailed) => {
            output::note(&or(&result.error, "the command could not be started"))?
        }
        Ok(ExecStatus::Lost) => output::note(&format!(
            "exec lost: {}",
            or(&result.error, "the sandbox or daemon died under it")
        ))?,
        Ok(ExecStatus::Running) => {
            output::note(&format!("exec {} is still running", result.exec_id))?
        }
        Ok(ExecStatus::Unspecified) | Err(_) => {
            output::note(&format!("exec ended with unknown status {}", result.status))?
        }
    }
    Ok(exit_code(result))
}

fn or(text: &str, fallback: &str) -> String {
    if text.is_empty() {
        fallback.to_owned()
    } else {
        text.to_owned()
    }
}

/// The exit code `sbx` passes on for an exec, as the API defines `exit_code` per status.
pub fn exit_code(result: &ExecResult) -> u8 {
    let code = match ExecStatus::try_from(result.status) {
        Ok(ExecStatus::Exited) => result.exit_code,
        // Should the daemon leave exit_code at 0, fall back on the shell's convention.
        Ok(ExecStatus::Signaled | ExecStatus::TimedOut | ExecStatus::OomKilled)
            if result.exit_code == 0 =>
        {
            128 + result.signal.max(1)
        }
        Ok(ExecStatus::Signaled | ExecStatus::TimedOut | ExecStatus::OomKilled) => result.exit_code,
        Ok(ExecStatus::SpawnFailed) if result.exit_code == 0 => 127,
        Ok(ExecStatus::SpawnFailed) => result.exit_code,
        Ok(ExecStatus::Lost | ExecStatus::Running | ExecStatus::Unspecified) | Err(_) => {
            return EXIT_UNKNOWN
        }
    };
    u8::try_from(code).unwrap_or(EXIT_UNKNOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: ExecStatus, exit_code: i32, signal: i32) -> ExecResult {
        ExecResult {
            status: status as i32,
            exit_code,
            signal,
            ..Default::default()
        }
    }

    #[test]
    fn exit_codes_follow_the_status() {
        assert_eq!(exit_code(&result(ExecStatus::Exited, 0, 0)), 0);
        assert_eq!(exit_code(&result(ExecStatus::Exited, 3, 0)), 3);
        assert_eq!(exit_code(&result(ExecStatus::Signaled, 137, 9)), 137);
        assert_eq!(exit_code(&result(ExecStatus::Signaled, 0, 15)), 143);
        assert_eq!(exit_code(&result(ExecStatus::TimedOut, 137, 9)), 137);
        assert_eq!(exit_code(&result(ExecStatus::OomKilled, 137, 9)), 137);
        assert_eq!(exit_code(&result(ExecStatus::SpawnFailed, 126, 0)), 126);
        assert_eq!(exit_code(&result(ExecStatus::SpawnFailed, 0, 0)), 127);
        assert_eq!(exit_code(&result(ExecStatus::Lost, 0, 0)), 255);
        assert_eq!(exit_code(&result(ExecStatus::Running, 0, 0)), 255);
        assert_eq!(
            exit_code(&ExecResult {
                status: 99,
                ..Default::default()
            }),
            255
        );
        assert_eq!(exit_code(&result(ExecStatus::Exited, -1, 0)), 255);
    }
}
