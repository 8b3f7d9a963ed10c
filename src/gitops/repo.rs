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

use super::render::{Limits, RenderError, RepoTree};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

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
    GitError { what: what.to_owned(), message: e.to_string() }
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
            remote.connect(gix::remote::Direction::Fetch).map_err(|e| err("connecting", e))?;
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
        connection
            .prepare_fetch(gix::progress::Discard, Default::default())
            .map_err(|e| err("fetching", e))?
            .receive(gix::progress::Discard, &interrupt)
            .map_err(|e| err("fetching", e))?;
        self.tip(&self.config.branch)
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
    pub(crate) fn files_at(&self, commit: &str, limits: &Limits) -> Result<RepoTree, GitError> {
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
}
