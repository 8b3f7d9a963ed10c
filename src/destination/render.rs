//! Pure rendering of the destination objects: one CDI DataVolume per disk and
//! the KubeVirt VirtualMachine. Deterministic: the same migration renders the
//! same bytes.
//!
//! Bus mapping (documented in docs/state-machine.md): SCSI and SATA disks
//! become `virtio` unless the guest may lack virtio drivers (IDE/SATA kept as
//! `sata`); NVMe becomes `virtio`. NICs: vmxnet3 → virtio, e1000/e1000e kept;
//! the MAC address is preserved. A Windows guest that is not converted has
//! no virtio drivers: every disk goes on `sata` and every NIC is `e1000e`.

use crate::api::{Firmware, ImportVerification, MigrationMode, NetworkKind, VirtualMachineMigration};
use crate::machine::{data_volume_name, destination_name};
use crate::ports::ImportAccess;
use serde_json::{Value, json};

use crate::api::labels::DISK as LABEL_DISK;
use crate::objects::{labels, owner_references};

/// The Secret holding the credentials of DataVolume `dv`'s artifact.
pub(crate) fn import_secret_name(dv: &str) -> String {
    format!("{dv}-import")
}

/// The ConfigMap holding the CA DataVolume `dv`'s importer trusts.
pub(crate) fn import_ca_name(dv: &str) -> String {
    format!("{dv}-import-ca")
}

/// The credentials of disk `disk`'s artifact, as CDI's HTTP source reads
/// them from `secretRef` (keys `accessKeyId` and `secretKey`), and the
/// staging CA beside them (`ca.pem`) for the fill Job, which mounts this one
/// Secret: the admission policy of `deploy/` lets vmmigrate's Jobs mount
/// claims, Secrets and empty directories only.
pub(crate) fn import_secret(vmm: &VirtualMachineMigration, disk: usize, access: &ImportAccess) -> Value {
    use base64::Engine as _;
    let encode = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": import_metadata(vmm, disk, import_secret_name),
        "type": "Opaque",
        "data": {
            "accessKeyId": encode(&access.access_key_id),
            "secretKey": encode(&access.secret_key),
            "ca.pem": encode(&access.ca_pem),
        },
    })
}

/// The staging server's CA, as CDI's HTTP source reads it from
/// `certConfigMap` (every key a PEM file).
pub(crate) fn import_ca(vmm: &VirtualMachineMigration, disk: usize, access: &ImportAccess) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": import_metadata(vmm, disk, import_ca_name),
        "data": { "ca.pem": access.ca_pem },
    })
}

fn import_metadata(vmm: &VirtualMachineMigration, disk: usize, name: fn(&str) -> String) -> Value {
    let dv = data_volume_name(
        &destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()),
        disk,
    );
    let mut labels = labels(vmm);
    labels.insert(LABEL_DISK.into(), json!(disk.to_string()));
    json!({
        "name": name(&dv),
        "namespace": vmm.spec.destination.namespace,
        "labels": labels,
        "ownerReferences": owner_references(vmm, &vmm.spec.destination.namespace),
    })
}

/// The DataVolume of disk `disk`, importing the staged artifact over HTTPS
/// with the credentials of [`import_secret`] and the CA of [`import_ca`].
pub(crate) fn data_volume(vmm: &VirtualMachineMigration, disk: usize) -> Value {
    let status = vmm.status.clone().unwrap_or_default();
    let name = data_volume_name(
        &destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()),
        disk,
    );
    // Before Preparing records the disks (a blank volume asked for early),
    // the size is the inventory's, and the volume is to be filled.
    let early = status.disks.get(disk).is_none();
    let evidence = status.disks.get(disk).cloned().unwrap_or_default();
    let inventory_size =
        || status.source_inventory.as_ref().and_then(|i| i.disks.get(disk)).map(|d| d.capacity_bytes);
    let size = match early {
        true => inventory_size().unwrap_or(0).max(1),
        false => evidence.size_bytes.max(1),
    };
    // Whole MiB, rounded up: CDI sizes the PVC from this.
    let request = format!("{}Mi", (size + (1 << 20) - 1) >> 20);
    let mut labels = labels(vmm);
    labels.insert(LABEL_DISK.into(), json!(disk.to_string()));
    let mut http = json!({
        "url": evidence.artifact_url.unwrap_or_default(),
        "secretRef": import_secret_name(&name),
        "certConfigMap": import_ca_name(&name),
    });
    // Only for a CDI that knows the field: an older one's API server would
    // refuse it (we write with strict field validation) or prune it.
    if let (Some(sha), Some(ImportVerification::CdiChecksum)) =
        (evidence.artifact_sha256, evidence.import_verification)
    {
        http["checksum"] = json!(format!("sha256:{sha}"));
    }
    // A volume vmmigrate fills itself (its fill Job) starts blank: CDI only
    // provisions it.
    let source = match evidence.import_verification {
        _ if early => json!({ "blank": {} }),
        Some(ImportVerification::Filled | ImportVerification::Patched) => json!({ "blank": {} }),
        _ => json!({ "http": http }),
    };
    json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": {
            "name": name,
            "namespace": vmm.spec.destination.namespace,
            "labels": labels,
            // The VM that will consume the volume is created after the
            // import: a WaitForFirstConsumer class must not wait for it.
            "annotations": { "cdi.kubevirt.io/storage.bind.immediate.requested": "true" },
            "ownerReferences": owner_references(vmm, &vmm.spec.destination.namespace),
        },
        "spec": {
            "source": source,
            "storage": {
                "storageClassName": vmm.spec.destination.storage_class_name,
                "resources": { "requests": { "storage": request } },
            },
        },
    })
}

/// The VirtualMachine, created with runStrategy Halted.
pub(crate) fn virtual_machine(vmm: &VirtualMachineMigration) -> Value {
    let status = vmm.status.clone().unwrap_or_default();
    let inventory = status.source_inventory.clone().unwrap_or_default();
    let name = destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default()).into_owned();
    let (sockets, cores) = match &vmm.spec.destination.cpu {
        Some(cpu) => (cpu.sockets, cpu.cores),
        None => (inventory.cpu_sockets.max(1), inventory.cores_per_socket.max(1)),
    };
    let memory =
        vmm.spec.destination.memory.clone().unwrap_or_else(|| format!("{}Mi", inventory.memory_mib.max(64)));
    // EFI keeps the source's secure boot setting (off unless the source had
    // it on); KubeVirt needs SMM for secure boot.
    let firmware = match inventory.firmware {
        Firmware::Efi => json!({ "bootloader": { "efi": { "secureBoot": inventory.secure_boot } } }),
        Firmware::Bios => json!({ "bootloader": { "bios": {} } }),
    };
    let features = if inventory.firmware == Firmware::Efi && inventory.secure_boot {
        json!({ "smm": { "enabled": true } })
    } else {
        json!({})
    };
    let emulated = crate::machine::compatibility::guest_plan(&vmm.spec, &inventory).emulated_devices;
    let mut disks = Vec::new();
    let mut volumes = Vec::new();
    for (i, disk) in inventory.disks.iter().enumerate() {
        let bus = match disk.bus.as_str() {
            _ if emulated => "sata",
            "ide" | "sata" => "sata",
            _ => "virtio",
        };
        let mut entry = json!({ "name": format!("disk-{i}"), "disk": { "bus": bus } });
        if i == 0 {
            entry["bootOrder"] = json!(1);
        }
        disks.push(entry);
        volumes.push(
            json!({ "name": format!("disk-{i}"), "dataVolume": { "name": data_volume_name(&name, i) } }),
        );
    }
    let mut interfaces = Vec::new();
    let mut networks = Vec::new();
    // A rehearsal runs beside its running source: never on the pod network
    // (no Service of the source's can reach it), with its NICs detached or
    // on the one network named for it, each with a MAC address of its own.
    let rehearsal = vmm.spec.mode == MigrationMode::Rehearsal;
    let rehearsal_network = vmm.spec.rehearsal.as_ref().and_then(|r| r.network_name.clone());
    for (i, nic) in inventory.nics.iter().enumerate() {
        if rehearsal && rehearsal_network.is_none() {
            break;
        }
        let mapping = vmm.spec.network_map.iter().find(|m| m.source == nic.network);
        let model = match nic.model.as_str() {
            _ if emulated => "e1000e",
            "e1000" | "e1000e" => nic.model.as_str(),
            _ => "virtio",
        };
        let mut iface = json!({ "name": format!("nic-{i}"), "model": model });
        if let Some(network) = rehearsal_network.as_ref().filter(|_| rehearsal) {
            iface["bridge"] = json!({});
            networks.push(json!({ "name": format!("nic-{i}"), "multus": { "networkName": network } }));
            interfaces.push(iface);
            continue;
        }
        if !nic.mac_address.is_empty() {
            iface["macAddress"] = json!(nic.mac_address);
        }
        match mapping.map(|m| m.kind) {
            Some(NetworkKind::Multus) => {
                iface["bridge"] = json!({});
                let target = mapping.and_then(|m| m.network_name.clone()).unwrap_or_default();
                networks.push(json!({ "name": format!("nic-{i}"), "multus": { "networkName": target } }));
            }
            _ => {
                iface["masquerade"] = json!({});
                networks.push(json!({ "name": format!("nic-{i}"), "pod": {} }));
            }
        }
        interfaces.push(iface);
    }
    let mut devices = json!({ "disks": disks, "interfaces": interfaces });
    if rehearsal && networks.is_empty() {
        // Without this KubeVirt adds a pod network interface by itself.
        devices["autoattachPodInterface"] = json!(false);
    }
    let mut template_labels = labels(vmm);
    template_labels.insert("kubevirt.io/domain".into(), json!(name));
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {
            "name": name,
            "namespace": vmm.spec.destination.namespace,
            "labels": labels(vmm),
            "ownerReferences": owner_references(vmm, &vmm.spec.destination.namespace),
        },
        "spec": {
            "runStrategy": "Halted",
            "template": {
                "metadata": { "labels": template_labels },
                "spec": {
                    "domain": {
                        "cpu": { "sockets": sockets, "cores": cores, "threads": 1 },
                        "memory": { "guest": memory },
                        "resources": { "requests": { "memory": memory } },
                        "firmware": firmware,
                        "features": features,
                        "devices": devices,
                    },
                    "networks": networks,
                    "volumes": volumes,
                },
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{SourceInventory, test_migration};

    fn with_firmware(firmware: Firmware, secure_boot: bool) -> Value {
        let mut vmm = test_migration();
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory { firmware, secure_boot, ..Default::default() }),
            ..Default::default()
        });
        virtual_machine(&vmm)["spec"]["template"]["spec"]["domain"].clone()
    }

    #[test]
    fn a_rehearsal_vm_has_its_own_name_no_pod_network_and_no_mac_of_the_source() {
        let mut vmm = test_migration();
        vmm.spec.mode = crate::api::MigrationMode::Rehearsal;
        vmm.spec.network_map = vec![crate::api::NetworkMapping {
            source: "VM Network".into(),
            kind: NetworkKind::Pod,
            network_name: None,
        }];
        let nic = |mac: &str| crate::api::SourceNic {
            device: "ethernet0".into(),
            model: "vmxnet3".into(),
            network: "VM Network".into(),
            mac_address: mac.into(),
            pci_slot: Some(192),
        };
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                nics: vec![nic("00:50:56:aa:bb:cc"), nic("00:50:56:aa:bb:cd")],
                ..Default::default()
            }),
            ..Default::default()
        });
        let vm = virtual_machine(&vmm);
        assert_eq!(vm["metadata"]["name"], "web-rehearsal");
        assert_eq!(vm["metadata"]["labels"]["migration.platform.example/rehearsal"], "true");
        let template = &vm["spec"]["template"]["spec"];
        assert_eq!(template["networks"], json!([]), "detached");
        assert_eq!(template["domain"]["devices"]["interfaces"], json!([]));
        assert_eq!(template["domain"]["devices"]["autoattachPodInterface"], false);

        vmm.spec.rehearsal =
            Some(crate::api::RehearsalSpec { name: None, network_name: Some("lab/isolated".into()) });
        let vm = virtual_machine(&vmm);
        let template = &vm["spec"]["template"]["spec"];
        let networks = template["networks"].as_array().unwrap();
        assert_eq!(networks.len(), 2);
        assert!(
            networks.iter().all(|n| n["multus"]["networkName"] == "lab/isolated" && n.get("pod").is_none())
        );
        let interfaces = template["domain"]["devices"]["interfaces"].as_array().unwrap();
        assert!(
            interfaces.iter().all(|i| i.get("macAddress").is_none() && i.get("bridge").is_some()),
            "{interfaces:?}"
        );
        assert!(template["domain"]["devices"].get("autoattachPodInterface").is_none());
        assert_eq!(data_volume(&vmm, 0)["metadata"]["name"], "web-rehearsal-disk-0");

        // The migration itself keeps the source's MAC and the pod network.
        vmm.spec.mode = crate::api::MigrationMode::Cold;
        vmm.spec.rehearsal = None;
        let vm = virtual_machine(&vmm);
        assert_eq!(vm["metadata"]["name"], "web");
        assert_eq!(
            vm["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]["macAddress"],
            "00:50:56:aa:bb:cc"
        );
    }

    #[test]
    fn firmware_follows_the_source_and_secure_boot_brings_smm() {
        let bios = with_firmware(Firmware::Bios, false);
        assert_eq!(bios["firmware"]["bootloader"], json!({ "bios": {} }));
        assert_eq!(bios["features"], json!({}));
        let efi = with_firmware(Firmware::Efi, false);
        assert_eq!(efi["firmware"]["bootloader"]["efi"]["secureBoot"], false);
        assert_eq!(efi["features"], json!({}));
        let secure = with_firmware(Firmware::Efi, true);
        assert_eq!(secure["firmware"]["bootloader"]["efi"]["secureBoot"], true);
        assert_eq!(secure["features"]["smm"]["enabled"], true);
    }

    #[test]
    fn a_windows_guest_moved_as_it_is_gets_sata_disks_and_e1000e_nics_and_a_converted_one_virtio() {
        let mut vmm = test_migration();
        let disk = |bus: &str| crate::api::SourceDisk { bus: bus.into(), ..Default::default() };
        let nic = crate::api::SourceNic { model: "vmxnet3".into(), ..Default::default() };
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                guest_os: "windows2019srv-64".into(),
                disks: vec![disk("scsi"), disk("nvme")],
                nics: vec![nic],
                ..Default::default()
            }),
            ..Default::default()
        });
        let devices = |vmm: &VirtualMachineMigration| {
            virtual_machine(vmm)["spec"]["template"]["spec"]["domain"]["devices"].clone()
        };
        vmm.spec.conversion.guest = crate::api::GuestConversionMode::None;
        let emulated = devices(&vmm);
        assert_eq!(emulated["disks"][0]["disk"]["bus"], "sata");
        assert_eq!(emulated["disks"][1]["disk"]["bus"], "sata");
        assert_eq!(emulated["interfaces"][0]["model"], "e1000e");
        vmm.spec.conversion.guest = crate::api::GuestConversionMode::Auto;
        let converted = devices(&vmm);
        assert_eq!(converted["disks"][0]["disk"]["bus"], "virtio");
        assert_eq!(converted["interfaces"][0]["model"], "virtio");
    }
}
