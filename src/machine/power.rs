//! Preparing's power steps, for cold and warm migrations (a rehearsal has
//! none): recording the source off, asking it to shut down or powering it
//! off as `powerOffPolicy` allows, and the failures when it will not stay off.
//!
//! The rules (docs/state-machine.md, "What the world does around a migration"):
//! - a power-off is an epoch: copies carry the epoch they were made in; a
//!   power-on seen after it ends the epoch and discards them;
//! - at the power-off the inventory is read again and compared with
//!   discovery's; a difference stops before any power action;
//! - every power action is recorded in `status.powerActions` by the decision
//!   that asks for it, and the controller writes that record before it acts.

use super::*;
use crate::api::{MAX_POWER_ACTIONS, PowerActionKind, PowerActionRecord, SourceInventory};

/// The source is on again after vmmigrate recorded it off.
pub(super) fn powered_on_again() -> Failure {
    Failure::needs_human(
        Reason::SourcePoweredOnAgain,
        "the source VM was powered on again after vmmigrate recorded it off; its disks may have changed. Power it off and retry",
    )
}

pub(super) fn suspended() -> Failure {
    Failure::needs_human(
        Reason::SourceSuspended,
        "the source VM is suspended; resume and shut it down (or power it off) on the host, then retry",
    )
}

/// The source was observed powered off: recorded once per epoch, and the
/// epoch it opens is the one every copy made from now on carries.
pub(super) fn record_powered_off(ctx: &mut Ctx<'_>) {
    ctx.status.epoch += 1;
    ctx.status.timestamps.source_powered_off = Some(ctx.now.clone());
    ctx.status.timestamps.shutdown_requested.get_or_insert_with(|| ctx.now.clone());
    ctx.condition(condition::SOURCE_POWERED_OFF, true, "PoweredOff", "the source VM is powered off");
    ctx.event(EventType::Normal, "SourcePoweredOff", "the source VM is powered off");
}

/// Powers the source down as the policy allows. Only called with Validated=True
/// and no recorded power-off.
pub(super) fn power_down(ctx: &mut Ctx<'_>, facts: &PreparingFacts) {
    let policy = ctx.spec.power_off_policy;
    let requested = ctx.status.timestamps.shutdown_requested.clone();
    let timeout = Duration::from_secs(ctx.spec.strategy.timeouts.shutdown_seconds.max(1) as u64);
    // Both clocks must agree the timeout passed: `shutdownRequested` may
    // have been written by another replica whose clock differs from ours.
    let timed_out = elapsed_since(&requested, ctx.now_ts).is_some_and(|e| e >= timeout)
        && ctx.shutdown_seen_for.is_none_or(|local| local >= timeout);
    match policy {
        PowerOffPolicy::RequireAlreadyOff => ctx.fail(
            Phase::Preparing,
            Failure::needs_human(
                Reason::SourceNotPoweredOff,
                "powerOffPolicy is RequireAlreadyOff and the source VM is powered on; shut it down on the host, then retry",
            ),
        ),
        PowerOffPolicy::Force => {
            ask(ctx, PowerActionKind::PowerOff);
            ctx.condition(condition::SOURCE_POWERED_OFF, false, "PowerOffRequested", "hard power-off requested");
            ctx.wait(POLL_POWER_ACTION);
        }
        PowerOffPolicy::GracefulOnly | PowerOffPolicy::GracefulThenForce => {
            let may_force = policy == PowerOffPolicy::GracefulThenForce;
            if requested.is_none() && !facts.tools_running {
                if may_force {
                    ask(ctx, PowerActionKind::PowerOff);
                    ctx.condition(
                        condition::SOURCE_POWERED_OFF,
                        false,
                        "PowerOffRequested",
                        "VMware Tools is not running; hard power-off requested",
                    );
                    ctx.wait(POLL_POWER_ACTION);
                } else {
                    ctx.fail(
                        Phase::Preparing,
                        Failure::needs_human(
                            Reason::ToolsNotRunning,
                            "VMware Tools is not running, so a graceful shutdown is impossible and powerOffPolicy GracefulOnly forbids a hard power-off; shut the guest down yourself or change the policy",
                        ),
                    );
                }
            } else if requested.is_none() {
                ctx.status.timestamps.shutdown_requested = Some(ctx.now.clone());
                ask(ctx, PowerActionKind::Shutdown);
                ctx.condition(
                    condition::SOURCE_POWERED_OFF,
                    false,
                    "ShutdownRequested",
                    "graceful guest shutdown requested",
                );
                ctx.wait(POLL_POWER_ACTION);
            } else if timed_out && may_force {
                ask(ctx, PowerActionKind::PowerOff);
                ctx.condition(
                    condition::SOURCE_POWERED_OFF,
                    false,
                    "PowerOffRequested",
                    "the guest did not shut down in time; hard power-off requested",
                );
                ctx.wait(POLL_POWER_ACTION);
            } else if timed_out {
                ctx.fail(
                    Phase::Preparing,
                    Failure::needs_human(
                        Reason::GuestShutdownTimeout,
                        format!(
                            "the guest did not shut down within {}s and powerOffPolicy GracefulOnly forbids a hard power-off",
                            timeout.as_secs()
                        ),
                    ),
                );
                // A retry asks the guest again.
                ctx.status.timestamps.shutdown_requested = None;
            } else {
                ctx.condition(condition::SOURCE_POWERED_OFF, false, "ShuttingDown", "waiting for the guest to shut down");
                let early = elapsed_since(&requested, ctx.now_ts).is_some_and(|e| e < SHUTDOWN_FIRST_SECONDS);
                ctx.wait(if early { POLL_POWER_ACTION } else { POLL_SHUTDOWN });
            }
        }
    }
}

/// Asks for a power action and records it in `status.powerActions` in the
/// same decision: the controller writes that record (with the
/// resourceVersion it read, while it holds the lease) before it asks the
/// host, so no power action happens that the status does not show.
fn ask(ctx: &mut Ctx<'_>, kind: PowerActionKind) {
    let inventory = ctx.status.source_inventory.clone().unwrap_or_default();
    let seq = ctx.status.power_actions.last().map_or(0, |r| r.seq) + 1;
    ctx.status.power_actions.push(PowerActionRecord {
        seq,
        action: kind,
        epoch: ctx.status.epoch,
        vmid: inventory.vmid,
        bios_uuid: inventory.bios_uuid,
        recorded: ctx.now.clone(),
    });
    let overflow = ctx.status.power_actions.len().saturating_sub(MAX_POWER_ACTIONS);
    ctx.status.power_actions.drain(..overflow);
    ctx.actions.push(match kind {
        PowerActionKind::PowerOff => Action::PowerOffHard,
        PowerActionKind::Shutdown => Action::RequestGuestShutdown,
    });
}

/// The source was seen `seen` after vmmigrate recorded it off: the epoch
/// ends. Every copy made in it, and every artifact and volume made from
/// them, holds disks the source has moved past: all of it goes (a running
/// destination is never touched: it is only started while the source is
/// off). The power-off is forgotten, a new epoch begins, and a person is
/// asked; the next power-off opens one more and everything is copied again.
pub(super) fn end_epoch(ctx: &mut Ctx<'_>, seen: SourcePowerState) {
    end_epoch_because(ctx, "PoweredOnAgain", format!("the source VM was seen {seen:?}"), powered_on_again());
}

/// The extents of the copied disks, as the host's `stat` describes them
/// now (`extents`: disk index and stat), compared with what each copy
/// recorded: a disk whose extent changed after its copy was written by a
/// source that ran while nobody looked (powered on and off between two
/// reads of its power). The epoch ends as for a power-on seen; `false` then.
pub(super) fn extents_unchanged(ctx: &mut Ctx<'_>, extents: &[(usize, String)]) -> bool {
    let changed: Vec<String> = extents
        .iter()
        .filter_map(|(disk, now)| {
            let copied = ctx.status.disks.get(*disk)?.source_stat.as_ref()?;
            (copied != now).then(|| format!("disk {disk} ({copied} → {now})"))
        })
        .collect();
    if changed.is_empty() {
        return true;
    }
    let what = format!("the extent of {} changed after its copy (size:mtime)", changed.join(", "));
    let failure = Failure::needs_human(
        Reason::SourceDisksChanged,
        format!(
            "{what}: the source ran after vmmigrate recorded it off, unobserved; its disks may hold more. Power it off and retry"
        ),
    );
    end_epoch_because(ctx, "DisksChanged", what, failure);
    false
}

/// Ends the power-off epoch (see [`end_epoch`]): `why` is the condition's
/// reason, `what` what was seen, `failure` what the person is told.
fn end_epoch_because(ctx: &mut Ctx<'_>, why: &str, what: String, failure: Failure) {
    let epoch = ctx.status.epoch;
    // A new epoch begins: whatever a task of the old one still writes
    // (another process's, a worker's) carries the old number and is stale.
    ctx.status.epoch += 1;
    ctx.actions.push(Action::CleanupStaging);
    if ctx.status.phase >= Phase::Importing && ctx.status.phase.is_active() {
        ctx.actions.push(Action::DeleteDestination);
    }
    // A warm migration's snapshot no longer freezes anything of use.
    ctx.drop_snapshot("the source ran again after the cutover");
    ctx.status.snapshot = None;
    ctx.status.timestamps.source_powered_off = None;
    ctx.status.timestamps.shutdown_requested = None;
    ctx.status.timestamps.start_requested = None;
    ctx.status.disks.clear();
    ctx.status.destination_vm = None;
    ctx.condition(condition::SOURCE_POWERED_OFF, false, why, what.clone());
    ctx.condition(
        condition::DISK_ACQUIRED,
        false,
        "EpochEnded",
        format!("the copies of power-off epoch {epoch} were discarded: the source ran after them"),
    );
    ctx.event(
        EventType::Warning,
        "EpochEnded",
        format!(
            "{what} after power-off {epoch} was recorded: every copy, artifact and volume made since is discarded, and everything is copied again after the next power-off"
        ),
    );
    ctx.fail(Phase::Preparing, failure);
}

/// A complete copy made in another epoch than the current one (or, for a
/// base copied from the migration's snapshot, than the snapshot's): stale.
pub(super) fn stale(ctx: &Ctx<'_>, copy: &CopyState) -> bool {
    let snapshot = ctx.status.snapshot.as_ref().map(|s| s.epoch);
    matches!(copy, CopyState::Complete { epoch, .. } if *epoch != ctx.status.epoch && Some(*epoch) != snapshot)
}

/// At the cutover the source is read again: a source that is not what
/// discovery saw (another VM under the vmid, a disk added, moved or resized,
/// a snapshot taken by a backup tool) stops the migration before any power
/// action or power-off record. `false` when the decision is made.
pub(super) fn source_unchanged(ctx: &mut Ctx<'_>, facts: &PreparingFacts) -> bool {
    let Some(recorded) = ctx.status.source_inventory.clone() else { return true };
    let own_snapshot = facts.snapshot.is_some();
    match &facts.inventory {
        Some(Ok(now)) => {
            let changes = inventory_changes(&recorded, now, own_snapshot);
            if changes.is_empty() {
                return true;
            }
            let message = format!(
                "the source VM changed since discovery: {}; nothing was powered off. Retry to discover it again",
                changes.join("; ")
            );
            ctx.condition(
                condition::SOURCE_DISCOVERED,
                false,
                Reason::SourceChangedSinceDiscovery.as_str(),
                message.clone(),
            );
            // What was copied from the old source goes, and a warm migration's
            // snapshot with it: the retry starts from a new discovery (and
            // validates what it finds).
            if ctx.status.snapshot.as_ref().is_some_and(|s| s.removed.is_none()) {
                ctx.actions.extend((0..facts.copies.len()).map(|disk| Action::DiscardDiskCopy { disk }));
                ctx.drop_snapshot("the source changed since discovery");
            }
            ctx.status.snapshot = None;
            ctx.fail(Phase::Discovering, Failure::needs_human(Reason::SourceChangedSinceDiscovery, message));
            false
        }
        Some(Err(failure)) => {
            ctx.fail(Phase::Preparing, failure.clone());
            false
        }
        None => {
            ctx.fail(
                Phase::Preparing,
                Failure::retryable(
                    Reason::ObservationMismatch,
                    "the source's inventory was not read before the cutover",
                ),
            );
            false
        }
    }
}

/// What differs between discovery's inventory and one read now, in words.
/// `own_snapshot`: the migration's own snapshot is on the source (warm),
/// which points the disks at its deltas.
pub(crate) fn inventory_changes(
    before: &SourceInventory,
    now: &SourceInventory,
    own_snapshot: bool,
) -> Vec<String> {
    let mut changes = Vec::new();
    let mut differs = |what: &str, a: &dyn std::fmt::Display, b: &dyn std::fmt::Display| {
        changes.push(format!("{what} was {a}, is {b}"));
    };
    if before.vmid != now.vmid {
        differs("vmid", &before.vmid, &now.vmid);
    }
    if before.bios_uuid != now.bios_uuid {
        differs("BIOS UUID", &before.bios_uuid, &now.bios_uuid);
    }
    if before.vmx_path != now.vmx_path {
        differs(".vmx", &before.vmx_path, &now.vmx_path);
    }
    // Discovery does not count the migration's own snapshot.
    if before.snapshots != now.snapshots {
        differs("snapshots (not vmmigrate's)", &before.snapshots, &now.snapshots);
    }
    if before.disks.len() != now.disks.len() {
        differs("disk count", &before.disks.len(), &now.disks.len());
    }
    for (a, b) in before.disks.iter().zip(&now.disks) {
        if a.device != b.device || a.capacity_bytes != b.capacity_bytes {
            changes.push(format!(
                "disk {} was {} of {} bytes, is {} of {} bytes",
                a.index, a.device, a.capacity_bytes, b.device, b.capacity_bytes
            ));
        }
        if !own_snapshot && a.extent_path != b.extent_path {
            changes.push(format!("disk {} was {}, is {}", a.index, a.extent_path, b.extent_path));
        }
    }
    changes
}
