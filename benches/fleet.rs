//! Benchmark (not a test): a fleet migrated through Git. One merge of
//! `VMS` manifests in `WAVES` waves, VMs spread over `HOSTS` ESXi hosts, at
//! most `CAP` disk reads per host; the real gitops loop (render, apply,
//! status branch on a real bare Git remote) and the real controller against
//! a real kube-apiserver. The ESXi hosts, the copies and the destination are
//! the in-memory fleet of `tests/support/fleet_sim.rs` (each disk copy takes
//! `COPY_SECONDS`; imports and boots are instant), so what is measured is the
//! orchestration: queueing, waves, API traffic, memory, Git commits.
//!
//!   cargo bench --bench fleet                    # 1000 VMs, 50 hosts, 10 waves, cap 2, 30 s copies
//!   VMMIGRATE_BENCH_VMS=200 VMMIGRATE_BENCH_HOSTS=10 VMMIGRATE_BENCH_WAVES=2 \
//!   VMMIGRATE_BENCH_COPY_SECONDS=10 cargo bench --bench fleet
//!
//! Reported against the ideal the caps set (every wave as many copy rounds
//! as its busiest host needs, nothing else costing time): the total from
//! the push to the last Completed, the longest wait of any migration for a
//! read slot once its wave was open, the peak RSS and CPU time of the
//! controller's process (with the in-memory fleet: an upper bound of the
//! controller's) and of the gitops loop (`vmmigrate gitops`, a
//! process of its own as deployed), API requests per migration as the API
//! server counted them, the CPU time of the other processes (API server,
//! etcd, the gitops loop), the size of a migration object, and commits on the
//! status branch per coalescing window. Needs root and the cluster's build
//! (as `cargo test` does).
//!
//! `VMMIGRATE_BENCH_PPROF=<file>` saves the API server's CPU profile over the
//! first hand-off between waves (`go tool pprof -top <file>`);
//! `VMMIGRATE_BENCH_DUMP=1` prints one Completed migration.

// The tests use more of it than this benchmark does.
#[allow(dead_code)]
#[path = "../tests/support/fleet_sim.rs"]
mod fleet_sim;

use fleet_sim::FleetSim;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::machine::fleet::ReadCaps;
use vmmigrate_harness::KubeEnv;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Platform Team", "-c", "user.email=platform@example.test"])
        .args(["-c", "commit.gpgsign=false"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn manifest(ns: &str, name: &str, host: &str, wave: u64) -> String {
    format!(
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  wave:\n    plan: fleet\n    number: {wave}\n  source:\n    host: {host}\n    hostKey: SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s\n    credentialsSecretRef:\n      name: esxi\n    vm:\n      name: {name}\n  destination:\n    namespace: {ns}\n    storageClassName: local-path\n  networkMap:\n  - source: VM Network\n    type: Pod\n  conversion:\n    guest: none\n  validation:\n    checks:\n    - name: agent\n      guestAgent: {{}}\n"
    )
}

/// `(sum of apiserver_request_total for VirtualMachineMigrations, for Events,
/// VirtualMachineMigrations by verb and subresource)`.
async fn api_requests(client: &Client) -> (f64, f64, std::collections::BTreeMap<String, f64>) {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .expect("API server metrics");
    let mut sums = (0.0, 0.0, std::collections::BTreeMap::new());
    let label = |line: &str, key: &str| {
        line.split(&format!("{key}=\""))
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or("")
            .to_owned()
    };
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let value: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        if line.contains("resource=\"virtualmachinemigrations\"") {
            sums.0 += value;
            let key = format!("{} {}", label(line, "verb"), label(line, "subresource"));
            *sums.2.entry(key.trim().to_owned()).or_insert(0.0) += value;
        } else if line.contains("resource=\"events\"") {
            sums.1 += value;
        }
    }
    sums
}

/// `(VmHWM, VmRSS)` in MiB and CPU seconds of this process.
fn process_usage() -> (f64, f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15; `fields` starts at field 3.
    (kib("VmHWM:") / 1024.0, kib("VmRSS:") / 1024.0, (ticks(11) + ticks(12)) / 100.0)
}

/// CPU seconds (utime + stime) of every living descendant of this process, by command name.
fn descendants_cpu() -> std::collections::BTreeMap<String, f64> {
    let mut procs: Vec<(u32, u32, String, f64)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some((head, rest)) = stat.rsplit_once(')') else { continue };
        let comm = head.split_once('(').map(|(_, c)| c.to_owned()).unwrap_or_default();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // ppid is field 4, utime and stime 14 and 15; `fields` starts at field 3.
        procs.push((pid, num(1) as u32, comm, (num(11) + num(12)) / 100.0));
    }
    let mut ours = std::collections::HashSet::from([std::process::id()]);
    let mut grew = true;
    while grew {
        grew = false;
        for (pid, ppid, _, _) in &procs {
            if ours.contains(ppid) && ours.insert(*pid) {
                grew = true;
            }
        }
    }
    let mut by_name = std::collections::BTreeMap::new();
    for (pid, _, comm, cpu) in procs {
        if pid != std::process::id() && ours.contains(&pid) {
            *by_name.entry(comm).or_insert(0.0) += cpu;
        }
    }
    by_name
}

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let vms = env("VMMIGRATE_BENCH_VMS", 1000);
    let hosts = env("VMMIGRATE_BENCH_HOSTS", 50);
    let waves = env("VMMIGRATE_BENCH_WAVES", 10).max(1);
    let cap = env("VMMIGRATE_BENCH_CAP", 2) as u32;
    let copy = Duration::from_secs(env("VMMIGRATE_BENCH_COPY_SECONDS", 30));
    let window = env("VMMIGRATE_BENCH_STATUS_WINDOW", 10);
    let cluster = KubeEnv::start_owned(false).expect("API server");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let client = cluster.client().await;
        let ns = format!("fleet-bench-{}", std::process::id());
        let namespace: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
        Api::all(client.clone()).create(&PostParams::default(), &namespace).await.expect("namespace");

        // The repository: one commit adding every manifest, pushed to main.
        let dir = tempfile::tempdir().unwrap();
        let bare = dir.path().join("remote.git");
        let work = dir.path().join("work");
        git(dir.path(), &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()]);
        git(dir.path(), &["init", "-q", "-b", "main", work.to_str().unwrap()]);
        std::fs::write(work.join("README.md"), "# migrations\n").unwrap();
        git(&work, &["add", "."]);
        git(&work, &["commit", "-q", "-m", "start"]);
        git(&work, &["remote", "add", "origin", bare.to_str().unwrap()]);
        git(&work, &["push", "-q", "origin", "main"]);
        let per_wave = vms.div_ceil(waves);
        let mut busiest = vec![0u64; waves as usize];
        let mut per_host_in_wave: HashMap<(u64, u64), u64> = HashMap::new();
        for i in 0..vms {
            let wave = i / per_wave + 1;
            let host = i % hosts;
            let name = format!("vm-{i:04}");
            let path = work.join(format!("migrations/wave-{wave:02}/{name}.yaml"));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, manifest(&ns, &name, &format!("esx-{host:02}"), wave)).unwrap();
            let n = per_host_in_wave.entry((wave, host)).or_default();
            *n += 1;
            busiest[(wave - 1) as usize] = busiest[(wave - 1) as usize].max(*n);
        }
        let rounds: u64 = busiest.iter().map(|&b| b.div_ceil(cap as u64)).sum();
        let ideal = copy * rounds as u32;

        let sim = FleetSim::new(copy, 1);
        let config = ControllerConfig {
            namespace: Some(ns.clone()),
            instance: "fleet-bench".into(),
            limits: ReadCaps { per_host: cap, ..ReadCaps::default() },
            ..Default::default()
        };
        let metrics = config.metrics.clone();
        let controller = tokio::spawn(reconciler::run(client.clone(), sim.adapters(), config, std::future::pending()));
        // The gitops loop as it is deployed: a process of its own (`vmmigrate gitops`).
        let cache = tempfile::tempdir().unwrap();
        // `setpriv --pdeathsig`: it ends with this process, however that ends.
        let mut gitops = Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "--", env!("CARGO_BIN_EXE_vmmigrate")])
            .args(["gitops", "--repo", bare.to_str().unwrap(), "--branch", "main"])
            .args(["--cache-dir", cache.path().to_str().unwrap(), "--poll-seconds", "2"])
            .args(["--manifest-namespace", &ns, "--status-window-seconds", &window.to_string()])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .env("KUBECONFIG", cluster.kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("vmmigrate gitops");
        let requests_before = api_requests(&client).await;
        let (_, _, cpu_before) = process_usage();
        let others_before = descendants_cpu();

        // The merge.
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", &format!("Migrate {vms} VMs in {waves} waves")]);
        let pushed = Instant::now();
        let pushed_at = pushed;
        git(&work, &["push", "-q", "origin", "main"]);
        // VMMIGRATE_BENCH_PPROF=<file>: the API server's CPU profile over the first hand-off between waves.
        if let Ok(out) = std::env::var("VMMIGRATE_BENCH_PPROF") {
            let client = client.clone();
            tokio::spawn(async move {
                tokio::time::sleep(copy.saturating_sub(Duration::from_secs(2))).await;
                let request = http::Request::get("/debug/pprof/profile?seconds=12").body(Vec::new()).unwrap();
                match client.request_stream(request).await {
                    Ok(body) => {
                        use futures::AsyncReadExt;
                        let mut bytes = Vec::new();
                        let mut body = body;
                        let _ = body.read_to_end(&mut bytes).await;
                        let _ = std::fs::write(&out, bytes);
                    }
                    Err(e) => eprintln!("profile: {e}"),
                }
            });
        }

        // Progress from the controller's own metrics: watching costs the API server nothing more.
        let mut looks = 0u64;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            looks += 1;
            let text = metrics.encode();
            let done: f64 = text
                .lines()
                .find(|l| l.starts_with("vmmigrate_migrations{phase=\"Completed\"}"))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            if looks.is_multiple_of(40) {
                eprintln!("{:>5.0} s: {done} of {vms} Completed", pushed.elapsed().as_secs_f64());
            }
            if done as u64 == vms {
                break;
            }
            assert!(pushed.elapsed() < ideal * 4 + Duration::from_secs(600), "the fleet did not finish");
        }
        let total = pushed.elapsed();
        let (hwm, _, cpu_after) = process_usage();
        let others_after = descendants_cpu();
        let gitops_hwm = std::fs::read_to_string(format!("/proc/{}/status", gitops.id()))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0;
        let requests_after = api_requests(&client).await;
        let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
        let all = api.list(&ListParams::default()).await.expect("list").items;
        let object_bytes = all.iter().map(|v| serde_json::to_vec(v).map_or(0, |b| b.len())).sum::<usize>() / all.len().max(1);
        let status_bytes = all.iter().map(|v| serde_json::to_vec(&v.status).map_or(0, |b| b.len())).sum::<usize>() / all.len().max(1);
        if std::env::var_os("VMMIGRATE_BENCH_DUMP").is_some() {
            eprintln!("{}", serde_json::to_string_pretty(&all[0]).unwrap());
        }
        let managed_bytes = all.iter().map(|v| serde_json::to_vec(&v.metadata.managed_fields).map_or(0, |b| b.len())).sum::<usize>() / all.len().max(1);
        // Let the status branch catch up before counting its commits.
        tokio::time::sleep(Duration::from_secs(window + 3)).await;
        let status_commits: u64 = git(&bare, &["rev-list", "--count", "migration-status"]).parse().unwrap_or(0);
        // Commits are counted over the run and the window after it.
        let counted_over = pushed_at.elapsed();
        let _ = gitops.kill();
        let _ = gitops.wait();
        controller.abort();

        // Slot waits: from when a migration could go (validated, its wave open) to its copy.
        let entered = |v: &VirtualMachineMigration, p: Phase| {
            v.status.as_ref().and_then(|s| s.history.iter().find(|t| t.phase == p)).map(|t| t.time.0.as_second())
        };
        let mut wave_done: HashMap<i32, i64> = HashMap::new();
        for v in &all {
            let w = v.spec.wave.as_ref().map(|w| w.number).unwrap_or(0);
            let done = entered(v, Phase::Completed).unwrap_or(0);
            let e = wave_done.entry(w).or_default();
            *e = (*e).max(done);
        }
        let mut longest = (0i64, String::new());
        for v in &all {
            let w = v.spec.wave.as_ref().map(|w| w.number).unwrap_or(0);
            let open = wave_done.get(&(w - 1)).copied().unwrap_or(0);
            let ready = entered(v, Phase::Validated).unwrap_or(0).max(open);
            let wait = entered(v, Phase::Preparing).unwrap_or(0) - ready;
            if wait > longest.0 {
                longest = (wait, v.name_any());
            }
        }
        // Where the time beyond the copies went.
        let reads = sim.reads();
        let first_read = reads.iter().map(|r| r.start).min().map(|t| t - pushed_at).unwrap_or_default();
        let last_read_end = reads.iter().map(|r| r.end).max().map(|t| t - pushed_at).unwrap_or_default();
        let mut handoffs = Vec::new();
        let mut by_host: HashMap<&str, Vec<&fleet_sim::Read>> = HashMap::new();
        for r in &reads {
            by_host.entry(&r.host).or_default().push(r);
        }
        for list in by_host.values_mut() {
            list.sort_by_key(|r| r.start);
            // Each read's start after the earliest end of a read that was running before it.
            for (i, r) in list.iter().enumerate().skip(cap as usize) {
                let freed = list[..i].iter().map(|o| o.end).filter(|&e| e <= r.start).max();
                if let Some(freed) = freed {
                    handoffs.push((r.start - freed).as_secs_f64());
                }
            }
        }
        handoffs.sort_by(f64::total_cmp);
        let median_handoff = handoffs.get(handoffs.len() / 2).copied().unwrap_or(0.0);
        let (peak_reads, _) = sim.peak_reads();
        assert!(sim.power_offs().values().all(|&n| n == 1), "every source powered off exactly once");
        let max_host = peak_reads.values().copied().max().unwrap_or(0);
        let vmm_requests = requests_after.0 - requests_before.0;
        let event_requests = requests_after.1 - requests_before.1;
        let by_verb: Vec<String> = requests_after
            .2
            .iter()
            .map(|(k, v)| (k, v - requests_before.2.get(k).copied().unwrap_or(0.0)))
            .filter(|(_, v)| *v > 0.0)
            .map(|(k, v)| format!("{k} {:.1}", v / vms as f64))
            .collect();
        let windows = (counted_over.as_secs_f64() / window as f64).ceil();

        println!("\nfleet: {vms} VMs, {hosts} hosts, {waves} waves, cap {cap} reads per host, copy {} s", copy.as_secs());
        println!("| measure | value |");
        println!("|---|---|");
        println!("| ideal set by the caps ({rounds} copy rounds) | {:.0} s |", ideal.as_secs_f64());
        println!("| push to the last Completed | {:.1} s ({:.3}× the ideal) |", total.as_secs_f64(), total.as_secs_f64() / ideal.as_secs_f64());
        println!("| push to the first read (fetch, render, apply, discovery, validation) | {:.1} s |", first_read.as_secs_f64());
        println!("| a read slot freed to the next read on that host, median (within a wave and across waves) | {median_handoff:.1} s |");
        println!("| the last read's end to the last Completed | {:.1} s |", (total.saturating_sub(last_read_end)).as_secs_f64());
        println!("| longest wait for a read slot once its wave was open | {} s ({}) |", longest.0, longest.1);
        println!("| most reads seen at once on one host | {max_host} (cap {cap}) |");
        println!("| peak RSS of the controller's process (controller + the in-memory fleet) | {hwm:.1} MiB |");
        println!("| peak RSS of the gitops loop (`vmmigrate gitops`, its own process) | {gitops_hwm:.1} MiB |");
        println!("| CPU time of that process during the run | {:.1} s ({:.0} % of one core) |", cpu_after - cpu_before, (cpu_after - cpu_before) / total.as_secs_f64() * 100.0);
        let others: Vec<String> = others_after
            .iter()
            .map(|(name, cpu)| (name, cpu - others_before.get(name).copied().unwrap_or(0.0)))
            .filter(|(_, cpu)| *cpu >= 0.5)
            .map(|(name, cpu)| format!("{name} {cpu:.1} s"))
            .collect();
        println!("| CPU time of the other processes (API server, etcd, gitops loop) | {} |", others.join(", "));
        println!("| API requests on VirtualMachineMigrations per migration | {:.1} |", vmm_requests / vms as f64);
        println!("| the same by verb and subresource | {} |", by_verb.join(", "));
        println!("| a Completed migration as JSON, mean | {object_bytes} bytes ({status_bytes} of status, {managed_bytes} of managedFields) |");
        println!("| API requests on Events per migration | {:.1} |", event_requests / vms as f64);
        println!(
            "| status-branch commits, from the push to one window after the end | {status_commits} in {windows:.0} windows of {window} s ({:.2} per window) |",
            status_commits as f64 / windows
        );
        drop(cluster);
    });
}
