//! Density: a fresh daemon filled with live process-tier sandboxes, its RSS and the PSS of its
//! whole process tree measured, execs across all of them, then emptied.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sandbox_tests::{process_sandbox, proto, rss_bytes, Daemon};

use crate::cli::Plan;
use crate::results::{Density, HostMemory, Key, Report};
use crate::sandboxes::{exec_true, Sandboxes};

/// PSS of `root` and every process below it, and how many processes that is.
fn pss_of_tree(root: u32) -> Option<(u64, usize)> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name may hold spaces and parentheses: the fields start after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let (mut total, mut count, mut todo) = (0u64, 0usize, vec![root]);
    while let Some(pid) = todo.pop() {
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        if let Some(kb) = rollup.lines().find(|l| l.starts_with("Pss:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok()) {
            total += kb * 1024;
        }
        count += 1;
        todo.extend(children.get(&pid).into_iter().flatten());
    }
    Some((total, count))
}

/// The host's memory in use (MemTotal − MemAvailable of /proc/meminfo), and the kernel's own
/// parts of it that a sandbox adds to: unreclaimable slab (cgroups, mounts, namespaces, and each
/// memory cgroup's per-shrinker maps), page tables, kernel stacks.
fn host_memory() -> Option<HostMemory> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = |key: &str| info.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok());
    Some(HostMemory {
        used: kb("MemTotal:")?.saturating_sub(kb("MemAvailable:")?) * 1024,
        slab_unreclaimable: kb("SUnreclaim:")? * 1024,
        page_tables: kb("PageTables:")? * 1024,
        kernel_stacks: kb("KernelStack:")? * 1024,
    })
}

/// [`host_memory`] once it holds still: read every half second until two readings in a row are
/// within 1 MiB of each other (at most 30 s). What the host frees after earlier work (a previous
/// daemon's cgroups, deferred frees) would otherwise land in the difference as noise of ±0.1 MiB
/// per sandbox.
async fn settled_host_memory() -> Option<HostMemory> {
    let mut last = host_memory()?;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = host_memory()?;
        if now.used.abs_diff(last.used) < 1 << 20 {
            return Some(now);
        }
        last = now;
    }
    Some(last)
}

/// An idle sandbox as an agent framework keeps many: the default image with small limits, so
/// the daemon's admission (memory, pids and disk promised against the host's) takes thousands.
fn idle_sandbox() -> proto::CreateSandboxRequest {
    let limits = proto::ResourceLimits { memory_bytes: 64 << 20, max_pids: 32, disk_bytes: 64 << 20, ..Default::default() };
    proto::CreateSandboxRequest { limits: Some(limits), ..process_sandbox("minimal") }
}

async fn fill_and_measure(sb: &mut Sandboxes, pid: Option<u32>, plan: &Plan, report: &mut Report) -> Result<Density> {
    let rss_idle = pid.and_then(rss_bytes);
    let host_before = settled_host_memory().await;
    let mut ids = Vec::with_capacity(plan.live);
    let mut creates = Vec::with_capacity(plan.live);
    let t = Instant::now();
    for i in 0..plan.live {
        let (id, took) = sb.create_with(idle_sandbox(), &format!("live sandbox {} of {}", i + 1, plan.live)).await?;
        ids.push(id);
        creates.push(took);
    }
    let create_total = t.elapsed();
    // Let the inits, spares and the kernel settle, so nothing is caught mid-fault.
    let host_live = settled_host_memory().await;
    let rss_live = pid.and_then(rss_bytes);
    let pss_tree = pid.and_then(pss_of_tree);
    let host_used = host_before.zip(host_live);
    report.measured(Key::LiveCreate, &creates);

    let mut execs = Vec::with_capacity(ids.len() * 3);
    for round in 0..3 {
        for id in &ids {
            execs.push(exec_true(&sb.client, id, &format!("round {round} across {} live", ids.len())).await?);
        }
    }
    report.measured(Key::LiveExec, &execs);
    // Idle again, now as sandboxes that have run commands: what their inits and the kernel kept.
    let host_after_execs = settled_host_memory().await;

    let mut destroys = Vec::with_capacity(ids.len());
    let t = Instant::now();
    for id in &ids {
        destroys.push(sb.destroy(id).await?);
    }
    let destroy_total = t.elapsed();
    report.measured(Key::LiveDestroy, &destroys);
    let rss_after = pid.and_then(rss_bytes);
    Ok(Density { live: plan.live, rss_idle, rss_live, pss_tree, host_used, host_after_execs, create_total, destroy_total, rss_after })
}

/// Section 4, on a fresh daemon so that its RSS is not that of the latency runs.
pub(crate) async fn sandboxd_density(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys = [Key::LiveCreate, Key::LiveExec, Key::LiveDestroy];
    eprintln!("bench: sandboxd {} live sandboxes", plan.live);
    // The policy's sandbox counts (4096, 2048 per tenant by default) raised to what is asked.
    let config = format!("[policy]\nmax_sandboxes = {n}\nmax_sandboxes_per_tenant = {n}\n", n = plan.live.max(4096));
    let daemon = match Daemon::start_with_config(&config).await.context("starting sandboxd for the density section") {
        Ok(d) => d,
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            return report.failed(&keys, &e);
        }
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            return report.failed(&keys, &e);
        }
    };
    let mut sb = Sandboxes::new(client);
    let result = fill_and_measure(&mut sb, daemon.pid(), plan, report).await;
    sb.cleanup().await;
    match result {
        Ok(d) => report.density = Some(Ok(d)),
        Err(e) => {
            report.density = Some(Err(format!("{e:#}")));
            report.failed_unless_done(&keys, &e);
        }
    }
    drop(daemon);
    report.section_times.push(("sandboxd density".into(), started.elapsed()));
}
