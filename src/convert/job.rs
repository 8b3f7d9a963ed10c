//! The `job` conversion runner's Kubernetes Jobs, from the controller image
//! on the shared work volume: one `batch/v1` Job per disk running `vmmigrate
//! convert`, or, for a guest converted whole, one Job per migration running
//! `vmmigrate convert-guest` over all of its disks. Pure rendering; `store`
//! creates, reads and deletes the Jobs.
//!
//! The names are deterministic (`<migration>-convert-<n>`,
//! `<migration>-convert-guest`, shortened with a hash when the migration name
//! is long), so a restarted controller finds the Job it created instead of
//! starting a second one. `backoffLimit: 0`: the controller's own retry budget
//! decides about retries, not the Job controller.

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
    /// The memory limit of a Job that converts a guest: libguestfs's
    /// appliance is a VM of about 2.5 GiB beside `vmmigrate`.
    pub guest_memory_limit: String,
}

/// The memory limit of a Job converting one disk.
const DISK_MEMORY_LIMIT: &str = "1Gi";

/// Everything one conversion needs, as paths on the work volume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JobInput {
    pub input: PathBuf,
    pub input_sha256: String,
    pub input_marker: PathBuf,
    pub expected_size: u64,
    pub output: PathBuf,
    pub format: String,
}

impl JobInput {
    /// What a Job is given for `request`.
    pub(crate) fn of(request: &super::produce::ConversionRequest) -> JobInput {
        JobInput {
            input: request.input.clone(),
            input_sha256: request.input_sha256.clone(),
            input_marker: request.input_marker.clone().unwrap_or_default(),
            expected_size: request.expected_virtual_size,
            output: request.output.clone(),
            format: request.format.as_str().to_owned(),
        }
    }

    /// The conversion a Job was given.
    pub(crate) fn request(&self) -> Result<super::produce::ConversionRequest, super::produce::UnknownFormat> {
        Ok(super::produce::ConversionRequest {
            input: self.input.clone(),
            input_sha256: self.input_sha256.clone(),
            input_marker: Some(self.input_marker.clone()),
            expected_virtual_size: self.expected_size,
            output: self.output.clone(),
            format: self.format.parse()?,
        })
    }
}

/// The Job's name: `<migration>-convert-<n>`, at most 63 characters.
pub(crate) fn job_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
    bounded_name(&vmm.metadata.name.clone().unwrap_or_default(), &format!("-convert-{disk}"))
}

/// The guest-conversion Job's name: `<migration>-convert-guest`.
pub(crate) fn guest_job_name(vmm: &VirtualMachineMigration) -> String {
    bounded_name(&vmm.metadata.name.clone().unwrap_or_default(), "-convert-guest")
}

/// What `vmmigrate convert-guest` is asked to do, written by the controller
/// into the migration's artifact folder as [`GUEST_REQUEST_FILE`] before its
/// Job is created: every disk of the guest, in the inventory's order, and the
/// inventory virt-v2v's description of the guest is written from.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct GuestJobRequest {
    pub disks: Vec<JobInput>,
    pub inventory: crate::api::SourceInventory,
    /// libguestfs's appliance under TCG (`--guest-conversion-tcg`).
    pub force_tcg: bool,
    /// Where virt-v2v works and the report goes: in the artifact folder.
    pub work: PathBuf,
    pub report: PathBuf,
}

/// The request's file name in the artifact folder.
pub(crate) const GUEST_REQUEST_FILE: &str = "guest-request.json";

/// The most a request may weigh: an inventory of a few dozen disks and NICs
/// is a few KiB.
pub(crate) const GUEST_REQUEST_LIMIT: u64 = 1 << 20;

impl GuestJobRequest {
    /// Reads and checks a request: bounded in size, every file it names in
    /// the request's own folder (outputs, work, report) or in one copy folder
    /// (inputs and their markers), no `..` anywhere.
    pub(crate) fn read(path: &Path) -> Result<GuestJobRequest, String> {
        use std::io::Read as _;
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut text = Vec::new();
        file.take(GUEST_REQUEST_LIMIT + 1)
            .read_to_end(&mut text)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if text.len() as u64 > GUEST_REQUEST_LIMIT {
            return Err(format!("{}: larger than {GUEST_REQUEST_LIMIT} bytes", path.display()));
        }
        let request: GuestJobRequest =
            serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let folder = path.parent().unwrap_or(Path::new("/"));
        let plain = |p: &Path| {
            p.is_absolute() && p.components().all(|c| !matches!(c, std::path::Component::ParentDir))
        };
        let in_folder = |p: &Path| plain(p) && p.parent() == Some(folder);
        if request.disks.is_empty() {
            return Err(format!("{}: disks: a guest without disks", path.display()));
        }
        let copies = request.disks[0].input.parent().map(Path::to_path_buf);
        for (i, disk) in request.disks.iter().enumerate() {
            let in_copies = |p: &Path| plain(p) && p.parent().map(Path::to_path_buf) == copies;
            if !in_folder(&disk.output) || !in_copies(&disk.input) || !in_copies(&disk.input_marker) {
                return Err(format!(
                    "{}: disks[{i}]: its copy and marker must share one folder and its output be beside the request",
                    path.display()
                ));
            }
            if !crate::convert::artifact::is_sha256_hex(&disk.input_sha256) {
                return Err(format!("{}: disks[{i}].inputSha256: not 64 hex digits", path.display()));
            }
            if disk.format.parse::<super::produce::OutputFormat>().is_err() {
                return Err(format!("{}: disks[{i}].format: raw or qcow2", path.display()));
            }
        }
        if !in_folder(&request.work) || !in_folder(&request.report) {
            return Err(format!("{}: work and report must be beside the request", path.display()));
        }
        Ok(request)
    }
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

/// What of the work volume a Job sees: its migration's copy folder, read
/// only, and its artifact folder, each at the path the controller has it
/// (`subPath` mounts); not the other migrations' files, not the staging
/// server's keys. The image a conversion parses comes from a host someone
/// else administers. A path outside the work directory (never made by the
/// store), or copies in more than one folder, mount the whole volume.
fn work_mounts(work_dir: &Path, copies: &[&Path], artifacts: &[&Path]) -> Value {
    let folder = |file: &Path| -> Option<(String, String)> {
        let dir = file.parent()?;
        let sub = dir.strip_prefix(work_dir).ok()?;
        let plain = sub.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        (plain && !sub.as_os_str().is_empty()).then(|| (path_arg(dir), path_arg(sub)))
    };
    let one_folder = |files: &[&Path]| -> Option<(String, String)> {
        let first = folder(files.first()?)?;
        files.iter().all(|f| folder(f).as_ref() == Some(&first)).then_some(first)
    };
    match (one_folder(copies), one_folder(artifacts)) {
        (Some((copies, copies_sub)), Some((artifacts, artifacts_sub))) => json!([
            { "name": "work", "mountPath": copies, "subPath": copies_sub, "readOnly": true },
            { "name": "work", "mountPath": artifacts, "subPath": artifacts_sub },
        ]),
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
    let mounts = work_mounts(&settings.work_dir, &[&input.input, &input.input_marker], &[&input.output]);
    let pod = JobPod {
        name: job_name(vmm, disk),
        disk: Some(disk),
        args: convert_args(input),
        mounts,
        memory_limit: DISK_MEMORY_LIMIT,
    };
    render(settings, vmm, pod)
}

/// The Job converting the whole guest from the request at `request` (the
/// file [`GuestJobRequest::read`] accepts).
pub(crate) fn guest_conversion_job(
    settings: &JobSettings,
    vmm: &VirtualMachineMigration,
    request: &Path,
    guest: &GuestJobRequest,
) -> Value {
    let copies: Vec<&Path> =
        guest.disks.iter().flat_map(|d| [d.input.as_path(), d.input_marker.as_path()]).collect();
    let mut artifacts: Vec<&Path> = guest.disks.iter().map(|d| d.output.as_path()).collect();
    artifacts.extend([request, guest.work.as_path(), guest.report.as_path()]);
    let pod = JobPod {
        name: guest_job_name(vmm),
        disk: None,
        args: vec!["convert-guest".to_owned(), "--request".to_owned(), path_arg(request)],
        mounts: work_mounts(&settings.work_dir, &copies, &artifacts),
        memory_limit: &settings.guest_memory_limit,
    };
    render(settings, vmm, pod)
}

/// What tells one conversion Job from another.
struct JobPod<'a> {
    name: String,
    /// The disk it converts; `None`: every disk (a guest).
    disk: Option<usize>,
    args: Vec<String>,
    mounts: Value,
    memory_limit: &'a str,
}

fn render(settings: &JobSettings, vmm: &VirtualMachineMigration, pod: JobPod<'_>) -> Value {
    let namespace = job_namespace(settings, vmm);
    let mut labels = labels(vmm);
    labels.insert(LABEL_ROLE.into(), json!("convert"));
    if let Some(disk) = pod.disk {
        labels.insert(LABEL_DISK.into(), json!(disk.to_string()));
    }
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
            "args": pod.args,
            // The controller reads why a conversion failed from here.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": {
                "requests": { "cpu": "500m", "memory": "256Mi" },
                "limits": { "memory": pod.memory_limit },
            },
            "securityContext": container_security_context(false),
            "volumeMounts": pod.mounts,
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
            "name": pod.name,
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
            guest_memory_limit: "4Gi".into(),
        }
    }

    fn guest_request(dir: &Path) -> GuestJobRequest {
        let copies = Path::new("/work/copies/apps/web/u-1");
        let disk = |n: usize| JobInput {
            input: copies.join(format!("disk-{n}.raw")),
            input_sha256: "ab".repeat(32),
            input_marker: copies.join(format!("disk-{n}.sha256")),
            expected_size: 1 << 30,
            output: dir.join(format!("disk-{n}.raw")),
            format: "raw".into(),
        };
        GuestJobRequest {
            disks: vec![disk(0), disk(1)],
            inventory: crate::api::SourceInventory { guest_os: "debian12-64".into(), ..Default::default() },
            force_tcg: true,
            work: dir.join("guest.v2v"),
            report: dir.join("guest-conversion.json"),
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

    #[test]
    fn a_guest_job_converts_every_disk_at_once_with_room_for_the_appliance() {
        let dir = Path::new("/work/artifacts/u-1");
        let request = dir.join(GUEST_REQUEST_FILE);
        let job = guest_conversion_job(&settings(None), &vmm("web"), &request, &guest_request(dir));
        assert_eq!(job["metadata"]["name"], "web-convert-guest");
        assert_eq!(job["metadata"]["labels"][LABEL_ROLE], "convert");
        assert!(job["metadata"]["labels"].get(LABEL_DISK).is_none(), "it is no one disk's");
        assert_eq!(job["spec"]["backoffLimit"], 0);
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            container["args"],
            json!(["convert-guest", "--request", "/work/artifacts/u-1/guest-request.json"])
        );
        assert_eq!(container["resources"]["limits"]["memory"], "4Gi");
        assert_eq!(
            container["volumeMounts"],
            json!([
                { "name": "work", "mountPath": "/work/copies/apps/web/u-1",
                  "subPath": "copies/apps/web/u-1", "readOnly": true },
                { "name": "work", "mountPath": "/work/artifacts/u-1", "subPath": "artifacts/u-1" },
            ]),
            "every copy read-only, the artifact folder, nothing else"
        );
        // A disk Job keeps its smaller limit.
        let disk = conversion_job(&settings(None), &vmm("web"), 0, &input());
        assert_eq!(disk["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"], "1Gi");
        let long = guest_job_name(&vmm(&"a".repeat(70)));
        assert!(long.len() <= 63 && long.ends_with("-convert-guest"), "{long}");
    }

    #[test]
    fn a_guest_job_whose_copies_are_in_two_folders_mounts_the_volume_whole() {
        let dir = Path::new("/work/artifacts/u-1");
        let mut guest = guest_request(dir);
        guest.disks[1].input = "/work/copies/apps/other/u-2/disk-1.raw".into();
        let job = guest_conversion_job(&settings(None), &vmm("web"), &dir.join(GUEST_REQUEST_FILE), &guest);
        let mounts = &job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"];
        assert_eq!(mounts, &json!([{ "name": "work", "mountPath": "/work" }]));
    }

    #[test]
    fn a_guest_request_is_read_back_only_when_it_names_files_where_the_job_mounts_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("artifacts").join("u-1");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(GUEST_REQUEST_FILE);
        let write = |r: &GuestJobRequest| std::fs::write(&path, serde_json::to_vec(r).unwrap()).unwrap();
        let good = guest_request(&dir);
        write(&good);
        assert_eq!(GuestJobRequest::read(&path).unwrap(), good);

        let mut outside = good.clone();
        outside.disks[1].output = tmp.path().join("elsewhere.raw");
        write(&outside);
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("disks[1]"));

        let mut climbing = good.clone();
        climbing.work = dir.join("..").join("u-2").join("guest.v2v");
        write(&climbing);
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("work and report"));

        let mut split = good.clone();
        split.disks[1].input_marker = "/work/copies/apps/other/u-2/disk-1.sha256".into();
        write(&split);
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("disks[1]"));

        let mut bad_sha = good.clone();
        bad_sha.disks[0].input_sha256 = "$(reboot)".into();
        write(&bad_sha);
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("disks[0].inputSha256"));

        let mut no_disks = good.clone();
        no_disks.disks.clear();
        write(&no_disks);
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("without disks"));

        std::fs::write(&path, vec![b' '; GUEST_REQUEST_LIMIT as usize + 1]).unwrap();
        assert!(GuestJobRequest::read(&path).unwrap_err().contains("larger than"));
    }
}
