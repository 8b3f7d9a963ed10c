//! Validated: the pre-flight checks, then the gates before the cutover
//! (the wave, the cutover window or approval, a read slot), in that order.
//! A migration held at a gate stays Validated, says what it waits for in
//! `status.waiting` and is not observed again until a gate may have opened.

use super::*;

pub(super) fn validated(ctx: &mut Ctx<'_>, observed: Observed, input: &Gating) {
    let facts = match observed {
        Observed::Preflight(Ok(facts)) => facts,
        Observed::Preflight(Err(failure)) => return ctx.fail(Phase::Validated, failure),
        // Validated before and still held at a gate: nothing was observed.
        Observed::Nothing if conditions::is_true(&ctx.status, condition::VALIDATED) => {
            return match gate(ctx, input) {
                Ok(Some(wait)) => hold(ctx, wait),
                Ok(None) => mismatch(ctx, Phase::Validated, "pre-flight"),
                Err(failure) => ctx.fail(Phase::Validated, failure),
            };
        }
        _ => return mismatch(ctx, Phase::Validated, "pre-flight"),
    };
    let Some(inventory) = ctx.status.source_inventory.clone() else {
        // Validation needs an inventory: discover again (never back to Pending).
        let failure =
            Failure::retryable(Reason::InventoryMissing, "no source inventory recorded; discovering again");
        ctx.status.retry = None;
        ctx.record_error(Phase::Validated, &failure);
        return ctx.enter(Phase::Discovering);
    };
    let blockers = preflight::blockers(ctx.spec, &ctx.destination, &inventory, &facts);
    ctx.status.warnings = super::compatibility::findings(ctx.spec, &inventory).warnings;
    if blockers.is_empty() {
        ctx.status.blockers.clear();
        ctx.condition(condition::VALIDATED, true, "ChecksPassed", "all pre-flight checks passed");
        match gate(ctx, input) {
            Ok(Some(wait)) => hold(ctx, wait),
            Ok(None) => {
                ctx.status.waiting = None;
                // From here on the mode is fixed, whatever the spec says later.
                if ctx.status.mode.is_none() {
                    ctx.status.mode = Some(ctx.spec.mode);
                    ctx.status.rehearsal = ctx.spec.rehearsal.clone();
                }
                ctx.advance(Phase::Preparing);
            }
            Err(failure) => ctx.fail(Phase::Validated, failure),
        }
    } else {
        let message =
            blockers.iter().map(|b| format!("{}: {}", b.reason, b.message)).collect::<Vec<_>>().join("; ");
        let first = blockers[0].reason.clone();
        ctx.status.blockers = blockers;
        ctx.status.waiting = None;
        ctx.condition(condition::VALIDATED, false, &first, message.clone());
        // After a fix, the retry re-reads the source: resume at Discovering.
        ctx.fail(Phase::Validated, Failure::needs_human(Reason::ValidationBlocked, message));
        ctx.status.failed_phase = Some(Phase::Discovering);
    }
}

/// What the gates before the cutover are asked with.
pub(super) struct Gating {
    pub(super) now: Timestamp,
    pub(super) cutover_approved: bool,
    pub(super) fleet: fleet::FleetGates,
    /// Orphaned in Git and not confirmed: no irreversible step.
    pub(super) orphan_hold: bool,
}

/// An orphaned migration (its manifest left Git) holds before its cutover
/// until a person confirms it (or the manifest comes back).
pub(super) fn orphan_wait() -> fleet::Wait {
    fleet::Wait {
        reason: Reason::OrphanNotConfirmed,
        message: format!(
            "the manifest of this migration left Git; it takes no irreversible step until a person sets the annotation {}=true or the manifest comes back",
            crate::api::CONFIRM_ORPHAN_ANNOTATION
        ),
        until: None,
        position: None,
    }
}

/// The first gate that holds the cutover, in order: wave, cutover, read slot.
/// Records an approval the first time it is seen.
fn gate(ctx: &mut Ctx<'_>, input: &Gating) -> Result<Option<fleet::Wait>, Failure> {
    if let Some(wait) = &input.fleet.wave {
        return Ok(Some(wait.clone()));
    }
    if input.orphan_hold && !copies_before_cutover(ctx.spec) {
        return Ok(Some(orphan_wait()));
    }
    // A warm migration's copy of the frozen bases runs early: its cutover
    // gate is asked in Preparing, before the power-off. A rehearsal has no cutover.
    if !copies_before_cutover(ctx.spec) {
        if let Some(wait) = fleet::cutover_gate(ctx.spec, &ctx.status, input.now, input.cutover_approved)? {
            return Ok(Some(wait));
        }
        note_approval(ctx);
    }
    Ok(input.fleet.slot.clone())
}

/// Warm and Rehearsal copy from a snapshot before any cutover gate.
fn copies_before_cutover(spec: &VirtualMachineMigrationSpec) -> bool {
    spec.mode.takes_snapshot()
}

/// Records an approval of the cutover the first time it is seen (the gate is open).
pub(super) fn note_approval(ctx: &mut Ctx<'_>) {
    if ctx.spec.cutover.mode == crate::api::CutoverMode::Approval
        && ctx.status.timestamps.cutover_approved.is_none()
    {
        ctx.status.timestamps.cutover_approved = Some(ctx.now.clone());
        let by = if ctx.spec.cutover.approved { "spec.cutover.approved (Git)" } else { "annotation" };
        ctx.event(EventType::Normal, "CutoverApproved", format!("cutover approved by {by}"));
    }
}

/// Whether a migration validated before is still held at a gate, so the
/// controller need not observe the cluster for it again.
pub(crate) fn held_at_gate(input: &Input<'_>) -> bool {
    conditions::is_true(input.status, condition::VALIDATED)
        && input.status.observed_generation == Some(input.generation)
        && (input.fleet.wave.is_some()
            || (input.orphan_hold && !copies_before_cutover(input.spec))
            || (!copies_before_cutover(input.spec)
                && !matches!(
                    fleet::cutover_gate(input.spec, input.status, input.now, input.cutover_approved),
                    Ok(None)
                ))
            || input.fleet.slot.is_some())
}

/// Stays where it is, saying what it waits for; `since` is kept while the reason is.
pub(super) fn hold(ctx: &mut Ctx<'_>, wait: fleet::Wait) {
    let since = match &ctx.status.waiting {
        Some(w) if w.reason == wait.reason => w.since.clone(),
        _ => {
            ctx.event(EventType::Normal, wait.reason.as_str(), wait.message.clone());
            ctx.now.clone()
        }
    };
    ctx.status.waiting = Some(crate::api::Waiting {
        reason: wait.reason.to_string(),
        message: wait.message,
        since,
        until: wait.until.map(api_time),
        position: wait.position.map(|p| p as i32),
    });
    let after = match wait.until {
        Some(until) => {
            let d: SignedDuration = until.duration_since(ctx.now_ts);
            Duration::from_millis(d.as_millis().clamp(1, POLL_WAITING.as_millis() as i128 * 60) as u64)
        }
        None => POLL_WAITING,
    };
    ctx.wait(after);
}
