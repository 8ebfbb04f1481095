//! Request handling end to end over a socketpair, as the host would drive it — without a VM:
//! files under a temp dir, execs as ordinary child processes (no cgroups, which only the guest
//! has), and a fake machine for freeze, thaw and power off.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_agent::protocol::{encode, Decoded, Decoder, ErrorKind, ExecExit, ExecRequest, ExitStatus, Request, Response, Stream, GuestLimits, MAGIC, VERSION};

use super::machine::Machine;
use super::{exec, files, Agent, Conn, RequestError, Session};

#[derive(Default)]
struct FakeMachine {
    frozen: AtomicBool,
    powered_off: AtomicBool,
    hostname: std::sync::Mutex<String>,
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
}

impl Host {
    fn start() -> Host {
        let root = tempfile::tempdir().expect("tempdir");
        let machine = Arc::new(FakeMachine::default());
        let agent = Arc::new(Agent { files: files::Files::new(root.path()), cgroup: None, running: exec::Running::default(), machine: Box::new(machine.clone()) });
        let (host, guest) = UnixStream::pair().expect("socketpair");
        let mut reader = guest.try_clone().expect("clone");
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
        Host { stream: host, decoder: Decoder::new(), next_id: 1, root, machine }
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
    let limits = GuestLimits { memory_bytes: 256 << 20, max_pids: 100, cpu_millicores: 500, hostname: "sb-1".into(), workdir: "/workspace/proj".into() };
    assert_eq!(host.call(&Request::Configure(limits.clone()), b"").0, Response::Ok);
    assert_eq!(*host.machine.hostname.lock().expect("lock"), "sb-1");
    assert!(host.root.path().join("workspace/proj").is_dir());
    // Again (a VM taken from the warm pool is configured twice): still fine.
    assert_eq!(host.call(&Request::Configure(limits), b"").0, Response::Ok);
    let relative = GuestLimits { memory_bytes: 0, max_pids: 0, cpu_millicores: 0, hostname: String::new(), workdir: "work".into() };
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
    let names: Vec<String> = std::fs::read_dir(host.root.path().join("w")).expect("ls").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
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
