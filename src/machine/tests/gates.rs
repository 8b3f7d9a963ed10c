//! The gates before the cutover at Validated: waves, read slots, the
//! cutover window and approval.

use super::*;

fn waiting_for(reason: Reason, message: &str) -> fleet::Wait {
    fleet::Wait { reason, message: message.into(), until: None, position: Some(3) }
}

#[test]
fn a_validated_migration_held_by_its_wave_or_a_read_slot_stays_validated_says_why_and_touches_nothing() {
    for (gates, reason) in [
        (
            fleet::FleetGates { wave: Some(waiting_for(Reason::WaitingForWave, "wave 1 first")), slot: None },
            "WaitingForWave",
        ),
        (
            fleet::FleetGates {
                wave: None,
                slot: Some(waiting_for(Reason::WaitingForHostSlot, "3rd in line for esxi01")),
            },
            "WaitingForHostSlot",
        ),
    ] {
        let mut run = Run::at(Phase::Validated);
        run.fleet = gates;
        let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(0));
        assert_eq!(d.status.phase, Phase::Validated, "{reason}");
        assert!(d.actions.is_empty(), "{reason}: {:?}", d.actions);
        assert_eq!(cond(&d.status, condition::VALIDATED).unwrap().0, ConditionStatus::True);
        let waiting = d.status.waiting.clone().unwrap();
        assert_eq!(waiting.reason, reason);
        assert_eq!(cond(&d.status, condition::READY).unwrap().1, reason, "kstatus says why");
        assert_eq!(d.requeue, Some(POLL_WAITING));
        assert!(d.events.iter().any(|e| e.reason == reason));
        // Held again later: nothing observed, `since` kept, no new event.
        let input_held = held_at_gate(&run.input(Observed::Nothing, t(30), false));
        assert!(input_held, "{reason}: the controller skips the pre-flight reads");
        let again = run.step(Observed::Nothing, t(30));
        assert_eq!(again.status.waiting.unwrap().since, waiting.since);
        assert!(again.events.is_empty(), "{:?}", again.events);
        // Once the gate opens, the pre-flight runs again and the cutover begins.
        run.fleet = fleet::FleetGates::default();
        let go = run.step(Observed::Preflight(Ok(preflight_ok())), t(60));
        assert_eq!(go.status.phase, Phase::Preparing, "{reason}");
        assert_eq!(go.status.waiting, None);
    }
}

#[test]
fn a_window_holds_the_cutover_until_its_start_and_the_requeue_is_the_start() {
    let mut run = Run::at(Phase::Validated);
    let start = t(3600);
    window_in(&mut run, start);
    let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Validated);
    let waiting = d.status.waiting.clone().unwrap();
    assert_eq!(waiting.reason, "WaitingForWindow");
    assert_eq!(waiting.until, Some(api_time(start)));
    assert_eq!(d.requeue, Some(Duration::from_secs(3600)));
    assert!(!has_power_action(&d));
    let open = run.step(Observed::Preflight(Ok(preflight_ok())), start);
    assert_eq!(open.status.phase, Phase::Preparing);
    // The window closes between admission and the first power action: back to wait.
    let closed = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(3600 + 7201));
    assert_eq!(closed.status.phase, Phase::Validated);
    assert_eq!(closed.status.waiting.as_ref().unwrap().reason, "CutoverWindowClosed");
    assert!(!has_power_action(&closed), "nothing irreversible outside the window");
}

#[test]
fn approval_through_the_annotation_is_recorded_once_with_an_event() {
    let mut run = Run::at(Phase::Validated);
    run.spec.cutover.mode = crate::api::CutoverMode::Approval;
    let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.waiting.unwrap().reason, "WaitingForApproval");
    assert_eq!(d.requeue, Some(POLL_WAITING));
    run.cutover_approved = true;
    let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(10));
    assert_eq!(d.status.phase, Phase::Preparing);
    assert_eq!(d.status.timestamps.cutover_approved, Some(api_time(t(10))));
    assert!(d.events.iter().any(|e| e.reason == "CutoverApproved" && e.message.contains("annotation")));
}

#[test]
fn an_invalid_window_waits_for_a_person_before_anything_irreversible() {
    let mut run = Run::at(Phase::Validated);
    run.spec.cutover = crate::api::CutoverSpec {
        mode: crate::api::CutoverMode::Window,
        window: Some(crate::api::CutoverWindow {
            start: "2026-12-12T22:00".into(),
            end: "2026-12-13T04:00".into(),
            time_zone: "Nowhere/Land".into(),
        }),
        approved: false,
    };
    let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, "InvalidCutoverWindow");
}

#[test]
fn a_persons_retry_of_a_failed_copy_goes_back_through_the_queue() {
    let mut run = Run::at(Phase::ManualInterventionRequired);
    run.status.failed_phase = Some(Phase::Preparing);
    let d = run.decide_full(Observed::Nothing, t(0), true);
    assert_eq!(d.status.phase, Phase::Validated);
}
