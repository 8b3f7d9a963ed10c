//! Unit tests of rendering, shared helpers for the other files' tests.
use super::*;

pub(super) const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

pub(super) fn file(path: &str, text: &str) -> RepoFile {
    RepoFile { path: path.to_owned(), bytes: text.as_bytes().to_vec() }
}

pub(super) fn manifest(name: &str, vm: &str) -> String {
    format!(
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: {name}\nspec:\n  source:\n    host: esxi01\n    hostKey: {HOST_KEY}\n    credentialsSecretRef:\n      name: creds\n    vm:\n      name: {vm}\n  destination:\n    namespace: apps\n    storageClassName: standard\n"
    )
}

pub(super) fn render_files(files: &[RepoFile]) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
    // Under the rule that lets migrations of the default namespace land in `apps`.
    let rules = DestinationRules::parse(&["vmmigrate=apps"]).expect("rule");
    render(
        files,
        &Provenance { repo_url: "file:///repo".into(), commit: "abc".into() },
        &RenderOptions::new(DEFAULT_NAMESPACE, &rules),
    )
}

pub(super) fn errors_of(files: &[RepoFile]) -> Vec<String> {
    render_files(files).err().unwrap_or_default().iter().map(ToString::to_string).collect()
}

pub(super) fn p(s: &str) -> Vec<Seg> {
    // "spec.networkMap[1].type" → segments (tests only use plain keys).
    let mut out = Vec::new();
    for part in s.split('.') {
        let (name, rest) = part.split_once('[').unwrap_or((part, ""));
        out.push(key(name));
        for idx in rest.split('[').filter(|x| !x.is_empty()) {
            out.push(Seg::Index(idx.trim_end_matches(']').parse().unwrap()));
        }
    }
    out
}

#[test]
fn error_display_leaves_out_missing_parts() {
    let e = RenderError { path: "p".into(), line: None, field: None, message: "m".into() };
    assert_eq!(e.to_string(), "p: m");
    let e = RenderError { path: "p".into(), line: Some(3), field: Some("f".into()), message: "m".into() };
    assert_eq!(e.to_string(), "p:3: f: m");
}

#[test]
fn a_cutover_window_that_names_no_real_time_is_refused_at_its_line() {
    let m = manifest("a", "a").replace(
        "  destination:",
        "  cutover:\n    mode: Window\n    window:\n      start: \"2026-12-12T22:00\"\n      end: \"2026-12-13T04:00\"\n      timeZone: Europe/Berlinn\n  destination:",
    );
    let errors = errors_of(&[file("migrations/a.yaml", &m)]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("migrations/a.yaml:18: spec.cutover.window.timeZone: timeZone \"Europe/Berlinn\" is not a known IANA time zone"),
        "{errors:?}"
    );
    let missing =
        manifest("a", "a").replace("  destination:", "  cutover:\n    mode: Window\n  destination:");
    let errors = errors_of(&[file("migrations/a.yaml", &missing)]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("cutover.window is required for mode Window"), "{errors:?}");
    let good = m.replace("Europe/Berlinn", "Europe/Berlin");
    let rendered = render_files(&[file("migrations/a.yaml", &good)]).unwrap();
    assert_eq!(
        rendered[0].object.pointer("/spec/cutover/window/timeZone"),
        Some(&Value::from("Europe/Berlin"))
    );
}

#[test]
fn a_minimal_manifest_renders_with_provenance_and_the_gitops_label() {
    let out = render_files(&[file("migrations/a.yaml", &manifest("a", "vm a"))]).unwrap();
    assert_eq!(out.len(), 1);
    let obj = &out[0].object;
    assert_eq!(out[0].namespace, DEFAULT_NAMESPACE);
    assert_eq!(obj["metadata"]["labels"][LABEL_GITOPS], "true");
    assert_eq!(obj["metadata"]["annotations"][ANNOTATION_COMMIT], "abc");
    assert_eq!(obj["metadata"]["annotations"][ANNOTATION_PATH], "migrations/a.yaml");
    assert_eq!(obj["metadata"]["annotations"][ANNOTATION_REPO], "file:///repo");
}

#[test]
fn null_in_a_manifest_unsets_a_default() {
    let defaults = "spec:\n  destination:\n    memory: 4Gi\n";
    let m = manifest("a", "a")
        .replace("    storageClassName: standard\n", "    storageClassName: standard\n    memory:\n");
    let out =
        render_files(&[file("migrations/defaults.yaml", defaults), file("migrations/a.yaml", &m)]).unwrap();
    assert!(out[0].object["spec"]["destination"].get("memory").is_none());
}

#[test]
fn other_files_are_ignored_and_providers_must_be_top_level() {
    assert_eq!(classify("README.md"), FileKind::Ignored);
    assert_eq!(classify("status/vmmigrate/a.yaml"), FileKind::Ignored);
    assert_eq!(classify("migrations/notes.txt"), FileKind::Ignored);
    assert_eq!(classify("migrations/a/defaults.yml"), FileKind::Defaults { dir: "migrations/a".into() });
    assert_eq!(classify("providers/x.yaml"), FileKind::Provider);
    assert_eq!(classify("providers/old/x.yaml"), FileKind::Ignored);
    assert_eq!(folder_chain("migrations/a/b/x.yaml"), vec!["migrations", "migrations/a", "migrations/a/b"]);
}

#[test]
fn a_list_item_from_defaults_missing_a_field_is_reported_at_the_defaults_file() {
    let defaults = "spec:\n  networkMap:\n    - source: VM Network\n";
    let errors = errors_of(&[
        file("migrations/defaults.yaml", defaults),
        file("migrations/a.yaml", &manifest("a", "b")),
    ]);
    assert_eq!(errors, vec!["migrations/defaults.yaml:3: spec.networkMap[0].type: is required"]);
}
