//! Benchmark (not a test): disk copy throughput from the ESXi emulator over
//! real SSH on loopback, ours against three baselines in the same run.
//!
//!   cargo bench --bench esxi_copy                  # 1024 MiB disk
//!   VMMIGRATE_BENCH_MIB=256 cargo bench --bench esxi_copy
//!   VMMIGRATE_BENCH_CHUNK_MIB=64 ...               # chunk size of our copy
//!   VMMIGRATE_BENCH_REPEAT=5 ...                   # runs per row (the median is shown)
//!
//! Rows: `ssh cat > /dev/null` (the transport's ceiling), `scp`, the shell way
//! of doing our work (`ssh cat | tee copy | sha256sum`), and vmmigrate's copy
//! (sha256 and write included) with 1 and 4 streams. Client CPU is the
//! client's own user+system time (for the shell rows: ssh, tee, sha256sum);
//! peak RSS is this process's own during the row (the shell rows' are
//! other processes'), to show that a copy's memory does not grow with the
//! disk.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};
use vmmigrate::source::esxi::copy::{self, CopyPlan};
use vmmigrate::source::esxi::ssh::{Credentials, Secret, Session, Target};
use vmmigrate_harness::esxi_emulator::{EsxiEmulator, EsxiOptions};
use vmmigrate_harness::process::{cpu_seconds, timed_shell as shell};

/// user+system CPU seconds of this process so far.
fn own_cpu() -> f64 {
    cpu_seconds(std::process::id())
}

struct Row {
    name: String,
    seconds: f64,
    cpu_seconds: f64,
    /// Peak resident memory of this process during the row, MiB.
    peak_rss_mib: Option<f64>,
}

/// Resets this process's peak resident set (`VmHWM`) to its current one.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// This process's peak resident set since the last reset, MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() {
    let mib: u64 = std::env::var("VMMIGRATE_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    let emu =
        EsxiEmulator::start(EsxiOptions { big_disk_mib: Some(mib), ..Default::default() }).expect("emulator");
    let (path, _, sha, size) = emu.disk_files("7").into_iter().next().expect("big disk");
    let work = tempfile::tempdir().expect("tempdir");
    let errors = work.path().join("stderr");
    let ssh_opts = format!(
        "-F /dev/null -p {} -i {} -o UserKnownHostsFile={} -o StrictHostKeyChecking=yes -o BatchMode=yes",
        emu.port,
        emu.rsa_key_path().display(),
        emu.known_hosts_path().display()
    );
    let remote = format!("{}@127.0.0.1", emu.username);
    let quoted = format!("'{}'", path.replace('\'', r#"'"'"'"#));
    let mut rows = Vec::new();

    let repeat: usize =
        std::env::var("VMMIGRATE_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    // Each row is the median of `repeat` runs: the two cores are shared with the emulator.
    let median = |measure: &mut dyn FnMut() -> (f64, f64)| {
        let mut runs: Vec<(f64, f64)> = (0..repeat).map(|_| measure()).collect();
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        runs[runs.len() / 2]
    };

    let (s, c) = median(&mut || shell(&format!("ssh {ssh_opts} {remote} cat {quoted} > /dev/null"), &errors));
    rows.push(Row {
        name: "ssh cat > /dev/null (ceiling)".into(),
        seconds: s,
        cpu_seconds: c,
        peak_rss_mib: None,
    });
    let scp_target = work.path().join("scp.raw");
    let scp_opts = ssh_opts.replace("-p ", "-P ");
    let scp = format!("scp -q {scp_opts} {remote}:{quoted} {}", scp_target.display());
    let (s, c) = median(&mut || shell(&scp, &errors));
    rows.push(Row { name: "scp".into(), seconds: s, cpu_seconds: c, peak_rss_mib: None });
    let _ = std::fs::remove_file(&scp_target);
    let tee_target = work.path().join("tee.raw");
    let tee = format!(
        "ssh {ssh_opts} {remote} cat {quoted} | tee {} | sha256sum > /dev/null",
        tee_target.display()
    );
    let (s, c) = median(&mut || shell(&tee, &errors));
    rows.push(Row {
        name: "ssh cat, tee, sha256sum (shell way)".into(),
        seconds: s,
        cpu_seconds: c,
        peak_rss_mib: None,
    });
    let _ = std::fs::remove_file(&tee_target);

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let chunk_mib = std::env::var("VMMIGRATE_BENCH_CHUNK_MIB").ok().and_then(|v| v.parse::<u64>().ok());
    for streams in [1usize, 4] {
        let local = work.path().join(format!("ours-{streams}.raw"));
        reset_peak_rss();
        let (seconds, cpu_seconds) = median(&mut || {
            // A fresh copy every run (a leftover sidecar would make it a no-op resume).
            copy::discard(&local).expect("discard");
            let cpu0 = own_cpu();
            let start = Instant::now();
            let result = rt.block_on(async {
                let target = Target {
                    host: "127.0.0.1".into(),
                    port: emu.port,
                    host_key: emu.host_key_fingerprint(),
                    timeout: Duration::from_secs(60),
                };
                let creds = Credentials {
                    username: emu.username.clone(),
                    secret: Secret::Password(emu.password.clone()),
                };
                let session = Arc::new(Session::connect(&target, &creds).await.expect("connect"));
                let mut plan =
                    CopyPlan { streams, remote_digest: false, ..CopyPlan::new(path.clone(), &local) };
                if let Some(mib) = chunk_mib {
                    plan.chunk_size = mib << 20;
                }
                copy::copy_disk(session, &plan, Arc::new(AtomicU64::new(0))).await.expect("copy")
            });
            let seconds = start.elapsed().as_secs_f64();
            assert_eq!(result.sha256, sha, "our copy must be exact");
            assert_eq!(result.bytes_read, size, "a fresh copy reads every byte");
            (seconds, own_cpu() - cpu0)
        });
        rows.push(Row {
            name: format!("vmmigrate copy, {streams} stream(s), sha256 + write"),
            seconds,
            cpu_seconds,
            peak_rss_mib: peak_rss_mib(),
        });
        copy::discard(&local).expect("discard");
    }

    let gib = size as f64 / (1u64 << 30) as f64;
    let ceiling = rows[0].seconds;
    let shell_way = rows[2].seconds;
    println!("\nmedian of {repeat} runs per row");
    println!(
        "disk: {mib} MiB from the ESXi emulator over SSH on loopback ({} cores)",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("| method | seconds | MB/s | vs ssh cat | vs shell way | client CPU s/GiB | peak RSS MiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        let mbps = size as f64 / 1e6 / row.seconds;
        println!(
            "| {} | {:.2} | {:.0} | {:.2}x | {:.2}x | {:.2} | {} |",
            row.name,
            row.seconds,
            mbps,
            ceiling / row.seconds,
            shell_way / row.seconds,
            row.cpu_seconds / gib,
            row.peak_rss_mib.map_or("–".to_owned(), |m| format!("{m:.0}")),
        );
    }
}
