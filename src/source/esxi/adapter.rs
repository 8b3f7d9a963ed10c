//! The real `EsxiHost` and `DiskStore` adapters: discovery and power over
//! SSH, and disk copies into a local store (one background task per disk).

use super::copy::{self, CopyError, CopyPlan, CopyResult};
use super::parse;
use super::ssh::{Credentials, Output, RemoteCommand, Secret, Session, SshError, Target};
use crate::api::Reason;
use crate::api::{SourceDisk, SourceInventory, SourcePowerState, VirtualMachineMigration};
use crate::machine::tenancy::{CREDENTIAL_HOSTS_ANNOTATION, credential_refusal};
use crate::machine::{CopyState, Failure};
use crate::metrics::Metrics;
use crate::ports::workdir::{copy_path, migration_copies_dir};
use crate::ports::{DiskStore, EsxiHost, PowerObservation, UNREADABLE_EXTENT};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::Api;
use kube::{Client, ResourceExt};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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

/// What the copy table holds under a key: a start under way, or its task.
pub(super) enum CopyEntry {
    /// Reserved by a start before its first `.await` (the session, the
    /// disk chains) and until it spawns: another start of the key is a
    /// no-op, and the start spawns only if its `token` is still here (a
    /// discard in between wins).
    Starting {
        token: u64,
    },
    Running(CopyTask),
}

/// A key of the copy table held by one start until it spawns its task.
/// Dropped without spawning (a failure, a call cancelled by its timeout),
/// it frees the key.
pub(super) struct Reservation<'a> {
    source: &'a EsxiSource,
    key: (String, usize),
    token: u64,
}

impl Reservation<'_> {
    fn holds(&self, copies: &HashMap<(String, usize), CopyEntry>) -> bool {
        matches!(copies.get(&self.key), Some(CopyEntry::Starting { token }) if *token == self.token)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut copies = self.source.copies();
        if self.holds(&copies) {
            copies.remove(&self.key);
        }
    }
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
    /// One entry per disk copy (and per delta copy) started or being started:
    /// at most one task per key.
    pub(super) copies: Mutex<HashMap<(String, usize), CopyEntry>>,
    /// Tokens of [`Reservation`]s.
    next_token: AtomicU64,
    /// Told when a copy ends.
    pub(super) wake: std::sync::OnceLock<crate::ports::Wake>,
}

impl Drop for EsxiSource {
    /// Copies belong to the controller process: they stop with it (and resume
    /// from their sidecar in the next one).
    fn drop(&mut self) {
        for entry in self.copies().values() {
            if let CopyEntry::Running(task) = entry {
                task.handle.abort();
            }
        }
    }
}

fn timeout_of(vmm: &VirtualMachineMigration) -> Duration {
    vmm.spec.strategy.timeouts.ssh()
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
            next_token: AtomicU64::new(0),
            wake: std::sync::OnceLock::new(),
        }
    }

    /// The copy table, also after a panic elsewhere held it: a poisoned
    /// table read as empty would let every start spawn another task.
    pub(super) fn copies(&self) -> MutexGuard<'_, HashMap<(String, usize), CopyEntry>> {
        self.copies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves `key` for a start, before anything is awaited; `None` when
    /// a start or a task holds it already (the caller then does nothing).
    /// Checked and reserved under one lock: two starts of one key cannot
    /// both pass, however long the first waits for its session.
    pub(super) fn reserve(&self, key: (String, usize)) -> Option<Reservation<'_>> {
        let mut copies = self.copies();
        if copies.contains_key(&key) {
            return None;
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        copies.insert(key.clone(), CopyEntry::Starting { token });
        Some(Reservation { source: self, key, token })
    }

    async fn credentials(&self, vmm: &VirtualMachineMigration) -> Result<Credentials, Failure> {
        let client = match &self.credentials {
            CredentialSource::Fixed(c) => return Ok(c.clone()),
            CredentialSource::Directory(dir) => {
                // A worker pod's mounted Secret: the controller checked its
                // hosts before it made the pod; a `esxi-hosts` key is checked again.
                let read = |k: &str| std::fs::read_to_string(dir.join(k)).ok();
                let what = format!("the credentials mounted at {}", dir.display());
                if let Some(hosts) = read("esxi-hosts") {
                    bound_to_host(vmm, &what, Some(&hosts))?;
                }
                return credentials_from(read, &what);
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
        let data = secret.data.clone().unwrap_or_default();
        let field = |k: &str| data.get(k).map(|v| String::from_utf8_lossy(&v.0).into_owned());
        // Used only for the hosts it names (annotation, or an `esxi-hosts`
        // key), before anything reaches a host.
        let hosts =
            secret.annotations().get(CREDENTIAL_HOSTS_ANNOTATION).cloned().or_else(|| field("esxi-hosts"));
        bound_to_host(vmm, &format!("{ns}/{name}"), hosts.as_deref())?;
        credentials_from(field, &format!("Secret {ns}/{name}"))
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
        let out = session.run(&cmd).await.map_err(|e| e.failure())?;
        // A session that ends before its command's exit status (sshd
        // restarted, the connection cut) is the connection's failure: what
        // it printed so far is not the host's answer.
        if out.exit_status.is_none() {
            return Err(SshError::Protocol(format!(
                "the connection ended before {} reported its exit status",
                cmd.what
            ))
            .failure());
        }
        Ok(out)
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
            let mut copies = self.copies();
            match copies.get(key) {
                // Being started (another call waits for its session): no other start.
                Some(CopyEntry::Starting { .. }) => {
                    return Some(CopyState::InProgress { bytes_done: 0, bytes_total: 0 });
                }
                Some(CopyEntry::Running(task))
                    if !task.handle.is_finished() && !task.ended.load(Ordering::Acquire) =>
                {
                    return Some(CopyState::InProgress {
                        bytes_done: task.progress.load(Ordering::Relaxed) as i64,
                        bytes_total: task.total as i64,
                    });
                }
                Some(CopyEntry::Running(_)) => match copies.remove(key) {
                    Some(CopyEntry::Running(task)) => Some(task),
                    _ => None,
                },
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
        if on_datastore(&vmx_path).is_none() {
            return Err(Failure::needs_human(
                Reason::SourcePathRefused,
                format!("the host lists the VM's .vmx at {vmx_path:?}, not a file of a datastore folder"),
            ));
        }
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
    /// under the key `reservation` holds: its bytes are counted when it ends
    /// (`bytes_read` excludes what a resume skipped), then it is marked ended
    /// and its migration woken. Nothing runs if the reservation was taken
    /// away meanwhile (the copy was discarded or its migration removed).
    pub(super) fn spawn_copy<F>(
        &self,
        vmm: &VirtualMachineMigration,
        reservation: Reservation<'_>,
        total: u64,
        run: impl FnOnce(Arc<AtomicU64>) -> F,
    ) where
        F: std::future::Future<Output = Result<CopyResult, CopyError>> + Send + 'static,
    {
        let mut copies = self.copies();
        if !reservation.holds(&copies) {
            tracing::info!(key = ?reservation.key, "the copy was discarded while it started; not started");
            return;
        }
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
        // In place of the reservation, under the same lock: nobody sees the key free.
        copies
            .insert(reservation.key.clone(), CopyEntry::Running(CopyTask { progress, total, ended, handle }));
        // The table's lock goes before the reservation (whose drop takes it; it keeps the task).
        drop(copies);
        drop(reservation);
    }
}

/// `Err` (needs a person) unless the Secret `what`, whose host list is
/// `hosts`, may be used for the migration's host, port and pinned key.
fn bound_to_host(vmm: &VirtualMachineMigration, what: &str, hosts: Option<&str>) -> Result<(), Failure> {
    let source = &vmm.spec.source;
    match credential_refusal(what, hosts, &source.host, source.port, &source.host_key) {
        Some(why) => Err(Failure::needs_human(Reason::CredentialsNotForHost, why)),
        None => Ok(()),
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

/// `(datastore, folder)` of a file path under `/vmfs/volumes/<datastore>/<folder…>/<file>`
/// whose every segment is a plain name (not empty, `.` or `..`, no control
/// characters); `None` for anything else (`/etc/shadow`, `/vmfs/devices/…`, `../`).
fn on_datastore(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/vmfs/volumes/")?;
    let plain = |s: &str| !s.is_empty() && s != "." && s != ".." && !s.chars().any(char::is_control);
    if !rest.split('/').all(plain) || rest.split('/').count() < 3 {
        return None;
    }
    let (datastore, tail) = rest.split_once('/')?;
    Some((datastore, tail.rsplit_once('/')?.0))
}

/// A disk file the `.vmx` (or a delta's parent hint) names, resolved against
/// the VM's folder `vm_dir` and checked before anything reads it: a file of
/// the VM's own folder, or of the folder of the same name on another
/// datastore (where ESXi puts a disk placed there). A path out of it (an
/// absolute one elsewhere, `../`, a device) is for a person to look at.
pub(super) fn disk_file(vm_dir: &str, reference: &str) -> Result<String, Failure> {
    let path = join(vm_dir, reference);
    let vmx_beside = format!("{vm_dir}/x");
    let folder_of_vm = on_datastore(&vmx_beside).map(|(_, folder)| folder);
    match (on_datastore(&path), folder_of_vm) {
        (Some((_, folder)), Some(vm_folder)) if folder == vm_folder => Ok(path),
        _ => Err(Failure::needs_human(
            Reason::SourcePathRefused,
            format!(
                "the disk file {reference:?} resolves to {path:?}, outside the VM's folder {vm_dir:?}: vmmigrate reads only files of the VM's own folder under /vmfs/volumes; check the .vmx"
            ),
        )),
    }
}

/// The extent `file` a descriptor at `descriptor_path` names: a bare file
/// name, beside the descriptor.
pub(super) fn extent_file(descriptor_path: &str, file: &str) -> Result<String, Failure> {
    let path = join(parent(descriptor_path), file);
    if file.contains('/') || on_datastore(&path).is_none() {
        return Err(Failure::needs_human(
            Reason::SourcePathRefused,
            format!(
                "{descriptor_path} names the extent {file:?}, not a file beside it: vmmigrate reads only the VM's own files; check the descriptor"
            ),
        ));
    }
    Ok(path)
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
            let descriptor_path = disk_file(&vm_dir, &disk.file_name)?;
            let text = self.run(vmm, head(&descriptor_path)).await?;
            // A disk is read only through a descriptor that says what it is.
            let Some(d) = parse::parse_descriptor(&text.stdout_text()) else {
                return Err(Failure::needs_human(
                    Reason::DiskDescriptorInvalid,
                    format!(
                        "{descriptor_path} ({}) is not a VMDK descriptor: a person checks the disk",
                        disk.device
                    ),
                ));
            };
            let extent_path = match d.extents.first() {
                Some(e) => extent_file(&descriptor_path, &e.file)?,
                None => String::new(),
            };
            let (capacity, create_type) = (d.capacity_bytes() as i64, d.create_type.clone());
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

    async fn extent_stats(
        &self,
        vmm: &VirtualMachineMigration,
        paths: &[String],
    ) -> Result<Vec<String>, Failure> {
        let session = self.session(vmm).await?;
        let mut stats = Vec::with_capacity(paths.len());
        for path in paths {
            stats.push(match copy::source_identity(&session, path).await {
                Ok((_, printed)) => copy::stat_token(&printed),
                // The host answered and stat failed: the extent is gone or
                // moved, which is a change too.
                Err(CopyError::Stat(_)) => UNREADABLE_EXTENT.to_owned(),
                Err(e) => return Err(e.failure().0),
            });
        }
        Ok(stats)
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
                source: m.source,
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
        // Reserved before the first `.await` (the session): a second start
        // while this one connects finds the key taken and does nothing,
        // instead of passing the same check and spawning a second copy.
        let Some(reservation) = self.reserve(Self::task_key(vmm, disk)) else {
            return Ok(());
        };
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
        self.spawn_copy(vmm, reservation, total, move |progress| async move {
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
        // A start under way loses its reservation and does not spawn.
        if let Some(CopyEntry::Running(task)) = self.copies().remove(&Self::task_key(vmm, disk)) {
            task.handle.abort();
        }
        copy::discard(&self.local_path(vmm, disk)).map_err(|e| {
            Failure::retryable(Reason::LocalDiskError, format!("removing the copy of disk {disk}: {e}"))
        })
    }

    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let uid = vmm.metadata.uid.clone().unwrap_or_default();
        let delta_uid = delta_key_uid(&uid);
        self.copies().retain(|(u, _), entry| {
            let ours = *u == uid || *u == delta_uid;
            if ours && let CopyEntry::Running(task) = entry {
                task.handle.abort();
            }
            !ours
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::VirtualMachineMigrationStatus;

    /// A migration of one 2 GiB disk on a "host" at `port`.
    fn vmm(port: u16) -> VirtualMachineMigration {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(serde_json::json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": { "name": "web", "namespace": "apps", "uid": "u-1" },
            "spec": {
                "source": { "host": "127.0.0.1", "port": port, "hostKey": format!("SHA256:{}", "A".repeat(43)),
                            "credentialsSecretRef": { "name": "esxi-cred" }, "vm": { "name": "web" } },
                "destination": { "namespace": "apps", "storageClassName": "fast" },
            },
        }))
        .unwrap();
        vmm.status = Some(VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                disks: vec![SourceDisk {
                    index: 0,
                    extent_path: "/vmfs/volumes/ds1/web/web-flat.vmdk".into(),
                    capacity_bytes: 2 << 30,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        });
        vmm
    }

    /// The report: two `dd skip=0` of one extent in the same second. Two
    /// calls to start one disk's copy (a worker pod answers calls at once;
    /// two controller replicas during a handover) both passed the check
    /// while the first waited for its SSH session, and both spawned a copy
    /// the moment it was there. The second must find the key taken.
    #[tokio::test]
    async fn a_second_start_while_the_first_connects_starts_nothing() {
        // A "host" that accepts and never says a word: the first start waits in its session.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (accepted_tx, mut accepted) = tokio::sync::mpsc::unbounded_channel();
        let host = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
                let _ = accepted_tx.send(());
            }
        });
        let work = tempfile::tempdir().unwrap();
        let source = Arc::new(source_in(work.path()));
        let vmm = vmm(port);
        let first = tokio::spawn({
            let (source, vmm) = (source.clone(), vmm.clone());
            async move { source.start_copy(&vmm, 0).await }
        });
        tokio::time::timeout(Duration::from_secs(10), accepted.recv())
            .await
            .expect("the first start connects");

        let second = tokio::time::timeout(Duration::from_secs(3), source.start_copy(&vmm, 0)).await;
        assert!(
            matches!(second, Ok(Ok(()))),
            "a second start of a disk being started returns at once, starting nothing: {second:?}"
        );
        assert!(
            matches!(source.copy_state(&vmm, 0).await, CopyState::InProgress { .. }),
            "a copy being started is in progress: nobody asks for it again"
        );
        assert_eq!(source.copies().len(), 1);
        assert!(accepted.try_recv().is_err(), "one connection: the second start did not go to the host");

        // A start that never got its session (cancelled here, as by its call's
        // timeout) frees the key: the next start may go.
        first.abort();
        let _ = first.await;
        assert!(source.copies().is_empty(), "the reservation goes with its start");
        assert_eq!(source.copy_state(&vmm, 0).await, CopyState::Absent);
        host.abort();
    }

    /// A store in `root` with a password that no host checks.
    fn source_in(root: &std::path::Path) -> EsxiSource {
        let credentials = Credentials { username: "root".into(), secret: Secret::Password("pw".into()) };
        let store = StoreConfig {
            root: root.to_path_buf(),
            streams: 1,
            chunk_size: copy::DEFAULT_CHUNK_SIZE,
            metrics: Arc::new(Metrics::new()),
        };
        EsxiSource::new(CredentialSource::Fixed(credentials), store)
    }

    /// A discard while a start waits for its session wins: the start spawns nothing.
    #[tokio::test]
    async fn a_start_whose_reservation_was_discarded_spawns_nothing() {
        let work = tempfile::tempdir().unwrap();
        let source = source_in(work.path());
        let vmm = vmm(22);
        let key = EsxiSource::task_key(&vmm, 0);
        let reservation = source.reserve(key.clone()).expect("a free key");
        assert!(source.reserve(key.clone()).is_none(), "one start at a time");
        source.discard_copy(&vmm, 0).await.unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        source.spawn_copy(&vmm, reservation, 0, move |_| async move {
            flag.store(true, Ordering::SeqCst);
            Err(CopyError::Stat("never".into()))
        });
        tokio::task::yield_now().await;
        assert!(!ran.load(Ordering::SeqCst), "a discarded start spawns nothing");
        assert!(source.copies().is_empty());
    }
}
