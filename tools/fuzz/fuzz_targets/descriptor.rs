//! Feeds arbitrary bytes (lossy UTF-8) to the VMDK descriptor parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmmigrate::source::esxi::parse;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(descriptor) = parse::parse_descriptor(&text) {
        let _ = descriptor.capacity_bytes();
    }
});
