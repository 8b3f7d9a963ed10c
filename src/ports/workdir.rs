//! The layout of the work directory that the disk store (`source::esxi`)
//! writes and the artifact store (`convert`) reads: one place, so neither
//! adapter imports the other.
//!
//! ```text
//! copies/<namespace>/<name>/<uid>/disk-<n>.raw   acquired disk (+ .sha256 marker)
//! artifacts/<uid>/disk-<n>.<fmt>                  artifact (+ .sha256 marker)
//! staging/<uid>/disk-<n>.<fmt>                    what the staging server publishes
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
