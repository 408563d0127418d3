//! Reduce-scatter: the `Communicator` method over the ring schedule's reduce-scatter phase
//! (`ring::reduce_scatter_inplace`).

use super::ring;
use crate::blocks::block_range;
use crate::comm::{check, Call, CallKind, Communicator};
use crate::dtype::Element;
use crate::error::CommError;
use crate::reduce::ReduceOp;
use cohort_transports::Transport;

impl<T: Transport> Communicator<T> {
    /// Reduce-scatter: reduces all ranks' `input` element-wise and leaves this rank's block of
    /// the result in `output`. Blocks follow [`crate::counts_for`]`(input.len(), size)`: the first
    /// `input.len() % size` ranks get one element more; `output.len()` must equal this rank's
    /// block. Ring schedule; `input` is copied once into scratch.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn reduce_scatter<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (len, n, rank) = (input.len(), self.size() as usize, self.rank() as usize);
        let mine = block_range(len, n, rank);
        let valid = check(output.len() == mine.len(), || {
            format!(
                "output has {} elements, rank {rank}'s block of {len} over {n} ranks has {}",
                output.len(),
                mine.len()
            )
        });
        let call =
            Call { dtype: Some(E::DTYPE), op: Some(op), count: len as u64, ..Call::new(CallKind::REDUCE_SCATTER) };
        self.run(call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, async |ctx, scratch| {
            let seg_need = ctx.seg.min(len.div_ceil(n));
            let all = scratch.get::<E>(len + seg_need);
            let (work, seg) = all.split_at_mut(len);
            work.copy_from_slice(input);
            let stride = ctx.nsegs(len.div_ceil(n));
            let blocks = |i| block_range(len, n, i);
            ring::reduce_scatter_inplace(&ctx, ring::RingOrder::world(&ctx), work, blocks, op, seg, 0, stride).await?;
            let result = &mut work[mine.clone()];
            crate::reduce::finish_avg(op, result, n as u32);
            output.copy_from_slice(result);
            Ok(())
        })
        .await
    }
}
