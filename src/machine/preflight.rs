//! Pre-flight rules evaluated in the `Validated` checkpoint. Pure: the
//! inventory comes from discovery, the cluster facts from the observation.

use super::observe::{DestinationOccupancy, PreflightFacts};
use crate::api::Reason;
use crate::api::{Blocker, MigrationMode, NetworkKind, SourceInventory, VirtualMachineMigrationSpec};

/// Longest destination name: `<name>-disk-NN` must stay a 63-character label.
pub(crate) const MAX_DESTINATION_NAME: usize = 55;

/// Every rule that does not pass, in a stable order.
pub(crate) fn blockers(
    spec: &VirtualMachineMigrationSpec,
    destination_name: &str,
    inventory: &SourceInventory,
    facts: &PreflightFacts,
) -> Vec<Blocker> {
    let mut out = Vec::new();
    let mut block =
        |reason: Reason, message: String| out.push(Blocker { reason: reason.to_string(), message });
    if inventory.snapshots > 0 {
        block(
            Reason::SnapshotsPresent,
            format!(
                "the source VM has {} snapshot(s); consolidate or delete them on the host, then retry",
                inventory.snapshots
            ),
        );
    }
    if let Some(question) = &inventory.pending_question {
        block(Reason::PendingQuestion, format!("the source VM is waiting on a question: {question}"));
    }
    if inventory.disks.is_empty() {
        block(Reason::NoDisks, "the source VM has no virtual disks".to_owned());
    }
    for disk in &inventory.disks {
        if disk.create_type.contains("RawDeviceMap") {
            block(
                Reason::UnsupportedDiskType,
                format!(
                    "disk {} ({}) is a raw device mapping, which cannot be copied",
                    disk.device, disk.descriptor_path
                ),
            );
        } else if !disk.create_type.is_empty()
            && !matches!(disk.create_type.as_str(), "vmfs" | "monolithicFlat")
        {
            block(
                Reason::UnsupportedDiskType,
                format!(
                    "disk {} has type {}; only flat disks (vmfs, monolithicFlat) are supported",
                    disk.device, disk.create_type
                ),
            );
        }
        if disk.mode.starts_with("independent") {
            block(
                Reason::IndependentDisk,
                format!("disk {} is {}; independent disks are not supported", disk.device, disk.mode),
            );
        }
    }
    // A rehearsal's NICs are detached or on its own network: no map needed.
    let mapped_nics = if spec.mode == MigrationMode::Rehearsal { &[][..] } else { &inventory.nics[..] };
    for nic in mapped_nics {
        let mapped = spec.network_map.iter().any(|m| m.source == nic.network);
        if !mapped {
            block(
                Reason::NetworkNotMapped,
                format!(
                    "NIC {} is on network {:?}, which spec.networkMap does not map (add an entry with type Pod or Multus)",
                    nic.device, nic.network
                ),
            );
        }
    }
    // Two NICs on the pod network cannot both be masquerade-bound.
    let pod_nics = mapped_nics
        .iter()
        .filter(|n| spec.network_map.iter().any(|m| m.source == n.network && m.kind == NetworkKind::Pod))
        .count();
    if pod_nics > 1 {
        block(
            Reason::NetworkNotMapped,
            format!("{pod_nics} NICs map to the pod network; at most one can (map the others to Multus)"),
        );
    }
    if !is_dns_label(destination_name) || destination_name.len() > MAX_DESTINATION_NAME {
        block(
            Reason::InvalidDestinationName,
            format!(
                "destination name {destination_name:?} must be a lowercase RFC 1123 label of at most {MAX_DESTINATION_NAME} characters (set {})",
                if spec.mode == MigrationMode::Rehearsal {
                    "spec.rehearsal.name"
                } else {
                    "spec.destination.name"
                }
            ),
        );
    }
    if let Some(refused) = &facts.destination_refused {
        block(Reason::DestinationNamespaceNotAllowed, refused.clone());
    }
    if let Some(blocked) = &facts.data_plane_blocked {
        block(Reason::WorkerCannotStart, blocked.clone());
    }
    if let Some(other) = &facts.source_claimed_by {
        block(
            Reason::SourceVMClaimed,
            format!(
                "the source VM {:?} (vmid {} on {}) is already claimed by migration {other}; one source VM has one migration (delete one of them)",
                inventory.name, inventory.vmid, spec.source.host
            ),
        );
    }
    if !facts.destination_namespace_exists {
        block(
            Reason::DestinationNamespaceNotFound,
            format!("namespace {:?} does not exist", spec.destination.namespace),
        );
    }
    if facts.destination_vm == DestinationOccupancy::Taken {
        block(
            Reason::DestinationNameTaken,
            format!(
                "a VirtualMachine {}/{destination_name} already exists and was not created by this migration",
                spec.destination.namespace
            ),
        );
    }
    if !facts.storage_class_exists {
        block(
            Reason::StorageClassNotFound,
            format!("StorageClass {:?} does not exist", spec.destination.storage_class_name),
        );
    }
    // What the VM's hardware rules out (passthrough, shared disks, …).
    out.extend(super::compatibility::findings(spec, inventory).blockers);
    // What converting the guest needs where conversions run.
    out.extend(super::compatibility::converter_blockers(spec, inventory, facts.guest_converter));
    out
}

/// RFC 1123 label: lowercase alphanumerics and '-', starting and ending alphanumeric, 1..=63.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}
