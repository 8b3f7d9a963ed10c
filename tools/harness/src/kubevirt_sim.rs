//! Simulation of KubeVirt's controllers (virt-controller and virt-handler),
//! which do not run here yet: no guest runs under this machine's
//! paravirtual KVM, and real KubeVirt on the test node is the next step
//! (docs/testing.md). It acts on the real API server, on KubeVirt v1.8.0's
//! own definitions, the way those controllers do:
//!
//! For each VirtualMachine whose runStrategy wants it running, it creates
//! the VirtualMachineInstance (labels and spec from the template, owned by
//! the VM) and moves it through `Scheduling` to `Running`, reporting one
//! interface per template interface (name, MAC, the IP on the first, with
//! `infoSource: domain, guest-agent` as virt-handler merges them) and, while
//! the guest agent is "connected", `AgentConnected` and `guestOSInfo`; it
//! deletes the VMI when the VM is Halted. As virt-controller does, a VMI
//! whose `dataVolume` volumes are not all `Succeeded` stays `Pending` with
//! `DataVolumesReady=False` (its VM `Provisioning`) and is scheduled only
//! once they are: a controller that starts a VM before its imports end sees
//! what it would see on real KubeVirt. An unschedulable VMI looks like
//! KubeVirt shows one: phase `Scheduling` with `PodScheduled=False`, reason
//! `Unschedulable`.
//!
//! CDI is not simulated: real CDI v1.65.0 runs on the test node
//! (`crate::cdi`).
//!
//! Faults and observations go through [`SimControl`]. The simulator polls
//! (100 ms) and stops when the returned [`Simulators`] is dropped.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// The upstream kinds the simulator acts on (KubeVirt v1).
fn resource(group: &str, version: &str, kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        plural,
    )
}
fn virtual_machine_resource() -> kube::api::ApiResource {
    resource("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")
}
fn virtual_machine_instance_resource() -> kube::api::ApiResource {
    resource("kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances")
}
fn data_volume_resource() -> kube::api::ApiResource {
    resource("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes")
}

/// Whether every `dataVolume` volume of the VMI spec `spec` has succeeded
/// (virt-controller's `DataVolumesReady`).
async fn data_volumes_ready(dvs: &Api<DynamicObject>, spec: &Value) -> bool {
    let names: Vec<&str> = spec["volumes"]
        .as_array()
        .map(|vs| vs.iter().filter_map(|v| v["dataVolume"]["name"].as_str()).collect())
        .unwrap_or_default();
    for name in names {
        match dvs.get_opt(name).await {
            Ok(Some(dv)) if dv.data["status"]["phase"] == "Succeeded" => {}
            _ => return false,
        }
    }
    true
}

fn waiting_for_volumes() -> Value {
    json!({
        "phase": "Pending",
        "conditions": [{
            "type": "DataVolumesReady", "status": "False", "reason": "NotReady",
            "message": "Not all of the VMI's DVs are ready", "lastProbeTime": null, "lastTransitionTime": now(),
        }],
    })
}

const POLL: Duration = Duration::from_millis(100);
/// The message the scheduler gives for a pod that fits on no node.
pub const UNSCHEDULABLE_MESSAGE: &str = "0/1 nodes are available: 1 Insufficient memory";

/// Knobs shared with the test.
#[derive(Default)]
pub struct SimControl {
    /// The KubeVirt side's knobs.
    pub kubevirt: KubeVirtControl,
}

/// Knobs of the KubeVirt simulator.
pub struct KubeVirtControl {
    /// The next N VMIs created cannot be scheduled (insufficient memory).
    pub fail_scheduling: AtomicUsize,
    /// Whether running VMIs report the guest agent as connected.
    pub agent_connected: AtomicBool,
    /// The address running VMIs report on their first interface ("" for none).
    pub vmi_ip: Mutex<String>,
    /// `status.guestOSInfo` reported while the agent is connected.
    pub guest_os_info: Mutex<Option<Value>>,
}

impl Default for KubeVirtControl {
    fn default() -> KubeVirtControl {
        KubeVirtControl {
            fail_scheduling: AtomicUsize::new(0),
            agent_connected: AtomicBool::new(true),
            vmi_ip: Mutex::new("10.0.2.2".to_owned()),
            guest_os_info: Mutex::new(None),
        }
    }
}

/// The simulator for one namespace; aborts it when dropped.
pub struct Simulators {
    pub control: Arc<SimControl>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Simulators {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the KubeVirt simulator for one namespace (tests share one API server).
pub fn start(client: Client, namespace: &str) -> Simulators {
    let control = Arc::new(SimControl::default());
    let tasks = vec![tokio::spawn(kubevirt_loop(client, namespace.to_owned(), control.clone()))];
    Simulators { control, tasks }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now() -> Value {
    serde_json::to_value(Time(Timestamp::now())).unwrap_or(Value::Null)
}

/// Writes `status` through the status subresource (VirtualMachines) or,
/// for a kind without one (KubeVirt's VirtualMachineInstance definition has
/// none: virt-handler writes the whole object), through the object.
async fn set_status(api: &Api<DynamicObject>, name: &str, status: Value) {
    let patch = json!({ "status": status });
    let params = PatchParams::default();
    let written = if api.resource_url().ends_with("/virtualmachineinstances") {
        api.patch(name, &params, &Patch::Merge(&patch)).await
    } else {
        api.patch_status(name, &params, &Patch::Merge(&patch)).await
    };
    if let Err(e) = written {
        eprintln!("simulator: status of {name}: {e}");
    }
}

// ------------------------------------------------------------ KubeVirt

async fn kubevirt_loop(client: Client, namespace: String, control: Arc<SimControl>) {
    let vms: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &namespace, &virtual_machine_resource());
    let vmis: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &namespace, &virtual_machine_instance_resource());
    let dvs: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &data_volume_resource());
    loop {
        if let Ok(list) = vms.list(&ListParams::default()).await {
            for vm in list {
                sync_vm(&vms, &vmis, &dvs, &vm, &control.kubevirt).await;
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn sync_vm(
    vms: &Api<DynamicObject>,
    vmis: &Api<DynamicObject>,
    dvs: &Api<DynamicObject>,
    vm: &DynamicObject,
    kv: &KubeVirtControl,
) {
    let name = vm.name_any();
    let wants_running = matches!(vm.data["spec"]["runStrategy"].as_str(), Some("Always" | "RerunOnFailure"));
    let vmi = match vmis.get_opt(&name).await {
        Ok(vmi) => vmi,
        Err(_) => return,
    };
    match (wants_running, vmi) {
        (true, None) => {
            let body = json!({
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstance",
                "metadata": {
                    "name": name,
                    "namespace": vm.namespace(),
                    "labels": vm.data["spec"]["template"]["metadata"]["labels"].clone(),
                    "ownerReferences": [{
                        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": name,
                        "uid": vm.uid().unwrap_or_default(), "controller": true, "blockOwnerDeletion": true
                    }],
                },
                "spec": vm.data["spec"]["template"]["spec"].clone(),
            });
            let Ok(obj) = serde_json::from_value::<DynamicObject>(body) else { return };
            if let Err(e) = vmis.create(&PostParams::default(), &obj).await {
                // Seen again next poll; a test that waits says what was wrong.
                eprintln!("kubevirt simulator: creating VMI {name}: {e}");
                return;
            }
            if !data_volumes_ready(dvs, &vm.data["spec"]["template"]["spec"]).await {
                set_status(vmis, &name, waiting_for_volumes()).await;
                set_vm_status(vms, vm, "Provisioning", false).await;
                return;
            }
            let unschedulable = kv
                .fail_scheduling
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if unschedulable {
                let now = now();
                set_status(
                    vmis,
                    &name,
                    json!({
                        "phase": "Scheduling",
                        "conditions": [{
                            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": UNSCHEDULABLE_MESSAGE, "lastProbeTime": null, "lastTransitionTime": now,
                        }],
                    }),
                )
                .await;
                set_vm_status(vms, vm, "ErrorUnschedulable", false).await;
            } else {
                set_status(vmis, &name, json!({"phase": "Scheduling"})).await;
                set_vm_status(vms, vm, "Starting", false).await;
            }
        }
        (true, Some(vmi)) => {
            let status = &vmi.data["status"];
            let unschedulable = status["conditions"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
            });
            match status["phase"].as_str() {
                // Its volumes became ready: the launcher pod is scheduled.
                Some("Pending") if data_volumes_ready(dvs, &vmi.data["spec"]).await => {
                    set_status(vmis, &name, json!({"phase": "Scheduling"})).await;
                    set_vm_status(vms, vm, "Starting", false).await;
                }
                Some("Scheduling") if !unschedulable => {
                    set_status(vmis, &name, running_status(&vmi, kv)).await;
                    set_vm_status(vms, vm, "Running", true).await;
                }
                // Knobs (agent, IP) may change while the guest runs.
                Some("Running") => {
                    let want = running_status(&vmi, kv);
                    let differs = want.as_object().is_some_and(|fields| {
                        fields.iter().any(|(k, v)| status.get(k).unwrap_or(&Value::Null) != v)
                    });
                    if differs {
                        set_status(vmis, &name, want).await;
                    }
                }
                _ => {}
            }
        }
        (false, Some(_)) => {
            let _ = vmis.delete(&name, &DeleteParams::default()).await;
            set_vm_status(vms, vm, "Stopped", false).await;
        }
        (false, None) => {
            if vm.data["status"]["printableStatus"] != "Stopped" {
                set_vm_status(vms, vm, "Stopped", false).await;
            }
        }
    }
}

async fn set_vm_status(vms: &Api<DynamicObject>, vm: &DynamicObject, printable: &str, ready: bool) {
    let status = json!({
        "printableStatus": printable,
        "ready": ready,
        "created": printable != "Stopped",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                        "lastProbeTime": null, "lastTransitionTime": now()}],
    });
    set_status(vms, &vm.name_any(), status).await;
}

/// What virt-handler reports for a running guest, given the knobs.
fn running_status(vmi: &DynamicObject, kv: &KubeVirtControl) -> Value {
    let agent = kv.agent_connected.load(Ordering::SeqCst);
    let ip = lock(&kv.vmi_ip).clone();
    let template =
        vmi.data["spec"]["domain"]["devices"]["interfaces"].as_array().cloned().unwrap_or_default();
    // KubeVirt attaches a pod-network interface named "default" when none is declared.
    let template =
        if template.is_empty() { vec![json!({"name": "default", "masquerade": {}})] } else { template };
    let uid = vmi.uid().unwrap_or_default();
    let interfaces: Vec<Value> = template
        .iter()
        .enumerate()
        .map(|(i, iface)| {
            let name = iface["name"].as_str().unwrap_or_default();
            let mac =
                iface["macAddress"].as_str().map(str::to_owned).unwrap_or_else(|| generated_mac(&uid, i));
            let mut entry = json!({
                "name": name,
                "mac": mac,
                "infoSource": if agent { "domain, guest-agent" } else { "domain" },
            });
            // Without the agent only the pod network's (masquerade) address is known.
            let known = agent || iface.get("masquerade").is_some();
            if i == 0 && known && !ip.is_empty() {
                entry["ipAddress"] = json!(ip);
                entry["ipAddresses"] = json!([ip]);
            }
            if agent {
                entry["interfaceName"] = json!(format!("eth{i}"));
            }
            entry
        })
        .collect();
    let mut conditions = vec![json!({"type": "Ready", "status": "True", "lastProbeTime": null})];
    if agent {
        conditions.push(json!({"type": "AgentConnected", "status": "True", "lastProbeTime": null}));
    }
    let guest_os_info =
        if agent { lock(&kv.guest_os_info).clone().unwrap_or(Value::Null) } else { Value::Null };
    json!({
        "phase": "Running",
        "nodeName": "sim-node-0",
        "conditions": conditions,
        "interfaces": interfaces,
        "guestOSInfo": guest_os_info,
    })
}

/// A libvirt-style MAC (52:54:00 prefix) for an interface declared without one.
fn generated_mac(uid: &str, index: usize) -> String {
    let digest = Sha256::digest(format!("{uid}/{index}").as_bytes());
    format!("52:54:00:{:02x}:{:02x}:{:02x}", digest[0], digest[1], digest[2])
}
