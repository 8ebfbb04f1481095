//! Boot progress and errors on the VM's console (ttyS0, which the host logs to a file).
//!
//! Every line starts with `sandbox-agent:` so the host can tell the agent's lines from the
//! kernel's. Before `/dev` exists (the first microseconds of boot) and in unit tests, lines go to
//! stderr instead.

use std::fs::File;
use std::io::Write;
use std::sync::OnceLock;

static CONSOLE: OnceLock<File> = OnceLock::new();

/// Opens `/dev/console` for every later line. Called once `/dev` is mounted.
pub fn open() {
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open("/dev/console") {
        let _ = CONSOLE.set(f);
    }
}

/// Writes one line, `sandbox-agent: ` first. Never fails: a console that cannot be written to
/// must not take the agent down.
pub fn line(args: std::fmt::Arguments<'_>) {
    // One write per line, so lines of concurrent threads do not interleave.
    let text = format!("sandbox-agent: {args}\n");
    match CONSOLE.get() {
        Some(mut f) => {
            let _ = f.write_all(text.as_bytes());
        }
        None => {
            let _ = std::io::stderr().write_all(text.as_bytes());
        }
    }
}

/// `log!("...", args)`: one line on the console.
macro_rules! log {
    ($($arg:tt)*) => { $crate::agent::console::line(format_args!($($arg)*)) };
}
pub(crate) use log;
