//! The staging HTTP server CDI imports artifacts from.
//!
//! Written directly on `tokio::net::TcpListener` rather than on hyper or axum:
//! the surface is two methods on one URL shape plus `/healthz`, at most one
//! byte range, and one request per connection (`Connection: close`), so a few
//! hundred lines cover it without another dependency in the controller.
//!
//! # Paths
//!
//! Only `/artifacts/<uid>/disk-<n>.<raw|qcow2>` is served, from
//! `<root>/<uid>/disk-<n>.<raw|qcow2>`. `<uid>` is 1 to 64 of `[a-z0-9-]` and
//! `<n>` a decimal number without leading zeros, so an accepted path cannot
//! hold `.` segments, percent-escapes, backslashes or extra slashes, and no
//! decoding is ever done. The query string is dropped. Neither the uid
//! directory nor the file may be a symlink; the file must be a regular file.
//! Anything else is 404 (400 for a malformed request) and counted in
//! [`ServeStats::rejected_paths`].
//!
//! # What is served
//!
//! A file is served only while its `.sha256` marker exists with the file's
//! size and no `.corrupt` marker exists (see [`super::artifact`]).
//!
//! # Hold-back verification
//!
//! A whole-file GET streams the file in 1 MiB reads while hashing it and
//! always holds back the last read until end of file. Only when the hash
//! equals the marker is that last buffer sent. Otherwise the server writes
//! `<file>.corrupt`, withholds the buffer and closes the connection: the client
//! gets fewer bytes than `Content-Length`, so bytes that changed after staging
//! (bit rot, a stray write) are never delivered whole, and later requests for
//! the file get 404.

use super::artifact::{Marker, corrupt_path, hex, read_marker};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, SeekFrom};
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;
use tracing::{Instrument, debug, field, info_span, warn};

/// Read size for whole-file responses, and so the size of the held-back tail.
const CHUNK: usize = 1 << 20;
/// Largest request head (request line and headers) accepted.
const MAX_HEAD: usize = 16 * 1024;
/// Time a client has to send its whole request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// A client that accepts no bytes for this long is dropped.
const WRITE_STALL: Duration = Duration::from_secs(60);
/// How long to drain a client's unread input after our FIN (see `close`).
const LINGER: Duration = Duration::from_secs(2);
/// sha256 of zero bytes: an empty file can be checked without reading it.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// Counters for the staging server, shared with whoever started it.
#[derive(Default, Debug)]
pub struct ServeStats {
    /// Requests answered, including refused and malformed ones.
    pub requests: AtomicU64,
    /// Body bytes written to clients.
    pub bytes_served: Arc<AtomicU64>,
    /// Whole-file reads whose hash differed from the marker.
    pub corrupt_detected: AtomicU64,
    /// Malformed requests, paths outside the artifact shape, and symlinks or
    /// non-regular files where an artifact should be.
    pub rejected_paths: AtomicU64,
}

/// A running staging server. Dropping it stops the server and every open
/// connection.
pub struct StagingServer {
    addr: SocketAddr,
    stats: Arc<ServeStats>,
    task: JoinHandle<()>,
}

impl StagingServer {
    /// Serves files under `root` (layout: `root/<migration-uid>/disk-<n>.<raw|qcow2>`)
    /// at URL path `/artifacts/<migration-uid>/disk-<n>.<raw|qcow2>`.
    pub(crate) async fn start(listener: TcpListener, root: PathBuf) -> io::Result<StagingServer> {
        if !tokio::fs::metadata(&root).await?.is_dir() {
            let message = format!("staging root {} is not a directory", root.display());
            return Err(io::Error::new(io::ErrorKind::NotADirectory, message));
        }
        let addr = listener.local_addr()?;
        let stats = Arc::new(ServeStats::default());
        let task = tokio::spawn(accept_loop(listener, Arc::from(root), stats.clone()));
        Ok(StagingServer { addr, stats, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Arc<ServeStats> {
        self.stats.clone()
    }
}

impl Drop for StagingServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The URL path of an artifact: `/artifacts/<uid>/disk-<n>.<ext>`.
pub(crate) fn artifact_path(uid: &str, disk: usize, ext: &str) -> String {
    format!("/artifacts/{uid}/disk-{disk}.{ext}")
}

/// Parses and validates a request path (the query string is dropped) and
/// returns the file it names under `root`; `None` for anything else. Pure: the
/// file system checks happen in `open_artifact`.
fn resolve(root: &Path, url_path: &str) -> Option<PathBuf> {
    let path = strip_query(url_path);
    let (uid, file) = path.strip_prefix("/artifacts/")?.split_once('/')?;
    (is_uid(uid) && is_disk_file(file)).then(|| root.join(uid).join(file))
}

fn strip_query(target: &str) -> &str {
    target.split_once('?').map_or(target, |(path, _)| path)
}

fn is_uid(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// `disk-<n>.raw` or `disk-<n>.qcow2`, `<n>` without leading zeros so each
/// disk has exactly one URL.
fn is_disk_file(name: &str) -> bool {
    let Some((stem, ext)) = name.rsplit_once('.') else { return false };
    let Some(n) = stem.strip_prefix("disk-") else { return false };
    matches!(ext, "raw" | "qcow2")
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
        && (n == "0" || !n.starts_with('0'))
}

async fn accept_loop(listener: TcpListener, root: Arc<Path>, stats: Arc<ServeStats>) {
    // Connections belong to this task's JoinSet, so aborting the task (on
    // drop) aborts them as well.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let span = info_span!("staging", %peer, method = field::Empty, target = field::Empty);
                    connections.spawn(serve_connection(stream, root.clone(), stats.clone()).instrument(span));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "staging server: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(done) = connections.join_next() => {
                if let Err(e) = done && e.is_panic() {
                    warn!(error = %e, "staging server: connection task panicked");
                }
            }
        }
    }
}

enum HeadError {
    /// The client closed before finishing the head; `partial` when it sent anything.
    Closed {
        partial: bool,
    },
    TooLarge,
    Io(io::Error),
}

async fn serve_connection(mut stream: TcpStream, root: Arc<Path>, stats: Arc<ServeStats>) {
    let _ = stream.set_nodelay(true);
    let head = match timeout(HEAD_TIMEOUT, read_head(&mut stream)).await {
        Ok(result) => result,
        Err(_elapsed) => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            let _ = send_simple(&mut stream, 408, false, &[]).await;
            return close(stream).await;
        }
    };
    let outcome = match head {
        Ok(head) => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            respond(&mut stream, &head, &root, &stats).await
        }
        Err(HeadError::TooLarge) => {
            stats.requests.fetch_add(1, Ordering::Relaxed);
            stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
            send_simple(&mut stream, 431, false, &[]).await
        }
        Err(HeadError::Closed { partial: false }) => Ok(()),
        Err(HeadError::Closed { partial: true }) => {
            debug!("client closed in the middle of its request head");
            Ok(())
        }
        Err(HeadError::Io(e)) => Err(e),
    };
    if let Err(e) = outcome {
        debug!(error = %e, "connection ended early");
    }
    close(stream).await;
}

/// Reads up to the blank line that ends the request head (CRLF or bare LF).
/// Anything after it (a body, a pipelined request) is left unread.
async fn read_head(stream: &mut (impl AsyncRead + Unpin)) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.map_err(HeadError::Io)?;
        if n == 0 {
            return Err(HeadError::Closed { partial: !head.is_empty() });
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head_end(&head) {
            if end > MAX_HEAD {
                return Err(HeadError::TooLarge);
            }
            head.truncate(end);
            return Ok(head);
        }
        if head.len() >= MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
    }
}

fn head_end(buf: &[u8]) -> Option<usize> {
    (0..buf.len()).find_map(|i| match &buf[i..] {
        [b'\n', b'\n', ..] => Some(i + 2),
        [b'\n', b'\r', b'\n', ..] => Some(i + 3),
        _ => None,
    })
}

struct Request<'a> {
    method: &'a str,
    target: &'a str,
    /// Every `Range` header value; only a single one is honoured.
    ranges: Vec<&'a str>,
    if_range: bool,
}

/// `None` for a malformed head: bad request line, unknown HTTP version,
/// header line without a name.
fn parse_request(head: &[u8]) -> Option<Request<'_>> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let mut parts = lines.next()?.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let well_formed = parts.next().is_none()
        && !method.is_empty()
        && method.bytes().all(|b| b.is_ascii_uppercase())
        && !target.is_empty()
        && matches!(version, "HTTP/1.0" | "HTTP/1.1");
    if !well_formed {
        return None;
    }
    let mut request = Request { method, target, ranges: Vec::new(), if_range: false };
    for line in lines.take_while(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':')?;
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return None;
        }
        if name.eq_ignore_ascii_case("range") {
            request.ranges.push(value.trim());
        } else if name.eq_ignore_ascii_case("if-range") {
            request.if_range = true;
        }
    }
    Some(request)
}

async fn respond(stream: &mut TcpStream, head: &[u8], root: &Path, stats: &ServeStats) -> io::Result<()> {
    let Some(request) = parse_request(head) else {
        stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
        debug!(status = 400, "malformed request head");
        return send_simple(stream, 400, false, &[]).await;
    };
    let span = tracing::Span::current();
    span.record("method", request.method);
    span.record("target", request.target);

    let is_head = request.method == "HEAD";
    if request.method != "GET" && !is_head {
        debug!(status = 405, "method not allowed");
        return send_simple(stream, 405, false, &[("Allow", "GET, HEAD")]).await;
    }
    if strip_query(request.target) == "/healthz" {
        let head = response_head(200, &[("Content-Type", "text/plain"), ("Content-Length", "2")]);
        write_head(stream, &head).await?;
        return if is_head { Ok(()) } else { write_body(stream, b"ok", stats).await };
    }
    let Some(file) = resolve(root, request.target) else {
        stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
        debug!(status = 404, "path is not an artifact path");
        return send_simple(stream, 404, is_head, &[]).await;
    };
    let opened = {
        let file = file.clone();
        tokio::task::spawn_blocking(move || open_artifact(&file)).await
    };
    let artifact = match opened.unwrap_or_else(|e| Err(Refusal::Io(io::Error::other(e)))) {
        Ok(artifact) => artifact,
        Err(Refusal::NotFound) => {
            debug!(status = 404, "no such artifact");
            return send_simple(stream, 404, is_head, &[]).await;
        }
        Err(Refusal::NotRegular) => {
            stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
            debug!(status = 404, file = %file.display(), "refused: symlink or not a regular file");
            return send_simple(stream, 404, is_head, &[]).await;
        }
        Err(Refusal::Unverified(why)) => {
            debug!(status = 404, file = %file.display(), why, "refused: not a verified artifact");
            return send_simple(stream, 404, is_head, &[]).await;
        }
        Err(Refusal::Io(e)) => {
            warn!(file = %file.display(), error = %e, "staging server: cannot open artifact");
            return send_simple(stream, 500, is_head, &[]).await;
        }
    };

    let size = artifact.marker.size;
    let checksum = artifact.marker.sha256.clone();
    let digest = format!("sha-256={}", base64(&unhex(&checksum)));
    let representation = [
        ("Content-Type", "application/octet-stream"),
        ("Accept-Ranges", "bytes"),
        ("X-Checksum-Sha256", checksum.as_str()),
        ("Digest", digest.as_str()),
    ];
    // Range is defined for GET only (RFC 9110 §14.2). If-Range is not
    // honoured: there are no validators to match, so the whole file is sent.
    let range = match request.ranges.as_slice() {
        [one] if !is_head && !request.if_range => plan_range(one, size),
        _ => RangePlan::Whole,
    };
    match range {
        RangePlan::Whole => {
            let length = size.to_string();
            let head =
                response_head(200, &[&representation[..], &[("Content-Length", length.as_str())]].concat());
            write_head(stream, &head).await?;
            debug!(status = 200, bytes = size, "serving whole artifact");
            if is_head { Ok(()) } else { send_verified(stream, artifact, stats).await }
        }
        RangePlan::Partial { first, last } => {
            let length = (last - first + 1).to_string();
            let content_range = format!("bytes {first}-{last}/{size}");
            let extra = [("Content-Length", length.as_str()), ("Content-Range", content_range.as_str())];
            let head = response_head(206, &[&representation[..], &extra].concat());
            write_head(stream, &head).await?;
            debug!(status = 206, first, last, "serving artifact range");
            send_range(stream, artifact.file, first, last - first + 1, stats).await
        }
        RangePlan::Unsatisfiable => {
            debug!(status = 416, "range not satisfiable");
            let content_range = format!("bytes */{size}");
            send_simple(stream, 416, false, &[("Content-Range", content_range.as_str())]).await
        }
    }
}

struct Artifact {
    path: PathBuf,
    file: fs::File,
    marker: Marker,
}

enum Refusal {
    NotFound,
    /// A symlink, directory or other non-regular file where an artifact should be.
    NotRegular,
    /// Present but not (or no longer) known to be complete and intact.
    Unverified(&'static str),
    Io(io::Error),
}

impl From<io::Error> for Refusal {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::NotADirectory => Refusal::NotFound,
            _ => Refusal::Io(e),
        }
    }
}

/// Opens an artifact that `resolve` named, refusing symlinks, files without a
/// matching marker and files marked corrupt. Blocking: run off the runtime.
fn open_artifact(path: &Path) -> Result<Artifact, Refusal> {
    if let Some(dir) = path.parent()
        && !fs::symlink_metadata(dir)?.is_dir()
    {
        return Err(Refusal::NotRegular);
    }
    let linked = fs::symlink_metadata(path)?;
    if !linked.file_type().is_file() {
        return Err(Refusal::NotRegular);
    }
    let file = fs::File::open(path)?;
    let opened = file.metadata()?;
    // The name could have been swapped for a symlink between the check and the open.
    if (opened.dev(), opened.ino()) != (linked.dev(), linked.ino()) {
        return Err(Refusal::NotRegular);
    }
    let marker = read_marker(path).ok_or(Refusal::Unverified("no valid .sha256 marker"))?;
    if marker.size != opened.len() {
        return Err(Refusal::Unverified("marker size differs from the file length"));
    }
    // Nothing can be held back from an empty body, so check it here.
    if marker.size == 0 && marker.sha256 != EMPTY_SHA256 {
        return Err(Refusal::Unverified("marker checksum is not that of an empty file"));
    }
    match fs::symlink_metadata(corrupt_path(path)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Ok(_) => return Err(Refusal::Unverified("marked corrupt")),
        Err(e) => return Err(Refusal::Io(e)),
    }
    Ok(Artifact { path: path.to_path_buf(), file, marker })
}

/// Streams the whole file, hashing as it goes and holding back the last read
/// until the hash at end of file matches the marker (see the module docs).
async fn send_verified(stream: &mut TcpStream, artifact: Artifact, stats: &ServeStats) -> io::Result<()> {
    let Artifact { path, file, marker } = artifact;
    // Never read past the size announced in Content-Length, even if the file grew.
    let mut file = tokio::fs::File::from_std(file).take(marker.size);
    let mut hasher = Sha256::new();
    let (mut current, mut held) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    let mut held_len = 0;
    loop {
        let n = read_chunk(&mut file, &mut current).await?;
        if n == 0 {
            break;
        }
        hasher.update(&current[..n]);
        write_body(stream, &held[..held_len], stats).await?;
        std::mem::swap(&mut current, &mut held);
        held_len = n;
    }
    let actual = hex(&hasher.finalize());
    if actual == marker.sha256 {
        return write_body(stream, &held[..held_len], stats).await;
    }
    stats.corrupt_detected.fetch_add(1, Ordering::Relaxed);
    warn!(
        file = %path.display(),
        expected = %marker.sha256,
        got = %actual,
        "staged artifact differs from its checksum: last chunk withheld, marked corrupt"
    );
    let note = format!("expected {} got {actual}\n", marker.sha256);
    if let Err(e) = tokio::fs::write(corrupt_path(&path), note).await {
        warn!(file = %path.display(), error = %e, "cannot write the .corrupt marker");
    }
    // Returning closes the connection short of Content-Length.
    Ok(())
}

/// Sends `length` bytes from `first`. Ranges are not hash-verified: that
/// would mean reading the whole file for every range; a client that needs
/// integrity fetches the whole file or checks `X-Checksum-Sha256` itself.
async fn send_range(
    stream: &mut TcpStream,
    file: fs::File,
    first: u64,
    length: u64,
    stats: &ServeStats,
) -> io::Result<()> {
    let mut file = tokio::fs::File::from_std(file);
    file.seek(SeekFrom::Start(first)).await?;
    let mut file = file.take(length);
    let mut buf = vec![0u8; CHUNK.min(usize::try_from(length).unwrap_or(CHUNK))];
    loop {
        let n = file.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        write_body(stream, &buf[..n], stats).await?;
    }
}

/// Fills `buf` unless end of file comes first; returns the bytes read.
async fn read_chunk(reader: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

#[derive(Debug, PartialEq, Eq)]
enum RangePlan {
    Whole,
    Partial { first: u64, last: u64 },
    Unsatisfiable,
}

/// Interprets one `Range` value against a file of `size` bytes (RFC 9110
/// §14). Values that do not parse, other units and multiple ranges get the
/// whole file, which the RFC allows; a range that parses but is backwards or
/// outside the file is unsatisfiable.
fn plan_range(value: &str, size: u64) -> RangePlan {
    let Some((unit, set)) = value.split_once('=') else { return RangePlan::Whole };
    if !unit.trim().eq_ignore_ascii_case("bytes") || set.contains(',') {
        return RangePlan::Whole;
    }
    let Some((first, last)) = set.trim().split_once('-') else { return RangePlan::Whole };
    let (first, last) = (first.trim(), last.trim());
    match (number(first), number(last)) {
        (None, Some(suffix)) if first.is_empty() => {
            if suffix == 0 || size == 0 {
                RangePlan::Unsatisfiable
            } else {
                RangePlan::Partial { first: size.saturating_sub(suffix), last: size - 1 }
            }
        }
        (Some(first), last_pos) if last_pos.is_some() || last.is_empty() => {
            let last_pos = last_pos.unwrap_or(u64::MAX);
            if first >= size || last_pos < first {
                RangePlan::Unsatisfiable
            } else {
                RangePlan::Partial { first, last: last_pos.min(size - 1) }
            }
        }
        _ => RangePlan::Whole,
    }
}

/// Decimal digits only; saturates at `u64::MAX` rather than failing on huge values.
fn number(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse().unwrap_or(u64::MAX))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        416 => "Range Not Satisfiable",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    }
}

fn response_head(status: u16, headers: &[(&str, &str)]) -> String {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    head
}

/// An error or short answer: the reason phrase as a plain-text body.
async fn send_simple(
    stream: &mut TcpStream,
    status: u16,
    is_head: bool,
    extra: &[(&str, &str)],
) -> io::Result<()> {
    let body = format!("{}\n", reason(status));
    let length = body.len().to_string();
    let basic = [("Content-Type", "text/plain"), ("Content-Length", length.as_str())];
    write_head(stream, &response_head(status, &[&basic[..], extra].concat())).await?;
    if is_head { Ok(()) } else { write_all(stream, body.as_bytes(), None).await }
}

async fn write_head(stream: &mut TcpStream, head: &str) -> io::Result<()> {
    write_all(stream, head.as_bytes(), None).await
}

async fn write_body(stream: &mut TcpStream, bytes: &[u8], stats: &ServeStats) -> io::Result<()> {
    write_all(stream, bytes, Some(&stats.bytes_served)).await
}

/// `write_all` that gives up on a client accepting nothing for `WRITE_STALL`
/// and counts what actually went out.
async fn write_all(stream: &mut TcpStream, mut bytes: &[u8], counter: Option<&AtomicU64>) -> io::Result<()> {
    while !bytes.is_empty() {
        let n = timeout(WRITE_STALL, stream.write(bytes))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "client stopped reading"))??;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if let Some(counter) = counter {
            counter.fetch_add(n as u64, Ordering::Relaxed);
        }
        bytes = &bytes[n..];
    }
    Ok(())
}

/// Sends FIN, then drains what the client still sends for a moment: closing
/// with unread input makes the kernel send RST, which can destroy a response
/// the client has not read yet (a 431, a 405 to a request with a body).
async fn close(mut stream: TcpStream) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async {
        while let Ok(n) = stream.read(&mut sink).await
            && n > 0
        {}
    };
    let _ = timeout(LINGER, drain).await;
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Bytes of a lowercase hex string (a marker's checksum, already validated).
fn unhex(hex: &str) -> Vec<u8> {
    hex.as_bytes()
        .chunks(2)
        .filter_map(|pair| std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::artifact::{is_sha256_hex, marker_path, sha256_file, write_marker};

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
        }

        fn content_length(&self) -> usize {
            self.header("Content-Length").expect("Content-Length").parse().unwrap()
        }
    }

    /// Sends `raw` as is, reads to EOF, splits head and body.
    async fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(raw).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let end = response.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head") + 4;
        let head = std::str::from_utf8(&response[..end]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
        let headers =
            lines.filter_map(|l| l.split_once(": ")).map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
        Reply { status, headers, body: response[end..].to_vec() }
    }

    async fn request(addr: SocketAddr, method: &str, target: &str, extra_headers: &str) -> Reply {
        let raw = format!("{method} {target} HTTP/1.1\r\nHost: staging\r\n{extra_headers}\r\n");
        exchange(addr, raw.as_bytes()).await
    }

    async fn get(addr: SocketAddr, target: &str) -> Reply {
        request(addr, "GET", target, "").await
    }

    async fn start(root: &Path) -> StagingServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        StagingServer::start(listener, root.to_path_buf()).await.unwrap()
    }

    /// Bytes that differ from position to position, so a wrong offset shows.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8).collect()
    }

    /// Writes `dir/name` with its `.sha256` marker, as the converter does.
    fn stage(dir: &Path, name: &str, bytes: &[u8]) -> (PathBuf, String) {
        fs::create_dir_all(dir).unwrap();
        let file = dir.join(name);
        fs::write(&file, bytes).unwrap();
        let (size, sha256) = sha256_file(&file, None).unwrap();
        write_marker(&file, &Marker { size, sha256: sha256.clone() }).unwrap();
        (file, sha256)
    }

    const UID: &str = "0b5e2c1a-7f3d-4e2a-9c1b-5d6e7f8a9b0c";

    #[tokio::test]
    async fn whole_file_is_served_with_length_and_checksum_headers() {
        let root = tempfile::tempdir().unwrap();
        // Several chunks and a short tail, so the hold-back path is exercised.
        let bytes = pattern(2 * CHUNK + CHUNK / 2 + 7);
        let (_, sha256) = stage(&root.path().join(UID), "disk-0.raw", &bytes);
        let server = start(root.path()).await;

        let reply = get(server.local_addr(), &format!("{}?ignored=1", artifact_path(UID, 0, "raw"))).await;

        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_length(), bytes.len());
        assert!(reply.body == bytes, "body differs from the staged file");
        assert_eq!(reply.header("Content-Type"), Some("application/octet-stream"));
        assert_eq!(reply.header("Accept-Ranges"), Some("bytes"));
        assert_eq!(reply.header("X-Checksum-Sha256"), Some(sha256.as_str()));
        assert!(is_sha256_hex(&sha256));
        assert_eq!(reply.header("Digest"), Some(format!("sha-256={}", base64(&unhex(&sha256))).as_str()));
        let stats = server.stats();
        assert_eq!(stats.requests.load(Ordering::Relaxed), 1);
        assert_eq!(stats.bytes_served.load(Ordering::Relaxed), bytes.len() as u64);
        assert_eq!(stats.corrupt_detected.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn qcow2_artifacts_and_the_health_check_are_served() {
        let root = tempfile::tempdir().unwrap();
        let bytes = pattern(1000);
        stage(&root.path().join("m-1"), "disk-12.qcow2", &bytes);
        let server = start(root.path()).await;

        let reply = get(server.local_addr(), &artifact_path("m-1", 12, "qcow2")).await;
        assert_eq!((reply.status, reply.body == bytes), (200, true));

        let health = get(server.local_addr(), "/healthz").await;
        assert_eq!((health.status, health.body.as_slice()), (200, &b"ok"[..]));
    }

    #[tokio::test]
    async fn range_requests_return_exactly_the_requested_bytes() {
        let root = tempfile::tempdir().unwrap();
        let bytes = pattern(CHUNK + 4321);
        let size = bytes.len();
        stage(&root.path().join(UID), "disk-1.raw", &bytes);
        let server = start(root.path()).await;
        let path = artifact_path(UID, 1, "raw");

        let cases = [
            ("bytes=0-0", 0, 0),
            ("bytes=10-19", 10, 19),
            ("bytes=1000-", 1000, size - 1),
            ("bytes=-500", size - 500, size - 1),
            ("bytes=-99999999", 0, size - 1),
            ("bytes=5-99999999", 5, size - 1),
            (&format!("bytes={}-{}", CHUNK - 3, CHUNK + 3), CHUNK - 3, CHUNK + 3),
        ];
        for (range, first, last) in cases {
            let reply = request(server.local_addr(), "GET", &path, &format!("Range: {range}\r\n")).await;
            assert_eq!(reply.status, 206, "{range}");
            assert_eq!(reply.header("Content-Range"), Some(format!("bytes {first}-{last}/{size}").as_str()));
            assert_eq!(reply.content_length(), last - first + 1, "{range}");
            assert!(reply.body == bytes[first..=last], "{range}: wrong bytes");
        }

        // Several ranges get the whole file, as RFC 9110 allows.
        let reply = request(server.local_addr(), "GET", &path, "Range: bytes=0-1,5-6\r\n").await;
        assert_eq!((reply.status, reply.body == bytes), (200, true));
    }

    #[tokio::test]
    async fn unsatisfiable_range_is_416() {
        let root = tempfile::tempdir().unwrap();
        let bytes = pattern(100);
        stage(&root.path().join(UID), "disk-0.raw", &bytes);
        let server = start(root.path()).await;
        let path = artifact_path(UID, 0, "raw");

        for range in ["bytes=100-", "bytes=100-200", "bytes=-0", "bytes=50-10"] {
            let reply = request(server.local_addr(), "GET", &path, &format!("Range: {range}\r\n")).await;
            assert_eq!(reply.status, 416, "{range}");
            assert_eq!(reply.header("Content-Range"), Some("bytes */100"), "{range}");
        }
    }

    #[test]
    fn range_values_are_interpreted_as_rfc_9110_says() {
        assert_eq!(plan_range("bytes=0-9", 100), RangePlan::Partial { first: 0, last: 9 });
        assert_eq!(plan_range("BYTES=90-", 100), RangePlan::Partial { first: 90, last: 99 });
        assert_eq!(plan_range("bytes=-10", 100), RangePlan::Partial { first: 90, last: 99 });
        assert_eq!(plan_range("bytes=-18446744073709551616", 5), RangePlan::Partial { first: 0, last: 4 });
        assert_eq!(plan_range("bytes=0-", 0), RangePlan::Unsatisfiable);
        assert_eq!(plan_range("bytes=-1", 0), RangePlan::Unsatisfiable);
        // Unparseable values and other units are ignored.
        for value in ["bytes=a-b", "bytes=-", "bytes=1", "items=0-1", "bytes", "bytes=1-2-3", "bytes=+1-2"] {
            assert_eq!(plan_range(value, 100), RangePlan::Whole, "{value}");
        }
    }

    #[test]
    fn only_canonical_artifact_paths_resolve() {
        let root = Path::new("/srv/staging");
        assert_eq!(resolve(root, "/artifacts/abc-1/disk-0.raw"), Some(root.join("abc-1/disk-0.raw")));
        assert_eq!(resolve(root, "/artifacts/abc/disk-10.qcow2?x=/.."), Some(root.join("abc/disk-10.qcow2")));
        assert_eq!(
            resolve(root, &artifact_path(&"a".repeat(64), 3, "raw")),
            Some(root.join("a".repeat(64)).join("disk-3.raw"))
        );
        for bad in [
            "/artifacts/../x",
            "/artifacts/abc/../disk-0.raw",
            "/artifacts/abc/disk-0.raw/",
            "/artifacts/abc/disk-00.raw",
            "/artifacts/abc/disk-01.raw",
            "/artifacts/abc/disk-.raw",
            "/artifacts/abc/disk-0.raw.sha256",
            "/artifacts/abc/disk-0.raw.corrupt",
            "/artifacts/abc/disk-0",
            "/artifacts/abc/disk-0.RAW",
            "/artifacts//disk-0.raw",
            "/artifacts/disk-0.raw",
            "/artifacts/a.b/disk-0.raw",
            "/artifacts/abc%2fdisk-0.raw",
            "/artifacts/abc/disk-0%2eraw",
            "/Artifacts/abc/disk-0.raw",
            "artifacts/abc/disk-0.raw",
            "/artifacts/abc/disk-+1.raw",
        ] {
            assert_eq!(resolve(root, bad), None, "{bad}");
        }
        assert_eq!(resolve(root, &artifact_path(&"a".repeat(65), 0, "raw")), None);
    }

    #[tokio::test]
    async fn path_traversal_and_odd_names_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        let secret = b"SECRET-OUTSIDE-THE-STAGING-ROOT".repeat(4);
        // Complete with a marker, so only the path rules stand between it and a client.
        let (secret_file, _) = stage(outside.path(), "disk-0.raw", &secret);
        let root = tempfile::tempdir().unwrap();
        let uid_dir = root.path().join("u");
        stage(&uid_dir, "disk-0.raw", b"legit");
        // A symlinked file with a marker of its own that matches the target.
        std::os::unix::fs::symlink(&secret_file, uid_dir.join("disk-1.raw")).unwrap();
        fs::copy(marker_path(&secret_file), marker_path(&uid_dir.join("disk-1.raw"))).unwrap();
        // A symlinked uid directory.
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();
        let server = start(root.path()).await;
        let addr = server.local_addr();

        let targets = [
            "/artifacts/../x",
            "/artifacts/u/../../etc/passwd",
            "/artifacts/u/%2e%2e/%2e%2e/etc/passwd",
            "/artifacts/%2e%2e/disk-0.raw",
            "/artifacts/u%2fdisk-0.raw",
            "/artifacts/U/disk-0.raw",
            "/artifacts/u/disk-0.vmdk",
            "/artifacts/u/disk-0.raw.sha256",
            "/artifacts/u/./disk-0.raw",
            "//artifacts/u/disk-0.raw",
            "/artifacts/u\\..\\disk-0.raw",
            "http://staging/artifacts/u/disk-0.raw",
            "/artifacts/u/disk-1.raw",
            "/artifacts/link/disk-0.raw",
        ];
        for target in targets {
            let reply = get(addr, target).await;
            assert_eq!(reply.status, 404, "{target}");
            assert!(!reply.body.windows(6).any(|w| w == b"SECRET"), "{target} leaked the secret");
        }
        let malformed: [&[u8]; 4] = [
            b"GET /artifacts/u/disk-0.raw\r\n\r\n",
            b"GET /artifacts/u/disk-0.raw HTTP/2.0\r\n\r\n",
            b"GET  /artifacts/u/disk-0.raw HTTP/1.1\r\n\r\n",
            b"GET /artifacts/u/disk-0.raw HTTP/1.1\r\nno colon here\r\n\r\n",
        ];
        for raw in malformed {
            assert_eq!(exchange(addr, raw).await.status, 400, "{}", String::from_utf8_lossy(raw));
        }

        let stats = server.stats();
        let refused = (targets.len() + malformed.len()) as u64;
        assert_eq!(stats.rejected_paths.load(Ordering::Relaxed), refused);
        assert_eq!(stats.bytes_served.load(Ordering::Relaxed), 0);
        // The rules refuse oddities, not the real thing.
        let reply = get(addr, "/artifacts/u/disk-0.raw").await;
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b"legit"[..]));
    }

    #[tokio::test]
    async fn file_without_marker_is_not_served() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(UID);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("disk-0.raw"), b"still being written").unwrap();
        // A marker for a different length: the file changed size after it was recorded.
        let (grown, _) = stage(&dir, "disk-1.raw", b"first version");
        fs::write(&grown, b"first version, then more").unwrap();
        // An empty file whose marker does not claim empty content.
        let empty = dir.join("disk-2.raw");
        fs::write(&empty, b"").unwrap();
        write_marker(&empty, &Marker { size: 0, sha256: "0".repeat(64) }).unwrap();
        let server = start(root.path()).await;

        for disk in 0..3 {
            let path = artifact_path(UID, disk, "raw");
            assert_eq!(get(server.local_addr(), &path).await.status, 404, "{path}");
            assert_eq!(request(server.local_addr(), "HEAD", &path, "").await.status, 404, "{path}");
        }
        assert_eq!(server.stats().bytes_served.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_byte_flipped_after_staging_is_never_delivered_whole_and_is_marked_corrupt() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(UID);
        let len = 3 * CHUNK + 100;
        // Flipped in the first chunk (already sent when the hash is known) and in the tail.
        for (disk, flipped) in [(0, 17), (1, len - 1)] {
            let mut bytes = pattern(len);
            let (file, expected) = stage(&dir, &format!("disk-{disk}.raw"), &bytes);
            bytes[flipped] ^= 0x01;
            fs::write(&file, &bytes).unwrap();
            let server = start(root.path()).await;
            let path = artifact_path(UID, disk, "raw");

            let reply = get(server.local_addr(), &path).await;

            assert_eq!(reply.status, 200);
            assert_eq!(reply.content_length(), len);
            assert!(reply.body.len() < len, "a corrupt artifact was delivered whole");
            assert!(reply.body == bytes[..reply.body.len()]);
            let (_, actual) = sha256_file(&file, None).unwrap();
            let note = fs::read_to_string(corrupt_path(&file)).unwrap();
            assert_eq!(note, format!("expected {expected} got {actual}\n"));
            assert_eq!(server.stats().corrupt_detected.load(Ordering::Relaxed), 1);
            assert_eq!(get(server.local_addr(), &path).await.status, 404);
        }
    }

    #[tokio::test]
    async fn head_returns_headers_without_body() {
        let root = tempfile::tempdir().unwrap();
        let bytes = pattern(4096);
        let (_, sha256) = stage(&root.path().join(UID), "disk-0.qcow2", &bytes);
        let server = start(root.path()).await;

        // Range is defined for GET only, so HEAD describes the whole file.
        let path = artifact_path(UID, 0, "qcow2");
        let reply = request(server.local_addr(), "HEAD", &path, "Range: bytes=0-9\r\n").await;

        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_length(), bytes.len());
        assert_eq!(reply.header("X-Checksum-Sha256"), Some(sha256.as_str()));
        assert!(reply.body.is_empty());
        assert_eq!(server.stats().bytes_served.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn non_get_methods_are_405() {
        let root = tempfile::tempdir().unwrap();
        stage(&root.path().join(UID), "disk-0.raw", b"data");
        let server = start(root.path()).await;

        for method in ["POST", "PUT", "DELETE", "OPTIONS", "PATCH"] {
            let reply = request(server.local_addr(), method, &artifact_path(UID, 0, "raw"), "").await;
            assert_eq!(reply.status, 405, "{method}");
            assert_eq!(reply.header("Allow"), Some("GET, HEAD"), "{method}");
        }
        // A body the server never reads does not turn the answer into a reset.
        let raw = format!("PUT /healthz HTTP/1.1\r\nContent-Length: 100000\r\n\r\n{}", "x".repeat(100_000));
        assert_eq!(exchange(server.local_addr(), raw.as_bytes()).await.status, 405);
    }

    #[tokio::test]
    async fn oversized_request_head_is_431() {
        let root = tempfile::tempdir().unwrap();
        let server = start(root.path()).await;

        let raw = format!("GET /healthz HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(exchange(server.local_addr(), raw.as_bytes()).await.status, 431);
        // Just under the limit is fine, and bare LF line ends are accepted.
        let raw = format!("GET /healthz HTTP/1.1\nX-Filler: {}\n\n", "a".repeat(MAX_HEAD - 100));
        assert_eq!(exchange(server.local_addr(), raw.as_bytes()).await.status, 200);
    }

    #[tokio::test]
    async fn dropping_the_server_stops_serving() {
        let root = tempfile::tempdir().unwrap();
        let server = start(root.path()).await;
        let addr = server.local_addr();
        assert_eq!(get(addr, "/healthz").await.status, 200);
        drop(server);
        // The abort takes effect at the accept loop's next poll.
        let mut refused = false;
        for _ in 0..100 {
            if TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(refused, "still accepting connections after drop");
    }

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
        ];
        for (input, encoded) in cases {
            assert_eq!(base64(input.as_bytes()), encoded);
        }
        let abc = unhex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(base64(&abc), "ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0=");
    }
}
