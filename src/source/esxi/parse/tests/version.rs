use super::*;

// ----- version -----

#[test]
fn version_from_vmware_v() {
    assert_eq!(
        parse_version("VMware ESXi 8.0.2 build-22380479\n").as_deref(),
        Some("VMware ESXi 8.0.2 build-22380479")
    );
}

#[test]
fn version_from_esxcli_system_version_get() {
    assert_eq!(parse_version(ESXCLI_VERSION).as_deref(), Some("VMware ESXi 8.0.2 build-22380479"));
}

#[test]
fn version_is_none_for_other_output() {
    assert_eq!(parse_version("-sh: vmware: not found\n"), None);
    assert_eq!(parse_version(""), None);
}
