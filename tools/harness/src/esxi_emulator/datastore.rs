//! The emulated host's VMs and datastore: each VM's `.vmx`, its VMDK
//! descriptors and flat extents (patterned or a guest image), snapshot
//! chains and the power state files the scripts read.

use super::*;

pub(super) struct VmSpec {
    pub(super) id: &'static str,
    pub(super) name: String,
    /// Directory and file stem on the datastore (`/` in names becomes `%2f`).
    pub(super) dir: String,
    pub(super) guest_os: &'static str,
    pub(super) guest_id: &'static str,
    pub(super) guest_full: &'static str,
    pub(super) hw_version: u32,
    pub(super) memory_mb: u32,
    pub(super) cpus: Option<u32>,
    pub(super) efi: bool,
    /// `uefi.secureBoot.enabled` (with `efi`).
    pub(super) secure_boot: bool,
    pub(super) power_on: bool,
    pub(super) tools: &'static str,
    pub(super) hostname: &'static str,
    pub(super) ip: Option<&'static str>,
    pub(super) annotation: &'static str,
    pub(super) controllers: Vec<(&'static str, &'static str)>,
    pub(super) disks: Vec<DiskSpec>,
    pub(super) cdrom: Option<(&'static str, &'static str)>,
    pub(super) nics: Vec<NicSpec>,
    pub(super) snapshot: bool,
    pub(super) question: Option<&'static str>,
    /// The BIOS UUID's last three bytes, when the vmid's byte is not enough
    /// (a fleet VM: unique across emulators, as on real hosts).
    pub(super) uuid_tail: Option<[u8; 3]>,
}

impl VmSpec {
    /// `uuid.bios` as the .vmx writes it, and as vim-cmd prints it.
    pub(super) fn uuids(&self) -> (String, String) {
        let n: u32 = self.id.parse().expect("numeric vmid");
        match self.uuid_tail {
            Some([a, b, c]) => (
                format!("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 {a:02x} {b:02x} {c:02x}"),
                format!("421b4b87-e6b7-d881-07a0-c9d221{a:02x}{b:02x}{c:02x}"),
            ),
            None => (
                format!("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c {n:02x}"),
                format!("421b4b87-e6b7-d881-07a0-c9d221cd3c{n:02x}"),
            ),
        }
    }
}

pub(super) struct DiskSpec {
    pub(super) node: &'static str,
    /// Descriptor file name in the VM directory.
    pub(super) file: String,
    pub(super) size_mib: u64,
    pub(super) adapter: &'static str,
    pub(super) thin: bool,
    /// Write an absolute `/vmfs/volumes/datastore1/...` path into the .vmx.
    pub(super) absolute: bool,
    /// The flat file's bytes come from this image (its size, not `size_mib`).
    pub(super) image: Option<PathBuf>,
}

pub(super) struct NicSpec {
    pub(super) device: &'static str,
    pub(super) network: &'static str,
    pub(super) address_type: &'static str,
    pub(super) mac: &'static str,
    pub(super) ips: &'static [&'static str],
}

pub(super) fn disk(node: &'static str, file: &str, size_mib: u64, adapter: &'static str) -> DiskSpec {
    DiskSpec { node, file: file.to_owned(), size_mib, adapter, thin: false, absolute: false, image: None }
}

pub(super) fn vm_specs(opts: &EsxiOptions) -> Vec<VmSpec> {
    let hostile = "x'; rm -rf /; '";
    let hostile_dir = hostile.replace('/', "%2f");
    let mut vms = vec![
        VmSpec {
            id: "1",
            name: "web 01".into(),
            dir: "web 01".into(),
            guest_os: "ubuntu-64",
            guest_id: "ubuntu64Guest",
            guest_full: "Ubuntu Linux (64-bit)",
            hw_version: 21,
            memory_mb: 2048,
            cpus: Some(2),
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "running",
            hostname: "web01",
            ip: Some("192.168.10.21"),
            annotation: "Public web server",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "web 01.vmdk", 64, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:01",
                ips: &["192.168.10.21", "fe80::20c:29ff:feaa:bb01"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "2",
            name: "db-02".into(),
            dir: "db-02".into(),
            guest_os: "debian11-64",
            guest_id: "debian11_64Guest",
            guest_full: "Debian GNU/Linux 11 (64-bit)",
            hw_version: 21,
            memory_mb: 4096,
            cpus: Some(4),
            efi: true,
            secure_boot: false,
            power_on: true,
            tools: "running",
            hostname: "db-02.internal",
            ip: Some("10.0.0.12"),
            annotation: "PostgreSQL primary\nowner: dba team",
            controllers: vec![("scsi0", "pvscsi"), ("nvme0", ""), ("sata0", "")],
            disks: vec![
                disk("scsi0:0", "db-02.vmdk", 32, "lsilogic"),
                DiskSpec { absolute: true, ..disk("nvme0:0", "db-02_1.vmdk", 16, "lsilogic") },
            ],
            cdrom: Some(("sata0:0", "/vmfs/volumes/datastore1/ISOs/debian-12.5.0-amd64-netinst.iso")),
            nics: vec![
                NicSpec {
                    device: "vmxnet3",
                    network: "VM Network",
                    address_type: "vpx",
                    mac: "00:50:56:9b:5f:0d",
                    ips: &["10.0.0.12"],
                },
                NicSpec {
                    device: "e1000",
                    network: "DMZ",
                    address_type: "static",
                    mac: "00:50:56:01:02:03",
                    ips: &["172.16.5.12"],
                },
            ],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "3",
            name: "snap-vm".into(),
            dir: "snap-vm".into(),
            guest_os: "rhel8-64",
            guest_id: "rhel8_64Guest",
            guest_full: "Red Hat Enterprise Linux 8 (64-bit)",
            hw_version: 19,
            memory_mb: 1024,
            cpus: Some(1),
            efi: false,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "snap-vm",
            ip: Some("192.168.10.23"),
            annotation: "",
            controllers: vec![("scsi0", "lsilogic")],
            disks: vec![disk("scsi0:0", "snap-vm.vmdk", 16, "lsilogic")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:03",
                ips: &["192.168.10.23"],
            }],
            snapshot: true,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "4",
            name: "question-vm".into(),
            dir: "question-vm".into(),
            guest_os: "windows2019srv-64",
            guest_id: "windows2019srv_64Guest",
            guest_full: "Microsoft Windows Server 2019 (64-bit)",
            hw_version: 19,
            memory_mb: 1024,
            cpus: None,
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "notrunning",
            hostname: "question-vm",
            ip: None,
            annotation: "",
            controllers: vec![("sata0", "")],
            disks: vec![disk("sata0:0", "question-vm.vmdk", 8, "ide")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "e1000e",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:04",
                ips: &[],
            }],
            snapshot: false,
            question: Some(
                "Virtual machine message 12: msg.uuid.altered:This virtual machine may have been moved or copied.\n\
                 0. Cancel (Cancel) 1. I _moved it (I _moved it) 2. I _copied it (I _copied it) [default]",
            ),
            uuid_tail: None,
        },
        VmSpec {
            id: "5",
            name: hostile.into(),
            dir: hostile_dir.clone(),
            guest_os: "other4xlinux-64",
            guest_id: "other4xLinux64Guest",
            guest_full: "Other 4.x or later Linux (64-bit)",
            hw_version: 21,
            memory_mb: 512,
            cpus: Some(1),
            efi: false,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "hostile",
            ip: Some("192.168.10.25"),
            annotation: "",
            controllers: vec![("scsi0", "lsilogic")],
            disks: vec![disk("scsi0:0", &format!("{hostile_dir}.vmdk"), 8, "lsilogic")],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:05",
                ips: &["192.168.10.25"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
        VmSpec {
            id: "6",
            name: "no-tools".into(),
            dir: "no-tools".into(),
            guest_os: "centos7-64",
            guest_id: "centos7_64Guest",
            guest_full: "CentOS 7 (64-bit)",
            hw_version: 21,
            memory_mb: 1024,
            cpus: Some(2),
            efi: false,
            secure_boot: false,
            power_on: true,
            tools: "notinstalled",
            hostname: "no-tools",
            ip: None,
            annotation: "no VMware Tools",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "no-tools.vmdk", 8, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:06",
                ips: &[],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        },
    ];
    if let Some(images) = &opts.guests {
        let mut guests = guest_vms(images);
        if let Some(data) = &opts.guest_data_disk {
            let app_bios = guests.iter_mut().find(|vm| vm.id == "8").expect("app-bios");
            app_bios.disks.push(DiskSpec {
                image: Some(data.clone()),
                ..disk("scsi0:1", "app-bios_1.vmdk", 0, "lsilogic")
            });
        }
        vms.extend(guests);
    }
    if let Some(images) = &opts.vmware_guests {
        vms.extend(vmware_guest_vms(images));
    }
    if let Some((n, mib)) = opts.fleet {
        // Each emulator's fleet has BIOS UUIDs of its own.
        static HOSTS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
        let host = HOSTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        vms.extend((1..=n).map(|i| fleet_vm(host, i, mib)));
    }
    if let Some((first, second)) = opts.pair_disk_mib {
        let mut pair = fleet_vm(0, 0, first);
        pair.id = "12";
        pair.name = "pair".into();
        pair.dir = "pair".into();
        pair.hostname = "pair";
        pair.uuid_tail = None;
        pair.disks = vec![disk("scsi0:0", "pair.vmdk", first, "lsilogic")];
        if second > 0 {
            pair.disks.push(disk("scsi0:1", "pair_1.vmdk", second, "lsilogic"));
        }
        pair.nics[0].mac = "00:0c:29:aa:bb:0c";
        vms.push(pair);
    }
    if let Some(mib) = opts.big_disk_mib {
        vms.push(VmSpec {
            id: "7",
            name: "big".into(),
            dir: "big".into(),
            guest_os: "debian12-64",
            guest_id: "debian12_64Guest",
            guest_full: "Debian GNU/Linux 12 (64-bit)",
            hw_version: 21,
            memory_mb: 2048,
            cpus: Some(2),
            efi: true,
            secure_boot: false,
            power_on: false,
            tools: "running",
            hostname: "big",
            ip: Some("192.168.10.27"),
            annotation: "",
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![DiskSpec { thin: true, ..disk("scsi0:0", "big.vmdk", mib, "lsilogic") }],
            cdrom: None,
            nics: vec![NicSpec {
                device: "vmxnet3",
                network: "VM Network",
                address_type: "generated",
                mac: "00:0c:29:aa:bb:07",
                ips: &["192.168.10.27"],
            }],
            snapshot: false,
            question: None,
            uuid_tail: None,
        });
    }
    vms
}

/// VM `vm-<i>` of [`EsxiOptions::fleet`]. Its strings live as long as the
/// process (a few bytes per VM of a test's fleet).
pub(super) fn fleet_vm(host: u8, i: usize, mib: u64) -> VmSpec {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let name = format!("vm-{i:03}");
    VmSpec {
        id: leak(format!("{}", 100 + i)),
        name: name.clone(),
        dir: name.clone(),
        guest_os: "debian12-64",
        guest_id: "debian12_64Guest",
        guest_full: "Debian GNU/Linux 12 (64-bit)",
        hw_version: 21,
        memory_mb: 512,
        cpus: Some(1),
        efi: false,
        secure_boot: false,
        power_on: true,
        tools: "running",
        hostname: leak(name.clone()),
        ip: None,
        annotation: "",
        controllers: vec![("scsi0", "pvscsi")],
        disks: vec![disk("scsi0:0", &format!("{name}.vmdk"), mib, "lsilogic")],
        cdrom: None,
        nics: vec![NicSpec {
            device: "vmxnet3",
            network: "VM Network",
            address_type: "generated",
            mac: leak(format!("00:0c:29:f1:{:02x}:{:02x}", i / 256, i % 256)),
            ips: &[],
        }],
        snapshot: false,
        question: None,
        uuid_tail: Some([host, (i >> 8) as u8, i as u8]),
    }
}

/// The VMs of [`GUEST_VMS`], on the images in `images`.
pub(super) fn guest_vms(images: &Path) -> Vec<VmSpec> {
    let image = |node, file: &str, name: &str| DiskSpec {
        thin: true,
        image: Some(images.join(name)),
        ..disk(node, file, 0, "lsilogic")
    };
    let nic = |network, mac| NicSpec { device: "vmxnet3", network, address_type: "generated", mac, ips: &[] };
    let guest = |id, name: &'static str, efi, disks, nics| VmSpec {
        id,
        name: name.into(),
        dir: name.into(),
        guest_os: "debian12-64",
        guest_id: "debian12_64Guest",
        guest_full: "Debian GNU/Linux 12 (64-bit)",
        hw_version: 21,
        memory_mb: 256,
        cpus: Some(1),
        efi,
        secure_boot: false,
        power_on: true,
        tools: "running",
        hostname: name,
        ip: None,
        annotation: "",
        controllers: vec![("scsi0", "pvscsi")],
        disks,
        cdrom: None,
        nics,
        snapshot: false,
        question: None,
        uuid_tail: None,
    };
    vec![
        guest(
            "8",
            "app-bios",
            false,
            vec![image("scsi0:0", "app-bios.vmdk", "bios.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:08")],
        ),
        guest(
            "9",
            "app-efi",
            true,
            vec![image("scsi0:0", "app-efi.vmdk", "efi.img"), image("scsi0:1", "app-efi_1.vmdk", "data.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:09")],
        ),
        guest(
            "10",
            "no-os",
            false,
            vec![image("scsi0:0", "no-os.vmdk", "nodisk.img")],
            vec![nic("VM Network", "00:0c:29:aa:bb:10")],
        ),
        // Debian's signed shim and GRUB start the kernel under secure boot
        // only with 512 MiB or more (tools/guest/build.sh).
        VmSpec {
            secure_boot: true,
            memory_mb: 512,
            ..guest(
                "11",
                "app-secure",
                true,
                vec![image("scsi0:0", "app-secure.vmdk", "secureboot.img")],
                vec![nic("VM Network", "00:0c:29:aa:bb:11")],
            )
        },
    ]
}

/// [`super::VMWARE_GUEST_VMS`]: the guests of `tools/guest/vmware.sh` on the
/// hardware they were built for.
pub(super) fn vmware_guest_vms(images: &Path) -> Vec<VmSpec> {
    let image = |node, file: &str, name: &str, adapter| DiskSpec {
        thin: true,
        image: Some(images.join(name)),
        ..disk(node, file, 0, adapter)
    };
    let nic =
        |mac| NicSpec { device: "vmxnet3", network: "VM Network", address_type: "generated", mac, ips: &[] };
    let base = |id, name: &'static str| VmSpec {
        id,
        name: name.into(),
        dir: name.into(),
        guest_os: "debian12-64",
        guest_id: "debian12_64Guest",
        guest_full: "Debian GNU/Linux 12 (64-bit)",
        hw_version: 21,
        memory_mb: 1024,
        cpus: Some(1),
        efi: false,
        secure_boot: false,
        power_on: true,
        tools: "running",
        hostname: name,
        ip: Some("10.0.2.2"),
        annotation: "",
        controllers: vec![],
        disks: vec![],
        cdrom: None,
        nics: vec![],
        snapshot: false,
        question: None,
        uuid_tail: None,
    };
    vec![
        VmSpec {
            controllers: vec![("scsi0", "pvscsi")],
            disks: vec![image("scsi0:0", "vmware-bios.vmdk", "vmware-bios.img", "lsilogic")],
            nics: vec![nic("00:50:56:aa:bb:13")],
            ..base("13", "vmware-bios")
        },
        VmSpec {
            efi: true,
            controllers: vec![("nvme0", "")],
            disks: vec![
                image("nvme0:0", "vmware-uefi.vmdk", "vmware-uefi.img", "nvme"),
                image("nvme0:1", "vmware-uefi_1.vmdk", "vmware-uefi-data.img", "nvme"),
            ],
            nics: vec![nic("00:50:56:aa:bb:14")],
            ..base("14", "vmware-uefi")
        },
    ]
}

pub(super) fn stem(file: &str) -> &str {
    file.strip_suffix(".vmdk").unwrap_or(file)
}

pub(super) fn vmx_text(vm: &VmSpec) -> String {
    let n: u32 = vm.id.parse().expect("numeric vmid");
    let mut lines: Vec<(String, String)> = vec![
        (".encoding".into(), "UTF-8".into()),
        ("config.version".into(), "8".into()),
        ("virtualHW.version".into(), vm.hw_version.to_string()),
        ("displayName".into(), vm.name.clone()),
        ("guestOS".into(), vm.guest_os.into()),
        ("memSize".into(), vm.memory_mb.to_string()),
    ];
    if let Some(cpus) = vm.cpus {
        lines.push(("numvcpus".into(), cpus.to_string()));
    }
    if vm.efi {
        lines.push(("firmware".into(), "efi".into()));
        lines.push(("nvram".into(), format!("{}.nvram", vm.dir)));
        if vm.secure_boot {
            lines.push(("uefi.secureBoot.enabled".into(), "TRUE".into()));
        }
    }
    lines.push(("uuid.bios".into(), vm.uuids().0));
    lines.push(("vc.uuid".into(), format!("52 7a 10 93 5e 44 c1 0f-9a 61 0b 3d 7e 22 a4 {n:02x}")));
    if !vm.annotation.is_empty() {
        lines.push(("annotation".into(), vm.annotation.replace('\n', "|0A")));
    }
    lines.push(("tools.syncTime".into(), "FALSE".into()));
    for (ctrl, dev) in &vm.controllers {
        lines.push((format!("{ctrl}.present"), "TRUE".into()));
        if !dev.is_empty() {
            lines.push((format!("{ctrl}.virtualDev"), (*dev).into()));
        }
    }
    for d in &vm.disks {
        let file = if vm.snapshot { format!("{}-000001.vmdk", stem(&d.file)) } else { d.file.clone() };
        let file = if d.absolute { format!("/vmfs/volumes/datastore1/{}/{file}", vm.dir) } else { file };
        lines.push((format!("{}.present", d.node), "TRUE".into()));
        if d.node.starts_with("scsi") {
            lines.push((format!("{}.deviceType", d.node), "scsi-hardDisk".into()));
        }
        lines.push((format!("{}.fileName", d.node), file));
    }
    if let Some((node, iso)) = vm.cdrom {
        lines.push((format!("{node}.present"), "TRUE".into()));
        lines.push((format!("{node}.deviceType"), "cdrom-image".into()));
        lines.push((format!("{node}.fileName"), iso.into()));
    }
    for (i, nic) in vm.nics.iter().enumerate() {
        lines.push((format!("ethernet{i}.present"), "TRUE".into()));
        lines.push((format!("ethernet{i}.virtualDev"), nic.device.into()));
        lines.push((format!("ethernet{i}.networkName"), nic.network.into()));
        lines.push((format!("ethernet{i}.addressType"), nic.address_type.into()));
        let key = if nic.address_type == "static" { "address" } else { "generatedAddress" };
        lines.push((format!("ethernet{i}.{key}"), nic.mac.into()));
        // The slots ESXi gives a VM's NICs in order (hardware version 7 on):
        // a guest with predictable names calls them ens192, ens224, ...
        let slot = match i {
            0 => 192,
            1 => 224,
            2 => 256,
            n => 1184 + 32 * (n - 3),
        };
        lines.push((format!("ethernet{i}.pciSlotNumber"), slot.to_string()));
    }
    lines.push((
        "sched.swap.derivedName".into(),
        format!("/vmfs/volumes/{DATASTORE_UUID}/{}/{}.vswp", vm.dir, vm.dir),
    ));
    let mut text = String::new();
    for (k, v) in lines {
        text.push_str(&format!("{k} = \"{}\"\n", v.replace('"', "|22")));
    }
    text
}

pub(super) fn flat_descriptor(file_stem: &str, sectors: u64, adapter: &str, thin: bool, cid: u32) -> String {
    let cylinders = (sectors / (255 * 63)).max(1);
    format!(
        "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID={cid:08x}\nparentCID=ffffffff\n\
         createType=\"vmfs\"\n\n# Extent description\nRW {sectors} VMFS \"{file_stem}-flat.vmdk\"\n\n\
         # The Disk Data Base\n#DDB\n\nddb.adapterType = \"{adapter}\"\nddb.geometry.cylinders = \"{cylinders}\"\n\
         ddb.geometry.heads = \"255\"\nddb.geometry.sectors = \"63\"\nddb.longContentID = \"{cid:08x}5c2e9f0a1b3d4e6f{cid:08x}\"\n\
         {}ddb.uuid = \"60 00 C2 9a 3b 1c 5d 7e-8f 90 a1 b2 c3 d4 {:02x} {:02x}\"\nddb.virtualHWVersion = \"21\"\n",
        if thin { "ddb.thinProvisioned = \"1\"\n" } else { "" },
        cid >> 8 & 0xff,
        cid & 0xff,
    )
}

pub(super) fn delta_descriptor(file_stem: &str, parent: &str, sectors: u64, parent_cid: u32) -> String {
    format!(
        "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=fffffffe\nparentCID={parent_cid:08x}\n\
         createType=\"vmfsSparse\"\nparentFileNameHint=\"{parent}\"\n# Extent description\n\
         RW {sectors} VMFSSPARSE \"{file_stem}-delta.vmdk\"\n\n# The Disk Data Base\n#DDB\n\n\
         ddb.longContentID = \"0d8c4a2e71f35b96a4e1c7d2fffffffe\"\n"
    )
}

/// Builds `/vmfs/volumes/<uuid>` (+ the `datastore1` link) with every VM's
/// files; returns the flat disk files per vmid.
pub(super) fn build_datastore(
    root: &Path,
    vms: &[VmSpec],
) -> anyhow::Result<BTreeMap<String, Vec<DiskFile>>> {
    let volumes = root.join("vmfs/volumes");
    let store = volumes.join(DATASTORE_UUID);
    mkdir_mode(&volumes, 0o755)?;
    mkdir_mode(&store, 0o755)?;
    symlink(DATASTORE_UUID, volumes.join("datastore1"))?;
    mkdir_mode(&store.join("ISOs"), 0o755)?;
    write_mode(&store.join("ISOs/debian-12.5.0-amd64-netinst.iso"), &[0u8; 4096], 0o644)?;

    let mut disks: BTreeMap<String, Vec<DiskFile>> =
        vms.iter().map(|vm| (vm.id.to_owned(), Vec::new())).collect();
    for vm in vms {
        let vm_dir = store.join(&vm.dir);
        mkdir_mode(&vm_dir, 0o755)?;
        write_mode(&vm_dir.join(format!("{}.vmx", vm.dir)), vmx_text(vm).as_bytes(), 0o644)?;
        if vm.efi {
            write_mode(&vm_dir.join(format!("{}.nvram", vm.dir)), &[0x4e; 8192], 0o644)?;
        }
        for (i, d) in vm.disks.iter().enumerate() {
            let file_stem = stem(&d.file);
            let size = match &d.image {
                Some(image) => fs::metadata(image).with_context(|| image.display().to_string())?.len(),
                None => d.size_mib * MIB,
            };
            let cid = 0x3c5a_0000 | (vm.id.parse::<u32>()? << 8) | i as u32;
            write_mode(
                &vm_dir.join(&d.file),
                flat_descriptor(file_stem, size / 512, d.adapter, d.thin, cid).as_bytes(),
                0o644,
            )?;
            let flat = vm_dir.join(format!("{file_stem}-flat.vmdk"));
            let digest = match &d.image {
                Some(image) => copy_flat(image, &flat)?,
                None => write_flat(&flat, size, &format!("{}/{file_stem}", vm.dir))?,
            };
            let esxi_path = format!("/vmfs/volumes/datastore1/{}/{file_stem}-flat.vmdk", vm.dir);
            disks.get_mut(vm.id).expect("vm").push((esxi_path, flat, digest, size));
            if vm.snapshot {
                let delta_stem = format!("{file_stem}-000001");
                write_mode(
                    &vm_dir.join(format!("{delta_stem}.vmdk")),
                    delta_descriptor(&delta_stem, &d.file, size / 512, cid).as_bytes(),
                    0o644,
                )?;
                // Not a valid COWD extent: only the magic and a little data.
                let mut delta = b"COWD\x01\x00\x00\x00\x03\x00\x00\x00".to_vec();
                delta.resize(64 * 1024, 0);
                write_mode(&vm_dir.join(format!("{delta_stem}-delta.vmdk")), &delta, 0o644)?;
                write_mode(&vm_dir.join(format!("{}.vmsd", vm.dir)), vmsd_text(vm, d).as_bytes(), 0o644)?;
                write_mode(&vm_dir.join(format!("{}-Snapshot1.vmsn", vm.dir)), &[0x53; 4096], 0o644)?;
            }
        }
    }

    Ok(disks)
}

pub(super) fn vmsd_text(vm: &VmSpec, d: &DiskSpec) -> String {
    format!(
        ".encoding = \"UTF-8\"\nsnapshot.lastUID = \"1\"\nsnapshot.current = \"1\"\n\
         snapshot0.uid = \"1\"\nsnapshot0.filename = \"{dir}-Snapshot1.vmsn\"\n\
         snapshot0.displayName = \"before-upgrade\"\nsnapshot0.description = \"clean install|0Apackages held at 8.6\"\n\
         snapshot0.createTimeHigh = \"395823\"\nsnapshot0.createTimeLow = \"-1489273952\"\n\
         snapshot0.numDisks = \"1\"\nsnapshot0.disk0.fileName = \"{file}\"\nsnapshot0.disk0.node = \"{node}\"\n\
         snapshot.numSnapshots = \"1\"\n",
        dir = vm.dir,
        file = d.file,
        node = d.node,
    )
}

/// The 1 MiB block all disk data derives from: deterministic, no zero bytes.
pub(super) fn pattern_block() -> &'static [u8] {
    static BLOCK: OnceLock<Vec<u8>> = OnceLock::new();
    BLOCK.get_or_init(|| {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut block = Vec::with_capacity(MIB as usize);
        while block.len() < MIB as usize {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            block.extend(state.to_le_bytes().iter().map(|b| if *b == 0 { 0x5a } else { *b }));
        }
        block
    })
}

/// Block `i` of the disk labelled `label`, into `buf` (the block's length):
/// the pattern with a header naming the disk and the block, or zeros for the
/// blocks with `i % 4 == 2` (left unwritten, so they stay sparse).
pub(super) fn disk_block(label: &str, i: u64, buf: &mut [u8]) -> bool {
    if i % 4 == 2 {
        buf.fill(0);
        return false;
    }
    buf.copy_from_slice(&pattern_block()[..buf.len()]);
    let header = format!("vmmigrate ESXi emulator disk {label} block {i:08}\n");
    let n = header.len().min(buf.len());
    buf[..n].copy_from_slice(&header.as_bytes()[..n]);
    true
}

/// Copies a guest image into place as a flat disk (holes stay holes) and
/// returns its sha256.
pub(super) fn copy_flat(image: &Path, path: &Path) -> anyhow::Result<String> {
    let status = Command::new("cp").arg("--sparse=always").arg(image).arg(path).status()?;
    ensure!(status.success(), "cp {} {} failed", image.display(), path.display());
    set_mode(path, 0o644)?;
    let out = Command::new("sha256sum").arg(path).output()?;
    ensure!(out.status.success(), "sha256sum {} failed", path.display());
    let text = String::from_utf8(out.stdout)?;
    Ok(text.split_whitespace().next().unwrap_or_default().to_owned())
}

/// Creates a raw disk with `qemu-img create -f raw`, fills it block by block
/// (see `disk_block`) and returns its sha256. The digest is computed by
/// `openssl dgst` (fast) from the same generator, on a second thread while the
/// file is written, and cached per (label, size) within the process.
pub(super) fn write_flat(path: &Path, size: u64, label: &str) -> anyhow::Result<String> {
    static DIGESTS: OnceLock<Mutex<HashMap<(String, u64), String>>> = OnceLock::new();
    let digests = DIGESTS.get_or_init(Default::default);
    let key = (label.to_owned(), size);
    let cached = digests.lock().expect("digest cache").get(&key).cloned();

    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "raw"])
        .arg(path)
        .arg(size.to_string())
        .status()?;
    ensure!(status.success(), "qemu-img create {} failed", path.display());
    let digest = std::thread::scope(|scope| -> anyhow::Result<String> {
        let hasher = cached.is_none().then(|| scope.spawn(|| hash_disk(size, label)));
        let file = fs::OpenOptions::new().write(true).open(path)?;
        let mut buf = vec![0u8; MIB as usize];
        for i in 0..size.div_ceil(MIB) {
            let len = (size - i * MIB).min(MIB) as usize;
            if disk_block(label, i, &mut buf[..len]) {
                file.write_all_at(&buf[..len], i * MIB)?;
            }
        }
        match hasher {
            Some(hasher) => hasher.join().map_err(|_| anyhow::anyhow!("the hashing thread panicked"))?,
            None => Ok(cached.clone().expect("cached digest")),
        }
    })?;
    digests.lock().expect("digest cache").insert(key, digest.clone());
    set_mode(path, 0o644)?;
    Ok(digest)
}

pub(super) fn hash_disk(size: u64, label: &str) -> anyhow::Result<String> {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-r"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("openssl")?;
    let mut stdin = child.stdin.take().expect("stdin");
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..size.div_ceil(MIB) {
        let len = (size - i * MIB).min(MIB) as usize;
        disk_block(label, i, &mut buf[..len]);
        stdin.write_all(&buf[..len])?;
    }
    drop(stdin);
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "openssl dgst failed");
    let digest = String::from_utf8(out.stdout)?.split_whitespace().next().unwrap_or_default().to_owned();
    ensure!(digest.len() == 64, "unexpected openssl dgst output {digest:?}");
    Ok(digest)
}

/// The state vim-cmd works on (see the header of `tools/esxi-emulator/vim-cmd`).
pub(super) fn write_state(
    root: &Path,
    uid: u32,
    gid: u32,
    vms: &[VmSpec],
    disks: &BTreeMap<String, Vec<DiskFile>>,
) -> anyhow::Result<()> {
    let st = root.join("var/lib/esxi-emu");
    let put = |rel: &str, value: &str| -> anyhow::Result<()> {
        let value =
            if value.is_empty() || value.ends_with('\n') { value.to_owned() } else { format!("{value}\n") };
        put_user_file(&st.join(rel), &value, uid, gid)
    };
    put("invalid", "99")?;
    put("shutdown_hangs", "0")?;
    put("shutdown_getstate_calls", &DEFAULT_SHUTDOWN_GETSTATE_CALLS.to_string())?;
    for vm in vms {
        let dir = st.join("vms").join(vm.id);
        mkdir_mode(&dir, 0o755)?;
        chown(&dir, Some(uid), Some(gid))?;
        let n: u32 = vm.id.parse()?;
        let committed: u64 = disks[vm.id].iter().map(|d| d.3).sum();
        let f = |name: &str, value: &str| put(&format!("vms/{}/{name}", vm.id), value);
        f("name", &vm.name)?;
        f("vmx", &format!("[datastore1] {}/{}.vmx", vm.dir, vm.dir))?;
        f("guest_id", vm.guest_id)?;
        f("guest_full", vm.guest_full)?;
        f("version", &format!("vmx-{}", vm.hw_version))?;
        f("annotation", vm.annotation)?;
        f("memory_mb", &vm.memory_mb.to_string())?;
        f("cpus", &vm.cpus.unwrap_or(1).to_string())?;
        f("uuid", &vm.uuids().1)?;
        f("instance_uuid", &format!("527a1093-5e44-c10f-9a61-0b3d7e22a4{n:02x}"))?;
        f("hostname", vm.hostname)?;
        f("ip", vm.ip.unwrap_or(""))?;
        let nics: String = vm
            .nics
            .iter()
            .map(|nic| format!("{}\t{}\t{}\n", nic.network, nic.mac, nic.ips.join(",")))
            .collect();
        f("nics", &nics)?;
        f("num_disks", &vm.disks.len().to_string())?;
        f("committed", &committed.to_string())?;
        f("uncommitted", "0")?;
        f("power", if vm.power_on { "on" } else { "off" })?;
        f("tools", vm.tools)?;
        f("poweroffs", "0")?;
        if let Some(q) = vm.question {
            f("question", q)?;
        }
        if vm.snapshot {
            f(
                "snapshots",
                "|-ROOT\n--Snapshot Name        : before-upgrade\n--Snapshot Id        : 1\n\
                 --Snapshot Desciption  : clean install\npackages held at 8.6\n\
                 --Snapshot Created On  : 3/4/2024 9:5:7\n--Snapshot State       : powered off",
            )?;
        }
    }
    Ok(())
}
