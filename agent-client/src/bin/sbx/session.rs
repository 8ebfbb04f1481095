//! `sbx exec -i`, `sbx exec -t` and `sbx shell`: an ExecSession driven from the local stdin,
//! signals and window.
//!
//! Three things run at once: the events are read and written out in the main loop; a task
//! feeds the session with stdin, signals and window sizes; a thread reads stdin. They are kept
//! apart because each may wait: a command that does not read its stdin must not stop its
//! output from being shown, and the blocking read of stdin must not keep sbx alive once the
//! command has ended (see `stdin.rs`).

use agent_client::proto::{ExecRequest, ExecSessionStart, ExecStatus, TerminalSize};
use agent_client::{SessionEvent, SessionEvents, SessionInput};
use anyhow::{bail, Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

use crate::cli::ExecArgs;
use crate::terminal::{self, RawMode};
use crate::{exec, json, output, Ctx};

/// Signals sent to sbx are passed on to the command, but the one that makes this many sbx
/// gives up waiting (the command ignores them) and exits at once.
const GIVE_UP_AT: usize = 3;

/// Output kept per stream for `--json`, unless --max-output says otherwise.
const JSON_OUTPUT_LIMIT: u64 = 1 << 20;

/// Runs `args` as an interactive session (`-i`, `-t`); returns the command's exit code.
pub async fn run(ctx: &Ctx, args: ExecArgs) -> Result<u8> {
    let tty = args.tty;
    if tty && !terminal::stdin_is_terminal() {
        bail!(
            "-t needs a terminal: stdin is not a terminal; use -i (without -t) to stream stdin \
             from a pipe or a file"
        );
    }
    if tty && ctx.json {
        bail!("--json cannot be used with -t: a terminal's output is shown as it comes");
    }
    let limit = args.max_output.unwrap_or(JSON_OUTPUT_LIMIT);
    let mut env: std::collections::HashMap<String, String> = args.env.into_iter().collect();
    if tty {
        // A remote terminal is only as good as the program's idea of it.
        let term = std::env::var("TERM").ok().filter(|t| !t.is_empty());
        env.entry("TERM".into())
            .or_insert_with(|| term.unwrap_or_else(|| "xterm".into()));
    }
    let request = ExecRequest {
        env,
        workdir: args.workdir.unwrap_or_default(),
        timeout_ms: args.timeout_ms.unwrap_or(0),
        max_output_bytes: args.max_output.unwrap_or(0),
        idempotency_key: args.idempotency_key.unwrap_or_default(),
        user: args.user.unwrap_or_default(),
        ..agent_client::exec_request(args.id, args.argv)
    };
    let size = if tty { terminal::size() } else { None };
    let start = ExecSessionStart {
        exec: Some(request),
        tty,
        size: size.map(|(rows, cols)| TerminalSize { rows, cols }),
    };
    let session = ctx.client().await?.exec_session(start).await?;
    // From here on every exit path drops this, restoring the terminal.
    let raw = if tty { Some(RawMode::enable()?) } else { None };
    let (input, events) = session.split();

    let signals = Signals::install()?;
    let (give_up_tx, give_up) = oneshot::channel();
    // The feeder stops by itself only once the session is over (its input then fails), which
    // the output reports; so its own end carries nothing to report.
    let feeder = tokio::spawn(feed(input, tty, signals, give_up_tx));
    let output = async {
        if ctx.json {
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            Ok(events.into_result(limit).await?)
        } else {
            show(events).await
        }
    };
    let outcome = tokio::select! {
        result = output => Outcome::Result(Box::new(result?)),
        Ok(signal) = give_up => Outcome::GaveUp(signal),
    };
    feeder.abort();
    drop(raw);
    let result = match outcome {
        Outcome::Result(result) => result,
        Outcome::GaveUp(signal) => {
            output::note(&format!(
                "gave up after {GIVE_UP_AT} signals; the daemon ends the command"
            ))?;
            return Ok(128u8.saturating_add(u8::try_from(signal).unwrap_or(0)));
        }
    };
    if ctx.json {
        output::json(&json::exec_result(&result))?;
        return Ok(exec::exit_code(&result));
    }
    // On a terminal a command ended by a signal was almost always ended by a key (Ctrl-C):
    // saying so would only add a line to the user's screen.
    if tty && result.status() == ExecStatus::Signaled {
        return Ok(exec::exit_code(&result));
    }
    exec::report(&result)
}

enum Outcome {
    Result(Box<agent_client::proto::ExecResult>),
    /// sbx was sent this signal once too often.
    GaveUp(i32),
}

/// Writes the output as it comes; returns the result.
async fn show(mut events: SessionEvents) -> Result<agent_client::proto::ExecResult> {
    while let Some(event) = events.next_event().await? {
        match event {
            SessionEvent::Stdout(chunk) => output::stdout(&chunk)?,
            SessionEvent::Stderr(chunk) => output::stderr(&chunk)?,
            SessionEvent::Finished(result) => return Ok(*result),
        }
    }
    bail!("the exec session ended without a result (was the daemon stopped?)")
}

/// The signals a session handles, installed before it is fed so a failure is reported.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
    quit: Signal,
    winch: Signal,
}

impl Signals {
    fn install() -> Result<Signals> {
        let kind = |kind| signal(kind).context("cannot handle signals");
        Ok(Signals {
            interrupt: kind(SignalKind::interrupt())?,
            terminate: kind(SignalKind::terminate())?,
            hangup: kind(SignalKind::hangup())?,
            quit: kind(SignalKind::quit())?,
            winch: kind(SignalKind::window_change())?,
        })
    }
}

/// Feeds the session: stdin as it arrives then close_stdin at its end, signals sent to sbx,
/// and (on a terminal) the window's size after each SIGWINCH. Tells `give_up` which signal
/// came once too often. Ends when the session's input fails, i.e. the session is over.
async fn feed(
    input: SessionInput,
    tty: bool,
    mut signals: Signals,
    give_up: oneshot::Sender<i32>,
) -> agent_client::Result<()> {
    let mut stdin = crate::stdin::chunks();
    let mut stdin_open = true;
    let mut forwarded = 0;
    loop {
        let signal = tokio::select! {
            chunk = stdin.recv(), if stdin_open => {
                match chunk {
                    Some(bytes) => input.stdin(bytes).await?,
                    None => {
                        stdin_open = false;
                        input.close_stdin().await?;
                    }
                }
                continue;
            }
            Some(()) = signals.winch.recv(), if tty => {
                if let Some((rows, cols)) = terminal::size() {
                    input.resize(rows, cols).await?;
                }
                continue;
            }
            Some(()) = signals.interrupt.recv() => libc::SIGINT,
            Some(()) = signals.terminate.recv() => libc::SIGTERM,
            Some(()) = signals.hangup.recv() => libc::SIGHUP,
            Some(()) = signals.quit.recv() => libc::SIGQUIT,
        };
        forwarded += 1;
        if forwarded >= GIVE_UP_AT {
            let _ = give_up.send(signal);
            return Ok(());
        }
        input.signal(signal).await?;
    }
}
