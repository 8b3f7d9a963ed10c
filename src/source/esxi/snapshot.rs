//! The snapshot a warm migration or a rehearsal takes of its source VM, and
//! the disk chains it creates: the only change vmmigrate may make to a source
//! VM besides powering it off, and only in those modes.
//!
//! While the snapshot exists the base `-flat.vmdk` of every disk is frozen
//! (the guest writes to a delta on top of it), so the base is copied while
//! the VM runs; after the cutover only the deltas are copied and the disk is
//! assembled locally (`convert::chain`). Creating is idempotent by name (a
//! retry after a crash finds the snapshot it made), removing likewise.

use super::adapter::{EsxiSource, join, parent, vim_fault};
use super::parse;
use super::ssh::RemoteCommand;
use crate::api::{Reason, VirtualMachineMigration};
use crate::machine::Failure;

/// A snapshot of the source VM as `snapshot.get` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: String,
    pub name: String,
}

/// One level of a disk's chain as the host describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainLevel {
    /// The descriptor on the host, e.g. `/vmfs/volumes/ds/web/web-000001.vmdk`.
    pub descriptor_path: String,
    /// Its data extent, e.g. `…/web-000001-sesparse.vmdk` or `…/web-flat.vmdk`.
    pub extent_path: String,
    /// `vmfs`, `vmfsSparse` or `seSparse`.
    pub create_type: String,
    /// The extent line's type: `VMFS`, `VMFSSPARSE` or `SESPARSE`.
    pub extent_kind: String,
    pub capacity_bytes: u64,
}

/// Most levels a chain is followed through (ESXi allows 32 snapshots).
const MAX_CHAIN: usize = 32;

/// A snapshot name vmmigrate creates: `vmmigrate-` and a Kubernetes name,
/// nothing the remote shell could read otherwise.
pub fn snapshot_name(migration: &str) -> String {
    format!("vmmigrate-{migration}")
}

fn valid_snapshot_name(name: &str) -> bool {
    name.len() <= 80
        && name.starts_with("vmmigrate-")
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl EsxiSource {
    /// The source VM's snapshots.
    pub async fn snapshots(&self, vmm: &VirtualMachineMigration) -> Result<Vec<SnapshotInfo>, Failure> {
        let vmid = self.vmid_or_find(vmm).await?;
        let out = self.run(vmm, Self::vim_cmd("vmsvc/snapshot.get", &vmid)).await?;
        if let Some(fault) = vim_fault("snapshot.get", &out) {
            return Err(fault);
        }
        Ok(parse::parse_snapshots(&out.text())
            .into_iter()
            .map(|s| SnapshotInfo { id: s.id, name: s.name })
            .collect())
    }

    /// Creates snapshot `name` without memory (quiesced when `quiesce`)
    /// unless one of that name exists; returns its id.
    pub async fn ensure_snapshot(
        &self,
        vmm: &VirtualMachineMigration,
        name: &str,
        quiesce: bool,
    ) -> Result<String, Failure> {
        if !valid_snapshot_name(name) {
            return Err(Failure::terminal(
                Reason::SnapshotFailed,
                format!("refusing snapshot name {name:?}"),
            ));
        }
        if let Some(found) = self.snapshots(vmm).await?.into_iter().find(|s| s.name == name) {
            return Ok(found.id);
        }
        let vmid = self.vmid_or_find(vmm).await?;
        let cmd = Self::vim_cmd("vmsvc/snapshot.create", &vmid).and_then(|c| {
            c.arg(name)?.arg("vmmigrate: frozen base for the copy")?.arg("0")?.arg(if quiesce {
                "1"
            } else {
                "0"
            })
        });
        let out = self.run(vmm, cmd).await?;
        if let Some(fault) = vim_fault("snapshot.create", &out) {
            return Err(Failure { reason: Reason::SnapshotFailed, ..fault });
        }
        match self.snapshots(vmm).await?.into_iter().find(|s| s.name == name) {
            Some(found) => Ok(found.id),
            None => Err(Failure::retryable(
                Reason::SnapshotFailed,
                format!(
                    "snapshot.create {name:?} printed {:?}, and the snapshot is not listed",
                    out.text().trim()
                ),
            )),
        }
    }

    /// Removes snapshot `name` (the host consolidates its delta into the
    /// base); `false` when there is none of that name. Only a name vmmigrate
    /// makes is ever removed: a user's snapshot is refused, whatever asks.
    pub async fn remove_snapshot(&self, vmm: &VirtualMachineMigration, name: &str) -> Result<bool, Failure> {
        if !valid_snapshot_name(name) {
            return Err(Failure::terminal(
                Reason::SnapshotFailed,
                format!("refusing to remove snapshot {name:?}: vmmigrate removes only its own"),
            ));
        }
        let Some(found) = self.snapshots(vmm).await?.into_iter().find(|s| s.name == name) else {
            return Ok(false);
        };
        if found.id.is_empty() || !found.id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Failure::retryable(
                Reason::UnparsableOutput,
                format!("snapshot {name:?} has id {:?}", found.id),
            ));
        }
        let vmid = self.vmid_or_find(vmm).await?;
        let out = self
            .run(vmm, Self::vim_cmd("vmsvc/snapshot.remove", &vmid).and_then(|c| c.arg(&found.id)))
            .await?;
        if let Some(fault) = vim_fault("snapshot.remove", &out) {
            return Err(Failure { reason: Reason::SnapshotFailed, ..fault });
        }
        if self.snapshots(vmm).await?.iter().any(|s| s.name == name) {
            return Err(Failure::retryable(
                Reason::SnapshotFailed,
                format!(
                    "snapshot.remove {name:?} printed {:?}, and the snapshot is still listed",
                    out.text().trim()
                ),
            ));
        }
        Ok(true)
    }

    /// Each disk's chain as the `.vmx` and the descriptors say now, top
    /// first, down to the flat base. Only flat bases and seSparse/vmfsSparse
    /// deltas are followed; anything else is `SnapshotChainUnexpected`.
    pub async fn disk_chains(&self, vmm: &VirtualMachineMigration) -> Result<Vec<Vec<ChainLevel>>, Failure> {
        let entry = self.find_vm(vmm).await?;
        let vmx_path = if entry.datastore.is_empty() {
            entry.vmx_path.clone()
        } else {
            format!("/vmfs/volumes/{}/{}", entry.datastore, entry.vmx_path)
        };
        let head =
            |path: &str| RemoteCommand::new("head").and_then(|c| c.arg("-c")?.arg("1048576")?.arg(path));
        let vmx = self.run(vmm, head(&vmx_path)).await?;
        if vmx.exit_status != Some(0) {
            return Err(Failure::retryable(
                Reason::VmxUnreadable,
                format!("cannot read {vmx_path}: {}", vmx.text().trim()),
            ));
        }
        let facts = parse::vmx_facts(&parse::parse_vmx(&vmx.stdout_text()));
        let vm_dir = parent(&vmx_path).to_owned();
        let unexpected = |message: String| Failure::needs_human(Reason::SnapshotChainUnexpected, message);
        let mut chains = Vec::new();
        for disk in &facts.disks {
            let mut chain = Vec::new();
            let mut descriptor_path = join(&vm_dir, &disk.file_name);
            loop {
                if chain.len() >= MAX_CHAIN {
                    return Err(unexpected(format!("disk {} has more than {MAX_CHAIN} levels", disk.device)));
                }
                let text = self.run(vmm, head(&descriptor_path)).await?;
                let Some(d) = parse::parse_descriptor(&text.stdout_text()) else {
                    return Err(unexpected(format!("{descriptor_path} is not a VMDK descriptor")));
                };
                let [extent] = d.extents.as_slice() else {
                    return Err(unexpected(format!(
                        "{descriptor_path} has {} extents, not one",
                        d.extents.len()
                    )));
                };
                let kind_ok = matches!(
                    (d.create_type.as_str(), extent.kind.as_str()),
                    ("vmfs", "VMFS") | ("vmfsSparse", "VMFSSPARSE") | ("seSparse", "SESPARSE")
                );
                if !kind_ok || extent.file.is_empty() || extent.file.contains('/') {
                    return Err(unexpected(format!(
                        "{descriptor_path}: createType {:?} with a {:?} extent {:?} is not a flat disk or a snapshot delta",
                        d.create_type, extent.kind, extent.file
                    )));
                }
                let level = ChainLevel {
                    descriptor_path: descriptor_path.clone(),
                    extent_path: join(parent(&descriptor_path), &extent.file),
                    create_type: d.create_type.clone(),
                    extent_kind: extent.kind.clone(),
                    capacity_bytes: d.capacity_bytes(),
                };
                let next = d.parent_file_name_hint.clone();
                let is_base = d.create_type == "vmfs";
                if let Some(previous) = chain.last().map(|l: &ChainLevel| l.capacity_bytes)
                    && previous != level.capacity_bytes
                {
                    return Err(unexpected(format!(
                        "{descriptor_path} is not the size of the level above it"
                    )));
                }
                chain.push(level);
                match (is_base, next) {
                    (true, _) => break,
                    (false, Some(hint)) if !hint.is_empty() => {
                        descriptor_path = join(parent(&descriptor_path), &hint);
                    }
                    (false, _) => {
                        return Err(unexpected(format!("{descriptor_path} is a delta without a parent")));
                    }
                }
            }
            chains.push(chain);
        }
        Ok(chains)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_vmmigrate_makes_are_snapshot_names() {
        assert!(valid_snapshot_name(&snapshot_name("web-01")));
        assert!(!valid_snapshot_name("before-upgrade"), "never someone else's snapshot");
        assert!(!valid_snapshot_name("vmmigrate-x; reboot"));
        assert!(!valid_snapshot_name(&format!("vmmigrate-{}", "a".repeat(80))));
    }
}
