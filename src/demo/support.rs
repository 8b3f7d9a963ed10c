//! The test harness of `tests/support/`, compiled into the binary: the demo
//! starts the same real control plane, ESXi emulator and network namespace
//! as the integration tests, and the same CDI/KubeVirt simulators, with the
//! same guarantee that nothing outlives the process (`process::Janitor`).
//! The files are shared, not copied; `kube_env` and the others find their
//! siblings here through `super::process`, as they do in `tests/support`.
#![allow(dead_code)]

#[path = "../../tests/support/esxi_emulator.rs"]
pub mod esxi_emulator;
#[path = "../../tests/support/kube_env.rs"]
pub mod kube_env;
#[path = "../../tests/support/kubevirt_sim.rs"]
pub mod kubevirt_sim;
#[path = "../../tests/support/netns.rs"]
pub mod netns;
#[path = "../../tests/support/process.rs"]
pub mod process;
