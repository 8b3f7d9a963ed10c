//! Documents: splitting files into YAML documents, parsing them, and locating
//! their errors.

use super::*;

/// One non-empty YAML document of one file.
pub(super) struct Doc {
    pub(super) path: String,
    pub(super) doc_index: usize,
    pub(super) value: Value,
    pub(super) lines: LineIndex,
}

impl Doc {
    pub(super) fn error(&self, path: &[Seg], message: impl Into<String>) -> RenderError {
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

/// Parses one file into its documents within `limits` (`tree_nodes`: the
/// nodes of the commit's files parsed so far); syntax errors and a budget
/// overrun carry the file's line.
pub(super) fn parse_file(
    file: &RepoFile,
    limits: &TreeLimits,
    tree_nodes: &mut u64,
    errors: &mut Vec<RenderError>,
) -> Option<Vec<Doc>> {
    if file.bytes.len() as u64 > limits.file_bytes {
        errors.push(RenderError {
            path: file.path.clone(),
            line: None,
            field: None,
            message: format!(
                "is {} bytes, more than the limit of {} (--max-file-bytes)",
                file.bytes.len(),
                limits.file_bytes
            ),
        });
        return None;
    }
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
        // The guard first: serde_yaml sees only documents within the budget.
        let left = limits.tree_nodes.saturating_sub(*tree_nodes);
        let budget = DocBudget { depth: limits.yaml_depth, nodes: limits.doc_nodes.min(left) };
        let lines = match LineIndex::build_within(&chunk.text, chunk.first_line, budget) {
            Ok((lines, nodes)) => {
                *tree_nodes += nodes;
                lines
            }
            Err(over) => {
                let message = if left < limits.doc_nodes && over.message.contains("nodes") {
                    format!(
                        "brings the commit past the limit of {} YAML nodes, aliases expanded (--max-repo-yaml-nodes)",
                        limits.tree_nodes
                    )
                } else {
                    format!(
                        "{} ({})",
                        over.message,
                        if over.message.contains("nest") { "--max-yaml-depth" } else { "--max-yaml-nodes" }
                    )
                };
                errors.push(RenderError {
                    path: file.path.clone(),
                    line: Some(over.line),
                    field: None,
                    message: format!("YAML document {}: {message}", doc_index + 1),
                });
                *tree_nodes = limits.tree_nodes.min(*tree_nodes + budget.nodes);
                ok = false;
                continue;
            }
        };
        let yaml = match serde_yaml::from_str::<serde_yaml::Value>(&chunk.text) {
            Ok(v) => v,
            Err(err) => {
                errors.push(syntax_error(&file.path, &chunk, &lines, err));
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

fn syntax_error(path: &str, chunk: &Chunk, lines: &LineIndex, err: serde_yaml::Error) -> RenderError {
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
        .and_then(|k| lines.repeated_key(&k).map(|(p, l)| (format_path(p), l)));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_split_at_markers_with_their_file_lines() {
        let text = "# only a comment\n---\na: 1\n---\n# empty\n---\nb: 2\n...\n--- {c: 3}\n";
        let chunks = split_documents(text);
        assert_eq!(chunks.iter().map(|c| c.first_line).collect::<Vec<_>>(), vec![2, 6, 9]);
        let values: Vec<serde_yaml::Value> =
            chunks.iter().map(|c| serde_yaml::from_str(&c.text).unwrap()).collect();
        assert_eq!(values[2]["c"], serde_yaml::Value::from(3));
    }
}
