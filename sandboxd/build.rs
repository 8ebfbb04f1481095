//! A fingerprint of this build's sources, `SANDBOXD_BUILD`: the daemon and its `sandbox-init`
//! binary carry the same one only when both were linked from the same sources, so the daemon can
//! tell a `sandbox-init` left from another build (`cargo build --bin sandboxd` alone) and not run
//! sandboxes under an init that speaks another protocol or lacks a fix.

use std::hash::Hasher;
use std::path::{Path, PathBuf};

/// Every file under `dir`, recursively.
fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() => files_under(&path, out),
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

fn main() {
    let Some(manifest) = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from) else {
        panic!("CARGO_MANIFEST_DIR is not set: run through cargo");
    };
    let workspace = manifest.join("..");
    // The init is this crate's code and the exec crate's; the lock file pins their dependencies.
    let roots = [manifest.join("src"), workspace.join("exec/src"), workspace.join("Cargo.lock")];
    let mut files = Vec::new();
    for root in &roots {
        println!("cargo:rerun-if-changed={}", root.display());
        if root.is_dir() {
            files_under(root, &mut files);
        } else {
            files.push(root.clone());
        }
    }
    files.sort();
    // SipHash with fixed keys: the same sources give the same value in this run, which is all
    // that is compared (both binaries link the one library this script builds for).
    let mut hash = std::hash::DefaultHasher::new();
    for file in &files {
        hash.write(file.strip_prefix(&workspace).unwrap_or(file).to_string_lossy().as_bytes());
        match std::fs::read(file) {
            Ok(bytes) => hash.write(&bytes),
            Err(e) => panic!("reading {}: {e}", file.display()),
        }
    }
    println!("cargo:rustc-env=SANDBOXD_BUILD={:016x}", hash.finish());
}
