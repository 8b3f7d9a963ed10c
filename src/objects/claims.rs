//! One source VM, one migration: a claim taken at `Validated`, cluster-wide.
//!
//! Two manifests may name the same VM differently (`name: Web Server 01` and
//! `id: "1"`, or the host by name and by address); only discovery tells. The
//! claim is a `coordination.k8s.io/v1` Lease in the controller's namespace,
//! named after a digest of what identifies the VM: its BIOS UUID when the
//! host reports one, else host, port and vmid. Creating a Lease is atomic, so
//! of two migrations validating at once exactly one holds it; the other is
//! blocked with a reason naming the first. A claim whose holder no longer
//! exists (deleted without its finalizer running) is taken over; the
//! finalizer releases it.

use crate::api::{LeftOnSource, SourceInventory, SourceSpec, VirtualMachineMigration};
use crate::machine::Failure;
use crate::ports::kube_errors::{classify, is_not_found};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;

/// Label on every claim Lease.
pub const CLAIM_LABEL: &str = "migration.platform.example/source-claim";
/// Annotation with the identity the claim is for (readable, not a secret).
const CLAIM_KEY_ANNOTATION: &str = "migration.platform.example/source-vm";

/// The claims of one cluster, kept in one namespace.
#[derive(Clone)]
pub struct SourceClaims {
    client: Client,
    namespace: String,
}

/// What identifies the migration's source VM, from its recorded inventory.
/// `None` before discovery.
pub(crate) fn source_identity(vmm: &VirtualMachineMigration) -> Option<String> {
    let inventory = vmm.status.as_ref()?.source_inventory.as_ref()?;
    Some(identity_of(inventory, &vmm.spec.source))
}

/// What identifies a discovered VM: its BIOS UUID, else host, port and vmid.
pub(crate) fn identity_of(inventory: &SourceInventory, source: &SourceSpec) -> String {
    if !inventory.bios_uuid.is_empty() {
        return format!("bios-uuid {}", inventory.bios_uuid);
    }
    format!("vmid {} on {}:{}", inventory.vmid, source.host.to_ascii_lowercase(), source.port)
}

fn lease_name(identity: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = format!("{:x}", Sha256::digest(identity.as_bytes()));
    format!("vmm-source-{}", &digest[..40])
}

/// `namespace/name/uid` of a migration: who holds a claim.
fn holder(vmm: &VirtualMachineMigration) -> String {
    format!(
        "{}/{}/{}",
        vmm.namespace().unwrap_or_default(),
        vmm.name_any(),
        vmm.metadata.uid.as_deref().unwrap_or_default()
    )
}

impl SourceClaims {
    pub fn new(client: Client, namespace: &str) -> SourceClaims {
        SourceClaims { client, namespace: namespace.to_owned() }
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Claims the migration's source VM. `Ok(None)`: it holds the claim (now or
    /// already); `Ok(Some("ns/name"))`: another live migration holds it.
    pub async fn claim(&self, vmm: &VirtualMachineMigration) -> Result<Option<String>, Failure> {
        let Some(identity) = source_identity(vmm) else { return Ok(None) };
        let name = lease_name(&identity);
        let me = holder(vmm);
        // Two rounds: a create that loses a race reads the winner's claim.
        for _ in 0..3 {
            let existing =
                self.leases().get_opt(&name).await.map_err(|e| classify("reading a source claim", e))?;
            let Some(lease) = existing else {
                match self.leases().create(&PostParams::default(), &self.lease(&name, &identity, &me)).await {
                    Ok(_) => return Ok(None),
                    Err(kube::Error::Api(s)) if s.code == 409 => continue,
                    Err(e) => {
                        let what = format!(
                            "creating a source-VM claim in namespace {} (the controller's own)",
                            self.namespace
                        );
                        return Err(classify(&what, e));
                    }
                }
            };
            let held_by = lease.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();
            if held_by == me {
                return Ok(None);
            }
            if self.holder_exists(&held_by).await? {
                let shown = held_by.rsplit_once('/').map_or(held_by.as_str(), |(who, _uid)| who).to_owned();
                return Ok(Some(shown));
            }
            // The holder is gone: take the claim over, only if nobody else did first.
            let mut taken = self.lease(&name, &identity, &me);
            taken.metadata.resource_version = lease.resource_version();
            match self.leases().replace(&name, &PostParams::default(), &taken).await {
                Ok(_) => return Ok(None),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(classify("taking over a source claim", e)),
            }
        }
        Err(Failure::retryable(
            crate::api::Reason::APIUnavailable,
            format!("the claim on source VM ({identity}) keeps changing; trying again"),
        ))
    }

    /// Who holds the claim on `identity`, as `namespace/name`, when a
    /// migration that still exists does. Read only (a plan's question).
    pub(crate) async fn holder_of(&self, identity: &str) -> Result<Option<String>, Failure> {
        let name = lease_name(identity);
        let Some(lease) =
            self.leases().get_opt(&name).await.map_err(|e| classify("reading a source claim", e))?
        else {
            return Ok(None);
        };
        let held_by = lease.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();
        if !self.holder_exists(&held_by).await? {
            return Ok(None);
        }
        Ok(Some(held_by.rsplit_once('/').map_or(held_by.as_str(), |(who, _uid)| who).to_owned()))
    }

    /// Gives the claim up if this migration holds it ("not found" is success).
    pub async fn release(&self, vmm: &VirtualMachineMigration) -> Result<(), Failure> {
        let Some(identity) = source_identity(vmm) else { return Ok(()) };
        let name = lease_name(&identity);
        let Some(lease) =
            self.leases().get_opt(&name).await.map_err(|e| classify("reading a source claim", e))?
        else {
            return Ok(());
        };
        if lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(holder(vmm).as_str()) {
            return Ok(());
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: lease.uid(),
                resource_version: lease.resource_version(),
            }),
            ..Default::default()
        };
        match self.leases().delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            // Someone took it over meanwhile: it is no longer ours to remove.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(classify("releasing a source claim", e)),
        }
    }

    /// Keeps what a deleted migration left on its source in this namespace
    /// (a ConfigMap per migration uid, [`LeftOnSource`]): it outlives the
    /// migration and its namespace, and the gitops side writes it to Git.
    /// Recording the same migration again is success.
    pub(crate) async fn record_left(&self, left: &LeftOnSource) -> Result<(), Failure> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.create(&PostParams::default(), &left.to_config_map(&self.namespace)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(classify(
                &format!(
                    "recording what was left on the source in namespace {} (the controller's own)",
                    self.namespace
                ),
                e,
            )),
        }
    }

    async fn holder_exists(&self, held_by: &str) -> Result<bool, Failure> {
        let mut parts = held_by.splitn(3, '/');
        let (Some(ns), Some(name), Some(uid)) = (parts.next(), parts.next(), parts.next()) else {
            return Ok(false);
        };
        let api: Api<VirtualMachineMigration> = Api::namespaced(self.client.clone(), ns);
        let found = api.get_opt(name).await.map_err(|e| classify("reading the claim's holder", e))?;
        Ok(found.is_some_and(|m| m.metadata.uid.as_deref() == Some(uid)))
    }

    fn lease(&self, name: &str, identity: &str, me: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([(CLAIM_LABEL.to_owned(), "true".to_owned())])),
                annotations: Some(BTreeMap::from([(CLAIM_KEY_ANNOTATION.to_owned(), identity.to_owned())])),
                ..Default::default()
            },
            spec: Some(LeaseSpec { holder_identity: Some(me.to_owned()), ..Default::default() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{SourceInventory, VirtualMachineMigrationStatus};

    fn migration(host: &str, vmid: &str, uuid: &str) -> VirtualMachineMigration {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(serde_json::json!({
            "apiVersion": "migration.platform.example/v1alpha1", "kind": "VirtualMachineMigration",
            "metadata": {"name": "a", "namespace": "apps", "uid": "u1"},
            "spec": {
                "source": {"host": host, "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                           "credentialsSecretRef": {"name": "c"}, "vm": {"id": vmid}},
                "destination": {"namespace": "apps", "storageClassName": "s"}
            }
        }))
        .unwrap();
        vmm.status = Some(VirtualMachineMigrationStatus {
            source_inventory: Some(SourceInventory {
                vmid: vmid.into(),
                bios_uuid: uuid.into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        vmm
    }

    #[test]
    fn the_bios_uuid_identifies_a_vm_however_its_host_is_named() {
        let uuid = "421b4b87-e6b7-d881-07a0-c9d221cd3c6b";
        let by_name = source_identity(&migration("esxi01.example", "1", uuid));
        let by_address = source_identity(&migration("10.0.0.5", "1", uuid));
        assert_eq!(by_name, by_address);
        // Without a UUID: host (case-insensitively), port and vmid.
        assert_eq!(
            source_identity(&migration("ESXi01.example", "7", "")),
            source_identity(&migration("esxi01.example", "7", ""))
        );
        assert_ne!(
            source_identity(&migration("esxi01.example", "7", "")),
            source_identity(&migration("esxi01.example", "8", ""))
        );
        let name = lease_name(&by_name.unwrap());
        assert!(name.len() <= 63 && crate::machine::preflight::is_dns_label(&name), "{name}");
    }
}
