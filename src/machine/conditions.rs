//! Conditions in one place: per-checkpoint conditions are set from facts by
//! `decide`; `summarize` derives the kstatus trio (`Ready`, `Reconciling`,
//! `Stalled`) from the phase at the end of every decision.

use crate::api::{Condition, ConditionStatus, Phase, VirtualMachineMigrationStatus, condition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// Sets a condition, keeping `lastTransitionTime` unless the status flips.
pub(crate) fn set(
    status: &mut VirtualMachineMigrationStatus,
    type_: &str,
    value: bool,
    reason: &str,
    message: impl Into<String>,
    generation: i64,
    now: &Time,
) {
    let value = if value { ConditionStatus::True } else { ConditionStatus::False };
    let message = message.into();
    match status.conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != value {
                c.last_transition_time = now.clone();
            }
            c.status = value;
            c.reason = reason.to_owned();
            c.message = message;
            c.observed_generation = Some(generation);
        }
        None => status.conditions.push(Condition {
            type_: type_.to_owned(),
            status: value,
            observed_generation: Some(generation),
            last_transition_time: now.clone(),
            reason: reason.to_owned(),
            message,
        }),
    }
}

/// Whether a condition is present and True.
pub fn is_true(status: &VirtualMachineMigrationStatus, type_: &str) -> bool {
    status.conditions.iter().any(|c| c.type_ == type_ && c.status == ConditionStatus::True)
}

/// Derives `Ready`, `Reconciling` and `Stalled` from the phase, refreshes
/// `observedGeneration` on every condition, and orders conditions stably.
pub(crate) fn summarize(status: &mut VirtualMachineMigrationStatus, generation: i64, now: &Time) {
    let phase = status.phase;
    // The cause is the last error of a working phase; errors of finishing work
    // in a terminal phase (a cleanup that will be retried) do not replace it.
    let last_error = status
        .errors
        .iter()
        .rev()
        .find(|e| e.phase.is_active())
        .map(|e| (e.reason.clone(), e.message.clone()));
    let (error_reason, error_message) =
        last_error.unwrap_or_else(|| (phase.as_str().to_owned(), String::new()));
    match phase {
        Phase::Completed => {
            set(
                status,
                condition::READY,
                true,
                "Completed",
                "the VM was migrated and validated",
                generation,
                now,
            );
            set(status, condition::RECONCILING, false, "Completed", "", generation, now);
            set(status, condition::STALLED, false, "Completed", "", generation, now);
        }
        Phase::Failed | Phase::ManualInterventionRequired => {
            let msg = if phase == Phase::Failed {
                format!("migration failed: {error_message}")
            } else {
                format!("waiting for a human: {error_message}")
            };
            set(status, condition::READY, false, &error_reason, msg.clone(), generation, now);
            set(status, condition::RECONCILING, false, phase.as_str(), "", generation, now);
            set(status, condition::STALLED, true, &error_reason, msg, generation, now);
        }
        Phase::Retryable => {
            let msg = format!("retrying after {error_reason}: {error_message}");
            set(status, condition::READY, false, "Retryable", msg.clone(), generation, now);
            set(status, condition::RECONCILING, true, "Retryable", msg, generation, now);
            set(status, condition::STALLED, false, "Retryable", "", generation, now);
        }
        active => {
            let (reason, msg) = match &status.waiting {
                Some(w) => (w.reason.clone(), format!("validated; waiting: {}", w.message)),
                None => (active.as_str().to_owned(), format!("working on checkpoint {active}")),
            };
            set(status, condition::READY, false, &reason, msg.clone(), generation, now);
            set(status, condition::RECONCILING, true, &reason, msg, generation, now);
            set(status, condition::STALLED, false, &reason, "", generation, now);
        }
    }
    for c in &mut status.conditions {
        c.observed_generation = Some(generation);
    }
    status.conditions.sort_by_key(|c| order(&c.type_));
    status.observed_generation = Some(generation);
}

fn order(type_: &str) -> usize {
    const ORDER: [&str; 13] = [
        condition::READY,
        condition::RECONCILING,
        condition::STALLED,
        condition::SOURCE_DISCOVERED,
        condition::VALIDATED,
        condition::SOURCE_POWERED_OFF,
        condition::DISK_ACQUIRED,
        condition::DISK_CONVERTED,
        condition::DISK_IMPORTED,
        condition::VM_CREATED,
        condition::VM_STARTED,
        condition::GUEST_READY,
        condition::VM_DRIFTED,
    ];
    ORDER.iter().position(|t| *t == type_).unwrap_or(ORDER.len())
}
