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

use super::{block_range, split_rw, Ctx};
use crate::dtype::{as_bytes_mut, Element};
use crate::reduce::{finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};
use std::ops::Range;

/// In-place ring reduce-scatter of `data` over the blocks `blocks(0..n)`: afterwards block
/// `ctx.rank` holds the reduction (other blocks hold partial sums). Uses steps
/// `step_base + r * stride + k`; `stride` must be at least the segment count of the largest
/// block. `scratch` must hold at least one segment (`min(ctx.seg, largest block)`).
pub(crate) async fn reduce_scatter_inplace<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    blocks: impl Fn(usize) -> Range<usize>,
    op: ReduceOp,
    scratch: &mut [E],
    step_base: u64,
    stride: u64,
) -> Result<(), TransportError> {
    let (n, rank) = (ctx.size, ctx.rank);
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    for r in 0..n.saturating_sub(1) {
        let send_block = (rank + 2 * n - r - 1) % n;
        let recv_block = (rank + 2 * n - r - 2) % n;
        let (send, recv) = split_rw(data, blocks(send_block), blocks(recv_block));
        let step0 = step_base + r as u64 * stride;
        let receive_and_combine = async {
            for (k, seg) in recv.chunks_mut(ctx.seg).enumerate() {
                let incoming = &mut scratch[..seg.len()];
                ctx.recv(left as u32, ctx.tag(step0 + k as u64)?, as_bytes_mut(incoming)).await?;
                E::combine(op, seg, incoming, false);
            }
            Ok(())
        };
        tokio::try_join!(ctx.send_segs(right, step0, send), receive_and_combine)?;
    }
    Ok(())
}

/// In-place ring allgather: on entry block `ctx.rank` of `data` is this rank's contribution;
/// afterwards every block holds its owner's contribution. Steps as in
/// [`reduce_scatter_inplace`].
pub(crate) async fn allgather_inplace<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    blocks: impl Fn(usize) -> Range<usize>,
    step_base: u64,
    stride: u64,
) -> Result<(), TransportError> {
    let (n, rank) = (ctx.size, ctx.rank);
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
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
    reduce_scatter_inplace(ctx, data, blocks, op, scratch, 0, stride).await?;
    finish_avg(op, &mut data[blocks(ctx.rank)], n as u32);
    allgather_inplace(ctx, data, blocks, (n as u64 - 1) * stride, stride).await
}
