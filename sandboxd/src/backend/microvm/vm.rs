//! One QEMU `microvm` process: how it is started, confined, watched and stopped.
//!
//! QEMU runs with as little as it can: its own host cgroup (memory and pids bounded), a uid of
//! its own, unique on the host, with no capabilities (`-runas`), chrooted into the VM's
//! directory (`-chroot`: after start-up it sees only its own top disk file), QEMU's seccomp
//! sandbox, no network device (or, for a filtered network, one virtio-net device on a TAP
//! descriptor the daemon opened), no default devices, and it never outlives the daemon: it runs in
//! a pid namespace of its own under a guard process that dies with the daemon ([`super::guard`];
//! `PR_SET_PDEATHSIG` on QEMU itself would be cleared by `-runas`). Every file it needs (kernel,
//! initramfs, backing disks) is opened before it drops privileges.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_agent::protocol::{GuestLimits, Request, Response, PORT_NAME};

/// The first guest protocol whose `Configure` sizes /dev/shm and writes /etc/hostname and
/// /etc/hosts (and whose guest shows the sandbox's cgroup at /sys/fs/cgroup).
const ENVIRONMENT: u32 = 5;

/// The first guest protocol whose `Configure` sets up `eth0` and /etc/resolv.conf.
const NETWORK: u32 = 7;

/// Refuses an agent too old to set up the sandbox's environment (its VM images predate it).
fn need_environment(version: u32) -> Result<(), BackendError> {
    if version < ENVIRONMENT {
        return Err(BackendError::Internal(format!(
            "the guest agent of this microVM speaks protocol {version}, which cannot size /dev/shm or name the sandbox in /etc/hosts: rebuild the VM images (make vm-images)"
        )));
    }
    Ok(())
}
use tokio::sync::oneshot;

use super::agent::{AgentConn, AgentError, HelloInfo};
use super::qmp::Qmp;
use crate::backend::cgroup::SandboxCgroup;
use crate::backend::BackendError;

/// How the guest's CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The boot files of an image (from `<images>/<name>/vm/vm.json`).
#[derive(Debug, Clone)]
pub struct BootFiles {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
}

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub qemu: PathBuf,
    /// The VM's directory: sockets, console log, top disk; QEMU's chroot.
    pub dir: PathBuf,
    /// The top disk (inside `dir`) and its generation (node name `disk<gen>`).
    pub top: PathBuf,
    pub gen: u64,
    pub boot: BootFiles,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub accel: Accel,
    /// Uid and gid QEMU drops to.
    pub uid: u32,
    pub boot_timeout: Duration,
    /// The file guest RAM lives in (`memory-backend-file`, `share=on`), on a tmpfs the daemon
    /// owns: a memory snapshot then saves only the device state (`x-ignore-shared`) and copies
    /// this file, and a restore copies the snapshot's RAM back into a VM's own file instead of
    /// QEMU reading every page through the migration stream. Created (sized) by the caller;
    /// its name is removed once the guest answers (see [`Vm::ram`]). None: anonymous RAM (the
    /// KVM probe, which is never snapshotted).
    pub ram: Option<PathBuf>,
    /// A memory snapshot to resume instead of booting.
    pub incoming: Option<Incoming>,
    /// The sandbox's TAP device (see [`crate::egress::Egress::attach_tap`]): a virtio-net device
    /// on it. None: no network device at all.
    pub tap: Option<Arc<crate::egress::TapLink>>,
}

/// A memory snapshot a VM resumes from: QEMU's device state (a migration stream saved with
/// `x-ignore-shared`, so without RAM), read through an inherited descriptor (`-incoming defer`,
/// then `migrate-incoming fd:N`), and the guest RAM it goes with, already copied into the VM's
/// own RAM file ([`LaunchSpec::ram`]) by the caller.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub snapshot: crate::ids::SnapshotId,
    pub file: Arc<std::fs::File>,
    /// The snapshot's guest RAM (a sparse file of `memory_mib` MiB).
    pub ram: Arc<std::fs::File>,
    /// The machine it was saved from, which the resumed VM must be.
    pub memory_mib: u64,
    pub vcpus: u32,
    /// The agent in the saved memory, when the snapshot recorded it: then no `Hello` is asked.
    pub agent: Option<HelloInfo>,
}

/// A running VM with its agent connected.
pub struct Vm {
    /// Current directory (renamed when a pooled VM is taken).
    pub dir: Mutex<PathBuf>,
    /// Pid of the VM's guard, the daemon's child (QEMU is its grandchild, in a pid namespace).
    pub pid: u32,
    pub uid: u32,
    pub accel: Accel,
    /// Guest RAM and vCPUs QEMU was started with.
    pub memory_mib: u64,
    pub vcpus: u32,
    pub agent: AgentConn,
    pub qmp: tokio::sync::Mutex<Qmp>,
    /// Generation of the top disk; the node name is `disk<gen>`.
    pub gen: Mutex<u64>,
    /// The QEMU process's host cgroup.
    pub cgroup: Mutex<Option<SandboxCgroup>>,
    /// Set when QEMU has exited, with how.
    exited: Arc<Mutex<Option<String>>>,
    /// Why the VM is being taken down (rollback, destroy, shutdown), set before the kill, so
    /// execs it cuts off end as LOST with that reason.
    lost: Mutex<Option<String>>,
    kill: Mutex<Option<oneshot::Sender<()>>>,
    done: tokio::sync::watch::Receiver<bool>,
    pub boot_time: Duration,
    /// Whether QEMU has a virtio-net device (a memory snapshot restores only into the same).
    pub nic: bool,
    /// What the agent said when it came up.
    pub hello: HelloInfo,
    /// The guest RAM's file (see [`LaunchSpec::ram`]): its name is removed as soon as the guest
    /// answers (QEMU has it mapped by then), so the RAM goes with QEMU and this handle whatever
    /// way the daemon ends; a snapshot reads it through the handle, which is dropped as soon as
    /// QEMU is gone (a failed sandbox keeps its `Vm` but not its RAM).
    ram: Arc<Mutex<Option<Arc<std::fs::File>>>>,
}

impl Vm {
    /// Starts QEMU and waits until the guest agent answers. On failure QEMU is killed and the
    /// error carries the end of the console log. For a resume the snapshot's RAM is copied
    /// into [`LaunchSpec::ram`] by the guard, in the VM's cgroup, while QEMU starts (see
    /// [`super::guard::RAM_COPY_ARG`]); the device state is loaded once it is done.
    pub async fn launch(spec: &LaunchSpec, cgroup: Option<SandboxCgroup>) -> Result<Vm, BackendError> {
        let t0 = Instant::now();
        let agent_sock = spec.dir.join("agent.sock");
        let qmp_sock = spec.dir.join("qmp.sock");
        let console = spec.dir.join("console.log");
        for p in [&agent_sock, &qmp_sock] {
            let _ = std::fs::remove_file(p);
        }
        // QEMU runs under the guard (see `guard`): `sandboxd __vm-guard <our pid> <qemu> <args>`.
        let exe = std::env::current_exe().map_err(|e| BackendError::io("locating the sandboxd binary (the VM guard)", e))?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg0(super::guard::GUARD_ARG0).arg(super::guard::GUARD_ARG).arg(std::process::id().to_string());
        // The copy's descriptors: the snapshot's RAM, the VM's RAM file, the report pipe.
        let copy_fds = match (&spec.incoming, &spec.ram) {
            (Some(i), Some(ram)) => {
                let to = std::fs::OpenOptions::new()
                    .write(true)
                    .open(ram)
                    .map_err(|e| BackendError::io(format!("opening the guest RAM file {}", ram.display()), e))?;
                let (report_r, report_w) =
                    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| BackendError::Internal(format!("pipe for the RAM copy: {e}")))?;
                let bytes = spec.memory_mib << 20;
                cmd.arg(format!("{}{}:{}:{bytes}:{}", super::guard::RAM_COPY_ARG, i.ram.as_raw_fd(), to.as_raw_fd(), report_w.as_raw_fd()));
                Some((i.ram.clone(), to, report_r, report_w))
            }
            _ => None,
        };
        let copy_raw: Vec<i32> = copy_fds.iter().flat_map(|(from, to, _, w)| [from.as_raw_fd(), to.as_raw_fd(), w.as_raw_fd()]).collect();
        cmd.arg(&spec.qemu);
        cmd.args(qemu_args(spec, &agent_sock, &qmp_sock, &console));
        cmd.stdin(std::process::Stdio::null());
        // Both host files the VM writes are created here, appended to, and kept bounded by
        // `cap_logs` through these handles (they follow a pooled VM's directory rename).
        let create = |name: &str| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(spec.dir.join(name))
                .and_then(|f| f.set_len(0).map(|()| f))
                .map_err(|e| BackendError::io(format!("creating {name}"), e))
        };
        let (console_file, log) = (create("console.log")?, create("qemu.log")?);
        let ram_file = match &spec.ram {
            Some(p) => Some(Arc::new(std::fs::File::open(p).map_err(|e| BackendError::io(format!("opening the guest RAM file {}", p.display()), e))?)),
            None => None,
        };
        let ram_file = Arc::new(Mutex::new(ram_file));
        let caps =
            [console_file.try_clone(), log.try_clone()].into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| BackendError::io("opening the VM's logs", e))?;
        let log2 = log.try_clone().map_err(|e| BackendError::io("creating qemu.log", e))?;
        drop(console_file);
        cmd.stdout(log).stderr(log2);
        cmd.kill_on_drop(true);
        let procs: Vec<std::fs::File> = match &cgroup {
            Some(cg) => cg.procs_files().map_err(|e| BackendError::Internal(format!("opening the VM's cgroup: {e}")))?,
            None => Vec::new(),
        };
        let fds: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
        let incoming_fd = spec.incoming.as_ref().map(|i| i.file.as_raw_fd());
        let tap_fd = spec.tap.as_ref().map(|t| t.fd.as_raw_fd());
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe system
        // calls (write, prctl, open, close) on values prepared before the fork. The guard keeps the death
        // signal across its exec (it is not set-id) and never changes its uid.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &fds {
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The memory snapshot's descriptor stays open across the exec of the guard and
                // of QEMU (the flag is the child's own copy: the daemon's stays close-on-exec).
                // So does the TAP device's, which QEMU's virtio-net reads and writes.
                // So do the RAM copy's (the guard hands them to its copier, never to QEMU).
                for fd in [incoming_fd, tap_fd].into_iter().flatten().chain(copy_raw.iter().copied()) {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // QEMU holds the guest's memory: under pressure it goes before the daemon.
                crate::admission::set_sandbox_oom_score_adj_in_child()
            });
        }
        let mut child = cmd.spawn().map_err(|e| BackendError::io(format!("starting {} under the VM guard", spec.qemu.display()), e))?;
        drop(procs);
        // The report: read until the copier closes its end (the guard closed its own at once).
        let ram_copy: Option<RamCopy> = copy_fds.map(|(_, _, report_r, _)| tokio::task::spawn_blocking(move || read_copy_report(report_r)));
        let pid = child.id().unwrap_or(0);
        let exited: Arc<Mutex<Option<String>>> = Arc::default();
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        {
            let exited = exited.clone();
            let ram_file = ram_file.clone();
            tokio::spawn(async move {
                let status = tokio::select! {
                    s = child.wait() => s,
                    _ = kill_rx => {
                        let _ = child.start_kill();
                        child.wait().await
                    }
                };
                let how = match status {
                    Ok(s) => format!("QEMU exited ({s})"),
                    Err(e) => format!("QEMU wait failed: {e}"),
                };
                if let Ok(mut x) = exited.lock() {
                    *x = Some(how);
                }
                if let Ok(mut r) = ram_file.lock() {
                    r.take();
                }
                let _ = done_tx.send(true);
            });
        }
        tokio::spawn(cap_logs(caps, done_rx.clone(), spec.dir.clone()));
        let deadline = tokio::time::Instant::now() + spec.boot_timeout;
        let alive = {
            let exited = exited.clone();
            move || match exited.lock().ok().and_then(|x| x.clone()) {
                Some(how) => Err(how),
                None => Ok(()),
            }
        };
        let booted = async {
            // A resumed VM stays paused (as it was when saved) until it is told to continue;
            // its agent answers only then.
            let resumed = match incoming_fd {
                Some(fd) => {
                    let qmp = resume_incoming(&qmp_sock, fd, ram_copy, deadline, &alive).await?;
                    tracing::debug!(dir = %spec.dir.display(), ms = t0.elapsed().as_millis() as u64, "microVM device state loaded, guest continued");
                    Some(qmp)
                }
                None => None,
            };
            let known = spec.incoming.as_ref().and_then(|i| i.agent.clone()).filter(|_| resumed.is_some());
            let asked = known.is_none();
            let (agent, hello) = match known {
                Some(hello) => AgentConn::connect_resumed(&agent_sock, deadline, alive, hello).await?,
                None => AgentConn::connect(&agent_sock, deadline, Duration::from_millis(200), alive).await?,
            };
            let what = if asked { "guest agent answered" } else { "guest agent connected (resumed: its first requests are the check)" };
            tracing::debug!(dir = %spec.dir.display(), ms = t0.elapsed().as_millis() as u64, "{what}");
            let qmp = match resumed {
                Some(qmp) => qmp,
                None => Qmp::connect(&qmp_sock).await.map_err(AgentError::Closed)?,
            };
            Ok::<_, AgentError>((agent, hello, qmp))
        }
        .await;
        let vm_parts = match booted {
            Ok(parts) => parts,
            Err(e) => {
                let _ = kill_tx.send(());
                let mut done = done_rx.clone();
                let _ = tokio::time::timeout(Duration::from_secs(5), done.wait_for(|d| *d)).await;
                if let Some(ram) = &spec.ram {
                    remove_ram(ram);
                }
                let tail = console_tail(&console, 12);
                let qemu_err = std::fs::read_to_string(spec.dir.join("qemu.log")).unwrap_or_default();
                if let Some(i) = &spec.incoming {
                    return Err(BackendError::SnapshotUnusable {
                        snapshot: i.snapshot.clone(),
                        reason: format!("the microVM did not resume from its memory ({e}); qemu: {}; console: {}", qemu_err.trim(), tail),
                    });
                }
                return Err(BackendError::Internal(format!(
                    "microVM did not boot with {} ({e}); qemu: {}; console: {}",
                    spec.accel.name(),
                    qemu_err.trim(),
                    tail
                )));
            }
        };
        let (agent, hello, qmp) = vm_parts;
        if let Some(ram) = &spec.ram {
            remove_ram(ram);
        }
        Ok(Vm {
            dir: Mutex::new(spec.dir.clone()),
            pid,
            uid: spec.uid,
            accel: spec.accel,
            memory_mib: spec.memory_mib,
            vcpus: spec.vcpus,
            agent,
            qmp: tokio::sync::Mutex::new(qmp),
            gen: Mutex::new(spec.gen),
            cgroup: Mutex::new(cgroup),
            exited,
            lost: Mutex::new(None),
            kill: Mutex::new(Some(kill_tx)),
            done: done_rx,
            boot_time: t0.elapsed(),
            nic: spec.tap.is_some(),
            hello,
            ram: ram_file,
        })
    }

    /// Records why the VM is going away, before it does (the first reason wins).
    pub fn mark_lost(&self, reason: &str) {
        if let Ok(mut l) = self.lost.lock() {
            l.get_or_insert_with(|| reason.to_string());
        }
    }

    /// Why the VM was taken down, if it was.
    pub fn lost_reason(&self) -> Option<String> {
        self.lost.lock().ok().and_then(|l| l.clone())
    }

    /// Why QEMU is gone, if it is.
    pub fn exited(&self) -> Option<String> {
        self.exited.lock().ok().and_then(|x| x.clone())
    }

    /// The guest RAM's file while QEMU runs (None after, or for anonymous RAM).
    pub fn ram(&self) -> Option<Arc<std::fs::File>> {
        self.ram.lock().ok().and_then(|r| r.clone())
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.lock().map(|d| d.clone()).unwrap_or_default()
    }

    /// Applies the sandbox's limits inside the guest. An agent older than protocol 5 would
    /// leave /dev/shm unsized and /etc/hosts naming another sandbox without a word (it skips
    /// what it does not know), so it is refused.
    pub async fn configure(&self, mut limits: GuestLimits) -> Result<(), BackendError> {
        need_environment(self.hello.version)?;
        if self.hello.version < NETWORK {
            // An older agent would ignore it; its image's machine-id stays (make vm-images).
            limits.machine_id.clear();
        }
        if limits.network.is_some() && self.hello.version < NETWORK {
            return Err(BackendError::Internal(format!(
                "the guest agent of this microVM speaks protocol {}, which cannot configure a network: rebuild the VM images (make vm-images)",
                self.hello.version
            )));
        }
        match self.agent.call(&Request::Configure(limits), &[], Duration::from_secs(10)).await {
            Ok(r) => expect_ok(r.msg, "configure"),
            Err(e) => Err(self.agent_error(e)),
        }
    }

    /// Turns an agent failure into a backend error, naming QEMU's exit when that is the cause.
    pub fn agent_error(&self, e: AgentError) -> BackendError {
        match self.exited() {
            Some(how) => BackendError::Internal(format!("the microVM is gone: {how}")),
            None => BackendError::Internal(e.to_string()),
        }
    }

    /// Kills QEMU and waits (bounded) for it to be reaped: SIGKILL to its guard (whose death
    /// tears down QEMU's pid namespace), then the VM's cgroup is emptied and removed.
    pub async fn kill(&self) {
        if let Some(tx) = self.kill.lock().ok().and_then(|mut k| k.take()) {
            let _ = tx.send(());
        }
        let mut done = self.done.clone();
        if tokio::time::timeout(Duration::from_secs(10), done.wait_for(|d| *d)).await.is_err() {
            tracing::warn!(pid = self.pid, "QEMU not reaped 10 s after SIGKILL");
        }
        let cg = self.cgroup.lock().ok().and_then(|mut c| c.take());
        if let Some(cg) = cg {
            let _ = tokio::task::spawn_blocking(move || {
                let _ = cg.kill_all();
                if let Err(e) = cg.destroy() {
                    tracing::warn!(error = %e, "removing a VM's cgroup");
                }
            })
            .await;
        }
    }
}

/// Removes a VM's RAM file (a missing one is fine: a failed launch may have removed it).
fn remove_ram(ram: &Path) {
    match std::fs::remove_file(ram) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(file = %ram.display(), error = %e, "removing a microVM's RAM file"),
    }
}

/// A snapshot's RAM being copied into a resuming VM's RAM file (bytes copied).
pub type RamCopy = tokio::task::JoinHandle<std::io::Result<u64>>;

/// What the guard's RAM copier reported (`ok <bytes>` or `error: <why>`; nothing: it died).
fn read_copy_report(report: std::os::fd::OwnedFd) -> std::io::Result<u64> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::from(report).take(4096).read_to_string(&mut text)?;
    let line = text.trim();
    match line.strip_prefix("ok ").and_then(|n| n.parse().ok()) {
        Some(n) => Ok(n),
        None if line.is_empty() => Err(std::io::Error::other("the copier ended without a word (see qemu.log)")),
        None => Err(std::io::Error::other(line.to_string())),
    }
}

/// How often a resuming VM's state is polled.
const RESUME_POLL: Duration = Duration::from_millis(2);

/// The migration capability that leaves `share=on` RAM out of a migration stream (its file is
/// the RAM): set on both ends of a memory snapshot.
pub const IGNORE_SHARED: &str = "x-ignore-shared";

/// Has QEMU (started with `-incoming defer`) load the device state of a memory snapshot from
/// the inherited descriptor `fd`, once `ram_copy` has put the RAM in its file, and lets the
/// guest continue. A stream QEMU cannot load makes it exit: that fails here at once, with why
/// QEMU went (the caller adds its log).
async fn resume_incoming(
    qmp_sock: &Path,
    fd: i32,
    ram_copy: Option<RamCopy>,
    deadline: tokio::time::Instant,
    alive: &impl Fn() -> Result<(), String>,
) -> Result<Qmp, AgentError> {
    let gone = |e: String| AgentError::Closed(alive().err().unwrap_or(e));
    let mut qmp = loop {
        match Qmp::connect(qmp_sock).await {
            Ok(q) => break q,
            Err(e) => {
                alive().map_err(AgentError::Closed)?;
                if tokio::time::Instant::now() >= deadline {
                    return Err(AgentError::Closed(e));
                }
                tokio::time::sleep(RESUME_POLL).await;
            }
        }
    };
    let caps = serde_json::json!({ "capabilities": [{ "capability": IGNORE_SHARED, "state": true }] });
    qmp.execute("migrate-set-capabilities", caps).await.map_err(gone)?;
    // QEMU has not touched guest RAM yet (a machine waiting for an incoming migration loads no
    // ROMs into it), so the copy may run until here, beside QEMU's start-up.
    if let Some(copy) = ram_copy {
        let started = Instant::now();
        let bytes = match copy.await {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return Err(AgentError::Closed(format!("copying the snapshot's guest RAM: {e}"))),
            Err(e) => return Err(AgentError::Closed(format!("copying the snapshot's guest RAM: {e}"))),
        };
        tracing::debug!(bytes, waited_ms = started.elapsed().as_millis() as u64, "guest RAM copied from the memory snapshot");
    }
    qmp.execute("migrate-incoming", serde_json::json!({ "uri": format!("fd:{fd}") })).await.map_err(gone)?;
    loop {
        let status = qmp.execute("query-status", serde_json::Value::Null).await.map_err(gone)?;
        match status.get("status").and_then(serde_json::Value::as_str) {
            Some("inmigrate") => {}
            Some("running") => return Ok(qmp),
            // Saved paused, loaded paused: it goes on from here.
            Some("paused" | "postmigrate" | "prelaunch") => {
                qmp.execute("cont", serde_json::Value::Null).await.map_err(gone)?;
                return Ok(qmp);
            }
            other => return Err(AgentError::Protocol(format!("the VM is {other:?} after loading its memory snapshot"))),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(AgentError::Closed("QEMU still loading the memory snapshot at the deadline".into()));
        }
        tokio::time::sleep(RESUME_POLL).await;
    }
}

/// `Ok` from the agent, or its error as a backend error.
pub fn expect_ok(msg: Response, what: &str) -> Result<(), BackendError> {
    match msg {
        Response::Ok => Ok(()),
        Response::Error { message, .. } => Err(BackendError::Internal(format!("guest agent {what}: {message}"))),
        other => Err(BackendError::Internal(format!("guest agent answered {what} with {other:?}"))),
    }
}

/// The QEMU command line of a VM.
fn qemu_args(spec: &LaunchSpec, agent_sock: &Path, qmp_sock: &Path, console: &Path) -> Vec<String> {
    let p = |p: &Path| p.display().to_string();
    let (accel, cpu) = match spec.accel {
        Accel::Kvm => ("kvm", "host"),
        Accel::Tcg => ("tcg", "max"),
    };
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    // rtc=on: the guest gets the wall-clock time at boot (with it off the clock starts at 1970
    // and the kernel waits twice for the missing RTC).
    let machine = "microvm,x-option-roms=off,rtc=on,isa-serial=on";
    match &spec.ram {
        // Opened (as root, before -chroot) at start-up; `share=on` makes the file the RAM itself.
        Some(ram) => {
            push(&["-M", &format!("{machine},memory-backend=ram")]);
            push(&["-object", &format!("memory-backend-file,id=ram,size={}M,mem-path={},share=on", spec.memory_mib, p(ram))]);
        }
        None => push(&["-M", machine]),
    }
    push(&["-accel", accel, "-cpu", cpu]);
    push(&["-m", &format!("{}M", spec.memory_mib), "-smp", &spec.vcpus.to_string()]);
    push(&["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]);
    push(&["-kernel", &p(&spec.boot.kernel), "-initrd", &p(&spec.boot.initramfs)]);
    push(&["-append", &kernel_cmdline(spec.accel)]);
    // Appended to a file the daemon created and keeps bounded (`cap_logs`): the guest's root can
    // write to its serial port as fast as it likes.
    push(&["-chardev", &format!("file,id=console,path={},append=on", p(console))]);
    push(&["-serial", "chardev:console"]);
    push(&["-chardev", &format!("socket,id=agent,path={},server=on,wait=off", p(agent_sock))]);
    push(&["-device", "virtio-serial-device", "-device", &format!("virtserialport,chardev=agent,name={PORT_NAME}")]);
    // cache.no-flush: the guest's flushes stop at the host page cache. The agent syncs after every
    // exec and file write, which makes the changes survive QEMU or the daemon dying; only a host
    // crash could lose them, as for the other tiers' files.
    // file.locking=off: a snapshot file stays open (as a backing file, never written again) in
    // the VM it was taken from while forks open it too; QEMU's image locks would refuse that,
    // and the daemon itself guarantees that only the top of a chain is ever written.
    push(&[
        "-blockdev",
        &format!("driver=qcow2,node-name=disk{},cache.no-flush=on,file.driver=file,file.locking=off,file.filename={}", spec.gen, p(&spec.top)),
    ]);
    push(&["-device", &format!("virtio-blk-device,drive=disk{}", spec.gen)]);
    push(&["-qmp", &format!("unix:{},server=on,wait=off", p(qmp_sock))]);
    // The filtered network: a virtio-net device on the sandbox's TAP (fixed MAC: see link.rs).
    if let Some(t) = &spec.tap {
        push(&["-netdev", &format!("tap,id=net0,fd={}", t.fd.as_raw_fd())]);
        push(&["-device", &format!("virtio-net-device,netdev=net0,mac={}", crate::egress::link::TAP_GUEST_MAC)]);
    }
    // The capability is set and the inherited descriptor read once QMP is up (resume_incoming).
    if spec.incoming.is_some() {
        push(&["-incoming", "defer"]);
    }
    // No elevateprivileges=deny: QEMU 7.2 installs the filter before -runas drops privileges,
    // and the setuid it needs would be killed. After -runas it holds no capabilities anyway.
    push(&["-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny"]);
    push(&["-runas", &format!("{}:{}", spec.uid, spec.uid), "-chroot", &p(&spec.dir)]);
    a
}

/// The guest kernel's command line. Under TCG the guest reads the host's TSC, and the kernel's
/// own calibration of it under emulation fails now and then (about one boot in six here hung
/// there), so it is told the frequency.
fn kernel_cmdline(accel: Accel) -> String {
    let mut line = String::from("console=ttyS0 quiet panic=-1");
    if accel == Accel::Tcg {
        if let Some(khz) = host_tsc_khz() {
            line.push_str(&format!(" tsc_early_khz={khz}"));
        }
    }
    line
}

/// The host's TSC frequency in kHz, measured once against CLOCK_MONOTONIC_RAW.
fn host_tsc_khz() -> Option<u64> {
    static KHZ: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    let raw_ns = || {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes into the timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_RAW, &mut ts) };
        ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
    };
    // SAFETY: rdtsc has no preconditions on x86_64.
    let tsc = || unsafe { core::arch::x86_64::_rdtsc() } as u128;
    let (t0, c0) = (raw_ns(), tsc());
    std::thread::sleep(Duration::from_millis(20));
    let (t1, c1) = (raw_ns(), tsc());
    let ns = t1.checked_sub(t0)?;
    let khz = (c1.checked_sub(c0)? * 1_000_000 / ns.max(1)) as u64;
    (100_000..20_000_000).contains(&khz).then_some(khz)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

/// Most bytes a VM's console log or QEMU log may hold on the host. They are written by QEMU for
/// the guest (its root can flood `/dev/ttyS0`), outside every quota, so past this size a file is
/// emptied: a boot's log (what a failed boot reports) is far smaller.
const VM_LOG_MAX_BYTES: u64 = 1 << 20;
/// How often the logs' sizes are checked: at the serial port's pace (well under 1 MB/s under
/// TCG) a file never gets much past [`VM_LOG_MAX_BYTES`].
const VM_LOG_CHECK: Duration = Duration::from_millis(500);

/// Keeps the VM's host log files (console and QEMU's own output, opened for appending by QEMU)
/// under [`VM_LOG_MAX_BYTES`] until the VM is gone.
async fn cap_logs(files: Vec<std::fs::File>, mut done: tokio::sync::watch::Receiver<bool>, dir: PathBuf) {
    let mut warned = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(VM_LOG_CHECK) => {}
            _ = done.wait_for(|d| *d) => return,
        }
        for file in &files {
            if file.metadata().map(|m| m.len() > VM_LOG_MAX_BYTES).unwrap_or(false) {
                if let Err(e) = file.set_len(0) {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot empty a VM log over its size limit");
                } else if !warned {
                    warned = true;
                    tracing::warn!(dir = %dir.display(), max_bytes = VM_LOG_MAX_BYTES, "a VM's host log passed its size limit and was emptied (the guest writes to its serial console)");
                }
            }
        }
    }
}

/// The last `lines` lines of the console log, on one line.
pub fn console_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = all.len().saturating_sub(lines);
    if all.is_empty() {
        "(empty)".into()
    } else {
        all[start..].join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_older_than_the_environment_protocol_is_refused_by_name() {
        for old in [1, 4] {
            let err = need_environment(old).expect_err("an old agent").to_string();
            assert!(err.contains(&format!("protocol {old}")) && err.contains("make vm-images"), "{err}");
        }
        assert!(need_environment(guest_agent::protocol::VERSION).is_ok());
    }

    #[test]
    fn command_line_confines_qemu() {
        let spec = LaunchSpec {
            qemu: "qemu-system-x86_64".into(),
            dir: "/s/vms/sb-1".into(),
            top: "/s/vms/sb-1/top-3.qcow2".into(),
            gen: 3,
            boot: BootFiles { kernel: "/i/vmlinuz".into(), initramfs: "/i/initramfs.img".into() },
            memory_mib: 576,
            vcpus: 2,
            accel: Accel::Tcg,
            uid: 400_001,
            boot_timeout: Duration::from_secs(1),
            ram: Some("/r/vm-1.ram".into()),
            incoming: None,
            tap: None,
        };
        let args = qemu_args(&spec, Path::new("/s/vms/sb-1/agent.sock"), Path::new("/s/vms/sb-1/qmp.sock"), Path::new("/s/vms/sb-1/console.log")).join(" ");
        for want in [
            "-accel tcg -cpu max",
            "-m 576M -smp 2",
            "-nodefaults",
            "node-name=disk3,cache.no-flush=on,file.driver=file,file.locking=off,file.filename=/s/vms/sb-1/top-3.qcow2",
            "virtio-blk-device,drive=disk3",
            "-runas 400001:400001 -chroot /s/vms/sb-1",
            "-sandbox on,",
            "name=org.sandboxd.agent.0",
            "microvm,x-option-roms=off,rtc=on,isa-serial=on,memory-backend=ram",
            "memory-backend-file,id=ram,size=576M,mem-path=/r/vm-1.ram,share=on",
        ] {
            assert!(args.contains(want), "{want:?} missing from {args}");
        }
        assert!(!args.contains("-netdev") && !args.contains("-nic"), "no network device: {args}");
        assert!(!args.contains("-incoming"), "a boot loads no memory snapshot: {args}");
        assert!(args.contains("tsc_early_khz="), "TCG boots are told the TSC frequency: {args}");
        // With a network: one virtio-net device on the TAP's inherited descriptor, nothing else.
        let tap = std::fs::File::open("/dev/null").expect("a descriptor");
        let link = crate::egress::TapLink {
            fd: tap.into(),
            address: std::net::Ipv4Addr::new(100, 96, 0, 2),
            prefix_len: 30,
            gateway: std::net::Ipv4Addr::new(100, 96, 0, 1),
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&link.fd);
        let spec = LaunchSpec { tap: Some(Arc::new(link)), ..spec };
        let args = qemu_args(&spec, Path::new("/a"), Path::new("/q"), Path::new("/c")).join(" ");
        assert!(args.contains(&format!("-netdev tap,id=net0,fd={fd} -device virtio-net-device,netdev=net0,mac=02:")), "{args}");
        assert_eq!(args.matches("-netdev").count(), 1, "{args}");
        let khz = host_tsc_khz().expect("a TSC on x86_64");
        assert!((100_000..20_000_000).contains(&khz), "{khz}");
    }
}
