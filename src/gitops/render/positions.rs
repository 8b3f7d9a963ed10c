//! Line index: serde_yaml 0.9 gives no span per value, so the lines of keys
//! come from the events of a second, position-reporting parser (yaml-rust2).
//! The events are read once, aliases are not expanded, and nothing is
//! allocated per event beyond the path being walked.
//!
//! The same walk is the guard in front of serde_yaml: it runs first and stops
//! at the first node past the document's budget (nesting depth, and nodes
//! counted as serde_yaml would build them, every alias expanded: a "billion
//! laughs" document is refused after its first few KB instead of growing to
//! gigabytes), so serde_yaml only ever sees documents of bounded size.

use super::{Seg, format_path};
use std::collections::{HashMap, HashSet};
use yaml_rust2::parser::{Event, Parser};

/// Field path → 1-based line of its key (or of the first token of a list item).
#[derive(Clone, Debug, Default)]
pub(super) struct LineIndex {
    keys: HashMap<String, usize>,
    /// Keys seen a second time in the same mapping (a YAML error): (key, path, line).
    repeated: Vec<(String, Vec<Seg>, usize)>,
    first: usize,
}

/// Where the walk is inside one open collection.
enum Open {
    /// A mapping: the next scalar is a key when `key` is `None`; once read,
    /// the key is held until its value has been walked. `seen` holds this
    /// mapping's keys, to find a repeated one.
    Mapping {
        key: Option<String>,
        seen: HashSet<String>,
    },
    Sequence {
        next: usize,
    },
    /// A complex key (`? [a, b]: …`) is walked over, not indexed.
    Skipped,
}

/// How much one document may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DocBudget {
    /// Open collections at once.
    pub(super) depth: usize,
    /// Nodes (scalars, mappings, sequences), every alias counted as the nodes it stands for.
    pub(super) nodes: u64,
}

/// A document past its budget: the line of the node that went over, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct OverBudget {
    pub(super) line: usize,
    pub(super) message: String,
}

/// The budget's half of the walk: nodes so far, aliases expanded; per open
/// collection its anchor and the count when it opened; per anchor the nodes
/// it stands for.
struct NodeCount {
    budget: DocBudget,
    nodes: u64,
    anchored: Vec<(usize, u64)>,
    anchor_nodes: HashMap<usize, u64>,
}

impl NodeCount {
    /// Counts one event; past the budget, the line and why.
    fn count(&mut self, event: &Event, line: usize) -> Result<(), OverBudget> {
        match event {
            Event::Alias(id) => {
                self.nodes = self.nodes.saturating_add(self.anchor_nodes.get(id).copied().unwrap_or(1));
            }
            Event::Scalar(_, _, anchor, _) => {
                self.nodes += 1;
                if *anchor > 0 {
                    self.anchor_nodes.insert(*anchor, 1);
                }
            }
            Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                self.nodes += 1;
                self.anchored.push((*anchor, self.nodes));
                if self.anchored.len() > self.budget.depth {
                    return Err(OverBudget {
                        line,
                        message: format!("nests deeper than {} levels (the limit)", self.budget.depth),
                    });
                }
            }
            Event::MappingEnd | Event::SequenceEnd => {
                if let Some((anchor, start)) = self.anchored.pop()
                    && anchor > 0
                {
                    self.anchor_nodes.insert(anchor, self.nodes - start + 1);
                }
            }
            _ => {}
        }
        if self.nodes > self.budget.nodes {
            let through = if self.anchor_nodes.is_empty() { "" } else { ", aliases expanded" };
            return Err(OverBudget {
                line,
                message: format!("holds more than {} YAML nodes{through} (the limit)", self.budget.nodes),
            });
        }
        Ok(())
    }
}

/// The index's half of the walk: the open collections and the path to the
/// node being read (one segment per open collection that has a current key
/// or item).
struct Walk {
    index: LineIndex,
    open: Vec<Open>,
    path: Vec<Seg>,
}

impl Walk {
    /// Takes one event at `line`; breaks at the end of the stream.
    fn visit(&mut self, event: Event, line: usize) -> std::ops::ControlFlow<()> {
        use std::ops::ControlFlow::{Break, Continue};
        let starts_node = matches!(
            event,
            Event::Scalar(..) | Event::Alias(_) | Event::MappingStart(..) | Event::SequenceStart(..)
        );
        if starts_node && self.index.first == 0 {
            self.index.first = line;
        }
        if starts_node && self.open.iter().any(|o| matches!(o, Open::Skipped)) {
            if matches!(event, Event::MappingStart(..) | Event::SequenceStart(..)) {
                self.open.push(Open::Skipped);
            }
            return Continue(());
        }
        if matches!(self.open.last(), Some(Open::Mapping { key: None, .. })) {
            match event {
                Event::Scalar(ref value, ..) => {
                    self.key(value, line);
                    return Continue(());
                }
                Event::MappingStart(..) | Event::SequenceStart(..) | Event::Alias(_) => {
                    // A collection or an alias as a key: not a field name; its
                    // value is indexed under an empty key.
                    if let Some(Open::Mapping { key, .. }) = self.open.last_mut() {
                        *key = Some(String::new());
                    }
                    self.path.push(Seg::Key(String::new()));
                    if !matches!(event, Event::Alias(_)) {
                        self.open.push(Open::Skipped);
                    }
                    return Continue(());
                }
                _ => {}
            }
        }
        if starts_node && let Some(Open::Sequence { next }) = self.open.last_mut() {
            self.path.push(Seg::Index(*next));
            *next += 1;
            self.index.keys.entry(format_path(&self.path)).or_insert(line);
        }
        match event {
            Event::MappingStart(..) => {
                self.open.push(Open::Mapping { key: None, seen: HashSet::new() });
                return Continue(());
            }
            Event::SequenceStart(..) => {
                self.open.push(Open::Sequence { next: 0 });
                return Continue(());
            }
            Event::MappingEnd | Event::SequenceEnd => {
                // The end of a complex key leaves its (unnamed) key open for the value.
                if matches!(self.open.pop(), Some(Open::Skipped)) {
                    return Continue(());
                }
            }
            Event::StreamEnd => return Break(()),
            Event::Scalar(..) | Event::Alias(_) => {}
            _ => return Continue(()),
        }
        // A node ended: the value of the enclosing key or item is done.
        if let Some(Open::Mapping { key, .. }) = self.open.last_mut() {
            if key.take().is_some() {
                self.path.pop();
            }
        } else if let Some(Open::Sequence { .. }) = self.open.last() {
            self.path.pop();
        }
        Continue(())
    }

    /// A scalar read as the next key of the open mapping.
    fn key(&mut self, value: &str, line: usize) {
        let Some(Open::Mapping { key, seen }) = self.open.last_mut() else { return };
        self.path.push(Seg::Key(value.to_string()));
        if seen.insert(value.to_string()) {
            self.index.keys.entry(format_path(&self.path)).or_insert(line);
        } else {
            self.index.repeated.push((value.to_string(), self.path.clone(), line));
        }
        *key = Some(value.to_string());
    }
}

impl LineIndex {
    /// Indexes one YAML document (first line `first_line` of its file) with no
    /// budget but the default one; tests only.
    #[cfg(test)]
    pub(super) fn build(text: &str, first_line: usize) -> LineIndex {
        let budget = DocBudget { depth: 1000, nodes: u64::MAX };
        Self::build_within(text, first_line, budget).map(|(index, _)| index).expect("within budget")
    }

    /// Indexes one YAML document whose first line is line `first_line` of its
    /// file, within `budget`; returns the index and the document's node count
    /// (aliases expanded). A document that does not parse keeps what was
    /// indexed before the error (serde_yaml reports the error itself).
    pub(super) fn build_within(
        text: &str,
        first_line: usize,
        budget: DocBudget,
    ) -> Result<(LineIndex, u64), OverBudget> {
        let mut walk = Walk { index: LineIndex::default(), open: Vec::new(), path: Vec::new() };
        let mut count = NodeCount { budget, nodes: 0, anchored: Vec::new(), anchor_nodes: HashMap::new() };
        let mut parser = Parser::new_from_str(text);
        loop {
            let (event, mark) = match parser.next_token() {
                Ok(next) => next,
                // The scanner's own bound on flow nesting (`[[[[…`), met while looking ahead.
                Err(e) if e.info().contains("recursion limit") => {
                    return Err(OverBudget {
                        line: first_line + e.marker().line().saturating_sub(1),
                        message: format!("nests deeper than {} levels (the limit)", budget.depth),
                    });
                }
                Err(_) => break,
            };
            let line = first_line + mark.line().saturating_sub(1);
            count.count(&event, line)?;
            if walk.visit(event, line).is_break() {
                break;
            }
        }
        let mut index = walk.index;
        if index.first == 0 {
            index.first = first_line;
        }
        Ok((index, count.nodes))
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
    fn line_index_enters_flow_collections_and_walks_over_complex_keys() {
        let text = "spec:\n  networkMap: [\n    {source: a, type: Pod},\n    {source: b,\n     type: Multus}]\n  ? [x, y]\n  : {inner: 1}\n  after: &a 2\n  alias: *a\n";
        let idx = LineIndex::build(text, 1);
        assert_eq!(idx.line_of(&p("spec.networkMap[0].type")), 3);
        assert_eq!(idx.line_of(&p("spec.networkMap[1].source")), 4);
        assert_eq!(idx.line_of(&p("spec.networkMap[1].type")), 5);
        assert_eq!(idx.line_of(&p("spec.after")), 8);
        assert_eq!(idx.line_of(&p("spec.alias")), 9);
        assert_eq!(idx.line_of(&p("spec.inner")), 1);
    }

    #[test]
    fn line_index_keeps_what_it_read_before_a_syntax_error() {
        let idx = LineIndex::build("a:\n  b: 1\n  c: [\n", 5);
        assert_eq!(idx.line_of(&p("a.b")), 6);
        assert_eq!(idx.first(), 5);
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
