//! What the world does around a migration: a person powers the source on
//! again, a backup tool snapshots it, another VM takes its vmid, a replica's
//! clock runs ahead, the API server browns out, the manifest leaves Git.
//! Each rule of docs/state-machine.md ("What the world does around a
//! migration") has a test here.

use super::*;
use crate::api::PowerActionKind;

fn stale_copy() -> CopyState {
    CopyState::Complete {
        size: 1 << 20,
        sha256: "ee".repeat(32),
        verified_remotely: true,
        epoch: 0,
        source: None,
    }
}

fn with_inventory(inventory: SourceInventory) -> Observed {
    match preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]) {
        Observed::Preparing(Ok(facts)) => {
            Observed::Preparing(Ok(PreparingFacts { inventory: Some(Ok(inventory)), ..facts }))
        }
        other => other,
    }
}

#[test]
fn a_recorded_power_off_opens_an_epoch_and_the_copies_are_made_in_it() {
    let mut run = Run::at(Phase::Preparing);
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(0));
    assert_eq!(d.status.epoch, 1, "the first power-off is epoch 1");
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }]);
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![complete_copy()]), t(5));
    assert_eq!(d.status.phase, Phase::Converting);
    assert_eq!(d.status.disks[0].epoch, 1, "the copy's epoch is recorded with its checksum");
}

#[test]
fn a_copy_made_before_the_current_power_off_is_discarded_and_copied_again() {
    let mut run = Run::at(Phase::Preparing);
    run.status.timestamps.source_powered_off = Some(api_time(t(0)));
    run.status.epoch = 1;
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![stale_copy()]), t(1));
    assert_eq!(
        d.actions,
        vec![Action::DiscardDiskCopy { disk: 0 }],
        "never reused, whatever its checksum says"
    );
    assert_eq!(d.status.phase, Phase::Preparing);
    assert!(d.events.iter().any(|e| e.reason == "StaleCopyDiscarded"));
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(2));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }]);
}

#[test]
fn a_source_powered_on_after_the_power_off_ends_the_epoch_and_discards_every_copy() {
    let mut run = Run::at(Phase::Preparing);
    run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(0));
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![complete_copy()]), t(5));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SourcePoweredOnAgain);
    assert_eq!(d.actions, vec![Action::CleanupStaging], "every copy of the epoch goes");
    assert_eq!(d.status.timestamps.source_powered_off, None, "the power-off is forgotten");
    assert!(d.status.disks.is_empty());
    assert_eq!(d.status.epoch, 2, "a new epoch begins: what the old one still writes is stale");
    // The person powers it off and retries: through the queue, a new epoch, everything copied again.
    let d = run.decide_full(Observed::Nothing, t(10), true);
    assert_eq!(d.status.phase, Phase::Validated);
    run.status = d.status;
    run.status.phase = Phase::Preparing;
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![complete_copy()]), t(11));
    assert_eq!(d.status.epoch, 3, "the next power-off opens one more");
    assert_eq!(
        d.actions,
        vec![Action::DiscardDiskCopy { disk: 0 }],
        "a copy the old epoch finished is stale"
    );
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(12));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }]);
}

#[test]
fn a_source_on_again_after_the_copies_completed_discards_them_and_the_volumes_before_the_destination_exists()
{
    for phase in [Phase::Converting, Phase::Importing, Phase::CreatingVm] {
        let mut run = Run::at(phase);
        run.source = Some(Ok(SourcePowerState::PoweredOn));
        let d = run.decide_at(Observed::Nothing, t(0));
        assert_eq!(d.status.phase, Phase::ManualInterventionRequired, "{phase}");
        assert_eq!(d.status.errors.last().unwrap().reason, Reason::SourcePoweredOnAgain);
        assert!(d.actions.contains(&Action::CleanupStaging), "{phase}: {:?}", d.actions);
        assert_eq!(
            d.actions.contains(&Action::DeleteDestination),
            phase >= Phase::Importing,
            "{phase}: volumes imported from the stale copies go too"
        );
        assert_eq!(d.status.failed_phase, Some(Phase::Preparing), "a retry copies again");
    }
}

/// A copied disk whose extent the host stated `1048576:100` when it was read.
fn with_copied_stat(mut run: Run) -> Run {
    run.status.disks[0].source_stat = Some("1048576:100".into());
    run
}

#[test]
fn a_source_run_unseen_after_its_copies_completed_is_told_by_its_extents_and_ends_the_epoch() {
    for phase in [Phase::Converting, Phase::Importing, Phase::CreatingVm, Phase::Starting] {
        let mut run = with_copied_stat(Run::at(phase));
        // Seen off every time, but the extent was written since its copy.
        run.extents = Some(Ok(vec![(0, "1048576:161".into())]));
        let observed = match phase {
            Phase::Starting => starting(false, VmiState::Absent),
            Phase::CreatingVm => Observed::CreatingVm(Ok(VmState::Absent)),
            _ => Observed::Nothing,
        };
        let d = run.decide_at(observed, t(0));
        assert_eq!(d.status.phase, Phase::ManualInterventionRequired, "{phase}");
        let error = d.status.errors.last().unwrap();
        assert_eq!(error.reason, Reason::SourceDisksChanged, "{phase}");
        assert!(error.message.contains("1048576:100 → 1048576:161"), "{phase}: {}", error.message);
        assert_eq!(d.status.epoch, 2, "{phase}: a new epoch");
        assert!(d.status.disks.is_empty() && d.status.timestamps.source_powered_off.is_none(), "{phase}");
        assert!(d.actions.contains(&Action::CleanupStaging), "{phase}: {:?}", d.actions);
        assert!(!d.actions.contains(&Action::CreateVm) && !d.actions.contains(&Action::SetRunStrategy));
        assert_eq!(d.status.failed_phase, Some(Phase::Preparing), "{phase}: a retry copies again");
    }
}

#[test]
fn extents_as_they_were_copied_let_the_migration_go_on_and_unreadable_ones_start_nothing() {
    let mut run = with_copied_stat(Run::at(Phase::CreatingVm));
    run.extents = Some(Ok(vec![(0, "1048576:100".into())]));
    let d = run.decide_at(Observed::CreatingVm(Ok(VmState::Absent)), t(0));
    assert_eq!(d.actions, vec![Action::CreateVm]);
    assert_eq!(d.status.epoch, 1);
    let unreadable = Failure::retryable(Reason::SSHTimeout, "stat timed out");
    for phase in [Phase::Importing, Phase::CreatingVm] {
        let mut run = with_copied_stat(Run::at(phase));
        run.extents = Some(Err(unreadable.clone()));
        let observed = if phase == Phase::CreatingVm {
            Observed::CreatingVm(Ok(VmState::Absent))
        } else {
            Observed::Nothing
        };
        let d = run.decide_at(observed, t(0));
        assert_eq!(d.status.phase, Phase::Retryable, "{phase}");
        assert!(!d.actions.contains(&Action::CreateVm), "{phase}: {:?}", d.actions);
        assert_eq!(d.status.epoch, 1, "{phase}: nothing discarded for a stat not read");
    }
}

#[test]
fn the_destination_is_not_created_or_started_unless_the_source_is_seen_off() {
    let unreadable = Failure::retryable(Reason::SSHConnectFailed, "connection refused");
    for source in [None, Some(Err(unreadable)), Some(Ok(SourcePowerState::Unknown))] {
        let mut run = Run::at(Phase::Starting);
        run.source = source.clone();
        run.status.timestamps.source_powered_off = None;
        let d = run.decide_at(starting(false, VmiState::Absent), t(0));
        assert!(!d.actions.contains(&Action::SetRunStrategy), "{source:?}: {:?}", d.actions);
        assert_eq!(d.status.phase, Phase::Retryable, "{source:?}");
        let mut run = Run::at(Phase::CreatingVm);
        run.source = source.clone();
        let d = run.decide_at(Observed::CreatingVm(Ok(VmState::Absent)), t(0));
        assert!(!d.actions.contains(&Action::CreateVm), "{source:?}: {:?}", d.actions);
    }
    // Seen on again: the epoch ends, the VM made from its copies goes, nothing starts.
    let mut run = Run::at(Phase::Starting);
    run.source = Some(Ok(SourcePowerState::PoweredOn));
    let d = run.decide_at(starting(false, VmiState::Absent), t(0));
    assert!(!d.actions.contains(&Action::SetRunStrategy));
    assert!(d.actions.contains(&Action::DeleteDestination));
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SourcePoweredOnAgain);
    // Once the VM was asked to run it is the user's: never stopped or deleted.
    let d = run.decide_at(starting(true, VmiState::Running), t(1));
    assert_eq!(d.status.phase, Phase::Validating);
    assert!(d.actions.is_empty());
}

#[test]
fn a_snapshot_or_disk_added_since_discovery_stops_before_any_power_action() {
    let snapshot = SourceInventory { snapshots: 1, ..inventory() };
    let mut added = inventory();
    added.disks.push(SourceDisk { index: 1, device: "scsi0:1".into(), ..inventory().disks[0].clone() });
    let moved = {
        let mut i = inventory();
        i.disks[0].extent_path = "/vmfs/volumes/datastore2/web/web-flat.vmdk".into();
        i
    };
    for (what, changed) in [("snapshots", snapshot), ("disk count", added), ("datastore2", moved)] {
        let d = Run::at(Phase::Preparing).decide_at(with_inventory(changed), t(0));
        assert!(!has_power_action(&d), "{what}");
        assert_eq!(d.status.phase, Phase::ManualInterventionRequired, "{what}");
        let error = d.status.errors.last().unwrap();
        assert_eq!(error.reason, Reason::SourceChangedSinceDiscovery);
        assert!(error.message.contains(what), "{what}: {}", error.message);
        assert_eq!(d.status.failed_phase, Some(Phase::Discovering), "a retry discovers again");
    }
    // Found off with a changed inventory: the power-off is not recorded either.
    let mut off = Run::at(Phase::Preparing);
    let facts = match preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]) {
        Observed::Preparing(Ok(f)) => {
            PreparingFacts { inventory: Some(Ok(SourceInventory { snapshots: 1, ..inventory() })), ..f }
        }
        _ => unreachable!(),
    };
    let d = off.step(Observed::Preparing(Ok(facts)), t(0));
    assert_eq!(d.status.timestamps.source_powered_off, None);
    assert!(d.actions.is_empty());
}

#[test]
fn another_vm_under_the_recorded_vmid_is_never_powered_off() {
    let other = SourceInventory { bios_uuid: "4200aaaa-0000-0000-0000-000000000001".into(), ..inventory() };
    let mut run = Run::at(Phase::Preparing);
    run.status.source_inventory.as_mut().unwrap().bios_uuid = "421b4b87-e6b7-d881-07a0-c9d221cd3c6b".into();
    let d = run.decide_at(with_inventory(other), t(0));
    assert!(!has_power_action(&d));
    assert!(d.status.errors.last().unwrap().message.contains("BIOS UUID"));
    // Unreadable at the cutover: nothing is powered off either.
    let unreadable = match preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]) {
        Observed::Preparing(Ok(f)) => {
            PreparingFacts { inventory: Some(Err(Failure::retryable(Reason::SSHTimeout, "timed out"))), ..f }
        }
        _ => unreachable!(),
    };
    let d = Run::at(Phase::Preparing).decide_at(Observed::Preparing(Ok(unreadable)), t(0));
    assert!(!has_power_action(&d));
    assert_eq!(d.status.phase, Phase::Retryable);
}

#[test]
fn every_power_action_is_recorded_with_the_vm_it_addresses_in_the_decision_that_asks_for_it() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::GracefulThenForce;
    run.status.source_inventory.as_mut().unwrap().bios_uuid = "421b-uuid".into();
    let seen = || with_inventory(SourceInventory { bios_uuid: "421b-uuid".into(), ..inventory() });
    let d = run.step(seen(), t(0));
    assert_eq!(d.actions, vec![Action::RequestGuestShutdown]);
    let record = d.status.power_actions.last().expect("recorded");
    assert_eq!((record.action, record.epoch), (PowerActionKind::Shutdown, 0));
    assert_eq!((record.vmid.as_str(), record.bios_uuid.as_str()), ("7", "421b-uuid"));
    let d = run.step(seen(), t(10));
    assert!(d.actions.is_empty() && d.status.power_actions.len() == 1, "no action, no record");
    let d = run.step(seen(), t(301));
    assert_eq!(d.actions, vec![Action::PowerOffHard]);
    assert_eq!(d.status.power_actions.len(), 2, "one record per power action");
    assert_eq!(d.status.power_actions[1].action, PowerActionKind::PowerOff);
    assert_eq!((d.status.power_actions[0].seq, d.status.power_actions[1].seq), (1, 2));
}

#[test]
fn a_replica_whose_clock_runs_ahead_does_not_cut_the_guests_shutdown_short() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::GracefulThenForce;
    run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    // Another replica took over; its wall clock is ten minutes ahead, and it
    // has seen the shutdown request for 20 s of its own time.
    run.shutdown_seen_for = Some(Duration::from_secs(20));
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(600));
    assert!(!d.actions.contains(&Action::PowerOffHard), "the guest keeps its shutdown window");
    run.shutdown_seen_for = Some(Duration::from_secs(300));
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(880));
    assert_eq!(d.actions, vec![Action::PowerOffHard], "once both clocks agree");
}

#[test]
fn an_api_brownout_after_the_power_off_never_spends_the_budget() {
    let mut run = Run::at(Phase::Importing);
    run.spec.strategy.retry_limit = 2;
    let brownout =
        || Observed::Importing(Err(Failure::retryable(Reason::APIUnavailable, "429 Too Many Requests")));
    let mut now = 0;
    for _ in 0..20 {
        let d = run.step(brownout(), t(now));
        assert_eq!(d.status.phase, Phase::Retryable, "a brownout is waited out");
        assert!(d.status.retry.as_ref().unwrap().attempt <= 2);
        now += 10_000;
        run.step(Observed::Nothing, t(now));
    }
}

#[test]
fn a_host_that_answered_at_discovery_and_cannot_be_reached_now_is_waited_out() {
    let lost = || Failure::retryable(Reason::SSHError, "SSH protocol error: Disconnected");
    let mut run = Run::at(Phase::Converting);
    run.spec.strategy.retry_limit = 1;
    assert!(run.status.source_inventory.is_some(), "discovered");
    let mut now = 0;
    for _ in 0..10 {
        let d = run.step(Observed::Converting(Ok(converting(vec![ArtifactState::Failed(lost())]))), t(now));
        assert_eq!(d.status.phase, Phase::Retryable, "{:?}", d.status.errors.last());
        now += 10_000;
        run.step(Observed::Nothing, t(now));
    }
    // Never reached: a wrong name or address spends the budget.
    let mut run = Run::at(Phase::Discovering);
    run.spec.strategy.retry_limit = 1;
    run.status.source_inventory = None;
    let refused = || Observed::Discovery(Err(Failure::retryable(Reason::SSHConnectFailed, "refused")));
    run.step(refused(), t(0));
    run.step(Observed::Nothing, t(10_000));
    let d = run.step(refused(), t(20_000));
    assert_ne!(d.status.phase, Phase::Retryable, "the budget is spent before discovery");
}

#[test]
fn a_full_work_directory_is_waited_out_without_spending_the_budget_or_losing_the_copy() {
    let mut run = Run::at(Phase::Converting);
    run.spec.strategy.retry_limit = 2;
    // What qemu-img prints when its output's file system fills.
    let full = Failure::local_write(
        Reason::QemuImgFailed,
        "qemu-img: error while writing at byte 8388608: No space left on device",
    );
    assert_eq!(full.reason, Reason::WorkDirectoryFull);
    let mut now = 0;
    for _ in 0..20 {
        let d =
            run.step(Observed::Converting(Ok(converting(vec![ArtifactState::Failed(full.clone())]))), t(now));
        assert_eq!(d.status.phase, Phase::Retryable, "{:?}", d.status.errors.last());
        assert!(d.status.retry.as_ref().unwrap().attempt <= 2, "the budget is not spent");
        assert!(!d.actions.iter().any(|a| matches!(a, Action::DiscardDiskCopy { .. })), "{:?}", d.actions);
        now += 10_000;
        run.step(Observed::Nothing, t(now));
    }
    // Any other local write failure still spends it.
    let other = Failure::local_write(Reason::QemuImgFailed, "qemu-img: Could not open: Permission denied");
    assert_eq!(other.reason, Reason::QemuImgFailed);
}

#[test]
fn after_the_power_off_an_exhausted_budget_waits_for_a_person_and_keeps_every_copy() {
    let mut run = Run::at(Phase::Importing);
    run.spec.strategy.retry_limit = 0;
    run.spec.strategy.on_retries_exhausted = RetriesExhausted::Fail;
    run.spec.cleanup.on_failure = CleanupAction::Delete;
    let failed = Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Failed(
        Failure::retryable(Reason::ImportFailed, "unexpected EOF"),
    )])));
    let d = run.step(failed, t(0));
    assert_eq!(
        d.status.phase,
        Phase::ManualInterventionRequired,
        "never an automatic Failed after the power-off"
    );
    // A terminal failure after the power-off keeps the copies and the volumes.
    run.status.phase = Phase::Failed;
    let d = run.decide_at(Observed::Nothing, t(1));
    assert!(!d.actions.contains(&Action::CleanupStaging), "{:?}", d.actions);
    assert!(!d.actions.contains(&Action::DeleteDestination), "{:?}", d.actions);
    assert!(d.events.iter().any(|e| e.reason == "CopiesKept"));
}

#[test]
fn an_orphaned_migration_holds_before_its_cutover_until_a_person_confirms() {
    let mut run = Run::at(Phase::Validated);
    run.orphan_hold = true;
    let d = run.step(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Validated);
    assert_eq!(d.status.waiting.as_ref().unwrap().reason, Reason::OrphanNotConfirmed.as_str());
    assert!(d.status.waiting.as_ref().unwrap().message.contains(crate::api::CONFIRM_ORPHAN_ANNOTATION));
    // Already preparing when the manifest left Git: nothing is powered off.
    let mut run = Run::at(Phase::Preparing);
    run.orphan_hold = true;
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert!(!has_power_action(&d));
    assert_eq!(d.status.waiting.as_ref().unwrap().reason, Reason::OrphanNotConfirmed.as_str());
    // Confirmed: the cutover goes on.
    run.orphan_hold = false;
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert!(has_power_action(&d));
}
