//! What a build needs from its context before Docker sees it: the Dockerfile's `FROM` lines.
//!
//! `FROM sandboxd/<name>` (or `sandboxd/<name>:latest`) names a catalog image: before the
//! build, each one is made to exist in Docker and tagged `sandboxd/<name>:latest`, so the build
//! starts from exactly the rootfs the sandboxes of that image run.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::ImageError;

/// Largest Dockerfile read.
const MAX_DOCKERFILE_BYTES: u64 = 1 << 20;

/// The repository prefix of catalog images in Docker.
pub const REPO_PREFIX: &str = "sandboxd/";

/// The Dockerfile at `dockerfile` (a path inside the context) from the context tar at `context`.
pub fn dockerfile_of(context: &Path, dockerfile: &str) -> Result<String, ImageError> {
    let wanted = normalize(dockerfile)
        .ok_or_else(|| ImageError::Invalid { field: "dockerfile", message: format!("{dockerfile:?} is not a path inside the context") })?;
    let file = File::open(context).map_err(|e| ImageError::io("opening the build context", e))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(file));
    let entries = archive.entries_with_seek().map_err(|e| ImageError::Invalid { field: "context", message: format!("not a tar archive: {e}") })?;
    for entry in entries {
        let mut entry = entry.map_err(|e| ImageError::Invalid { field: "context", message: format!("not a readable tar archive: {e}") })?;
        let Some(name) = std::str::from_utf8(&entry.path_bytes()).ok().and_then(normalize) else { continue };
        if name != wanted || !matches!(entry.header().entry_type(), tar::EntryType::Regular | tar::EntryType::Continuous) {
            continue;
        }
        if entry.size() > MAX_DOCKERFILE_BYTES {
            return Err(ImageError::Invalid {
                field: "dockerfile",
                message: format!("{dockerfile} is {} bytes; at most {MAX_DOCKERFILE_BYTES}", entry.size()),
            });
        }
        let mut text = String::new();
        entry.read_to_string(&mut text).map_err(|e| ImageError::Invalid { field: "dockerfile", message: format!("{dockerfile}: {e}") })?;
        return Ok(text);
    }
    Err(ImageError::Invalid { field: "dockerfile", message: format!("{dockerfile} is not in the build context") })
}

/// A path inside the context as a member name: no `./`, no `..`, not absolute.
fn normalize(path: &str) -> Option<String> {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    if comps.is_empty() || comps.contains(&"..") || path.starts_with('/') {
        return None;
    }
    Some(comps.join("/"))
}

/// The images the `FROM` lines of a Dockerfile start from, in order (build stages named with
/// `AS` and references with variables left out: they name no image of their own).
pub fn from_images(dockerfile: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stages: Vec<String> = Vec::new();
    for line in logical_lines(dockerfile) {
        let mut words = line.split_whitespace();
        if !words.next().is_some_and(|w| w.eq_ignore_ascii_case("FROM")) {
            continue;
        }
        let mut rest: Vec<&str> = words.filter(|w| !w.starts_with("--")).collect();
        let mut stage = None;
        if rest.len() >= 3 && rest[rest.len() - 2].eq_ignore_ascii_case("AS") {
            stage = Some(rest[rest.len() - 1].to_ascii_lowercase());
            rest.truncate(rest.len() - 2);
        }
        let Some(image) = rest.first().map(|s| s.to_string()) else { continue };
        let earlier_stage = stages.contains(&image.to_ascii_lowercase());
        stages.extend(stage);
        if image.contains('$') || earlier_stage {
            continue;
        }
        out.push(image);
    }
    out
}

/// The catalog name a `FROM` reference names, if it is `sandboxd/<name>` or
/// `sandboxd/<name>:latest`.
pub fn catalog_name(reference: &str) -> Option<&str> {
    let rest = reference.strip_prefix(REPO_PREFIX)?;
    let name = rest.strip_suffix(":latest").unwrap_or(rest);
    (super::is_valid_name(name) && !name.contains(':')).then_some(name)
}

/// Lines with continuations (`\` at the end) joined, comments and blank lines dropped.
fn logical_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if cur.is_empty() && (line.starts_with('#') || line.is_empty()) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(line);
        out.push(std::mem::take(&mut cur));
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_lines_name_the_base_images() {
        let text = "# syntax\nARG X=1\nfrom --platform=linux/amd64 sandboxd/debian AS base\nRUN true\nFROM base\nFROM \\\n  sandboxd/minimal:latest\nFROM busybox:1.36 as tools\nFROM ${BASE}\n";
        assert_eq!(from_images(text), ["sandboxd/debian", "sandboxd/minimal:latest", "busybox:1.36"]);
        assert_eq!(catalog_name("sandboxd/debian"), Some("debian"));
        assert_eq!(catalog_name("sandboxd/minimal:latest"), Some("minimal"));
        assert_eq!(catalog_name("sandboxd/debian:12"), None);
        assert_eq!(catalog_name("sandboxd/../x"), None);
        assert_eq!(catalog_name("debian"), None);
    }

    #[test]
    fn the_dockerfile_is_read_from_the_context() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("ctx.tar");
        let mut b = tar::Builder::new(File::create(&path).expect("create"));
        for (name, data) in [("./Dockerfile", &b"FROM sandboxd/debian\n"[..]), ("sub/Other", &b"FROM x\n"[..])] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data).expect("append");
        }
        b.finish().expect("finish");
        drop(b);
        assert_eq!(dockerfile_of(&path, "Dockerfile").expect("read"), "FROM sandboxd/debian\n");
        assert_eq!(dockerfile_of(&path, "./sub/Other").expect("read"), "FROM x\n");
        assert!(matches!(dockerfile_of(&path, "missing"), Err(ImageError::Invalid { field: "dockerfile", .. })));
        assert!(matches!(dockerfile_of(&path, "../etc/passwd"), Err(ImageError::Invalid { field: "dockerfile", .. })));
    }
}
