//! sandboxd's container tier (`ISOLATION_CONTAINER`): create, destroy, exec and
//! snapshot+rollback, on a daemon of its own; unavailable (not failed) when it cannot create.

use std::time::Instant;

use anyhow::{Context, Result};
use sandbox_tests::{process_sandbox, proto, Daemon};

use crate::cli::Plan;
use crate::results::{Key, Report};
use crate::sandboxes::{exec_true, Sandboxes};
use crate::snapshots::{snapshot_rollback, CHANGED_SMALL_MIB};

/// The container tier's rows, once a first container sandbox has been created.
async fn container_sections(sb: &mut Sandboxes, plan: &Plan, report: &mut Report) -> Result<()> {
    let request = || proto::CreateSandboxRequest { isolation: proto::Isolation::Container as i32, ..process_sandbox("minimal") };
    eprintln!("bench: sandboxd container tier create/destroy × {}", plan.container_create);
    let (mut creates, mut destroys) = (Vec::new(), Vec::new());
    for i in 0..plan.warmup.min(2) + plan.container_create {
        let (id, took) = sb.create_with(request(), &format!("container tier sample {i}")).await?;
        let destroyed = sb.destroy(&id).await?;
        if i >= plan.warmup.min(2) {
            creates.push(took);
            destroys.push(destroyed);
        }
    }
    report.measured(Key::ContainerCreate, &creates);
    report.measured(Key::ContainerDestroy, &destroys);

    eprintln!("bench: sandboxd container tier Exec × {}", plan.container_exec);
    let (id, _) = sb.create_with(request(), "the sandbox of the container tier exec section").await?;
    let mut execs = Vec::new();
    for i in 0..plan.warmup * 3 + plan.container_exec {
        let took = exec_true(&sb.client, &id, &format!("container tier exec {i}")).await?;
        if i >= plan.warmup * 3 {
            execs.push(took);
        }
    }
    report.measured(Key::ContainerExec, &execs);
    sb.destroy(&id).await?;
    container_exec_via_docker(plan, report).await?;

    eprintln!("bench: sandboxd container tier snapshot+rollback, {CHANGED_SMALL_MIB} MiB changed × {}", plan.container_snap);
    let (snaps, rollbacks, _) = snapshot_rollback(sb, request(), CHANGED_SMALL_MIB, plan.container_snap, None).await?;
    report.measured(Key::ContainerSnapshot, &snaps);
    report.measured(Key::ContainerRollback, &rollbacks);
    container_pool_create(plan, report).await
}

/// [`Key::ContainerPoolCreate`]: creates on a daemon with `[container] warm_pool = 1`, each
/// once the pool is filled again (its log says so), each checked to have come from the pool.
async fn container_pool_create(plan: &Plan, report: &mut Report) -> Result<()> {
    eprintln!("bench: sandboxd container tier CreateSandbox from the warm pool × {}", plan.container_create);
    let daemon = Daemon::start_with_config("[container]\nwarm_pool = 1\n").await.context("starting sandboxd with a container warm pool")?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    let request = || proto::CreateSandboxRequest { isolation: proto::Isolation::Container as i32, ..process_sandbox("minimal") };
    let count = |what: &str| daemon.log().matches(what).count();
    let measured = async {
        // The first create of the shape starts the pool.
        let (first, _) = sb.create_with(request(), "the container that starts the warm pool").await?;
        sb.destroy(&first).await?;
        let mut creates = Vec::new();
        for i in 0..plan.container_create {
            let ready = sandbox_tests::eventually(120, || std::future::ready(count("container warm pool: a container is ready") > i)).await;
            anyhow::ensure!(ready, "the warm pool was not filled again for create {i}");
            let (id, took) = sb.create_with(request(), &format!("container tier pooled create {i}")).await?;
            let pooled = daemon.log().lines().any(|l| l.contains("taken from the warm pool") && l.contains(&format!("sandbox={id}")));
            anyhow::ensure!(pooled, "create {i} did not come from the warm pool");
            sb.destroy(&id).await?;
            creates.push(took);
        }
        report.measured(Key::ContainerPoolCreate, &creates);
        anyhow::Ok(())
    }
    .await;
    sb.cleanup().await;
    measured
}

/// [`Key::ContainerExecViaDocker`]: the exec section again, on a daemon of its own that starts
/// every exec through Docker's exec API.
async fn container_exec_via_docker(plan: &Plan, report: &mut Report) -> Result<()> {
    eprintln!("bench: sandboxd container tier Exec through Docker's exec API × {}", plan.container_exec);
    let daemon = Daemon::start_with_config("[container]\nexec_through_docker = true\n").await.context("starting sandboxd with exec_through_docker")?;
    let mut sb = Sandboxes::new(daemon.client().await?);
    let request = proto::CreateSandboxRequest { isolation: proto::Isolation::Container as i32, ..process_sandbox("minimal") };
    let measured = async {
        let (id, _) = sb.create_with(request, "the sandbox of the exec_through_docker section").await?;
        let mut execs = Vec::new();
        for i in 0..plan.warmup * 3 + plan.container_exec {
            let took = exec_true(&sb.client, &id, &format!("container tier exec through Docker {i}")).await?;
            if i >= plan.warmup * 3 {
                execs.push(took);
            }
        }
        report.measured(Key::ContainerExecViaDocker, &execs);
        anyhow::Ok(())
    }
    .await;
    sb.cleanup().await;
    measured
}

/// The container tier (`ISOLATION_CONTAINER`) on a daemon of its own. A container tier that
/// cannot create a sandbox (no Docker, or not finished) marks its rows unavailable, loudly;
/// one that creates and then fails is a failure like any other sandboxd section.
pub(crate) async fn sandboxd_container(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let unavailable = |report: &mut Report, why: String| {
        let line = format!("!!!!! SANDBOXD CONTAINER TIER UNAVAILABLE: {why} — its rows say \"unavailable\" !!!!!");
        eprintln!("{line}");
        println!("{line}");
        report.unavailable(&Key::CONTAINER, &why);
        report.container_unavailable = Some(why);
    };
    let daemon = match Daemon::start().await.context("starting sandboxd for the container tier") {
        Ok(d) => d,
        Err(e) => return report.failed(&Key::CONTAINER, &e),
    };
    let client = match daemon.client().await {
        Ok(c) => c,
        Err(e) => return report.failed(&Key::CONTAINER, &e),
    };
    let mut sb = Sandboxes::new(client);
    eprintln!("bench: sandboxd container tier: a first, untimed create (may import the image)");
    let probe = proto::CreateSandboxRequest { isolation: proto::Isolation::Container as i32, ..process_sandbox("minimal") };
    let result = match sb.create_with(probe, "container tier, first create").await {
        Err(e) => {
            unavailable(report, format!("CreateSandbox with ISOLATION_CONTAINER failed: {e:#}"));
            Ok(())
        }
        Ok((id, _)) => match sb.destroy(&id).await {
            Ok(_) => container_sections(&mut sb, plan, report).await,
            Err(e) => Err(e),
        },
    };
    sb.cleanup().await;
    if let Err(e) = result {
        report.failed_unless_done(&Key::CONTAINER, &e);
    }
    drop(daemon);
    report.section_times.push(("sandboxd container tier".into(), started.elapsed()));
}
