//! The fleet rules end to end: the real controller against the real API
//! server, with many migrations on an in-memory fleet of ESXi hosts
//! (`support::fleet_sim`). Caps are proven from the reads that actually
//! overlapped, waves and approval from the phases the API server recorded.

use crate::support::fleet_sim::FleetSim;
use crate::support::{KubeEnv, phase_of, test_namespace};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use vmmigrate::api::{APPROVE_CUTOVER_ANNOTATION, Phase, VirtualMachineMigration, condition};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::machine::fleet::ReadCaps;

const WAIT: Duration = Duration::from_secs(180);

struct Fleet {
    ns: String,
    api: Api<VirtualMachineMigration>,
    controller: tokio::task::JoinHandle<()>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.controller.abort();
    }
}

impl Fleet {
    async fn start(prefix: &str, sim: Arc<FleetSim>, limits: ReadCaps) -> Fleet {
        let client: Client = KubeEnv::shared().client().await;
        let ns = test_namespace(&client, prefix).await;
        let config = ControllerConfig {
            namespace: Some(ns.clone()),
            max_requeue: Some(Duration::from_millis(200)),
            instance: "fleet".into(),
            limits,
            ..Default::default()
        };
        let controller =
            tokio::spawn(reconciler::run(client.clone(), sim.adapters(), config, std::future::pending()));
        Fleet { api: Api::namespaced(client, &ns), ns, controller }
    }

    async fn create(&self, name: &str, host: &str, extra: serde_json::Value) {
        let mut body = json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "source": {
                    "host": host,
                    "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                    "credentialsSecretRef": {"name": "esxi"},
                    "vm": {"name": name}
                },
                "destination": {"namespace": self.ns, "storageClassName": "local-path"},
                "networkMap": [{"source": "VM Network", "type": "Pod"}],
                // Patterned disks, not guests: nothing to convert.
                "conversion": {"guest": "none"},
                "validation": {"checks": [{"name": "agent", "guestAgent": {}}]}
            }
        });
        if let (Some(spec), Some(extra)) = (body["spec"].as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        let vmm: VirtualMachineMigration = serde_json::from_value(body).expect("manifest");
        self.api.create(&PostParams::default(), &vmm).await.expect("create migration");
    }

    async fn all(&self) -> Vec<VirtualMachineMigration> {
        self.api.list(&Default::default()).await.expect("list migrations").items
    }

    async fn get(&self, name: &str) -> VirtualMachineMigration {
        self.api.get(name).await.expect("get migration")
    }

    /// Polls until `pred` holds for `name`, handing every look to `seen`.
    async fn wait_for(
        &self,
        name: &str,
        what: &str,
        pred: impl Fn(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let vmm = self.get(name).await;
            if pred(&vmm) {
                return vmm;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {name} {what}: {:#?}",
                vmm.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn waiting_reason(vmm: &VirtualMachineMigration) -> Option<String> {
    vmm.status.as_ref()?.waiting.as_ref().map(|w| w.reason.clone())
}

/// When the migration entered `phase` (from its recorded history).
fn entered(vmm: &VirtualMachineMigration, phase: Phase) -> k8s_openapi::jiff::Timestamp {
    let status = vmm.status.as_ref().expect("status");
    status
        .history
        .iter()
        .find(|t| t.phase == phase)
        .unwrap_or_else(|| panic!("{} never entered {phase}", vmm.name_any()))
        .time
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_host_ever_reads_more_disks_than_its_cap_the_cluster_cap_holds_and_waiting_ones_say_their_place() {
    let sim = FleetSim::new(Duration::from_millis(1500), 1);
    let limits = ReadCaps { per_host: 2, hosts: [("esx-c".to_owned(), 1)].into(), cluster: Some(4) };
    let fleet = Fleet::start("fleet-caps", sim.clone(), limits).await;
    let hosts = ["esx-a", "esx-b", "esx-c"];
    for i in 0..12 {
        fleet.create(&format!("vm-{i:02}"), hosts[i % 3], json!({})).await;
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut messages = BTreeSet::new();
    loop {
        let all = fleet.all().await;
        for vmm in &all {
            if let Some(w) = vmm.status.as_ref().and_then(|s| s.waiting.as_ref()) {
                messages.insert(w.message.clone());
                let ready =
                    vmm.status.as_ref().unwrap().conditions.iter().find(|c| c.type_ == condition::READY);
                assert_eq!(
                    ready.map(|c| c.reason.as_str()),
                    Some(w.reason.as_str()),
                    "kstatus names the wait"
                );
            }
        }
        if all.len() == 12 && all.iter().all(|v| phase_of(v) == Phase::Completed) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not all Completed: {:?}",
            all.iter().map(|v| (v.name_any(), phase_of(v))).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (per_host, total) = sim.peak_reads();
    assert_eq!(sim.reads().len(), 12, "one read per disk");
    assert!(per_host["esx-a"] <= 2 && per_host["esx-b"] <= 2, "{per_host:?}");
    assert!(per_host["esx-c"] <= 1, "the override of esx-c: {per_host:?}");
    assert!(total <= 4, "the cluster cap: {total}");
    assert_eq!(total, 4, "the caps were reached, so they were what held the rest back");
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("2nd in line for esx-") || m.contains("in line for the cluster-wide cap")),
        "{messages:?}"
    );
    assert!(sim.power_offs().values().all(|&n| n == 1), "{:?}", sim.power_offs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wave_starts_after_every_earlier_wave_completed_and_a_failed_one_holds_the_next_until_removed() {
    let sim = FleetSim::new(Duration::from_millis(800), 1);
    let fleet = Fleet::start("fleet-waves", sim.clone(), ReadCaps::default()).await;
    sim.break_discovery("q1");
    fleet.create("w2", "esx-a", json!({"wave": {"plan": "p", "number": 2}})).await;
    fleet.create("w1-a", "esx-a", json!({"wave": {"plan": "p", "number": 1}})).await;
    fleet.create("w1-b", "esx-b", json!({"wave": {"plan": "p", "number": 1}})).await;
    fleet.create("q1", "esx-c", json!({"wave": {"plan": "q", "number": 1}})).await;
    fleet.create("q2", "esx-c", json!({"wave": {"plan": "q", "number": 2}})).await;

    let w2 = fleet.wait_for("w2", "Completed", |v| phase_of(v) == Phase::Completed).await;
    for first in ["w1-a", "w1-b"] {
        let done = fleet.get(first).await;
        assert!(
            entered(&w2, Phase::Preparing) >= entered(&done, Phase::Completed),
            "{first} completed after w2 started"
        );
    }
    let q2 = fleet.wait_for("q2", "held by q1", |v| waiting_reason(v).as_deref() == Some("WaveHeld")).await;
    let message = &q2.status.as_ref().unwrap().waiting.as_ref().unwrap().message;
    assert!(message.contains("q1 (ManualInterventionRequired)"), "{message}");
    assert_eq!(phase_of(&fleet.get("q1").await), Phase::ManualInterventionRequired);
    assert!(sim.reads().iter().all(|r| !r.migration.ends_with("/q2")), "a held wave reads nothing");
    assert!(
        !sim.power_offs().contains_key(&format!("{}/q2", fleet.ns))
            || sim.power_offs()[&format!("{}/q2", fleet.ns)] == 0
    );

    // Removing the failed manifest lets the next wave go.
    fleet.api.delete("q1", &DeleteParams::default()).await.expect("delete q1");
    fleet.wait_for("q2", "Completed", |v| phase_of(v) == Phase::Completed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_mode_never_powers_off_before_the_approval_annotation_and_records_it() {
    let sim = FleetSim::new(Duration::from_millis(300), 2);
    let fleet = Fleet::start("fleet-approval", sim.clone(), ReadCaps::default()).await;
    fleet.create("db", "esx-a", json!({"cutover": {"mode": "Approval"}})).await;
    let held = fleet
        .wait_for("db", "waiting for approval", |v| {
            waiting_reason(v).as_deref() == Some("WaitingForApproval")
        })
        .await;
    assert_eq!(phase_of(&held), Phase::Validated);
    let ready =
        held.status.as_ref().unwrap().conditions.iter().find(|c| c.type_ == condition::READY).unwrap();
    assert!(ready.message.contains("approve-cutover"), "{}", ready.message);
    // Looked at again while waiting, it still has not touched the source.
    tokio::task::yield_now().await;
    let again = fleet.get("db").await;
    assert_eq!(phase_of(&again), Phase::Validated);
    assert!(sim.power_offs().values().all(|&n| n == 0), "{:?}", sim.power_offs());
    assert!(sim.reads().is_empty());

    let patch = json!({"metadata": {"annotations": {APPROVE_CUTOVER_ANNOTATION: "true"}}});
    fleet.api.patch("db", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("approve");
    let done = fleet.wait_for("db", "Completed", |v| phase_of(v) == Phase::Completed).await;
    let status = done.status.unwrap();
    assert!(status.timestamps.cutover_approved.is_some());
    assert!(entered_ts(&status.history, Phase::Preparing) >= status.timestamps.cutover_approved.unwrap().0);
    assert_eq!(sim.power_offs().values().copied().collect::<Vec<_>>(), vec![1]);
    assert_eq!(sim.unapproved_power_actions(), 0, "every power action carried the approval");
    assert_eq!(sim.reads().len(), 2, "both disks read once");
}

fn entered_ts(history: &[vmmigrate::api::PhaseTransition], phase: Phase) -> k8s_openapi::jiff::Timestamp {
    history.iter().find(|t| t.phase == phase).expect("phase in history").time.0
}
