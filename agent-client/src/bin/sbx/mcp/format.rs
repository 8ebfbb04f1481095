//! Results as a model reads them: the outcome on the first line, then bounded content, and
//! every cut said with where the rest is.

use agent_client::proto::{ExecResult, ExecStatus, Sandbox};

use crate::output;

/// The first line of a command's result: exit code and status, and why it ended if not by
/// itself.
pub fn exec_headline(r: &ExecResult) -> String {
    let status = ExecStatus::try_from(r.status).unwrap_or(ExecStatus::Unspecified);
    let why = match status {
        ExecStatus::Exited if r.exit_code == 0 => "succeeded".to_owned(),
        ExecStatus::Exited => "failed".to_owned(),
        ExecStatus::Signaled => format!("killed by signal {}", r.signal),
        ExecStatus::TimedOut => "killed: it ran past its timeout".to_owned(),
        ExecStatus::OomKilled => "killed: out of memory".to_owned(),
        ExecStatus::SpawnFailed => format!("did not start: {}", r.error),
        ExecStatus::Lost => format!("lost: {}", r.error),
        ExecStatus::Running => "still running".to_owned(),
        ExecStatus::Unspecified => "unknown status".to_owned(),
    };
    format!(
        "exit_code={} status={} ({why}), {} ms, exec {}",
        r.exit_code,
        output::exec_status(r.status),
        r.duration_ms,
        r.exec_id
    )
}

/// One stream of a command, at most `limit` bytes of it, saying what was left out and where
/// the whole of it is.
pub fn stream(name: &str, bytes: &[u8], total: u64, spill: &str, limit: usize) -> String {
    if total == 0 && bytes.is_empty() {
        return format!("[{name}: empty]\n");
    }
    let shown = &bytes[..bytes.len().min(limit)];
    let text = String::from_utf8_lossy(shown);
    let mut out = String::new();
    if (shown.len() as u64) < total {
        let rest = if spill.is_empty() {
            "the rest was not kept".to_owned()
        } else {
            format!("the whole {name} is in the sandbox at {spill} (use read_file)")
        };
        out.push_str(&format!(
            "[{name}: first {} of {} bytes; {rest}]\n",
            shown.len(),
            total
        ));
    } else {
        out.push_str(&format!("[{name}: {total} bytes]\n"));
    }
    out.push_str(&text);
    if !text.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// A command's whole result: headline, stdout, stderr.
pub fn exec_result(r: &ExecResult, limit: usize) -> String {
    let mut text = exec_headline(r);
    text.push('\n');
    text.push_str(&stream(
        "stdout",
        &r.stdout,
        r.stdout_total_bytes.max(r.stdout.len() as u64),
        &r.stdout_spill_path,
        limit,
    ));
    text.push_str(&stream(
        "stderr",
        &r.stderr,
        r.stderr_total_bytes.max(r.stderr.len() as u64),
        &r.stderr_spill_path,
        limit,
    ));
    text
}

/// A sandbox in one line.
pub fn sandbox_line(s: &Sandbox) -> String {
    let limits = s.limits.unwrap_or_default();
    // The network only when it has one: most sandboxes reach nothing.
    let network = match &s.network {
        Some(n) if n.mode == agent_client::proto::NetworkMode::Allowlist as i32 => {
            format!(", network ALLOWLIST {}", n.allow.join(" "))
        }
        Some(n) if n.mode == agent_client::proto::NetworkMode::Open as i32 => {
            ", network OPEN".to_string()
        }
        _ => String::new(),
    };
    format!(
        "{} ({}, image {}, {}, workdir {}, memory {}, cpu {}m{network})",
        s.id,
        output::isolation(s.isolation),
        s.image,
        output::state(s.state),
        s.workdir,
        output::size(limits.memory_bytes),
        limits.cpu_millicores
    )
}

/// The longest prefix of `bytes` that is whole UTF-8 text, or None when the bytes are not text
/// (invalid before the last 3 bytes, where a page may cut a character in two).
pub fn text_prefix(bytes: &[u8]) -> Option<&str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => Some(s),
        Err(e) if e.error_len().is_none() && bytes.len() - e.valid_up_to() < 4 => {
            std::str::from_utf8(&bytes[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_command_says_its_code_first() {
        let r = ExecResult {
            exec_id: "ex-1".into(),
            status: ExecStatus::Exited as i32,
            exit_code: 3,
            stderr: b"boom\n".to_vec(),
            stderr_total_bytes: 5,
            ..Default::default()
        };
        let text = exec_result(&r, 100);
        assert!(
            text.starts_with("exit_code=3 status=exited (failed)"),
            "{text}"
        );
        assert!(text.contains("[stdout: empty]"));
        assert!(text.contains("[stderr: 5 bytes]\nboom\n"));
    }

    #[test]
    fn cut_output_names_the_spill_file() {
        let r = ExecResult {
            status: ExecStatus::Exited as i32,
            stdout: vec![b'x'; 50],
            stdout_total_bytes: 5000,
            stdout_truncated: true,
            stdout_spill_path: "/tmp/.sandboxd/out".into(),
            ..Default::default()
        };
        let text = exec_result(&r, 10);
        assert!(
            text.contains("[stdout: first 10 of 5000 bytes; the whole stdout is in the sandbox at /tmp/.sandboxd/out (use read_file)]\nxxxxxxxxxx\n"),
            "{text}"
        );
    }

    #[test]
    fn pages_cut_inside_a_character_are_still_text() {
        let s = "héllo".as_bytes();
        assert_eq!(text_prefix(&s[..2]), Some("h"));
        assert_eq!(text_prefix(s), Some("héllo"));
        assert_eq!(text_prefix(&[0xff, 0xfe, b'a', b'b', b'c', b'd']), None);
    }
}
