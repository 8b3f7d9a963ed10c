//! GitOps end to end with a real bare Git remote (driven with the `git` CLI
//! as a user would), the real kube-apiserver, the controller on the
//! in-memory ESXi/disk world (`support::sim`), real CDI importing what it
//! stages, the KubeVirt simulator, the webhook receiver on loopback, and the
//! fake forge of
//! tests/support for pull requests.

use crate::support::fake_forge::{
    BOT_LOGIN, Dialect, FakeForge, FakePr, LimitForm, OWNER, REPO, RateLimit, TOKEN,
};
use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::gitops::service::{self, Gitops, GitopsOptions, SyncOutcome};
use vmmigrate::metrics::Metrics;

/// Migrations import through real CDI: room for a loaded two-core machine.
const WAIT: Duration = Duration::from_secs(300);
const SECRET: &str = "webhook-secret-for-tests";

/// A bare remote plus a work clone to push from, as a user's laptop would.
struct Remote {
    dir: tempfile::TempDir,
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=Platform Team",
            "-c",
            "user.email=platform@example.test",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl Remote {
    fn new() -> Remote {
        let dir = tempfile::tempdir().unwrap();
        let bare = dir.path().join("remote.git");
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        git(dir.path(), &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()]);
        // Every ref update is logged, so the test can prove no push was forced.
        git(&bare, &["config", "core.logAllRefUpdates", "always"]);
        git(dir.path(), &["clone", "-q", bare.to_str().unwrap(), work.to_str().unwrap()]);
        git(&work, &["checkout", "-q", "-b", "main"]);
        std::fs::write(work.join("README.md"), "# migrations\n").unwrap();
        git(&work, &["add", "."]);
        git(&work, &["commit", "-q", "-m", "start"]);
        git(&work, &["push", "-q", "origin", "main"]);
        Remote { dir }
    }

    fn bare(&self) -> PathBuf {
        self.dir.path().join("remote.git")
    }

    fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    /// Writes `files` on `branch` (created from main when new), commits, pushes; returns the commit.
    fn push(&self, branch: &str, files: &[(&str, &str)], message: &str) -> String {
        let work = self.work();
        git(&work, &["fetch", "-q", "origin"]);
        let exists = Command::new("git")
            .arg("-C")
            .arg(&work)
            .args(["rev-parse", "--verify", "-q", &format!("origin/{branch}")])
            .output()
            .unwrap()
            .status
            .success();
        let base = if exists { format!("origin/{branch}") } else { "origin/main".to_owned() };
        git(&work, &["checkout", "-q", "-B", branch, &base]);
        for (path, content) in files {
            let full = work.join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(full, content).unwrap();
        }
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", message]);
        git(&work, &["push", "-q", "origin", &format!("HEAD:refs/heads/{branch}")]);
        git(&work, &["rev-parse", "HEAD"])
    }

    /// Removes `path` from main, commits, pushes; returns the commit.
    fn remove(&self, path: &str, message: &str) -> String {
        let work = self.work();
        git(&work, &["fetch", "-q", "origin"]);
        git(&work, &["checkout", "-q", "-B", "main", "origin/main"]);
        git(&work, &["rm", "-q", path]);
        git(&work, &["commit", "-q", "-m", message]);
        git(&work, &["push", "-q", "origin", "HEAD:refs/heads/main"]);
        git(&work, &["rev-parse", "HEAD"])
    }

    fn show(&self, rev_path: &str) -> Option<String> {
        let out =
            Command::new("git").arg("--git-dir").arg(self.bare()).args(["show", rev_path]).output().unwrap();
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn count(&self, rev: &str) -> usize {
        git(&self.bare(), &["rev-list", "--count", rev]).parse().unwrap()
    }
}

fn manifest(ns: &str, name: &str, vm: &str) -> String {
    format!(
        r#"apiVersion: migration.platform.example/v1alpha1
kind: VirtualMachineMigration
metadata:
  name: {name}
  namespace: {ns}
spec:
  source:
    host: esxi01.example.internal
    hostKey: SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s
    credentialsSecretRef:
      name: esxi01
    vm:
      name: {vm}
  destination:
    namespace: {ns}
    storageClassName: local-path
  networkMap:
    - source: VM Network
      type: Pod
  conversion:
    guest: none
  powerOffPolicy: GracefulThenForce
  strategy:
    backoff:
      initialSeconds: 1
      maxSeconds: 1
  validation:
    checks:
      - name: agent
        guestAgent: {{}}
      - name: address
        ip: {{}}
"#
    )
}

/// [`options`] planning pull requests on `forge` (GitHub's API), without a
/// status writer.
fn planning_options(remote: &Remote, cache: &Path, ns: &str, forge: &FakeForge) -> GitopsOptions {
    GitopsOptions {
        no_status: true,
        forge: Some("github".into()),
        forge_api: Some(forge.base_url(Dialect::GitHub)),
        forge_repo: Some(format!("{OWNER}/{REPO}")),
        forge_token: Some(TOKEN.into()),
        ..options(remote, cache, ns)
    }
}

fn options(remote: &Remote, cache: &Path, ns: &str) -> GitopsOptions {
    GitopsOptions {
        repo: remote.bare().to_string_lossy().into_owned(),
        branch: "main".into(),
        cache_dir: cache.to_path_buf(),
        poll_seconds: 1,
        no_apply: false,
        manifest_namespace: ns.to_owned(),
        status_branch: "migration-status".into(),
        status_dir: None,
        no_status: false,
        system_namespace: ns.to_owned(),
        status_window_seconds: 2,
        webhook_listen: None,
        github_webhook_secret: None,
        gitea_webhook_secret: None,
        gitlab_webhook_token: None,
        forge: None,
        forge_api: None,
        forge_repo: None,
        forge_token: None,
        forge_login: None,
        ssh_key: None,
        known_hosts: None,
        git_token: None,
        watch_path: None,
        destinations: Default::default(),
        tenants: Default::default(),
        limits: Default::default(),
        max_fetch_bytes: 256 << 20,
        fetch_timeout: 300,
    }
}

/// The controller on the simulated source world, watching `ns`.
struct SimController {
    _sims: kubevirt_sim::Simulators,
    _staging: crate::support::SimStaging,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SimController {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start_controller(client: &Client, ns: &str) -> SimController {
    start_controller_on(client, ns, SimWorld::new(11, FaultPlan::default())).await
}

/// [`start_controller`] on `world`; the controller's own namespace (source
/// claims, records of what was left on sources) is `ns` too.
async fn start_controller_on(client: &Client, ns: &str, world: Arc<SimWorld>) -> SimController {
    let staging = crate::support::publish_sim_staging(&world).await;
    let sims = kubevirt_sim::start(client.clone(), ns);
    let adapters = crate::support::sim_adapters(client, &world, ns);
    let config = ControllerConfig {
        namespace: Some(ns.to_owned()),
        max_requeue: Some(Duration::from_millis(200)),
        instance: "gitops-e2e".into(),
        ..Default::default()
    };
    let task = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));
    SimController { _sims: sims, _staging: staging, task }
}

async fn wait_for<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// POSTs a GitHub push event for `after` to the receiver, signed with `secret`.
fn github_push(addr: std::net::SocketAddr, after: &str, secret: &str) -> u16 {
    use hmac::{Hmac, Mac};
    use std::io::{Read, Write};
    let body =
        json!({"ref": "refs/heads/main", "after": after, "repository": {"full_name": "acme/vm-migrations"}})
            .to_string();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    let signature: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "POST /hooks/github HTTP/1.1\r\nHost: {addr}\r\nX-GitHub-Event: push\r\nX-Hub-Signature-256: sha256={signature}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn merged_manifest_is_applied_run_to_completed_and_reported_on_the_status_branch_in_few_commits() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "gitops-e2e").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let _controller = start_controller(&client, &ns).await;
    let metrics = Arc::new(Metrics::new());
    let gitops = service::start(client.clone(), options(&remote, cache.path(), &ns), metrics.clone())
        .await
        .expect("gitops");

    // The merge: the manifest lands on the tracked branch.
    let pushed = Instant::now();
    let commit = remote.push(
        "main",
        &[("migrations/web-01.yaml", &manifest(&ns, "web-01", "web 01"))],
        "Migrate web-01",
    );
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let created = wait_for("the CR", async || api.get_opt("web-01").await.unwrap()).await;
    let poll_latency = pushed.elapsed();
    assert_eq!(created.annotations()["migration.platform.example/git-commit"], commit);
    assert_eq!(created.annotations()["migration.platform.example/git-path"], "migrations/web-01.yaml");
    let managers: Vec<String> = created.managed_fields().iter().filter_map(|m| m.manager.clone()).collect();
    assert!(managers.contains(&"vmmigrate-gitops".to_owned()), "{managers:?}");

    // While the bot writes status, others write to both branches.
    wait_for("the status branch", async || remote.show("migration-status:STATUS.md")).await;
    remote.push("migration-status", &[("NOTES.md", "a human note on the status branch\n")], "note");
    let other = remote.push("main", &[("docs/runbook.md", "# runbook\n")], "Runbook");

    let done = wait_for("Completed", async || {
        let v = api.get("web-01").await.unwrap();
        (phase_of(&v) == Phase::Completed).then_some(v)
    })
    .await;
    let phase_changes = done.status.as_ref().unwrap().history.len();
    let status_file = format!("migration-status:{ns}/web-01.yaml");
    wait_for("Completed on the status branch", async || {
        remote.show(&status_file).filter(|s| s.contains("phase: Completed"))
    })
    .await;
    gitops.stop().await;

    let commits = remote.count("migration-status") - 1; // minus the human note
    eprintln!(
        "push → CR with polling (1 s): {:.0} ms; status commits {commits} for {phase_changes} phase changes",
        poll_latency.as_secs_f64() * 1000.0
    );
    assert!(commits < phase_changes, "coalescing: {commits} commits for {phase_changes} phase changes");
    // The loop and the writer recorded into the registry they were given.
    let text = metrics.encode();
    let count = |sample: &str| {
        let line =
            text.lines().find(|l| l.starts_with(sample)).unwrap_or_else(|| panic!("no {sample}:\n{text}"));
        line.rsplit(' ').next().unwrap().parse::<usize>().unwrap()
    };
    assert_eq!(count(r#"vmmigrate_git_push_total{result="pushed"}"#), commits, "one per status commit");
    assert!(count(r#"vmmigrate_git_fetch_total{result="ok"}"#) >= 1, "{text}");
    assert!(count(r#"vmmigrate_git_apply_total{result="applied"}"#) >= 1, "{text}");
    assert_eq!(metrics.readiness_report(), "gitops ready\n");
    let status_md = remote.show("migration-status:STATUS.md").unwrap();
    assert!(status_md.contains("web-01") && status_md.contains("Completed"), "{status_md}");
    let log = git(&remote.bare(), &["log", "-1", "--format=%an%n%B", "migration-status"]);
    assert!(log.starts_with("vmmigrate"), "{log}");
    assert!(log.contains("Vmmigrate-Source-Commit: "), "{log}");
    // Nothing lost: the human note is still there, main has every commit.
    assert!(
        remote.show("migration-status:NOTES.md").is_some(),
        "the human commit on the status branch survived"
    );
    git(&remote.bare(), &["merge-base", "--is-ancestor", &commit, "main"]);
    git(&remote.bare(), &["merge-base", "--is-ancestor", &other, "main"]);
    // The hand-run commands read the same state.
    let vmmigrate = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .args(args)
            .env("KUBECONFIG", KubeEnv::shared().kubeconfig_path())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let bare = remote.bare().to_string_lossy().into_owned();
    let (code, text) = vmmigrate(&["status", "--repo", &bare]);
    assert_eq!(code, Some(0));
    assert!(text.contains("web-01") && text.contains("Completed"), "status from the branch: {text}");
    let (code, text) = vmmigrate(&["status"]);
    assert_eq!(code, Some(0));
    let row =
        text.lines().find(|l| l.starts_with(&format!("{ns}/web-01"))).unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains("Completed"), "status from the cluster: {row}");
    let work = remote.work();
    git(&work, &["checkout", "-q", "main"]);
    git(&work, &["pull", "-q", "origin", "main"]);
    let (code, text) = vmmigrate(&["plan", work.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("0 to create, 0 to change, 1 unchanged"),
        "the merged manifest plans as unchanged: {text}"
    );
    // No forced update of any branch: every logged update is a fast-forward.
    for branch in ["main", "migration-status"] {
        let reflog = git(&remote.bare(), &["reflog", "show", "--format=%H", &format!("refs/heads/{branch}")]);
        let entries: Vec<&str> = reflog.lines().collect();
        assert!(entries.len() >= 2, "{branch}: {entries:?}");
        for pair in entries.windows(2) {
            git(&remote.bare(), &["merge-base", "--is-ancestor", pair[1], pair[0]]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhook_push_applies_at_once_and_a_bad_signature_changes_nothing() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-hook").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let mut opts = options(&remote, cache.path(), &ns);
    opts.poll_seconds = 3600; // only the first, immediate poll
    opts.no_status = true;
    opts.webhook_listen = Some("127.0.0.1:0".parse().unwrap());
    opts.github_webhook_secret = Some(SECRET.into());
    let metrics = Arc::new(Metrics::new());
    let gitops = service::start(client.clone(), opts, metrics.clone()).await.expect("gitops");
    let addr = gitops.webhook_addr.unwrap();
    let stats = gitops.webhook_stats.clone().unwrap();
    wait_for("the first poll", async || (gitops.gitops.ticks() >= 1).then_some(())).await;
    let ticks = gitops.gitops.ticks();

    let commit =
        remote.push("main", &[("migrations/db.yaml", &manifest(&ns, "db-02", "db-02"))], "Migrate db-02");
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    assert_eq!(
        tokio::task::spawn_blocking(move || github_push(addr, &commit, "wrong secret")).await.unwrap(),
        401
    );
    assert_eq!(stats.rejected_signature.load(Ordering::SeqCst), 1);
    assert_eq!(stats.accepted.load(Ordering::SeqCst), 0);
    assert_eq!(gitops.gitops.ticks(), ticks, "a rejected delivery triggers nothing");
    assert!(api.get_opt("db-02").await.unwrap().is_none(), "nothing applied");

    let commit = git(&remote.bare(), &["rev-parse", "main"]);
    let sent = Instant::now();
    assert_eq!(tokio::task::spawn_blocking(move || github_push(addr, &commit, SECRET)).await.unwrap(), 202);
    wait_for("the CR", async || api.get_opt("db-02").await.unwrap()).await;
    eprintln!("push → CR with the webhook: {:.0} ms", sent.elapsed().as_secs_f64() * 1000.0);
    assert_eq!(stats.accepted.load(Ordering::SeqCst), 1);
    let accepted = r#"vmmigrate_webhook_deliveries_total{forge="github",result="accepted"} 1"#;
    assert!(metrics.encode().lines().any(|l| l == accepted), "{}", metrics.encode());
    gitops.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pull_request_gets_one_plan_comment_edited_in_place_that_follows_the_merge_and_invalid_ones_fail_with_file_and_line()
 {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-pr").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let forge = FakeForge::start().await;
    let opts = planning_options(&remote, cache.path(), &ns, &forge);
    // Read-only discovery through the simulated ESXi world (the real adapter
    // is proven against the ESXi emulator in tests/esxi_source.rs).
    let world = SimWorld::new(3, FaultPlan::default());
    let gitops = Gitops::new(client.clone(), opts).unwrap().with_discoverer(world.clone());
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));

    // PR 1: a valid manifest; planned, then pushed again.
    let path = "migrations/web-01.yaml";
    let first = remote.push("add-web", &[(path, &manifest(&ns, "web-01", "web 01"))], "Add web-01");
    forge.add_pr(FakePr { head_ref: "add-web".into(), ..FakePr::open(1, &first) }.with_files(&[path]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let changed = manifest(&ns, "web-01", "web 01").replace("GracefulThenForce", "GracefulOnly");
    let second = remote.push("add-web", &[(path, &changed)], "Graceful only");
    forge.add_pr(FakePr { head_ref: "add-web".into(), ..FakePr::open(1, &second) }.with_files(&[path]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 0, "an unchanged head is not planned again");
    let comments = forge.comments(1);
    assert_eq!(comments.len(), 1, "exactly one plan comment: {comments:#?}");
    assert_eq!((comments[0].author.as_str(), comments[0].edits), (BOT_LOGIN, 1));
    assert!(
        comments[0].body.contains(&second) && comments[0].body.contains("web-01"),
        "{}",
        comments[0].body
    );
    let status = forge.statuses(&second);
    assert_eq!(
        status.last().map(|s| (s.context.as_str(), s.state.as_str())),
        Some(("vmmigrate/plan", "success"))
    );

    // PR 2: an invalid manifest; a failing status naming file and line; nothing applied.
    let bad_path = "migrations/bad.yaml";
    let bad = manifest(&ns, "bad-01", "bad").replace("powerOffPolicy:", "powerOfPolicy:");
    let head = remote.push("bad", &[(bad_path, &bad)], "Typo");
    forge.add_pr(FakePr { head_ref: "bad".into(), ..FakePr::open(2, &head) }.with_files(&[bad_path]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let comments = forge.comments(2);
    assert_eq!(comments.len(), 1);
    let line = bad.lines().position(|l| l.contains("powerOfPolicy")).unwrap() + 1;
    let location = format!("{bad_path}:{line}");
    assert!(comments[0].body.contains(&location), "names {location}: {}", comments[0].body);
    let status = forge.statuses(&head).last().cloned().unwrap();
    assert_eq!(status.state, "failure");
    assert!(status.description.contains(&location), "{}", status.description);
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    assert!(api.get_opt("bad-01").await.unwrap().is_none());
    assert!(api.get_opt("web-01").await.unwrap().is_none(), "plans apply nothing; only merges do");

    // The merge of PR 1: its comment follows the migration until it ends.
    ensure_storage_class(&client).await;
    let _controller = start_controller(&client, &ns).await;
    git(&remote.work(), &["push", "-q", "origin", "add-web:main"]);
    forge.add_pr(
        FakePr { head_ref: "add-web".into(), ..FakePr::open(1, &second) }.with_files(&[path]).merged(),
    );
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));
    let body = wait_for("the comment to show Completed", async || {
        gitops.plan_pull_requests().await.unwrap();
        gitops.update_followed().await.unwrap();
        let sync = gitops.sync().await.unwrap();
        assert!(!matches!(sync, SyncOutcome::Rejected { .. }), "{sync:?}");
        forge.comments(1).first().map(|c| c.body.clone()).filter(|b| b.contains("Completed"))
    })
    .await;
    assert_eq!(forge.comments(1).len(), 1, "still one comment after the merge");
    assert!(body.contains("web-01"), "{body}");
}

/// The real process against a real git server over HTTPS that demands the
/// token, so the fetcher (gix) and the status writer (git) are both proven
/// to carry it, and only there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_private_https_repository_is_fetched_and_its_status_pushed_with_the_token_and_a_wrong_token_applies_nothing()
 {
    use crate::support::git_http::GitHttp;
    const TOKEN_VALUE: &str = "t0ken-of-a-private-repo";
    let env = KubeEnv::shared();
    let client = env.client().await;
    let ns = test_namespace(&client, "gitops-token").await;
    let remote = Remote::new();
    remote.push("main", &[("migrations/web-01.yaml", &manifest(&ns, "web-01", "web 01"))], "Add web-01");
    let server = GitHttp::start(remote.dir.path(), "x-access-token", TOKEN_VALUE).await;
    let url = server.url("remote.git");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let gitops = |token: &str, cache: &Path| {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .args(["gitops", "--repo", &url, "--branch", "main", "--poll-seconds", "1"])
            .args(["--manifest-namespace", &ns, "--status-window-seconds", "1"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .arg("--cache-dir")
            .arg(cache)
            .env("VMMIGRATE_GIT_TOKEN", token)
            // The test CA, for gix (rustls reads SSL_CERT_FILE) and git (GnuTLS reads GIT_SSL_CAINFO).
            .env("SSL_CERT_FILE", server.ca_file())
            .env("GIT_SSL_CAINFO", server.ca_file())
            .env("KUBECONFIG", env.kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("vmmigrate gitops");
        Kill(child)
    };
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);

    // A wrong token: it asks, is refused, and applies nothing.
    let wrong_cache = tempfile::tempdir().unwrap();
    let wrong = gitops("not-the-token", wrong_cache.path());
    wait_for("the wrong token to be tried", async || {
        server.seen().iter().filter(|s| !s.authorized).nth(1).map(|_| ())
    })
    .await;
    drop(wrong);
    assert!(api.get_opt("web-01").await.unwrap().is_none());
    assert!(server.seen().iter().all(|s| !s.authorized), "{:?}", server.seen());

    // The token: fetched, applied, and the status writer pushes with it too.
    let cache = tempfile::tempdir().unwrap();
    let _running = gitops(TOKEN_VALUE, cache.path());
    let created = wait_for("the CR", async || api.get_opt("web-01").await.unwrap()).await;
    wait_for("STATUS.md on the status branch", async || remote.show("migration-status:STATUS.md")).await;
    let seen = server.seen();
    let pushes: Vec<_> = seen.iter().filter(|s| s.target.ends_with("/git-receive-pack")).collect();
    assert!(!pushes.is_empty() && pushes.iter().all(|s| s.authorized), "{seen:?}");
    let annotations = serde_json::to_string(created.annotations()).unwrap();
    assert!(annotations.contains(&url) && !annotations.contains(TOKEN_VALUE), "{annotations}");
    assert!(!seen.iter().any(|s| s.target.contains(TOKEN_VALUE)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_a_deleted_migration_left_on_its_host_stays_on_the_status_branch_until_its_record_is_cleared()
 {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{DeleteParams, ListParams};
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "gitops-left").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let world = SimWorld::new(11, FaultPlan { hold_copies: true, ..FaultPlan::default() });
    let _controller = start_controller_on(&client, &ns, world.clone()).await;
    let gitops =
        service::start(client.clone(), options(&remote, cache.path(), &ns), Arc::new(Metrics::new()))
            .await
            .expect("gitops");
    let warm = manifest(&ns, "web-01", "web 01").replace("\nspec:\n", "\nspec:\n  mode: Warm\n");
    remote.push("main", &[("migrations/web-01.yaml", &warm)], "Migrate web-01 warm");
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    wait_for("the snapshot taken", async || {
        let v = api.get_opt("web-01").await.unwrap()?;
        v.status.as_ref()?.snapshot.as_ref()?.id.as_ref().map(|_| ())
    })
    .await;
    // The manifest leaves Git, and the namespace's deletion takes the ESXi
    // Secret before the migration: its snapshot cannot be removed.
    remote.remove("migrations/web-01.yaml", "Drop web-01");
    wait_for("the migration marked orphaned", async || {
        let v = api.get("web-01").await.unwrap();
        v.annotations().contains_key(vmmigrate::api::ORPHANED_ANNOTATION).then_some(())
    })
    .await;
    world.lose_credentials();
    api.delete("web-01", &DeleteParams::default()).await.unwrap();
    wait_for("the finalizer to let go", async || {
        api.get_opt("web-01").await.unwrap().is_none().then_some(())
    })
    .await;
    assert_eq!(world.snapshot_left().as_deref(), Some("vmmigrate-web-01"));

    // Git says what stayed where, after the migration's own file went.
    let left = wait_for("left-on-source.yaml on the status branch", async || {
        remote
            .show("migration-status:left-on-source.yaml")
            .filter(|_| remote.show(&format!("migration-status:{ns}/web-01.yaml")).is_none())
    })
    .await;
    let value: serde_yaml::Value = serde_yaml::from_str(&left).unwrap();
    let record = &value["leftOnSource"][0];
    assert_eq!(record["namespace"], ns.as_str());
    assert_eq!(record["migration"], "web-01");
    assert_eq!(record["snapshot"], "vmmigrate-web-01");
    assert_eq!(record["host"], "esxi01.example.internal");
    assert!(record["vmid"].as_str().is_some_and(|v| !v.is_empty()), "{left}");
    let status_md = remote.show("migration-status:STATUS.md").unwrap();
    assert!(
        status_md.contains("## Left on source hosts") && status_md.contains("vmmigrate-web-01"),
        "{status_md}"
    );

    // A person removed the snapshot by hand and deletes the record: the file goes.
    let records: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let label = format!("{}=true", vmmigrate::api::LEFT_ON_SOURCE_LABEL);
    records.delete_collection(&DeleteParams::default(), &ListParams::default().labels(&label)).await.unwrap();
    wait_for("left-on-source.yaml removed", async || {
        remote.show("migration-status:left-on-source.yaml").is_none().then_some(())
    })
    .await;
    let status_md = remote.show("migration-status:STATUS.md").unwrap();
    assert!(!status_md.contains("Left on source"), "{status_md}");
    gitops.stop().await;
}

/// The value of one sample line of a Prometheus text page, 0 when absent.
fn sample(page: &str, name: &str) -> u64 {
    page.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0)
}

/// `GET /metrics` of a child process on loopback.
async fn metrics_page(port: u16) -> Option<String> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.ok()?;
    crate::support::read_answer(&mut stream, Duration::from_secs(5)).await
}

/// The real process against the real git HTTPS server, which goes down
/// (connections refused) while a commit waits on it and a migration's
/// status changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_the_git_remote_is_down_nothing_is_applied_the_outage_is_reported_and_status_catches_up_when_it_is_back()
 {
    use crate::support::git_http::GitHttp;
    use kube::api::{Patch, PatchParams};
    const TOKEN_VALUE: &str = "t0ken-of-a-remote-that-goes-down";
    const FETCH_ERRORS: &str = r#"vmmigrate_git_fetch_total{result="error"}"#;
    const PUSH_ERRORS: &str = r#"vmmigrate_git_push_total{result="error"}"#;
    let env = KubeEnv::shared();
    let client = env.client().await;
    let ns = test_namespace(&client, "gitops-down").await;
    let remote = Remote::new();
    remote.push("main", &[("migrations/web-01.yaml", &manifest(&ns, "web-01", "web 01"))], "Add web-01");
    let server = GitHttp::start(remote.dir.path(), "x-access-token", TOKEN_VALUE).await;
    let url = server.url("remote.git");
    let cache = tempfile::tempdir().unwrap();
    let log_path = cache.path().join("vmmigrate.log");
    let metrics_port = crate::support::free_port();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _running = Kill(
        std::process::Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
            .args(["gitops", "--repo", &url, "--branch", "main", "--poll-seconds", "1"])
            .args(["--manifest-namespace", &ns, "--status-window-seconds", "1"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .arg("--cache-dir")
            .arg(cache.path().join("git"))
            .env("VMMIGRATE_GIT_TOKEN", TOKEN_VALUE)
            .env("SSL_CERT_FILE", server.ca_file())
            .env("GIT_SSL_CAINFO", server.ca_file())
            .env("KUBECONFIG", env.kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("vmmigrate gitops"),
    );
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    wait_for("the CR", async || api.get_opt("web-01").await.unwrap()).await;
    wait_for("web-01 on the status branch", async || {
        remote.show(&format!("migration-status:{ns}/web-01.yaml"))
    })
    .await;

    // Outage 1: web-01 moves on (the controller's status, by hand) while
    // the status writer cannot push; nothing else changes, so only the
    // writer's retry can bring it to the branch.
    let failures = async |what: &str, fetches: u64, pushes: u64| {
        let before = metrics_page(metrics_port).await.unwrap_or_default();
        let page = wait_for(what, async || {
            let page = metrics_page(metrics_port).await?;
            (sample(&page, FETCH_ERRORS) >= sample(&before, FETCH_ERRORS) + fetches
                && sample(&page, PUSH_ERRORS) >= sample(&before, PUSH_ERRORS) + pushes)
                .then_some(page)
        })
        .await;
        (
            sample(&page, FETCH_ERRORS) - sample(&before, FETCH_ERRORS),
            sample(&page, PUSH_ERRORS) - sample(&before, PUSH_ERRORS),
        )
    };
    server.go_down();
    let importing = json!({ "status": { "phase": "Importing" } });
    api.patch_status("web-01", &PatchParams::default(), &Patch::Merge(&importing)).await.unwrap();
    let first = failures("three failed fetches and a failed status push", 3, 1).await;
    server.come_back().await;
    let back = Instant::now();
    wait_for("Importing on the status branch", async || {
        remote.show(&format!("migration-status:{ns}/web-01.yaml")).filter(|s| s.contains("phase: Importing"))
    })
    .await;
    let status_after = back.elapsed();

    // Outage 2: the remote holds a commit of two new migrations it cannot serve.
    server.go_down();
    let commit = remote.push(
        "main",
        &[
            ("migrations/db-02.yaml", &manifest(&ns, "db-02", "db 02")),
            ("migrations/db-03.yaml", &manifest(&ns, "db-03", "db 03")),
        ],
        "Add db-02 and db-03",
    );
    let second = failures("three more failed fetches", 3, 0).await;
    for name in ["db-02", "db-03"] {
        assert!(api.get_opt(name).await.unwrap().is_none(), "{name} applied from an unreachable remote");
    }
    let log = std::fs::read_to_string(&log_path).unwrap();
    let reported: Vec<&str> = log.lines().filter(|l| l.contains(&url)).collect();
    let fetch_line =
        reported.iter().find(|l| l.contains("sync failed") && l.contains(&format!("fetching from {url}: ")));
    let push_line = reported
        .iter()
        .find(|l| l.contains("status publish failed") && l.contains(&format!("git fetch {url} failed")));
    assert!(fetch_line.is_some(), "no fetch failure naming {url}:\n{log}");
    assert!(push_line.is_some(), "no push failure naming {url}:\n{log}");
    server.come_back().await;
    let back = Instant::now();
    for name in ["db-02", "db-03"] {
        let applied = wait_for(name, async || api.get_opt(name).await.unwrap()).await;
        assert_eq!(applied.annotations()["migration.platform.example/git-commit"], commit);
    }
    let applied_after = back.elapsed();
    wait_for("db-03 on the status branch", async || {
        remote.show(&format!("migration-status:{ns}/db-03.yaml")).filter(|s| s.contains(&commit))
    })
    .await;

    let log = std::fs::read_to_string(&log_path).unwrap();
    let basic = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("x-access-token:{TOKEN_VALUE}"),
    );
    assert!(!log.contains(TOKEN_VALUE) && !log.contains(&basic), "credentials in the log:\n{log}");
    let reflog = git(&remote.bare(), &["reflog", "show", "--format=%H", "refs/heads/migration-status"]);
    let entries: Vec<&str> = reflog.lines().collect();
    for pair in entries.windows(2) {
        git(&remote.bare(), &["merge-base", "--is-ancestor", pair[1], pair[0]]);
    }
    eprintln!(
        "git remote down twice: (failed fetches, failed status pushes) {first:?} and {second:?}; status of outage 1 \
         on the branch {:.1} s after it was back; outage 2's commit applied whole {:.1} s after; nothing applied \
         while down; logged:\n  {}\n  {}",
        status_after.as_secs_f64(),
        applied_after.as_secs_f64(),
        fetch_line.unwrap(),
        push_line.unwrap(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_that_discovers_a_vm_another_migration_claims_fails_naming_that_migration() {
    use vmmigrate::ports::EsxiHost;
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-claimed").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let forge = FakeForge::start().await;
    let opts = planning_options(&remote, cache.path(), &ns, &forge);
    let world = SimWorld::new(3, FaultPlan::default());
    let gitops =
        Gitops::new(client.clone(), opts).unwrap().with_discoverer(world.clone()).with_source_claims(&ns);

    // web-01 is applied and, as the controller does at Validated, claims its VM.
    remote.push("main", &[("migrations/web-01.yaml", &manifest(&ns, "web-01", "web 01"))], "Add web-01");
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let mut first = api.get("web-01").await.unwrap();
    let inventory = world.discover(&first).await.unwrap();
    first.status.get_or_insert_with(Default::default).source_inventory = Some(inventory);
    let claims = vmmigrate::objects::claims::SourceClaims::new(client.clone(), &ns);
    assert_eq!(claims.claim(&first).await.unwrap(), None, "web-01 holds the claim");

    // A PR names the same VM under another name (the world has one VM).
    let path = "migrations/web-01-again.yaml";
    let head = remote.push("again", &[(path, &manifest(&ns, "web-01-again", "Web Server 01"))], "Again");
    forge.add_pr(FakePr { head_ref: "again".into(), ..FakePr::open(5, &head) }.with_files(&[path]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let body = forge.comments(5).first().map(|c| c.body.clone()).unwrap_or_default();
    let holder = format!("{ns}/web-01");
    assert!(body.contains(&holder) && body.contains("SourceVMClaimed"), "{body}");
    let status = forge.statuses(&head).last().cloned().unwrap();
    assert_eq!(status.state, "failure", "{}", status.description);
    assert!(status.description.contains(path), "{}", status.description);

    // Once web-01 is gone, the same PR plans clean.
    claims.release(&first).await.unwrap();
    let next = remote.push("again", &[(path, &manifest(&ns, "web-01-again", "web server 01"))], "Retry");
    forge.add_pr(FakePr { head_ref: "again".into(), ..FakePr::open(5, &next) }.with_files(&[path]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    assert_eq!(forge.statuses(&next).last().unwrap().state, "success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_pull_request_fails_its_plan_naming_each_file_and_limit_and_the_next_one_is_planned() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-hostile").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let forge = FakeForge::start().await;
    let opts = planning_options(&remote, cache.path(), &ns, &forge);
    let gitops = Gitops::new(client.clone(), opts).unwrap();
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));

    // A fork's pull request: a billion laughs, a 2 MiB file, and a symbolic
    // link to a file outside the repository, next to a valid manifest.
    let mut laughs = String::from("a0: &a0 [lol]\n");
    for i in 1..=9 {
        laughs.push_str(&format!("a{i}: &a{i} [{}]\n", vec![format!("*a{}", i - 1); 10].join(", ")));
    }
    let big = format!("# {}\n", "x".repeat(2 << 20));
    let valid = manifest(&ns, "web-01", "web 01");
    let files = [
        ("migrations/laughs.yaml", laughs.as_str()),
        ("migrations/big.yaml", big.as_str()),
        ("migrations/web-01.yaml", valid.as_str()),
    ];
    remote.push("hostile", &files, "Hostile");
    let work = remote.work();
    std::os::unix::fs::symlink("/etc/hostname", work.join("migrations/link.yaml")).unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "Link"]);
    git(&work, &["push", "-q", "origin", "HEAD:refs/heads/hostile"]);
    let head = git(&work, &["rev-parse", "HEAD"]);
    let changed =
        ["migrations/laughs.yaml", "migrations/big.yaml", "migrations/web-01.yaml", "migrations/link.yaml"];
    forge.add_pr(FakePr { head_ref: "hostile".into(), ..FakePr::open(7, &head) }.with_files(&changed));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let body = forge.comments(7)[0].body.clone();
    for (file, limit) in [
        ("migrations/laughs.yaml:", "aliases expanded"),
        ("migrations/big.yaml", "--max-file-bytes"),
        ("migrations/link.yaml", "is a symbolic link"),
    ] {
        assert!(body.lines().any(|l| l.contains(file) && l.contains(limit)), "{file} {limit}: {body}");
    }
    assert_eq!(forge.statuses(&head).last().unwrap().state, "failure");
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 0, "not planned again until its head changes");

    // The next pull request is planned as usual.
    let next =
        remote.push("good", &[("migrations/db-01.yaml", &manifest(&ns, "db-01", "db 01"))], "Add db-01");
    forge.add_pr(
        FakePr { head_ref: "good".into(), ..FakePr::open(8, &next) }.with_files(&["migrations/db-01.yaml"]),
    );
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    assert_eq!(forge.statuses(&next).last().unwrap().state, "success");

    // Merged as it is, the hostile commit applies nothing, not even its valid manifest.
    git(&work, &["push", "-q", "origin", "hostile:main"]);
    match gitops.sync().await.unwrap() {
        SyncOutcome::Rejected { errors, .. } => assert_eq!(errors.len(), 3, "{errors:#?}"),
        other => panic!("applied a hostile commit: {other:?}"),
    }
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    assert!(api.get_opt("web-01").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pull_requests_failed_comment_does_not_stop_the_others_and_plans_show_only_their_own_migrations()
{
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-honest").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let forge = FakeForge::start().await;
    let opts = planning_options(&remote, cache.path(), &ns, &forge);
    let gitops = Gitops::new(client.clone(), opts).unwrap();
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));

    // The forge fails every comment write on PR 40; PR 41 is planned anyway.
    let a = remote.push("a", &[("migrations/a.yaml", &manifest(&ns, "a", "a"))], "a");
    let b = remote.push("b", &[("migrations/b.yaml", &manifest(&ns, "b", "b"))], "b");
    forge.add_pr(FakePr { head_ref: "a".into(), ..FakePr::open(40, &a) }.with_files(&["migrations/a.yaml"]));
    forge.add_pr(FakePr { head_ref: "b".into(), ..FakePr::open(41, &b) }.with_files(&["migrations/b.yaml"]));
    forge.refuse_writes_on(40);
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    assert!(forge.comments(40).is_empty() && forge.statuses(&a).is_empty());
    assert_eq!(forge.statuses(&b).last().unwrap().state, "success");
    // Once the forge is back, PR 40 is planned on the next round.
    forge.accept_writes_on(40);
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    assert_eq!(forge.comments(40).len(), 1);

    // A comment someone else planted with the bot's marker is never edited.
    let planted = forge.add_comment(41, "mallory", "<!-- vmmigrate:plan --> all good, merge it");
    let b2 = remote.push(
        "b",
        &[("migrations/b.yaml", &manifest(&ns, "b", "b").replace("GracefulThenForce", "GracefulOnly"))],
        "b2",
    );
    forge.add_pr(FakePr { head_ref: "b".into(), ..FakePr::open(41, &b2) }.with_files(&["migrations/b.yaml"]));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let comments = forge.comments(41);
    let mallory = comments.iter().find(|c| c.id == planted).unwrap();
    assert_eq!((mallory.edits, mallory.body.as_str()), (0, "<!-- vmmigrate:plan --> all good, merge it"));
    assert_eq!(mallory.refused_edits, 0, "the client tried to edit another author's comment");
    assert!(comments.iter().any(|c| c.author == BOT_LOGIN && c.body.contains(&b2)));

    // Another team's migration of the same name (created with kubectl) is not shown to the PR.
    let mut body = crate::support::sim_migration_json(&ns);
    body["metadata"]["name"] = "taken".into();
    body["spec"]["source"]["vm"]["name"] = "payroll-secret-vm".into();
    let other: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &other).await.unwrap();
    let c = remote.push("c", &[("migrations/taken.yaml", &manifest(&ns, "taken", "mine"))], "c");
    forge.add_pr(
        FakePr { head_ref: "c".into(), ..FakePr::open(42, &c) }.with_files(&["migrations/taken.yaml"]),
    );
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 1);
    let comment = forge.comments(42)[0].body.clone();
    assert!(comment.contains("was not created from Git: this manifest would take it over"), "{comment}");
    assert!(!comment.contains("payroll-secret-vm"), "the live spec leaked: {comment}");
    assert_eq!(forge.statuses(&c).last().unwrap().state, "failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_forge_gets_no_call_inside_retry_after_and_the_plan_comment_and_status_land_once() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-429").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let forge = FakeForge::start().await;
    let gitops = Gitops::new(client.clone(), planning_options(&remote, cache.path(), &ns, &forge)).unwrap();
    assert!(matches!(gitops.sync().await.unwrap(), SyncOutcome::Applied { .. }));
    let path = "migrations/web-01.yaml";
    let head = remote.push("add-web", &[(path, &manifest(&ns, "web-01", "web 01"))], "Add web-01");
    forge.add_pr(FakePr { head_ref: "add-web".into(), ..FakePr::open(1, &head) }.with_files(&[path]));
    // The comment is posted, then the status write is limited, and so is
    // the first call of the round after the wait.
    forge.rate_limit(RateLimit {
        from: "POST /repos/acme/vm-migrations/statuses/".into(),
        calls: 2,
        wait: Duration::from_secs(1),
        form: LimitForm::RetryAfter,
    });

    let started = Instant::now();
    let mut rounds = 0;
    wait_for("the plan's commit status", async || {
        rounds += 1;
        // A round the limit stops is logged and tried again on the next one.
        let _ = gitops.plan_pull_requests().await;
        forge.statuses(&head).last().cloned()
    })
    .await;
    let inside = forge.calls_inside_retry_after();
    let comments = forge.comments(1);
    eprintln!(
        "forge rate limit (2 × Retry-After: 1): {rounds} planning rounds, {} rate-limited answers, forge calls inside Retry-After {}, \
         plan comments {}, statuses {}, plan landed after {:.1} s",
        forge.limit_answers().len(),
        inside.len(),
        comments.len(),
        forge.statuses(&head).len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(forge.limit_answers().len(), 2);
    assert!(inside.is_empty(), "forge calls inside Retry-After: {inside:#?}");
    assert_eq!(comments.len(), 1, "one plan comment, no duplicate: {comments:#?}");
    assert!(comments[0].author == BOT_LOGIN && comments[0].body.contains(&head), "{comments:#?}");
    let statuses = forge.statuses(&head);
    assert_eq!(statuses.len(), 1, "{statuses:#?}");
    assert_eq!((statuses[0].context.as_str(), statuses[0].state.as_str()), ("vmmigrate/plan", "success"));
    assert_eq!(gitops.plan_pull_requests().await.unwrap(), 0, "planned: not planned again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn main_force_pushed_to_an_older_commit_orphans_what_left_holds_what_runs_and_keeps_the_status_branch()
{
    use kube::api::{Patch, PatchParams};
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-rewind").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let gitops = service::start(client.clone(), options(&remote, cache.path(), &ns), Arc::default())
        .await
        .expect("gitops");
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let applied_at = async |name: &str, commit: &str| {
        let commit = commit.to_owned();
        wait_for(&format!("{name} applied at {commit}"), async || {
            api.get_opt(name)
                .await
                .unwrap()
                .filter(|m| m.annotations().get("migration.platform.example/git-commit") == Some(&commit))
        })
        .await
    };

    // A: web-01, cold. B: web-01 made warm while it is still Pending, and db-02 added.
    let a = remote.push("main", &[("migrations/web-01.yaml", &manifest(&ns, "web-01", "web 01"))], "web-01");
    applied_at("web-01", &a).await;
    let warm = manifest(&ns, "web-01", "web 01").replace("\nspec:\n", "\nspec:\n  mode: Warm\n");
    let b = remote.push(
        "main",
        &[("migrations/web-01.yaml", &warm), ("migrations/db-02.yaml", &manifest(&ns, "db-02", "db 02"))],
        "web-01 warm, db-02",
    );
    let web = applied_at("web-01", &b).await;
    assert_eq!(web.spec.mode, vmmigrate::api::MigrationMode::Warm);
    applied_at("db-02", &b).await;
    // web-01 runs: past Validated (the controller's status, written here by hand).
    let importing = json!({ "status": { "phase": "Importing" } });
    api.patch_status("web-01", &PatchParams::default(), &Patch::Merge(&importing)).await.unwrap();
    let status_file = format!("migration-status:{ns}/web-01.yaml");
    wait_for("web-01 Importing on the status branch", async || {
        remote.show(&status_file).filter(|s| s.contains("phase: Importing"))
    })
    .await;
    wait_for("db-02 on the status branch", async || {
        remote.show(&format!("migration-status:{ns}/db-02.yaml"))
    })
    .await;
    let status_before = git(&remote.bare(), &["rev-parse", "migration-status"]);

    // Someone force-pushes main back to A.
    git(&remote.work(), &["push", "-q", "--force", "origin", &format!("{a}:refs/heads/main")]);
    assert_eq!(git(&remote.bare(), &["rev-parse", "main"]), a);

    let web = applied_at("web-01", &a).await;
    assert_eq!(
        web.spec.mode,
        vmmigrate::api::MigrationMode::Warm,
        "the running migration keeps the mode it runs in"
    );
    assert_eq!(phase_of(&web), Phase::Importing);
    let db = wait_for("db-02 marked orphaned", async || {
        api.get_opt("db-02")
            .await
            .unwrap()
            .filter(|m| m.annotations().contains_key("migration.platform.example/orphaned"))
    })
    .await;
    assert_eq!(db.annotations()["migration.platform.example/orphaned"], "true");
    assert!(db.metadata.deletion_timestamp.is_none(), "a migration whose manifest left is never deleted");
    let status_md = wait_for("db-02 orphaned in STATUS.md", async || {
        remote.show("migration-status:STATUS.md").filter(|s| s.contains("db-02 (orphaned)"))
    })
    .await;
    gitops.stop().await;

    // The status branch moved on from where it was, never back.
    git(&remote.bare(), &["merge-base", "--is-ancestor", &status_before, "migration-status"]);
    let log = git(&remote.bare(), &["log", "-1", "--format=%B", "migration-status"]);
    assert!(log.contains(&format!("Vmmigrate-Source-Commit: {a}")), "{log}");
    assert!(status_md.contains("web-01") && status_md.contains("Importing"), "{status_md}");
    let reflog = git(&remote.bare(), &["reflog", "show", "--format=%H", "refs/heads/migration-status"]);
    let entries: Vec<&str> = reflog.lines().collect();
    for pair in entries.windows(2) {
        git(&remote.bare(), &["merge-base", "--is-ancestor", pair[1], pair[0]]);
    }
    eprintln!(
        "main rewound from {} to {}: web-01 kept mode Warm in Importing, db-02 orphaned (not deleted), \
         status branch {} commits, all fast-forwards",
        &b[..8],
        &a[..8],
        entries.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_work_tree_is_applied_on_every_file_change_through_notify() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-watch").await;
    let tree = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tree.path().join("migrations")).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let remote = Remote::new();
    let mut opts = options(&remote, cache.path(), &ns);
    opts.repo = String::new();
    opts.watch_path = Some(tree.path().to_path_buf());
    opts.poll_seconds = 3600; // only the first, immediate poll: changes arrive through inotify
    let gitops = service::start(client.clone(), opts, Arc::default()).await.expect("gitops");
    wait_for("the first poll", async || (gitops.gitops.ticks() >= 1).then_some(())).await;

    std::fs::write(tree.path().join("migrations/web.yaml"), manifest(&ns, "web-01", "web 01")).unwrap();
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let created = wait_for("the CR", async || api.get_opt("web-01").await.unwrap()).await;
    assert!(created.annotations()["migration.platform.example/git-commit"].starts_with("working-tree-"));
    gitops.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rehearsal_beside_its_migration_in_git_is_deleted_when_its_manifest_leaves_and_the_migration_only_marked_orphaned()
 {
    use vmmigrate::gitops::apply::apply_commit;
    use vmmigrate::gitops::render::{RenderOptions, render};
    use vmmigrate::gitops::{Provenance, RepoFile};
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-rehearsal").await;
    let rehearsal = manifest(&ns, "web-trial", "web 01").replace("\nspec:\n", "\nspec:\n  mode: Rehearsal\n");
    let files = |both: bool| {
        let mut files = vec![RepoFile {
            path: "migrations/web.yaml".into(),
            bytes: manifest(&ns, "web-01", "web 01").into_bytes(),
        }];
        if both {
            files.push(RepoFile {
                path: "migrations/web-trial.yaml".into(),
                bytes: rehearsal.clone().into_bytes(),
            });
        }
        files
    };
    const GIT_REPO: &str = "https://git.example/m.git";
    let provenance = Provenance { repo_url: GIT_REPO.into(), commit: "ab".repeat(20) };
    let namespaces = std::slice::from_ref(&ns);
    let rendered = render(&files(true), &provenance, &RenderOptions::default()).expect("renders");
    assert_eq!(
        apply_commit(&client, &rendered, namespaces, GIT_REPO).await.expect("applies").applied.len(),
        2
    );
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    assert_eq!(api.get("web-trial").await.unwrap().spec.mode, vmmigrate::api::MigrationMode::Rehearsal);
    // Another repository's rehearsal in the same namespace.
    const OTHER_REPO: &str = "https://git.example/other.git";
    let theirs = rehearsal.replace("web-trial", "their-trial").replace("web 01", "web 02");
    let theirs = [RepoFile { path: "migrations/theirs.yaml".into(), bytes: theirs.into_bytes() }];
    let other = Provenance { repo_url: OTHER_REPO.into(), commit: "cd".repeat(20) };
    let rendered = render(&theirs, &other, &RenderOptions::default()).expect("renders");
    apply_commit(&client, &rendered, namespaces, OTHER_REPO).await.expect("applies");

    // Both manifests leave Git: the migration stays (marked), the rehearsal
    // goes; the other repository's objects are not this one's to touch.
    let report = apply_commit(&client, &[], namespaces, GIT_REPO).await.expect("applies");
    assert!(api.get_opt("their-trial").await.unwrap().is_some(), "another repository's rehearsal stays");
    assert_eq!(report.deleted, vec![(ns.clone(), "web-trial".to_owned())]);
    assert_eq!(report.orphaned, vec![(ns.clone(), "web-01".to_owned())]);
    assert!(api.get_opt("web-trial").await.unwrap().is_none(), "the rehearsal is deleted");
    let kept = api.get("web-01").await.unwrap();
    assert_eq!(
        kept.annotations().get("migration.platform.example/orphaned").map(String::as_str),
        Some("true")
    );

    // The migration's manifest comes back alone: nothing else changes.
    let rendered = render(&files(false), &provenance, &RenderOptions::default()).expect("renders");
    let report = apply_commit(&client, &rendered, namespaces, GIT_REPO).await.expect("applies");
    assert!(report.deleted.is_empty() && report.orphaned.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_named_like_a_migration_it_did_not_create_takes_nothing_over_until_its_owner_lets_it() {
    use kube::api::{Patch, PatchParams};
    use vmmigrate::gitops::apply::{ApplyError, apply_commit};
    use vmmigrate::gitops::render::{RenderOptions, render};
    use vmmigrate::gitops::{Provenance, RepoFile};
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-takeover").await;
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    // A team's migration, created with kubectl.
    let theirs: VirtualMachineMigration = serde_yaml::from_str(&manifest(&ns, "web-01", "web 01")).unwrap();
    api.create(&Default::default(), &theirs).await.expect("kubectl create");
    const GIT_REPO: &str = "https://git.example/m.git";
    let commit = |files: &[(&str, &str, &str)], repo: &str| {
        let files: Vec<RepoFile> = files
            .iter()
            .map(|(path, name, vm)| RepoFile {
                path: (*path).into(),
                bytes: manifest(&ns, name, vm).into_bytes(),
            })
            .collect();
        let provenance = Provenance { repo_url: repo.into(), commit: "ab".repeat(20) };
        render(&files, &provenance, &RenderOptions::default()).expect("renders")
    };
    let namespaces = std::slice::from_ref(&ns);
    // A pull request names its manifest web-01 too, beside a new one.
    let rendered = commit(
        &[("migrations/web.yaml", "web-01", "web 99"), ("migrations/db.yaml", "db-01", "db 01")],
        GIT_REPO,
    );
    let refused = apply_commit(&client, &rendered, namespaces, GIT_REPO).await.expect_err("a takeover");
    let ApplyError::Refused(why) = refused else { panic!("{refused}") };
    assert_eq!(why.len(), 1, "{why:?}");
    assert!(
        why[0].contains("migrations/web.yaml")
            && why[0].contains("was not created from Git")
            && why[0].contains("migration.platform.example/adopt=migrations/web.yaml"),
        "{why:?}"
    );
    let live = api.get("web-01").await.unwrap();
    assert_eq!(live.spec.source.vm.name.as_deref(), Some("web 01"), "the kubectl migration is untouched");
    assert!(!live.labels().contains_key("migration.platform.example/gitops"));
    assert!(api.get_opt("db-01").await.unwrap().is_none(), "nothing of the commit is applied");

    // Its owner lets Git manage it from that path: the commit applies.
    let adopt =
        json!({"metadata": {"annotations": {"migration.platform.example/adopt": "migrations/web.yaml"}}});
    api.patch("web-01", &PatchParams::default(), &Patch::Merge(&adopt)).await.unwrap();
    let rendered = commit(
        &[("migrations/web.yaml", "web-01", "web 01"), ("migrations/db.yaml", "db-01", "db 01")],
        GIT_REPO,
    );
    assert_eq!(
        apply_commit(&client, &rendered, namespaces, GIT_REPO).await.expect("adopted").applied.len(),
        2
    );
    let adopted = api.get("web-01").await.unwrap();
    assert!(
        !adopted.annotations().contains_key("migration.platform.example/adopt"),
        "the consent is used once"
    );

    // Another repository with a manifest of the same name and path: refused.
    let rendered = commit(&[("migrations/web.yaml", "web-01", "web 01")], "https://git.example/other.git");
    let refused = apply_commit(&client, &rendered, namespaces, "https://git.example/other.git").await;
    assert!(
        matches!(&refused, Err(ApplyError::Refused(why)) if why[0].contains("managed from another repository")),
        "{refused:?}"
    );
    // Moved within the repository (its old path gone): still its own.
    let rendered = commit(
        &[("migrations/web/web.yaml", "web-01", "web 01"), ("migrations/db.yaml", "db-01", "db 01")],
        GIT_REPO,
    );
    apply_commit(&client, &rendered, namespaces, GIT_REPO).await.expect("a move");
    assert_eq!(
        api.get("web-01").await.unwrap().annotations()["migration.platform.example/git-path"],
        "migrations/web/web.yaml"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_change_that_creates_a_migration_cannot_approve_its_cutover() {
    use vmmigrate::gitops::apply::apply_commit;
    use vmmigrate::gitops::render::{RenderOptions, render};
    use vmmigrate::gitops::{Provenance, RepoFile};
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-approval").await;
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    const GIT_REPO: &str = "https://git.example/m.git";
    let commit = |retries: i32| {
        let text = manifest(&ns, "web-01", "web 01")
            .replace("\nspec:\n", "\nspec:\n  cutover:\n    mode: Approval\n    approved: true\n")
            .replace(
                "  strategy:\n    backoff:",
                &format!("  strategy:\n    retryLimit: {retries}\n    backoff:"),
            );
        let files = [RepoFile { path: "migrations/web.yaml".into(), bytes: text.into_bytes() }];
        let provenance = Provenance { repo_url: GIT_REPO.into(), commit: "ab".repeat(20) };
        render(&files, &provenance, &RenderOptions::default()).expect("renders")
    };
    let namespaces = std::slice::from_ref(&ns);
    let approved = async || api.get("web-01").await.unwrap().spec.cutover.approved;
    // The pull request that creates it says approved: true.
    let report = apply_commit(&client, &commit(3), namespaces, GIT_REPO).await.expect("applies");
    assert!(
        report.held.iter().any(|(_, _, note)| note.contains("spec.cutover.approved not applied")),
        "{report:?}"
    );
    assert!(!approved().await, "self-approved at creation");
    // The same commit again (every poll): still held.
    apply_commit(&client, &commit(3), namespaces, GIT_REPO).await.expect("applies");
    assert!(!approved().await, "self-approved on a later poll of the same manifest");
    // A later change of the manifest: the approval counts.
    let report = apply_commit(&client, &commit(4), namespaces, GIT_REPO).await.expect("applies");
    assert!(report.held.is_empty(), "{report:?}");
    assert!(approved().await, "a later change approves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_manifests_render_and_apply_without_error() {
    use vmmigrate::gitops::render::{RenderOptions, render};
    use vmmigrate::gitops::{Provenance, RepoFile};
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "gitops-1000").await;
    let files: Vec<RepoFile> = (0..1000)
        .map(|i| RepoFile {
            path: format!("migrations/batch-{}/vm-{i:04}.yaml", i / 100),
            bytes: manifest(&ns, &format!("vm-{i:04}"), &format!("vm {i:04}")).into_bytes(),
        })
        .collect();
    const REPO: &str = "https://git.example/migrations.git";
    let provenance = Provenance { repo_url: REPO.into(), commit: "ab".repeat(20) };
    let started = Instant::now();
    let rendered = render(&files, &provenance, &RenderOptions::default()).expect("renders");
    let render_time = started.elapsed();
    assert_eq!(rendered.len(), 1000);
    let started = Instant::now();
    let report = vmmigrate::gitops::apply::apply_commit(&client, &rendered, std::slice::from_ref(&ns), REPO)
        .await
        .expect("applies");
    eprintln!(
        "1,000 manifests: render {:.0} ms (debug build), apply {:.1} s",
        render_time.as_secs_f64() * 1000.0,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(report.applied.len(), 1000);
    assert!(report.held.is_empty() && report.orphaned.is_empty());
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    assert_eq!(api.list(&Default::default()).await.unwrap().items.len(), 1000);
    // The same commit again changes nothing and still succeeds.
    let again = vmmigrate::gitops::apply::apply_commit(&client, &rendered, std::slice::from_ref(&ns), REPO)
        .await
        .expect("again");
    assert_eq!(again.applied.len(), 1000);
}

/// Reads a connection to its end, at most `within`; the status code of what
/// came back, 0 for a close without an answer.
async fn answer_of(stream: &mut tokio::net::TcpStream, within: Duration) -> u16 {
    let text = crate::support::read_answer(stream, within).await;
    let text = text.unwrap_or_else(|| panic!("the server kept a connection open for more than {within:?}"));
    text.strip_prefix("HTTP/1.1 ").and_then(|t| t.get(..3)).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_flood_of_idle_connections_and_oversized_unsigned_bodies_costs_little_memory_and_a_signed_push_sent_during_it_is_applied_by_its_delivery()
 {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;
    const IDLE: usize = 1000;
    const OVERSIZED: usize = 1000;

    let env = KubeEnv::shared();
    let client = env.client().await;
    let ns = test_namespace(&client, "gitops-flood").await;
    let remote = Remote::new();
    let cache = tempfile::tempdir().unwrap();
    let (hook_port, metrics_port) = (crate::support::free_port(), crate::support::free_port());
    // The real process, so its memory is its own to measure.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_vmmigrate"))
        .args(["gitops", "--repo", remote.bare().to_str().unwrap(), "--branch", "main", "--no-status"])
        .args(["--poll-seconds", "3600", "--manifest-namespace", &ns])
        .args(["--webhook-listen", &format!("127.0.0.1:{hook_port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        .arg("--cache-dir")
        .arg(cache.path())
        .env("VMMIGRATE_GITHUB_WEBHOOK_SECRET", SECRET)
        .env("KUBECONFIG", env.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("vmmigrate gitops");
    let pid = child.id();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let ready = async || {
        let mut stream = TcpStream::connect(("127.0.0.1", metrics_port)).await.ok()?;
        stream.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").await.ok()?;
        (answer_of(&mut stream, Duration::from_secs(5)).await == 200).then_some(())
    };
    wait_for("gitops ready after its first poll", ready).await;
    assert!(child.try_wait().unwrap().is_none(), "vmmigrate gitops exited");
    let _child = Kill(child);
    // The forge has the commit; only the webhook can make vmmigrate look now.
    let commit =
        remote.push("main", &[("migrations/db.yaml", &manifest(&ns, "db-02", "db-02"))], "Migrate db-02");
    let hook = std::net::SocketAddr::from(([127, 0, 0, 1], hook_port));

    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak RSS");
    let rss_before = vmmigrate_harness::process::status_kib(pid, "VmRSS");

    // 1,000 connections that send nothing, or a head that never ends.
    let mut idle = Vec::new();
    for i in 0..IDLE {
        let mut stream = TcpStream::connect(hook).await.unwrap();
        if i % 2 == 1 {
            stream.write_all(b"POST /hooks/github HTTP/1.1\r\nX-GitHub-Ev").await.unwrap();
        }
        idle.push(stream);
    }
    // 1,000 unsigned bodies: half over the size limit, half under it; each
    // sends its head and the first 64 KiB and waits for its answer.
    let flood = || {
        let mut flood = tokio::task::JoinSet::new();
        for i in 0..OVERSIZED {
            flood.spawn(async move {
                let (length, want) = if i % 2 == 0 { (100 << 20, 413) } else { (4 << 20, 401) };
                let mut stream = TcpStream::connect(hook).await.unwrap();
                let head = format!(
                    "POST /hooks/github HTTP/1.1\r\nHost: x\r\nX-GitHub-Event: push\r\nContent-Length: {length}\r\n\r\n"
                );
                stream.write_all(head.as_bytes()).await.unwrap();
                // The server may answer and close before taking it all.
                let _ = stream.write_all(&vec![b'x'; 64 * 1024]).await;
                (answer_of(&mut stream, Duration::from_secs(30)).await, want)
            });
        }
        flood
    };
    let mut wrong = Vec::new();
    let mut collect = async |mut flood: tokio::task::JoinSet<(u16, u16)>| {
        while let Some(done) = flood.join_next().await {
            let (got, want) = done.unwrap();
            if got != want {
                wrong.push((got, want));
            }
        }
    };
    // Round one measures the flood's own cost, apart from the fetch and
    // apply a push causes.
    collect(flood()).await;
    let peak = vmmigrate_harness::process::status_kib(pid, "VmHWM");
    let growth_mib = (peak.saturating_sub(rss_before)) as f64 / 1024.0;
    // Round two, with the idle ones still open: a real delivery meanwhile.
    let second = flood();
    let sent = Instant::now();
    assert_eq!(tokio::task::spawn_blocking(move || github_push(hook, &commit, SECRET)).await.unwrap(), 202);
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    wait_for("the CR", async || api.get_opt("db-02").await.unwrap()).await;
    let applied_after = sent.elapsed();
    collect(second).await;

    // The idle ones are closed by the server at its header timeout (5 s):
    // unanswered or 408, never left open.
    let mut idle_answers = std::collections::BTreeMap::new();
    for mut stream in idle {
        *idle_answers.entry(answer_of(&mut stream, Duration::from_secs(20)).await).or_insert(0) += 1;
    }
    eprintln!(
        "webhook flood: {IDLE} idle + {OVERSIZED} unsigned: RSS {:.1} MiB → peak {:.1} MiB (+{growth_mib:.1} MiB), \
         {:.1} MiB after a second flood and the apply; signed push applied after {:.0} ms; idle answers {idle_answers:?}",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0,
        vmmigrate_harness::process::status_kib(pid, "VmHWM") as f64 / 1024.0,
        applied_after.as_secs_f64() * 1000.0
    );
    assert!(
        wrong.is_empty(),
        "{} bad requests got the wrong answer (got, want): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    assert!(idle_answers.keys().all(|status| [0, 408].contains(status)), "{idle_answers:?}");
    assert!(growth_mib <= 32.0, "RSS grew by {growth_mib:.1} MiB under the flood");
    // The push was applied during the flood, by its delivery: the next poll
    // is an hour away (`--poll-seconds 3600`). How soon is measured above
    // and in docs/security.md, not asserted (no wall-clock limits in tests).
}
