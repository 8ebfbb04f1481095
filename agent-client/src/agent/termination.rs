//! No-progress detection.
//!
//! A step is fingerprinted by its action and its observation; two steps are "the same" when
//! their actions are identical and their observations identical or near-duplicates (the same
//! text up to timestamps, durations and ids, or with a few lines changed). The run is stuck
//! when the last `repeat` steps are all the same, or the last steps alternate between two
//! (A, B, A, B, …) — and **no progress signal** appeared meanwhile: the workspace's content
//! fingerprint did not change and no test counts changed. The progress signals are what let a
//! legitimate polling loop (same command, same "waiting" answer, while a background job writes
//! files) run on, where a loop that keeps failing the same way is stopped.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};

/// Tuning of the detector.
#[derive(Clone, Copy, Debug)]
pub struct DetectorConfig {
    /// Identical steps in a row that make a run stuck.
    pub repeat: usize,
    /// Identical steps in a row that make a run stuck when each of them waits explicitly
    /// (`sleep N`, `wait`, `timeout`): polling with a pause is slower to call stuck.
    pub repeat_waiting: usize,
    /// A/B cycles in a row that make a run stuck.
    pub alternations: usize,
    /// Jaccard similarity of observation shingles above which two are near-duplicates.
    pub near_duplicate: f64,
    /// Steps remembered.
    pub window: usize,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        DetectorConfig {
            repeat: 4,
            repeat_waiting: 12,
            alternations: 3,
            near_duplicate: 0.9,
            window: 12,
        }
    }
}

/// Fingerprint of one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPrint {
    /// Step number.
    pub step: u64,
    /// Hash of the canonical action.
    pub action: u64,
    /// Hash of the observation, exactly.
    pub observation: u64,
    /// Hashed word shingles of the normalized observation (bounded), for near-duplicates.
    pub shingles: Vec<u32>,
    /// Content fingerprint of the workspace after the step, when it was probed.
    pub workspace: Option<String>,
    /// Test counts seen in the observation ("3 passed", "1 failed").
    pub tests: Vec<String>,
    /// The action waits on purpose (`sleep`, `wait`): a poll.
    #[serde(default)]
    pub waiting: bool,
    /// Something was still running after the step: a background exec of the run.
    #[serde(default)]
    pub busy: bool,
    /// Fingerprint of activity outside the workspace (processes' CPU time, background
    /// execs' output size), when probed.
    #[serde(default)]
    pub activity: Option<String>,
}

/// What the detector remembers; checkpointed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DetectorState {
    /// Recent steps, oldest first.
    pub recent: VecDeque<StepPrint>,
    /// Last workspace fingerprint seen, with the step it was taken at.
    pub last_workspace: Option<(u64, String)>,
    /// Steps at which a progress signal was seen.
    pub progress_steps: Vec<u64>,
    /// Last activity fingerprint seen.
    #[serde(default)]
    pub last_activity: Option<String>,
}

/// Why the detector thinks the run is stuck.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stuck {
    /// The same step `times` in a row.
    Repeating {
        /// How many.
        times: usize,
    },
    /// Two steps alternating `cycles` times.
    Alternating {
        /// How many A/B cycles.
        cycles: usize,
    },
}

impl std::fmt::Display for Stuck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stuck::Repeating { times } => write!(
                f,
                "the same action gave the same result {times} times in a row with no change to the workspace"
            ),
            Stuck::Alternating { cycles } => write!(
                f,
                "two actions alternated {cycles} times with the same results and no change to the workspace"
            ),
        }
    }
}

/// What the detector says after a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to say.
    Fine,
    /// One more step like this and the run stops: tell the model now.
    Warning(String),
    /// The run is stuck.
    Stuck(Stuck),
}

/// The no-progress detector.
#[derive(Clone, Debug, Default)]
pub struct Detector {
    cfg: DetectorConfig,
    state: DetectorState,
}

fn hash_of(s: &str) -> u64 {
    let mut h = DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

impl Detector {
    /// A detector continuing from `state`.
    pub fn new(cfg: DetectorConfig, state: DetectorState) -> Self {
        let mut cfg = cfg;
        // Remember enough steps for the longest pattern.
        cfg.window = cfg
            .window
            .max(cfg.repeat_waiting + 1)
            .max(cfg.repeat + 1)
            .max(2 * cfg.alternations + 1);
        Detector { cfg, state }
    }

    /// The state to checkpoint.
    pub fn state(&self) -> &DetectorState {
        &self.state
    }

    /// Whether the loop should probe the workspace after running `action`: only when the
    /// action repeats a recent one, since only then can a verdict depend on it — so an agent
    /// that does not repeat itself pays nothing.
    pub fn wants_probe(&self, action_canonical: &str) -> bool {
        let h = hash_of(action_canonical);
        self.state.recent.iter().any(|p| p.action == h)
    }

    /// Fingerprints a step.
    pub fn print(
        step: u64,
        action_canonical: &str,
        observation: &str,
        workspace: Option<String>,
    ) -> StepPrint {
        StepPrint {
            step,
            action: hash_of(action_canonical),
            observation: hash_of(observation),
            shingles: shingles(&normalize(observation)),
            workspace,
            tests: test_counts(observation),
            waiting: waits_explicitly(action_canonical),
            busy: false,
            activity: None,
        }
    }

    /// Records a step and says whether the run is stuck, or will be after one more step
    /// like it.
    pub fn judge(&mut self, print: StepPrint) -> Verdict {
        if let Some(stuck) = self.observe(print) {
            return Verdict::Stuck(stuck);
        }
        self.warning().map_or(Verdict::Fine, Verdict::Warning)
    }

    /// Whether one more step repeating the last one would make the run stuck.
    fn warning(&self) -> Option<String> {
        let r: Vec<&StepPrint> = self.state.recent.iter().collect();
        let n = r.len();
        let last = *r.last()?;
        let k = self.repeat_for(&r[n.saturating_sub(self.cfg.repeat)..]);
        if k >= 2 && n + 1 >= k {
            let tail = &r[n + 1 - k..];
            if tail.iter().all(|p| self.same(p, last)) && !self.progressed_since(tail[0].step) {
                return Some(format!(
                    "NO-PROGRESS WARNING: the same action gave the same result {} times in a row with no progress signal (no change in the workspace, no test counts, nothing running in the background). One more and the run stops as no_progress. Change approach; if you are waiting for a job, run it with background=true or wait explicitly (sleep) between checks.",
                    k - 1
                ));
            }
        }
        let c = self.cfg.alternations;
        let len = 2 * c;
        if c >= 2 && n + 1 >= len && n >= 3 {
            let tail = &r[n + 1 - len..];
            let alternates = (2..tail.len()).all(|i| self.same(tail[i], tail[i - 2]))
                && !self.same(tail[0], tail[1]);
            if alternates && !self.progressed_since(tail[0].step) {
                return Some(format!(
                    "NO-PROGRESS WARNING: two actions have alternated {} times with the same results and no progress signal. One more and the run stops as no_progress. Change approach.",
                    c - 1
                ));
            }
        }
        None
    }

    /// Identical steps that make a run stuck: more when every one of them waits on purpose.
    fn repeat_for(&self, tail: &[&StepPrint]) -> usize {
        if !tail.is_empty() && tail.iter().all(|p| p.waiting) {
            self.cfg.repeat_waiting.max(self.cfg.repeat)
        } else {
            self.cfg.repeat
        }
    }

    /// Records a step and says whether the run is stuck.
    pub fn observe(&mut self, print: StepPrint) -> Option<Stuck> {
        // Beyond the workspace: a background job still running is progress (the poll is
        // legitimate while it runs); so is activity that changed since the last probe.
        if print.busy {
            self.state.progress_steps.push(print.step);
        }
        if let Some(a) = &print.activity {
            if self
                .state
                .last_activity
                .as_ref()
                .is_some_and(|prev| prev != a)
            {
                self.state.progress_steps.push(print.step);
            }
            self.state.last_activity = Some(a.clone());
        }
        if let Some(ws) = &print.workspace {
            if let Some((_, prev)) = &self.state.last_workspace {
                if prev != ws {
                    self.state.progress_steps.push(print.step);
                }
            }
            self.state.last_workspace = Some((print.step, ws.clone()));
        }
        // Test counts that differ from the last run of the same action are progress.
        if !print.tests.is_empty() {
            let prev = self
                .state
                .recent
                .iter()
                .rev()
                .find(|p| p.action == print.action && !p.tests.is_empty());
            if prev.is_some_and(|p| p.tests != print.tests) {
                self.state.progress_steps.push(print.step);
            }
        }
        self.state.recent.push_back(print);
        while self.state.recent.len() > self.cfg.window {
            self.state.recent.pop_front();
        }
        let keep_from = self.state.recent.front().map_or(0, |p| p.step);
        self.state.progress_steps.retain(|s| *s >= keep_from);
        self.verdict()
    }

    fn same(&self, a: &StepPrint, b: &StepPrint) -> bool {
        a.action == b.action
            && (a.observation == b.observation
                || jaccard(&a.shingles, &b.shingles) >= self.cfg.near_duplicate)
    }

    /// Whether a progress signal was seen after `from_step` (exclusive) up to now.
    fn progressed_since(&self, from_step: u64) -> bool {
        self.state.progress_steps.iter().any(|s| *s > from_step)
    }

    fn verdict(&self) -> Option<Stuck> {
        let r: Vec<&StepPrint> = self.state.recent.iter().collect();
        let n = r.len();
        let k = self.repeat_for(&r[n.saturating_sub(self.cfg.repeat)..]);
        if k >= 2 && n >= k {
            let tail = &r[n - k..];
            if tail.iter().all(|p| self.same(p, tail[k - 1]))
                && !self.progressed_since(tail[0].step)
            {
                return Some(Stuck::Repeating { times: k });
            }
        }
        let c = self.cfg.alternations;
        let len = 2 * c;
        if c >= 2 && n >= len {
            let tail = &r[n - len..];
            let alternates =
                (2..len).all(|i| self.same(tail[i], tail[i - 2])) && !self.same(tail[0], tail[1]);
            if alternates && !self.progressed_since(tail[0].step) {
                return Some(Stuck::Alternating { cycles: c });
            }
        }
        None
    }
}

/// Masks what changes between two runs of the same command without meaning anything: clock
/// times, durations, long hex ids and long numbers (pids, epoch times). Small numbers stay —
/// "3 passed" against "4 passed" is a real difference.
pub fn normalize(text: &str) -> String {
    text.split_whitespace()
        .map(|w| {
            let digits = w.chars().filter(char::is_ascii_digit).count();
            let hexish =
                w.len() >= 8 && w.chars().all(|c| c.is_ascii_hexdigit() || c == '-') && digits > 0;
            let clock = w.contains(':')
                && digits >= 4
                && w.chars()
                    .all(|c| c.is_ascii_digit() || ":.-TZ+".contains(c));
            let duration = digits > 0
                && ["ms", "s", "sec", "secs"].iter().any(|u| {
                    w.strip_suffix(u).is_some_and(|n| {
                        !n.is_empty() && n.chars().all(|c| c.is_ascii_digit() || c == '.')
                    })
                });
            let long_number = digits >= 5 && w.chars().all(|c| c.is_ascii_digit() || c == '.');
            if hexish || clock || duration || long_number {
                "#"
            } else {
                w
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Hashed word 3-shingles, the smallest 64 kept (a bottom-k sketch), so similarity of long
/// outputs costs the same as of short ones and the checkpoint stays small.
pub fn shingles(text: &str) -> Vec<u32> {
    let words: Vec<&str> = text.split(' ').filter(|w| !w.is_empty()).collect();
    let mut set = BTreeSet::new();
    // The low 32 bits of a 64-bit hash: collisions among a few hundred shingles are rare
    // enough not to move a 0.9 similarity threshold.
    let h = |s: &str| hash_of(s) as u32;
    if words.len() < 3 {
        set.insert(h(&words.join(" ")));
    } else {
        for w in words.windows(3) {
            set.insert(h(&w.join(" ")));
        }
    }
    set.into_iter().take(64).collect()
}

/// Jaccard similarity of two bottom-k sketches.
pub fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let sa: BTreeSet<u32> = a.iter().copied().collect();
    let sb: BTreeSet<u32> = b.iter().copied().collect();
    let inter = sa.intersection(&sb).count();
    let union = sa.union(&sb).count();
    inter as f64 / union.max(1) as f64
}

/// "N passed", "N failed", "N errors", … as found in test runner output.
pub fn test_counts(text: &str) -> Vec<String> {
    const WORDS: &[&str] = &[
        "passed", "failed", "failures", "failure", "errors", "error", "ok", "tests", "test",
        "skipped",
    ];
    let words: Vec<String> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
        .filter(|w| !w.is_empty())
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric())
                .to_ascii_lowercase()
        })
        .collect();
    let mut out = Vec::new();
    for pair in words.windows(2) {
        if pair[0].parse::<u64>().is_ok() && WORDS.contains(&pair[1].as_str()) {
            out.push(format!("{} {}", pair[0], pair[1]));
        }
    }
    out.truncate(16);
    out
}

/// Whether a command waits on purpose: `sleep N`, `wait`, `timeout …`, `inotifywait`.
pub fn waits_explicitly(action_canonical: &str) -> bool {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(action_canonical) else {
        return false;
    };
    let Some(command) = map.get("command").and_then(serde_json::Value::as_str) else {
        return false;
    };
    command
        .split([';', '&', '|', '\n', '(', ')'])
        .filter_map(|part| part.split_whitespace().next())
        .any(|word| matches!(word, "sleep" | "wait" | "timeout" | "inotifywait"))
}

/// Whether the model's stated plan (the text beside its call) says it is waiting for
/// something to finish: its repeated checks are then polls, held to the longer threshold.
pub fn plans_to_wait(reasoning: &str) -> bool {
    let r = reasoning.to_ascii_lowercase();
    [
        "waiting for",
        "wait for",
        "wait until",
        "poll",
        "still running",
        "until it finishes",
        "until it is done",
        "check again",
    ]
    .iter()
    .any(|p| r.contains(p))
}

/// The shell command printing, after the workspace fingerprint line, one line per process
/// in the sandbox that was there before the probe (not its ancestors): pid, name and CPU
/// ticks. Its change between probes is activity outside the workspace.
pub fn activity_probe_command() -> &'static str {
    "me=$$; anc=\" $me \"; p=$me; while [ \"$p\" -gt 1 ] 2>/dev/null; do \
       p=$(cut -d' ' -f4 /proc/$p/stat 2>/dev/null) || break; [ -n \"$p\" ] || break; anc=\"$anc$p \"; done; \
     for d in /proc/[0-9]*; do q=${d#/proc/}; [ \"$q\" -gt 1 ] && [ \"$q\" -lt \"$me\" ] || continue; \
       case \"$anc\" in *\" $q \"*) continue;; esac; \
       set -- $(cat $d/stat 2>/dev/null); [ $# -ge 15 ] && echo \"proc $q $2 $(($14+$15))\"; done; true"
}

/// The shell command whose output fingerprints the workspace's content: file hashes (for files
/// up to 2 MiB) and sizes of bigger ones. Content, not mtimes: rewriting a file with the same
/// bytes is not progress.
pub fn probe_command(workdir: &str) -> String {
    let dir = super::tools::shell_quote(workdir);
    format!(
        "cd {dir} 2>/dev/null || exit 0; \
         {{ find . -xdev -type f -size -2048k -exec md5sum {{}} + 2>/dev/null | sort; \
            find . -xdev -type f -size +2047k -exec ls -l {{}} + 2>/dev/null | sort; }} | md5sum"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(d: &mut Detector, n: u64, action: &str, obs: &str, ws: Option<&str>) -> Option<Stuck> {
        d.observe(Detector::print(n, action, obs, ws.map(str::to_owned)))
    }

    fn bash(command: &str) -> String {
        serde_json::json!({"tool": "bash", "command": command}).to_string()
    }

    #[test]
    fn explicit_waits_are_recognized() {
        assert!(waits_explicitly(&bash("sleep 2; cat status")));
        assert!(waits_explicitly(&bash("make & wait")));
        assert!(waits_explicitly(&bash("timeout 5 tail -f log")));
        assert!(!waits_explicitly(&bash("cat sleep.txt")));
        assert!(!waits_explicitly(&bash("echo waiting")));
        assert!(!waits_explicitly(r#"{"tool":"read_file","path":"sleep"}"#));
    }

    #[test]
    fn a_stated_plan_to_wait_is_recognized() {
        assert!(plans_to_wait(
            "The build is still running; I will poll its log."
        ));
        assert!(plans_to_wait("Waiting for the server to come up"));
        assert!(!plans_to_wait("The file is missing, let me read it"));
    }

    #[test]
    fn a_warning_comes_one_step_before_the_stop() {
        let mut d = Detector::new(DetectorConfig::default(), DetectorState::default());
        let a = bash("cat x");
        let mut verdicts = Vec::new();
        for n in 1..=4 {
            verdicts.push(d.judge(Detector::print(n, &a, "No such file", Some("w".into()))));
        }
        assert_eq!(verdicts[0], Verdict::Fine);
        assert_eq!(verdicts[1], Verdict::Fine);
        assert!(
            matches!(&verdicts[2], Verdict::Warning(w) if w.contains("One more")),
            "{verdicts:?}"
        );
        assert_eq!(verdicts[3], Verdict::Stuck(Stuck::Repeating { times: 4 }));
    }

    #[test]
    fn a_busy_background_job_and_changing_activity_are_progress() {
        let mut d = Detector::new(DetectorConfig::default(), DetectorState::default());
        let a = bash("cat status");
        for n in 1..=8 {
            let mut p = Detector::print(n, &a, "waiting", Some("w".into()));
            p.busy = n <= 6;
            assert_eq!(d.observe(p), None, "step {n}");
        }
        // Activity changing (CPU time of a process) counts too; once it stops, so does the run.
        let mut d = Detector::new(DetectorConfig::default(), DetectorState::default());
        for n in 1..=10u64 {
            let mut p = Detector::print(n, &a, "waiting", Some("w".into()));
            p.activity = Some(format!("proc 7 make {}", n.min(5)));
            let v = d.observe(p);
            if n < 8 {
                assert_eq!(v, None, "step {n}");
            } else {
                // Four identical steps since the last change (step 5, exclusive).
                assert!(v.is_some(), "step {n}: activity stopped at step 5");
            }
        }
        // Explicit waits get the longer threshold.
        let mut d = Detector::new(DetectorConfig::default(), DetectorState::default());
        let w = bash("sleep 1; cat status");
        let stops: Vec<u64> = (1..=20)
            .filter(|n| {
                d.observe(Detector::print(*n, &w, "waiting", Some("w".into())))
                    .is_some()
            })
            .collect();
        assert_eq!(stops.first(), Some(&12));
    }

    #[test]
    fn a_stuck_loop_is_caught() {
        let mut d = Detector::default();
        assert_eq!(step(&mut d, 1, "cat x", "No such file", None), None);
        assert_eq!(step(&mut d, 2, "cat x", "No such file", Some("w1")), None);
        assert_eq!(step(&mut d, 3, "cat x", "No such file", Some("w1")), None);
        assert_eq!(
            step(&mut d, 4, "cat x", "No such file", Some("w1")),
            Some(Stuck::Repeating { times: 4 })
        );
    }

    #[test]
    fn polling_while_the_workspace_changes_is_not_stuck() {
        let mut d = Detector::default();
        for n in 1..=10 {
            let ws = format!("w{n}");
            assert_eq!(
                step(&mut d, n, "check done", "waiting", Some(&ws)),
                None,
                "step {n}"
            );
        }
    }

    #[test]
    fn changing_output_is_not_stuck() {
        let mut d = Detector::default();
        for n in 1..=10 {
            assert_eq!(
                step(
                    &mut d,
                    n,
                    "cat progress",
                    &format!("{}% done", n * 10),
                    None
                ),
                None
            );
        }
    }

    #[test]
    fn near_duplicates_count_as_the_same() {
        let mut d = Detector::default();
        let mut verdict = None;
        for n in 1..=4 {
            let obs = format!(
                "error: build failed at 12:00:{n:02} after 0.{n}3s\nsee log id deadbeef{n:04}\n{}",
                "same line of context\n".repeat(20)
            );
            verdict = step(&mut d, n, "make", &obs, Some("w"));
        }
        assert_eq!(verdict, Some(Stuck::Repeating { times: 4 }));
    }

    #[test]
    fn alternation_is_caught() {
        let mut d = Detector::default();
        let mut verdict = None;
        for n in 1..=6 {
            verdict = if n % 2 == 1 {
                step(&mut d, n, "git checkout a", "Switched to a", Some("w"))
            } else {
                step(&mut d, n, "git checkout b", "Switched to b", Some("w"))
            };
        }
        assert_eq!(verdict, Some(Stuck::Alternating { cycles: 3 }));
    }

    #[test]
    fn changing_test_counts_are_progress() {
        // A long test log where only the counts change: near-duplicates by their words, so
        // only the test-count signal tells progress from a stuck loop.
        let log = |passed: u64| {
            let body: String = (0..200)
                .map(|i| format!("tests/test_mod_{i}.py::test_case_{i} PASSED\n"))
                .collect();
            format!(
                "{body}== {passed} passed, {} failed in 0.2s ==",
                10 - passed
            )
        };
        let mut d = Detector::default();
        for n in 1..=6 {
            assert_eq!(
                step(&mut d, n, "make test", &log(n), Some("w")),
                None,
                "step {n}"
            );
        }
        // The same log with counts that do not move is a stuck loop.
        let mut d = Detector::default();
        let verdicts: Vec<_> = (1..=6)
            .map(|n| step(&mut d, n, "make test", &log(3), Some("w")))
            .collect();
        assert!(verdicts.iter().any(Option::is_some), "{verdicts:?}");
        assert_eq!(
            test_counts("== 3 passed, 1 failed in 0.2s =="),
            vec!["3 passed", "1 failed"]
        );
    }

    #[test]
    fn probes_only_for_repeated_actions() {
        let mut d = Detector::default();
        assert!(!d.wants_probe("ls"));
        step(&mut d, 1, "ls", "a", None);
        assert!(d.wants_probe("ls"));
        assert!(!d.wants_probe("pwd"));
    }

    #[test]
    fn normalization_keeps_small_numbers() {
        assert_eq!(
            normalize("took 0.31s at 12:01:02 pid 123456"),
            "took # at # pid #"
        );
        assert_eq!(normalize("3 passed"), "3 passed");
    }
}
