//! Application checks through the Kubernetes API (`Prober`): the VMI's
//! guest agent and the address it reports, and HTTP checks through a
//! Service to an address that is the VMI's own: one KubeVirt reports for
//! its interfaces from the domain or Multus, or, on the pod network, that
//! of one of its running virt-launcher pods (set by the kubelet). Never an
//! address only the guest announces, never a Service range.

use super::cluster::{launcher_pods, virtual_machine_instance_resource};
use super::http_check::run_http_check;
use crate::api::{CheckKindRef, ValidationCheck, VirtualMachineMigration};
use crate::machine::{CheckResult, destination_name};
use crate::ports::Prober;
use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject};
use kube::{Client, ResourceExt};
use serde_json::Value;
use std::net::IpAddr;

/// Probes through the Kubernetes API (see the module's documentation).
#[derive(Clone)]
pub struct KubeProber {
    client: Client,
}

impl KubeProber {
    pub fn new(client: Client) -> KubeProber {
        KubeProber { client }
    }
}

#[async_trait]
impl Prober for KubeProber {
    async fn check(&self, vmm: &VirtualMachineMigration, check: &ValidationCheck) -> CheckResult {
        let name = destination_name(&vmm.spec, vmm.metadata.name.as_deref().unwrap_or_default());
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &vmm.spec.destination.namespace,
            &virtual_machine_instance_resource(),
        );
        let vmi = match api.get_opt(&name).await {
            Ok(Some(vmi)) => vmi,
            Ok(None) => return CheckResult::NotYet { message: "the VMI does not exist yet".into() },
            Err(e) => return CheckResult::NotYet { message: format!("reading the VMI: {e}") },
        };
        let status = vmi.data.get("status").cloned().unwrap_or(Value::Null);
        match check.kind() {
            Some(CheckKindRef::GuestAgent) => {
                let connected = status["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| c["type"] == "AgentConnected" && c["status"] == "True")
                });
                if connected {
                    CheckResult::Pass { message: "the guest agent is connected".into() }
                } else {
                    CheckResult::NotYet { message: "the guest agent is not connected yet".into() }
                }
            }
            Some(CheckKindRef::Ip) => ip_check(&status),
            Some(CheckKindRef::Http(http)) => {
                let services = match service_ranges(&self.client).await {
                    Ok(ranges) => ranges,
                    Err(e) => {
                        return CheckResult::NotYet { message: format!("reading the Service ranges: {e}") };
                    }
                };
                let mut addresses = vmi_addresses(&status);
                // As the guest agent connects, KubeVirt redoes the VMI's
                // interface list from what the agent reports, and for a
                // while lists no address; its launcher pod's stays.
                if let Some(uid) = vmi.metadata.uid.as_deref() {
                    match launcher_pods(&self.client, &vmm.spec.destination.namespace, uid).await {
                        Ok(pods) => {
                            for ip in launcher_addresses(&vmi, &pods) {
                                if !addresses.contains(&ip) {
                                    addresses.push(ip);
                                }
                            }
                        }
                        Err(e) => {
                            tracing::debug!(vmi = %name, error = %e, "listing the launcher pods for an http check")
                        }
                    }
                }
                addresses.retain(|ip| !in_any(ip, &services));
                run_http_check(&self.client, &vmm.spec.destination.namespace, http, &addresses).await
            }
            None => CheckResult::Wrong { message: "the check sets none of http, guestAgent, ip".into() },
        }
    }
}

/// The `ip` check: an address the guest itself reports. virt-handler fills
/// `ipAddress` from the pod's network for a masquerade interface before the
/// guest has booted; only an interface whose `infoSource` names
/// `guest-agent` shows the guest holds an address.
fn ip_check(status: &Value) -> CheckResult {
    let interfaces = status["interfaces"].as_array().map(Vec::as_slice).unwrap_or_default();
    let from_agent = |i: &&Value| {
        i["infoSource"].as_str().is_some_and(|s| s.split(',').any(|p| p.trim() == "guest-agent"))
    };
    let address = |i: &Value| i["ipAddress"].as_str().filter(|s| !s.is_empty()).map(str::to_owned);
    if let Some((ip, name)) = interfaces
        .iter()
        .filter(from_agent)
        .find_map(|i| Some((address(i)?, i["interfaceName"].as_str().unwrap_or("?").to_owned())))
    {
        return CheckResult::Pass { message: format!("the guest agent reports {ip} on {name}") };
    }
    match interfaces.iter().find_map(address) {
        Some(ip) => CheckResult::NotYet {
            message: format!(
                "the VMI shows {ip}, but not from the guest agent (infoSource); the guest has not reported an address yet"
            ),
        },
        None => CheckResult::NotYet { message: "the VMI reports no IP address yet".into() },
    }
}

/// The addresses the `http` check may talk to: those KubeVirt itself
/// reports for the VMI's interfaces (`infoSource` naming the domain or
/// Multus, or not given), never one only the guest agent announces (a
/// guest could name the API server or a metadata endpoint), and never a
/// loopback, link-local, unspecified, multicast or broadcast address.
fn vmi_addresses(status: &Value) -> Vec<IpAddr> {
    let mut addresses = Vec::new();
    for interface in status["interfaces"].as_array().into_iter().flatten() {
        let only_the_guest_says = interface["infoSource"]
            .as_str()
            .is_some_and(|s| !s.split(',').any(|p| matches!(p.trim(), "domain" | "multus-status")));
        if only_the_guest_says {
            continue;
        }
        let listed = interface["ipAddresses"].as_array().into_iter().flatten().filter_map(Value::as_str);
        for text in interface["ipAddress"].as_str().into_iter().chain(listed) {
            if let Ok(ip) = text.parse::<IpAddr>()
                && may_be_checked(&ip)
                && !addresses.contains(&ip)
            {
                addresses.push(ip);
            }
        }
    }
    addresses
}

/// The addresses of `vmi`'s own virt-launcher pods among `pods`: listed in
/// its `status.activePods` (KubeVirt's to write; a label or an owner
/// reference is anybody's who may create pods, so they alone vouch for
/// nothing), owned by the VMI as controller, running: their
/// `status.podIPs`, which the kubelet writes, not the guest. On the pod
/// network that is the guest's address (masquerade forwards to it, bridge
/// hands it over); a VMI without a pod network has none there.
fn launcher_addresses(vmi: &DynamicObject, pods: &[Pod]) -> Vec<IpAddr> {
    let Some(uid) = vmi.metadata.uid.as_deref() else { return Vec::new() };
    // Only a VMI on the pod network is reached at its pod's address.
    let networks = vmi.data["spec"]["networks"].as_array().map(Vec::as_slice).unwrap_or_default();
    if !networks.iter().any(|n| n.get("pod").is_some()) {
        return Vec::new();
    }
    let active = &vmi.data["status"]["activePods"];
    let mut addresses = Vec::new();
    for pod in pods {
        let owned = pod
            .owner_references()
            .iter()
            .any(|o| o.kind == "VirtualMachineInstance" && o.uid == uid && o.controller == Some(true));
        let listed = pod.metadata.uid.as_deref().is_some_and(|p| active.get(p).is_some());
        let status = pod.status.as_ref();
        let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
        if !(owned && listed && running) {
            continue;
        }
        for ip in status.and_then(|s| s.pod_ips.as_deref()).unwrap_or_default() {
            if let Ok(ip) = ip.ip.parse::<IpAddr>()
                && may_be_checked(&ip)
                && !addresses.contains(&ip)
            {
                addresses.push(ip);
            }
        }
    }
    addresses
}

/// The cluster's Service address ranges (its ServiceCIDR objects,
/// networking.k8s.io/v1 since Kubernetes 1.33): an `http` check never
/// talks to one, whatever the VMI reports. A cluster without the API
/// has none to read (404).
async fn service_ranges(client: &Client) -> Result<Vec<Range>, kube::Error> {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let api: Api<ServiceCIDR> = Api::all(client.clone());
    let listed = match api.list(&kube::api::ListParams::default()).await {
        Ok(listed) => listed,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(listed
        .items
        .iter()
        .filter_map(|c| c.spec.as_ref()?.cidrs.clone())
        .flatten()
        .filter_map(|c| parse_range(&c))
        .collect())
}

/// An address range, `(network, prefix length)`.
type Range = (IpAddr, u8);

/// `10.96.0.0/16`, `fd00:10:96::/112`.
fn parse_range(text: &str) -> Option<Range> {
    let (ip, prefix) = text.trim().split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    let prefix: u8 = prefix.parse().ok()?;
    let bits = if ip.is_ipv4() { 32 } else { 128 };
    (prefix <= bits).then_some((ip, prefix))
}

fn in_any(ip: &IpAddr, ranges: &[Range]) -> bool {
    let bits = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => (u128::from(u32::from(*v4)), 32u32),
        IpAddr::V6(v6) => (u128::from(*v6), 128u32),
    };
    let (value, width) = bits(ip);
    ranges.iter().any(|(net, prefix)| {
        let (network, net_width) = bits(net);
        let prefix = u32::from(*prefix);
        if net_width != width {
            return false;
        }
        if prefix == 0 {
            return true;
        }
        let shift = width - prefix;
        (value >> shift) == (network >> shift)
    })
}

/// Not an address of the host, the link or everyone.
fn may_be_checked(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unicast_link_local()
                || v6.to_ipv4_mapped().is_some_and(|v4| !may_be_checked(&IpAddr::V4(v4))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_http_check_talks_only_to_addresses_kubevirt_reports_and_never_to_special_ones() {
        let status = json!({ "interfaces": [
            { "name": "nic-0", "ipAddress": "10.244.0.7", "ipAddresses": ["10.244.0.7", "fd10::7", "fe80::1"],
              "infoSource": "domain, guest-agent" },
            // A second NIC only the guest announces, naming a metadata
            // endpoint and the API server's address.
            { "name": "nic-1", "ipAddresses": ["169.254.169.254", "10.96.0.1"], "infoSource": "guest-agent" },
            { "name": "nic-2", "ipAddresses": ["192.168.7.4", "127.0.0.1", "0.0.0.0", "224.0.0.1", "::ffff:169.254.1.1"],
              "infoSource": "domain, guest-agent, multus-status" },
        ] });
        let addresses: Vec<String> = vmi_addresses(&status).iter().map(ToString::to_string).collect();
        assert_eq!(addresses, ["10.244.0.7", "fd10::7", "192.168.7.4"]);
    }

    #[test]
    fn an_address_in_a_service_range_is_never_checked_whatever_the_vmi_reports() {
        let ranges: Vec<Range> =
            ["10.96.0.0/16", "fd00:10:96::/112"].iter().filter_map(|r| parse_range(r)).collect();
        assert_eq!(ranges.len(), 2);
        let inside = |ip: &str| in_any(&ip.parse().unwrap(), &ranges);
        assert!(inside("10.96.0.1"), "the API server's Service address");
        assert!(inside("10.96.255.254"));
        assert!(inside("fd00:10:96::1"));
        assert!(!inside("10.97.0.1"));
        assert!(!inside("10.244.0.7"), "a pod address");
        assert!(!inside("fd00:10:97::1"));
        assert!(in_any(&"192.168.1.1".parse().unwrap(), &[parse_range("0.0.0.0/0").unwrap()]));
        assert!(!in_any(&"::1".parse().unwrap(), &[parse_range("0.0.0.0/0").unwrap()]), "families apart");
        assert_eq!(parse_range("10.0.0.0/33"), None);
        assert_eq!(parse_range("10.0.0.0"), None);
    }

    #[test]
    fn the_ip_check_passes_only_on_an_address_the_guest_agent_reports() {
        let pod_address =
            json!({ "interfaces": [{ "name": "nic-0", "ipAddress": "10.244.0.7", "infoSource": "domain" }] });
        let CheckResult::NotYet { message } = ip_check(&pod_address) else {
            panic!("passed on the pod's address")
        };
        assert!(message.contains("10.244.0.7") && message.contains("guest agent"), "{message}");
        let guest = json!({ "interfaces": [
            { "name": "nic-0", "ipAddress": "10.244.0.7", "infoSource": "domain, guest-agent", "interfaceName": "eth0" }] });
        assert!(matches!(ip_check(&guest), CheckResult::Pass { message } if message.contains("eth0")));
        assert!(matches!(ip_check(&json!({})), CheckResult::NotYet { .. }));
    }

    fn launcher(uid: &str, owner: &str, controller: bool, phase: &str, ips: &[&str]) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": format!("virt-launcher-{uid}"), "uid": uid,
                "ownerReferences": [{ "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "name": "vm", "uid": owner, "controller": controller }] },
            "status": { "phase": phase, "podIPs": ips.iter().map(|ip| json!({ "ip": ip })).collect::<Vec<_>>() }
        }))
        .unwrap()
    }

    #[test]
    fn the_http_check_may_talk_to_the_vmis_own_running_launcher_pod_on_the_pod_network_and_no_pod_that_only_claims_to_be_it()
     {
        let vmi: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": { "name": "vm", "uid": "vmi-1" },
            "spec": { "networks": [{ "name": "default", "pod": {} }] },
            "status": { "activePods": { "pod-a": "node", "pod-forged": "node", "pod-done": "node" } }
        }))
        .unwrap();
        let pods = [
            launcher("pod-a", "vmi-1", true, "Running", &["10.244.0.7", "fd10::7", "127.0.0.1"]),
            // Labelled and listed, but owned by another VMI (or by none as controller).
            launcher("pod-forged", "vmi-2", true, "Running", &["10.96.0.1"]),
            launcher("pod-forged", "vmi-1", false, "Running", &["10.96.0.2"]),
            // Owned, but not among the VMI's active pods.
            launcher("pod-old", "vmi-1", true, "Running", &["10.244.0.9"]),
            // Owned and listed, but no longer running.
            launcher("pod-done", "vmi-1", true, "Succeeded", &["10.244.0.8"]),
        ];
        let found: Vec<String> = launcher_addresses(&vmi, &pods).iter().map(ToString::to_string).collect();
        assert_eq!(found, ["10.244.0.7", "fd10::7"]);
        let no_uid: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": { "name": "vm" } }))
        .unwrap();
        assert!(launcher_addresses(&no_uid, &pods).is_empty());
        // On a Multus network alone, the pod's address is not the guest's.
        let mut multus_only = vmi.clone();
        multus_only.data["spec"]["networks"] = json!([{ "name": "lan", "multus": { "networkName": "lan" } }]);
        assert!(launcher_addresses(&multus_only, &pods).is_empty());
    }
}
