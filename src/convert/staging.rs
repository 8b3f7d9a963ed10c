//! The staging HTTPS server CDI imports artifacts from.
//!
//! On [`crate::server`] (hyper under connection, time and size limits), over
//! TLS with the identity of [`super::access`], so a request is answered by
//! hyper's HTTP/1.1 parser and only ever reaches the code below well formed.
//!
//! # Who is answered
//!
//! `/healthz` answers anyone. An artifact is answered only to a request
//! carrying that artifact's own credentials (basic auth, see
//! [`super::access`]); anything else is 401, counted in
//! [`ServeStats::unauthorized`], before the file system is looked at, so a
//! stranger cannot even learn which artifacts exist.
//!
//! # Paths
//!
//! Only `/artifacts/<uid>/disk-<n>.<raw|qcow2>` is served, from
//! `<root>/<uid>/disk-<n>.<raw|qcow2>`. `<uid>` is 1 to 64 of `[a-z0-9-]` and
//! `<n>` a decimal number without leading zeros, so an accepted path cannot
//! hold `.` segments, percent-escapes, backslashes or extra slashes, and no
//! decoding is ever done. The query string is dropped. Neither the uid
//! directory nor the file may be a symlink; the file must be a regular file.
//! Anything else is 404 and counted in [`ServeStats::rejected_paths`].
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
//! `<file>.corrupt`, withholds the buffer and ends the body with an error,
//! which makes hyper close the connection: the client gets fewer bytes than
//! `Content-Length`, so bytes that changed after staging (bit rot, a stray
//! write) are never delivered whole, and later requests get 404.

use super::access::{REALM, StagingAccess};
use super::artifact::{Marker, corrupt_path, hex, read_marker};
use crate::server::{self, Body, Server, ServerLimits};
use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, SeekFrom};
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Read size for whole-file responses, and so the size of the held-back tail.
const CHUNK: usize = 1 << 20;
/// Largest request head (request line and headers) accepted: what hyper's
/// smallest read buffer holds (see `crate::server`).
const MAX_HEAD: usize = 8 * 1024;
/// sha256 of zero bytes: an empty file can be checked without reading it.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// The staging server's limits: importers are few (one per disk being
/// imported), an answer is a disk image that may take hours to stream, and a
/// client that stops reading for a minute is dropped.
fn limits() -> ServerLimits {
    ServerLimits {
        max_connections: 256,
        header_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(30),
        connection_deadline: Duration::from_secs(7 * 24 * 3600),
        write_stall: Duration::from_secs(60),
        max_head_bytes: MAX_HEAD,
    }
}

/// Counters for the staging server, shared with whoever started it.
#[derive(Default, Debug)]
pub struct ServeStats {
    /// Requests answered by our code (hyper itself answers malformed ones).
    pub requests: AtomicU64,
    /// Body bytes handed to connections.
    pub bytes_served: Arc<AtomicU64>,
    /// Whole-file reads whose hash differed from the marker.
    pub corrupt_detected: AtomicU64,
    /// Paths outside the artifact shape, and symlinks or non-regular files
    /// where an artifact should be.
    pub rejected_paths: AtomicU64,
    /// Artifact requests without that artifact's credentials.
    pub unauthorized: AtomicU64,
}

/// A running staging server. Dropping it stops the server and every open
/// connection.
pub struct StagingServer {
    server: Server,
    stats: Arc<ServeStats>,
    url: String,
    access: Arc<StagingAccess>,
}

struct Shared {
    root: PathBuf,
    access: Arc<StagingAccess>,
    stats: Arc<ServeStats>,
}

impl StagingServer {
    /// Serves files under `root` (layout: `root/<migration-uid>/disk-<n>.<raw|qcow2>`)
    /// at URL path `/artifacts/<migration-uid>/disk-<n>.<raw|qcow2>`, over
    /// TLS, to holders of each artifact's credentials. `url` is where CDI
    /// reaches it (the host its certificate names).
    pub async fn start(
        listener: TcpListener,
        root: PathBuf,
        url: String,
        access: Arc<StagingAccess>,
    ) -> io::Result<StagingServer> {
        if !tokio::fs::metadata(&root).await?.is_dir() {
            let message = format!("staging root {} is not a directory", root.display());
            return Err(io::Error::new(io::ErrorKind::NotADirectory, message));
        }
        let stats = Arc::new(ServeStats::default());
        let tls = access.tls();
        let shared = Arc::new(Shared { root, access: access.clone(), stats: stats.clone() });
        let server = Server::start(listener, limits(), Some(tls), "staging", move |request| {
            let shared = shared.clone();
            async move { handle(request, &shared).await }
        })?;
        Ok(StagingServer { server, stats, url, access })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The base URL CDI is given (`https://…`, no trailing slash).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn access(&self) -> Arc<StagingAccess> {
        self.access.clone()
    }

    pub fn stats(&self) -> Arc<ServeStats> {
        self.stats.clone()
    }
}

/// The URL path of an artifact: `/artifacts/<uid>/disk-<n>.<ext>`.
pub(crate) fn artifact_path(uid: &str, disk: usize, ext: &str) -> String {
    format!("/artifacts/{uid}/disk-{disk}.{ext}")
}

/// The migration uid and file name a request path names, validated; the
/// query string is dropped. Pure: the file system checks happen in
/// `open_artifact`.
fn artifact_name(url_path: &str) -> Option<(&str, &str)> {
    let path = url_path.split_once('?').map_or(url_path, |(path, _)| path);
    let (uid, file) = path.strip_prefix("/artifacts/")?.split_once('/')?;
    (is_uid(uid) && is_disk_file(file)).then_some((uid, file))
}

/// The file a request path names under `root`; `None` for anything else.
#[cfg(test)]
fn resolve(root: &Path, url_path: &str) -> Option<PathBuf> {
    artifact_name(url_path).map(|(uid, file)| root.join(uid).join(file))
}

fn is_uid(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// `disk-<n>.raw` or `disk-<n>.qcow2`, `<n>` without leading zeros so each
/// disk has exactly one URL.
fn is_disk_file(name: &str) -> bool {
    // A raw disk's warm companions: its base and its patch.
    let name = companion_of(name);
    let Some((stem, ext)) = name.rsplit_once('.') else { return false };
    let Some(n) = stem.strip_prefix("disk-") else { return false };
    matches!(ext, "raw" | "qcow2")
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
        && (n == "0" || !n.starts_with('0'))
}

/// The artifact a warm companion (`disk-<n>.raw.base`, `disk-<n>.raw.patch`)
/// belongs to, whose credentials open it too: a disk's base and changes are
/// no more than its artifact. Any other name is itself.
pub(crate) fn companion_of(name: &str) -> &str {
    [".raw.base", ".raw.patch"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix).map(|stem| &name[..stem.len() + 4]))
        .unwrap_or(name)
}

/// An answer with no body but the reason phrase (none for HEAD).
fn simple(status: StatusCode, is_head: bool) -> Response<Body> {
    let reason = format!("{}\n", status.canonical_reason().unwrap_or("error"));
    let mut answer = server::text(status, if is_head { String::new() } else { reason });
    if is_head {
        *answer.body_mut() = server::whole(Bytes::new());
    }
    answer
}

async fn handle(request: Request<Incoming>, shared: &Shared) -> Response<Body> {
    let stats = &shared.stats;
    stats.requests.fetch_add(1, Ordering::Relaxed);
    let is_head = request.method() == Method::HEAD;
    if request.method() != Method::GET && !is_head {
        debug!(status = 405, "method not allowed");
        let mut answer = simple(StatusCode::METHOD_NOT_ALLOWED, false);
        answer.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return answer;
    }
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str());
    if request.uri().path() == "/healthz" {
        return server::text(StatusCode::OK, "ok");
    }
    // The origin form only: an absolute URI names some other server.
    let name = if request.uri().scheme().is_some() { None } else { artifact_name(target) };
    let Some((uid, file_name)) = name else {
        stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
        debug!(status = 404, "path is not an artifact path");
        return simple(StatusCode::NOT_FOUND, is_head);
    };
    let authorization = request.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    if !shared.access.allows(authorization, uid, file_name) {
        stats.unauthorized.fetch_add(1, Ordering::Relaxed);
        debug!(status = 401, "no credentials of this artifact");
        let mut answer = simple(StatusCode::UNAUTHORIZED, is_head);
        let challenge = HeaderValue::from_str(&format!("Basic realm=\"{REALM}\"")).expect("a plain realm");
        answer.headers_mut().insert(header::WWW_AUTHENTICATE, challenge);
        return answer;
    }
    let file = shared.root.join(uid).join(file_name);
    let opened = {
        let file = file.clone();
        tokio::task::spawn_blocking(move || open_artifact(&file)).await
    };
    let artifact = match opened.unwrap_or_else(|e| Err(Refusal::Io(io::Error::other(e)))) {
        Ok(artifact) => artifact,
        Err(Refusal::NotFound) => {
            debug!(status = 404, "no such artifact");
            return simple(StatusCode::NOT_FOUND, is_head);
        }
        Err(Refusal::NotRegular) => {
            stats.rejected_paths.fetch_add(1, Ordering::Relaxed);
            debug!(status = 404, file = %file.display(), "refused: symlink or not a regular file");
            return simple(StatusCode::NOT_FOUND, is_head);
        }
        Err(Refusal::Unverified(why)) => {
            debug!(status = 404, file = %file.display(), why, "refused: not a verified artifact");
            return simple(StatusCode::NOT_FOUND, is_head);
        }
        Err(Refusal::Io(e)) => {
            warn!(file = %file.display(), error = %e, "staging server: cannot open artifact");
            return simple(StatusCode::INTERNAL_SERVER_ERROR, is_head);
        }
    };

    let size = artifact.marker.size;
    let checksum = artifact.marker.sha256.clone();
    let digest = format!("sha-256={}", base64::engine::general_purpose::STANDARD.encode(unhex(&checksum)));
    // Range is defined for GET only (RFC 9110 §14.2). If-Range is not
    // honoured: there are no validators to match, so the whole file is sent.
    let ranges: Vec<&str> =
        request.headers().get_all(header::RANGE).iter().filter_map(|v| v.to_str().ok()).collect();
    let range = match ranges.as_slice() {
        [one] if !is_head && !request.headers().contains_key(header::IF_RANGE) => plan_range(one, size),
        _ => RangePlan::Whole,
    };
    let (status, length, body) = match range {
        RangePlan::Whole => {
            debug!(status = 200, bytes = size, "serving whole artifact");
            let body =
                if is_head { server::whole(Bytes::new()) } else { verified_body(artifact, stats.clone()) };
            (StatusCode::OK, size, body)
        }
        RangePlan::Partial { first, last } => {
            debug!(status = 206, first, last, "serving artifact range");
            let body = range_body(artifact.file, first, last - first + 1, stats.clone());
            (StatusCode::PARTIAL_CONTENT, last - first + 1, body)
        }
        RangePlan::Unsatisfiable => {
            debug!(status = 416, "range not satisfiable");
            let mut answer = simple(StatusCode::RANGE_NOT_SATISFIABLE, false);
            let content_range = HeaderValue::from_str(&format!("bytes */{size}")).expect("digits");
            answer.headers_mut().insert(header::CONTENT_RANGE, content_range);
            return answer;
        }
    };
    let mut answer = Response::new(body);
    *answer.status_mut() = status;
    let headers = answer.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    headers.insert("x-checksum-sha256", HeaderValue::from_str(&checksum).expect("hex"));
    headers.insert("digest", HeaderValue::from_str(&digest).expect("base64"));
    if let RangePlan::Partial { first, last } = range {
        let content_range = format!("bytes {first}-{last}/{size}");
        headers.insert(header::CONTENT_RANGE, HeaderValue::from_str(&content_range).expect("digits"));
    }
    answer
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

type Frames = mpsc::Sender<io::Result<Frame<Bytes>>>;

/// A body fed by a task through a one-frame channel: the task reads ahead at
/// most one chunk, and stops when the connection (so the receiver) goes.
fn channel_body<F>(produce: impl FnOnce(Frames) -> F) -> Body
where
    F: Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel(1);
    tokio::spawn(produce(tx));
    StreamBody::new(futures::stream::poll_fn(move |cx| rx.poll_recv(cx))).boxed_unsync()
}

/// Hands `bytes` to the connection; `false` when the client has gone.
async fn send(tx: &Frames, bytes: Vec<u8>, stats: &ServeStats) -> bool {
    let n = bytes.len() as u64;
    if n == 0 {
        return true;
    }
    let sent = tx.send(Ok(Frame::data(Bytes::from(bytes)))).await.is_ok();
    if sent {
        stats.bytes_served.fetch_add(n, Ordering::Relaxed);
    }
    sent
}

/// Streams the whole file, hashing as it goes and holding back the last read
/// until the hash at end of file matches the marker (see the module docs).
fn verified_body(artifact: Artifact, stats: Arc<ServeStats>) -> Body {
    channel_body(move |tx| async move {
        let Artifact { path, file, marker } = artifact;
        // Never read past the size announced in Content-Length, even if the file grew.
        let mut file = tokio::fs::File::from_std(file).take(marker.size);
        let mut hasher = Sha256::new();
        let mut held: Vec<u8> = Vec::new();
        loop {
            let mut current = vec![0u8; CHUNK];
            let n = match read_chunk(&mut file, &mut current).await {
                Ok(n) => n,
                Err(e) => {
                    warn!(file = %path.display(), error = %e, "staging server: read failed");
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            if n == 0 {
                break;
            }
            current.truncate(n);
            hasher.update(&current);
            if !send(&tx, std::mem::replace(&mut held, current), &stats).await {
                return;
            }
        }
        let actual = hex(&hasher.finalize());
        if actual == marker.sha256 {
            send(&tx, held, &stats).await;
            return;
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
        // An error frame makes hyper close the connection short of Content-Length.
        let _ = tx.send(Err(io::Error::other("artifact differs from its checksum"))).await;
    })
}

/// Sends `length` bytes from `first`. Ranges are not hash-verified: that
/// would mean reading the whole file for every range; a client that needs
/// integrity fetches the whole file or checks `X-Checksum-Sha256` itself.
fn range_body(file: fs::File, first: u64, length: u64, stats: Arc<ServeStats>) -> Body {
    channel_body(move |tx| async move {
        let mut file = tokio::fs::File::from_std(file);
        if let Err(e) = file.seek(SeekFrom::Start(first)).await {
            let _ = tx.send(Err(e)).await;
            return;
        }
        let mut file = file.take(length);
        loop {
            let mut buf = vec![0u8; CHUNK.min(usize::try_from(length).unwrap_or(CHUNK))];
            match file.read(&mut buf).await {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if !send(&tx, buf, &stats).await {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            }
        }
    })
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
    use crate::convert::access::tests::basic;
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

    /// A staging server and a client that trusts its CA.
    struct Running {
        server: StagingServer,
        connector: tokio_rustls::TlsConnector,
        _tls_dir: tempfile::TempDir,
    }

    impl std::ops::Deref for Running {
        type Target = StagingServer;
        fn deref(&self) -> &StagingServer {
            &self.server
        }
    }

    async fn start(root: &Path) -> Running {
        let tls_dir = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let access = Arc::new(StagingAccess::load_or_create(tls_dir.path(), &url).unwrap());
        let connector = connector(access.ca_pem());
        let server = StagingServer::start(listener, root.to_path_buf(), url, access).await.unwrap();
        Running { server, connector, _tls_dir: tls_dir }
    }

    /// A TLS client that trusts only `ca_pem`.
    pub(crate) fn connector(ca_pem: &str) -> tokio_rustls::TlsConnector {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// Sends `raw` as is over TLS, reads to EOF (a connection cut short
    /// ends the body where it was cut), splits head and body.
    async fn exchange(s: &Running, raw: &[u8]) -> Reply {
        use tokio::io::AsyncWriteExt;
        let tcp = tokio::net::TcpStream::connect(s.local_addr()).await.unwrap();
        let name = rustls::pki_types::ServerName::from(s.local_addr().ip());
        let mut stream = s.connector.connect(name, tcp).await.unwrap();
        stream.write_all(raw).await.unwrap();
        let mut response = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
        }
        let end = response.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head") + 4;
        let head = std::str::from_utf8(&response[..end]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
        let headers =
            lines.filter_map(|l| l.split_once(": ")).map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
        Reply { status, headers, body: response[end..].to_vec() }
    }

    /// The `Authorization` header of the artifact `target` names, if any.
    fn credentials_for(s: &Running, target: &str) -> String {
        match artifact_name(target) {
            Some((uid, file)) => {
                let access = s.access().credential(uid, file);
                format!("Authorization: {}\r\n", basic(&access.access_key_id, &access.secret_key))
            }
            None => String::new(),
        }
    }

    /// A request with the credentials of the artifact it names.
    async fn request(s: &Running, method: &str, target: &str, extra_headers: &str) -> Reply {
        let auth = credentials_for(s, target);
        let raw = format!("{method} {target} HTTP/1.1\r\nHost: staging\r\n{auth}{extra_headers}\r\n");
        exchange(s, raw.as_bytes()).await
    }

    async fn get(s: &Running, target: &str) -> Reply {
        request(s, "GET", target, "").await
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

        let reply = get(&server, &format!("{}?ignored=1", artifact_path(UID, 0, "raw"))).await;

        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_length(), bytes.len());
        assert!(reply.body == bytes, "body differs from the staged file");
        assert_eq!(reply.header("Content-Type"), Some("application/octet-stream"));
        assert_eq!(reply.header("Accept-Ranges"), Some("bytes"));
        assert_eq!(reply.header("X-Checksum-Sha256"), Some(sha256.as_str()));
        assert!(is_sha256_hex(&sha256));
        assert_eq!(
            reply.header("Digest"),
            Some(
                format!("sha-256={}", base64::engine::general_purpose::STANDARD.encode(unhex(&sha256)))
                    .as_str()
            )
        );
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

        let reply = get(&server, &artifact_path("m-1", 12, "qcow2")).await;
        assert_eq!((reply.status, reply.body == bytes), (200, true));

        let health = get(&server, "/healthz").await;
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
            let reply = request(&server, "GET", &path, &format!("Range: {range}\r\n")).await;
            assert_eq!(reply.status, 206, "{range}");
            assert_eq!(reply.header("Content-Range"), Some(format!("bytes {first}-{last}/{size}").as_str()));
            assert_eq!(reply.content_length(), last - first + 1, "{range}");
            assert!(reply.body == bytes[first..=last], "{range}: wrong bytes");
        }

        // Several ranges get the whole file, as RFC 9110 allows.
        let reply = request(&server, "GET", &path, "Range: bytes=0-1,5-6\r\n").await;
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
            let reply = request(&server, "GET", &path, &format!("Range: {range}\r\n")).await;
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
        // A raw disk's warm companions.
        assert_eq!(resolve(root, "/artifacts/abc/disk-0.raw.base"), Some(root.join("abc/disk-0.raw.base")));
        assert_eq!(resolve(root, "/artifacts/abc/disk-2.raw.patch"), Some(root.join("abc/disk-2.raw.patch")));
        for bad in [
            "/artifacts/../x",
            "/artifacts/abc/../disk-0.raw",
            "/artifacts/abc/disk-0.raw/",
            "/artifacts/abc/disk-00.raw",
            "/artifacts/abc/disk-01.raw",
            "/artifacts/abc/disk-.raw",
            "/artifacts/abc/disk-0.raw.sha256",
            "/artifacts/abc/disk-0.raw.corrupt",
            "/artifacts/abc/disk-0.qcow2.patch",
            "/artifacts/abc/disk-0.raw.patch.sha256",
            "/artifacts/abc/disk-0.raw.base.patch",
            "/artifacts/abc/disk-01.raw.base",
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
        let addr = &server;

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
        // The malformed ones hyper answers before our code sees them.
        let refused = targets.len() as u64;
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
            assert_eq!(get(&server, &path).await.status, 404, "{path}");
            assert_eq!(request(&server, "HEAD", &path, "").await.status, 404, "{path}");
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

            let reply = get(&server, &path).await;

            assert_eq!(reply.status, 200);
            assert_eq!(reply.content_length(), len);
            assert!(reply.body.len() < len, "a corrupt artifact was delivered whole");
            assert!(reply.body == bytes[..reply.body.len()]);
            let (_, actual) = sha256_file(&file, None).unwrap();
            let note = fs::read_to_string(corrupt_path(&file)).unwrap();
            assert_eq!(note, format!("expected {expected} got {actual}\n"));
            assert_eq!(server.stats().corrupt_detected.load(Ordering::Relaxed), 1);
            assert_eq!(get(&server, &path).await.status, 404);
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
        let reply = request(&server, "HEAD", &path, "Range: bytes=0-9\r\n").await;

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
            let reply = request(&server, method, &artifact_path(UID, 0, "raw"), "").await;
            assert_eq!(reply.status, 405, "{method}");
            assert_eq!(reply.header("Allow"), Some("GET, HEAD"), "{method}");
        }
        // A body the server never reads does not turn the answer into a reset.
        let raw = format!("PUT /healthz HTTP/1.1\r\nContent-Length: 100000\r\n\r\n{}", "x".repeat(100_000));
        assert_eq!(exchange(&server, raw.as_bytes()).await.status, 405);
    }

    #[tokio::test]
    async fn oversized_request_head_is_431() {
        let root = tempfile::tempdir().unwrap();
        let server = start(root.path()).await;

        let raw = format!("GET /healthz HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(exchange(&server, raw.as_bytes()).await.status, 431);
        // Just under the limit is fine, and bare LF line ends are accepted.
        let raw = format!("GET /healthz HTTP/1.1\nX-Filler: {}\n\n", "a".repeat(MAX_HEAD - 200));
        assert_eq!(exchange(&server, raw.as_bytes()).await.status, 200);
    }

    #[tokio::test]
    async fn dropping_the_server_stops_serving() {
        let root = tempfile::tempdir().unwrap();
        let server = start(root.path()).await;
        let addr = server.local_addr();
        assert_eq!(get(&server, "/healthz").await.status, 200);
        drop(server);
        // The abort takes effect at the accept loop's next poll.
        let mut refused = false;
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(refused, "still accepting connections after drop");
    }

    #[tokio::test]
    async fn an_artifact_is_refused_without_its_own_credentials_before_its_existence_shows() {
        let root = tempfile::tempdir().unwrap();
        stage(&root.path().join(UID), "disk-0.raw", b"tenant a's disk");
        stage(&root.path().join(UID), "disk-1.raw", b"tenant a's other disk");
        let server = start(root.path()).await;
        let path = artifact_path(UID, 0, "raw");
        let raw = |auth: &str| format!("GET {path} HTTP/1.1\r\nHost: staging\r\n{auth}\r\n");

        let anonymous = exchange(&server, raw("").as_bytes()).await;
        assert_eq!(anonymous.status, 401);
        assert_eq!(anonymous.header("WWW-Authenticate"), Some("Basic realm=\"vmmigrate-staging\""));
        // Another disk's credentials, and its secret under this disk's name.
        let other = server.access().credential(UID, "disk-1.raw");
        let own = server.access().credential(UID, "disk-0.raw");
        for auth in
            [basic(&other.access_key_id, &other.secret_key), basic(&own.access_key_id, &other.secret_key)]
        {
            let reply = exchange(&server, raw(&format!("Authorization: {auth}\r\n")).as_bytes()).await;
            assert_eq!(reply.status, 401, "{auth}");
            assert!(!reply.body.windows(6).any(|w| w == b"tenant"));
        }
        // A missing artifact is 401 too, so a stranger learns nothing.
        let missing = format!("GET {} HTTP/1.1\r\nHost: s\r\n\r\n", artifact_path("nobody", 0, "raw"));
        assert_eq!(exchange(&server, missing.as_bytes()).await.status, 401);
        let head = request(&server, "HEAD", &path, "Authorization: Basic Zm9vOmJhcg==\r\n").await;
        assert_eq!(head.status, 200, "a second Authorization header is not a way around the first");

        let stats = server.stats();
        assert_eq!(stats.unauthorized.load(Ordering::Relaxed), 4);
        assert_eq!(stats.bytes_served.load(Ordering::Relaxed), 0);
        assert_eq!(get(&server, &path).await.body, b"tenant a's disk");
    }

    #[tokio::test]
    async fn plain_http_gets_no_answer() {
        use tokio::io::AsyncWriteExt;
        let root = tempfile::tempdir().unwrap();
        stage(&root.path().join(UID), "disk-0.raw", b"data");
        let server = start(root.path()).await;
        let mut tcp = tokio::net::TcpStream::connect(server.local_addr()).await.unwrap();
        let raw = format!("GET {} HTTP/1.1\r\nHost: s\r\n\r\n", artifact_path(UID, 0, "raw"));
        tcp.write_all(raw.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer).await;
        assert!(
            !answer.starts_with(b"HTTP/"),
            "answered in the clear: {:?}",
            String::from_utf8_lossy(&answer)
        );
        assert!(!answer.windows(4).any(|w| w == b"data"));
        assert_eq!(server.stats().requests.load(Ordering::Relaxed), 0);
    }
}
