//! Retries with capped exponential backoff and jitter, a circuit breaker per tool, and a token
//! bucket in front of the model.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::Rng;

/// Why a call was not let through.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RetryError {
    /// The tool's breaker is open.
    #[error("tool `{tool}` is disabled for {retry_in_secs}s after {failures} consecutive failures; use another approach meanwhile")]
    Open {
        /// The tool.
        tool: String,
        /// Consecutive failures that opened it.
        failures: u32,
        /// Seconds until a probe call is allowed.
        retry_in_secs: u64,
    },
}

/// Exponential backoff with "equal jitter": half the delay fixed, half random, so retries from
/// many clients spread out but none retries immediately.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    /// First delay.
    pub base: Duration,
    /// Largest delay.
    pub cap: Duration,
    /// Attempts before giving up (the first try included).
    pub max_attempts: u32,
    /// Total time one outage may take, retries included; with it, attempts are limited by
    /// time rather than count, and a `Retry-After` is honoured up to what is left of it.
    pub patience: Option<Duration>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(250),
            cap: Duration::from_secs(20),
            max_attempts: 6,
            patience: None,
        }
    }
}

impl Backoff {
    /// Delay before retry number `attempt` (1 = the first retry), or `None` when attempts are
    /// exhausted. A server's `Retry-After` wins when it is longer (but still capped).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Option<Duration> {
        if attempt >= self.max_attempts {
            return None;
        }
        let exp = self
            .base
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let ceiling = exp.min(self.cap);
        let half = ceiling / 2;
        let jitter = rand::thread_rng().gen_range(0..=half.as_millis() as u64);
        let d = half + Duration::from_millis(jitter);
        Some(match retry_after {
            Some(ra) if ra > d => ra.min(self.cap),
            _ => d,
        })
    }

    /// The policy for a model endpoint: an outage of minutes is survived. Backoff from 1 s
    /// doubling to 60 s, for up to `patience` in all.
    pub fn patient(patience: Duration) -> Self {
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            max_attempts: u32::MAX,
            patience: Some(patience),
        }
    }

    /// Delay before retry number `attempt` of an outage that began `spent` ago, or `None`
    /// when it is time to give up: attempts exhausted, or (with a patience) the patience
    /// spent. A `Retry-After` longer than the backoff is honoured — beyond the cap, up to the
    /// patience left.
    pub fn delay_within(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        spent: Duration,
    ) -> Option<Duration> {
        let Some(patience) = self.patience else {
            return self.delay(attempt, retry_after);
        };
        let left = patience.checked_sub(spent).filter(|d| !d.is_zero())?;
        if attempt >= self.max_attempts {
            return None;
        }
        let unlimited = Backoff {
            max_attempts: u32::MAX,
            patience: None,
            ..*self
        };
        let d = unlimited.delay(attempt, None)?;
        let d = match retry_after {
            Some(ra) if ra > d => ra,
            _ => d,
        };
        Some(d.min(left))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BreakerState {
    Closed,
    Open { until: Instant },
    HalfOpen,
}

#[derive(Clone, Debug)]
struct Breaker {
    state: BreakerState,
    failures: u32,
}

/// One circuit breaker per tool: opens after `threshold` consecutive failures, lets one probe
/// call through after `cooldown` (half-open), closes on its success and reopens on its failure.
#[derive(Clone, Debug)]
pub struct Breakers {
    threshold: u32,
    cooldown: Duration,
    tools: HashMap<String, Breaker>,
}

impl Breakers {
    /// Breakers opening after `threshold` failures for `cooldown`.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Breakers {
            threshold,
            cooldown,
            tools: HashMap::new(),
        }
    }

    /// Whether a call to `tool` may go out now.
    pub fn allow(&mut self, tool: &str, now: Instant) -> Result<(), RetryError> {
        let Some(b) = self.tools.get_mut(tool) else {
            return Ok(());
        };
        match b.state {
            BreakerState::Closed | BreakerState::HalfOpen => Ok(()),
            BreakerState::Open { until } if now >= until => {
                tracing::info!(tool, "circuit breaker half-open: letting one probe through");
                b.state = BreakerState::HalfOpen;
                Ok(())
            }
            BreakerState::Open { until } => Err(RetryError::Open {
                tool: tool.to_owned(),
                failures: b.failures,
                retry_in_secs: until.saturating_duration_since(now).as_secs().max(1),
            }),
        }
    }

    /// Records the outcome of a call to `tool`.
    pub fn record(&mut self, tool: &str, success: bool, now: Instant) {
        let b = self.tools.entry(tool.to_owned()).or_insert(Breaker {
            state: BreakerState::Closed,
            failures: 0,
        });
        if success {
            if b.state != BreakerState::Closed {
                tracing::info!(tool, "circuit breaker closed");
            }
            b.state = BreakerState::Closed;
            b.failures = 0;
            return;
        }
        b.failures += 1;
        if b.state == BreakerState::HalfOpen || b.failures >= self.threshold {
            tracing::warn!(tool, failures = b.failures, "circuit breaker open");
            b.state = BreakerState::Open {
                until: now + self.cooldown,
            };
        }
    }

    /// Whether `tool`'s breaker is open now.
    /// How long `tool`'s breaker stays open from `now`, if it is open.
    pub fn open_for(&self, tool: &str, now: Instant) -> Option<Duration> {
        match self.tools.get(tool)?.state {
            BreakerState::Open { until } if now < until => Some(until - now),
            _ => None,
        }
    }

    /// Whether `tool`'s breaker is open now.
    pub fn is_open(&self, tool: &str, now: Instant) -> bool {
        self.tools
            .get(tool)
            .is_some_and(|b| matches!(b.state, BreakerState::Open { until } if now < until))
    }
}

/// A token bucket: `capacity` calls at once, refilled at `rate` per second.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    capacity: f64,
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(capacity: u32, rate_per_sec: f64) -> Self {
        TokenBucket {
            capacity: f64::from(capacity.max(1)),
            rate: rate_per_sec.max(1e-3),
            tokens: f64::from(capacity.max(1)),
            last: Instant::now(),
        }
    }

    /// Takes a token if one is there; otherwise says how long until one will be.
    pub fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.capacity);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }

    /// Waits for a token.
    pub async fn take(&mut self) {
        while let Err(wait) = self.try_take(Instant::now()) {
            tracing::debug!(
                wait_ms = wait.as_millis() as u64,
                "rate limit: waiting for the model call budget"
            );
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(1_000),
            max_attempts: 10,
            patience: None,
        };
        for attempt in 1..10 {
            let d = b.delay(attempt, None).expect("within attempts");
            let ceiling =
                Duration::from_millis(100 * (1 << (attempt - 1))).min(Duration::from_millis(1_000));
            assert!(d >= ceiling / 2 && d <= ceiling, "attempt {attempt}: {d:?}");
        }
        assert_eq!(b.delay(10, None), None);
        assert_eq!(
            b.delay(1, Some(Duration::from_secs(5))),
            Some(Duration::from_millis(1_000)),
            "Retry-After is honored but capped"
        );
    }

    #[test]
    fn a_patient_backoff_lasts_minutes_and_honours_retry_after() {
        let b = Backoff::patient(Duration::from_secs(600));
        // Far more attempts than a count-limited policy, while the patience lasts.
        let d = b.delay_within(50, None, Duration::from_secs(300));
        assert!(
            d.is_some_and(|d| d <= Duration::from_secs(60) && d >= Duration::from_secs(30)),
            "{d:?}"
        );
        // Retry-After: 45 is honoured, not cut to the cap of a short policy.
        assert_eq!(
            b.delay_within(1, Some(Duration::from_secs(45)), Duration::ZERO),
            Some(Duration::from_secs(45))
        );
        // …up to what is left of the patience, and then it gives up.
        assert_eq!(
            b.delay_within(3, Some(Duration::from_secs(45)), Duration::from_secs(590)),
            Some(Duration::from_secs(10))
        );
        assert_eq!(b.delay_within(4, None, Duration::from_secs(600)), None);
        // Without a patience, the attempt count rules as before.
        let short = Backoff::default();
        assert_eq!(short.delay_within(6, None, Duration::ZERO), None);
    }

    #[test]
    fn breaker_opens_probes_and_closes() {
        let mut br = Breakers::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        for _ in 0..2 {
            br.record("bash", false, t0);
        }
        assert!(br.allow("bash", t0).is_ok(), "two failures: still closed");
        br.record("bash", false, t0);
        assert!(matches!(
            br.allow("bash", t0),
            Err(RetryError::Open { failures: 3, .. })
        ));
        assert!(br.allow("read_file", t0).is_ok(), "per tool");
        let later = t0 + Duration::from_secs(11);
        assert!(br.allow("bash", later).is_ok(), "half-open probe");
        br.record("bash", false, later);
        assert!(br.allow("bash", later).is_err(), "failed probe reopens");
        let much_later = later + Duration::from_secs(11);
        assert!(br.allow("bash", much_later).is_ok());
        br.record("bash", true, much_later);
        assert!(!br.is_open("bash", much_later));
        br.record("bash", false, much_later);
        assert!(
            br.allow("bash", much_later).is_ok(),
            "count restarted after success"
        );
    }

    #[test]
    fn bucket_limits_the_rate() {
        let mut tb = TokenBucket::new(2, 10.0);
        let t0 = Instant::now();
        assert!(tb.try_take(t0).is_ok());
        assert!(tb.try_take(t0).is_ok());
        let wait = tb.try_take(t0).expect_err("empty");
        assert!(
            wait <= Duration::from_millis(100) && wait > Duration::ZERO,
            "{wait:?}"
        );
        assert!(tb.try_take(t0 + Duration::from_millis(100)).is_ok());
    }
}
