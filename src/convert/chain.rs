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
    #[error("delta {level}: {what}")]
    BadDelta { level: usize, what: String },
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

/// Applies `deltas` (lowest first: each delta's kind and its copied data
/// file) onto `base` in place: every range a delta holds is written into
/// the base copy, nothing else is touched. The same disk as [`assemble`]
/// gives, in the time the deltas take rather than the disk. qemu-img reads
/// each delta on its own (a descriptor without a parent) and says where its
/// ranges are (`qemu-img map`); the bytes are then read from the copied
/// delta at those offsets, each range checked against the disk's and the
/// file's size. Applying the same deltas again gives the same bytes.
pub async fn apply(
    base: &Path,
    capacity: u64,
    deltas: &[(DeltaKind, PathBuf)],
    work: &Path,
) -> Result<(), ChainError> {
    use std::os::unix::fs::FileExt;
    if capacity == 0 || !capacity.is_multiple_of(512) {
        return Err(ChainError::NotSectors { expected: capacity });
    }
    let sectors = capacity / 512;
    std::fs::create_dir_all(work)?;
    let target = std::fs::OpenOptions::new().write(true).open(base)?;
    if target.metadata()?.len() != capacity {
        return Err(ChainError::SizeMismatch { expected: capacity, actual: target.metadata()?.len() });
    }
    for (i, (kind, data)) in deltas.iter().enumerate() {
        let level = i + 1;
        let bad = |what: String| ChainError::BadDelta { level, what };
        let data_name = format!("alone-{level}-data.vmdk");
        let data_link = work.join(&data_name);
        let _ = std::fs::remove_file(&data_link);
        std::fs::hard_link(data, &data_link)?;
        let descriptor = work.join(format!("alone-{level}.vmdk"));
        std::fs::write(
            &descriptor,
            format!(
                "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID={level:08x}\nparentCID=ffffffff\n\
                 createType=\"{}\"\n\n# Extent description\nRW {sectors} {} \"{data_name}\"\n",
                kind.create_type(),
                kind.extent_kind(),
            ),
        )?;
        let info = qemu::info(&descriptor, Some("vmdk")).await?;
        if info.virtual_size != capacity {
            return Err(ChainError::SizeMismatch { expected: capacity, actual: info.virtual_size });
        }
        let source = std::fs::File::open(data)?;
        let source_len = source.metadata()?.len();
        let mut buf = vec![0u8; 1 << 20];
        for range in qemu::map(&descriptor, "vmdk").await?.into_iter().filter(|r| r.present) {
            let end = range.start.checked_add(range.length).filter(|&e| e <= capacity);
            if end.is_none() {
                return Err(bad(format!(
                    "a range at {} of {} bytes ends past the disk",
                    range.start, range.length
                )));
            }
            let mut done = 0;
            while done < range.length {
                let n = ((range.length - done) as usize).min(buf.len());
                if range.data {
                    let offset = range
                        .offset
                        .ok_or_else(|| bad(format!("data at {} without an offset", range.start)))?;
                    let from = offset.checked_add(done).filter(|&o| o.saturating_add(n as u64) <= source_len);
                    let from =
                        from.ok_or_else(|| bad(format!("data at {} lies past the file", range.start)))?;
                    source.read_exact_at(&mut buf[..n], from)?;
                } else if range.zero {
                    buf[..n].fill(0);
                } else {
                    return Err(bad(format!("a range at {} is neither data nor zero", range.start)));
                }
                target.write_all_at(&buf[..n], range.start + done)?;
                done += n as u64;
            }
        }
    }
    target.sync_all()?;
    Ok(())
}
