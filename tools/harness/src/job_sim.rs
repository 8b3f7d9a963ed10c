//! Simulation of the Job controller and the kubelet, which do not run here
//! (the test environment has no nodes, and its kube-controller-manager runs
//! only the garbage-collector and namespace controllers, so nothing else
//! touches Jobs). No pods are ever created.
//!
//! For each batch/v1 Job of the namespace labelled
//! `app.kubernetes.io/managed-by=vmmigrate` that has not started (no
//! `status.startTime`) and is not suspended, the simulator runs the first
//! container's command as a LOCAL process: argv is `command` followed by
//! `args`, with `vmmigrate` replaced by the binary under test. The process
//! sees the host filesystem (volumes are not simulated) and a clean
//! environment: `PATH` (standing in for the image's) plus the container's
//! plain `value` env entries; `valueFrom` entries are skipped. It runs once:
//! a failure is final (no pod retries, as with `backoffLimit: 0`).
//!
//! Status goes through the /status subresource in the shape the Job
//! controller writes and that kube-apiserver 1.35's strict Job status
//! validation accepts (see `started`, `succeeded`, `failed` below).
//! Deleting a Job kills its process. Everything stops when the
//! [`JobSimulator`] is dropped.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The label selecting the Jobs this simulator runs.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by=vmmigrate";
const POLL: Duration = Duration::from_millis(100);
/// Job condition messages are capped by the API server (32 KiB); keep them short.
const MAX_MESSAGE: usize = 1024;

/// Knobs and counters shared with the test.
#[derive(Default)]
pub struct JobSimControl {
    /// Processes started.
    pub runs: AtomicUsize,
    /// Distinct Job uids the simulator ever started.
    pub job_uids_seen: Mutex<HashSet<String>>,
    /// While set, no Job is started (running ones go on).
    pub hold: AtomicBool,
    /// Each finished Job's output (stdout then stderr), by Job name: `kubectl logs`.
    pub logs: Mutex<HashMap<String, String>>,
}

/// The running simulator; stops it (and kills its processes) when dropped.
pub struct JobSimulator {
    pub control: Arc<JobSimControl>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for JobSimulator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the simulator for one namespace; `vmmigrate_binary` replaces a
/// command named `vmmigrate` (tests pass `env!("CARGO_BIN_EXE_vmmigrate")`).
pub fn start(client: Client, namespace: &str, vmmigrate_binary: PathBuf) -> JobSimulator {
    let control = Arc::new(JobSimControl::default());
    let api: Api<Job> = Api::namespaced(client, namespace);
    let task = tokio::spawn(job_loop(api, vmmigrate_binary, control.clone()));
    JobSimulator { control, task }
}

/// Aborts a spawned task when dropped (a dropped `JoinHandle` only detaches);
/// the process inside is killed with it (`kill_on_drop`).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn job_loop(api: Api<Job>, binary: PathBuf, control: Arc<JobSimControl>) {
    // One entry per Job uid ever started; kept after the run to never run it twice.
    let mut runs: HashMap<String, AbortOnDrop> = HashMap::new();
    loop {
        if let Ok(list) = api.list(&ListParams::default().labels(MANAGED_BY)).await {
            let live: HashSet<String> = list
                .iter()
                .filter(|job| job.metadata.deletion_timestamp.is_none())
                .filter_map(|job| job.uid())
                .collect();
            // A deleted Job's pod goes with it: dropping the entry kills the process.
            runs.retain(|uid, _| live.contains(uid));
            for job in list {
                let Some(uid) = job.uid() else { continue };
                let started = job.status.as_ref().is_some_and(|s| s.start_time.is_some());
                let suspended = job.spec.as_ref().and_then(|s| s.suspend).unwrap_or(false);
                if started
                    || suspended
                    || !live.contains(&uid)
                    || runs.contains_key(&uid)
                    || control.hold.load(Ordering::SeqCst)
                {
                    continue;
                }
                lock(&control.job_uids_seen).insert(uid.clone());
                let task = tokio::spawn(run_job(api.clone(), job, binary.clone(), control.clone()));
                runs.insert(uid, AbortOnDrop(task));
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now() -> Value {
    serde_json::to_value(Time(Timestamp::now())).unwrap_or(Value::Null)
}

/// Writes through /status. `metadata.uid` is immutable, so carrying it makes
/// the write fail on a Job recreated under the same name.
async fn set_status(api: &Api<Job>, name: &str, uid: &str, status: Value) -> Result<(), kube::Error> {
    let patch = json!({ "metadata": { "uid": uid }, "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| ())
}

/// The Job controller's first write after creating the pod.
fn started() -> Value {
    json!({
        "startTime": now(),
        "active": 1,
        "ready": 0,
        "terminating": 0,
        "uncountedTerminatedPods": {},
    })
}

/// The API server requires `completionTime` and `SuccessCriteriaMet=True`
/// alongside `Complete=True`, and `active` back to 0.
fn succeeded() -> Value {
    let now = now();
    let condition = |type_: &str| {
        json!({
            "type": type_, "status": "True", "reason": "CompletionsReached",
            "message": "Reached expected number of succeeded pods",
            "lastProbeTime": now, "lastTransitionTime": now,
        })
    };
    json!({
        "active": 0,
        "ready": 0,
        "terminating": 0,
        "succeeded": 1,
        "completionTime": now,
        "conditions": [condition("SuccessCriteriaMet"), condition("Complete")],
    })
}

/// The API server requires `FailureTarget=True` alongside `Failed=True`,
/// `active` and `terminating` at 0, and no `completionTime`.
fn failed(message: &str) -> Value {
    let now = now();
    let message: String = message.chars().take(MAX_MESSAGE).collect();
    let condition = |type_: &str| {
        json!({
            "type": type_, "status": "True", "reason": "BackoffLimitExceeded", "message": message,
            "lastProbeTime": now, "lastTransitionTime": now,
        })
    };
    json!({
        "active": 0,
        "ready": 0,
        "terminating": 0,
        "failed": 1,
        "conditions": [condition("FailureTarget"), condition("Failed")],
    })
}

/// The "pod": runs the first container's command to its end.
async fn run_job(api: Api<Job>, job: Job, binary: PathBuf, control: Arc<JobSimControl>) {
    let name = job.name_any();
    let uid = job.uid().unwrap_or_default();
    let container =
        job.spec.as_ref().and_then(|s| s.template.spec.as_ref()).and_then(|s| s.containers.first());
    let Some(container) = container else { return };
    let mut argv: Vec<String> = container.command.clone().unwrap_or_default();
    argv.extend(container.args.clone().unwrap_or_default());
    if set_status(&api, &name, &uid, started()).await.is_err() {
        return;
    }
    let Some((program, args)) = argv.split_first() else {
        let _ = set_status(
            &api,
            &name,
            &uid,
            failed("the simulator needs an explicit command: there are no images"),
        )
        .await;
        return;
    };
    let program = if program == "vmmigrate" { binary } else { PathBuf::from(program) };
    let mut cmd = tokio::process::Command::new(&program);
    cmd.args(args).env_clear().stdin(std::process::Stdio::null()).kill_on_drop(true);
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    for var in container.env.iter().flatten().filter(|v| v.value_from.is_none()) {
        cmd.env(&var.name, var.value.as_deref().unwrap_or(""));
    }
    if let Some(dir) = &container.working_dir {
        cmd.current_dir(dir);
    }
    control.runs.fetch_add(1, Ordering::SeqCst);
    let status = match cmd.output().await {
        Err(e) => failed(&format!("failed to start {}: {e}", program.display())),
        Ok(out) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            lock(&control.logs).insert(name.clone(), format!("{stdout}{stderr}"));
            if out.status.success() {
                succeeded()
            } else {
                let last = stderr.lines().rev().map(str::trim).find(|l| !l.is_empty());
                let message = match (last, out.status.code()) {
                    (Some(line), _) => line.to_owned(),
                    (None, Some(code)) => format!("the container exited with code {code}"),
                    (None, None) => "the container was killed by a signal".to_owned(),
                };
                failed(&message)
            }
        }
    };
    // Whoever waits on the Job waits on this write: retry it while the Job exists.
    for _ in 0..50 {
        match set_status(&api, &name, &uid, status.clone()).await {
            Ok(()) => return,
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 422 => return,
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}
