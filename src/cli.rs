//! Command-line interface. `main.rs` only parses and dispatches here.

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

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Reconcile VirtualMachineMigration resources in the cluster.
    Controller,
    /// Watch a Git repository, apply its migrations and write status back.
    Gitops,
    /// Run the gitops loop and the controller in one process.
    Run,
    /// Render the migrations of a repository (or a path in it) to Kubernetes YAML.
    Render {
        /// Repository URL or local path.
        repo: String,
    },
    /// Show what merging a branch would change: render, validate, diff, read-only discovery.
    Plan {
        /// Repository URL or local path.
        repo: String,
    },
    /// Validate the migrations of a repository without touching the cluster.
    Validate {
        /// Repository URL or local path.
        repo: String,
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
        Command::Controller => Err(NotImplemented("controller").into()),
        Command::Gitops => Err(NotImplemented("gitops").into()),
        Command::Run => Err(NotImplemented("run").into()),
        Command::Render { .. } => Err(NotImplemented("render").into()),
        Command::Plan { .. } => Err(NotImplemented("plan").into()),
        Command::Validate { .. } => Err(NotImplemented("validate").into()),
        Command::Demo => Err(NotImplemented("demo").into()),
        Command::Status => Err(NotImplemented("status").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.is::<NotImplemented>() { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
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
