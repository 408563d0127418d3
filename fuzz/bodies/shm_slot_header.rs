//! The shared-memory slot header, read from memory the peer process writes: any 64 bytes
//! (and the link's generation, largest message and slot payload from the input) decode to a
//! header that re-encodes to them and whose chunk lies within its slot and its message, or to
//! a typed error.
use cohort_transports::shm::ring::{SlotHeader, SLOT_HEADER};

/// One input: 64 header bytes, then the link's generation and largest message (u64 LE each)
/// and the slot's payload capacity (u32 LE).
pub(crate) fn run(data: &[u8]) {
    if data.len() < SLOT_HEADER + 20 {
        return;
    }
    let header: [u8; SLOT_HEADER] = data[..SLOT_HEADER].try_into().unwrap();
    let word = |at: usize| u64::from_le_bytes(data[SLOT_HEADER + at..SLOT_HEADER + at + 8].try_into().unwrap());
    let (generation, max_message) = (word(0), word(8));
    let capacity = u32::from_le_bytes(data[SLOT_HEADER + 16..SLOT_HEADER + 20].try_into().unwrap()) as usize;
    let theirs = u64::from_le_bytes(header[8..16].try_into().unwrap());
    for ours in [generation, theirs] {
        if let Ok(h) = SlotHeader::decode(&header, ours, max_message, capacity) {
            assert_eq!(h.encode(ours), header);
            assert!(h.total <= max_message);
            assert!(h.chunk as usize <= capacity);
            assert!(h.offset.checked_add(u64::from(h.chunk)).is_some_and(|end| end <= h.total));
        }
    }
}
