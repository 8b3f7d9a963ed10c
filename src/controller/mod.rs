//! The controller: observe through adapters, decide with `crate::machine`,
//! act idempotently, record status with server-side apply.
//!
//! - `adapters`: the ports (ESXi, disks, conversion, staging, cluster, probes)
//! - `engine`: one reconcile, independent of kube-runtime
//! - `sim`: an in-memory world implementing every adapter, for tests
//! - `service`: the real adapters assembled for `vmmigrate controller`

pub mod adapters;
pub mod engine;
pub mod leader;
pub mod reconciler;
pub mod service;
pub mod sim;
