//! Status write-back: the files of `status_files` committed onto the status
//! branch (default `migration-status`, owned by the bot) or under a directory of
//! the tracked branch, and pushed with the `git` CLI.
//!
//! gix cannot push (gitoxide has no send-pack yet), so the whole round trip is
//! git plumbing in a private bare scratch repository: no work tree, no checkout,
//! no hooks, and none of the user's or the system's git configuration. Pushes
//! never force: a rejected push is fetched again, rebuilt on the new tip and
//! retried a bounded number of times, so other writers' commits are never lost.
//! Only the files this module manages change: `STATUS.md` and `*.yaml` exactly
//! two levels deep (`<namespace>/<name>.yaml`) under the target.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::status_files::{LEFT_ON_SOURCE_YAML, STATUS_MD};
use crate::metrics::Metrics;

/// Branch written by default; the bot owns it.
pub(crate) const DEFAULT_BRANCH: &str = "migration-status";
pub(crate) const DEFAULT_AUTHOR_NAME: &str = "vmmigrate";
pub(crate) const DEFAULT_AUTHOR_EMAIL: &str = "vmmigrate@users.noreply.local";
pub(crate) const DEFAULT_MAX_PUSH_ATTEMPTS: u32 = 5;
/// Trailer with the tracked-branch commit the status was computed against.
pub(crate) const TRAILER_SOURCE_COMMIT: &str = "Vmmigrate-Source-Commit";
/// Trailer with the number of migration files in the commit.
pub(crate) const TRAILER_MIGRATIONS: &str = "Vmmigrate-Migrations";

/// The remote tip lands here in the scratch repository. Forced, but only this
/// private ref: the remote branch itself is never forced.
const SCRATCH_REF: &str = "refs/vmmigrate/remote";
/// Environment passed through to git; everything else is dropped so that no
/// `GIT_DIR`, `GIT_CONFIG_*` or askpass of the caller leaks in.
const PASSTHROUGH_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "TMPDIR",
    "SSH_AUTH_SOCK",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    // A private CA for git's own TLS (Debian's git uses GnuTLS, which reads no SSL_CERT_FILE).
    "GIT_SSL_CAINFO",
];

/// Where the status files go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A branch of its own, owned by the bot (default `migration-status`).
    /// Created as an orphan root commit when it does not exist yet.
    Branch(String),
    /// Under `dir` on the tracked branch; everything else on it is kept exactly.
    Directory { branch: String, dir: String },
}

impl Default for Target {
    fn default() -> Self {
        Target::Branch(DEFAULT_BRANCH.to_string())
    }
}

impl Target {
    pub(crate) fn branch(&self) -> &str {
        match self {
            Target::Branch(branch) | Target::Directory { branch, .. } => branch,
        }
    }
}

/// Runs before every push attempt (tests use it to move the remote in between).
pub(crate) type BeforePush = Arc<dyn Fn() + Send + Sync>;

#[derive(Clone)]
pub struct StatusWriterConfig {
    /// Remote URL or path (credentials belong in `git_env`, not here).
    pub remote_url: String,
    pub target: Target,
    /// A private bare repository used as scratch; created when missing.
    pub cache_dir: PathBuf,
    pub author_name: String,
    pub author_email: String,
    /// Push attempts before giving up when other writers keep moving the branch.
    pub max_push_attempts: u32,
    /// Extra environment for git, e.g. `GIT_SSH_COMMAND` for private repositories.
    pub git_env: Vec<(String, String)>,
    /// Test hook: runs before each push.
    pub before_push: Option<BeforePush>,
    /// Where [`run_coalescing`] counts its pushes (the default: a registry
    /// of its own).
    pub metrics: Arc<Metrics>,
}

impl StatusWriterConfig {
    /// The defaults: branch `migration-status`, the bot author, 5 push attempts.
    pub fn new(remote_url: impl Into<String>, cache_dir: impl Into<PathBuf>) -> Self {
        StatusWriterConfig {
            remote_url: remote_url.into(),
            target: Target::default(),
            cache_dir: cache_dir.into(),
            author_name: DEFAULT_AUTHOR_NAME.to_string(),
            author_email: DEFAULT_AUTHOR_EMAIL.to_string(),
            max_push_attempts: DEFAULT_MAX_PUSH_ATTEMPTS,
            git_env: Vec::new(),
            before_push: None,
            metrics: Arc::default(),
        }
    }
}

impl fmt::Debug for StatusWriterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusWriterConfig")
            .field("remote_url", &redact_url(&self.remote_url))
            .field("target", &self.target)
            .field("cache_dir", &self.cache_dir)
            .field("author_name", &self.author_name)
            .field("author_email", &self.author_email)
            .field("max_push_attempts", &self.max_push_attempts)
            .field("git_env", &self.git_env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("before_push", &self.before_push.is_some())
            .finish()
    }
}

/// The outcome of one publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Publish {
    /// A commit was pushed; `attempts` counts pushes including rejected ones.
    Committed { commit: String, attempts: u32 },
    /// The remote already has exactly these files; nothing was committed.
    Unchanged,
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("invalid status writer configuration: {0}")]
    InvalidConfig(String),
    #[error("status file path {0:?} is not STATUS.md or <namespace>/<name>.yaml")]
    InvalidPath(String),
    #[error("source commit {0:?} is not a hex commit id")]
    InvalidSourceCommit(String),
    #[error("could not run git: {0}")]
    GitNotRunnable(#[source] io::Error),
    #[error("git {command} failed ({status}): {stderr}")]
    Git { command: String, status: String, stderr: String },
    #[error("branch {0} does not exist on the remote")]
    BranchMissing(String),
    #[error("push to {branch} rejected {attempts} times: other writers kept moving it")]
    PushRejected { branch: String, attempts: u32 },
    #[error("the remote refused the push to {branch}: {message}")]
    PushRefused { branch: String, message: String },
    #[error("scratch repository: {0}")]
    Io(#[from] io::Error),
}

impl StatusError {
    /// Stable reason for logs, Events and metric labels.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            StatusError::InvalidConfig(_) => "StatusConfigInvalid",
            StatusError::InvalidPath(_) => "StatusPathInvalid",
            StatusError::InvalidSourceCommit(_) => "StatusSourceCommitInvalid",
            StatusError::GitNotRunnable(_) => "GitNotInstalled",
            StatusError::Git { .. } => "GitFailed",
            StatusError::BranchMissing(_) => "StatusBranchMissing",
            StatusError::PushRejected { .. } => "StatusPushRejected",
            StatusError::PushRefused { .. } => "StatusPushRefused",
            StatusError::Io(_) => "StatusScratchIOError",
        }
    }

    /// Whether trying again later may succeed without anyone changing anything.
    /// The others need a human (configuration, branch protection, a missing git).
    pub fn retryable(&self) -> bool {
        matches!(self, StatusError::Git { .. } | StatusError::PushRejected { .. } | StatusError::Io(_))
    }
}

/// Commits and pushes status files. Blocking; call it from `spawn_blocking`.
pub struct StatusWriter {
    cfg: StatusWriterConfig,
    /// The target directory without a trailing `/`, empty for a whole branch.
    prefix: String,
    /// `cfg.cache_dir` made absolute, since git runs inside it.
    cache_dir: PathBuf,
    /// Configuration problems found by `new`, reported by every call.
    invalid: Option<String>,
    /// One operation at a time on the scratch repository and its scratch ref.
    scratch: Mutex<()>,
}

/// Temporary files in the scratch repository are unique per call.
static SCRATCH_SEQ: AtomicU64 = AtomicU64::new(0);

impl StatusWriter {
    pub fn new(cfg: StatusWriterConfig) -> Self {
        let prefix = match &cfg.target {
            Target::Branch(_) => String::new(),
            Target::Directory { dir, .. } => dir.trim_end_matches('/').to_string(),
        };
        let mut invalid = validate_config(&cfg, &prefix).err();
        let cache_dir = std::path::absolute(&cfg.cache_dir).unwrap_or_else(|e| {
            invalid.get_or_insert_with(|| format!("cache directory {}: {e}", cfg.cache_dir.display()));
            cfg.cache_dir.clone()
        });
        StatusWriter { cfg, prefix, cache_dir, invalid, scratch: Mutex::new(()) }
    }

    pub(crate) fn config(&self) -> &StatusWriterConfig {
        &self.cfg
    }

    /// Publishes `files` (paths relative to the target) as the complete set of
    /// managed status files: managed files missing from `files` are removed,
    /// everything else in the remote tree is kept. Commits only when the tree
    /// changes; pushes without force, rebuilding on the new tip when rejected.
    pub fn publish(
        &self,
        files: &BTreeMap<String, String>,
        source_commit: &str,
    ) -> Result<Publish, StatusError> {
        self.check_config()?;
        if !is_commit_id(source_commit) {
            return Err(StatusError::InvalidSourceCommit(source_commit.to_string()));
        }
        if let Some(bad) = files.keys().find(|p| !is_status_path(p)) {
            return Err(StatusError::InvalidPath(bad.clone()));
        }
        let _guard = self.scratch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.ensure_scratch()?;
        let branch = self.cfg.target.branch();
        let migrations = files.keys().filter(|p| p.ends_with(".yaml")).count();
        let message = format!(
            "vmmigrate: status of {migrations} migration{}\n\n{TRAILER_SOURCE_COMMIT}: {source_commit}\n{TRAILER_MIGRATIONS}: {migrations}\n",
            if migrations == 1 { "" } else { "s" }
        );
        let blobs = self.write_blobs(files)?;
        let attempts = self.cfg.max_push_attempts;
        for attempt in 1..=attempts {
            let tip = self.fetch_tip()?;
            if tip.is_none() && !self.prefix.is_empty() {
                return Err(StatusError::BranchMissing(branch.to_string()));
            }
            let tree = self.build_tree(tip.as_ref(), &blobs)?;
            let unchanged = match &tip {
                Some(tip) => tip.tree == tree,
                None => tree == self.empty_tree()?,
            };
            if unchanged {
                tracing::debug!(branch, "status unchanged; no commit");
                return Ok(Publish::Unchanged);
            }
            let commit = self.commit_tree(&tree, tip.as_ref(), &message)?;
            if let Some(hook) = &self.cfg.before_push {
                hook();
            }
            match self.push(&commit)? {
                PushOutcome::Pushed => {
                    tracing::info!(branch, commit, attempt, migrations, "status committed");
                    return Ok(Publish::Committed { commit, attempts: attempt });
                }
                PushOutcome::Rejected => {
                    tracing::info!(
                        branch,
                        attempt,
                        "status push rejected: the branch moved; rebuilding on its new tip"
                    );
                }
            }
        }
        Err(StatusError::PushRejected { branch: branch.to_string(), attempts })
    }

    /// The managed files under the target as the remote has them now, with paths
    /// relative to the target (the shape `publish` takes). Empty when the status
    /// branch does not exist yet. Content that is not UTF-8 is read lossily.
    pub fn read_remote(&self) -> Result<BTreeMap<String, String>, StatusError> {
        self.check_config()?;
        let _guard = self.scratch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.ensure_scratch()?;
        let Some(tip) = self.fetch_tip()? else {
            if self.prefix.is_empty() {
                return Ok(BTreeMap::new());
            }
            return Err(StatusError::BranchMissing(self.cfg.target.branch().to_string()));
        };
        let entries: Vec<(String, String)> = self
            .ls_tree(&tip.commit)?
            .into_iter()
            .filter(|e| e.kind == "blob")
            .filter_map(|e| self.managed(&e.path).map(|rel| (rel.to_string(), e.object)))
            .collect();
        let mut input = Vec::new();
        for (_, object) in &entries {
            input.extend_from_slice(object.as_bytes());
            input.push(b'\n');
        }
        let out = self.git(&["cat-file", "--batch"], Some(&input), None)?;
        let contents = parse_cat_file_batch(&out)?;
        if contents.len() != entries.len() {
            return Err(git_error("cat-file --batch", "short output", ""));
        }
        Ok(entries.into_iter().map(|(path, _)| path).zip(contents).collect())
    }

    fn check_config(&self) -> Result<(), StatusError> {
        match &self.invalid {
            Some(problem) => Err(StatusError::InvalidConfig(problem.clone())),
            None => Ok(()),
        }
    }

    fn ensure_scratch(&self) -> Result<(), StatusError> {
        if self.cache_dir.join("HEAD").is_file() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.cache_dir)?;
        // With GIT_DIR set, `init --bare` initialises exactly that directory.
        self.git(&["-c", "init.defaultBranch=main", "init", "--bare", "-q"], None, None)?;
        Ok(())
    }

    /// Fetches the target branch into the scratch ref; `None` when the remote has no such branch.
    fn fetch_tip(&self) -> Result<Option<Tip>, StatusError> {
        let refspec = format!("+refs/heads/{}:{SCRATCH_REF}", self.cfg.target.branch());
        let out = self.run(
            &["fetch", "-q", "--no-tags", "--no-write-fetch-head", "--", &self.cfg.remote_url, &refspec],
            None,
            None,
        )?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // LC_ALL=C keeps this message stable.
            if stderr.contains("couldn't find remote ref") {
                // Forget a tip from before the branch was deleted.
                self.git(&["update-ref", "-d", SCRATCH_REF], None, None)?;
                return Ok(None);
            }
            // Named with the remote: an outage must say which one (ssh's own message does not).
            return Err(self.failed(&format!("fetch {}", redact_url(&self.cfg.remote_url)), &out));
        }
        let out = self.git(
            &["rev-parse", &format!("{SCRATCH_REF}^{{commit}}"), &format!("{SCRATCH_REF}^{{tree}}")],
            None,
            None,
        )?;
        let text = String::from_utf8_lossy(&out);
        let mut lines = text.lines();
        match (lines.next(), lines.next()) {
            (Some(commit), Some(tree)) => {
                Ok(Some(Tip { commit: commit.to_string(), tree: tree.to_string() }))
            }
            _ => Err(git_error("rev-parse", "unexpected output", &text)),
        }
    }

    /// Writes every file as a blob in one git process: path → blob id.
    fn write_blobs(&self, files: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, StatusError> {
        if files.is_empty() {
            return Ok(BTreeMap::new());
        }
        let dir = ScratchPath::new(&self.cache_dir, "blobs");
        std::fs::create_dir_all(&dir.0)?;
        let mut paths = Vec::new();
        for (i, content) in files.values().enumerate() {
            let path = dir.0.join(i.to_string());
            std::fs::write(&path, content)?;
            paths.extend_from_slice(path.as_os_str().as_encoded_bytes());
            paths.push(b'\n');
        }
        let out = self.git(&["hash-object", "-w", "--no-filters", "--stdin-paths"], Some(&paths), None)?;
        let text = String::from_utf8_lossy(&out);
        let ids: Vec<&str> = text.lines().collect();
        if ids.len() != files.len() {
            return Err(git_error("hash-object", "short output", &text));
        }
        Ok(files.keys().cloned().zip(ids.into_iter().map(str::to_string)).collect())
    }

    /// The tip's tree with the managed files replaced by `blobs`.
    fn build_tree(&self, tip: Option<&Tip>, blobs: &BTreeMap<String, String>) -> Result<String, StatusError> {
        let index = ScratchPath::new(&self.cache_dir, "index");
        let mut updates = Vec::new();
        if let Some(tip) = tip {
            self.git(&["read-tree", &tip.tree], None, Some(&index.0))?;
            for entry in self.ls_tree(&tip.tree)? {
                if let Some(rel) = self.managed(&entry.path)
                    && !blobs.contains_key(rel)
                {
                    // Mode 0 removes the path from the index.
                    updates.extend_from_slice(
                        format!("0 {}\t{}\0", "0".repeat(entry.object.len()), entry.path).as_bytes(),
                    );
                }
            }
        }
        for (path, blob) in blobs {
            updates.extend_from_slice(format!("100644 {blob}\t{}\0", self.full_path(path)).as_bytes());
        }
        if !updates.is_empty() {
            self.git(&["update-index", "-z", "--index-info"], Some(&updates), Some(&index.0))?;
        }
        let out = self.git(&["write-tree"], None, Some(&index.0))?;
        Ok(String::from_utf8_lossy(&out).trim().to_string())
    }

    fn empty_tree(&self) -> Result<String, StatusError> {
        let out = self.git(&["hash-object", "-t", "tree", "-w", "--stdin"], Some(&[]), None)?;
        Ok(String::from_utf8_lossy(&out).trim().to_string())
    }

    fn commit_tree(&self, tree: &str, tip: Option<&Tip>, message: &str) -> Result<String, StatusError> {
        let mut args = vec!["commit-tree", tree];
        if let Some(tip) = tip {
            args.extend(["-p", &tip.commit]);
        }
        args.extend(["-F", "-"]);
        let out = self.git(&args, Some(message.as_bytes()), None)?;
        Ok(String::from_utf8_lossy(&out).trim().to_string())
    }

    /// `git push <url> <commit>:refs/heads/<branch>`: a fast-forward or nothing.
    fn push(&self, commit: &str) -> Result<PushOutcome, StatusError> {
        let refspec = format!("{commit}:refs/heads/{}", self.cfg.target.branch());
        let out = self.run(
            &["push", "--porcelain", "--no-verify", "--", &self.cfg.remote_url, &refspec],
            None,
            None,
        )?;
        if out.status.success() {
            return Ok(PushOutcome::Pushed);
        }
        // Porcelain lines: `<flag>\t<from>:<to>\t<summary> (<reason>)`; `!` is a rejected ref.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let rejected = stdout.lines().find(|l| l.starts_with('!'));
        match rejected.map(|line| line.splitn(3, '\t').nth(2).unwrap_or_default()) {
            // Not a fast-forward (`non-fast-forward`, `fetch first`, `stale info`).
            Some(summary) if summary.starts_with("[rejected]") => Ok(PushOutcome::Rejected),
            // `[remote rejected]`: a hook or branch protection said no; retrying will not help.
            Some(summary) => Err(StatusError::PushRefused {
                branch: self.cfg.target.branch().to_string(),
                message: self.redact(summary),
            }),
            None => Err(self.failed(&format!("push {}", redact_url(&self.cfg.remote_url)), &out)),
        }
    }

    fn ls_tree(&self, treeish: &str) -> Result<Vec<TreeEntry>, StatusError> {
        let mut args = vec!["ls-tree", "-r", "-z", treeish];
        if !self.prefix.is_empty() {
            args.extend(["--", &self.prefix]);
        }
        let out = self.git(&args, None, None)?;
        let mut entries = Vec::new();
        for record in out.split(|b| *b == 0).filter(|r| !r.is_empty()) {
            let record = String::from_utf8_lossy(record);
            // `<mode> SP <type> SP <object> TAB <path>`
            let Some((meta, path)) = record.split_once('\t') else { continue };
            let mut meta = meta.split(' ');
            if let (Some(_mode), Some(kind), Some(object)) = (meta.next(), meta.next(), meta.next()) {
                entries.push(TreeEntry {
                    kind: kind.to_string(),
                    object: object.to_string(),
                    path: path.to_string(),
                });
            }
        }
        Ok(entries)
    }

    /// The path relative to the target when it is one of the files we manage.
    fn managed<'p>(&self, path: &'p str) -> Option<&'p str> {
        let rel =
            if self.prefix.is_empty() { path } else { path.strip_prefix(&self.prefix)?.strip_prefix('/')? };
        let parts: Vec<&str> = rel.split('/').collect();
        let ours = match parts.as_slice() {
            [file] => *file == STATUS_MD || *file == LEFT_ON_SOURCE_YAML,
            [_, file] => file.ends_with(".yaml"),
            _ => false,
        };
        ours.then_some(rel)
    }

    fn full_path(&self, rel: &str) -> String {
        if self.prefix.is_empty() { rel.to_string() } else { format!("{}/{rel}", self.prefix) }
    }

    /// Runs git and returns its stdout, or an error with its stderr.
    fn git(&self, args: &[&str], stdin: Option<&[u8]>, index: Option<&Path>) -> Result<Vec<u8>, StatusError> {
        let out = self.run(args, stdin, index)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(self.failed(args.first().copied().unwrap_or("git"), &out))
        }
    }

    fn run(
        &self,
        args: &[&str],
        stdin: Option<&[u8]>,
        index: Option<&Path>,
    ) -> Result<GitOutput, StatusError> {
        let mut cmd = Command::new("git");
        cmd.env_clear();
        for key in PASSTHROUGH_ENV {
            if let Some(value) = std::env::var_os(key) {
                cmd.env(key, value);
            }
        }
        // No system or global config: nothing that signs, rewrites URLs or runs hooks.
        cmd.env("GIT_CONFIG_NOSYSTEM", "1").env("GIT_CONFIG_GLOBAL", "/dev/null");
        for (key, value) in &self.cfg.git_env {
            cmd.env(key, value);
        }
        cmd.env("GIT_DIR", &self.cache_dir)
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_ALLOW_PROTOCOL", "file:git:http:https:ssh")
            .env("LC_ALL", "C")
            .env("GIT_AUTHOR_NAME", &self.cfg.author_name)
            .env("GIT_AUTHOR_EMAIL", &self.cfg.author_email)
            .env("GIT_COMMITTER_NAME", &self.cfg.author_name)
            .env("GIT_COMMITTER_EMAIL", &self.cfg.author_email);
        if let Some(index) = index {
            cmd.env("GIT_INDEX_FILE", index);
        }
        cmd.args([
            "-c",
            "commit.gpgSign=false",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "protocol.ext.allow=never",
        ])
        .args(args)
        .current_dir(&self.cache_dir)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(StatusError::GitNotRunnable)?;
        let writer = match (stdin, child.stdin.take()) {
            (Some(input), Some(mut pipe)) => {
                let input = input.to_vec();
                // A thread, so a large input cannot deadlock against a full stdout pipe.
                Some(std::thread::spawn(move || pipe.write_all(&input)))
            }
            _ => None,
        };
        let output = child.wait_with_output()?;
        if let Some(writer) = writer {
            match writer.join() {
                Ok(Ok(())) => {}
                // git exited early; its status and stderr say why.
                Ok(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(io::Error::other("stdin writer thread panicked").into()),
            }
        }
        Ok(GitOutput { status: output.status, stdout: output.stdout, stderr: output.stderr })
    }

    fn failed(&self, command: &str, out: &GitOutput) -> StatusError {
        git_error(command, &out.status.to_string(), &self.redact(String::from_utf8_lossy(&out.stderr).trim()))
    }

    /// Never repeat credentials embedded in the remote URL.
    fn redact(&self, text: &str) -> String {
        let redacted = redact_url(&self.cfg.remote_url);
        if redacted == self.cfg.remote_url {
            text.to_string()
        } else {
            text.replace(&self.cfg.remote_url, &redacted)
        }
    }
}

struct Tip {
    commit: String,
    tree: String,
}

struct TreeEntry {
    kind: String,
    object: String,
    path: String,
}

struct GitOutput {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

enum PushOutcome {
    Pushed,
    /// Not a fast-forward: someone else pushed first.
    Rejected,
}

/// A file or directory in the scratch repository, removed when dropped.
struct ScratchPath(PathBuf);

impl ScratchPath {
    fn new(dir: &Path, kind: &str) -> Self {
        let seq = SCRATCH_SEQ.fetch_add(1, Ordering::Relaxed);
        ScratchPath(dir.join(format!("vmmigrate-{kind}-{}-{seq}", std::process::id())))
    }
}

impl Drop for ScratchPath {
    fn drop(&mut self) {
        let _ =
            if self.0.is_dir() { std::fs::remove_dir_all(&self.0) } else { std::fs::remove_file(&self.0) };
    }
}

fn git_error(command: &str, status: &str, stderr: &str) -> StatusError {
    StatusError::Git { command: command.to_string(), status: status.to_string(), stderr: stderr.to_string() }
}

/// `<object> SP blob SP <size> LF <content> LF`, repeated.
fn parse_cat_file_batch(mut out: &[u8]) -> Result<Vec<String>, StatusError> {
    let mut contents = Vec::new();
    while !out.is_empty() {
        let newline =
            out.iter().position(|b| *b == b'\n').ok_or_else(|| git_error("cat-file", "bad output", ""))?;
        let header = String::from_utf8_lossy(&out[..newline]).to_string();
        let size: usize = header
            .rsplit(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| git_error("cat-file", "bad header", &header))?;
        let body = out
            .get(newline + 1..newline + 1 + size)
            .ok_or_else(|| git_error("cat-file", "short body", &header))?;
        contents.push(String::from_utf8_lossy(body).into_owned());
        out = out.get(newline + 2 + size..).unwrap_or_default();
    }
    Ok(contents)
}

fn validate_config(cfg: &StatusWriterConfig, prefix: &str) -> Result<(), String> {
    let url = &cfg.remote_url;
    if url.is_empty() || url.starts_with('-') || url.chars().any(char::is_control) {
        return Err(format!(
            "remote URL {:?} is empty, starts with '-' or has control characters",
            redact_url(url)
        ));
    }
    let transport = url.split_once("::").map(|(t, _)| t);
    if transport
        .is_some_and(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c)))
    {
        return Err("remote helpers (`<transport>::<address>`) are not allowed".to_string());
    }
    if !is_branch_name(cfg.target.branch()) {
        return Err(format!("{:?} is not a valid branch name", cfg.target.branch()));
    }
    if let Target::Directory { dir, .. } = &cfg.target
        && (prefix.is_empty() || !prefix.split('/').all(is_path_component))
    {
        return Err(format!("status directory {dir:?} must be a relative path of plain names"));
    }
    for value in [&cfg.author_name, &cfg.author_email] {
        if value.trim().is_empty() || value.chars().any(|c| c.is_control() || c == '<' || c == '>') {
            return Err(format!("author {value:?} is empty or has characters git rejects"));
        }
    }
    if cfg.max_push_attempts == 0 {
        return Err("max_push_attempts must be at least 1".to_string());
    }
    if let Some((key, _)) = cfg.git_env.iter().find(|(k, _)| k.is_empty() || k.contains(['=', '\0'])) {
        return Err(format!("environment variable name {key:?} is invalid"));
    }
    Ok(())
}

/// `git check-ref-format` rules for a branch name, and no leading `-`.
fn is_branch_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('-')
        && !name.starts_with('/')
        && !name.ends_with('/')
        && !name.ends_with('.')
        && name != "@"
        && !name.contains("..")
        && !name.contains("@{")
        && !name.contains("//")
        && !name.chars().any(|c| c.is_ascii_control() || " ~^:?*[\\".contains(c))
        && name.split('/').all(|part| !part.starts_with('.') && !part.ends_with(".lock"))
}

/// A plain file or directory name: no `.`/`..`/`.git`, no leading `-`, no separators.
fn is_path_component(part: &str) -> bool {
    !part.is_empty()
        && !part.starts_with(['.', '-'])
        && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// `STATUS.md`, `left-on-source.yaml` or `<namespace>/<name>.yaml` with plain names.
fn is_status_path(path: &str) -> bool {
    match path.split('/').collect::<Vec<_>>().as_slice() {
        [file] => *file == STATUS_MD || *file == LEFT_ON_SOURCE_YAML,
        [dir, file] => is_path_component(dir) && is_path_component(file) && file.ends_with(".yaml"),
        _ => false,
    }
}

fn is_commit_id(s: &str) -> bool {
    (4..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `https://user:token@host/x` → `https://***@host/x`.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// A snapshot for `run_coalescing`: the status files and the source commit.
pub(crate) type Snapshot = (BTreeMap<String, String>, String);

/// Publishes the snapshots from `rx`: at most one commit per `window`, always
/// the latest snapshot, and a final flush when the sender is dropped. A publish
/// that failed in a way that may pass later is retried after the window.
pub async fn run_coalescing(
    writer: Arc<StatusWriter>,
    mut rx: tokio::sync::watch::Receiver<Option<Snapshot>>,
    window: Duration,
) {
    // A snapshot present before we started counts as new.
    let mut pending = rx.borrow_and_update().is_some();
    let mut open = true;
    let mut next_allowed: Option<tokio::time::Instant> = None;
    while open || pending {
        if !pending && rx.changed().await.is_err() {
            break;
        }
        if let Some(at) = next_allowed {
            let hold = tokio::time::sleep_until(at);
            tokio::pin!(hold);
            while open {
                tokio::select! {
                    _ = &mut hold => break,
                    changed = rx.changed() => open = changed.is_ok(),
                }
            }
        }
        let snapshot = rx.borrow_and_update().clone();
        pending = false;
        let Some((files, source_commit)) = snapshot else { continue };
        let publisher = writer.clone();
        let result = tokio::task::spawn_blocking(move || publisher.publish(&files, &source_commit)).await;
        next_allowed = Some(tokio::time::Instant::now() + window);
        writer.config().metrics.git_push(match &result {
            Ok(Ok(Publish::Committed { .. })) => "pushed",
            Ok(Ok(Publish::Unchanged)) => "unchanged",
            _ => "error",
        });
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(reason = e.reason(), error = %e, "status publish failed");
                // Retried after the window, unless the sender is gone (one final attempt only).
                pending = e.retryable() && open;
            }
            Err(e) => tracing::error!(error = %e, "status publish task failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branch_names_follow_check_ref_format() {
        for good in ["migration-status", "bot/status", "status_2025", "a.b"] {
            assert!(is_branch_name(good), "{good}");
        }
        for bad in [
            "", "-f", "a..b", "a b", "a:b", "a~1", "a^", "x.lock", ".hidden", "a/", "/a", "a//b", "@",
            "a@{1}", "a\\b", "a*",
        ] {
            assert!(!is_branch_name(bad), "{bad}");
        }
    }

    #[test]
    fn only_status_md_left_on_source_and_two_level_yaml_files_are_status_paths() {
        assert!(is_status_path("STATUS.md"));
        assert!(is_status_path("left-on-source.yaml"));
        assert!(is_status_path("apps/web-01.yaml"));
        for bad in [
            "README.md",
            "apps/web.yml",
            "../x.yaml",
            "apps/../x.yaml",
            ".git/x.yaml",
            "a/b/c.yaml",
            "-a/b.yaml",
            "apps/STATUS.md",
            "other.yaml",
        ] {
            assert!(!is_status_path(bad), "{bad}");
        }
    }

    #[test]
    fn managed_paths_are_relative_to_the_target_directory() {
        let mut cfg = StatusWriterConfig::new("/tmp/remote.git", "/tmp/cache");
        cfg.target = Target::Directory { branch: "main".into(), dir: "status/".into() };
        let writer = StatusWriter::new(cfg);
        assert_eq!(writer.managed("status/STATUS.md"), Some("STATUS.md"));
        assert_eq!(writer.managed("status/apps/web.yaml"), Some("apps/web.yaml"));
        assert_eq!(writer.managed("status/left-on-source.yaml"), Some("left-on-source.yaml"));
        assert_eq!(writer.managed("status/README.md"), None);
        assert_eq!(writer.managed("statusx/apps/web.yaml"), None);
        assert_eq!(writer.managed("migrations/apps/web.yaml"), None);
        assert_eq!(writer.managed("STATUS.md"), None);
    }

    #[test]
    fn invalid_configuration_is_reported_by_every_call() {
        let mut cfg = StatusWriterConfig::new("--upload-pack=evil", "/tmp/cache");
        let err = StatusWriter::new(cfg.clone()).publish(&BTreeMap::new(), "abcd").unwrap_err();
        assert!(matches!(err, StatusError::InvalidConfig(_)), "{err}");
        cfg.remote_url = "ext::sh -c evil".into();
        assert!(matches!(StatusWriter::new(cfg.clone()).read_remote(), Err(StatusError::InvalidConfig(_))));
        cfg.remote_url = "/tmp/remote.git".into();
        cfg.target = Target::Directory { branch: "main".into(), dir: "../etc".into() };
        assert!(matches!(StatusWriter::new(cfg.clone()).read_remote(), Err(StatusError::InvalidConfig(_))));
        cfg.target = Target::Branch("-delete".into());
        assert!(matches!(StatusWriter::new(cfg).read_remote(), Err(StatusError::InvalidConfig(_))));
    }

    #[test]
    fn credentials_in_the_remote_url_are_redacted() {
        assert_eq!(
            redact_url("https://bot:tok3n@git.example/org/repo.git"),
            "https://***@git.example/org/repo.git"
        );
        assert_eq!(redact_url("ssh://git@host/repo"), "ssh://***@host/repo");
        assert_eq!(redact_url("/srv/git/repo.git"), "/srv/git/repo.git");
        let cfg = StatusWriterConfig::new("https://bot:tok3n@git.example/r.git", "/tmp/c");
        assert!(!format!("{cfg:?}").contains("tok3n"));
    }

    #[test]
    fn cat_file_batch_output_is_split_into_contents() {
        let out = b"aa blob 3\nabc\nbb blob 0\n\ncc blob 2\nx\n\n";
        assert_eq!(parse_cat_file_batch(out).unwrap(), ["abc", "", "x\n"]);
    }
}
