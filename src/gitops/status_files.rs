//! The files written to the status branch: one YAML file per migration at
//! `<namespace>/<name>.yaml` and a `STATUS.md` overview (table, progress bars,
//! a Mermaid gantt chart of each migration's phases).
//!
//! Rendering is pure and deterministic: the same state renders byte-identically,
//! so the writer can tell a real change from a re-render. Nothing volatile is
//! written (no "now", no transfer rate, no observation time, no condition
//! transition times), and only status and metadata are read: never the spec's
//! credentials reference nor artifact URLs, which may carry tokens.

use super::{ANNOTATION_COMMIT, ANNOTATION_ORPHANED, ANNOTATION_PATH};
use crate::api::{
    Condition, ConditionStatus, DestinationVm, LeftOnSource, MigrationError, Phase, PhaseTransition,
    Timestamps, VirtualMachineMigration, VirtualMachineMigrationStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Name of the overview file at the root of the status target.
pub(crate) const STATUS_MD: &str = "STATUS.md";
/// Name of the file of what deleted migrations left on their sources, at the
/// root of the status target (written while there is any).
pub(crate) const LEFT_ON_SOURCE_YAML: &str = "left-on-source.yaml";
/// Records of [`LEFT_ON_SOURCE_YAML`] written at most (the oldest first go).
pub(crate) const LEFT_ON_SOURCE_SHOWN: usize = 500;
/// Newest errors copied into a migration's status file.
pub(crate) const ERRORS_SHOWN: usize = 5;
/// Characters of the last error shown in the `STATUS.md` table.
pub(crate) const LAST_ERROR_WIDTH: usize = 80;
/// Cells of the text progress bar.
const BAR_CELLS: usize = 10;

/// What the status files are rendered from.
#[derive(Clone, Debug, Default)]
pub struct StatusInput {
    /// Every live migration the gitops side manages.
    pub migrations: Vec<VirtualMachineMigration>,
    /// The tracked-branch commit last applied.
    pub source_commit: String,
    /// `(namespace, name)` of live migrations whose manifest left Git.
    pub orphaned: Vec<(String, String)>,
    /// What deleted migrations left on their sources (the controller's
    /// records, `api::LeftOnSource`), until a person clears them.
    pub left_on_source: Vec<LeftOnSource>,
}

/// Path of a migration's status file, relative to the status target.
pub(crate) fn status_file_path(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}.yaml")
}

/// Renders every status file: path (relative to the status target) → content.
pub fn status_files(input: &StatusInput) -> BTreeMap<String, String> {
    let orphaned: BTreeSet<(&str, &str)> =
        input.orphaned.iter().map(|(ns, name)| (ns.as_str(), name.as_str())).collect();
    let mut rows: Vec<Row<'_>> = input.migrations.iter().filter_map(|m| Row::new(m, &orphaned)).collect();
    rows.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));
    rows.dedup_by(|a, b| (a.namespace, a.name) == (b.namespace, b.name));

    let mut files = BTreeMap::new();
    for row in &rows {
        files.insert(status_file_path(row.namespace, row.name), status_yaml(row));
    }
    let left = left_shown(&input.left_on_source);
    if !left.is_empty() {
        files.insert(LEFT_ON_SOURCE_YAML.to_string(), left_yaml(&left));
    }
    files.insert(STATUS_MD.to_string(), status_md(&rows, &input.source_commit, &left));
    files
}

/// The records shown: sorted (by migration, then uid), at most
/// [`LEFT_ON_SOURCE_SHOWN`] of the newest.
fn left_shown(records: &[LeftOnSource]) -> Vec<&LeftOnSource> {
    let mut newest: Vec<&LeftOnSource> = records.iter().collect();
    newest.sort_by(|a, b| b.recorded.cmp(&a.recorded).then_with(|| a.cmp(b)));
    let mut seen = BTreeSet::new();
    newest.retain(|l| seen.insert(l.uid.as_str()));
    newest.truncate(LEFT_ON_SOURCE_SHOWN);
    newest.sort();
    newest
}

fn left_yaml(records: &[&LeftOnSource]) -> String {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct LeftFile<'a> {
        left_on_source: &'a [&'a LeftOnSource],
    }
    let mut out = String::from(
        "# Written by vmmigrate: what deleted migrations left on their source hosts.\n\
         # Remove each snapshot on its host, then delete its record:\n\
         # kubectl -n <the controller's namespace> delete configmap vmm-left-<uid>\n",
    );
    out.push_str(&serde_yaml::to_string(&LeftFile { left_on_source: records }).unwrap_or_default());
    out
}

/// One migration as the files see it.
struct Row<'a> {
    namespace: &'a str,
    name: &'a str,
    migration: &'a VirtualMachineMigration,
    status: VirtualMachineMigrationStatus,
    orphaned: bool,
}

impl<'a> Row<'a> {
    fn new(migration: &'a VirtualMachineMigration, orphaned: &BTreeSet<(&str, &str)>) -> Option<Row<'a>> {
        let name = migration.metadata.name.as_deref()?;
        let namespace = migration.metadata.namespace.as_deref().unwrap_or("default");
        // Both become path components; Kubernetes names always pass, anything else is skipped.
        if !is_object_name(namespace) || !is_object_name(name) {
            tracing::warn!(namespace, name, "migration name is not a valid object name; no status file");
            return None;
        }
        let annotated = annotation(migration, ANNOTATION_ORPHANED).is_some_and(|v| v != "false");
        Some(Row {
            namespace,
            name,
            migration,
            status: migration.status.clone().unwrap_or_default(),
            orphaned: annotated || orphaned.contains(&(namespace, name)),
        })
    }

    fn source_vm(&self) -> SourceVmView<'a> {
        let source = &self.migration.spec.source;
        SourceVmView { host: &source.host, name: source.vm.name.as_deref(), id: source.vm.id.as_deref() }
    }

    /// The created VM, or where it will be created.
    fn destination(&self) -> String {
        match &self.status.destination_vm {
            Some(vm) => format!("{}/{}", vm.namespace, vm.name),
            None => {
                let spec = &self.migration.spec;
                format!(
                    "{}/{}",
                    spec.destination.namespace,
                    crate::machine::destination_name(spec, self.name)
                )
            }
        }
    }
}

/// Lowercase RFC 1123 subdomain characters, starting and ending alphanumeric.
fn is_object_name(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.starts_with(alnum)
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || c == '-' || c == '.')
}

fn annotation<'a>(migration: &'a VirtualMachineMigration, key: &str) -> Option<&'a str> {
    migration.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusFile<'a> {
    name: &'a str,
    namespace: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    manifest_path: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source_commit: Option<&'a str>,
    orphaned: bool,
    phase: Phase,
    /// What a validated migration waits for before its cutover.
    #[serde(skip_serializing_if = "Option::is_none")]
    waiting: Option<&'a crate::api::Waiting>,
    #[serde(skip_serializing_if = "Option::is_none")]
    wave: Option<&'a crate::api::WaveSpec>,
    /// `Warm` or `Rehearsal`; a cold migration says nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<crate::api::MigrationMode>,
    /// The snapshot a warm migration or a rehearsal took of its source: when
    /// it was created and removed.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<&'a crate::api::SnapshotRecord>,
    /// The power-off epoch (how many power-offs were recorded, and ended).
    #[serde(skip_serializing_if = "is_zero")]
    epoch: i32,
    /// Every power action asked of the source, each recorded before it was
    /// asked: the audit trail of the one irreversible action.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    power_actions: &'a [crate::api::PowerActionRecord],
    #[serde(rename = "sourceVM")]
    source_vm: SourceVmView<'a>,
    #[serde(rename = "destinationVM", skip_serializing_if = "Option::is_none")]
    destination_vm: Option<&'a DestinationVm>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    conditions: Vec<ConditionView<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: Option<ProgressView>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    disks: Vec<DiskView<'a>>,
    /// What converting the guest did: virt-v2v's version, the drivers it
    /// installed, VMware Tools afterwards, the NIC names kept, the time.
    #[serde(skip_serializing_if = "Option::is_none")]
    guest_conversion: Option<&'a crate::api::GuestConversion>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    validation_results: Vec<CheckView<'a>>,
    #[serde(skip_serializing_if = "no_timestamps")]
    timestamps: &'a Timestamps,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    history: &'a [PhaseTransition],
    /// Newest last.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    errors: &'a [MigrationError],
}

/// A check's outcome, without the time it was last looked at.
#[derive(Serialize)]
struct CheckView<'a> {
    name: &'a str,
    passed: bool,
    #[serde(skip_serializing_if = "str::is_empty")]
    message: &'a str,
}

#[derive(Serialize)]
struct SourceVmView<'a> {
    host: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
}

#[derive(Serialize)]
struct ConditionView<'a> {
    #[serde(rename = "type")]
    type_: &'a str,
    status: ConditionStatus,
    reason: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    message: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProgressView {
    bytes_done: i64,
    bytes_total: i64,
    percent: i32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    disks: Vec<DiskProgressView>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DiskProgressView {
    index: i32,
    bytes_done: i64,
    bytes_total: i64,
    percent: i32,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DiskView<'a> {
    index: i32,
    source_path: &'a str,
    size_bytes: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    source_sha256: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source_verified_remotely: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    artifact_sha256: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    artifact_format: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_volume_name: Option<&'a str>,
    /// How the import was proven the copy's bytes (`CDIChecksum`, `VolumeSha256`).
    #[serde(skip_serializing_if = "Option::is_none")]
    import_verification: Option<crate::api::ImportVerification>,
    #[serde(skip_serializing_if = "Option::is_none")]
    imported_sha256: Option<&'a str>,
}

fn no_timestamps(timestamps: &&Timestamps) -> bool {
    **timestamps == Timestamps::default()
}

fn status_yaml(row: &Row<'_>) -> String {
    let status = &row.status;
    let mut conditions: Vec<&Condition> = status.conditions.iter().collect();
    // The API server keeps conditions in write order; the file must not depend on it.
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
    let progress = status.progress.as_ref().map(|p| ProgressView {
        bytes_done: p.bytes_done,
        bytes_total: p.bytes_total,
        percent: p.percent.clamp(0, 100),
        disks: p
            .disks
            .iter()
            .map(|d| DiskProgressView {
                index: d.index,
                bytes_done: d.bytes_done,
                bytes_total: d.bytes_total,
                percent: percent_of(d.bytes_done, d.bytes_total),
            })
            .collect(),
    });
    let file = StatusFile {
        name: row.name,
        namespace: row.namespace,
        manifest_path: annotation(row.migration, ANNOTATION_PATH),
        source_commit: annotation(row.migration, ANNOTATION_COMMIT),
        orphaned: row.orphaned,
        phase: status.phase,
        waiting: status.waiting.as_ref(),
        wave: row.migration.spec.wave.as_ref(),
        mode: Some(status.mode.unwrap_or(row.migration.spec.mode))
            .filter(|m| *m != crate::api::MigrationMode::Cold),
        snapshot: status.snapshot.as_ref(),
        epoch: status.epoch,
        power_actions: &status.power_actions,
        source_vm: row.source_vm(),
        destination_vm: status.destination_vm.as_ref(),
        conditions: conditions
            .into_iter()
            .map(|c| ConditionView {
                type_: &c.type_,
                status: c.status,
                reason: &c.reason,
                message: &c.message,
            })
            .collect(),
        progress,
        disks: status
            .disks
            .iter()
            .map(|d| DiskView {
                index: d.index,
                source_path: &d.source_path,
                size_bytes: d.size_bytes,
                source_sha256: d.source_sha256.as_deref(),
                source_verified_remotely: d.source_verified_remotely,
                artifact_sha256: d.artifact_sha256.as_deref(),
                artifact_format: d.artifact_format.as_deref(),
                data_volume_name: d.data_volume_name.as_deref(),
                import_verification: d.import_verification,
                imported_sha256: d.imported_sha256.as_deref(),
            })
            .collect(),
        guest_conversion: status.guest_conversion.as_ref(),
        validation_results: status
            .validation_results
            .iter()
            .map(|r| CheckView { name: &r.name, passed: r.passed, message: &r.message })
            .collect(),
        timestamps: &status.timestamps,
        history: &status.history,
        errors: &status.errors[status.errors.len().saturating_sub(ERRORS_SHOWN)..],
    };
    // Plain structs of strings and numbers: serialising cannot fail in practice.
    let body = serde_yaml::to_string(&file)
        .unwrap_or_else(|e| format!("# rendering failed: {}\n", e.to_string().replace('\n', " ")));
    format!("# Written by vmmigrate from the migration's live status; edits are overwritten.\n{body}")
}

/// Whole percent, rounded down so that 100 means done.
fn percent_of(done: i64, total: i64) -> i32 {
    if total <= 0 {
        return 0;
    }
    let p = i128::from(done.max(0)) * 100 / i128::from(total);
    p.clamp(0, 100) as i32
}

/// `████░░░░░░ 42%`: one cell per ten percent, rounded down.
pub(crate) fn progress_bar(percent: i32) -> String {
    let percent = percent.clamp(0, 100);
    let filled = percent as usize * BAR_CELLS / 100;
    format!("{}{} {percent}%", "█".repeat(filled), "░".repeat(BAR_CELLS - filled))
}

/// Text safe inside one Markdown table cell: one line, no column breaks, no
/// HTML, and no inline syntax. The characters CommonMark and GitHub read as
/// links and images (`[` `]`), emphasis (`*` `_`), code spans, strike-through,
/// mentions and autolinks or emoji (`:`, as in `https://`) are
/// backslash-escaped, so a VM name or an ESXi error message shows as the text
/// it is and never as `[a link](https://elsewhere)` or a ping of `@team`.
pub(crate) fn markdown_cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '|' => out.push_str("\\|"),
            '[' | ']' | '*' | '_' | '`' | '~' | '@' | ':' => {
                out.push('\\');
                out.push(c);
            }
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '\r' | '\n' | '\t' => out.push(' '),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// At most `width` characters, the last one `…` when cut.
pub(crate) fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut out: String = text.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Text safe in a Mermaid title or task name: no `:` `;` `#` `%` or line breaks,
/// which Mermaid reads as syntax, and nothing that could close the code fence.
pub(crate) fn mermaid_text(text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, ' ' | '.' | '_' | '-' | '/') { c } else { '_' })
        .collect();
    let trimmed = cleaned.trim();
    if trimmed.is_empty() { "_".to_string() } else { trimmed.to_string() }
}

fn status_md(rows: &[Row<'_>], source_commit: &str, left: &[&LeftOnSource]) -> String {
    let mut md = String::new();
    md.push_str("# Migration status\n\n");
    let _ = writeln!(
        md,
        "Source commit: `{}` · {} migration{}\n",
        // A commit id inside a code span, where escapes would show: only
        // what an id is made of is kept, so nothing can close the span.
        source_commit.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>(),
        rows.len(),
        if rows.len() == 1 { "" } else { "s" }
    );
    md.push_str("<!-- Written by vmmigrate from the migrations' live status; edits are overwritten. -->\n\n");
    if !left.is_empty() {
        let _ = writeln!(
            md,
            "## Left on source hosts\n\nDeleted migrations could not remove these snapshots; `{LEFT_ON_SOURCE_YAML}` says how to clear them.\n"
        );
        md.push_str("| Migration | Host | VM | Snapshot | Why | Recorded |\n|---|---|---|---|---|---|\n");
        for l in left {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                markdown_cell(&format!("{}/{}", l.namespace, l.migration)),
                markdown_cell(&l.host),
                markdown_cell(&format!("{} (vmid {})", l.vm, l.vmid)),
                markdown_cell(&l.snapshot),
                markdown_cell(&l.reason),
                markdown_cell(&l.recorded),
            );
        }
        md.push('\n');
    }
    if rows.is_empty() {
        md.push_str("No migrations.\n");
        return md;
    }
    // Waves get a column once a migration has one.
    let waves = rows.iter().any(|r| r.migration.spec.wave.is_some());
    if waves {
        md.push_str("| Migration | Wave | Phase | Progress | Source VM | Destination | Last error |\n");
        md.push_str("|---|---|---|---|---|---|---|\n");
    } else {
        md.push_str("| Migration | Phase | Progress | Source VM | Destination | Last error |\n");
        md.push_str("|---|---|---|---|---|---|\n");
    }
    for row in rows {
        let mut migration = markdown_cell(&format!("{}/{}", row.namespace, row.name));
        if row.orphaned {
            migration.push_str(" (orphaned)");
        }
        if row.migration.spec.mode == crate::api::MigrationMode::Rehearsal {
            migration.push_str(" (rehearsal)");
        }
        let source = row.source_vm();
        let source_vm = match (source.name, source.id) {
            (Some(name), _) => format!("{name} on {}", source.host),
            (None, Some(id)) => format!("vmid {id} on {}", source.host),
            (None, None) => source.host.to_string(),
        };
        let last_error =
            row.status.errors.last().map(|e| format!("{}: {}", e.reason, e.message)).unwrap_or_default();
        if waves {
            let wave = row.migration.spec.wave.as_ref().map(|w| format!("{} {}", w.plan, w.number));
            migration.push_str(" | ");
            migration.push_str(&markdown_cell(&wave.unwrap_or_default()));
        }
        let phase = match &row.status.waiting {
            Some(w) => format!("{} · waiting: {}", row.status.phase, truncate(&w.message, LAST_ERROR_WIDTH)),
            None => row.status.phase.to_string(),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            migration,
            markdown_cell(&phase),
            progress_cell(&row.status),
            markdown_cell(&source_vm),
            markdown_cell(&row.destination()),
            markdown_cell(&truncate(&last_error, LAST_ERROR_WIDTH)),
        );
    }
    md.push_str("\n## Timelines\n");
    for row in rows {
        let title = format!("{}/{}", row.namespace, row.name);
        let _ = writeln!(md, "\n### {}\n", markdown_cell(&title));
        if row.status.history.is_empty() {
            md.push_str("No phase history yet.\n");
            continue;
        }
        md.push_str(&gantt(&title, &row.status.history));
    }
    md
}

/// The current phase's progress; a completed migration shows a full bar.
fn progress_cell(status: &VirtualMachineMigrationStatus) -> String {
    match &status.progress {
        Some(p) => progress_bar(p.percent),
        None if status.phase == Phase::Completed => progress_bar(100),
        None => String::new(),
    }
}

/// A gantt chart with one bar per history entry, from its start to the next
/// entry's start; the last entry (the current phase) is a milestone.
fn gantt(title: &str, history: &[PhaseTransition]) -> String {
    let mut chart = String::from("```mermaid\ngantt\n");
    let _ = writeln!(chart, "    title {}", mermaid_text(title));
    chart.push_str("    dateFormat YYYY-MM-DD HH:mm:ss\n    axisFormat %m-%d %H:%M\n");
    for (i, entry) in history.iter().enumerate() {
        let name = mermaid_text(entry.phase.as_str());
        let start = mermaid_time(&entry.time);
        match history.get(i + 1) {
            Some(next) => {
                let end = mermaid_time(std::cmp::max(&next.time, &entry.time));
                let _ = writeln!(chart, "    {name} : {start}, {end}");
            }
            None => {
                let _ = writeln!(chart, "    {name} : milestone, {start}, 0s");
            }
        }
    }
    chart.push_str("```\n");
    chart
}

fn mermaid_time(time: &Time) -> String {
    k8s_openapi::jiff::fmt::strtime::format("%Y-%m-%d %H:%M:%S", time.0).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DiskProgress, DiskStatus, Progress, VirtualMachineMigrationSpec};

    fn t(s: &str) -> Time {
        Time(s.parse().unwrap())
    }

    fn migration(ns: &str, name: &str, phase: Phase) -> VirtualMachineMigration {
        let spec: VirtualMachineMigrationSpec = serde_json::from_value(serde_json::json!({
            "source": {
                "host": "esxi01", "hostKey": "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                "credentialsSecretRef": {"name": "esxi-root-password"}, "vm": {"name": "web 01"}
            },
            "destination": {"namespace": "apps", "storageClassName": "standard"}
        }))
        .unwrap();
        let mut m = VirtualMachineMigration::new(name, spec);
        m.metadata.namespace = Some(ns.to_string());
        m.metadata.annotations = Some(
            [
                (ANNOTATION_PATH.to_string(), format!("migrations/{ns}/{name}.yaml")),
                (ANNOTATION_COMMIT.to_string(), "0123abcd".to_string()),
            ]
            .into(),
        );
        m.status = Some(VirtualMachineMigrationStatus {
            phase,
            history: vec![
                PhaseTransition { phase: Phase::Pending, time: t("2025-03-01T10:00:00Z") },
                PhaseTransition { phase: Phase::Discovering, time: t("2025-03-01T10:00:05Z") },
                PhaseTransition { phase, time: t("2025-03-01T10:01:00Z") },
            ],
            ..Default::default()
        });
        m
    }

    fn input(migrations: Vec<VirtualMachineMigration>) -> StatusInput {
        StatusInput { migrations, source_commit: "feedface".into(), orphaned: vec![], left_on_source: vec![] }
    }

    #[test]
    fn the_same_state_renders_byte_identically_whatever_the_order_and_volatile_fields() {
        let mut a = migration("apps", "web-01", Phase::Preparing);
        let b = migration("apps", "db-01", Phase::Completed);
        let status = a.status.as_mut().unwrap();
        status.progress = Some(Progress {
            bytes_done: 420,
            bytes_total: 1000,
            percent: 42,
            bytes_per_second: 17,
            updated: Some(t("2025-03-01T10:02:00Z")),
            disks: vec![DiskProgress { index: 0, bytes_done: 420, bytes_total: 1000, bytes_per_second: 17 }],
        });
        let first = status_files(&input(vec![a.clone(), b.clone()]));

        // A later observation with the same bytes: only the rate and the observation time moved.
        let progress = a.status.as_mut().unwrap().progress.as_mut().unwrap();
        progress.bytes_per_second = 99;
        progress.updated = Some(t("2025-03-01T10:03:00Z"));
        progress.disks[0].bytes_per_second = 99;
        let second = status_files(&input(vec![b, a]));

        assert_eq!(first, second);
        assert_eq!(first.keys().collect::<Vec<_>>(), ["STATUS.md", "apps/db-01.yaml", "apps/web-01.yaml"]);
        let web = &first["apps/web-01.yaml"];
        assert!(!web.contains("bytesPerSecond") && !web.contains("updated"), "{web}");
        assert!(web.contains("percent: 42"), "{web}");
    }

    #[test]
    fn the_status_file_carries_provenance_conditions_checksums_and_errors_but_no_credentials() {
        let mut m = migration("apps", "web-01", Phase::Retryable);
        let status = m.status.as_mut().unwrap();
        status.conditions = vec![
            Condition {
                type_: "Ready".into(),
                status: ConditionStatus::False,
                observed_generation: Some(1),
                last_transition_time: t("2025-03-01T10:00:00Z"),
                reason: "Retrying".into(),
                message: "waiting".into(),
            },
            Condition {
                type_: "DiskAcquired".into(),
                status: ConditionStatus::True,
                observed_generation: Some(1),
                last_transition_time: t("2025-03-01T10:00:00Z"),
                reason: "Copied".into(),
                message: String::new(),
            },
        ];
        status.disks = vec![DiskStatus {
            index: 0,
            source_path: "/vmfs/volumes/ds1/web/web-flat.vmdk".into(),
            size_bytes: 1000,
            source_sha256: Some("aa".repeat(32)),
            artifact_url: Some("https://artifacts.example/x?token=s3cr3t".into()),
            artifact_sha256: Some("bb".repeat(32)),
            import_verification: Some(crate::api::ImportVerification::VolumeSha256),
            imported_sha256: Some("aa".repeat(32)),
            ..Default::default()
        }];
        status.errors = (0..8)
            .map(|i| MigrationError {
                time: t("2025-03-01T10:00:00Z"),
                phase: Phase::Importing,
                reason: format!("Reason{i}"),
                message: "boom".into(),
                retryable: true,
            })
            .collect();
        let files = status_files(&input(vec![m]));
        let yaml = &files["apps/web-01.yaml"];
        let value: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(value["manifestPath"], "migrations/apps/web-01.yaml");
        assert_eq!(value["sourceCommit"], "0123abcd");
        assert_eq!(value["phase"], "Retryable");
        assert_eq!(value["orphaned"], false);
        assert_eq!(value["conditions"][0]["type"], "DiskAcquired");
        assert_eq!(value["disks"][0]["sourceSha256"], "aa".repeat(32).as_str());
        assert_eq!(value["disks"][0]["artifactSha256"], "bb".repeat(32).as_str());
        // How the import was proven is in Git too, never just "succeeded".
        assert_eq!(value["disks"][0]["importVerification"], "VolumeSha256");
        assert_eq!(value["disks"][0]["importedSha256"], "aa".repeat(32).as_str());
        assert!(value.get("guestConversion").is_none(), "a guest that was not converted says nothing");
        assert_eq!(value["errors"].as_sequence().unwrap().len(), ERRORS_SHOWN);
        assert_eq!(value["errors"][ERRORS_SHOWN - 1]["reason"], "Reason7");
        for text in files.values() {
            assert!(!text.contains("s3cr3t") && !text.contains("esxi-root-password"), "{text}");
            assert!(!text.contains("lastTransitionTime"), "{text}");
        }
    }

    #[test]
    fn the_status_file_says_what_converting_the_guest_did() {
        let mut m = migration("apps", "web-01", Phase::Importing);
        m.status.as_mut().unwrap().guest_conversion = Some(crate::api::GuestConversion {
            tool: "virt-v2v 2.2.0".into(),
            guest: "debian 12 (12.15)".into(),
            drivers: vec!["virtio_blk".into(), "virtio_net".into()],
            vmware_tools: "not installed".into(),
            interface_names: vec!["00:50:56:aa:bb:cc=ens192".into()],
            accelerator: "tcg".into(),
            seconds: 222,
            log: "/var/lib/vmmigrate/artifacts/u/virt-v2v.log".into(),
            disk_sha256: vec!["cc".repeat(32)],
        });
        let files = status_files(&input(vec![m]));
        let value: serde_yaml::Value = serde_yaml::from_str(&files["apps/web-01.yaml"]).unwrap();
        let guest = &value["guestConversion"];
        assert_eq!(guest["tool"], "virt-v2v 2.2.0");
        assert_eq!(guest["drivers"][1], "virtio_net");
        assert_eq!(guest["vmwareTools"], "not installed");
        assert_eq!(guest["interfaceNames"][0], "00:50:56:aa:bb:cc=ens192");
        assert_eq!(guest["seconds"], 222);
        assert_eq!(guest["diskSha256"][0], "cc".repeat(32).as_str());
    }

    fn left(uid: &str, recorded: &str) -> LeftOnSource {
        LeftOnSource {
            namespace: "apps".into(),
            migration: format!("web-{uid}"),
            uid: uid.into(),
            host: "esxi01.example.net".into(),
            vm: "web | <b>x</b>".into(),
            vmid: "7".into(),
            snapshot: format!("vmmigrate-web-{uid}"),
            reason: "CredentialsNotFound".into(),
            recorded: recorded.into(),
        }
    }

    #[test]
    fn what_deleted_migrations_left_on_sources_is_a_file_and_a_table_until_cleared() {
        let mut state = input(vec![migration("apps", "db-01", Phase::Preparing)]);
        state.left_on_source = vec![left("b2", "2026-12-06T10:00:00Z"), left("a1", "2026-12-06T09:00:00Z")];
        let files = status_files(&state);
        let value: serde_yaml::Value = serde_yaml::from_str(&files[LEFT_ON_SOURCE_YAML]).unwrap();
        let records = value["leftOnSource"].as_sequence().unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0]["uid"], "a1", "sorted by migration");
        for key in ["namespace", "migration", "host", "vm", "vmid", "snapshot", "reason", "recorded"] {
            assert!(records[1][key].as_str().is_some_and(|v| !v.is_empty()), "{key}");
        }
        assert_eq!(records[1]["snapshot"], "vmmigrate-web-b2");
        let md = &files[STATUS_MD];
        assert!(md.contains("## Left on source hosts"), "{md}");
        assert!(md.contains("vmmigrate-web-a1") && md.contains("vmmigrate-web-b2"), "{md}");
        assert!(!md.contains("<b>") && !md.contains("web | "), "cells are escaped: {md}");
        // Cleared by a person: the file goes, the section too.
        state.left_on_source.clear();
        let files = status_files(&state);
        assert!(!files.contains_key(LEFT_ON_SOURCE_YAML));
        assert!(!files[STATUS_MD].contains("Left on source"));
    }

    #[test]
    fn the_left_on_source_file_keeps_the_newest_records_up_to_its_limit() {
        let mut state = input(vec![]);
        state.left_on_source = (0..LEFT_ON_SOURCE_SHOWN + 20)
            .map(|i| left(&format!("{i:04}"), &format!("2026-12-06T{:02}:{:02}:00Z", i / 60 % 24, i % 60)))
            .collect();
        // The same record twice (listed twice) counts once.
        state.left_on_source.push(left("0519", "2026-12-06T08:39:00Z"));
        let files = status_files(&state);
        let value: serde_yaml::Value = serde_yaml::from_str(&files[LEFT_ON_SOURCE_YAML]).unwrap();
        let uids: Vec<&str> =
            value["leftOnSource"].as_sequence().unwrap().iter().map(|r| r["uid"].as_str().unwrap()).collect();
        assert_eq!(uids.len(), LEFT_ON_SOURCE_SHOWN);
        assert_eq!(uids[0], "0020", "the 20 oldest went");
        assert_eq!(uids.last(), Some(&"0519"));
    }

    #[test]
    fn a_rehearsal_shows_its_mode_snapshot_checks_and_its_own_vm_in_git() {
        let mut m = migration("apps", "web-01", Phase::Validating);
        m.spec.mode = crate::api::MigrationMode::Rehearsal;
        let status = m.status.get_or_insert_with(Default::default);
        status.snapshot = Some(crate::api::SnapshotRecord {
            name: "vmmigrate-web-01".into(),
            id: Some("3".into()),
            quiesced: true,
            created: t("2025-03-01T10:00:00Z"),
            removing: Some(t("2025-03-01T10:05:00Z")),
            removed: Some(t("2025-03-01T10:05:00Z")),
            left_on_source: None,
            epoch: 0,
        });
        status.validation_results = vec![crate::api::ValidationResult {
            name: "agent".into(),
            passed: true,
            message: "connected".into(),
            last_checked: t("2025-03-01T10:09:00Z"),
        }];
        let files = status_files(&input(vec![m]));
        let value: serde_yaml::Value = serde_yaml::from_str(&files["apps/web-01.yaml"]).unwrap();
        assert_eq!(value["mode"], "Rehearsal");
        assert_eq!(value["snapshot"]["name"], "vmmigrate-web-01");
        assert_eq!(value["snapshot"]["removed"], "2025-03-01T10:05:00Z");
        assert_eq!(value["validationResults"][0]["name"], "agent");
        assert_eq!(value["validationResults"][0]["passed"], true);
        assert!(!files["apps/web-01.yaml"].contains("lastChecked"), "no volatile times");
        let md = &files[STATUS_MD];
        assert!(md.contains("| apps/web-01 (rehearsal) |"), "{md}");
        assert!(md.contains("| apps/web-01-rehearsal |"), "the rehearsal VM's own name: {md}");
    }

    #[test]
    fn orphaned_migrations_are_marked_in_the_file_and_the_table() {
        let mut annotated = migration("apps", "old-02", Phase::Completed);
        annotated.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_ORPHANED.into(), "true".into());
        let listed = migration("apps", "old-01", Phase::Completed);
        let kept = migration("apps", "web-01", Phase::Completed);
        let mut input = input(vec![annotated, listed, kept]);
        input.orphaned = vec![("apps".into(), "old-01".into())];
        let files = status_files(&input);
        assert!(files["apps/old-01.yaml"].contains("\norphaned: true\n"));
        assert!(files["apps/old-02.yaml"].contains("\norphaned: true\n"));
        assert!(files["apps/web-01.yaml"].contains("\norphaned: false\n"));
        let md = &files[STATUS_MD];
        assert!(md.contains("| apps/old-01 (orphaned) |"), "{md}");
        assert!(md.contains("| apps/old-02 (orphaned) |"), "{md}");
        assert!(md.contains("| apps/web-01 |"), "{md}");
    }

    #[test]
    fn every_power_action_and_the_epoch_are_in_the_status_file() {
        let mut m = migration("apps", "web-01", Phase::Converting);
        let status = m.status.as_mut().unwrap();
        status.epoch = 1;
        status.power_actions = vec![crate::api::PowerActionRecord {
            seq: 1,
            action: crate::api::PowerActionKind::Shutdown,
            epoch: 0,
            vmid: "7".into(),
            bios_uuid: "421b".into(),
            recorded: t("2025-03-01T10:02:00Z"),
        }];
        let files = status_files(&input(vec![m]));
        let file = &files["apps/web-01.yaml"];
        assert!(file.contains("\nepoch: 1\n"), "{file}");
        assert!(
            file.contains("powerActions:\n- seq: 1\n  action: Shutdown\n  epoch: 0\n  vmid: '7'\n  biosUuid: 421b\n  recorded: 2025-03-01T10:02:00Z\n"),
            "{file}"
        );
        let quiet = status_files(&input(vec![migration("apps", "web-02", Phase::Discovering)]));
        assert!(!quiet["apps/web-02.yaml"].contains("powerActions"), "nothing to say, nothing said");
    }

    #[test]
    fn a_waiting_migration_shows_why_and_its_place_and_waves_get_a_column() {
        let mut waiting = migration("apps", "app-07", Phase::Validated);
        waiting.spec.wave = Some(crate::api::WaveSpec { plan: "erp".into(), number: 2 });
        waiting.status.as_mut().unwrap().waiting = Some(crate::api::Waiting {
            reason: "WaitingForHostSlot".into(),
            message: "3rd in line for esx-07 (2 of 2 reads in use)".into(),
            since: t("2025-03-01T10:01:00Z"),
            until: None,
            position: Some(3),
        });
        let plain = migration("apps", "web-01", Phase::Completed);
        let files = status_files(&input(vec![waiting, plain]));
        let md = &files[STATUS_MD];
        assert!(md.contains("| Migration | Wave | Phase | Progress |"), "{md}");
        assert!(
            md.contains(
                "| apps/app-07 | erp 2 | Validated · waiting\\: 3rd in line for esx-07 (2 of 2 reads in use) |"
            ),
            "{md}"
        );
        assert!(md.contains("| apps/web-01 |  | Completed |"), "{md}");
        let file = &files["apps/app-07.yaml"];
        assert!(file.contains("waiting:\n  reason: WaitingForHostSlot\n"), "{file}");
        assert!(file.contains("position: 3"), "{file}");
        assert!(file.contains("wave:\n  plan: erp\n  number: 2\n"), "{file}");
    }

    #[test]
    fn progress_bar_has_ten_cells_rounded_down() {
        assert_eq!(progress_bar(42), "████░░░░░░ 42%");
        assert_eq!(progress_bar(0), "░░░░░░░░░░ 0%");
        assert_eq!(progress_bar(99), "█████████░ 99%");
        assert_eq!(progress_bar(100), "██████████ 100%");
        assert_eq!(progress_bar(250), "██████████ 100%");
        assert_eq!(progress_bar(-3), "░░░░░░░░░░ 0%");
        assert_eq!(percent_of(999, 1000), 99);
        assert_eq!(percent_of(5, 0), 0);
        assert_eq!(percent_of(i64::MAX, i64::MAX), 100);
    }

    #[test]
    fn table_cells_escape_pipes_html_and_line_breaks_and_cut_long_errors() {
        assert_eq!(markdown_cell(r"a|b\|c"), r"a\|b\\\|c");
        assert_eq!(markdown_cell("<!-- x & y -->\nnext"), "&lt;!-- x &amp; y --&gt; next");
        assert_eq!(truncate("short", 80), "short");
        let cut = truncate(&"é".repeat(200), 80);
        assert_eq!(cut.chars().count(), 80);
        assert!(cut.ends_with('…'));

        let mut m = migration("apps", "web-01", Phase::Retryable);
        m.status.as_mut().unwrap().errors = vec![MigrationError {
            time: t("2025-03-01T10:00:00Z"),
            phase: Phase::Importing,
            reason: "ImportFailed".into(),
            message: format!("a | b\nc {}", "x".repeat(200)),
            retryable: true,
        }];
        let md = &status_files(&input(vec![m]))[STATUS_MD];
        let line = md.lines().find(|l| l.starts_with("| apps/web-01")).unwrap();
        assert_eq!(line.matches(" | ").count() + 1, 6, "{line}");
        assert!(line.contains(r"ImportFailed\: a \| b c xxx"), "{line}");
        assert!(line.ends_with("x… |"), "{line}");
    }

    #[test]
    fn a_vm_name_or_error_message_cannot_become_a_link_an_image_a_mention_or_emphasis_in_status_md() {
        assert_eq!(markdown_cell("[click](https://evil.example)"), r"\[click\](https\://evil.example)");
        assert_eq!(
            markdown_cell("![x](y) **b** _i_ `c` ~~s~~ @org/team :tada:"),
            r"!\[x\](y) \*\*b\*\* \_i\_ \`c\` \~\~s\~\~ \@org/team \:tada\:"
        );

        let mut m = migration("apps", "web-01", Phase::Retryable);
        m.spec.source.vm.name = Some("[web](https://evil.example/login) @admins".into());
        m.status.as_mut().unwrap().errors = vec![MigrationError {
            time: t("2025-03-01T10:00:00Z"),
            phase: Phase::Discovering,
            reason: "UnparsableOutput".into(),
            message: "![pixel](https://evil.example/p.png) `rm -rf` **now**".into(),
            retryable: false,
        }];
        let md = &status_files(&input(vec![m]))[STATUS_MD];
        let line = md.lines().find(|l| l.starts_with("| apps/web-01")).unwrap();
        for unescaped in ["[", "]", "`", "*", "@", "://"] {
            let bare = line.match_indices(unescaped).filter(|(i, _)| !line[..*i].ends_with('\\')).count();
            assert_eq!(bare, 0, "{unescaped:?} left unescaped in {line}");
        }
        assert!(line.contains(r"\[web\](https\://evil.example/login) \@admins"), "{line}");
    }

    #[test]
    fn mermaid_text_drops_syntax_characters() {
        assert_eq!(mermaid_text("apps/web-01"), "apps/web-01");
        assert_eq!(mermaid_text("a:b;c#d%%{init}\n```"), "a_b_c_d___init_____");
        assert_eq!(mermaid_text(":"), "_");
    }

    #[test]
    fn the_timeline_has_one_bar_per_phase_and_the_current_phase_as_a_milestone() {
        let md = &status_files(&input(vec![migration("apps", "web-01", Phase::Preparing)]))[STATUS_MD];
        let chart = md.split("```mermaid\n").nth(1).unwrap().split("```").next().unwrap();
        assert_eq!(
            chart,
            "gantt\n    title apps/web-01\n    dateFormat YYYY-MM-DD HH:mm:ss\n    axisFormat %m-%d %H:%M\n    \
             Pending : 2025-03-01 10:00:00, 2025-03-01 10:00:05\n    \
             Discovering : 2025-03-01 10:00:05, 2025-03-01 10:01:00\n    \
             Preparing : milestone, 2025-03-01 10:01:00, 0s\n"
        );
    }

    #[test]
    fn no_migrations_still_renders_an_overview() {
        let files = status_files(&input(vec![]));
        assert_eq!(files.len(), 1);
        assert!(files[STATUS_MD].contains("Source commit: `feedface` · 0 migrations"));
    }
}
