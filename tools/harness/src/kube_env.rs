//! A real Kubernetes control plane for the tests: etcd, kube-apiserver and
//! kube-controller-manager (garbage collector and namespace controllers only),
//! built from their Go modules by `tools/testenv/build.sh` (`crate::setup`) and started on free
//! loopback ports in a temporary directory.
//!
//! One environment per test binary (`KubeEnv::shared()`); each test makes its
//! own `kube::Client` (a client belongs to the tokio runtime it was made in)
//! and its own namespace. When `VMMIGRATE_TEST_KUBECONFIG` is set, that
//! cluster is used instead and nothing is started.
//!
//! Nothing is left behind: every process we start is recorded in `pids`, and a
//! small janitor shell (its stdin is a pipe only this process holds) kills them
//! and removes the directory as soon as the test process exits, however it exits.

use crate::process::{Janitor, free_port, wait_until};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

const ADMIN_TOKEN: &str = "vmmigrate-test-admin-token";

/// A running (or borrowed) cluster.
pub struct KubeEnv {
    kubeconfig: PathBuf,
    /// The API server's reported version, e.g. `v1.35.4`.
    pub version: String,
    _janitor: Option<Janitor>,
}

static SHARED: OnceLock<KubeEnv> = OnceLock::new();

impl KubeEnv {
    /// The environment of this test binary, started on first use.
    pub fn shared() -> &'static KubeEnv {
        // Started on a plain thread: callers are usually inside a tokio runtime,
        // and start-up blocks on its own small runtime.
        SHARED.get_or_init(|| match std::thread::spawn(KubeEnv::start).join() {
            Ok(Ok(env)) => env,
            Ok(Err(err)) => panic!("cannot start the Kubernetes test environment: {err:#}"),
            Err(_) => panic!("the Kubernetes test environment panicked while starting"),
        })
    }

    /// A client for this cluster, bound to the calling tokio runtime.
    pub async fn client(&self) -> Client {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig).expect("read test kubeconfig");
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("load test kubeconfig");
        Client::try_from(config).expect("build kube client")
    }

    /// Path of the kubeconfig, for tools and subprocesses.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    fn start() -> anyhow::Result<KubeEnv> {
        if let Some(path) = std::env::var_os("VMMIGRATE_TEST_KUBECONFIG") {
            let kubeconfig = PathBuf::from(path);
            let version = runtime().block_on(prepare_cluster(&kubeconfig))?;
            return Ok(KubeEnv { kubeconfig, version, _janitor: None });
        }
        let bin = crate::setup::control_plane()?;
        let janitor = Janitor::new("vmmigrate-kube")?;
        let dir = janitor.dir().to_path_buf();

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
        std::fs::write(dir.join("tokens.csv"), format!("{ADMIN_TOKEN},admin,admin,system:masters\n"))?;
        let sa_key = dir.join("sa.key");
        let status = Command::new("openssl")
            .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"])
            .arg(&sa_key)
            .stderr(Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "openssl genpkey failed");
        let api_port = free_port()?;
        janitor.spawn(
            "kube-apiserver",
            Command::new(bin.join("kube-apiserver")).args([
                &format!("--etcd-servers={etcd_url}"),
                &format!("--cert-dir={}", dir.join("certs").display()),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={api_port}"),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                &format!("--service-account-key-file={}", sa_key.display()),
                &format!("--service-account-signing-key-file={}", sa_key.display()),
                "--service-cluster-ip-range=10.96.0.0/16",
                &format!("--token-auth-file={}", dir.join("tokens.csv").display()),
                "--authorization-mode=RBAC",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                "--v=0",
            ]),
        )?;
        // The self-signed serving certificate appears once the server has started.
        let cert = dir.join("certs/apiserver.crt");
        wait_until(Duration::from_secs(120), "kube-apiserver serving certificate", || {
            janitor.check_alive()?;
            Ok(cert.exists())
        })?;
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, api_port, &std::fs::read(&cert)?)?;

        // kube-controller-manager: only what makes owner references and namespace deletion work.
        janitor.spawn(
            "kube-controller-manager",
            Command::new(bin.join("kube-controller-manager")).args([
                &format!("--kubeconfig={}", kubeconfig.display()),
                "--controllers=garbage-collector-controller,namespace-controller",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--bind-address=127.0.0.1",
                &format!("--secure-port={}", free_port()?),
                &format!("--cert-dir={}", dir.join("kcm-certs").display()),
                "--v=0",
            ]),
        )?;

        let version = runtime().block_on(async {
            wait_ready(&kubeconfig, &janitor).await?;
            prepare_cluster(&kubeconfig).await
        })?;
        Ok(KubeEnv { kubeconfig, version, _janitor: Some(janitor) })
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// Directory holding the built control-plane binaries: `VMMIGRATE_TESTENV_BIN`,
/// or whatever `tools/testenv/build.sh` prints (it builds only when the cache is empty).
fn write_kubeconfig(path: &Path, port: u16, ca_pem: &[u8]) -> anyhow::Result<()> {
    use std::fmt::Write;
    let ca = base64_encode(ca_pem);
    let mut out = String::new();
    writeln!(out, "apiVersion: v1\nkind: Config\ncurrent-context: test")?;
    writeln!(out, "clusters:\n- name: test\n  cluster:\n    server: https://127.0.0.1:{port}")?;
    writeln!(out, "    certificate-authority-data: {ca}")?;
    writeln!(out, "users:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}")?;
    writeln!(out, "contexts:\n- name: test\n  context:\n    cluster: test\n    user: admin")?;
    std::fs::write(path, out)?;
    Ok(())
}

fn base64_encode(data: &[u8]) -> String {
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
    Ok(Client::try_from(config)?)
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

/// Installs our CRDs and the simulated CDI/KubeVirt CRDs, waits until they are
/// established, and returns the server version.
async fn prepare_cluster(kubeconfig: &Path) -> anyhow::Result<String> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Patch, PatchParams};
    use serde::Deserialize;
    let client = client_for(kubeconfig).await?;
    let version = client.apiserver_version().await?.git_version;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let root = crate::repo_root();
    let mut files = Vec::new();
    // Ours, then the CDI/KubeVirt definitions the simulators act on.
    for dir in [root.join("crds"), Path::new(env!("CARGO_MANIFEST_DIR")).join("crds")] {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
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
    fn base64_matches_known_vectors() {
        assert_eq!(super::base64_encode(b""), "");
        assert_eq!(super::base64_encode(b"f"), "Zg==");
        assert_eq!(super::base64_encode(b"fo"), "Zm8=");
        assert_eq!(super::base64_encode(b"foo"), "Zm9v");
        assert_eq!(super::base64_encode(b"foobar"), "Zm9vYmFy");
    }
}
