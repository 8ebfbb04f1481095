//! Why a command could not start, the same on every tier: the stage a forked child failed at,
//! the exit code (127 not found, 126 not executable, as shells use) and the sentence a user reads
//! in `ExecResult.error`. The process tier's init, the guest agent and the container tier's
//! wrapper all report a (stage, errno) and describe it here.

use nix::errno::Errno;

/// Where a child failed before it became the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Cgroup = 1,
    Workdir = 2,
    Exec = 3,
    Stdio = 4,
}

impl Stage {
    /// The stage a child wrote as its first error byte (unknown bytes count as `Exec`).
    pub fn from_byte(b: u8) -> Stage {
        match b {
            1 => Stage::Cgroup,
            2 => Stage::Workdir,
            4 => Stage::Stdio,
            _ => Stage::Exec,
        }
    }

    /// Its name on a wire (the process tier's control messages).
    pub fn name(self) -> &'static str {
        match self {
            Stage::Cgroup => "cgroup",
            Stage::Workdir => "workdir",
            Stage::Exec => "exec",
            Stage::Stdio => "stdio",
        }
    }

    /// The stage named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Stage> {
        [Stage::Cgroup, Stage::Workdir, Stage::Exec, Stage::Stdio].into_iter().find(|s| s.name() == name)
    }

    /// The exit code a child failing here ends with.
    pub fn exit_code(self, errno: Errno) -> i32 {
        if self == Stage::Exec && errno != Errno::ENOENT && errno != Errno::ENOTDIR {
            126
        } else {
            127
        }
    }
}

/// Why a command did not start: exit code and a sentence.
pub fn describe_failure(stage: Stage, errno: Errno, argv0: &str, workdir: &str) -> (i32, String) {
    let sentence = match (stage, errno) {
        (Stage::Exec, Errno::ENOENT | Errno::ENOTDIR) => format!("executable not found: {argv0}"),
        (Stage::Exec, Errno::EACCES) => format!("permission denied: {argv0} is not executable"),
        (Stage::Exec, Errno::ENOEXEC) => format!("{argv0} is not an executable format (a script without #!?)"),
        (Stage::Exec, e) => format!("cannot execute {argv0}: {}", e.desc()),
        (Stage::Workdir, e) => format!("cannot enter working directory {workdir}: {}", e.desc()),
        (Stage::Cgroup, e) => format!("cannot join the exec's cgroup: {}", e.desc()),
        (Stage::Stdio, e) => format!("cannot set up the command's stdio: {}", e.desc()),
    };
    (stage.exit_code(errno), sentence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_of_codes_and_sentences() {
        let cases = [
            (Stage::Exec, Errno::ENOENT, 127, "executable not found: prog"),
            (Stage::Exec, Errno::ENOTDIR, 127, "executable not found: prog"),
            (Stage::Exec, Errno::EACCES, 126, "permission denied: prog is not executable"),
            (Stage::Exec, Errno::ENOEXEC, 126, "prog is not an executable format (a script without #!?)"),
            (Stage::Exec, Errno::E2BIG, 126, "cannot execute prog: Argument list too long"),
            (Stage::Workdir, Errno::ENOENT, 127, "cannot enter working directory /w: No such file or directory"),
            (Stage::Workdir, Errno::ENOTDIR, 127, "cannot enter working directory /w: Not a directory"),
            (Stage::Cgroup, Errno::ENOSPC, 127, "cannot join the exec's cgroup: No space left on device"),
            (Stage::Stdio, Errno::EBADF, 127, "cannot set up the command's stdio: Bad file number"),
        ];
        for (stage, errno, code, sentence) in cases {
            assert_eq!(describe_failure(stage, errno, "prog", "/w"), (code, sentence.to_string()), "{stage:?} {errno:?}");
        }
        for stage in [Stage::Cgroup, Stage::Workdir, Stage::Exec, Stage::Stdio] {
            assert_eq!(Stage::from_name(stage.name()), Some(stage));
            assert_eq!(Stage::from_byte(stage as u8), stage);
        }
        assert_eq!(Stage::from_name("fork"), None);
    }
}
