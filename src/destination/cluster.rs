//! The real `Cluster` adapter: CDI DataVolumes, the KubeVirt VirtualMachine
//! and its VMI, through the Kubernetes API (the checks are `probe.rs`'s).

use super::fill;
use super::render;
use super::verify::{self, VerifySettings};
use crate::api::Reason;
use crate::api::labels::MIGRATION_UID as LABEL_MIGRATION_UID;
use crate::api::{LeftOnSource, VirtualMachineMigration};
use crate::machine::{
    DataVolumeState, DestinationOccupancy, Failure, PreflightFacts, StartingFacts, VmState, VmiState,
    VolumeCheck, data_volume_name, destination_name,
};
use crate::objects::claims::SourceClaims;
use crate::ports::kube_errors::{classify, delete_by_uid};
use crate::ports::{Cluster, ImportAccess};
use async_trait::async_trait;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// KubeVirt's container that logs the guest's serial console beside the VMI.
const GUEST_CONSOLE_CONTAINER: &str = "guest-console-log";
/// How much of the console is read at a look: its last lines, bounded.
const GUEST_CONSOLE_LINES: i64 = 200;
const GUEST_CONSOLE_BYTES: i64 = 64 * 1024;

/// Field manager of every write the controller makes.
pub(crate) const FIELD_MANAGER: &str = "vmmigrate-controller";

pub fn data_volume_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cdi.kubevirt.io", "v1beta1", "DataVolume"),
        "datavolumes",
    )
}
pub fn virtual_machine_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}
pub fn virtual_machine_instance_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

/// A rendered object as the API client takes it.
fn object(body: Value) -> Result<DynamicObject, Failure> {
    serde_json::from_value(body).map_err(|e| Failure::terminal(Reason::RenderError, e.to_string()))
}

/// Creates `obj` with `fieldValidation=Strict`: a field the installed CRD
/// does not know (an older CDI without `checksum`, say) is an error naming
/// it, never pruned in silence. kube's `PostParams` has no field validation,
/// so the request is built here.
pub(crate) async fn create_strict(
    client: &Client,
    ar: &ApiResource,
    namespace: &str,
    obj: &DynamicObject,
) -> Result<DynamicObject, kube::Error> {
    use kube::Resource as _;
    let params = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let body = serde_json::to_vec(obj).map_err(kube::Error::SerdeError)?;
    let mut request = kube::core::Request::new(DynamicObject::url_path(ar, Some(namespace)))
        .create(&params, body)
        .map_err(kube::Error::BuildRequest)?;
    let uri = request.uri().to_string();
    let joiner = if uri.contains('?') { '&' } else { '?' };
    *request.uri_mut() =
        format!("{uri}{joiner}fieldValidation=Strict").parse().map_err(|e: http::uri::InvalidUri| {
            kube::Error::BuildRequest(kube::core::request::Error::Validation(e.to_string()))
        })?;
    client.request::<DynamicObject>(request).await
}

fn job_resource() -> ApiResource {
    ApiResource::erase::<Job>(&())
}

fn secret_resource() -> ApiResource {
    ApiResource::erase::<k8s_openapi::api::core::v1::Secret>(&())
}

fn config_map_resource() -> ApiResource {
    ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
}

fn is_ours(vmm: &VirtualMachineMigration, obj: &DynamicObject) -> bool {
    let uid = vmm.metadata.uid.clone().unwrap_or_default();
    !uid.is_empty() && obj.labels().get(LABEL_MIGRATION_UID) == Some(&uid)
}

/// Talks to the destination cluster.
#[derive(Clone)]
pub struct KubeCluster {
    client: Client,
    claims: SourceClaims,
    verify: Option<VerifySettings>,
    /// Whether raw disks go into blank DataVolumes filled by Jobs of
    /// `verify`'s image (`super::fill`).
    fill: bool,
}

/// A Job's state as the volume checks read it.
enum JobEnd {
    Absent,
    Running,
    Finished { complete: bool, said: String },
}

impl KubeCluster {
    /// `claims_namespace` holds the source-VM claims (the controller's own namespace).
    pub fn new(client: Client, claims_namespace: &str) -> KubeCluster {
        KubeCluster {
            claims: SourceClaims::new(client.clone(), claims_namespace),
            client,
            verify: None,
            fill: false,
        }
    }

    /// The last termination message of CDI's importer pod of DataVolume
    /// `dv` (`importer-<dv>`), as `<reason>: <message>`.
    async fn importer_last_error(&self, vmm: &VirtualMachineMigration, dv: &str) -> Option<String> {
        use k8s_openapi::api::core::v1::Pod;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &vmm.spec.destination.namespace);
        let pod = pods.get_opt(&format!("importer-{dv}")).await.ok()??;
        let statuses = pod.status?.container_statuses?;
        statuses.iter().find_map(|s| {
            let ended = s.last_state.as_ref()?.terminated.as_ref()?;
            let message = ended.message.as_deref()?.lines().rev().map(str::trim).find(|l| !l.is_empty())?;
            let message: String = message.chars().take(512).collect();
            Some(match ended.reason.as_deref() {
                Some(reason) => format!("{reason}: {message}"),
                None => message,
            })
        })
    }

    /// What this process may not write in `namespace` of what a migration
    /// creates there (its DataVolumes, VM and import Secrets), asked with
    /// SelfSubjectAccessReviews: under deploy/'s RBAC, a namespace without
    /// the tenant Role. `None`: everything is granted.
    async fn not_granted(&self, namespace: &str) -> Result<Option<String>, Failure> {
        use k8s_openapi::api::authorization::v1::{
            ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
        };
        let reviews: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        let mut refused = Vec::new();
        for (group, resource) in
            [("cdi.kubevirt.io", "datavolumes"), ("kubevirt.io", "virtualmachines"), ("", "secrets")]
        {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        namespace: Some(namespace.to_owned()),
                        verb: Some("create".into()),
                        group: Some(group.into()),
                        resource: Some(resource.into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let answer = reviews
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| classify("asking what vmmigrate may create", e))?;
            if !answer.status.is_some_and(|s| s.allowed) {
                refused.push(resource);
            }
        }
        Ok((!refused.is_empty()).then(|| {
            format!(
                "vmmigrate may not create {} in namespace {namespace}: an administrator grants it with the tenant Role (deploy/overlays/example-tenant/tenant.yaml) in that namespace",
                refused.join(", ")
            )
        }))
    }

    /// Lets this cluster read imported volumes back with Jobs of this image
    /// where CDI cannot check a checksum (`super::verify`).
    pub(crate) fn with_volume_checks(mut self, settings: VerifySettings) -> KubeCluster {
        self.verify = Some(settings);
        self
    }

    /// Lets this cluster fill blank DataVolumes itself with Jobs of the
    /// image given to [`Self::with_volume_checks`] (`super::fill`).
    pub(crate) fn filling_volumes(mut self, fill: bool) -> KubeCluster {
        self.fill = fill;
        self
    }

    /// Creates Job `name` from `body` in the destination namespace; one
    /// already there (made before a restart) is the one.
    /// Where a Job of this migration's destination namespace stands, and
    /// once it ended, the line its pod said.
    async fn job_end(&self, vmm: &VirtualMachineMigration, job_name: &str) -> Result<JobEnd, Failure> {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &vmm.spec.destination.namespace);
        let job = match jobs.get_opt(job_name).await {
            Ok(Some(job)) => job,
            Ok(None) => return Ok(JobEnd::Absent),
            Err(e) => return Err(classify(&format!("reading Job {job_name}"), e)),
        };
        let status = job.status.unwrap_or_default();
        let finished =
            |t: &str| status.conditions.iter().flatten().any(|c| c.type_ == t && c.status == "True");
        if !finished("Complete") && !finished("Failed") {
            return Ok(JobEnd::Running);
        }
        let namespace = &vmm.spec.destination.namespace;
        let said = crate::objects::pods::job_termination_line(&self.client, namespace, job_name).await;
        Ok(JobEnd::Finished { complete: finished("Complete"), said: said.unwrap_or_default() })
    }

    /// A fill Job's outcome: the sha256 of what it wrote, matching what it
    /// was told or not.
    async fn fill_check(
        &self,
        vmm: &VirtualMachineMigration,
        job_name: &str,
    ) -> Result<VolumeCheck, Failure> {
        let (complete, said) = match self.job_end(vmm, job_name).await? {
            JobEnd::Absent => return Ok(VolumeCheck::Absent),
            JobEnd::Running => return Ok(VolumeCheck::Running),
            JobEnd::Finished { complete, said } => (complete, said),
        };
        Ok(match fill::parse_report(&said) {
            Some(r) if complete => VolumeCheck::Matches { sha256: r.sha256 },
            Some(r) => VolumeCheck::Differs { sha256: r.sha256, nonzero_tail_bytes: 0 },
            None => VolumeCheck::Failed(Failure::retryable(
                Reason::VolumeCheckFailed,
                format!(
                    "Job {job_name} could not fill the volume: {}",
                    if said.is_empty() { "no message" } else { said.as_str() }
                ),
            )),
        })
    }

    async fn create_job(
        &self,
        vmm: &VirtualMachineMigration,
        body: Value,
        name: &str,
    ) -> Result<(), Failure> {
        let job: Job = serde_json::from_value(body)
            .map_err(|e| Failure::terminal(Reason::RenderError, e.to_string()))?;
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &vmm.spec.destination.namespace);
        match jobs
            .create(&PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() }, &job)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(classify(&format!("creating Job {name}"), e)),
        }
    }

    fn dynamic(&self, vmm: &VirtualMachineMigration, ar: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &vmm.spec.destination.namespace, ar)
    }

    fn vm_name(vmm: &VirtualMachineMigration) -> String {
        destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()).into_owned()
    }

    fn dv_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
        data_volume_name(&Self::vm_name(vmm), disk)
    }

    async fn get(
        &self,
        vmm: &VirtualMachineMigration,
        ar: &ApiResource,
        name: &str,
    ) -> Result<Option<DynamicObject>, Failure> {
        self.dynamic(vmm, ar)
            .get_opt(name)
            .await
            .map_err(|e| classify(&format!("reading {} {name}", ar.kind), e))
    }

    async fn create(
        &self,
        vmm: &VirtualMachineMigration,
        ar: &ApiResource,
        body: Value,
    ) -> Result<(), Failure> {
        let obj = object(body)?;
        match create_strict(&self.client, ar, &vmm.spec.destination.namespace, &obj).await {
            Ok(_) => Ok(()),
            // Create-if-absent: someone (a previous reconcile) was first.
            Err(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists" => Ok(()),
            Err(e) => Err(classify(&format!("creating {} {}", ar.kind, obj.name_any()), e)),
        }
    }

    /// Server-side apply of `body`, taking the fields from anyone else.
    async fn apply(
        &self,
        vmm: &VirtualMachineMigration,
        ar: &ApiResource,
        body: Value,
    ) -> Result<(), Failure> {
        let obj = object(body)?;
        let name = obj.name_any();
        self.dynamic(vmm, ar)
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force().validation_strict(), &Patch::Apply(&obj))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("applying {} {name}", ar.kind), e))
    }

    async fn delete_if_ours(
        &self,
        vmm: &VirtualMachineMigration,
        ar: &ApiResource,
        name: &str,
    ) -> Result<(), Failure> {
        match self.get(vmm, ar, name).await? {
            Some(obj) if is_ours(vmm, &obj) => {
                delete_by_uid(&self.dynamic(vmm, ar), name, obj.metadata.uid.clone(), &ar.kind).await
            }
            _ => Ok(()),
        }
    }

    /// Deletes the import Secrets and CA ConfigMaps of every disk.
    async fn delete_import_access(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        for disk in 0..crate::machine::disks_ever_named(vmm.status.as_ref()) {
            let dv = Self::dv_name(vmm, disk);
            self.delete_if_ours(vmm, &secret_resource(), &render::import_secret_name(&dv)).await?;
            self.delete_if_ours(vmm, &config_map_resource(), &render::import_ca_name(&dv)).await?;
        }
        Ok(())
    }

    async fn release(
        &self,
        vmm: &VirtualMachineMigration,
        ar: &ApiResource,
        name: &str,
    ) -> Result<(), Failure> {
        let Some(obj) = self.get(vmm, ar, name).await? else { return Ok(()) };
        let uid = vmm.metadata.uid.clone().unwrap_or_default();
        let refs = obj.metadata.owner_references.clone().unwrap_or_default();
        if !refs.iter().any(|r| r.uid == uid) {
            return Ok(());
        }
        let kept: Vec<_> = refs.into_iter().filter(|r| r.uid != uid).collect();
        let patch =
            json!({ "metadata": { "ownerReferences": kept, "resourceVersion": obj.resource_version() } });
        self.dynamic(vmm, ar)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("releasing {} {name}", ar.kind), e))
    }
}

/// What a DataVolume's status says, the way CDI v1.65 writes it: `Failed`
/// only for a fatal error (a checksum mismatch, reason `ChecksumError` on the
/// `Running` condition); any other importer error restarts the importer pod
/// (`restartCount`), with the phase kept and `Running=False` carrying the
/// importer's reason and message.
pub(crate) fn data_volume_state(name: &str, status: &Value) -> DataVolumeState {
    let phase = status.get("phase").and_then(Value::as_str).unwrap_or("Pending").to_owned();
    let conditions =
        status.get("conditions").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let running = conditions.iter().find(|c| c["type"] == "Running");
    let text = |c: &Value, key: &str| c.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
    // CDI cannot make the volume at all (the class's StorageProfile says no
    // access mode, say): nothing will change without a person.
    if let Some(bound) = conditions.iter().find(|c| c["type"] == "Bound" && c["status"] == "False")
        && bound["reason"] == "ErrClaimNotValid"
    {
        return DataVolumeState::Failed(Failure::needs_human(
            Reason::ImportFailed,
            format!("DataVolume {name}: CDI cannot create its volume: {}", text(bound, "message")),
        ));
    }
    match phase.as_str() {
        "Succeeded" => DataVolumeState::Succeeded,
        "Failed" => {
            let message = running
                .into_iter()
                .chain(conditions)
                .map(|c| text(c, "message"))
                .find(|m| !m.is_empty())
                .unwrap_or_else(|| "the import failed".to_owned());
            let checksum = running.is_some_and(|c| c["reason"] == "ChecksumError");
            let reason = if checksum { Reason::ImportChecksumMismatch } else { Reason::ImportFailed };
            DataVolumeState::Failed(Failure::retryable(reason, format!("DataVolume {name}: {message}")))
        }
        _ => DataVolumeState::InProgress {
            percent: percent(status.get("progress").and_then(Value::as_str)),
            phase,
            restarts: status
                .get("restartCount")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                .clamp(0, i32::MAX as i64) as i32,
            // Running=False also says "Completed" (done) or "Pending": an
            // error only once the importer failed (restarted, or says Error).
            importer_error: running
                .filter(|c| {
                    let restarted = status.get("restartCount").and_then(Value::as_i64).unwrap_or(0) > 0;
                    let failed = restarted || c["reason"] == "Error";
                    c["status"] == "False"
                        && c["reason"] != "Completed"
                        && failed
                        && !text(c, "message").is_empty()
                })
                .map(|c| {
                    let reason = text(c, "reason");
                    if reason.is_empty() {
                        text(c, "message")
                    } else {
                        format!("{reason}: {}", text(c, "message"))
                    }
                }),
        },
    }
}

fn percent(progress: Option<&str>) -> i32 {
    progress
        .and_then(|p| p.trim_end_matches('%').parse::<f64>().ok())
        .map(|p| p.clamp(0.0, 100.0) as i32)
        .unwrap_or(0)
}

#[async_trait]
impl Cluster for KubeCluster {
    async fn preflight(&self, vmm: &VirtualMachineMigration) -> Result<PreflightFacts, Failure> {
        let classes: Api<StorageClass> = Api::all(self.client.clone());
        let storage_class_exists = classes
            .get_opt(&vmm.spec.destination.storage_class_name)
            .await
            .map_err(|e| classify("reading StorageClass", e))?
            .is_some();
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let destination_namespace_exists = namespaces
            .get_opt(&vmm.spec.destination.namespace)
            .await
            .map_err(|e| classify("reading Namespace", e))?
            .is_some();
        let destination_vm = if destination_namespace_exists {
            match self.get(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await? {
                None => DestinationOccupancy::Free,
                Some(vm) if is_ours(vmm, &vm) => DestinationOccupancy::Ours,
                Some(_) => DestinationOccupancy::Taken,
            }
        } else {
            DestinationOccupancy::Free
        };
        let destination_refused = if destination_namespace_exists {
            self.not_granted(&vmm.spec.destination.namespace).await?
        } else {
            None
        };
        let source_claimed_by = self.claims.claim(vmm).await?;
        Ok(PreflightFacts {
            storage_class_exists,
            destination_namespace_exists,
            destination_vm,
            destination_refused,
            data_plane_blocked: None,
            source_claimed_by,
            guest_converter: Default::default(),
        })
    }

    async fn release_source(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.claims.release(vmm).await
    }

    async fn record_left_on_source(&self, left: &LeftOnSource) -> Result<(), Failure> {
        self.claims.record_left(left).await
    }

    async fn data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<DataVolumeState, Failure> {
        let name = Self::dv_name(vmm, disk);
        let Some(dv) = self.get(vmm, &data_volume_resource(), &name).await? else {
            return Ok(DataVolumeState::Absent);
        };
        if !is_ours(vmm, &dv) {
            return Err(Failure::needs_human(
                Reason::DataVolumeNotOwned,
                format!("DataVolume {name} exists and was not created by this migration"),
            ));
        }
        let mut state = data_volume_state(&name, dv.data.get("status").unwrap_or(&Value::Null));
        // Between restarts the Running condition may say nothing; what the
        // importer said when it last failed is its pod's termination message.
        if let DataVolumeState::InProgress { restarts, importer_error, .. } = &mut state
            && *restarts > 0
            && let Some(said) = self.importer_last_error(vmm, &name).await
        {
            *importer_error = Some(said);
        }
        Ok(state)
    }

    async fn create_data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        access: &ImportAccess,
    ) -> Result<(), Failure> {
        // Before the DataVolume: CDI's importer pod needs both when it starts.
        // Applied, not created if absent: a DataVolume made again after the
        // staging key or CA changed must not find the old ones.
        self.apply(vmm, &secret_resource(), render::import_secret(vmm, disk, access)).await?;
        self.apply(vmm, &config_map_resource(), render::import_ca(vmm, disk, access)).await?;
        self.create(vmm, &data_volume_resource(), render::data_volume(vmm, disk)).await
    }

    async fn cdi_verifies_checksum(&self) -> Result<bool, Failure> {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        match crds.get_opt(verify::DATA_VOLUME_CRD).await {
            Ok(Some(crd)) => Ok(verify::crd_has_checksum(&serde_json::to_value(&crd).unwrap_or(Value::Null))),
            Ok(None) => Err(Failure::needs_human(
                Reason::CDIMissing,
                format!(
                    "CustomResourceDefinition {} is not installed: is CDI installed?",
                    verify::DATA_VOLUME_CRD
                ),
            )),
            Err(e) => {
                Err(classify(&format!("reading CustomResourceDefinition {}", verify::DATA_VOLUME_CRD), e))
            }
        }
    }

    async fn import_check(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<Option<VolumeCheck>, Failure> {
        let name = Self::dv_name(vmm, disk);
        let Some(dv) = self.get(vmm, &data_volume_resource(), &name).await? else {
            return Ok(Some(VolumeCheck::Absent));
        };
        if dv.data["spec"]["source"]["http"].get("checksum").is_some_and(Value::is_string) {
            return Ok(None);
        }
        let filled = dv.data["spec"]["source"].get("blank").is_some();
        if self.verify.is_none() {
            return Ok(Some(VolumeCheck::Unavailable(match filled {
                true => "no image for Jobs is configured (--job-image) to fill the blank volume".into(),
                false => "no image for Jobs is configured (--job-image) to read the volume back".into(),
            })));
        }
        if filled {
            return self.fill_check(vmm, &fill::job_name(vmm, disk)).await.map(Some);
        }
        let job_name = verify::job_name(vmm, disk);
        let (complete, said) = match self.job_end(vmm, &job_name).await? {
            JobEnd::Absent => return Ok(Some(VolumeCheck::Absent)),
            JobEnd::Running => return Ok(Some(VolumeCheck::Running)),
            JobEnd::Finished { complete, said } => (complete, said),
        };
        Ok(Some(match verify::parse_answer(&said) {
            Some(d) if complete => VolumeCheck::Matches { sha256: d.sha256 },
            Some(d) => VolumeCheck::Differs { sha256: d.sha256, nonzero_tail_bytes: d.nonzero_tail_bytes },
            None => VolumeCheck::Failed(Failure::retryable(
                Reason::VolumeCheckFailed,
                format!(
                    "Job {job_name} could not read the volume: {}",
                    if said.is_empty() { "no message" } else { said.as_str() }
                ),
            )),
        }))
    }

    async fn base_fill(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<Option<VolumeCheck>, Failure> {
        if self.verify.is_none() || !self.fill {
            return Ok(None);
        }
        self.fill_check(vmm, &fill::base_job_name(vmm, disk)).await.map(Some)
    }

    async fn start_base_fill(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        (url, sha256): (&str, &str),
        access: &ImportAccess,
    ) -> Result<(), Failure> {
        let Some(settings) = &self.verify else { return Ok(()) };
        self.apply(vmm, &secret_resource(), render::import_secret(vmm, disk, access)).await?;
        let job = fill::fill_job(settings, vmm, disk, fill::Fill::Base { url, sha256 });
        self.create_job(vmm, job, &fill::base_job_name(vmm, disk)).await
    }

    async fn delete_base_fill(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.delete_if_ours(vmm, &job_resource(), &fill::base_job_name(vmm, disk)).await
    }

    async fn fills_volumes(&self) -> bool {
        self.fill && self.verify.is_some()
    }

    async fn start_volume_check(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        let Some(settings) = &self.verify else { return Ok(()) };
        self.create_job(vmm, verify::verify_job(settings, vmm, disk), &verify::job_name(vmm, disk)).await
    }

    async fn start_fill(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        access: &ImportAccess,
    ) -> Result<(), Failure> {
        let Some(settings) = &self.verify else { return Ok(()) };
        // The fill Job mounts both; applied, not created if absent, so a
        // changed staging key or CA is what it finds.
        self.apply(vmm, &secret_resource(), render::import_secret(vmm, disk, access)).await?;
        self.apply(vmm, &config_map_resource(), render::import_ca(vmm, disk, access)).await?;
        self.create_job(
            vmm,
            fill::fill_job(settings, vmm, disk, fill::Fill::Import),
            &fill::job_name(vmm, disk),
        )
        .await
    }

    async fn delete_volume_check(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.delete_if_ours(vmm, &job_resource(), &verify::job_name(vmm, disk)).await?;
        self.delete_if_ours(vmm, &job_resource(), &fill::base_job_name(vmm, disk)).await?;
        self.delete_if_ours(vmm, &job_resource(), &fill::job_name(vmm, disk)).await
    }

    async fn delete_data_volume(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.delete_if_ours(vmm, &data_volume_resource(), &Self::dv_name(vmm, disk)).await
    }

    async fn vm(&self, vmm: &VirtualMachineMigration) -> Result<VmState, Failure> {
        let Some(vm) = self.get(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await? else {
            return Ok(VmState::Absent);
        };
        if !is_ours(vmm, &vm) {
            return Ok(VmState::NotOurs);
        }
        let uid = vm.uid().unwrap_or_default();
        let wanted = render::virtual_machine(vmm);
        let live =
            json!({ "spec": { "template": vm.data.get("spec").and_then(|s| s.get("template")).cloned() } });
        let want = json!({ "spec": { "template": wanted["spec"]["template"].clone() } });
        let differences = crate::objects::semantic::differences(&live, &want);
        Ok(if differences.is_empty() {
            VmState::Matching { uid }
        } else {
            VmState::Drifted { uid, differences }
        })
    }

    async fn create_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.create(vmm, &virtual_machine_resource(), render::virtual_machine(vmm)).await
    }

    async fn update_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let name = Self::vm_name(vmm);
        let wanted = render::virtual_machine(vmm);
        let patch = json!({ "spec": { "template": wanted["spec"]["template"].clone() } });
        self.dynamic(vmm, &virtual_machine_resource())
            .patch(&name, &PatchParams::default().validation_strict(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("updating VirtualMachine {name}"), e))
    }

    async fn starting(&self, vmm: &VirtualMachineMigration) -> Result<StartingFacts, Failure> {
        let name = Self::vm_name(vmm);
        let wanted = serde_json::to_value(vmm.spec.run_strategy()).unwrap_or(Value::Null);
        let vm = self.get(vmm, &virtual_machine_resource(), &name).await?;
        let run_strategy_set = vm.as_ref().and_then(|vm| vm.data["spec"].get("runStrategy")) == Some(&wanted);
        let vmi = match self.get(vmm, &virtual_machine_instance_resource(), &name).await? {
            None => VmiState::Absent,
            Some(vmi) => {
                let status = vmi.data.get("status").cloned().unwrap_or(Value::Null);
                let phase = status.get("phase").and_then(Value::as_str).unwrap_or("Pending").to_owned();
                let unschedulable = status.get("conditions").and_then(Value::as_array).and_then(|cs| {
                    cs.iter().find(|c| {
                        c["type"] == "PodScheduled"
                            && c["status"] == "False"
                            && c["reason"] == "Unschedulable"
                    })
                });
                match (phase.as_str(), unschedulable) {
                    ("Running", _) => VmiState::Running,
                    ("Failed", _) => VmiState::Failed(Failure::retryable(
                        Reason::VMIFailed,
                        format!("VMI {name} failed{}", vmi_failure_detail(&status)),
                    )),
                    (_, Some(c)) => {
                        let message = c["message"].as_str().unwrap_or_default().to_owned();
                        if message.contains("devices.kubevirt.io/kvm") {
                            VmiState::Failed(Failure::needs_human(
                                Reason::NoKVM,
                                format!("no node offers /dev/kvm: {message}"),
                            ))
                        } else {
                            VmiState::Failed(Failure::retryable(Reason::Unschedulable, message))
                        }
                    }
                    _ => VmiState::Waiting { phase },
                }
            }
        };
        Ok(StartingFacts { run_strategy_set, vmi })
    }

    async fn guest_console(&self, vmm: &VirtualMachineMigration) -> Result<Option<String>, Failure> {
        use k8s_openapi::api::core::v1::Pod;
        let name = Self::vm_name(vmm);
        let Some(vmi) = self.get(vmm, &virtual_machine_instance_resource(), &name).await? else {
            return Ok(None);
        };
        let Some(vmi_uid) = vmi.metadata.uid.clone() else { return Ok(None) };
        let namespace = &vmm.spec.destination.namespace;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let listed = launcher_pods(&self.client, namespace, &vmi_uid)
            .await
            .map_err(|e| classify(&format!("listing the launcher pod of VMI {name}"), e))?;
        // The VMI's own launcher: owned by it, not a pod that only wears its
        // label. KubeVirt runs the console container as a native sidecar (an
        // init container that keeps running); a plain container is read too.
        let launcher = listed.into_iter().find(|p| {
            let logs_console = p.spec.as_ref().is_some_and(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
                    .any(|c| c.name == GUEST_CONSOLE_CONTAINER)
            });
            logs_console
                && p.owner_references().iter().any(|o| o.kind == "VirtualMachineInstance" && o.uid == vmi_uid)
        });
        let Some(launcher) = launcher else { return Ok(None) };
        let params = kube::api::LogParams {
            container: Some(GUEST_CONSOLE_CONTAINER.into()),
            tail_lines: Some(GUEST_CONSOLE_LINES),
            limit_bytes: Some(GUEST_CONSOLE_BYTES),
            ..Default::default()
        };
        let text = pods
            .logs(&launcher.name_any(), &params)
            .await
            .map_err(|e| classify(&format!("reading the console of VMI {name}"), e))?;
        Ok(Some(text))
    }

    async fn set_run_strategy(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let name = Self::vm_name(vmm);
        let patch = json!({ "spec": { "runStrategy": vmm.spec.run_strategy() } });
        self.dynamic(vmm, &virtual_machine_resource())
            .patch(&name, &PatchParams::default().validation_strict(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("setting runStrategy on {name}"), e))
    }

    async fn delete_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.delete_if_ours(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await?;
        for disk in 0..crate::machine::disks_ever_named(vmm.status.as_ref()) {
            self.delete_data_volume(vmm, disk).await?;
        }
        self.delete_import_access(vmm).await
    }

    async fn release_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.release(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await?;
        for disk in 0..crate::machine::disks_ever_named(vmm.status.as_ref()) {
            self.release(vmm, &data_volume_resource(), &Self::dv_name(vmm, disk)).await?;
        }
        // The imports are done: their credentials and CA go, never released.
        self.delete_import_access(vmm).await
    }
}

/// The pods labelled as created for the VMI of uid `vmi_uid` (at most 16):
/// its virt-launcher pods, and any other pod that wears the label, which is
/// anybody's to set; callers check what vouches for a pod.
pub(crate) async fn launcher_pods(
    client: &Client,
    namespace: &str,
    vmi_uid: &str,
) -> Result<Vec<k8s_openapi::api::core::v1::Pod>, kube::Error> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    let params =
        kube::api::ListParams::default().labels(&format!("kubevirt.io/created-by={vmi_uid}")).limit(16);
    Ok(pods.list(&params).await?.items)
}

/// What a failed VMI says about why: the messages of its conditions (virt-
/// handler's `Synchronized`, the pod's scheduling or readiness), as
/// `: Type Reason: message; …`, at most 500 characters; empty when it says
/// nothing.
fn vmi_failure_detail(status: &Value) -> String {
    let conditions = status.get("conditions").and_then(Value::as_array).cloned().unwrap_or_default();
    let said: Vec<String> = conditions
        .iter()
        .filter_map(|c| {
            let message = c["message"].as_str().filter(|m| !m.is_empty())?;
            let kind = c["type"].as_str().unwrap_or("?");
            let reason = c["reason"].as_str().unwrap_or_default();
            Some(format!("{kind} {reason}: {message}").replace("  ", " "))
        })
        .collect();
    if said.is_empty() {
        return String::new();
    }
    let mut detail = format!(": {}", said.join("; "));
    if detail.len() > 500 {
        let cut = (0..=500).rev().find(|i| detail.is_char_boundary(*i)).unwrap_or(0);
        detail.truncate(cut);
        detail.push('…');
    }
    detail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_vmi_is_reported_with_what_its_conditions_say() {
        let status = json!({ "phase": "Failed", "conditions": [
            { "type": "Ready", "status": "False", "reason": "PodTerminating", "message": "" },
            { "type": "Synchronized", "status": "False", "reason": "Synchronizing with the Domain failed.",
              "message": "virError(Code=1): internal error: process exited while connecting to monitor" }]});
        let detail = vmi_failure_detail(&status);
        assert!(detail.starts_with(": Synchronized Synchronizing"), "{detail}");
        assert!(detail.contains("process exited while connecting to monitor"), "{detail}");
        assert_eq!(vmi_failure_detail(&json!({ "phase": "Failed" })), "");
        let long = json!({ "conditions": [{ "type": "X", "message": "é".repeat(400) }] });
        assert!(vmi_failure_detail(&long).chars().count() <= 502);
    }

    #[test]
    fn data_volume_status_is_read_the_way_cdi_writes_it() {
        let running = |status: &str, reason: &str, message: &str| json!([{ "type": "Running", "status": status, "reason": reason, "message": message }]);
        // An importer error: the pod restarts, the phase stays.
        let restarting = json!({ "phase": "ImportInProgress", "progress": "N/A", "restartCount": 2,
            "conditions": running("False", "Error", "Unable to connect to http data source: expected status code 200, got 403") });
        assert_eq!(
            data_volume_state("dv", &restarting),
            DataVolumeState::InProgress {
                phase: "ImportInProgress".into(),
                percent: 0,
                restarts: 2,
                importer_error: Some(
                    "Error: Unable to connect to http data source: expected status code 200, got 403".into()
                ),
            }
        );
        let importing = json!({ "phase": "ImportInProgress", "progress": "42.5%", "conditions": running("True", "Pod is running", "") });
        assert!(matches!(
            data_volume_state("dv", &importing),
            DataVolumeState::InProgress { percent: 42, restarts: 0, importer_error: None, .. }
        ));
        // Fatal: a checksum mismatch fails the DataVolume.
        let mismatch = json!({ "phase": "Failed", "conditions": running("False", "ChecksumError", "checksum mismatch") });
        let DataVolumeState::Failed(failure) = data_volume_state("dv", &mismatch) else {
            panic!("not failed")
        };
        assert_eq!(failure.reason, Reason::ImportChecksumMismatch);
        assert!(failure.message.contains("dv: checksum mismatch"), "{}", failure.message);
        assert_eq!(data_volume_state("dv", &json!({ "phase": "Succeeded" })), DataVolumeState::Succeeded);
        // A volume CDI cannot even create waits for a person, not for ever.
        let invalid = json!({ "phase": "", "conditions": [{ "type": "Bound", "status": "False", "reason": "ErrClaimNotValid",
                              "message": "no accessMode specified in StorageProfile local-path" }] });
        let DataVolumeState::Failed(failure) = data_volume_state("dv", &invalid) else {
            panic!("not failed")
        };
        assert_eq!(failure.class, crate::machine::FailureClass::NeedsHuman);
        assert!(failure.message.contains("no accessMode specified"), "{}", failure.message);
        assert!(matches!(data_volume_state("dv", &Value::Null), DataVolumeState::InProgress { .. }));
    }
}
