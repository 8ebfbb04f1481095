//! Moving a proxied connection's bytes under the sandbox's caps: a token bucket per sandbox and
//! direction (`[network] bandwidth_bytes_per_sec`, shared by all its connections, so many
//! connections do not multiply the cap), and an idle deadline (`[network] idle_timeout_ms`: no
//! byte either way for that long ends the connection, so a sandbox cannot hold its slots and the
//! daemon's descriptors with connections that never finish).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes moved per read: small enough that the bucket meters smoothly.
const CHUNK: usize = 16 << 10;

/// A token bucket of `rate` bytes per second with a burst of one second's worth; 0 is no cap.
pub struct RateLimit {
    rate: u64,
    state: Mutex<(f64, Instant)>,
}

impl RateLimit {
    pub fn new(rate: u64) -> RateLimit {
        RateLimit { rate, state: Mutex::new((rate as f64, Instant::now())) }
    }

    /// How long to wait before sending `n` bytes (the bytes are taken now: waiters queue up in
    /// the order they asked, each paying for its own bytes).
    fn reserve(&self, n: usize) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        let Ok(mut s) = self.state.lock() else { return Duration::ZERO };
        let now = Instant::now();
        let rate = self.rate as f64;
        let refill = now.saturating_duration_since(s.1).as_secs_f64() * rate;
        s.0 = (s.0 + refill).min(rate);
        s.1 = now;
        s.0 -= n as f64;
        if s.0 >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.0 / rate)
        }
    }

    /// Waits until `n` more bytes may go.
    pub async fn take(&self, n: usize) {
        let wait = self.reserve(n);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// When a connection last moved a byte, in milliseconds since it started.
pub struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub fn new() -> Activity {
        Activity { start: Instant::now(), last_ms: AtomicU64::new(0) }
    }

    pub fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Returns once nothing has moved for `idle`.
    pub async fn idle_for(&self, idle: Duration) {
        loop {
            let deadline = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + idle;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    }
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

/// Copies `r` to `w` until the end of `r` (then shuts `w` down) or an error, metered by
/// `limit`, counting into `count` as it goes (so a connection cut off midway still reports
/// what it moved).
pub async fn pump<R, W>(r: &mut R, w: &mut W, limit: &RateLimit, activity: &Activity, count: &AtomicU64) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = r.read(&mut buf).await?;
        activity.touch();
        if n == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
        limit.take(n).await;
        w.write_all(&buf[..n]).await?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        activity.touch();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_bucket_lets_a_burst_through_then_meters_at_its_rate() {
        let b = RateLimit::new(1000);
        assert_eq!(b.reserve(1000), Duration::ZERO, "one second's worth goes at once");
        let wait = b.reserve(500);
        assert!(wait >= Duration::from_millis(450) && wait <= Duration::from_millis(500), "{wait:?}");
        // The next caller queues behind the first one's debt.
        let wait = b.reserve(500);
        assert!(wait >= Duration::from_millis(950) && wait <= Duration::from_millis(1000), "{wait:?}");
        assert_eq!(RateLimit::new(0).reserve(usize::MAX / 2), Duration::ZERO, "0 is no cap");
    }

    #[tokio::test]
    async fn idle_ends_only_after_a_quiet_spell() {
        let a = Activity::new();
        let started = Instant::now();
        tokio::time::sleep(Duration::from_millis(150)).await;
        a.touch();
        // (A lower bound only: a loaded machine makes it later, never earlier.)
        a.idle_for(Duration::from_millis(200)).await;
        assert!(started.elapsed() >= Duration::from_millis(350), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn pump_counts_what_it_moved_and_shuts_the_writer_down() {
        let (mut a, mut b) = tokio::io::duplex(64 << 10);
        let (mut c, mut d) = tokio::io::duplex(64 << 10);
        let data = vec![7u8; 100_000];
        let writer = tokio::spawn(async move {
            a.write_all(&data).await.expect("write");
            a.shutdown().await.expect("shutdown");
        });
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            d.read_to_end(&mut got).await.expect("read");
            got.len()
        });
        let count = AtomicU64::new(0);
        pump(&mut b, &mut c, &RateLimit::new(0), &Activity::new(), &count).await.expect("pump");
        drop(c);
        writer.await.expect("writer");
        assert_eq!(reader.await.expect("reader"), 100_000);
        assert_eq!(count.load(Ordering::Relaxed), 100_000);
    }
}
