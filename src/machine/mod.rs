//! The migration state machine: a pure `decide`.
//!
//! Each phase is a checkpoint naming a desired state. On every reconcile the
//! controller observes the world for the current checkpoint, calls `decide`
//! with the spec, the recorded status, that observation and the time, then
//! performs the returned actions (each idempotent) and records the returned
//! status in one write. Evidence and the next phase travel in the same status
//! ("record before you advance"): if the write is lost, the next reconcile
//! repeats idempotent actions and reaches the same place.
//!
//! No IO, no async, no clock: `now` and `jitter` are inputs.
//! The specification is shared/seeds/000_82a04c1365667313.txt; docs/state-machine.md
//! explains it for operators.

pub(crate) mod compatibility;
pub mod conditions;
mod console;
mod destination;
pub mod fleet;
mod gates;
mod importing;
mod observe;
mod power;
pub(crate) mod preflight;
mod rehearsal;
pub mod tenancy;
mod warm;

use destination::{creating_vm, starting, validating};
pub(crate) use gates::held_at_gate;
use gates::{Gating, hold, validated};
pub use importing::IMPORTER_RESTART_LIMIT;
pub use observe::*;
use power::{
    end_epoch, extents_unchanged, power_down, record_powered_off, source_unchanged, stale, suspended,
};

use crate::api::{
    CleanupAction, DiskFormat, DiskProgress, DiskStatus, ImportVerification, MAX_ERRORS, MAX_HISTORY,
    MigrationError, MigrationMode, Phase, PhaseTransition, PowerOffPolicy, Progress, RetriesExhausted,
    RetryStatus, RunStrategy, SourcePowerState, ValidationResult, VirtualMachineMigrationSpec,
    VirtualMachineMigrationStatus, condition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::time::Duration;

/// How soon to look again while something outside is in progress.
pub(crate) const POLL_IN_PROGRESS: Duration = Duration::from_secs(5);
/// How soon to look again while waiting for a guest to shut down.
pub(crate) const POLL_SHUTDOWN: Duration = Duration::from_secs(3);
/// How soon to look again right after asking for a power-off, and for the
/// first seconds of a shutdown: a hard power-off is done when `power.off`
/// returns, and a slot on the host waits for the copy behind it.
pub(crate) const POLL_POWER_ACTION: Duration = Duration::from_secs(1);
/// How long after a shutdown request `POLL_POWER_ACTION` applies.
const SHUTDOWN_FIRST_SECONDS: Duration = Duration::from_secs(5);
/// How soon at most to re-run validation checks that are not passing yet.
pub(crate) const POLL_CHECKS: Duration = Duration::from_secs(10);
/// How soon at least: a guest booting is often ready seconds after its first
/// failed check, and each second until it is seen ready is downtime.
pub(crate) const POLL_CHECKS_FIRST: Duration = Duration::from_secs(1);

/// How soon to re-run checks that have been failing for `waited`: a fifth of
/// that, between [`POLL_CHECKS_FIRST`] and [`POLL_CHECKS`] (every second for
/// the first five, every 10 s after the first 50), so a guest is seen ready
/// soon after it is, and one that takes long is not polled at that pace.
pub(crate) fn checks_poll(waited: Duration) -> Duration {
    (waited / 5).clamp(POLL_CHECKS_FIRST, POLL_CHECKS)
}
/// How soon a migration waiting before its cutover looks again by itself (the
/// controller wakes it earlier when its wave or a slot opens).
pub(crate) const POLL_WAITING: Duration = Duration::from_secs(60);

/// Stable reasons of failures the machine itself decides.
pub use crate::api::Reason;

/// Everything `decide` looks at.
#[derive(Clone, Debug)]
pub(crate) struct Input<'a> {
    pub spec: &'a VirtualMachineMigrationSpec,
    pub status: &'a VirtualMachineMigrationStatus,
    /// `metadata.name` of the migration.
    pub name: &'a str,
    /// `metadata.generation`.
    pub generation: i64,
    /// The retry annotation is present with value "true".
    pub retry_requested: bool,
    /// The cutover-approval annotation is present with value "true".
    pub cutover_approved: bool,
    /// What the rest of the fleet says (waves, read slots); asked at Validated.
    pub fleet: fleet::FleetGates,
    pub observed: Observed,
    pub now: Timestamp,
    /// Uniform in [0, 1): spreads retries of many migrations apart.
    pub jitter: f64,
    /// The source's power, read again after Preparing (Converting up to the
    /// start of the destination) once it was recorded off; `None` where not read.
    pub source: Option<Result<SourcePowerState, Failure>>,
    /// The extents of the copied disks as the host's `stat` describes them
    /// now (disk index, stat), read with `source` once it was seen off and
    /// a copy recorded its extent's stat; `None` where not read.
    pub extents: Option<Result<Vec<(usize, String)>, Failure>>,
    /// How long this process has seen the recorded `shutdownRequested`, on
    /// its own clock: durations that span replicas are measured locally
    /// (client-go's rule), so a replica whose clock runs ahead does not cut
    /// the guest's shutdown short. `None`: the wall clock alone.
    pub shutdown_seen_for: Option<Duration>,
    /// How long this process has looked at the migration without a gap
    /// (see `controller::reconciler::LOOK_GAP`), on its own clock: a wait
    /// that spans time nobody could look (an API outage, a restart) is
    /// judged only on what was watched. `None`: the recorded times alone.
    pub watched_for: Option<Duration>,
    /// The migration's manifest left Git (orphaned) and no person confirmed
    /// it may go on: it takes no irreversible step.
    pub orphan_hold: bool,
    /// The destination guest's serial console (its last lines), read in
    /// Starting and Validating once the VM was asked to run; `None` where
    /// not read or not available.
    pub console: Option<String>,
}

/// One idempotent external action. Performed in order, before the status write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Remove `migration.platform.example/retry` from the object.
    RemoveRetryAnnotation,
    /// `power.shutdown`: ask the guest to shut down (needs VMware Tools).
    RequestGuestShutdown,
    /// `power.off`: hard power-off. Only when the policy allows it.
    PowerOffHard,
    /// Start or resume copying one disk; a no-op when it is running or complete.
    StartDiskCopy {
        disk: usize,
    },
    /// Warm mode: create the migration's snapshot of the source (no memory),
    /// quiesced when VMware Tools run; a no-op when it exists.
    CreateSnapshot {
        quiesce: bool,
    },
    /// Warm mode: remove the migration's snapshot (the host consolidates it).
    RemoveSnapshot,
    /// Warm mode, after the cutover: copy one disk's deltas and assemble it.
    StartDeltaCopy {
        disk: usize,
    },
    /// Warm mode, before the cutover, where vmmigrate fills the volumes:
    /// publish one disk's base copy (`sha256`) and start the Job that fills
    /// its blank volume with it.
    StartBaseFill {
        disk: usize,
        sha256: String,
    },
    /// Delete a base fill Job that filled another base than the one copied now.
    DeleteBaseFill {
        disk: usize,
    },
    /// Remove a failed or corrupt local copy.
    DiscardDiskCopy {
        disk: usize,
    },
    /// Start converting one disk (a no-op for raw, where the copy is the artifact).
    StartConversion {
        disk: usize,
    },
    /// Remove an invalid or partial artifact.
    DiscardArtifact {
        disk: usize,
    },
    /// Publish a valid artifact where CDI can fetch it.
    StageArtifact {
        disk: usize,
    },
    /// Create the DataVolume `<name>-disk-<n>` if absent.
    CreateDataVolume {
        disk: usize,
    },
    /// Delete the DataVolume `<name>-disk-<n>` ("not found" is success).
    DeleteDataVolume {
        disk: usize,
    },
    /// Start the Job that reads disk's imported volume and hashes it.
    StartVolumeCheck {
        disk: usize,
    },
    DeleteVolumeCheck {
        disk: usize,
    },
    /// Create the VirtualMachine (runStrategy Halted) if absent.
    CreateVm,
    /// Update our drifted VirtualMachine to the rendered spec.
    UpdateVm,
    /// Set the requested runStrategy on the VirtualMachine.
    SetRunStrategy,
    /// Remove copied disks and staged artifacts.
    CleanupStaging,
    /// Delete the DataVolumes and VirtualMachine this migration created.
    DeleteDestination,
    /// Remove owner references from the VirtualMachine and DataVolumes so that
    /// deleting the migration never deletes the migrated VM.
    ReleaseDestination,
    /// Give up the claim on the source VM: a finished rehearsal is done with
    /// it, and the migration itself may claim it.
    ReleaseSourceClaim,
}

/// `Normal` or `Warning`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// A Kubernetes Event to publish with a stable reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub type_: EventType,
    pub reason: String,
    pub message: String,
}

/// What `decide` asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Performed in order; the first failure stops the rest and goes to `fail`.
    pub actions: Vec<Action>,
    /// The complete status to record after the actions succeed.
    pub status: VirtualMachineMigrationStatus,
    /// Look again after this long; `None` waits for a change (watch event).
    pub requeue: Option<Duration>,
    pub events: Vec<Event>,
}

/// The destination VM name: `spec.destination.name`, else the migration's
/// name; a rehearsal's VM has a name of its own ([`crate::api::rehearsal_name`]).
pub(crate) fn destination_name<'a>(
    spec: &'a VirtualMachineMigrationSpec,
    migration_name: &'a str,
) -> std::borrow::Cow<'a, str> {
    let name = spec.destination.name.as_deref().unwrap_or(migration_name);
    if spec.mode == crate::api::MigrationMode::Rehearsal {
        return crate::api::rehearsal_name(spec, name).into();
    }
    name.into()
}

/// The disks a migration works on: those its status records, or before
/// any is recorded, those discovery found.
pub(crate) fn disks_in_flight(status: Option<&VirtualMachineMigrationStatus>) -> usize {
    let recorded = status.map(|s| s.disks.len()).unwrap_or(0);
    if recorded > 0 {
        return recorded;
    }
    status.and_then(|s| s.source_inventory.as_ref()).map(|i| i.disks.len()).unwrap_or(0)
}

/// Every disk index a migration may have made objects for: the larger of
/// the recorded and the discovered count (cleanup and release leave none).
pub(crate) fn disks_ever_named(status: Option<&VirtualMachineMigrationStatus>) -> usize {
    let inventory = status.and_then(|s| s.source_inventory.as_ref()).map(|i| i.disks.len()).unwrap_or(0);
    inventory.max(status.map(|s| s.disks.len()).unwrap_or(0))
}

/// Deterministic DataVolume name of disk `n`.
pub(crate) fn data_volume_name(destination: &str, disk: usize) -> String {
    format!("{destination}-disk-{disk}")
}

/// Deterministic artifact key of disk `n`: `<migration-uid>/disk-<n>.<fmt>`.
pub fn artifact_key(migration_uid: &str, disk: usize, extension: &str) -> String {
    format!("{migration_uid}/disk-{disk}.{extension}")
}

/// Exponential backoff with equal jitter: half the delay fixed, half random.
pub(crate) fn backoff(spec: &VirtualMachineMigrationSpec, attempt: i32, jitter: f64) -> Duration {
    let initial = spec.strategy.backoff.initial_seconds.max(1) as f64;
    let max = spec.strategy.backoff.max_seconds.max(1) as f64;
    let exp = (attempt.max(1) - 1).min(30);
    let delay = (initial * 2f64.powi(exp)).min(max);
    let jitter = jitter.clamp(0.0, 1.0);
    Duration::from_millis(((delay / 2.0 + delay / 2.0 * jitter) * 1000.0) as u64)
}

/// Second-precision API time (what the API server stores).
pub(crate) fn api_time(now: Timestamp) -> Time {
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

fn elapsed_since(since: &Option<Time>, now: Timestamp) -> Option<Duration> {
    since.as_ref().map(|t| {
        let d: SignedDuration = now.duration_since(t.0);
        Duration::from_secs(d.as_secs().max(0) as u64)
    })
}

struct Ctx<'a> {
    spec: &'a VirtualMachineMigrationSpec,
    /// `metadata.name` of the migration.
    name: &'a str,
    generation: i64,
    now: Time,
    now_ts: Timestamp,
    jitter: f64,
    destination: std::borrow::Cow<'a, str>,
    status: VirtualMachineMigrationStatus,
    actions: Vec<Action>,
    events: Vec<Event>,
    requeue: Option<Duration>,
    shutdown_seen_for: Option<Duration>,
    watched_for: Option<Duration>,
}

impl<'a> Ctx<'a> {
    fn new(input: &Input<'a>) -> Ctx<'a> {
        Ctx {
            spec: input.spec,
            name: input.name,
            generation: input.generation,
            now: api_time(input.now),
            now_ts: input.now,
            jitter: input.jitter,
            destination: destination_name(input.spec, input.name),
            status: input.status.clone(),
            actions: Vec::new(),
            events: Vec::new(),
            requeue: None,
            shutdown_seen_for: input.shutdown_seen_for,
            watched_for: input.watched_for,
        }
    }

    /// Derives the kstatus conditions and hands out the decision.
    fn into_decision(mut self) -> Decision {
        conditions::summarize(&mut self.status, self.generation, &self.now);
        Decision { actions: self.actions, status: self.status, requeue: self.requeue, events: self.events }
    }

    fn condition(&mut self, type_: &str, value: bool, reason: &str, message: impl Into<String>) {
        conditions::set(&mut self.status, type_, value, reason, message, self.generation, &self.now);
    }

    fn event(&mut self, type_: EventType, reason: &str, message: impl Into<String>) {
        self.events.push(Event { type_, reason: reason.to_owned(), message: message.into() });
    }

    /// Moves to `phase`, recording the transition in the timeline.
    fn enter(&mut self, phase: Phase) {
        if self.status.phase == phase {
            return;
        }
        let from = self.status.phase;
        self.status.phase = phase;
        if phase != Phase::Validated {
            self.status.waiting = None;
        }
        self.status.history.push(PhaseTransition { phase, time: self.now.clone() });
        let overflow = self.status.history.len().saturating_sub(MAX_HISTORY);
        self.status.history.drain(..overflow);
        let type_ = if matches!(phase, Phase::Failed | Phase::ManualInterventionRequired | Phase::Retryable) {
            EventType::Warning
        } else {
            EventType::Normal
        };
        self.event(type_, phase.as_str(), format!("{from} -> {phase}"));
        if phase.is_active() || phase == Phase::Completed {
            self.requeue = Some(Duration::ZERO);
        }
    }

    /// Advances along the happy path after the checkpoint's goal was observed.
    /// A successful phase clears its retry bookkeeping.
    fn advance(&mut self, next: Phase) {
        // Rework in an earlier phase (`RetryStatus::resume`) keeps counting
        // against the budget of the phase that failed, until that one succeeds.
        if self.status.retry.as_ref().is_none_or(|r| r.phase == self.status.phase) {
            self.status.retry = None;
            self.status.failed_phase = None;
        }
        self.status.progress = None;
        self.enter(next);
    }

    fn record_error(&mut self, phase: Phase, failure: &Failure) {
        self.status.errors.push(MigrationError {
            time: self.now.clone(),
            phase,
            reason: failure.reason.to_string(),
            message: failure.message.clone(),
            retryable: failure.class == FailureClass::Retryable,
        });
        let overflow = self.status.errors.len().saturating_sub(MAX_ERRORS);
        self.status.errors.drain(..overflow);
    }

    /// Handles a classified failure of `phase` (observation or action).
    fn fail(&mut self, phase: Phase, failure: Failure) {
        self.fail_resuming(phase, None, failure)
    }

    /// Like `fail`, but a retry resumes from the earlier phase `resume`.
    fn fail_resuming(&mut self, phase: Phase, resume: Option<Phase>, failure: Failure) {
        self.record_error(phase, &failure);
        self.event(EventType::Warning, failure.reason.as_str(), failure.message.clone());
        self.status.failed_phase = Some(phase);
        self.status.progress = None;
        match failure.class {
            FailureClass::Retryable => {
                // Consecutive failures count together, also across rework in
                // an earlier phase, so a loop between phases stays bounded.
                let mut attempt = self.status.retry.as_ref().map_or(1, |r| r.attempt + 1);
                // The path to something failing (API server, SSH, a
                // timeout) or a full work directory is waited out with the
                // longest backoff; it never spends the budget. So is a host
                // that answered at discovery and cannot be reached now
                // (discovery itself always spends it: a wrong name).
                let reached_before = self.status.source_inventory.is_some() && phase != Phase::Discovering;
                if failure.reason.is_waited_out() || (failure.reason.is_host_reach() && reached_before) {
                    attempt = attempt.min(self.spec.strategy.retry_limit);
                }
                if attempt > self.spec.strategy.retry_limit {
                    // After the power-off the source is down and the copies
                    // are the only ones made: a person decides, never an automatic Failed.
                    let powered_off = self.status.timestamps.source_powered_off.is_some()
                        && self.spec.mode != MigrationMode::Rehearsal;
                    let exhausted = Failure {
                        class: match self.spec.strategy.on_retries_exhausted {
                            RetriesExhausted::Fail if !powered_off => FailureClass::Terminal,
                            _ => FailureClass::NeedsHuman,
                        },
                        reason: Reason::RetryBudgetExhausted.to_owned(),
                        message: format!(
                            "{phase} failed {attempt} times (retryLimit {}); last error {}: {}",
                            self.spec.strategy.retry_limit, failure.reason, failure.message
                        ),
                    };
                    self.status.retry = None;
                    return self.fail(phase, exhausted);
                }
                let delay = backoff(self.spec, attempt, self.jitter);
                let next = self.now_ts + SignedDuration::from_millis(delay.as_millis() as i64);
                self.status.retry =
                    Some(RetryStatus { phase, resume, attempt, next_attempt_at: api_time(next) });
                self.enter(Phase::Retryable);
                self.requeue = Some(delay);
            }
            FailureClass::NeedsHuman => {
                self.status.retry = None;
                if self.spec.mode == MigrationMode::Rehearsal && self.status.phase == Phase::Preparing {
                    // A rehearsal waiting for a person holds nothing on the
                    // running source: a retry copies again from a new snapshot.
                    let disks = self.status.source_inventory.as_ref().map_or(0, |i| i.disks.len());
                    if self.status.snapshot.as_ref().is_some_and(|s| s.removed.is_none()) {
                        self.actions.extend((0..disks).map(|disk| Action::DiscardDiskCopy { disk }));
                    }
                    self.drop_snapshot("the rehearsal waits for a person");
                }
                self.enter(Phase::ManualInterventionRequired);
                self.requeue = None;
            }
            FailureClass::Terminal => {
                self.status.retry = None;
                self.enter(Phase::Failed);
                // The finishing work runs in the Failed phase itself.
                self.requeue = Some(Duration::ZERO);
            }
        }
    }

    /// The finishing work of a terminal phase, done once and recorded with
    /// `timestamps.cleanedUp`. Of the source, it only removes a snapshot the
    /// migration still holds, after the cluster's own work (an unreachable
    /// host does not hold that up: the actions run in order).
    fn finish(&mut self) {
        if self.status.timestamps.cleaned_up.is_some() {
            return;
        }
        let completed = self.status.phase == Phase::Completed;
        let rehearsal = self.spec.mode == MigrationMode::Rehearsal;
        if !completed && !rehearsal && self.status.timestamps.source_powered_off.is_some() {
            // Failed after the source was powered off: what was copied and
            // imported stays for a person (nothing automatic deletes it).
            self.actions.push(Action::ReleaseDestination);
            self.drop_snapshot("the migration ended");
            self.event(
                EventType::Warning,
                "CopiesKept",
                "the migration failed after the source was powered off: its copies, artifacts and volumes are kept",
            );
            self.status.timestamps.cleaned_up = Some(self.now.clone());
            return;
        }
        if rehearsal {
            // A rehearsal's VM and volumes go with its manifest (its owner
            // references stay).
            if !completed && self.spec.cleanup.on_failure == CleanupAction::Delete {
                self.actions.push(Action::DeleteDestination);
            }
        } else if completed || self.spec.cleanup.on_failure == CleanupAction::Retain {
            // The migrated (or kept) VM must outlive its migration object.
            self.actions.push(Action::ReleaseDestination);
        } else {
            self.actions.push(Action::DeleteDestination);
        }
        if self.spec.cleanup.staging == CleanupAction::Delete {
            self.actions.push(Action::CleanupStaging);
        }
        // A migration that ends never leaves its snapshot on the source.
        self.drop_snapshot("the migration ended");
        if rehearsal {
            // Done with the source: the migration itself may claim it.
            self.actions.push(Action::ReleaseSourceClaim);
        }
        self.status.timestamps.cleaned_up = Some(self.now.clone());
    }

    /// Removes the snapshot the migration still holds, logged once.
    fn drop_snapshot(&mut self, why: &str) {
        if let Some(record) = self.status.snapshot.as_mut()
            && record.removed.is_none()
        {
            record.removing.get_or_insert_with(|| self.now.clone());
            record.removed = Some(self.now.clone());
            let message = format!("snapshot {} of the source removed ({why})", record.name);
            self.actions.push(Action::RemoveSnapshot);
            self.event(EventType::Normal, "SnapshotRemoved", message);
        }
    }

    fn wait(&mut self, after: Duration) {
        self.requeue = Some(match self.requeue {
            Some(current) => current.min(after),
            None => after,
        });
    }
}

/// What was read of the source after Preparing: its power and, once off,
/// its copied extents.
#[derive(Clone, Copy)]
pub(crate) struct SeenSource<'i> {
    pub power: Option<&'i Result<SourcePowerState, Failure>>,
    pub extents: Option<&'i Result<Vec<(usize, String)>, Failure>>,
}

/// The decision for one reconcile.
pub(crate) fn decide(input: Input<'_>) -> Decision {
    let mut ctx = Ctx::new(&input);
    let spec_changed = input.status.observed_generation.is_some_and(|g| g < input.generation);
    let phase = ctx.status.phase;
    let gating = Gating {
        now: input.now,
        cutover_approved: input.cutover_approved,
        fleet: input.fleet.clone(),
        orphan_hold: input.orphan_hold,
    };
    // After Preparing the source is looked at again until the destination
    // starts: a source on again ends the epoch before anything starts.
    if matches!(phase, Phase::Converting | Phase::Importing | Phase::CreatingVm)
        && ctx.status.timestamps.source_powered_off.is_some()
    {
        match &input.source {
            Some(Ok(seen)) if *seen != SourcePowerState::PoweredOff => {
                end_epoch(&mut ctx, *seen);
                return ctx.into_decision();
            }
            // Not seen off: nothing is built on copies that may be stale.
            Some(Err(failure)) if phase != Phase::CreatingVm => {
                ctx.fail(phase, failure.clone());
                return ctx.into_decision();
            }
            _ => {}
        }
        // Seen off, but it may have run between two looks: its extents say.
        match &input.extents {
            Some(Ok(extents)) if !extents_unchanged(&mut ctx, extents) => return ctx.into_decision(),
            Some(Err(failure)) if phase != Phase::CreatingVm => {
                ctx.fail(phase, failure.clone());
                return ctx.into_decision();
            }
            _ => {}
        }
    }
    // A guest asked to run whose console shows its initramfs gave up on the
    // root disk will not come up by waiting: a person (or a conversion) must.
    if matches!(phase, Phase::Starting | Phase::Validating)
        && ctx.status.timestamps.start_requested.is_some()
        && let Some(lines) = input.console.as_deref().and_then(console::root_disk_not_found)
    {
        let failure = Failure::needs_human(
            Reason::GuestRootDiskNotFound,
            format!(
                "the guest's kernel cannot find its root disk (its initramfs has no driver for the disk's bus; convert the guest with virt-v2v, or give it the bus it has a driver for); its console: {lines}"
            ),
        );
        ctx.fail(phase, failure);
        return ctx.into_decision();
    }
    match phase {
        Phase::Pending => {
            if ctx.status.timestamps.created.is_none() {
                ctx.status.timestamps.created = Some(ctx.now.clone());
            }
            ctx.status.history.push(PhaseTransition { phase: Phase::Pending, time: ctx.now.clone() });
            ctx.advance(Phase::Discovering);
        }
        Phase::Discovering => discovering(&mut ctx, input.observed),
        Phase::Validated => validated(&mut ctx, input.observed, &gating),
        Phase::Preparing => preparing(&mut ctx, input.observed, &gating),
        Phase::Converting => converting(&mut ctx, input.observed),
        Phase::Importing => importing::importing(&mut ctx, input.observed),
        Phase::CreatingVm => {
            let seen = SeenSource { power: input.source.as_ref(), extents: input.extents.as_ref() };
            creating_vm(&mut ctx, input.observed, seen)
        }
        Phase::Starting => {
            let seen = SeenSource { power: input.source.as_ref(), extents: input.extents.as_ref() };
            starting(&mut ctx, input.observed, seen)
        }
        Phase::Validating => validating(&mut ctx, input.observed),
        Phase::Retryable => match ctx.status.retry.clone() {
            Some(retry) => {
                let due = retry.next_attempt_at.0;
                if input.now >= due {
                    ctx.event(
                        EventType::Normal,
                        "RetryStarted",
                        format!(
                            "retry {} of {} for {}",
                            retry.attempt, input.spec.strategy.retry_limit, retry.phase
                        ),
                    );
                    ctx.enter(retry.resume.unwrap_or(retry.phase));
                } else {
                    let d: SignedDuration = due.duration_since(input.now);
                    ctx.wait(Duration::from_millis(d.as_millis().max(1) as u64));
                }
            }
            // A Retryable status without bookkeeping cannot come from this
            // machine; resume where the failure was recorded, or discover again.
            None => {
                let back = ctx.status.failed_phase.filter(|p| p.is_active()).unwrap_or(Phase::Discovering);
                ctx.enter(back);
            }
        },
        Phase::ManualInterventionRequired => {
            if input.retry_requested || spec_changed {
                let back = ctx.status.failed_phase.filter(|p| p.is_active()).unwrap_or(Phase::Discovering);
                // Reading the disks again takes a read slot: through the queue.
                let back = if back == Phase::Preparing { Phase::Validated } else { back };
                let why = if input.retry_requested { "retry annotation" } else { "spec change" };
                ctx.event(EventType::Normal, "RetryRequested", format!("{why}: resuming {back}"));
                ctx.status.retry = None;
                ctx.enter(back);
            }
        }
        Phase::Completed | Phase::Failed => {
            ctx.finish();
            if let Observed::Completed(vm) = input.observed {
                watch_drift(&mut ctx, vm);
            }
            if input.retry_requested {
                ctx.event(
                    EventType::Warning,
                    "RetryIgnored",
                    format!("{phase} is terminal; create a new VirtualMachineMigration to run again"),
                );
            }
        }
    }
    // The annotation is consumed on every reconcile that sees it.
    if input.retry_requested {
        ctx.actions.insert(0, Action::RemoveRetryAnnotation);
    }
    ctx.into_decision()
}

/// The decision after action `failed` of `decision` failed: the failure is
/// recorded against the phase that asked for the action.
pub(crate) fn action_failed(input: Input<'_>, decision_phase: Phase, failure: Failure) -> Decision {
    let mut ctx = Ctx::new(&input);
    let phase = if decision_phase.is_active() { decision_phase } else { input.status.phase };
    if phase.is_active() {
        ctx.fail(phase, failure);
    } else {
        // Actions of waiting or terminal phases (annotation removal, cleanup)
        // are retried by the controller's backoff without changing the phase.
        ctx.record_error(phase, &failure);
        ctx.event(EventType::Warning, failure.reason.as_str(), failure.message.clone());
    }
    ctx.into_decision()
}

/// Actions of the finalizer when the migration is deleted. The source is never touched.
pub(crate) fn cleanup_on_delete(
    spec: &VirtualMachineMigrationSpec,
    status: &VirtualMachineMigrationStatus,
) -> Vec<Action> {
    let mut actions = Vec::new();
    // A snapshot this migration took never outlives it: also one it took
    // whose record was lost with a crash (removed by its name, never another's).
    let took = spec.mode.takes_snapshot() && status.mode.is_some() && status.snapshot.is_none();
    if status.snapshot.as_ref().is_some_and(|s| s.removed.is_none()) || took {
        actions.push(Action::RemoveSnapshot);
    }
    if spec.cleanup.staging == CleanupAction::Delete || status.phase != Phase::Completed {
        actions.push(Action::CleanupStaging);
    }
    // What a rehearsal created goes with it, whatever its phase.
    if spec.mode != MigrationMode::Rehearsal
        && (status.phase == Phase::Completed || spec.cleanup.on_failure == CleanupAction::Retain)
    {
        actions.push(Action::ReleaseDestination);
    } else {
        actions.push(Action::DeleteDestination);
    }
    actions
}

fn mismatch(ctx: &mut Ctx<'_>, phase: Phase, what: &str) {
    // The controller observed something for another checkpoint; treat it as a
    // transient inconsistency (e.g. the status changed under us) and look again.
    ctx.fail(phase, Failure::retryable(Reason::ObservationMismatch, format!("expected {what} observation")));
}

fn discovering(ctx: &mut Ctx<'_>, observed: Observed) {
    match observed {
        Observed::Discovery(Ok(inventory)) => {
            let changed = ctx.status.source_inventory.as_ref().is_some_and(|old| old != &inventory);
            if changed {
                ctx.event(
                    EventType::Normal,
                    "InventoryChanged",
                    "the source VM changed since the last discovery",
                );
            }
            let summary = format!(
                "{} (vmid {}): {} disk(s), {} NIC(s), {} MiB, {:?}",
                inventory.name,
                inventory.vmid,
                inventory.disks.len(),
                inventory.nics.len(),
                inventory.memory_mib,
                inventory.firmware
            );
            ctx.status.source_inventory = Some(inventory);
            ctx.condition(condition::SOURCE_DISCOVERED, true, "Discovered", summary);
            ctx.advance(Phase::Validated);
        }
        Observed::Discovery(Err(failure)) => {
            ctx.condition(
                condition::SOURCE_DISCOVERED,
                false,
                failure.reason.as_str(),
                failure.message.clone(),
            );
            ctx.fail(Phase::Discovering, failure);
        }
        _ => mismatch(ctx, Phase::Discovering, "discovery"),
    }
}

/// Where the destination fills raw disks itself, its blank DataVolumes are
/// asked for once, as Preparing begins: CDI provisions them (a claim bound,
/// a pod that makes the empty image: seconds whatever the size) while the
/// disks are copied, and Importing only fills them. Blank volumes hold
/// nothing of the source, so asking before the power-off changes nothing.
fn request_volumes_early(ctx: &mut Ctx<'_>, facts: &PreparingFacts) {
    let disks = ctx.status.source_inventory.as_ref().map_or(0, |i| i.disks.len());
    if !facts.fills_volumes
        || ctx.spec.conversion.format != crate::api::DiskFormat::Raw
        || ctx.status.timestamps.volumes_requested.is_some()
        || disks == 0
    {
        return;
    }
    ctx.status.timestamps.volumes_requested = Some(ctx.now.clone());
    for disk in 0..disks {
        ctx.actions.push(Action::CreateDataVolume { disk });
    }
}

fn preparing(ctx: &mut Ctx<'_>, observed: Observed, input: &Gating) {
    let facts = match observed {
        Observed::Preparing(Ok(facts)) => facts,
        Observed::Preparing(Err(failure)) => return ctx.fail(Phase::Preparing, failure),
        _ => return mismatch(ctx, Phase::Preparing, "preparing"),
    };
    // The power-off guard: never act on power before validation passed.
    if !conditions::is_true(&ctx.status, condition::VALIDATED) {
        ctx.status.retry = None;
        ctx.event(EventType::Warning, "NotValidated", "Preparing without Validated=True; validating first");
        return ctx.enter(Phase::Validated);
    }
    // A rehearsal never looks at the power: it copies from a snapshot.
    if ctx.spec.mode == MigrationMode::Rehearsal {
        return rehearsal::preparing(ctx, &facts);
    }
    request_volumes_early(ctx, &facts);
    let already_off = ctx.status.timestamps.source_powered_off.is_some();
    // Warm: once a snapshot was taken, or while the source runs. A source
    // already off before anything was taken is copied cold.
    if ctx.spec.mode == MigrationMode::Warm
        && (ctx.status.snapshot.is_some() || (!already_off && facts.power != SourcePowerState::PoweredOff))
    {
        return warm::preparing(ctx, &facts, input);
    }
    match facts.power {
        SourcePowerState::PoweredOff => {
            // The power-off is recorded only for the source discovery saw.
            if !already_off {
                if !source_unchanged(ctx, &facts) {
                    return;
                }
                record_powered_off(ctx);
            }
        }
        // It ran again after the power-off: the copies of that epoch go.
        seen if already_off => return end_epoch(ctx, seen),
        SourcePowerState::Suspended => return ctx.fail(Phase::Preparing, suspended()),
        SourcePowerState::PoweredOn | SourcePowerState::Unknown => {
            // Nothing irreversible outside the cutover window: a window that
            // closed between admission and the first power action sends the
            // migration back to wait (its read slot goes to the next in line).
            let gate = match input.orphan_hold {
                true => Ok(Some(gates::orphan_wait())),
                false => fleet::cutover_gate(ctx.spec, &ctx.status, input.now, input.cutover_approved),
            };
            match gate {
                Ok(None) if source_unchanged(ctx, &facts) => return power_down(ctx, &facts),
                Ok(None) => return,
                Ok(Some(wait)) => {
                    ctx.enter(Phase::Validated);
                    return hold(ctx, wait);
                }
                Err(failure) => return ctx.fail(Phase::Preparing, failure),
            }
        }
    }
    // Observed off: copy every disk (in this epoch).
    let total = facts.copies.len();
    let Some((done, progress)) = tally_copies(ctx, &facts.copies) else { return };
    if done == total && total > 0 {
        ctx.status.disks = recorded_disks(ctx, &facts.copies);
        ctx.condition(
            condition::DISK_ACQUIRED,
            true,
            "Copied",
            format!("{total} disk(s) copied and checksummed"),
        );
        ctx.advance(Phase::Converting);
    } else {
        set_progress(ctx, progress);
        ctx.condition(
            condition::DISK_ACQUIRED,
            false,
            "Copying",
            format!("{done} of {total} disk(s) copied"),
        );
        ctx.wait(POLL_IN_PROGRESS);
    }
}

/// Each disk's copy: starts or resumes what is missing and sums the
/// progress; `(disks complete, progress)`, or `None` once a failed copy was
/// recorded as the phase's failure.
/// A copy of another epoch than the current one (or its snapshot's) is
/// stale: discarded, to be copied again.
fn tally_copies(ctx: &mut Ctx<'_>, copies: &[CopyState]) -> Option<(usize, Progress)> {
    let mut done = 0;
    let mut progress = Progress::default();
    for (disk, copy) in copies.iter().enumerate() {
        if stale(ctx, copy) {
            ctx.actions.push(Action::DiscardDiskCopy { disk });
            ctx.event(
                EventType::Warning,
                "StaleCopyDiscarded",
                format!(
                    "disk {disk}: the copy was made before power-off {} and is discarded",
                    ctx.status.epoch
                ),
            );
            progress.disks.push(DiskProgress { index: disk as i32, ..Default::default() });
            continue;
        }
        let (bytes_done, bytes_total) = match copy {
            CopyState::Absent => {
                ctx.actions.push(Action::StartDiskCopy { disk });
                (0, 0)
            }
            CopyState::Partial { bytes_done, bytes_total } => {
                ctx.actions.push(Action::StartDiskCopy { disk });
                (*bytes_done, *bytes_total)
            }
            CopyState::InProgress { bytes_done, bytes_total } => (*bytes_done, *bytes_total),
            CopyState::Complete { size, .. } => {
                done += 1;
                (*size, *size)
            }
            CopyState::Failed { failure, discard } => {
                if *discard {
                    ctx.actions.push(Action::DiscardDiskCopy { disk });
                }
                ctx.condition(
                    condition::DISK_ACQUIRED,
                    false,
                    failure.reason.as_str(),
                    failure.message.clone(),
                );
                ctx.fail(Phase::Preparing, failure.clone());
                return None;
            }
        };
        progress.disks.push(DiskProgress {
            index: disk as i32,
            bytes_done,
            bytes_total,
            ..Default::default()
        });
    }
    Some((done, progress))
}

/// What the status records of the copied disks: path, size and sha256 of
/// each complete copy.
fn recorded_disks(ctx: &Ctx<'_>, copies: &[CopyState]) -> Vec<DiskStatus> {
    let inventory = ctx.status.source_inventory.clone().unwrap_or_default();
    copies
        .iter()
        .enumerate()
        .map(|(i, copy)| {
            let (size, sha, remote, epoch, stat) = match copy {
                CopyState::Complete { size, sha256, verified_remotely, epoch, source } => {
                    (*size, Some(sha256.clone()), Some(*verified_remotely), *epoch, source.clone())
                }
                _ => (0, None, None, 0, None),
            };
            DiskStatus {
                index: i as i32,
                source_path: inventory.disks.get(i).map(|d| d.extent_path.clone()).unwrap_or_default(),
                size_bytes: size,
                source_sha256: sha,
                source_verified_remotely: remote,
                epoch,
                source_stat: stat,
                ..Default::default()
            }
        })
        .collect()
}

fn converting(ctx: &mut Ctx<'_>, observed: Observed) {
    let ConvertingFacts { artifacts, guest } = match observed {
        Observed::Converting(Ok(facts)) => facts,
        Observed::Converting(Err(failure)) => return ctx.fail(Phase::Converting, failure),
        _ => return mismatch(ctx, Phase::Converting, "converting"),
    };
    // A converted guest's raw artifacts are virt-v2v's disks, not the copies.
    let converts_guest = compatibility::converts_guest(ctx.spec, Some(&ctx.status));
    let mut ready = Vec::new();
    let mut progress = Progress::default();
    for (disk, artifact) in artifacts.iter().enumerate() {
        // A raw artifact is the copy itself: any other sha256 means it is
        // not what was copied, whatever its marker says.
        let foreign_raw = match artifact {
            ArtifactState::Complete { sha256, .. }
                if ctx.spec.conversion.format == DiskFormat::Raw && !converts_guest =>
            {
                ctx.status
                    .disks
                    .get(disk)
                    .and_then(|d| d.source_sha256.as_ref())
                    .filter(|copied| *copied != sha256)
                    .map(|copied| ArtifactState::Invalid {
                        reason: format!("the raw artifact's sha256 {sha256} is not the copy's {copied}"),
                    })
            }
            _ => None,
        };
        let artifact = foreign_raw.unwrap_or_else(|| artifact.clone());
        match artifact {
            ArtifactState::Absent => ctx.actions.push(Action::StartConversion { disk }),
            ArtifactState::InProgress { bytes_done, bytes_total } => progress.disks.push(DiskProgress {
                index: disk as i32,
                bytes_done,
                bytes_total,
                ..Default::default()
            }),
            ArtifactState::Invalid { reason } => {
                ctx.event(
                    EventType::Warning,
                    "InvalidArtifact",
                    format!("disk {disk}: {reason}; converting again"),
                );
                ctx.actions.push(Action::DiscardArtifact { disk });
                ctx.actions.push(Action::StartConversion { disk });
            }
            ArtifactState::Complete { staged_url: None, .. } => {
                ctx.actions.push(Action::StageArtifact { disk })
            }
            ArtifactState::Complete { sha256, staged_url: Some(url) } => ready.push((disk, sha256, url)),
            ArtifactState::Failed(failure) => {
                ctx.condition(
                    condition::DISK_CONVERTED,
                    false,
                    failure.reason.as_str(),
                    failure.message.clone(),
                );
                if [Reason::AcquiredCopyCorrupt, Reason::AcquiredCopyMissing].contains(&failure.reason)
                    && failure.class == FailureClass::Retryable
                {
                    // The source is off and its disks untouched: copy this disk again.
                    ctx.actions.push(Action::DiscardDiskCopy { disk });
                    return ctx.fail_resuming(Phase::Converting, Some(Phase::Preparing), failure.clone());
                }
                if failure.class == FailureClass::Retryable {
                    // Partial output and a failed conversion Job go; the retry starts afresh.
                    ctx.actions.push(Action::DiscardArtifact { disk });
                }
                return ctx.fail(Phase::Converting, failure.clone());
            }
        }
    }
    if ready.len() == artifacts.len() && !artifacts.is_empty() {
        let format = ctx.spec.conversion.format.extension().to_owned();
        for (disk, sha, url) in ready {
            if let Some(d) = ctx.status.disks.get_mut(disk) {
                d.artifact_sha256 = Some(sha.clone());
                d.artifact_url = Some(url.clone());
                d.artifact_format = Some(format.clone());
            }
        }
        if converts_guest {
            ctx.status.guest_conversion = guest;
        }
        ctx.condition(condition::DISK_CONVERTED, true, "Staged", "every artifact is valid and staged");
        ctx.advance(Phase::Importing);
    } else {
        let converting = !progress.disks.is_empty();
        if converting {
            set_progress(ctx, progress);
        }
        ctx.condition(condition::DISK_CONVERTED, false, "Converting", "converting and staging artifacts");
        // Publishing is done when the action returns: look again at once.
        // A conversion wakes the migration when it ends; the poll is the fallback.
        let staging_only = !converting
            && !ctx.actions.is_empty()
            && ctx.actions.iter().all(|a| matches!(a, Action::StageArtifact { .. }));
        ctx.wait(if staging_only { Duration::ZERO } else { POLL_IN_PROGRESS });
    }
}

/// After Completed the VirtualMachine is the user's: a change somebody makes
/// to it is reported (condition, Event, and through the status in Git),
/// never undone.
fn watch_drift(ctx: &mut Ctx<'_>, vm: Result<VmState, Failure>) {
    let (drifted, reason, message) = match vm {
        // A failed read says nothing about the VM.
        Err(_) => return,
        Ok(VmState::Matching { .. }) => {
            (false, "InSync", "the VirtualMachine says what the migration created".to_owned())
        }
        Ok(VmState::Drifted { differences, .. }) => (
            true,
            "Changed",
            format!(
                "the VirtualMachine was changed after the migration (not undone): {}",
                differences.join("; ")
            ),
        ),
        Ok(VmState::Absent) => {
            (true, "Deleted", "the VirtualMachine was deleted after the migration".to_owned())
        }
        Ok(VmState::NotOurs) => (
            true,
            "Replaced",
            "the VirtualMachine was replaced by one this migration did not create".to_owned(),
        ),
    };
    let before =
        ctx.status.conditions.iter().find(|c| c.type_ == condition::VM_DRIFTED).map(|c| c.message.clone());
    if drifted && before.as_deref() != Some(message.as_str()) {
        ctx.event(EventType::Warning, "VMDrifted", message.clone());
    }
    if drifted || before.is_some() {
        ctx.condition(condition::VM_DRIFTED, drifted, reason, message);
    }
    ctx.wait(DRIFT_WATCH);
}

/// How often a completed migration looks at its VirtualMachine.
pub(crate) const DRIFT_WATCH: Duration = Duration::from_secs(300);

fn set_progress(ctx: &mut Ctx<'_>, mut progress: Progress) {
    // Rates from the previous observation of the same disks; kept when no
    // whole second has passed (API times have second precision).
    let previous = ctx.status.progress.clone().unwrap_or_default();
    let moved = progress.disks.len() != previous.disks.len()
        || progress.disks.iter().any(|d| {
            previous.disks.iter().find(|b| b.index == d.index).map(|b| b.bytes_done) != Some(d.bytes_done)
        });
    // Nothing moved and the rate already says so: leave the status as it is.
    let elapsed = match &previous.updated {
        _ if !moved && previous.bytes_per_second == 0 && previous.updated.is_some() => 0,
        Some(t) => ctx.now.0.duration_since(t.0).as_secs(),
        None => 0,
    };
    for disk in &mut progress.disks {
        let before = previous.disks.iter().find(|d| d.index == disk.index);
        disk.bytes_per_second = match before {
            Some(b) if elapsed > 0 => ((disk.bytes_done - b.bytes_done) / elapsed).max(0),
            Some(b) => b.bytes_per_second,
            None => 0,
        };
    }
    progress.bytes_per_second = progress.disks.iter().map(|d| d.bytes_per_second).sum();
    progress.updated =
        if elapsed > 0 || previous.updated.is_none() { Some(ctx.now.clone()) } else { previous.updated };
    progress.bytes_done = progress.disks.iter().map(|d| d.bytes_done).sum();
    progress.bytes_total = progress.disks.iter().map(|d| d.bytes_total).sum();
    progress.percent = if progress.bytes_total > 0 {
        (progress.bytes_done * 100 / progress.bytes_total).clamp(0, 100) as i32
    } else {
        0
    };
    ctx.status.progress = Some(progress);
}

#[cfg(test)]
mod tests;
