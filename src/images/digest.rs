//! Digests of files on the local disk: a copy or artifact's sha256
//! (`file_sha256`, reading and hashing at once), and what an imported
//! volume holds: the digest `vmmigrate verify-volume` takes of a volume CDI
//! filled, read back where the installed CDI cannot check a checksum itself.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The read size of `file_sha256`, and how many reads may wait for the hasher.
const READ: usize = 4 << 20;
const READS_AHEAD: usize = 2;

/// Size and sha256 (hex) of the file at `path`, adding the bytes hashed to
/// `progress` as it goes. A reader thread keeps the next reads coming while
/// this one hashes, so that a large file costs the hashing alone: on the
/// warm path this hash of the assembled disk is part of the downtime.
pub(crate) fn file_sha256(path: &Path, progress: Option<&AtomicU64>) -> io::Result<(u64, String)> {
    let mut file = File::open(path)?;
    let (to_hasher, filled) = std::sync::mpsc::sync_channel::<Vec<u8>>(READS_AHEAD);
    let (to_reader, emptied) = std::sync::mpsc::sync_channel::<Vec<u8>>(READS_AHEAD + 2);
    std::thread::scope(|scope| {
        let reader = scope.spawn(move || -> io::Result<()> {
            loop {
                let mut buffer = emptied.try_recv().unwrap_or_else(|_| vec![0u8; READ]);
                buffer.resize(READ, 0);
                let mut n = 0;
                // Whole reads but the last, so each send carries READ bytes.
                while n < READ {
                    match file.read(&mut buffer[n..]) {
                        Ok(0) => break,
                        Ok(got) => n += got,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                buffer.truncate(n);
                let last = n < READ;
                if n > 0 && to_hasher.send(buffer).is_err() {
                    return Ok(());
                }
                if last {
                    return Ok(());
                }
            }
        });
        let mut hasher = Sha256::new();
        let mut total = 0u64;
        for buffer in filled {
            hasher.update(&buffer);
            total += buffer.len() as u64;
            if let Some(p) = progress {
                p.fetch_add(buffer.len() as u64, Ordering::Relaxed);
            }
            let _ = to_reader.try_send(buffer);
        }
        reader.join().map_err(|_| io::Error::other("the reader panicked"))??;
        Ok((total, hex(&hasher.finalize())))
    })
}

/// What `vmmigrate verify-volume` found in an imported volume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeDigest {
    /// sha256 of the first `size` bytes (the disk), hex.
    pub sha256: String,
    pub size: u64,
    /// Bytes after the disk that are not zero (CDI grows a raw image to the
    /// volume's size with zeros; anything else there did not come from us).
    pub nonzero_tail_bytes: u64,
}

/// Hashes the first `size` bytes of `path` (an imported `disk.img` or a
/// block device) and counts the non-zero bytes after them.
pub fn volume_digest(path: &Path, size: u64) -> io::Result<VolumeDigest> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < size {
        let want = buf.len().min((size - done) as usize);
        let n = file.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} holds {done} bytes, the disk has {size}", path.display()),
            ));
        }
        hasher.update(&buf[..n]);
        done += n as u64;
    }
    let mut nonzero_tail_bytes = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        nonzero_tail_bytes += buf[..n].iter().filter(|b| **b != 0).count() as u64;
    }
    Ok(VolumeDigest { sha256: hex(&hasher.finalize()), size, nonzero_tail_bytes })
}

/// Lowercase hex of a digest.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_files_sha256_read_ahead_is_the_sha256_of_its_bytes_at_every_size() {
        let dir = tempfile::tempdir().unwrap();
        for size in [0, 1, READ - 1, READ, READ + 1, 3 * READ + 12_345] {
            let bytes: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            let path = dir.path().join(format!("f-{size}"));
            std::fs::write(&path, &bytes).unwrap();
            let progress = AtomicU64::new(0);
            let (total, sha) = file_sha256(&path, Some(&progress)).unwrap();
            assert_eq!((total, progress.load(Ordering::Relaxed)), (size as u64, size as u64));
            assert_eq!(sha, hex(&Sha256::digest(&bytes)), "{size} bytes");
        }
        assert!(file_sha256(&dir.path().join("absent"), None).is_err());
    }
}
