//! Git as the front door: fetch and read trees (gix), render manifests, apply
//! them, write status back, receive webhooks, talk to forges.
