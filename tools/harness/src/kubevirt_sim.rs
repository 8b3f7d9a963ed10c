//! Simulation of the CDI and KubeVirt controllers, which cannot run here (no
//! nodes, no KVM, no storage provisioner). They act on the real API server
//! like the real controllers would, and honestly:
//!
//! - CDI (DataVolume controller + importer pod): each DataVolume of the
//!   namespace gets its own task that walks `status.phase` from ""
//!   through `ImportScheduled` and `ImportInProgress` (with `progress`) to
//!   `Succeeded` or `Failed`, with CDI-like `Bound`/`Ready`/`Running`
//!   conditions. The "importer" streams `spec.source.http.url` (HTTP or
//!   HTTPS, loopback or a Service of the cluster, resolved to a ready endpoint as
//!   cluster DNS and kube-proxy would) into a local directory standing in for the PVC,
//!   sending basic auth from the Secret `secretRef` names (keys `accessKeyId`
//!   and `secretKey`, as CDI's HTTP source does) and trusting for HTTPS only
//!   the PEM certificates of the ConfigMap `certConfigMap` names (CDI adds
//!   them to the system pool; this machine's pool knows no test CA anyway),
//!   `<pvc_root>/<namespace>/<dv>/disk.img`, hashing as it writes; only a
//!   download matching `spec.source.http.checksum` is kept. A qcow2 image is
//!   converted to raw with `qemu-img`, like CDI does. Deleting a DataVolume
//!   stops its import and removes its "PVC". Not simulated: scratch space,
//!   filesystem overhead on `spec.storage`, importer pod restarts (a failure
//!   is final: phase `Failed`), sources other than HTTP.
//! - KubeVirt (virt-controller + virt-handler): for each VirtualMachine whose
//!   runStrategy wants it running, creates the VirtualMachineInstance (labels
//!   and spec from the template, owned by the VM) and moves it through
//!   `Scheduling` to `Running`, reporting one interface per template
//!   interface (name, MAC, the IP on the first) and, while the guest agent is
//!   "connected", `AgentConnected` and `guestOSInfo`; deletes it when the VM
//!   is Halted. An unschedulable VMI looks like KubeVirt shows one: phase
//!   `Scheduling` with `PodScheduled=False`, reason `Unschedulable`.
//!
//! Faults and observations go through [`SimControl`]. The simulators poll
//! (100 ms) and stop when the returned [`Simulators`] is dropped.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// The upstream kinds the simulators act on (CDI v1beta1, KubeVirt v1).
fn resource(group: &str, version: &str, kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        plural,
    )
}
fn data_volume_resource() -> kube::api::ApiResource {
    resource("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes")
}
fn virtual_machine_resource() -> kube::api::ApiResource {
    resource("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")
}
fn virtual_machine_instance_resource() -> kube::api::ApiResource {
    resource("kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances")
}

const POLL: Duration = Duration::from_millis(100);
/// CDI's importer reports progress periodically, not per byte.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// A source that sends nothing for this long fails the import.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";
/// The message the scheduler gives for a pod that fits on no node.
pub const UNSCHEDULABLE_MESSAGE: &str = "0/1 nodes are available: 1 Insufficient memory";

/// Knobs and counters shared with the test.
#[derive(Default)]
pub struct SimControl {
    /// Fail this many upcoming imports with a transient error (the importer
    /// pod was evicted), after `ImportScheduled` and before any download.
    pub fail_imports: AtomicUsize,
    /// While set, DataVolumes stay in `ImportScheduled` before a single byte
    /// is downloaded (tests tamper with the staged artifact meanwhile).
    pub hold_imports: AtomicBool,
    /// Imports that downloaded an artifact whose checksum matched.
    pub verified_imports: AtomicUsize,
    /// Distinct DataVolume uids the CDI simulator ever acted on.
    pub dv_uids_seen: Mutex<HashSet<String>>,
    /// HTTP downloads started.
    pub downloads: AtomicUsize,
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

/// Options for [`start_with`]; build with `..Default::default()`, more may come.
#[derive(Default)]
pub struct SimOptions {
    /// Where the "PVCs" live; a temporary directory owned by the
    /// [`Simulators`] (removed on drop) when `None`.
    pub pvc_root: Option<PathBuf>,
    /// Leave DataVolumes to real CDI (`KubeEnv::cdi`): only KubeVirt is simulated.
    pub real_cdi: bool,
}

/// Both simulators for one namespace; aborts them when dropped.
pub struct Simulators {
    pub control: Arc<SimControl>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pvc_root: PathBuf,
    // Dropped after `drop` has aborted the tasks (fields drop after `Drop::drop`).
    _pvc_tempdir: Option<tempfile::TempDir>,
}

impl Simulators {
    /// The imported disk of DataVolume `dv_name` (exists once it `Succeeded`).
    pub fn pvc_image(&self, namespace: &str, dv_name: &str) -> PathBuf {
        pvc_dir(&self.pvc_root, namespace, dv_name).join("disk.img")
    }

    /// The directory holding every namespace's "PVCs".
    pub fn pvc_root(&self) -> &Path {
        &self.pvc_root
    }
}

impl Drop for Simulators {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts both simulators for one namespace (tests share one API server).
pub fn start(client: Client, namespace: &str) -> Simulators {
    start_with(client, namespace, SimOptions::default())
}

/// [`start`] with options.
pub fn start_with(client: Client, namespace: &str, options: SimOptions) -> Simulators {
    let (pvc_root, tempdir) = match options.pvc_root {
        Some(root) => (root, None),
        None => {
            let dir = tempfile::Builder::new().prefix("vmmigrate-pvcs").tempdir().expect("PVC tempdir");
            (dir.path().to_path_buf(), Some(dir))
        }
    };
    let control = Arc::new(SimControl::default());
    let mut tasks = vec![tokio::spawn(kubevirt_loop(client.clone(), namespace.to_owned(), control.clone()))];
    if !options.real_cdi {
        tasks.push(tokio::spawn(cdi_loop(client, namespace.to_owned(), pvc_root.clone(), control.clone())));
    }
    Simulators { control, tasks, pvc_root, _pvc_tempdir: tempdir }
}

fn pvc_dir(root: &Path, namespace: &str, dv_name: &str) -> PathBuf {
    root.join(namespace).join(dv_name)
}

/// Aborts a spawned task when dropped (a dropped `JoinHandle` only detaches).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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

// ---------------------------------------------------------------- CDI

/// One import per DataVolume uid; kept after it ends so the "PVC" can be
/// removed when the DataVolume goes.
struct Import {
    name: String,
    task: AbortOnDrop,
}

async fn cdi_loop(client: Client, namespace: String, pvc_root: PathBuf, control: Arc<SimControl>) {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &data_volume_resource());
    let mut imports: HashMap<String, Import> = HashMap::new();
    loop {
        if let Ok(list) = api.list(&ListParams::default()).await {
            let live: HashSet<String> = list
                .iter()
                .filter(|dv| dv.metadata.deletion_timestamp.is_none())
                .filter_map(|dv| dv.uid())
                .collect();
            // A deleted DataVolume takes its importer pod and its PVC with it.
            let gone: Vec<String> = imports.keys().filter(|uid| !live.contains(*uid)).cloned().collect();
            for uid in gone {
                if let Some(mut import) = imports.remove(&uid) {
                    let AbortOnDrop(task) = &mut import.task;
                    task.abort();
                    let _ = task.await;
                    let _ = tokio::fs::remove_dir_all(pvc_dir(&pvc_root, &namespace, &import.name)).await;
                }
            }
            for dv in list {
                let Some(uid) = dv.uid() else { continue };
                let phase = dv.data["status"]["phase"].as_str().unwrap_or("");
                if !live.contains(&uid)
                    || imports.contains_key(&uid)
                    || matches!(phase, "Succeeded" | "Failed")
                {
                    continue;
                }
                lock(&control.dv_uids_seen).insert(uid.clone());
                let name = dv.name_any();
                let dir = pvc_dir(&pvc_root, &namespace, &name);
                let writer = DvStatus::new(client.clone(), &dv, &uid);
                let task = tokio::spawn(import(writer, dv, dir, control.clone()));
                imports.insert(uid, Import { name, task: AbortOnDrop(task) });
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The importer: the whole life of one DataVolume.
async fn import(writer: DvStatus, dv: DynamicObject, dir: PathBuf, control: Arc<SimControl>) {
    let name = dv.name_any();
    let status = match run_import(&writer, &dv, &dir, &control).await {
        Ok(()) => {
            control.verified_imports.fetch_add(1, Ordering::SeqCst);
            json!({
                "phase": "Succeeded",
                "progress": "100.0%",
                "claimName": name,
                "conditions": dv_conditions(&name, true, ("False", "Completed", "Import Complete")),
            })
        }
        Err(message) => {
            // Nothing of a failed import is kept.
            let _ = tokio::fs::remove_file(dir.join("disk.img.partial")).await;
            let _ = tokio::fs::remove_file(dir.join("disk.img")).await;
            json!({
                "phase": "Failed",
                "progress": "N/A",
                "claimName": name,
                "conditions": dv_conditions(&name, false, ("False", "Error", &message)),
            })
        }
    };
    // The controller waits on this write: retry it while the DataVolume exists.
    for _ in 0..50 {
        match writer.write(&status).await {
            Ok(()) => return,
            Err(e) if e.starts_with("gone") => return,
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

/// Writes the whole status of one DataVolume, and only of that one: a JSON
/// patch that first tests `metadata.uid`, so a DataVolume deleted and
/// recreated under the same name is never written by the old import.
struct DvStatus {
    client: Client,
    path: String,
    uid: String,
}

impl DvStatus {
    fn new(client: Client, dv: &DynamicObject, uid: &str) -> DvStatus {
        let ar = data_volume_resource();
        let path = format!(
            "/apis/{}/namespaces/{}/{}/{}/status",
            ar.api_version,
            dv.namespace().unwrap_or_default(),
            ar.plural,
            dv.name_any()
        );
        DvStatus { client, path, uid: uid.to_owned() }
    }

    /// Err starting with "gone" when the DataVolume (this uid) no longer exists.
    async fn write(&self, status: &Value) -> Result<(), String> {
        let patch = json!([
            {"op": "test", "path": "/metadata/uid", "value": self.uid},
            {"op": "add", "path": "/status", "value": status},
        ]);
        let request = http::Request::patch(&self.path)
            .header("Content-Type", "application/json-patch+json")
            .body(patch.to_string().into_bytes())
            .map_err(|e| e.to_string())?;
        match self.client.request::<DynamicObject>(request).await {
            Ok(_) => Ok(()),
            // 404: deleted; 422: the uid test failed (another DataVolume by that name).
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 422 => Err(format!("gone: {}", s.message)),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// CDI's three DataVolume conditions, in CDI's order; `running` is
/// (status, reason, message) of the `Running` condition.
fn dv_conditions(name: &str, ready: bool, running: (&str, &str, &str)) -> Value {
    let now = now();
    let (status, reason, message) = running;
    json!([
        {"type": "Bound", "status": "True", "reason": "Bound", "message": format!("PVC {name} Bound"),
         "lastHeartbeatTime": now, "lastTransitionTime": now},
        {"type": "Ready", "status": if ready { "True" } else { "False" },
         "lastHeartbeatTime": now, "lastTransitionTime": now},
        {"type": "Running", "status": status, "reason": reason, "message": message,
         "lastHeartbeatTime": now, "lastTransitionTime": now},
    ])
}

async fn run_import(
    writer: &DvStatus,
    dv: &DynamicObject,
    dir: &Path,
    control: &SimControl,
) -> Result<(), String> {
    let name = dv.name_any();
    let scheduled = json!({
        "phase": "ImportScheduled",
        "progress": "N/A",
        "claimName": name,
        "conditions": dv_conditions(&name, false, ("False", "Pending", "Import pod is pending")),
    });
    let _ = writer.write(&scheduled).await;
    while control.hold_imports.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if control.fail_imports.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
        return Err("the importer pod was evicted".into());
    }
    let http = &dv.data["spec"]["source"]["http"];
    let url = http["url"].as_str().filter(|u| !u.is_empty()).ok_or("spec.source.http.url is missing")?;
    let want = match http["checksum"].as_str() {
        None | Some("") => return Err("no checksum given".into()),
        Some(c) => c
            .strip_prefix("sha256:")
            .ok_or_else(|| format!("unsupported checksum {c}: the simulator verifies sha256 only"))?
            .to_ascii_lowercase(),
    };
    tokio::fs::create_dir_all(dir).await.map_err(|e| format!("creating the PVC {}: {e}", dir.display()))?;
    let mut progress = ProgressReport {
        writer,
        name: &name,
        conditions: dv_conditions(&name, false, ("True", "Pod is running", "")),
        last: Instant::now(),
    };
    progress.write("0.00%".into()).await;

    let namespace = dv.namespace().unwrap_or_default();
    let source = ImportSource {
        url,
        credentials: import_credentials(&writer.client, &namespace, http["secretRef"].as_str()).await?,
        ca_pem: import_ca(&writer.client, &namespace, http["certConfigMap"].as_str()).await?,
    };
    control.downloads.fetch_add(1, Ordering::SeqCst);
    let partial = dir.join("disk.img.partial");
    let (got, magic) = download(&writer.client, &source, &partial, &mut progress).await?;
    if got != want {
        return Err(format!("checksum mismatch: got sha256:{got}, want sha256:{want}"));
    }

    let image = dir.join("disk.img");
    if magic == *QCOW2_MAGIC {
        let out = tokio::process::Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(&partial)
            .arg(&image)
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| format!("running qemu-img: {e}"))?;
        if !out.status.success() {
            return Err(format!("qemu-img convert failed: {}", last_line(&out.stderr)));
        }
        let _ = tokio::fs::remove_file(&partial).await;
    } else {
        tokio::fs::rename(&partial, &image).await.map_err(|e| format!("renaming into place: {e}"))?;
    }
    check_fits(dv, &image).await
}

/// The importer's periodic `ImportInProgress` writes.
struct ProgressReport<'a> {
    writer: &'a DvStatus,
    name: &'a str,
    conditions: Value,
    last: Instant,
}

impl ProgressReport<'_> {
    async fn write(&self, progress: String) {
        let status = json!({
            "phase": "ImportInProgress",
            "progress": progress,
            "claimName": self.name,
            "conditions": self.conditions,
        });
        let _ = self.writer.write(&status).await;
    }

    /// Called after every chunk; writes at most every [`PROGRESS_EVERY`].
    async fn update(&mut self, done: u64, total: Option<u64>) {
        if self.last.elapsed() < PROGRESS_EVERY {
            return;
        }
        self.last = Instant::now();
        let progress = match total {
            Some(total) if total > 0 => format!("{:.2}%", done as f64 * 100.0 / total as f64),
            _ => "N/A".into(),
        };
        self.write(progress).await;
    }
}

/// Like CDI, refuses an image whose virtual size exceeds the requested
/// storage (CDI inflates `spec.storage` requests for filesystem overhead
/// itself, so only `spec.pvc` requests lose the default 5.5 %).
async fn check_fits(dv: &DynamicObject, image: &Path) -> Result<(), String> {
    let (request, overhead) = match (
        dv.data["spec"]["storage"]["resources"]["requests"]["storage"].as_str(),
        dv.data["spec"]["pvc"]["resources"]["requests"]["storage"].as_str(),
    ) {
        (Some(q), _) => (q, 0.0),
        (None, Some(q)) => (q, 0.055),
        (None, None) => return Ok(()),
    };
    let Some(requested) = parse_quantity(request) else { return Ok(()) };
    let available = (requested as f64 * (1.0 - overhead)) as u64;
    let size = tokio::fs::metadata(image).await.map_err(|e| format!("reading the image: {e}"))?.len();
    if size > available {
        return Err(format!(
            "Virtual image size {size} is larger than the reported available storage {available}. \
             A larger PVC is required."
        ));
    }
    Ok(())
}

/// A Kubernetes quantity in bytes (`64Mi`, `1G`, `1048576`); None if unusual.
fn parse_quantity(q: &str) -> Option<u64> {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    number.checked_mul(factor)
}

fn last_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_owned()
}

/// Streams an HTTP/1.1 GET of `url` into `dest`, calling `progress` after
/// every chunk. Returns the sha256 (hex) of the body and its first four
/// bytes. The host is loopback, or a Service name
/// (`<service>.<namespace>.svc[.cluster.local]`), which an importer pod
/// reaches through cluster DNS and kube-proxy; the simulator, outside the
/// cluster, resolves it the way they would: to a ready endpoint of the
/// Service's EndpointSlices, a pod address the test node routes to the host.
/// What the importer is given: the URL, the Secret's pair, the CA's PEM.
struct ImportSource<'a> {
    url: &'a str,
    credentials: Option<(String, String)>,
    ca_pem: Option<String>,
}

/// `accessKeyId` and `secretKey` of the Secret `name`; the importer pod of
/// real CDI does not start without them.
async fn import_credentials(
    client: &Client,
    namespace: &str,
    name: Option<&str>,
) -> Result<Option<(String, String)>, String> {
    let Some(name) = name.filter(|n| !n.is_empty()) else { return Ok(None) };
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), namespace);
    let secret = secrets.get(name).await.map_err(|e| format!("reading Secret {name}: {e}"))?;
    let data = secret.data.unwrap_or_default();
    let key = |k: &str| {
        data.get(k)
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .ok_or_else(|| format!("Secret {name} has no key {k}"))
    };
    Ok(Some((key("accessKeyId")?, key("secretKey")?)))
}

/// Every value of the ConfigMap `name`, concatenated (each a PEM file).
async fn import_ca(client: &Client, namespace: &str, name: Option<&str>) -> Result<Option<String>, String> {
    let Some(name) = name.filter(|n| !n.is_empty()) else { return Ok(None) };
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client.clone(), namespace);
    let map = maps.get(name).await.map_err(|e| format!("reading ConfigMap {name}: {e}"))?;
    Ok(Some(map.data.unwrap_or_default().into_values().collect::<Vec<_>>().join("\n")))
}

trait Connection: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Connection for T {}

/// A TLS session to `host` over `tcp`, trusting only the certificates of `ca_pem`.
async fn tls_connect(
    tcp: tokio::net::TcpStream,
    host: &str,
    ca_pem: Option<&str>,
) -> Result<Box<dyn Connection>, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.unwrap_or_default().as_bytes()) {
        let cert = cert.map_err(|e| format!("certConfigMap: not PEM: {e}"))?;
        roots.add(cert).map_err(|e| format!("certConfigMap: {e}"))?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.split_once(']'))
        .map_or_else(|| host.rsplit_once(':').map_or(host, |(h, _)| h), |(h, _)| h);
    let name =
        rustls::pki_types::ServerName::try_from(bare.to_owned()).map_err(|e| format!("{bare}: {e}"))?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let stream = connector.connect(name, tcp).await.map_err(|e| format!("TLS to {host}: {e}"))?;
    Ok(Box::new(stream))
}

async fn download(
    client: &Client,
    source: &ImportSource<'_>,
    dest: &Path,
    progress: &mut ProgressReport<'_>,
) -> Result<(String, [u8; 4]), String> {
    let url = source.url;
    let (tls, rest) = match (url.strip_prefix("https://"), url.strip_prefix("http://")) {
        (Some(rest), _) => (true, rest),
        (None, Some(rest)) => (false, rest),
        (None, None) => return Err(format!("not an http(s) URL: {url}")),
    };
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let connect_to = if ["127.0.0.1:", "localhost:", "[::1]:"].iter().any(|p| host.starts_with(p)) {
        host.to_owned()
    } else if let Some(endpoint) = resolve_service(client, host).await? {
        endpoint
    } else {
        return Err(format!("refusing to fetch from {host}: neither loopback nor a Service of the cluster"));
    };
    let tcp = tokio::net::TcpStream::connect(&connect_to)
        .await
        .map_err(|e| format!("connect {host} ({connect_to}): {e}"))?;
    let mut stream: Box<dyn Connection> =
        if tls { tls_connect(tcp, host, source.ca_pem.as_deref()).await? } else { Box::new(tcp) };
    let authorization = match &source.credentials {
        Some((user, password)) => {
            use base64::Engine as _;
            let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            format!("Authorization: Basic {pair}\r\n")
        }
        None => String::new(),
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: cdi-importer-sim\r\n{authorization}Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.map_err(|e| format!("sending the request: {e}"))?;

    let mut buf = vec![0u8; 256 * 1024];
    let mut head = Vec::new();
    let body_start = loop {
        if let Some(pos) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        if head.len() > 64 * 1024 {
            return Err("malformed HTTP response: no end of headers".into());
        }
        let n = read(&mut stream, &mut buf).await?;
        if n == 0 {
            return Err("malformed HTTP response: connection closed in the headers".into());
        }
        head.extend_from_slice(&buf[..n]);
    };
    let text = String::from_utf8_lossy(&head[..body_start]).to_string();
    let mut lines = text.lines();
    let code: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("malformed HTTP response: no status code")?;
    if code != 200 {
        return Err(format!("HTTP {code} from the source"));
    }
    let mut total = None;
    for line in lines {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if key.eq_ignore_ascii_case("content-length") {
            total = Some(value.parse::<u64>().map_err(|_| format!("bad Content-Length {value:?}"))?);
        } else if key.eq_ignore_ascii_case("transfer-encoding") && !value.eq_ignore_ascii_case("identity") {
            return Err(format!("Transfer-Encoding {value} is not supported by the simulator"));
        }
    }

    let mut file =
        tokio::fs::File::create(dest).await.map_err(|e| format!("creating {}: {e}", dest.display()))?;
    let mut hasher = Sha256::new();
    let mut magic = [0u8; 4];
    let mut done: u64 = 0;
    // What arrived with the headers first, then one read at a time.
    let mut pending = head[body_start..].to_vec();
    let mut n = 0;
    loop {
        let data: &[u8] = if pending.is_empty() { &buf[..n] } else { &pending };
        // Bytes past Content-Length are not part of the body.
        let room = total.map_or(usize::MAX, |t| usize::try_from(t - done).unwrap_or(usize::MAX));
        let data = &data[..data.len().min(room)];
        if !data.is_empty() {
            if let Some(want) = usize::try_from(done).ok().filter(|d| *d < magic.len()) {
                let take = (magic.len() - want).min(data.len());
                magic[want..want + take].copy_from_slice(&data[..take]);
            }
            hasher.update(data);
            file.write_all(data).await.map_err(|e| format!("writing the PVC: {e}"))?;
            done += data.len() as u64;
            progress.update(done, total).await;
        }
        pending.clear();
        if total == Some(done) {
            break;
        }
        n = read(&mut stream, &mut buf).await?;
        if n == 0 {
            match total {
                Some(total) => return Err(format!("unexpected EOF: got {done} of {total} bytes")),
                None => break,
            }
        }
    }
    file.flush().await.map_err(|e| format!("writing the PVC: {e}"))?;
    let sha: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((sha, magic))
}

async fn read(
    stream: &mut (impl tokio::io::AsyncRead + Unpin + ?Sized),
    buf: &mut [u8],
) -> Result<usize, String> {
    match tokio::time::timeout(READ_TIMEOUT, stream.read(buf)).await {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(format!("reading from the source: {e}")),
        Err(_) => Err(format!("the source sent nothing for {READ_TIMEOUT:?}")),
    }
}

// ------------------------------------------------------------ KubeVirt

async fn kubevirt_loop(client: Client, namespace: String, control: Arc<SimControl>) {
    let vms: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &namespace, &virtual_machine_resource());
    let vmis: Api<DynamicObject> =
        Api::namespaced_with(client, &namespace, &virtual_machine_instance_resource());
    loop {
        if let Ok(list) = vms.list(&ListParams::default()).await {
            for vm in list {
                sync_vm(&vms, &vmis, &vm, &control.kubevirt).await;
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn sync_vm(
    vms: &Api<DynamicObject>,
    vmis: &Api<DynamicObject>,
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

// ------------------------------------------------------ HTTP source

/// `<service>.<namespace>.svc[.cluster.local]:<port>` → `<pod ip>:<target
/// port>` of a ready endpoint; `None` when `host` is not a Service name.
async fn resolve_service(client: &Client, host: &str) -> Result<Option<String>, String> {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let (name, port) = host.rsplit_once(':').unwrap_or((host, "80"));
    let name = name.strip_suffix(".cluster.local").unwrap_or(name);
    let Some(name) = name.strip_suffix(".svc") else { return Ok(None) };
    let Some((service, namespace)) = name.split_once('.') else { return Ok(None) };
    let port: i32 = port.parse().map_err(|_| format!("bad port in {host}"))?;
    let svc = Api::<Service>::namespaced(client.clone(), namespace)
        .get(service)
        .await
        .map_err(|e| format!("resolving {host}: Service {namespace}/{service}: {e}"))?;
    let port_name = svc
        .spec
        .and_then(|s| s.ports)
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.port == port)
        .map(|p| p.name.unwrap_or_default())
        .ok_or_else(|| format!("resolving {host}: Service {namespace}/{service} has no port {port}"))?;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
        .await
        .map_err(|e| format!("resolving {host}: {e}"))?;
    for slice in slices.items {
        let Some(target) = slice
            .ports
            .unwrap_or_default()
            .into_iter()
            .find(|p| p.name.clone().unwrap_or_default() == port_name)
            .and_then(|p| p.port)
        else {
            continue;
        };
        let ready = slice
            .endpoints
            .into_iter()
            .find(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true) && !e.addresses.is_empty());
        if let Some(endpoint) = ready {
            return Ok(Some(format!("{}:{target}", endpoint.addresses[0])));
        }
    }
    Err(format!("resolving {host}: Service {namespace}/{service} has no ready endpoint"))
}

/// A plain HTTP server on loopback serving whatever `serve(path)` returns;
/// used to publish staged artifacts for the CDI simulator to download.
/// Runs until the test process exits.
pub fn serve_http(serve: impl Fn(&str) -> Option<Vec<u8>> + Send + Sync + 'static) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let serve = serve.clone();
            std::thread::spawn(move || {
                let mut stream = stream;
                // Read the whole request head: it may arrive in several segments.
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let request = String::from_utf8_lossy(&head).to_string();
                let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
                match serve(&path) {
                    Some(body) => {
                        let head = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                        let _ = stream.write_all(head.as_bytes());
                        let _ = stream.write_all(&body);
                    }
                    None => {
                        let _ = write!(stream, "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n");
                    }
                }
            });
        }
    });
    base
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantities_parse_like_kubernetes() {
        assert_eq!(super::parse_quantity("64Mi"), Some(64 << 20));
        assert_eq!(super::parse_quantity("1G"), Some(1_000_000_000));
        assert_eq!(super::parse_quantity("1048576"), Some(1 << 20));
        assert_eq!(super::parse_quantity("1.5Gi"), None);
    }
}
