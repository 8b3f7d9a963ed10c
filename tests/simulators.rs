//! The KubeVirt simulator of the harness, exercised directly against the
//! real kube-apiserver and KubeVirt's own definitions: what it writes must be
//! accepted there and must look like what virt-controller and virt-handler
//! write. (CDI is not simulated: real CDI runs on the test node.)

use crate::support::{KubeEnv, kubevirt_sim, test_namespace};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vmmigrate::api::VirtualMachineMigration;
use vmmigrate::destination::cluster::{
    KubeCluster, virtual_machine_instance_resource, virtual_machine_resource,
};
use vmmigrate::destination::probe::KubeProber;
use vmmigrate::machine::{CheckResult, VmiState};
use vmmigrate::ports::{Cluster, Prober};

const WAIT: Duration = Duration::from_secs(60);

/// Polls `check` every 50 ms until it yields a value, or fails after `WAIT`.
async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {WAIT:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn condition<'a>(obj: &'a Value, type_: &str) -> &'a Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

fn migration(ns: &str) -> VirtualMachineMigration {
    let mut body = crate::support::sim_migration_json(ns);
    let spec = body["spec"].as_object_mut().expect("spec");
    spec.remove("powerOffPolicy");
    spec.remove("strategy");
    serde_json::from_value(body).expect("migration")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_simulator_reports_macs_ip_and_agent_and_can_fail_scheduling() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-kubevirt").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let kv = &sims.control.kubevirt;
    *kv.guest_os_info.lock().unwrap() = Some(json!({"id": "debian", "name": "Debian GNU/Linux"}));
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &virtual_machine_resource());
    let vmis: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &virtual_machine_instance_resource());
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "web-01", "namespace": ns},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {"labels": {"kubevirt.io/domain": "web-01"}},
                "spec": {
                    "domain": {"devices": {"interfaces": [
                        {"name": "nic-0", "model": "virtio", "macAddress": "00:50:56:aa:bb:01", "masquerade": {}},
                        {"name": "nic-1", "model": "e1000", "macAddress": "00:50:56:aa:bb:02", "bridge": {}},
                    ]}},
                    "networks": [{"name": "nic-0", "pod": {}}, {"name": "nic-1", "multus": {"networkName": "lan"}}],
                }
            }
        }
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();

    let vmi = wait_for("a Running VMI", async || {
        vmis.get_opt("web-01").await.ok().flatten().filter(|v| v.data["status"]["phase"] == "Running")
    })
    .await;
    assert_eq!(vmi.labels().get("kubevirt.io/domain").map(String::as_str), Some("web-01"));
    assert_eq!(vmi.owner_references()[0].kind, "VirtualMachine");
    let interfaces = vmi.data["status"]["interfaces"].as_array().unwrap();
    let summary: Vec<_> = interfaces.iter().map(|i| (&i["name"], &i["mac"], &i["ipAddress"])).collect();
    assert_eq!(
        summary,
        [
            (&json!("nic-0"), &json!("00:50:56:aa:bb:01"), &json!("10.0.2.2")),
            (&json!("nic-1"), &json!("00:50:56:aa:bb:02"), &Value::Null),
        ]
    );
    assert_eq!(condition(&vmi.data, "AgentConnected")["status"], "True");
    assert_eq!(vmi.data["status"]["guestOSInfo"]["id"], "debian");
    // The VM's status follows its VMI's in a second write: wait for it, as a client of KubeVirt would.
    wait_for("the VM to show Running", async || {
        let vm = vms.get("web-01").await.ok()?;
        (vm.data["status"]["printableStatus"] == "Running").then_some(())
    })
    .await;

    // The controller's adapters read what the simulator wrote.
    let vmm = migration(&ns);
    let prober = KubeProber::new(client.clone());
    let results: Vec<CheckResult> = {
        let mut results = Vec::new();
        for check in &vmm.spec.validation.checks {
            results.push(prober.check(&vmm, check).await);
        }
        results
    };
    assert!(results.iter().all(|r| matches!(r, CheckResult::Pass { .. })), "{results:?}");

    // The agent goes away and the address changes while the guest runs.
    kv.agent_connected.store(false, Ordering::SeqCst);
    *kv.vmi_ip.lock().unwrap() = "10.0.2.15".into();
    let vmi = wait_for("the agent to disconnect", async || {
        let vmi = vmis.get("web-01").await.ok()?;
        condition(&vmi.data, "AgentConnected").is_null().then_some(vmi)
    })
    .await;
    assert_eq!(vmi.data["status"]["interfaces"][0]["ipAddress"], "10.0.2.15", "the pod network's address");
    assert!(vmi.data["status"].get("guestOSInfo").is_none());
    let agent = prober.check(&vmm, &vmm.spec.validation.checks[0]).await;
    assert!(matches!(agent, CheckResult::NotYet { .. }), "{agent:?}");

    // Halted: the VMI goes. Started again, it cannot be scheduled.
    let halt = json!({"spec": {"runStrategy": "Halted"}});
    vms.patch("web-01", &PatchParams::default(), &Patch::Merge(&halt)).await.unwrap();
    wait_for("the VMI to be deleted", async || {
        matches!(vmis.get_opt("web-01").await, Ok(None)).then_some(())
    })
    .await;
    kv.fail_scheduling.store(1, Ordering::SeqCst);
    let start = json!({"spec": {"runStrategy": "Always"}});
    vms.patch("web-01", &PatchParams::default(), &Patch::Merge(&start)).await.unwrap();
    let vmi = wait_for("an unschedulable VMI", async || {
        let vmi = vmis.get_opt("web-01").await.ok().flatten()?;
        (condition(&vmi.data, "PodScheduled")["reason"] == "Unschedulable").then_some(vmi)
    })
    .await;
    assert_eq!(vmi.data["status"]["phase"], "Scheduling");
    assert_eq!(condition(&vmi.data, "PodScheduled")["message"], kubevirt_sim::UNSCHEDULABLE_MESSAGE);
    assert_eq!(kv.fail_scheduling.load(Ordering::SeqCst), 0);
    wait_for("the VM to show ErrorUnschedulable", async || {
        let vm = vms.get("web-01").await.ok()?;
        (vm.data["status"]["printableStatus"] == "ErrorUnschedulable").then_some(())
    })
    .await;
    let facts = KubeCluster::new(client.clone(), &ns).starting(&vmm).await.unwrap();
    match facts.vmi {
        VmiState::Failed(failure) => {
            assert_eq!(failure.reason, "Unschedulable");
            assert!(failure.message.contains("Insufficient memory"), "{}", failure.message);
        }
        other => panic!("the controller does not see an unschedulable VMI: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_simulator_keeps_a_vmi_pending_until_its_data_volumes_succeed_as_virt_controller_does() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-dvwait").await;
    let _sims = kubevirt_sim::start(client.clone(), &ns);
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &virtual_machine_resource());
    let vmis: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &virtual_machine_instance_resource());
    // The VM names a DataVolume that has not been imported (here: not even made).
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "web-02", "namespace": ns},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {"labels": {"kubevirt.io/domain": "web-02"}},
                "spec": {
                    "domain": {"devices": {"disks": [{"name": "disk-0", "disk": {"bus": "virtio"}}]}},
                    "volumes": [{"name": "disk-0", "dataVolume": {"name": "web-02-disk-0"}}],
                }
            }
        }
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let vmi = wait_for("a VMI waiting for its volumes", async || {
        vmis.get_opt("web-02").await.ok().flatten().filter(|v| !v.data["status"]["phase"].is_null())
    })
    .await;
    assert_eq!(vmi.data["status"]["phase"], "Pending", "never scheduled before its DataVolumes: {vmi:?}");
    let ready = condition(&vmi.data, "DataVolumesReady");
    assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("False"), Some("NotReady")));
    let vm = wait_for("the VM Provisioning", async || {
        vms.get_opt("web-02")
            .await
            .ok()
            .flatten()
            .filter(|v| v.data["status"]["printableStatus"] == "Provisioning")
    })
    .await;
    assert_eq!(vm.data["status"]["ready"], false);
    // A controller asking for the start sees it as KubeVirt would show it.
    let mut migration = migration(&ns);
    migration.spec.destination.name = Some("web-02".into());
    let facts = KubeCluster::new(client.clone(), &ns).starting(&migration).await.expect("starting");
    assert!(matches!(facts.vmi, VmiState::Waiting { .. }), "{:?}", facts.vmi);
}
