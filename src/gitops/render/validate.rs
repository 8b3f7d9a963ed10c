//! Validation against the CRD's openAPI schema, metadata and names, and the
//! refusal of secret-like fields.

use super::*;

// Secrets never go into Git

/// Normalized field names (lowercase, without `-`, `_`, `.`) that name a credential.
const SECRET_SUFFIXES: &[&str] =
    &["password", "passwd", "passphrase", "privatekey", "secretkey", "apikey", "token"];
const SECRET_NAMES: &[&str] = &["secret", "pass", "pwd"];

pub(super) fn is_secret_like(key: &str) -> bool {
    let last = key.rsplit('/').next().unwrap_or(key);
    let norm: String =
        last.chars().filter(|c| !matches!(c, '-' | '_' | '.')).map(|c| c.to_ascii_lowercase()).collect();
    SECRET_NAMES.contains(&norm.as_str()) || SECRET_SUFFIXES.iter().any(|s| norm.ends_with(s))
}

const SECRET_HINT: &str = "credentials never go into Git: put them in the Secret that spec.source.credentialsSecretRef names (keys `username` and `password` or `privateKey`)";

pub(super) fn scan_secrets(doc: &Doc, value: &Value, path: &mut Vec<Seg>, errors: &mut Vec<RenderError>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                path.push(Seg::Key(k.clone()));
                if is_secret_like(k) {
                    errors.push(doc.error(path, format!("looks like a secret; {SECRET_HINT}")));
                } else {
                    scan_secrets(doc, v, path, errors);
                }
                path.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                path.push(Seg::Index(i));
                scan_secrets(doc, v, path, errors);
                path.pop();
            }
        }
        Value::String(s) if s.contains("PRIVATE KEY-----") => {
            errors.push(doc.error(path, format!("holds a private key; {SECRET_HINT}")));
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------
// Schema walk

/// The CRD's schema of `spec`, taken once from `crate::api::crd()`.
pub(super) fn spec_schema() -> &'static JSONSchemaProps {
    static SCHEMA: OnceLock<JSONSchemaProps> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        crate::api::crd()
            .spec
            .versions
            .into_iter()
            .find(|v| v.name == VERSION)
            .and_then(|v| v.schema)
            .and_then(|s| s.open_api_v3_schema)
            .and_then(|mut s| s.properties.as_mut().and_then(|p| p.remove("spec")))
            .unwrap_or_default()
    })
}

/// Fields a provider may set: the connection half of `spec.source`. A
/// migration naming the provider may not set them itself.
pub(super) const PROVIDER_FIELDS: &[&str] = &["credentialsSecretRef", "host", "hostKey", "port"];
/// Settings of a provider's host that flow into its migrations as defaults:
/// a migration may still set its own (a cap can only lower the host's).
pub(super) const PROVIDER_SETTINGS: &[&str] = &["maxConcurrentReads"];

/// Whether a provider's `spec` may hold `field`.
pub(super) fn provider_may_set(field: &str) -> bool {
    PROVIDER_FIELDS.contains(&field) || PROVIDER_SETTINGS.contains(&field)
}

/// Schema of a provider's `spec`: `spec.source` without `vm`, same rules.
pub(super) fn provider_schema() -> &'static JSONSchemaProps {
    static SCHEMA: OnceLock<JSONSchemaProps> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let mut source =
            spec_schema().properties.as_ref().and_then(|p| p.get("source")).cloned().unwrap_or_default();
        if let Some(props) = source.properties.as_mut() {
            props.retain(|k, _| provider_may_set(k));
        }
        if let Some(required) = source.required.as_mut() {
            required.retain(|k| PROVIDER_FIELDS.contains(&k.as_str()));
        }
        source.x_kubernetes_validations = None;
        source
    })
}

/// Who a finding is reported against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Blame {
    /// The file the value at the path came from (manifest, a defaults.yaml or a provider).
    Origin,
    /// The manifest: something is missing from it.
    Manifest,
}

#[derive(Clone, Debug)]
pub(super) struct Finding {
    pub(super) path: Vec<Seg>,
    pub(super) message: String,
    pub(super) blame: Blame,
}

pub(super) fn finding(path: Vec<Seg>, message: impl Into<String>) -> Finding {
    Finding { path, message: message.into(), blame: Blame::Origin }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// A complete object: required fields and CEL rules are checked too.
    Full,
    /// A partial one (a defaults.yaml): only what is written is checked; a null unsets.
    Partial,
}

pub(super) struct SchemaWalk {
    pub(super) mode: Mode,
    /// `spec.source.provider` is accepted (before provider resolution).
    pub(super) allow_provider: bool,
    pub(super) findings: Vec<Finding>,
}

impl SchemaWalk {
    pub(super) fn walk(&mut self, value: &Value, schema: &JSONSchemaProps, path: &mut Vec<Seg>) {
        if value.is_null() && self.mode == Mode::Partial {
            return;
        }
        if let Some(allowed) = &schema.enum_
            && !allowed.iter().any(|a| a.0 == *value)
        {
            let names: Vec<String> = allowed
                .iter()
                .map(|a| a.0.as_str().map(str::to_owned).unwrap_or_else(|| a.0.to_string()))
                .collect();
            self.fail(path, format!("must be one of {} (got {})", names.join(", "), shown(value)));
            return;
        }
        match schema.type_.as_deref() {
            Some("object") => self.walk_object(value, schema, path),
            Some("array") => self.walk_array(value, schema, path),
            Some("string") => match value.as_str() {
                Some(s) => self.check_string(s, schema, path),
                None => self.fail(path, format!("must be a string (got {})", shown(value))),
            },
            Some("integer") => match value.as_i64() {
                Some(n) => self.check_number(n as f64, schema, path),
                None => self.fail(path, format!("must be an integer (got {})", shown(value))),
            },
            Some("number") => match value.as_f64() {
                Some(n) => self.check_number(n, schema, path),
                None => self.fail(path, format!("must be a number (got {})", shown(value))),
            },
            Some("boolean") if !value.is_boolean() => {
                self.fail(path, format!("must be true or false (got {})", shown(value)));
            }
            _ => {}
        }
    }

    fn walk_object(&mut self, value: &Value, schema: &JSONSchemaProps, path: &mut Vec<Seg>) {
        let Some(map) = value.as_object() else {
            self.fail(path, format!("must be a mapping (got {})", shown(value)));
            return;
        };
        let preserve = schema.x_kubernetes_preserve_unknown_fields == Some(true);
        for (k, v) in map {
            path.push(Seg::Key(k.clone()));
            match (&schema.properties, &schema.additional_properties) {
                (Some(props), _) if props.contains_key(k) => self.walk(v, &props[k], path),
                (_, Some(JSONSchemaPropsOrBool::Schema(extra))) => self.walk(v, extra, path),
                _ if preserve
                    || matches!(schema.additional_properties, Some(JSONSchemaPropsOrBool::Bool(true))) => {}
                // Reported by the secret scan, with a better message.
                _ if is_secret_like(k) => {}
                _ if self.allow_provider && k == "provider" && is_source_path(path) => {
                    if !v.is_string() && !v.is_null() {
                        self.fail(
                            path,
                            format!("must be the name of a provider in providers/ (got {})", shown(v)),
                        );
                    }
                }
                (props, _) => {
                    let known: Vec<&str> = props.iter().flat_map(|p| p.keys()).map(String::as_str).collect();
                    self.fail(path, unknown_field_message(k, &known));
                }
            }
            path.pop();
        }
        if self.mode == Mode::Partial {
            return;
        }
        for required in schema.required.iter().flatten() {
            if map.get(required).is_none_or(Value::is_null) {
                path.push(Seg::Key(required.clone()));
                self.findings.push(Finding {
                    path: path.clone(),
                    message: "is required".to_owned(),
                    blame: Blame::Manifest,
                });
                path.pop();
            }
        }
        for rule in schema.x_kubernetes_validations.iter().flatten() {
            if cel::evaluate(&rule.rule, map, schema) == Some(false) {
                let message = rule.message.clone().unwrap_or_else(|| format!("fails the rule {}", rule.rule));
                self.fail(path, message);
            }
        }
    }

    fn walk_array(&mut self, value: &Value, schema: &JSONSchemaProps, path: &mut Vec<Seg>) {
        let Some(items) = value.as_array() else {
            self.fail(path, format!("must be a list (got {})", shown(value)));
            return;
        };
        if let Some(min) = schema.min_items
            && (items.len() as i64) < min
        {
            self.fail(path, format!("must have at least {min} item(s)"));
        }
        if let Some(max) = schema.max_items
            && (items.len() as i64) > max
        {
            self.fail(path, format!("must have at most {max} item(s)"));
        }
        let item_schema = match &schema.items {
            Some(JSONSchemaPropsOrArray::Schema(s)) => Some(s.as_ref()),
            _ => None,
        };
        let map_keys = match schema.x_kubernetes_list_type.as_deref() {
            Some("map") => schema.x_kubernetes_list_map_keys.clone().unwrap_or_default(),
            _ => Vec::new(),
        };
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, item) in items.iter().enumerate() {
            path.push(Seg::Index(i));
            if item.is_null() {
                self.fail(path, "a list item cannot be null");
            } else if let Some(s) = item_schema {
                self.walk(item, s, path);
            }
            let identity = if !map_keys.is_empty() {
                let parts: Vec<String> = map_keys
                    .iter()
                    .map(|k| format!("{k} {}", shown(item.get(k).unwrap_or(&Value::Null))))
                    .collect();
                item.is_object().then(|| parts.join(", "))
            } else if schema.x_kubernetes_list_type.as_deref() == Some("set") {
                Some(item.to_string())
            } else {
                None
            };
            if let Some(identity) = identity {
                if let Some(first) = seen.get(&identity) {
                    self.fail(path, format!("duplicate entry with {identity} (the same as item [{first}])"));
                } else {
                    seen.insert(identity, i);
                }
            }
            path.pop();
        }
    }

    fn check_string(&mut self, s: &str, schema: &JSONSchemaProps, path: &[Seg]) {
        let len = s.chars().count() as i64;
        if let Some(min) = schema.min_length
            && len < min
        {
            let message = if len == 0 {
                "must not be empty".to_owned()
            } else {
                format!("must be at least {min} characters")
            };
            self.fail(path, message);
            return;
        }
        if let Some(max) = schema.max_length
            && len > max
        {
            self.fail(path, format!("must be at most {max} characters (got {len})"));
            return;
        }
        if let Some(source) = &schema.pattern
            && let Some(pattern) = pattern::Pattern::cached(source)
            && !pattern.is_match(s)
        {
            self.fail(
                path,
                format!("{} (got {})", pattern_message(source), shown(&Value::String(s.to_owned()))),
            );
        }
    }

    fn check_number(&mut self, n: f64, schema: &JSONSchemaProps, path: &[Seg]) {
        let (min, max) = match schema.format.as_deref() {
            Some("int32") => (Some(i32::MIN as f64), Some(i32::MAX as f64)),
            _ => (None, None),
        };
        let min = schema.minimum.or(min);
        let max = schema.maximum.or(max);
        let out_of_range = min.is_some_and(|m| n < m) || max.is_some_and(|m| n > m);
        if out_of_range {
            let message = match (min, max) {
                (Some(lo), Some(hi)) => format!("must be between {lo} and {hi} (got {n})"),
                (Some(lo), None) => format!("must be at least {lo} (got {n})"),
                (None, Some(hi)) => format!("must be at most {hi} (got {n})"),
                (None, None) => "is out of range".to_owned(),
            };
            self.fail(path, message);
        }
    }

    fn fail(&mut self, path: &[Seg], message: impl Into<String>) {
        self.findings.push(finding(path.to_vec(), message));
    }
}

/// Whether `path` is `spec.source.provider`.
fn is_source_path(path: &[Seg]) -> bool {
    path == segs(&["spec", "source", "provider"]).as_slice()
}

/// Short rendering of a value for messages.
pub(super) fn shown(value: &Value) -> String {
    let s = match value {
        Value::Null => "null".to_owned(),
        Value::Object(_) => "a mapping".to_owned(),
        Value::Array(_) => "a list".to_owned(),
        other => other.to_string(),
    };
    if s.chars().count() > 60 { format!("{}…", s.chars().take(60).collect::<String>()) } else { s }
}

pub(super) fn unknown_field_message(field: &str, known: &[&str]) -> String {
    let close = known
        .iter()
        .map(|k| (edit_distance(&field.to_ascii_lowercase(), &k.to_ascii_lowercase()), *k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min();
    match close {
        Some((_, k)) => format!("unknown field; did you mean `{k}`? (the API server would silently drop it)"),
        None if known.is_empty() => "unknown field (the API server would silently drop it)".to_owned(),
        None => format!(
            "unknown field; expected one of {} (the API server would silently drop it)",
            known.join(", ")
        ),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// What the CRD's patterns mean, in words.
fn pattern_message(pattern: &str) -> String {
    match pattern {
        r"^SHA256:[A-Za-z0-9+/]{43}=?$" => {
            "must look like SHA256:<43 base64 chars>, as `ssh-keygen -lf` prints it".to_owned()
        }
        r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" => {
            "must be a lowercase RFC 1123 label (a-z, 0-9 and '-', starting and ending with a letter or digit)"
                .to_owned()
        }
        r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$" => "must be a whole quantity such as 4Gi or 4096Mi".to_owned(),
        r"^[0-9]{1,9}$" => "must be the vmid: 1 to 9 digits".to_owned(),
        "^/" => "must start with /".to_owned(),
        other => format!("must match the pattern {other}"),
    }
}

// ---------------------------------------------------------------------------
// Names

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
pub(super) fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// The name part of a label or annotation key, and a label value when non-empty:
/// alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric, at most 63.
fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

fn key_problem(k: &str) -> Option<String> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if prefix.is_some_and(|p| !is_dns_subdomain(p)) {
        return Some("the prefix before `/` must be a DNS subdomain (e.g. example.com)".to_owned());
    }
    (!is_qualified_name_part(name)).then(|| {
        "the name must be at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
            .to_owned()
    })
}

// ---------------------------------------------------------------------------
// Metadata

const METADATA_SET_BY_SERVER: &[&str] = &[
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
];

/// Checks `metadata` (of a manifest after merging, or of a defaults.yaml).
pub(super) fn check_metadata(meta: &Value, partial: bool, out: &mut Vec<Finding>) {
    let base = segs(&["metadata"]);
    let Some(map) = meta.as_object() else {
        out.push(finding(base, format!("must be a mapping (got {})", shown(meta))));
        return;
    };
    for (k, v) in map {
        let path = child(&base, key(k));
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "name" if partial => {
                out.push(finding(path, "a defaults.yaml cannot set metadata.name (every migration names itself)"))
            }
            "name" => match v.as_str() {
                None => out.push(finding(path, format!("must be a string (got {})", shown(v)))),
                Some(name) if !is_dns_subdomain(name) => out.push(finding(
                    path,
                    "must be a lowercase RFC 1123 subdomain (a-z, 0-9, '-' and '.', starting and ending with a letter or digit), at most 253 characters",
                )),
                // The controller labels the VM and DataVolumes with it (a label value).
                Some(name) if name.len() > 63 => out.push(finding(
                    path,
                    format!("must be at most 63 characters (got {}): the VM and DataVolumes carry it as a label value", name.len()),
                )),
                Some(_) => {}
            },
            "namespace" => match v.as_str() {
                Some(ns) if is_dns_label(ns) => {}
                Some(_) => out.push(finding(path, "must be a lowercase RFC 1123 label (a-z, 0-9 and '-'), at most 63 characters")),
                None => out.push(finding(path, format!("must be a string (got {})", shown(v)))),
            },
            "labels" | "annotations" => check_string_map(k, v, &path, out),
            "generateName" => out.push(finding(path, "is not supported in Git: a migration needs a fixed name")),
            "finalizers" | "ownerReferences" => {
                out.push(finding(path, "is managed in the cluster, not in Git; remove it"))
            }
            other if METADATA_SET_BY_SERVER.contains(&other) => {
                out.push(finding(path, "is set by the API server; remove it"))
            }
            other => {
                let known: &[&str] =
                    if partial { &["namespace", "labels", "annotations"] } else { &["name", "namespace", "labels", "annotations"] };
                out.push(finding(path, unknown_field_message(other, known)));
            }
        }
    }
}

pub(super) fn check_string_map(which: &str, value: &Value, path: &[Seg], out: &mut Vec<Finding>) {
    let Some(map) = value.as_object() else {
        out.push(finding(path.to_vec(), format!("must be a mapping of strings (got {})", shown(value))));
        return;
    };
    for (k, v) in map {
        let p = child(path, key(k));
        if v.is_null() {
            continue;
        }
        if let Some(problem) = key_problem(k) {
            out.push(finding(
                p.clone(),
                format!("is not a valid {} key: {problem}", &which[..which.len() - 1]),
            ));
        }
        let reserved = match (which, k.as_str()) {
            ("labels", LABEL_GITOPS) => Some("is set by `vmmigrate render` on every migration; remove it"),
            ("annotations", ANNOTATION_REPO | ANNOTATION_COMMIT | ANNOTATION_PATH) => {
                Some("is set by `vmmigrate render` (provenance); remove it")
            }
            ("annotations", ANNOTATION_ORPHANED) => {
                Some("is set by vmmigrate when a manifest leaves Git; remove it")
            }
            ("annotations", RETRY_ANNOTATION) => Some(
                "is set with kubectl on the live migration (the controller removes it when consumed); from Git it would retry forever",
            ),
            ("annotations", crate::api::APPROVE_CUTOVER_ANNOTATION) => Some(
                "is an approver's, set with kubectl on the live migration; from Git approve with spec.cutover.approved: true, merged as a later change than the one that creates the migration",
            ),
            ("annotations", crate::api::CONFIRM_ORPHAN_ANNOTATION) => {
                Some("is a person's confirmation on the live migration, set with kubectl; remove it")
            }
            ("annotations", super::super::ANNOTATION_ADOPT | super::super::ANNOTATION_CREATED_SPEC) => {
                Some("is set on the live migration (by its owner, or by vmmigrate at creation); remove it")
            }
            _ => None,
        };
        if let Some(message) = reserved {
            out.push(finding(p, message));
            continue;
        }
        match v.as_str() {
            None => out.push(finding(p, format!("must be a string (got {}; quote it)", shown(v)))),
            Some(s) if which == "labels" && !s.is_empty() && !is_qualified_name_part(s) => out.push(finding(
                p,
                "is not a valid label value: at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric",
            )),
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use super::*;

    #[test]
    fn wrong_types_enums_and_ranges_are_reported_at_their_lines() {
        let m =
            manifest("a", "a").replace("    host: esxi01\n", "    host: esxi01\n    port: 70000\n").replace(
                "    storageClassName: standard\n",
                "    storageClassName: standard\n    runStrategy: Sometimes\n  conversion: raw\n",
            );
        let errors = errors_of(&[file("migrations/a.yaml", &m)]);
        assert_eq!(
            errors,
            vec![
                "migrations/a.yaml:8: spec.source.port: must be between 1 and 65535 (got 70000)",
                "migrations/a.yaml:17: spec.destination.runStrategy: must be one of Always, RerunOnFailure, Manual, Halted (got \"Sometimes\")",
                "migrations/a.yaml:18: spec.conversion: must be a mapping (got \"raw\")",
            ]
        );
    }

    #[test]
    fn cel_rule_exactly_one_of_vm_name_or_id() {
        let m = manifest("a", "a")
            .replace("      name: a\n  destination", "      name: a\n      id: \"12\"\n  destination");
        assert_eq!(
            errors_of(&[file("migrations/a.yaml", &m)]),
            vec!["migrations/a.yaml:11: spec.source.vm: set exactly one of vm.name or vm.id"]
        );
    }

    #[test]
    fn a_long_migration_name_needs_a_destination_name() {
        let long = "a".repeat(60);
        let errors = errors_of(&[file("migrations/a.yaml", &manifest(&long, "a"))]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("migrations/a.yaml:4: metadata.name: is also the destination VM's name")
        );
        let fixed =
            manifest(&long, "a").replace("    namespace: apps\n", "    namespace: apps\n    name: short\n");
        assert!(render_files(&[file("migrations/a.yaml", &fixed)]).is_ok());
    }

    #[test]
    fn status_and_reserved_annotations_are_refused() {
        let m = manifest("a", "b").replace(
            "  name: a\n",
            "  name: a\n  annotations:\n    migration.platform.example/retry: \"true\"\n",
        ) + "status:\n  phase: Completed\n";
        let errors = errors_of(&[file("migrations/a.yaml", &m)]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("migrations/a.yaml:18: status: is written by the controller"),
            "{errors:?}"
        );
        let m = manifest("a", "b").replace(
            "  name: a\n",
            "  name: a\n  annotations:\n    migration.platform.example/retry: \"true\"\n",
        );
        let errors = errors_of(&[file("migrations/a.yaml", &m)]);
        assert!(errors[0].starts_with("migrations/a.yaml:6: metadata.annotations[\"migration.platform.example/retry\"]: is set with kubectl"), "{errors:?}");
        // The creating pull request cannot approve, confirm or adopt for a person.
        for key in [
            "migration.platform.example/approve-cutover",
            "migration.platform.example/confirm-orphan",
            "migration.platform.example/adopt",
            "migration.platform.example/created-spec",
        ] {
            let m = manifest("a", "b")
                .replace("  name: a\n", &format!("  name: a\n  annotations:\n    {key}: \"true\"\n"));
            let errors = errors_of(&[file("migrations/a.yaml", &m)]);
            assert!(
                errors[0].starts_with(&format!("migrations/a.yaml:6: metadata.annotations[\"{key}\"]: is ")),
                "{errors:?}"
            );
        }
    }

    #[test]
    fn no_field_of_the_crd_looks_like_a_secret() {
        fn visit(s: &JSONSchemaProps) {
            for (name, child) in s.properties.iter().flatten() {
                assert!(!is_secret_like(name), "CRD field {name} would be refused as a secret");
                visit(child);
            }
            if let Some(JSONSchemaPropsOrArray::Schema(items)) = &s.items {
                visit(items);
            }
        }
        visit(spec_schema());
    }

    #[test]
    fn secret_like_names() {
        for k in [
            "password",
            "rootPassword",
            "private_key",
            "privateKey",
            "sshPrivateKey",
            "token",
            "example.com/api-key",
        ] {
            assert!(is_secret_like(k), "{k}");
        }
        for k in ["credentialsSecretRef", "hostKey", "name", "passes", "tokenizer"] {
            assert!(!is_secret_like(k), "{k}");
        }
    }
}
