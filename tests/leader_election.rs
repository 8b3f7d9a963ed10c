//! Leader election against the real kube-apiserver: real Leases, the real
//! kube-runtime controller and the real Kubernetes `Cluster` adapter.
//! Simulated, because they cannot run here: CDI and KubeVirt (tests/support)
//! and the ESXi host, disk copies and staging (`SimWorld`). Two controller
//! instances share one `SimWorld`, like two pods talking to the same ESXi host.

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, kubevirt_sim, test_namespace};
use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use vmmigrate::api::{Phase, VirtualMachineMigrationStatus};
use vmmigrate::api::{SourceInventory, ValidationCheck, VirtualMachineMigration};
use vmmigrate::controller::leader::{LeaderElector, LeaderError, LeaseConfig};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::destination::cluster::{data_volume_resource, virtual_machine_resource};
use vmmigrate::machine::{
    ArtifactState, CheckResult, CopyState, DataVolumeState, Failure, PreflightFacts, StartingFacts, VmState,
};
use vmmigrate::metrics::Metrics;
use vmmigrate::ports::{
    Adapters, Cluster, Converter, DiskStore, EsxiHost, ImportAccess, PowerObservation, Prober, Staging,
};

/// Migrations import through real CDI: room for a loaded two-core machine.
const WAIT: Duration = Duration::from_secs(300);

/// The timing of the handover test: a 3 s lease renewed every 500 ms.
fn short_lease(ns: &str, name: &str, identity: &str) -> LeaseConfig {
    LeaseConfig {
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(500),
        ..LeaseConfig::new(ns, name, identity)
    }
}

/// Polls `probe` every 20 ms until it yields a value; panics after `limit`.
async fn poll<T, F: Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut probe: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn lease_holder(leases: &Api<Lease>, name: &str) -> Option<String> {
    let lease = leases.get_opt(name).await.expect("read lease")?;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// `(acquireTime, renewTime)` as the API server stored them: the record of a
/// handover, read instead of timing it with a clock.
async fn lease_times(leases: &Api<Lease>, name: &str) -> (Timestamp, Timestamp) {
    let spec = leases.get(name).await.expect("read lease").spec.expect("lease spec");
    let time = |t: Option<MicroTime>| t.map(|t| t.0).expect("lease time");
    (time(spec.acquire_time), time(spec.renew_time))
}

async fn lease_transitions(leases: &Api<Lease>, name: &str) -> Option<i32> {
    leases.get(name).await.expect("read lease").spec?.lease_transitions
}

/// Every adapter of one instance, counting each call before passing it on.
struct Counting {
    calls: Arc<AtomicU64>,
    inner: Adapters,
}

impl Counting {
    fn tick(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

type Vmm = VirtualMachineMigration;

#[async_trait]
impl EsxiHost for Counting {
    async fn discover(&self, vmm: &Vmm) -> Result<SourceInventory, Failure> {
        self.tick();
        self.inner.esxi.discover(vmm).await
    }
    async fn power(&self, vmm: &Vmm) -> Result<PowerObservation, Failure> {
        self.tick();
        self.inner.esxi.power(vmm).await
    }
    async fn extent_stats(&self, vmm: &Vmm, paths: &[String]) -> Result<Vec<String>, Failure> {
        self.tick();
        self.inner.esxi.extent_stats(vmm, paths).await
    }
    async fn request_shutdown(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.esxi.request_shutdown(vmm).await
    }
    async fn power_off(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.esxi.power_off(vmm).await
    }
}

#[async_trait]
impl DiskStore for Counting {
    async fn copy_state(&self, vmm: &Vmm, disk: usize) -> CopyState {
        self.tick();
        self.inner.disks.copy_state(vmm, disk).await
    }
    async fn start_copy(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.disks.start_copy(vmm, disk).await
    }
    async fn discard_copy(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.disks.discard_copy(vmm, disk).await
    }
    async fn remove_all(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.disks.remove_all(vmm).await
    }
}

#[async_trait]
impl Converter for Counting {
    fn guest_converter(&self) -> vmmigrate::machine::GuestConverterFacts {
        self.inner.converter.guest_converter()
    }
    async fn artifact_state(&self, vmm: &Vmm, disk: usize) -> ArtifactState {
        self.tick();
        self.inner.converter.artifact_state(vmm, disk).await
    }
    async fn start_conversion(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.converter.start_conversion(vmm, disk).await
    }
    async fn discard_artifact(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.converter.discard_artifact(vmm, disk).await
    }
}

#[async_trait]
impl Staging for Counting {
    async fn staged_url(&self, vmm: &Vmm, disk: usize, sha256: &str) -> Result<Option<String>, Failure> {
        self.tick();
        self.inner.staging.staged_url(vmm, disk, sha256).await
    }
    async fn stage(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.staging.stage(vmm, disk).await
    }
    async fn import_access(&self, vmm: &Vmm, disk: usize) -> Result<ImportAccess, Failure> {
        self.tick();
        self.inner.staging.import_access(vmm, disk).await
    }
    async fn remove_all(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.staging.remove_all(vmm).await
    }
}

#[async_trait]
impl Cluster for Counting {
    async fn record_left_on_source(&self, left: &vmmigrate::api::LeftOnSource) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.record_left_on_source(left).await
    }
    async fn cdi_verifies_checksum(&self) -> Result<bool, Failure> {
        self.tick();
        self.inner.cluster.cdi_verifies_checksum().await
    }
    async fn import_check(
        &self,
        vmm: &Vmm,
        disk: usize,
    ) -> Result<Option<vmmigrate::machine::VolumeCheck>, Failure> {
        self.tick();
        self.inner.cluster.import_check(vmm, disk).await
    }
    async fn preflight(&self, vmm: &Vmm) -> Result<PreflightFacts, Failure> {
        self.tick();
        self.inner.cluster.preflight(vmm).await
    }
    async fn data_volume(&self, vmm: &Vmm, disk: usize) -> Result<DataVolumeState, Failure> {
        self.tick();
        self.inner.cluster.data_volume(vmm, disk).await
    }
    async fn create_data_volume(&self, vmm: &Vmm, disk: usize, access: &ImportAccess) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.create_data_volume(vmm, disk, access).await
    }
    async fn delete_data_volume(&self, vmm: &Vmm, disk: usize) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.delete_data_volume(vmm, disk).await
    }
    async fn vm(&self, vmm: &Vmm) -> Result<VmState, Failure> {
        self.tick();
        self.inner.cluster.vm(vmm).await
    }
    async fn create_vm(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.create_vm(vmm).await
    }
    async fn update_vm(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.update_vm(vmm).await
    }
    async fn starting(&self, vmm: &Vmm) -> Result<StartingFacts, Failure> {
        self.tick();
        self.inner.cluster.starting(vmm).await
    }
    async fn set_run_strategy(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.set_run_strategy(vmm).await
    }
    async fn delete_destination(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.delete_destination(vmm).await
    }
    async fn release_destination(&self, vmm: &Vmm) -> Result<(), Failure> {
        self.tick();
        self.inner.cluster.release_destination(vmm).await
    }
}

#[async_trait]
impl Prober for Counting {
    async fn check(&self, vmm: &Vmm, check: &ValidationCheck) -> CheckResult {
        self.tick();
        self.inner.prober.check(vmm, check).await
    }
}

/// One controller process: its elector, its adapter calls, its task.
struct Instance {
    identity: String,
    elector: LeaderElector,
    calls: Arc<AtomicU64>,
    /// Gone once nothing of this instance runs any more.
    adapters: Weak<Counting>,
    task: Option<JoinHandle<Result<(), LeaderError>>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Instance {
    /// `LeaderElector::run(reconciler::run(..), shutdown)` on the shared world.
    fn start(client: &Client, world: &Arc<SimWorld>, ns: &str, lease: LeaseConfig) -> Instance {
        let calls = Arc::new(AtomicU64::new(0));
        let counting = Arc::new(Counting {
            calls: calls.clone(),
            inner: crate::support::sim_adapters(client, world, ns),
        });
        let weak = Arc::downgrade(&counting);
        let adapters = Adapters {
            esxi: counting.clone(),
            disks: counting.clone(),
            converter: counting.clone(),
            staging: counting.clone(),
            cluster: counting.clone(),
            prober: counting,
        };
        let identity = lease.identity.clone();
        let config = ControllerConfig {
            namespace: Some(ns.to_owned()),
            max_requeue: Some(Duration::from_millis(200)),
            instance: identity.clone(),
            ..Default::default()
        };
        let work = reconciler::run(client.clone(), adapters, config, std::future::pending());
        let (stop, stopped) = oneshot::channel::<()>();
        let elector = LeaderElector::new(client.clone(), lease);
        let running = elector.clone();
        let task = tokio::spawn(async move {
            running
                .run(work, async {
                    let _ = stopped.await;
                })
                .await
        });
        Instance { identity, elector, calls, adapters: weak, task: Some(task), stop: Some(stop) }
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// A crash: the task is gone, the Lease is not released. kube-runtime runs
    /// each reconcile as its own task, aborted when the controller is dropped,
    /// which takes effect at the reconcile's next await: wait until every one
    /// is gone (the last reference to the adapters with it).
    async fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        let adapters = self.adapters.clone();
        poll("the killed instance's reconciles to end", WAIT, || {
            let gone = adapters.upgrade().is_none();
            async move { gone.then_some(()) }
        })
        .await;
    }

    /// SIGTERM: shut down and return what `run` returned.
    async fn shut_down(&mut self) -> Result<(), LeaderError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = self.task.take().expect("running");
        tokio::time::timeout(WAIT, task).await.expect("shut down in time").expect("task")
    }
}

async fn ensure_storage_class(client: &Client) {
    let classes: Api<StorageClass> = Api::all(client.clone());
    let sc: StorageClass = serde_json::from_value(json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "standard"}, "provisioner": "kubernetes.io/no-provisioner"
    }))
    .unwrap();
    let _ = classes.create(&PostParams::default(), &sc).await;
}

/// The migration of tests/controller_e2e.rs.
async fn create_migration(api: &Api<VirtualMachineMigration>, ns: &str) {
    let vmm: VirtualMachineMigration =
        serde_json::from_value(crate::support::sim_migration_json(ns)).expect("manifest");
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
}

fn status_of(vmm: &VirtualMachineMigration) -> VirtualMachineMigrationStatus {
    vmm.status.clone().unwrap_or_default()
}

async fn children(client: &Client, ns: &str, ar: &kube::core::ApiResource) -> Vec<DynamicObject> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, ar);
    api.list(&ListParams::default().labels("migration.platform.example/migration=web-01"))
        .await
        .expect("list children")
        .items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_the_leader_reconciles_and_a_killed_leader_hands_over_after_its_lease_expires() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "leader-handover").await;
    let lease_name = format!("{ns}-controller");
    // Copies are held so the migration can be caught in Preparing.
    let world = SimWorld::new(7, FaultPlan { hold_copies: true, ..Default::default() });
    let _staging = crate::support::publish_sim_staging(&world).await;
    let _sims = kubevirt_sim::start(client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let migrations: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);

    let lease = |identity| short_lease(&ns, &lease_name, identity);
    let (lease_duration, retry_period) = (lease("a").lease_duration, lease("a").retry_period);
    let mut instances = [
        Instance::start(&client, &world, &ns, lease("a")),
        Instance::start(&client, &world, &ns, lease("b")),
    ];
    let holder = poll("a leader", WAIT, || lease_holder(&leases, &lease_name)).await;
    let (leader, follower) = if holder == "a" { (0, 1) } else { (1, 0) };
    poll("the leader to know it leads", WAIT, || async {
        instances[leader].elector.is_leader().then_some(())
    })
    .await;
    eprintln!("{holder} leads; {} follows", instances[follower].identity);

    create_migration(&migrations, &ns).await;
    let preparing = poll("Preparing with copy progress", WAIT, || async {
        let vmm = migrations.get("web-01").await.expect("get migration");
        let status = status_of(&vmm);
        (status.phase == Phase::Preparing && status.progress.is_some()).then_some(vmm)
    })
    .await;
    assert!(instances[leader].calls() > 0, "the leader reconciled");
    assert_eq!(instances[follower].calls(), 0, "the follower touched nothing while the leader lived");
    assert!(!instances[follower].elector.is_leader());
    let dv_uids_before: Vec<String> =
        children(&client, &ns, &data_volume_resource()).await.iter().filter_map(|d| d.uid()).collect();
    assert!(dv_uids_before.is_empty(), "no DataVolumes before conversion: {dv_uids_before:?}");
    eprintln!("caught in {:?}", status_of(&preparing).phase);

    // The leader crashes mid-migration: no release, its in-memory work is gone.
    let (_, last_renewal) = lease_times(&leases, &lease_name).await;
    instances[leader].kill().await;
    world.crash();
    let leader_calls = instances[leader].calls();
    assert_eq!(instances[follower].calls(), 0, "still nothing from the follower");
    world.release_copies();

    let new_holder = instances[follower].identity.clone();
    poll("the follower to hold the lease", WAIT, || async {
        (lease_holder(&leases, &lease_name).await.as_deref() == Some(new_holder.as_str())).then_some(())
    })
    .await;
    // A crashed leader releases nothing: the follower waits out the lease
    // it last saw renewed, never less (client-go's rule).
    let (acquired, _) = lease_times(&leases, &lease_name).await;
    let waited = acquired.duration_since(last_renewal);
    eprintln!(
        "taken over {waited:?} after the last renewal (lease {lease_duration:?}, retry {retry_period:?})"
    );
    assert!(
        waited >= k8s_openapi::jiff::SignedDuration::try_from(lease_duration).expect("duration"),
        "the follower took the lease {waited:?} after its last renewal, before it expired"
    );
    assert_eq!(lease_transitions(&leases, &lease_name).await, Some(1), "created once, taken over once");

    // The follower finishes the migration without duplicating anything.
    let mut dv_uids = BTreeMap::new();
    let deadline = Instant::now() + WAIT;
    let done = loop {
        for dv in children(&client, &ns, &data_volume_resource()).await {
            let uid = dv.uid().unwrap_or_default();
            let first = dv_uids.entry(dv.name_any()).or_insert_with(|| uid.clone());
            assert_eq!(*first, uid, "DataVolume {} was recreated", dv.name_any());
        }
        let vmm = migrations.get("web-01").await.expect("get migration");
        let status = status_of(&vmm);
        if status.phase == Phase::Completed && status.timestamps.cleaned_up.is_some() {
            break vmm;
        }
        assert!(Instant::now() < deadline, "stuck in {:?}", status.phase);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(instances[leader].calls(), leader_calls, "the dead leader did nothing more");
    assert!(instances[follower].calls() > 0, "the new leader reconciled");
    assert!(instances[follower].elector.is_leader());

    let status = status_of(&done);
    let disks = status.disks.len();
    assert_eq!(disks, 2);
    let source = world.source_sha();
    for (i, disk) in status.disks.iter().enumerate() {
        assert_eq!(disk.source_sha256.as_deref(), Some(source[i].as_str()), "disk {i}");
        assert_eq!(disk.artifact_sha256, disk.source_sha256, "disk {i}");
    }
    assert!(world.ledger().power_off_transitions <= 1, "{:?}", world.ledger());
    assert_eq!(children(&client, &ns, &data_volume_resource()).await.len(), disks);
    assert_eq!(children(&client, &ns, &virtual_machine_resource()).await.len(), 1);
    assert!(dv_uids.len() <= disks, "{dv_uids:?}");

    // Completed exactly once, reported by the new leader.
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let succeeded: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("MigrationSucceeded"))
        .collect();
    let occurrences: i32 = succeeded.iter().map(|e| e.series.as_ref().map(|s| s.count).unwrap_or(1)).sum();
    assert_eq!(occurrences, 1, "{succeeded:#?}");
    assert_eq!(succeeded[0].reporting_instance.as_deref(), Some(new_holder.as_str()));

    let follower_result = instances[follower].shut_down().await;
    assert!(follower_result.is_ok(), "{follower_result:?}");
}

/// Work that records whether it is running; dropping it (cancellation) clears the flag.
fn flagged_work(running: Arc<AtomicBool>) -> impl Future<Output = ()> + Send + 'static {
    struct Running(Arc<AtomicBool>);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.store(false, Ordering::SeqCst);
        }
    }
    async move {
        running.store(true, Ordering::SeqCst);
        let _running = Running(running);
        std::future::pending::<()>().await;
    }
}

/// An elector around `flagged_work`, with a registry of its own.
struct Candidate {
    elector: LeaderElector,
    /// Whether its work runs (set by the work, cleared when it is dropped).
    running: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), LeaderError>>>,
}

impl Candidate {
    fn start(client: &Client, lease: LeaseConfig) -> Candidate {
        let metrics = Arc::new(Metrics::new());
        let elector = LeaderElector::new(client.clone(), lease).with_metrics(metrics.clone());
        let running = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = oneshot::channel::<()>();
        let (e, work) = (elector.clone(), flagged_work(running.clone()));
        let task = tokio::spawn(async move {
            e.run(work, async {
                let _ = stopped.await;
            })
            .await
        });
        Candidate { elector, running, metrics, stop: Some(stop), task: Some(task) }
    }

    fn leads(&self) -> bool {
        self.elector.is_leader() && self.running.load(Ordering::SeqCst)
    }

    /// `vmmigrate_leader` as its registry reports it.
    fn leader_gauge(&self) -> i64 {
        let text = self.metrics.encode();
        let line = text.lines().find(|l| l.starts_with("vmmigrate_leader ")).expect("vmmigrate_leader");
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    fn identity(&self) -> &str {
        &self.elector.config().identity
    }

    /// Waits for `run` to return, after a shutdown when `stop` is set.
    async fn finish(&mut self, stop: bool) -> Result<(), LeaderError> {
        if stop && let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let task = self.task.take().expect("running");
        tokio::time::timeout(WAIT, task).await.expect("run returns in time").expect("task")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_taken_at_once() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "leader-release").await;
    let name = format!("{ns}-controller");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    // A long lease: a successor that waited for expiry would take 15 s.
    let lease = |identity| LeaseConfig {
        retry_period: Duration::from_millis(500),
        ..LeaseConfig::new(&ns, &name, identity)
    };
    let mut a = Candidate::start(&client, lease("a"));
    poll("a to lead", WAIT, || async { a.leads().then_some(()) }).await;
    let mut b = Candidate::start(&client, lease("b"));
    assert_eq!(lease_holder(&leases, &name).await.as_deref(), Some("a"));
    assert!(!b.elector.is_leader() && !b.running.load(Ordering::SeqCst));
    assert_eq!((a.leader_gauge(), b.leader_gauge()), (1, 0));

    let (_, last_renewal) = lease_times(&leases, &name).await;
    let result = a.finish(true).await;
    assert!(result.is_ok(), "{result:?}");
    assert!(!a.elector.is_leader());
    assert!(!a.running.load(Ordering::SeqCst), "a's work was cancelled");
    assert_eq!(a.leader_gauge(), 0);

    poll("b to lead", WAIT, || async { b.leads().then_some(()) }).await;
    assert_eq!(b.leader_gauge(), 1);
    // a released the Lease, so b took it before a's last renewal expired.
    let (acquired, _) = lease_times(&leases, &name).await;
    assert!(
        acquired.duration_since(last_renewal) < k8s_openapi::jiff::SignedDuration::from_secs(15),
        "b took the lease {:?} after a's last renewal: it waited for expiry",
        acquired.duration_since(last_renewal)
    );
    assert_eq!(lease_holder(&leases, &name).await.as_deref(), Some("b"));
    assert_eq!(lease_transitions(&leases, &name).await, Some(1));

    let result = b.finish(true).await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(lease_holder(&leases, &name).await, None, "released again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_was_taken_stops_its_work_and_reports_the_loss() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "leader-lost").await;
    let name = format!("{ns}-controller");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let config = short_lease(&ns, &name, "a");
    let mut a = Candidate::start(&client, config);
    poll("a to lead", WAIT, || async { a.leads().then_some(()) }).await;
    assert_eq!(a.leader_gauge(), 1);

    // Another party overwrites the Lease (say, a replica that saw it expire
    // while this one was partitioned away).
    let mut lease = leases.get(&name).await.expect("lease");
    let spec = lease.spec.as_mut().expect("spec");
    spec.holder_identity = Some("intruder".into());
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    leases.replace(&name, &PostParams::default(), &lease).await.expect("take the lease");

    let result = a.finish(false).await;
    assert!(matches!(&result, Err(LeaderError::LostLease { .. })), "{result:?}");
    assert_eq!(result.unwrap_err().reason(), "LostLease");
    assert!(!a.elector.is_leader());
    assert!(!a.running.load(Ordering::SeqCst), "the work was cancelled");
    assert_eq!(a.leader_gauge(), 0, "vmmigrate_leader follows the loss");
    assert_eq!(lease_holder(&leases, &name).await.as_deref(), Some("intruder"), "nothing released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidates_racing_for_a_new_lease_elect_exactly_one() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "leader-race").await;
    let name = format!("{ns}-controller");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let mut candidates: Vec<Candidate> = ["a", "b", "c", "d", "e"]
        .into_iter()
        .map(|id| Candidate::start(&client, short_lease(&ns, &name, id)))
        .collect();
    let leading = |candidates: &[Candidate]| -> Vec<String> {
        let mut ids = Vec::new();
        for c in candidates {
            if c.elector.is_leader() || c.running.load(Ordering::SeqCst) {
                ids.push(c.identity().to_owned());
            }
        }
        ids
    };
    let holder = poll("a leader", WAIT, || async { lease_holder(&leases, &name).await }).await;
    // Watched over three renewals: one leader, the one the Lease names.
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        let now = leading(&candidates);
        assert!(now.len() <= 1, "two leaders at once: {now:?}");
        assert!(now.iter().all(|id| *id == holder), "{now:?} leads, the Lease names {holder}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(leading(&candidates), vec![holder]);
    let gauges: Vec<i64> = candidates.iter().map(Candidate::leader_gauge).collect();
    assert_eq!(gauges.iter().sum::<i64>(), 1, "sum(vmmigrate_leader) is 1: {gauges:?}");
    assert_eq!(lease_transitions(&leases, &name).await, Some(0), "created once, never taken over");
    for c in &mut candidates {
        let result = c.finish(true).await;
        assert!(result.is_ok(), "{result:?}");
    }
}

/// `name{labels} value` of a Prometheus scrape of `127.0.0.1:port`; `None`
/// when the server does not answer or the series is absent (an absent gauge
/// is not a 0).
async fn scrape(port: u16, series: &str) -> Option<f64> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.ok()?;
    let reply = crate::support::read_answer(&mut stream, std::time::Duration::from_secs(10)).await?;
    reply.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// A `vmmigrate run --leader-elect` process, killed when dropped.
struct RunProcess {
    child: std::process::Child,
    metrics_port: u16,
    _dirs: [tempfile::TempDir; 2],
}

impl RunProcess {
    fn start(ns: &str, pod: &str, repo: &std::path::Path) -> RunProcess {
        let (work, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let metrics_port = crate::support::free_port();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .args(["run", "--repo", repo.to_str().unwrap(), "--branch", "main", "--no-status"])
            .args(["--poll-seconds", "1", "--manifest-namespace", ns, "--namespace", ns])
            .args(["--leader-elect", "--lease-namespace", ns, "--lease-name", "vmmigrate-run"])
            .args(["--lease-seconds", "3", "--staging-listen", "127.0.0.1:0"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .arg("--work-dir")
            .arg(work.path())
            .arg("--cache-dir")
            .arg(cache.path())
            // The downward API of a pod, pointing at a Pod object of the test.
            .env("POD_NAME", pod)
            .env("POD_NAMESPACE", ns)
            .env("KUBECONFIG", KubeEnv::shared().kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("vmmigrate run");
        RunProcess { child, metrics_port, _dirs: [work, cache] }
    }

    async fn fetches(&self) -> f64 {
        // A labelled counter shows only once it was first counted: absent is none yet.
        scrape(self.metrics_port, r#"vmmigrate_git_fetch_total{result="ok"}"#).await.unwrap_or(0.0)
    }
}

impl Drop for RunProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn leader_label(pods: &Api<k8s_openapi::api::core::v1::Pod>, name: &str) -> Option<String> {
    let pod = pods.get(name).await.ok()?;
    pod.labels().get(vmmigrate::controller::service::LEADER_POD_LABEL).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_runs_the_gitops_half_labels_its_pod_for_webhooks_and_the_standby_takes_over_when_it_dies()
 {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "run-leader").await;
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("remote.git");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git").args(args).output().unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    git(&["init", "-q", "--bare", "-b", "main", repo.to_str().unwrap()]);
    let work = dir.path().join("work");
    git(&["clone", "-q", repo.to_str().unwrap(), work.to_str().unwrap()]);
    std::fs::write(work.join("README.md"), "# migrations\n").unwrap();
    let w = work.to_str().unwrap();
    git(&[
        "-C",
        w,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.test",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "start",
    ]);
    git(&["-C", w, "push", "-q", "origin", "HEAD:main"]);
    // Two Pod objects standing for the replicas (never scheduled: only their labels matter).
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    for name in ["vmmigrate-a", "vmmigrate-b"] {
        let pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "vmmigrate"}},
            "spec": {"containers": [{"name": "vmmigrate", "image": "vmmigrate:test"}]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }

    let a = RunProcess::start(&ns, "vmmigrate-a", &repo);
    poll("a leads and fetches", Duration::from_secs(60), || async {
        (a.fetches().await >= 2.0).then_some(())
    })
    .await;
    let b = RunProcess::start(&ns, "vmmigrate-b", &repo);
    poll("b stands by, its pod labelled not-leader", WAIT, || async {
        (leader_label(&pods, "vmmigrate-b").await.as_deref() == Some("false")).then_some(())
    })
    .await;
    assert_eq!(leader_label(&pods, "vmmigrate-a").await.as_deref(), Some("true"));
    // While a leads, b fetches nothing (it has not even cloned).
    let a_before = a.fetches().await;
    poll("a fetches on", Duration::from_secs(30), || async {
        (a.fetches().await >= a_before + 3.0).then_some(())
    })
    .await;
    assert_eq!(b.fetches().await, 0.0, "the standby ran the gitops half");
    let ready = scrape(b.metrics_port, "vmmigrate_leader").await;
    assert_eq!(ready, Some(0.0), "b says it is not the leader");

    // a dies without releasing its Lease; b takes over when it expires.
    drop(a);
    poll("b takes over and fetches", WAIT, || async { (b.fetches().await >= 2.0).then_some(()) }).await;
    poll("b's pod is labelled leader", WAIT, || async {
        (leader_label(&pods, "vmmigrate-b").await.as_deref() == Some("true")).then_some(())
    })
    .await;
}
