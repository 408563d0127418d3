//! All-to-all personalised exchange by pairwise rounds.
//!
//! In round `i` (1..n) rank `r` sends its block for `r + i` and receives the block from
//! `r - i`, both at once; its own block is copied locally. Every link carries one message per
//! direction per call, and each rank has exactly one send and one receive in flight.

use crate::blocks::offsets;
use crate::comm::{check, Call, CallKind, Communicator, Ctx};
use crate::dtype::Element;
use crate::error::CommError;
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

impl<T: Transport> Communicator<T> {
    /// All-to-all: `input` and `output` hold `size` equal blocks; block `j` of rank `i`'s
    /// input becomes block `i` of rank `j`'s output.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn alltoall<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), CommError> {
        let n = self.size() as usize;
        let valid = check(input.len() == output.len(), || {
            format!("input has {} elements, output {}", input.len(), output.len())
        })
        .and_then(|_| {
            check(input.len() % n == 0, || format!("{} elements do not split into {n} equal blocks", input.len()))
        });
        let m = input.len() / n;
        let call = Call { dtype: Some(E::DTYPE), count: input.len() as u64, ..Call::new(CallKind::ALLTOALL) };
        let counts = vec![m; n];
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, async |ctx, _scratch| {
            alltoallv(&ctx, input, &counts, output, &counts).await
        })
        .await
    }

    /// All-to-all with sizes: this rank sends `send_counts[j]` elements (consecutive in
    /// `input`, in rank order) to rank `j` and receives `recv_counts[i]` elements from rank `i`
    /// into `output` (consecutive, in rank order). Counts must agree pairwise across ranks
    /// (a disagreement is a length mismatch: [`CommError::InvalidArgument`]).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn alltoallv<E: Element>(
        &mut self,
        input: &[E],
        send_counts: &[usize],
        output: &mut [E],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.size() as usize, self.rank() as usize);
        let valid = check(send_counts.len() == n && recv_counts.len() == n, || {
            format!("{} send counts and {} receive counts for {n} ranks", send_counts.len(), recv_counts.len())
        })
        .and_then(|_| {
            check(send_counts.iter().sum::<usize>() == input.len(), || {
                format!("send counts do not sum to the input's {} elements", input.len())
            })
        })
        .and_then(|_| {
            check(recv_counts.iter().sum::<usize>() == output.len(), || {
                format!("receive counts do not sum to the output's {} elements", output.len())
            })
        })
        .and_then(|_| {
            check(send_counts[rank] == recv_counts[rank], || format!("send_counts[{rank}] != recv_counts[{rank}]"))
        });
        let call = Call { dtype: Some(E::DTYPE), ..Call::new(CallKind::ALLTOALLV) };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, async |ctx, _scratch| {
            alltoallv(&ctx, input, send_counts, output, recv_counts).await
        })
        .await
    }
}
