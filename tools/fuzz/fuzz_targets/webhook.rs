//! The webhook receiver's judgement of a delivery (signature or token from
//! the head, the HMAC over the body, then the JSON payload) on arbitrary
//! input. It must never panic, and without the secret nothing is accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&forge, rest)) = data.split_first() else { return };
    let split = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    let headers = String::from_utf8_lossy(&rest[..split]);
    let body = rest.get(split + 1..).unwrap_or_default();
    let accepted = vmmigrate::fuzzing::webhook_delivery(forge, &headers, body);
    // The fuzzer cannot forge an HMAC: only GitLab's plain token can match.
    if accepted && forge % 3 != 2 {
        panic!("a delivery was accepted without the secret's HMAC: {headers:?}");
    }
});
