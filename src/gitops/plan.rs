//! The pull-request comment: what merging would create and change, every
//! manifest error with its file and line, removed manifests, and after the
//! merge the migrations' progress. Pure and deterministic: the same input
//! gives the same text, so an unchanged plan is not re-posted.
//!
//! Everything that comes from a manifest, the cluster or a source host goes
//! into code (fenced blocks, inline code or `<code>`), never into Markdown
//! prose: it cannot break the layout, inject links or @-mention anyone.

use super::ANNOTATION_ORPHANED;
use super::forge::CommitState;
use crate::api::Phase;
use similar::TextDiff;

/// Hidden first line of the one comment vmmigrate keeps per pull request.
pub const PLAN_MARKER: &str = "<!-- vmmigrate:plan -->";
/// The commit status context of the plan.
pub const STATUS_CONTEXT: &str = "vmmigrate/plan";

/// GitHub refuses comment bodies over 65 536 characters.
const MAX_COMMENT_CHARS: usize = 65_000;
/// The plan stays under this so the progress comment can still carry it.
const MAX_PLAN_CHARS: usize = 60_000;
/// Lines of one diff or one new migration's YAML before the rest is cut.
const MAX_BLOCK_LINES: usize = 300;
/// What a plan too long for one comment still lists.
const COMPACT_MAX_ERRORS: usize = 50;
const COMPACT_MAX_ENTRIES: usize = 200;
/// GitHub rejects longer commit status descriptions.
const MAX_DESCRIPTION_CHARS: usize = 140;
/// A last error in the progress table is cut here.
const MAX_PROGRESS_ERROR_CHARS: usize = 200;

/// One manifest of the pull request, rendered, with the live object if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanEntry {
    /// The manifest's path in the repository.
    pub path: String,
    pub name: String,
    pub namespace: String,
    /// The rendered spec as YAML.
    pub rendered_yaml: String,
    /// The live CR's spec as YAML; `None` if the migration is new.
    pub live_yaml: Option<String>,
    /// Read-only discovery: a summary (VM, power, disks, NICs), or why the source was not reachable.
    pub discovery: Option<Result<String, String>>,
    /// `spec.wave` as `(plan, number)`.
    pub wave: Option<(String, i32)>,
    /// When the cutover may happen, unless `Now`: e.g. `window … Europe/Berlin`, `on approval`.
    pub cutover: Option<String>,
    /// The tenant's bound folder (`migrations/apps`), when tenants are configured.
    pub tenant: Option<String>,
}

/// Everything the plan of one pull request head shows.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PlanInput {
    pub head_sha: String,
    pub entries: Vec<PlanEntry>,
    /// `path:line: field: message`, in the order rendering found them.
    pub errors: Vec<String>,
    /// Manifests the pull request deletes; their live migrations are never deleted.
    pub removed: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Create,
    Update,
    Unchanged,
}

fn change_of(entry: &PlanEntry) -> Change {
    match &entry.live_yaml {
        None => Change::Create,
        Some(live) if normalize(live) == normalize(&entry.rendered_yaml) => Change::Unchanged,
        Some(_) => Change::Update,
    }
}

#[derive(Debug, Default)]
struct Counts {
    create: usize,
    update: usize,
    unchanged: usize,
    errors: usize,
    removed: usize,
    unreachable: usize,
}

impl Counts {
    fn of(input: &PlanInput) -> Self {
        let mut counts =
            Counts { errors: input.errors.len(), removed: input.removed.len(), ..Counts::default() };
        for entry in &input.entries {
            match change_of(entry) {
                Change::Create => counts.create += 1,
                Change::Update => counts.update += 1,
                Change::Unchanged => counts.unchanged += 1,
            }
            if matches!(entry.discovery, Some(Err(_))) {
                counts.unreachable += 1;
            }
        }
        counts
    }

    /// `N to create, M to change, K unchanged` (+ removed when there are any).
    fn changes(&self) -> String {
        let mut text =
            format!("{} to create, {} to change, {} unchanged", self.create, self.update, self.unchanged);
        if self.removed > 0 {
            text.push_str(&format!(", {} removed (kept running)", self.removed));
        }
        text
    }
}

/// The whole comment for one pull request head; starts with [`PLAN_MARKER`].
pub(crate) fn plan_comment(input: &PlanInput) -> String {
    let full = render_plan(input, Detail::Full);
    if full.chars().count() <= MAX_PLAN_CHARS { full } else { render_plan(input, Detail::Compact) }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Detail {
    Full,
    /// One line per migration, errors capped: for plans too long for one comment.
    Compact,
}

fn render_plan(input: &PlanInput, detail: Detail) -> String {
    let counts = Counts::of(input);
    let mut entries: Vec<&PlanEntry> = input.entries.iter().collect();
    entries.sort_by(|a, b| (&a.path, &a.namespace, &a.name).cmp(&(&b.path, &b.namespace, &b.name)));
    let mut removed: Vec<&String> = input.removed.iter().collect();
    removed.sort();
    removed.dedup();

    let mut out = String::new();
    out.push_str(PLAN_MARKER);
    out.push_str("\n### vmmigrate plan\n\n");
    out.push_str(&format!("**{}, {}**\n\n", counts.changes(), plural(counts.errors, "error", "errors")));

    if !input.errors.is_empty() {
        out.push_str("#### Errors\n\nNothing is applied while any manifest has an error.\n\n");
        let shown = match detail {
            Detail::Full => input.errors.len(),
            Detail::Compact => input.errors.len().min(COMPACT_MAX_ERRORS),
        };
        let mut text = input.errors[..shown].join("\n");
        if shown < input.errors.len() {
            text.push_str(&format!("\n… and {} more", input.errors.len() - shown));
        }
        out.push_str(&code_block("text", &text));
        out.push('\n');
    }

    let changing: Vec<&PlanEntry> =
        entries.iter().copied().filter(|e| change_of(e) != Change::Unchanged).collect();
    let unchanged: Vec<&PlanEntry> =
        entries.iter().copied().filter(|e| change_of(e) == Change::Unchanged).collect();

    if !changing.is_empty() {
        out.push_str("#### Migrations\n\n");
        match detail {
            Detail::Full => {
                for entry in &changing {
                    out.push_str(&entry_details(entry));
                }
            }
            Detail::Compact => {
                out.push_str(
                    "The full plan is too long for one comment; `vmmigrate plan` shows it locally.\n\n",
                );
                for entry in changing.iter().take(COMPACT_MAX_ENTRIES) {
                    let verb = if change_of(entry) == Change::Create { "create" } else { "change" };
                    out.push_str(&format!(
                        "- {verb} {} from {}{}{}\n",
                        inline_code(&object_key(entry)),
                        inline_code(&entry.path),
                        tenant_suffix(entry),
                        discovery_suffix(entry)
                    ));
                }
                if changing.len() > COMPACT_MAX_ENTRIES {
                    out.push_str(&format!("- … and {} more\n", changing.len() - COMPACT_MAX_ENTRIES));
                }
                out.push('\n');
            }
        }
    }

    out.push_str(&waves_section(&entries));

    if !unchanged.is_empty() {
        out.push_str(&format!(
            "<details><summary>{} unchanged</summary>\n\n",
            plural(unchanged.len(), "migration", "migrations")
        ));
        let limit = if detail == Detail::Full { unchanged.len() } else { COMPACT_MAX_ENTRIES };
        for entry in unchanged.iter().take(limit) {
            out.push_str(&format!(
                "- {} from {}{}{}\n",
                inline_code(&object_key(entry)),
                inline_code(&entry.path),
                tenant_suffix(entry),
                discovery_suffix(entry)
            ));
        }
        if unchanged.len() > limit {
            out.push_str(&format!("- … and {} more\n", unchanged.len() - limit));
        }
        out.push_str("\n</details>\n\n");
    }

    if !removed.is_empty() {
        out.push_str("#### Removed from Git\n\n");
        let limit = if detail == Detail::Full { removed.len() } else { COMPACT_MAX_ENTRIES };
        for path in removed.iter().take(limit) {
            out.push_str(&format!("- {}\n", inline_code(path)));
        }
        if removed.len() > limit {
            out.push_str(&format!("- … and {} more\n", removed.len() - limit));
        }
        out.push_str(&format!(
            "\nRemoving a manifest never deletes a migration: a running migration from it continues and is \
             marked with the {} annotation. Delete it with `kubectl delete` if that is intended.\n\n",
            inline_code(ANNOTATION_ORPHANED)
        ));
    }

    if input.entries.is_empty() && input.errors.is_empty() && removed.is_empty() {
        out.push_str("No migrations are created, changed or removed by this pull request.\n\n");
    }

    out.push_str(&format!("---\n<sub>Updated for {}</sub>\n", inline_code(&input.head_sha)));
    out
}

/// A collapsible section for one created or changed migration.
fn entry_details(entry: &PlanEntry) -> String {
    let change = change_of(entry);
    let verb = if change == Change::Create { "create" } else { "change" };
    let tenant = entry
        .tenant
        .as_ref()
        .map(|t| format!(" (tenant <code>{}</code>)", html_escape(t)))
        .unwrap_or_default();
    let mut out = format!(
        "<details><summary>{verb} <code>{}</code> from <code>{}</code>{tenant}</summary>\n\n",
        html_escape(&object_key(entry)),
        html_escape(&entry.path)
    );
    match (&entry.live_yaml, change) {
        (Some(live), Change::Update) => {
            let (live, rendered) = (normalize(live), normalize(&entry.rendered_yaml));
            let diff = TextDiff::from_lines(live.as_str(), rendered.as_str())
                .unified_diff()
                .context_radius(3)
                .header("live", "rendered")
                .to_string();
            out.push_str(&capped_block("diff", &diff));
        }
        _ => {
            out.push_str("New migration:\n\n");
            out.push_str(&capped_block("yaml", &normalize(&entry.rendered_yaml)));
        }
    }
    if let Some(cutover) = &entry.cutover {
        out.push_str(&format!("\n**Cutover:** {}\n", text_value(cutover)));
    }
    match &entry.discovery {
        Some(Ok(summary)) => out.push_str(&format!("\n**Source VM:** {}\n", text_value(summary))),
        Some(Err(why)) => out.push_str(&format!("\n**Source VM not reachable:** {}\n", text_value(why))),
        None => {}
    }
    out.push_str("\n</details>\n\n");
    out
}

/// The order merging starts migrations in: per namespace and plan, each wave
/// after every migration of the wave before it has Completed.
fn waves_section(entries: &[&PlanEntry]) -> String {
    use std::collections::BTreeMap;
    let mut plans: BTreeMap<(&str, &str), BTreeMap<i32, Vec<&str>>> = BTreeMap::new();
    for e in entries {
        if let Some((plan, number)) = &e.wave {
            plans.entry((&e.namespace, plan)).or_default().entry(*number).or_default().push(&e.name);
        }
    }
    if plans.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "#### Waves\n\nEach wave starts once every migration of the wave before it has Completed; a failure holds the waves after it.\n\n",
    );
    for ((namespace, plan), waves) in plans {
        out.push_str(&format!("- {} plan {}:\n", inline_code(namespace), inline_code(plan)));
        for (number, mut names) in waves {
            names.sort();
            let shown: Vec<String> = names.iter().take(COMPACT_MAX_ENTRIES).map(|n| inline_code(n)).collect();
            let more = names.len().saturating_sub(COMPACT_MAX_ENTRIES);
            let more = if more > 0 { format!(" and {more} more") } else { String::new() };
            out.push_str(&format!("  - wave {number}: {}{more}\n", shown.join(", ")));
        }
    }
    out.push('\n');
    out
}

/// For one-line list items: the discovery result, shortened to one line.
fn discovery_suffix(entry: &PlanEntry) -> String {
    match &entry.discovery {
        Some(Ok(summary)) => format!(": {}", inline_code(&first_line(summary))),
        Some(Err(why)) => format!(": source not reachable: {}", inline_code(&first_line(why))),
        None => String::new(),
    }
}

/// The commit status for the plan: failing with the first error's `file:line`
/// when any manifest has an error, else success with the counts.
pub fn commit_state(input: &PlanInput) -> (CommitState, String) {
    let counts = Counts::of(input);
    if let Some(first) = input.errors.first() {
        let (location, detail) = first.split_once(": ").unwrap_or((first.as_str(), ""));
        let head = format!("{} in the manifests; first at ", plural(counts.errors, "error", "errors"));
        // The location must survive: a very long path is shortened from the
        // left, and the detail gets only the room that is left.
        let location = truncate_start(&first_line(location), MAX_DESCRIPTION_CHARS - head.chars().count());
        let mut description = format!("{head}{location}");
        let left = MAX_DESCRIPTION_CHARS - description.chars().count();
        if !detail.is_empty() && left > 3 {
            description.push_str(": ");
            description.push_str(&truncate_end(&first_line(detail), left - 2));
        }
        return (CommitState::Failure, description);
    }
    let mut description = if input.entries.is_empty() && input.removed.is_empty() {
        "No migration changes".to_owned()
    } else {
        counts.changes()
    };
    if counts.unreachable > 0 {
        description
            .push_str(&format!("; {} not reachable", plural(counts.unreachable, "source VM", "source VMs")));
    }
    (CommitState::Success, truncate_end(&description, MAX_DESCRIPTION_CHARS))
}

/// The comment after the merge: the same marker, a progress table kept up to
/// date until every migration has ended, and the merged plan collapsed below.
/// `plan` is the text [`plan_comment`] produced; `progress` is
/// `(name, phase, percent, last error)` per migration.
pub(crate) fn progress_comment(plan: &str, progress: &[(String, String, i32, Option<String>)]) -> String {
    let mut rows: Vec<&(String, String, i32, Option<String>)> = progress.iter().collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let ended = rows.iter().filter(|(_, phase, _, _)| is_terminal(phase)).count();

    let mut out = String::new();
    out.push_str(PLAN_MARKER);
    out.push_str("\n### vmmigrate progress\n\n");
    if rows.is_empty() {
        out.push_str("No migrations to follow.\n\n");
    } else {
        let state = if ended == rows.len() { "all have ended" } else { "updated until all have ended" };
        out.push_str(&format!(
            "**{ended} of {} ended** ({state})\n\n",
            plural(rows.len(), "migration", "migrations")
        ));
        out.push_str("| Migration | Phase | Progress | Last error |\n|---|---|---|---|\n");
        for (name, phase, percent, error) in rows {
            let error = match error {
                Some(e) if !e.trim().is_empty() => {
                    format!(
                        "<code>{}</code>",
                        table_cell(&truncate_end(&first_line(e), MAX_PROGRESS_ERROR_CHARS))
                    )
                }
                _ => "—".to_owned(),
            };
            out.push_str(&format!(
                "| <code>{}</code> | {} | {} | {error} |\n",
                table_cell(name),
                table_cell(phase),
                progress_bar(*percent)
            ));
        }
        out.push('\n');
    }

    let plan_body = plan.strip_prefix(PLAN_MARKER).unwrap_or(plan).trim();
    let footer = format!("<details><summary>Plan as merged</summary>\n\n{plan_body}\n\n</details>\n");
    if out.chars().count() + footer.chars().count() <= MAX_COMMENT_CHARS {
        out.push_str(&footer);
    } else {
        out.push_str(
            "The merged plan is too long to keep in this comment; the pull request's history has it.\n",
        );
    }
    out
}

fn is_terminal(phase: &str) -> bool {
    Phase::ALL.iter().any(|p| p.as_str() == phase && p.is_terminal())
}

/// `▓▓▓▓░░░░░░ 40 %` in inline code (so every font keeps it aligned).
fn progress_bar(percent: i32) -> String {
    let percent = percent.clamp(0, 100);
    let filled = (percent / 10) as usize;
    format!("`{}{}` {percent} %", "█".repeat(filled), "░".repeat(10 - filled))
}

/// ` (tenant `migrations/apps`)` when tenants are configured.
fn tenant_suffix(entry: &PlanEntry) -> String {
    entry.tenant.as_ref().map(|t| format!(" (tenant {})", inline_code(t))).unwrap_or_default()
}

fn object_key(entry: &PlanEntry) -> String {
    if entry.namespace.is_empty() {
        entry.name.clone()
    } else {
        format!("{}/{}", entry.namespace, entry.name)
    }
}

/// Line endings unified and a final newline, so a missing one is not a change.
fn normalize(yaml: &str) -> String {
    let mut text = yaml.replace("\r\n", "\n");
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

/// A fenced block of at most [`MAX_BLOCK_LINES`] lines, with a note when cut.
fn capped_block(lang: &str, content: &str) -> String {
    let total = content.lines().count();
    if total <= MAX_BLOCK_LINES {
        return code_block(lang, content);
    }
    let shown: Vec<&str> = content.lines().take(MAX_BLOCK_LINES).collect();
    format!(
        "{}\n_… {} more lines not shown._\n",
        code_block(lang, &shown.join("\n")),
        total - MAX_BLOCK_LINES
    )
}

/// A fenced code block whose fence is longer than any backtick run inside,
/// so no content can close it early (CommonMark §4.5).
fn code_block(lang: &str, content: &str) -> String {
    let fence = "`".repeat((longest_backtick_run(content) + 1).max(3));
    let newline = if content.ends_with('\n') { "" } else { "\n" };
    format!("{fence}{lang}\n{content}{newline}{fence}\n")
}

/// Inline code that survives backticks in the text (CommonMark §6.1), on one line.
fn inline_code(text: &str) -> String {
    let text = first_line(text);
    let ticks = "`".repeat(longest_backtick_run(&text) + 1);
    let pad = if text.starts_with('`') || text.ends_with('`') { " " } else { "" };
    format!("{ticks}{pad}{text}{pad}{ticks}")
}

/// Free text from outside: inline code when it is one line, else a `text` block.
fn text_value(text: &str) -> String {
    let text = text.trim_end();
    if text.contains('\n') { format!("\n\n{}", code_block("text", text)) } else { inline_code(text) }
}

fn longest_backtick_run(text: &str) -> usize {
    let (mut longest, mut run) = (0, 0);
    for c in text.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    longest
}

fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in first_line(text).chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A table cell. Text between inline HTML tags is still Markdown, and `|`
/// splits cells before any other parsing, so markup characters become
/// character references (which render as plain characters).
fn table_cell(text: &str) -> String {
    let mut out = String::new();
    for c in html_escape(text).chars() {
        match c {
            '|' | '`' | '*' | '_' | '[' | ']' | '~' | '\\' | '!' => out.push_str(&format!("&#{};", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Multi-line text joined onto one line.
fn first_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn truncate_end(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn truncate_start(text: &str, max: usize) -> String {
    let count = text.chars().count();
    if count <= max {
        return text.to_owned();
    }
    let tail: String = text.chars().skip(count - max.saturating_sub(1)).collect();
    format!("…{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIVE: &str = "source:\n  host: esxi01.example.internal\n  vm:\n    name: web 01\ntarget:\n  namespace: web\n  cpu: 2\n  memory: 4Gi\n";

    fn entry(path: &str, name: &str, rendered: &str, live: Option<&str>) -> PlanEntry {
        PlanEntry {
            path: path.into(),
            name: name.into(),
            namespace: "web".into(),
            rendered_yaml: rendered.into(),
            live_yaml: live.map(str::to_owned),
            discovery: None,
            wave: None,
            cutover: None,
            tenant: None,
        }
    }

    #[test]
    fn the_plan_shows_the_waves_in_order_and_each_cutover_that_waits() {
        let mut input = input();
        input.entries[0].wave = Some(("erp".into(), 2));
        input.entries[1].wave = Some(("erp".into(), 1));
        input.entries[2].wave = Some(("erp".into(), 1));
        input.entries[1].cutover = Some("on approval: waits validated until a second merged change".into());
        let comment = plan_comment(&input);
        let waves = comment.find("#### Waves").expect("a waves section");
        let section = &comment[waves..];
        assert!(
            section.contains("- `web` plan `erp`:\n  - wave 1: `web-02`, `web-03`\n  - wave 2: `web-01`\n"),
            "{comment}"
        );
        assert!(
            comment.contains("**Cutover:** `on approval: waits validated until a second merged change`"),
            "{comment}"
        );
        assert!(!plan_comment(&super::tests::input()).contains("#### Waves"), "no waves, no section");
    }

    fn input() -> PlanInput {
        PlanInput {
            head_sha: "0123456789abcdef0123456789abcdef01234567".into(),
            entries: vec![
                entry(
                    "migrations/web/web-01.yaml",
                    "web-01",
                    &LIVE.replace("memory: 4Gi", "memory: 8Gi"),
                    Some(LIVE),
                ),
                entry("migrations/web/web-02.yaml", "web-02", LIVE, None),
                entry("migrations/web/web-03.yaml", "web-03", LIVE, Some(LIVE.trim_end())),
            ],
            errors: vec![],
            removed: vec![],
        }
    }

    #[test]
    fn a_changed_spec_shows_a_unified_diff_of_live_against_rendered() {
        let comment = plan_comment(&input());
        assert!(comment.starts_with(PLAN_MARKER), "{comment}");
        assert!(comment.contains("**1 to create, 1 to change, 1 unchanged, 0 errors**"), "{comment}");
        let diff_start = comment.find("```diff\n").expect("a diff block");
        let diff = &comment[diff_start..];
        let diff = &diff[..diff.find("\n```\n").unwrap()];
        assert!(diff.contains("--- live\n+++ rendered\n"), "{diff}");
        assert!(diff.contains("\n-  memory: 4Gi\n+  memory: 8Gi"), "{diff}");
        assert!(diff.contains("\n   cpu: 2\n"), "context lines around the change: {diff}");
        assert!(!diff.contains("host:"), "only 3 lines of context: {diff}");
        assert!(comment.contains("change <code>web/web-01</code>"), "{comment}");
        assert!(comment.contains("New migration:\n\n```yaml\nsource:"), "{comment}");
        assert!(comment.trim_end().ends_with("Updated for `0123456789abcdef0123456789abcdef01234567`</sub>"));
        // A missing final newline is not a change.
        assert!(
            !comment.contains("create <code>web/web-03</code>")
                && !comment.contains("change <code>web/web-03")
        );
        assert_eq!(
            commit_state(&input()),
            (CommitState::Success, "1 to create, 1 to change, 1 unchanged".into())
        );
    }

    #[test]
    fn errors_lead_the_comment_and_fail_the_status_naming_file_and_line() {
        let mut plan = input();
        plan.errors = vec![
            "migrations/web/web-04.yaml:12: spec.source.host: required".into(),
            "migrations/db/db-01.yaml:3: spec.target.memory: not a quantity".into(),
        ];
        let comment = plan_comment(&plan);
        let errors_at = comment.find("#### Errors").expect("errors section");
        assert!(errors_at < comment.find("#### Migrations").unwrap(), "errors come first:\n{comment}");
        assert!(comment.contains(
            "```text\nmigrations/web/web-04.yaml:12: spec.source.host: required\n\
             migrations/db/db-01.yaml:3: spec.target.memory: not a quantity\n```"
        ));
        assert!(comment.contains(", 2 errors**"));
        let (state, description) = commit_state(&plan);
        assert_eq!(state, CommitState::Failure);
        assert_eq!(
            description,
            "2 errors in the manifests; first at migrations/web/web-04.yaml:12: spec.source.host: required"
        );

        let long = format!("migrations/{}/vm.yaml:7: spec.x: {}", "deep/".repeat(40), "bad ".repeat(50));
        plan.errors = vec![long];
        let (_, description) = commit_state(&plan);
        assert!(description.chars().count() <= 140, "{description}");
        assert!(description.contains("/vm.yaml:7"), "{description}");
    }

    #[test]
    fn the_same_plan_gives_the_same_text_whatever_the_input_order() {
        let mut plan = input();
        plan.removed = vec!["migrations/old/b.yaml".into(), "migrations/old/a.yaml".into()];
        let first = plan_comment(&plan);
        plan.entries.reverse();
        plan.removed.reverse();
        assert_eq!(plan_comment(&plan), first);
        assert_eq!(plan_comment(&plan), plan_comment(&plan.clone()));
        assert!(first.contains("- `migrations/old/a.yaml`\n- `migrations/old/b.yaml`\n"), "{first}");
        assert!(first.contains(ANNOTATION_ORPHANED));
        assert!(commit_state(&plan).1.contains("2 removed (kept running)"));
    }

    #[test]
    fn backticks_in_manifests_cannot_close_the_code_blocks() {
        let mut plan = input();
        plan.entries = vec![entry("migrations/`x`.yaml", "x", "note: |\n  ```\n  </details> @team\n", None)];
        plan.entries[0].discovery = Some(Err("ssh: `host` <refused>".into()));
        let comment = plan_comment(&plan);
        assert!(comment.contains("````yaml\nnote: |\n  ```\n  </details> @team\n````\n"), "{comment}");
        assert!(comment.contains("<code>migrations/`x`.yaml</code>"), "{comment}");
        assert!(comment.contains("**Source VM not reachable:** ``ssh: `host` <refused>``"), "{comment}");
        assert_eq!(commit_state(&plan).1, "1 to create, 0 to change, 0 unchanged; 1 source VM not reachable");
    }

    #[test]
    fn discovery_summaries_are_shown_per_migration() {
        let mut plan = input();
        plan.entries[1].discovery = Some(Ok("web 01: poweredOn, 2 disks (80 GiB), 1 NIC".into()));
        let comment = plan_comment(&plan);
        assert!(comment.contains("**Source VM:** `web 01: poweredOn, 2 disks (80 GiB), 1 NIC`"), "{comment}");
    }

    #[test]
    fn a_plan_too_long_for_one_comment_is_compacted() {
        let big = (0..2000).map(|i| format!("line{i}: {}\n", "x".repeat(40))).collect::<String>();
        let mut plan = input();
        plan.entries =
            (0..400).map(|i| entry(&format!("migrations/vm-{i:03}.yaml"), "vm", &big, None)).collect();
        let comment = plan_comment(&plan);
        assert!(comment.chars().count() <= MAX_PLAN_CHARS, "{}", comment.chars().count());
        assert!(comment.contains("too long for one comment"));
        assert!(comment.contains("- … and 200 more"));
        assert!(comment.starts_with(PLAN_MARKER));
    }

    #[test]
    fn an_empty_plan_says_nothing_changes() {
        let plan = PlanInput { head_sha: "abc".into(), ..PlanInput::default() };
        assert!(plan_comment(&plan).contains("No migrations are created, changed or removed"));
        assert_eq!(commit_state(&plan), (CommitState::Success, "No migration changes".into()));
    }

    #[test]
    fn progress_keeps_the_marker_and_collapses_the_plan() {
        let plan = plan_comment(&input());
        let progress = vec![
            ("web-02".to_owned(), "Importing".to_owned(), 42, None),
            ("web-01".to_owned(), "Failed".to_owned(), 130, Some("disk | copy\nfailed".to_owned())),
        ];
        let comment = progress_comment(&plan, &progress);
        assert!(comment.starts_with(PLAN_MARKER));
        assert_eq!(comment.matches(PLAN_MARKER).count(), 1, "{comment}");
        assert!(comment.contains("**1 of 2 migrations ended** (updated until all have ended)"), "{comment}");
        let web01 = comment.find("<code>web-01</code>").unwrap();
        assert!(web01 < comment.find("<code>web-02</code>").unwrap(), "rows sorted by name");
        assert!(
            comment.contains("| `██████████` 100 % | <code>disk &#124; copy failed</code> |"),
            "{comment}"
        );
        assert!(comment.contains("| Importing | `████░░░░░░` 42 % | — |"), "{comment}");
        assert!(comment.contains("<details><summary>Plan as merged</summary>\n\n### vmmigrate plan"));
        assert_eq!(progress_comment(&plan, &progress), comment);

        let done = vec![("web-01".to_owned(), "Completed".to_owned(), 100, None)];
        assert!(progress_comment(&plan, &done).contains("**1 of 1 migration ended** (all have ended)"));
    }
}
