//! Unit tests of `decide`: one or more per row of the seed's tables.

use super::*;
use crate::api::Reason;
use crate::api::{
    ConditionStatus, Firmware, NetworkKind, NetworkMapping, SourceDisk, SourceInventory, SourceNic,
    ValidationCheck, VirtualMachineMigrationSpec,
};

const NAME: &str = "web-01";

mod filling;
mod gates;
mod rehearsal;
mod validation;
mod warm;
mod world;

fn spec() -> VirtualMachineMigrationSpec {
    serde_json::from_value(serde_json::json!({
        "source": {
            "host": "esxi01", "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
            "credentialsSecretRef": {"name": "creds"}, "vm": {"name": "web 01"}
        },
        "destination": {"namespace": "apps", "storageClassName": "standard"},
        "networkMap": [{"source": "VM Network", "type": "Pod"}],
        "validation": {"checks": [{"name": "home", "http": {"service": "web", "port": 80}}]}
    }))
    .unwrap()
}

fn inventory() -> SourceInventory {
    SourceInventory {
        vmid: "7".into(),
        name: "web 01".into(),
        vmx_path: "[datastore1] web/web.vmx".into(),
        firmware: Firmware::Bios,
        cpu_sockets: 1,
        cores_per_socket: 2,
        memory_mib: 2048,
        power_state: SourcePowerState::PoweredOn,
        disks: vec![SourceDisk {
            index: 0,
            device: "scsi0:0".into(),
            bus: "scsi".into(),
            descriptor_path: "/vmfs/volumes/datastore1/web/web.vmdk".into(),
            extent_path: "/vmfs/volumes/datastore1/web/web-flat.vmdk".into(),
            capacity_bytes: 1 << 20,
            create_type: "vmfs".into(),
            mode: "persistent".into(),
            ..Default::default()
        }],
        nics: vec![SourceNic {
            device: "ethernet0".into(),
            model: "vmxnet3".into(),
            network: "VM Network".into(),
            mac_address: "00:50:56:aa:bb:cc".into(),
            pci_slot: Some(192),
        }],
        ..Default::default()
    }
}

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

struct Run {
    spec: VirtualMachineMigrationSpec,
    status: VirtualMachineMigrationStatus,
    generation: i64,
    cutover_approved: bool,
    fleet: fleet::FleetGates,
    /// The source's power as read after Preparing (off unless a test says).
    source: Option<Result<SourcePowerState, Failure>>,
    /// The copied extents' stats as read after Preparing (`None`: not read).
    extents: Option<Result<Vec<(usize, String)>, Failure>>,
    orphan_hold: bool,
    console: Option<String>,
    shutdown_seen_for: Option<Duration>,
    watched_for: Option<Duration>,
}

impl Run {
    fn new() -> Run {
        Run {
            spec: spec(),
            status: VirtualMachineMigrationStatus::default(),
            generation: 1,
            cutover_approved: false,
            fleet: fleet::FleetGates::default(),
            source: Some(Ok(SourcePowerState::PoweredOff)),
            extents: None,
            orphan_hold: false,
            console: None,
            shutdown_seen_for: None,
            watched_for: None,
        }
    }

    fn at(phase: Phase) -> Run {
        let mut run = Run::new();
        run.status.phase = phase;
        run.status.source_inventory = Some(inventory());
        if phase > Phase::Validated && phase.is_active() {
            conditions::set(
                &mut run.status,
                condition::VALIDATED,
                true,
                "ChecksPassed",
                "",
                1,
                &api_time(t(0)),
            );
        }
        if phase > Phase::Preparing && phase.is_active() {
            run.status.timestamps.source_powered_off = Some(api_time(t(0)));
            run.status.epoch = 1;
            run.status.disks = vec![DiskStatus {
                index: 0,
                source_path: "/vmfs/volumes/datastore1/web/web-flat.vmdk".into(),
                size_bytes: 1 << 20,
                source_sha256: Some("ab".repeat(32)),
                ..Default::default()
            }];
        }
        run.status.observed_generation = Some(1);
        run
    }

    fn decide_at(&self, observed: Observed, now: Timestamp) -> Decision {
        self.decide_full(observed, now, false)
    }

    fn input(&self, observed: Observed, now: Timestamp, retry_requested: bool) -> Input<'_> {
        Input {
            spec: &self.spec,
            status: &self.status,
            name: NAME,
            generation: self.generation,
            retry_requested,
            cutover_approved: self.cutover_approved,
            fleet: self.fleet.clone(),
            observed,
            now,
            jitter: 0.5,
            source: self.source.clone(),
            extents: self.extents.clone(),
            shutdown_seen_for: self.shutdown_seen_for,
            watched_for: self.watched_for,
            orphan_hold: self.orphan_hold,
            console: self.console.clone(),
        }
    }

    fn decide_full(&self, observed: Observed, now: Timestamp, retry_requested: bool) -> Decision {
        decide(self.input(observed, now, retry_requested))
    }

    fn step(&mut self, observed: Observed, now: Timestamp) -> Decision {
        let d = self.decide_at(observed, now);
        self.status = d.status.clone();
        d
    }
}

fn cond(status: &VirtualMachineMigrationStatus, type_: &str) -> Option<(ConditionStatus, String)> {
    status.conditions.iter().find(|c| c.type_ == type_).map(|c| (c.status, c.reason.clone()))
}

fn preparing(power: SourcePowerState, copies: Vec<CopyState>) -> Observed {
    Observed::Preparing(Ok(PreparingFacts {
        power,
        tools_running: true,
        copies,
        snapshot: None,
        deltas: Vec::new(),
        inventory: Some(Ok(inventory())),
        fills_volumes: false,
        base_fills: Vec::new(),
        patches: Vec::new(),
    }))
}

fn complete_copy() -> CopyState {
    CopyState::Complete {
        size: 1 << 20,
        sha256: "ab".repeat(32),
        verified_remotely: true,
        epoch: 1,
        source: None,
    }
}

/// A cutover window of two hours from `start`, in UTC.
fn window_in(run: &mut Run, start: Timestamp) {
    run.spec.cutover = crate::api::CutoverSpec {
        mode: crate::api::CutoverMode::Window,
        window: Some(crate::api::CutoverWindow {
            start: start.to_zoned(jiff::tz::TimeZone::UTC).datetime().to_string(),
            end: (start + SignedDuration::from_hours(2))
                .to_zoned(jiff::tz::TimeZone::UTC)
                .datetime()
                .to_string(),
            time_zone: "UTC".into(),
        }),
        approved: false,
    };
}

fn has_power_action(d: &Decision) -> bool {
    d.actions.iter().any(|a| matches!(a, Action::RequestGuestShutdown | Action::PowerOffHard))
}

// ---- Pending ----

#[test]
fn pending_records_created_and_advances_to_discovering() {
    let d = Run::new().decide_at(Observed::Nothing, t(0));
    assert_eq!(d.status.phase, Phase::Discovering);
    assert_eq!(d.status.timestamps.created, Some(api_time(t(0))));
    assert_eq!(d.requeue, Some(Duration::ZERO));
    assert!(d.actions.is_empty());
}

#[test]
fn kstatus_conditions_exist_from_the_first_decision_with_observed_generation() {
    let mut run = Run::new();
    run.generation = 3;
    let d = run.decide_at(Observed::Nothing, t(0));
    for type_ in [condition::READY, condition::RECONCILING, condition::STALLED] {
        let c = d.status.conditions.iter().find(|c| c.type_ == type_).expect(type_);
        assert_eq!(c.observed_generation, Some(3));
    }
    assert_eq!(cond(&d.status, condition::READY).unwrap().0, ConditionStatus::False);
    assert_eq!(cond(&d.status, condition::RECONCILING).unwrap().0, ConditionStatus::True);
    assert_eq!(d.status.observed_generation, Some(3));
}

// ---- Discovering ----

#[test]
fn discovery_records_inventory_and_advances_in_the_same_status() {
    let d = Run::at(Phase::Discovering).decide_at(Observed::Discovery(Ok(inventory())), t(1));
    assert_eq!(d.status.phase, Phase::Validated);
    assert_eq!(d.status.source_inventory, Some(inventory()));
    assert_eq!(cond(&d.status, condition::SOURCE_DISCOVERED).unwrap().0, ConditionStatus::True);
}

#[test]
fn discovery_ssh_timeout_is_retryable_and_resumes_discovering_not_pending() {
    let mut run = Run::at(Phase::Discovering);
    let d = run.step(Observed::Discovery(Err(Failure::retryable(Reason::SSHTimeout, "timed out"))), t(0));
    assert_eq!(d.status.phase, Phase::Retryable);
    let retry = d.status.retry.clone().unwrap();
    assert_eq!((retry.phase, retry.attempt), (Phase::Discovering, 1));
    assert_eq!(d.status.errors.last().unwrap().reason, "SSHTimeout");
    assert!(d.status.errors.last().unwrap().retryable);
    // Before the backoff expires nothing happens.
    let early = run.decide_at(Observed::Nothing, t(1));
    assert_eq!(early.status.phase, Phase::Retryable);
    assert!(early.requeue.unwrap() > Duration::ZERO);
    // After it, the same phase resumes.
    let later = run.decide_at(Observed::Nothing, retry.next_attempt_at.0);
    assert_eq!(later.status.phase, Phase::Discovering);
}

#[test]
fn rediscovery_overwrites_inventory_and_reports_drift() {
    let mut run = Run::at(Phase::Discovering);
    let mut changed = inventory();
    changed.memory_mib = 4096;
    let d = run.step(Observed::Discovery(Ok(changed.clone())), t(0));
    assert_eq!(d.status.source_inventory.unwrap().memory_mib, 4096);
    assert!(d.events.iter().any(|e| e.reason == "InventoryChanged"));
}

// ---- Validated ----

/// What the converter saw: these artifacts, no guest conversion report.
fn converting(artifacts: Vec<ArtifactState>) -> ConvertingFacts {
    ConvertingFacts { artifacts, guest: None }
}

fn preflight_ok() -> PreflightFacts {
    PreflightFacts {
        storage_class_exists: true,
        destination_namespace_exists: true,
        destination_vm: DestinationOccupancy::Free,
        destination_refused: None,
        source_claimed_by: None,
        data_plane_blocked: None,
        guest_converter: GuestConverterFacts { virt_v2v: true, virtio_win: false, uefi_firmware: true },
    }
}

#[test]
fn power_is_never_touched_without_validated_true() {
    let mut run = Run::at(Phase::Preparing);
    run.status.conditions.retain(|c| c.type_ != condition::VALIDATED);
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert!(!has_power_action(&d));
    assert_eq!(d.status.phase, Phase::Validated);
}

#[test]
fn graceful_shutdown_is_requested_once_and_the_request_recorded() {
    let mut run = Run::at(Phase::Preparing);
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert_eq!(d.actions, vec![Action::RequestGuestShutdown]);
    assert_eq!(d.status.timestamps.shutdown_requested, Some(api_time(t(0))));
    assert_eq!(d.status.phase, Phase::Preparing);
    // While it shuts down: wait, do not ask again, do not copy.
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(10));
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert_eq!(cond(&d.status, condition::SOURCE_POWERED_OFF).unwrap().1, "ShuttingDown");
}

#[test]
fn graceful_only_timeout_needs_a_human_and_never_forces() {
    let mut run = Run::at(Phase::Preparing);
    run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    let d = run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(301));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::GuestShutdownTimeout);
    assert!(!d.actions.contains(&Action::PowerOffHard));
}

#[test]
fn graceful_then_force_powers_off_hard_after_the_timeout() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::GracefulThenForce;
    run.step(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    let before = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(299));
    assert!(!before.actions.contains(&Action::PowerOffHard));
    let after = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(300));
    assert_eq!(after.actions, vec![Action::PowerOffHard]);
}

#[test]
fn force_policy_powers_off_hard_at_once() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::Force;
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert_eq!(d.actions, vec![Action::PowerOffHard]);
}

#[test]
fn require_already_off_never_touches_power() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::RequireAlreadyOff;
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert!(!has_power_action(&d));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SourceNotPoweredOff);
    // Already off: it proceeds to copy.
    let d = run.decide_at(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(0));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }]);
}

#[test]
fn without_vmware_tools_graceful_only_needs_a_human_and_graceful_then_force_forces() {
    let facts = |tools| {
        Observed::Preparing(Ok(PreparingFacts {
            power: SourcePowerState::PoweredOn,
            tools_running: tools,
            copies: vec![CopyState::Absent],
            snapshot: None,
            deltas: Vec::new(),
            inventory: Some(Ok(inventory())),
            fills_volumes: false,
            base_fills: Vec::new(),
            patches: Vec::new(),
        }))
    };
    let run = Run::at(Phase::Preparing);
    let d = run.decide_at(facts(false), t(0));
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::ToolsNotRunning);
    assert!(!has_power_action(&d));
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::GracefulThenForce;
    assert_eq!(run.decide_at(facts(false), t(0)).actions, vec![Action::PowerOffHard]);
}

#[test]
fn power_off_is_recorded_once_and_never_re_decided() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::Force;
    let first = run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(5));
    assert_eq!(first.status.timestamps.source_powered_off, Some(api_time(t(5))));
    for later in [10, 20, 40] {
        let d = run.step(
            preparing(
                SourcePowerState::PoweredOff,
                vec![CopyState::InProgress { bytes_done: 1, bytes_total: 2 }],
            ),
            t(later),
        );
        assert_eq!(d.status.timestamps.source_powered_off, Some(api_time(t(5))));
        assert!(!has_power_action(&d));
    }
}

#[test]
fn source_powered_on_again_after_recorded_off_needs_a_human_and_is_not_powered_off_again() {
    let mut run = Run::at(Phase::Preparing);
    run.spec.power_off_policy = PowerOffPolicy::Force;
    run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(0));
    let d = run.decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(5));
    assert!(!has_power_action(&d));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::SourcePoweredOnAgain);
}

#[test]
fn suspended_source_needs_a_human() {
    let d = Run::at(Phase::Preparing)
        .decide_at(preparing(SourcePowerState::Suspended, vec![CopyState::Absent]), t(0));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    assert!(!has_power_action(&d));
}

// ---- Preparing: copy ----

#[test]
fn copy_starts_only_once_the_source_is_observed_off() {
    let on = Run::at(Phase::Preparing)
        .decide_at(preparing(SourcePowerState::PoweredOn, vec![CopyState::Absent]), t(0));
    assert!(!on.actions.iter().any(|a| matches!(a, Action::StartDiskCopy { .. })));
    let off = Run::at(Phase::Preparing)
        .decide_at(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(0));
    assert_eq!(off.actions, vec![Action::StartDiskCopy { disk: 0 }]);
}

#[test]
fn partial_copy_is_resumed_and_running_copy_reports_progress() {
    let run = Run::at(Phase::Preparing);
    let partial = run.decide_at(
        preparing(SourcePowerState::PoweredOff, vec![CopyState::Partial { bytes_done: 10, bytes_total: 40 }]),
        t(0),
    );
    assert_eq!(partial.actions, vec![Action::StartDiskCopy { disk: 0 }]);
    let running = run.decide_at(
        preparing(
            SourcePowerState::PoweredOff,
            vec![CopyState::InProgress { bytes_done: 30, bytes_total: 40 }],
        ),
        t(0),
    );
    assert!(running.actions.is_empty());
    let progress = running.status.progress.unwrap();
    assert_eq!((progress.bytes_done, progress.bytes_total, progress.percent), (30, 40, 75));
    assert_eq!(running.requeue, Some(POLL_IN_PROGRESS));
}

#[test]
fn checksum_mismatch_discards_the_copy_and_is_retryable() {
    let d = Run::at(Phase::Preparing).decide_at(
        preparing(
            SourcePowerState::PoweredOff,
            vec![CopyState::Failed {
                failure: Failure::retryable(Reason::ChecksumMismatch, "sha256 differs"),
                discard: true,
            }],
        ),
        t(0),
    );
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.retry.unwrap().phase, Phase::Preparing);
}

#[test]
fn acquired_disks_record_their_checksums_in_the_status_that_advances() {
    let d = Run::at(Phase::Preparing)
        .decide_at(preparing(SourcePowerState::PoweredOff, vec![complete_copy()]), t(0));
    assert_eq!(d.status.phase, Phase::Converting);
    let disk = &d.status.disks[0];
    assert_eq!(disk.source_sha256.as_deref(), Some("ab".repeat(32).as_str()));
    assert_eq!(disk.size_bytes, 1 << 20);
    assert_eq!(disk.source_verified_remotely, Some(true));
    assert_eq!(cond(&d.status, condition::DISK_ACQUIRED).unwrap().0, ConditionStatus::True);
    assert_eq!(cond(&d.status, condition::SOURCE_POWERED_OFF).unwrap().0, ConditionStatus::True);
}

// ---- Converting ----

#[test]
fn converting_starts_resumes_cleans_and_stages_per_disk() {
    let run = Run::at(Phase::Converting);
    let conv = |a: ArtifactState| run.decide_at(Observed::Converting(Ok(converting(vec![a]))), t(0));
    assert_eq!(conv(ArtifactState::Absent).actions, vec![Action::StartConversion { disk: 0 }]);
    assert!(conv(ArtifactState::InProgress { bytes_done: 1, bytes_total: 2 }).actions.is_empty());
    assert_eq!(
        conv(ArtifactState::Invalid { reason: "truncated".into() }).actions,
        vec![Action::DiscardArtifact { disk: 0 }, Action::StartConversion { disk: 0 }]
    );
    let staging = conv(ArtifactState::Complete { sha256: "ab".repeat(32), staged_url: None });
    assert_eq!(staging.actions, vec![Action::StageArtifact { disk: 0 }]);
    assert_eq!(staging.requeue, Some(Duration::ZERO), "a staged artifact is looked at again at once");
    let converting = conv(ArtifactState::InProgress { bytes_done: 1, bytes_total: 2 });
    assert_eq!(converting.requeue, Some(POLL_IN_PROGRESS), "a running conversion wakes its migration");
    let killed =
        conv(ArtifactState::Failed(Failure::retryable(Reason::ConversionKilled, "qemu-img was killed")));
    assert_eq!(killed.status.phase, Phase::Retryable);
    assert_eq!(killed.actions, vec![Action::DiscardArtifact { disk: 0 }], "the retry starts afresh");
}

#[test]
fn staged_artifact_url_and_checksum_are_recorded_in_the_status_that_advances() {
    let d = Run::at(Phase::Converting).decide_at(
        Observed::Converting(Ok(converting(vec![ArtifactState::Complete {
            sha256: "ab".repeat(32),
            staged_url: Some("http://stage/artifacts/u/disk-0.raw".into()),
        }]))),
        t(0),
    );
    assert_eq!(d.status.phase, Phase::Importing);
    assert_eq!(d.status.disks[0].artifact_url.as_deref(), Some("http://stage/artifacts/u/disk-0.raw"));
    assert_eq!(d.status.disks[0].artifact_sha256.as_deref(), Some("ab".repeat(32).as_str()));
    assert_eq!(d.status.disks[0].artifact_format.as_deref(), Some("raw"));
}

#[test]
fn a_raw_artifact_whose_sha256_is_not_the_copys_is_converted_again_whatever_its_marker_says() {
    let complete = |sha: &str| {
        Observed::Converting(Ok(converting(vec![ArtifactState::Complete {
            sha256: sha.into(),
            staged_url: Some("http://stage/artifacts/u/disk-0.raw".into()),
        }])))
    };
    let d = Run::at(Phase::Converting).decide_at(complete(&"ee".repeat(32)), t(0));
    assert_eq!(d.status.phase, Phase::Converting, "never imported");
    assert_eq!(d.actions, vec![Action::DiscardArtifact { disk: 0 }, Action::StartConversion { disk: 0 }]);
    assert!(
        d.events.iter().any(|e| e.reason == "InvalidArtifact" && e.message.contains("is not the copy's"))
    );
    // A qcow2 artifact has a sha256 of its own.
    let mut run = Run::at(Phase::Converting);
    run.spec.conversion.format = crate::api::DiskFormat::Qcow2;
    let d = run.decide_at(complete(&"ee".repeat(32)), t(0));
    assert_eq!(d.status.phase, Phase::Importing);
}

#[test]
fn a_converted_guests_raw_artifacts_are_virt_v2vs_and_what_it_did_is_recorded_when_they_are_staged() {
    let report = crate::api::GuestConversion {
        tool: "virt-v2v 2.2.0".into(),
        guest: "debian 12 (12.15)".into(),
        drivers: vec!["virtio_blk".into(), "virtio_net".into()],
        vmware_tools: "not installed".into(),
        interface_names: vec!["00:50:56:aa:bb:cc=ens192".into()],
        accelerator: "tcg".into(),
        seconds: 222,
        log: "/work/artifacts/u/virt-v2v.log".into(),
        disk_sha256: vec!["ee".repeat(32)],
    };
    let mut run = Run::at(Phase::Converting);
    run.status.source_inventory.as_mut().unwrap().guest_os = "debian12-64".into();
    let staged = ArtifactState::Complete {
        sha256: "ee".repeat(32),
        staged_url: Some("http://stage/artifacts/u/disk-0.raw".into()),
    };
    let facts = ConvertingFacts { artifacts: vec![staged], guest: Some(report.clone()) };
    let d = run.decide_at(Observed::Converting(Ok(facts)), t(0));
    assert_eq!(d.status.phase, Phase::Importing, "{:?}", d.actions);
    assert_eq!(d.status.disks[0].artifact_sha256.as_deref(), Some("ee".repeat(32).as_str()));
    assert_eq!(d.status.guest_conversion, Some(report));
    // Its volume is proven against the converted bytes, not the copy's.
    assert_ne!(d.status.disks[0].source_sha256.as_deref(), Some("ee".repeat(32).as_str()));
    assert_eq!(d.status.expected_volume_sha256(0), Some("ee".repeat(32)));
}

// ---- Importing ----

#[test]
fn importing_creates_one_data_volume_per_disk_with_a_deterministic_name() {
    let d = Run::at(Phase::Importing)
        .decide_at(Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Absent]))), t(0));
    assert_eq!(d.actions, vec![Action::CreateDataVolume { disk: 0 }]);
    assert_eq!(d.status.disks[0].data_volume_name.as_deref(), Some("web-01-disk-0"));
    let progress = Run::at(Phase::Importing).decide_at(
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::InProgress {
            phase: "ImportInProgress".into(),
            percent: 50,
            restarts: 0,
            importer_error: None,
        }]))),
        t(0),
    );
    assert!(progress.actions.is_empty());
    assert_eq!(progress.status.progress.unwrap().percent, 50);
}

#[test]
fn transient_data_volume_failure_deletes_it_for_recreation_within_the_budget() {
    let d = Run::at(Phase::Importing).decide_at(
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Failed(Failure::retryable(
            Reason::ImportFailed,
            "importer evicted",
        ))]))),
        t(0),
    );
    assert_eq!(d.actions, vec![Action::DeleteDataVolume { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Retryable);
}

#[test]
fn failed_import_rechecks_the_artifact_in_converting_and_counts_against_the_importing_budget() {
    let failed_import = || {
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Failed(Failure::retryable(
            Reason::ImportFailed,
            "unexpected EOF: got 1000 of 1048576 bytes",
        ))])))
    };
    let staged = || {
        Observed::Converting(Ok(converting(vec![ArtifactState::Complete {
            sha256: "ab".repeat(32),
            staged_url: Some("http://stage/artifacts/u/disk-0.raw".into()),
        }])))
    };
    let mut run = Run::at(Phase::Importing);
    let mut now = 0;
    for attempt in 1..=run.spec.strategy.retry_limit {
        let d = run.step(failed_import(), t(now));
        assert_eq!(d.status.phase, Phase::Retryable);
        let retry = d.status.retry.clone().unwrap();
        assert_eq!(
            (retry.phase, retry.resume, retry.attempt),
            (Phase::Importing, Some(Phase::Converting), attempt)
        );
        now += 3600;
        // The retry resumes Converting, which finds the artifact still valid and staged...
        assert_eq!(run.step(Observed::Nothing, t(now)).status.phase, Phase::Converting);
        let d = run.step(staged(), t(now));
        assert_eq!(d.status.phase, Phase::Importing);
        // ...and the attempt count survives that rework.
        assert_eq!(d.status.retry.as_ref().map(|r| r.attempt), Some(attempt));
    }
    let d = run.step(failed_import(), t(now));
    // After the power-off an exhausted budget waits for a person (onRetriesExhausted Fail or not).
    assert_eq!(
        d.status.phase,
        Phase::ManualInterventionRequired,
        "a loop between phases stays within the budget"
    );
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::RetryBudgetExhausted);
}

#[test]
fn import_success_after_rework_clears_the_retry_bookkeeping() {
    let mut run = Run::at(Phase::Importing);
    run.status.retry = Some(RetryStatus {
        phase: Phase::Importing,
        resume: Some(Phase::Converting),
        attempt: 2,
        next_attempt_at: api_time(t(0)),
    });
    run.status.failed_phase = Some(Phase::Importing);
    let d =
        run.step(Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Succeeded]))), t(10));
    assert_eq!(d.status.phase, Phase::CreatingVm);
    assert_eq!((d.status.retry, d.status.failed_phase), (None, None));
}

#[test]
fn corrupt_acquired_copy_is_discarded_and_copied_again_without_touching_power() {
    let mut run = Run::at(Phase::Converting);
    let d = run.step(
        Observed::Converting(Ok(converting(vec![ArtifactState::Failed(Failure::retryable(
            Reason::AcquiredCopyCorrupt,
            "disk-0.raw no longer matches the sha256 taken while copying",
        ))]))),
        t(0),
    );
    assert_eq!(d.actions, vec![Action::DiscardDiskCopy { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.retry.as_ref().and_then(|r| r.resume), Some(Phase::Preparing));
    assert_eq!(run.step(Observed::Nothing, t(3600)).status.phase, Phase::Preparing);
    // The source was recorded off: the copy starts again, power is not touched.
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![CopyState::Absent]), t(3601));
    assert_eq!(d.actions, vec![Action::StartDiskCopy { disk: 0 }]);
    assert!(!has_power_action(&d));
    let d = run.step(preparing(SourcePowerState::PoweredOff, vec![complete_copy()]), t(3602));
    assert_eq!(d.status.phase, Phase::Converting);
    assert_eq!(d.status.retry.as_ref().map(|r| r.attempt), Some(1), "counted until Converting succeeds");
}

#[test]
fn succeeded_data_volumes_advance_to_creating_vm() {
    let d = Run::at(Phase::Importing)
        .decide_at(Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::Succeeded]))), t(0));
    assert_eq!(d.status.phase, Phase::CreatingVm);
    assert_eq!(cond(&d.status, condition::DISK_IMPORTED).unwrap().0, ConditionStatus::True);
}

// ---- CreatingVM ----

#[test]
fn creating_vm_creates_updates_adopts_or_stops_on_a_foreign_vm() {
    let run = Run::at(Phase::CreatingVm);
    let vm = |s: VmState| run.decide_at(Observed::CreatingVm(Ok(s)), t(0));
    assert_eq!(vm(VmState::Absent).actions, vec![Action::CreateVm]);
    let drifted =
        || VmState::Drifted { uid: "u".into(), differences: vec!["spec.x: wanted 1, found 2".into()] };
    assert_eq!(vm(drifted()).actions, vec![Action::UpdateVm]);
    let matching = vm(VmState::Matching { uid: "uid-1".into() });
    assert_eq!(matching.status.phase, Phase::Starting);
    assert_eq!(matching.status.destination_vm.unwrap().uid, "uid-1");
    let foreign = vm(VmState::NotOurs);
    assert_eq!(foreign.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(foreign.status.errors.last().unwrap().reason, Reason::DestinationVMNotOwned);
    assert!(foreign.actions.is_empty(), "never touches a VM that is not ours");
}

#[test]
fn vm_creation_conflict_is_retryable() {
    let d = Run::at(Phase::CreatingVm).decide_at(
        Observed::CreatingVm(Err(Failure::retryable(Reason::Conflict, "resourceVersion changed"))),
        t(0),
    );
    assert_eq!(d.status.phase, Phase::Retryable);
}

#[test]
fn halted_run_strategy_completes_after_creating_the_vm_without_starting_it() {
    let mut run = Run::at(Phase::CreatingVm);
    run.spec.destination.run_strategy = RunStrategy::Halted;
    let d = run.decide_at(Observed::CreatingVm(Ok(VmState::Matching { uid: "u".into() })), t(0));
    assert_eq!(d.status.phase, Phase::Completed);
    assert!(!d.actions.contains(&Action::SetRunStrategy));
}

// ---- Starting ----

fn starting(set: bool, vmi: VmiState) -> Observed {
    Observed::Starting(Ok(StartingFacts { run_strategy_set: set, vmi }))
}

#[test]
fn starting_sets_run_strategy_and_advances_only_on_observed_running() {
    let mut run = Run::at(Phase::Starting);
    let d = run.step(starting(false, VmiState::Absent), t(0));
    assert_eq!(d.actions, vec![Action::SetRunStrategy]);
    assert_eq!(d.status.phase, Phase::Starting);
    let d = run.step(starting(true, VmiState::Waiting { phase: "Scheduling".into() }), t(5));
    assert!(d.actions.is_empty());
    let d = run.step(starting(true, VmiState::Running), t(9));
    assert_eq!(d.status.phase, Phase::Validating);
    assert_eq!(d.status.timestamps.vm_started, Some(api_time(t(9))));
}

#[test]
fn start_failures_are_classified_capacity_retryable_missing_kvm_needs_a_human() {
    let run = Run::at(Phase::Starting);
    let capacity = run.decide_at(
        starting(true, VmiState::Failed(Failure::retryable(Reason::Unschedulable, "0/3 nodes"))),
        t(0),
    );
    assert_eq!(capacity.status.phase, Phase::Retryable);
    let kvm = run
        .decide_at(starting(true, VmiState::Failed(Failure::needs_human(Reason::NoKVM, "/dev/kvm"))), t(0));
    assert_eq!(kvm.status.phase, Phase::ManualInterventionRequired);
}

#[test]
fn start_timeout_is_retryable() {
    let mut run = Run::at(Phase::Starting);
    run.step(starting(true, VmiState::Waiting { phase: "Pending".into() }), t(0));
    let d = run.step(starting(true, VmiState::Waiting { phase: "Pending".into() }), t(600));
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::StartTimeout);
}

// ---- Validating / Completed ----

#[test]
fn all_checks_passing_completes_releases_the_vm_and_cleans_staging() {
    let d = Run::at(Phase::Validating)
        .decide_at(Observed::Validating(Ok(vec![CheckResult::Pass { message: "200".into() }])), t(0));
    assert_eq!(d.status.phase, Phase::Completed);
    assert_eq!(cond(&d.status, condition::READY).unwrap().0, ConditionStatus::True);
    assert_eq!(cond(&d.status, condition::GUEST_READY).unwrap().0, ConditionStatus::True);
    assert!(d.status.timestamps.completed.is_some());
    assert!(d.status.validation_results[0].passed);
    // The finishing work happens in Completed, once, recorded by timestamps.cleanedUp.
    let mut run = Run::at(Phase::Completed);
    let finish = run.step(Observed::Nothing, t(1));
    assert_eq!(finish.actions, vec![Action::ReleaseDestination, Action::CleanupStaging]);
    assert_eq!(finish.status.timestamps.cleaned_up, Some(api_time(t(1))));
    assert_eq!(finish.requeue, None);
    assert!(run.decide_at(Observed::Nothing, t(2)).actions.is_empty(), "finishing runs once");
}

#[test]
fn wrong_content_needs_a_human_and_not_ready_keeps_checking_until_the_timeout() {
    let wrong = Run::at(Phase::Validating).decide_at(
        Observed::Validating(Ok(vec![CheckResult::Wrong { message: "body lacks Welcome".into() }])),
        t(0),
    );
    assert_eq!(wrong.status.phase, Phase::ManualInterventionRequired);
    let mut run = Run::at(Phase::Validating);
    let d = run.step(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(0));
    assert_eq!(d.status.phase, Phase::Validating);
    // The first look again comes soon: the guest may be ready in a second.
    assert_eq!(d.requeue, Some(POLL_CHECKS_FIRST));
    let d =
        run.step(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(20));
    assert_eq!(d.requeue, Some(Duration::from_secs(4)), "a fifth of the 20 s waited");
    let d =
        run.step(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(200));
    assert_eq!(d.requeue, Some(POLL_CHECKS), "no faster than every 10 s once it takes long");
    let d =
        run.step(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(900));
    assert_eq!(d.status.phase, Phase::Retryable);
    let error = d.status.errors.last().unwrap();
    assert_eq!(error.reason, Reason::ValidationTimeout);
    // The message names the failing check and what it saw last.
    let check = &d.status.validation_results[0].name;
    assert!(error.message.contains(&format!("check {check:?}: refused")), "{}", error.message);
}

#[test]
fn repeated_identical_check_results_do_not_change_the_status() {
    let mut run = Run::at(Phase::Validating);
    let first =
        run.step(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(0));
    let second = run
        .decide_at(Observed::Validating(Ok(vec![CheckResult::NotYet { message: "refused".into() }])), t(10));
    assert_eq!(first.status, second.status, "polling must not rewrite status");
}

#[test]
fn no_checks_configured_passes_validation() {
    let mut run = Run::at(Phase::Validating);
    run.spec.validation.checks = Vec::<ValidationCheck>::new();
    assert_eq!(run.decide_at(Observed::Validating(Ok(vec![])), t(0)).status.phase, Phase::Completed);
}

// ---- Retry budget ----

#[test]
fn retries_back_off_exponentially_with_jitter_within_bounds() {
    let spec = spec();
    for attempt in 1..=8 {
        let base = (10.0 * 2f64.powi(attempt - 1)).min(600.0);
        let lo = backoff(&spec, attempt, 0.0).as_secs_f64();
        let hi = backoff(&spec, attempt, 0.999_999).as_secs_f64();
        assert!((lo - base / 2.0).abs() < 0.01, "attempt {attempt}: {lo} vs {base}");
        assert!(hi <= base + 0.01 && hi > base * 0.99, "attempt {attempt}: {hi} vs {base}");
    }
}

#[test]
fn exhausted_retry_budget_fails_with_the_reason_and_cleans_up() {
    let mut run = Run::at(Phase::Discovering);
    run.spec.strategy.retry_limit = 2;
    let failure = || Observed::Discovery(Err(Failure::retryable(Reason::SSHTimeout, "timed out")));
    let mut now = 0;
    for attempt in 1..=2 {
        let d = run.step(failure(), t(now));
        assert_eq!(d.status.phase, Phase::Retryable);
        assert_eq!(d.status.retry.as_ref().unwrap().attempt, attempt);
        now += 10_000;
        run.step(Observed::Nothing, t(now));
        assert_eq!(run.status.phase, Phase::Discovering);
    }
    let d = run.step(failure(), t(now));
    assert_eq!(d.status.phase, Phase::Failed);
    let last = d.status.errors.last().unwrap();
    assert_eq!(last.reason, Reason::RetryBudgetExhausted);
    assert!(last.message.contains("SSHTimeout"));
    let finish = run.decide_at(Observed::Nothing, t(now + 1));
    assert!(finish.actions.contains(&Action::CleanupStaging));
    assert!(finish.actions.contains(&Action::ReleaseDestination), "Retain is the default on failure");
    run.spec.cleanup.on_failure = CleanupAction::Delete;
    let finish = run.decide_at(Observed::Nothing, t(now + 1));
    assert!(finish.actions.contains(&Action::DeleteDestination));
}

#[test]
fn exhausted_budget_can_wait_for_a_human_instead() {
    let mut run = Run::at(Phase::Discovering);
    run.spec.strategy.retry_limit = 0;
    run.spec.strategy.on_retries_exhausted = RetriesExhausted::ManualIntervention;
    let d = run.step(Observed::Discovery(Err(Failure::retryable(Reason::SSHTimeout, "x"))), t(0));
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
}

#[test]
fn success_after_a_retry_clears_the_attempt_counter() {
    let mut run = Run::at(Phase::Discovering);
    run.step(Observed::Discovery(Err(Failure::retryable(Reason::SSHTimeout, "x"))), t(0));
    run.step(Observed::Nothing, t(10_000));
    let d = run.step(Observed::Discovery(Ok(inventory())), t(10_001));
    assert_eq!(d.status.phase, Phase::Validated);
    assert!(d.status.retry.is_none());
}

#[test]
fn errors_list_is_bounded() {
    let mut run = Run::at(Phase::Discovering);
    run.spec.strategy.retry_limit = 100;
    let mut now = 0;
    for _ in 0..30 {
        run.step(Observed::Discovery(Err(Failure::retryable(Reason::SSHTimeout, "x"))), t(now));
        now += 100_000;
        run.step(Observed::Nothing, t(now));
    }
    assert_eq!(run.status.errors.len(), MAX_ERRORS);
}

// ---- Manual intervention and terminal phases ----

#[test]
fn manual_intervention_is_left_only_by_the_retry_annotation_which_is_consumed() {
    let mut run = Run::at(Phase::Starting);
    run.step(starting(true, VmiState::Failed(Failure::needs_human(Reason::NoKVM, "/dev/kvm missing"))), t(0));
    assert_eq!(run.status.phase, Phase::ManualInterventionRequired);
    // Time alone changes nothing.
    let idle = run.decide_at(Observed::Nothing, t(1_000_000));
    assert_eq!(idle.status.phase, Phase::ManualInterventionRequired);
    assert_eq!(idle.requeue, None);
    // The annotation resumes the failed phase (not Pending) and is removed.
    let d = run.decide_full(Observed::Nothing, t(1_000_001), true);
    assert_eq!(d.status.phase, Phase::Starting);
    assert_eq!(d.actions, vec![Action::RemoveRetryAnnotation]);
}

#[test]
fn manual_intervention_resumes_after_a_spec_change() {
    let mut run = Run::at(Phase::Validated);
    let mut facts = preflight_ok();
    facts.storage_class_exists = false;
    run.step(Observed::Preflight(Ok(facts)), t(0));
    assert_eq!(run.status.phase, Phase::ManualInterventionRequired);
    run.generation = 2;
    let d = run.decide_at(Observed::Nothing, t(5));
    assert_eq!(d.status.phase, Phase::Discovering);
    assert_eq!(d.status.observed_generation, Some(2));
}

#[test]
fn terminal_phases_are_never_left() {
    for terminal in [Phase::Completed, Phase::Failed] {
        let mut run = Run::at(terminal);
        run.generation = 5;
        for observed in [Observed::Nothing, Observed::Discovery(Ok(inventory()))] {
            for retry in [false, true] {
                run.status.timestamps.cleaned_up = Some(api_time(t(0)));
                let d = run.decide_full(observed.clone(), t(1_000_000), retry);
                assert_eq!(d.status.phase, terminal);
                assert!(
                    d.actions.iter().all(|a| *a == Action::RemoveRetryAnnotation),
                    "{terminal}: {:?}",
                    d.actions
                );
                if retry {
                    assert!(d.events.iter().any(|e| e.reason == "RetryIgnored"));
                }
            }
        }
    }
}

#[test]
fn deleting_a_migration_never_deletes_a_completed_vm_and_follows_the_failure_policy_otherwise() {
    let mut spec = spec();
    let mut status = VirtualMachineMigrationStatus { phase: Phase::Completed, ..Default::default() };
    assert!(cleanup_on_delete(&spec, &status).contains(&Action::ReleaseDestination));
    spec.cleanup.on_failure = CleanupAction::Delete;
    assert!(!cleanup_on_delete(&spec, &status).contains(&Action::DeleteDestination));
    status.phase = Phase::Importing;
    assert!(cleanup_on_delete(&spec, &status).contains(&Action::DeleteDestination));
    spec.cleanup.on_failure = CleanupAction::Retain;
    assert!(cleanup_on_delete(&spec, &status).contains(&Action::ReleaseDestination));
}

#[test]
fn action_failure_is_recorded_against_the_phase_that_asked_for_it() {
    let run = Run::at(Phase::Importing);
    let d = action_failed(
        Input {
            spec: &run.spec,
            status: &run.status,
            name: NAME,
            generation: 1,
            retry_requested: false,
            cutover_approved: false,
            fleet: fleet::FleetGates::default(),
            observed: Observed::Nothing,
            now: t(0),
            jitter: 0.0,
            source: None,
            extents: None,
            shutdown_seen_for: None,
            watched_for: None,
            orphan_hold: false,
            console: None,
        },
        Phase::Importing,
        Failure::retryable(Reason::APIError, "admission webhook timed out"),
    );
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.retry.unwrap().phase, Phase::Importing);
}

#[test]
fn observation_for_another_checkpoint_is_not_mistaken_for_success() {
    let d = Run::at(Phase::Importing).decide_at(Observed::Discovery(Ok(inventory())), t(0));
    assert_ne!(d.status.phase, Phase::CreatingVm);
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::ObservationMismatch);
}

#[test]
fn copy_progress_reports_the_rate_between_observations() {
    let mut run = Run::at(Phase::Preparing);
    run.status.timestamps.source_powered_off = Some(api_time(t(0)));
    let copying = |done| {
        preparing(
            SourcePowerState::PoweredOff,
            vec![CopyState::InProgress { bytes_done: done, bytes_total: 1 << 30 }],
        )
    };
    run.step(copying(0), t(10));
    let d = run.step(copying(250 << 20), t(20));
    let progress = d.status.progress.unwrap();
    assert_eq!(progress.bytes_per_second, 25 << 20);
    assert_eq!(progress.disks[0].bytes_per_second, 25 << 20);
    assert_eq!(progress.updated, Some(api_time(t(20))));
    // A stalled copy reports 0 once, then the status stops changing.
    let stalled = run.step(copying(250 << 20), t(30));
    assert_eq!(stalled.status.progress.as_ref().unwrap().bytes_per_second, 0);
    let again = run.decide_at(copying(250 << 20), t(40));
    assert_eq!(again.status, stalled.status);
}

#[test]
fn a_vm_that_still_differs_after_one_update_stops_for_a_human_instead_of_being_rewritten_forever() {
    let mut run = Run::at(Phase::CreatingVm);
    let drifted = || {
        Observed::CreatingVm(Ok(VmState::Drifted {
            uid: "u".into(),
            differences: vec!["spec.template.spec.domain.memory.guest: wanted \"4Gi\", found \"2Gi\"".into()],
        }))
    };
    assert_eq!(run.step(drifted(), t(0)).actions, vec![Action::UpdateVm]);
    let d = run.step(drifted(), t(1));
    assert!(d.actions.is_empty(), "a second update is not tried: {:?}", d.actions);
    assert_eq!(d.status.phase, Phase::ManualInterventionRequired);
    let error = d.status.errors.last().unwrap();
    assert_eq!(error.reason, Reason::DestinationVMNotConverging);
    assert!(error.message.contains("memory.guest"), "{}", error.message);
}

#[test]
fn after_completed_a_changed_vm_is_reported_once_and_never_written() {
    let mut run = Run::at(Phase::Completed);
    let seen = |s: VmState| Observed::Completed(Ok(s));
    let d = run.step(seen(VmState::Matching { uid: "u".into() }), t(0));
    assert!(d.actions.iter().all(|a| !matches!(a, Action::UpdateVm | Action::CreateVm)), "{:?}", d.actions);
    assert!(cond(&d.status, condition::VM_DRIFTED).is_none(), "no condition while nothing changed");
    assert_eq!(d.requeue, Some(crate::machine::DRIFT_WATCH));
    let changed = || VmState::Drifted {
        uid: "u".into(),
        differences: vec!["spec.template.spec.domain.memory.guest: wanted \"4Gi\", found \"8Gi\"".into()],
    };
    let d = run.step(seen(changed()), t(1));
    assert_eq!(d.status.phase, Phase::Completed);
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    let (value, reason) = cond(&d.status, condition::VM_DRIFTED).unwrap();
    assert_eq!((value, reason.as_str()), (ConditionStatus::True, "Changed"));
    assert_eq!(d.events.iter().filter(|e| e.reason == "VMDrifted").count(), 1);
    // The same drift seen again: no second Event.
    let d = run.step(seen(changed()), t(2));
    assert_eq!(d.events.iter().filter(|e| e.reason == "VMDrifted").count(), 0);
    // Put back by its owner: the condition goes False.
    let d = run.step(seen(VmState::Matching { uid: "u".into() }), t(3));
    assert_eq!(cond(&d.status, condition::VM_DRIFTED).unwrap().0, ConditionStatus::False);
    // A failed read changes nothing.
    let d = run.step(Observed::Completed(Err(Failure::retryable(Reason::Timeout, "slow"))), t(4));
    assert_eq!(cond(&d.status, condition::VM_DRIFTED).unwrap().0, ConditionStatus::False);
}

#[test]
fn an_importer_that_keeps_restarting_is_reported_then_given_up_on_and_retried_from_converting() {
    let restarting = |restarts: i32| {
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::InProgress {
            phase: "ImportInProgress".into(),
            percent: 0,
            restarts,
            importer_error: Some(
                "Error: Unable to connect to http data source: expected status code 200, got 403".into(),
            ),
        }])))
    };
    let d = Run::at(Phase::Importing).decide_at(restarting(1), t(0));
    assert_eq!(d.status.phase, Phase::Importing, "CDI retries on its own: so do we, for a while");
    let (value, reason) = cond(&d.status, condition::DISK_IMPORTED).unwrap();
    assert_eq!((value, reason.as_str()), (ConditionStatus::False, "ImporterRestarting"));
    let message = &d.status.conditions.iter().find(|c| c.type_ == condition::DISK_IMPORTED).unwrap().message;
    assert!(message.contains("got 403"), "the importer's own words: {message}");
    let d = Run::at(Phase::Importing).decide_at(restarting(crate::machine::IMPORTER_RESTART_LIMIT), t(0));
    assert_eq!(d.actions, vec![Action::DeleteDataVolume { disk: 0 }]);
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.status.retry.as_ref().and_then(|r| r.resume), Some(Phase::Converting));
    let error = d.status.errors.last().unwrap();
    assert_eq!(error.reason, Reason::ImportFailed);
    assert!(
        error.message.contains("failed 3 times") && error.message.contains("got 403"),
        "{}",
        error.message
    );
}

#[test]
fn an_import_not_moving_across_time_nobody_could_look_is_given_its_whole_stall_timeout_once_watched_again() {
    let at = || {
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::InProgress {
            phase: "ImportInProgress".into(),
            percent: 40,
            restarts: 0,
            importer_error: None,
        }])))
    };
    let mut run = Run::at(Phase::Importing);
    run.spec.strategy.timeouts.import_stall_seconds = 60;
    run.watched_for = Some(Duration::from_secs(0));
    run.step(at(), t(0));
    // The API server was down for five minutes: the first look after it
    // begins a new watch.
    run.watched_for = Some(Duration::from_secs(0));
    let d = run.step(at(), t(300));
    assert_eq!(d.status.phase, Phase::Importing, "300 s recorded, none of it watched");
    run.watched_for = Some(Duration::from_secs(59));
    let d = run.step(at(), t(359));
    assert_eq!(d.status.phase, Phase::Importing, "59 s watched is within the limit");
    run.watched_for = Some(Duration::from_secs(60));
    let d = run.step(at(), t(360));
    assert_eq!(d.status.phase, Phase::Retryable, "60 s watched without progress");
    assert_eq!(d.status.errors.last().unwrap().reason, Reason::ImportStalled);
}

#[test]
fn an_import_that_does_not_move_for_the_stall_timeout_is_given_up_on_and_retried_from_converting() {
    let at = |phase: &str, percent: i32| {
        Observed::Importing(Ok(ImportingFacts::volumes(vec![DataVolumeState::InProgress {
            phase: phase.into(),
            percent,
            restarts: 0,
            importer_error: None,
        }])))
    };
    let mut run = Run::at(Phase::Importing);
    run.spec.strategy.timeouts.import_stall_seconds = 60;
    assert!(!run.status.disks.is_empty(), "the run has a disk to import");
    // Progress resets the clock: phase moves, then the percentage.
    run.step(at("ImportScheduled", 0), t(0));
    run.step(at("ImportScheduled", 0), t(50));
    run.step(at("ImportInProgress", 0), t(100));
    run.step(at("ImportInProgress", 10), t(150));
    let d = run.step(at("ImportInProgress", 10), t(209));
    assert_eq!(d.status.phase, Phase::Importing, "59 s without progress is within the limit");
    assert_eq!(d.status.disks[0].import_progress.as_deref(), Some("ImportInProgress 10%"));
    let d = run.step(at("ImportInProgress", 10), t(210));
    assert_eq!(d.status.phase, Phase::Retryable);
    assert_eq!(d.actions, vec![Action::DeleteDataVolume { disk: 0 }]);
    assert_eq!(d.status.retry.as_ref().and_then(|r| r.resume), Some(Phase::Converting));
    let error = d.status.errors.last().unwrap();
    assert_eq!(error.reason, Reason::ImportStalled);
    assert!(
        error.message.contains("no progress for 60s") && error.message.contains("ImportInProgress 10%"),
        "{}",
        error.message
    );
}
