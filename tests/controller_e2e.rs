//! The controller end to end against the real kube-apiserver: the real
//! kube-runtime glue, the real Kubernetes `Cluster` adapter (DataVolumes and
//! VirtualMachines are real objects in the API server), real CDI importing
//! what the in-memory ESXi/disk world (`support::sim`) stages through the
//! real staging server, and the KubeVirt simulator.

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use vmmigrate::api::Reason;
use vmmigrate::api::{Phase, RETRY_ANNOTATION, VirtualMachineMigration, condition};
use vmmigrate::controller::reconciler::{self, ControllerConfig, FINALIZER};
use vmmigrate::destination::cluster::{data_volume_resource, virtual_machine_resource};
use vmmigrate::ports::Adapters;

/// Real CDI imports in these tests: room for a loaded two-core machine.
const WAIT: Duration = Duration::from_secs(300);

struct Harness {
    client: Client,
    ns: String,
    world: Arc<SimWorld>,
    api: Api<VirtualMachineMigration>,
    _sims: kubevirt_sim::Simulators,
    _staging: crate::support::SimStaging,
    controller: Option<tokio::task::JoinHandle<()>>,
    interrupt: Option<reconciler::Interrupt>,
}

impl Harness {
    async fn new(prefix: &str, faults: FaultPlan) -> Harness {
        let client = KubeEnv::shared().client().await;
        ensure_storage_class(&client).await;
        let ns = test_namespace(&client, prefix).await;
        let world = SimWorld::new(7, faults);
        let staging = crate::support::publish_sim_staging(&world).await;
        let sims = kubevirt_sim::start(client.clone(), &ns);
        let api = Api::namespaced(client.clone(), &ns);
        let mut h = Harness {
            client,
            ns,
            world,
            api,
            _sims: sims,
            _staging: staging,
            controller: None,
            interrupt: None,
        };
        h.start_controller();
        h
    }

    fn adapters(&self) -> Adapters {
        crate::support::sim_adapters(&self.client, &self.world, &self.ns)
    }

    fn start_controller(&mut self) {
        let config = ControllerConfig {
            namespace: Some(self.ns.clone()),
            max_requeue: Some(Duration::from_millis(200)),
            instance: "test".into(),
            interrupt: self.interrupt.clone(),
            ..Default::default()
        };
        let task = reconciler::run(self.client.clone(), self.adapters(), config, std::future::pending());
        self.controller = Some(tokio::spawn(task));
    }

    /// Kills the controller task the way a crash would, and drops the
    /// in-memory work it held; then starts a fresh one.
    async fn kill_and_restart_controller(&mut self) {
        if let Some(task) = self.controller.take() {
            task.abort();
            let _ = task.await;
        }
        self.world.crash();
        self.start_controller();
    }

    async fn create(&self, mutate: impl FnOnce(&mut serde_json::Value)) {
        let mut body = crate::support::sim_migration_json(&self.ns);
        mutate(&mut body);
        let vmm: VirtualMachineMigration = serde_json::from_value(body).expect("manifest");
        self.api.create(&PostParams::default(), &vmm).await.expect("create migration");
    }

    async fn get(&self) -> VirtualMachineMigration {
        self.api.get("web-01").await.expect("get migration")
    }

    async fn wait_for(
        &self,
        what: &str,
        pred: impl Fn(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let vmm = self.get().await;
            if pred(&vmm) {
                return vmm;
            }
            if tokio::time::Instant::now() > deadline {
                panic!("timed out waiting for {what}; status: {:#?}", vmm.status);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for `phase`; for a terminal phase also for its finishing work.
    async fn wait_phase(&self, phase: Phase) -> VirtualMachineMigration {
        self.wait_for(&format!("phase {phase}"), |v| {
            phase_of(v) == phase
                && (!phase.is_terminal()
                    || v.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some()))
        })
        .await
    }

    async fn count(&self, ar: &kube::core::ApiResource) -> Vec<DynamicObject> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.ns, ar);
        api.list(&ListParams::default().labels("migration.platform.example/migration=web-01"))
            .await
            .unwrap()
            .items
    }
}

/// The API server's table view, as `kubectl get vmm` prints it: (column names, first row cells).
async fn table(client: &Client, ns: &str) -> (Vec<String>, Vec<serde_json::Value>) {
    let req = http::Request::get(format!(
        "/apis/migration.platform.example/v1alpha1/namespaces/{ns}/virtualmachinemigrations"
    ))
    .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
    .body(Vec::new())
    .unwrap();
    let text = client.request_text(req).await.expect("table");
    let table: serde_json::Value = serde_json::from_str(&text).unwrap();
    let columns = table["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    let cells = table["rows"][0]["cells"].as_array().cloned().unwrap_or_default();
    (columns, cells)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_reaches_completed_and_kubectl_shows_phase_and_progress() {
    let h = Harness::new("e2e-happy", FaultPlan { hold_copies: true, ..Default::default() }).await;
    h.create(|_| {}).await;
    // Caught mid-copy: the printer columns show the phase and the progress.
    let running = h
        .wait_for("copy progress", |v| {
            phase_of(v) == Phase::Preparing && v.status.as_ref().and_then(|s| s.progress.as_ref()).is_some()
        })
        .await;
    let (columns, cells) = table(&h.client, &h.ns).await;
    let col = |name: &str| columns.iter().position(|c| c == name).unwrap_or_else(|| panic!("column {name}"));
    assert_eq!(cells[col("Phase")], "Preparing");
    let percent = running.status.unwrap().progress.unwrap().percent;
    assert_eq!(cells[col("Progress")], json!(percent));
    eprintln!("kubectl get vmm (mid-copy): {columns:?} {cells:?}");
    h.world.release_copies();

    let done = h.wait_phase(Phase::Completed).await;
    let status = done.status.clone().unwrap();
    assert!(done.finalizers().contains(&FINALIZER.to_owned()));
    // Every disk went end to end with one checksum: source, artifact, import.
    let source = h.world.source_sha();
    for (i, disk) in status.disks.iter().enumerate() {
        assert_eq!(disk.source_sha256.as_deref(), Some(source[i].as_str()));
        assert_eq!(disk.artifact_sha256, disk.source_sha256);
        assert_eq!(disk.data_volume_name.as_deref(), Some(format!("web-01-disk-{i}").as_str()));
    }
    // Real CDI checked each download against the artifact's sha256.
    for (dv, disk) in h.count(&data_volume_resource()).await.iter().zip(&status.disks) {
        let checksum = &dv.data["spec"]["source"]["http"]["checksum"];
        assert_eq!(checksum, &json!(format!("sha256:{}", disk.artifact_sha256.clone().unwrap())));
        assert_eq!(dv.data["status"]["phase"], "Succeeded");
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::CdiChecksum));
    }
    for c in [condition::READY, condition::GUEST_READY, condition::VM_STARTED, condition::DISK_IMPORTED] {
        let cond = status.conditions.iter().find(|x| x.type_ == c).unwrap();
        assert_eq!(format!("{:?}", cond.status), "True", "{c}");
        assert_eq!(cond.observed_generation, Some(1));
    }
    assert!(status.validation_results.iter().all(|r| r.passed));
    // Real objects: two DataVolumes and one VM, released from the migration.
    let dvs = h.count(&data_volume_resource()).await;
    let vms = h.count(&virtual_machine_resource()).await;
    assert_eq!((dvs.len(), vms.len()), (2, 1));
    assert_eq!(vms[0].data["spec"]["runStrategy"], "Always");
    for obj in dvs.iter().chain(vms.iter()) {
        let owned = obj.owner_references().iter().any(|r| Some(&r.uid) == done.metadata.uid.as_ref());
        assert!(!owned, "{} still owned by the migration", obj.name_any());
    }
    let (_, cells) = table(&h.client, &h.ns).await;
    assert_eq!(cells[1], "Completed");
    let (.., leftovers) = h.world.destination_summary();
    assert!(!leftovers, "staging cleaned after Completed");
    // Events with stable reasons were published on the migration.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(h.client.clone(), &h.ns);
    let reasons: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    for reason in ["Discovering", "SourcePoweredOff", "Importing", "MigrationSucceeded"] {
        assert!(reasons.iter().any(|r| r == reason), "no {reason} event in {reasons:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_killed_at_the_start_of_every_phase_still_completes_without_duplicates() {
    let mut h = Harness::new("e2e-kill", FaultPlan::default()).await;
    // The first reconcile of every phase dies right after observing; the test
    // then kills the controller task and starts a new one.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let killed = Arc::new(std::sync::Mutex::new(Vec::<Phase>::new()));
    let seen = killed.clone();
    h.interrupt = Some(Arc::new(move |phase, _checkpoint| {
        let mut seen = seen.lock().unwrap();
        if seen.contains(&phase) {
            return false;
        }
        seen.push(phase);
        let _ = tx.send(phase);
        true
    }));
    h.kill_and_restart_controller().await;
    // Every DataVolume and VirtualMachine ever created, however short-lived
    // (a watch sees each).
    let dvs = Api::<DynamicObject>::namespaced_with(h.client.clone(), &h.ns, &data_volume_resource());
    let vms = Api::<DynamicObject>::namespaced_with(h.client.clone(), &h.ns, &virtual_machine_resource());
    let (dvs_ever, dv_watch) = crate::support::migration::watch_uids(dvs);
    let (vms_ever, vm_watch) = crate::support::migration::watch_uids(vms);
    h.create(|_| {}).await;
    let mut dv_uids = std::collections::BTreeMap::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        while let Ok(_phase) = rx.try_recv() {
            h.kill_and_restart_controller().await;
        }
        let vmm = h.get().await;
        for dv in h.count(&data_volume_resource()).await {
            let uid = dv.uid().unwrap();
            let first = dv_uids.entry(dv.name_any()).or_insert_with(|| uid.clone());
            assert_eq!(*first, uid, "DataVolume {} was recreated; status: {:#?}", dv.name_any(), vmm.status);
        }
        if phase_of(&vmm) == Phase::Completed && vmm.status.as_ref().unwrap().timestamps.cleaned_up.is_some()
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "stuck in {}; killed at {killed:?}", phase_of(&vmm));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = killed.lock().unwrap().clone();
    eprintln!("killed the controller at the start of: {seen:?}");
    // Every checkpoint of the happy path, Pending through Completed.
    let happy_path = Phase::ALL.into_iter().filter(|p| p.is_active() || *p == Phase::Completed);
    for phase in happy_path {
        assert!(seen.contains(&phase), "never killed at {phase}: {seen:?}");
    }
    assert_eq!(h.count(&data_volume_resource()).await.len(), 2);
    assert_eq!(h.count(&virtual_machine_resource()).await.len(), 1);
    assert_eq!(dvs_ever.lock().unwrap().len(), 2, "one DataVolume per disk, ever");
    assert_eq!(vms_ever.lock().unwrap().len(), 1, "one VirtualMachine, ever");
    dv_watch.abort();
    vm_watch.abort();
    assert_eq!(h.world.ledger().power_off_transitions, 1, "powered off once");
    let status = h.get().await.status.unwrap();
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, h.world.source_sha(), "every disk recorded as the source is");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_faults_recover_within_the_budget() {
    let h = Harness::new("e2e-retry", FaultPlan { fail_nth_call: Some(2), ..Default::default() }).await;
    // No importer pod may start until the first DataVolumes are given up on.
    crate::support::hold_pods(&h.client, &h.ns).await;
    h.create(|m| {
        m["spec"]["strategy"]["timeouts"]["importStallSeconds"] = json!(20);
        // A loaded node may be slow enough to stall an import again after
        // the release: that retries too, within a roomier budget.
        m["spec"]["strategy"]["retryLimit"] = json!(10);
    })
    .await;
    h.wait_for("ImportStalled", |v| {
        v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == Reason::ImportStalled))
    })
    .await;
    crate::support::release_pods(&h.client, &h.ns).await;
    let done = h.wait_phase(Phase::Completed).await;
    let errors = done.status.unwrap().errors;
    let reasons: Vec<_> = errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.reason == Reason::APIUnavailable && e.message.contains("injected failure of call 2")),
        "{errors:?}"
    );
    assert!(reasons.contains(&"ImportStalled"), "{reasons:?}");
    assert!(errors.iter().all(|e| e.retryable));
    // The stalled DataVolumes were deleted and recreated: still exactly two.
    assert_eq!(h.count(&data_volume_resource()).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_retry_budget_ends_in_failed_with_the_reason() {
    let h =
        Harness::new("e2e-budget", FaultPlan { discovery_always_fails: true, ..Default::default() }).await;
    h.create(|m| m["spec"]["strategy"]["retryLimit"] = json!(1)).await;
    let failed = h
        .wait_for("Failed and cleaned up", |v| {
            phase_of(v) == Phase::Failed && v.status.as_ref().unwrap().timestamps.cleaned_up.is_some()
        })
        .await;
    let status = failed.status.unwrap();
    let stalled = status.conditions.iter().find(|c| c.type_ == condition::STALLED).unwrap();
    assert_eq!(stalled.reason, "RetryBudgetExhausted");
    assert!(stalled.message.contains(Reason::SSHConnectFailed.as_str()), "{}", stalled.message);
    assert_eq!(h.world.ledger().power_off_transitions, 0, "never validated, never powered off");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_intervention_is_left_through_the_retry_annotation_which_is_removed() {
    let h = Harness::new("e2e-human", FaultPlan { snapshot: true, ..Default::default() }).await;
    h.create(|_| {}).await;
    let blocked = h.wait_phase(Phase::ManualInterventionRequired).await;
    let status = blocked.status.unwrap();
    assert!(status.blockers.iter().any(|b| b.reason == "SnapshotsPresent"), "{:?}", status.blockers);
    assert_eq!(h.world.ledger().power_off_transitions, 0);
    // The human deletes the snapshot on the host and asks for a retry.
    h.world.human_fixes();
    let patch = json!({"metadata": {"annotations": {RETRY_ANNOTATION: "true"}}});
    h.api.patch("web-01", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let done = h.wait_phase(Phase::Completed).await;
    assert!(!done.annotations().contains_key(RETRY_ANNOTATION), "the annotation is consumed");
    assert!(done.status.unwrap().blockers.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_migration_mid_way_runs_cleanup_and_removes_the_finalizer() {
    let h = Harness::new("e2e-delete", FaultPlan::default()).await;
    crate::support::hold_pods(&h.client, &h.ns).await;
    h.create(|m| m["spec"]["cleanup"] = json!({"onFailure": "Delete"})).await;
    h.wait_for("DataVolumes importing", |v| phase_of(v) == Phase::Importing).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.count(&data_volume_resource()).await.len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "DataVolumes never appeared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.api.delete("web-01", &DeleteParams::default()).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.api.get_opt("web-01").await.unwrap().is_some() {
        assert!(tokio::time::Instant::now() < deadline, "the finalizer was never removed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(h.count(&data_volume_resource()).await.is_empty(), "DataVolumes deleted per cleanup.onFailure");
    let (.., leftovers) = h.world.destination_summary();
    assert!(!leftovers, "copied and staged data removed");
    assert_eq!(h.world.source_sha(), h.world.recorded_source_sha(), "the source was not touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_warm_migration_whose_host_cannot_be_reached_lets_go_and_says_which_snapshot_it_left() {
    let h = Harness::new("e2e-leftsnap", FaultPlan { hold_copies: true, ..FaultPlan::default() }).await;
    h.create(|m| m["spec"]["mode"] = json!("Warm")).await;
    h.wait_for("the snapshot taken and the bases copying", |v| {
        v.status.as_ref().and_then(|s| s.snapshot.as_ref()).is_some_and(|s| s.id.is_some())
    })
    .await;
    // The namespace is being deleted: the ESXi Secret went first.
    h.world.lose_credentials();
    h.api.delete("web-01", &DeleteParams::default()).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.api.get_opt("web-01").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the finalizer held the migration (and its namespace)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(h.world.snapshot_left().as_deref(), Some("vmmigrate-web-01"), "it could not be removed");
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(h.client.clone(), &h.ns);
    let deadline = tokio::time::Instant::now() + WAIT;
    let note = loop {
        let list = events.list(&ListParams::default()).await.unwrap();
        if let Some(e) = list.items.iter().find(|e| e.reason.as_deref() == Some("SnapshotLeftOnSource")) {
            break e.note.clone().unwrap_or_default();
        }
        assert!(tokio::time::Instant::now() < deadline, "no SnapshotLeftOnSource Event");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for what in ["vmmigrate-web-01", "esxi01", "vmid 7"] {
        assert!(note.contains(what), "the Event names {what}: {note}");
    }
    // The record for Git outlives the migration, in the controller's
    // namespace (here the test's): one, naming what stayed where.
    let records: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(h.client.clone(), &h.ns);
    let listed = records
        .list(&ListParams::default().labels(&format!("{}=true", vmmigrate::api::LEFT_ON_SOURCE_LABEL)))
        .await
        .unwrap();
    let left: Vec<_> =
        listed.items.iter().filter_map(vmmigrate::api::LeftOnSource::from_config_map).collect();
    assert_eq!(left.len(), 1, "{left:?}");
    let left = &left[0];
    assert_eq!(
        (left.migration.as_str(), left.snapshot.as_str(), left.vmid.as_str()),
        ("web-01", "vmmigrate-web-01", "7")
    );
    assert!(left.host.contains("esxi01") && !left.reason.is_empty() && !left.recorded.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_migration_holds_before_its_power_off_until_a_person_confirms_it() {
    let h = Harness::new("e2e-orphan", FaultPlan::default()).await;
    // Its manifest left Git before it was reconciled (as gitops marks it).
    h.create(|m| {
        m["metadata"]["annotations"] = json!({vmmigrate::api::ORPHANED_ANNOTATION: "true"});
    })
    .await;
    let held = h
        .wait_for("held before the cutover", |v| {
            v.status
                .as_ref()
                .and_then(|s| s.waiting.as_ref())
                .is_some_and(|w| w.reason == "OrphanNotConfirmed")
        })
        .await;
    assert_eq!(phase_of(&held), Phase::Validated);
    let ledger = h.world.ledger();
    assert_eq!(ledger.shutdown_requests + ledger.hard_power_offs, 0, "nothing asked of the source's power");
    assert!(held.status.unwrap().power_actions.is_empty());
    // A person confirms: the cutover goes on.
    let confirm = json!({"metadata": {"annotations": {vmmigrate::api::CONFIRM_ORPHAN_ANNOTATION: "true"}}});
    h.api.patch("web-01", &PatchParams::default(), &Patch::Merge(&confirm)).await.unwrap();
    let off = h
        .wait_for("the power-off", |v| {
            v.status.as_ref().is_some_and(|s| s.timestamps.source_powered_off.is_some())
        })
        .await;
    let ledger = h.world.ledger();
    assert_eq!(
        (ledger.shutdown_requests + ledger.hard_power_offs) as usize,
        off.status.unwrap().power_actions.len(),
        "every power call recorded"
    );
}
