//! Arbitrary bytes into `baton_common::fuzz::wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| baton_common::fuzz::wire(data));
