//! The metrics server while a migration runs, against the real
//! kube-apiserver and the real kube-runtime glue; real CDI imports what the
//! in-memory ESXi/disk world stages, KubeVirt is the simulator (the same
//! setup as controller_e2e.rs). Scrapes go over
//! plain TCP, as Prometheus would send them. Each controller records into the
//! registry its config names, so tests running side by side do not see each
//! other's counts.

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use kube::api::{Api, PostParams};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::metrics::{self, Metrics};

/// Migrations import through real CDI: room for a loaded two-core machine.
const WAIT: Duration = Duration::from_secs(300);

/// One GET over a fresh connection: (status code, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the metrics server");
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a response head");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status code");
    (status, body.to_owned())
}

/// The value of the sample line starting with `prefix`.
fn sample(text: &str, prefix: &str) -> Option<i64> {
    text.lines().find(|l| l.starts_with(prefix))?.rsplit(' ').next()?.parse().ok()
}

/// A controller on the simulated world watching `ns`, recording into `metrics`.
fn controller(
    client: &kube::Client,
    ns: &str,
    world: &Arc<SimWorld>,
    metrics: &Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    let config = ControllerConfig {
        namespace: Some(ns.to_owned()),
        max_requeue: Some(Duration::from_millis(200)),
        instance: "metrics-test".into(),
        metrics: metrics.clone(),
        ..Default::default()
    };
    let adapters = crate::support::sim_adapters(client, world, ns);
    tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()))
}

async fn create_migration(client: &kube::Client, ns: &str) -> Api<VirtualMachineMigration> {
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), ns);
    let mut body = crate::support::sim_migration_json(ns);
    body["spec"]["validation"]["checks"] = json!([{"name": "agent", "guestAgent": {}}]);
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");
    api
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_is_visible_by_name_phase_and_bytes_until_completed() {
    let registry = Arc::new(Metrics::new());
    let server =
        metrics::serve("127.0.0.1:0".parse().unwrap(), registry.clone()).await.expect("metrics server");
    let addr = server.local_addr();
    assert_eq!(get(addr, "/healthz").await.0, 200);
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 503, "nothing started yet: {body}");

    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "metrics").await;
    let world = SimWorld::new(11, FaultPlan::default());
    let _staging = crate::support::publish_sim_staging(&world).await;
    let _sims = kubevirt_sim::start(client.clone(), &ns);
    let controller = controller(&client, &ns, &world, &registry);

    // Ready once the controller's cache has synced.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (status, body) = get(addr, "/readyz").await;
        if status == 200 {
            assert_eq!(body, "controller ready\n");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ready: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let api = create_migration(&client, &ns).await;

    // Scrape while it runs: the bytes of each stage show up while it happens.
    let bytes_of =
        |kind: &str| format!(r#"vmmigrate_migration_bytes{{namespace="{ns}",name="web-01",kind="{kind}"}} "#);
    let mut seen_during_run: Vec<(Phase, String, i64)> = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let last = loop {
        let vmm = api.get("web-01").await.unwrap();
        let (status, text) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        for kind in ["copied", "converted", "imported"] {
            if let Some(n) = sample(&text, &bytes_of(kind)).filter(|n| *n > 0)
                && !seen_during_run.iter().any(|(_, k, _)| k == kind)
            {
                seen_during_run.push((phase_of(&vmm), kind.to_owned(), n));
            }
        }
        let done = phase_of(&vmm) == Phase::Completed
            && vmm.status.as_ref().is_some_and(|s| s.timestamps.cleaned_up.is_some());
        if done && text.contains(r#"phase="Completed"} 1"#) {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stuck in {}; status {:#?}",
            phase_of(&vmm),
            vmm.status
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    eprintln!("non-zero bytes seen during the run (phase, kind, bytes): {seen_during_run:?}");
    assert!(
        seen_during_run.iter().any(|(phase, kind, _)| kind == "copied" && *phase != Phase::Completed),
        "copied bytes appeared before Completed: {seen_during_run:?}"
    );

    let info = format!(r#"vmmigrate_migration_info{{namespace="{ns}",name="web-01",phase="Completed"}} 1"#);
    assert!(last.lines().any(|l| l == info), "no {info:?} in\n{last}");
    assert!(!last.contains(r#"name="web-01",phase="Preparing"}"#), "old phases are dropped");
    assert!(sample(&last, r#"vmmigrate_reconcile_total{result="ok"}"#).is_some_and(|n| n > 0), "{last}");
    assert!(sample(&last, "vmmigrate_reconcile_duration_seconds_count").is_some_and(|n| n > 0));
    assert_eq!(
        sample(&last, r#"vmmigrate_migrations{phase="Completed"}"#),
        Some(1),
        "this controller's only"
    );
    assert!(sample(&last, &bytes_of("copied")).is_some_and(|n| n > 0), "{last}");
    assert!(last.ends_with("# EOF\n"));
    let excerpt: Vec<&str> =
        last.lines().filter(|l| l.contains("web-01") || l.starts_with("vmmigrate_reconcile_total")).collect();
    eprintln!("/metrics excerpt:\n{}", excerpt.join("\n"));

    // A controller that dies takes readiness down with it.
    controller.abort();
    let _ = controller.await;
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (503, "controller not ready\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_in_one_process_count_and_report_readiness_in_their_own_registries() {
    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let (ns_a, ns_b) =
        (test_namespace(&client, "metrics-a").await, test_namespace(&client, "metrics-b").await);
    let world = SimWorld::new(12, FaultPlan::default());
    let (a, b) = (Arc::new(Metrics::new()), Arc::new(Metrics::new()));
    let controller_a = controller(&client, &ns_a, &world, &a);
    let _controller_b = controller(&client, &ns_b, &world, &b);
    wait_until("both ready", || a.is_ready() && b.is_ready()).await;

    // A migration only A watches: A records it, B sees none of it.
    create_migration(&client, &ns_a).await;
    let in_a = format!(r#"vmmigrate_migration_info{{namespace="{ns_a}",name="web-01""#);
    wait_until("the migration in A's registry", || a.encode().contains(&in_a)).await;
    let (text_a, text_b) = (a.encode(), b.encode());
    assert!(sample(&text_a, r#"vmmigrate_reconcile_total{result="ok"}"#).is_some_and(|n| n > 0), "{text_a}");
    assert!(!text_b.contains(&ns_a), "B shows A's migration:\n{text_b}");
    assert_eq!(sample(&text_b, r#"vmmigrate_reconcile_total{result="ok"}"#), Some(0), "{text_b}");
    assert_eq!(sample(&text_b, "vmmigrate_reconcile_duration_seconds_count"), Some(0), "{text_b}");

    // A's death takes A's readiness down, not B's.
    controller_a.abort();
    let _ = controller_a.await;
    assert_eq!(a.readiness_report(), "controller not ready\n");
    assert!(b.is_ready(), "{}", b.readiness_report());
}
