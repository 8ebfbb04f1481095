//! The Docker baseline: the same steps through the Docker Engine API (bollard), from the same
//! process, with an image imported from the `minimal` rootfs. Never fails the bench.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, RemoveImageOptionsBuilder,
    WaitContainerOptionsBuilder,
};
use bollard::Docker;
use futures::StreamExt;
use sandbox_tests::images_dir;

use crate::check_interrupt;
use crate::cli::Plan;
use crate::results::{Key, Report};

/// Where the Docker Engine listens, unless `DOCKER_HOST` names another `unix://` socket.
const DOCKER_SOCKET: &str = "/var/run/docker.sock";
/// The image the Docker baseline imports from the `minimal` rootfs (no registry involved).
pub(crate) const DOCKER_IMAGE: &str = "sandboxd-bench-minimal:latest";
/// Label on every container the bench makes, so leftovers of a killed run can be found.
const DOCKER_LABEL: &str = "sandboxd-bench";

pub(crate) fn docker_socket() -> String {
    std::env::var("DOCKER_HOST").ok().and_then(|h| h.strip_prefix("unix://").map(str::to_string)).unwrap_or_else(|| DOCKER_SOCKET.to_string())
}

/// The Docker side: the containers alive, so that each one is removed whatever happens.
struct DockerBench {
    pub(crate) docker: Docker,
    containers: BTreeSet<String>,
}

impl DockerBench {
    /// Connects (negotiating the API version down to the Engine's) and says which Engine it is.
    async fn connect() -> Result<(Self, String)> {
        let socket = docker_socket();
        // The Engine may be older than bollard's default API version (Debian 12 ships 1.41).
        let docker = Docker::connect_with_unix(&socket, 120, bollard::API_DEFAULT_VERSION)
            .with_context(|| format!("cannot reach Docker at {socket}"))?
            .negotiate_version()
            .await
            .with_context(|| format!("cannot reach Docker at {socket}"))?;
        let v = docker.version().await.context("Docker version")?;
        let desc = format!("Engine {} (API {})", v.version.unwrap_or_default(), v.api_version.unwrap_or_default());
        Ok((DockerBench { docker, containers: BTreeSet::new() }, desc))
    }

    /// Removes containers that an interrupted earlier run left behind.
    async fn remove_leftovers(&self) -> Result<()> {
        let filters = HashMap::from([("label".to_string(), vec![DOCKER_LABEL.to_string()])]);
        let options = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
        for c in self.docker.list_containers(Some(options)).await.context("listing leftover bench containers")? {
            if let Some(id) = c.id {
                eprintln!("bench: removing container {id} left by an earlier run");
                let _ = self.docker.remove_container(&id, Some(RemoveContainerOptionsBuilder::default().force(true).build())).await;
            }
        }
        Ok(())
    }

    /// `docker import` of the `minimal` rootfs as a tar stream: a local image, no registry.
    async fn import_image(&self) -> Result<Duration> {
        let rootfs = images_dir().join("minimal/rootfs");
        let t = Instant::now();
        let tarball = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
            let mut tar = tar::Builder::new(Vec::new());
            // Busybox's applets are symlinks: keep them links, not 300 copies of busybox.
            tar.follow_symlinks(false);
            tar.append_dir_all(".", &rootfs).with_context(|| format!("packing {} into a tar stream", rootfs.display()))?;
            tar.into_inner().context("finishing the tar stream")
        })
        .await
        .context("packing the rootfs")??;
        let (repo, tag) = DOCKER_IMAGE.split_once(':').unwrap_or((DOCKER_IMAGE, "latest"));
        let options = CreateImageOptionsBuilder::default().from_src("-").repo(repo).tag(tag).build();
        let mut progress = self.docker.create_image(Some(options), Some(bollard::body_full(tarball.into())), None);
        while let Some(item) = progress.next().await {
            item.with_context(|| format!("importing {DOCKER_IMAGE} from the minimal rootfs"))?;
        }
        Ok(t.elapsed())
    }

    fn body(cmd: &[&str], network: Option<&str>) -> ContainerCreateBody {
        ContainerCreateBody {
            image: Some(DOCKER_IMAGE.to_string()),
            cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
            labels: Some(HashMap::from([(DOCKER_LABEL.to_string(), "1".to_string())])),
            host_config: Some(HostConfig { network_mode: network.map(str::to_string), ..Default::default() }),
            ..Default::default()
        }
    }

    pub(crate) async fn create(&mut self, cmd: &[&str], network: Option<&str>) -> Result<String> {
        check_interrupt()?;
        let created = self
            .docker
            .create_container(Some(CreateContainerOptionsBuilder::default().build()), Self::body(cmd, network))
            .await
            .with_context(|| format!("creating a container of {DOCKER_IMAGE} running {cmd:?}"))?;
        self.containers.insert(created.id.clone());
        Ok(created.id)
    }

    pub(crate) async fn start(&self, id: &str) -> Result<()> {
        self.docker.start_container(id, None).await.with_context(|| format!("starting container {id}"))
    }

    /// `docker rm -f`; returns the call's time.
    pub(crate) async fn remove(&mut self, id: &str) -> Result<Duration> {
        let t = Instant::now();
        self.docker
            .remove_container(id, Some(RemoveContainerOptionsBuilder::default().force(true).build()))
            .await
            .with_context(|| format!("removing container {id}"))?;
        let took = t.elapsed();
        self.containers.remove(id);
        Ok(took)
    }

    /// `docker run --rm … true`: create, start, wait for the exit, remove.
    async fn run_rm(&mut self) -> Result<Duration> {
        let t = Instant::now();
        let id = self.create(&["true"], Some("none")).await?;
        self.start(&id).await?;
        let options = WaitContainerOptionsBuilder::default().condition("not-running").build();
        let mut wait = self.docker.wait_container(&id, Some(options));
        while let Some(r) = wait.next().await {
            r.with_context(|| format!("waiting for container {id} (`true`) to exit"))?;
        }
        self.remove(&id).await?;
        Ok(t.elapsed())
    }

    /// Create+start of a container that stays up; returns its id and the time.
    async fn create_start(&mut self, network: Option<&str>) -> Result<(String, Duration)> {
        let t = Instant::now();
        let id = self.create(&["sleep", "3600"], network).await?;
        self.start(&id).await?;
        Ok((id, t.elapsed()))
    }

    /// `docker exec <id> true`: exec create, attached start drained to the end, inspect for the
    /// exit code — the calls the CLI makes.
    async fn exec_true(&self, id: &str) -> Result<Duration> {
        check_interrupt()?;
        let t = Instant::now();
        let config =
            bollard::exec::CreateExecOptions::<&str> { cmd: Some(vec!["true"]), attach_stdout: Some(true), attach_stderr: Some(true), ..Default::default() };
        let exec = self.docker.create_exec(id, config).await.with_context(|| format!("creating an exec of `true` in container {id}"))?;
        match self.docker.start_exec(&exec.id, None).await.with_context(|| format!("starting exec {} in container {id}", exec.id))? {
            bollard::exec::StartExecResults::Attached { mut output, .. } => {
                while let Some(chunk) = output.next().await {
                    chunk.with_context(|| format!("reading exec {} output", exec.id))?;
                }
            }
            bollard::exec::StartExecResults::Detached => bail!("exec {} started detached although attached was asked", exec.id),
        }
        let inspect = self.docker.inspect_exec(&exec.id).await.with_context(|| format!("inspecting exec {}", exec.id))?;
        let took = t.elapsed();
        if inspect.exit_code != Some(0) {
            bail!("docker exec of `true` in {id} ended with exit code {:?}", inspect.exit_code);
        }
        Ok(took)
    }

    pub(crate) async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.containers) {
            if let Err(e) = self.docker.remove_container(&id, Some(RemoveContainerOptionsBuilder::default().force(true).build())).await {
                eprintln!("bench: WARNING: could not remove container {id} while cleaning up: {e}");
            }
        }
    }
}

async fn docker_sections(d: &mut DockerBench, plan: &Plan, report: &mut Report) -> Result<()> {
    let warmup = plan.warmup.min(2);
    eprintln!("bench: docker run --rm × {}", plan.docker_run);
    let mut runs = Vec::new();
    for i in 0..warmup + plan.docker_run {
        let took = d.run_rm().await?;
        if i >= warmup {
            runs.push(took);
        }
    }
    report.measured(Key::DockerRun, &runs);

    for (key, network) in [(Key::DockerCreateStart, Some("none")), (Key::DockerCreateStartBridge, None)] {
        eprintln!("bench: docker create+start ({}) × {}", network.unwrap_or("bridge"), plan.docker_create);
        let (mut starts, mut removes) = (Vec::new(), Vec::new());
        for i in 0..warmup + plan.docker_create {
            let (id, took) = d.create_start(network).await?;
            let removed = d.remove(&id).await?;
            if i >= warmup {
                starts.push(took);
                // `rm -f` is timed on the `--network none` containers, the ones like sandboxes.
                if network.is_some() {
                    removes.push(removed);
                }
            }
        }
        report.measured(key, &starts);
        if network.is_some() {
            report.measured(Key::DockerRemove, &removes);
        }
    }

    eprintln!("bench: docker exec × {}", plan.docker_exec);
    let (id, _) = d.create_start(Some("none")).await?;
    let mut execs = Vec::new();
    for i in 0..warmup * 3 + plan.docker_exec {
        let took = d.exec_true(&id).await?;
        if i >= warmup * 3 {
            execs.push(took);
        }
    }
    report.measured(Key::DockerExec, &execs);
    d.remove(&id).await?;
    Ok(())
}

/// Section 5. Never fails the bench: a Docker that cannot be reached or used marks its rows
/// "unavailable", loudly.
pub(crate) async fn docker_baseline(plan: &Plan, report: &mut Report) {
    let started = Instant::now();
    let loud = |why: &str| {
        let line = format!("!!!!! DOCKER BASELINE UNAVAILABLE: {why} — its rows say \"unavailable\"; the sandboxd numbers stand alone !!!!!");
        eprintln!("{line}");
        println!("{line}");
    };
    let (mut d, version) = match DockerBench::connect().await {
        Ok(x) => x,
        Err(e) => {
            let why = format!("{e:#}");
            loud(&why);
            report.docker_unavailable = Some(why.clone());
            return report.unavailable(&Key::DOCKER, &why);
        }
    };
    report.docker = Some(version);
    if let Err(e) = d.remove_leftovers().await {
        eprintln!("bench: WARNING: {e:#}");
    }
    eprintln!("bench: docker import of the minimal rootfs as {DOCKER_IMAGE}");
    let result = match d.import_image().await {
        Ok(took) => {
            report.docker_import = Some(took);
            docker_sections(&mut d, plan, report).await
        }
        Err(e) => Err(e),
    };
    d.cleanup().await;
    if let Err(e) = result {
        let why = format!("{e:#}");
        loud(&why);
        report.docker_unavailable = Some(why.clone());
        report.unavailable(&Key::DOCKER, &why);
    }
    if report.docker_import.is_some() {
        if let Err(e) = d.docker.remove_image(DOCKER_IMAGE, Some(RemoveImageOptionsBuilder::default().force(true).build()), None).await {
            eprintln!("bench: WARNING: could not remove image {DOCKER_IMAGE}: {e}");
        }
    }
    report.section_times.push(("Docker".into(), started.elapsed()));
}
