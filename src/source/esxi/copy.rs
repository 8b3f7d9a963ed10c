//! Resumable, checksummed copy of one disk extent from an ESXi host.
//!
//! The extent is split into fixed chunks read with `dd` over several SSH
//! channels at once (one ESXi stream is slow). Received bytes go through a
//! bounded queue to one writer thread (positional writes; all-zero blocks are
//! skipped, so a thin disk stays sparse locally), and a hasher thread hashes
//! the file in order as the contiguous prefix grows, so neither hashing nor
//! writing sits on the receive path. A sidecar file records finished chunks
//! and the source's identity (size and mtime): after an interruption only
//! missing chunks are read again, and only if the source is unchanged. The
//! source is only ever read. Where the host has `openssl` (or `sha256sum`),
//! its digest is compared with ours, so the checksum is end to end.

use super::ssh::{RemoteCommand, Session, SshError};
use crate::api::Reason;
use crate::machine::Failure;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

/// `dd` block size; chunk sizes are multiples of it.
pub(crate) const BLOCK: u64 = 1 << 20;
/// Bytes per chunk (the unit of resume and of one `dd` read): 16 MiB.
pub(crate) const DEFAULT_CHUNK_SIZE: u64 = 16 << 20;
/// Granularity of hole detection.
const ZERO_BLOCK: usize = 64 * 1024;
/// Bytes handed to the writer at a time.
const WRITE_BATCH: usize = 4 << 20;

/// How to copy.
#[derive(Clone, Debug)]
pub struct CopyPlan {
    /// Extent path on the host, e.g. `/vmfs/volumes/ds1/web/web-flat.vmdk`.
    pub source_path: String,
    /// Where the copy goes.
    pub local_path: PathBuf,
    /// Bytes per chunk (a multiple of `BLOCK`).
    pub chunk_size: u64,
    /// Parallel SSH channels.
    pub streams: usize,
    /// Ask the host for its own sha256 of the extent.
    pub remote_digest: bool,
    /// The migration's power-off epoch the copy is made in: written into
    /// its marker, and a partial copy of another epoch is never resumed.
    pub epoch: i32,
}

impl CopyPlan {
    pub fn new(source_path: impl Into<String>, local_path: impl Into<PathBuf>) -> CopyPlan {
        CopyPlan {
            source_path: source_path.into(),
            local_path: local_path.into(),
            chunk_size: 16 * BLOCK,
            streams: 4,
            remote_digest: true,
            epoch: 0,
        }
    }
}

/// The finished copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyResult {
    pub size: u64,
    pub sha256: String,
    /// The host computed the same digest itself.
    pub verified_remotely: bool,
    /// Bytes read from the host in this run (less than `size` after a resume).
    pub bytes_read: u64,
}

/// Copy errors.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    Ssh(#[from] SshError),
    #[error("the connection ended {got} bytes into a {want}-byte read, in chunk {chunk}")]
    ShortRead { chunk: u64, got: u64, want: u64 },
    #[error("the source changed during the copy ({before} → {after})")]
    SourceChanged { before: String, after: String },
    #[error("sha256 mismatch: the host computed {remote}, the copy is {local}")]
    ChecksumMismatch { remote: String, local: String },
    #[error("cannot read the source's size: {0}")]
    Stat(String),
    #[error("local disk: {0}")]
    Io(#[from] std::io::Error),
}

impl CopyError {
    /// The controller's view; `discard` says whether the partial copy must go.
    pub(crate) fn failure(&self) -> (Failure, bool) {
        let message = self.to_string();
        match self {
            CopyError::Ssh(e) => (e.failure(), false),
            CopyError::ShortRead { .. } => (Failure::retryable(Reason::ConnectionLost, message), false),
            CopyError::SourceChanged { .. } => (Failure::retryable(Reason::SourceChanged, message), true),
            CopyError::ChecksumMismatch { .. } => {
                (Failure::retryable(Reason::ChecksumMismatch, message), true)
            }
            CopyError::Stat(_) => (Failure::retryable(Reason::SourceUnreadable, message), false),
            CopyError::Io(_) => (Failure::local_write(Reason::LocalDiskError, message), false),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct Sidecar {
    source_path: String,
    identity: String,
    size: u64,
    chunk_size: u64,
    done: BTreeSet<u64>,
    #[serde(default)]
    epoch: i32,
}

fn sidecar_path(local: &Path) -> PathBuf {
    let mut name = local.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".progress.json");
    local.with_file_name(name)
}

/// `<copy>.lock`: locked (`flock`) by the one copy writing the file and its
/// sidecar, in whichever process: two controller replicas share the work
/// directory, and an aborted copy's writer may still be finishing. Never
/// removed by [`discard`] (a new file of that name would be a second lock).
fn lock_path(local: &Path) -> PathBuf {
    let mut name = local.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".lock");
    local.with_file_name(name)
}

/// How often a copy waiting for another copy of its file looks again.
const LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Takes the lock of the copy at `local`, waiting (without a thread) while
/// another copy of the same file holds it; `true` when it had to wait. The
/// lock goes with the last clone of the file, or with the process. On a file
/// system without locks the copy goes on unlocked, as before locks.
pub(crate) async fn lock_copy(local: &Path) -> Result<(File, bool), CopyError> {
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(lock_path(local))?;
    let mut waited = false;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok((file, waited)),
            Err(std::fs::TryLockError::WouldBlock) => {
                if !waited {
                    tracing::info!(path = %local.display(), "another copy of this file is running; waiting for it to end");
                }
                waited = true;
                tokio::time::sleep(LOCK_POLL).await;
            }
            Err(std::fs::TryLockError::Error(e)) => {
                tracing::warn!(path = %local.display(), error = %e, "cannot lock the copy; copying without the lock");
                return Ok((file, waited));
            }
        }
    }
}

/// Aborts the tasks it holds when dropped: a copy that is aborted
/// (discarded, its migration removed, the store dropped) stops its readers
/// and the host's hash with it; a dropped `JoinHandle` would only detach
/// them, reading on and writing the file and its sidecar.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

fn read_sidecar(local: &Path) -> Option<Sidecar> {
    let text = std::fs::read_to_string(sidecar_path(local)).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_sidecar(local: &Path, sidecar: &Sidecar) -> std::io::Result<()> {
    let path = sidecar_path(local);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(sidecar).map_err(std::io::Error::other)?)?;
    std::fs::rename(tmp, path)
}

/// Bytes already copied according to the sidecar (for progress after a restart).
pub(crate) fn bytes_present(local: &Path) -> u64 {
    read_sidecar(local).map(|s| (s.done.len() as u64 * s.chunk_size).min(s.size)).unwrap_or(0)
}

/// What a finished copy's marker says: `<size> <sha256> verified|local
/// epoch=<n> [source=<stat>]` (a marker written before epochs were recorded
/// is epoch 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CopyMarker {
    pub size: u64,
    pub sha256: String,
    /// The host computed the same digest itself.
    pub verified: bool,
    /// The power-off epoch the copy was made in.
    pub epoch: i32,
    /// The extent's [`stat_token`] the copy was read under (copies of the
    /// extent itself; a warm assembly has none).
    pub source: Option<String>,
}

impl CopyMarker {
    pub(crate) fn parse(text: &str) -> Option<CopyMarker> {
        let mut parts = text.split_whitespace();
        let size = parts.next()?.parse().ok()?;
        let sha256 = parts.next()?.to_owned();
        let verified = parts.next() == Some("verified");
        let epoch = match parts.next() {
            Some(token) => token.strip_prefix("epoch=")?.parse().ok()?,
            None => 0,
        };
        let source = match parts.next() {
            Some(token) => Some(token.strip_prefix("source=")?.to_owned()),
            None => None,
        };
        Some(CopyMarker { size, sha256, verified, epoch, source })
    }

    pub(crate) fn line(&self) -> String {
        let how = if self.verified { "verified" } else { "local" };
        let source = self.source.as_ref().map(|s| format!(" source={s}")).unwrap_or_default();
        format!("{} {} {how} epoch={}{source}\n", self.size, self.sha256, self.epoch)
    }
}

/// What the host's `stat -c '%s %Y'` printed of an extent (size and mtime),
/// as one token: `<size>:<mtime>`. A copy records it; the same extent
/// stated again later with another answer was written since.
pub(crate) fn stat_token(printed: &str) -> String {
    printed.split_whitespace().collect::<Vec<_>>().join(":")
}

/// A finished copy, as its marker records it.
pub(crate) fn is_complete(local: &Path) -> Option<CopyMarker> {
    let marker = CopyMarker::parse(&std::fs::read_to_string(local.with_extension("sha256")).ok()?)?;
    local.exists().then_some(marker)
}

/// Removes a copy and its bookkeeping. "Not found" is success.
pub fn discard(local: &Path) -> std::io::Result<()> {
    let patch = [crate::ports::workdir::patch_path(local), crate::ports::workdir::patch_info_path(local)];
    let derived = [local.with_extension("sha256")].into_iter().chain(patch);
    for path in [local.to_path_buf(), sidecar_path(local)].into_iter().chain(derived) {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `size mtime` of the source, as the host reports it.
pub(crate) async fn source_identity(session: &Session, path: &str) -> Result<(u64, String), CopyError> {
    let cmd = RemoteCommand::new("stat")?.arg("-c")?.arg("%s %Y")?.arg(path)?;
    let out = session.run(&cmd).await?;
    let text = out.stdout_text();
    let line = text.trim();
    let size = line.split_whitespace().next().and_then(|s| s.parse().ok());
    match (out.exit_status, size) {
        (Some(0), Some(size)) => Ok((size, line.to_owned())),
        // The session ended without stat's exit status: the connection's
        // failure, not the source's.
        (None, _) => Err(CopyError::Ssh(SshError::Protocol(format!(
            "the connection ended before stat of {path} reported its exit status"
        )))),
        _ => Err(CopyError::Stat(format!("{}: {}", path, out.text().trim()))),
    }
}

/// After a copy, how long the host's own hash may still take at least.
const REMOTE_HASH_MIN_GRACE: std::time::Duration = std::time::Duration::from_secs(60);
/// What a hash tool prints for one file, with room for a long path.
const REMOTE_HASH_MAX_OUTPUT: usize = 16 * 1024;

/// The host's own sha256 of `path`, if it has a tool for it: `openssl dgst`
/// first (it uses the CPU's SHA instructions: about 5× BusyBox's
/// `sha256sum` on the same core, and the host hashes the whole disk while it
/// sends it), `sha256sum` when openssl is missing or fails.
pub(crate) async fn remote_sha256(session: &Session, path: &str) -> Result<Option<String>, CopyError> {
    let quoted = super::ssh::quote(path)?;
    let script = format!(
        "if command -v openssl >/dev/null 2>&1 && h=$(openssl dgst -sha256 -r {quoted} 2>/dev/null); then echo \"$h\"; elif command -v sha256sum >/dev/null 2>&1; then sha256sum {quoted}; else echo NOHASHTOOL; fi"
    );
    let cmd = RemoteCommand::new("sh")?.arg("-c")?.arg(&script)?;
    // Hashing a large disk on the host takes a while: no command timeout here.
    let mut out = super::ssh::Output::default();
    let status = session
        .stream(
            &cmd,
            |c| {
                if out.stdout.len() + c.len() > REMOTE_HASH_MAX_OUTPUT {
                    return Err(SshError::OutputTooLarge {
                        what: "sha256 on the host".into(),
                        limit: REMOTE_HASH_MAX_OUTPUT,
                    });
                }
                out.stdout.extend_from_slice(c);
                Ok(())
            },
            &mut out.stderr,
        )
        .await?;
    let text = out.stdout_text();
    if status != Some(0) || text.contains("NOHASHTOOL") {
        return Ok(None);
    }
    let hex = text.split_whitespace().next().unwrap_or_default().to_ascii_lowercase();
    Ok((hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hex))
}

enum WriterMsg {
    Data { offset: u64, bytes: Vec<u8> },
    ChunkDone(u64),
}

/// Where readers put what they read: the writer's queue, and the buffers
/// it hands back.
#[derive(Clone)]
struct Sink {
    tx: tokio::sync::mpsc::Sender<WriterMsg>,
    buffers: Arc<Buffers>,
}

/// The batches' buffers, handed back by the writer once written: a copy
/// reuses a few buffers instead of asking the allocator for 4 MiB per batch
/// (which the kernel zeroes and maps again each time).
#[derive(Default)]
struct Buffers(std::sync::Mutex<Vec<Vec<u8>>>);

impl Buffers {
    /// Buffers kept: the writer's queue, one per stream filling, and slack.
    const KEPT: usize = 24;

    fn take(&self) -> Vec<u8> {
        let kept = self.0.lock().ok().and_then(|mut b| b.pop());
        kept.unwrap_or_else(|| Vec::with_capacity(WRITE_BATCH))
    }

    fn give(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        if let Ok(mut kept) = self.0.lock()
            && kept.len() < Self::KEPT
        {
            kept.push(buffer);
        }
    }
}

fn is_zero(buf: &[u8]) -> bool {
    buf.iter().all(|b| *b == 0)
}

/// Copies the extent; resumes from a previous run's finished chunks when the
/// source is unchanged. `progress` counts bytes present locally.
pub async fn copy_disk(
    session: Arc<Session>,
    plan: &CopyPlan,
    progress: Arc<AtomicU64>,
) -> Result<CopyResult, CopyError> {
    let chunk_size = (plan.chunk_size / BLOCK).max(1) * BLOCK;
    if let Some(parent) = plan.local_path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // One copy of a file at a time, whatever started it: held until this
    // returns and the writer thread (the last to touch the file) has ended.
    let (lock, waited) = lock_copy(&plan.local_path).await?;
    let lock = Arc::new(lock);
    if waited
        && let Some(done) = is_complete(&plan.local_path)
        && done.epoch == plan.epoch
    {
        // The copy waited for finished it: not read again.
        return Ok(CopyResult {
            size: done.size,
            sha256: done.sha256,
            verified_remotely: done.verified,
            bytes_read: 0,
        });
    }
    let (size, identity) = source_identity(&session, &plan.source_path).await?;
    let sidecar = resume_or_start(plan, size, &identity, chunk_size)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&plan.local_path)?;
    file.set_len(size)?;
    let file = Arc::new(file);
    let layout = Layout { chunk_size, size };
    let missing: Vec<u64> = (0..layout.chunks()).filter(|c| !sidecar.done.contains(c)).collect();
    progress.store((sidecar.done.len() as u64 * chunk_size).min(size), Ordering::Relaxed);
    write_sidecar(&plan.local_path, &sidecar)?;

    let (hash_tx, hasher) = spawn_hasher(file.clone(), &sidecar.done, layout);
    let buffers = Arc::new(Buffers::default());
    let (write_tx, writer) = spawn_writer(
        file,
        plan.local_path.clone(),
        sidecar,
        progress,
        hash_tx,
        lock.clone(),
        buffers.clone(),
    );

    let copy_started = std::time::Instant::now();
    let mut spawned = AbortOnDrop(Vec::new());
    let remote = plan.remote_digest.then(|| {
        let session = session.clone();
        let path = plan.source_path.clone();
        let task = tokio::spawn(async move { remote_sha256(&session, &path).await });
        spawned.0.push(task.abort_handle());
        task
    });
    let bytes_read = Arc::new(AtomicU64::new(0));
    let read = read_missing(
        &session,
        plan,
        &missing,
        layout,
        Sink { tx: write_tx, buffers },
        &bytes_read,
        &mut spawned,
    )
    .await;
    let written = writer.join().map_err(|_| std::io::Error::other("writer thread panicked"))?;
    let local_sha = hasher.join().map_err(|_| std::io::Error::other("hasher thread panicked"))?;
    if let Err(e) = read {
        if let Some(task) = remote {
            task.abort();
        }
        return Err(e);
    }
    written?;
    let local_sha = local_sha?;
    let (_, after) = source_identity(&session, &plan.source_path).await?;
    if after != identity {
        return Err(CopyError::SourceChanged { before: identity, after });
    }
    let remote_sha = match remote {
        Some(task) => host_digest(task, copy_started.elapsed(), &plan.source_path).await?,
        None => None,
    };
    if let Some(remote) = &remote_sha
        && *remote != local_sha
    {
        return Err(CopyError::ChecksumMismatch { remote: remote.clone(), local: local_sha });
    }
    let marker = CopyMarker {
        size,
        sha256: local_sha.clone(),
        verified: remote_sha.is_some(),
        epoch: plan.epoch,
        source: Some(stat_token(&identity)),
    };
    std::fs::write(plan.local_path.with_extension("sha256"), marker.line())?;
    Ok(CopyResult {
        size,
        sha256: local_sha,
        verified_remotely: remote_sha.is_some(),
        bytes_read: bytes_read.load(Ordering::Relaxed),
    })
}

/// How one extent is cut into chunks.
#[derive(Clone, Copy, Debug)]
struct Layout {
    chunk_size: u64,
    size: u64,
}

impl Layout {
    fn chunks(self) -> u64 {
        self.size.div_ceil(self.chunk_size)
    }
}

/// The previous run's sidecar when it describes this very source, chunking
/// and epoch; otherwise a fresh one, after discarding what is on disk (a copy
/// never appends to data it cannot vouch for).
fn resume_or_start(
    plan: &CopyPlan,
    size: u64,
    identity: &str,
    chunk_size: u64,
) -> Result<Sidecar, CopyError> {
    match read_sidecar(&plan.local_path) {
        Some(s)
            if s.identity == identity
                && s.size == size
                && s.chunk_size == chunk_size
                && s.epoch == plan.epoch
                && plan.local_path.exists() =>
        {
            Ok(s)
        }
        _ => {
            discard(&plan.local_path)?;
            Ok(Sidecar {
                source_path: plan.source_path.clone(),
                identity: identity.to_string(),
                size,
                chunk_size,
                done: BTreeSet::new(),
                epoch: plan.epoch,
            })
        }
    }
}

/// The hasher thread: follows the contiguous prefix of finished chunks
/// (those already `done` and those sent on the returned channel), reading
/// them back from the file. Ends with an empty digest if the channel closes
/// before the last chunk.
fn spawn_hasher(
    file: Arc<File>,
    done: &BTreeSet<u64>,
    layout: Layout,
) -> (mpsc::Sender<u64>, std::thread::JoinHandle<std::io::Result<String>>) {
    let (hash_tx, hash_rx) = mpsc::channel::<u64>();
    let mut ready = done.clone();
    let hasher = std::thread::spawn(move || -> std::io::Result<String> {
        let mut hasher = Sha256::new();
        let mut next = 0u64;
        let mut buf = vec![0u8; 4 << 20];
        loop {
            while ready.remove(&next) {
                let start = next * layout.chunk_size;
                let end = (start + layout.chunk_size).min(layout.size);
                let mut pos = start;
                while pos < end {
                    let n = ((end - pos) as usize).min(buf.len());
                    file.read_exact_at(&mut buf[..n], pos)?;
                    hasher.update(&buf[..n]);
                    pos += n as u64;
                }
                next += 1;
            }
            if next >= layout.chunks() {
                break;
            }
            match hash_rx.recv() {
                Ok(chunk) => {
                    ready.insert(chunk);
                }
                Err(_) => return Ok(String::new()),
            }
        }
        Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
    });
    (hash_tx, hasher)
}

/// The writer thread: positional writes, holes for zero blocks; each
/// finished chunk goes to the syncer. It holds the copy's lock until it (and
/// the syncer) end, even if the copy is cancelled.
fn spawn_writer(
    file: Arc<File>,
    local: PathBuf,
    sidecar: Sidecar,
    progress: Arc<AtomicU64>,
    hash_tx: mpsc::Sender<u64>,
    lock: Arc<File>,
    buffers: Arc<Buffers>,
) -> (tokio::sync::mpsc::Sender<WriterMsg>, std::thread::JoinHandle<std::io::Result<()>>) {
    let (write_tx, mut write_rx) = tokio::sync::mpsc::channel::<WriterMsg>(16);
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let _lock = lock;
        let (sync_tx, sync_rx) = mpsc::channel::<u64>();
        let syncer = spawn_syncer(file.clone(), local, sidecar, hash_tx, sync_rx);
        let written = (|| -> std::io::Result<()> {
            while let Some(msg) = write_rx.blocking_recv() {
                match msg {
                    WriterMsg::Data { offset, bytes } => {
                        for (i, block) in bytes.chunks(ZERO_BLOCK).enumerate() {
                            if !is_zero(block) {
                                file.write_all_at(block, offset + (i * ZERO_BLOCK) as u64)?;
                            }
                        }
                        progress.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        buffers.give(bytes);
                    }
                    WriterMsg::ChunkDone(chunk) => {
                        if sync_tx.send(chunk).is_err() {
                            break; // the syncer failed: its error is the copy's
                        }
                    }
                }
            }
            Ok(())
        })();
        drop(sync_tx);
        let synced = syncer.join().map_err(|_| std::io::Error::other("syncer thread panicked"))?;
        written.and(synced)
    });
    (write_tx, writer)
}

/// The syncer thread: makes finished chunks durable (`fdatasync`), then
/// records them in the sidecar and hands them to the hasher. It runs beside
/// the writer, so the disk's flush of one chunk overlaps the writing of the
/// next (flushing in the writer made the copy wait for the disk at every
/// chunk); chunks finished while it flushed are recorded together by the
/// next flush. A chunk is in the sidecar only after a flush that followed
/// its last write.
fn spawn_syncer(
    file: Arc<File>,
    local: PathBuf,
    mut sidecar: Sidecar,
    hash_tx: mpsc::Sender<u64>,
    finished: mpsc::Receiver<u64>,
) -> std::thread::JoinHandle<std::io::Result<()>> {
    std::thread::spawn(move || -> std::io::Result<()> {
        while let Ok(first) = finished.recv() {
            let mut chunks = vec![first];
            chunks.extend(finished.try_iter());
            file.sync_data()?;
            sidecar.done.extend(chunks.iter().copied());
            write_sidecar(&local, &sidecar)?;
            for chunk in chunks {
                let _ = hash_tx.send(chunk);
            }
        }
        Ok(())
    })
}

/// The readers: `plan.streams` channels pulling runs of consecutive missing
/// chunks from a shared queue; one `dd` per run, chunks recorded as the
/// stream crosses them. Returns the first reader's error once all have ended.
async fn read_missing(
    session: &Arc<Session>,
    plan: &CopyPlan,
    missing: &[u64],
    layout: Layout,
    sink: Sink,
    bytes_read: &Arc<AtomicU64>,
    spawned: &mut AbortOnDrop,
) -> Result<(), CopyError> {
    let streams = plan.streams.max(1);
    let queue = Arc::new(std::sync::Mutex::new(plan_runs(missing, streams).into_iter()));
    let mut readers = Vec::new();
    for _ in 0..streams {
        let session = session.clone();
        let queue = queue.clone();
        let sink = sink.clone();
        let path = plan.source_path.clone();
        let bytes_read = bytes_read.clone();
        let reader = tokio::spawn(async move {
            loop {
                let next = queue.lock().ok().and_then(|mut q| q.next());
                let Some((first, count)) = next else { return Ok::<(), CopyError>(()) };
                read_run(&session, &path, first, count, layout, &sink, &bytes_read).await?;
            }
        });
        spawned.0.push(reader.abort_handle());
        readers.push(reader);
    }
    drop(sink);
    let mut first_error = None;
    for reader in readers {
        let result = match reader.await {
            Ok(r) => r,
            Err(e) => Err(CopyError::Io(std::io::Error::other(e.to_string()))),
        };
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Waits for the host's own digest. The host reads its own disk faster than
/// it sends it: past the copy's own time again (at least a minute), a hash
/// still running is given up on (a stuck or hostile host), and the copy
/// stands on its local digest alone, as on a host without a hash tool.
async fn host_digest(
    task: tokio::task::JoinHandle<Result<Option<String>, CopyError>>,
    copy_took: std::time::Duration,
    path: &str,
) -> Result<Option<String>, CopyError> {
    let grace = copy_took.max(REMOTE_HASH_MIN_GRACE);
    let abort = task.abort_handle();
    match tokio::time::timeout(grace, task).await {
        Ok(joined) => joined.map_err(|e| std::io::Error::other(e.to_string()))?,
        Err(_elapsed) => {
            abort.abort();
            tracing::warn!(path = %path, secs = grace.as_secs(), "the host's own sha256 did not finish in time; the copy is verified locally only");
            Ok(None)
        }
    }
}

/// Groups missing chunks into runs of consecutive chunks `(first, count)`,
/// splitting the longest until there is work for every stream.
pub(crate) fn plan_runs(missing: &[u64], streams: usize) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &chunk in missing {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == chunk => *count += 1,
            _ => runs.push((chunk, 1)),
        }
    }
    while runs.len() < streams {
        let Some((i, &(first, count))) = runs.iter().enumerate().max_by_key(|(_, r)| r.1) else { break };
        if count < 2 {
            break;
        }
        let half = count / 2;
        runs[i] = (first, half);
        runs.insert(i + 1, (first + half, count - half));
    }
    runs
}

/// Reads chunks `first..first+count` with one `dd`, handing bytes to the
/// writer and marking each chunk done as the stream passes its end.
async fn read_run(
    session: &Session,
    path: &str,
    first: u64,
    count: u64,
    layout: Layout,
    sink: &Sink,
    bytes_read: &AtomicU64,
) -> Result<(), CopyError> {
    let tx = &sink.tx;
    let Layout { chunk_size, size } = layout;
    let blocks = chunk_size / BLOCK;
    let cmd = RemoteCommand::new("dd")?
        .arg(&format!("if={path}"))?
        .arg(&format!("bs={BLOCK}"))?
        .arg(&format!("skip={}", first * blocks))?
        .arg(&format!("count={}", count * blocks))?
        .raw("2>/dev/null");
    let stopped = || CopyError::Ssh(SshError::Protocol("the writer stopped".into()));
    let start = first * chunk_size;
    let end = ((first + count) * chunk_size).min(size);
    let want = end - start;
    let mut channel = session.exec_channel(&cmd).await?;
    let mut got = 0u64;
    let mut batch = sink.buffers.take();
    let mut status = None;
    while let Some(msg) = channel.wait().await {
        match msg {
            russh::ChannelMsg::Data { data } => {
                let mut piece = &data[..data.len().min((want - got) as usize)];
                while !piece.is_empty() {
                    let pos = start + got;
                    let chunk = pos / chunk_size;
                    let chunk_end = ((chunk + 1) * chunk_size).min(end);
                    let n = piece.len().min((chunk_end - pos) as usize);
                    batch.extend_from_slice(&piece[..n]);
                    piece = &piece[n..];
                    got += n as u64;
                    let crossed = start + got == chunk_end;
                    if batch.len() >= WRITE_BATCH || crossed {
                        let bytes = std::mem::replace(&mut batch, sink.buffers.take());
                        let offset = start + got - bytes.len() as u64;
                        // Awaiting here is the backpressure when the disk is slower than the network.
                        tx.send(WriterMsg::Data { offset, bytes }).await.map_err(|_| stopped())?;
                    }
                    if crossed {
                        tx.send(WriterMsg::ChunkDone(chunk)).await.map_err(|_| stopped())?;
                    }
                }
            }
            russh::ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
            russh::ChannelMsg::Close => break,
            _ => {}
        }
    }
    bytes_read.fetch_add(got, Ordering::Relaxed);
    if batch.is_empty() {
        sink.buffers.give(batch);
    } else {
        let offset = start + got - batch.len() as u64;
        tx.send(WriterMsg::Data { offset, bytes: batch }).await.map_err(|_| stopped())?;
    }
    if got < want || status != Some(0) {
        return Err(CopyError::ShortRead { chunk: (start + got) / chunk_size, got, want });
    }
    Ok(())
}

/// sha256 of a local file (used to verify finished copies).
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    crate::images::digest::file_sha256(path, None).map(|(_, sha)| sha)
}

#[cfg(test)]
mod tests {
    use super::{CopyMarker, lock_copy, plan_runs, stat_token};
    use std::time::Duration;

    #[test]
    fn a_marker_keeps_the_extents_stat_and_older_markers_still_read() {
        let marker = CopyMarker {
            size: 1 << 30,
            sha256: "ab".repeat(32),
            verified: true,
            epoch: 3,
            source: Some(stat_token("1073741824 1733480000\n")),
        };
        assert_eq!(marker.source.as_deref(), Some("1073741824:1733480000"));
        assert_eq!(CopyMarker::parse(&marker.line()), Some(marker.clone()));
        let older = format!("{} {} verified epoch=3\n", 1u64 << 30, "ab".repeat(32));
        assert_eq!(CopyMarker::parse(&older), Some(CopyMarker { source: None, ..marker }));
        assert_eq!(CopyMarker::parse(&format!("1 {} local epoch=1 junk", "ab".repeat(32))), None);
    }

    /// Two copies of one file (two processes on the shared work directory,
    /// or a new copy while an aborted one's writer finishes) never write it
    /// at once: the second waits until the first lets go.
    #[tokio::test]
    async fn a_second_copy_of_a_file_waits_for_the_first_to_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("disk-0.raw");
        let (first, waited) = lock_copy(&local).await.unwrap();
        assert!(!waited);
        let second = tokio::spawn({
            let local = local.clone();
            async move { lock_copy(&local).await.map(|(_, waited)| waited) }
        });
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(!second.is_finished(), "the second copy waits while the first holds the file");
        drop(first);
        let waited = tokio::time::timeout(Duration::from_secs(5), second).await.unwrap().unwrap().unwrap();
        assert!(waited, "and goes on once it is let go");
        super::discard(&local).unwrap();
        assert!(
            dir.path().join("disk-0.raw.lock").exists(),
            "a discard leaves the lock file to whoever holds it"
        );
    }

    #[test]
    fn runs_group_consecutive_chunks_and_split_for_every_stream() {
        assert_eq!(plan_runs(&[0, 1, 2, 3, 4, 5, 6, 7], 1), vec![(0, 8)]);
        assert_eq!(plan_runs(&[0, 1, 2, 3, 4, 5, 6, 7], 4), vec![(0, 2), (2, 2), (4, 2), (6, 2)]);
        assert_eq!(plan_runs(&[3, 4, 9], 1), vec![(3, 2), (9, 1)]);
        assert_eq!(plan_runs(&[5], 4), vec![(5, 1)]);
        assert!(plan_runs(&[], 4).is_empty());
    }
}
