//! The status writer against real `git` and real bare repositories (in temporary
//! directories) as the remote. Other writers are separate clones pushing with
//! the git CLI; the `before_push` hook makes their races deterministic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use vmmigrate::api::{
    Phase, PhaseTransition, Progress, VirtualMachineMigration, VirtualMachineMigrationSpec,
    VirtualMachineMigrationStatus,
};
use vmmigrate::gitops::status_branch::{
    Publish, StatusError, StatusWriter, StatusWriterConfig, Target, run_coalescing,
};
use vmmigrate::gitops::status_files::{StatusInput, status_files};

const SOURCE: &str = "0123456789abcdef0123456789abcdef01234567";

/// Runs git in `dir` as a human would, isolated from the machine's git config.
fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "init.defaultBranch=main", "-c", "commit.gpgSign=false"])
        .args(args)
        .current_dir(dir)
        .env_remove("GIT_DIR")
        .env_remove("GIT_INDEX_FILE")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", "Human")
        .env("GIT_AUTHOR_EMAIL", "human@example.com")
        .env("GIT_COMMITTER_NAME", "Human")
        .env("GIT_COMMITTER_EMAIL", "human@example.com")
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn git_ok(dir: &Path, args: &[&str]) -> bool {
    Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .status()
        .unwrap()
        .success()
}

struct Env {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    remote: PathBuf,
}

impl Env {
    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let remote = root.join("remote.git");
        git(&root, &["init", "-q", "--bare", remote.to_str().unwrap()]);
        // Reflogs on the remote record every value each branch ever had.
        git(&remote, &["config", "core.logAllRefUpdates", "always"]);
        Env { _tmp: tmp, root, remote }
    }

    fn config(&self, target: Target) -> StatusWriterConfig {
        let mut cfg = StatusWriterConfig::new(self.remote.to_str().unwrap(), self.root.join("cache"));
        cfg.target = target;
        cfg
    }

    fn writer(&self) -> StatusWriter {
        StatusWriter::new(self.config(Target::Branch("migration-status".into())))
    }

    /// A work-tree clone of `branch` for another writer.
    fn clone(&self, name: &str, branch: &str) -> PathBuf {
        let dir = self.root.join(name);
        git(&self.root, &["clone", "-q", "-b", branch, self.remote.to_str().unwrap(), dir.to_str().unwrap()]);
        dir
    }

    fn remote_git(&self, args: &[&str]) -> String {
        git(&self.remote, args)
    }

    fn tip(&self, branch: &str) -> String {
        self.remote_git(&["rev-parse", &format!("refs/heads/{branch}")]).trim().to_string()
    }

    fn show(&self, rev: &str, path: &str) -> String {
        self.remote_git(&["show", &format!("{rev}:{path}")])
    }

    fn paths(&self, rev: &str) -> Vec<String> {
        self.remote_git(&["ls-tree", "-r", "--name-only", rev]).lines().map(str::to_string).collect()
    }

    fn commit_count(&self, rev: &str) -> usize {
        self.remote_git(&["rev-list", "--count", rev]).trim().parse().unwrap()
    }

    fn is_ancestor(&self, ancestor: &str, descendant: &str) -> bool {
        git_ok(&self.remote, &["merge-base", "--is-ancestor", ancestor, descendant])
    }
}

/// Commits `path` with `content` in a work-tree clone and pushes it.
fn human_commit(clone: &Path, path: &str, content: &str) -> String {
    let file = clone.join(path);
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, content).unwrap();
    git(clone, &["add", path]);
    git(clone, &["commit", "-q", "-m", &format!("human: {path}")]);
    git(clone, &["pull", "-q", "--rebase"]);
    git(clone, &["push", "-q"]);
    git(clone, &["rev-parse", "HEAD"]).trim().to_string()
}

fn files(entries: &[(&str, &str)]) -> BTreeMap<String, String> {
    entries.iter().map(|(p, c)| (p.to_string(), c.to_string())).collect()
}

fn t(s: &str) -> Time {
    Time(s.parse().unwrap())
}

fn migration(ns: &str, name: &str, phase: Phase, percent: Option<i32>) -> VirtualMachineMigration {
    let spec: VirtualMachineMigrationSpec = serde_json::from_value(serde_json::json!({
        "source": {
            "host": "esxi01", "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
            "credentialsSecretRef": {"name": "esxi-creds"}, "vm": {"name": format!("{name} vm")}
        },
        "destination": {"namespace": ns, "storageClassName": "standard"}
    }))
    .unwrap();
    let mut m = VirtualMachineMigration::new(name, spec);
    m.metadata.namespace = Some(ns.to_string());
    m.status = Some(VirtualMachineMigrationStatus {
        phase,
        progress: percent.map(|p| Progress {
            bytes_done: i64::from(p) * 10,
            bytes_total: 1000,
            percent: p,
            ..Default::default()
        }),
        history: vec![
            PhaseTransition { phase: Phase::Pending, time: t("2025-03-01T10:00:00Z") },
            PhaseTransition { phase, time: t("2025-03-01T10:05:00Z") },
        ],
        ..Default::default()
    });
    m
}

#[test]
fn first_publish_creates_the_status_branch_with_files_and_trailers() {
    let env = Env::new();
    let writer = env.writer();
    let snapshot = files(&[
        ("STATUS.md", "# Migration status\n"),
        ("apps/web-01.yaml", "name: web-01\n"),
        ("db/pg-01.yaml", "name: pg-01\n"),
    ]);

    let Publish::Committed { commit, attempts } = writer.publish(&snapshot, SOURCE).unwrap() else {
        panic!("expected a commit");
    };

    assert_eq!(attempts, 1);
    assert_eq!(env.tip("migration-status"), commit);
    // An orphan root commit: no parents.
    assert_eq!(env.remote_git(&["rev-list", "--parents", "-n1", &commit]).trim(), commit);
    assert_eq!(env.paths(&commit), ["STATUS.md", "apps/web-01.yaml", "db/pg-01.yaml"]);
    for (path, content) in &snapshot {
        assert_eq!(&env.show(&commit, path), content);
    }
    let meta = env.remote_git(&["log", "-1", "--format=%an <%ae>|%cn <%ce>", &commit]);
    assert_eq!(
        meta.trim(),
        "vmmigrate <vmmigrate@users.noreply.local>|vmmigrate <vmmigrate@users.noreply.local>"
    );
    assert_eq!(
        env.remote_git(&["log", "-1", "--format=%B", &commit]).trim_end(),
        format!(
            "vmmigrate: status of 2 migrations\n\nVmmigrate-Source-Commit: {SOURCE}\nVmmigrate-Migrations: 2"
        )
    );
    let trailers = env.remote_git(&["log", "-1", "--format=%(trailers:only,unfold)", &commit]);
    assert_eq!(trailers.trim_end(), format!("Vmmigrate-Source-Commit: {SOURCE}\nVmmigrate-Migrations: 2"));
    assert_eq!(writer.read_remote().unwrap(), snapshot);
}

#[test]
fn identical_snapshot_makes_no_commit() {
    let env = Env::new();
    let writer = env.writer();
    let snapshot = files(&[("STATUS.md", "a\n"), ("apps/web-01.yaml", "phase: Importing\n")]);
    assert!(matches!(writer.publish(&snapshot, SOURCE).unwrap(), Publish::Committed { .. }));

    assert_eq!(writer.publish(&snapshot, SOURCE).unwrap(), Publish::Unchanged);
    // Nor from a fresh scratch repository, nor with another source commit alone.
    let fresh =
        StatusWriter::new(StatusWriterConfig::new(env.remote.to_str().unwrap(), env.root.join("cache-2")));
    assert_eq!(fresh.publish(&snapshot, "89abcdef").unwrap(), Publish::Unchanged);
    assert_eq!(env.commit_count("migration-status"), 1);

    // An empty snapshot for a branch that does not exist yet commits nothing either.
    let mut cfg = env.config(Target::Branch("other-status".into()));
    cfg.cache_dir = env.root.join("cache-3");
    assert_eq!(StatusWriter::new(cfg).publish(&BTreeMap::new(), SOURCE).unwrap(), Publish::Unchanged);
    assert!(!git_ok(&env.remote, &["rev-parse", "--verify", "-q", "refs/heads/other-status"]));
}

#[test]
fn a_migration_gone_from_the_snapshot_loses_its_file_and_unmanaged_files_stay() {
    let env = Env::new();
    let writer = env.writer();
    writer
        .publish(&files(&[("STATUS.md", "two\n"), ("apps/a.yaml", "a\n"), ("apps/b.yaml", "b\n")]), SOURCE)
        .unwrap();
    let human = env.clone("human", "migration-status");
    human_commit(&human, "README.md", "about this branch\n");
    human_commit(&human, "notes/deep/plan.yaml", "three levels: not ours\n");

    writer.publish(&files(&[("STATUS.md", "one\n"), ("apps/a.yaml", "a\n")]), SOURCE).unwrap();

    let tip = env.tip("migration-status");
    assert_eq!(env.paths(&tip), ["README.md", "STATUS.md", "apps/a.yaml", "notes/deep/plan.yaml"]);
    assert_eq!(env.show(&tip, "README.md"), "about this branch\n");
    assert_eq!(writer.read_remote().unwrap(), files(&[("STATUS.md", "one\n"), ("apps/a.yaml", "a\n")]));
}

#[test]
fn a_rejected_push_is_rebased_onto_the_new_tip_and_nothing_is_lost() {
    let env = Env::new();
    let first =
        env.writer().publish(&files(&[("STATUS.md", "v1\n"), ("apps/web-01.yaml", "v1\n")]), SOURCE).unwrap();
    let Publish::Committed { commit: ours_first, .. } = first else { panic!("expected a commit") };
    let human = env.clone("human", "migration-status");
    let human_tip = Arc::new(Mutex::new(None::<String>));

    // The human pushes between our fetch and our first push.
    let mut cfg = env.config(Target::Branch("migration-status".into()));
    let calls = Arc::new(AtomicUsize::new(0));
    let (hook_calls, hook_tip, hook_clone) = (calls.clone(), human_tip.clone(), human.clone());
    cfg.before_push = Some(Arc::new(move || {
        if hook_calls.fetch_add(1, Ordering::SeqCst) == 0 {
            *hook_tip.lock().unwrap() = Some(human_commit(&hook_clone, "NOTES.md", "human notes\n"));
        }
    }));
    let snapshot = files(&[("STATUS.md", "v2\n"), ("apps/web-01.yaml", "v2\n"), ("apps/db-01.yaml", "v2\n")]);

    let Publish::Committed { commit, attempts } = StatusWriter::new(cfg).publish(&snapshot, SOURCE).unwrap()
    else {
        panic!("expected a commit");
    };

    assert_eq!(attempts, 2);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let human_tip = human_tip.lock().unwrap().clone().unwrap();
    assert_eq!(env.tip("migration-status"), commit);
    // Linear: ours → the human's → our first.
    let history = env.remote_git(&["rev-list", "--parents", "migration-status"]);
    assert_eq!(
        history.lines().collect::<Vec<_>>(),
        [format!("{commit} {human_tip}"), format!("{human_tip} {ours_first}"), ours_first.clone()]
    );
    assert_eq!(env.show(&commit, "NOTES.md"), "human notes\n");
    for (path, content) in &snapshot {
        assert_eq!(&env.show(&commit, path), content);
    }
}

#[test]
fn a_branch_that_keeps_moving_gives_up_after_max_push_attempts() {
    let env = Env::new();
    env.writer().publish(&files(&[("STATUS.md", "v1\n")]), SOURCE).unwrap();
    let human = env.clone("human", "migration-status");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut cfg = env.config(Target::Branch("migration-status".into()));
    cfg.max_push_attempts = 3;
    let hook_calls = calls.clone();
    cfg.before_push = Some(Arc::new(move || {
        let n = hook_calls.fetch_add(1, Ordering::SeqCst);
        human_commit(&human, "NOTES.md", &format!("edit {n}\n"));
    }));

    let err = StatusWriter::new(cfg).publish(&files(&[("STATUS.md", "v2\n")]), SOURCE).unwrap_err();

    assert!(matches!(err, StatusError::PushRejected { attempts: 3, .. }), "{err}");
    assert!(err.retryable());
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(env.show("migration-status", "STATUS.md"), "v1\n");
}

#[test]
fn a_push_the_remote_refuses_is_not_retried() {
    let env = Env::new();
    let hook = env.remote.join("hooks/pre-receive");
    std::fs::write(&hook, "#!/bin/sh\necho protected >&2\nexit 1\n").unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let mut cfg = env.config(Target::Branch("migration-status".into()));
    let hook_calls = calls.clone();
    cfg.before_push = Some(Arc::new(move || {
        hook_calls.fetch_add(1, Ordering::SeqCst);
    }));

    let err = StatusWriter::new(cfg).publish(&files(&[("STATUS.md", "v1\n")]), SOURCE).unwrap_err();

    assert!(matches!(err, StatusError::PushRefused { .. }), "{err}");
    assert!(!err.retryable());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn directory_target_changes_only_status_dir_and_never_force_pushes_the_tracked_branch() {
    let env = Env::new();
    let seed = env.root.join("seed");
    git(&env.root, &["init", "-q", seed.to_str().unwrap()]);
    for (path, content) in [
        ("README.md", "tracked repo\n"),
        ("migrations/apps/web-01.yaml", "kind: VirtualMachineMigration\n"),
        ("status/README.md", "written by humans, kept by the bot\n"),
    ] {
        std::fs::create_dir_all(seed.join(path).parent().unwrap()).unwrap();
        std::fs::write(seed.join(path), content).unwrap();
    }
    git(&seed, &["add", "."]);
    git(&seed, &["commit", "-q", "-m", "seed"]);
    git(&seed, &["push", "-q", env.remote.to_str().unwrap(), "main"]);
    let mut tips = vec![env.tip("main")];

    let dev = env.clone("dev", "main");
    let calls = Arc::new(AtomicUsize::new(0));
    let pushed = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut cfg = env.config(Target::Directory { branch: "main".into(), dir: "status/".into() });
    let (hook_calls, hook_pushed, hook_dev) = (calls.clone(), pushed.clone(), dev.clone());
    // Before the first push of each publish, a developer merges a change to the tracked branch.
    cfg.before_push = Some(Arc::new(move || {
        let n = hook_calls.fetch_add(1, Ordering::SeqCst);
        if n % 2 == 0 {
            let path = format!("migrations/apps/race-{n}.yaml");
            hook_pushed.lock().unwrap().push(human_commit(
                &hook_dev,
                &path,
                "kind: VirtualMachineMigration\n",
            ));
        }
    }));
    let writer = StatusWriter::new(cfg);

    let one = files(&[("STATUS.md", "one\n"), ("apps/web-01.yaml", "phase: Discovering\n")]);
    let Publish::Committed { commit, attempts } = writer.publish(&one, SOURCE).unwrap() else { panic!() };
    assert_eq!(attempts, 2);
    tips.extend(pushed.lock().unwrap().drain(..));
    tips.push(commit);
    tips.push(human_commit(&dev, "docs/plain.md", "a commit nobody raced\n"));

    let two = files(&[("STATUS.md", "two\n"), ("apps/web-01.yaml", "phase: Completed\n")]);
    let Publish::Committed { commit: last, attempts } = writer.publish(&two, SOURCE).unwrap() else {
        panic!()
    };
    assert_eq!(attempts, 2);
    let race = pushed.lock().unwrap().pop().unwrap();
    tips.push(race.clone());
    tips.push(last.clone());

    assert_eq!(env.tip("main"), last);
    for tip in &tips {
        assert!(env.is_ancestor(tip, &last), "{tip} is no longer in the history of main");
    }
    // Every value main ever had (the remote's reflog) is still in its history.
    let reflog = env.remote_git(&["reflog", "show", "--format=%H", "refs/heads/main"]);
    assert!(reflog.lines().count() >= tips.len(), "{reflog}");
    for value in reflog.lines() {
        assert!(env.is_ancestor(value, &last), "{value} was overwritten");
    }
    assert_eq!(env.remote_git(&["rev-list", "--merges", "--count", "main"]).trim(), "0");
    // Our commit changed only status/, on top of the racing commit.
    assert_eq!(env.remote_git(&["rev-parse", &format!("{last}^")]).trim(), race);
    let changed = env.remote_git(&["diff", "--name-only", &race, &last]);
    assert_eq!(changed.lines().collect::<Vec<_>>(), ["status/STATUS.md", "status/apps/web-01.yaml"]);
    assert_eq!(
        env.paths(&last),
        [
            "README.md",
            "docs/plain.md",
            "migrations/apps/race-0.yaml",
            "migrations/apps/race-2.yaml",
            "migrations/apps/web-01.yaml",
            "status/README.md",
            "status/STATUS.md",
            "status/apps/web-01.yaml",
        ]
    );
    assert_eq!(env.show(&last, "README.md"), "tracked repo\n");
    assert_eq!(env.show(&last, "status/README.md"), "written by humans, kept by the bot\n");
    assert_eq!(env.show(&last, "docs/plain.md"), "a commit nobody raced\n");
    assert_eq!(writer.read_remote().unwrap(), two);
}

#[tokio::test(start_paused = true)]
async fn coalescing_publishes_fewer_commits_than_snapshots() {
    let env = Env::new();
    let writer = Arc::new(env.writer());
    let (tx, rx) = tokio::sync::watch::channel(None);
    let task = tokio::spawn(run_coalescing(writer.clone(), rx, Duration::from_millis(300)));

    let snapshot = |i: usize| {
        files(&[("STATUS.md", &format!("snapshot {i}\n")), ("apps/web-01.yaml", &format!("n: {i}\n"))])
    };
    for i in 0..20 {
        tx.send(Some((snapshot(i), SOURCE.to_string()))).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(tx);
    task.await.unwrap();

    let commits = env.commit_count("migration-status");
    assert!((1..=3).contains(&commits), "{commits} commits for 20 snapshots");
    assert_eq!(writer.read_remote().unwrap(), snapshot(19));
}

#[test]
fn status_md_lists_every_migration_with_phase_and_progress() {
    let env = Env::new();
    let input = StatusInput {
        migrations: vec![
            migration("apps", "web-01", Phase::Importing, Some(42)),
            migration("db", "pg-01", Phase::Completed, None),
            migration("apps", "cache-01", Phase::Preparing, Some(17)),
        ],
        source_commit: SOURCE.to_string(),
        orphaned: vec![("db".into(), "pg-01".into())],
        left_on_source: vec![],
    };
    let rendered = status_files(&input);
    env.writer().publish(&rendered, SOURCE).unwrap();

    let remote = env.writer().read_remote().unwrap();
    assert_eq!(remote, rendered);
    assert_eq!(
        remote.keys().collect::<Vec<_>>(),
        ["STATUS.md", "apps/cache-01.yaml", "apps/web-01.yaml", "db/pg-01.yaml"]
    );
    let md = &remote["STATUS.md"];
    assert!(md.contains(&format!("Source commit: `{SOURCE}`")), "{md}");
    let rows: Vec<&str> =
        md.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| Migration")).collect();
    assert_eq!(
        rows,
        [
            "| apps/cache-01 | Preparing | █░░░░░░░░░ 17% | cache-01 vm on esxi01 | apps/cache-01 |  |",
            "| apps/web-01 | Importing | ████░░░░░░ 42% | web-01 vm on esxi01 | apps/web-01 |  |",
            "| db/pg-01 (orphaned) | Completed | ██████████ 100% | pg-01 vm on esxi01 | db/pg-01 |  |",
        ]
    );
    assert_eq!(md.matches("```mermaid\ngantt\n").count(), 3, "{md}");
    assert!(md.contains("    Importing : milestone, 2025-03-01 10:05:00, 0s\n"), "{md}");
    assert!(!md.contains("esxi-creds"));
    assert!(remote["db/pg-01.yaml"].contains("\norphaned: true\n"));
}
