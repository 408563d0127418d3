//! Fuzzing (property-based, generated inputs) of every decoder that reads bytes from a peer:
//! the TCP frame header, the handshake messages, and (feature `rdma`) the RDMA addresses the
//! coordinator relays and the segment headers a peer writes into our memory.
//!
//! The property, for arbitrary input: no panic, a typed error or a value, and a value that
//! re-encodes to what was read (nothing is accepted that the encoder would not have made).
//! Cases proptest finds are kept in `fuzz_decoders.proptest-regressions` and replayed first on
//! every run; those found while writing these tests stand below as plain regression tests.
//! `PROPTEST_CASES=N` runs more cases (docs/testing.md reports a long run).

use cohort_transports::handshake::{self, Hello, Message, PREFIX_LEN};
use cohort_transports::tcp::frame::{FrameHeader, HEADER_LEN};
use cohort_transports::Tag;
use proptest::prelude::*;

fn frame_bytes() -> impl Strategy<Value = [u8; HEADER_LEN]> {
    // Half the cases start from a valid header and flip bytes, so that the checks after the
    // magic are reached too.
    prop_oneof![
        prop::array::uniform32(any::<u8>()).prop_flat_map(|a| {
            prop::array::uniform8(any::<u8>()).prop_map(move |b| {
                let mut h = [0u8; HEADER_LEN];
                h[..32].copy_from_slice(&a);
                h[32..].copy_from_slice(&b);
                h
            })
        }),
        (any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>(), 0..HEADER_LEN, any::<u8>()).prop_map(
            |(generation, seq, step, signature, len, at, byte)| {
                let mut h = FrameHeader { generation, tag: Tag::new(seq, step, signature), len }.encode();
                h[at] = byte;
                h
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn frame_headers_decode_or_fail_cleanly(b in frame_bytes(), generation in any::<u64>(), max in any::<u64>()) {
        // The generation a link expects is often the one in the frame: check that path too.
        for ours in [generation, u64::from_le_bytes(b[8..16].try_into().unwrap())] {
            if let Ok(h) = FrameHeader::decode(&b, ours, max) {
                prop_assert_eq!(h.encode(), b);
                prop_assert!(h.len <= max && h.generation == ours);
            }
        }
    }

    #[test]
    fn handshake_messages_decode_or_fail_cleanly(
        prefix in prop::array::uniform8(any::<u8>()),
        body in prop_oneof![prop::collection::vec(any::<u8>(), 0..64), prop::collection::vec(any::<u8>(), 0..400)],
        // The four kinds (1..=4) most of the time, anything else now and then.
        kind in prop_oneof![4 => 0u8..6, 1 => any::<u8>()],
    ) {
        // As the wire reads them: a prefix, then a body of the length it announced.
        if let Ok((k, len)) = handshake::decode_prefix(&prefix) {
            let mut exact = body.clone();
            exact.resize(len, 0);
            let _ = handshake::decode_body(k, &exact);
        }
        // And a body of any length for any kind: the decoder must not trust its caller.
        let _ = handshake::decode_body(kind, &body);
    }

    #[test]
    fn hellos_round_trip(
        job in "[A-Za-z0-9._-]{1,64}",
        generation in any::<u64>(),
        sender in any::<u32>(),
        receiver in any::<u32>(),
        world in any::<u32>(),
        nonce in prop::array::uniform32(any::<u8>()),
    ) {
        let hello = Hello { job, generation, sender, receiver, world, nonce };
        let bytes = hello.encode();
        let prefix: [u8; PREFIX_LEN] = bytes[..PREFIX_LEN].try_into().unwrap();
        let (kind, len) = handshake::decode_prefix(&prefix).expect("our own prefix");
        prop_assert_eq!(len, bytes.len() - PREFIX_LEN);
        match handshake::decode_body(kind, &bytes[PREFIX_LEN..]) {
            Ok(Message::Hello(back)) => prop_assert_eq!(back, hello),
            other => prop_assert!(false, "decoded {:?}", other),
        }
    }
}

/// Found by `handshake_messages_decode_or_fail_cleanly`: a body shorter than its kind's fixed
/// part panicked on a slice index (the decoder trusted `decode_prefix` to have been called).
#[test]
fn short_bodies_are_errors_not_panics() {
    for kind in 0..=u8::MAX {
        for len in 0..64 {
            let _ = handshake::decode_body(kind, &vec![0xff; len]);
        }
    }
}

#[cfg(feature = "rdma")]
mod rdma {
    use cohort_transports::rdma::address::{EndpointAddress, RdmaAddress};
    use cohort_transports::rdma::wire::{DataImm, SegmentHeader, SEGMENT_HEADER_LEN};
    use proptest::prelude::*;

    /// A well-formed endpoint address with arbitrary values, then maybe one byte changed.
    fn endpoint_text() -> impl Strategy<Value = String> {
        let mtu = prop_oneof![Just(256u32), Just(512), Just(1024), Just(2048), Just(4096), any::<u32>()];
        (any::<u16>(), prop::array::uniform16(any::<u8>()), mtu, any::<[u8; 4]>(), any::<u16>(), any::<(usize, u8)>())
            .prop_map(|(lid, gid, mtu, ip, port, (at, byte))| {
                let gid: String = gid.iter().map(|b| format!("{b:02x}")).collect();
                let [a, b, c, d] = ip;
                let mut text =
                    format!("rdma-ep1;lid={lid};gid={gid};mtu={mtu};boot={a}.{b}.{c}.{d}:{port}").into_bytes();
                if byte % 2 == 0 {
                    let at = at % text.len();
                    text[at] = byte;
                }
                String::from_utf8_lossy(&text).into_owned()
            })
    }

    /// Address-like text: the real field names and separators, arbitrary values.
    fn address_text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "(rdma-ep1|rdma-qp1)(;(lid|gid|mtu|boot|qpn|psn|slot|ring)=[0-9a-fA-F:.x\\[\\]-]{0,40}){0,9}",
            endpoint_text(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn addresses_decode_or_fail_cleanly(text in address_text()) {
            if let Ok(a) = EndpointAddress::decode(&text) {
                prop_assert_eq!(EndpointAddress::decode(&a.encode()).expect("re-decode"), a);
            }
            if let Ok(a) = RdmaAddress::decode(&text) {
                prop_assert_eq!(RdmaAddress::decode(&a.encode()).expect("re-decode"), a);
            }
        }

        #[test]
        fn segment_headers_decode_or_fail_cleanly(
            head in prop::array::uniform32(any::<u8>()),
            tail in prop::array::uniform16(any::<u8>()),
            imm in any::<u32>(),
            generation in any::<u64>(),
            max in any::<u64>(),
            capacity in any::<u32>(),
        ) {
            let mut b = [0u8; SEGMENT_HEADER_LEN];
            b[..32].copy_from_slice(&head);
            b[32..].copy_from_slice(&tail);
            if let Ok(h) = SegmentHeader::decode(&b, DataImm::from_u32(imm), generation, max, capacity) {
                prop_assert!(h.total <= max);
                prop_assert!(u64::from(h.seg_len) <= u64::from(capacity));
                prop_assert!(h.offset.checked_add(u64::from(h.seg_len)).is_some_and(|end| end <= h.total));
            }
        }
    }
}
