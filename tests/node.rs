//! The test cluster's real node (`vmmigrate_harness::node`): pods run under
//! the kubelet with containerd and runc, PVCs bind through the
//! local-path-provisioner, Services route through kube-proxy, and tearing a
//! cluster down leaves nothing on the machine.

use crate::support::{KubeEnv, test_namespace};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, PostParams};
use std::time::Duration;

const BUSYBOX: &str = vmmigrate_harness::node::BUSYBOX_IMAGE;

fn job(name: &str, script: &str, volume_claim: Option<&str>) -> Job {
    let mut spec = serde_json::json!({
        "restartPolicy": "Never",
        "containers": [{
            "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
            "command": ["sh", "-c", script],
        }],
    });
    if let Some(claim) = volume_claim {
        spec["containers"][0]["volumeMounts"] = serde_json::json!([{"name": "data", "mountPath": "/data"}]);
        spec["volumes"] =
            serde_json::json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]);
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": spec}},
    }))
    .expect("job object")
}

/// Waits for a Job to finish; returns whether it succeeded and the log of its pod.
async fn finish(env: &KubeEnv, jobs: &Api<Job>, ns: &str, name: &str) -> (bool, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let job = jobs.get(name).await.expect("get job");
        let status = job.status.unwrap_or_default();
        if status.succeeded.unwrap_or(0) > 0 || status.failed.unwrap_or(0) > 0 {
            let logs =
                env.kubectl(&["-n", ns, "logs", &format!("job/{name}")]).unwrap_or_else(|e| format!("{e:#}"));
            return (status.succeeded.unwrap_or(0) > 0, logs);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Job {ns}/{name} did not finish in 120s: {:?}",
            env.kubectl(&["-n", ns, "describe", "pods"])
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_job_runs_as_a_real_pod_and_writes_to_a_provisioned_volume() {
    let env = KubeEnv::shared();
    let node = env.node.as_ref().expect("the shared cluster has a node");
    let client = env.client().await;
    let ns = test_namespace(&client, "node-job").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "64Mi"}}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.expect("create pvc");
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let script =
        "echo written-by-$(hostname) > /data/proof && cat /proc/self/cgroup | grep memory && echo done";
    jobs.create(&PostParams::default(), &job("writer", script, Some("data"))).await.expect("create job");
    let (ok, logs) = finish(env, &jobs, &ns, "writer").await;
    assert!(ok, "the Job failed: {logs}");
    // The process ran in the node's pod cgroups, not as a local process.
    assert!(logs.contains(&format!("/{}/kubepods", node.cgroup_root)), "not in the pod cgroups: {logs}");
    assert!(logs.trim_end().ends_with("done"), "{logs}");

    // The claim was bound by the provisioner to a directory under the node's PV root.
    let bound = claims.get("data").await.unwrap();
    assert_eq!(bound.status.and_then(|s| s.phase).as_deref(), Some("Bound"));
    let volume = bound.spec.and_then(|s| s.volume_name).expect("volume name");
    let pv_root = node.dir.join("pv");
    let written: Vec<_> = std::fs::read_dir(&pv_root)
        .expect("pv root")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&volume))
        .map(|e| std::fs::read_to_string(e.path().join("proof")).expect("proof file"))
        .collect();
    assert_eq!(written.len(), 1, "one directory for {volume} under {}", pv_root.display());
    assert!(written[0].starts_with("written-by-writer-"), "{written:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_the_api_server_and_other_pods_through_services() {
    let env = KubeEnv::shared();
    let client = env.client().await;
    let ns = test_namespace(&client, "node-svc").await;
    // A server pod behind a Service.
    let server =
        "mkdir /www && echo hello-from-the-service > /www/index.html && exec httpd -f -p 8080 -h /www";
    env.kubectl(&[
        "-n",
        &ns,
        "run",
        "web",
        "--image",
        BUSYBOX,
        "--image-pull-policy",
        "Never",
        "--labels",
        "app=web",
        "--port",
        "8080",
        "--command",
        "--",
        "sh",
        "-c",
        server,
    ])
    .expect("run web pod");
    env.kubectl(&["-n", &ns, "expose", "pod", "web", "--port", "80", "--target-port", "8080"])
        .expect("expose");
    env.kubectl(&["-n", &ns, "wait", "--for=condition=Ready", "pod/web", "--timeout=120s"])
        .expect("web ready");
    let cluster_ip =
        env.kubectl(&["-n", &ns, "get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"]).unwrap();
    let api_ip = env
        .kubectl(&["-n", "default", "get", "service", "kubernetes", "-o", "jsonpath={.spec.clusterIP}"])
        .unwrap();

    // The client pod: the Service by its ClusterIP (kube-proxy's rules), and
    // the API server's Service port (what in-cluster clients use). bash's
    // /dev/tcp from the release image: Debian's busybox-static resolves
    // even an address through glibc's NSS, which a static binary cannot load.
    let image = tokio::task::block_in_place(|| env.controller_image()).expect("release image");
    // Each attempt within 3 s: until kube-proxy has written the Service's
    // rules, a SYN to its ClusterIP goes nowhere and a bare connect would
    // wait for the kernel's two minutes.
    let script = format!(
        "for i in $(seq 1 50); do \
           out=$(timeout 3 bash -c 'exec 3<>/dev/tcp/{cluster_ip}/80 && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' 2>&1) \
             && [ -n \"$out\" ] && {{ echo \"$out\"; break; }}; \
           echo \"attempt $i: $out\"; sleep 0.2; done; \
         timeout 10 bash -c 'exec 4<>/dev/tcp/{api_ip}/443' && echo api-reachable"
    );
    let mut client_job = job("client", &script, None);
    let container = &mut client_job.spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
    container.image = Some(image);
    container.command = Some(vec!["bash".into(), "-c".into(), script.clone()]);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    jobs.create(&PostParams::default(), &client_job).await.expect("create job");
    let (ok, logs) = finish(env, &jobs, &ns, "client").await;
    assert!(ok, "the client Job failed: {logs}");
    assert!(logs.contains("hello-from-the-service"), "the Service did not answer: {logs}");
    assert!(logs.contains("api-reachable"), "the API server's Service did not answer: {logs}");
}

/// Run by `a_killed_test_process_leaves_no_cluster_behind` as a child process:
/// starts a one-node cluster of its own, runs a pod, prints what it made and
/// waits to be killed.
#[test]
#[ignore = "started by a_killed_test_process_leaves_no_cluster_behind"]
fn node_cluster_child_process() {
    let env = KubeEnv::start_owned(true).expect("start a cluster");
    let node = env.node.as_ref().expect("node");
    env.kubectl(&[
        "run",
        "sleeper",
        "--image",
        BUSYBOX,
        "--image-pull-policy",
        "Never",
        "--command",
        "--",
        "sleep",
        "3600",
    ])
    .expect("run pod");
    env.kubectl(&["wait", "--for=condition=Ready", "pod/sleeper", "--timeout=120s"]).expect("pod ready");
    let dir = node.dir.parent().expect("cluster dir").display().to_string();
    println!("CLUSTER {} {} {} {:.1}", node.netns, node.cgroup_root, dir, env.startup.as_secs_f64());
    println!("MEMORY {}", env.memory_bytes());
    use std::io::Write as _;
    std::io::stdout().flush().unwrap();
    // Killed by the parent; stdin stays open until then.
    let _ = std::io::stdin().read_line(&mut String::new());
}

#[test]
fn a_killed_test_process_leaves_no_cluster_behind() {
    use std::io::BufRead as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "node::node_cluster_child_process", "--nocapture"])
        // Its cluster is to be removed even where this run keeps others.
        .env_remove("VMMIGRATE_TEST_KEEP")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start child");
    // Kill it on every path out of this test.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().unwrap();
    let mut child = Kill(child);
    let mut cluster = None;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("CLUSTER ") {
            cluster = Some(rest.split(' ').map(str::to_owned).collect::<Vec<_>>());
        }
        if let Some(memory) = line.strip_prefix("MEMORY ") {
            eprintln!(
                "the one-node cluster at rest with one pod: {} MiB",
                memory.parse::<u64>().unwrap() >> 20
            );
            break;
        }
    }
    let cluster = cluster.expect("the child printed its cluster");
    let (netns, cgroup, dir) = (&cluster[0], &cluster[1], &cluster[2]);
    eprintln!("the one-node cluster started in {}s", cluster[3]);
    assert!(std::path::Path::new(&format!("/run/netns/{netns}")).exists(), "netns {netns} while running");

    // SIGKILL: no destructor runs; the guard and the janitor clean up.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let leftovers = || -> Vec<String> {
        let mut left = Vec::new();
        if std::path::Path::new(&format!("/run/netns/{netns}")).exists() {
            left.push(format!("netns {netns}"));
        }
        for hierarchy in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
            if hierarchy.path().join(cgroup).exists() {
                left.push(format!("cgroup {}", hierarchy.path().join(cgroup).display()));
            }
        }
        if std::path::Path::new(dir).exists() {
            left.push(format!("directory {dir}"));
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        left.extend(mounts.lines().filter(|l| l.contains(dir.as_str())).map(|l| format!("mount {l}")));
        for proc in std::fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = std::fs::read(proc.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(dir.as_str()) {
                left.push(format!(
                    "process {} {}",
                    proc.file_name().to_string_lossy(),
                    String::from_utf8_lossy(&cmdline).replace('\0', " ")
                ));
            }
        }
        let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
        let links = String::from_utf8_lossy(&links.stdout);
        let host_if = format!("vn{}", netns.trim_start_matches("vmmnode-").replace('-', "n"));
        left.extend(
            links.lines().filter(|l| l.contains(&format!(" {host_if}@"))).map(|l| format!("link {l}")),
        );
        left
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !leftovers().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let left = leftovers();
    let guard_log = std::fs::read_to_string(format!("/tmp/{netns}.guard.log")).unwrap_or_default();
    assert!(
        left.is_empty(),
        "left behind after the test process was killed: {left:#?}\nguard log:\n{guard_log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversion_job_of_the_release_image_fails_on_a_missing_input_and_says_why_in_its_termination_message()
 {
    let env = KubeEnv::shared();
    let image = tokio::task::block_in_place(|| env.controller_image()).expect("release image");
    let client = env.client().await;
    let ns = test_namespace(&client, "node-convert").await;
    // What the controller's `job` runner renders, less the work volume: the
    // input is missing, so `vmmigrate convert` fails with its reason.
    let body = serde_json::json!({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "convert"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": true},
            "containers": [{
                "name": "convert", "image": image, "imagePullPolicy": "Never",
                "command": ["vmmigrate"],
                "args": ["convert", "--input", "/nonexistent/disk-0.raw", "--input-sha256", "ab".repeat(32),
                         "--expected-size", "1048576", "--output", "/tmp/out/disk-0.raw", "--format", "raw"],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        }}},
    });
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    jobs.create(&PostParams::default(), &serde_json::from_value(body).unwrap()).await.expect("create job");
    let (ok, logs) = finish(env, &jobs, &ns, "convert").await;
    assert!(!ok, "the conversion of a missing input succeeded: {logs}");
    assert!(
        logs.contains("AcquiredCopyMissing: the acquired copy /nonexistent/disk-0.raw does not exist"),
        "{logs}"
    );
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let pod = pods
        .list(&kube::api::ListParams::default().labels("batch.kubernetes.io/job-name=convert"))
        .await
        .unwrap()
        .items
        .pop()
        .expect("the Job's pod");
    let terminated =
        pod.status.unwrap().container_statuses.unwrap()[0].state.clone().unwrap().terminated.unwrap();
    assert_eq!(terminated.exit_code, 1);
    assert!(terminated.message.unwrap_or_default().contains("AcquiredCopyMissing"), "termination message");
}
