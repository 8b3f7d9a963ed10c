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
//! Then the downtime of a warm migration against a cold one
//! (`spec.mode: Warm` / `Cold`): one 1 GiB disk served at a host's stream
//! rate (`VMMIGRATE_BENCH_RATE_MIB`, 100 MiB/s by default; 0: as fast as
//! this machine goes), a running guest changing about 5 % of its blocks
//! during the time one read of the disk takes, the downtime measured from
//! the status recording the source powered off to the migration entering
//! Importing.
//!
//!   cargo bench --bench cold_path                 # 640 + 384 MiB, 3 runs; then downtime, 3 runs each
//!   VMMIGRATE_BENCH_TRACE=1 ...                   # every status change seen, with its time
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

/// When a migration got where, in seconds after its creation.
struct Times {
    preparing: f64,
    converting: f64,
    importing: f64,
    /// When the status first recorded the source powered off.
    powered_off: Option<f64>,
}

/// Migrates VM `pair` of `emu` in `mode` (`Cold` or `Warm`) up to Importing.
async fn migrate(client: &kube::Client, emu: &EsxiEmulator, run: &str, mode: &str) -> Times {
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
        guest_conversion_tcg: false,
        copy_streams: 1,
        job_image: None,
        job_namespace: None,
        work_claim: None,
        instance: "cold-path".into(),
        leader_election: service::LeaderElectionOptions { lease_namespace: ns.clone(), ..Default::default() },
        destination_rules: Default::default(),
        max_reads_per_host: 2,
        host_reads: Vec::new(),
        max_reads: None,
        data_plane: DataPlane::Process,
        worker_cpu: "100m".into(),
        worker_memory: "64Mi".into(),
        worker_memory_limit: "512Mi".into(),
        worker_guest_memory_limit: "3Gi".into(),
        job_guest_memory_limit: "4Gi".into(),
        import_method: service::ImportMethod::Cdi,
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
            // Patterned disks, not guests: the data path alone is measured.
            "conversion": {"guest": "none"},
            "powerOffPolicy": "GracefulThenForce",
            "mode": mode,
        }
    });
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    let started = Instant::now();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
    let (mut preparing, mut converting, mut powered_off) = (None, None, None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let importing = loop {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("Importing within 10 minutes")
            .expect("watch ended");
        let Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) = event else { continue };
        let status = object.status.unwrap_or_default();
        let at = started.elapsed().as_secs_f64();
        if status.timestamps.source_powered_off.is_some() {
            powered_off.get_or_insert(at);
        }
        if std::env::var_os("VMMIGRATE_BENCH_TRACE").is_some() {
            let acquired =
                status.conditions.iter().find(|c| c.type_ == "DiskAcquired").map(|c| c.reason.clone());
            eprintln!("{at:7.2} s {run} {} {acquired:?}", status.phase);
        }
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
    Times { preparing, converting: converting.unwrap_or(importing), importing, powered_off }
}

fn main() {
    let sizes: Vec<u64> = std::env::var("VMMIGRATE_BENCH_MIB")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .filter(|v: &Vec<u64>| v.len() == 2)
        .unwrap_or_else(|| vec![640, 384]);
    let repeat: usize =
        std::env::var("VMMIGRATE_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let rate_mib: u64 =
        std::env::var("VMMIGRATE_BENCH_RATE_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let cluster = KubeEnv::shared();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();

    // 1. The cold data path beside `ssh cat`, the source off before the run.
    let emu =
        EsxiEmulator::start(EsxiOptions { pair_disk_mib: Some((sizes[0], sizes[1])), ..Default::default() })
            .expect("ESXi emulator");
    let mut rows = Vec::new();
    runtime.block_on(async {
        let client = cluster.client().await;
        for run in 1..=repeat {
            emu.set_power(VMID, false);
            let t = migrate(&client, &emu, &format!("cold-{run}"), "Cold").await;
            let cat = bare_ssh_cat(&emu);
            rows.push((
                run,
                t.importing - t.preparing,
                t.converting - t.preparing,
                t.importing - t.converting,
                cat,
            ));
        }
    });
    drop(emu);
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

    // 2. Downtime, warm against cold: one 1 GiB disk served at a host's
    // stream rate, a guest changing about 5 % of its blocks during the copy.
    let emu = EsxiEmulator::start(EsxiOptions { pair_disk_mib: Some((1024, 0)), ..Default::default() })
        .expect("ESXi emulator");
    if rate_mib > 0 {
        emu.set_read_rate(Some(rate_mib << 20));
    }
    let disk_blocks = (1024u64 << 20) / 4096;
    // About 5 % of the blocks while the VM runs: the time one read of the
    // disk takes at the rate, and the 30 % more that a warm migration's base
    // copy was measured to take (its host hash, the look after it, the
    // shutdown). The table says how many blocks were written.
    let copy_seconds = if rate_mib > 0 { 1024.0 / rate_mib as f64 * 1.3 } else { 2.0 };
    let blocks_per_second = ((disk_blocks as f64 * 0.05) / copy_seconds).ceil() as u32;
    let mut downtime = Vec::new();
    runtime.block_on(async {
        let client = cluster.client().await;
        for run in 1..=repeat {
            for mode in ["Cold", "Warm"] {
                emu.set_power(VMID, true);
                let before = emu.guest_blocks_written();
                let writer = emu.start_guest_writes(
                    VMID,
                    vmmigrate_harness::esxi_snapshots::GuestWrites {
                        blocks_per_second,
                        seed: run as u64,
                        ..Default::default()
                    },
                );
                let t = migrate(&client, &emu, &format!("down-{}-{run}", mode.to_lowercase()), mode).await;
                drop(writer);
                let written = emu.guest_blocks_written() - before;
                let off = t.powered_off.expect("the source was powered off");
                downtime.push((run, mode, t.importing - off, t.importing, written));
            }
        }
    });
    println!(
        "\ndowntime: one 1024 MiB disk read at {} MiB/s, a guest writing {blocks_per_second} blocks of 4 KiB per second while on",
        if rate_mib > 0 { rate_mib.to_string() } else { "full speed".into() }
    );
    println!(
        "| run | mode | power-off → Importing (downtime) | create → Importing | guest blocks written while on (of {disk_blocks}) |"
    );
    println!("|---|---|---:|---:|---:|");
    for (run, mode, down, total, written) in &downtime {
        println!(
            "| {run} | {mode} | {down:.2} s | {total:.2} s | {written} ({:.1} %) |",
            *written as f64 / disk_blocks as f64 * 100.0
        );
    }
    let median = |mode: &str| {
        let mut v: Vec<f64> = downtime.iter().filter(|d| d.1 == mode).map(|d| d.2).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median downtime: cold {:.2} s, warm {:.2} s: warm is {:.0} % of cold",
        median("Cold"),
        median("Warm"),
        median("Warm") / median("Cold") * 100.0
    );
}
