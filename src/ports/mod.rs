//! The ports through which the controller touches the world: the small core
//! that both sides depend on (as linkerd's policy-controller-core is), so the
//! adapters (`source`, `convert`, `destination`) import neither the
//! controller nor each other. Each port has one real implementation (ESXi
//! over SSH, qemu-img, the staging server, the Kubernetes API) and one
//! in-memory simulation (the tests' `support::sim`).
//!
//! Every operation is idempotent and every error is a classified
//! `machine::Failure` with a stable reason. Adapters receive the migration
//! object as read from the API server; names they derive are deterministic
//! (`machine::data_volume_name`, `machine::artifact_key`).

use crate::api::{
    GuestConversion, LeftOnSource, SourceInventory, SourcePowerState, ValidationCheck,
    VirtualMachineMigration,
};
use crate::machine::{
    ArtifactState, CheckResult, CopyState, DataVolumeState, Failure, GuestConverterFacts, PreflightFacts,
    StartingFacts, VmState,
};
use async_trait::async_trait;
use std::sync::Arc;

pub(crate) mod kube_errors;
pub(crate) mod workdir;

/// Power as `power.getstate` and `get.guest` report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PowerObservation {
    pub state: SourcePowerState,
    pub tools_running: bool,
}

/// The source ESXi host. Discovery and power reads are read-only.
#[async_trait]
pub trait EsxiHost: Send + Sync {
    /// Finds the VM and reads its inventory (vim-cmd, .vmx, descriptors).
    async fn discover(&self, vmm: &VirtualMachineMigration) -> Result<SourceInventory, Failure>;
    /// `power.getstate` plus whether VMware Tools runs.
    async fn power(&self, vmm: &VirtualMachineMigration) -> Result<PowerObservation, Failure>;
    /// `power.shutdown`: asks the guest to shut down; returns at once.
    async fn request_shutdown(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// `power.off`: hard power-off. "Already off" is success.
    async fn power_off(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// What the host's `stat` says of each extent in `paths` now (size and
    /// mtime, the token a copy records in `CopyState::Complete::source`);
    /// `"unreadable"` for one it cannot stat. No default: every
    /// implementation says.
    async fn extent_stats(
        &self,
        vmm: &VirtualMachineMigration,
        paths: &[String],
    ) -> Result<Vec<String>, Failure>;
    /// The id of the source's snapshot `name`, if it has one.
    async fn snapshot_id(
        &self,
        _vmm: &VirtualMachineMigration,
        _name: &str,
    ) -> Result<Option<String>, Failure> {
        Err(unsupported("snapshots of the source"))
    }
    /// Creates snapshot `name` (no memory; quiesced when asked) unless it exists.
    async fn create_snapshot(
        &self,
        _vmm: &VirtualMachineMigration,
        _name: &str,
        _quiesce: bool,
    ) -> Result<(), Failure> {
        Err(unsupported("snapshots of the source"))
    }
    /// Removes snapshot `name` if it exists (only vmmigrate's own).
    async fn remove_snapshot(&self, _vmm: &VirtualMachineMigration, _name: &str) -> Result<(), Failure> {
        Err(unsupported("snapshots of the source"))
    }
}

/// `User-Agent` of every request vmmigrate makes to the API server:
/// `vmmigrate/<version> (<component>)`, so that audit logs, API priority
/// rules and the API server's metrics tell its calls (and its parts) apart.
pub fn user_agent(component: &str) -> String {
    format!("vmmigrate/{} ({component})", env!("CARGO_PKG_VERSION"))
}

/// A client of the cluster this process runs in (or of the kubeconfig's
/// context), whose requests say [`user_agent`]`(component)`.
pub(crate) async fn kube_client(component: &str) -> anyhow::Result<kube::Client> {
    let mut config = kube::Config::infer().await?;
    config.headers.push((http::header::USER_AGENT, http::HeaderValue::from_str(&user_agent(component))?));
    Ok(kube::Client::try_from(config)?)
}

/// [`EsxiHost::extent_stats`] of an extent the host could not stat.
pub const UNREADABLE_EXTENT: &str = "unreadable";

/// What an adapter that cannot do `what` answers: a person must choose another way.
fn unsupported(what: &str) -> Failure {
    Failure::needs_human(
        crate::api::Reason::SnapshotFailed,
        format!(
            "{what}: not supported by this data plane (use spec.mode Cold, or the in-process data plane)"
        ),
    )
}

/// Asks the controller to look at a migration (`namespace`, `name`) again now:
/// work an adapter runs in the background has ended.
pub type Wake = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Local copies of the source disks (deterministic paths per migration and disk).
#[async_trait]
pub trait DiskStore: Send + Sync {
    /// Whom to tell when a copy ends (done or failed), so the migration does
    /// not wait for its next poll. Adapters without background work ignore it.
    fn notify_on_finish(&self, _wake: Wake) {}
    /// Asked at validation, before anything irreversible: what would keep
    /// this store from running the migration, for a person (`None`: nothing).
    async fn preflight(&self, _vmm: &VirtualMachineMigration) -> Result<Option<String>, Failure> {
        Ok(None)
    }
    /// The state of disk `disk`'s copy. A failure of a finished copy is
    /// reported once; afterwards the partial data shows as `Partial` or `Absent`.
    async fn copy_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState;
    /// Starts or resumes the copy; a no-op while it runs or once it is complete.
    async fn start_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    /// Removes a failed or corrupt copy of one disk.
    async fn discard_copy(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    /// Removes every copy of this migration. "Not found" is success.
    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Warm mode, after the cutover: the deltas of disk `disk` copied and the
    /// disk assembled from its base copy and them. `Complete` carries the
    /// assembled disk's size and sha256 (it replaces the base copy).
    async fn delta_state(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> CopyState {
        CopyState::Failed { failure: unsupported("warm migration"), discard: false }
    }
    /// Starts copying disk `disk`'s deltas and assembling it; a no-op while
    /// that runs or once it is done.
    async fn start_delta_copy(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Err(unsupported("warm migration"))
    }
    /// Warm, once disk `disk` is assembled: the ranges its deltas changed,
    /// as a patch for a volume holding its base; `None` where the store made
    /// none (the volume is then filled whole).
    async fn patch(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Option<crate::api::DiskPatch> {
        None
    }
}

/// Turns an acquired disk into the artifact CDI imports.
#[async_trait]
pub trait Converter: Send + Sync {
    /// Whom to tell when a conversion this process runs ends, as for
    /// [`DiskStore::notify_on_finish`].
    fn notify_on_finish(&self, _wake: Wake) {}
    /// The artifact of disk `disk` (`staged_url` is left to `Staging`).
    async fn artifact_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> ArtifactState;
    async fn start_conversion(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    async fn discard_artifact(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    /// Whether a guest can be converted where conversions run (virt-v2v,
    /// virtio-win); asked at Validated, before anything is powered off.
    fn guest_converter(&self) -> GuestConverterFacts {
        GuestConverterFacts::default()
    }
    /// What converting the guest did, once its converted disks exist
    /// (`None` when the guest was not converted, or not yet).
    async fn guest_conversion(&self, _vmm: &VirtualMachineMigration) -> Option<GuestConversion> {
        None
    }
}

/// What CDI needs to fetch one artifact: the basic-auth pair for its Secret
/// and the CA for its ConfigMap.
#[derive(Clone, PartialEq, Eq)]
pub struct ImportAccess {
    pub access_key_id: String,
    pub secret_key: String,
    pub ca_pem: String,
}

impl std::fmt::Debug for ImportAccess {
    /// The secret never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportAccess").field("access_key_id", &self.access_key_id).finish_non_exhaustive()
    }
}

/// Where CDI fetches artifacts from.
#[async_trait]
pub trait Staging: Send + Sync {
    /// The URL when the artifact with this checksum is published, else `None`.
    async fn staged_url(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        sha256: &str,
    ) -> Result<Option<String>, Failure>;
    async fn stage(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    /// What CDI needs to fetch disk `disk`'s staged artifact, and nothing else.
    async fn import_access(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<ImportAccess, Failure>;
    /// Removes everything staged for this migration. "Not found" is success.
    async fn remove_all(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Whether [`Self::stage_base`] can publish base copies here.
    fn stages_bases(&self) -> bool {
        false
    }
    /// Warm, before the cutover: publishes disk `disk`'s base copy (its
    /// sha256 `sha256`) beside where its artifact will be, under the
    /// artifact's credentials, and returns its URL; `None` where this
    /// staging cannot (the copies live elsewhere).
    async fn stage_base(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
        _sha256: &str,
    ) -> Result<Option<String>, Failure> {
        Ok(None)
    }
}

/// The destination cluster: DataVolumes, the VirtualMachine and its VMI.
#[async_trait]
pub trait Cluster: Send + Sync {
    async fn preflight(&self, vmm: &VirtualMachineMigration) -> Result<PreflightFacts, Failure>;
    async fn data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<DataVolumeState, Failure>;
    /// Creates `<name>-disk-<n>` if absent ("already exists" is success),
    /// with the Secret and ConfigMap through which CDI uses `access`.
    async fn create_data_volume(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
        access: &ImportAccess,
    ) -> Result<(), Failure>;
    /// "Not found" is success.
    async fn delete_data_volume(&self, vmm: &VirtualMachineMigration, disk: usize) -> Result<(), Failure>;
    async fn vm(&self, vmm: &VirtualMachineMigration) -> Result<VmState, Failure>;
    /// Creates the VirtualMachine with runStrategy Halted if absent.
    async fn create_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Updates our VirtualMachine to the rendered spec.
    async fn update_vm(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    async fn starting(&self, vmm: &VirtualMachineMigration) -> Result<StartingFacts, Failure>;
    /// The last lines the destination guest printed on its serial console
    /// (KubeVirt's `guest-console-log`); `None` where there is none to read.
    async fn guest_console(&self, _vmm: &VirtualMachineMigration) -> Result<Option<String>, Failure> {
        Ok(None)
    }
    async fn set_run_strategy(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Deletes the DataVolumes and the VirtualMachine this migration created.
    async fn delete_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Removes this migration's owner references from them.
    async fn release_destination(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure>;
    /// Gives up the migration's claim on its source VM (taken in `preflight`)
    /// when the migration is deleted. "Not held" is success.
    async fn release_source(&self, _vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        Ok(())
    }
    /// Records, in the controller's own namespace, what a deleted migration
    /// left on its source: it outlives the migration and its namespace, and
    /// the gitops side writes it to Git. Recording it again is success.
    async fn record_left_on_source(&self, left: &LeftOnSource) -> Result<(), Failure>;
    /// Whether the installed DataVolume definition has
    /// `spec.source.http.checksum` (CDI v1.65 and later check it). No
    /// default: every implementation (the simulations included) says.
    async fn cdi_verifies_checksum(&self) -> Result<bool, Failure>;
    /// For a succeeded DataVolume: `None` when CDI checked its checksum (the
    /// stored DataVolume kept the field), else the state of the Job that
    /// reads the volume back. No default, as above.
    async fn import_check(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<Option<crate::machine::VolumeCheck>, Failure>;
    /// Whether raw disks go into blank DataVolumes this cluster fills
    /// itself, the fill Job standing where the verify Job stands
    /// (`destination::fill`); asked while a DataVolume is to be made.
    async fn fills_volumes(&self) -> bool {
        false
    }
    /// Starts the verify Job that reads disk `disk`'s succeeded DataVolume back.
    async fn start_volume_check(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
    /// Starts the fill Job of disk `disk`'s blank DataVolume
    /// (`ImportVerification::Filled`), with the artifact's credentials and
    /// CA applied first. Its state is read by [`Self::import_check`].
    async fn start_fill(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
        _access: &ImportAccess,
    ) -> Result<(), Failure> {
        Ok(())
    }
    async fn delete_volume_check(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
    /// Warm, before the cutover: the Job filling disk `disk`'s blank volume
    /// with its base (`None` where this cluster fills nothing).
    async fn base_fill(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
    ) -> Result<Option<crate::machine::VolumeCheck>, Failure> {
        Ok(None)
    }
    /// Starts that Job: the base staged at `url`, its sha256 `sha256`.
    async fn start_base_fill(
        &self,
        _vmm: &VirtualMachineMigration,
        _disk: usize,
        _base: (&str, &str),
        _access: &ImportAccess,
    ) -> Result<(), Failure> {
        Ok(())
    }
    /// Deletes it (it filled another base than the one now copied).
    async fn delete_base_fill(&self, _vmm: &VirtualMachineMigration, _disk: usize) -> Result<(), Failure> {
        Ok(())
    }
}

/// Read-only application checks.
#[async_trait]
pub trait Prober: Send + Sync {
    async fn check(&self, vmm: &VirtualMachineMigration, check: &ValidationCheck) -> CheckResult;
}

/// The set of adapters one controller uses.
#[derive(Clone)]
pub struct Adapters {
    pub esxi: Arc<dyn EsxiHost>,
    pub disks: Arc<dyn DiskStore>,
    pub converter: Arc<dyn Converter>,
    pub staging: Arc<dyn Staging>,
    pub cluster: Arc<dyn Cluster>,
    pub prober: Arc<dyn Prober>,
}
