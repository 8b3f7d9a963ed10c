//! What the controller saw when it looked at the world for the current
//! checkpoint, and the classified failures adapters report. Plain data.

use crate::api::{Reason, SourceInventory, SourcePowerState};

/// How a failure should be handled. Every adapter error carries one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FailureClass {
    /// May succeed on retry: Retryable, then back to the same phase, within the budget.
    Retryable,
    /// A human must decide or fix something: ManualInterventionRequired.
    NeedsHuman,
    /// Cannot succeed: Failed.
    Terminal,
}

/// A classified failure with a stable CamelCase reason (condition reason,
/// Event reason and metric label) and a human message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Failure {
    pub class: FailureClass,
    pub reason: Reason,
    pub message: String,
}

impl Failure {
    pub fn retryable(reason: Reason, message: impl Into<String>) -> Failure {
        Failure { class: FailureClass::Retryable, reason, message: capped(message.into()) }
    }
    pub fn needs_human(reason: Reason, message: impl Into<String>) -> Failure {
        Failure { class: FailureClass::NeedsHuman, reason, message: capped(message.into()) }
    }
    pub fn terminal(reason: Reason, message: impl Into<String>) -> Failure {
        Failure { class: FailureClass::Terminal, reason, message: capped(message.into()) }
    }
    /// A failed local write (a copy, a conversion, the work directory): a
    /// full file system is `WorkDirectoryFull`, waited out until there is
    /// room again; anything else is `reason`. Both are retryable, and what
    /// was written so far is kept.
    pub(crate) fn local_write(reason: Reason, message: impl Into<String>) -> Failure {
        let message = message.into();
        if reports_full_file_system(&message) {
            let message = format!(
                "the work directory's file system is full ({message}); the step resumes when there is room"
            );
            Failure::retryable(Reason::WorkDirectoryFull, message)
        } else {
            Failure::retryable(reason, message)
        }
    }
}

/// Whether an error text is ENOSPC's or EDQUOT's, as the kernel words them
/// (through `std::io::Error`, qemu-img's stderr or a Job's last line).
/// The longest failure message kept, in bytes: what a host, a forge or an
/// API server says goes into status, Events and Git through it, and a host
/// may say megabytes (a status past etcd's limit would stick the migration;
/// an Event's note is refused past 1 KiB).
pub(crate) const MAX_MESSAGE_BYTES: usize = 1024;

/// `message` cut to [`MAX_MESSAGE_BYTES`] on a character boundary, saying
/// how much was cut.
pub(crate) fn capped(message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let marker = format!(" … ({} bytes cut)", message.len());
    let mut end = MAX_MESSAGE_BYTES.saturating_sub(marker.len());
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{marker}", &message[..end])
}

fn reports_full_file_system(message: &str) -> bool {
    ["No space left on device", "os error 28", "Disk quota exceeded", "os error 122"]
        .iter()
        .any(|said| message.contains(said))
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

impl std::error::Error for Failure {}

/// The observation for the current phase. Phases that only wait (Pending,
/// Retryable, ManualInterventionRequired, Completed, Failed) observe `Nothing`.
// One per reconcile, moved once into `decide`: the inventory's size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Observed {
    Nothing,
    /// Discovering: the inventory read from the host (read-only).
    Discovery(Result<SourceInventory, Failure>),
    /// Validated: cluster facts the pre-flight rules need.
    Preflight(Result<PreflightFacts, Failure>),
    /// Preparing: power state and the local copy of every disk.
    Preparing(Result<PreparingFacts, Failure>),
    /// Converting: the artifact of every disk.
    Converting(Result<ConvertingFacts, Failure>),
    /// Importing: the DataVolume of every disk and how imports are verified.
    Importing(Result<ImportingFacts, Failure>),
    /// CreatingVM: the destination VirtualMachine.
    CreatingVm(Result<VmState, Failure>),
    /// Starting: runStrategy and the VMI.
    Starting(Result<StartingFacts, Failure>),
    /// Validating: one result per `spec.validation.checks` entry, in order.
    Validating(Result<Vec<CheckResult>, Failure>),
    /// Completed: the migrated VirtualMachine, watched for changes made after.
    Completed(Result<VmState, Failure>),
}

/// Facts from the cluster for the pre-flight rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreflightFacts {
    pub storage_class_exists: bool,
    pub destination_namespace_exists: bool,
    pub destination_vm: DestinationOccupancy,
    /// Why the destination namespace is refused (`None`: allowed): the
    /// administrator's rules, which the controller fills from its own
    /// configuration whatever the adapter says, or else the cluster's
    /// refusal of this process's writes there (no tenant Role).
    pub destination_refused: Option<String>,
    /// Another migration (`namespace/name`) that holds the claim on the same source VM.
    pub source_claimed_by: Option<String>,
    /// What keeps the data plane from running this migration (e.g. an object
    /// of a worker's name that is not the migration's). The controller fills
    /// it from its data plane, whatever the cluster adapter says.
    pub data_plane_blocked: Option<String>,
    /// What converts guests here; the controller fills it from its
    /// converter, whatever the cluster adapter says.
    pub guest_converter: GuestConverterFacts,
}

/// What the place conversions run has: virt-v2v (with guestfish beside it),
/// virtio-win's drivers, which a Windows guest's conversion needs, and
/// OVMF, which virt-v2v needs to describe a UEFI guest's output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestConverterFacts {
    pub virt_v2v: bool,
    pub virtio_win: bool,
    pub uefi_firmware: bool,
}

/// Converting: the artifact of every disk and, once the guest was
/// converted, what its conversion did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConvertingFacts {
    pub artifacts: Vec<ArtifactState>,
    pub guest: Option<crate::api::GuestConversion>,
}

/// Whether the destination VM name is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationOccupancy {
    Free,
    /// A VM with that name exists and belongs to this migration (a resumed run).
    Ours,
    /// A VM with that name exists and belongs to someone else.
    Taken,
}

/// Power and copy state while preparing.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PreparingFacts {
    pub power: SourcePowerState,
    /// Whether VMware Tools runs in the guest (a graceful shutdown needs it).
    pub tools_running: bool,
    /// One entry per inventory disk, in index order.
    pub copies: Vec<CopyState>,
    /// Warm mode: the id of the migration's snapshot on the source, if it has one.
    pub snapshot: Option<String>,
    /// Warm mode, after the cutover: each disk's deltas and assembly.
    pub deltas: Vec<CopyState>,
    /// The inventory read again before the power-off is recorded (cold, and
    /// warm once its bases are copied), to compare with discovery's; `None`
    /// where it was not read.
    pub inventory: Option<Result<SourceInventory, Failure>>,
    /// Whether the destination fills blank DataVolumes itself: they are
    /// then asked for as Preparing begins.
    pub fills_volumes: bool,
    /// Warm, bases copied, before the cutover, where volumes were asked for
    /// early: each disk's DataVolume and its base fill Job (`None` where
    /// the destination or the staging cannot fill bases). Empty otherwise.
    pub base_fills: Vec<(DataVolumeState, Option<VolumeCheck>)>,
    /// Warm, once the disks are assembled: each disk's patch (the ranges
    /// changed since its base), where the store made one.
    pub patches: Vec<Option<crate::api::DiskPatch>>,
}

/// The local copy of one source disk.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CopyState {
    /// Nothing copied yet.
    Absent,
    /// A copy is running now.
    InProgress { bytes_done: i64, bytes_total: i64 },
    /// Bytes are present but nothing is copying (interrupted); resumable.
    Partial { bytes_done: i64, bytes_total: i64 },
    /// Every byte is present and the size and sha256 match; made in power-off `epoch`.
    Complete {
        size: i64,
        sha256: String,
        verified_remotely: bool,
        #[serde(default)]
        epoch: i32,
        /// What the host's `stat` said of the extent (size and mtime) when
        /// the copy began and, unchanged, when it ended: the disk the copy
        /// holds. `None` where the copy is not of the extent itself (a warm
        /// migration's base and deltas).
        #[serde(default)]
        source: Option<String>,
    },
    /// The last copy failed; partial data may need removing (`discard`).
    Failed { failure: Failure, discard: bool },
}

/// The converted, staged artifact of one disk.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ArtifactState {
    Absent,
    InProgress {
        bytes_done: i64,
        bytes_total: i64,
    },
    /// Output exists but is incomplete or failed validation: remove and redo.
    Invalid {
        reason: String,
    },
    /// Valid artifact; `staged_url` is set once it is published for CDI.
    Complete {
        sha256: String,
        staged_url: Option<String>,
    },
    Failed(Failure),
}

/// The DataVolume of one disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataVolumeState {
    Absent,
    /// Pending, WaitForFirstConsumer, ImportScheduled, ImportInProgress...
    /// CDI does not fail a DataVolume on an importer error: the importer pod
    /// restarts (`status.restartCount`) and the `Running` condition carries
    /// its reason and message, while the phase stays where it was.
    InProgress {
        phase: String,
        percent: i32,
        restarts: i32,
        /// The importer's last error (`Running=False`), when it has one.
        importer_error: Option<String>,
    },
    Succeeded,
    Failed(Failure),
}

/// What Importing sees: every disk's DataVolume, whether the installed CDI
/// checks `spec.source.http.checksum` (read only while a DataVolume is to be
/// made), and the verify Job of every disk whose import CDI cannot check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ImportingFacts {
    pub volumes: Vec<DataVolumeState>,
    pub cdi_verifies_checksum: Option<bool>,
    /// Whether this cluster fills blank DataVolumes itself (read with
    /// `cdi_verifies_checksum`).
    pub fills_volumes: Option<bool>,
    /// One per disk; `None` where no verify or fill Job is looked for.
    pub checks: Vec<Option<VolumeCheck>>,
}

impl ImportingFacts {
    /// DataVolumes on a CDI that checks checksums (nothing else to look at).
    #[cfg(test)]
    pub(crate) fn volumes(volumes: Vec<DataVolumeState>) -> ImportingFacts {
        let checks = vec![None; volumes.len()];
        ImportingFacts { volumes, cdi_verifies_checksum: Some(true), fills_volumes: Some(false), checks }
    }
}

/// The Job that reads an imported volume and compares its sha256 with the copy's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeCheck {
    Absent,
    Running,
    Matches {
        sha256: String,
    },
    /// The volume holds other bytes than the copy.
    Differs {
        sha256: String,
        nonzero_tail_bytes: u64,
    },
    Failed(Failure),
    /// This controller cannot run one (no image for Jobs configured).
    Unavailable(String),
}

/// The destination VirtualMachine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmState {
    Absent,
    /// Ours and equal to the rendered spec.
    Matching {
        uid: String,
    },
    /// Ours but saying something else than the rendered spec (judged by
    /// meaning: `objects::semantic`), with the differences by path.
    Drifted {
        uid: String,
        differences: Vec<String>,
    },
    /// A VM with that name that this migration did not create.
    NotOurs,
}

/// runStrategy and VMI while starting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartingFacts {
    /// Whether the VM's runStrategy already equals the requested one.
    pub run_strategy_set: bool,
    pub vmi: VmiState,
}

/// The VirtualMachineInstance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmiState {
    Absent,
    /// Pending, Scheduling, Scheduled.
    Waiting {
        phase: String,
    },
    Running,
    /// Failed to schedule or to run; the failure is classified by the adapter
    /// (temporary capacity: retryable; missing /dev/kvm: needs a human).
    Failed(Failure),
}

/// Result of one validation check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckResult {
    Pass {
        message: String,
    },
    /// Not ready yet (connection refused, no IP yet): keep checking.
    NotYet {
        message: String,
    },
    /// Answered, but wrong (status or content): a human must look.
    Wrong {
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_text_in_a_failure_is_cut_to_one_kib_on_a_character_boundary() {
        let short = Failure::retryable(Reason::UnparsableOutput, "power.getstate printed \"x\"");
        assert_eq!(short.message, "power.getstate printed \"x\"");
        let long = Failure::needs_human(Reason::HostFault, "ü".repeat(4 << 20));
        assert!(long.message.len() <= MAX_MESSAGE_BYTES, "{}", long.message.len());
        assert!(long.message.ends_with(&format!(" … ({} bytes cut)", 8 << 20)), "{}", &long.message[1000..]);
    }
}
