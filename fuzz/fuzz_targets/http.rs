//! Arbitrary bytes into `baton_coordinator::fuzz::http`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| baton_coordinator::fuzz::http(data));
