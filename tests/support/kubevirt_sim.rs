//! Simulation of the CDI and KubeVirt controllers, which cannot run here (no
//! nodes, no KVM). They act on the real API server like the real controllers
//! would, and honestly:
//!
//! - CDI: for each DataVolume, downloads `spec.source.http.url` over HTTP
//!   (loopback only), computes the sha256 and compares it with
//!   `spec.source.http.checksum`; only a matching download is `Succeeded`,
//!   anything else is `Failed` with the reason. Faults: fail the next N
//!   imports transiently; hold imports in progress.
//! - KubeVirt: for each VirtualMachine whose runStrategy wants it running,
//!   creates the VirtualMachineInstance (labels from the template, owned by
//!   the VM), moves it through Scheduling to Running with the guest agent
//!   connected and an IP address; deletes it when the VM is Halted.
//!
//! Both are polling loops (100 ms) stopped by dropping the returned handle.

use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use vmmigrate::target::cluster::{
    data_volume_resource, virtual_machine_instance_resource, virtual_machine_resource,
};

/// Knobs and counters shared with the test.
#[derive(Default)]
pub struct SimControl {
    /// Fail this many upcoming imports with a transient error.
    pub fail_imports: AtomicUsize,
    /// Keep imports in progress while set.
    pub hold_imports: AtomicBool,
    /// Imports that downloaded and verified an artifact.
    pub verified_imports: AtomicUsize,
}

/// Aborts the simulator tasks when dropped.
pub struct Simulators {
    pub control: Arc<SimControl>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Simulators {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts both simulators for one namespace (tests share one API server).
pub fn start(client: Client, namespace: &str) -> Simulators {
    let control = Arc::new(SimControl::default());
    let cdi = tokio::spawn(cdi_loop(client.clone(), namespace.to_owned(), control.clone()));
    let kubevirt = tokio::spawn(kubevirt_loop(client, namespace.to_owned()));
    Simulators { control, tasks: vec![cdi, kubevirt] }
}

/// GET over plain HTTP on loopback; returns (status code, body).
fn http_get(url: &str) -> Result<(u16, Vec<u8>), String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| format!("not an http URL: {url}"))?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    if !host.starts_with("127.0.0.1:") && !host.starts_with("localhost:") {
        return Err(format!("refusing to fetch from {host}: the simulator only talks to loopback"));
    }
    let mut stream = TcpStream::connect(host).map_err(|e| format!("connect {host}: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("malformed HTTP response")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("no status code")?;
    Ok((code, raw[split + 4..].to_vec()))
}

async fn set_status(api: &Api<DynamicObject>, name: &str, status: Value) {
    let patch = json!({ "status": status });
    let _ = api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await;
}

async fn cdi_loop(client: Client, namespace: String, control: Arc<SimControl>) {
    let ar = data_volume_resource();
    let all: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &ar);
    loop {
        if let Ok(list) = all.list(&ListParams::default()).await {
            for dv in list {
                let phase = dv.data["status"]["phase"].as_str().unwrap_or("").to_owned();
                if phase == "Succeeded" || phase == "Failed" {
                    continue;
                }
                let ns = dv.namespace().unwrap_or_default();
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
                let name = dv.name_any();
                if phase.is_empty() {
                    set_status(&api, &name, json!({"phase": "ImportInProgress", "progress": "0.0%"})).await;
                    continue;
                }
                if control.hold_imports.load(Ordering::SeqCst) {
                    set_status(&api, &name, json!({"phase": "ImportInProgress", "progress": "42.0%"})).await;
                    continue;
                }
                if control.fail_imports.load(Ordering::SeqCst) > 0 {
                    control.fail_imports.fetch_sub(1, Ordering::SeqCst);
                    set_status(&api, &name, failed("the importer pod was evicted")).await;
                    continue;
                }
                let url = dv.data["spec"]["source"]["http"]["url"].as_str().unwrap_or("").to_owned();
                let checksum =
                    dv.data["spec"]["source"]["http"]["checksum"].as_str().unwrap_or("").to_owned();
                let fetched = tokio::task::spawn_blocking(move || http_get(&url)).await;
                let status = match fetched {
                    Ok(Ok((200, body))) => {
                        let sha: String = Sha256::digest(&body).iter().map(|b| format!("{b:02x}")).collect();
                        if checksum == format!("sha256:{sha}") {
                            control.verified_imports.fetch_add(1, Ordering::SeqCst);
                            json!({"phase": "Succeeded", "progress": "100.0%"})
                        } else {
                            failed(&format!("checksum mismatch: got sha256:{sha}, want {checksum}"))
                        }
                    }
                    Ok(Ok((code, _))) => failed(&format!("HTTP {code} from the source")),
                    Ok(Err(e)) => failed(&e),
                    Err(e) => failed(&e.to_string()),
                };
                set_status(&api, &name, status).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn failed(message: &str) -> Value {
    json!({
        "phase": "Failed",
        "progress": "N/A",
        "conditions": [{"type": "Running", "status": "False", "reason": "Error", "message": message}],
    })
}

async fn kubevirt_loop(client: Client, namespace: String) {
    let vm_ar = virtual_machine_resource();
    let vmi_ar = virtual_machine_instance_resource();
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &vm_ar);
    loop {
        if let Ok(list) = vms.list(&ListParams::default()).await {
            for vm in list {
                let ns = vm.namespace().unwrap_or_default();
                let name = vm.name_any();
                let vm_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &vm_ar);
                let vmi_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &vmi_ar);
                let wants_running =
                    matches!(vm.data["spec"]["runStrategy"].as_str(), Some("Always" | "RerunOnFailure"));
                let vmi = vmi_api.get_opt(&name).await.ok().flatten();
                match (wants_running, vmi) {
                    (true, None) => {
                        let body = json!({
                            "apiVersion": "kubevirt.io/v1",
                            "kind": "VirtualMachineInstance",
                            "metadata": {
                                "name": name,
                                "namespace": ns,
                                "labels": vm.data["spec"]["template"]["metadata"]["labels"].clone(),
                                "ownerReferences": [{
                                    "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": name,
                                    "uid": vm.uid().unwrap_or_default(), "controller": true, "blockOwnerDeletion": true
                                }],
                            },
                            "spec": vm.data["spec"]["template"]["spec"].clone(),
                        });
                        if let Ok(obj) = serde_json::from_value::<DynamicObject>(body) {
                            let _ = vmi_api.create(&PostParams::default(), &obj).await;
                            set_status(&vmi_api, &name, json!({"phase": "Scheduling"})).await;
                        }
                    }
                    (true, Some(vmi)) => {
                        if vmi.data["status"]["phase"] == "Scheduling" {
                            set_status(
                                &vmi_api,
                                &name,
                                json!({
                                    "phase": "Running",
                                    "conditions": [
                                        {"type": "Ready", "status": "True"},
                                        {"type": "AgentConnected", "status": "True"}
                                    ],
                                    "interfaces": [{"name": "nic-0", "ipAddress": "10.0.2.2"}],
                                }),
                            )
                            .await;
                            set_status(&vm_api, &name, json!({"printableStatus": "Running", "ready": true}))
                                .await;
                        }
                    }
                    (false, Some(_)) => {
                        let _ = vmi_api.delete(&name, &DeleteParams::default()).await;
                        set_status(&vm_api, &name, json!({"printableStatus": "Stopped", "ready": false}))
                            .await;
                    }
                    (false, None) => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A plain HTTP server on loopback serving whatever `serve(path)` returns;
/// used to publish the simulated world's staged artifacts for the CDI
/// simulator to download. Runs until the test process exits.
pub fn serve_http(serve: impl Fn(&str) -> Option<Vec<u8>> + Send + Sync + 'static) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let serve = serve.clone();
            std::thread::spawn(move || {
                let mut stream = stream;
                // Read the whole request head: it may arrive in several segments.
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let request = String::from_utf8_lossy(&head).to_string();
                let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
                match serve(&path) {
                    Some(body) => {
                        let head = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                        let _ = stream.write_all(head.as_bytes());
                        let _ = stream.write_all(&body);
                    }
                    None => {
                        let _ = write!(stream, "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n");
                    }
                }
            });
        }
    });
    base
}
