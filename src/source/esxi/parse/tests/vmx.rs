use super::*;
use crate::api::Firmware;

// ----- .vmx -----

#[test]
fn vmx_sample_facts() {
    let vmx = parse_vmx(VMX);
    assert_eq!(vmx.get("uuid.bios"), Some("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b"));
    assert_eq!(
        vmx_facts(&vmx),
        VmxFacts {
            display_name: "esx6.7-rhel8.6-nvme-disk".into(),
            guest_os: "rhel8-64".into(),
            memory_mib: 2048,
            num_cpus: 2,
            cores_per_socket: 1,
            firmware: Firmware::Efi,
            secure_boot: false,
            bios_uuid: "421b4b87-e6b7-d881-07a0-c9d221cd3c6b".into(),
            disks: vec![
                VmxDisk {
                    device: "scsi0:0".into(),
                    bus: "scsi".into(),
                    file_name: "Fedora-20.vmdk".into(),
                    mode: String::new(),
                    controller_model: "pvscsi".into(),
                },
                VmxDisk {
                    device: "nvme0:0".into(),
                    bus: "nvme".into(),
                    file_name: "nvme-disk.vmdk".into(),
                    mode: String::new(),
                    controller_model: String::new(),
                },
            ],
            nics: vec![VmxNic {
                device: "ethernet0".into(),
                model: "vmxnet3".into(),
                network: "VM Network".into(),
                mac_address: "00:50:56:9b:5f:0d".into(),
                pci_slot: Some(192),
            }],
            // Its installer ISO, connected at power-on, is not migrated.
            hardware: crate::api::SourceHardware {
                cdrom_images: vec![
                    "sata0:0: /vmfs/volumes/5458b680-…/ISOs/Fedora-20-x86_64-netinst.iso".into()
                ],
                ..Default::default()
            },
        }
    );
}

#[test]
fn vmx_handles_encoding_line_escapes_equals_and_garbage() {
    let text = ".encoding = \"UTF-8\"\n\
                    # a comment = \"no\"\n\
                    \n\
                    garbage without equals\n\
                    bad key = \"x\"\n\
                    annotation = \"say |22hi|22 |7C a=b |0Anext |zz |\"\n\
                    displayName = \"caf\u{e9} = bar\"\n\
                    unquoted = plain value\n\
                    dup = \"first\"\n\
                    DUP = \"second\"\n";
    let vmx = parse_vmx(text);
    assert_eq!(vmx.get(".encoding"), Some("UTF-8"));
    assert_eq!(vmx.get("annotation"), Some("say \"hi\" | a=b \nnext |zz |"));
    assert_eq!(vmx.get("DISPLAYNAME"), Some("caf\u{e9} = bar"));
    assert_eq!(vmx.get("unquoted"), Some("plain value"));
    assert_eq!(vmx.get("dup"), Some("second"));
    assert_eq!(vmx.get("bad key"), None);
    assert_eq!(vmx.entries.len(), 5, "{:?}", vmx.entries);
    assert!(vmx.entries.keys().all(|k| k == &k.to_ascii_lowercase()));
}

#[test]
fn vmx_booleans_are_case_insensitive() {
    let vmx = parse_vmx("a = \"TRUE\"\nb = \"true\"\nc = \"False\"\nd = \"FALSE\"\ne = \"maybe\"\n");
    assert_eq!(vmx.get_bool("A"), Some(true));
    assert_eq!(vmx.get_bool("b"), Some(true));
    assert_eq!(vmx.get_bool("c"), Some(false));
    assert_eq!(vmx.get_bool("d"), Some(false));
    assert_eq!(vmx.get_bool("e"), None);
    assert_eq!(vmx.get_bool("missing"), None);
}

#[test]
fn vmx_static_mac_is_used_and_lowercased_and_an_unassigned_pci_slot_is_none() {
    let vmx = parse_vmx(
        "ethernet1.present = \"TRUE\"\nethernet1.addressType = \"static\"\nethernet1.address = \"00:50:56:AA:BB:CC\"\nethernet1.generatedAddress = \"00:0c:29:00:00:01\"\nethernet1.networkName = \"Prod\"\nethernet1.pciSlotNumber = \"-1\"\n",
    );
    let nics = vmx_facts(&vmx).nics;
    assert_eq!(
        nics,
        vec![VmxNic {
            device: "ethernet1".into(),
            model: "e1000".into(),
            network: "Prod".into(),
            mac_address: "00:50:56:aa:bb:cc".into(),
            pci_slot: None,
        }]
    );
}

#[test]
fn vmx_absent_numvcpus_memsize_and_firmware_take_defaults() {
    let f = vmx_facts(&parse_vmx("displayName = \"tiny\"\ncpuid.coresPerSocket = \"0\"\n"));
    assert_eq!(f.num_cpus, 1);
    assert_eq!(f.cores_per_socket, 1);
    assert_eq!(f.memory_mib, 0);
    assert_eq!(f.firmware, Firmware::Bios);
    assert!(!f.secure_boot);
    assert_eq!(f.bios_uuid, "", "no uuid.bios");
    assert!(f.disks.is_empty() && f.nics.is_empty());
    for malformed in [
        "42 1b",
        "zz 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b",
        "42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b 00",
    ] {
        let f = vmx_facts(&parse_vmx(&format!("uuid.bios = \"{malformed}\"\n")));
        assert_eq!(f.bios_uuid, "", "{malformed}");
    }
    let f = vmx_facts(&parse_vmx(
        "numvcpus = \"8\"\ncpuid.coresPerSocket = \"4\"\nfirmware = \"EFI\"\nuefi.secureBoot.enabled = \"TRUE\"\n",
    ));
    assert_eq!((f.num_cpus, f.cores_per_socket, f.firmware, f.secure_boot), (8, 4, Firmware::Efi, true));
}

#[test]
fn vmx_cdroms_are_not_disks() {
    let vmx = parse_vmx(
        "ide1:0.present = \"TRUE\"\nide1:0.deviceType = \"atapi-cdrom\"\nide1:0.fileName = \"/vmfs/devices/cdrom/mpx.vmhba32:C0:T0:L0\"\n\
             sata0:1.deviceType = \"cdrom-raw\"\nsata0:1.fileName = \"auto detect\"\n\
             sata0:0.deviceType = \"cdrom-image\"\nsata0:0.fileName = \"/vmfs/volumes/ds/iso/x.iso\"\n\
             ide0:0.fileName = \"boot.vmdk\"\n",
    );
    let disks = vmx_facts(&vmx).disks;
    assert_eq!(disks.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["ide0:0"]);
}

#[test]
fn vmx_disks_ordered_scsi_sata_nvme_ide_then_numeric() {
    let vmx = parse_vmx(
        "ide0:1.fileName = \"i01.vmdk\"\nnvme0:0.fileName = \"n00.vmdk\"\nsata0:2.fileName = \"s02.vmdk\"\n\
             scsi10:0.fileName = \"c10-0.vmdk\"\nscsi2:0.fileName = \"c2-0.vmdk\"\nscsi0:10.fileName = \"c0-10.vmdk\"\n\
             scsi0:2.fileName = \"c0-2.vmdk\"\nscsi0:2.mode = \"independent-persistent\"\nscsi2.virtualDev = \"lsisas1068\"\n\
             scsi0.virtualDev = \"lsilogic\"\nsata0:0.fileName = \"s00.vmdk\"\nscsi0:x.fileName = \"bad.vmdk\"\n\
             ethernet10.virtualDev = \"e1000e\"\nethernet2.virtualDev = \"vmxnet3\"\n",
    );
    let f = vmx_facts(&vmx);
    let order: Vec<&str> = f.disks.iter().map(|d| d.device.as_str()).collect();
    assert_eq!(
        order,
        ["scsi0:2", "scsi0:10", "scsi2:0", "scsi10:0", "sata0:0", "sata0:2", "nvme0:0", "ide0:1"]
    );
    let first = f.disks.first().expect("disk");
    assert_eq!(
        (first.mode.as_str(), first.controller_model.as_str()),
        ("independent-persistent", "lsilogic")
    );
    assert_eq!(f.disks.get(2).map(|d| d.controller_model.as_str()), Some("lsisas1068"));
    assert_eq!(f.disks.get(3).map(|d| d.controller_model.as_str()), Some(""));
    assert_eq!(f.disks.get(4).map(|d| d.bus.as_str()), Some("sata"));
    let nics: Vec<(&str, &str)> = f.nics.iter().map(|n| (n.device.as_str(), n.model.as_str())).collect();
    assert_eq!(nics, [("ethernet2", "vmxnet3"), ("ethernet10", "e1000e")]);
}

#[test]
fn vmx_present_false_skips_disks_and_nics() {
    let vmx = parse_vmx(
        "scsi0:0.present = \"TRUE\"\nscsi0:0.fileName = \"a.vmdk\"\nscsi0:1.present = \"FALSE\"\nscsi0:1.fileName = \"b.vmdk\"\n\
             scsi1.present = \"false\"\nscsi1:0.fileName = \"c.vmdk\"\n\
             ethernet0.present = \"FALSE\"\nethernet0.virtualDev = \"vmxnet3\"\nethernet1.present = \"TRUE\"\n\
             ethernet1.generatedAddress = \"00:0C:29:AB:CD:EF\"\n",
    );
    let f = vmx_facts(&vmx);
    assert_eq!(f.disks.iter().map(|d| d.file_name.as_str()).collect::<Vec<_>>(), ["a.vmdk"]);
    assert_eq!(
        f.nics.iter().map(|n| (n.device.as_str(), n.mac_address.as_str())).collect::<Vec<_>>(),
        [("ethernet1", "00:0c:29:ab:cd:ef")]
    );
}

#[test]
fn vmx_hardware_names_what_a_kubevirt_vm_cannot_carry_and_skips_what_is_absent() {
    let text = r#"
vtpm.present = "TRUE"
encryption.keySafe = "vmware:key/list/(pair/(null/vmware%3akey%2ffqid))"
nvdimm0.present = "FALSE"
pciPassthru0.present = "TRUE"
pciPassthru0.id = "00000:059:00.0"
pciPassthru1.present = "TRUE"
pciPassthru1.vgpu = "grid_t4-2q"
pciPassthru2.present = "TRUE"
pciPassthru2.pfId = "00000:094:00.0"
pciPassthru3.present = "FALSE"
ethernet0.present = "TRUE"
ethernet0.virtualDev = "vmxnet3"
ethernet1.virtualDev = "sriov"
scsi0.present = "TRUE"
scsi0:0.fileName = "web.vmdk"
scsi0:1.fileName = "shared.vmdk"
scsi0:1.sharing = "multi-writer"
scsi1.present = "TRUE"
scsi1.sharedBus = "physical"
scsi2.present = "TRUE"
scsi2.sharedBus = "none"
scsi0:5.deviceType = "scsi-passthru"
ide1:0.present = "TRUE"
ide1:0.deviceType = "cdrom-image"
ide1:0.fileName = "/vmfs/volumes/ds1/iso/app.iso"
sata0:1.deviceType = "cdrom-image"
sata0:1.fileName = "/vmfs/volumes/ds1/iso/later.iso"
sata0:1.startConnected = "FALSE"
vcpu.hotadd = "TRUE"
mem.hotadd = "FALSE"
sched.cpu.affinity = "all"
numa.nodeAffinity = "0"
vhv.enable = "TRUE"
serial0.present = "TRUE"
serial0.fileType = "network"
serial1.present = "TRUE"
serial1.fileType = "thinprint"
floppy0.present = "TRUE"
floppy0.fileType = "file"
floppy0.fileName = "drivers.flp"
usb_xhci.present = "TRUE"
usb_xhci:4.present = "TRUE"
usb_xhci:4.deviceType = "hid"
usb_xhci:6.present = "TRUE"
usb_xhci:6.deviceType = "hub"
usb_xhci:7.present = "TRUE"
usb_xhci:7.deviceType = "pvscsi-dongle"
usb.present = "FALSE"
usb:1.present = "TRUE"
"#;
    let hw = vmx_facts(&parse_vmx(text)).hardware;
    assert!(hw.tpm && hw.encrypted && !hw.persistent_memory);
    assert_eq!(
        hw.passthrough,
        ["pciPassthru0", "pciPassthru1 (vGPU grid_t4-2q)", "scsi0:5 (SCSI passthrough)"]
    );
    assert_eq!(hw.sriov_nics, ["pciPassthru2", "ethernet1"]);
    assert_eq!(hw.shared_disks, ["scsi0:1 (multi-writer)", "scsi1 (bus sharing physical)"]);
    assert_eq!(hw.cdrom_images, ["ide1:0: /vmfs/volumes/ds1/iso/app.iso"], "a disconnected image is not");
    assert_eq!(hw.hot_plug, ["CPU hot-add"]);
    assert_eq!(hw.affinity, ["NUMA nodes 0"], "affinity \"all\" is the default, not an affinity");
    assert_eq!(hw.virtualization, ["nested hardware virtualization"]);
    assert_eq!(hw.ports, ["serial0 (serial port to a network)", "floppy0 (image drivers.flp)"]);
    assert_eq!(
        hw.usb_devices,
        ["usb_xhci:7 (pvscsi-dongle)"],
        "hubs, input devices and an absent controller's devices are not"
    );
}
