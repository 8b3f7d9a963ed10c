//! Command-line interface. `main.rs` only parses and dispatches here.

use crate::convert::artifact::is_sha256_hex;
use crate::convert::produce::{ConversionRequest, produce};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;

/// Moves virtual machines from standalone VMware ESXi hosts into KubeVirt,
/// driven by pull requests to a Git repository.
#[derive(Debug, Parser)]
#[command(name = "vmmigrate", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// One value per process: the size of the `run` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Reconcile VirtualMachineMigration resources in the cluster.
    Controller {
        #[command(flatten)]
        controller: crate::controller::service::ControllerOptions,
        #[command(flatten)]
        serve: crate::process::ServeOptions,
        #[command(flatten)]
        tenancy: TenancyOptions,
    },
    /// Watch a Git repository, apply its migrations and write status back.
    Gitops {
        #[command(flatten)]
        gitops: crate::gitops::service::GitopsOptions,
        #[command(flatten)]
        serve: crate::process::ServeOptions,
        #[command(flatten)]
        tenancy: TenancyOptions,
    },
    /// Run the gitops loop and the controller in one process.
    Run {
        #[command(flatten)]
        gitops: crate::gitops::service::GitopsOptions,
        #[command(flatten)]
        controller: crate::controller::service::ControllerOptions,
        #[command(flatten)]
        serve: crate::process::ServeOptions,
        #[command(flatten)]
        tenancy: TenancyOptions,
    },
    /// Render the migrations of a repository to Kubernetes YAML (what gets applied).
    ///
    /// Merges every `defaults.yaml`, resolves `providers/`, stamps provenance;
    /// prints errors as `path:line: field: message` and exits 1 when there are any.
    Render {
        /// Repository: a local directory (its root, holding `migrations/`).
        #[arg(default_value = ".")]
        repo: String,
        /// Namespace of migrations that set none.
        #[arg(long, default_value = crate::gitops::render::DEFAULT_NAMESPACE, value_parser = parse_namespace)]
        namespace: String,
        #[command(flatten)]
        tenancy: TenancyOptions,
        #[command(flatten)]
        limits: crate::gitops::service::TreeLimitFlags,
    },
    /// Show what merging a branch would change: render, validate, diff, read-only discovery.
    ///
    /// Prints what the pull-request comment would say for a local work tree,
    /// diffed against the live cluster when a kubeconfig reaches one; exits 1
    /// when the plan fails.
    Plan {
        /// Repository: a local directory (its root, holding `migrations/`).
        #[arg(default_value = ".")]
        repo: String,
        /// Namespace of migrations that set none.
        #[arg(long, default_value = crate::gitops::render::DEFAULT_NAMESPACE, value_parser = parse_namespace)]
        namespace: String,
        #[command(flatten)]
        tenancy: TenancyOptions,
        #[command(flatten)]
        limits: crate::gitops::service::TreeLimitFlags,
        /// Do not contact the cluster (every migration shows as new).
        #[arg(long)]
        offline: bool,
    },
    /// Validate the migrations of a repository without touching the cluster (a CI check).
    ///
    /// Prints `ok: N migrations`, or every error as `path:line: field: message`
    /// on standard error and exits 1.
    Validate {
        /// Repository: a local directory (its root, holding `migrations/`).
        #[arg(default_value = ".")]
        repo: String,
        /// Namespace of migrations that set none.
        #[arg(long, default_value = crate::gitops::render::DEFAULT_NAMESPACE, value_parser = parse_namespace)]
        namespace: String,
        #[command(flatten)]
        tenancy: TenancyOptions,
        #[command(flatten)]
        limits: crate::gitops::service::TreeLimitFlags,
    },
    /// Print the CustomResourceDefinition YAML.
    Crd {
        /// Write to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Start a complete local demo: API server, ESXi host, Git remote, vmmigrate.
    ///
    /// Needs root and the Debian packages of `.ci/run`; see docs/quickstart.md.
    Demo(DemoOptions),
    /// Show the status of the migrations: from the cluster, or from the status branch with `--repo`.
    Status {
        /// Read the status branch of this repository instead of the cluster.
        #[arg(long)]
        repo: Option<String>,
        /// The status branch.
        #[arg(long, default_value = "migration-status")]
        branch: String,
        /// Every migration in the cluster, not only those applied from Git.
        #[arg(long, short = 'A')]
        all: bool,
        /// Refresh every two seconds until Ctrl-C.
        #[arg(long, short = 'w')]
        watch: bool,
    },
    /// Convert one acquired raw disk into its artifact (what the conversion Job runs).
    ///
    /// Prints `{"size":..,"sha256":".."}` on success; on failure prints
    /// `error: <Reason>: <message>` and exits 1.
    Convert {
        /// The acquired copy (raw).
        #[arg(long)]
        input: PathBuf,
        /// The sha256 recorded while copying (64 hex digits).
        #[arg(long, value_parser = parse_sha256)]
        input_sha256: String,
        /// The copy's marker file: when the input is newer, it is hashed again first.
        #[arg(long)]
        input_marker: Option<PathBuf>,
        /// The source disk's capacity in bytes.
        #[arg(long)]
        expected_size: u64,
        /// The artifact to write.
        #[arg(long)]
        output: PathBuf,
        /// The artifact's format.
        #[arg(long, value_parser = ["raw", "qcow2"])]
        format: String,
        /// Convert the guest with virt-v2v.
        #[arg(long)]
        virt_v2v: bool,
    },
    /// One migration's data plane (what its worker Job runs with
    /// `--data-plane pods`): copies, conversions and staging on the
    /// migration's work volume, answering the controller's calls.
    Worker {
        #[command(flatten)]
        worker: crate::worker::process::WorkerOptions,
    },
    /// Verify an imported volume against the copy's sha256 (what the verify
    /// Job runs where CDI cannot check a checksum itself).
    ///
    /// Prints the digest as a JSON line (also the container's termination
    /// message); exits 0 when it matches, 3 when it does not, 1 on an error.
    VerifyVolume {
        /// The imported image (`/volume/disk.img`) or block device.
        #[arg(long)]
        path: PathBuf,
        /// The disk's size in bytes: what was copied.
        #[arg(long)]
        size: u64,
        /// The copy's sha256 (64 hex digits).
        #[arg(long, value_parser = parse_sha256)]
        sha256: String,
    },
}

/// A subcommand this build leaves out (`demo` without the `demo` feature).
#[derive(Debug, thiserror::Error)]
#[error(
    "`vmmigrate {0}` is not built into this binary (a release build leaves the test harness out); run it from a checkout: cargo run -- {0}"
)]
struct NotBuiltIn(&'static str);

/// Runs one command; the exit code follows the usual convention
/// (0 success, 1 failure, 2 usage or not built in).
pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Crd { output } => write_crd(output),
        Command::Controller { controller: c, serve, tenancy } => tenancy.rules().and_then(|rules| {
            init_logging();
            crate::process::controller(c.with_destinations(rules), serve)
        }),
        Command::Gitops { gitops: g, serve, tenancy } => tenancy.rules().and_then(|rules| {
            init_logging();
            crate::process::gitops(g.with_destinations(rules).with_tenants(tenancy.tenants()?), serve, None)
        }),
        Command::Run { gitops: g, controller: c, serve, tenancy } => tenancy.rules().and_then(|rules| {
            let g = g.with_destinations(rules.clone()).with_tenants(tenancy.tenants()?);
            init_logging();
            crate::process::gitops(g, serve, Some(c.with_destinations(rules)))
        }),
        Command::Render { repo, namespace, tenancy, limits } => {
            tenancy.render_options(&namespace, limits).and_then(|o| render_local(&repo, &o, true))
        }
        Command::Plan { repo, namespace, offline, tenancy, limits } => {
            tenancy.render_options(&namespace, limits).and_then(|o| plan(&repo, &o, offline))
        }
        Command::Validate { repo, namespace, tenancy, limits } => {
            tenancy.render_options(&namespace, limits).and_then(|o| render_local(&repo, &o, false))
        }
        // `main` runs the demo when it is built in.
        Command::Demo(_) => Err(NotBuiltIn("demo").into()),
        Command::Status { repo, branch, all, watch } => status(repo, &branch, all, watch),
        Command::Worker { worker } => {
            init_logging();
            crate::process::worker(worker)
        }
        Command::VerifyVolume { path, size, sha256 } => return verify_volume(&path, size, &sha256),
        Command::Convert { input, input_sha256, input_marker, expected_size, output, format, virt_v2v } => {
            format.parse().map_err(anyhow::Error::from).and_then(|format| {
                convert(ConversionRequest {
                    input,
                    input_sha256,
                    input_marker,
                    expected_virtual_size: expected_size,
                    output,
                    format,
                    virt_v2v,
                })
            })
        }
    };
    exit_code(result)
}

/// The exit code of a command's result, its error printed on one line.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.is::<NotBuiltIn>() { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
}

/// `vmmigrate plan`: the pull-request comment for a local work tree.
fn plan(repo: &str, opts: &crate::gitops::render::RenderOptions, offline: bool) -> anyhow::Result<()> {
    let root = std::path::Path::new(repo);
    if !root.join("migrations").is_dir() {
        anyhow::bail!("{repo}: no migrations/ directory (point at the repository's root)");
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (text, ok) = runtime.block_on(async {
        let client = if offline {
            None
        } else {
            match tokio::time::timeout(std::time::Duration::from_secs(5), crate::ports::kube_client("cli"))
                .await
            {
                Ok(Ok(c)) => Some(c),
                _ => {
                    eprintln!(
                        "note: no cluster reachable; every migration shows as new (--offline to silence)"
                    );
                    None
                }
            }
        };
        crate::gitops::local::plan_local(root, opts, client.as_ref()).await
    })?;
    print!("{text}");
    if ok { Ok(()) } else { Err(anyhow::anyhow!("the plan fails (see the errors above)")) }
}

/// `vmmigrate status`: a table from the cluster, or STATUS.md from the status branch.
fn status(repo: Option<String>, branch: &str, all: bool, watch: bool) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let client = match &repo {
            None => Some(crate::ports::kube_client("cli").await?),
            Some(_) => None,
        };
        loop {
            let text = match (&repo, &client) {
                (Some(url), _) => {
                    let cache = std::env::temp_dir().join(format!("vmmigrate-status-{}", std::process::id()));
                    let (url, branch) = (url.clone(), branch.to_owned());
                    let files = tokio::task::spawn_blocking(move || {
                        crate::gitops::service::read_status_branch(&url, &branch, cache)
                    })
                    .await??;
                    files
                        .get("STATUS.md")
                        .cloned()
                        .unwrap_or_else(|| "no STATUS.md on the status branch yet\n".into())
                }
                (None, Some(client)) => crate::gitops::local::status_table(
                    &crate::gitops::local::live_migrations(client, all).await?,
                ),
                (None, None) => unreachable!("a client exists when no repository is given"),
            };
            if !watch {
                print!("{text}");
                return Ok(());
            }
            // Clear the screen and redraw, like `watch`.
            print!("\x1b[H\x1b[2J{text}");
            use std::io::Write;
            std::io::stdout().flush()?;
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                _ = crate::server::shutdown_signal() => return Ok(()),
            }
        }
    })
}

/// Logs to standard error; `RUST_LOG` filters (default `info`);
/// `VMMIGRATE_LOG_FORMAT` is `text` (default) or `json`.
fn init_logging() {
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let requested = std::env::var("VMMIGRATE_LOG_FORMAT").unwrap_or_default();
    let format = LogFormat::parse(&requested);
    let _ = log_subscriber(format.unwrap_or(LogFormat::Text), filter, std::io::stderr).try_init();
    if format.is_none() {
        tracing::warn!(VMMIGRATE_LOG_FORMAT = %requested, "unknown log format (json or text); logging text");
    }
}

/// How log lines are written (`VMMIGRATE_LOG_FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with the fields of the enclosing spans
    /// (`span` and `spans`), such as a reconcile's `migration`.
    Json,
}

impl LogFormat {
    /// `json` or `text` (any case); empty is `text`; `None` for anything else.
    pub fn parse(s: &str) -> Option<LogFormat> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "text" => Some(LogFormat::Text),
            "json" => Some(LogFormat::Json),
            _ => None,
        }
    }
}

/// The subscriber `init_logging` installs, writing to `writer`.
pub fn log_subscriber<W>(
    format: LogFormat,
    filter: tracing_subscriber::EnvFilter,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.finish()),
        LogFormat::Json => Box::new(builder.json().finish()),
    }
}

/// Runs one conversion and prints its marker as a JSON line. A failure
/// becomes `<Reason>: <message>`, the reason the Job runner reports.
fn convert(req: ConversionRequest) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let progress = AtomicU64::new(0);
    let marker = runtime.block_on(produce(&req, &progress)).map_err(|e| e.failure())?;
    println!("{}", serde_json::json!({ "size": marker.size, "sha256": marker.sha256 }));
    Ok(())
}

/// Exit code of `verify-volume` when the volume differs from the copy.
pub(crate) const VOLUME_DIFFERS: u8 = 3;

fn verify_volume(path: &std::path::Path, size: u64, sha256: &str) -> ExitCode {
    let digest = match crate::images::digest::volume_digest(path, size) {
        Ok(digest) => digest,
        Err(e) => {
            let line = format!("error: reading {}: {e}", path.display());
            eprintln!("{line}");
            let _ = std::fs::write("/dev/termination-log", &line);
            return ExitCode::FAILURE;
        }
    };
    let line = serde_json::to_string(&digest).unwrap_or_default();
    println!("{line}");
    let _ = std::fs::write("/dev/termination-log", &line);
    if digest.sha256 == sha256 && digest.nonzero_tail_bytes == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(VOLUME_DIFFERS)
    }
}

/// The repository's manifests were rendered and found wrong (each error printed already).
#[derive(Debug, thiserror::Error)]
#[error("{0} error(s) in the repository")]
pub(crate) struct InvalidRepository(pub usize);

/// The administrator's tenancy rules, shared by every subcommand that renders
/// or reconciles migrations.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TenancyOptions {
    /// Let migrations of one namespace create their VMs in others:
    /// `<migration-ns>=<ns>[,<ns>...]`, or `<migration-ns>=*` for any but the
    /// system ones (`kube-*`, the controller's). Repeatable (`;` between rules
    /// in the environment). Without it a migration writes only into its own namespace.
    #[arg(long = "allow-destination", env = "VMMIGRATE_ALLOW_DESTINATION", value_delimiter = ';',
          value_parser = parse_destination_rule)]
    pub allow_destination: Vec<String>,
    /// Bind a Git folder under migrations/ to the namespace its migrations
    /// live in: `<folder>=<namespace>` (`apps=apps`, `teams/finance=finance`).
    /// With any binding, a manifest outside its folder's namespace, or in no
    /// bound folder, is refused at render, plan and apply. Repeatable (`;`
    /// between bindings in the environment).
    #[arg(long = "tenant", env = "VMMIGRATE_TENANTS", value_delimiter = ';', value_parser = parse_tenant)]
    pub tenant: Vec<String>,
}

impl TenancyOptions {
    fn rules(&self) -> anyhow::Result<crate::machine::tenancy::DestinationRules> {
        Ok(crate::machine::tenancy::DestinationRules::parse(&self.allow_destination)?)
    }

    fn tenants(&self) -> anyhow::Result<crate::machine::tenancy::TenantBindings> {
        Ok(crate::machine::tenancy::TenantBindings::parse(&self.tenant)?)
    }

    fn render_options(
        &self,
        namespace: &str,
        limits: crate::gitops::service::TreeLimitFlags,
    ) -> anyhow::Result<crate::gitops::render::RenderOptions> {
        Ok(crate::gitops::render::RenderOptions::new(namespace, &self.rules()?)
            .with_limits(limits.into())
            .with_tenants(self.tenants()?))
    }
}

fn parse_tenant(binding: &str) -> Result<String, String> {
    crate::machine::tenancy::TenantBindings::parse(&[binding])
        .map(|_| binding.to_owned())
        .map_err(|e| e.to_string())
}

fn parse_destination_rule(rule: &str) -> Result<String, String> {
    crate::machine::tenancy::DestinationRules::parse(&[rule])
        .map(|_| rule.to_owned())
        .map_err(|e| e.to_string())
}

/// `render` (print the YAML) and `validate` (print a count) of a local directory.
fn render_local(
    repo: &str,
    opts: &crate::gitops::render::RenderOptions,
    print_yaml: bool,
) -> anyhow::Result<()> {
    use crate::gitops::render::{read_dir_files, render_tree, to_yaml};
    let root = std::path::Path::new(repo);
    if !root.is_dir() {
        anyhow::bail!("{repo}: not a directory (remote URLs: use `vmmigrate gitops`)");
    }
    if !root.join("migrations").is_dir() {
        anyhow::bail!("{repo}: no migrations/ directory (point at the repository's root)");
    }
    let files = read_dir_files(root, &opts.limits).map_err(|e| anyhow::anyhow!("cannot read {repo}: {e}"))?;
    let provenance = crate::gitops::Provenance { repo_url: repo.to_owned(), commit: local_commit(root) };
    match render_tree(&files, &provenance, opts) {
        Ok(rendered) if print_yaml => {
            use std::io::Write;
            std::io::stdout().write_all(to_yaml(&rendered).as_bytes())?;
            Ok(())
        }
        Ok(rendered) => {
            println!("ok: {} migrations", rendered.len());
            Ok(())
        }
        Err(errors) => {
            for error in &errors {
                eprintln!("{error}");
            }
            Err(InvalidRepository(errors.len()).into())
        }
    }
}

/// `git rev-parse HEAD` of a clean work tree, else `working-tree`: a commit
/// annotation must name a commit that holds exactly what was rendered.
fn local_commit(root: &std::path::Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let inside = git(&["rev-parse", "--is-inside-work-tree"]).is_some_and(|s| s == "true");
    let clean = inside
        && git(&["status", "--porcelain", "--untracked-files=all", "--", "."]).is_some_and(|s| s.is_empty());
    match git(&["rev-parse", "HEAD"]) {
        Some(commit) if clean && !commit.is_empty() => commit,
        _ => "working-tree".to_owned(),
    }
}

fn parse_namespace(s: &str) -> Result<String, String> {
    if crate::machine::preflight::is_dns_label(s) {
        Ok(s.to_owned())
    } else {
        Err("must be a lowercase RFC 1123 label (a-z, 0-9 and '-'), at most 63 characters".to_owned())
    }
}

fn parse_sha256(s: &str) -> Result<String, String> {
    let lower = s.to_ascii_lowercase();
    if is_sha256_hex(&lower) { Ok(lower) } else { Err("expected 64 hexadecimal digits".to_owned()) }
}

fn write_crd(output: Option<PathBuf>) -> anyhow::Result<()> {
    let yaml = crate::api::crd_yaml()?;
    match output {
        Some(path) => {
            std::fs::write(&path, yaml).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
        }
        None => {
            use std::io::Write;
            std::io::stdout().write_all(yaml.as_bytes())?;
            Ok(())
        }
    }
}

/// `vmmigrate demo` flags.
#[derive(Clone, Debug, clap::Args)]
pub struct DemoOptions {
    /// Exit 1 when the migration has not completed this many seconds after
    /// start-up (the first run's builds of the cluster and, with --cluster,
    /// of the release image do not count).
    #[arg(long, default_value_t = 900)]
    pub timeout_seconds: u64,
    /// Once the walkthrough has ended (completed or not), keep everything
    /// running until Ctrl-C, to look around.
    #[arg(long)]
    pub keep: bool,
    /// Plain lines only, no progress bars redrawn in place (for CI logs).
    #[arg(long)]
    pub non_interactive: bool,
    /// Directory for the Git remote, clones, disk copies and the log; the Git
    /// remote and the log stay after exit. Default: a new directory in $TMPDIR.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Run vmmigrate as a user installs it: the release image (built on the
    /// first run) as two pods of the Deployment of deploy/ on a real
    /// one-node cluster (kubelet, containerd), instead of in this process.
    #[arg(long)]
    pub cluster: bool,
    /// Internal: this process is the demo itself, started by `vmmigrate demo`.
    #[arg(long = "in-own-process-group", hide = true)]
    pub in_own_process_group: bool,
}
