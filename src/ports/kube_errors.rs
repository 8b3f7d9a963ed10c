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
