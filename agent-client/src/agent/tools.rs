//! The tools the model may call, and the tolerant parsing of its calls into [`Action`]s.
//!
//! Models get tool calls wrong in a few recurring ways: JSON with a trailing comma, single
//! quotes, Python literals or a missing closing brace (output cut short), a misspelled or
//! synonymous field (`cmd`, `file_path`), a number sent as a string, a missing optional field.
//! Those are repaired here, each repair named so it can be logged. What cannot be repaired
//! safely (a missing required field, an unknown tool) becomes a [`CallError`] the loop sends
//! back to the model.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::llm::ToolSpec;

/// Default lines returned by `read_file`.
pub const DEFAULT_READ_LINES: u64 = 200;

/// Whether a tool's call is safe to send again when it is not known whether it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeat {
    /// Sending it again leaves the same state: reads, whole-file writes, pins, recall, a
    /// rollback to a named snapshot.
    Safe,
    /// Its commands go with an idempotency key; sent again under the same key the daemon runs
    /// them at most once and answers with the recorded result (bash, the checks of subtask
    /// and finish).
    Keyed,
    /// A read-modify-write: sent again only after checking whether the write landed
    /// (str_replace, whose new text may contain the old one).
    CheckFirst,
    /// Each sending makes something new (a snapshot): looked up first, never re-run blindly.
    LookUpFirst,
}

/// A parsed, validated tool call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "tool", rename_all = "snake_case")]
pub enum Action {
    /// Run a shell command.
    Bash {
        /// The command line, run with `bash -c` (or `sh -c` where bash is missing).
        command: String,
        /// Kill it after this many seconds.
        #[serde(default)]
        timeout_secs: Option<u64>,
        /// Start it and return at once with its exec id.
        #[serde(default)]
        background: bool,
    },
    /// Read lines of a file.
    ReadFile {
        /// Path inside the sandbox.
        path: String,
        /// First line, 1-based.
        start_line: u64,
        /// How many lines.
        max_lines: u64,
        /// Character offset within `start_line` to start at, to page through a very long line.
        #[serde(default)]
        start_char: u64,
    },
    /// Write a whole file.
    WriteFile {
        /// Path inside the sandbox.
        path: String,
        /// The new content.
        content: String,
    },
    /// Replace text in a file.
    StrReplace {
        /// Path inside the sandbox.
        path: String,
        /// Text to find; must occur exactly once unless `replace_all`.
        old_str: String,
        /// Replacement.
        new_str: String,
        /// Replace every occurrence.
        replace_all: bool,
    },
    /// Snapshot the sandbox.
    Snapshot {
        /// A name for it.
        name: Option<String>,
    },
    /// Roll the sandbox back to a snapshot.
    Rollback {
        /// The snapshot.
        snapshot_id: String,
    },
    /// Declare the task done.
    Finish {
        /// The final answer.
        answer: String,
    },
    /// Pin (or, with no value, unpin) a fact that survives every summary.
    Pin {
        /// The fact's name.
        key: String,
        /// Its value; `None` removes it.
        value: Option<String>,
    },
    /// Start a subtask, optionally with a check that must pass before the next one or finish.
    Subtask {
        /// What the subtask is.
        title: String,
        /// Shell command that verifies it.
        check: Option<String>,
    },
    /// Fetch back the full result of an earlier step.
    Recall {
        /// The step number.
        step: u64,
    },
}

impl Action {
    /// The tool's name.
    pub fn tool(&self) -> &'static str {
        match self {
            Action::Bash { .. } => "bash",
            Action::ReadFile { .. } => "read_file",
            Action::WriteFile { .. } => "write_file",
            Action::StrReplace { .. } => "str_replace",
            Action::Snapshot { .. } => "snapshot",
            Action::Rollback { .. } => "rollback",
            Action::Finish { .. } => "finish",
            Action::Pin { .. } => "pin",
            Action::Subtask { .. } => "subtask",
            Action::Recall { .. } => "recall",
        }
    }

    /// Whether the action may be sent again when it is not known to have happened (its reply
    /// was lost to a daemon outage, or the agent stopped after sending it). A retry and a
    /// resume both go by this.
    pub fn repeat(&self) -> Repeat {
        match self {
            Action::Bash { .. } | Action::Finish { .. } | Action::Subtask { .. } => Repeat::Keyed,
            Action::StrReplace { .. } => Repeat::CheckFirst,
            Action::Snapshot { .. } => Repeat::LookUpFirst,
            Action::ReadFile { .. }
            | Action::WriteFile { .. }
            | Action::Rollback { .. }
            | Action::Pin { .. }
            | Action::Recall { .. } => Repeat::Safe,
        }
    }

    /// Whether the action may change the sandbox's files (so a snapshot is worth taking after
    /// it, and a resume must not blindly run it twice).
    pub fn may_mutate(&self) -> bool {
        matches!(
            self,
            Action::Bash { .. }
                | Action::WriteFile { .. }
                | Action::StrReplace { .. }
                | Action::Rollback { .. }
        )
    }

    /// One line saying what the action is, for stubs, summaries and the trace.
    pub fn describe(&self) -> String {
        let short = |s: &str, n: usize| {
            let line = s.lines().next().unwrap_or_default();
            if line.chars().count() > n || s.lines().nth(1).is_some() {
                format!("{}…", line.chars().take(n).collect::<String>())
            } else {
                line.to_owned()
            }
        };
        match self {
            Action::Bash {
                command,
                background,
                ..
            } => format!(
                "bash{} `{}`",
                if *background { " (background)" } else { "" },
                short(command, 80)
            ),
            Action::ReadFile {
                path,
                start_line,
                start_char,
                ..
            } => {
                if *start_char > 0 {
                    format!("read_file {path} from line {start_line} char {start_char}")
                } else {
                    format!("read_file {path} from line {start_line}")
                }
            }
            Action::WriteFile { path, content } => {
                format!("write_file {path} ({} bytes)", content.len())
            }
            Action::StrReplace { path, old_str, .. } => {
                format!("str_replace in {path}: `{}`", short(old_str, 40))
            }
            Action::Snapshot { name } => format!("snapshot {}", name.as_deref().unwrap_or("")),
            Action::Rollback { snapshot_id } => format!("rollback to {snapshot_id}"),
            Action::Finish { answer } => format!("finish: {}", short(answer, 60)),
            Action::Pin { key, value } => match value {
                Some(v) => format!("pin {} = {}", short(key, 60), short(v, 60)),
                None => format!("unpin {}", short(key, 60)),
            },
            Action::Subtask { title, .. } => format!("subtask: {}", short(title, 60)),
            Action::Recall { step } => format!("recall step {step}"),
        }
    }

    /// The action as canonical JSON text, the basis of its fingerprint.
    pub fn canonical(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| self.describe())
    }
}

/// A call that cannot be used as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// No such tool, even allowing for misspelling.
    #[error("unknown tool `{name}`; the tools are: {known}")]
    UnknownTool {
        /// The name the model used.
        name: String,
        /// The valid names.
        known: String,
    },
    /// The arguments are not JSON, even after repair.
    #[error("arguments of `{tool}` are not valid JSON ({reason})")]
    BadJson {
        /// The tool.
        tool: String,
        /// The parser's complaint.
        reason: String,
    },
    /// A required argument is missing.
    #[error("`{tool}` needs the argument `{field}`")]
    Missing {
        /// The tool.
        tool: String,
        /// The argument.
        field: String,
    },
    /// An argument has a type that cannot be converted.
    #[error("argument `{field}` of `{tool}` must be {expected}")]
    BadType {
        /// The tool.
        tool: String,
        /// The argument.
        field: String,
        /// What it must be.
        expected: &'static str,
    },
}

/// A call parsed into an action, with the repairs that were needed.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// The action.
    pub action: Action,
    /// What was fixed, e.g. "field `cmd` read as `command`"; empty for a clean call.
    pub repairs: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Str,
    Int,
    Bool,
}

impl Kind {
    fn schema(self) -> &'static str {
        match self {
            Kind::Str => "string",
            Kind::Int => "integer",
            Kind::Bool => "boolean",
        }
    }
}

struct Field {
    name: &'static str,
    kind: Kind,
    required: bool,
    doc: &'static str,
    aliases: &'static [&'static str],
}

struct ToolDef {
    name: &'static str,
    doc: &'static str,
    aliases: &'static [&'static str],
    fields: &'static [Field],
}

const fn f(
    name: &'static str,
    kind: Kind,
    required: bool,
    doc: &'static str,
    aliases: &'static [&'static str],
) -> Field {
    Field {
        name,
        kind,
        required,
        doc,
        aliases,
    }
}

const TOOLS: &[ToolDef] = &[
    ToolDef {
        name: "bash",
        doc: "Run a shell command in the sandbox (working directory /workspace). Output is cut to head and tail when long; the full text is kept in a file you can page with read_file.",
        aliases: &["shell", "sh", "run", "exec", "execute", "run_command", "terminal", "command"],
        fields: &[
            f("command", Kind::Str, true, "The command line.", &["cmd", "script", "commands", "code", "input", "bash"]),
            f("timeout_secs", Kind::Int, false, "Kill the command after this many seconds.", &["timeout", "timeout_seconds"]),
            f("background", Kind::Bool, false, "Start it and return at once with its exec id.", &["detach", "async"]),
        ],
    },
    ToolDef {
        name: "read_file",
        doc: "Read lines of a file in the sandbox, numbered. A page is bounded (long lines are cut, with the start_char to read on); the header says where the next page starts.",
        aliases: &["read", "cat", "open", "view", "open_file", "view_file"],
        fields: &[
            f("path", Kind::Str, true, "Path of the file.", &["file", "filename", "file_path", "filepath", "name"]),
            f("start_line", Kind::Int, false, "First line to show, 1-based (default 1).", &["line", "offset", "start", "from_line"]),
            f("max_lines", Kind::Int, false, "How many lines (default 200).", &["limit", "lines", "count", "num_lines"]),
            f("start_char", Kind::Int, false, "Character offset within start_line to start at, for paging through a very long line (default 0).", &["char_offset", "column", "col"]),
        ],
    },
    ToolDef {
        name: "write_file",
        doc: "Create or overwrite a file in the sandbox with the given content.",
        aliases: &["write", "create_file", "save", "save_file", "create"],
        fields: &[
            f("path", Kind::Str, true, "Path of the file.", &["file", "filename", "file_path", "filepath", "name"]),
            f("content", Kind::Str, true, "The whole new content.", &["contents", "text", "data", "body", "file_text"]),
        ],
    },
    ToolDef {
        name: "str_replace",
        doc: "Replace text in a file: old_str must occur exactly once unless replace_all is true.",
        aliases: &["edit", "replace", "edit_file", "str_replace_editor", "apply_edit"],
        fields: &[
            f("path", Kind::Str, true, "Path of the file.", &["file", "filename", "file_path", "filepath"]),
            f("old_str", Kind::Str, true, "Exact text to replace.", &["old", "old_string", "old_text", "search", "find", "from"]),
            f("new_str", Kind::Str, true, "Replacement text.", &["new", "new_string", "new_text", "replacement", "replace", "to"]),
            f("replace_all", Kind::Bool, false, "Replace every occurrence.", &["all", "global"]),
        ],
    },
    ToolDef {
        name: "snapshot",
        doc: "Snapshot the sandbox's files; returns a snapshot id to roll back to.",
        aliases: &["checkpoint", "save_state"],
        fields: &[f("name", Kind::Str, false, "A name for the snapshot.", &["label", "tag"])],
    },
    ToolDef {
        name: "rollback",
        doc: "Put the sandbox's files back to a snapshot (running commands are stopped).",
        aliases: &["restore", "revert", "undo"],
        fields: &[f("snapshot_id", Kind::Str, true, "The snapshot id.", &["snapshot", "id", "snap", "snapshotid"])],
    },
    ToolDef {
        name: "finish",
        doc: "Declare the task done with the final answer. The task's check runs first; if it fails you are told why.",
        aliases: &["done", "submit", "final_answer", "answer", "complete", "stop", "end"],
        fields: &[f("answer", Kind::Str, true, "The final answer or a summary of what was done.", &["result", "final_answer", "response", "text", "message", "output", "summary"])],
    },
    ToolDef {
        name: "pin",
        doc: "Pin a fact (key variable, current hypothesis, verified result) so it is never summarized away; omit value to unpin.",
        aliases: &["remember", "note", "set_fact"],
        fields: &[
            f("key", Kind::Str, true, "The fact's name.", &["name", "fact"]),
            f("value", Kind::Str, false, "Its value; omit to remove the fact.", &["val", "text", "content"]),
        ],
    },
    ToolDef {
        name: "subtask",
        doc: "Start a subtask. If it has a check command, the check must pass before the next subtask or finish.",
        aliases: &["start_subtask", "plan_step", "task"],
        fields: &[
            f("title", Kind::Str, true, "What the subtask is.", &["name", "subtask", "description", "goal"]),
            f("check", Kind::Str, false, "Shell command that verifies it (exit 0 = done).", &["verify", "test", "check_command"]),
        ],
    },
    ToolDef {
        name: "recall",
        doc: "Fetch back the full result of an earlier step whose output was folded or summarized.",
        aliases: &["fetch", "show_step", "get_step"],
        fields: &[f("step", Kind::Int, true, "The step number.", &["step_number", "n", "number", "id"])],
    },
];

/// The tools offered to the model.
pub fn specs() -> Vec<ToolSpec> {
    TOOLS
        .iter()
        .map(|t| {
            let mut props = Map::new();
            for field in t.fields {
                props.insert(
                    field.name.into(),
                    json!({ "type": field.kind.schema(), "description": field.doc }),
                );
            }
            let required: Vec<&str> = t
                .fields
                .iter()
                .filter(|f| f.required)
                .map(|f| f.name)
                .collect();
            ToolSpec {
                name: t.name,
                description: t.doc,
                parameters: json!({ "type": "object", "properties": props, "required": required }),
            }
        })
        .collect()
}

fn tool_names() -> String {
    TOOLS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
}

/// Parses one call, repairing what is safe to repair.
pub fn parse_call(name: &str, arguments: &str) -> Result<Parsed, CallError> {
    let mut repairs = Vec::new();
    let def = find_tool(name, &mut repairs).ok_or_else(|| CallError::UnknownTool {
        name: name.chars().take(60).collect(),
        known: tool_names(),
    })?;
    let value = parse_arguments(def, arguments, &mut repairs)?;
    let args = fix_fields(def, value, &mut repairs)?;
    let action = build(def, &args)?;
    Ok(Parsed { action, repairs })
}

fn find_tool(name: &str, repairs: &mut Vec<String>) -> Option<&'static ToolDef> {
    let norm = name.trim().to_ascii_lowercase().replace(['-', ' '], "_");
    if let Some(t) = TOOLS.iter().find(|t| t.name == name) {
        return Some(t);
    }
    let found = TOOLS
        .iter()
        .find(|t| t.name == norm)
        .or_else(|| TOOLS.iter().find(|t| t.aliases.contains(&norm.as_str())))
        .or_else(|| {
            TOOLS
                .iter()
                .filter(|t| close_enough(&norm, t.name))
                .min_by_key(|t| levenshtein(&norm, t.name))
        })?;
    repairs.push(format!("tool `{name}` read as `{}`", found.name));
    Some(found)
}

fn parse_arguments(
    def: &ToolDef,
    raw: &str,
    repairs: &mut Vec<String>,
) -> Result<Value, CallError> {
    let trimmed = strip_fence(raw.trim());
    if trimmed.is_empty() {
        if !raw.is_empty() {
            repairs.push("blank arguments read as {}".into());
        }
        return Ok(json!({}));
    }
    let value = match serde_json::from_str::<Value>(trimmed) {
        Ok(v) => v,
        Err(first) => {
            let looks_like_json = trimmed.starts_with('{') || trimmed.starts_with('[');
            if !looks_like_json {
                // Plain text for a tool with one required text field is what the model meant.
                if let Some(field) = sole_required_text(def) {
                    repairs.push(format!("plain-text arguments read as `{}`", field.name));
                    return Ok(json!({ field.name: raw.trim() }));
                }
                return Err(CallError::BadJson {
                    tool: def.name.into(),
                    reason: first.to_string(),
                });
            }
            let fixed = repair_json(trimmed);
            match serde_json::from_str::<Value>(&fixed) {
                Ok(v) => {
                    repairs.push("malformed JSON repaired".into());
                    v
                }
                Err(_) => {
                    return Err(CallError::BadJson {
                        tool: def.name.into(),
                        reason: first.to_string(),
                    })
                }
            }
        }
    };
    match value {
        Value::Object(_) => Ok(value),
        // JSON encoded twice: `"{\"command\": \"ls\"}"`.
        Value::String(s) if s.trim_start().starts_with('{') => {
            repairs.push("doubly encoded JSON unwrapped".into());
            parse_arguments(def, &s, repairs)
        }
        Value::String(s) => match sole_required_text(def) {
            Some(field) => {
                repairs.push(format!("bare string read as `{}`", field.name));
                Ok(json!({ field.name: s }))
            }
            None => Err(CallError::BadJson {
                tool: def.name.into(),
                reason: "expected a JSON object".into(),
            }),
        },
        _ => Err(CallError::BadJson {
            tool: def.name.into(),
            reason: "expected a JSON object".into(),
        }),
    }
}

fn sole_required_text(def: &ToolDef) -> Option<&'static Field> {
    let mut required = def.fields.iter().filter(|f| f.required);
    let only = required.next()?;
    (required.next().is_none() && only.kind == Kind::Str).then_some(only)
}

fn strip_fence(s: &str) -> &str {
    let Some(rest) = s.strip_prefix("```") else {
        return s;
    };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.trim().strip_suffix("```").unwrap_or(rest).trim()
}

/// Rewrites almost-JSON into JSON: single-quoted strings, raw newlines inside strings, Python
/// literals, trailing commas, and a string or brackets left open by output that was cut short.
pub fn repair_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    let mut closers: Vec<char> = Vec::new();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut word = String::new();
    let flush_word = |word: &mut String, out: &mut String| {
        let mapped = match word.as_str() {
            "True" => "true",
            "False" => "false",
            "None" => "null",
            w => w,
        };
        out.push_str(mapped);
        word.clear();
    };
    for c in s.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
                if q == '\'' && c == '\'' {
                    out.push('\'');
                } else {
                    out.push('\\');
                    out.push(c);
                }
                continue;
            }
            match c {
                '\\' => escaped = true,
                c if c == q => {
                    out.push('"');
                    quote = None;
                }
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if (c as u32) < 0x20 => {}
                c => out.push(c),
            }
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' || c == '+' {
            word.push(c);
            continue;
        }
        flush_word(&mut word, &mut out);
        match c {
            '"' | '\'' => {
                quote = Some(c);
                out.push('"');
            }
            '{' => {
                closers.push('}');
                out.push(c);
            }
            '[' => {
                closers.push(']');
                out.push(c);
            }
            '}' | ']' => {
                drop_trailing_comma(&mut out);
                if closers.last() == Some(&c) {
                    closers.pop();
                }
                out.push(c);
            }
            c => out.push(c),
        }
    }
    flush_word(&mut word, &mut out);
    if quote.is_some() {
        out.push('"');
    }
    drop_trailing_comma(&mut out);
    if out.trim_end().ends_with(':') {
        out.push_str("null");
    }
    while let Some(c) = closers.pop() {
        out.push(c);
    }
    out
}

fn drop_trailing_comma(out: &mut String) {
    let trimmed = out.trim_end().len();
    if out[..trimmed].ends_with(',') {
        out.truncate(trimmed - 1);
    }
}

fn fix_fields(
    def: &ToolDef,
    value: Value,
    repairs: &mut Vec<String>,
) -> Result<Map<String, Value>, CallError> {
    let Value::Object(given) = value else {
        return Err(CallError::BadJson {
            tool: def.name.into(),
            reason: "expected a JSON object".into(),
        });
    };
    let mut out = Map::new();
    let mut unknown = Vec::new();
    // Exact names first, so an alias never shadows a field given by its own name.
    for (k, v) in &given {
        if def.fields.iter().any(|f| f.name == k) {
            out.insert(k.clone(), v.clone());
        } else {
            unknown.push((k.clone(), v.clone()));
        }
    }
    for (k, v) in unknown {
        let norm = k.to_ascii_lowercase().replace('-', "_");
        let target = def
            .fields
            .iter()
            .filter(|f| !out.contains_key(f.name))
            .find(|f| f.name == norm || f.aliases.contains(&norm.as_str()))
            .or_else(|| {
                def.fields
                    .iter()
                    .filter(|f| !out.contains_key(f.name) && close_enough(&norm, f.name))
                    .min_by_key(|f| levenshtein(&norm, f.name))
            });
        match target {
            Some(field) => {
                repairs.push(format!("field `{k}` read as `{}`", field.name));
                out.insert(field.name.into(), v);
            }
            None => repairs.push(format!("unknown field `{k}` ignored")),
        }
    }
    for field in def.fields {
        match out.get(field.name).cloned() {
            None | Some(Value::Null) => {
                out.remove(field.name);
                if field.required {
                    return Err(CallError::Missing {
                        tool: def.name.into(),
                        field: field.name.into(),
                    });
                }
            }
            Some(v) => {
                let coerced = coerce(def, field, v, repairs)?;
                out.insert(field.name.into(), coerced);
            }
        }
    }
    Ok(out)
}

fn coerce(
    def: &ToolDef,
    field: &Field,
    v: Value,
    repairs: &mut Vec<String>,
) -> Result<Value, CallError> {
    let bad = || CallError::BadType {
        tool: def.name.into(),
        field: field.name.into(),
        expected: match field.kind {
            Kind::Str => "a string",
            Kind::Int => "a non-negative integer",
            Kind::Bool => "true or false",
        },
    };
    let mut note = |what: &str| repairs.push(format!("field `{}` {what}", field.name));
    match (field.kind, v) {
        (Kind::Str, Value::String(s)) => Ok(Value::String(s)),
        (Kind::Str, Value::Number(n)) => {
            note("converted from a number");
            Ok(Value::String(n.to_string()))
        }
        (Kind::Str, Value::Bool(b)) => {
            note("converted from a boolean");
            Ok(Value::String(b.to_string()))
        }
        // `"command": ["ls", "-la"]` — an argv; joined into a command line.
        (Kind::Str, Value::Array(items)) if items.iter().all(Value::is_string) => {
            note("joined from a list");
            let parts: Vec<String> = items
                .iter()
                .filter_map(Value::as_str)
                .map(|s| {
                    if field.name == "command" {
                        shell_quote(s)
                    } else {
                        s.to_owned()
                    }
                })
                .collect();
            Ok(Value::String(parts.join(if field.name == "command" {
                " "
            } else {
                "\n"
            })))
        }
        (Kind::Int, Value::Number(n)) => match n.as_u64() {
            Some(_) => Ok(Value::Number(n)),
            None => match n.as_f64() {
                Some(x) if x >= 0.0 && x.fract() == 0.0 && x < 1e15 => {
                    note("converted to an integer");
                    Ok(json!(x as u64))
                }
                _ => Err(bad()),
            },
        },
        (Kind::Int, Value::String(s)) => match s.trim().parse::<u64>() {
            Ok(n) => {
                note("converted from a string");
                Ok(json!(n))
            }
            Err(_) => Err(bad()),
        },
        (Kind::Bool, Value::Bool(b)) => Ok(Value::Bool(b)),
        (Kind::Bool, Value::String(s)) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "1" => {
                note("converted from a string");
                Ok(Value::Bool(true))
            }
            "false" | "no" | "0" | "" => {
                note("converted from a string");
                Ok(Value::Bool(false))
            }
            _ => Err(bad()),
        },
        (Kind::Bool, Value::Number(n)) if n.as_u64().is_some_and(|n| n <= 1) => {
            note("converted from a number");
            Ok(Value::Bool(n.as_u64() == Some(1)))
        }
        _ => Err(bad()),
    }
}

/// Quotes one word for a POSIX shell, unless it needs none.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn build(def: &ToolDef, args: &Map<String, Value>) -> Result<Action, CallError> {
    let s = |k: &str| args.get(k).and_then(Value::as_str).map(str::to_owned);
    let n = |k: &str| args.get(k).and_then(Value::as_u64);
    let b = |k: &str| args.get(k).and_then(Value::as_bool).unwrap_or(false);
    let req = |k: &str| {
        s(k).ok_or_else(|| CallError::Missing {
            tool: def.name.into(),
            field: k.into(),
        })
    };
    Ok(match def.name {
        "bash" => Action::Bash {
            command: req("command")?,
            timeout_secs: n("timeout_secs"),
            background: b("background"),
        },
        "read_file" => Action::ReadFile {
            path: req("path")?,
            start_line: n("start_line").unwrap_or(1).max(1),
            max_lines: n("max_lines").unwrap_or(DEFAULT_READ_LINES).clamp(1, 2000),
            start_char: n("start_char").unwrap_or(0),
        },
        "write_file" => Action::WriteFile {
            path: req("path")?,
            content: req("content")?,
        },
        "str_replace" => Action::StrReplace {
            path: req("path")?,
            old_str: req("old_str")?,
            new_str: req("new_str")?,
            replace_all: b("replace_all"),
        },
        "snapshot" => Action::Snapshot { name: s("name") },
        "rollback" => Action::Rollback {
            snapshot_id: req("snapshot_id")?,
        },
        "finish" => Action::Finish {
            answer: req("answer")?,
        },
        "pin" => Action::Pin {
            key: req("key")?,
            value: s("value"),
        },
        "subtask" => Action::Subtask {
            title: req("title")?,
            check: s("check").filter(|c| !c.trim().is_empty()),
        },
        "recall" => Action::Recall {
            step: n("step").ok_or_else(|| CallError::Missing {
                tool: def.name.into(),
                field: "step".into(),
            })?,
        },
        other => {
            return Err(CallError::UnknownTool {
                name: other.into(),
                known: tool_names(),
            })
        }
    })
}

/// A misspelling, not a different word: within 2 edits and less than a third of the length.
fn close_enough(a: &str, b: &str) -> bool {
    let d = levenshtein(a, b);
    d > 0 && d <= 2 && d * 3 <= b.len()
}

/// Edit distance between two short strings.
pub fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(name: &str, args: &str) -> Parsed {
        match parse_call(name, args) {
            Ok(p) => p,
            Err(e) => panic!("{name}({args}) refused: {e}"),
        }
    }

    #[test]
    fn clean_calls_need_no_repair() {
        let p = ok("bash", r#"{"command":"ls -la"}"#);
        assert_eq!(
            p.action,
            Action::Bash {
                command: "ls -la".into(),
                timeout_secs: None,
                background: false
            }
        );
        assert!(p.repairs.is_empty(), "{:?}", p.repairs);
    }

    #[test]
    fn broken_json_is_repaired() {
        for raw in [
            r#"{"command": "ls",}"#,
            r#"{'command': 'ls'}"#,
            r#"{"command": "ls""#,
            r#"{"command": "ls"#,
            "```json\n{\"command\": \"ls\"}\n```",
            r#""{\"command\": \"ls\"}""#,
        ] {
            let p = ok("bash", raw);
            assert_eq!(p.action.tool(), "bash", "{raw}");
            let Action::Bash { command, .. } = p.action else {
                panic!()
            };
            assert_eq!(command, "ls", "{raw}");
        }
        let p = ok(
            "str_replace",
            "{\"path\": \"a.py\", \"old_str\": \"x = 1\n\", \"new_str\": \"x = 2\", \"replace_all\": True}",
        );
        assert!(
            matches!(p.action, Action::StrReplace { replace_all: true, ref old_str, .. } if old_str == "x = 1\n")
        );
    }

    #[test]
    fn misspelled_and_synonymous_fields_are_mapped() {
        let p = ok("bash", r#"{"cmd": "make test", "timeout": "30"}"#);
        assert_eq!(
            p.action,
            Action::Bash {
                command: "make test".into(),
                timeout_secs: Some(30),
                background: false
            }
        );
        assert_eq!(p.repairs.len(), 3, "{:?}", p.repairs);
        let p = ok("write_file", r#"{"file_path": "a", "contnet": "x"}"#);
        assert_eq!(
            p.action,
            Action::WriteFile {
                path: "a".into(),
                content: "x".into()
            }
        );
        let p = ok("Bash", r#"{"command": ["grep", "-r", "a b", "."]}"#);
        assert!(
            matches!(p.action, Action::Bash { ref command, .. } if command == "grep -r 'a b' .")
        );
        assert_eq!(ok("shell", r#"{"command":"x"}"#).action.tool(), "bash");
        assert_eq!(ok("finsh", r#"{"answer":"x"}"#).action.tool(), "finish");
    }

    #[test]
    fn optional_fields_default() {
        let p = ok("read_file", r#"{"path": "/workspace/a"}"#);
        assert_eq!(
            p.action,
            Action::ReadFile {
                path: "/workspace/a".into(),
                start_line: 1,
                max_lines: DEFAULT_READ_LINES,
                start_char: 0,
            }
        );
        assert_eq!(ok("snapshot", "").action, Action::Snapshot { name: None });
    }

    #[test]
    fn plain_text_for_single_field_tools() {
        let p = ok("finish", "The answer is 42");
        assert_eq!(
            p.action,
            Action::Finish {
                answer: "The answer is 42".into()
            }
        );
    }

    #[test]
    fn unsafe_guesses_are_refused() {
        assert!(matches!(
            parse_call("bash", r#"{"timeout": 3}"#),
            Err(CallError::Missing { ref field, .. }) if field == "command"
        ));
        assert!(matches!(
            parse_call("launch_missiles", "{}"),
            Err(CallError::UnknownTool { .. })
        ));
        assert!(matches!(
            parse_call("write_file", "path=a content=b"),
            Err(CallError::BadJson { .. })
        ));
        assert!(matches!(
            parse_call("recall", r#"{"step": "three"}"#),
            Err(CallError::BadType { .. })
        ));
    }

    #[test]
    fn specs_list_every_tool_with_required_fields() {
        let specs = specs();
        let names: Vec<&str> = specs.iter().map(|s| s.name).collect();
        for want in [
            "bash",
            "read_file",
            "write_file",
            "str_replace",
            "snapshot",
            "rollback",
            "finish",
        ] {
            assert!(names.contains(&want), "{want} missing");
        }
        let bash = &specs[0];
        assert_eq!(bash.parameters["required"], json!(["command"]));
    }

    #[test]
    fn quoting_and_distance() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("plain-word"), "plain-word");
        assert_eq!(levenshtein("comand", "command"), 1);
        assert!(!close_enough("path", "name"));
    }
}
