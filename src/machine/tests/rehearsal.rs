//! Rehearsal: copied from a snapshot while the VM runs, the snapshot removed
//! once the copy is done, the copy started under another name; the source's
//! power is never touched, and what the rehearsal made goes with it.

use super::*;
use crate::api::{MigrationMode, RehearsalSpec};

fn rehearsal_run(phase: Phase) -> Run {
    let mut run = Run::at(phase);
    run.spec.mode = MigrationMode::Rehearsal;
    if phase > Phase::Preparing && phase.is_active() {
        // A rehearsal never records a power-off.
        run.status.timestamps.source_powered_off = None;
    }
    run
}

fn facts(power: SourcePowerState, copies: Vec<CopyState>, snapshot: Option<&str>) -> Observed {
    Observed::Preparing(Ok(PreparingFacts {
        power,
        tools_running: true,
        copies,
        snapshot: snapshot.map(str::to_owned),
        deltas: Vec::new(),
        inventory: None,
        fills_volumes: false,
        base_fills: Vec::new(),
        patches: Vec::new(),
    }))
}

#[test]
fn a_rehearsal_copies_from_its_snapshot_while_the_vm_runs_and_removes_it_once_copied() {
    use SourcePowerState::PoweredOn;
    let mut run = rehearsal_run(Phase::Preparing);
    let d = run.step(facts(PoweredOn, vec![CopyState::Absent], None), t(0));
    assert_eq!(d.actions, vec![Action::CreateSnapshot { quiesce: true }]);
    assert_eq!(d.status.snapshot.as_ref().unwrap().name, "vmmigrate-web-01");

    let d = run.step(facts(PoweredOn, vec![CopyState::Absent], Some("9")), t(1));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }], "copied from the running VM");
    let copying = CopyState::InProgress { bytes_done: 5, bytes_total: 10 };
    let d = run.step(facts(PoweredOn, vec![copying], Some("9")), t(2));
    assert!(d.actions.is_empty());
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().1, "CopyingFromSnapshot");

    // Copied: no cutover, no power-off, the snapshot goes at once: the
    // decision recorded first, then the removal.
    let d = run.step(facts(PoweredOn, vec![base_copy()], Some("9")), t(3));
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert!(d.status.snapshot.as_ref().unwrap().removing.is_some());
    assert_eq!(d.requeue, Some(Duration::ZERO));
    let d = run.step(facts(PoweredOn, vec![base_copy()], Some("9")), t(3));
    assert_eq!(d.actions, vec![Action::RemoveSnapshot]);
    assert_eq!(d.status.phase, Phase::Converting);
    assert!(d.status.snapshot.as_ref().unwrap().removed.is_some(), "the removal is logged");
    assert!(d.events.iter().any(|e| e.reason == "SnapshotRemoved"));
    assert_eq!(d.status.disks[0].source_sha256.as_deref(), Some("ab".repeat(32).as_str()));
    assert_eq!(d.status.timestamps.source_powered_off, None);
    assert_eq!(cond(&d.status, condition::SOURCE_POWERED_OFF), None, "nothing said about power");
}

#[test]
fn a_rehearsal_never_asks_for_a_power_action_whatever_the_source_does() {
    use SourcePowerState::*;
    let approval = |run: &mut Run| run.spec.cutover.mode = crate::api::CutoverMode::Approval;
    for power in [PoweredOn, PoweredOff, Suspended, Unknown] {
        for policy in
            [PowerOffPolicy::Force, PowerOffPolicy::GracefulThenForce, PowerOffPolicy::RequireAlreadyOff]
        {
            let mut run = rehearsal_run(Phase::Preparing);
            run.spec.power_off_policy = policy;
            approval(&mut run);
            let mut copies = vec![CopyState::Absent];
            for (i, snapshot) in [None, Some("9"), Some("9"), Some("9"), Some("9")].into_iter().enumerate() {
                let d = run.step(facts(power, copies.clone(), snapshot), t(i as i64));
                assert!(!has_power_action(&d), "{power:?} {policy:?}: {:?}", d.actions);
                assert_ne!(
                    d.status.phase,
                    Phase::ManualInterventionRequired,
                    "{power:?}: {:?}",
                    d.status.errors
                );
                copies = vec![if i < 2 {
                    CopyState::InProgress { bytes_done: 1, bytes_total: 2 }
                } else {
                    base_copy()
                }];
            }
            assert_eq!(run.status.phase, Phase::Converting, "{power:?} {policy:?}: no cutover gate holds it");
        }
    }
    // Validated lets it through without a cutover approval either.
    let mut validated = rehearsal_run(Phase::Validated);
    approval(&mut validated);
    let d = validated.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Preparing);
}

#[test]
fn a_disk_read_again_after_the_removal_is_copied_with_every_other_from_a_new_snapshot() {
    let mut run = rehearsal_run(Phase::Preparing);
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent, CopyState::Absent], None), t(0));
    let both = vec![base_copy(), base_copy()];
    run.step(facts(SourcePowerState::PoweredOn, both.clone(), Some("9")), t(1));
    let d = run.step(facts(SourcePowerState::PoweredOn, both, Some("9")), t(1));
    assert_eq!(d.status.phase, Phase::Converting);
    // Converting found disk 1's copy corrupt, discarded it and came back.
    run.status.phase = Phase::Preparing;
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![base_copy(), CopyState::Absent], None), t(2));
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }, Action::DiscardDiskCopy { disk: 1 }]);
    assert!(d.status.snapshot.is_none());
    let d =
        run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent, CopyState::Absent], None), t(3));
    assert_eq!(d.actions, vec![Action::CreateSnapshot { quiesce: true }], "one new moment for both disks");
}

#[test]
fn a_crash_after_the_removal_goes_on_without_calling_the_snapshot_foreign() {
    let mut run = rehearsal_run(Phase::Preparing);
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(0));
    run.step(facts(SourcePowerState::PoweredOn, vec![base_copy()], Some("9")), t(4));
    // The removal ran, its status write did not: the decision was recorded before.
    let d = run.decide_at(facts(SourcePowerState::PoweredOn, vec![base_copy()], None), t(5));
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert_eq!(d.status.phase, Phase::Converting);
}

#[test]
fn a_snapshot_removed_by_someone_else_as_the_last_copy_ends_is_not_taken_for_its_own() {
    let mut run = rehearsal_run(Phase::Preparing);
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(0));
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], Some("9")), t(1));
    // The copy read while the host consolidated the snapshot into that very file.
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![base_copy()], None), t(5));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SnapshotFailed);
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }], "the copy does not vouch for anything");
    assert!(!has_power_action(&d));
}

#[test]
fn a_rehearsal_stopping_for_a_person_while_copying_leaves_no_snapshot_on_the_running_source() {
    let mut run = rehearsal_run(Phase::Preparing);
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(0));
    let failed = CopyState::Failed {
        failure: Failure::needs_human(Reason::LocalDiskError, "the work volume is full"),
        discard: false,
    };
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![failed], Some("9")), t(1));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert!(d.actions.contains(&Action::RemoveSnapshot), "{:?}", d.actions);
    assert!(d.actions.contains(&Action::DiscardDiskCopy { disk: 0 }), "{:?}", d.actions);
    assert!(d.status.snapshot.as_ref().unwrap().removed.is_some());
    // A retry copies again from a new snapshot.
    run.status.phase = Phase::Preparing;
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(9));
    assert!(d.status.snapshot.is_none());
    let d = run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(10));
    assert_eq!(d.actions, vec![Action::CreateSnapshot { quiesce: true }]);
}

#[test]
fn a_rehearsal_vm_is_always_started_and_its_checks_skip_what_cannot_reach_it() {
    let mut run = rehearsal_run(Phase::CreatingVm);
    run.spec.destination.run_strategy = RunStrategy::Halted;
    let d = run.decide_at(Observed::CreatingVm(Ok(VmState::Matching { uid: "u".into() })), t(0));
    assert_eq!(d.status.phase, Phase::Starting, "a rehearsal is a boot test");
    assert_eq!(d.status.destination_vm.unwrap().name, "web-01-rehearsal");

    let mut run = rehearsal_run(Phase::Validating);
    run.spec
        .validation
        .checks
        .push(serde_json::from_value(serde_json::json!({"name": "agent", "guestAgent": {}})).unwrap());
    run.spec
        .validation
        .checks
        .push(serde_json::from_value(serde_json::json!({"name": "addr", "ip": {}})).unwrap());
    let run_checks: Vec<&str> = run.spec.checks_to_run().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(run_checks, vec!["agent"], "detached: neither HTTP nor an address");
    let d = run
        .decide_at(Observed::Validating(Ok(vec![CheckResult::Pass { message: "connected".into() }])), t(0));
    assert_eq!(d.status.phase, Phase::Completed);
    let ready = d.status.conditions.iter().find(|c| c.type_ == condition::GUEST_READY).unwrap();
    assert!(ready.message.contains("\"home\"") && ready.message.contains("\"addr\""), "{}", ready.message);

    run.spec.rehearsal =
        Some(RehearsalSpec { name: Some("trial".into()), network_name: Some("isolated".into()) });
    let run_checks: Vec<&str> = run.spec.checks_to_run().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(run_checks, vec!["agent", "addr"], "on its own network it has an address");
    assert_eq!(destination_name(&run.spec, NAME), "trial");
}

#[test]
fn what_a_rehearsal_made_goes_with_it_and_its_source_is_released_once_it_ends() {
    let mut run = rehearsal_run(Phase::Completed);
    let d = run.step(Observed::Nothing, t(0));
    assert_eq!(d.actions, vec![Action::CleanupStaging, Action::ReleaseSourceClaim], "never released");
    assert!(cleanup_on_delete(&run.spec, &run.status).contains(&Action::DeleteDestination));

    // A rehearsal that failed with its snapshot still taken removes it.
    let mut run = rehearsal_run(Phase::Preparing);
    run.step(facts(SourcePowerState::PoweredOn, vec![CopyState::Absent], None), t(0));
    run.status.phase = Phase::Failed;
    let d = run.step(Observed::Nothing, t(1));
    assert_eq!(d.actions, vec![Action::CleanupStaging, Action::RemoveSnapshot, Action::ReleaseSourceClaim]);
    assert!(d.status.snapshot.unwrap().removed.is_some());
    let mut preflight = preflight_ok();
    preflight.destination_namespace_exists = true;
    let mut inventory = inventory();
    inventory.nics[0].network = "Unmapped".into();
    let blockers = preflight::blockers(&run.spec, "web-01-rehearsal", &inventory, &preflight);
    assert!(blockers.is_empty(), "a rehearsal needs no network map: {blockers:?}");
}

#[test]
fn snapshots_of_its_own_independent_and_raw_mapped_disks_are_refused_in_every_mode() {
    type Mutate = fn(&mut SourceInventory);
    let cases: [(&str, Mutate); 3] = [
        ("SnapshotsPresent", |i| i.snapshots = 1),
        ("IndependentDisk", |i| i.disks[0].mode = "independent-nonpersistent".into()),
        ("UnsupportedDiskType", |i| i.disks[0].create_type = "vmfsPassthroughRawDeviceMap".into()),
    ];
    for mode in [MigrationMode::Cold, MigrationMode::Warm, MigrationMode::Rehearsal] {
        for (reason, mutate) in cases {
            let mut run = Run::at(Phase::Validated);
            run.spec.mode = mode;
            mutate(run.status.source_inventory.as_mut().unwrap());
            let d = run.decide_at(Observed::Preflight(Ok(preflight_ok())), t(0));
            assert_eq!(d.status.phase, Phase::ManualInterventionRequired, "{mode:?} {reason}");
            assert!(
                d.status.blockers.iter().any(|b| b.reason == reason),
                "{mode:?}: {:?}",
                d.status.blockers
            );
            assert!(d.actions.is_empty(), "{mode:?} {reason}: nothing done to the source: {:?}", d.actions);
        }
    }
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
