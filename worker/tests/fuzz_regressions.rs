//! Replays every input in `fuzz/regressions/gguf/` (inputs the `gguf` fuzz target once
//! crashed on) through the target's own entry function, `baton_worker::fuzz::gguf`.

#[test]
fn past_gguf_fuzz_crashes_stay_fixed() {
    baton_common::fuzz::replay("gguf", baton_worker::fuzz::gguf);
}
