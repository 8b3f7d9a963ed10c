//! The snapshot a warm migration or a rehearsal takes of its source VM, and
//! the disk chains it creates: the only change vmmigrate may make to a source
//! VM besides powering it off, and only in those modes.
//!
//! While the snapshot exists the base `-flat.vmdk` of every disk is frozen
//! (the guest writes to a delta on top of it), so the base is copied while
//! the VM runs; after the cutover only the deltas are copied and the disk is
//! assembled locally (`convert::chain`). Creating is idempotent by name (a
//! retry after a crash finds the snapshot it made), removing likewise.

use super::copy::{self, CopyError, CopyPlan, CopyResult};
use super::hosts::{EsxiHosts, disk_file, extent_file, head, join, parent, vim_fault};
use super::parse;
use super::ssh::Session;
use super::store::{EsxiDiskStore, delta_key_uid};
use crate::api::DiskPatch;
use crate::api::{Reason, VirtualMachineMigration};
use crate::images::chain::{self, DeltaKind};
use crate::machine::{CopyState, Failure};
use crate::ports::workdir::{patch_info_path, patch_path, read_patch_info, write_patch_info};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

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

pub use crate::api::snapshot_name;

fn valid_snapshot_name(name: &str) -> bool {
    name.len() <= 80
        && name.starts_with("vmmigrate-")
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl EsxiHosts {
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
        let (vmx_path, facts) = self.read_vmx(vmm, &entry).await?;
        let vm_dir = parent(&vmx_path).to_owned();
        let unexpected = |message: String| Failure::needs_human(Reason::SnapshotChainUnexpected, message);
        let mut chains = Vec::new();
        for disk in &facts.disks {
            let mut chain = Vec::new();
            let mut descriptor_path = disk_file(&vm_dir, &disk.file_name)?;
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
                    extent_path: extent_file(&descriptor_path, &extent.file)?,
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
                        descriptor_path = disk_file(&vm_dir, &join(parent(&descriptor_path), &hint))?;
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

/// `disk-<n>.assembled`: "size sha256 verified|local", written once the disk
/// is assembled from its base copy and deltas (it then replaces the base copy).
fn assembled_marker(local: &Path) -> PathBuf {
    local.with_extension("assembled")
}

/// The patch of an assembled disk, where one was made.
pub(super) fn read_patch(local: &Path) -> Option<DiskPatch> {
    read_assembled(local)?;
    read_patch_info(local)
}

fn read_assembled(local: &Path) -> Option<copy::CopyMarker> {
    let assembled = copy::CopyMarker::parse(&std::fs::read_to_string(assembled_marker(local)).ok()?)?;
    // Done only once the copy in place is the assembled disk.
    let copy = copy::is_complete(local)?;
    (copy == assembled).then_some(assembled)
}

impl EsxiDiskStore {
    pub(super) async fn warm_delta_state(&self, vmm: &VirtualMachineMigration, disk: usize) -> CopyState {
        let key = (delta_key_uid(&vmm.metadata.uid.clone().unwrap_or_default()), disk);
        // A failed delta copy never discards: the base copy under it is good.
        if let Some(state) = self.task_state(&key, "the delta copy task", false).await {
            return state;
        }
        match read_assembled(&self.local_path(vmm, disk)) {
            Some(m) => CopyState::Complete {
                size: m.size as i64,
                sha256: m.sha256,
                verified_remotely: m.verified,
                epoch: m.epoch,
                source: None,
            },
            None => CopyState::Absent,
        }
    }

    /// Copies disk `disk`'s deltas (the VM is off, so they no longer change)
    /// and assembles the disk from its base copy and them, in a task.
    pub(super) async fn warm_start_delta_copy(
        &self,
        vmm: &VirtualMachineMigration,
        disk: usize,
    ) -> Result<(), Failure> {
        let uid = vmm.metadata.uid.clone().unwrap_or_default();
        // Reserved before the first `.await` (the chains, the session), as a copy's start.
        let Some(reservation) = self.reserve((delta_key_uid(&uid), disk)) else {
            return Ok(());
        };
        let local = self.local_path(vmm, disk);
        if read_assembled(&local).is_some() {
            return Ok(());
        }
        let Some(copy::CopyMarker { verified: base_verified, sha256: base_sha256, .. }) =
            copy::is_complete(&local)
        else {
            return Err(Failure::retryable(
                Reason::AcquiredCopyMissing,
                format!("disk {disk}: no complete copy of its base to assemble on"),
            ));
        };
        let source = Self::disk_of(vmm, disk).ok_or_else(|| {
            Failure::retryable(Reason::InventoryMissing, format!("no disk {disk} in the inventory"))
        })?;
        let chains = self.hosts.disk_chains(vmm).await?;
        let chain = chains.get(disk).cloned().ok_or_else(|| {
            Failure::needs_human(Reason::SnapshotChainUnexpected, format!("the .vmx has no disk {disk} now"))
        })?;
        // Top first down to the base: the base must be the extent that was copied.
        let Some((base, deltas)) = chain.split_last() else {
            return Err(Failure::needs_human(
                Reason::SnapshotChainUnexpected,
                format!("disk {disk} has no chain"),
            ));
        };
        if base.extent_path != source.extent_path || deltas.is_empty() {
            return Err(Failure::needs_human(
                Reason::SnapshotChainUnexpected,
                format!(
                    "disk {disk}: expected deltas on top of {}, the host shows {:?}",
                    source.extent_path,
                    chain.iter().map(|l| l.descriptor_path.as_str()).collect::<Vec<_>>()
                ),
            ));
        }
        let mut levels = Vec::new();
        for (i, level) in deltas.iter().rev().enumerate() {
            let kind = DeltaKind::from_create_type(&level.create_type).ok_or_else(|| {
                Failure::needs_human(
                    Reason::SnapshotChainUnexpected,
                    format!("{} is not a delta", level.descriptor_path),
                )
            })?;
            // A name of its own: `with_extension` of the copy's name would share its markers.
            let stem = local.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            levels.push((
                kind,
                level.extent_path.clone(),
                local.with_file_name(format!("{stem}-delta-{}.vmdk", i + 1)),
            ));
        }
        let capacity = base.capacity_bytes;
        let session = self.hosts.session(vmm).await?;
        let (chunk_size, streams) = (self.config.chunk_size, self.config.streams);
        let epoch = vmm.status.as_ref().map_or(0, |s| s.epoch);
        self.spawn_copy(vmm, reservation, 0, move |progress| async move {
            let strides = (chunk_size, streams);
            let base = (base_sha256, base_verified, epoch);
            copy_and_assemble(session, &local, capacity, &levels, strides, base, progress).await
        });
        Ok(())
    }
}

/// Copies each delta (with the host's sha256), assembles the disk on the
/// base copy at `local`, and puts the result in its place with its markers.
async fn copy_and_assemble(
    session: Arc<Session>,
    local: &Path,
    capacity: u64,
    levels: &[(DeltaKind, String, PathBuf)],
    (chunk_size, streams): (u64, usize),
    (base_sha256, base_verified, epoch): (String, bool, i32),
    progress: Arc<AtomicU64>,
) -> Result<CopyResult, CopyError> {
    let mut verified = base_verified;
    let mut bytes_read = 0;
    let mut copied = Vec::new();
    for (kind, remote, delta_local) in levels {
        let plan =
            CopyPlan { chunk_size, streams, epoch, ..CopyPlan::new(remote.clone(), delta_local.clone()) };
        let done = copy::copy_disk(session.clone(), &plan, progress.clone()).await?;
        verified &= done.verified_remotely;
        bytes_read += done.bytes_read;
        copied.push((*kind, delta_local.clone()));
    }
    let work = local.with_extension("assembly");
    // An assembly found begun was interrupted: the copy in place is part
    // base, part assembled, and no longer the base whose sha256 its marker
    // says; the patch would claim a base it cannot name, so none is made.
    let base_known = !work.exists();
    // The deltas' ranges onto the base copy, in place: the disk at the
    // cutover, written in the time the deltas take, not the disk. Done only
    // once both markers say the new sha256 (the assembled one last); a
    // crash in between is redone from here, and applying the same deltas
    // again gives the same bytes.
    let _ = std::fs::remove_file(assembled_marker(local));
    let _ = std::fs::remove_file(patch_info_path(local));
    let changed = chain::apply(local, capacity, &copied, &work)
        .await
        .map_err(|e| CopyError::Io(std::io::Error::other(e.to_string())))?;
    // The changed ranges as the assembled disk holds them: what a volume
    // holding the base needs to become this disk.
    if base_known {
        let summary = crate::images::patch::write(local, &changed, &patch_path(local))?;
        let patch = DiskPatch {
            sha256: summary.sha256,
            ranges: summary.ranges as i64,
            bytes: summary.bytes as i64,
            base_sha256: base_sha256.clone(),
        };
        write_patch_info(local, &patch)?;
    }
    let sha = copy::sha256_file(local)?;
    let marker = copy::CopyMarker { size: capacity, sha256: sha.clone(), verified, epoch, source: None };
    std::fs::write(local.with_extension("sha256"), marker.line())?;
    std::fs::write(assembled_marker(local), marker.line())?;
    let _ = std::fs::remove_dir_all(&work);
    for (_, delta) in &copied {
        let _ = copy::discard(delta);
    }
    Ok(CopyResult { size: capacity, sha256: sha, verified_remotely: verified, bytes_read })
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
