//! `status` of a VirtualMachineMigration: what the controller observed and recorded.
//! Written only by the controller, through server-side apply on `/status`.

use super::phase::Phase;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Most entries kept in `status.errors`; older ones are dropped first.
pub(crate) const MAX_ERRORS: usize = 10;
/// Most entries kept in `status.history`.
pub(crate) const MAX_HISTORY: usize = 64;

/// Observed state of a migration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineMigrationStatus {
    /// The checkpoint the controller is working on.
    #[serde(default)]
    pub phase: Phase,
    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// kstatus conditions (`Ready`, `Reconciling`, `Stalled`) and one per checkpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Milestones, each written once.
    #[serde(default)]
    pub timestamps: Timestamps,
    /// Phase entries in order, for the audit timeline (bounded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<PhaseTransition>,
    /// The most recent errors, newest last (bounded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<MigrationError>,
    /// The phase that failed last; Retryable returns to it, and so does the
    /// retry annotation (or a spec change) from ManualInterventionRequired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_phase: Option<Phase>,
    /// Set while a failed phase waits for its next attempt; kept while the phase
    /// is retried so attempts are counted, cleared when the phase succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryStatus>,
    /// Byte progress of the current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// What discovery found on the ESXi host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_inventory: Option<SourceInventory>,
    /// Reasons validation did not pass; empty once it does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blockers: Vec<Blocker>,
    /// What moves with a caveat (a virtual TPM's keys, a CD-ROM image, …),
    /// found at Validated: each a reason and what stays behind.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Blocker>,
    /// Per-disk evidence: checksums, artifact locations, DataVolume names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskStatus>,
    /// What converting the guest did (`spec.conversion.guest`), recorded
    /// when its converted disks were staged; absent when it was not converted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_conversion: Option<GuestConversion>,
    /// The KubeVirt VirtualMachine this migration created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "destinationVM")]
    pub destination_vm: Option<DestinationVm>,
    /// Result of each `spec.validation.checks` entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub validation_results: Vec<ValidationResult>,
    /// Why a validated migration does not go on yet (its wave, its cutover window or
    /// approval, a free read slot on its host); absent when it is not waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
    /// The snapshot a warm migration or a rehearsal took of its source: the
    /// only change either makes to the source besides a warm power-off, logged here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotRecord>,
    /// Warm, where vmmigrate fills the volumes: what each disk's volume was
    /// filled with before the cutover (its base, copied from the snapshot).
    /// An entry means the volume holds exactly those bytes; it goes when
    /// anything else writes the volume or the volume is made again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_bases: Vec<VolumeBase>,
    /// The mode the migration runs in, fixed when it left Validated: a later
    /// change of `spec.mode` is not applied (a rehearsal never turns into a
    /// migration that powers its source off, nor the reverse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<super::MigrationMode>,
    /// `spec.rehearsal` as it was when the migration left Validated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rehearsal: Option<super::RehearsalSpec>,
    /// The power-off epoch: how many times this migration recorded its source
    /// powered off. Copies carry the epoch they were made in; a power-on seen
    /// after a power-off ends the epoch and discards every copy made in it.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub epoch: i32,
    /// Every power action vmmigrate asked of the source, each recorded here
    /// before it was asked (write-ahead), newest last (bounded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub power_actions: Vec<PowerActionRecord>,
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

/// Most entries kept in `status.powerActions`.
pub(crate) const MAX_POWER_ACTIONS: usize = 16;

/// A power action on the source, recorded before it is asked of the host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PowerActionRecord {
    /// 1 for the migration's first power action, one more for each after
    /// (kept when older records are dropped from the list).
    pub seq: i32,
    /// `PowerOff` (`power.off`) or `Shutdown` (`power.shutdown`).
    pub action: PowerActionKind,
    /// The epoch it belongs to (the power-off it leads to is the next one).
    pub epoch: i32,
    /// The VM it addresses, as the inventory read just before said.
    pub vmid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bios_uuid: String,
    /// When it was recorded; the controller asks the host only after this
    /// record is written (the call may still fail: see `errors`).
    pub recorded: Time,
}

/// Which power action.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PowerActionKind {
    PowerOff,
    Shutdown,
}

/// What a validated migration waits for before the cutover.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    /// `WaitingForWave`, `WaveHeld`, `WaitingForWindow`, `CutoverWindowClosed`,
    /// `WaitingForApproval`, `WaitingForHostSlot` or `WaitingForClusterSlot`.
    pub reason: String,
    /// For people: e.g. `3rd in line for esx-07 (2 of 2 reads in use)`.
    pub message: String,
    /// When it started waiting for this reason.
    pub since: Time,
    /// The time it waits for, when it is a time (the window's start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Time>,
    /// 1-based place in the queue of its host, while waiting for a read slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<i32>,
}

/// A condition in the shape of Kubernetes `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// CamelCase condition type, e.g. `Ready`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    pub status: ConditionStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    pub last_transition_time: Time,
    /// Stable CamelCase reason, also used for Events and metrics.
    #[schemars(length(min = 1, max = 1024), regex(pattern = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"))]
    pub reason: String,
    #[serde(default)]
    #[schemars(length(max = 32768))]
    pub message: String,
}

/// `True`, `False` or `Unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// Milestones; each is written once and never re-decided.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Timestamps {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<Time>,
    /// When the source VM was observed powered off by (or for) this migration. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_powered_off: Option<Time>,
    /// When a graceful guest shutdown was first requested (start of the shutdown timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_requested: Option<Time>,
    /// When the requested runStrategy was first set (start of the starting timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_requested: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_started: Option<Time>,
    /// When the validation checks first ran (start of the validating timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_started: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<Time>,
    /// When the cutover of a migration with `spec.cutover.mode: Approval` was
    /// first seen approved. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cutover_approved: Option<Time>,
    /// When the destination's blank DataVolumes were asked for, as Preparing
    /// began, so that CDI provisions them while the disks are copied (where
    /// the controller fills raw disks itself). Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes_requested: Option<Time>,
    /// When the finishing work of a terminal phase (releasing or deleting the
    /// destination, removing staged data) was done. Set once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaned_up: Option<Time>,
}

/// A snapshot of the source VM that vmmigrate created (and removes).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRecord {
    /// `vmmigrate-<migration name>`.
    pub name: String,
    /// The host's snapshot id, once seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Whether it was taken quiesced (VMware Tools running).
    #[serde(default)]
    pub quiesced: bool,
    pub created: Time,
    /// When vmmigrate decided to remove it, recorded before it asks the host
    /// and once removing it can no longer change what is read (warm: at the
    /// cutover; a rehearsal: once its disks are copied): a snapshot gone
    /// without this was removed by someone else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removing: Option<Time>,
    /// When it was removed again (the host consolidated it into the base).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<Time>,
    /// Set when the migration was deleted and the snapshot could not be
    /// removed (the host or its credentials were gone): what stays, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_on_source: Option<String>,
    /// The epoch it was taken in: the base copies read from it carry it.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub epoch: i32,
}

/// A volume filled with its disk's base before the cutover.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeBase {
    pub disk: i32,
    /// sha256 of the base the fill Job wrote and hashed, hex.
    pub sha256: String,
    /// When the fill was proven; absent when it failed (`failed` says why)
    /// and the volume is filled whole after the cutover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filled: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// One entry in the phase timeline.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct PhaseTransition {
    pub phase: Phase,
    pub time: Time,
}

/// A recorded failure.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationError {
    pub time: Time,
    pub phase: Phase,
    /// Stable CamelCase reason.
    pub reason: String,
    pub message: String,
    pub retryable: bool,
}

/// The retry in progress.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryStatus {
    /// The phase that failed. Its attempts are counted until it succeeds.
    pub phase: Phase,
    /// An earlier phase to resume from when the failure's cause lies there
    /// (a failed import re-checks the artifact in Converting; a corrupt copy
    /// is copied again in Preparing). Absent: `phase` itself is resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Phase>,
    /// 1 for the first retry; counts consecutive failures until `phase` succeeds.
    pub attempt: i32,
    pub next_attempt_at: Time,
}

/// Byte progress.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub bytes_done: i64,
    pub bytes_total: i64,
    #[schemars(range(min = 0, max = 100))]
    pub percent: i32,
    /// Rate between the last two observations, all disks together.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_per_second: i64,
    /// When these numbers were observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated: Option<Time>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskProgress>,
}

/// Byte progress of one disk.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskProgress {
    pub index: i32,
    pub bytes_done: i64,
    pub bytes_total: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_per_second: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// The source VM as discovered over SSH.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceInventory {
    pub vmid: String,
    pub name: String,
    /// Datastore path of the .vmx, e.g. `[datastore1] web/web.vmx`.
    pub vmx_path: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub guest_os: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub esxi_version: String,
    pub firmware: Firmware,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub secure_boot: bool,
    /// The VM's BIOS UUID (`uuid.bios` of its .vmx): with host and vmid, what
    /// claims the source VM for one migration cluster-wide.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bios_uuid: String,
    pub cpu_sockets: i32,
    pub cores_per_socket: i32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: i64,
    pub power_state: SourcePowerState,
    #[serde(default)]
    pub snapshots: i32,
    /// Text of a question the VM is waiting on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_question: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<SourceDisk>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<SourceNic>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_addresses: Vec<String>,
    /// What the VM has beyond CPU, memory, disks and NICs that a KubeVirt VM
    /// cannot carry, or carries only in part (docs/compatibility.md).
    #[serde(default, skip_serializing_if = "SourceHardware::is_empty")]
    pub hardware: SourceHardware,
}

/// The source VM's devices and settings beyond CPU, memory, disks and NICs,
/// as its `.vmx` shows them. Each list names the devices (`pciPassthru0`,
/// `scsi1:0 (multi-writer)`); pre-flight decides what each means.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceHardware {
    /// A virtual TPM (`vtpm.present`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tpm: bool,
    /// VM encryption (`encryption.keySafe` / `encryption.data`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypted: bool,
    /// Persistent memory (`nvdimm0.present`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub persistent_memory: bool,
    /// PCI (DirectPath, vGPU) and SCSI passthrough devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passthrough: Vec<String>,
    /// SR-IOV network adapters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sriov_nics: Vec<String>,
    /// Disks shared with other VMs (multi-writer) and SCSI bus sharing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_disks: Vec<String>,
    /// CD-ROMs backed by an image file, connected at power-on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cdrom_images: Vec<String>,
    /// USB devices attached to a USB controller (not its hubs and input devices).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub usb_devices: Vec<String>,
    /// CPU and memory hot-plug that is enabled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hot_plug: Vec<String>,
    /// CPU or NUMA affinity.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinity: Vec<String>,
    /// Nested virtualization, a virtual IOMMU, Windows VBS.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtualization: Vec<String>,
    /// Serial and parallel ports to files, pipes, devices or the network; floppy images.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
}

impl SourceHardware {
    /// Nothing beyond CPU, memory, disks and NICs.
    pub fn is_empty(&self) -> bool {
        *self == SourceHardware::default()
    }
}

/// `bios` or `efi`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    #[default]
    Bios,
    Efi,
}

/// Power state as `vim-cmd vmsvc/power.getstate` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SourcePowerState {
    #[default]
    Unknown,
    PoweredOn,
    PoweredOff,
    Suspended,
}

/// One virtual disk of the source VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceDisk {
    /// Position in the migration (0-based, order of controller then unit).
    pub index: i32,
    /// The .vmx device key, e.g. `scsi0:0`, `sata0:1`, `nvme0:0`.
    pub device: String,
    /// `scsi`, `sata`, `ide` or `nvme`.
    pub bus: String,
    /// Controller model for SCSI (`pvscsi`, `lsilogic`, `lsisas1068`, `buslogic`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub controller_model: String,
    /// Descriptor path on the host, e.g. `/vmfs/volumes/datastore1/web/web.vmdk`.
    pub descriptor_path: String,
    /// Data extent path, e.g. `/vmfs/volumes/datastore1/web/web-flat.vmdk`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub extent_path: String,
    pub capacity_bytes: i64,
    /// VMDK createType, e.g. `vmfs`, `vmfsSparse`, `vmfsRawDeviceMap`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub create_type: String,
    /// .vmx disk mode, e.g. `persistent`, `independent-persistent`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mode: String,
}

/// One NIC of the source VM.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceNic {
    /// The .vmx device key, e.g. `ethernet0`.
    pub device: String,
    /// `vmxnet3`, `e1000`, `e1000e`, ...
    pub model: String,
    /// Port group name.
    pub network: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac_address: String,
    /// The PCI slot ESXi gave it (`pciSlotNumber`); a guest with predictable
    /// interface names calls the NIC `ens<slot>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_slot: Option<u32>,
}

/// What converting the guest did (virt-v2v over all of its disks, then its
/// interface names pinned), for the status and the Git status file.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GuestConversion {
    /// The tool and its version, e.g. `virt-v2v 2.2.0`.
    pub tool: String,
    /// The operating system it converted, as it named it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub guest: String,
    /// The virtio devices the guest was given drivers for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drivers: Vec<String>,
    /// VMware Tools afterwards: `not installed` (removed, or never there),
    /// `still installed`, or `not checked` (Windows).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vmware_tools: String,
    /// `<mac>=<name>` for each NIC whose name inside the guest was pinned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interface_names: Vec<String>,
    /// `kvm` or `tcg`: what libguestfs's appliance ran on.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub accelerator: String,
    pub seconds: u64,
    /// Where the conversion's log was kept.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub log: String,
    /// sha256 of each converted disk's raw bytes, in disk order: what its
    /// volume holds once imported (the copies' sha256 no longer says).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_sha256: Vec<String>,
}

impl VirtualMachineMigrationStatus {
    /// The sha256 disk `disk`'s imported volume must have: its converted
    /// bytes' when the guest was converted, else its copy's.
    /// Whether disk `disk`'s volume holds exactly the base with `sha256`.
    pub(crate) fn volume_holds_base(&self, disk: usize, sha256: &str) -> bool {
        self.volume_bases.iter().any(|b| b.disk == disk as i32 && b.sha256 == sha256 && b.filled.is_some())
    }

    /// Disk `disk`'s volume is about to be written otherwise, or made again.
    pub(crate) fn forget_volume_base(&mut self, disk: usize) {
        self.volume_bases.retain(|b| b.disk != disk as i32);
    }

    pub(crate) fn expected_volume_sha256(&self, disk: usize) -> Option<String> {
        match &self.guest_conversion {
            Some(converted) => converted.disk_sha256.get(disk).cloned(),
            None => self.disks.get(disk).and_then(|d| d.source_sha256.clone()),
        }
    }
}

/// A reason validation did not pass.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct Blocker {
    /// Stable CamelCase rule name, e.g. `SnapshotsPresent`.
    pub reason: String,
    pub message: String,
}

/// Evidence recorded for one disk as it moves through the phases.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    pub index: i32,
    pub source_path: String,
    pub size_bytes: i64,
    /// sha256 of the bytes read from the source, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sha256: Option<String>,
    /// Whether the source host computed the same digest itself (end-to-end check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_verified_remotely: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume_name: Option<String>,
    /// How the import is verified, chosen when its DataVolume is created:
    /// by CDI against `spec.source.http.checksum`, or, where the installed
    /// CDI has no such field, by a Job reading the imported volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import_verification: Option<ImportVerification>,
    /// sha256 of the imported volume's disk bytes as the verify Job read
    /// them (`VolumeSha256`) or the fill Job wrote them (`Filled`); equal
    /// to the artifact's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imported_sha256: Option<String>,
    /// The import's progress as last seen changing (CDI's phase and
    /// percentage, e.g. `ImportInProgress 42%`) and when: the clock of
    /// `timeouts.importStallSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import_progress: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import_progress_at: Option<Time>,
    /// The power-off epoch the copy was made in.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub epoch: i32,
    /// The extent as the host's `stat` described it (size and mtime) while
    /// it was copied; a different answer before the destination starts
    /// means the source ran unobserved, and the copy is stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_stat: Option<String>,
    /// Warm: the changes after the snapshot, for a volume holding the base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<DiskPatch>,
}

/// A warm migration's changes to one disk after its snapshot: the ranges
/// its deltas wrote, as one stream (`images::patch`) that turns a volume
/// holding the base into the disk at the cutover.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskPatch {
    /// sha256 of the patch stream, hex.
    pub sha256: String,
    /// The ranges it holds.
    pub ranges: i64,
    /// The disk bytes it holds.
    pub bytes: i64,
    /// sha256 of the base it applies on (the copy taken from the snapshot).
    pub base_sha256: String,
}

/// How an import is proven to hold the copied bytes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ImportVerification {
    /// CDI (v1.65 and later) checked the sha256 of what it downloaded and
    /// fails the DataVolume on a mismatch.
    #[serde(rename = "CDIChecksum")]
    CdiChecksum,
    /// CDI cannot check (its DataVolume has no `checksum`): a Job read the
    /// volume after the import and compared its sha256 with the copy's.
    VolumeSha256,
    /// vmmigrate filled a blank DataVolume itself (`vmmigrate fill-volume`
    /// in a Job) and hashed the bytes it wrote: they are the staged
    /// artifact's, compared with its sha256.
    Filled,
    /// Warm: the volume held the disk's base, filled and hashed before the
    /// cutover; after it vmmigrate wrote only the ranges changed since
    /// (`disks[].patch`), hashed against the patch's sha256. The volume's
    /// bytes are the disk's by construction.
    Patched,
}

/// The VirtualMachine created by this migration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct DestinationVm {
    pub namespace: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
}

/// Result of one validation check.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValidationResult {
    pub name: String,
    pub passed: bool,
    #[serde(default)]
    pub message: String,
    pub last_checked: Time,
}
