use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    vmmigrate::cli::run(vmmigrate::cli::Cli::parse())
}
