//! VMDK text descriptors ([`parse_descriptor`]).

/// One extent line of a VMDK descriptor, e.g. `RW 4194304 VMFS "vm-flat.vmdk"`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Extent {
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
pub(crate) struct Descriptor {
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
    pub(crate) fn capacity_bytes(&self) -> u64 {
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
pub(crate) fn parse_descriptor(text: &str) -> Option<Descriptor> {
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
