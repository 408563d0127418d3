//! One direction of a pair: a single-producer/single-consumer ring of fixed-size slots in the
//! shared segment, and the header every slot carries (pure layout and validation).
//!
//! Ring layout (offsets from the ring's start; each control word on its own cache line):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0   | 8 | `head`: slots published by the producer (written only by it) |
//! | 8   | 4 | `producer_cpu`: the CPU the producer last ran on, plus one (0: unknown; advisory) |
//! | 64  | 8 | `tail`: slots consumed by the consumer (written only by it) |
//! | 72  | 4 | `consumer_cpu`: the CPU the consumer last ran on, plus one (0: unknown; advisory) |
//! | 128 | 4 | `consumer_sleeping`: 1 while the consumer waits for a doorbell |
//! | 192 | 4 | `producer_sleeping`: 1 while the producer waits for a doorbell (for either lane) |
//! | 256 | 8 | `lane_tail`: messages of the small-message lane consumed (written only by the consumer) |
//! | 320 | `LANE_BYTES` | the small-message lane's cells (`shm/lane.rs`) |
//! | 320 + `LANE_BYTES` | `slots x slot_bytes` | the slots; slot `i` holds message chunk `i mod slots` |
//!
//! `consumer_sleeping` covers both lanes: the consumer sleeps waiting for either.
//!
//! Slot header (64 bytes, little-endian; payload follows):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0  | 4 | magic `"CHSM"` |
//! | 4  | 1 | version (`VERSION`, 2: the layout with the small-message lane) |
//! | 5  | 1 | kind: 1 = first chunk of a message, 2 = continuation |
//! | 6  | 2 | flags (0) |
//! | 8  | 8 | generation |
//! | 16 | 4 | tag seq |
//! | 20 | 4 | tag step |
//! | 24 | 4 | tag signature |
//! | 28 | 4 | chunk length |
//! | 32 | 8 | message length |
//! | 40 | 8 | offset of this chunk in the message |
//! | 48 | 16 | reserved (0) |
//!
//! Every value in the segment is written by the peer too, so it is untrusted: each side keeps
//! its own counter (the producer its head, the consumer its tail) as the truth and only reads
//! the other's, checking that the distance is within the ring; headers are copied out once and
//! validated before any length from them is used; payload copies are bounded by the slot.
//! The *order* of the peer's accesses is trusted: it writes a slot only between getting it
//! back and publishing it (`shm/protocol.rs`, model-checked), so no slot access of this side
//! races with one of the peer's (see `Ring::with_payload` for what that buys and costs).

use super::lane;
use crate::wire::{put_tag, tag_at, u32_at, u64_at};
use crate::Tag;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Bytes of the control words (before the lane).
pub(crate) const CONTROL_BYTES: usize = 320;
/// Offset of the first slot.
const SLOTS_AT: usize = CONTROL_BYTES + lane::LANE_BYTES;
/// Size of a slot header.
pub const SLOT_HEADER: usize = 64;
/// Magic opening every slot header.
pub(crate) const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"CHSM");
/// Layout version.
pub(crate) const VERSION: u8 = 2;
/// Slot kind: first chunk of a message.
pub const KIND_FIRST: u8 = 1;
/// Slot kind: a later chunk.
pub const KIND_CONT: u8 = 2;

/// Size of one ring with `slots` slots of `slot_bytes`.
pub(crate) fn ring_bytes(slots: u32, slot_bytes: usize) -> usize {
    SLOTS_AT + slots as usize * slot_bytes
}

/// A view of one ring inside a mapping. Copyable; the mapping must outlive it (the link
/// holds both).
#[derive(Clone, Copy)]
pub(crate) struct Ring {
    base: *mut u8,
    slots: u32,
    slot_bytes: usize,
}

// SAFETY: the ring points into a shared mapping that the owning link keeps alive; control
// words are accessed atomically and slot bytes only by the single producer or consumer.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    /// # Safety
    /// `base..base + ring_bytes(slots, slot_bytes)` must lie in a live, writable mapping that
    /// outlives the ring, aligned to 64 bytes; `slot_bytes` must exceed [`SLOT_HEADER`] and be
    /// a multiple of 64.
    pub(crate) unsafe fn new(base: *mut u8, slots: u32, slot_bytes: usize) -> Self {
        Self { base, slots, slot_bytes }
    }

    fn word64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is a 64-byte aligned offset inside the control block (see `new`).
        unsafe { &*self.base.add(at).cast::<AtomicU64>() }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is a 4-byte aligned offset inside the control block (see `new`).
        unsafe { &*self.base.add(at).cast::<AtomicU32>() }
    }

    /// Slots published by the producer.
    pub(crate) fn head(&self) -> &AtomicU64 {
        self.word64(0)
    }

    /// Slots consumed by the consumer.
    pub(crate) fn tail(&self) -> &AtomicU64 {
        self.word64(64)
    }

    /// The CPU the producer last ran on ([`crate::spin::encode_cpu`]); advisory: it only
    /// chooses how a waiting consumer spins (a peer may write anything here).
    pub(crate) fn producer_cpu(&self) -> &AtomicU32 {
        self.word32(8)
    }

    /// The CPU the consumer last ran on; advisory, like [`Ring::producer_cpu`].
    pub(crate) fn consumer_cpu(&self) -> &AtomicU32 {
        self.word32(72)
    }

    /// Set while the consumer sleeps waiting for data.
    pub(crate) fn consumer_sleeping(&self) -> &AtomicU32 {
        self.word32(128)
    }

    /// Set while the producer sleeps waiting for room.
    pub(crate) fn producer_sleeping(&self) -> &AtomicU32 {
        self.word32(192)
    }

    /// Messages of the small-message lane consumed by the consumer.
    pub(crate) fn lane_tail(&self) -> &AtomicU64 {
        self.word64(256)
    }

    /// The words of the lane's cell for message `n` (cell `n mod` [`lane::LANE_CELLS`]).
    pub(crate) fn lane_cell(&self, n: u64) -> &[AtomicU64] {
        let i = (n % u64::from(lane::LANE_CELLS)) as usize;
        // SAFETY: the cell lies inside the lane, inside the ring's mapping (see `new`),
        // 64-byte aligned; every access to it is atomic, so the peer's concurrent writes
        // are no data race.
        unsafe {
            std::slice::from_raw_parts(
                self.base.add(CONTROL_BYTES + i * lane::CELL_BYTES).cast::<AtomicU64>(),
                lane::CELL_WORDS,
            )
        }
    }

    /// Number of slots.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// Payload bytes per slot.
    pub(crate) fn capacity(&self) -> usize {
        self.slot_bytes - SLOT_HEADER
    }

    /// Pointer to slot number `n` (taken modulo the slot count).
    pub(crate) fn slot(&self, n: u64) -> *mut u8 {
        let i = (n % u64::from(self.slots)) as usize;
        // SAFETY: i < slots, so the slot lies inside the ring (see `new`).
        unsafe { self.base.add(SLOTS_AT + i * self.slot_bytes) }
    }

    /// Copies slot `n`'s header out of shared memory. The caller must own slot `n`, as for
    /// [`Ring::with_payload`].
    pub(crate) fn read_header(&self, n: u64) -> [u8; SLOT_HEADER] {
        let mut h = [0u8; SLOT_HEADER];
        // SAFETY: the slot holds at least SLOT_HEADER bytes; h is a local buffer; no write of
        // the peer races with the copy (the caller owns the slot: see `with_payload`).
        unsafe { std::ptr::copy_nonoverlapping(self.slot(n), h.as_mut_ptr(), SLOT_HEADER) };
        h
    }

    /// Writes a header and `payload` (at most [`Ring::capacity`] bytes) into slot `n`.
    pub(crate) fn write_slot(&self, n: u64, header: &[u8; SLOT_HEADER], payload: &[u8]) {
        assert!(payload.len() <= self.capacity(), "chunk larger than a slot");
        let p = self.slot(n);
        // SAFETY: header and payload fit in the slot (checked above); only this side writes
        // the slots of its outgoing ring, and only a slot that `protocol::room` saw released
        // (the peer's reads of it happen before this write).
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), p, SLOT_HEADER);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), p.add(SLOT_HEADER), payload.len());
        }
    }

    /// Lends `f` the first `len` (at most [`Ring::capacity`]) payload bytes of slot `n`, in
    /// place.
    ///
    /// The caller must own slot `n`: it is the ring's consumer, [`super::protocol::filled`]
    /// saw the slot published (an `Acquire` of the head) and the caller has not released it
    /// yet ([`super::protocol::release`], after this call returns).
    ///
    /// Why lending is sound, and on what it rests. A `&[u8]` asserts that nobody writes its
    /// bytes while it lives, and the compiler and `f` may rely on that (read a byte twice and
    /// assume it equal). The peer process maps the same memory and uses the same atomic
    /// instructions, so the memory model applies to it as to another thread of this program;
    /// then the protocol makes every access to the slot happen-before or -after the borrow:
    /// the producer's writes of it happen before the `Release` store of the head that this
    /// side's `Acquire` read, and the producer writes it again only after an `Acquire` of a
    /// tail that this side stores (`Release`) after `f` returns. No write races the borrow.
    ///
    /// This trusts the peer to follow the protocol's order (it is a process of the same job,
    /// which proved the job token at the handshake, running this code), not the values it
    /// writes (validated). A peer that wrote the slot during the borrow would be a data race:
    /// undefined behaviour. Copying the slot out through a raw pointer instead would not make
    /// it defined (a racing non-atomic read is a data race too), only confine its practical
    /// effect to the copied values; per-byte atomic reads would, at the cost of the in-place
    /// reduction this function exists for. docs/architecture.md ("Untrusted memory") states
    /// this threat model.
    pub(crate) fn with_payload<R>(&self, n: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        assert!(len <= self.capacity(), "chunk larger than a slot");
        // SAFETY: `len` bytes of payload lie inside the slot (checked above), in a live
        // mapping (see `new`); the caller owns the slot (see above), so no write of it races
        // with the borrow, which cannot outlive this call.
        let bytes = unsafe { std::slice::from_raw_parts(self.slot(n).add(SLOT_HEADER), len) };
        f(bytes)
    }
}

/// A decoded slot header. Public for the fuzz targets (`fuzz/bodies/shm_slot_header.rs`):
/// the header is read from memory the peer process writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHeader {
    /// [`KIND_FIRST`] or [`KIND_CONT`].
    pub kind: u8,
    /// The message's tag.
    pub tag: Tag,
    /// Bytes of payload in this slot.
    pub chunk: u32,
    /// Length of the whole message.
    pub total: u64,
    /// Offset of this chunk in the message.
    pub offset: u64,
}

impl SlotHeader {
    /// Encodes the header for `generation`.
    pub fn encode(&self, generation: u64) -> [u8; SLOT_HEADER] {
        let mut b = [0u8; SLOT_HEADER];
        b[0..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind;
        b[8..16].copy_from_slice(&generation.to_le_bytes());
        put_tag(&mut b, 16, self.tag);
        b[28..32].copy_from_slice(&self.chunk.to_le_bytes());
        b[32..40].copy_from_slice(&self.total.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b
    }

    /// Decodes and validates a header copied out of shared memory: magic, version, kind,
    /// zero flags and reserved bytes, the link's generation, a message length within
    /// `max_message`, and a chunk that fits both the slot (`capacity`) and the message.
    pub fn decode(b: &[u8; SLOT_HEADER], generation: u64, max_message: u64, capacity: usize) -> Result<Self, String> {
        let magic = u32_at(b, 0);
        if magic != SLOT_MAGIC {
            return Err(format!("bad slot magic {magic:#010x}"));
        }
        if b[4] != VERSION {
            return Err(format!("unsupported slot version {} (ours {VERSION})", b[4]));
        }
        let kind = b[5];
        if kind != KIND_FIRST && kind != KIND_CONT {
            return Err(format!("unknown slot kind {kind}"));
        }
        if b[6] != 0 || b[7] != 0 || b[48..].iter().any(|&x| x != 0) {
            return Err("reserved slot header bits set".into());
        }
        let theirs = u64_at(b, 8);
        if theirs != generation {
            return Err(format!("slot from generation {theirs} on a generation {generation} link"));
        }
        let tag = tag_at(b, 16);
        let chunk = u32_at(b, 28);
        let total = u64_at(b, 32);
        let offset = u64_at(b, 40);
        if total > max_message {
            return Err(format!("message length {total} exceeds the maximum of {max_message} bytes"));
        }
        // The chunk must be exactly what the sender's chunking produces: full slots until the
        // last one. Anything else is nonsense, never a short read to wait out.
        let expected = total.checked_sub(offset).map(|rest| rest.min(capacity as u64));
        if expected != Some(u64::from(chunk)) || (chunk == 0 && total != 0) {
            return Err(format!(
                "slot chunk of {chunk} bytes at offset {offset} of a {total}-byte message (slot payload {capacity})"
            ));
        }
        if (kind == KIND_FIRST) != (offset == 0) {
            return Err(format!("slot kind {kind} at message offset {offset}"));
        }
        Ok(Self { kind, tag, chunk, total, offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(total: u64, chunk: u32) -> SlotHeader {
        SlotHeader { kind: KIND_FIRST, tag: Tag::new(3, 4, 5), chunk, total, offset: 0 }
    }

    #[test]
    fn headers_round_trip() {
        let h = first(100, 100);
        assert_eq!(SlotHeader::decode(&h.encode(7), 7, 1 << 20, 4096), Ok(h));
        let c = SlotHeader { kind: KIND_CONT, tag: Tag::new(3, 4, 5), chunk: 904, total: 5000, offset: 4096 };
        assert_eq!(SlotHeader::decode(&c.encode(7), 7, 1 << 20, 4096), Ok(c));
        let empty = first(0, 0);
        assert_eq!(SlotHeader::decode(&empty.encode(7), 7, 1 << 20, 4096), Ok(empty));
    }

    #[test]
    fn garbage_headers_are_refused() {
        let good = first(5000, 4096).encode(7);
        type Corrupt = Box<dyn Fn(&mut [u8; SLOT_HEADER])>;
        let cases: Vec<(Corrupt, &str)> = vec![
            (Box::new(|b| b[0] ^= 1), "magic"),
            (Box::new(|b| b[4] = 9), "version"),
            (Box::new(|b| b[5] = 3), "kind"),
            (Box::new(|b| b[6] = 1), "reserved"),
            (Box::new(|b| b[60] = 1), "reserved"),
            (Box::new(|b| b[8] = 8), "generation"),
            (Box::new(|b| b[32..40].copy_from_slice(&u64::MAX.to_le_bytes())), "exceeds"),
            (Box::new(|b| b[28..32].copy_from_slice(&5000u32.to_le_bytes())), "chunk"),
            (Box::new(|b| b[28..32].copy_from_slice(&100u32.to_le_bytes())), "chunk"),
            (Box::new(|b| b[40..48].copy_from_slice(&6000u64.to_le_bytes())), "chunk"),
            (Box::new(|b| b[40..48].copy_from_slice(&904u64.to_le_bytes())), "kind"),
        ];
        for (corrupt, what) in cases {
            let mut b = good;
            corrupt(&mut b);
            let e = SlotHeader::decode(&b, 7, 1 << 20, 4096).expect_err(what);
            assert!(e.contains(what), "{what}: {e}");
        }
        let rnd: [u8; SLOT_HEADER] = std::array::from_fn(|i| (i as u8).wrapping_mul(37));
        assert!(SlotHeader::decode(&rnd, 7, 1 << 20, 4096).is_err());
    }
}
