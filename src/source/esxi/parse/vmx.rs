//! `.vmx` files: [`parse_vmx`] and the [`VmxFacts`] the migration needs.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::Firmware;

use super::vim_cmd::ends_with_ignore_ascii_case;

/// A parsed `.vmx` file: keys lowercased, values unquoted and `|XX`-decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Vmx {
    pub entries: BTreeMap<String, String>,
}

impl Vmx {
    /// Case-insensitive lookup.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.entries.get(&key.to_ascii_lowercase()).map(String::as_str)
    }

    /// `TRUE`/`true`/`yes`/`1` and `FALSE`/`false`/`no`/`0`, case-insensitive;
    /// `None` if absent or anything else.
    pub(crate) fn get_bool(&self, key: &str) -> Option<bool> {
        let v = self.get(key)?.trim();
        if ["true", "yes", "on", "1"].iter().any(|t| v.eq_ignore_ascii_case(t)) {
            Some(true)
        } else if ["false", "no", "off", "0"].iter().any(|f| v.eq_ignore_ascii_case(f)) {
            Some(false)
        } else {
            None
        }
    }
}

/// Parses a `.vmx` (or `.vmsd`) file: `key = "value"` lines. Comments, blank
/// and garbage lines are ignored; the last occurrence of a key wins; values may
/// contain `=`; VMware's `|XX` hex escapes (e.g. `|22` for `"`) are decoded.
pub(crate) fn parse_vmx(text: &str) -> Vmx {
    let mut entries = BTreeMap::new();
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        let key = k.trim();
        if key.is_empty() || key.contains(|c: char| c.is_whitespace() || c == '"') {
            continue;
        }
        let v = v.trim();
        let value = match v.strip_prefix('"') {
            Some(inner) => inner.get(..inner.rfind('"').unwrap_or(inner.len())).unwrap_or(inner),
            None => v,
        };
        entries.insert(key.to_ascii_lowercase(), decode_vmx_escapes(value));
    }
    Vmx { entries }
}

fn hex_val(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// Decodes `|XX` (two hex digits) escapes; a `|` not followed by two hex
/// digits is kept as is.
fn decode_vmx_escapes(v: &str) -> String {
    if !v.contains('|') {
        return v.to_string();
    }
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        if b == b'|'
            && let (Some(h), Some(l)) = (
                bytes.get(i.saturating_add(1)).copied().and_then(hex_val),
                bytes.get(i.saturating_add(2)).copied().and_then(hex_val),
            )
        {
            out.push(h.saturating_mul(16).saturating_add(l));
            i = i.saturating_add(3);
            continue;
        }
        out.push(b);
        i = i.saturating_add(1);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A virtual hard disk of a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VmxDisk {
    /// e.g. `scsi0:0` (lowercase).
    pub device: String,
    /// `scsi`, `sata`, `ide` or `nvme`.
    pub bus: String,
    /// As written: relative to the VM folder or absolute under `/vmfs/volumes/`.
    pub file_name: String,
    /// e.g. `independent-persistent`; `""` if absent.
    pub mode: String,
    /// `scsiN.virtualDev` (e.g. `pvscsi`) for SCSI disks; `""` otherwise.
    pub controller_model: String,
}

/// A virtual NIC of a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VmxNic {
    /// e.g. `ethernet0`.
    pub device: String,
    /// `virtualDev`, `e1000` if absent.
    pub model: String,
    pub network: String,
    /// Lowercase: `address` if `addressType = "static"`, else `generatedAddress`.
    pub mac_address: String,
    /// `pciSlotNumber`: the slot ESXi put the NIC in, which names it inside a
    /// guest with predictable interface names (`ens192` for slot 192).
    pub pci_slot: Option<u32>,
}

/// What the migration needs from a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VmxFacts {
    pub display_name: String,
    /// Short form, e.g. `rhel8-64`.
    pub guest_os: String,
    /// 0 if absent.
    pub memory_mib: i64,
    /// `numvcpus`, 1 if absent or invalid.
    pub num_cpus: i32,
    /// `cpuid.coresPerSocket`, 1 if absent or invalid.
    pub cores_per_socket: i32,
    pub firmware: Firmware,
    pub secure_boot: bool,
    /// `uuid.bios` in the usual 8-4-4-4-12 form, lowercase; empty when absent or malformed.
    pub bios_uuid: String,
    /// Hard disks only, ordered scsi, sata, nvme, ide, then controller, then unit.
    pub disks: Vec<VmxDisk>,
    /// `ethernetN` with `present` not false, ordered by N.
    pub nics: Vec<VmxNic>,
    /// What the VM has beyond CPU, memory, disks and NICs.
    pub hardware: crate::api::SourceHardware,
}

const DISK_BUSES: [&str; 4] = ["scsi", "sata", "nvme", "ide"];

/// `scsi0:1` -> (bus rank, bus, controller, unit).
fn parse_disk_device(dev: &str) -> Option<(usize, &'static str, u32, u32)> {
    DISK_BUSES.iter().enumerate().find_map(|(rank, &bus)| {
        let (c, u) = dev.strip_prefix(bus)?.split_once(':')?;
        let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !all_digits(c) || !all_digits(u) {
            return None;
        }
        Some((rank, bus, c.parse().ok()?, u.parse().ok()?))
    })
}

/// `42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b` (how a .vmx writes it)
/// → `421b4b87-e6b7-d881-07a0-c9d221cd3c6b`; anything but 32 hex digits → empty.
fn bios_uuid(value: &str) -> String {
    let hex: String = value.chars().filter(|c| !c.is_whitespace() && *c != '-').collect();
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return String::new();
    }
    let hex = hex.to_ascii_lowercase();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

fn positive_i32(v: Option<&str>) -> Option<i32> {
    v.and_then(|s| s.trim().parse::<i32>().ok()).filter(|&n| n > 0)
}

/// Extracts CPU, memory, firmware, disks and NICs from a parsed `.vmx`.
pub(crate) fn vmx_facts(vmx: &Vmx) -> VmxFacts {
    let get = |k: &str| vmx.get(k).unwrap_or("").to_string();
    let mut disks: Vec<((usize, u32, u32), VmxDisk)> = Vec::new();
    let mut nic_ids: BTreeSet<u32> = BTreeSet::new();
    for (key, value) in &vmx.entries {
        if let Some(dev) = key.strip_suffix(".filename")
            && let Some((rank, bus, controller, unit)) = parse_disk_device(dev)
        {
            let device_type = vmx.get(&format!("{dev}.devicetype")).unwrap_or("").to_ascii_lowercase();
            let not_a_disk = device_type.contains("cdrom")
                || device_type.contains("passthru")
                || device_type.contains("floppy")
                || ends_with_ignore_ascii_case(value, ".iso");
            let absent = vmx.get_bool(&format!("{dev}.present")) == Some(false)
                || vmx.get_bool(&format!("{bus}{controller}.present")) == Some(false);
            if not_a_disk || absent || value.trim().is_empty() {
                continue;
            }
            let controller_model =
                if bus == "scsi" { get(&format!("scsi{controller}.virtualdev")) } else { String::new() };
            disks.push((
                (rank, controller, unit),
                VmxDisk {
                    device: dev.to_string(),
                    bus: bus.to_string(),
                    file_name: value.clone(),
                    mode: get(&format!("{dev}.mode")),
                    controller_model,
                },
            ));
        }
        if let Some(rest) = key.strip_prefix("ethernet")
            && let Some((n, _)) = rest.split_once('.')
            && !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
            && let Ok(n) = n.parse::<u32>()
        {
            nic_ids.insert(n);
        }
    }
    disks.sort_by_key(|(k, _)| *k);
    let nics = nic_ids
        .into_iter()
        .filter(|n| vmx.get_bool(&format!("ethernet{n}.present")) != Some(false))
        .map(|n| {
            let dev = format!("ethernet{n}");
            let model = vmx.get(&format!("{dev}.virtualdev")).map(str::trim).filter(|m| !m.is_empty());
            let address = get(&format!("{dev}.address"));
            let generated = get(&format!("{dev}.generatedaddress"));
            let is_static = vmx
                .get(&format!("{dev}.addresstype"))
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("static"));
            let (preferred, other) = if is_static { (address, generated) } else { (generated, address) };
            let mac = if preferred.trim().is_empty() { other } else { preferred };
            VmxNic {
                model: model.unwrap_or("e1000").to_string(),
                network: get(&format!("{dev}.networkname")),
                mac_address: mac.trim().to_ascii_lowercase(),
                // ESXi writes -1 for a slot not yet assigned.
                pci_slot: vmx
                    .get(&format!("{dev}.pcislotnumber"))
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .filter(|slot| (1..=65_535).contains(slot)),
                device: dev,
            }
        })
        .collect();
    VmxFacts {
        display_name: get("displayName"),
        guest_os: get("guestOS"),
        memory_mib: vmx.get("memSize").and_then(|s| s.trim().parse().ok()).unwrap_or(0),
        num_cpus: positive_i32(vmx.get("numvcpus")).unwrap_or(1),
        cores_per_socket: positive_i32(vmx.get("cpuid.coresPerSocket")).unwrap_or(1),
        firmware: if vmx.get("firmware").is_some_and(|f| f.trim().eq_ignore_ascii_case("efi")) {
            Firmware::Efi
        } else {
            Firmware::Bios
        },
        secure_boot: vmx.get_bool("uefi.secureBoot.enabled").unwrap_or(false),
        bios_uuid: vmx.get("uuid.bios").map(bios_uuid).unwrap_or_default(),
        disks: disks.into_iter().map(|(_, d)| d).collect(),
        nics,
        hardware: hardware(vmx),
    }
}

/// The `N` of `<prefix>N.<rest>` keys (e.g. `pcipassthru`), each once, ordered.
fn numbered(vmx: &Vmx, prefix: &str) -> BTreeSet<u32> {
    vmx.entries
        .keys()
        .filter_map(|k| k.strip_prefix(prefix)?.split_once('.')?.0.parse::<u32>().ok())
        .collect()
}

/// The devices and settings a KubeVirt VM cannot carry, or carries only in
/// part, as the `.vmx` shows them; an absent or `present = FALSE` device is
/// not there. Read from the keys ESXi writes (docs/compatibility.md lists
/// each with what vmmigrate decides).
fn hardware(vmx: &Vmx) -> crate::api::SourceHardware {
    let on = |k: &str| vmx.get_bool(k) == Some(true);
    let text = |k: &str| vmx.get(k).map(str::trim).unwrap_or("").to_string();
    let mut hw = crate::api::SourceHardware {
        tpm: on("vtpm.present"),
        encrypted: vmx.get("encryption.keySafe").is_some() || vmx.get("encryption.data").is_some(),
        persistent_memory: on("nvdimm0.present"),
        ..Default::default()
    };
    for n in numbered(vmx, "pcipassthru") {
        let dev = format!("pciPassthru{n}");
        if !on(&format!("{dev}.present")) {
            continue;
        }
        if vmx.get(&format!("{dev}.pfId")).is_some() {
            hw.sriov_nics.push(dev);
        } else if let Some(vgpu) = vmx.get(&format!("{dev}.vgpu")) {
            hw.passthrough.push(format!("{dev} (vGPU {})", vgpu.trim()));
        } else {
            hw.passthrough.push(dev);
        }
    }
    for n in numbered(vmx, "ethernet") {
        let dev = format!("ethernet{n}");
        if vmx.get_bool(&format!("{dev}.present")) != Some(false)
            && vmx.get(&format!("{dev}.virtualDev")).is_some_and(|m| m.trim().eq_ignore_ascii_case("sriov"))
        {
            hw.sriov_nics.push(dev);
        }
    }
    for (key, value) in &vmx.entries {
        let Some(dev) = key.strip_suffix(".devicetype") else { continue };
        let Some((_, bus, controller, _)) = parse_disk_device(dev) else { continue };
        let absent = vmx.get_bool(&format!("{dev}.present")) == Some(false)
            || vmx.get_bool(&format!("{bus}{controller}.present")) == Some(false);
        if absent {
            continue;
        }
        let kind = value.trim().to_ascii_lowercase();
        if kind == "scsi-passthru" {
            hw.passthrough.push(format!("{dev} (SCSI passthrough)"));
        } else if kind == "cdrom-image" && vmx.get_bool(&format!("{dev}.startConnected")) != Some(false) {
            let file = text(&format!("{dev}.fileName"));
            if !file.is_empty() {
                hw.cdrom_images.push(format!("{dev}: {file}"));
            }
        }
    }
    for (key, value) in &vmx.entries {
        if let Some(dev) = key.strip_suffix(".sharing")
            && parse_disk_device(dev).is_some()
            && value.trim().eq_ignore_ascii_case("multi-writer")
            && vmx.get_bool(&format!("{dev}.present")) != Some(false)
        {
            hw.shared_disks.push(format!("{dev} (multi-writer)"));
        }
        if let Some(bus) = key.strip_suffix(".sharedbus")
            && bus
                .strip_prefix("scsi")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            && !value.trim().eq_ignore_ascii_case("none")
            && vmx.get_bool(&format!("{bus}.present")) != Some(false)
        {
            hw.shared_disks.push(format!("{bus} (bus sharing {})", value.trim()));
        }
    }
    // What each switch that is on stands for.
    let switched_on = |switches: &[(&str, &str)]| -> Vec<String> {
        switches.iter().filter(|(key, _)| on(key)).map(|(_, what)| what.to_string()).collect()
    };
    hw.hot_plug = switched_on(&[
        ("vcpu.hotadd", "CPU hot-add"),
        ("vcpu.hotremove", "CPU hot-remove"),
        ("mem.hotadd", "memory hot-add"),
    ]);
    let cpu_affinity = text("sched.cpu.affinity");
    if !cpu_affinity.is_empty() && !cpu_affinity.eq_ignore_ascii_case("all") {
        hw.affinity.push(format!("CPUs {cpu_affinity}"));
    }
    let numa = text("numa.nodeAffinity");
    if !numa.is_empty() {
        hw.affinity.push(format!("NUMA nodes {numa}"));
    }
    hw.virtualization = switched_on(&[
        ("vhv.enable", "nested hardware virtualization"),
        ("vvtd.enable", "a virtual IOMMU"),
        ("windows.vbs.enabled", "Windows virtualization-based security"),
    ]);
    for (prefix, name) in [("serial", "serial"), ("parallel", "parallel")] {
        for n in numbered(vmx, prefix) {
            let dev = format!("{prefix}{n}");
            let backing = text(&format!("{dev}.fileType")).to_ascii_lowercase();
            if on(&format!("{dev}.present"))
                && ["file", "network", "pipe", "device"].contains(&backing.as_str())
            {
                hw.ports.push(format!("{dev} ({name} port to a {backing})"));
            }
        }
    }
    if on("floppy0.present") && text("floppy0.fileType").eq_ignore_ascii_case("file") {
        hw.ports.push(format!("floppy0 (image {})", text("floppy0.fileName")));
    }
    for controller in ["usb", "usb_xhci"] {
        if vmx.get_bool(&format!("{controller}.present")) != Some(true) {
            continue;
        }
        let devices: BTreeSet<u32> = numbered(vmx, &format!("{controller}:"));
        for n in devices {
            let dev = format!("{controller}:{n}");
            let kind = text(&format!("{dev}.deviceType")).to_ascii_lowercase();
            if vmx.get_bool(&format!("{dev}.present")) == Some(true)
                && !matches!(kind.as_str(), "hid" | "hub")
            {
                hw.usb_devices.push(if kind.is_empty() { dev } else { format!("{dev} ({kind})") });
            }
        }
    }
    hw
}
