//! Webhook receiver: push and pull-request events from GitHub, Gitea and GitLab.
//!
//! A webhook only says "look now": every event is a hint that makes the
//! gitops loop fetch sooner, and the poll loop stays the fallback for anything
//! lost here. So the receiver answers within a second and never waits for work:
//! a verified event is answered `202 Accepted` and then offered to the channel
//! with `try_send`. When the channel is full the event is dropped and counted
//! in [`WebhookStats::coalesced`]: the events already queued make the loop
//! fetch anyway, and a fetch sees every commit pushed so far.
//!
//! Written on `tokio::net::TcpListener` like `crate::convert::staging`: one
//! POST per connection (`Connection: close`) with a `Content-Length` body is
//! all the forges send, so no HTTP framework is pulled in.
//!
//! # Routes
//!
//! | route | event header | authentication |
//! |---|---|---|
//! | `POST /hooks/github` | `X-GitHub-Event` | `X-Hub-Signature-256: sha256=<hex>` |
//! | `POST /hooks/gitea` | `X-Gitea-Event` | `X-Gitea-Signature: <hex>` and/or `X-Hub-Signature-256` |
//! | `POST /hooks/gitlab` | `X-Gitlab-Event` | `X-Gitlab-Token` |
//! | `GET /healthz` | | none |
//!
//! A forge without a configured secret has no route (404): unsigned events are
//! never accepted. The signature is checked over the raw body before any JSON
//! is parsed; a missing or wrong one is 401 and nothing reaches the channel.
//! Secrets and tokens are compared in constant time.
//!
//! # Answers
//!
//! `202` accepted (also for verified events of other kinds, tag pushes and the
//! like, which are counted as ignored), `400` malformed, `401` bad signature,
//! `404` unknown route or unconfigured forge, `405` wrong method, `408` the
//! request took longer than [`READ_TIMEOUT`], `411` no `Content-Length`
//! (chunked bodies are not supported; no forge sends them), `413` body over
//! [`MAX_BODY`], `431` request head over 16 KiB.

use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::Sha256;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, timeout_at};
use tracing::{Instrument, debug, field, info_span, warn};

type HmacSha256 = Hmac<Sha256>;

/// Largest body accepted. GitHub caps payloads at 25 MB but a push touching
/// `migrations/` is a few KiB; anything this large is not for us.
pub(crate) const MAX_BODY: usize = 5 * 1024 * 1024;
/// Time a client has to send its whole request, head and body.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head (request line and headers) accepted.
const MAX_HEAD: usize = 16 * 1024;
/// A client that accepts none of our (short) answer for this long is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to drain a client's unread input after our FIN (see `close`).
const LINGER: Duration = Duration::from_secs(2);

/// Secrets per forge. A forge left `None` has no route, so it cannot send
/// unsigned events.
#[derive(Clone, Default)]
pub(crate) struct WebhookConfig {
    /// The webhook secret configured on GitHub (HMAC-SHA256 key).
    pub github_secret: Option<String>,
    /// The webhook secret configured on Gitea (HMAC-SHA256 key).
    pub gitea_secret: Option<String>,
    /// The secret token configured on GitLab (sent as is in `X-Gitlab-Token`).
    pub gitlab_token: Option<String>,
}

/// Secrets never reach logs through `{:?}`.
impl fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redact = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("WebhookConfig")
            .field("github_secret", &redact(&self.github_secret))
            .field("gitea_secret", &redact(&self.gitea_secret))
            .field("gitlab_token", &redact(&self.gitlab_token))
            .finish()
    }
}

/// A verified event, reduced to what the gitops loop acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WebhookEvent {
    /// A branch moved (or was deleted: `after` is all zeros then).
    Push { forge: Forge, branch: String, after: String },
    /// A pull request (GitLab: merge request) was opened, updated, closed, ...
    /// `action` is the forge's own word (`synchronize` on GitHub,
    /// `synchronized` on Gitea, `update` on GitLab).
    PullRequest {
        forge: Forge,
        number: u64,
        action: String,
        head_sha: String,
        head_ref: String,
        base_ref: String,
        merged: bool,
    },
    /// GitHub's test delivery when a hook is created.
    Ping { forge: Forge },
}

/// The forge an event came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Forge {
    GitHub,
    Gitea,
    GitLab,
}

impl Forge {
    /// The metric label and log word.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Forge::GitHub => "github",
            Forge::Gitea => "gitea",
            Forge::GitLab => "gitlab",
        }
    }
}

impl WebhookEvent {
    /// The forge that sent the event.
    pub(crate) fn forge(&self) -> Forge {
        match self {
            WebhookEvent::Push { forge, .. }
            | WebhookEvent::PullRequest { forge, .. }
            | WebhookEvent::Ping { forge } => *forge,
        }
    }
}

/// Counters for the webhook receiver, shared with whoever started it.
#[derive(Default, Debug)]
pub struct WebhookStats {
    /// Verified and parsed events (delivered or coalesced).
    pub accepted: AtomicU64,
    /// Requests with a missing or wrong signature or token (401).
    pub rejected_signature: AtomicU64,
    /// Malformed requests: bad head, bad or missing length, oversized body,
    /// undecodable payload, missing event header.
    pub malformed: AtomicU64,
    /// Verified deliveries we do not act on: tag pushes, other event kinds.
    pub ignored: AtomicU64,
    /// Accepted events dropped because the channel was full; the events
    /// already queued (and the poll loop) cover them.
    pub coalesced: AtomicU64,
}

/// A running webhook receiver. Dropping it stops the server and every open
/// connection.
pub(crate) struct WebhookServer {
    addr: SocketAddr,
    stats: Arc<WebhookStats>,
    task: JoinHandle<()>,
}

impl WebhookServer {
    /// Serves the webhook routes on `listener`, sending verified events to `events`.
    pub(crate) async fn start(
        listener: TcpListener,
        config: WebhookConfig,
        events: mpsc::Sender<WebhookEvent>,
    ) -> io::Result<WebhookServer> {
        let addr = listener.local_addr()?;
        let stats = Arc::new(WebhookStats::default());
        let shared = Arc::new(Shared { config, events, stats: stats.clone() });
        let task = tokio::spawn(accept_loop(listener, shared));
        Ok(WebhookServer { addr, stats, task })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn stats(&self) -> Arc<WebhookStats> {
        self.stats.clone()
    }
}

impl Drop for WebhookServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Checks a GitHub-style `X-Hub-Signature-256` value (`sha256=<64 hex>`)
/// against the HMAC-SHA256 of `body` under `secret`, in constant time.
pub(crate) fn verify_hub_signature(secret: &[u8], body: &[u8], header: &str) -> bool {
    match header.trim().strip_prefix("sha256=") {
        Some(hex) => verify_hex_signature(secret, body, hex),
        None => false,
    }
}

/// Gitea's `X-Gitea-Signature`: the same HMAC as bare hex, without a prefix.
fn verify_hex_signature(secret: &[u8], body: &[u8], hex: &str) -> bool {
    let Some(expected) = unhex(hex.trim()) else { return false };
    let Ok(mut mac) = HmacSha256::new_from_slice(secret) else { return false };
    mac.update(body);
    mac.verify_slice(&expected).is_ok()
}

/// Compares GitLab's token in constant time, length included: both sides are
/// reduced to an HMAC under a fixed key and the tags compared with
/// `verify_slice`, so the time taken says nothing about where they differ.
fn token_matches(expected: &str, presented: &str) -> bool {
    const KEY: &[u8] = b"vmmigrate gitlab token comparison";
    let tag = |s: &str| {
        let mut mac = HmacSha256::new_from_slice(KEY).ok()?;
        mac.update(s.as_bytes());
        Some(mac)
    };
    let (Some(expected), Some(presented)) = (tag(expected), tag(presented)) else { return false };
    presented.verify_slice(&expected.finalize().into_bytes()).is_ok()
}

/// Exactly 32 bytes of hex (either case); anything else is `None`.
fn unhex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    hex.as_bytes()
        .chunks(2)
        .map(|pair| std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok()))
        .collect()
}

struct Shared {
    config: WebhookConfig,
    events: mpsc::Sender<WebhookEvent>,
    stats: Arc<WebhookStats>,
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Connections belong to this task's JoinSet, so aborting the task (on
    // drop) aborts them as well.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let span = info_span!("webhook", %peer, target = field::Empty, status = field::Empty);
                    connections.spawn(serve_connection(stream, shared.clone()).instrument(span));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "webhook server: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(done) = connections.join_next() => {
                if let Err(e) = done && e.is_panic() {
                    warn!(error = %e, "webhook server: connection task panicked");
                }
            }
        }
    }
}

/// What a request earned, decided before anything is written back.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// 202, and the event (if any) is offered to the channel afterwards.
    Accepted(Option<WebhookEvent>),
    Healthy,
    /// 405, with the methods the path does answer.
    MethodNotAllowed(&'static str),
    Refused(u16),
}

async fn serve_connection(mut stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + READ_TIMEOUT;
    let outcome = match timeout_at(deadline, handle(&mut stream, &shared)).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            debug!(error = %e, "connection ended before the request was complete");
            return close(stream).await;
        }
        Err(_elapsed) => Outcome::Refused(408),
    };
    let stats = &shared.stats;
    let written = match &outcome {
        Outcome::Accepted(_) => send(&mut stream, 202, "accepted\n").await,
        Outcome::Healthy => send(&mut stream, 200, "ok\n").await,
        Outcome::MethodNotAllowed(allow) => send_405(&mut stream, allow).await,
        Outcome::Refused(status) => send(&mut stream, *status, &format!("{}\n", reason(*status))).await,
    };
    let status = match &outcome {
        Outcome::Accepted(_) => 202,
        Outcome::Healthy => 200,
        Outcome::MethodNotAllowed(_) => 405,
        Outcome::Refused(status) => *status,
    };
    tracing::Span::current().record("status", status);
    if let Err(e) = written {
        debug!(error = %e, "could not write the answer");
    }
    match outcome {
        Outcome::Accepted(Some(event)) => {
            stats.accepted.fetch_add(1, Ordering::Relaxed);
            match shared.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    stats.coalesced.fetch_add(1, Ordering::Relaxed);
                    debug!(?event, "event channel full; coalesced with the queued ones");
                }
                Err(TrySendError::Closed(_)) => debug!("event channel closed; shutting down"),
            }
        }
        Outcome::Accepted(None) => {
            stats.ignored.fetch_add(1, Ordering::Relaxed);
        }
        Outcome::Healthy | Outcome::MethodNotAllowed(_) => {}
        Outcome::Refused(408) => {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
        }
        Outcome::Refused(_) => {}
    }
    close(stream).await;
}

/// Reads and judges one request. Counters for refusals are bumped here, where
/// the reason is known; acceptance is counted by the caller after answering.
async fn handle(stream: &mut TcpStream, shared: &Shared) -> io::Result<Outcome> {
    let stats = &shared.stats;
    let malformed = |status: u16| {
        stats.malformed.fetch_add(1, Ordering::Relaxed);
        Ok(Outcome::Refused(status))
    };
    let (head, mut body) = match read_head(stream).await? {
        Head::Complete { head, rest } => (head, rest),
        Head::TooLarge => return malformed(431),
    };
    let Some(request) = parse_request(&head) else { return malformed(400) };
    tracing::Span::current().record("target", request.target);
    let path = request.target.split_once('?').map_or(request.target, |(path, _)| path);
    let forge = match path {
        "/healthz" if request.method == "GET" => return Ok(Outcome::Healthy),
        "/healthz" => return Ok(Outcome::MethodNotAllowed("GET")),
        "/hooks/github" => Forge::GitHub,
        "/hooks/gitea" => Forge::Gitea,
        "/hooks/gitlab" => Forge::GitLab,
        _ => return Ok(Outcome::Refused(404)),
    };
    let configured = match forge {
        Forge::GitHub => shared.config.github_secret.is_some(),
        Forge::Gitea => shared.config.gitea_secret.is_some(),
        Forge::GitLab => shared.config.gitlab_token.is_some(),
    };
    if !configured {
        debug!(?forge, "no secret configured for this forge: route disabled");
        return Ok(Outcome::Refused(404));
    }
    if request.method != "POST" {
        return Ok(Outcome::MethodNotAllowed("POST"));
    }
    if request.header("transfer-encoding").is_some() {
        return malformed(411);
    }
    let length = match request.content_length() {
        Length::Missing => return malformed(411),
        Length::Invalid => return malformed(400),
        Length::Bytes(n) if n > MAX_BODY => return malformed(413),
        Length::Bytes(n) => n,
    };
    if body.len() > length {
        // Bytes past the body: a pipelined request, which one-request
        // connections do not serve.
        return malformed(400);
    }
    if request.header("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
        stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
    }
    read_body(stream, &mut body, length).await?;

    if !authentic(forge, &shared.config, &request, &body) {
        stats.rejected_signature.fetch_add(1, Ordering::Relaxed);
        debug!(?forge, "missing or wrong signature");
        return Ok(Outcome::Refused(401));
    }
    match parse_event(forge, &request, &body) {
        Ok(event) => Ok(Outcome::Accepted(event)),
        Err(why) => {
            debug!(?forge, why, "verified delivery could not be parsed");
            malformed(400)
        }
    }
}

/// Checks the delivery's signature or token. Only called for configured forges.
fn authentic(forge: Forge, config: &WebhookConfig, request: &Request<'_>, body: &[u8]) -> bool {
    match forge {
        Forge::GitHub => {
            let (Some(secret), Some(signature)) =
                (config.github_secret.as_deref(), request.header("x-hub-signature-256"))
            else {
                return false;
            };
            verify_hub_signature(secret.as_bytes(), body, signature)
        }
        Forge::Gitea => {
            // Gitea sends both; every one present must verify, and one must be present.
            let Some(secret) = config.gitea_secret.as_deref() else { return false };
            let gitea = request.header("x-gitea-signature");
            let hub = request.header("x-hub-signature-256");
            (gitea.is_some() || hub.is_some())
                && gitea.is_none_or(|hex| verify_hex_signature(secret.as_bytes(), body, hex))
                && hub.is_none_or(|value| verify_hub_signature(secret.as_bytes(), body, value))
        }
        Forge::GitLab => {
            let (Some(expected), Some(presented)) =
                (config.gitlab_token.as_deref(), request.header("x-gitlab-token"))
            else {
                return false;
            };
            token_matches(expected, presented)
        }
    }
}

/// The event a verified delivery describes; `Ok(None)` for a delivery we do
/// not act on (a tag push, another kind of event); `Err` for a malformed one.
fn parse_event(
    forge: Forge,
    request: &Request<'_>,
    body: &[u8],
) -> Result<Option<WebhookEvent>, &'static str> {
    let kind_header = match forge {
        Forge::GitHub => "x-github-event",
        Forge::Gitea => "x-gitea-event",
        Forge::GitLab => "x-gitlab-event",
    };
    let kind = request.header(kind_header).ok_or("no event header")?;
    match (forge, kind) {
        (Forge::GitHub | Forge::Gitea, "push") | (Forge::GitLab, "Push Hook") => {
            let push: PushPayload = json(body)?;
            Ok(push
                .r#ref
                .strip_prefix("refs/heads/")
                .filter(|b| !b.is_empty())
                .map(|branch| WebhookEvent::Push { forge, branch: branch.to_owned(), after: push.after }))
        }
        (Forge::GitHub | Forge::Gitea, "pull_request") => {
            let event: PullRequestPayload = json(body)?;
            let pr = event.pull_request;
            Ok(Some(WebhookEvent::PullRequest {
                forge,
                number: event.number.or(pr.number).ok_or("no pull request number")?,
                action: event.action,
                head_sha: pr.head.sha,
                head_ref: pr.head.r#ref,
                base_ref: pr.base.r#ref,
                merged: pr.merged.unwrap_or(false),
            }))
        }
        (Forge::GitLab, "Merge Request Hook") => {
            let event: MergeRequestPayload = json(body)?;
            let mr = event.object_attributes;
            Ok(Some(WebhookEvent::PullRequest {
                forge,
                number: mr.iid,
                action: mr.action.unwrap_or_default(),
                head_sha: mr.last_commit.id,
                head_ref: mr.source_branch,
                base_ref: mr.target_branch,
                merged: mr.state == "merged",
            }))
        }
        (Forge::GitHub, "ping") => Ok(Some(WebhookEvent::Ping { forge })),
        _ => Ok(None),
    }
}

fn json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, &'static str> {
    serde_json::from_slice(body).map_err(|_| "payload is not the expected JSON")
}

/// GitHub, Gitea and GitLab push payloads agree on these two fields.
#[derive(Deserialize)]
struct PushPayload {
    r#ref: String,
    after: String,
}

#[derive(Deserialize)]
struct PullRequestPayload {
    action: String,
    #[serde(default)]
    number: Option<u64>,
    pull_request: PullRequest,
}

#[derive(Deserialize)]
struct PullRequest {
    #[serde(default)]
    number: Option<u64>,
    head: GitRef,
    base: GitRef,
    #[serde(default)]
    merged: Option<bool>,
}

#[derive(Deserialize)]
struct GitRef {
    r#ref: String,
    sha: String,
}

#[derive(Deserialize)]
struct MergeRequestPayload {
    object_attributes: MergeRequest,
}

#[derive(Deserialize)]
struct MergeRequest {
    iid: u64,
    #[serde(default)]
    action: Option<String>,
    source_branch: String,
    target_branch: String,
    state: String,
    last_commit: Commit,
}

#[derive(Deserialize)]
struct Commit {
    id: String,
}

enum Head {
    /// The head without its blank line, and whatever body bytes came with it.
    Complete {
        head: Vec<u8>,
        rest: Vec<u8>,
    },
    TooLarge,
}

/// Reads up to the blank line that ends the request head (CRLF or bare LF).
async fn read_head(stream: &mut TcpStream) -> io::Result<Head> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = head_end(&buf) {
            if end > MAX_HEAD {
                return Ok(Head::TooLarge);
            }
            let rest = buf.split_off(end);
            return Ok(Head::Complete { head: buf, rest });
        }
        if buf.len() >= MAX_HEAD {
            return Ok(Head::TooLarge);
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

/// Reads until `body` holds `length` bytes.
async fn read_body(stream: &mut TcpStream, body: &mut Vec<u8>, length: usize) -> io::Result<()> {
    body.reserve_exact(length - body.len());
    let mut chunk = [0u8; 16 * 1024];
    while body.len() < length {
        let want = (length - body.len()).min(chunk.len());
        let n = stream.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

struct Request<'a> {
    method: &'a str,
    target: &'a str,
    /// Header names as sent; looked up case-insensitively.
    headers: Vec<(&'a str, &'a str)>,
}

enum Length {
    Missing,
    Invalid,
    Bytes(usize),
}

impl<'a> Request<'a> {
    /// The first value of a header, trimmed.
    fn header(&self, name: &str) -> Option<&'a str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| *v)
    }

    /// `Content-Length`, which must be digits and agree with any repeats.
    fn content_length(&self) -> Length {
        let mut values = self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case("content-length"));
        let Some((_, first)) = values.next() else { return Length::Missing };
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) || values.any(|(_, v)| v != first) {
            return Length::Invalid;
        }
        // Too many digits for usize is certainly over the limit.
        Length::Bytes(first.parse().unwrap_or(usize::MAX))
    }
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
        && target.starts_with('/')
        && matches!(version, "HTTP/1.0" | "HTTP/1.1");
    if !well_formed {
        return None;
    }
    let mut headers = Vec::new();
    for line in lines.take_while(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':')?;
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return None;
        }
        headers.push((name, value.trim()));
    }
    Some(Request { method, target, headers })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    }
}

/// A complete short answer with a plain-text body.
async fn send(stream: &mut TcpStream, status: u16, body: &str) -> io::Result<()> {
    send_with(stream, status, &[], body).await
}

async fn send_405(stream: &mut TcpStream, allow: &str) -> io::Result<()> {
    send_with(stream, 405, &[("Allow", allow)], "Method Not Allowed\n").await
}

async fn send_with(
    stream: &mut TcpStream,
    status: u16,
    headers: &[(&str, &str)],
    body: &str,
) -> io::Result<()> {
    let mut response = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n",
        reason(status),
        body.len()
    );
    for (name, value) in headers {
        response.push_str(&format!("{name}: {value}\r\n"));
    }
    response.push_str("Connection: close\r\n\r\n");
    response.push_str(body);
    tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(response.as_bytes()))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "client stopped reading"))?
}

/// Sends FIN, then drains what the client still sends for a moment: closing
/// with unread input makes the kernel send RST, which can destroy an answer
/// the client has not read yet (a 413 to a body still on its way).
async fn close(mut stream: TcpStream) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async {
        while let Ok(n) = stream.read(&mut sink).await
            && n > 0
        {}
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "s3cret-for-tests";

    fn config() -> WebhookConfig {
        WebhookConfig {
            github_secret: Some(SECRET.to_owned()),
            gitea_secret: Some(SECRET.to_owned()),
            gitlab_token: Some("gl-token-123".to_owned()),
        }
    }

    async fn start_with(
        config: WebhookConfig,
        capacity: usize,
    ) -> (WebhookServer, mpsc::Receiver<WebhookEvent>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = mpsc::channel(capacity);
        (WebhookServer::start(listener, config, tx).await.unwrap(), rx)
    }

    fn sign(secret: &str, body: &[u8]) -> String {
        let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(body);
        mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Sends `raw` as is and returns the status code of the answer.
    async fn exchange(addr: SocketAddr, raw: &[u8]) -> u16 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(raw).await.unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.unwrap();
        let text = String::from_utf8_lossy(&reply);
        let status_line = text.lines().next().unwrap_or_default().to_owned();
        assert!(status_line.starts_with("HTTP/1.1 "), "no status line in {text:?}");
        status_line[9..12].parse().unwrap()
    }

    async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> u16 {
        let mut raw =
            format!("POST {path} HTTP/1.1\r\nHost: vmmigrate\r\nContent-Length: {}\r\n", body.len());
        for (name, value) in headers {
            raw.push_str(&format!("{name}: {value}\r\n"));
        }
        raw.push_str("\r\n");
        let mut raw = raw.into_bytes();
        raw.extend_from_slice(body);
        exchange(addr, &raw).await
    }

    async fn next_event(rx: &mut mpsc::Receiver<WebhookEvent>) -> WebhookEvent {
        tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("no event in 5 s").unwrap()
    }

    fn count(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    const GITHUB_PUSH: &str = r#"{"ref":"refs/heads/main","before":"1111111111111111111111111111111111111111","after":"2222222222222222222222222222222222222222","repository":{"full_name":"platform/migrations"},"pusher":{"name":"alice"}}"#;

    #[tokio::test]
    async fn signed_github_push_is_accepted_and_delivered() {
        let (server, mut rx) = start_with(config(), 8).await;
        let signature = format!("sha256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));
        let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", signature.as_str())];

        let status = post(server.local_addr(), "/hooks/github", &headers, GITHUB_PUSH.as_bytes()).await;

        assert_eq!(status, 202);
        let expected = WebhookEvent::Push {
            forge: Forge::GitHub,
            branch: "main".to_owned(),
            after: "2222222222222222222222222222222222222222".to_owned(),
        };
        assert_eq!(next_event(&mut rx).await, expected);
        assert_eq!(count(&server.stats().accepted), 1);
    }

    #[tokio::test]
    async fn wrong_signature_is_401_and_nothing_is_delivered() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let wrong_secret = format!("sha256={}", sign("another secret", GITHUB_PUSH.as_bytes()));
        let other_body = format!("sha256={}", sign(SECRET, b"{}"));
        let uppercase_prefix = format!("SHA256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));

        for signature in
            [wrong_secret.as_str(), other_body.as_str(), uppercase_prefix.as_str(), "sha256=", "x"]
        {
            let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", signature)];
            assert_eq!(
                post(addr, "/hooks/github", &headers, GITHUB_PUSH.as_bytes()).await,
                401,
                "{signature}"
            );
        }
        // A Gitea delivery with one good and one bad signature is not authentic either.
        let good = sign(SECRET, GITHUB_PUSH.as_bytes());
        let headers = [
            ("X-Gitea-Event", "push"),
            ("X-Gitea-Signature", good.as_str()),
            ("X-Hub-Signature-256", "sha256=00"),
        ];
        assert_eq!(post(addr, "/hooks/gitea", &headers, GITHUB_PUSH.as_bytes()).await, 401);

        let stats = server.stats();
        assert_eq!(count(&stats.rejected_signature), 6);
        assert_eq!(count(&stats.accepted), 0);
        assert!(rx.try_recv().is_err(), "an unauthenticated event reached the channel");
    }

    #[tokio::test]
    async fn missing_signature_is_401_even_for_an_unparseable_body() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();

        assert_eq!(
            post(addr, "/hooks/github", &[("X-GitHub-Event", "push")], GITHUB_PUSH.as_bytes()).await,
            401
        );
        assert_eq!(
            post(addr, "/hooks/gitea", &[("X-Gitea-Event", "push")], GITHUB_PUSH.as_bytes()).await,
            401
        );
        assert_eq!(
            post(addr, "/hooks/gitlab", &[("X-Gitlab-Event", "Push Hook")], GITHUB_PUSH.as_bytes()).await,
            401
        );
        // Verification comes before parsing: garbage without a signature is 401, not 400.
        assert_eq!(post(addr, "/hooks/github", &[("X-GitHub-Event", "push")], b"not json").await, 401);

        assert_eq!(count(&server.stats().rejected_signature), 4);
        assert_eq!(count(&server.stats().malformed), 0);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_forge_without_a_secret_has_no_route() {
        let config = WebhookConfig { github_secret: Some(SECRET.to_owned()), ..WebhookConfig::default() };
        let (server, mut rx) = start_with(config, 8).await;
        let addr = server.local_addr();
        let signature = sign(SECRET, GITHUB_PUSH.as_bytes());

        let headers = [("X-Gitea-Event", "push"), ("X-Gitea-Signature", signature.as_str())];
        assert_eq!(post(addr, "/hooks/gitea", &headers, GITHUB_PUSH.as_bytes()).await, 404);
        assert_eq!(
            post(addr, "/hooks/gitlab", &[("X-Gitlab-Event", "Push Hook")], GITHUB_PUSH.as_bytes()).await,
            404
        );
        assert_eq!(post(addr, "/hooks/bitbucket", &[], b"{}").await, 404);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn gitlab_token_is_checked_and_merge_requests_are_parsed() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let body = br#"{"object_kind":"merge_request","user":{"username":"bob"},"object_attributes":{"iid":42,"id":9001,"action":"merge","state":"merged","source_branch":"migrate-web-01","target_branch":"main","last_commit":{"id":"3333333333333333333333333333333333333333","message":"Migrate web-01"}}}"#;

        for token in ["gl-token-12", "gl-token-1234", "GL-TOKEN-123", ""] {
            let headers = [("X-Gitlab-Event", "Merge Request Hook"), ("X-Gitlab-Token", token)];
            assert_eq!(post(addr, "/hooks/gitlab", &headers, body).await, 401, "{token:?}");
        }
        assert!(rx.try_recv().is_err());

        let headers = [("X-Gitlab-Event", "Merge Request Hook"), ("X-Gitlab-Token", "gl-token-123")];
        assert_eq!(post(addr, "/hooks/gitlab", &headers, body).await, 202);
        let expected = WebhookEvent::PullRequest {
            forge: Forge::GitLab,
            number: 42,
            action: "merge".to_owned(),
            head_sha: "3333333333333333333333333333333333333333".to_owned(),
            head_ref: "migrate-web-01".to_owned(),
            base_ref: "main".to_owned(),
            merged: true,
        };
        assert_eq!(next_event(&mut rx).await, expected);

        let push = br#"{"object_kind":"push","ref":"refs/heads/main","before":"0","after":"4444444444444444444444444444444444444444"}"#;
        let headers = [("X-Gitlab-Event", "Push Hook"), ("X-Gitlab-Token", "gl-token-123")];
        assert_eq!(post(addr, "/hooks/gitlab", &headers, push).await, 202);
        let expected = WebhookEvent::Push {
            forge: Forge::GitLab,
            branch: "main".to_owned(),
            after: "4444444444444444444444444444444444444444".to_owned(),
        };
        assert_eq!(next_event(&mut rx).await, expected);
        assert_eq!(count(&server.stats().rejected_signature), 4);
        assert_eq!(count(&server.stats().accepted), 2);
    }

    #[tokio::test]
    async fn github_and_gitea_pull_requests_are_parsed() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let body = br#"{"action":"synchronize","number":7,"pull_request":{"number":7,"state":"open","merged":false,"head":{"ref":"migrate-db-02","sha":"5555555555555555555555555555555555555555"},"base":{"ref":"main","sha":"6666666666666666666666666666666666666666"}}}"#;
        let signature = sign(SECRET, body);
        let hub = format!("sha256={signature}");

        let headers = [("X-GitHub-Event", "pull_request"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, body).await, 202);
        // Gitea sends both headers; either alone is enough.
        let both = [
            ("X-Gitea-Event", "pull_request"),
            ("X-Gitea-Signature", signature.as_str()),
            ("X-Hub-Signature-256", hub.as_str()),
        ];
        assert_eq!(post(addr, "/hooks/gitea", &both, body).await, 202);
        let only_hub = [("X-Gitea-Event", "pull_request"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/gitea", &only_hub, body).await, 202);

        for forge in [Forge::GitHub, Forge::Gitea, Forge::Gitea] {
            let expected = WebhookEvent::PullRequest {
                forge,
                number: 7,
                action: "synchronize".to_owned(),
                head_sha: "5555555555555555555555555555555555555555".to_owned(),
                head_ref: "migrate-db-02".to_owned(),
                base_ref: "main".to_owned(),
                merged: false,
            };
            assert_eq!(next_event(&mut rx).await, expected);
        }
        let ping = br#"{"zen":"Keep it logically awesome.","hook_id":1}"#;
        let hub = format!("sha256={}", sign(SECRET, ping));
        let headers = [("X-GitHub-Event", "ping"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, ping).await, 202);
        assert_eq!(next_event(&mut rx).await, WebhookEvent::Ping { forge: Forge::GitHub });
    }

    #[tokio::test]
    async fn tag_pushes_and_other_events_are_accepted_but_ignored() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let tag = br#"{"ref":"refs/tags/v1.0.0","after":"7777777777777777777777777777777777777777"}"#;
        let hub = format!("sha256={}", sign(SECRET, tag));

        let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, tag).await, 202);
        let headers = [("X-GitHub-Event", "issues"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, tag).await, 202);
        let headers = [("X-Gitlab-Event", "Tag Push Hook"), ("X-Gitlab-Token", "gl-token-123")];
        assert_eq!(post(addr, "/hooks/gitlab", &headers, tag).await, 202);

        let stats = server.stats();
        assert_eq!((count(&stats.ignored), count(&stats.accepted)), (3, 0));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn verified_but_malformed_payloads_are_400() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        for body in [&b"not json"[..], br#"{"ref":"refs/heads/main"}"#, br#"{"ref":7,"after":"x"}"#] {
            let hub = format!("sha256={}", sign(SECRET, body));
            let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", hub.as_str())];
            assert_eq!(post(addr, "/hooks/github", &headers, body).await, 400);
        }
        // No event header at all.
        let hub = format!("sha256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));
        assert_eq!(
            post(addr, "/hooks/github", &[("X-Hub-Signature-256", hub.as_str())], GITHUB_PUSH.as_bytes())
                .await,
            400
        );
        assert_eq!(count(&server.stats().malformed), 4);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn oversized_body_is_413_without_reading_it() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let head = format!(
            "POST /hooks/github HTTP/1.1\r\nX-GitHub-Event: push\r\nX-Hub-Signature-256: sha256={}\r\nContent-Length: {}\r\n\r\n",
            "0".repeat(64),
            MAX_BODY + 1
        );
        assert_eq!(exchange(addr, head.as_bytes()).await, 413);

        // Exactly at the limit is read (and then judged on its signature).
        let body = vec![b' '; MAX_BODY];
        let hub = format!("sha256={}", sign(SECRET, &body));
        let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, &body).await, 400);

        assert_eq!(count(&server.stats().malformed), 2);
        assert_eq!(count(&server.stats().rejected_signature), 0);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn requests_without_a_usable_length_are_refused() {
        let (server, _rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let cases: [(&[u8], u16); 5] = [
            (b"POST /hooks/github HTTP/1.1\r\nX-GitHub-Event: push\r\n\r\n", 411),
            (b"POST /hooks/github HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
            (b"POST /hooks/github HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST /hooks/github HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
            (b"POST /hooks/github HTTP/9\r\n\r\n", 400),
        ];
        for (raw, status) in cases {
            assert_eq!(exchange(addr, raw).await, status, "{}", String::from_utf8_lossy(raw));
        }
        assert_eq!(exchange(addr, b"GET /hooks/github HTTP/1.1\r\n\r\n").await, 405);
        assert_eq!(count(&server.stats().malformed), 5);
    }

    #[tokio::test]
    async fn healthz_answers_without_authentication() {
        let (server, _rx) = start_with(WebhookConfig::default(), 1).await;
        assert_eq!(exchange(server.local_addr(), b"GET /healthz HTTP/1.1\r\n\r\n").await, 200);
        assert_eq!(exchange(server.local_addr(), b"POST /healthz HTTP/1.1\r\n\r\n").await, 405);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stalls_is_answered_408() {
        let (server, mut rx) = start_with(config(), 8).await;
        let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
        // Promises a body and never sends it.
        stream.write_all(b"POST /hooks/github HTTP/1.1\r\nContent-Length: 10\r\n\r\n").await.unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.unwrap();
        assert!(reply.starts_with(b"HTTP/1.1 408 "), "{}", String::from_utf8_lossy(&reply));
        assert_eq!(count(&server.stats().malformed), 1);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_full_channel_still_answers_202_and_counts_the_event_as_coalesced() {
        let (server, mut rx) = start_with(config(), 1).await;
        let addr = server.local_addr();
        let hub = format!("sha256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));
        let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", hub.as_str())];

        for _ in 0..3 {
            assert_eq!(post(addr, "/hooks/github", &headers, GITHUB_PUSH.as_bytes()).await, 202);
        }
        // The event is offered after the answer but before the FIN that ends `post`.
        let stats = server.stats();
        assert_eq!((count(&stats.accepted), count(&stats.coalesced)), (3, 2));
        assert!(matches!(next_event(&mut rx).await, WebhookEvent::Push { .. }));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn expect_100_continue_is_honoured() {
        let (server, mut rx) = start_with(config(), 8).await;
        let hub = format!("sha256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));
        let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
        let head = format!(
            "POST /hooks/github HTTP/1.1\r\nX-GitHub-Event: push\r\nX-Hub-Signature-256: {hub}\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            GITHUB_PUSH.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut interim = [0u8; 25];
        stream.read_exact(&mut interim).await.unwrap();
        assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        stream.write_all(GITHUB_PUSH.as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.unwrap();
        assert!(reply.starts_with(b"HTTP/1.1 202 "), "{}", String::from_utf8_lossy(&reply));
        assert!(matches!(next_event(&mut rx).await, WebhookEvent::Push { .. }));
    }

    #[test]
    fn hmac_sha256_matches_rfc_4231_vectors() {
        // RFC 4231 §4.2 (test case 1), §4.3 (test case 2) and §4.7 (test case 6).
        let cases: [(&[u8], &[u8], &str); 3] = [
            (&[0x0b; 20], b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
            (
                b"Jefe",
                b"what do ya want for nothing?",
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First",
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
        ];
        for (key, data, mac) in cases {
            assert!(verify_hub_signature(key, data, &format!("sha256={mac}")));
            assert!(verify_hub_signature(key, data, &format!("sha256={}", mac.to_uppercase())));
            assert!(!verify_hub_signature(key, b"something else", &format!("sha256={mac}")));
            assert!(!verify_hub_signature(key, data, mac), "the sha256= prefix is required");
        }
    }

    #[test]
    fn github_documented_example_verifies() {
        // https://docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries
        let header = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert!(verify_hub_signature(b"It's a Secret to Everybody", b"Hello, World!", header));
        assert!(!verify_hub_signature(b"It's a Secret to Everybody", b"Hello, World?", header));
        assert!(!verify_hub_signature(b"It's a secret to everybody", b"Hello, World!", header));
        assert!(!verify_hub_signature(b"It's a Secret to Everybody", b"Hello, World!", &header[..70]));
    }

    #[test]
    fn gitlab_tokens_compare_whole() {
        assert!(token_matches("abc", "abc"));
        for other in ["ab", "abcd", "abd", "", "ABC"] {
            assert!(!token_matches("abc", other), "{other}");
        }
    }

    #[test]
    fn debug_output_redacts_secrets() {
        let shown = format!("{:?}", config());
        assert!(!shown.contains(SECRET) && !shown.contains("gl-token"), "{shown}");
    }
}
