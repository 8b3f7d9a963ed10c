//! Feeds arbitrary bytes (lossy UTF-8) to every parser of `vim-cmd` output.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vmmigrate::fuzzing::esxi_vim_cmd(&String::from_utf8_lossy(data));
});
