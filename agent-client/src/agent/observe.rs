//! Observation normalization: what the model reads after an action.
//!
//! Long output is cut to head + tail with a note saying where the whole of it is, so the model
//! can page through it with `read_file` instead of drowning the context; empty output is said in
//! words (an empty tool message reads like a failure to many models); how a command ended —
//! timed out, out of memory, killed, not startable, lost — is said plainly, first.

use serde::{Deserialize, Serialize};

use crate::proto::{ExecResult, ExecStatus};

/// The text the model gets for a command that succeeded silently.
pub const NO_OUTPUT: &str = "command succeeded with no output";

/// How much output an observation keeps. The same caps apply to every tool's result (a
/// command's streams, a file read, a recalled step): head + tail of long text, each line at
/// most `line_chars`, the whole at most `max_chars` — with a note saying how to page the rest.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct ObserveLimits {
    /// Characters kept from the start of a long stream.
    pub head_chars: usize,
    /// Characters kept from the end of a long stream.
    pub tail_chars: usize,
    /// Longest line shown whole; longer ones are cut with a note (one minified 400 KB line
    /// must not fill the prompt).
    #[serde(default = "default_line_chars")]
    pub line_chars: usize,
    /// Largest observation of any tool, characters.
    #[serde(default = "default_max_chars")]
    pub max_chars: usize,
}

fn default_line_chars() -> usize {
    ObserveLimits::default().line_chars
}

fn default_max_chars() -> usize {
    ObserveLimits::default().max_chars
}

impl Default for ObserveLimits {
    fn default() -> Self {
        ObserveLimits {
            head_chars: 2_000,
            tail_chars: 2_000,
            line_chars: 500,
            max_chars: 10_000,
        }
    }
}

impl ObserveLimits {
    /// Limits with the given head and tail and the default line and total caps.
    pub fn head_tail(head_chars: usize, tail_chars: usize) -> Self {
        ObserveLimits {
            head_chars,
            tail_chars,
            ..Default::default()
        }
    }
}

/// The normalized result of one action.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// What the model reads.
    pub text: String,
    /// Whether the action succeeded (exit 0, or a tool that did its job).
    pub ok: bool,
    /// The exec behind it, if any.
    pub exec_id: Option<String>,
    /// Exit code of a command.
    pub exit_code: Option<i32>,
    /// Whether the output was cut.
    pub truncated: bool,
    /// The exec ended LOST: the sandbox or daemon died under it, its effect is unknown.
    #[serde(default)]
    pub lost: bool,
    /// Streams that were cut and must be written to the sandbox so the model can page them:
    /// (stream name, full text). Emptied once written.
    #[serde(skip)]
    pub to_spill: Vec<(String, String)>,
}

impl Observation {
    /// A successful tool result with the given text.
    pub fn ok(text: impl Into<String>) -> Self {
        Observation {
            text: text.into(),
            ok: true,
            ..Default::default()
        }
    }

    /// A failed tool result, e.g. a file that does not exist.
    pub fn error(text: impl Into<String>) -> Self {
        Observation {
            text: text.into(),
            ok: false,
            ..Default::default()
        }
    }

    /// The first line of the text, for stubs and "failed because" notes.
    pub fn headline(&self) -> String {
        let line = self
            .text
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim();
        cut_chars(line, 120)
    }
}

/// Describes how an exec ended, in words, when it did not simply exit 0.
pub fn status_line(r: &ExecResult) -> Option<String> {
    match ExecStatus::try_from(r.status) {
        Ok(ExecStatus::Exited) if r.exit_code == 0 => None,
        Ok(ExecStatus::Exited) => Some(format!("exit code {}", r.exit_code)),
        Ok(ExecStatus::TimedOut) => Some(format!(
            "TIMED OUT: the command ran for {} ms, hit its time limit and was killed (exit {})",
            r.duration_ms, r.exit_code
        )),
        Ok(ExecStatus::OomKilled) => Some(format!(
            "OUT OF MEMORY: the command was killed by the kernel's OOM killer (peak {} MiB)",
            r.peak_memory_bytes >> 20
        )),
        Ok(ExecStatus::Signaled) => Some(format!(
            "KILLED by signal {} (exit {})",
            r.signal, r.exit_code
        )),
        Ok(ExecStatus::SpawnFailed) => Some(format!(
            "COULD NOT START: {} (exit {})",
            if r.error.is_empty() {
                "not found or not executable"
            } else {
                &r.error
            },
            r.exit_code
        )),
        Ok(ExecStatus::Lost) => Some(format!(
            "LOST: {}",
            if r.error.is_empty() {
                "the sandbox or daemon died under the command; its effects are unknown"
            } else {
                &r.error
            }
        )),
        Ok(ExecStatus::Running) => Some(format!(
            "started in the background as exec {}; poll it with a command, it is still running",
            r.exec_id
        )),
        Ok(ExecStatus::Unspecified) | Err(_) => {
            Some(format!("ended with unknown status {}", r.status))
        }
    }
}

/// Normalizes an exec's result.
pub fn exec(r: &ExecResult, limits: ObserveLimits) -> Observation {
    let running = r.status == ExecStatus::Running as i32;
    let ok = (r.status == ExecStatus::Exited as i32 && r.exit_code == 0) || running;
    let mut parts = Vec::new();
    if let Some(status) = status_line(r) {
        parts.push(status);
    }
    let mut truncated = false;
    let mut to_spill = Vec::new();
    for (name, bytes, daemon_cut, total, spill) in [
        (
            "stdout",
            &r.stdout,
            r.stdout_truncated,
            r.stdout_total_bytes,
            &r.stdout_spill_path,
        ),
        (
            "stderr",
            &r.stderr,
            r.stderr_truncated,
            r.stderr_total_bytes,
            &r.stderr_spill_path,
        ),
    ] {
        if bytes.is_empty() && !daemon_cut {
            continue;
        }
        let text = clean(&String::from_utf8_lossy(bytes));
        let (shown, cut) = head_tail(&text, limits);
        let label = if name == "stderr" { "[stderr]\n" } else { "" };
        let mut block = format!("{label}{shown}");
        if cut || daemon_cut {
            truncated = true;
            let total = total.max(bytes.len() as u64);
            let where_ = if daemon_cut && !spill.is_empty() {
                format!("the whole {name} is in the sandbox at {spill}")
            } else {
                // The daemon kept all of it, but only this process has it: the loop writes it
                // to the sandbox and fills in the path.
                to_spill.push((name.to_owned(), text.clone()));
                format!("the whole {name} is in the sandbox at {{spill:{name}}}")
            };
            block.push_str(&format!(
                "\n[{name}: {total} bytes, {} lines shown of {}; {where_} — page it with read_file(path, start_line)]",
                shown.lines().count(),
                text.lines().count()
            ));
        }
        parts.push(block);
    }
    if r.output_discarded {
        // The record kept its status but the daemon dropped its output (past the sandbox's
        // output storage): "no output" would be a false statement about the command.
        parts.push(format!(
            "[output not kept: the daemon discarded this command's recorded output (it wrote {} bytes to stdout and {} to stderr) to stay within the sandbox's output storage; run the command again to see it]",
            r.stdout_total_bytes, r.stderr_total_bytes
        ));
    } else if parts.is_empty() {
        parts.push(NO_OUTPUT.to_owned());
    }
    Observation {
        text: parts.join("\n"),
        ok,
        exec_id: (!r.exec_id.is_empty()).then(|| r.exec_id.clone()),
        exit_code: Some(r.exit_code),
        truncated,
        lost: r.status == ExecStatus::Lost as i32,
        to_spill,
    }
}

/// Replaces `{spill:stream}` placeholders with the path the stream was written to.
pub fn fill_spill_path(obs: &mut Observation, stream: &str, path: &str) {
    obs.text = obs.text.replace(&format!("{{spill:{stream}}}"), path);
}

/// Room for the note a cut line carries.
const LINE_NOTE_SLACK: usize = 200;

/// Cuts every line longer than `line_chars` to its start, with a note giving its length.
/// Returns the text and how many lines were cut.
pub fn cut_long_lines(text: &str, line_chars: usize) -> (String, usize) {
    let line_chars = line_chars.max(20);
    // Lines a little over the cap stay whole: a cut line with its note must not be cut again
    // when a capped text is capped once more.
    let cut_above = line_chars + LINE_NOTE_SLACK;
    if !text.lines().any(|l| l.len() > cut_above) {
        return (text.to_owned(), 0);
    }
    let mut cut = 0;
    let mut out = String::with_capacity(text.len().min(1 << 20));
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let n = line.chars().count();
        if n > cut_above {
            cut += 1;
            out.extend(line.chars().take(line_chars));
            out.push_str(&format!(
                " … [line cut: {n} characters, {line_chars} shown]"
            ));
        } else {
            out.push_str(line);
        }
    }
    (out, cut)
}

/// Caps any observation text the same way: long lines cut, then head + tail within
/// `max_chars`. Returns the text and whether anything was cut.
pub fn cap(text: &str, limits: ObserveLimits) -> (String, bool) {
    let half = limits.max_chars.max(400) / 2;
    let (shown, cut) = head_tail(
        text,
        ObserveLimits {
            head_chars: half.min(limits.max_chars),
            tail_chars: half.saturating_sub(200),
            ..limits
        },
    );
    (shown, cut)
}

/// Cuts text to head + tail on line boundaries where possible, after cutting lines longer than
/// `line_chars`. Returns the text to show and whether anything was cut.
pub fn head_tail(text: &str, limits: ObserveLimits) -> (String, bool) {
    let (lines_cut, n_cut) = cut_long_lines(text, limits.line_chars);
    let text = lines_cut.as_str();
    let total = text.chars().count();
    if total <= limits.head_chars + limits.tail_chars + 200 {
        return (text.to_owned(), n_cut > 0);
    }
    let head_end = char_boundary(text, limits.head_chars);
    let head_end = text[..head_end].rfind('\n').map_or(head_end, |i| i + 1);
    let tail_start = char_boundary(text, total - limits.tail_chars);
    let tail_start = text[tail_start..]
        .find('\n')
        .map_or(tail_start, |i| tail_start + i + 1);
    let omitted = &text[head_end..tail_start];
    let shown = format!(
        "{}[... {} lines, {} characters omitted ...]\n{}",
        &text[..head_end],
        omitted.lines().count(),
        omitted.chars().count(),
        &text[tail_start..]
    );
    (shown, true)
}

/// A page of a file for `read_file`: numbered lines from `start_line`, each at most
/// `line_chars` (a long line says how to read on with `start_char`), the whole within
/// `max_chars`, and a header saying where the next page starts.
pub fn file_view(
    path: &str,
    text: &str,
    start_line: u64,
    max_lines: u64,
    start_char: u64,
    limits: ObserveLimits,
) -> String {
    let total = text.lines().count() as u64;
    let start = start_line.max(1);
    // Room under the total cap for the header and a note after the page.
    let budget = limits.max_chars.max(800) - 400;
    let mut out = String::new();
    let mut used = 0usize;
    let mut last = start - 1;
    for (i, line) in text
        .lines()
        .enumerate()
        .skip((start - 1) as usize)
        .take(max_lines as usize)
    {
        let n = i as u64 + 1;
        let from = if n == start { start_char as usize } else { 0 };
        let len = line.chars().count();
        // A line read from a character offset is being paged on purpose: it gets the page;
        // any other long line is cut like command output.
        let room = if from > 0 {
            budget.saturating_sub(300)
        } else {
            limits.line_chars.max(20)
        };
        let piece: Vec<char> = line.chars().skip(from).take(room).collect();
        let shown_to = from + piece.len();
        // A paged piece is wrapped at `line_chars` (continuation lines marked `+`), so that
        // no later cap cuts it again.
        let mut entry = String::new();
        for (k, chunk) in piece.chunks(limits.line_chars.max(20)).enumerate() {
            let chunk: String = chunk.iter().collect();
            if k == 0 {
                entry.push_str(&format!("{n:>6}\t{chunk}"));
            } else {
                entry.push_str(&format!("\n     +\t{chunk}"));
            }
        }
        if piece.is_empty() {
            entry.push_str(&format!("{n:>6}\t"));
        }
        if shown_to < len {
            entry.push_str(&format!(
                " … [line {n}: {len} characters, {from}-{shown_to} shown; read_file(path, start_line={n}, start_char={shown_to}) continues it]"
            ));
        }
        entry.push('\n');
        let cost = entry.chars().count();
        if used > 0 && used + cost > budget {
            break;
        }
        used += cost;
        out.push_str(&entry);
        last = n;
    }
    if out.is_empty() {
        return format!("{path}: {total} lines, nothing at line {start}");
    }
    let more = if last < total {
        format!("; more from start_line={}", last + 1)
    } else {
        String::new()
    };
    format!("{path} lines {start}-{last} of {total}{more}\n{out}")
}

/// Byte index of the `n`th character.
fn char_boundary(text: &str, n: usize) -> usize {
    text.char_indices().nth(n).map_or(text.len(), |(i, _)| i)
}

/// Cuts a string to `n` characters, marking the cut.
pub fn cut_chars(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// Drops ANSI escape sequences and collapses carriage-return progress lines to their last
/// state: colors and spinners cost tokens and mean nothing to the model.
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // CSI: parameters and intermediates up to a final byte in @..~.
                for n in chars.by_ref() {
                    if ('@'..='~').contains(&n) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    if !out.contains('\r') {
        return out;
    }
    out.split('\n')
        .map(|line| {
            let line = line.strip_suffix('\r').unwrap_or(line);
            line.rsplit('\r').next().unwrap_or(line)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: ExecStatus, code: i32, stdout: &str, stderr: &str) -> ExecResult {
        ExecResult {
            exec_id: "ex-1".into(),
            status: status as i32,
            exit_code: code,
            stdout: stdout.as_bytes().to_vec(),
            stderr: stderr.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn silence_is_said_in_words() {
        let o = exec(
            &result(ExecStatus::Exited, 0, "", ""),
            ObserveLimits::default(),
        );
        assert_eq!(o.text, NO_OUTPUT);
        assert!(o.ok);
        assert_eq!(o.exec_id.as_deref(), Some("ex-1"));
    }

    #[test]
    fn failures_are_said_plainly() {
        let mut r = result(ExecStatus::TimedOut, 137, "", "");
        r.duration_ms = 5000;
        let o = exec(&r, ObserveLimits::default());
        assert!(o.text.starts_with("TIMED OUT"), "{}", o.text);
        assert!(!o.ok);
        let o = exec(
            &result(ExecStatus::OomKilled, 137, "", ""),
            ObserveLimits::default(),
        );
        assert!(o.text.starts_with("OUT OF MEMORY"), "{}", o.text);
        let o = exec(
            &result(ExecStatus::Exited, 2, "", "boom\n"),
            ObserveLimits::default(),
        );
        assert_eq!(o.text, "exit code 2\n[stderr]\nboom\n");
        assert_eq!(o.headline(), "exit code 2");
    }

    #[test]
    fn long_output_keeps_head_and_tail_and_says_where_the_rest_is() {
        let text: String = (0..5000).map(|i| format!("line {i}\n")).collect();
        let limits = ObserveLimits::head_tail(100, 100);
        let o = exec(&result(ExecStatus::Exited, 0, &text, ""), limits);
        assert!(o.truncated);
        assert!(o.text.starts_with("line 0\n"));
        assert!(o.text.contains("line 4999\n"));
        assert!(o.text.contains("lines, "), "{}", o.text);
        assert_eq!(o.to_spill.len(), 1, "cut here, so the loop must spill it");
        assert!(o.text.len() < 600, "{}", o.text.len());

        let mut r = result(ExecStatus::Exited, 0, "head\n", "");
        r.stdout_truncated = true;
        r.stdout_total_bytes = 9_000_000;
        r.stdout_spill_path = "/tmp/.sandboxd/ex-1.stdout".into();
        let o = exec(&r, limits);
        assert!(o.text.contains("/tmp/.sandboxd/ex-1.stdout"), "{}", o.text);
        assert!(o.to_spill.is_empty(), "the daemon already spilled it");
    }

    #[test]
    fn one_huge_line_is_cut_in_every_view() {
        let line = "x".repeat(400_000);
        let limits = ObserveLimits::default();
        // Command output: the line is cut, the stream is spilled whole.
        let o = exec(&result(ExecStatus::Exited, 0, &line, ""), limits);
        assert!(o.text.len() < 3_000, "{}", o.text.len());
        assert!(o.truncated);
        assert_eq!(o.to_spill.len(), 1);
        // A file page: cut with the way to read on.
        let v = file_view("/w/min.js", &line, 1, 200, 0, limits);
        assert!(v.len() < 1_500, "{}", v.len());
        assert!(v.contains("start_line=1, start_char=500"), "{v}");
        let page = file_view("/w/min.js", &line, 1, 200, 500, limits);
        assert!(page.len() <= limits.max_chars + 400, "{}", page.len());
        assert!(page.contains("start_char=9800"), "{page}");
        // Any text.
        let (t, cut) = cap(&format!("{line}\n").repeat(3), limits);
        assert!(cut && t.len() < 3_000, "{}", t.len());
    }

    #[test]
    fn file_pages_stay_within_the_total_cap() {
        let text: String = (1..=5_000)
            .map(|i| format!("{}\n", "y".repeat(80 + i % 7)))
            .collect();
        let limits = ObserveLimits::default();
        let v = file_view("/w/f", &text, 1, 2_000, 0, limits);
        assert!(v.chars().count() <= limits.max_chars + 200, "{}", v.len());
        let header = v.lines().next().unwrap_or_default();
        assert!(
            header.contains("of 5000; more from start_line="),
            "{header}"
        );
        let small = file_view("/w/f", "a\nb\n", 1, 200, 0, limits);
        assert_eq!(small, "/w/f lines 1-2 of 2\n     1\ta\n     2\tb\n");
    }

    #[test]
    fn spill_placeholder_is_filled() {
        let mut o = Observation::ok("see {spill:stdout}");
        fill_spill_path(&mut o, "stdout", "/tmp/x");
        assert_eq!(o.text, "see /tmp/x");
    }

    #[test]
    fn ansi_and_progress_lines_are_cleaned() {
        assert_eq!(clean("\u{1b}[31mred\u{1b}[0m ok"), "red ok");
        assert_eq!(clean("10%\r50%\r100%\ndone"), "100%\ndone");
    }
}
