//! GitHub and Gitea REST clients: only what the pull-request plan needs (open
//! pull requests, their changed files, one marker comment per pull request,
//! commit statuses).
//!
//! The token goes only into the `Authorization` header, marked sensitive so
//! neither reqwest's nor our `Debug` output shows it, and it is scrubbed from
//! any error text a server or proxy might echo it in. Pagination links are
//! followed only while they stay under the configured API base, so the token
//! is never sent to another host.
//!
//! A rate limit is honoured: after an answer that says when to come back
//! (`Retry-After`, or GitHub's `x-ratelimit-remaining: 0` with
//! `x-ratelimit-reset`), the client sends nothing to the forge until then and
//! refuses every call locally with a rate-limit error; the callers' next round
//! (the next poll) does the work. An absurd wait is cut to
//! [`MAX_RATE_LIMIT_WAIT`] and the cut is logged.

use async_trait::async_trait;
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderMap, HeaderName, HeaderValue, LINK};
use reqwest::{Client, Method};
use serde::Deserialize;
use serde_json::{Value, json};
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::OnceCell;

/// Every request, connect to last byte.
const TIMEOUT: Duration = Duration::from_secs(30);
/// GitHub's maximum `per_page`.
const GITHUB_PAGE_SIZE: usize = 100;
/// Gitea's default `MAX_RESPONSE_ITEMS`; a server configured lower is handled via `X-Total-Count`.
const GITEA_PAGE_SIZE: usize = 50;
/// A bound on pagination, so a server that never stops cannot keep us looping.
const MAX_PAGES: usize = 100;
/// How much of an error body goes into a [`ForgeError`].
const EXCERPT_CHARS: usize = 200;
/// GitHub rejects longer commit status descriptions.
const STATUS_DESCRIPTION_CHARS: usize = 140;
const USER_AGENT: &str = "vmmigrate";
/// The longest a rate limit keeps us quiet, whatever the forge asks: a
/// misconfigured proxy's `Retry-After: 86400` must not silence plans for a day.
pub(crate) const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(15 * 60);
/// How long to wait after a rate-limit answer that does not say (GitHub's
/// documentation: "wait for at least one minute").
const DEFAULT_RATE_LIMIT_WAIT: Duration = Duration::from_secs(60);
const REDACTED: &str = "[redacted]";

/// A pull request as vmmigrate needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullRequest {
    pub number: u64,
    pub head_sha: String,
    pub head_ref: String,
    pub base_ref: String,
    pub title: String,
    pub merged: bool,
    /// `open` or `closed`.
    pub state: String,
}

/// The state of a commit status; both forges use the same four words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitState {
    Pending,
    Success,
    Failure,
    Error,
}

impl CommitState {
    /// The value of the API's `state` field.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CommitState::Pending => "pending",
            CommitState::Success => "success",
            CommitState::Failure => "failure",
            CommitState::Error => "error",
        }
    }
}

/// A failed forge call: the HTTP status when there was an answer, and a
/// message naming the request and a short excerpt of the answer. Never
/// contains the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ForgeError {
    /// `None` when no answer came (connection, timeout) or the call was
    /// refused locally; `Some(429)` also for a call not sent because the
    /// forge's last rate limit has not passed yet.
    pub status: Option<u16>,
    pub message: String,
}

impl ForgeError {
    pub(crate) fn new(status: Option<u16>, message: impl Into<String>) -> Self {
        ForgeError { status, message: message.into() }
    }

    /// Stable reason for conditions, Events and metric labels.
    pub fn reason(&self) -> &'static str {
        match self.status {
            None => "ForgeUnreachable",
            Some(401) => "ForgeUnauthorized",
            Some(403) if self.is_rate_limit() => "ForgeRateLimited",
            Some(403) => "ForgeForbidden",
            Some(404) => "ForgeNotFound",
            Some(422) => "ForgeRejected",
            Some(429) => "ForgeRateLimited",
            Some(500..=599) => "ForgeServerError",
            Some(200..=299) => "ForgeUnexpectedResponse",
            Some(_) => "ForgeRequestFailed",
        }
    }

    /// Whether trying again later can succeed without anyone changing anything
    /// (a bad token, a missing repository or a rejected body need a human).
    pub fn retryable(&self) -> bool {
        match self.status {
            None | Some(408 | 429 | 500..=599 | 200..=299) => true,
            Some(403) => self.is_rate_limit(),
            Some(_) => false,
        }
    }

    /// GitHub answers an exhausted (secondary) rate limit with 403 and says so in the body.
    fn is_rate_limit(&self) -> bool {
        self.message.to_ascii_lowercase().contains("rate limit")
    }

    fn http(what: &str, status: u16, body: &str, token: &str) -> Self {
        let message = format!("{what}: HTTP {status}: {}", excerpt(body));
        ForgeError::new(Some(status), redact(&message, token))
    }

    fn transport(what: &str, err: &reqwest::Error, token: &str) -> Self {
        // The URL is already in `what`; reqwest's own text would repeat it.
        let mut message = format!("{what}: {}", transport_text(err));
        if err.is_timeout() {
            message = format!("{what}: no answer within {} s", TIMEOUT.as_secs());
        }
        ForgeError::new(None, redact(&message, token))
    }

    fn decode(what: &str, status: u16, detail: impl fmt::Display, token: &str) -> Self {
        let message = format!("{what}: HTTP {status} with an unexpected body: {detail}");
        ForgeError::new(Some(status), redact(&message, token))
    }
}

/// reqwest's message without the URL (the caller names the request), plus
/// the innermost cause ("connection refused", "invalid peer certificate").
fn transport_text(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    if let Some(url) = err.url() {
        text = text.replace(&format!(" for url ({url})"), "");
    }
    let mut source = std::error::Error::source(err);
    let mut innermost = None;
    while let Some(s) = source {
        innermost = Some(s.to_string());
        source = s.source();
    }
    match innermost {
        Some(cause) if !text.contains(&cause) => format!("{text}: {cause}"),
        _ => text,
    }
}

/// Pull requests, their files, one marker comment and commit statuses.
#[async_trait]
pub trait Forge: Send + Sync {
    /// Every open pull request (all pages).
    async fn open_pull_requests(&self) -> Result<Vec<PullRequest>, ForgeError>;
    async fn pull_request(&self, number: u64) -> Result<PullRequest, ForgeError>;
    /// Paths changed by the pull request; a rename contributes both its old and new path.
    async fn changed_files(&self, number: u64) -> Result<Vec<String>, ForgeError>;
    /// The account the token belongs to: the one login whose comments the
    /// bot may edit. Given (`--forge-login`) or asked once.
    async fn login(&self) -> Result<String, ForgeError>;
    /// Creates the comment carrying `marker`, or edits it in place when the
    /// bot's own account wrote one (never a second one, never another
    /// account's). Returns the comment id.
    async fn upsert_comment(&self, number: u64, marker: &str, body: &str) -> Result<u64, ForgeError>;
    async fn set_commit_status(
        &self,
        sha: &str,
        context: &str,
        state: CommitState,
        description: &str,
        target_url: Option<&str>,
    ) -> Result<(), ForgeError>;
}

/// GitHub's REST API v3 (github.com or GitHub Enterprise Server).
#[derive(Debug)]
pub struct GitHub(Rest);

impl GitHub {
    /// `api_base` is `https://api.github.com` or, for GitHub Enterprise
    /// Server, `https://<host>/api/v3`; `token` a PAT or an app installation token.
    pub fn new(api_base: &str, owner: &str, repo: &str, token: &str) -> Result<Self, ForgeError> {
        Rest::new(Dialect::GitHub, api_base, owner, repo, token).map(GitHub)
    }

    /// The account the token comments as, when `GET /user` cannot say (an
    /// app installation token comments as `<app-slug>[bot]`).
    pub(crate) fn with_login(self, login: Option<String>) -> Self {
        GitHub(self.0.with_login(login))
    }
}

/// Gitea's (and Forgejo's) REST API.
#[derive(Debug)]
pub struct Gitea(Rest);

impl Gitea {
    /// `api_base` is `https://<host>/api/v1`.
    pub fn new(api_base: &str, owner: &str, repo: &str, token: &str) -> Result<Self, ForgeError> {
        Rest::new(Dialect::Gitea, api_base, owner, repo, token).map(Gitea)
    }

    /// The account the token comments as, instead of asking `GET /user`.
    pub(crate) fn with_login(self, login: Option<String>) -> Self {
        Gitea(self.0.with_login(login))
    }
}

macro_rules! delegate_forge {
    ($client:ty) => {
        #[async_trait]
        impl Forge for $client {
            async fn open_pull_requests(&self) -> Result<Vec<PullRequest>, ForgeError> {
                self.0.open_pull_requests().await
            }
            async fn pull_request(&self, number: u64) -> Result<PullRequest, ForgeError> {
                self.0.pull_request(number).await
            }
            async fn changed_files(&self, number: u64) -> Result<Vec<String>, ForgeError> {
                self.0.changed_files(number).await
            }
            async fn login(&self) -> Result<String, ForgeError> {
                self.0.login().await
            }
            async fn upsert_comment(&self, number: u64, marker: &str, body: &str) -> Result<u64, ForgeError> {
                self.0.upsert_comment(number, marker, body).await
            }
            async fn set_commit_status(
                &self,
                sha: &str,
                context: &str,
                state: CommitState,
                description: &str,
                target_url: Option<&str>,
            ) -> Result<(), ForgeError> {
                self.0.set_commit_status(sha, context, state, description, target_url).await
            }
        }
    };
}

delegate_forge!(GitHub);
delegate_forge!(Gitea);

/// The two APIs differ in authentication, headers and pagination only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    GitHub,
    Gitea,
}

struct Rest {
    dialect: Dialect,
    http: Client,
    /// Without a trailing slash.
    api_base: String,
    owner: String,
    repo: String,
    /// Kept only to scrub it from error text.
    token: String,
    /// The token's login, given or asked once.
    login: OnceCell<String>,
    /// No call before this instant: the forge's last rate limit.
    quiet_until: Mutex<Option<Instant>>,
}

impl fmt::Debug for Rest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rest")
            .field("dialect", &self.dialect)
            .field("api_base", &self.api_base)
            .field("owner", &self.owner)
            .field("repo", &self.repo)
            .field("token", &REDACTED)
            .finish()
    }
}

#[derive(Deserialize)]
struct WirePull {
    number: u64,
    head: WireRef,
    base: WireRef,
    #[serde(default)]
    title: String,
    /// Absent from GitHub's list endpoint; `merged_at` is there.
    #[serde(default)]
    merged: Option<bool>,
    #[serde(default)]
    merged_at: Option<String>,
    state: String,
}

#[derive(Deserialize)]
struct WireRef {
    #[serde(rename = "ref")]
    name: String,
    #[serde(default)]
    sha: String,
}

#[derive(Deserialize)]
struct WireFile {
    filename: String,
    #[serde(default)]
    previous_filename: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
struct WireComment {
    id: u64,
    #[serde(default)]
    body: String,
    /// Null for deleted ("ghost") users.
    #[serde(default)]
    user: Option<WireUser>,
}

#[derive(Clone, Debug, Deserialize)]
struct WireUser {
    login: String,
}

impl From<WirePull> for PullRequest {
    fn from(p: WirePull) -> Self {
        PullRequest {
            number: p.number,
            head_sha: p.head.sha,
            head_ref: p.head.name,
            base_ref: p.base.name,
            title: p.title,
            merged: p.merged.unwrap_or(p.merged_at.is_some()),
            state: p.state,
        }
    }
}

impl Rest {
    fn new(
        dialect: Dialect,
        api_base: &str,
        owner: &str,
        repo: &str,
        token: &str,
    ) -> Result<Self, ForgeError> {
        // reqwest is built with `rustls-no-provider`; the first caller in the process installs ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        for (what, value) in [("owner", owner), ("repository", repo)] {
            if !is_path_safe_name(value) {
                return Err(ForgeError::new(None, format!("invalid {what} name {value:?}")));
            }
        }
        let api_base = api_base.trim_end_matches('/').to_owned();
        if !(api_base.starts_with("https://") || api_base.starts_with("http://")) {
            return Err(ForgeError::new(None, format!("the API base {api_base:?} is not an http(s) URL")));
        }
        let scheme = match dialect {
            Dialect::GitHub => "Bearer",
            Dialect::Gitea => "token",
        };
        let mut auth = HeaderValue::from_str(&format!("{scheme} {token}")).map_err(|_| {
            ForgeError::new(None, "the token contains characters that cannot go into an HTTP header")
        })?;
        auth.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, auth);
        match dialect {
            Dialect::GitHub => {
                headers.insert(ACCEPT, HeaderValue::from_static("application/vnd.github+json"));
                headers.insert(
                    HeaderName::from_static("x-github-api-version"),
                    HeaderValue::from_static("2022-11-28"),
                );
            }
            Dialect::Gitea => {
                headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
            }
        }
        let http = Client::builder()
            .default_headers(headers)
            .user_agent(USER_AGENT)
            .timeout(TIMEOUT)
            .build()
            .map_err(|e| ForgeError::new(None, redact(&format!("building the HTTP client: {e}"), token)))?;
        Ok(Rest {
            dialect,
            http,
            api_base,
            owner: owner.to_owned(),
            repo: repo.to_owned(),
            token: token.to_owned(),
            login: OnceCell::new(),
            quiet_until: Mutex::new(None),
        })
    }

    fn repo_url(&self, rest: &str) -> String {
        format!("{}/repos/{}/{}{rest}", self.api_base, self.owner, self.repo)
    }

    /// `METHOD /path?query` relative to the API base, for messages and logs.
    fn describe(&self, method: &Method, url: &str) -> String {
        format!("{method} {}", url.strip_prefix(&self.api_base).unwrap_or(url))
    }

    /// True for URLs on the API base, the only place the token may go.
    fn is_under_base(&self, url: &str) -> bool {
        url.strip_prefix(&self.api_base).is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']))
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
    ) -> Result<(HeaderMap, Value), ForgeError> {
        let what = self.describe(&method, url);
        if let Some(left) = self.quiet_for(Instant::now()) {
            return Err(ForgeError::new(
                Some(429),
                format!(
                    "{what}: not sent: the forge's rate limit asks for no calls for another {} s",
                    left.as_secs_f64().ceil()
                ),
            ));
        }
        let mut request = self.http.request(method, url);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(|e| ForgeError::transport(&what, &e, &self.token))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.map_err(|e| ForgeError::transport(&what, &e, &self.token))?;
        tracing::debug!(request = %what, status, "forge call");
        let limited =
            (status == 403 || status == 429) && excerpt(&text).to_ascii_lowercase().contains("rate limit");
        if let Some(wait) = rate_limit_wait(status, limited, &headers, SystemTime::now()) {
            self.keep_quiet(&what, wait);
        }
        if !(200..300).contains(&status) {
            return Err(ForgeError::http(&what, status, &text, &self.token));
        }
        if text.trim().is_empty() {
            return Ok((headers, Value::Null));
        }
        let value =
            serde_json::from_str(&text).map_err(|e| ForgeError::decode(&what, status, e, &self.token))?;
        Ok((headers, value))
    }

    /// How much longer the last rate limit keeps us quiet at `now`.
    fn quiet_for(&self, now: Instant) -> Option<Duration> {
        let until = *self.quiet_until.lock().unwrap_or_else(|p| p.into_inner());
        until.and_then(|until| until.checked_duration_since(now)).filter(|left| !left.is_zero())
    }

    /// Sends nothing for `wait` from now (never shortening a longer wait already set).
    fn keep_quiet(&self, what: &str, wait: RateLimitWait) {
        let until = Instant::now() + wait.wait;
        let mut quiet = self.quiet_until.lock().unwrap_or_else(|p| p.into_inner());
        if quiet.is_none_or(|current| current < until) {
            *quiet = Some(until);
        }
        match wait.asked {
            Some(asked) => tracing::warn!(
                request = %what,
                asked_seconds = asked.as_secs(),
                wait_seconds = wait.wait.as_secs(),
                "forge rate limit: it asked for a wait longer than the cap; no forge calls until the cap passes"
            ),
            None => tracing::warn!(
                request = %what,
                wait_seconds = wait.wait.as_secs_f64(),
                "forge rate limit: no forge calls until it passes"
            ),
        }
    }

    async fn get_as<T: for<'de> Deserialize<'de>>(&self, url: &str) -> Result<T, ForgeError> {
        let (_, value) = self.send(Method::GET, url, None).await?;
        self.decode(&Method::GET, url, value)
    }

    fn decode<T: for<'de> Deserialize<'de>>(
        &self,
        method: &Method,
        url: &str,
        value: Value,
    ) -> Result<T, ForgeError> {
        serde_json::from_value(value)
            .map_err(|e| ForgeError::decode(&self.describe(method, url), 200, e, &self.token))
    }

    /// Every item of a list endpoint, all pages.
    async fn list<T: for<'de> Deserialize<'de>>(&self, url: &str) -> Result<Vec<T>, ForgeError> {
        let items = match self.dialect {
            Dialect::GitHub => self.list_github(url).await?,
            Dialect::Gitea => self.list_gitea(url).await?,
        };
        self.decode(&Method::GET, url, Value::Array(items))
    }

    /// GitHub: follow `Link: <…>; rel="next"` until there is none.
    async fn list_github(&self, url: &str) -> Result<Vec<Value>, ForgeError> {
        let mut next = Some(with_query(url, &format!("per_page={GITHUB_PAGE_SIZE}")));
        let mut all = Vec::new();
        for _ in 0..MAX_PAGES {
            let Some(page_url) = next.take() else { return Ok(all) };
            if !self.is_under_base(&page_url) {
                return Err(ForgeError::new(
                    None,
                    format!(
                        "{}: the next-page link leaves the API base; not following it",
                        self.describe(&Method::GET, url)
                    ),
                ));
            }
            let (headers, value) = self.send(Method::GET, &page_url, None).await?;
            all.extend(self.array(&page_url, value)?);
            next = next_link(&headers);
        }
        match next {
            None => Ok(all),
            Some(_) => Err(self.too_many_pages(url)),
        }
    }

    /// Gitea: `page`/`limit` until a short or empty page or `X-Total-Count`
    /// items. Some list endpoints (an issue's comments) ignore `page` and send
    /// everything each time; a repeated page ends the loop as well.
    async fn list_gitea(&self, url: &str) -> Result<Vec<Value>, ForgeError> {
        let mut all = Vec::new();
        let mut previous: Option<Vec<Value>> = None;
        for page in 1..=MAX_PAGES {
            let page_url = with_query(url, &format!("page={page}&limit={GITEA_PAGE_SIZE}"));
            let (headers, value) = self.send(Method::GET, &page_url, None).await?;
            let items = self.array(&page_url, value)?;
            if items.is_empty() || previous.as_ref() == Some(&items) {
                return Ok(all);
            }
            let count = items.len();
            all.extend(items.iter().cloned());
            let done = match total_count(&headers) {
                Some(total) => all.len() >= total,
                None => count < GITEA_PAGE_SIZE,
            };
            if done {
                return Ok(all);
            }
            previous = Some(items);
        }
        Err(self.too_many_pages(url))
    }

    fn array(&self, url: &str, value: Value) -> Result<Vec<Value>, ForgeError> {
        match value {
            Value::Array(items) => Ok(items),
            other => Err(ForgeError::decode(
                &self.describe(&Method::GET, url),
                200,
                format!("expected a JSON array, got {}", json_kind(&other)),
                &self.token,
            )),
        }
    }

    fn too_many_pages(&self, url: &str) -> ForgeError {
        ForgeError::new(
            None,
            format!("{}: still more pages after {MAX_PAGES}; giving up", self.describe(&Method::GET, url)),
        )
    }

    fn with_login(self, login: Option<String>) -> Self {
        let cell = OnceCell::new();
        if let Some(login) = login.filter(|l| !l.trim().is_empty()) {
            let _ = cell.set(login.trim().to_owned());
        }
        Rest { login: cell, ..self }
    }

    /// The token's login, given or asked once. When the forge will not say
    /// (GitHub app installation tokens get 403 on `GET /user`), an error
    /// that asks for `--forge-login`: without a login no comment is edited.
    async fn login(&self) -> Result<String, ForgeError> {
        let login = self
            .login
            .get_or_try_init(|| async {
                let url = format!("{}/user", self.api_base);
                match self.get_as::<WireUser>(&url).await {
                    Ok(user) => Ok(user.login),
                    Err(e) if matches!(e.status, Some(403 | 404)) && !e.is_rate_limit() => Err(ForgeError::new(
                        e.status,
                        format!(
                            "the forge will not say whose token VMMIGRATE_FORGE_TOKEN is ({}); set --forge-login \
                             (VMMIGRATE_FORGE_LOGIN) to the account the bot comments as, e.g. my-app[bot]",
                            e.message
                        ),
                    )),
                    Err(e) => Err(e),
                }
            })
            .await?;
        Ok(login.clone())
    }

    async fn open_pull_requests(&self) -> Result<Vec<PullRequest>, ForgeError> {
        let pulls: Vec<WirePull> = self.list(&self.repo_url("/pulls?state=open")).await?;
        Ok(pulls.into_iter().map(PullRequest::from).collect())
    }

    async fn pull_request(&self, number: u64) -> Result<PullRequest, ForgeError> {
        let pull: WirePull = self.get_as(&self.repo_url(&format!("/pulls/{number}"))).await?;
        Ok(pull.into())
    }

    async fn changed_files(&self, number: u64) -> Result<Vec<String>, ForgeError> {
        let files: Vec<WireFile> = self.list(&self.repo_url(&format!("/pulls/{number}/files"))).await?;
        let mut paths: Vec<String> = Vec::with_capacity(files.len());
        for file in files {
            // A manifest renamed out of `migrations/` still touches `migrations/`.
            for path in std::iter::once(file.filename).chain(file.previous_filename) {
                if !path.is_empty() && !paths.contains(&path) {
                    paths.push(path);
                }
            }
        }
        Ok(paths)
    }

    async fn upsert_comment(&self, number: u64, marker: &str, body: &str) -> Result<u64, ForgeError> {
        let body = if body.contains(marker) { body.to_owned() } else { format!("{marker}\n{body}") };
        let comments: Vec<WireComment> =
            self.list(&self.repo_url(&format!("/issues/{number}/comments"))).await?;
        // Only the bot's own account's comment is edited: anyone can write the marker.
        let login =
            if comments.iter().any(|c| c.body.contains(marker)) { Some(self.login().await?) } else { None };
        if let Some(existing) = login.as_deref().and_then(|login| pick_comment(&comments, marker, login)) {
            if existing.body != body {
                let url = self.repo_url(&format!("/issues/comments/{}", existing.id));
                self.send(Method::PATCH, &url, Some(&json!({ "body": body }))).await?;
            }
            return Ok(existing.id);
        }
        let url = self.repo_url(&format!("/issues/{number}/comments"));
        let (_, created) = self.send(Method::POST, &url, Some(&json!({ "body": body }))).await?;
        let created: WireComment = self.decode(&Method::POST, &url, created)?;
        Ok(created.id)
    }

    async fn set_commit_status(
        &self,
        sha: &str,
        context: &str,
        state: CommitState,
        description: &str,
        target_url: Option<&str>,
    ) -> Result<(), ForgeError> {
        if sha.is_empty() || sha.len() > 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ForgeError::new(None, format!("{sha:?} is not a commit id")));
        }
        let mut status = json!({
            "state": state.as_str(),
            "context": context,
            "description": truncate_chars(description, STATUS_DESCRIPTION_CHARS),
        });
        if let Some(target_url) = target_url {
            status["target_url"] = json!(target_url);
        }
        self.send(Method::POST, &self.repo_url(&format!("/statuses/{sha}")), Some(&status)).await?;
        Ok(())
    }
}

/// How long a forge answer asks us to stay away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RateLimitWait {
    /// At most [`MAX_RATE_LIMIT_WAIT`].
    wait: Duration,
    /// What the forge asked for, when it was more than the cap.
    asked: Option<Duration>,
}

/// The wait an answer asks for: `Retry-After` (seconds or an HTTP date) on a
/// 429, a rate-limit 403 or a 503; GitHub's `x-ratelimit-reset` (epoch
/// seconds) once `x-ratelimit-remaining` is 0, whatever the status (the last
/// allowed call is answered 200); [`DEFAULT_RATE_LIMIT_WAIT`] for a 429 or a
/// rate-limit 403 that says nothing. `None`: no rate limit. `now` is the clock
/// the reset is read against.
fn rate_limit_wait(
    status: u16,
    rate_limit_body: bool,
    headers: &HeaderMap,
    now: SystemTime,
) -> Option<RateLimitWait> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let limited = status == 429 || (status == 403 && rate_limit_body);
    let retry_after = header("retry-after").filter(|_| limited || status == 503).and_then(|value| {
        if let Ok(seconds) = value.parse::<u64>() {
            return Some(Duration::from_secs(seconds));
        }
        let at = jiff::fmt::rfc2822::DateTimeParser::new().parse_timestamp(value).ok()?;
        Some(SystemTime::from(at).duration_since(now).unwrap_or_default())
    });
    let reset = (header("x-ratelimit-remaining") == Some("0"))
        .then(|| header("x-ratelimit-reset")?.parse::<u64>().ok())
        .flatten()
        .map(|epoch| {
            (SystemTime::UNIX_EPOCH + Duration::from_secs(epoch)).duration_since(now).unwrap_or_default()
        });
    let wait = match (retry_after, reset) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) if limited => DEFAULT_RATE_LIMIT_WAIT,
        (None, None) => return None,
    };
    if wait.is_zero() {
        return None;
    }
    Some(if wait > MAX_RATE_LIMIT_WAIT {
        RateLimitWait { wait: MAX_RATE_LIMIT_WAIT, asked: Some(wait) }
    } else {
        RateLimitWait { wait, asked: None }
    })
}

/// The bot's own marker comment: among the comments carrying the marker, the
/// oldest one written by `login`. A comment of anyone else quoting (or
/// planting) the marker is never picked.
fn pick_comment<'a>(comments: &'a [WireComment], marker: &str, login: &str) -> Option<&'a WireComment> {
    let mut candidates: Vec<&WireComment> = comments.iter().filter(|c| c.body.contains(marker)).collect();
    candidates.sort_by_key(|c| c.id);
    // Logins are case-insensitive on both forges.
    candidates.into_iter().find(|c| c.user.as_ref().is_some_and(|u| u.login.eq_ignore_ascii_case(login)))
}

/// Owner and repository names go into URL paths unencoded; both forges allow only these characters.
fn is_path_safe_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn with_query(url: &str, query: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{query}")
}

/// The `rel="next"` target of RFC 8288 `Link` headers.
fn next_link(headers: &HeaderMap) -> Option<String> {
    for value in headers.get_all(LINK) {
        let Ok(value) = value.to_str() else { continue };
        for link in value.split(',') {
            let link = link.trim();
            let (Some(start), Some(end)) = (link.find('<'), link.find('>')) else { continue };
            if end < start {
                continue;
            }
            let is_next = link[end + 1..].split(';').any(|param| {
                let Some((key, value)) = param.split_once('=') else { return false };
                key.trim().eq_ignore_ascii_case("rel")
                    && value
                        .trim()
                        .trim_matches('"')
                        .split_ascii_whitespace()
                        .any(|rel| rel.eq_ignore_ascii_case("next"))
            });
            if is_next {
                return Some(link[start + 1..end].to_owned());
            }
        }
    }
    None
}

fn total_count(headers: &HeaderMap) -> Option<usize> {
    headers.get("x-total-count")?.to_str().ok()?.trim().parse().ok()
}

/// The forge's `message` (plus validation `errors`) when the body is its JSON
/// error, else the body's start; one line either way.
fn excerpt(body: &str) -> String {
    let text = match serde_json::from_str::<Value>(body) {
        Ok(Value::Object(map)) if map.get("message").is_some_and(Value::is_string) => {
            let mut text = map["message"].as_str().unwrap_or_default().to_owned();
            if let Some(errors) = map.get("errors").filter(|e| !e.is_null()) {
                text.push_str(&format!(" ({errors})"));
            }
            text
        }
        _ => body.to_owned(),
    };
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() { "(empty body)".to_owned() } else { truncate_chars(&text, EXCERPT_CHARS) }
}

fn redact(text: &str, token: &str) -> String {
    if token.is_empty() { text.to_owned() } else { text.replace(token, REDACTED) }
}

/// At most `max` characters, the last one `…` when cut.
fn truncate_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comment(id: u64, login: &str, body: &str) -> WireComment {
        WireComment { id, body: body.into(), user: Some(WireUser { login: login.into() }) }
    }

    const MARKER: &str = "<!-- vmmigrate:plan -->";
    const GITHUB_API: &str = "https://api.github.com";

    #[test]
    fn the_bots_comment_wins_over_an_older_human_quote() {
        let comments = [
            comment(3, "alice", &format!("> {MARKER}\n> why?")),
            comment(7, "vmmigrate-bot", &format!("{MARKER}\nplan")),
            comment(9, "VMMIGRATE-BOT", &format!("{MARKER}\nsecond")),
        ];
        assert_eq!(pick_comment(&comments, MARKER, "vmmigrate-bot").map(|c| c.id), Some(7));
    }

    #[test]
    fn a_human_quote_alone_is_not_picked_when_the_login_is_known() {
        let comments = [comment(3, "alice", MARKER), comment(4, "vmmigrate-bot", "no marker here")];
        assert!(pick_comment(&comments, MARKER, "vmmigrate-bot").is_none());
    }

    #[tokio::test]
    async fn without_a_known_login_no_marker_comment_is_edited_and_the_error_asks_for_forge_login() {
        use vmmigrate_harness::fake_forge::{self as fake, FakeForge, FakePr};
        let forge = FakeForge::start().await;
        forge.add_pr(FakePr::open(7, "0123456789abcdef0123456789abcdef01234567"));
        forge.hide_user();
        let planted = forge.add_comment(7, "mallory", &format!("{MARKER}\nplanted"));
        let base = forge.base_url(fake::Dialect::GitHub);

        let unknown = GitHub::new(&base, fake::OWNER, fake::REPO, fake::TOKEN).unwrap();
        let error = unknown.upsert_comment(7, MARKER, "the plan").await.unwrap_err();
        assert!(error.message.contains("--forge-login"), "{error}");
        let comments = forge.comments(7);
        assert_eq!(comments.len(), 1, "no comment was posted");
        assert_eq!(
            (comments[0].edits, comments[0].body.as_str()),
            (0, format!("{MARKER}\nplanted").as_str())
        );

        let given = GitHub::new(&base, fake::OWNER, fake::REPO, fake::TOKEN)
            .unwrap()
            .with_login(Some(fake::BOT_LOGIN.into()));
        assert_eq!(given.login().await.unwrap(), fake::BOT_LOGIN);
        let id = given.upsert_comment(7, MARKER, "the plan").await.unwrap();
        assert_ne!(id, planted, "the planted comment is not the bot's");
        let mallory = forge.comments(7).into_iter().find(|c| c.id == planted).unwrap();
        assert_eq!(mallory.edits, 0);
    }

    #[test]
    fn next_link_is_found_among_several_relations() {
        let mut headers = HeaderMap::new();
        headers.insert(
            LINK,
            HeaderValue::from_static(
                "<https://api.github.com/repositories/1/issues/2/comments?page=1>; rel=\"prev\", \
                 <https://api.github.com/repositories/1/issues/2/comments?page=3>; rel=\"next\", \
                 <https://api.github.com/repositories/1/issues/2/comments?page=5>; rel=\"last\"",
            ),
        );
        assert_eq!(
            next_link(&headers).as_deref(),
            Some("https://api.github.com/repositories/1/issues/2/comments?page=3")
        );
        headers.insert(LINK, HeaderValue::from_static("<https://x/?page=1>; rel=\"first\""));
        assert_eq!(next_link(&headers), None);
    }

    #[test]
    fn pagination_links_to_other_hosts_are_not_under_the_base() {
        let rest = Rest::new(Dialect::GitHub, "https://ghe.example/api/v3/", "acme", "infra", "t").unwrap();
        assert!(rest.is_under_base("https://ghe.example/api/v3/repos/acme/infra/pulls?page=2"));
        assert!(!rest.is_under_base("https://ghe.example/api/v3evil/repos"));
        assert!(!rest.is_under_base("https://evil.example/api/v3/repos"));
    }

    #[test]
    fn error_text_is_an_excerpt_without_the_token() {
        let token = "ghp_s3cr3tT0ken";
        let body = format!("{{\"message\":\"Bad credentials for {token}\",\"documentation_url\":\"x\"}}");
        let err = ForgeError::http("GET /user", 401, &body, token);
        assert_eq!(err.status, Some(401));
        assert_eq!(err.message, "GET /user: HTTP 401: Bad credentials for [redacted]");
        assert_eq!(err.reason(), "ForgeUnauthorized");
        assert!(!err.retryable());

        let long = "x".repeat(5000);
        let err = ForgeError::http("GET /", 502, &long, token);
        assert!(err.message.chars().count() < 300, "{}", err.message);
        assert!(err.retryable());
    }

    #[test]
    fn rate_limits_are_retryable_even_as_403() {
        let err = ForgeError::http("GET /", 403, r#"{"message":"API rate limit exceeded for user"}"#, "t0k");
        assert_eq!(err.reason(), "ForgeRateLimited");
        assert!(err.retryable());
        let err = ForgeError::http("GET /", 403, r#"{"message":"Resource not accessible"}"#, "t0k");
        assert_eq!(err.reason(), "ForgeForbidden");
        assert!(!err.retryable());
    }

    #[test]
    fn debug_output_hides_the_token() {
        let client = Gitea::new("https://gitea.example/api/v1", "acme", "infra", "tok-abcdef123").unwrap();
        let debug = format!("{client:?}");
        assert!(!debug.contains("tok-abcdef123"), "{debug}");
        assert!(debug.contains("[redacted]"), "{debug}");
    }

    #[test]
    fn names_that_could_escape_the_url_path_are_refused() {
        for bad in ["", "..", "a/b", "a?b", "a b", "a%2fb"] {
            assert!(GitHub::new(GITHUB_API, bad, "repo", "t").is_err(), "{bad:?}");
        }
        assert!(GitHub::new(GITHUB_API, "acme-corp", "vm.migrations_1", "t").is_ok());
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn retry_after_and_github_reset_set_the_wait_and_an_absurd_one_is_cut_to_fifteen_minutes() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_750_000_000);
        let wait = |status, body, pairs: &[(&'static str, &str)]| {
            rate_limit_wait(status, body, &headers(pairs), now)
        };
        let secs = |s| Some(RateLimitWait { wait: Duration::from_secs(s), asked: None });

        assert_eq!(wait(429, false, &[("retry-after", "2")]), secs(2));
        assert_eq!(wait(429, false, &[("retry-after", "Sun, 15 Jun 2025 15:06:50 GMT")]), secs(10));
        assert_eq!(wait(503, false, &[("retry-after", "7")]), secs(7));
        assert_eq!(
            wait(403, true, &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1750000030")]),
            secs(30)
        );
        // The last allowed call is answered 200 with nothing remaining: quiet until the reset.
        assert_eq!(
            wait(200, false, &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1750000005")]),
            secs(5)
        );
        assert_eq!(
            wait(200, false, &[("x-ratelimit-remaining", "12"), ("x-ratelimit-reset", "1750000005")]),
            None
        );
        assert_eq!(wait(429, false, &[]), secs(60), "a 429 that does not say waits a minute");
        assert_eq!(wait(403, false, &[("retry-after", "5")]), None, "a plain 403 is no rate limit");
        assert_eq!(wait(500, false, &[("retry-after", "5")]), None);

        let absurd = wait(429, false, &[("retry-after", "86400")]).unwrap();
        assert_eq!(
            absurd,
            RateLimitWait { wait: MAX_RATE_LIMIT_WAIT, asked: Some(Duration::from_secs(86400)) }
        );
        assert_eq!(MAX_RATE_LIMIT_WAIT, Duration::from_secs(900));
    }

    #[test]
    fn the_quiet_time_ends_when_its_wait_does_and_a_shorter_wait_does_not_cut_it() {
        let rest = Rest::new(Dialect::GitHub, GITHUB_API, "acme", "infra", "t").unwrap();
        let now = Instant::now();
        assert_eq!(rest.quiet_for(now), None);
        rest.keep_quiet("GET /", RateLimitWait { wait: Duration::from_secs(30), asked: None });
        assert!(rest.quiet_for(now).is_some_and(|left| left > Duration::from_secs(29)));
        rest.keep_quiet("GET /", RateLimitWait { wait: Duration::from_secs(1), asked: None });
        assert!(
            rest.quiet_for(now).is_some_and(|left| left > Duration::from_secs(29)),
            "a shorter wait does not cut a longer one"
        );
        assert_eq!(rest.quiet_for(now + Duration::from_secs(31)), None);
    }

    #[test]
    fn long_descriptions_are_cut_to_140_characters() {
        let cut = truncate_chars(&"é".repeat(200), STATUS_DESCRIPTION_CHARS);
        assert_eq!(cut.chars().count(), 140);
        assert!(cut.ends_with('…'));
        assert_eq!(truncate_chars("short", 140), "short");
    }
}
