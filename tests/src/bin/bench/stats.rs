//! Statistics of the samples (nearest-rank percentiles, mean, median) and how the report
//! prints numbers.

use std::time::Duration;

/// n, p50, p99, mean and max of one set of samples, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary {
    pub(crate) n: usize,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) mean: f64,
    pub(crate) max: f64,
}

/// Nearest-rank percentile of sorted samples: the smallest sample with at least `p`% of the
/// samples at or below it (so p99 of fewer than 100 samples is the maximum).
fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// The [`Summary`] of `samples`, in milliseconds; `None` when there are none.
pub(crate) fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    Some(Summary {
        n: ms.len(),
        p50: nearest_rank(&ms, 50.0),
        p99: nearest_rank(&ms, 99.0),
        mean: ms.iter().sum::<f64>() / ms.len() as f64,
        max: ms[ms.len() - 1],
    })
}

/// The median of some sizes (the lower middle of an even count).
pub(crate) fn median(values: &[u64]) -> Option<u64> {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get(v.len().checked_sub(1)? / 2).copied()
}

/// Bytes as MiB, one decimal.
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Like [`mib`], but small sizes stay readable.
pub(crate) fn mib_of(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{:.0} KiB", bytes as f64 / 1024.0)
    } else {
        mib(bytes)
    }
}

/// Milliseconds, with fewer decimals the larger they are.
pub(crate) fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 1000.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// A difference in milliseconds, with its sign.
pub(crate) fn signed_ms(v: f64) -> String {
    if v < 0.0 {
        format!("-{}", ms(-v))
    } else {
        format!("+{}", ms(v))
    }
}

/// p50 of some samples, for a sentence.
pub(crate) fn p50_of(samples: &[Duration]) -> Option<String> {
    summarize(samples).map(|s| format!("{} ms", ms(s.p50)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&sorted, 50.0), 50.0);
        assert_eq!(nearest_rank(&sorted, 99.0), 99.0);
        assert_eq!(nearest_rank(&sorted, 100.0), 100.0);
        // Fewer than 100 samples: p99 is the maximum, p50 the lower middle.
        let few = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(nearest_rank(&few, 99.0), 4.0);
        assert_eq!(nearest_rank(&few, 50.0), 2.0);
        assert_eq!(nearest_rank(&[7.0], 50.0), 7.0);
        assert_eq!(nearest_rank(&[7.0], 0.0), 7.0);
    }

    #[test]
    fn summary_sorts_and_converts_to_ms() {
        let samples = [30, 10, 20].map(Duration::from_millis);
        let s = summarize(&samples).expect("three samples");
        assert_eq!((s.n, s.p50, s.p99, s.max), (3, 20.0, 30.0, 30.0));
        assert!((s.mean - 20.0).abs() < 1e-9);
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn median_of_sizes() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3, 1, 2]), Some(2));
        assert_eq!(median(&[4, 1, 3, 2]), Some(2));
    }
}
