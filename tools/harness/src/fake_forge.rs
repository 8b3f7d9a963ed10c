//! Stands in for the GitHub REST API v3 and the Gitea REST API v1: only the
//! subset vmmigrate's forge clients use (open pull requests, one pull request,
//! its changed files, issue comments listed/created/edited, commit statuses,
//! the authenticated user). Neither forge can run here, so this is a real
//! HTTP/1.1 server on 127.0.0.1, hand-written on tokio's `TcpListener`, one
//! request per connection (`Connection: close`), with in-memory state the
//! test seeds and inspects and every call recorded.
//!
//! GitHub is served under `/`, Gitea under `/api/v1`, each with its own
//! rules, as the real ones have them:
//! - authentication: `Authorization: Bearer <token>` (GitHub) or
//!   `Authorization: token <token>` (Gitea), else 401; GitHub also answers
//!   403 without a `User-Agent`;
//! - pagination: GitHub `per_page` (default 30, at most 100) and `page` with
//!   a `Link` header carrying `rel="next"`/`rel="last"`; Gitea `limit`
//!   (default 30, at most 50) and `page` with `X-Total-Count`;
//! - GitHub's pull request list has `merged_at` but no `merged`; commit
//!   status descriptions over 140 characters and unknown states get 422.
//!
//! Differences on purpose: comment authors are whatever the test seeds
//! (created comments belong to [`BOT_LOGIN`]); an edit of another author's
//! comment is refused with 403, as both forges answer, and counted
//! ([`FakeComment::refused_edits`]) so that a test proves the client never
//! tried; and a 401 body echoes the
//! credential it was offered, as a careless proxy might, so clients'
//! redaction of the token is exercised. Real Gitea does not paginate an
//! issue's comments (it sends all of them); this one does, which is the
//! harder case for a client.
//!
//! Rate limits ([`FakeForge::rate_limit`]) are answered as the real ones
//! are: 429 with `Retry-After: <seconds>` (both forges, and GitHub's
//! secondary limit), or GitHub's primary limit, 403 "API rate limit
//! exceeded" with `x-ratelimit-remaining: 0` and `x-ratelimit-reset: <epoch
//! seconds>`. Every call is recorded with the instant it arrived, so
//! [`FakeForge::calls_inside_retry_after`] tells, from the fake's own record,
//! which calls came while a rate limit it answered was still running.

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const OWNER: &str = "acme";
pub const REPO: &str = "vm-migrations";
/// The one token the fake accepts.
pub const TOKEN: &str = "fake-forge-token-7c1e5a9d";
/// The user [`TOKEN`] belongs to; `GET /user` answers with it.
pub const BOT_LOGIN: &str = "vmmigrate-bot";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    GitHub,
    Gitea,
}

/// A pull request as seeded by the test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakePr {
    pub number: u64,
    pub head_sha: String,
    pub head_ref: String,
    pub base_ref: String,
    pub title: String,
    /// `open` or `closed`.
    pub state: String,
    pub merged: bool,
    pub files: Vec<String>,
}

impl FakePr {
    pub fn open(number: u64, head_sha: &str) -> Self {
        FakePr {
            number,
            head_sha: head_sha.into(),
            head_ref: format!("change-{number}"),
            base_ref: "main".into(),
            title: format!("Migrate batch {number}"),
            state: "open".into(),
            merged: false,
            files: Vec::new(),
        }
    }

    pub fn with_files(mut self, files: &[&str]) -> Self {
        self.files = files.iter().map(|f| f.to_string()).collect();
        self
    }

    pub fn merged(mut self) -> Self {
        self.state = "closed".into();
        self.merged = true;
        self
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeComment {
    pub id: u64,
    pub issue: u64,
    pub author: String,
    pub body: String,
    /// How many times a PATCH changed it.
    pub edits: u32,
    /// How many PATCHes of it were refused (403: not its author).
    pub refused_edits: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeStatus {
    pub sha: String,
    pub context: String,
    pub state: String,
    pub description: String,
    pub target_url: Option<String>,
}

/// One request as the fake saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub dialect: Dialect,
    pub method: String,
    /// Path and query after the dialect's prefix, e.g. `/repos/acme/vm-migrations/pulls?state=open&page=2`.
    pub path: String,
    /// Whether an `Authorization` header was sent at all.
    pub has_auth: bool,
    /// Whether it was the right one for the dialect.
    pub authorized: bool,
    /// Request headers (lower-case names) without `Authorization`.
    pub headers: BTreeMap<String, String>,
    /// When the request arrived (its head and body read).
    pub at: Instant,
}

/// How a rate-limited answer says when to come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitForm {
    /// 429 with `Retry-After: <seconds>`.
    RetryAfter,
    /// GitHub's primary limit: 403 "API rate limit exceeded" with
    /// `x-ratelimit-remaining: 0` and `x-ratelimit-reset: <epoch seconds>`.
    GitHubReset,
}

/// A run of rate-limited answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// The run starts with the first call whose `METHOD path` (as in
    /// [`Call`]) starts with this; empty: with the next call.
    pub from: String,
    /// How many calls in a row it answers, the one that starts it included.
    pub calls: usize,
    /// What each answer asks for; whole seconds (both headers count in seconds).
    pub wait: Duration,
    pub form: LimitForm,
}

/// A rate-limited answer: when it was given and until when it asked for quiet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitAnswer {
    pub at: Instant,
    pub until: Instant,
}

#[derive(Default)]
struct State {
    prs: BTreeMap<u64, FakePr>,
    comments: Vec<FakeComment>,
    statuses: Vec<FakeStatus>,
    calls: Vec<Call>,
    next_comment_id: u64,
    /// Issues whose comments cannot be written (an outage for one pull request).
    refused_issues: std::collections::BTreeSet<u64>,
    /// `GET /user` answers 403, as GitHub does for app installation tokens.
    user_hidden: bool,
    /// The rate limit armed, and whether its first call has come.
    limit: Option<(RateLimit, bool)>,
    limit_answers: Vec<LimitAnswer>,
}

/// The running server; stops when dropped.
pub struct FakeForge {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeForge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeForge {
    pub async fn start() -> FakeForge {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the fake forge");
        let addr = listener.local_addr().expect("fake forge address");
        let state = Arc::new(Mutex::new(State { next_comment_id: 1001, ..State::default() }));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    // A broken connection is the client's problem; the test sees it there.
                    let _ = serve(stream, addr, state).await;
                });
            }
        });
        FakeForge { addr, state, task }
    }

    /// `http://127.0.0.1:<port>` for GitHub, `…/api/v1` for Gitea.
    pub fn base_url(&self, dialect: Dialect) -> String {
        match dialect {
            Dialect::GitHub => format!("http://{}", self.addr),
            Dialect::Gitea => format!("http://{}/api/v1", self.addr),
        }
    }

    pub fn add_pr(&self, pr: FakePr) {
        self.lock().prs.insert(pr.number, pr);
    }

    /// Seeds a comment by anyone; returns its id. Ids grow, so seeding order is age.
    pub fn add_comment(&self, issue: u64, author: &str, body: &str) -> u64 {
        let mut state = self.lock();
        let id = state.next_comment_id;
        state.next_comment_id += 1;
        state.comments.push(FakeComment {
            id,
            issue,
            author: author.into(),
            body: body.into(),
            edits: 0,
            refused_edits: 0,
        });
        id
    }

    /// Writes of comments on `issue` fail with 502 until [`FakeForge::accept_writes_on`].
    pub fn refuse_writes_on(&self, issue: u64) {
        self.lock().refused_issues.insert(issue);
    }

    /// `GET /user` answers 403 "Resource not accessible by integration", as
    /// GitHub does for an app installation token.
    pub fn hide_user(&self) {
        self.lock().user_hidden = true;
    }

    pub fn accept_writes_on(&self, issue: u64) {
        self.lock().refused_issues.remove(&issue);
    }

    pub fn comments(&self, issue: u64) -> Vec<FakeComment> {
        self.lock().comments.iter().filter(|c| c.issue == issue).cloned().collect()
    }

    pub fn statuses(&self, sha: &str) -> Vec<FakeStatus> {
        self.lock().statuses.iter().filter(|s| s.sha == sha).cloned().collect()
    }

    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Arms a run of rate-limited answers (replacing one still armed).
    pub fn rate_limit(&self, limit: RateLimit) {
        assert!(
            limit.calls > 0 && limit.wait.subsec_nanos() == 0,
            "whole seconds, at least one call: {limit:?}"
        );
        self.lock().limit = Some((limit, false));
    }

    /// The rate-limited answers given so far.
    pub fn limit_answers(&self) -> Vec<LimitAnswer> {
        self.lock().limit_answers.clone()
    }

    /// Calls that arrived after a rate-limited answer and before the time it
    /// asked the client to wait for.
    pub fn calls_inside_retry_after(&self) -> Vec<Call> {
        let state = self.lock();
        state
            .calls
            .iter()
            .filter(|c| state.limit_answers.iter().any(|a| a.at < c.at && c.at < a.until))
            .cloned()
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("fake forge state")
    }
}

struct Request {
    method: String,
    /// Without the query.
    path: String,
    query: Vec<(String, String)>,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Response {
    fn json(status: u16, body: Value) -> Self {
        Response { status, headers: Vec::new(), body }
    }

    fn message(status: u16, message: &str) -> Self {
        Response::json(
            status,
            json!({ "message": message, "documentation_url": "https://docs.example/rest" }),
        )
    }
}

async fn serve(mut stream: TcpStream, addr: SocketAddr, state: Arc<Mutex<State>>) -> std::io::Result<()> {
    let Some(request) = read_request(&mut stream).await? else {
        return write_response(&mut stream, Response::message(400, "Bad Request")).await;
    };
    let response = handle(request, addr, &state);
    write_response(&mut stream, response).await
}

async fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos;
        }
        if buf.len() > 64 * 1024 {
            return Ok(None);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or_default().split(' ');
    let (Some(method), Some(target)) = (request_line.next(), request_line.next()) else { return Ok(None) };
    let mut headers = BTreeMap::new();
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    let length: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect();
    Ok(Some(Request { method: method.to_owned(), path: path.to_owned(), query, headers, body }))
}

async fn write_response(stream: &mut TcpStream, response: Response) -> std::io::Result<()> {
    let body = serde_json::to_vec(&response.body).expect("serialise a JSON value");
    let mut head = format!("HTTP/1.1 {} {}\r\n", response.status, reason(response.status));
    head.push_str("Content-Type: application/json; charset=utf-8\r\n");
    head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    for (name, value) in &response.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&body).await?;
    stream.shutdown().await
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        502 => "Bad Gateway",
        _ => "Internal Server Error",
    }
}

fn handle(request: Request, addr: SocketAddr, state: &Mutex<State>) -> Response {
    let (dialect, path) = match request.path.strip_prefix("/api/v1") {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => (Dialect::Gitea, rest.to_owned()),
        _ => (Dialect::GitHub, request.path.clone()),
    };
    let offered = request.headers.get("authorization").cloned();
    let expected = match dialect {
        Dialect::GitHub => format!("Bearer {TOKEN}"),
        Dialect::Gitea => format!("token {TOKEN}"),
    };
    let authorized = offered.as_deref() == Some(expected.as_str());
    let mut headers = request.headers.clone();
    headers.remove("authorization");
    let query_text = request.query.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&");
    let recorded = if query_text.is_empty() { path.clone() } else { format!("{path}?{query_text}") };
    let at = Instant::now();
    let mut state = state.lock().expect("fake forge state");
    let call = format!("{} {recorded}", request.method);
    state.calls.push(Call {
        dialect,
        method: request.method.clone(),
        path: recorded,
        has_auth: offered.is_some(),
        authorized,
        headers,
        at,
    });

    if !authorized {
        let echo = offered.unwrap_or_else(|| "nothing".into());
        return Response::message(401, &format!("Bad credentials (offered: {echo})"));
    }
    if dialect == Dialect::GitHub && !request.headers.contains_key("user-agent") {
        return Response::message(
            403,
            "Request forbidden by administrative rules. Please make sure your request has a User-Agent header",
        );
    }
    if let Some(limited) = rate_limited(&mut state, &call, at) {
        return limited;
    }

    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = request.method.as_str();
    if segments == ["user"] && method == "GET" {
        if state.user_hidden {
            return Response::message(403, "Resource not accessible by integration");
        }
        return Response::json(200, json!({ "id": 1, "login": BOT_LOGIN }));
    }
    let ["repos", owner, repo, rest @ ..] = segments.as_slice() else {
        return Response::message(404, "Not Found");
    };
    if *owner != OWNER || *repo != REPO {
        return Response::message(404, "Not Found");
    }
    let page_base = format!("http://{addr}{}", request.path);
    match (method, rest) {
        ("GET", ["pulls"]) => {
            let wanted = query(&request, "state").unwrap_or("open").to_owned();
            let items = state
                .prs
                .values()
                .filter(|pr| wanted == "all" || pr.state == wanted)
                .map(|pr| pr_json(dialect, pr, true))
                .collect();
            paginate(dialect, &request, &page_base, items)
        }
        ("GET", ["pulls", number]) => match find_pr(&state, number) {
            Some(pr) => Response::json(200, pr_json(dialect, pr, false)),
            None => Response::message(404, "Not Found"),
        },
        ("GET", ["pulls", number, "files"]) => match find_pr(&state, number) {
            Some(pr) => {
                let items = pr
                    .files
                    .iter()
                    .map(|f| json!({ "filename": f, "status": "modified", "additions": 1, "deletions": 0 }))
                    .collect();
                paginate(dialect, &request, &page_base, items)
            }
            None => Response::message(404, "Not Found"),
        },
        ("GET", ["issues", number, "comments"]) => {
            let Some(issue) = find_pr(&state, number).map(|pr| pr.number) else {
                return Response::message(404, "Not Found");
            };
            let items = state.comments.iter().filter(|c| c.issue == issue).map(comment_json).collect();
            paginate(dialect, &request, &page_base, items)
        }
        ("POST", ["issues", number, "comments"]) => {
            let Some(issue) = find_pr(&state, number).map(|pr| pr.number) else {
                return Response::message(404, "Not Found");
            };
            if state.refused_issues.contains(&issue) {
                return Response::message(502, "Bad Gateway");
            }
            let Some(body) = json_field(&request, "body") else {
                return Response::message(422, "body is required");
            };
            let id = state.next_comment_id;
            state.next_comment_id += 1;
            let comment =
                FakeComment { id, issue, author: BOT_LOGIN.into(), body, edits: 0, refused_edits: 0 };
            let answer = comment_json(&comment);
            state.comments.push(comment);
            Response::json(201, answer)
        }
        ("PATCH", ["issues", "comments", id]) => {
            let Some(body) = json_field(&request, "body") else {
                return Response::message(422, "body is required");
            };
            let id: u64 = id.parse().unwrap_or(0);
            let refused = state.refused_issues.clone();
            match state.comments.iter_mut().find(|c| c.id == id) {
                Some(comment) if refused.contains(&comment.issue) => Response::message(502, "Bad Gateway"),
                // As GitHub and Gitea answer: only its author edits a comment.
                Some(comment) if comment.author != BOT_LOGIN => {
                    comment.refused_edits += 1;
                    Response::message(403, "Resource not accessible by integration")
                }
                Some(comment) => {
                    comment.body = body;
                    comment.edits += 1;
                    Response::json(200, comment_json(comment))
                }
                None => Response::message(404, "Not Found"),
            }
        }
        ("POST", ["statuses", sha]) => {
            let status: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
            let text = |key: &str| status.get(key).and_then(Value::as_str).map(str::to_owned);
            let state_word = text("state").unwrap_or_default();
            let description = text("description").unwrap_or_default();
            if !["pending", "success", "failure", "error"].contains(&state_word.as_str()) {
                return Response::message(422, "Validation Failed: state");
            }
            if description.chars().count() > 140 {
                return Response::message(
                    422,
                    "Validation Failed: description is too long (maximum is 140 characters)",
                );
            }
            let recorded = FakeStatus {
                sha: sha.to_string(),
                context: text("context").unwrap_or_else(|| "default".into()),
                state: state_word,
                description,
                target_url: text("target_url"),
            };
            let answer = json!({
                "id": state.statuses.len() + 1,
                "state": recorded.state,
                "context": recorded.context,
                "description": recorded.description,
                "target_url": recorded.target_url,
            });
            state.statuses.push(recorded);
            Response::json(201, answer)
        }
        _ => Response::message(404, "Not Found"),
    }
}

/// The rate-limited answer to `call` when the armed limit covers it; records it.
fn rate_limited(state: &mut State, call: &str, at: Instant) -> Option<Response> {
    let (limit, started) = state.limit.as_mut()?;
    if !*started && !call.starts_with(&limit.from) {
        return None;
    }
    *started = true;
    limit.calls -= 1;
    let (wait, form) = (limit.wait, limit.form);
    if limit.calls == 0 {
        state.limit = None;
    }
    let response = match form {
        LimitForm::RetryAfter => {
            state.limit_answers.push(LimitAnswer { at, until: at + wait });
            let mut response = Response::message(429, "Too Many Requests");
            response.headers.push(("Retry-After".into(), wait.as_secs().to_string()));
            response
        }
        LimitForm::GitHubReset => {
            // Epoch seconds: the reset is the first whole second at least `wait` away.
            let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).expect("after 1970");
            let reset = (now + wait).as_secs() + u64::from((now + wait).subsec_nanos() > 0);
            let until = at + (Duration::from_secs(reset) - now);
            state.limit_answers.push(LimitAnswer { at, until });
            let mut response = Response::message(
                403,
                "API rate limit exceeded for user ID 1. If you reach out to GitHub Support for help, please include the request ID.",
            );
            response.headers.push(("x-ratelimit-limit".into(), "5000".into()));
            response.headers.push(("x-ratelimit-remaining".into(), "0".into()));
            response.headers.push(("x-ratelimit-reset".into(), reset.to_string()));
            response
        }
    };
    Some(response)
}

fn query<'a>(request: &'a Request, key: &str) -> Option<&'a str> {
    request.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn find_pr<'a>(state: &'a State, number: &str) -> Option<&'a FakePr> {
    state.prs.get(&number.parse::<u64>().ok()?)
}

fn json_field(request: &Request, key: &str) -> Option<String> {
    let value: Value = serde_json::from_slice(&request.body).ok()?;
    value.get(key)?.as_str().map(str::to_owned)
}

/// One page of `items`, with the dialect's paging parameters and headers.
fn paginate(dialect: Dialect, request: &Request, page_base: &str, items: Vec<Value>) -> Response {
    let number = |key: &str| query(request, key).and_then(|v| v.parse::<usize>().ok());
    let (size, size_key) = match dialect {
        Dialect::GitHub => (number("per_page").unwrap_or(30).clamp(1, 100), "per_page"),
        Dialect::Gitea => (number("limit").unwrap_or(30).clamp(1, 50), "limit"),
    };
    let page = number("page").unwrap_or(1).max(1);
    let total = items.len();
    let pages = total.div_ceil(size).max(1);
    let start = ((page - 1) * size).min(total);
    let end = (start + size).min(total);
    let mut response = Response::json(200, Value::Array(items[start..end].to_vec()));
    match dialect {
        Dialect::GitHub => {
            let link = |to: usize| {
                let mut params: Vec<String> = request
                    .query
                    .iter()
                    .filter(|(k, _)| k != "page" && k != size_key)
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                params.push(format!("{size_key}={size}"));
                params.push(format!("page={to}"));
                format!("<{page_base}?{}>", params.join("&"))
            };
            let mut links = Vec::new();
            if page > 1 {
                links.push(format!("{}; rel=\"prev\"", link(page - 1)));
            }
            if page < pages {
                links.push(format!("{}; rel=\"next\"", link(page + 1)));
                links.push(format!("{}; rel=\"last\"", link(pages)));
            }
            if !links.is_empty() {
                response.headers.push(("Link".into(), links.join(", ")));
            }
        }
        Dialect::Gitea => response.headers.push(("X-Total-Count".into(), total.to_string())),
    }
    response
}

fn pr_json(dialect: Dialect, pr: &FakePr, in_list: bool) -> Value {
    let merged_at = pr.merged.then_some("2025-06-01T12:00:00Z");
    let mut value = json!({
        "number": pr.number,
        "title": pr.title,
        "state": pr.state,
        "head": { "ref": pr.head_ref, "sha": pr.head_sha, "label": format!("{OWNER}:{}", pr.head_ref) },
        "base": { "ref": pr.base_ref, "sha": "0000000000000000000000000000000000000000" },
        "merged_at": merged_at,
    });
    // GitHub's list omits `merged`; Gitea always sends it.
    if dialect == Dialect::Gitea || !in_list {
        value["merged"] = json!(pr.merged);
    }
    value
}

fn comment_json(comment: &FakeComment) -> Value {
    json!({
        "id": comment.id,
        "body": comment.body,
        "user": { "login": comment.author, "id": if comment.author == BOT_LOGIN { 1 } else { 2 } },
        "created_at": "2025-06-01T12:00:00Z",
    })
}
