//! libFuzzer's entry for the `scenario_toml` target; the body (shared with the seed-corpus replay
//! that `cargo test` runs) is in `fuzz/bodies/scenario_toml.rs`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/scenario_toml.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
