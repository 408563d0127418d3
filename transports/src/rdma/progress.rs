//! The progress engine: the completion-queue task and the handling of each completion.

use super::cq::{Completion, CompletionQueue};
use super::late;
use super::peer::{Peer, PeerState, WR_CREDIT, WR_KIND_MASK, WR_RECV, WR_WRITE};
use super::status;
use crate::activity::{Activity, LateTrack, LateWait};
use crate::liveness::{self, PROBE_WITHIN};
use crate::{AbortReason, Deadlines, Rank, Silence, TransportError};
use rdma_sys::ibv_wc_opcode as op;
use std::collections::HashMap;
use std::future::Future;
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
    /// This rank's board of the mesh ([`crate::activity`]): transport calls enter it, waits
    /// on late peers count on it, peers' probes read it.
    pub(super) board: Arc<Activity>,
    /// The mesh's span (job, generation, rank), for what the waits log.
    pub(super) span: tracing::Span,
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

    /// Waits for a change on `peer` (a completion, a failure, the abort) during the wait of
    /// an operation on `seq` that started at `started`; when the no-progress deadline passes,
    /// fails the link (so every other waiter on it stops too) and returns the timeout, or,
    /// with learning on and a late peer, waits on ([`Inner::wait_for`]).
    ///
    /// # Cancel safety
    /// Cancel safe: it holds nothing but its wait (and the board's count of it, while the
    /// peer is judged late).
    pub(super) async fn wait(
        &self,
        peer: &Peer,
        seq: u32,
        rx: &mut watch::Receiver<u64>,
        started: Instant,
    ) -> Result<(), TransportError> {
        match self.wait_for(peer, seq, started, rx.changed()).await? {
            Ok(()) => Ok(()),
            Err(_) => Err(TransportError::Io("transport shut down".into())),
        }
    }

    /// The peer's last progress, at least `started`.
    fn last_progress(peer: &Peer, started: Instant) -> Instant {
        peer.lock().last_progress.max(started)
    }

    /// Awaits `fut` (a change on `peer`, or its send lock) for the operation on `seq` that
    /// started at `started`, under the no-progress deadline counted from the peer's last
    /// progress. When it passes: with learning off, or a peer whose responder was never
    /// heard, the link fails with `Timeout` (`Silence::Unprobed`); with learning on, the
    /// peer's process is asked where it is and [`late::decide`] says whether the link fails
    /// now (silent, stopped, gone: with what was found; inside the operation: at the
    /// ceiling) or waits on (late: asked again every no-progress interval, up to the
    /// late-rank bound, then `Silence::Late`). While the peer is judged late, this rank's
    /// board counts the wait ([`crate::activity::Activity::late_wait`]) and it says whom it
    /// waits for at info level, at most every [`crate::activity::LATE_LOG_EVERY`].
    ///
    /// # Cancel safety
    /// Cancel safe if `fut` is: it holds nothing else but a board count dropped with it.
    pub(super) async fn wait_for<F: Future>(
        &self,
        peer: &Peer,
        seq: u32,
        started: Instant,
        fut: F,
    ) -> Result<F::Output, TransportError> {
        tokio::pin!(fut);
        let bounds = late::Bounds::of(&self.deadlines);
        let mut track = LateTrack::default();
        let mut late_wait: Option<LateWait<'_>> = None;
        // When to ask a late peer again (None: at the ceiling from the last progress).
        let mut ask_at: Option<Instant> = None;
        loop {
            let due = ask_at.unwrap_or_else(|| Self::last_progress(peer, started) + bounds.no_progress);
            tokio::select! {
                biased;
                out = &mut fut => return Ok(out),
                () = tokio::time::sleep_until(due) => {}
            }
            let last = Self::last_progress(peer, started);
            let now = Instant::now();
            if now < last + bounds.no_progress {
                // Progress since: whatever was judged is stale.
                ask_at = None;
                track.clear();
                late_wait = None;
                continue;
            }
            let heard = match peer.liveness.as_ref().filter(|p| p.verified.load(Ordering::Relaxed)) {
                Some(p) if self.deadlines.learning.is_some() => {
                    let query =
                        liveness::Query { job: self.board.job(), generation: self.generation, rank: peer.rank, seq };
                    let answer = tokio::select! {
                        biased;
                        out = &mut fut => return Ok(out),
                        a = liveness::probe(p.target, PROBE_WITHIN, query) => a,
                    };
                    late::hear(answer, seq, peer.rank, self.rank)
                }
                _ => late::Heard::Inside,
            };
            let now = Instant::now();
            let last = Self::last_progress(peer, started);
            if now < last + bounds.no_progress {
                ask_at = None;
                track.clear();
                late_wait = None;
                continue;
            }
            if let late::Heard::Late { lateness, root, cpu } = heard {
                if let Some(line) = track.late(now.into_std(), last.into_std(), lateness, cpu) {
                    let p = peer.rank;
                    self.span.in_scope(|| tracing::info!(peer = p, "waiting on rank {p}: {line}"));
                }
                match &late_wait {
                    Some(w) => w.behind(root),
                    None => late_wait = Some(self.board.late_wait(root)),
                }
            } else {
                track.clear();
                late_wait = None;
            }
            match late::decide(heard, track.cpu_use(), now - last, bounds) {
                late::Next::Wait(d) => ask_at = Some(now + d),
                late::Next::Fail { after, silence } => {
                    self.span.in_scope(|| match silence {
                        Silence::Late { .. } => tracing::warn!(
                            peer = peer.rank,
                            waited_ms = (now - last).as_millis() as u64,
                            "the peer runs but stayed late past the late-rank bound"
                        ),
                        Silence::Unprobed => {}
                        _ => tracing::warn!(
                            peer = peer.rank,
                            stalled_ms = (now - last).as_millis() as u64,
                            "no progress past the no-progress deadline and the peer's process does not answer"
                        ),
                    });
                    let e = TransportError::Timeout { peer: peer.rank, after, silence };
                    return Err(peer.fail(&mut peer.lock(), e));
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
