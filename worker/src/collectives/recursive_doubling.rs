//! Recursive-doubling allreduce with a fold for world sizes that are not powers of two.
//!
//! With `p` the largest power of two not above `n` and `rem = n - p`: each rank `r >= p` hands
//! its vector to rank `r - p` and sits out; ranks `0..p` run `log2(p)` rounds, exchanging their
//! whole vector with the partner whose rank differs in one bit; finally ranks `0..rem` hand the
//! result back to `r + p`. `log2(p) + 2` latency terms, `n` whole-vector transfers per round:
//! the choice for small messages. Every partner is `2^j` ranks away (the fold `p`, round `j`
//! `2^j`), so the schedule uses only links that the barrier and the trees use too
//! ([`super::links`]).
//!
//! Bit-exactness: in every exchange both partners compute `lower operand op higher operand`
//! from the same two vectors, so both hold identical bytes afterwards; by induction all
//! participants end identical, and the folded ranks receive a copy.

use crate::comm::Ctx;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::reduce::{combine, finish_avg, ReduceOp};
use cohort_transports::{Transport, TransportError};

/// Scratch elements [`allreduce`] needs for `len` elements.
pub(crate) fn allreduce_scratch(seg: usize, len: usize) -> usize {
    seg.min(len)
}

/// Recursive-doubling allreduce of `data` in place; `scratch` holds at least one segment.
pub(crate) async fn allreduce<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    data: &mut [E],
    op: ReduceOp,
    scratch: &mut [E],
) -> Result<(), TransportError> {
    let (n, rank) = (ctx.size, ctx.rank);
    let pow2 = if n == 0 { 0 } else { 1usize << (usize::BITS - 1 - n.leading_zeros()) };
    let rem = n - pow2;
    let segs = ctx.nsegs(data.len());

    let rounds = pow2.trailing_zeros() as u64;
    let last = (1 + rounds) * segs;
    if rank >= pow2 {
        // Folded: hand the operand down, take the result back.
        ctx.send_segs(rank - pow2, 0, data).await?;
        ctx.recv_segs(rank - pow2, last, data).await?;
        finish_avg(op, data, n as u32);
        return Ok(());
    }
    if rank < rem {
        for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
            ctx.recv_combine((rank + pow2) as u32, ctx.tag(k as u64)?, seg, scratch, op, false).await?;
        }
    }
    for round in 0..rounds {
        let peer = rank ^ (1usize << round);
        let step0 = (1 + round) * segs;
        for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
            let incoming = &mut scratch[..seg.len()];
            let tag = ctx.tag(step0 + k as u64)?;
            tokio::try_join!(
                ctx.t.send(peer as u32, tag, as_bytes(seg)),
                ctx.recv(peer as u32, tag, as_bytes_mut(incoming))
            )?;
            combine(op, seg, incoming, rank > peer);
        }
    }
    if rank < rem {
        ctx.send_segs(rank + pow2, last, data).await?;
    }
    finish_avg(op, data, n as u32);
    Ok(())
}

/// Every rank that `rank` exchanges with in a recursive-doubling allreduce on `n` ranks: its
/// fold partner, and its partner in each round (at most `log2(n) + 1` ranks).
pub(crate) fn partners(rank: usize, n: usize) -> Vec<usize> {
    if n < 2 || rank >= n {
        return Vec::new();
    }
    let pow2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    if rank >= pow2 {
        return vec![rank - pow2];
    }
    let mut out: Vec<usize> = (0..pow2.trailing_zeros()).map(|round| rank ^ (1usize << round)).collect();
    if rank < n - pow2 {
        out.push(rank + pow2);
    }
    out
}
