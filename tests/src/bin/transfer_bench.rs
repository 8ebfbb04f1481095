//! `transfer_bench`: files and directories in and out of a sandbox of each tier through the
//! streaming API (UploadFile/DownloadFile, UploadArchive/DownloadArchive), with `docker cp` of
//! the same data measured in the same run as the baseline, and the daemon's peak memory.
//!
//! `make bench` runs it after `bench`: it writes the `## Transfers` section of BENCHMARKS.md
//! (`--out FILE`), leaving the rest of the file alone. `--file-mib N` (default 1024) and
//! `--files N` (default 10000) set the sizes; `--tiers process,container,microvm` the tiers.
//! Every transfer is checked (sha256 of the file, entry count of the directory): a mismatch
//! fails the run.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use sandbox_tests::{proc_status_bytes, proto, replace_section, Daemon};
use sha2::{Digest, Sha256};

#[derive(Parser)]
#[command(about = "File and directory transfer throughput per tier, with docker cp as the baseline")]
struct Args {
    /// Size of the file moved in and out, in MiB.
    #[arg(long, default_value_t = 1024)]
    file_mib: usize,
    /// Number of files in the directory moved in and out.
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Tiers to measure.
    #[arg(long, value_delimiter = ',', default_value = "process,container,microvm")]
    tiers: Vec<String>,
    /// Markdown file whose `## Transfers` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

const PIECE: usize = 1 << 20;

/// Piece `i` of the test file: a fixed pseudo-random block with the index stamped in, so no two
/// pieces are equal and nothing has to be held in memory.
fn piece(block: &[u8], i: usize) -> Vec<u8> {
    let mut p = block.to_vec();
    p[..8].copy_from_slice(&(i as u64).to_le_bytes());
    p
}

fn block() -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..PIECE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One row: what moved, how long each way.
struct Row {
    what: String,
    into: Duration,
    out: Duration,
    note: String,
}

fn mib_s(bytes: u64, d: Duration) -> String {
    format!("{:.0} MiB/s", bytes as f64 / (1 << 20) as f64 / d.as_secs_f64().max(1e-9))
}

fn files_s(n: usize, d: Duration) -> String {
    format!("{:.0} files/s", n as f64 / d.as_secs_f64().max(1e-9))
}

/// The directory's tar: `n` small files in one directory.
fn tree_tar(n: usize) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for i in 0..n {
        let data = format!("file {i}\n");
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        b.append_data(&mut h, format!("d/f{i:05}"), data.as_bytes())?;
    }
    Ok(b.into_inner()?)
}

async fn sandboxd_tier(client: &agent_client::Client, tier: proto::Isolation, args: &Args, block: &[u8], want_sha: &str, tar: &[u8]) -> Result<(Row, Row)> {
    let mut raw = client.raw();
    let limits = proto::ResourceLimits { disk_bytes: (args.file_mib as u64 + 1024) << 20, memory_bytes: 1 << 30, ..Default::default() };
    let sandbox = client
        .create(proto::CreateSandboxRequest { isolation: tier as i32, image: "minimal".into(), limits: Some(limits), ..Default::default() })
        .await
        .with_context(|| format!("creating a {tier:?} sandbox"))?;
    let id = sandbox.id;

    // The file, in.
    let n = args.file_mib;
    let header = proto::UploadRequest {
        item: Some(proto::upload_request::Item::Header(proto::UploadHeader { sandbox_id: id.clone(), path: "/workspace/big.bin".into(), mode: 0 })),
    };
    let owned = block.to_vec();
    let sum = want_sha.to_string();
    let pieces = (0..n).map(move |i| proto::UploadRequest { item: Some(proto::upload_request::Item::Data(piece(&owned, i))) });
    let trailer = proto::UploadRequest { item: Some(proto::upload_request::Item::Sha256(sum)) };
    let stream = tokio_stream::iter(std::iter::once(header).chain(pieces).chain(std::iter::once(trailer)));
    let t0 = Instant::now();
    let reply = raw.upload_file(stream).await.context("UploadFile")?.into_inner();
    let into = t0.elapsed();
    ensure!(reply.sha256 == want_sha && reply.bytes_written == (n * PIECE) as u64, "upload: {reply:?}");

    // The file, out.
    let t0 = Instant::now();
    let mut stream =
        raw.download_file(proto::DownloadRequest { sandbox_id: id.clone(), path: "/workspace/big.bin".into() }).await.context("DownloadFile")?.into_inner();
    let (mut hasher, mut got, mut trailer) = (Sha256::new(), 0u64, String::new());
    while let Some(chunk) = stream.message().await.context("download chunk")? {
        hasher.update(&chunk.data);
        got += chunk.data.len() as u64;
        if !chunk.sha256.is_empty() {
            trailer = chunk.sha256;
        }
    }
    let out = t0.elapsed();
    let got_sha = hex(&hasher.finalize());
    ensure!(got == (n * PIECE) as u64 && got_sha == want_sha && trailer == want_sha, "download of {tier:?}: {got} bytes, sha {got_sha}, trailer {trailer}");
    let file = Row { what: format!("{tier:?} file {n} MiB"), into, out, note: String::new() };

    // The directory, in and out.
    let header = proto::UploadRequest {
        item: Some(proto::upload_request::Item::Header(proto::UploadHeader { sandbox_id: id.clone(), path: "/workspace/tree".into(), mode: 0 })),
    };
    let pieces: Vec<proto::UploadRequest> =
        tar.chunks(PIECE).map(|c| proto::UploadRequest { item: Some(proto::upload_request::Item::Data(c.to_vec())) }).collect();
    let t0 = Instant::now();
    let digest = proto::UploadRequest { item: Some(proto::upload_request::Item::Sha256(hex(&Sha256::digest(tar)))) };
    let stats = raw
        .upload_archive(tokio_stream::iter(std::iter::once(header).chain(pieces).chain(std::iter::once(digest))))
        .await
        .context("UploadArchive")?
        .into_inner();
    let into = t0.elapsed();
    ensure!(stats.files == args.files as u64, "archive upload: {stats:?}");
    let t0 = Instant::now();
    let mut stream =
        raw.download_archive(proto::DownloadRequest { sandbox_id: id.clone(), path: "/workspace/tree".into() }).await.context("DownloadArchive")?.into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.context("archive chunk")? {
        bytes.extend_from_slice(&chunk.data);
    }
    let out = t0.elapsed();
    let entries = tar::Archive::new(bytes.as_slice()).entries()?.filter_map(|e| e.ok()).filter(|e| e.header().entry_type().is_file()).count();
    ensure!(entries == args.files, "archive download of {tier:?}: {entries} files");
    let dir = Row { what: format!("{tier:?} directory of {} files", args.files), into, out, note: String::new() };
    let _ = client.raw().destroy_sandbox(proto::DestroySandboxRequest { sandbox_id: id }).await;
    Ok((file, dir))
}

fn docker(args: &[&str]) -> Result<()> {
    let out = Command::new("docker").args(args).output().with_context(|| format!("running docker {args:?}"))?;
    if !out.status.success() {
        bail!("docker {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn timed(f: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let t0 = Instant::now();
    f()?;
    Ok(t0.elapsed())
}

/// `docker cp` of the same file and directory into and out of a created container.
fn docker_baseline(args: &Args, block: &[u8], tar: &[u8], scratch: &Path) -> Result<(Row, Row)> {
    let rootfs = sandbox_tests::images_dir().join("minimal/rootfs");
    let image = "sandboxd-transfer-bench:latest";
    let status = Command::new("sh").arg("-c").arg(format!("tar -C {} -c . | docker import - {image} >/dev/null", rootfs.display())).status()?;
    ensure!(status.success(), "docker import of the minimal rootfs failed");
    let name = format!("sandboxd-transfer-bench-{}", std::process::id());
    docker(&["create", "--name", &name, image, "/bin/sh"])?;
    let result = (|| {
        let file = scratch.join("big.bin");
        {
            use std::io::Write;
            let mut f = std::io::BufWriter::new(std::fs::File::create(&file)?);
            for i in 0..args.file_mib {
                f.write_all(&piece(block, i))?;
            }
            f.flush()?;
        }
        let into = timed(|| docker(&["cp", &file.display().to_string(), &format!("{name}:/big.bin")]))?;
        let back = scratch.join("back.bin");
        let out = timed(|| docker(&["cp", &format!("{name}:/big.bin"), &back.display().to_string()]))?;
        ensure!(std::fs::metadata(&back)?.len() == (args.file_mib * PIECE) as u64, "docker cp out: wrong size");
        let file_row = Row { what: format!("docker cp file {} MiB", args.file_mib), into, out, note: String::new() };
        let tree = scratch.join("tree");
        std::fs::create_dir_all(&tree)?;
        tar::Archive::new(tar).unpack(&tree)?;
        let into = timed(|| docker(&["cp", &tree.join("d").display().to_string(), &format!("{name}:/tree")]))?;
        let tree_back = scratch.join("tree-back");
        let out = timed(|| docker(&["cp", &format!("{name}:/tree"), &tree_back.display().to_string()]))?;
        let n = std::fs::read_dir(&tree_back)?.count();
        ensure!(n == args.files, "docker cp out: {n} files");
        Ok((file_row, Row { what: format!("docker cp directory of {} files", args.files), into, out, note: String::new() }))
    })();
    let _ = docker(&["rm", "-f", &name]);
    let _ = docker(&["rmi", image]);
    result
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let block = block();
    let want_sha = {
        let mut h = Sha256::new();
        for i in 0..args.file_mib {
            h.update(piece(&block, i));
        }
        hex(&h.finalize())
    };
    let tar = tree_tar(args.files)?;
    let scratch = tempfile::tempdir()?;

    let daemon = Daemon::start().await.context("starting sandboxd")?;
    let pid = daemon.pid().context("daemon pid")?;
    let client = daemon.client().await?;
    let hwm_before = proc_status_bytes(pid, "VmHWM").unwrap_or(0);
    let mut rows = Vec::new();
    for tier in &args.tiers {
        let isolation = match tier.as_str() {
            "process" => proto::Isolation::Process,
            "container" => proto::Isolation::Container,
            "microvm" => proto::Isolation::Microvm,
            other => bail!("unknown tier {other}"),
        };
        eprintln!("transfer_bench: {tier}");
        let (file, dir) = sandboxd_tier(&client, isolation, &args, &block, &want_sha, &tar).await?;
        rows.push(file);
        rows.push(dir);
    }
    let hwm_after = proc_status_bytes(pid, "VmHWM").unwrap_or(0);
    drop(daemon);
    eprintln!("transfer_bench: docker cp");
    match docker_baseline(&args, &block, &tar, scratch.path()) {
        Ok((f, d)) => {
            rows.push(f);
            rows.push(d);
        }
        Err(e) => rows.push(Row { what: "docker cp".into(), into: Duration::ZERO, out: Duration::ZERO, note: format!("FAILED: {e:#}") }),
    }

    let mut md = String::from("## Transfers\n\n");
    md.push_str(&format!(
        "`target/release/transfer_bench` (run by `make bench`): a {} MiB file (sha256 checked both ways) and a directory of {} small files (a tar stream; entries counted) into and out of one sandbox per tier over the streaming API, `docker cp` of the same data into and out of a created container as the baseline. One run each.\n\n",
        args.file_mib, args.files
    ));
    md.push_str("| what | in | out | in (rate) | out (rate) |\n|---|---|---|---|---|\n");
    for r in &rows {
        if !r.note.is_empty() {
            md.push_str(&format!("| {} | {} | | | |\n", r.what, r.note));
            continue;
        }
        let (a, b) = if r.what.contains("directory") {
            (files_s(args.files, r.into), files_s(args.files, r.out))
        } else {
            (mib_s((args.file_mib * PIECE) as u64, r.into), mib_s((args.file_mib * PIECE) as u64, r.out))
        };
        md.push_str(&format!("| {} | {:.2} s | {:.2} s | {a} | {b} |\n", r.what, r.into.as_secs_f64(), r.out.as_secs_f64()));
    }
    md.push_str(&format!(
        "\nsandboxd's peak resident memory (VmHWM) was {} MiB before the transfers and {} MiB after them: the daemon streams, it never holds a file.\n",
        hwm_before >> 20,
        hwm_after >> 20
    ));
    print!("{md}");
    if let Some(out) = &args.out {
        replace_section(out, "## Transfers", &md)?;
        eprintln!("wrote the `## Transfers` section of {}", out.display());
    }
    Ok(())
}
