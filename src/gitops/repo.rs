//! The tracked repository, read through gix: a private bare clone in a cache
//! directory, fetched on every poll or webhook, and read as trees at one
//! commit, without a work tree (nothing half-written is ever read).
//!
//! Transports: gix speaks `file://`, `ssh://` and local paths by launching
//! the `git` binary (`git-upload-pack`, `ssh`), and `https://` through
//! reqwest. Pushing is not here: gix has no send-pack yet, so the status
//! writer pushes with the `git` CLI (`status_branch`).
//!
//! All functions block; async callers use `spawn_blocking`.

use super::render::{RenderError, RepoTree, TreeLimits};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Largest pack one fetch may bring, by default: a repository of manifests
/// is a few MiB, so this leaves room for years of history and stops a pull
/// request that pushes gigabytes before it fills the cache volume.
pub(crate) const DEFAULT_MAX_FETCH_BYTES: u64 = 256 << 20;
/// Longest one fetch may take, by default.
pub(crate) const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the fetch watchdog looks at the pack being written.
const WATCH_EVERY: Duration = Duration::from_millis(20);

/// How to authenticate to a private repository.
#[derive(Clone, Default)]
pub(crate) enum RepoAuth {
    #[default]
    None,
    /// An SSH private key file (from a mounted Secret), used as
    /// `ssh -i <key> -o IdentitiesOnly=yes`; host keys come from the
    /// known_hosts file given alongside.
    SshKey { key: PathBuf, known_hosts: Option<PathBuf> },
    /// A token for HTTPS (sent as the password of user `x-access-token`).
    Token(String),
}

impl std::fmt::Debug for RepoAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RepoAuth::None => f.write_str("None"),
            RepoAuth::SshKey { key, .. } => write!(f, "SshKey({})", key.display()),
            RepoAuth::Token(_) => f.write_str("Token(<redacted>)"),
        }
    }
}

/// The repository to track.
#[derive(Clone, Debug)]
pub(crate) struct RepoConfig {
    /// Clone URL or local path.
    pub url: String,
    /// The tracked branch, e.g. `main`.
    pub branch: String,
    /// Where the private bare clone lives.
    pub cache_dir: PathBuf,
    pub auth: RepoAuth,
    /// Largest pack one fetch may write (`--max-fetch-bytes`).
    pub max_fetch_bytes: u64,
    /// Longest one fetch may take (`--fetch-timeout`).
    pub fetch_timeout: Duration,
}

/// A failure talking to or reading the repository. Messages never contain
/// credentials.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {message}")]
pub(crate) struct GitError {
    pub what: String,
    pub message: String,
}

fn err(what: &str, e: impl std::fmt::Display) -> GitError {
    GitError { what: what.to_owned(), message: format!("{e:#}") }
}

/// The tracked repository's local bare clone.
pub(crate) struct TrackedRepo {
    config: RepoConfig,
}

/// Remote-tracking namespace in the cache clone.
const REMOTE_REFS: &str = "refs/remotes/origin";

impl TrackedRepo {
    pub(crate) fn new(config: RepoConfig) -> TrackedRepo {
        TrackedRepo { config }
    }

    fn open(&self) -> Result<gix::Repository, GitError> {
        let dir = &self.config.cache_dir;
        if dir.join("HEAD").exists() {
            gix::open(dir.clone()).map_err(|e| err("opening the cache clone", e))
        } else {
            std::fs::create_dir_all(dir).map_err(|e| err("creating the cache directory", e))?;
            gix::init_bare(dir).map_err(|e| err("creating the cache clone", e))
        }
    }

    /// The `GIT_SSH_COMMAND` for an SSH key, to be set in the process
    /// environment once, before any thread starts (gix's ssh and file
    /// transports run `ssh`/`git`, which honour it like git itself).
    pub(crate) fn ssh_command(auth: &RepoAuth) -> Option<String> {
        let RepoAuth::SshKey { key, known_hosts } = auth else { return None };
        let mut cmd = format!("ssh -i {} -o IdentitiesOnly=yes -o BatchMode=yes", shell_quote(key));
        if let Some(k) = known_hosts {
            cmd.push_str(&format!(" -o UserKnownHostsFile={} -o StrictHostKeyChecking=yes", shell_quote(k)));
        }
        Some(cmd)
    }

    /// Fetches every branch (pull-request heads are branches too) and returns
    /// the tracked branch's tip.
    pub(crate) fn fetch(&self) -> Result<String, GitError> {
        // Errors name the remote (an outage must say which one); the URL
        // carries no credentials (refused at start-up).
        let connecting = format!("connecting to {}", self.config.url);
        let fetching = format!("fetching from {}", self.config.url);
        let repo = self.open()?;
        let remote = repo
            .remote_at(self.config.url.as_str())
            .map_err(|e| err("remote URL", e))?
            .with_refspecs(
                [format!("+refs/heads/*:{REMOTE_REFS}/*"), format!("+refs/pull/*/head:{REMOTE_REFS}/pull/*")]
                    .iter()
                    .map(String::as_str),
                gix::remote::Direction::Fetch,
            )
            .map_err(|e| err("refspec", e))?;
        let mut connection =
            remote.connect(gix::remote::Direction::Fetch).map_err(|e| err(&connecting, e))?;
        if let RepoAuth::Token(token) = &self.config.auth {
            let token = token.clone();
            connection = connection.with_credentials(move |action| match action {
                gix::credentials::helper::Action::Get(ctx) => Ok(Some(gix::credentials::protocol::Outcome {
                    identity: gix::sec::identity::Account {
                        username: "x-access-token".into(),
                        password: token.clone(),
                        oauth_refresh_token: None,
                    },
                    next: ctx.into(),
                })),
                _ => Ok(None),
            });
        }
        let interrupt = AtomicBool::new(false);
        let pack_dir = repo.objects.store_ref().path().join("pack");
        let done = AtomicBool::new(false);
        let (received, stopped) = std::thread::scope(|scope| {
            let watchdog = scope.spawn(|| self.watch_fetch(&pack_dir, &done, &interrupt));
            let received = connection
                .prepare_fetch(gix::progress::Discard, Default::default())
                .map_err(|e| err(&fetching, e))
                .and_then(|prepared| {
                    prepared
                        .receive(gix::progress::Discard, &interrupt)
                        .map(|_| ())
                        .map_err(|e| err(&fetching, e))
                });
            done.store(true, Ordering::SeqCst);
            (received, watchdog.join().ok().flatten())
        });
        // A fetch that completed although the watchdog fired (it was past the
        // point where gix looks at the flag) stands: its refs have moved.
        match received.as_ref().err().and(stopped) {
            Some(Stop::Size) => Err(err(
                &fetching,
                format!(
                    "the remote sent more than {} bytes, the most one fetch may bring (--max-fetch-bytes); nothing of it was kept",
                    self.config.max_fetch_bytes
                ),
            )),
            Some(Stop::Time) => Err(err(
                &fetching,
                format!(
                    "the fetch took longer than {} s (--fetch-timeout); nothing of it was kept",
                    self.config.fetch_timeout.as_secs()
                ),
            )),
            None => received,
        }?;
        self.tip(&self.config.branch)
    }

    /// Runs beside a fetch until `done`: interrupts it (gix checks the flag
    /// while it reads and indexes the pack, and removes its temporary pack)
    /// once the new files in `pack_dir` grow past the byte limit or the time
    /// limit passes, and returns which.
    fn watch_fetch(&self, pack_dir: &Path, done: &AtomicBool, interrupt: &AtomicBool) -> Option<Stop> {
        let before = dir_bytes(pack_dir);
        let deadline = Instant::now() + self.config.fetch_timeout;
        while !done.load(Ordering::SeqCst) {
            let reason = if dir_bytes(pack_dir).saturating_sub(before) > self.config.max_fetch_bytes {
                Stop::Size
            } else if Instant::now() >= deadline {
                Stop::Time
            } else {
                std::thread::sleep(WATCH_EVERY);
                continue;
            };
            interrupt.store(true, Ordering::SeqCst);
            return Some(reason);
        }
        None
    }

    /// The last fetched tip of `branch`.
    pub(crate) fn tip(&self, branch: &str) -> Result<String, GitError> {
        let repo = self.open()?;
        let name = format!("{REMOTE_REFS}/{branch}");
        let mut reference =
            repo.find_reference(name.as_str()).map_err(|e| err(&format!("branch {branch}"), e))?;
        let id = reference.peel_to_id().map_err(|e| err(&format!("branch {branch}"), e))?;
        Ok(id.to_string())
    }

    /// The files of `commit` that the repository format reads, within
    /// `limits`: only the `migrations/` and `providers/` subtrees are walked,
    /// a blob's size is read from its header before the blob, and symbolic
    /// links and submodules are refused, never followed. Sorted by path.
    pub(crate) fn files_at(&self, commit: &str, limits: &TreeLimits) -> Result<RepoTree, GitError> {
        let repo = self.open()?;
        let id = gix::ObjectId::from_hex(commit.as_bytes()).map_err(|e| err("commit id", e))?;
        let tree = repo
            .find_commit(id)
            .map_err(|e| err(&format!("commit {commit}"), e))?
            .tree()
            .map_err(|e| err(&format!("tree of {commit}"), e))?;
        let mut out = RepoTree::default();
        for top in ["migrations", "providers"] {
            let Some(entry) = tree.find_entry(top) else { continue };
            if !entry.mode().is_tree() {
                out.refused.push(RenderError {
                    path: top.to_owned(),
                    line: None,
                    field: None,
                    message:
                        "is not a folder (a symbolic link or a file); vmmigrate reads no file through a link"
                            .to_owned(),
                });
                continue;
            }
            let subtree = repo.find_tree(entry.oid()).map_err(|e| err(&format!("reading {top}/"), e))?;
            let mut recorder = gix::traverse::tree::Recorder::default();
            subtree.traverse().breadthfirst(&mut recorder).map_err(|e| err("reading the tree", e))?;
            for record in recorder.records {
                let raw = record.filepath.to_vec();
                let shown = format!("{top}/{}", String::from_utf8_lossy(&raw));
                let path = std::str::from_utf8(&raw).ok().map(|p| format!("{top}/{p}"));
                if record.mode.is_tree() {
                    continue;
                }
                if !record.mode.is_blob() {
                    // A symbolic link or a submodule: whatever it points at is not read.
                    out.refused.push(RenderError {
                        path: super::render::escape(&shown),
                        line: None,
                        field: None,
                        message: "is a symbolic link or a submodule; vmmigrate reads no file through a link"
                            .to_owned(),
                    });
                    continue;
                }
                let size =
                    repo.find_header(record.oid).map_err(|e| err(&format!("reading {shown}"), e))?.size();
                out.offer(path.as_deref(), &shown, size, limits, || {
                    let blob = repo.find_blob(record.oid).map_err(std::io::Error::other)?;
                    Ok(blob.data.clone())
                })
                .map_err(|e| err(&format!("reading {shown}"), e))?;
            }
        }
        out.sort();
        Ok(out)
    }
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.to_string_lossy().replace('\'', "'\\''"))
}

/// Why the fetch watchdog interrupted a fetch.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Size,
    Time,
}

/// Bytes of the files directly in `dir` (a pack directory holds no folders);
/// 0 when it cannot be read.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_command_quotes_paths_and_pins_known_hosts() {
        let auth =
            RepoAuth::SshKey { key: "/keys/it's".into(), known_hosts: Some("/keys/known_hosts".into()) };
        let cmd = TrackedRepo::ssh_command(&auth).unwrap();
        assert!(cmd.starts_with(r"ssh -i '/keys/it'\''s' -o IdentitiesOnly=yes"), "{cmd}");
        assert!(cmd.contains("UserKnownHostsFile='/keys/known_hosts' -o StrictHostKeyChecking=yes"), "{cmd}");
        assert_eq!(TrackedRepo::ssh_command(&RepoAuth::Token("t".into())), None);
        assert_eq!(format!("{:?}", RepoAuth::Token("secret".into())), "Token(<redacted>)");
    }

    /// A bare repository at `dir` whose `main` holds one commit with a blob
    /// of `bytes` incompressible bytes (a pull request pushing a disk image).
    fn remote_with_blob(dir: &Path, bytes: usize) -> String {
        let git = |args: &[&str]| {
            let out = std::process::Command::new("git")
                .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let work = dir.join("work");
        let bare = dir.join("remote.git");
        git(&["init", "-q", "-b", "main", work.to_str().unwrap()]);
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let noise: Vec<u8> = (0..bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        std::fs::write(work.join("disk.img"), noise).unwrap();
        git(&["-C", work.to_str().unwrap(), "add", "disk.img"]);
        git(&["-C", work.to_str().unwrap(), "commit", "-q", "-m", "a big blob"]);
        git(&["clone", "-q", "--bare", work.to_str().unwrap(), bare.to_str().unwrap()]);
        bare.to_string_lossy().into_owned()
    }

    fn tracked(url: String, cache: &Path, max_fetch_bytes: u64) -> TrackedRepo {
        TrackedRepo::new(RepoConfig {
            url,
            branch: "main".into(),
            cache_dir: cache.to_path_buf(),
            auth: RepoAuth::None,
            max_fetch_bytes,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
        })
    }

    #[test]
    fn a_fetch_past_the_byte_limit_is_stopped_with_an_error_naming_the_limit_and_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let url = remote_with_blob(dir.path(), 24 << 20);
        let cache = dir.path().join("cache.git");

        let refused = tracked(url.clone(), &cache, 4 << 20).fetch().unwrap_err().to_string();

        assert!(
            refused.contains("more than 4194304 bytes") && refused.contains("--max-fetch-bytes"),
            "{refused}"
        );
        let kept = dir_bytes(&cache.join("objects/pack"));
        assert!(kept < 1 << 20, "{kept} bytes of the refused pack were left in the cache");
        assert!(tracked(url.clone(), &cache, 4 << 20).tip("main").is_err(), "the refused tip was recorded");
        // Within the limit the same remote fetches.
        let tip = tracked(url, &cache, 64 << 20).fetch().unwrap();
        assert_eq!(tip.len(), 40, "{tip}");
    }
}
