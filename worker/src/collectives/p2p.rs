//! Point-to-point send and receive between two ranks of a communicator.
//!
//! Messages are ordered per pair by a step counter of their own (from [`P2P_STEP_BASE`] up,
//! above every collective's steps) and do not consume a collective sequence number: a send
//! and its receive happen between the same two collectives on both ranks.

use crate::comm::{check, Call, CallKind, Communicator, P2P_STEP_BASE};
use crate::dtype::Element;
use crate::error::CommError;
use cohort_transports::Transport;

impl<T: Transport> Communicator<T> {
    /// Sends `data` to `peer`, which must post a matching [`Communicator::recv`] (same dtype
    /// and length) between the same two collectives: point-to-point messages are ordered per
    /// pair and do not consume a collective sequence number.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn send<E: Element>(&mut self, data: &[E], peer: u32) -> Result<(), CommError> {
        let valid = self.check_peer(peer);
        let call = Call { dtype: Some(E::DTYPE), count: data.len() as u64, ..Call::new(CallKind::P2P) };
        let step0 = self.p2p_send.get(peer as usize).copied().unwrap_or(P2P_STEP_BASE);
        let segs = data.len().div_ceil(self.segment_elems(&call, std::mem::size_of::<E>())) as u64;
        let res = self
            .run(call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, false, async |ctx, _scratch| {
                ctx.send_segs(peer as usize, step0, data).await
            })
            .await;
        if res.is_ok() {
            self.p2p_send[peer as usize] = step0 + segs;
        }
        res
    }

    /// Receives into `data` (exactly `data.len()` elements) the matching
    /// [`Communicator::send`] from `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn recv<E: Element>(&mut self, data: &mut [E], peer: u32) -> Result<(), CommError> {
        let valid = self.check_peer(peer);
        let call = Call { dtype: Some(E::DTYPE), count: data.len() as u64, ..Call::new(CallKind::P2P) };
        let step0 = self.p2p_recv.get(peer as usize).copied().unwrap_or(P2P_STEP_BASE);
        let segs = data.len().div_ceil(self.segment_elems(&call, std::mem::size_of::<E>())) as u64;
        let res = self
            .run(call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, false, async |ctx, _scratch| {
                ctx.recv_segs(peer as usize, step0, data).await
            })
            .await;
        if res.is_ok() {
            self.p2p_recv[peer as usize] = step0 + segs;
        }
        res
    }

    fn check_peer(&self, peer: u32) -> Result<(), String> {
        check(peer < self.size() && peer != self.rank(), || {
            format!("peer {peer} is not another rank of {} (this is rank {})", self.size(), self.rank())
        })
    }
}
