//! Rendering of CDI DataVolumes and KubeVirt VirtualMachines, VMI observation
//! and application validation probes.
