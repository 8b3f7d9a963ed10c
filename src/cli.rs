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

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Reconcile VirtualMachineMigration resources in the cluster.
    Controller(crate::controller::service::ControllerOptions),
    /// Watch a Git repository, apply its migrations and write status back.
    Gitops,
    /// Run the gitops loop and the controller in one process.
    Run,
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
    },
    /// Show what merging a branch would change: render, validate, diff, read-only discovery.
    Plan {
        /// Repository URL or local path.
        repo: String,
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
    },
    /// Print the CustomResourceDefinition YAML.
    Crd {
        /// Write to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Start a complete local demo: API server, ESXi host, Git remote, vmmigrate.
    Demo,
    /// Show the status of the migrations in the cluster.
    Status,
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
}

/// A subcommand that exists in the plan but not yet in the code.
#[derive(Debug, thiserror::Error)]
#[error("`vmmigrate {0}` is not implemented yet")]
pub struct NotImplemented(pub &'static str);

/// Runs one command; the exit code follows the usual convention
/// (0 success, 1 failure, 2 usage or not implemented).
pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Crd { output } => write_crd(output),
        Command::Controller(opts) => controller(opts),
        Command::Gitops => Err(NotImplemented("gitops").into()),
        Command::Run => Err(NotImplemented("run").into()),
        Command::Render { repo, namespace } => render_local(&repo, &namespace, true),
        Command::Plan { .. } => Err(NotImplemented("plan").into()),
        Command::Validate { repo, namespace } => render_local(&repo, &namespace, false),
        Command::Demo => Err(NotImplemented("demo").into()),
        Command::Status => Err(NotImplemented("status").into()),
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
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.is::<NotImplemented>() { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
}

/// Runs the controller with the real adapters until Ctrl-C or SIGTERM.
fn controller(opts: crate::controller::service::ControllerOptions) -> anyhow::Result<()> {
    init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(crate::controller::service::run(opts))
}

/// Logs to standard error; `RUST_LOG` filters (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
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

/// The repository's manifests were rendered and found wrong (each error printed already).
#[derive(Debug, thiserror::Error)]
#[error("{0} error(s) in the repository")]
pub struct InvalidRepository(pub usize);

/// `render` (print the YAML) and `validate` (print a count) of a local directory.
fn render_local(repo: &str, namespace: &str, print_yaml: bool) -> anyhow::Result<()> {
    use crate::gitops::render::{RenderOptions, read_dir_files, render, to_yaml};
    let root = std::path::Path::new(repo);
    if !root.is_dir() {
        anyhow::bail!("{repo}: not a directory (remote URLs: use `vmmigrate gitops`)");
    }
    if !root.join("migrations").is_dir() {
        anyhow::bail!("{repo}: no migrations/ directory (point at the repository's root)");
    }
    let files = read_dir_files(root).map_err(|e| anyhow::anyhow!("cannot read {repo}: {e}"))?;
    let provenance = crate::gitops::Provenance { repo_url: repo.to_owned(), commit: local_commit(root) };
    let opts = RenderOptions { default_namespace: namespace.to_owned() };
    match render(&files, &provenance, &opts) {
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
