//! Kubernetes API errors as classified failures, shared by every adapter
//! that talks to the API server (DataVolumes and VMs, conversion Jobs).

use crate::api::Reason;
use crate::machine::Failure;

/// Classifies a Kubernetes API error.
pub(crate) fn classify(what: &str, err: kube::Error) -> Failure {
    match &err {
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
