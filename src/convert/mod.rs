//! Disk conversion (qemu-img; virt-v2v over a whole guest), artifact validation and
//! the staging HTTP server that CDI imports from.
//!
//! On-disk layout under the controller's work directory (`--work-dir`):
//!
//! ```text
//! copies/<namespace>/<name>/<uid>/disk-<n>.raw          the acquired disk (source::esxi)
//! artifacts/<uid>/disk-<n>.<raw|qcow2>                   the artifact CDI imports
//! artifacts/<uid>/disk-<n>.<fmt>.sha256                  marker: "<size> <sha256>\n", written last
//! artifacts/<uid>/guest.v2v/                             virt-v2v's work while the guest is converted
//! artifacts/<uid>/guest-conversion.json, virt-v2v.log    what converting the guest did, its log
//! staging/<uid>/disk-<n>.<fmt>                           hard link published by `Staging::stage`
//! staging/<uid>/disk-<n>.<fmt>.sha256                    the same marker
//! staging/<uid>/disk-<n>.<fmt>.corrupt                   written by the server when bytes differ
//! ```

pub mod access;
pub mod artifact;
pub mod guest;
pub(crate) mod job;
pub mod produce;
pub mod staging;
pub(crate) mod store;
