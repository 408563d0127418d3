//! Handshake messages as the wire reads them (a prefix, then the body it announces), and any
//! body for any kind: a message or a typed error, never a panic.
use cohort_transports::handshake::{self, PREFIX_LEN};

/// One input: a prefix and what follows it.
pub(crate) fn run(data: &[u8]) {
    if data.len() < PREFIX_LEN + 1 {
        return;
    }
    let prefix: [u8; PREFIX_LEN] = data[..PREFIX_LEN].try_into().unwrap();
    let rest = &data[PREFIX_LEN..];
    if let Ok((kind, len)) = handshake::decode_prefix(&prefix) {
        if rest.len() >= len {
            let _ = handshake::decode_body(kind, &rest[..len]);
        }
    }
    let _ = handshake::decode_body(rest[0], &rest[1..]);
}
