//! Rendering: the files of a repository at one commit → VirtualMachineMigration
//! objects, or every error with its file, line and field.
//!
//! Pure and deterministic: files in, objects (or errors) out; no IO except
//! [`read_dir_files`], which the CLI uses for a local directory. The format
//! (`migrations/`, `defaults.yaml` per folder, `providers/`) is described in
//! docs/gitops.md; this module is its single implementation.
//!
//! Validation walks each document against the CRD's own openAPI schema
//! (`crate::api::crd()`), so a field the API server would silently prune is an
//! error here, and mirrors the CRD's CEL rules by hand (a unit test fails when
//! the CRD gains a rule `cel` does not know).
//!
//! Parts: `documents` (YAML documents and their errors), `positions` (the
//! line of each key), `validate` (schema walk, metadata, secrets), `cel` and
//! `pattern` (the CRD's rules and patterns), `manifest` (one migration
//! manifest, from its document to the object applied); merging and the
//! renderer are here.

use super::{
    ANNOTATION_COMMIT, ANNOTATION_ORPHANED, ANNOTATION_PATH, ANNOTATION_REPO, LABEL_GITOPS, Provenance,
    RepoFile,
};
use crate::api::{GROUP, RETRY_ANNOTATION, VERSION};
use crate::machine::preflight::is_dns_label;
use crate::machine::tenancy::{DestinationRules, TenantBindings};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

/// Namespace of a migration whose manifest and defaults do not set one.
pub(crate) const DEFAULT_NAMESPACE: &str = "vmmigrate";
/// `kind` of a provider definition in `providers/`.
pub(crate) const PROVIDER_KIND: &str = "EsxiProvider";
/// `kind` of every document under `migrations/`.
pub(crate) const MIGRATION_KIND: &str = "VirtualMachineMigration";

/// How much of a repository vmmigrate reads and builds for one commit or
/// pull-request head: everything in a pull request is hostile. Readers stop
/// before reading past a file or tree limit; the YAML walk stops at the
/// first node past a document's budget, before serde_yaml builds anything.
/// Over a limit is an error naming the file and the limit; nothing of that
/// commit is applied. Each field is what the `--max-*` flag of its name sets;
/// `gitops::service::TreeLimitFlags` says what each means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeLimits {
    pub file_bytes: u64,
    pub tree_bytes: u64,
    pub files: usize,
    pub folder_depth: usize,
    pub yaml_depth: usize,
    pub doc_nodes: u64,
    pub tree_nodes: u64,
}

impl TreeLimits {
    /// A migration is about 1 KB and 100 nodes: these leave room for
    /// thousands of them and keep a hostile commit within tens of MiB.
    pub(crate) const DEFAULT: TreeLimits = TreeLimits {
        file_bytes: 1 << 20,
        tree_bytes: 32 << 20,
        files: 10_000,
        folder_depth: 16,
        yaml_depth: 32,
        doc_nodes: 50_000,
        tree_nodes: 2_000_000,
    };
}

impl Default for TreeLimits {
    fn default() -> Self {
        TreeLimits::DEFAULT
    }
}

/// Settings that do not come from the repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// `metadata.namespace` of migrations that set none (directly or through defaults).
    pub default_namespace: String,
    /// The administrator's rules for destination namespaces (the controller
    /// applies the same rules again at Validated).
    pub destinations: DestinationRules,
    /// The administrator's binding of folders to namespaces (`--tenant`).
    pub tenants: TenantBindings,
    pub limits: TreeLimits,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            default_namespace: DEFAULT_NAMESPACE.to_owned(),
            destinations: DestinationRules::default(),
            tenants: TenantBindings::default(),
            limits: TreeLimits::DEFAULT,
        }
    }
}

impl RenderOptions {
    /// Migrations without a namespace go to `namespace`; destinations follow
    /// `destinations`; the default limits.
    pub fn new(namespace: &str, destinations: &DestinationRules) -> RenderOptions {
        RenderOptions {
            default_namespace: namespace.to_owned(),
            destinations: destinations.clone(),
            tenants: TenantBindings::default(),
            limits: TreeLimits::DEFAULT,
        }
    }

    pub(crate) fn with_limits(mut self, limits: TreeLimits) -> RenderOptions {
        self.limits = limits;
        self
    }

    /// Manifests live in their folder's namespace (`--tenant`).
    pub fn with_tenants(mut self, tenants: TenantBindings) -> RenderOptions {
        self.tenants = tenants;
        self
    }
}

/// The files a reader took from a repository, and the ones it refused to
/// read (over a limit, or a name that cannot be shown safely).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepoTree {
    pub files: Vec<RepoFile>,
    pub refused: Vec<RenderError>,
    bytes: u64,
}

impl RepoTree {
    /// A file a reader found at `path` (`None`: its name is not UTF-8; `shown`
    /// is its lossy form), of `size` bytes: read with `read` only when the
    /// format names it and it is within `limits`; else skipped (not ours) or
    /// refused with the reason.
    pub fn offer(
        &mut self,
        path: Option<&str>,
        shown: &str,
        size: u64,
        limits: &TreeLimits,
        read: impl FnOnce() -> std::io::Result<Vec<u8>>,
    ) -> std::io::Result<()> {
        let refuse = |message: String| RenderError { path: escape(shown), line: None, field: None, message };
        let Some(path) = path else {
            if is_ours(shown) {
                self.refused.push(refuse("has a name that is not UTF-8; rename it".to_owned()));
            }
            return Ok(());
        };
        if classify(path) == FileKind::Ignored {
            return Ok(());
        }
        if path.chars().any(char::is_control) {
            self.refused
                .push(refuse("has a control character (a newline?) in its name; rename it".to_owned()));
            return Ok(());
        }
        if path.matches('/').count() > limits.folder_depth {
            self.refused.push(refuse(format!(
                "is nested deeper than {} folders (the limit, --max-folder-depth)",
                limits.folder_depth
            )));
            return Ok(());
        }
        if self.files.len() >= limits.files {
            if !self.refused.iter().any(|e| e.message.contains("--max-files")) {
                self.refused.push(refuse(format!(
                    "is one file more than the limit of {} under migrations/ and providers/ (--max-files)",
                    limits.files
                )));
            }
            return Ok(());
        }
        if size > limits.file_bytes {
            self.refused.push(refuse(format!(
                "is {size} bytes, more than the limit of {} (--max-file-bytes)",
                limits.file_bytes
            )));
            return Ok(());
        }
        if self.bytes + size > limits.tree_bytes {
            self.refused.push(refuse(format!(
                "brings the files under migrations/ and providers/ past the limit of {} bytes (--max-repo-bytes)",
                limits.tree_bytes
            )));
            return Ok(());
        }
        let bytes = read()?;
        if bytes.len() as u64 > limits.file_bytes {
            // It grew between the size check and the read.
            self.refused.push(refuse(format!(
                "is more than the limit of {} bytes (--max-file-bytes)",
                limits.file_bytes
            )));
            return Ok(());
        }
        self.bytes += bytes.len() as u64;
        self.files.push(RepoFile { path: path.to_owned(), bytes });
        Ok(())
    }

    /// Sorted by path, as every reader returns it.
    pub fn sort(&mut self) {
        self.files.sort_by(|a, b| a.path.cmp(&b.path));
        self.refused.sort();
    }
}

/// Whether a path (shown lossily) would be read if its name were fine.
fn is_ours(shown: &str) -> bool {
    shown.starts_with("migrations/") || shown.starts_with("providers/")
}

/// A path as it may be printed: control characters (a newline that would
/// start a `::error` line in CI output, terminal escapes) escaped.
pub(crate) fn escape(path: &str) -> String {
    if !path.chars().any(char::is_control) {
        return path.to_owned();
    }
    path.chars()
        .map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() })
        .collect()
}

/// Renders a tree a reader produced: its refused files are errors too, so a
/// commit with one unreadable file applies nothing.
pub fn render_tree(
    tree: &RepoTree,
    provenance: &Provenance,
    opts: &RenderOptions,
) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
    let result = render(&tree.files, provenance, opts);
    if tree.refused.is_empty() {
        return result;
    }
    let mut errors = tree.refused.clone();
    errors.extend(result.err().unwrap_or_default());
    errors.sort();
    errors.dedup();
    Err(errors)
}

/// One migration, ready for server-side apply.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedMigration {
    /// Path of the manifest in the repository.
    pub path: String,
    /// Index of the document among the manifest's non-empty YAML documents (0-based).
    pub doc_index: usize,
    pub name: String,
    pub namespace: String,
    /// The bound folder it belongs to (`migrations/apps`), when tenants are configured.
    pub tenant: Option<String>,
    /// The full VirtualMachineMigration: defaults merged, provider resolved,
    /// provenance annotations and the gitops label added. Keys are sorted.
    pub object: Value,
}

/// One problem in the repository, located as precisely as the YAML allows.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RenderError {
    /// Path of the file in the repository.
    pub path: String,
    /// 1-based line: the key of `field` when it can be found, else the document's first line.
    pub line: Option<usize>,
    /// Field path such as `spec.networkMap[1].type`.
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for RenderError {
    /// `migrations/a.yaml:12: spec.source.hostKey: must look like …`; missing
    /// parts are left out; control characters in the path are escaped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(&self.path))?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for RenderError {}

/// Renders every migration of one commit. All errors are collected (sorted by
/// path, then line); the result is `Ok` only when there are none, so a commit
/// with one bad manifest changes nothing in the cluster.
pub fn render(
    files: &[RepoFile],
    provenance: &Provenance,
    opts: &RenderOptions,
) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
    let mut r = Renderer { errors: Vec::new() };
    let rendered = r.run(files, provenance, opts);
    let mut errors = r.errors;
    if errors.is_empty() {
        return Ok(rendered);
    }
    // The same problem reached through several manifests (a bad value in a
    // shared defaults.yaml) is reported once.
    errors.sort();
    errors.dedup();
    Err(errors)
}

/// Multi-document YAML of the rendered migrations, sorted by (namespace, name):
/// byte-identical for identical input.
pub fn to_yaml(rendered: &[RenderedMigration]) -> String {
    let mut sorted: Vec<&RenderedMigration> = rendered.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.namespace, &a.name, &a.path, a.doc_index).cmp(&(&b.namespace, &b.name, &b.path, b.doc_index))
    });
    let docs: Vec<String> = sorted
        .iter()
        // A serde_json::Value always serializes; the fallback keeps the signature infallible.
        .map(|r| serde_yaml::to_string(&r.object).unwrap_or_else(|e| format!("# cannot serialize: {e}\n")))
        .collect();
    docs.join("---\n")
}

/// Reads `migrations/` and `providers/` of a local checkout (recursively,
/// within `limits`). Symbolic links are never followed (not even to a file
/// inside the checkout: Git would store the link, not the file); `.git` is
/// skipped. Paths are relative to `root` with `/` separators, sorted. A
/// missing folder is an empty one.
pub fn read_dir_files(root: &Path, limits: &TreeLimits) -> std::io::Result<RepoTree> {
    let mut tree = RepoTree::default();
    for top in ["migrations", "providers"] {
        let dir = root.join(top);
        let meta = match std::fs::symlink_metadata(&dir) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if meta.file_type().is_symlink() {
            tree.refused.push(symlink_refused(top));
        } else if meta.is_dir() {
            read_tree(&dir, top, limits, &mut tree)?;
        }
    }
    tree.sort();
    Ok(tree)
}

fn symlink_refused(shown: &str) -> RenderError {
    RenderError {
        path: escape(shown),
        line: None,
        field: None,
        message: "is a symbolic link; vmmigrate reads no file through a link".to_owned(),
    }
}

fn read_tree(dir: &Path, rel: &str, limits: &TreeLimits, tree: &mut RepoTree) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let os_name = entry.file_name();
        let name = os_name.to_str();
        if name == Some(".git") {
            continue;
        }
        let shown = format!("{rel}/{}", os_name.to_string_lossy());
        let rel_path = name.map(|n| format!("{rel}/{n}"));
        let file_type = entry.file_type()?;
        if file_type.is_symlink() {
            // Whatever it points at (a manifest, a folder of them, a file
            // outside the checkout), it is not read.
            tree.refused.push(symlink_refused(&shown));
        } else if file_type.is_dir() {
            // Deeper folders hold nothing the format reads (offer refuses their files).
            if let Some(rel_path) = rel_path.filter(|p| p.matches('/').count() <= limits.folder_depth) {
                read_tree(&entry.path(), &rel_path, limits, tree)?;
            }
        } else if file_type.is_file() {
            let size = entry.metadata()?.len();
            let path = entry.path();
            tree.offer(rel_path.as_deref(), &shown, size, limits, || {
                use std::io::Read;
                let mut bytes = Vec::new();
                std::fs::File::open(&path)?.take(limits.file_bytes + 1).read_to_end(&mut bytes)?;
                Ok(bytes)
            })?;
        }
    }
    Ok(())
}

fn is_yaml(name: &str) -> bool {
    name.ends_with(".yaml") || name.ends_with(".yml")
}

// ---------------------------------------------------------------------------
// Repository layout

#[derive(Clone, Debug, PartialEq, Eq)]
enum FileKind {
    /// A `VirtualMachineMigration` manifest under `migrations/`.
    Manifest,
    /// `defaults.yaml` of the folder (`migrations` or below).
    Defaults {
        dir: String,
    },
    /// `providers/<name>.yaml`.
    Provider,
    Ignored,
}

fn classify(path: &str) -> FileKind {
    let Some(file_name) = path.rsplit('/').next() else { return FileKind::Ignored };
    if !is_yaml(file_name) {
        return FileKind::Ignored;
    }
    if path.starts_with("migrations/") {
        if file_name == "defaults.yaml" || file_name == "defaults.yml" {
            let dir = path[..path.len() - file_name.len() - 1].to_owned();
            return FileKind::Defaults { dir };
        }
        return FileKind::Manifest;
    }
    if let Some(rest) = path.strip_prefix("providers/")
        && !rest.contains('/')
    {
        return FileKind::Provider;
    }
    FileKind::Ignored
}

/// Folders whose defaults apply to a manifest, root (`migrations`) first.
fn folder_chain(path: &str) -> Vec<&str> {
    path.match_indices('/').map(|(i, _)| &path[..i]).collect()
}

// ---------------------------------------------------------------------------
// Paths inside a document

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

fn key(k: &str) -> Seg {
    Seg::Key(k.to_owned())
}

fn segs(keys: &[&str]) -> Vec<Seg> {
    keys.iter().map(|k| key(k)).collect()
}

fn child(path: &[Seg], seg: Seg) -> Vec<Seg> {
    let mut out = path.to_vec();
    out.push(seg);
    out
}

/// `spec.networkMap[1].type`; keys that are not plain words are quoted:
/// `metadata.annotations["example.com/owner"]`.
fn format_path(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k)
                if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
            {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Key(k) => out.push_str(&format!("[{k:?}]")),
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

fn lookup<'v>(value: &'v Value, path: &[Seg]) -> Option<&'v Value> {
    let mut cur = value;
    for seg in path {
        cur = match seg {
            Seg::Key(k) => cur.as_object()?.get(k)?,
            Seg::Index(i) => cur.as_array()?.get(*i)?,
        };
    }
    (!cur.is_null()).then_some(cur)
}

mod cel;
mod documents;
mod manifest;
mod pattern;
mod positions;
mod validate;

use manifest::Providers;

use documents::*;
use positions::{DocBudget, LineIndex};
use validate::*;

// ---------------------------------------------------------------------------
// Merging

/// Lays `upper` over `lower`: mappings merge key by key, everything else
/// (scalars and lists) is replaced whole. Lists are never merged item by item:
/// half of a defaults networkMap under half of a manifest's would map
/// networks nobody asked for. A null in `upper` removes the key.
fn overlay(lower: &mut Map<String, Value>, upper: &Map<String, Value>) {
    for (k, v) in upper {
        match (lower.get_mut(k), v) {
            (Some(Value::Object(l)), Value::Object(u)) => overlay(l, u),
            _ => {
                lower.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Drops null map entries, as the API server prunes them (the CRD has no nullable fields).
fn prune_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(prune_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(prune_nulls),
        _ => {}
    }
}

// ---------------------------------------------------------------------------
// The renderer

struct Provider {
    doc: usize,
    spec: Map<String, Value>,
}

/// A file a manifest's values may come from, most important first.
struct Layer<'d> {
    doc: &'d Doc,
    /// A provider's `spec.X` is the migration's `spec.source.X`.
    provider: bool,
}

impl Layer<'_> {
    fn local_path(&self, path: &[Seg]) -> Option<Vec<Seg>> {
        if !self.provider {
            return Some(path.to_vec());
        }
        let rest = path.strip_prefix(&segs(&["spec", "source"])[..])?;
        Some([vec![key("spec")], rest.to_vec()].concat())
    }
}

/// Reports a finding against the file that holds the offending value: the
/// manifest, one of its defaults.yaml files, or its provider.
fn attribute(f: &Finding, layers: &[Layer]) -> RenderError {
    // Where the value is, or for a missing field, where its parent is when
    // that parent sits in a list (a list comes whole from one file).
    let anchor = match f.blame {
        Blame::Origin => Some(f.path.as_slice()),
        Blame::Manifest if f.path.iter().any(|s| matches!(s, Seg::Index(_))) => {
            f.path.split_last().map(|(_, parent)| parent)
        }
        Blame::Manifest => None,
    };
    if let Some(anchor) = anchor {
        for layer in layers {
            if let (Some(local_anchor), Some(local)) = (layer.local_path(anchor), layer.local_path(&f.path))
                && lookup(&layer.doc.value, &local_anchor).is_some()
            {
                return layer.doc.error(&local, f.message.clone());
            }
        }
    }
    layers[0].doc.error(&f.path, f.message.clone())
}

struct Accepted {
    doc: usize,
    rendered: RenderedMigration,
    source_key: String,
    destination_key: String,
}

struct Renderer {
    errors: Vec<RenderError>,
}

impl Renderer {
    fn run(
        &mut self,
        files: &[RepoFile],
        provenance: &Provenance,
        opts: &RenderOptions,
    ) -> Vec<RenderedMigration> {
        // Input order must not matter.
        let mut files: Vec<&RepoFile> = files.iter().collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));

        let mut docs: Vec<Doc> = Vec::new();
        let mut manifests: Vec<usize> = Vec::new();
        let mut defaults: BTreeMap<String, usize> = BTreeMap::new();
        let mut broken_defaults: BTreeSet<String> = BTreeSet::new();
        let mut provider_docs: Vec<usize> = Vec::new();
        let mut broken_providers: Vec<String> = Vec::new();

        let mut previous: Option<&str> = None;
        let mut tree_nodes: u64 = 0;
        for file in &files {
            if previous == Some(file.path.as_str()) {
                self.errors.push(RenderError {
                    path: file.path.clone(),
                    line: None,
                    field: None,
                    message: "is listed twice".to_owned(),
                });
                continue;
            }
            previous = Some(&file.path);
            let kind = classify(&file.path);
            if kind == FileKind::Ignored {
                continue;
            }
            let Some(parsed) = parse_file(file, &opts.limits, &mut tree_nodes, &mut self.errors) else {
                match kind {
                    FileKind::Defaults { dir } => {
                        broken_defaults.insert(dir);
                    }
                    FileKind::Provider => broken_providers.push(file.path.clone()),
                    _ => {}
                }
                continue;
            };
            for doc in &parsed {
                scan_secrets(doc, &doc.value, &mut Vec::new(), &mut self.errors);
            }
            for doc in parsed {
                let i = docs.len();
                match &kind {
                    FileKind::Manifest => manifests.push(i),
                    FileKind::Defaults { dir } => {
                        if doc.doc_index > 0 {
                            self.errors.push(doc.error(&[], "a defaults.yaml holds one document"));
                        } else if let Some(&other) = defaults.get(dir) {
                            let message =
                                format!("{dir} has two defaults files; keep one ({})", docs[other].path);
                            self.errors.push(doc.error(&[], message));
                        } else {
                            self.check_defaults(&doc);
                            defaults.insert(dir.clone(), i);
                        }
                    }
                    FileKind::Provider => provider_docs.push(i),
                    FileKind::Ignored => {}
                }
                docs.push(doc);
            }
        }

        let by_name = self.providers(&docs, &provider_docs);
        let providers = Providers { by_name: &by_name, unreadable: &broken_providers };
        let mut accepted = Vec::new();
        for &m in &manifests {
            let chain: Vec<&str> = folder_chain(&docs[m].path);
            if chain.iter().any(|dir| broken_defaults.contains(*dir)) {
                // Its defaults did not parse (reported); checking it without them would only add noise.
                continue;
            }
            let chain_docs: Vec<usize> =
                chain.iter().rev().filter_map(|dir| defaults.get(*dir).copied()).collect();
            if let Some(a) = self.manifest(&docs, m, &chain_docs, &providers, provenance, opts) {
                accepted.push(a);
            }
        }
        self.duplicates(&docs, &accepted);
        accepted.into_iter().map(|a| a.rendered).collect()
    }

    fn check_defaults(&mut self, doc: &Doc) {
        let mut findings = Vec::new();
        for (k, v) in doc.value.as_object().into_iter().flatten() {
            match k.as_str() {
                "metadata" => check_metadata(v, true, &mut findings),
                "spec" => {
                    let mut walk = SchemaWalk { mode: Mode::Partial, allow_provider: true, findings: Vec::new() };
                    walk.walk(v, spec_schema(), &mut vec![key("spec")]);
                    findings.extend(walk.findings);
                }
                "apiVersion" | "kind" => findings.push(finding(
                    vec![key(k)],
                    "a defaults.yaml is not a resource: it holds only metadata (namespace, labels, annotations) and spec",
                )),
                other if is_secret_like(other) => {}
                other => findings.push(finding(vec![key(other)], unknown_field_message(other, &["metadata", "spec"]))),
            }
        }
        self.errors.extend(findings.iter().map(|f| doc.error(&f.path, f.message.clone())));
    }

    fn providers(&mut self, docs: &[Doc], provider_docs: &[usize]) -> BTreeMap<String, Provider> {
        let mut by_name: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut specs: HashMap<usize, Map<String, Value>> = HashMap::new();
        for &i in provider_docs {
            let doc = &docs[i];
            let value = &doc.value;
            let mut findings = Vec::new();
            match value.get("apiVersion") {
                None => {}
                Some(v) if v.as_str() == Some(&format!("{GROUP}/{VERSION}")) => {}
                Some(v) => findings.push(finding(
                    segs(&["apiVersion"]),
                    format!("must be {GROUP}/{VERSION} (got {})", shown(v)),
                )),
            }
            match value.get("kind") {
                Some(v) if v.as_str() == Some(PROVIDER_KIND) => {}
                Some(v) => findings.push(finding(
                    segs(&["kind"]),
                    format!("must be {PROVIDER_KIND} (got {}); migrations go in migrations/", shown(v)),
                )),
                None => findings.push(finding(segs(&["kind"]), format!("is required ({PROVIDER_KIND})"))),
            }
            let name = value.get("metadata").and_then(|m| m.get("name")).and_then(Value::as_str);
            match name {
                Some(n) if is_dns_subdomain(n) => {}
                Some(_) => findings
                    .push(finding(segs(&["metadata", "name"]), "must be a lowercase RFC 1123 subdomain")),
                None => findings
                    .push(finding(segs(&["metadata", "name"]), "is required (the name migrations refer to)")),
            }
            if let Some(meta) = value.get("metadata").and_then(Value::as_object) {
                for (k, v) in meta {
                    match k.as_str() {
                        "name" => {}
                        "labels" | "annotations" => {
                            check_string_map(k, v, &segs(&["metadata", k]), &mut findings)
                        }
                        other => findings.push(finding(
                            segs(&["metadata", other]),
                            unknown_field_message(other, &["name", "labels", "annotations"]),
                        )),
                    }
                }
            }
            for k in value.as_object().into_iter().flat_map(|m| m.keys()) {
                if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata" | "spec") && !is_secret_like(k) {
                    findings.push(finding(
                        vec![key(k)],
                        unknown_field_message(k, &["apiVersion", "kind", "metadata", "spec"]),
                    ));
                }
            }
            let mut spec = value.get("spec").cloned().unwrap_or(Value::Null);
            prune_nulls(&mut spec);
            let mut walk = SchemaWalk { mode: Mode::Full, allow_provider: false, findings: Vec::new() };
            walk.walk(&spec, provider_schema(), &mut vec![key("spec")]);
            findings.extend(walk.findings);
            self.errors.extend(findings.iter().map(|f| doc.error(&f.path, f.message.clone())));
            if let (Some(name), Value::Object(mut spec)) = (name, spec) {
                // Only the connection fields flow into migrations (others are errors above).
                spec.retain(|k, _| provider_may_set(k));
                by_name.entry(name.to_owned()).or_default().push(i);
                specs.insert(i, spec);
            }
        }
        let mut out = BTreeMap::new();
        for (name, defined) in by_name {
            if defined.len() > 1 {
                for &i in &defined {
                    let others: Vec<String> =
                        defined.iter().filter(|&&j| j != i).map(|&j| docs[j].path.clone()).collect();
                    let message = format!("provider {name:?} is also defined in {}", others.join(", "));
                    self.errors.push(docs[i].error(&segs(&["metadata", "name"]), message));
                }
            }
            let first = defined[0];
            out.insert(name, Provider { doc: first, spec: specs.remove(&first).unwrap_or_default() });
        }
        out
    }

    /// One migration per (namespace, name), per source VM and per destination
    /// VM across the whole commit; every manifest involved gets an error.
    fn duplicates(&mut self, docs: &[Doc], accepted: &[Accepted]) {
        type KeyFn = fn(&Accepted) -> String;
        let checks: [(KeyFn, &[&str], &str); 3] = [
            (|a| format!("{}/{}", a.rendered.namespace, a.rendered.name), &["metadata", "name"], "migration"),
            (|a| a.source_key.clone(), &["spec", "source", "vm"], "source VM"),
            (|a| a.destination_key.clone(), &["spec", "destination"], "destination VM"),
        ];
        for (key_of, field, what) in checks {
            let mut groups: BTreeMap<String, Vec<&Accepted>> = BTreeMap::new();
            for a in accepted {
                groups.entry(key_of(a)).or_default().push(a);
            }
            for (k, group) in groups.into_iter().filter(|(_, g)| g.len() > 1) {
                let field = segs(field);
                let location =
                    |a: &Accepted| format!("{}:{}", docs[a.doc].path, docs[a.doc].lines.line_of(&field));
                for a in &group {
                    let others: Vec<String> =
                        group.iter().filter(|o| o.doc != a.doc).map(|o| location(o)).collect();
                    let verb = match what {
                        "migration" => "is also defined in",
                        "source VM" => "is also migrated by",
                        _ => "is also the destination of",
                    };
                    self.errors
                        .push(docs[a.doc].error(&field, format!("{what} {k} {verb} {}", others.join(", "))));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
