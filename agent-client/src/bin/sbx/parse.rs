//! Parsers for command-line values: sizes, `K=V` pairs, CPU counts, signals and `ID:/path`.
//!
//! Each returns a `String` error, which clap shows next to the offending argument.

use std::path::PathBuf;

/// Parses a byte size: a number with an optional binary unit, case-insensitive.
///
/// `K`, `M`, `G`, `T` are powers of 1024, also written `Ki`/`KiB`/`KB` etc.; `B` or no unit means
/// bytes. A fraction is allowed with a unit (`1.5G`) and rounded to whole bytes.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    if number.is_empty() {
        return Err(format!(
            "invalid size {input:?}: expected a number such as 512M, 1G or 1048576"
        ));
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kb" | "kib" => 10,
        "m" | "mi" | "mb" | "mib" => 20,
        "g" | "gi" | "gb" | "gib" => 30,
        "t" | "ti" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "invalid size {input:?}: unknown unit {unit:?} (use K, M, G or T, powers of 1024)"
            ))
        }
    };
    let multiplier = 1u64 << shift;
    let too_large = || format!("invalid size {input:?}: too large");
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier).ok_or_else(too_large);
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid size {input:?}: {number:?} is not a number"))?;
    let bytes = (value * multiplier as f64).round();
    // 2^64 itself is not representable as u64; anything at or above it overflows.
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

/// Parses `KEY=VALUE`; the value may be empty and may itself contain `=`.
pub fn parse_kv(input: &str) -> Result<(String, String), String> {
    match input.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        Some(_) => Err(format!("invalid {input:?}: the key before '=' is empty")),
        None => Err(format!("invalid {input:?}: expected KEY=VALUE")),
    }
}

/// Parses a CPU count (`0.5`, `2`) into millicores.
pub fn parse_cpus(input: &str) -> Result<u32, String> {
    let cpus: f64 = input
        .trim()
        .parse()
        .map_err(|_| format!("invalid CPU count {input:?}: expected a number such as 0.5 or 2"))?;
    if !cpus.is_finite() || cpus <= 0.0 {
        return Err(format!(
            "invalid CPU count {input:?}: must be greater than 0"
        ));
    }
    let millicores = (cpus * 1000.0).round();
    if millicores < 1.0 {
        return Err(format!(
            "invalid CPU count {input:?}: the smallest share is 0.001"
        ));
    }
    if millicores > f64::from(u32::MAX) {
        return Err(format!("invalid CPU count {input:?}: too large"));
    }
    Ok(millicores as u32)
}

/// Linux signal numbers by name. The numbers are those of the sandbox (always Linux), not of
/// the machine `sbx` runs on.
const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("WINCH", 28),
];

/// Parses a signal: a name with or without `SIG` (`TERM`, `sigkill`) or a number (`9`).
pub fn parse_signal(input: &str) -> Result<i32, String> {
    let s = input.trim();
    if let Ok(n) = s.parse::<i32>() {
        return if (1..=64).contains(&n) {
            Ok(n)
        } else {
            Err(format!("invalid signal {input:?}: numbers go from 1 to 64"))
        };
    }
    let upper = s.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, n)| *n)
        .ok_or_else(|| format!("invalid signal {input:?}: use a number or one of TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT"))
}

/// The name of a Linux signal number (`SIGKILL`), if it is a common one.
pub fn signal_name(signal: i32) -> Option<String> {
    SIGNALS
        .iter()
        .find(|(_, n)| *n == signal)
        .map(|(name, _)| format!("SIG{name}"))
}

/// One side of `sbx cp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// `-`: standard input or output.
    Stdio,
    /// A path on this machine.
    Local(PathBuf),
    /// `ID:/path`: a path inside a sandbox.
    Remote {
        /// The sandbox.
        sandbox_id: String,
        /// The path inside it.
        path: String,
    },
}

impl Location {
    /// Parses `-`, `ID:/path` or a local path.
    ///
    /// As with `scp`, text before the first `:` is a sandbox id only if it contains no `/`; so a
    /// local file whose name has a colon is written `./name:with:colon`.
    pub fn parse(input: &str) -> Result<Self, String> {
        if input == "-" {
            return Ok(Location::Stdio);
        }
        if input.is_empty() {
            return Err("empty path".to_owned());
        }
        match input.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') => {
                if path.is_empty() {
                    return Err(format!("{input:?}: a path is needed after the sandbox id, e.g. {id}:/workspace/file"));
                }
                Ok(Location::Remote {
                    sandbox_id: id.to_owned(),
                    path: path.to_owned(),
                })
            }
            _ => Ok(Location::Local(PathBuf::from(input))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(1_048_576));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("64Ki"), Ok(64 << 10));
        assert_eq!(parse_size("64kib"), Ok(64 << 10));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("3gb"), Ok(3 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("100b"), Ok(100));
        assert_eq!(parse_size(" 512 M "), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn bad_sizes_say_why() {
        for (input, reason) in [
            ("", "expected a number"),
            ("M", "expected a number"),
            ("-1G", "expected a number"),
            ("12X", "unknown unit \"X\""),
            ("1.2.3M", "is not a number"),
            ("16384P", "unknown unit"),
            ("99999999999T", "too large"),
            ("18446744073709551616", "too large"),
        ] {
            let err = parse_size(input).expect_err(input);
            assert!(err.contains(reason), "{input:?}: {err}");
        }
    }

    #[test]
    fn key_values() {
        assert_eq!(parse_kv("A=1"), Ok(("A".into(), "1".into())));
        assert_eq!(parse_kv("A="), Ok(("A".into(), String::new())));
        assert_eq!(parse_kv("URL=a=b"), Ok(("URL".into(), "a=b".into())));
        assert!(parse_kv("A").is_err());
        assert!(parse_kv("=1").is_err());
    }

    #[test]
    fn cpus() {
        assert_eq!(parse_cpus("0.5"), Ok(500));
        assert_eq!(parse_cpus("2"), Ok(2000));
        assert_eq!(parse_cpus("0.001"), Ok(1));
        for bad in ["0", "-1", "0.0001", "abc", "inf", "NaN", "1e10"] {
            assert!(parse_cpus(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal("TERM"), Ok(15));
        assert_eq!(parse_signal("sigkill"), Ok(9));
        assert_eq!(parse_signal("INT"), Ok(2));
        assert_eq!(parse_signal("9"), Ok(9));
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("BOGUS").is_err());
        assert_eq!(signal_name(9).as_deref(), Some("SIGKILL"));
        assert_eq!(signal_name(63), None);
    }

    #[test]
    fn locations() {
        assert_eq!(Location::parse("-"), Ok(Location::Stdio));
        assert_eq!(
            Location::parse("sb-123:/workspace/a.txt"),
            Ok(Location::Remote {
                sandbox_id: "sb-123".into(),
                path: "/workspace/a.txt".into()
            })
        );
        assert_eq!(
            Location::parse("notes.txt"),
            Ok(Location::Local("notes.txt".into()))
        );
        assert_eq!(
            Location::parse("/tmp/a:b"),
            Ok(Location::Local("/tmp/a:b".into()))
        );
        assert_eq!(
            Location::parse("./x:y"),
            Ok(Location::Local("./x:y".into()))
        );
        assert_eq!(Location::parse(":/x"), Ok(Location::Local(":/x".into())));
        assert!(Location::parse("sb-1:").is_err());
        assert!(Location::parse("").is_err());
    }
}
