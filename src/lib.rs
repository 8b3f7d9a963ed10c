//! vmmigrate: a GitOps reconciler that moves virtual machines from standalone
//! VMware ESXi hosts into KubeVirt. See docs/architecture.md for the module map.

pub mod api;
pub mod cli;
mod commands;
pub mod controller;
pub mod convert;
#[cfg(feature = "demo")]
pub mod demo;
pub mod destination;
pub mod gitops;
pub mod images;
pub mod machine;
pub mod metrics;
pub mod objects;
pub mod ports;
mod process;
mod server;
pub mod source;
pub mod worker;

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

    /// Every parser of `vim-cmd` output on `text`. Must never panic.
    pub fn esxi_vim_cmd(text: &str) {
        use crate::source::esxi::parse;
        let _ = parse::parse_getallvms(text);
        let _ = parse::parse_power_state(text);
        let _ = parse::parse_fault(text);
        let _ = parse::parse_snapshots(text);
        let _ = parse::parse_message(text);
        let _ = parse::parse_guest_info(text).map(|g| g.tools_running());
        let _ = parse::parse_version(text);
    }

    /// The `.vmx` parser and what discovery reads from it. Must never panic.
    pub fn esxi_vmx(text: &str) {
        use crate::source::esxi::parse;
        let vmx = parse::parse_vmx(text);
        let _ = vmx.get("displayName");
        let _ = vmx.get_bool("uefi.secureBoot.enabled");
        let _ = parse::vmx_facts(&vmx);
    }

    /// The VMDK descriptor parser. Must never panic.
    pub fn esxi_descriptor(text: &str) {
        if let Some(descriptor) = crate::source::esxi::parse::parse_descriptor(text) {
            let _ = descriptor.capacity_bytes();
        }
    }
}
