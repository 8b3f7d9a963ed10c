//! The migration state machine: a pure `decide(spec, status, observed, now)`.
//! No IO, no async, no clock.
