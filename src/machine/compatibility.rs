//! What the source VM's hardware means for its move, as its `.vmx` shows it
//! (`SourceHardware`, the guest OS): what stops a migration at Validated and
//! what moves with a caveat. The rules follow what Forklift's VMware
//! policies check, decided for a copy over SSH (docs/compatibility.md has
//! each with its reason). Pure.

use super::observe::GuestConverterFacts;
use crate::api::{Blocker, GuestConversionMode, Reason, SourceInventory};

/// The hardware's findings: what blocks, and what is not carried.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Findings {
    pub(crate) blockers: Vec<Blocker>,
    pub(crate) warnings: Vec<Blocker>,
}

fn finding(reason: Reason, message: String) -> Blocker {
    Blocker { reason: reason.to_string(), message }
}

fn names(list: &[String]) -> String {
    list.join(", ")
}

/// Every finding of the inventory's hardware and guest OS, in a stable order;
/// `spec` says whether the guest is converted.
pub(crate) fn findings(
    spec: &crate::api::VirtualMachineMigrationSpec,
    inventory: &SourceInventory,
) -> Findings {
    let hw = &inventory.hardware;
    let mut out = Findings::default();
    let mut block = |reason, message| out.blockers.push(finding(reason, message));
    if !hw.passthrough.is_empty() {
        block(
            Reason::PassthroughDevice,
            format!(
                "the VM has passthrough devices ({}): the host's hardware cannot follow it; remove them on the host, then retry",
                names(&hw.passthrough)
            ),
        );
    }
    if !hw.shared_disks.is_empty() {
        block(
            Reason::SharedDisk,
            format!(
                "the VM shares disks with other VMs ({}): a clustered disk moves with all its VMs at once, which vmmigrate does not do; unshare them, then retry",
                names(&hw.shared_disks)
            ),
        );
    }
    if hw.encrypted {
        block(
            Reason::EncryptedVM,
            "the VM is encrypted (encryption.keySafe in its .vmx): its disk files hold ciphertext only the key server can open; decrypt the VM on the host, then retry".to_owned(),
        );
    }
    if hw.persistent_memory {
        block(
            Reason::PersistentMemory,
            "the VM has persistent memory (nvdimm0): its data is not in a virtual disk; move it to a disk, then retry".to_owned(),
        );
    }
    let mut warn = |reason, message| out.warnings.push(finding(reason, message));
    if hw.tpm {
        warn(
            Reason::TpmNotMigrated,
            "the VM has a virtual TPM: its keys stay behind, so BitLocker asks for its recovery key and a TPM-sealed LUKS volume for its passphrase".to_owned(),
        );
    }
    let lists = [
        (
            Reason::SriovNicNotMigrated,
            &hw.sriov_nics,
            "SR-IOV network adapters are not migrated; add an SR-IOV interface to the new VM",
        ),
        (
            Reason::CdromImageNotMigrated,
            &hw.cdrom_images,
            "CD-ROM images are not migrated; the new VM has no CD-ROM",
        ),
        (Reason::UsbDeviceNotMigrated, &hw.usb_devices, "USB devices are not migrated"),
        (
            Reason::HotPlugNotCarried,
            &hw.hot_plug,
            "hot-plug is not carried over; set the new VM's maximum sockets or memory to hot-plug there",
        ),
        (
            Reason::AffinityNotCarried,
            &hw.affinity,
            "affinity is not carried over; the new VM runs where the scheduler puts it",
        ),
        (
            Reason::NestedVirtualization,
            &hw.virtualization,
            "these need nested virtualization on the nodes; the new VM does not ask for it",
        ),
        (
            Reason::PortNotMigrated,
            &hw.ports,
            "serial, parallel and floppy backings are not migrated; the new VM has a serial console only",
        ),
    ];
    for (reason, list, what) in lists {
        if !list.is_empty() {
            warn(reason, format!("{what}: {}", names(list)));
        }
    }
    let plan = guest_plan(spec, inventory);
    if plan.emulated_devices {
        warn(
            Reason::WindowsWithoutVirtio,
            format!(
                "guest OS {:?} has no virtio drivers and is not converted: its disks go on SATA and its NICs become e1000e, which are slower; set spec.conversion.guest to auto or virtV2v to install virtio drivers (virt-v2v needs virtio-win for that)",
                inventory.guest_os
            ),
        );
    }
    if let Some(family) = not_convertible(&inventory.guest_os) {
        let message = format!(
            "guest OS {:?} ({family}) is not one virt-v2v converts: it moves as it is, with no virtio drivers added",
            inventory.guest_os
        );
        if spec.conversion.guest == GuestConversionMode::VirtV2v {
            out.blockers.push(finding(
                Reason::GuestOSNotConvertible,
                format!("{message}; spec.conversion.guest is virtV2v, so it cannot move (set guest: none to move it as it is)"),
            ));
        } else {
            out.warnings.push(finding(Reason::GuestOSNotConvertible, message));
        }
    }
    out
}

/// A Windows guest (the `.vmx`'s `guestOS` `windows…`, `win…`, `longhorn…`,
/// or the vim guest id): it has no virtio drivers of its own.
pub(crate) fn is_windows(guest_os: &str) -> bool {
    let os = guest_os.to_ascii_lowercase();
    os.starts_with("win") || os.starts_with("longhorn")
}

/// What happens to the guest itself, decided from `spec.conversion.guest`
/// and the guest OS alone (so every reconcile, the render and the plan
/// comment agree): converted with virt-v2v, or moved as it is, on emulated
/// devices where it has no virtio drivers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GuestPlan {
    /// virt-v2v converts the guest over all of its disks at once.
    pub(crate) convert: bool,
    /// Moved as it is with no virtio drivers of its own: SATA disks and
    /// e1000e NICs (a Windows guest that is not converted).
    pub(crate) emulated_devices: bool,
    /// Why, in a sentence for the plan comment and the status.
    pub(crate) why: String,
}

/// Whether the migration's guest is converted whole: its plan, once
/// discovery has recorded the inventory (before that, nothing converts it).
pub(crate) fn converts_guest(
    spec: &crate::api::VirtualMachineMigrationSpec,
    status: Option<&crate::api::VirtualMachineMigrationStatus>,
) -> bool {
    status
        .and_then(|s| s.source_inventory.as_ref())
        .is_some_and(|inventory| guest_plan(spec, inventory).convert)
}

/// The guest's [`GuestPlan`].
pub(crate) fn guest_plan(
    spec: &crate::api::VirtualMachineMigrationSpec,
    inventory: &SourceInventory,
) -> GuestPlan {
    let os = &inventory.guest_os;
    let windows = is_windows(os);
    let (convert, why) = match spec.conversion.guest {
        GuestConversionMode::None => {
            (false, "spec.conversion.guest is none: the disks move as they are".to_owned())
        }
        GuestConversionMode::VirtV2v => (true, "spec.conversion.guest is virtV2v".to_owned()),
        GuestConversionMode::Auto => match not_convertible(os) {
            Some(family) => {
                (false, format!("guest OS {os:?} ({family}) is not one virt-v2v converts: it moves as it is"))
            }
            None if !is_known(os) => (
                false,
                format!(
                    "guest OS {os:?} is not one virt-v2v is known to convert (set spec.conversion.guest: virtV2v to try): it moves as it is"
                ),
            ),
            None if windows => (
                true,
                format!(
                    "guest OS {os:?} has no virtio drivers: virt-v2v installs them (from virtio-win) and removes VMware Tools"
                ),
            ),
            None => (
                true,
                format!(
                    "guest OS {os:?} was installed on VMware hardware, so its initramfs may hold no virtio drivers: virt-v2v adds them, removes VMware Tools, and its NICs keep their names"
                ),
            ),
        },
    };
    GuestPlan { convert, emulated_devices: !convert && windows, why }
}

/// The guest OS families virt-v2v converts (the `.vmx`'s `guestOS` or the
/// vim guest id): Windows and the Linux distributions it inspects.
fn is_known(guest_os: &str) -> bool {
    let os = guest_os.to_ascii_lowercase();
    const LINUX: &[&str] = &[
        "rhel",
        "centos",
        "oracle",
        "almalinux",
        "rocky",
        "fedora",
        "sles",
        "suse",
        "opensuse",
        "debian",
        "ubuntu",
        "asianux",
        "mandr",
        "other3xlinux",
        "other4xlinux",
        "other5xlinux",
        "other6xlinux",
        "other26xlinux",
        "otherlinux",
        "amazonlinux",
        "linux",
    ];
    is_windows(&os) || LINUX.iter().any(|family| os.starts_with(family))
}

/// What stops a guest the plan converts at Validated, before anything is
/// powered off: no virt-v2v, a Windows guest and no virtio-win, or a UEFI
/// guest and no OVMF (virt-v2v converts it, then stops at its last step).
pub(crate) fn converter_blockers(
    spec: &crate::api::VirtualMachineMigrationSpec,
    inventory: &SourceInventory,
    facts: GuestConverterFacts,
) -> Vec<Blocker> {
    let plan = guest_plan(spec, inventory);
    let mut out = Vec::new();
    if !plan.convert {
        return out;
    }
    if !facts.virt_v2v {
        out.push(finding(
            Reason::VirtV2vNotInstalled,
            format!(
                "the guest is to be converted ({}) but virt-v2v is not installed where conversions run; install it (with guestfish) in the conversion image, or set spec.conversion.guest: none to move the disks as they are",
                plan.why
            ),
        ));
    }
    if is_windows(&inventory.guest_os) && !facts.virtio_win {
        out.push(finding(
            Reason::VirtioWinMissing,
            format!(
                "guest OS {:?} is Windows: virt-v2v installs its virtio drivers from virtio-win (/usr/share/virtio-win), which is not installed where conversions run; install it, or set spec.conversion.guest: none (its disks then go on SATA and its NICs become e1000e)",
                inventory.guest_os
            ),
        ));
    }
    if inventory.firmware == crate::api::Firmware::Efi && !facts.uefi_firmware {
        out.push(finding(
            Reason::UefiFirmwareMissing,
            "the guest boots with UEFI: virt-v2v describes a UEFI guest's output with OVMF's firmware files (/usr/share/OVMF), which are not installed where conversions run, and would stop after converting; install OVMF (Debian's ovmf package) in the conversion image, or set spec.conversion.guest: none".to_owned(),
        ));
    }
    out
}

/// The family of a guest OS (the `.vmx`'s `guestOS`, or the vim guest id)
/// that virt-v2v 2.x cannot convert; `None` for the Linux families and
/// Windows versions it converts, and for an unknown or empty one.
pub(crate) fn not_convertible(guest_os: &str) -> Option<&'static str> {
    let os = guest_os.to_ascii_lowercase();
    const FAMILIES: &[(&str, &str)] = &[
        ("freebsd", "FreeBSD"),
        ("solaris", "Solaris"),
        ("darwin", "macOS"),
        ("netware", "NetWare"),
        ("vmkernel", "ESXi"),
        ("vmware-photon", "Photon OS"),
        ("vmwarephoton", "Photon OS"),
        ("coreos", "CoreOS"),
        ("dos", "DOS"),
        ("os2", "OS/2"),
        ("ecomstation", "eComStation"),
        ("openserver", "OpenServer"),
        ("unixware", "UnixWare"),
        ("win31", "Windows 3.1"),
        ("win95", "Windows 95"),
        ("win98", "Windows 98"),
        ("winme", "Windows Me"),
        ("winnt", "Windows NT"),
        ("win2000", "Windows 2000"),
    ];
    FAMILIES.iter().find(|(prefix, _)| os.starts_with(prefix)).map(|(_, family)| *family)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SourceHardware;

    fn cold() -> crate::api::VirtualMachineMigrationSpec {
        crate::api::test_migration().spec
    }

    fn inventory(hardware: SourceHardware, guest_os: &str) -> SourceInventory {
        SourceInventory { hardware, guest_os: guest_os.into(), ..Default::default() }
    }

    fn reasons(list: &[Blocker]) -> Vec<&str> {
        list.iter().map(|b| b.reason.as_str()).collect()
    }

    #[test]
    fn a_plain_vm_has_no_findings() {
        assert_eq!(
            findings(&cold(), &inventory(SourceHardware::default(), "debian12-64")),
            Findings::default()
        );
    }

    #[test]
    fn passthrough_shared_disks_encryption_and_persistent_memory_block_and_name_their_devices() {
        let hw = SourceHardware {
            passthrough: vec!["pciPassthru0 (vGPU grid_t4-2q)".into()],
            shared_disks: vec!["scsi1:0 (multi-writer)".into()],
            encrypted: true,
            persistent_memory: true,
            ..Default::default()
        };
        let f = findings(&cold(), &inventory(hw, "rhel8-64"));
        assert_eq!(
            reasons(&f.blockers),
            ["PassthroughDevice", "SharedDisk", "EncryptedVM", "PersistentMemory"]
        );
        assert!(f.blockers[0].message.contains("pciPassthru0 (vGPU grid_t4-2q)"));
        assert!(f.blockers[1].message.contains("scsi1:0 (multi-writer)"));
        assert!(f.warnings.is_empty());
    }

    #[test]
    fn what_moves_with_a_caveat_is_a_warning_naming_what_stays_behind() {
        let hw = SourceHardware {
            tpm: true,
            sriov_nics: vec!["pciPassthru1".into()],
            cdrom_images: vec!["ide1:0: /vmfs/volumes/ds1/iso/app.iso".into()],
            usb_devices: vec!["usb:1 (dongle)".into()],
            hot_plug: vec!["CPU hot-add".into()],
            affinity: vec!["CPUs 0,2".into()],
            virtualization: vec!["nested hardware virtualization".into()],
            ports: vec!["serial0 (serial port to a network)".into()],
            ..Default::default()
        };
        let f = findings(&cold(), &inventory(hw, "rhel8-64"));
        assert!(f.blockers.is_empty(), "{:?}", f.blockers);
        assert_eq!(
            reasons(&f.warnings),
            [
                "TpmNotMigrated",
                "SriovNicNotMigrated",
                "CdromImageNotMigrated",
                "UsbDeviceNotMigrated",
                "HotPlugNotCarried",
                "AffinityNotCarried",
                "NestedVirtualization",
                "PortNotMigrated"
            ]
        );
        assert!(f.warnings[2].message.contains("app.iso"));
    }

    #[test]
    fn guests_virt_v2v_cannot_convert_are_named_and_the_ones_it_converts_are_not() {
        for os in ["freeBSD12-64", "solaris11-64", "darwin19-64", "vmware-photon-64", "win98", "winNT"] {
            let f = findings(&cold(), &inventory(SourceHardware::default(), os));
            assert_eq!(reasons(&f.warnings).last(), Some(&"GuestOSNotConvertible"), "{os}");
            assert!(f.blockers.is_empty(), "{os}");
        }
        for os in [
            "rhel9-64",
            "debian11-64",
            "ubuntu-64",
            "sles15-64",
            "windows9srv-64",
            "windows11-64",
            "winXPPro",
            "",
        ] {
            assert_eq!(not_convertible(os), None, "{os}");
        }
    }

    #[test]
    fn a_windows_guest_moved_as_it_is_gets_sata_and_e1000e_and_is_told_why() {
        for os in
            ["windows2019srv-64", "windows9-64", "winNetEnterprise", "longhorn-64", "windows9Server64Guest"]
        {
            assert!(is_windows(os), "{os}");
        }
        for os in ["rhel9-64", "debian12-64", "freeBSD13-64", ""] {
            assert!(!is_windows(os), "{os}");
        }
        let mut spec = cold();
        spec.conversion.guest = GuestConversionMode::None;
        let windows = inventory(SourceHardware::default(), "windows2019srv-64");
        let f = findings(&spec, &windows);
        assert_eq!(reasons(&f.warnings), ["WindowsWithoutVirtio"]);
        assert!(f.warnings[0].message.contains("SATA") && f.warnings[0].message.contains("virtio-win"));
        assert!(guest_plan(&spec, &windows).emulated_devices);
        for mode in [GuestConversionMode::Auto, GuestConversionMode::VirtV2v] {
            spec.conversion.guest = mode;
            let plan = guest_plan(&spec, &windows);
            assert!(plan.convert && !plan.emulated_devices, "{mode:?}: virt-v2v installs virtio drivers");
            assert!(findings(&spec, &windows).warnings.is_empty(), "{mode:?}");
        }
    }

    #[test]
    fn auto_converts_the_linux_and_windows_guests_virt_v2v_knows_and_moves_the_rest_as_they_are() {
        let spec = cold();
        assert_eq!(spec.conversion.guest, GuestConversionMode::Auto, "auto is the default");
        for os in ["debian12-64", "rhel9-64", "ubuntu-64", "sles15-64", "otherLinux64", "windows2019srv-64"] {
            let plan = guest_plan(&spec, &inventory(SourceHardware::default(), os));
            assert!(plan.convert, "{os}");
            assert!(plan.why.contains(os), "{os}: {}", plan.why);
        }
        for os in ["freeBSD13-64", "solaris11-64", "other-64", ""] {
            let plan = guest_plan(&spec, &inventory(SourceHardware::default(), os));
            assert!(!plan.convert && !plan.emulated_devices, "{os}");
            assert!(plan.why.contains("moves as it is"), "{os}: {}", plan.why);
        }
    }

    #[test]
    fn virt_v2v_asked_for_a_guest_it_cannot_convert_blocks_and_none_moves_it_with_a_warning() {
        let mut spec = cold();
        let bsd = inventory(SourceHardware::default(), "freeBSD13-64");
        spec.conversion.guest = GuestConversionMode::VirtV2v;
        let f = findings(&spec, &bsd);
        assert_eq!(reasons(&f.blockers), ["GuestOSNotConvertible"]);
        assert!(f.blockers[0].message.contains("guest: none"), "{}", f.blockers[0].message);
        spec.conversion.guest = GuestConversionMode::None;
        let f = findings(&spec, &bsd);
        assert!(f.blockers.is_empty());
        assert_eq!(reasons(&f.warnings), ["GuestOSNotConvertible"]);
    }

    #[test]
    fn a_guest_to_convert_is_blocked_without_virt_v2v_and_a_windows_one_without_virtio_win() {
        let spec = cold();
        let all = GuestConverterFacts { virt_v2v: true, virtio_win: true, uefi_firmware: true };
        let linux = inventory(SourceHardware::default(), "debian12-64");
        let windows = inventory(SourceHardware::default(), "windows2019srv-64");
        assert!(converter_blockers(&spec, &linux, all).is_empty());
        assert!(converter_blockers(&spec, &windows, all).is_empty());
        let no_v2v = GuestConverterFacts { virt_v2v: false, ..all };
        let b = converter_blockers(&spec, &linux, no_v2v);
        assert_eq!(reasons(&b), ["VirtV2vNotInstalled"]);
        assert!(b[0].message.contains("guest: none"), "{}", b[0].message);
        let no_virtio_win = GuestConverterFacts { virtio_win: false, ..all };
        assert!(converter_blockers(&spec, &linux, no_virtio_win).is_empty(), "Linux needs no virtio-win");
        let b = converter_blockers(&spec, &windows, no_virtio_win);
        assert_eq!(reasons(&b), ["VirtioWinMissing"]);
        assert!(b[0].message.contains("/usr/share/virtio-win") && b[0].message.contains("SATA"));
        let mut none = cold();
        none.conversion.guest = GuestConversionMode::None;
        assert!(
            converter_blockers(&none, &windows, GuestConverterFacts::default()).is_empty(),
            "a guest moved as it is needs no converter"
        );
    }

    #[test]
    fn a_uefi_guest_to_convert_is_blocked_without_ovmf_and_a_bios_one_is_not() {
        let spec = cold();
        let all = GuestConverterFacts { virt_v2v: true, virtio_win: true, uefi_firmware: true };
        let no_ovmf = GuestConverterFacts { uefi_firmware: false, ..all };
        let bios = inventory(SourceHardware::default(), "debian12-64");
        let uefi = SourceInventory { firmware: crate::api::Firmware::Efi, ..bios.clone() };
        assert!(converter_blockers(&spec, &uefi, all).is_empty());
        assert!(converter_blockers(&spec, &bios, no_ovmf).is_empty(), "BIOS guests need no OVMF");
        let b = converter_blockers(&spec, &uefi, no_ovmf);
        assert_eq!(reasons(&b), ["UefiFirmwareMissing"]);
        assert!(b[0].message.contains("ovmf") && b[0].message.contains("guest: none"), "{}", b[0].message);
        let mut none = cold();
        none.conversion.guest = GuestConversionMode::None;
        assert!(converter_blockers(&none, &uefi, no_ovmf).is_empty(), "moved as it is, nothing converts it");
    }
}
