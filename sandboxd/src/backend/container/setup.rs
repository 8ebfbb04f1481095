//! Making a container sandbox exist: the recipe, and finding the container's cgroup afterwards.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig, RestartPolicy, RestartPolicyNameEnum};
use bollard::query_parameters::CreateContainerOptions;

use super::docker::{self, api_error, LABEL_ID, LABEL_IMAGE, LABEL_OWNER, LABEL_STANDBY};
use super::process_cgroup::CgroupRoot;
use super::{layer, ContainerSandbox, DiskLimits, Inner};
use crate::backend::{BackendError, SandboxSpec};
use crate::ids::SnapshotId;

/// Capabilities a container keeps: the same set as the process tier — Docker's default minus
/// `MKNOD` (device nodes a sandbox makes could be opened by a careless host tool) and `NET_RAW`
/// (no network anyway). Everything else is dropped.
const KEPT_CAPS: [&str; 11] = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "SETFCAP"];

/// The container's main process under docker-init: the exec helper serving the daemon's exec
/// requests (see `exec.rs`). It keeps the container up and needs nothing from the image (no
/// shell, no `sleep`).
const KEEPALIVE: [&str; 2] = [super::exec::HELPER_IN_CONTAINER, "--serve"];
/// The keepalive with `[container] exec_through_docker` (and of containers made before the exec
/// channel): it only waits for signals.
const KEEPALIVE_WITHOUT_CHANNEL: [&str; 2] = [super::exec::HELPER_IN_CONTAINER, "--pause"];

/// Docker refuses a CPU limit below 0.01 CPU.
const MIN_NANO_CPUS: i64 = 10_000_000;

/// Docker's default read-only paths (20.10; setting the list replaces Docker's, so they are
/// repeated), plus:
/// * `/sys/fs/cgroup`: Docker mounts the container's own cgroups read-only there but leaves the
///   tmpfs holding them writable;
/// * `/etc/hosts`, `/etc/hostname`, `/etc/resolv.conf`: Docker binds them writable from files of
///   its own directory on the host (`/var/lib/docker/containers/<id>/`), outside any bound on
///   what the sandbox writes — a sandbox could fill the host's disk through `/etc/hosts`.
const READONLY_PATHS: [&str; 9] =
    ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger", "/sys/fs/cgroup", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"];

/// Where glibc reads the number of online CPUs (`sysconf(_SC_NPROCESSORS_ONLN)`, Python's
/// `os.cpu_count()`); a file saying the container's CPU set is bound over it.
const CPU_ONLINE: &str = "/sys/devices/system/cpu/online";

/// What a container is told about itself beyond its limits: its CPUs, and the host file that
/// lists them for its `/sys/devices/system/cpu/online`.
pub(super) struct Placement {
    pub cpus: crate::backend::cpus::CpuLease,
    pub online_file: PathBuf,
}

/// What a container is for.
#[derive(Debug, Clone)]
pub enum Role {
    /// It serves the sandbox now.
    Active,
    /// A standby started from a snapshot, swapped in by a rollback (see `snapshot.rs`).
    Standby(SnapshotId),
    /// A RUN step of a build, on the Docker image `image` (the build so far), see `build.rs`;
    /// `as_root`: the image has a USER, which the keepalive must not run as.
    BuildStep { image: String, as_root: bool },
}

impl Role {
    fn name(&self, spec: &SandboxSpec) -> String {
        match self {
            Role::Active | Role::BuildStep { .. } => docker::active_name(&spec.id),
            Role::Standby(snap) => format!("{}-standby-{snap}", docker::active_name(&spec.id)),
        }
    }
}

fn host_config(spec: &SandboxSpec, disk: Option<u64>, helper_dir: &std::path::Path, placement: &Placement) -> HostConfig {
    let l = &spec.limits;
    let memory = i64::try_from(l.memory_bytes).unwrap_or(i64::MAX);
    let nano_cpus = (i64::from(l.cpu_millicores) * 1_000_000).max(MIN_NANO_CPUS);
    HostConfig {
        // Memory and memory+swap equal: the limit cannot be escaped by swapping.
        memory: Some(memory),
        memory_swap: Some(memory),
        pids_limit: Some(i64::from(l.max_pids)),
        nano_cpus: Some(nano_cpus),
        // The CPUs programs see (nproc, os.cpu_count(), the JVM): the limit rounded up, spread
        // over the host with the process tier's sandboxes. The CFS quota above stays the limit.
        cpuset_cpus: Some(placement.cpus.list()),
        // /dev/shm from the limits (half of the memory by default). Its pages are charged to
        // the memory cgroup of the container process that writes them, so this is a share of
        // the memory limit, never more memory.
        shm_size: Some(i64::try_from(l.shm_size()).unwrap_or(i64::MAX)),
        // The hostname resolves: Docker writes it into /etc/hosts with the container's address,
        // and with network `none` there is none, so it is given the loopback one the other
        // tiers use.
        extra_hosts: Some(vec![format!("{}:{}", spec.id, sandbox_exec::etc::SELF_ADDRESS)]),
        readonly_paths: Some(READONLY_PATHS.iter().map(|p| p.to_string()).collect()),
        cap_drop: Some(vec!["ALL".to_string()]),
        cap_add: Some(KEPT_CAPS.iter().map(|c| c.to_string()).collect()),
        // The process tier's seccomp list as a profile (see `backend::seccomp`): Docker's own
        // default differs between Engine versions, and 20.10's still allows io_uring.
        security_opt: Some(vec!["no-new-privileges".to_string(), format!("seccomp={}", crate::backend::seccomp::docker_profile())]),
        // docker-init (tini) as PID 1 reaps the zombies execs leave behind.
        init: Some(true),
        network_mode: Some("none".to_string()),
        // The keepalive prints nothing and exec output is captured by the daemon: no log files.
        log_config: Some(HostConfigLogConfig { typ: Some("none".to_string()), config: None }),
        restart_policy: Some(RestartPolicy { name: Some(RestartPolicyNameEnum::NO), maximum_retry_count: None }),
        storage_opt: disk.map(|bytes| HashMap::from([("size".to_string(), bytes.to_string())])),
        // Read-only: nothing in the container can replace how its commands are started.
        binds: Some(vec![
            format!("{}:{}:ro", helper_dir.display(), super::exec::HELPER_DIR_IN_CONTAINER),
            format!("{}:{CPU_ONLINE}:ro", placement.online_file.display()),
        ]),
        ..Default::default()
    }
}

/// The host ids of the user namespace process `pid` runs in (`/proc/<pid>/uid_map` and
/// `gid_map`): `None` for the host's own (Docker without `--userns-remap`), else the one range
/// both maps give. Maps of several ranges, or uid and gid ranges that differ, are refused: the
/// daemon would make files with the wrong owners.
fn remapped_ids(pid: i32) -> Result<Option<sandbox_exec::archive::IdShift>, String> {
    let read = |name: &str| std::fs::read_to_string(format!("/proc/{pid}/{name}")).map_err(|e| format!("reading /proc/{pid}/{name}: {e}"));
    let (uid, gid) = (parse_id_map(&read("uid_map")?)?, parse_id_map(&read("gid_map")?)?);
    if uid != gid {
        return Err(format!("Docker's remapped uid range {uid:?} and gid range {gid:?} differ; give dockremap the same subordinate uids and gids"));
    }
    Ok(uid
        .filter(|(inside, outside, len)| !(*inside == 0 && *outside == 0 && *len == u32::MAX))
        .map(|(_, base, len)| sandbox_exec::archive::IdShift { base, len }))
}

/// The single range `inside outside length` of an id map (`None` when the map is empty).
fn parse_id_map(text: &str) -> Result<Option<(u32, u32, u32)>, String> {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.as_slice() {
        [] => Ok(None),
        [line] => {
            let n: Vec<u32> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
            match n.as_slice() {
                [0, outside, len] => Ok(Some((0, *outside, *len))),
                _ => Err(format!("an id map this daemon cannot use: {line:?} (root inside must be its first id)")),
            }
        }
        _ => Err(format!("an id map of {} ranges; this daemon handles one", lines.len())),
    }
}

/// Whether a create failed because the storage driver cannot limit the writable layer.
fn is_storage_opt_refusal(e: &bollard::errors::Error) -> bool {
    let text = e.to_string().to_lowercase();
    text.contains("storage-opt") || text.contains("storageopt") || text.contains("storage opt") || text.contains("quota")
}

/// Parses `/proc/<pid>/cgroup` into the path of the hierarchy holding `controller` (v1), or the
/// unified path (v2) — relative, without the leading `/`.
fn cgroup_path(proc_cgroup: &str, controller: &str) -> Option<String> {
    let mut unified = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == controller) {
            return Some(path.trim_start_matches('/').to_string());
        }
        if controllers.is_empty() {
            unified = Some(path.trim_start_matches('/').to_string());
        }
    }
    unified
}

impl Inner {
    fn disk_limits(&self) -> DiskLimits {
        self.disk_limits.lock().map(|d| *d).unwrap_or(DiskLimits::Unsupported)
    }

    fn set_disk_limits(&self, value: DiskLimits) {
        if let Ok(mut d) = self.disk_limits.lock() {
            *d = value;
        }
    }

    /// Creates and starts the container of `spec` in `role`, its writable layer copied from
    /// `layer` when given (a fork, rollback or standby). On failure nothing is left behind.
    pub(super) async fn launch(
        self: &Arc<Self>,
        spec: &SandboxSpec,
        role: &Role,
        layer_from: Option<&SnapshotId>,
    ) -> Result<Arc<ContainerSandbox>, BackendError> {
        let docker = self.docker()?;
        let image = match role {
            Role::BuildStep { image, .. } => image.clone(),
            Role::Active | Role::Standby(_) => self.images.ensure(docker, &self.cfg.catalog, &spec.image).await?,
        };
        let name = role.name(spec);
        // Held until the container is attached, which then holds its CPUs (see `attach`).
        let placement = self.place(spec)?;
        let container_id = self.create_container(spec, role, &image, &name, &placement).await?;
        match self.start_created(spec, &container_id, layer_from).await {
            Ok(sb) => Ok(sb),
            Err(e) => {
                self.remove_container(&container_id).await;
                Err(e)
            }
        }
    }

    /// The CPUs of a new container of `spec`, and the file listing them (one per CPU list under
    /// the state dir, kept: a re-adopted container is restarted with the same bind).
    fn place(&self, spec: &SandboxSpec) -> Result<Placement, BackendError> {
        let cpus = crate::backend::cpus::place(spec.limits.cpu_millicores);
        let online_file = self.cpu_online_file(&cpus.list())?;
        Ok(Placement { cpus, online_file })
    }

    /// `<state>/container/cpus-online/<list>`, holding `<list>`; written once, read-only.
    fn cpu_online_file(&self, list: &str) -> Result<PathBuf, BackendError> {
        let dir = self.cfg.state_dir.join("container").join("cpus-online");
        let path = dir.join(list);
        if !path.is_file() {
            std::fs::create_dir_all(&dir).map_err(|e| BackendError::io(format!("creating {}", dir.display()), e))?;
            // Written aside and renamed, so a container never binds a half-written file.
            // A name of its own per write: two creates of the same list may race here.
            let tmp = dir.join(format!(".{list}.{}", crate::ids::random_suffix(8)));
            std::fs::write(&tmp, format!("{list}\n"))
                .and_then(|()| std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o444)))
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| BackendError::io(format!("writing {}", path.display()), e))?;
        }
        Ok(path)
    }

    /// 1. The container: limits, privileges and labels, all fixed at create time.
    async fn create_container(&self, spec: &SandboxSpec, role: &Role, image: &str, name: &str, placement: &Placement) -> Result<String, BackendError> {
        let docker = self.docker()?;
        let mut labels = HashMap::from([
            (LABEL_ID.to_string(), spec.id.to_string()),
            (LABEL_OWNER.to_string(), self.owner.clone()),
            (LABEL_IMAGE.to_string(), spec.image.clone()),
        ]);
        if let Role::Standby(snap) = role {
            labels.insert(LABEL_STANDBY.to_string(), snap.to_string());
        }
        let keepalive: Vec<String> = if self.cfg.exec_through_docker { KEEPALIVE_WITHOUT_CHANNEL } else { KEEPALIVE }.iter().map(|s| s.to_string()).collect();
        // A build step's image has the Dockerfile's ENTRYPOINT and CMD: the keepalive replaces
        // both, as the entrypoint with an empty command, so a commit of the container (which
        // fills an empty CMD from the container's) gives the image no command of ours.
        let (entrypoint, cmd) = match role {
            Role::BuildStep { .. } => (Some(keepalive), Some(Vec::new())),
            Role::Active | Role::Standby(_) => (None, Some(keepalive)),
        };
        // The keepalive serves execs as any user: it runs as root, whatever the image's USER.
        let user = matches!(role, Role::BuildStep { as_root: true, .. }).then(|| "0:0".to_string());
        let body = |disk: Option<u64>| ContainerCreateBody {
            image: Some(image.to_string()),
            user: user.clone(),
            entrypoint: entrypoint.clone(),
            cmd: cmd.clone(),
            // Same as the process tier: the hostname is the sandbox id.
            hostname: Some(spec.id.to_string()),
            // Docker creates the working directory at start when the image lacks it.
            working_dir: Some(spec.workdir.clone()),
            labels: Some(labels.clone()),
            tty: Some(false),
            open_stdin: Some(false),
            attach_stdin: Some(false),
            attach_stdout: Some(false),
            attach_stderr: Some(false),
            // Network mode `none` (in the host config) gives the container a network namespace
            // with only `lo`. Not `network_disabled` as well: with it Docker writes no /etc/hosts
            // at all, and the hostname would not resolve.
            stop_timeout: Some(1),
            host_config: Some(host_config(spec, disk, &super::exec::helper_dir(&self.cfg.images_dir), placement)),
            ..Default::default()
        };
        let options = || CreateContainerOptions { name: Some(name.to_string()), ..Default::default() };
        let disk = (self.disk_limits() != DiskLimits::Unsupported).then_some(spec.limits.disk_bytes);
        let created = match docker.create_container(Some(options()), body(disk)).await {
            Ok(r) => {
                if disk.is_some() {
                    self.set_disk_limits(DiskLimits::Enforced);
                }
                r
            }
            Err(e) if disk.is_some() && is_storage_opt_refusal(&e) => {
                tracing::warn!(error = %e, "Docker cannot limit a container's writable layer on this storage driver: disk_bytes is not enforced for CONTAINER sandboxes");
                self.set_disk_limits(DiskLimits::Unsupported);
                docker.create_container(Some(options()), body(None)).await.map_err(|e| api_error(format!("creating container {name}"), e))?
            }
            Err(e) => return Err(api_error(format!("creating container {name}"), e)),
        };
        for warning in &created.warnings {
            tracing::warn!(container = %name, %warning, "Docker warning on create");
        }
        Ok(created.id)
    }

    /// 2. The writable layer (copied in before start, while no overlay is mounted on it),
    ///    3. start, 4. what the daemon needs to reach into the running container.
    async fn start_created(&self, spec: &SandboxSpec, container_id: &str, layer_from: Option<&SnapshotId>) -> Result<Arc<ContainerSandbox>, BackendError> {
        let docker = self.docker()?;
        if let Some(snap) = layer_from {
            let upper = self.upper_dir_of(container_id).await?;
            let src = self.snapshot_dir(snap);
            let copied = tokio::task::spawn_blocking(move || layer::copy_tree(&src, &upper))
                .await
                .map_err(|e| BackendError::Internal(format!("layer copy task: {e}")))?
                .map_err(|e| BackendError::io(format!("restoring snapshot {snap} into container {container_id}"), e))?;
            tracing::debug!(container = %container_id, snapshot = %snap, bytes = copied.bytes, entries = copied.entries, "writable layer restored");
        }
        docker.start_container(container_id, None).await.map_err(|e| api_error(format!("starting container {container_id}"), e))?;
        self.attach(spec, container_id).await
    }

    /// What the daemon needs to reach into a running container: its init's pid, its cgroup, its
    /// writable layer.
    pub(super) async fn attach(&self, spec: &SandboxSpec, container_id: &str) -> Result<Arc<ContainerSandbox>, BackendError> {
        let docker = self.docker()?;
        let info = docker.inspect_container(container_id, None).await.map_err(|e| api_error(format!("inspecting container {container_id}"), e))?;
        let state = info.state.unwrap_or_default();
        let pid = state.pid.and_then(|p| i32::try_from(p).ok()).filter(|&p| p > 0);
        let Some(init_pid) = pid.filter(|_| state.running == Some(true)) else {
            return Err(BackendError::Internal(format!(
                "container {container_id} exited right after start (exit code {:?}, error {:?}): is the exec helper mounted?",
                state.exit_code, state.error
            )));
        };
        let upper_dir = info.graph_driver.and_then(|g| g.data.get("UpperDir").map(PathBuf::from));
        let cgroup = self.cgroup_of(container_id, init_pid)?;
        // The CPUs it runs on, as Docker holds them (also for a container re-adopted after a
        // restart), count for the placement of the next sandboxes until it goes.
        let cpuset = info.host_config.and_then(|h| h.cpuset_cpus).unwrap_or_default();
        let cpus = crate::backend::cpus::claim(&crate::backend::cpus::parse_list(&cpuset).unwrap_or_default());
        // The exec channel, taken from the helper before anything of the sandbox runs in it.
        let taken = tokio::task::spawn_blocking(move || super::channel::take(init_pid))
            .await
            .map_err(|e| BackendError::Internal(format!("exec channel task: {e}")))?
            .map_err(|e| BackendError::Internal(format!("container {container_id}: {e}")))?;
        let channel = match taken {
            Some(sock) => Some(super::channel::HelperChannel::new(sock).map_err(|e| BackendError::io("watching the exec channel", e))?),
            None => {
                tracing::info!(container = %container_id, "container without an exec channel: its execs go through Docker's exec API");
                None
            }
        };
        let ids = remapped_ids(init_pid).map_err(|e| BackendError::Internal(format!("container {container_id}: {e}")))?;
        tracing::debug!(sandbox = %spec.id, container = %container_id, pid = init_pid, channel = channel.is_some(), remapped = ?ids, "container running");
        Ok(Arc::new(ContainerSandbox {
            spec: spec.clone(),
            container_id: container_id.to_string(),
            init_pid,
            cgroup,
            upper_dir,
            lost: Mutex::new(None),
            execs: Default::default(),
            channel,
            cpus,
            ids,
        }))
    }

    /// The container's writable layer on the host, from the storage driver's data.
    pub(super) async fn upper_dir_of(&self, container_id: &str) -> Result<PathBuf, BackendError> {
        let info = self.docker()?.inspect_container(container_id, None).await.map_err(|e| api_error(format!("inspecting container {container_id}"), e))?;
        let driver = info.graph_driver.unwrap_or_default();
        driver.data.get("UpperDir").map(PathBuf::from).ok_or_else(|| {
            BackendError::Internal(format!(
                "Docker's storage driver {:?} has no writable layer directory; container snapshots need overlay2 or fuse-overlayfs",
                driver.name
            ))
        })
    }

    /// The container's cgroup (in every hierarchy), found from its init's `/proc/<pid>/cgroup`:
    /// Docker's cgroupfs driver puts it at `docker/<container id>`.
    pub(super) fn cgroup_of(&self, container_id: &str, init_pid: i32) -> Result<super::process_cgroup::SandboxCgroup, BackendError> {
        let unsupported =
            |why: String| BackendError::Internal(format!("container {container_id}: {why}; per-exec cgroups need Docker's cgroupfs cgroup driver"));
        let proc_cgroup = std::fs::read_to_string(format!("/proc/{init_pid}/cgroup"))
            .map_err(|e| BackendError::io(format!("reading the cgroup of container {container_id}"), e))?;
        let path = cgroup_path(&proc_cgroup, "freezer").ok_or_else(|| unsupported("no cgroup path".into()))?;
        let (parent, leaf) = path.rsplit_once('/').ok_or_else(|| unsupported(format!("cgroup {path:?} has no parent")))?;
        let root = {
            let mut roots = self.cgroup_roots.lock().map_err(|_| BackendError::Internal("cgroup root table poisoned".into()))?;
            match roots.get(parent) {
                Some(r) => r.clone(),
                None => {
                    let r = CgroupRoot::detect(parent).map_err(|e| unsupported(format!("cgroup parent {parent:?}: {e}")))?;
                    roots.insert(parent.to_string(), r.clone());
                    r
                }
            }
        };
        root.open_sandbox(leaf).ok_or_else(|| unsupported(format!("cannot open cgroup {path:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_maps_are_read_as_one_range_or_refused() {
        assert_eq!(parse_id_map("         0          0 4294967295\n"), Ok(Some((0, 0, u32::MAX))));
        assert_eq!(parse_id_map("0 100000 65536\n"), Ok(Some((0, 100_000, 65_536))));
        assert!(parse_id_map("0 100000 1000\n1000 1000 1\n").is_err());
        assert!(parse_id_map("1 100000 65536\n").is_err());
        assert_eq!(parse_id_map(""), Ok(None));
        let own = remapped_ids(std::process::id() as i32).expect("our own maps");
        assert_eq!(own, None, "this test runs in the host's user namespace");
    }

    #[test]
    fn cgroup_path_prefers_the_named_controller() {
        let v1 = "12:freezer:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n";
        assert_eq!(cgroup_path(v1, "freezer").as_deref(), Some("docker/abc"));
        let v2 = "0::/system.slice/docker-abc.scope\n";
        assert_eq!(cgroup_path(v2, "freezer").as_deref(), Some("system.slice/docker-abc.scope"));
    }

    #[test]
    fn limits_map_to_docker_fields() {
        let spec = SandboxSpec {
            id: crate::ids::SandboxId::generate(),
            image: "minimal".into(),
            limits: crate::config::Limits {
                cpu_millicores: 1,
                memory_bytes: 64 << 20,
                max_pids: 32,
                disk_bytes: 1 << 30,
                exec_timeout_ms: 1000,
                shm_bytes: 32 << 20,
            },
            workdir: "/workspace".into(),
            from_snapshot: None,
            tenant: String::new(),
            network: Default::default(),
        };
        let placement = Placement { cpus: crate::backend::cpus::claim(&[0]), online_file: PathBuf::from("/state/container/cpus-online/0") };
        let hc = host_config(&spec, None, std::path::Path::new("/x/.tools"), &placement);
        assert_eq!((hc.memory, hc.memory_swap, hc.pids_limit), (Some(64 << 20), Some(64 << 20), Some(32)));
        assert_eq!(hc.nano_cpus, Some(MIN_NANO_CPUS), "tiny CPU limits are rounded up to Docker's minimum");
        assert_eq!(hc.init, Some(true));
        assert_eq!(hc.network_mode.as_deref(), Some("none"));
        assert!(hc.storage_opt.is_none());
        assert_eq!(
            hc.binds.as_deref(),
            Some(&["/x/.tools:/.sandboxd:ro".to_string(), "/state/container/cpus-online/0:/sys/devices/system/cpu/online:ro".to_string()][..]),
            "the exec helper's directory and the CPU list, read-only"
        );
        assert_eq!((hc.cpuset_cpus.as_deref(), hc.shm_size), (Some("0"), Some(32 << 20)));
        assert_eq!(hc.extra_hosts, Some(vec![format!("{}:127.0.1.1", spec.id)]), "the hostname resolves");
        assert!(hc.readonly_paths.unwrap_or_default().iter().any(|p| p == "/sys/fs/cgroup"));
        assert!(!hc.cap_add.unwrap_or_default().iter().any(|c| c == "MKNOD" || c == "NET_RAW" || c == "SYS_ADMIN"));
    }
}
