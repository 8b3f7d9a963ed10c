//! The checksum guard for a CDI that cannot check one. CDI v1.65 verifies
//! `spec.source.http.checksum` and fails the DataVolume on a mismatch; an
//! older CDI's DataVolume has no such field, so its API server prunes it and
//! nothing is verified. There the controller proves the import itself: a Job
//! in the destination namespace mounts the imported volume read-only and
//! runs `vmmigrate verify-volume`, which hashes the disk's bytes (and checks
//! that whatever CDI added after them is zeros). Its one-line answer is the
//! container's termination message.
//!
//! Which CDI is installed is read from the DataVolume definition itself (its
//! schema, the same thing that prunes or keeps the field), and, for each
//! import, from the stored DataVolume: a `checksum` that survived storage is
//! one CDI checked.

use crate::api::VirtualMachineMigration;
use crate::images::digest::VolumeDigest;
use crate::machine::{data_volume_name, destination_name};
use crate::objects::pods::{container_security_context, pod_security_context};
use crate::objects::{LABEL_ROLE, bounded_name, labels, owner_references};
use serde_json::{Value, json};

/// The DataVolume definition CDI installs.
pub(crate) const DATA_VOLUME_CRD: &str = "datavolumes.cdi.kubevirt.io";

/// How verify Jobs run.
#[derive(Clone, Debug)]
pub(crate) struct VerifySettings {
    /// The controller image (it holds `vmmigrate`).
    pub image: String,
    /// uid and gid of the Job (the controller's); `None`: the image's user.
    pub run_as: Option<(u32, u32)>,
}

/// Whether a served version of the DataVolume definition has
/// `spec.source.http.checksum`.
pub(crate) fn crd_has_checksum(crd: &Value) -> bool {
    crd["spec"]["versions"].as_array().into_iter().flatten().any(|v| {
        v["served"] != false
            && v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["source"]["properties"]["http"]
                ["properties"]
                .get("checksum")
                .is_some()
    })
}

/// The verify Job's name: `<dv>-verify`, at most 63 characters.
pub(crate) fn job_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    let dv = data_volume_name(
        &destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()),
        disk,
    );
    bounded_name(&dv, "-verify")
}

/// The Job reading disk `disk`'s imported volume (a filesystem volume: CDI
/// writes `disk.img` there).
pub(crate) fn verify_job(settings: &VerifySettings, vmm: &VirtualMachineMigration, disk: usize) -> Value {
    let status = vmm.status.clone().unwrap_or_default();
    let evidence = status.disks.get(disk).cloned().unwrap_or_default();
    let dv = data_volume_name(
        &destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()),
        disk,
    );
    let mut labels = labels(vmm);
    labels.insert(LABEL_ROLE.into(), json!("verify"));
    labels.insert(crate::api::labels::DISK.into(), json!(disk.to_string()));
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "containers": [{
            "name": "verify",
            "image": settings.image,
            "command": ["vmmigrate"],
            "args": [
                "verify-volume",
                "--path", "/volume/disk.img",
                "--size", evidence.size_bytes.max(0).to_string(),
                "--sha256", status.expected_volume_sha256(disk).unwrap_or_default(),
            ],
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": { "requests": { "cpu": "100m", "memory": "64Mi" }, "limits": { "memory": "256Mi" } },
            "securityContext": container_security_context(true),
            "volumeMounts": [{ "name": "volume", "mountPath": "/volume", "readOnly": true }],
        }],
        "volumes": [{ "name": "volume", "persistentVolumeClaim": { "claimName": dv, "readOnly": true } }],
    });
    pod_spec["securityContext"] = pod_security_context(settings.run_as);
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(vmm, disk),
            "namespace": vmm.spec.destination.namespace,
            "labels": labels.clone(),
            "ownerReferences": owner_references(vmm, &vmm.spec.destination.namespace),
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 3600,
            "template": { "metadata": { "labels": labels }, "spec": pod_spec },
        },
    })
}

/// What the verify Job's one line says.
pub(crate) fn parse_answer(line: &str) -> Option<VolumeDigest> {
    serde_json::from_str(line.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm() -> VirtualMachineMigration {
        let mut vmm = crate::api::test_migration();
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus {
            disks: vec![crate::api::DiskStatus {
                size_bytes: 1 << 30,
                source_sha256: Some("ab".repeat(32)),
                ..Default::default()
            }],
            ..Default::default()
        });
        vmm
    }

    #[test]
    fn the_verify_job_reads_the_volume_read_only_and_compares_with_the_copy() {
        let settings = VerifySettings { image: "vmmigrate:1".into(), run_as: Some((65532, 65532)) };
        let job = verify_job(&settings, &vmm(), 0);
        assert_eq!(job["metadata"]["name"], "web-disk-0-verify");
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(
            pod["volumes"][0]["persistentVolumeClaim"],
            json!({ "claimName": "web-disk-0", "readOnly": true })
        );
        assert_eq!(pod["containers"][0]["volumeMounts"][0]["readOnly"], true);
        let args: Vec<&str> =
            pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "verify-volume",
                "--path",
                "/volume/disk.img",
                "--size",
                "1073741824",
                "--sha256",
                &"ab".repeat(32)
            ]
        );
        assert_eq!(job["spec"]["backoffLimit"], 0);
    }

    #[test]
    fn the_installed_definition_tells_whether_cdi_checks_checksums() {
        let with = |props: Value| {
            json!({ "spec": { "versions": [{ "name": "v1beta1", "served": true, "schema": { "openAPIV3Schema": {
                "properties": { "spec": { "properties": { "source": { "properties": { "http": { "properties": props } } } } } } } } }] } })
        };
        assert!(crd_has_checksum(&with(json!({ "url": {}, "checksum": {} }))));
        assert!(!crd_has_checksum(&with(json!({ "url": {}, "secretRef": {} }))));
        assert!(!crd_has_checksum(&json!({})));
    }
}
