//! Prometheus metrics, liveness and readiness of the process.
//!
//! One [`Metrics`] per process, created by the entry point and handed (as an
//! `Arc`) to the controller, the gitops loop and the adapters that record
//! into it, and a small HTTP server ([`serve`]) in front of it:
//!
//! | route | answer |
//! |---|---|
//! | `GET /metrics` | OpenMetrics text |
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 when every registered component is ready, else 503 with the list |
//!
//! The per-migration families (`vmmigrate_migrations`,
//! `vmmigrate_migration_info`, `vmmigrate_migration_bytes`,
//! `vmmigrate_copy_throughput_bytes_per_second`) are computed at scrape time
//! from what the reconciler last recorded for each migration, so a phase
//! change replaces the old label set instead of leaving it behind.
//!
//! Served by `crate::server` (hyper under its connection cap and deadlines):
//! three GET routes.

use crate::api::{Phase, VirtualMachineMigrationStatus};
use crate::server::{self, Server, ServerLimits};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpListener;

/// Where the metrics server listens unless told otherwise.
pub(crate) const DEFAULT_LISTEN: &str = "0.0.0.0:9090";
/// Environment variable naming the metrics server's address.
pub(crate) const LISTEN_ENV: &str = "VMMIGRATE_METRICS_LISTEN";
/// Content type of `/metrics`.
pub(crate) const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;

fn labels<const N: usize>(pairs: [(&'static str, &str); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k, v.to_owned())).collect()
}

/// Which byte count a phase's `status.progress` is: `copied` while
/// Preparing, `converted` while Converting, `imported` while Importing.
pub(crate) fn bytes_kind(phase: Phase) -> Option<&'static str> {
    match phase {
        Phase::Preparing => Some("copied"),
        Phase::Converting => Some("converted"),
        Phase::Importing => Some("imported"),
        _ => None,
    }
}

/// What the reconciler last recorded about one migration.
#[derive(Clone, Debug, Default)]
struct MigrationView {
    phase: Phase,
    /// Last `progress.bytesDone` per kind; kept after the phase moves on.
    bytes: BTreeMap<&'static str, i64>,
    /// Last `progress.bytesPerSecond` while Preparing.
    copy_rate: i64,
}

/// The state read at scrape time, shared between `Metrics` and its collector.
#[derive(Debug, Default)]
struct Scraped {
    migrations: Mutex<BTreeMap<(String, String), MigrationView>>,
    /// The staging server's byte counter, read at scrape time.
    staging: Mutex<Option<Arc<AtomicU64>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn encode_family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (Labels, i64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in samples {
        match metric_type {
            MetricType::Info => family.encode_info(&labels)?,
            _ => family.encode_family(&labels)?.encode_gauge(&value)?,
        }
    }
    Ok(())
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let migrations = lock(&self.migrations).clone();
        let mut per_phase: HashMap<Phase, i64> = Phase::ALL.into_iter().map(|p| (p, 0)).collect();
        for view in migrations.values() {
            *per_phase.entry(view.phase).or_default() += 1;
        }
        encode_family(
            &mut encoder,
            "vmmigrate_migrations",
            "Migrations per phase",
            MetricType::Gauge,
            Phase::ALL.into_iter().map(|p| (labels([("phase", &p.to_string())]), per_phase[&p])),
        )?;
        let key =
            |(ns, name): &(String, String)| labels([("namespace", ns.as_str()), ("name", name.as_str())]);
        encode_family(
            &mut encoder,
            "vmmigrate_migration",
            "The current phase of each migration",
            MetricType::Info,
            migrations.iter().map(|(k, v)| {
                let mut l = key(k);
                l.push(("phase", v.phase.to_string()));
                (l, 1)
            }),
        )?;
        encode_family(
            &mut encoder,
            "vmmigrate_migration_bytes",
            "Bytes copied (Preparing), converted (Converting) and imported (Importing) per migration, \
             from status.progress.bytesDone; each kind keeps its last value",
            MetricType::Gauge,
            migrations.iter().flat_map(|(k, v)| {
                v.bytes.iter().map(move |(kind, bytes)| {
                    let mut l = key(k);
                    l.push(("kind", (*kind).to_owned()));
                    (l, *bytes)
                })
            }),
        )?;
        let copying = migrations.values().filter(|v| v.phase == Phase::Preparing).map(|v| v.copy_rate).sum();
        encode_family(
            &mut encoder,
            "vmmigrate_copy_throughput_bytes_per_second",
            "Disk copy rate of the migrations in Preparing, from status.progress.bytesPerSecond",
            MetricType::Gauge,
            [(Labels::new(), copying)],
        )?;
        if let Some(bytes_served) = lock(&self.staging).clone() {
            let served = ConstCounter::new(bytes_served.load(Ordering::Relaxed));
            let metric = encoder.encode_descriptor(
                "vmmigrate_staging_bytes_served",
                "Bytes the staging server sent to CDI importers",
                None,
                served.metric_type(),
            )?;
            served.encode(metric)?;
        }
        Ok(())
    }
}

/// The process's metrics and readiness registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    scraped: Arc<Scraped>,
    readiness: Mutex<BTreeMap<String, bool>>,
    reconciles: Family<Labels, Counter>,
    reconcile_errors: Family<Labels, Counter>,
    reconcile_duration: Histogram,
    copy_bytes: Counter,
    convert_bytes: Counter,
    git_fetches: Family<Labels, Counter>,
    git_pushes: Family<Labels, Counter>,
    git_applies: Family<Labels, Counter>,
    webhook_deliveries: Family<Labels, Counter>,
    leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry; an entry point creates one and shares it.
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Registry::default(),
            scraped: Arc::new(Scraped::default()),
            readiness: Mutex::new(BTreeMap::new()),
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            // 5 ms to about 80 s.
            reconcile_duration: Histogram::new(exponential_buckets(0.005, 2.0, 15)),
            copy_bytes: Counter::default(),
            convert_bytes: Counter::default(),
            git_fetches: Family::default(),
            git_pushes: Family::default(),
            git_applies: Family::default(),
            webhook_deliveries: Family::default(),
            leader: Gauge::default(),
        };
        let mut registry = Registry::default();
        registry.register("vmmigrate_reconcile", "Reconciles by result (ok, error)", m.reconciles.clone());
        registry.register(
            "vmmigrate_reconcile_errors",
            "Failed reconciles by error reason",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "vmmigrate_reconcile_duration_seconds",
            "Time one reconcile took",
            m.reconcile_duration.clone(),
        );
        registry.register(
            "vmmigrate_copy_bytes",
            "Bytes read from ESXi hosts by finished disk copy runs",
            m.copy_bytes.clone(),
        );
        registry.register(
            "vmmigrate_convert_bytes",
            "Bytes of artifacts written by finished in-process conversions",
            m.convert_bytes.clone(),
        );
        registry.register(
            "vmmigrate_git_fetch",
            "Fetches of the tracked branch by result (ok, error)",
            m.git_fetches.clone(),
        );
        registry.register(
            "vmmigrate_git_push",
            "Status write-backs by result (pushed, unchanged, error)",
            m.git_pushes.clone(),
        );
        registry.register(
            "vmmigrate_git_apply",
            "New commits of the tracked branch by result (applied, rejected, error)",
            m.git_applies.clone(),
        );
        registry.register(
            "vmmigrate_webhook_deliveries",
            "Webhook events that reached the gitops loop, by forge and result",
            m.webhook_deliveries.clone(),
        );
        registry.register(
            "vmmigrate_leader",
            "1 while this process holds the leader lease",
            m.leader.clone(),
        );
        registry.register_collector(Box::new(m.scraped.clone()));
        // Both series exist from the start, so a rate over them is defined.
        for result in ["ok", "error"] {
            let _ = m.reconciles.get_or_create(&labels([("result", result)]));
        }
        Metrics { registry, ..m }
    }

    /// The OpenMetrics exposition of everything recorded.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// One reconcile finished after `elapsed`; `error` is the reason when it failed.
    pub(crate) fn reconciled(&self, elapsed: Duration, error: Option<&str>) {
        self.reconcile_duration.observe(elapsed.as_secs_f64());
        let result = if error.is_some() { "error" } else { "ok" };
        self.reconciles.get_or_create(&labels([("result", result)])).inc();
        if let Some(reason) = error {
            self.reconcile_errors.get_or_create(&labels([("reason", reason)])).inc();
        }
    }

    /// The status just recorded for `namespace/name`.
    pub(crate) fn observe_migration(
        &self,
        namespace: &str,
        name: &str,
        status: &VirtualMachineMigrationStatus,
    ) {
        let mut migrations = lock(&self.scraped.migrations);
        let view = migrations.entry((namespace.to_owned(), name.to_owned())).or_default();
        view.phase = status.phase;
        if let (Some(kind), Some(progress)) = (bytes_kind(status.phase), &status.progress) {
            view.bytes.insert(kind, progress.bytes_done);
            if status.phase == Phase::Preparing {
                view.copy_rate = progress.bytes_per_second;
            }
        }
        // Finished work is counted from its evidence: the status that leaves
        // a phase carries no progress, but it records every disk it finished.
        let sum = |done: fn(&crate::api::DiskStatus) -> bool| -> i64 {
            status.disks.iter().filter(|d| done(d)).map(|d| d.size_bytes).sum()
        };
        for (kind, finished) in [
            ("copied", sum(|d| d.source_sha256.is_some())),
            ("converted", sum(|d| d.artifact_sha256.is_some())),
        ] {
            if finished > 0 {
                let entry = view.bytes.entry(kind).or_default();
                *entry = (*entry).max(finished);
            }
        }
    }

    /// The migration is gone: its label sets go too.
    pub(crate) fn forget_migration(&self, namespace: &str, name: &str) {
        lock(&self.scraped.migrations).remove(&(namespace.to_owned(), name.to_owned()));
    }

    /// A disk copy run read `bytes` from the host.
    pub(crate) fn copied_bytes(&self, bytes: u64) {
        self.copy_bytes.inc_by(bytes);
    }

    /// A conversion wrote an artifact of `bytes`.
    pub(crate) fn converted_bytes(&self, bytes: u64) {
        self.convert_bytes.inc_by(bytes);
    }

    /// Reports `vmmigrate_staging_bytes_served_total` from the staging
    /// server's own counter (metrics knows no domain type).
    pub(crate) fn watch_staging(&self, bytes_served: Arc<AtomicU64>) {
        *lock(&self.scraped.staging) = Some(bytes_served);
    }

    pub(crate) fn git_fetch(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.git_fetches.get_or_create(&labels([("result", result)])).inc();
    }

    /// `result`: `pushed`, `unchanged` or `error`.
    pub(crate) fn git_push(&self, result: &str) {
        self.git_pushes.get_or_create(&labels([("result", result)])).inc();
    }

    /// `result`: `applied`, `rejected` or `error`.
    pub(crate) fn git_apply(&self, result: &str) {
        self.git_applies.get_or_create(&labels([("result", result)])).inc();
    }

    /// A verified webhook event of `forge` (`github`, `gitea`, `gitlab`)
    /// reached the gitops loop.
    pub(crate) fn webhook_delivered(&self, forge: &str) {
        self.webhook_deliveries.get_or_create(&labels([("forge", forge), ("result", "accepted")])).inc();
    }

    /// Whether this process holds the leader Lease.
    pub(crate) fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Registers `component` (or updates it); `/readyz` needs every one ready.
    pub(crate) fn set_ready(&self, component: &str, ready: bool) {
        lock(&self.readiness).insert(component.to_owned(), ready);
    }

    /// Registers `component` as not ready unless it is registered already.
    pub(crate) fn register_readiness(&self, component: &str) {
        lock(&self.readiness).entry(component.to_owned()).or_insert(false);
    }

    /// True when at least one component is registered and all are ready:
    /// before anything registered, nothing runs that could serve.
    pub fn is_ready(&self) -> bool {
        let readiness = lock(&self.readiness);
        !readiness.is_empty() && readiness.values().all(|r| *r)
    }

    /// `component ready|not ready` per line, for the `/readyz` body.
    pub fn readiness_report(&self) -> String {
        let readiness = lock(&self.readiness);
        if readiness.is_empty() {
            return "nothing started yet\n".to_owned();
        }
        readiness.iter().map(|(c, r)| format!("{c} {}\n", if *r { "ready" } else { "not ready" })).collect()
    }
}

/// Registers `component` as not ready, and marks it not ready again when
/// dropped: a long-running task holds one, so its death (return, panic,
/// abort) takes readiness down with it.
#[must_use = "the component is marked not ready when the guard is dropped"]
#[derive(Debug)]
pub(crate) struct ReadinessGuard {
    metrics: Arc<Metrics>,
    component: String,
}

impl ReadinessGuard {
    pub(crate) fn new(metrics: &Arc<Metrics>, component: &str) -> ReadinessGuard {
        metrics.set_ready(component, false);
        ReadinessGuard { metrics: metrics.clone(), component: component.to_owned() }
    }
}

impl Drop for ReadinessGuard {
    fn drop(&mut self) {
        self.metrics.set_ready(&self.component, false);
    }
}

/// `configured` (`--metrics-listen`, `process::ServeOptions`), else
/// `VMMIGRATE_METRICS_LISTEN`, else [`DEFAULT_LISTEN`].
pub(crate) fn listen_addr(configured: Option<SocketAddr>) -> io::Result<SocketAddr> {
    if let Some(addr) = configured {
        return Ok(addr);
    }
    let text = std::env::var(LISTEN_ENV).unwrap_or_else(|_| DEFAULT_LISTEN.to_owned());
    text.parse().map_err(|e| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("{LISTEN_ENV}={text:?} is not an address: {e}"))
    })
}

/// A running metrics server. Dropping it stops the server.
pub struct MetricsServer {
    server: Server,
}

impl fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsServer").field("addr", &self.server.local_addr()).finish()
    }
}

impl MetricsServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` of `metrics` on `addr`.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> io::Result<MetricsServer> {
    start(server::bind(addr)?, metrics)
}

/// [`serve`] on [`listen_addr`]`(configured)`; errors name the address.
pub(crate) async fn serve_configured(
    configured: Option<SocketAddr>,
    metrics: Arc<Metrics>,
) -> io::Result<MetricsServer> {
    let addr = listen_addr(configured)?;
    serve(addr, metrics).await.map_err(|e| io::Error::new(e.kind(), format!("metrics server on {addr}: {e}")))
}

/// The limits of the metrics server: scrapes and probes are small GET
/// requests, so the cap is lower than the webhook's.
fn limits() -> ServerLimits {
    ServerLimits { max_connections: 256, max_head_bytes: 8 * 1024, ..ServerLimits::default() }
}

fn start(listener: TcpListener, metrics: Arc<Metrics>) -> io::Result<MetricsServer> {
    let server = Server::start(listener, limits(), None, "metrics", move |request| {
        let answer = route(&request, &metrics);
        async move { answer }
    })?;
    tracing::info!(addr = %server.local_addr(), "metrics server listening");
    Ok(MetricsServer { server })
}

fn route<B>(request: &Request<B>, metrics: &Metrics) -> Response<server::Body> {
    if request.method() != Method::GET {
        let mut answer = server::text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
        answer.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET"));
        return answer;
    }
    match request.uri().path() {
        "/metrics" => {
            let mut answer = server::text(StatusCode::OK, metrics.encode());
            answer
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE));
            answer
        }
        "/healthz" => server::text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            let status = if metrics.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            server::text(status, metrics.readiness_report())
        }
        _ => server::text(StatusCode::NOT_FOUND, "not found: /metrics, /healthz, /readyz\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Progress;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    fn status(phase: Phase, bytes_done: i64, bytes_per_second: i64) -> VirtualMachineMigrationStatus {
        VirtualMachineMigrationStatus {
            phase,
            progress: (bytes_done > 0).then(|| Progress {
                bytes_done,
                bytes_per_second,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[test]
    fn readiness_needs_a_registered_component_and_all_of_them_ready() {
        let m = Metrics::new();
        assert!(!m.is_ready(), "nothing registered is not ready");
        m.set_ready("controller", false);
        assert!(!m.is_ready());
        m.set_ready("controller", true);
        assert!(m.is_ready());
        m.set_ready("gitops", false);
        assert!(!m.is_ready());
        assert_eq!(m.readiness_report(), "controller ready\ngitops not ready\n");
        m.set_ready("gitops", true);
        assert!(m.is_ready());
    }

    #[test]
    fn a_readiness_guard_takes_its_component_down_when_dropped() {
        let m = Arc::new(Metrics::new());
        let guard = ReadinessGuard::new(&m, "controller");
        assert_eq!(m.readiness_report(), "controller not ready\n");
        m.set_ready("controller", true);
        assert!(m.is_ready());
        drop(guard);
        assert_eq!(m.readiness_report(), "controller not ready\n");
    }

    #[test]
    fn a_phase_change_replaces_the_info_label_set_and_bytes_keep_their_kind() {
        let m = Metrics::new();
        m.observe_migration("ns", "web-01", &status(Phase::Preparing, 4096, 1000));
        let text = m.encode();
        assert!(
            text.contains(r#"vmmigrate_migration_info{namespace="ns",name="web-01",phase="Preparing"} 1"#)
        );
        assert!(
            text.contains(r#"vmmigrate_migration_bytes{namespace="ns",name="web-01",kind="copied"} 4096"#)
        );
        assert!(text.contains("vmmigrate_copy_throughput_bytes_per_second 1000"), "{text}");
        assert!(text.contains(r#"vmmigrate_migrations{phase="Preparing"} 1"#));

        m.observe_migration("ns", "web-01", &status(Phase::Converting, 0, 0));
        m.observe_migration("ns", "web-01", &status(Phase::Converting, 2048, 0));
        let text = m.encode();
        assert!(!text.contains(r#"phase="Preparing"} 1"#), "{text}");
        assert!(
            text.contains(r#"vmmigrate_migration_info{namespace="ns",name="web-01",phase="Converting"} 1"#)
        );
        assert!(text.contains(r#"kind="copied"} 4096"#), "the copy total stays: {text}");
        assert!(text.contains(r#"kind="converted"} 2048"#));
        assert!(text.contains("vmmigrate_copy_throughput_bytes_per_second 0"), "{text}");
        assert!(text.contains(r#"vmmigrate_migrations{phase="Preparing"} 0"#));

        m.forget_migration("ns", "web-01");
        assert!(!m.encode().contains("web-01"));
    }

    #[test]
    fn counters_and_the_staging_counter_are_exposed_in_openmetrics_text() {
        let m = Metrics::new();
        m.reconciled(Duration::from_millis(20), None);
        m.reconciled(Duration::from_millis(20), Some("KubeAPIError"));
        m.git_fetch(true);
        m.git_apply("rejected");
        m.git_push("pushed");
        m.copied_bytes(10);
        m.set_leader(true);
        let text = m.encode();
        for line in [
            r#"vmmigrate_reconcile_total{result="ok"} 1"#,
            r#"vmmigrate_reconcile_total{result="error"} 1"#,
            r#"vmmigrate_reconcile_errors_total{reason="KubeAPIError"} 1"#,
            "vmmigrate_reconcile_duration_seconds_count 2",
            r#"vmmigrate_git_fetch_total{result="ok"} 1"#,
            r#"vmmigrate_git_apply_total{result="rejected"} 1"#,
            r#"vmmigrate_git_push_total{result="pushed"} 1"#,
            "vmmigrate_copy_bytes_total 10",
            "vmmigrate_leader 1",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert!(!text.contains("vmmigrate_staging_bytes_served"), "absent until a staging server is watched");
        let bytes_served = Arc::new(AtomicU64::new(77));
        m.watch_staging(bytes_served);
        assert!(m.encode().contains("vmmigrate_staging_bytes_served_total 77"));
        assert!(m.encode().ends_with("# EOF\n"));
    }

    #[tokio::test]
    async fn routes_answer_get_only_and_readyz_follows_the_registry() {
        let m = Arc::new(Metrics::new());
        let server = start(TcpListener::bind("127.0.0.1:0").await.unwrap(), m.clone()).unwrap();
        let addr = server.local_addr();
        let req = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(get(addr, &req("/healthz")).await.starts_with("HTTP/1.1 200 "));
        let not_ready = get(addr, &req("/readyz")).await;
        assert!(not_ready.starts_with("HTTP/1.1 503 "), "{not_ready}");
        m.set_ready("controller", true);
        assert!(get(addr, &req("/readyz?verbose")).await.starts_with("HTTP/1.1 200 "));
        let scrape = get(addr, &req("/metrics")).await;
        assert!(scrape.starts_with("HTTP/1.1 200 "), "{scrape}");
        assert!(scrape.contains(&format!("content-type: {OPENMETRICS_CONTENT_TYPE}\r\n")), "{scrape}");
        assert!(scrape.contains(r#"vmmigrate_reconcile_total{result="ok"} 0"#), "{scrape}");
        assert!(get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await.starts_with("HTTP/1.1 405 "));
        assert!(get(addr, &req("/other")).await.starts_with("HTTP/1.1 404 "));
        assert!(get(addr, "nonsense\r\n\r\n").await.starts_with("HTTP/1.1 400 "));
        drop(server);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(TcpStream::connect(addr).await.is_err(), "dropping the server stops it");
    }

    #[test]
    fn listen_addr_prefers_the_flag() {
        let flag: SocketAddr = "127.0.0.1:9999".parse().unwrap();
        assert_eq!(listen_addr(Some(flag)).unwrap(), flag);
    }
}
