//! Runs the demo in a child process with its own process group.
//!
//! Why: Ctrl-C in a terminal sends SIGINT to the whole foreground process
//! group. Started in it, etcd, kube-apiserver, sshd and the janitor shells
//! would all receive it, and a janitor shell killed by it can no longer
//! clean up (remove the chroot, the network namespace, the directories). In
//! its own group only the child's orderly shutdown runs: this process turns
//! Ctrl-C and SIGTERM into one SIGTERM for the child and waits for it. The
//! child's stdin is a pipe from here, so it also stops when this process dies.

use std::process::Stdio;

/// The hidden flag that marks the child.
pub(crate) const CHILD_FLAG: &str = "--in-own-process-group";

/// Starts `vmmigrate <same arguments> --in-own-process-group`, forwards
/// signals to it and exits with its exit code.
pub(crate) fn run_child_in_own_process_group() -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let code = runtime.block_on(async move {
        let mut child = tokio::process::Command::new(exe)
            .args(args)
            .arg(CHILD_FLAG)
            .process_group(0)
            // The harness's test knobs (another cluster, keep the files) are not the demo's.
            .env_remove("VMMIGRATE_TEST_KUBECONFIG")
            .env_remove("VMMIGRATE_TEST_KEEP")
            .stdin(Stdio::piped())
            .spawn()?;
        // Held until the child exits: its end-of-file tells the child we are gone.
        let _stdin = child.stdin.take();
        let pid = child.id().map(|p| p.to_string()).unwrap_or_default();
        let mut signals = 0;
        loop {
            tokio::select! {
                status = child.wait() => {
                    let status = status?;
                    if status.code().is_none() {
                        eprintln!("error: the demo was stopped by a signal ({status})");
                    }
                    return anyhow::Ok(status.code().unwrap_or(1));
                }
                _ = crate::server::shutdown_signal() => {
                    signals += 1;
                    // A third signal means "now": the janitors still clean up after a KILL.
                    let signal = if signals >= 3 { "-KILL" } else { "-TERM" };
                    let _ = tokio::process::Command::new("kill").arg(signal).arg(&pid).status().await;
                }
            }
        }
    })?;
    drop(runtime);
    if code == 0 {
        Ok(())
    } else {
        // The child printed why; only its exit code is left to pass on.
        std::process::exit(code)
    }
}
