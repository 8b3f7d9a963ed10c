//! Feeds arbitrary bytes (lossy UTF-8) to the `.vmx` parser and fact extraction.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmmigrate::fuzzing::esxi_vmx(&String::from_utf8_lossy(data));
});
