use super::*;

// ----- VMDK descriptors -----

#[test]
fn descriptor_sample_is_thin_vmfs_with_one_flat_extent() {
    let d = parse_descriptor(DESCRIPTOR).expect("descriptor");
    assert_eq!(
        d,
        Descriptor {
            create_type: "vmfs".into(),
            extents: vec![Extent {
                access: "RW".into(),
                sectors: 4_194_304,
                kind: "VMFS".into(),
                file: "vm-flat.vmdk".into(),
                offset: 0,
            }],
            thin: true,
            adapter_type: "lsilogic".into(),
            parent_file_name_hint: None,
        }
    );
    assert_eq!(d.capacity_bytes(), 2 * 1024 * 1024 * 1024);
}

#[test]
fn descriptor_flat_thick_disk_is_not_thin() {
    let text = "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\ncreateType=\"vmfs\"\n\n\
                    RW 20971520 VMFS \"web 01-flat.vmdk\"\n\nddb.adapterType = \"pvscsi\"\nddb.virtualHWVersion = \"19\"\n";
    let d = parse_descriptor(text).expect("descriptor");
    assert!(!d.thin);
    assert_eq!(d.adapter_type, "pvscsi");
    assert_eq!(d.extents.first().map(|e| e.file.as_str()), Some("web 01-flat.vmdk"));
    assert_eq!(d.capacity_bytes(), 10 * 1024 * 1024 * 1024);
}

#[test]
fn descriptor_flat_extent_with_offset_and_multiple_extents() {
    let text = "createType=\"monolithicFlat\"\nRW 100 FLAT \"a-f001.vmdk\" 0\nRDONLY 50 FLAT \"a-f002.vmdk\" 2048\nRW 10 ZERO\n";
    let d = parse_descriptor(text).expect("descriptor");
    assert_eq!(d.extents.len(), 3);
    assert_eq!(d.extents.get(1).map(|e| (e.access.as_str(), e.offset)), Some(("RDONLY", 2048)));
    assert_eq!(d.extents.get(2).map(|e| (e.kind.as_str(), e.file.as_str())), Some(("ZERO", "")));
    assert_eq!(d.capacity_bytes(), 160 * 512);
}

#[test]
fn descriptor_vmfs_sparse_delta_has_parent_hint() {
    let text = "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=a1b2c3d4\nparentCID=fffffffe\n\
                    createType=\"vmfsSparse\"\nparentFileNameHint=\"web 01.vmdk\"\n# Extent description\n\
                    RW 4194304 VMFSSPARSE \"web 01-000001-delta.vmdk\"\n\n# The Disk Data Base\n#DDB\n\n\
                    ddb.longContentID = \"0123456789abcdef\"\n";
    let d = parse_descriptor(text).expect("descriptor");
    assert_eq!(d.create_type, "vmfsSparse");
    assert_eq!(d.parent_file_name_hint.as_deref(), Some("web 01.vmdk"));
    assert_eq!(d.extents.first().map(|e| e.kind.as_str()), Some("VMFSSPARSE"));
    let se = "createType=\"seSparse\"\nparentFileNameHint=\"/vmfs/volumes/ds/vm/vm.vmdk\"\nRW 8388608 SESPARSE \"vm-000002-sesparse.vmdk\"\n";
    let d = parse_descriptor(se).expect("descriptor");
    assert_eq!(d.parent_file_name_hint.as_deref(), Some("/vmfs/volumes/ds/vm/vm.vmdk"));
    assert_eq!(d.extents.first().map(|e| e.kind.as_str()), Some("SESPARSE"));
}

#[test]
fn descriptor_rdm_mapping_file() {
    let text = "# Disk DescriptorFile\nversion=1\nencoding=\"UTF-8\"\nCID=fffffffe\nparentCID=ffffffff\n\
                    createType=\"vmfsRawDeviceMap\"\n\n# Extent description\nRW 209715200 VMFSRDM \"db-rdm.vmdk\"\n\n\
                    # The Disk Data Base\n#DDB\n\nddb.adapterType = \"lsilogic\"\n";
    let d = parse_descriptor(text).expect("descriptor");
    assert_eq!(d.create_type, "vmfsRawDeviceMap");
    assert_eq!(
        d.extents.first().map(|e| (e.kind.as_str(), e.file.as_str())),
        Some(("VMFSRDM", "db-rdm.vmdk"))
    );
    assert_eq!(d.capacity_bytes(), 100 * 1024 * 1024 * 1024);
}

#[test]
fn descriptor_is_none_for_binary_or_unrelated_text() {
    let binary =
        String::from_utf8_lossy(&[0x4b, 0x44, 0x4d, 0x56, 0, 0, 0xff, 0xfe, 0x0a, 0x01, 0x02]).into_owned();
    assert_eq!(parse_descriptor(&binary), None);
    assert_eq!(parse_descriptor(""), None);
    assert_eq!(parse_descriptor(VMX), None);
}

#[test]
fn descriptor_capacity_saturates() {
    let text = format!("RW {} VMFS \"a\"\nRW {} VMFS \"b\"\n", u64::MAX, u64::MAX / 2);
    assert_eq!(parse_descriptor(&text).map(|d| d.capacity_bytes()), Some(u64::MAX));
}
