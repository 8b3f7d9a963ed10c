//! vmmigrate: a GitOps reconciler that moves virtual machines from standalone
//! VMware ESXi hosts into KubeVirt. See docs/architecture.md for the module map.

// The test harness compiled into `demo` names this crate `vmmigrate::`, as the tests do.
extern crate self as vmmigrate;

pub mod api;
pub mod cli;
pub mod controller;
pub mod convert;
pub mod demo;
pub mod gitops;
pub mod machine;
pub mod metrics;
pub mod source;
pub mod target;
