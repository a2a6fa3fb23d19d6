//! Replays every input in `fuzz/regressions/wire/` (inputs the `wire` fuzz target once
//! crashed on) through the target's own entry function, `baton_common::fuzz::wire`.

#[test]
fn past_wire_fuzz_crashes_stay_fixed() {
    baton_common::fuzz::replay("wire", baton_common::fuzz::wire);
}
