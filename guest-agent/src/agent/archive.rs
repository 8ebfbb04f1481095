//! `UploadArchive` and `DownloadArchive` (protocol 4): directories in and out of the guest as tar
//! streams, made and taken apart by `sandbox_exec::archive` against the guest's root (`/`; a temp
//! dir in unit tests), so every entry stays below the named directory and nothing there is
//! followed.
//!
//! An upload is extracted on a thread of its own, fed by the request reader through a bounded
//! queue. Why not a thread per piece like other requests: the pieces are one byte stream and must
//! keep their order. Why not extract on the reader: extraction blocks on the disk, and the port
//! also carries every other request (a `Signal`, another exec's stdin). The reader only appends
//! to the queue (a mutex held for a push, never across I/O) and refuses past
//! [`MAX_ARCHIVE_QUEUE`] pieces or [`MAX_ARCHIVE_QUEUE_BYTES`] bytes; the extraction thread answers
//! each piece once it takes its bytes, which is the host's flow control (the same as an
//! interactive exec's stdin, see `input.rs`). The thread gives up on a host that sent nothing for
//! [`ARCHIVE_IDLE`], on `AbortWrite`, and when the host disconnects.
//!
//! A download runs `create` on its request's thread, which sends the stream as `ArchiveData`
//! frames through the shared connection as it is made. Their flow control is the exec output's:
//! a frame is written to the port, and the write blocks while the host does not read, so the walk
//! goes at the pace of the host's reader and holds one frame of memory. `AbortWrite` (or a
//! disconnect) is seen between two frames.
//!
//! At most [`MAX_ARCHIVE_TRANSFERS`] transfers exist at once, uploads and downloads together,
//! including uploads that failed with no piece left to tell it to (the error waits for the next
//! piece or the abort, for at most [`ARCHIVE_IDLE`]).

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use guest_agent::protocol::{
    ArchiveCreated, ArchiveExtracted, ErrorKind, Response, FILE_CHUNK, MAX_ARCHIVE_QUEUE, MAX_ARCHIVE_QUEUE_BYTES, MAX_ARCHIVE_TRANSFERS, MAX_TRANSFER_ID,
};
use sandbox_exec::archive::{ArchiveError, CreateLimits, ExtractLimits};

use super::console::log;
use super::input::Answer;
use super::RequestError;

/// An upload that received no piece for this long was abandoned by its host: the extraction stops
/// (what it wrote stays) and its slot is freed.
pub const ARCHIVE_IDLE: Duration = Duration::from_secs(600);
/// Payload of one `ArchiveData` frame. Below [`FILE_CHUNK`] (the protocol's bound) because the
/// host buffers a number of frames per request before its reader waits: smaller frames keep
/// that buffer small, and at this size the per-frame cost is still negligible.
const ARCHIVE_FRAME: usize = 256 << 10;
/// Stack of an extraction thread: the tar code keeps its buffers on the heap.
const EXTRACT_STACK: usize = 256 << 10;

/// An error as the host sees it, kept to be told later.
type Failure = (ErrorKind, String);

/// One transfer id's entry.
enum Slot {
    Upload(Arc<Upload>),
    /// Set to stop the download between two frames.
    Download(Arc<AtomicBool>),
    /// An upload whose extraction failed when no piece was waiting for an answer: the next piece
    /// of that id is answered with this, and the entry goes.
    Failed {
        failure: Failure,
        since: Instant,
    },
}

impl Slot {
    fn stop(&self) {
        match self {
            Slot::Upload(up) => up.abort(),
            Slot::Download(stop) => stop.store(true, Ordering::SeqCst),
            Slot::Failed { .. } => {}
        }
    }
}

/// One piece of an upload, as the reader queued it.
struct Piece {
    /// The request to answer.
    id: u64,
    bytes: Vec<u8>,
    last: bool,
}

struct UploadState {
    queue: VecDeque<Piece>,
    /// Payload bytes in `queue`.
    queued_bytes: usize,
    /// Stream bytes accepted so far: the next piece's offset.
    received: u64,
    /// The last piece was accepted: nothing more is.
    closed: bool,
    /// Stop now (`AbortWrite`, a disconnect, a newer transfer of the same id).
    aborted: bool,
}

/// The queue between the request reader and one extraction thread.
struct Upload {
    dest: String,
    state: Mutex<UploadState>,
    wake: Condvar,
}

impl Upload {
    /// Queues a piece (the reader's side). The caller answers a refusal.
    fn push(&self, id: u64, offset: u64, bytes: Vec<u8>, last: bool) -> Result<(), RequestError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.closed || st.aborted {
            return Err(RequestError::new(ErrorKind::BadRequest, "a piece after the last one of an archive upload"));
        }
        if offset != st.received {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("archive piece at offset {offset}, but {} bytes came before it", st.received)));
        }
        if st.queue.len() >= MAX_ARCHIVE_QUEUE || st.queued_bytes + bytes.len() > MAX_ARCHIVE_QUEUE_BYTES {
            return Err(RequestError::new(
                ErrorKind::BadRequest,
                format!("the archive upload queue is full ({} pieces, {} bytes): wait for the answers", st.queue.len(), st.queued_bytes),
            ));
        }
        st.received += bytes.len() as u64;
        st.queued_bytes += bytes.len();
        st.closed = last;
        st.queue.push_back(Piece { id, bytes, last });
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    fn abort(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).aborted = true;
        self.wake.notify_all();
    }
}

/// The archive transfers of one root directory.
#[derive(Clone)]
pub struct Archives {
    root: PathBuf,
    table: Arc<Mutex<HashMap<String, Slot>>>,
    /// [`ARCHIVE_IDLE`], shorter in tests.
    idle: Duration,
}

impl std::fmt::Debug for Archives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Archives").field("root", &self.root).finish_non_exhaustive()
    }
}

/// The protocol's answer to an archive error, with the message naming the entry; the same kinds
/// the other tiers give these errors (see the protocol's module documentation).
pub fn archive_error(e: &ArchiveError) -> RequestError {
    let kind = match e {
        ArchiveError::Unsafe { .. }
        | ArchiveError::Unsupported { .. }
        | ArchiveError::NotADirectory { .. }
        | ArchiveError::Malformed { .. }
        | ArchiveError::Limit { .. } => ErrorKind::InvalidPath,
        ArchiveError::NotFound { .. } => ErrorKind::NotFound,
        ArchiveError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => ErrorKind::DiskFull,
        ArchiveError::Io { .. } => ErrorKind::Internal,
    };
    RequestError::new(kind, e.to_string())
}

fn check_transfer(transfer: &str) -> Result<(), RequestError> {
    if transfer.is_empty() || transfer.len() > MAX_TRANSFER_ID {
        return Err(RequestError::new(ErrorKind::BadRequest, format!("transfer id of {} bytes (1..={MAX_TRANSFER_ID})", transfer.len())));
    }
    Ok(())
}

fn no_upload(transfer: &str) -> RequestError {
    RequestError::new(ErrorKind::BadRequest, format!("no archive upload {transfer:?} (it failed, expired or was aborted)"))
}

impl Archives {
    /// Archives below `root` (`/` in the guest).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self::with_idle(root, ARCHIVE_IDLE)
    }

    /// As [`Archives::new`], giving up on a silent upload after `idle`.
    pub fn with_idle(root: impl Into<PathBuf>, idle: Duration) -> Self {
        Archives { root: root.into(), table: Arc::default(), idle }
    }

    fn open_root(&self) -> Result<File, RequestError> {
        File::open(&self.root).map_err(|e| RequestError::new(ErrorKind::Internal, format!("opening root {}: {e}", self.root.display())))
    }

    /// Makes room for one more transfer in `table`: forgets failures nobody came for, refuses
    /// past the bound.
    fn reserve(&self, table: &mut HashMap<String, Slot>) -> Result<(), RequestError> {
        table.retain(|_, slot| !matches!(slot, Slot::Failed { since, .. } if since.elapsed() > self.idle));
        if table.len() >= MAX_ARCHIVE_TRANSFERS {
            return Err(RequestError::new(ErrorKind::Internal, format!("{MAX_ARCHIVE_TRANSFERS} archive transfers are already in progress")));
        }
        Ok(())
    }

    /// `UploadArchive`, on the request reader: queues the piece (request `id`) for the transfer's
    /// extraction thread, starting it at offset 0. Never blocks on I/O. The extraction thread
    /// answers the piece through `answer`; an error is for the caller to answer.
    #[allow(clippy::too_many_arguments)]
    pub fn upload(&self, id: u64, transfer: &str, dest: &str, offset: u64, last: bool, bytes: Vec<u8>, answer: &Answer) -> Result<(), RequestError> {
        check_transfer(transfer)?;
        if bytes.len() as u64 > FILE_CHUNK {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("an archive piece of {} bytes; at most {FILE_CHUNK}", bytes.len())));
        }
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if offset != 0 {
            let refused = match table.get(transfer) {
                Some(Slot::Upload(up)) if up.dest != dest => {
                    RequestError::new(ErrorKind::BadRequest, format!("archive upload {transfer:?} extracts into {}, not {dest}", up.dest))
                }
                Some(Slot::Upload(up)) => match up.push(id, offset, bytes, last) {
                    Ok(()) => return Ok(()),
                    Err(e) => e,
                },
                Some(Slot::Failed { .. }) => {
                    let Some(Slot::Failed { failure: (kind, message), .. }) = table.remove(transfer) else { return Err(no_upload(transfer)) };
                    return Err(RequestError::new(kind, message));
                }
                Some(Slot::Download(_)) | None => return Err(no_upload(transfer)),
            };
            // A host out of step with its own stream: this upload cannot go on.
            if let Some(slot) = table.remove(transfer) {
                slot.stop();
            }
            return Err(refused);
        }
        // A fresh start replaces an upload that went by that id (a host starting over), never
        // a download.
        if matches!(table.get(transfer), Some(Slot::Download(_))) {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("archive transfer {transfer:?} is a download in progress")));
        }
        if let Some(old) = table.remove(transfer) {
            old.stop();
        }
        self.reserve(&mut table)?;
        let state = UploadState { queue: VecDeque::new(), queued_bytes: 0, received: 0, closed: false, aborted: false };
        let up = Arc::new(Upload { dest: dest.to_string(), state: Mutex::new(state), wake: Condvar::new() });
        up.push(id, 0, bytes, last)?;
        table.insert(transfer.to_string(), Slot::Upload(up.clone()));
        drop(table);
        let (archives, name, thread_answer) = (self.clone(), transfer.to_string(), answer.clone());
        let spawned =
            std::thread::Builder::new().name(format!("untar-{transfer}")).stack_size(EXTRACT_STACK).spawn(move || archives.extract(&name, &up, &thread_answer));
        if let Err(e) = spawned {
            self.forget_upload(transfer, None);
            return Err(RequestError::new(ErrorKind::Internal, format!("cannot start a thread for the archive upload: {e}")));
        }
        Ok(())
    }

    /// Removes `transfer`'s entry if it is still `up` (`None`: whatever upload it is).
    fn forget_upload(&self, transfer: &str, up: Option<&Arc<Upload>>) {
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let ours = match (table.get(transfer), up) {
            (Some(Slot::Upload(found)), Some(up)) => Arc::ptr_eq(found, up),
            (Some(Slot::Upload(_)), None) => true,
            _ => false,
        };
        if ours {
            table.remove(transfer);
        }
    }

    /// The extraction thread of `transfer`: extracts what `up` is fed, then answers.
    fn extract(&self, transfer: &str, up: &Arc<Upload>, answer: &Answer) {
        let mut reader = PieceReader { up, answer, idle: self.idle, buf: Vec::new(), pos: 0, taken: 0, last_id: None, stopped: None };
        let result = self.open_root().and_then(|root| {
            let stats = sandbox_exec::archive::extract(root.as_fd(), &up.dest, &mut reader, &ExtractLimits::default());
            // The reader's own failure (an abort, a silent host) is the reason, whatever the tar
            // code made of the short read.
            if let Some((kind, message)) = reader.stopped.clone() {
                return Err(RequestError::new(kind, message));
            }
            let stats = stats.map_err(|e| archive_error(&e))?;
            // What follows the end-of-archive marker (tar pads to its record size) is read and
            // dropped: the stream ends with the last piece.
            if std::io::copy(&mut reader, &mut std::io::sink()).is_err() {
                let (kind, message) = reader.stopped.clone().unwrap_or((ErrorKind::Internal, "reading the archive stream".into()));
                return Err(RequestError::new(kind, message));
            }
            super::persist();
            Ok(ArchiveExtracted { files: stats.files, dirs: stats.dirs, symlinks: stats.symlinks, hardlinks: stats.hardlinks, bytes: stats.bytes })
        });
        let last_id = reader.last_id;
        // Out of the table first (the host may start the next transfer of that id as soon as it
        // has its answer), then the queue is closed: nothing more reaches it.
        let left: Vec<u64> = {
            let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
            let ours = matches!(table.get(transfer), Some(Slot::Upload(found)) if Arc::ptr_eq(found, up));
            if ours {
                table.remove(transfer);
            }
            let mut st = up.state.lock().unwrap_or_else(|p| p.into_inner());
            st.closed = true;
            st.queued_bytes = 0;
            let left: Vec<u64> = st.queue.drain(..).map(|p| p.id).collect();
            // An error no piece is waiting for is kept for the next one, unless the host gave up
            // on the transfer itself.
            if let Err(e) = &result {
                if ours && !st.aborted && last_id.is_none() && left.is_empty() {
                    table.insert(transfer.to_string(), Slot::Failed { failure: (e.kind, e.message.clone()), since: Instant::now() });
                }
            }
            left
        };
        match result {
            Ok(stats) => {
                if let Some(id) = last_id {
                    answer(id, &Response::Extracted(stats), &[]);
                }
                // None in practice: nothing is accepted after the last piece.
                let late = Response::Error { kind: ErrorKind::BadRequest, message: "a piece after the last one of an archive upload".into() };
                for id in left {
                    answer(id, &late, &[]);
                }
            }
            Err(e) => {
                log!("archive upload {transfer} into {}: {}", up.dest, e.message);
                let error = Response::Error { kind: e.kind, message: e.message };
                for id in last_id.into_iter().chain(left) {
                    answer(id, &error, &[]);
                }
            }
        }
    }

    /// `DownloadArchive`, on its request's thread: streams the tar of `path` through `send` as
    /// `ArchiveData` frames and returns what was archived. An error before any frame was sent
    /// means nothing was (a missing path is `NotFound`).
    pub fn download(&self, transfer: &str, path: &str, send: &dyn Fn(&Response, &[u8])) -> Result<ArchiveCreated, RequestError> {
        check_transfer(transfer)?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
            if table.contains_key(transfer) {
                return Err(RequestError::new(ErrorKind::BadRequest, format!("archive transfer {transfer:?} is already in progress")));
            }
            self.reserve(&mut table)?;
            table.insert(transfer.to_string(), Slot::Download(stop.clone()));
        }
        let _registered = Registered { archives: self, transfer, stop: &stop };
        let root = self.open_root()?;
        let mut out = FrameWriter { send, stop: &stop, buf: Vec::with_capacity(ARCHIVE_FRAME) };
        let made = sandbox_exec::archive::create(root.as_fd(), path, &mut out, &CreateLimits::default());
        if stop.load(Ordering::SeqCst) {
            return Err(RequestError::new(ErrorKind::BadRequest, format!("the archive download of {path} was aborted")));
        }
        let stats = made.map_err(|e| archive_error(&e))?;
        out.flush().map_err(|e| RequestError::new(ErrorKind::Internal, format!("sending the archive of {path}: {e}")))?;
        Ok(ArchiveCreated {
            files: stats.files,
            dirs: stats.dirs,
            symlinks: stats.symlinks,
            hardlinks: stats.hardlinks,
            bytes: stats.bytes,
            skipped: stats.skipped,
            changed: stats.changed,
        })
    }

    /// `AbortWrite`: stops the upload or download of `transfer` (or forgets its kept failure).
    /// Nothing if there is none.
    pub fn abort(&self, transfer: &str) {
        let slot = self.table.lock().unwrap_or_else(|p| p.into_inner()).remove(transfer);
        if let Some(slot) = slot {
            slot.stop();
        }
    }

    /// The host disconnected: its transfers are orphans (a new host does not know their ids).
    pub fn abort_all(&self) {
        let slots: Vec<Slot> = self.table.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, s)| s).collect();
        for slot in &slots {
            slot.stop();
        }
    }

    /// Transfers in the table (tests).
    #[cfg(test)]
    pub fn in_progress(&self) -> usize {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Takes a download out of the table however it ends (a panic included).
struct Registered<'a> {
    archives: &'a Archives,
    transfer: &'a str,
    stop: &'a Arc<AtomicBool>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut table = self.archives.table.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(table.get(self.transfer), Some(Slot::Download(s)) if Arc::ptr_eq(s, self.stop)) {
            table.remove(self.transfer);
        }
    }
}

/// The upload's byte stream, as the extraction reads it: pieces taken from the queue in order,
/// each answered as it is taken (but the last, which gets the extraction's outcome).
struct PieceReader<'a> {
    up: &'a Upload,
    answer: &'a Answer,
    idle: Duration,
    buf: Vec<u8>,
    pos: usize,
    /// Stream bytes taken so far.
    taken: u64,
    /// The last piece's request, once taken.
    last_id: Option<u64>,
    /// Why the stream stopped short, as the host should hear it.
    stopped: Option<Failure>,
}

impl PieceReader<'_> {
    /// The next piece, waiting up to the idle time for one.
    fn next_piece(&mut self) -> std::io::Result<Piece> {
        let deadline = Instant::now() + self.idle;
        let mut st = self.up.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.aborted {
                self.stopped = Some((ErrorKind::BadRequest, "the archive upload was aborted".into()));
                return Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the archive upload was aborted"));
            }
            if let Some(piece) = st.queue.pop_front() {
                st.queued_bytes -= piece.bytes.len();
                return Ok(piece);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!("no piece of the archive upload came for {} s", self.idle.as_secs());
                self.stopped = Some((ErrorKind::BadRequest, why.clone()));
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
            }
            st = self.up.wake.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Read for PieceReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos >= self.buf.len() {
            if self.last_id.is_some() || out.is_empty() {
                return Ok(0);
            }
            let piece = self.next_piece()?;
            self.taken += piece.bytes.len() as u64;
            if piece.last {
                self.last_id = Some(piece.id);
            } else {
                // Taken: the host may send the next piece while these bytes are extracted.
                (self.answer)(piece.id, &Response::Written { size: self.taken }, &[]);
            }
            self.buf = piece.bytes;
            self.pos = 0;
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The download's tar stream, sent as `ArchiveData` frames of [`ARCHIVE_FRAME`] bytes; stops
/// (a broken pipe for the tar code) once the transfer is aborted.
struct FrameWriter<'a> {
    send: &'a dyn Fn(&Response, &[u8]),
    stop: &'a AtomicBool,
    buf: Vec<u8>,
}

impl FrameWriter<'_> {
    fn send_frame(&mut self) -> std::io::Result<()> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the archive download was aborted"));
        }
        if !self.buf.is_empty() {
            (self.send)(&Response::ArchiveData, &self.buf);
            self.buf.clear();
        }
        Ok(())
    }
}

impl Write for FrameWriter<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() >= ARCHIVE_FRAME {
            self.send_frame()?;
        }
        let n = data.len().min(ARCHIVE_FRAME - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send_frame()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_errors_get_the_kinds_of_the_other_tiers() {
        let io = |errno: i32| ArchiveError::Io { path: "a/f".into(), source: std::io::Error::from_raw_os_error(errno) };
        let cases = [
            (ArchiveError::Unsafe { path: "../x".into(), reason: "`..` component".into() }, ErrorKind::InvalidPath),
            (ArchiveError::Unsupported { path: "dev".into(), kind: "character device".into() }, ErrorKind::InvalidPath),
            (ArchiveError::NotADirectory { path: "f/g".into(), component: "f".into() }, ErrorKind::InvalidPath),
            (ArchiveError::Malformed { path: "the first entry".into(), source: std::io::Error::other("bad checksum") }, ErrorKind::InvalidPath),
            (ArchiveError::Limit { path: "big".into(), what: "entries", limit: 3 }, ErrorKind::InvalidPath),
            (ArchiveError::NotFound { path: "/nope".into() }, ErrorKind::NotFound),
            (io(libc::ENOSPC), ErrorKind::DiskFull),
            (io(libc::EDQUOT), ErrorKind::DiskFull),
            (io(libc::EIO), ErrorKind::Internal),
        ];
        for (e, kind) in cases {
            let got = archive_error(&e);
            assert_eq!(got.kind, kind, "{e}");
            assert_eq!(got.message, e.to_string(), "the message is the archive's, naming the entry");
        }
    }

    #[test]
    fn the_upload_queue_is_bounded_and_in_step() {
        let state = UploadState { queue: VecDeque::new(), queued_bytes: 0, received: 0, closed: false, aborted: false };
        let up = Upload { dest: "/d".into(), state: Mutex::new(state), wake: Condvar::new() };
        let kind = |r: Result<(), RequestError>| r.expect_err("refused").kind;
        // Nobody takes the pieces: a host that does not wait for the answers fills the queue.
        let piece = FILE_CHUNK as usize / 2;
        let mut offset = 0u64;
        let refused = loop {
            match up.push(offset, offset, vec![0; piece], false) {
                Ok(()) => offset += piece as u64,
                Err(e) => break e,
            }
            assert!(offset as usize <= MAX_ARCHIVE_QUEUE_BYTES, "unbounded");
        };
        assert_eq!(refused.kind, ErrorKind::BadRequest, "{refused}");
        assert_eq!(offset as usize, MAX_ARCHIVE_QUEUE_BYTES);
        assert_eq!(kind(up.push(9, offset + 1, vec![], false)), ErrorKind::BadRequest, "out of step");
        up.state.lock().expect("lock").queue.clear();
        up.state.lock().expect("lock").queued_bytes = 0;
        for _ in 0..MAX_ARCHIVE_QUEUE {
            up.push(1, offset, vec![], false).expect("empty pieces count too");
        }
        assert_eq!(kind(up.push(1, offset, vec![], false)), ErrorKind::BadRequest, "{MAX_ARCHIVE_QUEUE} pieces at most");
        up.state.lock().expect("lock").queue.clear();
        up.push(2, offset, vec![1], true).expect("the last piece");
        assert_eq!(kind(up.push(3, offset + 1, vec![], false)), ErrorKind::BadRequest, "nothing after the last piece");
    }

    #[test]
    fn frames_are_bounded_and_stop_once_aborted() {
        let sent = std::cell::RefCell::new(Vec::<usize>::new());
        let send = |resp: &Response, bytes: &[u8]| {
            assert_eq!(resp, &Response::ArchiveData);
            sent.borrow_mut().push(bytes.len());
        };
        let stop = AtomicBool::new(false);
        let mut w = FrameWriter { send: &send, stop: &stop, buf: Vec::new() };
        w.write_all(&vec![1u8; ARCHIVE_FRAME * 2 + 10]).expect("write");
        w.flush().expect("flush");
        w.flush().expect("an empty flush sends nothing");
        assert_eq!(*sent.borrow(), [ARCHIVE_FRAME, ARCHIVE_FRAME, 10]);
        const { assert!(ARCHIVE_FRAME as u64 <= FILE_CHUNK) };
        stop.store(true, Ordering::SeqCst);
        w.write_all(&vec![2u8; ARCHIVE_FRAME + 1]).expect_err("aborted");
        assert_eq!(sent.borrow().len(), 3, "nothing more after the abort");
    }
}
