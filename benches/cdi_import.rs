//! Benchmark (not a test): one DataVolume imported by real CDI v1.65.0 on the
//! test node from vmmigrate's staging server (HTTPS, per-artifact
//! credentials, `checksum` checked by CDI), against baselines in the same
//! run.
//!
//!   cargo bench --bench cdi_import                  # 1024 MiB artifact
//!   VMMIGRATE_BENCH_MIB=256 cargo bench --bench cdi_import
//!   VMMIGRATE_BENCH_REPEAT=3 ...                    # imports (the median is shown)
//!
//! Rows: `curl` from the staging server piped into `sha256sum` (the bytes
//! and the hash CDI's importer has to move, nothing else: the baseline),
//! `qemu-img convert` of the file to a raw file on the same disk (the
//! importer's writing step), and the real import from creating the
//! DataVolume to `Succeeded` (claim binding by local-path's helper pod, the
//! importer pod's start, nbdkit + qemu-img through the pod network, CDI
//! noticing the end), and beside it the other way to fill a volume that
//! keeps a DataVolume per disk: a blank DataVolume and a Job running
//! `vmmigrate fill-volume` (the release image), created together, from
//! their creation to the Job's success (the volume's bytes hashed to the
//! artifact's sha256). Each import gets a namespace of its own, removed
//! afterwards. Needs root and the cluster's build (as `cargo test` does).

use kube::api::{Api, DynamicObject, PostParams};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmigrate::convert::access::StagingAccess;
use vmmigrate::convert::artifact::{Marker, sha256_file, write_marker};
use vmmigrate::convert::staging::StagingServer;
use vmmigrate::destination::cluster::data_volume_resource;
use vmmigrate_harness::KubeEnv;
use vmmigrate_harness::process::timed_shell as shell;

fn main() {
    let mib: u64 = std::env::var("VMMIGRATE_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    let repeat: usize =
        std::env::var("VMMIGRATE_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let env = KubeEnv::shared();
    let node_ip = env.node.as_ref().expect("the shared cluster has a node").host_ip;
    let work = tempfile::tempdir().expect("tempdir");
    let errors = work.path().join("stderr");
    let uid = "bench-cdi-0000";
    let dir = work.path().join("staging").join(uid);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("disk-0.raw");
    // Incompressible bytes: nothing in the path gets to skip them.
    shell(&format!("head -c {mib}M /dev/urandom > {}", file.display()), &errors);
    let (size, sha256) = sha256_file(&file, None).unwrap();
    write_marker(&file, &Marker { size, sha256: sha256.clone() }).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind((node_ip, 0))).unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let access = Arc::new(StagingAccess::load_or_create(&work.path().join("tls"), &url).unwrap());
    let credential = access.credential(uid, "disk-0.raw");
    let ca = work.path().join("ca.pem");
    std::fs::write(&ca, access.ca_pem()).unwrap();
    let server = runtime
        .block_on(StagingServer::start(listener, work.path().join("staging"), url.clone(), access.clone()))
        .unwrap();
    let artifact_url = format!("{url}/artifacts/{uid}/disk-0.raw");

    let median = |runs: &mut Vec<f64>| {
        runs.sort_by(f64::total_cmp);
        runs[runs.len() / 2]
    };
    let mut rows: Vec<(&str, f64)> = Vec::new();
    let curl = format!(
        "curl -sS --fail --cacert {} -u '{}:{}' {artifact_url} | sha256sum | grep -q {sha256}",
        ca.display(),
        credential.access_key_id,
        credential.secret_key
    );
    let mut runs: Vec<f64> = (0..repeat).map(|_| shell(&curl, &errors).0).collect();
    rows.push(("staging → curl | sha256sum (the baseline)", median(&mut runs)));
    let out = work.path().join("converted.raw");
    let convert = format!(
        "qemu-img convert -f raw -O raw {} {} && sync -f {}",
        file.display(),
        out.display(),
        out.display()
    );
    let mut runs: Vec<f64> = (0..repeat)
        .map(|_| {
            let _ = std::fs::remove_file(&out);
            shell(&convert, &errors).0
        })
        .collect();
    let _ = std::fs::remove_file(&out);
    rows.push(("qemu-img convert raw → raw, same disk", median(&mut runs)));

    let mut runs: Vec<f64> = (0..repeat)
        .map(|i| runtime.block_on(import_once(env, &access, uid, &artifact_url, &sha256, size, i)))
        .collect();
    rows.push(("real CDI v1.65.0: DataVolume created → Succeeded", median(&mut runs)));
    let image = env.controller_image().expect("the release image");
    let mut runs: Vec<f64> = (0..repeat)
        .map(|i| runtime.block_on(fill_once(env, &image, &access, uid, &artifact_url, &sha256, size, i)))
        .collect();
    rows.push(("blank DataVolume + `vmmigrate fill-volume` Job → Succeeded", median(&mut runs)));
    let served = server.stats().bytes_served.load(std::sync::atomic::Ordering::Relaxed);
    assert!(served >= 3 * repeat as u64 * size, "every run got the whole artifact ({served} bytes served)");

    let gib = mib as f64 / 1024.0;
    println!("real CDI import, {mib} MiB artifact, median of {repeat}:");
    println!("{:<52} {:>8} {:>8} {:>8}", "row", "wall s", "s/GiB", "MiB/s");
    let baseline = rows[0].1;
    for (name, seconds) in &rows {
        println!(
            "{name:<52} {seconds:>8.2} {:>8.2} {:>8.0}   ({:.2}× the baseline)",
            seconds / gib,
            mib as f64 / seconds,
            seconds / baseline
        );
    }
}

/// A namespace of its own with the artifact's Secret and CA as the
/// controller writes them.
async fn namespace_with_access(
    client: &kube::Client,
    ns: &str,
    access: &StagingAccess,
    uid: &str,
) -> Api<k8s_openapi::api::core::v1::Namespace> {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace = serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap();
    namespaces.create(&PostParams::default(), &namespace).await.expect("namespace");
    let credential = access.credential(uid, "disk-0.raw");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": { "name": "disk-0-import" },
        "stringData": { "accessKeyId": credential.access_key_id, "secretKey": credential.secret_key,
                        "ca.pem": access.ca_pem() },
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), ns).create(&PostParams::default(), &secret).await.unwrap();
    let ca: ConfigMap = serde_json::from_value(json!({
        "metadata": { "name": "disk-0-import-ca" }, "data": { "ca.pem": access.ca_pem() },
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), ns).create(&PostParams::default(), &ca).await.unwrap();
    namespaces
}

/// One DataVolume importing over HTTPS in a namespace of its own; returns
/// the seconds from its creation to `Succeeded`.
async fn import_once(
    env: &KubeEnv,
    access: &StagingAccess,
    uid: &str,
    url: &str,
    sha256: &str,
    size: u64,
    run: usize,
) -> f64 {
    let client = env.client().await;
    let ns = format!("bench-cdi-{}-{run}", std::process::id());
    let namespaces = namespace_with_access(&client, &ns, access, uid).await;
    let request = format!("{}Mi", size.div_ceil(1 << 20));
    let dv: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": { "name": "disk-0", "annotations": { "cdi.kubevirt.io/storage.bind.immediate.requested": "true" } },
        "spec": {
            "source": { "http": { "url": url, "secretRef": "disk-0-import", "certConfigMap": "disk-0-import-ca",
                                  "checksum": format!("sha256:{sha256}") } },
            "storage": { "storageClassName": "local-path", "resources": { "requests": { "storage": request } } },
        },
    }))
    .unwrap();
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &data_volume_resource());
    let started = Instant::now();
    dvs.create(&PostParams::default(), &dv).await.expect("DataVolume");
    let deadline = started + Duration::from_secs(1800);
    let seconds = loop {
        let dv = dvs.get("disk-0").await.expect("DataVolume");
        let phase = dv.data["status"]["phase"].as_str().unwrap_or("").to_owned();
        if phase == "Succeeded" {
            break started.elapsed().as_secs_f64();
        }
        assert!(phase != "Failed", "the import failed: {}", dv.data["status"]);
        assert!(Instant::now() < deadline, "the import did not finish: {}", dv.data["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    namespaces.delete(&ns, &Default::default()).await.expect("namespace removal");
    seconds
}

/// A blank DataVolume and, at the same moment, a Job that fills it with
/// `vmmigrate fill-volume` (the release image, as the qemu user KubeVirt's
/// launcher and CDI's importer write volumes as), in a namespace of its own;
/// returns the seconds from their creation to the Job's success, which
/// means the volume's bytes hash to the artifact's sha256.
#[allow(clippy::too_many_arguments)]
async fn fill_once(
    env: &KubeEnv,
    image: &str,
    access: &StagingAccess,
    uid: &str,
    url: &str,
    sha256: &str,
    size: u64,
    run: usize,
) -> f64 {
    use k8s_openapi::api::batch::v1::Job;
    let client = env.client().await;
    let ns = format!("bench-fill-{}-{run}", std::process::id());
    let namespaces = namespace_with_access(&client, &ns, access, uid).await;
    let request = format!("{}Mi", size.div_ceil(1 << 20));
    let dv: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": { "name": "disk-0", "annotations": { "cdi.kubevirt.io/storage.bind.immediate.requested": "true" } },
        "spec": {
            "source": { "blank": {} },
            "storage": { "storageClassName": "local-path", "resources": { "requests": { "storage": request } } },
        },
    }))
    .unwrap();
    let job: Job = serde_json::from_value(json!({
        "metadata": { "name": "disk-0-fill" },
        "spec": { "backoffLimit": 0, "template": { "spec": {
            "restartPolicy": "Never",
            "securityContext": { "runAsUser": 107, "runAsGroup": 107, "runAsNonRoot": true,
                                 "seccompProfile": { "type": "RuntimeDefault" } },
            "containers": [{
                "name": "fill", "image": image, "command": ["vmmigrate"],
                "args": ["fill-volume", "--url", url, "--ca", "/credentials/ca.pem", "--credentials", "/credentials",
                         "--path", "/volume/disk.img", "--size", size.to_string(), "--sha256", sha256],
                "securityContext": { "allowPrivilegeEscalation": false, "capabilities": { "drop": ["ALL"] },
                                     "readOnlyRootFilesystem": true },
                "volumeMounts": [
                    { "name": "volume", "mountPath": "/volume" },
                    { "name": "credentials", "mountPath": "/credentials", "readOnly": true },
                ],
            }],
            "volumes": [
                { "name": "volume", "persistentVolumeClaim": { "claimName": "disk-0" } },
                { "name": "credentials", "secret": { "secretName": "disk-0-import" } },
            ],
        } } },
    }))
    .unwrap();
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &data_volume_resource());
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    dvs.create(&PostParams::default(), &dv).await.expect("DataVolume");
    // CDI writes the blank image first (its own pod); a pod of ours that
    // mounted the claim before would find no `disk.img`, or race CDI's.
    let deadline = started + Duration::from_secs(1800);
    loop {
        let dv = dvs.get("disk-0").await.expect("DataVolume");
        if dv.data["status"]["phase"] == "Succeeded" {
            break;
        }
        assert!(Instant::now() < deadline, "the blank DataVolume did not succeed: {}", dv.data["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let blank = started.elapsed().as_secs_f64();
    jobs.create(&PostParams::default(), &job).await.expect("fill Job");
    let seconds = loop {
        let job = jobs.get("disk-0-fill").await.expect("fill Job");
        let status = job.status.unwrap_or_default();
        if status.succeeded.unwrap_or(0) > 0 {
            break started.elapsed().as_secs_f64();
        }
        if status.failed.unwrap_or(0) > 0 {
            let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
            let listed = pods.list(&Default::default()).await.expect("pods");
            let said: Vec<String> = listed
                .items
                .iter()
                .flat_map(|p| p.status.iter().flat_map(|s| s.container_statuses.iter().flatten()))
                .filter_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
                .collect();
            panic!("the fill Job failed: {said:?}");
        }
        let dv = dvs.get("disk-0").await.expect("DataVolume");
        assert!(Instant::now() < deadline, "the fill did not finish: {}", dv.data["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("fill run {run}: blank DataVolume Succeeded after {blank:.2} s, filled after {seconds:.2} s");
    namespaces.delete(&ns, &Default::default()).await.expect("namespace removal");
    seconds
}
