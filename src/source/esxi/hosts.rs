//! The real `EsxiHost`: ESXi hosts over SSH. Credentials from the
//! migration's Secret (used only for the hosts it names), sessions reused
//! only by migrations that would open the very same one, discovery, power,
//! and the rules a path on the host must pass before anything reads it.

use super::copy::{self, CopyError};
use super::parse;
use super::ssh::{Credentials, Output, RemoteCommand, Secret, Session, SshError, Target};
use crate::api::Reason;
use crate::api::{SourceDisk, SourceInventory, SourcePowerState, VirtualMachineMigration};
use crate::machine::Failure;
use crate::machine::tenancy::{CREDENTIAL_HOSTS_ANNOTATION, credential_refusal};
use crate::ports::{EsxiHost, PowerObservation, UNREADABLE_EXTENT};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::Api;
use kube::{Client, ResourceExt};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
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

/// ESXi hosts over SSH: the sessions to them and what is asked of them.
pub struct EsxiHosts {
    credentials: CredentialSource,
    sessions: tokio::sync::Mutex<HashMap<String, Arc<Session>>>,
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

/// What authenticates a session: the cache key of [`EsxiHosts::session`].
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

impl EsxiHosts {
    pub fn new(credentials: CredentialSource) -> EsxiHosts {
        EsxiHosts { credentials, sessions: tokio::sync::Mutex::new(HashMap::new()) }
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
impl EsxiHost for EsxiHosts {
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
                    pci_slot: n.pci_slot,
                })
                .collect(),
            ip_addresses: guest
                .map(|g| g.nics.iter().flat_map(|n| n.ip_addresses.clone()).collect())
                .unwrap_or_default(),
            hardware: facts.hardware.clone(),
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
        EsxiHosts::remove_snapshot(self, vmm, name).await.map(|_| ())
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
