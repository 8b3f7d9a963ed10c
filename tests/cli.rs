//! The command line: help lists every planned subcommand, unimplemented ones
//! fail cleanly with exit code 2, `crd` prints the CRD.

use std::process::Command;

fn vmmigrate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vmmigrate")).args(args).output().expect("run vmmigrate")
}

#[test]
fn help_lists_every_planned_subcommand() {
    let out = vmmigrate(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for cmd in ["controller", "gitops", "run", "render", "plan", "validate", "crd", "demo", "status"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(cmd)), "`{cmd}` missing from help:\n{help}");
    }
}

#[test]
fn unimplemented_subcommand_exits_2_with_a_clear_message() {
    let out = vmmigrate(&["demo"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("`vmmigrate demo` is not implemented yet"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn crd_subcommand_prints_the_committed_crd() {
    let out = vmmigrate(&["crd"]);
    assert!(out.status.success());
    let committed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/virtualmachinemigration.yaml"),
    )
    .unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), committed);
}
