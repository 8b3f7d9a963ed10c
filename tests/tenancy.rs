//! Tenancy against the real API server: one source VM is claimed by one
//! migration cluster-wide (a Lease created atomically, taken over when its
//! holder is gone, released on delete), and a migration created with kubectl
//! that names a destination namespace outside the administrator's rules is
//! refused by the controller at Validated.

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use std::time::Duration;
use vmmigrate::api::{Phase, SourceInventory, VirtualMachineMigration, VirtualMachineMigrationStatus};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::destination::cluster::KubeCluster;
use vmmigrate::machine::tenancy::DestinationRules;
use vmmigrate::objects::claims::CLAIM_LABEL;
use vmmigrate::ports::Cluster;

/// A migration of `vm` (by name) created in `ns`, with the inventory discovery
/// would record: the VM's BIOS UUID and vmid.
async fn discovered(client: &Client, ns: &str, name: &str, uuid: &str) -> VirtualMachineMigration {
    let mut body = crate::support::sim_migration_json(ns);
    body["metadata"]["name"] = name.into();
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), ns);
    let mut created = api.create(&PostParams::default(), &vmm).await.expect("create migration");
    created.status = Some(VirtualMachineMigrationStatus {
        source_inventory: Some(SourceInventory {
            vmid: "7".into(),
            bios_uuid: uuid.into(),
            ..Default::default()
        }),
        ..Default::default()
    });
    created
}

async fn claim_leases(client: &Client, ns: &str) -> Vec<Lease> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases.list(&ListParams::default().labels(&format!("{CLAIM_LABEL}=true"))).await.unwrap().items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_vm_is_claimed_by_one_migration_across_namespaces() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let claims = test_namespace(&client, "claims").await;
    let team_a = test_namespace(&client, "claim-a").await;
    let team_b = test_namespace(&client, "claim-b").await;
    let cluster = KubeCluster::new(client.clone(), &claims);
    const UUID: &str = "421b4b87-e6b7-d881-07a0-c9d221cd3c01";

    // The same VM, named differently in two teams' manifests: discovery tells.
    let first = discovered(&client, &team_a, "web", UUID).await;
    let second = discovered(&client, &team_b, "web-server-01", UUID).await;
    assert_eq!(cluster.preflight(&first).await.unwrap().source_claimed_by, None);
    assert_eq!(
        cluster.preflight(&second).await.unwrap().source_claimed_by,
        Some(format!("{team_a}/web")),
        "the second migration is refused, naming the first"
    );
    assert_eq!(cluster.preflight(&first).await.unwrap().source_claimed_by, None, "the holder again");
    assert_eq!(claim_leases(&client, &claims).await.len(), 1);

    // Two migrations validating at the same moment: exactly one holds the claim.
    const RACED: &str = "421b4b87-e6b7-d881-07a0-c9d221cd3c02";
    let c = discovered(&client, &team_a, "raced-a", RACED).await;
    let d = discovered(&client, &team_b, "raced-b", RACED).await;
    let (fc, fd) = tokio::join!(cluster.preflight(&c), cluster.preflight(&d));
    let held: Vec<bool> = [fc.unwrap(), fd.unwrap()].iter().map(|f| f.source_claimed_by.is_none()).collect();
    assert_eq!(held.iter().filter(|h| **h).count(), 1, "{held:?}");

    // Its holder deleted without its finalizer (no controller runs here): the
    // claim is stale and the second migration takes it over.
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &team_a);
    api.delete("web", &DeleteParams::default()).await.unwrap();
    let gone = async {
        while api.get_opt("web").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), gone).await.expect("migration deleted");
    assert_eq!(cluster.preflight(&second).await.unwrap().source_claimed_by, None, "taken over");
    // A released claim is gone; releasing what another holds changes nothing.
    cluster.release_source(&first).await.unwrap();
    assert_eq!(
        claim_leases(&client, &claims).await.len(),
        2,
        "the web claim (now the second's) and the raced one"
    );
    cluster.release_source(&second).await.unwrap();
    let left: Vec<String> = claim_leases(&client, &claims).await.iter().map(|l| l.name_any()).collect();
    assert_eq!(left.len(), 1, "only the raced VM's claim is left: {left:?}");
}

/// A controller on the simulated world under `rules`, watching `ns`, and a
/// migration created there with kubectl (`mutate` changes its body): no
/// rendering ran, so the controller is the last word. Returns the status it
/// stopped with (ManualInterventionRequired) and the world.
async fn stopped_by_the_controller(
    client: &kube::Client,
    ns: &str,
    rules: DestinationRules,
    mutate: impl FnOnce(&mut serde_json::Value),
) -> (vmmigrate::api::VirtualMachineMigrationStatus, std::sync::Arc<SimWorld>) {
    let world = SimWorld::new(7, FaultPlan::default());
    let _staging = crate::support::publish_sim_staging(&world).await;
    let _sims = kubevirt_sim::start(client.clone(), ns);
    let config = ControllerConfig {
        namespace: Some(ns.to_owned()),
        max_requeue: Some(Duration::from_millis(200)),
        instance: ns.to_owned(),
        destinations: rules,
        ..Default::default()
    };
    let adapters = crate::support::sim_adapters(client, &world, ns);
    let task = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), ns);
    let mut body = crate::support::sim_migration_json(ns);
    mutate(&mut body);
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &vmm).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let refused = loop {
        let vmm = api.get("web-01").await.unwrap();
        if phase_of(&vmm) == Phase::ManualInterventionRequired {
            break vmm;
        }
        assert!(tokio::time::Instant::now() < deadline, "not refused: {:#?}", vmm.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    task.abort();
    (refused.status.unwrap(), world)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_refuses_a_destination_namespace_outside_the_rules() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "tenancy").await;
    let other = test_namespace(&client, "tenancy-other").await;
    // Another namespace is allowed; kube-system never is.
    let rules = DestinationRules::parse(&[format!("{ns}={other}")]).unwrap();
    let (status, world) = stopped_by_the_controller(&client, &ns, rules, |body| {
        body["spec"]["destination"]["namespace"] = "kube-system".into();
    })
    .await;
    let blocker = status.blockers.iter().find(|b| b.reason == "DestinationNamespaceNotAllowed");
    let blocker = blocker.unwrap_or_else(|| panic!("{:?}", status.blockers));
    assert!(blocker.message.contains("\"kube-system\" is a system namespace"), "{}", blocker.message);
    assert_eq!(world.ledger().power_off_transitions, 0, "the source was not touched");
    assert_eq!(world.source_power(), vmmigrate::api::SourcePowerState::PoweredOn);
    assert!(status.disks.is_empty(), "nothing was copied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_refuses_a_network_of_a_namespace_outside_the_rules() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "tenancy-net").await;
    // A NIC on finance's NetworkAttachmentDefinition.
    let (status, world) = stopped_by_the_controller(&client, &ns, DestinationRules::default(), |body| {
        body["spec"]["networkMap"] = serde_json::json!([
            {"source": "VM Network", "type": "Pod"},
            {"source": "DMZ", "type": "Multus", "networkName": "finance/dmz"}
        ]);
    })
    .await;
    let blocker = status.blockers.iter().find(|b| b.reason == "DestinationNamespaceNotAllowed");
    let blocker = blocker.unwrap_or_else(|| panic!("{:?}", status.blockers));
    assert!(
        blocker.message.contains("network \"finance/dmz\" is in another namespace"),
        "{}",
        blocker.message
    );
    assert_eq!(world.ledger().power_off_transitions, 0, "the source was not touched");
    assert!(status.disks.is_empty(), "nothing was copied");
}
