//! Recursive-doubling allreduce with the usual fold for world sizes that are not powers of two.
//!
//! With `p` the largest power of two not above `n` and `rem = n - p`: the first `2 * rem`
//! ranks pair up, each even rank hands its vector to the odd rank above it and sits out; the
//! `p` remaining ranks run `log2(p)` rounds, exchanging their whole vector with the partner
//! whose virtual rank differs in one bit; finally the odd ranks hand the result back to their
//! even partners. `log2(p) + 2` latency terms, `n` whole-vector transfers per round: the choice
//! for small messages.
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

    // Fold: even ranks below 2*rem give their vector to the odd rank above them.
    let vrank = if rank < 2 * rem {
        if rank % 2 == 0 {
            ctx.send_segs(rank + 1, 0, data).await?;
            None
        } else {
            for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
                let incoming = &mut scratch[..seg.len()];
                ctx.recv((rank - 1) as u32, ctx.tag(k as u64)?, as_bytes_mut(incoming)).await?;
                // The even (lower) rank's operand goes first.
                combine(op, seg, incoming, true);
            }
            Some(rank / 2)
        }
    } else {
        Some(rank - rem)
    };

    let rounds = pow2.trailing_zeros() as u64;
    if let Some(v) = vrank {
        for round in 0..rounds {
            let pv = v ^ (1usize << round);
            let peer = if pv < rem { pv * 2 + 1 } else { pv + rem };
            let step0 = (1 + round) * segs;
            for (k, seg) in data.chunks_mut(ctx.seg).enumerate() {
                let incoming = &mut scratch[..seg.len()];
                let tag = ctx.tag(step0 + k as u64)?;
                tokio::try_join!(
                    ctx.t.send(peer as u32, tag, as_bytes(seg)),
                    ctx.recv(peer as u32, tag, as_bytes_mut(incoming))
                )?;
                combine(op, seg, incoming, v > pv);
            }
        }
    }

    // Unfold: odd ranks below 2*rem give the result back.
    let last = (1 + rounds) * segs;
    if rank < 2 * rem {
        if rank % 2 == 1 {
            ctx.send_segs(rank - 1, last, data).await?;
        } else {
            ctx.recv_segs(rank + 1, last, data).await?;
        }
    }
    finish_avg(op, data, n as u32);
    Ok(())
}
