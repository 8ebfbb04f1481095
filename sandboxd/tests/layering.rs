//! The shape of the crate, pinned: the top-level modules of `sandboxd/src` import each other
//! without a cycle, and no isolation tier under `backend/` reaches into another tier.
//!
//! The check reads the sources with `std::fs` rather than asking the compiler, so it needs no
//! extra dependency and runs in the normal `cargo test`. It is a small lexer, not a parser:
//! comments, string and char literals are blanked first (a doc link or a message naming
//! `crate::x` is no import), then every path that starts with `crate::`, `super::` or `self::`
//! is resolved against the module the file (or the inline `mod` block) defines, `use` groups
//! included (`use crate::{a::b, c}` names `a` and `c`). Paths that do not start with one of
//! those keywords can only name something in scope, which a keyword path brought there, or a
//! child module, which is no edge between top-level modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The isolation tiers, one folder each under `backend/`.
const TIERS: [&str; 3] = ["process", "container", "microvm"];

// ---- Lexing ----

/// `src` with comments, string literals and char literals replaced by spaces (newlines kept),
/// so that only code is left to scan.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&c, i) {
            // r"…", r#"…"#, br#"…"#: no escapes, ends at a quote followed by as many hashes.
            let open = i + usize::from(c[i] == 'b') + 1 + hashes + 1;
            for &ch in &c[i..open] {
                blank(&mut out, ch);
            }
            i = open;
            while i < c.len() && !(c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#'))) {
                blank(&mut out, c[i]);
                i += 1;
            }
            let close = (i + 1 + hashes).min(c.len());
            for &ch in &c[i..close] {
                blank(&mut out, ch);
            }
            i = close;
        } else if c[i] == '"' {
            blank(&mut out, c[i]);
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    blank(&mut out, c[i]);
                    i += 1;
                }
                if i < c.len() {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            if i < c.len() {
                blank(&mut out, c[i]);
                i += 1;
            }
        } else if c[i] == '\'' {
            // A char literal ('x', '\n', '\u{1F600}', '"') or a lifetime ('a): only the former
            // is blanked, so a quote inside it cannot open a string.
            let end = if next == Some('\\') {
                // The escaped character sits at i + 2 (it may be a quote), so the closing quote
                // is the first one from i + 3 on.
                (i + 3..c.len()).find(|&k| c[k] == '\'')
            } else if c.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for &ch in &c[i..=end] {
                        blank(&mut out, ch);
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c[i]);
                    i += 1;
                }
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn is_ident_char(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// When a raw (byte) string literal starts at `i`, the number of `#` it opens with.
fn raw_string_start(c: &[char], i: usize) -> Option<usize> {
    if i > 0 && is_ident_char(c[i - 1]) {
        return None;
    }
    let mut k = i;
    if c.get(k) == Some(&'b') {
        k += 1;
    }
    if c.get(k) != Some(&'r') {
        return None;
    }
    k += 1;
    let hashes = c[k..].iter().take_while(|&&ch| ch == '#').count();
    (c.get(k + hashes) == Some(&'"')).then_some(hashes)
}

/// Identifiers, `::` and single punctuation characters of stripped code.
fn tokens(code: &str) -> Vec<String> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if c[i].is_whitespace() {
            i += 1;
        } else if is_ident_char(c[i]) {
            let start = i;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push("::".to_string());
            i += 2;
        } else {
            out.push(c[i].to_string());
            i += 1;
        }
    }
    out
}

// ---- Paths ----

/// A `use` tree or path expression after its root keyword: each leaf as its segments
/// (`{a::b, c}` → `[[a, b], [c]]`). Reads from `toks[*i]`, which follows a `::`.
fn path_tails(toks: &[String], i: &mut usize) -> Vec<Vec<String>> {
    match toks.get(*i).map(String::as_str) {
        Some("{") => {
            *i += 1;
            let mut all = Vec::new();
            while let Some(t) = toks.get(*i) {
                match t.as_str() {
                    "}" => {
                        *i += 1;
                        break;
                    }
                    "," => *i += 1,
                    _ => {
                        let before = *i;
                        all.extend(path_tails(toks, i));
                        if *i == before {
                            // Something that is no path (a stray token): step over it.
                            *i += 1;
                        }
                    }
                }
            }
            all
        }
        Some("*") => {
            *i += 1;
            vec![vec!["*".to_string()]]
        }
        Some(t) if is_ident_char(t.chars().next().unwrap_or(' ')) => {
            let seg = t.to_string();
            *i += 1;
            if toks.get(*i).map(String::as_str) == Some("::") {
                *i += 1;
                let mut tails = path_tails(toks, i);
                for tail in &mut tails {
                    tail.insert(0, seg.clone());
                }
                if tails.is_empty() {
                    tails.push(vec![seg]);
                }
                tails
            } else {
                if toks.get(*i).map(String::as_str) == Some("as") {
                    // `x as y`: the alias is local; the path is what it names.
                    *i += 2;
                }
                // `a::{self, b}`: `self` is `a` itself.
                if seg == "self" {
                    return vec![Vec::new()];
                }
                vec![vec![seg]]
            }
        }
        _ => Vec::new(),
    }
}

/// Every module-relative path of `src` (a file of module `module`), resolved to a path from the
/// crate root: `crate::a::b`, `super::x` and `self::y` (also inside `use` groups and inline
/// `mod` blocks). A `super` that climbs above the root is dropped.
fn crate_paths(module: &[String], src: &str) -> Vec<Vec<String>> {
    let toks = tokens(&strip(src));
    let mut out = Vec::new();
    // The inline `mod name {` blocks we are in, with the brace depth each opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        match t {
            "{" => {
                depth += 1;
                i += 1;
                continue;
            }
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                i += 1;
                continue;
            }
            "mod" if toks.get(i + 2).map(String::as_str) == Some("{") => {
                inline.push((toks[i + 1].clone(), depth));
                i += 2;
                continue;
            }
            _ => {}
        }
        let prev = i.checked_sub(1).map(|p| toks[p].as_str());
        let is_root = matches!(t, "crate" | "super" | "self") && toks.get(i + 1).map(String::as_str) == Some("::");
        // `a::super` is no root, and `$crate` is a macro's own crate.
        if !is_root || matches!(prev, Some("::") | Some("$")) {
            i += 1;
            continue;
        }
        let mut here: Vec<String> = module.iter().cloned().chain(inline.iter().map(|(m, _)| m.clone())).collect();
        let mut base = match t {
            "crate" => Some(Vec::new()),
            "self" => Some(here.clone()),
            _ => here.pop().map(|_| here.clone()),
        };
        i += 2;
        // Leading `super::super::…` climbs further.
        while toks.get(i).map(String::as_str) == Some("super") && toks.get(i + 1).map(String::as_str) == Some("::") {
            base = base.and_then(|mut b| b.pop().map(|_| b));
            i += 2;
        }
        let tails = path_tails(&toks, &mut i);
        if let Some(base) = base {
            for tail in tails {
                out.push(base.iter().cloned().chain(tail).collect());
            }
        }
    }
    out
}

// ---- The crate's files ----

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()));
        for entry in entries {
            let path = entry.unwrap_or_else(|e| panic!("reading {}: {e}", d.display())).path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The module a file under `src` defines (`a/b.rs` and `a/b/mod.rs` are `a::b`); None for the
/// crate roots (`lib.rs`, and `main.rs`, which is another crate).
fn module_of(rel: &Path) -> Option<Vec<String>> {
    let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    let file = segs.pop()?;
    let stem = file.strip_suffix(".rs")?;
    if segs.is_empty() && (stem == "lib" || stem == "main") {
        return None;
    }
    if stem != "mod" {
        segs.push(stem.to_string());
    }
    Some(segs)
}

/// A source file of the crate: where it is, the module it defines, and the paths it uses.
struct Source {
    rel: PathBuf,
    module: Vec<String>,
    paths: Vec<Vec<String>>,
}

fn sources() -> Vec<Source> {
    let root = src_dir();
    rust_files(&root)
        .into_iter()
        .filter_map(|path| {
            let rel = path.strip_prefix(&root).ok()?.to_path_buf();
            let module = module_of(&rel)?;
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            let paths = crate_paths(&module, &text);
            Some(Source { rel, module, paths })
        })
        .collect()
}

// ---- The checks ----

/// Edges between top-level modules: `from → {to: the first file that makes the edge}`.
type Graph = BTreeMap<String, BTreeMap<String, PathBuf>>;

fn top_level_graph(sources: &[Source]) -> Graph {
    let modules: BTreeSet<&String> = sources.iter().filter_map(|s| s.module.first()).collect();
    let mut graph = Graph::new();
    for s in sources {
        let Some(from) = s.module.first() else { continue };
        let node = graph.entry(from.clone()).or_default();
        for p in &s.paths {
            if let Some(to) = p.first().filter(|to| *to != from && modules.contains(to)) {
                node.entry(to.clone()).or_insert_with(|| s.rel.clone());
            }
        }
    }
    graph
}

/// The cycles of `graph`: for each module that lies on one, a shortest way from it back to
/// itself (`a → b → a`), each cycle once. Not every elementary cycle, but every module of every
/// strongly connected component shows up, and each mutual import as its own two-step cycle.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    for start in graph.keys() {
        // Breadth first from `start`, remembering how each module was reached.
        let mut prev: BTreeMap<&String, &String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut back = None;
        'search: while let Some(n) = queue.pop_front() {
            for next in graph.get(n).into_iter().flat_map(|e| e.keys()) {
                if next == start {
                    back = Some(n);
                    break 'search;
                }
                if !prev.contains_key(next) {
                    prev.insert(next, n);
                    queue.push_back(next);
                }
            }
        }
        let Some(mut n) = back else { continue };
        let mut cycle = vec![start.clone()];
        while n != start {
            cycle.insert(1, n.clone());
            n = prev[n];
        }
        // The same cycle found from another of its modules starts elsewhere: compare them
        // rotated to start at their smallest module.
        let rotated = |c: &[String]| {
            let body = &c[..c.len() - 1];
            let k = (0..body.len()).min_by_key(|&k| &body[k]).unwrap_or(0);
            body[k..].iter().chain(&body[..k]).cloned().collect::<Vec<_>>()
        };
        cycle.push(start.clone());
        let key = rotated(&cycle);
        if !out.iter().any(|c| rotated(c) == key) {
            out.push(cycle);
        }
    }
    out
}

/// A cycle as a sentence naming, for each edge, a file that makes it.
fn describe(graph: &Graph, cycle: &[String]) -> String {
    let edges: Vec<String> = cycle
        .windows(2)
        .map(|w| format!("{} → {} (in {})", w[0], w[1], graph.get(&w[0]).and_then(|e| e.get(&w[1])).map(|p| p.display().to_string()).unwrap_or_default()))
        .collect();
    format!("{}: {}", cycle.join(" → "), edges.join(", "))
}

/// References from a tier's files to another tier: `(file, the path it uses)`.
fn cross_tier(sources: &[Source]) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for s in sources {
        let own = match s.module.as_slice() {
            [backend, tier, ..] if backend == "backend" && TIERS.contains(&tier.as_str()) => tier,
            _ => continue,
        };
        for p in &s.paths {
            if p.len() >= 2 && p[0] == "backend" && TIERS.contains(&p[1].as_str()) && &p[1] != own {
                out.push((s.rel.clone(), p.join("::")));
            }
        }
    }
    out
}

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let sources = sources();
    let graph = top_level_graph(&sources);
    // A check that found nothing to check would pass forever: the edges every layout has.
    for (from, to) in [("api", "manager"), ("manager", "backend"), ("server", "api")] {
        assert!(graph.get(from).is_some_and(|e| e.contains_key(to)), "the scan lost the edge {from} → {to}: {graph:#?}");
    }
    let found: Vec<String> = cycles(&graph).iter().map(|c| describe(&graph, c)).collect();
    assert!(found.is_empty(), "top-level modules of sandboxd/src import in a circle:\n  {}", found.join("\n  "));
}

#[test]
fn no_tier_reaches_into_another() {
    let sources = sources();
    for tier in TIERS {
        let files = sources.iter().filter(|s| s.module.len() >= 2 && s.module[0] == "backend" && s.module[1] == tier).count();
        assert!(files > 0, "no files under backend/{tier}/: the tier list of this test is out of date");
    }
    let found: Vec<String> = cross_tier(&sources).iter().map(|(f, p)| format!("{} uses {p}", f.display())).collect();
    assert!(found.is_empty(), "a tier reaches into another tier; share code through backend/ instead:\n  {}", found.join("\n  "));
}

// ---- The checker itself, on made-up sources: a check that cannot fail is a defect. ----

fn module(path: &str) -> Vec<String> {
    path.split("::").map(str::to_string).collect()
}

fn fake(files: &[(&str, &str)]) -> Vec<Source> {
    files
        .iter()
        .map(|(m, text)| {
            let module = module(m);
            let rel = PathBuf::from(format!("{}.rs", module.join("/")));
            Source { paths: crate_paths(&module, text), module, rel }
        })
        .collect()
}

#[test]
fn paths_are_resolved_through_groups_super_and_inline_modules() {
    let src = r##"
        use crate::{error::Error, store::{self, Store}, ids};
        use super::super::container as c;
        // use crate::commented::Out;
        /* use crate::blocked::Out; /* nested */ */
        /// [`crate::doc_link`]
        const S: &str = "crate::in_a_string";
        const R: &str = r#"crate::in_a_raw_string"#;
        const Q: char = '"';
        fn f<'a>(x: &'a str) -> crate::metrics::Op { let _ = crate::policy::decide; $crate::macro_own; }
        mod tests { use super::*; use super::super::files; }
    "##;
    let found: BTreeSet<String> = crate_paths(&module("backend::process::exec"), src).iter().map(|p| p.join("::")).collect();
    let expected = [
        "error::Error",
        "store",
        "store::Store",
        "ids",
        "backend::container",
        "metrics::Op",
        "policy::decide",
        "backend::process::exec::*",
        "backend::process::files",
    ];
    assert_eq!(found, expected.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>());
}

#[test]
fn a_cycle_is_found_and_named() {
    let sources = fake(&[
        ("manager", "use crate::store::Store; use crate::backend::Backends;"),
        ("store", "use crate::{ids::ExecId, manager::ExecRecord};"),
        ("backend", "use crate::ids::SandboxId;"),
        ("ids", ""),
    ]);
    let graph = top_level_graph(&sources);
    let found = cycles(&graph);
    assert_eq!(found, vec![module("manager::store::manager")]);
    assert!(describe(&graph, &found[0]).contains("store → manager (in store.rs)"), "{}", describe(&graph, &found[0]));
    let acyclic = fake(&[("manager", "use crate::store::Store;"), ("store", "use crate::ids::ExecId;"), ("ids", "")]);
    assert!(cycles(&top_level_graph(&acyclic)).is_empty());
}

#[test]
fn a_tier_naming_another_is_found_but_shared_modules_are_not() {
    let sources = fake(&[
        ("backend::container::exec", "use super::process_cgroup::ExecCgroup; use crate::backend::cgroup;"),
        ("backend::container", "use super::cgroup as process_cgroup;"),
        ("backend::microvm::vm", "fn f() { crate::backend::process::init::run(); }"),
        ("backend::process", "use super::{container::Docker, files};"),
        ("backend::process::exec", "use super::super::microvm::Vm;"),
    ]);
    let found: Vec<String> = cross_tier(&sources).into_iter().map(|(f, p)| format!("{} {p}", f.display())).collect();
    assert_eq!(
        found,
        ["backend/microvm/vm.rs backend::process::init::run", "backend/process.rs backend::container::Docker", "backend/process/exec.rs backend::microvm::Vm",]
    );
}
