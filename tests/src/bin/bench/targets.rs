//! The targets of the issues (foundation, snapshots, container tier, microVM tier), and what
//! this run says of each: PASS, MISS or not measured.

use crate::latency::EXEC_GAP;
use crate::results::{Image, Key, Outcome, Report, VmAccel};
use crate::snapshots::CHANGED_SMALL_MIB;
use crate::stats::{mib, ms, signed_ms};

/// Targets from the issues (foundation, snapshots, container tier).
const TARGET_CREATE_P50_MS: f64 = 20.0;
const TARGET_EXEC_P50_MS: f64 = 3.0;
pub(crate) const TARGET_LIVE: usize = 100;
const TARGET_RSS_BYTES: u64 = 100 << 20;
const TARGET_SNAPSHOT_P50_MS: f64 = 20.0;
const TARGET_ROLLBACK_P50_MS: f64 = 30.0;
/// How much slower snapshot and rollback may be over a 100× larger image (same bytes changed).
const TARGET_LARGE_IMAGE_FACTOR: f64 = 2.0;
/// How much a fork may cost beyond a plain create.
const TARGET_FORK_OVER_CREATE_MS: f64 = 10.0;
/// Container tier against the raw Docker API calls for the same work.
const TARGET_CONTAINER_VS_DOCKER: f64 = 1.1;
const TARGET_CONTAINER_ROLLBACK_P50_MS: f64 = 300.0;
/// Issue 28: a container-tier exec started through the exec channel.
const TARGET_CONTAINER_EXEC_P50_MS: f64 = 5.0;
/// Issue 28 on the process tier: exec (back to back and after a pause), create, and snapshot /
/// rollback with a small change, near the kernel's floor.
const TARGET_FLOOR_EXEC_P50_MS: f64 = 2.0;
const TARGET_FLOOR_CREATE_P50_MS: f64 = 5.0;
const TARGET_FLOOR_SNAPSHOT_P50_MS: f64 = 10.0;
const TARGET_FLOOR_ROLLBACK_P50_MS: f64 = 20.0;
/// Issue 28's density: this many idle process sandboxes at once, each costing the host at most
/// this much memory (kernel memory included), and an exec among them answered within this.
const TARGET_FLOOR_LIVE: usize = 5000;
const TARGET_FLOOR_HOST_BYTES_PER_SANDBOX: f64 = (1u64 << 20) as f64;
const TARGET_FLOOR_LIVE_EXEC_P50_MS: f64 = 5.0;
/// MicroVM tier: boot to first exec without a pool, under TCG and under KVM; exec round trip;
/// `CreateSandbox` served from the warm pool.
const TARGET_MICROVM_TCG_BOOT_P50_MS: f64 = 2500.0;
const TARGET_MICROVM_KVM_BOOT_P50_MS: f64 = 300.0;
const TARGET_MICROVM_EXEC_P50_MS: f64 = 20.0;
const TARGET_MICROVM_POOL_CREATE_P50_MS: f64 = 100.0;
/// Issue #29: rollback to and fork of a memory snapshot (a resume, no boot), under TCG too.
const TARGET_MICROVM_RESUME_P50_MS: f64 = 200.0;

/// (target, what was measured, PASS / MISS / not measured) for each target of the issue.
pub(crate) fn targets(report: &Report) -> Vec<(String, String, String)> {
    let verdict = |ok: bool| {
        if ok {
            "PASS".to_string()
        } else {
            "**MISS**".to_string()
        }
    };
    let mut out = Vec::new();
    let t = format!("`CreateSandbox` p50 ≤ {TARGET_CREATE_P50_MS} ms");
    out.push(match report.p50(Key::Create) {
        Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= TARGET_CREATE_P50_MS)),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("exec round trip p50 ≤ {TARGET_EXEC_P50_MS} ms");
    let gap = EXEC_GAP.as_millis();
    out.push(match (report.p50(Key::Exec), report.p50(Key::ExecSpaced)) {
        (Some(p), Some(spaced)) => {
            let measured = format!("{} ms back to back; {} ms with {gap} ms between execs (unary `Exec` of `true`)", ms(p), ms(spaced));
            let result = match (p <= TARGET_EXEC_P50_MS, spaced <= TARGET_EXEC_P50_MS) {
                (true, true) => "PASS".to_string(),
                (true, false) => format!("PASS back to back, **MISS** {gap} ms apart"),
                (false, true) => format!("**MISS** back to back, PASS {gap} ms apart"),
                (false, false) => "**MISS**".to_string(),
            };
            (t, measured, result)
        }
        (Some(p), None) => (t, format!("{} ms back to back (unary `Exec` of `true`)", ms(p)), verdict(p <= TARGET_EXEC_P50_MS)),
        _ => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("{TARGET_LIVE} live sandboxes, daemon RSS < {}", mib(TARGET_RSS_BYTES));
    out.push(match &report.density {
        Some(Ok(d)) if d.live >= TARGET_LIVE => match d.rss_live {
            Some(rss) => (t, format!("{} with {} live", mib(rss), d.live), verdict(rss < TARGET_RSS_BYTES)),
            None => (t, "RSS unreadable".into(), "not measured".into()),
        },
        Some(Ok(d)) => (t, format!("only {} live in this run ({})", d.live, d.rss_live.map(mib).unwrap_or_default()), "not measured".into()),
        Some(Err(e)) => (t, format!("failed: {e}"), "**MISS**".into()),
        None => (t, "not run".into(), "not measured".into()),
    });

    // Snapshots (issue 3): absolute targets with a small change over the small image...
    let small = CHANGED_SMALL_MIB;
    for (op, key, target) in [
        ("`Snapshot`", Key::Snapshot(Image::Minimal, small), TARGET_SNAPSHOT_P50_MS),
        ("`Rollback`", Key::Rollback(Image::Minimal, small), TARGET_ROLLBACK_P50_MS),
    ] {
        let t = format!("{op} p50 ≤ {target} ms with {small} MiB changed (image minimal)");
        out.push(match report.p50(key) {
            Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= target)),
            None => (t, "not measured".into(), "not measured".into()),
        });
    }
    // ...and the same change over a 100× larger image costs at most twice as much.
    for (op, large, base) in [
        ("`Snapshot`", Key::Snapshot(Image::Debian, small), Key::Snapshot(Image::Minimal, small)),
        ("`Rollback`", Key::Rollback(Image::Debian, small), Key::Rollback(Image::Minimal, small)),
    ] {
        let t = format!(
            "{op} over the 100× larger image within {TARGET_LARGE_IMAGE_FACTOR}× of the small one \
             (p50, debian vs minimal, {small} MiB changed)"
        );
        out.push(match (report.p50(large), report.p50(base)) {
            (Some(l), Some(b)) => {
                let ratio = l / b.max(1e-9);
                (t, format!("{} ms vs {} ms: {ratio:.2}×", ms(l), ms(b)), verdict(ratio <= TARGET_LARGE_IMAGE_FACTOR))
            }
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    let t = format!("fork p50 ≤ `CreateSandbox` p50 + {TARGET_FORK_OVER_CREATE_MS} ms");
    out.push(match (report.p50(Key::Fork), report.p50(Key::Create)) {
        (Some(f), Some(c)) => (t, format!("fork {} ms, create {} ms: {} ms", ms(f), ms(c), signed_ms(f - c)), verdict(f <= c + TARGET_FORK_OVER_CREATE_MS)),
        _ => (t, "not measured".into(), "not measured".into()),
    });

    // Issue 28: the process tier near the kernel's floor.
    for (what, key, target) in [
        ("`Exec` of `true` back to back", Key::Exec, TARGET_FLOOR_EXEC_P50_MS),
        ("`Exec` of `true` 100 ms apart", Key::ExecSpaced, TARGET_FLOOR_EXEC_P50_MS),
        ("`CreateSandbox`", Key::Create, TARGET_FLOOR_CREATE_P50_MS),
    ] {
        let t = format!("issue 28: {what} p50 ≤ {target} ms");
        out.push(match report.p50(key) {
            Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= target)),
            None => (t, "not measured".into(), "not measured".into()),
        });
    }
    for (op, key, target) in [
        ("Snapshot", Key::Snapshot(Image::Minimal, small), TARGET_FLOOR_SNAPSHOT_P50_MS),
        ("Rollback", Key::Rollback(Image::Minimal, small), TARGET_FLOOR_ROLLBACK_P50_MS),
    ] {
        let t = format!("issue 28: `{op}` p50 ≤ {target} ms with {small} MiB changed (image minimal)");
        out.push(match report.p50(key) {
            Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= target)),
            None => (t, "not measured".into(), "not measured".into()),
        });
    }

    let t = format!(
        "issue 28: {TARGET_FLOOR_LIVE} idle sandboxes live, ≤ {} of host memory each, `Exec` among them p50 ≤ {TARGET_FLOOR_LIVE_EXEC_P50_MS} ms",
        mib(TARGET_FLOOR_HOST_BYTES_PER_SANDBOX as u64)
    );
    out.push(match &report.density {
        Some(Ok(d)) => {
            // The worse of the two idle readings: freshly created, and after running commands.
            let each = d.host_used.as_ref().map(|(before, live)| {
                let after = d.host_after_execs.map_or(live.used, |a| a.used.max(live.used));
                after.saturating_sub(before.used) as f64 / d.live.max(1) as f64
            });
            let exec = report.p50(Key::LiveExec);
            let measured = format!(
                "{} live: {} each (the worse of fresh and after execs), exec {}",
                d.live,
                each.map(|b| format!("{:.2} MiB", b / (1u64 << 20) as f64)).unwrap_or_else(|| "host memory unreadable".into()),
                exec.map(|p| format!("{} ms", ms(p))).unwrap_or_else(|| "not measured".into())
            );
            match (d.live >= TARGET_FLOOR_LIVE, each, exec) {
                (false, _, _) => (t, format!("{measured} (`--live {TARGET_FLOOR_LIVE}` measures it)"), "not measured".into()),
                (true, Some(each), Some(exec)) => (t, measured, verdict(each <= TARGET_FLOOR_HOST_BYTES_PER_SANDBOX && exec <= TARGET_FLOOR_LIVE_EXEC_P50_MS)),
                (true, _, _) => (t, measured, "not measured".into()),
            }
        }
        Some(Err(e)) => (t, format!("failed: {e}"), "**MISS**".into()),
        None => (t, "not run".into(), "not measured".into()),
    });

    // Container tier (issue 4).
    for (what, ours, theirs) in
        [("container tier `CreateSandbox`", Key::ContainerCreate, Key::DockerCreateStart), ("container tier `Exec`", Key::ContainerExec, Key::DockerExec)]
    {
        let t = format!(
            "{what} p50 within {TARGET_CONTAINER_VS_DOCKER}× of the raw Docker calls ({})",
            match theirs {
                Key::DockerCreateStart => "create+start",
                _ => "`docker exec`",
            }
        );
        out.push(match (report.p50(ours), report.p50(theirs)) {
            (Some(o), Some(d)) => {
                let ratio = o / d.max(1e-9);
                (t, format!("{} ms vs Docker {} ms: {ratio:.2}×", ms(o), ms(d)), verdict(ratio <= TARGET_CONTAINER_VS_DOCKER))
            }
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    // Issue 28: a container create at most half of Docker's create+start, from the warm pool.
    let t = "issue 28: container tier `CreateSandbox` from the warm pool p50 ≤ half of Docker's create+start".to_string();
    out.push(match (report.p50(Key::ContainerPoolCreate), report.p50(Key::DockerCreateStart)) {
        (Some(o), Some(d)) => (t, format!("{} ms vs Docker {} ms: {:.2}×", ms(o), ms(d), o / d.max(1e-9)), verdict(o <= d / 2.0)),
        _ => (t, "not measured".into(), "not measured".into()),
    });
    // Issue 28: execs started by the container's own exec helper, not Docker's exec API.
    let t = format!("container tier `Exec` p50 ≤ {TARGET_CONTAINER_EXEC_P50_MS} ms");
    out.push(match report.p50(Key::ContainerExec) {
        Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= TARGET_CONTAINER_EXEC_P50_MS)),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("container tier `Rollback` p50 ≤ {TARGET_CONTAINER_ROLLBACK_P50_MS} ms ({small} MiB changed)");
    out.push(match report.p50(Key::ContainerRollback) {
        Some(p) => (t, format!("{} ms", ms(p)), verdict(p <= TARGET_CONTAINER_ROLLBACK_P50_MS)),
        None => (t, "not measured".into(), "not measured".into()),
    });

    // MicroVM tier, with Docker's number for the same step of this run beside each.
    let docker = |key: Key, what: &str| match report.p50(key) {
        Some(d) => format!("; Docker {what} p50 {} ms", ms(d)),
        None => String::new(),
    };
    let create_start = docker(Key::DockerCreateStart, "create+start");
    for (accel, target) in [(VmAccel::Tcg, TARGET_MICROVM_TCG_BOOT_P50_MS), (VmAccel::Kvm, TARGET_MICROVM_KVM_BOOT_P50_MS)] {
        let t = format!(
            "microVM boot to first exec under {} p50 ≤ {target} ms (no pool){}",
            accel.name(),
            if accel == VmAccel::Kvm { ", where KVM works" } else { "" }
        );
        let boot = Key::MicroVmBoot(accel);
        out.push(match report.rows.get(&boot) {
            Some(Outcome::Measured(s)) => {
                let create = report.p50(Key::MicroVmCreate(accel)).map(ms);
                (t, format!("{} ms (`CreateSandbox` alone {} ms){create_start}", ms(s.p50), create.unwrap_or_else(|| "?".into())), verdict(s.p50 <= target))
            }
            Some(Outcome::Unavailable(why)) if accel == VmAccel::Kvm => (t, why.clone(), "not measured (no usable KVM)".into()),
            _ => (t, "not measured".into(), "not measured".into()),
        });
    }
    let t = format!("microVM exec round trip p50 ≤ {TARGET_MICROVM_EXEC_P50_MS} ms");
    out.push(match report.p50(Key::MicroVmExec) {
        Some(p) => (
            t,
            format!(
                "{} ms (unary `Exec` of `true`, back to back{}){}",
                ms(p),
                report.microvm.auto_accel.map(|a| format!(", under {}", a.name())).unwrap_or_default(),
                docker(Key::DockerExec, "exec")
            ),
            verdict(p <= TARGET_MICROVM_EXEC_P50_MS),
        ),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("microVM `CreateSandbox` from the warm pool p50 ≤ {TARGET_MICROVM_POOL_CREATE_P50_MS} ms");
    out.push(match report.p50(Key::MicroVmPoolCreate) {
        Some(p) => (t, format!("{} ms{create_start}", ms(p)), verdict(p <= TARGET_MICROVM_POOL_CREATE_P50_MS)),
        None => (t, "not measured".into(), "not measured".into()),
    });
    let t = format!("microVM `CreateSandbox` without a pool (restored from the image's boot snapshot) p50 ≤ {TARGET_MICROVM_RESUME_P50_MS} ms");
    out.push(match report.p50(Key::MicroVmBootSnapshotCreate) {
        Some(p) => {
            let cold =
                report.microvm.auto_accel.and_then(|a| report.p50(Key::MicroVmCreate(a))).map(|b| format!(" (a cold boot: {} ms)", ms(b))).unwrap_or_default();
            (t, format!("{} ms{cold}", ms(p)), verdict(p <= TARGET_MICROVM_RESUME_P50_MS))
        }
        None => (t, "not measured".into(), "not measured".into()),
    });
    for (key, boot, what) in [(Key::MicroVmRollbackMemory, Key::MicroVmRollback, "`Rollback`"), (Key::MicroVmForkMemory, Key::MicroVmFork, "fork")] {
        let t = format!("microVM {what} of a memory snapshot p50 ≤ {TARGET_MICROVM_RESUME_P50_MS} ms");
        out.push(match report.p50(key) {
            Some(p) => {
                let booted = report.p50(boot).map(|b| format!(" (without memory, a boot: {} ms)", ms(b))).unwrap_or_default();
                (t, format!("{} ms{booted}", ms(p)), verdict(p <= TARGET_MICROVM_RESUME_P50_MS))
            }
            None => (t, "not measured".into(), "not measured".into()),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn targets_say_miss_and_not_measured_honestly() {
        let mut report = Report::default();
        report.measured(Key::Create, &[Duration::from_millis(25)]);
        report.measured(Key::Exec, &[Duration::from_millis(2)]);
        report.measured(Key::ExecSpaced, &[Duration::from_millis(9)]);
        let t = targets(&report);
        assert!(t[0].2.contains("MISS"), "{t:?}");
        assert!(t[1].2.starts_with("PASS back to back") && t[1].2.contains("MISS"), "{t:?}");
        assert_eq!(t[2].2, "not measured");
    }

    #[test]
    fn snapshot_and_fork_targets() {
        let mut report = Report::default();
        let ms = |v: u64| [Duration::from_millis(v)];
        report.measured(Key::Create, &ms(10));
        report.measured(Key::Fork, &ms(25));
        report.measured(Key::Snapshot(Image::Minimal, CHANGED_SMALL_MIB), &ms(5));
        report.measured(Key::Snapshot(Image::Debian, CHANGED_SMALL_MIB), &ms(9));
        report.measured(Key::Rollback(Image::Minimal, CHANGED_SMALL_MIB), &ms(31));
        report.measured(Key::Rollback(Image::Debian, CHANGED_SMALL_MIB), &ms(70));
        let t = targets(&report);
        let find =
            |start: &str| t.iter().find(|(target, _, _)| target.starts_with(start)).unwrap_or_else(|| panic!("no target starting {start:?} in {t:?}")).clone();
        assert_eq!(find("`Snapshot` p50").2, "PASS");
        assert_eq!(find("`Rollback` p50").2, "**MISS**");
        let large = find("`Snapshot` over the 100×");
        assert_eq!(large.2, "PASS", "9 ms is 1.8× of 5 ms: {large:?}");
        assert!(large.1.contains("1.80×"), "{large:?}");
        assert_eq!(find("`Rollback` over the 100×").2, "**MISS**");
        let fork = find("fork p50");
        assert_eq!(fork.2, "**MISS**", "25 ms > 10 + 10 ms: {fork:?}");
        assert!(fork.1.ends_with(": +15.0 ms"), "{fork:?}");
        assert_eq!(signed_ms(-2.5), "-2.50");
        // Container rows not measured say so rather than pass or miss.
        assert_eq!(find("container tier `Rollback`").2, "not measured");
    }

    #[test]
    fn microvm_targets_pass_miss_and_say_why_kvm_is_missing() {
        let mut report = Report::default();
        let ms = |v: u64| [Duration::from_millis(v)];
        report.measured(Key::MicroVmBoot(VmAccel::Tcg), &ms(2400));
        report.measured(Key::MicroVmCreate(VmAccel::Tcg), &ms(2300));
        report.measured(Key::MicroVmExec, &ms(25));
        report.measured(Key::MicroVmPoolCreate, &ms(40));
        report.measured(Key::DockerCreateStart, &ms(300));
        report.unavailable(&[Key::MicroVmBoot(VmAccel::Kvm)], "KVM unusable on this host: KVM probe failed");
        let t = targets(&report);
        let find =
            |start: &str| t.iter().find(|(target, _, _)| target.starts_with(start)).unwrap_or_else(|| panic!("no target starting {start:?} in {t:?}")).clone();
        let tcg = find("microVM boot to first exec under TCG");
        assert_eq!(tcg.2, "PASS", "{tcg:?}");
        assert!(tcg.1.contains("Docker create+start p50 300.0 ms"), "{tcg:?}");
        let kvm = find("microVM boot to first exec under KVM");
        assert_eq!(kvm.2, "not measured (no usable KVM)", "{kvm:?}");
        assert!(kvm.1.starts_with("KVM unusable on this host"), "{kvm:?}");
        assert_eq!(find("microVM exec round trip").2, "**MISS**");
        assert_eq!(find("microVM `CreateSandbox` from the warm pool").2, "PASS");
    }
}
