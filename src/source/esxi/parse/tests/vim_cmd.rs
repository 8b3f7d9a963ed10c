use super::*;
use crate::api::SourcePowerState;

fn entry(vmid: &str, name: &str, ds: &str, path: &str, guest: &str, version: &str) -> VmListEntry {
    VmListEntry {
        vmid: vmid.into(),
        name: name.into(),
        datastore: ds.into(),
        vmx_path: path.into(),
        guest_id: guest.into(),
        version: version.into(),
        annotation: String::new(),
    }
}

// ----- getallvms -----

#[test]
fn getallvms_parses_sample_despite_header_width_mismatch() {
    assert_eq!(
        parse_getallvms(GETALLVMS),
        vec![
            entry(
                "1",
                "ubuntu-desktop",
                "HDD",
                "ubuntu-desktop/ubuntu-desktop.vmx",
                "ubuntu64Guest",
                "vmx-13"
            ),
            entry("3", "windows-7", "HDD", "windows-7/windows-7.vmx", "windows7_64Guest", "vmx-13"),
        ]
    );
}

#[test]
fn getallvms_keeps_names_with_spaces_and_quotes() {
    let text = "\
Vmid                 Name                                          File                                        Guest OS          Version      Annotation
2      VMware vCenter Server 8   [datastore 1] VMware vCenter Server 8/VMware vCenter Server 8.vmx   vmwarePhoton64Guest   vmx-10   VMware vCenter Server Appliance
7      x'; rm -rf /; '           [datastore 1] x'; rm -rf |2f; '/x'; rm -rf |2f; '.vmx               otherLinux64Guest     vmx-19   
8      say \"hi\" `id`             [ssd] say \"hi\" `id`/say \"hi\" `id`.vmx                           windows2019srv_64Guest   vmx-19   a \"quoted\" note
";
    let vms = parse_getallvms(text);
    assert_eq!(vms.len(), 3, "{vms:#?}");
    let v0 = vms.first().expect("row");
    assert_eq!(v0.name, "VMware vCenter Server 8");
    assert_eq!(v0.datastore, "datastore 1");
    assert_eq!(v0.vmx_path, "VMware vCenter Server 8/VMware vCenter Server 8.vmx");
    assert_eq!(v0.guest_id, "vmwarePhoton64Guest");
    assert_eq!(v0.version, "vmx-10");
    assert_eq!(v0.annotation, "VMware vCenter Server Appliance");
    let v1 = vms.get(1).expect("row");
    assert_eq!(v1.vmid, "7");
    assert_eq!(v1.name, "x'; rm -rf /; '");
    assert_eq!(v1.vmx_path, "x'; rm -rf |2f; '/x'; rm -rf |2f; '.vmx");
    assert_eq!(v1.annotation, "");
    let v2 = vms.get(2).expect("row");
    assert_eq!(v2.name, "say \"hi\" `id`");
    assert_eq!(v2.datastore, "ssd");
    assert_eq!(v2.guest_id, "windows2019srv_64Guest");
    assert_eq!(v2.annotation, "a \"quoted\" note");
}

#[test]
fn getallvms_accepts_empty_datastore_of_system_vms() {
    let text = "Vmid   Name   File   Guest OS   Version   Annotation\n\
                    9      vCLS-0f1e2d3c   [] /var/run/crx/infra/vCLS-…/vCLS-….vmx   otherLinux64Guest   vmx-11   vSphere Cluster Service VM\n";
    let vms = parse_getallvms(text);
    assert_eq!(vms.len(), 1);
    let v = vms.first().expect("row");
    assert_eq!(v.datastore, "");
    assert_eq!(v.vmx_path, "/var/run/crx/infra/vCLS-…/vCLS-….vmx");
    assert_eq!(v.annotation, "vSphere Cluster Service VM");
}

#[test]
fn getallvms_ignores_skipping_invalid_vm_lines() {
    let text = format!("Skipping invalid VM '6'\nSkipping invalid VM '11'\n{GETALLVMS}");
    let vms = parse_getallvms(&text);
    assert_eq!(vms.iter().map(|v| v.vmid.as_str()).collect::<Vec<_>>(), ["1", "3"]);
    assert!(vms.iter().all(|v| v.annotation.is_empty()));
}

#[test]
fn getallvms_empty_annotation_with_trailing_blanks_is_empty() {
    let text = "1      web   [ds1] web/web.vmx   centos64Guest   vmx-14      \n\n   \n";
    let vms = parse_getallvms(text);
    assert_eq!(vms, vec![entry("1", "web", "ds1", "web/web.vmx", "centos64Guest", "vmx-14")]);
}

#[test]
fn getallvms_joins_multi_line_annotations() {
    let text = "\
Vmid   Name   File   Guest OS   Version   Annotation
4      db     [ds1] db/db.vmx   debian10_64Guest   vmx-15   Primary database
owner: data team

2 disks, see   wiki
5      app    [ds1] app/app.vmx   debian10_64Guest   vmx-15   
  
";
    let vms = parse_getallvms(text);
    assert_eq!(vms.len(), 2, "{vms:#?}");
    assert_eq!(
        vms.first().expect("db").annotation,
        "Primary database\nowner: data team\n\n2 disks, see   wiki"
    );
    assert_eq!(vms.get(1).expect("app").annotation, "");
}

#[test]
fn getallvms_annotation_keeps_inner_wide_spacing_and_missing_guest() {
    let text = "12   tmpl   [ds] tmpl/tmpl.vmx   vmx-08   notes   with   gaps\n";
    let vms = parse_getallvms(text);
    let v = vms.first().expect("row");
    assert_eq!(v.guest_id, "");
    assert_eq!(v.version, "vmx-08");
    assert_eq!(v.annotation, "notes   with   gaps");
}

#[test]
fn getallvms_of_nothing_or_a_fault_is_empty() {
    assert!(parse_getallvms("").is_empty());
    assert!(parse_getallvms(NOT_FOUND).is_empty());
    assert!(parse_getallvms("Vmid   Name   File   Guest OS   Version   Annotation\n").is_empty());
}

// ----- power state -----

#[test]
fn power_state_reads_sample() {
    assert_eq!(parse_power_state(POWER_ON), Some(SourcePowerState::PoweredOn));
    assert_eq!(
        parse_power_state("  Retrieved runtime info\n  Powered on\n"),
        Some(SourcePowerState::PoweredOn)
    );
}

#[test]
fn power_state_reads_off_and_suspended() {
    assert_eq!(
        parse_power_state("Retrieved runtime info\nPowered off\n"),
        Some(SourcePowerState::PoweredOff)
    );
    assert_eq!(
        parse_power_state("Retrieved runtime info\r\nSuspended\r\n"),
        Some(SourcePowerState::Suspended)
    );
}

#[test]
fn power_state_is_none_when_unrecognised() {
    assert_eq!(parse_power_state("Powering on VM:\n"), None);
    assert_eq!(parse_power_state("Powering off VM:\n"), None);
    assert_eq!(parse_power_state(NOT_FOUND), None);
    assert_eq!(parse_power_state(""), None);
}

// ----- faults -----

#[test]
fn fault_not_found_keeps_unescaped_inner_quotes() {
    assert_eq!(
        parse_fault(NOT_FOUND),
        Some(Fault {
            kind: "vim.fault.NotFound".into(),
            msg: "Unable to find a VM corresponding to \"2\"".into()
        })
    );
}

#[test]
fn fault_is_found_after_reset_failed_prefix() {
    let expected = Some(Fault {
        kind: "vim.fault.InvalidPowerState".into(),
        msg: "The attempted operation cannot be performed in the current state (Powered off).".into(),
    });
    assert_eq!(parse_fault(RESET_FAULT), expected);
    assert_eq!(parse_fault(RESET_FAULT_INDENTED), expected);
}

#[test]
fn fault_of_older_hosts_with_dynamic_type_and_commas() {
    let text = "(vmodl.fault.ManagedObjectNotFound) {\n   dynamicType = <unset>,\n   faultCause = (vmodl.MethodFault) null,\n   obj = 'vim.VirtualMachine:42',\n   msg = \"The object has already been deleted or has not been completely created\",\n}\n";
    let f = parse_fault(text).expect("fault");
    assert_eq!(f.kind, "vmodl.fault.ManagedObjectNotFound");
    assert_eq!(f.msg, "The object has already been deleted or has not been completely created");
}

#[test]
fn fault_prefers_its_own_msg_over_a_nested_cause() {
    let text = "(vim.fault.TaskInProgress) {\n   faultCause = (vmodl.MethodFault) {\n      msg = \"inner\"\n   },\n   msg = \"outer\"\n}\n";
    assert_eq!(parse_fault(text).expect("fault").msg, "outer");
    let only_nested = "(vim.fault.TaskInProgress) {\n   faultCause = (vmodl.MethodFault) {\n      msg = \"inner\"\n   }\n}\n";
    assert_eq!(parse_fault(only_nested).expect("fault").msg, "inner");
}

#[test]
fn fault_recognises_tools_not_running_sentence() {
    let text = "Cannot complete operation because VMware Tools is not running in this virtual machine.\n";
    assert_eq!(
        parse_fault(text),
        Some(Fault {
            kind: "vim.fault.ToolsUnavailable".into(),
            msg: "Cannot complete operation because VMware Tools is not running in this virtual machine."
                .into(),
        })
    );
    let block = "(vim.fault.ToolsUnavailable) {\n   faultCause = (vmodl.MethodFault) null, \n   faultMessage = <unset>, \n   msg = \"Cannot complete operation because VMware Tools is not running in this virtual machine.\"\n}\n";
    assert_eq!(parse_fault(block), parse_fault(text));
}

#[test]
fn fault_is_none_for_normal_outputs() {
    for text in [POWER_ON, GETALLVMS, GUEST, SUMMARY, SNAPSHOTS, MESSAGE, "", "Powering on VM:\n"] {
        assert_eq!(parse_fault(text), None, "{text}");
    }
}

#[test]
fn fault_block_without_msg_has_empty_msg() {
    let f = parse_fault("(vim.fault.InvalidState) {\n   faultMessage = <unset>\n}").expect("fault");
    assert_eq!(f, Fault { kind: "vim.fault.InvalidState".into(), msg: String::new() });
}

// ----- snapshots -----

#[test]
fn snapshots_none_when_only_header() {
    assert!(parse_snapshots("Get Snapshot:").is_empty());
    assert!(parse_snapshots("Get Snapshot:\n").is_empty());
}

#[test]
fn snapshots_sample_nesting_misspelling_and_wrapped_description() {
    assert_eq!(
        parse_snapshots(SNAPSHOTS),
        vec![
            Snapshot {
                name: "snap0".into(),
                id: "5".into(),
                depth: 0,
                description: "clush configured\ntmp and all traces of mapr removed".into(),
                created: "11/29/2017 23:59:6".into(),
                state: "powered on".into(),
            },
            Snapshot {
                name: "finish_naigos_install".into(),
                id: "6".into(),
                depth: 1,
                ..Snapshot::default()
            },
        ]
    );
}

#[test]
fn snapshots_three_levels_and_siblings() {
    let text = "\
Get Snapshot:
|-ROOT
--Snapshot Name        : a
--Snapshot Id        : 1
--Snapshot Desciption  : 
--Snapshot Created On  : 1/2/2024 3:4:5
--Snapshot State       : powered off
--|-CHILD
----Snapshot Name        : b
----Snapshot Id        : 2
----Snapshot Desciption  : - dashed line follows
- not a label: really
----Snapshot State       : powered off
----|-CHILD
------Snapshot Name        : c
------Snapshot Id        : 3
--|-CHILD
----Snapshot Name        : d
----Snapshot Id        : 4
";
    let snaps = parse_snapshots(text);
    let summary: Vec<(&str, &str, usize)> =
        snaps.iter().map(|s| (s.name.as_str(), s.id.as_str(), s.depth)).collect();
    assert_eq!(summary, [("a", "1", 0), ("b", "2", 1), ("c", "3", 2), ("d", "4", 1)]);
    assert_eq!(snaps.get(1).expect("b").description, "- dashed line follows\n- not a label: really");
    assert_eq!(snaps.first().expect("a").description, "");
}

// ----- message -----

#[test]
fn message_none_when_no_message() {
    assert_eq!(parse_message("No message.\n"), None);
    assert_eq!(parse_message(""), None);
    assert_eq!(parse_message(NOT_FOUND), None);
}

#[test]
fn message_returns_question_text_of_sample() {
    assert_eq!(
        parse_message(MESSAGE).as_deref(),
        Some("msg.uuid.altered:This virtual machine may have been moved or copied.")
    );
}

#[test]
fn message_text_may_follow_on_the_next_line() {
    let text = "Virtual machine message _vmx1:\nmsg.hbacommon.outofspace:There is no more space for virtual disk web.vmdk.\n0. Retry (Retry) 1. Cancel (Cancel)\n";
    assert_eq!(
        parse_message(text).as_deref(),
        Some("msg.hbacommon.outofspace:There is no more space for virtual disk web.vmdk.")
    );
}

// ----- get.guest / get.summary -----

#[test]
fn guest_info_reads_sample() {
    let g = parse_guest_info(GUEST).expect("guest");
    assert_eq!(
        g,
        GuestInfo {
            tools_status: "toolsOk".into(),
            tools_running_status: "guestToolsRunning".into(),
            guest_id: "debian10_64Guest".into(),
            ip_address: Some("192.168.200.9".into()),
            nics: vec![GuestNic {
                network: "Kubernetes Network".into(),
                mac_address: "00:0c:29:62:e8:6d".into(),
                ip_addresses: vec!["192.168.200.9".into(), "fe80::20c:29ff:fe62:e86d".into()],
            }],
            guest_state: "running".into(),
        }
    );
    assert!(g.tools_running());
}

#[test]
fn guest_info_without_tools_has_no_ip_and_tools_not_running() {
    let g = parse_guest_info(GUEST_NO_TOOLS).expect("guest");
    assert_eq!(g.tools_status, "toolsNotInstalled");
    assert_eq!(g.ip_address, None);
    assert_eq!(g.guest_id, "");
    assert!(g.nics.is_empty());
    assert_eq!(g.guest_state, "notRunning");
    assert!(!g.tools_running());
}

#[test]
fn guest_info_and_summary_are_none_for_faults_and_empty_output() {
    assert_eq!(parse_guest_info(NOT_FOUND), None);
    assert_eq!(parse_guest_info("Guest information:\n"), None);
    assert_eq!(parse_summary(NOT_FOUND), None);
    assert_eq!(parse_summary(""), None);
}

#[test]
fn summary_reads_nested_runtime_and_config_fields() {
    assert_eq!(
        parse_summary(SUMMARY),
        Some(Summary {
            power_state: "poweredOn".into(),
            name: "web 01".into(),
            vmx_path: "[datastore1] web 01/web 01.vmx".into(),
            memory_mb: 4096,
            num_cpu: 2,
            uuid: "564d8a6e-2c3b-1f5e-8f0a-9a3c2b1d0e4f".into(),
            annotation: "Owner: web team\nsays \"hi\", with a comma".into(),
        })
    );
    let vmx_path = parse_summary(SUMMARY).map(|s| s.vmx_path).unwrap_or_default();
    assert_eq!(split_datastore_path(&vmx_path), ("datastore1", "web 01/web 01.vmx"));
}
