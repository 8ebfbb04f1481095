//! Request handling end to end over a socketpair, as the host would drive it — without a VM:
//! files under a temp dir, execs as ordinary child processes (no cgroups, which only the guest
//! has), and a fake machine for freeze, thaw and power off.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_agent::protocol::{
    encode, ArchiveCreated, ArchiveExtracted, Decoded, Decoder, ErrorKind, ExecExit, ExecRequest, ExitStatus, GuestLimits, Request, Response, Stream,
    FILE_CHUNK, MAGIC, MAX_ARCHIVE_TRANSFERS, VERSION,
};

use super::machine::Machine;
use super::{archive, exec, files, Agent, Conn, RequestError, Session};

#[derive(Default)]
struct FakeMachine {
    frozen: AtomicBool,
    powered_off: AtomicBool,
    hostname: std::sync::Mutex<String>,
    shm_bytes: std::sync::atomic::AtomicU64,
    resumed: std::sync::Mutex<Option<(u64, Vec<u8>)>>,
    network: std::sync::Mutex<Vec<Option<guest_agent::protocol::GuestNetwork>>>,
}

impl Machine for Arc<FakeMachine> {
    fn freeze(&self) -> Result<(), RequestError> {
        if self.frozen.swap(true, Ordering::SeqCst) {
            panic!("froze twice");
        }
        Ok(())
    }
    fn thaw(&self) -> Result<(), RequestError> {
        self.frozen.store(false, Ordering::SeqCst);
        Ok(())
    }
    fn power_off(&self) {
        self.powered_off.store(true, Ordering::SeqCst);
    }
    fn set_hostname(&self, name: &str) -> Result<(), RequestError> {
        *self.hostname.lock().expect("lock") = name.to_string();
        Ok(())
    }
    fn size_shm(&self, bytes: u64) -> Result<(), RequestError> {
        self.shm_bytes.store(bytes, Ordering::SeqCst);
        Ok(())
    }
    fn configure_network(&self, network: Option<&guest_agent::protocol::GuestNetwork>) -> Result<(), RequestError> {
        self.network.lock().expect("lock").push(network.copied());
        Ok(())
    }
    fn resumed(&self, unix_time_ns: u64, entropy: &[u8]) -> Result<(), RequestError> {
        *self.resumed.lock().expect("lock") = Some((unix_time_ns, entropy.to_vec()));
        Ok(())
    }
}

/// Frames of an exec before its final one: `Started`, then `Output`s.
type Frames = Vec<(Response, Vec<u8>)>;

/// The host's end of a connection to an agent serving on the other end of a socketpair.
struct Host {
    stream: UnixStream,
    decoder: Decoder,
    next_id: u64,
    root: tempfile::TempDir,
    machine: Arc<FakeMachine>,
    agent: Arc<Agent>,
    /// Frames read while waiting for another request's, by request id.
    held: Vec<(u64, Response, Vec<u8>)>,
}

impl Host {
    fn start() -> Host {
        Host::start_with_idle(archive::ARCHIVE_IDLE)
    }

    /// An agent whose archive uploads give up after `idle` without a piece.
    fn start_with_idle(idle: Duration) -> Host {
        let root = tempfile::tempdir().expect("tempdir");
        let machine = Arc::new(FakeMachine::default());
        let agent = Arc::new(Agent {
            files: files::Files::new(root.path()),
            archives: archive::Archives::with_idle(root.path(), idle),
            cgroup: None,
            running: exec::Running::default(),
            machine: Box::new(machine.clone()),
            applied: Mutex::default(),
            workers: super::workers::Workers::new(super::REQUEST_STACK),
        });
        let (host, guest) = UnixStream::pair().expect("socketpair");
        let mut reader = guest.try_clone().expect("clone");
        let served = agent.clone();
        std::thread::spawn(move || {
            let mut session = Session::new(agent, Conn::new(guest));
            let mut buf = vec![0u8; 4096];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => session.feed(&buf[..n]),
                }
            }
        });
        host.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        Host { stream: host, decoder: Decoder::new(), next_id: 1, root, machine, agent: served, held: Vec::new() }
    }

    fn send(&mut self, req: &Request, payload: &[u8]) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.stream.write_all(&encode(id, req, payload).expect("encode")).expect("write");
        id
    }

    fn recv(&mut self) -> (u64, Response, Vec<u8>) {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(event) = self.decoder.next() {
                let Decoded::Frame(f) = event else { panic!("agent sent garbage: {event:?}") };
                let env = f.envelope::<Response>().expect("agent's frames parse");
                return (env.id, env.msg, f.payload);
            }
            let n = self.stream.read(&mut buf).expect("the agent answers");
            assert!(n > 0, "the agent closed the connection");
            self.decoder.push(&buf[..n]);
        }
    }

    /// Sends a request and returns its final answer (skipping nothing: other frames panic).
    fn call(&mut self, req: &Request, payload: &[u8]) -> (Response, Vec<u8>) {
        let id = self.send(req, payload);
        let (got, resp, bytes) = self.recv();
        assert_eq!(got, id, "{resp:?}");
        (resp, bytes)
    }

    /// Runs an exec; returns the frames before the final one, the final record and its payload.
    fn exec(&mut self, req: ExecRequest, stdin: &[u8]) -> (Frames, ExecExit, Vec<u8>) {
        let id = self.send(&Request::Exec(req), stdin);
        let mut before = Vec::new();
        loop {
            let (got, resp, bytes) = self.recv();
            assert_eq!(got, id);
            match resp {
                Response::Exited(exit) => return (before, exit, bytes),
                r if r.is_final() => panic!("exec answered {r:?}"),
                r => before.push((r, bytes)),
            }
        }
    }
}

impl Host {
    /// The next frame of request `id`; frames of other requests read meanwhile are held.
    fn recv_for(&mut self, id: u64) -> (Response, Vec<u8>) {
        if let Some(at) = self.held.iter().position(|(got, _, _)| *got == id) {
            let (_, resp, bytes) = self.held.remove(at);
            return (resp, bytes);
        }
        loop {
            let (got, resp, bytes) = self.recv();
            if got == id {
                return (resp, bytes);
            }
            self.held.push((got, resp, bytes));
        }
    }

    /// Starts a session exec and waits for `Started`.
    fn start_session(&mut self, req: ExecRequest, tty: Option<(u16, u16)>, interactive: bool, stdin: &[u8]) -> u64 {
        let id = self.send(&Request::ExecSession { exec: req, tty, interactive }, stdin);
        let (resp, _) = self.recv_for(id);
        assert_eq!(resp, Response::Started);
        id
    }

    /// The rest of exec `id`: its `Output` bytes (all stdout on a terminal), final record and
    /// payload.
    fn finish(&mut self, id: u64) -> (Vec<u8>, ExecExit, Vec<u8>) {
        let mut streamed = Vec::new();
        loop {
            match self.recv_for(id) {
                (Response::Output { stream }, bytes) => {
                    assert_eq!(stream, Stream::Stdout, "a terminal has one stream");
                    streamed.extend_from_slice(&bytes);
                }
                (Response::Exited(exit), payload) => return (streamed, exit, payload),
                (other, _) => panic!("exec answered {other:?}"),
            }
        }
    }

    fn input(&mut self, exec_id: &str, bytes: &[u8]) -> u64 {
        self.send(&Request::Stdin { exec_id: exec_id.into() }, bytes)
    }
}

fn exec_req(id: &str, argv: &[&str]) -> ExecRequest {
    ExecRequest {
        exec_id: id.to_string(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![("PATH".into(), "/usr/bin:/bin".into()), ("HOME".into(), "/root".into())],
        workdir: "/".into(),
        timeout_ms: 20_000,
        max_output_bytes: 1 << 20,
        io_drain_ms: 300,
        stream: false,
        user: None,
    }
}

fn stdout_of<'a>(exit: &ExecExit, payload: &'a [u8]) -> &'a [u8] {
    &payload[..exit.stdout.len as usize]
}

fn stderr_of<'a>(exit: &ExecExit, payload: &'a [u8]) -> &'a [u8] {
    &payload[exit.stdout.len as usize..]
}

#[test]
fn hello_reports_the_protocol_version_and_kernel() {
    let mut host = Host::start();
    let (resp, _) = host.call(&Request::Hello, b"");
    let Response::Hello { version, kernel, .. } = resp else { panic!("{resp:?}") };
    assert_eq!(version, VERSION);
    assert!(!kernel.is_empty());
}

#[test]
fn garbage_is_answered_and_the_next_request_still_works() {
    let mut host = Host::start();
    host.stream.write_all(b"\x00\xffthis is not a frame").expect("write");
    let hello = encode(42, &Request::Hello, b"").expect("encode");
    host.stream.write_all(&hello).expect("write");
    let (id, resp, _) = host.recv();
    assert_eq!(id, 0);
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    let (id, resp, _) = host.recv();
    assert_eq!(id, 42);
    assert!(matches!(resp, Response::Hello { .. }), "{resp:?}");
}

#[test]
fn malformed_headers_are_bad_requests_with_the_id_when_readable() {
    let mut host = Host::start();
    // An unknown request type: the id is readable.
    host.stream.write_all(&encode(7, &serde_json::json!({"type": "format_disk"}), b"").expect("encode")).expect("write");
    let (id, resp, _) = host.recv();
    assert_eq!(id, 7);
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    // Not JSON at all: id 0.
    let mut bad = MAGIC.to_vec();
    bad.extend_from_slice(&5u32.to_be_bytes());
    bad.extend_from_slice(&0u32.to_be_bytes());
    bad.extend_from_slice(b"{nope");
    host.stream.write_all(&bad).expect("write");
    let (id, resp, _) = host.recv();
    assert_eq!(id, 0);
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    // An oversized length: skipped as garbage (one report per skipped run of bytes), then the
    // stream resynchronizes on the next frame.
    let mut huge = MAGIC.to_vec();
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    huge.extend_from_slice(&0u32.to_be_bytes());
    host.stream.write_all(&huge).expect("write");
    let hello = host.send(&Request::Hello, b"");
    let mut garbage = 0;
    loop {
        let (id, resp, _) = host.recv();
        if id == hello {
            assert!(matches!(resp, Response::Hello { .. }), "{resp:?}");
            break;
        }
        assert_eq!(id, 0);
        assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
        garbage += 1;
    }
    assert!(garbage >= 1);
}

#[test]
fn a_panicking_handler_is_an_internal_error_and_the_agent_goes_on() {
    let mut host = Host::start();
    assert_eq!(host.call(&Request::Freeze, b"").0, Response::Ok);
    assert!(host.machine.frozen.load(Ordering::SeqCst));
    // The fake machine panics on a second freeze.
    let (resp, _) = host.call(&Request::Freeze, b"");
    assert!(matches!(&resp, Response::Error { kind: ErrorKind::Internal, message } if message.contains("froze twice")), "{resp:?}");
    assert_eq!(host.call(&Request::Thaw, b"").0, Response::Ok);
    assert!(!host.machine.frozen.load(Ordering::SeqCst));
    assert!(matches!(host.call(&Request::Hello, b"").0, Response::Hello { .. }));
}

#[test]
fn shutdown_answers_before_powering_off() {
    let mut host = Host::start();
    assert_eq!(host.call(&Request::Shutdown, b"").0, Response::Ok);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !host.machine.powered_off.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "never powered off");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn configure_sets_the_hostname_and_creates_the_workdir() {
    let mut host = Host::start();
    std::fs::create_dir(host.root.path().join("etc")).expect("etc");
    std::fs::write(host.root.path().join("etc/hosts"), "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n").expect("image hosts");
    let limits = GuestLimits {
        memory_bytes: 256 << 20,
        max_pids: 100,
        cpu_millicores: 500,
        hostname: "sb-1".into(),
        workdir: "/workspace/proj".into(),
        shm_bytes: 128 << 20,
        network: None,
        machine_id: "00112233445566778899aabbccddeeff".into(),
    };
    assert_eq!(host.call(&Request::Configure(limits.clone()), b"").0, Response::Ok);
    assert_eq!(*host.machine.hostname.lock().expect("lock"), "sb-1");
    assert_eq!(host.machine.shm_bytes.load(Ordering::SeqCst), 128 << 20);
    assert!(host.root.path().join("workspace/proj").is_dir());
    assert_eq!(std::fs::read_to_string(host.root.path().join("etc/hostname")).expect("hostname"), "sb-1\n");
    assert_eq!(std::fs::read_to_string(host.root.path().join("etc/hosts")).expect("hosts"), "::1\tlocalhost\n127.0.0.1\tlocalhost\n127.0.1.1\tsb-1\n");
    assert!(!host.root.path().join("etc/resolv.conf").exists(), "no network, no resolv.conf");
    assert_eq!(std::fs::read_to_string(host.root.path().join("etc/machine-id")).expect("machine-id"), "00112233445566778899aabbccddeeff\n");
    // Again (a VM taken from the warm pool is configured twice, a VM resumed from a configured
    // snapshot once more): still fine, and what is already so is not applied again.
    host.machine.shm_bytes.store(0, Ordering::SeqCst);
    let downs = host.machine.network.lock().expect("lock").len();
    assert_eq!(host.call(&Request::Configure(GuestLimits { hostname: "sb-2".into(), ..limits.clone() }), b"").0, Response::Ok);
    assert_eq!(*host.machine.hostname.lock().expect("lock"), "sb-2", "the identity is always applied");
    assert_eq!(std::fs::read_to_string(host.root.path().join("etc/hostname")).expect("hostname"), "sb-2\n");
    assert_eq!(host.machine.shm_bytes.load(Ordering::SeqCst), 0, "/dev/shm already had that size");
    assert_eq!(host.machine.network.lock().expect("lock").len(), downs, "eth0 was already down");
    assert_eq!(host.call(&Request::Configure(GuestLimits { shm_bytes: 64 << 20, ..limits.clone() }), b"").0, Response::Ok);
    assert_eq!(host.machine.shm_bytes.load(Ordering::SeqCst), 64 << 20, "a new size is applied");
    // With a network (protocol 7): eth0 configured, resolv.conf naming the gateway only.
    let network = guest_agent::protocol::GuestNetwork {
        address: std::net::Ipv4Addr::new(100, 96, 0, 6),
        prefix_len: 30,
        gateway: std::net::Ipv4Addr::new(100, 96, 0, 5),
    };
    assert_eq!(host.call(&Request::Configure(GuestLimits { network: Some(network), ..limits }), b"").0, Response::Ok);
    assert_eq!(*host.machine.network.lock().expect("lock"), [None, Some(network)], "down once, then up");
    let conf = std::fs::read_to_string(host.root.path().join("etc/resolv.conf")).expect("resolv.conf");
    assert!(conf.ends_with("\nnameserver 100.96.0.5\n"), "{conf}");
    let relative = GuestLimits {
        memory_bytes: 0,
        max_pids: 0,
        cpu_millicores: 0,
        hostname: String::new(),
        workdir: "work".into(),
        shm_bytes: 0,
        network: None,
        machine_id: String::new(),
    };
    let (resp, _) = host.call(&Request::Configure(relative), b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{resp:?}");
}

#[test]
fn files_round_trip_through_the_protocol() {
    let mut host = Host::start();
    let (resp, _) = host.call(&Request::WriteFile { path: "/work/dir/a.txt".into(), mode: 0o640, append: false }, b"hello ");
    assert_eq!(resp, Response::Written { size: 6 });
    let (resp, _) = host.call(&Request::WriteFile { path: "/work/dir/a.txt".into(), mode: 0o640, append: true }, b"world");
    assert_eq!(resp, Response::Written { size: 11 });
    let (resp, bytes) = host.call(&Request::ReadFile { path: "/work/dir/a.txt".into(), offset: 6, limit: 100 }, b"");
    assert_eq!(resp, Response::FileData { size: 11, eof: true });
    assert_eq!(bytes, b"world");
    assert_eq!(std::fs::read(host.root.path().join("work/dir/a.txt")).expect("read"), b"hello world");
    let (resp, _) = host.call(&Request::ReadFile { path: "/nope".into(), offset: 0, limit: 1 }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::NotFound, .. }), "{resp:?}");
    let (resp, _) = host.call(&Request::ReadFile { path: "relative".into(), offset: 0, limit: 1 }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{resp:?}");
    let (resp, _) = host.call(&Request::WriteFile { path: "/work".into(), mode: 0, append: false }, b"x");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{resp:?}");
}

#[test]
fn staged_writes_replace_the_file_only_at_commit_and_remove_file_unlinks() {
    let mut host = Host::start();
    let f = host.root.path().join("w/f");
    let (resp, _) = host.call(&Request::WriteFile { path: "/w/f".into(), mode: 0, append: false }, b"old");
    assert_eq!(resp, Response::Written { size: 3 });
    let chunk = |offset: u64, commit: bool| Request::WriteStaged { transfer: "t-1".into(), path: "/w/f".into(), mode: 0o600, offset, commit };
    assert_eq!(host.call(&chunk(0, false), b"new ").0, Response::Written { size: 4 });
    assert_eq!(host.call(&chunk(4, false), b"cont").0, Response::Written { size: 8 });
    assert_eq!(std::fs::read(&f).expect("read"), b"old", "untouched until the commit");
    assert_eq!(host.call(&chunk(8, true), b"ent").0, Response::Written { size: 11 });
    assert_eq!(std::fs::read(&f).expect("read"), b"new content");
    // A chunk out of order, or of a transfer that is gone, is refused and changes nothing.
    assert_eq!(host.call(&chunk(0, false), b"abc").0, Response::Written { size: 3 });
    let (resp, _) = host.call(&chunk(5, true), b"x");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    let (resp, _) = host.call(&chunk(3, true), b"x");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    assert_eq!(std::fs::read(&f).expect("read"), b"new content");
    // An aborted transfer leaves nothing behind.
    assert_eq!(host.call(&chunk(0, false), b"abc").0, Response::Written { size: 3 });
    assert_eq!(host.call(&Request::AbortWrite { transfer: "t-1".into() }, b"").0, Response::Ok);
    assert_eq!(host.call(&Request::AbortWrite { transfer: "never".into() }, b"").0, Response::Ok);
    let names: Vec<String> =
        std::fs::read_dir(host.root.path().join("w")).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["f"], "no temporary file is left");
    assert_eq!(host.call(&Request::RemoveFile { path: "/w/f".into() }, b"").0, Response::Ok);
    assert!(!f.exists());
    assert_eq!(host.call(&Request::RemoveFile { path: "/w/f".into() }, b"").0, Response::Ok, "a missing file is fine");
    let (resp, _) = host.call(&Request::RemoveFile { path: "/w".into() }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{resp:?}");
}

#[test]
fn exec_captures_output_exit_code_and_stdin() {
    let mut host = Host::start();
    let (before, exit, payload) = host.exec(exec_req("ex-echo", &["echo", "hi"]), b"");
    assert_eq!(before, [(Response::Started, vec![])]);
    assert_eq!((exit.status, exit.exit_code, exit.signal), (ExitStatus::Exited, 0, 0));
    assert_eq!(stdout_of(&exit, &payload), b"hi\n");
    assert!(stderr_of(&exit, &payload).is_empty());

    let (_, exit, payload) = host.exec(exec_req("ex-cat", &["cat"]), b"from stdin");
    assert_eq!(stdout_of(&exit, &payload), b"from stdin");

    let (_, exit, payload) = host.exec(exec_req("ex-sh", &["sh", "-c", "echo out; echo err >&2; exit 3"]), b"");
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 3));
    assert_eq!(stdout_of(&exit, &payload), b"out\n");
    assert_eq!(stderr_of(&exit, &payload), b"err\n");
}

#[test]
fn exec_gets_exactly_its_env_and_workdir() {
    let mut host = Host::start();
    let workdir = host.root.path().join("new/work/dir");
    // A missing workdir is a start failure (the sandbox's own is made at Configure).
    let mut missing = exec_req("ex-nowd", &["pwd"]);
    missing.workdir = workdir.to_str().expect("utf8").to_string();
    let (_, exit, _) = host.exec(missing, b"");
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::SpawnFailed, 127), "{}", exit.error);
    assert!(exit.error.starts_with("cannot enter working directory"), "{}", exit.error);
    std::fs::create_dir_all(&workdir).expect("mkdir");
    let mut req = exec_req("ex-env", &["sh", "-c", "pwd; echo $FOO; env | wc -l"]);
    req.env.push(("FOO".into(), "bar".into()));
    req.workdir = workdir.to_str().expect("utf8").to_string();
    let (_, exit, payload) = host.exec(req, b"");
    assert_eq!(exit.status, ExitStatus::Exited, "{}", exit.error);
    let out = String::from_utf8_lossy(stdout_of(&exit, &payload)).to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], workdir.to_str().expect("utf8"));
    assert_eq!(lines[1], "bar");
    // PATH, HOME, FOO, and PWD which sh adds itself.
    assert!(lines[2].trim().parse::<u32>().expect("count") <= 4, "{out}");
}

#[test]
fn spawn_failures_say_why_with_shell_exit_codes() {
    let mut host = Host::start();
    let (before, exit, _) = host.exec(exec_req("ex-nf", &["definitely-not-a-command"]), b"");
    assert!(before.is_empty(), "no Started for a command that never ran");
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::SpawnFailed, 127));
    assert!(exit.error.contains("not found"), "{}", exit.error);

    let script = host.root.path().join("noexec.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").expect("write");
    let (_, exit, _) = host.exec(exec_req("ex-na", &[script.to_str().expect("utf8")]), b"");
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::SpawnFailed, 126));
    assert!(exit.error.contains("permission denied"), "{}", exit.error);

    let file = host.root.path().join("plain");
    std::fs::write(&file, "x").expect("write");
    let mut req = exec_req("ex-wd", &["true"]);
    req.workdir = file.join("sub").to_str().expect("utf8").to_string();
    let (_, exit, _) = host.exec(req, b"");
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::SpawnFailed, 127));
    assert!(exit.error.contains("working directory"), "{}", exit.error);

    let (_, exit, _) = host.exec(exec_req("ex-empty", &[]), b"");
    assert_eq!(exit.status, ExitStatus::SpawnFailed);
}

#[test]
fn a_timeout_kills_the_command_and_says_so() {
    let mut host = Host::start();
    let mut req = exec_req("ex-timeout", &["sleep", "10"]);
    req.timeout_ms = 200;
    let t0 = Instant::now();
    let (_, exit, _) = host.exec(req, b"");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!((exit.status, exit.exit_code, exit.signal), (ExitStatus::TimedOut, 137, 9));
    assert!(exit.duration_ms >= 200, "{}", exit.duration_ms);
}

#[test]
fn signals_reach_a_running_exec_and_unknown_execs_are_reported() {
    let mut host = Host::start();
    let (resp, _) = host.call(&Request::Signal { exec_id: "ex-nobody".into(), signal: 15 }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::NoSuchExec, .. }), "{resp:?}");
    let exec_id = host.send(&Request::Exec(exec_req("ex-sig", &["sleep", "30"])), b"");
    let (id, resp, _) = host.recv();
    assert_eq!((id, resp), (exec_id, Response::Started));
    let sig_id = host.send(&Request::Signal { exec_id: "ex-sig".into(), signal: 15 }, b"");
    let mut answers = Vec::new();
    while answers.len() < 2 {
        let (id, resp, _) = host.recv();
        answers.push((id, resp));
    }
    assert!(answers.contains(&(sig_id, Response::Ok)), "{answers:?}");
    let exit = answers.iter().find_map(|(id, r)| match r {
        Response::Exited(e) if *id == exec_id => Some(e.clone()),
        _ => None,
    });
    let exit = exit.expect("exec ended");
    assert_eq!((exit.status, exit.exit_code, exit.signal), (ExitStatus::Signaled, 143, 15));
}

#[test]
fn streaming_sends_output_frames_as_the_command_writes() {
    let mut host = Host::start();
    let mut req = exec_req("ex-stream", &["sh", "-c", "echo one; sleep 0.2; echo two >&2"]);
    req.stream = true;
    let (before, exit, payload) = host.exec(req, b"");
    assert_eq!(before[0].0, Response::Started);
    let mut out = Vec::new();
    let mut err = Vec::new();
    for (resp, bytes) in &before[1..] {
        match resp {
            Response::Output { stream: Stream::Stdout } => out.extend_from_slice(bytes),
            Response::Output { stream: Stream::Stderr } => err.extend_from_slice(bytes),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(out, b"one\n");
    assert_eq!(err, b"two\n");
    assert_eq!(stdout_of(&exit, &payload), b"one\n", "the final record carries the capture too");
}

#[test]
fn big_output_is_truncated_to_head_and_tail_and_spilled_whole() {
    let mut host = Host::start();
    let mut req = exec_req("ex-big", &["sh", "-c", "seq 1 100000"]);
    req.max_output_bytes = 1000;
    let (_, exit, payload) = host.exec(req, b"");
    assert!(exit.stdout.truncated);
    assert_eq!(exit.stdout.len, 1000);
    let spill = exit.stdout.spill_path.clone().expect("spilled");
    assert_eq!(spill, "/tmp/.sandboxd/ex-big.stdout");
    let whole = std::fs::read(host.root.path().join(spill.trim_start_matches('/'))).expect("spill file");
    assert_eq!(whole.len() as u64, exit.stdout.total_bytes);
    assert!(stdout_of(&exit, &payload).starts_with(b"1\n2\n3\n"));
    assert!(stdout_of(&exit, &payload).ends_with(b"99999\n100000\n"));
}

#[test]
fn a_background_process_holding_the_pipes_does_not_hold_the_exec() {
    let mut host = Host::start();
    let mut req = exec_req("ex-bg", &["sh", "-c", "sleep 30 & echo started"]);
    req.io_drain_ms = 100;
    let t0 = Instant::now();
    let (_, exit, payload) = host.exec(req, b"");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(exit.status, ExitStatus::Exited);
    assert_eq!(stdout_of(&exit, &payload), b"started\n");
}

#[test]
fn execs_run_concurrently_and_duplicate_ids_are_refused() {
    let mut host = Host::start();
    let t0 = Instant::now();
    let a = host.send(&Request::Exec(exec_req("ex-a", &["sleep", "1"])), b"");
    let b = host.send(&Request::Exec(exec_req("ex-b", &["sleep", "1"])), b"");
    let mut started = 0;
    while started < 2 {
        let (_, resp, _) = host.recv();
        assert_eq!(resp, Response::Started);
        started += 1;
    }
    let (resp, _) = host.call(&Request::Exec(exec_req("ex-a", &["true"])), b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::BadRequest, .. }), "{resp:?}");
    let mut ended = Vec::new();
    while ended.len() < 2 {
        let (id, resp, _) = host.recv();
        assert!(matches!(resp, Response::Exited(_)), "{resp:?}");
        ended.push(id);
    }
    ended.sort();
    assert_eq!(ended, [a, b]);
    assert!(t0.elapsed() < Duration::from_millis(1900), "ran one after the other: {:?}", t0.elapsed());
}

#[test]
fn a_host_that_reads_slowly_does_not_stretch_the_timeout() {
    let mut host = Host::start();
    let mut req = exec_req("ex-yes", &["yes"]);
    req.stream = true;
    req.timeout_ms = 300;
    let id = host.send(&Request::Exec(req), b"");
    // Read nothing for a while: the agent blocks sending output, the timeout must still fire.
    std::thread::sleep(Duration::from_millis(1500));
    let exit = loop {
        let (got, resp, _) = host.recv();
        assert_eq!(got, id);
        if let Response::Exited(e) = resp {
            break e;
        }
    };
    assert_eq!(exit.status, ExitStatus::TimedOut);
    assert!(exit.duration_ms < 1200, "the command ran {} ms", exit.duration_ms);
    let (resp, _) = host.call(&Request::Signal { exec_id: "ex-yes".into(), signal: 9 }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::NoSuchExec, .. }), "an ended exec is gone: {resp:?}");
}

#[test]
fn an_interactive_exec_reads_stdin_sent_after_it_started() {
    let mut host = Host::start();
    let id = host.start_session(exec_req("ex-read", &["sh", "-c", "read l; echo got:$l"]), None, true, b"");
    let typed = host.input("ex-read", b"hello\n");
    assert_eq!(host.recv_for(typed).0, Response::Ok);
    let (_, exit, payload) = host.finish(id);
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 0), "{}", exit.error);
    assert_eq!(stdout_of(&exit, &payload), b"got:hello\n");
    // The exec is gone: its input is refused, as is input for an exec that never was.
    let late = host.input("ex-read", b"late\n");
    assert!(matches!(host.recv_for(late).0, Response::Error { kind: ErrorKind::NoSuchExec, .. }));
    let (resp, _) = host.call(&Request::CloseStdin { exec_id: "ex-nobody".into() }, b"");
    assert!(matches!(resp, Response::Error { kind: ErrorKind::NoSuchExec, .. }), "{resp:?}");
}

#[test]
fn interactive_stdin_keeps_its_order_after_the_payload_and_closes_on_request() {
    let mut host = Host::start();
    let id = host.start_session(exec_req("ex-cat", &["cat"]), None, true, b"payload;");
    // Sent without waiting for the answers: they are applied, and answered, in order.
    let mut sent = Vec::new();
    for i in 0..50 {
        sent.push(host.input("ex-cat", format!("{i};").as_bytes()));
    }
    sent.push(host.send(&Request::Resize { exec_id: "ex-cat".into(), rows: 10, cols: 10 }, b""));
    sent.push(host.send(&Request::CloseStdin { exec_id: "ex-cat".into() }, b""));
    let (_, exit, payload) = host.finish(id);
    let expected: String = std::iter::once("payload;".to_string()).chain((0..50).map(|i| format!("{i};"))).collect();
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 0));
    assert_eq!(String::from_utf8_lossy(stdout_of(&exit, &payload)), expected, "cat ended at the close");
    let answers: Vec<u64> = std::iter::from_fn(|| {
        host.held.first().map(|(id, _, _)| *id).inspect(|_| {
            let (_, resp, _) = host.held.remove(0);
            assert_eq!(resp, Response::Ok);
        })
    })
    .collect();
    assert_eq!(answers, sent, "one Ok each, in the order sent");
}

#[test]
fn a_plain_exec_takes_no_live_input() {
    let mut host = Host::start();
    let id = host.send(&Request::Exec(exec_req("ex-plain", &["sleep", "30"])), b"");
    assert_eq!(host.recv_for(id).0, Response::Started);
    let typed = host.input("ex-plain", b"x");
    assert!(matches!(host.recv_for(typed).0, Response::Error { kind: ErrorKind::BadRequest, .. }));
    let kill = host.send(&Request::Signal { exec_id: "ex-plain".into(), signal: 9 }, b"");
    assert_eq!(host.recv_for(kill).0, Response::Ok);
    let (_, exit, _) = host.finish(id);
    assert_eq!(exit.status, ExitStatus::Signaled);
}

#[test]
fn a_flooded_input_queue_is_refused_and_the_end_answers_what_was_queued() {
    let mut host = Host::start();
    // `sleep` never reads: the pipe fills (64 KiB into the first chunk), then the guest's queue
    // (16 chunks of 256 KiB make its 4 MiB), then input is refused at once.
    let id = host.start_session(exec_req("ex-deaf", &["sleep", "30"]), None, true, b"");
    let chunk = vec![b'z'; 256 << 10];
    let sent: Vec<u64> = (0..40).map(|_| host.input("ex-deaf", &chunk)).collect();
    let mut refused = Vec::new();
    while refused.len() < 22 {
        let (got, resp, bytes) = host.recv();
        match resp {
            Response::Error { kind: ErrorKind::BadRequest, message } if sent.contains(&got) => {
                assert!(message.contains("full"), "{message}");
                refused.push(got);
            }
            other => host.held.push((got, other, bytes)),
        }
    }
    let kill = host.send(&Request::Signal { exec_id: "ex-deaf".into(), signal: 9 }, b"");
    assert_eq!(host.recv_for(kill).0, Response::Ok);
    let (_, exit, _) = host.finish(id);
    assert_eq!(exit.status, ExitStatus::Signaled);
    // Every input request is answered exactly once: refused at once, or — never read by the
    // command — told the exec ended, or `Ok` for bytes discarded once the killed command's end
    // of the pipe was gone (EPIPE) before the writer was stopped.
    let mut ended = 0;
    let rest: Vec<u64> = sent.iter().copied().filter(|s| !refused.contains(s)).collect();
    for s in rest {
        match host.recv_for(s).0 {
            Response::Error { kind: ErrorKind::BadRequest, .. } => refused.push(s),
            Response::Error { kind: ErrorKind::NoSuchExec, .. } | Response::Ok => ended += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!((16..=18).contains(&ended), "{ended} were queued (or being written), {} refused", refused.len());
    assert_eq!(ended + refused.len(), sent.len());
    assert!(host.held.is_empty(), "{:?}", host.held);
}

#[test]
fn a_terminal_exec_is_on_a_tty_and_its_output_is_one_stream() {
    let mut host = Host::start();
    let mut req = exec_req("ex-tty", &["sh", "-c", "test -t 0 && test -t 1 && test -t 2 && echo on-a-tty; echo to-stderr >&2; read l; echo got:$l"]);
    req.stream = true;
    let id = host.start_session(req, Some((24, 80)), true, b"");
    let typed = host.input("ex-tty", b"hi\n");
    assert_eq!(host.recv_for(typed).0, Response::Ok);
    let (streamed, exit, payload) = host.finish(id);
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 0), "{}", exit.error);
    let out = String::from_utf8_lossy(stdout_of(&exit, &payload)).to_string();
    assert_eq!(streamed, stdout_of(&exit, &payload), "streamed and captured alike");
    // A terminal turns "\n" into "\r\n", and echoes what is typed.
    assert!(out.contains("on-a-tty\r\n"), "{out:?}");
    assert!(out.contains("to-stderr\r\n"), "{out:?}");
    assert!(out.contains("hi\r\n"), "the echo: {out:?}");
    assert!(out.contains("got:hi\r\n"), "{out:?}");
    assert_eq!(exit.stderr.len, 0);
    assert!(stderr_of(&exit, &payload).is_empty());
}

#[test]
fn ctrl_c_on_the_terminal_interrupts_the_foreground_command() {
    let mut host = Host::start();
    let t0 = Instant::now();
    let id = host.start_session(exec_req("ex-intr", &["sleep", "100"]), Some((24, 80)), true, b"");
    let typed = host.input("ex-intr", b"\x03");
    let (_, exit, _) = host.finish(id);
    assert_eq!((exit.status, exit.exit_code, exit.signal), (ExitStatus::Signaled, 130, libc::SIGINT), "{}", exit.error);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(host.recv_for(typed).0, Response::Ok);
}

#[test]
fn a_terminal_is_resized_in_order_and_ctrl_d_closes_its_input() {
    let mut host = Host::start();
    let mut req = exec_req("ex-size", &["sh", "-c", "stty size; read l; stty size; cat; echo cat-done"]);
    req.stream = true;
    let id = host.start_session(req, Some((24, 80)), true, b"");
    // The size it started with, before it is changed.
    let mut out = Vec::new();
    while !String::from_utf8_lossy(&out).contains("24 80") {
        match host.recv_for(id) {
            (Response::Output { .. }, bytes) => out.extend_from_slice(&bytes),
            other => panic!("{other:?}"),
        }
    }
    let resize = host.send(&Request::Resize { exec_id: "ex-size".into(), rows: 30, cols: 100 }, b"");
    let line = host.input("ex-size", b"\n");
    let more = host.input("ex-size", b"more\n");
    let close = host.send(&Request::CloseStdin { exec_id: "ex-size".into() }, b"");
    let (streamed, exit, payload) = host.finish(id);
    out.extend_from_slice(&streamed);
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 0), "{}", exit.error);
    assert_eq!(out, stdout_of(&exit, &payload));
    let out = String::from_utf8_lossy(&out).to_string();
    let second = out.find("30 100").expect("the new size, applied before the line that follows it");
    let done = out.find("cat-done").expect("cat ended at the Ctrl-D");
    assert!(second < done, "{out:?}");
    assert!(out[second..done].contains("more"), "cat's copy: {out:?}");
    for req in [resize, line, more, close] {
        assert_eq!(host.recv_for(req).0, Response::Ok);
    }
}

#[test]
fn a_terminal_exec_that_is_not_interactive_gets_its_payload_then_end_of_file() {
    let mut host = Host::start();
    let req = exec_req("ex-tty-plain", &["sh", "-c", "test -t 0 && echo tty; cat; echo cat-done"]);
    let id = host.start_session(req, Some((5, 40)), false, b"payload\n");
    let (_, exit, payload) = host.finish(id);
    assert_eq!((exit.status, exit.exit_code), (ExitStatus::Exited, 0), "{}", exit.error);
    let out = String::from_utf8_lossy(stdout_of(&exit, &payload)).to_string();
    assert!(out.contains("tty\r\n") && out.contains("payload\r\n") && out.ends_with("cat-done\r\n"), "{out:?}");
    let typed = host.input("ex-tty-plain", b"x");
    assert!(matches!(host.recv_for(typed).0, Response::Error { kind: ErrorKind::NoSuchExec, .. }));
}

// --- Archives (protocol 4) ---

impl Host {
    /// Uploads `tar` into `dest` in pieces of `piece` bytes, each sent once the one before was
    /// answered, as the host does; the last (possibly empty) piece's answer, or the first error.
    fn upload_archive(&mut self, transfer: &str, dest: &str, tar: &[u8], piece: usize) -> Response {
        let mut offset = 0u64;
        for chunk in tar.chunks(piece) {
            let req = Request::UploadArchive { transfer: transfer.into(), dest: dest.into(), offset, last: false };
            let id = self.send(&req, chunk);
            offset += chunk.len() as u64;
            match self.recv_for(id).0 {
                Response::Written { size } => assert_eq!(size, offset, "the bytes taken so far"),
                other => return other,
            }
        }
        let id = self.send(&Request::UploadArchive { transfer: transfer.into(), dest: dest.into(), offset, last: true }, b"");
        self.recv_for(id).0
    }

    /// Downloads the tar stream of `path`: the bytes and the final answer.
    fn download_archive(&mut self, transfer: &str, path: &str) -> (Vec<u8>, Response) {
        let id = self.send(&Request::DownloadArchive { transfer: transfer.into(), path: path.into() }, b"");
        let mut tar = Vec::new();
        loop {
            match self.recv_for(id) {
                (Response::ArchiveData, bytes) => {
                    assert!(!bytes.is_empty() && bytes.len() as u64 <= FILE_CHUNK, "a frame of {} bytes", bytes.len());
                    tar.extend_from_slice(&bytes);
                }
                (last, bytes) => {
                    assert!(last.is_final() && bytes.is_empty(), "{last:?}");
                    return (tar, last);
                }
            }
        }
    }
}

/// A ustar archive of `(name, type flag, data or link target)` entries, written by hand: the
/// `tar` crate refuses to write the names a hostile client would.
fn raw_tar(entries: &[(&str, u8, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, kind, body) in entries {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        let size = if *kind == b'0' { body.len() } else { 0 };
        h[100..108].copy_from_slice(b"0000644\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
        h[136..148].copy_from_slice(b"14000000000\0");
        h[156] = *kind;
        if *kind == b'2' {
            h[157..157 + body.len()].copy_from_slice(body);
        }
        h[257..265].copy_from_slice(b"ustar\x0000");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        out.extend_from_slice(&h);
        if size > 0 {
            out.extend_from_slice(body);
            out.resize(out.len().next_multiple_of(512), 0);
        }
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// Every name below `dir` with what it is: `d mode`, `f mode <bytes>`, `l <target>`.
fn tree_of(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("ls") {
            let path = entry.expect("entry").path();
            let rel = path.strip_prefix(dir).expect("below").to_string_lossy().into_owned();
            let meta = std::fs::symlink_metadata(&path).expect("lstat");
            let mode = meta.permissions().mode() & 0o7777;
            let what = if meta.file_type().is_symlink() {
                format!("l {}", std::fs::read_link(&path).expect("readlink").display())
            } else if meta.is_dir() {
                todo.push(path.clone());
                format!("d {mode:o}")
            } else {
                let bytes = std::fs::read(&path).expect("read");
                format!("f {mode:o} {} {:?}", bytes.len(), &bytes[..bytes.len().min(32)])
            };
            out.insert(rel, what);
        }
    }
    out
}

#[test]
fn a_tree_goes_out_and_back_in_as_a_tar_stream() {
    use std::os::unix::fs::PermissionsExt;
    let mut host = Host::start();
    let src = host.root.path().join("src");
    std::fs::create_dir_all(src.join("a/b/c")).expect("mkdir");
    std::fs::create_dir(src.join("empty")).expect("mkdir");
    std::fs::write(src.join("top.txt"), b"top\n").expect("write");
    std::fs::write(src.join("a/b/c/deep.txt"), b"deep down\n").expect("write");
    std::fs::write(src.join("a/run.sh"), b"#!/bin/sh\necho hi\n").expect("write");
    std::fs::set_permissions(src.join("a/run.sh"), std::fs::Permissions::from_mode(0o750)).expect("chmod");
    // More than a frame, so the stream comes in several.
    let big: Vec<u8> = (0..(FILE_CHUNK as usize + 300_000)).map(|i| (i % 251) as u8).collect();
    std::fs::write(src.join("a/b/big.bin"), &big).expect("write");
    std::os::unix::fs::symlink("../top.txt", src.join("a/up")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", src.join("abs-link")).expect("symlink");

    let (tar, end) = host.download_archive("d1", "/src");
    let Response::ArchiveEnd(made) = end else { panic!("{end:?}") };
    assert_eq!(made, ArchiveCreated { files: 4, dirs: 5, symlinks: 2, hardlinks: 0, bytes: big.len() as u64 + 4 + 10 + 18, skipped: 0, changed: 0 });
    assert_eq!(tar.len() % 512, 0, "whole tar records");

    // Back in, into a directory that does not exist yet, in pieces that cut headers in two.
    let answer = host.upload_archive("u1", "/restored/here", &tar, 100_003);
    let Response::Extracted(stats) = answer else { panic!("{answer:?}") };
    assert_eq!(stats, ArchiveExtracted { files: 4, dirs: 5, symlinks: 2, hardlinks: 0, bytes: made.bytes });
    let restored = host.root.path().join("restored/here");
    assert_eq!(tree_of(&restored), tree_of(&src), "the same tree");
    assert_eq!(std::fs::read(restored.join("a/b/big.bin")).expect("read"), big);
    assert_eq!(std::fs::read_link(restored.join("abs-link")).expect("readlink"), std::path::Path::new("/etc/passwd"), "stored, not followed");
    // A whole stream in its last piece works as well, and a single file downloads as itself.
    let (one, end) = host.download_archive("d2", "/src/top.txt");
    assert!(matches!(end, Response::ArchiveEnd(ArchiveCreated { files: 1, .. })), "{end:?}");
    let id = host.send(&Request::UploadArchive { transfer: "u2".into(), dest: "/single".into(), offset: 0, last: true }, &one);
    assert!(matches!(host.recv_for(id).0, Response::Extracted(ArchiveExtracted { files: 1, .. })));
    assert_eq!(std::fs::read(host.root.path().join("single/top.txt")).expect("read"), b"top\n");
    assert_eq!(host.agent.archives.in_progress(), 0, "finished transfers leave nothing behind");
}

#[test]
fn a_hostile_archive_is_refused_naming_the_entry_and_nothing_lands_outside() {
    let mut host = Host::start();
    let tar = raw_tar(&[("fine", b'0', b"ok"), ("../x", b'0', b"evil")]);
    let answer = host.upload_archive("h1", "/dst", &tar, 1 << 20);
    let Response::Error { kind, message } = answer else { panic!("{answer:?}") };
    assert_eq!(kind, ErrorKind::InvalidPath, "{message}");
    assert!(message.starts_with("../x: refused"), "names the entry: {message}");
    assert!(!host.root.path().join("dst/fine").exists(), "what came before is taken out again (all or nothing)");
    assert!(!host.root.path().join("x").exists());
    // Refused before the last piece: the next piece hears it.
    let tar = raw_tar(&[("link", b'2', b"/"), ("link/etc-owned", b'0', b"evil")]);
    let id = host.send(&Request::UploadArchive { transfer: "h2".into(), dest: "/dst2".into(), offset: 0, last: false }, &tar);
    assert_eq!(host.recv_for(id).0, Response::Written { size: tar.len() as u64 });
    let id = host.send(&Request::UploadArchive { transfer: "h2".into(), dest: "/dst2".into(), offset: tar.len() as u64, last: true }, b"");
    let answer = host.recv_for(id).0;
    assert!(matches!(&answer, Response::Error { kind: ErrorKind::InvalidPath, message } if message.starts_with("link/etc-owned")), "{answer:?}");
    assert!(!host.root.path().join("etc-owned").exists());
    // Not a tar at all, a device node, and a destination that is a file.
    let garbage = host.upload_archive("h3", "/dst3", &[b'x'; 1024], 1 << 20);
    assert!(matches!(garbage, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{garbage:?}");
    let device = host.upload_archive("h4", "/dst4", &raw_tar(&[("null", b'3', b"")]), 1 << 20);
    assert!(matches!(&device, Response::Error { kind: ErrorKind::InvalidPath, message } if message.contains("null")), "{device:?}");
    std::fs::write(host.root.path().join("plain"), b"x").expect("write");
    let not_dir = host.upload_archive("h5", "/plain", &raw_tar(&[("f", b'0', b"x")]), 1 << 20);
    assert!(matches!(not_dir, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{not_dir:?}");
    assert_eq!(host.agent.archives.in_progress(), 0, "failed transfers leave nothing behind once told");
}

#[test]
fn an_aborted_upload_stops_and_frees_its_slot() {
    let mut host = Host::start();
    let tar = raw_tar(&[("a", b'0', b"first"), ("b", b'0', &[7u8; 5000])]);
    let half = 1024;
    let id = host.send(&Request::UploadArchive { transfer: "t1".into(), dest: "/dst".into(), offset: 0, last: false }, &tar[..half]);
    assert_eq!(host.recv_for(id).0, Response::Written { size: half as u64 });
    assert_eq!(host.call(&Request::AbortWrite { transfer: "t1".into() }, b"").0, Response::Ok);
    let id = host.send(&Request::UploadArchive { transfer: "t1".into(), dest: "/dst".into(), offset: half as u64, last: true }, &tar[half..]);
    let answer = host.recv_for(id).0;
    assert!(matches!(&answer, Response::Error { kind: ErrorKind::BadRequest, message } if message.contains("aborted")), "{answer:?}");
    assert!(!host.root.path().join("dst/b").exists(), "nothing after the abort");
    // A piece out of step drops the transfer; so does an abort of an unknown id (Ok).
    let id = host.send(&Request::UploadArchive { transfer: "t2".into(), dest: "/dst".into(), offset: 0, last: false }, &tar[..half]);
    assert_eq!(host.recv_for(id).0, Response::Written { size: half as u64 });
    let id = host.send(&Request::UploadArchive { transfer: "t2".into(), dest: "/dst".into(), offset: 7, last: false }, b"x");
    assert!(matches!(host.recv_for(id).0, Response::Error { kind: ErrorKind::BadRequest, .. }));
    assert_eq!(host.call(&Request::AbortWrite { transfer: "nope".into() }, b"").0, Response::Ok);
    // The bound counts open uploads; an abort makes room.
    for i in 0..MAX_ARCHIVE_TRANSFERS {
        let id = host.send(&Request::UploadArchive { transfer: format!("m{i}"), dest: format!("/m{i}"), offset: 0, last: false }, &tar[..512]);
        assert_eq!(host.recv_for(id).0, Response::Written { size: 512 });
    }
    let id = host.send(&Request::UploadArchive { transfer: "more".into(), dest: "/more".into(), offset: 0, last: false }, &tar[..512]);
    assert!(matches!(host.recv_for(id).0, Response::Error { kind: ErrorKind::Internal, .. }), "over the bound");
    assert_eq!(host.call(&Request::AbortWrite { transfer: "m0".into() }, b"").0, Response::Ok);
    assert_eq!(host.upload_archive("more", "/more", &tar, 700), Response::Extracted(ArchiveExtracted { files: 2, bytes: 5005, ..Default::default() }));
    // A host that goes away takes its transfers with it.
    let mut session = Session::new(host.agent.clone(), Conn::new(std::io::sink()));
    session.reset();
    assert_eq!(host.agent.archives.in_progress(), 0);
}

#[test]
fn an_upload_left_idle_expires_and_its_next_piece_hears_why() {
    let mut host = Host::start_with_idle(Duration::from_millis(200));
    let tar = raw_tar(&[("a", b'0', &[1u8; 3000])]);
    let id = host.send(&Request::UploadArchive { transfer: "slow".into(), dest: "/dst".into(), offset: 0, last: false }, &tar[..1000]);
    assert_eq!(host.recv_for(id).0, Response::Written { size: 1000 });
    std::thread::sleep(Duration::from_millis(600));
    let id = host.send(&Request::UploadArchive { transfer: "slow".into(), dest: "/dst".into(), offset: 1000, last: true }, &tar[1000..]);
    let answer = host.recv_for(id).0;
    assert!(matches!(&answer, Response::Error { kind: ErrorKind::BadRequest, message } if message.contains("no piece")), "{answer:?}");
    assert_eq!(host.agent.archives.in_progress(), 0);
}

#[test]
fn a_download_of_nothing_fails_before_any_byte_and_an_abort_stops_one() {
    let mut host = Host::start();
    let (tar, end) = host.download_archive("d1", "/missing");
    assert!(tar.is_empty());
    assert!(matches!(&end, Response::Error { kind: ErrorKind::NotFound, message } if message.contains("/missing")), "{end:?}");
    nix::unistd::mkfifo(&host.root.path().join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
    let (tar, end) = host.download_archive("d2", "/fifo");
    assert!(tar.is_empty() && matches!(end, Response::Error { kind: ErrorKind::InvalidPath, .. }), "{end:?}");
    let (_, end) = host.download_archive("d3", "/../..");
    assert!(matches!(end, Response::Error { kind: ErrorKind::InvalidPath, .. }), "`..` is refused: {end:?}");

    // Far more than the socket holds: the guest waits for the host to read, frame by frame.
    std::fs::create_dir(host.root.path().join("big")).expect("mkdir");
    for i in 0..4 {
        std::fs::write(host.root.path().join(format!("big/f{i}")), vec![i as u8; 8 << 20]).expect("write");
    }
    let id = host.send(&Request::DownloadArchive { transfer: "d4".into(), path: "/big".into() }, b"");
    let (first, bytes) = host.recv_for(id);
    assert_eq!((first, bytes.is_empty()), (Response::ArchiveData, false));
    let abort = host.send(&Request::AbortWrite { transfer: "d4".into() }, b"");
    let mut got = bytes.len();
    let end = loop {
        match host.recv_for(id) {
            (Response::ArchiveData, bytes) => got += bytes.len(),
            (end, _) => break end,
        }
    };
    assert!(matches!(&end, Response::Error { message, .. } if message.contains("aborted")), "{end:?}");
    assert!(got < 32 << 20, "stopped early: {got} bytes");
    assert_eq!(host.recv_for(abort).0, Response::Ok);
    assert_eq!(host.agent.archives.in_progress(), 0);
    // A second transfer of a running download's id is refused (the running one is registered
    // before its first frame).
    let id = host.send(&Request::DownloadArchive { transfer: "d5".into(), path: "/big".into() }, b"");
    let (first, bytes) = host.recv_for(id);
    assert_eq!(first, Response::ArchiveData);
    let dup = host.send(&Request::DownloadArchive { transfer: "d5".into(), path: "/big".into() }, b"");
    let refused = host.recv_for(dup).0;
    assert!(matches!(refused, Response::Error { kind: ErrorKind::BadRequest, .. }), "{refused:?}");
    let mut got = bytes.len();
    let end = loop {
        match host.recv_for(id) {
            (Response::ArchiveData, bytes) => got += bytes.len(),
            (end, _) => break end,
        }
    };
    assert!(matches!(end, Response::ArchiveEnd(ArchiveCreated { files: 4, .. })), "{end:?}");
    assert!(got > 32 << 20, "the whole stream: {got}");
}
