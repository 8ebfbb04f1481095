//! Process-tier latency: `CreateSandbox` and `DestroySandbox` timed apart, then `GetSandbox`,
//! unary execs back to back and spaced, and streamed execs, each in one sandbox.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sandbox_tests::{rss_bytes, Daemon};

use crate::check_interrupt;
use crate::cli::Plan;
use crate::results::{Key, Report};
use crate::sandboxes::{exec_stream_true, exec_true, Sandboxes};

/// Pause between the execs of the spaced exec row: an agent that thinks between commands.
/// Longer than a few RCU grace periods, so each exec meets the kernel as a lone one would.
pub(crate) const EXEC_GAP: Duration = Duration::from_millis(100);

/// Section 1: create and destroy, timed apart.
pub(crate) async fn create_destroy(sb: &mut Sandboxes, plan: &Plan) -> Result<(Vec<Duration>, Vec<Duration>)> {
    for i in 0..plan.warmup {
        let (id, _) = sb.create(&format!("warm-up {i}")).await?;
        sb.destroy(&id).await?;
    }
    let (mut creates, mut destroys) = (Vec::with_capacity(plan.create), Vec::with_capacity(plan.create));
    for i in 0..plan.create {
        let (id, took) = sb.create(&format!("sample {i} of {}", plan.create)).await?;
        creates.push(took);
        destroys.push(sb.destroy(&id).await?);
    }
    Ok((creates, destroys))
}

/// How the calls of a one-sandbox section are made.
#[derive(Debug, Clone, Copy)]
enum Call {
    /// `GetSandbox`: the daemon's answer without starting any process.
    Get,
    /// `GetSandbox` with [`EXEC_GAP`] of quiet before each (not timed).
    GetSpaced,
    /// Unary `Exec` of `true`, the next as soon as the last has answered.
    Exec,
    /// Unary `Exec` of `true` with [`EXEC_GAP`] of quiet before each (not timed).
    ExecSpaced,
    /// `ExecStream` of `true`, back to back.
    Stream,
}

/// Sections 2 and 3: `n` timed calls in one sandbox, after `warmup` untimed ones.
async fn calls_in_one(sb: &mut Sandboxes, call: Call, n: usize, warmup: usize) -> Result<Vec<Duration>> {
    let (id, _) = sb.create(&format!("the sandbox of the {call:?} section")).await?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let what = format!("{call:?} sample {i}");
        let took = match call {
            Call::Get | Call::GetSpaced => {
                check_interrupt()?;
                if matches!(call, Call::GetSpaced) {
                    tokio::time::sleep(EXEC_GAP).await;
                }
                let t = Instant::now();
                sb.client.get(id.as_str()).await.with_context(|| format!("GetSandbox {id} ({what})"))?;
                t.elapsed()
            }
            Call::Exec => exec_true(&sb.client, &id, &what).await?,
            Call::ExecSpaced => {
                tokio::time::sleep(EXEC_GAP).await;
                exec_true(&sb.client, &id, &what).await?
            }
            Call::Stream => exec_stream_true(&sb.client, &id, &what).await?,
        };
        if i >= warmup {
            samples.push(took);
        }
    }
    sb.destroy(&id).await?;
    Ok(samples)
}

/// Sections 1–3 on one daemon.
pub(crate) async fn sandboxd_latency(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let keys = [Key::Create, Key::Destroy, Key::Get, Key::GetSpaced, Key::Exec, Key::ExecSpaced, Key::ExecStream];
    let daemon = match Daemon::start().await.context("starting sandboxd") {
        Ok(d) => d,
        Err(e) => return report.failed(&keys, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return report.failed(&keys, &e),
    };
    let mut sb = Sandboxes::new(client);

    eprintln!("bench: sandboxd create/destroy × {}", plan.create);
    match create_destroy(&mut sb, plan).await {
        Ok((c, d)) => {
            report.measured(Key::Create, &c);
            report.measured(Key::Destroy, &d);
        }
        Err(e) => report.failed(&[Key::Create, Key::Destroy], &e),
    }
    sb.cleanup().await;

    let sections = [
        (Key::Get, Call::Get, plan.exec),
        (Key::GetSpaced, Call::GetSpaced, plan.spaced),
        (Key::Exec, Call::Exec, plan.exec),
        (Key::ExecSpaced, Call::ExecSpaced, plan.spaced),
        (Key::ExecStream, Call::Stream, plan.stream),
    ];
    for (key, call, n) in sections {
        eprintln!("bench: sandboxd {call:?} × {n}");
        match calls_in_one(&mut sb, call, n, plan.warmup * 3).await {
            Ok(s) => report.measured(key, &s),
            Err(e) => report.failed(&[key], &e),
        }
        sb.cleanup().await;
    }

    report.rss_after_latency = daemon.pid().and_then(rss_bytes);
    drop(daemon);
    report.section_times.push(("sandboxd latency".into(), started.elapsed()));
}
