//! Preparing's power steps, for cold and warm migrations (a rehearsal has
//! none): recording the source off, asking it to shut down or powering it
//! off as `powerOffPolicy` allows, and the failures when it will not stay off.

use super::*;

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

/// The source was observed powered off: recorded once.
pub(super) fn record_powered_off(ctx: &mut Ctx<'_>) {
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
    let timed_out = elapsed_since(&requested, ctx.now_ts).is_some_and(|e| e >= timeout);
    match policy {
        PowerOffPolicy::RequireAlreadyOff => ctx.fail(
            Phase::Preparing,
            Failure::needs_human(
                Reason::SourceNotPoweredOff,
                "powerOffPolicy is RequireAlreadyOff and the source VM is powered on; shut it down on the host, then retry",
            ),
        ),
        PowerOffPolicy::Force => {
            ctx.actions.push(Action::PowerOffHard);
            ctx.condition(condition::SOURCE_POWERED_OFF, false, "PowerOffRequested", "hard power-off requested");
            ctx.wait(POLL_POWER_ACTION);
        }
        PowerOffPolicy::GracefulOnly | PowerOffPolicy::GracefulThenForce => {
            let may_force = policy == PowerOffPolicy::GracefulThenForce;
            if requested.is_none() && !facts.tools_running {
                if may_force {
                    ctx.actions.push(Action::PowerOffHard);
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
                ctx.actions.push(Action::RequestGuestShutdown);
                ctx.condition(
                    condition::SOURCE_POWERED_OFF,
                    false,
                    "ShutdownRequested",
                    "graceful guest shutdown requested",
                );
                ctx.wait(POLL_POWER_ACTION);
            } else if timed_out && may_force {
                ctx.actions.push(Action::PowerOffHard);
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
