//! The commands a person runs by hand: `vmmigrate plan` (the pull-request
//! comment, printed locally) and `vmmigrate status` (from the cluster or the
//! status branch, once or `--watch`ed).

use super::apply::server_spec;
use super::plan::{PlanEntry, PlanInput, commit_state, plan_comment};
use super::render::{RenderOptions, RenderedMigration, read_dir_files, render_tree};
use super::status_files::progress_bar;
use super::{LABEL_GITOPS, Provenance};
use crate::api::VirtualMachineMigration;
use crate::gitops::forge::CommitState;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use std::path::Path;

/// The plan of a local work tree against the live cluster (when reachable).
/// Returns the comment text and whether it passes.
pub(crate) async fn plan_local(
    root: &Path,
    opts: &RenderOptions,
    client: Option<&Client>,
) -> anyhow::Result<(String, bool)> {
    let files = read_dir_files(root, &opts.limits)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", root.display()))?;
    let provenance = Provenance { repo_url: root.display().to_string(), commit: "working-tree".into() };
    let mut input = PlanInput { head_sha: "working-tree".into(), ..Default::default() };
    match render_tree(&files, &provenance, opts) {
        Err(errors) => input.errors = errors.iter().map(ToString::to_string).collect(),
        Ok(rendered) => {
            let paths = rendered.iter().map(|r| r.path.as_str()).collect();
            for r in &rendered {
                match plan_entry(client, None, r, &paths).await? {
                    Ok(entry) => input.entries.push(entry),
                    Err(refusal) => input.errors.push(refusal),
                }
            }
        }
    }
    let (state, _) = commit_state(&input);
    Ok((plan_comment(&input), state == CommitState::Success))
}

/// How a rendered `spec.cutover` reads in the plan; `None` for `Now`.
fn cutover_summary(cutover: &serde_json::Value) -> Option<String> {
    match cutover.get("mode").and_then(|m| m.as_str()).unwrap_or("Now") {
        "Window" => {
            let w = cutover.get("window")?;
            let field = |k: &str| w.get(k).and_then(|v| v.as_str()).unwrap_or_default().to_owned();
            let zone = w.get("timeZone").and_then(|v| v.as_str()).unwrap_or("UTC");
            Some(format!("in the window {} to {} {zone}; discovery and validation run at once", field("start"), field("end")))
        }
        "Approval" if cutover.get("approved").and_then(|a| a.as_bool()) == Some(true) => {
            Some("on approval: approved, once the manifest has changed since the change that created the migration (a change cannot create and approve it)".to_owned())
        }
        "Approval" => Some(
            "on approval: waits validated until a second merged change sets spec.cutover.approved: true (or the approve-cutover annotation)"
                .to_owned(),
        ),
        _ => None,
    }
}

/// One plan entry: the rendered spec next to the live one, both as the API
/// server stores them (a server-side dry run adds the server's defaults, so
/// only real changes show). Without a cluster the rendered spec is shown as
/// written. `Ok(Err(_))`: the API server would refuse the manifest.
/// `repo`: the repository the gitops loop tracks (a live migration applied
/// from another one is not this plan's); `None` for a local work tree, whose
/// remote is not known.
pub(crate) async fn plan_entry(
    client: Option<&Client>,
    repo: Option<&str>,
    r: &RenderedMigration,
    paths: &std::collections::BTreeSet<&str>,
) -> anyhow::Result<Result<PlanEntry, String>> {
    let mut entry = PlanEntry {
        path: r.path.clone(),
        name: r.name.clone(),
        namespace: r.namespace.clone(),
        rendered_yaml: serde_yaml::to_string(&r.object["spec"])?,
        live_yaml: None,
        discovery: None,
        wave: r.object.pointer("/spec/wave").and_then(|w| {
            let plan = w.get("plan").and_then(|p| p.as_str()).unwrap_or("default").to_owned();
            Some((plan, w.get("number")?.as_i64()? as i32))
        }),
        cutover: r.object.pointer("/spec/cutover").and_then(cutover_summary),
        tenant: r.tenant.clone(),
    };
    let Some(client) = client else { return Ok(Ok(entry)) };
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &r.namespace);
    if let Some(live) = api.get_opt(&r.name).await? {
        // A pull request may name any name: another team's migration, or
        // one created with kubectl, is not shown to it, and apply refuses it.
        if let Some(refusal) = super::apply::takeover(&live, r, repo, paths) {
            return Ok(Err(format!("{refusal} (its spec is not shown)")));
        }
        match server_spec(client, r).await {
            Ok(Some(spec)) => entry.rendered_yaml = serde_yaml::to_string(&spec)?,
            // Not allowed to dry-run: the live spec is projected on what the
            // manifest writes, so server defaults still do not show as changes.
            Ok(None) => {
                let live = project(&serde_json::to_value(&live.spec)?, &r.object["spec"]);
                entry.live_yaml = Some(serde_yaml::to_string(&live)?);
                return Ok(Ok(entry));
            }
            Err(refusal) => return Ok(Err(format!("{}: {}/{}: {refusal}", r.path, r.namespace, r.name))),
        }
        entry.live_yaml = Some(serde_yaml::to_string(&serde_json::to_value(&live.spec)?)?);
    } else if let Err(refusal) = server_spec(client, r).await {
        return Ok(Err(format!("{}: {}/{}: {refusal}", r.path, r.namespace, r.name)));
    }
    Ok(Ok(entry))
}

/// `live` reduced to the object keys `shape` has (arrays and scalars whole).
fn project(live: &serde_json::Value, shape: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match (live, shape) {
        (Value::Object(l), Value::Object(w)) => {
            Value::Object(w.keys().filter_map(|k| Some((k.clone(), project(l.get(k)?, &w[k])))).collect())
        }
        (l, _) => l.clone(),
    }
}

/// One line per migration: name, phase, a progress bar, the last error.
pub(crate) fn status_table(migrations: &[VirtualMachineMigration]) -> String {
    let mut rows = vec![format!("{:<40} {:<27} {:<16} {}", "MIGRATION", "PHASE", "PROGRESS", "LAST ERROR")];
    for m in migrations {
        let status = m.status.clone().unwrap_or_default();
        let percent = match (status.phase, &status.progress) {
            (crate::api::Phase::Completed, _) => 100,
            (_, Some(p)) => p.percent,
            _ => 0,
        };
        let error = status.errors.last().map(|e| format!("{}: {}", e.reason, e.message)).unwrap_or_default();
        let error: String = error.chars().take(80).collect();
        rows.push(format!(
            "{:<40} {:<27} {:<16} {}",
            format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any()),
            status.phase.to_string(),
            progress_bar(percent),
            error
        ));
    }
    rows.join("\n") + "\n"
}

/// The migrations vmmigrate's gitops side manages, from the cluster.
pub(crate) async fn live_migrations(
    client: &Client,
    all: bool,
) -> anyhow::Result<Vec<VirtualMachineMigration>> {
    let lp = if all {
        ListParams::default()
    } else {
        ListParams::default().labels(&format!("{LABEL_GITOPS}=true"))
    };
    let mut items = Api::<VirtualMachineMigration>::all(client.clone()).list(&lp).await?.items;
    items.sort_by_key(|m| (m.namespace(), m.name_any()));
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Phase, Progress, VirtualMachineMigrationStatus};

    #[test]
    fn projection_keeps_only_what_the_manifest_writes() {
        let live = serde_json::json!({"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2]});
        let shape = serde_json::json!({"b": {"c": 0}, "e": [], "x": 1});
        assert_eq!(project(&live, &shape), serde_json::json!({"b": {"c": 2}, "e": [1, 2]}));
    }

    #[test]
    fn status_table_shows_phase_bar_and_last_error() {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(serde_json::json!({
            "apiVersion": "migration.platform.example/v1alpha1", "kind": "VirtualMachineMigration",
            "metadata": { "name": "web-01", "namespace": "apps" },
            "spec": {
                "source": { "host": "esxi", "hostKey": format!("SHA256:{}", "A".repeat(43)),
                            "credentialsSecretRef": { "name": "s" }, "vm": { "name": "web" } },
                "destination": { "namespace": "apps", "storageClassName": "fast" },
            },
        }))
        .unwrap();
        vmm.status = Some(VirtualMachineMigrationStatus {
            phase: Phase::Importing,
            progress: Some(Progress { percent: 50, ..Default::default() }),
            ..Default::default()
        });
        let table = status_table(&[vmm]);
        let row = table.lines().nth(1).unwrap();
        assert!(row.starts_with("apps/web-01"), "{row}");
        assert!(row.contains("Importing") && row.contains(&progress_bar(50)), "{row}");
    }
}
