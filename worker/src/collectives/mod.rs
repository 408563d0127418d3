//! The collectives: each file holds a schedule (a pure message pattern over a [`Transport`])
//! and the `Communicator` methods that run it, with the `CallKind` (name and signature code)
//! of each collective it implements. A new collective is a new file here, its `mod` line and
//! its entry in `CALLS` (in this module's tests); the machinery every call goes through (`Communicator::run`: the
//! call signature, sequence numbers, poisoning, deadlines, revocation) is in `crate::comm`.
//! The allreduce methods, which choose among several schedules, are in `allreduce.rs`.
//!
//! Each schedule takes a `Ctx` (the transport, this rank, the world, the operation's `seq`
//! and call signature, the segment size) and the caller's buffers, and either completes or
//! returns the first [`TransportError`]; classifying errors, poisoning and deadlines are the
//! communicator's job. Messages never exceed one segment, so no frame is ever larger than
//! `CommConfig::segment_bytes`. Schedules that split a vector split it as
//! [`crate::counts_for`] does (`crate::blocks`).
//!
//! Steps: every message of an operation between an ordered pair of ranks gets a distinct
//! `step`, computed from the schedule alone so that sender and receiver agree on it.

pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod alltoall;
pub(crate) mod barrier;
pub mod bcube;
pub(crate) mod hierarchical;
pub(crate) mod p2p;
pub(crate) mod recursive_doubling;
pub(crate) mod reduce_scatter;
pub(crate) mod ring;
pub(crate) mod tree;

use crate::dtype::{as_bytes, as_bytes_mut, Element};
use cohort_transports::{Rank, Tag, Transport, TransportError};
use std::sync::atomic::{AtomicU64, Ordering};

/// One operation's view of the transport.
///
/// Schedules receive through [`Ctx::recv`] (or [`Ctx::recv_segs`]), never `t.recv`
/// directly: the count of received messages is how far this rank got in the operation,
/// which a timeout report carries (see [`crate::OpProgress`]).
pub(crate) struct Ctx<'a, T> {
    /// The transport (send through it; receive through [`Ctx::recv`]).
    pub t: &'a T,
    /// Messages received so far in this operation.
    pub received: &'a AtomicU64,
    /// This rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// The operation's sequence number.
    pub seq: u32,
    /// The call signature every message carries.
    pub sig: u32,
    /// Elements per message (at least 1).
    pub seg: usize,
}

impl<T: Transport> Ctx<'_, T> {
    /// The tag of message `step`; fails if the schedule runs out of the 32-bit step space.
    pub(crate) fn tag(&self, step: u64) -> Result<Tag, TransportError> {
        u32::try_from(step).map(|s| Tag::new(self.seq, s, self.sig)).map_err(|_| {
            TransportError::InvalidArgument(format!(
                "operation needs more than 2^32 messages per link at {} elements per segment; raise segment_bytes",
                self.seg
            ))
        })
    }

    /// Number of messages that carry `len` elements.
    pub(crate) fn nsegs(&self, len: usize) -> u64 {
        len.div_ceil(self.seg) as u64
    }

    /// Sends `data` to `peer` as segments with steps `step0, step0 + 1, ...` (nothing if empty).
    pub(crate) async fn send_segs<E: Element>(
        &self,
        peer: usize,
        step0: u64,
        data: &[E],
    ) -> Result<(), TransportError> {
        for (k, chunk) in data.chunks(self.seg).enumerate() {
            self.t.send(peer as u32, self.tag(step0 + k as u64)?, as_bytes(chunk)).await?;
        }
        Ok(())
    }

    /// Receives message `tag` from `peer` into `buf` and counts it.
    pub(crate) async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.t.recv(peer, tag, buf).await?;
        self.received.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Receives into `buf` from `peer` the segments sent by [`Ctx::send_segs`] with `step0`.
    pub(crate) async fn recv_segs<E: Element>(
        &self,
        peer: usize,
        step0: u64,
        buf: &mut [E],
    ) -> Result<(), TransportError> {
        for (k, chunk) in buf.chunks_mut(self.seg).enumerate() {
            self.recv(peer as u32, self.tag(step0 + k as u64)?, as_bytes_mut(chunk)).await?;
        }
        Ok(())
    }
}

/// Every collective's call kind; no two may share a code or a name (a unit test checks), and
/// every code fits the 5 bits the call signature gives it (below 32). A mismatch error decodes
/// the peer's call kind from its signature through this list. The next free code is 12.
pub(crate) const CALLS: &[crate::comm::CallKind] = &[
    allreduce::ALLREDUCE,
    reduce_scatter::REDUCE_SCATTER,
    allgather::ALLGATHER,
    allgather::ALLGATHERV,
    tree::BROADCAST,
    tree::REDUCE,
    tree::GATHER,
    tree::SCATTER,
    alltoall::ALLTOALL,
    alltoall::ALLTOALLV,
    barrier::BARRIER,
    p2p::P2P,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_kinds_are_distinct() {
        for (i, a) in CALLS.iter().enumerate() {
            assert!(a.code < 32, "{}'s code {} does not fit the signature's 5 bits", a.name, a.code);
            for b in &CALLS[i + 1..] {
                assert_ne!(a.code, b.code, "{} and {} share a signature code", a.name, b.name);
                assert_ne!(a.name, b.name, "two collectives are named {}", a.name);
            }
        }
    }
}
