//! The command line: help lists every subcommand, `demo --help` its flags,
//! `crd` prints the CRD.

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
fn demo_help_documents_its_flags_and_hides_the_internal_one() {
    // The demo itself runs in tests/demo.rs; this only reads its help.
    let out = vmmigrate(&["demo", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in ["--timeout-seconds", "--keep", "--non-interactive", "--work-dir"] {
        assert!(help.contains(flag), "`{flag}` missing from demo help:\n{help}");
    }
    assert!(!help.contains("--in-own-process-group"), "{help}");
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
