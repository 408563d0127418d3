//! Rules of the wire every transport keeps alike (TCP, shared memory, RDMA): what names a
//! message ([`Rank`], [`Tag`]), the order of operation sequence numbers, how much a link holds
//! for receivers that have not asked yet, and the reading of the fields every data header
//! shares.

/// A rank within one generation: `0..world_size`.
pub type Rank = u32;

/// Identifies one message between a pair of ranks.
///
/// `seq` is the communicator's operation sequence number (one per collective call, increasing,
/// wrapping within [`SEQ_BITS`] bits) with the communicator's channel in the bits above (0 for
/// a generation's own communicator, see [`channel_of`] and `crate::subgroup`); `step` numbers
/// the messages within that operation; `signature` is a hash of what the
/// collective was called with (kind, dtype, op, count, root) so that ranks that disagree are
/// told so instead of reducing garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    /// Operation sequence number on the communicator.
    pub seq: u32,
    /// Message number within the operation.
    pub step: u32,
    /// Hash of the collective's arguments; must match on both sides.
    pub signature: u32,
}

impl Tag {
    /// A tag for message `step` of operation `seq` with the given call signature.
    pub fn new(seq: u32, step: u32, signature: u32) -> Self {
        Self { seq, step, signature }
    }
}

/// Most bytes of out-of-order frames a link holds for receivers that have not asked yet;
/// beyond it the link fails with a protocol error instead of growing.
pub const STASH_BUDGET: usize = 64 << 20;

/// Most out-of-order frames a link holds.
pub const STASH_MAX_FRAMES: usize = 1024;

/// Steps from here up are point-to-point messages (ordered per pair, sharing the sequence
/// number of the next collective, under a signature of their own); below it, the messages of
/// one collective operation.
pub const P2P_STEP_BASE: u32 = 1 << 31;

/// Whether a message tagged `got`, arriving while a receiver waits for `want`, shows that
/// the two ranks are in different calls: the same operation (`seq`), both collective steps,
/// and another call signature. Every message of one collective carries its call's signature,
/// so such a message is never one to stash for later: a link reports it at once as a
/// mismatch, instead of stashing it and waiting for a message that will never come (ranks
/// calling different collectives may not send the steps the other expects).
pub fn other_call(want: Tag, got: Tag) -> bool {
    got.seq == want.seq && got.signature != want.signature && want.step < P2P_STEP_BASE && got.step < P2P_STEP_BASE
}

/// Bits of [`Tag::seq`] that number a communicator's operations; the bits above carry its
/// channel, so that communicators sharing one link (a generation's own and its subgroups',
/// `crate::subgroup`) never take each other's messages for their own. A communicator's
/// numbers wrap within these bits, which is safe: operations of one communicator are ordered,
/// and links compare numbers in wrapping order.
pub const SEQ_BITS: u32 = 20;

/// The part of [`Tag::seq`] that numbers operations.
pub const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;

/// The largest channel: channels are `0..=MAX_CHANNEL`, 0 being a generation's own
/// communicator.
pub const MAX_CHANNEL: u32 = u32::MAX >> SEQ_BITS;

/// The channel a sequence number belongs to.
pub fn channel_of(seq: u32) -> u32 {
    seq >> SEQ_BITS
}

/// The sequence number of operation `n` (taken modulo 2^[`SEQ_BITS`]) on `channel`.
pub fn seq_on(channel: u32, n: u32) -> u32 {
    (channel << SEQ_BITS) | (n & SEQ_MASK)
}

/// `a` is older than `b`: both on one channel, and `a` earlier in wrapping order within it.
/// Numbers of different channels are never older than each other.
pub fn seq_older(a: u32, b: u32) -> bool {
    channel_of(a) == channel_of(b) && ((a.wrapping_sub(b) << (32 - SEQ_BITS)) as i32) < 0
}

/// The little-endian `u32` at `at` of a fixed-size header (the offset is a constant of its
/// layout, inside the array).
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian `u64` at `at` of a fixed-size header.
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// The tag at `at` of a fixed-size header: seq, step and signature, `u32` LE each (bytes
/// 16..28 of every data header: TCP frame, shared-memory slot, RDMA segment).
pub(crate) fn tag_at(b: &[u8], at: usize) -> Tag {
    Tag { seq: u32_at(b, at), step: u32_at(b, at + 4), signature: u32_at(b, at + 8) }
}

/// Writes `tag` at `at` of a header, as [`tag_at`] reads it.
pub(crate) fn put_tag(b: &mut [u8], at: usize, tag: Tag) {
    b[at..at + 4].copy_from_slice(&tag.seq.to_le_bytes());
    b[at + 4..at + 8].copy_from_slice(&tag.step.to_le_bytes());
    b[at + 8..at + 12].copy_from_slice(&tag.signature.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_call_is_seen_across_steps_but_not_across_operations_or_p2p() {
        let want = Tag::new(7, 3, 0xaaaa);
        assert!(other_call(want, Tag::new(7, 0, 0xbbbb)), "same op, another step, another call");
        assert!(other_call(want, Tag::new(7, 3, 0xbbbb)));
        assert!(!other_call(want, Tag::new(7, 0, 0xaaaa)), "same call, a later step: stash it");
        assert!(!other_call(want, Tag::new(8, 0, 0xbbbb)), "the next operation: stash it");
        assert!(!other_call(want, Tag::new(7, P2P_STEP_BASE, 0xbbbb)), "a send/recv sharing the seq");
        assert!(!other_call(Tag::new(7, P2P_STEP_BASE + 2, 0xaaaa), Tag::new(7, 0, 0xbbbb)));
    }

    #[test]
    fn header_fields_read_back_what_was_written() {
        let mut b = [0u8; 40];
        b[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
        put_tag(&mut b, 16, Tag::new(1, u32::MAX, 0xdead_beef));
        assert_eq!(u64_at(&b, 8), 0x0102_0304_0506_0708);
        assert_eq!(tag_at(&b, 16), Tag::new(1, u32::MAX, 0xdead_beef));
        assert_eq!(u32_at(&b, 20), u32::MAX);
    }

    #[test]
    fn sequence_numbers_wrap() {
        assert!(seq_older(1, 2));
        assert!(!seq_older(2, 2));
        assert!(!seq_older(3, 2));
        assert!(seq_older(SEQ_MASK, 0));
        assert!(!seq_older(0, SEQ_MASK));
        // Within a channel too, across its wrap.
        assert!(seq_older(seq_on(7, SEQ_MASK), seq_on(7, 0)));
        assert!(!seq_older(seq_on(7, 0), seq_on(7, SEQ_MASK)));
        assert!(seq_older(seq_on(MAX_CHANNEL, 3), seq_on(MAX_CHANNEL, 4)));
    }

    #[test]
    fn channels_are_never_older_than_each_other() {
        for (a, b) in [(seq_on(0, 5), seq_on(1, 6)), (seq_on(1, 5), seq_on(0, 6)), (seq_on(2, 0), seq_on(3, SEQ_MASK))]
        {
            assert!(!seq_older(a, b) && !seq_older(b, a), "{a:#x} {b:#x}");
        }
        assert_eq!(channel_of(seq_on(MAX_CHANNEL, u32::MAX)), MAX_CHANNEL);
        assert_eq!(seq_on(MAX_CHANNEL, u32::MAX), u32::MAX);
        assert_eq!(seq_on(0, SEQ_MASK + 1), 0);
    }
}
