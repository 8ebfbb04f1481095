//! `image_bench`: bringing images into sandboxd — `ImportImage` from the local Docker Engine,
//! `BuildImage` of a small Dockerfile, `ImportImage` of an uploaded `docker save` archive — each
//! timed in total and per progress phase, with Docker's nearest equivalent measured in the same
//! run as the baseline; then the first exec of a sandbox of the imported image on each tier, and
//! the daemon's peak memory.
//!
//! `make bench` runs it after `transfer_bench`: it writes the `## Images` section of
//! BENCHMARKS.md (`--out FILE`), leaving the rest of the file alone. `--runs N` (default 3) sets
//! how often each import and build is repeated. Every measured operation is checked (the image
//! is listed with the expected digest and ready on every tier, the exec prints 1): a failed
//! check fails the run. What the bench makes in Docker is removed when it ends, also when it
//! fails half way; what it makes in the daemon goes with the daemon's temp dir.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use agent_client::proto::{self, exec_event, ImageInfo, ImageProgress, Isolation};
use agent_client::{exec_request, Client};
use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use sandbox_tests::{describe, images_dir, proc_status_bytes, replace_section, sandbox_request, Daemon};

#[derive(Parser)]
#[command(about = "Image import and build times per phase, with docker save/load and docker build as the baselines")]
struct Args {
    /// How often each import and build is repeated (medians and p99 are over these).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Markdown file whose `## Images` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

const HEADING: &str = "## Images";
/// The Docker repository of the daemon's copies of the script-built `debian` image.
const DEBIAN_REPO: &str = "sandboxd/debian";
/// What `FROM sandboxd/debian` means: a daemon points it at its own copy whenever a build
/// starts from it.
const DEBIAN_LATEST: &str = "sandboxd/debian:latest";
/// Bound of one import or build (a Docker export, the unpacking, a Docker import and a base
/// disk of some 600 MiB each, on a machine other work may be loading).
const IMPORT_SECS: u64 = 1800;
/// Bound of a create (a microVM boots under TCG) and of an exec.
const CREATE_SECS: u64 = 600;
const EXEC_SECS: u64 = 120;

// Docker, through its command line (as an operator would measure it).

/// Runs `docker args…` with `env` set; its stdout, or an error with the end of its stderr.
fn docker_with(env: &[(&str, &str)], args: &[&str]) -> Result<String> {
    let out = Command::new("docker").args(args).envs(env.iter().copied()).output().with_context(|| format!("running docker {args:?}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let err = err.trim();
        let tail: String = err.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
        bail!("docker {args:?}: {tail}");
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn docker(args: &[&str]) -> Result<String> {
    docker_with(&[], args)
}

/// The image ID (`sha256:…`) of a local image.
fn docker_id(reference: &str) -> Result<String> {
    Ok(docker(&["image", "inspect", "--format", "{{.Id}}", reference])?.trim().to_string())
}

/// `repo:tag` → image ID for every tag of repository `repo` (empty if there are none or Docker
/// cannot say).
fn tags_of(repo: &str) -> BTreeMap<String, String> {
    let listed = docker(&["images", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}", repo]).unwrap_or_default();
    listed.lines().filter_map(|l| l.split_once(' ')).map(|(t, id)| (t.to_string(), id.to_string())).collect()
}

/// Runs a shell pipeline (paths in it are the bench's own temp dirs and the images dir); any
/// failing command of it fails it.
fn sh(script: &str) -> Result<()> {
    let out = Command::new("bash").arg("-o").arg("pipefail").arg("-c").arg(script).output().context("running bash")?;
    ensure!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr).chars().take(2000).collect::<String>());
    Ok(())
}

/// What the bench made in Docker, removed when it ends (also on an error or a panic): every tag
/// of its own repositories (`<prefix>…`, and the `sandboxd/<prefix>…` ones the daemon made of
/// its imports), the `sandboxd/debian` tags this run's daemon added, and `sandboxd/debian:latest`
/// pointed back at the image it named before.
struct DockerCleanup {
    prefix: String,
    debian_before: BTreeMap<String, String>,
    /// The image ID of this run's daemon's `sandboxd/debian` (known once a build prepared it).
    /// Only its new tags are removed: another daemon on this Docker may add its own meanwhile.
    ours: Option<String>,
}

impl Drop for DockerCleanup {
    fn drop(&mut self) {
        if let Some(before) = self.debian_before.get(DEBIAN_LATEST) {
            if docker_id(DEBIAN_LATEST).ok().as_ref() != Some(before) {
                let _ = docker(&["tag", before, DEBIAN_LATEST]);
            }
        }
        if let Some(ours) = &self.ours {
            for (tag, id) in tags_of(DEBIAN_REPO) {
                if id == *ours && !self.debian_before.contains_key(&tag) {
                    let _ = docker(&["rmi", &tag]);
                }
            }
        }
        let all = docker(&["images", "--format", "{{.Repository}}:{{.Tag}}"]).unwrap_or_default();
        let ours = format!("sandboxd/{}", self.prefix);
        for tag in all.lines().filter(|t| t.starts_with(&self.prefix) || t.starts_with(&ours)) {
            let _ = docker(&["rmi", tag]);
        }
    }
}

// Timing.

/// One measured operation: its runs, and for each run where the time went.
struct Row {
    what: String,
    runs: Vec<Duration>,
    parts: Vec<Vec<(String, Duration)>>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    match v.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2,
    }
}

/// The 99th percentile, nearest rank: the maximum below 100 runs.
fn p99(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    let rank = (v.len() * 99).div_ceil(100);
    v.get(rank.saturating_sub(1)).copied().unwrap_or_default()
}

fn secs(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// How long each phase of an import or build took, from the client's receipt of its progress
/// events. A phase runs from the end of the phase before (the call's start for the first) to
/// its last event: the daemon reports `metadata` and each tier once that step has finished,
/// `receive`, `build`, `export` and `layers` also as they go. A phase seen in two stretches adds
/// up; `done` (the catalog read after the last tier) counts only in the total.
fn phase_times(start: Instant, events: &[(String, Instant)]) -> Vec<(String, Duration)> {
    let mut out: Vec<(String, Duration)> = Vec::new();
    let mut prev = start;
    let mut i = 0;
    while i < events.len() {
        let phase = &events[i].0;
        let mut last = i;
        while last + 1 < events.len() && events[last + 1].0 == *phase {
            last += 1;
        }
        let end = events[last].1;
        if phase != "done" {
            let took = end.saturating_duration_since(prev);
            match out.iter_mut().find(|(p, _)| p == phase) {
                Some(entry) => entry.1 += took,
                None => out.push((phase.clone(), took)),
            }
        }
        prev = end;
        i = last + 1;
    }
    out
}

/// The median of each part over the runs, in the order they first appear.
fn part_medians(parts: &[Vec<(String, Duration)>]) -> Vec<(String, Duration)> {
    let mut names: Vec<&str> = Vec::new();
    for (name, _) in parts.iter().flatten() {
        if !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let times: Vec<Duration> = parts.iter().map(|run| run.iter().filter(|(p, _)| p == name).map(|(_, d)| *d).sum::<Duration>()).collect();
            (name.to_string(), median(&times))
        })
        .collect()
}

/// Awaits a client call, failing (not hanging) after `secs`.
async fn bounded<T>(secs: u64, what: &str, call: impl Future<Output = agent_client::Result<T>>) -> Result<T> {
    match tokio::time::timeout(Duration::from_secs(secs), call).await {
        Ok(result) => result.with_context(|| what.to_string()),
        Err(_) => bail!("{what} did not finish within {secs} s"),
    }
}

/// An import or build that ended with its image: how long in total and per phase.
struct Imported {
    total: Duration,
    phases: Vec<(String, Duration)>,
    info: ImageInfo,
}

/// The progress events of one import or build, as the client receives them.
struct Recorder {
    start: Instant,
    events: Vec<(String, Instant)>,
}

impl Recorder {
    /// Starts the clock: call right before the call.
    fn start() -> Self {
        Recorder { start: Instant::now(), events: Vec::new() }
    }

    /// The progress callback of the call.
    fn record(&mut self) -> impl FnMut(&ImageProgress) + '_ {
        |e| self.events.push((e.phase.clone(), Instant::now()))
    }

    /// Stops the clock: call right after the call returned `info`.
    fn finish(self, info: ImageInfo) -> Imported {
        let total = self.start.elapsed();
        Imported { total, phases: phase_times(self.start, &self.events), info }
    }
}

// The daemon's side.

/// Every tier, in the order they are reported.
const TIERS: [Isolation; 3] = [Isolation::Process, Isolation::Container, Isolation::Microvm];

/// The image is listed under its name with `digest` (when given) and ready on every tier.
async fn check_listed(c: &Client, info: &ImageInfo, digest: Option<&str>) -> Result<()> {
    let listed = c.list_images().await.context("ListImages")?.into_iter().find(|i| i.name == info.name);
    let Some(listed) = listed else { bail!("image {} is not listed after its import", info.name) };
    if let Some(want) = digest {
        ensure!(listed.digest == want, "image {} is listed with digest {}, not {want}", info.name, listed.digest);
    }
    ensure!(listed.digest.starts_with("sha256:") && listed.digest.len() == 71, "image {}: digest {:?}", info.name, listed.digest);
    let ready: Vec<Isolation> = listed.ready_tiers.iter().filter_map(|t| Isolation::try_from(*t).ok()).collect();
    ensure!(ready == TIERS, "image {} is ready on {ready:?}, not on every tier", info.name);
    Ok(())
}

/// RemoveImage, then the image is neither listed nor in Docker.
async fn remove(c: &Client, name: &str) -> Result<()> {
    bounded(300, "RemoveImage", c.remove_image(name)).await?;
    ensure!(c.list_images().await.context("ListImages")?.iter().all(|i| i.name != name), "image {name} is still listed after RemoveImage");
    let left = tags_of(&format!("sandboxd/{name}"));
    ensure!(left.is_empty(), "RemoveImage {name} left Docker images: {:?}", left.keys().collect::<Vec<_>>());
    Ok(())
}

/// The build context: a Dockerfile whose RUN line carries `run` (so no cache hides the build).
fn dockerfile(run: &str) -> String {
    format!("FROM sandboxd/debian\nRUN echo hi > /hello && echo {run} > /dev/null\nENV X=1\n")
}

fn context_tar(dockerfile: &str) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(dockerfile.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(1_700_000_000);
    b.append_data(&mut h, "Dockerfile", dockerfile.as_bytes())?;
    Ok(b.into_inner()?)
}

/// Create a sandbox of `image` on `tier`, run `python3 -c 'print(1)'`: (create, first output),
/// both from the start of the create. The sandbox is destroyed either way.
async fn first_exec(c: &Client, tier: Isolation, image: &str) -> Result<(Duration, Duration)> {
    let start = Instant::now();
    let sandbox = bounded(CREATE_SECS, &format!("CreateSandbox {tier:?} {image}"), c.create(sandbox_request(tier, image))).await?;
    let created = start.elapsed();
    let run: Result<(Duration, Duration)> = async {
        let mut stream = bounded(EXEC_SECS, "ExecStream", c.exec_stream(exec_request(&sandbox.id, ["python3", "-c", "print(1)"]))).await?;
        let (mut first, mut stdout, mut stderr) = (None, Vec::new(), Vec::new());
        loop {
            let Some(event) = bounded(EXEC_SECS, "ExecStream event", stream.next_event()).await? else {
                bail!("{tier:?}: the exec stream ended without a result");
            };
            match event.event {
                Some(exec_event::Event::Stdout(b)) => {
                    first.get_or_insert_with(|| start.elapsed());
                    stdout.extend_from_slice(&b);
                }
                Some(exec_event::Event::Stderr(b)) => stderr.extend_from_slice(&b),
                Some(exec_event::Event::Result(mut r)) => {
                    (r.stdout, r.stderr) = (stdout, stderr);
                    let ok = r.status == proto::ExecStatus::Exited as i32 && r.exit_code == 0 && r.stdout == b"1\n";
                    ensure!(ok, "{tier:?}: python3 -c 'print(1)' did not print 1: {}", describe(&r));
                    break;
                }
                None => {}
            }
        }
        Ok((created, first.context("no output")?))
    }
    .await;
    let destroyed = bounded(300, "DestroySandbox", c.destroy(sandbox.id.as_str())).await;
    let times = run?;
    destroyed?;
    Ok(times)
}

/// A tier as the README names it.
fn tier_name(tier: Isolation) -> &'static str {
    match tier {
        Isolation::Process => "process",
        Isolation::Container => "container",
        Isolation::Microvm => "microVM",
        _ => "unknown tier",
    }
}

// The runs.

/// Everything a run names, unique to it.
struct Names {
    prefix: String,
}

impl Names {
    fn image(&self, what: &str, run: usize) -> String {
        format!("{}-{what}-{run}", self.prefix)
    }
    fn docker(&self, what: &str) -> String {
        format!("{}-{what}", self.prefix)
    }
}

/// BuildImage of the small Dockerfile, then `docker build --no-cache` of the same context.
async fn builds(c: &Client, args: &Args, names: &Names, scratch: &Path, cleanup: &mut DockerCleanup) -> Result<(Row, Row)> {
    let mut ours = Row { what: String::new(), runs: Vec::new(), parts: Vec::new() };
    let mut theirs =
        Row { what: "baseline: `DOCKER_BUILDKIT=0 docker build --no-cache --network none` of the same context".into(), runs: Vec::new(), parts: Vec::new() };
    for run in 0..args.runs {
        let name = names.image("build", run);
        eprintln!("image_bench: BuildImage {name}");
        let text = dockerfile(&name);
        let context = context_tar(&text)?;
        let header =
            proto::BuildImageHeader { name: name.clone(), dockerfile: "Dockerfile".into(), context_size_bytes: context.len() as u64, ..Default::default() };
        let mut rec = Recorder::start();
        let info = bounded(IMPORT_SECS, "BuildImage", c.build_image(header, context.as_slice(), rec.record())).await?;
        let built = rec.finish(info);
        check_listed(c, &built.info, None).await?;
        let (env, source) = (built.info.env.get("X").map(String::as_str), built.info.source.as_str());
        ensure!(env == Some("1") && source == format!("build:{name}"), "built image {name}: env X={env:?}, source {source:?}");
        if cleanup.ours.is_none() {
            // The build pointed sandboxd/debian:latest at this daemon's copy of `debian`.
            cleanup.ours = Some(docker_id(DEBIAN_LATEST)?);
        }
        remove(c, &name).await?;
        ours.what = format!("`BuildImage` (`FROM sandboxd/debian`, `RUN echo hi > /hello`, `ENV X=1`; {} MiB)", built.info.size_bytes >> 20);
        ours.runs.push(built.total);
        ours.parts.push(built.phases);

        eprintln!("image_bench: docker build");
        let dir = scratch.join(format!("context-{run}"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("Dockerfile"), &text)?;
        let tag = format!("{}:{run}", names.docker("docker-build"));
        let dir_arg = dir.display().to_string();
        let start = Instant::now();
        docker_with(&[("DOCKER_BUILDKIT", "0")], &["build", "--no-cache", "--network", "none", "-q", "-t", &tag, &dir_arg])?;
        let took = start.elapsed();
        let env = docker(&["image", "inspect", "--format", "{{json .Config.Env}}", &tag])?;
        ensure!(env.contains("\"X=1\""), "docker build of {tag}: env {}", env.trim());
        docker(&["rmi", &tag])?;
        theirs.runs.push(took);
        theirs.parts.push(Vec::new());
    }
    Ok((ours, theirs))
}

/// ImportImage `docker:sandboxd/debian:latest`, then `docker save` + `docker load` of a copy.
/// The image of the last run is kept (returned) for the first execs.
async fn docker_imports(c: &Client, args: &Args, names: &Names, scratch: &Path) -> Result<(Row, Row, String)> {
    let mut ours = Row { what: String::new(), runs: Vec::new(), parts: Vec::new() };
    let mut kept = String::new();
    for run in 0..args.runs {
        let name = names.image("debian", run);
        eprintln!("image_bench: ImportImage docker:{DEBIAN_LATEST} as {name}");
        // Read right before: another daemon on this Docker may point the tag elsewhere.
        let want = docker_id(DEBIAN_LATEST)?;
        let layers = docker(&["image", "inspect", "--format", "{{len .RootFS.Layers}}", DEBIAN_LATEST])?;
        let mut rec = Recorder::start();
        let info = bounded(IMPORT_SECS, "ImportImage docker", c.import_docker_image(DEBIAN_LATEST, name.clone(), rec.record())).await?;
        let imported = rec.finish(info);
        check_listed(c, &imported.info, Some(&want)).await?;
        ours.what = format!("`ImportImage` `docker:{DEBIAN_LATEST}` ({} MiB, {} layer(s))", imported.info.size_bytes >> 20, layers.trim());
        ours.runs.push(imported.total);
        ours.parts.push(imported.phases);
        if run + 1 < args.runs {
            remove(c, &name).await?;
        } else {
            kept = name;
        }
    }

    // The baseline: a one-layer image of the same rootfs plus a marker file, so that its layer
    // is in Docker's store only while the image is (a `docker load` of layers Docker already
    // holds skips them and measures nothing).
    eprintln!("image_bench: docker save + docker load");
    let copy = format!("{}:latest", names.docker("debian-copy"));
    let marker = scratch.join("marker");
    std::fs::create_dir_all(&marker)?;
    std::fs::write(marker.join(".image-bench"), &names.prefix)?;
    let rootfs = images_dir().join("debian/rootfs");
    sh(&format!("tar -C '{}' -cf - . -C '{}' .image-bench | docker import - {copy} >/dev/null", rootfs.display(), marker.display()))?;
    let id = docker_id(&copy)?;
    let file = scratch.join("debian-copy.tar");
    let file_arg = file.display().to_string();
    let mut theirs = Row { what: String::new(), runs: Vec::new(), parts: Vec::new() };
    for _ in 0..args.runs {
        let start = Instant::now();
        docker(&["save", "-o", &file_arg, &copy])?;
        let save = start.elapsed();
        docker(&["rmi", &copy])?;
        ensure!(docker_id(&copy).is_err(), "{copy} is still in Docker after docker rmi");
        let start = Instant::now();
        docker(&["load", "-q", "-i", &file_arg])?;
        let load = start.elapsed();
        ensure!(docker_id(&copy)? == id, "docker load of {copy} made another image");
        let size = std::fs::metadata(&file)?.len();
        std::fs::remove_file(&file)?;
        theirs.what = format!("baseline: `docker save -o` + `docker rmi` + `docker load -i` of a one-layer copy ({} MiB archive)", size >> 20);
        theirs.runs.push(save + load);
        theirs.parts.push(vec![("docker save".into(), save), ("docker load".into(), load)]);
    }
    docker(&["rmi", &copy])?;
    Ok((ours, theirs, kept))
}

/// ImportImage of a `docker save` archive of a small image, through the upload path.
async fn archive_imports(c: &Client, args: &Args, names: &Names, scratch: &Path) -> Result<Row> {
    let tag = format!("{}:v1", names.docker("minimal"));
    let rootfs_tar = scratch.join("minimal-rootfs.tar");
    sh(&format!("tar -C '{}' -cf '{}' .", images_dir().join("minimal/rootfs").display(), rootfs_tar.display()))?;
    docker(&["import", &rootfs_tar.display().to_string(), &tag])?;
    let want = docker_id(&tag)?;
    let archive = scratch.join("minimal.tar");
    docker(&["save", "-o", &archive.display().to_string(), &tag])?;
    let size = std::fs::metadata(&archive)?.len();
    let mut row =
        Row { what: format!("`ImportImage` of a `docker save` archive of `minimal` ({} KiB, uploaded)", size >> 10), runs: Vec::new(), parts: Vec::new() };
    for run in 0..args.runs {
        let name = names.image("archive", run);
        eprintln!("image_bench: ImportImage archive as {name}");
        let file = tokio::fs::File::open(&archive).await?;
        let mut rec = Recorder::start();
        let info = bounded(IMPORT_SECS, "ImportImage archive", c.import_image_archive(name.clone(), "minimal.tar", size, file, rec.record())).await?;
        let imported = rec.finish(info);
        check_listed(c, &imported.info, Some(&want)).await?;
        remove(c, &name).await?;
        row.runs.push(imported.total);
        row.parts.push(imported.phases);
    }
    docker(&["rmi", &tag])?;
    Ok(row)
}

/// All the measurements, in an order where each finds what it needs: the builds point
/// `sandboxd/debian:latest` at this daemon's `debian`, which the Docker imports then read.
async fn measure(daemon: &Daemon, args: &Args, names: &Names, cleanup: &mut DockerCleanup) -> Result<(Vec<Row>, u64, u64)> {
    let scratch = tempfile::Builder::new().prefix("image-bench-").tempdir()?;
    let pid = daemon.pid().context("daemon pid")?;
    let c = daemon.client().await?;
    let hwm_start = proc_status_bytes(pid, "VmHWM").unwrap_or(0);

    // Untimed: the Docker image of `debian` exists (a first use imports its rootfs into Docker)
    // and its files are in the page cache, so no run pays a one-off cost the others do not.
    eprintln!("image_bench: warming up (a container sandbox of debian)");
    let warm = bounded(CREATE_SECS, "CreateSandbox container debian", c.create(sandbox_request(Isolation::Container, "debian"))).await?;
    bounded(300, "DestroySandbox", c.destroy(warm.id.as_str())).await?;

    let (build, docker_build) = builds(&c, args, names, scratch.path(), cleanup).await?;
    let (import, save_load, kept) = docker_imports(&c, args, names, scratch.path()).await?;
    let mut rows = vec![import, save_load, build, docker_build];
    for tier in TIERS {
        eprintln!("image_bench: first exec on {tier:?}");
        let (created, output) = first_exec(&c, tier, &kept).await?;
        rows.push(Row {
            what: format!("{} sandbox of the imported image: create + first exec's first output", tier_name(tier)),
            runs: vec![output],
            parts: vec![vec![("create".into(), created), ("exec to first output".into(), output.saturating_sub(created))]],
        });
    }
    remove(&c, &kept).await?;
    rows.push(archive_imports(&c, args, names, scratch.path()).await?);
    let hwm_end = proc_status_bytes(pid, "VmHWM").unwrap_or(0);
    Ok((rows, hwm_start, hwm_end))
}

fn render(rows: &[Row], args: &Args, hwm_start: u64, hwm_end: u64) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut md = format!("{HEADING}\n\n");
    md.push_str(&format!(
        "`target/release/image_bench` (run by `make bench`; {cpus} CPUs): images brought into a release sandboxd, each import and build repeated \
         {runs} time(s) under a fresh name and removed after each run, with median and p99 (nearest rank: the maximum below 100 runs); \
         Docker's nearest equivalent is measured in the same run. A phase runs from the end of the one before to its last progress event, \
         as the client receives them (the daemon reports `metadata` and each tier once that step is done): `export` is the image out of \
         Docker's Engine API, `layers` applying its layers into the catalog, `metadata` the commit, then each tier prepares the image \
         (`process`: nothing to do; `container`: its rootfs imported into Docker; `microvm`: its base disk); a build first receives its \
         context and runs the Dockerfile (`build`, which includes making sure `sandboxd/debian` is in Docker). Every import is checked: \
         listed with Docker's image ID as its digest (the build's: a digest and `X=1`) and ready on every tier.\n\n",
        runs = args.runs
    ));
    md.push_str(
        "The `docker save`/`docker load` baseline moves a one-layer image of the same debian rootfs (plus a marker file, so that \
         its layer is not already in Docker's store: a `docker load` of layers Docker holds skips them) out of Docker to a file and \
         back in after `docker rmi`: the export and unpacking a runtime does to receive an image. The build baseline is the classic \
         builder the daemon drives through the Engine API, with the daemon's default build network (none); both builds have a run \
         id in their `RUN` line, so no cache serves them. The first execs (`python3 -c 'print(1)'`, once per tier) use the image \
         of the last `docker:` import; their time runs from the start of the create to the first byte of output.\n\n",
    );
    md.push_str("| what | runs | median | p99 | where the time goes (medians) |\n|---|---|---|---|---|\n");
    for r in rows {
        let parts = part_medians(&r.parts).iter().map(|(p, d)| format!("{p} {}", secs(*d))).collect::<Vec<_>>().join(" · ");
        md.push_str(&format!("| {} | {} | {} | {} | {parts} |\n", r.what, r.runs.len(), secs(median(&r.runs)), secs(p99(&r.runs))));
    }
    md.push_str(&format!(
        "\nsandboxd's peak resident memory (VmHWM) was {} MiB once started and {} MiB at the end of the run: imports stream \
         archives and layers through files, never whole into memory.\n",
        hwm_start >> 20,
        hwm_end >> 20
    ));
    md
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.runs >= 1, "--runs must be at least 1");
    for f in ["debian/image.json", "debian/vm/vm.json", "debian/rootfs/usr/bin/python3", "minimal/rootfs"] {
        let p = images_dir().join(f);
        ensure!(p.exists(), "{} is missing: build the images (`make images image-debian vm-images exec-helper`)", p.display());
    }
    docker(&["version", "--format", "{{.Server.Version}}"]).context("image_bench needs a Docker Engine")?;
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let names = Names { prefix: format!("imgbench-{}-{nanos}", std::process::id()) };

    // Declared before the daemon, so dropped after it: a daemon's containers go before the
    // Docker images they run.
    let mut cleanup = DockerCleanup { prefix: names.prefix.clone(), debian_before: tags_of(DEBIAN_REPO), ours: None };
    let daemon = Daemon::start().await.context("starting sandboxd")?;
    let measured = measure(&daemon, &args, &names, &mut cleanup).await;
    let (rows, hwm_start, hwm_end) = match measured {
        Ok(m) => m,
        Err(e) => {
            let log = daemon.log();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            eprintln!("image_bench failed; the daemon's log ends:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            return Err(e);
        }
    };
    drop(daemon);
    drop(cleanup);

    let md = render(&rows, &args, hwm_start, hwm_end);
    print!("{md}");
    if let Some(out) = &args.out {
        replace_section(out, HEADING, &md)?;
        eprintln!("wrote the `{HEADING}` section of {}", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_end_at_their_last_event_and_stretches_add_up() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let events: Vec<(String, Instant)> = [
            ("export", 10),
            ("export", 100),
            ("layers", 150),
            ("layers", 300),
            ("metadata", 310),
            ("process", 320),
            ("receive", 330),
            ("process", 400),
            ("done", 410),
        ]
        .into_iter()
        .map(|(p, ms)| (p.to_string(), at(ms)))
        .collect();
        let got: Vec<(String, u128)> = phase_times(t0, &events).into_iter().map(|(p, d)| (p, d.as_millis())).collect();
        let want = [("export", 100), ("layers", 200), ("metadata", 10), ("process", 80), ("receive", 10)].map(|(p, ms)| (p.to_string(), ms));
        assert_eq!(got, want);
        let runs = [Duration::from_secs(3), Duration::from_secs(1), Duration::from_secs(2)];
        assert_eq!((median(&runs), p99(&runs)), (Duration::from_secs(2), Duration::from_secs(3)));
        assert_eq!(median(&runs[..2]), Duration::from_secs(2));
    }
}
