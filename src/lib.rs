//! vmmigrate: a GitOps reconciler that moves virtual machines from standalone
//! VMware ESXi hosts into KubeVirt. See docs/architecture.md for the module map.

pub mod api;
pub mod cli;
pub mod controller;
pub mod convert;
#[cfg(feature = "demo")]
pub mod demo;
pub mod destination;
pub mod gitops;
pub mod machine;
pub mod metrics;
pub mod ports;
mod server;
pub mod source;
