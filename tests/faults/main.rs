//! Faults injected into the real control plane and the node: a binary of
//! its own, with a cluster of its own, because each fault stops or restarts
//! a part every test on that cluster depends on. Its tests take turns;
//! nothing else runs beside them.

// Shared with the main binary; this one uses only part of it.
#[allow(dead_code, unused_imports)]
#[path = "../support/mod.rs"]
mod support;

mod control_plane;
