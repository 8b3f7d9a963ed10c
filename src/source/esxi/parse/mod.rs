//! Pure parsers for what a VMware ESXi host prints over SSH: `vim-cmd` output
//! (`getallvms`, `power.getstate`, faults, `snapshot.get`, `message`, VMODL
//! object dumps from `get.guest`/`get.summary`), `.vmx` files, VMDK
//! descriptors and `vmware -v`.
//!
//! Every input is untrusted (arbitrary bytes decoded lossily), so nothing here
//! may panic: no slice indexing, no unwrap, checked or saturating arithmetic,
//! and the only recursive parser (VMODL) is depth-bounded. No IO, no async.
//! The formats and their quirks are described in the ESXi facts notes; each
//! quirk has a unit test in the `tests` submodule.

mod descriptor;
mod version;
mod vim_cmd;
mod vmodl;
mod vmx;

pub(crate) use descriptor::parse_descriptor;
pub(crate) use version::parse_version;
pub(crate) use vim_cmd::{
    VmListEntry, parse_fault, parse_getallvms, parse_guest_info, parse_message, parse_power_state,
    parse_snapshots,
};
pub(crate) use vmx::{VmxFacts, parse_vmx, vmx_facts};
// What only the tests name.
#[cfg(test)]
use {
    descriptor::{Descriptor, Extent},
    vim_cmd::{Fault, GuestInfo, GuestNic, Snapshot, Summary, parse_summary, split_datastore_path},
    vmodl::{Vmodl, parse_vmodl},
    vmx::{VmxDisk, VmxNic},
};

#[cfg(test)]
mod tests;
