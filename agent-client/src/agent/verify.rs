//! Verification at three levels.
//!
//! **Action**: an exec's status and exit code decide whether the step succeeded (and feed the
//! failed-approaches list). **Subtask**: a subtask may carry a check command that must pass
//! before the model moves to the next subtask or finishes. **Task**: `--verify CMD` must pass
//! before `finish` is accepted. A failed check goes back to the model as a structured message
//! — which check, the command, what was expected and what happened — not as a bare "no".

use serde::Serialize;

use super::observe::{self, ObserveLimits};
use crate::proto::{ExecResult, ExecStatus};

/// Which level a check belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// A subtask's check.
    Subtask,
    /// The task's `--verify` check.
    Task,
}

/// The outcome of one check.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckResult {
    /// Its level.
    pub level: Level,
    /// The command.
    pub command: String,
    /// Whether it passed.
    pub passed: bool,
    /// What passing means.
    pub expected: String,
    /// What happened.
    pub actual: String,
    /// Output, head and tail.
    pub output: String,
    /// The exec that ran it.
    pub exec_id: String,
}

/// Whether an exec succeeded: it exited, with code 0.
pub fn action_ok(r: &ExecResult) -> bool {
    r.status == ExecStatus::Exited as i32 && r.exit_code == 0
}

/// Judges a check's exec.
pub fn judge(level: Level, command: &str, r: &ExecResult) -> CheckResult {
    let passed = action_ok(r);
    let actual = observe::status_line(r).unwrap_or_else(|| "exit code 0".into());
    let mut text = String::from_utf8_lossy(&r.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&r.stderr);
    if !stderr.is_empty() {
        text.push_str("[stderr]\n");
        text.push_str(&stderr);
    }
    let (output, _) = observe::head_tail(
        &observe::clean(&text),
        ObserveLimits::head_tail(1_000, 1_500),
    );
    CheckResult {
        level,
        command: command.to_owned(),
        passed,
        expected: "exit code 0".into(),
        actual,
        output,
        exec_id: r.exec_id.clone(),
    }
}

impl CheckResult {
    /// The message for the model when `finish` (or a subtask switch) was refused.
    pub fn rejection(&self, what: &str) -> String {
        let detail = serde_json::json!({
            "check": self.level,
            "command": self.command,
            "expected": self.expected,
            "actual": self.actual,
            "exec_id": self.exec_id,
        });
        format!(
            "{what} REJECTED: the {} check failed.\n{detail}\nOutput of the check:\n{}\nFix the problem, then try again.",
            match self.level {
                Level::Task => "task",
                Level::Subtask => "subtask",
            },
            if self.output.trim().is_empty() {
                "(none)"
            } else {
                &self.output
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_says_what_was_expected_and_what_happened() {
        let r = ExecResult {
            exec_id: "ex-9".into(),
            status: ExecStatus::Exited as i32,
            exit_code: 2,
            stdout: b"FAIL test_add\n1 failed, 3 passed\n".to_vec(),
            ..Default::default()
        };
        let c = judge(Level::Task, "make test", &r);
        assert!(!c.passed);
        let msg = c.rejection("finish");
        assert!(
            msg.starts_with("finish REJECTED: the task check failed."),
            "{msg}"
        );
        assert!(msg.contains(r#""command":"make test""#), "{msg}");
        assert!(msg.contains(r#""expected":"exit code 0""#), "{msg}");
        assert!(msg.contains(r#""actual":"exit code 2""#), "{msg}");
        assert!(msg.contains("1 failed, 3 passed"), "{msg}");
    }

    #[test]
    fn timeouts_fail_checks() {
        let r = ExecResult {
            status: ExecStatus::TimedOut as i32,
            exit_code: 137,
            ..Default::default()
        };
        let c = judge(Level::Subtask, "sleep 99", &r);
        assert!(!c.passed);
        assert!(c.actual.starts_with("TIMED OUT"));
        let ok = ExecResult {
            status: ExecStatus::Exited as i32,
            ..Default::default()
        };
        assert!(judge(Level::Task, "true", &ok).passed);
    }
}
