//! Benchmark (not a test): the staging server handing one artifact to an
//! importer over HTTPS with its credentials, against baselines in the same
//! run.
//!
//!   cargo bench --bench staging                    # 1024 MiB artifact
//!   VMMIGRATE_BENCH_MIB=256 cargo bench --bench staging
//!   VMMIGRATE_BENCH_REPEAT=5 ...                   # runs per row (the median is shown)
//!
//! Rows: the sha256 of the file in this process (the server hashes every
//! byte it serves whole) and by `sha256sum`, `openssl s_server -WWW` over
//! TLS to `curl` (a plain TLS file server, no hashing, no auth: the
//! baseline the ratios are against), and vmmigrate's staging server to
//! `curl` with basic auth and the staging CA (TLS, hold-back verification,
//! the credential check), once to /dev/null and once piped into `sha256sum`
//! as CDI's importer checks it. CPU is the client commands' user+system plus,
//! for the server rows, the server's (this process, or openssl's).

use std::process::Command;
use std::sync::Arc;
use vmmigrate::convert::access::StagingAccess;
use vmmigrate::convert::artifact::{Marker, sha256_file, write_marker};
use vmmigrate::convert::staging::StagingServer;
use vmmigrate_harness::process::{cpu_seconds, timed_shell as shell};

fn own_cpu() -> f64 {
    cpu_seconds(std::process::id())
}

fn main() {
    let mib: u64 = std::env::var("VMMIGRATE_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    let repeat: usize =
        std::env::var("VMMIGRATE_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let work = tempfile::tempdir().expect("tempdir");
    let errors = work.path().join("stderr");
    let uid = "bench-0000";
    let dir = work.path().join("staging").join(uid);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("disk-0.raw");
    // Incompressible bytes, in the page cache for every row.
    shell(&format!("head -c {}M /dev/urandom > {}", mib, file.display()), &errors);
    let (size, sha256) = sha256_file(&file, None).unwrap();
    write_marker(&file, &Marker { size, sha256: sha256.clone() }).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let access = Arc::new(StagingAccess::load_or_create(&work.path().join("tls"), &url).unwrap());
    let credential = access.credential(uid, "disk-0.raw");
    let ca = work.path().join("ca.pem");
    std::fs::write(&ca, access.ca_pem()).unwrap();
    let server = runtime
        .block_on(StagingServer::start(listener, work.path().join("staging"), url.clone(), access))
        .unwrap();

    // openssl's own TLS file server, on a self-signed certificate.
    let (cert, key) = (work.path().join("cert.pem"), work.path().join("key.pem"));
    shell(
        &format!(
            "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=127.0.0.1 \
             -addext subjectAltName=IP:127.0.0.1 -keyout {} -out {} >/dev/null 2>&1",
            key.display(),
            cert.display()
        ),
        &errors,
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut openssl = Command::new("openssl")
        .args(["s_server", "-quiet", "-WWW", "-accept", &port.to_string()])
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("openssl s_server");
    let openssl_ready = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(25));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(openssl_ready, "openssl s_server did not listen");

    let median = |measure: &mut dyn FnMut() -> (f64, f64)| {
        let mut runs: Vec<(f64, f64)> = (0..repeat).map(|_| measure()).collect();
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        runs[runs.len() / 2]
    };
    let curl = format!(
        "curl -sS --fail --cacert {} -u '{}:{}' {url}/artifacts/{uid}/disk-0.raw",
        ca.display(),
        credential.access_key_id,
        credential.secret_key
    );
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    let (s, c) = median(&mut || {
        let (started, before) = (std::time::Instant::now(), own_cpu());
        sha256_file(&file, None).unwrap();
        (started.elapsed().as_secs_f64(), own_cpu() - before)
    });
    rows.push(("sha256 in-process (sha2, what the server hashes with)".into(), s, c));
    let (s, c) = median(&mut || shell(&format!("sha256sum {} > /dev/null", file.display()), &errors));
    rows.push(("sha256sum of the file (coreutils)".into(), s, c));
    let openssl_pid = openssl.id();
    let (s, c) = median(&mut || {
        let before = cpu_seconds(openssl_pid);
        let (s, c) =
            shell(&format!("curl -sS --fail -k https://127.0.0.1:{port}/disk-0.raw -o /dev/null"), &errors);
        (s, c + cpu_seconds(openssl_pid) - before)
    });
    rows.push(("openssl s_server -WWW → curl (TLS, no hash)".into(), s, c));
    let (s, c) = median(&mut || {
        let before = own_cpu();
        let (s, c) = shell(&format!("{curl} -o /dev/null"), &errors);
        (s, c + own_cpu() - before)
    });
    rows.push(("vmmigrate staging → curl (TLS, auth, hold-back sha256)".into(), s, c));
    let (s, c) = median(&mut || {
        let before = own_cpu();
        let (s, c) = shell(&format!("{curl} | sha256sum | grep -q {sha256}"), &errors);
        (s, c + own_cpu() - before)
    });
    rows.push(("vmmigrate staging → curl | sha256sum (as CDI checks)".into(), s, c));
    let _ = openssl.kill();
    let _ = openssl.wait();
    let served = server.stats().bytes_served.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(served, 2 * repeat as u64 * size, "every run got the whole artifact");

    println!("staging server, {mib} MiB artifact, median of {repeat}:");
    println!("{:<58} {:>8} {:>10} {:>9}", "row", "wall s", "MiB/s", "CPU s");
    let baseline = rows[2].1;
    for (name, seconds, cpu) in &rows {
        let ratio = seconds / baseline;
        println!(
            "{name:<58} {seconds:>8.2} {:>10.0} {cpu:>9.2}   ({ratio:.2}× openssl's)",
            mib as f64 / seconds
        );
    }
}
