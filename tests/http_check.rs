mod support;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use support::{KubeEnv, test_namespace};

#[tokio::test]
async fn probe_loopback() {
    let client = KubeEnv::shared().client().await;
    let ns = test_namespace(&client, "probe").await;
    for (i, addr) in ["127.0.0.1", "10.251.0.2", "169.254.1.1"].iter().enumerate() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("s{i}"), "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [addr], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        })).unwrap();
        let r = Api::<EndpointSlice>::namespaced(client.clone(), &ns).create(&PostParams::default(), &slice).await;
        println!("slice {addr}: {:?}", r.map(|_| "ok"));
        let ep: k8s_openapi::api::core::v1::Endpoints = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": format!("e{i}")},
            "subsets": [{"addresses": [{"ip": addr}], "ports": [{"name": "http", "port": 8080}]}]
        })).unwrap();
        let r = Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(client.clone(), &ns).create(&PostParams::default(), &ep).await;
        println!("endpoints {addr}: {:?}", r.map(|_| "ok"));
    }
}
