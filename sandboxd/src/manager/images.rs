//! Images as users see them: the catalog with the tiers that can run each image, removal
//! (refused while a sandbox or snapshot uses the image), and imports and builds, which run as
//! tasks of their own and report their progress as a stream.
//!
//! An import, whatever its source, ends the same way ([`Manager::finish_import`]): the archive
//! (uploaded, exported from Docker, or the export of a build) is staged by
//! `images::import::stage` on a blocking thread, committed into the catalog under the image
//! gate (so no create and no removal sees half of it), and then every tier prepares it once:
//! the container tier imports it into Docker, the microVM tier builds its base disk. A tier that
//! cannot does not fail the import; the image is listed with the tiers that are ready.
//!
//! Images are their tenant's (see `images::owner`): an import or build belongs to the caller's
//! tenant, under a name of its own; script-built images and those an image admin shares are
//! everyone's. Another tenant's image is NOT_FOUND on every call, exactly like a name nobody
//! has, and a refusal names only the caller's own sandboxes and snapshots. Each tenant has its
//! own slots for imports and builds and its own share of the store.
//!
//! A build runs boxed: its Dockerfile is checked and its bases pinned before Docker sees it
//! (`images::build`), every RUN step runs in a container sandbox of the caller — the tier's
//! seccomp profile, capabilities, `no-new-privileges`, memory, CPU and pids limits, and no
//! network unless the operator allows builds the policy's, through the egress filter
//! (`images::steps`, `builds`) — and it stops at `images.build_timeout_ms`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::builds::{StepBuilder, BUILD_REPO};
use super::validate::validate_image;
use super::Manager;
use crate::backend::UploadPiece;
use crate::config::BuildNetwork;
use crate::egress::{NetworkMode, NetworkPolicy};
use crate::error::Error;
use crate::images::engine;
use crate::images::import::{self, ImportSpec, Prepared};
use crate::images::steps;
use crate::images::store::Claim;
use crate::images::{build, catalog, display_name, human, owner, ImageError, Viewer};
use crate::model::{ImageProgress, ImageRecord, Isolation, Limits};

/// Progress events waiting for a slow client.
const EVENT_BUFFER: usize = 32;
/// How often the bytes of an upload or export are reported.
const REPORT_EVERY: Duration = Duration::from_millis(500);
/// How often (in bytes received) an upload checks the free space of the store's filesystem.
const FREE_CHECK_EVERY: u64 = 64 << 20;

/// The events of an import or build: progress, then a last event with `done` set, or an error.
pub type ImageEvents = ReceiverStream<Result<ImageProgress, Error>>;

/// Where an import's image comes from.
pub enum ImportSource {
    /// A local Docker Engine image reference.
    Docker(String),
    /// An archive the client streams: its pieces, then `Commit` once its checksum matched.
    Archive { file_name: String, size: u64, data: mpsc::Receiver<UploadPiece> },
}

/// An ImportImage call.
pub struct ImportRequest {
    /// Empty: from the archive's references or its source.
    pub name: String,
    pub source: ImportSource,
    /// Shared with every tenant (image admins only).
    pub shared: bool,
}

/// An import's or build's slots: one of its tenant's, one of the daemon's.
struct Slot {
    _own: tokio::sync::OwnedSemaphorePermit,
    _shared: tokio::sync::OwnedSemaphorePermit,
}

/// A BuildImage call: the context arrives as pieces of a tar.
pub struct BuildRequest {
    pub name: String,
    /// Empty: `Dockerfile`.
    pub dockerfile: String,
    pub build_args: BTreeMap<String, String>,
    /// The network of its RUN steps (see `build_network`).
    pub network: Option<NetworkPolicy>,
    pub size: u64,
    pub data: mpsc::Receiver<UploadPiece>,
}

/// Where an import's events go.
#[derive(Clone)]
struct Reporter(mpsc::Sender<Result<ImageProgress, Error>>);

impl Reporter {
    /// Sends an event; `false` when the client is gone.
    async fn send(&self, event: ImageProgress) -> bool {
        self.0.send(Ok(event)).await.is_ok()
    }

    async fn say(&self, phase: &'static str, message: impl Into<String>) -> bool {
        self.send(ImageProgress::say(phase, message)).await
    }
}

/// A file removed when dropped (an upload, an export).
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Manager {
    /// The longest an import or build may take here: a build's `images.build_timeout_ms`, plus
    /// the time its export and import into the catalog may take after it.
    pub fn image_job_deadline(&self) -> Duration {
        Duration::from_millis(self.cfg.images.build_timeout_ms) + Duration::from_secs(600)
    }

    /// A fresh path for a temporary file in the image store (an upload kept for the fleet's
    /// other nodes, say), on the store's filesystem.
    pub fn image_upload_path(&self) -> PathBuf {
        self.catalog.upload_path()
    }

    /// Who `tenant` is to the image catalog; `root_peer` is a UNIX-socket caller running as
    /// root (or as the daemon's own uid), always an image admin.
    pub fn image_viewer(&self, tenant: &str, root_peer: bool) -> Viewer {
        Viewer {
            tenant: tenant.to_string(),
            owns_legacy: tenant == self.cfg.auth.unix_tenant,
            admin: root_peer || self.cfg.images.admin_tenants.iter().any(|t| t == tenant),
        }
    }

    /// The images `viewer` can use, sorted by name, with the tiers that can run each now.
    pub fn list_images(&self, viewer: &Viewer) -> Result<Vec<ImageRecord>, Error> {
        let mut out = Vec::new();
        for img in self.catalog.visible(viewer) {
            match self.catalog.record(&img.name) {
                Ok(r) => out.push(self.with_ready_tiers(&img.name, r)),
                // Removed between the listing and the read.
                Err(ImageError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// One image `viewer` can use, or NOT_FOUND listing the names it can.
    pub fn get_image(&self, viewer: &Viewer, name: &str) -> Result<ImageRecord, Error> {
        let img = self.catalog.find(viewer, name)?;
        Ok(self.with_ready_tiers(&img.name, self.catalog.record(&img.name)?))
    }

    /// The catalog key of the image `name` as `tenant` sees it, for a create: what the sandbox
    /// records and its tier resolves. Another tenant's image is NOT_FOUND.
    pub(super) fn image_key(&self, tenant: &str, name: &str) -> Result<String, Error> {
        Ok(self.catalog.find(&self.image_viewer(tenant, false), name)?.name)
    }

    fn with_ready_tiers(&self, key: &str, mut record: ImageRecord) -> ImageRecord {
        record.ready_tiers = Isolation::ALL.into_iter().filter(|t| self.backends.get(*t).is_ok_and(|b| b.image_ready(key).is_ok())).collect();
        record
    }

    /// The lock that serializes imports, builds and removals of one catalog key.
    fn image_lock(&self, key: &str) -> Result<Arc<tokio::sync::Mutex<()>>, Error> {
        let mut locks = self.image_locks.lock().map_err(|_| Error::Internal("image lock table poisoned".into()))?;
        locks.retain(|_, l| Arc::strong_count(l) > 1);
        Ok(locks.entry(key.to_string()).or_default().clone())
    }

    /// FAILED_PRECONDITION naming what of `tenant`'s uses the image stored under `key` (its
    /// sandboxes and snapshots by id), if anything does. Other tenants' are neither named nor
    /// counted: only a shared image can have any, and the admin removing it learns only that
    /// there are some. Called under the image gate's write lock.
    fn refuse_if_used(&self, tenant: &str, key: &str, doing: &str) -> Result<(), Error> {
        let mut mine = Vec::new();
        let mut others = false;
        {
            let map = self.sandboxes.read().map_err(|_| Error::Internal("sandbox table poisoned".into()))?;
            for info in map.values().filter_map(|e| e.info().ok()).filter(|i| i.image == key) {
                if info.tenant == tenant {
                    mine.push(format!("sandbox {}", info.id));
                } else {
                    others = true;
                }
            }
        }
        for snap in self.store.snapshots(None)?.into_iter().filter(|s| s.image == key) {
            if snap.tenant == tenant {
                mine.push(format!("snapshot {}", snap.snapshot_id));
            } else {
                others = true;
            }
        }
        if mine.is_empty() && !others {
            return Ok(());
        }
        mine.sort();
        let mut users = mine.join(", ");
        if others {
            if !users.is_empty() {
                users.push_str(" and ");
            }
            users.push_str("sandboxes or snapshots of other tenants");
        }
        let name = display_name(key);
        Err(Error::FailedPrecondition(format!(
            "cannot {doing} image {name:?}: it is in use by {users}; destroy those sandboxes and delete those snapshots first"
        )))
    }

    /// Removes an image of `viewer`'s (or, for an image admin, a shared import): refused while
    /// any sandbox or snapshot uses it, and for the operator's script-built images. Another
    /// tenant's image is NOT_FOUND. Returns the bytes of image files freed.
    #[tracing::instrument(name = "manager.remove_image", skip_all)]
    pub async fn remove_image(&self, viewer: &Viewer, name: &str) -> Result<u64, Error> {
        let key = self.catalog.find(viewer, name)?.name;
        let lock = self.image_lock(&key)?;
        let _named = lock.lock().await;
        let (trash, freed) = {
            // No create starts from the image while its tiers' copies and then its files go.
            let _gate = self.image_gate.write().await;
            let Some(img) = self.catalog.imported(&key) else {
                if self.catalog.is_script_built(&key) {
                    return Err(Error::FailedPrecondition(format!(
                        "image {name:?} is built by the operator's image scripts into the images dir; the daemon never removes those (delete its directory there instead)"
                    )));
                }
                return Err(self.catalog.not_found_for(viewer, name).into());
            };
            let json = img.json();
            if owner::split_key(&key).1.is_none() && json.shared && !viewer.admin {
                return Err(Error::PermissionDenied(format!(
                    "image {name:?} is shared with every tenant; only an image admin removes it (images.admin_tenants)"
                )));
            }
            self.refuse_if_used(&viewer.tenant, &key, "remove")?;
            self.remove_tier_copies(&key).await;
            (self.catalog.take_out(&key)?, json.size_bytes)
        };
        self.image_store.forget(&key);
        let removed = tokio::task::spawn_blocking(move || catalog::remove_any(&trash)).await;
        if let Err(e) = removed {
            tracing::warn!(image = name, error = %e, "removing an image's files");
        }
        tracing::info!(tenant = %viewer.tenant, image = name, freed_bytes = freed, "image removed");
        Ok(freed)
    }

    /// Imports an image (see the module documentation); the events end with `done` or an error.
    /// A `docker:` import needs an image admin unless the operator lists the reference
    /// (`images.docker_import_allowed`): the host's Docker holds the operator's images too.
    pub fn import_image(self: &Arc<Self>, viewer: &Viewer, req: ImportRequest) -> Result<ImageEvents, Error> {
        check_name(&req.name)?;
        if req.shared && !viewer.admin {
            return Err(Error::PermissionDenied("only an image admin shares an image with every tenant (images.admin_tenants)".into()));
        }
        if let ImportSource::Docker(reference) = &req.source {
            if reference.is_empty() || reference.len() > 512 || reference.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(Error::invalid("docker_image", "a Docker image reference: 1-512 characters, no spaces"));
            }
            if !viewer.admin && !self.cfg.images.docker_import_allowed.iter().any(|r| r == reference) {
                return Err(Error::PermissionDenied(format!(
                    "importing {:?} from the host's Docker needs an image admin; the operator lists the images anyone may import in images.docker_import_allowed",
                    reference.chars().take(200).collect::<String>()
                )));
            }
        }
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let manager = self.clone();
        let viewer = viewer.clone();
        tokio::spawn(async move {
            let report = Reporter(tx.clone());
            let result = manager.run_import(&viewer, req, &report).await;
            finish(&tx, result).await;
        });
        Ok(ReceiverStream::new(rx))
    }

    /// Builds an image with the local Docker Engine and imports the result as `viewer`'s.
    pub fn build_image(self: &Arc<Self>, viewer: &Viewer, req: BuildRequest) -> Result<ImageEvents, Error> {
        if req.name.is_empty() {
            return Err(Error::invalid("name", "a build needs the name of its image"));
        }
        check_name(&req.name)?;
        if self.catalog.is_script_built(&req.name) {
            return Err(Error::FailedPrecondition(format!(
                "image {:?} is a script-built image of the operator's images dir; build under another name",
                req.name
            )));
        }
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let manager = self.clone();
        let viewer = viewer.clone();
        tokio::spawn(async move {
            let report = Reporter(tx.clone());
            let result = manager.run_build(&viewer, req, &report).await;
            finish(&tx, result).await;
        });
        Ok(ReceiverStream::new(rx))
    }

    /// A slot for an import or build of `tenant`: one of its own
    /// `images.max_concurrent_per_tenant`, then one of the daemon's `images.max_concurrent`,
    /// saying so while it waits. A tenant waits for its own slots before it takes a shared
    /// one, and can never hold all of those, so its builds never block another tenant.
    async fn image_slot(&self, tenant: &str, report: &Reporter) -> Result<Slot, Error> {
        let closed = |_| Error::Internal("image job slots closed".into());
        let own = {
            let mut map = self.tenant_image_jobs.lock().map_err(|_| Error::Internal("image slot table poisoned".into()))?;
            map.retain(|_, s| Arc::strong_count(s) > 1 || s.available_permits() < self.cfg.images.max_concurrent_per_tenant);
            map.entry(tenant.to_string()).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.cfg.images.max_concurrent_per_tenant))).clone()
        };
        let own = match own.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                report
                    .say(
                        "receive",
                        format!(
                            "waiting: {} of your imports or builds are running (images.max_concurrent_per_tenant)",
                            self.cfg.images.max_concurrent_per_tenant
                        ),
                    )
                    .await;
                own.acquire_owned().await.map_err(closed)?
            }
        };
        let shared = match self.image_jobs.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                report.say("receive", format!("waiting: {} imports or builds are running (images.max_concurrent)", self.cfg.images.max_concurrent)).await;
                self.image_jobs.clone().acquire_owned().await.map_err(closed)?
            }
        };
        Ok(Slot { _own: own, _shared: shared })
    }

    async fn run_import(&self, viewer: &Viewer, req: ImportRequest, report: &Reporter) -> Result<ImageRecord, Error> {
        let started = Instant::now();
        let tenant = viewer.tenant.as_str();
        // Declared first, dropped last: the claim covers the upload file until it is gone.
        let mut claim = self.image_store.claim(tenant)?;
        let upload = TempFile(self.catalog.upload_path());
        let (spec, permit) = match req.source {
            ImportSource::Docker(reference) => {
                let permit = self.image_slot(tenant, report).await?;
                let id = self.engine.image_id(&reference).await?;
                report.say("export", format!("exporting {reference} ({}) from the local Docker Engine", short(&id))).await;
                self.export(&id, &upload.0, &mut claim, report).await?;
                let spec = ImportSpec {
                    name: req.name,
                    name_hint: reference.clone(),
                    source: format!("docker:{reference}"),
                    viewer: viewer.clone(),
                    shared: req.shared,
                };
                (spec, permit)
            }
            ImportSource::Archive { file_name, size, data } => {
                // The bytes are received before a slot is taken: a slow client holds no slot.
                receive(data, &upload.0, size, self.cfg.images.max_archive_bytes, &mut claim, report).await?;
                let permit = self.image_slot(tenant, report).await?;
                let stem = Path::new(&file_name).file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
                let source = format!("archive:{}", file_name.chars().take(200).collect::<String>());
                let spec = ImportSpec { name: req.name, name_hint: stem, source, viewer: viewer.clone(), shared: req.shared };
                (spec, permit)
            }
        };
        tracing::info!(tenant, source = %spec.source, ms = started.elapsed().as_millis() as u64, "image archive received");
        let record = self.finish_import(tenant, spec, &upload.0, &mut claim, report).await;
        drop(permit);
        record
    }

    /// The Docker image ID of each catalog image the checked Dockerfile names, as `viewer`
    /// sees it, made to exist in Docker first (NOT_FOUND for an image `viewer` cannot use).
    async fn pin_bases(
        &self,
        viewer: &Viewer,
        checked: &build::Checked,
        container: &Arc<dyn crate::backend::Backend>,
        report: &Reporter,
    ) -> Result<HashMap<String, String>, Error> {
        let mut pinned = HashMap::new();
        for name in checked.catalog_names() {
            let img = self.catalog.find(viewer, &name)?;
            container.prepare_image(&img.name).await?;
            let reference = engine::docker_reference(&img.name, engine::stable_hash(&img.meta));
            let id = self.engine.image_id(&reference).await?;
            report.say("build", format!("FROM sandboxd/{name}: the catalog image {name}, as Docker image {}", short(&id))).await;
            pinned.insert(name, id);
        }
        Ok(pinned)
    }

    async fn run_build(&self, viewer: &Viewer, req: BuildRequest, report: &Reporter) -> Result<ImageRecord, Error> {
        let tenant = viewer.tenant.as_str();
        let mut claim = self.image_store.claim(tenant)?;
        let context = TempFile(self.catalog.upload_path());
        receive(req.data, &context.0, req.size, self.cfg.images.max_archive_bytes, &mut claim, report).await?;
        let permit = self.image_slot(tenant, report).await?;
        let dockerfile = if req.dockerfile.is_empty() { "Dockerfile".to_string() } else { req.dockerfile };
        let text = {
            let (path, file) = (context.0.clone(), dockerfile.clone());
            tokio::task::spawn_blocking(move || build::dockerfile_of(&path, &file))
                .await
                .map_err(|e| Error::Internal(format!("reading the Dockerfile: {e}")))??
        };
        // Everything a build could reach beyond its context is refused before Docker sees it.
        let checked = build::check(&text)?;
        // What cannot run boxed (RUN flags, ONBUILD) and a network the daemon gives no build,
        // refused before anything is made.
        steps::plan(&text)?;
        let network = self.build_network(req.network)?;
        let container = self.backends.available(Isolation::Container).map_err(|e| Error::FailedPrecondition(format!("BuildImage needs Docker: {e}")))?.clone();
        let pinned = self.pin_bases(viewer, &checked, &container, report).await?;
        let plan = steps::plan(&checked.pinned(&pinned))?;
        let id = crate::ids::SandboxId::generate().as_str().trim_start_matches("sb-").to_ascii_lowercase();
        let i = &self.cfg.images;
        let limits = Limits {
            cpu_millicores: i.build_cpu_millicores,
            memory_bytes: i.build_memory_bytes,
            max_pids: i.build_max_pids,
            disk_bytes: i.max_rootfs_bytes,
            exec_timeout_ms: i.build_timeout_ms,
            shm_bytes: i.build_shm_bytes,
        };
        let started = Instant::now();
        report
            .say(
                "build",
                format!(
                    "building: each RUN step in a container sandbox (network {}, {} memory, {} CPU, {} processes), the other instructions by the local Docker Engine; at most {}",
                    network.mode.name(),
                    human(i.build_memory_bytes),
                    f64::from(i.build_cpu_millicores) / 1000.0,
                    i.build_max_pids,
                    humantime::format_duration(Duration::from_millis(i.build_timeout_ms))
                ),
            )
            .await;
        let (log_tx, mut log_rx) = mpsc::channel::<String>(64);
        let forward = {
            let report = report.clone();
            tokio::spawn(async move {
                while let Some(line) = log_rx.recv().await {
                    if !report.say("build", line).await {
                        break;
                    }
                }
            })
        };
        let tags = Arc::new(std::sync::Mutex::new(Vec::new()));
        let builder = StepBuilder {
            engine: &self.engine,
            backend: container,
            id: id.clone(),
            context: context.0.clone(),
            scratch_dir: self.catalog.upload_path().parent().map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir),
            build_args: req.build_args,
            tenant: tenant.to_string(),
            image_name: req.name.clone(),
            limits,
            network,
            timeout: Duration::from_millis(i.build_timeout_ms),
            log: log_tx,
            tags: tags.clone(),
        };
        // A client that goes away stops the build even while a step prints nothing; a stopped
        // step's sandbox is destroyed with everything it started.
        let building = async {
            tokio::select! {
                r = builder.run(&plan) => r,
                () = report.0.closed() => Err(ImageError::Aborted("the client went away during the build".into()).into()),
            }
        };
        let built = match tokio::time::timeout(Duration::from_millis(i.build_timeout_ms), building).await {
            Ok(r) => r,
            Err(_) => Err(ImageError::Limit {
                what: "the build".into(),
                limit: humantime::format_duration(Duration::from_millis(i.build_timeout_ms)).to_string(),
                key: "build_timeout_ms",
            }
            .into()),
        };
        drop(builder);
        let _ = forward.await;
        drop(context);
        let tag = format!("{BUILD_REPO}:{id}");
        let result = async {
            let image = built?;
            self.engine.tag(&image, BUILD_REPO, &id).await?;
            tags.lock().map_err(|_| Error::Internal("build tag list poisoned".into()))?.push(tag.clone());
            tracing::info!(tenant, image = %req.name, ms = started.elapsed().as_millis() as u64, "build finished");
            report.say("build", format!("built in {} ms", started.elapsed().as_millis())).await;
            let export = TempFile(self.catalog.upload_path());
            self.export(&tag, &export.0, &mut claim, report).await?;
            // The intermediate images go before the (long) import: Docker keeps nothing of ours.
            self.remove_build_tags(&tags).await;
            let spec = ImportSpec {
                name: req.name.clone(),
                name_hint: req.name.clone(),
                source: format!("build:{}", req.name),
                viewer: viewer.clone(),
                shared: false,
            };
            self.finish_import(tenant, spec, &export.0, &mut claim, report).await
        }
        .await;
        self.remove_build_tags(&tags).await;
        drop(permit);
        result
    }

    /// The network of a build's RUN steps: none, unless the operator lets builds have the one
    /// the policy gives a container sandbox of the caller (what the build asks, within the
    /// ceilings).
    fn build_network(&self, asked: Option<NetworkPolicy>) -> Result<NetworkPolicy, Error> {
        match self.cfg.images.build_network {
            BuildNetwork::None => match asked {
                Some(n) if n.mode != NetworkMode::None => Err(Error::FailedPrecondition(format!(
                    "this daemon gives builds no network ([images] build_network = \"none\"); the build asked for {}",
                    n.mode.name()
                ))),
                _ => Ok(NetworkPolicy::default()),
            },
            BuildNetwork::Policy => {
                let decision = self.cfg.policy.decide(Some(Isolation::Container), &BTreeMap::new()).map_err(|e| Error::PermissionDenied(e.to_string()))?;
                decision.network(asked).map_err(|e| Error::PermissionDenied(e.to_string()))
            }
        }
    }

    /// Removes the build's intermediate Docker tags, newest first (so each image is a leaf
    /// when its tag goes, and goes with it).
    async fn remove_build_tags(&self, tags: &std::sync::Mutex<Vec<String>>) {
        let all: Vec<String> = match tags.lock() {
            Ok(mut t) => t.drain(..).rev().collect(),
            Err(_) => return,
        };
        for tag in all {
            self.remove_build_tag(&tag).await;
        }
    }

    async fn remove_build_tag(&self, tag: &str) {
        if let Err(e) = self.engine.remove(tag).await {
            tracing::warn!(image = %tag, error = %e, "removing a build's intermediate Docker image");
        }
    }

    /// Exports (`docker save`) `reference` from Docker into `dest`, counted against the image store's budget
    /// once written (the export is bounded by `images.max_archive_bytes` while it runs).
    async fn export(&self, reference: &str, dest: &Path, claim: &mut Claim, report: &Reporter) -> Result<u64, Error> {
        let started = Instant::now();
        let (bytes_tx, mut bytes_rx) = tokio::sync::watch::channel(0u64);
        let forward = {
            let report = report.clone();
            tokio::spawn(async move {
                while bytes_rx.changed().await.is_ok() {
                    let bytes = *bytes_rx.borrow_and_update();
                    report.send(ImageProgress { phase: "export", message: format!("{} exported", human(bytes)), bytes, ..Default::default() }).await;
                    tokio::time::sleep(REPORT_EVERY).await;
                }
            })
        };
        let result = self
            .engine
            .export(reference, dest, self.cfg.images.max_archive_bytes, |n| {
                bytes_tx.send_replace(n);
            })
            .await;
        drop(bytes_tx);
        let _ = forward.await;
        let bytes = result?;
        claim.grow(bytes)?;
        claim.check_free()?;
        report.say("export", format!("{} exported in {} ms", human(bytes), started.elapsed().as_millis())).await;
        Ok(bytes)
    }

    /// Stages the archive at `path`, puts it in the catalog, and prepares every tier.
    /// `claim` holds what the import wrote so far; the staged rootfs is added to it, and the
    /// store is measured again once the image is in place.
    async fn finish_import(&self, tenant: &str, spec: ImportSpec, path: &Path, claim: &mut Claim, report: &Reporter) -> Result<ImageRecord, Error> {
        let started = Instant::now();
        let prepared = {
            let (catalog, cfg, path) = (self.catalog.clone(), self.cfg.images.clone(), path.to_path_buf());
            let room = self.image_store.room(tenant);
            let tx = report.0.clone();
            let closed = tx.clone();
            tokio::task::spawn_blocking(move || {
                import::stage(&catalog, &cfg, room, &path, &spec, &mut |event| tx.blocking_send(Ok(event)).is_ok(), &|| closed.is_closed())
            })
            .await
            .map_err(|e| Error::Internal(format!("image import task: {e}")))??
        };
        if let Prepared::Staged(staged) = &prepared {
            // Another import may have taken the same room meanwhile; a failure drops `staged`,
            // which removes its dir.
            claim.grow(staged.json.size_bytes)?;
            claim.check_free()?;
        }
        let layers_ms = started.elapsed().as_millis();
        let name = match &prepared {
            Prepared::Unchanged { name, .. } => name.clone(),
            Prepared::Staged(staged) => staged.name.clone(),
        };
        // Held through the tiers' preparation too: two imports of one name never build one base
        // disk at once.
        let lock = self.image_lock(&name)?;
        let _named = lock.lock().await;
        match prepared {
            Prepared::Unchanged { name, digest } => {
                report.say("metadata", format!("image {} is already imported with digest {digest}: nothing to do", display_name(&name))).await;
            }
            Prepared::Staged(staged) => {
                let replaced = {
                    let _gate = self.image_gate.write().await;
                    if self.catalog.imported(&name).is_some() {
                        // Nothing may use the old image, and what the tiers made of it goes.
                        self.refuse_if_used(tenant, &name, "replace")?;
                        self.remove_tier_copies(&name).await;
                    }
                    self.catalog.commit(&staged.dir, &name)?
                };
                if let Some(old) = replaced {
                    let _ = tokio::task::spawn_blocking(move || catalog::remove_any(&old)).await;
                }
                let j = &staged.json;
                report
                    .say(
                        "metadata",
                        format!(
                            "image {} {}: {} in {} entries, {} layers ({layers_ms} ms)",
                            display_name(&name),
                            short(&j.digest),
                            human(j.size_bytes),
                            j.entries,
                            j.layers
                        ),
                    )
                    .await;
            }
        }
        self.prepare_tiers(&name, report).await;
        let (store, measured) = (self.image_store.clone(), name.clone());
        if let Err(e) = tokio::task::spawn_blocking(move || store.measure(&measured)).await {
            tracing::warn!(image = %name, error = %e, "measuring the image store");
        }
        tracing::info!(tenant, image = %name, ms = started.elapsed().as_millis() as u64, "image imported");
        Ok(self.with_ready_tiers(&name, self.catalog.record(&name)?))
    }

    /// Frees what every tier made of the image (failures are logged: the image goes anyway,
    /// and a leftover Docker image or base disk is only space).
    async fn remove_tier_copies(&self, name: &str) {
        for backend in self.backends.all() {
            if let Err(e) = backend.remove_image(name).await {
                tracing::warn!(image = name, tier = backend.isolation().name(), error = %e, "removing a tier's copy of an image");
            }
        }
    }

    /// Asks every tier to prepare the image; a tier that cannot is reported, not an error.
    async fn prepare_tiers(&self, name: &str, report: &Reporter) {
        for tier in Isolation::ALL {
            let phase = match tier {
                Isolation::Process => "process",
                Isolation::Container => "container",
                Isolation::MicroVm => "microvm",
            };
            let started = Instant::now();
            let outcome = match self.backends.available(tier) {
                Ok(backend) => backend.prepare_image(name).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let ms = started.elapsed().as_millis() as u64;
            match outcome {
                Ok(detail) => {
                    tracing::info!(image = name, tier = tier.name(), ms, %detail, "image prepared");
                    report.say(phase, format!("{detail} ({ms} ms)")).await;
                }
                Err(reason) => {
                    tracing::warn!(image = name, tier = tier.name(), %reason, "image not ready on this tier");
                    report.say(phase, format!("not ready: {reason}")).await;
                }
            }
        }
    }
}

/// A requested name: empty (derived later) or valid.
fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty() {
        return Ok(());
    }
    validate_image(name).map_err(|e| match e {
        Error::InvalidArgument { message, .. } => Error::invalid("name", message),
        e => e,
    })
}

/// The first 12 hex digits of a digest.
fn short(digest: &str) -> String {
    digest.trim_start_matches("sha256:").chars().take(12).collect()
}

/// The last event of an import: `done` with the image, or the error.
async fn finish(tx: &mpsc::Sender<Result<ImageProgress, Error>>, result: Result<ImageRecord, Error>) {
    let last = result.map(|record| ImageProgress {
        phase: "done",
        message: format!("image {} ready", record.name),
        done: Some(Box::new(record)),
        ..Default::default()
    });
    if let Err(e) = &last {
        tracing::info!(error = %e, "image import or build failed");
    }
    let _ = tx.send(last).await;
}

/// Writes an upload's pieces to `path` (at most `max` bytes) until `Commit`; a channel that
/// closes before it is an upload that did not complete.
async fn receive(mut data: mpsc::Receiver<UploadPiece>, path: &Path, size: u64, max: u64, claim: &mut Claim, report: &Reporter) -> Result<u64, Error> {
    let started = Instant::now();
    if size > max {
        return Err(Error::ResourceExhausted(format!("the archive is {}; at most {} (images.max_archive_bytes)", human(size), human(max))));
    }
    claim.fits(size)?;
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .await
        .map_err(|e| Error::from(ImageError::io("creating the upload file", e)))?;
    let mut total = 0u64;
    let mut reported = Instant::now();
    loop {
        match data.recv().await {
            Some(UploadPiece::Data(bytes)) => {
                total += bytes.len() as u64;
                if total > max {
                    return Err(Error::ResourceExhausted(format!("the archive is over {} (images.max_archive_bytes)", human(max))));
                }
                // Counted before it is written: a full store stops the upload here.
                claim.grow(bytes.len() as u64)?;
                if total / FREE_CHECK_EVERY != (total - bytes.len() as u64) / FREE_CHECK_EVERY {
                    claim.check_free()?;
                }
                file.write_all(&bytes).await.map_err(|e| Error::from(ImageError::io("writing the upload", e)))?;
                if reported.elapsed() >= REPORT_EVERY {
                    reported = Instant::now();
                    report
                        .send(ImageProgress {
                            phase: "receive",
                            message: format!("{} received", human(total)),
                            bytes: total,
                            total_bytes: size,
                            ..Default::default()
                        })
                        .await;
                }
            }
            Some(UploadPiece::Commit) => break,
            None => return Err(Error::Aborted("the upload did not complete".into())),
        }
    }
    file.flush().await.map_err(|e| Error::from(ImageError::io("writing the upload", e)))?;
    let ms = started.elapsed().as_millis();
    report
        .send(ImageProgress {
            phase: "receive",
            message: format!("{} received in {ms} ms", human(total)),
            bytes: total,
            total_bytes: size.max(total),
            ..Default::default()
        })
        .await;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::super::fake::fake_manager;
    use crate::error::Error;
    use crate::model::{CreateRequest, ExecRequest};

    #[tokio::test]
    async fn an_images_config_sets_the_defaults_and_removal_waits_for_its_users() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = fake_manager(dir.path(), 8 << 30, "");
        let py = dir.path().join("images/py");
        std::fs::create_dir_all(py.join("rootfs")).expect("mkdir");
        let json = r#"{"name":"py","owner":"t","digest":"sha256:00","size_bytes":9,"config":{"env":{"LANG":"en_US.UTF-8","A":"1","B":"image"},"workdir":"/app","user":"app"}}"#;
        std::fs::write(py.join("image.json"), json).expect("write");
        let (t, other) = (m.image_viewer("t", false), m.image_viewer("other", false));
        assert_eq!(m.list_images(&t).expect("list").iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["minimal", "py"]);
        // Another tenant's image: not listed, NOT_FOUND to get, create from or remove.
        assert_eq!(m.list_images(&other).expect("list").iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["minimal"]);
        for err in [
            m.get_image(&other, "py").expect_err("another tenant's"),
            m.create("other", CreateRequest { image: "py".into(), ..Default::default() }).await.expect_err("another tenant's"),
            m.remove_image(&other, "py").await.expect_err("another tenant's"),
        ] {
            assert!(matches!(&err, Error::ImageNotFound { available, .. } if available == &["minimal".to_string()]), "{err}");
        }

        let env = std::collections::BTreeMap::from([("B".to_string(), "sandbox".to_string())]);
        let sb = m.create("t", CreateRequest { image: "py".into(), env, ..Default::default() }).await.expect("create");
        assert_eq!((sb.workdir.as_str(), sb.image_config.user.as_str(), sb.user.as_deref()), ("/app", "app", Some("app")), "the image's USER runs execs");
        let root = m.create("t", CreateRequest { image: "py".into(), user: "0".into(), ..Default::default() }).await.expect("create as root");
        assert_eq!(root.user.as_deref(), Some("0"), "a request's user wins over the image's");
        m.destroy("t", root.id.as_str()).await.expect("destroy");
        let run = |id: String| ExecRequest { sandbox_id: id, argv: vec!["env".into()], ..Default::default() };
        let out = String::from_utf8(m.exec("t", run(sb.id.to_string())).await.expect("exec").outcome.stdout.bytes).expect("utf8");
        for line in ["LANG=en_US.UTF-8", "A=1", "B=sandbox", "PATH="] {
            assert!(out.lines().any(|l| l.starts_with(line)), "{line} in {out}");
        }
        // A script-built image has no config: LANG is C.UTF-8, the workdir /workspace.
        let plain = m.create("t", CreateRequest::default()).await.expect("create");
        assert_eq!(plain.workdir, "/workspace");
        let out = String::from_utf8(m.exec("t", run(plain.id.to_string())).await.expect("exec").outcome.stdout.bytes).expect("utf8");
        assert!(out.lines().any(|l| l == "LANG=C.UTF-8"), "{out}");

        let err = m.remove_image(&t, "py").await.expect_err("in use");
        assert!(matches!(&err, Error::FailedPrecondition(m) if m.contains(sb.id.as_str())), "{err}");
        let err = m.remove_image(&t, "minimal").await.expect_err("script-built");
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        m.destroy("t", sb.id.as_str()).await.expect("destroy");
        assert_eq!(m.remove_image(&t, "py").await.expect("remove"), 9);
        assert!(!py.exists());
        for err in [
            m.remove_image(&t, "py").await.expect_err("gone"),
            m.create("t", CreateRequest { image: "py".into(), ..Default::default() }).await.expect_err("gone"),
        ] {
            assert!(matches!(&err, Error::ImageNotFound { available, .. } if available == &["minimal".to_string()]), "{err}");
        }
    }
}
