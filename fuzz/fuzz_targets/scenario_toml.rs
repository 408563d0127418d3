//! Chaos scenario files: a checked scenario, or a typed error.
#![no_main]
use cohort_chaos::scenario::Scenario;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let _ = Scenario::parse("fuzz", text);
});
