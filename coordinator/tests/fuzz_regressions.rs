//! Replays every input in `fuzz/regressions/http/` (inputs the `http` fuzz target once
//! crashed on) through the target's own entry function, `baton_coordinator::fuzz::http`.

#[test]
fn past_http_fuzz_crashes_stay_fixed() {
    baton_common::fuzz::replay("http", baton_coordinator::fuzz::http);
}
