//! Exec throughput: unary execs of `true` by many concurrent tasks over one connection, at each
//! concurrency level of the plan.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agent_client::Client;
use anyhow::{anyhow, Context, Result};

use crate::check_interrupt;
use crate::cli::Plan;
use crate::results::{Report, Throughput};
use crate::sandboxes::{exec_true, Sandboxes};
use crate::stats::summarize;

/// Sandboxes the exec throughput section spreads its execs over.
pub(crate) const THROUGHPUT_SANDBOXES: usize = 8;

/// `execs` unary execs of `true` over `ids` by `concurrency` tasks sharing one client.
async fn throughput_level(client: &Client, ids: &Arc<Vec<String>>, concurrency: usize, execs: usize) -> Result<Throughput> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..concurrency {
        let (client, ids, next) = (client.clone(), Arc::clone(ids), Arc::clone(&next));
        tasks.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= execs {
                    return Ok::<_, anyhow::Error>(samples);
                }
                let id = &ids[k % ids.len()];
                let what = format!("exec {k} of {execs} at concurrency {concurrency}");
                samples.push(exec_true(&client, id, &what).await?);
            }
        });
    }
    let mut samples = Vec::with_capacity(execs);
    // The first error ends the level; dropping the JoinSet aborts the other tasks.
    while let Some(joined) = tasks.join_next().await {
        samples.extend(joined.context("an exec task panicked")??);
    }
    let wall = started.elapsed();
    let latency = summarize(&samples).ok_or_else(|| anyhow!("no execs were run"))?;
    Ok(Throughput { concurrency, execs: samples.len(), wall, latency })
}

/// Exec throughput at each concurrency level of the plan, over [`THROUGHPUT_SANDBOXES`]
/// sandboxes made for it.
pub(crate) async fn throughput(sb: &mut Sandboxes, plan: &Plan, report: &mut Report) -> Result<()> {
    let mut ids = Vec::with_capacity(THROUGHPUT_SANDBOXES);
    for i in 0..THROUGHPUT_SANDBOXES {
        let (id, _) = sb.create(&format!("throughput sandbox {i}")).await?;
        for w in 0..plan.warmup {
            exec_true(&sb.client, &id, &format!("warm-up {w} of throughput sandbox {i}")).await?;
        }
        ids.push(id);
    }
    let ids = Arc::new(ids);
    for (concurrency, execs) in plan.throughput {
        eprintln!("bench: sandboxd exec throughput, {execs} execs at concurrency {concurrency}");
        let result = throughput_level(&sb.client, &ids, concurrency, execs).await;
        if let Err(e) = &result {
            eprintln!("bench: FAILED exec throughput at concurrency {concurrency}: {e:#}");
        }
        report.throughput.push((concurrency, result.map_err(|e| format!("{e:#}"))));
        check_interrupt()?;
    }
    for id in ids.iter() {
        sb.destroy(id).await?;
    }
    Ok(())
}
