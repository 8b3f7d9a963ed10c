//! Disk conversion (qemu-img, virt-v2v when present), artifact validation and
//! the staging HTTP server that CDI imports from.
//!
//! On-disk layout under the controller's work directory (`--work-dir`):
//!
//! ```text
//! copies/<namespace>/<name>/<uid>/disk-<n>.raw          the acquired disk (source::esxi)
//! artifacts/<uid>/disk-<n>.<raw|qcow2>                   the artifact CDI imports
//! artifacts/<uid>/disk-<n>.<fmt>.sha256                  marker: "<size> <sha256>\n", written last
//! staging/<uid>/disk-<n>.<fmt>                           hard link published by `Staging::stage`
//! staging/<uid>/disk-<n>.<fmt>.sha256                    the same marker
//! staging/<uid>/disk-<n>.<fmt>.corrupt                   written by the server when bytes differ
//! ```

pub mod access;
pub mod artifact;
pub(crate) mod job;
pub mod produce;
pub mod staging;
pub(crate) mod store;
