//! `vmmigrate demo`, the README's first command, run as a user runs it: the
//! real binary as a child process, on its own. It must end with the
//! migration Completed, say so on the status branch of the Git remote it
//! prints, and leave none of the processes it started running.
//!
//! Needs root and the Debian packages of `.ci/run`, like the ESXi tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `name=pid` pairs of the "processes started:" line.
fn started_processes(stdout: &str) -> Vec<(String, u32)> {
    let line = stdout.lines().find_map(|l| l.strip_prefix("processes started: ")).expect("a processes line");
    line.split_whitespace()
        .map(|pair| {
            let (name, pid) = pair.split_once('=').expect("name=pid");
            (name.to_owned(), pid.parse().expect("a pid"))
        })
        .collect()
}

/// Whether `pid` runs (a zombie waiting for init to reap it does not).
fn is_running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z")
}

/// Running processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) && is_running(pid) {
            found.push(format!("{pid}: {cmdline}"));
        }
    }
    found
}

/// Runs `vmmigrate demo ARGS…` to the end; returns its stdout and work directory.
fn run_demo(args: &[&str]) -> (String, tempfile::TempDir, PathBuf) {
    let work = tempfile::tempdir().expect("work dir");
    let work_dir = work.path().canonicalize().expect("canonical work dir");
    let out = Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
        .args(["demo", "--non-interactive", "--timeout-seconds", "300"])
        .args(args)
        .arg("--work-dir")
        .arg(&work_dir)
        .stdin(Stdio::null())
        .output()
        .expect("run vmmigrate demo");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(work_dir.join("vmmigrate.log")).unwrap_or_default();
    let log_tail: Vec<&str> = log.lines().rev().take(40).collect();
    assert!(
        out.status.success(),
        "exit {:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- log (last lines, newest first)\n{}",
        out.status.code(),
        log_tail.join("\n")
    );
    assert!(stdout.contains("Completed"), "{stdout}");

    // The remote it prints holds the outcome, after the demo is gone.
    let remote = stdout
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("Git remote"))
        .map(|p| PathBuf::from(p.trim()))
        .expect("the remote's path is printed");
    assert_eq!(remote, work_dir.join("remote.git"));
    let shown = Command::new("git")
        .arg("--git-dir")
        .arg(&remote)
        // The plain demo migrates db-02; `--cluster` the real guest app-bios.
        .arg("show")
        .arg(format!(
            "migration-status:demo/{}.yaml",
            if args.contains(&"--cluster") { "app-bios" } else { "db-02" }
        ))
        .output()
        .expect("git show");
    assert!(shown.status.success(), "{}", String::from_utf8_lossy(&shown.stderr));
    let file: serde_yaml::Value = serde_yaml::from_slice(&shown.stdout).expect("status file YAML");
    assert_eq!(file["phase"].as_str(), Some("Completed"), "{}", String::from_utf8_lossy(&shown.stdout));
    assert!(
        !Path::new(&work_dir).join("controller").exists(),
        "disk copies are removed; only the remote and the log stay"
    );
    (stdout, work, work_dir)
}

/// Nothing of `expected` (and nothing else it started) runs any more, and
/// no process uses its directory.
fn assert_nothing_left(stdout: &str, work_dir: &Path, expected: &[&str]) {
    let started = started_processes(stdout);
    let names: Vec<&str> = started.iter().map(|(n, _)| n.as_str()).collect();
    for expected in expected {
        assert!(names.contains(expected), "{expected} missing from {started:?}");
    }
    let running: Vec<&(String, u32)> = started.iter().filter(|(_, pid)| is_running(*pid)).collect();
    assert!(running.is_empty(), "still running: {running:?}\n--- stdout\n{stdout}");
    let mentioning = processes_mentioning(&work_dir.to_string_lossy());
    assert!(mentioning.is_empty(), "processes using the demo's directory: {mentioning:?}");
}

#[test]
fn demo_completes_the_migration_reports_it_on_the_status_branch_and_leaves_no_process_behind() {
    let (stdout, _work, work_dir) = run_demo(&[]);
    assert_nothing_left(
        &stdout,
        &work_dir,
        &["etcd", "kube-apiserver", "kube-controller-manager", "sshd", "httpd"],
    );
    let netns = stdout
        .lines()
        .find_map(|l| l.split("in network namespace ").nth(1))
        .map(str::trim)
        .expect("the network namespace is printed");
    let namespaces = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    let namespaces = String::from_utf8_lossy(&namespaces.stdout);
    assert!(!namespaces.lines().any(|l| l.split_whitespace().next() == Some(netns)), "{netns} is left");
}

#[test]
fn demo_with_cluster_runs_vmmigrate_as_pods_boots_a_real_guest_on_kubevirt_and_leaves_no_node_behind() {
    let before: Vec<String> = node_namespaces();
    let (stdout, _work, work_dir) = run_demo(&["--cluster"]);
    assert!(stdout.contains("installed with kubectl apply -k"), "{stdout}");
    assert!(stdout.contains("git daemon: git://"), "{stdout}");
    // The guest booted on real KubeVirt from the copied disk and served its page.
    assert!(stdout.contains("console     vmmigrate-guest: booted firmware bios"), "{stdout}");
    assert!(stdout.contains("page        vmmigrate-guest app-bios"), "{stdout}");
    assert_nothing_left(
        &stdout,
        &work_dir,
        &["etcd", "kube-apiserver", "kube-scheduler", "kubelet", "containerd", "kube-proxy", "sshd"],
    );
    // The node's namespace goes once the demo's process has exited (its guard).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let new: Vec<String> = node_namespaces().into_iter().filter(|n| !before.contains(n)).collect();
        let mine = format!("vmmnode-{}-", std::process::id());
        let left: Vec<&String> = new.iter().filter(|n| !n.starts_with(&mine)).collect();
        if left.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "node namespaces left by the demo: {left:?}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// The test nodes' network namespaces on this machine.
fn node_namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("vmmnode-"))
        .map(str::to_owned)
        .collect()
}
