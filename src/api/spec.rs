//! `spec` of a VirtualMachineMigration: the user's intent, as written in Git.
//!
//! Everything with a sensible default has one, so a minimal manifest names
//! only the source host, its pinned host key, the credentials Secret, the VM,
//! and the destination namespace and StorageClass.

// Each `printcolumn(...)` repeats `type_ = ...`, which this lint mistakes for a duplicate.
#![allow(clippy::duplicated_attributes)]

use super::status::VirtualMachineMigrationStatus;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of every vmmigrate resource.
pub(crate) const GROUP: &str = "migration.platform.example";
/// API version of `VirtualMachineMigration`.
pub(crate) const VERSION: &str = "v1alpha1";
/// Annotation that moves a migration out of ManualInterventionRequired; removed when consumed.
pub const RETRY_ANNOTATION: &str = "migration.platform.example/retry";
/// Annotation (value `"true"`) that approves the cutover of a migration with
/// `spec.cutover.mode: Approval`, for kubectl users; from Git the approval is
/// `spec.cutover.approved: true`, merged as a second change.
pub const APPROVE_CUTOVER_ANNOTATION: &str = "migration.platform.example/approve-cutover";
/// Annotation (value `"true"`) the gitops side sets on a migration whose
/// manifest left Git; removed when the manifest comes back.
pub const ORPHANED_ANNOTATION: &str = "migration.platform.example/orphaned";
/// Annotation (value `"true"`) by which a person lets an orphaned migration
/// take its irreversible steps (the power-off) after all.
pub const CONFIRM_ORPHAN_ANNOTATION: &str = "migration.platform.example/confirm-orphan";

/// A request to move one VM from a standalone ESXi host into KubeVirt.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "migration.platform.example",
    version = "v1alpha1",
    kind = "VirtualMachineMigration",
    plural = "virtualmachinemigrations",
    singular = "virtualmachinemigration",
    shortname = "vmm",
    category = "migration",
    namespaced,
    status = "VirtualMachineMigrationStatus",
    derive = "PartialEq",
    doc = "Moves one virtual machine from a standalone VMware ESXi host into KubeVirt.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Progress",
        type_ = "integer",
        json_path = ".status.progress.percent",
        description = "Percent of the current phase's bytes done"
    ),
    printcolumn(name = "Source VM", type_ = "string", json_path = ".spec.source.vm.name", priority = "1"),
    printcolumn(
        name = "Destination",
        type_ = "string",
        json_path = ".spec.destination.namespace",
        priority = "1"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.rehearsal) || (has(self.mode) && self.mode == 'Rehearsal')").message("spec.rehearsal is only allowed with mode Rehearsal"))]
pub struct VirtualMachineMigrationSpec {
    /// The ESXi host and the VM on it.
    pub source: SourceSpec,
    /// Where the VM lands in the cluster.
    pub destination: DestinationSpec,
    /// Source network name to destination network. Every source NIC must be covered or validation blocks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["source"]))]
    pub network_map: Vec<NetworkMapping>,
    /// How the source VM may be powered off before its disks are copied.
    #[serde(default)]
    pub power_off_policy: PowerOffPolicy,
    /// Disk conversion settings.
    #[serde(default)]
    pub conversion: ConversionSpec,
    /// Retry budget, backoff and timeouts.
    #[serde(default)]
    pub strategy: StrategySpec,
    /// Checks that prove the migrated application works.
    #[serde(default)]
    pub validation: ValidationSpec,
    /// What is removed when a migration ends or its resource is deleted.
    #[serde(default)]
    pub cleanup: CleanupSpec,
    /// When the irreversible step (the source's power-off) may happen. Discovery and
    /// validation always run at once; only what follows them waits.
    #[serde(default, skip_serializing_if = "CutoverSpec::is_now")]
    pub cutover: CutoverSpec,
    /// The wave this migration belongs to: it goes past validation only once every
    /// migration of an earlier wave of the same plan (in the same namespace) has Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave: Option<WaveSpec>,
    /// `Cold` (the default): the source is powered off, then its disks are
    /// copied. `Warm`: a snapshot of the source (no memory; quiesced when
    /// VMware Tools run) freezes its base disks, which are copied while the
    /// VM runs; at the cutover the VM is powered off per `powerOffPolicy`,
    /// only the snapshot's deltas are copied, the disks are assembled from
    /// base and deltas, and the snapshot is removed. The VM is off only for
    /// the deltas. A source already powered off is copied cold.
    /// `Rehearsal`: a trial run that never powers the source off: the disks
    /// are copied from a snapshot while the VM runs, the snapshot is removed
    /// once they are copied, and the copy is imported and started under
    /// another name (`spec.rehearsal`) with its networks detached or on the
    /// one network named there; the checks run and are reported, and
    /// everything it created goes when the migration is deleted.
    #[serde(default, skip_serializing_if = "MigrationMode::is_cold")]
    pub mode: MigrationMode,
    /// The rehearsal VM's name and network, for `mode: Rehearsal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rehearsal: Option<RehearsalSpec>,
}

impl VirtualMachineMigration {
    /// The migration as it runs, when that differs from its spec: once it
    /// left Validated, the mode and rehearsal settings recorded then are
    /// the ones that count, whatever the spec was changed to since.
    pub fn pinned(&self) -> Option<VirtualMachineMigration> {
        let status = self.status.as_ref()?;
        let mode = status.mode?;
        if mode == self.spec.mode && status.rehearsal == self.spec.rehearsal {
            return None;
        }
        let mut pinned = self.clone();
        pinned.spec.mode = mode;
        pinned.spec.rehearsal = status.rehearsal.clone();
        Some(pinned)
    }
}

impl VirtualMachineMigrationSpec {
    /// The runStrategy the destination VM is given once created: a
    /// rehearsal is a boot test, so its VM is always started.
    pub fn run_strategy(&self) -> RunStrategy {
        match self.mode {
            MigrationMode::Rehearsal => RunStrategy::Always,
            _ => self.destination.run_strategy,
        }
    }

    /// The checks that run in Validating, in order: all of them, except in a
    /// rehearsal those that could not reach its VM ([`Self::skipped_checks`]).
    pub(crate) fn checks_to_run(&self) -> Vec<&ValidationCheck> {
        let skipped = self.skipped_checks();
        self.validation.checks.iter().filter(|c| !skipped.iter().any(|(name, _)| *name == c.name)).collect()
    }

    /// The checks a rehearsal cannot run, each with why: an HTTP check goes
    /// through a Service on the pod network, which a rehearsal VM is never
    /// on; without a network the VM reports no address either.
    pub(crate) fn skipped_checks(&self) -> Vec<(&str, &'static str)> {
        if self.mode != MigrationMode::Rehearsal {
            return Vec::new();
        }
        let detached = self.rehearsal.as_ref().is_none_or(|r| r.network_name.is_none());
        self.validation
            .checks
            .iter()
            .filter_map(|c| match c.kind() {
                Some(CheckKindRef::Http(_)) => Some((
                    c.name.as_str(),
                    "an HTTP check goes through the pod network, which a rehearsal VM is not on",
                )),
                Some(CheckKindRef::Ip) if detached => {
                    Some((c.name.as_str(), "the rehearsal VM has no network, so no address"))
                }
                _ => None,
            })
            .collect()
    }
}

/// Where a rehearsal's copy runs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RehearsalSpec {
    /// Name of the rehearsal VirtualMachine (its DataVolumes are `<name>-disk-<n>`);
    /// defaults to the destination name with `-rehearsal` appended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 55), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: Option<String>,
    /// A NetworkAttachmentDefinition of the destination namespace (a plain
    /// name: another namespace's network is not the migration's to use) every
    /// NIC of the rehearsal VM is attached to, with a MAC address of its own.
    /// Unset: the rehearsal VM has no network at all (not even the pod
    /// network), so it can never answer for the running source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"))]
    pub network_name: Option<String>,
}

/// The name of the VM a rehearsal creates: `spec.rehearsal.name`, else
/// `<destination>-rehearsal`.
pub(crate) fn rehearsal_name(spec: &VirtualMachineMigrationSpec, destination: &str) -> String {
    match spec.rehearsal.as_ref().and_then(|r| r.name.clone()) {
        Some(name) => name,
        None => format!("{destination}-rehearsal"),
    }
}

/// The name of the snapshot a warm migration named `migration` takes of its
/// source: `vmmigrate-` and a Kubernetes name, nothing a shell could read otherwise.
pub fn snapshot_name(migration: &str) -> String {
    format!("vmmigrate-{migration}")
}

/// How the source's disks are copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MigrationMode {
    #[default]
    Cold,
    Warm,
    Rehearsal,
}

impl MigrationMode {
    fn is_cold(&self) -> bool {
        *self == MigrationMode::Cold
    }

    /// Warm and Rehearsal copy from a snapshot while the source runs.
    pub fn takes_snapshot(self) -> bool {
        matches!(self, MigrationMode::Warm | MigrationMode::Rehearsal)
    }

    /// Only a rehearsal leaves the source's power alone, always.
    pub fn may_power_off(self) -> bool {
        self != MigrationMode::Rehearsal
    }
}

/// When the source may be powered off.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.mode == 'Window' ? has(self.window) : !has(self.window)").message("cutover.window is required for mode Window and not allowed otherwise"))]
pub struct CutoverSpec {
    /// `Now` (as soon as validated), `Window` (only between `window.start` and `window.end`)
    /// or `Approval` (only once approved: `approved: true` merged through Git, or the
    /// `migration.platform.example/approve-cutover: "true"` annotation).
    #[serde(default)]
    pub mode: CutoverMode,
    /// The maintenance window, for mode `Window`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<CutoverWindow>,
    /// The approval of mode `Approval`, given through Git as a second merged change.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approved: bool,
}

impl CutoverSpec {
    fn is_now(&self) -> bool {
        *self == CutoverSpec::default()
    }
}

/// How the cutover is released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CutoverMode {
    #[default]
    Now,
    Window,
    Approval,
}

/// A maintenance window: wall-clock start and end in a time zone. Nothing
/// irreversible starts outside it; a copy started inside it runs to its end.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CutoverWindow {
    /// Local start, `YYYY-MM-DDTHH:MM` (seconds optional), in `timeZone`.
    #[schemars(regex(pattern = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$"))]
    pub start: String,
    /// Local end, same form; after `start`.
    #[schemars(regex(pattern = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$"))]
    pub end: String,
    /// IANA time zone of `start` and `end`, e.g. `Europe/Berlin`.
    #[serde(default = "default_time_zone")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: String,
}

fn default_time_zone() -> String {
    "UTC".to_owned()
}

/// A migration's place in an ordered plan.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WaveSpec {
    /// The plan the waves belong to; plans are independent of each other.
    #[serde(default = "default_plan")]
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub plan: String,
    /// The wave number: lower waves go first.
    #[schemars(range(min = 0, max = 10000))]
    pub number: i32,
}

fn default_plan() -> String {
    "default".to_owned()
}

/// The ESXi host (reached over SSH) and the VM on it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SourceSpec {
    /// Host name or IP address of the ESXi host's SSH service.
    #[schemars(length(min = 1, max = 253))]
    pub host: String,
    /// SSH port.
    #[serde(default = "default_ssh_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Pinned SSH host key fingerprint, as `ssh-keygen -lf` prints it: `SHA256:` and 43 base64 characters.
    /// The connection is refused when the host presents another key; there is no trust on first use.
    #[schemars(regex(pattern = r"^SHA256:[A-Za-z0-9+/]{43}=?$"))]
    pub host_key: String,
    /// Secret in the migration's namespace with `username` and either `password` or `privateKey`.
    pub credentials_secret_ref: SecretReference,
    /// The source VM, by name or by vmid.
    pub vm: SourceVm,
    /// At most this many disks read at once from this host, counting this
    /// migration's own reads (usually set once in a provider, for its host).
    /// It can only lower the controller's cap for the host
    /// (`--max-reads-per-host`, `--host-reads`), never raise it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub max_concurrent_reads: Option<i32>,
}

fn default_ssh_port() -> i32 {
    22
}

/// A Secret in the same namespace as the migration.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SecretReference {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// The source VM, by exactly one of its display name or its vmid.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("has(self.name) != has(self.id)").message("set exactly one of vm.name or vm.id"))]
pub struct SourceVm {
    /// Display name as `vim-cmd vmsvc/getallvms` lists it (may contain spaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 80))]
    pub name: Option<String>,
    /// The vmid (the first column of `vim-cmd vmsvc/getallvms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]{1,9}$"))]
    pub id: Option<String>,
}

/// Where the VM lands.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DestinationSpec {
    /// Namespace of the KubeVirt VirtualMachine and its DataVolumes.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub namespace: String,
    /// Name of the VirtualMachine; defaults to the migration's name. At most 55 characters so that
    /// `<name>-disk-<n>` stays a valid DataVolume name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 55), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: Option<String>,
    /// StorageClass of the imported disks.
    #[schemars(length(min = 1, max = 253))]
    pub storage_class_name: String,
    /// runStrategy set on the VM once it is created (it is created Halted).
    #[serde(default)]
    pub run_strategy: RunStrategy,
    /// CPU topology override; defaults to the source VM's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuOverride>,
    /// Memory override as a Kubernetes quantity (e.g. `4Gi`); defaults to the source VM's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    pub memory: Option<String>,
}

/// KubeVirt `spec.runStrategy` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RunStrategy {
    #[default]
    Always,
    RerunOnFailure,
    Manual,
    Halted,
}

/// CPU topology of the destination VM.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CpuOverride {
    #[schemars(range(min = 1, max = 64))]
    pub sockets: i32,
    #[schemars(range(min = 1, max = 256))]
    pub cores: i32,
}

/// One source network and where its NICs are attached in the cluster.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type == 'Pod' ? !has(self.networkName) : has(self.networkName)").message("networkName is required for type Multus and not allowed for type Pod"))]
pub struct NetworkMapping {
    /// Port group name as the source VM's `.vmx` and `get.guest` name it.
    #[schemars(length(min = 1, max = 253))]
    pub source: String,
    /// `Pod` (the pod network, masquerade) or `Multus` (a NetworkAttachmentDefinition).
    #[serde(rename = "type")]
    pub kind: NetworkKind,
    /// NetworkAttachmentDefinition as `name` or `namespace/name`, for type Multus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub network_name: Option<String>,
}

/// Kind of destination network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum NetworkKind {
    Pod,
    Multus,
}

/// How the source VM may be powered off. Power-off happens only after validation passed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PowerOffPolicy {
    /// Ask the guest to shut down (needs VMware Tools); if it does not within the timeout,
    /// stop in ManualInterventionRequired. The safe default.
    #[default]
    GracefulOnly,
    /// Ask the guest to shut down; power off hard after `strategy.timeouts.shutdownSeconds`.
    GracefulThenForce,
    /// Power off hard at once.
    Force,
    /// Never touch power: the VM must already be off, otherwise ManualInterventionRequired.
    RequireAlreadyOff,
}

/// Disk conversion settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConversionSpec {
    /// Format of the staged artifact: `raw` (a flat VMDK extent already is one) or `qcow2`.
    #[serde(default)]
    pub format: DiskFormat,
    /// Where conversion runs: `local` (in the controller) or `job` (a batch/v1 Job per disk).
    #[serde(default)]
    pub runner: ConversionRunner,
    /// Whether the guest itself is converted: `auto` (the default: a guest
    /// virt-v2v knows, Linux or Windows, is converted, since one installed on
    /// ESXi has no virtio drivers where it boots), `virtV2v` (always;
    /// Validated refuses a guest it cannot convert) or `none` (the disks move
    /// as they are; a Windows guest gets SATA disks and e1000e NICs).
    #[serde(default)]
    pub guest: GuestConversionMode,
}

/// Whether the guest is converted with virt-v2v (`spec.conversion.guest`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum GuestConversionMode {
    #[default]
    Auto,
    VirtV2v,
    None,
}

impl GuestConversionMode {
    /// As `spec.conversion.guest` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            GuestConversionMode::Auto => "auto",
            GuestConversionMode::VirtV2v => "virtV2v",
            GuestConversionMode::None => "none",
        }
    }
}

/// Format of a staged disk artifact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    #[default]
    Raw,
    Qcow2,
}

impl DiskFormat {
    /// File extension of an artifact in this format.
    pub(crate) fn extension(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }
}

/// Where conversion runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ConversionRunner {
    #[default]
    Local,
    Job,
}

/// Retry budget, backoff and per-phase timeouts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StrategySpec {
    /// Retries allowed per phase before the migration fails (or waits for a human).
    #[serde(default = "default_retry_limit")]
    #[schemars(range(min = 0, max = 100))]
    pub retry_limit: i32,
    /// Exponential backoff between retries.
    #[serde(default)]
    pub backoff: BackoffSpec,
    /// Timeouts of the phases that wait on something outside the controller.
    #[serde(default)]
    pub timeouts: TimeoutSpec,
    /// When the retry budget is exhausted: `Fail` (terminal) or `ManualIntervention` (a human may fix and retry).
    #[serde(default)]
    pub on_retries_exhausted: RetriesExhausted,
}

impl Default for StrategySpec {
    fn default() -> Self {
        StrategySpec {
            retry_limit: default_retry_limit(),
            backoff: BackoffSpec::default(),
            timeouts: TimeoutSpec::default(),
            on_retries_exhausted: RetriesExhausted::default(),
        }
    }
}

fn default_retry_limit() -> i32 {
    5
}

/// What happens when a phase has used its retries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RetriesExhausted {
    #[default]
    Fail,
    ManualIntervention,
}

/// Exponential backoff with jitter: `initialSeconds * 2^(attempt-1)`, capped at `maxSeconds`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.maxSeconds >= self.initialSeconds").message("backoff.maxSeconds must be at least initialSeconds"))]
pub struct BackoffSpec {
    #[serde(default = "default_backoff_initial")]
    #[schemars(range(min = 1, max = 3600))]
    pub initial_seconds: i32,
    #[serde(default = "default_backoff_max")]
    #[schemars(range(min = 1, max = 86400))]
    pub max_seconds: i32,
}

impl Default for BackoffSpec {
    fn default() -> Self {
        BackoffSpec { initial_seconds: default_backoff_initial(), max_seconds: default_backoff_max() }
    }
}

fn default_backoff_initial() -> i32 {
    10
}
fn default_backoff_max() -> i32 {
    600
}

/// Timeouts, in seconds, of the steps that wait on the outside world.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TimeoutSpec {
    /// Graceful guest shutdown before force (GracefulThenForce) or manual intervention (GracefulOnly).
    #[serde(default = "default_shutdown_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub shutdown_seconds: i32,
    /// The VMI reaching Running after the runStrategy is set.
    #[serde(default = "default_start_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub starting_seconds: i32,
    /// All validation checks passing.
    #[serde(default = "default_validation_timeout")]
    #[schemars(range(min = 1, max = 86400))]
    pub validating_seconds: i32,
    /// One SSH command or connection attempt.
    #[serde(default = "default_ssh_timeout")]
    #[schemars(range(min = 1, max = 3600))]
    pub ssh_seconds: i32,
    /// An import whose DataVolume shows no progress (neither its phase nor
    /// its percentage moves) for this long is given up on and made again
    /// after Converting re-checks the artifact.
    #[serde(default = "default_import_stall_timeout")]
    #[schemars(range(min = 10, max = 86400))]
    pub import_stall_seconds: i32,
}

impl TimeoutSpec {
    /// How long one SSH command may take on the host (`sshSeconds`, at
    /// least a second): the ESXi adapter's own bound on every command.
    pub fn ssh(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.ssh_seconds.max(1) as u64)
    }
}

impl Default for TimeoutSpec {
    fn default() -> Self {
        TimeoutSpec {
            shutdown_seconds: default_shutdown_timeout(),
            starting_seconds: default_start_timeout(),
            validating_seconds: default_validation_timeout(),
            ssh_seconds: default_ssh_timeout(),
            import_stall_seconds: default_import_stall_timeout(),
        }
    }
}

fn default_shutdown_timeout() -> i32 {
    300
}
fn default_start_timeout() -> i32 {
    600
}
fn default_validation_timeout() -> i32 {
    900
}
fn default_ssh_timeout() -> i32 {
    30
}
fn default_import_stall_timeout() -> i32 {
    600
}

/// Checks that prove the migrated application works.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ValidationSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub checks: Vec<ValidationCheck>,
}

/// One read-only check; exactly one of `http`, `guestAgent`, `ip` is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.http) ? 1 : 0) + (has(self.guestAgent) ? 1 : 0) + (has(self.ip) ? 1 : 0) == 1").message("set exactly one of http, guestAgent or ip"))]
pub struct ValidationCheck {
    /// Name of the check, unique within the migration; reported in `status.validationResults`.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpCheck>,
    /// Passes when the VMI reports the guest agent connected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<EmptyCheck>,
    /// Passes when the VMI reports an IP address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<EmptyCheck>,
}

/// A check with no parameters.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct EmptyCheck {}

/// An HTTP GET through a Service in the destination namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpCheck {
    /// Service in the destination namespace.
    #[schemars(length(min = 1, max = 63))]
    pub service: String,
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    #[serde(default = "default_http_path")]
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
    #[serde(default = "default_http_status")]
    #[schemars(range(min = 100, max = 599))]
    pub expected_status: i32,
    /// The response body must contain this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_contains: Option<String>,
}

fn default_http_path() -> String {
    "/".to_owned()
}
fn default_http_status() -> i32 {
    200
}

/// What is removed when a migration ends or its resource is deleted. The source VM is never touched.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CleanupSpec {
    /// DataVolumes and the VirtualMachine this migration created, when it fails or is deleted
    /// before Completed. `Retain` keeps them for inspection. A Completed migration's VM is never deleted.
    #[serde(default)]
    pub on_failure: CleanupAction,
    /// Copied disks and staged artifacts once the migration is Completed or Failed.
    #[serde(default = "delete_action")]
    pub staging: CleanupAction,
}

impl Default for CleanupSpec {
    fn default() -> Self {
        CleanupSpec { on_failure: CleanupAction::Retain, staging: CleanupAction::Delete }
    }
}

fn delete_action() -> CleanupAction {
    CleanupAction::Delete
}

/// Keep or remove.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CleanupAction {
    #[default]
    Retain,
    Delete,
}

/// Which kind of check a `ValidationCheck` is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum CheckKindRef<'a> {
    Http(&'a HttpCheck),
    GuestAgent,
    Ip,
}

impl ValidationCheck {
    /// The one member that is set (the CRD's CEL rule enforces exactly one).
    pub(crate) fn kind(&self) -> Option<CheckKindRef<'_>> {
        match (&self.http, &self.guest_agent, &self.ip) {
            (Some(http), None, None) => Some(CheckKindRef::Http(http)),
            (None, Some(_), None) => Some(CheckKindRef::GuestAgent),
            (None, None, Some(_)) => Some(CheckKindRef::Ip),
            _ => None,
        }
    }
}
