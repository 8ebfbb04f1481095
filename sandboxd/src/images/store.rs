//! How much of the host's disk the image store may take.
//!
//! Imports write client bytes to the host: the archive or build context as it arrives
//! (`.upload-*`), a `docker:` export, the staged rootfs, and later the microVM tier's base disk.
//! Each is bounded on its own (`images.max_archive_bytes`, `images.max_rootfs_bytes`), but not
//! their sum: any number of clients may stream uploads at once (only the work after the upload
//! takes one of `images.max_concurrent` slots), and any number of imports may be kept. So the
//! store as a whole has a budget, `images.max_store_bytes`, and the filesystem under it keeps
//! `images.min_free_bytes` free for everything else on the host; a write past either is
//! RESOURCE_EXHAUSTED naming the key, and the upload or staging dir is removed.
//!
//! * committed: the disk the imported images hold (`du` of `<state_dir>/images/<name>/`), each
//!   measured at start, after its import (tiers included) and forgotten at its removal — one
//!   image's tree per import, never the whole store again;
//! * in flight: what the imports running now have written and not yet committed, claimed by
//!   each as it writes ([`Claim::grow`]) and released when its claim is dropped (the temporary
//!   file or staging dir is gone by then, or committed and measured).
//!
//! Two imports staging at once may each be told the same room, so the store can pass its budget
//! by up to `max_concurrent` rootfs for the moment until the second one's claim fails; the base
//! disk the microVM tier makes after the commit is counted once it is made (the image is measured
//! after its tiers), not claimed ahead. The Docker Engine's copy of an image (container tier) is
//! in Docker's storage and not counted here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{human, ImageError};
use crate::hostfs::{self, Measure};

/// The budget of the image store; shared by every import.
#[derive(Debug)]
pub struct StoreBudget {
    dir: PathBuf,
    max: u64,
    min_free: u64,
    /// Disk of each imported image, by name.
    committed: Mutex<HashMap<String, u64>>,
    in_flight: AtomicU64,
}

/// Bytes an import has written and not yet committed; released when dropped.
#[derive(Debug)]
pub struct Claim {
    budget: Arc<StoreBudget>,
    bytes: u64,
}

impl StoreBudget {
    /// A budget of `max` bytes for the imported images under `dir`, keeping `min_free` bytes of
    /// its filesystem free. Measures the store (blocks: call at start or from `spawn_blocking`).
    pub fn new(dir: &Path, max: u64, min_free: u64) -> Arc<Self> {
        let budget = Arc::new(StoreBudget { dir: dir.to_path_buf(), max, min_free, committed: Mutex::new(HashMap::new()), in_flight: AtomicU64::new(0) });
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                // Dot entries are in flight (uploads, staging) or going (trash), and the catalog
                // clears them at start.
                let name = entry.file_name();
                match name.to_str() {
                    Some(name) if !name.starts_with('.') && entry.file_type().is_ok_and(|t| t.is_dir()) => budget.measure(name),
                    _ => {}
                }
            }
        }
        tracing::info!(bytes = budget.committed(), max, "image store measured");
        budget
    }

    /// Measures imported image `name` (once it is in place with what its tiers made of it).
    /// Blocks.
    pub fn measure(&self, name: &str) {
        let bytes = hostfs::tree_size(&self.dir.join(name), Measure::Allocated);
        self.set(name, Some(bytes));
    }

    /// Forgets imported image `name` (removed).
    pub fn forget(&self, name: &str) {
        self.set(name, None);
    }

    fn set(&self, name: &str, bytes: Option<u64>) {
        let Ok(mut sizes) = self.committed.lock() else { return };
        match bytes {
            Some(b) => sizes.insert(name.to_string(), b),
            None => sizes.remove(name),
        };
    }

    /// Bytes the imported images hold (a sum over a few entries per upload chunk).
    fn committed(&self) -> u64 {
        self.committed.lock().map(|s| s.values().fold(0u64, |a, b| a.saturating_add(*b))).unwrap_or(0)
    }

    /// Bytes the store holds and is being written, counted against the budget.
    pub fn used(&self) -> u64 {
        self.committed().saturating_add(self.in_flight.load(Ordering::Relaxed))
    }

    /// Bytes an import may still write before the store is full.
    pub fn room(&self) -> u64 {
        self.max.saturating_sub(self.used())
    }

    /// A new, empty claim; refused when the store or its filesystem is already full.
    pub fn claim(self: &Arc<Self>) -> Result<Claim, ImageError> {
        let claim = Claim { budget: self.clone(), bytes: 0 };
        claim.grow_by(0)?;
        claim.check_free()?;
        Ok(claim)
    }

    /// The error for a store that is over its budget.
    pub fn full(&self, needed: u64) -> ImageError {
        ImageError::StoreFull(format!(
            "the image store is full: {} more would pass images.max_store_bytes ({}); {} images hold {} and imports in flight {}; remove images (sbx image rm) or raise the limit",
            human(needed),
            human(self.max),
            self.committed.lock().map(|s| s.len()).unwrap_or_default(),
            human(self.committed()),
            human(self.in_flight.load(Ordering::Relaxed)),
        ))
    }

    /// Bytes free for unprivileged writes on the store's filesystem.
    fn free(&self) -> Option<u64> {
        let st = nix::sys::statvfs::statvfs(&self.dir).ok()?;
        Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
    }
}

impl Claim {
    /// Counts `n` more bytes written by this import; an error once the store is over budget
    /// (the bytes stay claimed until the claim is dropped, as they stay on disk until then).
    pub fn grow(&mut self, n: u64) -> Result<(), ImageError> {
        self.bytes = self.bytes.saturating_add(n);
        self.budget.in_flight.fetch_add(n, Ordering::Relaxed);
        self.grow_by(n)
    }

    fn grow_by(&self, n: u64) -> Result<(), ImageError> {
        if self.budget.used() > self.budget.max {
            return Err(self.budget.full(n));
        }
        Ok(())
    }

    /// An error when the store's filesystem has less than `images.min_free_bytes` free.
    pub fn check_free(&self) -> Result<(), ImageError> {
        match self.budget.free() {
            Some(free) if free < self.budget.min_free => Err(ImageError::StoreFull(format!(
                "the filesystem of the image store has {} free, less than images.min_free_bytes ({}); remove images (sbx image rm) or free space on the host",
                human(free),
                human(self.budget.min_free)
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses, before anything is written, `n` more bytes that would not fit (a client that
    /// says how long its upload is learns at once).
    pub fn fits(&self, n: u64) -> Result<(), ImageError> {
        if n > self.budget.room() {
            return Err(self.budget.full(n));
        }
        Ok(())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.budget.in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_measured_and_claims_count_until_dropped() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(tmp.path().join("one/rootfs")).expect("mkdir");
        std::fs::write(tmp.path().join("one/rootfs/f"), vec![1u8; 64 << 10]).expect("write");
        // In flight or going: not committed.
        std::fs::create_dir_all(tmp.path().join(".staging-two-x/rootfs")).expect("mkdir");
        std::fs::write(tmp.path().join(".staging-two-x/rootfs/f"), vec![1u8; 64 << 10]).expect("write");
        std::fs::write(tmp.path().join(".upload-y"), vec![1u8; 64 << 10]).expect("write");

        let budget = StoreBudget::new(tmp.path(), 200 << 10, 0);
        let committed = budget.used();
        assert!((64 << 10..100 << 10).contains(&committed), "one image of 64 KiB: {committed}");
        let mut a = budget.claim().expect("room");
        a.grow(50 << 10).expect("within");
        let mut b = budget.claim().expect("room");
        let err = b.grow(100 << 10).expect_err("the two claims pass the budget");
        assert!(matches!(&err, ImageError::StoreFull(m) if m.contains("images.max_store_bytes") && m.contains("1 images")), "{err}");
        assert_eq!(budget.used(), committed + (150 << 10), "a failed claim holds its bytes until dropped");
        drop(b);
        assert_eq!(budget.room(), (200 << 10) - committed - (50 << 10));
        drop(a);
        assert_eq!(budget.used(), committed);

        // Full already: no new claim.
        let mut c = budget.claim().expect("room");
        assert!(c.grow(1 << 20).is_err());
        assert!(budget.claim().is_err(), "a store over its budget takes no new import");
        drop(c);

        let claim = budget.claim().expect("room");
        assert!(claim.fits(100 << 10).is_ok() && claim.fits(200 << 10).is_err(), "a declared length past the room is refused at once");
        drop(claim);

        std::fs::create_dir_all(tmp.path().join("two/rootfs")).expect("mkdir");
        std::fs::write(tmp.path().join("two/rootfs/f"), vec![1u8; 64 << 10]).expect("write");
        budget.measure("two");
        assert!(budget.used() >= 2 * (64 << 10), "two images: {}", budget.used());
        budget.forget("one");
        budget.forget("two");
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_filesystem_below_its_reserve_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let budget = StoreBudget::new(tmp.path(), u64::MAX, u64::MAX);
        let err = budget.claim().expect_err("no filesystem has u64::MAX bytes free");
        assert!(matches!(&err, ImageError::StoreFull(m) if m.contains("images.min_free_bytes")), "{err}");
        assert!(StoreBudget::new(tmp.path(), u64::MAX, 0).claim().is_ok());
    }
}
