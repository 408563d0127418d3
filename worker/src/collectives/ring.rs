//! Ring reduce-scatter, ring allgather and ring allreduce (Gloo's ring-chunked).
//!
//! The vector is split into one block per rank. Reduce-scatter runs `n - 1` rounds; in round
//! `r` rank `i` sends block `i - r - 1` to its right neighbour and receives block `i - r - 2`
//! from its left one, combining it into its own copy, so after the last round rank `i` holds
//! the fully reduced block `i`. Allgather then circulates the finished blocks for `n - 1` more
//! rounds. Every block travels as segments of at most `seg` elements: each round sends and
//! receives concurrently, and the receiver combines segment `k` as soon as it lands while the
//! later segments are still on the wire (and in the socket buffers), so reduction overlaps
//! transfer. The only scratch is one segment.
//!
//! Bit-exactness: each element's final value is computed once, by the block's owner, and the
//! allgather copies those bytes to everybody.

use crate::blocks::block_range;
use crate::comm::Ctx;
use crate::dtype::Element;
use crate::reduce::{finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};
use std::ops::Range;

/// The ring a schedule runs on: the member at position `i` sends to the one at `i + 1` and
/// receives from the one at `i - 1` (mod the ring's length). The whole world in rank order,
/// or a subset (the ranks of one host, or one rank of every host, for the hierarchical
/// allreduce).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingOrder<'a> {
    /// The members' ranks in ring order; `None`: ranks `0..len`.
    members: Option<&'a [usize]>,
    /// Number of members.
    len: usize,
    /// This rank's position.
    pos: usize,
}

impl<'a> RingOrder<'a> {
    /// Every rank of `ctx`'s world, in rank order.
    pub(crate) fn world<T>(ctx: &Ctx<'_, T>) -> Self {
        Self { members: None, len: ctx.size, pos: ctx.rank }
    }

    /// The ranks `members` in that order, this rank at position `pos`.
    pub(crate) fn over(members: &'a [usize], pos: usize) -> Self {
        Self { members: Some(members), len: members.len(), pos }
    }

    /// Number of members.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// This rank's position (the block it ends a reduce-scatter owning).
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The rank at position `i` (mod the length).
    fn rank_at(&self, i: usize) -> usize {
        let i = i % self.len;
        self.members.map_or(i, |m| m[i])
    }

    fn right(&self) -> usize {
        self.rank_at(self.pos + 1)
    }

    fn left(&self) -> usize {
        self.rank_at(self.pos + self.len - 1)
    }
}

/// In-place ring reduce-scatter of `data` over the blocks `blocks(0..n)` (`n` the ring's
/// length): afterwards block `ring.pos()` holds the reduction over the ring's members (other
/// blocks hold partial sums). Uses steps `step_base + r * stride + k`; `stride` must be at
/// least the segment count of the largest block. `scratch` must hold at least one segment
/// (`min(ctx.seg, largest block)`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn reduce_scatter_inplace<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    ring: RingOrder<'_>,
    data: &mut [E],
    blocks: impl Fn(usize) -> Range<usize>,
    op: ReduceOp,
    scratch: &mut [E],
    step_base: u64,
    stride: u64,
) -> Result<(), TransportError> {
    let (n, rank) = (ring.len(), ring.pos());
    let (right, left) = (ring.right(), ring.left());
    for r in 0..n.saturating_sub(1) {
        let send_block = (rank + 2 * n - r - 1) % n;
        let recv_block = (rank + 2 * n - r - 2) % n;
        let (send, recv) = split_rw(data, blocks(send_block), blocks(recv_block));
        let step0 = step_base + r as u64 * stride;
        let receive_and_combine = async {
            for (k, seg) in recv.chunks_mut(ctx.seg).enumerate() {
                ctx.recv_combine(left as u32, ctx.tag(step0 + k as u64)?, seg, scratch, op, false).await?;
            }
            Ok(())
        };
        tokio::try_join!(ctx.send_segs(right, step0, send), receive_and_combine)?;
    }
    Ok(())
}

/// In-place ring allgather: on entry block `ring.pos()` of `data` is this rank's
/// contribution; afterwards every block holds its owner's contribution. Steps as in
/// [`reduce_scatter_inplace`].
pub(crate) async fn allgather_inplace<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    ring: RingOrder<'_>,
    data: &mut [E],
    blocks: impl Fn(usize) -> Range<usize>,
    step_base: u64,
    stride: u64,
) -> Result<(), TransportError> {
    let (n, rank) = (ring.len(), ring.pos());
    let (right, left) = (ring.right(), ring.left());
    for r in 0..n.saturating_sub(1) {
        let send_block = (rank + n - r) % n;
        let recv_block = (rank + 2 * n - r - 1) % n;
        let (send, recv) = split_rw(data, blocks(send_block), blocks(recv_block));
        let step0 = step_base + r as u64 * stride;
        tokio::try_join!(ctx.send_segs(right, step0, send), ctx.recv_segs(left, step0, recv))?;
    }
    Ok(())
}

/// Scratch elements [`allreduce`] needs for `len` elements.
pub(crate) fn allreduce_scratch(ctx_seg: usize, len: usize, size: usize) -> usize {
    ctx_seg.min(len.div_ceil(size.max(1)))
}

/// Ring allreduce: reduce-scatter, then (for `Avg`) the owner divides its block once, then
/// allgather.
pub(crate) async fn allreduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let (n, len) = (ctx.size, data.len());
    let blocks = |i| block_range(len, n, i);
    let stride = ctx.nsegs(len.div_ceil(n));
    let ring = RingOrder::world(ctx);
    reduce_scatter_inplace(ctx, ring, data, blocks, op, scratch, 0, stride).await?;
    finish_avg(op, &mut data[blocks(ctx.rank)], n as u32);
    allgather_inplace(ctx, ring, data, blocks, (n as u64 - 1) * stride, stride).await
}

/// A shared view of range `read` and a mutable view of range `write` of one buffer.
///
/// # Panics
/// If the ranges overlap (a bug in the schedule).
fn split_rw<E>(buf: &mut [E], read: Range<usize>, write: Range<usize>) -> (&[E], &mut [E]) {
    if read.end <= write.start {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.end - write.start])
    } else {
        assert!(write.end <= read.start, "schedule bug: overlapping read {read:?} and write {write:?}");
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.end - read.start], &mut lo[write])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rw_views_two_ranges_of_one_buffer() {
        let mut v = [0, 1, 2, 3, 4];
        let (r, w) = split_rw(&mut v, 3..5, 0..2);
        w[0] = r[1];
        assert_eq!(v[0], 4);
        let (r, w) = split_rw(&mut v, 0..1, 2..4);
        w[1] = r[0];
        assert_eq!(v[3], 4);
    }
}
