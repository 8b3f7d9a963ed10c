use super::*;

// ----- VMODL -----

#[test]
fn vmodl_parses_guest_sample_structure() {
    let v = parse_vmodl(GUEST).expect("object");
    assert_eq!(v.type_name(), Some("vim.vm.GuestInfo"));
    assert_eq!(v.field("toolsStatus"), Some(&Vmodl::Str("toolsOk".into())));
    let net = v.field("net").expect("net");
    assert_eq!(net.type_name(), Some("vim.vm.GuestInfo.NicInfo"));
    let nic = net.items().first().expect("nic");
    assert_eq!(
        nic.field("ipAddress"),
        Some(&Vmodl::Array {
            type_name: "string".into(),
            items: vec![Vmodl::Str("192.168.200.9".into()), Vmodl::Str("fe80::20c:29ff:fe62:e86d".into())],
        })
    );
    assert_eq!(v.field("guestState").and_then(Vmodl::as_str), Some("running"));
}

#[test]
fn vmodl_reads_refs_unset_typed_nulls_scalars_and_empty_arrays() {
    let v = parse_vmodl(SUMMARY).expect("object");
    assert_eq!(v.field("vm"), Some(&Vmodl::Ref("vim.VirtualMachine:4".into())));
    assert_eq!(v.path(&["runtime", "question"]), Some(&Vmodl::Null));
    assert_eq!(v.path(&["runtime", "maxMemoryUsage"]), Some(&Vmodl::Scalar("2048".into())));
    assert_eq!(v.path(&["runtime", "consolidationNeeded"]), Some(&Vmodl::Scalar("false".into())));
    assert_eq!(
        v.path(&["runtime", "featureMask"]),
        Some(&Vmodl::Array { type_name: "vim.host.FeatureMask".into(), items: vec![] })
    );
    assert_eq!(
        v.path(&["runtime", "device"]).map(|d| d.items().len()),
        Some(1),
        "trailing comma before the closing brace"
    );
    assert_eq!(v.path(&["storage", "uncommitted"]).and_then(Vmodl::as_str), Some("17179869184"));
    assert_eq!(v.field("overallStatus").and_then(Vmodl::as_str), Some("green"));
    let fault = parse_vmodl(NOT_FOUND).expect("fault object");
    assert_eq!(fault.field("faultMessage"), Some(&Vmodl::Unset));
    assert_eq!(fault.field("faultCause"), Some(&Vmodl::Null));
}

#[test]
fn vmodl_finds_first_object_after_prefix_text() {
    let v = parse_vmodl(RESET_FAULT).expect("object");
    assert_eq!(v.type_name(), Some("vim.fault.InvalidPowerState"));
    assert_eq!(v.field("existingState").and_then(Vmodl::as_str), Some("poweredOff"));
    assert_eq!(
        v.field("msg").and_then(Vmodl::as_str),
        Some("The attempted operation cannot be performed in the current state (Powered off).")
    );
}

#[test]
fn vmodl_is_none_without_an_object() {
    assert_eq!(parse_vmodl(""), None);
    assert_eq!(parse_vmodl("Guest information:\n"), None);
    assert_eq!(parse_vmodl("(vim.vm.QuestionInfo) null"), None);
}

#[test]
fn vmodl_returns_what_it_read_when_truncated() {
    let cut = GUEST.get(..GUEST.find("net =").expect("net")).expect("prefix");
    let v = parse_vmodl(cut).expect("partial");
    assert_eq!(v.field("ipAddress").and_then(Vmodl::as_str), Some("192.168.200.9"));
    assert_eq!(v.field("net"), None);
}

#[test]
fn vmodl_deep_nesting_is_bounded() {
    let deep = "(t) {\n a = (t) {\n".repeat(50_000);
    assert_eq!(parse_vmodl(&deep), None);
    let arrays = format!("(t) {{ a = {}", "(t) [".repeat(100_000));
    assert_eq!(parse_vmodl(&arrays), None);
    let ok = format!("(t) {{\n{}{}}}", "a = (t) {\n".repeat(30), "}\n".repeat(30));
    assert!(parse_vmodl(&ok).is_some());
}
