//! The controller: observe through the ports (`crate::ports`), decide with `crate::machine`,
//! act idempotently, record status with a merge patch guarded by the
//! resourceVersion read (`reconciler`).
//!
//! - `engine`: one reconcile, independent of kube-runtime
//! - `service`: the real adapters assembled for `vmmigrate controller`

pub mod engine;
pub(crate) mod fleet_view;
pub mod leader;
pub mod reconciler;
pub mod service;
