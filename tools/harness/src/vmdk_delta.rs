//! The two snapshot delta formats an ESXi host writes, for the emulator's
//! snapshot engine: `vmfsSparse` (VMFS5, `<disk>-000001-delta.vmdk`, the
//! "COWD" sparse extent, 512-byte grains, 4096 32-bit entries per grain
//! table) and `seSparse` (VMFS6, `<disk>-000001-sesparse.vmdk`, 4 KiB grains,
//! 4096 64-bit entries per grain table, typed entries). Each file is what
//! QEMU's vmdk driver reads (`block/vmdk.c`: `vmdk_open_vmfs_sparse`,
//! `vmdk_open_se_sparse`, `get_cluster_offset`), so a delta written here is
//! read back by the real `qemu-img` as the VM's disk on top of its base.
//!
//! The engine writes guest blocks into a delta while the "VM" runs, and
//! consolidates it into the base flat extent when the snapshot is removed,
//! as ESXi does. All offsets in the headers are in 512-byte sectors.

use anyhow::{Context, ensure};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

const SECTOR: u64 = 512;
/// Entries per grain table, both formats.
const GT_ENTRIES: u64 = 4096;

const COWD_GRAIN_SECTORS: u64 = 1;
const COWD_GD_SECTOR: u64 = 4;

const SE_CONST_MAGIC: u64 = 0xcafe_babe;
const SE_VOLATILE_MAGIC: u64 = 0xcafe_cafe;
const SE_VERSION: u64 = 0x0000_0002_0000_0001;
const SE_GRAIN_SECTORS: u64 = 8;
const SE_GT_SECTORS: u64 = GT_ENTRIES * 8 / SECTOR;
const SE_GT_ALLOCATED: u64 = 0x1000_0000_0000_0000;
const SE_GRAIN_ALLOCATED: u64 = 0x3000_0000_0000_0000;

/// Which delta an ESXi host writes for a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaFormat {
    /// VMFS5: `-delta.vmdk`, `createType="vmfsSparse"`, extent `VMFSSPARSE`.
    VmfsSparse,
    /// VMFS6: `-sesparse.vmdk`, `createType="seSparse"`, extent `SESPARSE`.
    SeSparse,
}

impl DeltaFormat {
    /// The data file's suffix after the delta's stem.
    pub fn suffix(self) -> &'static str {
        match self {
            DeltaFormat::VmfsSparse => "-delta.vmdk",
            DeltaFormat::SeSparse => "-sesparse.vmdk",
        }
    }

    fn create_type(self) -> &'static str {
        match self {
            DeltaFormat::VmfsSparse => "vmfsSparse",
            DeltaFormat::SeSparse => "seSparse",
        }
    }

    fn extent_type(self) -> &'static str {
        match self {
            DeltaFormat::VmfsSparse => "VMFSSPARSE",
            DeltaFormat::SeSparse => "SESPARSE",
        }
    }

    /// Bytes per grain.
    pub fn grain_bytes(self) -> u64 {
        match self {
            DeltaFormat::VmfsSparse => COWD_GRAIN_SECTORS * SECTOR,
            DeltaFormat::SeSparse => SE_GRAIN_SECTORS * SECTOR,
        }
    }
}

/// The descriptor of a delta on top of `parent` (the parent's descriptor
/// file name, relative to the VM directory) whose CID is `parent_cid`.
pub fn descriptor(
    format: DeltaFormat,
    stem: &str,
    parent: &str,
    sectors: u64,
    cid: u32,
    parent_cid: u32,
) -> String {
    format!(
        "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID={cid:08x}\nparentCID={parent_cid:08x}\n\
         createType=\"{}\"\nparentFileNameHint=\"{parent}\"\n\n# Extent description\nRW {sectors} {} \"{stem}{}\"\n\n\
         # The Disk Data Base\n#DDB\n\nddb.grain = \"{}\"\nddb.longContentID = \"{:032x}\"\n",
        format.create_type(),
        format.extent_type(),
        format.suffix(),
        format.grain_bytes() / SECTOR,
        cid as u128 * 0x1_0000_0001,
    )
}

/// An open delta extent: its layout, and where the next grain goes.
pub struct Delta {
    file: File,
    format: DeltaFormat,
    capacity_sectors: u64,
    /// Sector of the first grain table (all are preallocated, in order).
    tables: u64,
    /// Sector where grains start (seSparse) or the next free sector (vmfsSparse).
    grains: u64,
    /// Grains allocated so far.
    allocated: u64,
}

impl Delta {
    /// Creates an empty delta of `capacity_sectors` at `path` (no grain allocated).
    pub fn create(path: &Path, format: DeltaFormat, capacity_sectors: u64) -> anyhow::Result<Delta> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .with_context(|| path.display().to_string())?;
        let grain_sectors = format.grain_bytes() / SECTOR;
        let gts = capacity_sectors.div_ceil(GT_ENTRIES * grain_sectors);
        let delta = match format {
            DeltaFormat::VmfsSparse => {
                let gd_sectors = (gts * 4).div_ceil(SECTOR);
                let tables = COWD_GD_SECTOR + gd_sectors;
                let table_sectors = GT_ENTRIES * 4 / SECTOR;
                let grains = tables + gts * table_sectors;
                // Header: "COWD", then version, flags, capacity, grain size,
                // grain directory offset and entries, next free sector, and a
                // geometry (all little-endian 32-bit).
                let mut header = vec![0u8; (COWD_GD_SECTOR * SECTOR) as usize];
                header[..4].copy_from_slice(b"COWD");
                let fields: [u32; 10] = [
                    1,
                    3,
                    u32::try_from(capacity_sectors).context("vmfsSparse holds at most 2 TiB")?,
                    COWD_GRAIN_SECTORS as u32,
                    COWD_GD_SECTOR as u32,
                    gts as u32,
                    grains as u32,
                    (capacity_sectors / (255 * 63)).min(u32::MAX as u64) as u32,
                    255,
                    63,
                ];
                for (i, v) in fields.iter().enumerate() {
                    header[4 + i * 4..8 + i * 4].copy_from_slice(&v.to_le_bytes());
                }
                file.write_all_at(&header, 0)?;
                let gd: Vec<u8> =
                    (0..gts).flat_map(|i| ((tables + i * table_sectors) as u32).to_le_bytes()).collect();
                file.write_all_at(&gd, COWD_GD_SECTOR * SECTOR)?;
                file.set_len(grains * SECTOR)?;
                Delta { file, format, capacity_sectors, tables, grains, allocated: 0 }
            }
            DeltaFormat::SeSparse => {
                let gd_sectors = (gts * 8).div_ceil(SECTOR).max(1);
                let gd = 4;
                let tables = gd + gd_sectors;
                let grains = tables + gts * SE_GT_SECTORS;
                let data_sectors = capacity_sectors.div_ceil(SE_GRAIN_SECTORS) * SE_GRAIN_SECTORS;
                let mut header = [0u8; SECTOR as usize];
                let fields: [u64; 26] = [
                    SE_CONST_MAGIC,
                    SE_VERSION,
                    capacity_sectors,
                    SE_GRAIN_SECTORS,
                    SE_GT_SECTORS,
                    0,
                    0,
                    0,
                    0,
                    0,
                    1, // volatile header
                    1,
                    2, // journal header
                    1,
                    3, // journal
                    1,
                    gd,
                    gd_sectors,
                    tables,
                    gts * SE_GT_SECTORS,
                    0, // free bitmap, backmap: not kept by this writer
                    0,
                    0,
                    0,
                    grains,
                    data_sectors,
                ];
                for (i, v) in fields.iter().enumerate() {
                    header[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
                }
                file.write_all_at(&header, 0)?;
                let mut volatile = [0u8; SECTOR as usize];
                volatile[..8].copy_from_slice(&SE_VOLATILE_MAGIC.to_le_bytes());
                volatile[8..16].copy_from_slice(&gts.to_le_bytes());
                volatile[16..24].copy_from_slice(&1u64.to_le_bytes());
                file.write_all_at(&volatile, SECTOR)?;
                let directory: Vec<u8> = (0..gts).flat_map(|i| (SE_GT_ALLOCATED | i).to_le_bytes()).collect();
                file.write_all_at(&directory, gd * SECTOR)?;
                file.set_len(grains * SECTOR)?;
                Delta { file, format, capacity_sectors, tables, grains, allocated: 0 }
            }
        };
        Ok(delta)
    }

    /// Opens a delta this module wrote.
    pub fn open(path: &Path, format: DeltaFormat) -> anyhow::Result<Delta> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| path.display().to_string())?;
        let mut header = [0u8; SECTOR as usize];
        file.read_exact_at(&mut header, 0)?;
        let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap()) as u64;
        let u64_at = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap());
        let mut delta = match format {
            DeltaFormat::VmfsSparse => {
                ensure!(&header[..4] == b"COWD", "{} is not a vmfsSparse extent", path.display());
                let capacity_sectors = u32_at(12);
                let gd = u32_at(20);
                let gts = u32_at(24);
                let tables = gd + (gts * 4).div_ceil(SECTOR);
                let grains = tables + gts * (GT_ENTRIES * 4 / SECTOR);
                Delta { file, format, capacity_sectors, tables, grains, allocated: 0 }
            }
            DeltaFormat::SeSparse => {
                ensure!(u64_at(0) == SE_CONST_MAGIC, "{} is not a seSparse extent", path.display());
                Delta {
                    file,
                    format,
                    capacity_sectors: u64_at(16),
                    tables: u64_at(144),
                    grains: u64_at(192),
                    allocated: 0,
                }
            }
        };
        delta.allocated = delta.mapped().len() as u64;
        Ok(delta)
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_sectors * SECTOR
    }

    fn entry_bytes(&self) -> u64 {
        match self.format {
            DeltaFormat::VmfsSparse => 4,
            DeltaFormat::SeSparse => 8,
        }
    }

    /// The byte offset of grain `index`'s grain-table entry.
    fn entry_offset(&self, index: u64) -> u64 {
        self.tables * SECTOR + index * self.entry_bytes()
    }

    /// Where grain `index` of the disk lives in this file, if written here.
    fn lookup(&self, index: u64) -> std::io::Result<Option<u64>> {
        let at = self.entry_offset(index);
        Ok(match self.format {
            DeltaFormat::VmfsSparse => {
                let mut e = [0u8; 4];
                self.file.read_exact_at(&mut e, at)?;
                let sector = u32::from_le_bytes(e) as u64;
                (sector != 0).then_some(sector * SECTOR)
            }
            DeltaFormat::SeSparse => {
                let mut e = [0u8; 8];
                self.file.read_exact_at(&mut e, at)?;
                let e = u64::from_le_bytes(e);
                if e & 0xf000_0000_0000_0000 != SE_GRAIN_ALLOCATED {
                    None
                } else {
                    let grain = ((e & 0x0fff_0000_0000_0000) >> 48) | ((e & 0x0000_ffff_ffff_ffff) << 12);
                    Some((self.grains + grain * SE_GRAIN_SECTORS) * SECTOR)
                }
            }
        })
    }

    /// Writes `data` at byte `offset` of the disk, whole grains only
    /// (`offset` and the length are multiples of the grain size).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        let grain = self.format.grain_bytes();
        ensure!(
            offset.is_multiple_of(grain) && (data.len() as u64).is_multiple_of(grain),
            "writes are whole grains"
        );
        ensure!(offset + data.len() as u64 <= self.capacity_bytes(), "write past the end of the disk");
        for (i, chunk) in data.chunks(grain as usize).enumerate() {
            let index = offset / grain + i as u64;
            let at = match self.lookup(index)? {
                Some(at) => at,
                None => self.allocate(index)?,
            };
            self.file.write_all_at(chunk, at)?;
        }
        Ok(())
    }

    /// Appends a grain for disk grain `index` and records it in its table.
    fn allocate(&mut self, index: u64) -> anyhow::Result<u64> {
        let n = self.allocated;
        self.allocated += 1;
        let (at, entry) = match self.format {
            DeltaFormat::VmfsSparse => {
                let sector = self.grains + n * COWD_GRAIN_SECTORS;
                (sector * SECTOR, (sector as u32).to_le_bytes().to_vec())
            }
            DeltaFormat::SeSparse => {
                let entry = SE_GRAIN_ALLOCATED | ((n & 0xfff) << 48) | ((n >> 12) & 0x0000_ffff_ffff_ffff);
                ((self.grains + n * SE_GRAIN_SECTORS) * SECTOR, entry.to_le_bytes().to_vec())
            }
        };
        // The grain first, then its entry: a reader never sees an entry without data.
        self.file.write_all_at(&vec![0u8; self.format.grain_bytes() as usize], at)?;
        self.file.write_all_at(&entry, self.entry_offset(index))?;
        if self.format == DeltaFormat::VmfsSparse {
            // The header's next free sector.
            let next = (self.grains + self.allocated * COWD_GRAIN_SECTORS) as u32;
            self.file.write_all_at(&next.to_le_bytes(), 28)?;
        }
        Ok(at)
    }

    /// Reads the grain at byte `disk_at` of the disk (written here) into `buf` (one grain).
    pub fn read_disk(&self, disk_at: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        let grain = self.format.grain_bytes();
        let at = self
            .lookup(disk_at / grain)?
            .with_context(|| format!("grain at {disk_at} is not in this delta"))?;
        self.file.read_exact_at(buf, at)?;
        Ok(())
    }

    /// Every grain written here: `(byte offset in the disk, byte offset in this file)`, in disk order.
    pub fn mapped(&self) -> Vec<(u64, u64)> {
        let grain = self.format.grain_bytes();
        let grains = self.capacity_bytes().div_ceil(grain);
        let mut table = vec![0u8; (grains * self.entry_bytes()) as usize];
        if self.file.read_exact_at(&mut table, self.tables * SECTOR).is_err() {
            return Vec::new();
        }
        (0..grains)
            .filter_map(|index| {
                let e = &table
                    [(index * self.entry_bytes()) as usize..((index + 1) * self.entry_bytes()) as usize];
                let at = match self.format {
                    DeltaFormat::VmfsSparse => {
                        let sector = u32::from_le_bytes(e.try_into().unwrap()) as u64;
                        (sector != 0).then_some(sector * SECTOR)
                    }
                    DeltaFormat::SeSparse => {
                        let e = u64::from_le_bytes(e.try_into().unwrap());
                        (e & 0xf000_0000_0000_0000 == SE_GRAIN_ALLOCATED).then(|| {
                            let g = ((e & 0x0fff_0000_0000_0000) >> 48) | ((e & 0x0000_ffff_ffff_ffff) << 12);
                            (self.grains + g * SE_GRAIN_SECTORS) * SECTOR
                        })
                    }
                };
                at.map(|at| (index * grain, at))
            })
            .collect()
    }

    /// Writes every grain of this delta into `base` (the flat extent below
    /// it): what removing the snapshot does on the host. Returns the bytes written.
    pub fn consolidate_into(&self, base: &Path) -> anyhow::Result<u64> {
        let flat = OpenOptions::new().write(true).open(base).with_context(|| base.display().to_string())?;
        let grain = self.format.grain_bytes() as usize;
        let mut buf = vec![0u8; grain];
        let mut written = 0;
        for (disk_at, file_at) in self.mapped() {
            self.file.read_exact_at(&mut buf, file_at)?;
            flat.write_all_at(&buf, disk_at)?;
            written += grain as u64;
        }
        flat.sync_all()?;
        Ok(written)
    }
}
