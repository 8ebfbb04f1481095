//! The stand-in's streaming RPCs: exec sessions with a few fake commands, files kept in the
//! same in-memory map as WriteFile/ReadFile, and archives extracted into and packed from a
//! real temp directory.
//!
//! Fake session commands: `cat` echoes stdin as it arrives and exits 0 at close_stdin; `sleep`
//! ignores stdin and waits for a signal; `missing` cannot start. With `tty` every command acts
//! as a terminal would: it prints `[tty ROWSxCOLS TERM=… argv=…]` first, echoes keys, prints
//! `[resize ROWSxCOLS]`, ends SIGNALED by SIGINT on `\x03` (Ctrl-C) and exits 0 on `\x04`
//! (Ctrl-D) or close_stdin.
//!
//! Special files for DownloadFile: `/corrupt` (its trailing sha256 is wrong) and `/short` (the
//! announced size is 10 bytes more than sent). DownloadArchive of `/hostile/KIND` sends a
//! hostile archive: `abs`, `dotdot`, `symlink` (a link to `/tmp/…outside`, then a file through
//! it), `device`, `hardlink` (to a file outside).

use std::path::{Path, PathBuf};

use agent_client::proto::*;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::Mock;

/// Stream type of every server-streaming RPC here.
pub type EventStream<T> = ReceiverStream<Result<T, Status>>;

/// Chunk size of downloads: small, so that a few MiB make many messages.
const DOWNLOAD_CHUNK: usize = 64 * 1024;

fn sha(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

fn event(e: exec_session_event::Event) -> Result<ExecSessionEvent, Status> {
    Ok(ExecSessionEvent { event: Some(e) })
}

fn finished(
    argv: &[String],
    status: ExecStatus,
    exit_code: i32,
    signal: i32,
) -> exec_session_event::Event {
    exec_session_event::Event::Result(ExecResult {
        exec_id: "ex-s1".into(),
        sandbox_id: "sb-1".into(),
        argv: argv.to_vec(),
        status: status as i32,
        exit_code,
        signal,
        ..Default::default()
    })
}

pub async fn exec_session(
    mock: &Mock,
    mut requests: Streaming<ExecSessionRequest>,
) -> Result<EventStream<ExecSessionEvent>, Status> {
    let first = requests
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("no start message"))?;
    let Some(exec_session_request::Item::Start(start)) = first.item else {
        return Err(Status::invalid_argument("the first message must be start"));
    };
    let exec = start.exec.unwrap_or_default();
    super::sandbox(&exec.sandbox_id)?;
    if exec.argv.is_empty() {
        return Err(Status::invalid_argument("argv: must not be empty"));
    }
    mock.log(format!(
        "start tty={} argv={:?} workdir={:?}",
        start.tty, exec.argv, exec.workdir
    ));
    let (tx, rx) = mpsc::channel(16);
    let mock = mock.clone();
    tokio::spawn(async move {
        let argv = exec.argv.clone();
        let _ = tx
            .send(event(exec_session_event::Event::Started(ExecStarted {
                exec_id: "ex-s1".into(),
            })))
            .await;
        if argv[0] == "missing" {
            let mut result = finished(&argv, ExecStatus::SpawnFailed, 127, 0);
            if let exec_session_event::Event::Result(r) = &mut result {
                r.error = "executable not found: missing".into();
            }
            let _ = tx.send(event(result)).await;
            return;
        }
        let tty = start.tty;
        if tty {
            let size = start.size.unwrap_or_default();
            let term = exec.env.get("TERM").cloned().unwrap_or_default();
            let banner = format!(
                "[tty {}x{} TERM={term} argv={:?}]\r\n",
                size.rows, size.cols, argv
            );
            let _ = tx
                .send(event(exec_session_event::Event::Stdout(
                    banner.into_bytes(),
                )))
                .await;
        }
        // What a real command would have been given as stdin up front.
        if !exec.stdin.is_empty() && argv[0] == "cat" {
            let _ = tx
                .send(event(exec_session_event::Event::Stdout(exec.stdin.clone())))
                .await;
        }
        let end = loop {
            let message = match requests.message().await {
                Ok(Some(message)) => message,
                // The client went away: the command ends with nobody to tell.
                Ok(None) | Err(_) => {
                    mock.log("session: client gone".into());
                    return;
                }
            };
            match message.item {
                Some(exec_session_request::Item::Stdin(data)) => {
                    mock.log(format!("stdin {:?}", String::from_utf8_lossy(&data)));
                    if tty {
                        if let Some(at) = data.iter().position(|b| *b == 3) {
                            let _ = tx
                                .send(event(exec_session_event::Event::Stdout(
                                    data[..at].to_vec(),
                                )))
                                .await;
                            break finished(&argv, ExecStatus::Signaled, 130, 2);
                        }
                        if data.contains(&4) {
                            break finished(&argv, ExecStatus::Exited, 0, 0);
                        }
                    }
                    if tty || argv[0] == "cat" {
                        let _ = tx
                            .send(event(exec_session_event::Event::Stdout(data)))
                            .await;
                    }
                }
                Some(exec_session_request::Item::CloseStdin(_)) => {
                    mock.log("close_stdin".into());
                    if tty || argv[0] == "cat" {
                        break finished(&argv, ExecStatus::Exited, 0, 0);
                    }
                }
                Some(exec_session_request::Item::Signal(n)) => {
                    mock.log(format!("signal {n}"));
                    break finished(&argv, ExecStatus::Signaled, 128 + n, n);
                }
                Some(exec_session_request::Item::Resize(size)) => {
                    mock.log(format!("resize {}x{}", size.rows, size.cols));
                    if tty {
                        let text = format!("[resize {}x{}]\r\n", size.rows, size.cols);
                        let _ = tx
                            .send(event(exec_session_event::Event::Stdout(text.into_bytes())))
                            .await;
                    }
                }
                Some(exec_session_request::Item::Start(_)) => {
                    let _ = tx
                        .send(Err(Status::invalid_argument("start sent twice")))
                        .await;
                    return;
                }
                None => {}
            }
        };
        let _ = tx.send(event(end)).await;
    });
    Ok(ReceiverStream::new(rx))
}

/// Reads an upload: the header, then every data piece; `None` for the digest when none came.
/// An error when the stream breaks (the client went away) or is out of order.
async fn read_upload(
    mock: &Mock,
    requests: &mut Streaming<UploadRequest>,
) -> Result<(UploadHeader, Vec<u8>, Option<String>), Status> {
    let header = match requests.message().await? {
        Some(UploadRequest {
            item: Some(upload_request::Item::Header(header)),
        }) => header,
        _ => return Err(Status::invalid_argument("the first message must be header")),
    };
    super::sandbox(&header.sandbox_id)?;
    let (mut data, mut digest) = (Vec::new(), None);
    loop {
        let message = match requests.message().await {
            Ok(Some(message)) => message,
            Ok(None) => return Ok((header, data, digest)),
            Err(status) => {
                mock.outcome(format!("broken {}", header.path));
                return Err(status);
            }
        };
        match message.item {
            Some(upload_request::Item::Data(piece)) => {
                if digest.is_some() {
                    return Err(Status::invalid_argument("data after sha256"));
                }
                {
                    let mut state = mock.state();
                    state.max_piece = state.max_piece.max(piece.len());
                    state.received += piece.len() as u64;
                }
                data.extend_from_slice(&piece);
            }
            Some(upload_request::Item::Sha256(hex)) => {
                if digest.is_some() {
                    mock.outcome(format!("refused {}: sha256 twice", header.path));
                    return Err(Status::invalid_argument("sha256 twice"));
                }
                digest = Some(hex);
            }
            _ => return Err(Status::invalid_argument("header twice")),
        }
    }
}

pub async fn upload_file(
    mock: &Mock,
    mut requests: Streaming<UploadRequest>,
) -> Result<UploadFileResponse, Status> {
    let (header, data, digest) = read_upload(mock, &mut requests).await?;
    let actual = sha(&data);
    if let Some(expected) = digest {
        if expected != actual {
            mock.outcome(format!("refused {}: sha256", header.path));
            return Err(Status::data_loss(format!(
                "{}: sha256 {actual} differs from the client's {expected}",
                header.path
            )));
        }
    }
    let bytes_written = data.len() as u64;
    mock.outcome(format!("ok {}", header.path));
    mock.state().files.insert(header.path, (data, header.mode));
    Ok(UploadFileResponse {
        bytes_written,
        sha256: actual,
    })
}

pub async fn download_file(
    mock: &Mock,
    request: DownloadRequest,
) -> Result<EventStream<DownloadChunk>, Status> {
    super::sandbox(&request.sandbox_id)?;
    let content = mock
        .state()
        .files
        .get(&request.path)
        .map(|(content, _)| content.clone())
        .ok_or_else(|| Status::not_found(format!("{} not found", request.path)))?;
    let mut size = content.len() as u64;
    let mut digest = sha(&content);
    match request.path.as_str() {
        "/corrupt" => digest = sha(b"something else"),
        "/short" => size += 10,
        _ => {}
    }
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let mut first = true;
        for piece in content.chunks(DOWNLOAD_CHUNK) {
            let chunk = DownloadChunk {
                data: piece.to_vec(),
                size: if first { size } else { 0 },
                sha256: String::new(),
            };
            first = false;
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
        let last = DownloadChunk {
            data: Vec::new(),
            size: if first { size } else { 0 },
            sha256: digest,
        };
        let _ = tx.send(Ok(last)).await;
    });
    Ok(ReceiverStream::new(rx))
}

/// Where an archive path of the sandbox lives in the stand-in's temp directory.
fn local(mock: &Mock, path: &str) -> PathBuf {
    mock.root().join(path.trim_start_matches('/'))
}

pub async fn upload_archive(
    mock: &Mock,
    mut requests: Streaming<UploadRequest>,
) -> Result<UploadArchiveResponse, Status> {
    let (header, data, digest) = read_upload(mock, &mut requests).await?;
    // As the daemon: the digest is required, and checked before anything is extracted.
    match digest {
        Some(expected) if expected == sha(&data) => {}
        Some(expected) => {
            return Err(Status::data_loss(format!(
                "{}: sha256 differs from the client's {expected}",
                header.path
            )))
        }
        None => {
            return Err(Status::aborted(
                "the stream ended without its sha256 message",
            ))
        }
    }
    let dir = local(mock, &header.path);
    let outcome = tokio::task::spawn_blocking(move || extract(&data, &dir))
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
    match outcome {
        Ok(response) => {
            mock.outcome(format!("ok {}", header.path));
            Ok(response)
        }
        Err(status) => {
            mock.outcome(format!("refused {}: {}", header.path, status.message()));
            Err(status)
        }
    }
}

/// What the daemon promises: regular files, directories, symlinks as they are, hard links;
/// modes and mtimes kept; anything leaving the directory or a device refused.
fn extract(data: &[u8], dir: &Path) -> Result<UploadArchiveResponse, Status> {
    std::fs::create_dir_all(dir).map_err(|e| Status::internal(e.to_string()))?;
    let mut archive = tar::Archive::new(data);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    let mut response = UploadArchiveResponse::default();
    let entries = archive
        .entries()
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| Status::invalid_argument(format!("bad archive: {e}")))?;
        let kind = entry.header().entry_type();
        let name = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if kind.is_character_special() || kind.is_block_special() {
            return Err(Status::invalid_argument(format!("{name}: a device node")));
        }
        let size = entry.size();
        let unpacked = entry
            .unpack_in(dir)
            .map_err(|e| Status::invalid_argument(format!("{name}: {e}")))?;
        if !unpacked {
            return Err(Status::invalid_argument(format!(
                "{name}: leaves the directory"
            )));
        }
        match kind {
            tar::EntryType::Directory => response.directories += 1,
            tar::EntryType::Symlink => response.symlinks += 1,
            _ => {
                response.files += 1;
                response.bytes += size;
            }
        }
    }
    Ok(response)
}

pub async fn download_archive(
    mock: &Mock,
    request: DownloadRequest,
) -> Result<EventStream<DownloadChunk>, Status> {
    super::sandbox(&request.sandbox_id)?;
    let data = match request.path.strip_prefix("/hostile/") {
        Some(kind) => hostile(kind, &mock.outside())?,
        None => {
            let dir = local(mock, &request.path);
            if !dir.is_dir() {
                return Err(Status::not_found(format!("{} not found", request.path)));
            }
            let mut builder = tar::Builder::new(Vec::new());
            builder.follow_symlinks(false);
            builder
                .append_dir_all("", &dir)
                .and_then(|()| builder.into_inner())
                .map_err(|e| Status::internal(e.to_string()))?
        }
    };
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        for piece in data.chunks(DOWNLOAD_CHUNK) {
            let chunk = DownloadChunk {
                data: piece.to_vec(),
                ..Default::default()
            };
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    Ok(ReceiverStream::new(rx))
}

/// One raw tar entry, its name and link written byte for byte (the `tar` crate's setters
/// would refuse them).
fn raw_entry(
    builder: &mut tar::Builder<Vec<u8>>,
    kind: tar::EntryType,
    name: &str,
    link: &str,
    data: &[u8],
) {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_mode(0o644);
    header.set_size(data.len() as u64);
    header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
    header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
    header.set_cksum();
    builder.append(&header, data).expect("append to a Vec");
}

/// A hostile archive of `kind`, aiming at `outside` (a directory of the test's, beside the
/// local extraction target). Every one starts with an innocent file.
fn hostile(kind: &str, outside: &Path) -> Result<Vec<u8>, Status> {
    use tar::EntryType::*;
    let outside = outside.display().to_string();
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, Regular, "fine.txt", "", b"fine");
    match kind {
        "abs" => raw_entry(&mut b, Regular, &format!("{outside}/victim"), "", b"owned"),
        "dotdot" => raw_entry(&mut b, Regular, "sub/../../outside/victim", "", b"owned"),
        "symlink" => {
            raw_entry(&mut b, Symlink, "esc", &outside, b"");
            raw_entry(&mut b, Regular, "esc/victim", "", b"owned");
        }
        "device" => raw_entry(&mut b, Char, "null", "", b""),
        "hardlink" => raw_entry(&mut b, Link, "h", &format!("{outside}/victim"), b""),
        other => return Err(Status::not_found(format!("no hostile archive {other}"))),
    }
    b.into_inner().map_err(|e| Status::internal(e.to_string()))
}
