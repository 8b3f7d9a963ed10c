//! A whole migration with every real part this machine can run: the ESXi
//! emulator (real OpenSSH, BusyBox, vim-cmd scripts, VMDKs made by qemu-img)
//! → the real SSH copy with sha256 → real qemu-img → the real staging HTTPS
//! server → real CDI v1.65.0 (its importer pods download with per-artifact
//! credentials, check the sha256 themselves and write real PersistentVolumes
//! of the node's provisioner; their restarts and failures are CDI's own) →
//! real DataVolume, VirtualMachine and VMI objects in the real kube-apiserver
//! → then, for the VMs whose disks are real guests (the emulator's
//! `GUEST_VMS`, built by `tools/guest/build.sh`), real KubeVirt v1.8.0 on a
//! cluster of its own: real virt-api admits and rewrites the VM, real
//! virt-controller and virt-handler start a virt-launcher pod whose QEMU
//! boots the imported bytes in software emulation, and the checks talk to
//! the guest itself (its own web server through a Service, its real
//! qemu-guest-agent) → Completed. The other tests end in the KubeVirt
//! simulator on the shared cluster, with busybox httpd in a network
//! namespace playing db-02's application: they are about CDI and the
//! controller, not the guest.
//! Conversion Jobs are real Jobs: the scheduler places their pods on the test
//! cluster's node and the kubelet runs them from the release image, on a
//! PersistentVolume holding the controller's work directory.

use crate::support::esxi_emulator::EsxiEmulator;
use crate::support::{CDI_DEFINITION, KubeEnv, phase_of};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Secret};
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::convert::artifact::sha256_file;
use vmmigrate::destination::cluster::{data_volume_resource, virtual_machine_resource};
use vmmigrate::metrics::Metrics;

pub(crate) use crate::support::migration::*;

mod faults;
mod fill;
mod interference;
mod rehearsal;
mod vmware_guests;
mod warm;
mod worker_pods;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_disk_efi_vm_with_two_nics_migrates_to_completed_with_checksums_end_to_end() {
    let m = Migration::new("e2e-full").await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let wall = started.elapsed().as_secs_f64();
    let cat = bare_ssh_cat_seconds(&m.emu, VMID);
    let total: u64 = m.emu.disk_files(VMID).iter().map(|d| d.3).sum();
    eprintln!(
        "end-to-end migration of {} MiB in two disks: {wall:.2} s; bare `ssh cat` of the same disks: {cat:.2} s",
        total >> 20
    );
    let status = vmm.status.clone().unwrap();
    let uid = vmm.uid().unwrap();

    // sha256 end to end: source disk = copy = artifact = imported bytes.
    let source = m.source_sha256_at_start();
    assert_eq!(source.len(), 2);
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, source, "sha256 of the copies");
    let artifacts: Vec<String> = status.disks.iter().map(|d| d.artifact_sha256.clone().unwrap()).collect();
    assert_eq!(artifacts, source, "a raw artifact is the copy itself");
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");

    // The rendered VirtualMachine matches the inventory, field by field.
    let inventory = status.source_inventory.clone().unwrap();
    let vms = m.list(&virtual_machine_resource()).await;
    assert_eq!(vms.len(), 1);
    let vm = &vms[0].data["spec"];
    let domain = &vm["template"]["spec"]["domain"];
    assert_eq!(vm["runStrategy"], "Always");
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], json!(inventory.secure_boot));
    assert_eq!(domain["cpu"]["sockets"], json!(inventory.cpu_sockets));
    assert_eq!(domain["cpu"]["cores"], json!(inventory.cores_per_socket));
    assert_eq!(inventory.cpu_sockets * inventory.cores_per_socket, 4, "db-02 has 4 vCPUs");
    assert_eq!(domain["memory"]["guest"], json!(format!("{}Mi", inventory.memory_mib)));
    assert_eq!(inventory.memory_mib, 4096);
    let disks = domain["devices"]["disks"].as_array().unwrap();
    let volumes = vm["template"]["spec"]["volumes"].as_array().unwrap();
    assert_eq!((disks.len(), volumes.len(), inventory.disks.len()), (2, 2, 2));
    for (i, source_disk) in inventory.disks.iter().enumerate() {
        let bus = if matches!(source_disk.bus.as_str(), "ide" | "sata") { "sata" } else { "virtio" };
        assert_eq!(disks[i]["disk"]["bus"], bus, "disk {i} on {}", source_disk.bus);
        assert_eq!(volumes[i]["dataVolume"]["name"], format!("{VM}-disk-{i}"));
    }
    assert_eq!(disks[0]["bootOrder"], 1);
    let interfaces = domain["devices"]["interfaces"].as_array().unwrap();
    let networks = vm["template"]["spec"]["networks"].as_array().unwrap();
    assert_eq!(inventory.nics.len(), 2);
    for (i, nic) in inventory.nics.iter().enumerate() {
        let model = if nic.model == "vmxnet3" { "virtio" } else { nic.model.as_str() };
        assert_eq!(interfaces[i]["model"], model, "nic {i} was {}", nic.model);
        assert_eq!(interfaces[i]["macAddress"], nic.mac_address.as_str(), "MAC of nic {i} preserved");
    }
    assert_eq!((inventory.nics[0].model.as_str(), inventory.nics[1].model.as_str()), ("vmxnet3", "e1000"));
    assert!(interfaces[0].get("masquerade").is_some() && networks[0].get("pod").is_some());
    assert!(interfaces[1].get("bridge").is_some());
    assert_eq!(networks[1]["multus"]["networkName"], "dmz");
    assert_eq!(vms[0].labels()["migration.platform.example/migration-uid"], uid);

    // Every check ran against the real thing and passed.
    assert_the_three_checks_passed(&status);
    let dvs = m.list(&data_volume_resource()).await;
    assert_eq!(dvs.len(), 2);
    // Real CDI v1.65 checked each download against the copy's sha256.
    for (dv, disk) in dvs.iter().zip(&status.disks) {
        let checksum = &dv.data["spec"]["source"]["http"]["checksum"];
        assert_eq!(checksum, &json!(format!("sha256:{}", disk.artifact_sha256.clone().unwrap())));
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::CdiChecksum));
    }
    // Imported over TLS with per-artifact credentials, which are gone now.
    for dv in &dvs {
        let http = &dv.data["spec"]["source"]["http"];
        assert!(http["url"].as_str().unwrap().starts_with("https://"), "{http}");
        assert_eq!(http["secretRef"], format!("{}-import", dv.name_any()));
        assert_eq!(http["certConfigMap"], format!("{}-import-ca", dv.name_any()));
    }
    let ours = ListParams::default().labels(&format!("migration.platform.example/migration-uid={uid}"));
    let secrets: Api<Secret> = Api::namespaced(m.client.clone(), &m.ns);
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(m.client.clone(), &m.ns);
    assert!(secrets.list(&ours).await.unwrap().items.is_empty(), "import Secrets left after Completed");
    assert!(maps.list(&ours).await.unwrap().items.is_empty(), "import CAs left after Completed");
    let staging = m.staging.stats();
    assert_eq!(staging.unauthorized.load(Ordering::Relaxed), 0);

    // The real adapters and the staging server counted every byte once.
    let text = m.metrics.encode();
    let counter = |name: &str| -> u64 {
        let line =
            text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("no {name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(counter("vmmigrate_copy_bytes_total"), total, "read from the host");
    assert_eq!(counter("vmmigrate_convert_bytes_total"), total, "raw artifacts of the copies' size");
    assert_eq!(counter("vmmigrate_staging_bytes_served_total"), total, "each artifact imported once");

    // Nothing staged or copied is left; the source is off and untouched.
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_efi_guest_with_two_disks_boots_on_real_kubevirt_from_the_copied_bytes_and_completes_with_checksums_end_to_end()
 {
    let m = Migration::guest("e2e-efi", "app-efi").await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let wall = started.elapsed().as_secs_f64();
    let cat = bare_ssh_cat_seconds(&m.emu, m.vmid);
    let total: u64 = m.emu.disk_files(m.vmid).iter().map(|d| d.3).sum();
    eprintln!(
        "EFI guest on real KubeVirt, {} MiB in two disks: {wall:.1} s to Completed; bare `ssh cat`: {cat:.2} s",
        total >> 20
    );
    let status = vmm.status.clone().unwrap();

    // sha256 end to end: source disk = copy = artifact = imported bytes.
    let source = m.source_sha256_at_start();
    assert_eq!(source.len(), 2);
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert_eq!(recorded, source, "sha256 of the copies");
    assert_eq!(m.imported_sha256(2).await, source, "the bytes in the PVCs are the source's");

    // Real virt-api admitted the VM, with UEFI and without secure boot as on the source.
    let inventory = status.source_inventory.clone().unwrap();
    assert!(inventory.firmware == vmmigrate::api::Firmware::Efi && !inventory.secure_boot);
    let vms = m.list(&virtual_machine_resource()).await;
    let domain = &vms[0].data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], false);
    assert_eq!(domain["machine"]["type"], "q35", "virt-api's defaults are there");

    // Every check ran against the guest and passed.
    assert_the_three_checks_passed(&status);
    // The guest booted from the imported bytes under UEFI (OVMF) and saw
    // both disks, the second with the data disk's file system.
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware efi"), "console:\n{}", guest.console);
    assert!(guest.page.contains("vmmigrate-guest app-efi"), "{}", guest.page);
    let disks_line = guest.page.lines().find(|l| l.starts_with("disks:")).unwrap_or_default();
    assert_eq!(disks_line.split_whitespace().count(), 3, "two disks: {}", guest.page);
    assert!(guest.page.contains("vmmdata"), "the data disk's label: {}", guest.page);
    let iface = &guest.interfaces[0];
    assert!(iface["infoSource"].as_str().unwrap_or("").contains("guest-agent"), "{iface}");
    assert_eq!(iface["mac"], "00:0c:29:aa:bb:09", "the guest sees the source's MAC");
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_killed_during_converting_and_importing_completes_with_one_job_and_data_volume_per_disk() {
    let mut m = Migration::new("e2e-kill").await;
    let data_volumes: Api<DynamicObject> =
        Api::namespaced_with(m.client.clone(), &m.ns, &data_volume_resource());
    let (dvs_seen, dv_watch) = watch_uids(data_volumes);
    // The Jobs' pods wait for the work claim, created after the first kill.
    m.create(|body| {
        body["spec"]["conversion"] = json!({"format": "qcow2", "runner": "job", "guest": "none"});
    })
    .await;

    // Converting: both Jobs and their pods exist (held); no pod may start
    // after them (real CDI's importers wait for the quota to go); kill the
    // controller, release the Jobs.
    let jobs: Api<Job> = Api::namespaced(m.client.clone(), &m.ns);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(m.client.clone(), &m.ns);
    m.wait_for("two conversion Jobs", |v| phase_of(v) == Phase::Converting).await;
    let deadline = Instant::now() + WAIT;
    while jobs.list(&ListParams::default()).await.unwrap().items.len() < 2
        || pods.list(&ListParams::default().labels("job-name")).await.unwrap().items.len() < 2
    {
        assert!(Instant::now() < deadline, "the conversion Jobs and their pods were never created");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    m.hold_importer_pods().await;
    m.kill_and_restart_controller().await;
    create_work_claim(&m.client, &m.ns).await;

    // Importing: both DataVolumes exist (held); kill again, release the imports.
    m.importing_with_both_data_volumes().await;
    m.kill_and_restart_controller().await;
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    dv_watch.abort();
    let status = vmm.status.unwrap();
    assert_eq!(m.jobs_seen.lock().unwrap().len(), 2, "one conversion Job per disk");
    assert_eq!(dvs_seen.lock().unwrap().len(), 2, "one DataVolume per disk");
    assert!(jobs.list(&ListParams::default()).await.unwrap().items.is_empty(), "Jobs are cleaned up");
    // qcow2 artifacts: CDI's importer converted them back to raw; the bytes
    // are the source's.
    assert!(status.disks.iter().all(|d| d.artifact_format.as_deref() == Some("qcow2")));
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flipped_in_a_staged_artifact_is_caught_retried_and_only_the_source_bytes_end_in_the_volumes()
{
    let m = Migration::new("e2e-flip").await;
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let uid = vmm.uid().unwrap();
    let staged = m.work.path().join("staging").join(&uid).join("disk-0.raw");
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&staged).expect("staged artifact");
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, 4096).unwrap();
        file.write_all_at(&[byte[0] ^ 0x01], 4096).unwrap();
    }
    m.release_importer_pods().await;

    // Real CDI's importer gets the file without its last bytes (the staging
    // server withholds them from a file that no longer matches its marker):
    // CDI's checksum check fails it, or the importer fails until the
    // controller gives up; either way Converting finds the corrupt copy.
    let deadline = Instant::now() + Duration::from_secs(600);
    let vmm = loop {
        let vmm = m.get().await;
        if phase_of(&vmm) == Phase::Completed
            && vmm.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some())
        {
            break vmm;
        }
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        assert!(Instant::now() < deadline, "still {}: {:#?}", phase_of(&vmm), vmm.status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let status = vmm.status.unwrap();
    let reasons: Vec<&str> = status.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons.iter().any(|r| *r == "ImportChecksumMismatch" || *r == "ImportFailed"),
        "the bad import was seen: {reasons:?}"
    );
    assert!(
        reasons.contains(&"AcquiredCopyCorrupt"),
        "the corrupt copy was found and copied again: {reasons:?}"
    );
    assert!(m.staging.stats().corrupt_detected.load(Ordering::SeqCst) >= 1, "the staging server withheld it");
    // Never imported: the only successful imports carry the source's bytes.
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}

/// The controller's reconcile count (ok and error) from its metrics.
/// The sha256 of a disk file as the copy computes it.
fn copy_sha256(path: &Path) -> String {
    vmmigrate::source::esxi::copy::sha256_file(path).expect("sha256")
}

fn reconciles(metrics: &Metrics) -> u64 {
    metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("vmmigrate_reconcile_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// What the API server records of the VM's writers: its generation (bumped
/// by every change to the spec) and, per field manager other than
/// KubeVirt's own controllers (which keep the VM's status), the time of its
/// last write.
async fn vm_writers(vms: &Api<DynamicObject>, name: &str) -> (i64, Vec<(String, String)>) {
    let vm = vms.get(name).await.unwrap();
    let mut writers: Vec<(String, String)> = vm
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|f| !matches!(f.manager.as_deref(), Some("virt-controller" | "virt-handler" | "virt-api")))
        .map(|f| (f.manager.unwrap_or_default(), f.time.map(|t| format!("{t:?}")).unwrap_or_default()))
        .collect();
    writers.sort();
    (vm.metadata.generation.unwrap_or_default(), writers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completed_vm_rewritten_by_real_virt_api_gets_no_writes_over_20_reconciles_and_a_later_change_is_reported_not_undone()
 {
    let m = Migration::guest("e2e-drift", "app-bios").await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    m.wait_completed().await;
    let vms: Api<DynamicObject> = Api::namespaced_with(m.client.clone(), &m.ns, &virtual_machine_resource());
    let stored = vms.get(m.vm).await.unwrap();
    let domain = &stored.data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["machine"]["type"], "q35", "rewritten by real virt-api's mutating webhook");
    let at_completed = vm_writers(&vms, m.vm).await;

    // 20 reconciles forced by touching the migration: no write to the VM.
    for i in 0..20 {
        let before = reconciles(&m.metrics);
        let poke = json!({ "metadata": { "annotations": { "test.vmmigrate/poke": i.to_string() } } });
        m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&poke)).await.unwrap();
        let deadline = Instant::now() + WAIT;
        while reconciles(&m.metrics) <= before {
            assert!(Instant::now() < deadline, "reconcile {i} never ran");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(vm_writers(&vms, m.vm).await, at_completed, "the VM was written after Completed");

    // A person gives the VM more memory: reported as drift, not undone.
    let more = json!({ "spec": { "template": { "spec": { "domain": { "memory": { "guest": "320Mi" },
                        "resources": { "requests": { "memory": "320Mi" } } } } } } });
    // As a person would, again while KubeVirt's mutating webhook times out
    // (virt-api on a loaded node: the API server answers 500).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match vms.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&more)).await {
            Ok(_) => break,
            Err(kube::Error::Api(e)) if e.code == 500 && e.message.contains("webhook") => {
                assert!(Instant::now() < deadline, "virt-api never answered: {e:?}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => panic!("patching the VM: {e}"),
        }
    }
    let vmm = m
        .wait_for("VMDrifted", |v| {
            v.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "VMDrifted" && c.status == vmmigrate::api::ConditionStatus::True)
            })
        })
        .await;
    let status = vmm.status.clone().unwrap();
    let drifted = status.conditions.iter().find(|c| c.type_ == "VMDrifted").unwrap();
    assert!(drifted.message.contains("memory.guest"), "{}", drifted.message);
    assert_eq!(status.phase, Phase::Completed);
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(m.client.clone(), &m.ns);
    let deadline = Instant::now() + WAIT;
    loop {
        let list = events.list(&ListParams::default()).await.unwrap().items;
        if list.iter().any(|e| {
            e.reason.as_deref() == Some("VMDrifted") && e.involved_object.name.as_deref() == Some(m.vm)
        }) {
            break;
        }
        assert!(Instant::now() < deadline, "no VMDrifted Event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // More reconciles: the person's change stands, the controller wrote nothing.
    let after_change = vm_writers(&vms, m.vm).await;
    for i in 0..3 {
        let before = reconciles(&m.metrics);
        let poke = json!({ "metadata": { "annotations": { "test.vmmigrate/poke": format!("after-{i}") } } });
        m.api.patch(m.vm, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&poke)).await.unwrap();
        while reconciles(&m.metrics) <= before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(vm_writers(&vms, m.vm).await, after_change, "the controller wrote to the changed VM");
    assert_eq!(
        vms.get(m.vm).await.unwrap().data["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
        "320Mi"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bios_guest_boots_on_real_kubevirt_from_a_volume_vmmigrate_filled_and_its_own_page_agent_and_address_pass()
 {
    let setup =
        Setup { import_method: vmmigrate::controller::service::ImportMethod::Fill, ..Default::default() };
    let m = Migration::guest_with("e2e-bios", "app-bios", setup).await;
    let started = Instant::now();
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    eprintln!(
        "BIOS guest, merge of the manifest to Completed on real KubeVirt: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let status = vmm.status.clone().unwrap();
    let source = m.source_sha256_at_start();
    assert_eq!(m.imported_sha256(1).await, source, "the bytes in the PVC are the source's");
    // Written by vmmigrate's fill Job into a blank volume, not by CDI's importer.
    assert_eq!(status.disks[0].import_verification, Some(vmmigrate::api::ImportVerification::Filled));
    assert_eq!(status.disks[0].imported_sha256.as_ref(), Some(&source[0]));
    assert_the_three_checks_passed(&status);
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware bios"), "console:\n{}", guest.console);
    // The controller reads the same console, from the VMI's own launcher pod
    // and with its own rights (the tenant Role's pods/log).
    let cluster = vmmigrate::destination::cluster::KubeCluster::new(m.controller_client.clone(), &m.ns);
    let read = vmmigrate::ports::Cluster::guest_console(&cluster, &vmm).await.expect("console read");
    let read = read.expect("a console to read");
    assert!(read.contains("vmmigrate-guest: booted firmware bios"), "the controller's read:\n{read}");
    assert!(
        guest.page.contains("vmmigrate-guest app-bios") && guest.page.contains("firmware: bios"),
        "{}",
        guest.page
    );
    let iface = &guest.interfaces[0];
    assert!(iface["infoSource"].as_str().unwrap_or("").contains("guest-agent"), "{iface}");
    assert_eq!(iface["mac"], "00:0c:29:aa:bb:08", "the guest sees the source's MAC");
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_secure_boot_guest_boots_on_real_kubevirt_with_secure_boot_and_smm_through_its_signed_shim() {
    let m = Migration::guest("e2e-secure", "app-secure").await;
    m.create(|_| {}).await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.clone().unwrap();
    let inventory = status.source_inventory.clone().unwrap();
    assert!(inventory.firmware == vmmigrate::api::Firmware::Efi && inventory.secure_boot, "{inventory:?}");
    let vms = m.list(&virtual_machine_resource()).await;
    let domain = &vms[0].data["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["firmware"]["bootloader"]["efi"]["secureBoot"], true);
    assert_eq!(domain["features"]["smm"]["enabled"], true, "secure boot needs SMM");
    assert!(status.validation_results.iter().all(|r| r.passed), "{:#?}", status.validation_results);
    // OVMF with Microsoft's keys verified Debian's shim, GRUB and kernel:
    // the kernel says secure boot is on, and so does the guest.
    let guest = m.guest_facts().await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware efi"), "console:\n{}", guest.console);
    assert!(guest.console.contains("vmmigrate-guest: secureboot on"), "console:\n{}", guest.console);
    assert!(guest.page.contains("secureboot: on"), "{}", guest.page);
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disk_without_an_os_runs_but_fails_its_checks_retries_and_waits_for_a_person_never_completed() {
    let m = Migration::guest("e2e-no-os", "no-os").await;
    m.create(|body| {
        body["spec"]["strategy"]["retryLimit"] = json!(1);
        body["spec"]["strategy"]["onRetriesExhausted"] = json!("ManualIntervention");
        body["spec"]["strategy"]["timeouts"]["validatingSeconds"] = json!(30);
    })
    .await;
    let mut phases = Vec::new();
    let vmm = m
        .wait_until_stopped(|v| {
            let phase = phase_of(v);
            if phases.last() != Some(&phase) {
                phases.push(phase);
            }
            assert_ne!(phase, Phase::Completed, "a disk without an OS completed: {:#?}", v.status);
            phase == Phase::ManualInterventionRequired
        })
        .await;
    assert!(phases.contains(&Phase::Validating), "{phases:?}");
    let status = vmm.status.clone().unwrap();
    let timeouts: Vec<_> =
        status.errors.iter().filter(|e| e.reason == vmmigrate::api::Reason::ValidationTimeout).collect();
    assert!(timeouts.len() >= 2, "validated again within its retry budget first: {:#?}", status.errors);
    // The VMI ran: QEMU started, and what it ran answered nothing.
    let guest = m.guest_facts().await;
    assert!(!guest.console.contains("vmmigrate-guest: booted"), "{}", guest.console);
    let failed: Vec<_> = status.validation_results.iter().filter(|r| !r.passed).collect();
    assert!(!failed.is_empty(), "{:#?}", status.validation_results);
    let error = status.errors.last().expect("an error names what failed");
    assert!(
        ["status-page", "agent", "address"].iter().any(|check| error.message.contains(check)),
        "the message names the check: {}",
        error.message
    );
    eprintln!("no-OS disk stopped with: {}", error.message);
}

/// CDI's DataVolume definition without `spec.source.http.checksum` (as CDI
/// v1.64 and older install it) while this lives; CDI's operator, which would
/// put the field back, is scaled to zero meanwhile. Restored on drop.
struct CdiWithoutChecksum {
    _exclusive: tokio::sync::RwLockWriteGuard<'static, ()>,
}

impl CdiWithoutChecksum {
    async fn install() -> CdiWithoutChecksum {
        let exclusive = CDI_DEFINITION.write().await;
        let env = tokio::task::block_in_place(KubeEnv::shared);
        tokio::task::block_in_place(|| {
            env.kubectl(&["-n", "cdi", "scale", "deployment", "cdi-operator", "--replicas=0"]).unwrap();
            env.kubectl(&[
                "-n",
                "cdi",
                "wait",
                "--for=delete",
                "pod",
                "-l",
                "name=cdi-operator",
                "--timeout=120s",
            ])
            .unwrap();
        });
        let crds: Api<
            k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
        > = Api::all(env.client().await);
        let crd = crds.get("datavolumes.cdi.kubevirt.io").await.unwrap();
        let versions = crd.spec.versions.len();
        let remove: Vec<Value> = (0..versions)
            .map(|i| json!({ "op": "remove", "path": format!(
                "/spec/versions/{i}/schema/openAPIV3Schema/properties/spec/properties/source/properties/http/properties/checksum") }))
            .collect();
        crds.patch(
            "datavolumes.cdi.kubevirt.io",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::<()>::Json(serde_json::from_value(Value::Array(remove)).unwrap()),
        )
        .await
        .expect("removing checksum from the DataVolume definition");
        CdiWithoutChecksum { _exclusive: exclusive }
    }
}

impl Drop for CdiWithoutChecksum {
    fn drop(&mut self) {
        let env = KubeEnv::shared();
        let crds = vmmigrate_harness::setup::upstream().unwrap().join("crds/cdi.yaml");
        let restore = || -> anyhow::Result<()> {
            env.kubectl(&[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=vmmigrate-tests",
                "-f",
                &crds.to_string_lossy(),
            ])?;
            env.kubectl(&["-n", "cdi", "scale", "deployment", "cdi-operator", "--replicas=1"])?;
            Ok(())
        };
        let _ = std::thread::scope(|s| s.spawn(restore).join());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_cdi_that_cannot_check_checksums_each_import_is_read_back_and_compared_before_the_vm_is_created()
 {
    let _old_cdi = CdiWithoutChecksum::install().await;
    let m = Migration::with("e2e-nochecksum", Cdi::RealWithoutChecksum).await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let source = m.source_sha256_at_start();
    for (disk, sha) in status.disks.iter().zip(&source) {
        assert_eq!(disk.import_verification, Some(vmmigrate::api::ImportVerification::VolumeSha256));
        assert_eq!(disk.imported_sha256.as_ref(), Some(sha), "read back from the volume");
    }
    // The DataVolumes went without the field CDI would not have checked.
    for dv in m.list(&data_volume_resource()).await {
        assert!(dv.data["spec"]["source"]["http"].get("checksum").is_none(), "{}", dv.data["spec"]);
    }
    let seen = m.jobs_seen.lock().unwrap().clone();
    assert!(seen.len() >= 2, "a verify Job per disk: {seen:?}");
    assert_eq!(m.imported_sha256(2).await, source);
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_importer_refused_by_the_staging_server_restarts_in_cdi_until_the_controller_gives_up_and_imports_again()
 {
    let m = Migration::new("e2e-refused").await;
    // Hold the importer pods until the credentials are spoilt.
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    m.wait_for("Importing", |v| phase_of(v) == Phase::Importing).await;
    let secrets: Api<Secret> = Api::namespaced(m.client.clone(), &m.ns);
    let deadline = Instant::now() + WAIT;
    for disk in 0..2 {
        let name = format!("{VM}-disk-{disk}-import");
        while secrets.get_opt(&name).await.unwrap().is_none() {
            assert!(Instant::now() < deadline, "no import Secret {name}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let wrong = json!({ "stringData": { "secretKey": "not-the-key" } });
        secrets
            .patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&wrong))
            .await
            .unwrap();
    }
    m.release_importer_pods().await;

    // CDI restarts the importers (401 from the staging server); after three
    // restarts the controller deletes the DataVolumes, goes back through
    // Converting and imports again with credentials applied anew.
    let deadline = Instant::now() + Duration::from_secs(600);
    let vmm = loop {
        let vmm = m.get().await;
        if phase_of(&vmm) == Phase::Completed {
            break vmm;
        }
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        assert!(Instant::now() < deadline, "still {}: {:#?}", phase_of(&vmm), vmm.status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let status = vmm.status.unwrap();
    let given_up = status
        .errors
        .iter()
        .find(|e| e.reason == vmmigrate::api::Reason::ImportFailed)
        .unwrap_or_else(|| panic!("no ImportFailed: {:#?}", status.errors));
    assert!(given_up.message.contains("failed 3 times"), "{}", given_up.message);
    assert!(given_up.message.contains("401"), "the importer's own words: {}", given_up.message);
    assert!(m.staging.stats().unauthorized.load(Ordering::Relaxed) >= 3, "the staging server refused them");
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

/// The `DiskImported` condition's message, when there is one.
fn disk_imported_message(vmm: &VirtualMachineMigration) -> Option<String> {
    let status = vmm.status.as_ref()?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "DiskImported")
        .map(|c| format!("{}: {}", c.reason, c.message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staging_server_unavailable_for_a_while_restarts_the_importers_and_the_import_completes_without_rework()
 {
    let m = Migration::with_front("e2e-503", Cdi::Real, true).await;
    let front = m.front.as_ref().unwrap();
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;

    // Every importer is answered 503 until each disk's importer has failed
    // at least once and the controller has said so.
    let mut seen_restarting = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen_restarting.is_none() {
        let vmm = m.get().await;
        assert!(
            !matches!(phase_of(&vmm), Phase::Failed | Phase::ManualInterventionRequired),
            "{:#?}",
            vmm.status
        );
        if let Some(message) = disk_imported_message(&vmm).filter(|m| m.starts_with("ImporterRestarting"))
            && front.refused() >= 2
        {
            seen_restarting = Some(message);
        }
        assert!(Instant::now() < deadline, "no importer restart reported: {:#?}", vmm.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let message = seen_restarting.unwrap();
    assert!(message.contains("503"), "the importer's own words in the condition: {message}");
    front.open();

    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let reasons: Vec<&str> = status.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.is_empty(), "a transient outage is no failure: {reasons:?}");
    // The same DataVolumes carried on (restarted by CDI, not remade by us),
    // and each artifact was served whole exactly once.
    let dvs = m.list(&data_volume_resource()).await;
    let restarts: i64 = dvs.iter().map(|dv| dv.data["status"]["restartCount"].as_i64().unwrap_or(0)).sum();
    assert!(restarts >= 1, "CDI restarted an importer: {restarts}");
    assert!(
        dvs.iter().all(|dv| dv.data["status"]["restartCount"].as_i64().unwrap_or(0)
            < i64::from(vmmigrate::machine::IMPORTER_RESTART_LIMIT)),
        "no importer reached the give-up limit"
    );
    let total: u64 = m.emu.disk_files(VMID).iter().map(|d| d.3).sum();
    let served = m.staging.stats().bytes_served.load(Ordering::Relaxed);
    assert_eq!(served, total, "each artifact imported once");
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_whose_importer_never_starts_is_given_up_after_the_stall_timeout_and_made_again() {
    let m = Migration::new("e2e-stall").await;
    // No importer pod may start: the DataVolumes sit in their first phase.
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] });
        // Long enough for a loaded node to bind a volume and start an
        // importer once they may; each phase CDI moves through resets it.
        body["spec"]["strategy"]["timeouts"]["importStallSeconds"] = json!(30);
    })
    .await;
    let (first, dvs) = m.importing_with_both_data_volumes().await;
    let first_dvs: std::collections::HashSet<String> = dvs.iter().filter_map(|dv| dv.uid()).collect();
    let stalled = m
        .wait_for("ImportStalled", |v| {
            v.status.as_ref().is_some_and(|s| s.errors.iter().any(|e| e.reason == "ImportStalled"))
        })
        .await;
    let error = stalled.status.unwrap().errors.into_iter().find(|e| e.reason == "ImportStalled").unwrap();
    assert!(error.message.contains("made no progress for"), "{}", error.message);
    assert!(error.message.contains(&format!("{VM}-disk-")), "names the DataVolume: {}", error.message);
    assert_eq!(first.status.unwrap().phase, Phase::Importing);
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    let dvs: std::collections::HashSet<String> =
        m.list(&data_volume_resource()).await.iter().filter_map(|dv| dv.uid()).collect();
    assert!(dvs.is_disjoint(&first_dvs), "the stalled DataVolumes were replaced");
    let status = vmm.status.unwrap();
    assert!(status.errors.iter().all(|e| e.reason == "ImportStalled"), "{:#?}", status.errors);
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    m.assert_source_off_and_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bytes_served_under_another_checksum_fail_in_cdis_own_check_and_the_copy_is_imported_again() {
    use vmmigrate::convert::artifact::{Marker, write_marker};
    let m = Migration::new("e2e-checksum").await;
    m.hold_importer_pods().await;
    m.create(|body| {
        body["spec"]["validation"] = json!({ "checks": [{ "name": "agent", "guestAgent": {} }] })
    })
    .await;
    let (vmm, _) = m.importing_with_both_data_volumes().await;
    // The staged file is replaced by other bytes with a marker of their own:
    // the staging server serves them whole, and only the checksum the
    // DataVolume carries (the copy's) can tell.
    let uid = vmm.uid().unwrap();
    let staged = m.work.path().join("staging").join(&uid).join("disk-0.raw");
    let mut other = std::fs::read(&staged).expect("staged artifact");
    other[4096] ^= 0x01;
    let replacement = staged.with_extension("replacement");
    std::fs::write(&replacement, &other).unwrap();
    std::fs::rename(&replacement, &staged).unwrap();
    let (size, sha256) = sha256_file(&staged, None).unwrap();
    write_marker(&staged, &Marker { size, sha256 }).unwrap();
    m.release_importer_pods().await;

    let vmm = m.wait_completed().await;
    let status = vmm.status.unwrap();
    let mismatch = status
        .errors
        .iter()
        .find(|e| e.reason == vmmigrate::api::Reason::ImportChecksumMismatch)
        .unwrap_or_else(|| panic!("CDI's checksum check did not fail the import: {:#?}", status.errors));
    assert!(mismatch.message.contains(&format!("{VM}-disk-0")), "{}", mismatch.message);
    assert_eq!(m.staging.stats().corrupt_detected.load(Ordering::SeqCst), 0, "the server could not tell");
    // Only the copy's bytes were ever imported into the volumes that stay.
    assert_eq!(m.imported_sha256(2).await, m.source_sha256_at_start());
    assert_eq!(m.leftovers(&uid), Vec::<PathBuf>::new());
    m.assert_source_off_and_untouched().await;
}
