//! Benchmark (not a test): the downtime a user sees, from the status
//! recording the source powered off to every check passing (`GuestReady`),
//! and the whole migration (create → Completed), for a real guest on real
//! CDI and real KubeVirt, cold and warm, beside what the bytes and the boot
//! cost alone in the same run: one bare `ssh host cat` of the disks, and the
//! same guest booted to ready under plain QEMU.
//!
//! The guest is `app-bios` of `tools/guest/build.sh` (BIOS, its own disk
//! of 20 MiB) with a second disk of `VMMIGRATE_BENCH_MIB` MiB holding an
//! ext4 file system filled to 90 % with incompressible data. While the
//! source runs, a guest writer changes 4 KiB blocks of that data disk at a
//! rate meant to change about 5 % of its blocks during one read of the disk,
//! and stops once it wrote as many blocks as 5 % of the disk holds (the
//! table says what it changed, and what was read after the power-off).
//! Above the smallest size, a third mode (`Warm, same bytes`) is warm with
//! the writer stopped at the smallest size's count of blocks: the changed
//! bytes of issue 37's ratio, warm downtime at 4 GiB against 1 GiB "with the
//! same changed bytes".
//! The source is powered on before each run and shut down by the migration
//! (`GracefulThenForce`). Each mode runs with each import method: CDI's
//! importer (`--import-method cdi`) and a blank DataVolume that a Job of the
//! release image fills (`fill`).
//!
//!   cargo bench --bench downtime                       # 1024 and 4096 MiB, one run of each mode
//!   VMMIGRATE_BENCH_MIB=1024 VMMIGRATE_BENCH_REPEAT=3 cargo bench --bench downtime
//!   VMMIGRATE_BENCH_RATE_MIB=100 ...                   # the host serves each read at 100 MiB/s
//!   VMMIGRATE_BENCH_TRACE=1 ...                        # every phase change seen, with its time
//!   VMMIGRATE_BENCH_IMPORT=fill ...                    # one import method (default: cdi,fill)
//!
//! The real controller (release build, the in-process data plane, the
//! controller's default requeue) runs in this process against the test
//! cluster's real API server; importer pods reach its staging server on the
//! host end of the node's network. The phases are seen through a watch on
//! the migration. Each run has a namespace of its own, deleted (the VM
//! with it) before the next run. A run stops the benchmark unless it
//! reaches Completed with every copy checked against the host's own sha256.
//! Beside the times: the peak RSS of this process during each run (the
//! controller) and of the fill Jobs' `fill-volume` processes on the node.
//! Needs root and the cluster's build (as `cargo test` does).

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::controller::service::{self, ControllerOptions, DataPlane, ImportMethod};
use vmmigrate::metrics::Metrics;
use vmmigrate_harness::KubeEnv;
use vmmigrate_harness::esxi_emulator::{EsxiEmulator, EsxiOptions};
use vmmigrate_harness::esxi_snapshots::GuestWrites;
use vmmigrate_harness::qemu_guest::{Boot, Hardware, QemuGuest};

const VMID: &str = "8";
/// Warm, with as many blocks changed as at the smallest size.
const SAME_BYTES: &str = "Warm, same bytes";
const VM: &str = "app-bios";
/// The guest's line on its serial console once its address, web server
/// and agent are up.
const READY: &str = "vmmigrate-guest: ready";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// An ext4 file system of `mib` MiB, 90 % of it one file of pseudo-random
/// bytes (xorshift: nothing compresses it, nothing is a hole).
fn data_disk(dir: &Path, mib: u64) -> PathBuf {
    let content = dir.join("content");
    std::fs::create_dir_all(&content).unwrap();
    let mut file = std::io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(content.join("payload.bin")).expect("payload"),
    );
    let mut state: u64 = 0x2545_f491_4f6c_dd1d ^ mib;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..(mib * 9 / 10) {
        for word in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        file.write_all(&block).unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();
    let image = dir.join("data.img");
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "benchdata", "-d"])
        .arg(&content)
        .arg(&image)
        .arg(format!("{mib}M"))
        .output()
        .expect("mkfs.ext4");
    assert!(out.status.success(), "mkfs.ext4: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&content).unwrap();
    image
}

/// One bare `ssh host cat` of every disk of the guest, to `/dev/null`: seconds.
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

/// The guest's disks booted under plain QEMU (TCG, virtio, as KubeVirt
/// gives them): seconds until its console says it is ready (its init says
/// so once its address is leased and its web server and agent run).
fn plain_qemu_boot(disks: &[PathBuf]) -> f64 {
    let started = Instant::now();
    let guest = QemuGuest::boot(&Boot {
        name: "downtime-baseline",
        disks,
        efi: false,
        hardware: Hardware::Virtio,
        mac: "00:0c:29:aa:bb:08",
        memory_mib: 256,
    })
    .expect("qemu");
    guest.wait_for_console(&[READY], Duration::from_secs(300)).expect("the guest boots under QEMU");
    started.elapsed().as_secs_f64()
}

/// When a migration got where, in seconds after its creation.
#[derive(Default, Debug)]
struct Times {
    phases: BTreeMap<&'static str, f64>,
    powered_off: Option<f64>,
    /// The guest's own page first answered through its Service (the `http`
    /// check passed): the service is back for its users.
    page_answered: Option<f64>,
    guest_ready: Option<f64>,
    completed: f64,
    /// Peak RSS of this process during the run (the controller, with the
    /// in-process data plane and staging server, and the bench's own
    /// bookkeeping), MiB.
    controller_mib: f64,
    /// This process's RSS when the run began (what the peak grew from), MiB.
    start_mib: f64,
    /// Peak RSS of the `vmmigrate fill-volume` processes (the fill Jobs'
    /// pods on the node), sampled every 200 ms, MiB; 0 if none ran.
    fill_mib: f64,
}

impl Times {
    fn at(&self, phase: &str) -> f64 {
        *self.phases.get(phase).unwrap_or_else(|| panic!("{phase} was never seen: {self:?}"))
    }
}

/// The highest peak RSS (`VmHWM`, MiB) of the node's `vmmigrate fill-volume`
/// processes, sampled until the task is aborted.
async fn sample_fill_rss(cluster: &'static KubeEnv, peak: Arc<std::sync::Mutex<f64>>) {
    let node = cluster.node.as_ref().expect("the cluster has a node");
    let scan = move || {
        let kib = |pid| vmmigrate_harness::process::status_kib(pid, "VmHWM");
        node.vmmigrate_processes("fill-volume").into_iter().map(kib).max().unwrap_or(0) as f64 / 1024.0
    };
    loop {
        let highest = tokio::task::spawn_blocking(scan).await.unwrap_or(0.0);
        {
            let mut peak = peak.lock().unwrap();
            *peak = peak.max(highest);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Migrates `app-bios` of `emu` in `mode` (`Cold` or `Warm`) to Completed,
/// its disks imported by `method`.
async fn migrate(
    client: &kube::Client,
    cluster: &'static KubeEnv,
    emu: &EsxiEmulator,
    run: &str,
    mode: &str,
    method: ImportMethod,
) -> Times {
    let node_ip = cluster.node.as_ref().expect("the cluster has a node").host_ip;
    let ns = format!("downtime-{}-{run}", std::process::id());
    let namespace: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.create(&PostParams::default(), &namespace).await.expect("namespace");
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "esxi", "annotations": {
            vmmigrate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION:
                format!("127.0.0.1={}", emu.host_key_fingerprint())}},
        "stringData": {"username": emu.username, "password": emu.password},
    }))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), &ns).create(&PostParams::default(), &secret).await.unwrap();
    // The guest's page, behind a Service on its launcher pod.
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"kubevirt.io/domain": VM},
                 "ports": [{"name": "http", "port": 80, "targetPort": 80}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), &ns).create(&PostParams::default(), &web).await.unwrap();

    let work = tempfile::tempdir_in("/var/tmp").expect("work dir");
    let opts = ControllerOptions {
        namespace: Some(ns.clone()),
        work_dir: work.path().to_path_buf(),
        staging_listen: std::net::SocketAddr::new(node_ip.into(), 0),
        staging_url: None,
        conversions: 2,
        guest_conversion_tcg: true,
        copy_streams: 1,
        // The fill Jobs' image (and the verify Job's).
        job_image: Some(cluster.controller_image().expect("the release image")),
        job_namespace: None,
        work_claim: None,
        instance: "downtime".into(),
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
        import_method: method,
        worker_storage_class: None,
    };
    let metrics = Arc::new(Metrics::new());
    let staging = service::start_staging(&opts, &metrics).await.expect("staging server");
    let adapters = service::adapters(client.clone(), &opts, &staging, &metrics).expect("adapters");
    let config = ControllerConfig {
        namespace: Some(ns.clone()),
        instance: "downtime".into(),
        metrics: metrics.clone(),
        ..Default::default()
    };
    // This process's peak RSS from here on (Linux: 5 resets VmHWM).
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak RSS");
    let start_mib = vmmigrate_harness::process::status_kib(std::process::id(), "VmRSS") as f64 / 1024.0;
    let fill_peak = Arc::new(std::sync::Mutex::new(0.0));
    let sampler = tokio::spawn(sample_fill_rss(cluster, fill_peak.clone()));
    let controller = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));

    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let mut events = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
    let page = serde_json::json!({"service": "web", "port": 80, "path": "/", "expectedStatus": 200,
                                  "bodyContains": format!("vmmigrate-guest {VM}")});
    let body = serde_json::json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": {"name": VM, "namespace": ns},
        "spec": {
            "source": {"host": "127.0.0.1", "port": emu.port, "hostKey": emu.host_key_fingerprint(),
                       "credentialsSecretRef": {"name": "esxi"}, "vm": {"name": VM}},
            "destination": {"namespace": ns, "storageClassName": "local-path"},
            "networkMap": [{"source": "VM Network", "type": "Pod"}],
            // Built to boot anywhere (virtio, DHCP): nothing to convert.
            "conversion": {"guest": "none"},
            "powerOffPolicy": "GracefulThenForce",
            "mode": mode,
            "validation": {"checks": [
                {"name": "status-page", "http": page},
                {"name": "agent", "guestAgent": {}},
                {"name": "address", "ip": {}}
            ]}
        }
    });
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    let started = Instant::now();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
    let mut times = Times { start_mib, ..Times::default() };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1800);
    loop {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("Completed within 30 minutes")
            .expect("watch ended");
        let Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) = event else { continue };
        let status = object.status.unwrap_or_default();
        let at = started.elapsed().as_secs_f64();
        if status.timestamps.source_powered_off.is_some() {
            times.powered_off.get_or_insert(at);
        }
        if status.validation_results.iter().any(|r| r.name == "status-page" && r.passed) {
            times.page_answered.get_or_insert(at);
        }
        if status.conditions.iter().any(|c| {
            c.type_ == vmmigrate::api::condition::GUEST_READY
                && c.status == vmmigrate::api::ConditionStatus::True
        }) {
            times.guest_ready.get_or_insert(at);
        }
        if std::env::var_os("VMMIGRATE_BENCH_TRACE").is_some() {
            // Which checks pass, to see which one the downtime waits for.
            let checks: Vec<String> = status
                .validation_results
                .iter()
                .map(|r| format!("{} {}: {}", r.name, if r.passed { "passed" } else { "not yet" }, r.message))
                .collect();
            eprintln!("{at:8.2} s {run} {} {checks:?}", status.phase);
        }
        times.phases.entry(status.phase.as_str()).or_insert(at);
        match status.phase {
            Phase::Completed => {
                assert!(
                    status.disks.iter().all(|d| d.source_verified_remotely == Some(true)),
                    "every copy verified by the host's own sha256: {:?}",
                    status.disks
                );
                times.completed = at;
                times.controller_mib =
                    vmmigrate_harness::process::status_kib(std::process::id(), "VmHWM") as f64 / 1024.0;
                sampler.abort();
                times.fill_mib = *fill_peak.lock().unwrap();
                break;
            }
            Phase::Failed | Phase::ManualInterventionRequired | Phase::Retryable => {
                panic!("the migration stopped in {}: {:#?}", status.phase, status.conditions)
            }
            _ => {}
        }
    }
    // The VM goes with its namespace before the next run, so that no guest
    // of an earlier run competes for the two cores. The migration goes first,
    // while its controller still runs to release it.
    let _ = api.delete(VM, &DeleteParams::default()).await;
    let gone = tokio::time::Instant::now() + Duration::from_secs(120);
    while api.get_opt(VM).await.ok().flatten().is_some() && tokio::time::Instant::now() < gone {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    controller.abort();
    let _ = controller.await;
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    let gone = tokio::time::Instant::now() + Duration::from_secs(300);
    while namespaces.get_opt(&ns).await.ok().flatten().is_some() {
        if tokio::time::Instant::now() > gone {
            eprintln!("namespace {ns} still there after 300 s; going on");
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    times
}

struct Row {
    mib: u64,
    method: &'static str,
    run: u64,
    mode: &'static str,
    times: Times,
    written: u64,
    read_after_off: u64,
}

fn main() {
    let sizes: Vec<u64> = std::env::var("VMMIGRATE_BENCH_MIB")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .filter(|v: &Vec<u64>| !v.is_empty())
        .unwrap_or_else(|| vec![1024, 4096]);
    let repeat = env_u64("VMMIGRATE_BENCH_REPEAT", 1).max(1);
    let rate_mib = env_u64("VMMIGRATE_BENCH_RATE_MIB", 0);
    let methods: Vec<(&'static str, ImportMethod)> = std::env::var("VMMIGRATE_BENCH_IMPORT")
        .unwrap_or_else(|_| "cdi,fill".into())
        .split(',')
        .filter_map(|m| match m.trim() {
            "cdi" => Some(("cdi", ImportMethod::Cdi)),
            "fill" => Some(("fill", ImportMethod::Fill)),
            _ => None,
        })
        .collect();
    let cluster = KubeEnv::shared_kubevirt();
    let guests = vmmigrate_harness::setup::guest_images().expect("guest images");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();

    let mut rows = Vec::new();
    let mut baselines = Vec::new();
    // 5 % of the 4 KiB blocks of a data disk of `mib` MiB.
    let five_percent = |mib: u64| (mib << 20) / 4096 / 20;
    let smallest = sizes.iter().min().copied().unwrap_or_default();
    for &mib in &sizes {
        let dir = tempfile::tempdir_in("/var/tmp").expect("scratch");
        let made = Instant::now();
        let data = data_disk(dir.path(), mib);
        eprintln!("data disk of {mib} MiB made in {:.1} s", made.elapsed().as_secs_f64());
        let emu = EsxiEmulator::start(EsxiOptions {
            guests: Some(guests.clone()),
            guest_data_disk: Some(data.clone()),
            ..Default::default()
        })
        .expect("ESXi emulator");
        if rate_mib > 0 {
            emu.set_read_rate(Some(rate_mib << 20));
        }
        let cat = bare_ssh_cat(&emu);
        let boot = plain_qemu_boot(&[guests.join("bios.img"), data.clone()]);
        baselines.push((mib, cat, boot));
        // A budget of blocks written during one read of the disk (the bare
        // `cat` just measured) and the snapshot and look around it; then the
        // writer stops, whatever the mode makes the source run for (warm runs
        // it longer: its bases are also filled into the volumes before the
        // cutover). 5 % of this disk's blocks, or, for the same changed
        // bytes, of the smallest disk's.
        let writes = |budget: u64| GuestWrites {
            blocks_per_second: (budget as f64 / (cat * 1.3 + 2.0)).ceil() as u32,
            only_disk: Some(1),
            at_most: Some(budget),
            ..Default::default()
        };
        let modes: &[&'static str] =
            if mib > smallest { &["Cold", "Warm", SAME_BYTES] } else { &["Cold", "Warm"] };
        runtime.block_on(async {
            let client = cluster.client().await;
            for run in 1..=repeat {
                for (mode, (method_name, method)) in
                    methods.iter().flat_map(|m| modes.iter().map(move |mode| (*mode, *m)))
                {
                    emu.set_power(VMID, true);
                    let before = emu.guest_blocks_written();
                    let budget = five_percent(if mode == SAME_BYTES { smallest } else { mib });
                    let writer = emu.start_guest_writes(VMID, GuestWrites { seed: run, ..writes(budget) });
                    let label = if mode == SAME_BYTES { "same".to_owned() } else { mode.to_lowercase() };
                    let name = format!("{mib}-{method_name}-{label}-{run}");
                    let spec_mode = if mode == SAME_BYTES { "Warm" } else { mode };
                    let times = migrate(&client, cluster, &emu, &name, spec_mode, method).await;
                    drop(writer);
                    let written = emu.guest_blocks_written() - before;
                    let read_after_off: u64 =
                        emu.disk_reads_after_power_off(VMID).iter().map(|r| r.delivered).sum();
                    rows.push(Row { mib, method: method_name, run, mode, times, written, read_after_off });
                }
            }
        });
    }

    println!("\nbaselines (same run): the guest's disks (20 MiB + the data disk)");
    println!("| data disk | bare `ssh cat` of both disks | plain QEMU boot to ready | sum |");
    println!("|---:|---:|---:|---:|");
    for (mib, cat, boot) in &baselines {
        println!("| {mib} MiB | {cat:.2} s | {boot:.2} s | {:.2} s |", cat + boot);
    }
    println!("\ndowntime (power-off → GuestReady) and its parts, seconds");
    println!(
        "| data disk | import | run | mode | before the power-off | copy or delta | conversion, staging | import | VM creation | start → running | checks pass | **downtime** | page answers (downtime) | create → Completed | guest blocks written while on | bytes read after the power-off | peak RSS: controller (at the start) | fill Job |"
    );
    println!("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let t = &r.times;
        let off = t.powered_off.expect("the source was powered off");
        let ready = t.guest_ready.unwrap_or(t.completed);
        let blocks = (r.mib << 20) / 4096;
        println!(
            "| {} MiB | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | **{:.2}** | {:.2} | {:.2} | {} ({:.1} %) | {:.1} MiB | {:.0} MiB ({:.0} MiB) | {:.0} MiB |",
            r.mib,
            r.method,
            r.run,
            r.mode,
            off,
            t.at("Converting") - off,
            t.at("Importing") - t.at("Converting"),
            t.at("CreatingVM") - t.at("Importing"),
            t.at("Starting") - t.at("CreatingVM"),
            t.at("Validating") - t.at("Starting"),
            ready - t.at("Validating"),
            ready - off,
            t.page_answered.unwrap_or(ready) - off,
            t.completed,
            r.written,
            r.written as f64 / blocks as f64 * 100.0,
            r.read_after_off as f64 / (1 << 20) as f64,
            t.controller_mib,
            t.start_mib,
            t.fill_mib,
        );
    }
    let median = |mib: u64, method: &str, mode: &str, f: &dyn Fn(&Row) -> f64| {
        let mut v: Vec<f64> =
            rows.iter().filter(|r| r.mib == mib && r.method == method && r.mode == mode).map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let downtime = |r: &Row| r.times.guest_ready.unwrap_or(r.times.completed) - r.times.powered_off.unwrap();
    let page = |r: &Row| {
        r.times.page_answered.or(r.times.guest_ready).unwrap_or(r.times.completed)
            - r.times.powered_off.unwrap()
    };
    println!(
        "\n| data disk | import | cold downtime | warm downtime | warm / cold | to the page: cold | warm | warm / cold | cold create → Completed | ÷ (ssh cat + boot) |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (mib, cat, boot) in &baselines {
        for (method, _) in &methods {
            let (cold, warm) =
                (median(*mib, method, "Cold", &downtime), median(*mib, method, "Warm", &downtime));
            let (cold_page, warm_page) =
                (median(*mib, method, "Cold", &page), median(*mib, method, "Warm", &page));
            let total = median(*mib, method, "Cold", &|r: &Row| r.times.completed);
            println!(
                "| {mib} MiB | {method} | {cold:.2} s | {warm:.2} s | {:.0} % | {cold_page:.2} s | {warm_page:.2} s | {:.0} % | {total:.2} s | {:.2}× |",
                warm / cold * 100.0,
                warm_page / cold_page * 100.0,
                total / (cat + boot)
            );
        }
    }
    // Issue 37's second ratio: warm downtime at a larger disk against the
    // smallest, with 5 % of each disk changed and with the same changed bytes.
    let larger: Vec<u64> = sizes.iter().copied().filter(|&m| m > smallest).collect();
    if !larger.is_empty() {
        println!("\nwarm downtime against the {smallest} MiB disk's (to GuestReady; to the page)");
        println!("| data disk | import | 5 % of each disk changed | the same changed bytes |");
        println!("|---:|---|---:|---:|");
        for &mib in &larger {
            for (method, _) in &methods {
                let base = median(smallest, method, "Warm", &downtime);
                let base_page = median(smallest, method, "Warm", &page);
                let ratio = |mode: &str| {
                    format!(
                        "{:.2}× ; {:.2}×",
                        median(mib, method, mode, &downtime) / base,
                        median(mib, method, mode, &page) / base_page
                    )
                };
                println!("| {mib} MiB | {method} | {} | {} |", ratio("Warm"), ratio(SAME_BYTES));
            }
        }
    }
}
