//! GitOps: the pull request is the request, the merge is the approval, Git is
//! the audit trail. See docs/gitops.md for the repository format.
//!
//! - `repo`: the tracked repository through gix (fetch, trees at one commit)
//! - `render`: manifests + `defaults.yaml` + `providers/` → VirtualMachineMigrations
//! - `apply`: server-side apply of one commit's migrations, all or nothing
//! - `status_branch`: status files and `STATUS.md`, committed and pushed with the git CLI
//! - `forge`: GitHub and Gitea REST clients; `plan`: the pull-request comment
//! - `webhook`: push and pull-request events from GitHub, Gitea and GitLab
//! - `service`: the loop tying them together (`vmmigrate gitops`)

/// One file of the repository at one commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Path from the repository root with `/` separators, e.g. `migrations/web/web-01.yaml`.
    pub path: String,
    pub bytes: Vec<u8>,
}

/// Where rendered objects came from; written as annotations on every object.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Provenance {
    /// The repository URL as configured (credentials never included).
    pub repo_url: String,
    /// The commit id (hex) the files were read at.
    pub commit: String,
}

/// Annotation with the repository URL.
pub(crate) const ANNOTATION_REPO: &str = "migration.platform.example/git-repository";
/// Annotation with the commit a migration was rendered from.
pub const ANNOTATION_COMMIT: &str = "migration.platform.example/git-commit";
/// Annotation with the manifest's path in the repository.
pub const ANNOTATION_PATH: &str = "migration.platform.example/git-path";
/// Set on a live migration by whoever may edit it, with the path of the
/// manifest allowed to take it over (a migration created with kubectl, or
/// from another repository, that Git is to manage from now on).
pub(crate) const ANNOTATION_ADOPT: &str = "migration.platform.example/adopt";
/// The sha256 of the spec a migration was created with from Git: an
/// approval (`spec.cutover.approved: true`) counts only from a later change
/// of the manifest, never from the change that created it.
pub(crate) const ANNOTATION_CREATED_SPEC: &str = "migration.platform.example/created-spec";
/// Label on every object the gitops side applied (prune and orphan detection).
pub const LABEL_GITOPS: &str = "migration.platform.example/gitops";
/// Annotation set when the manifest of a live migration left Git.
pub(crate) const ANNOTATION_ORPHANED: &str = crate::api::ORPHANED_ANNOTATION;
/// Field manager of the gitops side's server-side apply.
pub const FIELD_MANAGER: &str = "vmmigrate-gitops";

pub mod apply;
pub mod forge;
pub(crate) mod local;
pub mod plan;
pub mod render;
pub(crate) mod repo;
pub mod service;
pub mod status_branch;
pub mod status_files;
pub(crate) mod webhook;
