//! `vmmigrate gitops`: the loop that turns the tracked branch into
//! VirtualMachineMigrations, plans pull requests, and writes status back.
//!
//! Triggers: a poll every `--poll-seconds` (the fallback that always runs),
//! webhook events (a push to the tracked branch syncs at once; a pull-request
//! event plans that PR), and `notify` on a local work tree (`--watch-path`,
//! development only). Every trigger does the same idempotent work, so a lost
//! or duplicated event costs nothing but a fetch.

use super::apply::{ApplyError, ApplyReport, apply_commit};
use super::forge::{Forge, GitHub, Gitea};
use super::plan::{PLAN_MARKER, PlanInput, STATUS_CONTEXT, commit_state, plan_comment, progress_comment};
use super::render::{RenderError, RenderOptions, RenderedMigration, RepoTree, TreeLimits, render_tree};
use super::repo::{RepoAuth, RepoConfig, TrackedRepo};
use super::status_branch::{Snapshot, StatusWriter, StatusWriterConfig, Target, run_coalescing};
use super::status_files::{StatusInput, status_files};
use super::webhook::{WebhookConfig, WebhookEvent, WebhookServer};
use super::{LABEL_GITOPS, Provenance, RepoFile};
use crate::api::{LEFT_ON_SOURCE_LABEL, LeftOnSource, Phase, VirtualMachineMigration};
use crate::machine::tenancy::DestinationRules;
use crate::metrics::Metrics;
use crate::ports::EsxiHost;
use anyhow::Context as _;
use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// What the tracked repository is read for.
const PREFIXES: &[&str] = &["migrations/", "providers/"];
/// Longest one render of one commit may take (within the limits it takes milliseconds).
const RENDER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The command-line flags of [`TreeLimits`] (`render` stays free of the
/// command line).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct TreeLimitFlags {
    /// Largest manifest, defaults or provider file, in bytes.
    #[arg(long = "max-file-bytes", env = "VMMIGRATE_MAX_FILE_BYTES", default_value_t = TreeLimits::DEFAULT.file_bytes)]
    pub file_bytes: u64,
    /// Largest total of those files in one commit, in bytes.
    #[arg(long = "max-repo-bytes", env = "VMMIGRATE_MAX_REPO_BYTES", default_value_t = TreeLimits::DEFAULT.tree_bytes)]
    pub tree_bytes: u64,
    /// Most files under migrations/ and providers/ in one commit.
    #[arg(long = "max-files", env = "VMMIGRATE_MAX_FILES", default_value_t = TreeLimits::DEFAULT.files)]
    pub files: usize,
    /// Deepest folder nesting under migrations/.
    #[arg(long = "max-folder-depth", env = "VMMIGRATE_MAX_FOLDER_DEPTH", default_value_t = TreeLimits::DEFAULT.folder_depth)]
    pub folder_depth: usize,
    /// Deepest nesting of YAML collections in one document.
    #[arg(long = "max-yaml-depth", env = "VMMIGRATE_MAX_YAML_DEPTH", default_value_t = TreeLimits::DEFAULT.yaml_depth)]
    pub yaml_depth: usize,
    /// Most YAML nodes in one document, aliases expanded.
    #[arg(long = "max-yaml-nodes", env = "VMMIGRATE_MAX_YAML_NODES", default_value_t = TreeLimits::DEFAULT.doc_nodes)]
    pub doc_nodes: u64,
    /// Most YAML nodes in one commit, aliases expanded.
    #[arg(long = "max-repo-yaml-nodes", env = "VMMIGRATE_MAX_REPO_YAML_NODES", default_value_t = TreeLimits::DEFAULT.tree_nodes)]
    pub tree_nodes: u64,
}

impl From<TreeLimitFlags> for TreeLimits {
    fn from(f: TreeLimitFlags) -> TreeLimits {
        TreeLimits {
            file_bytes: f.file_bytes,
            tree_bytes: f.tree_bytes,
            files: f.files,
            folder_depth: f.folder_depth,
            yaml_depth: f.yaml_depth,
            doc_nodes: f.doc_nodes,
            tree_nodes: f.tree_nodes,
        }
    }
}

impl Default for TreeLimitFlags {
    fn default() -> TreeLimitFlags {
        let d = TreeLimits::DEFAULT;
        TreeLimitFlags {
            file_bytes: d.file_bytes,
            tree_bytes: d.tree_bytes,
            files: d.files,
            folder_depth: d.folder_depth,
            yaml_depth: d.yaml_depth,
            doc_nodes: d.doc_nodes,
            tree_nodes: d.tree_nodes,
        }
    }
}

/// Settings of the gitops side (flags and `VMMIGRATE_*` environment).
#[derive(Clone, Debug, clap::Args)]
pub struct GitopsOptions {
    /// The repository to track (URL or local path).
    #[arg(long, env = "VMMIGRATE_REPO", required_unless_present = "watch_path", default_value = "")]
    pub repo: String,
    /// Development: read manifests from this local directory (not Git) and
    /// apply on every file change (inotify); status is not written to Git.
    #[arg(long, env = "VMMIGRATE_WATCH_PATH")]
    pub watch_path: Option<PathBuf>,
    /// The tracked branch: merging to it is the approval.
    #[arg(long, env = "VMMIGRATE_BRANCH", default_value = "main")]
    pub branch: String,
    /// Private cache of the repository (a bare clone and the status scratch repo).
    #[arg(long, env = "VMMIGRATE_GIT_CACHE", default_value = "/var/cache/vmmigrate/git")]
    pub cache_dir: PathBuf,
    /// Seconds between polls (the fallback when no webhook arrives).
    #[arg(long, env = "VMMIGRATE_POLL_SECONDS", default_value_t = 30)]
    pub poll_seconds: u64,
    /// Render and report only; Argo CD or Flux applies the manifests.
    #[arg(long, env = "VMMIGRATE_NO_APPLY")]
    pub no_apply: bool,
    /// `metadata.namespace` of manifests that set none.
    #[arg(long, env = "VMMIGRATE_MANIFEST_NAMESPACE", default_value = "vmmigrate")]
    pub manifest_namespace: String,
    /// The status branch (owned by vmmigrate).
    #[arg(long, env = "VMMIGRATE_STATUS_BRANCH", default_value = "migration-status")]
    pub status_branch: String,
    /// Write status under this directory of the tracked branch instead of a status branch.
    #[arg(long, env = "VMMIGRATE_STATUS_DIR", conflicts_with = "status_branch")]
    pub status_dir: Option<String>,
    /// Do not write status to Git.
    #[arg(long, env = "VMMIGRATE_NO_STATUS")]
    pub no_status: bool,
    /// The controller's namespace: its records of what deleted migrations
    /// left on their sources are written to the status files from there.
    #[arg(long, env = "POD_NAMESPACE", default_value = "vmmigrate-system")]
    pub system_namespace: String,
    /// At most one status commit per this many seconds.
    #[arg(long, env = "VMMIGRATE_STATUS_WINDOW_SECONDS", default_value_t = 10)]
    pub status_window_seconds: u64,
    /// Address of the webhook receiver (off when absent).
    #[arg(long, env = "VMMIGRATE_WEBHOOK_LISTEN")]
    pub webhook_listen: Option<SocketAddr>,
    #[arg(long, env = "VMMIGRATE_GITHUB_WEBHOOK_SECRET", hide_env_values = true)]
    pub github_webhook_secret: Option<String>,
    #[arg(long, env = "VMMIGRATE_GITEA_WEBHOOK_SECRET", hide_env_values = true)]
    pub gitea_webhook_secret: Option<String>,
    #[arg(long, env = "VMMIGRATE_GITLAB_WEBHOOK_TOKEN", hide_env_values = true)]
    pub gitlab_webhook_token: Option<String>,
    /// The forge for pull-request plans: `github` or `gitea`.
    #[arg(long, env = "VMMIGRATE_FORGE", value_parser = ["github", "gitea"])]
    pub forge: Option<String>,
    /// The forge's API base, e.g. https://api.github.com or https://gitea.example/api/v1.
    #[arg(long, env = "VMMIGRATE_FORGE_API")]
    pub forge_api: Option<String>,
    /// `owner/name` of the repository on the forge.
    #[arg(long, env = "VMMIGRATE_FORGE_REPO")]
    pub forge_repo: Option<String>,
    #[arg(long, env = "VMMIGRATE_FORGE_TOKEN", hide_env_values = true)]
    pub forge_token: Option<String>,
    /// The account the forge token comments as, the only one whose plan
    /// comments are edited. Default: asked from the forge (`GET /user`) at
    /// start-up; needed for GitHub app installation tokens (`<app-slug>[bot]`),
    /// which cannot ask.
    #[arg(long, env = "VMMIGRATE_FORGE_LOGIN")]
    pub forge_login: Option<String>,
    /// SSH private key for a private repository (from a mounted Secret).
    #[arg(long, env = "VMMIGRATE_GIT_SSH_KEY")]
    pub ssh_key: Option<PathBuf>,
    /// known_hosts for the repository's SSH host.
    #[arg(long, env = "VMMIGRATE_GIT_KNOWN_HOSTS")]
    pub known_hosts: Option<PathBuf>,
    /// Token for a private HTTPS repository.
    #[arg(long, env = "VMMIGRATE_GIT_TOKEN", hide_env_values = true)]
    pub git_token: Option<String>,
    /// The administrator's destination rules (`--allow-destination` of the subcommand).
    #[arg(skip)]
    pub destinations: DestinationRules,
    /// The administrator's folder bindings (`--tenant` of the subcommand).
    #[arg(skip)]
    pub tenants: crate::machine::tenancy::TenantBindings,
    #[command(flatten)]
    pub limits: TreeLimitFlags,
    /// Largest pack one fetch of the repository may bring, in bytes; past it
    /// the fetch is stopped and nothing of it is kept.
    #[arg(long, env = "VMMIGRATE_MAX_FETCH_BYTES", default_value_t = super::repo::DEFAULT_MAX_FETCH_BYTES)]
    pub max_fetch_bytes: u64,
    /// Longest one fetch of the repository may take, in seconds.
    #[arg(long, env = "VMMIGRATE_FETCH_TIMEOUT", default_value_t = super::repo::DEFAULT_FETCH_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    pub fetch_timeout: u64,
}

impl GitopsOptions {
    /// These options under the administrator's destination rules.
    pub(crate) fn with_destinations(mut self, rules: DestinationRules) -> GitopsOptions {
        self.destinations = rules;
        self
    }

    /// These options with the administrator's folder bindings.
    pub fn with_tenants(mut self, tenants: crate::machine::tenancy::TenantBindings) -> GitopsOptions {
        self.tenants = tenants;
        self
    }
}

/// What one sync of the tracked branch did.
#[derive(Debug)]
pub enum SyncOutcome {
    /// The tip was already applied.
    UpToDate {
        commit: String,
    },
    Applied {
        commit: String,
        report: ApplyReport,
    },
    /// Rendered and valid, not applied (`--no-apply`).
    Rendered {
        commit: String,
        migrations: usize,
    },
    /// The commit has errors: nothing of it was applied.
    Rejected {
        commit: String,
        errors: Vec<String>,
    },
}

/// A posted plan: the comment body and the (namespace, name) of its migrations.
type PlannedPr = (String, Vec<(String, String)>);

#[derive(Default)]
struct State {
    last_applied: Option<String>,
    last_rejected: Option<(String, Vec<String>)>,
    orphaned: Vec<(String, String)>,
    /// PR number → head sha last planned.
    planned: HashMap<u64, String>,
    /// Merged PRs whose comment still follows progress.
    following: HashMap<u64, PlannedPr>,
    /// Last plan per PR, reused after the merge.
    plans: HashMap<u64, PlannedPr>,
}

/// The gitops side.
pub struct Gitops {
    client: Client,
    opts: GitopsOptions,
    repo: Arc<TrackedRepo>,
    forge: Option<Arc<dyn Forge>>,
    /// Read-only discovery of a plan's source VMs, when configured.
    discoverer: Option<Arc<dyn EsxiHost>>,
    /// Where the controller keeps its source-VM claims, for plans that
    /// discover: a second migration of a claimed VM fails its plan.
    claims: Option<crate::objects::claims::SourceClaims>,
    state: Mutex<State>,
    ticks: std::sync::atomic::AtomicU64,
    metrics: Arc<Metrics>,
    /// One render at a time: a hostile commit holds at most one commit's limits of memory.
    render_slot: tokio::sync::Semaphore,
}

impl Gitops {
    pub fn new(client: Client, opts: GitopsOptions) -> anyhow::Result<Gitops> {
        if opts.repo.is_empty() && opts.watch_path.is_none() {
            anyhow::bail!("--repo is required (or --watch-path for a local directory)");
        }
        if url_carries_credentials(&opts.repo) {
            anyhow::bail!(
                "--repo carries a user or token in its URL; give the token as VMMIGRATE_GIT_TOKEN (--git-token) \
                 so that it never reaches annotations, STATUS.md, logs or plan comments"
            );
        }
        let auth = match (&opts.ssh_key, &opts.git_token) {
            (Some(key), _) => RepoAuth::SshKey { key: key.clone(), known_hosts: opts.known_hosts.clone() },
            (None, Some(token)) => RepoAuth::Token(token.clone()),
            (None, None) => RepoAuth::None,
        };
        let repo = TrackedRepo::new(RepoConfig {
            url: opts.repo.clone(),
            branch: opts.branch.clone(),
            cache_dir: opts.cache_dir.join("tracked.git"),
            auth,
            max_fetch_bytes: opts.max_fetch_bytes,
            fetch_timeout: std::time::Duration::from_secs(opts.fetch_timeout),
        });
        let forge: Option<Arc<dyn Forge>> = match opts.forge.as_deref() {
            None => None,
            Some(kind) => {
                let api = opts.forge_api.clone().context("--forge needs --forge-api")?;
                forge_api_is_safe(&api)?;
                let full = opts.forge_repo.clone().context("--forge needs --forge-repo owner/name")?;
                let (owner, name) = full.split_once('/').context("--forge-repo must be owner/name")?;
                let token = opts.forge_token.clone().context("--forge needs VMMIGRATE_FORGE_TOKEN")?;
                let login = opts.forge_login.clone();
                Some(match kind {
                    "github" => Arc::new(GitHub::new(&api, owner, name, &token)?.with_login(login)),
                    _ => Arc::new(Gitea::new(&api, owner, name, &token)?.with_login(login)),
                })
            }
        };
        Ok(Gitops {
            client,
            opts,
            repo: Arc::new(repo),
            forge,
            discoverer: None,
            claims: None,
            state: Mutex::new(State::default()),
            ticks: Default::default(),
            metrics: Arc::default(),
            render_slot: tokio::sync::Semaphore::new(1),
        })
    }

    /// Records fetches, applies, webhook deliveries and readiness in
    /// `metrics` (the default: a registry of its own).
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>) -> Gitops {
        self.metrics = metrics;
        self
    }

    /// Plans include a read-only discovery of each source VM through `esxi`.
    /// Plans check discovered VMs against the controller's claims in
    /// `namespace` (its `--lease-namespace`).
    pub fn with_source_claims(mut self, namespace: &str) -> Gitops {
        self.claims = Some(crate::objects::claims::SourceClaims::new(self.client.clone(), namespace));
        self
    }

    pub fn with_discoverer(mut self, esxi: Arc<dyn EsxiHost>) -> Gitops {
        self.discoverer = Some(esxi);
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn render_options(&self) -> RenderOptions {
        RenderOptions::new(&self.opts.manifest_namespace, &self.opts.destinations)
            .with_limits(TreeLimits::from(self.opts.limits))
            .with_tenants(self.opts.tenants.clone())
    }

    async fn fetch(&self) -> anyhow::Result<String> {
        let repo = self.repo.clone();
        Ok(tokio::task::spawn_blocking(move || repo.fetch()).await??)
    }

    async fn files_at(&self, commit: &str) -> anyhow::Result<RepoTree> {
        let repo = self.repo.clone();
        let commit = commit.to_owned();
        let limits = TreeLimits::from(self.opts.limits);
        Ok(tokio::task::spawn_blocking(move || repo.files_at(&commit, &limits)).await??)
    }

    /// Renders off the async threads (the loop keeps serving webhooks and
    /// other pull requests), one commit at a time, within the limits; a render
    /// that takes longer than [`RENDER_TIMEOUT`] is reported as over the limit.
    async fn render(&self, tree: RepoTree, commit: &str) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
        let _one = self.render_slot.acquire().await;
        let provenance = self.provenance(commit);
        let opts = self.render_options();
        let work = tokio::task::spawn_blocking(move || render_tree(&tree, &provenance, &opts));
        let over =
            |message: String| vec![RenderError { path: "(commit)".into(), line: None, field: None, message }];
        match tokio::time::timeout(RENDER_TIMEOUT, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(over(format!("rendering failed: {e}"))),
            Err(_) => Err(over(format!(
                "rendering took longer than {} s (the limit); nothing is applied",
                RENDER_TIMEOUT.as_secs()
            ))),
        }
    }

    fn provenance(&self, commit: &str) -> Provenance {
        Provenance { repo_url: self.opts.repo.clone(), commit: commit.to_owned() }
    }

    /// The last commit applied (or validated, with `--no-apply`).
    pub(crate) fn last_applied(&self) -> Option<String> {
        self.state().last_applied.clone()
    }

    /// Fetches the tracked branch and applies its tip when it is new.
    pub async fn sync(&self) -> anyhow::Result<SyncOutcome> {
        let (commit, local_files) = match &self.opts.watch_path {
            Some(path) => {
                let path = path.clone();
                let limits = TreeLimits::from(self.opts.limits);
                let tree = tokio::task::spawn_blocking(move || super::render::read_dir_files(&path, &limits))
                    .await??;
                (working_tree_id(&tree.files), Some(tree))
            }
            None => {
                let fetched = self.fetch().await;
                self.metrics.git_fetch(fetched.is_ok());
                (fetched?, None)
            }
        };
        if self.state().last_applied.as_deref() == Some(commit.as_str()) {
            return Ok(SyncOutcome::UpToDate { commit });
        }
        if self.state().last_rejected.as_ref().is_some_and(|(c, _)| *c == commit) {
            let errors = self.state().last_rejected.clone().map(|(_, e)| e).unwrap_or_default();
            return Ok(SyncOutcome::Rejected { commit, errors });
        }
        let tree = match local_files {
            Some(tree) => tree,
            None => self.files_at(&commit).await?,
        };
        let rendered = match self.render(tree, &commit).await {
            Ok(r) => r,
            Err(errors) => {
                let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
                tracing::error!(%commit, errors = errors.len(), first = %errors[0], "commit rejected: nothing applied");
                self.metrics.git_apply("rejected");
                self.state().last_rejected = Some((commit.clone(), errors.clone()));
                return Ok(SyncOutcome::Rejected { commit, errors });
            }
        };
        if self.opts.no_apply {
            self.state().last_applied = Some(commit.clone());
            return Ok(SyncOutcome::Rendered { commit, migrations: rendered.len() });
        }
        let applied = apply_commit(&self.client, &rendered, &[], &self.opts.repo).await;
        self.metrics.git_apply(match &applied {
            Ok(_) => "applied",
            Err(ApplyError::Refused(_)) => "rejected",
            Err(_) => "error",
        });
        match applied {
            Ok(report) => {
                tracing::info!(%commit, applied = report.applied.len(), held = report.held.len(), orphaned = report.orphaned.len(), "commit applied");
                let mut state = self.state();
                state.last_applied = Some(commit.clone());
                state.orphaned = report.orphaned.clone();
                Ok(SyncOutcome::Applied { commit, report })
            }
            Err(ApplyError::Refused(errors)) => {
                self.state().last_rejected = Some((commit.clone(), errors.clone()));
                Ok(SyncOutcome::Rejected { commit, errors })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The status files for `live` (the migrations vmmigrate applied, as the
    /// watch of [`watch_live`] holds them) at the last applied commit.
    pub(crate) fn status_snapshot(
        &self,
        live: &Store<VirtualMachineMigration>,
        left: &Store<ConfigMap>,
    ) -> Option<Snapshot> {
        let commit = self.last_applied()?;
        let mut migrations: Vec<VirtualMachineMigration> =
            live.state().iter().map(|m| (**m).clone()).collect();
        migrations.sort_by_key(|m| (m.namespace(), m.name_any()));
        let orphaned = self.state().orphaned.clone();
        let left_on_source = left.state().iter().filter_map(|cm| LeftOnSource::from_config_map(cm)).collect();
        let files = status_files(&StatusInput {
            migrations,
            source_commit: commit.clone(),
            orphaned,
            left_on_source,
        });
        Some((files, commit))
    }

    /// Plans every open pull request into the tracked branch whose head moved.
    pub async fn plan_pull_requests(&self) -> anyhow::Result<usize> {
        let Some(forge) = self.forge.clone() else { return Ok(0) };
        let prs = forge.open_pull_requests().await?;
        // Planned PRs that are no longer open: merged ones are followed until
        // their migrations end; closed ones are forgotten.
        let gone: Vec<u64> = {
            let st = self.state();
            st.planned.keys().filter(|n| !prs.iter().any(|p| p.number == **n)).copied().collect()
        };
        for number in gone {
            let pr = forge.pull_request(number).await?;
            let mut st = self.state();
            st.planned.remove(&number);
            if pr.merged
                && let Some(plan) = st.plans.remove(&number)
            {
                st.following.insert(number, plan);
            }
        }
        let mut planned = 0;
        for pr in prs.into_iter().filter(|p| p.base_ref == self.opts.branch) {
            if self.state().planned.get(&pr.number) == Some(&pr.head_sha) {
                continue;
            }
            // One pull request's failure (a forge outage, a comment the
            // forge will not let us edit) is reported and the others go on;
            // it is planned again on the next round.
            match self.plan_one(forge.as_ref(), &pr).await {
                Ok(true) => planned += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(pr = pr.number, head = %pr.head_sha, error = %format!("{e:#}"), "cannot plan the pull request; trying again next round");
                }
            }
        }
        Ok(planned)
    }

    /// Plans one pull request; `false` when it changes nothing vmmigrate reads.
    async fn plan_one(&self, forge: &dyn Forge, pr: &super::forge::PullRequest) -> anyhow::Result<bool> {
        let changed = forge.changed_files(pr.number).await?;
        if !changed.iter().any(|p| PREFIXES.iter().any(|prefix| p.starts_with(prefix))) {
            return Ok(false);
        }
        self.fetch().await?;
        let (input, names) = self.plan_commit(&pr.head_sha, &changed).await?;
        let comment = plan_comment(&input);
        forge.upsert_comment(pr.number, PLAN_MARKER, &comment).await?;
        let (state, description) = commit_state(&input);
        forge.set_commit_status(&pr.head_sha, STATUS_CONTEXT, state, &description, None).await?;
        let mut st = self.state();
        st.planned.insert(pr.number, pr.head_sha.clone());
        st.plans.insert(pr.number, (comment, names));
        Ok(true)
    }

    /// The plan of one commit: render, validate, diff against the live objects.
    async fn plan_commit(
        &self,
        head: &str,
        changed: &[String],
    ) -> anyhow::Result<(PlanInput, Vec<(String, String)>)> {
        let tree = self.files_at(head).await?;
        let mut input = PlanInput { head_sha: head.to_owned(), ..Default::default() };
        let present: std::collections::BTreeSet<&str> = tree.files.iter().map(|f| f.path.as_str()).collect();
        input.removed = changed
            .iter()
            .filter(|p| p.starts_with("migrations/") && !present.contains(p.as_str()))
            .cloned()
            .collect();
        let rendered = match self.render(tree, head).await {
            Ok(r) => r,
            Err(errors) => {
                input.errors = errors.iter().map(ToString::to_string).collect();
                return Ok((input, Vec::new()));
            }
        };
        let mut names = Vec::new();
        let paths = rendered.iter().map(|r| r.path.as_str()).collect();
        for r in rendered.iter().filter(|r| changed.contains(&r.path)) {
            names.push((r.namespace.clone(), r.name.clone()));
            match super::local::plan_entry(Some(&self.client), Some(&self.opts.repo), r, &paths).await? {
                Ok(mut entry) => {
                    let found = self.discover(r).await;
                    // A Secret pointed at a host it is not bound to fails
                    // the plan: merged, it would stop at its first look.
                    if let Some(Err(why)) = &found
                        && why.starts_with(crate::api::Reason::CredentialsNotForHost.as_str())
                    {
                        input.errors.push(format!("{}: spec.source.credentialsSecretRef: {why}", r.path));
                    }
                    entry.discovery = found
                        .as_ref()
                        .map(|f| f.as_ref().map(|(vmm, inv)| summary(&vmm.spec, inv)).map_err(Clone::clone));
                    if let Some(Ok((vmm, inventory))) = &found
                        && let Some(holder) = self.claim_holder(vmm, inventory).await
                        && holder != format!("{}/{}", r.namespace, r.name)
                    {
                        input.errors.push(format!(
                            "{}: spec.source: the source VM is already being migrated by {holder}; this \
                             migration would be refused at Validated (SourceVMClaimed)",
                            r.path
                        ));
                    }
                    input.entries.push(entry);
                }
                Err(refusal) => input.errors.push(refusal),
            }
        }
        Ok((input, names))
    }

    /// Read-only discovery of the manifest's source VM, bounded in time.
    async fn discover(
        &self,
        r: &RenderedMigration,
    ) -> Option<Result<(VirtualMachineMigration, crate::api::SourceInventory), String>> {
        let esxi = self.discoverer.clone()?;
        let vmm: VirtualMachineMigration = match serde_json::from_value(r.object.clone()) {
            Ok(v) => v,
            Err(e) => return Some(Err(e.to_string())),
        };
        Some(match tokio::time::timeout(Duration::from_secs(20), esxi.discover(&vmm)).await {
            Err(_) => Err("the host did not answer within 20 s".to_owned()),
            Ok(Err(failure)) => Err(failure.to_string()),
            Ok(Ok(inventory)) => Ok((vmm, inventory)),
        })
    }

    /// The migration (`namespace/name`) holding the claim on a discovered
    /// VM, if any; a claim that cannot be read is not shown.
    async fn claim_holder(
        &self,
        vmm: &VirtualMachineMigration,
        inventory: &crate::api::SourceInventory,
    ) -> Option<String> {
        let identity = crate::objects::claims::identity_of(inventory, &vmm.spec.source);
        match self.claims.as_ref()?.holder_of(&identity).await {
            Ok(holder) => holder,
            Err(e) => {
                tracing::warn!(error = %e, "plan: cannot read the source-VM claims");
                None
            }
        }
    }

    /// After a merge, keeps the PR's comment up to date with the progress of
    /// its migrations until all of them end.
    pub(crate) async fn follow_merged(&self, number: u64) -> anyhow::Result<()> {
        let Some(forge) = self.forge.clone() else { return Ok(()) };
        let pr = forge.pull_request(number).await?;
        if !pr.merged {
            return Ok(());
        }
        let mut st = self.state();
        st.planned.remove(&number);
        if let Some(plan) = st.plans.remove(&number) {
            st.following.insert(number, plan);
        }
        Ok(())
    }

    /// Updates the comments of merged pull requests with their migrations' progress.
    pub async fn update_followed(&self) -> anyhow::Result<()> {
        let Some(forge) = self.forge.clone() else { return Ok(()) };
        let following: Vec<(u64, PlannedPr)> =
            self.state().following.iter().map(|(k, v)| (*k, v.clone())).collect();
        for (number, (plan, names)) in following {
            let mut rows = Vec::new();
            let mut all_done = true;
            for (ns, name) in &names {
                let api: Api<VirtualMachineMigration> = Api::namespaced(self.client.clone(), ns);
                let Some(vmm) = api.get_opt(name).await? else {
                    all_done = false;
                    continue;
                };
                let status = vmm.status.unwrap_or_default();
                let percent = status.progress.as_ref().map(|p| p.percent).unwrap_or(0);
                let last = status.errors.last().map(|e| format!("{}: {}", e.reason, e.message));
                if !matches!(status.phase, Phase::Completed | Phase::Failed) {
                    all_done = false;
                }
                let phase = match &status.waiting {
                    Some(w) => format!("{} · waiting: {}", status.phase, w.message),
                    None => status.phase.to_string(),
                };
                rows.push((name.clone(), phase, percent, last));
            }
            forge.upsert_comment(number, PLAN_MARKER, &progress_comment(&plan, &rows)).await?;
            if all_done {
                self.state().following.remove(&number);
            }
        }
        Ok(())
    }

    /// How many triggers (polls and webhook events) were handled.
    pub fn ticks(&self) -> u64 {
        self.ticks.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Everything one trigger does.
    pub(crate) async fn tick(&self) {
        self.ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.metrics.register_readiness("gitops");
        let synced = self.sync().await;
        if synced.is_ok() {
            // Ready after the first sync that reached the repository (a
            // rejected commit included: the loop works, the commit does not).
            self.metrics.set_ready("gitops", true);
        }
        match synced {
            Ok(SyncOutcome::Rejected { commit, errors }) => {
                tracing::warn!(%commit, first = %errors.first().cloned().unwrap_or_default(), "tracked branch has errors")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "sync failed; the next poll retries"),
        }
        if let Err(e) = self.plan_pull_requests().await {
            tracing::warn!(error = %format!("{e:#}"), "planning pull requests failed");
        }
        if let Err(e) = self.update_followed().await {
            tracing::warn!(error = %format!("{e:#}"), "updating merged pull requests failed");
        }
    }
}

/// A stable id for the contents of a local work tree (`--watch-path`), so
/// unchanged files are not applied again.
fn working_tree_id(files: &[RepoFile]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for f in files {
        hasher.update(f.path.as_bytes());
        hasher.update([0]);
        hasher.update((f.bytes.len() as u64).to_le_bytes());
        hasher.update(&f.bytes);
    }
    let hex: String = hasher.finalize().iter().take(10).map(|b| format!("{b:02x}")).collect();
    format!("working-tree-{hex}")
}

/// Watches a local directory and sends a tick on every change.
fn watch_directory(
    path: &std::path::Path,
    ticks: mpsc::Sender<()>,
) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = ticks.try_send(());
        }
    })?;
    watcher.watch(path, notify::RecursiveMode::Recursive)?;
    Ok(watcher)
}

/// A running gitops side.
pub struct GitopsHandle {
    pub gitops: Arc<Gitops>,
    /// Where the webhook receiver listens, when enabled.
    pub webhook_addr: Option<SocketAddr>,
    pub webhook_stats: Option<Arc<super::webhook::WebhookStats>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl GitopsHandle {
    /// Stops the loop, flushes the last status snapshot and waits for both.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for GitopsHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One line on a discovered VM for the plan comment.
fn summary(spec: &crate::api::VirtualMachineMigrationSpec, inv: &crate::api::SourceInventory) -> String {
    let disks: Vec<String> = inv
        .disks
        .iter()
        .map(|d| format!("{} {} GiB on {}", d.device, d.capacity_bytes as f64 / (1u64 << 30) as f64, d.bus))
        .collect();
    let nics: Vec<String> =
        inv.nics.iter().map(|n| format!("{} on {:?} ({})", n.model, n.network, n.mac_address)).collect();
    let mut text = format!(
        "VM {:?} (vmid {}), {:?}, {} vCPU, {} MiB, {:?} firmware, snapshots {}; disks: {}; NICs: {}",
        inv.name,
        inv.vmid,
        inv.power_state,
        inv.cpu_sockets * inv.cores_per_socket,
        inv.memory_mib,
        inv.firmware,
        inv.snapshots,
        disks.join(", "),
        nics.join(", ")
    );
    // What happens to the guest, and why (spec.conversion.guest).
    let plan = crate::machine::compatibility::guest_plan(spec, inv);
    let fate = match (plan.convert, plan.emulated_devices) {
        (true, _) => "converted with virt-v2v",
        (false, true) => "moved as it is on SATA disks and e1000e NICs",
        (false, false) => "moved as it is",
    };
    text.push_str(&format!("; guest {:?}: {fate} ({})", inv.guest_os, plan.why));
    // What its hardware means, as Validated will decide it.
    let found = crate::machine::compatibility::findings(spec, inv);
    for (what, list) in [("blocks the move", &found.blockers), ("moves with a caveat", &found.warnings)] {
        if !list.is_empty() {
            let items: Vec<String> = list.iter().map(|b| format!("{}: {}", b.reason, b.message)).collect();
            text.push_str(&format!("; {what}: {}", items.join("; ")));
        }
    }
    text
}

/// Whether a repository URL holds credentials: any user information in an
/// `http(s)://` URL (a token is often given as the user), a password in any.
fn url_carries_credentials(url: &str) -> bool {
    let Some((scheme, rest)) = url.split_once("://") else { return false };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let Some((userinfo, _host)) = authority.rsplit_once('@') else { return false };
    scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") || userinfo.contains(':')
}

/// The token as git configuration in the environment of the status
/// writer's `git` (GIT_CONFIG_COUNT, git 2.31 and later): an
/// `Authorization` header sent to the repository's URL only, as the fetcher
/// sends it (user `x-access-token`); never in a URL, an argument or a file.
fn token_env(url: &str, token: &str) -> Vec<(String, String)> {
    use base64::Engine as _;
    let pair = base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"));
    vec![
        ("GIT_CONFIG_COUNT".into(), "1".into()),
        ("GIT_CONFIG_KEY_0".into(), format!("http.{url}.extraHeader")),
        ("GIT_CONFIG_VALUE_0".into(), format!("Authorization: Basic {pair}")),
    ]
}

/// Whose comments the bot may edit, known before the first plan. A forge
/// that cannot say is a configuration error; one that is down is asked
/// again before the first edit.
async fn resolve_forge_account(forge: &dyn Forge) -> anyhow::Result<()> {
    match forge.login().await {
        Ok(login) => tracing::info!(%login, "forge: plan comments are written and edited as this account"),
        Err(e) if !e.retryable() && matches!(e.status, Some(401 | 403 | 404)) => {
            anyhow::bail!("resolving the forge account: {e}")
        }
        Err(e) => {
            tracing::warn!(error = %e, "forge: cannot resolve the bot's account yet; no comment is edited until it is known")
        }
    }
    Ok(())
}

/// The webhook receiver on `addr`, its secrets checked before it listens.
async fn start_webhooks(
    addr: std::net::SocketAddr,
    opts: &GitopsOptions,
    events: mpsc::Sender<WebhookEvent>,
) -> anyhow::Result<WebhookServer> {
    let config = WebhookConfig {
        github_secret: opts.github_webhook_secret.clone(),
        gitea_secret: opts.gitea_webhook_secret.clone(),
        gitlab_token: opts.gitlab_webhook_token.clone(),
    };
    config.validate().map_err(anyhow::Error::msg)?;
    let listener = crate::server::bind(addr).with_context(|| format!("binding {addr}"))?;
    let server = WebhookServer::start(listener, config, events).await?;
    tracing::info!(addr = %server.local_addr(), "webhook receiver listening");
    Ok(server)
}

/// Where status is written (the status branch, or a folder of the tracked
/// branch) and with which credentials: the fetcher's own, for the pushes.
fn status_writer_config(opts: &GitopsOptions, metrics: Arc<Metrics>) -> anyhow::Result<StatusWriterConfig> {
    let target = match &opts.status_dir {
        Some(dir) => {
            status_dir_is_safe(dir)?;
            Target::Directory { branch: opts.branch.clone(), dir: dir.clone() }
        }
        None => Target::Branch(opts.status_branch.clone()),
    };
    let mut cfg = StatusWriterConfig::new(opts.repo.clone(), opts.cache_dir.join("status.git"));
    cfg.target = target;
    cfg.metrics = metrics;
    if let Some(key) = &opts.ssh_key {
        let auth = RepoAuth::SshKey { key: key.clone(), known_hosts: opts.known_hosts.clone() };
        if let Some(cmd) = TrackedRepo::ssh_command(&auth) {
            cfg.git_env.push(("GIT_SSH_COMMAND".into(), cmd));
        }
    } else if let Some(token) = &opts.git_token {
        cfg.git_env.extend(token_env(&opts.repo, token));
    }
    Ok(cfg)
}

pub async fn start(
    client: Client,
    opts: GitopsOptions,
    metrics: Arc<Metrics>,
) -> anyhow::Result<GitopsHandle> {
    let gitops = Arc::new(Gitops::new(client.clone(), opts.clone())?.with_metrics(metrics.clone()));
    if let Some(forge) = &gitops.forge {
        resolve_forge_account(forge.as_ref()).await?;
    }
    let (events_tx, mut events) = mpsc::channel::<WebhookEvent>(64);
    let webhooks = match opts.webhook_listen {
        Some(addr) => Some(start_webhooks(addr, &opts, events_tx).await?),
        None => None,
    };
    let webhook_addr = webhooks.as_ref().map(|w| w.local_addr());
    let webhook_stats = webhooks.as_ref().map(|w| w.stats());
    // Status write-back: a snapshot task feeding the coalescing writer.
    let (status_tx, status_rx) = watch::channel::<Option<Snapshot>>(None);
    let (file_ticks_tx, mut file_ticks) = mpsc::channel::<()>(1);
    let watcher = match &opts.watch_path {
        Some(path) => Some(watch_directory(path, file_ticks_tx).context("watching the local directory")?),
        None => None,
    };
    let writer_task = if opts.no_status || opts.watch_path.is_some() {
        None
    } else {
        let writer = Arc::new(StatusWriter::new(status_writer_config(&opts, metrics)?));
        Some(tokio::spawn(run_coalescing(writer, status_rx, Duration::from_secs(opts.status_window_seconds))))
    };
    // Status needs the live migrations: one watch, only when status is written.
    let mut live = writer_task.as_ref().map(|_| watch_live(client.clone(), &opts.system_namespace));
    let (shutdown_tx, mut shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let looping = gitops.clone();
    let poll_every = Duration::from_secs(opts.poll_seconds.max(1));
    let task = tokio::spawn(async move {
        let _webhooks = webhooks;
        let _watcher = watcher;
        let mut poll = tokio::time::interval(poll_every);
        // A snapshot at most once a second, and only after something changed.
        let mut snapshot_every = tokio::time::interval(Duration::from_secs(1));
        let mut changed = false;
        let mut last: Option<Snapshot> = None;
        loop {
            tokio::select! {
                _ = &mut shutdown_rx => break,
                _ = poll.tick() => {
                    looping.tick().await;
                    changed = true;
                }
                Some(event) = events.recv() => {
                    tracing::info!(?event, "webhook event");
                    looping.metrics.webhook_delivered(event.forge().as_str());
                    if let WebhookEvent::PullRequest { number, merged: true, .. } = &event {
                        let _ = looping.follow_merged(*number).await;
                    }
                    looping.tick().await;
                    changed = true;
                }
                Some(()) = file_ticks.recv() => {
                    looping.tick().await;
                    changed = true;
                }
                Some(()) = async { match live.as_mut() { Some(l) => l.changes.recv().await, None => None } } => {
                    changed = true;
                }
                _ = snapshot_every.tick(), if changed => {
                    if let Some(l) = live.as_ref().filter(|l| l.ready())
                        && let Some(s) = looping.status_snapshot(&l.store, &l.left)
                    {
                        changed = false;
                        if last.as_ref() != Some(&s) {
                            last = Some(s.clone());
                            let _ = status_tx.send(Some(s));
                        }
                    }
                }
            }
        }
        // One last snapshot, then closing the channel flushes it.
        if let Some(l) = live.as_ref().filter(|l| l.ready())
            && let Some(s) = looping.status_snapshot(&l.store, &l.left)
            && last.as_ref() != Some(&s)
        {
            let _ = status_tx.send(Some(s));
        }
        drop(status_tx);
        drop(live);
        if let Some(task) = writer_task {
            let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
        }
    });
    Ok(GitopsHandle { gitops, webhook_addr, webhook_stats, shutdown: Some(shutdown_tx), task })
}

/// The migrations vmmigrate applied, kept by one watch (`LABEL_GITOPS=true`,
/// all namespaces) instead of a list every second.
struct LiveMigrations {
    store: Store<VirtualMachineMigration>,
    /// The controller's records of what deleted migrations left on their
    /// sources (ConfigMaps labelled `LEFT_ON_SOURCE_LABEL` in its namespace).
    /// Not waited for: until listed (or without the right to), none.
    left: Store<ConfigMap>,
    left_task: tokio::task::JoinHandle<()>,
    /// A message after the first full list and after every change since.
    changes: mpsc::Receiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl LiveMigrations {
    /// The first list has arrived: the store is the cluster, not a part of it.
    fn ready(&self) -> bool {
        self.store.wait_until_ready().now_or_never().is_some_and(|r| r.is_ok())
    }
}

impl Drop for LiveMigrations {
    fn drop(&mut self) {
        self.task.abort();
        self.left_task.abort();
    }
}

fn watch_live(client: Client, system_namespace: &str) -> LiveMigrations {
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let (store, writer) = reflector::store();
    let (tx, changes) = mpsc::channel(1);
    let (left, left_writer) = reflector::store();
    let left_api = Api::<ConfigMap>::namespaced(client.clone(), system_namespace);
    let left_tx = tx.clone();
    let left_task = tokio::spawn(async move {
        let config = watcher::Config::default().labels(&format!("{LEFT_ON_SOURCE_LABEL}=true"));
        let events = watcher(left_api, config).default_backoff().reflect(left_writer);
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
                Ok(_) => {
                    let _ = left_tx.try_send(());
                }
                Err(e) => tracing::warn!(error = %e, "watching the records of what was left on sources"),
            }
        }
    });
    let api = Api::<VirtualMachineMigration>::all(client);
    let config = watcher::Config::default().labels(&format!("{LABEL_GITOPS}=true"));
    let task = tokio::spawn(async move {
        let events = watcher(api, config).default_backoff().reflect(writer);
        let mut events = std::pin::pin!(events);
        let mut listed = false;
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::InitDone) => listed = true,
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "watching migrations for status");
                    continue;
                }
            }
            if listed {
                // Full: a snapshot is pending anyway.
                let _ = tx.try_send(());
            }
        }
    });
    LiveMigrations { store, left, left_task, changes, task }
}

/// The status files as `vmmigrate status` shows them from the status branch.
pub(crate) fn read_status_branch(
    remote: &str,
    branch: &str,
    cache: PathBuf,
) -> anyhow::Result<BTreeMap<String, String>> {
    let mut cfg = StatusWriterConfig::new(remote.to_owned(), cache);
    cfg.target = Target::Branch(branch.to_owned());
    Ok(StatusWriter::new(cfg).read_remote()?)
}

/// The forge's API carries the token: HTTPS, or plain HTTP to this host only.
fn forge_api_is_safe(api: &str) -> anyhow::Result<()> {
    let Some(rest) = api.strip_prefix("http://") else {
        anyhow::ensure!(api.starts_with("https://"), "--forge-api {api:?} must be an https:// URL");
        return Ok(());
    };
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = host
        .rsplit_once(':')
        .map_or(host, |(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { host });
    let loopback = host == "localhost"
        || host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    anyhow::ensure!(
        loopback,
        "--forge-api {api:?}: the forge token would travel in clear; use https:// (plain http only to this host)"
    );
    Ok(())
}

/// `--status-dir` is written by the bot on the tracked branch: never where
/// manifests or providers are read from (its files would be rendered).
fn status_dir_is_safe(dir: &str) -> anyhow::Result<()> {
    let dir = dir.trim_matches('/');
    let first = dir.split('/').next().unwrap_or_default();
    anyhow::ensure!(
        !dir.is_empty()
            && !matches!(first, "migrations" | "providers" | ".git")
            && !dir.split('/').any(|s| s == ".."),
        "--status-dir {dir:?} must be a folder outside migrations/ and providers/ (the bot writes there on the tracked branch)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plans_source_line_says_what_the_hardware_blocks_and_what_it_leaves_behind() {
        let spec = crate::api::test_migration().spec;
        let mut inv = crate::api::SourceInventory { name: "gpu-box".into(), ..Default::default() };
        assert!(!summary(&spec, &inv).contains("blocks"), "{}", summary(&spec, &inv));
        inv.hardware.passthrough = vec!["pciPassthru0".into()];
        inv.hardware.tpm = true;
        let line = summary(&spec, &inv);
        assert!(line.contains("blocks the move: PassthroughDevice: "), "{line}");
        assert!(line.contains("pciPassthru0"), "{line}");
        assert!(line.contains("moves with a caveat: TpmNotMigrated: "), "{line}");
    }

    #[test]
    fn the_plans_source_line_says_whether_the_guest_is_converted_and_why() {
        let mut spec = crate::api::test_migration().spec;
        let inv = crate::api::SourceInventory { guest_os: "debian12-64".into(), ..Default::default() };
        let line = summary(&spec, &inv);
        assert!(line.contains("guest \"debian12-64\": converted with virt-v2v ("), "{line}");
        assert!(line.contains("VMware hardware"), "{line}");
        spec.conversion.guest = crate::api::GuestConversionMode::None;
        let line = summary(&spec, &inv);
        assert!(line.contains(": moved as it is (spec.conversion.guest is none"), "{line}");
        let windows =
            crate::api::SourceInventory { guest_os: "windows2019srv-64".into(), ..Default::default() };
        let line = summary(&spec, &windows);
        assert!(line.contains("moved as it is on SATA disks and e1000e NICs"), "{line}");
    }

    #[test]
    fn the_forge_token_never_travels_in_clear_and_status_never_lands_among_manifests() {
        assert!(forge_api_is_safe("https://api.github.com").is_ok());
        assert!(forge_api_is_safe("http://127.0.0.1:4000/api/v1").is_ok(), "the test forge, on this host");
        assert!(forge_api_is_safe("http://[::1]:4000").is_ok());
        assert!(forge_api_is_safe("http://gitea.example/api/v1").is_err());
        assert!(forge_api_is_safe("http://127.0.0.1.example.com/").is_err());
        assert!(forge_api_is_safe("ftp://x").is_err());
        assert!(status_dir_is_safe("status").is_ok());
        assert!(status_dir_is_safe("ops/status/").is_ok());
        for bad in ["migrations", "migrations/status", "/providers", "", "../x", ".git"] {
            assert!(status_dir_is_safe(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_repository_url_with_a_user_or_token_is_refused() {
        for url in [
            "https://x-access-token:ghp_abc@github.com/acme/vms.git",
            "https://ghp_abc@github.com/acme/vms.git",
            "HTTP://user@git.example/vms.git",
            "ssh://git:hunter2@git.example/vms.git",
        ] {
            assert!(url_carries_credentials(url), "{url}");
        }
        for url in ["https://github.com/acme/vms.git", "ssh://git@git.example/vms.git", "/srv/git/vms.git"] {
            assert!(!url_carries_credentials(url), "{url}");
        }
    }

    /// Real git reads the configuration the writer's environment carries.
    #[test]
    fn the_status_writers_git_sends_the_token_to_the_repository_url_only() {
        let url = "https://git.example/acme/vms.git";
        let env = token_env(url, "s3cret");
        let ask = |target: &str| {
            let out = std::process::Command::new("git")
                .env_clear()
                .env("GIT_CONFIG_NOSYSTEM", "1")
                .env("GIT_CONFIG_GLOBAL", "/dev/null")
                .env("HOME", "/nonexistent")
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .args(["config", "--get-urlmatch", "http.extraheader", target])
                .output()
                .expect("git");
            String::from_utf8(out.stdout).unwrap().trim().to_owned()
        };
        use base64::Engine as _;
        let expected = format!(
            "Authorization: Basic {}",
            base64::engine::general_purpose::STANDARD.encode("x-access-token:s3cret")
        );
        assert_eq!(ask(url), expected);
        assert_eq!(ask("https://elsewhere.example/acme/vms.git"), "", "sent to another host");
        assert!(
            env.iter().all(|(k, v)| !k.contains("s3cret") && !v.contains("s3cret")),
            "the token in clear"
        );
    }
}
