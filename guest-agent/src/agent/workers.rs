//! Request threads kept for reuse.
//!
//! Every request runs on a thread of its own (a handler may block: an exec waits for its
//! command). Starting a thread is `clone` plus a stack mapping; in a VM resumed from a memory
//! snapshot under TCG the first one costs ~40 ms, because QEMU translates those kernel paths
//! anew in its fresh process. A thread that has finished its request waits here for the next
//! one instead (up to [`MAX_IDLE`] of them), so a resumed agent — whose snapshot was taken with
//! idle workers — wakes a thread instead of making one, and a busy agent makes threads only
//! while all are busy.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};

/// Idle threads kept; more finish and exit.
pub const MAX_IDLE: usize = 8;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The idle threads, each waiting on its own channel.
pub struct Workers {
    idle: Mutex<Vec<SyncSender<Job>>>,
    stack: usize,
}

impl Workers {
    /// Threads with `stack` bytes of stack.
    pub fn new(stack: usize) -> Arc<Self> {
        Arc::new(Workers { idle: Mutex::new(Vec::new()), stack })
    }

    /// How many threads wait for work.
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Runs `job` on an idle thread, or on a new one when none is idle.
    pub fn run(self: &Arc<Self>, job: Job) -> std::io::Result<()> {
        let mut job = job;
        loop {
            let Some(worker) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() else { break };
            match worker.send(job) {
                Ok(()) => return Ok(()),
                // That thread is gone (it cannot be while listed, but a lost job is worse).
                Err(std::sync::mpsc::SendError(back)) => job = back,
            }
        }
        let (tx, rx) = sync_channel::<Job>(1);
        let workers = self.clone();
        std::thread::Builder::new().name("req".into()).stack_size(self.stack).spawn(move || {
            job();
            loop {
                {
                    let mut idle = workers.idle.lock().unwrap_or_else(|p| p.into_inner());
                    if idle.len() >= MAX_IDLE {
                        return;
                    }
                    idle.push(tx.clone());
                }
                match rx.recv() {
                    Ok(next) => next(),
                    Err(_) => return,
                }
            }
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::{Duration, Instant};

    fn wait_idle(w: &Workers, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.idle() != n {
            assert!(Instant::now() < deadline, "{} idle, not {n}", w.idle());
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_finished_thread_takes_the_next_job() {
        let w = Workers::new(64 << 10);
        let (tx, rx) = channel();
        let t = tx.clone();
        w.run(Box::new(move || t.send(std::thread::current().id()).expect("send"))).expect("run");
        let first = rx.recv().expect("first");
        wait_idle(&w, 1);
        let t = tx.clone();
        w.run(Box::new(move || t.send(std::thread::current().id()).expect("send"))).expect("run");
        assert_eq!(rx.recv().expect("second"), first, "the same thread");
        wait_idle(&w, 1);
    }

    #[test]
    fn busy_threads_do_not_hold_up_another_job_and_at_most_max_idle_stay() {
        let w = Workers::new(64 << 10);
        let (release_tx, release_rx) = channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (done_tx, done_rx) = channel();
        let n = MAX_IDLE + 4;
        for _ in 0..n {
            let (r, d) = (release_rx.clone(), done_tx.clone());
            // Each blocks until released: every job needs a thread of its own.
            w.run(Box::new(move || {
                d.send(()).expect("started");
                let _ = r.lock().expect("lock").recv();
            }))
            .expect("run");
        }
        for _ in 0..n {
            done_rx.recv_timeout(Duration::from_secs(10)).expect("every job started while the others block");
        }
        for _ in 0..n {
            release_tx.send(()).expect("release");
        }
        wait_idle(&w, MAX_IDLE);
    }
}
