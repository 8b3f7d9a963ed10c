//! Volumes vmmigrate fills itself (`--import-method fill`): blank
//! DataVolumes asked for as Preparing begins, and Importing's fill Jobs.

use super::*;

fn preparing_filled(power: SourcePowerState, copies: Vec<CopyState>) -> Observed {
    match preparing(power, copies) {
        Observed::Preparing(Ok(facts)) => {
            Observed::Preparing(Ok(PreparingFacts { fills_volumes: true, ..facts }))
        }
        other => other,
    }
}

#[test]
fn blank_volumes_are_asked_for_once_as_preparing_begins_where_the_destination_fills_them() {
    let mut run = Run::at(Phase::Preparing);
    let disks = run.status.source_inventory.as_ref().unwrap().disks.len();
    assert!(disks > 0);
    let d = run.step(preparing_filled(SourcePowerState::PoweredOn, vec![CopyState::Absent; disks]), t(0));
    let created: Vec<&Action> =
        d.actions.iter().filter(|a| matches!(a, Action::CreateDataVolume { .. })).collect();
    assert_eq!(created.len(), disks, "{:?}", d.actions);
    assert_eq!(d.status.timestamps.volumes_requested, Some(api_time(t(0))));
    // Beside the shutdown the same step asks for: nothing waits for them.
    assert!(has_power_action(&d), "{:?}", d.actions);
    // Once.
    let again = run.step(preparing_filled(SourcePowerState::PoweredOn, vec![CopyState::Absent; disks]), t(1));
    assert!(
        !again.actions.iter().any(|a| matches!(a, Action::CreateDataVolume { .. })),
        "{:?}",
        again.actions
    );

    // Not where CDI imports (qcow2 artifacts, or a cluster that does not fill).
    let mut qcow2 = Run::at(Phase::Preparing);
    qcow2.spec.conversion.format = crate::api::DiskFormat::Qcow2;
    let d = qcow2.step(preparing_filled(SourcePowerState::PoweredOn, vec![CopyState::Absent; disks]), t(0));
    assert!(!d.actions.iter().any(|a| matches!(a, Action::CreateDataVolume { .. })));
    let d = Run::at(Phase::Preparing)
        .decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent; disks]), t(0));
    assert!(!d.actions.iter().any(|a| matches!(a, Action::CreateDataVolume { .. })));
    assert_eq!(d.status.timestamps.volumes_requested, None);
}

#[test]
fn a_volume_asked_for_early_is_filled_at_importing() {
    let mut run = Run::at(Phase::Importing);
    run.status.timestamps.volumes_requested = Some(api_time(t(0)));
    run.status.disks[0].artifact_format = Some("raw".into());
    // The blank volume exists: no new DataVolume; its fill Job starts.
    let d = run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(1));
    assert_eq!(d.actions, vec![Action::StartVolumeCheck { disk: 0 }]);
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Filled));
}

/// Importing on a cluster that fills blank volumes itself.
fn filling(volume: DataVolumeState, check: Option<VolumeCheck>) -> Observed {
    Observed::Importing(Ok(ImportingFacts {
        volumes: vec![volume],
        cdi_verifies_checksum: Some(true),
        fills_volumes: Some(true),
        checks: vec![check],
    }))
}

#[test]
fn a_raw_disk_goes_into_a_blank_volume_that_its_fill_job_writes_and_hashes() {
    let mut run = Run::at(Phase::Importing);
    run.status.disks[0].artifact_format = Some("raw".into());
    let d = run.step(filling(DataVolumeState::Absent, None), t(0));
    assert_eq!(d.actions, vec![Action::CreateDataVolume { disk: 0 }]);
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Filled));
    // The blank volume is there: its fill Job starts, and until it ends the
    // import is not done.
    let d = run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(1));
    assert_eq!(d.actions, vec![Action::StartVolumeCheck { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Importing);
    let d = run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Running)), t(2));
    assert!(d.actions.is_empty() && d.status.phase == Phase::Importing);
    // The bytes it wrote hash to the copy's sha256: imported, and said how.
    let written = VolumeCheck::Matches { sha256: "ab".repeat(32) };
    let d = run.step(filling(DataVolumeState::Succeeded, Some(written)), t(3));
    assert_eq!(d.status.phase, Phase::CreatingVm);
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Filled));
    assert_eq!(d.status.disks[0].imported_sha256, Some("ab".repeat(32)));
    let imported = d.status.conditions.iter().find(|c| c.type_ == condition::DISK_IMPORTED).unwrap();
    assert!(imported.message.contains("filled by vmmigrate"), "{}", imported.message);
}

#[test]
fn a_fill_that_wrote_other_bytes_goes_back_through_converting_with_a_new_volume() {
    let mut run = Run::at(Phase::Importing);
    run.status.disks[0].artifact_format = Some("raw".into());
    run.status.disks[0].import_verification = Some(ImportVerification::Filled);
    let other = VolumeCheck::Differs { sha256: "cd".repeat(32), nonzero_tail_bytes: 0 };
    let d = run.step(filling(DataVolumeState::Succeeded, Some(other)), t(0));
    assert_eq!(d.actions, vec![Action::DeleteVolumeCheck { disk: 0 }, Action::DeleteDataVolume { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::ImportChecksumMismatch);
}

#[test]
fn a_qcow2_artifact_is_left_to_cdis_importer_where_the_cluster_fills_raw_ones() {
    let mut run = Run::at(Phase::Importing);
    run.status.disks[0].artifact_format = Some("qcow2".into());
    let d = run.step(filling(DataVolumeState::Absent, None), t(0));
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::CdiChecksum));
}

/// Warm, bases copied, the source still on, volumes asked for early: the
/// volume and its base fill Job as observed.
fn warm_base(volume: DataVolumeState, fill: Option<VolumeCheck>) -> Observed {
    Observed::Preparing(Ok(PreparingFacts {
        power: SourcePowerState::PoweredOn,
        tools_running: true,
        copies: vec![base()],
        snapshot: Some("4".into()),
        deltas: Vec::new(),
        inventory: Some(Ok(inventory())),
        fills_volumes: true,
        base_fills: vec![(volume, fill)],
        patches: Vec::new(),
    }))
}

fn base() -> CopyState {
    CopyState::Complete {
        size: 1 << 20,
        sha256: "ba".repeat(32),
        verified_remotely: true,
        epoch: 0,
        source: None,
    }
}

/// A warm run whose snapshot is taken and whose volumes were asked for.
fn warm_filling_run() -> Run {
    let mut run = Run::at(Phase::Preparing);
    run.spec.mode = crate::api::MigrationMode::Warm;
    run.step(
        warm_base(
            DataVolumeState::InProgress {
                phase: "Pending".into(),
                percent: 0,
                restarts: 0,
                importer_error: None,
            },
            None,
        ),
        t(0),
    );
    assert!(run.status.snapshot.is_some() && run.status.timestamps.volumes_requested.is_some());
    run
}

#[test]
fn warm_fills_each_volume_with_its_base_while_the_vm_runs_and_powers_off_only_once_it_holds_it() {
    let mut run = warm_filling_run();
    // The blank volume is still being provisioned: the cutover waits.
    let provisioning = DataVolumeState::InProgress {
        phase: "Pending".into(),
        percent: 0,
        restarts: 0,
        importer_error: None,
    };
    let d = run.step(warm_base(provisioning, Some(VolumeCheck::Absent)), t(1));
    assert!(!has_power_action(&d), "{:?}", d.actions);
    // Provisioned: the base goes in, by its sha256; still no power action.
    let d = run.step(warm_base(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(2));
    assert_eq!(d.actions, vec![Action::StartBaseFill { disk: 0, sha256: "ba".repeat(32) }]);
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().1, "FillingBase");
    let d = run.step(warm_base(DataVolumeState::Succeeded, Some(VolumeCheck::Running)), t(3));
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert_eq!(d.status.timestamps.source_powered_off, None);
    // The Job wrote and hashed the base: recorded, and the cutover follows in the same step.
    let filled = VolumeCheck::Matches { sha256: "ba".repeat(32) };
    let d = run.step(warm_base(DataVolumeState::Succeeded, Some(filled.clone())), t(4));
    assert!(d.status.volume_holds_base(0, &"ba".repeat(32)));
    assert!(has_power_action(&d), "{:?}", d.actions);
    // Seen again, nothing is filled twice.
    let d = run.step(warm_base(DataVolumeState::Succeeded, Some(filled)), t(5));
    assert!(!d.actions.iter().any(|a| matches!(a, Action::StartBaseFill { .. })), "{:?}", d.actions);
}

#[test]
fn a_base_fill_job_of_another_base_is_deleted_and_the_base_copied_now_is_filled() {
    let mut run = warm_filling_run();
    let other = VolumeCheck::Matches { sha256: "0f".repeat(32) };
    let d = run.step(warm_base(DataVolumeState::Succeeded, Some(other)), t(1));
    assert_eq!(d.actions, vec![Action::DeleteBaseFill { disk: 0 }]);
    assert!(!d.status.volume_holds_base(0, &"0f".repeat(32)) && !has_power_action(&d));
}

#[test]
fn a_base_fill_that_fails_lets_the_cutover_go_on_and_the_volume_is_filled_whole_after_it() {
    for outcome in [
        VolumeCheck::Failed(Failure::retryable(Reason::VolumeCheckFailed, "GET: 404")),
        VolumeCheck::Differs { sha256: "0f".repeat(32), nonzero_tail_bytes: 0 },
    ] {
        let mut run = warm_filling_run();
        let d = run.step(warm_base(DataVolumeState::Succeeded, Some(outcome.clone())), t(1));
        assert!(d.events.iter().any(|e| e.reason == "BaseFillFailed"), "{outcome:?}");
        assert!(has_power_action(&d), "{outcome:?}: {:?}", d.actions);
        assert!(!d.status.volume_holds_base(0, &"ba".repeat(32)));
        let d = run.step(warm_base(DataVolumeState::Succeeded, Some(outcome.clone())), t(2));
        assert!(!d.actions.iter().any(|a| matches!(a, Action::StartBaseFill { .. })), "not again");
        assert!(!d.events.iter().any(|e| e.reason == "BaseFillFailed"), "said once");
    }
    // A volume that is never provisioned is waited for no longer than an
    // import would be: the cutover goes on.
    let mut run = warm_filling_run();
    let stuck = DataVolumeState::InProgress {
        phase: "Pending".into(),
        percent: 0,
        restarts: 0,
        importer_error: None,
    };
    let d = run.step(warm_base(stuck.clone(), Some(VolumeCheck::Absent)), t(599));
    assert!(!has_power_action(&d));
    let d = run.step(warm_base(stuck, Some(VolumeCheck::Absent)), t(601));
    assert!(d.events.iter().any(|e| e.reason == "BaseFillFailed" && e.message.contains("Pending")));
    assert!(has_power_action(&d), "{:?}", d.actions);
    // Where the destination cannot fill bases, nothing waits for them.
    let mut run = warm_filling_run();
    let d = run.step(warm_base(DataVolumeState::Succeeded, None), t(1));
    assert!(has_power_action(&d), "{:?}", d.actions);
}

/// Importing after a warm cutover: the disk's patch recorded, its volume
/// holding the base, the artifact the assembled copy itself.
fn patchable_run() -> Run {
    let mut run = Run::at(Phase::Importing);
    run.status.timestamps.volumes_requested = Some(api_time(t(0)));
    let d = &mut run.status.disks[0];
    d.artifact_format = Some("raw".into());
    d.artifact_sha256 = d.source_sha256.clone();
    d.patch = Some(crate::api::DiskPatch {
        sha256: "9a".repeat(32),
        ranges: 3,
        bytes: 12288,
        base_sha256: "ba".repeat(32),
    });
    run.status.volume_bases = vec![crate::api::VolumeBase {
        disk: 0,
        sha256: "ba".repeat(32),
        filled: Some(api_time(t(0))),
        failed: None,
    }];
    run
}

#[test]
fn a_volume_holding_its_base_is_written_only_the_patch_and_then_holds_the_disk() {
    let mut run = patchable_run();
    let d = run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(1));
    assert_eq!(d.actions, vec![Action::StartVolumeCheck { disk: 0 }]);
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Patched));
    assert!(d.status.volume_bases.is_empty(), "the volume is being written: its base no longer stands");
    // The fill Job hashed the patch it wrote; the whole disk's sha256 is recorded.
    let d = run.step(
        filling(DataVolumeState::Succeeded, Some(VolumeCheck::Matches { sha256: "9a".repeat(32) })),
        t(2),
    );
    assert_eq!(d.status.phase, Phase::CreatingVm);
    assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Patched));
    assert_eq!(d.status.disks[0].imported_sha256, Some("ab".repeat(32)));
    let imported = d.status.conditions.iter().find(|c| c.type_ == condition::DISK_IMPORTED).unwrap();
    assert!(imported.message.contains("only the ranges changed"), "{}", imported.message);

    // A patch that wrote other bytes: the volume goes, and Converting is re-checked.
    let mut run = patchable_run();
    run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(1));
    let d = run.step(
        filling(DataVolumeState::Succeeded, Some(VolumeCheck::Matches { sha256: "ab".repeat(32) })),
        t(2),
    );
    assert_eq!(d.status.phase, Phase::Retryable);
    assert!(d.actions.contains(&Action::DeleteDataVolume { disk: 0 }));
}

#[test]
fn a_volume_is_filled_whole_where_it_holds_another_base_or_the_artifact_is_not_the_copy() {
    type Change = fn(&mut Run);
    let cases: [(&str, Change); 4] = [
        ("another base", |run| run.status.volume_bases[0].sha256 = "0f".repeat(32)),
        ("a failed base fill", |run| {
            run.status.volume_bases[0].filled = None;
            run.status.volume_bases[0].failed = Some("404".into());
        }),
        ("no patch", |run| run.status.disks[0].patch = None),
        ("a converted artifact", |run| run.status.disks[0].artifact_sha256 = Some("c0".repeat(32))),
    ];
    for (case, change) in cases {
        let mut run = patchable_run();
        change(&mut run);
        let d = run.step(filling(DataVolumeState::Succeeded, Some(VolumeCheck::Absent)), t(1));
        assert_eq!(d.status.disks[0].import_verification, Some(ImportVerification::Filled), "{case}");
    }
    // A volume made again is blank, whatever it held.
    let mut run = patchable_run();
    let d = run.step(filling(DataVolumeState::Absent, None), t(1));
    assert_eq!(d.actions, vec![Action::CreateDataVolume { disk: 0 }]);
    assert!(d.status.volume_bases.is_empty());
}

#[test]
fn while_a_fill_job_runs_importing_looks_again_within_seconds_and_slower_as_it_goes_on() {
    let mut run = Run::at(Phase::Importing);
    run.status.history.push(crate::api::PhaseTransition { phase: Phase::Importing, time: api_time(t(0)) });
    run.status.disks[0].artifact_format = Some("raw".into());
    run.status.disks[0].import_verification = Some(ImportVerification::Filled);
    let running = || filling(DataVolumeState::Succeeded, Some(VolumeCheck::Running));
    assert_eq!(run.decide_at(running(), t(2)).requeue, Some(Duration::from_secs(1)));
    assert_eq!(run.decide_at(running(), t(15)).requeue, Some(Duration::from_secs(3)));
    assert_eq!(run.decide_at(running(), t(600)).requeue, Some(Duration::from_secs(5)));
    // A DataVolume CDI still imports wakes the controller through its watch.
    let importing = DataVolumeState::InProgress {
        phase: "ImportInProgress".into(),
        percent: 10,
        restarts: 0,
        importer_error: None,
    };
    assert_eq!(run.decide_at(filling(importing, None), t(2)).requeue, Some(Duration::from_secs(5)));
}
