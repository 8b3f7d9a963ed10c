//! The layout of the work directory that the disk store (`source::esxi`)
//! writes and the artifact store (`convert`) reads: one place, so neither
//! adapter imports the other.
//!
//! ```text
//! copies/<namespace>/<name>/<uid>/disk-<n>.raw   acquired disk (+ .sha256 marker)
//!                                      .patch     warm: the ranges changed since the base
//!                                      .patch-info  "sha256 ranges bytes base-sha256"
//! artifacts/<uid>/disk-<n>.<fmt>                  artifact (+ .sha256 marker)
//! staging/<uid>/disk-<n>.<fmt>                    what the staging server publishes
//! staging/<uid>/disk-<n>.raw.base, .raw.patch     warm: the base, the patch
//! ```

use crate::api::VirtualMachineMigration;
use kube::ResourceExt;
use std::path::{Path, PathBuf};

/// The root of the acquired copies under a work directory.
pub(crate) fn copies_root(work_dir: &Path) -> PathBuf {
    work_dir.join("copies")
}

/// Where the copies of one migration live under the copies root:
/// `<root>/<namespace>/<name>/<uid>`.
pub(crate) fn migration_copies_dir(root: &Path, vmm: &VirtualMachineMigration) -> PathBuf {
    let safe = |s: String| s.replace(['/', '.'], "_");
    root.join(safe(vmm.namespace().unwrap_or_default()))
        .join(safe(vmm.name_any()))
        .join(safe(vmm.metadata.uid.clone().unwrap_or_default()))
}

/// The local copy of disk `disk`: `<root>/<namespace>/<name>/<uid>/disk-<n>.raw`.
/// Its marker (`size sha256 [verified]`) is the same path with extension `sha256`.
pub(crate) fn copy_path(root: &Path, vmm: &VirtualMachineMigration, disk: usize) -> PathBuf {
    migration_copies_dir(root, vmm).join(format!("disk-{disk}.raw"))
}

/// `disk-<n>.patch` beside the copy: the ranges a warm migration's deltas
/// changed, as the assembled disk holds them (`images::patch`).
pub(crate) fn patch_path(copy: &Path) -> PathBuf {
    copy.with_extension("patch")
}

/// `disk-<n>.patch-info`: the patch's "sha256 ranges bytes base-sha256".
pub(crate) fn patch_info_path(copy: &Path) -> PathBuf {
    copy.with_extension("patch-info")
}

/// Records the patch beside `copy` (after the patch itself is written).
pub(crate) fn write_patch_info(copy: &Path, patch: &crate::api::DiskPatch) -> std::io::Result<()> {
    let line = format!("{} {} {} {}\n", patch.sha256, patch.ranges, patch.bytes, patch.base_sha256);
    std::fs::write(patch_info_path(copy), line)
}

/// The patch beside `copy`, where one was written whole.
pub(crate) fn read_patch_info(copy: &Path) -> Option<crate::api::DiskPatch> {
    let info = std::fs::read_to_string(patch_info_path(copy)).ok()?;
    let [sha256, ranges, bytes, base_sha256] = info.split_whitespace().collect::<Vec<_>>().try_into().ok()?;
    let hex = |s: &str| s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let patch = crate::api::DiskPatch {
        sha256: sha256.to_owned(),
        ranges: ranges.parse().ok()?,
        bytes: bytes.parse().ok()?,
        base_sha256: base_sha256.to_owned(),
    };
    (hex(sha256) && hex(base_sha256) && patch_path(copy).is_file()).then_some(patch)
}
