//! deploy/: the kustomize base and its overlays, applied to a real
//! kube-apiserver that authorizes with RBAC (`--authorization-mode=RBAC` in
//! support/kube_env.rs), and the ServiceAccount's rights proven with
//! SubjectAccessReviews: every call in `CALLS` is allowed, everything in
//! `FORBIDDEN` is not.
//!
//! kustomize is not installed here, so `kustomize()` below builds the
//! kustomizations itself, implementing only what deploy/ uses (resources,
//! `namespace:`, JSON6902 `patches:`); it refuses any other field, so a new
//! feature in a kustomization fails here until this loader learns it.
//! (`kubectl kustomize` of each directory gave the same objects when written.)
//!
//! The base is applied to the shared cluster's real `vmmigrate-system`. The
//! gitops-coexistence tests change the shared ClusterRole, so they hold
//! `CLUSTER_RBAC` for writing and restore the base before letting go.

use crate::support::KubeEnv;
use clap::CommandFactory;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::Scope;
use kube::{Client, Config};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::RwLock;

/// One API request: (verb, API group, resource, subresource, namespace).
/// An empty namespace is a cluster-scoped resource, or every namespace.
pub(crate) type Call = (&'static str, &'static str, &'static str, &'static str, &'static str);

const MIGRATIONS: &str = "migration.platform.example";
pub(crate) const SYSTEM: &str = "vmmigrate-system";
/// Any namespace holding migrations or destinations (the ClusterRole's reach);
/// not one vmmigrate reads Secrets in.
pub(crate) const ANY: &str = "apps";
/// The namespace deploy/overlays/example-tenant grants.
const TENANT: &str = "vmmigrate";

pub(crate) const SA_USER: &str = "system:serviceaccount:vmmigrate-system:vmmigrate";
const SA_GROUPS: &[&str] =
    &["system:serviceaccounts", "system:serviceaccounts:vmmigrate-system", "system:authenticated"];

/// Every call vmmigrate makes under the base, from src/ (deploy/README.md
/// has the reason for each).
pub(crate) const CALLS: &[Call] = &[
    // gitops: apply (server-side apply, which creates a new object), orphan
    // marks, live list for status and plans; controller: watch all
    // namespaces, a fresh get per reconcile, finalizer and retry annotation.
    ("get", MIGRATIONS, "virtualmachinemigrations", "", ANY),
    ("list", MIGRATIONS, "virtualmachinemigrations", "", ""),
    ("watch", MIGRATIONS, "virtualmachinemigrations", "", ""),
    ("create", MIGRATIONS, "virtualmachinemigrations", "", ANY),
    ("patch", MIGRATIONS, "virtualmachinemigrations", "", ANY),
    ("patch", MIGRATIONS, "virtualmachinemigrations", "status", ANY),
    // blockOwnerDeletion on owned objects (OwnerReferencesPermissionEnforcement).
    ("update", MIGRATIONS, "virtualmachinemigrations", "finalizers", ANY),
    // DataVolumes and VMs are read everywhere, written where the tenant
    // Role is (`TENANT_CALLS`).
    ("list", "cdi.kubevirt.io", "datavolumes", "", ""),
    ("watch", "cdi.kubevirt.io", "datavolumes", "", ""),
    ("get", "cdi.kubevirt.io", "datavolumes", "", ANY),
    ("list", "kubevirt.io", "virtualmachines", "", ""),
    ("watch", "kubevirt.io", "virtualmachines", "", ""),
    ("get", "kubevirt.io", "virtualmachines", "", ANY),
    ("list", "kubevirt.io", "virtualmachineinstances", "", ""),
    ("watch", "kubevirt.io", "virtualmachineinstances", "", ""),
    ("get", "kubevirt.io", "virtualmachineinstances", "", ANY),
    // Conversion Jobs, in VMMIGRATE_JOB_NAMESPACE only.
    ("get", "batch", "jobs", "", SYSTEM),
    ("list", "batch", "jobs", "", SYSTEM),
    ("create", "batch", "jobs", "", SYSTEM),
    ("delete", "batch", "jobs", "", SYSTEM),
    // Why a conversion Job failed: its pod's termination message.
    ("get", "", "pods", "", SYSTEM),
    ("list", "", "pods", "", SYSTEM),
    // --data-plane pods: a worker's Service and work claim beside its Job.
    ("get", "", "services", "", SYSTEM),
    ("create", "", "services", "", SYSTEM),
    ("delete", "", "services", "", SYSTEM),
    ("get", "", "persistentvolumeclaims", "", SYSTEM),
    ("create", "", "persistentvolumeclaims", "", SYSTEM),
    ("delete", "", "persistentvolumeclaims", "", SYSTEM),
    // The leader's label on its own pod (the webhook Service follows it).
    ("patch", "", "pods", "", SYSTEM),
    // HTTP checks.
    ("get", "", "services", "", ANY),
    ("list", "discovery.k8s.io", "endpointslices", "", ANY),
    ("list", "networking.k8s.io", "servicecidrs", "", ""),
    // Pre-flight.
    ("get", "storage.k8s.io", "storageclasses", "", ""),
    // Does the installed CDI check checksums? Its DataVolume definition.
    ("get", "apiextensions.k8s.io", "customresourcedefinitions", "", ""),
    ("get", "", "namespaces", "", ""),
    // May it write in a migration's destination namespace? (Validated.)
    ("create", "authorization.k8s.io", "selfsubjectaccessreviews", "", ""),
    // kube-runtime's Recorder.
    ("create", "events.k8s.io", "events", "", ANY),
    ("patch", "events.k8s.io", "events", "", ANY),
    // Leader election and source-VM claims.
    ("get", "coordination.k8s.io", "leases", "", SYSTEM),
    ("create", "coordination.k8s.io", "leases", "", SYSTEM),
    ("update", "coordination.k8s.io", "leases", "", SYSTEM),
    ("delete", "coordination.k8s.io", "leases", "", SYSTEM),
    // What deleted migrations left on their sources: created by the
    // finalizer (`create` below), watched by the gitops side for the status branch.
    ("list", "", "configmaps", "", SYSTEM),
    ("watch", "", "configmaps", "", SYSTEM),
    // ESXi credentials of migrations in the namespace the base configures.
    ("get", "", "secrets", "", SYSTEM),
    // The import Secret and CA ConfigMap beside each DataVolume.
    ("create", "", "secrets", "", SYSTEM),
    ("patch", "", "secrets", "", SYSTEM),
    ("delete", "", "secrets", "", SYSTEM),
    ("get", "", "configmaps", "", SYSTEM),
    ("create", "", "configmaps", "", SYSTEM),
    ("patch", "", "configmaps", "", SYSTEM),
    ("delete", "", "configmaps", "", SYSTEM),
];

/// What the tenant Role (deploy/overlays/example-tenant/tenant.yaml) adds in
/// its namespace, written here for [`TENANT`].
pub(crate) const TENANT_CALLS: &[Call] = &[
    // The migrated VM and its DataVolumes.
    ("create", "cdi.kubevirt.io", "datavolumes", "", TENANT),
    ("patch", "cdi.kubevirt.io", "datavolumes", "", TENANT),
    ("delete", "cdi.kubevirt.io", "datavolumes", "", TENANT),
    ("create", "kubevirt.io", "virtualmachines", "", TENANT),
    ("patch", "kubevirt.io", "virtualmachines", "", TENANT),
    ("delete", "kubevirt.io", "virtualmachines", "", TENANT),
    // ESXi credentials by name; the import Secret and CA beside each DataVolume.
    ("get", "", "secrets", "", TENANT),
    ("create", "", "secrets", "", TENANT),
    ("patch", "", "secrets", "", TENANT),
    ("delete", "", "secrets", "", TENANT),
    ("get", "", "configmaps", "", TENANT),
    ("create", "", "configmaps", "", TENANT),
    ("patch", "", "configmaps", "", TENANT),
    ("delete", "", "configmaps", "", TENANT),
    // The verify Job where CDI cannot check a checksum, and the importer's
    // last words.
    ("get", "batch", "jobs", "", TENANT),
    ("create", "batch", "jobs", "", TENANT),
    ("delete", "batch", "jobs", "", TENANT),
    ("get", "", "pods", "", TENANT),
    ("list", "", "pods", "", TENANT),
    // The migrated guest's console (its launcher's guest-console-log).
    ("get", "", "pods", "log", TENANT),
    // A migration's worker pod, its Service and work claim.
    ("get", "", "services", "", TENANT),
    ("create", "", "services", "", TENANT),
    ("delete", "", "services", "", TENANT),
    ("get", "", "persistentvolumeclaims", "", TENANT),
    ("create", "", "persistentvolumeclaims", "", TENANT),
    ("delete", "", "persistentvolumeclaims", "", TENANT),
];

/// What the ServiceAccount must never be able to do.
const FORBIDDEN: &[Call] = &[
    // VMs and DataVolumes are written only where a tenant Role is: not in a
    // namespace without one, not in kube-system (a VM there could mount its
    // Secrets), not cluster-wide.
    ("create", "kubevirt.io", "virtualmachines", "", ANY),
    ("patch", "kubevirt.io", "virtualmachines", "", ANY),
    ("delete", "kubevirt.io", "virtualmachines", "", ANY),
    ("create", "kubevirt.io", "virtualmachines", "", "kube-system"),
    ("create", "kubevirt.io", "virtualmachines", "", ""),
    ("create", "cdi.kubevirt.io", "datavolumes", "", ANY),
    ("patch", "cdi.kubevirt.io", "datavolumes", "", ANY),
    ("delete", "cdi.kubevirt.io", "datavolumes", "", ANY),
    ("create", "cdi.kubevirt.io", "datavolumes", "", "kube-system"),
    // Never VMs or DataVolumes in its own namespace (Pod Security
    // `restricted` there; virt-launcher would not pass it).
    ("create", "kubevirt.io", "virtualmachines", "", SYSTEM),
    ("create", "cdi.kubevirt.io", "datavolumes", "", SYSTEM),
    // Service-account tokens are minted through this subresource.
    ("create", "", "serviceaccounts", "token", SYSTEM),
    ("create", "", "serviceaccounts", "token", TENANT),
    ("get", "", "secrets", "", ANY),
    ("list", "", "secrets", "", ANY),
    ("get", "", "secrets", "", ""),
    ("list", "", "secrets", "", ""),
    ("watch", "", "secrets", "", ""),
    // By name only, even where it may read them.
    ("list", "", "secrets", "", SYSTEM),
    ("watch", "", "secrets", "", SYSTEM),
    // Import Secrets and CAs only where a Role allows it, never cluster-wide.
    ("create", "", "secrets", "", ANY),
    ("patch", "", "secrets", "", ANY),
    ("delete", "", "secrets", "", ANY),
    ("create", "", "configmaps", "", ANY),
    // Records of what was left on sources are read in its own namespace only.
    ("list", "", "configmaps", "", ANY),
    ("watch", "", "configmaps", "", ANY),
    ("delete", "", "namespaces", "", ""),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings", "", ""),
    ("create", "rbac.authorization.k8s.io", "rolebindings", "", SYSTEM),
    ("escalate", "rbac.authorization.k8s.io", "clusterroles", "", ""),
    ("bind", "rbac.authorization.k8s.io", "clusterroles", "", ""),
    ("escalate", "rbac.authorization.k8s.io", "roles", "", SYSTEM),
    ("bind", "rbac.authorization.k8s.io", "roles", "", SYSTEM),
    ("impersonate", "", "serviceaccounts", "", ""),
    // It never deletes a migration: that is a person's decision.
    ("delete", MIGRATIONS, "virtualmachinemigrations", "", ANY),
    ("deletecollection", MIGRATIONS, "virtualmachinemigrations", "", ANY),
    // Jobs (pods that could mount any Secret of their namespace) only in vmmigrate-system.
    ("create", "batch", "jobs", "", ANY),
    ("create", "", "pods", "", SYSTEM),
    // Worker Services and claims only where Jobs may run.
    ("create", "", "services", "", ANY),
    ("create", "", "persistentvolumeclaims", "", ANY),
    ("delete", "", "persistentvolumeclaims", "", ANY),
    ("create", "coordination.k8s.io", "leases", "", ANY),
    ("patch", "", "pods", "", ANY),
];

/// Held for writing by tests that change the shared ClusterRole.
pub(crate) static CLUSTER_RBAC: RwLock<()> = RwLock::const_new(());

fn deploy_dir(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(rel)
}

// ---------------------------------------------------------------------------
// A minimal kustomize.

/// Kinds kustomize's namespace transformer leaves alone.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "StorageClass",
    "PersistentVolume",
    "PriorityClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
];

/// The objects `kustomize build <dir>` would print (in load order).
fn kustomize(dir: &Path) -> Vec<Value> {
    let file = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let k: Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let known = ["apiVersion", "kind", "resources", "namespace", "patches"];
    for key in k.as_object().expect("kustomization is a mapping").keys() {
        assert!(
            known.contains(&key.as_str()),
            "{}: this test's kustomize does not do `{key}`",
            file.display()
        );
    }
    let mut objects = Vec::new();
    for resource in k["resources"].as_array().into_iter().flatten() {
        let path = dir.join(resource.as_str().expect("resource path"));
        if path.is_dir() {
            objects.extend(kustomize(&path));
        } else {
            objects.extend(yaml_documents(&path));
        }
    }
    for patch in k["patches"].as_array().into_iter().flatten() {
        let path = dir.join(patch["path"].as_str().expect("only `path:` patches"));
        let ops: Value = serde_yaml::from_str(&std::fs::read_to_string(&path).expect("read patch"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(ops.is_array(), "{}: only JSON6902 patches (a list of operations)", path.display());
        let target = &patch["target"];
        let matching: Vec<&mut Value> = objects.iter_mut().filter(|o| targets(target, o)).collect();
        assert_eq!(matching.len(), 1, "{}: target {target} must match one object", path.display());
        for obj in matching {
            json6902(obj, &ops).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
    if let Some(ns) = k["namespace"].as_str() {
        for obj in &mut objects {
            set_namespace(obj, ns);
        }
    }
    objects
}

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

fn targets(target: &Value, obj: &Value) -> bool {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let field = |key: &str, actual: &str| target.get(key).and_then(Value::as_str).is_none_or(|w| w == actual);
    field("group", group)
        && field("version", version)
        && field("kind", obj["kind"].as_str().unwrap_or_default())
        && field("name", obj["metadata"]["name"].as_str().unwrap_or_default())
}

/// RFC 6902 `test`, `add`, `remove` and `replace`: what deploy/ uses.
fn json6902(doc: &mut Value, ops: &Value) -> Result<(), String> {
    for op in ops.as_array().into_iter().flatten() {
        let path = op["path"].as_str().ok_or("an operation without a path")?;
        let (parent_path, last) = path.rsplit_once('/').ok_or_else(|| format!("bad path {path}"))?;
        let last = last.replace("~1", "/").replace("~0", "~");
        match op["op"].as_str() {
            Some("test") => {
                if doc.pointer(path) != Some(&op["value"]) {
                    return Err(format!("test failed: {path} is {:?}", doc.pointer(path)));
                }
            }
            Some("replace") => {
                *doc.pointer_mut(path).ok_or_else(|| format!("replace: no {path}"))? = op["value"].clone();
            }
            Some(kind @ ("add" | "remove")) => {
                let parent =
                    doc.pointer_mut(parent_path).ok_or_else(|| format!("{kind}: no {parent_path}"))?;
                match (parent, kind) {
                    (Value::Array(items), "add") if last == "-" => items.push(op["value"].clone()),
                    (Value::Array(items), "add") => {
                        let i: usize = last.parse().map_err(|_| format!("bad index in {path}"))?;
                        items.insert(i, op["value"].clone());
                    }
                    (Value::Array(items), _) => {
                        let i: usize = last.parse().map_err(|_| format!("bad index in {path}"))?;
                        items.remove(i);
                    }
                    (Value::Object(map), "add") => {
                        map.insert(last, op["value"].clone());
                    }
                    (Value::Object(map), _) => {
                        map.remove(&last).ok_or_else(|| format!("remove: no {path}"))?;
                    }
                    _ => return Err(format!("{kind}: {parent_path} is not a container")),
                }
            }
            other => return Err(format!("operation {other:?} is not implemented here")),
        }
    }
    Ok(())
}

/// kustomize's namespace transformer, default mode: namespaced objects move;
/// of RoleBinding subjects, only ServiceAccounts named `default` follow.
fn set_namespace(obj: &mut Value, ns: &str) {
    let kind = obj["kind"].as_str().unwrap_or_default().to_owned();
    if !CLUSTER_SCOPED.contains(&kind.as_str()) {
        obj["metadata"]["namespace"] = json!(ns);
    }
    if kind == "RoleBinding" || kind == "ClusterRoleBinding" {
        for subject in obj["subjects"].as_array_mut().into_iter().flatten() {
            if subject["kind"] == "ServiceAccount" && subject["name"] == "default" {
                subject["namespace"] = json!(ns);
            }
        }
    }
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

// ---------------------------------------------------------------------------
// The cluster.

/// Server-side applies every object, Namespaces and CRDs first, as written,
/// except that a Deployment gets
/// no replicas: its pods are not what these tests look at, and on the test
/// node they would wait for ever (the base's ReadWriteMany claim is for a
/// real cluster's storage) while their CPU requests keep other tests' pods
/// off the node.
async fn apply_all(client: &Client, objects: &[Value]) {
    let objects: Vec<Value> = objects
        .iter()
        .cloned()
        .map(|mut o| {
            if o["kind"] == "Deployment" {
                o["spec"]["replicas"] = json!(0);
            }
            o
        })
        .collect();
    let rank = |o: &Value| match o["kind"].as_str() {
        Some("Namespace") => 0,
        Some("CustomResourceDefinition") => 1,
        _ => 2,
    };
    let mut ordered: Vec<&Value> = objects.iter().collect();
    ordered.sort_by_key(|o| rank(o));
    let params = PatchParams::apply("vmmigrate-deploy-test").force();
    for obj in ordered {
        let api_version = obj["apiVersion"].as_str().expect("apiVersion");
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, obj["kind"].as_str().expect("kind"));
        let (ar, caps) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .unwrap_or_else(|e| panic!("{api_version} {}: {e}", gvk.kind));
        let name = obj["metadata"]["name"].as_str().expect("metadata.name");
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Cluster => Api::all_with(client.clone(), &ar),
            Scope::Namespaced => {
                let ns = obj["metadata"]["namespace"].as_str();
                Api::namespaced_with(
                    client.clone(),
                    ns.unwrap_or_else(|| panic!("{name} has no namespace")),
                    &ar,
                )
            }
        };
        api.patch(name, &params, &Patch::Apply(obj))
            .await
            .unwrap_or_else(|e| panic!("applying {} {name}: {e}", gvk.kind));
    }
}

async fn ensure_namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
    match Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating namespace {name}: {e}"),
    }
}

/// Asks the API server's authorizer whether the ServiceAccount may make `call`.
async fn may(client: &Client, call: Call) -> bool {
    let (verb, group, resource, subresource, namespace) = call;
    let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(SA_USER.into()),
            groups: Some(SA_GROUPS.iter().map(|g| g.to_string()).collect()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource: some(subresource),
                namespace: some(namespace),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("create SubjectAccessReview");
    created.status.is_some_and(|s| s.allowed)
}

/// RBAC is read from an informer cache: a new grant or revocation shows
/// after a moment. Waits until `call` is allowed (or not), up to 20 s.
async fn eventually(client: &Client, call: Call, allowed: bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if may(client, call).await == allowed {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn show(call: Call) -> String {
    let (verb, group, resource, subresource, namespace) = call;
    let resource =
        if subresource.is_empty() { resource.to_owned() } else { format!("{resource}/{subresource}") };
    let group = if group.is_empty() { "core" } else { group };
    let namespace = if namespace.is_empty() { "(cluster)" } else { namespace };
    format!("{verb} {group} {resource} in {namespace}")
}

/// Applies the base (again) and waits until its grants are in effect.
async fn install_base(client: &Client) -> Vec<Value> {
    let objects = kustomize(&deploy_dir("base"));
    apply_all(client, &objects).await;
    // One call per binding: all four are visible to the authorizer.
    for call in [
        ("create", MIGRATIONS, "virtualmachinemigrations", "", ANY),
        ("get", "coordination.k8s.io", "leases", "", SYSTEM),
        ("create", "batch", "jobs", "", SYSTEM),
        ("get", "", "secrets", "", SYSTEM),
    ] {
        assert!(eventually(client, call, true).await, "the base does not allow: {}", show(call));
    }
    objects
}

/// Applies deploy/overlays/example-tenant (the base and the tenant Role in
/// [`TENANT`]) and waits until the Role is in effect.
async fn install_tenant(client: &Client) {
    ensure_namespace(client, TENANT).await;
    let objects = kustomize(&deploy_dir("overlays/example-tenant"));
    assert_eq!(
        objects.len(),
        kustomize(&deploy_dir("base")).len() + 2,
        "the base plus a Role and RoleBinding"
    );
    apply_all(client, &objects).await;
    let call = ("create", "kubevirt.io", "virtualmachines", "", TENANT);
    assert!(eventually(client, call, true).await, "{}", show(call));
}

/// A client that is the ServiceAccount (impersonated by the admin).
async fn service_account_client() -> Client {
    let kubeconfig = Kubeconfig::read_from(KubeEnv::shared().kubeconfig_path()).expect("kubeconfig");
    let mut config =
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig");
    config.auth_info.impersonate = Some(SA_USER.into());
    config.auth_info.impersonate_groups = Some(SA_GROUPS.iter().map(|g| g.to_string()).collect());
    Client::try_from(config).expect("client")
}

// ---------------------------------------------------------------------------
// The manifests themselves.

#[test]
fn base_crd_is_byte_identical_to_the_generated_crd() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated = std::fs::read(root.join(vmmigrate::api::CRD_PATH)).expect("read the generated CRD");
    let copy = std::fs::read(deploy_dir("base/crd.yaml")).expect("read deploy/base/crd.yaml");
    assert!(
        copy == generated,
        "deploy/base/crd.yaml differs from {0}; run `cp {0} deploy/base/crd.yaml`",
        vmmigrate::api::CRD_PATH
    );
}

#[test]
fn deployment_passes_only_flags_and_variables_that_vmmigrate_run_knows() {
    let objects = kustomize(&deploy_dir("base"));
    let cli = vmmigrate::cli::Cli::command();
    let run = cli.find_subcommand("run").expect("`vmmigrate run`");
    let longs: BTreeSet<&str> = run.get_arguments().filter_map(|a| a.get_long()).collect();
    let envs: BTreeSet<String> =
        run.get_arguments().filter_map(|a| a.get_env()).map(|e| e.to_string_lossy().into_owned()).collect();

    let deployment = find(&objects, "Deployment", "vmmigrate");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(args[..3], ["run", "--repo", "$(VMMIGRATE_REPO)"]);
    assert!(args.contains(&"--leader-elect"), "two replicas need leader election: {args:?}");
    for flag in args.iter().filter_map(|a| a.strip_prefix("--")) {
        assert!(longs.contains(flag), "`vmmigrate run` has no --{flag}");
    }

    let config = find(&objects, "ConfigMap", "vmmigrate-config");
    let mut names: Vec<String> = config["data"].as_object().unwrap().keys().cloned().collect();
    names.extend(container["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap().to_owned()));
    for name in names.iter().filter(|n| n.starts_with("VMMIGRATE_") || n.starts_with("POD_")) {
        assert!(envs.contains(name), "`vmmigrate run` reads no {name}");
    }
    assert_eq!(config["data"]["VMMIGRATE_MANIFEST_NAMESPACE"], SYSTEM, "where the base may read Secrets");
    assert_eq!(config["data"]["VMMIGRATE_JOB_NAMESPACE"], SYSTEM, "where the base may create Jobs");
    assert_eq!(config["data"]["VMMIGRATE_JOB_IMAGE"], container["image"], "Jobs run the controller's image");

    for env in container["env"].as_array().unwrap() {
        if let Some(secret) = env["valueFrom"].get("secretKeyRef") {
            assert_eq!(secret["name"], "vmmigrate-git");
            assert_eq!(secret["optional"], true, "{} must not keep the pod from starting", env["name"]);
        }
    }
    let pod_name = container["env"].as_array().unwrap().iter().find(|e| e["name"] == "POD_NAME").unwrap();
    assert_eq!(pod_name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");

    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let tmp = container["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == "/tmp");
    let tmp_volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == tmp.unwrap()["name"]);
    assert!(tmp_volume.unwrap().get("emptyDir").is_some(), "/tmp is an emptyDir");

    for (service, port) in
        [("vmmigrate-staging", 8443), ("vmmigrate-webhooks", 8081), ("vmmigrate-metrics", 9090)]
    {
        let target = &find(&objects, "Service", service)["spec"]["ports"][0];
        let named = container["ports"].as_array().unwrap().iter().find(|p| p["name"] == target["targetPort"]);
        assert_eq!(named.map(|p| &p["containerPort"]), Some(&json!(port)), "{service}");
    }
    assert_eq!(container["livenessProbe"]["httpGet"], json!({"path": "/healthz", "port": "metrics"}));
    assert_eq!(container["readinessProbe"]["httpGet"], json!({"path": "/readyz", "port": "metrics"}));
}

#[test]
fn the_network_policy_admits_the_staging_port_only_from_cdi_importer_pods_and_vmmigrates_fill_jobs() {
    let objects = kustomize(&deploy_dir("base"));
    let policy = find(&objects, "NetworkPolicy", "vmmigrate-controller");
    let deployment = find(&objects, "Deployment", "vmmigrate");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (key, value) in policy["spec"]["podSelector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&pod_labels[key], value, "the policy selects the controller pods ({key})");
    }
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    let admitting = |port: &str| -> Vec<&Value> {
        rules.iter().filter(|r| r["ports"].as_array().unwrap().iter().any(|p| p["port"] == port)).collect()
    };
    let staging = admitting("staging");
    assert_eq!(staging.len(), 1, "one rule admits the staging port");
    assert_eq!(
        staging[0]["from"],
        json!([{
            "namespaceSelector": {},
            "podSelector": { "matchLabels": { "app": "containerized-data-importer", "cdi.kubevirt.io": "importer" } },
        }, {
            "namespaceSelector": {},
            "podSelector": { "matchLabels": {
                "app.kubernetes.io/managed-by": "vmmigrate", "migration.platform.example/role": "fill" } },
        }]),
        "only CDI importer pods and fill Jobs reach the staging port"
    );
    assert_eq!(staging[0]["ports"].as_array().unwrap().len(), 1, "the importer rule opens nothing else");
    for open in ["webhooks", "metrics"] {
        let rule = admitting(open);
        assert!(rule.len() == 1 && rule[0].get("from").is_none(), "{open} is reachable from anywhere");
    }
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let named: Vec<&Value> = container["ports"].as_array().unwrap().iter().map(|p| &p["name"]).collect();
    for port in ["staging", "webhooks", "metrics"] {
        assert!(named.contains(&&json!(port)), "the container names its port {port}");
    }
}

#[test]
fn no_cluster_role_names_secrets_or_wildcards() {
    for dir in ["base", "overlays/gitops-coexistence", "overlays/example-tenant"] {
        for obj in kustomize(&deploy_dir(dir)) {
            if obj["kind"] != "ClusterRole" && obj["kind"] != "Role" {
                continue;
            }
            for rule in obj["rules"].as_array().unwrap() {
                let words: Vec<&str> = ["apiGroups", "resources", "verbs"]
                    .iter()
                    .flat_map(|k| rule[*k].as_array().unwrap().iter().filter_map(Value::as_str))
                    .collect();
                assert!(!words.contains(&"*"), "{dir}: wildcard in {}", obj["metadata"]["name"]);
                if obj["kind"] == "ClusterRole" {
                    assert!(!words.contains(&"secrets"), "{dir}: ClusterRole {}", obj["metadata"]["name"]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Against the API server.

#[tokio::test]
async fn base_applies_and_leaves_the_installed_crd_unchanged() {
    let client = KubeEnv::shared().client().await;
    let _shared = CLUSTER_RBAC.read().await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = "virtualmachinemigrations.migration.platform.example";
    let before = crds.get(name).await.expect("the test env installs the CRD");
    let objects = install_base(&client).await;
    let after = crds.get(name).await.expect("CRD");
    assert_eq!(after.metadata.generation, before.metadata.generation, "the CRD's spec changed");
    assert_eq!(serde_json::to_value(&after.spec).unwrap(), serde_json::to_value(&before.spec).unwrap());

    // Everything the kustomization lists is there, as written.
    let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in [
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(kinds.contains(kind), "the base has no {kind}");
    }
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), SYSTEM);
    deployments.get("vmmigrate").await.expect("Deployment");
    let written = objects.iter().find(|o| o["kind"] == "Deployment").expect("the base's Deployment");
    assert_eq!(written["spec"]["replicas"], 2, "two replicas, one leader");
}

#[tokio::test]
async fn service_account_may_make_each_call_on_the_hand_kept_list_of_the_controllers_calls() {
    let client = KubeEnv::shared().client().await;
    let _shared = CLUSTER_RBAC.read().await;
    install_base(&client).await;
    let mut refused = Vec::new();
    for &call in CALLS {
        if !eventually(&client, call, true).await {
            refused.push(show(call));
        }
    }
    assert!(refused.is_empty(), "the ServiceAccount may not:\n  {}", refused.join("\n  "));
}

#[tokio::test]
async fn service_account_cannot_read_other_secrets_delete_migrations_or_escalate() {
    let client = KubeEnv::shared().client().await;
    let _shared = CLUSTER_RBAC.read().await;
    install_base(&client).await;
    let mut allowed = Vec::new();
    for &call in FORBIDDEN {
        if may(&client, call).await {
            allowed.push(show(call));
        }
    }
    assert!(allowed.is_empty(), "the ServiceAccount may:\n  {}", allowed.join("\n  "));
}

#[tokio::test]
async fn the_example_tenant_overlay_grants_the_tenant_role_in_its_namespace_only() {
    let (client, _shared, _sa) = tenant_installed().await;
    let mut refused = Vec::new();
    for &call in TENANT_CALLS {
        if !eventually(&client, call, true).await {
            refused.push(show(call));
        }
    }
    assert!(
        refused.is_empty(),
        "in the tenant namespace the ServiceAccount may not:\n  {}",
        refused.join("\n  ")
    );
    for call in [
        ("list", "", "secrets", "", TENANT),
        ("watch", "", "secrets", "", TENANT),
        ("get", "", "secrets", "", ANY),
        ("create", "kubevirt.io", "virtualmachines", "", ANY),
    ] {
        assert!(!may(&client, call).await, "the ServiceAccount may {}", show(call));
    }
}

#[tokio::test]
async fn gitops_coexistence_overlay_passes_no_apply_and_cannot_create_migrations() {
    let client = KubeEnv::shared().client().await;
    let _exclusive = CLUSTER_RBAC.write().await;
    install_base(&client).await;
    let objects = kustomize(&deploy_dir("overlays/gitops-coexistence"));
    let args =
        &find(&objects, "Deployment", "vmmigrate")["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(args[args.as_array().unwrap().len() - 1], "--no-apply");
    let base = kustomize(&deploy_dir("base"));
    let base_args =
        &find(&base, "Deployment", "vmmigrate")["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(
        args.as_array().unwrap()[..base_args.as_array().unwrap().len()],
        base_args.as_array().unwrap()[..]
    );

    apply_all(&client, &objects).await;
    let create = ("create", MIGRATIONS, "virtualmachinemigrations", "", ANY);
    let denied = eventually(&client, create, false).await;
    // The controller's own calls on migrations stay allowed.
    let mut refused = Vec::new();
    for &call in CALLS.iter().filter(|c| c.1 == MIGRATIONS && c.0 != "create") {
        if !may(&client, call).await {
            refused.push(show(call));
        }
    }
    install_base(&client).await; // restore before anyone else looks
    assert!(denied, "gitops-coexistence still allows {}", show(create));
    assert!(refused.is_empty(), "gitops-coexistence refuses:\n  {}", refused.join("\n  "));
}

/// Why the overlay's trade-off is documented: a pull-request plan diffs a
/// manifest through a server-side dry run, and a dry run that would create
/// the object is authorized as a create.
#[tokio::test]
async fn in_gitops_coexistence_a_dry_run_apply_of_a_new_migration_is_forbidden() {
    let admin = KubeEnv::shared().client().await;
    let _exclusive = CLUSTER_RBAC.write().await;
    install_base(&admin).await;
    let existing = "deploy-rbac-existing";
    let migration = |name: &str| {
        json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": {"name": name, "namespace": SYSTEM},
            "spec": {
                "source": {
                    "host": "esxi01.example.internal",
                    "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                    "credentialsSecretRef": {"name": "esxi01-credentials"},
                    "vm": {"name": "web-01"}
                },
                "destination": {"namespace": "apps", "storageClassName": "standard"}
            }
        })
    };
    let ar = kube::discovery::ApiResource::erase::<vmmigrate::api::VirtualMachineMigration>(&());
    let admin_api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), SYSTEM, &ar);
    admin_api
        .patch(
            existing,
            &PatchParams::apply("vmmigrate-deploy-test").force(),
            &Patch::Apply(migration(existing)),
        )
        .await
        .expect("create the existing migration");

    let sa: Api<DynamicObject> = Api::namespaced_with(service_account_client().await, SYSTEM, &ar);
    let dry = PatchParams::apply("vmmigrate-gitops").force().dry_run();
    let new = "deploy-rbac-new";
    sa.patch(new, &dry, &Patch::Apply(migration(new))).await.expect("base: a dry run of a new migration");

    apply_all(&admin, &kustomize(&deploy_dir("overlays/gitops-coexistence"))).await;
    let create = ("create", MIGRATIONS, "virtualmachinemigrations", "", SYSTEM);
    let revoked = eventually(&admin, create, false).await;
    let new_result = sa.patch(new, &dry, &Patch::Apply(migration(new))).await;
    let existing_result = sa.patch(existing, &dry, &Patch::Apply(migration(existing))).await;
    install_base(&admin).await; // restore before anyone else looks
    assert!(revoked, "gitops-coexistence still allows {}", show(create));
    match new_result {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("a dry run of a new migration without `create`: {other:?}"),
    }
    existing_result.expect("a dry run of an existing migration needs only `patch`");
}

#[tokio::test]
async fn under_the_shipped_rbac_a_rehearsal_whose_manifest_left_git_is_kept_marked_and_the_apply_goes_on() {
    use vmmigrate::gitops::apply::apply_commit;
    use vmmigrate::gitops::render::{RenderOptions, render};
    use vmmigrate::gitops::{Provenance, RepoFile};
    let client = KubeEnv::shared().client().await;
    let _shared = CLUSTER_RBAC.read().await;
    install_base(&client).await;
    let ns = crate::support::test_namespace(&client, "rbac-rehearsal").await;
    let sa = service_account_client().await;
    let manifest = |name: &str, mode: &str| {
        format!(
            "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  mode: {mode}\n  source:\n    host: esxi01.example.internal\n    hostKey: SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s\n    credentialsSecretRef:\n      name: esxi01\n    vm:\n      name: {name}\n  destination:\n    namespace: {ns}\n    storageClassName: standard\n"
        )
    };
    const REPO: &str = "https://git.example/m.git";
    let commit = |files: &[(&str, String)]| {
        let files: Vec<RepoFile> = files
            .iter()
            .map(|(p, t)| RepoFile { path: (*p).into(), bytes: t.clone().into_bytes() })
            .collect();
        render(
            &files,
            &Provenance { repo_url: REPO.into(), commit: "ab".repeat(20) },
            &RenderOptions::default(),
        )
        .expect("renders")
    };
    let namespaces = std::slice::from_ref(&ns);
    let both = commit(&[
        ("migrations/trial.yaml", manifest("trial", "Rehearsal")),
        ("migrations/web.yaml", manifest("web", "Cold")),
    ]);
    apply_commit(&sa, &both, namespaces, REPO).await.expect("the ServiceAccount applies");
    // The rehearsal's manifest leaves Git while another manifest changes.
    let next = commit(&[(
        "migrations/web.yaml",
        manifest("web", "Cold").replace("storageClassName: standard", "storageClassName: fast"),
    )]);
    let report = apply_commit(&sa, &next, namespaces, REPO).await.expect("a 403 on the delete stops nothing");
    assert_eq!(report.undeletable, vec![(ns.clone(), "trial".to_owned())]);
    assert!(report.orphaned.contains(&(ns.clone(), "trial".to_owned())), "{report:?}");
    let api: Api<vmmigrate::api::VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let trial = api.get("trial").await.expect("kept");
    assert_eq!(
        trial
            .metadata
            .annotations
            .unwrap_or_default()
            .get("migration.platform.example/orphaned")
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(api.get("web").await.unwrap().spec.destination.storage_class_name, "fast", "the rest applied");
}

// ---------------------------------------------------------------------------
// What the ServiceAccount may write where RBAC lets it write:
// deploy/base/admission-policies.yaml and Pod Security `restricted`.

/// `obj` created as the ServiceAccount in a dry run (admission runs, nothing
/// is stored): `Err` is the API server's refusal.
async fn dry_run_create(client: &Client, obj: &Value) -> Result<(), String> {
    let api_version = obj["apiVersion"].as_str().expect("apiVersion");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, obj["kind"].as_str().expect("kind"));
    let (ar, _) = kube::discovery::pinned_kind(client, &gvk).await.expect("discovery");
    let ns = obj["metadata"]["namespace"].as_str().expect("namespace");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let obj: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    let params = PostParams { dry_run: true, ..Default::default() };
    api.create(&params, &obj).await.map(|_| ()).map_err(|e| e.to_string())
}

/// The base and deploy/overlays/example-tenant installed, the shared RBAC
/// held for reading: the administrator's client, the guard, and a client
/// that is the ServiceAccount.
async fn tenant_installed() -> (Client, tokio::sync::RwLockReadGuard<'static, ()>, Client) {
    let client = KubeEnv::shared().client().await;
    let shared = CLUSTER_RBAC.read().await;
    install_base(&client).await;
    install_tenant(&client).await;
    (client, shared, service_account_client().await)
}

/// Admission policies are read from an informer: waits (up to 20 s) until
/// creating `obj` is refused, and requires `policy` to be what refused it.
async fn refused_once_in_effect(sa: &Client, obj: &Value, policy: &str, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match dry_run_create(sa, obj).await {
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            answer => return refused_by(answer, policy, what),
        }
    }
}

fn refused_by(answer: Result<(), String>, policy: &str, what: &str) {
    match answer {
        Err(e) => assert!(e.contains(policy), "{what}: refused, but not by {policy}: {e}"),
        Ok(()) => panic!("{what}: admitted"),
    }
}

fn vm(name: &str, volumes: Value) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": { "name": name, "namespace": TENANT },
        "spec": {
            "runStrategy": "Halted",
            "template": { "spec": {
                "domain": { "devices": {}, "memory": { "guest": "1Gi" } },
                "volumes": volumes,
            } },
        },
    })
}

#[tokio::test]
async fn as_the_service_account_a_vm_that_mounts_anything_but_its_own_data_volumes_is_refused_at_admission() {
    let (client, _shared, sa) = tenant_installed().await;
    const POLICY: &str = "vmmigrate-vm-volumes";
    let secret = vm("web", json!([{ "name": "token", "secret": { "secretName": "payroll-db" } }]));
    refused_once_in_effect(&sa, &secret, POLICY, "a VM mounting a Secret").await;
    let token = vm("web", json!([{ "name": "sa", "serviceAccount": { "serviceAccountName": "default" } }]));
    refused_by(dry_run_create(&sa, &token).await, POLICY, "a VM mounting a ServiceAccount token");
    let other = vm("web", json!([{ "name": "disk-0", "dataVolume": { "name": "payroll-disk-0" } }]));
    refused_by(dry_run_create(&sa, &other).await, POLICY, "a VM mounting another VM's disk");
    let claim =
        vm("web", json!([{ "name": "disk-0", "persistentVolumeClaim": { "claimName": "web-disk-0" } }]));
    refused_by(dry_run_create(&sa, &claim).await, POLICY, "a VM mounting a claim directly");
    let mut template = vm("web", json!([{ "name": "disk-0", "dataVolume": { "name": "web-disk-0" } }]));
    template["spec"]["dataVolumeTemplates"] = json!([{
        "metadata": { "name": "web-disk-0" },
        "spec": { "source": { "pvc": { "namespace": "kube-system", "name": "etcd" } },
                  "storage": { "resources": { "requests": { "storage": "1Gi" } } } },
    }]);
    refused_by(dry_run_create(&sa, &template).await, POLICY, "a VM with a DataVolume template");

    // What vmmigrate writes passes; an administrator is not bound by the policy.
    let own = vm(
        "web",
        json!([{ "name": "disk-0", "dataVolume": { "name": "web-disk-0" } },
               { "name": "disk-1", "dataVolume": { "name": "web-disk-1" } }]),
    );
    dry_run_create(&sa, &own).await.expect("a VM of its own DataVolumes");
    dry_run_create(&client, &secret).await.expect("the administrator's VM");
}

#[tokio::test]
async fn as_the_service_account_only_a_migrations_own_import_secrets_and_cas_can_be_written() {
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use kube::api::DeleteParams;
    let (client, _shared, sa) = tenant_installed().await;
    const POLICY: &str = "vmmigrate-own-secrets";
    const UID: &str = "migration.platform.example/migration-uid";
    let secret = |name: &str, labelled: bool| {
        let labels = if labelled { json!({ UID: "0b5c7d1e" }) } else { json!({}) };
        json!({ "apiVersion": "v1", "kind": "Secret",
                "metadata": { "name": name, "namespace": TENANT, "labels": labels },
                "stringData": { "secretKey": "x" } })
    };
    refused_once_in_effect(&sa, &secret("payroll-db", true), POLICY, "a Secret named payroll-db").await;
    refused_by(
        dry_run_create(&sa, &secret("web-disk-0-import", false)).await,
        POLICY,
        "an import Secret without its migration's uid",
    );
    dry_run_create(&sa, &secret("web-disk-0-import", true)).await.expect("an import Secret");
    dry_run_create(&sa, &secret("web-vmm-worker", true)).await.expect("a worker's identity");
    let ca = |name: &str| {
        json!({ "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": { "name": name, "namespace": TENANT, "labels": { UID: "0b5c7d1e" } },
                "data": { "ca.crt": "x" } })
    };
    dry_run_create(&sa, &ca("web-disk-0-import-ca")).await.expect("an import CA");
    refused_by(dry_run_create(&sa, &ca("app-settings")).await, POLICY, "a ConfigMap named app-settings");

    // A tenant's own Secret whose name looks like an import Secret: the
    // ServiceAccount may neither label it as its own nor delete it.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), TENANT);
    let theirs: Secret = serde_json::from_value(secret("legacy-disk-0-import", false)).unwrap();
    match secrets.create(&PostParams::default(), &theirs).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("the tenant's Secret: {e}"),
    }
    let as_sa: Api<Secret> = Api::namespaced(sa.clone(), TENANT);
    let dry = PatchParams { dry_run: true, ..Default::default() };
    let adopt = as_sa
        .patch(
            "legacy-disk-0-import",
            &dry,
            &Patch::Merge(json!({ "metadata": { "labels": { UID: "0b5c7d1e" } } })),
        )
        .await;
    refused_by(adopt.map(|_| ()).map_err(|e| e.to_string()), POLICY, "labelling a tenant's Secret");
    let delete =
        as_sa.delete("legacy-disk-0-import", &DeleteParams { dry_run: true, ..Default::default() }).await;
    refused_by(delete.map(|_| ()).map_err(|e| e.to_string()), POLICY, "deleting a tenant's Secret");
    // Nor the namespace's CA bundle.
    let maps: Api<ConfigMap> = Api::namespaced(sa.clone(), TENANT);
    let root_ca =
        maps.patch("kube-root-ca.crt", &dry, &Patch::Merge(json!({ "data": { "ca.crt": "x" } }))).await;
    refused_by(root_ca.map(|_| ()).map_err(|e| e.to_string()), POLICY, "changing kube-root-ca.crt");
}

fn job(name: &str, ns: &str, pod: Value) -> Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "backoffLimit": 0, "template": { "spec": pod } },
    })
}

/// A pod as vmmigrate writes its helper Jobs' (convert/job.rs, worker/plane.rs,
/// destination/verify.rs): Pod Security `restricted`.
fn restricted_pod() -> Value {
    json!({
        "restartPolicy": "Never",
        "securityContext": { "runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": true,
                             "seccompProfile": { "type": "RuntimeDefault" } },
        "containers": [{
            "name": "convert",
            "image": "vmmigrate:test",
            "securityContext": { "allowPrivilegeEscalation": false, "capabilities": { "drop": ["ALL"] } },
            "volumeMounts": [{ "name": "work", "mountPath": "/var/lib/vmmigrate" }],
        }],
        "volumes": [{ "name": "work", "emptyDir": {} }],
    })
}

#[tokio::test]
async fn as_the_service_account_a_privileged_or_host_mounting_job_is_refused_in_every_namespace() {
    let (_admin, _shared, sa) = tenant_installed().await;
    const POLICY: &str = "vmmigrate-helper-jobs";
    let mut privileged = restricted_pod();
    privileged["containers"][0]["securityContext"] = json!({ "privileged": true });
    let mut host_path = restricted_pod();
    host_path["volumes"] = json!([{ "name": "work", "hostPath": { "path": "/" } }]);
    let mut root = restricted_pod();
    root["securityContext"] = json!({ "runAsUser": 0 });
    let mut capability = restricted_pod();
    capability["containers"][0]["securityContext"]["capabilities"]["add"] = json!(["SYS_ADMIN"]);
    let mut host_network = restricted_pod();
    host_network["hostNetwork"] = json!(true);
    let mut token = restricted_pod();
    token["volumes"] =
        json!([{ "name": "work", "projected": { "sources": [{ "serviceAccountToken": { "path": "t" } }] } }]);
    for ns in [TENANT, SYSTEM] {
        for (what, pod) in [
            ("privileged", &privileged),
            ("a host path", &host_path),
            ("root", &root),
            ("an added capability", &capability),
            ("the host's network", &host_network),
            ("a projected token", &token),
        ] {
            let what = format!("{what} in {ns}");
            refused_once_in_effect(&sa, &job("convert", ns, pod.clone()), POLICY, &what).await;
        }
        dry_run_create(&sa, &job("convert", ns, restricted_pod()))
            .await
            .expect("a helper Job as vmmigrate writes it");
    }
}

#[tokio::test]
async fn a_pod_in_vmmigrate_system_that_is_not_pod_security_restricted_is_refused_whoever_creates_it() {
    let client = KubeEnv::shared().client().await;
    let _shared = CLUSTER_RBAC.read().await;
    install_base(&client).await;
    let pod = |spec: Value| json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "probe", "namespace": SYSTEM }, "spec": spec });
    // Baseline would admit this one; `restricted` wants a non-root user, no
    // escalation, no capabilities and a seccomp profile.
    let baseline = json!({ "containers": [{ "name": "c", "image": "vmmigrate:test" }] });
    let answer = dry_run_create(&client, &pod(baseline)).await;
    match answer {
        Err(e) => assert!(e.contains("restricted"), "refused, but not by Pod Security: {e}"),
        Ok(()) => panic!("a pod that is only baseline is admitted in {SYSTEM}"),
    }
    dry_run_create(&client, &pod(restricted_pod())).await.expect("a restricted pod");
}

#[tokio::test]
async fn at_validated_the_service_account_finds_a_destination_namespace_without_the_tenant_role_refused() {
    use vmmigrate::destination::cluster::KubeCluster;
    use vmmigrate::ports::Cluster;
    let (client, _shared, sa) = tenant_installed().await;
    crate::support::ensure_storage_class(&client).await;
    let bare = crate::support::test_namespace(&client, "no-tenant-role").await;
    // The migration in the tenant's namespace, as discovery leaves it.
    let migration = |destination: &str, uuid: &str| {
        let mut body = crate::support::sim_migration_json(TENANT);
        body["metadata"]["name"] = json!(format!("to-{destination}"));
        body["metadata"]["uid"] = json!(format!("uid-{uuid}"));
        body["spec"]["destination"]["namespace"] = json!(destination);
        let mut vmm: vmmigrate::api::VirtualMachineMigration =
            serde_json::from_value(body).expect("migration");
        vmm.status = Some(vmmigrate::api::VirtualMachineMigrationStatus {
            source_inventory: Some(vmmigrate::api::SourceInventory {
                vmid: "7".into(),
                bios_uuid: uuid.into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        vmm
    };
    let cluster = KubeCluster::new(sa.clone(), SYSTEM);
    let away = migration(&bare, &format!("4211-{bare}"));
    let facts = cluster.preflight(&away).await.expect("the ServiceAccount's pre-flight");
    cluster.release_source(&away).await.expect("release");
    let refused = facts.destination_refused.expect("a namespace without the tenant Role is refused");
    for part in ["datavolumes", "virtualmachines", "secrets", &bare, "tenant Role"] {
        assert!(refused.contains(part), "{refused:?} does not say {part:?}");
    }
    let home = migration(TENANT, &format!("4212-{bare}"));
    let facts = cluster.preflight(&home).await.expect("the ServiceAccount's pre-flight");
    cluster.release_source(&home).await.expect("release");
    assert_eq!(facts.destination_refused, None, "the tenant's namespace is granted");
}
