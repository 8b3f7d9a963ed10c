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
