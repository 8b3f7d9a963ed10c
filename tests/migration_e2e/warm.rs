//! Warm migration (`spec.mode: Warm`) through the real controller, against
//! the ESXi emulator with a guest writing to its disks the whole time: the
//! snapshot, the bases copied while the VM runs, one power-off at the
//! cutover, only the deltas after it, real CDI importing the assembled disks;
//! in the controller's process and in the migration's worker pod.

use super::*;
use crate::support::esxi_snapshots::GuestWrites;
use crate::support::vmdk_delta::DeltaFormat;
use vmmigrate::controller::service::DataPlane;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warm_migration_of_a_changing_vm_imports_exactly_its_disks_at_power_off_and_copies_only_deltas_after_it()
 {
    warm_migration_of_a_changing_vm(DeltaFormat::SeSparse, "-sesparse.vmdk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warm_migration_on_vmfs5_assembles_its_disks_from_vmfs_sparse_deltas_and_imports_them_at_power_off()
{
    warm_migration_of_a_changing_vm(DeltaFormat::VmfsSparse, "-delta.vmdk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_warm_migration_in_a_worker_pod_copies_the_bases_while_the_vm_runs_and_only_the_deltas_after_the_power_off()
 {
    let setup = Setup {
        vm: ("pair", "12"),
        snapshot_format: DeltaFormat::SeSparse,
        data_plane: DataPlane::Pods,
        import_method: vmmigrate::controller::service::ImportMethod::Fill,
        ..Default::default()
    };
    let m = Migration::start("e2e-warm-pod", setup).await;
    // Slower writes: the bases are also filled before the cutover, so the
    // VM runs longer, and the deltas must still be a part of the disks.
    let status = warm_migration_checks(m, "-sesparse.vmdk", 200).await;
    // The worker staged each base for its volume before the cutover and
    // each patch after it: only the changed ranges were written then.
    for (i, disk) in status.disks.iter().enumerate() {
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::Patched), "disk {i}");
    }
}

async fn warm_migration_of_a_changing_vm(format: DeltaFormat, delta_suffix: &str) {
    let m = Migration::pair_with(&format!("e2e-warm-{format:?}").to_lowercase(), format).await;
    warm_migration_checks(m, delta_suffix, 500).await;
}

/// A warm migration of `m` (the emulator's `pair`, its guest writing
/// `blocks_per_second` 4 KiB blocks the whole time) and what it must show.
async fn warm_migration_checks(
    m: Migration,
    delta_suffix: &str,
    blocks_per_second: u32,
) -> vmmigrate::api::VirtualMachineMigrationStatus {
    let writer =
        m.emu.start_guest_writes(m.vmid, GuestWrites { blocks_per_second, seed: 3, ..Default::default() });
    m.create(|body| body["spec"]["mode"] = json!("Warm")).await;
    let vmm = m.wait_completed().await;
    drop(writer);
    let status = vmm.status.clone().unwrap();

    // The snapshot: taken, logged, removed; the source powered off once.
    let snapshot = status.snapshot.clone().expect("the snapshot is logged in the status");
    assert_eq!(snapshot.name, "vmmigrate-pair");
    assert!(snapshot.id.is_some() && snapshot.quiesced, "{snapshot:?}");
    assert!(snapshot.removed.is_some(), "removed after the deltas were copied");
    let off = status.timestamps.source_powered_off.clone().expect("powered off");
    assert!(snapshot.created.0 <= off.0, "the snapshot came before the power-off");
    assert_eq!(m.emu.power_off_transitions(m.vmid), 1);
    let listed = m.emu.ssh_command().arg("vim-cmd vmsvc/snapshot.get 12").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&listed.stdout), "Get Snapshot:\n", "no snapshot left on the source");

    // The data: the guest changed the disks during the copy; what was
    // imported is the disks as they were at power-off, which, with the
    // snapshot consolidated, is what a cold copy would read now.
    let now: Vec<String> = m.emu.disk_files(m.vmid).iter().map(|d| copy_sha256(&d.1)).collect();
    assert_ne!(now, m.source_sha256_at_start(), "the guest wrote during the migration");
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, now, "the assembled disks are the disks at power-off");
    assert!(status.disks.iter().all(|d| d.source_verified_remotely == Some(true)));
    assert_eq!(m.imported_sha256(2).await, now, "the imported bytes");

    // After the power-off only the deltas traveled: no base extent was read again.
    let after: Vec<String> = m.emu.disk_reads_after_power_off(m.vmid).into_iter().map(|r| r.path).collect();
    assert!(
        !after.is_empty() && after.iter().all(|p| p.ends_with(delta_suffix)),
        "read after the power-off: {after:?}"
    );
    let reads = m.emu.disk_reads();
    let delta_bytes: u64 = reads.iter().filter(|r| r.path.ends_with(delta_suffix)).map(|r| r.delivered).sum();
    let total: u64 = m.emu.disk_files(m.vmid).iter().map(|d| d.3).sum();
    assert!(delta_bytes > 0 && delta_bytes < total / 2, "deltas: {delta_bytes} of {total} bytes");
    status
}
