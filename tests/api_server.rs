//! The VirtualMachineMigration CRD against a real kube-apiserver: the schema is
//! structural and enforced, status goes through server-side apply and merge patches on /status,
//! optimistic concurrency holds, and owner references cascade.

use crate::support::{KubeEnv, test_namespace};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use std::time::Duration;
use vmmigrate::api::{Phase, PowerOffPolicy, VirtualMachineMigration};

const FIELD_MANAGER: &str = "vmmigrate-controller";
const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

fn minimal_manifest(name: &str) -> serde_json::Value {
    json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": name},
        "spec": {
            "source": {
                "host": "esxi01.example.internal",
                "hostKey": HOST_KEY,
                "credentialsSecretRef": {"name": "esxi01-credentials"},
                "vm": {"name": "web 01"}
            },
            "destination": {"namespace": "apps", "storageClassName": "standard"}
        }
    })
}

async fn setup(prefix: &str) -> (Client, String, Api<VirtualMachineMigration>) {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, prefix).await;
    let api = Api::namespaced(client.clone(), &ns);
    (client, ns, api)
}

/// Creates from raw JSON (so tests can send what the typed struct would not).
async fn create_raw(
    client: &Client,
    ns: &str,
    body: serde_json::Value,
) -> Result<VirtualMachineMigration, kube::Error> {
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), ns);
    let obj: VirtualMachineMigration = match serde_json::from_value(body.clone()) {
        Ok(obj) => obj,
        // Invalid on purpose: send it untyped through the dynamic API.
        Err(_) => {
            let ar = kube::discovery::ApiResource::erase::<VirtualMachineMigration>(&());
            let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
            let obj: kube::api::DynamicObject = serde_json::from_value(body).expect("dynamic object");
            let created = dynamic.create(&PostParams::default(), &obj).await?;
            return Ok(serde_json::from_value(serde_json::to_value(created).unwrap()).unwrap());
        }
    };
    api.create(&PostParams::default(), &obj).await
}

fn api_error(err: kube::Error) -> kube::core::Status {
    match err {
        kube::Error::Api(resp) => *resp,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn api_server_is_the_real_one_built_from_go_modules() {
    let env = KubeEnv::shared();
    let client = env.client().await;
    let info = client.apiserver_version().await.expect("version");
    eprintln!("testenv: kube-apiserver {} ({})", info.git_version, info.platform);
    // The version pinned in the Go module the cluster is built from (its
    // build stamps it into the binaries), not a value read back from the server.
    let go_mod =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tools/testenv/go.mod")).unwrap();
    let pinned = go_mod
        .lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes v").map(|v| format!("v{}", v.trim())))
        .expect("k8s.io/kubernetes in tools/testenv/go.mod");
    assert_eq!(info.git_version, pinned, "the API server is not the one built from tools/testenv/go.mod");
    assert_eq!(info.git_tree_state, "clean");
    assert_eq!(info.major, "1");
    assert_eq!(env.version, pinned);
}

#[tokio::test]
async fn crd_is_accepted_with_a_structural_schema() {
    let client = KubeEnv::shared().client().await;
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let crd = crds.get("virtualmachinemigrations.migration.platform.example").await.expect("CRD installed");
    let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
    let status_of = |t: &str| conditions.iter().find(|c| c.type_ == t).map(|c| c.status.clone());
    assert_eq!(status_of("Established").as_deref(), Some("True"));
    assert_eq!(status_of("NamesAccepted").as_deref(), Some("True"));
    // The API server sets NonStructuralSchema=True when the schema is not structural.
    assert_ne!(status_of("NonStructuralSchema").as_deref(), Some("True"), "{conditions:?}");
    assert_eq!(crd.spec.names.short_names.as_deref(), Some(&["vmm".to_owned()][..]));
    let version = &crd.spec.versions[0];
    assert!(version.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some(), "status subresource");
    let columns: Vec<_> =
        version.additional_printer_columns.iter().flatten().map(|c| c.name.as_str()).collect();
    for column in ["Phase", "Progress", "Age"] {
        assert!(columns.contains(&column), "printer column {column} missing: {columns:?}");
    }
}

#[tokio::test]
async fn minimal_manifest_is_accepted_and_defaulted_by_the_server() {
    let (client, ns, api) = setup("minimal").await;
    create_raw(&client, &ns, minimal_manifest("web-01")).await.expect("minimal manifest accepted");
    // Read it back: the defaults were applied by the API server from the CRD schema.
    let stored = api.get("web-01").await.unwrap();
    assert_eq!(stored.spec.source.port, 22);
    assert_eq!(stored.spec.power_off_policy, PowerOffPolicy::GracefulOnly);
    assert_eq!(stored.spec.strategy.retry_limit, 5);
    assert_eq!(stored.spec.strategy.timeouts.shutdown_seconds, 300);
    let raw = serde_json::to_value(&stored).unwrap();
    assert_eq!(raw["spec"]["conversion"]["format"], "raw");
    assert_eq!(raw["spec"]["destination"]["runStrategy"], "Always");
    assert_eq!(raw["spec"]["cleanup"]["staging"], "Delete");
}

#[tokio::test]
async fn status_is_written_by_server_side_apply_on_the_status_subresource() {
    let (client, ns, api) = setup("ssa").await;
    create_raw(&client, &ns, minimal_manifest("web-01")).await.unwrap();
    let patch = json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "web-01", "namespace": ns},
        "status": {
            "phase": "Discovering",
            "observedGeneration": 1,
            "conditions": [{
                "type": "Reconciling", "status": "True", "reason": "Discovering",
                "message": "discovering the source VM", "lastTransitionTime": "2026-11-29T10:00:00Z",
                "observedGeneration": 1
            }]
        }
    });
    let updated = api
        .patch_status("web-01", &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .expect("status apply");
    let status = updated.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Discovering);
    assert_eq!(status.conditions[0].reason, "Discovering");
    // The status fields are owned by our field manager, through the status subresource.
    let managed = updated.meta().managed_fields.clone().unwrap_or_default();
    let ours = managed
        .iter()
        .find(|m| m.manager.as_deref() == Some(FIELD_MANAGER))
        .expect("entry for vmmigrate-controller");
    assert_eq!(ours.subresource.as_deref(), Some("status"));
    assert_eq!(ours.operation.as_deref(), Some("Apply"));
    // A spec change sent to /status is ignored by the API server.
    let mut sneaky = patch.clone();
    sneaky["spec"] = json!({"powerOffPolicy": "Force"});
    let after = api
        .patch_status("web-01", &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&sneaky))
        .await
        .expect("status apply with spec");
    assert_eq!(after.spec.power_off_policy, PowerOffPolicy::GracefulOnly);
    assert_eq!(after.metadata.generation, updated.metadata.generation);
}

#[tokio::test]
async fn update_with_a_stale_resource_version_is_a_conflict() {
    let (client, ns, api) = setup("conflict").await;
    let created = create_raw(&client, &ns, minimal_manifest("web-01")).await.unwrap();
    let mut first = created.clone();
    first.spec.strategy.retry_limit = 7;
    api.replace("web-01", &PostParams::default(), &first).await.expect("first update");
    // `created` still carries the old resourceVersion.
    let mut stale = created;
    stale.spec.strategy.retry_limit = 9;
    let err = api.replace("web-01", &PostParams::default(), &stale).await.expect_err("stale update");
    let resp = api_error(err);
    assert_eq!(resp.code, 409, "{resp:?}");
    assert_eq!(resp.reason, "Conflict");
    assert_eq!(api.get("web-01").await.unwrap().spec.strategy.retry_limit, 7);
}

/// The controller writes status as a merge patch of what changed, carrying the
/// resourceVersion it read: a patch computed from a stale read is refused,
/// and a member set to null is removed.
#[tokio::test]
async fn a_status_merge_patch_from_a_stale_read_is_a_conflict_and_null_removes_a_member() {
    let (client, ns, api) = setup("merge").await;
    let created = create_raw(&client, &ns, minimal_manifest("web-01")).await.unwrap();
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    let first = json!({
        "metadata": {"resourceVersion": created.resource_version()},
        "status": {"phase": "Validated", "waiting": {"reason": "WaitingForWave", "message": "m", "since": "2026-11-29T10:00:00Z"}}
    });
    let written = api.patch_status("web-01", &params, &Patch::Merge(&first)).await.expect("first status");
    assert!(written.status.as_ref().unwrap().waiting.is_some());
    // Computed from `created` again: its resourceVersion is gone.
    let stale = json!({"metadata": {"resourceVersion": created.resource_version()}, "status": {"phase": "Preparing"}});
    let resp =
        api_error(api.patch_status("web-01", &params, &Patch::Merge(&stale)).await.expect_err("stale"));
    assert_eq!(resp.code, 409, "{resp:?}");
    assert_eq!(api.get("web-01").await.unwrap().status.unwrap().phase, Phase::Validated);
    let next = json!({
        "metadata": {"resourceVersion": written.resource_version()},
        "status": {"phase": "Preparing", "waiting": null}
    });
    let after = api.patch_status("web-01", &params, &Patch::Merge(&next)).await.expect("fresh status");
    let status = after.status.unwrap();
    assert_eq!(status.phase, Phase::Preparing);
    assert!(status.waiting.is_none(), "null removes the member");
}

#[tokio::test]
async fn manifest_without_host_key_is_rejected_with_a_readable_message() {
    let (client, ns, _) = setup("invalid").await;
    let mut body = minimal_manifest("no-key");
    body["spec"]["source"].as_object_mut().unwrap().remove("hostKey");
    let resp = api_error(create_raw(&client, &ns, body).await.expect_err("rejected"));
    assert_eq!(resp.code, 422, "{resp:?}");
    assert!(resp.message.contains("spec.source.hostKey: Required value"), "{}", resp.message);
}

#[tokio::test]
async fn host_key_that_is_not_a_sha256_fingerprint_is_rejected() {
    let (client, ns, _) = setup("invalid").await;
    let mut body = minimal_manifest("bad-key");
    body["spec"]["source"]["hostKey"] = json!("MD5:aa:bb:cc");
    let resp = api_error(create_raw(&client, &ns, body).await.expect_err("rejected"));
    assert_eq!(resp.code, 422);
    assert!(resp.message.contains("spec.source.hostKey"), "{}", resp.message);
    assert!(resp.message.contains("should match"), "{}", resp.message);
}

#[tokio::test]
async fn vm_named_both_by_name_and_id_is_rejected_by_the_cel_rule() {
    let (client, ns, _) = setup("invalid").await;
    let mut body = minimal_manifest("both");
    body["spec"]["source"]["vm"] = json!({"name": "web", "id": "12"});
    let resp = api_error(create_raw(&client, &ns, body).await.expect_err("rejected"));
    assert_eq!(resp.code, 422);
    assert!(resp.message.contains("set exactly one of vm.name or vm.id"), "{}", resp.message);
}

#[tokio::test]
async fn destination_name_that_is_not_rfc1123_is_rejected() {
    let (client, ns, _) = setup("invalid").await;
    let mut body = minimal_manifest("bad-dest");
    body["spec"]["destination"]["name"] = json!("Web_01");
    let resp = api_error(create_raw(&client, &ns, body).await.expect_err("rejected"));
    assert_eq!(resp.code, 422);
    assert!(resp.message.contains("spec.destination.name"), "{}", resp.message);
}

#[tokio::test]
async fn status_with_an_unknown_phase_is_rejected() {
    let (client, ns, api) = setup("invalid").await;
    create_raw(&client, &ns, minimal_manifest("web-01")).await.unwrap();
    let patch = json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "web-01", "namespace": ns},
        "status": {"phase": "Teleporting"}
    });
    let ar = kube::discovery::ApiResource::erase::<VirtualMachineMigration>(&());
    let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    let err = dynamic
        .patch_status("web-01", &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .expect_err("unknown phase rejected");
    let resp = api_error(err);
    assert_eq!(resp.code, 422);
    assert!(resp.message.contains("status.phase: Unsupported value: \"Teleporting\""), "{}", resp.message);
    // Nothing was half-written.
    assert!(api.get("web-01").await.unwrap().status.is_none());
}

#[tokio::test]
async fn object_owned_by_a_deleted_migration_is_garbage_collected() {
    let (client, ns, api) = setup("gc").await;
    let vmm = create_raw(&client, &ns, minimal_manifest("web-01")).await.unwrap();
    let owner = vmm.controller_owner_ref(&()).expect("owner reference");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let mut owned = ConfigMap::default();
    owned.metadata.name = Some("web-01-owned".into());
    owned.metadata.owner_references = Some(vec![owner]);
    cms.create(&PostParams::default(), &owned).await.unwrap();
    let mut bystander = ConfigMap::default();
    bystander.metadata.name = Some("bystander".into());
    cms.create(&PostParams::default(), &bystander).await.unwrap();

    api.delete("web-01", &DeleteParams::background()).await.unwrap();
    // The garbage collector in kube-controller-manager removes the dependent.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while cms.get_opt("web-01-owned").await.unwrap().is_some() {
        assert!(tokio::time::Instant::now() < deadline, "owned ConfigMap not garbage-collected in 90s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(cms.get_opt("bystander").await.unwrap().is_some(), "unowned object must survive");
    assert_eq!(cms.get("bystander").await.unwrap().name_any(), "bystander");
}

#[tokio::test]
async fn example_repository_manifests_are_accepted_by_the_api_server() {
    // Rendered first: manifests that use providers/ and defaults.yaml are not
    // complete resources on their own (`vmmigrate render` is what gets applied).
    use vmmigrate::gitops::render::{RenderOptions, read_dir_files, render};
    let (client, ns, _) = setup("examples").await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples-repo");
    let files = read_dir_files(&root, &Default::default()).unwrap().files;
    let provenance =
        vmmigrate::gitops::Provenance { repo_url: root.display().to_string(), commit: "example".into() };
    let rendered = render(&files, &provenance, &RenderOptions::default())
        .unwrap_or_else(|errors| panic!("examples-repo does not render: {errors:?}"));
    // Exactly the rendered object, as gitops applies it (server-side apply),
    // with strict field validation: an unknown field would be refused, not pruned.
    let ar = kube::discovery::ApiResource::erase::<VirtualMachineMigration>(&());
    let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    for migration in &rendered {
        let mut object = migration.object.clone();
        object["metadata"]["namespace"] = json!(ns);
        let params = PatchParams::apply(vmmigrate::gitops::FIELD_MANAGER).dry_run().validation_strict();
        dynamic
            .patch(&migration.name, &params, &Patch::Apply(&object))
            .await
            .unwrap_or_else(|e| panic!("{} rejected: {e}", migration.path));
    }
    assert!(rendered.len() >= 2, "examples-repo should show a plain and a provider-based migration");
}
