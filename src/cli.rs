//! Command-line interface: the arguments, their parsing and checks, logging,
//! and the dispatch of each command (`main.rs` calls [`run`]). What a
//! command does is in `commands` (one-shot) or `process` (long-running).

use crate::commands;
use crate::convert::artifact::is_sha256_hex;
use crate::convert::produce::ConversionRequest;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

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
    },
    /// Convert a whole guest over all of its acquired disks with virt-v2v
    /// (what a guest's conversion Job runs).
    ///
    /// Reads the request the controller wrote beside the artifacts; prints
    /// what was done as a JSON line. On failure writes the classified
    /// failure as JSON to /dev/termination-log, prints `error: <Reason>:
    /// <message>` and exits 1.
    ConvertGuest {
        /// The request (`<work>/artifacts/<uid>/guest-request.json`).
        #[arg(long)]
        request: PathBuf,
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
    /// Fill a destination volume with one staged artifact, without CDI's
    /// importer: read it over HTTPS, write it in place, hash it on the way.
    ///
    /// Prints what it wrote as a JSON line (also the container's termination
    /// message); exits 0 when the bytes match `--sha256`, 3 when they do
    /// not, 1 on an error.
    FillVolume {
        /// The artifact's staging URL.
        #[arg(long)]
        url: String,
        /// The staging server's CA certificate (PEM), the only one trusted.
        #[arg(long)]
        ca: PathBuf,
        /// A folder holding the artifact's credentials as files
        /// `accessKeyId` and `secretKey` (its import Secret, mounted).
        #[arg(long)]
        credentials: PathBuf,
        /// The volume's image (`/volume/disk.img`) or block device.
        #[arg(long)]
        path: PathBuf,
        /// The artifact's size in bytes.
        #[arg(long)]
        size: u64,
        /// The artifact's sha256 (64 hex digits); with `--patch`, the patch's.
        #[arg(long, value_parser = parse_sha256)]
        sha256: String,
        /// The URL serves a patch (`images::patch`): only its ranges are
        /// written, onto the base the volume already holds.
        #[arg(long)]
        patch: bool,
    },
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
        Command::Crd { output } => commands::write_crd(output),
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
            tenancy.render_options(&namespace, limits).and_then(|o| commands::render_local(&repo, &o, true))
        }
        Command::Plan { repo, namespace, offline, tenancy, limits } => {
            tenancy.render_options(&namespace, limits).and_then(|o| commands::plan(&repo, &o, offline))
        }
        Command::Validate { repo, namespace, tenancy, limits } => {
            tenancy.render_options(&namespace, limits).and_then(|o| commands::render_local(&repo, &o, false))
        }
        // `main` runs the demo when it is built in.
        Command::Demo(_) => Err(NotBuiltIn("demo").into()),
        Command::Status { repo, branch, all, watch } => commands::status(repo, &branch, all, watch),
        Command::Worker { worker } => {
            init_logging();
            crate::process::worker(worker)
        }
        Command::VerifyVolume { path, size, sha256 } => return commands::verify_volume(&path, size, &sha256),
        Command::FillVolume { url, ca, credentials, path, size, sha256, patch } => {
            let request = commands::FillArgs { url: &url, ca: &ca, credentials: &credentials, patch };
            return commands::fill_volume(&request, &path, size, &sha256);
        }
        Command::ConvertGuest { request } => {
            init_logging();
            commands::convert_guest(&request)
        }
        Command::Convert { input, input_sha256, input_marker, expected_size, output, format } => {
            format.parse().map_err(anyhow::Error::from).and_then(|format| {
                commands::convert(ConversionRequest {
                    input,
                    input_sha256,
                    input_marker,
                    expected_virtual_size: expected_size,
                    output,
                    format,
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
