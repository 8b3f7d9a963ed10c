//! Benchmark (not a test): hostile pull requests fed to the real `vmmigrate
//! gitops` process, next to a benign one in the same run.
//!
//!   cargo bench --bench hostile_pr
//!
//! The process tracks a real Git remote (a bare repository), plans pull
//! requests from the fake forge of tools/harness and renders against the test
//! control plane (kube-apiserver and etcd). For each pull request the bench
//! resets the process's peak RSS (`/proc/<pid>/clear_refs`), opens the PR
//! together with a benign one, waits until both have a commit status, and
//! reports the peak RSS growth over the resident size before, the CPU time
//! the process spent, and how long the benign PR waited for its plan: the
//! loop keeps serving other pull requests meanwhile.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vmmigrate_harness::fake_forge::{BOT_LOGIN, Dialect, FakeForge, FakePr, OWNER, REPO, TOKEN};
use vmmigrate_harness::kube_env::KubeEnv;
use vmmigrate_harness::process::{cpu_seconds, status_kib};

const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Bench", "-c", "user.email=bench@example.test", "-c", "commit.gpgsign=false"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn manifest(name: &str) -> String {
    format!(
        "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: {name}\nspec:\n  source:\n    host: esxi01.example.internal\n    hostKey: {HOST_KEY}\n    credentialsSecretRef:\n      name: esxi01\n    vm:\n      name: {name}\n  destination:\n    namespace: vmmigrate\n    storageClassName: standard\n"
    )
}

/// `levels` levels of ten aliases of the level below: 10^levels nodes once expanded.
fn laughs(bytes: usize) -> String {
    let mut text = String::from("a0: &a0 [\"lol lol lol lol lol lol lol lol\"]\n");
    let mut i = 1;
    while text.len() < bytes {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        i += 1;
    }
    text
}

struct Attack {
    name: &'static str,
    files: Vec<(String, Vec<u8>)>,
    /// A symbolic link (path, target) committed as well.
    link: Option<(&'static str, &'static str)>,
}

fn attacks() -> Vec<Attack> {
    let list: String = (0..12_500_000).map(|i| format!("- {}\n", i % 10)).collect();
    let many: Vec<(String, Vec<u8>)> = (0..1000)
        .map(|i| (format!("migrations/batch/vm-{i:04}.yaml"), manifest(&format!("vm-{i:04}")).into_bytes()))
        .collect();
    vec![
        Attack { name: "benign: 1,000 manifests", files: many, link: None },
        Attack {
            name: "aliases, 50 KB",
            files: vec![("migrations/laughs.yaml".into(), laughs(50_000).into_bytes())],
            link: None,
        },
        Attack {
            name: "aliases, 101 KB",
            files: vec![("migrations/laughs2.yaml".into(), laughs(101_000).into_bytes())],
            link: None,
        },
        Attack {
            name: "nested [, 200 KB",
            files: vec![("migrations/nested.yaml".into(), "[".repeat(200_000).into_bytes())],
            link: None,
        },
        Attack {
            name: "list, 50 MB",
            files: vec![("migrations/list.yaml".into(), format!("items:\n{list}").into_bytes())],
            link: None,
        },
        Attack {
            name: "binary, 8 MiB",
            files: vec![(
                "migrations/disk.yaml".into(),
                (0..8u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect(),
            )],
            link: None,
        },
        Attack { name: "symlink out", files: vec![], link: Some(("migrations/link.yaml", "/etc/passwd")) },
        Attack {
            name: "newline name",
            files: vec![("migrations/x\n::error::ok.yaml".into(), manifest("x").into_bytes())],
            link: None,
        },
    ]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

async fn run() {
    // The control plane alone: the gitops process needs an API server, no node.
    let env = KubeEnv::start_owned(false).expect("the control plane");
    let env = &env;
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("remote.git");
    let work = dir.path().join("work");
    git(dir.path(), &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()]);
    git(dir.path(), &["clone", "-q", bare.to_str().unwrap(), work.to_str().unwrap()]);
    git(&work, &["checkout", "-q", "-b", "main"]);
    std::fs::write(work.join("README.md"), "# migrations\n").unwrap();
    git(&work, &["add", "."]);
    git(&work, &["commit", "-q", "-m", "start"]);
    git(&work, &["push", "-q", "origin", "main"]);

    // The plan's server-side dry runs need the migrations' namespace.
    env.kubectl(&["create", "namespace", "vmmigrate"]).ok();
    let forge = FakeForge::start().await;
    let cache = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
        .args(["gitops", "--repo", bare.to_str().unwrap(), "--branch", "main", "--no-apply", "--no-status"])
        .args(["--poll-seconds", "1", "--metrics-listen", "127.0.0.1:0", "--forge", "github"])
        .args(["--forge-api", &forge.base_url(Dialect::GitHub), "--forge-repo", &format!("{OWNER}/{REPO}")])
        .arg("--cache-dir")
        .arg(cache.path())
        .env("VMMIGRATE_FORGE_TOKEN", TOKEN)
        .env("KUBECONFIG", env.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("vmmigrate gitops");
    let pid = child.id();
    let _ = BOT_LOGIN;

    println!("| pull request | peak RSS growth (MiB) | CPU (s) | benign PR planned after (s) | outcome |");
    println!("|---|---:|---:|---:|---|");
    for (n, attack) in attacks().into_iter().enumerate() {
        let number = 10 + 2 * n as u64;
        let branch = format!("pr-{number}");
        git(&work, &["checkout", "-q", "-B", &branch, "main"]);
        let mut changed = Vec::new();
        for (path, bytes) in &attack.files {
            let full = work.join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, bytes).unwrap();
            changed.push(path.clone());
        }
        if let Some((path, target)) = attack.link {
            std::fs::create_dir_all(work.join(path).parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, work.join(path)).unwrap();
            changed.push(path.to_owned());
        }
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", attack.name]);
        git(&work, &["push", "-q", "-f", "origin", &format!("HEAD:refs/heads/{branch}")]);
        let head = git(&work, &["rev-parse", "HEAD"]);
        // The benign neighbour.
        let good_branch = format!("pr-{}", number + 1);
        git(&work, &["checkout", "-q", "-B", &good_branch, "main"]);
        let good_path = format!("migrations/good-{number}.yaml");
        std::fs::create_dir_all(work.join("migrations")).unwrap();
        std::fs::write(work.join(&good_path), manifest(&format!("good-{number}"))).unwrap();
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", "benign"]);
        git(&work, &["push", "-q", "-f", "origin", &format!("HEAD:refs/heads/{good_branch}")]);
        let good_head = git(&work, &["rev-parse", "HEAD"]);
        git(&work, &["checkout", "-q", "main"]);

        // Idle for a moment so the previous PR's memory is back, then measure this one.
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS");
        let rss_before = status_kib(pid, "VmRSS");
        let cpu_before = cpu_seconds(pid);
        let opened = Instant::now();
        let refs: Vec<&str> = changed.iter().map(String::as_str).collect();
        forge.add_pr(FakePr { head_ref: branch.clone(), ..FakePr::open(number, &head) }.with_files(&refs));
        forge.add_pr(
            FakePr { head_ref: good_branch.clone(), ..FakePr::open(number + 1, &good_head) }
                .with_files(&[&good_path]),
        );
        let mut good_after = None;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if good_after.is_none() && !forge.statuses(&good_head).is_empty() {
                good_after = Some(opened.elapsed());
            }
            if good_after.is_some() && !forge.statuses(&head).is_empty() {
                break;
            }
            if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                println!("| {} | — | — | — | no plan within 300 s (or the process died) |", attack.name);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let peak = status_kib(pid, "VmHWM");
        let cpu = cpu_seconds(pid) - cpu_before;
        let status = forge.statuses(&head).last().map(|s| (s.state.clone(), s.description.clone()));
        let outcome = match status {
            Some((state, description)) => {
                format!("{state}: {}", description.chars().take(90).collect::<String>())
            }
            None => "no status".into(),
        };
        println!(
            "| {} | {:.1} | {:.2} | {:.1} | {} |",
            attack.name,
            peak.saturating_sub(rss_before) as f64 / 1024.0,
            cpu,
            good_after.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN),
            outcome.replace('|', "\\|").replace('\n', "\\n"),
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}
