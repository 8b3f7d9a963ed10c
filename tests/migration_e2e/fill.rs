//! Raw disks into blank DataVolumes that vmmigrate fills itself
//! (`--import-method fill`): real CDI provisions each volume blank, a real
//! Job of the release image (`vmmigrate fill-volume`) writes the staged
//! artifact into it over HTTPS and hashes what it wrote.

use super::*;
use vmmigrate::controller::service::ImportMethod;

/// The fill Jobs of the migration's namespace, by name.
async fn fill_jobs(m: &Migration) -> Vec<Job> {
    let jobs: Api<Job> = Api::namespaced(m.client.clone(), &m.ns);
    let params = ListParams::default().labels("migration.platform.example/role=fill");
    jobs.list(&params).await.expect("list Jobs").items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raw_disks_filled_by_vmmigrate_hold_the_source_bytes_without_an_importer_download_across_a_controller_kill()
 {
    let setup = Setup { import_method: ImportMethod::Fill, ..Default::default() };
    let mut m = Migration::start("e2e-fill", setup).await;
    m.create(|_| {}).await;

    // A controller killed while the fill Jobs run: the Jobs go on, and the
    // next controller finds them by name instead of filling again.
    let deadline = Instant::now() + WAIT;
    while fill_jobs(&m).await.len() < 2 {
        let vmm = m.get().await;
        let phase = phase_of(&vmm);
        assert!(
            !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired | Phase::Completed),
            "no fill Jobs seen before {phase}: {:#?}",
            vmm.status
        );
        assert!(Instant::now() < deadline, "no fill Jobs: {:#?}", vmm.status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before: Vec<String> = fill_jobs(&m).await.iter().map(|j| j.uid().unwrap()).collect();
    m.kill_and_restart_controller().await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.clone().unwrap();

    // Each disk was filled, and the bytes written hash to the copy's sha256,
    // which is the source's; the volumes hold exactly them.
    let source = m.source_sha256_at_start();
    for (i, disk) in status.disks.iter().enumerate() {
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::Filled), "disk {i}");
        assert_eq!(disk.imported_sha256.as_ref(), Some(&source[i]), "disk {i}");
    }
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");

    // The DataVolumes were blank (CDI downloaded nothing) and asked for as
    // Preparing began, so that CDI provisioned them while the disks were
    // copied: made no later than the power-off was recorded.
    let dvs = m.list(&data_volume_resource()).await;
    assert_eq!(dvs.len(), 2);
    let requested = status.timestamps.volumes_requested.clone().expect("volumes asked for early");
    let off = status.timestamps.source_powered_off.clone().expect("powered off");
    assert!(requested.0 <= off.0, "asked for at {requested:?}, powered off at {off:?}");
    for dv in &dvs {
        assert_eq!(dv.data["spec"]["source"], json!({ "blank": {} }), "{}", dv.name_any());
        let made = dv.metadata.creation_timestamp.clone().unwrap();
        assert!(made.0 <= off.0, "{} made at {made:?}, after the power-off at {off:?}", dv.name_any());
    }
    // One fill Job per disk, the same two as before the kill (the new
    // controller found them), each succeeded.
    let jobs = fill_jobs(&m).await;
    let after: Vec<String> = jobs.iter().map(|j| j.uid().unwrap()).collect();
    assert_eq!(after, before, "the fill Jobs were not made again");
    for job in &jobs {
        assert_eq!(job.status.as_ref().and_then(|s| s.succeeded), Some(1), "{}", job.name_any());
    }
    // Every artifact left the staging server exactly once, to its fill Job.
    let total: u64 = m.emu.disk_files(m.vmid).iter().map(|d| d.3).sum();
    let served = m.staging.stats().bytes_served.load(Ordering::Relaxed);
    assert_eq!(served, total, "each artifact served once");
    assert_the_three_checks_passed(&status);
}

/// The base fill Jobs (`<dv>-fill-base`) and the import's fill Jobs of the
/// migration's namespace.
async fn base_and_import_fills(m: &Migration) -> (Vec<Job>, Vec<Job>) {
    fill_jobs(m).await.into_iter().partition(|j| j.name_any().ends_with("-fill-base"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warm_migration_fills_the_bases_while_the_vm_runs_and_writes_only_the_changed_ranges_after_the_cutover_across_controller_kills()
 {
    use crate::support::esxi_snapshots::GuestWrites;
    use crate::support::vmdk_delta::DeltaFormat;
    let setup = Setup {
        vm: ("pair", "12"),
        snapshot_format: DeltaFormat::SeSparse,
        import_method: ImportMethod::Fill,
        ..Default::default()
    };
    let mut m = Migration::start("e2e-warm-fill", setup).await;
    let writer = m
        .emu
        .start_guest_writes(m.vmid, GuestWrites { blocks_per_second: 500, seed: 5, ..Default::default() });
    m.create(|body| body["spec"]["mode"] = json!("Warm")).await;

    // The controller is killed at each new step: while the bases are filled
    // (the VM still on), and once the patches are being written.
    for (step, wanted) in [("base", true), ("patch", false)] {
        let deadline = Instant::now() + WAIT;
        loop {
            let (bases, imports) = base_and_import_fills(&m).await;
            if (if wanted { bases.len() } else { imports.len() }) == 2 {
                break;
            }
            let vmm = m.get().await;
            let phase = phase_of(&vmm);
            assert!(
                !matches!(phase, Phase::Failed | Phase::ManualInterventionRequired | Phase::Completed),
                "no {step} fill Jobs seen before {phase}: {:#?}",
                vmm.status
            );
            assert!(Instant::now() < deadline, "no {step} fill Jobs: {:#?}", vmm.status);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if wanted {
            let vmm = m.get().await;
            let off = vmm.status.as_ref().and_then(|s| s.timestamps.source_powered_off.clone());
            assert_eq!(off, None, "the bases are filled while the VM runs");
        }
        m.kill_and_restart_controller().await;
    }
    let vmm = m.wait_completed().await;
    drop(writer);
    let status = vmm.status.clone().unwrap();
    assert_eq!(m.emu.power_off_transitions(m.vmid), 1);

    // The guest wrote while the bases were copied and filled; the volumes
    // hold the disks as they were at the power-off, each patched.
    let now: Vec<String> = m.emu.disk_files(m.vmid).iter().map(|d| copy_sha256(&d.1)).collect();
    assert_ne!(now, m.source_sha256_at_start(), "the guest wrote during the migration");
    for (i, disk) in status.disks.iter().enumerate() {
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::Patched), "disk {i}");
        assert_eq!(disk.imported_sha256.as_ref(), Some(&now[i]), "disk {i}");
        let patch = disk.patch.as_ref().expect("a patch recorded");
        assert!(patch.ranges > 0 && patch.bytes > 0, "disk {i}: {patch:?}");
    }
    assert_eq!(m.imported_sha256(2).await, now, "the bytes in the PVCs are the disks at the power-off");
    assert!(status.volume_bases.is_empty(), "written since: {:?}", status.volume_bases);

    // Each base fill ended before the power-off was recorded; one Job of
    // each kind per disk, the same ones across the kills, each succeeded.
    let off = status.timestamps.source_powered_off.clone().expect("powered off");
    let (bases, imports) = base_and_import_fills(&m).await;
    assert_eq!((bases.len(), imports.len()), (2, 2));
    for job in &bases {
        let ended = job.status.as_ref().and_then(|s| s.completion_time.clone()).expect("completed");
        assert!(ended.0 <= off.0, "{} ended at {ended:?}, after the power-off at {off:?}", job.name_any());
    }
    for job in bases.iter().chain(&imports) {
        assert_eq!(job.status.as_ref().and_then(|s| s.succeeded), Some(1), "{}", job.name_any());
    }

    // What left the staging server: each base once, then only the patches
    // (16 bytes of header per range beside the changed bytes).
    let total: u64 = m.emu.disk_files(m.vmid).iter().map(|d| d.3).sum();
    let patches: u64 =
        status.disks.iter().filter_map(|d| d.patch.as_ref()).map(|p| (p.bytes + 16 * p.ranges) as u64).sum();
    let served = m.staging.stats().bytes_served.load(Ordering::Relaxed);
    assert_eq!(served, total + patches, "bases once, then the patches");
    // The patches carry the ranges the deltas hold: no more bytes than the
    // deltas read after the power-off (the guest here rewrote about half
    // of its small disks while the bases moved).
    let changed: u64 = status.disks.iter().filter_map(|d| d.patch.as_ref()).map(|p| p.bytes as u64).sum();
    let deltas: u64 = m.emu.disk_reads_after_power_off(m.vmid).iter().map(|r| r.delivered).sum();
    assert!(
        changed <= deltas,
        "the patches hold {changed} bytes; the deltas read after the power-off {deltas}"
    );
}
