//! What an imported volume holds: the digest `vmmigrate verify-volume`
//! takes of a volume CDI filled, read back where the installed CDI cannot
//! check a checksum itself.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

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
