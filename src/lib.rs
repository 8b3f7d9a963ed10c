//! vmmigrate: a GitOps reconciler that moves virtual machines from standalone
//! VMware ESXi hosts into KubeVirt. See docs/architecture.md for the module map.

pub mod api;
pub mod cli;
pub mod controller;
pub mod convert;
pub mod gitops;
pub mod machine;
pub mod source;
pub mod target;
