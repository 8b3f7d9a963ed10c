//! The controller's side of the data plane in pods: `DiskStore`,
//! `Converter` and `Staging` of a migration, carried out by its worker pod.
//!
//! For each migration, in its own namespace (where its ESXi credentials
//! Secret is), all owned by the migration:
//!
//! ```text
//! Service               <name>-vmm-worker   ClusterIP; control 9443, staging 8443
//! Secret                <name>-vmm-worker   key, tls.crt, tls.key, ca.crt (the worker's identity)
//! PersistentVolumeClaim <name>-vmm-work     copies, artifacts, staged files
//! Job                   <name>-vmm-worker   `vmmigrate worker`; a lost pod is replaced by the next
//! ```
//!
//! The Scheduler places the pod; the claim carries the copies across pods.
//! While no pod of the Job is ready (starting, or replaced after a kill),
//! reads report the work as in progress and writes wait: nothing of the
//! migration's retry budget is spent on a pod being replaced. A pod that
//! cannot start (its image cannot be pulled, a Secret is missing) or a Job
//! out of retries is a failure with the pod's own words.

use super::protocol::{CALL_PATH, CONTROL_PORT, Call, Request, STAGING_PORT};
use crate::api::{Reason, VirtualMachineMigration};
use crate::convert::access::StagingAccess;
use crate::machine::{ArtifactState, CopyState, Failure};
use crate::objects::pods::{container_security_context, pod_security_context};
use crate::objects::{LABEL_ROLE, bounded_name, owner_references};
use crate::ports::kube_errors::{classify, delete_by_uid};
use crate::ports::{Converter, DiskStore, ImportAccess, Staging};
use async_trait::async_trait;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The role label of a worker's objects.
const ROLE: &str = "worker";
/// Where the worker mounts its volume.
const WORK_DIR: &str = "/var/lib/vmmigrate";
/// How long one call to a worker may take (calls answer at once).
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Room on the claim beside the disks (sidecars, markers, file system).
const CLAIM_MARGIN: i64 = 256 << 20;
/// Pods the Job may lose before it fails.
const BACKOFF_LIMIT: i32 = 6;

/// Settings of the worker pods (the controller's flags).
#[derive(Clone, Debug)]
pub(crate) struct WorkerSettings {
    /// The image (the controller's own).
    pub image: String,
    /// User and group the worker runs as (the controller's own).
    pub run_as: Option<(u32, u32)>,
    /// Resource requests and the memory limit of a worker.
    pub cpu: String,
    pub memory: String,
    pub memory_limit: String,
    /// The memory limit instead when the migration's guest is converted.
    pub guest_memory_limit: String,
    /// Storage class of the work claims (default: the cluster's default).
    pub storage_class: Option<String>,
    /// Parallel SSH streams per disk copy.
    pub copy_streams: usize,
    /// `--guest-conversion-tcg`, passed on.
    pub guest_conversion_tcg: bool,
}

/// `DiskStore`, `Converter` and `Staging` through worker pods.
pub(crate) struct WorkerPlane {
    client: Client,
    settings: WorkerSettings,
    /// The controller's staging access: it signs the workers' certificates
    /// and derives each worker's key.
    access: Arc<StagingAccess>,
    tls: rustls::ClientConfig,
    /// Bytes last reported per (uid, disk): shown while a pod is replaced.
    known: Mutex<HashMap<(String, usize), (i64, i64)>>,
    /// Calls in a row a ready worker did not answer, per uid.
    unanswered: Mutex<HashMap<String, u32>>,
}

/// Calls in a row a ready worker may leave unanswered (a pod being replaced
/// is still listed ready for a moment) before it is a failure.
const UNANSWERED_LIMIT: u32 = 15;

/// The names of one migration's worker objects.
pub(crate) fn worker_name(vmm: &VirtualMachineMigration) -> String {
    bounded_name(&vmm.name_any(), "-vmm-worker")
}

/// The work claim of one migration.
pub(crate) fn claim_name(vmm: &VirtualMachineMigration) -> String {
    bounded_name(&vmm.name_any(), "-vmm-work")
}

fn uid_of(vmm: &VirtualMachineMigration) -> String {
    vmm.metadata.uid.clone().unwrap_or_default()
}

/// Where the worker stands.
enum Presence {
    /// No Job: nothing was started (or it was cleaned up).
    Absent,
    /// The Job runs but no pod answers yet (starting, or being replaced).
    Waiting,
    /// A ready pod at this IP.
    Ready(String),
    Failed(Failure),
}

impl WorkerPlane {
    pub fn new(client: Client, settings: WorkerSettings, access: Arc<StagingAccess>) -> anyhow::Result<Self> {
        let tls = access.client_tls()?;
        Ok(WorkerPlane {
            client,
            settings,
            access,
            tls,
            known: Mutex::new(HashMap::new()),
            unanswered: Mutex::new(HashMap::new()),
        })
    }

    fn api<K>(&self, vmm: &VirtualMachineMigration) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &vmm.namespace().unwrap_or_default())
    }

    fn labels(vmm: &VirtualMachineMigration) -> serde_json::Map<String, Value> {
        let mut labels = crate::objects::labels(vmm);
        labels.insert(LABEL_ROLE.into(), json!(ROLE));
        labels
    }

    fn selector(vmm: &VirtualMachineMigration) -> String {
        format!("{}={},{LABEL_ROLE}={ROLE}", crate::api::labels::MIGRATION_UID, uid_of(vmm))
    }

    /// Owned by the migration (always in its namespace): removed with it.
    fn metadata(vmm: &VirtualMachineMigration, name: &str) -> Value {
        json!({
            "name": name,
            "namespace": vmm.namespace().unwrap_or_default(),
            "labels": Self::labels(vmm),
            "ownerReferences": owner_references(vmm, &vmm.namespace().unwrap_or_default()),
        })
    }

    /// The Service's DNS names: what the worker's certificate names.
    fn dns_names(vmm: &VirtualMachineMigration) -> Vec<String> {
        let (name, ns) = (worker_name(vmm), vmm.namespace().unwrap_or_default());
        vec![format!("{name}.{ns}.svc"), format!("{name}.{ns}.svc.cluster.local")]
    }

    async fn create<K>(&self, api: &Api<K>, object: Value, what: &str) -> Result<K, Failure>
    where
        K: Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
    {
        let object: K = serde_json::from_value(object).map_err(|e| {
            Failure::needs_human(Reason::JobRenderError, format!("rendering the {what}: {e}"))
        })?;
        match api.create(&PostParams::default(), &object).await {
            Ok(created) => Ok(created),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(object),
            Err(e) => Err(classify(&format!("creating the {what}"), e)),
        }
    }

    /// Creates whatever of the worker's objects is missing; a Job out of
    /// retries is deleted (its claim stays), so the next call starts anew.
    async fn ensure(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let name = worker_name(vmm);
        let services: Api<Service> = self.api(vmm);
        let service = match self.ours(vmm, &services, &name, "worker Service").await? {
            Some(service) => service,
            None => self.create(&services, service(vmm), "worker Service").await?,
        };
        let cluster_ip = service.spec.as_ref().and_then(|s| s.cluster_ip.clone()).unwrap_or_default();
        if cluster_ip.is_empty() || cluster_ip == "None" {
            return Err(Failure::retryable(
                Reason::WorkerCannotStart,
                format!("Service {name} has no cluster IP yet"),
            ));
        }
        let secrets: Api<Secret> = self.api(vmm);
        if self.ours(vmm, &secrets, &name, "worker Secret").await?.is_none() {
            let secret = self.identity_secret(vmm, &cluster_ip)?;
            self.create(&secrets, secret, "worker Secret").await?;
        }
        let claims: Api<PersistentVolumeClaim> = self.api(vmm);
        if self.ours(vmm, &claims, &claim_name(vmm), "work claim").await?.is_none() {
            self.create(&claims, claim(&self.settings, vmm), "work claim").await?;
        }
        let jobs: Api<Job> = self.api(vmm);
        match self.ours(vmm, &jobs, &name, "worker Job").await? {
            None => {
                self.create(&jobs, job(&self.settings, vmm, &cluster_ip), "worker Job").await?;
            }
            Some(job) if job_failed(&job).is_some() && job.metadata.deletion_timestamp.is_none() => {
                delete_owned(&jobs, &job, "failed worker Job").await?;
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// The object named `name`, when there is one and it is this
    /// migration's. One of that name that is not (a user's own claim, say)
    /// is never used, changed or deleted: the migration waits for a person.
    async fn ours<K>(
        &self,
        vmm: &VirtualMachineMigration,
        api: &Api<K>,
        name: &str,
        what: &str,
    ) -> Result<Option<K>, Failure>
    where
        K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        match api.get_opt(name).await.map_err(|e| classify(&format!("reading the {what}"), e))? {
            None => Ok(None),
            Some(object) if owned_by(object.meta(), &uid_of(vmm)) => Ok(Some(object)),
            Some(_) => Err(Failure::needs_human(
                Reason::WorkerCannotStart,
                format!(
                    "{what} {}/{name} exists and is not this migration's (no owner reference to it); \
                     rename or remove it",
                    vmm.namespace().unwrap_or_default()
                ),
            )),
        }
    }

    fn identity_secret(&self, vmm: &VirtualMachineMigration, cluster_ip: &str) -> Result<Value, Failure> {
        let mut names = Self::dns_names(vmm);
        names.push(cluster_ip.to_owned());
        let identity = self.access.worker_identity(&uid_of(vmm), &names).map_err(|e| {
            Failure::retryable(Reason::WorkerCannotStart, format!("making the worker's certificate: {e:#}"))
        })?;
        Ok(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": Self::metadata(vmm, &worker_name(vmm)),
            "type": "Opaque",
            "stringData": {
                "key": identity.key_hex,
                "tls.crt": identity.cert_pem,
                "tls.key": identity.key_pem,
                "ca.crt": identity.ca_pem,
            },
        }))
    }

    /// Whether the worker exists, runs, answers.
    async fn presence(&self, vmm: &VirtualMachineMigration) -> Result<Presence, Failure> {
        let jobs: Api<Job> = self.api(vmm);
        let job = match self.ours(vmm, &jobs, &worker_name(vmm), "worker Job").await {
            Ok(Some(job)) => job,
            Ok(None) => return Ok(Presence::Absent),
            Err(failure) => return Ok(Presence::Failed(failure)),
        };
        if let Some(failure) = job_failed(&job) {
            return Ok(Presence::Failed(failure));
        }
        let pods: Api<Pod> = self.api(vmm);
        let list = pods
            .list(&ListParams::default().labels(&Self::selector(vmm)))
            .await
            .map_err(|e| classify("listing the worker pods", e))?;
        // Only the Job's own pods: a pod that merely wears the labels is not the worker.
        let job_uid = job.metadata.uid.clone().unwrap_or_default();
        let own: Vec<&Pod> = list.items.iter().filter(|p| owned_by(&p.metadata, &job_uid)).collect();
        let mut ready: Vec<&Pod> = own.iter().copied().filter(|p| pod_ready(p)).collect();
        ready.sort_by_key(|p| p.metadata.creation_timestamp.clone());
        if let Some(ip) = ready.last().and_then(|p| p.status.as_ref()?.pod_ip.clone()) {
            return Ok(Presence::Ready(ip));
        }
        if let Some(failure) = own.iter().copied().find_map(cannot_start) {
            return Ok(Presence::Failed(failure));
        }
        Ok(Presence::Waiting)
    }

    /// One call to the worker at `ip`. A worker that does not answer is
    /// `Ok(None)` (a pod being replaced) until it has not answered
    /// [`UNANSWERED_LIMIT`] calls in a row.
    async fn call<T: DeserializeOwned>(
        &self,
        vmm: &VirtualMachineMigration,
        ip: &str,
        call: Call,
    ) -> Result<Option<T>, Failure> {
        let result = self.exchange(vmm, ip, call).await;
        let mut unanswered = self.unanswered.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(answer) => {
                unanswered.remove(&uid_of(vmm));
                Ok(Some(answer))
            }
            Err(failure) if failure.reason == Reason::WorkerProtocolError => {
                let count = unanswered.entry(uid_of(vmm)).or_default();
                *count += 1;
                if *count > UNANSWERED_LIMIT {
                    return Err(failure);
                }
                tracing::debug!(error = %failure.message, "the worker did not answer; waiting");
                Ok(None)
            }
            Err(failure) => Err(failure),
        }
    }

    /// One exchange with the worker at `ip`, its answer parsed as `T`.
    async fn exchange<T: DeserializeOwned>(
        &self,
        vmm: &VirtualMachineMigration,
        ip: &str,
        call: Call,
    ) -> Result<T, Failure> {
        let host = Self::dns_names(vmm).remove(0);
        let addr: std::net::SocketAddr = format!("{ip}:{CONTROL_PORT}")
            .parse()
            .or_else(|_| format!("[{ip}]:{CONTROL_PORT}").parse())
            .map_err(|_| Failure::retryable(Reason::WorkerProtocolError, format!("pod IP {ip:?}")))?;
        let protocol = |e: String| Failure::retryable(Reason::WorkerProtocolError, e);
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(self.tls.clone())
            .resolve(&host, addr)
            .no_proxy()
            .http1_only()
            .timeout(CALL_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| protocol(format!("building the worker client: {e}")))?;
        let token = self.access.for_migration(&uid_of(vmm)).control_token();
        let request = Request { vmm: vmm.clone(), call };
        let response = client
            .post(format!("https://{host}:{CONTROL_PORT}{CALL_PATH}"))
            .bearer_auth(token)
            .json(&request)
            .send()
            .await
            .map_err(|e| protocol(format!("calling the worker at {addr}: {e}")))?;
        let status = response.status();
        let body =
            response.bytes().await.map_err(|e| protocol(format!("reading the worker's answer: {e}")))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).trim().to_owned();
            return Err(protocol(format!("the worker answered {status}: {text}")));
        }
        serde_json::from_slice(&body).map_err(|e| protocol(format!("the worker's answer: {e}")))
    }

    /// A write: sent to a ready worker; created and waited for otherwise.
    async fn write(&self, vmm: &VirtualMachineMigration, call: Call) -> Result<(), Failure> {
        self.ensure(vmm).await?;
        match self.presence(vmm).await? {
            Presence::Ready(ip) => self.call::<Result<(), Failure>>(vmm, &ip, call).await?.unwrap_or(Ok(())),
            Presence::Failed(failure) => Err(failure),
            // Asked again once the pod is ready (reads say "in progress" meanwhile).
            Presence::Absent | Presence::Waiting => Ok(()),
        }
    }

    fn remember(&self, vmm: &VirtualMachineMigration, disk: usize, state: &CopyState) {
        if let CopyState::InProgress { bytes_done, bytes_total }
        | CopyState::Partial { bytes_done, bytes_total } = state
        {
            let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
            known.insert((uid_of(vmm), disk), (*bytes_done, *bytes_total));
        }
    }

    fn last_known(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let total = vmm
            .status
            .as_ref()
            .and_then(|s| s.source_inventory.as_ref()?.disks.get(disk).map(|d| d.capacity_bytes))
            .unwrap_or(0);
        let (bytes_done, bytes_total) = known.get(&(uid_of(vmm), disk)).copied().unwrap_or((0, total));
        CopyState::InProgress { bytes_done, bytes_total }
    }

    /// Deletes the worker's objects, its claim included, and only those
    /// this migration owns. "Not found" is success.
    async fn teardown(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let (name, uid) = (worker_name(vmm), uid_of(vmm));
        teardown_one(&self.api::<Job>(vmm), &name, &uid, "worker Job").await?;
        teardown_one(&self.api::<Service>(vmm), &name, &uid, "worker Service").await?;
        teardown_one(&self.api::<Secret>(vmm), &name, &uid, "worker Secret").await?;
        teardown_one(&self.api::<PersistentVolumeClaim>(vmm), &claim_name(vmm), &uid, "work claim").await?;
        self.known.lock().unwrap_or_else(|p| p.into_inner()).retain(|(u, _), _| *u != uid);
        Ok(())
    }
}

/// Whether an object carries an owner reference to the migration `uid`.
fn owned_by(meta: &kube::api::ObjectMeta, uid: &str) -> bool {
    !uid.is_empty() && meta.owner_references.iter().flatten().any(|o| o.uid == uid)
}

/// Deletes `object` (by its uid: never another of the same name made since).
async fn delete_owned<K>(api: &Api<K>, object: &K, what: &str) -> Result<(), Failure>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    delete_by_uid(api, &object.name_any(), object.meta().uid.clone(), &format!("the {what}")).await
}

/// Deletes `name` if it is the migration `uid`'s; leaves anyone else's.
async fn teardown_one<K>(api: &Api<K>, name: &str, uid: &str, what: &str) -> Result<(), Failure>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await.map_err(|e| classify(&format!("reading the {what}"), e))? {
        Some(object) if owned_by(object.meta(), uid) => delete_owned(api, &object, what).await,
        _ => Ok(()),
    }
}

/// The Service in front of the worker: where CDI imports from.
fn service(vmm: &VirtualMachineMigration) -> Value {
    let mut selector = serde_json::Map::new();
    selector.insert(crate::api::labels::MIGRATION_UID.into(), json!(uid_of(vmm)));
    selector.insert(LABEL_ROLE.into(), json!(ROLE));
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": WorkerPlane::metadata(vmm, &worker_name(vmm)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                { "name": "control", "port": CONTROL_PORT, "targetPort": CONTROL_PORT, "protocol": "TCP" },
                { "name": "staging", "port": STAGING_PORT, "targetPort": STAGING_PORT, "protocol": "TCP" },
            ],
        },
    })
}

/// Room for every disk, twice for qcow2 (the copy and its conversion).
fn claim(settings: &WorkerSettings, vmm: &VirtualMachineMigration) -> Value {
    let disks: i64 = vmm
        .status
        .as_ref()
        .and_then(|s| s.source_inventory.as_ref())
        .map(|i| i.disks.iter().map(|d| d.capacity_bytes.max(0)).sum())
        .unwrap_or(0);
    let factor = if vmm.spec.conversion.format.extension() == "raw" { 1 } else { 2 };
    let bytes = disks * factor + CLAIM_MARGIN;
    let mib = (bytes + (1 << 20) - 1) >> 20;
    let mut spec = json!({
        "accessModes": ["ReadWriteOnce"],
        "resources": { "requests": { "storage": format!("{mib}Mi") } },
    });
    if let Some(class) = &settings.storage_class {
        spec["storageClassName"] = json!(class);
    }
    json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": WorkerPlane::metadata(vmm, &claim_name(vmm)),
        "spec": spec,
    })
}

/// The worker's Job: one pod at a time, replaced when lost.
fn job(settings: &WorkerSettings, vmm: &VirtualMachineMigration, cluster_ip: &str) -> Value {
    let name = worker_name(vmm);
    let staging_url = format!("https://{cluster_ip}:{STAGING_PORT}");
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "containers": [{
            "name": "worker",
            "image": settings.image,
            "command": ["vmmigrate"],
            "args": [
                "worker",
                "--uid", uid_of(vmm),
                "--work-dir", WORK_DIR,
                "--staging-url", staging_url,
                "--copy-streams", settings.copy_streams.max(1).to_string(),
            ],
            "ports": [
                { "name": "control", "containerPort": CONTROL_PORT },
                { "name": "staging", "containerPort": STAGING_PORT },
            ],
            "readinessProbe": {
                "httpGet": { "path": super::protocol::HEALTH_PATH, "port": CONTROL_PORT, "scheme": "HTTPS" },
                "periodSeconds": 2,
            },
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": {
                "requests": { "cpu": settings.cpu, "memory": settings.memory },
                "limits": { "memory": settings.memory_limit },
            },
            "securityContext": container_security_context(true),
            "volumeMounts": [
                { "name": "work", "mountPath": WORK_DIR },
                { "name": "identity", "mountPath": "/etc/vmmigrate/worker", "readOnly": true },
                { "name": "source", "mountPath": "/etc/vmmigrate/source", "readOnly": true },
                { "name": "tmp", "mountPath": "/tmp" },
            ],
        }],
        "volumes": [
            { "name": "work", "persistentVolumeClaim": { "claimName": claim_name(vmm) } },
            { "name": "identity", "secret": { "secretName": name, "defaultMode": 0o440 } },
            { "name": "source", "secret": {
                "secretName": vmm.spec.source.credentials_secret_ref.name, "defaultMode": 0o440 } },
            { "name": "tmp", "emptyDir": {} },
        ],
    });
    if settings.guest_conversion_tcg
        && let Some(args) = pod_spec["containers"][0]["args"].as_array_mut()
    {
        args.push(json!("--guest-conversion-tcg"));
    }
    // A worker that converts the guest runs libguestfs's appliance too.
    if crate::machine::compatibility::converts_guest(&vmm.spec, vmm.status.as_ref()) {
        pod_spec["containers"][0]["resources"]["limits"]["memory"] = json!(settings.guest_memory_limit);
    }
    let mut context = pod_security_context(settings.run_as);
    if let Some((_, gid)) = settings.run_as {
        // The volumes' files belong to the worker's group.
        context["fsGroup"] = json!(gid);
    }
    pod_spec["securityContext"] = context;
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": WorkerPlane::metadata(vmm, &name),
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            // A pod stopped from outside (SIGTERM: a drain, a deletion)
            // or lost with its node is replaced without counting
            // against the limit; crashes and OOM kills count.
            "podFailurePolicy": { "rules": [
                { "action": "Ignore", "onExitCodes": {
                    "containerName": "worker", "operator": "In",
                    "values": [super::process::STOPPED_EXIT_CODE] } },
                { "action": "Ignore", "onPodConditions": [{ "type": "DisruptionTarget" }] },
            ] },
            "template": { "metadata": { "labels": WorkerPlane::labels(vmm) }, "spec": pod_spec },
        },
    })
}

/// A Job out of retries, with the reason Kubernetes gives.
fn job_failed(job: &Job) -> Option<Failure> {
    let conditions = job.status.as_ref()?.conditions.as_ref()?;
    let failed = conditions.iter().find(|c| c.type_ == "Failed" && c.status == "True")?;
    Some(Failure::retryable(
        Reason::WorkerFailed,
        format!(
            "worker Job {} failed: {}: {}",
            job.name_any(),
            failed.reason.clone().unwrap_or_default(),
            failed.message.clone().unwrap_or_default()
        ),
    ))
}

fn pod_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().is_some_and(|s| {
            s.phase.as_deref() == Some("Running")
                && s.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// A pod that waits for something only a person can fix.
fn cannot_start(pod: &Pod) -> Option<Failure> {
    const STUCK: [&str; 5] = [
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    ];
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|s| {
        let waiting = s.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.as_deref()?;
        STUCK.contains(&reason).then(|| {
            Failure::needs_human(
                Reason::WorkerCannotStart,
                format!(
                    "worker pod {} cannot start: {reason}: {}",
                    pod.name_any(),
                    waiting.message.clone().unwrap_or_default()
                ),
            )
        })
    })
}

#[async_trait]
impl DiskStore for WorkerPlane {
    /// An object of a worker's name that is not this migration's stops the
    /// migration at validation, before its source is powered off.
    async fn preflight(&self, vmm: &VirtualMachineMigration) -> Result<Option<String>, Failure> {
        if vmm.spec.mode == crate::api::MigrationMode::Rehearsal {
            return Ok(Some(
                "spec.mode Rehearsal needs the in-process data plane (--data-plane process); the worker pods copy cold or warm (use spec.mode Cold or Warm)".to_owned(),
            ));
        }
        let name = worker_name(vmm);
        let checks = [
            self.ours(vmm, &self.api::<Service>(vmm), &name, "worker Service").await.map(|_| ()),
            self.ours(vmm, &self.api::<Secret>(vmm), &name, "worker Secret").await.map(|_| ()),
            self.ours(vmm, &self.api::<PersistentVolumeClaim>(vmm), &claim_name(vmm), "work claim")
                .await
                .map(|_| ()),
            self.ours(vmm, &self.api::<Job>(vmm), &name, "worker Job").await.map(|_| ()),
        ];
        let mut taken = Vec::new();
        for check in checks {
            match check {
                Ok(()) => {}
                Err(failure) if failure.reason == Reason::WorkerCannotStart => taken.push(failure.message),
                Err(failure) => return Err(failure),
            }
        }
        Ok((!taken.is_empty()).then(|| taken.join("; ")))
    }

    async fn copy_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        self.disk_state(vmm, disk, Call::CopyState { disk }).await
    }

    async fn delta_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        self.disk_state(vmm, disk, Call::DeltaState { disk }).await
    }

    async fn start_delta_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::StartDeltaCopy { disk }).await
    }

    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::StartCopy { disk }).await
    }

    /// The worker's patch; none while its pod is not there to say (the
    /// volume is then filled whole, which is never wrong).
    async fn patch(&self, vmm: &VirtualMachineMigration, disk: usize) -> Option<crate::api::DiskPatch> {
        match self.presence(vmm).await {
            Ok(Presence::Ready(ip)) => {
                self.call(vmm, &ip, Call::Patch { disk }).await.ok().flatten().flatten()
            }
            _ => None,
        }
    }

    async fn discard_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::DiscardCopy { disk }).await
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.teardown(vmm).await
    }
}

impl WorkerPlane {
    /// A call the worker answers with a staged URL, or none yet (also
    /// while its pod is not there to answer).
    async fn url_call(&self, vmm: &VirtualMachineMigration, call: Call) -> Result<Option<String>, Failure> {
        match self.presence(vmm).await? {
            Presence::Ready(ip) => {
                self.call::<Result<Option<String>, Failure>>(vmm, &ip, call).await?.unwrap_or(Ok(None))
            }
            Presence::Failed(failure) => Err(failure),
            Presence::Absent | Presence::Waiting => Ok(None),
        }
    }

    /// A disk's copy (or, warm after the cutover, delta) state as the
    /// worker answers `call`; while its pod is replaced, what it last said.
    async fn disk_state(&self, vmm: &VirtualMachineMigration, disk: usize, call: Call) -> CopyState {
        let state = match self.presence(vmm).await {
            Ok(Presence::Absent) => CopyState::Absent,
            Ok(Presence::Waiting) => self.last_known(vmm, disk),
            Ok(Presence::Failed(failure)) => CopyState::Failed { failure, discard: false },
            Err(failure) => CopyState::Failed { failure, discard: false },
            Ok(Presence::Ready(ip)) => match self.call::<CopyState>(vmm, &ip, call).await {
                Ok(Some(state)) => state,
                // A pod that was ready a moment ago: being replaced.
                Ok(None) => self.last_known(vmm, disk),
                Err(failure) => CopyState::Failed { failure, discard: false },
            },
        };
        self.remember(vmm, disk, &state);
        state
    }
}

#[async_trait]
impl Converter for WorkerPlane {
    async fn artifact_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState {
        let waiting = ArtifactState::InProgress { bytes_done: 0, bytes_total: 0 };
        match self.presence(vmm).await {
            Ok(Presence::Absent) => ArtifactState::Absent,
            Ok(Presence::Waiting) => waiting,
            Ok(Presence::Failed(failure)) | Err(failure) => ArtifactState::Failed(failure),
            Ok(Presence::Ready(ip)) => match self.call(vmm, &ip, Call::ArtifactState { disk }).await {
                Ok(Some(state)) => state,
                Ok(None) => waiting,
                Err(failure) => ArtifactState::Failed(failure),
            },
        }
    }

    async fn start_conversion(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::StartConversion { disk }).await
    }

    async fn discard_artifact(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::DiscardArtifact { disk }).await
    }

    /// The worker runs this process's own image: what converts guests
    /// there is what is installed here.
    fn guest_converter(&self) -> crate::machine::GuestConverterFacts {
        crate::convert::store::installed_guest_converter()
    }

    async fn guest_conversion(&self, vmm: &VirtualMachineMigration) -> Option<crate::api::GuestConversion> {
        match self.presence(vmm).await {
            Ok(Presence::Ready(ip)) => {
                self.call(vmm, &ip, Call::GuestConversion).await.ok().flatten().flatten()
            }
            _ => None,
        }
    }
}

#[async_trait]
impl Staging for WorkerPlane {
    async fn staged_url(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure> {
        self.url_call(vmm, Call::StagedUrl { disk, sha256: sha256.into() }).await
    }

    async fn stage(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.write(vmm, Call::Stage { disk }).await
    }

    /// The worker stages its own copies, as it stages its artifacts.
    fn stages_bases(&self) -> bool {
        true
    }

    async fn stage_base(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure> {
        self.url_call(vmm, Call::StageBase { disk, sha256: sha256.into() }).await
    }

    async fn import_access(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<ImportAccess, Failure> {
        let uid = uid_of(vmm);
        let file = crate::convert::store::ArtifactStore::file_name(vmm, disk);
        Ok(self.access.for_migration(&uid).credential(&uid, &file))
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        self.teardown(vmm).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm(name: &str, format: &str) -> VirtualMachineMigration {
        use crate::api::{SourceDisk, SourceInventory, VirtualMachineMigrationStatus};
        let mut vmm: VirtualMachineMigration = serde_json::from_value(json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": { "name": name, "namespace": "apps", "uid": "u-1" },
            "spec": {
                "source": { "host": "esxi", "hostKey": format!("SHA256:{}", "A".repeat(43)),
                            "credentialsSecretRef": { "name": "esxi-cred" }, "vm": { "name": "web" } },
                "destination": { "namespace": "apps", "storageClassName": "fast" },
                "conversion": { "format": format },
            },
        }))
        .unwrap();
        let disk =
            |index: i32, gib: i64| SourceDisk { index, capacity_bytes: gib << 30, ..Default::default() };
        vmm.status = Some(VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                disks: vec![disk(0, 3), disk(1, 1)],
                ..Default::default()
            }),
            ..Default::default()
        });
        vmm
    }

    fn settings() -> WorkerSettings {
        WorkerSettings {
            image: "registry.example.net/platform/vmmigrate:0.1.0".into(),
            run_as: Some((65532, 65532)),
            cpu: "500m".into(),
            memory: "256Mi".into(),
            memory_limit: "1Gi".into(),
            guest_memory_limit: "3Gi".into(),
            storage_class: Some("fast-local".into()),
            copy_streams: 2,
            guest_conversion_tcg: false,
        }
    }

    #[test]
    fn a_worker_that_converts_a_guest_has_room_for_the_appliance_and_runs_it_as_told() {
        let mut vmm = vmm("web", "raw");
        vmm.status.as_mut().unwrap().source_inventory.as_mut().unwrap().guest_os = "debian12-64".into();
        let tcg = WorkerSettings { guest_conversion_tcg: true, ..settings() };
        let container = job(&tcg, &vmm, "10.96.0.7")["spec"]["template"]["spec"]["containers"][0].clone();
        assert_eq!(container["resources"]["limits"], json!({ "memory": "3Gi" }));
        assert_eq!(container["args"].as_array().unwrap().last().unwrap(), "--guest-conversion-tcg");
        vmm.spec.conversion.guest = crate::api::GuestConversionMode::None;
        let container =
            job(&settings(), &vmm, "10.96.0.7")["spec"]["template"]["spec"]["containers"][0].clone();
        assert_eq!(container["resources"]["limits"], json!({ "memory": "1Gi" }), "moved as it is");
        assert!(!container["args"].as_array().unwrap().contains(&json!("--guest-conversion-tcg")));
    }

    #[test]
    fn the_worker_job_runs_the_worker_with_no_api_token_on_its_claim_and_replaces_a_stopped_pod() {
        let job = job(&settings(), &vmm("web", "raw"), "10.96.0.7");
        assert_eq!(job["metadata"]["name"], "web-vmm-worker");
        assert_eq!(job["metadata"]["namespace"], "apps");
        assert_eq!(job["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(job["metadata"]["ownerReferences"][0]["controller"], true);
        let spec = &job["spec"];
        assert_eq!(spec["backoffLimit"], BACKOFF_LIMIT);
        let rules = spec["podFailurePolicy"]["rules"].as_array().unwrap();
        assert_eq!(rules[0]["onExitCodes"]["values"], json!([super::super::process::STOPPED_EXIT_CODE]));
        assert_eq!(rules[0]["action"], "Ignore");
        assert_eq!(rules[1]["onPodConditions"][0]["type"], "DisruptionTarget");
        let pod = &spec["template"]["spec"];
        assert_eq!(
            pod["restartPolicy"], "Never",
            "a lost pod is replaced by a new one, not restarted in place"
        );
        assert_eq!(pod["automountServiceAccountToken"], false, "the worker reads nothing from the API");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(pod["securityContext"]["fsGroup"], 65532);
        assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
        let container = &pod["containers"][0];
        let args: Vec<&str> =
            container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "worker",
                "--uid",
                "u-1",
                "--work-dir",
                WORK_DIR,
                "--staging-url",
                "https://10.96.0.7:8443",
                "--copy-streams",
                "2"
            ]
        );
        assert_eq!(container["resources"]["requests"], json!({ "cpu": "500m", "memory": "256Mi" }));
        assert_eq!(container["resources"]["limits"], json!({ "memory": "1Gi" }));
        assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(container["readinessProbe"]["httpGet"]["scheme"], "HTTPS");
        let volumes = pod["volumes"].as_array().unwrap();
        let volume = |name: &str| volumes.iter().find(|v| v["name"] == name).unwrap().clone();
        assert_eq!(volume("work")["persistentVolumeClaim"]["claimName"], "web-vmm-work");
        assert_eq!(volume("identity")["secret"]["secretName"], "web-vmm-worker");
        assert_eq!(volume("source")["secret"]["secretName"], "esxi-cred", "the migration's own credentials");
        // The pods carry the labels the Service and the controller select.
        let labels = &spec["template"]["metadata"]["labels"];
        assert_eq!(labels[crate::api::labels::MIGRATION_UID], "u-1");
        assert_eq!(labels[LABEL_ROLE], ROLE);
        let service = service(&vmm("web", "raw"));
        for (key, value) in service["spec"]["selector"].as_object().unwrap() {
            assert_eq!(&labels[key], value, "the Service selects the worker's pods by {key}");
        }
    }

    #[test]
    fn the_work_claim_holds_every_disk_and_twice_that_for_qcow2() {
        let raw = claim(&settings(), &vmm("web", "raw"));
        assert_eq!(raw["spec"]["resources"]["requests"]["storage"], format!("{}Mi", 4 * 1024 + 256));
        assert_eq!(raw["spec"]["storageClassName"], "fast-local");
        assert_eq!(raw["spec"]["accessModes"], json!(["ReadWriteOnce"]));
        let qcow2 = claim(&WorkerSettings { storage_class: None, ..settings() }, &vmm("web", "qcow2"));
        assert_eq!(qcow2["spec"]["resources"]["requests"]["storage"], format!("{}Mi", 8 * 1024 + 256));
        assert!(qcow2["spec"].get("storageClassName").is_none(), "the cluster's default class");
    }

    #[test]
    fn worker_names_are_deterministic_and_fit_kubernetes_limits() {
        let long = "a".repeat(63);
        for name in [worker_name(&vmm(&long, "raw")), claim_name(&vmm(&long, "raw"))] {
            assert!(name.len() <= 63, "{name}");
        }
        assert_ne!(worker_name(&vmm(&long, "raw")), worker_name(&vmm(&format!("{}b", &long[1..]), "raw")));
    }

    #[test]
    fn a_pod_that_cannot_pull_its_image_is_a_failure_for_a_person_with_its_words() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": "web-vmm-worker-x" },
            "status": { "phase": "Pending", "containerStatuses": [{
                "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": { "waiting": { "reason": "ImagePullBackOff", "message": "no such image" } },
            }] },
        }))
        .unwrap();
        let failure = cannot_start(&pod).unwrap();
        assert_eq!(failure.reason, Reason::WorkerCannotStart);
        assert!(failure.message.contains("ImagePullBackOff") && failure.message.contains("no such image"));
        let scheduling: Pod = serde_json::from_value(json!({
            "metadata": { "name": "p" },
            "status": { "phase": "Pending", "conditions": [{ "type": "PodScheduled", "status": "False",
                                                           "reason": "Unschedulable" }] },
        }))
        .unwrap();
        assert!(cannot_start(&scheduling).is_none(), "waiting for room is not a failure");
    }

    #[test]
    fn only_an_owner_reference_to_the_migrations_uid_makes_an_object_ours() {
        let meta = |owners: Value| -> kube::api::ObjectMeta {
            serde_json::from_value(json!({ "name": "web-vmm-work", "ownerReferences": owners })).unwrap()
        };
        let owner = |uid: &str| {
            json!([{ "apiVersion": "migration.platform.example/v1alpha1", "kind": "VirtualMachineMigration",
                     "name": "web", "uid": uid }])
        };
        assert!(owned_by(&meta(owner("u-1")), "u-1"));
        assert!(!owned_by(&meta(owner("u-2")), "u-1"), "another migration's");
        assert!(!owned_by(&meta(json!([])), "u-1"), "a user's own");
        assert!(!owned_by(&meta(owner("")), ""), "no uid matches nothing");
    }
}
