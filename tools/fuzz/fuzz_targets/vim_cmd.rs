//! Feeds arbitrary bytes (lossy UTF-8) to every parser of `vim-cmd` output.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmmigrate::source::esxi::parse;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse::parse_getallvms(&text);
    let _ = parse::parse_power_state(&text);
    let _ = parse::parse_fault(&text);
    let _ = parse::parse_snapshots(&text);
    let _ = parse::parse_message(&text);
    let _ = parse::parse_vmodl(&text);
    let _ = parse::parse_guest_info(&text).map(|g| g.tools_running());
    let _ = parse::parse_summary(&text);
    let _ = parse::parse_version(&text);
});
