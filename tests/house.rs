//! The shape of the tree, read from the sources: which module may import
//! which (docs/architecture.md, "Imports run one way"), and that every
//! `cargo test --test …`, `cargo bench --bench …` and `--example …` the
//! documents tell a reader to run names a target that exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn files_under(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if !path.ends_with("target")
                && !path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'))
            {
                files_under(&path, ext, out);
            }
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// The code of a source file without its comments and unit tests
/// (everything from the first `#[cfg(test)]` on: the tree keeps them at the
/// end of a file).
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let code = match text.find("#[cfg(test)]") {
        Some(at) => &text[..at],
        None => &text,
    };
    // A comment line stays, empty: line numbers are the file's.
    code.lines().map(|l| if l.trim_start().starts_with("//") { "" } else { l }).collect::<Vec<_>>().join("\n")
}

/// The top-level modules a file names as `crate::<module>::`.
fn imported_modules(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue; // `vmmigrate_crate::`, not a path of ours
        }
        let rest = &code[at + "crate::".len()..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if !name.is_empty() {
            found.insert(name);
        }
    }
    found
}

/// What each layer may import besides itself (docs/architecture.md).
fn allowed(module: &str) -> &'static [&'static str] {
    const BELOW_ADAPTERS: &[&str] = &["objects", "images", "ports", "machine", "api", "metrics", "server"];
    match module {
        "api" => &[],
        "machine" => &["api"],
        "ports" => &["machine", "api", "metrics"],
        "objects" => &["ports", "machine", "api"],
        "images" => &[],
        "source" | "convert" | "destination" | "gitops" => BELOW_ADAPTERS,
        _ => unreachable!("{module} is not a layer this test knows"),
    }
}

#[test]
fn no_adapter_imports_another_adapter_or_anything_above_it() {
    let mut broken = Vec::new();
    for module in
        ["api", "machine", "ports", "objects", "images", "source", "convert", "destination", "gitops"]
    {
        let mut files = Vec::new();
        let dir = root().join("src").join(module);
        files_under(&dir, "rs", &mut files);
        assert!(!files.is_empty(), "no sources under {}", dir.display());
        for file in files {
            for imported in imported_modules(&code_of(&file)) {
                if imported != module && !allowed(module).contains(&imported.as_str()) {
                    broken.push(format!(
                        "{} imports crate::{imported}",
                        file.strip_prefix(root()).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "imports against docs/architecture.md:\n  {}", broken.join("\n  "));
}

#[test]
fn the_import_reader_sees_paths_and_skips_unit_tests() {
    let code = "//! see crate::machine\nuse crate::api::Phase;\nfn f() { crate::ports::x(); my_crate::gitops::y(); }\n#[cfg(test)]\nmod tests { use crate::gitops; }\n";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.rs");
    std::fs::write(&file, code).unwrap();
    let seen: Vec<String> = imported_modules(&code_of(&file)).into_iter().collect();
    assert_eq!(seen, ["api", "ports"]);
}

/// The targets Cargo.toml declares (`[[test]]`, `[[bench]]` names, by
/// kind), and the harness crate's examples.
fn targets() -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let mut kind: Option<&str> = None;
    for line in manifest.lines().map(str::trim) {
        if let Some(table) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
            kind = Some(table);
        } else if line.starts_with('[') {
            kind = None;
        } else if let (Some(k), Some(value)) = (kind, line.strip_prefix("name = ")) {
            out.insert((k.to_owned(), value.trim_matches('"').to_owned()));
        }
    }
    let mut examples = Vec::new();
    files_under(&root().join("tools/harness/examples"), "rs", &mut examples);
    for e in examples {
        out.insert(("example".into(), e.file_stem().unwrap().to_string_lossy().into_owned()));
    }
    out
}

#[test]
fn every_cargo_command_the_documents_name_runs_a_target_that_exists() {
    let targets = targets();
    assert!(targets.contains(&("test".into(), "integration".into())), "{targets:?}");
    let mut documents = Vec::new();
    for dir in ["docs", "deploy", "examples-repo", "tools", "tests", "src"] {
        files_under(&root().join(dir), "md", &mut documents);
        files_under(&root().join(dir), "rs", &mut documents);
        files_under(&root().join(dir), "sh", &mut documents);
    }
    documents.push(root().join("README.md"));
    let mut wrong = Vec::new();
    let mut seen = 0;
    for document in &documents {
        let text = std::fs::read_to_string(document).unwrap();
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            for pair in words.windows(2) {
                let kind = match pair[0] {
                    "--test" => "test",
                    "--bench" => "bench",
                    "--example" => "example",
                    _ => continue,
                };
                if !line.contains("cargo ") {
                    continue;
                }
                let name: String =
                    pair[1].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-').collect();
                if name.is_empty() {
                    continue;
                }
                seen += 1;
                if !targets.contains(&(kind.to_owned(), name.clone())) {
                    wrong.push(format!(
                        "{}: --{kind} {name}",
                        document.strip_prefix(root()).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(seen > 10, "the documents name {seen} commands: the reader is broken");
    assert!(wrong.is_empty(), "commands naming no target:\n  {}", wrong.join("\n  "));
}

/// `pub` items outside `api/` that nothing outside `src/` names, public only
/// because a public item's signature holds them: rustc refuses them narrower
/// (`private_interfaces`).
const IN_PUBLIC_SIGNATURES: &[&str] = &[
    "ApplyReport",
    "ChainError",
    "ChainLevel",
    "ConvertingFacts",
    "Decision",
    "DemoOptions",
    "EventType",
    "FleetGates",
    "GitopsHandle",
    "ImageInfo",
    "MapRange",
    "Member",
    "MetricsServer",
    "PlanEntry",
    "PullRequest",
    "QemuError",
    "Queue",
    "RuleError",
    "ServeOptions",
    "ServeStats",
    "SnapshotInfo",
    "Step",
    "TenancyOptions",
    "TreeLimitFlags",
    "UnknownFormat",
    "VolumeDigest",
    "Wait",
    "WebhookStats",
    "WorkerIdentity",
];

/// The `pub` items (`fn`, type, trait, `const`, `static`, `mod`) a file
/// declares, as `(line, name)`; `pub(crate)` and narrower are not `pub`.
fn public_items(code: &str) -> Vec<(usize, String)> {
    const KINDS: &[&str] = &["fn ", "struct ", "enum ", "trait ", "type ", "const ", "static ", "mod "];
    let mut items = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let Some(mut rest) = line.trim_start().strip_prefix("pub ") else { continue };
        for qualifier in ["async ", "unsafe "] {
            rest = rest.strip_prefix(qualifier).unwrap_or(rest);
        }
        let Some(kind) = KINDS.iter().find(|k| rest.starts_with(**k)) else { continue };
        let name: String =
            rest[kind.len()..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        items.push((n + 1, name));
    }
    items
}

/// Every word of the code that uses the library from outside: the tests
/// (but this one), benches, harness and fuzz targets, `main.rs`, and the
/// fuzzing entry points.
fn words_used_outside() -> BTreeSet<String> {
    let mut files = vec![root().join("src/main.rs")];
    for dir in ["tests", "benches", "tools/harness", "tools/fuzz"] {
        files_under(&root().join(dir), "rs", &mut files);
    }
    // This file names items to list them, not to use them.
    files.retain(|f| !f.ends_with("tests/house.rs"));
    let mut text: Vec<String> = files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect();
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    text.push(lib[lib.find("pub mod fuzzing").expect("the fuzzing module")..].to_owned());
    let mut words = BTreeSet::new();
    for t in &text {
        words.extend(t.split(|c: char| !(c.is_alphanumeric() || c == '_')).map(str::to_owned));
    }
    words
}

/// The surface is what is used: an item that only the crate uses is
/// `pub(crate)` (or narrower), so a reader sees at its declaration that
/// nothing outside depends on it.
#[test]
fn every_public_item_outside_api_is_used_outside_the_crate_or_held_by_a_public_signature() {
    let used = words_used_outside();
    let mut files = Vec::new();
    files_under(&root().join("src"), "rs", &mut files);
    let mut unused = Vec::new();
    let mut declared = BTreeSet::new();
    for file in files {
        let rel = file.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        if rel.starts_with("src/api/") || rel == "src/lib.rs" || rel == "src/main.rs" {
            continue;
        }
        for (line, name) in public_items(&code_of(&file)) {
            declared.insert(name.clone());
            if !used.contains(&name) && !IN_PUBLIC_SIGNATURES.contains(&name.as_str()) {
                unused.push(format!("{rel}:{line}: pub {name}"));
            }
        }
    }
    assert!(
        unused.is_empty(),
        "public, yet named nowhere outside src/: make these pub(crate):\n{}",
        unused.join("\n")
    );
    let stale: Vec<&&str> =
        IN_PUBLIC_SIGNATURES.iter().filter(|n| !declared.contains(**n) || used.contains(**n)).collect();
    assert!(
        stale.is_empty(),
        "IN_PUBLIC_SIGNATURES lists items no longer declared pub or now used: {stale:?}"
    );
}

#[test]
fn the_public_item_reader_sees_pub_but_not_pub_crate() {
    let code = "pub fn a() {}\npub(crate) fn b() {}\n    pub async fn c() {}\npub struct D;\nfn e() {}\n";
    let names: Vec<String> = public_items(code).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, ["a", "c", "D"]);
}
