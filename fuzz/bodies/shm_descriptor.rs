//! The shared-memory segment descriptor a peer sends with its segment: any 16 bytes decode to
//! a geometry within the limits that re-encodes to them, or to a typed error.
use cohort_transports::shm::{self, DESC_LEN};

/// One input: the descriptor's 16 bytes.
pub(crate) fn run(data: &[u8]) {
    let Some(desc) = data.get(..DESC_LEN) else { return };
    let desc: [u8; DESC_LEN] = desc.try_into().unwrap();
    if let Ok((slots, slot_bytes)) = shm::decode_descriptor(&desc) {
        assert_eq!(shm::encode_descriptor(slots, slot_bytes), desc);
        assert!((shm::MIN_SLOTS..=shm::MAX_SLOTS).contains(&slots));
        assert!((shm::MIN_SLOT_BYTES..=shm::MAX_SLOT_BYTES).contains(&slot_bytes));
        assert!(2 * (slots as usize) * slot_bytes <= shm::MAX_SEGMENT_BYTES);
    }
}
