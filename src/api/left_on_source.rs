//! What a deleted migration left on its source host: the record that
//! outlives the migration and its namespace.
//!
//! When a migration is deleted and its snapshot cannot be removed for good
//! (the ESXi Secret went with the namespace, the host refuses), the finalizer
//! lets go and records what stayed in a ConfigMap of the controller's own
//! namespace, `vmm-left-<uid>`, labelled [`LABEL`]. The gitops side writes
//! every such record to the status branch (`left-on-source.yaml`, and a
//! section of `STATUS.md`) until a person who removed the snapshot deletes
//! the ConfigMap. Only names go there: host, VM, vmid, snapshot and the
//! failure's reason code, never its message (which may name a Secret).

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use std::collections::BTreeMap;

/// Label on every record's ConfigMap.
pub const LABEL: &str = "migration.platform.example/left-on-source";

/// One thing a deleted migration left on its source.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeftOnSource {
    /// The migration's namespace and name.
    pub namespace: String,
    pub migration: String,
    /// The migration's uid: one record per migration ever.
    pub uid: String,
    /// The ESXi host as the spec named it.
    pub host: String,
    pub vm: String,
    pub vmid: String,
    pub snapshot: String,
    /// Why it could not be removed (a `Reason`'s code).
    pub reason: String,
    /// When the finalizer let go (RFC 3339, seconds).
    pub recorded: String,
}

/// Longest value a record keeps of any field read back (ConfigMaps may be
/// edited by anyone who can write them; the status branch stays bounded).
const FIELD_LIMIT: usize = 253;

impl LeftOnSource {
    /// The ConfigMap's name: one per migration uid.
    pub fn object_name(uid: &str) -> String {
        format!("vmm-left-{uid}")
    }

    /// The record as the ConfigMap that keeps it, in `namespace`.
    pub fn to_config_map(&self, namespace: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(Self::object_name(&self.uid)),
                namespace: Some(namespace.to_owned()),
                labels: Some(BTreeMap::from([(LABEL.to_owned(), "true".to_owned())])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([
                ("namespace".to_owned(), self.namespace.clone()),
                ("migration".to_owned(), self.migration.clone()),
                ("uid".to_owned(), self.uid.clone()),
                ("host".to_owned(), self.host.clone()),
                ("vm".to_owned(), self.vm.clone()),
                ("vmid".to_owned(), self.vmid.clone()),
                ("snapshot".to_owned(), self.snapshot.clone()),
                ("reason".to_owned(), self.reason.clone()),
                ("recorded".to_owned(), self.recorded.clone()),
            ])),
            ..ConfigMap::default()
        }
    }

    /// The record a ConfigMap keeps; `None` when it is not one (no uid).
    /// Each field is cut to [`FIELD_LIMIT`] characters.
    pub fn from_config_map(cm: &ConfigMap) -> Option<LeftOnSource> {
        let data = cm.data.as_ref()?;
        let field = |key: &str| -> String {
            data.get(key).map(|v| v.chars().take(FIELD_LIMIT).collect()).unwrap_or_default()
        };
        let uid = field("uid");
        if uid.is_empty() {
            return None;
        }
        Some(LeftOnSource {
            namespace: field("namespace"),
            migration: field("migration"),
            uid,
            host: field("host"),
            vm: field("vm"),
            vmid: field("vmid"),
            snapshot: field("snapshot"),
            reason: field("reason"),
            recorded: field("recorded"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_from_its_config_map_and_long_edited_fields_are_cut() {
        let left = LeftOnSource {
            namespace: "apps".into(),
            migration: "web-01".into(),
            uid: "0b1c".into(),
            host: "esxi01.example.net".into(),
            vm: "web-01".into(),
            vmid: "7".into(),
            snapshot: "vmmigrate-web-01".into(),
            reason: "CredentialsNotFound".into(),
            recorded: "2026-12-06T10:00:00Z".into(),
        };
        let mut cm = left.to_config_map("vmmigrate-system");
        assert_eq!(cm.metadata.name.as_deref(), Some("vmm-left-0b1c"));
        assert_eq!(LeftOnSource::from_config_map(&cm), Some(left.clone()));
        cm.data.as_mut().unwrap().insert("vm".into(), "x".repeat(10_000));
        assert_eq!(LeftOnSource::from_config_map(&cm).unwrap().vm.len(), FIELD_LIMIT);
        cm.data.as_mut().unwrap().remove("uid");
        assert_eq!(LeftOnSource::from_config_map(&cm), None, "not a record without a uid");
    }
}
