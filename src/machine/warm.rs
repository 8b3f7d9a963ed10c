//! Preparing, warm (`spec.mode: Warm`): a snapshot of the source freezes its
//! base disks, which are copied while the VM runs; at the cutover (the same
//! gate and power policy as a cold migration) the VM is powered off, only
//! the snapshot's deltas are copied, each disk is assembled from its base
//! copy and deltas, and the snapshot is removed (the host consolidates it).
//! Every step is recorded before the next, and each is idempotent: the
//! snapshot is found by name, copies resume from their chunks, a disk
//! assembled twice from the same parts is the same disk.

use super::gates::{hold, note_approval};
use super::*;
use crate::api::snapshot_name;
use crate::api::{SnapshotRecord, VolumeBase};

pub(super) fn preparing(ctx: &mut Ctx<'_>, facts: &PreparingFacts, input: &Gating) {
    let name = snapshot_name(ctx.name);
    let mut off = ctx.status.timestamps.source_powered_off.is_some();
    match facts.power {
        // Off before the cutover (the user shut it down): recorded only for
        // the source discovery saw, once its bases are copied.
        SourcePowerState::PoweredOff
            if !off && facts.copies.iter().all(|c| matches!(c, CopyState::Complete { .. })) =>
        {
            if !source_unchanged(ctx, facts) {
                return;
            }
            record_powered_off(ctx);
            off = true;
        }
        // It ran again after the power-off: the copies of that epoch go.
        seen @ (SourcePowerState::PoweredOn | SourcePowerState::Unknown | SourcePowerState::Suspended)
            if off =>
        {
            return end_epoch(ctx, seen);
        }
        SourcePowerState::Suspended => return ctx.fail(Phase::Preparing, suspended()),
        _ => {}
    }

    if !snapshot_taken(ctx, facts, &name) {
        return;
    }
    // Done: every disk assembled from its base and deltas. The snapshot goes.
    let assembled = off
        && !facts.deltas.is_empty()
        && facts.deltas.iter().all(|d| matches!(d, CopyState::Complete { .. }));
    if assembled {
        let summary = format!(
            "{} disk(s): bases copied while the VM ran, deltas after the cutover, assembled and checksummed",
            facts.deltas.len()
        );
        finish_from_snapshot(ctx, facts, &name, &facts.deltas, "the host consolidated it", summary);
        // Each disk's patch, for a volume that holds its base.
        for (disk, patch) in ctx.status.disks.iter_mut().zip(&facts.patches) {
            disk.patch = patch.clone();
        }
        return;
    }

    // The frozen bases, copied while the VM runs; a VM that went off before
    // they were done (the user shut it down) still has them copied first,
    // as the snapshot keeps them frozen. (Once the deltas are applied, a
    // base copy reads complete: it is the assembled disk.)
    let total = facts.copies.len();
    let Some((done, progress)) = tally_copies(ctx, &facts.copies) else { return };
    if done < total {
        set_progress(ctx, progress);
        ctx.condition(
            condition::DISK_ACQUIRED,
            false,
            "CopyingBase",
            format!("{done} of {total} base disk(s) copied from snapshot {name}"),
        );
        return ctx.wait(POLL_IN_PROGRESS);
    }
    if !off {
        if !bases_filled(ctx, facts) {
            return;
        }
        return cutover(ctx, facts, input, total);
    }
    ctx.status.waiting = None;

    // After the cutover the bases are copied and the source is off: the
    // snapshot's removal can no longer change what was or will be read (the
    // deltas do not change, and the bases are copied), so it is decided now,
    // and done in the step that finds every disk assembled, without one more
    // step on the downtime. Gone before that, it was someone else: the
    // deltas are lost.
    if let Some(record) = ctx.status.snapshot.as_mut() {
        // (`snapshot_taken` let a missing snapshot through only with the
        // decision recorded; before every disk is assembled that decision
        // was never carried out by vmmigrate.)
        if facts.snapshot.is_none() {
            let message = format!(
                "the snapshot {} of the source was removed outside vmmigrate after the cutover, before its deltas were copied; the copies are discarded, and a retry copies the disks again",
                record.name
            );
            return snapshot_lost(ctx, facts, message);
        }
        record.removing.get_or_insert_with(|| ctx.now.clone());
    }

    copy_deltas(ctx, facts, total);
}

/// After the cutover: only the deltas, then each disk assembled from its
/// base and its deltas.
fn copy_deltas(ctx: &mut Ctx<'_>, facts: &PreparingFacts, total: usize) {
    let mut progress = Progress::default();
    let mut assembled = 0;
    for disk in 0..total {
        let state = facts.deltas.get(disk).cloned().unwrap_or(CopyState::Absent);
        let (bytes_done, bytes_total) = match &state {
            CopyState::Absent | CopyState::Partial { .. } => {
                ctx.actions.push(Action::StartDeltaCopy { disk });
                (0, 0)
            }
            CopyState::InProgress { bytes_done, bytes_total } => (*bytes_done, *bytes_total),
            CopyState::Complete { size, .. } => {
                assembled += 1;
                (*size, *size)
            }
            CopyState::Failed { failure, .. } => {
                ctx.condition(
                    condition::DISK_ACQUIRED,
                    false,
                    failure.reason.as_str(),
                    failure.message.clone(),
                );
                return ctx.fail(Phase::Preparing, failure.clone());
            }
        };
        progress.disks.push(DiskProgress {
            index: disk as i32,
            bytes_done,
            bytes_total,
            ..Default::default()
        });
    }
    set_progress(ctx, progress);
    ctx.condition(
        condition::DISK_ACQUIRED,
        false,
        "CopyingDeltas",
        format!(
            "{assembled} of {total} disk(s) assembled from their base and the deltas copied after the cutover"
        ),
    );
    ctx.wait(POLL_IN_PROGRESS);
}

/// Where vmmigrate fills the volumes (asked for blank as Preparing began),
/// each volume is filled with its disk's base while the VM still runs, so
/// that after the cutover only the changed ranges are written into it
/// (Importing, `ImportVerification::Patched`). `true` once every volume
/// holds its base, or will be filled whole after the cutover (its fill
/// failed, or this destination cannot fill bases): the cutover waits for
/// the fills, never for ever.
fn bases_filled(ctx: &mut Ctx<'_>, facts: &PreparingFacts) -> bool {
    // A volume still not provisioned after the import stall timeout (from
    // when it was asked for) is not waited for any longer.
    let stall = Duration::from_secs(ctx.spec.strategy.timeouts.import_stall_seconds.max(1) as u64);
    let asked = elapsed_since(&ctx.status.timestamps.volumes_requested, ctx.now_ts).unwrap_or_default();
    let mut filling = 0;
    for (disk, (volume, fill)) in facts.base_fills.iter().enumerate() {
        let Some(CopyState::Complete { sha256: base, .. }) = facts.copies.get(disk) else { continue };
        let settled = ctx.status.volume_bases.iter().any(|b| b.disk == disk as i32 && &b.sha256 == base);
        let Some(fill) = fill else { continue };
        if settled {
            continue;
        }
        match (volume, fill) {
            // A volume not provisioned yet is waited for; one gone or failed
            // is Importing's to make again, whole.
            (DataVolumeState::InProgress { .. }, _) if asked < stall => filling += 1,
            (DataVolumeState::InProgress { phase, .. }, _) => {
                let why =
                    format!("its DataVolume is still {phase} {}s after it was asked for", asked.as_secs());
                give_up_base(ctx, disk, base, why)
            }
            (DataVolumeState::Absent | DataVolumeState::Failed(_), _) => {
                give_up_base(ctx, disk, base, "its DataVolume is not there to fill".into())
            }
            (DataVolumeState::Succeeded, VolumeCheck::Absent) => {
                ctx.status.forget_volume_base(disk);
                ctx.actions.push(Action::StartBaseFill { disk, sha256: base.clone() });
                filling += 1;
            }
            (DataVolumeState::Succeeded, VolumeCheck::Running) => filling += 1,
            (DataVolumeState::Succeeded, VolumeCheck::Matches { sha256 }) if sha256 == base => {
                ctx.status.forget_volume_base(disk);
                ctx.status.volume_bases.push(VolumeBase {
                    disk: disk as i32,
                    sha256: base.clone(),
                    filled: Some(ctx.now.clone()),
                    failed: None,
                });
            }
            // A Job that filled another base (an earlier epoch's) goes, and
            // this one is filled.
            (DataVolumeState::Succeeded, VolumeCheck::Matches { .. }) => {
                ctx.status.forget_volume_base(disk);
                ctx.actions.push(Action::DeleteBaseFill { disk });
                filling += 1;
            }
            (DataVolumeState::Succeeded, VolumeCheck::Differs { sha256, .. }) => {
                let why = format!("the bytes written hash to {sha256}, not the base's");
                give_up_base(ctx, disk, base, why)
            }
            (DataVolumeState::Succeeded, VolumeCheck::Failed(failure)) => {
                give_up_base(ctx, disk, base, failure.message.clone())
            }
            (DataVolumeState::Succeeded, VolumeCheck::Unavailable(why)) => {
                give_up_base(ctx, disk, base, why.clone())
            }
        }
    }
    if filling == 0 {
        return true;
    }
    let total = facts.base_fills.len();
    let held = ctx.status.volume_bases.iter().filter(|b| b.filled.is_some()).count();
    ctx.condition(
        condition::DISK_ACQUIRED,
        false,
        "FillingBase",
        format!("{held} of {total} volume(s) hold their disk's base; the cutover follows the fills"),
    );
    ctx.wait(POLL_IN_PROGRESS);
    false
}

/// A base fill that did not end with the base in the volume: the volume is
/// filled whole after the cutover instead (whatever it holds now is
/// overwritten), and the cutover does not wait for it again.
fn give_up_base(ctx: &mut Ctx<'_>, disk: usize, base: &str, why: String) {
    ctx.status.forget_volume_base(disk);
    ctx.event(
        EventType::Warning,
        "BaseFillFailed",
        format!("disk {disk}: the volume was not filled with its base ({why}); it is filled whole after the cutover"),
    );
    ctx.status.volume_bases.push(VolumeBase {
        disk: disk as i32,
        sha256: base.to_owned(),
        filled: None,
        failed: Some(why),
    });
}

/// Every base copied and the source still on: the cutover, as for a cold
/// migration, once its gate opens; until then the bases and the snapshot
/// stay and the read slot is kept.
fn cutover(ctx: &mut Ctx<'_>, facts: &PreparingFacts, input: &Gating, total: usize) {
    // Every base copied: the cutover, as for a cold migration.
    let gate = match input.orphan_hold {
        true => Ok(Some(super::gates::orphan_wait())),
        false => fleet::cutover_gate(ctx.spec, &ctx.status, input.now, input.cutover_approved),
    };
    match gate {
        Ok(None) if !source_unchanged(ctx, facts) => {}
        Ok(None) => {
            note_approval(ctx);
            ctx.condition(
                condition::DISK_ACQUIRED,
                false,
                "BaseCopied",
                format!("{total} base disk(s) copied; the source is powered off for the deltas"),
            );
            power_down(ctx, facts)
        }
        // The bases stay copied and the snapshot stays; the read slot is kept.
        Ok(Some(wait)) => {
            ctx.condition(
                condition::DISK_ACQUIRED,
                false,
                "BaseCopied",
                format!("{total} base disk(s) copied; waiting for the cutover: {}", wait.message),
            );
            hold(ctx, wait)
        }
        Err(failure) => ctx.fail(Phase::Preparing, failure),
    }
}

/// Every disk copied (and, warm, assembled): the decision to remove the
/// snapshot is recorded first, so that a snapshot found gone without it is
/// known to be someone else's doing; then it is removed, the disks recorded,
/// and Preparing is done.
pub(super) fn finish_from_snapshot(
    ctx: &mut Ctx<'_>,
    facts: &PreparingFacts,
    name: &str,
    disks: &[CopyState],
    how: &str,
    summary: String,
) {
    if let Some(record) = ctx.status.snapshot.as_mut()
        && record.removing.is_none()
    {
        record.removing = Some(ctx.now.clone());
        return ctx.wait(Duration::ZERO);
    }
    remove_snapshot(ctx, facts, name, how);
    ctx.status.disks = recorded_disks(ctx, disks);
    // Removing the snapshot writes its delta into the extents: their stat
    // says nothing of the copies from now on.
    for disk in &mut ctx.status.disks {
        disk.source_stat = None;
    }
    ctx.condition(condition::DISK_ACQUIRED, true, "Copied", summary);
    ctx.advance(Phase::Converting);
}

/// Removes the migration's snapshot when the host still has it, and logs
/// the removal once (found gone after a crash that removed it: that was
/// this removal, as `removing` was recorded before).
fn remove_snapshot(ctx: &mut Ctx<'_>, facts: &PreparingFacts, name: &str, how: &str) {
    if facts.snapshot.is_some() {
        ctx.actions.push(Action::RemoveSnapshot);
    }
    if let Some(record) = ctx.status.snapshot.as_mut()
        && record.removed.is_none()
    {
        record.removed = Some(ctx.now.clone());
        ctx.events.push(Event {
            type_: EventType::Normal,
            reason: "SnapshotRemoved".into(),
            message: format!("snapshot {name} of the source removed ({how})"),
        });
    }
}

/// The migration's snapshot: taken when none was, its id kept current.
/// `false` when the decision is made (the snapshot was just asked for, or
/// it vanished behind vmmigrate's back and the copies are discarded).
pub(super) fn snapshot_taken(ctx: &mut Ctx<'_>, facts: &PreparingFacts, name: &str) -> bool {
    match (&ctx.status.snapshot, &facts.snapshot) {
        (None, existing) => {
            ctx.actions.push(Action::CreateSnapshot { quiesce: facts.tools_running });
            ctx.status.snapshot = Some(SnapshotRecord {
                name: name.to_owned(),
                id: existing.clone(),
                quiesced: facts.tools_running,
                created: ctx.now.clone(),
                removing: None,
                removed: None,
                left_on_source: None,
                epoch: ctx.status.epoch,
            });
            let how = if facts.tools_running { "quiesced, " } else { "" };
            ctx.event(
                EventType::Normal,
                "SnapshotCreated",
                format!("snapshot {name} of the source created ({how}no memory): its base disks are copied while the VM runs"),
            );
            ctx.condition(
                condition::DISK_ACQUIRED,
                false,
                "SnapshotCreated",
                format!("snapshot {name} created"),
            );
            ctx.wait(Duration::ZERO);
            return false;
        }
        // Gone after a warm migration decided to remove it while the VM
        // runs (a rehearsal removes it so once its copies are done): the
        // migration was starting over (a crash came between the removal and
        // its record); its copies went first. A new one is taken.
        (Some(record), None)
            if record.removing.is_some()
                && ctx.spec.mode == crate::api::MigrationMode::Warm
                && facts.power != SourcePowerState::PoweredOff =>
        {
            ctx.status.snapshot = None;
            ctx.wait(Duration::ZERO);
            return false;
        }
        // Gone after vmmigrate decided to remove it: its own removal (a crash
        // came between the removal and its record).
        (Some(record), None) if record.removing.is_some() => {}
        (Some(record), None) => {
            // Gone, and not by this migration: the bases copied from it no longer vouch for anything.
            let message = format!(
                "the snapshot {} of the source was removed outside vmmigrate; the base copies are discarded, and a retry takes a new snapshot",
                record.name
            );
            snapshot_lost(ctx, facts, message);
            return false;
        }
        (Some(record), Some(id)) if record.id.as_ref() != Some(id) => {
            if let Some(record) = ctx.status.snapshot.as_mut() {
                record.id = Some(id.clone());
            }
        }
        _ => {}
    }

    true
}

/// The snapshot was removed outside vmmigrate: the copies read from it no
/// longer vouch for anything; they are discarded and a person is asked.
fn snapshot_lost(ctx: &mut Ctx<'_>, facts: &PreparingFacts, message: String) {
    ctx.status.snapshot = None;
    for disk in 0..facts.copies.len() {
        ctx.actions.push(Action::DiscardDiskCopy { disk });
    }
    ctx.fail(Phase::Preparing, Failure::needs_human(Reason::SnapshotFailed, message));
}
