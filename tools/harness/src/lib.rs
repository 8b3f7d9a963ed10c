//! The test harness of vmmigrate, a crate of its own so the product crate
//! holds nothing only tests use: the real Kubernetes control plane
//! with its one node (`kube_env`, `node`), the ESXi emulator (a real `sshd`,
//! `esxi_emulator`), the CDI/KubeVirt simulators, a fake forge, network
//! namespaces, faults (`fault_proxy`, `full_fs`, control-plane restarts in
//! `kube_env`), and the process janitor that makes sure nothing outlives a
//! test or the demo.
//!
//! `setup` prepares a fresh machine on first use: the Debian packages these
//! parts need and the control-plane build, under a lock so parallel test
//! processes wait instead of racing.

pub mod cdi;
pub mod deploy;
pub mod esxi_emulator;
pub mod esxi_snapshots;
pub mod fake_forge;
pub mod fault_proxy;
pub mod full_fs;
pub mod git_daemon;
pub mod git_http;
pub mod kube_env;
pub mod kubevirt;
pub mod kubevirt_sim;
pub mod netns;
pub mod node;
pub mod process;
pub mod qemu_guest;
pub mod setup;
pub mod tls;
pub mod vmdk_delta;

pub use kube_env::KubeEnv;

/// The repository this harness is part of (`tools/harness/../..`).
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
