//! Whether a stored object still says what we rendered, judged by meaning
//! and not by text. The API server and admission webhooks rewrite what they
//! store: KubeVirt's virt-api round-trips a VirtualMachine through its Go
//! types, so quantities come back canonical (`4096Mi` is stored as `4Gi`),
//! empty lists and nulls vanish (`omitempty`) and defaults appear (machine
//! type, architecture). None of that is a change anybody made.
//!
//! The rules, applied to the fields we render (fields only in the stored
//! object are defaults and never count):
//! - objects: every key we render must be there and agree; a key we render
//!   as `null` or an empty list may be missing;
//! - lists: the same length, element by element;
//! - strings that are both Kubernetes quantities: equal values;
//! - numbers: equal values (`1` and `1.0`);
//! - anything else: equal.

use serde_json::Value;

/// Where `live` disagrees with `wanted`, as `path: wanted X, found Y`, in
/// key order. Empty when they agree.
pub(crate) fn differences(live: &Value, wanted: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(live, wanted, &mut String::new(), &mut out);
    out
}

/// Whether `live` says everything `wanted` says.
pub(crate) fn agrees(live: &Value, wanted: &Value) -> bool {
    differences(live, wanted).is_empty()
}

fn walk(live: &Value, wanted: &Value, path: &mut String, out: &mut Vec<String>) {
    match (live, wanted) {
        (Value::Object(l), Value::Object(w)) => {
            for (key, want) in w {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
                match l.get(key) {
                    Some(found) => walk(found, want, path, out),
                    None if omittable(want) => {}
                    None => out.push(format!("{path}: wanted {}, found nothing", short(want))),
                }
                path.truncate(len);
            }
        }
        (Value::Array(l), Value::Array(w)) => {
            if l.len() != w.len() {
                out.push(format!("{path}: wanted {} entries, found {}", w.len(), l.len()));
                return;
            }
            for (i, (found, want)) in l.iter().zip(w).enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                walk(found, want, path, out);
                path.truncate(len);
            }
        }
        (Value::String(l), Value::String(w)) if l == w => {}
        (Value::String(l), Value::String(w)) => match (quantity_millis(l), quantity_millis(w)) {
            (Some(a), Some(b)) if a == b => {}
            _ => out.push(format!("{path}: wanted {}, found {}", short(wanted), short(live))),
        },
        (Value::Number(l), Value::Number(w)) if l.as_f64() == w.as_f64() => {}
        (l, w) if l == w => {}
        (l, w) if omittable(w) && omittable(l) => {}
        (l, w) => out.push(format!("{path}: wanted {}, found {}", short(w), short(l))),
    }
}

/// What a Go type with `omitempty` drops when it stores the object.
fn omittable(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn short(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() <= 80 {
        text
    } else {
        format!("{}…", text.chars().take(79).collect::<String>())
    }
}

/// The value of a Kubernetes quantity (`resource.Quantity`) in thousandths,
/// exactly, when it is one and fits: `4Gi`, `4096Mi`, `500m`, `1.5G`, `2e3`.
pub(crate) fn quantity_millis(s: &str) -> Option<i128> {
    let s = s.trim();
    let (sign, body) = match s.as_bytes().first()? {
        b'-' => (-1, &s[1..]),
        b'+' => (1, &s[1..]),
        _ => (1, s),
    };
    let number_end = body.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(body.len());
    let (number, suffix) = body.split_at(number_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return None;
    }
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.len() + fraction.len() > 30 {
        return None;
    }
    let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
    // value = digits / 10^fraction × multiplier; thousandths → × 1000.
    let (numerator, denominator): (i128, i128) = match suffix {
        "" => (1000, 1),
        "m" => (1, 1),
        "k" => (1000 * 1000, 1),
        "M" => (1000 * 10i128.pow(6), 1),
        "G" => (1000 * 10i128.pow(9), 1),
        "T" => (1000 * 10i128.pow(12), 1),
        "P" => (1000 * 10i128.pow(15), 1),
        "E" => (1000 * 10i128.pow(18), 1),
        "Ki" => (1000 << 10, 1),
        "Mi" => (1000 << 20, 1),
        "Gi" => (1000 << 30, 1),
        "Ti" => (1000 << 40, 1),
        "Pi" => (1000 << 50, 1),
        "Ei" => (1000 << 60, 1),
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().ok()?;
            if exp.unsigned_abs() > 18 {
                return None;
            }
            if exp >= 0 { (1000 * 10i128.pow(exp as u32), 1) } else { (1000, 10i128.pow(exp.unsigned_abs())) }
        }
        _ => return None,
    };
    let scaled = digits.checked_mul(numerator)?;
    let divisor = 10i128.checked_pow(fraction.len() as u32)?.checked_mul(denominator)?;
    (scaled % divisor == 0).then(|| sign * (scaled / divisor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quantities_are_compared_by_value() {
        assert_eq!(quantity_millis("4Gi"), quantity_millis("4096Mi"));
        assert_eq!(quantity_millis("1"), quantity_millis("1000m"));
        assert_eq!(quantity_millis("1.5G"), quantity_millis("1500M"));
        assert_eq!(quantity_millis("2e3"), quantity_millis("2k"));
        assert_eq!(quantity_millis("0.5Gi"), quantity_millis("512Mi"));
        assert_ne!(quantity_millis("4Gi"), quantity_millis("4G"));
        for not_a_quantity in ["virtio", "disk-0", "52:54:00:12:34:56", "", ".", "1.2.3", "4Gib"] {
            assert_eq!(quantity_millis(not_a_quantity), None, "{not_a_quantity}");
        }
    }

    #[test]
    fn what_virt_api_rewrites_is_not_a_difference() {
        let wanted = json!({
            "domain": {
                "memory": { "guest": "4096Mi" },
                "resources": { "requests": { "memory": "4096Mi" } },
                "cpu": { "cores": 2 },
                "devices": { "disks": [{ "name": "disk-0" }], "interfaces": [] },
                "features": {},
            },
            "networks": [],
        });
        // As stored: canonical quantities, empty lists dropped, defaults added.
        let stored = json!({
            "architecture": "amd64",
            "domain": {
                "machine": { "type": "q35" },
                "memory": { "guest": "4Gi" },
                "resources": { "requests": { "memory": "4Gi" } },
                "cpu": { "cores": 2.0 },
                "devices": { "disks": [{ "name": "disk-0", "disk": { "bus": "virtio" } }] },
                "features": { "acpi": {} },
            },
        });
        assert_eq!(differences(&stored, &wanted), Vec::<String>::new());
    }

    #[test]
    fn a_change_a_person_made_is_named_by_its_path() {
        let wanted = json!({ "domain": { "memory": { "guest": "4Gi" }, "devices": { "disks": [{ "name": "a" }] },
                             "features": {} } });
        let changed = json!({ "domain": { "memory": { "guest": "8Gi" },
                                          "devices": { "disks": [{ "name": "a" }, { "name": "b" }] } } });
        assert_eq!(
            differences(&changed, &wanted),
            vec![
                "domain.devices.disks: wanted 1 entries, found 2",
                "domain.features: wanted {}, found nothing",
                "domain.memory.guest: wanted \"4Gi\", found \"8Gi\"",
            ]
        );
        assert!(!agrees(&json!({ "x": [1] }), &json!({ "x": [] })));
        assert!(agrees(&json!({}), &json!({ "x": null, "y": [] })));
    }
}
