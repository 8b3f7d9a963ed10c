//! The metrics server while a migration runs, against the real
//! kube-apiserver and the real kube-runtime glue; CDI and KubeVirt are the
//! simulators of tests/support and ESXi, the disk store and staging are the
//! in-memory world (the same setup as controller_e2e.rs). Scrapes go over
//! plain TCP, as Prometheus would send them.

use crate::support::sim::{FaultPlan, SimWorld};
use crate::support::{KubeEnv, ensure_storage_class, kubevirt_sim, phase_of, test_namespace};
use kube::api::{Api, PostParams};
use serde_json::json;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing_subscriber::EnvFilter;
use vmmigrate::api::{Phase, VirtualMachineMigration};
use vmmigrate::cli::{LogFormat, log_subscriber};
use vmmigrate::controller::reconciler::{self, ControllerConfig};
use vmmigrate::metrics;

const WAIT: Duration = Duration::from_secs(90);

/// Log output captured in memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn json_lines(&self) -> Vec<serde_json::Value> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_is_visible_by_name_phase_and_bytes_until_completed() {
    // Process-wide JSON logs, to check the reconciler's lines carry the migration.
    let logs = Captured::default();
    let sink = logs.clone();
    tracing::subscriber::set_global_default(log_subscriber(
        LogFormat::Json,
        EnvFilter::new("info"),
        move || sink.clone(),
    ))
    .expect("the only global subscriber of this process");

    let server = metrics::serve("127.0.0.1:0".parse().unwrap()).await.expect("metrics server");
    let addr = server.local_addr();
    assert_eq!(get(addr, "/healthz").await.0, 200);
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 503, "nothing started yet: {body}");

    let client = KubeEnv::shared().client().await;
    ensure_storage_class(&client).await;
    let ns = test_namespace(&client, "metrics").await;
    let world = SimWorld::new(11, FaultPlan::default());
    crate::support::publish_sim_staging(&world);
    let _sims = kubevirt_sim::start(client.clone(), &ns);
    let adapters = crate::support::sim_adapters(&client, &world);
    let config = ControllerConfig {
        namespace: Some(ns.clone()),
        max_requeue: Some(Duration::from_millis(200)),
        instance: "metrics-test".into(),
        interrupt: None,
    };
    let controller = tokio::spawn(reconciler::run(client.clone(), adapters, config, std::future::pending()));

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

    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &ns);
    let mut body = crate::support::sim_migration_json(&ns);
    body["spec"]["validation"]["checks"] = json!([{"name": "agent", "guestAgent": {}}]);
    let vmm: VirtualMachineMigration = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &vmm).await.expect("create migration");

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
    assert!(sample(&last, r#"vmmigrate_migrations{phase="Completed"}"#).is_some_and(|n| n >= 1));
    assert!(sample(&last, &bytes_of("copied")).is_some_and(|n| n > 0), "{last}");
    assert!(last.ends_with("# EOF\n"));
    let excerpt: Vec<&str> =
        last.lines().filter(|l| l.contains("web-01") || l.starts_with("vmmigrate_reconcile_total")).collect();
    eprintln!("/metrics excerpt:\n{}", excerpt.join("\n"));

    // Every line the reconciler logged for this migration names it.
    let key = format!("{ns}/web-01");
    let reconciling: Vec<_> =
        logs.json_lines().into_iter().filter(|l| l["fields"]["message"] == "reconciling").collect();
    assert!(reconciling.iter().any(|l| l["span"]["migration"] == key.as_str()), "{reconciling:?}");
    assert!(reconciling.iter().all(|l| l["span"]["migration"].is_string()), "{reconciling:?}");

    // A controller that dies takes readiness down with it.
    controller.abort();
    let _ = controller.await;
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (503, "controller not ready\n"));
}

#[test]
fn json_log_lines_carry_the_migration_of_the_reconcile_span() {
    let logs = Captured::default();
    let sink = logs.clone();
    let subscriber = log_subscriber(LogFormat::Json, EnvFilter::new("info"), move || sink.clone());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("reconcile", migration = %"team-a/web-01");
        let _in = span.enter();
        tracing::info!(phase = %Phase::Preparing, "reconciling");
    });
    let lines = logs.json_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["fields"]["message"], "reconciling");
    assert_eq!(lines[0]["fields"]["phase"], "Preparing");
    assert_eq!(lines[0]["span"]["migration"], "team-a/web-01");
    assert_eq!(lines[0]["span"]["name"], "reconcile");
}

#[test]
fn log_format_is_text_unless_json_is_asked_for() {
    assert_eq!(LogFormat::parse(""), Some(LogFormat::Text));
    assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
    assert_eq!(LogFormat::parse("JSON"), Some(LogFormat::Json));
    assert_eq!(LogFormat::parse("yaml"), None);
}
