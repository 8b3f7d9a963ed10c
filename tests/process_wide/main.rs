//! Tests that own process-wide state, the global tracing subscriber: a
//! binary of their own, so no other test's components show up in what they
//! read.

// Shared with the main binary; this one uses only part of it.
#[allow(dead_code, unused_imports)]
#[path = "../support/mod.rs"]
mod support;

mod logs;
