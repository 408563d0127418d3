//! The TCP frame header: any 40 bytes (and the link's generation and limit from the input)
//! decode to a header that re-encodes to them, or to a typed error.
use cohort_transports::tcp::frame::{FrameHeader, HEADER_LEN};

/// One input: 40 header bytes, then the link's generation and largest frame (u64 LE each).
pub(crate) fn run(data: &[u8]) {
    if data.len() < HEADER_LEN + 16 {
        return;
    }
    let header: [u8; HEADER_LEN] = data[..HEADER_LEN].try_into().unwrap();
    let generation = u64::from_le_bytes(data[HEADER_LEN..HEADER_LEN + 8].try_into().unwrap());
    let max = u64::from_le_bytes(data[HEADER_LEN + 8..HEADER_LEN + 16].try_into().unwrap());
    for ours in [generation, u64::from_le_bytes(header[8..16].try_into().unwrap())] {
        if let Ok(h) = FrameHeader::decode(&header, ours, max) {
            assert_eq!(h.encode(), header);
            assert!(h.len <= max);
        }
    }
}
