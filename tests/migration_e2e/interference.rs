//! What people and tools around a migration do to its source, against the
//! real parts: the ESXi emulator (a real sshd, vim-cmd over SSH), the real
//! controller and real CDI. A person powers the source on again in the
//! middle of its copy, or after its copies completed, and writes to its
//! disks; a backup tool snapshots it while its cutover waits for an
//! approval, or for its window.

use super::*;

/// Writes `len` bytes of a new pattern at the start of every disk of `vmid`,
/// as the guest of a running VM would. A guest runs for more than a second
/// between its power-on and its writes, and the host's `stat` tells
/// modification times to the second: each extent's mtime ends at least one
/// second past what it was, as a guest's run leaves it.
fn guest_writes_at_start(emu: &EsxiEmulator, vmid: &str, len: usize) {
    use std::os::unix::fs::FileExt;
    for (i, (_, path, _, size)) in emu.disk_files(vmid).iter().enumerate() {
        let n = len.min(*size as usize);
        let data: Vec<u8> = (0..n).map(|b| (b as u8).wrapping_mul(7).wrapping_add(i as u8 + 1)).collect();
        let file = std::fs::OpenOptions::new().write(true).open(path).expect("the disk file");
        let before = file.metadata().and_then(|m| m.modified()).expect("the disk's mtime");
        file.write_all_at(&data, 0).expect("the guest writes");
        let after = file.metadata().and_then(|m| m.modified()).expect("the disk's mtime");
        let second = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        if second(after) <= second(before) {
            file.set_modified(before + Duration::from_secs(1)).expect("the guest's mtime");
        }
    }
}

/// A person powers the VM on at the host, and its guest writes 4 MiB at
/// the start of both disks: the migration stops for a person
/// (`SourcePoweredOnAgain`) and forgets its power-off. Returns that status.
async fn a_person_powers_it_on_and_the_guest_writes(
    m: &Migration,
) -> vmmigrate::api::VirtualMachineMigrationStatus {
    m.emu.vim_cmd_by_hand(&["vmsvc/power.on", m.vmid]).expect("power.on");
    guest_writes_at_start(&m.emu, m.vmid, 4 << 20);
    let stopped =
        m.wait_until_stopped(|v| phase_of(v) == Phase::ManualInterventionRequired).await.status.unwrap();
    assert_eq!(stopped.errors.last().unwrap().reason, "SourcePoweredOnAgain", "{:#?}", stopped.errors);
    assert!(stopped.timestamps.source_powered_off.is_none(), "the power-off is forgotten");
    stopped
}

/// A person's retry after powering the source off again: the migration
/// completes with the disks as they were at that last power-off, recorded
/// and imported, the source never written and every power call recorded.
/// Returns the final status.
async fn retry_completes_with_the_disks_at_the_last_power_off(
    m: &Migration,
    at_last_power_off: &[String],
) -> vmmigrate::api::VirtualMachineMigrationStatus {
    let retry = json!({"metadata": {"annotations": {vmmigrate::api::RETRY_ANNOTATION: "true"}}});
    m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&retry)).await.unwrap();
    m.wait_until_stopped(|v| phase_of(v) != Phase::ManualInterventionRequired).await;
    let done = m.wait_completed().await.status.unwrap();
    let recorded: Vec<String> = done.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, at_last_power_off, "recorded: the disks at the last power-off");
    assert_eq!(m.imported_sha256(2).await, at_last_power_off, "imported: the disks at the last power-off");
    assert_eq!(m.source_sha256_now(), at_last_power_off, "vmmigrate never wrote the source");
    m.assert_power_calls_recorded().await;
    done
}

/// Waits until the cutover waits for `reason`, then takes the nightly
/// backup's snapshot of the source, over SSH like any tool.
async fn backup_snapshot_while_waiting(m: &Migration, reason: &str) {
    m.wait_for(reason, |v| {
        v.status.as_ref().and_then(|s| s.waiting.as_ref()).is_some_and(|w| w.reason == reason)
    })
    .await;
    m.emu
        .vim_cmd_by_hand(&["vmsvc/snapshot.create", m.vmid, "backup-nightly", "", "0", "0"])
        .expect("snapshot");
}

/// After a backup tool's snapshot, the cutover stopped before any power
/// action, naming the change, with the source running as it was.
async fn stopped_before_any_power_action_for_the_snapshot(m: &Migration) {
    let status =
        m.wait_until_stopped(|v| phase_of(v) == Phase::ManualInterventionRequired).await.status.unwrap();
    let error = status.errors.last().unwrap();
    assert_eq!(error.reason, "SourceChangedSinceDiscovery", "{:#?}", status.errors);
    assert!(error.message.contains("snapshots"), "{}", error.message);
    assert!(m.emu.power_calls(m.vmid).is_empty(), "nothing was asked of the source's power");
    assert!(status.power_actions.is_empty());
    assert_eq!(m.emu.vm_power(m.vmid), "on", "the source still runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_powered_on_by_a_person_after_its_copies_completed_is_copied_again_from_its_disks_at_the_last_power_off()
 {
    let m = Migration::new("e2e-poweron").await;
    // The imports wait: the migration is caught after its copies completed.
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let uid = vmm.uid().unwrap();
    let first = vmm.status.clone().unwrap();
    assert_eq!(first.epoch, 1);
    let at_start = m.source_sha256_at_start();

    let stopped = a_person_powers_it_on_and_the_guest_writes(&m).await;
    assert!(stopped.disks.is_empty(), "the copies' evidence is gone with them");
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new(), "every copy and artifact of the epoch is discarded");
    let deadline = Instant::now() + WAIT;
    while !m.list(&data_volume_resource()).await.is_empty() {
        assert!(Instant::now() < deadline, "the DataVolumes made from the stale copies are never deleted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        m.list(&virtual_machine_resource()).await.is_empty(),
        "no destination VM beside the running source"
    );

    // The person powers it off again and retries: a new epoch, copied again.
    m.emu.set_power(m.vmid, false);
    let at_last_power_off = m.source_sha256_now();
    assert_ne!(at_last_power_off, at_start, "the guest's writes changed the disks");
    m.release_importer_pods().await;
    let done = retry_completes_with_the_disks_at_the_last_power_off(&m, &at_last_power_off).await;
    assert_eq!(done.epoch, 3, "the run ended epoch 1 (2), the second power-off opened 3");
    assert!(done.disks.iter().all(|d| d.epoch == 3), "copied in the new epoch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_powered_on_written_and_powered_off_between_two_looks_after_its_copies_completed_is_told_by_its_extents_and_copied_again()
 {
    let mut m = Migration::new("e2e-unseen").await;
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let first = vmm.status.clone().unwrap();
    assert!(first.disks.iter().all(|d| d.source_stat.is_some()), "each copy recorded its extent's stat");
    let at_start = m.source_sha256_at_start();

    // Between two looks: the controller is down (its pod rescheduled) while
    // a person at the host's console powers the source on, its guest
    // writes, and the person powers it off (the host's state, not vim-cmd).
    m.kill_controller().await;
    m.emu.set_power(m.vmid, true);
    guest_writes_at_start(&m.emu, m.vmid, 4 << 20);
    m.emu.set_power(m.vmid, false);
    let at_last_power_off = m.source_sha256_now();
    assert_ne!(at_last_power_off, at_start, "the guest's writes changed the disks");
    // The next controller sees the source off, as it was left.
    m.start_controller();

    let stopped =
        m.wait_until_stopped(|v| phase_of(v) == Phase::ManualInterventionRequired).await.status.unwrap();
    let error = stopped.errors.last().unwrap();
    assert_eq!(error.reason, "SourceDisksChanged", "{:#?}", stopped.errors);
    assert!(error.message.contains("disk 0") && error.message.contains("disk 1"), "{}", error.message);
    assert!(stopped.timestamps.source_powered_off.is_none(), "the power-off is forgotten");
    assert!(m.list(&virtual_machine_resource()).await.is_empty(), "no destination VM from the stale copies");

    m.release_importer_pods().await;
    let done = retry_completes_with_the_disks_at_the_last_power_off(&m, &at_last_power_off).await;
    assert_eq!(done.epoch, 3, "the stat ended epoch 1 (2), the next power-off opened 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_taken_by_a_backup_tool_while_the_cutover_waits_for_approval_stops_it_before_any_power_action()
 {
    let m = Migration::new("e2e-backup").await;
    m.create(|body| {
        body["spec"]["cutover"] = json!({ "mode": "Approval" });
    })
    .await;
    backup_snapshot_while_waiting(&m, "WaitingForApproval").await;
    let approve = json!({"metadata": {"annotations": {vmmigrate::api::APPROVE_CUTOVER_ANNOTATION: "true"}}});
    m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&approve)).await.unwrap();
    stopped_before_any_power_action_for_the_snapshot(&m).await;
    assert_eq!(m.source_sha256_now(), m.source_sha256_at_start());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_powered_on_by_a_person_mid_copy_stops_the_copy_and_the_retry_copies_its_disks_at_the_last_power_off()
 {
    let m = Migration::new("e2e-poweron-copy").await;
    m.emu.set_read_rate(Some(SLOW_READS));
    m.create(|_| {}).await;
    m.wait_copying(4 << 20).await;
    let uid = m.get().await.uid().unwrap();
    a_person_powers_it_on_and_the_guest_writes(&m).await;
    // Nothing of the copy made while the guest ran is kept.
    let deadline = Instant::now() + WAIT;
    while !m.leftovers(&uid).is_empty() {
        assert!(Instant::now() < deadline, "copies of the ended epoch kept: {:?}", m.leftovers(&uid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(m.list(&data_volume_resource()).await.is_empty(), "nothing imported from a running source");

    m.emu.set_power(m.vmid, false);
    m.emu.set_read_rate(None);
    let at_last_power_off = m.source_sha256_now();
    assert_ne!(at_last_power_off, m.source_sha256_at_start(), "the guest's writes changed the disks");
    retry_completes_with_the_disks_at_the_last_power_off(&m, &at_last_power_off).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_taken_by_a_backup_tool_while_the_cutover_waits_for_its_window_stops_it_before_any_power_action()
 {
    let m = Migration::new("e2e-backup-window").await;
    // The window opens 20 s from now (UTC wall clock, to the second).
    let opens = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(20);
    let local = |t: jiff::Timestamp| t.strftime("%Y-%m-%dT%H:%M:%S").to_string();
    let window = json!({
        "start": local(opens),
        "end": local(opens + jiff::SignedDuration::from_secs(3600)),
        "timeZone": "UTC",
    });
    m.create(|body| body["spec"]["cutover"] = json!({ "mode": "Window", "window": window })).await;
    backup_snapshot_while_waiting(&m, "WaitingForWindow").await;
    assert!(jiff::Timestamp::now() < opens, "the snapshot is taken before the window opens");
    stopped_before_any_power_action_for_the_snapshot(&m).await;
}
