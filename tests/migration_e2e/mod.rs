//! A whole migration with every real part this machine can run: the ESXi
//! emulator (real OpenSSH, BusyBox, vim-cmd scripts, VMDKs made by qemu-img)
//! → the real SSH copy with sha256 → real qemu-img → the real staging HTTPS
//! server → real CDI v1.65.0 (its importer pods download with per-artifact
//! credentials, check the sha256 themselves and write real PersistentVolumes
//! of the node's provisioner; their restarts and failures are CDI's own) →
//! real DataVolume, VirtualMachine and VMI objects in the real kube-apiserver
//! → then, for the VMs whose disks are real guests (the emulator's
//! `GUEST_VMS`, built by `tools/guest/build.sh`), real KubeVirt v1.8.0 on a
//! cluster of its own: real virt-api admits and rewrites the VM, real
//! virt-controller and virt-handler start a virt-launcher pod whose QEMU
//! boots the imported bytes in software emulation, and the checks talk to
//! the guest itself (its own web server through a Service, its real
//! qemu-guest-agent) → Completed. The other tests end in the KubeVirt
//! simulator on the shared cluster, with busybox httpd in a network
//! namespace playing db-02's application: they are about CDI and the
//! controller, not the guest.
//! Conversion Jobs are real Jobs: the scheduler places their pods on the test
//! cluster's node and the kubelet runs them from the release image, on a
//! PersistentVolume holding the controller's work directory.

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
use vmmigrate::destination::cluster::{
    data_volume_resource, virtual_machine_instance_resource, virtual_machine_resource,
};
use vmmigrate::metrics::Metrics;

mod faults;
mod interference;
mod rehearsal;
mod warm;
mod worker_pods;

/// What a step may take on a loaded two-core machine running the whole suite.
const WAIT: Duration = Duration::from_secs(300);
const VM: &str = "db-02";
const VMID: &str = "2";
const PAGE: &str = "<html><body><h1>db-02 status page</h1><p>migrated from ESXi</p></body></html>\n";

struct Migration {
    client: Client,
    ns: String,
    /// The source VM's name and vmid on the emulated host.
    vm: &'static str,
    vmid: &'static str,
    kubevirt: Kubevirt,
    api: Api<VirtualMachineMigration>,
    emu: EsxiEmulator,
    work: WorkDir,
    opts: ControllerOptions,
    staging: StagingServer,
    _sims: Option<kubevirt_sim::Simulators>,
    /// Every conversion Job ever created in the namespace, by uid.
    jobs_seen: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    job_watch: tokio::task::JoinHandle<()>,
    /// Every DataVolume ever created in the namespace, by uid.
    dvs_seen: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    dv_watch: tokio::task::JoinHandle<()>,
    _netns: Option<Netns>,
    _cdi_definition: Option<tokio::sync::RwLockReadGuard<'static, ()>>,
    /// What the adapters and the staging server record into (one registry
    /// across controller restarts, like the Service's view of the pods).
    metrics: Arc<Metrics>,
    controller: Option<tokio::task::JoinHandle<()>>,
    /// What importer pods reach instead of the staging server, when the test
    /// asked for one.
    front: Option<UnavailableFront>,
    /// Where the migration reaches the ESXi host: loopback, or the host end
    /// of the node's veth when worker pods copy.
    source_host: String,
}

/// What a real guest showed ([`Migration::guest_facts`]).
struct GuestFacts {
    console: String,
    page: String,
    interfaces: Vec<Value>,
}

/// What runs the migrated VM.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kubevirt {
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
enum Cdi {
    /// Real CDI v1.65.0 on the node: importer pods download from the staging
    /// server into PersistentVolumes of the node's provisioner.
    Real,
    /// Real CDI while its DataVolume definition lacks `checksum`
    /// ([`CdiWithoutChecksum`], held by the test).
    RealWithoutChecksum,
}

/// The controller's work directory: a temporary one, or the test's.
struct WorkDir {
    _own: Option<tempfile::TempDir>,
    path: PathBuf,
}

impl WorkDir {
    fn new(given: Option<PathBuf>) -> WorkDir {
        match given {
            Some(path) => WorkDir { _own: None, path },
            None => {
                let own = tempfile::tempdir().expect("work dir");
                WorkDir { path: own.path().to_path_buf(), _own: Some(own) }
            }
        }
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// How a [`Migration`] is set up: every choice, each with its usual value.
#[derive(Clone)]
struct Setup {
    cdi: Cdi,
    /// Importer pods reach the staging server through an
    /// [`UnavailableFront`], which answers 503 until the test opens it.
    front: bool,
    kubevirt: Kubevirt,
    /// The source VM's name and vmid on the emulated host.
    vm: (&'static str, &'static str),
    data_plane: DataPlane,
    snapshot_format: crate::support::vmdk_delta::DeltaFormat,
    /// On the cluster whose control plane the fault tests break
    /// (`KubeEnv::shared_faults`), instead of the shared one.
    fault_cluster: bool,
    /// The controller's work directory, when the test gives one (a small
    /// file system that fills, say).
    work_dir: Option<PathBuf>,
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
            fault_cluster: false,
            work_dir: None,
        }
    }
}

impl Migration {
    async fn new(prefix: &str) -> Migration {
        Migration::start(prefix, Setup::default()).await
    }

    async fn with(prefix: &str, cdi: Cdi) -> Migration {
        Migration::start(prefix, Setup { cdi, ..Default::default() }).await
    }

    async fn with_front(prefix: &str, cdi: Cdi, front: bool) -> Migration {
        Migration::start(prefix, Setup { cdi, front, ..Default::default() }).await
    }

    /// db-02 with its data plane in worker pods (`--data-plane pods`).
    async fn with_worker_pods(prefix: &str) -> Migration {
        Migration::start(prefix, Setup { data_plane: DataPlane::Pods, ..Default::default() }).await
    }

    /// VM 12 `pair` (two disks, 24 + 8 MiB, powered on with Tools), for
    /// warm migrations; its snapshots are seSparse (VMFS6).
    async fn pair(prefix: &str) -> Migration {
        Migration::pair_with(prefix, crate::support::vmdk_delta::DeltaFormat::SeSparse).await
    }

    /// [`Self::pair`] with snapshots in `format` (vmfsSparse: VMFS5).
    async fn pair_with(prefix: &str, format: crate::support::vmdk_delta::DeltaFormat) -> Migration {
        let setup = Setup { vm: ("pair", "12"), snapshot_format: format, ..Default::default() };
        Migration::start(prefix, setup).await
    }

    /// The real guest `vm` of the emulator's `GUEST_VMS`, on real KubeVirt.
    async fn guest(prefix: &str, vm: &'static str) -> Migration {
        let (vmid, vm) = esxi_emulator::GUEST_VMS
            .iter()
            .find(|(_, name)| *name == vm)
            .copied()
            .unwrap_or_else(|| panic!("{vm} is not a guest VM of the emulator"));
        Migration::start(prefix, Setup { kubevirt: Kubevirt::Real, vm: (vm, vmid), ..Default::default() })
            .await
    }

    async fn start(prefix: &str, setup: Setup) -> Migration {
        let Setup {
            cdi,
            front,
            kubevirt,
            vm: (vm, vmid),
            data_plane,
            snapshot_format,
            fault_cluster,
            work_dir,
        } = setup;
        let env = match kubevirt {
            Kubevirt::Simulated if fault_cluster => tokio::task::block_in_place(KubeEnv::shared_faults),
            Kubevirt::Simulated => tokio::task::block_in_place(KubeEnv::shared),
            Kubevirt::Real => tokio::task::block_in_place(KubeEnv::shared_kubevirt),
        };
        // The conversion Jobs' image; built and imported on first use.
        let image = tokio::task::block_in_place(|| env.controller_image()).expect("the release image");
        // The no-checksum test changes CDI on the shared cluster only.
        let cdi_definition = if cdi == Cdi::Real && kubevirt == Kubevirt::Simulated && !fault_cluster {
            Some(CDI_DEFINITION.read().await)
        } else {
            None
        };
        let node_ip = env.node.as_ref().expect("the shared cluster has a node").host_ip;
        let client = env.client().await;
        ensure_storage_class(&client).await;
        let ns = test_namespace(&client, prefix).await;
        let guests = match kubevirt {
            Kubevirt::Simulated => None,
            Kubevirt::Real => Some(tokio::task::block_in_place(setup::guest_images).expect("guest images")),
        };
        // Worker pods reach the host where pods reach the host: the node's veth.
        let also_listen = (data_plane == DataPlane::Pods).then_some(node_ip);
        let pair_disk_mib = (vm == "pair").then_some((24, 8));
        let emu = EsxiEmulator::start(EsxiOptions {
            guests,
            also_listen,
            pair_disk_mib,
            snapshot_format,
            ..Default::default()
        })
        .expect("ESXi emulator");
        let source_host = also_listen.map_or_else(|| "127.0.0.1".to_owned(), |ip| ip.to_string());
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "esxi"},
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
            job_image: Some(image),
            job_namespace: None,
            work_claim: Some("vmmigrate-work".into()),
            instance: "e2e".into(),
            // The source-VM claims live in the controller's namespace: here the test's.
            leader_election: service::LeaderElectionOptions {
                lease_namespace: ns.clone(),
                ..Default::default()
            },
            metrics_listen: "127.0.0.1:0".parse().unwrap(),
            destination_rules: Default::default(),
            max_reads_per_host: 2,
            host_reads: Vec::new(),
            max_reads: None,
            data_plane,
            worker_cpu: "100m".into(),
            worker_memory: "64Mi".into(),
            worker_memory_limit: "512Mi".into(),
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
    fn start_controller(&mut self) {
        let adapters =
            service::adapters(self.client.clone(), &self.opts, &self.staging, &self.metrics).unwrap();
        let config = ControllerConfig {
            namespace: Some(self.ns.clone()),
            max_requeue: Some(Duration::from_millis(250)),
            instance: "e2e".into(),
            metrics: self.metrics.clone(),
            ..Default::default()
        };
        let task = reconciler::run(self.client.clone(), adapters, config, std::future::pending());
        self.controller = Some(tokio::spawn(task));
    }

    /// Kills the controller the way a crash would: its task and everything it
    /// ran in process (copies, conversions) stop; then a new one starts.
    async fn kill_and_restart_controller(&mut self) {
        if let Some(task) = self.controller.take() {
            task.abort();
            let _ = task.await;
        }
        self.start_controller();
    }

    async fn create(&self, mutate: impl FnOnce(&mut Value)) {
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
    async fn hold_importer_pods(&self) {
        crate::support::hold_pods(&self.client, &self.ns).await;
    }

    async fn release_importer_pods(&self) {
        crate::support::release_pods(&self.client, &self.ns).await;
    }

    async fn get(&self) -> VirtualMachineMigration {
        self.api.get(self.vm).await.expect("get migration")
    }

    /// Waits for Importing and both disks' DataVolumes; returns them.
    async fn importing_with_both_data_volumes(&self) -> (VirtualMachineMigration, Vec<DynamicObject>) {
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
    async fn wait_for(
        &self,
        what: &str,
        mut done: impl FnMut(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = Instant::now() + WAIT;
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
            assert!(Instant::now() < deadline, "{what}: still {phase} after {WAIT:?}: {:#?}", vmm.status);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls the migration until `done` holds (Failed and
    /// ManualInterventionRequired are `done`'s to judge), or fails after
    /// `WAIT` per phase at most three times over.
    async fn wait_until_stopped(
        &self,
        mut done: impl FnMut(&VirtualMachineMigration) -> bool,
    ) -> VirtualMachineMigration {
        let deadline = Instant::now() + WAIT * 3;
        loop {
            let vmm = self.get().await;
            if done(&vmm) {
                return vmm;
            }
            assert!(
                Instant::now() < deadline,
                "still {} after {:?}: {:#?}",
                phase_of(&vmm),
                WAIT * 3,
                vmm.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What the real guest shows: its serial console (KubeVirt's
    /// `guest-console-log` container), its page (GET / at the address its
    /// VMI reports) and the VMI's `status.interfaces`.
    async fn guest_facts(&self) -> GuestFacts {
        self.guest_facts_of(self.vm).await
    }

    /// [`Self::guest_facts`] of the VM named `vm` in the cluster.
    async fn guest_facts_of(&self, vm: &str) -> GuestFacts {
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

    async fn wait_completed(&self) -> VirtualMachineMigration {
        self.wait_for("Completed", |v| {
            phase_of(v) == Phase::Completed
                && v.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some())
        })
        .await
    }

    async fn list(&self, ar: &kube::core::ApiResource) -> Vec<DynamicObject> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.ns, ar);
        api.list(&ListParams::default()).await.expect("list").items
    }

    /// sha256 of the disk bytes imported into the volume of each disk: for
    /// real CDI the `disk.img` in the PersistentVolume's directory on the
    /// node (its first `size` bytes; CDI grows the image with zeros to fill
    /// the volume).
    async fn imported_sha256(&self, disks: usize) -> Vec<String> {
        self.imported_sha256_of(self.vm, disks).await
    }

    /// [`Self::imported_sha256`] of the disks of the destination VM `vm`.
    async fn imported_sha256_of(&self, vm: &str, disks: usize) -> Vec<String> {
        let mut found = Vec::new();
        for d in 0..disks {
            let dv = format!("{vm}-disk-{d}");
            let image = crate::support::imported_image(&self.client, &self.ns, &dv).await;
            let size = self.emu.disk_files(self.vmid)[d].3;
            let digest = vmmigrate::convert::artifact::volume_digest(&image, size)
                .unwrap_or_else(|e| panic!("{}: {e}", image.display()));
            assert_eq!(digest.nonzero_tail_bytes, 0, "{}: bytes after the disk", image.display());
            found.push(digest.sha256);
        }
        found
    }

    /// The source disks' sha256 as they are on the emulated datastore now.
    fn source_sha256_now(&self) -> Vec<String> {
        self.emu
            .disk_files(self.vmid)
            .iter()
            .map(|(_, path, _, _)| sha256_file(path, None).unwrap().1)
            .collect()
    }

    fn source_sha256_at_start(&self) -> Vec<String> {
        self.emu.disk_files(self.vmid).iter().map(|(_, _, sha, _)| sha.clone()).collect()
    }

    /// Files left for this migration in the work directory.
    fn leftovers(&self, uid: &str) -> Vec<PathBuf> {
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
    async fn assert_source_off_and_untouched(&self) {
        assert_eq!(self.emu.vm_power(self.vmid), "off");
        assert_eq!(self.emu.power_off_transitions(self.vmid), 1, "powered off exactly once");
        assert_eq!(self.source_sha256_now(), self.source_sha256_at_start(), "the source disks were written");
        self.assert_power_calls_recorded().await;
    }

    /// Every power call the host saw (counted at the host, each call, not
    /// each change) is one of `status.powerActions`, in order, and the
    /// other way round.
    async fn assert_power_calls_recorded(&self) {
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
async fn work_volume(client: &Client, ns: &str, work: &Path) {
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

async fn create_work_claim(client: &Client, ns: &str) {
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
async fn guest_web_service(client: &Client, ns: &str, vm: &str) {
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
fn assert_the_three_checks_passed(status: &vmmigrate::api::VirtualMachineMigrationStatus) {
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
fn watch_uids<K>(
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

fn walk(dir: &Path, f: &mut impl FnMut(&Path)) {
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
fn bare_ssh_cat_seconds(emu: &EsxiEmulator, vmid: &str) -> f64 {
    let start = Instant::now();
    for (path, _, _, size) in emu.disk_files(vmid) {
        let out = emu.ssh_command().arg(format!("cat '{path}'")).output().expect("ssh cat");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout.len() as u64, size);
    }
    start.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_disk_efi_vm_with_two_nics_migrates_to_completed_with_checksums_end_to_end() {
    let m = Migration::new("e2e-full").await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let wall = started.elapsed().as_secs_f64();
    let cat = bare_ssh_cat_seconds(&m.emu, VMID);
    let total: u64 = m.emu.disk_files(VMID).iter().map(|d| d.3).sum();
    eprintln!(
        "end-to-end migration of {} MiB in two disks: {wall:.2} s; bare `ssh cat` of the same disks: {cat:.2} s",
        total >> 20
    );
    let status = vmm.status.clone().unwrap();
    let uid = vmm.uid().unwrap();

    // sha256 end to end: source disk = copy = artifact = imported bytes.
    let source = m.source_sha256_at_start();
    assert_eq!(source.len(), 2);
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, source, "sha256 of the copies");
    let artifacts: Vec<String> = status.disks.iter().map(|d| d.artifact_sha256.clone().unwrap()).collect();
    assert_eq!(artifacts, source, "a raw artifact is the copy itself");
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");

    // The rendered VirtualMachine matches the inventory, field by field.
    let inventory = status.source_inventory.clone().unwrap();
    let vms = m.list(&virtual_machine_resource()).await;
    assert_eq!(vms.len(), 1);
    let vm = &vms[0].data["spec"];
    let domain = &vm["template"]["spec"]["domain"];
    assert_eq!(vm["runStrategy"], "Always");
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], json!(inventory.secure_boot));
    assert_eq!(domain["cpu"]["sockets"], json!(inventory.cpu_sockets));
    assert_eq!(domain["cpu"]["cores"], json!(inventory.cores_per_socket));
    assert_eq!(inventory.cpu_sockets * inventory.cores_per_socket, 4, "db-02 has 4 vCPUs");
    assert_eq!(domain["memory"]["guest"], json!(format!("{}Mi", inventory.memory_mib)));
    assert_eq!(inventory.memory_mib, 4096);
    let disks = domain["devices"]["disks"].as_array().unwrap();
    let volumes = vm["template"]["spec"]["volumes"].as_array().unwrap();
    assert_eq!((disks.len(), volumes.len(), inventory.disks.len()), (2, 2, 2));
    for (i, source_disk) in inventory.disks.iter().enumerate() {
        let bus = if matches!(source_disk.bus.as_str(), "ide" | "sata") { "sata" } else { "virtio" };
        assert_eq!(disks[i]["disk"]["bus"], bus, "disk {i} on {}", source_disk.bus);
        assert_eq!(volumes[i]["dataVolume"]["name"], format!("{VM}-disk-{i}"));
    }
    assert_eq!(disks[0]["bootOrder"], 1);
    let interfaces = domain["devices"]["interfaces"].as_array().unwrap();
    let networks = vm["template"]["spec"]["networks"].as_array().unwrap();
    assert_eq!(inventory.nics.len(), 2);
    for (i, nic) in inventory.nics.iter().enumerate() {
        let model = if nic.model == "vmxnet3" { "virtio" } else { nic.model.as_str() };
        assert_eq!(interfaces[i]["model"], model, "nic {i} was {}", nic.model);
        assert_eq!(interfaces[i]["macAddress"], nic.mac_address.as_str(), "MAC of nic {i} preserved");
    }
    assert_eq!((inventory.nics[0].model.as_str(), inventory.nics[1].model.as_str()), ("vmxnet3", "e1000"));
    assert!(interfaces[0].get("masquerade").is_some() && networks[0].get("pod").is_some());
    assert!(interfaces[1].get("bridge").is_some());
    assert_eq!(networks[1]["multus"]["networkName"], "dmz");
    assert_eq!(vms[0].labels()["migration.platform.example/migration-uid"], uid);

    // Every check ran against the real thing and passed.
    assert_the_three_checks_passed(&status);
    let dvs = m.list(&data_volume_resource()).await;
    assert_eq!(dvs.len(), 2);
    // Real CDI v1.65 checked each download against the copy's sha256.
    for (dv, disk) in dvs.iter().zip(&status.disks) {
        let checksum = &dv.data["spec"]["source"]["http"]["checksum"];
        assert_eq!(checksum, &json!(format!("sha256:{}", disk.artifact_sha256.clone().unwrap())));
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::CdiChecksum));
    }
    // Imported over TLS with per-artifact credentials, which are gone now.
    for dv in &dvs {
        let http = &dv.data["spec"]["source"]["http"];
        assert!(http["url"].as_str().unwrap().starts_with("https://"), "{http}");
        assert_eq!(http["secretRef"], format!("{}-import", dv.name_any()));
        assert_eq!(http["certConfigMap"], format!("{}-import-ca", dv.name_any()));
    }
    let ours = ListParams::default().labels(&format!("migration.platform.example/migration-uid={uid}"));
    let secrets: Api<Secret> = Api::namespaced(m.client.clone(), &m.ns);
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(m.client.clone(), &m.ns);
    assert!(secrets.list(&ours).await.unwrap().items.is_empty(), "import Secrets left after Completed");
    assert!(maps.list(&ours).await.unwrap().items.is_empty(), "import CAs left after Completed");
    let staging = m.staging.stats();
    assert_eq!(staging.unauthorized.load(Ordering::Relaxed), 0);

    // The real adapters and the staging server counted every byte once.
    let text = m.metrics.encode();
    let counter = |name: &str| -> u64 {
        let line =
            text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("no {name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(counter("vmmigrate_copy_bytes_total"), total, "read from the host");
    assert_eq!(counter("vmmigrate_convert_bytes_total"), total, "raw artifacts of the copies' size");
    assert_eq!(counter("vmmigrate_staging_bytes_served_total"), total, "each artifact imported once");

    // Nothing staged or copied is left; the source is off and untouched.
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_efi_guest_with_two_disks_boots_on_real_kubevirt_from_the_copied_bytes_and_completes_with_checksums_end_to_end()
 {
    let m = Migration::guest("e2e-efi", "app-efi").await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let wall = started.elapsed().as_secs_f64();
    let cat = bare_ssh_cat_seconds(&m.emu, m.vmid);
    let total: u64 = m.emu.disk_files(m.vmid).iter().map(|d| d.3).sum();
    eprintln!(
        "EFI guest on real KubeVirt, {} MiB in two disks: {wall:.1} s to Completed; bare `ssh cat`: {cat:.2} s",
        total >> 20
    );
    let status = vmm.status.clone().unwrap();

    // sha256 end to end: source disk = copy = artifact = imported bytes.
    let source = m.source_sha256_at_start();
    assert_eq!(source.len(), 2);
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, source, "sha256 of the copies");
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");

    // Real virt-api admitted the VM, with UEFI and without secure boot as on the source.
    let inventory = status.source_inventory.clone().unwrap();
    assert!(inventory.firmware == vmmigrate::api::Firmware::Efi && !inventory.secure_boot);
    let vms = m.list(&virtual_machine_resource()).await;
    let domain = &vms[0].data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], false);
    assert_eq!(domain["machine"]["type"], "q35", "virt-api's defaults are there");

    // Every check ran against the guest and passed.
    assert_the_three_checks_passed(&status);
    // The guest booted from the imported bytes under UEFI (OVMF) and saw
    // both disks, the second with the data disk's file system.
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware efi"), "console:\n{}", guest.console);
    assert!(guest.page.contains("vmmigrate-guest app-efi"), "{}", guest.page);
    let disks_line = guest.page.lines().find(|l| l.starts_with("disks:")).unwrap_or_default();
    assert_eq!(disks_line.split_whitespace().count(), 3, "two disks: {}", guest.page);
    assert!(guest.page.contains("vmmdata"), "the data disk's label: {}", guest.page);
    let iface = &guest.interfaces[0];
    assert!(iface["infoSource"].as_str().unwrap_or("").contains("guest-agent"), "{iface}");
    assert_eq!(iface["mac"], "00:0c:29:aa:bb:09", "the guest sees the source's MAC");
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_killed_during_converting_and_importing_completes_with_one_job_and_data_volume_per_disk() {
    let mut m = Migration::new("e2e-kill").await;
    let data_volumes: Api<DynamicObject> =
        Api::namespaced_with(m.client.clone(), &m.ns, &data_volume_resource());
    let (dvs_seen, dv_watch) = watch_uids(data_volumes);
    // The Jobs' pods wait for the work claim, created after the first kill.
    m.create(|body| {
        body["spec"]["conversion"] = json!({"format": "qcow2", "runner": "job"});
    })
    .await;

    // Converting: both Jobs and their pods exist (held); no pod may start
    // after them (real CDI's importers wait for the quota to go); kill the
    // controller, release the Jobs.
    let jobs: Api<Job> = Api::namespaced(m.client.clone(), &m.ns);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(m.client.clone(), &m.ns);
    m.wait_for("two conversion Jobs", |v| phase_of(v) == Phase::Converting).await;
    let deadline = Instant::now() + WAIT;
    while jobs.list(&ListParams::default()).await.unwrap().items.len() < 2
        || pods.list(&ListParams::default().labels("job-name")).await.unwrap().items.len() < 2
    {
        assert!(Instant::now() < deadline, "the conversion Jobs and their pods were never created");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    m.hold_importer_pods().await;
    m.kill_and_restart_controller().await;
    create_work_claim(&m.client, &m.ns).await;

    // Importing: both DataVolumes exist (held); kill again, release the imports.
    m.importing_with_both_data_volumes().await;
    m.kill_and_restart_controller().await;
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    dv_watch.abort();
    let status = vmm.status.unwrap();
    assert_eq!(m.jobs_seen.lock().unwrap().len(), 2, "one conversion Job per disk");
    assert_eq!(dvs_seen.lock().unwrap().len(), 2, "one DataVolume per disk");
    assert!(jobs.list(&ListParams::default()).await.unwrap().items.is_empty(), "Jobs are cleaned up");
    // qcow2 artifacts: CDI's importer converted them back to raw; the bytes
    // are the source's.
    assert!(status.disks.iter().all(|d| d.artifact_format.as_deref() == Some("qcow2")));
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_in_a_staged_artifact_is_caught_retried_and_only_the_source_bytes_end_in_the_volumes()
{
    let m = Migration::new("e2e-flip").await;
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let uid = vmm.uid().unwrap();
    let staged = m.work.path().join("staging").join(&uid).join("disk-0.raw");
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&staged).expect("staged artifact");
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, 4096).unwrap();
        file.write_all_at(&[byte[0] ^ 0x01], 4096).unwrap();
    }
    m.release_importer_pods().await;

    // Real CDI's importer gets the file without its last bytes (the staging
    // server withholds them from a file that no longer matches its marker):
    // CDI's checksum check fails it, or the importer fails until the
    // controller gives up; either way Converting finds the corrupt copy.
    let deadline = Instant::now() + Duration::from_secs(600);
    let vmm = loop {
        let vmm = m.get().await;
        if phase_of(&vmm) == Phase::Completed
            && vmm.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some())
        {
            break vmm;
        }
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        assert!(Instant::now() < deadline, "still {}: {:#?}", phase_of(&vmm), vmm.status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let status = vmm.status.unwrap();
    let reasons: Vec<&str> = status.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons.iter().any(|r| *r == "ImportChecksumMismatch" || *r == "ImportFailed"),
        "the bad import was seen: {reasons:?}"
    );
    assert!(
        reasons.contains(&"AcquiredCopyCorrupt"),
        "the corrupt copy was found and copied again: {reasons:?}"
    );
    assert!(m.staging.stats().corrupt_detected.load(Ordering::SeqCst) >= 1, "the staging server withheld it");
    // Never imported: the only successful imports carry the source's bytes.
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}

/// The controller's reconcile count (ok and error) from its metrics.
fn reconciles(metrics: &Metrics) -> u64 {
    metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("vmmigrate_reconcile_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// What the API server records of the VM's writers: its generation (bumped
/// by every change to the spec) and, per field manager other than
/// KubeVirt's own controllers (which keep the VM's status), the time of its
/// last write.
async fn vm_writers(vms: &Api<DynamicObject>, name: &str) -> (i64, Vec<(String, String)>) {
    let vm = vms.get(name).await.unwrap();
    let mut writers: Vec<(String, String)> = vm
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|f| !matches!(f.manager.as_deref(), Some("virt-controller" | "virt-handler" | "virt-api")))
        .map(|f| (f.manager.unwrap_or_default(), f.time.map(|t| format!("{t:?}")).unwrap_or_default()))
        .collect();
    writers.sort();
    (vm.metadata.generation.unwrap_or_default(), writers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completed_vm_rewritten_by_real_virt_api_gets_no_writes_over_20_reconciles_and_a_later_change_is_reported_not_undone()
 {
    let m = Migration::guest("e2e-drift", "app-bios").await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    m.wait_completed().await;
    let vms: Api<DynamicObject> = Api::namespaced_with(m.client.clone(), &m.ns, &virtual_machine_resource());
    let stored = vms.get(m.vm).await.unwrap();
    let domain = &stored.data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["machine"]["type"], "q35", "rewritten by real virt-api's mutating webhook");
    let at_completed = vm_writers(&vms, m.vm).await;

    // 20 reconciles forced by touching the migration: no write to the VM.
    for i in 0..20 {
        let before = reconciles(&m.metrics);
        let poke = json!({ "metadata": { "annotations": { "test.vmmigrate/poke": i.to_string() } } });
        m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&poke)).await.unwrap();
        let deadline = Instant::now() + WAIT;
        while reconciles(&m.metrics) <= before {
            assert!(Instant::now() < deadline, "reconcile {i} never ran");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(vm_writers(&vms, m.vm).await, at_completed, "the VM was written after Completed");

    // A person gives the VM more memory: reported as drift, not undone.
    let more = json!({ "spec": { "template": { "spec": { "domain": { "memory": { "guest": "320Mi" },
                        "resources": { "requests": { "memory": "320Mi" } } } } } } });
    vms.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&more)).await.unwrap();
    let vmm = m
        .wait_for("VMDrifted", |v| {
            v.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "VMDrifted" && c.status == vmmigrate::api::ConditionStatus::True)
            })
        })
        .await;
    let status = vmm.status.clone().unwrap();
    let drifted = status.conditions.iter().find(|c| c.type_ == "VMDrifted").unwrap();
    assert!(drifted.message.contains("memory.guest"), "{}", drifted.message);
    assert_eq!(status.phase, Phase::Completed);
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(m.client.clone(), &m.ns);
    let deadline = Instant::now() + WAIT;
    loop {
        let list = events.list(&ListParams::default()).await.unwrap().items;
        if list.iter().any(|e| {
            e.reason.as_deref() == Some("VMDrifted") && e.involved_object.name.as_deref() == Some(m.vm)
        }) {
            break;
        }
        assert!(Instant::now() < deadline, "no VMDrifted Event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // More reconciles: the person's change stands, the controller wrote nothing.
    let after_change = vm_writers(&vms, m.vm).await;
    for i in 0..3 {
        let before = reconciles(&m.metrics);
        let poke = json!({ "metadata": { "annotations": { "test.vmmigrate/poke": format!("after-{i}") } } });
        m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&poke)).await.unwrap();
        while reconciles(&m.metrics) <= before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(vm_writers(&vms, m.vm).await, after_change, "the controller wrote to the changed VM");
    assert_eq!(
        vms.get(m.vm).await.unwrap().data["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
        "320Mi"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bios_guest_boots_from_the_copied_bytes_on_real_kubevirt_and_its_own_page_agent_and_address_pass() {
    let m = Migration::guest("e2e-bios", "app-bios").await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    eprintln!(
        "BIOS guest, merge of the manifest to Completed on real KubeVirt: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let status = vmm.status.clone().unwrap();
    let source = m.source_sha256_at_start();
    assert_eq!(m.imported_sha256(1).await, source, "the bytes in the PVC are the source's");
    assert_the_three_checks_passed(&status);
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware bios"), "console:\n{}", guest.console);
    assert!(
        guest.page.contains("vmmigrate-guest app-bios") && guest.page.contains("firmware: bios"),
        "{}",
        guest.page
    );
    let iface = &guest.interfaces[0];
    assert!(iface["infoSource"].as_str().unwrap_or("").contains("guest-agent"), "{iface}");
    assert_eq!(iface["mac"], "00:0c:29:aa:bb:08", "the guest sees the source's MAC");
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_secure_boot_guest_boots_on_real_kubevirt_with_secure_boot_and_smm_through_its_signed_shim() {
    let m = Migration::guest("e2e-secure", "app-secure").await;
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.clone().unwrap();
    let inventory = status.source_inventory.clone().unwrap();
    assert!(inventory.firmware == vmmigrate::api::Firmware::Efi && inventory.secure_boot, "{inventory:?}");
    let vms = m.list(&virtual_machine_resource()).await;
    let domain = &vms[0].data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], true);
    assert_eq!(domain["features"]["smm"]["enabled"], true, "secure boot needs SMM");
    assert!(status.validation_results.iter().all(|r| r.passed), "{:#?}", status.validation_results);
    // OVMF with Microsoft's keys verified Debian's shim, GRUB and kernel:
    // the kernel says secure boot is on, and so does the guest.
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware efi"), "console:\n{}", guest.console);
    assert!(guest.console.contains("vmmigrate-guest: secureboot on"), "console:\n{}", guest.console);
    assert!(guest.page.contains("secureboot: on"), "{}", guest.page);
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disk_without_an_os_runs_but_fails_its_checks_retries_and_waits_for_a_person_never_completed() {
    let m = Migration::guest("e2e-no-os", "no-os").await;
    m.create(|body| {
        body["spec"]["strategy"]["retryLimit"] = json!(1);
        body["spec"]["strategy"]["onRetriesExhausted"] = json!("ManualIntervention");
        body["spec"]["strategy"]["timeouts"]["validatingSeconds"] = json!(30);
    })
    .await;
    let mut phases = Vec::new();
    let vmm = m
        .wait_until_stopped(|v| {
            let phase = phase_of(v);
            if phases.last() != Some(&phase) {
                phases.push(phase);
            }
            assert_ne!(phase, Phase::Completed, "a disk without an OS completed: {:#?}", v.status);
            phase == Phase::ManualInterventionRequired
        })
        .await;
    assert!(phases.contains(&Phase::Validating), "{phases:?}");
    let status = vmm.status.clone().unwrap();
    let timeouts: Vec<_> =
        status.errors.iter().filter(|e| e.reason == vmmigrate::api::Reason::ValidationTimeout).collect();
    assert!(timeouts.len() >= 2, "validated again within its retry budget first: {:#?}", status.errors);
    // The VMI ran: QEMU started, and what it ran answered nothing.
    let guest = m.guest_facts().await;
    assert!(!guest.console.contains("vmmigrate-guest: booted"), "{}", guest.console);
    let failed: Vec<_> = status.validation_results.iter().filter(|r| !r.passed).collect();
    assert!(!failed.is_empty(), "{:#?}", status.validation_results);
    let error = status.errors.last().expect("an error names what failed");
    assert!(
        ["status-page", "agent", "address"].iter().any(|check| error.message.contains(check)),
        "the message names the check: {}",
        error.message
    );
    eprintln!("no-OS disk stopped with: {}", error.message);
}

/// CDI's DataVolume definition without `spec.source.http.checksum` (as CDI
/// v1.64 and older install it) while this lives; CDI's operator, which would
/// put the field back, is scaled to zero meanwhile. Restored on drop.
struct CdiWithoutChecksum {
    _exclusive: tokio::sync::RwLockWriteGuard<'static, ()>,
}

impl CdiWithoutChecksum {
    async fn install() -> CdiWithoutChecksum {
        let exclusive = CDI_DEFINITION.write().await;
        let env = tokio::task::block_in_place(KubeEnv::shared);
        tokio::task::block_in_place(|| {
            env.kubectl(&["-n", "cdi", "scale", "deployment", "cdi-operator", "--replicas=0"]).unwrap();
            env.kubectl(&[
                "-n",
                "cdi",
                "wait",
                "--for=delete",
                "pod",
                "-l",
                "name=cdi-operator",
                "--timeout=120s",
            ])
            .unwrap();
        });
        let crds: Api<
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
        > = Api::all(env.client().await);
        let crd = crds.get("datavolumes.cdi.kubevirt.io").await.unwrap();
        let versions = crd.spec.versions.len();
        let remove: Vec<Value> = (0..versions)
            .map(|i| json!({ "op": "remove", "path": format!(
                "/spec/versions/{i}/schema/openAPIV3Schema/properties/spec/properties/source/properties/http/properties/checksum") }))
            .collect();
        crds.patch(
            "datavolumes.cdi.kubevirt.io",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(serde_json::from_value(Value::Array(remove)).unwrap()),
        )
        .await
        .expect("removing checksum from the DataVolume definition");
        CdiWithoutChecksum { _exclusive: exclusive }
    }
}

impl Drop for CdiWithoutChecksum {
    fn drop(&mut self) {
        let env = KubeEnv::shared();
        let crds = vmmigrate_harness::setup::upstream().unwrap().join("crds/cdi.yaml");
        let restore = || -> anyhow::Result<()> {
            env.kubectl(&[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=vmmigrate-tests",
                "-f",
                &crds.to_string_lossy(),
            ])?;
            env.kubectl(&["-n", "cdi", "scale", "deployment", "cdi-operator", "--replicas=1"])?;
            Ok(())
        };
        let _ = std::thread::scope(|s| s.spawn(restore).join());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_cdi_that_cannot_check_checksums_each_import_is_read_back_and_compared_before_the_vm_is_created()
 {
    let _old_cdi = CdiWithoutChecksum::install().await;
    let m = Migration::with("e2e-nochecksum", Cdi::RealWithoutChecksum).await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let source = m.source_sha256_at_start();
    for (disk, sha) in status.disks.iter().zip(&source) {
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::VolumeSha256));
        assert_eq!(disk.imported_sha256.as_ref(), Some(sha), "read back from the volume");
    }
    // The DataVolumes went without the field CDI would not have checked.
    for dv in m.list(&data_volume_resource()).await {
        assert!(dv.data["spec"]["source"]["http"].get("checksum").is_none(), "{}", dv.data["spec"]);
    }
    let seen = m.jobs_seen.lock().unwrap().clone();
    assert!(seen.len() >= 2, "a verify Job per disk: {seen:?}");
    assert_eq!(m.imported_sha256(2).await, source);
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_importer_refused_by_the_staging_server_restarts_in_cdi_until_the_controller_gives_up_and_imports_again()
 {
    let m = Migration::new("e2e-refused").await;
    // Hold the importer pods until the credentials are spoilt.
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let secrets: Api<Secret> = Api::namespaced(m.client.clone(), &m.ns);
    let deadline = Instant::now() + WAIT;
    for disk in 0..2 {
        let name = format!("{VM}-disk-{disk}-import");
        while secrets.get_opt(&name).await.unwrap().is_none() {
            assert!(Instant::now() < deadline, "no import Secret {name}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let wrong = json!({ "stringData": { "secretKey": "not-the-key" } });
        secrets
            .patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&wrong))
            .await
            .unwrap();
    }
    m.release_importer_pods().await;

    // CDI restarts the importers (401 from the staging server); after three
    // restarts the controller deletes the DataVolumes, goes back through
    // Converting and imports again with credentials applied anew.
    let deadline = Instant::now() + Duration::from_secs(600);
    let vmm = loop {
        let vmm = m.get().await;
        if phase_of(&vmm) == Phase::Completed {
            break vmm;
        }
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        assert!(Instant::now() < deadline, "still {}: {:#?}", phase_of(&vmm), vmm.status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let status = vmm.status.unwrap();
    let given_up = status
        .errors
        .iter()
        .find(|e| e.reason == vmmigrate::api::Reason::ImportFailed)
        .unwrap_or_else(|| panic!("no ImportFailed: {:#?}", status.errors));
    assert!(given_up.message.contains("failed 3 times"), "{}", given_up.message);
    assert!(given_up.message.contains("401"), "the importer's own words: {}", given_up.message);
    assert!(m.staging.stats().unauthorized.load(Ordering::Relaxed) >= 3, "the staging server refused them");
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

/// Stands where the staging Service would during a rollout of the
/// controller: while closed it completes TLS with the staging server's own
/// certificate and answers every request `503 Service Unavailable`; once
/// opened it passes each connection through to the staging server untouched
/// (TLS end to end, the server's credentials check included).
struct UnavailableFront {
    open: Arc<std::sync::atomic::AtomicBool>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl UnavailableFront {
    fn start(listener: tokio::net::TcpListener, staging: &StagingServer) -> UnavailableFront {
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

    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for UnavailableFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `DiskImported` condition's message, when there is one.
fn disk_imported_message(vmm: &VirtualMachineMigration) -> Option<String> {
    let status = vmm.status.as_ref()?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "DiskImported")
        .map(|c| format!("{}: {}", c.reason, c.message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staging_server_unavailable_for_a_while_restarts_the_importers_and_the_import_completes_without_rework()
 {
    let m = Migration::with_front("e2e-503", Cdi::Real, true).await;
    let front = m.front.as_ref().unwrap();
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;

    // Every importer is answered 503 until each disk's importer has failed
    // at least once and the controller has said so.
    let mut seen_restarting = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen_restarting.is_none() {
        let vmm = m.get().await;
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        if let Some(message) = disk_imported_message(&vmm).filter(|m| m.starts_with("ImporterRestarting"))
            && front.refused() >= 2
        {
            seen_restarting = Some(message);
        }
        assert!(Instant::now() < deadline, "no importer restart reported: {:#?}", vmm.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let message = seen_restarting.unwrap();
    assert!(message.contains("503"), "the importer's own words in the condition: {message}");
    front.open();

    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let reasons: Vec<&str> = status.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.is_empty(), "a transient outage is no failure: {reasons:?}");
    // The same DataVolumes carried on (restarted by CDI, not remade by us),
    // and each artifact was served whole exactly once.
    let dvs = m.list(&data_volume_resource()).await;
    let restarts: i64 = dvs.iter().map(|dv| dv.data["status"]["restartCount"].as_i64().unwrap_or(0)).sum();
    assert!(restarts >= 1, "CDI restarted an importer: {restarts}");
    assert!(
        dvs.iter().all(|dv| dv.data["status"]["restartCount"].as_i64().unwrap_or(0)
            < i64::from(vmmigrate::machine::IMPORTER_RESTART_LIMIT)),
        "no importer reached the give-up limit"
    );
    let total: u64 = m.emu.disk_files(VMID).iter().map(|d| d.3).sum();
    let served = m.staging.stats().bytes_served.load(Ordering::Relaxed);
    assert_eq!(served, total, "each artifact imported once");
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_whose_importer_never_starts_is_given_up_after_the_stall_timeout_and_made_again() {
    let m = Migration::new("e2e-stall").await;
    // No importer pod may start: the DataVolumes sit in their first phase.
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] });
        // Long enough for a loaded node to bind a volume and start an
        // importer once they may; each phase CDI moves through resets it.
        body["spec"]["strategy"]["timeouts"]["importStallSeconds"] = json!(30);
    })
    .await;
    let (first, dvs) = m.importing_with_both_data_volumes().await;
    let first_dvs: std::collections::HashSet<String> = dvs.iter().filter_map(|dv| dv.uid()).collect();
    let stalled = m
        .wait_for("ImportStalled", |v| {
            v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == "ImportStalled"))
        })
        .await;
    let error = stalled.status.unwrap().errors.into_iter().find(|e| e.reason == "ImportStalled").unwrap();
    assert!(error.message.contains("made no progress for"), "{}", error.message);
    assert!(error.message.contains(&format!("{VM}-disk-")), "names the DataVolume: {}", error.message);
    assert_eq!(first.status.unwrap().phase, Phase::Importing);
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    let dvs: std::collections::HashSet<String> =
        m.list(&data_volume_resource()).await.iter().filter_map(|dv| dv.uid()).collect();
    assert!(dvs.is_disjoint(&first_dvs), "the stalled DataVolumes were replaced");
    let status = vmm.status.unwrap();
    assert!(status.errors.iter().all(|e| e.reason == "ImportStalled"), "{:#?}", status.errors);
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bytes_served_under_another_checksum_fail_in_cdis_own_check_and_the_copy_is_imported_again() {
    use vmmigrate::convert::artifact::{Marker, write_marker};
    let m = Migration::new("e2e-checksum").await;
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let (vmm, _) = m.importing_with_both_data_volumes().await;
    // The staged file is replaced by other bytes with a marker of their own:
    // the staging server serves them whole, and only the checksum the
    // DataVolume carries (the copy's) can tell.
    let uid = vmm.uid().unwrap();
    let staged = m.work.path().join("staging").join(&uid).join("disk-0.raw");
    let mut other = std::fs::read(&staged).expect("staged artifact");
    other[4096] ^= 0x01;
    let replacement = staged.with_extension("replacement");
    std::fs::write(&replacement, &other).unwrap();
    std::fs::rename(&replacement, &staged).unwrap();
    let (size, sha256) = sha256_file(&staged, None).unwrap();
    write_marker(&staged, &Marker { size, sha256 }).unwrap();
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let mismatch = status
        .errors
        .iter()
        .find(|e| e.reason == vmmigrate::api::Reason::ImportChecksumMismatch)
        .unwrap_or_else(|| panic!("CDI's checksum check did not fail the import: {:#?}", status.errors));
    assert!(mismatch.message.contains(&format!("{VM}-disk-0")), "{}", mismatch.message);
    assert_eq!(m.staging.stats().corrupt_detected.load(Ordering::SeqCst), 0, "the server could not tell");
    // Only the copy's bytes were ever imported into the volumes that stay.
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}
