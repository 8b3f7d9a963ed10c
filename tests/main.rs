//! The integration tests, one binary so the crate links once. Each module is
//! a subject; `support` holds what they share (the harness crate's parts, the
//! in-memory simulation, manifests).

mod support;

mod api_server;
mod argocd_health;
mod cli;
mod controller_e2e;
mod controller_pod;
mod convert;
mod crd_is_current;
mod demo;
mod deploy_rbac;
mod esxi_emulator;
mod esxi_source;
mod fleet;
mod forge;
mod gitops_e2e;
mod gitops_render;
mod guest_conversion;
mod harness_janitor;
mod house;
mod http_check;
mod leader_election;
mod logs;
mod machine_simulation;
mod metrics;
mod migration_e2e;
mod node;
mod simulators;
mod status_branch;
mod tenancy;
mod worker_api;
