//! One process assembled from its options: the Tokio runtime, the metrics
//! listener, the Kubernetes client, the staging server and the adapters,
//! the leader election, and what runs under it. `cli` parses, sets up
//! logging and dispatches here; the controller's and the worker's own
//! assembly (`controller::service`, `worker::process`) are called from here.

/// What every long-running process but a worker serves beside its work.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeOptions {
    /// Address of the metrics server (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, env = "VMMIGRATE_METRICS_LISTEN", default_value = crate::metrics::DEFAULT_LISTEN)]
    pub metrics_listen: std::net::SocketAddr,
}

/// Runs one migration's worker until SIGTERM.
pub(crate) fn worker(opts: crate::worker::process::WorkerOptions) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(crate::worker::process::run(opts))
}

/// Runs the controller with the real adapters until Ctrl-C or SIGTERM.
pub(crate) fn controller(
    opts: crate::controller::service::ControllerOptions,
    serve: ServeOptions,
) -> anyhow::Result<()> {
    use crate::controller::service as ctl;
    use anyhow::Context as _;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let _server = crate::metrics::serve_configured(Some(serve.metrics_listen), metrics.clone()).await?;
        let client =
            crate::ports::kube_client("controller").await.context("connecting to the Kubernetes API")?;
        let staging = ctl::start_staging(&opts, &metrics).await?;
        let adapters = ctl::adapters(client.clone(), &opts, &staging, &metrics)?;
        tracing::info!(
            staging = %staging.local_addr(),
            work_dir = %opts.work_dir.display(),
            "controller starting"
        );
        let config = opts.reconciler_config(metrics, None);
        let result = ctl::run_reconciler(client, adapters, config, &opts.leader_election).await;
        drop(staging);
        result
    })
}

/// The gitops side, and with `controller` the controller too, in one process.
pub(crate) fn gitops(
    opts: crate::gitops::service::GitopsOptions,
    serve: ServeOptions,
    controller: Option<crate::controller::service::ControllerOptions>,
) -> anyhow::Result<()> {
    use crate::controller::service as ctl;
    if let Some(key) = &opts.ssh_key {
        let auth =
            crate::gitops::repo::RepoAuth::SshKey { key: key.clone(), known_hosts: opts.known_hosts.clone() };
        if let Some(cmd) = crate::gitops::repo::TrackedRepo::ssh_command(&auth) {
            // SAFETY: no other thread exists yet (the runtime starts below),
            // so nothing reads the environment concurrently.
            unsafe { std::env::set_var("GIT_SSH_COMMAND", cmd) };
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let _server = crate::metrics::serve_configured(Some(serve.metrics_listen), metrics.clone()).await?;
        let part = if controller.is_some() { "run" } else { "gitops" };
        let client = crate::ports::kube_client(part).await?;
        // `run` elects with the controller's flags; `gitops` alone runs one replica.
        let election = controller.as_ref().map(|c| c.leader_election.clone()).unwrap_or_default();
        let instance =
            controller.as_ref().map_or_else(|| "vmmigrate-gitops".to_owned(), |c| c.instance.clone());
        // The gitops half leaves the elected work through this slot, so that
        // a shutdown can flush its last status (a lost Lease drops it unflushed:
        // the next leader writes).
        let started = std::sync::Mutex::new(None);
        // Filled by the election, if there is one: asked before an irreversible action.
        let fence_slot =
            std::sync::Arc::new(std::sync::OnceLock::<crate::controller::reconciler::LeaseFence>::new());
        let lease_fence: crate::controller::reconciler::LeaseFence = {
            let slot = fence_slot.clone();
            std::sync::Arc::new(move || slot.get().is_none_or(|holds| holds()))
        };
        let work = async {
            let gitops = crate::gitops::service::start(client.clone(), opts, metrics.clone()).await?;
            *started.lock().unwrap_or_else(|p| p.into_inner()) = Some(gitops);
            let Some(c) = controller else {
                return std::future::pending().await;
            };
            let staging = ctl::start_staging(&c, &metrics).await?;
            let adapters = ctl::adapters(client.clone(), &c, &staging, &metrics)?;
            let config = c.reconciler_config(metrics.clone(), Some(lease_fence));
            crate::controller::reconciler::run(client.clone(), adapters, config, std::future::pending())
                .await;
            drop(staging);
            Ok(())
        };
        let result =
            ctl::run_elected(client.clone(), &election, &instance, metrics.clone(), &fence_slot, work).await;
        let gitops = started.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(gitops) = gitops
            && result.is_ok()
        {
            gitops.stop().await;
        }
        result
    })
}
