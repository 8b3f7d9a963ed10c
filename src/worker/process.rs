//! `vmmigrate worker`: one migration's data plane in a pod of its own. It
//! assembles the in-process data plane's adapters (`EsxiDiskStore` copies,
//! `ArtifactStore` conversions, the staging server) on the work volume the
//! controller made for this migration, and answers the controller's calls
//! (`protocol`) on a TLS listener.
//!
//! It serves one migration: calls for another uid are refused. Its identity
//! (the derived key, its certificate, the CA) and the ESXi credentials are
//! files mounted from Secrets; it never talks to the Kubernetes API.

use super::protocol::{CALL_PATH, Call, HEALTH_PATH, MAX_REQUEST_BYTES, Request};
use crate::api::{ConversionRunner, Reason, VirtualMachineMigration};
use crate::convert::access::{StagingAccess, WorkerIdentity};
use crate::convert::staging::StagingServer;
use crate::convert::store::{ArtifactStore, StoreSettings};
use crate::machine::Failure;
use crate::metrics::Metrics;
use crate::ports::{Converter, DiskStore, Staging};
use crate::server::{self, Body, Server, ServerLimits};
use crate::source::esxi::hosts::{CredentialSource, EsxiHosts};
use crate::source::esxi::store::{EsxiDiskStore, StoreConfig};
use anyhow::Context as _;
use http::{Request as HttpRequest, Response, StatusCode, header};
use hyper::body::Incoming;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Settings of `vmmigrate worker` (the Job's arguments).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerOptions {
    /// The uid of the one migration this worker serves.
    #[arg(long, env = "VMMIGRATE_WORKER_UID")]
    pub uid: String,
    /// The migration's work volume (copies, artifacts, staged files).
    #[arg(long, env = "VMMIGRATE_WORK_DIR", default_value = "/var/lib/vmmigrate")]
    pub work_dir: PathBuf,
    /// The worker's identity (files `key`, `tls.crt`, `tls.key`, `ca.crt`).
    #[arg(long, default_value = "/etc/vmmigrate/worker")]
    pub identity_dir: PathBuf,
    /// The ESXi credentials (the migration's Secret, mounted).
    #[arg(long, default_value = "/etc/vmmigrate/source")]
    pub credentials_dir: PathBuf,
    /// Address of the control API.
    #[arg(long, default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,
    /// Address of the staging server.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub staging_listen: SocketAddr,
    /// Base URL CDI reaches this worker's staging server at (its Service).
    #[arg(long)]
    pub staging_url: String,
    /// Parallel SSH streams per disk copy.
    #[arg(long, default_value_t = 1)]
    pub copy_streams: usize,
    /// Conversions at once.
    #[arg(long, default_value_t = 2)]
    pub conversions: usize,
    /// As the controller's `--guest-conversion-tcg`.
    #[arg(long)]
    pub guest_conversion_tcg: bool,
}

/// Reads the identity the controller put in the worker's Secret.
pub(crate) fn read_identity(dir: &Path) -> anyhow::Result<WorkerIdentity> {
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .with_context(|| format!("reading {}", dir.join(name).display()))
    };
    Ok(WorkerIdentity {
        key_hex: read("key")?,
        cert_pem: read("tls.crt")?,
        key_pem: read("tls.key")?,
        ca_pem: read("ca.crt")?,
    })
}

/// The adapters of one worker.
pub struct Worker {
    uid: String,
    access: Arc<StagingAccess>,
    disks: Arc<EsxiDiskStore>,
    store: Arc<ArtifactStore>,
}

/// A running worker: its control server and staging server.
pub struct Running {
    control: Server,
    staging: StagingServer,
}

impl Running {
    pub fn control_addr(&self) -> SocketAddr {
        self.control.local_addr()
    }

    pub(crate) fn staging_addr(&self) -> SocketAddr {
        self.staging.local_addr()
    }
}

/// Starts the worker's servers on `opts` (binding both listeners).
pub async fn start(opts: &WorkerOptions, metrics: Arc<Metrics>) -> anyhow::Result<Running> {
    let identity = read_identity(&opts.identity_dir)?;
    let access = Arc::new(StagingAccess::from_worker(&identity).context("loading the worker identity")?);
    let staging_root = ArtifactStore::staging_root(&opts.work_dir);
    std::fs::create_dir_all(&staging_root)
        .with_context(|| format!("creating the staging directory {}", staging_root.display()))?;
    let listener = server::bind(opts.staging_listen)
        .with_context(|| format!("binding the staging server to {}", opts.staging_listen))?;
    let url = opts.staging_url.trim_end_matches('/').to_owned();
    let staging = StagingServer::start(listener, staging_root, url.clone(), access.clone())
        .await
        .context("starting the staging server")?;
    metrics.watch_staging(staging.stats().bytes_served.clone());
    let store = Arc::new(ArtifactStore::new(
        StoreSettings {
            work_dir: opts.work_dir.clone(),
            staging_url: url,
            access: access.clone(),
            local_concurrency: opts.conversions,
            force_tcg: opts.guest_conversion_tcg,
            jobs: None,
            metrics: metrics.clone(),
        },
        None,
    ));
    let disks = Arc::new(EsxiDiskStore::new(
        Arc::new(EsxiHosts::new(CredentialSource::Directory(opts.credentials_dir.clone()))),
        StoreConfig {
            root: crate::ports::workdir::copies_root(&opts.work_dir),
            streams: opts.copy_streams.max(1),
            chunk_size: crate::source::esxi::copy::DEFAULT_CHUNK_SIZE,
            metrics,
        },
    ));
    let worker = Arc::new(Worker { uid: opts.uid.clone(), access: access.clone(), disks, store });
    let listener =
        server::bind(opts.listen).with_context(|| format!("binding the control API to {}", opts.listen))?;
    let budget = Arc::new(Semaphore::new(4 * MAX_REQUEST_BYTES));
    let control = Server::start(listener, control_limits(), Some(access.tls()), "worker", move |request| {
        let (worker, budget) = (worker.clone(), budget.clone());
        async move { worker.handle(request, &budget).await }
    })?;
    Ok(Running { control, staging })
}

/// Calls answer at once (copies and conversions run in the background).
fn control_limits() -> ServerLimits {
    ServerLimits { max_connections: 64, ..ServerLimits::default() }
}

impl Worker {
    async fn handle(
        self: &Arc<Self>,
        request: HttpRequest<Incoming>,
        budget: &Arc<Semaphore>,
    ) -> Response<Body> {
        if request.uri().path() == HEALTH_PATH && request.method() == http::Method::GET {
            return server::text(StatusCode::OK, "ok\n");
        }
        if request.uri().path() != CALL_PATH || request.method() != http::Method::POST {
            return server::text(StatusCode::NOT_FOUND, "not found\n");
        }
        let authorization = request.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes().to_vec());
        if !self.access.allows_control(authorization.as_deref()) {
            return server::text(StatusCode::UNAUTHORIZED, "this worker's token is required\n");
        }
        let body = match server::read_limited(request, MAX_REQUEST_BYTES, budget, |_| {}).await {
            Ok((body, _held)) => body,
            Err(refused) => return server::text(refused.status(), format!("{refused:?}\n")),
        };
        let request: Request = match serde_json::from_slice(&body) {
            Ok(request) => request,
            Err(e) => return server::text(StatusCode::BAD_REQUEST, format!("not a call: {e}\n")),
        };
        if request.vmm.metadata.uid.as_deref() != Some(self.uid.as_str()) {
            return server::text(StatusCode::FORBIDDEN, "this worker serves another migration\n");
        }
        // The call runs to its end even when the controller stops waiting
        // (its call timed out, the connection closed): a start whose SSH
        // login outlasts the controller's call still starts, and holds its
        // place meanwhile, as the next read shows.
        let worker = Arc::clone(self);
        let answer = tokio::spawn(async move { worker.call(&request.vmm, &request.call).await })
            .await
            .unwrap_or_else(|e| {
                serde_json::json!({ "Err": Failure::retryable(Reason::WorkerProtocolError, format!("the call ended: {e}")) })
            });
        let mut response = Response::new(server::whole(answer.to_string()));
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        response
    }

    /// Runs one port operation; the answer is its result as JSON.
    pub async fn call(&self, vmm: &VirtualMachineMigration, call: &Call) -> serde_json::Value {
        // Conversions run here, whatever runner the spec names: this pod is
        // the migration's data plane.
        let mut vmm = vmm.clone();
        vmm.spec.conversion.runner = ConversionRunner::Local;
        let vmm = &vmm;
        let json = |v: Result<serde_json::Value, serde_json::Error>| {
            v.unwrap_or_else(|e| {
                serde_json::json!({ "Err": Failure::retryable(Reason::WorkerProtocolError, e.to_string()) })
            })
        };
        match call {
            Call::CopyState { disk } => json(serde_json::to_value(self.disks.copy_state(vmm, *disk).await)),
            Call::StartCopy { disk } => json(serde_json::to_value(self.disks.start_copy(vmm, *disk).await)),
            Call::DiscardCopy { disk } => {
                json(serde_json::to_value(self.disks.discard_copy(vmm, *disk).await))
            }
            Call::ArtifactState { disk } => {
                json(serde_json::to_value(self.store.artifact_state(vmm, *disk).await))
            }
            Call::StartConversion { disk } => {
                json(serde_json::to_value(self.store.start_conversion(vmm, *disk).await))
            }
            Call::DiscardArtifact { disk } => {
                json(serde_json::to_value(self.store.discard_artifact(vmm, *disk).await))
            }
            Call::StagedUrl { disk, sha256 } => {
                json(serde_json::to_value(self.store.staged_url(vmm, *disk, sha256).await))
            }
            Call::Stage { disk } => json(serde_json::to_value(self.store.stage(vmm, *disk).await)),
            Call::GuestConversion => json(serde_json::to_value(self.store.guest_conversion(vmm).await)),
            Call::DeltaState { disk } => json(serde_json::to_value(self.disks.delta_state(vmm, *disk).await)),
            Call::StartDeltaCopy { disk } => {
                json(serde_json::to_value(self.disks.start_delta_copy(vmm, *disk).await))
            }
            Call::Patch { disk } => json(serde_json::to_value(self.disks.patch(vmm, *disk).await)),
            Call::StageBase { disk, sha256 } => {
                json(serde_json::to_value(self.store.stage_base(vmm, *disk, sha256).await))
            }
        }
    }
}

/// Runs the worker until SIGTERM (the pod's end), then exits with
/// [`STOPPED_EXIT_CODE`].
pub(crate) async fn run(opts: WorkerOptions) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let running = start(&opts, metrics).await?;
    tracing::info!(
        uid = %opts.uid,
        control = %running.control_addr(),
        staging = %running.staging_addr(),
        work_dir = %opts.work_dir.display(),
        "worker starting"
    );
    crate::server::shutdown_signal().await;
    tracing::info!("worker stopping; copies resume from their sidecars in the next pod");
    drop(running);
    // A worker is never done: it serves until the controller deletes its
    // Job. Stopped before that (a drain, a kill), it must not count as a
    // success, or the Job would complete and start no other pod; 143 (as
    // if by SIGTERM) is what the Job's pod failure policy ignores.
    std::process::exit(STOPPED_EXIT_CODE)
}

/// The exit code of a worker stopped by SIGTERM (128 + 15).
pub(crate) const STOPPED_EXIT_CODE: i32 = 143;
