//! Pure parsers for what a VMware ESXi host prints over SSH: `vim-cmd` output
//! (`getallvms`, `power.getstate`, faults, `snapshot.get`, `message`, VMODL
//! object dumps from `get.guest`/`get.summary`), `.vmx` files, VMDK
//! descriptors and `vmware -v`.
//!
//! Every input is untrusted (arbitrary bytes decoded lossily), so nothing here
//! may panic: no slice indexing, no unwrap, checked or saturating arithmetic,
//! and the only recursive parser (VMODL) is depth-bounded. No IO, no async.
//! The formats and their quirks are described in the ESXi facts notes; each
//! quirk has a unit test below.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::{Firmware, SourcePowerState};

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/getallvms
// ---------------------------------------------------------------------------

/// One row of `vim-cmd vmsvc/getallvms`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmListEntry {
    pub vmid: String,
    pub name: String,
    /// Datastore name between the brackets; empty for `[] /var/run/...` system VMs.
    pub datastore: String,
    /// Path inside the datastore, e.g. `web 01/web 01.vmx`.
    pub vmx_path: String,
    pub guest_id: String,
    pub version: String,
    /// Annotation; continuation lines are joined with `\n`.
    pub annotation: String,
}

/// Parses `vim-cmd vmsvc/getallvms`. Columns are separated by runs of three or
/// more spaces (header widths differ from row widths); names and datastores may
/// contain spaces; `Skipping invalid VM 'N'` lines and the header are ignored;
/// lines without a leading Vmid continue the previous row's annotation.
pub fn parse_getallvms(text: &str) -> Vec<VmListEntry> {
    let mut out: Vec<VmListEntry> = Vec::new();
    let mut pending_blank_lines = 0usize;
    for raw in text.lines() {
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.is_empty() {
            if !out.is_empty() {
                pending_blank_lines = pending_blank_lines.saturating_add(1);
            }
            continue;
        }
        if trimmed.starts_with("Skipping invalid VM") || is_getallvms_header(trimmed) {
            pending_blank_lines = 0;
            continue;
        }
        if let Some(entry) = parse_getallvms_row(line) {
            out.push(entry);
        } else if let Some(last) = out.last_mut() {
            for _ in 0..pending_blank_lines {
                last.annotation.push('\n');
            }
            last.annotation.push('\n');
            last.annotation.push_str(line);
        }
        pending_blank_lines = 0;
    }
    out
}

fn is_getallvms_header(trimmed: &str) -> bool {
    trimmed.starts_with("Vmid") && trimmed.contains("Name") && trimmed.contains("File")
}

fn is_blank_byte(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// Byte ranges of the columns of `s`, split at runs of three or more blanks.
/// Every range starts and ends at a char boundary (next to an ASCII blank or at
/// an end of `s`).
fn column_segments(s: &str) -> Vec<(usize, usize)> {
    let bytes = s.as_bytes();
    let mut segs = Vec::new();
    let mut seg_start: Option<usize> = None;
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        if is_blank_byte(b) {
            let run_start = i;
            while bytes.get(i).copied().is_some_and(is_blank_byte) {
                i = i.saturating_add(1);
            }
            if (i.saturating_sub(run_start) >= 3 || i >= bytes.len())
                && let Some(start) = seg_start.take()
            {
                segs.push((start, run_start));
            }
        } else {
            if seg_start.is_none() {
                seg_start = Some(i);
            }
            i = i.saturating_add(1);
        }
    }
    if let Some(start) = seg_start {
        segs.push((start, bytes.len()));
    }
    segs
}

fn ends_with_ignore_ascii_case(s: &str, suffix: &str) -> bool {
    let (s, suffix) = (s.as_bytes(), suffix.as_bytes());
    s.len() >= suffix.len()
        && s.get(s.len().saturating_sub(suffix.len())..).is_some_and(|t| t.eq_ignore_ascii_case(suffix))
}

fn parse_getallvms_row(line: &str) -> Option<VmListEntry> {
    let t = line.trim_start();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let vmid = t.get(..digits)?;
    let rest = t.get(digits..)?;
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let segs = column_segments(rest);
    let seg = |i: usize| segs.get(i).and_then(|&(a, b)| rest.get(a..b));
    let is_file_start = |i: usize| seg(i).is_some_and(|s| s.starts_with('[') && s.contains(']'));
    let ends_vmx = |i: usize| seg(i).is_some_and(|s| ends_with_ignore_ascii_case(s, ".vmx"));
    let n = segs.len();
    // The file column: `[datastore] path.vmx`, normally one column; if a path
    // itself contains three spaces, it spans several.
    let span = (1..n).find(|&i| is_file_start(i) && ends_vmx(i)).map(|i| (i, i)).or_else(|| {
        let last_vmx = (1..n).rev().find(|&j| ends_vmx(j))?;
        let i = (1..=last_vmx).find(|&i| is_file_start(i))?;
        let j = (i..n).find(|&j| ends_vmx(j))?;
        Some((i, j))
    });
    let (name, file, tail_from) = match span {
        Some((i, j)) => {
            let name_start = segs.first()?.0;
            let name_end = segs.get(i.checked_sub(1)?)?.1;
            let name = rest.get(name_start..name_end)?;
            let file = rest.get(segs.get(i)?.0..segs.get(j)?.1)?;
            (name, file, j.saturating_add(1))
        }
        None => {
            // Name and file separated by fewer than three blanks.
            let first = seg(0)?;
            let at = first.find(" [")?;
            let name = first.get(..at)?.trim_end();
            let file = first.get(at.saturating_add(1)..)?;
            if !file.contains(']') || !ends_with_ignore_ascii_case(file, ".vmx") {
                return None;
            }
            (name, file, 1)
        }
    };
    let tail = segs.get(tail_from..).unwrap_or(&[]);
    let tseg = |k: usize| tail.get(k).and_then(|&(a, b)| rest.get(a..b)).unwrap_or("");
    // An empty guest column would put the version right after the file.
    let (guest_id, version, annotation_idx) = if tseg(0).starts_with("vmx-") && !tseg(1).starts_with("vmx-") {
        ("", tseg(0), 1)
    } else {
        (tseg(0), tseg(1), 2)
    };
    let annotation = tail.get(annotation_idx).and_then(|&(a, _)| rest.get(a..)).unwrap_or("").trim_end();
    let (datastore, vmx_path) = split_datastore_path(file);
    Some(VmListEntry {
        vmid: vmid.to_string(),
        name: name.to_string(),
        datastore: datastore.to_string(),
        vmx_path: vmx_path.to_string(),
        guest_id: guest_id.to_string(),
        version: version.to_string(),
        annotation: annotation.to_string(),
    })
}

/// `[ds] dir/vm.vmx` -> (`ds`, `dir/vm.vmx`); without brackets, (`""`, input).
pub fn split_datastore_path(file: &str) -> (&str, &str) {
    let file = file.trim();
    if let Some(inner) = file.strip_prefix('[')
        && let Some(close) = inner.find(']')
    {
        let ds = inner.get(..close).unwrap_or("");
        let path = inner.get(close.saturating_add(1)..).unwrap_or("").trim_start();
        return (ds, path);
    }
    ("", file)
}

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/power.getstate
// ---------------------------------------------------------------------------

/// Parses `vim-cmd vmsvc/power.getstate`: the first line that is exactly
/// `Powered on`, `Powered off` or `Suspended` (case-insensitive, trimmed).
pub fn parse_power_state(text: &str) -> Option<SourcePowerState> {
    text.lines().find_map(|line| {
        let line = line.trim();
        if line.eq_ignore_ascii_case("Powered on") {
            Some(SourcePowerState::PoweredOn)
        } else if line.eq_ignore_ascii_case("Powered off") {
            Some(SourcePowerState::PoweredOff)
        } else if line.eq_ignore_ascii_case("Suspended") {
            Some(SourcePowerState::Suspended)
        } else {
            None
        }
    })
}

// ---------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------

/// A vim-cmd fault, e.g. `vim.fault.NotFound` with its `msg`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fault {
    pub kind: String,
    pub msg: String,
}

const TOOLS_NOT_RUNNING: &str = "Cannot complete operation because VMware Tools is not running";

/// Finds the first fault block (`(vim.fault.X) {`, `(vmodl.fault.X) {`,
/// `(vmodl.MethodFault) {`...) anywhere in `text`, e.g. after `Reset failed: `.
/// `msg` is taken from the first to the last double quote of its line, since
/// vim-cmd does not escape inner quotes. The bare sentence `Cannot complete
/// operation because VMware Tools is not running...` is reported as
/// `vim.fault.ToolsUnavailable`. vim-cmd's exit code is unreliable: callers
/// should check this on every output.
pub fn parse_fault(text: &str) -> Option<Fault> {
    if let Some((kind, body)) = find_fault_block(text) {
        return Some(Fault { kind: kind.to_string(), msg: fault_block_msg(body).unwrap_or_default() });
    }
    let at = text.find(TOOLS_NOT_RUNNING)?;
    let msg = text.get(at..)?.lines().next().unwrap_or("").trim();
    Some(Fault { kind: "vim.fault.ToolsUnavailable".to_string(), msg: msg.to_string() })
}

fn is_fault_kind(kind: &str) -> bool {
    !kind.is_empty()
        && !kind.contains(char::is_whitespace)
        && (kind.contains(".fault.") || kind.starts_with("fault.") || kind.ends_with("Fault"))
}

/// Returns the fault type and the text after its opening brace.
fn find_fault_block(text: &str) -> Option<(&str, &str)> {
    let (_, kind, brace) = find_typed_brace(text, is_fault_kind)?;
    Some((kind, text.get(brace.saturating_add(1)..)?))
}

/// Finds the first `(type) {` on one line whose trimmed type satisfies `accept`;
/// returns the offsets of `(` and `{` and the type. Linear: for each `)`, only
/// the last `(` before it on its line can start a type without parentheses.
fn find_typed_brace(text: &str, accept: impl Fn(&str) -> bool) -> Option<(usize, &str, usize)> {
    let mut search = 0usize;
    while let Some(rel) = text.get(search..).and_then(|t| t.find(')')) {
        let close = search.saturating_add(rel);
        let before = text.get(search..close)?;
        let line_start = before.rfind('\n').map_or(0, |i| i.saturating_add(1));
        if let Some(open_rel) = before.get(line_start..).and_then(|l| l.rfind('(')) {
            let open = search.saturating_add(line_start).saturating_add(open_rel);
            let kind = text.get(open.saturating_add(1)..close)?.trim();
            let post = text.get(close.saturating_add(1)..)?;
            let trimmed = post.trim_start_matches([' ', '\t', '\r']);
            if trimmed.starts_with('{') && !kind.is_empty() && accept(kind) {
                let brace = close.saturating_add(1).saturating_add(post.len().saturating_sub(trimmed.len()));
                return Some((open, kind, brace));
            }
        }
        search = close.saturating_add(1);
    }
    None
}

/// The `msg = "..."` of a fault block body, preferring the block's own level.
fn fault_block_msg(body: &str) -> Option<String> {
    let mut depth = 1usize;
    let mut nested: Option<String> = None;
    for raw in body.lines() {
        let line = raw.trim();
        if line.starts_with('}') || line.starts_with(']') {
            depth = depth.saturating_sub(1);
            if depth == 0 {
                break;
            }
            continue;
        }
        if let Some(v) = msg_value(line) {
            if depth == 1 {
                return Some(v);
            }
            if nested.is_none() {
                nested = Some(v);
            }
        }
        let l = line.trim_end_matches([',', ' ', '\t']);
        if l.ends_with('{') || l.ends_with('[') {
            depth = depth.saturating_add(1);
        }
    }
    nested
}

fn msg_value(line: &str) -> Option<String> {
    let rest = line.strip_prefix("msg")?.trim_start().strip_prefix('=')?.trim();
    Some(line_quoted_value(rest))
}

/// A value as printed on one line: from the first to the last double quote if
/// quoted, `""` for `<unset>`, otherwise the bare text without a trailing comma.
fn line_quoted_value(v: &str) -> String {
    if let Some(first) = v.find('"') {
        let after = v.get(first.saturating_add(1)..).unwrap_or("");
        return match after.rfind('"') {
            Some(last) => after.get(..last).unwrap_or(""),
            None => after.trim_end_matches([',', ' ', '\t']),
        }
        .to_string();
    }
    let v = v.trim_end_matches([',', ' ', '\t']);
    if v == "<unset>" { String::new() } else { v.to_string() }
}

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/snapshot.get
// ---------------------------------------------------------------------------

/// One snapshot of `vim-cmd vmsvc/snapshot.get`, in printed (pre-order) order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub name: String,
    pub id: String,
    /// 0 for a root snapshot, 1 for its children, ...
    pub depth: usize,
    pub description: String,
    pub created: String,
    pub state: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SnapshotLabel {
    Name,
    Id,
    Description,
    Created,
    State,
    Other,
}

fn snapshot_label(rest: &str) -> Option<(SnapshotLabel, &str)> {
    let (label, value) = rest.split_once(':')?;
    let words: Vec<&str> = label.split_whitespace().collect();
    let first = words.first()?;
    if !first.eq_ignore_ascii_case("Snapshot") {
        return None;
    }
    let tail = words.get(1..).unwrap_or(&[]).join(" ").to_ascii_lowercase();
    let kind = match tail.as_str() {
        "name" => SnapshotLabel::Name,
        "id" => SnapshotLabel::Id,
        "desciption" | "description" => SnapshotLabel::Description,
        "created on" | "created" => SnapshotLabel::Created,
        "state" => SnapshotLabel::State,
        _ => SnapshotLabel::Other,
    };
    Some((kind, value.trim()))
}

/// Parses `vim-cmd vmsvc/snapshot.get`. `Get Snapshot:` alone yields nothing.
/// Each nesting level adds two dashes; `|-ROOT`/`|-CHILD` lines separate
/// snapshots; a description may wrap onto lines without dashes.
pub fn parse_snapshots(text: &str) -> Vec<Snapshot> {
    let mut out = Vec::new();
    let mut current: Option<Snapshot> = None;
    let mut in_description = false;
    let mut pending_blank_lines = 0usize;
    for raw in text.lines() {
        let line = raw.trim_end();
        let dashes = line.bytes().take_while(|&b| b == b'-').count();
        let rest = line.get(dashes..).unwrap_or("");
        if rest.starts_with("|-") {
            out.extend(current.take());
            in_description = false;
            continue;
        }
        if let Some((label, value)) = snapshot_label(rest)
            && (label != SnapshotLabel::Other || dashes > 0)
        {
            let depth = (dashes / 2).saturating_sub(1);
            if label == SnapshotLabel::Name && current.as_ref().is_some_and(|c| !c.name.is_empty()) {
                out.extend(current.take());
            }
            let snap = current.get_or_insert_with(|| Snapshot { depth, ..Snapshot::default() });
            match label {
                SnapshotLabel::Name => {
                    snap.name = value.to_string();
                    snap.depth = depth;
                }
                SnapshotLabel::Id => snap.id = value.to_string(),
                SnapshotLabel::Description => snap.description = value.to_string(),
                SnapshotLabel::Created => snap.created = value.to_string(),
                SnapshotLabel::State => snap.state = value.to_string(),
                SnapshotLabel::Other => {}
            }
            in_description = label == SnapshotLabel::Description;
            pending_blank_lines = 0;
            continue;
        }
        if !in_description {
            continue;
        }
        let Some(snap) = current.as_mut() else { continue };
        if line.trim().is_empty() {
            pending_blank_lines = pending_blank_lines.saturating_add(1);
            continue;
        }
        for _ in 0..pending_blank_lines {
            snap.description.push('\n');
        }
        pending_blank_lines = 0;
        snap.description.push('\n');
        snap.description.push_str(line);
    }
    out.extend(current);
    out
}

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/message
// ---------------------------------------------------------------------------

/// Parses `vim-cmd vmsvc/message`: `None` for `No message.` (or anything that
/// is not a `Virtual machine message N: ...` block), else the question text
/// (e.g. `msg.uuid.altered:This virtual machine may have been moved or
/// copied.`) without the numbered choices line.
pub fn parse_message(text: &str) -> Option<String> {
    const MARKER: &str = "Virtual machine message";
    let mut lines = text.lines();
    let first = lines.by_ref().find(|l| l.contains(MARKER))?;
    let after_marker = first.get(first.find(MARKER)?.saturating_add(MARKER.len())..)?;
    let mut parts: Vec<&str> = Vec::new();
    if let Some((_, text)) = after_marker.split_once(':') {
        let text = text.trim();
        if !text.is_empty() {
            parts.push(text);
        }
    }
    for line in lines {
        let t = line.trim();
        if t.is_empty() {
            if parts.is_empty() {
                continue;
            }
            break;
        }
        if is_choice_line(t) {
            break;
        }
        parts.push(t);
    }
    if parts.is_empty() { None } else { Some(parts.join("\n")) }
}

/// `0. Cancel (Cancel) 1. ...`
fn is_choice_line(t: &str) -> bool {
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && t.get(digits..).is_some_and(|r| r.starts_with(". "))
}

// ---------------------------------------------------------------------------
// VMODL pretty-print dumps
// ---------------------------------------------------------------------------

/// A VMODL pretty-print value, as in `get.guest` / `get.summary` dumps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Vmodl {
    Object {
        type_name: String,
        fields: Vec<(String, Vmodl)>,
    },
    Array {
        type_name: String,
        items: Vec<Vmodl>,
    },
    Str(String),
    /// A single-quoted managed object reference, e.g. `vim.HostSystem:ha-host`.
    Ref(String),
    /// `<unset>`
    #[default]
    Unset,
    /// A typed null, e.g. `(vim.vm.QuestionInfo) null`.
    Null,
    /// Numbers, `true`/`false`, anything else unquoted.
    Scalar(String),
}

impl Vmodl {
    /// The first field called `name` of an object.
    pub fn field(&self, name: &str) -> Option<&Vmodl> {
        match self {
            Vmodl::Object { fields, .. } => fields.iter().find(|(k, _)| k == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Follows nested object fields, e.g. `["config", "name"]`.
    pub fn path(&self, path: &[&str]) -> Option<&Vmodl> {
        path.iter().try_fold(self, |v, name| v.field(name))
    }

    /// The text of a string, reference or scalar.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Vmodl::Str(s) | Vmodl::Ref(s) | Vmodl::Scalar(s) => Some(s),
            _ => None,
        }
    }

    /// The items of an array; empty for anything else.
    pub fn items(&self) -> &[Vmodl] {
        match self {
            Vmodl::Array { items, .. } => items,
            _ => &[],
        }
    }

    /// The type of an object or array.
    pub fn type_name(&self) -> Option<&str> {
        match self {
            Vmodl::Object { type_name, .. } | Vmodl::Array { type_name, .. } => Some(type_name),
            _ => None,
        }
    }
}

/// Nesting deeper than this makes [`parse_vmodl`] give up (returns `None`).
pub const VMODL_MAX_DEPTH: usize = 64;

/// Finds the first `(type) {` in `text` and parses the object up to its
/// matching `}`. Tolerates `, ` / `,` line ends, missing commas, `dynamicType`
/// lines, truncation (returns what was read) and stray text. `None` if there is
/// no object or nesting exceeds [`VMODL_MAX_DEPTH`].
pub fn parse_vmodl(text: &str) -> Option<Vmodl> {
    let start = find_object_start(text)?;
    let mut p = VmodlParser { s: text, pos: start, too_deep: false, no_string_end_from: usize::MAX };
    let v = p.value(0);
    if p.too_deep { None } else { v }
}

/// Byte offset of the `(` of the first `(type) {`.
fn find_object_start(text: &str) -> Option<usize> {
    find_typed_brace(text, |_| true).map(|(open, _, _)| open)
}

struct VmodlParser<'a> {
    s: &'a str,
    /// Always on a char boundary.
    pos: usize,
    too_deep: bool,
    /// A multi-line string scan from here found no closing line up to the end
    /// of the text; later scans stop here (keeps parsing linear).
    no_string_end_from: usize,
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'$'
}

impl VmodlParser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    fn rest(&self) -> &str {
        self.s.get(self.pos..).unwrap_or("")
    }

    /// Advances one byte; only call when the current byte is ASCII.
    fn bump_ascii(&mut self) {
        self.pos = self.pos.saturating_add(1).min(self.s.len());
    }

    /// Advances one char.
    fn bump_char(&mut self) {
        let len = self.rest().chars().next().map_or(1, char::len_utf8);
        self.pos = self.pos.saturating_add(len).min(self.s.len());
    }

    fn skip_inline_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r')) {
            self.bump_ascii();
        }
    }

    fn skip_ws_and_commas(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace() || b == b',') {
            self.bump_ascii();
        }
    }

    /// End (exclusive) of the current line.
    fn line_end(&self) -> usize {
        self.rest().find('\n').map_or(self.s.len(), |i| self.pos.saturating_add(i))
    }

    fn value(&mut self, depth: usize) -> Option<Vmodl> {
        if depth > VMODL_MAX_DEPTH {
            self.too_deep = true;
            return None;
        }
        self.skip_inline_ws();
        match self.peek()? {
            b'(' => {
                let rest = self.rest();
                let close = rest.find([')', '\n']).unwrap_or(rest.len());
                if rest.as_bytes().get(close) != Some(&b')') {
                    // `(` without `)` on its line: keep the text, skip the line.
                    let text = rest.get(..close).unwrap_or("").trim().to_string();
                    self.pos = self.pos.saturating_add(close);
                    return Some(Vmodl::Scalar(text));
                }
                let type_name = rest.get(1..close).unwrap_or("").trim().to_string();
                self.pos = self.pos.saturating_add(close).saturating_add(1);
                self.skip_inline_ws();
                match self.peek() {
                    Some(b'{') => {
                        self.bump_ascii();
                        self.object(type_name, depth)
                    }
                    Some(b'[') => {
                        self.bump_ascii();
                        self.array(type_name, depth)
                    }
                    None | Some(b'\n' | b',' | b'}' | b']') => Some(Vmodl::Null),
                    Some(_) if self.rest().starts_with("null") => {
                        self.pos = self.pos.saturating_add(4);
                        Some(Vmodl::Null)
                    }
                    Some(_) => Some(self.plain()),
                }
            }
            b'{' => {
                self.bump_ascii();
                self.object(String::new(), depth)
            }
            b'[' => {
                self.bump_ascii();
                self.array(String::new(), depth)
            }
            _ => Some(self.plain()),
        }
    }

    fn object(&mut self, type_name: String, depth: usize) -> Option<Vmodl> {
        let mut fields = Vec::new();
        loop {
            self.skip_ws_and_commas();
            match self.peek() {
                None => break,
                Some(b'}') => {
                    self.bump_ascii();
                    break;
                }
                // Mismatched closer: let the enclosing array consume it.
                Some(b']') => break,
                Some(b) if is_ident_byte(b) => {
                    let start = self.pos;
                    while self.peek().is_some_and(is_ident_byte) {
                        self.bump_ascii();
                    }
                    let name = self.s.get(start..self.pos).unwrap_or("").to_string();
                    self.skip_inline_ws();
                    if self.peek() == Some(b'=') {
                        self.bump_ascii();
                        match self.value(depth.saturating_add(1)) {
                            Some(v) => fields.push((name, v)),
                            None if self.too_deep => return None,
                            None => break,
                        }
                    }
                }
                Some(_) => self.bump_char(),
            }
        }
        Some(Vmodl::Object { type_name, fields })
    }

    fn array(&mut self, type_name: String, depth: usize) -> Option<Vmodl> {
        let mut items = Vec::new();
        loop {
            self.skip_ws_and_commas();
            match self.peek() {
                None => break,
                Some(b']') => {
                    self.bump_ascii();
                    break;
                }
                // Mismatched closer: let the enclosing object consume it.
                Some(b'}') => break,
                Some(_) => {
                    let before = self.pos;
                    match self.value(depth.saturating_add(1)) {
                        Some(v) => items.push(v),
                        None if self.too_deep => return None,
                        None => break,
                    }
                    if self.pos == before {
                        // Cannot happen, but never loop without progress.
                        self.bump_char();
                    }
                }
            }
        }
        Some(Vmodl::Array { type_name, items })
    }

    /// A string, reference, `<unset>` or bare scalar.
    fn plain(&mut self) -> Vmodl {
        match self.peek() {
            Some(b'"') => Vmodl::Str(self.string()),
            Some(b'\'') => {
                self.bump_ascii();
                let rest = self.rest();
                let stop = rest.find(['\'', '\n']).unwrap_or(rest.len());
                let closed = rest.as_bytes().get(stop) == Some(&b'\'');
                let text = rest.get(..stop).unwrap_or("");
                let text = if closed { text } else { text.trim_end() }.to_string();
                self.pos = self.pos.saturating_add(stop).saturating_add(usize::from(closed));
                Vmodl::Ref(text)
            }
            Some(b'<') if self.rest().starts_with("<unset>") => {
                self.pos = self.pos.saturating_add("<unset>".len());
                Vmodl::Unset
            }
            _ => {
                let start = self.pos;
                while self.peek().is_some_and(|b| !matches!(b, b',' | b'\n' | b'}' | b']')) {
                    self.bump_char();
                }
                Vmodl::Scalar(self.s.get(start..self.pos).unwrap_or("").trim().to_string())
            }
        }
    }

    /// A double-quoted string. vim-cmd does not escape inner quotes, so it ends
    /// at the last quote of its line; if the first line has no closing quote,
    /// the string spans lines and ends at the last quote of the first later
    /// line where that quote is followed only by blanks, commas or closers.
    fn string(&mut self) -> String {
        self.bump_ascii();
        let body_start = self.pos;
        let first_end = self.line_end();
        let first_line = self.s.get(body_start..first_end).unwrap_or("");
        if let Some(q) = first_line.rfind('"') {
            self.pos = body_start.saturating_add(q).saturating_add(1);
            return first_line.get(..q).unwrap_or("").to_string();
        }
        let mut line_start = first_end.saturating_add(1);
        while line_start < self.no_string_end_from {
            let Some(line_rest) = self.s.get(line_start..) else { break };
            let len = line_rest.find('\n').unwrap_or(line_rest.len());
            let line = line_rest.get(..len).unwrap_or("");
            if let Some(q) = line.rfind('"') {
                let trailing = line.get(q.saturating_add(1)..).unwrap_or("");
                if trailing.bytes().all(|b| b.is_ascii_whitespace() || matches!(b, b',' | b'}' | b']')) {
                    let end = line_start.saturating_add(q);
                    self.pos = end.saturating_add(1);
                    return self.s.get(body_start..end).unwrap_or("").to_string();
                }
            }
            if len >= line_rest.len() {
                break;
            }
            line_start = line_start.saturating_add(len).saturating_add(1);
        }
        self.no_string_end_from = self.no_string_end_from.min(first_end.saturating_add(1));
        // Unterminated: the rest of the first line.
        self.pos = first_end;
        first_line.trim_end_matches('\r').to_string()
    }
}

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/get.guest
// ---------------------------------------------------------------------------

/// One guest NIC as VMware Tools reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestNic {
    pub network: String,
    /// Lowercased.
    pub mac_address: String,
    pub ip_addresses: Vec<String>,
}

/// The useful part of `vim-cmd vmsvc/get.guest`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestInfo {
    pub tools_status: String,
    pub tools_running_status: String,
    pub guest_id: String,
    pub ip_address: Option<String>,
    pub nics: Vec<GuestNic>,
    pub guest_state: String,
}

impl GuestInfo {
    /// `toolsRunningStatus == "guestToolsRunning"` or `toolsStatus == "toolsOk"`.
    pub fn tools_running(&self) -> bool {
        self.tools_running_status == "guestToolsRunning" || self.tools_status == "toolsOk"
    }
}

fn vmodl_string(v: &Vmodl, path: &[&str]) -> String {
    v.path(path).and_then(Vmodl::as_str).unwrap_or("").to_string()
}

fn vmodl_int(v: &Vmodl, path: &[&str]) -> Option<i64> {
    v.path(path).and_then(Vmodl::as_str).and_then(|s| s.trim().parse().ok())
}

/// The first object dump of `text`, unless it is a fault.
fn non_fault_object(text: &str) -> Option<Vmodl> {
    let v = parse_vmodl(text)?;
    if v.type_name().is_some_and(is_fault_kind) {
        return None;
    }
    Some(v)
}

/// Parses `vim-cmd vmsvc/get.guest` (`Guest information:` then a
/// `(vim.vm.GuestInfo) {` dump). `None` if there is no dump or it is a fault.
pub fn parse_guest_info(text: &str) -> Option<GuestInfo> {
    let v = non_fault_object(text)?;
    let ip_address = v.field("ipAddress").and_then(Vmodl::as_str).map(str::trim).filter(|s| !s.is_empty());
    let nics = v
        .field("net")
        .map(Vmodl::items)
        .unwrap_or(&[])
        .iter()
        .map(|nic| GuestNic {
            network: vmodl_string(nic, &["network"]),
            mac_address: vmodl_string(nic, &["macAddress"]).to_ascii_lowercase(),
            ip_addresses: match nic.field("ipAddress") {
                Some(Vmodl::Array { items, .. }) => {
                    items.iter().filter_map(Vmodl::as_str).map(str::to_string).collect()
                }
                Some(Vmodl::Str(s)) if !s.is_empty() => vec![s.clone()],
                _ => Vec::new(),
            },
        })
        .collect();
    Some(GuestInfo {
        tools_status: vmodl_string(&v, &["toolsStatus"]),
        tools_running_status: vmodl_string(&v, &["toolsRunningStatus"]),
        guest_id: vmodl_string(&v, &["guestId"]),
        ip_address: ip_address.map(str::to_string),
        nics,
        guest_state: vmodl_string(&v, &["guestState"]),
    })
}

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/get.summary
// ---------------------------------------------------------------------------

/// The useful part of `vim-cmd vmsvc/get.summary`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// `poweredOn`, `poweredOff` or `suspended`.
    pub power_state: String,
    pub name: String,
    /// `[ds] dir/vm.vmx`
    pub vmx_path: String,
    /// 0 if absent.
    pub memory_mb: i64,
    /// 0 if absent.
    pub num_cpu: i32,
    pub uuid: String,
    pub annotation: String,
}

/// Parses `vim-cmd vmsvc/get.summary` (`Listsummary:` then a
/// `(vim.vm.Summary) {` dump): `runtime.powerState`, `config.name`,
/// `config.vmPathName`, `config.memorySizeMB`, `config.numCpu`, `config.uuid`,
/// `config.annotation`. `None` if there is no dump or it is a fault.
pub fn parse_summary(text: &str) -> Option<Summary> {
    let v = non_fault_object(text)?;
    Some(Summary {
        power_state: vmodl_string(&v, &["runtime", "powerState"]),
        name: vmodl_string(&v, &["config", "name"]),
        vmx_path: vmodl_string(&v, &["config", "vmPathName"]),
        memory_mb: vmodl_int(&v, &["config", "memorySizeMB"]).unwrap_or(0),
        num_cpu: vmodl_int(&v, &["config", "numCpu"]).and_then(|n| i32::try_from(n).ok()).unwrap_or(0),
        uuid: vmodl_string(&v, &["config", "uuid"]),
        annotation: vmodl_string(&v, &["config", "annotation"]),
    })
}

// ---------------------------------------------------------------------------
// .vmx
// ---------------------------------------------------------------------------

/// A parsed `.vmx` file: keys lowercased, values unquoted and `|XX`-decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vmx {
    pub entries: BTreeMap<String, String>,
}

impl Vmx {
    /// Case-insensitive lookup.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.get(&key.to_ascii_lowercase()).map(String::as_str)
    }

    /// `TRUE`/`true`/`yes`/`1` and `FALSE`/`false`/`no`/`0`, case-insensitive;
    /// `None` if absent or anything else.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        let v = self.get(key)?.trim();
        if ["true", "yes", "on", "1"].iter().any(|t| v.eq_ignore_ascii_case(t)) {
            Some(true)
        } else if ["false", "no", "off", "0"].iter().any(|f| v.eq_ignore_ascii_case(f)) {
            Some(false)
        } else {
            None
        }
    }
}

/// Parses a `.vmx` (or `.vmsd`) file: `key = "value"` lines. Comments, blank
/// and garbage lines are ignored; the last occurrence of a key wins; values may
/// contain `=`; VMware's `|XX` hex escapes (e.g. `|22` for `"`) are decoded.
pub fn parse_vmx(text: &str) -> Vmx {
    let mut entries = BTreeMap::new();
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        let key = k.trim();
        if key.is_empty() || key.contains(|c: char| c.is_whitespace() || c == '"') {
            continue;
        }
        let v = v.trim();
        let value = match v.strip_prefix('"') {
            Some(inner) => inner.get(..inner.rfind('"').unwrap_or(inner.len())).unwrap_or(inner),
            None => v,
        };
        entries.insert(key.to_ascii_lowercase(), decode_vmx_escapes(value));
    }
    Vmx { entries }
}

fn hex_val(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// Decodes `|XX` (two hex digits) escapes; a `|` not followed by two hex
/// digits is kept as is.
fn decode_vmx_escapes(v: &str) -> String {
    if !v.contains('|') {
        return v.to_string();
    }
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        if b == b'|'
            && let (Some(h), Some(l)) = (
                bytes.get(i.saturating_add(1)).copied().and_then(hex_val),
                bytes.get(i.saturating_add(2)).copied().and_then(hex_val),
            )
        {
            out.push(h.saturating_mul(16).saturating_add(l));
            i = i.saturating_add(3);
            continue;
        }
        out.push(b);
        i = i.saturating_add(1);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A virtual hard disk of a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmxDisk {
    /// e.g. `scsi0:0` (lowercase).
    pub device: String,
    /// `scsi`, `sata`, `ide` or `nvme`.
    pub bus: String,
    /// As written: relative to the VM folder or absolute under `/vmfs/volumes/`.
    pub file_name: String,
    /// e.g. `independent-persistent`; `""` if absent.
    pub mode: String,
    /// `scsiN.virtualDev` (e.g. `pvscsi`) for SCSI disks; `""` otherwise.
    pub controller_model: String,
}

/// A virtual NIC of a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmxNic {
    /// e.g. `ethernet0`.
    pub device: String,
    /// `virtualDev`, `e1000` if absent.
    pub model: String,
    pub network: String,
    /// Lowercase: `address` if `addressType = "static"`, else `generatedAddress`.
    pub mac_address: String,
}

/// What the migration needs from a `.vmx`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmxFacts {
    pub display_name: String,
    /// Short form, e.g. `rhel8-64`.
    pub guest_os: String,
    /// 0 if absent.
    pub memory_mib: i64,
    /// `numvcpus`, 1 if absent or invalid.
    pub num_cpus: i32,
    /// `cpuid.coresPerSocket`, 1 if absent or invalid.
    pub cores_per_socket: i32,
    pub firmware: Firmware,
    pub secure_boot: bool,
    /// Hard disks only, ordered scsi, sata, nvme, ide, then controller, then unit.
    pub disks: Vec<VmxDisk>,
    /// `ethernetN` with `present` not false, ordered by N.
    pub nics: Vec<VmxNic>,
}

const DISK_BUSES: [&str; 4] = ["scsi", "sata", "nvme", "ide"];

/// `scsi0:1` -> (bus rank, bus, controller, unit).
fn parse_disk_device(dev: &str) -> Option<(usize, &'static str, u32, u32)> {
    DISK_BUSES.iter().enumerate().find_map(|(rank, &bus)| {
        let (c, u) = dev.strip_prefix(bus)?.split_once(':')?;
        let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !all_digits(c) || !all_digits(u) {
            return None;
        }
        Some((rank, bus, c.parse().ok()?, u.parse().ok()?))
    })
}

fn positive_i32(v: Option<&str>) -> Option<i32> {
    v.and_then(|s| s.trim().parse::<i32>().ok()).filter(|&n| n > 0)
}

/// Extracts CPU, memory, firmware, disks and NICs from a parsed `.vmx`.
pub fn vmx_facts(vmx: &Vmx) -> VmxFacts {
    let get = |k: &str| vmx.get(k).unwrap_or("").to_string();
    let mut disks: Vec<((usize, u32, u32), VmxDisk)> = Vec::new();
    let mut nic_ids: BTreeSet<u32> = BTreeSet::new();
    for (key, value) in &vmx.entries {
        if let Some(dev) = key.strip_suffix(".filename")
            && let Some((rank, bus, controller, unit)) = parse_disk_device(dev)
        {
            let device_type = vmx.get(&format!("{dev}.devicetype")).unwrap_or("").to_ascii_lowercase();
            let not_a_disk = device_type.contains("cdrom")
                || device_type.contains("passthru")
                || device_type.contains("floppy")
                || ends_with_ignore_ascii_case(value, ".iso");
            let absent = vmx.get_bool(&format!("{dev}.present")) == Some(false)
                || vmx.get_bool(&format!("{bus}{controller}.present")) == Some(false);
            if not_a_disk || absent || value.trim().is_empty() {
                continue;
            }
            let controller_model =
                if bus == "scsi" { get(&format!("scsi{controller}.virtualdev")) } else { String::new() };
            disks.push((
                (rank, controller, unit),
                VmxDisk {
                    device: dev.to_string(),
                    bus: bus.to_string(),
                    file_name: value.clone(),
                    mode: get(&format!("{dev}.mode")),
                    controller_model,
                },
            ));
        }
        if let Some(rest) = key.strip_prefix("ethernet")
            && let Some((n, _)) = rest.split_once('.')
            && !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
            && let Ok(n) = n.parse::<u32>()
        {
            nic_ids.insert(n);
        }
    }
    disks.sort_by_key(|(k, _)| *k);
    let nics = nic_ids
        .into_iter()
        .filter(|n| vmx.get_bool(&format!("ethernet{n}.present")) != Some(false))
        .map(|n| {
            let dev = format!("ethernet{n}");
            let model = vmx.get(&format!("{dev}.virtualdev")).map(str::trim).filter(|m| !m.is_empty());
            let address = get(&format!("{dev}.address"));
            let generated = get(&format!("{dev}.generatedaddress"));
            let is_static = vmx
                .get(&format!("{dev}.addresstype"))
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("static"));
            let (preferred, other) = if is_static { (address, generated) } else { (generated, address) };
            let mac = if preferred.trim().is_empty() { other } else { preferred };
            VmxNic {
                model: model.unwrap_or("e1000").to_string(),
                network: get(&format!("{dev}.networkname")),
                mac_address: mac.trim().to_ascii_lowercase(),
                device: dev,
            }
        })
        .collect();
    VmxFacts {
        display_name: get("displayName"),
        guest_os: get("guestOS"),
        memory_mib: vmx.get("memSize").and_then(|s| s.trim().parse().ok()).unwrap_or(0),
        num_cpus: positive_i32(vmx.get("numvcpus")).unwrap_or(1),
        cores_per_socket: positive_i32(vmx.get("cpuid.coresPerSocket")).unwrap_or(1),
        firmware: if vmx.get("firmware").is_some_and(|f| f.trim().eq_ignore_ascii_case("efi")) {
            Firmware::Efi
        } else {
            Firmware::Bios
        },
        secure_boot: vmx.get_bool("uefi.secureBoot.enabled").unwrap_or(false),
        disks: disks.into_iter().map(|(_, d)| d).collect(),
        nics,
    }
}

// ---------------------------------------------------------------------------
// VMDK descriptor
// ---------------------------------------------------------------------------

/// One extent line of a VMDK descriptor, e.g. `RW 4194304 VMFS "vm-flat.vmdk"`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    /// `RW`, `RDONLY` or `NOACCESS`.
    pub access: String,
    /// Size in 512-byte sectors.
    pub sectors: u64,
    /// `VMFS`, `VMFSSPARSE`, `SESPARSE`, `VMFSRDM`, `FLAT`, `SPARSE`, `ZERO`...
    pub kind: String,
    /// `""` for extents without a file (`ZERO`).
    pub file: String,
    pub offset: u64,
}

/// A parsed VMDK descriptor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub create_type: String,
    pub extents: Vec<Extent>,
    /// `ddb.thinProvisioned = "1"`.
    pub thin: bool,
    pub adapter_type: String,
    /// Set on snapshot deltas (`vmfsSparse`, `seSparse`).
    pub parent_file_name_hint: Option<String>,
}

impl Descriptor {
    /// Sum of the extents' sizes in bytes (saturating).
    pub fn capacity_bytes(&self) -> u64 {
        self.extents.iter().fold(0u64, |acc, e| acc.saturating_add(e.sectors.saturating_mul(512)))
    }
}

fn parse_extent(line: &str) -> Option<Extent> {
    let mut tokens = line.split_whitespace();
    let access = tokens.next()?;
    if !["RW", "RDONLY", "NOACCESS"].iter().any(|a| access.eq_ignore_ascii_case(a)) {
        return None;
    }
    let sectors: u64 = tokens.next()?.parse().ok()?;
    let kind = tokens.next().unwrap_or("").trim_matches('"');
    let (file, after_file) = match line.find('"') {
        Some(first) => {
            let after = line.get(first.saturating_add(1)..).unwrap_or("");
            match after.rfind('"') {
                Some(last) => {
                    (after.get(..last).unwrap_or(""), after.get(last.saturating_add(1)..).unwrap_or(""))
                }
                None => (after, ""),
            }
        }
        None => ("", ""),
    };
    let offset = after_file.split_whitespace().next().and_then(|o| o.parse().ok()).unwrap_or(0);
    Some(Extent {
        access: access.to_ascii_uppercase(),
        sectors,
        kind: kind.to_string(),
        file: file.to_string(),
        offset,
    })
}

fn unquote(v: &str) -> &str {
    let v = v.trim();
    match v.strip_prefix('"') {
        Some(inner) => inner.get(..inner.rfind('"').unwrap_or(inner.len())).unwrap_or(inner),
        None => v,
    }
}

/// Parses a VMDK text descriptor. `None` if it has neither a `createType` nor
/// an extent line (e.g. binary data).
pub fn parse_descriptor(text: &str) -> Option<Descriptor> {
    let mut d = Descriptor::default();
    let mut has_create_type = false;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(extent) = parse_extent(line) {
            d.extents.push(extent);
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        let key = k.trim();
        let value = unquote(v);
        if key.eq_ignore_ascii_case("createType") {
            d.create_type = value.to_string();
            has_create_type = true;
        } else if key.eq_ignore_ascii_case("parentFileNameHint") {
            d.parent_file_name_hint = Some(value.to_string());
        } else if key.eq_ignore_ascii_case("ddb.adapterType") {
            d.adapter_type = value.to_string();
        } else if key.eq_ignore_ascii_case("ddb.thinProvisioned") {
            d.thin = value.trim() == "1" || value.trim().eq_ignore_ascii_case("true");
        }
    }
    if has_create_type || !d.extents.is_empty() { Some(d) } else { None }
}

// ---------------------------------------------------------------------------
// Version
// ---------------------------------------------------------------------------

/// `vmware -v` -> `VMware ESXi 8.0.2 build-22380479`. Also accepts
/// `esxcli system version get` (`Product:`, `Version:`, `Build:` lines) and
/// builds the same form from it.
pub fn parse_version(text: &str) -> Option<String> {
    if let Some(line) =
        text.lines().map(str::trim).find(|l| l.starts_with("VMware ") && !l.contains(':') && l.len() > 7)
    {
        return Some(line.to_string());
    }
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim()).filter(|v| !v.is_empty())
        })
    };
    let product = field("Product")?;
    let version = field("Version")?;
    let mut out = format!("{product} {version}");
    if let Some(build) = field("Build") {
        let lower = build.to_ascii_lowercase();
        let build = match lower.find("build-") {
            Some(i) => build.get(i.saturating_add("build-".len())..).unwrap_or(build),
            None => build,
        };
        out.push_str(" build-");
        out.push_str(build);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // ----- samples copied from the ESXi facts notes -----

    const GETALLVMS: &str = "\
Vmid          Name                               File                             Guest OS       Version   Annotation
1      ubuntu-desktop       [HDD] ubuntu-desktop/ubuntu-desktop.vmx           ubuntu64Guest      vmx-13
3      windows-7            [HDD] windows-7/windows-7.vmx                     windows7_64Guest   vmx-13
";

    const POWER_ON: &str = "Retrieved runtime info\nPowered on\n";

    /// As it appears in the notes, indented by the markdown list.
    const RESET_FAULT_INDENTED: &str = r#"  Reset VM:
  Reset failed: (vim.fault.InvalidPowerState) {
     faultCause = (vmodl.MethodFault) null, 
     faultMessage = <unset>, 
     requestedState = "poweredOn", 
     existingState = "poweredOff"
     msg = "The attempted operation cannot be performed in the current state (Powered off)."
  }
"#;

    /// The same output as the host prints it (list indentation removed).
    const RESET_FAULT: &str = r#"Reset VM:
Reset failed: (vim.fault.InvalidPowerState) {
   faultCause = (vmodl.MethodFault) null, 
   faultMessage = <unset>, 
   requestedState = "poweredOn", 
   existingState = "poweredOff"
   msg = "The attempted operation cannot be performed in the current state (Powered off)."
}
"#;

    const NOT_FOUND: &str = r#"(vim.fault.NotFound) {
   faultCause = (vmodl.MethodFault) null,
   faultMessage = <unset>
   msg = "Unable to find a VM corresponding to "2""
}
"#;

    const GUEST: &str = r#"Guest information:

(vim.vm.GuestInfo) {
   toolsStatus = "toolsOk", 
   toolsRunningStatus = "guestToolsRunning", 
   guestId = "debian10_64Guest", 
   ipAddress = "192.168.200.9", 
   net = (vim.vm.GuestInfo.NicInfo) [
      (vim.vm.GuestInfo.NicInfo) {
         network = "Kubernetes Network", 
         ipAddress = (string) [
            "192.168.200.9", 
            "fe80::20c:29ff:fe62:e86d"
         ], 
         macAddress = "00:0c:29:62:e8:6d"
      }
   ], 
   guestState = "running"
}
"#;

    const SNAPSHOTS: &str = "\
Get Snapshot:
|-ROOT
--Snapshot Name        : snap0
--Snapshot Id        : 5
--Snapshot Desciption  : clush configured
tmp and all traces of mapr removed
--Snapshot Created On  : 11/29/2017 23:59:6
--Snapshot State       : powered on
--|-CHILD
----Snapshot Name        : finish_naigos_install
----Snapshot Id        : 6
";

    const MESSAGE: &str = "\
Virtual machine message 12: msg.uuid.altered:This virtual machine may have been moved or copied.
0. Cancel (Cancel) 1. I _moved it (I _moved it) 2. I _copied it (I _copied it) [default]
";

    const VMX: &str = r#"displayName = "esx6.7-rhel8.6-nvme-disk"
guestOS = "rhel8-64"
memSize = "2048"
numvcpus = "2"
firmware = "efi"
scsi0.virtualDev = "pvscsi"
scsi0:0.deviceType = "scsi-hardDisk"
scsi0:0.fileName = "Fedora-20.vmdk"
nvme0:0.fileName = "nvme-disk.vmdk"
sata0:0.deviceType = "cdrom-image"
sata0:0.fileName = "/vmfs/volumes/5458b680-…/ISOs/Fedora-20-x86_64-netinst.iso"
ethernet0.virtualDev = "vmxnet3"
ethernet0.networkName = "VM Network"
ethernet0.addressType = "vpx"
ethernet0.generatedAddress = "00:50:56:9b:5f:0d"
uuid.bios = "42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b"
"#;

    const DESCRIPTOR: &str = r#"# Disk DescriptorFile
version=1
encoding="UTF-8"
CID=fffffffe
parentCID=ffffffff
createType="vmfs"

# Extent description
RW 4194304 VMFS "vm-flat.vmdk"

# The Disk Data Base
#DDB
ddb.adapterType = "lsilogic"
ddb.thinProvisioned = "1"
ddb.virtualHWVersion = "13"
"#;

    // ----- realistic outputs assembled from the notes' descriptions -----

    const SUMMARY: &str = r#"Listsummary:

(vim.vm.Summary) {
   vm = 'vim.VirtualMachine:4', 
   runtime = (vim.vm.RuntimeInfo) {
      device = (vim.vm.DeviceRuntimeInfo) [
         (vim.vm.DeviceRuntimeInfo) {
            runtimeState = (vim.vm.DeviceRuntimeInfo.VirtualEthernetCardRuntimeState) {
               vmDirectPathGen2Active = false, 
               vmDirectPathGen2InactiveReasonVm = (string) [
                  "vmNptIncompatibleAdapterType"
               ], 
               reservationStatus = <unset>, 
            }, 
            key = 4000
         }
      ], 
      host = 'vim.HostSystem:ha-host', 
      connectionState = "connected", 
      powerState = "poweredOn", 
      faultToleranceState = "notConfigured", 
      dasVmProtection = (vim.vm.RuntimeInfo.DasProtectionState) null, 
      bootTime = "2023-05-02T10:11:12.123456Z", 
      question = (vim.vm.QuestionInfo) null, 
      maxMemoryUsage = 2048, 
      consolidationNeeded = false, 
      featureMask = (vim.host.FeatureMask) [], 
   }, 
   guest = (vim.vm.Summary.GuestSummary) {
      guestId = "debian10_64Guest", 
      toolsStatus = "toolsOk", 
      hostName = "web01", 
      ipAddress = "192.168.200.9", 
   }, 
   config = (vim.vm.Summary.ConfigSummary) {
      name = "web 01", 
      template = false, 
      vmPathName = "[datastore1] web 01/web 01.vmx", 
      memorySizeMB = 4096, 
      numCpu = 2, 
      numEthernetCards = 1, 
      numVirtualDisks = 1, 
      uuid = "564d8a6e-2c3b-1f5e-8f0a-9a3c2b1d0e4f", 
      instanceUuid = "52b1c4aa-6a2e-3b8f-1c2d-3e4f5a6b7c8d", 
      guestId = "debian10_64Guest", 
      annotation = "Owner: web team
says "hi", with a comma", 
      product = (vim.vApp.ProductInfo) null, 
      ftInfo = (vim.vm.FaultToleranceConfigInfo) null, 
      hwVersion = "vmx-13"
   }, 
   storage = (vim.vm.Summary.StorageSummary) {
      committed = 4563746816, 
      uncommitted = 17179869184, 
      unshared = 4563746816, 
   }, 
   overallStatus = "green", 
   customValue = (vim.CustomFieldsManager.Value) []
}
"#;

    const GUEST_NO_TOOLS: &str = r#"Guest information:

(vim.vm.GuestInfo) {
   dynamicType = <unset>,
   toolsStatus = "toolsNotInstalled",
   toolsRunningStatus = "guestToolsNotRunning",
   guestId = <unset>,
   ipAddress = <unset>,
   net = (vim.vm.GuestInfo.NicInfo) [],
   guestState = "notRunning",
}
"#;

    const ESXCLI_VERSION: &str = "   Product: VMware ESXi
   Version: 8.0.2
   Build: Releasebuild-22380479
   Update: 2
   Patch: 0
";

    fn entry(vmid: &str, name: &str, ds: &str, path: &str, guest: &str, version: &str) -> VmListEntry {
        VmListEntry {
            vmid: vmid.into(),
            name: name.into(),
            datastore: ds.into(),
            vmx_path: path.into(),
            guest_id: guest.into(),
            version: version.into(),
            annotation: String::new(),
        }
    }

    // ----- getallvms -----

    #[test]
    fn getallvms_parses_sample_despite_header_width_mismatch() {
        assert_eq!(
            parse_getallvms(GETALLVMS),
            vec![
                entry(
                    "1",
                    "ubuntu-desktop",
                    "HDD",
                    "ubuntu-desktop/ubuntu-desktop.vmx",
                    "ubuntu64Guest",
                    "vmx-13"
                ),
                entry("3", "windows-7", "HDD", "windows-7/windows-7.vmx", "windows7_64Guest", "vmx-13"),
            ]
        );
    }

    #[test]
    fn getallvms_keeps_names_with_spaces_and_quotes() {
        let text = "\
Vmid                 Name                                          File                                        Guest OS          Version      Annotation
2      VMware vCenter Server 8   [datastore 1] VMware vCenter Server 8/VMware vCenter Server 8.vmx   vmwarePhoton64Guest   vmx-10   VMware vCenter Server Appliance
7      x'; rm -rf /; '           [datastore 1] x'; rm -rf |2f; '/x'; rm -rf |2f; '.vmx               otherLinux64Guest     vmx-19   
8      say \"hi\" `id`             [ssd] say \"hi\" `id`/say \"hi\" `id`.vmx                           windows2019srv_64Guest   vmx-19   a \"quoted\" note
";
        let vms = parse_getallvms(text);
        assert_eq!(vms.len(), 3, "{vms:#?}");
        let v0 = vms.first().expect("row");
        assert_eq!(v0.name, "VMware vCenter Server 8");
        assert_eq!(v0.datastore, "datastore 1");
        assert_eq!(v0.vmx_path, "VMware vCenter Server 8/VMware vCenter Server 8.vmx");
        assert_eq!(v0.guest_id, "vmwarePhoton64Guest");
        assert_eq!(v0.version, "vmx-10");
        assert_eq!(v0.annotation, "VMware vCenter Server Appliance");
        let v1 = vms.get(1).expect("row");
        assert_eq!(v1.vmid, "7");
        assert_eq!(v1.name, "x'; rm -rf /; '");
        assert_eq!(v1.vmx_path, "x'; rm -rf |2f; '/x'; rm -rf |2f; '.vmx");
        assert_eq!(v1.annotation, "");
        let v2 = vms.get(2).expect("row");
        assert_eq!(v2.name, "say \"hi\" `id`");
        assert_eq!(v2.datastore, "ssd");
        assert_eq!(v2.guest_id, "windows2019srv_64Guest");
        assert_eq!(v2.annotation, "a \"quoted\" note");
    }

    #[test]
    fn getallvms_accepts_empty_datastore_of_system_vms() {
        let text = "Vmid   Name   File   Guest OS   Version   Annotation\n\
                    9      vCLS-0f1e2d3c   [] /var/run/crx/infra/vCLS-…/vCLS-….vmx   otherLinux64Guest   vmx-11   vSphere Cluster Service VM\n";
        let vms = parse_getallvms(text);
        assert_eq!(vms.len(), 1);
        let v = vms.first().expect("row");
        assert_eq!(v.datastore, "");
        assert_eq!(v.vmx_path, "/var/run/crx/infra/vCLS-…/vCLS-….vmx");
        assert_eq!(v.annotation, "vSphere Cluster Service VM");
    }

    #[test]
    fn getallvms_ignores_skipping_invalid_vm_lines() {
        let text = format!("Skipping invalid VM '6'\nSkipping invalid VM '11'\n{GETALLVMS}");
        let vms = parse_getallvms(&text);
        assert_eq!(vms.iter().map(|v| v.vmid.as_str()).collect::<Vec<_>>(), ["1", "3"]);
        assert!(vms.iter().all(|v| v.annotation.is_empty()));
    }

    #[test]
    fn getallvms_empty_annotation_with_trailing_blanks_is_empty() {
        let text = "1      web   [ds1] web/web.vmx   centos64Guest   vmx-14      \n\n   \n";
        let vms = parse_getallvms(text);
        assert_eq!(vms, vec![entry("1", "web", "ds1", "web/web.vmx", "centos64Guest", "vmx-14")]);
    }

    #[test]
    fn getallvms_joins_multi_line_annotations() {
        let text = "\
Vmid   Name   File   Guest OS   Version   Annotation
4      db     [ds1] db/db.vmx   debian10_64Guest   vmx-15   Primary database
owner: data team

2 disks, see   wiki
5      app    [ds1] app/app.vmx   debian10_64Guest   vmx-15   
  
";
        let vms = parse_getallvms(text);
        assert_eq!(vms.len(), 2, "{vms:#?}");
        assert_eq!(
            vms.first().expect("db").annotation,
            "Primary database\nowner: data team\n\n2 disks, see   wiki"
        );
        assert_eq!(vms.get(1).expect("app").annotation, "");
    }

    #[test]
    fn getallvms_annotation_keeps_inner_wide_spacing_and_missing_guest() {
        let text = "12   tmpl   [ds] tmpl/tmpl.vmx   vmx-08   notes   with   gaps\n";
        let vms = parse_getallvms(text);
        let v = vms.first().expect("row");
        assert_eq!(v.guest_id, "");
        assert_eq!(v.version, "vmx-08");
        assert_eq!(v.annotation, "notes   with   gaps");
    }

    #[test]
    fn getallvms_of_nothing_or_a_fault_is_empty() {
        assert!(parse_getallvms("").is_empty());
        assert!(parse_getallvms(NOT_FOUND).is_empty());
        assert!(parse_getallvms("Vmid   Name   File   Guest OS   Version   Annotation\n").is_empty());
    }

    // ----- power state -----

    #[test]
    fn power_state_reads_sample() {
        assert_eq!(parse_power_state(POWER_ON), Some(SourcePowerState::PoweredOn));
        assert_eq!(
            parse_power_state("  Retrieved runtime info\n  Powered on\n"),
            Some(SourcePowerState::PoweredOn)
        );
    }

    #[test]
    fn power_state_reads_off_and_suspended() {
        assert_eq!(
            parse_power_state("Retrieved runtime info\nPowered off\n"),
            Some(SourcePowerState::PoweredOff)
        );
        assert_eq!(
            parse_power_state("Retrieved runtime info\r\nSuspended\r\n"),
            Some(SourcePowerState::Suspended)
        );
    }

    #[test]
    fn power_state_is_none_when_unrecognised() {
        assert_eq!(parse_power_state("Powering on VM:\n"), None);
        assert_eq!(parse_power_state("Powering off VM:\n"), None);
        assert_eq!(parse_power_state(NOT_FOUND), None);
        assert_eq!(parse_power_state(""), None);
    }

    // ----- faults -----

    #[test]
    fn fault_not_found_keeps_unescaped_inner_quotes() {
        assert_eq!(
            parse_fault(NOT_FOUND),
            Some(Fault {
                kind: "vim.fault.NotFound".into(),
                msg: "Unable to find a VM corresponding to \"2\"".into()
            })
        );
    }

    #[test]
    fn fault_is_found_after_reset_failed_prefix() {
        let expected = Some(Fault {
            kind: "vim.fault.InvalidPowerState".into(),
            msg: "The attempted operation cannot be performed in the current state (Powered off).".into(),
        });
        assert_eq!(parse_fault(RESET_FAULT), expected);
        assert_eq!(parse_fault(RESET_FAULT_INDENTED), expected);
    }

    #[test]
    fn fault_of_older_hosts_with_dynamic_type_and_commas() {
        let text = "(vmodl.fault.ManagedObjectNotFound) {\n   dynamicType = <unset>,\n   faultCause = (vmodl.MethodFault) null,\n   obj = 'vim.VirtualMachine:42',\n   msg = \"The object has already been deleted or has not been completely created\",\n}\n";
        let f = parse_fault(text).expect("fault");
        assert_eq!(f.kind, "vmodl.fault.ManagedObjectNotFound");
        assert_eq!(f.msg, "The object has already been deleted or has not been completely created");
    }

    #[test]
    fn fault_prefers_its_own_msg_over_a_nested_cause() {
        let text = "(vim.fault.TaskInProgress) {\n   faultCause = (vmodl.MethodFault) {\n      msg = \"inner\"\n   },\n   msg = \"outer\"\n}\n";
        assert_eq!(parse_fault(text).expect("fault").msg, "outer");
        let only_nested = "(vim.fault.TaskInProgress) {\n   faultCause = (vmodl.MethodFault) {\n      msg = \"inner\"\n   }\n}\n";
        assert_eq!(parse_fault(only_nested).expect("fault").msg, "inner");
    }

    #[test]
    fn fault_recognises_tools_not_running_sentence() {
        let text = "Cannot complete operation because VMware Tools is not running in this virtual machine.\n";
        assert_eq!(
            parse_fault(text),
            Some(Fault {
                kind: "vim.fault.ToolsUnavailable".into(),
                msg: "Cannot complete operation because VMware Tools is not running in this virtual machine."
                    .into(),
            })
        );
        let block = "(vim.fault.ToolsUnavailable) {\n   faultCause = (vmodl.MethodFault) null, \n   faultMessage = <unset>, \n   msg = \"Cannot complete operation because VMware Tools is not running in this virtual machine.\"\n}\n";
        assert_eq!(parse_fault(block), parse_fault(text));
    }

    #[test]
    fn fault_is_none_for_normal_outputs() {
        for text in [POWER_ON, GETALLVMS, GUEST, SUMMARY, SNAPSHOTS, MESSAGE, "", "Powering on VM:\n"] {
            assert_eq!(parse_fault(text), None, "{text}");
        }
    }

    #[test]
    fn fault_block_without_msg_has_empty_msg() {
        let f = parse_fault("(vim.fault.InvalidState) {\n   faultMessage = <unset>\n}").expect("fault");
        assert_eq!(f, Fault { kind: "vim.fault.InvalidState".into(), msg: String::new() });
    }

    // ----- snapshots -----

    #[test]
    fn snapshots_none_when_only_header() {
        assert!(parse_snapshots("Get Snapshot:").is_empty());
        assert!(parse_snapshots("Get Snapshot:\n").is_empty());
    }

    #[test]
    fn snapshots_sample_nesting_misspelling_and_wrapped_description() {
        assert_eq!(
            parse_snapshots(SNAPSHOTS),
            vec![
                Snapshot {
                    name: "snap0".into(),
                    id: "5".into(),
                    depth: 0,
                    description: "clush configured\ntmp and all traces of mapr removed".into(),
                    created: "11/29/2017 23:59:6".into(),
                    state: "powered on".into(),
                },
                Snapshot {
                    name: "finish_naigos_install".into(),
                    id: "6".into(),
                    depth: 1,
                    ..Snapshot::default()
                },
            ]
        );
    }

    #[test]
    fn snapshots_three_levels_and_siblings() {
        let text = "\
Get Snapshot:
|-ROOT
--Snapshot Name        : a
--Snapshot Id        : 1
--Snapshot Desciption  : 
--Snapshot Created On  : 1/2/2024 3:4:5
--Snapshot State       : powered off
--|-CHILD
----Snapshot Name        : b
----Snapshot Id        : 2
----Snapshot Desciption  : - dashed line follows
- not a label: really
----Snapshot State       : powered off
----|-CHILD
------Snapshot Name        : c
------Snapshot Id        : 3
--|-CHILD
----Snapshot Name        : d
----Snapshot Id        : 4
";
        let snaps = parse_snapshots(text);
        let summary: Vec<(&str, &str, usize)> =
            snaps.iter().map(|s| (s.name.as_str(), s.id.as_str(), s.depth)).collect();
        assert_eq!(summary, [("a", "1", 0), ("b", "2", 1), ("c", "3", 2), ("d", "4", 1)]);
        assert_eq!(snaps.get(1).expect("b").description, "- dashed line follows\n- not a label: really");
        assert_eq!(snaps.first().expect("a").description, "");
    }

    // ----- message -----

    #[test]
    fn message_none_when_no_message() {
        assert_eq!(parse_message("No message.\n"), None);
        assert_eq!(parse_message(""), None);
        assert_eq!(parse_message(NOT_FOUND), None);
    }

    #[test]
    fn message_returns_question_text_of_sample() {
        assert_eq!(
            parse_message(MESSAGE).as_deref(),
            Some("msg.uuid.altered:This virtual machine may have been moved or copied.")
        );
    }

    #[test]
    fn message_text_may_follow_on_the_next_line() {
        let text = "Virtual machine message _vmx1:\nmsg.hbacommon.outofspace:There is no more space for virtual disk web.vmdk.\n0. Retry (Retry) 1. Cancel (Cancel)\n";
        assert_eq!(
            parse_message(text).as_deref(),
            Some("msg.hbacommon.outofspace:There is no more space for virtual disk web.vmdk.")
        );
    }

    // ----- VMODL -----

    #[test]
    fn vmodl_parses_guest_sample_structure() {
        let v = parse_vmodl(GUEST).expect("object");
        assert_eq!(v.type_name(), Some("vim.vm.GuestInfo"));
        assert_eq!(v.field("toolsStatus"), Some(&Vmodl::Str("toolsOk".into())));
        let net = v.field("net").expect("net");
        assert_eq!(net.type_name(), Some("vim.vm.GuestInfo.NicInfo"));
        let nic = net.items().first().expect("nic");
        assert_eq!(
            nic.field("ipAddress"),
            Some(&Vmodl::Array {
                type_name: "string".into(),
                items: vec![
                    Vmodl::Str("192.168.200.9".into()),
                    Vmodl::Str("fe80::20c:29ff:fe62:e86d".into())
                ],
            })
        );
        assert_eq!(v.field("guestState").and_then(Vmodl::as_str), Some("running"));
    }

    #[test]
    fn vmodl_reads_refs_unset_typed_nulls_scalars_and_empty_arrays() {
        let v = parse_vmodl(SUMMARY).expect("object");
        assert_eq!(v.field("vm"), Some(&Vmodl::Ref("vim.VirtualMachine:4".into())));
        assert_eq!(v.path(&["runtime", "question"]), Some(&Vmodl::Null));
        assert_eq!(v.path(&["runtime", "maxMemoryUsage"]), Some(&Vmodl::Scalar("2048".into())));
        assert_eq!(v.path(&["runtime", "consolidationNeeded"]), Some(&Vmodl::Scalar("false".into())));
        assert_eq!(
            v.path(&["runtime", "featureMask"]),
            Some(&Vmodl::Array { type_name: "vim.host.FeatureMask".into(), items: vec![] })
        );
        assert_eq!(
            v.path(&["runtime", "device"]).map(|d| d.items().len()),
            Some(1),
            "trailing comma before the closing brace"
        );
        assert_eq!(v.path(&["storage", "uncommitted"]).and_then(Vmodl::as_str), Some("17179869184"));
        assert_eq!(v.field("overallStatus").and_then(Vmodl::as_str), Some("green"));
        let fault = parse_vmodl(NOT_FOUND).expect("fault object");
        assert_eq!(fault.field("faultMessage"), Some(&Vmodl::Unset));
        assert_eq!(fault.field("faultCause"), Some(&Vmodl::Null));
    }

    #[test]
    fn vmodl_finds_first_object_after_prefix_text() {
        let v = parse_vmodl(RESET_FAULT).expect("object");
        assert_eq!(v.type_name(), Some("vim.fault.InvalidPowerState"));
        assert_eq!(v.field("existingState").and_then(Vmodl::as_str), Some("poweredOff"));
        assert_eq!(
            v.field("msg").and_then(Vmodl::as_str),
            Some("The attempted operation cannot be performed in the current state (Powered off).")
        );
    }

    #[test]
    fn vmodl_is_none_without_an_object() {
        assert_eq!(parse_vmodl(""), None);
        assert_eq!(parse_vmodl("Guest information:\n"), None);
        assert_eq!(parse_vmodl("(vim.vm.QuestionInfo) null"), None);
    }

    #[test]
    fn vmodl_returns_what_it_read_when_truncated() {
        let cut = GUEST.get(..GUEST.find("net =").expect("net")).expect("prefix");
        let v = parse_vmodl(cut).expect("partial");
        assert_eq!(v.field("ipAddress").and_then(Vmodl::as_str), Some("192.168.200.9"));
        assert_eq!(v.field("net"), None);
    }

    #[test]
    fn vmodl_deep_nesting_is_bounded() {
        let deep = "(t) {\n a = (t) {\n".repeat(50_000);
        assert_eq!(parse_vmodl(&deep), None);
        let arrays = format!("(t) {{ a = {}", "(t) [".repeat(100_000));
        assert_eq!(parse_vmodl(&arrays), None);
        let ok = format!("(t) {{\n{}{}}}", "a = (t) {\n".repeat(30), "}\n".repeat(30));
        assert!(parse_vmodl(&ok).is_some());
    }

    // ----- get.guest / get.summary -----

    #[test]
    fn guest_info_reads_sample() {
        let g = parse_guest_info(GUEST).expect("guest");
        assert_eq!(
            g,
            GuestInfo {
                tools_status: "toolsOk".into(),
                tools_running_status: "guestToolsRunning".into(),
                guest_id: "debian10_64Guest".into(),
                ip_address: Some("192.168.200.9".into()),
                nics: vec![GuestNic {
                    network: "Kubernetes Network".into(),
                    mac_address: "00:0c:29:62:e8:6d".into(),
                    ip_addresses: vec!["192.168.200.9".into(), "fe80::20c:29ff:fe62:e86d".into()],
                }],
                guest_state: "running".into(),
            }
        );
        assert!(g.tools_running());
    }

    #[test]
    fn guest_info_without_tools_has_no_ip_and_tools_not_running() {
        let g = parse_guest_info(GUEST_NO_TOOLS).expect("guest");
        assert_eq!(g.tools_status, "toolsNotInstalled");
        assert_eq!(g.ip_address, None);
        assert_eq!(g.guest_id, "");
        assert!(g.nics.is_empty());
        assert_eq!(g.guest_state, "notRunning");
        assert!(!g.tools_running());
    }

    #[test]
    fn guest_info_and_summary_are_none_for_faults_and_empty_output() {
        assert_eq!(parse_guest_info(NOT_FOUND), None);
        assert_eq!(parse_guest_info("Guest information:\n"), None);
        assert_eq!(parse_summary(NOT_FOUND), None);
        assert_eq!(parse_summary(""), None);
    }

    #[test]
    fn summary_reads_nested_runtime_and_config_fields() {
        assert_eq!(
            parse_summary(SUMMARY),
            Some(Summary {
                power_state: "poweredOn".into(),
                name: "web 01".into(),
                vmx_path: "[datastore1] web 01/web 01.vmx".into(),
                memory_mb: 4096,
                num_cpu: 2,
                uuid: "564d8a6e-2c3b-1f5e-8f0a-9a3c2b1d0e4f".into(),
                annotation: "Owner: web team\nsays \"hi\", with a comma".into(),
            })
        );
        let vmx_path = parse_summary(SUMMARY).map(|s| s.vmx_path).unwrap_or_default();
        assert_eq!(split_datastore_path(&vmx_path), ("datastore1", "web 01/web 01.vmx"));
    }

    // ----- .vmx -----

    #[test]
    fn vmx_sample_facts() {
        let vmx = parse_vmx(VMX);
        assert_eq!(vmx.get("uuid.bios"), Some("42 1b 4b 87 e6 b7 d8 81-07 a0 c9 d2 21 cd 3c 6b"));
        assert_eq!(
            vmx_facts(&vmx),
            VmxFacts {
                display_name: "esx6.7-rhel8.6-nvme-disk".into(),
                guest_os: "rhel8-64".into(),
                memory_mib: 2048,
                num_cpus: 2,
                cores_per_socket: 1,
                firmware: Firmware::Efi,
                secure_boot: false,
                disks: vec![
                    VmxDisk {
                        device: "scsi0:0".into(),
                        bus: "scsi".into(),
                        file_name: "Fedora-20.vmdk".into(),
                        mode: String::new(),
                        controller_model: "pvscsi".into(),
                    },
                    VmxDisk {
                        device: "nvme0:0".into(),
                        bus: "nvme".into(),
                        file_name: "nvme-disk.vmdk".into(),
                        mode: String::new(),
                        controller_model: String::new(),
                    },
                ],
                nics: vec![VmxNic {
                    device: "ethernet0".into(),
                    model: "vmxnet3".into(),
                    network: "VM Network".into(),
                    mac_address: "00:50:56:9b:5f:0d".into(),
                }],
            }
        );
    }

    #[test]
    fn vmx_handles_encoding_line_escapes_equals_and_garbage() {
        let text = ".encoding = \"UTF-8\"\n\
                    # a comment = \"no\"\n\
                    \n\
                    garbage without equals\n\
                    bad key = \"x\"\n\
                    annotation = \"say |22hi|22 |7C a=b |0Anext |zz |\"\n\
                    displayName = \"caf\u{e9} = bar\"\n\
                    unquoted = plain value\n\
                    dup = \"first\"\n\
                    DUP = \"second\"\n";
        let vmx = parse_vmx(text);
        assert_eq!(vmx.get(".encoding"), Some("UTF-8"));
        assert_eq!(vmx.get("annotation"), Some("say \"hi\" | a=b \nnext |zz |"));
        assert_eq!(vmx.get("DISPLAYNAME"), Some("caf\u{e9} = bar"));
        assert_eq!(vmx.get("unquoted"), Some("plain value"));
        assert_eq!(vmx.get("dup"), Some("second"));
        assert_eq!(vmx.get("bad key"), None);
        assert_eq!(vmx.entries.len(), 5, "{:?}", vmx.entries);
        assert!(vmx.entries.keys().all(|k| k == &k.to_ascii_lowercase()));
    }

    #[test]
    fn vmx_booleans_are_case_insensitive() {
        let vmx = parse_vmx("a = \"TRUE\"\nb = \"true\"\nc = \"False\"\nd = \"FALSE\"\ne = \"maybe\"\n");
        assert_eq!(vmx.get_bool("A"), Some(true));
        assert_eq!(vmx.get_bool("b"), Some(true));
        assert_eq!(vmx.get_bool("c"), Some(false));
        assert_eq!(vmx.get_bool("d"), Some(false));
        assert_eq!(vmx.get_bool("e"), None);
        assert_eq!(vmx.get_bool("missing"), None);
    }

    #[test]
    fn vmx_static_mac_is_used_and_lowercased() {
        let vmx = parse_vmx(
            "ethernet1.present = \"TRUE\"\nethernet1.addressType = \"static\"\nethernet1.address = \"00:50:56:AA:BB:CC\"\nethernet1.generatedAddress = \"00:0c:29:00:00:01\"\nethernet1.networkName = \"Prod\"\n",
        );
        let nics = vmx_facts(&vmx).nics;
        assert_eq!(
            nics,
            vec![VmxNic {
                device: "ethernet1".into(),
                model: "e1000".into(),
                network: "Prod".into(),
                mac_address: "00:50:56:aa:bb:cc".into(),
            }]
        );
    }

    #[test]
    fn vmx_absent_numvcpus_memsize_and_firmware_take_defaults() {
        let f = vmx_facts(&parse_vmx("displayName = \"tiny\"\ncpuid.coresPerSocket = \"0\"\n"));
        assert_eq!(f.num_cpus, 1);
        assert_eq!(f.cores_per_socket, 1);
        assert_eq!(f.memory_mib, 0);
        assert_eq!(f.firmware, Firmware::Bios);
        assert!(!f.secure_boot);
        assert!(f.disks.is_empty() && f.nics.is_empty());
        let f = vmx_facts(&parse_vmx(
            "numvcpus = \"8\"\ncpuid.coresPerSocket = \"4\"\nfirmware = \"EFI\"\nuefi.secureBoot.enabled = \"TRUE\"\n",
        ));
        assert_eq!((f.num_cpus, f.cores_per_socket, f.firmware, f.secure_boot), (8, 4, Firmware::Efi, true));
    }

    #[test]
    fn vmx_cdroms_are_not_disks() {
        let vmx = parse_vmx(
            "ide1:0.present = \"TRUE\"\nide1:0.deviceType = \"atapi-cdrom\"\nide1:0.fileName = \"/vmfs/devices/cdrom/mpx.vmhba32:C0:T0:L0\"\n\
             sata0:1.deviceType = \"cdrom-raw\"\nsata0:1.fileName = \"auto detect\"\n\
             sata0:0.deviceType = \"cdrom-image\"\nsata0:0.fileName = \"/vmfs/volumes/ds/iso/x.iso\"\n\
             ide0:0.fileName = \"boot.vmdk\"\n",
        );
        let disks = vmx_facts(&vmx).disks;
        assert_eq!(disks.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["ide0:0"]);
    }

    #[test]
    fn vmx_disks_ordered_scsi_sata_nvme_ide_then_numeric() {
        let vmx = parse_vmx(
            "ide0:1.fileName = \"i01.vmdk\"\nnvme0:0.fileName = \"n00.vmdk\"\nsata0:2.fileName = \"s02.vmdk\"\n\
             scsi10:0.fileName = \"c10-0.vmdk\"\nscsi2:0.fileName = \"c2-0.vmdk\"\nscsi0:10.fileName = \"c0-10.vmdk\"\n\
             scsi0:2.fileName = \"c0-2.vmdk\"\nscsi0:2.mode = \"independent-persistent\"\nscsi2.virtualDev = \"lsisas1068\"\n\
             scsi0.virtualDev = \"lsilogic\"\nsata0:0.fileName = \"s00.vmdk\"\nscsi0:x.fileName = \"bad.vmdk\"\n\
             ethernet10.virtualDev = \"e1000e\"\nethernet2.virtualDev = \"vmxnet3\"\n",
        );
        let f = vmx_facts(&vmx);
        let order: Vec<&str> = f.disks.iter().map(|d| d.device.as_str()).collect();
        assert_eq!(
            order,
            ["scsi0:2", "scsi0:10", "scsi2:0", "scsi10:0", "sata0:0", "sata0:2", "nvme0:0", "ide0:1"]
        );
        let first = f.disks.first().expect("disk");
        assert_eq!(
            (first.mode.as_str(), first.controller_model.as_str()),
            ("independent-persistent", "lsilogic")
        );
        assert_eq!(f.disks.get(2).map(|d| d.controller_model.as_str()), Some("lsisas1068"));
        assert_eq!(f.disks.get(3).map(|d| d.controller_model.as_str()), Some(""));
        assert_eq!(f.disks.get(4).map(|d| d.bus.as_str()), Some("sata"));
        let nics: Vec<(&str, &str)> = f.nics.iter().map(|n| (n.device.as_str(), n.model.as_str())).collect();
        assert_eq!(nics, [("ethernet2", "vmxnet3"), ("ethernet10", "e1000e")]);
    }

    #[test]
    fn vmx_present_false_skips_disks_and_nics() {
        let vmx = parse_vmx(
            "scsi0:0.present = \"TRUE\"\nscsi0:0.fileName = \"a.vmdk\"\nscsi0:1.present = \"FALSE\"\nscsi0:1.fileName = \"b.vmdk\"\n\
             scsi1.present = \"false\"\nscsi1:0.fileName = \"c.vmdk\"\n\
             ethernet0.present = \"FALSE\"\nethernet0.virtualDev = \"vmxnet3\"\nethernet1.present = \"TRUE\"\n\
             ethernet1.generatedAddress = \"00:0C:29:AB:CD:EF\"\n",
        );
        let f = vmx_facts(&vmx);
        assert_eq!(f.disks.iter().map(|d| d.file_name.as_str()).collect::<Vec<_>>(), ["a.vmdk"]);
        assert_eq!(
            f.nics.iter().map(|n| (n.device.as_str(), n.mac_address.as_str())).collect::<Vec<_>>(),
            [("ethernet1", "00:0c:29:ab:cd:ef")]
        );
    }

    // ----- VMDK descriptors -----

    #[test]
    fn descriptor_sample_is_thin_vmfs_with_one_flat_extent() {
        let d = parse_descriptor(DESCRIPTOR).expect("descriptor");
        assert_eq!(
            d,
            Descriptor {
                create_type: "vmfs".into(),
                extents: vec![Extent {
                    access: "RW".into(),
                    sectors: 4_194_304,
                    kind: "VMFS".into(),
                    file: "vm-flat.vmdk".into(),
                    offset: 0,
                }],
                thin: true,
                adapter_type: "lsilogic".into(),
                parent_file_name_hint: None,
            }
        );
        assert_eq!(d.capacity_bytes(), 2 * 1024 * 1024 * 1024);
    }

    #[test]
    fn descriptor_flat_thick_disk_is_not_thin() {
        let text = "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\ncreateType=\"vmfs\"\n\n\
                    RW 20971520 VMFS \"web 01-flat.vmdk\"\n\nddb.adapterType = \"pvscsi\"\nddb.virtualHWVersion = \"19\"\n";
        let d = parse_descriptor(text).expect("descriptor");
        assert!(!d.thin);
        assert_eq!(d.adapter_type, "pvscsi");
        assert_eq!(d.extents.first().map(|e| e.file.as_str()), Some("web 01-flat.vmdk"));
        assert_eq!(d.capacity_bytes(), 10 * 1024 * 1024 * 1024);
    }

    #[test]
    fn descriptor_flat_extent_with_offset_and_multiple_extents() {
        let text = "createType=\"monolithicFlat\"\nRW 100 FLAT \"a-f001.vmdk\" 0\nRDONLY 50 FLAT \"a-f002.vmdk\" 2048\nRW 10 ZERO\n";
        let d = parse_descriptor(text).expect("descriptor");
        assert_eq!(d.extents.len(), 3);
        assert_eq!(d.extents.get(1).map(|e| (e.access.as_str(), e.offset)), Some(("RDONLY", 2048)));
        assert_eq!(d.extents.get(2).map(|e| (e.kind.as_str(), e.file.as_str())), Some(("ZERO", "")));
        assert_eq!(d.capacity_bytes(), 160 * 512);
    }

    #[test]
    fn descriptor_vmfs_sparse_delta_has_parent_hint() {
        let text = "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=a1b2c3d4\nparentCID=fffffffe\n\
                    createType=\"vmfsSparse\"\nparentFileNameHint=\"web 01.vmdk\"\n# Extent description\n\
                    RW 4194304 VMFSSPARSE \"web 01-000001-delta.vmdk\"\n\n# The Disk Data Base\n#DDB\n\n\
                    ddb.longContentID = \"0123456789abcdef\"\n";
        let d = parse_descriptor(text).expect("descriptor");
        assert_eq!(d.create_type, "vmfsSparse");
        assert_eq!(d.parent_file_name_hint.as_deref(), Some("web 01.vmdk"));
        assert_eq!(d.extents.first().map(|e| e.kind.as_str()), Some("VMFSSPARSE"));
        let se = "createType=\"seSparse\"\nparentFileNameHint=\"/vmfs/volumes/ds/vm/vm.vmdk\"\nRW 8388608 SESPARSE \"vm-000002-sesparse.vmdk\"\n";
        let d = parse_descriptor(se).expect("descriptor");
        assert_eq!(d.parent_file_name_hint.as_deref(), Some("/vmfs/volumes/ds/vm/vm.vmdk"));
        assert_eq!(d.extents.first().map(|e| e.kind.as_str()), Some("SESPARSE"));
    }

    #[test]
    fn descriptor_rdm_mapping_file() {
        let text = "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=fffffffe\nparentCID=ffffffff\n\
                    createType=\"vmfsRawDeviceMap\"\n\n# Extent description\nRW 209715200 VMFSRDM \"db-rdm.vmdk\"\n\n\
                    # The Disk Data Base\n#DDB\n\nddb.adapterType = \"lsilogic\"\n";
        let d = parse_descriptor(text).expect("descriptor");
        assert_eq!(d.create_type, "vmfsRawDeviceMap");
        assert_eq!(
            d.extents.first().map(|e| (e.kind.as_str(), e.file.as_str())),
            Some(("VMFSRDM", "db-rdm.vmdk"))
        );
        assert_eq!(d.capacity_bytes(), 100 * 1024 * 1024 * 1024);
    }

    #[test]
    fn descriptor_is_none_for_binary_or_unrelated_text() {
        let binary = String::from_utf8_lossy(&[0x4b, 0x44, 0x4d, 0x56, 0, 0, 0xff, 0xfe, 0x0a, 0x01, 0x02])
            .into_owned();
        assert_eq!(parse_descriptor(&binary), None);
        assert_eq!(parse_descriptor(""), None);
        assert_eq!(parse_descriptor(VMX), None);
    }

    #[test]
    fn descriptor_capacity_saturates() {
        let text = format!("RW {} VMFS \"a\"\nRW {} VMFS \"b\"\n", u64::MAX, u64::MAX / 2);
        assert_eq!(parse_descriptor(&text).map(|d| d.capacity_bytes()), Some(u64::MAX));
    }

    // ----- version -----

    #[test]
    fn version_from_vmware_v() {
        assert_eq!(
            parse_version("VMware ESXi 8.0.2 build-22380479\n").as_deref(),
            Some("VMware ESXi 8.0.2 build-22380479")
        );
    }

    #[test]
    fn version_from_esxcli_system_version_get() {
        assert_eq!(parse_version(ESXCLI_VERSION).as_deref(), Some("VMware ESXi 8.0.2 build-22380479"));
    }

    #[test]
    fn version_is_none_for_other_output() {
        assert_eq!(parse_version("-sh: vmware: not found\n"), None);
        assert_eq!(parse_version(""), None);
    }

    // ----- panic freedom -----

    /// SplitMix64: a tiny deterministic PRNG.
    struct SplitMix64(u64);

    impl SplitMix64 {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            if n == 0 { 0 } else { (self.next() % n as u64) as usize }
        }
    }

    const INTERESTING: &[u8] = b"(){}[]\"'-=,:|.<> \n\n\t\r#_0123456789abcXYZvmx[]|-ROOT";

    fn random_byte(rng: &mut SplitMix64) -> u8 {
        match rng.below(4) {
            0 => rng.next() as u8,
            1 => b' ' + rng.below(95) as u8,
            _ => INTERESTING[rng.below(INTERESTING.len())],
        }
    }

    fn mutate(rng: &mut SplitMix64, samples: &[&str]) -> Vec<u8> {
        let mut v = samples[rng.below(samples.len())].as_bytes().to_vec();
        for _ in 0..1 + rng.below(6) {
            match rng.below(9) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] ^= 1 << rng.below(8);
                }
                1 => {
                    let i = rng.below(v.len() + 1);
                    for _ in 0..1 + rng.below(8) {
                        v.insert(i, random_byte(rng));
                    }
                }
                2 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    let n = (1 + rng.below(16)).min(v.len() - i);
                    v.drain(i..i + n);
                }
                3 => v.truncate(rng.below(v.len() + 1)),
                4 => {
                    // Duplicate a line (possibly many times).
                    let lines: Vec<&[u8]> = v.split_inclusive(|&b| b == b'\n').collect();
                    if !lines.is_empty() {
                        let line = lines[rng.below(lines.len())].to_vec();
                        let at = rng.below(v.len() + 1);
                        for _ in 0..1 + rng.below(4) {
                            v.splice(at..at, line.iter().copied());
                        }
                    }
                }
                5 => {
                    // A run of one structural character.
                    let c = INTERESTING[rng.below(12)];
                    let at = rng.below(v.len() + 1);
                    let n = 1 + rng.below(200);
                    v.splice(at..at, std::iter::repeat_n(c, n));
                }
                6 => {
                    // Splice in a chunk of another sample.
                    let other = samples[rng.below(samples.len())].as_bytes();
                    let a = rng.below(other.len() + 1);
                    let b = a + rng.below(other.len() - a + 1);
                    let at = rng.below(v.len() + 1);
                    v.splice(at..at, other[a..b].iter().copied());
                }
                7 => {
                    // Pure random ASCII.
                    v = (0..rng.below(300)).map(|_| random_byte(rng)).collect();
                }
                _ => {}
            }
        }
        v
    }

    fn feed_all(bytes: &[u8]) {
        let s = String::from_utf8_lossy(bytes);
        let _ = parse_getallvms(&s);
        let _ = parse_power_state(&s);
        let _ = parse_fault(&s);
        let _ = parse_snapshots(&s);
        let _ = parse_message(&s);
        let _ = parse_vmodl(&s);
        let _ = parse_guest_info(&s).map(|g| g.tools_running());
        let _ = parse_summary(&s);
        let _ = vmx_facts(&parse_vmx(&s));
        let _ = parse_descriptor(&s).map(|d| d.capacity_bytes());
        let _ = parse_version(&s);
    }

    /// Inputs built to trigger quadratic scans; each must finish quickly even in
    /// debug builds (a quadratic parser would take minutes here).
    #[test]
    fn parsers_finish_on_large_adversarial_inputs() {
        let inputs = [
            format!("{})", "(".repeat(50_000)),
            format!("{}) {{", "(".repeat(50_000)),
            "(a) x, ".repeat(10_000),
            format!("(t) {{\n{}", "x = \"unterminated\n".repeat(10_000)),
            format!("(t) [\n{}", "'r, ".repeat(15_000)),
            format!("1   n   {}", "[a]   ".repeat(10_000)),
            format!("(vim.fault.X) {{\n{}", "a = (t) {\n}\n".repeat(10_000)),
            "--Snapshot Desciption : x\n\n".repeat(10_000),
            "scsi0:0.fileName = \"|2|2|2\"\n".repeat(10_000),
            "\"".repeat(50_000),
        ];
        // How fast is for `benches/`; here: every parser finishes on them.
        for input in &inputs {
            feed_all(input.as_bytes());
        }
    }

    #[test]
    fn parsers_never_panic_on_mutated_samples() {
        let samples = [
            GETALLVMS,
            POWER_ON,
            RESET_FAULT,
            RESET_FAULT_INDENTED,
            NOT_FOUND,
            GUEST,
            GUEST_NO_TOOLS,
            SNAPSHOTS,
            MESSAGE,
            VMX,
            DESCRIPTOR,
            SUMMARY,
            ESXCLI_VERSION,
        ];
        for sample in samples {
            feed_all(sample.as_bytes());
        }
        // 20,000 inputs over two threads (one per seed) to stay fast in debug builds.
        std::thread::scope(|scope| {
            for seed in [0x5EED_E5C1_u64, 0xC0FF_EE00_D15C_0001] {
                scope.spawn(move || {
                    let mut rng = SplitMix64(seed);
                    for _ in 0..10_000 {
                        let input = mutate(&mut rng, &samples);
                        feed_all(&input);
                    }
                });
            }
        });
    }
}
