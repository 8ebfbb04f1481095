//! A build, step by step: the plan the daemon follows instead of handing a whole Dockerfile to
//! Docker.
//!
//! Docker's build API runs RUN steps in containers of its own making: Docker's default seccomp
//! profile and capabilities, no `no-new-privileges` (the API refuses security options on Linux),
//! and on a network of Docker's. So the daemon splits the (checked, pinned) Dockerfile:
//!
//! * every run of instructions other than RUN becomes a **segment**, a small Dockerfile
//!   `FROM <the image so far>` + those instructions, built by Docker's classic builder with no
//!   network: COPY, ENV, WORKDIR and the rest start no process of the build's;
//! * every **RUN** step runs in a container sandbox made from the image so far (the container
//!   tier's confinement, limits and egress filter, see `backend::container`), and what it wrote
//!   is committed as the next image.
//!
//! This module is the pure part: parsing into stages and steps, the text of a segment, and the
//! environment Docker would give a RUN step (the image's ENV plus the build args its stage
//! declares).

use std::collections::BTreeMap;

use super::build::{escape_char, logical_lines};
use super::ImageError;

/// Build args Docker passes to RUN steps without an `ARG` declaring them.
const PREDEFINED_ARGS: [&str; 10] =
    ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "FTP_PROXY", "ftp_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"];

/// The PATH a RUN step gets from an image that sets none (what Docker gives a container).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A Dockerfile as the daemon runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Parser directives (`# escape=…`), repeated at the top of every segment.
    pub directives: Vec<String>,
    /// The ARG instructions before the first FROM.
    pub global_args: Vec<Arg>,
    pub stages: Vec<Stage>,
}

/// One `ARG` instruction: its text and what it declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arg {
    pub text: String,
    /// Each name with its default (unexpanded, quotes kept), in order.
    pub names: Vec<(String, Option<String>)>,
}

/// One `FROM` and what follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// The base: a Docker image ID (a pinned catalog image), an earlier stage's name or index,
    /// or `scratch`.
    pub base: String,
    /// Flags of the FROM (`--platform=…`).
    pub flags: Vec<String>,
    /// The `AS` name, lowercased.
    pub name: Option<String>,
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Arg(Arg),
    /// A RUN instruction: its 1-based line and its command.
    Run {
        line: usize,
        command: RunCommand,
    },
    /// Anything else, for a segment: its 1-based line and text.
    Other {
        line: usize,
        text: String,
    },
}

/// What a RUN runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunCommand {
    /// The shell form: run by the stage's SHELL.
    Shell(String),
    /// The exec (JSON) form.
    Exec(Vec<String>),
}

impl RunCommand {
    /// The argv under `shell` (the image's SHELL, or `/bin/sh -c`).
    pub fn argv(&self, shell: &[String]) -> Vec<String> {
        match self {
            RunCommand::Shell(cmd) => {
                let mut argv = if shell.is_empty() { vec!["/bin/sh".to_string(), "-c".to_string()] } else { shell.to_vec() };
                argv.push(cmd.clone());
                argv
            }
            RunCommand::Exec(argv) => argv.clone(),
        }
    }

    /// How the step is named in the log (at most 120 characters).
    pub fn display(&self) -> String {
        let text = match self {
            RunCommand::Shell(cmd) => cmd.clone(),
            RunCommand::Exec(argv) => serde_json::to_string(argv).unwrap_or_default(),
        };
        let mut short: String = text.chars().take(120).collect();
        if short.len() < text.len() {
            short.push('…');
        }
        short
    }
}

impl Step {
    /// Whether this step, in a segment, reads the build context (COPY or ADD without
    /// `--from`).
    pub fn reads_context(&self) -> bool {
        let Step::Other { text, .. } = self else { return false };
        let mut words = text.split_whitespace();
        let instruction = words.next().unwrap_or_default().to_ascii_uppercase();
        (instruction == "COPY" || instruction == "ADD") && !words.take_while(|w| w.starts_with("--")).any(|w| w.to_ascii_lowercase().starts_with("--from="))
    }
}

/// Parses a checked and pinned Dockerfile into its plan. Refused (INVALID_ARGUMENT naming the
/// line): what the classic builder does not know or the daemon cannot box — RUN flags
/// (`--mount`, `--network`, `--security` are BuildKit's), ONBUILD (a trigger would run in a
/// later build outside any box), an instruction before the first FROM other than ARG.
pub fn plan(dockerfile: &str) -> Result<Plan, ImageError> {
    let lines: Vec<String> = dockerfile.lines().map(str::to_string).collect();
    let escape = escape_char(&lines);
    let directives = lines.iter().take_while(|l| l.trim().strip_prefix('#').is_some_and(|d| d.contains('=') && !d.trim().contains(' '))).cloned().collect();
    let mut out = Plan { directives, global_args: Vec::new(), stages: Vec::new() };
    for (first, _last, text) in logical_lines(&lines, escape) {
        let line = first + 1;
        let refuse = |what: String| ImageError::Invalid { field: "dockerfile", message: format!("line {line}: {what}") };
        let (word, rest) = match text.trim().split_once(char::is_whitespace) {
            Some((w, r)) => (w, r.trim()),
            None => (text.trim(), ""),
        };
        let instruction = word.to_ascii_uppercase();
        match instruction.as_str() {
            "FROM" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let flags: Vec<String> = words.iter().take_while(|w| w.starts_with("--")).map(|w| w.to_string()).collect();
                let stage = match &words[flags.len()..] {
                    [base] => Stage { base: base.to_string(), flags, name: None, steps: Vec::new() },
                    [base, as_, name] if as_.eq_ignore_ascii_case("AS") => {
                        Stage { base: base.to_string(), flags, name: Some(name.to_ascii_lowercase()), steps: Vec::new() }
                    }
                    _ => return Err(refuse(format!("{text:?} is not `FROM <image> [AS <name>]`"))),
                };
                out.stages.push(stage);
            }
            "ARG" => {
                let arg = parse_arg(&text, rest).map_err(refuse)?;
                match out.stages.last_mut() {
                    Some(stage) => stage.steps.push(Step::Arg(arg)),
                    None => out.global_args.push(arg),
                }
            }
            "ONBUILD" => return Err(refuse("ONBUILD is not supported: its trigger would run in a later build, outside the build's box".into())),
            _ => {
                let Some(stage) = out.stages.last_mut() else {
                    return Err(refuse(format!("{instruction} before the first FROM (only ARG may come before it)")));
                };
                if instruction == "RUN" {
                    if rest.starts_with("--") {
                        return Err(refuse(format!(
                            "RUN {}: flags of RUN (--mount, --network, --security) are BuildKit's and not supported",
                            rest.split_whitespace().next().unwrap_or_default()
                        )));
                    }
                    let command = match rest.starts_with('[').then(|| serde_json::from_str::<Vec<String>>(rest).ok()).flatten() {
                        Some(argv) if !argv.is_empty() => RunCommand::Exec(argv),
                        Some(_) => return Err(refuse("RUN [] runs nothing".into())),
                        None if rest.is_empty() => return Err(refuse("RUN needs a command".into())),
                        None => RunCommand::Shell(rest.to_string()),
                    };
                    stage.steps.push(Step::Run { line, command });
                } else {
                    stage.steps.push(Step::Other { line, text: text.trim().to_string() });
                }
            }
        }
    }
    if out.stages.is_empty() {
        return Err(ImageError::Invalid { field: "dockerfile", message: "no FROM: a Dockerfile starts from an image".into() });
    }
    Ok(out)
}

/// The names and defaults of `ARG a=1 b "c=two words"`.
fn parse_arg(text: &str, rest: &str) -> Result<Arg, String> {
    let words = split_words(rest);
    if words.is_empty() {
        return Err("ARG needs a name".into());
    }
    let mut names = Vec::new();
    for w in words {
        let (name, default) = match w.split_once('=') {
            Some((n, d)) => (n.to_string(), Some(d.to_string())),
            None => (w, None),
        };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("ARG {name:?} is not a variable name"));
        }
        names.push((name, default));
    }
    Ok(Arg { text: text.trim().to_string(), names })
}

/// Words separated by unquoted whitespace, quotes kept (they are removed on expansion).
fn split_words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                cur.push(c);
            }
            (Some(q), c) if c == q => {
                quote = None;
                cur.push(c);
            }
            (_, '\\') => {
                cur.push(c);
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
            }
            (_, c) => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// `word` with its variables expanded from `vars` and its quotes removed, as Docker's
/// Dockerfile lexer does: `$X`, `${X}`, `${X:-default}`, `${X-default}`, `${X:+alt}`,
/// `${X+alt}`; nothing inside single quotes; `\` escapes the next character.
pub fn expand(word: &str, vars: &dyn Fn(&str) -> Option<String>) -> String {
    let chars: Vec<char> = word.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    let mut quote: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        match (quote, c) {
            (Some('\''), '\'') | (Some('"'), '"') => quote = None,
            (Some('\''), c) => out.push(c),
            (None, '\'' | '"') => quote = Some(c),
            (_, '\\') if i + 1 < chars.len() => {
                i += 1;
                out.push(chars[i]);
            }
            (_, '$') if i + 1 < chars.len() && chars[i + 1] == '{' => {
                let Some(close) = chars[i + 2..].iter().position(|c| *c == '}') else {
                    out.extend(&chars[i..]);
                    break;
                };
                let inner: String = chars[i + 2..i + 2 + close].iter().collect();
                out.push_str(&substitute(&inner, vars));
                i += 2 + close;
            }
            (_, '$') if i + 1 < chars.len() && (chars[i + 1].is_ascii_alphanumeric() || chars[i + 1] == '_') => {
                let end = chars[i + 1..].iter().position(|c| !(c.is_ascii_alphanumeric() || *c == '_')).map_or(chars.len(), |p| i + 1 + p);
                let name: String = chars[i + 1..end].iter().collect();
                out.push_str(&vars(&name).unwrap_or_default());
                i = end - 1;
            }
            (_, c) => out.push(c),
        }
        i += 1;
    }
    out
}

/// The value of `${inner}`.
fn substitute(inner: &str, vars: &dyn Fn(&str) -> Option<String>) -> String {
    let name_end = inner.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(inner.len());
    let (name, op) = inner.split_at(name_end);
    let value = vars(name);
    let (colon, op) = match op.strip_prefix(':') {
        Some(rest) => (true, rest),
        None => (false, op),
    };
    let set = match &value {
        Some(v) => !(colon && v.is_empty()),
        None => false,
    };
    match op.chars().next() {
        Some('-') => {
            if set {
                value.unwrap_or_default()
            } else {
                expand(&op[1..], vars)
            }
        }
        Some('+') => {
            if set {
                expand(&op[1..], vars)
            } else {
                String::new()
            }
        }
        _ => value.unwrap_or_default(),
    }
}

/// The values of the global ARGs (those before the first FROM): the build arg, else the
/// default expanded against the globals before it.
pub fn global_values(globals: &[Arg], build_args: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut values = BTreeMap::new();
    for (name, default) in globals.iter().flat_map(|a| a.names.iter()) {
        let value = build_args.get(name).cloned().or_else(|| default.as_ref().map(|d| expand(d, &|n| values.get(n).cloned())));
        if let Some(v) = value {
            values.insert(name.clone(), v);
        }
    }
    values
}

/// The environment of a RUN step, as Docker gives it: the image's ENV (`image_env`, `K=V`
/// strings), then each ARG the stage declared before the step (`stage_args`) with its value —
/// the build arg, else its default expanded against what is set so far, else (no default) the
/// global ARG of that name — unless the image's ENV sets that name; then the predefined proxy
/// args given as build args; PATH if nothing set it.
pub fn run_env(image_env: &[String], stage_args: &[&Arg], globals: &BTreeMap<String, String>, build_args: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> =
        image_env.iter().map(|kv| kv.split_once('=').map_or((kv.clone(), String::new()), |(k, v)| (k.to_string(), v.to_string()))).collect();
    let from_image: Vec<String> = env.iter().map(|(k, _)| k.clone()).collect();
    let mut args: Vec<(String, String)> = Vec::new();
    for (name, default) in stage_args.iter().flat_map(|a| a.names.iter()) {
        let lookup = |n: &str| env.iter().chain(args.iter()).rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        let value = match (build_args.get(name), default) {
            (Some(v), _) => Some(v.clone()),
            (None, Some(d)) => Some(expand(d, &lookup)),
            (None, None) => globals.get(name).cloned(),
        };
        if let Some(v) = value {
            args.retain(|(k, _)| k != name);
            args.push((name.clone(), v));
        }
    }
    for name in PREDEFINED_ARGS {
        if let Some(v) = build_args.get(name) {
            if !args.iter().any(|(k, _)| k == name) {
                args.push((name.to_string(), v.clone()));
            }
        }
    }
    env.extend(args.into_iter().filter(|(k, _)| !from_image.contains(k)));
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".to_string(), DEFAULT_PATH.to_string()));
    }
    env
}

/// The Dockerfile of a segment: the directives, the global ARGs, `FROM <base>`, the ARGs the
/// stage declared in earlier segments (so the instructions still see them), then the steps.
/// `--from=` of a COPY naming an earlier stage becomes that stage's image (`stage_image`).
pub fn segment(
    plan: &Plan,
    flags: &[String],
    base: &str,
    earlier_args: &[&Arg],
    steps: &[&Step],
    stage_image: &dyn Fn(&str) -> Option<String>,
) -> Result<String, ImageError> {
    let mut out: Vec<String> = plan.directives.clone();
    out.extend(plan.global_args.iter().map(|a| a.text.clone()));
    let mut from = vec!["FROM".to_string()];
    from.extend(flags.iter().cloned());
    from.push(base.to_string());
    out.push(from.join(" "));
    out.extend(earlier_args.iter().map(|a| a.text.clone()));
    for step in steps {
        match step {
            Step::Arg(a) => out.push(a.text.clone()),
            Step::Other { line, text } => out.push(rewrite_from(*line, text, stage_image)?),
            Step::Run { line, .. } => return Err(ImageError::Internal(format!("line {line}: a RUN step in a segment"))),
        }
    }
    let mut text = out.join("\n");
    text.push('\n');
    Ok(text)
}

/// `text` (a COPY or ADD) with `--from=<stage>` replaced by the stage's image; other words as
/// they were. A catalog image was pinned to an image ID already and stays.
fn rewrite_from(line: usize, text: &str, stage_image: &dyn Fn(&str) -> Option<String>) -> Result<String, ImageError> {
    let mut words: Vec<String> = Vec::new();
    let mut in_flags = true;
    for (i, w) in text.split(' ').enumerate() {
        if i > 0 && in_flags && !w.is_empty() && !w.starts_with("--") {
            in_flags = false;
        }
        match w.split_once('=') {
            Some((flag, value)) if i > 0 && in_flags && flag.eq_ignore_ascii_case("--from") && !value.starts_with("sha256:") => {
                let image = stage_image(&value.to_ascii_lowercase()).ok_or_else(|| ImageError::Invalid {
                    field: "dockerfile",
                    message: format!("line {line}: --from={value} names no earlier stage with an image"),
                })?;
                words.push(format!("{flag}={image}"));
            }
            _ => words.push(w.to_string()),
        }
    }
    Ok(words.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_dockerfile_becomes_stages_of_steps() {
        let text = "# escape=\\\nARG V=1\nFROM --platform=linux/amd64 sha256:aa AS base\nARG X=\"a b\" Y\nENV A=$X\nRUN echo \\\n  hi\nRUN [\"/bin/true\", \"x\"]\nFROM base\nCOPY --from=base /a /b\nWORKDIR /w\n";
        let p = plan(text).expect("plan");
        assert_eq!(p.directives, ["# escape=\\"]);
        assert_eq!(p.global_args.len(), 1);
        assert_eq!(p.stages.len(), 2);
        let s = &p.stages[0];
        assert_eq!((s.base.as_str(), s.flags.as_slice(), s.name.as_deref()), ("sha256:aa", &["--platform=linux/amd64".to_string()][..], Some("base")));
        assert_eq!(s.steps[0], Step::Arg(Arg { text: "ARG X=\"a b\" Y".into(), names: vec![("X".into(), Some("\"a b\"".into())), ("Y".into(), None)] }));
        assert_eq!(s.steps[2], Step::Run { line: 6, command: RunCommand::Shell("echo   hi".into()) });
        assert_eq!(s.steps[3], Step::Run { line: 8, command: RunCommand::Exec(vec!["/bin/true".into(), "x".into()]) });
        assert!(!p.stages[1].steps[0].reads_context() && !p.stages[1].steps[1].reads_context());
        assert!(Step::Other { line: 1, text: "COPY --chown=1 . /app".into() }.reads_context());
        assert_eq!(RunCommand::Shell("ls".into()).argv(&[]), ["/bin/sh", "-c", "ls"]);
        assert_eq!(RunCommand::Shell("ls".into()).argv(&["bash".into(), "-ec".into()]), ["bash", "-ec", "ls"]);
    }

    #[test]
    fn what_cannot_be_boxed_is_refused_naming_the_line() {
        for (text, wanted) in [
            ("FROM sha256:a\nRUN --mount=type=bind,target=/x true\n", "line 2: RUN --mount"),
            ("FROM sha256:a\nRUN --network=host true\n", "line 2"),
            ("FROM sha256:a\nONBUILD RUN true\n", "line 2: ONBUILD"),
            ("ENV A=1\nFROM sha256:a\n", "line 1: ENV before the first FROM"),
            ("ARG A=1\n", "no FROM"),
            ("FROM sha256:a\nRUN []\n", "line 2"),
            ("FROM sha256:a\nARG 1-x\n", "line 2"),
        ] {
            let err = plan(text).expect_err(text).to_string();
            assert!(err.contains(wanted), "{text:?}: {err}");
        }
    }

    #[test]
    fn variables_expand_as_docker_expands_them() {
        let vars = |n: &str| match n {
            "A" => Some("1".to_string()),
            "E" => Some(String::new()),
            _ => None,
        };
        for (word, wanted) in [
            ("$A-${A}", "1-1"),
            ("${B:-x$A}", "x1"),
            ("${E:-d}", "d"),
            ("${E-d}", ""),
            ("${A:+set}${B:+no}", "set"),
            ("'$A' \"$A\"", "$A 1"),
            ("\\$A", "$A"),
            ("$", "$"),
            ("${A", "${A"),
        ] {
            assert_eq!(expand(word, &vars), wanted, "{word}");
        }
    }

    #[test]
    fn a_run_step_sees_the_image_env_and_its_stages_args() {
        let p = plan("ARG G=g1\nARG H=$G-h\nFROM sha256:a\nARG G\nARG X=${G}x\nARG P=\"path $PATH\"\nARG Q\n").expect("plan");
        let globals = global_values(&p.global_args, &args(&[]));
        assert_eq!(globals, args(&[("G", "g1"), ("H", "g1-h")]));
        let stage_args: Vec<&Arg> = p.stages[0].steps.iter().filter_map(|s| if let Step::Arg(a) = s { Some(a) } else { None }).collect();
        let env = run_env(&["PATH=/bin".into(), "X=from-env".into()], &stage_args, &globals, &args(&[("Q", "q"), ("HTTP_PROXY", "http://p"), ("UNUSED", "u")]));
        let env: BTreeMap<_, _> = env.into_iter().collect();
        // ENV wins over ARG; a bare ARG takes the global; the predefined proxy arg passes.
        assert_eq!(env, args(&[("PATH", "/bin"), ("X", "from-env"), ("G", "g1"), ("P", "path /bin"), ("Q", "q"), ("HTTP_PROXY", "http://p")]));
        let env = run_env(&[], &[], &globals, &args(&[]));
        assert_eq!(env, [("PATH".to_string(), DEFAULT_PATH.to_string())]);
    }

    #[test]
    fn a_segment_starts_from_the_image_so_far_and_keeps_the_stages_args() {
        let p = plan(
            "ARG G=1\nFROM sha256:a AS one\nARG X=2\nRUN true\nFROM sha256:b\nCOPY --from=one --chown=1 /a /b\nCOPY --from=sha256:c /c /c\nCOPY --from=1 x y\n",
        )
        .expect("plan");
        let Step::Arg(x) = &p.stages[0].steps[0] else { panic!("an ARG") };
        let steps: Vec<&Step> = p.stages[1].steps.iter().collect();
        let images = |s: &str| match s {
            "one" | "0" => Some("sha256:one".to_string()),
            _ => None,
        };
        let err = segment(&p, &[], "sha256:b", &[x], &steps, &images).expect_err("stage 1 has no image yet");
        assert!(err.to_string().contains("line 8: --from=1"), "{err}");
        let text = segment(&p, &["--platform=x".into()], "sha256:img", &[x], &steps[..2], &images).expect("segment");
        assert_eq!(text, "ARG G=1\nFROM --platform=x sha256:img\nARG X=2\nCOPY --from=sha256:one --chown=1 /a /b\nCOPY --from=sha256:c /c /c\n");
    }
}
