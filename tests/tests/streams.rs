//! Streams, not messages (issue #12), end to end on every tier: interactive exec sessions (live
//! stdin, its close, a terminal with its size, Ctrl-C through the terminal, the record in
//! ListExecs, a client that goes away ending its command) and files and directories as streams
//! (a file larger than the old 64 MiB message limit in and out with matching checksums; an
//! upload with a wrong checksum or cut short leaves the old file; a directory as a tar stream
//! both ways; a hostile archive refused naming its entry).
//!
//! Each case takes the tier; [`streams!`] makes a module per tier, as the conformance suite
//! does. Nothing skips.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::time::Duration;

use agent_client::proto::{
    self as pb, exec_session_event::Event, exec_session_request::Item, upload_request, CreateSandboxRequest, ExecRequest, ExecSessionEvent, ExecSessionRequest,
    ExecSessionStart, ExecStatus, Isolation, TerminalSize, UploadHeader, UploadRequest,
};
use sandbox_tests::{text, within, Harness};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

async fn sandbox(h: &Harness, isolation: Isolation, image: &str) -> String {
    let request = CreateSandboxRequest { isolation: isolation as i32, image: image.into(), ..Default::default() };
    match within(180, h.client.create(request)).await {
        Ok(s) => s.id,
        Err(e) => panic!("CreateSandbox {isolation:?} {image}: {e}"),
    }
}

/// An open session: where to send input, and its events.
struct Session {
    tx: mpsc::Sender<ExecSessionRequest>,
    events: tonic::Streaming<ExecSessionEvent>,
    /// Output (stdout and stderr) read so far.
    seen: String,
    exec_id: String,
}

impl Session {
    async fn start(h: &Harness, id: &str, argv: &[&str], tty: Option<(u32, u32)>) -> Session {
        let (tx, rx) = mpsc::channel(16);
        let exec = ExecRequest { sandbox_id: id.into(), argv: argv.iter().map(|a| a.to_string()).collect(), timeout_ms: 120_000, ..Default::default() };
        let start = ExecSessionStart { exec: Some(exec), tty: tty.is_some(), size: tty.map(|(rows, cols)| TerminalSize { rows, cols }) };
        tx.send(ExecSessionRequest { item: Some(Item::Start(start)) }).await.expect("send start");
        let mut events = within(60, h.client.raw().exec_session(ReceiverStream::new(rx))).await.expect("ExecSession").into_inner();
        let first = within(60, events.message()).await.expect("first event").expect("an event");
        let Some(Event::Started(started)) = first.event else { panic!("the first event is not `started`: {first:?}") };
        Session { tx, events, seen: String::new(), exec_id: started.exec_id }
    }

    async fn send(&self, item: Item) {
        self.tx.send(ExecSessionRequest { item: Some(item) }).await.expect("session input");
    }

    /// Reads output until it contains `want` (within 60 s).
    async fn expect(&mut self, want: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !self.seen.contains(want) {
            let event = tokio::time::timeout_at(deadline, self.events.message()).await;
            match event {
                Ok(Ok(Some(ExecSessionEvent { event: Some(Event::Stdout(b) | Event::Stderr(b)) }))) => self.seen.push_str(&text(&b)),
                Ok(Ok(Some(other))) => panic!("waiting for {want:?} after {:?}: got {other:?}", self.seen),
                Ok(other) => panic!("waiting for {want:?} after {:?}: the stream ended: {other:?}", self.seen),
                Err(_) => panic!("{want:?} not seen within 60 s; output so far {:?}", self.seen),
            }
        }
    }

    /// Reads to the end: the result.
    async fn result(mut self) -> (pb::ExecResult, String) {
        loop {
            match within(120, self.events.message()).await.expect("session event") {
                Some(ExecSessionEvent { event: Some(Event::Stdout(b) | Event::Stderr(b)) }) => self.seen.push_str(&text(&b)),
                Some(ExecSessionEvent { event: Some(Event::Result(r)) }) => return (r, self.seen),
                other => panic!("unexpected session event {other:?}"),
            }
        }
    }
}

/// Stdin flows while the command runs: each line is answered before the next is sent; the
/// close of stdin ends it; its record is in ListExecs under the id `started` gave.
async fn live_stdin(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let mut s = Session::start(&h, &id, &["sh", "-c", "while read l; do echo got:$l; done; echo bye"], None).await;
    s.send(Item::Stdin(b"a\n".to_vec())).await;
    s.expect("got:a").await;
    s.send(Item::Stdin(b"b\n".to_vec())).await;
    s.expect("got:b").await;
    s.send(Item::CloseStdin(true)).await;
    let exec_id = s.exec_id.clone();
    let (r, out) = s.result().await;
    assert_eq!((r.status, r.exit_code), (ExecStatus::Exited as i32, 0), "{r:?}");
    assert_eq!(out, "got:a\ngot:b\nbye\n");
    assert_eq!(r.exec_id, exec_id);
    let listed = h.client.raw().list_execs(pb::ListExecsRequest { sandbox_id: id.clone(), ..Default::default() }).await.expect("ListExecs").into_inner();
    assert!(listed.execs.iter().any(|e| e.exec_id == exec_id && e.status == ExecStatus::Exited as i32), "{:?}", listed.execs);
}

/// A terminal of the size asked for (and resized), stdin a tty, Ctrl-C reaching the foreground
/// process through the terminal.
async fn terminal(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let mut s = Session::start(&h, &id, &["sh", "-c", "test -t 0 && echo is-a-tty; stty size; read l; stty size; exec sleep 100"], Some((33, 101))).await;
    s.expect("is-a-tty").await;
    s.expect("33 101").await;
    s.send(Item::Resize(TerminalSize { rows: 40, cols: 120 })).await;
    s.send(Item::Stdin(b"\n".to_vec())).await;
    s.expect("40 120").await;
    // Ctrl-C typed on the terminal: SIGINT to its foreground process group.
    s.send(Item::Stdin(b"\x03".to_vec())).await;
    let (r, _) = s.result().await;
    assert_eq!((r.status, r.signal), (ExecStatus::Signaled as i32, 2), "{r:?}");
}

/// A client that goes away ends its session's command.
async fn disconnect_ends_the_command(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let s = Session::start(&h, &id, &["sleep", "300"], None).await;
    let exec_id = s.exec_id.clone();
    drop(s);
    let r = within(60, h.client.raw().get_exec(pb::GetExecRequest { exec_id, wait: true })).await.expect("GetExec").into_inner();
    assert_eq!(r.status, ExecStatus::Signaled as i32, "{r:?}");
}

/// `python3` driven interactively on a terminal (the debian image).
async fn python_on_a_terminal(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "debian").await;
    let mut s = Session::start(&h, &id, &["python3", "-q"], Some((24, 80))).await;
    s.expect(">>> ").await;
    s.send(Item::Stdin(b"print(6*7)\n".to_vec())).await;
    s.expect("42").await;
    s.send(Item::Stdin(b"exit(3)\n".to_vec())).await;
    let (r, _) = s.result().await;
    assert_eq!((r.status, r.exit_code), (ExecStatus::Exited as i32, 3), "{r:?}");
}

fn upload_stream(id: &str, path: &str, pieces: Vec<Vec<u8>>, sha256: Option<String>) -> impl tokio_stream::Stream<Item = UploadRequest> {
    let header = UploadRequest { item: Some(upload_request::Item::Header(UploadHeader { sandbox_id: id.into(), path: path.into(), mode: 0o640 })) };
    let data = pieces.into_iter().map(|p| UploadRequest { item: Some(upload_request::Item::Data(p)) });
    let sum = sha256.map(|s| UploadRequest { item: Some(upload_request::Item::Sha256(s)) });
    tokio_stream::iter(std::iter::once(header).chain(data).chain(sum))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Downloads a file: (content, the size announced first, the sha256 announced last).
async fn download(h: &Harness, id: &str, path: &str) -> (Vec<u8>, u64, String) {
    let mut stream =
        within(60, h.client.raw().download_file(pb::DownloadRequest { sandbox_id: id.into(), path: path.into() })).await.expect("DownloadFile").into_inner();
    let (mut content, mut size, mut sha) = (Vec::new(), None, String::new());
    while let Some(chunk) = within(120, stream.message()).await.expect("download chunk") {
        size.get_or_insert(chunk.size);
        content.extend_from_slice(&chunk.data);
        if !chunk.sha256.is_empty() {
            sha = chunk.sha256;
        }
    }
    (content, size.unwrap_or_default(), sha)
}

/// A file above the old 64 MiB message limit goes in and out with matching checksums; a wrong
/// checksum is DATA_LOSS and leaves the old file.
async fn big_file_round_trip(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let size = 80 << 20;
    let content: Vec<u8> = (0..size).map(|i: usize| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let sum = hex(&Sha256::digest(&content));
    let pieces: Vec<Vec<u8>> = content.chunks(1 << 20).map(<[u8]>::to_vec).collect();
    let reply =
        within(300, h.client.raw().upload_file(upload_stream(&id, "/workspace/big.bin", pieces, Some(sum.clone())))).await.expect("UploadFile").into_inner();
    assert_eq!((reply.bytes_written, reply.sha256.as_str()), (size as u64, sum.as_str()));
    let (back, announced, sha) = download(&h, &id, "/workspace/big.bin").await;
    assert_eq!((back.len(), announced, sha.as_str()), (size, size as u64, sum.as_str()));
    assert!(back == content, "downloaded content differs");

    // A wrong checksum: refused, the old file untouched.
    let bad = within(60, h.client.raw().upload_file(upload_stream(&id, "/workspace/big.bin", vec![b"new".to_vec()], Some("00".repeat(32)))))
        .await
        .expect_err("bad checksum");
    assert_eq!(bad.code(), Code::DataLoss, "{bad}");
    let (_, announced, sha) = download(&h, &id, "/workspace/big.bin").await;
    assert_eq!((announced, sha.as_str()), (size as u64, sum.as_str()), "the old file stays");

    // No header first: refused naming it.
    let no_header = tokio_stream::iter(vec![UploadRequest { item: Some(upload_request::Item::Data(b"x".to_vec())) }]);
    let e = within(60, h.client.raw().upload_file(no_header)).await.expect_err("no header");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("header"), "{e}");
}

/// An upload cut short (the client goes away mid-stream) leaves the old file as it was.
async fn interrupted_upload_keeps_the_old_file(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let reply = h
        .client
        .raw()
        .upload_file(upload_stream(&id, "keep.txt", vec![b"old content".to_vec()], Some(hex(&Sha256::digest(b"old content")))))
        .await
        .expect("first upload")
        .into_inner();
    assert_eq!(reply.bytes_written, 11);
    // A stream that ends without its digest may have been cut short (a cancelled call looks
    // like a clean end to a server): ABORTED, and nothing replaced.
    let e = within(60, h.client.raw().upload_file(upload_stream(&id, "keep.txt", vec![b"truncated".to_vec()], None))).await.expect_err("no digest");
    assert_eq!(e.code(), Code::Aborted, "{e}");
    // A stock client whose process dies mid-upload (see the script).
    let root = sandbox_tests::workspace_root();
    let script = root.join("tests/python/grpcio_cut_upload.py");
    let (address, sid) = (h.daemon.address.clone(), id.clone());
    let status =
        tokio::task::spawn_blocking(move || std::process::Command::new("python3").arg(&script).arg(&root).arg(&address).arg(&sid).arg("keep.txt").status())
            .await
            .expect("join")
            .expect("running python3 (grpcio and grpcio-tools: make pydeps)");
    assert_eq!(status.code(), Some(3), "the client died mid-upload as planned");
    // The daemon notices the broken stream and drops the half-written file.
    assert!(sandbox_tests::eventually(30, || async { download(&h, &id, "keep.txt").await.0 == b"old content" }).await, "the old file stays");
    let (content, _, _) = download(&h, &id, "keep.txt").await;
    assert!(content == b"old content", "keep.txt holds {} bytes, not the old content", content.len());
}

/// A tar of `n` files, a nested directory, an empty one and a symlink.
fn tree_tar(n: usize) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, data: &[u8], link: Option<&str>| {
        let mut hd = tar::Header::new_gnu();
        hd.set_entry_type(kind);
        hd.set_mode(mode);
        hd.set_mtime(1_700_000_000);
        hd.set_uid(0);
        hd.set_gid(0);
        hd.set_size(data.len() as u64);
        if let Some(l) = link {
            hd.set_link_name(l).expect("link name");
        }
        b.append_data(&mut hd, path, data).expect("append");
    };
    add("sub/", tar::EntryType::Directory, 0o755, b"", None);
    add("sub/deeper/", tar::EntryType::Directory, 0o700, b"", None);
    add("empty/", tar::EntryType::Directory, 0o755, b"", None);
    add("sub/deeper/tool.sh", tar::EntryType::Regular, 0o750, b"#!/bin/sh\necho tool\n", None);
    add("link", tar::EntryType::Symlink, 0o777, b"", Some("sub/deeper/tool.sh"));
    for i in 0..n {
        add(&format!("sub/f{i:05}.txt"), tar::EntryType::Regular, 0o644, format!("file {i}\n").as_bytes(), None);
    }
    b.into_inner().expect("tar")
}

async fn upload_archive(h: &Harness, id: &str, dir: &str, tar: Vec<u8>) -> Result<pb::UploadArchiveResponse, tonic::Status> {
    let sum = hex(&Sha256::digest(&tar));
    let pieces: Vec<Vec<u8>> = tar.chunks(256 << 10).map(<[u8]>::to_vec).collect();
    within(300, h.client.raw().upload_archive(upload_stream(id, dir, pieces, Some(sum)))).await.map(|r| r.into_inner())
}

/// A directory of 2,000 files goes in as a tar stream (modes, the symlink kept), works inside,
/// and comes back out as a tar stream with the same entries; a hostile archive is refused
/// naming its entry, and writes nothing outside.
async fn directory_round_trip(isolation: Isolation) {
    let h = Harness::start().await;
    let id = sandbox(&h, isolation, "minimal").await;
    let n = 2000;
    let stats = upload_archive(&h, &id, "/workspace/tree", tree_tar(n)).await.expect("UploadArchive");
    assert_eq!((stats.files, stats.symlinks), (n as u64 + 1, 1), "{stats:?}");
    let out = h.sh_ok(&id, "cd /workspace/tree && ./link && ls sub | wc -l && stat -c %a sub/deeper/tool.sh sub/deeper && readlink link").await;
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["tool", &(n + 1).to_string(), "750", "700", "sub/deeper/tool.sh"], "{out}");

    let mut stream = within(60, h.client.raw().download_archive(pb::DownloadRequest { sandbox_id: id.clone(), path: "/workspace/tree".into() }))
        .await
        .expect("DownloadArchive")
        .into_inner();
    let mut tar_bytes = Vec::new();
    while let Some(chunk) = within(120, stream.message()).await.expect("archive chunk") {
        tar_bytes.extend_from_slice(&chunk.data);
    }
    let mut names = Vec::new();
    let mut archive = tar::Archive::new(tar_bytes.as_slice());
    for entry in archive.entries().expect("entries") {
        let entry = entry.expect("entry");
        let name = entry.path().expect("path").to_string_lossy().trim_start_matches("./").trim_end_matches('/').to_string();
        if name == "link" {
            assert_eq!(entry.header().entry_type(), tar::EntryType::Symlink);
        }
        names.push(name);
    }
    for want in ["sub/deeper/tool.sh", "link", "empty", "sub/f01999.txt"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {} entries", names.len());
    }
    assert_eq!(names.iter().filter(|n| n.starts_with("sub/f")).count(), n);

    // Hostile: an entry that climbs out of the destination.
    let mut b = tar::Builder::new(Vec::new());
    let mut hd = tar::Header::new_gnu();
    hd.set_entry_type(tar::EntryType::Regular);
    hd.set_size(4);
    hd.set_mode(0o644);
    hd.set_uid(0);
    hd.set_gid(0);
    hd.set_mtime(1_700_000_000);
    let name = b"../escaped.txt";
    hd.as_old_mut().name[..name.len()].copy_from_slice(name);
    hd.set_cksum();
    b.append(&hd, &b"evil"[..]).expect("append");
    let e = upload_archive(&h, &id, "/workspace/hostile", b.into_inner().expect("tar")).await.expect_err("hostile archive");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("escaped.txt"), "{e}");
    let r = h.sh(&id, "test -e /workspace/escaped.txt").await;
    assert_eq!(r.exit_code, 1, "nothing was written outside the destination");
}

macro_rules! streams {
    ($($tier:ident => $isolation:expr, [$($case:ident),*]);* $(;)?) => {
        $(mod $tier {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $case() {
                super::$case($isolation).await
            })*
        })*
    };
}

streams! {
    process => Isolation::Process, [live_stdin, terminal, disconnect_ends_the_command, python_on_a_terminal, big_file_round_trip, interrupted_upload_keeps_the_old_file, directory_round_trip];
    container => Isolation::Container, [live_stdin, terminal, disconnect_ends_the_command, python_on_a_terminal, big_file_round_trip, interrupted_upload_keeps_the_old_file, directory_round_trip];
    microvm => Isolation::Microvm, [live_stdin, terminal, disconnect_ends_the_command, big_file_round_trip, interrupted_upload_keeps_the_old_file, directory_round_trip];
}
