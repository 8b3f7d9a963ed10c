//! `vmmigrate demo`: one whole migration on this machine, on loopback.
//!
//! It starts what the integration tests start (`tests/support`, compiled in
//! through [`support`]): a real one-node cluster with real CDI v1.65.0, an
//! emulated ESXi host that is a real sshd, a network namespace serving the
//! "guest's" web page, and the KubeVirt simulator. Then a bare Git remote,
//! vmmigrate's gitops loop and controller with the production adapters, and
//! walks through a pull request: push a branch, print the plan, merge, follow
//! the migration to Completed and the status branch. See docs/quickstart.md.
//!
//! By default vmmigrate runs in this process: its log is the demo's. With
//! `--cluster` vmmigrate is the release image installed from `deploy/` (two
//! pods, leader election), its repository served by `git daemon`.

mod cluster;
mod remote;
mod screen;
mod supervisor;
use vmmigrate_harness as support;

use crate::api::{DiskProgress, Phase, PhaseTransition, VirtualMachineMigration};
pub(crate) use crate::cli::DemoOptions;
use crate::controller::reconciler::{self, ControllerConfig};
use crate::controller::service::{self as ctl, ControllerOptions};
use crate::gitops::service::{GitopsHandle, GitopsOptions};
use anyhow::{Context as _, bail, ensure};
use clap::Parser as _;
use kube::api::Api;
use kube::{Client, ResourceExt};
use remote::GitRemote;
use screen::Screen;
use std::collections::HashSet;
use std::io::{IsTerminal as _, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::esxi_emulator::{EsxiEmulator, EsxiOptions};
use support::kube_env::KubeEnv;
use support::netns::Netns;
use tokio::sync::watch;

/// Where the demo's migration, Secret and Service live.
const NAMESPACE: &str = "demo";
const SECRET: &str = "esxi-demo";
const STATUS_BRANCH: &str = "migration-status";

/// The VM the demo migrates.
#[derive(Clone, Copy)]
struct Subject {
    vm: &'static str,
    vmid: &'static str,
    /// What the ESXi line says of it.
    describe: &'static str,
    /// A real guest that boots on real KubeVirt (`--cluster`), or db-02,
    /// whose VMI the KubeVirt simulator reports running.
    real_guest: bool,
}

/// The plain demo's VM: two disks, EFI, two NICs (VM Network and DMZ).
const DB_02: Subject = Subject {
    vm: "db-02",
    vmid: "2",
    describe: "2 disks, EFI, NICs on VM Network and DMZ",
    real_guest: false,
};

/// `--cluster`'s VM: a real Linux guest (`tools/guest/build.sh`) on one
/// disk, SeaBIOS, one NIC; it boots on real KubeVirt and serves its own page.
const APP_BIOS: Subject = Subject {
    vm: "app-bios",
    vmid: "8",
    describe: "a real Linux guest: SeaBIOS, 1 disk, NIC on VM Network",
    real_guest: true,
};

impl Subject {
    fn pr_branch(&self) -> String {
        format!("migrate-{}", self.vm)
    }
}
/// The page the "guest" serves, and the port it listens on.
const PAGE: &str = "<html><body><h1>db-02 status page</h1><p>migrated from ESXi</p></body></html>\n";
const GUEST_HTTP_PORT: u16 = 8080;
const METRICS_PORT: u16 = 9090;
const POLL: Duration = Duration::from_millis(200);

/// Runs the demo; exit code 0 only when the migration completed.
pub fn run(opts: DemoOptions) -> anyhow::Result<()> {
    if opts.in_own_process_group { demo(opts) } else { supervisor::run_child_in_own_process_group() }
}

/// The processes and directories started before the async part.
struct LocalParts {
    kube: &'static KubeEnv,
    esxi: EsxiEmulator,
    guest_web: GuestWeb,
    subject: Subject,
}

/// What answers the application check: busybox httpd in a network
/// namespace standing in for db-02's application, or, with `--cluster`, the
/// real guest's own web server once it has booted.
enum GuestWeb {
    Netns(Box<Netns>),
    Guest,
}

impl GuestWeb {
    fn dir(&self) -> Option<&Path> {
        match self {
            GuestWeb::Netns(n) => Some(n.dir()),
            GuestWeb::Guest => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            GuestWeb::Netns(n) => {
                format!(
                    "guest's web server http://{}:{GUEST_HTTP_PORT}/ in network namespace {}",
                    n.ip,
                    n.name()
                )
            }
            GuestWeb::Guest => {
                "the guest's own web server (port 80), once it boots, through Service web".to_owned()
            }
        }
    }
}

fn demo(opts: DemoOptions) -> anyhow::Result<()> {
    let interactive = !opts.non_interactive && std::io::stdout().is_terminal();
    let mut screen = Screen::new(interactive);
    check_machine()?;
    let work = work_dir(&opts)?;
    init_log(&work.join("vmmigrate.log"))?;
    intro(&mut screen, opts.cluster);
    build_control_plane(&mut screen)?;

    screen.line(if opts.cluster {
        "starting the cluster with CDI and KubeVirt, and the ESXi host…"
    } else {
        "starting the API server, the ESXi host and the guest's web server…"
    });
    let parts = start_local_parts(opts.cluster)?;
    // From here: building the control plane or the release image does not count.
    let deadline = Instant::now() + Duration::from_secs(opts.timeout_seconds);
    let pids = started_processes(&parts);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let stop = stop_signal(&runtime);
    let result = runtime.block_on(walkthrough(&mut screen, &parts, &work, &opts, deadline, stop, &pids));
    drop(runtime);

    screen.line("");
    screen.line("stopping…");
    let LocalParts { kube, esxi, guest_web, .. } = parts;
    drop(guest_web);
    drop(esxi);
    let kube_pids = read_pids(&kube_dir(kube));
    stop_processes(&kube_pids);
    let left: Vec<String> =
        pids.iter().filter(|(_, pid)| is_running(*pid)).map(|(name, pid)| format!("{name}={pid}")).collect();
    if left.is_empty() {
        screen.line(&format!("✓ stopped {} processes; none is left", pids.len()));
    } else {
        screen.line(&format!("! still running: {}", left.join(" ")));
    }
    for dir in ["laptop", "controller", "gitops-cache", "kubeconfig"] {
        let path = work.join(dir);
        let _ = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
    }
    screen.line(&format!(
        "kept: {} and {}",
        work.join("remote.git").display(),
        work.join("vmmigrate.log").display()
    ));
    if opts.work_dir.is_none() {
        screen.line(&format!("      (rm -rf {} when done)", work.display()));
    }
    result
}

/// Root and the Debian packages of `.ci/run`.
fn check_machine() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2));
    ensure!(
        euid == Some("0"),
        "the demo needs root: its ESXi host is a real sshd with a chroot and a system user, and the \
         application check runs in a network namespace (use a VM or container you can be root in)"
    );
    // Missing Debian packages are installed here on first use (we are root).
    support::setup::packages()
}

fn work_dir(opts: &DemoOptions) -> anyhow::Result<PathBuf> {
    match &opts.work_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            ensure!(
                !dir.join("remote.git").exists(),
                "{} holds an earlier demo's remote; give an empty directory",
                dir.display()
            );
            Ok(dir.canonicalize()?)
        }
        None => Ok(tempfile::Builder::new().prefix("vmmigrate-demo-").tempdir()?.keep()),
    }
}

/// vmmigrate's own log goes to a file: the terminal is for the walkthrough.
fn init_log(path: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init();
    Ok(())
}

fn intro(screen: &mut Screen, cluster: bool) {
    let vmmigrate: &[&str] = if cluster {
        &[
            "  real       vmmigrate as installed from deploy/: the release image, two pods with leader",
            "             election; its repository served by git daemon",
        ]
    } else {
        &[
            "  real       vmmigrate's controller with its production adapters: SSH copy + sha256, qemu-img, staging",
        ]
    };
    screen.line(
        "vmmigrate demo: a VM moves from ESXi to KubeVirt through a Git pull request, on this machine.",
    );
    screen.line("");
    for line in [
        "  real       Kubernetes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and one node",
        "             (kubelet, containerd + runc, kube-proxy, CNI bridge, local-path-provisioner)",
    ]
    .iter()
    .chain(vmmigrate)
    {
        screen.line(line);
    }
    for line in [
        "  real       CDI v1.65.0 (operator, controller, API server; built from its Go module): its importer pods",
        "             download each disk from vmmigrate's staging server over HTTPS and check its sha256",
        "  real       ESXi 8 host: OpenSSH sshd with ESXi's algorithms, BusyBox shell, vim-cmd, VMDKs on a datastore",
        "  real       Git: a bare remote pushed to with the git CLI; vmmigrate's gitops loop writes status back",
    ] {
        screen.line(line);
    }
    let guest: &[&str] = if cluster {
        &[
            "  real       KubeVirt v1.8.0 (operator, virt-api, virt-controller, virt-handler, virt-launcher with",
            "             libvirt and QEMU; built from its Go module) boots the copied disk in software emulation:",
            "             a real Linux guest that takes its address by DHCP, runs qemu-guest-agent and serves a page",
            "  real       the application check: HTTP through a Service to the guest's own web server",
            "",
        ]
    } else {
        &[
            "  real       the application check: HTTP through a Service and EndpointSlice to busybox httpd in a",
            "             network namespace, standing in for the guest's web server",
            "  simulated  KubeVirt: the KubeVirt simulator reports the VirtualMachineInstance running; db-02's",
            "             disks hold no OS and nothing boots (`--cluster` boots a real guest on real KubeVirt)",
            "",
        ]
    };
    for line in guest {
        screen.line(line);
    }
}

/// Finds the control plane, or builds it from its Go modules on the first run
/// (minutes; the harness prints progress and holds a lock meanwhile).
fn build_control_plane(screen: &mut Screen) -> anyhow::Result<()> {
    screen.line("finding (or, on the first run, building) the Kubernetes control plane…");
    support::setup::control_plane().map(drop)
}

/// The control plane, the ESXi host and the guest's web server, started side by side.
fn start_local_parts(cluster: bool) -> anyhow::Result<LocalParts> {
    if cluster {
        return start_cluster_parts();
    }
    let (kube, esxi, web) = std::thread::scope(|s| {
        // `shared()` panics when the cluster or CDI cannot start (the message is printed).
        let kube = s.spawn(KubeEnv::shared);
        let esxi = s.spawn(|| EsxiEmulator::start(EsxiOptions::default()));
        let web = s.spawn(|| -> anyhow::Result<Netns> {
            let netns = Netns::new()?;
            netns.serve_http(GUEST_HTTP_PORT, &[("index.html", PAGE)])?;
            Ok(netns)
        });
        (kube.join(), esxi.join(), web.join())
    });
    let kube = kube.map_err(|_| anyhow::anyhow!("the Kubernetes API server did not start (see above)"))?;
    let esxi = esxi
        .map_err(|_| anyhow::anyhow!("the ESXi emulator panicked"))?
        .context("starting the ESXi emulator")?;
    let guest_web = web
        .map_err(|_| anyhow::anyhow!("the network namespace panicked"))?
        .context("starting the guest's web server")?;
    Ok(LocalParts { kube, esxi, guest_web: GuestWeb::Netns(Box::new(guest_web)), subject: DB_02 })
}

/// `--cluster`: the one-node cluster with real KubeVirt first (the ESXi
/// host listens on the address pods reach, which the node's start chooses),
/// the guest images, and the release image imported into the node.
fn start_cluster_parts() -> anyhow::Result<LocalParts> {
    let guests = std::thread::spawn(support::setup::guest_images);
    let kube = std::thread::spawn(KubeEnv::shared_kubevirt)
        .join()
        .map_err(|_| anyhow::anyhow!("the one-node cluster with KubeVirt did not start (see above)"))?;
    let node = kube.node.as_ref().context("the cluster has no node")?;
    let guests = guests
        .join()
        .map_err(|_| anyhow::anyhow!("building the guest images panicked"))?
        .context("building the guest images (tools/guest/build.sh)")?;
    let esxi = EsxiEmulator::start(EsxiOptions {
        also_listen: Some(node.host_ip),
        guests: Some(guests),
        ..Default::default()
    })
    .context("starting the ESXi emulator")?;
    kube.controller_image().context("building and importing the release image")?;
    Ok(LocalParts { kube, esxi, guest_web: GuestWeb::Guest, subject: APP_BIOS })
}

fn kube_dir(kube: &KubeEnv) -> PathBuf {
    kube.kubeconfig_path().parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Every process the parts started, by name, from their janitors' `pids` files.
fn started_processes(parts: &LocalParts) -> Vec<(String, u32)> {
    let mut dirs = vec![
        kube_dir(parts.kube),
        parts.esxi.rsa_key_path().parent().map(Path::to_path_buf).unwrap_or_default(),
    ];
    dirs.extend(parts.guest_web.dir().map(Path::to_path_buf));
    dirs.iter().flat_map(|d| read_pids(d)).map(|pid| (process_name(pid), pid)).collect()
}

fn read_pids(dir: &Path) -> Vec<u32> {
    vmmigrate_harness::process::recorded_pids(dir)
}

/// `etcd`, `sshd`, `httpd` (for `busybox httpd`): the executable's name
/// (sshd rewrites its command line, and `comm` is cut at 15 characters);
/// for `nsenter` (which forks to start containerd in the node's PID
/// namespace), its child's.
fn process_name(pid: u32) -> String {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    let name = exe.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "?".into());
    if name == "nsenter" {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(child) = children.split_whitespace().next().and_then(|c| c.parse().ok()) {
            return process_name(child);
        }
    }
    if name != "busybox" {
        return name;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let applet = cmdline.split(|b| *b == 0).nth(1).map(|a| String::from_utf8_lossy(a).into_owned());
    applet.unwrap_or(name)
}

/// Whether `pid` exists and is not a zombie (our unreaped children are).
fn is_running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name, which is in parentheses and may hold anything.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z")
}

/// Stops the control plane now instead of when its janitor sees this
/// process exit (`KubeEnv` lives in a static and is never dropped): TERM,
/// up to three seconds, then KILL (kube-apiserver's graceful shutdown can
/// take longer, and its data is thrown away). They are our own unreaped
/// children, so the pids cannot have been reused.
fn stop_processes(pids: &[u32]) {
    // A killed process takes a moment to exit too: wait after KILL as well.
    for (signal, patience) in [("-TERM", Duration::from_secs(3)), ("-KILL", Duration::from_secs(5))] {
        for pid in pids.iter().copied().filter(|p| is_running(*p)) {
            let _ = Command::new("kill").arg(signal).arg(pid.to_string()).stderr(Stdio::null()).status();
        }
        let deadline = Instant::now() + patience;
        while pids.iter().any(|p| is_running(*p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Turns SIGINT/SIGTERM, or the supervising parent going away (end of
/// stdin), into `true`.
fn stop_signal(runtime: &tokio::runtime::Runtime) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    let tx = Arc::new(tx);
    let on_signal = tx.clone();
    runtime.spawn(async move {
        crate::server::shutdown_signal().await;
        let _ = on_signal.send(true);
    });
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 256];
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
        let _ = tx.send(true);
    });
    rx
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// vmmigrate's side, plus the simulators: in this process, or installed.
enum Services {
    InProcess(InProcess),
    Cluster { _daemon: support::git_daemon::GitDaemon, metrics_url: Option<String> },
}

impl Services {
    fn metrics_url(&self) -> Option<String> {
        match self {
            Services::InProcess(p) => {
                p.metrics.as_ref().map(|m| format!("http://{}/metrics", m.local_addr()))
            }
            Services::Cluster { metrics_url, .. } => metrics_url.clone(),
        }
    }

    async fn stop(self) {
        // The pods stop with the cluster, when the demo exits.
        if let Services::InProcess(p) = self {
            p.stop().await;
        }
    }
}

/// vmmigrate's side as `vmmigrate run` starts it, in this process.
struct InProcess {
    _sims: support::kubevirt_sim::Simulators,
    metrics: Option<crate::metrics::MetricsServer>,
    gitops: GitopsHandle,
    staging: crate::convert::staging::StagingServer,
    controller: tokio::task::JoinHandle<()>,
    stop_controller: tokio::sync::oneshot::Sender<()>,
}

impl InProcess {
    async fn stop(self) {
        let _ = self.stop_controller.send(());
        let mut controller = self.controller;
        if tokio::time::timeout(Duration::from_secs(10), &mut controller).await.is_err() {
            controller.abort();
        }
        drop(self.staging);
        // Flushes the last status snapshot to the status branch.
        let _ = tokio::time::timeout(Duration::from_secs(30), self.gitops.stop()).await;
    }
}

/// The flags `vmmigrate run` would be started with, parsed by the same
/// definitions: the demo runs exactly that, in this process.
#[derive(clap::Parser)]
#[command(name = "vmmigrate run")]
struct RunFlags {
    #[command(flatten)]
    gitops: GitopsOptions,
    #[command(flatten)]
    controller: ControllerOptions,
}

fn run_flags(remote: &Path, work: &Path, staging_ip: std::net::Ipv4Addr) -> Vec<String> {
    let p = |p: &Path| p.display().to_string();
    let staging_listen = format!("{staging_ip}:0");
    [
        ["--repo", &p(remote)],
        ["--branch", "main"],
        ["--cache-dir", &p(&work.join("gitops-cache"))],
        ["--poll-seconds", "2"],
        ["--manifest-namespace", NAMESPACE],
        ["--status-branch", STATUS_BRANCH],
        ["--status-window-seconds", "3"],
        ["--namespace", NAMESPACE],
        ["--work-dir", &p(&work.join("controller"))],
        // Where CDI's importer pods reach this process: the host end of
        // the node's network.
        ["--staging-listen", &staging_listen],
        ["--conversions", "2"],
        ["--copy-streams", "2"],
        ["--instance", "vmmigrate-demo"],
        // Where a Deployment's pod namespace would be: the controller keeps
        // its source-VM claims there.
        ["--lease-namespace", NAMESPACE],
    ]
    .iter()
    .flat_map(|pair| pair.iter().map(|s| s.to_string()))
    .collect()
}

async fn start_services(
    screen: &mut Screen,
    client: &Client,
    remote: &GitRemote,
    work: &Path,
    guest_ip: std::net::Ipv4Addr,
    staging_ip: std::net::Ipv4Addr,
) -> anyhow::Result<Services> {
    let sims = support::kubevirt_sim::start(client.clone(), NAMESPACE);
    *sims.control.kubevirt.vmi_ip.lock().unwrap_or_else(|p| p.into_inner()) = guest_ip.to_string();
    screen.line("✓ KubeVirt simulator; real CDI v1.65.0 imports into local-path volumes on the node");

    let registry = Arc::new(crate::metrics::Metrics::new());
    let metrics = match crate::metrics::serve(([127, 0, 0, 1], METRICS_PORT).into(), registry.clone()).await {
        Ok(server) => Some(server),
        Err(_) => crate::metrics::serve(([127, 0, 0, 1], 0).into(), registry.clone()).await.ok(),
    };

    let flags = run_flags(remote.bare(), work, staging_ip);
    let RunFlags { gitops, controller } =
        RunFlags::try_parse_from(std::iter::once("vmmigrate run".to_owned()).chain(flags.iter().cloned()))
            .context("the demo's `vmmigrate run` flags")?;
    let gitops = crate::gitops::service::start(client.clone(), gitops, registry.clone())
        .await
        .context("starting the gitops loop")?;
    screen.line("✓ vmmigrate gitops loop: polls main every 2 s, writes status to branch migration-status");

    let staging = ctl::start_staging(&controller, &registry).await?;
    let adapters = ctl::adapters(client.clone(), &controller, &staging, &registry)?;
    let config = ControllerConfig {
        namespace: controller.namespace.clone(),
        // The machine polls running work every 5 s; every second makes the bars move.
        max_requeue: Some(Duration::from_secs(1)),
        instance: controller.instance.clone(),
        metrics: registry,
        ..Default::default()
    };
    let (stop_controller, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let controller_task = tokio::spawn(reconciler::run(client.clone(), adapters, config, async move {
        let _ = stopped_rx.await;
    }));
    screen.line(&format!(
        "✓ vmmigrate controller: production adapters, staging server https://{}, work dir {}",
        staging.local_addr(),
        controller.work_dir.display()
    ));
    screen.line(&format!(
        "  (as `vmmigrate run {}` would, but polling running work every 1 s instead of 5 s)",
        flags.join(" ")
    ));
    if let Some(m) = &metrics {
        screen.line(&format!("✓ metrics: http://{}/metrics", m.local_addr()));
    }
    Ok(Services::InProcess(InProcess {
        _sims: sims,
        metrics,
        gitops,
        staging,
        controller: controller_task,
        stop_controller,
    }))
}

/// `--cluster`: the repository served by `git daemon` on the address pods
/// reach, and vmmigrate installed from deploy/ as a user would (an overlay
/// of the base: the imported image, the node's ReadWriteOnce class, this
/// repository, the demo's settings, and the Secret-reading Role of
/// deploy/overlays/example-tenant for namespace demo).
async fn start_cluster_services(
    screen: &mut Screen,
    kube: &'static KubeEnv,
    remote: &GitRemote,
    work: &Path,
) -> anyhow::Result<Services> {
    let node = kube.node.as_ref().context("the cluster has no node")?;
    screen.line(&format!(
        "✓ KubeVirt {} (software emulation) and CDI {} on the node, each deployed by its operator",
        support::kubevirt::VERSION,
        support::cdi::VERSION
    ));

    let served = remote.bare().parent().context("the remote's directory")?.to_path_buf();
    let daemon = support::git_daemon::GitDaemon::start(node.host_ip, &served)?;
    let name = remote.bare().file_name().context("the remote's name")?.to_string_lossy().into_owned();
    let repo_url = daemon.url(&name);
    screen.line(&format!("✓ git daemon: {repo_url} (fetch and push)"));

    let image = tokio::task::block_in_place(|| kube.controller_image())?;
    let overlay = work.join("deploy-overlay");
    std::fs::create_dir_all(&overlay)?;
    let install = support::deploy::Install {
        image: &image,
        repo_url: &repo_url,
        watch_namespace: None,
        credential_namespaces: &[NAMESPACE],
        settings: &[
            ("VMMIGRATE_POLL_SECONDS", "2"),
            ("VMMIGRATE_STATUS_WINDOW_SECONDS", "3"),
            ("VMMIGRATE_STATUS_BRANCH", STATUS_BRANCH),
        ],
    };
    tokio::task::block_in_place(|| -> anyhow::Result<()> {
        support::deploy::install(kube, &overlay, &install)?;
        support::deploy::wait_ready(kube)
    })
    .context("installing vmmigrate from deploy/")?;
    let pods = kube.kubectl(&[
        "-n",
        support::deploy::SYSTEM,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/component=controller",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name}={.status.podIP} {end}",
    ])?;
    screen.line(&format!(
        "✓ vmmigrate {image} installed with kubectl apply -k {} (deploy/base + overlay): pods {}",
        overlay.display(),
        pods.trim()
    ));
    let metrics_url = pods
        .split_whitespace()
        .next()
        .and_then(|p| p.split_once('='))
        .map(|(_, ip)| format!("http://{ip}:{METRICS_PORT}/metrics"));
    Ok(Services::Cluster { _daemon: daemon, metrics_url })
}

async fn walkthrough(
    screen: &mut Screen,
    parts: &LocalParts,
    work: &Path,
    opts: &DemoOptions,
    deadline: Instant,
    stop: watch::Receiver<bool>,
    pids: &[(String, u32)],
) -> anyhow::Result<()> {
    let client = parts.kube.client().await;
    let kubeconfig = work.join("kubeconfig");
    std::fs::copy(parts.kube.kubeconfig_path(), &kubeconfig)?;
    screen.line(&format!(
        "✓ Kubernetes API server {} (kubeconfig {})",
        parts.kube.version,
        kubeconfig.display()
    ));
    let esxi = &parts.esxi;
    screen.line(&format!(
        "✓ ESXi host {}:{}, host key {}, VM {} (vmid {}): {}",
        source_host(parts),
        esxi.port,
        esxi.host_key_fingerprint(),
        parts.subject.vm,
        parts.subject.vmid,
        parts.subject.describe,
    ));
    screen.line(&format!("✓ {}", parts.guest_web.describe()));
    let names: Vec<String> = pids.iter().map(|(name, pid)| format!("{name}={pid}")).collect();
    screen.line(&format!("processes started: {}", names.join(" ")));

    let hosts = format!("{}:{}={}", source_host(parts), esxi.port, esxi.host_key_fingerprint());
    cluster::prepare(&client, NAMESPACE, SECRET, &hosts, &esxi.username, &esxi.password).await?;
    let service = match &parts.guest_web {
        GuestWeb::Netns(netns) => {
            cluster::web_service(&client, NAMESPACE, "db-web", netns.ip, GUEST_HTTP_PORT).await?;
            "db-web"
        }
        GuestWeb::Guest => {
            cluster::guest_service(&client, NAMESPACE, "web", parts.subject.vm).await?;
            "web"
        }
    };
    screen.line(&format!("✓ namespace {NAMESPACE}: Secret {SECRET} (the ESXi login), Service {service}"));

    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples-repo");
    let remote = tokio::task::block_in_place(|| GitRemote::create(work, &examples))?;
    screen.line(&format!(
        "✓ Git remote {} (main: README.md and providers/ from examples-repo)",
        remote.bare().display()
    ));

    let services = match &parts.guest_web {
        GuestWeb::Guest => start_cluster_services(screen, parts.kube, &remote, work).await?,
        GuestWeb::Netns(netns) => {
            let node = parts.kube.node.as_ref().context("the cluster has no node")?;
            start_services(screen, &client, &remote, work, netns.ip, node.host_ip).await?
        }
    };
    let metrics_url = services.metrics_url();
    let host = source_host(parts);
    let result = tokio::select! {
        r = pull_request_to_completed(screen, &client, &remote, &host, esxi, parts.subject, deadline) => r,
        _ = stopped(stop.clone()) => Err(anyhow::anyhow!("interrupted")),
    };
    if let Ok(vmm) = &result {
        summary(screen, vmm, esxi, parts.subject);
        if parts.subject.real_guest {
            show_guest(screen, &client, parts.subject).await;
        }
    }
    look_around(screen, &remote, &kubeconfig, work, metrics_url.as_deref(), parts.subject);
    if opts.keep && !*stop.borrow() {
        screen.line("");
        screen.line("Everything keeps running (--keep). Press Ctrl-C to stop it.");
        stopped(stop).await;
    }
    services.stop().await;
    result.map(|_| ())
}

/// The ESXi host's address as the controller reaches it (with `--cluster`
/// the controller runs in pods, which reach the host end of the node's veth).
fn source_host(parts: &LocalParts) -> String {
    match &parts.guest_web {
        GuestWeb::Guest => parts.kube.node.as_ref().map(|n| n.host_ip.to_string()).unwrap_or_default(),
        GuestWeb::Netns(_) => "127.0.0.1".to_owned(),
    }
}

/// The manifest the engineer writes, pinned to the emulated host's key.
fn manifest(host: &str, esxi: &EsxiEmulator, subject: Subject) -> String {
    let text = manifest_text(host, esxi.port, &esxi.host_key_fingerprint());
    if subject.real_guest { guest_manifest_text(&text, subject.vm) } else { text }
}

/// db-02's manifest made the real guest's: its name, its one network, and
/// the page it serves itself (naming itself with the hostname KubeVirt's
/// DHCP gives it).
fn guest_manifest_text(db_02: &str, vm: &str) -> String {
    db_02
        .replace(
            "# Migrate db-02 (two disks, EFI, two NICs)",
            &format!("# Migrate {vm} (a real Linux guest)"),
        )
        .replace("name: db-02", &format!("name: {vm}"))
        .replace("    - source: DMZ\n      type: Multus\n      networkName: dmz\n", "")
        .replace("service: db-web", "service: web")
        .replace("bodyContains: db-02 status page", &format!("bodyContains: vmmigrate-guest {vm}"))
}

fn manifest_text(host: &str, port: u16, host_key: &str) -> String {
    format!(
        r#"# Migrate db-02 (two disks, EFI, two NICs) from the demo's ESXi host.
apiVersion: migration.platform.example/v1alpha1
kind: VirtualMachineMigration
metadata:
  name: db-02
  namespace: {NAMESPACE}
spec:
  source:
    host: {host}
    port: {port}
    # Pinned: `ssh-keygen -lf` of the host's key. Any other key is refused.
    hostKey: {host_key}
    credentialsSecretRef:
      name: {SECRET}
    vm:
      name: db-02
  destination:
    namespace: {NAMESPACE}
    storageClassName: local-path
  networkMap:
    - source: VM Network
      type: Pod
    - source: DMZ
      type: Multus
      networkName: dmz
  conversion:
    # The demo's guest was built to boot anywhere (virtio drivers, DHCP).
    # A guest installed on ESXi is converted by default (guest: auto).
    guest: none
  powerOffPolicy: GracefulThenForce
  strategy:
    # Short waits between retries keep the demo quick (defaults: 10 s, up to 600 s).
    backoff:
      initialSeconds: 2
      maxSeconds: 10
  validation:
    checks:
      - name: status-page
        http:
          service: db-web
          port: 80
          path: /
          expectedStatus: 200
          bodyContains: db-02 status page
      - name: agent
        guestAgent: {{}}
      - name: address
        ip: {{}}
"#,
    )
}

fn section(screen: &mut Screen, title: &str) {
    screen.line("");
    screen.line(&format!("── {title}"));
}

fn quoted(screen: &mut Screen, text: &str) {
    for line in text.lines() {
        screen.line(&format!("   │ {line}"));
    }
}

/// Pull request → plan → merge → Completed → status branch. Returns the completed migration.
async fn pull_request_to_completed(
    screen: &mut Screen,
    client: &Client,
    remote: &GitRemote,
    host: &str,
    esxi: &EsxiEmulator,
    subject: Subject,
    deadline: Instant,
) -> anyhow::Result<VirtualMachineMigration> {
    let vm = subject.vm;
    let branch = subject.pr_branch();
    let path = format!("migrations/{vm}.yaml");
    let text = manifest(host, esxi, subject);
    section(screen, &format!("1. Pull request: branch {branch} adds {path}"));
    let head = tokio::task::block_in_place(|| {
        remote.push_branch(&branch, &[(&path, &text)], &format!("Migrate {vm} to KubeVirt"))
    })?;
    quoted(screen, &text);
    screen.line(&format!("   pushed {branch} at {}", &head[..head.len().min(7)]));

    section(screen, "2. The plan vmmigrate posts on the pull request (`vmmigrate plan` on the branch)");
    let (plan, ok) = crate::gitops::local::plan_local(
        remote.laptop(),
        &crate::gitops::render::RenderOptions::new(NAMESPACE, &Default::default()),
        Some(client),
    )
    .await?;
    quoted(screen, plan.lines().filter(|l| !l.starts_with("<!--")).collect::<Vec<_>>().join("\n").trim());
    ensure!(ok, "the plan fails (see above)");

    let merge = tokio::task::block_in_place(|| remote.merge(&branch))?;
    let merged_at = Instant::now();
    section(
        screen,
        &format!(
            "3. Merged: main fast-forwarded to {}; the gitops loop applies it",
            &merge[..merge.len().min(7)]
        ),
    );

    section(screen, &format!("4. The migration {NAMESPACE}/{vm}, live"));
    let vmm = follow(screen, client, subject, merged_at, deadline).await?;

    section(screen, "5. The outcome, written back to Git");
    let file = format!("{STATUS_BRANCH}:{NAMESPACE}/{vm}.yaml");
    loop {
        let shown = tokio::task::block_in_place(|| remote.show(&file));
        if let Some(yaml) = shown
            && status_file_phase(&yaml).as_deref() == Some("Completed")
        {
            let commit = tokio::task::block_in_place(|| remote.short(STATUS_BRANCH)).unwrap_or_default();
            screen.line(&format!(
                "{}  branch {STATUS_BRANCH} at {commit}: {NAMESPACE}/{vm}.yaml says phase: Completed",
                screen::elapsed(merged_at.elapsed())
            ));
            return Ok(vmm);
        }
        if Instant::now() >= deadline {
            bail!("timed out: the status branch does not show {NAMESPACE}/{vm} Completed");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `phase` of a status-branch file.
fn status_file_phase(yaml: &str) -> Option<String> {
    let value: serde_yaml::Value = serde_yaml::from_str(yaml).ok()?;
    value.get("phase")?.as_str().map(str::to_owned)
}

/// Follows the migration until it is Completed and cleaned up: a line per
/// phase entered and per error recorded, progress bars per disk.
async fn follow(
    screen: &mut Screen,
    client: &Client,
    subject: Subject,
    merged_at: Instant,
    deadline: Instant,
) -> anyhow::Result<VirtualMachineMigration> {
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), NAMESPACE);
    let mut applied = false;
    let mut last_transition: Option<PhaseTransition> = None;
    let mut current = Phase::Pending;
    let mut bars: Vec<DiskProgress> = Vec::new();
    let mut errors_seen: HashSet<String> = HashSet::new();
    loop {
        let at = screen::elapsed(merged_at.elapsed());
        let (vm, real_guest) = (subject.vm, subject.real_guest);
        let vmm = match api.get_opt(vm).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "reading the migration");
                None
            }
        };
        if let Some(vmm) = vmm {
            if !applied {
                applied = true;
                let commit =
                    vmm.annotations().get(crate::gitops::ANNOTATION_COMMIT).cloned().unwrap_or_default();
                screen.line(&format!(
                    "{at}  applied by the gitops loop from commit {}",
                    &commit[..commit.len().min(7)]
                ));
            }
            let status = vmm.status.clone().unwrap_or_default();
            for t in new_transitions(&status.history, last_transition.as_ref()) {
                if screen::has_disk_progress(current) {
                    let forward = !matches!(
                        t.phase,
                        Phase::Retryable | Phase::Failed | Phase::ManualInterventionRequired
                    );
                    let sizes: Vec<DiskProgress> = if bars.is_empty() {
                        status
                            .disks
                            .iter()
                            .map(|d| DiskProgress {
                                index: d.index,
                                bytes_total: d.size_bytes,
                                ..Default::default()
                            })
                            .collect()
                    } else {
                        bars.clone()
                    };
                    let last = if forward {
                        sizes.iter().map(screen::disk_done).collect()
                    } else {
                        bars.iter().map(screen::disk_bar).collect()
                    };
                    screen.freeze(last);
                }
                bars.clear();
                current = t.phase;
                screen.line(&format!(
                    "{at}  {:<27}{}",
                    t.phase.to_string(),
                    screen::caption(t.phase, real_guest)
                ));
                last_transition = Some(t);
            }
            for e in &status.errors {
                let key = format!("{:?}/{}/{}", e.time, e.reason, e.message);
                if errors_seen.insert(key) {
                    screen.line(&format!("{at}  ! {} in {}: {}", e.reason, e.phase, e.message));
                }
            }
            if screen::has_disk_progress(status.phase)
                && let Some(progress) = &status.progress
                && progress.disks.iter().any(|d| d.bytes_total > 0)
            {
                bars = progress.disks.clone();
                screen.live(bars.iter().map(screen::disk_bar).collect());
            }
            match status.phase {
                Phase::Completed if status.timestamps.cleaned_up.is_some() => return Ok(vmm),
                Phase::Failed | Phase::ManualInterventionRequired => {
                    let errors: Vec<String> = status
                        .errors
                        .iter()
                        .map(|e| format!("  {} in {}: {}", e.reason, e.phase, e.message))
                        .collect();
                    bail!("the migration stopped in {}:\n{}", status.phase, errors.join("\n"));
                }
                _ => {}
            }
        }
        if Instant::now() >= deadline {
            bail!("timed out in phase {current} (--timeout-seconds)");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The history entries after `last` (all of them when `last` is not in it any more).
fn new_transitions(history: &[PhaseTransition], last: Option<&PhaseTransition>) -> Vec<PhaseTransition> {
    let start = match last {
        None => 0,
        Some(last) => history.iter().rposition(|t| t == last).map(|i| i + 1).unwrap_or(0),
    };
    history[start..].to_vec()
}

/// What the migration proved, from its status and the emulated host.
fn summary(screen: &mut Screen, vmm: &VirtualMachineMigration, esxi: &EsxiEmulator, subject: Subject) {
    let (vm, vmid) = (subject.vm, subject.vmid);
    let status = vmm.status.clone().unwrap_or_default();
    section(screen, &format!("Result: {NAMESPACE}/{vm} {}", status.phase));
    screen.line(&format!(
        "   source      {vm} on the ESXi host: power {}, powered off {} by vmmigrate; its disks were only read",
        esxi.vm_power(vmid),
        match esxi.power_off_transitions(vmid) {
            1 => "once".to_owned(),
            n => format!("{n} times"),
        }
    ));
    let on_datastore = esxi.disk_files(vmid);
    for d in &status.disks {
        let sha = d.source_sha256.clone().unwrap_or_default();
        let same = on_datastore.get(d.index as usize).is_some_and(|f| f.2 == sha);
        screen.line(&format!(
            "   disk {}      {}  sha256 {}…  {} the datastore's file; imported into DataVolume {}",
            d.index,
            screen::mib(d.size_bytes),
            &sha[..sha.len().min(16)],
            if same { "=" } else { "≠" },
            d.data_volume_name.clone().unwrap_or_default()
        ));
    }
    if let Some(vm) = &status.destination_vm {
        let running = if subject.real_guest {
            "running on real KubeVirt, booted from the copied bytes"
        } else {
            "a real object; running it is simulated"
        };
        screen.line(&format!("   VM          VirtualMachine {}/{} ({running})", vm.namespace, vm.name));
    }
    let checks: Vec<String> = status
        .validation_results
        .iter()
        .map(|r| format!("{} {}", r.name, if r.passed { "✓" } else { "✗" }))
        .collect();
    screen.line(&format!("   checks      {}", checks.join("  ")));
}

/// The real guest after Completed: the lines its serial console printed
/// (KubeVirt's `guest-console-log` container) and the page it serves (GET /
/// at the address its VMI reports, the one the check reached).
async fn show_guest(screen: &mut Screen, client: &Client, subject: Subject) {
    section(screen, &format!("The guest {} on KubeVirt", subject.vm));
    let (console, page) = guest_console_and_page(client, subject.vm).await;
    let booted: Vec<&str> = console.lines().filter(|l| l.starts_with("vmmigrate-guest: ")).take(3).collect();
    if booted.is_empty() {
        screen.line("   console     (no line from the guest yet)");
    }
    for line in booted {
        screen.line(&format!("   console     {line}"));
    }
    for line in page.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('<')).take(4) {
        screen.line(&format!("   page        {line}"));
    }
}

async fn guest_console_and_page(client: &Client, vm: &str) -> (String, String) {
    use k8s_openapi::api::core::v1::Pod;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let launcher = pods
        .list(&kube::api::ListParams::default().labels(&format!("kubevirt.io/domain={vm}")))
        .await
        .ok()
        .and_then(|l| l.items.into_iter().next());
    let console = match launcher {
        Some(pod) => {
            let params =
                kube::api::LogParams { container: Some("guest-console-log".into()), ..Default::default() };
            pods.logs(&pod.name_any(), &params).await.unwrap_or_default()
        }
        None => String::new(),
    };
    let vmis: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &crate::destination::cluster::virtual_machine_instance_resource(),
    );
    let ip = match vmis.get(vm).await {
        Ok(vmi) => vmi.data["status"]["interfaces"][0]["ipAddress"].as_str().unwrap_or_default().to_owned(),
        Err(_) => String::new(),
    };
    let page = match reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build() {
        Ok(http) if !ip.is_empty() => match http.get(format!("http://{ip}/")).send().await {
            Ok(answer) => answer.text().await.unwrap_or_default(),
            Err(e) => format!("GET http://{ip}/: {e}"),
        },
        _ => String::new(),
    };
    (console, page)
}

fn look_around(
    screen: &mut Screen,
    remote: &GitRemote,
    kubeconfig: &Path,
    work: &Path,
    metrics: Option<&str>,
    subject: Subject,
) {
    let vm = subject.vm;
    let bare = remote.bare().display();
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "vmmigrate".into());
    section(screen, "Look around");
    for line in [
        format!("   Git remote  {bare}"),
        format!("     git --git-dir {bare} log --oneline {STATUS_BRANCH}"),
        format!("     git --git-dir {bare} show {STATUS_BRANCH}:STATUS.md"),
        format!("     git --git-dir {bare} show {STATUS_BRANCH}:{NAMESPACE}/{vm}.yaml"),
        "   Cluster     while the demo runs (--keep keeps it running after the migration):".to_owned(),
        format!("     KUBECONFIG={} {exe} status", kubeconfig.display()),
        format!("     KUBECONFIG={} kubectl get vmm -A      (if kubectl is installed)", kubeconfig.display()),
        format!(
            "   Metrics     {}",
            metrics
                .map(|m| format!("curl -s {m}"))
                .unwrap_or_else(|| "(the metrics server did not start)".into())
        ),
        format!("   Log         {}", work.join("vmmigrate.log").display()),
    ] {
        screen.line(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn at(phase: Phase, second: i64) -> PhaseTransition {
        let time = Time(Timestamp::from_second(1_800_000_000 + second).unwrap_or(Timestamp::UNIX_EPOCH));
        PhaseTransition { phase, time }
    }

    #[test]
    fn new_transitions_are_those_after_the_last_one_printed() {
        let history = vec![at(Phase::Pending, 0), at(Phase::Discovering, 1), at(Phase::Validated, 2)];
        assert_eq!(new_transitions(&history, None), history);
        assert_eq!(new_transitions(&history, Some(&history[1])), vec![history[2].clone()]);
        assert!(new_transitions(&history, Some(&history[2])).is_empty());
    }

    #[test]
    fn new_transitions_survive_the_front_of_the_history_being_trimmed() {
        let trimmed = vec![at(Phase::Validated, 2), at(Phase::Preparing, 3)];
        assert_eq!(new_transitions(&trimmed, Some(&at(Phase::Validated, 2))), vec![trimmed[1].clone()]);
        // The last one printed was trimmed away: everything left is shown.
        assert_eq!(new_transitions(&trimmed, Some(&at(Phase::Pending, 0))), trimmed);
    }

    #[test]
    fn status_file_phase_reads_the_phase_of_a_status_branch_file() {
        let file = "# Written by vmmigrate\nname: db-02\nnamespace: demo\nphase: Completed\n";
        assert_eq!(status_file_phase(file).as_deref(), Some("Completed"));
        assert_eq!(status_file_phase("name: db-02\n"), None);
        assert_eq!(status_file_phase(": not yaml ["), None);
    }

    #[test]
    fn the_run_flags_parse_with_the_real_option_definitions() {
        let flags =
            run_flags(Path::new("/tmp/r.git"), Path::new("/tmp/w"), std::net::Ipv4Addr::new(10, 0, 0, 1));
        let parsed = RunFlags::try_parse_from(std::iter::once("vmmigrate run".to_owned()).chain(flags));
        let RunFlags { gitops, controller } = parsed.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(gitops.repo, "/tmp/r.git");
        assert_eq!(gitops.poll_seconds, 2);
        assert_eq!(gitops.status_branch, STATUS_BRANCH);
        assert_eq!(controller.namespace.as_deref(), Some(NAMESPACE));
        assert_eq!(controller.work_dir, Path::new("/tmp/w/controller"));
        assert_eq!(controller.staging_listen, "10.0.0.1:0".parse().unwrap());
    }

    #[test]
    fn the_demo_manifest_renders_without_errors() {
        use crate::gitops::render::{RenderOptions, render};
        let files = vec![crate::gitops::RepoFile {
            path: format!("migrations/{}.yaml", DB_02.vm),
            bytes: manifest_text("127.0.0.1", 2222, &format!("SHA256:{}", "A".repeat(43))).into_bytes(),
        }];
        let provenance = crate::gitops::Provenance { repo_url: "demo".into(), commit: "c".into() };
        let rendered = render(&files, &provenance, &RenderOptions::new(NAMESPACE, &Default::default()));
        let rendered = rendered.unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(rendered.len(), 1);
        assert_eq!(rendered[0].namespace, NAMESPACE);
        assert_eq!(rendered[0].object["spec"]["source"]["port"], 2222);
    }
}
