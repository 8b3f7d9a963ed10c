//! Parsers of `vim-cmd vmsvc/...` output: `getallvms`, `power.getstate`,
//! faults, `snapshot.get`, `message`, and the `get.guest` / `get.summary`
//! VMODL dumps (read with [`parse_vmodl`]).

use crate::api::SourcePowerState;

use super::vmodl::{Vmodl, parse_vmodl};

// ---------------------------------------------------------------------------
// vim-cmd vmsvc/getallvms
// ---------------------------------------------------------------------------

/// One row of `vim-cmd vmsvc/getallvms`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VmListEntry {
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
pub(crate) fn parse_getallvms(text: &str) -> Vec<VmListEntry> {
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

pub(super) fn ends_with_ignore_ascii_case(s: &str, suffix: &str) -> bool {
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
pub(crate) fn split_datastore_path(file: &str) -> (&str, &str) {
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
pub(crate) fn parse_power_state(text: &str) -> Option<SourcePowerState> {
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
pub(crate) struct Fault {
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
pub(crate) fn parse_fault(text: &str) -> Option<Fault> {
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
pub(super) fn find_typed_brace(text: &str, accept: impl Fn(&str) -> bool) -> Option<(usize, &str, usize)> {
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
pub(crate) struct Snapshot {
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
pub(crate) fn parse_snapshots(text: &str) -> Vec<Snapshot> {
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
pub(crate) fn parse_message(text: &str) -> Option<String> {
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
// vim-cmd vmsvc/get.guest
// ---------------------------------------------------------------------------

/// One guest NIC as VMware Tools reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GuestNic {
    pub network: String,
    /// Lowercased.
    pub mac_address: String,
    pub ip_addresses: Vec<String>,
}

/// The useful part of `vim-cmd vmsvc/get.guest`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GuestInfo {
    pub tools_status: String,
    pub tools_running_status: String,
    pub guest_id: String,
    pub ip_address: Option<String>,
    pub nics: Vec<GuestNic>,
    pub guest_state: String,
}

impl GuestInfo {
    /// `toolsRunningStatus == "guestToolsRunning"` or `toolsStatus == "toolsOk"`.
    pub(crate) fn tools_running(&self) -> bool {
        self.tools_running_status == "guestToolsRunning" || self.tools_status == "toolsOk"
    }
}

fn vmodl_string(v: &Vmodl, path: &[&str]) -> String {
    v.path(path).and_then(Vmodl::as_str).unwrap_or("").to_string()
}

#[cfg(test)]
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
pub(crate) fn parse_guest_info(text: &str) -> Option<GuestInfo> {
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

/// The useful part of `vim-cmd vmsvc/get.summary`. The adapter reads the
/// `.vmx` instead; the parser stays with its tests as the record of the format.
#[cfg(test)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Summary {
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
#[cfg(test)]
pub(crate) fn parse_summary(text: &str) -> Option<Summary> {
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
