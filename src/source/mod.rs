//! Migration sources. Only standalone ESXi hosts over SSH for now.

pub mod esxi;
