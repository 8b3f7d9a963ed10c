//! Benchmark (not a test): a small fleet with its data plane in worker pods
//! (`--data-plane pods`), every part real but KubeVirt's controllers. `HOSTS`
//! ESXi emulators (real OpenSSH each, on the node's veth) hold `VMS_PER_HOST`
//! VMs of one `DISK_MIB` disk each, served at `RATE_MIB` MiB/s per read so
//! that a copy takes a known time; the real controller with at most `CAP`
//! reads per host starts one worker Job per migration on the test cluster's
//! real node (kubelet, containerd, the release image, local-path claims);
//! real CDI imports from the workers' staging servers; the KubeVirt simulator
//! runs the VMs. The migrations are created through the API (the Git path is
//! the fleet benchmark's).
//!
//!   cargo bench --bench worker_pods               # 3 hosts x 3 VMs, 16 MiB at 4 MiB/s, cap 1
//!   VMMIGRATE_BENCH_HOSTS=2 VMMIGRATE_BENCH_VMS_PER_HOST=2 cargo bench --bench worker_pods
//!
//! Reported: the time from the first create to the last Completed against
//! the ideal the caps set for the copies alone (each host copies its VMs in
//! rounds of `CAP`, hosts at once), each migration's time in Preparing, the
//! most worker pods running at once, the peak RSS of a worker pod's process
//! and of all worker pods together, and the peak RSS of this process (the
//! controller). Needs root and the cluster's build (as `cargo test` does).

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::controller::service::{self, ControllerOptions, DataPlane};
use vmmigrate::metrics::Metrics;
use vmmigrate_harness::KubeEnv;
use vmmigrate_harness::esxi_emulator::{EsxiEmulator, EsxiOptions};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// RSS in MiB of each process of the node whose command line is `vmmigrate worker …`.
fn worker_rss(env: &KubeEnv) -> Vec<f64> {
    let node = env.node.as_ref().expect("the shared cluster has a node");
    node.vmmigrate_processes("worker")
        .into_iter()
        .map(|pid| vmmigrate_harness::process::rss_bytes(pid) as f64 / (1 << 20) as f64)
        .collect()
}

fn self_hwm_mib() -> f64 {
    vmmigrate_harness::process::status_kib(std::process::id(), "VmHWM") as f64 / 1024.0
}

fn main() {
    let hosts = env("VMMIGRATE_BENCH_HOSTS", 3) as usize;
    let per_host = env("VMMIGRATE_BENCH_VMS_PER_HOST", 3) as usize;
    let disk_mib = env("VMMIGRATE_BENCH_DISK_MIB", 16);
    let rate_mib = env("VMMIGRATE_BENCH_RATE_MIB", 4).max(1);
    let cap = env("VMMIGRATE_BENCH_CAP", 1).max(1) as u32;
    let cluster = KubeEnv::shared();
    let image = cluster.controller_image().expect("the release image");
    let node_ip = cluster.node.as_ref().expect("a node").host_ip;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let client: Client = cluster.client().await;
        let ns = format!("pods-bench-{}", std::process::id());
        let namespace: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
        Api::all(client.clone()).create(&PostParams::default(), &namespace).await.expect("namespace");

        let emulators: Vec<EsxiEmulator> = (0..hosts)
            .map(|_| {
                let emu = EsxiEmulator::start(EsxiOptions {
                    also_listen: Some(node_ip),
                    fleet: Some((per_host, disk_mib)),
                    ..Default::default()
                })
                .expect("ESXi emulator");
                emu.set_read_rate(Some(rate_mib << 20));
                emu
            })
            .collect();
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        for (h, emu) in emulators.iter().enumerate() {
            let secret: Secret = serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("esxi-{h}")},
                "stringData": {"username": emu.username, "password": emu.password},
            }))
            .unwrap();
            secrets.create(&PostParams::default(), &secret).await.expect("credentials");
        }

        let work = tempfile::tempdir().expect("work dir");
        let opts = ControllerOptions {
            namespace: Some(ns.clone()),
            work_dir: work.path().to_path_buf(),
            staging_listen: std::net::SocketAddr::new(node_ip.into(), 0),
            staging_url: None,
            conversions: 2,
            guest_conversion_tcg: false,
            copy_streams: 1,
            job_image: Some(image),
            job_namespace: None,
            work_claim: None,
            instance: "pods-bench".into(),
            leader_election: service::LeaderElectionOptions { lease_namespace: ns.clone(), ..Default::default() },
            destination_rules: Default::default(),
            max_reads_per_host: cap,
            host_reads: Vec::new(),
            max_reads: None,
            data_plane: DataPlane::Pods,
            worker_cpu: "100m".into(),
            worker_memory: "64Mi".into(),
            worker_memory_limit: "512Mi".into(),
            worker_guest_memory_limit: "3Gi".into(),
            job_guest_memory_limit: "4Gi".into(),
        import_method: service::ImportMethod::Cdi,
            worker_storage_class: Some("local-path".into()),
        };
        let metrics = Arc::new(Metrics::new());
        let staging = service::start_staging(&opts, &metrics).await.expect("staging server");
        let adapters = service::adapters(client.clone(), &opts, &staging, &metrics).expect("adapters");
        let _sims = vmmigrate_harness::kubevirt_sim::start(client.clone(), &ns);
        let config = ControllerConfig {
            namespace: Some(ns.clone()),
            instance: "pods-bench".into(),
            metrics: metrics.clone(),
            limits: opts.limits(),
            ..Default::default()
        };
        let controller = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));

        let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
        let started = Instant::now();
        for (h, emu) in emulators.iter().enumerate() {
            for v in 1..=per_host {
                let vm = format!("vm-{v:03}");
                let body = serde_json::json!({
                    "apiVersion": "migration.platform.example/v1alpha1",
                    "kind": "VirtualMachineMigration",
                    "metadata": {"name": format!("h{h}-{vm}"), "namespace": ns},
                    "spec": {
                        "source": {"host": node_ip.to_string(), "port": emu.port,
                                   "hostKey": emu.host_key_fingerprint(),
                                   "credentialsSecretRef": {"name": format!("esxi-{h}")}, "vm": {"name": vm}},
                        "destination": {"namespace": ns, "storageClassName": "local-path"},
                        "networkMap": [{"source": "VM Network", "type": "Pod"}],
                        "conversion": {"guest": "none"},
                        "strategy": {"timeouts": {"sshSeconds": 30}},
                    }
                });
                let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
                api.create(&PostParams::default(), &vmm).await.expect("create migration");
            }
        }

        let total = hosts * per_host;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let workers = ListParams::default().labels("migration.platform.example/role=worker");
        let mut preparing: BTreeMap<String, (Option<Instant>, Option<Instant>)> = BTreeMap::new();
        let (mut most_pods, mut peak_one, mut peak_all) = (0usize, 0f64, 0f64);
        let deadline = started + Duration::from_secs(1800);
        let done = loop {
            let list = api.list(&ListParams::default()).await.expect("list migrations");
            let now = Instant::now();
            let mut completed = 0;
            for vmm in &list.items {
                let phase = vmm.status.as_ref().map(|s| s.phase).unwrap_or_default();
                let entry = preparing.entry(vmm.name_any()).or_default();
                if phase == Phase::Preparing && entry.0.is_none() {
                    entry.0 = Some(now);
                }
                if entry.0.is_some() && entry.1.is_none() && !matches!(phase, Phase::Preparing | Phase::Validated) {
                    entry.1 = Some(now);
                }
                assert!(
                    !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired),
                    "{} stopped in {phase}: {:#?}",
                    vmm.name_any(),
                    vmm.status
                );
                completed += usize::from(phase == Phase::Completed);
            }
            let running = pods.list(&workers).await.map(|l| l.items.len()).unwrap_or(0);
            most_pods = most_pods.max(running);
            let rss = worker_rss(cluster);
            peak_one = rss.iter().copied().fold(peak_one, f64::max);
            peak_all = peak_all.max(rss.iter().sum());
            if completed == total {
                break now - started;
            }
            assert!(now < deadline, "{completed} of {total} Completed after 30 minutes");
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        controller.abort();

        let copy = disk_mib as f64 / rate_mib as f64;
        let rounds = per_host.div_ceil(cap as usize) as f64;
        let ideal = rounds * copy;
        let mut in_preparing: Vec<f64> = preparing
            .values()
            .filter_map(|(from, to)| Some(to.as_ref()?.duration_since(*from.as_ref()?).as_secs_f64()))
            .collect();
        in_preparing.sort_by(f64::total_cmp);
        let median = in_preparing.get(in_preparing.len() / 2).copied().unwrap_or(0.0);
        println!("worker pods: {total} VMs from {hosts} hosts ({per_host} each), one {disk_mib} MiB disk each at {rate_mib} MiB/s, cap {cap}");
        println!("  create to the last Completed           {:>8.1} s", done.as_secs_f64());
        println!("  ideal of the copies alone (caps)       {ideal:>8.1} s ({rounds} rounds of {copy:.1} s per host)");
        println!("  ratio                                  {:>8.2}x", done.as_secs_f64() / ideal);
        println!(
            "  time in Preparing per migration        median {median:.1} s, min {:.1} s, max {:.1} s (a copy alone: {copy:.1} s)",
            in_preparing.first().copied().unwrap_or(0.0),
            in_preparing.last().copied().unwrap_or(0.0)
        );
        println!("  worker pods at once, most              {most_pods:>8}");
        println!("  peak RSS of one worker process         {peak_one:>8.1} MiB");
        println!("  peak RSS of all worker processes       {peak_all:>8.1} MiB");
        println!("  peak RSS of the controller's process   {:>8.1} MiB", self_hwm_mib());
        let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .delete(&ns, &Default::default())
            .await;
        drop(staging);
    });
}
