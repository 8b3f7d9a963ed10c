//! The worker's control API (`vmmigrate worker`) as any pod on the network
//! could call it: it answers the controller's token for its own migration
//! and nothing else, over TLS with the certificate the controller made for
//! it, and bounds what it reads.

use std::sync::Arc;
use vmmigrate::convert::access::StagingAccess;
use vmmigrate::machine::CopyState;
use vmmigrate::metrics::Metrics;
use vmmigrate::worker::process::{WorkerOptions, start};
use vmmigrate::worker::protocol::{CALL_PATH, Call, HEALTH_PATH, MAX_REQUEST_BYTES, Request};

const HOST: &str = "db-02-vmm-worker.apps.svc";

fn migration(uid: &str) -> vmmigrate::api::VirtualMachineMigration {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "migration.platform.example/v1alpha1",
        "kind": "VirtualMachineMigration",
        "metadata": { "name": "db-02", "namespace": "apps", "uid": uid },
        "spec": {
            "source": { "host": "127.0.0.1", "hostKey": format!("SHA256:{}", "A".repeat(43)),
                        "credentialsSecretRef": { "name": "esxi" }, "vm": { "name": "db-02" } },
            "destination": { "namespace": "apps", "storageClassName": "local-path" },
        },
    }))
    .unwrap()
}

/// A worker for migration `uid-a` on a fresh claim, and its controller's CA.
async fn start_worker(dir: &std::path::Path) -> (vmmigrate::worker::process::Running, StagingAccess) {
    let controller = StagingAccess::load_or_create(&dir.join("ca"), "https://staging.example").unwrap();
    let identity = controller.worker_identity("uid-a", &[HOST.to_owned()]).unwrap();
    let (identity_dir, credentials_dir) = (dir.join("identity"), dir.join("source"));
    std::fs::create_dir_all(&identity_dir).unwrap();
    std::fs::create_dir_all(&credentials_dir).unwrap();
    for (file, text) in [
        ("key", &identity.key_hex),
        ("tls.crt", &identity.cert_pem),
        ("tls.key", &identity.key_pem),
        ("ca.crt", &identity.ca_pem),
    ] {
        std::fs::write(identity_dir.join(file), text).unwrap();
    }
    std::fs::write(credentials_dir.join("password"), "secret").unwrap();
    let opts = WorkerOptions {
        uid: "uid-a".into(),
        work_dir: dir.join("work"),
        identity_dir,
        credentials_dir,
        listen: "127.0.0.1:0".parse().unwrap(),
        staging_listen: "127.0.0.1:0".parse().unwrap(),
        staging_url: format!("https://{HOST}:8443"),
        copy_streams: 1,
        guest_conversion_tcg: false,
        conversions: 1,
    };
    let worker = start(&opts, Arc::new(Metrics::new())).await.expect("the worker starts");
    (worker, controller)
}

#[tokio::test]
async fn the_worker_answers_only_its_controllers_token_for_its_own_migration_and_bounds_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (worker, controller) = start_worker(dir.path()).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(controller.client_tls().unwrap())
        .resolve(HOST, worker.control_addr())
        .no_proxy()
        .build()
        .unwrap();
    let url = |path: &str| format!("https://{HOST}:{}{path}", worker.control_addr().port());
    let own_token = controller.for_migration("uid-a").control_token();
    let call = |uid: &str| Request { vmm: migration(uid), call: Call::CopyState { disk: 0 } };

    let health = client.get(url(HEALTH_PATH)).send().await.unwrap();
    assert_eq!(health.status(), 200, "the readiness probe needs no token");

    let post = |token: Option<String>, body: Vec<u8>| {
        let mut request = client.post(url(CALL_PATH)).header("content-type", "application/json").body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    let body = |uid: &str| serde_json::to_vec(&call(uid)).unwrap();
    assert_eq!(post(None, body("uid-a")).await.unwrap().status(), 401, "no token");
    let other = controller.for_migration("uid-b").control_token();
    assert_eq!(post(Some(other), body("uid-a")).await.unwrap().status(), 401, "another worker's token");
    assert_eq!(post(Some(controller.control_token()), body("uid-a")).await.unwrap().status(), 401);
    assert_eq!(
        post(Some(own_token.clone()), body("uid-b")).await.unwrap().status(),
        403,
        "another migration"
    );
    assert_eq!(post(Some(own_token.clone()), b"{not json".to_vec()).await.unwrap().status(), 400);
    let huge = vec![b' '; MAX_REQUEST_BYTES + 1];
    assert_eq!(post(Some(own_token.clone()), huge).await.unwrap().status(), 413, "bounded");

    let answer = post(Some(own_token), body("uid-a")).await.unwrap();
    assert_eq!(answer.status(), 200);
    let state: CopyState = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
    assert_eq!(state, CopyState::Absent, "nothing copied on a fresh claim");

    // A client trusting another staging CA does not reach it (nor would the
    // controller reach an impostor): TLS with this controller's CA only.
    let other_ca =
        StagingAccess::load_or_create(&dir.path().join("other-ca"), "https://staging.example").unwrap();
    let stranger = reqwest::Client::builder()
        .use_preconfigured_tls(other_ca.client_tls().unwrap())
        .resolve(HOST, worker.control_addr())
        .no_proxy()
        .build()
        .unwrap();
    assert!(stranger.get(url(HEALTH_PATH)).send().await.is_err(), "a certificate of another CA was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_start_whose_ssh_login_outlasts_the_controllers_call_is_not_cancelled_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (worker, controller) = start_worker(dir.path()).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    // An ESXi host that accepts the connection and then says nothing: the
    // SSH login waits for its banner until the migration's SSH timeout.
    let host = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = host.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = host.accept().await {
            open.push(stream);
        }
    });
    let mut vmm = migration("uid-a");
    vmm.spec.source.port = i32::from(port);
    vmm.status = Some(serde_json::from_value(serde_json::json!({
        "phase": "Preparing",
        "sourceInventory": {
            "vmid": "2", "name": "db-02", "vmxPath": "[ds1] db-02/db-02.vmx", "firmware": "bios",
            "cpuSockets": 1, "coresPerSocket": 1, "memoryMiB": 512, "powerState": "PoweredOff",
            "disks": [{ "index": 0, "device": "scsi0:0", "bus": "scsi", "descriptorPath": "/vmfs/volumes/ds1/db-02/db-02.vmdk",
                        "extentPath": "/vmfs/volumes/ds1/db-02/db-02-flat.vmdk", "capacityBytes": 1048576 }],
        },
    }))
    .unwrap());
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(controller.client_tls().unwrap())
        .resolve(HOST, worker.control_addr())
        .no_proxy()
        .build()
        .unwrap();
    let url = format!("https://{HOST}:{}{CALL_PATH}", worker.control_addr().port());
    let token = controller.for_migration("uid-a").control_token();
    let post = |call: Call, timeout: std::time::Duration| {
        client
            .post(&url)
            .bearer_auth(&token)
            .timeout(timeout)
            .json(&Request { vmm: vmm.clone(), call })
            .send()
    };
    // The controller's call gives up long before the login does.
    let started = post(Call::StartCopy { disk: 0 }, std::time::Duration::from_secs(1)).await;
    assert!(started.is_err_and(|e| e.is_timeout()), "the start answered before its login ended");
    // The start goes on: its place is held, a read says the copy is under way.
    let answer = post(Call::CopyState { disk: 0 }, std::time::Duration::from_secs(10)).await.unwrap();
    let state: CopyState = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
    assert!(
        matches!(state, CopyState::InProgress { .. }),
        "the start was cancelled with the call: {state:?}"
    );
    held.abort();
}
