//! Streams with deadlines and budgets (issue #20): no client can hold the daemon's threads,
//! memory or descriptors with a stream it never finishes. Many header-only uploads leave
//! another tenant's Exec and ReadFile served and end with DEADLINE_EXCEEDED, their partial
//! files removed; the concurrency caps answer RESOURCE_EXHAUSTED naming their key; downloads
//! nobody reads keep the daemon's memory small, archive downloads of a deep tree its open
//! descriptors; a big stdin is not kept once the command has read it; a failed UploadArchive
//! leaves nothing of what it extracted.
//!
//! All against the real daemon on the process tier (the transport and the bounds are the same
//! for every tier). Nothing skips.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::time::Duration;

use agent_client::proto::{
    self as pb, exec_session_request::Item, upload_request, ExecRequest, ExecSessionRequest, ExecSessionStart, UploadHeader, UploadRequest,
};
use agent_client::{exec_request, Client};
use sandbox_tests::{eventually, free_port, process_sandbox, rss_bytes, sh_ok, within, Daemon, Harness, PeakRss};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn header(id: &str, path: &str) -> UploadRequest {
    UploadRequest { item: Some(upload_request::Item::Header(UploadHeader { sandbox_id: id.into(), path: path.into(), mode: 0o644 })) }
}

/// Starts an upload that sends its header and then nothing: the call and the sender that keeps
/// the stream open.
fn idle_upload(client: &Client, id: &str, path: &str) -> (tokio::task::JoinHandle<Result<pb::UploadFileResponse, tonic::Status>>, mpsc::Sender<UploadRequest>) {
    let (tx, rx) = mpsc::channel(4);
    tx.try_send(header(id, path)).expect("queue the header");
    let raw = client.raw();
    let call = tokio::spawn(async move {
        let mut raw = raw;
        raw.upload_file(ReceiverStream::new(rx)).await.map(|r| r.into_inner())
    });
    (call, tx)
}

/// A daemon on TCP with two tenants, `alpha` and `beta`, and `toml` besides; and its address.
async fn two_tenants(toml: &str) -> (Daemon, Client, Client, String) {
    let port = free_port().expect("port");
    let token = |t: &str| hex(&Sha256::digest(t.as_bytes()));
    let config = format!(
        "{toml}\n[[auth.tokens]]\ntenant = \"alpha\"\nsha256 = \"{}\"\n[[auth.tokens]]\ntenant = \"beta\"\nsha256 = \"{}\"\n",
        token("alpha-secret"),
        token("beta-secret")
    );
    let tcp = format!("tcp://127.0.0.1:{port}");
    let daemon = Daemon::start_with(&config, &["--listen", &tcp]).await.expect("daemon");
    let alpha = Client::connect(&tcp).await.expect("connect").with_token("alpha-secret").expect("token");
    let beta = Client::connect(&tcp).await.expect("connect").with_token("beta-secret").expect("token");
    (daemon, alpha, beta, tcp)
}

/// Temporary upload files in `dir` of a sandbox.
async fn temp_files(client: &Client, id: &str, dir: &str) -> usize {
    sh_ok(client, id, &format!("ls -A {dir} | grep -c '^.sbx-write' || true")).await.trim().parse().expect("a count")
}

/// 520 uploads that send their header and then nothing (more than tokio's 512 blocking
/// threads, which held one each before): another tenant's Exec and ReadFile are served while
/// they are open, and each ends with DEADLINE_EXCEEDED after `streams.idle_timeout_ms`, its
/// temporary file removed.
#[tokio::test(flavor = "multi_thread")]
async fn idle_uploads_neither_starve_another_tenant_nor_stay_open() {
    let (daemon, alpha, beta, tcp) = two_tenants("[streams]\nidle_timeout_ms = 20000\nmax_uploads = 1024\nmax_uploads_per_tenant = 1024\n").await;
    let a_sb = within(60, alpha.create(process_sandbox("minimal"))).await.expect("alpha creates").id;
    let b_sb = within(60, beta.create(process_sandbox("minimal"))).await.expect("beta creates").id;
    sh_ok(&beta, &b_sb, "echo hello > /workspace/hello").await;

    // Several connections: one HTTP/2 connection carries a bounded number of streams at once.
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(Client::connect(&tcp).await.expect("another connection").with_token("alpha-secret").expect("token"));
    }
    let n = 520;
    let mut calls = Vec::new();
    let mut senders = Vec::new();
    for i in 0..n {
        let (call, tx) = idle_upload(&clients[i % clients.len()], &a_sb, &format!("/workspace/up/f{i}"));
        calls.push(call);
        senders.push(tx);
    }
    // Every upload is open in the daemon: its temporary file exists.
    let open = eventually(20, || async { temp_files(&alpha, &a_sb, "/workspace/up").await >= n }).await;
    assert!(open, "{} of {n} uploads got as far as their temporary file", temp_files(&alpha, &a_sb, "/workspace/up").await);

    // Meanwhile the other tenant is served.
    let r = within(20, beta.exec(exec_request(&b_sb, ["echo", "served"]))).await.expect("beta's Exec while 520 uploads idle");
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "served");
    let chunk = within(20, beta.read_file(&b_sb, "/workspace/hello", 0, 0)).await.expect("beta's ReadFile while 520 uploads idle");
    assert_eq!(chunk.content, b"hello\n");

    // Each idle upload is ended with DEADLINE_EXCEEDED, and nothing of it stays.
    for call in calls {
        let status = within(120, call).await.expect("join").expect_err("an idle upload cannot succeed");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().contains("streams.idle_timeout_ms"), "{status:?}");
    }
    drop(senders);
    assert_eq!(temp_files(&alpha, &a_sb, "/workspace/up").await, 0, "the partial uploads were removed");
    drop(daemon);
}

/// A download opened on a connection of its own (unread streams on one connection would
/// soon hold its whole flow-control window, and no other stream there could move), with its
/// first message read.
struct Opened {
    stream: tonic::Streaming<pb::DownloadChunk>,
    _client: Client,
}

/// Opens a file download and reads its first message (the size), leaving the rest unread.
async fn open_download(daemon: &Daemon, id: &str, path: &str) -> Result<Opened, tonic::Status> {
    let client = daemon.client().await.expect("a connection");
    let mut stream = within(60, client.raw().download_file(pb::DownloadRequest { sandbox_id: id.into(), path: path.into() })).await?.into_inner();
    within(60, stream.message()).await?.expect("the size comes first");
    Ok(Opened { stream, _client: client })
}

/// Opens an archive download and reads its first chunk, leaving the rest unread.
async fn open_archive(daemon: &Daemon, id: &str, path: &str) -> Result<Opened, tonic::Status> {
    let client = daemon.client().await.expect("a connection");
    let mut stream = within(60, client.raw().download_archive(pb::DownloadRequest { sandbox_id: id.into(), path: path.into() })).await?.into_inner();
    within(60, stream.message()).await?.expect("a first chunk");
    Ok(Opened { stream, _client: client })
}

/// Each cap answers RESOURCE_EXHAUSTED naming its key, and a slot is free again once its
/// stream ends.
#[tokio::test(flavor = "multi_thread")]
async fn stream_caps_answer_resource_exhausted_naming_the_key() {
    let h = Harness::start_with_config(
        "[streams]\nmax_downloads_per_tenant = 2\nmax_uploads_per_tenant = 2\nmax_sessions_per_tenant = 1\nmax_archive_walks_per_tenant = 1\n",
    )
    .await;
    let id = h.sandbox().await;
    h.sh_ok(&id, "head -c 8388608 /dev/zero > /workspace/big && mkdir -p /workspace/tree && cp /workspace/big /workspace/tree/").await;

    // Downloads.
    let first = open_download(&h.daemon, &id, "/workspace/big").await.expect("first download");
    let _second = open_download(&h.daemon, &id, "/workspace/big").await.expect("second download");
    let refused = open_download(&h.daemon, &id, "/workspace/big").await.err().expect("a third download of the tenant");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("streams.max_downloads_per_tenant"), "{refused:?}");
    drop(first);
    assert!(eventually(30, || async { open_download(&h.daemon, &id, "/workspace/big").await.is_ok() }).await, "a slot is free once a download is dropped");

    // Uploads: a refused one is answered at once, without waiting for its client.
    let (u1, t1) = idle_upload(&h.client, &id, "/workspace/u1");
    let (u2, t2) = idle_upload(&h.client, &id, "/workspace/u2");
    assert!(eventually(30, || async { temp_files(&h.client, &id, "/workspace").await == 2 }).await, "two uploads open");
    let (u3, _t3) = idle_upload(&h.client, &id, "/workspace/u3");
    let status = within(30, u3).await.expect("join").expect_err("a third upload of the tenant");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("streams.max_uploads_per_tenant"), "{status:?}");
    drop((t1, t2));
    for u in [u1, u2] {
        let _ = within(60, u).await;
    }

    // Sessions.
    let session = |argv: &[&str]| {
        let (tx, rx) = mpsc::channel(4);
        let exec = ExecRequest { sandbox_id: id.clone(), argv: argv.iter().map(|a| a.to_string()).collect(), ..Default::default() };
        tx.try_send(ExecSessionRequest { item: Some(Item::Start(ExecSessionStart { exec: Some(exec), tty: false, size: None })) }).expect("start");
        let raw = h.client.raw();
        async move {
            let mut raw = raw;
            let mut events = raw.exec_session(ReceiverStream::new(rx)).await?.into_inner();
            events.message().await?;
            Ok::<_, tonic::Status>((tx, events))
        }
    };
    let _open = within(60, session(&["sleep", "600"])).await.expect("one session");
    let refused = within(60, session(&["true"])).await.expect_err("a second session of the tenant");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("streams.max_sessions_per_tenant"), "{refused:?}");

    // Archive walks, once the download slots are free again: a dropped download's slot comes
    // back when the daemon sees the stream go, so the first walk is retried until it is admitted
    // (a probe download would itself hold a slot for a moment). The second walk is refused by
    // the walk cap whatever the downloads are doing: the daemon checks it first.
    drop(_second);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let _walking = loop {
        match open_archive(&h.daemon, &id, "/workspace/tree").await {
            Ok(walk) => break walk,
            Err(e) if e.code() == Code::ResourceExhausted && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("one archive walk: {e:?}"),
        }
    };
    let refused = open_archive(&h.daemon, &id, "/workspace/tree").await.err().expect("a second archive walk of the tenant");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("streams.max_archive_walks_per_tenant"), "{refused:?}");
}

/// Downloads of a 64 MiB file that nobody reads after the first message: the daemon holds a
/// few MiB for each at most (it held ~10.8 MiB each, read ahead into queues).
#[tokio::test(flavor = "multi_thread")]
async fn downloads_nobody_reads_keep_the_daemon_small() {
    let h = Harness::start().await;
    let pid = h.daemon.pid().expect("pid");
    let id = h.sandbox().await;
    h.sh_ok(&id, "head -c 67108864 /dev/urandom > /workspace/big").await;
    // Warm: one download read to the end, so allocator pools are in the baseline.
    let mut warm = open_download(&h.daemon, &id, "/workspace/big").await.expect("download");
    while within(60, warm.stream.message()).await.expect("chunk").is_some() {}
    let before = rss_bytes(pid).expect("VmRSS");
    let n = 24u64;
    let mut open = Vec::new();
    let peak = PeakRss::start(pid, Duration::from_millis(50));
    for _ in 0..n {
        open.push(open_download(&h.daemon, &id, "/workspace/big").await.expect("download"));
    }
    // Whatever the daemon reads ahead it does right after the first message; give the
    // sampler a moment across that.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let peak = peak.stop().await;
    let grown = peak.saturating_sub(before);
    eprintln!("{n} unread downloads: daemon RSS {} MiB -> peak {} MiB (+{} KiB each)", before >> 20, peak >> 20, (grown / n) >> 10);
    assert!(grown < n * (5 << 20), "{n} unread downloads grew the daemon by {} MiB", grown >> 20);
    drop(open);
}

/// Entries of the daemon's descriptor table.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Archive downloads of a 250-level tree with a 16 MiB file at the bottom, never read: the
/// daemon's descriptors stay bounded (it held one per level for each).
#[tokio::test(flavor = "multi_thread")]
async fn deep_tree_downloads_keep_descriptors_bounded() {
    let h = Harness::start().await;
    let pid = h.daemon.pid().expect("pid");
    let id = h.sandbox().await;
    h.sh_ok(&id, "p=/workspace/deep; i=0; while [ $i -lt 250 ]; do p=$p/d; i=$((i+1)); done; mkdir -p $p && head -c 16777216 /dev/zero > $p/bottom").await;
    let before = open_fds(pid);
    let n = 8;
    let mut open = Vec::new();
    for _ in 0..n {
        open.push(open_archive(&h.daemon, &id, "/workspace/deep").await.expect("DownloadArchive"));
    }
    // Each walk goes down to the file at the bottom and waits there for its reader.
    let mut most = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline {
        most = most.max(open_fds(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let grown = most.saturating_sub(before);
    eprintln!("{n} unread deep archive downloads: {before} -> {most} descriptors");
    assert!(grown < n * 32, "{n} archive walks hold {grown} more descriptors");
    // The walks are whole when read.
    let mut first = open.remove(0);
    let mut bytes = 0usize;
    while let Some(chunk) = within(120, first.stream.message()).await.expect("chunk") {
        bytes += chunk.data.len();
    }
    // Past the first chunk (read when it was opened): the rest of the 16 MiB file and the end.
    assert!(bytes > 15 << 20, "{bytes} bytes of archive after the first chunk");
}

/// Background execs given 60 MiB of stdin each: once the command has read it, the daemon
/// does not keep it (it kept a copy per exec for the exec's life).
#[tokio::test(flavor = "multi_thread")]
async fn a_big_stdin_is_not_kept_once_read() {
    let h = Harness::start().await;
    let pid = h.daemon.pid().expect("pid");
    let id = h.sandbox().await;
    h.sh_ok(&id, "true").await;
    let before = rss_bytes(pid).expect("VmRSS");
    let n = 3;
    for i in 0..n {
        let script = format!("cat > /dev/null; touch /tmp/fed{i}; sleep 600");
        let req = ExecRequest { stdin: vec![b'x'; 60 << 20], background: true, ..exec_request(&id, ["sh", "-c", script.as_str()]) };
        let r = within(120, h.client.exec(req)).await.expect("Exec");
        assert_eq!(r.status, pb::ExecStatus::Running as i32);
    }
    let fed = eventually(60, || async { h.sh(&id, "ls /tmp/fed* | wc -l").await.stdout.starts_with(format!("{n}").as_bytes()) }).await;
    assert!(fed, "the commands read their stdin");
    let after = rss_bytes(pid).expect("VmRSS");
    let grown = after.saturating_sub(before);
    eprintln!("{n} execs with 60 MiB of stdin read: daemon RSS {} -> {} MiB", before >> 20, after >> 20);
    assert!(grown < 60 << 20, "the daemon grew by {} MiB for {n} × 60 MiB of stdin already read", grown >> 20);
}

/// A failed UploadArchive leaves nothing it extracted, and what it replaced is back: once for
/// an archive refused part way, once for a stream cut before its checksum.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_upload_archive_leaves_nothing() {
    let h = Harness::start().await;
    let id = h.sandbox().await;
    h.sh_ok(&id, "mkdir -p /workspace/dest/old && echo old > /workspace/dest/keep.txt && echo inner > /workspace/dest/old/inner").await;
    let listing = "cd /workspace/dest && find . | sort && cat keep.txt old/inner";
    let before = h.sh_ok(&id, listing).await;

    let tar = |bad: bool| {
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |path: &str, kind: tar::EntryType, data: &[u8]| {
            let mut hd = tar::Header::new_gnu();
            hd.set_entry_type(kind);
            hd.set_mode(0o644);
            hd.set_size(data.len() as u64);
            b.append_data(&mut hd, path, data).expect("append");
        };
        add("new/", tar::EntryType::Directory, b"");
        add("new/deep/er/file", tar::EntryType::Regular, &[7; 100_000]);
        add("keep.txt", tar::EntryType::Regular, b"replaced\n");
        add("old/inner", tar::EntryType::Regular, b"replaced\n");
        add("old/added", tar::EntryType::Regular, b"added\n");
        if bad {
            add("dev", tar::EntryType::Char, b"");
        }
        b.into_inner().expect("tar")
    };
    let send = |tar: Vec<u8>, with_sum: bool| {
        let sum = hex(&Sha256::digest(&tar));
        let mut msgs = vec![header(&id, "/workspace/dest")];
        msgs.extend(tar.chunks(64 << 10).map(|c| UploadRequest { item: Some(upload_request::Item::Data(c.to_vec())) }));
        if with_sum {
            msgs.push(UploadRequest { item: Some(upload_request::Item::Sha256(sum)) });
        }
        let raw = h.client.raw();
        async move {
            let mut raw = raw;
            raw.upload_archive(tokio_stream::iter(msgs)).await
        }
    };
    let refused = within(60, send(tar(true), true)).await.expect_err("a device entry is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(h.sh_ok(&id, listing).await, before, "nothing of the refused archive stays");

    let cut = within(60, send(tar(false), false)).await.expect_err("no checksum: not complete");
    assert_eq!(cut.code(), Code::Aborted, "{cut:?}");
    assert_eq!(h.sh_ok(&id, listing).await, before, "nothing of the cut upload stays");

    within(60, send(tar(false), true)).await.expect("a whole upload");
    let after = h.sh_ok(&id, listing).await;
    assert!(after.contains("./new/deep/er/file") && after.contains("replaced"), "{after}");
}
