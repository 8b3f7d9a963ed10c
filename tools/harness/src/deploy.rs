//! Installs vmmigrate on the test cluster the way a user does: an overlay
//! of `deploy/base` applied with `kubectl apply -k`, nothing else. The
//! overlay is what someone running a one-node cluster writes: the image
//! they imported, a ReadWriteOnce claim of the node's provisioner, their
//! repository, and smaller CPU requests (the node has two cores); plus, per
//! extra namespace holding migrations or their VMs, the tenant Role of
//! `deploy/overlays/example-tenant`. The test cluster runs no cluster DNS,
//! so CDI's importer pods reach the staging server by its Service's
//! address: the overlay pins the Service to [`STAGING_CLUSTER_IP`] and
//! names that address in `VMMIGRATE_STAGING_URL` (the staging certificate
//! is made for it).

use crate::KubeEnv;
use std::path::Path;

/// vmmigrate's namespace in `deploy/base`.
pub const SYSTEM: &str = "vmmigrate-system";

/// The staging Service's address in the test cluster's Service range
/// (`10.96.0.0/16`), fixed so that the staging URL can name it.
pub const STAGING_CLUSTER_IP: &str = "10.96.0.80";

pub struct Install<'a> {
    /// The release image as containerd names it.
    pub image: &'a str,
    /// `VMMIGRATE_REPO`.
    pub repo_url: &'a str,
    /// `VMMIGRATE_NAMESPACE`: the only namespace the controller watches
    /// (`None`: all of them, the base's default).
    pub watch_namespace: Option<&'a str>,
    /// Namespaces besides vmmigrate-system that hold migrations (their ESXi
    /// Secrets) or their VMs (the import Secrets and CAs): the Role of
    /// deploy/overlays/example-tenant in each.
    pub credential_namespaces: &'a [&'a str],
    /// Extra `VMMIGRATE_*` settings for the ConfigMap.
    pub settings: &'a [(&'a str, &'a str)],
}

/// Writes the overlay into `dir` and applies it.
pub fn install(env: &KubeEnv, dir: &Path, install: &Install<'_>) -> anyhow::Result<()> {
    let (name, tag) = install.image.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("image without a tag"))?;
    // kustomize takes bases by relative path only.
    let base = crate::repo_root().join("deploy/base").canonicalize()?;
    let here = dir.canonicalize()?;
    let up = "../".repeat(here.components().count() - 1);
    let base = format!("{up}{}", base.strip_prefix("/")?.display());
    let mut resources = vec![base];
    let tenant =
        std::fs::read_to_string(crate::repo_root().join("deploy/overlays/example-tenant/tenant.yaml"))?;
    for ns in install.credential_namespaces {
        let file = format!("tenant-{ns}.yaml");
        std::fs::write(
            dir.join(&file),
            tenant.replace("  namespace: vmmigrate\n", &format!("  namespace: {ns}\n")),
        )?;
        resources.push(file);
    }
    let mut settings: Vec<(String, String)> = vec![
        ("VMMIGRATE_REPO".into(), install.repo_url.into()),
        ("VMMIGRATE_STAGING_URL".into(), format!("https://{STAGING_CLUSTER_IP}:8443")),
    ];
    if let Some(ns) = install.watch_namespace {
        settings.push(("VMMIGRATE_NAMESPACE".into(), ns.into()));
    }
    settings.extend(install.settings.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let config: String = settings
        .iter()
        .map(|(k, v)| format!("      - {{op: add, path: /data/{k}, value: {}}}\n", serde_json::json!(v)))
        .collect();
    let resources: String = resources.iter().map(|r| format!("  - {r}\n")).collect();
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
{resources}images:
  - name: {name}
    newTag: "{tag}"
patches:
  - target: {{kind: PersistentVolumeClaim, name: vmmigrate-work}}
    patch: |-
      - {{op: replace, path: /spec/accessModes, value: [ReadWriteOnce]}}
      - {{op: replace, path: /spec/resources/requests/storage, value: 10Gi}}
      - {{op: add, path: /spec/storageClassName, value: local-path}}
  - target: {{kind: Deployment, name: vmmigrate}}
    patch: |-
      - {{op: replace, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}}
      - {{op: replace, path: /spec/template/spec/containers/0/resources/requests/cpu, value: 100m}}
  - target: {{kind: Service, name: vmmigrate-staging}}
    patch: |-
      - {{op: add, path: /spec/clusterIP, value: {STAGING_CLUSTER_IP}}}
  - target: {{kind: ConfigMap, name: vmmigrate-config}}
    patch: |-
{config}"#
        ),
    )?;
    env.kubectl(&["apply", "-k", &dir.to_string_lossy()])?;
    Ok(())
}

/// Deletes the Deployment, the work claim (a claim's access modes cannot
/// change, so an install over the base's ReadWriteMany claim needs this
/// first) and the staging Service, and waits until they are gone. The CRD
/// and RBAC stay.
pub fn remove_workloads(env: &KubeEnv) -> anyhow::Result<()> {
    if env.kubectl(&["get", "namespace", SYSTEM]).is_err() {
        return Ok(());
    }
    env.kubectl(&[
        "-n",
        SYSTEM,
        "delete",
        "deployment/vmmigrate",
        "--ignore-not-found",
        "--wait=true",
        "--timeout=120s",
    ])?;
    // Conversion Jobs and any pod still holding the work claim (a test that
    // failed midway leaves some): the claim is not released before they go.
    env.kubectl(&[
        "-n",
        SYSTEM,
        "delete",
        "jobs",
        "--all",
        "--ignore-not-found",
        "--wait=true",
        "--timeout=60s",
    ])?;
    env.kubectl(&[
        "-n",
        SYSTEM,
        "delete",
        "pods",
        "-l",
        "app.kubernetes.io/name=vmmigrate",
        "--ignore-not-found",
        "--grace-period=0",
        "--force",
    ])?;
    // The base as written gives the staging Service an address of the
    // cluster's choosing (tests/deploy_rbac.rs applies it so); the overlay
    // pins it, and a Service's address cannot change once set.
    env.kubectl(&["-n", SYSTEM, "delete", "service/vmmigrate-staging", "--ignore-not-found", "--wait=true"])?;
    env.kubectl(&[
        "-n",
        SYSTEM,
        "delete",
        "pvc/vmmigrate-work",
        "--ignore-not-found",
        "--wait=true",
        "--timeout=120s",
    ])?;
    Ok(())
}

/// Waits until a controller pod is Ready (the leader; a standby is too).
pub fn wait_ready(env: &KubeEnv) -> anyhow::Result<()> {
    crate::process::wait_until(std::time::Duration::from_secs(180), "a Ready vmmigrate pod", || {
        let out = env.kubectl(&[
            "-n",
            SYSTEM,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/component=controller",
            "-o",
            r#"jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}"#,
        ])?;
        Ok(out.split_whitespace().any(|s| s == "True"))
    })
}
