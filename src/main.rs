use clap::Parser;
use std::process::ExitCode;
use vmmigrate::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo sits above the CLI (it drives the gitops loop and the
    // controller), so the CLI does not call into it; without the `demo`
    // feature the CLI answers that it is not built in.
    #[cfg(feature = "demo")]
    if let vmmigrate::cli::Command::Demo(opts) = cli.command {
        return vmmigrate::cli::exit_code(vmmigrate::demo::run(opts));
    }
    vmmigrate::cli::run(cli)
}
