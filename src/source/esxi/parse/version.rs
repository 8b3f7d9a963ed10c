//! The ESXi version string, from `vmware -v` or `esxcli system version get`.

/// `vmware -v` -> `VMware ESXi 8.0.2 build-22380479`. Also accepts
/// `esxcli system version get` (`Product:`, `Version:`, `Build:` lines) and
/// builds the same form from it.
pub(crate) fn parse_version(text: &str) -> Option<String> {
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
