//! Kubernetes API errors as classified failures, shared by every adapter
//! that talks to the API server (DataVolumes and VMs, conversion Jobs).

use crate::api::Reason;
use crate::machine::Failure;

/// Classifies a Kubernetes API error.
pub(crate) fn classify(what: &str, err: kube::Error) -> Failure {
    match &err {
        // Not the request's fault: a webhook that could not reach what it
        // checks against (the API server behind its Service, a restarting
        // backend) and says so in its denial. The path's failure, waited out.
        kube::Error::Api(status) if webhook_could_not_reach(&status.message) => {
            Failure::retryable(Reason::APIError, format!("{what}: {}", status.message))
        }
        kube::Error::Api(status) => match status.code {
            409 => Failure::retryable(Reason::Conflict, format!("{what}: {}", status.message)),
            403 => Failure::needs_human(
                Reason::Forbidden,
                format!("{what}: {} (check the controller's RBAC)", status.message),
            ),
            422 | 400 => Failure::needs_human(Reason::Invalid, format!("{what}: {}", status.message)),
            404 => Failure::needs_human(Reason::NotFound, format!("{what}: {}", status.message)),
            _ => Failure::retryable(Reason::APIError, format!("{what}: {}", status.message)),
        },
        _ => Failure::retryable(Reason::APIUnavailable, format!("{what}: {err}")),
    }
}

/// Whether an API error is an admission webhook's denial that quotes a
/// failure of its own calls (its Service without endpoints, a connection
/// refused or timed out), as CDI's webhooks do while the node restarts.
fn webhook_could_not_reach(message: &str) -> bool {
    const PATH_FAILURES: [&str; 7] = [
        "dial tcp",
        "connection refused",
        "i/o timeout",
        "context deadline exceeded",
        "no endpoints available",
        "TLS handshake timeout",
        "connection reset by peer",
    ];
    (message.contains("admission webhook") || message.contains("failed calling webhook"))
        && PATH_FAILURES.iter().any(|said| message.contains(said))
}

/// Whether the API answered 404.
pub(crate) fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 404)
}

/// Deletes `name` only while it is the object with `uid` (a precondition the
/// API server checks): never another made under the same name since it was
/// read. "Not found" and "another object now" (409) are success: ours is gone.
pub(crate) async fn delete_by_uid<K>(
    api: &kube::Api<K>,
    name: &str,
    uid: Option<String>,
    what: &str,
) -> Result<(), Failure>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let Some(uid) = uid.filter(|u| !u.is_empty()) else {
        return Err(Failure::retryable(
            Reason::APIError,
            format!("{what} {name}: the object read has no uid"),
        ));
    };
    let params = kube::api::DeleteParams {
        propagation_policy: Some(kube::api::PropagationPolicy::Background),
        preconditions: Some(kube::api::Preconditions { uid: Some(uid), resource_version: None }),
        ..Default::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(classify(&format!("deleting {what} {name}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(kube::core::Status::failure(message, "BadRequest").with_code(code).boxed())
    }

    #[test]
    fn a_webhook_denial_that_quotes_its_own_connection_failure_is_waited_out() {
        let denied = api_error(
            400,
            "admission webhook \"datavolume-validate.cdi.kubevirt.io\" denied the request: Get \"https://10.96.0.1:443/api/v1/namespaces/ns/persistentvolumeclaims/d\": dial tcp 10.96.0.1:443: connect: connection refused",
        );
        let failure = classify("creating DataVolume d", denied);
        assert_eq!(failure.reason, Reason::APIError);
        assert!(failure.reason.is_transport());
        // A webhook's denial of the request itself still waits for a person.
        let invalid = api_error(400, "admission webhook \"x\" denied the request: spec.source is invalid");
        assert_eq!(classify("creating DataVolume d", invalid).reason, Reason::Invalid);
    }
}
