//! A whole migration with every real part this machine can run, for the
//! tests of `migration_e2e` and of the `faults` binary: see
//! `tests/migration_e2e/mod.rs` for what runs where. [`Migration`] sets one
//! up ([`Setup`]: which VM, which CDI, which KubeVirt, which data plane,
//! which work directory), drives it and checks what every migration must
//! end with.

use crate::support::esxi_emulator::{self, EsxiEmulator, EsxiOptions};
use crate::support::netns::Netns;
use crate::support::setup;
use crate::support::{CDI_DEFINITION, KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Secret};
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::controller::service::{self, ControllerOptions, DataPlane};
use vmmigrate::convert::artifact::sha256_file;
use vmmigrate::convert::staging::StagingServer;
use vmmigrate::destination::cluster::{data_volume_resource, virtual_machine_instance_resource};
use vmmigrate::metrics::Metrics;

/// What a step may take on a loaded two-core machine running the whole suite.
/// Slow enough that a fault lands mid-copy: each disk read (a 16 MiB
/// chunk) takes 16 s, db-02's copy about as long (its three chunks go at once).
pub(crate) const SLOW_READS: u64 = 1 << 20;

/// What a step may take on a loaded two-core machine running the whole suite.
pub(crate) const WAIT: Duration = Duration::from_secs(300);
pub(crate) const VM: &str = "db-02";
pub(crate) const VMID: &str = "2";
pub(crate) const PAGE: &str =
    "<html><body><h1>db-02 status page</h1><p>migrated from ESXi</p></body></html>\n";

pub(crate) struct Migration {
    pub(crate) client: Client,
    /// The controller's client: its requests say vmmigrate's `User-Agent`.
    pub(crate) controller_client: Client,
    /// The cluster the migration runs on (its audit log among the rest).
    pub(crate) env: &'static KubeEnv,
    pub(crate) ns: String,
    /// The source VM's name and vmid on the emulated host.
    pub(crate) vm: &'static str,
    pub(crate) vmid: &'static str,
    pub(crate) kubevirt: Kubevirt,
    pub(crate) api: Api<VirtualMachineMigration>,
    pub(crate) emu: EsxiEmulator,
    pub(crate) work: WorkDir,
    pub(crate) opts: ControllerOptions,
    pub(crate) staging: StagingServer,
    pub(crate) _sims: Option<kubevirt_sim::Simulators>,
    /// Every conversion Job ever created in the namespace, by uid.
    pub(crate) jobs_seen: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    pub(crate) job_watch: tokio::task::JoinHandle<()>,
    /// Every DataVolume ever created in the namespace, by uid.
    pub(crate) dvs_seen: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    pub(crate) dv_watch: tokio::task::JoinHandle<()>,
    pub(crate) _netns: Option<Netns>,
    pub(crate) _cdi_definition: Option<tokio::sync::RwLockReadGuard<'static, ()>>,
    /// Real KubeVirt's virt-api, read by a real guest's test
    /// (`support::VIRT_API`).
    pub(crate) _virt_api: Option<tokio::sync::RwLockReadGuard<'static, ()>>,
    /// What the adapters and the staging server record into (one registry
    /// across controller restarts, like the Service's view of the pods).
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) controller: Option<tokio::task::JoinHandle<()>>,
    /// What importer pods reach instead of the staging server, when the test
    /// asked for one.
    pub(crate) front: Option<UnavailableFront>,
    /// Where the migration reaches the ESXi host: loopback, or the host end
    /// of the node's veth when worker pods copy.
    pub(crate) source_host: String,
}

/// What a real guest showed ([`Migration::guest_facts`]).
pub(crate) struct GuestFacts {
    pub(crate) console: String,
    pub(crate) page: String,
    pub(crate) interfaces: Vec<Value>,
}

/// What runs the migrated VM.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kubevirt {
    /// db-02 (patterned bytes, no OS) on the shared cluster: the KubeVirt
    /// simulator declares its VMI running, and busybox httpd in a network
    /// namespace answers for its application.
    Simulated,
    /// A VM of the emulator's `GUEST_VMS`, whose disks are a real guest, on
    /// the cluster with real KubeVirt: it boots, takes its address by DHCP,
    /// runs qemu-guest-agent and serves a page naming itself.
    Real,
}

/// Who imports the DataVolumes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cdi {
    /// Real CDI v1.65.0 on the node: importer pods download from the staging
    /// server into PersistentVolumes of the node's provisioner.
    Real,
    /// Real CDI while its DataVolume definition lacks `checksum`
    /// ([`CdiWithoutChecksum`], held by the test).
    RealWithoutChecksum,
}

/// The controller's work directory: a temporary one, or the test's.
pub(crate) struct WorkDir {
    pub(crate) _own: Option<tempfile::TempDir>,
    pub(crate) path: PathBuf,
}

impl WorkDir {
    pub(crate) fn new(given: Option<PathBuf>) -> WorkDir {
        match given {
            Some(path) => WorkDir { _own: None, path },
            None => {
                let own = tempfile::tempdir().expect("work dir");
                WorkDir { path: own.path().to_path_buf(), _own: Some(own) }
            }
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// How a [`Migration`] is set up: every choice, each with its usual value.
#[derive(Clone)]
pub(crate) struct Setup {
    pub(crate) cdi: Cdi,
    /// Importer pods reach the staging server through an
    /// [`UnavailableFront`], which answers 503 until the test opens it.
    pub(crate) front: bool,
    pub(crate) kubevirt: Kubevirt,
    /// The source VM's name and vmid on the emulated host.
    pub(crate) vm: (&'static str, &'static str),
    pub(crate) data_plane: DataPlane,
    pub(crate) snapshot_format: crate::support::vmdk_delta::DeltaFormat,
    /// The controller's work directory, when the test gives one (a small
    /// file system that fills, say).
    pub(crate) work_dir: Option<PathBuf>,
    /// The test holds `support::VIRT_API` for writing (it takes virt-api
    /// down); others with a real guest read it.
    pub(crate) holds_virt_api: bool,
    /// CDI's importer (most tests: its failure model is what they prove)
    /// or blank DataVolumes filled by vmmigrate's Jobs.
    pub(crate) import_method: service::ImportMethod,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            cdi: Cdi::Real,
            front: false,
            kubevirt: Kubevirt::Simulated,
            vm: ("db-02", "2"),
            data_plane: DataPlane::Process,
            snapshot_format: crate::support::vmdk_delta::DeltaFormat::SeSparse,
            work_dir: None,
            holds_virt_api: false,
            import_method: service::ImportMethod::Cdi,
        }
    }
}

impl Migration {
    pub(crate) async fn new(prefix: &str) -> Migration {
        Migration::start(prefix, Setup::default()).await
    }

    pub(crate) async fn with(prefix: &str, cdi: Cdi) -> Migration {
        Migration::start(prefix, Setup { cdi, ..Default::default() }).await
    }

    pub(crate) async fn with_front(prefix: &str, cdi: Cdi, front: bool) -> Migration {
        Migration::start(prefix, Setup { cdi, front, ..Default::default() }).await
    }

    /// db-02 with its data plane in worker pods (`--data-plane pods`).
    pub(crate) async fn with_worker_pods(prefix: &str) -> Migration {
        Migration::start(prefix, Setup { data_plane: DataPlane::Pods, ..Default::default() }).await
    }

    /// VM 12 `pair` (two disks, 24 + 8 MiB, powered on with Tools), for
    /// warm migrations; its snapshots are seSparse (VMFS6).
    pub(crate) async fn pair(prefix: &str) -> Migration {
        Migration::pair_with(prefix, crate::support::vmdk_delta::DeltaFormat::SeSparse).await
    }

    /// [`Self::pair`] with snapshots in `format` (vmfsSparse: VMFS5).
    pub(crate) async fn pair_with(
        prefix: &str,
        format: crate::support::vmdk_delta::DeltaFormat,
    ) -> Migration {
        let setup = Setup { vm: ("pair", "12"), snapshot_format: format, ..Default::default() };
        Migration::start(prefix, setup).await
    }

    /// The real guest `vm` of the emulator's `GUEST_VMS`, on real KubeVirt.
    pub(crate) async fn guest(prefix: &str, vm: &'static str) -> Migration {
        Migration::guest_with(prefix, vm, Setup::default()).await
    }

    /// [`Self::guest`] with the rest of `setup`.
    pub(crate) async fn guest_with(prefix: &str, vm: &'static str, setup: Setup) -> Migration {
        let (vmid, vm) = esxi_emulator::GUEST_VMS
            .iter()
            .find(|(_, name)| *name == vm)
            .copied()
            .unwrap_or_else(|| panic!("{vm} is not a guest VM of the emulator"));
        Migration::start(prefix, Setup { kubevirt: Kubevirt::Real, vm: (vm, vmid), ..setup }).await
    }

    /// The VMware-shaped guest `vm` of the emulator's `VMWARE_GUEST_VMS`
    /// (`tools/guest/vmware.sh`), on real KubeVirt.
    pub(crate) async fn vmware_guest(prefix: &str, vm: &'static str) -> Migration {
        Migration::vmware_guest_with(prefix, vm, Setup::default()).await
    }

    /// [`Self::vmware_guest`] with the rest of `setup`.
    pub(crate) async fn vmware_guest_with(prefix: &str, vm: &'static str, setup: Setup) -> Migration {
        let (vmid, vm) = esxi_emulator::VMWARE_GUEST_VMS
            .iter()
            .find(|(_, name)| *name == vm)
            .copied()
            .unwrap_or_else(|| panic!("{vm} is not a VMware-shaped guest VM of the emulator"));
        Migration::start(prefix, Setup { kubevirt: Kubevirt::Real, vm: (vm, vmid), ..setup }).await
    }

    pub(crate) async fn start(prefix: &str, setup: Setup) -> Migration {
        let Setup {
            cdi,
            front,
            kubevirt,
            vm: (vm, vmid),
            data_plane,
            snapshot_format,
            work_dir,
            holds_virt_api,
            import_method,
        } = setup;
        let virt_api = match kubevirt {
            Kubevirt::Real if !holds_virt_api => Some(crate::support::VIRT_API.read().await),
            _ => None,
        };
        let env = match kubevirt {
            Kubevirt::Simulated => tokio::task::block_in_place(KubeEnv::shared),
            Kubevirt::Real => tokio::task::block_in_place(KubeEnv::shared_kubevirt),
        };
        // The conversion Jobs' image; built and imported on first use.
        let image = tokio::task::block_in_place(|| env.controller_image()).expect("the release image");
        // The no-checksum test changes CDI on the shared cluster only.
        let cdi_definition = if cdi == Cdi::Real && kubevirt == Kubevirt::Simulated {
            Some(CDI_DEFINITION.read().await)
        } else {
            None
        };
        let node_ip = env.node.as_ref().expect("the shared cluster has a node").host_ip;
        let client = env.client().await;
        let controller_client = env.client_as(&vmmigrate::ports::user_agent("controller")).await;
        ensure_storage_class(&client).await;
        let ns = test_namespace(&client, prefix).await;
        let vmware = esxi_emulator::VMWARE_GUEST_VMS.iter().any(|(_, name)| *name == vm);
        let (guests, vmware_guests) = match kubevirt {
            Kubevirt::Simulated => (None, None),
            Kubevirt::Real if vmware => (
                None,
                Some(tokio::task::block_in_place(setup::vmware_guest_images).expect("VMware-shaped guests")),
            ),
            Kubevirt::Real => {
                (Some(tokio::task::block_in_place(setup::guest_images).expect("guest images")), None)
            }
        };
        // Worker pods reach the host where pods reach the host: the node's veth.
        let also_listen = (data_plane == DataPlane::Pods).then_some(node_ip);
        let pair_disk_mib = (vm == "pair").then_some((24, 8));
        let emu = EsxiEmulator::start(EsxiOptions {
            guests,
            vmware_guests,
            also_listen,
            pair_disk_mib,
            snapshot_format,
            ..Default::default()
        })
        .expect("ESXi emulator");
        let source_host = also_listen.map_or_else(|| "127.0.0.1".to_owned(), |ip| ip.to_string());
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            // Any port: some tests reach the host through a proxy.
            "metadata": {"name": "esxi", "annotations": {
                vmmigrate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION:
                    format!("{source_host}={}", emu.host_key_fingerprint())}},
            "stringData": {"username": emu.username, "password": emu.password},
        }))
        .unwrap();
        Api::<Secret>::namespaced(client.clone(), &ns).create(&PostParams::default(), &secret).await.unwrap();

        let netns = match kubevirt {
            // db-02's application: a real web server at the address the simulated VMI reports.
            Kubevirt::Simulated => {
                let netns = Netns::new().expect("network namespace");
                netns.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
                crate::support::db_web_service(&client, &ns, netns.ip).await;
                Some(netns)
            }
            // The guest's own web server, behind a Service on its launcher pod.
            Kubevirt::Real => {
                guest_web_service(&client, &ns, vm).await;
                None
            }
        };

        let work = WorkDir::new(work_dir);
        let front = if front {
            let listener = tokio::net::TcpListener::bind((node_ip, 0)).await.expect("front listener");
            Some(listener)
        } else {
            None
        };
        let staging_url = front.as_ref().map(|l| format!("https://{}", l.local_addr().unwrap()));
        let opts = ControllerOptions {
            namespace: Some(ns.clone()),
            work_dir: work.path().to_path_buf(),
            // Where importer pods reach the test process: the host end of the node's veth.
            staging_listen: std::net::SocketAddr::new(node_ip.into(), 0),
            staging_url,
            conversions: 2,
            copy_streams: 2,
            // This machine kind's /dev/kvm opens but runs no guest.
            guest_conversion_tcg: true,
            job_image: Some(image),
            job_namespace: None,
            work_claim: Some("vmmigrate-work".into()),
            job_guest_memory_limit: "4Gi".into(),
            import_method,
            instance: "e2e".into(),
            // The source-VM claims live in the controller's namespace: here the test's.
            leader_election: service::LeaderElectionOptions {
                lease_namespace: ns.clone(),
                ..Default::default()
            },
            destination_rules: Default::default(),
            max_reads_per_host: 2,
            host_reads: Vec::new(),
            max_reads: None,
            data_plane,
            worker_cpu: "100m".into(),
            worker_memory: "64Mi".into(),
            worker_memory_limit: "512Mi".into(),
            worker_guest_memory_limit: "4Gi".into(),
            worker_storage_class: Some("local-path".into()),
        };
        let metrics = Arc::new(Metrics::new());
        let staging = service::start_staging(&opts, &metrics).await.expect("staging server");
        let front = front.map(|listener| UnavailableFront::start(listener, &staging));
        let sims = netns.as_ref().map(|netns| {
            let sims = kubevirt_sim::start(client.clone(), &ns);
            *sims.control.kubevirt.vmi_ip.lock().unwrap() = netns.ip.to_string();
            sims
        });
        work_volume(&client, &ns, work.path()).await;
        let (jobs_seen, job_watch) = watch_uids(Api::<Job>::namespaced(client.clone(), &ns));
        let (dvs_seen, dv_watch) =
            watch_uids(Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &data_volume_resource()));
        let api = Api::namespaced(client.clone(), &ns);
        let mut m = Migration {
            client,
            controller_client,
            env,
            ns,
            vm,
            vmid,
            kubevirt,
            api,
            emu,
            work,
            opts,
            staging,
            _sims: sims,
            jobs_seen,
            job_watch,
            dvs_seen,
            dv_watch,
            _netns: netns,
            _cdi_definition: cdi_definition,
            _virt_api: virt_api,
            metrics,
            controller: None,
            front,
            source_host,
        };
        m.start_controller();
        m
    }

    /// A controller process: fresh adapters (no memory of earlier work) and
    /// the reconciler. The staging server stands for the Service in front of
    /// the controller pods and outlives them.
    pub(crate) fn start_controller(&mut self) {
        let adapters =
            service::adapters(self.controller_client.clone(), &self.opts, &self.staging, &self.metrics)
                .unwrap();
        let config = ControllerConfig {
            namespace: Some(self.ns.clone()),
            max_requeue: Some(Duration::from_millis(250)),
            instance: "e2e".into(),
            metrics: self.metrics.clone(),
            ..Default::default()
        };
        let task = reconciler::run(self.controller_client.clone(), adapters, config, std::future::pending());
        self.controller = Some(tokio::spawn(task));
    }

    /// Kills the controller the way a crash would: its task and everything it
    /// ran in process (copies, conversions) stop; then a new one starts.
    pub(crate) async fn kill_and_restart_controller(&mut self) {
        self.kill_controller().await;
        self.start_controller();
    }

    /// Kills the controller the way a crash would and starts none: until
    /// [`Self::start_controller`], nobody looks at the migration or its source.
    pub(crate) async fn kill_controller(&mut self) {
        if let Some(task) = self.controller.take() {
            task.abort();
            let _ = task.await;
        }
    }

    pub(crate) async fn create(&self, mutate: impl FnOnce(&mut Value)) {
        // Real CDI writes PersistentVolumes of the node's provisioner.
        let class = "local-path";
        let (networks, page) = match self.kubevirt {
            Kubevirt::Simulated => (
                json!([
                    {"source": "VM Network", "type": "Pod"},
                    {"source": "DMZ", "type": "Multus", "networkName": "dmz"}
                ]),
                json!({"service": "db-web", "port": 80, "path": "/", "expectedStatus": 200,
                       "bodyContains": "db-02 status page"}),
            ),
            Kubevirt::Real => {
                let networks = vec![json!({"source": "VM Network", "type": "Pod"})];
                // The guest names itself with the hostname KubeVirt's DHCP gives it: the VMI's name.
                let page = json!({"service": "web", "port": 80, "path": "/", "expectedStatus": 200,
                                  "bodyContains": format!("vmmigrate-guest {}", self.vm)});
                (json!(networks), page)
            }
        };
        let mut body = json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": {"name": self.vm, "namespace": self.ns},
            "spec": {
                "source": {
                    "host": self.source_host,
                    "port": self.emu.port,
                    "hostKey": self.emu.host_key_fingerprint(),
                    "credentialsSecretRef": {"name": "esxi"},
                    "vm": {"name": self.vm}
                },
                "destination": {"namespace": self.ns, "storageClassName": class},
                "networkMap": networks,
                // The test guests are built to boot anywhere (virtio, DHCP):
                // nothing to convert them for.
                "conversion": {"guest": "none"},
                "strategy": {"backoff": {"initialSeconds": 1, "maxSeconds": 2}, "timeouts": {"sshSeconds": 20}},
                "validation": {"checks": [
                    {"name": "status-page", "http": page},
                    {"name": "agent", "guestAgent": {}},
                    {"name": "address", "ip": {}}
                ]}
            }
        });
        mutate(&mut body);
        let vmm: VirtualMachineMigration = serde_json::from_value(body).expect("manifest");
        self.api.create(&PostParams::default(), &vmm).await.expect("create migration");
    }

    /// Holds real CDI's importer pods (`support::hold_pods`).
    pub(crate) async fn hold_importer_pods(&self) {
        crate::support::hold_pods(&self.client, &self.ns).await;
    }

    pub(crate) async fn release_importer_pods(&self) {
        crate::support::release_pods(&self.client, &self.ns).await;
    }

    pub(crate) async fn get(&self) -> VirtualMachineMigration {
        self.api.get(self.vm).await.expect("get migration")
    }

    /// Waits for Importing and both disks' DataVolumes; returns them.
    pub(crate) async fn importing_with_both_data_volumes(
        &self,
    ) -> (VirtualMachineMigration, Vec<DynamicObject>) {
        let vmm = self.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
        let deadline = Instant::now() + WAIT;
        loop {
            let dvs = self.list(&data_volume_resource()).await;
            if dvs.len() == 2 {
                return (vmm, dvs);
            }
            assert!(Instant::now() < deadline, "the DataVolumes were never created");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls the migration until `done` holds; fails on Failed or
    /// ManualInterventionRequired (with the status) or after `WAIT`.
    pub(crate) async fn wait_for(
        &self,
        what: &str,
        done: impl FnMut(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        self.wait_for_within(what, WAIT, done).await
    }

    /// [`Self::wait_for`] with `limit` instead of `WAIT`.
    pub(crate) async fn wait_for_within(
        &self,
        what: &str,
        limit: Duration,
        mut done: impl FnMut(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = Instant::now() + limit;
        loop {
            let vmm = self.get().await;
            if done(&vmm) {
                return vmm;
            }
            let phase = phase_of(&vmm);
            assert!(
                !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired),
                "{what}: the migration stopped in {phase}: {:#?}",
                vmm.status
            );
            if Instant::now() >= deadline {
                panic!(
                    "{what}: still {phase} after {limit:?}: {:#?}\n{}",
                    vmm.status,
                    self.namespace_report().await
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls the migration until `done` holds (Failed and
    /// ManualInterventionRequired are `done`'s to judge), or fails after
    /// `WAIT` per phase at most three times over.
    pub(crate) async fn wait_until_stopped(
        &self,
        mut done: impl FnMut(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = Instant::now() + WAIT * 3;
        loop {
            let vmm = self.get().await;
            if done(&vmm) {
                return vmm;
            }
            if Instant::now() >= deadline {
                panic!(
                    "still {} after {:?}: {:#?}\n{}",
                    phase_of(&vmm),
                    WAIT * 3,
                    vmm.status,
                    self.namespace_report().await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What the namespace holds, for a failed wait's message: each
    /// DataVolume's phase and progress, each pod's phase and containers
    /// (restarts, state), and the Events in the order they were last seen.
    pub(crate) async fn namespace_report(&self) -> String {
        use k8s_openapi::api::core::v1::{Event, Pod};
        let mut out = format!("namespace {}:\n", self.ns);
        let dvs: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &data_volume_resource());
        match dvs.list(&ListParams::default()).await {
            Ok(list) => {
                for dv in list.items {
                    let status = dv.data.get("status").cloned().unwrap_or(Value::Null);
                    out += &format!(
                        "  DataVolume {}: phase {} progress {} restarts {} conditions {}\n",
                        dv.name_any(),
                        status["phase"],
                        status["progress"],
                        status["restartCount"],
                        status["conditions"]
                    );
                }
            }
            Err(e) => out += &format!("  DataVolumes: {e}\n"),
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                for pod in list.items {
                    let status = pod.status.clone().unwrap_or_default();
                    let containers: Vec<String> = status
                        .container_statuses
                        .unwrap_or_default()
                        .iter()
                        .map(|c| format!("{} restarts {} state {:?}", c.name, c.restart_count, c.state))
                        .collect();
                    out += &format!(
                        "  Pod {}: phase {:?} containers {containers:?}\n",
                        pod.name_any(),
                        status.phase
                    );
                }
            }
            Err(e) => out += &format!("  Pods: {e}\n"),
        }
        // The cluster's own pods that restarted or are not ready: a CDI or
        // KubeVirt controller in back-off explains a migration that waits.
        let everywhere: Api<Pod> = Api::all(self.client.clone());
        if let Ok(list) = everywhere.list(&ListParams::default()).await {
            for pod in list.items.iter().filter(|p| p.namespace().as_deref() != Some(self.ns.as_str())) {
                let status = pod.status.clone().unwrap_or_default();
                let troubled: Vec<String> = status
                    .container_statuses
                    .unwrap_or_default()
                    .iter()
                    .filter(|c| c.restart_count > 0 || !c.ready)
                    .map(|c| {
                        format!(
                            "{} restarts {} ready {} state {:?}",
                            c.name, c.restart_count, c.ready, c.state
                        )
                    })
                    .collect();
                if !troubled.is_empty() {
                    out += &format!(
                        "  Pod {}/{}: {troubled:?}\n",
                        pod.namespace().unwrap_or_default(),
                        pod.name_any()
                    );
                }
            }
        }
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        match events.list(&ListParams::default()).await {
            Ok(list) => {
                let mut items = list.items;
                items.sort_by_key(|e| e.last_timestamp.clone().map(|t| t.0));
                for e in items {
                    out += &format!(
                        "  Event {:?} {} {}/{}: {} x{} {}\n",
                        e.last_timestamp.map(|t| t.0),
                        e.involved_object.kind.unwrap_or_default(),
                        e.involved_object.name.unwrap_or_default(),
                        e.reason.unwrap_or_default(),
                        e.type_.unwrap_or_default(),
                        e.count.unwrap_or(1),
                        e.message.unwrap_or_default()
                    );
                }
            }
            Err(e) => out += &format!("  Events: {e}\n"),
        }
        out
    }

    /// What the real guest shows: its serial console (KubeVirt's
    /// `guest-console-log` container), its page (GET / at the address its
    /// VMI reports) and the VMI's `status.interfaces`.
    pub(crate) async fn guest_facts(&self) -> GuestFacts {
        self.guest_facts_of(self.vm).await
    }

    /// [`Self::guest_facts`] of the VM named `vm` in the cluster.
    pub(crate) async fn guest_facts_of(&self, vm: &str) -> GuestFacts {
        use k8s_openapi::api::core::v1::Pod;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        let launcher = pods
            .list(&ListParams::default().labels(&format!("kubevirt.io/domain={vm}")))
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
            .expect("the virt-launcher pod");
        let params =
            kube::api::LogParams { container: Some("guest-console-log".into()), ..Default::default() };
        let console = pods.logs(&launcher.name_any(), &params).await.unwrap_or_default();
        let vmis: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.ns, &virtual_machine_instance_resource());
        let vmi = vmis.get(vm).await.expect("the VMI");
        let interfaces = vmi.data["status"]["interfaces"].as_array().cloned().unwrap_or_default();
        let ip = interfaces.first().and_then(|i| i["ipAddress"].as_str()).unwrap_or_default().to_owned();
        let page = if ip.is_empty() {
            String::new()
        } else {
            let url = format!("http://{ip}/");
            let client =
                reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
            match client.get(&url).send().await {
                Ok(answer) => answer.text().await.unwrap_or_default(),
                Err(e) => format!("GET {url}: {e}"),
            }
        };
        GuestFacts { console, page, interfaces }
    }

    pub(crate) async fn wait_completed(&self) -> VirtualMachineMigration {
        self.wait_completed_within(WAIT).await
    }

    /// [`Self::wait_completed`] with `limit` instead of `WAIT`.
    pub(crate) async fn wait_completed_within(&self, limit: Duration) -> VirtualMachineMigration {
        self.wait_for_within("Completed", limit, |v| {
            phase_of(v) == Phase::Completed
                && v.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some())
        })
        .await
    }

    pub(crate) async fn list(&self, ar: &kube::core::ApiResource) -> Vec<DynamicObject> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.ns, ar);
        api.list(&ListParams::default()).await.expect("list").items
    }

    /// sha256 of the disk bytes imported into the volume of each disk: for
    /// real CDI the `disk.img` in the PersistentVolume's directory on the
    /// node (its first `size` bytes; CDI grows the image with zeros to fill
    /// the volume).
    pub(crate) async fn imported_sha256(&self, disks: usize) -> Vec<String> {
        self.imported_sha256_of(self.vm, disks).await
    }

    /// [`Self::imported_sha256`] of the disks of the destination VM `vm`.
    pub(crate) async fn imported_sha256_of(&self, vm: &str, disks: usize) -> Vec<String> {
        let mut found = Vec::new();
        for d in 0..disks {
            let dv = format!("{vm}-disk-{d}");
            let image = crate::support::imported_image(&self.client, &self.ns, &dv).await;
            let size = self.emu.disk_files(self.vmid)[d].3;
            let digest = vmmigrate::images::digest::volume_digest(&image, size)
                .unwrap_or_else(|e| panic!("{}: {e}", image.display()));
            assert_eq!(digest.nonzero_tail_bytes, 0, "{}: bytes after the disk", image.display());
            found.push(digest.sha256);
        }
        found
    }

    /// The source disks' sha256 as they are on the emulated datastore now.
    pub(crate) fn source_sha256_now(&self) -> Vec<String> {
        self.emu
            .disk_files(self.vmid)
            .iter()
            .map(|(_, path, _, _)| sha256_file(path, None).unwrap().1)
            .collect()
    }

    pub(crate) fn source_sha256_at_start(&self) -> Vec<String> {
        self.emu.disk_files(self.vmid).iter().map(|(_, _, sha, _)| sha.clone()).collect()
    }

    /// Files left for this migration in the work directory.
    pub(crate) fn leftovers(&self, uid: &str) -> Vec<PathBuf> {
        let mut found = Vec::new();
        walk(self.work.path(), &mut |p| {
            let s = p.to_string_lossy();
            if s.contains(uid) {
                found.push(p.to_path_buf());
            }
        });
        found
    }

    /// The safety properties every migration must end with.
    pub(crate) async fn assert_source_off_and_untouched(&self) {
        assert_eq!(self.emu.vm_power(self.vmid), "off");
        assert_eq!(self.emu.power_off_transitions(self.vmid), 1, "powered off exactly once");
        assert_eq!(self.source_sha256_now(), self.source_sha256_at_start(), "the source disks were written");
        self.assert_power_calls_recorded().await;
    }

    /// Every power call the host saw (counted at the host, each call, not
    /// each change) is one of `status.powerActions`, in order, and the
    /// other way round.
    pub(crate) async fn assert_power_calls_recorded(&self) {
        let status = self.get().await.status.unwrap_or_default();
        let recorded: Vec<String> = status
            .power_actions
            .iter()
            .map(|r| match r.action {
                vmmigrate::api::PowerActionKind::PowerOff => "off".to_owned(),
                vmmigrate::api::PowerActionKind::Shutdown => "shutdown".to_owned(),
            })
            .collect();
        let calls: Vec<String> =
            self.emu.power_calls(self.vmid).into_iter().filter(|op| op != "on").collect();
        assert_eq!(calls, recorded, "power calls at the host vs status.powerActions");
    }
}

impl Drop for Migration {
    fn drop(&mut self) {
        self.job_watch.abort();
        self.dv_watch.abort();
    }
}

/// The work volume of the conversion Jobs: a PersistentVolume on the node's
/// path of the controller's work directory (the controller runs in the test
/// process, on the same machine), bound ahead to the claim `vmmigrate-work`
/// that [`create_work_claim`] creates. Until it exists the Jobs' pods cannot
/// be scheduled: the test's way of holding conversions.
pub(crate) async fn work_volume(client: &Client, ns: &str, work: &Path) {
    let pv: PersistentVolume = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": format!("{ns}-work")},
        "spec": {
            "capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "hostPath": {"path": work.to_string_lossy(), "type": "Directory"},
            "claimRef": {"namespace": ns, "name": "vmmigrate-work"},
        },
    }))
    .unwrap();
    Api::<PersistentVolume>::all(client.clone()).create(&PostParams::default(), &pv).await.expect("work PV");
}

pub(crate) async fn create_work_claim(client: &Client, ns: &str) {
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "vmmigrate-work"},
        "spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": format!("{ns}-work"),
            "resources": {"requests": {"storage": "10Gi"}},
        },
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pvc)
        .await
        .expect("work PVC");
}

/// The Service `web` in front of the guest `vm`'s launcher pod (KubeVirt
/// labels it `kubevirt.io/domain: <vm>`, from the VM's template): the
/// endpoints controller fills its EndpointSlice once the pod is ready.
pub(crate) async fn guest_web_service(client: &Client, ns: &str, vm: &str) {
    use k8s_openapi::api::core::v1::Service;
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"kubevirt.io/domain": vm},
                 "ports": [{"name": "http", "port": 80, "targetPort": 80}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns).create(&PostParams::default(), &service).await.unwrap();
}

/// The manifest's three checks (`Migration::create`), each passed.
pub(crate) fn assert_the_three_checks_passed(status: &vmmigrate::api::VirtualMachineMigrationStatus) {
    let results: Vec<(String, bool)> =
        status.validation_results.iter().map(|r| (r.name.clone(), r.passed)).collect();
    assert_eq!(
        results,
        vec![("status-page".into(), true), ("agent".into(), true), ("address".into(), true)],
        "{:#?}",
        status.validation_results
    );
}

/// Records the uid of every object of `api` ever created (a watch sees each
/// one, however short-lived).
pub(crate) fn watch_uids<K>(
    api: Api<K>,
) -> (Arc<std::sync::Mutex<std::collections::HashSet<String>>>, tokio::task::JoinHandle<()>)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt as _;
    use kube::runtime::watcher;
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let record = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
        while let Some(event) = events.next().await {
            if let Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) = event {
                record.lock().unwrap().insert(object.meta().uid.clone().unwrap_or_default());
            }
        }
    });
    (seen, task)
}

pub(crate) fn walk(dir: &Path, f: &mut impl FnMut(&Path)) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        f(&path);
        if path.is_dir() {
            walk(&path, f);
        }
    }
}

/// `ssh host cat <disk>` of every disk, the bare transfer a migration can
/// never beat, timed in the same run as the migration.
pub(crate) fn bare_ssh_cat_seconds(emu: &EsxiEmulator, vmid: &str) -> f64 {
    let start = Instant::now();
    for (path, _, _, size) in emu.disk_files(vmid) {
        let out = emu.ssh_command().arg(format!("cat '{path}'")).output().expect("ssh cat");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout.len() as u64, size);
    }
    start.elapsed().as_secs_f64()
}

/// Stands where the staging Service would during a rollout of the
/// controller: while closed it completes TLS with the staging server's own
/// certificate and answers every request `503 Service Unavailable`; once
/// opened it passes each connection through to the staging server untouched
/// (TLS end to end, the server's credentials check included).
pub(crate) struct UnavailableFront {
    pub(crate) open: Arc<std::sync::atomic::AtomicBool>,
    pub(crate) refused: Arc<std::sync::atomic::AtomicUsize>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl UnavailableFront {
    pub(crate) fn start(listener: tokio::net::TcpListener, staging: &StagingServer) -> UnavailableFront {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tls = tokio_rustls::TlsAcceptor::from(staging.access().tls());
        let upstream = staging.local_addr();
        let (is_open, count) = (open.clone(), refused.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (tls, is_open, count) = (tls.clone(), is_open.clone(), count.clone());
                tokio::spawn(async move {
                    if is_open.load(Ordering::SeqCst) {
                        if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut stream, &mut server).await;
                        }
                        return;
                    }
                    let Ok(mut stream) = tls.accept(stream).await else { return };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    let body = "the staging server is starting\n";
                    let answer = format!(
                        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        UnavailableFront { open, refused, task }
    }

    pub(crate) fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    pub(crate) fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for UnavailableFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Migration {
    /// Waits until the copy after the power-off has `bytes` of the disks
    /// (the controller's own count, `status.progress`, which grows with
    /// every buffer received) and is still under way: a fault injected
    /// now lands mid-copy.
    pub(crate) async fn wait_copying(&self, bytes: u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let vmm = self.get().await;
            let status = vmm.status.clone().unwrap_or_default();
            let done = status.progress.as_ref().map_or(0, |p| p.bytes_done.max(0) as u64);
            let copying =
                phase_of(&vmm) == Phase::Preparing && status.timestamps.source_powered_off.is_some();
            if copying && done >= bytes {
                let total = status.progress.as_ref().map_or(0, |p| p.bytes_total.max(0) as u64);
                assert!(done < total, "the copy ended before the fault: {done} of {total} bytes");
                return;
            }
            assert!(Instant::now() < deadline, "the copy never got to {bytes} bytes: {:#?}", vmm.status);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What every fault case must end with.
    pub(crate) async fn assert_survived(&self) -> vmmigrate::api::VirtualMachineMigrationStatus {
        self.assert_survived_within(WAIT).await
    }

    /// [`Self::assert_survived`], the migration given `limit` to complete.
    pub(crate) async fn assert_survived_within(
        &self,
        limit: Duration,
    ) -> vmmigrate::api::VirtualMachineMigrationStatus {
        self.assert_survived_with(limit, false).await
    }

    /// [`Self::assert_survived_within`]; with `stall_may_redo`, the imports
    /// may also have been given up on once (`ImportStalled`, or
    /// `ImportFailed` after the importer's restarts) and made again: two
    /// DataVolumes per disk ever then.
    pub(crate) async fn assert_survived_with(
        &self,
        limit: Duration,
        stall_may_redo: bool,
    ) -> vmmigrate::api::VirtualMachineMigrationStatus {
        let done = self.wait_completed_within(limit).await.status.unwrap();
        self.assert_source_off_and_untouched().await;
        let at_power_off = self.source_sha256_at_start();
        let recorded: Vec<String> = done.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
        assert_eq!(recorded, at_power_off, "recorded: the disks at the power-off");
        assert_eq!(self.imported_sha256(2).await, at_power_off, "imported: the disks at the power-off");
        let ever = self.dvs_seen.lock().unwrap().len();
        let redone =
            done.errors.iter().any(|e| matches!(e.reason.as_str(), "ImportStalled" | "ImportFailed"));
        if stall_may_redo && redone {
            assert_eq!(
                ever,
                4,
                "one DataVolume per disk, and one more after the redo: {:#?}",
                reasons(&done)
            );
        } else {
            assert_eq!(ever, 2, "one DataVolume per disk, ever: {:#?}", reasons(&done));
        }
        let deletes = self.assert_deleted_only_its_own().await;
        eprintln!(
            "{}: survived; {deletes} delete(s) by vmmigrate, all its own; errors on the way: {:#?}",
            self.ns,
            reasons(&done)
        );
        done
    }

    /// Every delete the controller made in the namespace (the API server's
    /// audit log, by vmmigrate's `User-Agent`) removed an object of this
    /// migration: labelled with its uid or owned by it, and named by uid
    /// (`preconditions.uid`). Returns how many there were.
    pub(crate) async fn assert_deleted_only_its_own(&self) -> usize {
        let uid = self.get().await.metadata.uid.expect("the migration's uid");
        let Some(deletes) = self.env.audited_deletes(&self.ns) else { return 0 };
        let agent = vmmigrate::ports::user_agent("controller");
        let ours: Vec<_> =
            deletes.expect("the audit log").into_iter().filter(|d| d.user_agent == agent).collect();
        for d in &ours {
            let label = d.labels.get("migration.platform.example/migration-uid");
            let owned = label == Some(&uid) || d.owner_uids.contains(&uid);
            let answered = (200..300).contains(&d.code);
            assert!(
                !answered || owned,
                "vmmigrate deleted {} {} ({:?}), which is not this migration's: {d:?}",
                d.resource,
                d.name,
                d.uid
            );
            assert!(
                d.precondition_uid.is_some(),
                "vmmigrate deleted {} {} without naming its uid: {d:?}",
                d.resource,
                d.name
            );
        }
        ours.len()
    }
}

/// The reasons of `status.errors`, for messages.
pub(crate) fn reasons(status: &vmmigrate::api::VirtualMachineMigrationStatus) -> Vec<String> {
    status.errors.iter().map(|e| format!("{}: {}", e.reason, e.message)).collect()
}
