//! Rehearsals (`spec.mode: Rehearsal`) through the real controller: copied
//! from a snapshot while the source runs, imported by real CDI, started under
//! another name without a network; the source is never powered off, and the
//! only vim-cmd calls that change it are the snapshot's create and remove.

use super::*;
use crate::support::esxi_snapshots::GuestWrites;

/// The `.vmx` of the source, as the host has it.
fn vmx_of(m: &Migration) -> Vec<u8> {
    let disk = m.emu.disk_files(m.vmid)[0].1.clone();
    let dir = disk.parent().expect("the VM's directory");
    let vmx = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "vmx"))
        .expect("a .vmx beside the disks");
    std::fs::read(vmx).unwrap()
}

/// Every vim-cmd call that could change the source, by name: anything but
/// the reads (a `message` call with only the vmid lists the pending question).
fn changing_calls(m: &Migration) -> Vec<String> {
    let reads = ["getallvms", "get.", "snapshot.get", "tools.", "power.getstate"];
    m.emu
        .vimcmd_invocations()
        .into_iter()
        .filter(|argv| !(argv.first().is_some_and(|c| c.ends_with("message")) && argv.len() == 2))
        .filter_map(|argv| argv.first().cloned())
        .map(|cmd| cmd.trim_start_matches("vmsvc/").to_owned())
        .filter(|cmd| !reads.iter().any(|r| cmd.starts_with(r)))
        .collect()
}

/// The VM and DataVolumes of the namespace, by name.
async fn destination_objects(m: &Migration) -> (Vec<String>, Vec<String>) {
    let names = |objs: Vec<DynamicObject>| objs.iter().map(|o| o.name_any()).collect::<Vec<_>>();
    (names(m.list(&virtual_machine_resource()).await), names(m.list(&data_volume_resource()).await))
}

/// Deletes the migration and waits until its finalizer ran and what it
/// deleted is gone (KubeVirt's own finalizer holds a VM until its VMI stopped).
async fn delete_migration(m: &Migration) {
    m.api.delete(m.vm, &Default::default()).await.expect("delete the migration");
    let deadline = Instant::now() + WAIT;
    while m.api.get_opt(m.vm).await.expect("read the migration").is_some() {
        assert!(Instant::now() < deadline, "the migration's finalizer never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    loop {
        let left = destination_objects(m).await;
        if left == (vec![], vec![]) {
            return;
        }
        assert!(Instant::now() < deadline, "the rehearsal's VM and volumes are still there: {left:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn assert_snapshot_logged_and_removed(status: &vmmigrate::api::VirtualMachineMigrationStatus, vm: &str) {
    let snapshot = status.snapshot.clone().expect("the snapshot is logged in the status");
    assert_eq!(snapshot.name, format!("vmmigrate-{vm}"));
    assert!(snapshot.removed.is_some(), "removed once the copy was done: {snapshot:?}");
    assert!(status.timestamps.source_powered_off.is_none(), "no power-off recorded");
    assert!(status.timestamps.shutdown_requested.is_none(), "no shutdown asked for");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rehearsal_of_a_changing_vm_imports_the_bytes_the_host_hashed_under_its_snapshot_and_never_touches_the_power()
 {
    let m = Migration::pair("e2e-rehearsal").await;
    let vmx_before = vmx_of(&m);
    let writer = m
        .emu
        .start_guest_writes(m.vmid, GuestWrites { blocks_per_second: 500, seed: 5, ..Default::default() });
    m.create(|body| body["spec"]["mode"] = json!("Rehearsal")).await;
    let vmm = m.wait_completed().await;
    drop(writer);
    let status = vmm.status.clone().unwrap();
    assert_snapshot_logged_and_removed(&status, "pair");

    // The source: running all along, never asked to stop; the snapshot's
    // create and remove were the only changing calls; nothing left of it.
    assert_eq!(m.emu.vm_power(m.vmid), "on");
    assert_eq!(m.emu.power_off_transitions(m.vmid), 0);
    assert_eq!(changing_calls(&m), vec!["snapshot.create", "snapshot.remove"]);
    let listed = m.emu.ssh_command().arg("vim-cmd vmsvc/snapshot.get 12").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&listed.stdout), "Get Snapshot:\n", "no snapshot left");
    assert_eq!(vmx_of(&m), vmx_before, "the .vmx is as it was");

    // The copy: what the host's own sha256 read under the snapshot (the
    // frozen base), checked again by CDI; neither the disks at the start nor
    // now: the guest wrote before the snapshot and after it.
    let recorded: Vec<String> = status.disks.iter().map(|d| d.source_sha256.clone().unwrap()).collect();
    assert!(status.disks.iter().all(|d| d.source_verified_remotely == Some(true)));
    let now = m.source_sha256_now();
    assert_ne!(recorded, now, "the guest wrote after the snapshot");
    assert_ne!(recorded, m.source_sha256_at_start(), "the guest wrote before the snapshot too");
    assert_eq!(
        m.imported_sha256_of("pair-rehearsal", 2).await,
        recorded,
        "the imported bytes are the snapshot's moment"
    );

    // Another name, no network; the checks that cannot reach it are named, not run.
    let vm = status.destination_vm.clone().expect("the rehearsal VM");
    assert_eq!(vm.name, "pair-rehearsal");
    let (vms, mut dvs) = destination_objects(&m).await;
    dvs.sort();
    assert_eq!(vms, vec!["pair-rehearsal"]);
    assert_eq!(dvs, vec!["pair-rehearsal-disk-0", "pair-rehearsal-disk-1"]);
    let results: Vec<(&str, bool)> =
        status.validation_results.iter().map(|r| (r.name.as_str(), r.passed)).collect();
    assert_eq!(results, vec![("agent", true)]);
    let ready = status.conditions.iter().find(|c| c.type_ == "GuestReady").unwrap();
    assert!(ready.message.contains("\"status-page\"") && ready.message.contains("\"address\""), "{ready:?}");

    // Done, it gave up its claim on the source: the migration of the same VM
    // passes validation (and, told the VM must already be off, stops there
    // for a person without touching it).
    m.create(|body| {
        body["metadata"]["name"] = json!("pair-real");
        body["spec"]["powerOffPolicy"] = json!("RequireAlreadyOff");
    })
    .await;
    let deadline = Instant::now() + WAIT;
    let real = loop {
        let real = m.api.get("pair-real").await.expect("the migration");
        if phase_of(&real) == Phase::ManualInterventionRequired {
            break real.status.unwrap();
        }
        assert!(Instant::now() < deadline, "still {}: {:#?}", phase_of(&real), real.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reason = real.errors.last().map(|e| e.reason.clone());
    assert_eq!(reason.as_deref(), Some("SourceNotPoweredOff"), "past validation: {:#?}", real.blockers);
    m.api.delete("pair-real", &Default::default()).await.expect("delete the migration");

    // Its objects go when the manifest goes.
    delete_migration(&m).await;
    assert_eq!(m.emu.vm_power(m.vmid), "on");
    assert_eq!(m.emu.power_off_transitions(m.vmid), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rehearsal_boots_on_real_kubevirt_without_a_network_and_leaves_the_source_running_and_unchanged() {
    let m = Migration::guest("e2e-rehearse", "app-bios").await;
    let vmx_before = vmx_of(&m);
    m.create(|body| body["spec"]["mode"] = json!("Rehearsal")).await;
    let vmm = m.wait_completed().await;
    let status = vmm.status.clone().unwrap();
    assert_snapshot_logged_and_removed(&status, "app-bios");

    // Real virt-api admitted a VM without interfaces and real KubeVirt booted
    // the copied bytes; its guest agent answered over virtio-serial.
    let guest = m.guest_facts_of("app-bios-rehearsal").await;
    assert!(guest.console.contains("vmmigrate-guest: booted firmware bios"), "console:\n{}", guest.console);
    // What the VMI reports of the guest's interfaces: no address beyond
    // loopback, never the source's MAC (the guest agent may list `lo`).
    let addressed: Vec<&Value> = guest
        .interfaces
        .iter()
        .filter(|i| i["ipAddress"].as_str().is_some_and(|ip| !ip.is_empty() && !ip.starts_with("127.")))
        .collect();
    assert!(addressed.is_empty(), "no network: {:?}", guest.interfaces);
    assert!(guest.interfaces.iter().all(|i| i["mac"] != "00:0c:29:aa:bb:08"), "{:?}", guest.interfaces);
    let vms: Api<DynamicObject> = Api::namespaced_with(m.client.clone(), &m.ns, &virtual_machine_resource());
    let vm = vms.get("app-bios-rehearsal").await.expect("the rehearsal VM");
    let template = &vm.data["spec"]["template"]["spec"];
    assert_eq!(template["domain"]["devices"]["autoattachPodInterface"], false, "{template}");
    // (virt-api drops the empty lists vmmigrate writes.)
    let empty = |v: &Value| v.is_null() || v == &json!([]);
    assert!(
        empty(&template["networks"]) && empty(&template["domain"]["devices"]["interfaces"]),
        "{template}"
    );
    let results: Vec<(&str, bool)> =
        status.validation_results.iter().map(|r| (r.name.as_str(), r.passed)).collect();
    assert_eq!(results, vec![("agent", true)]);
    assert_eq!(
        m.imported_sha256_of("app-bios-rehearsal", 1).await,
        m.source_sha256_at_start(),
        "the bytes in the PVC are the source's"
    );

    // The source: still running, byte for byte the same, never stopped.
    assert_eq!(m.emu.vm_power(m.vmid), "on");
    assert_eq!(m.emu.power_off_transitions(m.vmid), 0);
    assert_eq!(m.source_sha256_now(), m.source_sha256_at_start(), "the source disks were written");
    assert_eq!(vmx_of(&m), vmx_before, "the .vmx is as it was");
    assert_eq!(changing_calls(&m), vec!["snapshot.create", "snapshot.remove"]);

    delete_migration(&m).await;
}
