//! What travels in a receive slot and in the 32-bit immediate (pure, no device).
//!
//! Every segment of a message is one RDMA write with immediate into one slot of the peer's
//! ring: a [`SEGMENT_HEADER_LEN`]-byte header at the front of the slot, then up to
//! `slot_bytes - SEGMENT_HEADER_LEN` payload bytes.
//!
//! Header layout (little-endian):
//!
//! | offset | size | field                                    |
//! |--------|------|------------------------------------------|
//! | 0      | 4    | magic `"CHRS"`                           |
//! | 4      | 1    | version ([`WIRE_VERSION`])               |
//! | 5      | 1    | kind (1 = data segment)                  |
//! | 6      | 2    | flags (must be 0)                        |
//! | 8      | 8    | generation                               |
//! | 16     | 4    | tag seq                                  |
//! | 20     | 4    | tag step                                 |
//! | 24     | 4    | tag signature                            |
//! | 28     | 4    | segment payload length                   |
//! | 32     | 8    | message length                           |
//! | 40     | 8    | segment offset within the message        |
//!
//! The immediate of a data write ([`DataImm`]) carries the slot index and the low 8 bits
//! of the tag's seq and step, which the receiver checks against the header: a slot whose
//! header does not match its immediate was overwritten or torn and closes the link. Credit
//! returns are zero-length sends with immediate whose immediate is the number of credits.

use crate::wire::{put_tag, tag_at, u32_at, u64_at};
use crate::Tag;

/// Size of the header at the front of every slot.
pub const SEGMENT_HEADER_LEN: usize = 48;
/// Magic number opening every segment header.
pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"CHRS");
/// Version of the RDMA data-path format.
pub const WIRE_VERSION: u8 = 1;
/// Header kind of a data segment.
pub const KIND_SEGMENT: u8 = 1;

/// The header of one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The sender's generation.
    pub generation: u64,
    /// The message's tag.
    pub tag: Tag,
    /// Payload bytes in this segment.
    pub seg_len: u32,
    /// Length of the whole message.
    pub total: u64,
    /// Offset of this segment's payload within the message.
    pub offset: u64,
}

/// Why a segment header was rejected; each one closes the link with a protocol error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    /// Not a segment header.
    #[error("bad segment magic {0:#010x}")]
    BadMagic(u32),
    /// Another wire version.
    #[error("unsupported rdma wire version {0} (ours {WIRE_VERSION})")]
    BadVersion(u8),
    /// Unknown kind.
    #[error("unknown segment kind {0}")]
    BadKind(u8),
    /// Flags set.
    #[error("reserved segment flags set ({0:#06x})")]
    Flags(u16),
    /// From another generation.
    #[error("segment from generation {theirs} on a generation {ours} link")]
    Generation {
        /// Our generation.
        ours: u64,
        /// The segment's generation.
        theirs: u64,
    },
    /// Message length over the configured maximum.
    #[error("message length {len} exceeds the maximum of {max} bytes")]
    TooLong {
        /// Announced length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// Segment does not fit its slot or its message.
    #[error("segment of {seg_len} bytes at offset {offset} does not fit (message {total} bytes, slot payload {capacity} bytes)")]
    BadBounds {
        /// Segment payload length.
        seg_len: u32,
        /// Segment offset.
        offset: u64,
        /// Message length.
        total: u64,
        /// Payload capacity of a slot.
        capacity: u32,
    },
    /// The header's tag disagrees with the immediate that announced the write.
    #[error("slot header tag (seq {seq}, step {step}) does not match its immediate")]
    ImmMismatch {
        /// Header seq.
        seq: u32,
        /// Header step.
        step: u32,
    },
}

impl SegmentHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let mut b = [0u8; SEGMENT_HEADER_LEN];
        b[0..4].copy_from_slice(&SEGMENT_MAGIC.to_le_bytes());
        b[4] = WIRE_VERSION;
        b[5] = KIND_SEGMENT;
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        put_tag(&mut b, 16, self.tag);
        b[28..32].copy_from_slice(&self.seg_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.total.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b
    }

    /// Decodes and validates a header read from a slot announced by `imm`: magic, version,
    /// kind, flags, generation, message length at most `max_message`, segment within both
    /// its message and the slot's payload `capacity`, tag bits equal to the immediate's.
    pub fn decode(
        b: &[u8; SEGMENT_HEADER_LEN],
        imm: DataImm,
        generation: u64,
        max_message: u64,
        capacity: u32,
    ) -> Result<Self, SegmentError> {
        let magic = u32_at(b, 0);
        if magic != SEGMENT_MAGIC {
            return Err(SegmentError::BadMagic(magic));
        }
        if b[4] != WIRE_VERSION {
            return Err(SegmentError::BadVersion(b[4]));
        }
        if b[5] != KIND_SEGMENT {
            return Err(SegmentError::BadKind(b[5]));
        }
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags != 0 {
            return Err(SegmentError::Flags(flags));
        }
        let theirs = u64_at(b, 8);
        if theirs != generation {
            return Err(SegmentError::Generation { ours: generation, theirs });
        }
        let h = Self {
            generation: theirs,
            tag: tag_at(b, 16),
            seg_len: u32_at(b, 28),
            total: u64_at(b, 32),
            offset: u64_at(b, 40),
        };
        if h.total > max_message {
            return Err(SegmentError::TooLong { len: h.total, max: max_message });
        }
        let fits = h.seg_len <= capacity
            && h.offset.checked_add(u64::from(h.seg_len)).is_some_and(|end| end <= h.total)
            && (h.seg_len > 0 || h.total == 0);
        if !fits {
            return Err(SegmentError::BadBounds { seg_len: h.seg_len, offset: h.offset, total: h.total, capacity });
        }
        if DataImm::check_bits(h.tag) != imm.check {
            return Err(SegmentError::ImmMismatch { seq: h.tag.seq, step: h.tag.step });
        }
        Ok(h)
    }
}

/// The immediate of a data write: which slot was written, and tag check bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataImm {
    /// Slot index (rings have at most 65536 slots).
    pub slot: u16,
    /// Low 8 bits of the tag's seq (high byte) and step (low byte).
    pub check: u16,
}

impl DataImm {
    /// The immediate announcing a write of `tag` into `slot`.
    pub fn new(slot: u16, tag: Tag) -> Self {
        Self { slot, check: Self::check_bits(tag) }
    }

    fn check_bits(tag: Tag) -> u16 {
        (u16::from(tag.seq as u8) << 8) | u16::from(tag.step as u8)
    }

    /// The 32-bit value in host order (the device code converts to network order).
    pub fn to_u32(self) -> u32 {
        (u32::from(self.check) << 16) | u32::from(self.slot)
    }

    /// Splits a received immediate (host order).
    pub fn from_u32(v: u32) -> Self {
        Self { slot: (v & 0xffff) as u16, check: (v >> 16) as u16 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> SegmentHeader {
        SegmentHeader { generation: 9, tag: Tag::new(300, 5, 0xabcd), seg_len: 100, total: 1000, offset: 900 }
    }

    fn dec(b: &[u8; SEGMENT_HEADER_LEN], imm: DataImm) -> Result<SegmentHeader, SegmentError> {
        SegmentHeader::decode(b, imm, 9, 1 << 20, 4048)
    }

    #[test]
    fn header_and_imm_round_trip() {
        let h = hdr();
        let imm = DataImm::new(17, h.tag);
        assert_eq!(DataImm::from_u32(imm.to_u32()), imm);
        assert_eq!(imm.slot, 17);
        assert_eq!(dec(&h.encode(), imm), Ok(h));
        let empty = SegmentHeader { seg_len: 0, total: 0, offset: 0, ..h };
        assert_eq!(dec(&empty.encode(), imm), Ok(empty));
    }

    #[test]
    fn header_rejects_every_bad_field() {
        let h = hdr();
        let imm = DataImm::new(0, h.tag);
        let good = h.encode();
        let mut b = good;
        b[1] ^= 1;
        assert!(matches!(dec(&b, imm), Err(SegmentError::BadMagic(_))));
        let mut b = good;
        b[4] = 2;
        assert_eq!(dec(&b, imm), Err(SegmentError::BadVersion(2)));
        let mut b = good;
        b[5] = 0;
        assert_eq!(dec(&b, imm), Err(SegmentError::BadKind(0)));
        let mut b = good;
        b[6] = 1;
        assert_eq!(dec(&b, imm), Err(SegmentError::Flags(1)));
        assert_eq!(
            SegmentHeader::decode(&good, imm, 10, 1 << 20, 4048),
            Err(SegmentError::Generation { ours: 10, theirs: 9 })
        );
        assert_eq!(SegmentHeader::decode(&good, imm, 9, 999, 4048), Err(SegmentError::TooLong { len: 1000, max: 999 }));
        assert!(matches!(SegmentHeader::decode(&good, imm, 9, 1 << 20, 99), Err(SegmentError::BadBounds { .. })));
        for bad in [
            SegmentHeader { offset: 901, ..h },
            SegmentHeader { offset: u64::MAX, ..h },
            SegmentHeader { seg_len: 0, ..h },
        ] {
            assert!(matches!(dec(&bad.encode(), imm), Err(SegmentError::BadBounds { .. })), "{bad:?}");
        }
        let other = DataImm::new(0, Tag::new(301, 5, 0));
        assert_eq!(dec(&good, other), Err(SegmentError::ImmMismatch { seq: 300, step: 5 }));
    }
}
