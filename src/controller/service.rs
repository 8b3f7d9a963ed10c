//! `vmmigrate controller`: the real adapters assembled around the reconciler.
//! ESXi over SSH (credentials from the migration's Secret), copies and
//! artifacts in the work directory, the staging server CDI imports from, and
//! the Kubernetes API for DataVolumes, VirtualMachines and checks.

use super::leader::{LeaderElector, LeaseConfig, unique_identity};
use super::reconciler::{self, ControllerConfig};
use crate::convert::access::StagingAccess;
use crate::convert::job::JobSettings;
use crate::convert::staging::StagingServer;
use crate::convert::store::{ArtifactStore, StoreSettings};
use crate::destination::cluster::KubeCluster;
use crate::destination::probe::KubeProber;
use crate::destination::verify::VerifySettings;
use crate::machine::tenancy::DestinationRules;
use crate::metrics::Metrics;
use crate::ports::{Adapters, Converter, DiskStore, Staging};
use crate::source::esxi::hosts::{CredentialSource, EsxiHosts};
use crate::source::esxi::store::{EsxiDiskStore, StoreConfig};
use crate::worker::plane::{WorkerPlane, WorkerSettings};
use anyhow::Context as _;
use kube::Client;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Settings of the controller process (flags and `VMMIGRATE_*` environment).
#[derive(Clone, Debug, clap::Args)]
pub struct ControllerOptions {
    /// Watch only this namespace's migrations (default: all namespaces).
    #[arg(long, env = "VMMIGRATE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Work directory for disk copies, artifacts and staged files (a volume
    /// large enough for the disks in flight).
    #[arg(long, env = "VMMIGRATE_WORK_DIR", default_value = "/var/lib/vmmigrate")]
    pub work_dir: PathBuf,
    /// Address the staging server listens on.
    #[arg(long, env = "VMMIGRATE_STAGING_LISTEN", default_value = "0.0.0.0:8443")]
    pub staging_listen: SocketAddr,
    /// Base URL CDI reaches the staging server at (the Service in front of
    /// this pod); `https://` only: the server's certificate names its host.
    /// Default: `https://<the address it listens on>`.
    #[arg(long, env = "VMMIGRATE_STAGING_URL")]
    pub staging_url: Option<String>,
    /// Conversions at once in this process (runner `local`).
    #[arg(long, env = "VMMIGRATE_CONVERSIONS", default_value_t = 2)]
    pub conversions: usize,
    /// Run virt-v2v's appliance under software emulation (TCG) even where
    /// `/dev/kvm` exists: for nodes whose `/dev/kvm` opens but cannot run a
    /// guest (nested or paravirtual). Slower; without it libguestfs picks KVM
    /// when it can.
    #[arg(long, env = "VMMIGRATE_GUEST_CONVERSION_TCG")]
    pub guest_conversion_tcg: bool,
    /// Parallel SSH streams per disk copy.
    #[arg(long, env = "VMMIGRATE_COPY_STREAMS", default_value_t = 1)]
    pub copy_streams: usize,
    /// Image for conversion Jobs (runner `job`); without it, `job` is refused.
    #[arg(long, env = "VMMIGRATE_JOB_IMAGE")]
    pub job_image: Option<String>,
    /// Namespace of conversion Jobs (default: the migration's namespace).
    #[arg(long, env = "VMMIGRATE_JOB_NAMESPACE")]
    pub job_namespace: Option<String>,
    /// PersistentVolumeClaim holding the work directory, mounted by conversion Jobs.
    #[arg(long, env = "VMMIGRATE_WORK_CLAIM")]
    pub work_claim: Option<String>,
    /// Memory limit of a conversion Job that converts a guest whole:
    /// virt-v2v's appliance is a VM of about 2.5 GiB beside it.
    #[arg(long, env = "VMMIGRATE_JOB_GUEST_MEMORY_LIMIT", default_value = "4Gi")]
    pub job_guest_memory_limit: String,
    /// How a staged raw disk gets into its DataVolume: `cdi` (CDI's
    /// importer) or `fill` (a blank DataVolume, asked for while the disks
    /// are copied, filled by a Job of `--job-image` that hashes what it
    /// writes: measured 40-50 % shorter imports). Without `--job-image`, and
    /// for qcow2 artifacts, CDI's importer.
    #[arg(long, env = "VMMIGRATE_IMPORT_METHOD", value_enum, default_value_t = ImportMethod::Cdi)]
    pub import_method: ImportMethod,
    /// Where copies, conversions and staging run: `process` (this process,
    /// on `--work-dir`) or `pods` (one worker Job per migration, on a claim
    /// of its own, from `--job-image`).
    #[arg(long, env = "VMMIGRATE_DATA_PLANE", value_enum, default_value_t = DataPlane::Process)]
    pub data_plane: DataPlane,
    /// CPU a worker pod requests.
    #[arg(long, env = "VMMIGRATE_WORKER_CPU", default_value = "500m")]
    pub worker_cpu: String,
    /// Memory a worker pod requests.
    #[arg(long, env = "VMMIGRATE_WORKER_MEMORY", default_value = "256Mi")]
    pub worker_memory: String,
    /// Memory limit of a worker pod.
    #[arg(long, env = "VMMIGRATE_WORKER_MEMORY_LIMIT", default_value = "1Gi")]
    pub worker_memory_limit: String,
    /// Memory limit of a worker pod that converts a guest: virt-v2v's
    /// appliance is a VM of about 2.5 GiB beside the worker.
    #[arg(long, env = "VMMIGRATE_WORKER_GUEST_MEMORY_LIMIT", default_value = "4Gi")]
    pub worker_guest_memory_limit: String,
    /// Storage class of the worker pods' work claims (default: the cluster's).
    #[arg(long, env = "VMMIGRATE_WORKER_STORAGE_CLASS")]
    pub worker_storage_class: Option<String>,
    /// Reporting instance for Events (the pod name).
    #[arg(long, env = "POD_NAME", default_value = "vmmigrate-controller")]
    pub instance: String,
    /// Disks read at once from one ESXi host (its SSH bandwidth is shared:
    /// more streams stretch every downtime). Migrations wait in a fair queue.
    #[arg(long, env = "VMMIGRATE_MAX_READS_PER_HOST",
          default_value_t = crate::machine::fleet::DEFAULT_READS_PER_HOST,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_reads_per_host: u32,
    /// A host's own cap, as `HOST=N` (the host as `spec.source.host` names it);
    /// repeat for more hosts, or separate with commas.
    #[arg(long = "host-reads", env = "VMMIGRATE_HOST_READS", value_delimiter = ',',
          value_parser = parse_host_reads)]
    pub host_reads: Vec<(String, u32)>,
    /// Disks read at once in the whole cluster (default: only the per-host caps).
    #[arg(long, env = "VMMIGRATE_MAX_READS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_reads: Option<u32>,
    #[command(flatten)]
    pub leader_election: LeaderElectionOptions,
    /// The administrator's destination rules (`--allow-destination` of the subcommand).
    #[arg(skip)]
    pub destination_rules: DestinationRules,
}

impl ControllerOptions {
    /// These options under the administrator's destination rules.
    pub(crate) fn with_destinations(mut self, rules: DestinationRules) -> ControllerOptions {
        self.destination_rules = rules;
        self
    }

    /// The read caps as the queue applies them.
    pub fn limits(&self) -> crate::machine::fleet::ReadCaps {
        crate::machine::fleet::ReadCaps {
            per_host: self.max_reads_per_host,
            hosts: self.host_reads.iter().cloned().collect(),
            cluster: self.max_reads,
        }
    }

    /// The rules as the controller applies them: the namespace it runs in is closed too.
    pub fn destinations(&self) -> DestinationRules {
        self.destination_rules.clone().with_system_namespace(&self.leader_election.lease_namespace)
    }
}

/// How a staged raw disk gets into its DataVolume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ImportMethod {
    /// CDI's importer downloads it (`source.http`).
    Cdi,
    /// A blank DataVolume that a Job of `--job-image` fills itself
    /// (`vmmigrate fill-volume`), hashing what it writes; qcow2 artifacts
    /// and controllers without `--job-image` still use CDI's importer.
    Fill,
}

/// Where the data plane runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataPlane {
    /// In the controller process, on its work directory.
    Process,
    /// In one worker pod per migration (`vmmigrate worker`).
    Pods,
}

/// `HOST=N` of `--host-reads`.
fn parse_host_reads(text: &str) -> Result<(String, u32), String> {
    let (host, n) = text.split_once('=').ok_or_else(|| format!("{text:?}: expected HOST=N"))?;
    let n: u32 = n.trim().parse().map_err(|_| format!("{text:?}: N must be a whole number"))?;
    if host.trim().is_empty() || n == 0 {
        return Err(format!("{text:?}: expected a host and N of at least 1"));
    }
    Ok((host.trim().to_owned(), n))
}

/// Leader election among replicas through a `coordination.k8s.io/v1` Lease.
#[derive(Clone, Debug, clap::Args)]
pub struct LeaderElectionOptions {
    /// Reconcile only while holding the Lease, so that one replica of several works.
    #[arg(long, env = "VMMIGRATE_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Namespace of the Lease (default: this pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "vmmigrate-system")]
    pub lease_namespace: String,
    /// Name of the Lease.
    #[arg(long, env = "VMMIGRATE_LEASE_NAME", default_value = "vmmigrate-controller")]
    pub lease_name: String,
    /// Lease duration in seconds; the renew deadline and retry period follow
    /// in client-go's proportions (15 : 10 : 2).
    #[arg(long, env = "VMMIGRATE_LEASE_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(2..))]
    pub lease_seconds: u64,
}

impl Default for LeaderElectionOptions {
    /// No election (one replica), with the flags' defaults.
    fn default() -> Self {
        LeaderElectionOptions {
            leader_elect: false,
            lease_namespace: "vmmigrate-system".into(),
            lease_name: "vmmigrate-controller".into(),
            lease_seconds: 15,
        }
    }
}

/// Starts the staging server on the work directory's `staging/`, with the
/// key and CA of its `staging-tls/` (made on first use) and a certificate
/// for the host of `--staging-url` (without one, the address it listens
/// on); `metrics` reports the bytes it serves.
pub async fn start_staging(opts: &ControllerOptions, metrics: &Metrics) -> anyhow::Result<StagingServer> {
    let staging_root = ArtifactStore::staging_root(&opts.work_dir);
    std::fs::create_dir_all(&staging_root)
        .with_context(|| format!("creating the staging directory {}", staging_root.display()))?;
    let listener = crate::server::bind(opts.staging_listen)
        .with_context(|| format!("binding the staging server to {}", opts.staging_listen))?;
    let addr = listener.local_addr()?;
    let url = opts.staging_url.clone().unwrap_or_else(|| format!("https://{addr}"));
    let url = url.trim_end_matches('/').to_owned();
    let access = StagingAccess::load_or_create(&StagingAccess::dir(&opts.work_dir), &url)
        .context("loading the staging server's key and CA")?;
    let server = StagingServer::start(listener, staging_root, url, Arc::new(access))
        .await
        .context("starting the staging server")?;
    metrics.watch_staging(server.stats().bytes_served.clone());
    Ok(server)
}

/// The real adapters, recording into `metrics`, handing CDI the URL and
/// credentials of `staging`; with `--data-plane pods`, copies, conversions
/// and staging go to worker pods (which needs `--job-image`).
pub fn adapters(
    client: Client,
    opts: &ControllerOptions,
    staging: &StagingServer,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Adapters> {
    let jobs = opts.job_image.clone().map(|image| JobSettings {
        namespace: opts.job_namespace.clone(),
        image,
        work_claim: opts.work_claim.clone(),
        work_dir: opts.work_dir.clone(),
        service_account: None,
        run_as: own_ids(),
        guest_memory_limit: opts.job_guest_memory_limit.clone(),
    });
    let store = Arc::new(ArtifactStore::new(
        StoreSettings {
            work_dir: opts.work_dir.clone(),
            staging_url: staging.url().to_owned(),
            access: staging.access(),
            local_concurrency: opts.conversions,
            force_tcg: opts.guest_conversion_tcg,
            jobs,
            metrics: metrics.clone(),
        },
        Some(client.clone()),
    ));
    let hosts = Arc::new(EsxiHosts::new(CredentialSource::Kubernetes(client.clone())));
    let (disks, converter, staging): (Arc<dyn DiskStore>, Arc<dyn Converter>, Arc<dyn Staging>) = match opts
        .data_plane
    {
        DataPlane::Process => {
            let copies = EsxiDiskStore::new(
                hosts.clone(),
                StoreConfig {
                    root: crate::ports::workdir::copies_root(&opts.work_dir),
                    streams: opts.copy_streams.max(1),
                    chunk_size: crate::source::esxi::copy::DEFAULT_CHUNK_SIZE,
                    metrics: metrics.clone(),
                },
            );
            (Arc::new(copies), store.clone(), store)
        }
        DataPlane::Pods => {
            let image =
                opts.job_image.clone().context("--data-plane pods needs --job-image (the worker's image)")?;
            let settings = WorkerSettings {
                image,
                run_as: own_ids(),
                cpu: opts.worker_cpu.clone(),
                memory: opts.worker_memory.clone(),
                memory_limit: opts.worker_memory_limit.clone(),
                guest_memory_limit: opts.worker_guest_memory_limit.clone(),
                storage_class: opts.worker_storage_class.clone(),
                copy_streams: opts.copy_streams.max(1),
                guest_conversion_tcg: opts.guest_conversion_tcg,
            };
            let plane = Arc::new(WorkerPlane::new(client.clone(), settings, staging.access())?);
            (plane.clone(), plane.clone(), plane)
        }
    };
    Ok(Adapters {
        esxi: hosts,
        disks,
        converter,
        staging,
        cluster: Arc::new(match &opts.job_image {
            Some(image) => KubeCluster::new(client.clone(), &opts.leader_election.lease_namespace)
                .with_volume_checks(VerifySettings { image: image.clone(), run_as: own_ids() })
                .filling_volumes(opts.import_method == ImportMethod::Fill),
            None => KubeCluster::new(client.clone(), &opts.leader_election.lease_namespace),
        }),
        prober: Arc::new(KubeProber::new(client)),
    })
}

impl ControllerOptions {
    /// The reconciler's configuration: these options, recording into
    /// `metrics`, asking `lease_fence` (when elected elsewhere) before an
    /// irreversible action.
    pub(crate) fn reconciler_config(
        &self,
        metrics: Arc<Metrics>,
        lease_fence: Option<reconciler::LeaseFence>,
    ) -> ControllerConfig {
        ControllerConfig {
            namespace: self.namespace.clone(),
            max_requeue: None,
            instance: self.instance.clone(),
            destinations: self.destinations(),
            interrupt: None,
            metrics,
            limits: self.limits(),
            lease_fence,
        }
    }
}

/// Runs the reconciler until Ctrl-C or SIGTERM; with `--leader-elect` only
/// while this process holds the Lease (reported in `config.metrics`). Losing
/// the Lease is an error: the process must exit (see `LeaderElector::run`).
pub(crate) async fn run_reconciler(
    client: Client,
    adapters: Adapters,
    config: ControllerConfig,
    election: &LeaderElectionOptions,
) -> anyhow::Result<()> {
    if !election.leader_elect {
        reconciler::run(client, adapters, config, crate::server::shutdown_signal()).await;
        return Ok(());
    }
    let lease =
        LeaseConfig::new(&election.lease_namespace, &election.lease_name, unique_identity(&config.instance))
            .with_lease_seconds(election.lease_seconds);
    let elector = LeaderElector::new(client.clone(), lease).with_metrics(config.metrics.clone());
    // The elector cancels the reconciler on shutdown and on a lost Lease;
    // before that, its fence stops an irreversible action of a leader whose
    // renewals stopped (a partition) at the renew deadline.
    let config = ControllerConfig { lease_fence: Some(elector.fence()), ..config };
    let work = reconciler::run(client, adapters, config, std::future::pending());
    elector.run(work, crate::server::shutdown_signal()).await.context("leader election")
}

/// The label the leader puts on its own pod, so that a Service can send
/// what only the leader serves (the webhooks) to it alone.
pub const LEADER_POD_LABEL: &str = "migration.platform.example/leader";

/// Sets [`LEADER_POD_LABEL`] on this process's pod (`POD_NAME` in
/// `POD_NAMESPACE`, from the downward API) to `leader`. Outside a pod, or
/// without the right, it only logs: the label steers webhook traffic and
/// nothing else depends on it.
pub(crate) async fn label_own_pod(client: &Client, leader: bool) {
    let (Ok(name), Ok(namespace)) = (std::env::var("POD_NAME"), std::env::var("POD_NAMESPACE")) else {
        return;
    };
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client.clone(), &namespace);
    let patch = serde_json::json!({"metadata": {"labels": {LEADER_POD_LABEL: leader.to_string()}}});
    let params = kube::api::PatchParams::default();
    match pods.patch(&name, &params, &kube::api::Patch::Merge(&patch)).await {
        Ok(_) => tracing::info!(pod = %name, leader, "pod labelled"),
        Err(e) => tracing::warn!(pod = %name, leader, error = %e, "could not label this pod"),
    }
}

/// Runs `work` (the gitops half, the controller, or both) until Ctrl-C or
/// SIGTERM; with `--leader-elect` only while this process holds the Lease,
/// so that of several replicas exactly one fetches, applies, writes status
/// and reconciles. A standby reports itself ready (`election ready`: it is
/// healthy and will take over) but labels its pod not-leader, so the
/// webhook Service sends it nothing. `work`'s error, or a lost Lease, is
/// returned: the process must exit. `fence` receives the elector's fence
/// (whether the Lease is still held, on this process's clock).
pub(crate) async fn run_elected(
    client: Client,
    election: &LeaderElectionOptions,
    instance: &str,
    metrics: Arc<Metrics>,
    fence: &std::sync::OnceLock<reconciler::LeaseFence>,
    work: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    if !election.leader_elect {
        return tokio::select! {
            result = work => result,
            () = crate::server::shutdown_signal() => Ok(()),
        };
    }
    // A restarted container keeps its pod, and the label of its last life.
    label_own_pod(&client, false).await;
    metrics.set_ready("election", true);
    let lease = LeaseConfig::new(&election.lease_namespace, &election.lease_name, unique_identity(instance))
        .with_lease_seconds(election.lease_seconds);
    let elector = LeaderElector::new(client.clone(), lease).with_metrics(metrics);
    let _ = fence.set(elector.fence());
    let failed = std::sync::Mutex::new(None);
    let work = async {
        label_own_pod(&client, true).await;
        if let Err(e) = work.await {
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        }
    };
    elector.run(work, crate::server::shutdown_signal()).await.context("leader election")?;
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// This process's uid and gid (the owner of `/proc/self`).
fn own_ids() -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").ok().map(|m| (m.uid(), m.gid()))
}
