//! Which sandboxes keep a spare: the `limit` whose spares were armed last.
//!
//! A spare (a fork of the init waiting for the next exec, see `exec.rs`) takes the fork off an
//! exec's path, ~0.3 ms after a pause, but it is a process: ~0.2 MiB of host memory (its task,
//! page tables, socket and copied pages) in every idle sandbox. So the daemon keeps spares for
//! the sandboxes used most recently only; arming one past the limit makes the least recently
//! armed sandbox give its spare up (dropping its socket: the spare reads EOF and exits). A
//! sandbox without a spare starts its next exec through the init, and arms one again then.

use std::collections::BTreeMap;
use std::sync::{Mutex, Weak};

use super::exec::Spare;
use super::ProcessSandbox;

/// The armed spares of one process backend (`T`: who holds each), oldest first.
pub(crate) struct Spares<T = Weak<ProcessSandbox>> {
    limit: usize,
    lru: Mutex<Lru<T>>,
}

struct Lru<T> {
    /// The next ticket: one per armed spare, increasing.
    next: u64,
    armed: BTreeMap<u64, T>,
}

impl<T> Spares<T> {
    /// At most `limit` spares at once; 0 keeps none.
    pub(crate) fn new(limit: usize) -> Self {
        Spares { limit, lru: Mutex::new(Lru { next: 0, armed: BTreeMap::new() }) }
    }

    /// Whether no sandbox keeps a spare.
    pub(crate) fn is_off(&self) -> bool {
        self.limit == 0
    }

    /// Counts a spare armed by `holder`: its ticket (for [`Spares::release`]), and the spares
    /// that must go to make room, oldest first, for the caller to give up (for a sandbox,
    /// [`ProcessSandbox::give_up_spare`], outside any lock). `None` when spares are off.
    pub(crate) fn admit(&self, holder: T) -> Option<(u64, Vec<(u64, T)>)> {
        if self.limit == 0 {
            return None;
        }
        let mut lru = self.lru.lock().ok()?;
        let ticket = lru.next;
        lru.next += 1;
        lru.armed.insert(ticket, holder);
        let mut evicted = Vec::new();
        while lru.armed.len() > self.limit {
            match lru.armed.pop_first() {
                Some(oldest) => evicted.push(oldest),
                None => break,
            }
        }
        Some((ticket, evicted))
    }

    /// The spare with `ticket` was used or dropped: it no longer counts.
    pub(crate) fn release(&self, ticket: u64) {
        if let Ok(mut lru) = self.lru.lock() {
            lru.armed.remove(&ticket);
        }
    }

    /// Spares counted now.
    #[cfg(test)]
    fn armed(&self) -> usize {
        self.lru.lock().map(|l| l.armed.len()).unwrap_or(0)
    }
}

impl ProcessSandbox {
    /// Drops this sandbox's spare if it is still the one armed under `ticket` (it may have
    /// been used since, and another armed): the spare exits on EOF, and a slot cgroup it
    /// waited in is removed off the async workers.
    pub(crate) fn give_up_spare(&self, ticket: u64) {
        let spare: Option<Spare> = match self.spare.lock() {
            Ok(mut s) if s.as_ref().is_some_and(|s| s.ticket == ticket) => s.take(),
            _ => None,
        };
        let Some(spare) = spare else { return };
        tracing::trace!(sandbox = %self.id, slot = %spare.slot, "spare given up for a more recently used sandbox");
        self.channel.forget(&spare.slot);
        if let Some(cgroup) = spare.cgroup {
            drop(spare.ends);
            tokio::task::spawn_blocking(move || {
                let _ = cgroup.kill_all().and_then(|_| cgroup.remove());
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_armed_go_first_and_a_released_ticket_frees_its_place() {
        let spares = Spares::new(2);
        let (a, none) = spares.admit("a").expect("on");
        assert!(none.is_empty());
        let (b, _) = spares.admit("b").expect("on");
        let (_, evicted) = spares.admit("c").expect("on");
        assert_eq!(evicted, vec![(a, "a")], "the oldest gives its spare up");
        // b's spare was used: it no longer counts, so d takes its place without evicting c.
        spares.release(b);
        spares.release(b);
        assert_eq!(spares.armed(), 1, "a ticket released twice counts once");
        let (_, evicted) = spares.admit("d").expect("on");
        assert!(evicted.is_empty());
        let (_, evicted) = spares.admit("e").expect("on");
        assert_eq!(evicted.into_iter().map(|(_, h)| h).collect::<Vec<_>>(), vec!["c"]);
    }

    #[test]
    fn a_limit_of_zero_keeps_no_spare() {
        let spares = Spares::new(0);
        assert!(spares.admit(()).is_none());
        assert_eq!(spares.armed(), 0);
    }
}
