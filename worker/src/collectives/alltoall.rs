//! All-to-all personalised exchange by pairwise rounds.
//!
//! In round `i` (1..n) rank `r` sends its block for `r + i` and receives the block from
//! `r - i`, both at once; its own block is copied locally. Every link carries one message per
//! direction per call, and each rank has exactly one send and one receive in flight.

use super::{offsets, Ctx};
use crate::dtype::Element;
use cohort_transports::{Transport, TransportError};

/// Pairwise all-to-all with per-destination `send_counts` and per-source `recv_counts`
/// (validated by the caller: both of length n, summing to the buffer lengths, and
/// `send_counts[rank] == recv_counts[rank]`).
pub(crate) async fn alltoallv<T: Transport, E: Element>(
    ctx: &Ctx<'_, T>,
    input: &[E],
    send_counts: &[usize],
    output: &mut [E],
    recv_counts: &[usize],
) -> Result<(), TransportError> {
    let (n, rank) = (ctx.size, ctx.rank);
    let send_off = offsets(send_counts);
    let recv_off = offsets(recv_counts);
    output[recv_off[rank]..recv_off[rank] + recv_counts[rank]]
        .copy_from_slice(&input[send_off[rank]..send_off[rank] + send_counts[rank]]);
    for i in 1..n {
        let to = (rank + i) % n;
        let from = (rank + n - i) % n;
        let send = &input[send_off[to]..send_off[to] + send_counts[to]];
        let recv = &mut output[recv_off[from]..recv_off[from] + recv_counts[from]];
        tokio::try_join!(ctx.send_segs(to, 0, send), ctx.recv_segs(from, 0, recv))?;
    }
    Ok(())
}
