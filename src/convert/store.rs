//! The real `Converter` and `Staging` adapters: artifacts and their
//! publication under the controller's work directory (layout in `super`).
//!
//! One type implements both because the two share the evidence that decides
//! whether an artifact can be trusted: the `.sha256` marker written last, its
//! freshness against the data, and the `.corrupt` marker the staging server
//! leaves when served bytes differ from it.
//!
//! Runners: `local` converts in the controller process (bounded concurrency;
//! the task dies with the process and its `.partial` output is removed on the
//! next attempt); `job` creates one Kubernetes Job per disk running
//! `vmmigrate convert`, or one per migration running `vmmigrate
//! convert-guest` when the guest is converted whole (see `job`), and reads
//! its status.

use super::artifact::{self, corrupt_path, marker_path, partial_path, read_marker};
use super::job::{self, GuestJobRequest, JobInput, JobSettings};
use super::produce::{self, ConversionRequest, OutputFormat};
use crate::api::{ConversionRunner, DiskFormat, VirtualMachineMigration};
use crate::machine::{ArtifactState, Failure, Reason};
use crate::metrics::Metrics;
use crate::ports::kube_errors::{classify, delete_by_uid};
use crate::ports::workdir::{copies_root, copy_path};
use crate::ports::{Converter, ImportAccess, Staging};
use async_trait::async_trait;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;

/// Settings of the artifact store.
#[derive(Clone, Debug)]
pub(crate) struct StoreSettings {
    /// The work directory (`copies/`, `artifacts/`, `staging/` below it).
    pub work_dir: PathBuf,
    /// Base URL CDI reaches the staging server at, e.g.
    /// `https://vmmigrate-staging.vmmigrate-system.svc:8443`.
    pub staging_url: String,
    /// The staging server's key and CA, for the credentials CDI is given.
    pub access: Arc<super::access::StagingAccess>,
    /// Conversions running at once in the controller process.
    pub local_concurrency: usize,
    /// libguestfs's appliance runs under TCG (`--guest-conversion-tcg`).
    pub force_tcg: bool,
    /// The `job` runner; `None` refuses migrations that ask for it.
    pub jobs: Option<JobSettings>,
    /// Where in-process conversions count the bytes they wrote.
    pub metrics: Arc<Metrics>,
}

struct LocalTask {
    progress: Arc<AtomicU64>,
    total: u64,
    /// Set when the work is done, before the migration is woken (the
    /// handle may not read finished yet when the woken reconcile looks).
    ended: Arc<std::sync::atomic::AtomicBool>,
    handle: tokio::task::JoinHandle<Result<(), produce::ConvertError>>,
}

/// The task key of a migration's whole-guest conversion (one for all its disks).
const GUEST_TASK: usize = usize::MAX;

/// Converter + Staging over the work directory.
pub(crate) struct ArtifactStore {
    settings: StoreSettings,
    client: Option<Client>,
    permits: Arc<Semaphore>,
    tasks: Mutex<HashMap<(String, usize), LocalTask>>,
    /// Told when a local conversion ends.
    wake: std::sync::OnceLock<crate::ports::Wake>,
}

fn uid_of(vmm: &VirtualMachineMigration) -> String {
    vmm.metadata.uid.clone().unwrap_or_default()
}

fn io_failure(what: &str, err: std::io::Error) -> Failure {
    Failure::local_write(Reason::WorkDirError, format!("{what}: {err}"))
}

impl ArtifactStore {
    /// `client` is needed for the `job` runner only.
    pub(crate) fn new(settings: StoreSettings, client: Option<Client>) -> ArtifactStore {
        let permits = Arc::new(Semaphore::new(settings.local_concurrency.max(1)));
        ArtifactStore {
            settings,
            client,
            permits,
            tasks: Mutex::new(HashMap::new()),
            wake: std::sync::OnceLock::new(),
        }
    }

    /// `<work>/staging`: the root the staging server serves.
    pub(crate) fn staging_root(work_dir: &Path) -> PathBuf {
        work_dir.join("staging")
    }

    /// `disk-<n>.<raw|qcow2>`: an artifact's file, and the name its credentials open.
    pub(crate) fn file_name(vmm: &VirtualMachineMigration, disk: usize) -> String {
        format!("disk-{disk}.{}", vmm.spec.conversion.format.extension())
    }

    /// `<work>/artifacts/<uid>/disk-<n>.<fmt>`.
    pub(crate) fn artifact_path(&self, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
        self.settings.work_dir.join("artifacts").join(uid_of(vmm)).join(Self::file_name(vmm, disk))
    }

    /// `<work>/staging/<uid>/disk-<n>.<fmt>`; its warm companions add
    /// `.base` and `.patch` (see [`companion`]).
    pub(crate) fn staged_path(&self, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
        Self::staging_root(&self.settings.work_dir).join(uid_of(vmm)).join(Self::file_name(vmm, disk))
    }

    fn copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
        copy_path(&copies_root(&self.settings.work_dir), vmm, disk)
    }

    /// Whether the guest is converted as a whole (`spec.conversion.guest`).
    fn converts_guest(&self, vmm: &VirtualMachineMigration) -> bool {
        crate::machine::compatibility::converts_guest(&vmm.spec, vmm.status.as_ref())
    }

    /// `<work>/artifacts/<uid>/guest.v2v`: virt-v2v's work while it converts.
    fn guest_work(&self, vmm: &VirtualMachineMigration) -> PathBuf {
        self.settings.work_dir.join("artifacts").join(uid_of(vmm)).join("guest.v2v")
    }

    /// `<work>/artifacts/<uid>/guest-conversion.json`: what converting did.
    fn guest_report(&self, vmm: &VirtualMachineMigration) -> PathBuf {
        self.settings.work_dir.join("artifacts").join(uid_of(vmm)).join("guest-conversion.json")
    }

    /// The key of the local task that makes disk `disk`'s artifact.
    fn task_key(&self, vmm: &VirtualMachineMigration, disk: usize) -> (String, usize) {
        (uid_of(vmm), if self.converts_guest(vmm) { GUEST_TASK } else { disk })
    }

    fn lock_tasks(&self) -> std::sync::MutexGuard<'_, HashMap<(String, usize), LocalTask>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn request(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<ConversionRequest, Failure> {
        let status = vmm.status.clone().unwrap_or_default();
        let evidence = status.disks.get(disk).cloned().unwrap_or_default();
        let capacity = status
            .source_inventory
            .as_ref()
            .and_then(|inv| inv.disks.get(disk))
            .map(|d| d.capacity_bytes)
            .unwrap_or(evidence.size_bytes);
        let input_sha256 = evidence.source_sha256.clone().ok_or_else(|| {
            Failure::retryable(
                Reason::AcquiredCopyMissing,
                format!("disk {disk}: no checksum of the acquired copy is recorded"),
            )
        })?;
        let input = self.copy(vmm, disk);
        Ok(ConversionRequest {
            input_marker: Some(input.with_extension("sha256")),
            input,
            input_sha256,
            expected_virtual_size: capacity.max(0) as u64,
            output: self.artifact_path(vmm, disk),
            format: match vmm.spec.conversion.format {
                DiskFormat::Raw => OutputFormat::Raw,
                DiskFormat::Qcow2 => OutputFormat::Qcow2,
            },
        })
    }

    fn jobs(&self, vmm: &VirtualMachineMigration) -> Result<(Api<Job>, &JobSettings), Failure> {
        let (Some(settings), Some(client)) = (&self.settings.jobs, &self.client) else {
            return Err(Failure::needs_human(
                Reason::JobRunnerNotConfigured,
                "spec.conversion.runner is job but this controller runs without --job-image; \
                 use runner: local or configure the job runner",
            ));
        };
        Ok((Api::namespaced(client.clone(), &job::job_namespace(settings, vmm)), settings))
    }

    /// What the files say about the artifact when no conversion runs.
    fn artifact_from_files(&self, vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState {
        let artifact = self.artifact_path(vmm, disk);
        let staged = self.staged_path(vmm, disk);
        if corrupt_path(&staged).exists() || corrupt_path(&artifact).exists() {
            return ArtifactState::Invalid {
                reason: "the staging server served bytes that differ from the recorded sha256".into(),
            };
        }
        if artifact.exists() {
            let len = std::fs::metadata(&artifact).map(|m| m.len()).unwrap_or(0);
            return match read_marker(&artifact) {
                None => ArtifactState::Invalid { reason: "artifact without a checksum marker".into() },
                Some(m) if m.size != len => ArtifactState::Invalid {
                    reason: format!("artifact is {len} bytes, its marker says {}", m.size),
                },
                Some(_) if !artifact::marker_is_fresh(&artifact, &marker_path(&artifact)) => {
                    ArtifactState::Invalid {
                        reason: "artifact was modified after its checksum was taken".into(),
                    }
                }
                Some(m) => ArtifactState::Complete { sha256: m.sha256, staged_url: None },
            };
        }
        if partial_path(&artifact).exists() {
            return ArtifactState::Invalid { reason: "partial output of an interrupted conversion".into() };
        }
        if self.converts_guest(vmm) && self.guest_work(vmm).exists() {
            return ArtifactState::Invalid {
                reason: "partial output of an interrupted guest conversion".into(),
            };
        }
        if !self.copy(vmm, disk).exists() {
            return ArtifactState::Failed(Failure::retryable(
                Reason::AcquiredCopyMissing,
                format!("disk {disk}: the acquired copy is gone; copying it again"),
            ));
        }
        ArtifactState::Absent
    }

    async fn job_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> Option<ArtifactState> {
        let (api, settings) = match self.jobs(vmm) {
            Ok(j) => j,
            Err(failure) => return Some(ArtifactState::Failed(failure)),
        };
        let namespace = job::job_namespace(settings, vmm);
        let job = match api.get_opt(&self.job_name(vmm, disk)).await {
            Ok(job) => job?,
            Err(e) => return Some(ArtifactState::Failed(classify("reading the conversion Job", e))),
        };
        let status = job.status.unwrap_or_default();
        let condition = |t: &str| {
            status.conditions.iter().flatten().find(|c| c.type_ == t && c.status == "True").cloned()
        };
        if let Some(failed) = condition("Failed") {
            let name = job.metadata.name.unwrap_or_default();
            // The Job controller only says a limit was reached; what went
            // wrong is the last line `vmmigrate convert` printed, which the
            // kubelet keeps as the container's termination message.
            let said = match self.pod_error(&namespace, &name).await {
                Some(line) => line,
                None => failed.message.unwrap_or_else(|| failed.reason.unwrap_or_default()),
            };
            return Some(ArtifactState::Failed(job_failure(&name, &said)));
        }
        if condition("Complete").is_some() {
            return None; // the files speak
        }
        let total = self.request(vmm, disk).map(|r| r.expected_virtual_size).unwrap_or(0);
        // A guest's conversion reports no bytes: it is whole or nothing.
        let done = if self.converts_guest(vmm) {
            0
        } else {
            std::fs::metadata(partial_path(&self.artifact_path(vmm, disk))).map(|m| m.len()).unwrap_or(0)
        };
        Some(ArtifactState::InProgress { bytes_done: done.min(total) as i64, bytes_total: total as i64 })
    }
}

/// Why conversion Job `name` failed, from the last line its pod left: the
/// classified failure `vmmigrate convert-guest` writes (its class kept: a
/// guest virt-v2v cannot convert waits for a person), or any other line as
/// a retryable `ConversionJobFailed`.
fn job_failure(name: &str, said: &str) -> Failure {
    match serde_json::from_str::<Failure>(said) {
        Ok(f) => {
            let message = format!("Job {name}: {}", f.message);
            match f.class {
                crate::machine::FailureClass::Retryable => Failure::local_write(f.reason, message),
                crate::machine::FailureClass::NeedsHuman => Failure::needs_human(f.reason, message),
                crate::machine::FailureClass::Terminal => Failure::terminal(f.reason, message),
            }
        }
        Err(_) => Failure::local_write(Reason::ConversionJobFailed, format!("Job {name}: {said}")),
    }
}

/// Creates a conversion Job; one that exists already is the one this
/// controller created before it restarted (its name says whose it is).
async fn create_job(api: &Api<Job>, body: serde_json::Value) -> Result<(), Failure> {
    let job: Job = serde_json::from_value(body)
        .map_err(|e| Failure::terminal(Reason::JobRenderError, format!("rendering the Job: {e}")))?;
    match api.create(&PostParams::default(), &job).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(classify("creating the conversion Job", e)),
    }
}

impl ArtifactStore {
    /// The Job that makes disk `disk`'s artifact: the guest's, when it is
    /// converted whole.
    fn job_name(&self, vmm: &VirtualMachineMigration, disk: usize) -> String {
        if self.converts_guest(vmm) { job::guest_job_name(vmm) } else { job::job_name(vmm, disk) }
    }

    /// The guest's conversion Job: the request written beside the
    /// artifacts (replaced whole, never half-written), then the Job.
    async fn start_guest_job(
        &self,
        vmm: &VirtualMachineMigration,
        requests: &[ConversionRequest],
        inventory: crate::api::SourceInventory,
    ) -> Result<(), Failure> {
        let (api, settings) = self.jobs(vmm)?;
        let guest = GuestJobRequest {
            disks: requests.iter().map(JobInput::of).collect(),
            inventory,
            force_tcg: self.settings.force_tcg,
            work: self.guest_work(vmm),
            report: self.guest_report(vmm),
        };
        let path = self.guest_report(vmm).with_file_name(job::GUEST_REQUEST_FILE);
        let io = |e| io_failure("writing the guest's conversion request", e);
        // The Job mounts its artifact folder by subPath: made here, as
        // this process's user, not by the kubelet as root.
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_vec_pretty(&guest).map_err(|e| io(std::io::Error::other(e)))?;
        let partial = partial_path(&path);
        std::fs::write(&partial, text).map_err(io)?;
        std::fs::rename(&partial, &path).map_err(io)?;
        let body = job::guest_conversion_job(settings, vmm, &path, &guest);
        create_job(&api, body).await
    }

    async fn pod_error(&self, namespace: &str, job: &str) -> Option<String> {
        crate::objects::pods::job_termination_line(self.client.as_ref()?, namespace, job).await
    }
}

impl ArtifactStore {
    /// Starts the one conversion of the whole guest, unless it runs: a Job
    /// with runner `job`, else a task of this process (virt-v2v reads the
    /// guest's bytes inside libguestfs's appliance, a VM of its own).
    async fn start_guest_conversion(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let disks = vmm.status.as_ref().map(|s| s.disks.len()).unwrap_or(0);
        let requests = (0..disks).map(|disk| self.request(vmm, disk)).collect::<Result<Vec<_>, _>>()?;
        let inventory = vmm.status.as_ref().and_then(|s| s.source_inventory.clone()).unwrap_or_default();
        let remove_staged = || -> Result<(), Failure> {
            // Staged copies of an earlier conversion go with its artifacts.
            for disk in 0..disks {
                artifact::remove_with_markers(&self.staged_path(vmm, disk))
                    .map_err(|e| io_failure("removing a staged artifact", e))?;
            }
            Ok(())
        };
        if vmm.spec.conversion.runner == ConversionRunner::Job {
            remove_staged()?;
            return self.start_guest_job(vmm, &requests, inventory).await;
        }
        let key = (uid_of(vmm), GUEST_TASK);
        let mut tasks = self.lock_tasks();
        if tasks.contains_key(&key) {
            return Ok(());
        }
        remove_staged()?;
        let (work, report) = (self.guest_work(vmm), self.guest_report(vmm));
        let metrics = self.settings.metrics.clone();
        let force_tcg = self.settings.force_tcg;
        let task = self.spawn_local(vmm, 0, |_| async move {
            let guest =
                produce::GuestRequest { disks: &requests, inventory: &inventory, force_tcg, work, report };
            produce::produce_guest(&guest).await.map(|(markers, _)| {
                for marker in markers {
                    metrics.converted_bytes(marker.size);
                }
            })
        });
        tasks.insert(key, task);
        Ok(())
    }

    /// Runs `work` as a local task under the concurrency permits: it is
    /// marked ended, then the migration is woken (it looks again at once,
    /// not at its next poll). `work` gets the progress counter it fills.
    fn spawn_local<F, W>(&self, vmm: &VirtualMachineMigration, total: u64, work: W) -> LocalTask
    where
        W: FnOnce(Arc<AtomicU64>) -> F,
        F: std::future::Future<Output = Result<(), produce::ConvertError>> + Send + 'static,
    {
        let progress = Arc::new(AtomicU64::new(0));
        let work = work(progress.clone());
        let permits = self.permits.clone();
        let wake = self.wake.get().cloned();
        let (namespace, name) = (
            vmm.metadata.namespace.clone().unwrap_or_default(),
            vmm.metadata.name.clone().unwrap_or_default(),
        );
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task_ended = ended.clone();
        let handle = tokio::spawn(async move {
            let permit = permits.acquire_owned().await;
            let result = work.await;
            drop(permit);
            task_ended.store(true, Ordering::Release);
            if let Some(wake) = wake {
                wake(&namespace, &name);
            }
            result
        });
        LocalTask { progress, total, ended, handle }
    }
}

/// Where distributions put OVMF's x86-64 firmware, among the places
/// libguestfs looks for it (Debian and Ubuntu, Fedora and RHEL, SUSE).
const OVMF_CODE: &[&str] = &[
    "/usr/share/OVMF/OVMF_CODE.fd",
    "/usr/share/OVMF/OVMF_CODE.secboot.fd",
    "/usr/share/edk2/ovmf/OVMF_CODE.fd",
    "/usr/share/edk2/ovmf/OVMF_CODE.secboot.fd",
    "/usr/share/qemu/ovmf-x86_64-code.bin",
    "/usr/share/qemu/ovmf-x86_64-ms-code.bin",
];

/// What converts guests in this process's image: virt-v2v and guestfish on
/// `PATH`, virtio-win's drivers where virt-v2v looks for them
/// (`/usr/share/virtio-win`, or `$VIRTIO_WIN`), and OVMF.
pub(crate) fn installed_guest_converter() -> crate::machine::GuestConverterFacts {
    use crate::images::qemu;
    let virtio_win = std::env::var_os("VIRTIO_WIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/virtio-win"));
    crate::machine::GuestConverterFacts {
        virt_v2v: qemu::virt_v2v_path().is_some() && qemu::guestfish_path().is_some(),
        virtio_win: virtio_win.exists(),
        uefi_firmware: OVMF_CODE.iter().any(|p| Path::new(p).is_file()),
    }
}

impl Drop for ArtifactStore {
    /// Conversions belong to the controller process: they stop with it.
    fn drop(&mut self) {
        for task in self.lock_tasks().values() {
            task.handle.abort();
        }
    }
}

#[async_trait]
impl Converter for ArtifactStore {
    fn notify_on_finish(&self, wake: crate::ports::Wake) {
        let _ = self.wake.set(wake);
    }

    async fn artifact_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState {
        let key = self.task_key(vmm, disk);
        let finished = {
            let mut tasks = self.lock_tasks();
            match tasks.get(&key) {
                Some(task) if !task.handle.is_finished() && !task.ended.load(Ordering::Acquire) => {
                    // A guest's conversion reports no bytes: it is whole or nothing.
                    let (done, total) = if key.1 == GUEST_TASK {
                        (0, self.request(vmm, disk).map(|r| r.expected_virtual_size).unwrap_or(0))
                    } else {
                        (task.progress.load(Ordering::Relaxed).min(task.total), task.total)
                    };
                    return ArtifactState::InProgress { bytes_done: done as i64, bytes_total: total as i64 };
                }
                Some(_) => tasks.remove(&key),
                None => None,
            }
        };
        if let Some(task) = finished {
            // A finished task's failure is reported once; afterwards the files speak.
            match task.handle.await {
                Ok(Err(err)) => return ArtifactState::Failed(err.failure()),
                Err(join) if join.is_panic() => {
                    return ArtifactState::Failed(Failure::retryable(
                        Reason::ConversionPanicked,
                        "the conversion task panicked",
                    ));
                }
                _ => {}
            }
        }
        if vmm.spec.conversion.runner == ConversionRunner::Job
            && let Some(state) = self.job_state(vmm, disk).await
        {
            return state;
        }
        self.artifact_from_files(vmm, disk)
    }

    async fn start_conversion(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        if self.converts_guest(vmm) {
            return self.start_guest_conversion(vmm).await;
        }
        let request = self.request(vmm, disk)?;
        // A raw artifact is a hard link to the copy: nothing parses the
        // guest's bytes, so nothing needs a Job's isolation, and a Job (copy
        // and artifact on two mounts) could only copy it.
        let parses = request.format != OutputFormat::Raw;
        if vmm.spec.conversion.runner == ConversionRunner::Job && parses {
            let (api, settings) = self.jobs(vmm)?;
            // The Job mounts its artifact folder by subPath: made here, as
            // this process's user, not by the kubelet as root.
            if let Some(dir) = request.output.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| io_failure(&format!("creating {}", dir.display()), e))?;
            }
            let body = job::conversion_job(settings, vmm, disk, &JobInput::of(&request));
            return create_job(&api, body).await;
        }
        let key = (uid_of(vmm), disk);
        let mut tasks = self.lock_tasks();
        if tasks.contains_key(&key) {
            return Ok(());
        }
        let metrics = self.settings.metrics.clone();
        let total = request.expected_virtual_size;
        let task = self.spawn_local(vmm, total, |progress| async move {
            produce::produce(&request, &progress).await.map(|marker| metrics.converted_bytes(marker.size))
        });
        tasks.insert(key, task);
        Ok(())
    }

    fn guest_converter(&self) -> crate::machine::GuestConverterFacts {
        installed_guest_converter()
    }

    async fn guest_conversion(&self, vmm: &VirtualMachineMigration) -> Option<crate::api::GuestConversion> {
        self.converts_guest(vmm).then(|| produce::read_guest_report(&self.guest_report(vmm))).flatten()
    }

    async fn discard_artifact(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        // A guest's conversion makes every disk at once and starts by
        // removing them all: discarding one disk leaves it running.
        if !self.converts_guest(vmm)
            && let Some(task) = self.lock_tasks().remove(&(uid_of(vmm), disk))
        {
            task.handle.abort();
        }
        if vmm.spec.conversion.runner == ConversionRunner::Job
            && let Ok((api, _)) = self.jobs(vmm)
        {
            // Only this migration's Job, by its uid: never another of that
            // name. A guest's Job goes with any of its disks: it makes them
            // all again.
            let name = self.job_name(vmm, disk);
            let found = api.get_opt(&name).await.map_err(|e| classify("reading the conversion Job", e))?;
            if let Some(found) =
                found.filter(|j| j.labels().get(crate::api::labels::MIGRATION_UID) == Some(&uid_of(vmm)))
            {
                delete_by_uid(&api, &name, found.metadata.uid.clone(), "the conversion Job").await?;
            }
        }
        for file in [self.staged_path(vmm, disk), self.artifact_path(vmm, disk)] {
            artifact::remove_with_markers(&file).map_err(|e| io_failure("removing the artifact", e))?;
        }
        Ok(())
    }
}

#[async_trait]
impl Staging for ArtifactStore {
    async fn staged_url(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure> {
        let staged = self.staged_path(vmm, disk);
        let published = staged.exists()
            && !corrupt_path(&staged).exists()
            && read_marker(&staged).is_some_and(|m| m.sha256 == sha256)
            && artifact::marker_is_fresh(&staged, &marker_path(&staged));
        Ok(published.then(|| {
            format!(
                "{}{}",
                self.settings.staging_url.trim_end_matches('/'),
                super::staging::artifact_path(&uid_of(vmm), disk, vmm.spec.conversion.format.extension())
            )
        }))
    }

    async fn stage(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        let artifact = self.artifact_path(vmm, disk);
        let staged = self.staged_path(vmm, disk);
        let marker = read_marker(&artifact).ok_or_else(|| {
            Failure::retryable(
                Reason::ArtifactMissing,
                format!("{} has no checksum marker", artifact.display()),
            )
        })?;
        let io = |e| io_failure("staging the artifact", e);
        artifact::remove_with_markers(&staged).map_err(io)?;
        if let Some(dir) = staged.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        // A hard link: publishing costs no copy; the marker is written last.
        std::fs::hard_link(&artifact, &staged).map_err(io)?;
        artifact::write_marker(&staged, &marker).map_err(io)?;
        // Warm: the base is the assembled disk's now (the copy was
        // assembled in place); the patch, where the store made one, is
        // published beside the artifact for a volume that holds the base.
        let copy = self.copy(vmm, disk);
        let (base, patch) = (companion(&staged, "base"), companion(&staged, "patch"));
        artifact::remove_with_markers(&base).map_err(io)?;
        artifact::remove_with_markers(&patch).map_err(io)?;
        if let Some(info) = crate::ports::workdir::read_patch_info(&copy) {
            let file = crate::ports::workdir::patch_path(&copy);
            let size = std::fs::metadata(&file).map_err(io)?.len();
            std::fs::hard_link(&file, &patch).map_err(io)?;
            artifact::write_marker(&patch, &artifact::Marker { size, sha256: info.sha256 }).map_err(io)?;
        }
        Ok(())
    }

    fn stages_bases(&self) -> bool {
        true
    }

    async fn stage_base(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure> {
        if vmm.spec.conversion.format != crate::api::DiskFormat::Raw {
            return Ok(None);
        }
        let copy = self.copy(vmm, disk);
        let base = companion(&self.staged_path(vmm, disk), "base");
        let io = |e| io_failure("staging the base", e);
        let marker =
            artifact::Marker { size: std::fs::metadata(&copy).map_err(io)?.len(), sha256: sha256.to_owned() };
        // Only the base copy the machine names: complete, of that sha256.
        let copied = std::fs::read_to_string(copy.with_extension("sha256")).unwrap_or_default();
        if copied.split_whitespace().nth(1) != Some(sha256) {
            return Err(Failure::retryable(
                Reason::AcquiredCopyMissing,
                format!("disk {disk}: no complete base copy with sha256 {sha256} to stage"),
            ));
        }
        if read_marker(&base).as_ref() != Some(&marker) || !base.exists() {
            artifact::remove_with_markers(&base).map_err(io)?;
            if let Some(dir) = base.parent() {
                std::fs::create_dir_all(dir).map_err(io)?;
            }
            std::fs::hard_link(&copy, &base).map_err(io)?;
            artifact::write_marker(&base, &marker).map_err(io)?;
        }
        let path = super::staging::artifact_path(&uid_of(vmm), disk, "raw");
        Ok(Some(format!("{}{path}.base", self.settings.staging_url.trim_end_matches('/'))))
    }

    async fn import_access(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<ImportAccess, Failure> {
        Ok(self.settings.access.credential(&uid_of(vmm), &Self::file_name(vmm, disk)))
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let uid = uid_of(vmm);
        self.lock_tasks().retain(|(u, _), task| {
            if *u == uid {
                task.handle.abort();
            }
            *u != uid
        });
        if vmm.spec.conversion.runner == ConversionRunner::Job
            && let Ok((api, _)) = self.jobs(vmm)
        {
            let selector =
                format!("{}={uid},{}=convert", crate::api::labels::MIGRATION_UID, crate::objects::LABEL_ROLE);
            if let Ok(list) = api.list(&ListParams::default().labels(&selector)).await {
                for j in list {
                    delete_by_uid(&api, &j.name_any(), j.metadata.uid.clone(), "a conversion Job").await?;
                }
            }
        }
        for dir in [
            Self::staging_root(&self.settings.work_dir).join(&uid),
            self.settings.work_dir.join("artifacts").join(&uid),
        ] {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_failure("removing staged data", e)),
            }
        }
        Ok(())
    }
}

/// `<staged>.<what>`: a staged raw disk's warm base or patch.
fn companion(staged: &Path, what: &str) -> PathBuf {
    let mut name = staged.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".{what}"));
    staged.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::FailureClass;

    #[test]
    fn a_guest_jobs_classified_failure_keeps_its_class_and_anything_else_is_retried() {
        let said = Failure::needs_human(Reason::VirtV2vFailed, "virt-v2v: no bootloader detected");
        let failure = job_failure("web-convert-guest", &serde_json::to_string(&said).unwrap());
        assert_eq!((failure.class, failure.reason), (FailureClass::NeedsHuman, Reason::VirtV2vFailed));
        assert_eq!(failure.message, "Job web-convert-guest: virt-v2v: no bootloader detected");

        let full = Failure::retryable(Reason::ConversionIoError, "write: No space left on device");
        let failure = job_failure("web-convert-guest", &serde_json::to_string(&full).unwrap());
        assert_eq!(failure.reason, Reason::WorkDirectoryFull, "a full disk is waited out: {failure:?}");

        let failure = job_failure("web-convert-0", "error: InvalidArtifact: qemu-img check failed");
        assert_eq!((failure.class, failure.reason), (FailureClass::Retryable, Reason::ConversionJobFailed));
        assert!(failure.message.ends_with("qemu-img check failed"), "{}", failure.message);

        // A message longer than a status holds is cut as any other.
        let long = Failure {
            class: FailureClass::Terminal,
            reason: Reason::JobRenderError,
            message: "x".repeat(100_000),
        };
        let failure = job_failure("web-convert-guest", &serde_json::to_string(&long).unwrap());
        assert!(failure.message.len() <= crate::machine::MAX_MESSAGE_BYTES, "{}", failure.message.len());
    }
}
