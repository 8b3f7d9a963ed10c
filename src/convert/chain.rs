//! Builds a disk from local copies of its snapshot chain: the base extent
//! copied while the VM ran under a snapshot, and the deltas copied after the
//! cutover (seSparse from VMFS6, vmfsSparse from VMFS5). `qemu-img` reads
//! both delta formats; it is given descriptors written here, never the
//! host's: only the delta's type and the disk's size come from the host, the
//! file names are ours, so a hostile descriptor cannot point qemu-img at any
//! other file. The result is the raw disk a cold copy of the powered-off VM
//! would have given.

use super::qemu::{self, QemuError};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

/// A delta's format, as its descriptor's `createType` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaKind {
    VmfsSparse,
    SeSparse,
}

impl DeltaKind {
    /// From a descriptor's `createType`.
    pub fn from_create_type(create_type: &str) -> Option<DeltaKind> {
        match create_type {
            "vmfsSparse" => Some(DeltaKind::VmfsSparse),
            "seSparse" => Some(DeltaKind::SeSparse),
            _ => None,
        }
    }

    fn create_type(self) -> &'static str {
        match self {
            DeltaKind::VmfsSparse => "vmfsSparse",
            DeltaKind::SeSparse => "seSparse",
        }
    }

    fn extent_kind(self) -> &'static str {
        match self {
            DeltaKind::VmfsSparse => "VMFSSPARSE",
            DeltaKind::SeSparse => "SESPARSE",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("the disk is {expected} bytes, not a whole number of sectors")]
    NotSectors { expected: u64 },
    #[error("the assembled chain is {actual} bytes, but the source disk is {expected} bytes")]
    SizeMismatch { expected: u64, actual: u64 },
    #[error(transparent)]
    Qemu(#[from] QemuError),
    #[error("assembling the chain: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes to `output` (raw) the disk that the flat `base` with `deltas` on
/// top (lowest first: each delta's kind and its copied data file) holds.
/// `work` is an empty directory on the same file system as the copies
/// (they are hard-linked into it under names of our own).
pub async fn assemble(
    base: &Path,
    capacity: u64,
    deltas: &[(DeltaKind, PathBuf)],
    work: &Path,
    output: &Path,
) -> Result<(), ChainError> {
    if capacity == 0 || !capacity.is_multiple_of(512) {
        return Err(ChainError::NotSectors { expected: capacity });
    }
    let sectors = capacity / 512;
    std::fs::create_dir_all(work)?;
    let link = |from: &Path, name: &str| -> std::io::Result<()> {
        let to = work.join(name);
        let _ = std::fs::remove_file(&to);
        std::fs::hard_link(from, to)
    };
    link(base, "base-flat.vmdk")?;
    std::fs::write(
        work.join("base.vmdk"),
        format!(
            "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=00000001\nparentCID=ffffffff\n\
             createType=\"vmfs\"\n\n# Extent description\nRW {sectors} VMFS \"base-flat.vmdk\"\n"
        ),
    )?;
    let mut top = "base.vmdk".to_owned();
    for (i, (kind, data)) in deltas.iter().enumerate() {
        let data_name = format!("level-{}-data.vmdk", i + 1);
        link(data, &data_name)?;
        let name = format!("level-{}.vmdk", i + 1);
        std::fs::write(
            work.join(&name),
            format!(
                "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID={cid:08x}\nparentCID={parent:08x}\n\
                 createType=\"{}\"\nparentFileNameHint=\"{top}\"\n\n# Extent description\n\
                 RW {sectors} {} \"{data_name}\"\n",
                kind.create_type(),
                kind.extent_kind(),
                cid = i + 2,
                parent = i + 1,
            ),
        )?;
        top = name;
    }
    let top = work.join(top);
    // A delta's own header could claim another size: refuse before writing anything.
    let info = qemu::info(&top, Some("vmdk")).await?;
    if info.virtual_size != capacity {
        return Err(ChainError::SizeMismatch { expected: capacity, actual: info.virtual_size });
    }
    let partial = output.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    qemu::convert(&top, "vmdk", &partial, "raw", &AtomicU64::new(0)).await?;
    let actual = std::fs::metadata(&partial)?.len();
    if actual != capacity {
        let _ = std::fs::remove_file(&partial);
        return Err(ChainError::SizeMismatch { expected: capacity, actual });
    }
    std::fs::rename(&partial, output)?;
    Ok(())
}
