//! CreatingVM, Starting and Validating: the destination made, started only
//! while the source is seen off, and its application checked; then Completed.

use super::*;

/// Before the destination is created or started the source must be seen
/// off (and, past Preparing, it was: `decide` ended the epoch otherwise).
/// `false` when the decision is made: the source could not be seen off.
fn source_seen_off(ctx: &mut Ctx<'_>, phase: Phase, source: SeenSource<'_>) -> bool {
    if ctx.spec.mode == MigrationMode::Rehearsal {
        return true;
    }
    let failure = match source.power {
        Some(Ok(SourcePowerState::PoweredOff)) => match source.extents {
            None => return true,
            Some(Ok(extents)) => return extents_unchanged(ctx, extents),
            Some(Err(failure)) => Failure::retryable(
                failure.reason,
                format!(
                    "the source's disks could not be read, so the destination is not started: {}",
                    failure.message
                ),
            ),
        },
        Some(Ok(seen)) if ctx.status.timestamps.source_powered_off.is_some() => {
            end_epoch(ctx, *seen);
            return false;
        }
        Some(Ok(seen)) => Failure::retryable(
            Reason::SourcePowerUnknown,
            format!("the source VM is {seen:?}; the destination is not started beside it"),
        ),
        Some(Err(failure)) => Failure::retryable(
            failure.reason,
            format!(
                "the source's power could not be read, so the destination is not started: {}",
                failure.message
            ),
        ),
        None => Failure::retryable(
            Reason::SourcePowerUnknown,
            "the source's power was not read; the destination is not started",
        ),
    };
    ctx.fail(phase, failure);
    false
}

pub(super) fn creating_vm(ctx: &mut Ctx<'_>, observed: Observed, source: SeenSource<'_>) {
    let vm = match observed {
        Observed::CreatingVm(Ok(vm)) => vm,
        Observed::CreatingVm(Err(failure)) => return ctx.fail(Phase::CreatingVm, failure),
        _ => return mismatch(ctx, Phase::CreatingVm, "VM"),
    };
    if !source_seen_off(ctx, Phase::CreatingVm, source) {
        return;
    }
    let namespace = ctx.spec.destination.namespace.clone();
    match vm {
        VmState::Absent => {
            ctx.actions.push(Action::CreateVm);
            ctx.wait(Duration::from_secs(1));
        }
        VmState::Drifted { differences, .. } => {
            let differences = differences.join("; ");
            // Updated once already and still different: the cluster rewrites
            // what we write (a webhook, a default this version does not
            // know). Fighting it would rewrite the VM forever.
            let updated = ctx.status.conditions.iter().any(|c| c.type_ == condition::VM_CREATED && c.reason == "Updating");
            if updated {
                return ctx.fail(
                    Phase::CreatingVm,
                    Failure::needs_human(
                        Reason::DestinationVMNotConverging,
                        format!("the VirtualMachine still differs from the rendered spec after one update (something in the cluster rewrites it): {differences}"),
                    ),
                );
            }
            ctx.actions.push(Action::UpdateVm);
            ctx.condition(condition::VM_CREATED, false, "Updating", format!("updating the VirtualMachine: {differences}"));
            ctx.event(EventType::Normal, "VMDrifted", format!("the VirtualMachine differs from the rendered spec; updating once: {differences}"));
            ctx.wait(Duration::from_secs(1));
        }
        VmState::Matching { uid } => {
            ctx.status.destination_vm =
                Some(crate::api::DestinationVm { namespace, name: ctx.destination.to_string(), uid });
            ctx.condition(condition::VM_CREATED, true, "Created", "the VirtualMachine matches the rendered spec");
            if matches!(ctx.spec.run_strategy(), RunStrategy::Halted | RunStrategy::Manual) {
                // Nothing to start or probe: the user asked for a stopped VM.
                complete(ctx, "the VirtualMachine was created and left stopped as spec.destination.runStrategy asks");
            } else {
                ctx.advance(Phase::Starting);
            }
        }
        VmState::NotOurs => ctx.fail(
            Phase::CreatingVm,
            Failure::needs_human(
                Reason::DestinationVMNotOwned,
                format!(
                    "VirtualMachine {namespace}/{} exists and was not created by this migration; rename spec.destination.name or remove that VM",
                    ctx.destination
                ),
            ),
        ),
    }
}

pub(super) fn starting(ctx: &mut Ctx<'_>, observed: Observed, source: SeenSource<'_>) {
    let facts = match observed {
        Observed::Starting(Ok(f)) => f,
        Observed::Starting(Err(failure)) => return ctx.fail(Phase::Starting, failure),
        _ => return mismatch(ctx, Phase::Starting, "starting"),
    };
    // The destination starts only while the source is seen off; once asked
    // to run it is the user's VM and never stopped by vmmigrate.
    let asked = ctx.status.timestamps.start_requested.is_some();
    if !facts.run_strategy_set && !asked && !source_seen_off(ctx, Phase::Starting, source) {
        return;
    }
    if ctx.status.timestamps.start_requested.is_none() {
        ctx.status.timestamps.start_requested = Some(ctx.now.clone());
    }
    if !facts.run_strategy_set {
        ctx.actions.push(Action::SetRunStrategy);
    }
    match facts.vmi {
        VmiState::Running => {
            if ctx.status.timestamps.vm_started.is_none() {
                ctx.status.timestamps.vm_started = Some(ctx.now.clone());
            }
            ctx.condition(condition::VM_STARTED, true, "Running", "the VirtualMachineInstance is Running");
            ctx.advance(Phase::Validating);
        }
        VmiState::Failed(failure) => {
            ctx.condition(condition::VM_STARTED, false, failure.reason.as_str(), failure.message.clone());
            ctx.status.timestamps.start_requested = None;
            ctx.fail(Phase::Starting, failure);
        }
        VmiState::Absent | VmiState::Waiting { .. } => {
            let timeout = Duration::from_secs(ctx.spec.strategy.timeouts.starting_seconds.max(1) as u64);
            let waited =
                elapsed_since(&ctx.status.timestamps.start_requested, ctx.now_ts).unwrap_or_default();
            if waited >= timeout {
                ctx.status.timestamps.start_requested = None;
                ctx.fail(
                    Phase::Starting,
                    Failure::retryable(
                        Reason::StartTimeout,
                        format!("the VirtualMachineInstance was not Running within {}s", timeout.as_secs()),
                    ),
                );
            } else {
                let phase = match &facts.vmi {
                    VmiState::Waiting { phase } => phase.clone(),
                    _ => "absent".to_owned(),
                };
                ctx.condition(condition::VM_STARTED, false, "Starting", format!("VMI is {phase}"));
                ctx.wait(POLL_IN_PROGRESS);
            }
        }
    }
}

pub(super) fn validating(ctx: &mut Ctx<'_>, observed: Observed) {
    let results = match observed {
        Observed::Validating(Ok(r)) => r,
        Observed::Validating(Err(failure)) => return ctx.fail(Phase::Validating, failure),
        _ => return mismatch(ctx, Phase::Validating, "validation"),
    };
    if ctx.status.timestamps.validation_started.is_none() {
        ctx.status.timestamps.validation_started = Some(ctx.now.clone());
    }
    let checks = ctx.spec.checks_to_run();
    ctx.status.validation_results = checks
        .iter()
        .zip(results.iter())
        .map(|(check, result)| {
            let (passed, message) = match result {
                CheckResult::Pass { message } => (true, message.clone()),
                CheckResult::NotYet { message } | CheckResult::Wrong { message } => (false, message.clone()),
            };
            // Keep the old entry while nothing changed, so polling does not write status.
            let previous = ctx.status.validation_results.iter().find(|r| r.name == check.name);
            match previous {
                Some(p) if p.passed == passed && p.message == message => p.clone(),
                _ => ValidationResult {
                    name: check.name.clone(),
                    passed,
                    message,
                    last_checked: ctx.now.clone(),
                },
            }
        })
        .collect();
    if let Some((check, CheckResult::Wrong { message })) =
        checks.iter().zip(results.iter()).find(|(_, r)| matches!(r, CheckResult::Wrong { .. }))
    {
        let message = format!("check {:?}: {message}", check.name);
        ctx.condition(
            condition::GUEST_READY,
            false,
            Reason::ApplicationCheckFailed.as_str(),
            message.clone(),
        );
        ctx.status.timestamps.validation_started = None;
        return ctx.fail(Phase::Validating, Failure::needs_human(Reason::ApplicationCheckFailed, message));
    }
    let passing = results.iter().filter(|r| matches!(r, CheckResult::Pass { .. })).count();
    if passing == checks.len() && results.len() == checks.len() {
        let skipped = ctx.spec.skipped_checks();
        let mut message = format!("{passing} check(s) passed");
        if !skipped.is_empty() {
            let list: Vec<String> = skipped.iter().map(|(name, why)| format!("{name:?} ({why})")).collect();
            message.push_str(&format!("; not run in a rehearsal: {}", list.join(", ")));
        }
        ctx.condition(condition::GUEST_READY, true, "ChecksPassed", message);
        if ctx.spec.mode == MigrationMode::Rehearsal {
            complete(ctx, "the rehearsal VM runs and its checks passed; the source was never powered off");
        } else {
            complete(ctx, "the VM runs and every validation check passed");
        }
        return;
    }
    let timeout = Duration::from_secs(ctx.spec.strategy.timeouts.validating_seconds.max(1) as u64);
    let waited = elapsed_since(&ctx.status.timestamps.validation_started, ctx.now_ts).unwrap_or_default();
    let message = format!("{passing} of {} check(s) passing", checks.len());
    ctx.condition(condition::GUEST_READY, false, "Checking", message.clone());
    if waited >= timeout {
        ctx.status.timestamps.validation_started = None;
        // Name each check still failing and what it saw last.
        let failing: Vec<String> = ctx
            .status
            .validation_results
            .iter()
            .filter(|r| !r.passed)
            .map(|r| format!("check {:?}: {}", r.name, r.message))
            .collect();
        ctx.fail(
            Phase::Validating,
            Failure::retryable(
                Reason::ValidationTimeout,
                format!("{message} after {}s; {}", timeout.as_secs(), failing.join("; ")),
            ),
        );
    } else {
        ctx.wait(checks_poll(waited));
    }
}

fn complete(ctx: &mut Ctx<'_>, message: &str) {
    ctx.status.timestamps.completed = Some(ctx.now.clone());
    ctx.event(EventType::Normal, "MigrationSucceeded", message);
    // The finishing work (release the VM, clean staging) runs in Completed itself.
    ctx.advance(Phase::Completed);
}
