//! The worker's control API: `POST /v1/call` with a [`Request`] as JSON and
//! the bearer token of the migration's worker; the answer is the JSON of
//! what the port returns. `GET /healthz` (no token) is the readiness probe.
//!
//! The request carries the migration as the controller read it: the worker
//! reads nothing from the Kubernetes API (its pod has no token), and it
//! refuses a migration whose uid is not the one it was started for.

use crate::api::VirtualMachineMigration;
use serde::{Deserialize, Serialize};

/// The port the control API listens on in the worker pod.
pub(crate) const CONTROL_PORT: u16 = 9443;
/// The port the staging server listens on in the worker pod.
pub(crate) const STAGING_PORT: u16 = 8443;
/// The path of calls.
pub const CALL_PATH: &str = "/v1/call";
/// The readiness path.
pub const HEALTH_PATH: &str = "/healthz";
/// The largest request body: a migration object and a call.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// One port operation on one migration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Call {
    /// `DiskStore::copy_state` → `CopyState`.
    CopyState { disk: usize },
    /// `DiskStore::start_copy` → `Result<(), Failure>`.
    StartCopy { disk: usize },
    /// `DiskStore::discard_copy` → `Result<(), Failure>`.
    DiscardCopy { disk: usize },
    /// `Converter::artifact_state` → `ArtifactState`.
    ArtifactState { disk: usize },
    /// `Converter::start_conversion` → `Result<(), Failure>`.
    StartConversion { disk: usize },
    /// `Converter::discard_artifact` → `Result<(), Failure>`.
    DiscardArtifact { disk: usize },
    /// `Converter::guest_conversion` → `Option<GuestConversion>`.
    GuestConversion,
    /// `Staging::staged_url` → `Result<Option<String>, Failure>`.
    StagedUrl { disk: usize, sha256: String },
    /// `Staging::stage` → `Result<(), Failure>`.
    Stage { disk: usize },
    /// `DiskStore::delta_state` → `CopyState` (warm mode, after the cutover).
    DeltaState { disk: usize },
    /// `DiskStore::start_delta_copy` → `Result<(), Failure>`.
    StartDeltaCopy { disk: usize },
    /// `DiskStore::patch` → `Option<DiskPatch>` (warm, once assembled).
    Patch { disk: usize },
    /// `Staging::stage_base` → `Result<Option<String>, Failure>` (warm,
    /// before the cutover).
    StageBase { disk: usize, sha256: String },
}

/// What the controller sends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Request {
    pub vmm: VirtualMachineMigration,
    pub call: Call,
}
