//! Credit-based flow control over a ring of receive slots (pure, sans-IO).
//!
//! Each receiver registers, per peer and once per generation, a ring of `N` slots of `S`
//! bytes. The sender writes each segment into the next slot of the ring, in ring order, with
//! an RDMA write with immediate. It may only write a slot it holds a *credit* for: it starts
//! with `N` credits, spends one per segment, and gets them back when the receiver returns
//! them. The receiver returns a slot's credit once it has consumed the slot *and* every
//! earlier slot, so the sender's next slot is always free when it holds a credit.
//!
//! [`SendWindow`] is the sender's book (credits plus which of its local staging slots still
//! have a write in flight), [`RecvRing`] the receiver's (which slots have arrived, which
//! are consumed, how many credits are owed back), [`segments`] cuts a message into
//! slot-sized pieces and [`Reassembly`] checks that they arrive whole and in order. None of
//! them does I/O; the transport drives them from completions, and the tests below drive them
//! from random schedules.

/// A violation of the credit protocol (by the peer, or a bookkeeping bug).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreditError {
    /// The peer returned more credits than it holds slots for.
    #[error("peer returned {returned} credits but only {outstanding} slots are outstanding")]
    OverGrant {
        /// Credits in the return.
        returned: u32,
        /// Slots written and not yet returned.
        outstanding: u32,
    },
    /// A slot index outside the ring.
    #[error("slot {slot} outside a ring of {slots}")]
    SlotRange {
        /// The slot.
        slot: u32,
        /// Ring size.
        slots: u32,
    },
    /// A write landed in another slot than the next one in ring order.
    #[error("write into slot {got}, expected slot {expected}")]
    OutOfOrder {
        /// The next slot in ring order.
        expected: u32,
        /// The slot written.
        got: u32,
    },
    /// The peer wrote without holding a credit (it would overwrite unconsumed data).
    #[error("write into slot {0} without a credit (ring overrun)")]
    Overrun(u32),
    /// A slot released that holds no unconsumed data.
    #[error("slot {0} released twice or before it arrived")]
    BadRelease(u32),
    /// A local completion for a slot with no write in flight.
    #[error("local completion for slot {0}, which has no write in flight")]
    BadCompletion(u32),
    /// A segment that does not continue its message.
    #[error("segment at offset {offset} of {len} bytes does not continue a message of {total} bytes with {received} received")]
    BadSegment {
        /// Offset of the segment.
        offset: u64,
        /// Length of the segment.
        len: u64,
        /// Announced message length.
        total: u64,
        /// Bytes received so far.
        received: u64,
    },
}

/// The sender's view of one peer's ring.
#[derive(Debug, Clone)]
pub struct SendWindow {
    slots: u32,
    next: u32,
    credits: u32,
    /// Per local staging slot: an RDMA write from it has not completed yet.
    busy: Vec<bool>,
}

impl SendWindow {
    /// A window onto a ring of `slots` slots (at least 1), all credited.
    pub fn new(slots: u32) -> Self {
        let slots = slots.max(1);
        Self { slots, next: 0, credits: slots, busy: vec![false; slots as usize] }
    }

    /// Ring size.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Credits held now.
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// Writes posted whose local completion has not been seen.
    pub fn in_flight(&self) -> u32 {
        self.busy.iter().filter(|b| **b).count() as u32
    }

    /// Takes the next slot if a credit is held and the slot's previous write has completed
    /// locally; the caller must then post exactly one write into that slot.
    pub fn try_acquire(&mut self) -> Option<u32> {
        let slot = self.next;
        if self.credits == 0 || self.busy[slot as usize] {
            return None;
        }
        self.credits -= 1;
        self.busy[slot as usize] = true;
        self.next = (slot + 1) % self.slots;
        Some(slot)
    }

    /// Records the local completion of the write from `slot` (its staging memory is free).
    pub fn complete_local(&mut self, slot: u32) -> Result<(), CreditError> {
        match self.busy.get_mut(slot as usize) {
            None => Err(CreditError::SlotRange { slot, slots: self.slots }),
            Some(b) if !*b => Err(CreditError::BadCompletion(slot)),
            Some(b) => {
                *b = false;
                Ok(())
            }
        }
    }

    /// Adds `n` credits returned by the receiver.
    pub fn grant(&mut self, n: u32) -> Result<(), CreditError> {
        let outstanding = self.slots - self.credits;
        if n > outstanding {
            return Err(CreditError::OverGrant { returned: n, outstanding });
        }
        self.credits += n;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Not holding unconsumed data.
    Empty,
    /// Written by the peer, not yet consumed.
    Arrived,
    /// Consumed, but an earlier slot is still unconsumed, so its credit cannot go back yet.
    Released,
}

/// The receiver's view of its ring for one peer.
#[derive(Debug, Clone)]
pub struct RecvRing {
    slots: u32,
    state: Vec<SlotState>,
    /// Next slot the peer must write.
    next_arrival: u32,
    /// Oldest slot whose credit has not been released yet.
    head: u32,
    /// Credits the peer holds: writes it may still make.
    peer_credits: u32,
    /// Credits released and not yet returned to the peer.
    owed: u32,
    /// Return credits once this many are owed.
    threshold: u32,
}

impl RecvRing {
    /// A ring of `slots` slots (at least 1) that returns credits in batches of
    /// `threshold` (clamped to `1..=slots`).
    pub fn new(slots: u32, threshold: u32) -> Self {
        let slots = slots.max(1);
        Self {
            slots,
            state: vec![SlotState::Empty; slots as usize],
            next_arrival: 0,
            head: 0,
            peer_credits: slots,
            owed: 0,
            threshold: threshold.clamp(1, slots),
        }
    }

    /// Ring size.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Slots holding unconsumed data.
    pub fn occupied(&self) -> u32 {
        self.state.iter().filter(|s| **s == SlotState::Arrived).count() as u32
    }

    /// Records the peer's write into `slot`: it must be the next slot in ring order and the
    /// peer must hold a credit for it.
    pub fn arrive(&mut self, slot: u32) -> Result<(), CreditError> {
        if slot >= self.slots {
            return Err(CreditError::SlotRange { slot, slots: self.slots });
        }
        if slot != self.next_arrival {
            return Err(CreditError::OutOfOrder { expected: self.next_arrival, got: slot });
        }
        if self.peer_credits == 0 || self.state[slot as usize] != SlotState::Empty {
            return Err(CreditError::Overrun(slot));
        }
        self.peer_credits -= 1;
        self.state[slot as usize] = SlotState::Arrived;
        self.next_arrival = (slot + 1) % self.slots;
        Ok(())
    }

    /// Marks `slot` consumed; credits for the consumed prefix of the ring become owed.
    pub fn release(&mut self, slot: u32) -> Result<(), CreditError> {
        match self.state.get(slot as usize) {
            None => return Err(CreditError::SlotRange { slot, slots: self.slots }),
            Some(SlotState::Arrived) => self.state[slot as usize] = SlotState::Released,
            Some(_) => return Err(CreditError::BadRelease(slot)),
        }
        while self.state[self.head as usize] == SlotState::Released {
            self.state[self.head as usize] = SlotState::Empty;
            self.owed += 1;
            self.head = (self.head + 1) % self.slots;
        }
        Ok(())
    }

    /// Credits to send back now, if the batch threshold is reached (or, with `force`, if
    /// any are owed). The caller must deliver the returned count to the peer.
    pub fn take_credits(&mut self, force: bool) -> Option<u32> {
        if self.owed >= self.threshold || (force && self.owed > 0) {
            let n = self.owed;
            self.owed = 0;
            self.peer_credits += n;
            Some(n)
        } else {
            None
        }
    }
}

/// Cuts a message of `total` bytes into `(offset, len)` pieces of at most `per_slot` bytes
/// (at least 1). A message of zero bytes is one empty piece, so that it still arrives.
pub fn segments(total: u64, per_slot: u32) -> impl Iterator<Item = (u64, u32)> {
    let per = u64::from(per_slot.max(1));
    let count = if total == 0 { 1 } else { total.div_ceil(per) };
    (0..count).map(move |i| {
        let off = i * per;
        // min(per, ...) fits in u32 because per does.
        (off, (total - off).min(per) as u32)
    })
}

/// Checks that the pieces of one message arrive whole and in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reassembly {
    total: u64,
    received: u64,
    started: bool,
}

impl Reassembly {
    /// Expects a message of `total` bytes.
    pub fn new(total: u64) -> Self {
        Self { total, received: 0, started: false }
    }

    /// Announced length.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Whether every byte has arrived (an empty message is complete after its one piece).
    pub fn is_complete(&self) -> bool {
        self.started && self.received == self.total
    }

    /// Accepts the piece at `offset` of `len` bytes; returns whether the message is now
    /// complete.
    pub fn accept(&mut self, offset: u64, len: u64) -> Result<bool, CreditError> {
        let bad = CreditError::BadSegment { offset, len, total: self.total, received: self.received };
        if self.is_complete() || offset != self.received || (len == 0 && self.total != 0) {
            return Err(bad);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.total => {
                self.received = end;
                self.started = true;
                Ok(self.is_complete())
            }
            _ => Err(bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::VecDeque;

    #[test]
    fn segments_cover_the_message_exactly() {
        assert_eq!(segments(0, 10).collect::<Vec<_>>(), vec![(0, 0)]);
        assert_eq!(segments(10, 10).collect::<Vec<_>>(), vec![(0, 10)]);
        assert_eq!(segments(25, 10).collect::<Vec<_>>(), vec![(0, 10), (10, 10), (20, 5)]);
        for total in [1u64, 7, 4095, 4096, 4097, 1 << 20] {
            let mut r = Reassembly::new(total);
            let mut done = false;
            for (off, len) in segments(total, 4096) {
                assert!(!done);
                done = r.accept(off, u64::from(len)).unwrap();
            }
            assert!(done && r.is_complete());
        }
    }

    #[test]
    fn reassembly_rejects_gaps_overlaps_and_overflow() {
        let mut r = Reassembly::new(100);
        assert!(r.accept(10, 10).is_err());
        assert_eq!(r.accept(0, 60), Ok(false));
        assert!(r.accept(50, 10).is_err());
        assert!(r.accept(60, 41).is_err());
        assert!(r.accept(60, 0).is_err());
        assert_eq!(r.accept(60, 40), Ok(true));
        assert!(r.accept(100, 0).is_err());
        let mut e = Reassembly::new(0);
        assert!(!e.is_complete());
        assert_eq!(e.accept(0, 0), Ok(true));
        assert!(e.accept(0, 0).is_err());
        assert!(Reassembly::new(u64::MAX).accept(0, u64::MAX).is_ok());
        let mut big = Reassembly::new(10);
        assert!(big.accept(0, u64::MAX).is_err());
    }

    #[test]
    fn window_needs_credit_and_local_completion() {
        let mut w = SendWindow::new(2);
        assert_eq!(w.try_acquire(), Some(0));
        assert_eq!(w.try_acquire(), Some(1));
        assert_eq!(w.try_acquire(), None);
        assert_eq!(w.grant(3), Err(CreditError::OverGrant { returned: 3, outstanding: 2 }));
        w.grant(1).unwrap();
        // Credit is back but slot 0's write has not completed locally.
        assert_eq!(w.try_acquire(), None);
        w.complete_local(0).unwrap();
        assert_eq!(w.complete_local(0), Err(CreditError::BadCompletion(0)));
        assert_eq!(w.try_acquire(), Some(0));
        assert_eq!(w.complete_local(5), Err(CreditError::SlotRange { slot: 5, slots: 2 }));
    }

    #[test]
    fn ring_detects_overrun_disorder_and_bad_release() {
        let mut r = RecvRing::new(2, 2);
        assert_eq!(r.arrive(1), Err(CreditError::OutOfOrder { expected: 0, got: 1 }));
        r.arrive(0).unwrap();
        r.arrive(1).unwrap();
        // A third write without any credit returned is an overrun.
        assert_eq!(r.arrive(0), Err(CreditError::Overrun(0)));
        assert_eq!(r.release(3), Err(CreditError::SlotRange { slot: 3, slots: 2 }));
        r.release(1).unwrap();
        // Slot 1 consumed before slot 0: nothing owed yet.
        assert_eq!(r.take_credits(true), None);
        assert_eq!(r.release(1), Err(CreditError::BadRelease(1)));
        r.release(0).unwrap();
        assert_eq!(r.take_credits(false), Some(2));
        r.arrive(0).unwrap();
        r.release(0).unwrap();
        assert_eq!(r.take_credits(false), None, "below the batch threshold");
        assert_eq!(r.take_credits(true), Some(1));
    }

    /// Drives a sender and a receiver through random interleavings of every event (posting,
    /// local completion, delivery, consumption in a random order, credit returns) and checks
    /// the invariants: the sender never writes a slot holding unconsumed data, segments are
    /// delivered whole and in order, memory stays within the ring, and every credit comes
    /// back at the end.
    #[test]
    fn random_schedules_never_overrun_and_return_every_credit() {
        for seed in 0..300u64 {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let slots = rng.random_range(1..=8u32);
            let slot_bytes = rng.random_range(1..=16u32);
            let threshold = rng.random_range(1..=slots);
            let mut w = SendWindow::new(slots);
            let mut r = RecvRing::new(slots, threshold);
            // Messages to send: (id, length).
            let msgs: Vec<(u32, u64)> =
                (0..rng.random_range(1..20u32)).map(|i| (i, rng.random_range(0..64u64))).collect();
            let mut to_send: VecDeque<(u32, u64, u32)> = VecDeque::new();
            for &(id, len) in &msgs {
                for (off, l) in segments(len, slot_bytes) {
                    to_send.push_back((id, off, l));
                }
            }
            let total_segments = to_send.len();
            // Contents of the receiver's ring: what sits in each slot.
            let mut ring: Vec<Option<(u32, u64, u32)>> = vec![None; slots as usize];
            let mut wire: VecDeque<u32> = VecDeque::new(); // slots written, in order
            let mut local_pending: VecDeque<u32> = VecDeque::new(); // writes awaiting local completion
            let mut credit_wire: VecDeque<u32> = VecDeque::new();
            let mut arrived: Vec<u32> = Vec::new(); // slots arrived, unconsumed
            let mut delivered: Vec<(u32, u64, u32)> = Vec::new();
            let mut steps = 0;
            while delivered.len() < total_segments || !credit_wire.is_empty() || !local_pending.is_empty() {
                steps += 1;
                assert!(steps < 100_000, "seed {seed}: no progress (deadlock)");
                match rng.random_range(0..6) {
                    0 => {
                        if let Some(&seg) = to_send.front() {
                            if let Some(slot) = w.try_acquire() {
                                to_send.pop_front();
                                assert!(ring[slot as usize].is_none(), "seed {seed}: overwrote unconsumed slot {slot}");
                                ring[slot as usize] = Some(seg);
                                wire.push_back(slot);
                                local_pending.push_back(slot);
                            }
                        }
                    }
                    1 => {
                        if let Some(slot) = local_pending.pop_front() {
                            w.complete_local(slot).unwrap();
                        }
                    }
                    2 => {
                        if let Some(slot) = wire.pop_front() {
                            r.arrive(slot).unwrap();
                            arrived.push(slot);
                        }
                    }
                    3 | 4 => {
                        if !arrived.is_empty() {
                            let i = rng.random_range(0..arrived.len());
                            let slot = arrived.remove(i);
                            let seg = ring[slot as usize].take().expect("arrived slot holds data");
                            delivered.push(seg);
                            r.release(slot).unwrap();
                            let force = rng.random_bool(0.2) || (arrived.is_empty() && wire.is_empty());
                            if let Some(n) = r.take_credits(force) {
                                credit_wire.push_back(n);
                            }
                        }
                    }
                    _ => {
                        if let Some(n) = credit_wire.pop_front() {
                            w.grant(n).unwrap();
                        }
                    }
                }
                assert!(r.occupied() <= slots);
            }
            // Everything delivered once; per message in order when sorted by arrival of slots.
            delivered.sort_by_key(|&(id, off, _)| (id, off));
            let mut expect: Vec<(u32, u64, u32)> = Vec::new();
            for &(id, len) in &msgs {
                expect.extend(segments(len, slot_bytes).map(|(o, l)| (id, o, l)));
            }
            assert_eq!(delivered, expect, "seed {seed}");
            if let Some(n) = r.take_credits(true) {
                w.grant(n).unwrap();
            }
            assert_eq!(w.credits(), slots, "seed {seed}: every credit returns");
            assert_eq!(w.in_flight(), 0);
        }
    }

    #[test]
    fn in_order_consumption_reassembles_every_message() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(99);
        let slots = 4;
        let per = 8;
        let mut w = SendWindow::new(slots);
        let mut r = RecvRing::new(slots, 2);
        let lens: Vec<u64> = (0..50).map(|_| rng.random_range(0..100)).collect();
        let mut queue: VecDeque<(usize, u64, u32)> = VecDeque::new();
        for (i, &len) in lens.iter().enumerate() {
            queue.extend(segments(len, per).map(|(o, l)| (i, o, l)));
        }
        let mut current: Option<(usize, Reassembly)> = None;
        let mut completed = 0;
        let mut ring: Vec<Option<(usize, u64, u32)>> = vec![None; slots as usize];
        while let Some(seg) = queue.pop_front() {
            let slot = loop {
                if let Some(s) = w.try_acquire() {
                    break s;
                }
                // Receiver side: nothing to do but return what is owed.
                let n = r.take_credits(true).expect("a stalled sender is owed credits");
                w.grant(n).unwrap();
            };
            ring[slot as usize] = Some(seg);
            w.complete_local(slot).unwrap();
            r.arrive(slot).unwrap();
            let (id, off, len) = ring[slot as usize].take().unwrap();
            let re = match &mut current {
                Some((cid, re)) if *cid == id => re,
                _ => {
                    current = Some((id, Reassembly::new(lens[id])));
                    &mut current.as_mut().unwrap().1
                }
            };
            if re.accept(off, u64::from(len)).unwrap() {
                completed += 1;
            }
            r.release(slot).unwrap();
            if let Some(n) = r.take_credits(false) {
                w.grant(n).unwrap();
            }
        }
        assert_eq!(completed, lens.len());
    }
}
