//! BENCHMARKS.md is written by several bench binaries in turn (`make bench`): each owns one
//! level-2 section and replaces only that one, leaving the others as they are.

use std::path::Path;

use anyhow::{Context, Result};

/// Replaces the section of the markdown file `path` that starts with the line `heading` (e.g.
/// `## Images`) with `section` (which starts with that heading), up to the next `#` or `##`
/// heading; appends it when the file has no such section, and creates the file if there is none.
pub fn replace_section(path: &Path, heading: &str, section: &str) -> Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        // Anything else (permissions, not UTF-8): never overwrite a file that was not read.
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    std::fs::write(path, replaced(&old, heading, section)).with_context(|| format!("writing {}", path.display()))
}

/// `doc` with its `heading` section replaced by `section`, or `section` appended.
fn replaced(doc: &str, heading: &str, section: &str) -> String {
    let lines: Vec<&str> = doc.lines().collect();
    let Some(start) = lines.iter().position(|l| l.trim_end() == heading) else {
        let mut out = doc.trim_end().to_owned();
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(section.trim_end());
        out.push('\n');
        return out;
    };
    let end = lines[start + 1..].iter().position(|l| l.starts_with("## ") || l.starts_with("# ")).map_or(lines.len(), |i| start + 1 + i);
    let mut out = lines[..start].join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(section.trim_end());
    out.push('\n');
    if end < lines.len() {
        out.push('\n');
        out.push_str(&lines[end..].join("\n"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_is_replaced_in_place_or_appended() {
        let doc = "# Bench\n\n## Latency\nfast\n\n## Images\nold\n### sub\nold\n\n## Density\nmany\n";
        assert_eq!(replaced(doc, "## Images", "## Images\nnew\n"), "# Bench\n\n## Latency\nfast\n\n## Images\nnew\n\n## Density\nmany\n");
        assert_eq!(replaced("# Bench\n", "## Images", "## Images\nnew\n\n"), "# Bench\n\n## Images\nnew\n");
        assert_eq!(replaced("# B\n\n## Images\nold\n", "## Images", "## Images\nnew\n"), "# B\n\n## Images\nnew\n");
        assert_eq!(replaced("## Images\nold\n## Other\nx\n", "## Images", "## Images\nnew"), "## Images\nnew\n\n## Other\nx\n");
        assert_eq!(replaced("", "## Images", "## Images\nnew\n"), "## Images\nnew\n");
        // A heading that only starts like it is another section.
        assert_eq!(replaced("## Images of VMs\nx\n", "## Images", "## Images\nnew\n"), "## Images of VMs\nx\n\n## Images\nnew\n");
    }

    #[test]
    fn the_file_is_created_then_updated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("BENCHMARKS.md");
        replace_section(&path, "## Images", "## Images\none\n").unwrap();
        replace_section(&path, "## Transfers", "## Transfers\nt\n").unwrap();
        replace_section(&path, "## Images", "## Images\ntwo\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "## Images\ntwo\n\n## Transfers\nt\n");
    }
}
