//! The `job` conversion runner's Kubernetes Job: one `batch/v1` Job per disk
//! running `vmmigrate convert` from the controller image on the shared work
//! volume. Pure rendering; `store` creates, reads and deletes the Jobs.
//!
//! The name is deterministic (`<migration>-convert-<n>`, shortened with a
//! hash when the migration name is long), so a restarted controller finds the
//! Job it created instead of starting a second one. `backoffLimit: 0`: the
//! controller's own retry budget decides about retries, not the Job controller.

use crate::api::VirtualMachineMigration;
use crate::objects::pods::{container_security_context, pod_security_context};
use crate::objects::{LABEL_ROLE, bounded_name, labels, owner_references};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

pub(crate) use crate::api::labels::DISK as LABEL_DISK;

/// How conversion Jobs are run.
#[derive(Clone, Debug)]
pub(crate) struct JobSettings {
    /// Namespace of the Jobs; `None`: the migration's own namespace (then the
    /// Job is owned by the migration). The work volume must exist there.
    pub namespace: Option<String>,
    /// The controller image (it contains `vmmigrate`, qemu-img and virt-v2v when installed).
    pub image: String,
    /// PersistentVolumeClaim holding the work directory; `None`: an
    /// `emptyDir` (only useful on single-node clusters and in tests).
    pub work_claim: Option<String>,
    /// Where the work directory is mounted, the same path as in the controller.
    pub work_dir: PathBuf,
    pub service_account: Option<String>,
    /// The uid and gid the Job runs as: the controller's own, so that files
    /// either writes on the shared work volume are the other's to read and
    /// replace (65532 from the release image; whoever runs an out-of-cluster
    /// controller otherwise). `None`: the image's user.
    pub run_as: Option<(u32, u32)>,
}

/// Everything one conversion needs, as paths on the work volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JobInput {
    pub input: PathBuf,
    pub input_sha256: String,
    pub input_marker: PathBuf,
    pub expected_size: u64,
    pub output: PathBuf,
    pub format: String,
}

/// The Job's name: `<migration>-convert-<n>`, at most 63 characters.
pub(crate) fn job_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    bounded_name(&vmm.metadata.name.clone().unwrap_or_default(), &format!("-convert-{disk}"))
}

/// The namespace the Job runs in.
pub(crate) fn job_namespace(settings: &JobSettings, vmm: &VirtualMachineMigration) -> String {
    settings.namespace.clone().unwrap_or_else(|| vmm.metadata.namespace.clone().unwrap_or_default())
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The `vmmigrate convert` argument list (after the command name).
pub(crate) fn convert_args(input: &JobInput) -> Vec<String> {
    vec![
        "convert".to_owned(),
        "--input".to_owned(),
        path_arg(&input.input),
        "--input-sha256".to_owned(),
        input.input_sha256.clone(),
        "--input-marker".to_owned(),
        path_arg(&input.input_marker),
        "--expected-size".to_owned(),
        input.expected_size.to_string(),
        "--output".to_owned(),
        path_arg(&input.output),
        "--format".to_owned(),
        input.format.clone(),
    ]
}

/// What of the work volume the Job sees: its migration's copy folder, read
/// only, and its artifact folder, each at the path the controller has it
/// (`subPath` mounts); not the other migrations' files, not the staging
/// server's keys. The image `vmmigrate convert` parses comes from a host
/// someone else administers. A path outside the work directory (never made
/// by the store) mounts the whole volume, as before.
fn work_mounts(work_dir: &Path, input: &JobInput) -> Value {
    let folder = |file: &Path| -> Option<(String, String)> {
        let dir = file.parent()?;
        let sub = dir.strip_prefix(work_dir).ok()?;
        let plain = sub.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        (plain && !sub.as_os_str().is_empty()).then(|| (path_arg(dir), path_arg(sub)))
    };
    match (folder(&input.input), folder(&input.output)) {
        (Some((copies, copies_sub)), Some((artifacts, artifacts_sub)))
            if folder(&input.input_marker).is_some_and(|(dir, _)| dir == copies) =>
        {
            json!([
                { "name": "work", "mountPath": copies, "subPath": copies_sub, "readOnly": true },
                { "name": "work", "mountPath": artifacts, "subPath": artifacts_sub },
            ])
        }
        _ => json!([{ "name": "work", "mountPath": path_arg(work_dir) }]),
    }
}

/// The Job converting disk `disk`.
pub(crate) fn conversion_job(
    settings: &JobSettings,
    vmm: &VirtualMachineMigration,
    disk: usize,
    input: &JobInput,
) -> Value {
    let namespace = job_namespace(settings, vmm);
    let mut labels = labels(vmm);
    labels.insert(LABEL_ROLE.into(), json!("convert"));
    labels.insert(LABEL_DISK.into(), json!(disk.to_string()));
    let owners = owner_references(vmm, &namespace);
    let volume = match &settings.work_claim {
        Some(claim) => json!({ "name": "work", "persistentVolumeClaim": { "claimName": claim } }),
        None => json!({ "name": "work", "emptyDir": {} }),
    };
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "containers": [{
            "name": "convert",
            "image": settings.image,
            "command": ["vmmigrate"],
            "args": convert_args(input),
            // The controller reads why a conversion failed from here.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": {
                "requests": { "cpu": "500m", "memory": "256Mi" },
                "limits": { "memory": "1Gi" },
            },
            "securityContext": container_security_context(false),
            "volumeMounts": work_mounts(&settings.work_dir, input),
        }],
        "volumes": [volume],
    });
    if let Some(sa) = &settings.service_account {
        pod_spec["serviceAccountName"] = json!(sa);
    }
    pod_spec["securityContext"] = pod_security_context(settings.run_as);
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(vmm, disk),
            "namespace": namespace,
            "labels": labels.clone(),
            "ownerReferences": owners,
        },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": { "labels": labels },
                "spec": pod_spec,
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm(name: &str) -> VirtualMachineMigration {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": { "name": name, "namespace": "apps", "uid": "u-1" },
            "spec": {
                "source": { "host": "esxi", "hostKey": format!("SHA256:{}", "A".repeat(43)),
                            "credentialsSecretRef": { "name": "s" }, "vm": { "name": "web" } },
                "destination": { "namespace": "apps", "storageClassName": "fast" },
            },
        }))
        .unwrap();
        vmm.metadata.uid = Some("u-1".into());
        vmm
    }

    fn input() -> JobInput {
        JobInput {
            input: "/work/copies/apps/web/u-1/disk-0.raw".into(),
            input_sha256: "ab".repeat(32),
            input_marker: "/work/copies/apps/web/u-1/disk-0.sha256".into(),
            expected_size: 1 << 30,
            output: "/work/artifacts/u-1/disk-0.qcow2".into(),
            format: "qcow2".into(),
        }
    }

    fn settings(namespace: Option<&str>) -> JobSettings {
        JobSettings {
            namespace: namespace.map(str::to_owned),
            image: "vmmigrate:dev".into(),
            work_claim: Some("vmmigrate-work".into()),
            work_dir: "/work".into(),
            service_account: None,
            run_as: Some((65532, 65532)),
        }
    }

    #[test]
    fn job_names_are_deterministic_and_fit_kubernetes_limits() {
        assert_eq!(job_name(&vmm("web"), 1), "web-convert-1");
        let long = "a".repeat(70);
        let name = job_name(&vmm(&long), 12);
        assert!(name.len() <= 63, "{name}");
        assert_eq!(name, job_name(&vmm(&long), 12));
        assert_ne!(name, job_name(&vmm(&format!("{long}b")), 12), "different migrations, different Jobs");
    }

    #[test]
    fn job_runs_vmmigrate_convert_on_the_work_volume_without_retries_of_its_own() {
        let job = conversion_job(&settings(None), &vmm("web"), 0, &input());
        assert_eq!(job["spec"]["backoffLimit"], 0);
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(container["command"], json!(["vmmigrate"]));
        assert_eq!(container["args"][0], "convert");
    }

    #[test]
    fn the_job_sees_only_its_migrations_copy_read_only_and_its_artifact_folder() {
        let job = conversion_job(&settings(None), &vmm("web"), 0, &input());
        let mounts = &job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"];
        assert_eq!(
            mounts,
            &json!([
                { "name": "work", "mountPath": "/work/copies/apps/web/u-1",
                  "subPath": "copies/apps/web/u-1", "readOnly": true },
                { "name": "work", "mountPath": "/work/artifacts/u-1", "subPath": "artifacts/u-1" },
            ]),
            "nothing else of /work: not other migrations' files, not staging-tls/"
        );
        // The paths `vmmigrate convert` is given are where the mounts put them.
        let args = &job["spec"]["template"]["spec"]["containers"][0]["args"];
        assert!(args.as_array().unwrap().contains(&json!("/work/copies/apps/web/u-1/disk-0.raw")));
        assert!(args.as_array().unwrap().contains(&json!("/work/artifacts/u-1/disk-0.qcow2")));
        // A path the store never makes mounts the volume as a whole.
        let odd = JobInput { output: "/elsewhere/disk-0.qcow2".into(), ..input() };
        let job = conversion_job(&settings(None), &vmm("web"), 0, &odd);
        let mounts = &job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"];
        assert_eq!(mounts, &json!([{ "name": "work", "mountPath": "/work" }]));
    }

    #[test]
    fn the_job_mounts_the_work_claim_is_owned_by_its_migration_and_labelled() {
        let job = conversion_job(&settings(None), &vmm("web"), 0, &input());
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
            "vmmigrate-work"
        );
        assert_eq!(job["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(job["metadata"]["labels"][LABEL_ROLE], "convert");
        assert!(container["resources"]["requests"]["cpu"].is_string());
    }

    #[test]
    fn the_job_runs_as_the_controllers_user_and_never_as_root_unless_the_controller_is() {
        let job = conversion_job(&settings(None), &vmm("web"), 0, &input());
        let security = &job["spec"]["template"]["spec"]["securityContext"];
        assert_eq!(security["runAsUser"], 65532);
        assert_eq!(security["runAsGroup"], 65532);
        assert_eq!(security["runAsNonRoot"], true);
        let root = JobSettings { run_as: Some((0, 0)), ..settings(None) };
        let job = conversion_job(&root, &vmm("web"), 0, &input());
        assert_eq!(job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"], false);
        let image_user = JobSettings { run_as: None, ..settings(None) };
        let job = conversion_job(&image_user, &vmm("web"), 0, &input());
        let security = &job["spec"]["template"]["spec"]["securityContext"];
        assert!(security.get("runAsUser").is_none(), "the image's user");
        assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault", "always, as `restricted` asks");
    }

    #[test]
    fn a_job_in_another_namespace_has_no_owner_reference() {
        let job = conversion_job(&settings(Some("vmmigrate-system")), &vmm("web"), 0, &input());
        assert_eq!(job["metadata"]["namespace"], "vmmigrate-system");
        assert_eq!(job["metadata"]["ownerReferences"], json!([]));
    }
}
