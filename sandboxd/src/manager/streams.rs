//! How many streams of each kind run at once, on the whole daemon and per tenant: uploads,
//! downloads, exec sessions and archive walks. A stream holds its [`StreamSlot`] until it is
//! dropped, whatever ended it (the end, an error, an idle deadline, a client that went away).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::StreamsConfig;
use crate::error::Error;

/// The kinds of stream with a cap of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Upload,
    Download,
    Session,
    /// An archive upload or download, besides its upload or download slot: it walks a tree on
    /// a thread of its own.
    ArchiveWalk,
}

impl StreamKind {
    /// The config key of the global cap (the per-tenant one is this plus `_per_tenant`).
    fn key(self) -> &'static str {
        match self {
            StreamKind::Upload => "max_uploads",
            StreamKind::Download => "max_downloads",
            StreamKind::Session => "max_sessions",
            StreamKind::ArchiveWalk => "max_archive_walks",
        }
    }

    fn what(self) -> &'static str {
        match self {
            StreamKind::Upload => "uploads",
            StreamKind::Download => "downloads",
            StreamKind::Session => "exec sessions",
            StreamKind::ArchiveWalk => "archive transfers",
        }
    }

    fn caps(self, cfg: &StreamsConfig) -> (usize, usize) {
        match self {
            StreamKind::Upload => (cfg.max_uploads, cfg.max_uploads_per_tenant),
            StreamKind::Download => (cfg.max_downloads, cfg.max_downloads_per_tenant),
            StreamKind::Session => (cfg.max_sessions, cfg.max_sessions_per_tenant),
            StreamKind::ArchiveWalk => (cfg.max_archive_walks, cfg.max_archive_walks_per_tenant),
        }
    }
}

#[derive(Default)]
struct Counts {
    total: HashMap<StreamKind, usize>,
    per_tenant: HashMap<(StreamKind, String), usize>,
}

/// The streams open now, against the `[streams]` caps.
pub struct StreamSlots {
    cfg: StreamsConfig,
    counts: Mutex<Counts>,
}

impl StreamSlots {
    /// Slots under the caps of `cfg`.
    pub fn new(cfg: StreamsConfig) -> Arc<Self> {
        Arc::new(StreamSlots { cfg, counts: Mutex::new(Counts::default()) })
    }

    /// A slot of `kind` for `tenant`, or RESOURCE_EXHAUSTED naming the cap that is full.
    pub fn take(self: &Arc<Self>, kind: StreamKind, tenant: &str) -> Result<StreamSlot, Error> {
        let (global, per_tenant) = kind.caps(&self.cfg);
        let mut counts = self.counts.lock().map_err(|_| Error::Internal("stream slots poisoned".into()))?;
        let mine = counts.per_tenant.get(&(kind, tenant.to_string())).copied().unwrap_or(0);
        if mine >= per_tenant {
            return Err(Error::ResourceExhausted(format!(
                "{per_tenant} {} of this tenant are open (streams.{}_per_tenant); wait for one to end",
                kind.what(),
                kind.key()
            )));
        }
        let all = counts.total.get(&kind).copied().unwrap_or(0);
        if all >= global {
            return Err(Error::ResourceExhausted(format!("{global} {} are open on this daemon (streams.{}); wait for one to end", kind.what(), kind.key())));
        }
        *counts.total.entry(kind).or_insert(0) += 1;
        *counts.per_tenant.entry((kind, tenant.to_string())).or_insert(0) += 1;
        Ok(StreamSlot { slots: self.clone(), kind, tenant: tenant.to_string() })
    }

    /// The idle deadline of a stream.
    pub fn idle_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.cfg.idle_timeout_ms)
    }

    /// Bytes of a session's input held once read.
    pub fn session_input_buffer(&self) -> usize {
        self.cfg.session_input_buffer_bytes
    }

    fn give_back(&self, kind: StreamKind, tenant: &str) {
        let Ok(mut counts) = self.counts.lock() else { return };
        if let Some(n) = counts.total.get_mut(&kind) {
            *n = n.saturating_sub(1);
        }
        let key = (kind, tenant.to_string());
        if let Some(n) = counts.per_tenant.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.per_tenant.remove(&key);
            }
        }
    }
}

/// One open stream's claim; dropping it frees the slot.
pub struct StreamSlot {
    slots: Arc<StreamSlots>,
    kind: StreamKind,
    tenant: String,
}

impl std::fmt::Debug for StreamSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSlot").field("kind", &self.kind).field("tenant", &self.tenant).finish()
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.slots.give_back(self.kind, &self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_refuse_naming_the_key_and_free_on_drop() {
        let cfg = StreamsConfig { max_downloads: 3, max_downloads_per_tenant: 2, ..Default::default() };
        let slots = StreamSlots::new(cfg);
        let a1 = slots.take(StreamKind::Download, "a").expect("first");
        let _a2 = slots.take(StreamKind::Download, "a").expect("second");
        let err = slots.take(StreamKind::Download, "a").expect_err("third of a tenant").to_string();
        assert!(err.contains("streams.max_downloads_per_tenant"), "{err}");
        let _b1 = slots.take(StreamKind::Download, "b").expect("another tenant");
        let err = slots.take(StreamKind::Download, "c").expect_err("global cap").to_string();
        assert!(err.contains("(streams.max_downloads)"), "{err}");
        // Other kinds have caps of their own.
        let _u = slots.take(StreamKind::Upload, "a").expect("an upload");
        drop(a1);
        let _c1 = slots.take(StreamKind::Download, "c").expect("a freed slot is taken again");
    }
}
