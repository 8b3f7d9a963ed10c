//! Validated's pre-flight rules: each blocks with its reason and needs a
//! person; what the hardware leaves behind is a warning and the migration
//! goes on.

use super::*;

#[test]
fn validation_passing_sets_validated_true_and_advances_to_preparing() {
    let d = Run::at(Phase::Validated).decide_at(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Preparing);
    assert_eq!(cond(&d.status, condition::VALIDATED).unwrap().0, ConditionStatus::True);
    assert!(!has_power_action(&d), "validation itself never touches power");
}

#[test]
fn each_preflight_rule_blocks_with_its_reason_and_needs_a_human() {
    type Mutate = fn(&mut Run, &mut PreflightFacts);
    let cases: Vec<(&str, Mutate)> = vec![
        ("SnapshotsPresent", |r, _| r.status.source_inventory.as_mut().unwrap().snapshots = 2),
        ("PendingQuestion", |r, _| {
            r.status.source_inventory.as_mut().unwrap().pending_question = Some("msg.uuid.altered".into())
        }),
        ("UnsupportedDiskType", |r, _| {
            r.status.source_inventory.as_mut().unwrap().disks[0].create_type = "vmfsRawDeviceMap".into()
        }),
        ("IndependentDisk", |r, _| {
            r.status.source_inventory.as_mut().unwrap().disks[0].mode = "independent-persistent".into()
        }),
        ("NoDisks", |r, _| r.status.source_inventory.as_mut().unwrap().disks.clear()),
        ("NetworkNotMapped", |r, _| r.spec.network_map.clear()),
        ("InvalidDestinationName", |r, _| r.spec.destination.name = Some("Web_01".into())),
        ("DestinationNameTaken", |_, f| f.destination_vm = DestinationOccupancy::Taken),
        ("StorageClassNotFound", |_, f| f.storage_class_exists = false),
        ("DestinationNamespaceNotFound", |_, f| f.destination_namespace_exists = false),
        ("DestinationNamespaceNotAllowed", |_, f| f.destination_refused = Some("not allowed".into())),
        ("SourceVMClaimed", |_, f| f.source_claimed_by = Some("apps/web-01-again".into())),
        ("PassthroughDevice", |r, _| {
            r.status.source_inventory.as_mut().unwrap().hardware.passthrough = vec!["pciPassthru0".into()]
        }),
        ("SharedDisk", |r, _| {
            r.status.source_inventory.as_mut().unwrap().hardware.shared_disks =
                vec!["scsi1:0 (multi-writer)".into()]
        }),
        ("EncryptedVM", |r, _| r.status.source_inventory.as_mut().unwrap().hardware.encrypted = true),
        ("PersistentMemory", |r, _| {
            r.status.source_inventory.as_mut().unwrap().hardware.persistent_memory = true
        }),
        ("WorkerCannotStart", |_, f| {
            f.data_plane_blocked =
                Some("work claim apps/web-01-vmm-work exists and is not this migration's".into())
        }),
    ];
    for (reason, mutate) in cases {
        let mut run = Run::at(Phase::Validated);
        let mut facts = preflight_ok();
        mutate(&mut run, &mut facts);
        let d = run.decide_at(Observed::Preflight(Ok(facts)), t(0));
        assert_eq!(d.status.phase, Phase::ManualInterventionRequired, "{reason}");
        assert!(d.status.blockers.iter().any(|b| b.reason == reason), "{reason}: {:?}", d.status.blockers);
        assert_eq!(cond(&d.status, condition::VALIDATED).unwrap().0, ConditionStatus::False, "{reason}");
        assert_eq!(cond(&d.status, condition::STALLED).unwrap().0, ConditionStatus::True, "{reason}");
        // A retry re-reads the source VM first.
        assert_eq!(d.status.failed_phase, Some(Phase::Discovering), "{reason}");
        assert!(!has_power_action(&d));
    }
}

#[test]
fn what_the_hardware_leaves_behind_is_recorded_as_warnings_and_the_migration_goes_on() {
    let mut run = Run::at(Phase::Validated);
    let hw = &mut run.status.source_inventory.as_mut().unwrap().hardware;
    hw.tpm = true;
    hw.cdrom_images = vec!["ide1:0: /vmfs/volumes/ds1/iso/app.iso".into()];
    let d = run.decide_at(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert_eq!(d.status.phase, Phase::Preparing, "warnings do not stop it");
    assert!(d.status.blockers.is_empty());
    let reasons: Vec<&str> = d.status.warnings.iter().map(|w| w.reason.as_str()).collect();
    assert_eq!(reasons, ["TpmNotMigrated", "CdromImageNotMigrated"]);
    assert!(d.status.warnings[1].message.contains("app.iso"));
}

#[test]
fn two_nics_on_the_pod_network_are_blocked() {
    let mut run = Run::at(Phase::Validated);
    let inv = run.status.source_inventory.as_mut().unwrap();
    let mut second = inv.nics[0].clone();
    second.device = "ethernet1".into();
    inv.nics.push(second);
    let d = run.decide_at(Observed::Preflight(Ok(preflight_ok())), t(0));
    assert!(d.status.blockers.iter().any(|b| b.message.contains("pod network")));
    // Mapping the second network to Multus clears it.
    let mut run = Run::at(Phase::Validated);
    let inv = run.status.source_inventory.as_mut().unwrap();
    let mut second = inv.nics[0].clone();
    second.network = "DMZ".into();
    inv.nics.push(second);
    run.spec.network_map.push(NetworkMapping {
        source: "DMZ".into(),
        kind: NetworkKind::Multus,
        network_name: Some("dmz".into()),
    });
    assert_eq!(run.decide_at(Observed::Preflight(Ok(preflight_ok())), t(0)).status.phase, Phase::Preparing);
}

// ---- Preparing: power ----

/// What a Debian guest whose initramfs holds only `vmw_pvscsi` prints on a
/// virtio disk (../shared/guest-conversion-facts.md).
const GAVE_UP: &str = "Gave up waiting for root file system device.  Common problems:\n\
    ALERT!  UUID=6f1c1b2e-0d5a-4c8e-9d1e-3b8f2a7c9e10 does not exist.  Dropping to a shell!\n";

#[test]
fn a_guest_whose_initramfs_gave_up_on_its_root_disk_needs_a_person_at_once_with_its_console_lines() {
    for phase in [Phase::Starting, Phase::Validating] {
        let mut run = Run::at(phase);
        run.status.timestamps.start_requested = Some(api_time(t(0)));
        run.console = Some(format!("SeaBIOS\nBooting from Hard Disk...\n{GAVE_UP}"));
        let observed = match phase {
            Phase::Starting => {
                Observed::Starting(Ok(StartingFacts { run_strategy_set: true, vmi: VmiState::Running }))
            }
            _ => Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])),
        };
        let d = run.decide_at(observed, t(60));
        assert_eq!(
            d.status.phase,
            Phase::ManualInterventionRequired,
            "{phase:?}: not a wait for the timeout"
        );
        let error = d.status.errors.last().unwrap();
        assert_eq!(error.reason, Reason::GuestRootDiskNotFound);
        assert!(
            error.message.contains("ALERT!  UUID=6f1c1b2e-0d5a-4c8e-9d1e-3b8f2a7c9e10 does not exist"),
            "{}",
            error.message
        );
        assert!(!has_power_action(&d));
    }
}

#[test]
fn a_console_that_booted_or_was_not_read_leaves_the_checks_to_decide() {
    let checks = || Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }]));
    let mut run = Run::at(Phase::Validating);
    run.status.timestamps.start_requested = Some(api_time(t(0)));
    run.console = Some("vmmigrate-guest: booted\nvmmigrate-guest: ready\n".into());
    assert_eq!(run.decide_at(checks(), t(60)).status.phase, Phase::Validating);
    run.console = None;
    assert_eq!(run.decide_at(checks(), t(60)).status.phase, Phase::Validating);
    // Before the VM was asked to run, no console is judged.
    let mut run = Run::at(Phase::Starting);
    run.console = Some(GAVE_UP.into());
    let d = run.decide_at(
        Observed::Starting(Ok(StartingFacts { run_strategy_set: false, vmi: VmiState::Absent })),
        t(0),
    );
    assert_ne!(d.status.phase, Phase::ManualInterventionRequired);
}
