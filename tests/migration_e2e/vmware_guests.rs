//! Guests shaped like guests installed on ESXi (`tools/guest/vmware.sh`:
//! an initramfs of VMware's disk drivers only, a static address on
//! `ens192`, open-vm-tools), migrated onto real KubeVirt by the controller:
//! moved as they are they stop in their initramfs, and the controller says
//! so at once; converted whole (`spec.conversion.guest: auto`) they boot on
//! virtio and answer at their own address.

use super::*;
use vmmigrate::api::{GuestConversion, VirtualMachineMigrationStatus};
use vmmigrate::controller::service::DataPlane;

/// A conversion under TCG on a busy 2-core machine (222 to 402 s measured
/// here), perhaps twice, then a boot under TCG.
const CONVERTED: Duration = Duration::from_secs(1800);

/// The check of the guest's own page: served by busybox httpd inside the
/// guest, it names the address `ens192` has, which only the guest's own
/// static configuration gives it (KubeVirt's masquerade binding answers
/// DHCP, but the guest does not ask).
fn own_address_check() -> Value {
    json!({ "checks": [{ "name": "own-address", "http": {
        "service": "web", "port": 80, "path": "/", "expectedStatus": 200,
        "bodyContains": "nic ens192 10.0.2.2/24" } }] })
}

fn ended(v: &VirtualMachineMigration) -> bool {
    matches!(phase_of(v), Phase::Completed | Phase::ManualInterventionRequired | Phase::Failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vmware_guest_moved_as_it_is_needs_a_person_at_once_with_its_consoles_words() {
    let m = Migration::vmware_guest("e2e-vmw-none", "vmware-bios").await;
    // The fixture says `guest: none`; the check could pass only on a guest that booted.
    m.create(|body| body["spec"]["validation"] = own_address_check()).await;
    let vmm = m.wait_for_within("the migration's end", CONVERTED, ended).await;
    let status = vmm.status.clone().unwrap();
    assert_eq!(phase_of(&vmm), Phase::ManualInterventionRequired, "{:#?}", status.errors);
    let error = status.errors.last().expect("an error");
    assert_eq!(error.reason, "GuestRootDiskNotFound", "{error:?}");
    assert!(
        error.message.contains("Gave up waiting for root file system device")
            || error.message.contains("does not exist.  Dropping to a shell"),
        "the console's words are quoted: {}",
        error.message
    );
    assert!(status.guest_conversion.is_none(), "nothing converted it");
    // It was moved as it is: its disk on virtio, which its initramfs has no driver for.
    let vms = m.list(&virtual_machine_resource()).await;
    let disks = &vms[0].data["spec"]["template"]["spec"]["domain"]["devices"]["disks"];
    assert_eq!(disks[0]["disk"]["bus"], "virtio", "{disks}");
    // Long before the validation timeout: the console said it.
    let validating =
        status.history.iter().find(|t| t.phase == Phase::Validating || t.phase == Phase::Starting);
    let stopped = status.history.last().unwrap();
    let waited = stopped.time.0.duration_since(validating.unwrap().time.0).as_secs();
    let limit = vmm.spec.strategy.timeouts.validating_seconds;
    assert!(waited < i64::from(limit), "waited {waited} s of the {limit} s the checks may take");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vmware_bios_guest_converted_whole_boots_on_virtio_at_its_own_address_even_across_a_controller_crash()
 {
    let mut m = Migration::vmware_guest("e2e-vmw-bios", "vmware-bios").await;
    let started = Instant::now();
    m.create(|body| {
        body["spec"]["conversion"] = json!({ "guest": "auto" });
        body["spec"]["validation"] = own_address_check();
    })
    .await;
    // The controller dies while virt-v2v runs: the process group it started
    // names itself beside its log.
    let vmm =
        m.wait_for_within("Converting", CONVERTED, |v| phase_of(v) == Phase::Converting || ended(v)).await;
    let uid = vmm.metadata.uid.clone().unwrap();
    let pgid_file = m.work.path().join("artifacts").join(&uid).join("guest.v2v").join("virt-v2v.pgid");
    let deadline = Instant::now() + CONVERTED;
    let pgid = loop {
        if let Some(pgid) =
            std::fs::read_to_string(&pgid_file).ok().and_then(|s| s.trim().parse::<u32>().ok())
        {
            break pgid;
        }
        assert!(Instant::now() < deadline, "virt-v2v never started");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    m.kill_and_restart_controller().await;
    let first_gone = Instant::now() + Duration::from_secs(30);
    while group_alive(pgid) {
        assert!(Instant::now() < first_gone, "the killed conversion's processes (group {pgid}) still run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let vmm = m.wait_for_within("the migration's end", CONVERTED, ended).await;
    let status = vmm.status.clone().unwrap();
    assert_eq!(phase_of(&vmm), Phase::Completed, "{:#?}", status.errors);
    eprintln!(
        "VMware-shaped BIOS guest, converted twice (a controller crash between): {:.0} s to Completed; conversion {} s",
        started.elapsed().as_secs_f64(),
        status.guest_conversion.as_ref().map_or(0, |g| g.seconds)
    );
    assert_converted_and_chained(&m, &status, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vmware_uefi_guest_on_two_nvme_disks_converted_whole_in_one_job_boots_on_virtio_with_its_data_disk()
{
    let m = Migration::vmware_guest("e2e-vmw-uefi", "vmware-uefi").await;
    create_work_claim(&m.client, &m.ns).await;
    let started = Instant::now();
    // Only the runner: the default converts a guest it knows, here in a Job.
    m.create(|body| {
        body["spec"]["conversion"] = json!({ "runner": "job" });
        body["spec"]["validation"] = own_address_check();
    })
    .await;
    assert_eq!(m.get().await.spec.conversion.guest, vmmigrate::api::GuestConversionMode::Auto);

    // One Job converts the guest: both disks, every copy read-only.
    let jobs: Api<Job> = Api::namespaced(m.client.clone(), &m.ns);
    let name = format!("{}-convert-guest", m.vm);
    let deadline = Instant::now() + CONVERTED;
    let job = loop {
        if let Some(job) = jobs.get_opt(&name).await.unwrap() {
            break job;
        }
        let vmm = m.get().await;
        assert!(!ended(&vmm) && Instant::now() < deadline, "no Job {name}: {:?}", vmm.status);
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let pod = job.spec.unwrap().template.spec.unwrap();
    let container = &pod.containers[0];
    assert_eq!(container.args.as_ref().unwrap()[0], "convert-guest");
    let mounts = container.volume_mounts.clone().unwrap();
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    assert_eq!(mounts[0].read_only, Some(true), "the copies: {mounts:?}");

    let vmm = m.wait_for_within("the migration's end", CONVERTED, ended).await;
    let status = vmm.status.clone().unwrap();
    assert_eq!(phase_of(&vmm), Phase::Completed, "{:#?}", status.errors);
    eprintln!(
        "VMware-shaped UEFI guest, two disks, converted in a Job: {:.0} s to Completed; conversion {} s",
        started.elapsed().as_secs_f64(),
        status.guest_conversion.as_ref().map_or(0, |g| g.seconds)
    );
    let guest = m.guest_facts().await;
    assert!(
        guest.page.contains("data vmmigrate-data-disk-"),
        "its data disk is mounted by UUID: {}",
        guest.page
    );
    // Last: it halts the VM to read its volume.
    assert_converted_and_chained(&m, &status, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vmware_guest_is_converted_in_its_worker_pod_from_the_release_image_and_filled_into_its_volume() {
    let setup = Setup {
        data_plane: DataPlane::Pods,
        import_method: vmmigrate::controller::service::ImportMethod::Fill,
        ..Default::default()
    };
    let m = Migration::vmware_guest_with("e2e-vmw-pod", "vmware-bios", setup).await;
    let started = Instant::now();
    m.create(|body| {
        body["spec"]["conversion"] = json!({ "guest": "auto" });
        body["spec"]["validation"] = own_address_check();
    })
    .await;
    let vmm = m.wait_for_within("the migration's end", CONVERTED, ended).await;
    let status = vmm.status.clone().unwrap();
    assert_eq!(phase_of(&vmm), Phase::Completed, "{:#?}", status.errors);
    let report = status.guest_conversion.clone().expect("status.guestConversion");
    eprintln!(
        "VMware-shaped BIOS guest converted in its worker pod: {:.0} s to Completed; conversion {} s",
        started.elapsed().as_secs_f64(),
        report.seconds
    );
    // Converted there, not here: the log is on the worker's claim.
    assert!(!report.log.starts_with(&m.work.path().display().to_string()), "{report:?}");
    // The converted disk went from the worker's staging server into a blank
    // volume by vmmigrate's fill Job.
    assert_eq!(status.disks[0].import_verification, Some(vmmigrate::api::ImportVerification::Filled));
    assert_converted_and_chained(&m, &status, 1).await;
}

/// What every converted guest shows: what virt-v2v did, the hashes chained
/// from the copy through the converted artifact to the imported volume,
/// its own page at its own address, and no VMware Tools on the volume.
async fn assert_converted_and_chained(m: &Migration, status: &VirtualMachineMigrationStatus, disks: usize) {
    let report: &GuestConversion = status.guest_conversion.as_ref().expect("status.guestConversion");
    assert!(report.tool.starts_with("virt-v2v "), "{report:?}");
    assert!(report.guest.starts_with("debian 12"), "{report:?}");
    assert!(report.drivers.iter().any(|d| d == "virtio-blk"), "{report:?}");
    assert!(report.drivers.iter().any(|d| d == "virtio-net"), "{report:?}");
    assert!(report.log.ends_with("virt-v2v.log"), "{report:?}");
    assert_eq!(report.vmware_tools, "not installed", "{report:?}");
    let mac = &status.source_inventory.as_ref().unwrap().nics[0].mac_address;
    assert_eq!(report.interface_names, vec![format!("{mac}=ens192")]);
    assert_eq!(report.accelerator, "tcg");

    // Source = copy → converted disk (raw) = artifact → imported volume,
    // proven at import, before the guest first wrote to it.
    let source = m.source_sha256_at_start();
    let copies: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(copies, source, "the copies are the source's bytes");
    assert_eq!(report.disk_sha256.len(), disks, "{report:?}");
    assert_ne!(report.disk_sha256[0], copies[0], "the root disk was converted");
    let artifacts: Vec<String> = status.disks.iter().map(|d| d.artifact_sha256.clone().unwrap()).collect();
    assert_eq!(artifacts, report.disk_sha256, "raw artifacts are the converted disks");
    for (i, disk) in status.disks.iter().enumerate() {
        match disk.import_verification {
            // CDI checked what it downloaded against the artifact's sha256.
            Some(vmmigrate::api::ImportVerification::CdiChecksum) => {}
            Some(
                vmmigrate::api::ImportVerification::VolumeSha256
                | vmmigrate::api::ImportVerification::Filled
                | vmmigrate::api::ImportVerification::Patched,
            ) => {
                assert_eq!(disk.imported_sha256.as_ref(), Some(&report.disk_sha256[i]), "disk {i}")
            }
            None => panic!("disk {i}'s import was not proven: {disk:?}"),
        }
    }

    // The guest's own page, at its own address, through the Service.
    assert_eq!(status.validation_results.len(), 1);
    assert!(status.validation_results[0].passed, "{:?}", status.validation_results);
    let guest = m.guest_facts().await;
    assert!(guest.page.contains("nic ens192 10.0.2.2/24"), "{}", guest.page);
    assert!(guest.page.contains("vmware-tools absent"), "{}", guest.page);
    assert_eq!(guest.interfaces[0]["mac"].as_str(), Some(mac.as_str()), "the NIC keeps its MAC");

    // Read back from the imported root volume itself, not from the guest:
    // the VM is stopped first, so that nothing holds the volume.
    let vms: Api<DynamicObject> = Api::namespaced_with(m.client.clone(), &m.ns, &virtual_machine_resource());
    let halt = json!({ "spec": { "runStrategy": "Halted" } });
    vms.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&halt)).await.unwrap();
    let vmis: Api<DynamicObject> = Api::namespaced_with(
        m.client.clone(),
        &m.ns,
        &vmmigrate::destination::cluster::virtual_machine_instance_resource(),
    );
    let deadline = Instant::now() + WAIT;
    while vmis.get_opt(m.vm).await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "the halted VM's VMI never went");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let root = crate::support::imported_image(&m.client, &m.ns, &format!("{}-disk-0", m.vm)).await;
    let out = std::process::Command::new("guestfish")
        .env("LIBGUESTFS_BACKEND", "direct")
        .env("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg")
        .args(["--ro", "--format=raw", "-a"])
        .arg(&root)
        .args([
            "-i",
            "is-file",
            "/usr/bin/vmtoolsd",
            ":",
            "is-file",
            "/etc/systemd/network/10-vmmigrate-ens192.link",
        ])
        .output()
        .expect("guestfish");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "guestfish: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        said.split_whitespace().collect::<Vec<_>>(),
        ["false", "true"],
        "vmtoolsd gone, ens192 pinned"
    );
}

/// Whether any process of group `pgid` still runs.
fn group_alive(pgid: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-0", "--", &format!("-{pgid}")])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
