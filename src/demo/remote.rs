//! The demo's Git side: a bare repository standing in for the team's
//! remote (GitHub, Gitea, …) and a clone standing in for an engineer's
//! laptop, driven with the `git` CLI the way a person would.

use anyhow::{Context as _, ensure};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The bare remote and the engineer's clone of it.
pub(crate) struct GitRemote {
    bare: PathBuf,
    laptop: PathBuf,
}

impl GitRemote {
    /// Creates `<dir>/remote.git` with one commit on `main` holding the
    /// example repository's README and providers, and clones it to `<dir>/laptop`.
    pub(crate) fn create(dir: &Path, examples: &Path) -> anyhow::Result<GitRemote> {
        let remote = GitRemote { bare: dir.join("remote.git"), laptop: dir.join("laptop") };
        git(dir, &["init", "-q", "--bare", "-b", "main", &path_str(&remote.bare)?])?;
        git(dir, &["clone", "-q", &path_str(&remote.bare)?, &path_str(&remote.laptop)?])?;
        git(&remote.laptop, &["checkout", "-q", "-B", "main"])?;
        std::fs::copy(examples.join("README.md"), remote.laptop.join("README.md"))
            .with_context(|| format!("copying {}/README.md", examples.display()))?;
        let providers = remote.laptop.join("providers");
        std::fs::create_dir_all(&providers)?;
        for entry in std::fs::read_dir(examples.join("providers"))? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                std::fs::copy(&path, providers.join(name))?;
            }
        }
        git(&remote.laptop, &["add", "-A"])?;
        git(
            &remote.laptop,
            &["commit", "-q", "-m", "Start from vmmigrate's examples-repo (README, providers)"],
        )?;
        git(&remote.laptop, &["push", "-q", "origin", "main"])?;
        Ok(remote)
    }

    pub(crate) fn bare(&self) -> &Path {
        &self.bare
    }

    /// The engineer's work tree (on the last branch pushed).
    pub(crate) fn laptop(&self) -> &Path {
        &self.laptop
    }

    /// Commits `files` on a new `branch` from `main` and pushes it: the pull request.
    /// Returns the commit.
    pub(crate) fn push_branch(
        &self,
        branch: &str,
        files: &[(&str, &str)],
        message: &str,
    ) -> anyhow::Result<String> {
        git(&self.laptop, &["fetch", "-q", "origin"])?;
        git(&self.laptop, &["checkout", "-q", "-B", branch, "origin/main"])?;
        for (path, content) in files {
            let full = self.laptop.join(path);
            if let Some(parent) = full.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&full, content)?;
        }
        git(&self.laptop, &["add", "-A"])?;
        git(&self.laptop, &["commit", "-q", "-m", message])?;
        git(&self.laptop, &["push", "-q", "origin", &format!("HEAD:refs/heads/{branch}")])?;
        git(&self.laptop, &["rev-parse", "HEAD"])
    }

    /// Fast-forwards `main` to `branch` and pushes it: the merge. Returns the commit.
    pub(crate) fn merge(&self, branch: &str) -> anyhow::Result<String> {
        git(&self.laptop, &["checkout", "-q", "-B", "main", "origin/main"])?;
        git(&self.laptop, &["merge", "-q", "--ff-only", branch])?;
        git(&self.laptop, &["push", "-q", "origin", "main"])?;
        git(&self.laptop, &["rev-parse", "HEAD"])
    }

    /// `git show <rev>:<path>` in the remote, when it exists.
    pub(crate) fn show(&self, rev_path: &str) -> Option<String> {
        let out =
            Command::new("git").arg("--git-dir").arg(&self.bare).args(["show", rev_path]).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The abbreviated commit a ref of the remote points at.
    pub(crate) fn short(&self, rev: &str) -> Option<String> {
        let out = Command::new("git")
            .arg("--git-dir")
            .arg(&self.bare)
            .args(["rev-parse", "--short", rev])
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

fn path_str(path: &Path) -> anyhow::Result<String> {
    path.to_str().map(str::to_owned).with_context(|| format!("{} is not UTF-8", path.display()))
}

/// Runs git in `dir` as "Platform Engineer", ignoring the user's own
/// configuration (signing, hooks, templates); returns trimmed stdout.
fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Platform Engineer", "-c", "user.email=platform@example.test"])
        .args(["-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null"])
        .args(args)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .context("running git (install git)")?;
    ensure!(out.status.success(), "git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
