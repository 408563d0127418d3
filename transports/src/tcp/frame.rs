//! Data frame header: encoding and validation (pure, no I/O).
//!
//! Layout (40 bytes, little-endian):
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 4    | magic `0x4654_4843` (`"CHTF"` on the wire) |
//! | 4      | 1    | protocol version ([`VERSION`])          |
//! | 5      | 1    | kind (1 = data, 2 = re-bind marker)     |
//! | 6      | 2    | flags (must be 0)                       |
//! | 8      | 8    | generation                              |
//! | 16     | 4    | tag seq                                 |
//! | 20     | 4    | tag step                                |
//! | 24     | 4    | tag signature                           |
//! | 28     | 4    | reserved (must be 0)                    |
//! | 32     | 8    | payload length                          |

use crate::wire::{put_tag, tag_at, u32_at, u64_at};
use crate::Tag;

/// Size of an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = 40;
/// Magic number opening every data frame.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"CHTF");
/// Wire protocol version (shared with the handshake).
pub const VERSION: u8 = 1;
/// Frame kind: a tagged data message.
pub const KIND_DATA: u8 = 1;
/// Frame kind of the marker that ends a generation's frames on a link carried into the next
/// generation (`super::carry`): no payload, the new generation in the generation field.
pub const KIND_REBIND: u8 = 2;

/// A decoded, validated data frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Generation the sender's transport belongs to.
    pub generation: u64,
    /// The message's tag.
    pub tag: Tag,
    /// Payload length in bytes.
    pub len: u64,
}

/// Why a header was rejected; each one closes the link with a protocol error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not [`FRAME_MAGIC`].
    #[error("bad frame magic {0:#010x}")]
    BadMagic(u32),
    /// Another protocol version.
    #[error("unsupported frame version {0} (ours {VERSION})")]
    BadVersion(u8),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// Flags or reserved bits set.
    #[error("reserved header bits set (flags {flags:#06x}, reserved {reserved:#010x})")]
    Reserved {
        /// The flags field.
        flags: u16,
        /// The reserved field.
        reserved: u32,
    },
    /// A frame from another generation.
    #[error("frame from generation {theirs} on a generation {ours} link")]
    Generation {
        /// Our generation.
        ours: u64,
        /// The frame's generation.
        theirs: u64,
    },
    /// Payload length over the configured maximum.
    #[error("frame length {len} exceeds the maximum of {max} bytes")]
    TooLong {
        /// Announced length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = KIND_DATA;
        // flags (6..8) and reserved (28..32) stay zero.
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        put_tag(&mut b, 16, self.tag);
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header against the link's generation and maximum length.
    pub fn decode(b: &[u8; HEADER_LEN], generation: u64, max_frame: u64) -> Result<Self, FrameError> {
        check_envelope(b)?;
        if b[5] != KIND_DATA {
            return Err(FrameError::BadKind(b[5]));
        }
        let theirs = u64_at(b, 8);
        if theirs != generation {
            return Err(FrameError::Generation { ours: generation, theirs });
        }
        let len = u64_at(b, 32);
        if len > max_frame {
            return Err(FrameError::TooLong { len, max: max_frame });
        }
        let tag = tag_at(b, 16);
        Ok(Self { generation: theirs, tag, len })
    }
}

/// The checks every header passes whatever its kind: magic, version, and the flags and
/// reserved bits at zero.
fn check_envelope(b: &[u8; HEADER_LEN]) -> Result<(), FrameError> {
    let magic = u32_at(b, 0);
    if magic != FRAME_MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if b[4] != VERSION {
        return Err(FrameError::BadVersion(b[4]));
    }
    let flags = u16::from_le_bytes([b[6], b[7]]);
    let reserved = u32_at(b, 28);
    if flags != 0 || reserved != 0 {
        return Err(FrameError::Reserved { flags, reserved });
    }
    Ok(())
}

/// What a link carried into a new generation finds on the wire before that generation's
/// handshake ([`skim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skimmed {
    /// A data frame of an older generation, whose payload of this many bytes is skipped.
    Stale(u64),
    /// The peer's re-bind marker for the generation being formed.
    Marker,
}

/// The marker a side sends on a carried link before the new generation's handshake: every
/// frame it sent before belongs to older generations.
pub fn rebind_marker(generation: u64) -> [u8; HEADER_LEN] {
    let mut b = FrameHeader { generation, tag: Tag::new(0, 0, 0), len: 0 }.encode();
    b[5] = KIND_REBIND;
    b
}

/// Classifies a header read on a link carried into generation `forming`: a data frame of an
/// older generation (skipped) or the peer's marker for `forming`. Anything else (a frame of
/// `forming` or later before the marker, a marker for another generation or with a payload,
/// a malformed header) is an error, and the link is not carried.
pub fn skim(b: &[u8; HEADER_LEN], forming: u64, max_frame: u64) -> Result<Skimmed, FrameError> {
    check_envelope(b)?;
    let theirs = u64_at(b, 8);
    let len = u64_at(b, 32);
    match b[5] {
        KIND_DATA if theirs < forming && len <= max_frame => Ok(Skimmed::Stale(len)),
        KIND_DATA if theirs >= forming => Err(FrameError::Generation { ours: forming, theirs }),
        KIND_DATA => Err(FrameError::TooLong { len, max: max_frame }),
        KIND_REBIND if theirs != forming => Err(FrameError::Generation { ours: forming, theirs }),
        KIND_REBIND if len != 0 => Err(FrameError::TooLong { len, max: 0 }),
        KIND_REBIND => Ok(Skimmed::Marker),
        k => Err(FrameError::BadKind(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> FrameHeader {
        FrameHeader { generation: 7, tag: Tag::new(3, 9, 0xdead_beef), len: 4093 }
    }

    #[test]
    fn round_trip() {
        let b = hdr().encode();
        assert_eq!(&b[0..4], b"CHTF");
        assert_eq!(FrameHeader::decode(&b, 7, 1 << 20), Ok(hdr()));
    }

    #[test]
    fn rejects_bad_fields() {
        let good = hdr().encode();
        let mut b = good;
        b[0] ^= 1;
        assert!(matches!(FrameHeader::decode(&b, 7, 1 << 20), Err(FrameError::BadMagic(_))));
        let mut b = good;
        b[4] = 2;
        assert_eq!(FrameHeader::decode(&b, 7, 1 << 20), Err(FrameError::BadVersion(2)));
        let mut b = good;
        b[5] = 9;
        assert_eq!(FrameHeader::decode(&b, 7, 1 << 20), Err(FrameError::BadKind(9)));
        let mut b = good;
        b[7] = 1;
        assert!(matches!(FrameHeader::decode(&b, 7, 1 << 20), Err(FrameError::Reserved { .. })));
        let mut b = good;
        b[30] = 1;
        assert!(matches!(FrameHeader::decode(&b, 7, 1 << 20), Err(FrameError::Reserved { .. })));
        assert_eq!(FrameHeader::decode(&good, 8, 1 << 20), Err(FrameError::Generation { ours: 8, theirs: 7 }));
        assert_eq!(FrameHeader::decode(&good, 7, 4092), Err(FrameError::TooLong { len: 4093, max: 4092 }));
        assert!(FrameHeader::decode(&good, 7, 4093).is_ok());
    }

    /// Sequence numbers cross a channel's wrap unchanged on the wire, and the order links use
    /// to tell an old frame from a new one still holds across it.
    #[test]
    fn seq_order_wraps() {
        let around = [crate::wire::SEQ_MASK - 1, crate::wire::SEQ_MASK, 0, 1];
        let decoded: Vec<u32> = around
            .iter()
            .map(|&seq| {
                let h = FrameHeader { generation: 7, tag: Tag { seq, ..hdr().tag }, len: 8 };
                let back = FrameHeader::decode(&h.encode(), 7, 1 << 20).expect("a well-formed header");
                assert_eq!(back, h);
                back.tag.seq
            })
            .collect();
        assert_eq!(decoded, around);
        for w in decoded.windows(2) {
            assert!(crate::wire::seq_older(w[0], w[1]), "{} is not older than {}", w[0], w[1]);
            assert!(!crate::wire::seq_older(w[1], w[0]), "{} is older than {}", w[1], w[0]);
        }
        assert!(crate::wire::seq_older(decoded[0], decoded[3]));
    }

    #[test]
    fn a_carried_link_skims_older_frames_up_to_the_marker() {
        let max = 1 << 20;
        assert_eq!(skim(&hdr().encode(), 8, max), Ok(Skimmed::Stale(4093)));
        assert_eq!(skim(&rebind_marker(8), 8, max), Ok(Skimmed::Marker));
        // A data frame of the generation being formed cannot come before the marker.
        assert_eq!(skim(&hdr().encode(), 7, max), Err(FrameError::Generation { ours: 7, theirs: 7 }));
        assert_eq!(skim(&rebind_marker(9), 8, max), Err(FrameError::Generation { ours: 8, theirs: 9 }));
        assert_eq!(skim(&hdr().encode(), 8, 100), Err(FrameError::TooLong { len: 4093, max: 100 }));
        let mut long_marker = rebind_marker(8);
        long_marker[32] = 1;
        assert_eq!(skim(&long_marker, 8, max), Err(FrameError::TooLong { len: 1, max: 0 }));
        let mut b = rebind_marker(8);
        b[5] = 3;
        assert_eq!(skim(&b, 8, max), Err(FrameError::BadKind(3)));
        // A marker is no data frame: a link that did not expect one fails on it.
        assert_eq!(FrameHeader::decode(&rebind_marker(8), 8, max), Err(FrameError::BadKind(KIND_REBIND)));
    }
}
