//! The reconciler's log lines while a migration runs, against the real
//! kube-apiserver and the real kube-runtime glue; CDI and KubeVirt are the
//! simulators of tests/support and ESXi, the disk store and staging are the
//! in-memory world (the same setup as controller_e2e.rs).

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{CapturedLogs, KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use kube::api::{Api, PostParams};
use serde_json::json;
use std::time::Duration;
use tracing_subscriber::EnvFilter;
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::cli::{LogFormat, log_subscriber};
use vmmigrate::controller::reconciler::{self, ControllerConfig};

/// Migrations import through real CDI: room for a loaded two-core machine.
const WAIT: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_reconcile_line_of_a_migration_names_it_in_json() {
    // The reconciler logs from kube-runtime's tasks on every worker thread:
    // only the process's global subscriber sees all of them.
    let logs = CapturedLogs::default();
    let sink = logs.clone();
    tracing::subscriber::set_global_default(log_subscriber(
        LogFormat::Json,
        EnvFilter::new("info"),
        move || sink.clone(),
    ))
    .expect("the only global subscriber of this process");

    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "logs").await;
    let world = SimWorld::new(11, FaultPlan::default());
    let _staging = crate::support::publish_sim_staging(&world).await;
    let _sims = kubevirt_sim::start(client.clone(), &ns);
    let adapters = crate::support::sim_adapters(&client, &world, &ns);
    let config = ControllerConfig {
        namespace: Some(ns.clone()),
        max_requeue: Some(Duration::from_millis(200)),
        instance: "logs-test".into(),
        ..Default::default()
    };
    let controller = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));

    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let mut body = crate::support::sim_migration_json(&ns);
    body["spec"]["validation"]["checks"] = json!([{"name": "agent", "guestAgent": {}}]);
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let vmm = api.get("web-01").await.unwrap();
        if phase_of(&vmm) == Phase::Completed
            && vmm.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some())
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stuck in {}; status {:#?}",
            phase_of(&vmm),
            vmm.status
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    controller.abort();
    let _ = controller.await;

    let key = format!("{ns}/web-01");
    let reconciling: Vec<_> =
        logs.json_lines().into_iter().filter(|l| l["fields"]["message"] == "reconciling").collect();
    assert!(reconciling.iter().any(|l| l["span"]["migration"] == key.as_str()), "{reconciling:?}");
    assert!(reconciling.iter().all(|l| l["span"]["migration"].is_string()), "{reconciling:?}");
}
