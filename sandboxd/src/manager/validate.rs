//! What a request may ask for, checked before anything is made or run: every refusal is an
//! INVALID_ARGUMENT naming the request field, and the bounds sit here beside the checks.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::admission::human_bytes;
use crate::backend::ExecSpec;
use crate::config::Config;
use crate::error::Error;
use crate::ids::{ExecId, SandboxId};
use crate::model::{ExecRequest, Isolation, Limits, RequestedLimits, SandboxInfo};

/// What argv and env of one exec may take together (the kernel allows more, but this keeps a
/// request's command line a command line: large data goes on stdin or in a file).
const MAX_ARGV_ENV_BYTES: usize = 256 << 10;
/// The kernel's MAX_ARG_STRLEN: one argument or `NAME=value` string (with its NUL) longer than
/// this makes execve fail with E2BIG.
const MAX_ARG_STRLEN: usize = 32 * 4096;
/// Room a sandbox's env must leave within [`MAX_ARGV_ENV_BYTES`] for the argv of its execs.
const ARGV_ROOM_BYTES: usize = 4 << 10;
/// Longest workdir (the kernel's PATH_MAX, with its NUL) and path component (NAME_MAX).
const PATH_MAX: usize = 4095;
const NAME_MAX: usize = 255;
/// Bounds of labels: they are stored with the sandbox and matched on every ListSandboxes.
const MAX_LABELS: usize = 64;
const MAX_LABEL_KEY_BYTES: usize = 128;
const MAX_LABEL_VALUE_BYTES: usize = 1024;
/// Longest idempotency key (it is stored with the exec record and looked up by value).
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;

/// The variables every exec starts with, under the image's, the sandbox's and the request's
/// own. `LANG=C.UTF-8`: a UTF-8 locale every glibc since 2.35 (and musl, busybox) has built in,
/// so Python, git and friends print non-ASCII text instead of failing on it.
fn base_env(id: &SandboxId) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("PATH".to_string(), sandbox_exec::capture::DEFAULT_PATH.to_string()),
        ("HOME".to_string(), "/root".to_string()),
        ("HOSTNAME".to_string(), id.to_string()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
    ])
}

/// Bytes an environment takes in an exec's argv+env budget (`NAME=value\0` each).
fn env_bytes<'a>(env: impl IntoIterator<Item = (&'a String, &'a String)>) -> usize {
    env.into_iter().map(|(k, v)| k.len() + v.len() + 2).sum()
}

/// Each variable of an env: a name execve accepts, no NUL, not longer than one string may be.
fn validate_env(field: &str, env: &BTreeMap<String, String>) -> Result<(), Error> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(Error::invalid(
                field,
                format!("bad variable {:?}: names must be non-empty without '=' or NUL", k.chars().take(64).collect::<String>()),
            ));
        }
        if k.len() + v.len() + 2 > MAX_ARG_STRLEN {
            return Err(Error::invalid(
                field,
                format!(
                    "variable {:?} is {} bytes; one variable may take at most {MAX_ARG_STRLEN} (execve refuses longer)",
                    k.chars().take(64).collect::<String>(),
                    k.len() + v.len() + 2
                ),
            ));
        }
    }
    Ok(())
}

/// An absolute path without `..`, within the kernel's path bounds.
fn validate_abs_path(field: &str, path: &str) -> Result<(), Error> {
    if !path.starts_with('/') || path.contains('\0') || path.split('/').any(|c| c == "..") {
        return Err(Error::invalid(field, format!("{:?} must be an absolute path without '..'", path.chars().take(256).collect::<String>())));
    }
    if path.len() > PATH_MAX || path.split('/').any(|c| c.len() > NAME_MAX) {
        return Err(Error::invalid(field, format!("path of {} bytes: at most {PATH_MAX} bytes, {NAME_MAX} per component", path.len())));
    }
    Ok(())
}

/// A sandbox's workdir: an absolute path the sandbox will see.
pub(super) fn validate_workdir(workdir: &str) -> Result<(), Error> {
    validate_abs_path("workdir", workdir)?;
    // The sandbox's /proc, /dev and /sys are mounted over whatever the layer holds there, so
    // a workdir made below them would not exist once the sandbox runs.
    if let Some(top) = ["/proc", "/dev", "/sys"].into_iter().find(|m| workdir == *m || workdir.starts_with(&format!("{m}/"))) {
        return Err(Error::invalid("workdir", format!("{workdir:?} is under {top}, which the sandbox's own mount hides")));
    }
    Ok(())
}

/// The env of sandbox `id`, which every exec in it inherits over its image's: valid variables,
/// and room left for a command line.
pub(super) fn validate_sandbox_env(id: &SandboxId, image_env: &BTreeMap<String, String>, env: &BTreeMap<String, String>) -> Result<(), Error> {
    validate_env("env", env)?;
    let mut all = base_env(id);
    all.extend(image_env.clone());
    all.extend(env.clone());
    let env_size = env_bytes(all.iter());
    if env_size + ARGV_ROOM_BYTES > MAX_ARGV_ENV_BYTES {
        return Err(Error::invalid(
            "env",
            format!(
                "{env_size} bytes with the default variables; every exec's argv and env must fit in {} KiB, so the sandbox env may take at most {} bytes (pass large data as a file)",
                MAX_ARGV_ENV_BYTES >> 10,
                MAX_ARGV_ENV_BYTES - ARGV_ROOM_BYTES
            ),
        ));
    }
    Ok(())
}

/// Labels of a sandbox: bounded in number and size, keys without control characters.
pub(super) fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), Error> {
    if labels.len() > MAX_LABELS {
        return Err(Error::invalid("labels", format!("{} labels; at most {MAX_LABELS}", labels.len())));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty() && k.len() <= MAX_LABEL_KEY_BYTES && !k.chars().any(char::is_control);
        if !key_ok || v.len() > MAX_LABEL_VALUE_BYTES || v.contains('\0') {
            return Err(Error::invalid(
                "labels",
                format!(
                    "label {:?}: keys are 1-{MAX_LABEL_KEY_BYTES} bytes without control characters, values at most {MAX_LABEL_VALUE_BYTES} bytes without NUL",
                    k.chars().take(64).collect::<String>()
                ),
            ));
        }
    }
    Ok(())
}

/// Image names are directory names under the images dir: no path, nothing hidden.
pub(super) fn validate_image(image: &str) -> Result<(), Error> {
    if !crate::backend::is_image_name(image) {
        return Err(Error::invalid(
            "image",
            format!("{:?}: 1-{} of [A-Za-z0-9._-], not starting with '.'", image.chars().take(80).collect::<String>(), crate::backend::MAX_IMAGE_NAME_BYTES),
        ));
    }
    Ok(())
}

/// A user an exec runs as: `name`, `uid`, `name:group` or `uid:gid` (resolved in the sandbox).
pub(super) fn validate_user(field: &str, user: String) -> Result<String, Error> {
    if !sandbox_exec::user::is_valid_spec(&user) {
        return Err(Error::invalid(
            field,
            format!("{:?}: expected name, uid, name:group or uid:gid, each 1-64 of [A-Za-z0-9._-]", user.chars().take(80).collect::<String>()),
        ));
    }
    Ok(user)
}

/// Refuses limits below [`Limits::MINIMUMS`]: a sandbox with them could not run anything.
pub(super) fn validate_minimums(limits: &Limits) -> Result<(), Error> {
    let m = Limits::MINIMUMS;
    if limits.memory_bytes < m.memory_bytes {
        return Err(Error::invalid("limits.memory_bytes", format!("{} is below the minimum {}", limits.memory_bytes, human_bytes(m.memory_bytes))));
    }
    if limits.max_pids < m.max_pids {
        return Err(Error::invalid(
            "limits.max_pids",
            format!("{} is below the minimum {} (a shell running a pipeline needs that many)", limits.max_pids, m.max_pids),
        ));
    }
    if limits.disk_bytes < m.disk_bytes {
        return Err(Error::invalid(
            "limits.disk_bytes",
            format!("{} is below the minimum {} (the writable layer must hold the sandbox's own files)", limits.disk_bytes, human_bytes(m.disk_bytes)),
        ));
    }
    if limits.shm_bytes < m.shm_bytes {
        return Err(Error::invalid("limits.shm_bytes", format!("{} is below the minimum {}", limits.shm_bytes, human_bytes(m.shm_bytes))));
    }
    Ok(())
}

/// One requested limit: the default when 0, refused above `max` naming `limits.<field>`.
fn resolve_limit<T: Copy + PartialOrd + Default + Into<u64>>(field: &str, requested: T, default: T, max: T) -> Result<T, Error> {
    if requested == T::default() {
        return Ok(default);
    }
    if requested > max {
        return Err(Error::invalid(format!("limits.{field}"), format!("{} is above the configured ceiling {}", requested.into(), max.into())));
    }
    Ok(requested)
}

/// The limits of a new sandbox: each requested one, or the default when it is 0, refused above
/// its ceiling. `/dev/shm` is a share of the memory limit: a request above it is refused, and
/// a default (half of the memory limit when 0) is cut to it.
pub(super) fn resolve_limits(r: &RequestedLimits, d: &Limits, m: &Limits) -> Result<Limits, Error> {
    let memory_bytes = resolve_limit("memory_bytes", r.memory_bytes, d.memory_bytes, m.memory_bytes)?;
    let shm_bytes = if r.shm_bytes == 0 {
        Limits { memory_bytes, ..*d }.shm_size().min(m.shm_bytes)
    } else if r.shm_bytes > memory_bytes {
        return Err(Error::invalid(
            "limits.shm_bytes",
            format!(
                "{} is above the sandbox's memory limit {} (limits.memory_bytes): /dev/shm is memory the sandbox uses",
                human_bytes(r.shm_bytes),
                human_bytes(memory_bytes)
            ),
        ));
    } else {
        resolve_limit("shm_bytes", r.shm_bytes, d.shm_bytes, m.shm_bytes)?
    };
    Ok(Limits {
        cpu_millicores: resolve_limit("cpu_millicores", r.cpu_millicores, d.cpu_millicores, m.cpu_millicores)?,
        memory_bytes,
        max_pids: resolve_limit("max_pids", r.max_pids, d.max_pids, m.max_pids)?,
        disk_bytes: resolve_limit("disk_bytes", r.disk_bytes, d.disk_bytes, m.disk_bytes)?,
        exec_timeout_ms: resolve_limit("exec_timeout_ms", r.exec_timeout_ms, d.exec_timeout_ms, m.exec_timeout_ms)?,
        shm_bytes,
    })
}

/// Validates an exec request against its sandbox and the configured ceilings, and resolves every
/// default.
pub(super) fn exec_spec(cfg: &Config, info: &SandboxInfo, req: &ExecRequest, exec_id: ExecId) -> Result<ExecSpec, Error> {
    if req.argv.is_empty() {
        return Err(Error::invalid("argv", "must not be empty"));
    }
    if req.argv[0].is_empty() {
        return Err(Error::invalid("argv", "argv[0] must not be empty"));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(Error::invalid("argv", "arguments must not contain NUL bytes"));
    }
    if let Some((i, a)) = req.argv.iter().enumerate().find(|(_, a)| a.len() + 1 > MAX_ARG_STRLEN) {
        return Err(Error::invalid("argv", format!("argv[{i}] is {} bytes; one argument may take at most {MAX_ARG_STRLEN} (execve refuses longer)", a.len())));
    }
    validate_env("env", &req.env)?;
    if req.idempotency_key.len() > MAX_IDEMPOTENCY_KEY_BYTES || req.idempotency_key.contains('\0') {
        return Err(Error::invalid("idempotency_key", format!("{} bytes: at most {MAX_IDEMPOTENCY_KEY_BYTES}, without NUL", req.idempotency_key.len())));
    }
    let workdir = if req.workdir.is_empty() { info.workdir.clone() } else { req.workdir.clone() };
    validate_abs_path("workdir", &workdir)?;
    let timeout_ms = if req.timeout_ms == 0 { info.limits.exec_timeout_ms } else { req.timeout_ms };
    if timeout_ms > cfg.limits.max.exec_timeout_ms {
        return Err(Error::invalid("timeout_ms", format!("{timeout_ms} is above the configured ceiling {}", cfg.limits.max.exec_timeout_ms)));
    }
    let max_output = if req.max_output_bytes == 0 { cfg.exec.default_max_output_bytes } else { req.max_output_bytes };
    if max_output > cfg.exec.max_output_bytes_ceiling {
        return Err(Error::invalid("max_output_bytes", format!("{max_output} is above the configured ceiling {}", cfg.exec.max_output_bytes_ceiling)));
    }
    let user = if req.user.is_empty() { info.user.clone() } else { Some(validate_user("user", req.user.clone())?) };
    // The image's env under the sandbox's, under the request's. An exec with a user gets that
    // user's HOME from the sandbox's /etc/passwd in the runtime (root's is /root there too),
    // unless one of these sets it.
    let mut env = base_env(&info.id);
    if user.is_some() {
        env.remove("HOME");
    }
    env.extend(info.image_config.env.clone());
    env.extend(info.env.clone());
    env.extend(req.env.clone());
    let argv_size: usize = req.argv.iter().map(|a| a.len() + 1).sum();
    let size = argv_size + env_bytes(&env);
    if size > MAX_ARGV_ENV_BYTES {
        // Named after the part the request made large.
        let field = if env_bytes(&req.env) > argv_size { "env" } else { "argv" };
        return Err(Error::invalid(
            field,
            format!("argv and env together are {size} bytes; the limit is {} KiB (pass large data on stdin or as a file)", MAX_ARGV_ENV_BYTES >> 10),
        ));
    }
    Ok(ExecSpec {
        exec_id,
        user,
        argv: req.argv.clone(),
        env: env.into_iter().collect(),
        workdir,
        // Set by the caller, which moves it out of the request (see `Manager::run_exec_with`).
        stdin: crate::backend::Stdin::default(),
        timeout: Duration::from_millis(timeout_ms),
        max_output_bytes: max_output,
        io_drain_timeout: Duration::from_millis(cfg.exec.io_drain_timeout_ms),
        input: crate::backend::SessionInputs::default(),
        tty: None,
        // Set by the caller from the sandbox's entry (see `Manager::run_exec_with`).
        clock: crate::backend::RunClock::default(),
    })
}

/// The signal number of a SignalExec.
pub(super) fn validate_signal(signal: i32) -> Result<(), Error> {
    if !(1..=64).contains(&signal) {
        return Err(Error::invalid("signal", format!("{signal} is not a signal number (1-64)")));
    }
    Ok(())
}

/// The permission bits of a WriteFile.
pub(super) fn validate_mode(mode: u32) -> Result<(), Error> {
    if mode > 0o7777 {
        return Err(Error::invalid("mode", format!("{mode:o} is not a permission mode")));
    }
    Ok(())
}

/// Paths the file API refuses: the kernel's interfaces (`/proc`, `/sys`), which the daemon, as
/// the host's root, must never write through a sandbox's view, and on the process tier `/dev`
/// (its `/dev/shm` and `/dev/pts` are mounts of the sandbox's own, while that tier's file API
/// works on the root filesystem, where `/dev` is an empty directory: a file written there would
/// never be seen inside). The container and microVM tiers reach the sandbox's own `/dev/shm`.
/// `path` is taken lexically, relative to `workdir` when relative.
pub(super) fn refuse_kernel_mounts(isolation: Isolation, workdir: &str, path: &str) -> Result<(), Error> {
    let mut parts: Vec<&str> = Vec::new();
    let joined = if path.starts_with('/') { path.to_string() } else { format!("{workdir}/{path}") };
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let refused = |top: &str| top == "proc" || top == "sys" || (top == "dev" && isolation == Isolation::Process);
    match parts.first() {
        Some(&top) if refused(top) => Err(Error::invalid(
            "path",
            format!("{path:?} is under /{top}, which the file API does not reach on this tier (it reads and writes the sandbox's files, not the kernel's or its own mounts there): use an exec, e.g. `cat` or `cp`"),
        )),
        _ => Ok(()),
    }
}

/// A snapshot's name, stored with its record.
pub(super) fn validate_snapshot_name(name: &str) -> Result<(), Error> {
    if name.len() > 256 {
        return Err(Error::invalid("name", "at most 256 bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_mounts_are_refused_however_named() {
        for path in ["/dev/shm/x", "/proc/1/environ", "/sys", "/workspace/../dev/shm", "shm/x"] {
            let workdir = if path == "shm/x" { "/dev" } else { "/workspace" };
            let err = refuse_kernel_mounts(Isolation::Process, workdir, path).expect_err(path);
            assert!(err.to_string().contains("use an exec"), "{err}");
        }
        for path in ["/workspace/dev/shm", "/devices", "/tmp/x", "dev/x", "/"] {
            assert!(refuse_kernel_mounts(Isolation::Process, "/workspace", path).is_ok(), "{path}");
        }
        // The other tiers reach their own /dev/shm, never the kernel's interfaces.
        for isolation in [Isolation::Container, Isolation::MicroVm] {
            assert!(refuse_kernel_mounts(isolation, "/workspace", "/dev/shm/x").is_ok());
            assert!(refuse_kernel_mounts(isolation, "/workspace", "/proc/sysrq-trigger").is_err());
            assert!(refuse_kernel_mounts(isolation, "/", "sys/kernel").is_err());
        }
    }

    #[test]
    fn limits_default_and_ceiling() {
        assert_eq!(resolve_limit("max_pids", 0u32, 10, 100).ok(), Some(10));
        assert_eq!(resolve_limit("max_pids", 50u32, 10, 100).ok(), Some(50));
        let err = resolve_limit("memory_bytes", 1u64 << 40, 1, 1 << 30).expect_err("over ceiling");
        assert!(err.to_string().contains("limits.memory_bytes"), "{err}");
    }

    #[test]
    fn shm_defaults_to_half_the_memory_and_never_exceeds_it() {
        let (d, m) = (Limits::DEFAULTS, Limits::CEILINGS);
        let gib = RequestedLimits { memory_bytes: 1 << 30, ..Default::default() };
        assert_eq!(resolve_limits(&gib, &d, &m).expect("default").shm_bytes, 512 << 20);
        assert_eq!(resolve_limits(&RequestedLimits::default(), &d, &m).expect("all defaults").shm_bytes, d.memory_bytes / 2);
        let asked = RequestedLimits { shm_bytes: 200 << 20, ..gib };
        assert_eq!(resolve_limits(&asked, &d, &m).expect("explicit").shm_bytes, 200 << 20);
        let equal = RequestedLimits { shm_bytes: 1 << 30, ..gib };
        assert_eq!(resolve_limits(&equal, &d, &m).expect("all of the memory").shm_bytes, 1 << 30);
        let over = RequestedLimits { shm_bytes: (1 << 30) + 1, ..gib };
        let err = resolve_limits(&over, &d, &m).expect_err("above the memory limit");
        assert!(err.to_string().contains("limits.shm_bytes") && err.to_string().contains("memory"), "{err}");
        // A configured default larger than a sandbox's memory is cut to it, not refused.
        let big_default = Limits { shm_bytes: 1 << 30, ..d };
        let small = RequestedLimits { memory_bytes: 64 << 20, ..Default::default() };
        assert_eq!(resolve_limits(&small, &big_default, &m).expect("default cut").shm_bytes, 64 << 20);
        // And a ceiling below the memory limit refuses, naming the field.
        let low_ceiling = Limits { shm_bytes: 100 << 20, ..m };
        let err = resolve_limits(&asked, &d, &low_ceiling).expect_err("above the ceiling");
        assert!(err.to_string().contains("limits.shm_bytes"), "{err}");
    }

    #[test]
    fn env_and_paths_are_validated() {
        let mut env = BTreeMap::new();
        env.insert("A=B".to_string(), "x".to_string());
        assert!(validate_env("env", &env).is_err());
        assert!(validate_abs_path("workdir", "relative").is_err());
        assert!(validate_abs_path("workdir", "/a/../b").is_err());
        assert!(validate_abs_path("workdir", "/workspace/x").is_ok());
        assert!(validate_abs_path("workdir", &format!("/{}", "x".repeat(256))).is_err(), "component over NAME_MAX");
        assert!(validate_abs_path("workdir", &"/x".repeat(2100)).is_err(), "over PATH_MAX");
        let big = BTreeMap::from([("BIG".to_string(), "x".repeat(MAX_ARG_STRLEN))]);
        assert!(validate_env("env", &big).is_err(), "one variable over MAX_ARG_STRLEN");
    }

    #[test]
    fn create_time_floors_and_names_are_validated() {
        // Resolved limits always hold a /dev/shm size.
        let ok = Limits { shm_bytes: Limits::DEFAULTS.shm_size(), ..Limits::DEFAULTS };
        assert!(validate_minimums(&ok).is_ok());
        assert!(validate_minimums(&Limits::MINIMUMS).is_ok(), "the floors themselves are allowed");
        for (limits, field) in [
            (Limits { disk_bytes: 1, ..ok }, "limits.disk_bytes"),
            (Limits { max_pids: 7, ..ok }, "limits.max_pids"),
            (Limits { memory_bytes: 1 << 20, ..ok }, "limits.memory_bytes"),
            (Limits { shm_bytes: 4096, ..ok }, "limits.shm_bytes"),
        ] {
            let err = validate_minimums(&limits).expect_err(field);
            assert!(err.to_string().contains(field), "{err}");
        }
        for good in ["minimal", "debian-12", "img_v1.2"] {
            assert!(validate_image(good).is_ok(), "{good}");
        }
        for bad in ["", "../etc", "a/b", ".hidden", "with space", &"x".repeat(65)] {
            assert!(validate_image(bad).is_err(), "{bad:?}");
        }
        assert!(validate_labels(&BTreeMap::from([("team".to_string(), "ci".to_string())])).is_ok());
        assert!(validate_labels(&BTreeMap::from([("x".repeat(129), String::new())])).is_err());
        assert!(validate_labels(&BTreeMap::from([("a\nb".to_string(), String::new())])).is_err());
        assert!(validate_labels(&(0..=MAX_LABELS).map(|i| (format!("k{i}"), String::new())).collect()).is_err());
    }
}
