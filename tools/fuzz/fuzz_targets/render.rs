//! The manifest renderer on arbitrary repository content: a provider and a
//! manifest (split at the first 0xFF byte), read through the same reader
//! rules and limits as a Git tree. It must never panic, and every error must
//! name a file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmmigrate::gitops::Provenance;
use vmmigrate::gitops::render::{RenderOptions, RepoTree, TreeLimits, render_tree};

fuzz_target!(|data: &[u8]| {
    let (provider, manifest) = match data.iter().position(|b| *b == 0xff) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (&[][..], data),
    };
    let limits = TreeLimits::default();
    let mut tree = RepoTree::default();
    for (path, bytes) in [("providers/esxi01.yaml", provider), ("migrations/apps/fuzz.yaml", manifest)] {
        let _ = tree.offer(Some(path), path, bytes.len() as u64, &limits, || Ok(bytes.to_vec()));
    }
    let provenance = Provenance { repo_url: "https://git.example/m.git".into(), commit: "0".repeat(40) };
    let rules = vmmigrate::machine::tenancy::DestinationRules::default();
    let opts = RenderOptions::new("apps", &rules);
    if let Err(errors) = render_tree(&tree, &provenance, &opts) {
        for error in errors {
            assert!(!error.path.is_empty(), "an error without a file: {error}");
        }
    }
});
