//! The loop's explicit states, the transitions allowed between them, and why a run ends.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where the loop is. Every change goes through [`LoopState::can_go_to`] and is logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LoopState {
    /// Not started, or resumed and not yet thinking.
    Idle,
    /// Building the prompt and waiting for the model.
    Thinking,
    /// Running the model's tool call in the sandbox.
    Acting,
    /// Turning the tool's result into an observation and deciding whether to go on.
    Observing,
    /// The model called `finish`: running the task check.
    Verifying,
    /// Waiting out a backoff before trying the failed call again.
    Retrying,
    /// Finished and verified.
    Done,
    /// Stopped: a budget, no progress, an error. The stop reason says which.
    Failed,
}

/// A transition the state machine does not allow.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("illegal state transition {from} -> {to}")]
pub struct IllegalTransition {
    /// The state the loop was in.
    pub from: LoopState,
    /// The state it was asked to enter.
    pub to: LoopState,
}

impl LoopState {
    /// Whether the run has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, LoopState::Done | LoopState::Failed)
    }

    /// Whether `self -> to` is a legal transition.
    ///
    /// Kept as one table so the loop cannot drift into a state sequence nobody reasoned about;
    /// every non-terminal state may fail, no terminal state may leave.
    pub fn can_go_to(self, to: LoopState) -> bool {
        use LoopState::*;
        if self.is_terminal() {
            return false;
        }
        if to == Failed {
            return true;
        }
        matches!(
            (self, to),
            (Idle, Thinking)
                | (Idle, Acting) // resume with a pending action
                | (Idle, Verifying) // resume while verifying
                | (Thinking, Acting)
                | (Thinking, Verifying)
                | (Thinking, Retrying)
                | (Thinking, Thinking) // a malformed call re-asked at once
                | (Acting, Observing)
                | (Acting, Retrying)
                | (Observing, Thinking)
                | (Verifying, Done)
                | (Verifying, Thinking)
                | (Verifying, Retrying)
                | (Retrying, Thinking)
                | (Retrying, Acting)
                | (Retrying, Verifying)
        )
    }

    /// Whether the operator may move the run from `self` to `to` (`sbx agent stop`): the
    /// "intervene" transition, from any non-terminal state straight to DONE or FAILED at a step
    /// boundary. Kept apart from [`LoopState::can_go_to`] so that the loop's own transitions
    /// stay strict: THINKING never reaches DONE by itself.
    pub fn can_intervene(self, to: LoopState) -> bool {
        !self.is_terminal() && to.is_terminal()
    }

    /// Checks an operator's transition ([`LoopState::can_intervene`]).
    pub fn check_intervention(self, to: LoopState) -> Result<LoopState, IllegalTransition> {
        if self.can_intervene(to) {
            Ok(to)
        } else {
            Err(IllegalTransition { from: self, to })
        }
    }

    /// Checks a transition.
    pub fn check(self, to: LoopState) -> Result<LoopState, IllegalTransition> {
        if self.can_go_to(to) {
            Ok(to)
        } else {
            Err(IllegalTransition { from: self, to })
        }
    }
}

impl fmt::Display for LoopState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            LoopState::Idle => "IDLE",
            LoopState::Thinking => "THINKING",
            LoopState::Acting => "ACTING",
            LoopState::Observing => "OBSERVING",
            LoopState::Verifying => "VERIFYING",
            LoopState::Retrying => "RETRYING",
            LoopState::Done => "DONE",
            LoopState::Failed => "FAILED",
        };
        f.write_str(name)
    }
}

/// How a run ended, as printed in the `status` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// The model finished and every check passed.
    Done,
    /// Something went wrong that is not a deliberate stop (an error, a failed verification).
    Failed,
    /// A termination rule stopped the run (steps, budget, no progress).
    Stopped,
}

impl RunStatus {
    /// `done`, `failed` or `stopped`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Done => "done",
            RunStatus::Failed => "failed",
            RunStatus::Stopped => "stopped",
        }
    }
}

/// Why a run ended: the `reason` field. Every stop has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// `finish` was called and the task check passed.
    Finished,
    /// The step budget ran out.
    MaxSteps,
    /// The same actions kept producing the same results with nothing changing.
    NoProgress,
    /// The task's token budget ran out.
    BudgetTokens,
    /// The task's wall-time budget ran out.
    BudgetTime,
    /// The task's cost budget ran out.
    BudgetCost,
    /// `finish` was rejected by the task check too many times.
    VerifyFailed,
    /// The model kept answering with tool calls that could not be parsed or repaired.
    MalformedOutput,
    /// Authentication failed, the daemon or the model endpoint is gone: resumable.
    FatalError,
    /// An operator ended the run as done (`sbx agent stop --done`).
    OperatorDone,
    /// An operator ended the run as failed (`sbx agent stop --failed`).
    OperatorFailed,
}

impl StopReason {
    /// The `status` this reason ends a run with.
    pub fn status(self) -> RunStatus {
        match self {
            StopReason::Finished | StopReason::OperatorDone => RunStatus::Done,
            StopReason::MaxSteps
            | StopReason::NoProgress
            | StopReason::BudgetTokens
            | StopReason::BudgetTime
            | StopReason::BudgetCost => RunStatus::Stopped,
            StopReason::VerifyFailed
            | StopReason::MalformedOutput
            | StopReason::FatalError
            | StopReason::OperatorFailed => RunStatus::Failed,
        }
    }

    /// Whether `sbx agent resume` may pick the run up again: only after an error that may go
    /// away (the daemon restarted, the endpoint came back), never after a deliberate stop.
    pub fn resumable(self) -> bool {
        agent_inbox::RESUMABLE_REASONS.contains(&self.as_str())
    }

    /// The snake_case name used in JSON and the trace.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Finished => "finished",
            StopReason::MaxSteps => "max_steps",
            StopReason::NoProgress => "no_progress",
            StopReason::BudgetTokens => "budget_tokens",
            StopReason::BudgetTime => "budget_time",
            StopReason::BudgetCost => "budget_cost",
            StopReason::VerifyFailed => "verify_failed",
            StopReason::MalformedOutput => "malformed_output",
            StopReason::FatalError => "fatal_error",
            StopReason::OperatorDone => "operator_done",
            StopReason::OperatorFailed => "operator_failed",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::LoopState::*;
    use super::*;

    #[test]
    fn the_happy_path_is_legal() {
        let path = [Idle, Thinking, Acting, Observing, Thinking, Verifying, Done];
        for pair in path.windows(2) {
            assert!(pair[0].can_go_to(pair[1]), "{} -> {}", pair[0], pair[1]);
        }
    }

    #[test]
    fn terminal_states_never_leave() {
        for to in [Idle, Thinking, Acting, Failed, Done] {
            assert!(!Done.can_go_to(to));
            assert!(!Failed.can_go_to(to));
        }
    }

    #[test]
    fn shortcuts_are_refused() {
        assert_eq!(
            Thinking.check(Done),
            Err(IllegalTransition {
                from: Thinking,
                to: Done
            })
        );
        assert!(!Acting.can_go_to(Thinking), "an action must be observed");
        assert!(
            !Observing.can_go_to(Acting),
            "the model decides the next action"
        );
        assert!(Acting.can_go_to(Failed));
    }

    #[test]
    fn the_operator_intervenes_from_any_live_state_to_an_end() {
        for from in [Idle, Thinking, Acting, Observing, Verifying, Retrying] {
            assert_eq!(from.check_intervention(Done), Ok(Done), "{from}");
            assert_eq!(from.check_intervention(Failed), Ok(Failed), "{from}");
            assert!(
                !from.can_intervene(Thinking),
                "{from} -> THINKING is no stop"
            );
        }
        assert!(!Done.can_intervene(Failed), "an ended run stays ended");
        assert!(!Failed.can_intervene(Done));
        // The loop's own table is unchanged by it.
        assert!(!Thinking.can_go_to(Done));
        assert!(!Retrying.can_go_to(Done));
    }

    #[test]
    fn reasons_map_to_statuses() {
        assert_eq!(StopReason::Finished.status(), RunStatus::Done);
        assert_eq!(StopReason::NoProgress.status(), RunStatus::Stopped);
        assert_eq!(StopReason::FatalError.status(), RunStatus::Failed);
        assert!(StopReason::FatalError.resumable());
        assert!(!StopReason::BudgetTokens.resumable());
        assert_eq!(StopReason::OperatorDone.status(), RunStatus::Done);
        assert_eq!(StopReason::OperatorFailed.status(), RunStatus::Failed);
        assert!(!StopReason::OperatorDone.resumable());
        assert!(!StopReason::OperatorFailed.resumable());
        let json = serde_json::to_string(&StopReason::BudgetTokens).unwrap_or_default();
        assert_eq!(json, "\"budget_tokens\"");
    }
}
