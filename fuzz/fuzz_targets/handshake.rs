//! libFuzzer's entry for the `handshake` target; the body (shared with the seed-corpus replay
//! that `cargo test` runs) is in `fuzz/bodies/handshake.rs`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/handshake.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
