//! Rendering a GitOps repository: manifests, folder defaults and providers in
//! temporary directories, read back as the CLI reads them; and the `render`
//! and `validate` commands run as a user (or a CI job) runs them.

use std::path::Path;
use std::process::Command;
use vmmigrate::gitops::render::{
    RenderError, RenderOptions, RenderedMigration, read_dir_files, render, to_yaml,
};
use vmmigrate::gitops::{ANNOTATION_COMMIT, ANNOTATION_PATH, LABEL_GITOPS, Provenance, RepoFile};
use vmmigrate::machine::tenancy::{DestinationRules, TenantBindings};

const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";
const OTHER_KEY: &str = "SHA256:AAAAztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

fn write(root: &Path, path: &str, text: &str) {
    let path = root.join(path);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A complete migration of VM `vm` on esxi01.
fn manifest(name: &str, vm: &str) -> String {
    format!(
        "apiVersion: migration.platform.example/v1alpha1
kind: VirtualMachineMigration
metadata:
  name: {name}
spec:
  source:
    host: esxi01.example.internal
    hostKey: {HOST_KEY}
    credentialsSecretRef:
      name: esxi01-credentials
    vm:
      name: {vm}
  destination:
    namespace: apps
    storageClassName: standard
"
    )
}

/// A migration that takes its connection from a provider.
fn provider_manifest(name: &str, provider: &str) -> String {
    format!(
        "apiVersion: migration.platform.example/v1alpha1
kind: VirtualMachineMigration
metadata:
  name: {name}
spec:
  source:
    provider: {provider}
    vm:
      name: {name}
  destination:
    namespace: apps
    storageClassName: standard
"
    )
}

const PROVIDER: &str = "apiVersion: migration.platform.example/v1alpha1
kind: EsxiProvider
metadata:
  name: esxi01
spec:
  host: esxi01.example.internal
  port: 2222
  hostKey: SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s
  credentialsSecretRef:
    name: esxi01-credentials
";

fn provenance() -> Provenance {
    Provenance { repo_url: "https://git.example/infra/migrations.git".into(), commit: "0123abcd".into() }
}

/// The administrator's rule these tests run under: migrations in `vmmigrate`
/// (the default namespace) may create their VMs in `apps`.
fn options() -> RenderOptions {
    let rules = DestinationRules::parse(&["vmmigrate=apps", "migrations=apps"]).unwrap();
    RenderOptions::new("vmmigrate", &rules)
}

fn render_dir(root: &Path) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
    render(&read_dir_files(root, &Default::default()).unwrap().files, &provenance(), &options())
}

fn errors_of(root: &Path) -> Vec<String> {
    match render_dir(root) {
        Ok(ok) => panic!("expected errors, rendered {} migrations", ok.len()),
        Err(errors) => errors.iter().map(ToString::to_string).collect(),
    }
}

fn one(rendered: &[RenderedMigration], name: &str) -> serde_json::Value {
    rendered.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("{name} not rendered")).object.clone()
}

/// The CLI under the same rules as [`options`], given through the environment
/// as a deployment gives them (`;` between rules).
fn vmmigrate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
        .args(args)
        .env("VMMIGRATE_ALLOW_DESTINATION", "vmmigrate=apps;migrations=apps")
        .output()
        .expect("run vmmigrate")
}

#[test]
fn the_same_files_render_byte_identically_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", PROVIDER);
    write(dir.path(), "migrations/defaults.yaml", "metadata:\n  labels:\n    team: platform\n");
    write(dir.path(), "migrations/web/defaults.yaml", "spec:\n  powerOffPolicy: Force\n");
    for i in 0..12 {
        let folder = if i % 2 == 0 { "web" } else { "db" };
        write(
            dir.path(),
            &format!("migrations/{folder}/vm-{i:02}.yaml"),
            &provider_manifest(&format!("vm-{i:02}"), "esxi01"),
        );
    }
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let first = to_yaml(&render(&files, &provenance(), &options()).unwrap());
    let again = to_yaml(&render(&files, &provenance(), &options()).unwrap());
    let mut shuffled = files.clone();
    shuffled.reverse();
    shuffled.swap(1, 5);
    shuffled.swap(0, 9);
    let reordered = to_yaml(&render(&shuffled, &provenance(), &options()).unwrap());
    assert_eq!(first, again);
    assert_eq!(first, reordered);
    assert_eq!(first.matches("kind: VirtualMachineMigration").count(), 12);
    assert_eq!(first.matches("---\n").count(), 11);
    // Sorted by (namespace, name); keys sorted inside each object.
    let names: Vec<&str> = first.lines().filter_map(|l| l.strip_prefix("  name: vm-")).collect();
    assert_eq!(names, (0..12).map(|i| format!("{i:02}")).collect::<Vec<_>>());
    assert!(first.starts_with(
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n"
    ));
}

#[test]
fn defaults_merge_beneath_the_manifest_nearest_folder_first_and_lists_are_replaced() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "migrations/defaults.yaml",
        "metadata:
  namespace: migrations
  labels:
    team: platform
    tier: root
spec:
  powerOffPolicy: Force
  strategy:
    retryLimit: 7
    backoff:
      initialSeconds: 30
  networkMap:
    - source: VM Network
      type: Pod
    - source: Backup
      type: Multus
      networkName: backup
",
    );
    write(
        dir.path(),
        "migrations/finance/defaults.yaml",
        "metadata:
  labels:
    tier: finance
spec:
  powerOffPolicy: GracefulThenForce
  strategy:
    backoff:
      maxSeconds: 900
",
    );
    write(dir.path(), "migrations/finance/plain.yaml", &manifest("plain", "plain"));
    let own = manifest("own", "own-vm")
        .replace("  name: own\n", "  name: own\n  labels:\n    tier: manifest\n")
        + "  powerOffPolicy: RequireAlreadyOff\n  networkMap:\n    - source: Storage\n      type: Multus\n      networkName: storage\n";
    write(dir.path(), "migrations/finance/own.yaml", &own);
    write(dir.path(), "migrations/top.yaml", &manifest("top", "top"));
    let rendered = render_dir(dir.path()).unwrap();

    let plain = one(&rendered, "plain");
    assert_eq!(plain["metadata"]["namespace"], "migrations");
    assert_eq!(plain["metadata"]["labels"]["team"], "platform");
    assert_eq!(plain["metadata"]["labels"]["tier"], "finance", "the nearest folder wins");
    assert_eq!(plain["metadata"]["labels"][LABEL_GITOPS], "true");
    assert_eq!(plain["spec"]["powerOffPolicy"], "GracefulThenForce");
    // Mappings merge deeply across all three layers.
    assert_eq!(plain["spec"]["strategy"]["retryLimit"], 7);
    assert_eq!(
        plain["spec"]["strategy"]["backoff"],
        serde_json::json!({"initialSeconds": 30, "maxSeconds": 900})
    );
    assert_eq!(plain["spec"]["networkMap"].as_array().unwrap().len(), 2);
    assert_eq!(plain["spec"]["source"]["vm"]["name"], "plain");

    let own = one(&rendered, "own");
    assert_eq!(own["metadata"]["labels"]["tier"], "manifest", "the manifest wins");
    assert_eq!(own["spec"]["powerOffPolicy"], "RequireAlreadyOff");
    // The list is the manifest's, whole: not merged item by item with the defaults'.
    assert_eq!(
        own["spec"]["networkMap"],
        serde_json::json!([{"source": "Storage", "type": "Multus", "networkName": "storage"}])
    );

    let top = one(&rendered, "top");
    assert_eq!(top["metadata"]["labels"]["tier"], "root", "folder defaults do not reach the parent folder");
    assert_eq!(top["spec"]["powerOffPolicy"], "Force");
    assert!(top["spec"]["strategy"]["backoff"].get("maxSeconds").is_none());
}

#[test]
fn a_defaults_file_is_not_a_migration_and_its_errors_are_reported_once_at_its_own_line() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/defaults.yaml", "spec:\n  destination:\n    runStrategy: Sometimes\n");
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    write(dir.path(), "migrations/b.yaml", &manifest("b", "b"));
    assert_eq!(
        errors_of(dir.path()),
        vec![
            "migrations/defaults.yaml:3: spec.destination.runStrategy: must be one of Always, RerunOnFailure, Manual, Halted (got \"Sometimes\")"
        ]
    );
    write(dir.path(), "migrations/defaults.yaml", "metadata:\n  name: shared\n");
    assert_eq!(
        errors_of(dir.path()),
        vec![
            "migrations/defaults.yaml:2: metadata.name: a defaults.yaml cannot set metadata.name (every migration names itself)"
        ]
    );
}

#[test]
fn a_destination_namespace_outside_the_allow_rules_is_refused_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/ok.yaml", &manifest("ok", "ok"));
    // The controller's rights must not reach kube-system, nor another team's namespace.
    write(
        dir.path(),
        "migrations/a.yaml",
        &manifest("a", "a").replace("namespace: apps", "namespace: kube-system"),
    );
    write(
        dir.path(),
        "migrations/b.yaml",
        &manifest("b", "b").replace("namespace: apps", "namespace: finance"),
    );
    // A folder's defaults that move migrations elsewhere are blamed there.
    write(dir.path(), "migrations/team/defaults.yaml", "spec:\n  destination:\n    namespace: payroll\n");
    write(dir.path(), "migrations/team/c.yaml", &manifest("c", "c").replace("    namespace: apps\n", ""));
    let errors = errors_of(dir.path());
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(
        errors[0].starts_with("migrations/a.yaml:14: spec.destination.namespace: destination namespace \"kube-system\" is a system namespace"),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("migrations/b.yaml:14: spec.destination.namespace: destination namespace \"finance\" is not allowed for migrations in \"vmmigrate\" (allowed: vmmigrate or apps)"),
        "{errors:?}"
    );
    assert!(
        errors[2].starts_with("migrations/team/defaults.yaml:3: spec.destination.namespace: "),
        "{errors:?}"
    );
    // Nothing is applied from a commit with errors; without the rule, even `apps` is refused.
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let only_ok: Vec<_> = files.into_iter().filter(|f| f.path == "migrations/ok.yaml").collect();
    assert!(render(&only_ok, &provenance(), &options()).is_ok());
    let refused = render(&only_ok, &provenance(), &RenderOptions::default()).unwrap_err();
    assert!(refused[0].message.contains("--allow-destination vmmigrate=apps"), "{refused:?}");
}

/// A migration whose destination is its own namespace (`ns`).
fn tenant_manifest(name: &str, ns: &str) -> String {
    manifest(name, name).replace("    namespace: apps\n", &format!("    namespace: {ns}\n"))
}

#[test]
fn a_manifest_in_a_tenants_folder_cannot_place_its_migration_in_another_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = TenantBindings::parse(&["apps=apps", "finance=finance"]).unwrap();
    let opts = RenderOptions::new("vmmigrate", &DestinationRules::default()).with_tenants(tenants.clone());
    // The tenant's own migration lands in its folder's namespace unasked.
    write(dir.path(), "migrations/apps/web.yaml", &tenant_manifest("web", "apps"));
    write(dir.path(), "migrations/finance/ledger.yaml", &tenant_manifest("ledger", "finance"));
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let rendered = render(&files, &provenance(), &opts).expect("both tenants render");
    let web = rendered.iter().find(|r| r.name == "web").unwrap();
    assert_eq!((web.namespace.as_str(), web.tenant.as_deref()), ("apps", Some("migrations/apps")));
    assert_eq!(rendered.iter().find(|r| r.name == "ledger").unwrap().namespace, "finance");

    // Someone who may only change migrations/apps/ names finance, in the
    // manifest or in the folder's defaults: refused at that line.
    write(
        dir.path(),
        "migrations/apps/steal.yaml",
        &tenant_manifest("steal", "finance").replacen(
            "  name: steal\n",
            "  name: steal\n  namespace: finance\n",
            1,
        ),
    );
    write(dir.path(), "migrations/apps/db/defaults.yaml", "metadata:\n  namespace: finance\n");
    write(dir.path(), "migrations/apps/db/db.yaml", &tenant_manifest("db", "finance"));
    // A folder nobody bound.
    write(dir.path(), "migrations/ops/tool.yaml", &tenant_manifest("tool", "ops"));
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let errors: Vec<String> =
        render(&files, &provenance(), &opts).unwrap_err().iter().map(ToString::to_string).collect();
    // (tool.yaml is also told its destination is not its namespace's.)
    assert_eq!(errors.len(), 4, "{errors:#?}");
    assert!(
        errors.iter().any(|e| e.starts_with("migrations/apps/steal.yaml:5: metadata.namespace: is \"finance\", but migrations/apps/ belongs to the tenant of namespace \"apps\"")),
        "{errors:#?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("migrations/apps/db/defaults.yaml:2: metadata.namespace: is \"finance\"")),
        "{errors:#?}"
    );
    assert!(
        errors.iter().any(|e| e.starts_with("migrations/ops/tool.yaml")
            && e.contains("migrations/ops/ is bound to no tenant")),
        "{errors:#?}"
    );
    // Without bindings the same files render (one team's repository).
    let open = RenderOptions::new("vmmigrate", &DestinationRules::default());
    let steal: Vec<_> = files.into_iter().filter(|f| f.path == "migrations/apps/steal.yaml").collect();
    let rendered = render(&steal, &provenance(), &open).expect("no tenants, no refusal");
    assert_eq!(rendered[0].namespace, "finance");
}

#[test]
fn allow_rules_follow_the_tenant_not_the_namespace_a_manifest_chose() {
    let dir = tempfile::tempdir().unwrap();
    // apps may create VMs in web; finance may not.
    let rules = DestinationRules::parse(&["apps=web"]).unwrap();
    let tenants = TenantBindings::parse(&["apps=apps", "finance=finance"]).unwrap();
    let opts = RenderOptions::new("vmmigrate", &rules).with_tenants(tenants);
    write(dir.path(), "migrations/apps/a.yaml", &tenant_manifest("a", "web"));
    write(dir.path(), "migrations/finance/f.yaml", &tenant_manifest("f", "web"));
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let errors: Vec<String> =
        render(&files, &provenance(), &opts).unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].starts_with("migrations/finance/f.yaml:14: spec.destination.namespace: destination namespace \"web\" is not allowed for migrations in \"finance\""), "{errors:#?}");
}

#[test]
fn a_network_of_another_namespace_is_refused_at_its_line_by_the_destination_rules() {
    let dir = tempfile::tempdir().unwrap();
    let rules = DestinationRules::parse(&["apps=web"]).unwrap();
    let opts = RenderOptions::new("apps", &rules);
    let with_network = |name: &str, network: &str| {
        format!(
            "{}  networkMap:\n    - source: VM Network\n      type: Multus\n      networkName: {network}\n",
            tenant_manifest(name, "apps")
        )
    };
    write(dir.path(), "migrations/own.yaml", &with_network("own", "vlan10"));
    write(dir.path(), "migrations/open.yaml", &with_network("open", "web/vlan10"));
    write(dir.path(), "migrations/steal.yaml", &with_network("steal", "finance/vlan10"));
    let files = read_dir_files(dir.path(), &Default::default()).unwrap().files;
    let errors: Vec<String> =
        render(&files, &provenance(), &opts).unwrap_err().iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].starts_with("migrations/steal.yaml:19: spec.networkMap[0].networkName: network \"finance/vlan10\" is in another namespace"),
        "{errors:#?}"
    );
}

#[test]
fn provider_fields_fill_the_source_and_a_migration_cannot_override_them() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", PROVIDER);
    write(dir.path(), "migrations/a.yaml", &provider_manifest("a", "esxi01"));
    // The provider may also come from a folder's defaults.
    write(dir.path(), "migrations/team/defaults.yaml", "spec:\n  source:\n    provider: esxi01\n");
    write(
        dir.path(),
        "migrations/team/c.yaml",
        &provider_manifest("c", "esxi01").replace("    provider: esxi01\n", ""),
    );
    let rendered = render_dir(dir.path()).unwrap();

    let a = one(&rendered, "a");
    assert_eq!(
        a["spec"]["source"],
        serde_json::json!({
            "host": "esxi01.example.internal",
            "port": 2222,
            "hostKey": HOST_KEY,
            "credentialsSecretRef": {"name": "esxi01-credentials"},
            "vm": {"name": "a"}
        }),
        "provider resolved and `provider` removed (the CRD has no such field)"
    );
    assert_eq!(one(&rendered, "c")["spec"]["source"]["port"], 2222);
    // The rendered objects are what the typed controller reads.
    for r in &rendered {
        let _: vmmigrate::api::VirtualMachineMigration = serde_json::from_value(r.object.clone()).unwrap();
    }

    // Pointing a provider's credentials at another host (and its key) is refused,
    // in the manifest and in a folder's defaults alike.
    let b = provider_manifest("b", "esxi01").replace(
        "    provider: esxi01\n",
        &format!("    provider: esxi01\n    host: attacker.example\n    hostKey: {OTHER_KEY}\n"),
    );
    write(dir.path(), "migrations/b.yaml", &b);
    write(
        dir.path(),
        "migrations/team/defaults.yaml",
        "spec:\n  source:\n    provider: esxi01\n    port: 2200\n",
    );
    let errors = errors_of(dir.path());
    let bound = "by provider \"esxi01\" (providers/), which binds host, port, hostKey and credentialsSecretRef together";
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(
        errors[0].starts_with("migrations/b.yaml:8: spec.source.host: is set ") && errors[0].contains(bound),
        "{errors:?}"
    );
    assert!(errors[1].starts_with("migrations/b.yaml:9: spec.source.hostKey: is set "), "{errors:?}");
    assert!(
        errors[2].starts_with("migrations/team/defaults.yaml:4: spec.source.port: is set "),
        "{errors:?}"
    );
}

#[test]
fn a_providers_read_cap_flows_into_its_migrations_and_a_migration_may_lower_its_own() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", &format!("{PROVIDER}  maxConcurrentReads: 1\n"));
    write(dir.path(), "migrations/a.yaml", &provider_manifest("a", "esxi01"));
    let own = provider_manifest("b", "esxi01")
        .replace("    provider: esxi01\n", "    provider: esxi01\n    maxConcurrentReads: 1\n");
    write(dir.path(), "migrations/b.yaml", &own);
    let rendered = render_dir(dir.path()).unwrap();
    assert_eq!(one(&rendered, "a")["spec"]["source"]["maxConcurrentReads"], 1, "from the provider");
    assert_eq!(one(&rendered, "b")["spec"]["source"]["maxConcurrentReads"], 1);
    let typed: vmmigrate::api::VirtualMachineMigration =
        serde_json::from_value(one(&rendered, "a").clone()).unwrap();
    assert_eq!(typed.spec.source.max_concurrent_reads, Some(1));

    // Out of range, in the provider: reported at its line.
    write(dir.path(), "providers/esxi01.yaml", &format!("{PROVIDER}  maxConcurrentReads: 0\n"));
    let errors = errors_of(dir.path());
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("providers/esxi01.yaml:") && e.contains("spec.maxConcurrentReads")),
        "{errors:?}"
    );
}

#[test]
fn an_unknown_provider_is_an_error_naming_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", PROVIDER);
    write(dir.path(), "providers/esxi02.yaml", &PROVIDER.replace("name: esxi01\n", "name: esxi02\n"));
    write(dir.path(), "migrations/a.yaml", &provider_manifest("a", "esxi03"));
    assert_eq!(
        errors_of(dir.path()),
        vec![
            "migrations/a.yaml:7: spec.source.provider: unknown provider \"esxi03\" (known: esxi01, esxi02)"
        ]
    );
}

#[test]
fn a_provider_with_a_bad_host_key_is_reported_at_the_provider_file() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", &PROVIDER.replace(HOST_KEY, "SHA256:tooshort"));
    write(dir.path(), "migrations/a.yaml", &provider_manifest("a", "esxi01"));
    write(dir.path(), "migrations/b.yaml", &provider_manifest("b", "esxi01"));
    assert_eq!(
        errors_of(dir.path()),
        vec![
            "providers/esxi01.yaml:8: spec.hostKey: must look like SHA256:<43 base64 chars>, as `ssh-keygen -lf` prints it (got \"SHA256:tooshort\")"
        ]
    );
}

#[test]
fn a_misspelled_field_is_an_error_with_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &(manifest("a", "a") + "  powerOfPolicy: Force\n"));
    assert_eq!(
        errors_of(dir.path()),
        vec![
            "migrations/a.yaml:16: spec.powerOfPolicy: unknown field; did you mean `powerOffPolicy`? (the API server would silently drop it)"
        ]
    );
}

#[test]
fn errors_in_later_documents_of_a_file_carry_the_file_line() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{}---\n{}",
        manifest("a", "a"),
        manifest("b", "b").replace("storageClassName: standard", "storageClassName: \"\"")
    );
    write(dir.path(), "migrations/many.yaml", &text);
    assert_eq!(
        errors_of(dir.path()),
        vec!["migrations/many.yaml:31: spec.destination.storageClassName: must not be empty"]
    );
    write(dir.path(), "migrations/many.yaml", &format!("{}---\n{}", manifest("a", "a"), manifest("b", "b")));
    let rendered = render_dir(dir.path()).unwrap();
    assert_eq!(rendered.iter().map(|r| r.doc_index).collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn a_yaml_syntax_error_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/good.yaml", &manifest("good", "good"));
    let broken = manifest("bad", "bad").replace("    vm:\n      name: bad\n", "    vm:\n      name: [bad\n");
    write(dir.path(), "migrations/bad.yaml", &format!("# a comment\n---\n{broken}"));
    let errors = render_dir(dir.path()).unwrap_err();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].path, "migrations/bad.yaml");
    // The unclosed flow sequence opens on line 14 and the parser notices at the end.
    let line = errors[0].line.unwrap();
    assert!((14..=18).contains(&line), "{}", errors[0]);
    assert!(errors[0].message.starts_with("YAML syntax: "), "{}", errors[0]);

    write(
        dir.path(),
        "migrations/bad.yaml",
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\n  metadata: {}\n",
    );
    let errors = render_dir(dir.path()).unwrap_err();
    assert_eq!(errors[0].line, Some(3), "{}", errors[0]);
}

#[test]
fn the_same_source_vm_twice_is_an_error_on_both_manifests() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "web 01"));
    // The same VM, written with the default port spelled out and the host in capitals.
    let b = manifest("b", "web 01")
        .replace("host: esxi01.example.internal", "host: ESXi01.example.internal\n    port: 22");
    write(dir.path(), "migrations/team/b.yaml", &b);
    let errors = errors_of(dir.path());
    assert_eq!(
        errors,
        vec![
            "migrations/a.yaml:11: spec.source.vm: source VM name \"web 01\" on esxi01.example.internal:22 is also migrated by migrations/team/b.yaml:12",
            "migrations/team/b.yaml:12: spec.source.vm: source VM name \"web 01\" on esxi01.example.internal:22 is also migrated by migrations/a.yaml:11",
        ]
    );
}

#[test]
fn the_same_destination_vm_or_name_twice_is_an_error_on_each_manifest() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("web", "web-a"));
    // Another migration whose explicit destination name is the first one's default.
    let b = manifest("b", "web-b").replace("    namespace: apps\n", "    namespace: apps\n    name: web\n");
    write(dir.path(), "migrations/b.yaml", &b);
    let errors = errors_of(dir.path());
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].starts_with("migrations/a.yaml:13: spec.destination: destination VM apps/web is also the destination of migrations/b.yaml:13"), "{errors:?}");
    assert!(errors[1].starts_with("migrations/b.yaml:13: spec.destination: destination VM apps/web is also the destination of migrations/a.yaml:13"), "{errors:?}");

    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("web", "web-a"));
    let b =
        manifest("web", "web-b").replace("    namespace: apps\n", "    namespace: apps\n    name: web-b\n");
    write(dir.path(), "migrations/b.yaml", &b);
    let errors = errors_of(dir.path());
    assert_eq!(
        errors,
        vec![
            "migrations/a.yaml:4: metadata.name: migration vmmigrate/web is also defined in migrations/b.yaml:4",
            "migrations/b.yaml:4: metadata.name: migration vmmigrate/web is also defined in migrations/a.yaml:4",
        ]
    );
}

#[test]
fn a_secret_looking_field_is_refused_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let a = manifest("a", "a").replace(
        "      name: esxi01-credentials\n",
        "      name: esxi01-credentials\n    password: hunter2\n",
    );
    write(dir.path(), "migrations/a.yaml", &a);
    write(
        dir.path(),
        "providers/esxi01.yaml",
        &(PROVIDER.to_owned() + "  privateKey: |\n    -----BEGIN OPENSSH PRIVATE KEY-----\n"),
    );
    let errors = errors_of(dir.path());
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].starts_with(
            "migrations/a.yaml:11: spec.source.password: looks like a secret; credentials never go into Git"
        ),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("providers/esxi01.yaml:11: spec.privateKey: looks like a secret"),
        "{errors:?}"
    );
}

#[test]
fn missing_required_fields_are_reported_after_defaults_and_provider() {
    let dir = tempfile::tempdir().unwrap();
    let a = manifest("a", "a").replace(&format!("    hostKey: {HOST_KEY}\n"), "");
    write(dir.path(), "migrations/a.yaml", &a);
    // Supplied by the folder's defaults: not an error.
    write(dir.path(), "migrations/ok/defaults.yaml", &format!("spec:\n  source:\n    hostKey: {HOST_KEY}\n"));
    write(
        dir.path(),
        "migrations/ok/b.yaml",
        &manifest("b", "b").replace(&format!("    hostKey: {HOST_KEY}\n"), ""),
    );
    assert_eq!(errors_of(dir.path()), vec!["migrations/a.yaml:6: spec.source.hostKey: is required"]);
}

#[test]
fn only_migrations_and_providers_are_read_and_other_files_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    write(dir.path(), "migrations/notes.md", "not yaml");
    write(dir.path(), "migrations/.git/config.yaml", "not: read");
    write(dir.path(), "status/vmmigrate/a.yaml", "phase: Completed\n");
    write(dir.path(), "kustomization.yaml", "resources: []\n");
    write(dir.path(), "providers/esxi01.yml", PROVIDER);
    let files: Vec<String> = read_dir_files(dir.path(), &Default::default())
        .unwrap()
        .files
        .into_iter()
        .map(|f: RepoFile| f.path)
        .collect();
    assert_eq!(files, vec!["migrations/a.yaml", "providers/esxi01.yml"]);
    assert_eq!(render_dir(dir.path()).unwrap().len(), 1);
}

#[test]
fn a_thousand_generated_manifests_render_without_error() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "providers/esxi01.yaml", PROVIDER);
    write(
        dir.path(),
        "migrations/defaults.yaml",
        "spec:\n  networkMap:\n    - source: VM Network\n      type: Pod\n",
    );
    for i in 0..1000 {
        let folder = format!("migrations/rack-{:02}", i % 20);
        if i < 20 {
            write(
                dir.path(),
                &format!("{folder}/defaults.yaml"),
                "spec:\n  powerOffPolicy: GracefulThenForce\n",
            );
        }
        write(
            dir.path(),
            &format!("{folder}/vm-{i:04}.yaml"),
            &provider_manifest(&format!("vm-{i:04}"), "esxi01"),
        );
    }
    let rendered = render_dir(dir.path()).unwrap();
    assert_eq!(rendered.len(), 1000);
    assert!(rendered.iter().all(|r| r.object["spec"]["powerOffPolicy"] == "GracefulThenForce"));
    assert_eq!(to_yaml(&rendered).matches("---\n").count(), 999);
}

#[test]
fn validate_exits_0_with_a_count_and_1_with_path_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    let root = dir.path().to_str().unwrap();
    let out = vmmigrate(&["validate", root]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "ok: 1 migrations\n");

    write(dir.path(), "migrations/b.yaml", &(manifest("b", "b") + "  powerOfPolicy: Force\n"));
    write(dir.path(), "migrations/c.yaml", "kind: [\n");
    let out = vmmigrate(&["validate", root]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(lines[0].starts_with("migrations/b.yaml:16: spec.powerOfPolicy: unknown field"), "{stderr}");
    assert!(lines[1].starts_with("migrations/c.yaml:2: YAML syntax: "), "{stderr}");
    assert_eq!(lines[2], "error: 2 error(s) in the repository");
    assert!(out.stdout.is_empty());

    // Without the administrator's rule the destination is refused, and a rule
    // that cannot be read is a usage error naming it.
    std::fs::remove_file(dir.path().join("migrations/b.yaml")).unwrap();
    std::fs::remove_file(dir.path().join("migrations/c.yaml")).unwrap();
    let bare = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .args(args)
            .env_remove("VMMIGRATE_ALLOW_DESTINATION")
            .output()
            .unwrap()
    };
    let out = bare(&["validate", root]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with(
            "migrations/a.yaml:14: spec.destination.namespace: destination namespace \"apps\" is not allowed"
        ),
        "{stderr}"
    );
    let out = bare(&["validate", root, "--allow-destination", "vmmigrate=apps"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = bare(&["validate", root, "--allow-destination", "vmmigrate=kube-system"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"kube-system\" is a system namespace"));

    let out = vmmigrate(&["validate", &format!("{root}/migrations/a.yaml")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("not a directory (remote URLs: use `vmmigrate gitops`)")
    );
    let out = vmmigrate(&["validate", root, "--namespace", "Not_A_Namespace"]);
    assert_eq!(out.status.code(), Some(2), "a bad flag is a usage error");
}

#[test]
fn render_prints_the_examples_repo_with_its_defaults_and_provider_resolved() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples-repo");
    let out = vmmigrate(&["render", examples.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let yaml = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<serde_json::Value> =
        yaml.split("---\n").map(|d| serde_yaml::from_str(d).unwrap()).collect();
    assert_eq!(docs.len(), 2, "{yaml}");
    let db = docs.iter().find(|d| d["metadata"]["name"] == "db-01").expect("db-01 rendered");
    assert_eq!(db["spec"]["source"]["host"], "esxi01.example.internal");
    assert!(db["spec"]["source"].get("provider").is_none());
    assert_eq!(db["spec"]["destination"]["namespace"], "finance");
    assert_eq!(db["metadata"]["annotations"][ANNOTATION_PATH], "migrations/finance/db-01.yaml");
    let out = vmmigrate(&["validate", examples.to_str().unwrap()]);
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "ok: 2 migrations\n");
}

#[test]
fn render_stamps_the_head_commit_of_a_clean_work_tree_and_working_tree_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir.path())
            .args(args)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@example.com")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@example.com")
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let commit_of = || {
        let out = vmmigrate(&["render", dir.path().to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let doc: serde_json::Value = serde_yaml::from_slice(&out.stdout).unwrap();
        doc["metadata"]["annotations"][ANNOTATION_COMMIT].as_str().unwrap().to_owned()
    };
    assert_eq!(commit_of(), "working-tree", "not a git repository");
    git(&["init", "-q"]);
    git(&["add", "."]);
    git(&["commit", "-q", "-m", "a"]);
    assert_eq!(commit_of(), git(&["rev-parse", "HEAD"]));
    write(dir.path(), "migrations/a.yaml", &manifest("a", "changed"));
    assert_eq!(commit_of(), "working-tree", "uncommitted changes");
}

// ---- Hostile repositories: every limit refuses with the file, line and limit ----

/// `validate` of `root` under the default limits: (exit code, stderr).
fn validate(root: &Path) -> (Option<i32>, String) {
    let out = vmmigrate(&["validate", root.to_str().unwrap()]);
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_billion_laughs_is_refused_by_counting_its_aliases_not_by_expanding_them() {
    let dir = tempfile::tempdir().unwrap();
    // Nine levels of ten aliases each: 10^9 nodes once expanded, 1 KB as text.
    let mut text = String::from(
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\na0: &a0 [lol]\n",
    );
    for i in 1..=9 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    write(dir.path(), "migrations/laughs.yaml", &text);
    write(dir.path(), "migrations/ok.yaml", &manifest("ok", "ok"));
    let (code, stderr) = validate(dir.path());
    assert_eq!(code, Some(1), "{stderr}");
    let first = stderr.lines().next().unwrap();
    assert!(
        first.starts_with("migrations/laughs.yaml:")
            && first.contains(
                "holds more than 50000 YAML nodes, aliases expanded (the limit) (--max-yaml-nodes)"
            ),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 2, "one error, then the count: {stderr}");
}

#[test]
fn deep_nesting_and_huge_lists_and_files_are_refused_at_their_limits() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/nested.yaml", &"[".repeat(200_000));
    let list: String = (0..60_000).map(|i| format!("- {i}\n")).collect();
    write(dir.path(), "migrations/list.yaml", &format!("items:\n{list}"));
    write(dir.path(), "migrations/big.yaml", &format!("# {}\n", "x".repeat(2 << 20)));
    let (code, stderr) = validate(dir.path());
    assert_eq!(code, Some(1));
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{stderr}");
    assert!(
        lines[0].starts_with(
            "migrations/big.yaml: is 2097155 bytes, more than the limit of 1048576 (--max-file-bytes)"
        ),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with("migrations/list.yaml:49999: YAML document 1: holds more than 50000 YAML nodes"),
        "{stderr}"
    );
    assert!(lines[2].starts_with("migrations/nested.yaml:1: YAML document 1: nests deeper than 32 levels (the limit) (--max-yaml-depth)"), "{stderr}");
    // The limits are flags: raised, the same list is only a wrong document.
    let out = vmmigrate(&[
        "validate",
        dir.path().to_str().unwrap(),
        "--max-yaml-nodes",
        "100000",
        "--max-file-bytes",
        "4194304",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("migrations/list.yaml:1: kind: is required"), "{stderr}");
}

#[test]
fn only_files_the_format_names_are_read_and_binary_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    // 64 MiB that is not YAML, in migrations/: never opened, never counted.
    let image = std::fs::File::create(dir.path().join("migrations/disk.img")).unwrap();
    image.set_len(64 << 20).unwrap();
    let out = vmmigrate(&["validate", dir.path().to_str().unwrap(), "--max-repo-bytes", "65536"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // A binary file named like a manifest is an error, not a crash.
    std::fs::write(dir.path().join("migrations/blob.yaml"), [0u8, 159, 146, 150, 0xff, 0xfe]).unwrap();
    let (code, stderr) = validate(dir.path());
    assert_eq!(code, Some(1));
    assert!(stderr.starts_with("migrations/blob.yaml: is not UTF-8 text"), "{stderr}");
}

#[test]
fn symbolic_links_are_refused_and_never_followed_out_of_the_repository() {
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "secret.yaml", &manifest("stolen", "stolen"));
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    std::os::unix::fs::symlink(outside.path().join("secret.yaml"), dir.path().join("migrations/link.yaml"))
        .unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("migrations/team")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("providers")).unwrap();
    let out = vmmigrate(&["render", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing rendered from a tree with a link");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines[..3],
        [
            "migrations/link.yaml: is a symbolic link; vmmigrate reads no file through a link",
            "migrations/team: is a symbolic link; vmmigrate reads no file through a link",
            "providers: is a symbolic link; vmmigrate reads no file through a link",
        ],
        "{stderr}"
    );
    assert!(!stderr.contains("stolen"));
}

#[test]
fn a_file_name_with_a_newline_cannot_inject_a_line_into_ci_output() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "migrations/a.yaml", &manifest("a", "a"));
    write(dir.path(), "migrations/x\n::error file=README.md::all good.yaml", &manifest("b", "b"));
    let (code, stderr) = validate(dir.path());
    assert_eq!(code, Some(1));
    assert!(stderr.lines().all(|l| !l.starts_with("::")), "{stderr}");
    assert!(
        stderr.starts_with("migrations/x\\n::error file=README.md::all good.yaml: has a control character (a newline?) in its name; rename it"),
        "{stderr}"
    );
}
