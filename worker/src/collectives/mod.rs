//! The collectives: each file holds a schedule (a pure message pattern over a [`Transport`])
//! and the `Communicator` methods that run it. A new collective is a new file here, its `mod`
//! line, and its `CallKind` (name and signature code) beside the others in `crate::comm`, with
//! the machinery every call goes through (`Communicator::run`: the call signature, sequence
//! numbers, poisoning, deadlines, revocation). The allreduce methods, which choose among
//! several schedules, are in `allreduce.rs`. Everything here builds on `crate::comm`; nothing
//! there names a collective's file.
//!
//! Each schedule takes a `Ctx` (`crate::comm`: the transport, this rank, the world, the
//! operation's `seq` and call signature, the segment size) and the caller's buffers, and either
//! completes or returns the first [`TransportError`]; classifying errors, poisoning and
//! deadlines are the communicator's job. Messages never exceed one segment, so no frame is ever
//! larger than `CommConfig::segment_bytes`. Schedules that split a vector split it as
//! [`crate::counts_for`] does.
//!
//! Steps: every message of an operation between an ordered pair of ranks gets a distinct
//! `step`, computed from the schedule alone so that sender and receiver agree on it.
//!
//! [`Transport`]: cohort_transports::Transport
//! [`TransportError`]: cohort_transports::TransportError

pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod alltoall;
pub(crate) mod barrier;
pub mod bcube;
pub(crate) mod hierarchical;
pub mod links;
pub(crate) mod p2p;
pub(crate) mod recursive_doubling;
pub(crate) mod reduce_scatter;
pub(crate) mod ring;
pub(crate) mod tree;
