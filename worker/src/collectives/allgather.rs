//! Allgather and allgatherv: the `Communicator` methods over the ring schedule's allgather
//! phase (`ring::allgather_inplace`).

use super::ring;
use crate::blocks::offsets;
use crate::comm::{check, hash_counts, Call, CallKind, Communicator};
use crate::dtype::Element;
use crate::error::CommError;
use cohort_transports::Transport;

impl<T: Transport> Communicator<T> {
    /// Allgather: `output` (of `input.len() * size` elements) gets rank `i`'s `input` as block
    /// `i`, on every rank. Ring schedule, in place in `output`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allgather<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), CommError> {
        let (m, n, rank) = (input.len(), self.size() as usize, self.rank() as usize);
        let valid =
            check(output.len() == m * n, || format!("output has {} elements, expected {m} x {n}", output.len()));
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, ..Call::new(CallKind::ALLGATHER) };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, async |ctx, _scratch| {
            output[rank * m..(rank + 1) * m].copy_from_slice(input);
            ring::allgather_inplace(&ctx, ring::RingOrder::world(&ctx), output, |i| i * m..(i + 1) * m, 0, ctx.nsegs(m))
                .await
        })
        .await
    }

    /// Allgather with per-rank sizes: rank `i` contributes `counts[i]` elements (its `input`),
    /// and `output` (of `sum(counts)` elements) gets them concatenated in rank order. `counts`
    /// must be the same on every rank.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allgatherv<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        counts: &[usize],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.size() as usize, self.rank() as usize);
        let total: usize = counts.iter().sum();
        let valid = check(counts.len() == n, || format!("{} counts for {n} ranks", counts.len()))
            .and_then(|_| {
                check(counts[rank] == input.len(), || {
                    format!("counts[{rank}] = {} but input has {} elements", counts[rank], input.len())
                })
            })
            .and_then(|_| {
                check(output.len() == total, || format!("output has {} elements, counts sum to {total}", output.len()))
            });
        let call = Call {
            dtype: Some(E::DTYPE),
            count: total as u64,
            extra: hash_counts(counts),
            ..Call::new(CallKind::ALLGATHERV)
        };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, async |ctx, _scratch| {
            let offs = offsets(counts);
            output[offs[rank]..offs[rank] + counts[rank]].copy_from_slice(input);
            let stride = ctx.nsegs(counts.iter().copied().max().unwrap_or(0));
            ring::allgather_inplace(
                &ctx,
                ring::RingOrder::world(&ctx),
                output,
                |i| offs[i]..offs[i] + counts[i],
                0,
                stride,
            )
            .await
        })
        .await
    }
}
