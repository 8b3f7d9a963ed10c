//! The destination: rendering of CDI DataVolumes and KubeVirt
//! VirtualMachines, observation of VMIs, and application probes.

pub mod cluster;
pub(crate) mod fill;
pub mod http_check;
pub mod probe;
pub(crate) mod render;
pub mod verify;
