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
//! Served by `crate::server` (hyper's HTTP/1.1 under a connection cap and
//! header, request and connection deadlines). Everything that can be judged
//! from the head is judged before a byte of body is read: route, method,
//! `Content-Length` (at most [`MAX_BODY`]), and that the signature or token is
//! present and well formed (GitLab's token is compared right there). The body
//! is then read into a budget shared by all requests ([`BODY_BUDGET`] bytes at
//! once; beyond it `503`, which the forges redeliver) with the HMAC computed
//! on the chunks as they arrive, and nothing is parsed before it verifies.
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
//! request took longer than its deadline, `411` no `Content-Length` (chunked
//! bodies are not supported; no forge sends them), `413` body over
//! [`MAX_BODY`], `431` request head over 16 KiB, `503` the body budget is
//! spent by other requests. A connection over the cap is closed unanswered.

use crate::server::{self, BodyRefused, Server, ServerLimits, ServerStats};
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde::Deserialize;
use sha2::Sha256;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::debug;

type HmacSha256 = Hmac<Sha256>;

/// Largest body accepted. GitHub caps payloads at 25 MB but a push touching
/// `migrations/` is a few KiB; anything this large is not for us.
pub(crate) const MAX_BODY: usize = 5 * 1024 * 1024;
/// Bytes of request bodies held at once, over all connections: three bodies
/// at [`MAX_BODY`], or thousands of real deliveries.
pub(crate) const BODY_BUDGET: usize = 16 * 1024 * 1024;

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

impl WebhookConfig {
    /// Refuses an empty (or all-blank) secret: an HMAC under an empty key is
    /// one anybody can compute, so it would open the route to everyone.
    /// `flags` names each secret the way the user set it.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let secrets = [
            (&self.github_secret, "--github-webhook-secret (VMMIGRATE_GITHUB_WEBHOOK_SECRET)"),
            (&self.gitea_secret, "--gitea-webhook-secret (VMMIGRATE_GITEA_WEBHOOK_SECRET)"),
            (&self.gitlab_token, "--gitlab-webhook-token (VMMIGRATE_GITLAB_WEBHOOK_TOKEN)"),
        ];
        for (secret, flag) in secrets {
            if secret.as_deref().is_some_and(|s| s.trim().is_empty()) {
                return Err(format!(
                    "{flag} is set but empty: an empty secret would let anyone sign deliveries; \
                     set a real secret or leave it unset to turn that forge's route off"
                ));
            }
        }
        Ok(())
    }

    fn configured(&self, forge: Forge) -> bool {
        match forge {
            Forge::GitHub => self.github_secret.is_some(),
            Forge::Gitea => self.gitea_secret.is_some(),
            Forge::GitLab => self.gitlab_token.is_some(),
        }
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
    /// Malformed requests: missing or chunked length, oversized body, a body
    /// cut short, undecodable payload, missing event header. (Heads hyper
    /// cannot parse are answered 400 by hyper and not counted here.)
    pub malformed: AtomicU64,
    /// Verified deliveries we do not act on: tag pushes, other event kinds.
    pub ignored: AtomicU64,
    /// Accepted events dropped because the channel was full; the events
    /// already queued (and the poll loop) cover them.
    pub coalesced: AtomicU64,
    /// Bodies refused with 503 because [`BODY_BUDGET`] was held by others.
    pub busy: AtomicU64,
}

/// A running webhook receiver. Dropping it stops the server and every open
/// connection.
pub(crate) struct WebhookServer {
    server: Server,
    stats: Arc<WebhookStats>,
}

impl WebhookServer {
    /// Serves the webhook routes on `listener`, sending verified events to
    /// `events`. Refuses a configuration with an empty secret.
    pub(crate) async fn start(
        listener: TcpListener,
        config: WebhookConfig,
        events: mpsc::Sender<WebhookEvent>,
    ) -> io::Result<WebhookServer> {
        Self::start_with_limits(listener, config, events, ServerLimits::default())
    }

    pub(crate) fn start_with_limits(
        listener: TcpListener,
        config: WebhookConfig,
        events: mpsc::Sender<WebhookEvent>,
        limits: ServerLimits,
    ) -> io::Result<WebhookServer> {
        config.validate().map_err(|why| io::Error::new(io::ErrorKind::InvalidInput, why))?;
        let stats = Arc::new(WebhookStats::default());
        let shared = Arc::new(Shared {
            config,
            events,
            stats: stats.clone(),
            budget: Arc::new(Semaphore::new(BODY_BUDGET)),
        });
        let server = Server::start(listener, limits, None, "webhook", move |request| {
            let shared = shared.clone();
            async move { handle(request, &shared).await }
        })?;
        Ok(WebhookServer { server, stats })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub(crate) fn stats(&self) -> Arc<WebhookStats> {
        self.stats.clone()
    }

    /// Connection-level counters: refused over the cap, timed out.
    #[allow(dead_code)] // read by tests and the load benchmark
    pub(crate) fn connection_stats(&self) -> Arc<ServerStats> {
        self.server.stats()
    }
}

/// The 32 bytes of a GitHub-style `X-Hub-Signature-256` value
/// (`sha256=<64 hex>`, the prefix in lower case as GitHub sends it).
fn hub_signature(value: &str) -> Option<[u8; 32]> {
    unhex(value.trim().strip_prefix("sha256=")?)
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
fn unhex(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim().as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks(2)) {
        let digits = std::str::from_utf8(pair).ok()?;
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        *byte = u8::from_str_radix(digits, 16).ok()?;
    }
    Some(out)
}

struct Shared {
    config: WebhookConfig,
    events: mpsc::Sender<WebhookEvent>,
    stats: Arc<WebhookStats>,
    /// One permit per body byte held (see [`BODY_BUDGET`]).
    budget: Arc<Semaphore>,
}

/// Judges one request and, for an accepted event, offers it to the channel
/// before answering 202.
async fn handle(request: Request<Incoming>, shared: &Shared) -> Response<server::Body> {
    let stats = &shared.stats;
    let malformed = |status: StatusCode| {
        stats.malformed.fetch_add(1, Ordering::Relaxed);
        refused(status)
    };
    let forge = match request.uri().path() {
        "/healthz" if request.method() == Method::GET => return server::text(StatusCode::OK, "ok\n"),
        "/healthz" => return method_not_allowed("GET"),
        "/hooks/github" => Forge::GitHub,
        "/hooks/gitea" => Forge::Gitea,
        "/hooks/gitlab" => Forge::GitLab,
        _ => return refused(StatusCode::NOT_FOUND),
    };
    if !shared.config.configured(forge) {
        debug!(?forge, "no secret configured for this forge: route disabled");
        return refused(StatusCode::NOT_FOUND);
    }
    if request.method() != Method::POST {
        return method_not_allowed("POST");
    }
    if let Err(why) = server::declared_length(&request, MAX_BODY) {
        return malformed(why.status());
    }
    // Everything the head can tell, before the body is read.
    let Some(check) = Check::from_head(forge, &shared.config, request.headers()) else {
        stats.rejected_signature.fetch_add(1, Ordering::Relaxed);
        debug!(?forge, "missing, malformed or wrong signature or token");
        return refused(StatusCode::UNAUTHORIZED);
    };
    let headers = request.headers().clone();
    let mut check = check;
    let (body, _held): (Vec<u8>, OwnedSemaphorePermit) =
        match server::read_limited(request, MAX_BODY, &shared.budget, |chunk| check.update(chunk)).await {
            Ok(read) => read,
            Err(BodyRefused::Busy) => {
                stats.busy.fetch_add(1, Ordering::Relaxed);
                return refused(StatusCode::SERVICE_UNAVAILABLE);
            }
            Err(why) => return malformed(why.status()),
        };
    if !check.verifies() {
        stats.rejected_signature.fetch_add(1, Ordering::Relaxed);
        debug!(?forge, "wrong signature");
        return refused(StatusCode::UNAUTHORIZED);
    }
    match parse_event(forge, &headers, &body) {
        Ok(Some(event)) => {
            stats.accepted.fetch_add(1, Ordering::Relaxed);
            match shared.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    stats.coalesced.fetch_add(1, Ordering::Relaxed);
                    debug!(?event, "event channel full; coalesced with the queued ones");
                }
                Err(TrySendError::Closed(_)) => debug!("event channel closed; shutting down"),
            }
            server::text(StatusCode::ACCEPTED, "accepted\n")
        }
        Ok(None) => {
            stats.ignored.fetch_add(1, Ordering::Relaxed);
            server::text(StatusCode::ACCEPTED, "accepted\n")
        }
        Err(why) => {
            debug!(?forge, why, "verified delivery could not be parsed");
            malformed(StatusCode::BAD_REQUEST)
        }
    }
}

fn refused(status: StatusCode) -> Response<server::Body> {
    server::text(status, format!("{}\n", status.canonical_reason().unwrap_or("refused")))
}

fn method_not_allowed(allow: &'static str) -> Response<server::Body> {
    let mut response = refused(StatusCode::METHOD_NOT_ALLOWED);
    response.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    response
}

/// The first value of a header, trimmed; `None` when absent or not text.
fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// The authentication of one delivery, started from its head and finished
/// on its body.
enum Check {
    /// GitLab's token matched; the body needs nothing more.
    Token,
    /// An HMAC-SHA256 of the body under the forge's secret, to equal every
    /// one of the signatures the head carried (Gitea may send two).
    Hmac { mac: Box<HmacSha256>, expected: Vec<[u8; 32]> },
}

impl Check {
    /// `None` when the head alone already fails: no signature, a malformed
    /// one, or a wrong GitLab token. Only called for configured forges.
    fn from_head(forge: Forge, config: &WebhookConfig, headers: &HeaderMap) -> Option<Check> {
        let hub = || header_str(headers, "x-hub-signature-256").map(hub_signature);
        let (secret, expected) = match forge {
            Forge::GitLab => {
                let expected = config.gitlab_token.as_deref()?;
                let presented = header_str(headers, "x-gitlab-token")?;
                return token_matches(expected, presented).then_some(Check::Token);
            }
            Forge::GitHub => (config.github_secret.as_deref()?, vec![hub()??]),
            Forge::Gitea => {
                // Gitea sends both; every one present must verify, and one must be present.
                let mut expected = Vec::new();
                if let Some(hex) = header_str(headers, "x-gitea-signature") {
                    expected.push(unhex(hex)?);
                }
                if let Some(signature) = hub() {
                    expected.push(signature?);
                }
                if expected.is_empty() {
                    return None;
                }
                (config.gitea_secret.as_deref()?, expected)
            }
        };
        Check::hmac(secret.as_bytes(), expected)
    }

    fn hmac(secret: &[u8], expected: Vec<[u8; 32]>) -> Option<Check> {
        let mac = HmacSha256::new_from_slice(secret).ok()?;
        Some(Check::Hmac { mac: Box::new(mac), expected })
    }

    fn update(&mut self, chunk: &[u8]) {
        if let Check::Hmac { mac, .. } = self {
            mac.update(chunk);
        }
    }

    /// Constant-time comparison of the finished MAC with each signature.
    fn verifies(self) -> bool {
        match self {
            Check::Token => true,
            Check::Hmac { mac, expected } => {
                expected.iter().all(|signature| (*mac).clone().verify_slice(signature).is_ok())
            }
        }
    }
}

/// The event a verified delivery describes; `Ok(None)` for a delivery we do
/// not act on (a tag push, another kind of event); `Err` for a malformed one.
fn parse_event(forge: Forge, headers: &HeaderMap, body: &[u8]) -> Result<Option<WebhookEvent>, &'static str> {
    let kind_header = match forge {
        Forge::GitHub => "x-github-event",
        Forge::Gitea => "x-gitea-event",
        Forge::GitLab => "x-gitlab-event",
    };
    let kind = header_str(headers, kind_header).ok_or("no event header")?;
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

/// What the fuzz target drives (`tools/fuzz/fuzz_targets/webhook.rs`): a delivery
/// judged from its head and body the way [`handle`] judges it once the route,
/// method and length passed. Returns whether it would be accepted.
pub(crate) fn judge_delivery(forge: Forge, config: &WebhookConfig, headers: &HeaderMap, body: &[u8]) -> bool {
    let Some(mut check) = Check::from_head(forge, config, headers) else { return false };
    // Fed in two pieces, as a body arrives in chunks.
    let (first, rest) = body.split_at(body.len() / 2);
    check.update(first);
    check.update(rest);
    check.verifies() && parse_event(forge, headers, body).is_ok()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const SECRET: &str = "s3cret-for-tests";

    /// The production check, fed one `X-Hub-Signature-256` value and a body.
    fn verify_hub_signature(secret: &[u8], body: &[u8], header: &str) -> bool {
        let Some(expected) = hub_signature(header) else { return false };
        let mut check = Check::hmac(secret, vec![expected]).unwrap();
        check.update(body);
        check.verifies()
    }

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
        // The two 411s are ours; hyper answers the unparseable heads itself.
        assert_eq!(count(&server.stats().malformed), 2);
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
        // A well-formed signature promises a body that never comes.
        let head = format!(
            "POST /hooks/github HTTP/1.1\r\nX-Hub-Signature-256: sha256={}\r\nContent-Length: 10\r\n\r\n",
            "0".repeat(64)
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.unwrap();
        assert!(reply.starts_with(b"HTTP/1.1 408 "), "{}", String::from_utf8_lossy(&reply));
        assert_eq!(count(&server.connection_stats().timed_out), 1);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_that_never_ends_is_cut_off_at_the_header_timeout() {
        let (server, _rx) = start_with(config(), 8).await;
        let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
        stream.write_all(b"POST /hooks/github HTTP/1.1\r\nX-GitHub-Event: pu").await.unwrap();
        let started = tokio::time::Instant::now();
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply).await;
        let waited = started.elapsed();
        assert!(waited >= ServerLimits::default().header_timeout, "closed after {waited:?}");
        assert!(waited < ServerLimits::default().request_timeout, "closed after {waited:?}");
        let text = String::from_utf8_lossy(&reply);
        assert!(reply.is_empty() || text.starts_with("HTTP/1.1 408 "), "{text}");
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

    #[tokio::test]
    async fn an_empty_secret_is_refused_at_start_up_naming_its_flag() {
        for (config, flag) in [
            (WebhookConfig { github_secret: Some(String::new()), ..config() }, "--github-webhook-secret"),
            (WebhookConfig { gitea_secret: Some("  ".into()), ..config() }, "--gitea-webhook-secret"),
            (WebhookConfig { gitlab_token: Some(String::new()), ..config() }, "--gitlab-webhook-token"),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let (tx, _rx) = mpsc::channel(1);
            let error = WebhookServer::start(listener, config, tx).await.err().expect("refused");
            assert!(error.to_string().contains(flag), "{error}");
        }
    }

    /// Opens a connection and sends only a head that promises `length` bytes.
    async fn promise_body(addr: SocketAddr, headers: &str, length: usize) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let head = format!("POST /hooks/github HTTP/1.1\r\nContent-Length: {length}\r\n{headers}\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        stream
    }

    async fn status_of(mut stream: TcpStream) -> u16 {
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut reply))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        let text = String::from_utf8_lossy(&reply);
        assert!(text.starts_with("HTTP/1.1 "), "{text:?}");
        text[9..12].parse().unwrap()
    }

    #[tokio::test]
    async fn an_unsigned_or_malformed_signature_is_refused_before_the_body_is_read() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        // Each promises a body it never sends: only an answer from the head
        // alone can come back (reading the body would wait for the 408).
        for headers in [
            "X-GitHub-Event: push\r\n",
            "X-GitHub-Event: push\r\nX-Hub-Signature-256: sha256=abc\r\n",
            "X-GitHub-Event: push\r\nX-Hub-Signature-256: 00000000000000000000000000000000000000000000000000000000000000zz\r\n",
        ] {
            let stream = promise_body(addr, headers, 4096).await;
            assert_eq!(status_of(stream).await, 401, "{headers}");
        }
        // GitLab's token is judged from the head too.
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"POST /hooks/gitlab HTTP/1.1\r\nX-Gitlab-Event: Push Hook\r\nX-Gitlab-Token: nope\r\nContent-Length: 4096\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(status_of(stream).await, 401);
        assert_eq!(count(&server.stats().rejected_signature), 4);
        assert_eq!(count(&server.connection_stats().timed_out), 0);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn bodies_beyond_the_shared_budget_are_503_while_others_are_held() {
        let (server, mut rx) = start_with(config(), 8).await;
        let addr = server.local_addr();
        let hub = format!("sha256={}", sign(SECRET, b"{}"));
        let signed = format!("X-GitHub-Event: push\r\nX-Hub-Signature-256: {hub}\r\n");
        // Three well-signed heads promise MAX_BODY each and send nothing:
        // together they hold the whole budget (BODY_BUDGET is 3.2 × MAX_BODY).
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(promise_body(addr, &signed, MAX_BODY).await);
        }
        // Wait until the server has taken all three into the budget.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let stream = promise_body(addr, &signed, MAX_BODY).await;
            if status_of(stream).await == 503 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the budget never filled");
        }
        assert!(count(&server.stats().busy) >= 1);
        // A small delivery still fits in what is left.
        let hub = format!("sha256={}", sign(SECRET, GITHUB_PUSH.as_bytes()));
        let headers = [("X-GitHub-Event", "push"), ("X-Hub-Signature-256", hub.as_str())];
        assert_eq!(post(addr, "/hooks/github", &headers, GITHUB_PUSH.as_bytes()).await, 202);
        assert!(matches!(next_event(&mut rx).await, WebhookEvent::Push { .. }));
        drop(held);
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_unanswered_and_counted() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (tx, _rx) = mpsc::channel(8);
        let limits = ServerLimits { max_connections: 2, ..ServerLimits::default() };
        let server = WebhookServer::start_with_limits(listener, config(), tx, limits).unwrap();
        let addr = server.local_addr();
        let _idle = [TcpStream::connect(addr).await.unwrap(), TcpStream::connect(addr).await.unwrap()];
        let mut third = TcpStream::connect(addr).await.unwrap();
        let _ = third.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await;
        let mut reply = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut reply)).await.unwrap();
        assert!(reply.is_empty(), "{}", String::from_utf8_lossy(&reply));
        assert_eq!(count(&server.connection_stats().refused_connections), 1);
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
