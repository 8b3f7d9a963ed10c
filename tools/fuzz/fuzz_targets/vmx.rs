//! Feeds arbitrary bytes (lossy UTF-8) to the `.vmx` parser and fact extraction.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmmigrate::source::esxi::parse;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let vmx = parse::parse_vmx(&text);
    let _ = vmx.get("displayName");
    let _ = vmx.get_bool("uefi.secureBoot.enabled");
    let _ = parse::vmx_facts(&vmx);
});
