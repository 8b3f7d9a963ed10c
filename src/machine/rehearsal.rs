//! Preparing, rehearsal (`spec.mode: Rehearsal`): a snapshot of the source
//! freezes its disks, which are copied while the VM runs; once every disk is
//! copied the snapshot is removed (the host consolidates it) and the copies
//! go on as a migration's would, to a VM of another name. The source's power
//! is never touched, whatever it is: this file asks for no power action,
//! and the engine refuses one for a rehearsal besides.
//! Every step is recorded before the next and idempotent, as in warm mode.

use super::warm::{finish_from_snapshot, snapshot_taken};
use super::*;
use crate::api::snapshot_name;

pub(super) fn preparing(ctx: &mut Ctx<'_>, facts: &PreparingFacts) {
    let name = snapshot_name(ctx.name);
    let total = facts.copies.len();
    let copied = ctx.status.snapshot.is_some()
        && total > 0
        && facts.copies.iter().all(|c| matches!(c, CopyState::Complete { .. }));

    // A disk to read again (Converting found its copy corrupt or gone) once
    // the snapshot was removed: every disk is copied again from a new
    // snapshot, so that the disks still show one moment of the VM.
    let removed = ctx.status.snapshot.as_ref().is_some_and(|s| s.removed.is_some());
    if removed && !copied {
        ctx.status.snapshot = None;
        for disk in 0..total {
            ctx.actions.push(Action::DiscardDiskCopy { disk });
        }
        ctx.event(
            EventType::Normal,
            "SnapshotRetaken",
            "a disk must be read again: every disk is copied again from a new snapshot",
        );
        return ctx.wait(Duration::ZERO);
    }
    if !snapshot_taken(ctx, facts, &name) {
        return;
    }
    if copied {
        let summary = format!(
            "{total} disk(s) copied from snapshot {name} while the VM ran, and checksummed; the snapshot is removed"
        );
        let how = "its disks are copied; the VM keeps running";
        return finish_from_snapshot(ctx, facts, &name, &facts.copies, how, summary);
    }
    let Some((done, progress)) = tally_copies(ctx, &facts.copies) else { return };
    set_progress(ctx, progress);
    ctx.condition(
        condition::DISK_ACQUIRED,
        false,
        "CopyingFromSnapshot",
        format!("{done} of {total} disk(s) copied from snapshot {name} while the VM runs"),
    );
    ctx.wait(POLL_IN_PROGRESS);
}
