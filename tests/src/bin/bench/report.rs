//! The markdown report: its tables and paragraphs, and BENCHMARKS.md, whose sections written by
//! other benches are carried over when the file is rewritten.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cli::Plan;
use crate::docker::{docker_socket, DOCKER_IMAGE};
use crate::latency::EXEC_GAP;
use crate::machine::Machine;
use crate::microvm::{KVM_TRY_BOOT_TIMEOUT_MS, LOG_BOOTED, LOG_POOL_READY, LOG_POOL_TAKEN, MICROVM_LOG_DIRECTIVE};
use crate::results::{HostMemory, Key, Outcome, Report};
use crate::snapshots::{CHANGED_LARGE_MIB, CHANGED_SMALL_MIB, FORK_BATCH};
use crate::stats::{mib, mib_of, ms, p50_of};
use crate::targets::targets;
use crate::throughput::THROUGHPUT_SANDBOXES;

/// A text on one line (for a paragraph, which a newline would break).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Markdown table cells can hold neither newlines nor pipes.
fn cell(s: &str) -> String {
    let one_line = one_line(s);
    let short: String = if one_line.chars().count() > 160 { one_line.chars().take(160).chain("…".chars()).collect() } else { one_line };
    short.replace('|', "\\|")
}

/// One row of a latency table: n, p50, p99, mean, max, or why there are none.
fn table_row(w: &mut String, report: &Report, key: Key, plan: &Plan) {
    let label = key.label(plan.live);
    match report.rows.get(&key) {
        Some(Outcome::Measured(s)) => {
            let _ = writeln!(w, "| {label} | {} | {} | {} | {} | {} |", s.n, ms(s.p50), ms(s.p99), ms(s.mean), ms(s.max));
        }
        Some(Outcome::Unavailable(why)) => {
            let _ = writeln!(w, "| {label} | — | unavailable | | | {} |", cell(why));
        }
        Some(Outcome::Failed(why)) => {
            let _ = writeln!(w, "| {label} | — | **FAILED** | | | {} |", cell(why));
        }
        None => {
            let _ = writeln!(w, "| {label} | — | not run | | | |");
        }
    }
}

/// The `## microVM tier` section: how the guests ran, the rows, what the daemon logged.
fn render_microvm(w: &mut String, report: &Report, plan: &Plan) {
    let vm = &report.microvm;
    let _ = writeln!(w, "\n## microVM tier\n");
    if let Some(why) = &vm.unavailable {
        let _ = writeln!(w, "**Unavailable on this host**: {}\n", cell(why));
    }
    let _ = writeln!(
        w,
        "Each sandbox is a QEMU `microvm` guest with its own kernel (`ISOLATION_MICROVM`, image \
         `minimal`, default limits). Milliseconds of wall time per API call, as the client sees it."
    );
    match vm.auto_accel {
        Some(accel) => {
            let _ = writeln!(
                w,
                "\nThe daemon left at `accel = \"auto\"` ran its guests under **{}**; it logged: {}. \
                 Every row below that names no accelerator ran on that daemon (the warm pool on one \
                 like it).\n",
                accel.name(),
                if vm.accel_log.is_empty() {
                    "nothing about KVM or TCG".to_string()
                } else {
                    vm.accel_log.iter().map(|l| format!("`{}`", one_line(l).replace('`', "'"))).collect::<Vec<_>>().join("; ")
                }
            );
        }
        None => {
            let _ = writeln!(w);
        }
    }
    if let Some(forced) = &vm.kvm_forced {
        let _ = writeln!(
            w,
            "KVM is unusable on this host: {}; then {}.\n",
            vm.kvm_reason.as_deref().map(one_line).unwrap_or_else(|| "the daemon left at `accel = \"auto\"` chose TCG".into()),
            one_line(forced)
        );
    }
    let _ = writeln!(w, "| measurement | n | p50 ms | p99 ms | mean ms | max ms |\n|---|---:|---:|---:|---:|---:|");
    for key in Key::MICROVM {
        table_row(w, report, key, plan);
    }
    let mut notes = Vec::new();
    for (accel, (boot, uptime)) in &vm.boot_logged {
        if let (Some(b), Some(u)) = (p50_of(boot), p50_of(uptime)) {
            notes.push(format!(
                "the daemon's own boot time of the timed cold boots under {} (QEMU started → the guest \
                 agent's hello, `boot_ms` of its `{LOG_BOOTED}` lines): p50 {b}, of which the guest \
                 kernel had been up p50 {u} at the hello",
                accel.name()
            ));
        }
    }
    if let Some(b) = p50_of(&vm.pool_boot_logged) {
        notes.push(format!(
            "the warm pool's {} boots in the background (`boot_ms` of `{LOG_POOL_READY}`): p50 {b}; \
             every timed pool create was checked to be served by the pool (`{LOG_POOL_TAKEN}` for its id)",
            vm.pool_boot_logged.len()
        ));
    }
    if let Some(size) = vm.snapshot_size {
        notes.push(format!("the snapshots' `size_bytes` with {CHANGED_SMALL_MIB} MiB changed, without memory (median): {}", mib_of(size)));
    }
    if let Some(size) = vm.memory_snapshot_size {
        notes.push(format!("the same with memory (disk + the memory file QEMU wrote, median): {}", mib_of(size)));
    }
    if !notes.is_empty() {
        let _ = writeln!(w);
    }
    for note in notes {
        let _ = writeln!(w, "- {note}");
    }
}

pub(crate) fn render(report: &Report, plan: &Plan, machine: &Machine, total: Duration) -> String {
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# sandboxd benchmarks\n");
    let _ = writeln!(
        w,
        "Written by `make bench` (`target/release/bench --out BENCHMARKS.md`) on {}; the run took {:.0} s.{}\n\
         Numbers from one machine do not carry over to another: re-run the bench where it matters.\n",
        machine.date,
        total.as_secs_f64(),
        if plan.quick { " **Quick mode: a smoke run with few samples, not numbers to compare.**" } else { "" }
    );

    let _ = writeln!(w, "## Machine\n");
    let _ = writeln!(w, "| | |\n|---|---|");
    for (k, v) in machine.rows(report) {
        let _ = writeln!(w, "| {k} | {} |", cell(&v));
    }

    let _ = writeln!(w, "\n## Latency\n");
    let _ = writeln!(w, "Milliseconds of wall time per API call, as the client sees it.\n");
    let _ = writeln!(w, "| measurement | n | p50 ms | p99 ms | mean ms | max ms |\n|---|---:|---:|---:|---:|---:|");
    let all_rows = Key::SANDBOXD
        .iter()
        .chain(Key::SNAPSHOTS.iter())
        .chain(Key::NO_USERNS.iter())
        .chain(Key::FORKS.iter())
        .chain(Key::CONTAINER.iter())
        .chain(Key::DOCKER.iter());
    for key in all_rows {
        table_row(w, report, *key, plan);
    }
    if !report.snapshot_sizes.is_empty() {
        let sizes: Vec<String> = Key::SNAPSHOTS
            .iter()
            .filter_map(|k| match (k, report.snapshot_sizes.get(k)) {
                (Key::Snapshot(image, mib), Some(size)) => Some(format!("{} with {mib} MiB changed: {}", image.name(), mib_of(*size))),
                _ => None,
            })
            .collect();
        let _ = writeln!(w, "\nThe snapshots' `size_bytes` as the daemon reported them (median): {}.", sizes.join("; "));
    }

    let _ = writeln!(w, "\n## Exec throughput\n");
    if report.throughput.is_empty() {
        let _ = writeln!(w, "not run");
    } else {
        let _ = writeln!(
            w,
            "Unary `Exec` of `true` spread round-robin over {THROUGHPUT_SANDBOXES} process-tier sandboxes by \
             concurrent client tasks; execs/s is the count over the wall time from the first send to the \
             last answer, latency is each exec's round trip under that load.\n"
        );
        let _ = writeln!(w, "| concurrency | execs | wall s | execs/s | p50 ms | p99 ms | mean ms | max ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (concurrency, result) in &report.throughput {
            match result {
                Ok(t) => {
                    let _ = writeln!(
                        w,
                        "| {} | {} | {:.2} | {:.0} | {} | {} | {} | {} |",
                        t.concurrency,
                        t.execs,
                        t.wall.as_secs_f64(),
                        t.per_second(),
                        ms(t.latency.p50),
                        ms(t.latency.p99),
                        ms(t.latency.mean),
                        ms(t.latency.max)
                    );
                }
                Err(why) => {
                    let _ = writeln!(w, "| {concurrency} | — | | **FAILED** | | | | {} |", cell(why));
                }
            }
        }
    }

    let _ = writeln!(w, "\n## Density\n");
    match &report.density {
        Some(Ok(d)) => {
            let opt = |v: Option<u64>| v.map(mib).unwrap_or_else(|| "unknown".into());
            let _ = writeln!(
                w,
                "A fresh daemon, then {} process-tier sandboxes (image minimal; memory 64 MiB, 32 pids, disk 64 MiB each) created one after another and kept alive:\n",
                d.live
            );
            let _ = writeln!(
                w,
                "- daemon RSS (VmRSS) idle: {}; with {} live: **{}**; after destroying them all: {}",
                opt(d.rss_idle),
                d.live,
                opt(d.rss_live),
                opt(d.rss_after)
            );
            if let Some((pss, procs)) = d.pss_tree {
                let _ = writeln!(
                    w,
                    "- the daemon and every process under it ({procs} processes: the zygote, and per sandbox its init, and the spare of its next exec in the 256 used last, `[process] spares`) together: {} PSS, {:.2} MiB per sandbox",
                    mib(pss),
                    pss as f64 / (1u64 << 20) as f64 / d.live.max(1) as f64
                );
            }
            if let Some((before, live)) = d.host_used {
                let each = |f: fn(&HostMemory) -> u64| f(&live).saturating_sub(f(&before)) as f64 / (1u64 << 20) as f64 / d.live.max(1) as f64;
                let _ = writeln!(
                    w,
                    "- the host's memory in use (MemTotal − MemAvailable, kernel memory included, each read once it holds still): {} before, {} with {} live: {:.2} MiB per sandbox; \
                     of that, per sandbox, unreclaimable kernel slab {:.2} MiB (cgroups, mounts, namespaces, and each memory cgroup's map of every \
                     shrinker: one per superblock, so it grows with the sandboxes alive, and the kernel keeps its high-water mark until reboot), \
                     page tables {:.2} MiB, kernel stacks {:.2} MiB",
                    mib(before.used),
                    mib(live.used),
                    d.live,
                    each(|m| m.used),
                    each(|m| m.slab_unreclaimable),
                    each(|m| m.page_tables),
                    each(|m| m.kernel_stacks),
                );
                if let Some(after) = d.host_after_execs {
                    let _ = writeln!(
                        w,
                        "- idle again after 3 execs in each: {} in use, {:.2} MiB per sandbox",
                        mib(after.used),
                        after.used.saturating_sub(before.used) as f64 / (1u64 << 20) as f64 / d.live.max(1) as f64
                    );
                }
            }
            let _ = writeln!(
                w,
                "- time to create all {}: {:.2} s ({:.1} ms each on average); to destroy them all: {:.2} s",
                d.live,
                d.create_total.as_secs_f64(),
                d.create_total.as_secs_f64() * 1e3 / d.live.max(1) as f64,
                d.destroy_total.as_secs_f64()
            );
        }
        Some(Err(e)) => {
            let _ = writeln!(w, "**FAILED**: {}", cell(e));
        }
        None => {
            let _ = writeln!(w, "not run");
        }
    }
    if let Some(rss) = report.rss_after_latency {
        let _ = writeln!(w, "- the latency daemon, after its creates, destroys and execs with nothing live: {} RSS", mib(rss));
    }

    render_microvm(w, report, plan);

    let _ = writeln!(w, "\n## Against Docker\n");
    let _ = writeln!(w, "p50 against p50, measured in this run; ratio = Docker ÷ sandboxd.\n");
    let _ = writeln!(w, "| | sandboxd p50 ms | Docker p50 ms | ratio |\n|---|---:|---:|---:|");
    let one_shot = match (report.p50(Key::Create), report.p50(Key::Exec), report.p50(Key::Destroy)) {
        (Some(c), Some(e), Some(d)) => Some(c + e + d),
        _ => None,
    };
    let comparisons = [
        ("a sandbox ready to exec: `CreateSandbox` vs container create+start (`--network none`)", report.p50(Key::Create), report.p50(Key::DockerCreateStart)),
        ("run `true` in it: `Exec` vs `docker exec`", report.p50(Key::Exec), report.p50(Key::DockerExec)),
        ("tear down: `DestroySandbox` vs `rm -f`", report.p50(Key::Destroy), report.p50(Key::DockerRemove)),
        ("one-shot `true`: create+exec+destroy (sum of p50s) vs `docker run --rm`", one_shot, report.p50(Key::DockerRun)),
        (
            "container tier, a sandbox ready to exec: `CreateSandbox` vs container create+start (`--network none`)",
            report.p50(Key::ContainerCreate),
            report.p50(Key::DockerCreateStart),
        ),
        ("container tier, run `true` in it: `Exec` vs `docker exec`", report.p50(Key::ContainerExec), report.p50(Key::DockerExec)),
        ("container tier, tear down: `DestroySandbox` vs `rm -f`", report.p50(Key::ContainerDestroy), report.p50(Key::DockerRemove)),
        (
            "microVM tier, cold: boot to first exec vs container create+start (`--network none`)",
            report.microvm.auto_accel.and_then(|a| report.p50(Key::MicroVmBoot(a))),
            report.p50(Key::DockerCreateStart),
        ),
        (
            "microVM tier, from the warm pool: `CreateSandbox` vs container create+start (`--network none`)",
            report.p50(Key::MicroVmPoolCreate),
            report.p50(Key::DockerCreateStart),
        ),
        ("microVM tier, run `true` in it: `Exec` vs `docker exec`", report.p50(Key::MicroVmExec), report.p50(Key::DockerExec)),
    ];
    for (what, ours, theirs) in comparisons {
        let f = |v: Option<f64>| v.map(ms).unwrap_or_else(|| "unavailable".into());
        let ratio = match (ours, theirs) {
            // A slower sandboxd (a microVM booting) keeps two digits instead of reading 0.0×.
            (Some(o), Some(t)) if o > 0.0 && t / o < 0.1 => format!("{:.2}×", t / o),
            (Some(o), Some(t)) if o > 0.0 => format!("{:.1}×", t / o),
            _ => "—".into(),
        };
        let _ = writeln!(w, "| {what} | {} | {} | {ratio} |", f(ours), f(theirs));
    }

    let _ = writeln!(w, "\n## Targets\n");
    let _ = writeln!(w, "| target | measured | result |\n|---|---|---|");
    for (target, measured, result) in targets(report) {
        let _ = writeln!(w, "| {target} | {} | {result} |", cell(&measured));
    }

    let _ = writeln!(w, "\n## How measured\n");
    let _ = writeln!(
        w,
        "The bench starts the release `sandboxd` ({}) with a state dir of its own and talks to it with \
         `agent-client` over its UNIX socket: one HTTP/2 connection, one call at a time, each sample the wall \
         time of one call from send to complete answer. `CreateSandbox` returns when the sandbox can exec; \
         every exec is checked to have exited 0. Creates are timed apart from their destroys ({} cycles). \
         `GetSandbox` calls, unary execs back to back, unary execs {} ms apart (the pause is not timed: it is \
         an agent thinking between commands) and streamed execs each run in one sandbox; a few untimed \
         calls before each section ({} creates, {} calls) take one-off costs out. Execs are timed both ways \
         because moving a process into a cgroup waits for an RCU grace period, which back-to-back execs \
         often skip and a lone one pays, unless the cgroup hierarchy has `favordynmods` (the daemon's \
         `[exec] favordynmods`, on by default; once set, it was seen to last until reboot on Linux 6.18). The density section uses a second, fresh \
         daemon: it creates {} \
         sandboxes in turn, reads the daemon's VmRSS from /proc/<pid>/status (and the PSS of its whole \
         process tree from /proc/<pid>/smaps_rollup), runs `true` in each sandbox 3 times round-robin, then \
         destroys them; the host's memory in use (/proc/meminfo) is read before the creates, with all live and again \
         after the execs, each time once two readings half a second apart are within 1 MiB. Docker is driven through its Engine API at {} with `bollard` from the \
         same process, so API call is compared with API call: the image `{DOCKER_IMAGE}` is imported from \
         the same `minimal` rootfs (no registry); `run --rm` is create, start, wait, remove; `exec` is what \
         the CLI does (exec create, attached start, inspect for the exit code); containers use `--network none` \
         like a sandbox, except in the row that says otherwise. Percentiles are nearest-rank over the sorted \
         samples, so p99 of fewer than 100 samples is the maximum. The machine has {} CPUs and other work may \
         run beside the bench: the load average before and after is in the table above.",
        machine.sandboxd_bin,
        plan.create,
        EXEC_GAP.as_millis(),
        plan.warmup,
        plan.warmup * 3,
        plan.live,
        docker_socket(),
        machine.nproc,
    );
    let _ = writeln!(
        w,
        "\nSnapshots, forks and exec throughput run on a third fresh daemon. Snapshot and rollback are \
         measured in one process-tier sandbox per image (`minimal`, `debian`) and size ({CHANGED_SMALL_MIB} \
         and {CHANGED_LARGE_MIB} MiB), {} and {} samples, after one untimed round. Each sample, untimed: \
         `dd if=/dev/urandom of=/workspace/blob bs=1M count=N` and `sync` (a fresh write every time, so each \
         snapshot holds N MiB changed since the image, and `sync` keeps the write-back of dirty pages out of \
         the snapshot); then `Snapshot` (timed); then, untimed, the blob is deleted and a new file written; \
         then `Rollback` to the snapshot (timed); then, untimed, an exec checks the blob is back at its full \
         size and the new file gone, and the snapshot is deleted. Forks: one sandbox of `minimal` with \
         {CHANGED_SMALL_MIB} MiB written is snapshotted once; `CreateSandbox{{from_snapshot_id}}` of it and \
         the fork's `DestroySandbox` are timed apart ({} cycles; the first fork is checked to see the \
         origin's file), then {} batches of {FORK_BATCH} forks created one after another are timed as a \
         whole (destroyed untimed after each batch). Exec throughput: {THROUGHPUT_SANDBOXES} sandboxes, \
         a few untimed execs in each, then for each concurrency level C that many tokio tasks share one \
         client connection (HTTP/2 multiplexes their calls) and take the next of N exec numbers until all \
         are done, exec k going to sandbox k mod {THROUGHPUT_SANDBOXES}. The container tier \
         (`ISOLATION_CONTAINER`, image `minimal`) runs on a fourth daemon: one untimed create first (it may \
         import the image into Docker); if that fails the rows say unavailable with the daemon's reason \
         and the bench goes on; otherwise creates and destroys ({} cycles), execs of `true` in one sandbox \
         ({}) and snapshot+rollback with {CHANGED_SMALL_MIB} MiB changed ({}, as above) are timed the same \
         way as for the process tier.{}",
        plan.snap_small,
        plan.snap_large,
        plan.fork,
        plan.fork_batches,
        plan.container_create,
        plan.container_exec,
        plan.container_snap,
        match &report.container_unavailable {
            Some(why) => format!(" In this run the container tier was unavailable: {}.", cell(why)),
            None => String::new(),
        },
    );
    let _ = writeln!(
        w,
        "\nThe microVM tier (`ISOLATION_MICROVM`, image `minimal`, default limits) runs last, on daemons \
         of its own logging JSON with `{MICROVM_LOG_DIRECTIVE}`, so the bench reads from their logs \
         which accelerator the guests used (`accel=` of `{LOG_BOOTED}`) and why (the KVM probe lines). \
         First a daemon left at `accel = \"auto\"`: one untimed boot (it may run the KVM probe), then \
         {} cold boots with no pool, each timed from the `CreateSandbox` call to the answer of the first \
         `Exec` of `true` in the new VM (the create alone is a row too; the destroy is timed apart); \
         every boot must be logged under that accelerator. On the same daemon: unary and streamed execs \
         of `true` in one VM ({} and {}, after untimed ones), snapshot+rollback with \
         {CHANGED_SMALL_MIB} MiB changed ({} samples, as for the process tier; a microVM rollback boots \
         a new VM over the snapshot) and forks (`CreateSandbox{{from_snapshot_id}}` of one snapshot, \
         {} after an untimed one that checks the fork sees the origin's file, each destroyed before \
         the next: first while the origin runs, then again after it is destroyed). Then a daemon \
         forced to the other accelerator boots {} VMs the same way; when that is KVM and its first \
         create fails (boot deadline {KVM_TRY_BOOT_TIMEOUT_MS} ms), the KVM rows say so with the \
         reason. Last a daemon \
         with `--microvm-pool 1`: before each of {} creates (after an untimed one) the bench waits for \
         the log to show the pool holding a booted VM again (`{LOG_POOL_READY}`), times \
         `CreateSandbox` and its first exec, and checks the log says the create took the pooled VM \
         (`{LOG_POOL_TAKEN}`); the pool's refill boots in the background meanwhile, as it would in \
         use. A host that cannot run the tier at all (FAILED_PRECONDITION: no QEMU, no VM artifacts) \
         marks its rows unavailable.",
        plan.microvm_boot, plan.microvm_exec, plan.microvm_stream, plan.microvm_snap, plan.microvm_fork, plan.microvm_boot, plan.microvm_pool,
    );
    let _ = writeln!(
        w,
        "\nTime per section: {}.",
        report.section_times.iter().map(|(s, d)| format!("{s} {:.1} s", d.as_secs_f64())).collect::<Vec<_>>().join(", ")
    );
    md
}

/// The level-2 sections of a markdown text, verbatim, each from its heading to the next level-2
/// heading or the end of the text, with its heading line.
fn sections(text: &str) -> Vec<(&str, &str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    let mut current: Option<(&str, usize)> = None;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let heading = line.trim_end();
        if heading.starts_with("## ") {
            if let Some((h, s)) = current.take() {
                out.push((h, &text[s..offset]));
            }
            current = Some((heading, offset));
        }
        offset += line.len();
    }
    if let Some((h, s)) = current {
        out.push((h, &text[s..]));
    }
    out
}

/// The sections of an earlier file that this report does not write (the agent loop's, the
/// images', transfers', restart's, E2B's, egress' and fleet's: other benches write those into
/// the same file), verbatim and in their order, as the end of the new file.
fn kept_sections(old: &str, new: &str) -> String {
    let ours: Vec<&str> = sections(new).into_iter().map(|(h, _)| h).collect();
    sections(old).into_iter().filter(|(h, _)| !ours.contains(h)).map(|(_, body)| section_tail(body)).collect()
}

/// A kept section as the end of the file: one blank line before it, one newline after.
fn section_tail(section: &str) -> String {
    format!("\n{}\n", section.trim_end())
}

/// Writes the report `md` to `out`, carrying over the sections of an earlier file there that
/// other benches wrote (see [`kept_sections`]).
pub(crate) fn write(out: &Path, md: String) -> Result<()> {
    let kept = std::fs::read_to_string(out).map(|old| kept_sections(&old, &md)).unwrap_or_default();
    let text = if kept.is_empty() { md } else { format!("{}\n{kept}", md.trim_end()) };
    std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("bench: wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_benches_sections_are_kept_verbatim_and_ours_replaced() {
        let old = "# sandboxd benchmarks\n\n## Latency\n\nold rows\n\n## Agent loop\n\n| a | b |\n### sub\nmore\n\n## Egress\ne rows\n";
        let new = "# sandboxd benchmarks\n\n## Latency\n\nnew rows\n";
        assert_eq!(kept_sections(old, new), "\n## Agent loop\n\n| a | b |\n### sub\nmore\n\n## Egress\ne rows\n");
        let sections = sections(old);
        assert_eq!(sections.iter().map(|(h, _)| *h).collect::<Vec<_>>(), ["## Latency", "## Agent loop", "## Egress"]);
        assert_eq!(sections[1].1, "## Agent loop\n\n| a | b |\n### sub\nmore\n\n");
        // A heading that only starts like one of ours is another bench's.
        assert_eq!(kept_sections("## Latency\nx\n## Latency tails\ny\n", new), "\n## Latency tails\ny\n");
        assert_eq!(kept_sections(new, new), "");
    }

    #[test]
    fn cells_stay_on_one_line() {
        assert_eq!(cell("a |b\nc"), "a \\|b c");
        assert_eq!(cell("line one\nline two"), "line one line two");
    }
}
