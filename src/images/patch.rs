//! A disk's changes as one stream: the ranges a warm migration's deltas
//! wrote, each followed by its bytes as the assembled disk holds them. A
//! volume filled with the disk's base before the cutover becomes the
//! assembled disk by writing the patch's ranges, and nothing else: what
//! moves after the cutover follows the changed bytes, not the disk.
//!
//! The stream is, for each range in ascending order of offset, none
//! overlapping the one before: a 16-byte header (the offset and the length,
//! each a little-endian u64) and `length` bytes. It ends after the last
//! range's bytes. A range is at most [`MAX_RANGE`] bytes (longer runs are
//! split), so a reader never holds more than that. The sha256 of the whole
//! stream (headers included) is the patch's: the writer computes it from
//! the local disk, the reader of the staged copy recomputes it as it
//! writes, and the two are compared.

use sha2::{Digest, Sha256};
use std::io::{self, Write};
use std::path::Path;

/// The longest range one header may announce.
pub(crate) const MAX_RANGE: u64 = 16 << 20;
const HEADER: usize = 16;

/// What a patch holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PatchSummary {
    /// sha256 of the stream, hex.
    pub sha256: String,
    /// Ranges in the stream (after splitting at [`MAX_RANGE`]).
    pub ranges: u64,
    /// The disk bytes it carries (the stream is 16 bytes a range longer).
    pub bytes: u64,
}

/// `ranges` (offset, length) sorted, overlapping and touching ones merged,
/// empty ones dropped.
pub(crate) fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, length) in ranges {
        let end = start.saturating_add(length);
        match merged.last_mut() {
            Some((s, l)) if *s + *l >= start => *l = (*l).max(end - *s),
            _ => merged.push((start, length)),
        }
    }
    merged
}

/// Writes the patch of `ranges` (merged, within the disk) read from the
/// disk image `disk` into `out`, through `<out>.partial` renamed at the end.
pub(crate) fn write(disk: &Path, ranges: &[(u64, u64)], out: &Path) -> io::Result<PatchSummary> {
    use std::os::unix::fs::FileExt;
    let source = std::fs::File::open(disk)?;
    let size = source.metadata()?.len();
    let partial = out.with_extension("partial");
    let mut sink = io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&partial)?);
    let mut hasher = Sha256::new();
    let mut summary = PatchSummary::default();
    let mut buffer = vec![0u8; MAX_RANGE as usize];
    for &(start, length) in ranges {
        if start.checked_add(length).is_none_or(|end| end > size) {
            return Err(io::Error::other(format!("a range at {start} of {length} bytes ends past the disk")));
        }
        let mut done = 0;
        while done < length {
            let n = (length - done).min(MAX_RANGE);
            let mut header = [0u8; HEADER];
            header[..8].copy_from_slice(&(start + done).to_le_bytes());
            header[8..].copy_from_slice(&n.to_le_bytes());
            let bytes = &mut buffer[..n as usize];
            source.read_exact_at(bytes, start + done)?;
            for part in [&header[..], &bytes[..]] {
                hasher.update(part);
                sink.write_all(part)?;
            }
            summary.ranges += 1;
            summary.bytes += n;
            done += n;
        }
    }
    let file = sink.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    std::fs::rename(&partial, out)?;
    summary.sha256 = super::digest::hex(&hasher.finalize());
    Ok(summary)
}

/// Why a patch stream was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum PatchError {
    #[error("range {index}: {length} bytes at {offset} {why}")]
    BadRange { index: u64, offset: u64, length: u64, why: &'static str },
    #[error("the patch ends inside range {index}")]
    Truncated { index: u64 },
    #[error("writing range {index}: {message}")]
    Write { index: u64, message: String },
}

/// Reads a patch stream as it arrives, checks every header against the
/// disk's size and the range before, and hands each range's bytes (in
/// pieces, as received) to a writer.
pub(crate) struct Applier {
    size: u64,
    hasher: Sha256,
    header: Vec<u8>,
    /// The range being received: where its next byte goes and how many remain.
    data: Option<(u64, u64)>,
    /// Where the previous range ended: the next must start there or later.
    end: u64,
    summary: PatchSummary,
}

impl Applier {
    /// For a disk of `size` bytes.
    pub(crate) fn new(size: u64) -> Applier {
        Applier {
            size,
            hasher: Sha256::new(),
            header: Vec::with_capacity(HEADER),
            data: None,
            end: 0,
            summary: PatchSummary::default(),
        }
    }

    /// Takes the next bytes of the stream; `write(offset, bytes)` puts a
    /// piece of a range on the disk.
    pub(crate) fn feed(
        &mut self,
        mut input: &[u8],
        write: &mut impl FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> Result<(), PatchError> {
        self.hasher.update(input);
        while !input.is_empty() {
            match &mut self.data {
                Some((at, remaining)) => {
                    let n = (*remaining).min(input.len() as u64) as usize;
                    let index = self.summary.ranges;
                    write(*at, &input[..n])
                        .map_err(|e| PatchError::Write { index, message: e.to_string() })?;
                    *at += n as u64;
                    *remaining -= n as u64;
                    self.summary.bytes += n as u64;
                    input = &input[n..];
                    if *remaining == 0 {
                        self.data = None;
                        self.summary.ranges += 1;
                    }
                }
                None => {
                    let n = (HEADER - self.header.len()).min(input.len());
                    self.header.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.header.len() == HEADER {
                        self.start_range()?;
                    }
                }
            }
        }
        Ok(())
    }

    fn start_range(&mut self) -> Result<(), PatchError> {
        let offset = u64::from_le_bytes(self.header[..8].try_into().expect("8 bytes"));
        let length = u64::from_le_bytes(self.header[8..].try_into().expect("8 bytes"));
        self.header.clear();
        let bad = |why| PatchError::BadRange { index: self.summary.ranges, offset, length, why };
        if length == 0 || length > MAX_RANGE {
            return Err(bad("is empty or longer than a range may be"));
        }
        if offset < self.end {
            return Err(bad("starts before the range above ended"));
        }
        match offset.checked_add(length) {
            Some(end) if end <= self.size => self.end = end,
            _ => return Err(bad("ends past the disk")),
        }
        self.data = Some((offset, length));
        Ok(())
    }

    /// The stream ended: what it held, or why it is not whole.
    pub(crate) fn finish(self) -> Result<PatchSummary, PatchError> {
        if self.data.is_some() || !self.header.is_empty() {
            return Err(PatchError::Truncated { index: self.summary.ranges });
        }
        Ok(PatchSummary { sha256: super::digest::hex(&self.hasher.finalize()), ..self.summary })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(dir: &Path, bytes: &[u8]) -> std::path::PathBuf {
        let path = dir.join("disk.raw");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn apply(stream: &[u8], size: usize, piece: usize) -> Result<(Vec<u8>, PatchSummary), PatchError> {
        let mut volume = vec![0u8; size];
        let mut applier = Applier::new(size as u64);
        for chunk in stream.chunks(piece) {
            applier.feed(chunk, &mut |at, bytes| {
                volume[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
                Ok(())
            })?;
        }
        Ok((volume, applier.finish()?))
    }

    #[test]
    fn ranges_are_sorted_and_merged_where_they_overlap_or_touch() {
        assert_eq!(
            merge(vec![(8, 4), (0, 4), (4, 2), (20, 0), (30, 5), (32, 1)]),
            vec![(0, 6), (8, 4), (30, 5)]
        );
        assert_eq!(merge(vec![(0, 10), (2, 3)]), vec![(0, 10)]);
    }

    #[test]
    fn a_base_with_the_patch_applied_is_the_disk_the_patch_was_read_from() {
        let dir = tempfile::tempdir().unwrap();
        let base: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let mut changed = base.clone();
        changed[100..612].fill(7);
        changed[4000..4096].fill(9);
        let ranges = merge(vec![(100, 512), (4000, 96)]);
        let out = dir.path().join("disk.patch");
        let summary = write(&disk(dir.path(), &changed), &ranges, &out).unwrap();
        assert_eq!((summary.ranges, summary.bytes), (2, 608));
        let stream = std::fs::read(&out).unwrap();
        assert_eq!(stream.len(), 608 + 2 * HEADER);
        for piece in [1, 7, 4096] {
            let mut volume = base.clone();
            let mut applier = Applier::new(volume.len() as u64);
            for chunk in stream.chunks(piece) {
                applier
                    .feed(chunk, &mut |at, bytes| {
                        volume[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
                        Ok(())
                    })
                    .unwrap();
            }
            assert_eq!(applier.finish().unwrap(), summary, "fed {piece} bytes at a time");
            assert_eq!(volume, changed);
        }
    }

    #[test]
    fn a_long_run_is_split_into_ranges_no_reader_must_hold_whole() {
        let dir = tempfile::tempdir().unwrap();
        let size = (MAX_RANGE * 2 + 512) as usize;
        let changed = vec![5u8; size];
        let out = dir.path().join("disk.patch");
        let summary = write(&disk(dir.path(), &changed), &[(0, size as u64)], &out).unwrap();
        assert_eq!((summary.ranges, summary.bytes), (3, size as u64));
        let (volume, read) = apply(&std::fs::read(&out).unwrap(), size, 1 << 20).unwrap();
        assert_eq!(read, summary);
        assert!(volume == changed);
    }

    fn header(offset: u64, length: u64) -> Vec<u8> {
        [offset.to_le_bytes(), length.to_le_bytes()].concat()
    }

    #[test]
    fn a_range_past_the_disk_overlapping_or_too_long_is_refused_before_any_of_it_is_written() {
        let past = [header(60, 8), vec![1; 8]].concat();
        assert!(matches!(apply(&past, 64, 5), Err(PatchError::BadRange { why: "ends past the disk", .. })));
        let wraps = [header(u64::MAX - 2, 8), vec![1; 8]].concat();
        assert!(matches!(apply(&wraps, 64, 5), Err(PatchError::BadRange { why: "ends past the disk", .. })));
        let overlapping = [header(0, 8), vec![1; 8], header(4, 4), vec![2; 4]].concat();
        assert!(matches!(apply(&overlapping, 64, 3), Err(PatchError::BadRange { index: 1, .. })));
        let long = [header(0, MAX_RANGE + 1)].concat();
        assert!(matches!(apply(&long, usize::MAX >> 40, 16), Err(PatchError::BadRange { .. })));
        let empty = header(0, 0);
        assert!(matches!(apply(&empty, 64, 16), Err(PatchError::BadRange { .. })));
    }

    #[test]
    fn a_stream_cut_inside_a_header_or_a_range_is_truncated() {
        let whole = [header(0, 8), vec![1; 8]].concat();
        assert_eq!(apply(&whole[..20], 64, 4).unwrap_err(), PatchError::Truncated { index: 0 });
        assert_eq!(apply(&whole[..10], 64, 4).unwrap_err(), PatchError::Truncated { index: 0 });
        let (_, empty) = apply(&[], 64, 4).unwrap();
        assert_eq!((empty.ranges, empty.bytes), (0, 0), "no change is an empty patch");
    }
}
