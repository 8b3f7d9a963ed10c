//! Applying one commit's migrations: all or nothing, server-side apply with
//! our own field manager, never a delete of a migration (a rehearsal's aside).
//!
//! 1. Every rendered object is sent as a server-side dry run first; if any is
//!    refused, nothing of that commit is applied and every refusal is
//!    reported (with the manifest's path).
//! 2. For a migration already past `Validated`, spec changes that would
//!    change *what* is migrated or *how the source is touched* are held back
//!    (`source`, `destination`, `networkMap`, `powerOffPolicy`, `conversion`,
//!    `mode`, `rehearsal`):
//!    the live values are kept and the hold is reported. `strategy`,
//!    `validation` and `cleanup` still apply. Terminal migrations
//!    (Completed, Failed) take no spec change at all: create a new one.
//! 3. A live migration applied by us whose manifest left Git is marked
//!    orphaned (an annotation, through a merge patch so that field ownership
//!    does not change) and is otherwise left alone; it is unmarked when the
//!    manifest comes back. A rehearsal (`spec.mode: Rehearsal`) is the one
//!    exception: it never touched the source's power and its objects are
//!    throwaway, so when its manifest leaves Git it is deleted, and its
//!    finalizer removes its VM, volumes and any snapshot it still holds.
//!
//! 4. No takeover: a live migration of the same namespace and name that
//!    this repository's manifest at that path did not create is never
//!    applied over (a manifest named like a kubectl-created migration, or
//!    another repository's). A manifest moved to another path of the same
//!    repository (its old path gone from the commit) keeps its migration;
//!    anything else needs the live object's [`ANNOTATION_ADOPT`] naming the
//!    manifest's path, set by someone who may edit it. The commit is
//!    refused whole, as for a dry-run refusal, and the plan says why.
//!
//! The real apply can still fail half-way (the API server going away between
//! two objects); the next poll applies the same commit again, and server-side
//! apply is idempotent, so the cluster converges on the commit.

use super::render::RenderedMigration;
use super::{
    ANNOTATION_ADOPT, ANNOTATION_CREATED_SPEC, ANNOTATION_ORPHANED, ANNOTATION_PATH, ANNOTATION_REPO,
    FIELD_MANAGER, LABEL_GITOPS,
};
use crate::api::{Phase, VirtualMachineMigration};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use std::collections::BTreeSet;

/// Spec fields a migration keeps once it is past `Validated`: a rehearsal
/// never becomes a migration that powers its source off mid-way, nor the reverse.
pub(crate) const HELD_FIELDS: &[&str] =
    &["source", "destination", "networkMap", "powerOffPolicy", "conversion", "mode", "rehearsal"];

/// What applying one commit did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// (namespace, name) applied (created or updated; unchanged ones too).
    pub applied: Vec<(String, String)>,
    /// Spec changes held back: (namespace, name, explanation).
    pub held: Vec<(String, String, String)>,
    /// Live migrations whose manifest is gone.
    pub orphaned: Vec<(String, String)>,
    /// Rehearsals whose manifest is gone, deleted with what they created.
    pub deleted: Vec<(String, String)>,
    /// Rehearsals whose manifest is gone that vmmigrate may not delete
    /// (its RBAC): kept and marked orphaned (also in `orphaned`).
    pub undeletable: Vec<(String, String)>,
}

/// Why a commit was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("the commit was not applied: {}", .0.join("; "))]
    Refused(Vec<String>),
    #[error("the API server: {0}")]
    Api(#[from] kube::Error),
}

fn phase_of(live: &VirtualMachineMigration) -> Phase {
    live.status.as_ref().map(|s| s.phase).unwrap_or_default()
}

/// Whether the migration has gone past the point where its identity may change.
fn identity_fixed(live: &VirtualMachineMigration) -> bool {
    let status = live.status.clone().unwrap_or_default();
    let phase = status.phase;
    let beyond = |p: Phase| p > Phase::Validated && p.is_active();
    beyond(phase)
        || status.failed_phase.is_some_and(beyond)
        || status.timestamps.shutdown_requested.is_some()
        || status.timestamps.source_powered_off.is_some()
}

/// The sha256 of a rendered spec (its keys are sorted: one spec, one digest).
fn spec_digest(rendered: &Value) -> String {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_string(&rendered["spec"]).unwrap_or_default();
    Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The object to apply for `rendered` given the live migration, plus a
/// note when changes were held back.
pub(crate) fn reconcile_spec(
    rendered: &Value,
    live: Option<&VirtualMachineMigration>,
) -> (Value, Option<String>) {
    let approved = rendered.pointer("/spec/cutover/approved").and_then(Value::as_bool) == Some(true);
    let Some(live) = live else {
        // Created now: the spec it is created with is recorded, and an
        // approval in it is held (the change that creates a migration
        // cannot approve its own cutover).
        let mut object = rendered.clone();
        object["metadata"]["annotations"][ANNOTATION_CREATED_SPEC] = Value::String(spec_digest(rendered));
        let note = approved.then(|| {
            object["spec"]["cutover"]["approved"] = Value::Bool(false);
            "spec.cutover.approved not applied: the change that creates a migration cannot approve its cutover; merge the approval as a later change of its manifest".to_owned()
        });
        return (object, note);
    };
    let created = live.annotations().get(ANNOTATION_CREATED_SPEC);
    let (mut object, note) = if approved && created.is_some_and(|d| *d == spec_digest(rendered)) {
        let mut held = rendered.clone();
        held["spec"]["cutover"]["approved"] = Value::Bool(false);
        let (object, _) = reconcile_spec_of_live(&held, live);
        (
            object,
            Some("spec.cutover.approved not applied: the approval counts once the manifest's spec has changed since the change that created the migration".to_owned()),
        )
    } else {
        reconcile_spec_of_live(rendered, live)
    };
    // Kept through every apply (an annotation the apply left out would go).
    if let Some(digest) = created {
        object["metadata"]["annotations"][ANNOTATION_CREATED_SPEC] = Value::String(digest.clone());
    }
    (object, note)
}

/// [`reconcile_spec`] of a migration that exists.
fn reconcile_spec_of_live(rendered: &Value, live: &VirtualMachineMigration) -> (Value, Option<String>) {
    let live_spec = serde_json::to_value(&live.spec).unwrap_or(Value::Null);
    let mut object = rendered.clone();
    let phase = phase_of(live);
    if matches!(phase, Phase::Completed | Phase::Failed) {
        // The live spec carries the server's defaults: it contains an
        // unchanged manifest's spec.
        let changed = !crate::objects::semantic::agrees(&live_spec, &rendered["spec"]);
        object["spec"] = live_spec;
        let note = changed.then(|| {
            format!("{phase} is terminal: spec changes are not applied; create a new migration to run again")
        });
        return (object, note);
    }
    if !identity_fixed(live) {
        return (object, None);
    }
    let mut held = Vec::new();
    for field in HELD_FIELDS {
        let wanted = rendered["spec"].get(*field).cloned().unwrap_or(Value::Null);
        let current = live_spec.get(*field).cloned().unwrap_or(Value::Null);
        // Server defaults make the live value a superset of what was written.
        // `mode` and `rehearsal` are never defaulted into the live value: a
        // manifest that drops them asks for a change too (a rehearsal to Cold).
        let unset_is_a_value = matches!(*field, "mode" | "rehearsal");
        if (!wanted.is_null() || unset_is_a_value) && !crate::objects::semantic::agrees(&current, &wanted) {
            held.push(*field);
        }
        if current.is_null() {
            // Unset on the live object (a default, e.g. `mode: Cold`): it stays unset.
            if let Some(spec) = object["spec"].as_object_mut() {
                spec.remove(*field);
            }
        } else {
            object["spec"][*field] = current;
        }
    }
    let note = (!held.is_empty()).then(|| {
        format!(
            "spec.{} not changed: the migration is in {phase} and already acts on the source; \
             these fields are fixed after Validated (strategy, validation and cleanup still apply)",
            held.join(", spec.")
        )
    });
    (object, note)
}

/// Why applying `r` over the live migration `live` would take over an
/// object this repository's manifest did not create (see the module
/// documentation, 4.); `None` when it may be applied. `repo`: the tracked
/// repository (`None` for a local work tree, whose remote is not known);
/// `paths`: every manifest path of the commit.
pub(crate) fn takeover(
    live: &VirtualMachineMigration,
    r: &RenderedMigration,
    repo: Option<&str>,
    paths: &BTreeSet<&str>,
) -> Option<String> {
    let annotation = |key: &str| live.annotations().get(key).map(String::as_str);
    if annotation(ANNOTATION_ADOPT) == Some(r.path.as_str()) {
        return None;
    }
    let ours = live.labels().get(LABEL_GITOPS).is_some_and(|v| v == "true")
        && annotation(ANNOTATION_REPO).is_some()
        && repo.is_none_or(|repo| annotation(ANNOTATION_REPO) == Some(repo));
    let from = match (ours, annotation(ANNOTATION_PATH)) {
        (true, Some(path)) if path == r.path => return None,
        // Moved within the repository: its old manifest is gone.
        (true, Some(path)) if !paths.contains(path) => return None,
        (true, Some(path)) => format!("it is managed from {path}"),
        (true, None) => "it names no manifest path".to_owned(),
        (false, _) => match annotation(ANNOTATION_REPO) {
            Some(other) => format!("it is managed from another repository ({other})"),
            None => "it was not created from Git".to_owned(),
        },
    };
    Some(format!(
        "{}: {}/{}: a migration of that name exists and {from}: this manifest would take it over, so nothing of this commit is applied. Rename the manifest, or have the migration's owner annotate it {ANNOTATION_ADOPT}={}",
        r.path, r.namespace, r.name, r.path
    ))
}

/// The spec as the API server would store it if `rendered` were applied now:
/// a server-side dry run, so defaults and admission are the server's own
/// (what `kubectl diff` shows). `Ok(None)`: not allowed to ask (with
/// `--no-apply` the ServiceAccount may lack `create`); `Err` carries the
/// server's refusal of the manifest.
pub(crate) async fn server_spec(
    client: &Client,
    rendered: &RenderedMigration,
) -> Result<Option<Value>, String> {
    let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &rendered.namespace);
    let live = api.get_opt(&rendered.name).await.map_err(|e| e.to_string())?;
    let (object, _) = reconcile_spec(&rendered.object, live.as_ref());
    let dry = PatchParams::apply(FIELD_MANAGER).force().dry_run();
    match api.patch(&rendered.name, &dry, &Patch::Apply(&object)).await {
        Ok(stored) => Ok(Some(serde_json::to_value(&stored.spec).unwrap_or(Value::Null))),
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(None),
        Err(kube::Error::Api(s)) => Err(s.message),
        Err(e) => Err(e.to_string()),
    }
}

/// Applies one commit's migrations (see the module documentation).
/// `namespaces`: where to look for orphans (all namespaces when empty);
/// `repo`: the repository the commit is of: only its migrations can be
/// orphaned by it (or, for a rehearsal, deleted).
pub async fn apply_commit(
    client: &Client,
    rendered: &[RenderedMigration],
    namespaces: &[String],
    repo: &str,
) -> Result<ApplyReport, ApplyError> {
    let mut report = ApplyReport::default();
    let mut planned = Vec::with_capacity(rendered.len());
    let paths: BTreeSet<&str> = rendered.iter().map(|r| r.path.as_str()).collect();
    let mut refusals = Vec::new();
    for r in rendered {
        let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &r.namespace);
        let live = api.get_opt(&r.name).await?;
        if let Some(refusal) = live.as_ref().and_then(|live| takeover(live, r, Some(repo), &paths)) {
            refusals.push(refusal);
            continue;
        }
        let (object, note) = reconcile_spec(&r.object, live.as_ref());
        if let Some(note) = note {
            report.held.push((r.namespace.clone(), r.name.clone(), note));
        }
        // Marks that go once the commit applies: an orphan's mark, and an
        // owner's consent to adoption (used once: it is managed from Git now).
        let unmark: Vec<&str> = [ANNOTATION_ORPHANED, ANNOTATION_ADOPT]
            .into_iter()
            .filter(|key| live.as_ref().is_some_and(|l| l.annotations().contains_key(*key)))
            .collect();
        planned.push((r, api, object, unmark));
    }
    // 1. Dry run of everything; nothing is applied unless all pass.
    let dry = PatchParams::apply(FIELD_MANAGER).force().dry_run();
    for (r, api, object, _) in &planned {
        if let Err(e) = api.patch(&r.name, &dry, &Patch::Apply(object)).await {
            let message = match &e {
                kube::Error::Api(s) => s.message.clone(),
                other => other.to_string(),
            };
            refusals.push(format!("{}: {}/{}: {message}", r.path, r.namespace, r.name));
        }
    }
    if !refusals.is_empty() {
        return Err(ApplyError::Refused(refusals));
    }
    // 2. The real apply, earlier waves first: the controller orders a wave
    // against the migrations that exist, so a later wave must not exist first.
    planned
        .sort_by_key(|(r, ..)| r.object.pointer("/spec/wave/number").and_then(Value::as_i64).unwrap_or(-1));
    let real = PatchParams::apply(FIELD_MANAGER).force();
    for (r, api, object, unmark) in &planned {
        api.patch(&r.name, &real, &Patch::Apply(object)).await?;
        if !unmark.is_empty() {
            let nulls: serde_json::Map<String, Value> =
                unmark.iter().map(|key| ((*key).to_owned(), Value::Null)).collect();
            let unmark = json!({ "metadata": { "annotations": nulls } });
            api.patch(&r.name, &PatchParams::default(), &Patch::Merge(&unmark)).await?;
        }
        report.applied.push((r.namespace.clone(), r.name.clone()));
    }
    // 3. Orphans: ours, live, not in this commit.
    let wanted: BTreeSet<(String, String)> =
        rendered.iter().map(|r| (r.namespace.clone(), r.name.clone())).collect();
    let lp = ListParams::default().labels(&format!("{LABEL_GITOPS}=true"));
    let mut live = Vec::new();
    if namespaces.is_empty() {
        live.extend(Api::<VirtualMachineMigration>::all(client.clone()).list(&lp).await?.items);
    } else {
        for ns in namespaces {
            live.extend(
                Api::<VirtualMachineMigration>::namespaced(client.clone(), ns).list(&lp).await?.items,
            );
        }
    }
    for vmm in live {
        let key = (vmm.namespace().unwrap_or_default(), vmm.name_any());
        let from_repo = vmm.annotations().get(ANNOTATION_REPO).is_some_and(|r| r == repo);
        if wanted.contains(&key) || !from_repo {
            continue;
        }
        if vmm.spec.mode == crate::api::MigrationMode::Rehearsal {
            let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &key.0);
            // Only the object that was listed: a new one of the same name is not ours to delete.
            let params = DeleteParams {
                preconditions: Some(Preconditions { uid: vmm.uid(), resource_version: None }),
                ..Default::default()
            };
            match api.delete(&key.1, &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                // The shipped RBAC lets vmmigrate delete no migration: the
                // rehearsal is kept and marked like any orphan, and the
                // apply goes on (a 403 must not stop every later commit).
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tracing::warn!(namespace = %key.0, name = %key.1, "rehearsal manifest removed from Git, but vmmigrate may not delete migrations (RBAC): kept and marked orphaned; delete it with kubectl");
                    report.undeletable.push(key.clone());
                }
                Err(e) => return Err(e.into()),
            }
            if !report.undeletable.contains(&key) {
                tracing::info!(namespace = %key.0, name = %key.1, "rehearsal manifest removed from Git; the rehearsal and its objects are deleted");
                report.deleted.push(key);
                continue;
            }
        }
        if !vmm.annotations().contains_key(ANNOTATION_ORPHANED) {
            let api: Api<VirtualMachineMigration> = Api::namespaced(client.clone(), &key.0);
            let mark = json!({ "metadata": { "annotations": { ANNOTATION_ORPHANED: "true" } } });
            api.patch(&key.1, &PatchParams::default(), &Patch::Merge(&mark)).await?;
            tracing::warn!(namespace = %key.0, name = %key.1, "manifest removed from Git; the migration is kept and marked orphaned");
        }
        report.orphaned.push(key);
    }
    report.orphaned.sort();
    report.deleted.sort();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(phase: Phase, spec: Value) -> VirtualMachineMigration {
        let mut vmm: VirtualMachineMigration = serde_json::from_value(json!({
            "apiVersion": "migration.platform.example/v1alpha1",
            "kind": "VirtualMachineMigration",
            "metadata": { "name": "web", "namespace": "apps" },
            "spec": spec,
        }))
        .unwrap();
        vmm.status = Some(crate::api::VirtualMachineMigrationStatus { phase, ..Default::default() });
        vmm
    }

    fn spec(vm: &str, retry_limit: i32) -> Value {
        json!({
            "source": { "host": "esxi", "hostKey": format!("SHA256:{}", "A".repeat(43)),
                        "credentialsSecretRef": { "name": "s" }, "vm": { "name": vm } },
            "destination": { "namespace": "apps", "storageClassName": "fast" },
            "strategy": { "retryLimit": retry_limit },
        })
    }

    fn rendered(vm: &str, retry_limit: i32) -> Value {
        json!({ "apiVersion": "migration.platform.example/v1alpha1", "kind": "VirtualMachineMigration",
                "metadata": { "name": "web", "namespace": "apps" }, "spec": spec(vm, retry_limit) })
    }

    #[test]
    fn before_preparing_every_spec_change_applies() {
        let (object, note) =
            reconcile_spec(&rendered("db", 3), Some(&live(Phase::Validated, spec("web", 5))));
        assert_eq!(object["spec"]["source"]["vm"]["name"], "db");
        assert_eq!(note, None);
    }

    #[test]
    fn past_validated_the_source_is_held_but_strategy_applies() {
        let (object, note) =
            reconcile_spec(&rendered("db", 3), Some(&live(Phase::Converting, spec("web", 5))));
        assert_eq!(object["spec"]["source"]["vm"]["name"], "web", "the VM being migrated does not change");
        assert_eq!(object["spec"]["strategy"]["retryLimit"], 3);
        assert!(note.unwrap().contains("spec.source"));
    }

    #[test]
    fn past_validated_a_cold_migration_does_not_become_a_rehearsal_nor_a_rehearsal_cold() {
        let mut wanted = rendered("web", 5);
        wanted["spec"]["mode"] = json!("Rehearsal");
        wanted["spec"]["rehearsal"] = json!({ "name": "trial" });
        // The live cold migration has no `mode` at all (the default is not written).
        let (object, note) = reconcile_spec(&wanted, Some(&live(Phase::Preparing, spec("web", 5))));
        assert_eq!(object["spec"].get("mode"), None, "{object}");
        assert_eq!(object["spec"].get("rehearsal"), None);
        assert!(note.unwrap().contains("spec.mode, spec.rehearsal"));

        let mut rehearsing = spec("web", 5);
        rehearsing["mode"] = json!("Rehearsal");
        let (object, note) = reconcile_spec(&rendered("web", 5), Some(&live(Phase::Converting, rehearsing)));
        assert_eq!(object["spec"]["mode"], "Rehearsal", "a rehearsal stays one");
        assert!(note.unwrap().contains("spec.mode"), "dropping the mode is a change, and it is held");
        let (_, note) = reconcile_spec(&rendered("web", 5), Some(&live(Phase::Converting, spec("web", 5))));
        assert_eq!(note, None, "a cold migration's unset mode is no change");
    }

    #[test]
    fn terminal_migrations_take_no_spec_change() {
        let (object, note) =
            reconcile_spec(&rendered("web", 3), Some(&live(Phase::Completed, spec("web", 5))));
        assert_eq!(object["spec"]["strategy"]["retryLimit"], 5);
        assert!(note.unwrap().contains("terminal"));
        let (_, note) = reconcile_spec(&rendered("web", 5), Some(&live(Phase::Completed, spec("web", 5))));
        assert_eq!(note, None, "an unchanged manifest says nothing");
    }
}
