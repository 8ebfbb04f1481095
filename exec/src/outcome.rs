//! How an exec ended, decided the same way on every tier: the process tier's daemon, the
//! container tier's daemon and the microVM's guest agent each observe a main process's end (an
//! exit code, a signal, or nothing they could read), whether they stopped waiting for a timeout
//! or a cancellation, and how many OOM kills its cgroup saw — and [`classify`] turns that into the
//! status, exit code and signal of the `ExecResult`.

use serde::{Deserialize, Serialize};

/// How the main process ended, as observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// Its end could not be read (the status was lost, or the runtime could not ask).
    Unknown,
}

/// Why the runtime stopped waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// It ended by itself.
    Ended,
    /// Its timeout passed and its whole tree was killed.
    TimedOut,
    /// The caller went away (or asked) and its whole tree was killed.
    Cancelled,
}

/// The status of an exec that ran, as every tier reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndStatus {
    Exited,
    Signaled,
    TimedOut,
    OomKilled,
    /// Its end is unknown: `exit_code` -1, and the record's error says [`UNKNOWN_EXIT`].
    Lost,
}

/// The error sentence of an exec whose end could not be observed.
pub const UNKNOWN_EXIT: &str = "exit status unknown";

/// Status, exit code (the code, or 128 + signal) and signal (0 if none) of an exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classified {
    pub status: EndStatus,
    pub exit_code: i32,
    pub signal: i32,
}

/// The one table: see the test below for every row.
pub fn classify(cause: Cause, exit: Exit, oom_kills: u64) -> Classified {
    let kill = libc::SIGKILL;
    let c = |status, exit_code, signal| Classified { status, exit_code, signal };
    match (cause, exit) {
        (Cause::TimedOut, _) => c(EndStatus::TimedOut, 128 + kill, kill),
        (Cause::Cancelled, _) => c(EndStatus::Signaled, 128 + kill, kill),
        // The OOM killer fired in this exec's cgroup and the command did not succeed: the command
        // (or the child it was waiting for) was the victim.
        (Cause::Ended, Exit::Signal(s)) if s == kill && oom_kills > 0 => c(EndStatus::OomKilled, 128 + kill, kill),
        (Cause::Ended, Exit::Code(code)) if code != 0 && oom_kills > 0 => c(EndStatus::OomKilled, 128 + kill, kill),
        (Cause::Ended, Exit::Signal(s)) => c(EndStatus::Signaled, 128 + s, s),
        (Cause::Ended, Exit::Code(code)) => c(EndStatus::Exited, code, 0),
        (Cause::Ended, Exit::Unknown) => c(EndStatus::Lost, -1, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use Cause::*;
        use EndStatus as S;
        let rows = [
            (Ended, Exit::Code(0), 0, S::Exited, 0, 0),
            (Ended, Exit::Code(3), 0, S::Exited, 3, 0),
            (Ended, Exit::Code(3), 1, S::OomKilled, 137, 9),
            (Ended, Exit::Code(0), 1, S::Exited, 0, 0),
            (Ended, Exit::Signal(15), 0, S::Signaled, 143, 15),
            (Ended, Exit::Signal(9), 0, S::Signaled, 137, 9),
            (Ended, Exit::Signal(9), 2, S::OomKilled, 137, 9),
            (Ended, Exit::Signal(15), 2, S::Signaled, 143, 15),
            (Ended, Exit::Signal(40), 0, S::Signaled, 168, 40),
            (Ended, Exit::Unknown, 0, S::Lost, -1, 0),
            (Ended, Exit::Unknown, 1, S::Lost, -1, 0),
            (TimedOut, Exit::Signal(9), 0, S::TimedOut, 137, 9),
            (TimedOut, Exit::Unknown, 1, S::TimedOut, 137, 9),
            (Cancelled, Exit::Code(0), 0, S::Signaled, 137, 9),
            (Cancelled, Exit::Unknown, 0, S::Signaled, 137, 9),
        ];
        for (cause, exit, ooms, status, code, signal) in rows {
            assert_eq!(classify(cause, exit, ooms), Classified { status, exit_code: code, signal }, "{cause:?} {exit:?} oom_kills={ooms}");
        }
    }
}
