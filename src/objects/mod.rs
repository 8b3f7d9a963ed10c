//! The Kubernetes objects vmmigrate makes for a migration, as every adapter
//! that makes one writes them: the labels and owner reference that tie an
//! object to its migration, names within Kubernetes' limits, the hardened
//! pod of a helper Job and what its finished container said; how a stored
//! object is compared with what was rendered (`semantic`); and the claims on
//! source VMs (`claims`). No adapter owns this module: the converter's Jobs,
//! the destination's objects and volume checks, the workers and the GitOps
//! side use it.

pub mod claims;
pub(crate) mod pods;
pub(crate) mod semantic;

use crate::api::labels::{
    MIGRATION as LABEL_MIGRATION, MIGRATION_NAMESPACE as LABEL_MIGRATION_NAMESPACE,
    MIGRATION_UID as LABEL_MIGRATION_UID, REHEARSAL as LABEL_REHEARSAL,
};
use crate::api::{MigrationMode, VirtualMachineMigration};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Label with the role of a helper object (`convert`, `verify`, the worker's).
pub(crate) const LABEL_ROLE: &str = "migration.platform.example/role";

/// Labels linking an object back to its migration.
pub(crate) fn labels(vmm: &VirtualMachineMigration) -> serde_json::Map<String, Value> {
    let mut labels = serde_json::Map::new();
    labels.insert("app.kubernetes.io/managed-by".into(), json!("vmmigrate"));
    labels.insert(LABEL_MIGRATION.into(), json!(vmm.metadata.name.clone().unwrap_or_default()));
    labels
        .insert(LABEL_MIGRATION_NAMESPACE.into(), json!(vmm.metadata.namespace.clone().unwrap_or_default()));
    labels.insert(LABEL_MIGRATION_UID.into(), json!(vmm.metadata.uid.clone().unwrap_or_default()));
    if vmm.spec.mode == MigrationMode::Rehearsal {
        labels.insert(LABEL_REHEARSAL.into(), json!("true"));
    }
    labels
}

/// An owner reference to the migration for an object in `namespace`, only
/// when that is the migration's own: Kubernetes does not allow
/// cross-namespace owners, and the garbage collector would delete such a
/// dependent at once.
pub(crate) fn owner_references(vmm: &VirtualMachineMigration, namespace: &str) -> Value {
    if vmm.metadata.namespace.as_deref() != Some(namespace) {
        return json!([]);
    }
    json!([{
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "name": vmm.metadata.name.clone().unwrap_or_default(),
        "uid": vmm.metadata.uid.clone().unwrap_or_default(),
        "controller": true,
        "blockOwnerDeletion": true,
    }])
}

/// `<base><suffix>` in at most 63 characters (a Job's name becomes a pod
/// label): a longer base is cut and marked with a hash of itself, so
/// names stay deterministic and distinct.
pub(crate) fn bounded_name(base: &str, suffix: &str) -> String {
    if base.len() + suffix.len() <= 63 {
        return format!("{base}{suffix}");
    }
    let hash: String = Sha256::digest(base.as_bytes()).iter().take(4).map(|b| format!("{b:02x}")).collect();
    let keep = 63 - suffix.len() - hash.len() - 1;
    let head = base[..keep].trim_end_matches(['-', '.']);
    format!("{head}-{hash}{suffix}")
}
