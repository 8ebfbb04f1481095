//! Bounded waiting: a hung call or a condition that never comes fails the test, never leaves a
//! suite that does not end.

use std::future::Future;
use std::time::{Duration, Instant};

/// Awaits `fut`, failing the test if it takes more than `secs` seconds: a hung call must be a
/// failure, never a suite that never ends.
pub async fn within<T>(secs: u64, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("call did not return within {secs} s"),
    }
}

/// Polls `check` every 50 ms until it returns true or `secs` pass; returns whether it did.
pub async fn eventually<F, Fut>(secs: u64, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
