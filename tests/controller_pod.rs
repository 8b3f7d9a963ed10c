//! vmmigrate as a user installs it: the release image imported into the test
//! node, `kubectl apply -k` of an overlay of `deploy/base` (Namespace, CRD,
//! RBAC, ConfigMap, PVC, Deployment with two replicas and leader election,
//! Services, probes, non-root, read-only root file system), the migrations
//! repository served by a real `git daemon`, the ESXi emulator's real sshd on
//! the host address pods reach. The controller pod runs with the
//! ServiceAccount and RBAC of `deploy/` only; its conversion Jobs are real
//! pods from the same image, and real CDI's importer pods download the
//! artifacts through the staging Service. KubeVirt is the simulator.

use crate::support::esxi_emulator::{EsxiEmulator, EsxiOptions};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, test_namespace};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use vmmigrate::convert::artifact::sha256_file;
use vmmigrate_harness::deploy::{self, SYSTEM};
use vmmigrate_harness::git_daemon::GitDaemon;
use vmmigrate_harness::process::Janitor;

const PAGE: &str = "<html><body><h1>db-02 status page</h1></body></html>\n";
const VM: &str = "db-02";
const VMID: &str = "2";
const WAIT: Duration = Duration::from_secs(300);

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=platform", "-c", "user.email=platform@example.net"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Installed<'a> {
    env: &'a KubeEnv,
}

impl Drop for Installed<'_> {
    /// Prints what a failure needs, then stops the controller pods (the
    /// cluster outlives this test; the CRD and RBAC stay for the others).
    fn drop(&mut self) {
        if std::thread::panicking() {
            for args in [
                vec!["-n", SYSTEM, "get", "pods,jobs,pvc,lease", "-o", "wide"],
                vec!["-n", SYSTEM, "get", "virtualmachinemigrations", "-o", "yaml"],
                vec![
                    "-n",
                    SYSTEM,
                    "logs",
                    "-l",
                    "app.kubernetes.io/component=controller",
                    "--tail=60",
                    "--prefix",
                ],
            ] {
                eprintln!("{}", self.env.kubectl(&args).unwrap_or_else(|e| format!("{e:#}")));
            }
        }
        if let Err(err) = deploy::remove_workloads(self.env) {
            eprintln!("removing the installation: {err:#}");
        }
    }
}

/// The pod holding the Lease (its identity is `<pod name>_<process nonce>`).
fn leader(env: &KubeEnv) -> Option<String> {
    let holder = env
        .kubectl(&[
            "-n",
            SYSTEM,
            "get",
            "lease",
            "vmmigrate-controller",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ])
        .ok()?;
    let pod = holder.trim().split('_').next().unwrap_or_default().to_owned();
    (!pod.is_empty()).then_some(pod)
}

/// Processes reading one of the VM's disk extents on the emulated host right
/// now (the `dd` wrapper, waiting out the read delay or copying): a copy in flight.
fn disk_readers() -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmdline =
            String::from_utf8_lossy(&std::fs::read(entry.path().join("cmdline")).unwrap_or_default())
                .replace('\0', " ");
        if cmdline.contains(&format!("/{VM}/")) && cmdline.contains("-flat.vmdk") {
            pids.push(pid);
        }
    }
    pids
}

/// Fails at once when the migration stopped where no retry helps.
async fn assert_not_stopped(migrations: &Api<vmmigrate::api::VirtualMachineMigration>) {
    use vmmigrate::api::Phase;
    if let Ok(vmm) = migrations.get(VM).await {
        let status = vmm.status.unwrap_or_default();
        assert!(
            !matches!(status.phase, Phase::Failed | Phase::ManualInterventionRequired),
            "stopped: {status:#?}"
        );
    }
}

/// Kills the main process of `pod`'s container from the node, as an OOM
/// kill or a crash would: the kubelet restarts the container in the same pod.
fn kill_container_process(env: &KubeEnv, pod: &Pod) {
    let node = env.node.as_ref().unwrap();
    let uid = pod.uid().unwrap();
    let container =
        pod.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0].container_id.clone().unwrap();
    let id = container.rsplit("://").next().unwrap();
    let mut killed: Vec<String> = Vec::new();
    let mut seen = Vec::new();
    // The container's processes are read once: its cgroup can be reached
    // again under another parent, and by then the kubelet may have started
    // the next process there.
    let mut read = false;
    let root = Path::new("/sys/fs/cgroup/memory").join(&node.cgroup_root);
    let mut stack = vec![root];
    while let Some(dir) = stack.pop() {
        // cgroupfs layout: …/kubepods/<qos>/pod<uid>/<container id>
        let in_pod = dir.parent().is_some_and(|p| p.ends_with(format!("pod{uid}")));
        if in_pod && dir.ends_with(id) && !read {
            read = true;
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<&str> = procs.lines().collect();
            // A child forked to run git shows its parent's command line until
            // it execs: the main process is the one whose parent is not here.
            let parent = |pid: &str| {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                status.lines().find_map(|l| l.strip_prefix("PPid:")).map(|p| p.trim().to_owned())
            };
            for pid in &pids {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                // The main process only: not its git children (whose
                // arguments name /var/lib/vmmigrate) nor a `vmmigrate convert`.
                let argv: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                let main = argv.first().is_some_and(|a| a.ends_with(b"vmmigrate"))
                    && argv.get(1).is_some_and(|a| *a == b"run")
                    && !parent(pid).is_some_and(|p| pids.contains(&p.as_str()));
                seen.push(format!("{pid}: {}", String::from_utf8_lossy(&cmdline).replace('\0', " ")));
                if main {
                    assert!(Command::new("kill").args(["-KILL", pid]).status().unwrap().success());
                    killed.push((*pid).to_owned());
                }
            }
        }
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(entry.path());
            }
        }
    }
    assert_eq!(
        killed.len(),
        1,
        "one vmmigrate process in container {id} of pod {}: {seen:?}",
        pod.name_any()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_installed_controller_pod_migrates_a_vm_through_leader_kills_mid_copy() {
    let env = KubeEnv::shared();
    let node = env.node.as_ref().expect("a node");
    let image = tokio::task::block_in_place(|| env.controller_image()).expect("release image");
    let client = env.client().await;
    ensure_storage_class(&client).await;
    let apps = test_namespace(&client, "pod-e2e").await;

    // The ESXi host, on an address pods reach; its disks read slowly enough
    // to be interrupted twice.
    let emu = EsxiEmulator::start(EsxiOptions { also_listen: Some(node.host_ip), ..Default::default() })
        .expect("ESXi emulator");

    // The migrations repository: one merged request.
    let repos = tempfile::tempdir().unwrap();
    let bare = repos.path().join("migrations.git");
    Command::new("git").args(["init", "-q", "--bare", "-b", "main"]).arg(&bare).status().unwrap();
    let daemon = GitDaemon::start(node.host_ip, repos.path()).expect("git daemon");
    let work = tempfile::tempdir().unwrap();
    git(work.path(), &["init", "-q", "-b", "main"]);
    std::fs::create_dir_all(work.path().join("migrations")).unwrap();
    std::fs::write(
        work.path().join("migrations/db-02.yaml"),
        format!(
            r#"apiVersion: migration.platform.example/v1alpha1
kind: VirtualMachineMigration
metadata:
  name: {VM}
spec:
  source:
    host: "{host}"
    port: {port}
    hostKey: "{key}"
    credentialsSecretRef:
      name: esxi
    vm:
      name: {VM}
  destination:
    namespace: {apps}
    storageClassName: local-path
  networkMap:
    - source: VM Network
      type: Pod
    - source: DMZ
      type: Multus
      networkName: dmz
  conversion:
    format: qcow2
    runner: job
    guest: none
  strategy:
    backoff:
      initialSeconds: 1
      maxSeconds: 2
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
            host = node.host_ip,
            port = emu.port,
            key = emu.host_key_fingerprint(),
        ),
    )
    .unwrap();
    git(work.path(), &["add", "."]);
    git(work.path(), &["commit", "-q", "-m", "migrate db-02"]);
    git(work.path(), &["push", "-q", &bare.to_string_lossy(), "main"]);

    // Install, as a user would.
    let kustomize = tempfile::tempdir().unwrap();
    let repo_url = daemon.url("migrations.git");
    // vmmigrate-system is shared with tests/deploy_rbac.rs: one at a time.
    let _exclusive = crate::deploy_rbac::CLUSTER_RBAC.write().await;
    // Imports through real CDI with its definition as installed.
    let _cdi = crate::support::CDI_DEFINITION.read().await;
    deploy::remove_workloads(env).expect("removing an earlier installation");
    let installed_at = std::time::SystemTime::now();
    let _ = env.kubectl(&["-n", SYSTEM, "delete", "secret", "esxi", "--ignore-not-found"]);
    let _installed = Installed { env };
    // The other tests' namespaces have controllers of their own: this one
    // watches vmmigrate-system only. A short lease for quick take-overs.
    // Migrations live in vmmigrate-system, their VMs in the test's namespace.
    let allow = format!("{SYSTEM}={apps}");
    let install = deploy::Install {
        image: &image,
        repo_url: &repo_url,
        watch_namespace: Some(SYSTEM),
        // The VMs' namespace gets the Role too: the import Secret and CA
        // ConfigMap of each DataVolume are written there.
        credential_namespaces: &[&apps],
        settings: &[
            ("VMMIGRATE_POLL_SECONDS", "2"),
            ("VMMIGRATE_LEASE_SECONDS", "6"),
            ("VMMIGRATE_ALLOW_DESTINATION", &allow),
        ],
    };
    deploy::install(env, kustomize.path(), &install).expect("kubectl apply -k");
    env.kubectl(&[
        "-n",
        SYSTEM,
        "create",
        "secret",
        "generic",
        "esxi",
        &format!("--from-literal=username={}", emu.username),
        &format!("--from-literal=password={}", emu.password),
    ])
    .expect("ESXi credentials");
    // For the emulated host only, as its owner binds it.
    env.kubectl(&[
        "-n",
        SYSTEM,
        "annotate",
        "secret",
        "esxi",
        &format!("migration.platform.example/esxi-hosts={}={}", node.host_ip, emu.host_key_fingerprint()),
    ])
    .expect("the Secret's hosts");
    // The migrated guest's application: a web server the controller pod
    // reaches through the Service db-web.
    let guest = Janitor::new("vmmigrate-guest").unwrap();
    node.serve_http(&guest, 8080, &[("index.html", PAGE)]).expect("guest web server");
    crate::support::db_web_service(&client, &apps, node.ip).await;
    let sims = kubevirt_sim::start(client.clone(), &apps);
    *sims.control.kubevirt.vmi_ip.lock().unwrap() = node.ip.to_string();
    emu.set_read_delay(Some(4.0));

    let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let controller_pods = ListParams::default().labels("app.kubernetes.io/component=controller");
    let migrations: Api<vmmigrate::api::VirtualMachineMigration> = Api::namespaced(client.clone(), SYSTEM);

    // Kill 1: the leader pod, force-deleted while a disk read is in flight.
    let deadline = Instant::now() + WAIT;
    let (first, in_flight) = loop {
        let readers = disk_readers();
        if !readers.is_empty()
            && let Some(holder) = leader(env)
        {
            break (holder, readers);
        }
        assert_not_stopped(&migrations).await;
        assert!(Instant::now() < deadline, "the copy never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    env.kubectl(&["-n", SYSTEM, "delete", "pod", &first, "--grace-period=0", "--force"])
        .expect("delete leader");

    // Kill 2: the next leader's process, once it is copying again.
    let second = loop {
        if let Some(holder) = leader(env).filter(|h| *h != first)
            && disk_readers().iter().any(|pid| !in_flight.contains(pid))
        {
            break holder;
        }
        assert_not_stopped(&migrations).await;
        assert!(Instant::now() < deadline, "no other replica took over and resumed the copy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The kubelet may not have reported the new leader's container yet.
    let pod = loop {
        let pod = pods.get(&second).await.unwrap();
        let reported = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .is_some_and(|c| c.container_id.is_some());
        if reported {
            break pod;
        }
        assert!(Instant::now() < deadline, "the kubelet never reported {second}'s container");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    kill_container_process(env, &pod);
    emu.set_read_delay(None);

    // Completed, and cleaned up.
    let vmm = loop {
        if let Ok(vmm) = migrations.get(VM).await {
            let status = vmm.status.clone().unwrap_or_default();
            if status.phase == vmmigrate::api::Phase::Completed && status.timestamps.cleaned_up.is_some() {
                break vmm;
            }
            assert!(
                !matches!(
                    status.phase,
                    vmmigrate::api::Phase::Failed | vmmigrate::api::Phase::ManualInterventionRequired
                ),
                "stopped: {status:#?}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "not Completed: {:#?}",
            migrations.get(VM).await.ok().and_then(|v| v.status)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // One power-off; the source's disks unchanged; what CDI imported is the source, byte for byte.
    assert_eq!(emu.vm_power(VMID), "off");
    assert_eq!(
        emu.power_off_transitions(VMID),
        1,
        "powered off exactly once across three controller processes"
    );
    let source: Vec<String> = emu.disk_files(VMID).iter().map(|(_, _, sha, _)| sha.clone()).collect();
    let now: Vec<String> =
        emu.disk_files(VMID).iter().map(|(_, p, _, _)| sha256_file(p, None).unwrap().1).collect();
    assert_eq!(now, source, "the source disks were written");
    let mut imported = Vec::new();
    for (d, (_, _, _, size)) in emu.disk_files(VMID).into_iter().enumerate() {
        let image = crate::support::imported_image(&client, &apps, &format!("{VM}-disk-{d}")).await;
        let digest = vmmigrate::images::digest::volume_digest(&image, size).unwrap();
        assert_eq!(digest.nonzero_tail_bytes, 0, "{}: bytes after the disk", image.display());
        imported.push(digest.sha256);
    }
    assert_eq!(imported, source, "imported bytes differ from the source");
    let status = vmm.status.unwrap();
    assert!(status.disks.iter().all(|d| d.artifact_format.as_deref() == Some("qcow2")));

    // The second pod's container was restarted in place; the first pod was replaced.
    let listed = pods.list(&controller_pods).await.unwrap().items;
    assert!(listed.iter().all(|p| p.name_any() != first), "the force-deleted pod is gone");
    let restarted = listed.iter().find(|p| p.name_any() == second).expect("the second leader's pod");
    let restarts = restarted.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0].restart_count;
    assert_eq!(restarts, 1, "its container was killed once and restarted");

    // The conversion Jobs ran as pods of the image, and are gone.
    let jobs = env.kubectl(&["-n", SYSTEM, "get", "jobs", "-o", "name"]).unwrap();
    assert!(jobs.trim().is_empty(), "conversion Jobs left: {jobs}");

    // Only deploy/'s RBAC: the pods run as the ServiceAccount vmmigrate and
    // nothing they asked for was forbidden.
    for pod in &listed {
        assert_eq!(pod.spec.as_ref().unwrap().service_account_name.as_deref(), Some("vmmigrate"));
        let logs = env.kubectl(&["-n", SYSTEM, "logs", &pod.name_any()]).unwrap_or_default();
        assert!(!logs.contains("forbidden"), "{}: {logs}", pod.name_any());
    }

    // The outcome reaches the status branch of the real remote (status
    // commits are batched over a window).
    let status_file = format!("migration-status:{SYSTEM}/{VM}.yaml");
    loop {
        let shown =
            Command::new("git").arg("--git-dir").arg(&bare).args(["show", &status_file]).output().unwrap();
        let text = String::from_utf8_lossy(&shown.stdout).into_owned();
        if text.lines().any(|l| l == "phase: Completed") {
            break;
        }
        assert!(Instant::now() < deadline, "{status_file}: {text}\n{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The API server's audit log of the run against the rights granted.
    // Every migration it watched (other tests leave some in vmmigrate-system)
    // names the credentials it may read.
    let credentials: Vec<String> = migrations
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|m| m.spec.source.credentials_secret_ref.name.clone())
        .collect();
    audit_matches_the_granted_rights(env, installed_at, &apps, &credentials);
}

/// Every request the installed controller made with the ServiceAccount's
/// own token since `since` (impersonated ones are deploy_rbac's reviews)
/// was answered without a 403, and each is a call on deploy_rbac's
/// hand-kept lists: the base's, or the tenant Role's in `tenant`; of
/// Secrets it read only the `credentials` its migrations name and its own. The
/// grants the run never used are printed (a path this test does not take,
/// or a right to take back).
fn audit_matches_the_granted_rights(
    env: &KubeEnv,
    since: std::time::SystemTime,
    tenant: &str,
    credentials: &[String],
) {
    use crate::deploy_rbac::{ANY, CALLS, SA_USER, TENANT_CALLS};
    let Some(requests) = env.audited_requests(SA_USER, since) else {
        return; // a borrowed cluster: no audit log
    };
    let requests = requests.expect("reading the audit log");
    assert!(requests.iter().any(|r| r.resource == "datavolumes"), "the audit log has the run: {requests:?}");
    let forbidden: Vec<_> = requests.iter().filter(|r| r.code == 403).collect();
    assert!(forbidden.is_empty(), "refused to the controller: {forbidden:#?}");
    let matches = |call: &crate::deploy_rbac::Call, r: &vmmigrate_harness::kube_env::AuditedRequest| {
        let &(verb, group, resource, subresource, at) = call;
        verb == r.verb
            && group == r.group
            && resource == r.resource
            && subresource == r.subresource
            && match at {
                "" | ANY => true,
                SYSTEM => r.namespace == SYSTEM,
                _ => r.namespace == tenant,
            }
    };
    let on_a_list = |r: &vmmigrate_harness::kube_env::AuditedRequest| {
        // Discovery and /version: what every authenticated client may read.
        r.resource.is_empty() || CALLS.iter().chain(TENANT_CALLS).any(|c| matches(c, r))
    };
    let mut unlisted: Vec<String> = requests
        .iter()
        .filter(|r| !on_a_list(r))
        .map(|r| format!("{} {}/{}/{} in {:?}", r.verb, r.group, r.resource, r.subresource, r.namespace))
        .collect();
    unlisted.sort();
    unlisted.dedup();
    assert!(
        unlisted.is_empty(),
        "the controller made calls on no granted list:\n  {}",
        unlisted.join("\n  ")
    );
    // What RBAC cannot say (it grants `get` on Secrets by any name in a
    // tenant namespace): the Secrets read were the migration's credentials
    // and vmmigrate's own import and worker Secrets, nothing else.
    let mut read: Vec<&str> = requests
        .iter()
        .filter(|r| r.resource == "secrets" && r.verb == "get")
        .map(|r| r.name.as_str())
        .collect();
    read.sort();
    read.dedup();
    assert!(read.contains(&"esxi"), "the credentials were read: {read:?}");
    let foreign: Vec<&&str> = read
        .iter()
        .filter(|n| {
            !credentials.iter().any(|c| c == **n) && !n.ends_with("-import") && !n.ends_with("-vmm-worker")
        })
        .collect();
    assert!(foreign.is_empty(), "the controller read Secrets not its own: {foreign:?}");
    let unused: Vec<String> = CALLS
        .iter()
        .chain(TENANT_CALLS)
        .filter(|c| !requests.iter().any(|r| matches(c, r)))
        .map(|c| format!("{c:?}"))
        .collect();
    eprintln!(
        "audit: {} requests by the ServiceAccount, none refused; granted and not used in this run ({}):\n  {}",
        requests.len(),
        unused.len(),
        unused.join("\n  ")
    );
}
