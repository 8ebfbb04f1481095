//! Hostile probes (`tests/probes/*.c`), built for the test that runs them.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::workspace_root;

/// Builds a hostile probe of `tests/probes/<name>.c` as a static binary (so it runs in any
/// image, busybox included) into `out_dir`, and returns its bytes.
pub fn build_probe(name: &str, out_dir: &Path) -> Result<Vec<u8>> {
    let source = workspace_root().join("tests/probes").join(format!("{name}.c"));
    let out = out_dir.join(name);
    let status = Command::new("gcc")
        .args(["-static", "-O1", "-Wall", "-o"])
        .arg(&out)
        .arg(&source)
        .status()
        .context("running gcc (apt-get install gcc libc6-dev) to build a probe")?;
    if !status.success() {
        bail!("building probe {} failed ({status})", source.display());
    }
    std::fs::read(&out).with_context(|| format!("reading built probe {}", out.display()))
}
