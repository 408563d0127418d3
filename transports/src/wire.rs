//! Rules of the wire every transport keeps alike (TCP, shared memory, RDMA): the order of
//! operation sequence numbers, and how much a link holds for receivers that have not asked
//! yet.

/// Most bytes of out-of-order frames a link holds for receivers that have not asked yet;
/// beyond it the link fails with a protocol error instead of growing.
pub const STASH_BUDGET: usize = 64 << 20;

/// Most out-of-order frames a link holds.
pub const STASH_MAX_FRAMES: usize = 1024;

/// `a` is older than `b` in wrapping sequence-number order.
pub fn seq_older(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_wrap() {
        assert!(seq_older(1, 2));
        assert!(!seq_older(2, 2));
        assert!(!seq_older(3, 2));
        assert!(seq_older(u32::MAX, 0));
        assert!(!seq_older(0, u32::MAX));
    }
}
