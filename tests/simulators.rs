//! The CDI and KubeVirt simulators of tests/support, exercised directly
//! against the real kube-apiserver: what they write must be accepted by it and
//! must look like what the real controllers write.

use crate::support::{KubeEnv, kubevirt_sim, test_namespace};
use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmmigrate::api::VirtualMachineMigration;
use vmmigrate::destination::cluster::{
    KubeCluster, KubeProber, data_volume_resource, virtual_machine_instance_resource,
    virtual_machine_resource,
};
use vmmigrate::machine::{CheckResult, VmiState};
use vmmigrate::ports::{Cluster, Prober};

const WAIT: Duration = Duration::from_secs(60);

/// Polls `check` every 50 ms until it yields a value, or fails after `WAIT`.
async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {WAIT:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic, incompressible-looking test data.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A one-file HTTP source on loopback: declares `declared` bytes, sends
/// `body` in `chunk`-sized pieces with `pause` between them (a slow source),
/// then closes. Records how many requests were ever served concurrently.
struct Source {
    url: String,
    max_concurrent: Arc<AtomicUsize>,
}

fn serve_source(body: Vec<u8>, declared: usize, chunk: usize, pause: Duration) -> Source {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/disk.img", listener.local_addr().expect("addr"));
    let active = Arc::new(AtomicUsize::new(0));
    let max_concurrent = Arc::new(AtomicUsize::new(0));
    let max = max_concurrent.clone();
    let body = Arc::new(body);
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let (body, active, max) = (body.clone(), active.clone(), max.clone());
            std::thread::spawn(move || {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n"
                );
                for piece in body.chunks(chunk) {
                    if stream.write_all(piece).is_err() {
                        break;
                    }
                    std::thread::sleep(pause);
                }
                active.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Source { url, max_concurrent }
}

async fn create_data_volume(client: &Client, ns: &str, name: &str, url: &str, checksum: Option<String>) {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &data_volume_resource());
    let mut http = json!({ "url": url });
    if let Some(checksum) = checksum {
        http["checksum"] = json!(checksum);
    }
    let dv: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": { "name": name, "namespace": ns },
        "spec": {
            "source": { "http": http },
            "storage": { "resources": { "requests": { "storage": "16Mi" } } },
        },
    }))
    .expect("DataVolume");
    api.create(&PostParams::default(), &dv).await.expect("create DataVolume");
}

/// Waits for a final phase and returns the DataVolume.
async fn finished_data_volume(client: &Client, ns: &str, name: &str) -> DynamicObject {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &data_volume_resource());
    wait_for(&format!("DataVolume {name} to finish"), async || {
        let dv = api.get(name).await.ok()?;
        matches!(dv.data["status"]["phase"].as_str(), Some("Succeeded" | "Failed")).then_some(dv)
    })
    .await
}

fn condition<'a>(obj: &'a Value, type_: &str) -> &'a Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_simulator_imports_verified_bytes_into_the_pvc_and_reports_progress() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-cdi").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &data_volume_resource());
    // Two slow 4 MiB sources (about a second each): the disks must import side by side.
    let bodies = [pattern(4 << 20, 1), pattern(4 << 20, 2)];
    let sources: Vec<Source> = bodies
        .iter()
        .map(|b| serve_source(b.clone(), b.len(), 256 << 10, Duration::from_millis(60)))
        .collect();

    // Every status write the simulator makes, in order.
    let seen = Arc::new(Mutex::new(Vec::<(String, String, String)>::new()));
    let list = dvs.list_metadata(&Default::default()).await.unwrap();
    let mut events = dvs
        .watch(&WatchParams::default(), list.metadata.resource_version.as_deref().unwrap_or("0"))
        .await
        .unwrap()
        .boxed();
    let record = seen.clone();
    let watcher = tokio::spawn(async move {
        while let Some(Ok(event)) = events.next().await {
            if let WatchEvent::Added(dv) | WatchEvent::Modified(dv) = event {
                let field = |f: &str| dv.data["status"][f].as_str().unwrap_or_default().to_owned();
                record.lock().unwrap().push((dv.name_any(), field("phase"), field("progress")));
            }
        }
    });

    for (i, (body, source)) in bodies.iter().zip(&sources).enumerate() {
        let checksum = format!("sha256:{}", sha256_hex(body));
        create_data_volume(&client, &ns, &format!("disk-{i}"), &source.url, Some(checksum)).await;
    }
    for (i, body) in bodies.iter().enumerate() {
        let name = format!("disk-{i}");
        let dv = finished_data_volume(&client, &ns, &name).await;
        assert_eq!(dv.data["status"]["phase"], "Succeeded", "{:#}", dv.data["status"]);
        assert_eq!(dv.data["status"]["progress"], "100.0%");
        assert_eq!(condition(&dv.data, "Ready")["status"], "True");
        assert_eq!(condition(&dv.data, "Bound")["status"], "True");
        assert_eq!(condition(&dv.data, "Running")["reason"], "Completed");
        let image = sims.pvc_image(&ns, &name);
        assert!(std::fs::read(&image).unwrap() == *body, "the PVC holds exactly the served bytes");
        assert_eq!(leftovers(image.parent().unwrap()), vec!["disk.img".to_owned()]);
    }
    assert_eq!(sims.control.verified_imports.load(Ordering::SeqCst), 2);
    assert_eq!(sims.control.downloads.load(Ordering::SeqCst), 2);
    assert_eq!(sims.control.dv_uids_seen.lock().unwrap().len(), 2);
    assert!(sources.iter().all(|s| s.max_concurrent.load(Ordering::SeqCst) == 1), "one download per DV");

    // The watch saw every write: the phase walk and intermediate progress.
    wait_for("the watch to see both Succeeded", async || {
        let seen = seen.lock().unwrap();
        (seen.iter().filter(|(_, phase, _)| phase == "Succeeded").count() == 2).then_some(())
    })
    .await;
    watcher.abort();
    let seen = seen.lock().unwrap().clone();
    for name in ["disk-0", "disk-1"] {
        let mut phases: Vec<&str> =
            seen.iter().filter(|(n, ..)| n == name).map(|(_, phase, _)| phase.as_str()).collect();
        phases.dedup();
        assert_eq!(phases, ["", "ImportScheduled", "ImportInProgress", "Succeeded"], "{name}: {seen:?}");
        let partial: Vec<f64> = seen
            .iter()
            .filter(|(n, phase, _)| n == name && phase == "ImportInProgress")
            .filter_map(|(.., p)| p.strip_suffix('%')?.parse().ok())
            .filter(|p| *p > 0.0 && *p < 100.0)
            .collect();
        assert!(!partial.is_empty(), "{name}: no progress between 0 and 100%: {seen:?}");
        assert!(partial.windows(2).all(|w| w[0] <= w[1]), "{name}: progress went back: {partial:?}");
    }
    // Side by side: both were importing before either finished.
    let first_done = seen.iter().position(|(_, phase, _)| phase == "Succeeded").unwrap();
    for name in ["disk-0", "disk-1"] {
        assert!(
            seen[..first_done].iter().any(|(n, phase, _)| n == name && phase == "ImportInProgress"),
            "{name} was not importing while the other one was: {seen:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_simulator_fails_a_checksum_mismatch_and_keeps_nothing() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-cdi-bad").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let body = pattern(1 << 20, 3);
    let source = serve_source(body.clone(), body.len(), 64 << 10, Duration::ZERO);
    let wrong = sha256_hex(b"something else");
    create_data_volume(&client, &ns, "mismatch", &source.url, Some(format!("sha256:{wrong}"))).await;

    let dv = finished_data_volume(&client, &ns, "mismatch").await;
    assert_eq!(dv.data["status"]["phase"], "Failed");
    let running = condition(&dv.data, "Running");
    assert_eq!((&running["status"], &running["reason"]), (&json!("False"), &json!("Error")));
    let expected = format!("checksum mismatch: got sha256:{}, want sha256:{wrong}", sha256_hex(&body));
    assert_eq!(running["message"], expected);
    assert_eq!(condition(&dv.data, "Ready")["status"], "False");
    let image = sims.pvc_image(&ns, "mismatch");
    assert!(leftovers(image.parent().unwrap()).is_empty(), "nothing kept of a mismatching download");
    assert_eq!(sims.control.downloads.load(Ordering::SeqCst), 1);
    assert_eq!(sims.control.verified_imports.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_simulator_fails_short_bodies_http_errors_and_missing_checksums() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-cdi-err").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let body = pattern(600, 4);
    let short = serve_source(body.clone(), 1000, 100, Duration::ZERO);
    let not_found = kubevirt_sim::serve_http(|_| None);
    let checksum = Some(format!("sha256:{}", sha256_hex(&body)));
    create_data_volume(&client, &ns, "short", &short.url, checksum.clone()).await;
    create_data_volume(&client, &ns, "missing", &format!("{not_found}/disk-0.img"), checksum).await;
    create_data_volume(&client, &ns, "unchecked", &short.url, None).await;

    for (name, message) in [
        ("short", "unexpected EOF: got 600 of 1000 bytes"),
        ("missing", "HTTP 404 from the source"),
        ("unchecked", "no checksum given"),
    ] {
        let dv = finished_data_volume(&client, &ns, name).await;
        assert_eq!(dv.data["status"]["phase"], "Failed", "{name}");
        assert_eq!(condition(&dv.data, "Running")["message"], message, "{name}");
        assert!(leftovers(sims.pvc_image(&ns, name).parent().unwrap()).is_empty(), "{name}");
    }
    // Without a checksum nothing is downloaded.
    assert_eq!(sims.control.downloads.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_simulator_holds_imports_before_the_first_byte_and_injects_evictions() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-cdi-hold").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &data_volume_resource());
    let staged = Arc::new(Mutex::new(pattern(1 << 20, 5)));
    let checksum = format!("sha256:{}", sha256_hex(&staged.lock().unwrap()));
    let served = staged.clone();
    let base = kubevirt_sim::serve_http(move |_| Some(served.lock().unwrap().clone()));

    sims.control.hold_imports.store(true, Ordering::SeqCst);
    create_data_volume(&client, &ns, "held", &format!("{base}/disk-0.img"), Some(checksum.clone())).await;
    wait_for("ImportScheduled", async || {
        let dv = dvs.get("held").await.ok()?;
        (dv.data["status"]["phase"] == "ImportScheduled").then_some(())
    })
    .await;
    assert_eq!(sims.control.downloads.load(Ordering::SeqCst), 0, "held before any byte");
    // Tampering while held is caught once the import runs.
    staged.lock().unwrap()[0] ^= 0xff;
    sims.control.hold_imports.store(false, Ordering::SeqCst);
    let dv = finished_data_volume(&client, &ns, "held").await;
    let message = condition(&dv.data, "Running")["message"].as_str().unwrap().to_owned();
    assert!(message.starts_with("checksum mismatch"), "{message}");

    sims.control.fail_imports.store(1, Ordering::SeqCst);
    create_data_volume(&client, &ns, "evicted", &format!("{base}/disk-1.img"), Some(checksum)).await;
    let dv = finished_data_volume(&client, &ns, "evicted").await;
    assert_eq!(dv.data["status"]["phase"], "Failed");
    assert_eq!(condition(&dv.data, "Running")["message"], "the importer pod was evicted");
    assert_eq!(sims.control.fail_imports.load(Ordering::SeqCst), 0);
    assert_eq!(sims.control.downloads.load(Ordering::SeqCst), 1, "an evicted import downloads nothing");
    assert_eq!(sims.control.dv_uids_seen.lock().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_simulator_converts_qcow2_to_raw_like_cdi() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-cdi-qcow").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let work = tempfile::tempdir().unwrap();
    // Data, a hole, data: qcow2 stores the hole as unallocated clusters.
    let mut raw = pattern(3 << 20, 6);
    raw[1 << 20..2 << 20].fill(0);
    std::fs::write(work.path().join("disk.raw"), &raw).unwrap();
    let out = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(work.path().join("disk.raw"))
        .arg(work.path().join("disk.qcow2"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let qcow2 = std::fs::read(work.path().join("disk.qcow2")).unwrap();
    assert_eq!(&qcow2[..4], b"QFI\xfb");
    assert_ne!(qcow2.len(), raw.len());

    let source = serve_source(qcow2.clone(), qcow2.len(), 64 << 10, Duration::ZERO);
    create_data_volume(&client, &ns, "qcow", &source.url, Some(format!("sha256:{}", sha256_hex(&qcow2))))
        .await;
    let dv = finished_data_volume(&client, &ns, "qcow").await;
    assert_eq!(dv.data["status"]["phase"], "Succeeded", "{:#}", dv.data["status"]);
    let image = sims.pvc_image(&ns, "qcow");
    assert!(std::fs::read(&image).unwrap() == raw, "the PVC holds the raw disk");
    assert_eq!(leftovers(image.parent().unwrap()), vec!["disk.img".to_owned()]);
}

fn migration(ns: &str) -> VirtualMachineMigration {
    let mut body = crate::support::sim_migration_json(ns);
    let spec = body["spec"].as_object_mut().expect("spec");
    spec.remove("powerOffPolicy");
    spec.remove("strategy");
    serde_json::from_value(body).expect("migration")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_simulator_reports_macs_ip_and_agent_and_can_fail_scheduling() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "sim-kubevirt").await;
    let sims = kubevirt_sim::start(client.clone(), &ns);
    let kv = &sims.control.kubevirt;
    *kv.guest_os_info.lock().unwrap() = Some(json!({"id": "debian", "name": "Debian GNU/Linux"}));
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &virtual_machine_resource());
    let vmis: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &virtual_machine_instance_resource());
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "web-01", "namespace": ns},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {"labels": {"kubevirt.io/domain": "web-01"}},
                "spec": {
                    "domain": {"devices": {"interfaces": [
                        {"name": "nic-0", "model": "virtio", "macAddress": "00:50:56:aa:bb:01", "masquerade": {}},
                        {"name": "nic-1", "model": "e1000", "macAddress": "00:50:56:aa:bb:02", "bridge": {}},
                    ]}},
                    "networks": [{"name": "nic-0", "pod": {}}, {"name": "nic-1", "multus": {"networkName": "lan"}}],
                }
            }
        }
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();

    let vmi = wait_for("a Running VMI", async || {
        vmis.get_opt("web-01").await.ok().flatten().filter(|v| v.data["status"]["phase"] == "Running")
    })
    .await;
    assert_eq!(vmi.labels().get("kubevirt.io/domain").map(String::as_str), Some("web-01"));
    assert_eq!(vmi.owner_references()[0].kind, "VirtualMachine");
    let interfaces = vmi.data["status"]["interfaces"].as_array().unwrap();
    let summary: Vec<_> = interfaces.iter().map(|i| (&i["name"], &i["mac"], &i["ipAddress"])).collect();
    assert_eq!(
        summary,
        [
            (&json!("nic-0"), &json!("00:50:56:aa:bb:01"), &json!("10.0.2.2")),
            (&json!("nic-1"), &json!("00:50:56:aa:bb:02"), &Value::Null),
        ]
    );
    assert_eq!(condition(&vmi.data, "AgentConnected")["status"], "True");
    assert_eq!(vmi.data["status"]["guestOSInfo"]["id"], "debian");
    // The VM's status follows its VMI's in a second write: wait for it, as a client of KubeVirt would.
    wait_for("the VM to show Running", async || {
        let vm = vms.get("web-01").await.ok()?;
        (vm.data["status"]["printableStatus"] == "Running").then_some(())
    })
    .await;

    // The controller's adapters read what the simulator wrote.
    let vmm = migration(&ns);
    let prober = KubeProber::new(client.clone());
    let results: Vec<CheckResult> = {
        let mut results = Vec::new();
        for check in &vmm.spec.validation.checks {
            results.push(prober.check(&vmm, check).await);
        }
        results
    };
    assert!(results.iter().all(|r| matches!(r, CheckResult::Pass { .. })), "{results:?}");

    // The agent goes away and the address changes while the guest runs.
    kv.agent_connected.store(false, Ordering::SeqCst);
    *kv.vmi_ip.lock().unwrap() = "10.0.2.15".into();
    let vmi = wait_for("the agent to disconnect", async || {
        let vmi = vmis.get("web-01").await.ok()?;
        condition(&vmi.data, "AgentConnected").is_null().then_some(vmi)
    })
    .await;
    assert_eq!(vmi.data["status"]["interfaces"][0]["ipAddress"], "10.0.2.15", "the pod network's address");
    assert!(vmi.data["status"].get("guestOSInfo").is_none());
    let agent = prober.check(&vmm, &vmm.spec.validation.checks[0]).await;
    assert!(matches!(agent, CheckResult::NotYet { .. }), "{agent:?}");

    // Halted: the VMI goes. Started again, it cannot be scheduled.
    let halt = json!({"spec": {"runStrategy": "Halted"}});
    vms.patch("web-01", &PatchParams::default(), &Patch::Merge(&halt)).await.unwrap();
    wait_for("the VMI to be deleted", async || {
        matches!(vmis.get_opt("web-01").await, Ok(None)).then_some(())
    })
    .await;
    kv.fail_scheduling.store(1, Ordering::SeqCst);
    let start = json!({"spec": {"runStrategy": "Always"}});
    vms.patch("web-01", &PatchParams::default(), &Patch::Merge(&start)).await.unwrap();
    let vmi = wait_for("an unschedulable VMI", async || {
        let vmi = vmis.get_opt("web-01").await.ok().flatten()?;
        (condition(&vmi.data, "PodScheduled")["reason"] == "Unschedulable").then_some(vmi)
    })
    .await;
    assert_eq!(vmi.data["status"]["phase"], "Scheduling");
    assert_eq!(condition(&vmi.data, "PodScheduled")["message"], kubevirt_sim::UNSCHEDULABLE_MESSAGE);
    assert_eq!(kv.fail_scheduling.load(Ordering::SeqCst), 0);
    wait_for("the VM to show ErrorUnschedulable", async || {
        let vm = vms.get("web-01").await.ok()?;
        (vm.data["status"]["printableStatus"] == "ErrorUnschedulable").then_some(())
    })
    .await;
    let facts = KubeCluster::new(client.clone(), &ns).starting(&vmm).await.unwrap();
    match facts.vmi {
        VmiState::Failed(failure) => {
            assert_eq!(failure.reason, "Unschedulable");
            assert!(failure.message.contains("Insufficient memory"), "{}", failure.message);
        }
        other => panic!("the controller does not see an unschedulable VMI: {other:?}"),
    }
}
