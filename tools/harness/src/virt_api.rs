//! A stand-in for the VirtualMachine mutating webhook of KubeVirt v1.8.0's
//! virt-api (`pkg/virt-api/webhooks/mutating-webhook/mutators/vm-mutator.go`
//! and `pkg/defaults`), until real virt-api runs on the test node. It is
//! registered with the real API server as a MutatingWebhookConfiguration
//! over HTTPS and reproduces what upstream does to every VirtualMachine it
//! admits:
//!
//! - the VM is decoded into KubeVirt's Go types and the answer is a JSON patch
//!   replacing `/spec` and `/metadata` with what those types marshal back, so
//!   quantities come back canonical (`resource.Quantity`: `4096Mi` is `4Gi`,
//!   `2000m` is `2`) and empty lists and nulls vanish (`omitempty`);
//! - every CREATE and UPDATE: `spec.template.spec.architecture` (`amd64`) and
//!   `spec.template.spec.domain.machine.type` (`q35`) are set when empty
//!   (`SetVirtualMachineDefaults`);
//! - CREATE only: `domain.firmware.uuid` and `domain.firmware.serial` get
//!   fresh UUIDs when empty (`setFirmwareDefaultsIfEmpty`) and the template
//!   gets the annotation `kubevirt.io/pci-topology-version: v3`.
//!
//! Not reproduced: instance types and preferences, DataSource architectures,
//! the schema check upstream repeats (the API server's strict validation on
//! KubeVirt's own CRD does that here). Every admitted write is recorded, so a
//! test can count the writes to a VM.

use base64::Engine as _;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// One write the webhook admitted.
#[derive(Clone, Debug)]
pub struct Admitted {
    pub operation: String,
    pub namespace: String,
    pub name: String,
    /// `fieldManager` of the request, when it named one.
    pub field_manager: Option<String>,
}

pub struct VirtApi {
    admitted: Arc<Mutex<Vec<Admitted>>>,
    task: tokio::task::JoinHandle<()>,
    client: kube::Client,
    name: String,
}

impl Drop for VirtApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl VirtApi {
    /// Serves the webhook on loopback and registers it (failure policy Fail,
    /// like upstream) for VirtualMachines in `namespace` (a registration a
    /// test leaves behind can then stop nothing but its own namespace).
    pub async fn start(client: kube::Client, namespace: &str) -> anyhow::Result<VirtApi> {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (acceptor, ca_pem) = crate::tls::server("127.0.0.1", "virt-api stand-in CA");
        let admitted = Arc::new(Mutex::new(Vec::new()));
        let shared = admitted.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, admitted) = (acceptor.clone(), shared.clone());
                tokio::spawn(async move {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = serve(stream, &admitted).await;
                    }
                });
            }
        });
        let name = format!("virt-api-standin-{namespace}");
        let config: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": { "name": name },
            "webhooks": [{
                "name": "virtualmachines-mutator.kubevirt.io",
                "clientConfig": {
                    "url": format!("https://{addr}/virtualmachines-mutate"),
                    "caBundle": base64::engine::general_purpose::STANDARD.encode(&ca_pem),
                },
                "rules": [{
                    "apiGroups": ["kubevirt.io"],
                    "apiVersions": ["v1"],
                    "operations": ["CREATE", "UPDATE"],
                    "resources": ["virtualmachines"],
                }],
                "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": namespace } },
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
            }],
        }))?;
        let api: kube::Api<MutatingWebhookConfiguration> = kube::Api::all(client.clone());
        api.create(&Default::default(), &config).await?;
        Ok(VirtApi { admitted, task, client, name })
    }

    /// Every write admitted so far, in order.
    pub fn admitted(&self) -> Vec<Admitted> {
        self.admitted.lock().expect("admission log").clone()
    }

    /// Removes the registration (the server stops when this is dropped).
    pub async fn unregister(&self) -> anyhow::Result<()> {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let api: kube::Api<MutatingWebhookConfiguration> = kube::Api::all(self.client.clone());
        api.delete(&self.name, &Default::default()).await?;
        Ok(())
    }
}

async fn serve<S>(stream: S, admitted: &Mutex<Vec<Admitted>>) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        let mut length = 0usize;
        loop {
            line.clear();
            if reader.read_line(&mut line).await? == 0 || line.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.trim().eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length.min(16 << 20)];
        reader.read_exact(&mut body).await?;
        let answer = match serde_json::from_slice::<Value>(&body) {
            Ok(review) => review_answer(&review, admitted),
            Err(e) => json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                              "response": { "uid": "", "allowed": false, "status": { "message": e.to_string() } } }),
        };
        let bytes = serde_json::to_vec(&answer).unwrap_or_default();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            bytes.len()
        );
        reader.get_mut().write_all(head.as_bytes()).await?;
        reader.get_mut().write_all(&bytes).await?;
        reader.get_mut().flush().await?;
    }
}

fn review_answer(review: &Value, admitted: &Mutex<Vec<Admitted>>) -> Value {
    let request = &review["request"];
    let operation = request["operation"].as_str().unwrap_or_default().to_owned();
    let mut vm = request["object"].clone();
    if vm["metadata"]["deletionTimestamp"].is_string() {
        return response(request, None);
    }
    admitted.lock().expect("admission log").push(Admitted {
        operation: operation.clone(),
        namespace: request["namespace"].as_str().unwrap_or_default().to_owned(),
        name: request["name"].as_str().or(vm["metadata"]["name"].as_str()).unwrap_or_default().to_owned(),
        field_manager: request["options"]["fieldManager"].as_str().map(str::to_owned),
    });
    mutate(&mut vm, operation == "CREATE");
    let patch = json!([
        { "op": "replace", "path": "/spec", "value": vm["spec"] },
        { "op": "replace", "path": "/metadata", "value": vm["metadata"] },
    ]);
    response(request, Some(patch))
}

fn response(request: &Value, patch: Option<Value>) -> Value {
    let mut response = json!({ "uid": request["uid"], "allowed": true });
    if let Some(patch) = patch {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(
            base64::engine::general_purpose::STANDARD.encode(serde_json::to_vec(&patch).unwrap_or_default())
        );
    }
    json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response })
}

/// What virt-api v1.8.0 does to a VirtualMachine it admits (see the top).
pub fn mutate(vm: &mut Value, create: bool) {
    let template = &mut vm["spec"]["template"];
    if template.is_object() {
        if create {
            let firmware = &mut template["spec"]["domain"]["firmware"];
            for field in ["uuid", "serial"] {
                if firmware[field].as_str().unwrap_or_default().is_empty() {
                    firmware[field] = json!(uuid_v4());
                }
            }
            let annotations = &mut template["metadata"]["annotations"];
            if annotations.get("kubevirt.io/pci-topology-version").is_none() {
                annotations["kubevirt.io/pci-topology-version"] = json!("v3");
            }
        }
        let spec = &mut template["spec"];
        if spec["architecture"].as_str().unwrap_or_default().is_empty() {
            spec["architecture"] = json!("amd64");
        }
        let machine = &mut spec["domain"]["machine"];
        if machine["type"].as_str().unwrap_or_default().is_empty() {
            machine["type"] = json!("q35");
        }
    }
    round_trip(vm, "");
}

/// The Go round trip: quantities canonical, empty lists and nulls dropped.
fn round_trip(v: &mut Value, key: &str) {
    match v {
        Value::Object(map) => {
            let quantities = matches!(key, "requests" | "limits");
            for (k, child) in map.iter_mut() {
                if (quantities || (key == "memory" && matches!(k.as_str(), "guest" | "maxGuest")))
                    && let Value::String(s) = child
                    && let Some(canonical) = canonical_quantity(s)
                {
                    *s = canonical;
                }
                round_trip(child, k);
            }
            map.retain(|_, child| !(child.is_null() || child.as_array().is_some_and(Vec::is_empty)));
        }
        Value::Array(items) => items.iter_mut().for_each(|item| round_trip(item, key)),
        _ => {}
    }
}

/// `resource.Quantity`'s canonical text: binary suffixes stay binary while
/// the value is a whole multiple of 1024 bytes, otherwise the largest
/// decimal suffix that keeps the number whole.
pub fn canonical_quantity(text: &str) -> Option<String> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || whole.len() + fraction.len() > 24 {
        return None;
    }
    let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
    let shift = |bits: u32| Some(((1000i128 << bits), true));
    let decimal = |exp: u32| Some((1000 * 10i128.pow(exp), false));
    let (per_unit, binary) = match suffix {
        "" => decimal(0)?,
        "m" => (1, false),
        "k" => decimal(3)?,
        "M" => decimal(6)?,
        "G" => decimal(9)?,
        "T" => decimal(12)?,
        "Ki" => shift(10)?,
        "Mi" => shift(20)?,
        "Gi" => shift(30)?,
        "Ti" => shift(40)?,
        _ => return None,
    };
    let scaled = digits.checked_mul(per_unit)?;
    let divisor = 10i128.pow(fraction.len() as u32);
    if scaled % divisor != 0 {
        return None;
    }
    let millis = scaled / divisor;
    if millis % 1000 != 0 {
        return Some(format!("{millis}m"));
    }
    let units = millis / 1000;
    if binary && units >= 1024 {
        for (bits, name) in [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
            if units % (1i128 << bits) == 0 {
                return Some(format!("{}{name}", units >> bits));
            }
        }
        return Some(units.to_string());
    }
    for (exp, name) in [(12, "T"), (9, "G"), (6, "M"), (3, "k")] {
        let unit = 10i128.pow(exp);
        if units != 0 && units % unit == 0 {
            return Some(format!("{}{name}", units / unit));
        }
    }
    Some(units.to_string())
}

fn uuid_v4() -> String {
    use sha2::Digest as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{:?}{}{}",
        std::time::SystemTime::now(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let h = sha2::Sha256::digest(seed.as_bytes());
    let hex: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-4{}-a{}-{}", &hex[0..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_come_back_as_go_marshals_them() {
        for (given, stored) in [
            ("4096Mi", "4Gi"),
            ("1000Mi", "1000Mi"),
            ("2000m", "2"),
            ("1500m", "1500m"),
            ("1000", "1k"),
            ("1024", "1024"),
            ("0.5Gi", "512Mi"),
            ("512", "512"),
        ] {
            assert_eq!(canonical_quantity(given).as_deref(), Some(stored), "{given}");
        }
    }

    #[test]
    fn a_created_vm_gets_defaults_canonical_memory_and_loses_empty_lists() {
        let mut vm = json!({
            "metadata": { "name": "web", "ownerReferences": [] },
            "spec": { "runStrategy": "Halted", "template": { "metadata": { "labels": { "a": "b" } }, "spec": {
                "domain": { "memory": { "guest": "4096Mi" }, "resources": { "requests": { "memory": "4096Mi" } },
                            "devices": { "disks": [], "interfaces": [] }, "features": {} },
                "networks": [],
            } } },
        });
        mutate(&mut vm, true);
        let spec = &vm["spec"]["template"]["spec"];
        assert_eq!(spec["domain"]["memory"]["guest"], "4Gi");
        assert_eq!(spec["domain"]["resources"]["requests"]["memory"], "4Gi");
        assert_eq!(spec["domain"]["machine"]["type"], "q35");
        assert_eq!(spec["architecture"], "amd64");
        assert!(spec.get("networks").is_none() && spec["domain"]["devices"].get("disks").is_none());
        assert_eq!(spec["domain"]["features"], json!({}));
        assert!(vm["metadata"].get("ownerReferences").is_none());
        assert_eq!(spec["domain"]["firmware"]["uuid"].as_str().unwrap().len(), 36);
        assert_eq!(
            vm["spec"]["template"]["metadata"]["annotations"]["kubevirt.io/pci-topology-version"],
            "v3"
        );
    }
}
