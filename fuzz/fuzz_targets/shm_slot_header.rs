//! libFuzzer's entry for the `shm_slot_header` target; the body (shared with the seed-corpus replay
//! that `cargo test` runs) is in `fuzz/bodies/shm_slot_header.rs`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/shm_slot_header.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
