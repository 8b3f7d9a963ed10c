//! vmmigrate: a GitOps reconciler that moves virtual machines from standalone
//! VMware ESXi hosts into KubeVirt. See docs/architecture.md for the module map.

pub mod api;
pub mod cli;
pub mod controller;
pub mod convert;
#[cfg(feature = "demo")]
pub mod demo;
pub mod destination;
pub mod gitops;
pub mod machine;
pub mod metrics;
pub mod ports;
mod server;
pub mod source;

/// Entry points for the fuzz targets in `tools/fuzz/` (not an API).
#[doc(hidden)]
pub mod fuzzing {
    use crate::gitops::webhook::{Forge, WebhookConfig, judge_delivery};

    /// The secret the fuzzed deliveries are judged under.
    pub const SECRET: &str = "fuzz-secret";

    /// One webhook delivery: `forge` picks GitHub, Gitea or GitLab, `headers`
    /// are `name: value` lines, `body` the payload. Must never panic.
    pub fn webhook_delivery(forge: u8, headers: &str, body: &[u8]) -> bool {
        let forge = match forge % 3 {
            0 => Forge::GitHub,
            1 => Forge::Gitea,
            _ => Forge::GitLab,
        };
        let config = WebhookConfig {
            github_secret: Some(SECRET.into()),
            gitea_secret: Some(SECRET.into()),
            gitlab_token: Some(SECRET.into()),
        };
        let mut map = http::HeaderMap::new();
        for line in headers.lines().take(64) {
            let Some((name, value)) = line.split_once(':') else { continue };
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.trim().as_bytes()),
                http::HeaderValue::from_str(value.trim()),
            ) {
                map.append(name, value);
            }
        }
        judge_delivery(forge, &config, &map, body)
    }
}
