//! One reconcile of one migration, independent of kube-runtime:
//! observe (through adapters) → decide (pure) → act (idempotent) → the
//! status to record. The kube-runtime glue and the simulation tests both run
//! exactly this code.

use crate::api::Reason;
use crate::api::snapshot_name;
use crate::api::{MigrationMode, Phase, VirtualMachineMigration};
use crate::machine::tenancy::DestinationRules;
use crate::machine::{
    self, Action, ArtifactState, ConvertingFacts, CopyState, DataVolumeState, Decision, Failure,
    ImportingFacts, Input, Observed,
};
use crate::ports::Adapters;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use std::future::Future;
use std::time::Duration;

/// Longest any single adapter call may take before it counts as hung.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Where a reconcile can be interrupted; the simulation crashes the
/// controller at each of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// Observed, nothing done yet.
    Observed,
    /// This action was just performed (before the next one and before the status write).
    Performed(Action),
}

/// What one reconcile produced.
#[derive(Clone, Debug)]
pub struct Step {
    /// The decision whose status must be recorded.
    pub decision: Decision,
    /// Actions that were performed, in order.
    pub performed: Vec<Action>,
    /// The action that failed, if any (already folded into `decision`).
    pub failed: Option<(Action, Failure)>,
}

async fn bounded<T>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result,
        Err(_) => Err(Failure::retryable(
            Reason::Timeout,
            format!("{what} did not answer within {}s", limit.as_secs()),
        )),
    }
}

/// The engine's outer bound on one call to the host: twice the adapter's
/// own bound on a command, so that the adapter's fires first and says why.
fn ssh_timeout(vmm: &VirtualMachineMigration) -> Duration {
    vmm.spec.strategy.timeouts.ssh() * 2
}

/// Looks at the world for the migration's current phase.
pub(crate) async fn observe(adapters: &Adapters, vmm: &VirtualMachineMigration) -> Observed {
    let phase = vmm.status.as_ref().map(|s| s.phase).unwrap_or_default();
    let disks = machine::disks_in_flight(vmm.status.as_ref());
    match phase {
        Phase::Discovering => Observed::Discovery(
            bounded("ESXi discovery", ssh_timeout(vmm) * 4, adapters.esxi.discover(vmm)).await,
        ),
        Phase::Validated => {
            let facts = bounded("pre-flight", CALL_TIMEOUT, adapters.cluster.preflight(vmm)).await;
            let blocked =
                bounded("the data plane's pre-flight", CALL_TIMEOUT, adapters.disks.preflight(vmm)).await;
            Observed::Preflight(facts.and_then(|mut facts| {
                facts.data_plane_blocked = blocked?;
                facts.guest_converter = adapters.converter.guest_converter();
                Ok(facts)
            }))
        }
        Phase::Preparing => Observed::Preparing(observe_preparing(adapters, vmm, disks).await),
        Phase::Converting => Observed::Converting(observe_converting(adapters, vmm, disks).await),
        Phase::Importing => Observed::Importing(observe_importing(adapters, vmm, disks).await),
        Phase::CreatingVm => {
            Observed::CreatingVm(bounded("VM read", CALL_TIMEOUT, adapters.cluster.vm(vmm)).await)
        }
        Phase::Starting => {
            Observed::Starting(bounded("VMI read", CALL_TIMEOUT, adapters.cluster.starting(vmm)).await)
        }
        Phase::Validating => Observed::Validating(Ok(observe_checks(adapters, vmm).await)),
        // The migrated VM is the user's now: read to report changes, never written.
        Phase::Completed if vmm.status.as_ref().is_some_and(|s| s.destination_vm.is_some()) => {
            Observed::Completed(bounded("VM read", CALL_TIMEOUT, adapters.cluster.vm(vmm)).await)
        }
        Phase::Pending
        | Phase::Retryable
        | Phase::ManualInterventionRequired
        | Phase::Completed
        | Phase::Failed => Observed::Nothing,
    }
}

/// What [`observe_source`] read: the power, and the copied extents' stats.
type SourceSeen =
    (Option<Result<crate::api::SourcePowerState, Failure>>, Option<Result<Vec<(usize, String)>, Failure>>);

/// Preparing: the source's power, each disk's copy (and after a warm
/// cutover its delta), the migration's snapshot, and before any power action
/// a fresh discovery to compare with the first.
async fn observe_preparing(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    disks: usize,
) -> Result<machine::PreparingFacts, Failure> {
    let power = bounded("ESXi power state", ssh_timeout(vmm), adapters.esxi.power(vmm)).await?;
    let mut copies = Vec::with_capacity(disks);
    for disk in 0..disks {
        copies.push(answered(adapters.disks.copy_state(vmm, disk)).await);
    }
    let status = vmm.status.clone().unwrap_or_default();
    let warm = vmm.spec.mode == MigrationMode::Warm;
    let snapshot = if vmm.spec.mode.takes_snapshot() {
        let name = snapshot_name(&vmm.name_any());
        bounded("ESXi snapshots", ssh_timeout(vmm), adapters.esxi.snapshot_id(vmm, &name)).await?
    } else {
        None
    };
    // Read again before the power-off is recorded or asked for (cold;
    // warm once its bases are copied), to compare with discovery's.
    let bases_copied = copies.iter().all(|c| matches!(c, CopyState::Complete { .. }));
    let inventory = if vmm.spec.mode.may_power_off()
        && status.timestamps.source_powered_off.is_none()
        && (!warm || status.snapshot.is_none() || bases_copied)
    {
        Some(bounded("ESXi discovery", ssh_timeout(vmm) * 4, adapters.esxi.discover(vmm)).await)
    } else {
        None
    };
    let mut deltas = Vec::new();
    let mut patches = Vec::new();
    if warm && status.snapshot.is_some() && status.timestamps.source_powered_off.is_some() {
        for disk in 0..disks {
            deltas.push(answered(adapters.disks.delta_state(vmm, disk)).await);
        }
        if deltas.iter().all(|d| matches!(d, CopyState::Complete { .. })) {
            for disk in 0..disks {
                patches.push(
                    tokio::time::timeout(CALL_TIMEOUT, adapters.disks.patch(vmm, disk)).await.ok().flatten(),
                );
            }
        }
    }
    // Warm, before the cutover: the volumes asked for early, and their bases.
    let mut base_fills = Vec::new();
    if warm
        && bases_copied
        && status.snapshot.is_some()
        && status.timestamps.source_powered_off.is_none()
        && status.timestamps.volumes_requested.is_some()
    {
        for disk in 0..disks {
            let volume = bounded("DataVolume", CALL_TIMEOUT, adapters.cluster.data_volume(vmm, disk)).await?;
            let fill = match adapters.staging.stages_bases() {
                true => bounded("base fill Job", CALL_TIMEOUT, adapters.cluster.base_fill(vmm, disk)).await?,
                false => None,
            };
            base_fills.push((volume, fill));
        }
    }
    Ok(machine::PreparingFacts {
        power: power.state,
        tools_running: power.tools_running,
        copies,
        snapshot,
        deltas,
        inventory,
        fills_volumes: adapters.cluster.fills_volumes().await,
        base_fills,
        patches,
    })
}

/// A copy's or delta's state, or a retryable failure when the disk store
/// does not answer in time.
async fn answered(state: impl std::future::Future<Output = CopyState>) -> CopyState {
    tokio::time::timeout(CALL_TIMEOUT, state).await.unwrap_or_else(|_| CopyState::Failed {
        failure: Failure::retryable(Reason::Timeout, "the disk store did not answer"),
        discard: false,
    })
}

/// Converting: each disk's artifact, and where it is complete, its staged URL.
async fn observe_converting(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    disks: usize,
) -> Result<ConvertingFacts, Failure> {
    let mut artifacts = Vec::with_capacity(disks);
    for disk in 0..disks {
        let state = tokio::time::timeout(CALL_TIMEOUT, adapters.converter.artifact_state(vmm, disk))
            .await
            .unwrap_or_else(|_| ArtifactState::Failed(Failure::retryable(Reason::Timeout, "converter hung")));
        artifacts.push(match state {
            ArtifactState::Complete { sha256, staged_url: None } => {
                let url =
                    bounded("staging", CALL_TIMEOUT, adapters.staging.staged_url(vmm, disk, &sha256)).await?;
                ArtifactState::Complete { sha256, staged_url: url }
            }
            other => other,
        });
    }
    // What converting the guest did is read once every disk is staged.
    let staged = artifacts.iter().all(|a| matches!(a, ArtifactState::Complete { staged_url: Some(_), .. }));
    let guest = if staged && !artifacts.is_empty() {
        tokio::time::timeout(CALL_TIMEOUT, adapters.converter.guest_conversion(vmm)).await.ok().flatten()
    } else {
        None
    };
    Ok(ConvertingFacts { artifacts, guest })
}

/// Importing: each DataVolume, the proof of a finished import, and before
/// the first is made, whether the installed CDI checks a checksum.
async fn observe_importing(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    disks: usize,
) -> Result<ImportingFacts, Failure> {
    let mut facts = ImportingFacts {
        volumes: Vec::with_capacity(disks),
        cdi_verifies_checksum: None,
        fills_volumes: None,
        checks: Vec::new(),
    };
    for disk in 0..disks {
        let read = async {
            let dv = adapters.cluster.data_volume(vmm, disk).await?;
            let check = match dv {
                DataVolumeState::Succeeded => adapters.cluster.import_check(vmm, disk).await?,
                _ => None,
            };
            Ok::<_, Failure>((dv, check))
        };
        let (dv, check) = bounded("DataVolume read", CALL_TIMEOUT, read).await?;
        facts.volumes.push(dv);
        facts.checks.push(check);
    }
    if facts.volumes.contains(&DataVolumeState::Absent) {
        let verifies =
            bounded("DataVolume definition read", CALL_TIMEOUT, adapters.cluster.cdi_verifies_checksum())
                .await?;
        facts.cdi_verifies_checksum = Some(verifies);
        facts.fills_volumes = Some(adapters.cluster.fills_volumes().await);
    }
    Ok(facts)
}

/// Validating: every check, a check that does not answer in time "not yet".
async fn observe_checks(adapters: &Adapters, vmm: &VirtualMachineMigration) -> Vec<machine::CheckResult> {
    let mut results = Vec::new();
    for check in vmm.spec.checks_to_run() {
        let result = tokio::time::timeout(CALL_TIMEOUT, adapters.prober.check(vmm, check)).await;
        results.push(result.unwrap_or_else(|_| machine::CheckResult::NotYet {
            message: format!("check {:?} did not answer in time", check.name),
        }));
    }
    results
}

/// The destination guest's console while it starts and is checked, once it
/// was asked to run. Best effort: a console that cannot be read (an older
/// KubeVirt, its log container turned off) is `None`, and the checks decide.
async fn observe_console(adapters: &Adapters, vmm: &VirtualMachineMigration) -> Option<String> {
    let status = vmm.status.as_ref()?;
    if !matches!(status.phase, Phase::Starting | Phase::Validating)
        || status.timestamps.start_requested.is_none()
    {
        return None;
    }
    match bounded("guest console read", CALL_TIMEOUT, adapters.cluster.guest_console(vmm)).await {
        Ok(console) => console,
        Err(failure) => {
            tracing::debug!(reason = %failure.reason, message = %failure.message, "the guest console could not be read");
            None
        }
    }
}

/// The source's power after Preparing, until the destination is started:
/// read for a migration that recorded its source off (never for a rehearsal).
/// The extents of the disks whose copy recorded a stat are stated first,
/// the power read after them: a changed extent was written before its stat,
/// so a source still on is seen on (`SourcePoweredOnAgain`), and only one
/// powered on and off between two looks is told by its extents alone.
async fn observe_source(adapters: &Adapters, vmm: &VirtualMachineMigration) -> SourceSeen {
    let Some(status) = vmm.status.as_ref() else { return (None, None) };
    // In Starting only until the destination was asked to run (then it is the user's VM).
    let starting = status.phase == Phase::Starting && status.timestamps.start_requested.is_none();
    let watched =
        matches!(status.phase, Phase::Converting | Phase::Importing | Phase::CreatingVm) || starting;
    if !watched || !vmm.spec.mode.may_power_off() || status.timestamps.source_powered_off.is_none() {
        return (None, None);
    }
    let copied: Vec<(usize, String)> = status
        .disks
        .iter()
        .enumerate()
        .filter(|(_, d)| d.source_stat.is_some())
        .map(|(i, d)| (i, d.source_path.clone()))
        .collect();
    let extents = if copied.is_empty() {
        None
    } else {
        let paths: Vec<String> = copied.iter().map(|(_, path)| path.clone()).collect();
        let stats =
            bounded("ESXi extent stat", ssh_timeout(vmm), adapters.esxi.extent_stats(vmm, &paths)).await;
        Some(stats.and_then(|stats| {
            if stats.len() != copied.len() {
                return Err(Failure::retryable(
                    Reason::SSHError,
                    format!("asked the stat of {} extent(s), got {}", copied.len(), stats.len()),
                ));
            }
            Ok(copied.iter().map(|(disk, _)| *disk).zip(stats).collect())
        }))
    };
    let power =
        bounded("ESXi power state", ssh_timeout(vmm), adapters.esxi.power(vmm)).await.map(|p| p.state);
    // The extents say something only of a source seen off after them.
    let extents = extents.filter(|_| matches!(power, Ok(crate::api::SourcePowerState::PoweredOff)));
    (Some(power), extents)
}

/// Whether an action cannot be undone or destroys something: it is
/// performed only after the fence let the step act.
fn fenced(action: &Action) -> bool {
    matches!(
        action,
        Action::PowerOffHard
            | Action::RequestGuestShutdown
            | Action::DiscardDiskCopy { .. }
            | Action::CleanupStaging
            | Action::DeleteDestination
            | Action::DeleteDataVolume { .. }
    )
}

/// Asked right before the first action of a step that cannot be undone or
/// destroys something (a power action, discarding copies, cleaning staging,
/// deleting volumes), with the recorded status plus the power actions the
/// step asks for: it writes that status ahead, with the resourceVersion the
/// step read (unchanged, the write only proves the read fresh), and lets the step
/// act only if the write succeeded, the migration is not being deleted and
/// this process still holds the lease. A stale read (409), a deleted
/// migration or a stale leader acts on nothing.
///
/// Every other action asks [`Fence::leading`] first (client-go's rule: a
/// replica acts only while it holds the lease). A replica whose lease lapsed
/// while it looked (a hung SSH call outlasts the lease) read a status the
/// next leader may have moved past: it starts, creates and updates nothing.
#[async_trait::async_trait]
pub trait Fence: Send + Sync {
    async fn write_ahead(&self, status: &crate::api::VirtualMachineMigrationStatus) -> Result<(), Failure>;
    /// Whether this process still holds the lease, asked before each action.
    fn leading(&self) -> Result<(), Failure>;
}

/// Performs one action. Annotation removal is done by the caller (it needs the API).
pub(crate) async fn perform(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    action: &Action,
) -> Result<(), Failure> {
    let esxi = ssh_timeout(vmm);
    match action {
        Action::RemoveRetryAnnotation => Ok(()),
        // A rehearsal never powers its source off: refused here too, whatever asked.
        Action::RequestGuestShutdown | Action::PowerOffHard if !vmm.spec.mode.may_power_off() => {
            Err(Failure::terminal(
                Reason::PowerActionRefused,
                "a rehearsal never powers its source off; the power action was refused",
            ))
        }
        Action::RequestGuestShutdown => {
            bounded("ESXi shutdown", esxi, adapters.esxi.request_shutdown(vmm)).await
        }
        Action::PowerOffHard => bounded("ESXi power-off", esxi, adapters.esxi.power_off(vmm)).await,
        Action::StartDiskCopy { disk } => {
            bounded("disk copy", CALL_TIMEOUT, adapters.disks.start_copy(vmm, *disk)).await
        }
        // A quiesced snapshot of a busy guest takes a while on the host.
        Action::CreateSnapshot { quiesce } => {
            let name = snapshot_name(&vmm.name_any());
            bounded("ESXi snapshot", esxi * 10, adapters.esxi.create_snapshot(vmm, &name, *quiesce)).await
        }
        Action::RemoveSnapshot => {
            let name = snapshot_name(&vmm.name_any());
            bounded("ESXi snapshot removal", esxi * 10, adapters.esxi.remove_snapshot(vmm, &name)).await
        }
        Action::StartDeltaCopy { disk } => {
            bounded("delta copy", esxi * 4, adapters.disks.start_delta_copy(vmm, *disk)).await
        }
        Action::StartBaseFill { disk, sha256 } => {
            let staged =
                bounded("base staging", CALL_TIMEOUT, adapters.staging.stage_base(vmm, *disk, sha256));
            let Some(url) = staged.await? else { return Ok(()) };
            let access =
                bounded("import access", CALL_TIMEOUT, adapters.staging.import_access(vmm, *disk)).await?;
            let start = adapters.cluster.start_base_fill(vmm, *disk, (&url, sha256), &access);
            bounded("base fill Job create", CALL_TIMEOUT, start).await
        }
        Action::DeleteBaseFill { disk } => {
            bounded("base fill Job delete", CALL_TIMEOUT, adapters.cluster.delete_base_fill(vmm, *disk)).await
        }
        Action::DiscardDiskCopy { disk } => {
            bounded("disk discard", CALL_TIMEOUT, adapters.disks.discard_copy(vmm, *disk)).await
        }
        Action::StartConversion { disk } => {
            bounded("conversion", CALL_TIMEOUT, adapters.converter.start_conversion(vmm, *disk)).await
        }
        Action::DiscardArtifact { disk } => {
            bounded("artifact discard", CALL_TIMEOUT, adapters.converter.discard_artifact(vmm, *disk)).await
        }
        Action::StageArtifact { disk } => {
            bounded("staging", CALL_TIMEOUT, adapters.staging.stage(vmm, *disk)).await
        }
        Action::CreateDataVolume { disk } => {
            let access =
                bounded("import access", CALL_TIMEOUT, adapters.staging.import_access(vmm, *disk)).await?;
            let create = adapters.cluster.create_data_volume(vmm, *disk, &access);
            bounded("DataVolume create", CALL_TIMEOUT, create).await
        }
        Action::StartVolumeCheck { disk } => {
            use crate::api::ImportVerification::{Filled, Patched};
            let how =
                vmm.status.as_ref().and_then(|s| s.disks.get(*disk)).and_then(|d| d.import_verification);
            let filled = matches!(how, Some(Filled | Patched));
            if filled {
                // The artifact's credentials and the CA, fresh: the staging
                // key or CA may have changed since the volume was asked for.
                let access =
                    bounded("import access", CALL_TIMEOUT, adapters.staging.import_access(vmm, *disk))
                        .await?;
                let start = adapters.cluster.start_fill(vmm, *disk, &access);
                bounded("fill Job create", CALL_TIMEOUT, start).await
            } else {
                bounded("verify Job create", CALL_TIMEOUT, adapters.cluster.start_volume_check(vmm, *disk))
                    .await
            }
        }
        Action::DeleteVolumeCheck { disk } => {
            bounded("verify Job delete", CALL_TIMEOUT, adapters.cluster.delete_volume_check(vmm, *disk)).await
        }
        Action::DeleteDataVolume { disk } => {
            bounded("DataVolume delete", CALL_TIMEOUT, adapters.cluster.delete_data_volume(vmm, *disk)).await
        }
        Action::CreateVm => bounded("VM create", CALL_TIMEOUT, adapters.cluster.create_vm(vmm)).await,
        Action::UpdateVm => bounded("VM update", CALL_TIMEOUT, adapters.cluster.update_vm(vmm)).await,
        Action::SetRunStrategy => {
            bounded("runStrategy", CALL_TIMEOUT, adapters.cluster.set_run_strategy(vmm)).await
        }
        Action::CleanupStaging => {
            bounded("staging cleanup", CALL_TIMEOUT, adapters.staging.remove_all(vmm)).await?;
            bounded("disk cleanup", CALL_TIMEOUT, adapters.disks.remove_all(vmm)).await
        }
        Action::DeleteDestination => {
            bounded("destination delete", CALL_TIMEOUT, adapters.cluster.delete_destination(vmm)).await
        }
        Action::ReleaseDestination => {
            bounded("destination release", CALL_TIMEOUT, adapters.cluster.release_destination(vmm)).await
        }
        Action::ReleaseSourceClaim => {
            bounded("source claim release", CALL_TIMEOUT, adapters.cluster.release_source(vmm)).await
        }
    }
}

/// What the finalizer does when a migration is deleted, in order (never
/// anything to the source's power): the migration's pinned mode decides.
pub fn cleanup_actions(vmm: &VirtualMachineMigration) -> Vec<Action> {
    let pinned = vmm.pinned();
    let vmm = pinned.as_ref().unwrap_or(vmm);
    machine::cleanup_on_delete(&vmm.spec, &vmm.status.clone().unwrap_or_default())
}

/// Performs one of [`cleanup_actions`] (the simulation deletes migrations
/// at any crash point through it, as the finalizer does).
pub async fn perform_cleanup(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    action: &Action,
) -> Result<(), Failure> {
    perform(adapters, vmm, action).await
}

/// Inputs of one reconcile besides the adapters and the object.
pub struct StepInput<'a> {
    pub now: Timestamp,
    pub jitter: f64,
    pub retry_requested: bool,
    /// The administrator's destination allow rules, applied at Validated.
    pub destinations: &'a DestinationRules,
    /// The cutover-approval annotation is present with value "true".
    pub cutover_approved: bool,
    /// What the rest of the fleet says (waves, read slots); asked at Validated.
    pub fleet: machine::fleet::FleetGates,
    /// How long this process has seen the recorded `shutdownRequested` (its own clock).
    pub shutdown_seen_for: Option<Duration>,
    /// How long this process has looked at the migration without a gap.
    pub watched_for: Option<Duration>,
    /// Orphaned in Git and not confirmed by a person.
    pub orphan_hold: bool,
    /// Writes ahead before an irreversible or destructive action.
    pub fence: &'a dyn Fence,
}

/// One reconcile. `interrupt` is asked at every crash point and returns true to
/// stop there as if the process died (the simulation's crash); production
/// passes `|_| false`. Returns `None` when interrupted, when the fence
/// refused the step's first irreversible or destructive action, or when
/// the lease was lost before any action: nothing is recorded.
pub async fn step(
    adapters: &Adapters,
    vmm: &VirtualMachineMigration,
    input: StepInput<'_>,
    mut interrupt: impl FnMut(&CrashPoint) -> bool,
) -> Option<Step> {
    // Past Validated the recorded mode counts, whatever the spec says now.
    let pinned = vmm.pinned();
    let changed_mode = pinned.as_ref().map(|_| vmm.spec.mode);
    let vmm = pinned.as_ref().unwrap_or(vmm);
    let status = vmm.status.clone().unwrap_or_default();
    let name = vmm.metadata.name.clone().unwrap_or_default();
    let generation = vmm.metadata.generation.unwrap_or(1);
    let make_input = |observed: Observed| Input {
        spec: &vmm.spec,
        status: &status,
        name: &name,
        generation,
        retry_requested: input.retry_requested,
        cutover_approved: input.cutover_approved,
        fleet: input.fleet.clone(),
        observed,
        now: input.now,
        jitter: input.jitter,
        source: None,
        extents: None,
        shutdown_seen_for: input.shutdown_seen_for,
        watched_for: input.watched_for,
        orphan_hold: input.orphan_hold,
        console: None,
    };
    // Held at a gate after validating: nothing to look at until it opens.
    let held = status.phase == Phase::Validated && machine::held_at_gate(&make_input(Observed::Nothing));
    let mut observed = if held { Observed::Nothing } else { observe(adapters, vmm).await };
    let (source, extents) = if held { (None, None) } else { observe_source(adapters, vmm).await };
    if let Observed::Preflight(Ok(facts)) = &mut observed {
        let ns = vmm.namespace().unwrap_or_default();
        let destination = &vmm.spec.destination.namespace;
        // The controller's own rule first, whatever the adapter reported;
        // then what the cluster refuses this process (no tenant Role there).
        let cluster_refusal = facts.destination_refused.take();
        facts.destination_refused = input
            .destinations
            .refusal(&ns, destination)
            .or_else(|| {
                vmm.spec
                    .network_map
                    .iter()
                    .filter_map(|m| m.network_name.as_deref())
                    .find_map(|network| input.destinations.network_refusal(&ns, destination, network))
            })
            .or(cluster_refusal);
    }
    if interrupt(&CrashPoint::Observed) {
        return None;
    }
    let console = observe_console(adapters, vmm).await;
    let mut decision = machine::decide(Input { source, extents, console, ..make_input(observed) });
    if let Some(asked) = changed_mode
        && decision.status.phase != status.phase
    {
        decision.events.push(machine::Event {
            type_: machine::EventType::Warning,
            reason: "SpecChangeNotApplied".into(),
            message: format!(
                "spec.mode {asked:?} (or spec.rehearsal) was changed after the migration left Validated and is not applied: it runs as {:?}",
                vmm.spec.mode
            ),
        });
    }
    // Actions act on what this decision says (a DataVolume is rendered with
    // the verification it chose), though it is recorded only after them.
    let acting = VirtualMachineMigration { status: Some(decision.status.clone()), ..vmm.clone() };
    let mut performed = Vec::new();
    let mut fence_passed = false;
    for action in &decision.actions {
        if let Err(failure) = input.fence.leading() {
            tracing::warn!(?action, reason = %failure.reason, "not performed: {}", failure.message);
            return None;
        }
        if fenced(action) && !fence_passed {
            // Ahead goes what is recorded plus the power actions this
            // decision asks for, nothing else: the rest is recorded after
            // the actions, as always (a crash in between repeats them).
            let mut ahead = crate::api::VirtualMachineMigrationStatus {
                power_actions: decision.status.power_actions.clone(),
                ..status.clone()
            };
            // So is the decision to remove the migration's snapshot: found
            // gone after a crash, it is then known to be this removal.
            if decision.actions.contains(&Action::RemoveSnapshot)
                && let Some(record) = ahead.snapshot.as_mut()
            {
                record.removing.get_or_insert_with(|| machine::api_time(input.now));
            }
            if let Err(failure) = input.fence.write_ahead(&ahead).await {
                tracing::warn!(?action, reason = %failure.reason, "not performed: {}", failure.message);
                return None;
            }
            fence_passed = true;
        }
        if let Err(failure) = perform(adapters, &acting, action).await {
            // Nothing of this decision is recorded: the failure is recorded
            // against the recorded status and phase (record before you advance).
            let failed = machine::action_failed(make_input(Observed::Nothing), status.phase, failure.clone());
            return Some(Step { decision: failed, performed, failed: Some((action.clone(), failure)) });
        }
        performed.push(action.clone());
        if interrupt(&CrashPoint::Performed(action.clone())) {
            return None;
        }
    }
    Some(Step { decision, performed, failed: None })
}
