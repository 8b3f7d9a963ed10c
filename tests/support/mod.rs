//! What the integration tests share: the harness crate's real parts
//! (control plane, ESXi emulator, simulators, fake forge), the in-memory
//! simulation of every port (`sim`), and the manifests they start from.

pub mod fleet_sim;
pub mod migration;
pub mod sim;

pub use vmmigrate_harness::{
    KubeEnv, esxi_emulator, esxi_snapshots, fake_forge, fault_proxy, full_fs, git_http, kubevirt_sim, netns,
    setup, vmdk_delta,
};

/// A namespace unique to one test, created in the cluster.
pub async fn test_namespace(client: &kube::Client, prefix: &str) -> String {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, PostParams};
    let name = format!("{prefix}-{:08x}", rand_u32());
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))
    .expect("namespace object");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    name
}

/// A loopback port free at the moment of asking, for a child process to
/// bind (it may be taken in between; the caller's start-up then fails loudly).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Reads a raw HTTP/1.1 answer to its end (vmmigrate's servers close the
/// connection after each answer), or as much as arrived before the
/// connection broke; `None` when it takes longer than `within`.
pub async fn read_answer(stream: &mut tokio::net::TcpStream, within: std::time::Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut reply = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut reply)).await;
    read.is_ok().then(|| String::from_utf8_lossy(&reply).into_owned())
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now()) as u32
}

/// The StorageClass `standard` the tests' migrations name (created once; an
/// existing one is fine).
pub async fn ensure_storage_class(client: &kube::Client) {
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::api::{Api, PostParams};
    let sc: StorageClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "standard"}, "provisioner": "kubernetes.io/no-provisioner"
    }))
    .expect("storage class object");
    let _ = Api::<StorageClass>::all(client.clone()).create(&PostParams::default(), &sc).await;
}

/// The phase a migration's status shows (Pending without a status).
pub fn phase_of(vmm: &vmmigrate::api::VirtualMachineMigration) -> vmmigrate::api::Phase {
    vmm.status.as_ref().map(|s| s.phase).unwrap_or_default()
}

/// The migration of the simulated world's VM `web 01` (`support::sim`)
/// into `ns`: the manifest the controller-level tests share. Tests adjust it
/// as JSON before creating it.
pub fn sim_migration_json(ns: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "web-01", "namespace": ns},
        "spec": {
            "source": {
                "host": "esxi01.example.internal",
                "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                "credentialsSecretRef": {"name": "esxi01"},
                "vm": {"name": "web 01"}
            },
            "destination": {"namespace": ns, "storageClassName": "local-path"},
            "networkMap": [{"source": "VM Network", "type": "Pod"}],
            // Patterned disks, not guests: nothing to convert.
            "conversion": {"guest": "none"},
            "powerOffPolicy": "GracefulThenForce",
            "strategy": {"backoff": {"initialSeconds": 1, "maxSeconds": 1}},
            "validation": {"checks": [{"name": "agent", "guestAgent": {}}, {"name": "address", "ip": {}}]}
        }
    })
}

/// Held by every test whose migrations import through real CDI; taken
/// exclusively by the one that changes CDI's DataVolume definition for the
/// whole cluster (`migration_e2e`'s CDI without `checksum`).
pub static CDI_DEFINITION: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Real KubeVirt's virt-api on the cluster for real KubeVirt: every test
/// with a real guest reads it (`migration_e2e::Migration`); the test that
/// takes virt-api down holds it for writing, so no other guest test meets
/// its outage.
pub static VIRT_API: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The simulated world's artifacts, staged as files and served to real CDI's
/// importer pods by the real staging server (HTTPS, per-artifact
/// credentials) on the host end of the node's network; CDI's definition is
/// held as it is while this lives.
pub struct SimStaging {
    _server: vmmigrate::convert::staging::StagingServer,
    _dir: tempfile::TempDir,
    _cdi: tokio::sync::RwLockReadGuard<'static, ()>,
}

pub async fn publish_sim_staging(world: &std::sync::Arc<sim::SimWorld>) -> SimStaging {
    use vmmigrate::convert::access::StagingAccess;
    let cdi = CDI_DEFINITION.read().await;
    let node_ip = KubeEnv::shared().node.as_ref().expect("the shared cluster has a node").host_ip;
    let listener = tokio::net::TcpListener::bind((node_ip, 0)).await.expect("staging listener");
    let url = format!("https://{}", listener.local_addr().unwrap());
    let dir = tempfile::tempdir().expect("staging dir");
    let access = StagingAccess::load_or_create(&dir.path().join("tls"), &url).expect("staging TLS");
    let access = std::sync::Arc::new(access);
    let root = dir.path().join("staging");
    std::fs::create_dir_all(&root).unwrap();
    let server = vmmigrate::convert::staging::StagingServer::start(
        listener,
        root.clone(),
        url.clone(),
        access.clone(),
    )
    .await
    .expect("staging server");
    world.publish(&root, &url, access);
    SimStaging { _server: server, _dir: dir, _cdi: cdi }
}

/// The disk image real CDI imported for DataVolume `dv` of `ns`: `disk.img`
/// in its PersistentVolume's directory on the node (local-path volumes are
/// directories of this machine).
pub async fn imported_image(client: &kube::Client, ns: &str, dv: &str) -> std::path::PathBuf {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let claims: kube::Api<PersistentVolumeClaim> = kube::Api::namespaced(client.clone(), ns);
    let claim = claims.get(dv).await.unwrap_or_else(|e| panic!("claim {ns}/{dv}: {e}"));
    let pv = claim.spec.and_then(|s| s.volume_name).unwrap_or_else(|| panic!("claim {ns}/{dv} is not bound"));
    let pv = kube::Api::<PersistentVolume>::all(client.clone()).get(&pv).await.expect("the claim's volume");
    let spec = pv.spec.unwrap_or_default();
    let dir = spec.host_path.map(|h| h.path).or(spec.local.map(|l| l.path)).expect("a node-local volume");
    std::path::PathBuf::from(dir).join("disk.img")
}

/// Holds every new pod of `ns` the Kubernetes way, real CDI's importers
/// among them: a ResourceQuota of no pods (CDI retries creating them until
/// it goes). Pods that exist already run on.
pub async fn hold_pods(client: &kube::Client, ns: &str) {
    use k8s_openapi::api::core::v1::ResourceQuota;
    let quota: ResourceQuota = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": { "name": "hold-pods" },
        "spec": { "hard": { "pods": "0" } },
    }))
    .unwrap();
    kube::Api::<ResourceQuota>::namespaced(client.clone(), ns)
        .create(&Default::default(), &quota)
        .await
        .expect("hold-pods quota");
}

pub async fn release_pods(client: &kube::Client, ns: &str) {
    use k8s_openapi::api::core::v1::ResourceQuota;
    kube::Api::<ResourceQuota>::namespaced(client.clone(), ns)
        .delete("hold-pods", &Default::default())
        .await
        .expect("release the hold-pods quota");
}

/// The controller's adapters on the simulated world (ESXi, disks, conversion,
/// staging) and the real Kubernetes API (cluster, probes).
/// The simulated source world with the real Kubernetes adapters; source-VM
/// claims are kept in `claims_namespace` (the test's own: tests share the
/// simulated VM's identity).
pub fn sim_adapters(
    client: &kube::Client,
    world: &std::sync::Arc<sim::SimWorld>,
    claims_namespace: &str,
) -> vmmigrate::ports::Adapters {
    use std::sync::Arc;
    use vmmigrate::destination::cluster::KubeCluster;
    use vmmigrate::destination::probe::KubeProber;
    vmmigrate::ports::Adapters {
        esxi: world.clone(),
        disks: world.clone(),
        converter: world.clone(),
        staging: world.clone(),
        cluster: Arc::new(KubeCluster::new(client.clone(), claims_namespace)),
        prober: Arc::new(KubeProber::new(client.clone())),
    }
}

/// Log output captured in memory (a `MakeWriter` through `move || logs.clone()`).
#[derive(Clone, Default)]
pub struct CapturedLogs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    /// Every line, parsed as JSON.
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
    }
}

/// Service `db-web` port 80 → the guest's web server on `ip:8080`. The
/// EndpointSlice is written by the test, standing in for the endpoint
/// controller that would point it at the virt-launcher pod.
pub async fn db_web_service(client: &kube::Client, ns: &str, ip: std::net::Ipv4Addr) {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{Api, PostParams};
    let service: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "db-web"},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns).create(&PostParams::default(), &service).await.unwrap();
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "db-web-1",
                     "labels": {vmmigrate::destination::http_check::SERVICE_NAME_LABEL: "db-web"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip.to_string()], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &slice)
        .await
        .unwrap();
}
