//! Feeds arbitrary bytes (lossy UTF-8) to the VMDK descriptor parser.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmmigrate::fuzzing::esxi_descriptor(&String::from_utf8_lossy(data));
});
