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

/// Applies `deltas` (lowest first: each delta's kind and its copied data
/// file) onto `base` in place: every range a delta holds is written into
/// the base copy, nothing else is touched: the disk the chain describes, in
/// the time the deltas take rather than the disk. qemu-img reads
/// each delta on its own (a descriptor without a parent) and says where its
/// ranges are (`qemu-img map`); the bytes are then read from the copied
/// delta at those offsets, each range checked against the disk's and the
/// file's size. Applying the same deltas again gives the same bytes.
/// Returns the ranges written, merged (`patch::merge`): what differs from
/// the base.
pub async fn apply(
    base: &Path,
    capacity: u64,
    deltas: &[(DeltaKind, PathBuf)],
    work: &Path,
) -> Result<Vec<(u64, u64)>, ChainError> {
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
    let mut written = Vec::new();
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
            written.push((range.start, range.length));
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
    Ok(super::patch::merge(written))
}
