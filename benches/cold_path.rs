//! Benchmark (not a test): the cold data path of one migration next to the
//! bare transfer it can never beat, in the same run. VM 12 `pair` of the
//! ESXi emulator (real OpenSSH on loopback, two thick disks, 1 GiB together
//! by default) is migrated by the real controller (release build, the
//! in-process data plane) against the test cluster's real API server; the
//! time from the migration entering Preparing to entering Importing (power
//! state confirmed, both disks copied over SSH with sha256 and checked
//! against the host's `sha256sum`, the raw artifacts made and staged) is
//! put beside one bare `ssh host cat` of the same two extents to
//! `/dev/null`. Each copy must still be verified by the host's own sha256
//! (`openssl dgst` on the emulated host, as on ESXi), or the run fails.
//!
//!   cargo bench --bench cold_path                 # 640 + 384 MiB, 3 runs
//!   VMMIGRATE_BENCH_MIB=96,32 VMMIGRATE_BENCH_REPEAT=1 cargo bench --bench cold_path
//!
//! The source is powered off before each run (the guest's shutdown is the
//! guest's time, not the data path's; a migration of a running VM adds it
//! between Preparing and the first read). The phases are seen through a
//! watch on the migration (milliseconds after each status write). Each run
//! has a namespace of its own; the import itself (real CDI) is left to the
//! CDI benchmark. Needs root and the cluster's build (as `cargo test` does).

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::controller::service::{self, ControllerOptions, DataPlane};
use vmmigrate::metrics::Metrics;
use vmmigrate_harness::KubeEnv;
use vmmigrate_harness::esxi_emulator::{EsxiEmulator, EsxiOptions};

const VMID: &str = "12";

/// One bare `ssh host cat` of both extents, to `/dev/null`: seconds.
fn bare_ssh_cat(emu: &EsxiEmulator) -> f64 {
    let paths: Vec<String> = emu.disk_files(VMID).into_iter().map(|d| format!("'{}'", d.0)).collect();
    let started = Instant::now();
    let status = emu
        .ssh_command()
        .arg(format!("cat {}", paths.join(" ")))
        .stdout(std::process::Stdio::null())
        .status()
        .expect("ssh cat");
    assert!(status.success(), "ssh cat failed");
    started.elapsed().as_secs_f64()
}

/// `(entered Preparing, entered Converting, entered Importing)` after `started`, in seconds.
async fn migrate(client: &kube::Client, emu: &EsxiEmulator, run: usize) -> (f64, f64, f64) {
    let ns = format!("cold-path-{}-{run}", std::process::id());
    let namespace: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.create(&PostParams::default(), &namespace).await.expect("namespace");
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "esxi"},
        "stringData": {"username": emu.username, "password": emu.password},
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), &ns).create(&PostParams::default(), &secret).await.unwrap();

    let work = tempfile::tempdir().expect("work dir");
    let opts = ControllerOptions {
        namespace: Some(ns.clone()),
        work_dir: work.path().to_path_buf(),
        staging_listen: "127.0.0.1:0".parse().unwrap(),
        staging_url: None,
        conversions: 2,
        copy_streams: 1,
        job_image: None,
        job_namespace: None,
        work_claim: None,
        instance: "cold-path".into(),
        leader_election: service::LeaderElectionOptions { lease_namespace: ns.clone(), ..Default::default() },
        metrics_listen: "127.0.0.1:0".parse().unwrap(),
        destination_rules: Default::default(),
        max_reads_per_host: 2,
        host_reads: Vec::new(),
        max_reads: None,
        data_plane: DataPlane::Process,
        worker_cpu: "100m".into(),
        worker_memory: "64Mi".into(),
        worker_memory_limit: "512Mi".into(),
        worker_storage_class: None,
    };
    let metrics = Arc::new(Metrics::new());
    let staging = service::start_staging(&opts, &metrics).await.expect("staging server");
    let adapters = service::adapters(client.clone(), &opts, &staging, &metrics).expect("adapters");
    let config = ControllerConfig {
        namespace: Some(ns.clone()),
        instance: "cold-path".into(),
        metrics: metrics.clone(),
        ..Default::default()
    };
    let controller = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));

    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let mut events = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
    let body = serde_json::json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": "pair", "namespace": ns},
        "spec": {
            "source": {"host": "127.0.0.1", "port": emu.port, "hostKey": emu.host_key_fingerprint(),
                       "credentialsSecretRef": {"name": "esxi"}, "vm": {"name": "pair"}},
            "destination": {"namespace": ns, "storageClassName": "local-path"},
            "networkMap": [{"source": "VM Network", "type": "Pod"}],
        }
    });
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    let started = Instant::now();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
    let (mut preparing, mut converting) = (None, None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let importing = loop {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("Importing within 10 minutes")
            .expect("watch ended");
        let Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) = event else { continue };
        let status = object.status.unwrap_or_default();
        let at = started.elapsed().as_secs_f64();
        match status.phase {
            Phase::Preparing => {
                preparing.get_or_insert(at);
            }
            Phase::Converting => {
                converting.get_or_insert(at);
            }
            Phase::Importing => {
                // The end-to-end checksum held: the host hashed each disk itself.
                assert!(
                    status.disks.iter().all(|d| d.source_verified_remotely == Some(true)),
                    "every copy verified by the host's own sha256: {:?}",
                    status.disks
                );
                break at;
            }
            Phase::Failed | Phase::ManualInterventionRequired | Phase::Retryable => {
                panic!("the migration stopped in {}: {:#?}", status.phase, status.conditions)
            }
            _ => {}
        }
    };
    controller.abort();
    let _ = controller.await;
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    let preparing = preparing.expect("Preparing seen");
    (preparing, converting.unwrap_or(importing), importing)
}

fn main() {
    let sizes: Vec<u64> = std::env::var("VMMIGRATE_BENCH_MIB")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .filter(|v: &Vec<u64>| v.len() == 2)
        .unwrap_or_else(|| vec![640, 384]);
    let repeat: usize =
        std::env::var("VMMIGRATE_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let cluster = KubeEnv::shared();
    let emu =
        EsxiEmulator::start(EsxiOptions { pair_disk_mib: Some((sizes[0], sizes[1])), ..Default::default() })
            .expect("ESXi emulator");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut rows = Vec::new();
    runtime.block_on(async {
        let client = cluster.client().await;
        for run in 1..=repeat {
            emu.set_power(VMID, false);
            let (preparing, converting, importing) = migrate(&client, &emu, run).await;
            let cat = bare_ssh_cat(&emu);
            rows.push((run, importing - preparing, converting - preparing, importing - converting, cat));
        }
    });
    let mib = sizes[0] + sizes[1];
    println!("\ncold data path: VM `pair`, two disks of {} + {} MiB ({mib} MiB)", sizes[0], sizes[1]);
    println!(
        "| run | Preparing → Importing | of it: Preparing (copies) | Converting (artifacts, staging) | bare `ssh cat` of both | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (run, path, copy, convert, cat) in &rows {
        println!("| {run} | {path:.2} s | {copy:.2} s | {convert:.2} s | {cat:.2} s | {:.2}× |", path / cat);
    }
    let mut ratios: Vec<f64> = rows.iter().map(|r| r.1 / r.4).collect();
    ratios.sort_by(f64::total_cmp);
    println!("median ratio: {:.2}×", ratios[ratios.len() / 2]);
}
