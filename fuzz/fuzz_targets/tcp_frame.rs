//! libFuzzer's entry for the `tcp_frame` target; the body (shared with the seed-corpus replay
//! that `cargo test` runs) is in `fuzz/bodies/tcp_frame.rs`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/tcp_frame.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
