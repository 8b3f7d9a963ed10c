//! The pod of a helper Job (conversion, volume check, worker) as vmmigrate
//! writes it, hardened the same way everywhere: Pod Security `restricted`
//! (deploy/base/namespace.yaml) and deploy/base/admission-policies.yaml
//! admit it; and what its finished container said.

use kube::Client;
use kube::api::Api;
use serde_json::{Value, json};

/// The pod security context of a helper Job: the runtime's seccomp profile
/// always, and the controller's ids when known. With a non-root controller
/// the pod passes Pod Security `restricted` (deploy/base/namespace.yaml)
/// and deploy/base/admission-policies.yaml.
pub(crate) fn pod_security_context(run_as: Option<(u32, u32)>) -> Value {
    let mut context = json!({ "seccompProfile": { "type": "RuntimeDefault" } });
    if let Some((uid, gid)) = run_as {
        context["runAsUser"] = json!(uid);
        context["runAsGroup"] = json!(gid);
        context["runAsNonRoot"] = json!(uid != 0);
    }
    context
}

/// The container security context of a helper Job: no privilege
/// escalation, no capabilities; a read-only root file system where the
/// program writes only to its volumes.
pub(crate) fn container_security_context(read_only_root: bool) -> Value {
    let mut context = json!({ "allowPrivilegeEscalation": false, "capabilities": { "drop": ["ALL"] } });
    if read_only_root {
        context["readOnlyRootFilesystem"] = json!(true);
    }
    context
}

/// The last line of the termination message of a finished pod of Job `job`.
pub(crate) async fn job_termination_line(client: &Client, namespace: &str, job: &str) -> Option<String> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = kube::api::ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}"));
    let list = pods.list(&params).await.ok()?;
    list.items.iter().find_map(|pod| {
        let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
        statuses.iter().find_map(|s| {
            let message = s.state.as_ref()?.terminated.as_ref()?.message.as_ref()?;
            message
                .lines()
                .rev()
                .map(str::trim)
                .find(|l| !l.is_empty())
                // The kubelet keeps at most 4096 bytes; a classified failure
                // (JSON around a message of up to 1 KiB) fits whole.
                .map(|l| l.chars().take(4096).collect())
        })
    })
}
