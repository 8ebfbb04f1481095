//! Which host CPUs a sandbox's processes are placed on, so that programs sizing themselves by
//! the CPUs they see (`nproc`, `os.cpu_count()`, the JVM, Go's `GOMAXPROCS`, pytest-xdist
//! `-n auto`) see the CPU limit, not the host.
//!
//! A sandbox with a limit of `m` millicores gets `ceil(m / 1000)` CPUs (at least one, at most the
//! CPUs the daemon may use): the process tier sets its init's affinity to them (every exec
//! inherits it), the container tier passes them as `cpuset_cpus`. The CFS quota stays the real
//! limit; the CPU set is what programs read. Sandboxes are spread over the host's CPUs — each new
//! one gets the CPUs the fewest live sandboxes hold, ties taken in turn — so a host of many small
//! sandboxes does not run them all on CPU 0. One placer serves both tiers, so they spread
//! together.

use std::sync::{Arc, Mutex, OnceLock};

/// The daemon's view of the host's CPUs and how many live sandboxes hold each.
#[derive(Debug)]
struct Placer {
    /// CPUs the daemon may run on (its own affinity at start), ascending.
    host: Vec<usize>,
    state: Mutex<PlacerState>,
}

#[derive(Debug, Default)]
struct PlacerState {
    /// Live leases per entry of `host`.
    used: Vec<u32>,
    /// Where ties start next time (round robin).
    next: usize,
}

/// CPUs held by one sandbox; released when dropped.
#[derive(Debug)]
pub struct CpuLease {
    cpus: Vec<usize>,
    placer: Arc<Placer>,
}

impl CpuLease {
    /// The CPUs, ascending.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// As the kernel writes CPU lists (`/sys/devices/system/cpu/online`, `cpuset.cpus`):
    /// `0-1,3`.
    pub fn list(&self) -> String {
        format_list(&self.cpus)
    }
}

impl Drop for CpuLease {
    fn drop(&mut self) {
        self.placer.release(&self.cpus);
    }
}

/// CPUs for a sandbox with a limit of `cpu_millicores` (0: no limit, every CPU).
pub fn place(cpu_millicores: u32) -> CpuLease {
    let placer = placer();
    let n = count_for(cpu_millicores, placer.host.len());
    let cpus = placer.take(n);
    CpuLease { cpus, placer }
}

/// Takes exactly `cpus` (those of a container that was re-adopted), whatever the load; the ones
/// the daemon may not use are left out.
pub fn claim(cpus: &[usize]) -> CpuLease {
    let placer = placer();
    let cpus: Vec<usize> = placer.host.iter().copied().filter(|c| cpus.contains(c)).collect();
    placer.hold(&cpus);
    CpuLease { cpus, placer }
}

/// How many CPUs a sandbox gets: its limit rounded up to whole CPUs, between 1 and the host's.
pub fn count_for(cpu_millicores: u32, host_cpus: usize) -> usize {
    let host_cpus = host_cpus.max(1);
    if cpu_millicores == 0 {
        return host_cpus;
    }
    usize::try_from(cpu_millicores.div_ceil(1000)).unwrap_or(usize::MAX).clamp(1, host_cpus)
}

/// `0-1,3` for `[0, 1, 3]` (sorted or not).
pub fn format_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(",")
}

/// Parses a CPU list (`0-1,3`); `None` when malformed.
pub fn parse_list(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 4096 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

fn placer() -> Arc<Placer> {
    static PLACER: OnceLock<Arc<Placer>> = OnceLock::new();
    PLACER.get_or_init(|| Arc::new(Placer::new(daemon_cpus()))).clone()
}

/// The CPUs this process may run on.
fn daemon_cpus() -> Vec<usize> {
    let cpus: Vec<usize> = match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the daemon's CPU affinity; placing sandboxes on CPU 0 only");
            Vec::new()
        }
    };
    if cpus.is_empty() {
        vec![0]
    } else {
        cpus
    }
}

impl Placer {
    fn new(host: Vec<usize>) -> Self {
        let used = vec![0; host.len()];
        Placer { host, state: Mutex::new(PlacerState { used, next: 0 }) }
    }

    /// The `n` CPUs the fewest leases hold, ties in turn from where the last choice stopped.
    fn take(&self, n: usize) -> Vec<usize> {
        let len = self.host.len();
        let Ok(mut st) = self.state.lock() else { return self.host.iter().copied().take(n).collect() };
        let start = st.next;
        let mut order: Vec<usize> = (0..len).collect();
        order.sort_by_key(|&i| (st.used[i], (i + len - start % len) % len));
        let mut chosen: Vec<usize> = order.into_iter().take(n).collect();
        for &i in &chosen {
            st.used[i] += 1;
        }
        st.next = chosen.last().map(|&i| (i + 1) % len).unwrap_or(start);
        chosen.sort_unstable();
        chosen.into_iter().map(|i| self.host[i]).collect()
    }

    fn hold(&self, cpus: &[usize]) {
        if let Ok(mut st) = self.state.lock() {
            for (i, c) in self.host.iter().enumerate() {
                if cpus.contains(c) {
                    st.used[i] += 1;
                }
            }
        }
    }

    fn release(&self, cpus: &[usize]) {
        if let Ok(mut st) = self.state.lock() {
            for (i, c) in self.host.iter().enumerate() {
                if cpus.contains(c) {
                    st.used[i] = st.used[i].saturating_sub(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used)]
    use super::*;

    fn lease(p: &Arc<Placer>, n: usize) -> CpuLease {
        CpuLease { cpus: p.take(n), placer: p.clone() }
    }

    #[test]
    fn counts_round_up_and_stay_within_the_host() {
        assert_eq!(count_for(1000, 2), 1);
        assert_eq!(count_for(1, 2), 1);
        assert_eq!(count_for(1001, 2), 2);
        assert_eq!(count_for(2000, 2), 2);
        assert_eq!(count_for(64_000, 2), 2);
        assert_eq!(count_for(0, 4), 4, "no limit: every CPU");
        assert_eq!(count_for(500, 0), 1);
    }

    #[test]
    fn lists_format_and_parse() {
        assert_eq!(format_list(&[0]), "0");
        assert_eq!(format_list(&[3, 0, 1]), "0-1,3");
        assert_eq!(format_list(&[0, 1, 2, 5, 6, 8]), "0-2,5-6,8");
        assert_eq!(parse_list("0-2,5-6,8\n"), Some(vec![0, 1, 2, 5, 6, 8]));
        assert_eq!(parse_list(""), Some(vec![]));
        assert_eq!(parse_list("2-1"), None);
        assert_eq!(parse_list("x"), None);
    }

    #[test]
    fn sandboxes_spread_over_the_cpus_and_give_them_back() {
        let p = Arc::new(Placer::new(vec![0, 1, 2, 3]));
        let a = lease(&p, 1);
        let b = lease(&p, 1);
        let c = lease(&p, 2);
        assert_eq!((a.cpus(), b.cpus(), c.cpus()), (&[0][..], &[1][..], &[2, 3][..]), "least used first, in turn");
        let d = lease(&p, 1);
        assert_eq!(d.cpus(), &[0], "all equal again: round robin goes on");
        drop(b);
        let e = lease(&p, 1);
        assert_eq!(e.cpus(), &[1], "the CPU a destroyed sandbox gave back is the least used");
        let all = lease(&p, 4);
        assert_eq!(all.list(), "0-3");
        drop((a, c, d, e, all));
        assert_eq!(p.state.lock().unwrap().used, vec![0; 4], "every lease returned");
    }

    #[test]
    fn only_the_daemons_cpus_are_used() {
        let p = Arc::new(Placer::new(vec![2, 5]));
        let a = lease(&p, 1);
        let b = lease(&p, 1);
        assert_eq!((a.list(), b.list()), ("2".to_string(), "5".to_string()));
        assert_eq!(lease(&p, 2).list(), "2,5");
    }
}
