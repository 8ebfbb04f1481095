//! What a run measured: one row per [`Key`] with its [`Outcome`], and what the sections found
//! beyond their rows (density, throughput, the microVM tier's log, Docker).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::latency::EXEC_GAP;
use crate::snapshots::{CHANGED_LARGE_MIB, CHANGED_SMALL_MIB, FORK_BATCH};
use crate::stats::{summarize, Summary};

/// An image the snapshot rows are measured over: `debian` (~280 MB) is over 100× `minimal`
/// (~2 MB), which is what the "100× larger image" target needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Image {
    Minimal,
    Debian,
}

impl Image {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Image::Minimal => "minimal",
            Image::Debian => "debian",
        }
    }
}

/// How microVM guests ran their CPUs, as the daemon logged it (`accel=` of `microVM booted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum VmAccel {
    Tcg,
    Kvm,
}

impl VmAccel {
    pub(crate) fn name(self) -> &'static str {
        match self {
            VmAccel::Tcg => "TCG",
            VmAccel::Kvm => "KVM",
        }
    }

    /// The value of `[microvm] accel` that forces it, also how the daemon's log spells it.
    pub(crate) fn config(self) -> &'static str {
        match self {
            VmAccel::Tcg => "tcg",
            VmAccel::Kvm => "kvm",
        }
    }

    pub(crate) fn from_log(value: &str) -> Option<VmAccel> {
        match value {
            "tcg" => Some(VmAccel::Tcg),
            "kvm" => Some(VmAccel::Kvm),
            _ => None,
        }
    }

    pub(crate) fn other(self) -> VmAccel {
        match self {
            VmAccel::Tcg => VmAccel::Kvm,
            VmAccel::Kvm => VmAccel::Tcg,
        }
    }
}

/// One row of the results table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Key {
    Create,
    Destroy,
    Get,
    /// `GetSandbox` after the same pause as [`Key::ExecSpaced`]: what waking the client, the
    /// daemon and their CPUs costs a call that starts no process.
    GetSpaced,
    Exec,
    ExecSpaced,
    ExecStream,
    LiveCreate,
    LiveExec,
    LiveDestroy,
    /// `Snapshot` of a process-tier sandbox of that image with that many MiB written since it.
    Snapshot(Image, u32),
    /// `Rollback` to such a snapshot.
    Rollback(Image, u32),
    /// `CreateSandbox` and a 1 MiB `Snapshot` on a daemon with `[process] user_namespaces =
    /// "off"`: the cost of a user namespace per sandbox, next to [`Key::Create`] and
    /// [`Key::Snapshot`].
    CreateNoUserns,
    SnapshotNoUserns,
    /// The same on a daemon with `user_namespaces = "shifted"`: files shifted on disk into
    /// each sandbox's range (what a kernel without idmapped mounts gets).
    CreateShifted,
    SnapshotShifted,
    Fork,
    ForkDestroy,
    /// [`FORK_BATCH`] forks of one snapshot, one after another: one sample is the whole batch.
    ForkBatch,
    ContainerCreate,
    ContainerDestroy,
    ContainerExec,
    /// The same on a daemon with `[container] exec_through_docker`: how every exec started
    /// before the exec channel, in the same run.
    ContainerExecViaDocker,
    ContainerSnapshot,
    ContainerRollback,
    /// `CreateSandbox` served by a container of the warm pool (`[container] warm_pool = 1`).
    ContainerPoolCreate,
    DockerRun,
    DockerCreateStart,
    DockerCreateStartBridge,
    DockerRemove,
    DockerExec,
    /// Cold microVM (no pool) under that accelerator: `CreateSandbox` + the first `Exec` of
    /// `true`, timed as one.
    MicroVmBoot(VmAccel),
    /// The `CreateSandbox` alone of those boots.
    MicroVmCreate(VmAccel),
    MicroVmDestroy,
    /// `CreateSandbox` served from the warm pool, and the same with its first `Exec` of `true`.
    MicroVmPoolCreate,
    MicroVmPoolReady,
    /// `CreateSandbox` restored from the image's boot snapshot (no pool; `boot_snapshots`, the
    /// default), and the same with its first `Exec` of `true`.
    MicroVmBootSnapshotCreate,
    MicroVmBootSnapshotReady,
    MicroVmExec,
    MicroVmExecStream,
    /// `Snapshot{include_memory: false}` and `Rollback` to it (a boot over the snapshot's disk).
    MicroVmSnapshot,
    MicroVmRollback,
    /// Fork of such a snapshot whose origin still runs, and of one whose origin was destroyed.
    MicroVmFork,
    MicroVmForkOriginGone,
    /// The same four with the snapshot's memory (the tier's default): rollback and forks resume
    /// the saved VM instead of booting one.
    MicroVmSnapshotMemory,
    MicroVmRollbackMemory,
    MicroVmForkMemory,
    MicroVmForkMemoryOriginGone,
    /// With the memory limit at that many MiB (see [`SIZED_MIB`]): a create restored from that
    /// shape's boot snapshot, a snapshot with memory, a rollback to it, a fork of it.
    MicroVmSized(u32, SizedOp),
}

/// The memory limits (MiB) of the microVM rows other than the default's.
pub(crate) const SIZED_MIB: [u32; 2] = [256, 1024];

/// What a [`Key::MicroVmSized`] row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SizedOp {
    Create,
    Snapshot,
    Rollback,
    Fork,
}

impl Key {
    /// The rows of one memory limit.
    pub(crate) fn sized(mib: u32) -> [Key; 4] {
        [SizedOp::Create, SizedOp::Snapshot, SizedOp::Rollback, SizedOp::Fork].map(|op| Key::MicroVmSized(mib, op))
    }

    pub(crate) const SANDBOXD: [Key; 10] =
        [Key::Create, Key::Destroy, Key::Get, Key::GetSpaced, Key::Exec, Key::ExecSpaced, Key::ExecStream, Key::LiveCreate, Key::LiveExec, Key::LiveDestroy];
    pub(crate) const SNAPSHOTS: [Key; 8] = [
        Key::Snapshot(Image::Minimal, CHANGED_SMALL_MIB),
        Key::Rollback(Image::Minimal, CHANGED_SMALL_MIB),
        Key::Snapshot(Image::Minimal, CHANGED_LARGE_MIB),
        Key::Rollback(Image::Minimal, CHANGED_LARGE_MIB),
        Key::Snapshot(Image::Debian, CHANGED_SMALL_MIB),
        Key::Rollback(Image::Debian, CHANGED_SMALL_MIB),
        Key::Snapshot(Image::Debian, CHANGED_LARGE_MIB),
        Key::Rollback(Image::Debian, CHANGED_LARGE_MIB),
    ];
    pub(crate) const NO_USERNS: [Key; 4] = [Key::CreateNoUserns, Key::SnapshotNoUserns, Key::CreateShifted, Key::SnapshotShifted];
    pub(crate) const FORKS: [Key; 3] = [Key::Fork, Key::ForkDestroy, Key::ForkBatch];
    pub(crate) const CONTAINER: [Key; 7] = [
        Key::ContainerCreate,
        Key::ContainerDestroy,
        Key::ContainerExec,
        Key::ContainerExecViaDocker,
        Key::ContainerSnapshot,
        Key::ContainerRollback,
        Key::ContainerPoolCreate,
    ];
    pub(crate) const DOCKER: [Key; 5] = [Key::DockerRun, Key::DockerCreateStart, Key::DockerCreateStartBridge, Key::DockerRemove, Key::DockerExec];
    pub(crate) const MICROVM: [Key; 27] = [
        Key::MicroVmBoot(VmAccel::Tcg),
        Key::MicroVmCreate(VmAccel::Tcg),
        Key::MicroVmBoot(VmAccel::Kvm),
        Key::MicroVmCreate(VmAccel::Kvm),
        Key::MicroVmDestroy,
        Key::MicroVmPoolCreate,
        Key::MicroVmPoolReady,
        Key::MicroVmBootSnapshotCreate,
        Key::MicroVmBootSnapshotReady,
        Key::MicroVmExec,
        Key::MicroVmExecStream,
        Key::MicroVmSnapshot,
        Key::MicroVmRollback,
        Key::MicroVmFork,
        Key::MicroVmForkOriginGone,
        Key::MicroVmSnapshotMemory,
        Key::MicroVmRollbackMemory,
        Key::MicroVmForkMemory,
        Key::MicroVmForkMemoryOriginGone,
        Key::MicroVmSized(SIZED_MIB[0], SizedOp::Create),
        Key::MicroVmSized(SIZED_MIB[0], SizedOp::Snapshot),
        Key::MicroVmSized(SIZED_MIB[0], SizedOp::Rollback),
        Key::MicroVmSized(SIZED_MIB[0], SizedOp::Fork),
        Key::MicroVmSized(SIZED_MIB[1], SizedOp::Create),
        Key::MicroVmSized(SIZED_MIB[1], SizedOp::Snapshot),
        Key::MicroVmSized(SIZED_MIB[1], SizedOp::Rollback),
        Key::MicroVmSized(SIZED_MIB[1], SizedOp::Fork),
    ];

    pub(crate) fn label(self, live: usize) -> String {
        match self {
            Key::Create => "sandboxd `CreateSandbox` (process tier, image minimal)".into(),
            Key::Destroy => "sandboxd `DestroySandbox`".into(),
            Key::Get => "sandboxd `GetSandbox` (the gRPC floor: no process is started)".into(),
            Key::GetSpaced => format!("sandboxd `GetSandbox`, {} ms apart (the floor after a pause)", EXEC_GAP.as_millis()),
            Key::Exec => "sandboxd `Exec` of `true` (unary), back to back".into(),
            Key::ExecSpaced => format!("sandboxd `Exec` of `true` (unary), {} ms apart", EXEC_GAP.as_millis()),
            Key::ExecStream => "sandboxd `ExecStream` of `true`".into(),
            Key::LiveCreate => format!("sandboxd `CreateSandbox`, filling up to {live} live"),
            Key::LiveExec => format!("sandboxd `Exec` of `true` across {live} live sandboxes"),
            Key::LiveDestroy => format!("sandboxd `DestroySandbox`, emptying {live} live"),
            Key::Snapshot(image, mib) => {
                format!("sandboxd `Snapshot`, {mib} MiB changed (image {})", image.name())
            }
            Key::Rollback(image, mib) => {
                format!("sandboxd `Rollback`, {mib} MiB changed (image {})", image.name())
            }
            Key::CreateNoUserns => "sandboxd `CreateSandbox` (process tier, image minimal) without user namespaces".into(),
            Key::SnapshotNoUserns => format!("sandboxd `Snapshot`, {CHANGED_SMALL_MIB} MiB changed (image minimal) without user namespaces"),
            Key::CreateShifted => "sandboxd `CreateSandbox` (process tier, image minimal), user namespace with shifted copies (no idmapped mounts)".into(),
            Key::SnapshotShifted => format!("sandboxd `Snapshot`, {CHANGED_SMALL_MIB} MiB changed (image minimal), user namespace with shifted copies"),
            Key::Fork => "sandboxd fork: `CreateSandbox{from_snapshot_id}` (image minimal, 1 MiB changed)".into(),
            Key::ForkDestroy => "sandboxd `DestroySandbox` of a fork".into(),
            Key::ForkBatch => {
                format!("sandboxd {FORK_BATCH} forks of one snapshot, one after another (total)")
            }
            Key::ContainerCreate => "sandboxd container tier `CreateSandbox` (image minimal)".into(),
            Key::ContainerDestroy => "sandboxd container tier `DestroySandbox`".into(),
            Key::ContainerExec => "sandboxd container tier `Exec` of `true`, back to back".into(),
            Key::ContainerExecViaDocker => "sandboxd container tier `Exec` of `true` through Docker's exec API (`exec_through_docker`), back to back".into(),
            Key::ContainerSnapshot => {
                format!("sandboxd container tier `Snapshot`, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::ContainerRollback => {
                format!("sandboxd container tier `Rollback`, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::ContainerPoolCreate => "sandboxd container tier `CreateSandbox` from the warm pool (`[container] warm_pool = 1`)".into(),
            Key::DockerRun => "Docker `run --rm` of `true` (create+start+wait+remove)".into(),
            Key::DockerCreateStart => "Docker container create+start (`--network none`)".into(),
            Key::DockerCreateStartBridge => "Docker container create+start (default bridge network)".into(),
            Key::DockerRemove => "Docker `rm -f` of a running container".into(),
            Key::DockerExec => "Docker `exec` of `true` (exec create+start+inspect)".into(),
            Key::MicroVmBoot(accel) => format!("microVM boot to first exec, cold ({}, no pool): `CreateSandbox` + first `Exec` of `true`", accel.name()),
            Key::MicroVmCreate(accel) => format!("microVM `CreateSandbox` alone, cold ({}, no pool)", accel.name()),
            Key::MicroVmDestroy => "microVM `DestroySandbox`".into(),
            Key::MicroVmPoolCreate => "microVM `CreateSandbox` from the warm pool (`--microvm-pool 1`)".into(),
            Key::MicroVmPoolReady => "microVM from the warm pool to first exec: `CreateSandbox` + first `Exec` of `true`".into(),
            Key::MicroVmBootSnapshotCreate => "microVM `CreateSandbox` restored from the image's boot snapshot (no pool, no boot)".into(),
            Key::MicroVmBootSnapshotReady => "microVM restored from the image's boot snapshot to first exec: `CreateSandbox` + first `Exec` of `true`".into(),
            Key::MicroVmExec => "microVM `Exec` of `true` (unary), back to back".into(),
            Key::MicroVmExecStream => "microVM `ExecStream` of `true`".into(),
            Key::MicroVmSnapshot => {
                format!("microVM `Snapshot` without memory, {CHANGED_SMALL_MIB} MiB changed")
            }
            Key::MicroVmRollback => format!("microVM `Rollback` without memory, {CHANGED_SMALL_MIB} MiB changed (boots a new VM over the snapshot)"),
            Key::MicroVmFork => {
                format!("microVM fork without memory: `CreateSandbox{{from_snapshot_id}}`, the origin running ({CHANGED_SMALL_MIB} MiB changed; boots)")
            }
            Key::MicroVmForkOriginGone => {
                format!("microVM fork without memory of a snapshot whose origin was destroyed ({CHANGED_SMALL_MIB} MiB changed; boots)")
            }
            Key::MicroVmSnapshotMemory => format!("microVM `Snapshot` with memory (the default), {CHANGED_SMALL_MIB} MiB changed"),
            Key::MicroVmRollbackMemory => format!("microVM `Rollback` to a memory snapshot, {CHANGED_SMALL_MIB} MiB changed (resumes the saved VM)"),
            Key::MicroVmForkMemory => format!("microVM fork of a memory snapshot, the origin running ({CHANGED_SMALL_MIB} MiB changed; resumes)"),
            Key::MicroVmForkMemoryOriginGone => {
                format!("microVM fork of a memory snapshot whose origin was destroyed ({CHANGED_SMALL_MIB} MiB changed; resumes)")
            }
            Key::MicroVmSized(mib, SizedOp::Create) => format!("microVM at {mib} MiB: `CreateSandbox` restored from its boot snapshot (no pool)"),
            Key::MicroVmSized(mib, SizedOp::Snapshot) => format!("microVM at {mib} MiB: `Snapshot` with memory, {CHANGED_SMALL_MIB} MiB changed"),
            Key::MicroVmSized(mib, SizedOp::Rollback) => format!("microVM at {mib} MiB: `Rollback` to a memory snapshot (resumes)"),
            Key::MicroVmSized(mib, SizedOp::Fork) => format!("microVM at {mib} MiB: fork of a memory snapshot, the origin running (resumes)"),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Measured(Summary),
    /// Docker could not be reached or could not run the section: not a failure of the bench.
    Unavailable(String),
    /// A sandboxd section failed: the bench exits non-zero.
    Failed(String),
}

/// What the density section found.
#[derive(Debug, Clone)]
pub(crate) struct Density {
    pub(crate) live: usize,
    pub(crate) rss_idle: Option<u64>,
    pub(crate) rss_live: Option<u64>,
    /// PSS of the daemon and every process under it (the zygote; per sandbox its init; the spare of its next exec in those used last), and how many processes.
    pub(crate) pss_tree: Option<(u64, usize)>,
    /// The host's memory in use (MemTotal − MemAvailable) before the creates and with all live:
    /// what the sandboxes cost the host, kernel memory (cgroups, mounts, namespaces) included.
    pub(crate) host_used: Option<(HostMemory, HostMemory)>,
    /// The same, idle again after 3 execs in each sandbox.
    pub(crate) host_after_execs: Option<HostMemory>,
    pub(crate) create_total: Duration,
    pub(crate) destroy_total: Duration,
    pub(crate) rss_after: Option<u64>,
}

/// What /proc/meminfo says of the host's memory, in bytes (see `density::host_memory`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostMemory {
    pub(crate) used: u64,
    pub(crate) slab_unreclaimable: u64,
    pub(crate) page_tables: u64,
    pub(crate) kernel_stacks: u64,
}

/// One concurrency level of the exec throughput section.
#[derive(Debug, Clone)]
pub(crate) struct Throughput {
    pub(crate) concurrency: usize,
    pub(crate) execs: usize,
    /// From the first exec sent to the last answer received.
    pub(crate) wall: Duration,
    /// Round trip of each exec, as its task saw it.
    pub(crate) latency: Summary,
}

impl Throughput {
    pub(crate) fn per_second(&self) -> f64 {
        self.execs as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// What the microVM section learnt from the daemons' logs, beyond its rows.
#[derive(Debug, Default)]
pub(crate) struct MicroVm {
    /// The accelerator the daemon left at `accel = "auto"` used, and the lines of its log that
    /// say why (KVM probe, cached verdict, no /dev/kvm).
    pub(crate) auto_accel: Option<VmAccel>,
    pub(crate) accel_log: Vec<String>,
    /// Why that daemon did not use KVM (from its log), and what a daemon forced to KVM answered.
    pub(crate) kvm_reason: Option<String>,
    pub(crate) kvm_forced: Option<String>,
    /// The daemon's own boot times of the timed cold boots (QEMU started → guest agent's hello,
    /// `boot_ms` of `microVM booted`) and the guest kernel's uptime at that hello, per accelerator.
    pub(crate) boot_logged: BTreeMap<VmAccel, (Vec<Duration>, Vec<Duration>)>,
    /// `boot_ms` of the VMs the warm pool booted while its rows were measured.
    pub(crate) pool_boot_logged: Vec<Duration>,
    /// `size_bytes` of the snapshots of the `Snapshot` rows without and with memory (median).
    pub(crate) snapshot_size: Option<u64>,
    pub(crate) memory_snapshot_size: Option<u64>,
    /// Why the whole tier is unavailable.
    pub(crate) unavailable: Option<String>,
}

#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) rows: BTreeMap<Key, Outcome>,
    pub(crate) density: Option<Result<Density, String>>,
    /// RSS of the latency daemon once its sections were done and nothing was live.
    pub(crate) rss_after_latency: Option<u64>,
    /// `size_bytes` the daemon reported for the snapshots of each `Snapshot` row (median).
    pub(crate) snapshot_sizes: BTreeMap<Key, u64>,
    /// Each concurrency level, or why it failed.
    pub(crate) throughput: Vec<(usize, Result<Throughput, String>)>,
    /// Why the container tier's rows are unavailable.
    pub(crate) container_unavailable: Option<String>,
    /// What the microVM section found beyond its rows.
    pub(crate) microvm: MicroVm,
    pub(crate) docker: Option<String>,
    pub(crate) docker_unavailable: Option<String>,
    pub(crate) docker_import: Option<Duration>,
    pub(crate) section_times: Vec<(String, Duration)>,
}

impl Report {
    pub(crate) fn measured(&mut self, key: Key, samples: &[Duration]) {
        let outcome = match summarize(samples) {
            Some(s) => Outcome::Measured(s),
            None => Outcome::Failed("no samples".into()),
        };
        self.rows.insert(key, outcome);
    }

    pub(crate) fn failed(&mut self, keys: &[Key], err: &anyhow::Error) {
        let msg = format!("{err:#}");
        eprintln!("bench: FAILED {}: {msg}", keys.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", "));
        for k in keys {
            self.rows.insert(*k, Outcome::Failed(msg.clone()));
        }
    }

    /// [`Report::failed`] for those of `keys` that have no outcome yet: a section that fails
    /// part-way keeps the rows it measured.
    pub(crate) fn failed_unless_done(&mut self, keys: &[Key], err: &anyhow::Error) {
        let missing: Vec<Key> = keys.iter().copied().filter(|k| !self.rows.contains_key(k)).collect();
        self.failed(&missing, err);
    }

    pub(crate) fn unavailable(&mut self, keys: &[Key], reason: &str) {
        for k in keys {
            self.rows.entry(*k).or_insert_with(|| Outcome::Unavailable(reason.to_string()));
        }
    }

    pub(crate) fn p50(&self, key: Key) -> Option<f64> {
        match self.rows.get(&key) {
            Some(Outcome::Measured(s)) => Some(s.p50),
            _ => None,
        }
    }

    pub(crate) fn any_failed(&self) -> bool {
        self.rows.values().any(|o| matches!(o, Outcome::Failed(_))) || matches!(self.density, Some(Err(_))) || self.throughput.iter().any(|(_, r)| r.is_err())
    }
}
