//! The CRD's CEL rules, mirrored by hand.

use super::JSONSchemaProps;
use serde_json::{Map, Value};

/// Every rule this file evaluates; a unit test checks the CRD has no other.
#[cfg(test)]
pub(super) const MIRRORED: &[&str] = &[
    "has(self.name) != has(self.id)",
    "self.type == 'Pod' ? !has(self.networkName) : has(self.networkName)",
    "self.maxSeconds >= self.initialSeconds",
    "(has(self.http) ? 1 : 0) + (has(self.guestAgent) ? 1 : 0) + (has(self.ip) ? 1 : 0) == 1",
    "self.mode == 'Window' ? has(self.window) : !has(self.window)",
    "!has(self.rehearsal) || (has(self.mode) && self.mode == 'Rehearsal')",
];

/// `Some(passes)` for a mirrored rule, `None` for an unknown one or when a
/// field has the wrong type (reported by the schema walk). Like the API
/// server, the rule sees the object after the schema's defaults.
pub(super) fn evaluate(rule: &str, object: &Map<String, Value>, schema: &JSONSchemaProps) -> Option<bool> {
    let get = |field: &str| -> Option<Value> {
        object
            .get(field)
            .filter(|v| !v.is_null())
            .cloned()
            .or_else(|| schema.properties.as_ref()?.get(field)?.default.as_ref().map(|d| d.0.clone()))
    };
    let has = |field: &str| get(field).is_some();
    match rule {
        "has(self.name) != has(self.id)" => Some(has("name") != has("id")),
        "self.type == 'Pod' ? !has(self.networkName) : has(self.networkName)" => {
            let pod = get("type")?.as_str()? == "Pod";
            Some(if pod { !has("networkName") } else { has("networkName") })
        }
        "self.maxSeconds >= self.initialSeconds" => {
            Some(get("maxSeconds")?.as_i64()? >= get("initialSeconds")?.as_i64()?)
        }
        "(has(self.http) ? 1 : 0) + (has(self.guestAgent) ? 1 : 0) + (has(self.ip) ? 1 : 0) == 1" => {
            Some(["http", "guestAgent", "ip"].iter().filter(|f| has(f)).count() == 1)
        }
        "self.mode == 'Window' ? has(self.window) : !has(self.window)" => {
            let window = get("mode")?.as_str()? == "Window";
            Some(if window { has("window") } else { !has("window") })
        }
        "!has(self.rehearsal) || (has(self.mode) && self.mode == 'Rehearsal')" => {
            Some(!has("rehearsal") || (has("mode") && get("mode")?.as_str()? == "Rehearsal"))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::*;
    use super::super::*;
    use super::*;

    #[test]
    fn every_cel_rule_of_the_crd_is_mirrored() {
        fn visit(s: &JSONSchemaProps, found: &mut Vec<String>) {
            found.extend(s.x_kubernetes_validations.iter().flatten().map(|r| r.rule.clone()));
            s.properties.iter().flat_map(|p| p.values()).for_each(|c| visit(c, found));
            if let Some(JSONSchemaPropsOrArray::Schema(items)) = &s.items {
                visit(items, found);
            }
        }
        let mut found = Vec::new();
        visit(spec_schema(), &mut found);
        assert!(found.len() >= 4, "{found:?}");
        for rule in found {
            assert!(
                MIRRORED.contains(&rule.as_str()),
                "CEL rule not mirrored in gitops/render/cel.rs: {rule}"
            );
        }
    }

    #[test]
    fn cel_rules_see_schema_defaults() {
        let m = manifest("a", "a")
            .replace("  destination:", "  strategy:\n    backoff:\n      maxSeconds: 5\n  destination:");
        let errors = errors_of(&[file("migrations/a.yaml", &m)]);
        assert_eq!(
            errors,
            vec![
                "migrations/a.yaml:14: spec.strategy.backoff: backoff.maxSeconds must be at least initialSeconds"
            ]
        );
    }

    #[test]
    fn a_rehearsal_section_is_refused_unless_the_mode_is_rehearsal() {
        let with = |mode: &str| {
            manifest("a", "a").replace(
                "  destination:",
                &format!("{mode}  rehearsal:\n    networkName: isolated\n  destination:"),
            )
        };
        let errors = errors_of(&[file("migrations/a.yaml", &with("  mode: Warm\n"))]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .starts_with("migrations/a.yaml:5: spec: spec.rehearsal is only allowed with mode Rehearsal"),
            "{errors:?}"
        );
        assert_eq!(errors_of(&[file("migrations/a.yaml", &with(""))]).len(), 1, "the default mode is Cold");
        assert!(errors_of(&[file("migrations/a.yaml", &with("  mode: Rehearsal\n"))]).is_empty());
        // A rehearsal beside the migration of the same VM: both in Git, each its own VM.
        let trial = manifest("a-trial", "a").replace("  destination:", "  mode: Rehearsal\n  destination:");
        let both = [file("migrations/a.yaml", &manifest("a", "a")), file("migrations/a-trial.yaml", &trial)];
        assert!(errors_of(&both).is_empty(), "{:?}", errors_of(&both));
        let twice = [
            file("migrations/b.yaml", &trial.replace("a-trial", "b-trial")),
            file("migrations/a-trial.yaml", &trial),
        ];
        assert!(
            errors_of(&twice).iter().any(|e| e.contains("is also migrated by")),
            "two rehearsals of one VM"
        );
        // The rehearsal VM's default name must fit: a name of 50 characters does, plus `-rehearsal` not.
        let long = "a".repeat(50);
        let errors = errors_of(&[file("migrations/long.yaml", &trial.replace("a-trial", &long))]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("spec.mode") && errors[0].contains("set spec.rehearsal.name"),
            "{errors:?}"
        );
        let named = trial
            .replace("a-trial", &long)
            .replace("  mode: Rehearsal\n", "  mode: Rehearsal\n  rehearsal:\n    name: short\n");
        assert!(errors_of(&[file("migrations/long.yaml", &named)]).is_empty());
        let other_ns = trial
            .replace("  mode: Rehearsal\n", "  mode: Rehearsal\n  rehearsal:\n    networkName: team-b/lab\n");
        let errors = errors_of(&[file("migrations/a-trial.yaml", &other_ns)]);
        assert!(errors.iter().any(|e| e.contains("spec.rehearsal.networkName")), "{errors:?}");
    }
}
