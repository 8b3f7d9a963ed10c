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
