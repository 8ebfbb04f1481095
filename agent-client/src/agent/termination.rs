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
        }
    }

    /// Records a step and says whether the run is stuck.
    pub fn observe(&mut self, print: StepPrint) -> Option<Stuck> {
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
        let k = self.cfg.repeat;
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
        let mut d = Detector::default();
        for n in 1..=6 {
            let obs = format!("{} passed, {} failed", n, 10 - n);
            assert_eq!(step(&mut d, n, "make test", &obs, Some("w")), None);
        }
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
