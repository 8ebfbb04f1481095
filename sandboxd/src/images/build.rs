//! What a build needs from its context before Docker sees it: the Dockerfile, checked and
//! pinned.
//!
//! `FROM sandboxd/<name>` (or `sandboxd/<name>:latest`, and the same in `COPY --from=`) names a
//! catalog image the caller can use: before the build, each one is made to exist in Docker and
//! the Dockerfile Docker reads names it by its Docker image ID, so the build starts from
//! exactly the rootfs the caller's sandboxes of that image run — never from what else Docker
//! calls that name, another tenant's image of the same name, or an image of the host's own.
//! Anything else a build could reach beyond its context is refused before it starts (see
//! [`check`]).

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

/// A Dockerfile, checked: every image it starts from is a catalog image (to be pinned), an
/// earlier stage or `scratch`, and nothing in it makes Docker fetch a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The physical lines.
    lines: Vec<String>,
    /// Each instruction that names a catalog image: its first and last physical line (0-based),
    /// its text with continuations joined, and the reference and the catalog name it names.
    uses: Vec<Use>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Use {
    first: usize,
    last: usize,
    text: String,
    reference: String,
    name: String,
}

impl Checked {
    /// The catalog names the Dockerfile starts from (FROM and COPY --from), each once, in order.
    pub fn catalog_names(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for u in &self.uses {
            if !out.contains(&u.name) {
                out.push(u.name.clone());
            }
        }
        out
    }

    /// The Dockerfile with every catalog reference replaced by `pinned[name]` (a Docker image
    /// ID), so Docker builds from exactly the image the caller may use, whatever else its local
    /// store calls `sandboxd/<name>`. Line numbers stay: a rewritten instruction is one line,
    /// followed by as many empty lines as its continuations took.
    pub fn pinned(&self, pinned: &std::collections::HashMap<String, String>) -> String {
        let mut lines = self.lines.clone();
        for u in &self.uses {
            let Some(id) = pinned.get(&u.name) else { continue };
            let rewritten = u.text.split(' ').map(|w| replace_ref(w, &u.reference, id)).collect::<Vec<_>>().join(" ");
            lines[u.first] = rewritten;
            for l in &mut lines[u.first + 1..=u.last] {
                l.clear();
            }
        }
        let mut out = lines.join("\n");
        out.push('\n');
        out
    }
}

/// `word` with the reference `reference` (as a whole word or a `--from=` value) replaced.
fn replace_ref(word: &str, reference: &str, id: &str) -> String {
    if word == reference {
        return id.to_string();
    }
    match word.split_once('=') {
        Some((flag, value)) if flag.eq_ignore_ascii_case("--from") && value == reference => format!("{flag}={id}"),
        _ => word.to_string(),
    }
}

/// Checks a Dockerfile before Docker sees it (see [`Checked`]). A refusal is INVALID_ARGUMENT
/// naming the line: an `ADD` of a URL (dockerd would fetch it on the host's network, whatever
/// the build's network is), an `ADD` whose source has a variable (it could expand to one), a
/// `FROM` or `COPY --from` of anything but `sandboxd/<name>`, an earlier stage or `scratch`
/// (any other name is an image of the host's Docker, perhaps the operator's private one, or a
/// pull).
pub fn check(dockerfile: &str) -> Result<Checked, ImageError> {
    let lines: Vec<String> = dockerfile.lines().map(str::to_string).collect();
    let escape = escape_char(&lines);
    let mut stages: Vec<String> = Vec::new();
    let mut uses = Vec::new();
    for (first, last, text) in logical_lines(&lines, escape) {
        let refuse = |what: String| ImageError::Invalid { field: "dockerfile", message: format!("line {}: {what}", first + 1) };
        let mut words: Vec<&str> = text.split_whitespace().collect();
        let mut instruction = words.first().map(|w| w.to_ascii_uppercase()).unwrap_or_default();
        // ONBUILD runs its instruction in a later build: checked like one here.
        if instruction == "ONBUILD" {
            words.remove(0);
            instruction = words.first().map(|w| w.to_ascii_uppercase()).unwrap_or_default();
        }
        let args = words.get(1..).unwrap_or_default();
        match instruction.as_str() {
            "FROM" => {
                let rest: Vec<&str> = args.iter().copied().filter(|w| !w.starts_with("--")).collect();
                let (reference, stage) = match rest.as_slice() {
                    [r] => (*r, None),
                    [r, as_, s] if as_.eq_ignore_ascii_case("AS") => (*r, Some(s.to_ascii_lowercase())),
                    _ => return Err(refuse(format!("{text:?} is not `FROM <image> [AS <name>]`"))),
                };
                match base(reference, &stages) {
                    Base::Catalog(name) => uses.push(Use { first, last, text: text.clone(), reference: reference.to_string(), name }),
                    Base::Stage | Base::Scratch => {}
                    Base::Other(why) => return Err(refuse(format!("FROM {reference}: {why}"))),
                }
                stages.extend(stage);
            }
            "COPY" | "ADD" => {
                for flag in args.iter().take_while(|w| w.starts_with("--")) {
                    let Some((name, value)) = flag.split_once('=') else { continue };
                    if !name.eq_ignore_ascii_case("--from") {
                        continue;
                    }
                    match base(value, &stages) {
                        Base::Catalog(name) => uses.push(Use { first, last, text: text.clone(), reference: value.to_string(), name }),
                        Base::Stage => {}
                        Base::Scratch => return Err(refuse(format!("{instruction} --from=scratch copies nothing"))),
                        Base::Other(why) => return Err(refuse(format!("{instruction} --from={value}: {why}"))),
                    }
                }
                if instruction == "ADD" {
                    for source in add_sources(&args.join(" ")) {
                        let lower = source.to_ascii_lowercase();
                        if lower.contains("://") || lower.starts_with("git@") {
                            return Err(refuse(format!(
                                "ADD {source}: a build fetches nothing from the network (Docker would fetch it on the host's, whatever the build's network); download it into the context and COPY it"
                            )));
                        }
                        if source.contains('$') {
                            return Err(refuse(format!("ADD {source}: a variable in an ADD source could name a URL; use COPY for files of the context")));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(Checked { lines, uses })
}

/// What a `FROM` or `--from=` names.
enum Base {
    /// `sandboxd/<name>` (`:latest` allowed): the catalog image `<name>`.
    Catalog(String),
    /// An earlier stage, by name or index.
    Stage,
    Scratch,
    /// Anything else, and why it is refused.
    Other(&'static str),
}

fn base(reference: &str, stages: &[String]) -> Base {
    if reference.contains('$') {
        return Base::Other("a variable could name any image of the host's Docker; name the catalog image (`sandboxd/<name>`)");
    }
    let lower = reference.to_ascii_lowercase();
    if stages.contains(&lower) || (!reference.is_empty() && reference.bytes().all(|b| b.is_ascii_digit())) {
        return Base::Stage;
    }
    if lower == "scratch" {
        return Base::Scratch;
    }
    match catalog_name(reference) {
        Some(name) => Base::Catalog(name.to_string()),
        None => Base::Other(
            "a build starts only from a catalog image you can use (`sandboxd/<name>`), an earlier stage or scratch — never another image of the host's Docker",
        ),
    }
}

/// The sources of an ADD's arguments (flags and the destination left out), in the shell or the
/// JSON form.
fn add_sources(args: &str) -> Vec<String> {
    let rest = args.split_whitespace().skip_while(|w| w.starts_with("--")).collect::<Vec<_>>().join(" ");
    let words: Vec<String> = if rest.trim_start().starts_with('[') {
        serde_json::from_str::<Vec<String>>(rest.trim()).unwrap_or_else(|_| rest.split_whitespace().map(str::to_string).collect())
    } else {
        rest.split_whitespace().map(str::to_string).collect()
    };
    let n = words.len().saturating_sub(1);
    words.into_iter().take(n.max(1)).collect()
}

/// The catalog name a `FROM` reference names, if it is `sandboxd/<name>` or
/// `sandboxd/<name>:latest`.
pub fn catalog_name(reference: &str) -> Option<&str> {
    let rest = reference.strip_prefix(REPO_PREFIX)?;
    let name = rest.strip_suffix(":latest").unwrap_or(rest);
    (super::is_valid_name(name) && !name.contains(':')).then_some(name)
}

/// The escape character of a Dockerfile: `\`, or what an `# escape=` parser directive at the
/// top says.
pub(super) fn escape_char(lines: &[String]) -> char {
    for line in lines {
        let Some(directive) = line.trim().strip_prefix('#') else { break };
        let Some((key, value)) = directive.split_once('=') else { break };
        if key.trim().eq_ignore_ascii_case("escape") {
            return match value.trim() {
                "`" => '`',
                _ => '\\',
            };
        }
    }
    '\\'
}

/// Instructions as Docker reads them: lines ending in the escape character joined with the
/// next (the character and the newline removed, as Docker does), comment lines inside them
/// and blank lines between them dropped; each with its first and last physical line.
pub(super) fn logical_lines(lines: &[String], escape: char) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, raw) in lines.iter().enumerate() {
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.starts_with('#') || (cur.is_none() && trimmed.is_empty()) {
            continue;
        }
        let (first, mut text) = cur.take().unwrap_or((i, String::new()));
        match line.strip_suffix(escape) {
            Some(head) => {
                text.push_str(if text.is_empty() { head.trim_start() } else { head });
                cur = Some((first, text));
            }
            None => {
                text.push_str(if text.is_empty() { trimmed } else { line });
                out.push((first, i, text));
            }
        }
    }
    if let Some((first, text)) = cur {
        if !text.trim().is_empty() {
            out.push((first, lines.len().saturating_sub(1), text));
        }
    }
    out
}

/// Appends `text` as the member `name` to the plain tar at `context` (over its end-of-archive
/// blocks), so the build reads the checked and pinned Dockerfile instead of the client's.
pub fn append_to_context(context: &Path, name: &str, text: &str) -> Result<(), ImageError> {
    let end = {
        let file = File::open(context).map_err(|e| ImageError::io("opening the build context", e))?;
        let mut archive = tar::Archive::new(std::io::BufReader::new(file));
        let entries = archive.entries_with_seek().map_err(|e| ImageError::Invalid { field: "context", message: format!("not a tar archive: {e}") })?;
        let mut end = 0u64;
        for entry in entries {
            let entry = entry.map_err(|e| ImageError::Invalid { field: "context", message: format!("not a readable tar archive: {e}") })?;
            end = entry.raw_file_position().saturating_add(entry.size().div_ceil(512).saturating_mul(512));
        }
        end
    };
    let file = std::fs::OpenOptions::new().write(true).open(context).map_err(|e| ImageError::io("opening the build context", e))?;
    file.set_len(end).map_err(|e| ImageError::io("writing the build context", e))?;
    let mut file = std::io::BufWriter::new(file);
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(end)).map_err(|e| ImageError::io("writing the build context", e))?;
    let mut builder = tar::Builder::new(file);
    let mut header = tar::Header::new_gnu();
    header.set_size(text.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_cksum();
    builder.append_data(&mut header, name, text.as_bytes()).map_err(|e| ImageError::io("writing the build context", e))?;
    builder.into_inner().and_then(|mut w| std::io::Write::flush(&mut w)).map_err(|e| ImageError::io("writing the build context", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_bases_are_pinned_and_everything_else_is_refused() {
        let text = "# syntax=docker/dockerfile:1\nARG X=1\nfrom --platform=linux/amd64 sandboxd/debian AS base\nRUN true\nFROM base\nFROM \\\n  sandboxd/minimal:latest\nCOPY --from=base /a /b\nCOPY --from=0 /a /c\nCOPY --from=sandboxd/tools /bin/x /bin/x\nADD local.tar /opt/\nADD [\"a b\", \"/x/\"]\nFROM scratch\n";
        let c = check(text).expect("allowed");
        assert_eq!(c.catalog_names(), ["debian", "minimal", "tools"]);
        let pinned = c.pinned(
            &[("debian", "sha256:d"), ("minimal", "sha256:m"), ("tools", "sha256:t")].into_iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
        );
        let lines: Vec<&str> = pinned.lines().collect();
        assert_eq!(lines.len(), text.lines().count(), "line numbers kept: {pinned}");
        assert_eq!(lines[2], "from --platform=linux/amd64 sha256:d AS base");
        assert_eq!((lines[5], lines[6]), ("FROM   sha256:m", ""));
        assert_eq!(lines[9], "COPY --from=sha256:t /bin/x /bin/x");
        assert_eq!(lines[7], "COPY --from=base /a /b");
        assert!(!pinned.contains("sandboxd/"), "{pinned}");
        assert_eq!(catalog_name("sandboxd/debian:12"), None);
        assert_eq!(catalog_name("sandboxd/../x"), None);

        for (bad, needle) in [
            ("FROM sandboxd/debian\nRUN true\nADD http://127.0.0.1:8080/secret /s\n", "line 3: ADD http://127.0.0.1:8080/secret"),
            ("FROM sandboxd/debian\nADD --chown=1 HTTPS://x/y /s\n", "line 2"),
            ("FROM sandboxd/debian\nADD [\"https://x/y\", \"/s\"]\n", "line 2"),
            ("FROM sandboxd/debian\nADD git@github.com:a/b.git /s\n", "line 2"),
            ("FROM sandboxd/debian\nADD \\\n  http://x/y /s\n", "line 2"),
            ("FROM sandboxd/debian\nARG U=http://x\nADD $U /s\n", "line 3: ADD $U"),
            ("FROM sandboxd/debian\nONBUILD ADD http://x/y /s\n", "line 2"),
            ("FROM busybox:latest\n", "line 1: FROM busybox:latest"),
            ("FROM sandboxd/debian AS a\nFROM private/secret-image AS b\n", "line 2"),
            ("ARG B=busybox\nFROM $B\n", "line 2: FROM $B"),
            ("FROM sandboxd/debian\nCOPY --from=operator/private:1 /etc/shadow /x\n", "line 2: COPY --from=operator/private:1"),
            ("FROM sandboxd/debian\nCOPY --from=later /x /x\nFROM sandboxd/debian AS later\n", "line 2"),
            ("# escape=`\nFROM sandboxd/debian\nADD `\n http://x/y /s\n", "line 3"),
        ] {
            match check(bad) {
                Err(ImageError::Invalid { field: "dockerfile", message }) => assert!(message.starts_with(needle), "{bad:?}: {message}"),
                other => panic!("{bad:?} was not refused: {other:?}"),
            }
        }
    }

    #[test]
    fn the_pinned_dockerfile_is_appended_to_the_context() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("ctx.tar");
        let mut b = tar::Builder::new(File::create(&path).expect("create"));
        let mut h = tar::Header::new_gnu();
        h.set_size(5);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "Dockerfile", &b"FROM "[..]).expect("append");
        b.finish().expect("finish");
        drop(b);
        append_to_context(&path, ".pinned", "FROM sha256:x\n").expect("append");
        assert_eq!(dockerfile_of(&path, ".pinned").expect("read"), "FROM sha256:x\n");
        assert_eq!(dockerfile_of(&path, "Dockerfile").expect("the client's is still there"), "FROM ");
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
