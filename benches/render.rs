//! Benchmark (not a test): rendering 1,000 generated manifests, the way
//! gitops renders a commit (folder defaults and a provider included).
//!
//!   cargo bench --bench render
//!   VMMIGRATE_BENCH_MANIFESTS=5000 VMMIGRATE_BENCH_REPEAT=9 cargo bench --bench render
//!
//! Prints the median of the runs and manifests per second; to_yaml separately.

use std::time::{Duration, Instant};
use vmmigrate::gitops::render::{RenderOptions, render, to_yaml};
use vmmigrate::gitops::{Provenance, RepoFile};

const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn file(path: String, text: String) -> RepoFile {
    RepoFile { path, bytes: text.into_bytes() }
}

/// `n` migrations in 20 folders, each folder with its own defaults, half of
/// them through a provider and half with the connection written out.
fn repository(n: usize) -> Vec<RepoFile> {
    let mut files = vec![
        file(
            "providers/esxi01.yaml".into(),
            format!(
                "apiVersion: migration.platform.example/v1alpha1\nkind: EsxiProvider\nmetadata:\n  name: esxi01\nspec:\n  host: esxi01.example.internal\n  hostKey: {HOST_KEY}\n  credentialsSecretRef:\n    name: esxi01-credentials\n"
            ),
        ),
        file(
            "migrations/defaults.yaml".into(),
            "metadata:\n  labels:\n    team: platform\nspec:\n  networkMap:\n    - source: VM Network\n      type: Pod\n".into(),
        ),
    ];
    for rack in 0..20 {
        files.push(file(
            format!("migrations/rack-{rack:02}/defaults.yaml"),
            format!("spec:\n  destination:\n    namespace: rack-{rack:02}\n    storageClassName: standard\n  powerOffPolicy: GracefulThenForce\n"),
        ));
    }
    for i in 0..n {
        let source = if i % 2 == 0 {
            "    provider: esxi01\n".to_owned()
        } else {
            format!(
                "    host: esxi02.example.internal\n    hostKey: {HOST_KEY}\n    credentialsSecretRef:\n      name: esxi02-credentials\n"
            )
        };
        files.push(file(
            format!("migrations/rack-{:02}/vm-{i:05}.yaml", i % 20),
            format!(
                "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: vm-{i:05}\nspec:\n  source:\n{source}    vm:\n      name: vm-{i:05}\n  validation:\n    checks:\n      - name: home\n        http:\n          service: vm-{i:05}\n          port: 80\n"
            ),
        ));
    }
    files
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let n = env_usize("VMMIGRATE_BENCH_MANIFESTS", 1000);
    let repeat = env_usize("VMMIGRATE_BENCH_REPEAT", 5).max(1);
    let files = repository(n);
    let provenance =
        Provenance { repo_url: "https://git.example/migrations.git".into(), commit: "0".repeat(40) };
    // The racks are the VMs' namespaces: an administrator allows them.
    let rules = vmmigrate::machine::tenancy::DestinationRules::parse(&["vmmigrate=*"]).expect("rule");
    let opts = RenderOptions::new("vmmigrate", &rules);

    let mut render_times = Vec::new();
    let mut yaml_times = Vec::new();
    let mut bytes = 0;
    for _ in 0..repeat {
        let start = Instant::now();
        let rendered = match render(&files, &provenance, &opts) {
            Ok(rendered) => rendered,
            Err(errors) => {
                for e in &errors {
                    eprintln!("{e}");
                }
                std::process::exit(1);
            }
        };
        render_times.push(start.elapsed());
        assert_eq!(rendered.len(), n);
        let start = Instant::now();
        bytes = to_yaml(&rendered).len();
        yaml_times.push(start.elapsed());
    }
    let render_median = median(render_times);
    let yaml_median = median(yaml_times);
    println!("render: {n} manifests, median of {repeat} runs");
    println!(
        "  render   {:>8.1} ms  {:>9.0} manifests/s",
        render_median.as_secs_f64() * 1e3,
        n as f64 / render_median.as_secs_f64()
    );
    println!(
        "  to_yaml  {:>8.1} ms  {:>9.0} manifests/s  ({bytes} bytes)",
        yaml_median.as_secs_f64() * 1e3,
        n as f64 / yaml_median.as_secs_f64()
    );
}
