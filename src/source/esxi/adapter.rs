//! The real `EsxiHost` and `DiskStore` adapters: discovery and power over
//! SSH, and disk copies into a local store (one background task per disk).

use super::copy::{self, CopyError, CopyPlan, CopyResult};
use super::parse;
use super::ssh::{Credentials, Output, RemoteCommand, Secret, Session, SshError, Target};
use crate::api::Reason;
use crate::api::{SourceDisk, SourceInventory, SourcePowerState, VirtualMachineMigration};
use crate::machine::{CopyState, Failure};
use crate::metrics::Metrics;
use crate::ports::workdir::{copy_path, migration_copies_dir};
use crate::ports::{DiskStore, EsxiHost, PowerObservation};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::Api;
use kube::{Client, ResourceExt};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where credentials come from: a Kubernetes Secret, or fixed (tests, the demo).
#[derive(Clone)]
pub enum CredentialSource {
    Kubernetes(Client),
    Fixed(Credentials),
    /// The Secret mounted as files (a worker pod): read at every session,
    /// so a rotated Secret is used once the kubelet has updated the files.
    Directory(PathBuf),
}

pub(super) struct CopyTask {
    pub(super) progress: Arc<AtomicU64>,
    pub(super) total: u64,
    /// Set when the copy has its result, just before the controller is
    /// woken: the task may not have returned yet when it looks.
    pub(super) ended: Arc<std::sync::atomic::AtomicBool>,
    pub(super) handle: tokio::task::JoinHandle<Result<CopyResult, CopyError>>,
}

/// Settings of the disk store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub root: PathBuf,
    pub streams: usize,
    pub chunk_size: u64,
    /// Where finished copy runs count their bytes.
    pub metrics: Arc<Metrics>,
}

/// ESXi hosts over SSH plus the local disk store.
pub struct EsxiSource {
    credentials: CredentialSource,
    pub(super) store: StoreConfig,
    sessions: tokio::sync::Mutex<HashMap<String, Arc<Session>>>,
    pub(super) copies: Mutex<HashMap<(String, usize), CopyTask>>,
    /// Told when a copy ends.
    pub(super) wake: std::sync::OnceLock<crate::ports::Wake>,
}

impl Drop for EsxiSource {
    /// Copies belong to the controller process: they stop with it (and resume
    /// from their sidecar in the next one).
    fn drop(&mut self) {
        if let Ok(copies) = self.copies.lock() {
            for task in copies.values() {
                task.handle.abort();
            }
        }
    }
}

fn timeout_of(vmm: &VirtualMachineMigration) -> Duration {
    Duration::from_secs(vmm.spec.strategy.timeouts.ssh_seconds.max(1) as u64)
}

pub(super) fn vim_fault(what: &str, out: &Output) -> Option<Failure> {
    let fault = parse::parse_fault(&out.text())?;
    Some(match fault.kind.as_str() {
        "vim.fault.NotFound" => {
            Failure::needs_human(Reason::SourceVMNotFound, format!("{what}: {}", fault.msg))
        }
        "vim.fault.ToolsUnavailable" => {
            Failure::needs_human(Reason::ToolsNotRunning, format!("{what}: {}", fault.msg))
        }
        "vim.fault.InvalidPowerState" => {
            Failure::retryable(Reason::InvalidPowerState, format!("{what}: {}", fault.msg))
        }
        kind => Failure::retryable(Reason::HostFault, format!("{what}: {kind}: {}", fault.msg)),
    })
}

/// What authenticates a session: the cache key of [`EsxiSource::session`].
fn session_key(vmm: &VirtualMachineMigration, credentials: &Credentials) -> String {
    use sha2::{Digest, Sha256};
    let source = &vmm.spec.source;
    let mut digest = Sha256::new();
    for part in [
        source.host.to_ascii_lowercase().as_bytes(),
        source.port.to_string().as_bytes(),
        source.host_key.as_bytes(),
        vmm.namespace().unwrap_or_default().as_bytes(),
        source.credentials_secret_ref.name.as_bytes(),
        credentials.username.as_bytes(),
        match &credentials.secret {
            Secret::Password(p) => p.as_bytes(),
            Secret::PrivateKey(k) => k.as_bytes(),
        },
    ] {
        // Length-prefixed: no two different tuples hash the same bytes.
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    let kind: &[u8] = match &credentials.secret {
        Secret::Password(_) => b"password",
        Secret::PrivateKey(_) => b"key",
    };
    digest.update(kind);
    format!("{:x}", digest.finalize())
}

impl EsxiSource {
    pub fn new(credentials: CredentialSource, store: StoreConfig) -> EsxiSource {
        EsxiSource {
            credentials,
            store,
            sessions: tokio::sync::Mutex::new(HashMap::new()),
            copies: Mutex::new(HashMap::new()),
            wake: std::sync::OnceLock::new(),
        }
    }

    async fn credentials(&self, vmm: &VirtualMachineMigration) -> Result<Credentials, Failure> {
        let client = match &self.credentials {
            CredentialSource::Fixed(c) => return Ok(c.clone()),
            CredentialSource::Directory(dir) => {
                let read = |k: &str| std::fs::read_to_string(dir.join(k)).ok();
                return credentials_from(read, &format!("the credentials mounted at {}", dir.display()));
            }
            CredentialSource::Kubernetes(client) => client.clone(),
        };
        let name = &vmm.spec.source.credentials_secret_ref.name;
        let ns = vmm.namespace().unwrap_or_default();
        let secrets: Api<KubeSecret> = Api::namespaced(client, &ns);
        let secret = secrets
            .get_opt(name)
            .await
            .map_err(|e| {
                Failure::retryable(Reason::APIUnavailable, format!("reading Secret {ns}/{name}: {e}"))
            })?
            .ok_or_else(|| {
                Failure::needs_human(
                    Reason::CredentialsSecretMissing,
                    format!("Secret {ns}/{name} does not exist"),
                )
            })?;
        let data = secret.data.unwrap_or_default();
        credentials_from(
            |k| data.get(k).map(|v| String::from_utf8_lossy(&v.0).into_owned()),
            &format!("Secret {ns}/{name}"),
        )
    }
    /// A live session to the migration's host, reused across calls only by
    /// migrations that would open the very same one: same host, port and pinned
    /// key, same credentials (the Secret's namespace, name and version, and a
    /// digest of what it holds). A migration never rides a session another
    /// namespace's password opened.
    pub(super) async fn session(&self, vmm: &VirtualMachineMigration) -> Result<Arc<Session>, Failure> {
        let credentials = self.credentials(vmm).await?;
        let key = session_key(vmm, &credentials);
        let source = &vmm.spec.source;
        let mut sessions = self.sessions.lock().await;
        if let Some(session) = sessions.get(&key)
            && !session.is_closed()
        {
            return Ok(session.clone());
        }
        let target = Target {
            host: source.host.clone(),
            port: u16::try_from(source.port).unwrap_or(22),
            host_key: source.host_key.clone(),
            timeout: timeout_of(vmm),
        };
        let session = Arc::new(Session::connect(&target, &credentials).await.map_err(|e| e.failure())?);
        sessions.insert(key, session.clone());
        Ok(session)
    }

    pub(super) async fn run(
        &self,
        vmm: &VirtualMachineMigration,
        cmd: Result<RemoteCommand, SshError>,
    ) -> Result<Output, Failure> {
        let cmd = cmd.map_err(|e| e.failure())?;
        let session = self.session(vmm).await?;
        session.run(&cmd).await.map_err(|e| e.failure())
    }

    pub(super) fn vim_cmd(op: &str, vmid: &str) -> Result<RemoteCommand, SshError> {
        if vmid.is_empty() || !vmid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(SshError::InvalidArgument(format!("vmid {vmid:?}")));
        }
        RemoteCommand::new("vim-cmd")?.arg(op)?.arg(vmid)
    }

    pub(super) async fn find_vm(&self, vmm: &VirtualMachineMigration) -> Result<parse::VmListEntry, Failure> {
        let out = self.run(vmm, RemoteCommand::new("vim-cmd").and_then(|c| c.arg("vmsvc/getallvms"))).await?;
        let vms = parse::parse_getallvms(&out.stdout_text());
        let wanted = &vmm.spec.source.vm;
        let matches: Vec<_> = vms
            .iter()
            .filter(|v| match (&wanted.name, &wanted.id) {
                (Some(name), _) => v.name == *name,
                (None, Some(id)) => v.vmid == *id,
                (None, None) => false,
            })
            .collect();
        match matches.as_slice() {
            [one] => Ok((*one).clone()),
            [] => {
                let known: Vec<_> =
                    vms.iter().take(20).map(|v| format!("{:?} (vmid {})", v.name, v.vmid)).collect();
                Err(Failure::needs_human(
                    Reason::SourceVMNotFound,
                    format!(
                        "no VM {:?} on {}; the host has: {}",
                        wanted,
                        vmm.spec.source.host,
                        known.join(", ")
                    ),
                ))
            }
            many => Err(Failure::needs_human(
                Reason::AmbiguousVMName,
                format!("{} VMs are named {:?}; select one by spec.source.vm.id", many.len(), wanted.name),
            )),
        }
    }

    fn vmid(vmm: &VirtualMachineMigration) -> Option<String> {
        vmm.status.as_ref()?.source_inventory.as_ref().map(|i| i.vmid.clone())
    }

    pub(super) async fn vmid_or_find(&self, vmm: &VirtualMachineMigration) -> Result<String, Failure> {
        match Self::vmid(vmm) {
            Some(id) => Ok(id),
            None => Ok(self.find_vm(vmm).await?.vmid),
        }
    }

    async fn power_state(
        &self,
        vmm: &VirtualMachineMigration,
        vmid: &str,
    ) -> Result<SourcePowerState, Failure> {
        let out = self.run(vmm, Self::vim_cmd("vmsvc/power.getstate", vmid)).await?;
        if let Some(fault) = vim_fault("power.getstate", &out) {
            return Err(fault);
        }
        parse::parse_power_state(&out.text()).ok_or_else(|| {
            Failure::retryable(Reason::UnparsableOutput, format!("power.getstate printed {:?}", out.text()))
        })
    }

    pub(super) fn local_path(&self, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
        copy_path(&self.store.root, vmm, disk)
    }

    fn migration_dir(&self, vmm: &VirtualMachineMigration) -> PathBuf {
        migration_copies_dir(&self.store.root, vmm)
    }

    /// The state of the task under `key` while it runs, and once it ended
    /// its failure (reported once: the entry goes; what it left is discarded
    /// only when `may_discard`); `None` when the files must speak.
    pub(super) async fn task_state(
        &self,
        key: &(String, usize),
        what: &str,
        may_discard: bool,
    ) -> Option<CopyState> {
        let finished = {
            let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
            match copies.get(key) {
                Some(task) if !task.handle.is_finished() && !task.ended.load(Ordering::Acquire) => {
                    return Some(CopyState::InProgress {
                        bytes_done: task.progress.load(Ordering::Relaxed) as i64,
                        bytes_total: task.total as i64,
                    });
                }
                Some(_) => copies.remove(key),
                None => None,
            }
        }?;
        match finished.handle.await {
            Ok(Err(err)) => {
                let (failure, discard) = err.failure();
                Some(CopyState::Failed { failure, discard: discard && may_discard })
            }
            Err(join) if join.is_panic() => Some(CopyState::Failed {
                failure: Failure::retryable(Reason::CopyTaskPanicked, format!("{what} panicked")),
                discard: may_discard,
            }),
            _ => None,
        }
    }

    /// The VM's `.vmx` on the host (its path) and what it says.
    pub(super) async fn read_vmx(
        &self,
        vmm: &VirtualMachineMigration,
        entry: &parse::VmListEntry,
    ) -> Result<(String, parse::VmxFacts), Failure> {
        let vmx_path = if entry.datastore.is_empty() {
            entry.vmx_path.clone()
        } else {
            format!("/vmfs/volumes/{}/{}", entry.datastore, entry.vmx_path)
        };
        let vmx = self.run(vmm, head(&vmx_path)).await?;
        if vmx.exit_status != Some(0) {
            return Err(Failure::retryable(
                Reason::VmxUnreadable,
                format!("cannot read {vmx_path}: {}", vmx.text().trim()),
            ));
        }
        Ok((vmx_path, parse::vmx_facts(&parse::parse_vmx(&vmx.stdout_text()))))
    }

    pub(super) fn disk_of(vmm: &VirtualMachineMigration, disk: usize) -> Option<SourceDisk> {
        vmm.status.as_ref()?.source_inventory.as_ref()?.disks.get(disk).cloned()
    }

    pub(super) fn task_key(vmm: &VirtualMachineMigration, disk: usize) -> (String, usize) {
        (vmm.metadata.uid.clone().unwrap_or_default(), disk)
    }

    /// Runs a copy (`run`, given its progress counter) in the background
    /// under `key`: its bytes are counted when it ends (`bytes_read` excludes
    /// what a resume skipped), then it is marked ended and its migration woken.
    pub(super) fn spawn_copy<F>(
        &self,
        vmm: &VirtualMachineMigration,
        key: (String, usize),
        total: u64,
        run: impl FnOnce(Arc<AtomicU64>) -> F,
    ) where
        F: std::future::Future<Output = Result<CopyResult, CopyError>> + Send + 'static,
    {
        let progress = Arc::new(AtomicU64::new(0));
        let copying = run(progress.clone());
        let metrics = self.store.metrics.clone();
        let wake = self.wake.get().cloned();
        let (namespace, name) = (vmm.metadata.namespace.clone().unwrap_or_default(), vmm.name_any());
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task_ended = ended.clone();
        let handle = tokio::spawn(async move {
            let result = copying.await;
            if let Ok(done) = &result {
                metrics.copied_bytes(done.bytes_read);
            }
            task_ended.store(true, Ordering::Release);
            if let Some(wake) = wake {
                wake(&namespace, &name);
            }
            result
        });
        if let Ok(mut copies) = self.copies.lock() {
            copies.insert(key, CopyTask { progress, total, ended, handle });
        }
    }
}

/// Credentials from a Secret's keys: `username` (default `root`), and
/// `privateKey` (or `ssh-privatekey`) or `password`; `what` names the Secret
/// in the error.
fn credentials_from(field: impl Fn(&str) -> Option<String>, what: &str) -> Result<Credentials, Failure> {
    let username = field("username").map(|u| u.trim().to_owned()).unwrap_or_else(|| "root".into());
    let secret = match (field("password"), field("privateKey").or_else(|| field("ssh-privatekey"))) {
        (_, Some(key)) => Secret::PrivateKey(key),
        (Some(password), None) => Secret::Password(password),
        (None, None) => {
            return Err(Failure::needs_human(
                Reason::CredentialsSecretInvalid,
                format!("{what} has neither `password` nor `privateKey`"),
            ));
        }
    };
    Ok(Credentials { username, secret })
}

/// `head -c 1 MiB` of a file on the host: how the `.vmx` and descriptors are read.
pub(super) fn head(path: &str) -> Result<RemoteCommand, SshError> {
    RemoteCommand::new("head").and_then(|c| c.arg("-c")?.arg("1048576")?.arg(path))
}

/// The key of a disk's warm delta task in the copy table: apart from its base copy.
pub(super) fn delta_key_uid(uid: &str) -> String {
    format!("{uid}/delta")
}

pub(super) fn join(dir: &str, file: &str) -> String {
    if file.starts_with('/') { file.to_owned() } else { format!("{}/{file}", dir.trim_end_matches('/')) }
}

pub(super) fn parent(path: &str) -> &str {
    path.rsplit_once('/').map(|(d, _)| d).unwrap_or("")
}

#[async_trait]
impl EsxiHost for EsxiSource {
    async fn discover(&self, vmm: &VirtualMachineMigration) -> Result<SourceInventory, Failure> {
        let entry = self.find_vm(vmm).await?;
        let vmid = entry.vmid.clone();
        let power = self.power_state(vmm, &vmid).await?;
        let snapshots = self.run(vmm, Self::vim_cmd("vmsvc/snapshot.get", &vmid)).await?;
        let message = self.run(vmm, Self::vim_cmd("vmsvc/message", &vmid)).await?;
        let guest = self.run(vmm, Self::vim_cmd("vmsvc/get.guest", &vmid)).await?;
        let guest = parse::parse_guest_info(&guest.text());
        let version = self.run(vmm, RemoteCommand::new("vmware").and_then(|c| c.arg("-v"))).await?;
        let (vmx_path, facts) = self.read_vmx(vmm, &entry).await?;
        let vm_dir = parent(&vmx_path).to_owned();
        let mut disks = Vec::new();
        for (index, disk) in facts.disks.iter().enumerate() {
            let descriptor_path = join(&vm_dir, &disk.file_name);
            let text = self.run(vmm, head(&descriptor_path)).await?;
            let descriptor = parse::parse_descriptor(&text.stdout_text());
            let (extent_path, capacity, create_type) = match &descriptor {
                Some(d) => {
                    let extent = d
                        .extents
                        .first()
                        .map(|e| join(parent(&descriptor_path), &e.file))
                        .unwrap_or_default();
                    (extent, d.capacity_bytes() as i64, d.create_type.clone())
                }
                None => (descriptor_path.clone(), 0, String::new()),
            };
            disks.push(SourceDisk {
                index: index as i32,
                device: disk.device.clone(),
                bus: disk.bus.clone(),
                controller_model: disk.controller_model.clone(),
                descriptor_path,
                extent_path,
                capacity_bytes: capacity,
                create_type,
                mode: disk.mode.clone(),
            });
        }
        let cores = facts.cores_per_socket.max(1);
        Ok(SourceInventory {
            vmid,
            name: entry.name.clone(),
            vmx_path: if entry.datastore.is_empty() {
                entry.vmx_path.clone()
            } else {
                format!("[{}] {}", entry.datastore, entry.vmx_path)
            },
            guest_os: if entry.guest_id.is_empty() { facts.guest_os.clone() } else { entry.guest_id.clone() },
            esxi_version: parse::parse_version(&version.text()).unwrap_or_default(),
            firmware: facts.firmware,
            secure_boot: facts.secure_boot,
            bios_uuid: facts.bios_uuid.clone(),
            cpu_sockets: (facts.num_cpus.max(1) / cores).max(1),
            cores_per_socket: cores,
            memory_mib: facts.memory_mib,
            power_state: power,
            // The snapshot a warm migration takes itself is not the user's.
            snapshots: parse::parse_snapshots(&snapshots.text())
                .iter()
                .filter(|s| s.name != crate::api::snapshot_name(&vmm.name_any()))
                .count() as i32,
            pending_question: parse::parse_message(&message.text()),
            disks,
            nics: facts
                .nics
                .iter()
                .map(|n| crate::api::SourceNic {
                    device: n.device.clone(),
                    model: n.model.clone(),
                    network: n.network.clone(),
                    mac_address: n.mac_address.clone(),
                })
                .collect(),
            ip_addresses: guest
                .map(|g| g.nics.iter().flat_map(|n| n.ip_addresses.clone()).collect())
                .unwrap_or_default(),
        })
    }

    async fn power(&self, vmm: &VirtualMachineMigration) -> Result<PowerObservation, Failure> {
        let vmid = self.vmid_or_find(vmm).await?;
        let state = self.power_state(vmm, &vmid).await?;
        let guest = self.run(vmm, Self::vim_cmd("vmsvc/get.guest", &vmid)).await?;
        let tools_running = parse::parse_guest_info(&guest.text()).is_some_and(|g| g.tools_running());
        Ok(PowerObservation { state, tools_running })
    }

    async fn request_shutdown(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let vmid = self.vmid_or_find(vmm).await?;
        if self.power_state(vmm, &vmid).await? == SourcePowerState::PoweredOff {
            return Ok(());
        }
        let out = self.run(vmm, Self::vim_cmd("vmsvc/power.shutdown", &vmid)).await?;
        match vim_fault("power.shutdown", &out) {
            Some(f) if f.reason == Reason::InvalidPowerState => Ok(()),
            Some(f) => Err(f),
            None => Ok(()),
        }
    }

    async fn snapshot_id(
        &self,
        vmm: &VirtualMachineMigration,
        name: &str,
    ) -> Result<Option<String>, Failure> {
        Ok(self.snapshots(vmm).await?.into_iter().find(|s| s.name == name).map(|s| s.id))
    }

    async fn create_snapshot(
        &self,
        vmm: &VirtualMachineMigration,
        name: &str,
        quiesce: bool,
    ) -> Result<(), Failure> {
        self.ensure_snapshot(vmm, name, quiesce).await.map(|_| ())
    }

    async fn remove_snapshot(&self, vmm: &VirtualMachineMigration, name: &str) -> Result<(), Failure> {
        EsxiSource::remove_snapshot(self, vmm, name).await.map(|_| ())
    }

    async fn power_off(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let vmid = self.vmid_or_find(vmm).await?;
        if self.power_state(vmm, &vmid).await? == SourcePowerState::PoweredOff {
            return Ok(());
        }
        let out = self.run(vmm, Self::vim_cmd("vmsvc/power.off", &vmid)).await?;
        if let Some(f) = vim_fault("power.off", &out)
            && f.reason != "InvalidPowerState"
        {
            return Err(f);
        }
        match self.power_state(vmm, &vmid).await? {
            SourcePowerState::PoweredOff => Ok(()),
            other => Err(Failure::retryable(
                Reason::PowerOffNotObserved,
                format!("after power.off the VM is {other:?}"),
            )),
        }
    }
}

#[async_trait]
impl DiskStore for EsxiSource {
    fn notify_on_finish(&self, wake: crate::ports::Wake) {
        let _ = self.wake.set(wake);
    }

    async fn copy_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        if let Some(state) = self.task_state(&Self::task_key(vmm, disk), "the copy task", true).await {
            return state;
        }
        let local = self.local_path(vmm, disk);
        if let Some(m) = copy::is_complete(&local) {
            return CopyState::Complete {
                size: m.size as i64,
                sha256: m.sha256,
                verified_remotely: m.verified,
                epoch: m.epoch,
            };
        }
        let present = copy::bytes_present(&local);
        let total = Self::disk_of(vmm, disk).map(|d| d.capacity_bytes).unwrap_or(0);
        if present > 0 {
            CopyState::Partial { bytes_done: present as i64, bytes_total: total }
        } else {
            CopyState::Absent
        }
    }

    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        let key = Self::task_key(vmm, disk);
        if self.copies.lock().map(|c| c.contains_key(&key)).unwrap_or(false) {
            return Ok(());
        }
        let local = self.local_path(vmm, disk);
        if copy::is_complete(&local).is_some() {
            return Ok(());
        }
        let source = Self::disk_of(vmm, disk).ok_or_else(|| {
            Failure::retryable(Reason::InventoryMissing, format!("no disk {disk} in the inventory"))
        })?;
        let session = self.session(vmm).await?;
        let plan = CopyPlan {
            chunk_size: self.store.chunk_size,
            streams: self.store.streams,
            epoch: vmm.status.as_ref().map_or(0, |s| s.epoch),
            ..CopyPlan::new(source.extent_path.clone(), local)
        };
        let total = source.capacity_bytes.max(0) as u64;
        self.spawn_copy(vmm, key, total, move |progress| async move {
            copy::copy_disk(session, &plan, progress).await
        });
        Ok(())
    }

    async fn delta_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        self.warm_delta_state(vmm, disk).await
    }

    async fn start_delta_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        self.warm_start_delta_copy(vmm, disk).await
    }

    async fn discard_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure> {
        if let Some(task) = self.copies.lock().ok().and_then(|mut c| c.remove(&Self::task_key(vmm, disk))) {
            task.handle.abort();
        }
        copy::discard(&self.local_path(vmm, disk)).map_err(|e| {
            Failure::retryable(Reason::LocalDiskError, format!("removing the copy of disk {disk}: {e}"))
        })
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let uid = vmm.metadata.uid.clone().unwrap_or_default();
        if let Ok(mut copies) = self.copies.lock() {
            let delta_uid = delta_key_uid(&uid);
            copies.retain(|(u, _), task| {
                let ours = *u == uid || *u == delta_uid;
                if ours {
                    task.handle.abort();
                }
                !ours
            });
        }
        remove_dir(&self.migration_dir(vmm))
    }
}

fn remove_dir(dir: &Path) -> Result<(), Failure> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Failure::retryable(Reason::LocalDiskError, format!("removing {}: {e}", dir.display()))),
    }
}
