//! The real `Cluster` and `Prober` adapters: CDI DataVolumes, the KubeVirt
//! VirtualMachine and its VMI, through the Kubernetes API.

use super::claims::SourceClaims;
use super::http_check::run_http_check;
use super::render;
use crate::api::Reason;
use crate::api::labels::MIGRATION_UID as LABEL_MIGRATION_UID;
use crate::api::{CheckKindRef, ValidationCheck, VirtualMachineMigration};
use crate::machine::{
    CheckResult, DataVolumeState, DestinationOccupancy, Failure, PreflightFacts, StartingFacts, VmState,
    VmiState, data_volume_name, destination_name,
};
use crate::ports::kube_errors::{classify, is_not_found};
use crate::ports::{Cluster, ImportAccess, Prober};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

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
}

impl KubeCluster {
    /// `claims_namespace` holds the source-VM claims (the controller's own namespace).
    pub fn new(client: Client, claims_namespace: &str) -> KubeCluster {
        KubeCluster { claims: SourceClaims::new(client.clone(), claims_namespace), client }
    }

    fn dynamic(&self, vmm: &VirtualMachineMigration, ar: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &vmm.spec.destination.namespace, ar)
    }

    fn vm_name(vmm: &VirtualMachineMigration) -> String {
        destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()).to_owned()
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
        let obj: DynamicObject = serde_json::from_value(body)
            .map_err(|e| Failure::terminal(Reason::RenderError, e.to_string()))?;
        match self
            .dynamic(vmm, ar)
            .create(&PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() }, &obj)
            .await
        {
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
        let obj: DynamicObject = serde_json::from_value(body)
            .map_err(|e| Failure::terminal(Reason::RenderError, e.to_string()))?;
        let name = obj.name_any();
        self.dynamic(vmm, ar)
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&obj))
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
                match self.dynamic(vmm, ar).delete(name, &DeleteParams::background()).await {
                    Ok(_) => Ok(()),
                    Err(e) if is_not_found(&e) => Ok(()),
                    Err(e) => Err(classify(&format!("deleting {} {name}", ar.kind), e)),
                }
            }
            _ => Ok(()),
        }
    }

    /// Deletes the import Secrets and CA ConfigMaps of every disk.
    async fn delete_import_access(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        for disk in 0..disk_count(vmm) {
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
        let source_claimed_by = self.claims.claim(vmm).await?;
        Ok(PreflightFacts {
            storage_class_exists,
            destination_namespace_exists,
            destination_vm,
            destination_refused: None,
            source_claimed_by,
        })
    }

    async fn release_source(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.claims.release(vmm).await
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
        let status = dv.data.get("status").cloned().unwrap_or(Value::Null);
        let phase = status.get("phase").and_then(Value::as_str).unwrap_or("Pending").to_owned();
        Ok(match phase.as_str() {
            "Succeeded" => DataVolumeState::Succeeded,
            "Failed" => {
                // CDI puts the importer's error on the Running condition.
                let conditions =
                    status.get("conditions").and_then(Value::as_array).cloned().unwrap_or_default();
                let message = conditions
                    .iter()
                    .find(|c| c["type"] == "Running")
                    .into_iter()
                    .chain(conditions.iter())
                    .find_map(|c| c.get("message").and_then(Value::as_str).filter(|m| !m.is_empty()))
                    .unwrap_or("the import failed")
                    .to_owned();
                DataVolumeState::Failed(Failure::retryable(
                    Reason::ImportFailed,
                    format!("DataVolume {name}: {message}"),
                ))
            }
            _ => DataVolumeState::InProgress {
                percent: percent(status.get("progress").and_then(Value::as_str)),
                phase,
            },
        })
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
        Ok(if render::contains(&live, &want) { VmState::Matching { uid } } else { VmState::Drifted { uid } })
    }

    async fn create_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.create(vmm, &virtual_machine_resource(), render::virtual_machine(vmm)).await
    }

    async fn update_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let name = Self::vm_name(vmm);
        let wanted = render::virtual_machine(vmm);
        let patch = json!({ "spec": { "template": wanted["spec"]["template"].clone() } });
        self.dynamic(vmm, &virtual_machine_resource())
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("updating VirtualMachine {name}"), e))
    }

    async fn starting(&self, vmm: &VirtualMachineMigration) -> Result<StartingFacts, Failure> {
        let name = Self::vm_name(vmm);
        let wanted = serde_json::to_value(vmm.spec.destination.run_strategy).unwrap_or(Value::Null);
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
                    ("Failed", _) => {
                        VmiState::Failed(Failure::retryable(Reason::VMIFailed, format!("VMI {name} failed")))
                    }
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

    async fn set_run_strategy(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let name = Self::vm_name(vmm);
        let patch = json!({ "spec": { "runStrategy": vmm.spec.destination.run_strategy } });
        self.dynamic(vmm, &virtual_machine_resource())
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| classify(&format!("setting runStrategy on {name}"), e))
    }

    async fn delete_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.delete_if_ours(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await?;
        for disk in 0..disk_count(vmm) {
            self.delete_data_volume(vmm, disk).await?;
        }
        self.delete_import_access(vmm).await
    }

    async fn release_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.release(vmm, &virtual_machine_resource(), &Self::vm_name(vmm)).await?;
        for disk in 0..disk_count(vmm) {
            self.release(vmm, &data_volume_resource(), &Self::dv_name(vmm, disk)).await?;
        }
        // The imports are done: their credentials and CA go, never released.
        self.delete_import_access(vmm).await
    }
}

fn disk_count(vmm: &VirtualMachineMigration) -> usize {
    let status = vmm.status.as_ref();
    let inventory = status.and_then(|s| s.source_inventory.as_ref()).map(|i| i.disks.len()).unwrap_or(0);
    inventory.max(status.map(|s| s.disks.len()).unwrap_or(0))
}

/// Probes through the Kubernetes API: the VMI's guest agent and IP address.
/// HTTP checks through a Service are not implemented yet and report "not yet".
#[derive(Clone)]
pub struct KubeProber {
    client: Client,
}

impl KubeProber {
    pub fn new(client: Client) -> KubeProber {
        KubeProber { client }
    }
}

#[async_trait]
impl Prober for KubeProber {
    async fn check(&self, vmm: &VirtualMachineMigration, check: &ValidationCheck) -> CheckResult {
        let name = destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default());
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &vmm.spec.destination.namespace,
            &virtual_machine_instance_resource(),
        );
        let vmi = match api.get_opt(name).await {
            Ok(Some(vmi)) => vmi,
            Ok(None) => return CheckResult::NotYet { message: "the VMI does not exist yet".into() },
            Err(e) => return CheckResult::NotYet { message: format!("reading the VMI: {e}") },
        };
        let status = vmi.data.get("status").cloned().unwrap_or(Value::Null);
        match check.kind() {
            Some(CheckKindRef::GuestAgent) => {
                let connected = status["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| c["type"] == "AgentConnected" && c["status"] == "True")
                });
                if connected {
                    CheckResult::Pass { message: "the guest agent is connected".into() }
                } else {
                    CheckResult::NotYet { message: "the guest agent is not connected yet".into() }
                }
            }
            Some(CheckKindRef::Ip) => {
                let ip = status["interfaces"].as_array().and_then(|is| {
                    is.iter()
                        .find_map(|i| i["ipAddress"].as_str().filter(|s| !s.is_empty()).map(str::to_owned))
                });
                match ip {
                    Some(ip) => CheckResult::Pass { message: format!("the VMI reports {ip}") },
                    None => CheckResult::NotYet { message: "the VMI reports no IP address yet".into() },
                }
            }
            Some(CheckKindRef::Http(http)) => {
                run_http_check(&self.client, &vmm.spec.destination.namespace, http, &vmi_addresses(&status))
                    .await
            }
            None => CheckResult::Wrong { message: "the check sets none of http, guestAgent, ip".into() },
        }
    }
}

/// Every address the VMI reports on its interfaces (`ipAddress` and
/// `ipAddresses`): the only ones an `http` check may talk to.
fn vmi_addresses(status: &Value) -> Vec<std::net::IpAddr> {
    let mut addresses = Vec::new();
    for interface in status["interfaces"].as_array().into_iter().flatten() {
        let listed = interface["ipAddresses"].as_array().into_iter().flatten().filter_map(Value::as_str);
        for text in interface["ipAddress"].as_str().into_iter().chain(listed) {
            if let Ok(ip) = text.parse()
                && !addresses.contains(&ip)
            {
                addresses.push(ip);
            }
        }
    }
    addresses
}
