//! The `http` validation check against a real kube-apiserver: the target is
//! resolved from a real Service and EndpointSlice, and the GET goes to a real
//! HTTP server (busybox httpd) in a network namespace of the test's own,
//! because the API server refuses loopback addresses in EndpointSlices.

use crate::support::netns::Netns;
use crate::support::{KubeEnv, test_namespace};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use std::net::IpAddr;
use vmmigrate::api::HttpCheck;
use vmmigrate::destination::http_check::{SERVICE_NAME_LABEL, run_http_check};
use vmmigrate::machine::CheckResult;

const PAGE: &str = "<html><body><h1>Welcome to web01</h1><p>migrated from ESXi</p></body></html>\n";

fn http(port: i32, path: &str, expected_status: i32, body_contains: Option<&str>) -> HttpCheck {
    HttpCheck {
        service: "web".into(),
        port,
        path: path.into(),
        expected_status,
        body_contains: body_contains.map(str::to_owned),
    }
}

/// A selector-less Service `web` (nothing else writes its EndpointSlices).
async fn create_service(client: &Client, ns: &str, ports: Value) {
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"ports": ports},
    }))
    .expect("service object");
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &service)
        .await
        .expect("create Service");
}

async fn create_slice(client: &Client, ns: &str, name: &str, endpoints: Value, ports: Value) {
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {SERVICE_NAME_LABEL: "web"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    }))
    .expect("endpoint slice object");
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &slice)
        .await
        .expect("create EndpointSlice");
}

/// Service port 80 named `http` → the namespace's address, port 8080.
async fn web_service_at(client: &Client, ns: &str, netns: &Netns) {
    create_service(client, ns, json!([{"name": "http", "port": 80, "targetPort": 8080}])).await;
    create_slice(
        client,
        ns,
        "web-1",
        json!([{"addresses": [netns.ip.to_string()], "conditions": {"ready": true}}]),
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
    )
    .await;
}

/// The check as the controller runs it, for a VM whose VMI reports `vm`.
async fn run(client: &Client, ns: &str, check: &HttpCheck, vm: &[IpAddr]) -> CheckResult {
    run_http_check(client, ns, check, vm).await
}

#[tokio::test]
async fn http_check_passes_when_the_service_answers_with_the_expected_status_and_body() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-pass").await;
    let netns = Netns::new().expect("network namespace");
    let vm = [IpAddr::V4(netns.ip)];
    netns.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
    web_service_at(&client, &ns, &netns).await;

    let result = run(&client, &ns, &http(80, "/", 200, Some("Welcome to web01")), &vm).await;
    let url = format!("http://{}:8080/", netns.ip);
    assert_eq!(
        result,
        CheckResult::Pass { message: format!("GET {url} → 200, body contains \"Welcome to web01\"") }
    );

    let without_body = run(&client, &ns, &http(80, "/index.html", 200, None), &vm).await;
    assert_eq!(without_body, CheckResult::Pass { message: format!("GET {url}index.html → 200") });
}

#[tokio::test]
async fn wrong_status_or_body_is_wrong_not_not_yet() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-wrong").await;
    let netns = Netns::new().expect("network namespace");
    let vm = [IpAddr::V4(netns.ip)];
    netns.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
    web_service_at(&client, &ns, &netns).await;

    let missing_page = run(&client, &ns, &http(80, "/health", 200, None), &vm).await;
    let CheckResult::Wrong { message } = &missing_page else {
        panic!("expected Wrong, got {missing_page:?}")
    };
    let prefix = format!("GET http://{}:8080/health → 404, expected 200; body: ", netns.ip);
    assert!(message.starts_with(&prefix), "{message}");

    let other_text = run(&client, &ns, &http(80, "/", 200, Some("Goodbye")), &vm).await;
    let CheckResult::Wrong { message } = &other_text else { panic!("expected Wrong, got {other_text:?}") };
    assert!(message.contains("→ 200, but the body does not contain \"Goodbye\""), "{message}");
    assert!(message.contains("Welcome to web01"), "the message shows what came back: {message}");
}

#[tokio::test]
async fn missing_service_or_no_ready_endpoints_is_not_yet() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-notyet").await;
    let check = http(80, "/", 200, None);
    let vm: [IpAddr; 1] = ["10.251.255.254".parse().unwrap()];
    let not_yet = |message: &str| CheckResult::NotYet { message: format!("Service {ns}/web {message}") };

    assert_eq!(run(&client, &ns, &check, &vm).await, not_yet("does not exist yet"));

    create_service(&client, &ns, json!([{"name": "http", "port": 80, "targetPort": 8080}])).await;
    assert_eq!(run(&client, &ns, &check, &vm).await, not_yet("has no endpoints yet"));

    let elsewhere = http(8443, "/", 200, None);
    assert_eq!(run(&client, &ns, &elsewhere, &vm).await, not_yet("has no TCP port 8443 (it has 80/http)"));

    create_slice(
        &client,
        &ns,
        "web-1",
        json!([{"addresses": ["10.251.255.254"], "conditions": {"ready": false}}]),
        json!([{"name": "http", "port": 8080}]),
    )
    .await;
    assert_eq!(run(&client, &ns, &check, &vm).await, not_yet("has no ready endpoint yet (1 not ready)"));
}

/// The guest's address answers but nothing listens yet: refused, then passing once the server starts.
#[tokio::test]
async fn connection_refused_is_not_yet() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-refused").await;
    let netns = Netns::new().expect("network namespace");
    let vm = [IpAddr::V4(netns.ip)];
    web_service_at(&client, &ns, &netns).await;
    let check = http(80, "/", 200, Some("Welcome"));

    let refused = run(&client, &ns, &check, &vm).await;
    let CheckResult::NotYet { message } = &refused else { panic!("expected NotYet, got {refused:?}") };
    let prefix = format!("GET http://{}:8080/: cannot connect: ", netns.ip);
    assert!(message.starts_with(&prefix) && message.contains("refused"), "{message}");

    netns.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
    assert!(matches!(run(&client, &ns, &check, &vm).await, CheckResult::Pass { .. }));
}

/// `HttpCheck.port` is a number, so the name is the Service port's: it selects
/// the slice port of the same name, whatever the targetPort says.
#[tokio::test]
async fn the_endpoint_port_is_the_slice_port_named_like_the_service_port() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-named").await;
    let netns = Netns::new().expect("network namespace");
    let vm = [IpAddr::V4(netns.ip)];
    netns.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
    netns.serve_http(9090, &[("index.html", "metrics\n")]).expect("httpd");
    create_service(
        &client,
        &ns,
        json!([
            {"name": "metrics", "port": 9090, "targetPort": "metrics"},
            {"name": "http", "port": 80, "targetPort": "web"},
        ]),
    )
    .await;
    create_slice(
        &client,
        &ns,
        "web-1",
        json!([{"addresses": [netns.ip.to_string()]}]),
        json!([{"name": "metrics", "port": 9090}, {"name": "http", "port": 8080}]),
    )
    .await;

    let web = run(&client, &ns, &http(80, "/", 200, Some("Welcome")), &vm).await;
    assert!(matches!(&web, CheckResult::Pass { message } if message.contains(":8080/")), "{web:?}");
    let metrics = run(&client, &ns, &http(9090, "/", 200, Some("metrics")), &vm).await;
    assert!(matches!(&metrics, CheckResult::Pass { message } if message.contains(":9090/")), "{metrics:?}");
}

/// A tenant who writes the destination namespace's Services and
/// EndpointSlices aims the check elsewhere (another namespace's server, the
/// API server): it is never contacted, and the check says why.
#[tokio::test]
async fn a_service_that_points_away_from_the_migrated_vm_is_not_checked_and_the_check_says_why() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "http-elsewhere").await;
    let guest = Netns::new().expect("the VM's namespace");
    let other = Netns::new().expect("someone else's server");
    other.serve_http(8080, &[("index.html", PAGE)]).expect("httpd");
    // The Service points at the other server, which would answer 200.
    web_service_at(&client, &ns, &other).await;
    let vm = [IpAddr::V4(guest.ip)];
    let result = run(&client, &ns, &http(80, "/", 200, Some("Welcome")), &vm).await;
    let CheckResult::NotYet { message } = &result else { panic!("expected NotYet, got {result:?}") };
    assert!(message.contains(&format!("points at {}", other.ip)), "{message}");
    assert!(message.contains(&format!("its VMI reports {}", guest.ip)), "{message}");
    assert!(!message.contains("GET "), "a request was made: {message}");
}
