//! Dissemination barrier: `ceil(log2 n)` rounds of empty messages.
//!
//! In round `j` rank `r` signals `r + 2^j` and waits for `r - 2^j`. After the last round every
//! rank has (transitively) heard from every other, so nobody leaves before everybody entered.

use crate::comm::{Call, CallKind, Communicator, Ctx};
use crate::error::CommError;
use cohort_transports::{Transport, TransportError};

/// Runs the barrier.
pub(crate) async fn barrier<T: Transport>(ctx: &Ctx<'_, T>) -> Result<(), TransportError> {
    let (n, rank) = (ctx.size, ctx.rank);
    let mut dist = 1usize;
    let mut round = 0u64;
    while dist < n {
        let to = (rank + dist) % n;
        let from = (rank + n - dist) % n;
        let tag = ctx.tag(round)?;
        tokio::try_join!(ctx.t.send(to as u32, tag, &[]), ctx.recv(from as u32, tag, &mut []))?;
        dist <<= 1;
        round += 1;
    }
    Ok(())
}

impl<T: Transport> Communicator<T> {
    /// Barrier: returns once every rank has entered it (dissemination, `ceil(log2 n)` rounds).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn barrier(&mut self) -> Result<(), CommError> {
        self.run(Call::new(CallKind::BARRIER), 1, 0, Ok(()), true, async |ctx, _scratch| barrier(&ctx).await).await
    }
}
