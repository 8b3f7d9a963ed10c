//! The `http` validation check: a GET to the application through its Service
//! in the destination namespace, passing when the status and the body are the
//! expected ones.
//!
//! The target is resolved through the Kubernetes API (Service →
//! EndpointSlices → a ready address), never through cluster DNS, and only an
//! address the migrated VM's VMI reports is taken: a tenant who can write
//! Services and EndpointSlices (or an ExternalName) in the destination
//! namespace cannot aim the controller's GET at the API server, a metadata
//! endpoint or another namespace's pods. The check needs no cluster DNS and
//! can be tested against a bare API server.
//!
//! The client is reqwest (hyper underneath) for one HTTP/1.1 GET: no proxy
//! from the environment, no redirects followed, `Connection: close`, at most
//! 1 MiB of body kept.
//!
//! Whatever may still change while the guest boots (no Service, no ready
//! endpoint, refused, reset or timed-out connections) is `NotYet`; an answer
//! with the wrong status or body is `Wrong`.

use crate::api::HttpCheck;
use crate::machine::CheckResult;
use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Client;
use kube::api::{Api, ListParams};
use std::net::IpAddr;
use std::time::Duration;

pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Connect, request and response together.
pub(crate) const TOTAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Body bytes kept for the `bodyContains` test; the rest is not read.
pub(crate) const BODY_LIMIT: usize = 1024 * 1024;
/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const EXCERPT_CHARS: usize = 200;

/// Where the GET goes: an IP address or DNS name, and a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HttpEndpoint {
    pub host: String,
    pub port: u16,
}

impl HttpEndpoint {
    /// `host:port` with IPv6 addresses in brackets: the URL authority and the Host header.
    pub(crate) fn authority(&self) -> String {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(ip)) => format!("[{ip}]:{}", self.port),
            _ => format!("{}:{}", self.host, self.port),
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.authority(), request_target(path))
    }
}

/// A response, its body cut at `BODY_LIMIT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HttpResponse {
    pub status: u16,
    pub body: Vec<u8>,
    /// The body was longer than `BODY_LIMIT` and only its start was read.
    pub truncated: bool,
}

/// Why a GET produced no usable response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("no connection within {}s", .0.as_secs())]
    ConnectTimeout(Duration),
    #[error("no complete response within {}s", .0.as_secs())]
    Timeout(Duration),
    #[error("connection broken: {0}")]
    Io(String),
    #[error("the connection closed before the response was complete")]
    Closed,
    #[error("the answer is not valid HTTP/1.x: {0}")]
    Malformed(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

impl HttpError {
    /// Something answered, just not in HTTP: waiting will not fix that.
    pub(crate) fn is_answer(&self) -> bool {
        matches!(self, HttpError::Malformed(_))
    }
}

/// Runs one `http` check against the Service `check.service` in `namespace`,
/// through one of its ready endpoints whose address is in `vm_addresses`
/// (what the migrated VM's VMI reports).
pub async fn run_http_check(
    client: &Client,
    namespace: &str,
    check: &HttpCheck,
    vm_addresses: &[IpAddr],
) -> CheckResult {
    let endpoint = match resolve_endpoint(client, namespace, check, vm_addresses).await {
        Ok(endpoint) => endpoint,
        Err(message) => return CheckResult::NotYet { message },
    };
    let url = endpoint.url(&check.path);
    let result = match http_get(&endpoint, &check.path).await {
        Ok(response) => judge(&url, check, &response),
        Err(err) if err.is_answer() => CheckResult::Wrong { message: format!("GET {url}: {err}") },
        Err(err) => CheckResult::NotYet { message: format!("GET {url}: {err}") },
    };
    tracing::debug!(service = %check.service, %namespace, ?result, "http check");
    result
}

/// Service → its port `check.port` → a ready endpoint of its EndpointSlices.
async fn resolve_endpoint(
    client: &Client,
    namespace: &str,
    check: &HttpCheck,
    vm_addresses: &[IpAddr],
) -> Result<HttpEndpoint, String> {
    let key = format!("{namespace}/{}", check.service);
    let service = match Api::<Service>::namespaced(client.clone(), namespace).get_opt(&check.service).await {
        Ok(Some(service)) => service,
        Ok(None) => return Err(format!("Service {key} does not exist yet")),
        Err(e) => return Err(format!("reading Service {key}: {e}")),
    };
    let port = service_port(&service, check.port).map_err(|e| format!("Service {key} {e}"))?;
    let selector = format!("{SERVICE_NAME_LABEL}={}", check.service);
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| format!("listing EndpointSlices of Service {key}: {e}"))?;
    select_endpoint(port, &slices.items, vm_addresses).map_err(|e| format!("Service {key} {e}"))
}

/// The Service's TCP port numbered `port`. Errors complete "Service ns/name …".
pub(crate) fn service_port(service: &Service, port: i32) -> Result<&ServicePort, String> {
    let ports = service.spec.as_ref().and_then(|s| s.ports.as_deref()).unwrap_or_default();
    ports.iter().find(|p| p.port == port && is_tcp(p.protocol.as_deref())).ok_or_else(|| {
        let known: Vec<String> = ports
            .iter()
            .map(|p| match p.name.as_deref() {
                Some(name) if !name.is_empty() => format!("{}/{name}", p.port),
                _ => p.port.to_string(),
            })
            .collect();
        if known.is_empty() {
            "has no ports".to_owned()
        } else {
            format!("has no TCP port {port} (it has {})", known.join(", "))
        }
    })
}

/// The first ready address of the VM (one of `vm_addresses`; slices in name
/// order) and the port it serves `port` on: the slice's port with the same
/// name as the Service port, else the Service's numeric targetPort. Errors
/// complete "Service ns/name …".
pub(crate) fn select_endpoint(
    port: &ServicePort,
    slices: &[EndpointSlice],
    vm_addresses: &[IpAddr],
) -> Result<HttpEndpoint, String> {
    let mut ordered: Vec<&EndpointSlice> = slices.iter().collect();
    ordered.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut not_ready = 0;
    let mut without_port = 0;
    let mut foreign: Vec<&str> = Vec::new();
    for slice in ordered {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        let Some(target) = endpoint_port(port, slice) else {
            without_port += slice.endpoints.len();
            continue;
        };
        for endpoint in &slice.endpoints {
            if !is_ready(endpoint) {
                not_ready += 1;
                continue;
            }
            for address in &endpoint.addresses {
                match address.parse::<IpAddr>() {
                    Ok(ip) if vm_addresses.contains(&ip) => {
                        return Ok(HttpEndpoint { host: ip.to_string(), port: target });
                    }
                    Ok(_) => foreign.push(address),
                    Err(_) => {}
                }
            }
        }
    }
    let port_name = port.name.as_deref().filter(|n| !n.is_empty());
    let described = match port_name {
        Some(name) => format!("port {} ({name})", port.port),
        None => format!("port {}", port.port),
    };
    Err(if !foreign.is_empty() {
        let reported: Vec<String> = vm_addresses.iter().map(IpAddr::to_string).collect();
        let reported = if reported.is_empty() { "none yet".to_owned() } else { reported.join(", ") };
        format!(
            "points at {}, not at the migrated VM (its VMI reports {reported}): the check talks only to the VM",
            foreign.join(", ")
        )
    } else if not_ready > 0 {
        format!("has no ready endpoint yet ({not_ready} not ready)")
    } else if without_port > 0 {
        format!("has {without_port} endpoint(s), none with a port for {described}")
    } else {
        "has no endpoints yet".to_owned()
    })
}

fn endpoint_port(port: &ServicePort, slice: &EndpointSlice) -> Option<u16> {
    let wanted = port.name.as_deref().unwrap_or("");
    let named = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref().unwrap_or("") == wanted && is_tcp(p.protocol.as_deref()));
    let number = match (named.and_then(|p| p.port), &port.target_port) {
        (Some(number), _) => number,
        (None, None) => port.port,
        (None, Some(IntOrString::Int(number))) => *number,
        // A named container port is only known from the slice.
        (None, Some(IntOrString::String(_))) => return None,
    };
    u16::try_from(number).ok().filter(|n| *n != 0)
}

/// An unset `ready` is unknown, which consumers should treat as ready (EndpointConditions docs).
fn is_ready(endpoint: &Endpoint) -> bool {
    endpoint.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
}

fn is_tcp(protocol: Option<&str>) -> bool {
    protocol.is_none_or(|p| p == "TCP")
}

/// One GET with `Connection: close`, bounded by `CONNECT_TIMEOUT` and `TOTAL_TIMEOUT`.
pub(crate) async fn http_get(endpoint: &HttpEndpoint, path: &str) -> Result<HttpResponse, HttpError> {
    match tokio::time::timeout(TOTAL_TIMEOUT, exchange(endpoint, path)).await {
        Ok(result) => result,
        Err(_) => Err(HttpError::Timeout(TOTAL_TIMEOUT)),
    }
}

async fn exchange(endpoint: &HttpEndpoint, path: &str) -> Result<HttpResponse, HttpError> {
    // Plain http:// only, but reqwest's rustls build wants a crypto provider:
    // ring, as everywhere else in the binary (one crypto stack).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        // The check goes to the guest, never through a proxy from our environment.
        .no_proxy()
        .http1_only()
        .user_agent(concat!("vmmigrate/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| HttpError::Client(e.to_string()))?;
    let mut response = client
        .get(endpoint.url(path))
        .header(http::header::CONNECTION, "close")
        .send()
        .await
        .map_err(classify)?;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    // Read only what the body test needs; the rest is never downloaded.
    while let Some(chunk) = response.chunk().await.map_err(classify)? {
        let room = BODY_LIMIT - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok(HttpResponse { status, body, truncated: true });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(HttpResponse { status, body, truncated: false })
}

/// A reqwest error in the terms of the check: hyper's parse errors mean
/// something answered that is not HTTP; an early close or reset may be a
/// guest still booting.
fn classify(err: reqwest::Error) -> HttpError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_parse() || h.is_parse_status() {
                return HttpError::Malformed(h.to_string());
            }
            if h.is_incomplete_message() {
                return HttpError::Closed;
            }
        }
        // A body cut short by the peer (fewer bytes than Content-Length).
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
        {
            return HttpError::Closed;
        }
        source = e.source();
    }
    if err.is_timeout() {
        HttpError::ConnectTimeout(CONNECT_TIMEOUT)
    } else if err.is_connect() {
        HttpError::Connect(error_chain(&err))
    } else {
        HttpError::Io(error_chain(&err))
    }
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// The path as a request target: leading `/`, and every byte outside visible
/// ASCII percent-encoded, so a path from the spec can never break the request line.
pub(crate) fn request_target(path: &str) -> String {
    let mut out = String::with_capacity(path.len() + 1);
    if !path.starts_with('/') {
        out.push('/');
    }
    for byte in path.bytes() {
        if (0x21..=0x7e).contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Status first, then `bodyContains`.
pub(crate) fn judge(url: &str, check: &HttpCheck, response: &HttpResponse) -> CheckResult {
    let status = response.status;
    if i32::from(status) != check.expected_status {
        return CheckResult::Wrong {
            message: format!(
                "GET {url} → {status}, expected {}; body: {}",
                check.expected_status,
                body_excerpt(&response.body)
            ),
        };
    }
    let Some(needle) = check.body_contains.as_deref().filter(|n| !n.is_empty()) else {
        return CheckResult::Pass { message: format!("GET {url} → {status}") };
    };
    if needle.is_empty() || response.body.windows(needle.len()).any(|w| w == needle.as_bytes()) {
        return CheckResult::Pass { message: format!("GET {url} → {status}, body contains {needle:?}") };
    }
    let scope = if response.truncated { " (first 1 MiB)" } else { "" };
    CheckResult::Wrong {
        message: format!(
            "GET {url} → {status}, but the body{scope} does not contain {needle:?}; body: {}",
            body_excerpt(&response.body)
        ),
    }
}

/// The first `EXCERPT_CHARS` characters, quoted and escaped onto one line.
fn body_excerpt(body: &[u8]) -> String {
    if body.is_empty() {
        return "empty".to_owned();
    }
    let text = String::from_utf8_lossy(body);
    let cut = excerpt(&text);
    let more = if cut.len() < text.len() { "…" } else { "" };
    format!("{cut:?}{more}")
}

fn excerpt(text: &str) -> &str {
    match text.char_indices().nth(EXCERPT_CHARS) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body_contains: Option<&str>) -> HttpCheck {
        HttpCheck {
            service: "web".into(),
            port: 80,
            path: "/health".into(),
            expected_status: 200,
            body_contains: body_contains.map(str::to_owned),
        }
    }

    fn ok(status: u16, body: &str) -> HttpResponse {
        HttpResponse { status, body: body.as_bytes().to_vec(), truncated: false }
    }

    /// Serves `raw` once on a loopback port (after reading the request head,
    /// which it returns), then closes, or keeps the connection open.
    async fn answer_with(raw: &'static [u8], keep_open: bool) -> (Result<HttpResponse, HttpError>, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&buf[..n]);
            }
            socket.write_all(raw).await.unwrap();
            if keep_open {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            String::from_utf8_lossy(&head).into_owned()
        });
        let result = http_get(&endpoint("127.0.0.1", port), "/health?full=1").await;
        let head = if keep_open {
            server.abort();
            String::new()
        } else {
            server.await.unwrap()
        };
        (result, head)
    }

    async fn answer(raw: &'static [u8]) -> Result<HttpResponse, HttpError> {
        answer_with(raw, false).await.0
    }

    #[tokio::test]
    async fn content_length_body_is_complete_without_waiting_for_eof() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello";
        assert_eq!(answer_with(raw, true).await.0.unwrap(), ok(200, "hello"));
    }

    #[tokio::test]
    async fn a_short_content_length_body_is_closed() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello";
        let result = answer(raw).await;
        assert!(matches!(result, Err(HttpError::Closed)), "{result:?}");
    }

    #[tokio::test]
    async fn body_without_length_runs_to_eof() {
        let raw = b"HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n\r\nnot here";
        assert_eq!(answer(raw).await.unwrap(), ok(404, "not here"));
    }

    #[tokio::test]
    async fn header_names_are_case_insensitive_and_chunked_is_decoded() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        assert_eq!(answer(raw).await.unwrap().body, b"abc");
    }

    #[tokio::test]
    async fn interim_responses_are_skipped() {
        let raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok";
        assert_eq!(answer(raw).await.unwrap(), ok(201, "ok"));
    }

    #[tokio::test]
    async fn no_content_has_an_empty_body() {
        assert_eq!(answer(b"HTTP/1.1 204 No Content\r\n\r\n").await.unwrap(), ok(204, ""));
    }

    #[tokio::test]
    async fn a_closed_connection_before_the_head_ends_is_not_an_answer() {
        for raw in [&b""[..], b"HTTP/1.1 200 OK\r\nContent-"] {
            let err = answer(raw).await.unwrap_err();
            assert!(!err.is_answer(), "{raw:?} gave {err}");
        }
    }

    #[tokio::test]
    async fn answers_that_are_not_http_are_malformed() {
        for raw in [
            &b"SSH-2.0-OpenSSH_9.2\r\n\r\n"[..],
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/2 200\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
        ] {
            let err = answer(raw).await.unwrap_err();
            assert!(err.is_answer(), "{:?} gave {err}", String::from_utf8_lossy(raw));
        }
    }

    #[tokio::test]
    async fn bodies_are_cut_at_the_limit() {
        let long: &'static [u8] = Box::leak(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{}",
                BODY_LIMIT + 10,
                "x".repeat(BODY_LIMIT + 10)
            )
            .into_bytes()
            .into_boxed_slice(),
        );
        let response = answer_with(long, true).await.0.unwrap();
        assert_eq!((response.body.len(), response.truncated), (BODY_LIMIT, true));
        let exact: &'static [u8] = Box::leak(
            format!("HTTP/1.1 200 OK\r\n\r\n{}", "y".repeat(BODY_LIMIT)).into_bytes().into_boxed_slice(),
        );
        let response = answer(exact).await.unwrap();
        assert_eq!((response.body.len(), response.truncated), (BODY_LIMIT, false));
    }

    #[tokio::test]
    async fn the_request_names_the_host_closes_the_connection_and_keeps_the_query() {
        let (result, head) = answer_with(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false).await;
        result.unwrap();
        let head = head.to_ascii_lowercase();
        assert!(head.starts_with("get /health?full=1 http/1.1\r\n"), "{head}");
        assert!(head.contains("\r\nhost: 127.0.0.1:"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    }

    #[test]
    fn paths_cannot_break_the_request_line() {
        assert_eq!(request_target("/a b\r\nX: y"), "/a%20b%0D%0AX:%20y");
        assert_eq!(request_target("/café"), "/caf%C3%A9");
        assert_eq!(request_target("health"), "/health");
    }

    #[test]
    fn ipv6_addresses_are_bracketed_and_dns_names_are_not() {
        let v6 = HttpEndpoint { host: "fd00::5".into(), port: 80 };
        assert_eq!(v6.url("/"), "http://[fd00::5]:80/");
        let dns = HttpEndpoint { host: "web.apps.svc".into(), port: 80 };
        assert_eq!(dns.url("/health"), "http://web.apps.svc:80/health");
    }

    /// What the migrated VM's VMI reports in these tests.
    fn vm() -> Vec<IpAddr> {
        ["10.1.0.5", "10.1.0.1", "10.1.0.9", "fd00::1", "fd00::2"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect()
    }

    #[test]
    fn an_endpoint_that_is_not_the_vm_is_never_chosen() {
        let svc = service(json!([{"port": 80}]));
        let port = service_port(&svc, 80).unwrap();
        // A hand-written slice aiming at the API server and a metadata endpoint.
        let slices = [slice(
            "web-1",
            "IPv4",
            json!([{"addresses": ["10.96.0.1"]}, {"addresses": ["169.254.169.254"]}]),
            json!([{"port": 443}]),
        )];
        let error = select_endpoint(port, &slices, &vm()).unwrap_err();
        assert!(error.contains("points at 10.96.0.1, 169.254.169.254"), "{error}");
        assert!(error.contains("not at the migrated VM (its VMI reports 10.1.0.5"), "{error}");
        let error = select_endpoint(port, &slices, &[]).unwrap_err();
        assert!(error.contains("its VMI reports none yet"), "{error}");
        // Mixed: the VM's own address is taken, the other never.
        let mixed = [slice(
            "web-1",
            "IPv4",
            json!([{"addresses": ["169.254.169.254"]}, {"addresses": ["10.1.0.5"]}]),
            json!([{"port": 80}]),
        )];
        assert_eq!(select_endpoint(port, &mixed, &vm()), Ok(endpoint("10.1.0.5", 80)));
    }

    fn service(ports: serde_json::Value) -> Service {
        serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"ports": ports}})).unwrap()
    }

    fn slice(
        name: &str,
        address_type: &str,
        endpoints: serde_json::Value,
        ports: serde_json::Value,
    ) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": address_type,
            "endpoints": endpoints,
            "ports": ports,
        }))
        .unwrap()
    }

    fn endpoint(host: &str, port: u16) -> HttpEndpoint {
        HttpEndpoint { host: host.into(), port }
    }

    #[test]
    fn the_service_port_is_found_by_number_and_tcp() {
        let svc = service(json!([
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "http", "port": 80, "targetPort": 8080},
        ]));
        assert_eq!(service_port(&svc, 80).unwrap().name.as_deref(), Some("http"));
        assert_eq!(service_port(&svc, 53).unwrap_err(), "has no TCP port 53 (it has 53/dns, 80/http)");
        assert_eq!(service_port(&service(json!([])), 80).unwrap_err(), "has no ports");
    }

    #[test]
    fn the_endpoint_port_is_the_slice_port_with_the_service_port_name() {
        let svc = service(json!([{"name": "http", "port": 80, "targetPort": "web"}]));
        let port = service_port(&svc, 80).unwrap();
        let slices = [slice(
            "web-1",
            "IPv4",
            json!([{"addresses": ["10.1.0.5"], "conditions": {"ready": true}}]),
            json!([{"name": "metrics", "port": 9090}, {"name": "http", "port": 8080, "protocol": "TCP"}]),
        )];
        assert_eq!(select_endpoint(port, &slices, &vm()), Ok(endpoint("10.1.0.5", 8080)));
    }

    #[test]
    fn without_a_named_slice_port_the_numeric_target_port_is_used() {
        let slices = [slice("web-1", "IPv4", json!([{"addresses": ["10.1.0.5"]}]), json!([]))];
        let svc = service(json!([{"port": 80, "targetPort": 8081}]));
        assert_eq!(
            select_endpoint(service_port(&svc, 80).unwrap(), &slices, &vm()),
            Ok(endpoint("10.1.0.5", 8081))
        );
        let svc = service(json!([{"port": 80}]));
        assert_eq!(
            select_endpoint(service_port(&svc, 80).unwrap(), &slices, &vm()),
            Ok(endpoint("10.1.0.5", 80))
        );
        let svc = service(json!([{"name": "http", "port": 80, "targetPort": "web"}]));
        assert_eq!(
            select_endpoint(service_port(&svc, 80).unwrap(), &slices, &vm()).unwrap_err(),
            "has 1 endpoint(s), none with a port for port 80 (http)"
        );
    }

    #[test]
    fn only_ready_addresses_are_chosen_in_slice_name_order() {
        let svc = service(json!([{"port": 80}]));
        let port = service_port(&svc, 80).unwrap();
        let ports = json!([{"port": 80}]);
        let slices = [
            slice("web-c", "IPv4", json!([{"addresses": ["10.1.0.9"]}]), ports.clone()),
            slice("web-a", "FQDN", json!([{"addresses": ["web.example.org"]}]), ports.clone()),
            slice(
                "web-b",
                "IPv6",
                json!([
                    {"addresses": ["fd00::1"], "conditions": {"ready": false, "terminating": true}},
                    {"addresses": ["fd00::2"], "conditions": {"ready": true}},
                ]),
                ports.clone(),
            ),
        ];
        assert_eq!(select_endpoint(port, &slices, &vm()), Ok(endpoint("fd00::2", 80)));
        let not_ready = [slice(
            "web-b",
            "IPv4",
            json!([{"addresses": ["10.1.0.1"], "conditions": {"ready": false}}]),
            ports,
        )];
        assert_eq!(
            select_endpoint(port, &not_ready, &vm()).unwrap_err(),
            "has no ready endpoint yet (1 not ready)"
        );
        assert_eq!(select_endpoint(port, &[], &vm()).unwrap_err(), "has no endpoints yet");
    }

    #[test]
    fn the_expected_status_and_body_pass() {
        let url = "http://10.1.0.5:8080/health";
        assert_eq!(
            judge(url, &check(Some("Welcome")), &ok(200, "<h1>Welcome</h1>")),
            CheckResult::Pass {
                message: "GET http://10.1.0.5:8080/health → 200, body contains \"Welcome\"".into()
            }
        );
        assert_eq!(
            judge(url, &check(None), &ok(200, "")),
            CheckResult::Pass { message: "GET http://10.1.0.5:8080/health → 200".into() }
        );
    }

    #[test]
    fn a_wrong_status_or_body_is_wrong_and_says_what_came_back() {
        let url = "http://10.1.0.5:8080/health";
        assert_eq!(
            judge(url, &check(Some("Welcome")), &ok(503, "maintenance\n")),
            CheckResult::Wrong {
                message: "GET http://10.1.0.5:8080/health → 503, expected 200; body: \"maintenance\\n\""
                    .into()
            }
        );
        let long = format!("{}{}", "é".repeat(EXCERPT_CHARS), "tail");
        let CheckResult::Wrong { message } = judge(url, &check(Some("Welcome")), &ok(200, &long)) else {
            panic!("expected Wrong")
        };
        assert!(message.starts_with(
            "GET http://10.1.0.5:8080/health → 200, but the body does not contain \"Welcome\"; body: \"é"
        ));
        assert!(message.ends_with("é\"…"), "{message}");
        assert!(!message.contains("tail"));
    }

    /// A server that answers and then keeps the connection open must not stall the check.
    #[tokio::test]
    async fn a_complete_response_ends_the_read_even_on_a_kept_open_connection() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 1024];
            let _ = socket.read(&mut request).await.unwrap();
            for piece in [
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
                "lo\r\n6\r\n world\r\n0\r\n\r\n",
            ] {
                socket.write_all(piece.as_bytes()).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        // A read waiting for EOF would end in the 10 s timeout, an error.
        let response = http_get(&endpoint("127.0.0.1", port), "/").await.unwrap();
        assert_eq!(response, ok(200, "hello world"));
        server.abort();
    }
}
