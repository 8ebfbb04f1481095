//! Writing to the terminal: raw bytes, JSON, aligned tables and short human-readable values.

use std::io::{self, Write};

use agent_client::proto::{ExecStatus, Isolation, SandboxState};
use anyhow::{Context, Result};
use prost_types::Timestamp;
use serde_json::Value;

/// Writes bytes to stdout and flushes, so streamed output shows up as it arrives.
///
/// A closed pipe (`sbx ls | head -1`) is not an error: whoever reads has seen enough.
pub fn stdout(bytes: &[u8]) -> Result<()> {
    write_all(&mut io::stdout().lock(), bytes).context("cannot write to stdout")
}

/// Writes bytes to stderr and flushes.
pub fn stderr(bytes: &[u8]) -> Result<()> {
    write_all(&mut io::stderr().lock(), bytes).context("cannot write to stderr")
}

fn write_all(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    match w.write_all(bytes).and_then(|()| w.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Prints one line to stdout.
pub fn line(text: &str) -> Result<()> {
    stdout(format!("{text}\n").as_bytes())
}

/// Prints a note from `sbx` itself (not from the command) to stderr.
pub fn note(text: &str) -> Result<()> {
    stderr(format!("sbx: {text}\n").as_bytes())
}

/// Prints one JSON value, pretty, on stdout.
pub fn json(value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).context("cannot encode JSON")?;
    line(&text)
}

/// Renders rows under a header, columns padded to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            // The last column is not padded, so lines carry no trailing blanks.
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}   "));
            }
        }
        out.push('\n');
    }
    out
}

/// Renders `NAME   value` lines, names padded to the longest.
pub fn fields(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(name, value)| format!("{name:<width$}   {value}\n"))
        .collect()
}

/// A cell that shows `-` rather than nothing.
pub fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

/// A byte count in binary units: `512MiB`, `1.5GiB`, `100B`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let scale = 1u64 << (10 * unit);
    if bytes & (scale - 1) == 0 {
        format!("{}{}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.1}{}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

/// A timestamp to the second, RFC 3339; `-` when unset.
pub fn time(t: Option<&Timestamp>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| {
            Timestamp {
                seconds: t.seconds,
                nanos: 0,
            }
            .to_string()
        },
    )
}

/// `process`, `container`, `microvm`.
pub fn isolation(v: i32) -> String {
    Isolation::try_from(v).map_or_else(|_| v.to_string(), |e| short(e.as_str_name(), "ISOLATION_"))
}

/// `running`, `failed`, …
pub fn state(v: i32) -> String {
    SandboxState::try_from(v).map_or_else(
        |_| v.to_string(),
        |e| short(e.as_str_name(), "SANDBOX_STATE_"),
    )
}

/// `exited`, `timed_out`, …
pub fn exec_status(v: i32) -> String {
    ExecStatus::try_from(v).map_or_else(
        |_| v.to_string(),
        |e| short(e.as_str_name(), "EXEC_STATUS_"),
    )
}

fn short(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix)
        .unwrap_or(name)
        .to_ascii_lowercase()
}

/// `k=v,k2=v2`, sorted by key; `-` when empty.
pub fn labels(map: &std::collections::HashMap<String, String>) -> String {
    let mut pairs: Vec<String> = map.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.sort();
    or_dash(&pairs.join(","))
}

/// Shortens text to `max` characters, marking the cut with `…`.
pub fn ellipsize(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size(100), "100B");
        assert_eq!(size(512 << 20), "512MiB");
        assert_eq!(size(3 << 29), "1.5GiB");
        assert_eq!(size(0), "0B");
    }

    #[test]
    fn tables_align() {
        let rows = vec![
            vec!["sb-1".to_owned(), "running".to_owned()],
            vec!["sb-22".to_owned(), "-".to_owned()],
        ];
        assert_eq!(
            table(&["ID", "STATE"], &rows),
            "ID      STATE\nsb-1    running\nsb-22   -\n"
        );
    }

    #[test]
    fn fields_align() {
        assert_eq!(
            fields(&[("ID", "sb-1".into()), ("STATE", "running".into())]),
            "ID      sb-1\nSTATE   running\n"
        );
    }

    #[test]
    fn short_names() {
        assert_eq!(exec_status(ExecStatus::TimedOut as i32), "timed_out");
        assert_eq!(isolation(Isolation::Microvm as i32), "microvm");
        assert_eq!(state(99), "99");
    }

    #[test]
    fn ellipsis() {
        assert_eq!(ellipsize("abcdef", 4), "abc…");
        assert_eq!(ellipsize("abc", 4), "abc");
    }
}
