//! ESXi over SSH (russh): host key pinning, vim-cmd and .vmx parsing, power
//! control, streaming disk copy with sha256.
pub mod copy;
pub mod hosts;
pub(crate) mod parse;
pub mod snapshot;
pub mod ssh;
pub mod store;
