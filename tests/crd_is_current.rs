//! The committed CRD must be exactly what the code in src/api generates.

#[test]
fn committed_crd_matches_the_types_in_src_api() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(vmmigrate::api::CRD_PATH);
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = vmmigrate::api::crd_yaml().expect("generate CRD");
    if committed != generated {
        let diff = similar::TextDiff::from_lines(&committed, &generated)
            .unified_diff()
            .header("committed", "generated")
            .to_string();
        panic!(
            "{} is stale; regenerate it with `cargo run -- crd -o {}`:\n{diff}",
            path.display(),
            vmmigrate::api::CRD_PATH
        );
    }
}
