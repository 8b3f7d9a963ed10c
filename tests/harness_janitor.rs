//! The harness's janitor stops what its test process started, and nothing
//! else: pids are reused (pid_max is 32,768 on this machine kind), and a
//! janitor outliving its test binary once stopped the next binary's
//! containerd, whose pid had been recorded for a process long gone.

use std::process::{Command, Stdio};

use vmmigrate_harness::process::{Janitor, recorded_pids, start_time};

#[test]
fn a_janitor_stops_its_own_processes_and_leaves_a_reused_pid_alone() {
    // It removes its directory even where VMMIGRATE_TEST_KEEP keeps others'.
    let janitor = Janitor::keeping("vmmigrate-janitor-test", false).unwrap();
    let own = janitor.spawn("own", Command::new("sleep").arg("600")).unwrap();
    // A process this janitor did not start, recorded under its pid with a
    // start time that is not its own: what a reused pid looks like.
    let mut stranger = Command::new("sleep").arg("600").stdin(Stdio::null()).spawn().unwrap();
    let started = start_time(stranger.id()).expect("the stranger's start time");
    let pids = janitor.dir().join("pids");
    let mut recorded = std::fs::read_to_string(&pids).unwrap();
    recorded.push_str(&format!("{} {}\n", stranger.id(), started + 1));
    std::fs::write(&pids, recorded).unwrap();
    assert_eq!(recorded_pids(janitor.dir()), vec![own], "only the janitor's own process counts as recorded");

    let dir = janitor.dir().to_path_buf();
    let own_alive = || start_time(own).is_some() && !is_zombie(own);
    assert!(own_alive());
    drop(janitor);
    assert!(!own_alive(), "the janitor stopped its own process");
    assert!(stranger.try_wait().unwrap().is_none(), "the janitor left the process with a reused pid alone");
    assert!(!dir.exists(), "the janitor removed its directory");
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}

/// An exited child not yet reaped.
fn is_zombie(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'))
}

#[test]
fn a_janitor_shell_stops_only_recorded_processes_whose_start_time_matches() {
    // The shell alone, as it runs when a test binary dies without dropping
    // its janitor: a recorded own process (pid and start time) is stopped,
    // a reused pid is not.
    let dir = tempfile::tempdir().unwrap();
    let mut own = Command::new("sleep").arg("600").spawn().unwrap();
    let mut stranger = Command::new("sleep").arg("600").spawn().unwrap();
    let pids = format!(
        "{} {}\n{} {}\n",
        own.id(),
        start_time(own.id()).unwrap(),
        stranger.id(),
        start_time(stranger.id()).unwrap() + 7
    );
    std::fs::write(dir.path().join("pids"), pids).unwrap();
    let status = Command::new("sh")
        .args(["-c", vmmigrate_harness::process::JANITOR_SCRIPT, "janitor"])
        .arg(dir.path())
        .arg("1")
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let own_status = own.wait().unwrap();
    assert!(!own_status.success(), "the recorded process was stopped ({own_status})");
    assert!(stranger.try_wait().unwrap().is_none(), "the reused pid's process still runs");
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}
