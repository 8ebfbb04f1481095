//! How much of the host's disk the image store may take.
//!
//! Imports write client bytes to the host: the archive or build context as it arrives
//! (`.upload-*`), a `docker:` export, the staged rootfs, and later the microVM tier's base disk.
//! Each is bounded on its own (`images.max_archive_bytes`, `images.max_rootfs_bytes`), but not
//! their sum: any number of clients may stream uploads at once (only the work after the upload
//! takes one of `images.max_concurrent` slots), and any number of imports may be kept. So the
//! store as a whole has a budget, `images.max_store_bytes`, and the filesystem under it keeps
//! `images.min_free_bytes` free for everything else on the host; a write past either is
//! RESOURCE_EXHAUSTED naming the key, and the upload or staging dir is removed. Each tenant's
//! images and imports in flight have a budget of their own beside it,
//! `images.max_store_bytes_per_tenant`, so one tenant cannot take the whole store; its
//! refusals speak only of that tenant's own bytes.
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

use super::{human, owner, ImageError, ImageJson};
use crate::hostfs::{self, Measure};

/// The budget of the image store; shared by every import.
#[derive(Debug)]
pub struct StoreBudget {
    dir: PathBuf,
    max: u64,
    min_free: u64,
    /// Bytes one tenant's images and claims may hold.
    per_tenant_max: u64,
    /// The tenant tag of images imported before owners were recorded.
    legacy_tag: String,
    /// Disk of each imported image, by key, with its owner's tenant tag.
    committed: Mutex<HashMap<String, (String, u64)>>,
    in_flight: AtomicU64,
    /// Bytes claimed and not committed, by tenant tag.
    in_flight_by_tenant: Mutex<HashMap<String, u64>>,
}

/// Bytes an import has written and not yet committed; released when dropped.
#[derive(Debug)]
pub struct Claim {
    budget: Arc<StoreBudget>,
    /// The importing tenant's tag.
    tag: String,
    bytes: u64,
}

impl StoreBudget {
    /// A budget of `max` bytes for the imported images under `dir` (`per_tenant_max` for one
    /// tenant's), keeping `min_free` bytes of its filesystem free; images from before owners
    /// were recorded count as `legacy_tenant`'s. Measures the store (blocks: call at start or
    /// from `spawn_blocking`).
    pub fn new(dir: &Path, max: u64, min_free: u64, per_tenant_max: u64, legacy_tenant: &str) -> Arc<Self> {
        let budget = Arc::new(StoreBudget {
            dir: dir.to_path_buf(),
            max,
            min_free,
            per_tenant_max,
            legacy_tag: owner::tenant_tag(legacy_tenant),
            committed: Mutex::new(HashMap::new()),
            in_flight: AtomicU64::new(0),
            in_flight_by_tenant: Mutex::new(HashMap::new()),
        });
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
        tracing::info!(bytes = budget.committed(None), max, "image store measured");
        budget
    }

    /// Measures imported image `key` (once it is in place with what its tiers made of it).
    /// Blocks.
    pub fn measure(&self, key: &str) {
        let dir = self.dir.join(key);
        let tag = match owner::split_key(key).1 {
            Some(tag) => tag.to_string(),
            // A shared image counts as the admin's who shared it.
            None => match std::fs::read(dir.join("image.json")).map(|b| ImageJson::parse(&b).owner) {
                Ok(o) if !o.is_empty() => owner::tenant_tag(&o),
                _ => self.legacy_tag.clone(),
            },
        };
        let bytes = hostfs::tree_size(&dir, Measure::Allocated);
        if let Ok(mut sizes) = self.committed.lock() {
            sizes.insert(key.to_string(), (tag, bytes));
        }
    }

    /// Forgets imported image `key` (removed).
    pub fn forget(&self, key: &str) {
        if let Ok(mut sizes) = self.committed.lock() {
            sizes.remove(key);
        }
    }

    /// Bytes the imported images hold (a sum over a few entries per upload chunk), all of
    /// them or one tenant's.
    fn committed(&self, tag: Option<&str>) -> u64 {
        let sum =
            |s: &HashMap<String, (String, u64)>| s.values().filter(|(t, _)| tag.is_none_or(|w| t.as_str() == w)).fold(0u64, |a, (_, b)| a.saturating_add(*b));
        self.committed.lock().map(|s| sum(&s)).unwrap_or(0)
    }

    fn in_flight_of(&self, tag: &str) -> u64 {
        self.in_flight_by_tenant.lock().map(|m| m.get(tag).copied().unwrap_or(0)).unwrap_or(0)
    }

    /// Bytes the store holds and is being written, counted against the budget.
    pub fn used(&self) -> u64 {
        self.committed(None).saturating_add(self.in_flight.load(Ordering::Relaxed))
    }

    /// Bytes one tenant's images hold and its imports are writing.
    pub fn used_by(&self, tenant: &str) -> u64 {
        let tag = owner::tenant_tag(tenant);
        self.committed(Some(&tag)).saturating_add(self.in_flight_of(&tag))
    }

    /// Bytes an import of `tenant` may still write before the store or the tenant's share of
    /// it is full.
    pub fn room(&self, tenant: &str) -> u64 {
        self.max.saturating_sub(self.used()).min(self.per_tenant_max.saturating_sub(self.used_by(tenant)))
    }

    /// A new, empty claim of `tenant`; refused when the store, the tenant's share or the
    /// filesystem is already full.
    pub fn claim(self: &Arc<Self>, tenant: &str) -> Result<Claim, ImageError> {
        let claim = Claim { budget: self.clone(), tag: owner::tenant_tag(tenant), bytes: 0 };
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
            human(self.committed(None)),
            human(self.in_flight.load(Ordering::Relaxed)),
        ))
    }

    /// The error for a tenant over its share: only its own bytes are named.
    fn tenant_full(&self, tag: &str, needed: u64) -> ImageError {
        ImageError::StoreFull(format!(
            "your images are over their share of the image store: {} more would pass images.max_store_bytes_per_tenant ({}); your images hold {} and your imports in flight {}; remove images (sbx image rm)",
            human(needed),
            human(self.per_tenant_max),
            human(self.committed(Some(tag))),
            human(self.in_flight_of(tag)),
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
        if let Ok(mut m) = self.budget.in_flight_by_tenant.lock() {
            let v = m.entry(self.tag.clone()).or_default();
            *v = v.saturating_add(n);
        }
        self.grow_by(n)
    }

    fn grow_by(&self, n: u64) -> Result<(), ImageError> {
        if self.budget.used() > self.budget.max {
            return Err(self.budget.full(n));
        }
        if self.budget.committed(Some(&self.tag)).saturating_add(self.budget.in_flight_of(&self.tag)) > self.budget.per_tenant_max {
            return Err(self.budget.tenant_full(&self.tag, n));
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
        if n > self.budget.max.saturating_sub(self.budget.used()) {
            return Err(self.budget.full(n));
        }
        let mine = self.budget.committed(Some(&self.tag)).saturating_add(self.budget.in_flight_of(&self.tag));
        if n > self.budget.per_tenant_max.saturating_sub(mine) {
            return Err(self.budget.tenant_full(&self.tag, n));
        }
        Ok(())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.budget.in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
        if let Ok(mut m) = self.budget.in_flight_by_tenant.lock() {
            if let Some(v) = m.get_mut(&self.tag) {
                *v = v.saturating_sub(self.bytes);
                if *v == 0 {
                    m.remove(&self.tag);
                }
            }
        }
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

        let budget = StoreBudget::new(tmp.path(), 200 << 10, 0, u64::MAX, "local");
        let committed = budget.used();
        assert!((64 << 10..100 << 10).contains(&committed), "one image of 64 KiB: {committed}");
        let mut a = budget.claim("t").expect("room");
        a.grow(50 << 10).expect("within");
        let mut b = budget.claim("t").expect("room");
        let err = b.grow(100 << 10).expect_err("the two claims pass the budget");
        assert!(matches!(&err, ImageError::StoreFull(m) if m.contains("images.max_store_bytes") && m.contains("1 images")), "{err}");
        assert_eq!(budget.used(), committed + (150 << 10), "a failed claim holds its bytes until dropped");
        drop(b);
        assert_eq!(budget.room("t"), (200 << 10) - committed - (50 << 10));
        drop(a);
        assert_eq!(budget.used(), committed);

        // Full already: no new claim.
        let mut c = budget.claim("t").expect("room");
        assert!(c.grow(1 << 20).is_err());
        assert!(budget.claim("t").is_err(), "a store over its budget takes no new import");
        drop(c);

        let claim = budget.claim("t").expect("room");
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
        let budget = StoreBudget::new(tmp.path(), u64::MAX, u64::MAX, u64::MAX, "local");
        let err = budget.claim("t").expect_err("no filesystem has u64::MAX bytes free");
        assert!(matches!(&err, ImageError::StoreFull(m) if m.contains("images.min_free_bytes")), "{err}");
        assert!(StoreBudget::new(tmp.path(), u64::MAX, 0, u64::MAX, "local").claim("t").is_ok());
    }

    #[test]
    fn a_tenant_over_its_share_is_refused_and_others_go_on() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let a_key = super::owner::Viewer { tenant: "a".into(), owns_legacy: false, admin: false }.key("big");
        std::fs::create_dir_all(tmp.path().join(&a_key).join("rootfs")).expect("mkdir");
        std::fs::write(tmp.path().join(&a_key).join("rootfs/f"), vec![1u8; 96 << 10]).expect("write");
        let budget = StoreBudget::new(tmp.path(), 1 << 30, 0, 128 << 10, "local");
        assert!(budget.used_by("a") >= 96 << 10 && budget.used_by("b") == 0);
        let mut a = budget.claim("a").expect("a has some room");
        let err = a.grow(64 << 10).expect_err("past a's share");
        let m = err.to_string();
        assert!(m.contains("images.max_store_bytes_per_tenant") && m.contains("your images"), "{m}");
        assert!(budget.claim("b").expect("b").fits(100 << 10).is_ok(), "another tenant's share is untouched");
        assert!(budget.room("b") > budget.room("a"));
        drop(a);
        assert_eq!(budget.used_by("a"), budget.used(), "only a's image is in the store");
    }
}
