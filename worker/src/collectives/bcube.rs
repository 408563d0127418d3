//! BCube allreduce (after Gloo's allreduce_bcube), for any world size.
//!
//! The world size is factored into dimensions `d_0 * d_1 * ... = n` (the configured base as
//! often as it divides, then the rest as one dimension; without a base, the prime factors in
//! ascending order; a prime world is a single group). A rank's digits in that mixed radix place
//! it in one group per dimension: the ranks that differ from it in that digit only.
//!
//! Reduce-scatter: in dimension `0` the group splits the vector into `d_0` blocks and each
//! member receives its block from every other member and combines them (its own first, then
//! the others in digit order); dimension `1` does the same on that block, and so on. After the
//! last dimension each rank owns a fully reduced piece; the allgather replays the dimensions in
//! reverse, each member sending its piece to the others in its group. Each member talks to a
//! group's `d - 1` peers concurrently: `sum(d_i - 1)` peers in all, `log_b(n)` rounds.
//!
//! Bit-exactness: every element's final value is computed by one rank only; the allgather
//! copies its bytes.

use crate::blocks::block_range;
use crate::comm::Ctx;
use crate::dtype::Element;
use crate::reduce::{combine, finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};
use futures::future::{try_join, try_join_all};
use std::ops::Range;

/// Factors `n` into group sizes: `base` as often as it divides `n`, then the remainder as one
/// group; with no usable base (`None`, 0 or 1) the prime factors in ascending order. The
/// product is always `n`; `n <= 1` has no dimensions.
pub fn factorize(n: u32, base: Option<u32>) -> Vec<u32> {
    let mut dims = Vec::new();
    let mut rest = n;
    match base {
        Some(b) if b >= 2 => {
            while rest > 1 && rest % b == 0 {
                dims.push(b);
                rest /= b;
            }
            if rest > 1 {
                dims.push(rest);
            }
        }
        _ => {
            let mut f = 2u32;
            while rest > 1 {
                if u64::from(f) * u64::from(f) > u64::from(rest) {
                    dims.push(rest);
                    break;
                }
                if rest % f == 0 {
                    dims.push(f);
                    rest /= f;
                } else {
                    f += 1;
                }
            }
        }
    }
    dims
}

/// One dimension's group as seen from this rank.
struct Group {
    /// Group size.
    size: usize,
    /// This rank's digit (its index in the group).
    digit: usize,
    /// Rank of member `j` is `first + j * stride`.
    first: usize,
    stride: usize,
}

impl Group {
    fn member(&self, j: usize) -> usize {
        self.first + j * self.stride
    }
}

fn groups(rank: usize, dims: &[u32]) -> Vec<Group> {
    let mut stride = 1usize;
    dims.iter()
        .map(|&d| {
            let size = d as usize;
            let digit = (rank / stride) % size;
            let g = Group { size, digit, first: rank - digit * stride, stride };
            stride *= size;
            g
        })
        .collect()
}

fn sub_block(region: &Range<usize>, parts: usize, j: usize) -> Range<usize> {
    let r = block_range(region.len(), parts, j);
    region.start + r.start..region.start + r.end
}

/// Scratch elements [`allreduce`] needs for `len` elements.
pub(crate) fn allreduce_scratch(seg: usize, len: usize, dims: &[u32]) -> usize {
    let mut region = len;
    let mut need = 0;
    for &d in dims {
        let d = d as usize;
        let block = region.div_ceil(d);
        need = need.max((d - 1) * seg.min(block.max(1)));
        region = block;
    }
    need
}

/// BCube allreduce of `data` in place over the dimensions `dims` (product = world size);
/// `scratch` holds [`allreduce_scratch`] elements.
pub(crate) async fn allreduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    dims: &[u32],
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let groups = groups(ctx.rank, dims);
    let mut regions = Vec::with_capacity(groups.len());
    let mut region = 0..data.len();

    for g in &groups {
        let mine = sub_block(&region, g.size, g.digit);
        let seg = ctx.seg.min(mine.len().max(1));
        let stride = ctx.nsegs(region.len().div_ceil(g.size));
        for k in 0..stride as usize {
            // Exchange segment k of every block: others' blocks out, my block's copies in.
            {
                let shared: &[E] = data;
                let sends = (0..g.size).filter(|&j| j != g.digit).filter_map(|j| {
                    let b = sub_block(&region, g.size, j);
                    let lo = b.start + k * ctx.seg;
                    (lo < b.end).then(|| ctx.send_segs(g.member(j), k as u64, &shared[lo..b.end.min(lo + ctx.seg)]))
                });
                let lo = mine.start + k * ctx.seg;
                let seg_len = mine.end.saturating_sub(lo).min(ctx.seg);
                let recvs = scratch[..(g.size - 1) * seg]
                    .chunks_mut(seg)
                    .take(g.size - 1)
                    .zip((0..g.size).filter(|&j| j != g.digit))
                    .filter(|_| seg_len > 0)
                    .map(|(slot, j)| ctx.recv_segs(g.member(j), k as u64, &mut slot[..seg_len]));
                try_join(try_join_all(sends), try_join_all(recvs)).await?;
            }
            let lo = mine.start + k * ctx.seg;
            if lo < mine.end {
                let hi = mine.end.min(lo + ctx.seg);
                let target = &mut data[lo..hi];
                for slot in scratch[..(g.size - 1) * seg].chunks(seg) {
                    combine(op, target, &slot[..hi - lo], false);
                }
            }
        }
        regions.push(region);
        region = mine;
    }

    finish_avg(op, &mut data[region.clone()], ctx.size as u32);

    for (g, outer) in groups.iter().zip(regions.iter()).rev() {
        let stride = ctx.nsegs(outer.len().div_ceil(g.size));
        let mut rest = &mut data[outer.clone()];
        let mut blocks: Vec<&mut [E]> = Vec::with_capacity(g.size);
        for j in 0..g.size {
            let (b, r) = rest.split_at_mut(block_range(outer.len(), g.size, j).len());
            blocks.push(b);
            rest = r;
        }
        let mine: &mut [E] = std::mem::take(&mut blocks[g.digit]);
        let mine: &[E] = mine;
        let sends = (0..g.size).filter(|&j| j != g.digit).map(|j| ctx.send_segs(g.member(j), stride, mine));
        let recvs = blocks
            .iter_mut()
            .enumerate()
            .filter(|(j, _)| *j != g.digit)
            .map(|(j, b)| ctx.recv_segs(g.member(j), stride, b));
        try_join(try_join_all(sends), try_join_all(recvs)).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factorizations() {
        assert_eq!(factorize(8, None), [2, 2, 2]);
        assert_eq!(factorize(12, None), [2, 2, 3]);
        assert_eq!(factorize(7, None), [7]);
        assert_eq!(factorize(1, None), Vec::<u32>::new());
        assert_eq!(factorize(8, Some(4)), [4, 2]);
        assert_eq!(factorize(8, Some(3)), [8]);
        assert_eq!(factorize(9, Some(3)), [3, 3]);
        assert_eq!(factorize(6, Some(1)), [2, 3]);
        for n in 1..200u32 {
            assert_eq!(factorize(n, None).iter().product::<u32>(), n.max(1));
            assert_eq!(factorize(n, Some(4)).iter().product::<u32>(), n.max(1));
        }
    }

    #[test]
    fn groups_partition_the_world() {
        let dims = [2u32, 3];
        for rank in 0..6 {
            let gs = groups(rank, &dims);
            assert_eq!(gs[0].member(gs[0].digit), rank);
            assert_eq!(gs[1].member(gs[1].digit), rank);
        }
        let g = &groups(4, &dims)[1];
        assert_eq!((0..3).map(|j| g.member(j)).collect::<Vec<_>>(), [0, 2, 4]);
    }
}
