//! Rules of the wire every transport keeps alike (TCP, shared memory, RDMA): the order of
//! operation sequence numbers, and how much a link holds for receivers that have not asked
//! yet.

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
pub fn other_call(want: crate::Tag, got: crate::Tag) -> bool {
    got.seq == want.seq && got.signature != want.signature && want.step < P2P_STEP_BASE && got.step < P2P_STEP_BASE
}

/// `a` is older than `b` in wrapping sequence-number order.
pub fn seq_older(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_call_is_seen_across_steps_but_not_across_operations_or_p2p() {
        let want = crate::Tag::new(7, 3, 0xaaaa);
        assert!(other_call(want, crate::Tag::new(7, 0, 0xbbbb)), "same op, another step, another call");
        assert!(other_call(want, crate::Tag::new(7, 3, 0xbbbb)));
        assert!(!other_call(want, crate::Tag::new(7, 0, 0xaaaa)), "same call, a later step: stash it");
        assert!(!other_call(want, crate::Tag::new(8, 0, 0xbbbb)), "the next operation: stash it");
        assert!(!other_call(want, crate::Tag::new(7, P2P_STEP_BASE, 0xbbbb)), "a send/recv sharing the seq");
        assert!(!other_call(crate::Tag::new(7, P2P_STEP_BASE + 2, 0xaaaa), crate::Tag::new(7, 0, 0xbbbb)));
    }

    #[test]
    fn sequence_numbers_wrap() {
        assert!(seq_older(1, 2));
        assert!(!seq_older(2, 2));
        assert!(!seq_older(3, 2));
        assert!(seq_older(u32::MAX, 0));
        assert!(!seq_older(0, u32::MAX));
    }
}
