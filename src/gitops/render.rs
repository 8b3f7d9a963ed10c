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
//! the CRD gains a rule this file does not know).

use super::{
    ANNOTATION_COMMIT, ANNOTATION_ORPHANED, ANNOTATION_PATH, ANNOTATION_REPO, LABEL_GITOPS, Provenance,
    RepoFile,
};
use crate::api::{GROUP, RETRY_ANNOTATION, VERSION, VirtualMachineMigration};
use crate::machine::preflight::{MAX_DESTINATION_NAME, is_dns_label};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

/// Namespace of a migration whose manifest and defaults do not set one.
pub const DEFAULT_NAMESPACE: &str = "vmmigrate";
/// `kind` of a provider definition in `providers/`.
pub const PROVIDER_KIND: &str = "EsxiProvider";
/// `kind` of every document under `migrations/`.
pub const MIGRATION_KIND: &str = "VirtualMachineMigration";

/// Settings that do not come from the repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// `metadata.namespace` of migrations that set none (directly or through defaults).
    pub default_namespace: String,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions { default_namespace: DEFAULT_NAMESPACE.to_owned() }
    }
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
    /// `migrations/a.yaml:12: spec.source.hostKey: must look like …`; missing parts are left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.path)?;
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
/// skipping `.git` and symlinked directories). Paths are relative to `root`
/// with `/` separators, sorted. A missing folder is an empty one.
pub fn read_dir_files(root: &Path) -> std::io::Result<Vec<RepoFile>> {
    let mut out = Vec::new();
    for top in ["migrations", "providers"] {
        let dir = root.join(top);
        if dir.is_dir() {
            read_tree(&dir, top, &mut out)?;
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn read_tree(dir: &Path, rel: &str, out: &mut Vec<RepoFile>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == ".git" {
            continue;
        }
        let path = entry.path();
        let rel_path = format!("{rel}/{name}");
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            read_tree(&path, &rel_path, out)?;
        } else if (file_type.is_file() || (file_type.is_symlink() && path.is_file())) && is_yaml(&name) {
            out.push(RepoFile { path: rel_path, bytes: std::fs::read(&path)? });
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

// ---------------------------------------------------------------------------
// Line index: serde_yaml 0.9 has no spans per value, so the lines of keys are
// found by a small scanner for block-style YAML.

mod lines {
    use super::{Seg, format_path};
    use std::collections::HashMap;

    /// Field path → 1-based line of its key (or of its `- ` for a list item).
    #[derive(Clone, Debug, Default)]
    pub(super) struct LineIndex {
        keys: HashMap<String, usize>,
        /// Keys seen a second time in the same mapping (a YAML error): (key, path, line).
        repeated: Vec<(String, Vec<Seg>, usize)>,
        first: usize,
    }

    impl LineIndex {
        /// Indexes one YAML document whose first line is line `first_line` of its file.
        /// Flow collections (`{…}`, `[…]`) are not entered: their fields resolve
        /// to the line of the enclosing key.
        pub(super) fn build(text: &str, first_line: usize) -> LineIndex {
            let mut index = LineIndex { keys: HashMap::new(), repeated: Vec::new(), first: 0 };
            // (column, segment): the path to the line being read.
            let mut stack: Vec<(usize, Seg)> = Vec::new();
            // Lines indented deeper than this belong to a block scalar (`|`, `>`).
            let mut block_scalar: Option<usize> = None;
            for (i, raw) in text.lines().enumerate() {
                let line_no = first_line + i;
                let indent = raw.len() - raw.trim_start_matches(' ').len();
                let mut rest = &raw[indent..];
                if rest.trim().is_empty() {
                    continue;
                }
                if let Some(limit) = block_scalar {
                    if indent > limit {
                        continue;
                    }
                    block_scalar = None;
                }
                if rest.starts_with('#') || rest.starts_with('%') {
                    continue;
                }
                if indent == 0 && (is_marker(rest, "---") || is_marker(rest, "...")) {
                    continue;
                }
                if index.first == 0 {
                    index.first = line_no;
                }
                let mut col = indent;
                loop {
                    if rest == "-" || rest.starts_with("- ") {
                        while stack.last().is_some_and(|(c, _)| *c > col) {
                            stack.pop();
                        }
                        match stack.last_mut() {
                            Some((c, Seg::Index(n))) if *c == col => *n += 1,
                            _ => stack.push((col, Seg::Index(0))),
                        }
                        index.record(&stack, line_no);
                        let after = &rest[1..];
                        let trimmed = after.trim_start_matches(' ');
                        col += 1 + after.len() - trimmed.len();
                        rest = trimmed;
                        if starts_block_scalar(rest) {
                            block_scalar = Some(col.saturating_sub(2));
                            break;
                        }
                        continue;
                    }
                    if let Some((key, value)) = split_key(rest) {
                        while stack.last().is_some_and(|(c, _)| *c >= col) {
                            stack.pop();
                        }
                        stack.push((col, Seg::Key(key)));
                        index.record(&stack, line_no);
                        if starts_block_scalar(value.trim_start()) {
                            block_scalar = Some(col);
                        }
                    }
                    break;
                }
            }
            if index.first == 0 {
                index.first = first_line;
            }
            index
        }

        fn record(&mut self, stack: &[(usize, Seg)], line: usize) {
            let path: Vec<Seg> = stack.iter().map(|(_, s)| s.clone()).collect();
            match self.keys.entry(format_path(&path)) {
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(line);
                }
                std::collections::hash_map::Entry::Occupied(_) => {
                    if let Some(Seg::Key(k)) = path.last() {
                        self.repeated.push((k.clone(), path.clone(), line));
                    }
                }
            }
        }

        /// Where key `key` appears a second time in one mapping.
        pub(super) fn repeated_key(&self, key: &str) -> Option<(&[Seg], usize)> {
            self.repeated.iter().find(|(k, _, _)| k == key).map(|(_, path, line)| (path.as_slice(), *line))
        }

        /// Line of `path`'s key, else of its nearest indexed ancestor, else the document's first line.
        pub(super) fn line_of(&self, path: &[Seg]) -> usize {
            (1..=path.len())
                .rev()
                .find_map(|n| self.keys.get(&format_path(&path[..n])).copied())
                .unwrap_or(self.first)
        }

        /// The document's first line with content.
        #[cfg(test)]
        pub(super) fn first(&self) -> usize {
            self.first
        }
    }

    fn is_marker(line: &str, marker: &str) -> bool {
        line.strip_prefix(marker).is_some_and(|r| r.is_empty() || r.starts_with([' ', '\t']))
    }

    fn starts_block_scalar(value: &str) -> bool {
        let value = value.split(" #").next().unwrap_or("").trim_end();
        (value.starts_with('|') || value.starts_with('>'))
            && value[1..].chars().all(|c| c.is_ascii_digit() || c == '-' || c == '+')
    }

    /// `key: value` → (key, value); quoted keys are unquoted. Anything else
    /// (a scalar, a flow collection, `key:value`) is not a key.
    pub(super) fn split_key(line: &str) -> Option<(String, &str)> {
        let (key, after) = match line.chars().next()? {
            '"' => {
                let mut escaped = false;
                let end = line[1..].char_indices().find_map(|(i, c)| {
                    let found = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    found.then_some(i + 1)
                })?;
                let key =
                    serde_json::from_str::<String>(&line[..=end]).unwrap_or_else(|_| line[1..end].to_owned());
                (key, line[end + 1..].trim_start_matches(' '))
            }
            '\'' => {
                let mut i = 1;
                let bytes = line.as_bytes();
                loop {
                    match bytes.get(i) {
                        None => return None,
                        Some(b'\'') if bytes.get(i + 1) == Some(&b'\'') => i += 2,
                        Some(b'\'') => break,
                        Some(_) => i += 1,
                    }
                }
                (line[1..i].replace("''", "'"), line[i + 1..].trim_start_matches(' '))
            }
            '[' | '{' | '&' | '*' | '!' | '|' | '>' | '%' | '@' | '`' | '?' | '#' => return None,
            _ => {
                let bytes = line.as_bytes();
                let colon = (0..bytes.len()).find(|&i| {
                    bytes[i] == b':'
                        && (i + 1 == bytes.len() || bytes[i + 1] == b' ' || bytes[i + 1] == b'\t')
                })?;
                if line[..colon].contains(" #") {
                    return None;
                }
                (line[..colon].trim_end().to_owned(), &line[colon..])
            }
        };
        let value = after.strip_prefix(':')?;
        (value.is_empty() || value.starts_with([' ', '\t'])).then_some((key, value))
    }
}

use lines::LineIndex;

// ---------------------------------------------------------------------------
// Documents

/// One non-empty YAML document of one file.
struct Doc {
    path: String,
    doc_index: usize,
    value: Value,
    lines: LineIndex,
}

impl Doc {
    fn error(&self, path: &[Seg], message: impl Into<String>) -> RenderError {
        RenderError {
            path: self.path.clone(),
            line: Some(self.lines.line_of(path)),
            field: (!path.is_empty()).then(|| format_path(path)),
            message: message.into(),
        }
    }
}

/// A document's text, with the line of the file it starts on.
struct Chunk {
    text: String,
    first_line: usize,
}

/// Splits a YAML stream at `---` (and `...`) lines, keeping only documents
/// with content. Each document is parsed on its own so its errors and
/// lines are its own; `first_line` turns them back into file lines.
fn split_documents(text: &str) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let mut current = Chunk { text: String::new(), first_line: 1 };
    let mut has_content = false;
    for (i, line) in text.lines().enumerate() {
        let marker =
            |m: &str| line.strip_prefix(m).is_some_and(|r| r.is_empty() || r.starts_with([' ', '\t']));
        if marker("---") || marker("...") {
            if has_content {
                chunks.push(std::mem::replace(&mut current, Chunk { text: String::new(), first_line: 0 }));
            }
            current = Chunk { text: String::new(), first_line: i + 1 };
            has_content = false;
            if marker("---") {
                // `--- {…}` or `--- # comment`: keep what follows the marker, in place.
                current.text.push_str("   ");
                current.text.push_str(&line[3..]);
                has_content = !line[3..].trim().is_empty() && !line[3..].trim_start().starts_with('#');
            }
            current.text.push('\n');
            continue;
        }
        if line.starts_with('%') {
            // A directive (%YAML): only meaningful before `---`; dropped, line kept.
            current.text.push('\n');
            continue;
        }
        let trimmed = line.trim_start();
        if !trimmed.is_empty() && !trimmed.starts_with('#') {
            has_content = true;
        }
        current.text.push_str(line);
        current.text.push('\n');
    }
    if has_content {
        chunks.push(current);
    }
    chunks
}

/// Parses one file into its documents; syntax errors carry the file's line.
fn parse_file(file: &RepoFile, errors: &mut Vec<RenderError>) -> Option<Vec<Doc>> {
    let Ok(text) = std::str::from_utf8(&file.bytes) else {
        errors.push(RenderError {
            path: file.path.clone(),
            line: None,
            field: None,
            message: "is not UTF-8 text".to_owned(),
        });
        return None;
    };
    let mut docs = Vec::new();
    let mut ok = true;
    for (doc_index, chunk) in split_documents(text).into_iter().enumerate() {
        let lines = LineIndex::build(&chunk.text, chunk.first_line);
        let yaml = match serde_yaml::from_str::<serde_yaml::Value>(&chunk.text) {
            Ok(v) => v,
            Err(err) => {
                errors.push(syntax_error(&file.path, &chunk, err));
                ok = false;
                continue;
            }
        };
        let mut yaml = yaml;
        let doc = Doc { path: file.path.clone(), doc_index, value: Value::Null, lines };
        if let Err(err) = yaml.apply_merge() {
            errors.push(doc.error(&[], format!("YAML merge key: {err}")));
            ok = false;
            continue;
        }
        let mut path = Vec::new();
        match yaml_to_json(yaml, &mut path) {
            Ok(value) if value.is_object() => docs.push(Doc { value, ..doc }),
            Ok(_) => {
                errors.push(doc.error(&[], "a document must be a mapping (`apiVersion: …`, `kind: …`, …)"));
                ok = false;
            }
            Err((path, message)) => {
                errors.push(doc.error(&path, message));
                ok = false;
            }
        }
    }
    ok.then_some(docs)
}

fn syntax_error(path: &str, chunk: &Chunk, err: serde_yaml::Error) -> RenderError {
    // Parse again behind as many newlines as the document is deep in its
    // file: the locations in serde_yaml's message then are file lines too.
    let padded = format!("{}{}", "\n".repeat(chunk.first_line.saturating_sub(1)), chunk.text);
    let err = serde_yaml::from_str::<serde_yaml::Value>(&padded).err().unwrap_or(err);
    let location = err.location();
    let mut message = err.to_string();
    if let Some(loc) = &location {
        // The line is in the `path:line:` prefix already.
        message = message.replacen(&format!(" at line {} column {}", loc.line(), loc.column()), "", 1);
    }
    // serde_yaml places a repeated key at the start of its mapping; the line
    // index knows where the repetition is.
    // Its message reads `[<path of the mapping>: ]duplicate entry with key "<key>"`.
    let repeated = message
        .split_once("duplicate entry with key ")
        .and_then(|(_, k)| serde_json::from_str::<String>(k.split(" at line ").next().unwrap_or(k)).ok())
        .and_then(|k| {
            LineIndex::build(&chunk.text, chunk.first_line).repeated_key(&k).map(|(p, l)| (format_path(p), l))
        });
    if let Some((field, line)) = repeated {
        return RenderError {
            path: path.to_owned(),
            line: Some(line),
            field: Some(field),
            message: "is written twice in the same mapping".to_owned(),
        };
    }
    RenderError {
        path: path.to_owned(),
        line: location.map(|l| l.line()),
        field: None,
        message: format!("YAML syntax: {message}"),
    }
}

fn yaml_to_json(value: serde_yaml::Value, path: &mut Vec<Seg>) -> Result<Value, (Vec<Seg>, String)> {
    use serde_yaml::Value as Y;
    Ok(match value {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .ok_or_else(|| (path.clone(), format!("{n} is not a finite number")))?
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                path.push(Seg::Index(i));
                out.push(yaml_to_json(item, path)?);
                path.pop();
            }
            Value::Array(out)
        }
        Y::Mapping(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                let Y::String(k) = k else {
                    let shown = serde_yaml::to_string(&k).unwrap_or_default();
                    return Err((
                        path.clone(),
                        format!("key {} must be a string (quote it)", shown.trim_end()),
                    ));
                };
                path.push(Seg::Key(k.clone()));
                let v = yaml_to_json(v, path)?;
                path.pop();
                out.insert(k, v);
            }
            Value::Object(out)
        }
        Y::Tagged(tagged) => {
            return Err((path.clone(), format!("YAML tags ({}) are not supported", tagged.tag)));
        }
    })
}

// ---------------------------------------------------------------------------
// Secrets never go into Git

/// Normalized field names (lowercase, without `-`, `_`, `.`) that name a credential.
const SECRET_SUFFIXES: &[&str] =
    &["password", "passwd", "passphrase", "privatekey", "secretkey", "apikey", "token"];
const SECRET_NAMES: &[&str] = &["secret", "pass", "pwd"];

fn is_secret_like(key: &str) -> bool {
    let last = key.rsplit('/').next().unwrap_or(key);
    let norm: String =
        last.chars().filter(|c| !matches!(c, '-' | '_' | '.')).map(|c| c.to_ascii_lowercase()).collect();
    SECRET_NAMES.contains(&norm.as_str()) || SECRET_SUFFIXES.iter().any(|s| norm.ends_with(s))
}

const SECRET_HINT: &str = "credentials never go into Git: put them in the Secret that spec.source.credentialsSecretRef names (keys `username` and `password` or `privateKey`)";

fn scan_secrets(doc: &Doc, value: &Value, path: &mut Vec<Seg>, errors: &mut Vec<RenderError>) {
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
fn spec_schema() -> &'static JSONSchemaProps {
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

/// Fields a provider may set: the connection half of `spec.source`.
const PROVIDER_FIELDS: &[&str] = &["credentialsSecretRef", "host", "hostKey", "port"];

/// Schema of a provider's `spec`: `spec.source` without `vm`, same rules.
fn provider_schema() -> &'static JSONSchemaProps {
    static SCHEMA: OnceLock<JSONSchemaProps> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let mut source =
            spec_schema().properties.as_ref().and_then(|p| p.get("source")).cloned().unwrap_or_default();
        if let Some(props) = source.properties.as_mut() {
            props.retain(|k, _| PROVIDER_FIELDS.contains(&k.as_str()));
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
enum Blame {
    /// The file the value at the path came from (manifest, a defaults.yaml or a provider).
    Origin,
    /// The manifest: something is missing from it.
    Manifest,
}

#[derive(Clone, Debug)]
struct Finding {
    path: Vec<Seg>,
    message: String,
    blame: Blame,
}

fn finding(path: Vec<Seg>, message: impl Into<String>) -> Finding {
    Finding { path, message: message.into(), blame: Blame::Origin }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A complete object: required fields and CEL rules are checked too.
    Full,
    /// A partial one (a defaults.yaml): only what is written is checked; a null unsets.
    Partial,
}

struct SchemaWalk {
    mode: Mode,
    /// `spec.source.provider` is accepted (before provider resolution).
    allow_provider: bool,
    findings: Vec<Finding>,
}

impl SchemaWalk {
    fn walk(&mut self, value: &Value, schema: &JSONSchemaProps, path: &mut Vec<Seg>) {
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
            && let Some(pattern) = pattern::Pattern::compile(source)
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
fn shown(value: &Value) -> String {
    let s = match value {
        Value::Null => "null".to_owned(),
        Value::Object(_) => "a mapping".to_owned(),
        Value::Array(_) => "a list".to_owned(),
        other => other.to_string(),
    };
    if s.chars().count() > 60 { format!("{}…", s.chars().take(60).collect::<String>()) } else { s }
}

fn unknown_field_message(field: &str, known: &[&str]) -> String {
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
// The CRD's CEL rules, mirrored by hand

mod cel {
    use super::JSONSchemaProps;
    use serde_json::{Map, Value};

    /// Every rule this file evaluates; a unit test checks the CRD has no other.
    #[cfg(test)]
    pub(super) const MIRRORED: &[&str] = &[
        "has(self.name) != has(self.id)",
        "self.type == 'Pod' ? !has(self.networkName) : has(self.networkName)",
        "self.maxSeconds >= self.initialSeconds",
        "(has(self.http) ? 1 : 0) + (has(self.guestAgent) ? 1 : 0) + (has(self.ip) ? 1 : 0) == 1",
    ];

    /// `Some(passes)` for a mirrored rule, `None` for an unknown one or when a
    /// field has the wrong type (reported by the schema walk). Like the API
    /// server, the rule sees the object after the schema's defaults.
    pub(super) fn evaluate(
        rule: &str,
        object: &Map<String, Value>,
        schema: &JSONSchemaProps,
    ) -> Option<bool> {
        let get = |field: &str| -> Option<Value> {
            object
                .get(field)
                .filter(|v| !v.is_null())
                .cloned()
                .or_else(|| schema.properties.as_ref()?.get(field)?.default.as_ref().map(|d| d.0.clone()))
        };
        let has = |field: &str| get(field).is_some();
        match rule {
            "has(self.name) != has(self.id)" => Some(has("name") != has("id")),
            "self.type == 'Pod' ? !has(self.networkName) : has(self.networkName)" => {
                let pod = get("type")?.as_str()? == "Pod";
                Some(if pod { !has("networkName") } else { has("networkName") })
            }
            "self.maxSeconds >= self.initialSeconds" => {
                Some(get("maxSeconds")?.as_i64()? >= get("initialSeconds")?.as_i64()?)
            }
            "(has(self.http) ? 1 : 0) + (has(self.guestAgent) ? 1 : 0) + (has(self.ip) ? 1 : 0) == 1" => {
                Some(["http", "guestAgent", "ip"].iter().filter(|f| has(f)).count() == 1)
            }
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// The CRD's patterns: a small regular-expression matcher (RE2 subset:
// literals, `.`, classes, groups, `|`, `* + ? {n,m}`, `^ $`) compiled to a
// Pike VM, so matching is linear and never recurses on the input.

mod pattern {
    #[derive(Debug)]
    enum Atom {
        Char(char),
        Any,
        Class { ranges: Vec<(char, char)>, negated: bool },
        Group(Vec<Vec<Piece>>),
        Start,
        End,
    }

    #[derive(Debug)]
    struct Piece {
        atom: Atom,
        min: usize,
        max: Option<usize>,
    }

    #[derive(Clone, Debug)]
    enum Inst {
        Char(char),
        Any,
        Class(usize),
        Split(usize, usize),
        Jmp(usize),
        AssertStart,
        AssertEnd,
        Match,
    }

    /// A compiled pattern; `None` from `compile` for syntax this subset lacks
    /// (the API server still checks those).
    #[derive(Debug)]
    pub(crate) struct Pattern {
        prog: Vec<Inst>,
        classes: Vec<(Vec<(char, char)>, bool)>,
    }

    const MAX_REPEAT: usize = 1000;

    impl Pattern {
        pub(crate) fn compile(source: &str) -> Option<Pattern> {
            let chars: Vec<char> = source.chars().collect();
            let mut pos = 0;
            let alternatives = parse_alternatives(&chars, &mut pos)?;
            if pos != chars.len() {
                return None;
            }
            let mut p = Pattern { prog: Vec::new(), classes: Vec::new() };
            p.emit_alternatives(&alternatives);
            p.prog.push(Inst::Match);
            Some(p)
        }

        /// Whether the pattern matches somewhere in `text` (Go's `MatchString`).
        pub(crate) fn is_match(&self, text: &str) -> bool {
            let input: Vec<char> = text.chars().collect();
            let len = input.len();
            let mut seen = vec![0usize; self.prog.len()];
            let mut generation = 1;
            let mut current = Vec::new();
            if self.add(&mut current, &mut seen, generation, 0, 0, len) {
                return true;
            }
            for (pos, c) in input.iter().enumerate() {
                generation += 1;
                let mut next = Vec::new();
                for &pc in &current {
                    if self.consumes(pc, *c)
                        && self.add(&mut next, &mut seen, generation, pc + 1, pos + 1, len)
                    {
                        return true;
                    }
                }
                // Unanchored search: a match may also start at the next position.
                if self.add(&mut next, &mut seen, generation, 0, pos + 1, len) {
                    return true;
                }
                current = next;
            }
            false
        }

        fn consumes(&self, pc: usize, c: char) -> bool {
            match &self.prog[pc] {
                Inst::Char(x) => *x == c,
                Inst::Any => c != '\n',
                Inst::Class(i) => {
                    let (ranges, negated) = &self.classes[*i];
                    ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&c)) != *negated
                }
                _ => false,
            }
        }

        /// Adds `pc` and everything reachable without input; true when that reaches `Match`.
        fn add(
            &self,
            list: &mut Vec<usize>,
            seen: &mut [usize],
            generation: usize,
            pc: usize,
            pos: usize,
            len: usize,
        ) -> bool {
            if seen[pc] == generation {
                return false;
            }
            seen[pc] = generation;
            match self.prog[pc] {
                Inst::Jmp(t) => self.add(list, seen, generation, t, pos, len),
                Inst::Split(a, b) => {
                    self.add(list, seen, generation, a, pos, len)
                        || self.add(list, seen, generation, b, pos, len)
                }
                Inst::AssertStart => pos == 0 && self.add(list, seen, generation, pc + 1, pos, len),
                Inst::AssertEnd => pos == len && self.add(list, seen, generation, pc + 1, pos, len),
                Inst::Match => true,
                _ => {
                    list.push(pc);
                    false
                }
            }
        }

        fn emit_alternatives(&mut self, alternatives: &[Vec<Piece>]) {
            let mut jumps = Vec::new();
            for (i, alternative) in alternatives.iter().enumerate() {
                if i + 1 < alternatives.len() {
                    let split = self.prog.len();
                    self.prog.push(Inst::Split(0, 0));
                    self.emit_sequence(alternative);
                    jumps.push(self.prog.len());
                    self.prog.push(Inst::Jmp(0));
                    self.prog[split] = Inst::Split(split + 1, self.prog.len());
                } else {
                    self.emit_sequence(alternative);
                }
            }
            let end = self.prog.len();
            for j in jumps {
                self.prog[j] = Inst::Jmp(end);
            }
        }

        fn emit_sequence(&mut self, pieces: &[Piece]) {
            for piece in pieces {
                for _ in 0..piece.min {
                    self.emit_atom(&piece.atom);
                }
                match piece.max {
                    None => {
                        let split = self.prog.len();
                        self.prog.push(Inst::Split(0, 0));
                        self.emit_atom(&piece.atom);
                        self.prog.push(Inst::Jmp(split));
                        self.prog[split] = Inst::Split(split + 1, self.prog.len());
                    }
                    Some(max) => {
                        for _ in piece.min..max {
                            let split = self.prog.len();
                            self.prog.push(Inst::Split(0, 0));
                            self.emit_atom(&piece.atom);
                            self.prog[split] = Inst::Split(split + 1, self.prog.len());
                        }
                    }
                }
            }
        }

        fn emit_atom(&mut self, atom: &Atom) {
            match atom {
                Atom::Char(c) => self.prog.push(Inst::Char(*c)),
                Atom::Any => self.prog.push(Inst::Any),
                Atom::Class { ranges, negated } => {
                    self.classes.push((ranges.clone(), *negated));
                    self.prog.push(Inst::Class(self.classes.len() - 1));
                }
                Atom::Group(alternatives) => self.emit_alternatives(alternatives),
                Atom::Start => self.prog.push(Inst::AssertStart),
                Atom::End => self.prog.push(Inst::AssertEnd),
            }
        }
    }

    fn parse_alternatives(c: &[char], pos: &mut usize) -> Option<Vec<Vec<Piece>>> {
        let mut alternatives = vec![parse_sequence(c, pos)?];
        while c.get(*pos) == Some(&'|') {
            *pos += 1;
            alternatives.push(parse_sequence(c, pos)?);
        }
        Some(alternatives)
    }

    fn parse_sequence(c: &[char], pos: &mut usize) -> Option<Vec<Piece>> {
        let mut pieces = Vec::new();
        while let Some(&ch) = c.get(*pos) {
            if ch == '|' || ch == ')' {
                break;
            }
            *pos += 1;
            let atom = match ch {
                '^' => Atom::Start,
                '$' => Atom::End,
                '.' => Atom::Any,
                '(' => {
                    if c.get(*pos) == Some(&'?') {
                        if c.get(*pos + 1) != Some(&':') {
                            return None;
                        }
                        *pos += 2;
                    }
                    let inner = parse_alternatives(c, pos)?;
                    if c.get(*pos) != Some(&')') {
                        return None;
                    }
                    *pos += 1;
                    Atom::Group(inner)
                }
                '[' => parse_class(c, pos)?,
                '\\' => {
                    let e = *c.get(*pos)?;
                    *pos += 1;
                    match escape_class(e) {
                        Some((ranges, negated)) => Atom::Class { ranges, negated },
                        None if e.is_ascii_alphanumeric() => return None,
                        None => Atom::Char(e),
                    }
                }
                '*' | '+' | '?' | '{' => return None,
                other => Atom::Char(other),
            };
            let (min, max) = parse_quantifier(c, pos)?;
            pieces.push(Piece { atom, min, max });
        }
        Some(pieces)
    }

    fn parse_quantifier(c: &[char], pos: &mut usize) -> Option<(usize, Option<usize>)> {
        let q = match c.get(*pos) {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                let close = c[*pos..].iter().position(|&x| x == '}')? + *pos;
                let body: String = c[*pos + 1..close].iter().collect();
                let (lo, hi) = match body.split_once(',') {
                    None => {
                        let n = body.parse().ok()?;
                        (n, Some(n))
                    }
                    Some((lo, "")) => (lo.parse().ok()?, None),
                    Some((lo, hi)) => (lo.parse().ok()?, Some(hi.parse().ok()?)),
                };
                if lo > MAX_REPEAT || hi.is_some_and(|h| h > MAX_REPEAT || h < lo) {
                    return None;
                }
                *pos = close;
                (lo, hi)
            }
            _ => return Some((1, Some(1))),
        };
        *pos += 1;
        // A lazy quantifier matches the same strings.
        if c.get(*pos) == Some(&'?') {
            *pos += 1;
        }
        Some(q)
    }

    fn parse_class(c: &[char], pos: &mut usize) -> Option<Atom> {
        let negated = c.get(*pos) == Some(&'^');
        if negated {
            *pos += 1;
        }
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let ch = *c.get(*pos)?;
            *pos += 1;
            if ch == ']' && !first {
                break;
            }
            first = false;
            let lo = match ch {
                '[' if c.get(*pos) == Some(&':') => return None,
                '\\' => {
                    let e = *c.get(*pos)?;
                    *pos += 1;
                    match escape_class(e) {
                        Some((more, false)) => {
                            ranges.extend(more);
                            continue;
                        }
                        Some((_, true)) => return None,
                        None if e.is_ascii_alphanumeric() => return None,
                        None => e,
                    }
                }
                other => other,
            };
            if c.get(*pos) == Some(&'-') && c.get(*pos + 1).is_some_and(|&n| n != ']') {
                let hi = *c.get(*pos + 1)?;
                if hi == '\\' || hi < lo {
                    return None;
                }
                *pos += 2;
                ranges.push((lo, hi));
            } else {
                ranges.push((lo, lo));
            }
        }
        Some(Atom::Class { ranges, negated })
    }

    fn escape_class(e: char) -> Option<(Vec<(char, char)>, bool)> {
        let digits = vec![('0', '9')];
        let word = vec![('0', '9'), ('A', 'Z'), ('_', '_'), ('a', 'z')];
        let space = vec![('\t', '\n'), ('\x0c', '\r'), (' ', ' ')];
        match e {
            'd' => Some((digits, false)),
            'D' => Some((digits, true)),
            'w' => Some((word, false)),
            'W' => Some((word, true)),
            's' => Some((space, false)),
            'S' => Some((space, true)),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// Names

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
fn is_dns_subdomain(s: &str) -> bool {
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
fn check_metadata(meta: &Value, partial: bool, out: &mut Vec<Finding>) {
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

fn check_string_map(which: &str, value: &Value, path: &[Seg], out: &mut Vec<Finding>) {
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
            let Some(parsed) = parse_file(file, &mut self.errors) else {
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

        let providers = self.providers(&docs, &provider_docs);
        let mut accepted = Vec::new();
        for &m in &manifests {
            let chain: Vec<&str> = folder_chain(&docs[m].path);
            if chain.iter().any(|dir| broken_defaults.contains(*dir)) {
                // Its defaults did not parse (reported); checking it without them would only add noise.
                continue;
            }
            let chain_docs: Vec<usize> =
                chain.iter().rev().filter_map(|dir| defaults.get(*dir).copied()).collect();
            if let Some(a) =
                self.manifest(&docs, m, &chain_docs, &providers, &broken_providers, provenance, opts)
            {
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
                spec.retain(|k, _| PROVIDER_FIELDS.contains(&k.as_str()));
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

    #[allow(clippy::too_many_arguments)]
    fn manifest(
        &mut self,
        docs: &[Doc],
        m: usize,
        chain: &[usize],
        providers: &BTreeMap<String, Provider>,
        broken_providers: &[String],
        provenance: &Provenance,
        opts: &RenderOptions,
    ) -> Option<Accepted> {
        let doc = &docs[m];
        let raw = doc.value.as_object()?;
        let mut errors = Vec::new();

        // What this document is.
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
        if !errors.is_empty() {
            self.errors.extend(errors);
            return None;
        }

        // Defaults beneath the manifest, nearest folder over its parents.
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
        let provider_name = merged.pointer("/spec/source/provider").cloned();
        let mut provider_unresolved = false;
        if let Some(name_value) = provider_name {
            match name_value.as_str().and_then(|n| providers.get(n)) {
                Some(provider) => {
                    if let Some(Value::Object(source)) = merged.pointer_mut("/spec/source") {
                        source.remove("provider");
                        let mut resolved = provider.spec.clone();
                        overlay(&mut resolved, source);
                        *source = resolved;
                    }
                    layers.push(Layer { doc: &docs[provider.doc], provider: true });
                }
                None => {
                    provider_unresolved = true;
                    let known: Vec<&str> = providers.keys().map(String::as_str).collect();
                    let mut message = match name_value.as_str() {
                        Some(n) if known.is_empty() => {
                            format!("unknown provider {n:?}: providers/ defines none")
                        }
                        Some(n) => format!("unknown provider {n:?} (known: {})", known.join(", ")),
                        None => format!(
                            "must be the name of a provider in providers/ (got {})",
                            shown(&name_value)
                        ),
                    };
                    if !broken_providers.is_empty() {
                        message.push_str(&format!("; {} could not be read", broken_providers.join(", ")));
                    }
                    findings.push(finding(segs(&["spec", "source", "provider"]), message));
                }
            }
        }

        match merged.get("spec") {
            None => findings.push(Finding {
                path: segs(&["spec"]),
                message: "is required".to_owned(),
                blame: Blame::Manifest,
            }),
            Some(spec) if !provider_unresolved => {
                let mut walk = SchemaWalk { mode: Mode::Full, allow_provider: false, findings: Vec::new() };
                walk.walk(spec, spec_schema(), &mut vec![key("spec")]);
                findings.extend(walk.findings);
            }
            Some(_) => {}
        }

        // The destination VM is named after the migration unless spec.destination.name is set.
        let name = merged.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
        let destination_name =
            merged.pointer("/spec/destination/name").and_then(Value::as_str).map(str::to_owned);
        if destination_name.is_none()
            && !name.is_empty()
            && is_dns_subdomain(&name)
            && (!is_dns_label(&name) || name.len() > MAX_DESTINATION_NAME)
        {
            findings.push(finding(
                segs(&["metadata", "name"]),
                format!(
                    "is also the destination VM's name (spec.destination.name is not set), which must be a lowercase RFC 1123 label (no dots) of at most {MAX_DESTINATION_NAME} characters; set spec.destination.name"
                ),
            ));
        }
        let namespace = merged
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or(&opts.default_namespace)
            .to_owned();
        if merged.pointer("/metadata/namespace").is_none() && !is_dns_label(&namespace) {
            findings.push(Finding {
                path: segs(&["metadata", "namespace"]),
                message: format!(
                    "is not set, and the default namespace {namespace:?} is not a valid namespace"
                ),
                blame: Blame::Manifest,
            });
        }

        if !findings.is_empty() {
            self.errors.extend(findings.iter().map(|f| attribute(f, &layers)));
            return None;
        }

        // The object as it is applied.
        let mut meta = Map::new();
        meta.insert("name".into(), Value::String(name.clone()));
        meta.insert("namespace".into(), Value::String(namespace.clone()));
        let mut labels =
            merged.pointer("/metadata/labels").and_then(Value::as_object).cloned().unwrap_or_default();
        labels.insert(LABEL_GITOPS.into(), Value::String("true".into()));
        meta.insert("labels".into(), Value::Object(labels));
        let mut annotations =
            merged.pointer("/metadata/annotations").and_then(Value::as_object).cloned().unwrap_or_default();
        annotations.insert(ANNOTATION_REPO.into(), Value::String(provenance.repo_url.clone()));
        annotations.insert(ANNOTATION_COMMIT.into(), Value::String(provenance.commit.clone()));
        annotations.insert(ANNOTATION_PATH.into(), Value::String(doc.path.clone()));
        meta.insert("annotations".into(), Value::Object(annotations));
        let mut object = Map::new();
        object.insert("apiVersion".into(), Value::String(api_version));
        object.insert("kind".into(), Value::String(MIGRATION_KIND.into()));
        object.insert("metadata".into(), Value::Object(meta));
        object.insert("spec".into(), merged.get("spec").cloned().unwrap_or_default());
        let object = Value::Object(object);

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
        let source = &typed.spec.source;
        let vm = match (&source.vm.name, &source.vm.id) {
            (Some(n), _) => format!("name {n:?}"),
            (None, Some(id)) => format!("vmid {id}"),
            (None, None) => String::new(),
        };
        Some(Accepted {
            doc: m,
            source_key: format!("{} on {}:{}", vm, source.host.to_ascii_lowercase(), source.port),
            destination_key: format!(
                "{}/{}",
                typed.spec.destination.namespace,
                destination_name.as_deref().unwrap_or(&name)
            ),
            rendered: RenderedMigration {
                path: doc.path.clone(),
                doc_index: doc.doc_index,
                name,
                namespace,
                object,
            },
        })
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
mod tests {
    use super::*;

    const HOST_KEY: &str = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s";

    fn file(path: &str, text: &str) -> RepoFile {
        RepoFile { path: path.to_owned(), bytes: text.as_bytes().to_vec() }
    }

    fn manifest(name: &str, vm: &str) -> String {
        format!(
            "apiVersion: migration.platform.example/v1alpha1\nkind: VirtualMachineMigration\nmetadata:\n  name: {name}\nspec:\n  source:\n    host: esxi01\n    hostKey: {HOST_KEY}\n    credentialsSecretRef:\n      name: creds\n    vm:\n      name: {vm}\n  destination:\n    namespace: apps\n    storageClassName: standard\n"
        )
    }

    fn render_files(files: &[RepoFile]) -> Result<Vec<RenderedMigration>, Vec<RenderError>> {
        render(
            files,
            &Provenance { repo_url: "file:///repo".into(), commit: "abc".into() },
            &RenderOptions::default(),
        )
    }

    fn errors_of(files: &[RepoFile]) -> Vec<String> {
        render_files(files).err().unwrap_or_default().iter().map(ToString::to_string).collect()
    }

    fn p(s: &str) -> Vec<Seg> {
        // "spec.networkMap[1].type" → segments (tests only use plain keys).
        let mut out = Vec::new();
        for part in s.split('.') {
            let (name, rest) = part.split_once('[').unwrap_or((part, ""));
            out.push(key(name));
            for idx in rest.split('[').filter(|x| !x.is_empty()) {
                out.push(Seg::Index(idx.trim_end_matches(']').parse().unwrap()));
            }
        }
        out
    }

    #[test]
    fn line_index_finds_keys_list_items_and_nested_fields() {
        let text = "\
# comment
apiVersion: v1
metadata:
  name: a   # trailing
spec:
  source:
    hostKey: x
  networkMap:
    - source: VM Network
      type: Pod
    - source: Storage
      type: Multus
      networkName: storage
  validation:
    checks:
    - name: home
      http:
        service: web
";
        let idx = LineIndex::build(text, 1);
        assert_eq!(idx.line_of(&p("apiVersion")), 2);
        assert_eq!(idx.line_of(&p("metadata.name")), 4);
        assert_eq!(idx.line_of(&p("spec.source.hostKey")), 7);
        assert_eq!(idx.line_of(&p("spec.networkMap[0]")), 9);
        assert_eq!(idx.line_of(&p("spec.networkMap[1].type")), 12);
        assert_eq!(idx.line_of(&p("spec.networkMap[1].networkName")), 13);
        // A list at the same indentation as its key (compact style).
        assert_eq!(idx.line_of(&p("spec.validation.checks[0].http.service")), 18);
        // Missing fields fall back to the nearest ancestor, then the first line.
        assert_eq!(idx.line_of(&p("spec.source.port")), 6);
        assert_eq!(idx.line_of(&p("status")), 2);
        assert_eq!(idx.first(), 2);
    }

    #[test]
    fn line_index_skips_block_scalars_and_offsets_documents() {
        let text = "a:\n  script: |\n    not: a key\n    - nor an item\n  after: 1\n- x\n";
        let idx = LineIndex::build(text, 10);
        assert_eq!(idx.line_of(&p("a.script")), 11);
        assert_eq!(idx.line_of(&p("a.after")), 14);
        assert_eq!(idx.line_of(&p("a.script.not")), 11);
    }

    #[test]
    fn line_index_handles_quoted_keys_and_nested_sequences() {
        let text = "metadata:\n  annotations:\n    \"example.com/owner\": team\n    'it''s': x\nm:\n- - a: 1\n  - b: 2\n";
        let idx = LineIndex::build(text, 1);
        let owner = vec![key("metadata"), key("annotations"), key("example.com/owner")];
        assert_eq!(idx.line_of(&owner), 3);
        assert_eq!(idx.line_of(&[key("metadata"), key("annotations"), key("it's")]), 4);
        assert_eq!(idx.line_of(&[key("m"), Seg::Index(0), Seg::Index(1), key("b")]), 7);
        assert_eq!(format_path(&owner), "metadata.annotations[\"example.com/owner\"]");
    }

    #[test]
    fn a_repeated_key_is_reported_at_its_second_line() {
        let text = format!(
            "# x\n---\n{}",
            manifest("a", "b").replace(
                "    storageClassName: standard\n",
                "    storageClassName: standard\n    namespace: other\n"
            )
        );
        assert_eq!(
            errors_of(&[file("migrations/a.yaml", &text)]),
            vec!["migrations/a.yaml:18: spec.destination.namespace: is written twice in the same mapping"]
        );
    }

    #[test]
    fn documents_are_split_at_markers_with_their_file_lines() {
        let text = "# only a comment\n---\na: 1\n---\n# empty\n---\nb: 2\n...\n--- {c: 3}\n";
        let chunks = split_documents(text);
        assert_eq!(chunks.iter().map(|c| c.first_line).collect::<Vec<_>>(), vec![2, 6, 9]);
        let values: Vec<serde_yaml::Value> =
            chunks.iter().map(|c| serde_yaml::from_str(&c.text).unwrap()).collect();
        assert_eq!(values[2]["c"], serde_yaml::Value::from(3));
    }

    #[test]
    fn patterns_of_the_crd_match_like_re2() {
        let host_key = pattern::Pattern::compile(r"^SHA256:[A-Za-z0-9+/]{43}=?$").unwrap();
        assert!(host_key.is_match(HOST_KEY));
        assert!(host_key.is_match(&format!("{HOST_KEY}=")));
        assert!(!host_key.is_match("SHA256:short"));
        assert!(!host_key.is_match(&format!("{HOST_KEY}xx")));
        let label = pattern::Pattern::compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$").unwrap();
        for ok in ["a", "web-01", "0a"] {
            assert!(label.is_match(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "Web", "a.b", "a_b"] {
            assert!(!label.is_match(bad), "{bad}");
        }
        let quantity = pattern::Pattern::compile(r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$").unwrap();
        assert!(quantity.is_match("4Gi") && quantity.is_match("512") && !quantity.is_match("4GB"));
        let vmid = pattern::Pattern::compile(r"^[0-9]{1,9}$").unwrap();
        assert!(vmid.is_match("1") && vmid.is_match("123456789") && !vmid.is_match("1234567890"));
        let slash = pattern::Pattern::compile("^/").unwrap();
        assert!(slash.is_match("/health") && !slash.is_match("health"));
        let unanchored = pattern::Pattern::compile(r"b\d+|x(?:y|z)*").unwrap();
        assert!(unanchored.is_match("aab12") && unanchored.is_match("x") && !unanchored.is_match("ab"));
        // Syntax outside the subset is left to the API server.
        assert!(pattern::Pattern::compile(r"\p{L}").is_none());
        assert!(pattern::Pattern::compile("(a").is_none());
        // Long input: linear, no recursion on the input.
        assert!(label.is_match(&"a".repeat(100_000)));
    }

    #[test]
    fn every_cel_rule_of_the_crd_is_mirrored() {
        fn visit(s: &JSONSchemaProps, found: &mut Vec<String>) {
            found.extend(s.x_kubernetes_validations.iter().flatten().map(|r| r.rule.clone()));
            s.properties.iter().flat_map(|p| p.values()).for_each(|c| visit(c, found));
            if let Some(JSONSchemaPropsOrArray::Schema(items)) = &s.items {
                visit(items, found);
            }
        }
        let mut found = Vec::new();
        visit(spec_schema(), &mut found);
        assert!(found.len() >= 4, "{found:?}");
        for rule in found {
            assert!(cel::MIRRORED.contains(&rule.as_str()), "CEL rule not mirrored in render.rs: {rule}");
        }
    }

    #[test]
    fn cel_rules_see_schema_defaults() {
        let m = manifest("a", "a")
            .replace("  destination:", "  strategy:\n    backoff:\n      maxSeconds: 5\n  destination:");
        let errors = errors_of(&[file("migrations/a.yaml", &m)]);
        assert_eq!(
            errors,
            vec![
                "migrations/a.yaml:14: spec.strategy.backoff: backoff.maxSeconds must be at least initialSeconds"
            ]
        );
    }

    #[test]
    fn error_display_leaves_out_missing_parts() {
        let e = RenderError { path: "p".into(), line: None, field: None, message: "m".into() };
        assert_eq!(e.to_string(), "p: m");
        let e = RenderError { path: "p".into(), line: Some(3), field: Some("f".into()), message: "m".into() };
        assert_eq!(e.to_string(), "p:3: f: m");
    }

    #[test]
    fn a_minimal_manifest_renders_with_provenance_and_the_gitops_label() {
        let out = render_files(&[file("migrations/a.yaml", &manifest("a", "vm a"))]).unwrap();
        assert_eq!(out.len(), 1);
        let obj = &out[0].object;
        assert_eq!(out[0].namespace, DEFAULT_NAMESPACE);
        assert_eq!(obj["metadata"]["labels"][LABEL_GITOPS], "true");
        assert_eq!(obj["metadata"]["annotations"][ANNOTATION_COMMIT], "abc");
        assert_eq!(obj["metadata"]["annotations"][ANNOTATION_PATH], "migrations/a.yaml");
        assert_eq!(obj["metadata"]["annotations"][ANNOTATION_REPO], "file:///repo");
    }

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
    fn null_in_a_manifest_unsets_a_default() {
        let defaults = "spec:\n  destination:\n    memory: 4Gi\n";
        let m = manifest("a", "a")
            .replace("    storageClassName: standard\n", "    storageClassName: standard\n    memory:\n");
        let out = render_files(&[file("migrations/defaults.yaml", defaults), file("migrations/a.yaml", &m)])
            .unwrap();
        assert!(out[0].object["spec"]["destination"].get("memory").is_none());
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
    }

    #[test]
    fn other_files_are_ignored_and_providers_must_be_top_level() {
        assert_eq!(classify("README.md"), FileKind::Ignored);
        assert_eq!(classify("status/vmmigrate/a.yaml"), FileKind::Ignored);
        assert_eq!(classify("migrations/notes.txt"), FileKind::Ignored);
        assert_eq!(classify("migrations/a/defaults.yml"), FileKind::Defaults { dir: "migrations/a".into() });
        assert_eq!(classify("providers/x.yaml"), FileKind::Provider);
        assert_eq!(classify("providers/old/x.yaml"), FileKind::Ignored);
        assert_eq!(
            folder_chain("migrations/a/b/x.yaml"),
            vec!["migrations", "migrations/a", "migrations/a/b"]
        );
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
    fn a_list_item_from_defaults_missing_a_field_is_reported_at_the_defaults_file() {
        let defaults = "spec:\n  networkMap:\n    - source: VM Network\n";
        let errors = errors_of(&[
            file("migrations/defaults.yaml", defaults),
            file("migrations/a.yaml", &manifest("a", "b")),
        ]);
        assert_eq!(errors, vec!["migrations/defaults.yaml:3: spec.networkMap[0].type: is required"]);
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
