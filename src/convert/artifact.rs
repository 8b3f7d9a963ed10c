//! Artifact bookkeeping shared by the converter, the staging server and the
//! `vmmigrate convert` command: the `.sha256` marker written last (its
//! presence means "complete and validated"), the `.corrupt` marker the
//! staging server leaves when served bytes differ, and hashing with progress.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// What the `.sha256` marker records about a finished artifact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Marker {
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

fn with_suffix(file: &Path, suffix: &str) -> PathBuf {
    let mut name = file.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(suffix);
    file.with_file_name(name)
}

/// `<file>.sha256`.
pub fn marker_path(file: &Path) -> PathBuf {
    with_suffix(file, ".sha256")
}

/// `<file>.corrupt`.
pub fn corrupt_path(file: &Path) -> PathBuf {
    with_suffix(file, ".corrupt")
}

/// `<file>.partial`: where output is written before the rename.
pub fn partial_path(file: &Path) -> PathBuf {
    with_suffix(file, ".partial")
}

/// Whether `s` is 64 lowercase hex digits.
pub(crate) fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Reads `<file>.sha256` ("<size> <sha256>\n"). `None` when absent or malformed.
pub fn read_marker(file: &Path) -> Option<Marker> {
    let text = fs::read_to_string(marker_path(file)).ok()?;
    let mut parts = text.split_whitespace();
    let size = parts.next()?.parse().ok()?;
    let sha256 = parts.next()?.to_owned();
    is_sha256_hex(&sha256).then_some(Marker { size, sha256 })
}

/// Writes `<file>.sha256` atomically (temporary file, fsync, rename).
pub fn write_marker(file: &Path, marker: &Marker) -> io::Result<()> {
    let path = marker_path(file);
    let tmp = with_suffix(&path, ".tmp");
    {
        let mut f = File::create(&tmp)?;
        writeln!(f, "{} {}", marker.size, marker.sha256)?;
        f.sync_all()?;
    }
    fs::rename(tmp, path)
}

/// Whether the marker is at least as new as the data: a file written after
/// its checksum was recorded is no longer known to match it.
pub(crate) fn marker_is_fresh(file: &Path, marker_file: &Path) -> bool {
    let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    match (modified(file), modified(marker_file)) {
        (Some(data), Some(marker)) => marker >= data,
        _ => false,
    }
}

/// Removes `file` if present. "Not found" is success.
pub(crate) fn remove_if_present(file: &Path) -> io::Result<()> {
    match fs::remove_file(file) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Removes a file with its `.sha256`, `.corrupt` and `.partial` companions.
pub(crate) fn remove_with_markers(file: &Path) -> io::Result<()> {
    for path in [file.to_path_buf(), marker_path(file), corrupt_path(file), partial_path(file)] {
        remove_if_present(&path)?;
    }
    Ok(())
}

/// Size and sha256 of a file, adding the bytes read to `progress` as it goes.
pub fn sha256_file(
    path: &Path,
    progress: Option<&std::sync::atomic::AtomicU64>,
) -> io::Result<(u64, String)> {
    crate::images::digest::file_sha256(path, progress)
}

pub(crate) use crate::images::digest::hex;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_round_trips_and_rejects_malformed_text() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk-0.raw");
        fs::write(&file, b"abc").unwrap();
        let (size, sha) = sha256_file(&file, None).unwrap();
        assert_eq!(size, 3);
        assert_eq!(sha, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        write_marker(&file, &Marker { size, sha256: sha.clone() }).unwrap();
        assert_eq!(read_marker(&file), Some(Marker { size: 3, sha256: sha }));
        fs::write(marker_path(&file), "3 not-a-sha\n").unwrap();
        assert_eq!(read_marker(&file), None);
    }

    #[test]
    fn data_written_after_the_marker_makes_it_stale() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk-0.raw");
        fs::write(&file, b"abc").unwrap();
        write_marker(&file, &Marker { size: 3, sha256: "0".repeat(64) }).unwrap();
        assert!(marker_is_fresh(&file, &marker_path(&file)));
        // Make the data visibly newer than the marker, whatever the clock's granularity.
        let later =
            fs::metadata(marker_path(&file)).unwrap().modified().unwrap() + std::time::Duration::from_secs(1);
        File::options().write(true).open(&file).unwrap().set_modified(later).unwrap();
        assert!(!marker_is_fresh(&file, &marker_path(&file)));
    }

    #[test]
    fn removing_with_markers_removes_every_companion_and_tolerates_absence() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk-1.qcow2");
        for p in [file.clone(), marker_path(&file), corrupt_path(&file), partial_path(&file)] {
            fs::write(p, b"x").unwrap();
        }
        remove_with_markers(&file).unwrap();
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        remove_with_markers(&file).unwrap();
    }
}
