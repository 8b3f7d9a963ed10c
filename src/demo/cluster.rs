//! What an administrator would have set up in the cluster before the first
//! pull request: the namespace, the ESXi credentials Secret and the Service
//! the application check goes through (the StorageClass `local-path` is the
//! node's provisioner's).

use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use std::net::Ipv4Addr;

const MANAGER: &str = "vmmigrate-demo";

/// Applies one object (server-side apply, so a second run changes nothing).
async fn apply<K>(api: Api<K>, name: &str, object: serde_json::Value) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&object))
        .await
        .map_err(|e| anyhow::anyhow!("applying {name}: {e}"))?;
    Ok(())
}

/// Namespace `ns` and Secret `secret` with the ESXi login, for `hosts`
/// only (`host[:port]=key`, as an administrator binds it).
pub(crate) async fn prepare(
    client: &Client,
    ns: &str,
    secret: &str,
    hosts: &str,
    username: &str,
    password: &str,
) -> anyhow::Result<()> {
    apply(
        Api::<Namespace>::all(client.clone()),
        ns,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
    )
    .await?;
    apply(
        Api::<Secret>::namespaced(client.clone(), ns),
        secret,
        json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": secret, "namespace": ns,
                         "annotations": {crate::machine::tenancy::CREDENTIAL_HOSTS_ANNOTATION: hosts}},
            "stringData": {"username": username, "password": password},
        }),
    )
    .await
}

/// Service `name` port 80 → port 80 of the real guest `vm`'s virt-launcher
/// pod (KubeVirt labels it `kubevirt.io/domain: <vm>`); the endpoints
/// controller points it at the pod once the pod is ready.
pub(crate) async fn guest_service(client: &Client, ns: &str, name: &str, vm: &str) -> anyhow::Result<()> {
    apply(
        Api::<Service>::namespaced(client.clone(), ns),
        name,
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"kubevirt.io/domain": vm},
                     "ports": [{"name": "http", "port": 80, "targetPort": 80}]},
        }),
    )
    .await
}

/// Service `name` port 80 → `address:port`. The EndpointSlice is written
/// here, standing in for the endpoint controller that would point it at the
/// virt-launcher pod of the migrated VM.
pub(crate) async fn web_service(
    client: &Client,
    ns: &str,
    name: &str,
    address: Ipv4Addr,
    port: u16,
) -> anyhow::Result<()> {
    apply(
        Api::<Service>::namespaced(client.clone(), ns),
        name,
        json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": port}]},
        }),
    )
    .await?;
    let slice = format!("{name}-1");
    apply(
        Api::<EndpointSlice>::namespaced(client.clone(), ns),
        &slice,
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": slice, "namespace": ns,
                         "labels": {crate::destination::http_check::SERVICE_NAME_LABEL: name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address.to_string()], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        }),
    )
    .await
}
