//! Preparing, warm: the snapshot first, the frozen bases copied while the VM
//! runs, the power-off only at the cutover, then only the deltas.

use super::*;
use crate::api::MigrationMode;

fn warm_run() -> Run {
    let mut run = Run::at(Phase::Preparing);
    run.spec.mode = MigrationMode::Warm;
    run
}

fn facts(
    power: SourcePowerState,
    copies: Vec<CopyState>,
    snapshot: Option<&str>,
    deltas: Vec<CopyState>,
) -> Observed {
    Observed::Preparing(Ok(PreparingFacts {
        power,
        tools_running: true,
        copies,
        snapshot: snapshot.map(str::to_owned),
        deltas,
        // Discovery's inventory (which does not count the migration's own snapshot).
        inventory: Some(Ok(inventory())),
        fills_volumes: false,
        base_fills: Vec::new(),
        patches: Vec::new(),
    }))
}

fn assembled() -> CopyState {
    CopyState::Complete {
        size: 1 << 20,
        sha256: "cd".repeat(32),
        verified_remotely: true,
        epoch: 1,
        source: None,
    }
}

#[test]
fn warm_takes_its_snapshot_first_copies_the_bases_while_the_vm_runs_and_powers_off_only_then() {
    use SourcePowerState::PoweredOn;
    let mut run = warm_run();
    let d = run.step(facts(PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    assert_eq!(d.actions, vec![Action::CreateSnapshot { quiesce: true }], "the snapshot before anything");
    let snapshot = d.status.snapshot.clone().expect("logged in the status");
    assert_eq!(snapshot.name, "vmmigrate-web-01");
    assert!(snapshot.quiesced && snapshot.removed.is_none());
    assert!(d.events.iter().any(|e| e.reason == "SnapshotCreated"));
    assert_eq!(d.requeue, Some(Duration::ZERO));

    let d = run.step(facts(PoweredOn, vec![CopyState::Absent], Some("4"), vec![]), t(1));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }], "the base, from the running VM");
    assert_eq!(d.status.snapshot.as_ref().unwrap().id.as_deref(), Some("4"));
    let copying = CopyState::InProgress { bytes_done: 5, bytes_total: 10 };
    let d = run.step(facts(PoweredOn, vec![copying], Some("4"), vec![]), t(2));
    assert!(d.actions.is_empty() && !has_power_action(&d));
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().1, "CopyingBase");
    assert_eq!(d.status.timestamps.source_powered_off, None);

    let d = run.step(facts(PoweredOn, vec![base_copy()], Some("4"), vec![]), t(3));
    assert_eq!(d.actions, vec![Action::RequestGuestShutdown], "the cutover, per the power policy");
    assert_eq!(d.status.phase, Phase::Preparing);
}

#[test]
fn after_the_cutover_only_the_deltas_are_copied_then_the_snapshot_goes_and_the_assembled_disks_are_recorded()
{
    use SourcePowerState::PoweredOff;
    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    let d = run.step(facts(PoweredOff, vec![base_copy()], Some("4"), vec![]), t(5));
    assert!(d.status.timestamps.source_powered_off.is_some(), "the power-off is recorded");
    assert_eq!(d.actions, vec![Action::StartDeltaCopy { disk: 0 }]);
    assert!(!d.actions.contains(&Action::StartDiskCopy { disk: 0 }), "the base is not copied again");
    let d = run.step(
        facts(
            PoweredOff,
            vec![base_copy()],
            Some("4"),
            vec![CopyState::InProgress { bytes_done: 1, bytes_total: 2 }],
        ),
        t(6),
    );
    assert!(d.actions.is_empty());
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().1, "CopyingDeltas");

    assert!(
        d.status.snapshot.as_ref().unwrap().removing.is_some(),
        "the removal is decided at the cutover: it can no longer change what is read"
    );
    let d = run.step(facts(PoweredOff, vec![base_copy()], Some("4"), vec![assembled()]), t(7));
    assert_eq!(d.actions, vec![Action::RemoveSnapshot], "removed in the step that finds the disks assembled");
    assert_eq!(d.status.phase, Phase::Converting);
    assert!(d.status.snapshot.as_ref().unwrap().removed.is_some(), "the removal is logged");
    assert!(d.events.iter().any(|e| e.reason == "SnapshotRemoved"));
    assert_eq!(
        d.status.disks[0].source_sha256.as_deref(),
        Some("cd".repeat(32).as_str()),
        "the assembled disk"
    );
    assert_eq!(d.status.disks[0].source_verified_remotely, Some(true));
}

#[test]
fn a_vm_shut_down_by_its_user_before_the_bases_are_copied_gets_them_copied_before_any_delta() {
    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    let partial = CopyState::InProgress { bytes_done: 5, bytes_total: 10 };
    let d = run.step(facts(SourcePowerState::PoweredOff, vec![partial], Some("4"), vec![]), t(3));
    assert!(d.actions.iter().all(|a| !matches!(a, Action::StartDeltaCopy { .. })), "{:?}", d.actions);
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().1, "CopyingBase");
    let d = run.step(facts(SourcePowerState::PoweredOff, vec![base_copy()], Some("4"), vec![]), t(6));
    assert!(
        d.status.timestamps.source_powered_off.is_some(),
        "recorded once the bases are copied and the source compared with discovery, though not done by vmmigrate"
    );
    assert_eq!(d.actions, vec![Action::StartDeltaCopy { disk: 0 }]);
    assert!(!has_power_action(&d), "it is off already");
}

#[test]
fn a_crash_after_removing_the_snapshot_finishes_without_calling_it_foreign() {
    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    run.step(facts(SourcePowerState::PoweredOff, vec![base_copy()], Some("4"), vec![]), t(5));
    // The removal ran, the status write did not: the snapshot is gone, the disks are assembled.
    let d = run.step(facts(SourcePowerState::PoweredOff, vec![base_copy()], None, vec![assembled()]), t(8));
    assert!(d.actions.is_empty(), "nothing to remove: {:?}", d.actions);
    assert_eq!(d.status.phase, Phase::Converting);
}

#[test]
fn a_snapshot_removed_behind_its_back_discards_the_bases_and_waits_for_a_person() {
    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![base_copy()], None, vec![]), t(4));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SnapshotFailed);
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }]);
    assert!(d.status.snapshot.is_none(), "a retry takes a new one");
    assert!(!has_power_action(&d));
}

#[test]
fn a_snapshot_removed_by_someone_else_after_the_cutover_before_the_deltas_are_copied_waits_for_a_person() {
    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    run.step(facts(SourcePowerState::PoweredOff, vec![base_copy()], Some("4"), vec![]), t(5));
    let copying = CopyState::InProgress { bytes_done: 1, bytes_total: 2 };
    let d = run.step(facts(SourcePowerState::PoweredOff, vec![base_copy()], None, vec![copying]), t(6));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SnapshotFailed);
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }]);
    assert!(!has_power_action(&d));
}

#[test]
fn warm_copies_its_bases_before_its_window_and_powers_off_only_inside_it() {
    let mut validated = Run::at(Phase::Validated);
    validated.spec.mode = MigrationMode::Warm;
    window_in(&mut validated, t(3600));
    let d = validated.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Preparing, "the pre-copy runs before the window");

    let mut run = warm_run();
    window_in(&mut run, t(3600));
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![base_copy()], Some("4"), vec![]), t(10));
    assert!(!has_power_action(&d), "nothing irreversible outside the window");
    assert_eq!(d.status.phase, Phase::Preparing, "the bases and the snapshot stay");
    assert_eq!(d.status.waiting.as_ref().unwrap().reason, "WaitingForWindow");
    assert_eq!(d.requeue, Some(Duration::from_secs(3590)));
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![base_copy()], Some("4"), vec![]), t(3600));
    assert_eq!(d.actions, vec![Action::RequestGuestShutdown]);
}

#[test]
fn a_source_already_off_is_copied_cold_and_a_snapshot_never_outlives_its_migration() {
    let run = warm_run();
    let d = run.decide_at(facts(SourcePowerState::PoweredOff, vec![CopyState::Absent], None, vec![]), t(0));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }], "no snapshot of a VM that is off");
    assert!(d.status.snapshot.is_none());

    let mut run = warm_run();
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None, vec![]), t(0));
    assert_eq!(cleanup_on_delete(&run.spec, &run.status)[0], Action::RemoveSnapshot);
}

/// A base copied from the migration's snapshot, before any power-off (epoch 0).
fn base_copy() -> CopyState {
    CopyState::Complete {
        size: 1 << 20,
        sha256: "ab".repeat(32),
        verified_remotely: true,
        epoch: 0,
        source: None,
    }
}
