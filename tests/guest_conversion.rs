//! Guests shaped like guests that lived on ESXi (`tools/guest/vmware.sh`),
//! booted under plain QEMU (software emulation): they are what they claim
//! (they boot on VMware's hardware and their initramfs gives up on virtio).
//! Their conversion, by the controller on real KubeVirt, is
//! `migration_e2e::vmware_guests`.

use std::path::PathBuf;
use std::time::Duration;
use vmmigrate_harness::qemu_guest::{Boot, Hardware, QemuGuest};
use vmmigrate_harness::setup;

/// The MAC ESXi gave each guest's vmxnet3 NIC.
const MAC: &str = "00:0c:29:5e:6d:01";
/// initramfs-tools' words when it gives up on its root (`machine::console`
/// recognizes the same); the last comes last.
const GAVE_UP: [&str; 3] =
    ["Gave up waiting for root file system device", "does not exist.", "Dropping to a shell"];
/// Up to the guest's own service, under TCG on a busy 2-core machine.
const BOOT: Duration = Duration::from_secs(420);

struct Guest {
    name: &'static str,
    efi: bool,
    /// Its disks' bus on ESXi: `scsi` (PVSCSI) or `nvme`.
    bus: &'static str,
    disks: Vec<PathBuf>,
}

fn guests() -> Vec<Guest> {
    let dir = setup::vmware_guest_images().expect("the VMware-shaped guests (tools/guest/vmware.sh)");
    vec![
        Guest { name: "vmware-bios", efi: false, bus: "scsi", disks: vec![dir.join("vmware-bios.img")] },
        Guest {
            name: "vmware-uefi",
            efi: true,
            bus: "nvme",
            disks: vec![dir.join("vmware-uefi.img"), dir.join("vmware-uefi-data.img")],
        },
    ]
}

fn boot(guest: &Guest, disks: &[PathBuf], hardware: Hardware) -> QemuGuest {
    QemuGuest::boot(&Boot { name: guest.name, disks, efi: guest.efi, hardware, mac: MAC, memory_mib: 1024 })
        .expect("QEMU starts")
}

/// The guest's page: its ready line is printed just before its HTTP server
/// starts, so the first connections may be refused.
fn page(guest: &QemuGuest) -> String {
    let mut page = String::new();
    vmmigrate_harness::process::wait_until(Duration::from_secs(60), "the guest's page", || {
        page = guest.http_get("/").unwrap_or_default();
        Ok(!page.is_empty())
    })
    .unwrap();
    page
}

/// Waits for the guest's ready line and checks it and the page: its static
/// address on `ens192`, VMware Tools `tools` (`present` or `absent`), and
/// on a guest with a data disk, that disk mounted by UUID.
fn serves_its_page_on_ens192(guest: &Guest, qemu: &QemuGuest, tools: &str) {
    qemu.wait_for_console(&["vmmigrate-guest: ready"], BOOT).unwrap();
    // The serial line arrives a few bytes at a time under TCG: the whole line.
    let mut console = String::new();
    vmmigrate_harness::process::wait_until(Duration::from_secs(60), "the whole ready line", || {
        console = qemu.console();
        Ok(ready_line(&console).is_some())
    })
    .unwrap();
    let ready = ready_line(&console).unwrap();
    assert!(ready.contains("ens192=10.0.2.2/24") && ready.contains(&format!("tools={tools}")), "{ready}");
    let page = page(qemu);
    assert!(page.contains("nic ens192 10.0.2.2/24"), "{page}");
    assert!(page.contains(&format!("vmware-tools {tools}")), "{page}");
    if guest.disks.len() > 1 {
        assert!(page.contains("data vmmigrate-data-disk-"), "the data disk is mounted by UUID: {page}");
    }
}

/// The guest's ready line, once whole (ended by its newline):
/// `vmmigrate-guest: ready <host> ens192=<addr> tools=<..> data=<..>`.
fn ready_line(console: &str) -> Option<&str> {
    console
        .split_inclusive('\n')
        .find(|l| l.ends_with('\n') && l.contains("vmmigrate-guest: ready "))
        .map(str::trim)
}

/// Runs `check` for each guest on a thread of its own (QEMU under TCG uses
/// one core per guest) and fails with every guest's failure.
fn each_guest(check: fn(&Guest)) {
    let failures: Vec<String> = std::thread::scope(|scope| {
        let runs: Vec<_> = guests().into_iter().map(|g| (g.name, scope.spawn(move || check(&g)))).collect();
        runs.into_iter()
            .filter_map(|(name, run)| {
                run.join().err().map(|e| {
                    let message = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    format!("{name}: {message}")
                })
            })
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn vmware_shaped_guests_boot_on_vmware_disks_and_vmxnet3_and_give_up_on_virtio() {
    each_guest(|guest| {
        let hardware = if guest.bus == "nvme" { Hardware::VmwareNvme } else { Hardware::VmwarePvscsi };
        let on_vmware = boot(guest, &guest.disks, hardware);
        serves_its_page_on_ens192(guest, &on_vmware, "present");
        drop(on_vmware);

        let on_virtio = boot(guest, &guest.disks, Hardware::Virtio);
        on_virtio.wait_for_console(&GAVE_UP[2..], BOOT).unwrap();
        let console = on_virtio.console();
        assert!(ready_line(&console).is_none(), "it gave up, yet: {console}");
        for words in GAVE_UP {
            assert!(console.contains(words), "the initramfs says {words:?}: {console}");
        }
    });
}
