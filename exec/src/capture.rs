//! Bounded capture of one output stream: head and tail in memory, the whole stream spilled to a
//! file once it outgrows the cap.
//!
//! Whatever a command prints, the daemon holds at most `cap` bytes per stream. Until the stream
//! passes the cap everything is kept; at that moment the bytes so far are written to the spill file
//! and from then on every byte goes to the file, while memory keeps the first `cap/2` bytes and a
//! ring of the last `cap - cap/2`.

/// Where, inside a sandbox, every tier keeps an exec's whole stream once it passes its cap
/// (`<exec id>.stdout` / `.stderr`); the record's `*_spill_path` names the file.
pub const SPILL_DIR: &str = "/tmp/.sandboxd";

/// `PATH` of an exec whose environment sets none, on every tier.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

use std::collections::VecDeque;
use std::io::Write;

/// Captured output of one stream: its head and tail within the cap.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CapturedOutput {
    /// Head followed by tail when truncated; everything otherwise.
    pub bytes: Vec<u8>,
    pub truncated: bool,
    /// What the process wrote, in total.
    pub total_bytes: u64,
    /// Where inside the sandbox the whole stream was kept, when truncated.
    pub spill_path: Option<String>,
}

/// Opens the file a stream spills into, lazily, only when the stream outgrows its cap.
pub trait SpillTarget: Send {
    /// Opens (creating) the spill file.
    fn open(&mut self) -> std::io::Result<Box<dyn Write + Send>>;
    /// The path of the spill file as the sandbox sees it.
    fn path(&self) -> String;
}

enum Spill {
    NotNeeded,
    Open(Box<dyn Write + Send>),
    /// The spill file could not be opened or written (e.g. the sandbox's disk is full): the head
    /// and tail are still kept, the spill path is not reported as complete.
    Failed,
}

/// Capture of one stream.
pub struct OutputCapture {
    cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    overflowed: bool,
    total: u64,
    target: Option<Box<dyn SpillTarget>>,
    spill: Spill,
}

impl OutputCapture {
    /// A capture keeping at most `cap` bytes in memory (at least 2).
    pub fn new(cap: usize, target: Option<Box<dyn SpillTarget>>) -> Self {
        let cap = cap.max(2);
        OutputCapture { cap, head: Vec::with_capacity(cap.min(64 << 10)), tail: VecDeque::new(), overflowed: false, total: 0, target, spill: Spill::NotNeeded }
    }

    fn tail_cap(&self) -> usize {
        self.cap - self.cap / 2
    }

    /// Adds bytes the process wrote.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.total += chunk.len() as u64;
        if self.overflowed {
            self.write_spill(chunk);
            self.push_tail(chunk);
        } else if self.head.len() + chunk.len() <= self.cap {
            self.head.extend_from_slice(chunk);
        } else {
            self.overflow(chunk);
        }
    }

    /// The stream just passed the cap with `chunk`: start the spill file with everything so far
    /// and split what we have into head and tail.
    fn overflow(&mut self, chunk: &[u8]) {
        self.overflowed = true;
        self.spill = match self.target.as_mut().map(|t| t.open()) {
            Some(Ok(w)) => Spill::Open(w),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot open output spill file; keeping head and tail only");
                Spill::Failed
            }
            None => Spill::Failed,
        };
        let so_far = std::mem::take(&mut self.head);
        self.write_spill(&so_far);
        self.write_spill(chunk);
        // The head is the first cap/2 bytes of so_far ++ chunk; the rest feeds the tail ring.
        let head_len = self.cap / 2;
        let from_old = head_len.min(so_far.len());
        let from_new = (head_len - from_old).min(chunk.len());
        self.head = so_far[..from_old].to_vec();
        self.head.extend_from_slice(&chunk[..from_new]);
        self.push_tail(&so_far[from_old..]);
        self.push_tail(&chunk[from_new..]);
    }

    fn write_spill(&mut self, bytes: &[u8]) {
        if let Spill::Open(w) = &mut self.spill {
            if let Err(e) = w.write_all(bytes) {
                tracing::warn!(error = %e, "output spill file write failed; spill is incomplete");
                self.spill = Spill::Failed;
            }
        }
    }

    fn push_tail(&mut self, bytes: &[u8]) {
        let tail_cap = self.tail_cap();
        if bytes.len() >= tail_cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - tail_cap..]);
            return;
        }
        let excess = (self.tail.len() + bytes.len()).saturating_sub(tail_cap);
        self.tail.drain(..excess);
        self.tail.extend(bytes);
    }

    /// Ends the capture.
    pub fn finish(mut self) -> CapturedOutput {
        if let Spill::Open(w) = &mut self.spill {
            if let Err(e) = w.flush() {
                tracing::warn!(error = %e, "output spill file flush failed");
                self.spill = Spill::Failed;
            }
        }
        let spill_path = match (&self.spill, &self.target) {
            (Spill::Open(_), Some(t)) => Some(t.path()),
            _ => None,
        };
        let mut bytes = self.head;
        bytes.extend(self.tail);
        CapturedOutput { bytes, truncated: self.overflowed, total_bytes: self.total, spill_path }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct MemSpill(Arc<Mutex<Vec<u8>>>);

    struct MemWriter(Arc<Mutex<Vec<u8>>>);
    impl Write for MemWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl SpillTarget for MemSpill {
        fn open(&mut self) -> std::io::Result<Box<dyn Write + Send>> {
            Ok(Box::new(MemWriter(self.0.clone())))
        }
        fn path(&self) -> String {
            "/tmp/spill".into()
        }
    }

    #[test]
    fn small_output_is_kept_whole_without_spill() {
        let spill = MemSpill::default();
        let mut c = OutputCapture::new(16, Some(Box::new(spill.clone())));
        c.feed(b"hello ");
        c.feed(b"world");
        let out = c.finish();
        assert_eq!(out.bytes, b"hello world");
        assert!(!out.truncated);
        assert_eq!(out.total_bytes, 11);
        assert_eq!(out.spill_path, None);
        assert!(spill.0.lock().expect("lock").is_empty());
    }

    #[test]
    fn overflow_keeps_head_and_tail_and_spills_everything() {
        let spill = MemSpill::default();
        let mut c = OutputCapture::new(10, Some(Box::new(spill.clone())));
        let input: Vec<u8> = (0u8..100).collect();
        for chunk in input.chunks(7) {
            c.feed(chunk);
        }
        let out = c.finish();
        assert!(out.truncated);
        assert_eq!(out.total_bytes, 100);
        assert_eq!(out.bytes, [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]);
        assert_eq!(out.spill_path.as_deref(), Some("/tmp/spill"));
        assert_eq!(*spill.0.lock().expect("lock"), input);
    }

    #[test]
    fn exactly_cap_is_not_truncated_and_one_more_is() {
        let mut c = OutputCapture::new(4, None);
        c.feed(b"abcd");
        assert!(!c.finish().truncated);
        let mut c = OutputCapture::new(4, None);
        c.feed(b"abcde");
        let out = c.finish();
        assert!(out.truncated);
        assert_eq!(out.bytes, b"abde");
        assert_eq!(out.spill_path, None, "no target: no spill path claimed");
    }

    #[test]
    fn a_huge_single_chunk_keeps_memory_at_the_cap() {
        let mut c = OutputCapture::new(1024, None);
        c.feed(&vec![b'x'; 10 << 20]);
        c.feed(b"END");
        let out = c.finish();
        assert_eq!(out.bytes.len(), 1024);
        assert!(out.bytes.ends_with(b"END"));
        assert_eq!(out.total_bytes, (10 << 20) + 3);
    }
}
