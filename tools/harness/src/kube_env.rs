//! A real Kubernetes cluster for the tests, built from its Go modules by
//! `tools/testenv/build.sh` (`crate::setup`) and started in a temporary
//! directory: etcd, kube-apiserver, kube-controller-manager and, in the
//! one-node shape, kube-scheduler and a real node (`crate::node`: kubelet,
//! containerd, kube-proxy, CNI, local-path-provisioner).
//!
//! [`KubeEnv::shared`] is the one-node cluster with real CDI, once per test
//! binary: pods run, and the API server listens on the host end of the
//! node's veth. [`KubeEnv::start_owned`] starts a cluster of its own, with
//! or without a node, for tests of the harness.
//!
//! Each test makes its own `kube::Client` (a client belongs to the tokio
//! runtime it was made in) and its own namespace. When
//! `VMMIGRATE_TEST_KUBECONFIG` is set, that cluster is used instead and
//! nothing is started.
//!
//! Nothing is left behind: every process we start is recorded in `pids`, and a
//! small janitor shell (its stdin is a pipe only this process holds) kills them
//! and removes the directory as soon as the test process exits, however it exits.

use crate::node::{ControlPlane, Node, NodeNet};
use crate::process::{Janitor, free_port, wait_until};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

const ADMIN_TOKEN: &str = "vmmigrate-test-admin-token";
const NODE_TOKEN: &str = "vmmigrate-test-node-token";
const PROXY_TOKEN: &str = "vmmigrate-test-kube-proxy-token";
const SCHEDULER_TOKEN: &str = "vmmigrate-test-scheduler-token";

/// A running (or borrowed) cluster.
pub struct KubeEnv {
    kubeconfig: PathBuf,
    /// The API server's reported version, e.g. `v1.35.4`.
    pub version: String,
    /// The node, in the one-node shape.
    pub node: Option<Node>,
    /// The cluster's binaries (kubectl among them); `None` when borrowed.
    pub bin: Option<PathBuf>,
    /// How long the cluster took to start, node and provisioner included.
    pub startup: Duration,
    /// The release image, once imported into the node.
    imported: std::sync::Mutex<Option<String>>,
    /// Whether real CDI was installed (`cdi()`), or why it could not be.
    cdi: std::sync::Mutex<Option<Result<(), String>>>,
    /// Whether real KubeVirt was installed (`kubevirt()`), or why it could not be.
    kubevirt: std::sync::Mutex<Option<Result<(), String>>>,
    /// etcd's client port (plain HTTP on loopback); `None` when borrowed.
    etcd_port: Option<u16>,
    /// The API server's audit log of every delete (JSON lines, written
    /// before each answer); `None` when borrowed.
    audit_log: Option<PathBuf>,
    // Dropped in this order: processes (janitor), then the node's network,
    // cgroups and mounts (its guard).
    _janitor: Option<Janitor>,
    _net: Option<NodeNet>,
}

static SHARED: OnceLock<KubeEnv> = OnceLock::new();
static SHARED_KUBEVIRT: OnceLock<KubeEnv> = OnceLock::new();

/// A control-plane process a fault test stops and starts again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Etcd,
    ApiServer,
    /// The node's kubelet: its pods keep running while it is stopped.
    Kubelet,
    /// The node's containerd: its containers keep running (their shims
    /// hold them) while it is stopped.
    Containerd,
}

impl Component {
    fn process(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "kube-apiserver",
            Component::Kubelet => "kubelet",
            Component::Containerd => "containerd",
        }
    }
}

impl KubeEnv {
    /// The one-node cluster of this test binary with real CDI (`cdi()`),
    /// started on first use. CDI's operator installs CDI's definitions
    /// itself (it refuses to start beside definitions somebody else applied).
    pub fn shared() -> &'static KubeEnv {
        SHARED.get_or_init(|| {
            let env = start_blocking(Shape::Node);
            // A borrowed cluster (`VMMIGRATE_TEST_KUBECONFIG`) brings its own.
            if env.node.is_some() {
                env.cdi().unwrap_or_else(|e| panic!("cannot install CDI: {e:#}"));
            }
            env
        })
    }

    /// The second one-node cluster of this test binary, with real CDI and
    /// real KubeVirt (`kubevirt()`), started on first use: where migrated
    /// guests boot. It is a cluster of its own because the KubeVirt
    /// simulator of the controller-level tests on [`KubeEnv::shared`] and
    /// real KubeVirt cannot both own VirtualMachines.
    pub fn shared_kubevirt() -> &'static KubeEnv {
        SHARED_KUBEVIRT.get_or_init(|| {
            let env = start_blocking(Shape::KubeVirt);
            if env.node.is_some() {
                env.cdi().unwrap_or_else(|e| panic!("cannot install CDI: {e:#}"));
                env.kubevirt().unwrap_or_else(|e| panic!("cannot install KubeVirt: {e:#}"));
            }
            env
        })
    }

    /// The turn of one fault test on the cluster it breaks: held for the
    /// test, so that no two tests break the same control plane at once.
    pub async fn fault_turn() -> tokio::sync::MutexGuard<'static, ()> {
        static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        TURN.lock().await
    }

    /// Stops a control-plane process (SIGTERM, as systemd or the kubelet
    /// stops a static pod) and waits until it is gone. Clients see refused
    /// connections until [`KubeEnv::start_again`].
    pub fn stop(&self, component: Component) -> anyhow::Result<()> {
        let janitor = self.owned_janitor()?;
        match component {
            Component::Etcd | Component::ApiServer => janitor.stop(component.process()),
            // Started through nsenter, which does not pass signals on.
            Component::Kubelet | Component::Containerd => janitor.stop_with_children(component.process()),
        }
    }

    /// Kills a control-plane process with SIGKILL (a crash, or the
    /// machine under it gone): no graceful shutdown, open connections end
    /// at once. [`KubeEnv::start_again`] brings it back.
    pub fn kill(&self, component: Component) -> anyhow::Result<()> {
        let janitor = self.owned_janitor()?;
        if matches!(component, Component::Kubelet | Component::Containerd) {
            let pid = janitor.pid_of(component.process());
            if let Some(pid) = pid {
                let _ = Command::new("pkill").args(["-KILL", "-P", &pid.to_string()]).status();
            }
        }
        janitor.kill(component.process())
    }

    /// Waits until every Deployment of the cluster (CDI's, the
    /// provisioner's) is Available again after a fault: the next test
    /// starts on a settled cluster, not on the last one's aftermath.
    pub fn wait_settled(&self) -> anyhow::Result<()> {
        self.kubectl(&["wait", "--for=condition=Available", "deployment", "--all", "-A", "--timeout=300s"])
            .map(|_| ())
    }

    /// Starts a stopped control-plane process again, with its own flags and
    /// data directory, and waits until it serves (etcd `/health`, the API
    /// server `/readyz`).
    pub fn start_again(&self, component: Component) -> anyhow::Result<()> {
        let janitor = self.owned_janitor()?;
        janitor.start_again(component.process())?;
        match component {
            Component::Etcd => {
                let port = self.etcd_port.ok_or_else(|| anyhow::anyhow!("no etcd here"))?;
                wait_until(Duration::from_secs(60), "etcd /health", || {
                    janitor.check_alive()?;
                    Ok(crate::process::http_get_plain(port, "/health")
                        .is_ok_and(|body| body.contains("\"health\":\"true\"")))
                })
            }
            Component::ApiServer => {
                let kubeconfig = self.kubeconfig.clone();
                std::thread::scope(|scope| {
                    scope.spawn(|| runtime().block_on(wait_ready(&kubeconfig, janitor))).join()
                })
                .map_err(|_| anyhow::anyhow!("waiting for the API server panicked"))?
            }
            Component::Kubelet => self.wait_node_ready(),
            Component::Containerd => self.node()?.wait_containerd(janitor),
        }?;
        // etcd alone: the API server may be down too (started next); so may
        // the kubelet under containerd (nothing settles without it).
        let kubelet_down = janitor.pid_of(Component::Kubelet.process()).is_none();
        let settles = match component {
            Component::Etcd => false,
            Component::Containerd => !kubelet_down,
            Component::ApiServer | Component::Kubelet => true,
        };
        if settles {
            self.wait_settled()?;
        }
        Ok(())
    }

    /// Power cut and boot of the node: every process of the node (its
    /// daemons, the containerd shims, every container of every pod) is
    /// killed at once with SIGKILL, then containerd, the kubelet and
    /// kube-proxy start again as a boot starts them. The node's disks (the
    /// kubelet's and containerd's directories, the PersistentVolumes) stay;
    /// the kubelet finds its pods' sandboxes dead and makes them again.
    pub fn power_cycle_node(&self) -> anyhow::Result<()> {
        let janitor = self.owned_janitor()?;
        let node = self.node()?;
        for pid in node.processes() {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        // nsenter, their parents on the host, end with them; reaped here.
        for daemon in ["kube-proxy", "kubelet", "containerd"] {
            janitor.kill(daemon)?;
        }
        janitor.start_again("containerd")?;
        node.wait_containerd(janitor)?;
        janitor.start_again("kubelet")?;
        janitor.start_again("kube-proxy")?;
        self.wait_node_ready()?;
        self.wait_settled()
    }

    fn node(&self) -> anyhow::Result<&Node> {
        self.node.as_ref().ok_or_else(|| anyhow::anyhow!("this cluster has no node"))
    }

    fn wait_node_ready(&self) -> anyhow::Result<()> {
        let bin = self.bin.as_ref().ok_or_else(|| anyhow::anyhow!("a borrowed cluster"))?;
        self.node()?.wait_ready(self.owned_janitor()?, &self.kubeconfig, bin)
    }

    /// Compacts etcd's history up to its current revision (what the API
    /// server does every five minutes, brought forward): every watch or
    /// list from an older resourceVersion is then answered 410 Gone.
    /// Returns the revision compacted to.
    pub fn compact_etcd(&self) -> anyhow::Result<u64> {
        let port = self.etcd_port.ok_or_else(|| anyhow::anyhow!("no etcd here"))?;
        // etcd's JSON gateway: keys are base64; "AA==" is the key "\0".
        let range = crate::process::http_post_plain(port, "/v3/kv/range", r#"{"key":"AA=="}"#)?;
        let range: serde_json::Value = serde_json::from_str(&range)?;
        let revision: u64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("etcd's range answer has no revision: {range}"))?;
        let body = format!(r#"{{"revision":"{revision}","physical":true}}"#);
        let answer = crate::process::http_post_plain(port, "/v3/kv/compaction", &body)?;
        anyhow::ensure!(answer.contains("header"), "etcd refused the compaction: {answer}");
        Ok(revision)
    }

    fn owned_janitor(&self) -> anyhow::Result<&Janitor> {
        self._janitor.as_ref().ok_or_else(|| anyhow::anyhow!("a borrowed cluster's processes are not ours"))
    }

    /// A cluster of its own, stopped when dropped (for tests of the harness).
    /// KubeVirt's definitions are applied for its simulator
    /// (`kubevirt_sim`); [`KubeEnv::start_owned_for_kubevirt`] leaves them to
    /// real KubeVirt's operator.
    pub fn start_owned(with_node: bool) -> anyhow::Result<KubeEnv> {
        std::thread::spawn(move || KubeEnv::start(with_node, false))
            .join()
            .map_err(|_| anyhow::anyhow!("the Kubernetes test environment panicked while starting"))?
    }

    /// A one-node cluster of its own for real KubeVirt (`kubevirt()`):
    /// KubeVirt's definitions are its operator's to install.
    pub fn start_owned_for_kubevirt() -> anyhow::Result<KubeEnv> {
        std::thread::spawn(move || KubeEnv::start(true, true))
            .join()
            .map_err(|_| anyhow::anyhow!("the Kubernetes test environment panicked while starting"))?
    }

    /// Resident memory of the cluster: every process it started (etcd, the
    /// control plane, containerd, the kubelet, kube-proxy), the containerd
    /// shims in the node's network namespace and every process in its pods.
    pub fn memory_bytes(&self) -> u64 {
        let mut pids = std::collections::BTreeSet::new();
        if let Some(janitor) = &self._janitor {
            pids.extend(crate::process::recorded_pids(janitor.dir()));
        }
        if let Some(node) = &self.node {
            pids.extend(node.processes());
        }
        pids.iter().map(|pid| crate::process::rss_bytes(*pid)).sum()
    }

    /// The release image, built on first use and imported into the node
    /// once; returns its name (`registry.example.net/platform/vmmigrate:<v>`).
    pub fn controller_image(&self) -> anyhow::Result<String> {
        let node = self.node.as_ref().ok_or_else(|| anyhow::anyhow!("this cluster has no node"))?;
        let mut imported = self.imported.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(name) = imported.as_ref() {
            return Ok(name.clone());
        }
        let (archive, name) = crate::setup::release_image()?;
        node.import_image(&archive)?;
        *imported = Some(name.clone());
        Ok(name)
    }

    /// Imports an image archive into the node's containerd.
    pub fn import_image(&self, archive: &Path) -> anyhow::Result<()> {
        let node = self.node.as_ref().ok_or_else(|| anyhow::anyhow!("this cluster has no node"))?;
        node.import_image(archive)
    }

    /// Real CDI on this cluster's node, installed on first use (`crate::cdi`).
    pub fn cdi(&self) -> anyhow::Result<()> {
        let mut state = self.cdi.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            *state = Some(crate::cdi::install(self).map_err(|e| format!("{e:#}")));
        }
        state.clone().unwrap_or(Ok(())).map_err(anyhow::Error::msg)
    }

    /// Real KubeVirt on this cluster's node, installed on first use (`crate::kubevirt`).
    pub fn kubevirt(&self) -> anyhow::Result<()> {
        let mut state = self.kubevirt.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            *state = Some(crate::kubevirt::install(self).map_err(|e| format!("{e:#}")));
        }
        state.clone().unwrap_or(Ok(())).map_err(anyhow::Error::msg)
    }

    /// `kubectl ARGS…` against this cluster.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let bin = match &self.bin {
            Some(bin) => bin.clone(),
            None => crate::setup::control_plane()?,
        };
        Node::kubectl(&bin, &self.kubeconfig, args)
    }

    /// A client for this cluster, bound to the calling tokio runtime.
    /// A client whose every write asks for `fieldValidation=Strict`: in the
    /// tests a field no installed schema knows is an error, never pruned in
    /// silence (the API's default only warns).
    pub async fn client(&self) -> Client {
        client_for(&self.kubeconfig).await.expect("build kube client")
    }

    /// Path of the kubeconfig, for tools and subprocesses.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Starts the cluster; CDI comes later, by its operator (`cdi()`).
    fn start(with_node: bool, real_kubevirt: bool) -> anyhow::Result<KubeEnv> {
        let started = std::time::Instant::now();
        if let Some(path) = std::env::var_os("VMMIGRATE_TEST_KUBECONFIG") {
            let kubeconfig = PathBuf::from(path);
            let version = runtime().block_on(prepare_cluster(&kubeconfig, false, false))?;
            return Ok(KubeEnv {
                kubeconfig,
                version,
                node: None,
                bin: None,
                startup: started.elapsed(),
                imported: Default::default(),
                cdi: Default::default(),
                kubevirt: Default::default(),
                etcd_port: None,
                audit_log: None,
                _janitor: None,
                _net: None,
            });
        }
        let bin = crate::setup::control_plane()?;
        if with_node {
            // Built (or found) before anything starts: a first build takes minutes.
            crate::setup::node_images()?;
        }
        let janitor = Janitor::new("vmmigrate-kube")?;
        let dir = janitor.dir().to_path_buf();
        let net = if with_node { Some(NodeNet::create()?) } else { None };
        let api_ip = net.as_ref().map_or_else(|| "127.0.0.1".to_owned(), |n| n.host_ip.to_string());

        // etcd
        let etcd_port = free_port()?;
        let peer_port = free_port()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        janitor.spawn(
            "etcd",
            Command::new(bin.join("etcd")).args([
                "--name=default",
                &format!("--data-dir={}", dir.join("etcd").display()),
                &format!("--listen-client-urls={etcd_url}"),
                &format!("--advertise-client-urls={etcd_url}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ]),
        )?;
        wait_until(Duration::from_secs(60), "etcd /health", || {
            janitor.check_alive()?;
            Ok(crate::process::http_get_plain(etcd_port, "/health")
                .map(|body| body.contains("\"health\":\"true\""))
                .unwrap_or(false))
        })?;

        // kube-apiserver
        std::fs::write(
            dir.join("tokens.csv"),
            format!(
                "{ADMIN_TOKEN},admin,admin,system:masters\n\
                 {NODE_TOKEN},system:node:{node},node,system:nodes\n\
                 {PROXY_TOKEN},system:kube-proxy,kube-proxy\n\
                 {SCHEDULER_TOKEN},system:kube-scheduler,kube-scheduler\n",
                node = crate::node::NODE_NAME
            ),
        )?;
        let sa_key = dir.join("sa.key");
        let status = Command::new("openssl")
            .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"])
            .arg(&sa_key)
            .stderr(Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "openssl genpkey failed");
        let api_port = free_port()?;
        // Every delete, with what it deleted, so that a test can tell whose
        // objects a client deleted (`audited_deletes`).
        let audit_policy = dir.join("audit-policy.yaml");
        std::fs::write(&audit_policy, AUDIT_POLICY)?;
        let audit_log = dir.join("audit.log");
        let mut apiserver = Command::new(bin.join("kube-apiserver"));
        apiserver.args([
            &format!("--etcd-servers={etcd_url}"),
            &format!("--cert-dir={}", dir.join("certs").display()),
            &format!("--bind-address={api_ip}"),
            &format!("--advertise-address={api_ip}"),
            &format!("--secure-port={api_port}"),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            &format!("--service-account-key-file={}", sa_key.display()),
            &format!("--service-account-signing-key-file={}", sa_key.display()),
            "--service-cluster-ip-range=10.96.0.0/16",
            &format!("--token-auth-file={}", dir.join("tokens.csv").display()),
            "--enable-priority-and-fairness=false",
            &format!("--audit-policy-file={}", audit_policy.display()),
            &format!("--audit-log-path={}", audit_log.display()),
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            "--v=0",
        ]);
        if with_node {
            // The `kubernetes` Service gets the API server's address (pods'
            // in-cluster clients); the node authorizer for the kubelet;
            // logs and exec through the node's InternalIP.
            apiserver.args([
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--kubelet-preferred-address-types=InternalIP",
            ]);
            // The aggregation layer (CDI registers its upload API), reaching
            // extension servers and webhook Services at their endpoints: the
            // API server runs outside the node, where Service IPs mean nothing
            // but the pod network is routed.
            let [ca, cert, key] = crate::tls::front_proxy(&dir)?;
            apiserver.args([
                &format!("--requestheader-client-ca-file={}", ca.display()),
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                &format!("--proxy-client-cert-file={}", cert.display()),
                &format!("--proxy-client-key-file={}", key.display()),
                "--enable-aggregator-routing=true",
            ]);
        } else {
            apiserver.args(["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]);
        }
        janitor.spawn("kube-apiserver", &mut apiserver)?;
        // The self-signed serving certificate appears once the server has started.
        let cert = dir.join("certs/apiserver.crt");
        wait_until(Duration::from_secs(120), "kube-apiserver serving certificate", || {
            janitor.check_alive()?;
            Ok(cert.exists())
        })?;
        let ca_pem = std::fs::read(&cert)?;
        let server = format!("https://{api_ip}:{api_port}");
        let kubeconfig = dir.join("kubeconfig");
        crate::node::write_token_kubeconfig(&kubeconfig, &server, &ca_pem, ADMIN_TOKEN)?;

        let mut kcm = Command::new(bin.join("kube-controller-manager"));
        kcm.args([
            &format!("--kubeconfig={}", kubeconfig.display()),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            &format!("--secure-port={}", free_port()?),
            &format!("--cert-dir={}", dir.join("kcm-certs").display()),
            "--v=0",
        ]);
        if with_node {
            // Every default controller (Deployments, Jobs, service account
            // tokens, PV binding, EndpointSlices, TTL-after-finished…), each
            // with its own service account's permissions, as in a cluster.
            kcm.args([
                "--controllers=*",
                "--use-service-account-credentials=true",
                &format!("--service-account-private-key-file={}", sa_key.display()),
                &format!("--root-ca-file={}", cert.display()),
            ]);
        } else {
            // Only what makes owner references and namespace deletion work.
            kcm.args([
                "--controllers=garbage-collector-controller,namespace-controller",
                "--use-service-account-credentials=false",
            ]);
        }
        janitor.spawn("kube-controller-manager", &mut kcm)?;

        let version = runtime().block_on(async {
            wait_ready(&kubeconfig, &janitor).await?;
            prepare_cluster(&kubeconfig, !real_kubevirt, !with_node).await
        })?;
        let node = match &net {
            Some(net) => {
                let scheduler_kubeconfig = dir.join("scheduler.kubeconfig");
                crate::node::write_token_kubeconfig(
                    &scheduler_kubeconfig,
                    &server,
                    &ca_pem,
                    SCHEDULER_TOKEN,
                )?;
                janitor.spawn(
                    "kube-scheduler",
                    Command::new(bin.join("kube-scheduler")).args([
                        &format!("--kubeconfig={}", scheduler_kubeconfig.display()),
                        "--leader-elect=false",
                        "--bind-address=127.0.0.1",
                        &format!("--secure-port={}", free_port()?),
                        "--v=0",
                    ]),
                )?;
                let cp = ControlPlane {
                    bin: &bin,
                    server: &server,
                    ca_pem: &ca_pem,
                    node_token: NODE_TOKEN,
                    proxy_token: PROXY_TOKEN,
                };
                Some(crate::node::start(net, &janitor, &cp, &kubeconfig)?)
            }
            None => None,
        };
        Ok(KubeEnv {
            kubeconfig,
            version,
            node,
            bin: Some(bin),
            startup: started.elapsed(),
            imported: Default::default(),
            cdi: Default::default(),
            kubevirt: Default::default(),
            etcd_port: Some(etcd_port),
            audit_log: Some(audit_log),
            _janitor: Some(janitor),
            _net: net,
        })
    }

    /// A client whose requests say `User-Agent: <agent>` (as vmmigrate's
    /// own clients do), so that the audit log tells them apart.
    pub async fn client_as(&self, agent: &str) -> Client {
        let mut config = Config::from_custom_kubeconfig(
            Kubeconfig::read_from(&self.kubeconfig).expect("kubeconfig"),
            &KubeConfigOptions::default(),
        )
        .await
        .expect("kube config");
        config.headers.push((http::header::USER_AGENT, http::HeaderValue::from_str(agent).expect("agent")));
        let strict = tower::util::MapRequestLayer::new(strict_writes);
        kube::client::ClientBuilder::try_from(config).expect("kube client").with_layer(&strict).build()
    }

    /// Every request `user` made since `since`, as the API server's audit
    /// log recorded it (`None` for a borrowed cluster, which has none).
    pub fn audited_requests(
        &self,
        user: &str,
        since: std::time::SystemTime,
    ) -> Option<anyhow::Result<Vec<AuditedRequest>>> {
        let path = self.audit_log.as_ref()?;
        Some(std::fs::read_to_string(path).map_err(Into::into).map(|log| audited_requests(&log, user, since)))
    }

    /// Every delete in `namespace` the API server answered, as its audit
    /// log recorded it (`None` for a borrowed cluster, which has none).
    pub fn audited_deletes(&self, namespace: &str) -> Option<anyhow::Result<Vec<AuditedDelete>>> {
        let path = self.audit_log.as_ref()?;
        Some(std::fs::read_to_string(path).map_err(Into::into).map(|log| audited_deletes(&log, namespace)))
    }
}

/// Records every delete at `RequestResponse` (the deleted object, or a
/// `Status` naming its uid, is the answer), and the writes of the kinds
/// vmmigrate creates (their answers carry each object's uid and labels, for
/// a delete answered by a `Status`); of other clients nothing else, events
/// and leases not even that. Of deploy/'s ServiceAccount, every request,
/// its metadata at least (`audited_requests`).
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: RequestResponse
    users: [\"system:serviceaccount:vmmigrate-system:vmmigrate\"]
    verbs: [delete, deletecollection]
  - level: RequestResponse
    users: [\"system:serviceaccount:vmmigrate-system:vmmigrate\"]
    verbs: [create, patch, update]
    resources: &written
      - group: \"\"
        resources: [secrets, configmaps, persistentvolumeclaims, services]
      - group: batch
        resources: [jobs]
      - group: cdi.kubevirt.io
        resources: [datavolumes]
      - group: kubevirt.io
        resources: [virtualmachines]
  - level: Metadata
    users: [\"system:serviceaccount:vmmigrate-system:vmmigrate\"]
  - level: None
    resources:
      - group: \"\"
        resources: [events]
      - group: events.k8s.io
      - group: coordination.k8s.io
  - level: RequestResponse
    verbs: [delete, deletecollection]
  - level: RequestResponse
    verbs: [create, patch, update]
    resources: *written
  - level: None
";

/// One API request as the audit log recorded it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct AuditedRequest {
    pub verb: String,
    /// API group (`""`: core), resource and subresource; all empty for a
    /// non-resource URL (`path` then).
    pub group: String,
    pub resource: String,
    pub subresource: String,
    /// Empty: cluster-scoped, or every namespace.
    pub namespace: String,
    /// The object's name (empty for a list, a watch or a create without one).
    pub name: String,
    pub path: String,
    /// The answer's HTTP status.
    pub code: u16,
}

/// Every request `user` made itself (not impersonated by another) since
/// `since`, from an audit log (JSON lines).
pub fn audited_requests(log: &str, user: &str, since: std::time::SystemTime) -> Vec<AuditedRequest> {
    use k8s_openapi::jiff::Timestamp;
    let since = Timestamp::try_from(since).unwrap_or(Timestamp::MIN);
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| {
            e["stage"] == "ResponseComplete"
                && e["user"]["username"] == user
                && e["impersonatedUser"].is_null()
                && e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(|t| t.parse::<Timestamp>().ok())
                    .is_some_and(|t| t >= since)
        })
        .map(|e| {
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            let object = &e["objectRef"];
            AuditedRequest {
                verb: text(&e["verb"]),
                group: text(&object["apiGroup"]),
                resource: text(&object["resource"]),
                subresource: text(&object["subresource"]),
                namespace: text(&object["namespace"]),
                name: text(&object["name"]),
                path: text(&e["requestURI"]).split('?').next().unwrap_or_default().to_owned(),
                code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
            }
        })
        .collect()
}

/// One object a delete removed (or marked for removal), from the audit log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditedDelete {
    /// The client's `User-Agent`.
    pub user_agent: String,
    pub resource: String,
    pub name: String,
    /// The answer's HTTP status.
    pub code: u16,
    /// The deleted object's uid, labels and owners' uids, from the answer
    /// (a `Status` answer gives the uid only).
    pub uid: Option<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    pub owner_uids: Vec<String>,
    /// The uid the request required (`preconditions.uid`).
    pub precondition_uid: Option<String>,
}

/// The labels and owners' uids of an object as an answer carries it.
type Described = (std::collections::BTreeMap<String, String>, Vec<String>);

fn described(object: &serde_json::Value) -> Described {
    let meta = &object["metadata"];
    let labels = meta["labels"]
        .as_object()
        .map(|labels| labels.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
        .unwrap_or_default();
    let owners = meta["ownerReferences"]
        .as_array()
        .map(|refs| refs.iter().filter_map(|r| r["uid"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    (labels, owners)
}

/// The deletes of `namespace` in an audit log (JSON lines). A delete
/// answered by a `Status` (Secrets, ConfigMaps) gets the labels and owners
/// the object had when it was last written.
pub fn audited_deletes(log: &str, namespace: &str) -> Vec<AuditedDelete> {
    let events: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseComplete" && e["objectRef"]["namespace"] == namespace)
        .collect();
    let mut written: std::collections::HashMap<String, Described> = std::collections::HashMap::new();
    for event in events.iter().filter(|e| matches!(e["verb"].as_str(), Some("create" | "patch" | "update"))) {
        if let Some(uid) = event["responseObject"]["metadata"]["uid"].as_str() {
            written.insert(uid.to_owned(), described(&event["responseObject"]));
        }
    }
    let mut out = Vec::new();
    for event in &events {
        let verb = event["verb"].as_str().unwrap_or_default();
        if !matches!(verb, "delete" | "deletecollection") {
            continue;
        }
        let base = AuditedDelete {
            user_agent: event["userAgent"].as_str().unwrap_or_default().to_owned(),
            resource: event["objectRef"]["resource"].as_str().unwrap_or_default().to_owned(),
            name: event["objectRef"]["name"].as_str().unwrap_or_default().to_owned(),
            code: event["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
            precondition_uid: event["requestObject"]["preconditions"]["uid"].as_str().map(str::to_owned),
            ..AuditedDelete::default()
        };
        let answer = &event["responseObject"];
        let objects: Vec<&serde_json::Value> = match answer["items"].as_array() {
            Some(items) => items.iter().collect(),
            None => vec![answer],
        };
        for object in objects {
            let mut delete = base.clone();
            if object["kind"] == "Status" {
                delete.uid = object["details"]["uid"].as_str().map(str::to_owned);
                if let Some((labels, owners)) = delete.uid.as_ref().and_then(|uid| written.get(uid)) {
                    delete.labels = labels.clone();
                    delete.owner_uids = owners.clone();
                }
            } else {
                if let Some(name) = object["metadata"]["name"].as_str() {
                    delete.name = name.to_owned();
                }
                delete.uid = object["metadata"]["uid"].as_str().map(str::to_owned);
                (delete.labels, delete.owner_uids) = described(object);
            }
            out.push(delete);
        }
    }
    out
}

/// What [`start_blocking`] starts.
#[derive(Clone, Copy)]
enum Shape {
    /// One node, KubeVirt's definitions for its simulator.
    Node,
    /// One node for real KubeVirt.
    KubeVirt,
}

fn start_blocking(shape: Shape) -> KubeEnv {
    // Started on a plain thread: callers are usually inside a tokio runtime,
    // and start-up blocks on its own small runtime.
    let mut attempt = 1;
    loop {
        let started = match shape {
            Shape::Node => KubeEnv::start_owned(true),
            Shape::KubeVirt => KubeEnv::start_owned_for_kubevirt(),
        };
        match started {
            Ok(env) => {
                let name = match shape {
                    Shape::Node => "one-node cluster",
                    Shape::KubeVirt => "one-node cluster for KubeVirt",
                };
                eprintln!("vmmigrate-harness: {name} started in {:.1}s", env.startup.as_secs_f64());
                return env;
            }
            Err(err) if attempt < START_ATTEMPTS && is_upstream_start_race(&format!("{err:#}")) => {
                eprintln!(
                    "vmmigrate-harness: a component died of a Go runtime race while starting \
                     (attempt {attempt} of {START_ATTEMPTS}); starting the cluster again: {err:#}"
                );
                attempt += 1;
            }
            Err(err) => panic!("cannot start the Kubernetes test environment: {err:#}"),
        }
    }
}

/// How often a cluster start is tried when a component dies of a race.
const START_ATTEMPTS: u32 = 3;

/// Whether a failed start is the Go runtime's verdict on a data race inside
/// an upstream component, not anything of ours: kubelet v1.35.4 can die at
/// start-up with `fatal error: concurrent map iteration and map write`
/// (`containerManagerImpl.GetCapacity`, called from the DRA manager's
/// goroutine while the container manager fills the map; seen once in
/// about thirty starts here). The failed attempt's processes and network
/// are gone with it; a new start does not meet the race again.
fn is_upstream_start_race(error: &str) -> bool {
    error.contains("fatal error: concurrent map")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// Standard base64 with padding.
pub(crate) fn base64_encode(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn client_for(kubeconfig: &Path) -> anyhow::Result<Client> {
    let config =
        Config::from_custom_kubeconfig(Kubeconfig::read_from(kubeconfig)?, &KubeConfigOptions::default())
            .await?;
    let strict = tower::util::MapRequestLayer::new(strict_writes);
    Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&strict).build())
}

/// Adds `fieldValidation=Strict` to a create, update or patch that does not
/// choose its own validation.
fn strict_writes(mut request: http::Request<kube::client::Body>) -> http::Request<kube::client::Body> {
    let write = matches!(*request.method(), http::Method::POST | http::Method::PUT | http::Method::PATCH);
    let query = request.uri().query().unwrap_or_default();
    if write && !query.contains("fieldValidation=") {
        let joined = if query.is_empty() { "?" } else { "&" };
        let uri = format!("{}{joined}fieldValidation=Strict", request.uri());
        if let Ok(uri) = uri.parse() {
            *request.uri_mut() = uri;
        }
    }
    request
}

/// Polls `/readyz` until the API server says ok.
async fn wait_ready(kubeconfig: &Path, janitor: &Janitor) -> anyhow::Result<()> {
    let client = client_for(kubeconfig).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        janitor.check_alive()?;
        let req = http::Request::get("/readyz").body(Vec::new())?;
        match client.request_text(req).await {
            Ok(body) if body.trim() == "ok" => return Ok(()),
            Ok(_) | Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(body) => anyhow::bail!("kube-apiserver not ready after 120s: {body}"),
            Err(err) => anyhow::bail!("kube-apiserver not ready after 120s: {err}"),
        }
    }
}

/// Installs our CRD and, for a cluster without a node (which runs no
/// KubeVirt), KubeVirt's own (generated from its Go module,
/// `setup::upstream`); waits until they are established, and returns the
/// server version. On a node, KubeVirt's and CDI's definitions are their
/// operators' to install (both refuse definitions somebody else applied);
/// a cluster without a node runs no CDI either and gets CDI's (`cdi_crds`),
/// so that a controller watching DataVolumes there finds the kind.
async fn prepare_cluster(kubeconfig: &Path, kubevirt_crds: bool, cdi_crds: bool) -> anyhow::Result<String> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Patch, PatchParams};
    use serde::Deserialize;
    let client = client_for(kubeconfig).await?;
    let version = client.apiserver_version().await?.git_version;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let root = crate::repo_root();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root.join("crds"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files.push(path);
        }
    }
    files.sort();
    if kubevirt_crds || cdi_crds {
        let upstream = tokio::task::spawn_blocking(crate::setup::upstream).await??.join("crds");
        if kubevirt_crds {
            files.push(upstream.join("kubevirt.yaml"));
        }
        if cdi_crds {
            files.push(upstream.join("cdi.yaml"));
        }
    }
    let mut names = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path)?;
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let crd = CustomResourceDefinition::deserialize(doc)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let name = crd.metadata.name.clone().unwrap_or_default();
            crds.patch(&name, &PatchParams::apply("vmmigrate-tests").force(), &Patch::Apply(&crd))
                .await
                .map_err(|e| anyhow::anyhow!("applying {}: {e}", path.display()))?;
            names.push(name);
        }
    }
    for name in names {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let crd = crds.get(&name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "CRD {name} not established after 30s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_audit_log_gives_each_deleted_object_its_labels_owners_and_the_uid_the_delete_required() {
        let object = r#"{"kind":"Event","level":"RequestResponse","stage":"ResponseComplete","verb":"delete","userAgent":"vmmigrate/0.1.0 (controller)","objectRef":{"resource":"datavolumes","namespace":"apps","name":"web-disk-0","apiGroup":"cdi.kubevirt.io"},"responseStatus":{"metadata":{},"code":200},"requestObject":{"kind":"DeleteOptions","preconditions":{"uid":"u-dv"}},"responseObject":{"kind":"DataVolume","metadata":{"name":"web-disk-0","uid":"u-dv","labels":{"migration.platform.example/migration-uid":"u-m"},"ownerReferences":[{"uid":"u-m"}]}}}"#;
        let status = r#"{"kind":"Event","level":"RequestResponse","stage":"ResponseComplete","verb":"delete","userAgent":"kubectl/v1.35.4","objectRef":{"resource":"secrets","namespace":"apps","name":"s"},"responseStatus":{"code":200},"responseObject":{"kind":"Status","status":"Success","details":{"name":"s","kind":"secrets","uid":"u-s"}}}"#;
        let elsewhere = object.replace(r#""namespace":"apps""#, r#""namespace":"other""#);
        let received = object.replace("ResponseComplete", "RequestReceived");
        let list = r#"{"kind":"Event","stage":"ResponseComplete","verb":"deletecollection","userAgent":"gc","objectRef":{"resource":"configmaps","namespace":"apps"},"responseStatus":{"code":200},"responseObject":{"kind":"ConfigMapList","items":[{"metadata":{"name":"a","uid":"u-a"}},{"metadata":{"name":"b","uid":"u-b"}}]}}"#;
        let created = r#"{"kind":"Event","stage":"ResponseComplete","verb":"patch","userAgent":"vmmigrate/0.1.0 (controller)","objectRef":{"resource":"secrets","namespace":"apps","name":"s"},"responseStatus":{"code":201},"responseObject":{"kind":"Secret","metadata":{"name":"s","uid":"u-s","labels":{"migration.platform.example/migration-uid":"u-m"}}}}"#;
        let log =
            [created, object, status, elsewhere.as_str(), received.as_str(), list, "not json"].join("\n");
        let deletes = super::audited_deletes(&log, "apps");
        assert_eq!(deletes.len(), 4, "{deletes:#?}");
        let dv = &deletes[0];
        assert_eq!(
            (dv.user_agent.as_str(), dv.resource.as_str(), dv.name.as_str(), dv.code),
            ("vmmigrate/0.1.0 (controller)", "datavolumes", "web-disk-0", 200)
        );
        assert_eq!(dv.labels["migration.platform.example/migration-uid"], "u-m");
        assert_eq!((dv.uid.as_deref(), dv.precondition_uid.as_deref()), (Some("u-dv"), Some("u-dv")));
        assert_eq!(dv.owner_uids, vec!["u-m".to_owned()]);
        assert_eq!((deletes[1].uid.as_deref(), deletes[1].precondition_uid.as_deref()), (Some("u-s"), None));
        assert_eq!(
            deletes[1].labels["migration.platform.example/migration-uid"], "u-m",
            "a Status answer: the labels of the object's last write"
        );
        assert_eq!(
            (deletes[2].name.as_str(), deletes[3].name.as_str()),
            ("a", "b"),
            "one per item of a collection"
        );
    }

    #[test]
    fn only_a_go_runtime_race_in_a_component_makes_a_start_try_again() {
        let race = "kubelet exited (exit status: 2); last log lines:\nfatal error: concurrent map iteration and map write";
        assert!(super::is_upstream_start_race(race));
        assert!(!super::is_upstream_start_race(
            "kubelet exited (exit status: 1); last log lines:\nfailed to run Kubelet: bad flag"
        ));
        assert!(!super::is_upstream_start_race("timed out after 120s waiting for the node"));
    }

    #[test]
    fn base64_matches_known_vectors() {
        assert_eq!(super::base64_encode(b""), "");
        assert_eq!(super::base64_encode(b"f"), "Zg==");
        assert_eq!(super::base64_encode(b"fo"), "Zm8=");
        assert_eq!(super::base64_encode(b"foo"), "Zm9v");
        assert_eq!(super::base64_encode(b"foobar"), "Zm9vYmFy");
    }
}
