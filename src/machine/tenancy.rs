//! Which destination namespaces a migration may write into: the
//! administrator's allow rules. Pure; rendering (plan, validate, apply) and
//! the controller's `Validated` checkpoint ask the same question.
//!
//! By default a migration may create its VM only in its own namespace: the
//! controller's rights are cluster-wide, and a manifest that names
//! `kube-system` must not borrow them (a confused deputy). An administrator
//! widens that per migration namespace with
//! `--allow-destination <migration-ns>=<dest-ns>[,<dest-ns>…]`; `*` stands
//! for every namespace except the cluster's own (`kube-*`, closed even to
//! migrations created there) and the controller's (open only to migrations
//! created in it).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// Namespaces no rule opens, besides every `kube-*` one.
const NEVER: &[&str] = &["vmmigrate-system"];

/// The administrator's destination allow rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DestinationRules {
    /// Migration namespace → namespaces its migrations may target besides its own.
    allowed: BTreeMap<String, BTreeSet<String>>,
    /// The controller's own namespace, closed to every rule.
    system_namespace: Option<String>,
}

/// A rule that cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleError(String);

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RuleError {}

fn is_label(s: &str) -> bool {
    super::preflight::is_dns_label(s)
}

impl DestinationRules {
    /// Reads `--allow-destination` values: `apps=web,db` or `vmmigrate=*`.
    pub fn parse<S: AsRef<str>>(rules: &[S]) -> Result<DestinationRules, RuleError> {
        let mut out = DestinationRules::default();
        for rule in rules {
            let rule = rule.as_ref();
            let (from, to) = rule.split_once('=').ok_or_else(|| {
                RuleError(format!(
                    "--allow-destination {rule:?}: expected <migration-namespace>=<namespace>[,<namespace>...]"
                ))
            })?;
            if !is_label(from) {
                return Err(RuleError(format!(
                    "--allow-destination {rule:?}: {from:?} is not a namespace name"
                )));
            }
            let set = out.allowed.entry(from.to_owned()).or_default();
            for dest in to.split(',') {
                if dest != "*" && !is_label(dest) {
                    return Err(RuleError(format!(
                        "--allow-destination {rule:?}: {dest:?} is not a namespace name or *"
                    )));
                }
                if dest != "*" && is_closed(dest) {
                    return Err(RuleError(format!(
                        "--allow-destination {rule:?}: {dest:?} is a system namespace; no rule opens it"
                    )));
                }
                set.insert(dest.to_owned());
            }
        }
        Ok(out)
    }

    /// Closes the controller's own namespace too (where its Secrets and Leases live).
    pub(crate) fn with_system_namespace(mut self, namespace: &str) -> DestinationRules {
        self.system_namespace = Some(namespace.to_owned());
        self
    }

    /// `None` when a migration in `migration_ns` may create its VM in
    /// `destination_ns`, else why not (a sentence for a condition or a plan).
    pub fn refusal(&self, migration_ns: &str, destination_ns: &str) -> Option<String> {
        if destination_ns.starts_with("kube-") {
            return Some(format!(
                "destination namespace {destination_ns:?} is a system namespace; migrations never write there"
            ));
        }
        if destination_ns == migration_ns {
            return None;
        }
        if self.is_system(destination_ns) {
            return Some(format!(
                "destination namespace {destination_ns:?} is vmmigrate's own; only migrations created there may write there"
            ));
        }
        let allowed = self.allowed.get(migration_ns);
        if allowed.is_some_and(|set| set.contains(destination_ns) || set.contains("*")) {
            return None;
        }
        let others = match allowed {
            Some(set) if !set.is_empty() => {
                format!(" or {}", set.iter().cloned().collect::<Vec<_>>().join(", "))
            }
            _ => String::new(),
        };
        Some(format!(
            "destination namespace {destination_ns:?} is not allowed for migrations in {migration_ns:?} (allowed: {migration_ns}{others}); an administrator allows it with --allow-destination {migration_ns}={destination_ns}"
        ))
    }

    /// `None` when a migration in `migration_ns` may attach its VM to the
    /// NetworkAttachmentDefinition `network_name` (`name`, or `namespace/name`
    /// of a namespace these rules let it write into), else why not.
    pub(crate) fn network_refusal(
        &self,
        migration_ns: &str,
        destination_ns: &str,
        network_name: &str,
    ) -> Option<String> {
        let (namespace, _) = network_name.split_once('/')?;
        if namespace == destination_ns {
            return None;
        }
        self.refusal(migration_ns, namespace)
            .map(|why| format!("network {network_name:?} is in another namespace, and {why}"))
    }

    fn is_system(&self, namespace: &str) -> bool {
        is_closed(namespace) || self.system_namespace.as_deref() == Some(namespace)
    }
}

fn is_closed(namespace: &str) -> bool {
    namespace.starts_with("kube-") || NEVER.contains(&namespace)
}

/// The administrator's binding of Git folders to namespaces, as Argo CD's
/// AppProjects bind source paths to destinations and Flux binds a tenant's
/// path to its namespace: `--tenant <folder>=<namespace>`, the folder under
/// `migrations/`. A manifest in a bound folder (or below it: the longest
/// bound folder wins) lives in that namespace and no other; with any
/// binding configured, a manifest in no bound folder is refused. Without
/// bindings every folder may name any namespace (one team's repository).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantBindings {
    /// Folder under `migrations/` (no slashes at either end) → namespace.
    folders: BTreeMap<String, String>,
}

/// The tenant a manifest belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tenant {
    /// Its bound folder, as the repository shows it (`migrations/apps`).
    pub folder: String,
    pub namespace: String,
}

impl TenantBindings {
    /// Reads `--tenant` values: `apps=apps`, `teams/finance=finance`.
    pub fn parse<S: AsRef<str>>(bindings: &[S]) -> Result<TenantBindings, RuleError> {
        let mut out = TenantBindings::default();
        for binding in bindings {
            let binding = binding.as_ref();
            let (folder, namespace) = binding.split_once('=').ok_or_else(|| {
                RuleError(format!("--tenant {binding:?}: expected <folder under migrations/>=<namespace>"))
            })?;
            let folder = folder.trim_matches('/');
            let folder = folder.strip_prefix("migrations/").unwrap_or(folder);
            let segment_ok = |s: &str| {
                !s.is_empty()
                    && s != "."
                    && s != ".."
                    && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            };
            if folder.len() > 253 || !folder.split('/').all(segment_ok) {
                return Err(RuleError(format!(
                    "--tenant {binding:?}: {folder:?} is not a folder under migrations/ (segments of letters, digits, '.', '_' or '-'; no '..')"
                )));
            }
            if !is_label(namespace) {
                return Err(RuleError(format!(
                    "--tenant {binding:?}: {namespace:?} is not a namespace name"
                )));
            }
            if is_closed(namespace) {
                return Err(RuleError(format!(
                    "--tenant {binding:?}: {namespace:?} is a system namespace; no tenant lives there"
                )));
            }
            match out.folders.insert(folder.to_owned(), namespace.to_owned()) {
                Some(other) if other != namespace => {
                    return Err(RuleError(format!(
                        "--tenant {binding:?}: migrations/{folder} is bound to {other:?} already"
                    )));
                }
                _ => {}
            }
        }
        Ok(out)
    }

    pub fn is_empty(&self) -> bool {
        self.folders.is_empty()
    }

    /// The tenant of the manifest at `path` (`migrations/apps/web.yaml`):
    /// the longest bound folder that holds it, whole segments only.
    pub(crate) fn tenant_of(&self, path: &str) -> Option<Tenant> {
        let rest = path.strip_prefix("migrations/")?;
        self.folders
            .iter()
            .filter(|(folder, _)| {
                rest.strip_prefix(folder.as_str()).is_some_and(|after| after.starts_with('/'))
            })
            .max_by_key(|(folder, _)| folder.len())
            .map(|(folder, namespace)| Tenant {
                folder: format!("migrations/{folder}"),
                namespace: namespace.clone(),
            })
    }

    /// Why the manifest at `path` may not live in `namespace`, if it may not.
    pub fn refusal(&self, path: &str, namespace: &str) -> Option<String> {
        if self.is_empty() {
            return None;
        }
        match self.tenant_of(path) {
            Some(t) if t.namespace == namespace => None,
            Some(t) => Some(format!(
                "is {namespace:?}, but {}/ belongs to the tenant of namespace {:?} (--tenant {}={}): a manifest cannot place a migration outside its folder's namespace",
                t.folder,
                t.namespace,
                t.folder.trim_start_matches("migrations/"),
                t.namespace
            )),
            None => {
                let folder = path.rsplit_once('/').map_or(path, |(dir, _)| dir);
                Some(format!(
                    "{folder}/ is bound to no tenant: with tenants configured, every manifest lives in a bound folder (an administrator binds it with --tenant {}=<namespace>)",
                    folder.strip_prefix("migrations/").unwrap_or(folder)
                ))
            }
        }
    }
}

/// The annotation (or Secret key) naming the ESXi hosts a credentials
/// Secret may be used for, as Argo CD scopes repository credentials to
/// their URLs: entries `host[:port][=SHA256:<key>]`, separated by commas or
/// new lines. Without a port any port matches; without a key any pinned key.
pub const CREDENTIAL_HOSTS_ANNOTATION: &str = "migration.platform.example/esxi-hosts";

/// Why the Secret `secret` (whose host list is `hosts`) may not be used to
/// log in to `host:port` with pinned key `host_key`, if it may not. Checked
/// before any connection: a manifest that points a Secret at a host of its
/// own choosing never receives the password.
pub(crate) fn credential_refusal(
    secret: &str,
    hosts: Option<&str>,
    host: &str,
    port: i32,
    host_key: &str,
) -> Option<String> {
    let Some(hosts) = hosts.map(str::trim).filter(|h| !h.is_empty()) else {
        return Some(format!(
            "Secret {secret} names no ESXi host it may be used for; its owner adds the annotation {CREDENTIAL_HOSTS_ANNOTATION}: {host}={host_key} (host[:port][=key], comma-separated)"
        ));
    };
    let allowed = hosts.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty()).any(|entry| {
        let (address, key) = match entry.split_once('=') {
            Some((address, key)) => (address.trim(), Some(key.trim())),
            None => (entry, None),
        };
        // `[v6]:port`, `[v6]`, `name:port`, `name`.
        let (name, entry_port) = match address.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some((name, tail)) => (name, tail.strip_prefix(':')),
                None => return false,
            },
            None => match address.rsplit_once(':') {
                Some((name, p)) if !name.contains(':') => (name, Some(p)),
                _ => (address, None),
            },
        };
        name.eq_ignore_ascii_case(host.trim_start_matches('[').trim_end_matches(']'))
            && entry_port.is_none_or(|p| p.parse::<i32>().ok() == Some(port))
            && key.is_none_or(|k| k == host_key)
    });
    (!allowed).then(|| {
        format!(
            "Secret {secret} may be used only for {hosts:?} ({CREDENTIAL_HOSTS_ANNOTATION}), not for {host}:{port} with key {host_key}: no connection was made"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_belongs_to_the_longest_bound_folder_that_holds_it_and_to_no_other_namespace() {
        let t =
            TenantBindings::parse(&["apps=apps", "migrations/apps/payments/=payments", "finance=finance"])
                .unwrap();
        assert_eq!(t.tenant_of("migrations/apps/web.yaml").unwrap().namespace, "apps");
        assert_eq!(t.tenant_of("migrations/apps/payments/pay.yaml").unwrap().namespace, "payments");
        assert_eq!(
            t.tenant_of("migrations/apps/payments/pay.yaml").unwrap().folder,
            "migrations/apps/payments"
        );
        assert_eq!(t.tenant_of("migrations/appsx/web.yaml"), None, "whole segments only");
        assert_eq!(t.tenant_of("migrations/web.yaml"), None);
        assert_eq!(t.refusal("migrations/apps/web.yaml", "apps"), None);
        let refused = t.refusal("migrations/apps/web.yaml", "finance").unwrap();
        assert!(refused.contains("migrations/apps/") && refused.contains("--tenant apps=apps"), "{refused}");
        let unbound = t.refusal("migrations/other/web.yaml", "other").unwrap();
        assert!(unbound.contains("migrations/other/ is bound to no tenant"), "{unbound}");
        assert_eq!(TenantBindings::default().refusal("migrations/x/y.yaml", "finance"), None);
    }

    #[test]
    fn another_namespaces_network_follows_the_destination_rules() {
        let rules = DestinationRules::parse(&["apps=web"]).unwrap();
        assert_eq!(
            rules.network_refusal("apps", "apps", "vlan10"),
            None,
            "a plain name is the destination's"
        );
        assert_eq!(rules.network_refusal("apps", "apps", "apps/vlan10"), None);
        assert_eq!(rules.network_refusal("apps", "apps", "web/vlan10"), None, "a namespace the rules open");
        let refused = rules.network_refusal("apps", "apps", "finance/vlan").unwrap();
        assert!(
            refused.contains("\"finance/vlan\"") && refused.contains("--allow-destination apps=finance"),
            "{refused}"
        );
        assert!(rules.network_refusal("apps", "apps", "kube-system/x").is_some());
    }

    #[test]
    fn a_secret_is_used_only_for_the_hosts_ports_and_keys_it_names() {
        const KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";
        let hosts = format!("esxi01.example.internal={KEY}, 10.0.0.5:2222\n[fd00::5]:22");
        let ok = |host: &str, port: i32, key: &str| credential_refusal("ns/s", Some(&hosts), host, port, key);
        assert_eq!(ok("ESXi01.example.internal", 22, KEY), None, "names compare without case, any port");
        assert_eq!(ok("10.0.0.5", 2222, "SHA256:other"), None, "no key named: any pinned key");
        assert_eq!(ok("fd00::5", 22, KEY), None);
        assert!(ok("esxi01.example.internal", 22, "SHA256:attacker").is_some(), "another key");
        assert!(ok("10.0.0.5", 22, KEY).is_some(), "another port");
        assert!(ok("attacker.example", 22, KEY).is_some(), "another host");
        let unbound = credential_refusal("ns/s", None, "esxi01", 22, KEY).unwrap();
        assert!(unbound.contains(CREDENTIAL_HOSTS_ANNOTATION), "{unbound}");
        assert!(credential_refusal("ns/s", Some("  "), "esxi01", 22, KEY).is_some());
    }

    #[test]
    fn tenant_bindings_refuse_system_namespaces_dot_dot_and_a_folder_bound_twice() {
        for bad in
            ["apps", "apps=kube-system", "apps=vmmigrate-system", "../x=apps", "a//b=apps", "apps=Apps"]
        {
            assert!(TenantBindings::parse(&[bad]).is_err(), "{bad} accepted");
        }
        assert!(TenantBindings::parse(&["apps=apps", "apps=finance"]).is_err());
        assert!(TenantBindings::parse(&["apps=apps", "apps/=apps"]).is_ok(), "the same binding twice");
    }

    #[test]
    fn by_default_only_the_migrations_own_namespace_is_allowed() {
        let rules = DestinationRules::default();
        assert_eq!(rules.refusal("apps", "apps"), None);
        let refused = rules.refusal("apps", "finance").unwrap();
        assert!(refused.contains("--allow-destination apps=finance"), "{refused}");
        assert!(rules.refusal("kube-system", "kube-system").is_some(), "kube-* is closed even to itself");
        assert_eq!(
            rules.refusal("vmmigrate-system", "vmmigrate-system"),
            None,
            "the controller's own, to itself"
        );
        assert!(rules.refusal("apps", "vmmigrate-system").is_some());
    }

    #[test]
    fn rules_open_listed_namespaces_and_the_wildcard_never_opens_system_ones() {
        let rules = DestinationRules::parse(&["vmmigrate=apps,finance", "lab=*"])
            .unwrap()
            .with_system_namespace("migrations-system");
        assert_eq!(rules.refusal("vmmigrate", "apps"), None);
        assert_eq!(rules.refusal("vmmigrate", "finance"), None);
        assert!(rules.refusal("vmmigrate", "lab").is_some());
        assert_eq!(rules.refusal("lab", "anything"), None);
        for closed in ["kube-system", "kube-public"] {
            let why = rules.refusal("lab", closed).unwrap();
            assert!(why.contains("system namespace"), "{why}");
        }
        for own in ["vmmigrate-system", "migrations-system"] {
            let why = rules.refusal("lab", own).unwrap();
            assert!(why.contains("vmmigrate's own"), "{why}");
        }
    }

    #[test]
    fn malformed_rules_are_refused_with_the_rule() {
        for bad in ["apps", "Apps=web", "apps=web,", "apps=kube-system", "apps=vmmigrate-system"] {
            let err = DestinationRules::parse(&[bad]).unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }
}
