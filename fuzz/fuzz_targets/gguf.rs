//! Arbitrary bytes into `baton_worker::fuzz::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| baton_worker::fuzz::gguf(data));
