//! The one-shot commands: what `render`, `validate`, `plan`, `status`,
//! `crd`, `convert`, `convert-guest` and `verify-volume` do with their parsed arguments
//! (`cli` parses and dispatches; `process` assembles the long-running ones).

use crate::convert::produce::{ConversionRequest, produce};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;

/// A local repository's root: the folder that holds `migrations/`.
fn repository_root(repo: &str) -> anyhow::Result<&std::path::Path> {
    let root = std::path::Path::new(repo);
    if !root.join("migrations").is_dir() {
        anyhow::bail!("{repo}: no migrations/ directory (point at the repository's root)");
    }
    Ok(root)
}

/// `vmmigrate plan`: the pull-request comment for a local work tree.
pub(crate) fn plan(
    repo: &str,
    opts: &crate::gitops::render::RenderOptions,
    offline: bool,
) -> anyhow::Result<()> {
    let root = repository_root(repo)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (text, ok) = runtime.block_on(async {
        let client = if offline {
            None
        } else {
            match tokio::time::timeout(std::time::Duration::from_secs(5), crate::ports::kube_client("cli"))
                .await
            {
                Ok(Ok(c)) => Some(c),
                _ => {
                    eprintln!(
                        "note: no cluster reachable; every migration shows as new (--offline to silence)"
                    );
                    None
                }
            }
        };
        crate::gitops::local::plan_local(root, opts, client.as_ref()).await
    })?;
    print!("{text}");
    if ok { Ok(()) } else { Err(anyhow::anyhow!("the plan fails (see the errors above)")) }
}

/// `vmmigrate status`: a table from the cluster, or STATUS.md from the status branch.
pub(crate) fn status(repo: Option<String>, branch: &str, all: bool, watch: bool) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let client = match &repo {
            None => Some(crate::ports::kube_client("cli").await?),
            Some(_) => None,
        };
        loop {
            let text = match (&repo, &client) {
                (Some(url), _) => {
                    let cache = std::env::temp_dir().join(format!("vmmigrate-status-{}", std::process::id()));
                    let (url, branch) = (url.clone(), branch.to_owned());
                    let files = tokio::task::spawn_blocking(move || {
                        crate::gitops::service::read_status_branch(&url, &branch, cache)
                    })
                    .await??;
                    files
                        .get("STATUS.md")
                        .cloned()
                        .unwrap_or_else(|| "no STATUS.md on the status branch yet\n".into())
                }
                (None, Some(client)) => crate::gitops::local::status_table(
                    &crate::gitops::local::live_migrations(client, all).await?,
                ),
                (None, None) => unreachable!("a client exists when no repository is given"),
            };
            if !watch {
                print!("{text}");
                return Ok(());
            }
            // Clear the screen and redraw, like `watch`.
            print!("\x1b[H\x1b[2J{text}");
            use std::io::Write;
            std::io::stdout().flush()?;
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                _ = crate::server::shutdown_signal() => return Ok(()),
            }
        }
    })
}

/// Runs one conversion and prints its marker as a JSON line. A failure
/// becomes `<Reason>: <message>`, the reason the Job runner reports.
pub(crate) fn convert(req: ConversionRequest) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let progress = AtomicU64::new(0);
    let marker = runtime.block_on(produce(&req, &progress)).map_err(|e| e.failure())?;
    println!("{}", serde_json::json!({ "size": marker.size, "sha256": marker.sha256 }));
    Ok(())
}

/// Where the kubelet reads a container's termination message from.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// Leaves `line` as the container's termination message, where the kubelet
/// made the file (never creates one outside a pod).
fn termination_message(line: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new().write(true).truncate(true).open(TERMINATION_LOG) {
        use std::io::Write as _;
        let _ = file.write_all(line.as_bytes());
    }
}

/// Converts a whole guest as the request at `request` says (what the
/// guest's conversion Job runs) and prints what was done as a JSON line. A
/// failure is written as the classified [`Failure`](crate::machine::Failure)
/// in JSON to the termination log, so the controller keeps its class (a
/// guest virt-v2v cannot convert waits for a person, a full disk is retried).
pub(crate) fn convert_guest(request: &std::path::Path) -> anyhow::Result<()> {
    use crate::convert::job::GuestJobRequest;
    use crate::convert::produce::{GuestRequest, produce_guest};
    let fail = |failure: crate::machine::Failure| {
        termination_message(&serde_json::to_string(&failure).unwrap_or_default());
        anyhow::Error::from(failure)
    };
    // A request this controller wrote that cannot be read back is a bug, not
    // the guest's: a person looks (the source may be off by now).
    let guest = GuestJobRequest::read(request)
        .map_err(|e| fail(crate::machine::Failure::needs_human(crate::machine::Reason::JobRenderError, e)))?;
    let disks = guest.disks.iter().map(|d| d.request()).collect::<Result<Vec<_>, _>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let request = GuestRequest {
        disks: &disks,
        inventory: &guest.inventory,
        force_tcg: guest.force_tcg,
        work: guest.work.clone(),
        report: guest.report.clone(),
    };
    let (markers, report) = runtime.block_on(produce_guest(&request)).map_err(|e| fail(e.failure()))?;
    let line = serde_json::json!({
        "guest": report.guest,
        "seconds": report.seconds,
        "disks": markers.iter().map(|m| serde_json::json!({ "size": m.size, "sha256": m.sha256 })).collect::<Vec<_>>(),
    });
    println!("{line}");
    Ok(())
}

/// Exit code of `verify-volume` when the volume differs from the copy.
const VOLUME_DIFFERS: u8 = 3;

pub(crate) fn verify_volume(path: &std::path::Path, size: u64, sha256: &str) -> ExitCode {
    let digest = crate::images::digest::volume_digest(path, size)
        .map_err(|e| format!("error: reading {}: {e}", path.display()));
    volume_job_answer(digest, |d| d.sha256 == sha256 && d.nonzero_tail_bytes == 0)
}

/// The one line a volume Job (verify, fill) answers with, printed and
/// written as its termination message: the error, or the report as JSON;
/// exit 0 when `matches` holds, 3 when it does not, 1 on the error.
fn volume_job_answer<T: serde::Serialize>(
    report: Result<T, String>,
    matches: impl Fn(&T) -> bool,
) -> ExitCode {
    let report = match report {
        Ok(report) => report,
        Err(line) => {
            eprintln!("{line}");
            termination_message(&line);
            return ExitCode::FAILURE;
        }
    };
    let line = serde_json::to_string(&report).unwrap_or_default();
    println!("{line}");
    termination_message(&line);
    if matches(&report) { ExitCode::SUCCESS } else { ExitCode::from(VOLUME_DIFFERS) }
}

/// Where `fill-volume` reads from, and what.
pub(crate) struct FillArgs<'a> {
    pub url: &'a str,
    pub ca: &'a std::path::Path,
    pub credentials: &'a std::path::Path,
    pub patch: bool,
}

pub(crate) fn fill_volume(args: &FillArgs<'_>, path: &std::path::Path, size: u64, sha256: &str) -> ExitCode {
    let read =
        |p: &std::path::Path| std::fs::read(p).map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()));
    let filled = (|| {
        let ca_pem = read(args.ca)?;
        let username = String::from_utf8(read(&args.credentials.join("accessKeyId"))?)?;
        let password = String::from_utf8(read(&args.credentials.join("secretKey"))?)?;
        crate::destination::fill::fill_volume(&crate::destination::fill::FillRequest {
            url: args.url,
            ca_pem: &ca_pem,
            username: username.trim(),
            password: password.trim(),
            path,
            size,
            patch: args.patch,
        })
    })();
    let filled = filled.map_err(|e| format!("error: filling {}: {e:#}", path.display()));
    volume_job_answer(filled, |r| r.sha256 == sha256)
}

/// The repository's manifests were rendered and found wrong (each error printed already).
#[derive(Debug, thiserror::Error)]
#[error("{0} error(s) in the repository")]
struct InvalidRepository(usize);

/// `render` (print the YAML) and `validate` (print a count) of a local directory.
pub(crate) fn render_local(
    repo: &str,
    opts: &crate::gitops::render::RenderOptions,
    print_yaml: bool,
) -> anyhow::Result<()> {
    use crate::gitops::render::{read_dir_files, render_tree, to_yaml};
    let root = std::path::Path::new(repo);
    if !root.is_dir() {
        anyhow::bail!("{repo}: not a directory (remote URLs: use `vmmigrate gitops`)");
    }
    repository_root(repo)?;
    let files = read_dir_files(root, &opts.limits).map_err(|e| anyhow::anyhow!("cannot read {repo}: {e}"))?;
    let provenance = crate::gitops::Provenance { repo_url: repo.to_owned(), commit: local_commit(root) };
    match render_tree(&files, &provenance, opts) {
        Ok(rendered) if print_yaml => {
            use std::io::Write;
            std::io::stdout().write_all(to_yaml(&rendered).as_bytes())?;
            Ok(())
        }
        Ok(rendered) => {
            println!("ok: {} migrations", rendered.len());
            Ok(())
        }
        Err(errors) => {
            for error in &errors {
                eprintln!("{error}");
            }
            Err(InvalidRepository(errors.len()).into())
        }
    }
}

/// `git rev-parse HEAD` of a clean work tree, else `working-tree`: a commit
/// annotation must name a commit that holds exactly what was rendered.
fn local_commit(root: &std::path::Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let inside = git(&["rev-parse", "--is-inside-work-tree"]).is_some_and(|s| s == "true");
    let clean = inside
        && git(&["status", "--porcelain", "--untracked-files=all", "--", "."]).is_some_and(|s| s.is_empty());
    match git(&["rev-parse", "HEAD"]) {
        Some(commit) if clean && !commit.is_empty() => commit,
        _ => "working-tree".to_owned(),
    }
}

pub(crate) fn write_crd(output: Option<PathBuf>) -> anyhow::Result<()> {
    let yaml = crate::api::crd_yaml()?;
    match output {
        Some(path) => {
            std::fs::write(&path, yaml).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
        }
        None => {
            use std::io::Write;
            std::io::stdout().write_all(yaml.as_bytes())?;
            Ok(())
        }
    }
}
