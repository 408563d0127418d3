//! The committed seed corpus of every coverage-guided fuzz target over this crate's parsers
//! (`fuzz/seeds/TARGET/`), replayed through the targets' own bodies (`fuzz/bodies/`): what
//! `cargo fuzz` runs, without nightly or libFuzzer. A crash the fuzzer finds is fixed and its
//! input added to the seeds, so it stays replayed here.

#[path = "../../fuzz/bodies/replay.rs"]
mod replay;

#[path = "../../fuzz/bodies/tcp_frame.rs"]
mod tcp_frame;

#[path = "../../fuzz/bodies/handshake.rs"]
mod handshake;

#[path = "../../fuzz/bodies/shm_slot_header.rs"]
mod shm_slot_header;

#[path = "../../fuzz/bodies/shm_descriptor.rs"]
mod shm_descriptor;

#[cfg(feature = "rdma")]
#[path = "../../fuzz/bodies/rdma_address.rs"]
mod rdma_address;

#[test]
fn tcp_frame_seeds() {
    replay::replay("tcp_frame", tcp_frame::run);
}

#[test]
fn handshake_seeds() {
    replay::replay("handshake", handshake::run);
}

#[test]
fn shm_slot_header_seeds() {
    replay::replay("shm_slot_header", shm_slot_header::run);
}

#[test]
fn shm_descriptor_seeds() {
    replay::replay("shm_descriptor", shm_descriptor::run);
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_address_seeds() {
    replay::replay("rdma_address", rdma_address::run);
}
