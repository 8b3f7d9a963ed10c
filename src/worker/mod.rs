//! The data plane in pods (`--data-plane pods`): one worker pod per
//! migration copies its disks with sha256, converts them and serves them to
//! CDI, on a volume of its own, while the controller keeps orchestration
//! and the recorded checkpoints.
//!
//! - `plane`: the controller's side. It implements the `DiskStore`,
//!   `Converter` and `Staging` ports by creating the worker's objects (a
//!   Service, a Secret with the worker's identity, a PersistentVolumeClaim
//!   for the copies and a Job) and calling the worker's control API.
//! - `process`: `vmmigrate worker`, what the Job runs: the same `EsxiDiskStore`
//!   copies, `ArtifactStore` conversions and staging server as the
//!   in-process data plane, on the claim, behind the control API.
//! - `protocol`: what the two say to each other.
//!
//! A worker pod holds nothing that a new pod could not rebuild: copies live
//! on the claim with their `.progress.json` sidecars, so a killed worker (or
//! its node gone) resumes in the pod its Job starts next, from the chunks it
//! recorded. Every object the controller creates for a worker is owned by
//! the migration, so the garbage collector removes what a deleted migration
//! leaves.

pub mod plane;
pub mod process;
pub mod protocol;
