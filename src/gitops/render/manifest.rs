//! One migration manifest, from its document to the object applied: what
//! the document is, its folders' defaults beneath it, its provider beneath
//! both, its namespace (a tenant's folder decides it), the checks the schema
//! cannot make, and the typed resource the controller will read.

use super::documents::Doc;
use super::validate::{
    Blame, Finding, Mode, SchemaWalk, check_metadata, finding, is_dns_subdomain, is_secret_like, shown,
    spec_schema, unknown_field_message,
};
use super::{
    Accepted, Layer, MIGRATION_KIND, PROVIDER_FIELDS, PROVIDER_KIND, Provider, RenderOptions,
    RenderedMigration, Renderer, Seg, attribute, key, overlay, prune_nulls, segs,
};
use crate::api::{GROUP, VERSION, VirtualMachineMigration};
use crate::gitops::{ANNOTATION_COMMIT, ANNOTATION_PATH, ANNOTATION_REPO, LABEL_GITOPS, Provenance};
use crate::machine::preflight::{MAX_DESTINATION_NAME, is_dns_label};
use crate::machine::tenancy::Tenant;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

impl Renderer {
    /// Renders document `m` of `docs` (a migration), with the defaults of
    /// `chain` (nearest folder first) beneath it; every error goes to
    /// `self.errors` and the manifest is then not accepted.
    pub(super) fn manifest(
        &mut self,
        docs: &[Doc],
        m: usize,
        chain: &[usize],
        providers: &Providers<'_>,
        provenance: &Provenance,
        opts: &RenderOptions,
    ) -> Option<Accepted> {
        let doc = &docs[m];
        let raw = doc.value.as_object()?;
        let errors = kind_errors(doc, raw);
        if !errors.is_empty() {
            self.errors.extend(errors);
            return None;
        }
        let mut merged = with_defaults(docs, chain, raw);
        let mut layers: Vec<Layer> = vec![Layer { doc, provider: false }];
        layers.extend(chain.iter().map(|&d| Layer { doc: &docs[d], provider: false }));

        let mut findings = Vec::new();
        check_metadata(merged.get("metadata").unwrap_or(&Value::Object(Map::new())), false, &mut findings);
        if merged.pointer("/metadata/name").is_none() {
            findings.push(Finding {
                path: segs(&["metadata", "name"]),
                message: "is required".to_owned(),
                blame: Blame::Manifest,
            });
        }

        // The provider, beneath everything written in the migration and its defaults.
        let provider = resolve_provider(&mut merged, providers, &mut findings);
        if let Some(Some(doc)) = provider {
            layers.push(Layer { doc: &docs[doc], provider: true });
        }
        match merged.get("spec") {
            None => findings.push(Finding {
                path: segs(&["spec"]),
                message: "is required".to_owned(),
                blame: Blame::Manifest,
            }),
            Some(spec) if provider != Some(None) => {
                let mut walk = SchemaWalk { mode: Mode::Full, allow_provider: false, findings: Vec::new() };
                walk.walk(spec, spec_schema(), &mut vec![key("spec")]);
                findings.extend(walk.findings);
            }
            Some(_) => {}
        }

        let name = merged.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
        check_vm_names(&merged, &name, &mut findings);
        let (namespace, tenant) = namespace_of(&merged, &doc.path, opts, &mut findings);
        check_window(&merged, &mut findings);
        check_destination_rules(&merged, &namespace, opts, &mut findings);
        if !findings.is_empty() {
            self.errors.extend(findings.iter().map(|f| attribute(f, &layers)));
            return None;
        }

        let object = applied_object(&merged, &name, &namespace, &doc.path, provenance);
        // The last word: the typed resource the controller will read.
        let typed = match serde_json::from_value::<VirtualMachineMigration>(object.clone()) {
            Ok(typed) => typed,
            Err(err) => {
                self.errors.push(doc.error(
                    &segs(&["spec"]),
                    format!("does not match the VirtualMachineMigration type: {err}"),
                ));
                return None;
            }
        };
        let rendered = RenderedMigration {
            path: doc.path.clone(),
            doc_index: doc.doc_index,
            name,
            namespace,
            tenant: tenant.map(|t| t.folder),
            object,
        };
        Some(accepted(m, &typed, rendered))
    }
}

/// What the document says it is: a migration of this API version, with no
/// field but `apiVersion`, `kind`, `metadata` and `spec` (and no `status`).
fn kind_errors(doc: &Doc, raw: &Map<String, Value>) -> Vec<super::RenderError> {
    let mut errors = Vec::new();
    let api_version = format!("{GROUP}/{VERSION}");
    match raw.get("apiVersion") {
        Some(v) if v.as_str() == Some(&api_version) => {}
        Some(v) => errors
            .push(doc.error(&segs(&["apiVersion"]), format!("must be {api_version} (got {})", shown(v)))),
        None => errors.push(doc.error(&segs(&["apiVersion"]), format!("is required ({api_version})"))),
    }
    match raw.get("kind").and_then(Value::as_str) {
        Some(MIGRATION_KIND) => {}
        Some(PROVIDER_KIND) => errors.push(doc.error(
            &segs(&["kind"]),
            format!("a {PROVIDER_KIND} belongs in providers/; migrations/ holds only {MIGRATION_KIND}s"),
        )),
        Some(other) => errors.push(doc.error(
            &segs(&["kind"]),
            format!("must be {MIGRATION_KIND} (got {other:?}); migrations/ holds only migrations"),
        )),
        None => errors.push(doc.error(&segs(&["kind"]), format!("is required ({MIGRATION_KIND})"))),
    }
    for k in raw.keys() {
        match k.as_str() {
            "apiVersion" | "kind" | "metadata" | "spec" => {}
            "status" => errors.push(doc.error(
                &segs(&["status"]),
                "is written by the controller, never in Git; remove it from the manifest",
            )),
            other if is_secret_like(other) => {}
            other => errors.push(doc.error(
                &[key(other)],
                unknown_field_message(other, &["apiVersion", "kind", "metadata", "spec"]),
            )),
        }
    }
    errors
}

/// The manifest over its folders' defaults (nearest folder over its
/// parents; only their `metadata` and `spec`), nulls pruned.
fn with_defaults(docs: &[Doc], chain: &[usize], raw: &Map<String, Value>) -> Value {
    let mut merged = Map::new();
    for &d in chain.iter().rev() {
        if let Some(defaults) = docs[d].value.as_object() {
            let mut defaults = defaults.clone();
            defaults.retain(|k, _| k == "metadata" || k == "spec");
            overlay(&mut merged, &defaults);
        }
    }
    overlay(&mut merged, raw);
    let mut merged = Value::Object(merged);
    prune_nulls(&mut merged);
    merged
}

/// The migration's namespace and the tenant whose folder holds `path`. A
/// tenant's manifest lives in its folder's namespace: the default there,
/// and the only namespace it may name.
fn namespace_of(
    merged: &Value,
    path: &str,
    opts: &RenderOptions,
    findings: &mut Vec<Finding>,
) -> (String, Option<Tenant>) {
    let tenant = opts.tenants.tenant_of(path);
    let default_namespace = tenant.as_ref().map_or(opts.default_namespace.as_str(), |t| t.namespace.as_str());
    let written = merged.pointer("/metadata/namespace").and_then(Value::as_str);
    let namespace = written.unwrap_or(default_namespace).to_owned();
    if let Some(refused) = opts.tenants.refusal(path, &namespace) {
        findings.push(Finding {
            path: segs(&["metadata", "namespace"]),
            message: refused,
            blame: if merged.pointer("/metadata/namespace").is_some() {
                Blame::Origin
            } else {
                Blame::Manifest
            },
        });
    }
    if merged.pointer("/metadata/namespace").is_none() && !is_dns_label(&namespace) {
        findings.push(Finding {
            path: segs(&["metadata", "namespace"]),
            message: format!("is not set, and the default namespace {namespace:?} is not a valid namespace"),
            blame: Blame::Manifest,
        });
    }
    (namespace, tenant)
}

/// The accepted manifest with the keys its duplicates are found by: its
/// source VM and its destination VM. One migration and one rehearsal of a
/// VM may both be in Git (the cluster's claim on the VM runs them one at a
/// time); a rehearsal's VM has a name of its own.
fn accepted(doc: usize, typed: &VirtualMachineMigration, rendered: RenderedMigration) -> Accepted {
    let source = &typed.spec.source;
    let vm = match (&source.vm.name, &source.vm.id) {
        (Some(n), _) => format!("name {n:?}"),
        (None, Some(id)) => format!("vmid {id}"),
        (None, None) => String::new(),
    };
    let rehearsal = if typed.spec.mode == crate::api::MigrationMode::Rehearsal { " (rehearsal)" } else { "" };
    Accepted {
        doc,
        source_key: format!("{} on {}:{}{rehearsal}", vm, source.host.to_ascii_lowercase(), source.port),
        destination_key: format!(
            "{}/{}",
            typed.spec.destination.namespace,
            crate::machine::destination_name(&typed.spec, &rendered.name)
        ),
        rendered,
    }
}

/// The migration as it is applied: its name and namespace, its labels and
/// annotations with the GitOps marks and where it came from, its spec.
fn applied_object(merged: &Value, name: &str, namespace: &str, path: &str, provenance: &Provenance) -> Value {
    let mut meta = Map::new();
    meta.insert("name".into(), Value::String(name.to_owned()));
    meta.insert("namespace".into(), Value::String(namespace.to_owned()));
    let mut labels =
        merged.pointer("/metadata/labels").and_then(Value::as_object).cloned().unwrap_or_default();
    labels.insert(LABEL_GITOPS.into(), Value::String("true".into()));
    meta.insert("labels".into(), Value::Object(labels));
    let mut annotations =
        merged.pointer("/metadata/annotations").and_then(Value::as_object).cloned().unwrap_or_default();
    annotations.insert(ANNOTATION_REPO.into(), Value::String(provenance.repo_url.clone()));
    annotations.insert(ANNOTATION_COMMIT.into(), Value::String(provenance.commit.clone()));
    annotations.insert(ANNOTATION_PATH.into(), Value::String(path.to_owned()));
    meta.insert("annotations".into(), Value::Object(annotations));
    let mut object = Map::new();
    object.insert("apiVersion".into(), Value::String(format!("{GROUP}/{VERSION}")));
    object.insert("kind".into(), Value::String(MIGRATION_KIND.into()));
    object.insert("metadata".into(), Value::Object(meta));
    object.insert("spec".into(), merged.get("spec").cloned().unwrap_or_default());
    Value::Object(object)
}

/// The provider a migration names (`spec.source.provider`), resolved into
/// `spec.source` beneath what the migration and its defaults set. `None`:
/// it names none; `Some(Some(doc))`: resolved from document `doc`;
/// `Some(None)`: it names one that does not resolve (reported).
fn resolve_provider(
    merged: &mut Value,
    providers: &Providers<'_>,
    findings: &mut Vec<Finding>,
) -> Option<Option<usize>> {
    let name_value = merged.pointer("/spec/source/provider").cloned()?;
    let Some(provider) = name_value.as_str().and_then(|n| providers.by_name.get(n)) else {
        let known: Vec<&str> = providers.by_name.keys().map(String::as_str).collect();
        let mut message = match name_value.as_str() {
            Some(n) if known.is_empty() => format!("unknown provider {n:?}: providers/ defines none"),
            Some(n) => format!("unknown provider {n:?} (known: {})", known.join(", ")),
            None => format!("must be the name of a provider in providers/ (got {})", shown(&name_value)),
        };
        if !providers.unreadable.is_empty() {
            message.push_str(&format!("; {} could not be read", providers.unreadable.join(", ")));
        }
        findings.push(finding(segs(&["spec", "source", "provider"]), message));
        return Some(None);
    };
    // A provider binds host, port, host key and credentials together: a
    // migration that names one cannot point its credentials elsewhere.
    let name = name_value.as_str().unwrap_or_default();
    if let Some(Value::Object(source)) = merged.get("spec").and_then(|s| s.get("source")) {
        for field in PROVIDER_FIELDS.iter().filter(|f| source.contains_key(**f)) {
            findings.push(finding(
                segs(&["spec", "source", field]),
                format!(
                    "is set by provider {name:?} (providers/), which binds host, port, hostKey and credentialsSecretRef together; remove it here, or define another provider"
                ),
            ));
        }
    }
    if let Some(Value::Object(source)) = merged.pointer_mut("/spec/source") {
        source.remove("provider");
        let mut resolved = provider.spec.clone();
        resolved.extend(std::mem::take(source));
        *source = resolved;
    }
    Some(Some(provider.doc))
}

/// The names the migrated VM would get: the destination VM is named after
/// the migration unless `spec.destination.name` is set, and a rehearsal's
/// VM after `spec.rehearsal.name`, else the destination name with
/// `-rehearsal`; each must be a label KubeVirt accepts.
fn check_vm_names(merged: &Value, name: &str, findings: &mut Vec<Finding>) {
    let destination_name = merged.pointer("/spec/destination/name").and_then(Value::as_str);
    let rehearsal = merged.pointer("/spec/mode").and_then(Value::as_str) == Some("Rehearsal");
    let rehearsal_named = merged.pointer("/spec/rehearsal/name").is_some();
    if rehearsal && !rehearsal_named && !name.is_empty() && is_dns_subdomain(name) {
        let vm = format!("{}-rehearsal", destination_name.unwrap_or(name));
        if !is_dns_label(&vm) || vm.len() > MAX_DESTINATION_NAME {
            findings.push(finding(
                segs(&["spec", "mode"]),
                format!(
                    "a rehearsal's VM would be named {vm:?}, which must be a lowercase RFC 1123 label (no dots) of at most {MAX_DESTINATION_NAME} characters; set spec.rehearsal.name"
                ),
            ));
        }
    }
    if destination_name.is_none()
        && !rehearsal
        && !name.is_empty()
        && is_dns_subdomain(name)
        && (!is_dns_label(name) || name.len() > MAX_DESTINATION_NAME)
    {
        findings.push(finding(
            segs(&["metadata", "name"]),
            format!(
                "is also the destination VM's name (spec.destination.name is not set), which must be a lowercase RFC 1123 label (no dots) of at most {MAX_DESTINATION_NAME} characters; set spec.destination.name"
            ),
        ));
    }
}

/// A cutover window must name real instants; the schema only checks its shape.
fn check_window(merged: &Value, findings: &mut Vec<Finding>) {
    if let Some(window) = merged.pointer("/spec/cutover/window")
        && let Ok(window) = serde_json::from_value::<crate::api::CutoverWindow>(window.clone())
        && let Err(problem) = crate::machine::fleet::window_bounds(&window)
    {
        // The problem starts with the field it is about.
        let field =
            ["timeZone", "start", "end"].into_iter().find(|f| problem.starts_with(f)).unwrap_or("end");
        findings.push(finding(segs(&["spec", "cutover", "window", field]), problem));
    }
}

/// The administrator's rules for a migration in `namespace`: its
/// destination namespace, and another namespace's networks by the same rules.
fn check_destination_rules(
    merged: &Value,
    namespace: &str,
    opts: &RenderOptions,
    findings: &mut Vec<Finding>,
) {
    let Some(destination) = merged.pointer("/spec/destination/namespace").and_then(Value::as_str) else {
        return;
    };
    if let Some(refused) = opts.destinations.refusal(namespace, destination) {
        findings.push(finding(segs(&["spec", "destination", "namespace"]), refused));
    }
    let networks = merged.pointer("/spec/networkMap").and_then(Value::as_array).cloned().unwrap_or_default();
    for (i, mapping) in networks.iter().enumerate() {
        if let Some(network) = mapping.get("networkName").and_then(Value::as_str)
            && let Some(refused) = opts.destinations.network_refusal(namespace, destination, network)
        {
            let path = [segs(&["spec", "networkMap"]), vec![Seg::Index(i)], segs(&["networkName"])].concat();
            findings.push(finding(path, refused));
        }
    }
}

/// The providers of a commit by name, and the provider files that did not parse.
pub(super) struct Providers<'a> {
    pub(super) by_name: &'a BTreeMap<String, Provider>,
    pub(super) unreadable: &'a [String],
}
