//! The kube-runtime controller: observe through adapters, decide with
//! `crate::machine`, act idempotently, record status with server-side apply.
