//! [`RdmaTransport`]: the [`Transport`] operations over a connected mesh.

use super::credits::segments;
use super::peer::{Inbound, Peer, HDR, WR_WRITE};
use super::progress::Inner;
use super::wire::{DataImm, SegmentHeader, SEGMENT_HEADER_LEN};
use crate::{AbortReason, Rank, Tag, Transport, TransportError};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

/// An RDMA mesh for one generation; see the module docs.
pub struct RdmaTransport {
    pub(super) inner: Arc<Inner>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) engine: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("generation", &self.inner.generation)
            .finish()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.engine.abort();
    }
}

/// Unregisters a receive that ends without completing (error or cancellation).
pub(super) struct RecvGuard<'a> {
    pub(super) peer: &'a Peer,
    pub(super) key: (u32, u32),
    pub(super) done: bool,
}

impl Drop for RecvGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.peer.lock();
        let touched = st.inbound.get(&self.key).is_some_and(|e| e.touched);
        if touched && st.broken.is_none() {
            let e = TransportError::Protocol {
                peer: self.peer.rank,
                detail: format!("receive of seq {} step {} abandoned part-way", self.key.0, self.key.1),
            };
            self.peer.fail(&mut st, e);
        } else if let Some(e) = st.inbound.get_mut(&self.key) {
            e.waiting = false;
            if !e.seen {
                st.inbound.remove(&self.key);
            }
        }
    }
}

impl RdmaTransport {
    /// Whether the liveness responder of `peer`'s endpoint has answered since the mesh came
    /// up (with learning on, stalls past the no-progress deadline are then settled by asking
    /// it where the peer is; see [`crate::liveness`] and [`crate::activity`]). False for
    /// this rank itself, a rank outside the world, and with learning off (nobody is asked).
    pub fn peer_probed(&self, peer: Rank) -> bool {
        self.inner
            .peers
            .get(peer as usize)
            .and_then(Option::as_ref)
            .and_then(|p| p.liveness.as_ref())
            .is_some_and(|p| p.verified.load(Ordering::Relaxed))
    }

    pub(super) async fn send_inner(&self, peer_rank: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let peer = inner.peer(peer_rank)?;
        if data.len() as u64 > inner.max_message {
            return Err(TransportError::InvalidArgument(format!(
                "message of {} bytes exceeds the maximum of {}",
                data.len(),
                inner.max_message
            )));
        }
        let _in_call = inner.board.enter(tag.seq);
        let started = Instant::now();
        let mut rx = peer.wake.subscribe();
        // Behind an earlier send to the same peer: waited for under the same rules as the
        // peer itself (that send waits on the peer's credits).
        let _order = inner.wait_for(peer, tag.seq, started, peer.send_lock.lock()).await?;
        let rsb = peer.remote.slot_bytes;
        for (off, len) in segments(data.len() as u64, rsb - HDR) {
            loop {
                {
                    let mut st = peer.lock();
                    inner.check(&st)?;
                    if let Some(slot) = st.window.try_acquire() {
                        let h = SegmentHeader {
                            generation: inner.generation,
                            tag,
                            seg_len: len,
                            total: data.len() as u64,
                            offset: off,
                        };
                        let base = (slot * rsb) as usize;
                        let payload = &data[off as usize..off as usize + len as usize];
                        let res = peer
                            .staging
                            .write_at(base, &h.encode())
                            .and_then(|_| peer.staging.write_at(base + SEGMENT_HEADER_LEN, payload))
                            .and_then(|_| {
                                // Slots are < MAX_SLOTS (4096), so they fit the immediate's 16 bits.
                                let imm = DataImm::new(slot as u16, tag).to_u32();
                                peer.qp.post_write_imm(
                                    WR_WRITE | u64::from(slot),
                                    peer.staging.addr() + base as u64,
                                    HDR + len,
                                    peer.staging.lkey(),
                                    peer.remote.ring.addr + base as u64,
                                    peer.remote.ring.rkey,
                                    imm,
                                )
                            });
                        if let Err(e) = res {
                            return Err(peer.fail(&mut st, e));
                        }
                        break;
                    }
                }
                inner.wait(peer, tag.seq, &mut rx, started).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn recv_inner(&self, peer_rank: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let peer = inner.peer(peer_rank)?;
        let _in_call = inner.board.enter(tag.seq);
        let started = Instant::now();
        let mut rx = peer.wake.subscribe();
        let key = (tag.seq, tag.step);
        {
            let mut st = peer.lock();
            inner.check(&st)?;
            let e = st.inbound.entry(key).or_insert_with(Inbound::new);
            if e.waiting {
                return Err(TransportError::InvalidArgument(format!(
                    "a receive for seq {} step {} from rank {peer_rank} is already waiting",
                    tag.seq, tag.step
                )));
            }
            e.waiting = true;
        }
        let mut guard = RecvGuard { peer, key, done: false };
        let slot_bytes = peer.local_slot_bytes as usize;
        loop {
            {
                let mut st = peer.lock();
                inner.check(&st)?;
                let st = &mut *st;
                let Some(entry) = st.inbound.get_mut(&key) else {
                    return Err(TransportError::Io("receive state lost".into()));
                };
                if entry.seen {
                    if entry.signature != tag.signature || entry.reasm.total() != buf.len() as u64 {
                        let d = format!(
                            "message seq {} step {}: expected {} bytes with signature {:#010x}, got {} bytes with signature {:#010x}",
                            tag.seq,
                            tag.step,
                            buf.len(),
                            tag.signature,
                            entry.reasm.total(),
                            entry.signature
                        );
                        let signatures = (entry.signature != tag.signature)
                            .then_some(crate::Signatures { received: entry.signature, expected: tag.signature });
                        return Err(peer.fail(st, TransportError::Mismatch { peer: peer_rank, detail: d, signatures }));
                    }
                    if let Some(heap) = &entry.heap {
                        let (a, b) = (entry.heap_copied as usize, entry.heap_len as usize);
                        buf[a..b].copy_from_slice(&heap[a..b]);
                        entry.heap_copied = entry.heap_len;
                        entry.touched |= b > a;
                    }
                    let segs = std::mem::take(&mut entry.in_slot);
                    entry.touched |= !segs.is_empty();
                    for (slot, off, len) in segs {
                        let (off, len) = (off as usize, len as usize);
                        let at = slot as usize * slot_bytes + SEGMENT_HEADER_LEN;
                        if let Err(e) = peer.ring.read_at(at, &mut buf[off..off + len]) {
                            return Err(peer.fail(st, e));
                        }
                        if let Err(e) = st.ring.release(slot) {
                            return Err(peer.protocol(st, e.to_string()));
                        }
                    }
                    let entry = st.inbound.get(&key).expect("entry present");
                    if entry.reasm.is_complete() && entry.in_slot.is_empty() && entry.heap_copied == entry.heap_len {
                        if let Some(e) = st.inbound.remove(&key) {
                            if e.heap.is_some() {
                                st.staged_bytes = st.staged_bytes.saturating_sub(e.reasm.total());
                                st.staged_msgs = st.staged_msgs.saturating_sub(1);
                            }
                        }
                        guard.done = true;
                    }
                    let owed = st.ring.take_credits(false);
                    peer.flush_credits(st, owed);
                    if guard.done {
                        return Ok(());
                    }
                }
            }
            inner.wait(peer, tag.seq, &mut rx, started).await?;
        }
    }
}

impl Transport for RdmaTransport {
    fn rank(&self) -> Rank {
        self.inner.rank
    }

    fn world_size(&self) -> u32 {
        self.inner.world
    }

    fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// Copies `data` segment by segment into registered staging slots and RDMA-writes each
    /// into a credited slot of the peer's ring; returns once the last write is posted.
    ///
    /// # Cancel safety
    /// Not cancel safe: a message cut short leaves the peer's reassembly waiting; use
    /// [`Transport::abort`] to stop work on purpose.
    fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.send_inner(peer, tag, data)
    }

    /// Waits for the message `tag` from `peer` and copies it from the ring (or from early
    /// copies) into `buf`.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future after part of the message was copied breaks the
    /// link (before that, the message simply stays queued for a later receive).
    fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.recv_inner(peer, tag, buf)
    }

    fn abort(&self, reason: AbortReason) {
        // The generation is over for this rank: its board no longer says where it is.
        self.inner.board.close();
        {
            let mut r = self.inner.abort.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                tracing::info!(rank = self.inner.rank, generation = self.inner.generation, %reason, "rdma transport aborted");
                *r = Some(reason);
            }
        }
        self.inner.aborted.store(true, Ordering::Release);
        for p in self.inner.peers.iter().flatten() {
            if let Err(e) = p.qp.to_error() {
                tracing::warn!(peer = p.rank, error = %e, "moving the queue pair to the error state failed");
            }
            p.wake();
        }
    }

    fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::Acquire)
            || self.inner.peers.iter().flatten().any(|p| p.lock().broken.is_some())
    }
}
