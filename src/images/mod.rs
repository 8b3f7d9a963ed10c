//! What this process does to local disk image files, whoever asks: qemu-img
//! (inspect, convert, check), a snapshot chain assembled onto its copied
//! base (the ESXi disk store's warm copies), and the digest of an imported
//! volume (`vmmigrate verify-volume`). No adapter owns it; the source's disk
//! store, the converter and the destination's volume checks use it.

pub mod chain;
pub mod digest;
pub mod patch;
pub mod qemu;
