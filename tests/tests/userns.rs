//! User namespaces on the process tier (issue #21): root inside a sandbox is an unprivileged host
//! uid of the sandbox's own range, so the host's own users cannot read, open or trace what a
//! sandbox runs, and what the kernel counts per user is not shared with the host's.
//!
//! Each attack is made the way a host user would make it: a forked child of this (root) test
//! drops to uid and gid 1000 with no supplementary groups and no capabilities, then tries. The
//! same attacks against a daemon with `user_namespaces = "off"` must get through, so the checks
//! are known to be able to fail.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;

use agent_client::exec_request;
use agent_client::proto::ExecRequest;
use sandbox_tests::{eventually, host_pid_of, Harness};

/// What a host process running as uid 1000 could do to process `pid`.
#[derive(Debug, PartialEq, Eq)]
struct HostUserReach {
    environ: bool,
    root_files: bool,
    ptrace: bool,
}

/// Forks a child that becomes uid/gid 1000 (no groups; a uid change from root drops every
/// capability) and tries to read `/proc/<pid>/environ`, open `/proc/<pid>/root/etc/passwd` and
/// `PTRACE_ATTACH` to `pid`; its exit code carries one bit per attack that worked.
fn host_user_reach(pid: i32) -> HostUserReach {
    let environ = CString::new(format!("/proc/{pid}/environ")).unwrap();
    let root_file = CString::new(format!("/proc/{pid}/root/etc/passwd")).unwrap();
    // SAFETY: the child runs only async-signal-safe system calls on memory prepared before the
    // fork, then _exits; the parent waits for it.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        // SAFETY: as above.
        unsafe {
            if libc::setgroups(0, std::ptr::null()) != 0 || libc::setresgid(1000, 1000, 1000) != 0 || libc::setresuid(1000, 1000, 1000) != 0 {
                libc::_exit(100);
            }
            let mut bits = 0;
            let mut byte = 0u8;
            let fd = libc::open(environ.as_ptr(), libc::O_RDONLY);
            if fd >= 0 && libc::read(fd, (&mut byte as *mut u8).cast(), 1) >= 0 {
                bits |= 1;
            }
            if libc::open(root_file.as_ptr(), libc::O_RDONLY) >= 0 {
                bits |= 2;
            }
            if libc::ptrace(libc::PTRACE_ATTACH, pid, 0, 0) == 0 {
                bits |= 4;
                libc::ptrace(libc::PTRACE_DETACH, pid, 0, 0);
            }
            libc::_exit(bits)
        }
    }
    let mut status = 0;
    // SAFETY: waitpid of our own child with a pointer to a local.
    let waited = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(waited, child, "waitpid: {}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status), "the probe child died: status {status:#x}");
    let bits = libc::WEXITSTATUS(status);
    assert_ne!(bits, 100, "the probe child could not become uid 1000");
    HostUserReach { environ: bits & 1 != 0, root_files: bits & 2 != 0, ptrace: bits & 4 != 0 }
}

/// The `Uid:` line of `/proc/<pid>/status`: real, effective, saved, fs.
fn host_uids(pid: i32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find(|l| l.starts_with("Uid:")).expect("Uid line");
    line.split_whitespace().skip(1).map(|v| v.parse().expect("uid")).collect()
}

/// Starts `sleep <marker>` in the background of sandbox `id` as 1000:1000 with a secret in its
/// environment; returns its host pid once it runs.
async fn sleeper_as_1000(h: &Harness, id: &str, marker: &str) -> i32 {
    let mut request: ExecRequest = exec_request(id, ["sleep", marker]);
    request.user = "1000:1000".into();
    request.background = true;
    request.env.insert("API_KEY".into(), "sk-tenant-secret".into());
    h.exec(request).await;
    let mut pid = None;
    assert!(
        eventually(60, || {
            pid = host_pid_of(&["sleep", marker]);
            std::future::ready(pid.is_some())
        })
        .await,
        "the background sleep never started"
    );
    pid.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_uid_1000_cannot_read_open_or_trace_a_sandbox_uid_1000() {
    host_uid_1000_cannot_reach(&Harness::start().await).await;
}

/// The same with the files shifted on disk, as a kernel without idmapped mounts has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_uid_1000_cannot_reach_a_sandbox_whose_files_are_shifted_on_disk() {
    host_uid_1000_cannot_reach(&Harness::start_with_config("[process]\nuser_namespaces = \"shifted\"\n").await).await;
}

async fn host_uid_1000_cannot_reach(h: &Harness) {
    let id = h.sandbox().await;
    let pid = sleeper_as_1000(h, &id, "987001").await;

    let uids = host_uids(pid);
    let base = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).expect("uid_map");
    let base: u32 = base.split_whitespace().nth(1).expect("a mapping").parse().expect("base");
    assert!(base >= 1 << 30, "the sandbox's root is host uid {base}, not one of the range above 2^30");
    assert_eq!(uids, vec![base + 1000; 4], "uid 1000 inside is host uid base+1000");
    assert_eq!(host_user_reach(pid), HostUserReach { environ: false, root_files: false, ptrace: false });

    // A file root made inside belongs to the range's root on the host, and to root inside.
    h.sh_ok(&id, "echo x > /workspace/made-by-root").await;
    let meta = std::fs::metadata(format!("/proc/{pid}/root/workspace/made-by-root")).expect("stat through /proc/<pid>/root");
    assert_eq!((meta.uid(), meta.gid()), (base, base));
    // ... and so does one the daemon wrote for a client.
    h.client.write_file(&id, "/workspace/written", b"y".to_vec(), 0o644).await.expect("WriteFile");
    let meta = std::fs::metadata(format!("/proc/{pid}/root/workspace/written")).expect("stat");
    assert_eq!((meta.uid(), meta.gid()), (base, base));
    assert_eq!(h.sh_ok(&id, "stat -c '%u:%g' /workspace/written /workspace/made-by-root").await, "0:0\n0:0\n");
    // Root inside cannot become a host id outside its range: a nobody-owned file stays foreign.
    assert_eq!(h.sh_ok(&id, "cat /proc/self/uid_map").await.split_whitespace().collect::<Vec<_>>(), vec!["0", &base.to_string(), "65536"]);

    // Its mountinfo names no host path of the daemon's (state dir, images).
    let mountinfo = h.sh_ok(&id, "cat /proc/self/mountinfo").await;
    for host_path in [h.daemon.state_dir(), sandbox_tests::images_dir()] {
        let host_path = host_path.display().to_string();
        assert!(!mountinfo.contains(&host_path), "the sandbox's mountinfo shows {host_path}:\n{mountinfo}");
    }

    // A second sandbox gets a range of its own.
    let other = h.sandbox().await;
    let other_pid = sleeper_as_1000(h, &other, "987002").await;
    assert_ne!(host_uids(other_pid)[0], base + 1000, "two sandboxes share a host uid");
}

/// The host ids of a sandbox's root (read off a process of it).
async fn base_of(h: &Harness, id: &str, marker: &str) -> u32 {
    let pid = sleeper_as_1000(h, id, marker).await;
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).expect("uid_map");
    map.split_whitespace().nth(1).expect("a mapping").parse().expect("base")
}

/// `path`'s owner and mode bits as the host sees them.
fn owner(path: &std::path::Path) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

/// Without idmapped mounts (`shifted`), a sandbox's image and writable layer are shifted into
/// its range on disk and snapshots are shifted back: a snapshot holds the ids inside, so it
/// forks into another range and rolls back with every owner and set-user-ID bit right, and a
/// restart re-adopts the sandbox with its files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shifted_files_keep_their_owners_through_snapshot_fork_rollback_and_restart() {
    let mut h = Harness::start_with_config("[process]\nuser_namespaces = \"shifted\"\n").await;
    let id = h.sandbox().await;
    let base = base_of(&h, &id, "987101").await;
    let state = h.daemon.state_dir();
    let files = "stat -c '%n %u:%g %a' /bin/busybox /workspace /workspace/root-file /workspace/app-file /workspace/suid";
    let expected = "/bin/busybox 0:0 755\n/workspace 0:0 755\n/workspace/root-file 0:0 644\n/workspace/app-file 1000:1000 644\n/workspace/suid 0:0 4755\n";
    h.sh_ok(&id, "echo r > /workspace/root-file; echo a > /workspace/app-file; chown 1000:1000 /workspace/app-file; cp /bin/busybox /workspace/suid; chmod 4755 /workspace/suid").await;
    assert_eq!(h.sh_ok(&id, files).await, expected, "inside, the image's files are root's and the sandbox's its users'");
    // On disk, the writable layer is in the range, and so is the sandbox's copy of the image.
    let upper = state.join(format!("pool/sandboxes/{id}/upper"));
    assert_eq!(owner(&upper.join("workspace/root-file")), (base, base, 0o644));
    assert_eq!(owner(&upper.join("workspace/app-file")), (base + 1000, base + 1000, 0o644));
    assert_eq!(owner(&upper.join("workspace/suid")), (base, base, 0o4755));
    assert_eq!(owner(&state.join(format!("pool/shifted/{id}/bin/busybox"))).0, base, "the image shifted into the range");

    // A snapshot is canonical on disk: the ids inside, whatever the range.
    let snap = h.client.snapshot(&id, "s1").await.expect("snapshot").snapshot_id;
    let snap_upper = state.join(format!("pool/snapshots/{snap}/upper"));
    assert_eq!(owner(&snap_upper.join("workspace/root-file")), (0, 0, 0o644));
    assert_eq!(owner(&snap_upper.join("workspace/app-file")), (1000, 1000, 0o644));
    assert_eq!(owner(&snap_upper.join("workspace/suid")), (0, 0, 0o4755), "set-user-ID kept through both shifts");
    // The sandbox goes on with its files where they were.
    assert_eq!(h.sh_ok(&id, files).await, expected);

    // A fork gets another range, and the same owners inside.
    let mut fork = sandbox_tests::process_sandbox("minimal");
    fork.image = String::new();
    fork.from_snapshot_id = snap.clone();
    let forked = h.client.create(fork).await.expect("fork").id;
    let fork_base = base_of(&h, &forked, "987102").await;
    assert_ne!(fork_base, base, "a fork has a range of its own");
    assert_eq!(h.sh_ok(&forked, files).await, expected, "the fork's files inside");
    let fork_upper = state.join(format!("pool/sandboxes/{forked}/upper"));
    assert_eq!(owner(&fork_upper.join("workspace/app-file")), (fork_base + 1000, fork_base + 1000, 0o644));

    // A rollback puts back what the snapshot held, owners included.
    h.sh_ok(&id, "chown 1000:1000 /workspace/root-file; rm /workspace/app-file").await;
    h.client.rollback(&id, &snap).await.expect("rollback");
    assert_eq!(h.sh_ok(&id, files).await, expected, "after the rollback");

    // A restart re-adopts the sandbox (its range recorded with its layer) with its files.
    h.daemon.restart().await.expect("restart");
    h.client = h.daemon.client().await.expect("client");
    assert!(
        eventually(60, || async { h.client.get(&id).await.is_ok_and(|s| s.state == agent_client::proto::SandboxState::Running as i32) }).await,
        "re-adopted"
    );
    assert_eq!(h.sh_ok(&id, files).await, expected, "after a restart");
    let again = base_of(&h, &id, "987103").await;
    assert_eq!(owner(&state.join(format!("pool/sandboxes/{id}/upper/workspace/app-file"))).0, again + 1000);

    // Destroyed, a sandbox's copy of the image goes with it.
    h.client.destroy(forked.clone()).await.expect("destroy");
    assert!(!state.join(format!("pool/shifted/{forked}")).exists(), "the fork's shifted image is removed");
}

/// The control: without user namespaces the same attacks work (what issue #21 found), so the
/// test above can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_user_namespaces_the_same_attacks_get_through() {
    let h = Harness::start_with_config("[process]\nuser_namespaces = \"off\"\n").await;
    assert!(h.daemon.log().contains("user namespaces are off"), "the daemon did not say user namespaces are off");
    let id = h.sandbox().await;
    let pid = sleeper_as_1000(&h, &id, "987003").await;
    assert_eq!(host_uids(pid), vec![1000; 4]);
    let reach = host_user_reach(pid);
    assert!(reach.environ && reach.root_files, "uid 1000 on the host should reach a host-uid-1000 sandbox process: {reach:?}");
    // ptrace too, unless Yama restricts attaching to non-descendants on this host.
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").map(|s| s.trim().to_string()).unwrap_or_else(|_| "0".into());
    if yama == "0" {
        assert!(reach.ptrace, "uid 1000 on the host should be able to ptrace a host-uid-1000 sandbox process");
    }
}

/// Starts a sandbox process (as root inside) that makes 128 inotify instances (the default
/// per-user limit) and holds them; returns how many it made and whether the host's root could
/// then make one of its own.
async fn hold_inotify_instances(h: &Harness) -> (String, bool) {
    let id = h.sandbox_with("debian", Default::default()).await;
    let script = "import ctypes,os,time\n\
                  libc=ctypes.CDLL(None)\n\
                  fds=[libc.inotify_init() for _ in range(128)]\n\
                  open('/tmp/held.new','w').write(str(sum(f>=0 for f in fds)))\n\
                  os.rename('/tmp/held.new','/tmp/held')\n\
                  time.sleep(3600)\n";
    let mut hold = exec_request(&id, ["python3", "-c", script]);
    hold.background = true;
    h.exec(hold).await;
    let held = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    assert!(
        eventually(120, || {
            let (client, id, held) = (h.client.clone(), id.clone(), held.clone());
            async move {
                match client.read_file_all(&id, "/tmp/held").await {
                    Ok(bytes) => {
                        *held.lock().unwrap() = String::from_utf8_lossy(&bytes).to_string();
                        true
                    }
                    Err(_) => false,
                }
            }
        })
        .await,
        "the sandbox never reported its inotify instances"
    );
    let held = held.lock().unwrap().clone();
    // SAFETY: inotify_init1 returns a new descriptor or -1.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: closing the descriptor just made.
        unsafe { libc::close(fd) };
    }
    (held, fd >= 0)
}

/// 128 inotify instances held by root in a sandbox (the default per-user limit) leave the host's
/// root able to make its own. The control, without user namespaces, shows the shared budget the
/// test guards against: there the sandbox's root is the host's root, so either the sandbox
/// could not make all 128 (the host's own processes hold some) or the host then cannot make one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_holding_inotify_instances_does_not_use_up_the_hosts() {
    let limit = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").expect("max_user_instances");
    assert_eq!(limit.trim(), "128", "the test assumes the kernel's default per-user inotify limit");
    let h = Harness::start().await;
    let (held, host_ok) = hold_inotify_instances(&h).await;
    assert_eq!(held, "128", "the sandbox could not make 128 inotify instances");
    assert!(host_ok, "the host's root cannot make an inotify instance while a sandbox holds 128");
    drop(h);

    let h = Harness::start_with_config("[process]\nuser_namespaces = \"off\"\n").await;
    let (held, host_ok) = hold_inotify_instances(&h).await;
    assert!(held != "128" || !host_ok, "without a user namespace the sandbox's 128 instances should have used up host root's budget (the control)");
}

/// Whether a uevent socket in a sandbox receives a uevent the host triggers: the sandbox binds
/// one and says so, the host binds its own, triggers `change` on /dev/null's device and waits
/// until its own socket has the event (netlink broadcasts to every socket at send time), then
/// the sandbox polls its socket without blocking.
async fn sandbox_sees_host_uevents(h: &Harness, id: &str) -> bool {
    let script = "import os,socket,time\n\
                  s=socket.socket(socket.AF_NETLINK,socket.SOCK_DGRAM,15)\n\
                  s.bind((0,1))\n\
                  open('/tmp/bound','w').close()\n\
                  while not os.path.exists('/tmp/go'): time.sleep(0.01)\n\
                  s.setblocking(False)\n\
                  try: got=s.recv(65536)\n\
                  except BlockingIOError: got=b''\n\
                  open('/tmp/seen.new','wb').write(got)\n\
                  os.rename('/tmp/seen.new','/tmp/seen')\n";
    let mut listen = exec_request(id, ["python3", "-c", script]);
    listen.background = true;
    h.exec(listen).await;
    let client = h.client.clone();
    assert!(
        eventually(120, || {
            let (client, id) = (client.clone(), id.to_string());
            async move { client.read_file_all(&id, "/tmp/bound").await.is_ok() }
        })
        .await,
        "the sandbox never bound its uevent socket"
    );
    // The host's own listener, then the event.
    // SAFETY: socket/bind/setsockopt/recv on a descriptor owned here, with pointers to locals.
    unsafe {
        let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_KOBJECT_UEVENT);
        assert!(fd >= 0, "host uevent socket: {}", std::io::Error::last_os_error());
        let mut addr: libc::sockaddr_nl = std::mem::zeroed();
        addr.nl_family = libc::AF_NETLINK as u16;
        addr.nl_groups = 1;
        let bound = libc::bind(fd, (&addr as *const libc::sockaddr_nl).cast(), std::mem::size_of::<libc::sockaddr_nl>() as u32);
        assert_eq!(bound, 0, "host uevent bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval { tv_sec: 2, tv_usec: 0 };
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&timeout as *const libc::timeval).cast(), std::mem::size_of::<libc::timeval>() as u32);
        let mut seen = false;
        for _ in 0..30 {
            std::fs::write("/sys/devices/virtual/mem/null/uevent", "change").expect("triggering a uevent on the host");
            let mut buf = [0u8; 8192];
            loop {
                let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
                if n <= 0 {
                    break;
                }
                if String::from_utf8_lossy(&buf[..n as usize]).starts_with("change@/devices/virtual/mem/null") {
                    seen = true;
                    break;
                }
            }
            if seen {
                break;
            }
        }
        libc::close(fd);
        assert!(seen, "the host never saw its own uevent");
    }
    h.client.write_file(id, "/tmp/go", Vec::new(), 0o644).await.expect("WriteFile");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    assert!(
        eventually(60, || {
            let (client, id, seen) = (client.clone(), id.to_string(), seen.clone());
            async move {
                match client.read_file_all(&id, "/tmp/seen").await {
                    Ok(bytes) => {
                        *seen.lock().unwrap() = bytes;
                        true
                    }
                    Err(_) => false,
                }
            }
        })
        .await,
        "the sandbox never reported"
    );
    let seen = seen.lock().unwrap().clone();
    !seen.is_empty()
}

/// Host uevents (a device added, changed) reach a network namespace only when it belongs to the
/// host's user namespace: a sandbox's own user namespace keeps them out. The control without
/// user namespaces shows the leak the test guards against.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_uevents_do_not_reach_a_sandbox() {
    let h = Harness::start().await;
    let id = h.sandbox_with("debian", Default::default()).await;
    assert!(!sandbox_sees_host_uevents(&h, &id).await, "a host uevent reached the sandbox");
    drop(h);
    let h = Harness::start_with_config("[process]\nuser_namespaces = \"off\"\n").await;
    let id = h.sandbox_with("debian", Default::default()).await;
    assert!(sandbox_sees_host_uevents(&h, &id).await, "without a user namespace the host's uevent should have reached the sandbox (the control)");
}

/// The container tier shares host uids unless Docker remaps user namespaces; an operator who
/// asks for strict mode gets container creates refused, naming the setting and the fix, while
/// the process tier goes on. (This host's Docker does not remap: the test checks that first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_refuses_containers_while_docker_shares_host_uids() {
    let info = std::process::Command::new("docker").args(["info", "--format", "{{json .SecurityOptions}}"]).output().expect("docker info");
    assert!(info.status.success(), "docker info: {}", String::from_utf8_lossy(&info.stderr));
    assert!(!String::from_utf8_lossy(&info.stdout).contains("userns"), "this test expects a Docker without userns-remap");
    let h = Harness::start_with_config("[container]\nrequire_userns_remap = true\n").await;
    let request =
        agent_client::proto::CreateSandboxRequest { isolation: agent_client::proto::Isolation::Container as i32, ..sandbox_tests::process_sandbox("minimal") };
    let err = sandbox_tests::within(60, h.client.create(request)).await.expect_err("a container create in strict mode");
    let msg = err.to_string();
    assert!(msg.contains("require_userns_remap") && msg.contains("--userns-remap"), "{msg}");
    // Nothing else is affected.
    let id = h.sandbox().await;
    assert_eq!(h.sh_ok(&id, "echo ok").await, "ok\n");
}

/// A Docker Engine of this test's own, started with `--userns-remap=default` (container uids
/// shifted into `dockremap`'s subordinate range) on a socket, data root and containerd
/// namespace of its own, in a network namespace of its own (`--bridge=none` makes dockerd
/// delete any `docker0` it sees: the host's Docker's must stay), with no iptables rules.
struct RemappedDocker {
    child: std::process::Child,
    dir: tempfile::TempDir,
    netns: String,
}

impl RemappedDocker {
    fn start() -> RemappedDocker {
        let dir = tempfile::Builder::new().prefix("sbx-remapped-docker-").tempdir().expect("tempdir");
        let p = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("daemon.json"), "{}").expect("daemon.json");
        let log = std::fs::File::create(dir.path().join("dockerd.log")).expect("log");
        let ns = format!("sbxtest-remap-{}", std::process::id());
        let _ = std::process::Command::new("ip").args(["netns", "del", &ns]).output();
        let made = std::process::Command::new("ip").args(["netns", "add", &ns]).output().expect("ip netns add");
        assert!(made.status.success(), "ip netns add {ns}: {}", String::from_utf8_lossy(&made.stderr));
        // nsenter switches only the network namespace (dockerd still sees the host's cgroups and
        // mounts) and execs dockerd in place: the child's pid is dockerd's.
        let child = std::process::Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .args(["--", "dockerd", "--config-file", &p("daemon.json"), "--userns-remap=default", "--data-root", &p("data"), "--exec-root", &p("exec")])
            .args(["--pidfile", &p("dockerd.pid"), "-H", &format!("unix://{}", p("docker.sock")), "--bridge=none", "--iptables=false", "--ip6tables=false"])
            .args(["--containerd-namespace", &ns, "--containerd-plugins-namespace", &format!("{ns}-plugins")])
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("starting dockerd (the Docker Engine's daemon)");
        RemappedDocker { child, dir, netns: ns }
    }

    fn socket(&self) -> String {
        format!("unix://{}", self.dir.path().join("docker.sock").display())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("dockerd.log")).unwrap_or_default()
    }

    /// `docker info` of this engine once it answers.
    async fn ready(&self) -> String {
        let mut info = String::new();
        let answered = eventually(120, || {
            let out = std::process::Command::new("docker").args(["info", "--format", "{{json .SecurityOptions}}"]).env("DOCKER_HOST", self.socket()).output();
            info = out.as_ref().map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default();
            std::future::ready(out.is_ok_and(|o| o.status.success()))
        })
        .await;
        assert!(answered, "the remapped dockerd never answered: {}", self.log());
        info
    }
}

impl Drop for RemappedDocker {
    fn drop(&mut self) {
        // SIGTERM: dockerd stops its containers and unmounts its layers before it exits.
        // SAFETY: kill of our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.netns]).output();
    }
}

/// Container sandboxes under a Docker that remaps user namespaces: root inside is the remapped
/// range's first uid on the host and a sandbox's uid 1000 is not the host's (a host uid 1000
/// reaches nothing of it), while everything the API does keeps the ids the sandbox sees: a
/// file written through the API is root's inside, a file written by an exec keeps its owner,
/// and snapshot and rollback keep both. Strict mode (`require_userns_remap`) accepts this
/// Docker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_sandboxes_under_a_remapping_docker_keep_their_ids_apart_from_the_hosts() {
    let host_bridge = || std::process::Command::new("ip").args(["link", "show", "docker0"]).output().is_ok_and(|o| o.status.success());
    let had_bridge = host_bridge();
    let docker = RemappedDocker::start();
    let info = docker.ready().await;
    assert!(info.contains("userns"), "the engine remaps: {info}");
    let socket = docker.socket();
    let daemon = sandbox_tests::Daemon::start_with_env("[container]\nrequire_userns_remap = true\n", &[("DOCKER_HOST", &socket)]).await.expect("daemon");
    let client = daemon.client().await.expect("client");
    let h = Harness { daemon, client };
    let request =
        agent_client::proto::CreateSandboxRequest { isolation: agent_client::proto::Isolation::Container as i32, ..sandbox_tests::process_sandbox("minimal") };
    let id = sandbox_tests::within(300, h.client.create(request))
        .await
        .unwrap_or_else(|e| panic!("a container create under a remapping Docker: {e}\n{}\n{}", h.daemon.log(), docker.log()))
        .id;
    assert_eq!(h.sh_ok(&id, "id -u; id -g").await, "0\n0\n");

    // Host ids: root inside is the remapped range's first uid; uid 1000 inside is 1000 above it.
    let first = std::fs::read_to_string("/etc/subuid")
        .expect("/etc/subuid")
        .lines()
        .find_map(|l| l.strip_prefix("dockremap:").and_then(|r| r.split(':').next()).and_then(|n| n.parse::<u32>().ok()))
        .expect("dockremap's range in /etc/subuid");
    let marker = format!("37{}", std::process::id() % 10_000);
    let pid = sleeper_as_1000(&h, &id, &marker).await;
    assert_eq!(host_uids(pid), vec![first + 1000; 4], "uid 1000 inside runs as host uid {} ", first + 1000);
    assert_eq!(host_user_reach(pid), HostUserReach { environ: false, root_files: false, ptrace: false }, "host uid 1000 reaches nothing");

    // Ids the sandbox sees, through the API and through execs, and across snapshot/rollback.
    sandbox_tests::within(30, h.client.write_file(&id, "/workspace/api.txt", "from the API", 0o644)).await.expect("WriteFile");
    let mut mine: ExecRequest = exec_request(&id, ["sh", "-c", "echo mine > /tmp/mine.txt"]);
    mine.user = "1000:1000".into();
    h.exec(mine).await;
    let owners = "stat -c '%u:%g %n' /workspace/api.txt /tmp/mine.txt";
    assert_eq!(h.sh_ok(&id, owners).await, "0:0 /workspace/api.txt\n1000:1000 /tmp/mine.txt\n");
    assert_eq!(sandbox_tests::within(30, h.client.read_file(&id, "/tmp/mine.txt", 0, 0)).await.expect("ReadFile").content, b"mine\n".to_vec());
    let snap = sandbox_tests::within(120, h.client.snapshot(&id, "ids")).await.expect("snapshot").snapshot_id;
    h.sh_ok(&id, "rm /workspace/api.txt /tmp/mine.txt").await;
    sandbox_tests::within(300, h.client.rollback(&id, &snap)).await.expect("rollback");
    assert_eq!(h.sh_ok(&id, owners).await, "0:0 /workspace/api.txt\n1000:1000 /tmp/mine.txt\n", "after rollback");
    sandbox_tests::within(120, h.client.destroy(&id)).await.expect("destroy");
    drop(h);
    drop(docker);
    assert_eq!(host_bridge(), had_bridge, "the host Docker's docker0 is as it was");
}
