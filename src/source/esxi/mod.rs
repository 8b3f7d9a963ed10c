//! ESXi over SSH (russh): host key pinning, vim-cmd and .vmx parsing, power
//! control, streaming disk copy with sha256.
pub mod adapter;
pub mod copy;
pub(crate) mod parse;
pub mod snapshot;
pub mod ssh;
