//! The Argo CD health check in `deploy/argocd/` run by a real Lua interpreter
//! against the cases of its `health_test.yaml`, the way Argo CD runs it: the
//! script is a chunk that sees the live object as the global `obj` and returns
//! `hs`. Each `testdata/*.yaml` object is turned into a Lua table constructor
//! here (YAML → JSON value → Lua source), so nothing but the interpreter is
//! needed.
//!
//! The interpreter is `lua5.4`, one of the harness's Debian packages
//! (`setup::packages`, installed on first use when the tests run as root);
//! when it cannot be had these tests fail rather than skip. Argo CD itself runs
//! gopher-lua, a Lua 5.1; the script keeps to what both accept.

use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use vmmigrate::api::{Phase, VirtualMachineMigration};

const LUA: &str = "lua5.4";
const CHECK_DIR: &str = "deploy/argocd/migration.platform.example/VirtualMachineMigration";
const CM_PATCH: &str = "deploy/argocd/argocd-cm-patch.yaml";
const CM_KEY: &str = "resource.customizations.health.migration.platform.example_VirtualMachineMigration";
const STATUSES: [&str; 5] = ["Healthy", "Progressing", "Degraded", "Suspended", "Missing"];

#[derive(Deserialize)]
struct HealthTests {
    tests: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Case {
    health_status: Health,
    input_path: String,
}

#[derive(Deserialize, Debug, PartialEq, Eq)]
struct Health {
    status: String,
    #[serde(default)]
    message: String,
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn load_yaml(path: &Path) -> Value {
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::to_value(yaml).unwrap_or_else(|e| panic!("{}: not JSON-shaped: {e}", path.display()))
}

fn cases() -> Vec<Case> {
    let path = repo(CHECK_DIR).join("health_test.yaml");
    let tests: HealthTests =
        serde_yaml::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!tests.tests.is_empty(), "{} has no tests", path.display());
    tests.tests
}

/// A Lua string literal holding exactly `s`'s bytes. Everything outside
/// printable ASCII becomes a three-digit decimal escape, which Lua 5.1 to 5.4
/// all read the same way (and which no following digit can extend).
fn lua_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for byte in s.bytes() {
        match byte {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(byte)),
            _ => {
                let _ = write!(out, "\\{byte:03}");
            }
        }
    }
    out.push('"');
    out
}

/// A Lua expression for a JSON value: objects and arrays become table
/// constructors (keys always bracketed, so any key works), `null` is `nil`,
/// integers stay integers.
fn lua_value(value: &Value) -> String {
    match value {
        Value::Null => "nil".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) => format!("{f:?}"),
            _ => panic!("unrepresentable number {n}"),
        },
        Value::String(s) => lua_string(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(lua_value).collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Object(fields) => {
            let fields: Vec<String> =
                fields.iter().map(|(k, v)| format!("[{}] = {}", lua_string(k), lua_value(v))).collect();
            format!("{{{}}}", fields.join(", "))
        }
    }
}

/// Runs health.lua with `obj` as the global Argo CD provides and returns what it reported.
fn assess(obj: &Value) -> Health {
    let script_path = repo(CHECK_DIR).join("health.lua");
    let script_path = script_path.to_str().expect("UTF-8 path");
    let driver = format!(
        "obj = {}\nlocal check = assert(loadfile({}))\nlocal hs = check()\n\
         assert(type(hs) == \"table\", \"health.lua returned \" .. type(hs))\n\
         io.write(tostring(hs.status), \"\\n\", tostring(hs.message))\n",
        lua_value(obj),
        lua_string(script_path)
    );
    let dir = tempfile::tempdir().unwrap();
    let driver_path = dir.path().join("driver.lua");
    std::fs::write(&driver_path, driver).unwrap();
    crate::support::setup::packages().expect("the harness's Debian packages (lua5.4 among them)");
    let output = match Command::new(LUA).arg(&driver_path).output() {
        Ok(output) => output,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "the Lua interpreter `{LUA}` is not installed; these tests need it \
             (`apt-get install -y lua5.4`, as .ci/run does)"
        ),
        Err(e) => panic!("running {LUA}: {e}"),
    };
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    assert!(output.status.success(), "{LUA} failed: {}{stdout}", String::from_utf8_lossy(&output.stderr));
    let (status, message) = stdout.split_once('\n').expect("status and message lines");
    Health { status: status.to_owned(), message: message.to_owned() }
}

#[test]
fn health_check_passes_every_case_of_health_test_yaml() {
    let mut failures = Vec::new();
    for case in cases() {
        let obj = load_yaml(&repo(CHECK_DIR).join(&case.input_path));
        let got = assess(&obj);
        assert!(
            STATUSES.contains(&got.status.as_str()),
            "{}: not an Argo CD health: {got:?}",
            case.input_path
        );
        if got != case.health_status {
            failures.push(format!(
                "{}:\n  expected {:?}\n  got      {got:?}",
                case.input_path, case.health_status
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_testdata_file_has_a_case_and_every_case_a_file() {
    let listed: BTreeSet<String> = cases().into_iter().map(|c| c.input_path).collect();
    let present: BTreeSet<String> = std::fs::read_dir(repo(CHECK_DIR).join("testdata"))
        .unwrap()
        .map(|entry| format!("testdata/{}", entry.unwrap().file_name().to_string_lossy()))
        .collect();
    assert_eq!(listed, present);
}

#[test]
fn testdata_objects_are_what_the_controller_writes() {
    // Deserializing into the real type and back loses any field the API does
    // not have, so a misspelt or invented field in a testdata object fails here.
    for case in cases() {
        let original = load_yaml(&repo(CHECK_DIR).join(&case.input_path));
        let typed: VirtualMachineMigration = serde_json::from_value(original.clone())
            .unwrap_or_else(|e| panic!("{}: not a VirtualMachineMigration: {e}", case.input_path));
        let round_trip = serde_json::to_value(&typed).unwrap();
        if let Some(difference) = first_difference(&original, &round_trip, "") {
            panic!("{}: differs from what the API types write at {difference}", case.input_path);
        }
    }
}

/// The JSON path of the first place where `written` (the testdata) and
/// `typed` (after the round trip) differ, with both values.
fn first_difference(written: &Value, typed: &Value, path: &str) -> Option<String> {
    match (written, typed) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|k| {
                let path = format!("{path}.{k}");
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => first_difference(x, y, &path),
                    (x, y) => Some(format!("{path}: testdata {x:?}, API types {y:?}")),
                }
            })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| first_difference(x, y, &format!("{path}[{i}]"))),
        (a, b) => (a != b).then(|| format!("{path}: testdata {a}, API types {b}")),
    }
}

#[test]
fn argocd_cm_patch_embeds_health_lua_verbatim() {
    let script = read(&repo(CHECK_DIR).join("health.lua"));
    let patch = load_yaml(&repo(CM_PATCH));
    assert_eq!(patch["kind"], "ConfigMap");
    assert_eq!(patch["metadata"]["name"], "argocd-cm");
    let embedded =
        patch["data"][CM_KEY].as_str().unwrap_or_else(|| panic!("{CM_PATCH} has no data.{CM_KEY}"));
    assert!(
        embedded == script,
        "{CM_PATCH} and {CHECK_DIR}/health.lua differ; copy health.lua into the patch"
    );
}

/// An object whose status says only `phase`, built on the no-status case.
fn with_status(status: Value) -> Value {
    let mut obj = load_yaml(&repo(CHECK_DIR).join("testdata/no-status.yaml"));
    obj["status"] = status;
    obj
}

#[test]
fn only_completed_is_healthy_and_only_failed_or_waiting_for_a_human_is_degraded() {
    for phase in Phase::ALL {
        let expected = match phase {
            Phase::Completed => "Healthy",
            Phase::Failed | Phase::ManualInterventionRequired => "Degraded",
            _ => "Progressing",
        };
        let got = assess(&with_status(json!({ "phase": phase.as_str(), "timestamps": {} })));
        assert_eq!(got.status, expected, "{phase}: {got:?}");
        assert!(got.message.starts_with(phase.as_str()), "{phase}: {got:?}");
    }
    // A phase a newer controller might add is not mistaken for a verdict.
    assert_eq!(assess(&with_status(json!({ "phase": "Hibernating" }))).status, "Progressing");
}

#[test]
fn error_text_reaches_the_message_byte_for_byte() {
    let message = "quote \" backslash \\ ]] [[ newline\n tab\t nul\0 del\u{7f} umlaut ü emoji 🚚 %d %s \\065";
    let obj = with_status(json!({
        "phase": "Failed",
        "errors": [{
            "time": "2025-05-06T10:41:03Z",
            "phase": "Converting",
            "reason": "QemuImgFailed",
            "message": message,
            "retryable": false,
        }],
    }));
    let got = assess(&obj);
    assert_eq!(
        got,
        Health { status: "Degraded".to_owned(), message: format!("Failed: QemuImgFailed: {message}") }
    );
}

#[test]
fn degraded_without_errors_falls_back_to_the_stalled_condition() {
    let stalled = |status: &str| {
        json!({
            "type": "Stalled",
            "status": status,
            "reason": "HostKeyMismatch",
            "message": "waiting for a human: the host presented another key",
            "lastTransitionTime": "2025-05-06T10:00:00Z",
        })
    };
    let obj = with_status(json!({ "phase": "ManualInterventionRequired", "conditions": [stalled("True")] }));
    assert_eq!(
        assess(&obj).message,
        "ManualInterventionRequired: waiting for a human: the host presented another key"
    );
    // Errors of finishing work in a terminal phase are not the cause.
    let obj = with_status(json!({
        "phase": "Failed",
        "conditions": [stalled("True")],
        "errors": [{ "time": "2025-05-06T10:41:04Z", "phase": "Failed", "reason": "LocalDiskError",
                     "message": "removing staging: busy", "retryable": true }],
    }));
    assert_eq!(assess(&obj).message, "Failed: waiting for a human: the host presented another key");
    // Nothing to say but the phase.
    let obj = with_status(json!({ "phase": "Failed", "conditions": [stalled("False")] }));
    assert_eq!(assess(&obj), Health { status: "Degraded".to_owned(), message: "Failed".to_owned() });
}

#[test]
fn lua_literals_escape_what_lua_would_misread() {
    assert_eq!(lua_string("a\"b\\c"), r#""a\"b\\c""#);
    assert_eq!(lua_string("\n1"), r#""\0101""#);
    assert_eq!(lua_string("ü"), r#""\195\188""#);
    assert_eq!(
        lua_value(&json!({"a b": [1, -2, 2.5, null, true]})),
        r#"{["a b"] = {1, -2, 2.5, nil, true}}"#
    );
}
