//! One peer of a mesh: its queue pair, receive ring and send staging, and what arrives on
//! the link (segments, reassembly, early messages, credits).

use super::address::RdmaAddress;
use super::credits::{Reassembly, RecvRing, SendWindow};
use super::late::PeerProbe;
use super::memory::PooledBuffer;
use super::qp::QueuePair;
use super::wire::{DataImm, SegmentHeader, SEGMENT_HEADER_LEN};
use crate::wire::{channel_of, seq_older};
use crate::{Rank, TransportError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;
use tokio::time::Instant;

/// The segment header's length, as work requests count bytes.
pub(super) const HDR: u32 = SEGMENT_HEADER_LEN as u32;
/// Work request ids: the kind in the top byte, the slot (for writes) below.
pub(super) const WR_RECV: u64 = 1 << 56;
pub(super) const WR_WRITE: u64 = 2 << 56;
pub(super) const WR_CREDIT: u64 = 3 << 56;
pub(super) const WR_KIND_MASK: u64 = 0xff << 56;
/// Per peer: most early messages copied out of the ring at once (bounds the bookkeeping of
/// empty messages, which cost no bytes).
const MAX_STAGED_MESSAGES: u32 = 4096;

/// A message (or part of one) that arrived for a tag.
#[derive(Debug)]
pub(super) struct Inbound {
    pub(super) signature: u32,
    pub(super) reasm: Reassembly,
    /// A receive is registered for this tag.
    pub(super) waiting: bool,
    /// Copies of early segments, from offset 0 to `heap_len`.
    pub(super) heap: Option<Vec<u8>>,
    pub(super) heap_len: u64,
    /// Bytes of `heap` already copied to the receiver.
    pub(super) heap_copied: u64,
    /// Segments still in their slot: (slot, offset, length).
    pub(super) in_slot: Vec<(u32, u64, u32)>,
    /// Whether any byte has gone to the receiver's buffer.
    pub(super) touched: bool,
    /// Whether a header for it has arrived (a waiting receive creates the entry first).
    pub(super) seen: bool,
}

impl Inbound {
    pub(super) fn new() -> Self {
        Self {
            signature: 0,
            reasm: Reassembly::new(0),
            waiting: false,
            heap: None,
            heap_len: 0,
            heap_copied: 0,
            in_slot: Vec::new(),
            touched: false,
            seen: false,
        }
    }
}

pub(super) struct PeerState {
    pub(super) window: SendWindow,
    pub(super) ring: RecvRing,
    pub(super) inbound: HashMap<(u32, u32), Inbound>,
    pub(super) broken: Option<TransportError>,
    pub(super) last_progress: Instant,
    pub(super) staged_bytes: u64,
    /// Early messages copied out of the ring, waiting for their receive.
    pub(super) staged_msgs: u32,
    /// Credits owed to the peer that could not be posted yet (send queue budget).
    pub(super) credit_backlog: u32,
    /// Credit sends posted and not yet completed.
    pub(super) credit_sends: u32,
}

pub(super) struct Peer {
    pub(super) rank: Rank,
    // Declared before the buffers: the QP is destroyed before they go back to the pool.
    pub(super) qp: Arc<QueuePair>,
    pub(super) state: Mutex<PeerState>,
    pub(super) ring: PooledBuffer,
    pub(super) staging: PooledBuffer,
    pub(super) remote: RdmaAddress,
    pub(super) local_slot_bytes: u32,
    pub(super) wake: watch::Sender<u64>,
    pub(super) send_lock: tokio::sync::Mutex<()>,
    /// Where the peer's process is asked where it is (with learning on; see [`super::late`]).
    pub(super) liveness: Option<PeerProbe>,
}

impl Peer {
    pub(super) fn lock(&self) -> MutexGuard<'_, PeerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn wake(&self) {
        self.wake.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Breaks the link (first error wins), moves the QP to error so the peer notices, and
    /// wakes every waiter.
    pub(super) fn fail(&self, st: &mut PeerState, e: TransportError) -> TransportError {
        if st.broken.is_none() {
            tracing::warn!(peer = self.rank, error = %e, "rdma link failed");
            st.broken = Some(e);
            let _ = self.qp.to_error();
        }
        self.wake();
        st.broken.clone().unwrap_or_else(|| TransportError::Io("link failed".into()))
    }

    pub(super) fn protocol(&self, st: &mut PeerState, detail: String) -> TransportError {
        let e = TransportError::Protocol { peer: self.rank, detail };
        self.fail(st, e)
    }

    /// Sends owed credits, within a budget of in-flight credit sends.
    pub(super) fn flush_credits(&self, st: &mut PeerState, more: Option<u32>) {
        st.credit_backlog += more.unwrap_or(0);
        let budget = st.ring.slots();
        if st.credit_backlog == 0 || st.credit_sends >= budget || st.broken.is_some() {
            return;
        }
        let n = std::mem::take(&mut st.credit_backlog);
        match self.qp.post_send_imm(WR_CREDIT, n) {
            Ok(()) => st.credit_sends += 1,
            Err(e) => {
                self.fail(st, e);
            }
        }
    }

    /// The oldest seq a receive waits for on this link on `channel` (a communicator's: see
    /// [`crate::subgroup`]).
    pub(super) fn oldest_waiting(st: &PeerState, channel: u32) -> Option<u32> {
        st.inbound.iter().filter(|(k, e)| e.waiting && channel_of(k.0) == channel).map(|(k, _)| k.0).reduce(|a, b| {
            if seq_older(b, a) {
                b
            } else {
                a
            }
        })
    }

    /// Handles the arrival of a data segment announced by `imm`.
    pub(super) fn on_data(&self, st: &mut PeerState, imm: u32, generation: u64, max_message: u64, max_unexpected: u64) {
        let imm = DataImm::from_u32(imm);
        let slot = u32::from(imm.slot);
        if let Err(e) = st.ring.arrive(slot) {
            self.protocol(st, e.to_string());
            return;
        }
        let base = (slot * self.local_slot_bytes) as usize;
        let mut raw = [0u8; SEGMENT_HEADER_LEN];
        if let Err(e) = self.ring.read_at(base, &mut raw) {
            self.fail(st, e);
            return;
        }
        let h = match SegmentHeader::decode(&raw, imm, generation, max_message, self.local_slot_bytes - HDR) {
            Ok(h) => h,
            Err(e) => {
                self.protocol(st, e.to_string());
                return;
            }
        };
        let key = (h.tag.seq, h.tag.step);
        if !st.inbound.contains_key(&key) {
            if let Some(oldest) = Self::oldest_waiting(st, channel_of(h.tag.seq)) {
                if seq_older(h.tag.seq, oldest) {
                    let d = format!(
                        "stale segment seq {} step {} (the oldest message still expected is seq {oldest})",
                        h.tag.seq, h.tag.step
                    );
                    self.protocol(st, d);
                    return;
                }
            }
        }
        let entry = st.inbound.entry(key).or_insert_with(Inbound::new);
        if !entry.seen {
            entry.seen = true;
            entry.signature = h.tag.signature;
            entry.reasm = Reassembly::new(h.total);
        } else if entry.signature != h.tag.signature || entry.reasm.total() != h.total {
            let d =
                format!("segment of seq {} step {} changes the message's signature or length", h.tag.seq, h.tag.step);
            self.protocol(st, d);
            return;
        }
        if let Err(e) = entry.reasm.accept(h.offset, u64::from(h.seg_len)) {
            self.protocol(st, e.to_string());
            return;
        }
        let first = h.offset == 0;
        let stage = !entry.waiting
            && (entry.heap.is_some()
                || (first
                    && st.staged_msgs < MAX_STAGED_MESSAGES
                    && st.staged_bytes.saturating_add(h.total) <= max_unexpected))
            && entry.in_slot.is_empty();
        if stage {
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            if entry.heap.is_none() {
                // Bounded by max_unexpected (checked above) and max_message (header check).
                entry.heap = Some(vec![0u8; h.total as usize]);
                st.staged_bytes += h.total;
                st.staged_msgs += 1;
            }
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            let heap = entry.heap.as_mut().expect("heap allocated above");
            let (off, len) = (h.offset as usize, h.seg_len as usize);
            if let Err(e) = self.ring.read_at(base + SEGMENT_HEADER_LEN, &mut heap[off..off + len]) {
                self.fail(st, e);
                return;
            }
            entry.heap_len = h.offset + u64::from(h.seg_len);
            if let Err(e) = st.ring.release(slot) {
                self.protocol(st, e.to_string());
                return;
            }
            let owed = st.ring.take_credits(false);
            self.flush_credits(st, owed);
        } else {
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            entry.in_slot.push((slot, h.offset, h.seg_len));
        }
    }
}
