//! Budgets at three levels — per model call, per step, per task — with a soft warning to the
//! model before the hard stop.
//!
//! Per call: the completion's `max_tokens`, and a prompt that must fit the window (the context
//! manager's job). Per step: the exec's wall time (its timeout) and the tokens one step may burn
//! on re-asks and summaries. Per task: tokens, cost, wall time and steps; at `soft` (80%) of any
//! of them the model is told, once, to wrap up; at 100% the run stops with the named reason.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::state::StopReason;

/// Fraction of a task budget at which the model is warned.
pub const SOFT_FRACTION: f64 = 0.8;

/// Prices per million tokens (prompt, completion), USD, of models whose price is public.
/// Anything else costs what `--price` says, or nothing (and a cost budget cannot be enforced).
pub fn known_price(model: &str) -> Option<(f64, f64)> {
    let table: &[(&str, (f64, f64))] = &[
        ("gpt-4o-mini", (0.15, 0.60)),
        ("gpt-4o", (2.50, 10.00)),
        ("gpt-4.1-nano", (0.10, 0.40)),
        ("gpt-4.1-mini", (0.40, 1.60)),
        ("gpt-4.1", (2.00, 8.00)),
        ("o4-mini", (1.10, 4.40)),
        ("o3", (2.00, 8.00)),
    ];
    // Longest prefix first, so gpt-4o-mini is not priced as gpt-4o.
    table
        .iter()
        .filter(|(prefix, _)| model.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, p)| *p)
}

/// The limits of a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BudgetLimits {
    /// Task: prompt + completion tokens.
    pub max_tokens: Option<u64>,
    /// Task: USD.
    pub max_cost: Option<f64>,
    /// Task: wall time.
    pub max_time: Option<Duration>,
    /// Task: steps.
    pub max_steps: u64,
    /// USD per million prompt and completion tokens.
    pub price: Option<(f64, f64)>,
    /// Call: completion tokens.
    pub call_completion_tokens: u32,
    /// Step: wall time of the action.
    pub step_time: Duration,
    /// Step: tokens spent on one step (re-asks, summaries included).
    pub step_tokens: u64,
}

/// What has been used; carried across resumes in the checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetUsed {
    /// Prompt tokens, as the endpoint reported (else as counted here).
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// USD.
    pub cost_usd: f64,
    /// Wall time of all sessions before this one, ms.
    pub elapsed_ms_before: u64,
    /// Model calls.
    pub llm_calls: u64,
    /// Budget kinds already warned about.
    pub warned: Vec<String>,
}

impl BudgetUsed {
    /// Total tokens.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// The budget check's answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Carry on.
    Ok,
    /// Carry on, but tell the model this (once per budget).
    Warn(String),
    /// Stop now.
    Stop(StopReason, String),
}

/// Tracks use against limits.
#[derive(Clone, Debug)]
pub struct Budget {
    /// The limits.
    pub limits: BudgetLimits,
    /// Use so far.
    pub used: BudgetUsed,
}

impl Budget {
    /// A budget with `used` carried over from earlier sessions.
    pub fn new(limits: BudgetLimits, used: BudgetUsed) -> Self {
        Budget { limits, used }
    }

    /// Records a model call.
    pub fn record_call(&mut self, prompt_tokens: u64, completion_tokens: u64) {
        // The counts come from the endpoint: a wrong one must trip the budget, never wrap it
        // (or panic a debug build).
        self.used.prompt_tokens = self.used.prompt_tokens.saturating_add(prompt_tokens);
        self.used.completion_tokens = self
            .used
            .completion_tokens
            .saturating_add(completion_tokens);
        self.used.llm_calls = self.used.llm_calls.saturating_add(1);
        if let Some((p, c)) = self.limits.price {
            self.used.cost_usd +=
                (prompt_tokens as f64 * p + completion_tokens as f64 * c) / 1_000_000.0;
        }
    }

    /// Wall time of the whole task, given this session's elapsed time.
    pub fn elapsed(&self, session: Duration) -> Duration {
        Duration::from_millis(self.used.elapsed_ms_before) + session
    }

    /// Checks task-level budgets after `steps` steps and `session` of this session's time.
    pub fn check(&mut self, steps: u64, session: Duration) -> Verdict {
        let elapsed = self.elapsed(session);
        let gauges: [(&str, StopReason, f64, Option<f64>, String); 4] = [
            (
                "steps",
                StopReason::MaxSteps,
                steps as f64,
                Some(self.limits.max_steps as f64),
                format!("{steps} of {} steps", self.limits.max_steps),
            ),
            (
                "tokens",
                StopReason::BudgetTokens,
                self.used.tokens() as f64,
                self.limits.max_tokens.map(|t| t as f64),
                format!(
                    "{} of {} tokens",
                    self.used.tokens(),
                    self.limits.max_tokens.unwrap_or(0)
                ),
            ),
            (
                "cost",
                StopReason::BudgetCost,
                self.used.cost_usd,
                self.limits.max_cost,
                format!(
                    "${:.4} of ${:.4}",
                    self.used.cost_usd,
                    self.limits.max_cost.unwrap_or(0.0)
                ),
            ),
            (
                "time",
                StopReason::BudgetTime,
                elapsed.as_secs_f64(),
                self.limits.max_time.map(|t| t.as_secs_f64()),
                format!(
                    "{:.0}s of {:.0}s",
                    elapsed.as_secs_f64(),
                    self.limits.max_time.map_or(0.0, |t| t.as_secs_f64())
                ),
            ),
        ];
        let mut warning = None;
        for (kind, reason, used, limit, text) in gauges {
            let Some(limit) = limit else { continue };
            if used >= limit {
                return Verdict::Stop(reason, format!("{kind} budget exhausted: {text}"));
            }
            if used >= SOFT_FRACTION * limit && !self.used.warned.iter().any(|w| w == kind) {
                self.used.warned.push(kind.to_owned());
                warning.get_or_insert_with(|| {
                    format!(
                        "BUDGET WARNING: {text} used ({:.0}%). Wrap up: verify your work and call finish soon, or the run will be stopped.",
                        100.0 * used / limit
                    )
                });
            }
        }
        warning.map_or(Verdict::Ok, Verdict::Warn)
    }

    /// Exec timeout for a step: what the model asked for, capped by the per-step budget.
    pub fn step_timeout(&self, requested_secs: Option<u64>) -> Duration {
        // 0 is no answer the daemon can take: its `timeout_ms: 0` means "the sandbox's
        // default", which would let the model escape the step timeout.
        requested_secs
            .filter(|&s| s > 0)
            .map(Duration::from_secs)
            .unwrap_or(self.limits.step_time)
            .min(self.limits.step_time)
    }

    /// Completion tokens one call may produce, shrunk near the end of a token budget so the
    /// last call cannot overshoot it by much.
    pub fn call_completion_tokens(&self) -> u32 {
        self.call_completion_tokens_up_to(self.limits.call_completion_tokens)
    }

    /// Like [`Budget::call_completion_tokens`] with a per-call cap of `cap` instead of the
    /// configured one (a call re-asked after being cut off gets a larger one), still shrunk
    /// near the end of the token budget.
    pub fn call_completion_tokens_up_to(&self, cap: u32) -> u32 {
        match self.limits.max_tokens {
            Some(max) => {
                let left = max.saturating_sub(self.used.tokens());
                cap.min(left.clamp(16, u64::from(u32::MAX)) as u32)
            }
            None => cap,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> BudgetLimits {
        BudgetLimits {
            max_tokens: Some(1_000),
            max_cost: None,
            max_time: Some(Duration::from_secs(100)),
            max_steps: 10,
            price: Some((1.0, 2.0)),
            call_completion_tokens: 500,
            step_time: Duration::from_secs(30),
            step_tokens: 10_000,
        }
    }

    #[test]
    fn warns_once_then_stops() {
        let mut b = Budget::new(limits(), BudgetUsed::default());
        assert_eq!(b.check(0, Duration::ZERO), Verdict::Ok);
        b.record_call(700, 100);
        assert!(
            matches!(b.check(1, Duration::ZERO), Verdict::Warn(ref w) if w.contains("800 of 1000 tokens"))
        );
        assert_eq!(b.check(2, Duration::ZERO), Verdict::Ok, "warned once only");
        b.record_call(150, 50);
        assert!(matches!(
            b.check(3, Duration::ZERO),
            Verdict::Stop(StopReason::BudgetTokens, _)
        ));
        assert!((b.used.cost_usd - (850.0 + 300.0) / 1e6).abs() < 1e-12);
    }

    #[test]
    fn steps_and_time_stop_with_their_reason() {
        let mut b = Budget::new(limits(), BudgetUsed::default());
        assert!(matches!(
            b.check(10, Duration::ZERO),
            Verdict::Stop(StopReason::MaxSteps, _)
        ));
        let mut b = Budget::new(
            limits(),
            BudgetUsed {
                elapsed_ms_before: 90_000,
                ..Default::default()
            },
        );
        assert!(matches!(
            b.check(0, Duration::from_secs(10)),
            Verdict::Stop(StopReason::BudgetTime, _)
        ));
    }

    #[test]
    fn cost_budget() {
        let mut l = limits();
        l.max_tokens = None;
        l.max_cost = Some(0.001);
        let mut b = Budget::new(l, BudgetUsed::default());
        b.record_call(1_000, 0);
        assert!(matches!(
            b.check(1, Duration::ZERO),
            Verdict::Stop(StopReason::BudgetCost, _)
        ));
    }

    #[test]
    fn step_and_call_limits() {
        let mut b = Budget::new(limits(), BudgetUsed::default());
        assert_eq!(b.step_timeout(Some(5)), Duration::from_secs(5));
        assert_eq!(b.step_timeout(Some(500)), Duration::from_secs(30));
        assert_eq!(b.step_timeout(None), Duration::from_secs(30));
        assert_eq!(b.call_completion_tokens(), 500);
        b.record_call(900, 0);
        assert_eq!(b.call_completion_tokens(), 100);
    }

    #[test]
    fn prices() {
        assert_eq!(known_price("gpt-4o-mini-2024-07-18"), Some((0.15, 0.60)));
        assert_eq!(known_price("gpt-4o"), Some((2.50, 10.00)));
        assert_eq!(known_price("llama3"), None);
    }
}
