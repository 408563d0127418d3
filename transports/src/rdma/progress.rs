//! The progress engine: the completion-queue task and the handling of each completion.

use super::cq::{Completion, CompletionQueue};
use super::peer::{Peer, PeerState, WR_CREDIT, WR_KIND_MASK, WR_RECV, WR_WRITE};
use super::status;
use crate::{AbortReason, Deadlines, Rank, TransportError};
use rdma_sys::ibv_wc_opcode as op;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::time::Instant;

pub(super) struct Inner {
    // Declared first: peers (QPs, then buffers) go before the CQ they use.
    pub(super) peers: Vec<Option<Peer>>,
    pub(super) by_qpn: HashMap<u32, Rank>,
    pub(super) cq: Arc<CompletionQueue>,
    pub(super) rank: Rank,
    pub(super) world: u32,
    pub(super) generation: u64,
    pub(super) deadlines: Deadlines,
    pub(super) max_message: u64,
    pub(super) max_unexpected: u64,
    pub(super) abort: Mutex<Option<AbortReason>>,
    pub(super) aborted: AtomicBool,
}

impl Inner {
    pub(super) fn abort_reason(&self) -> Option<AbortReason> {
        if !self.aborted.load(Ordering::Acquire) {
            return None;
        }
        self.abort.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(super) fn peer(&self, peer: Rank) -> Result<&Peer, TransportError> {
        if peer >= self.world {
            return Err(TransportError::InvalidArgument(format!("peer {peer} outside a world of {}", self.world)));
        }
        self.peers[peer as usize].as_ref().ok_or_else(|| {
            TransportError::InvalidArgument(format!("rank {peer} cannot send to or receive from itself"))
        })
    }

    /// Aborted, or the link broken: the error to return.
    pub(super) fn check(&self, st: &PeerState) -> Result<(), TransportError> {
        if let Some(r) = self.abort_reason() {
            return Err(TransportError::Aborted(r));
        }
        match &st.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    pub(super) fn handle(&self, c: &Completion) {
        let Some(&rank) = self.by_qpn.get(&c.qp_num) else {
            tracing::warn!(qpn = c.qp_num, "completion for an unknown queue pair");
            return;
        };
        let Some(peer) = self.peers[rank as usize].as_ref() else { return };
        let mut st = peer.lock();
        let aborted = self.abort_reason();
        if let Some(e) = status::wc_error(c.status, c.vendor_err, rank, aborted.as_ref()) {
            if aborted.is_none() {
                peer.fail(&mut st, e);
            }
            return;
        }
        st.last_progress = Instant::now();
        match c.wr_id & WR_KIND_MASK {
            WR_RECV => {
                if let Err(e) = peer.qp.post_recv(WR_RECV) {
                    peer.fail(&mut st, e);
                    return;
                }
                match (c.opcode, c.imm) {
                    (op::IBV_WC_RECV_RDMA_WITH_IMM, Some(imm)) => {
                        peer.on_data(&mut st, imm, self.generation, self.max_message, self.max_unexpected)
                    }
                    (op::IBV_WC_RECV, Some(n)) => {
                        if let Err(e) = st.window.grant(n) {
                            peer.protocol(&mut st, e.to_string());
                        }
                    }
                    (opc, imm) => {
                        peer.protocol(
                            &mut st,
                            format!("unexpected receive completion (opcode {opc}, immediate {imm:?})"),
                        );
                    }
                }
            }
            WR_WRITE => {
                let slot = (c.wr_id & 0xffff_ffff) as u32;
                if let Err(e) = st.window.complete_local(slot) {
                    peer.fail(&mut st, TransportError::Io(e.to_string()));
                }
            }
            WR_CREDIT => {
                st.credit_sends = st.credit_sends.saturating_sub(1);
                peer.flush_credits(&mut st, None);
            }
            _ => tracing::warn!(wr_id = c.wr_id, "completion with an unknown work request id"),
        }
        drop(st);
        peer.wake();
    }

    /// Waits for a change on `peer` or the no-progress deadline; when the deadline passes,
    /// fails the link (so every other waiter on it stops too) and returns the timeout.
    pub(super) async fn wait(
        &self,
        peer: &Peer,
        rx: &mut watch::Receiver<u64>,
        started: Instant,
    ) -> Result<(), TransportError> {
        loop {
            let last = peer.lock().last_progress.max(started);
            let deadline = last + self.deadlines.no_progress;
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(_)) => return Err(TransportError::Io("transport shut down".into())),
                Err(_) => {
                    if peer.lock().last_progress.max(started) + self.deadlines.no_progress <= Instant::now() {
                        let e = TransportError::Timeout {
                            peer: peer.rank,
                            after: self.deadlines.no_progress,
                            silence: crate::Silence::Unprobed,
                        };
                        return Err(peer.fail(&mut peer.lock(), e));
                    }
                }
            }
        }
    }
}

/// The progress task: waits for completion events (or spins in busy-poll mode) and hands
/// every completion to [`Inner::handle`].
pub(super) async fn progress(inner: Arc<Inner>, mut stop: watch::Receiver<bool>, busy_poll: bool) {
    let mut batch = Vec::with_capacity(64);
    loop {
        if *stop.borrow() {
            return;
        }
        if !busy_poll {
            tokio::select! {
                _ = stop.changed() => return,
                r = inner.cq.wait() => if let Err(e) = r {
                    tracing::error!(error = %e, "rdma completion channel failed; failing every link");
                    for p in inner.peers.iter().flatten() {
                        let mut st = p.lock();
                        p.fail(&mut st, e.clone());
                    }
                    return;
                },
            }
        }
        loop {
            batch.clear();
            match inner.cq.poll(&mut batch, 64) {
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "polling the completion queue failed");
                    for p in inner.peers.iter().flatten() {
                        let mut st = p.lock();
                        p.fail(&mut st, e.clone());
                    }
                    return;
                }
            }
            for c in &batch {
                inner.handle(c);
            }
            if batch.len() < 64 {
                break;
            }
        }
        if busy_poll {
            tokio::task::yield_now().await;
        }
    }
}
