//! Line index: serde_yaml 0.9 has no spans per value, so the lines of keys are
//! found by a small scanner for block-style YAML.

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
                bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' ' || bytes[i + 1] == b'\t')
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

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use super::super::*;
    use super::*;

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
}
