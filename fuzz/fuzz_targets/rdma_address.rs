//! libFuzzer's entry for the `rdma_address` target; the body (shared with the seed-corpus replay
//! that `cargo test` runs) is in `fuzz/bodies/rdma_address.rs`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/rdma_address.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
