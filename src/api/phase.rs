//! The migration phases: the checkpoint the controller is working on now.
//!
//! `Phase` is a plain enum (no data) so that the CRD schema is a simple string
//! enum the API server enforces. The transition graph lives in `crate::machine`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The checkpoint a migration is at. See docs/state-machine.md.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum Phase {
    /// Accepted; the controller adds its finalizer and records `timestamps.created`.
    #[default]
    Pending,
    /// Read-only discovery of the source VM over SSH.
    Discovering,
    /// Pre-flight checks run here; named for their result.
    Validated,
    /// Source powered off per policy and disks acquired with checksums.
    Preparing,
    /// Artifacts converted (or validated, for raw) and staged for CDI.
    Converting,
    /// One CDI DataVolume per disk imported.
    Importing,
    /// The KubeVirt VirtualMachine exists and matches the rendered spec.
    #[serde(rename = "CreatingVM")]
    #[schemars(rename = "CreatingVM")]
    CreatingVm,
    /// The VirtualMachineInstance is Running.
    Starting,
    /// The application answers the configured checks.
    Validating,
    /// Terminal success.
    Completed,
    /// A step failed in a way that may succeed on retry; waits, then resumes the failed phase.
    Retryable,
    /// A human decision or fix is needed; nothing automatic happens.
    ManualInterventionRequired,
    /// Terminal failure.
    Failed,
}

impl Phase {
    /// Every phase, in the order of the happy path followed by the failure states.
    pub const ALL: [Phase; 13] = [
        Phase::Pending,
        Phase::Discovering,
        Phase::Validated,
        Phase::Preparing,
        Phase::Converting,
        Phase::Importing,
        Phase::CreatingVm,
        Phase::Starting,
        Phase::Validating,
        Phase::Completed,
        Phase::Retryable,
        Phase::ManualInterventionRequired,
        Phase::Failed,
    ];

    /// The name used in the API (`status.phase`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Discovering => "Discovering",
            Phase::Validated => "Validated",
            Phase::Preparing => "Preparing",
            Phase::Converting => "Converting",
            Phase::Importing => "Importing",
            Phase::CreatingVm => "CreatingVM",
            Phase::Starting => "Starting",
            Phase::Validating => "Validating",
            Phase::Completed => "Completed",
            Phase::Retryable => "Retryable",
            Phase::ManualInterventionRequired => "ManualInterventionRequired",
            Phase::Failed => "Failed",
        }
    }

    /// Completed and Failed are never left automatically.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Completed | Phase::Failed)
    }

    /// The phases that are checkpoints of the happy path (not failure states).
    pub fn is_active(self) -> bool {
        !self.is_terminal() && !matches!(self, Phase::Retryable | Phase::ManualInterventionRequired)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_names_round_trip_through_serde() {
        for phase in Phase::ALL {
            let json = serde_json::to_string(&phase).unwrap();
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
            let back: Phase = serde_json::from_str(&json).unwrap();
            assert_eq!(back, phase);
        }
    }

    #[test]
    fn unknown_phase_does_not_deserialize() {
        assert!(serde_json::from_str::<Phase>("\"Exploding\"").is_err());
    }
}
