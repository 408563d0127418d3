//! Typed errors of the data plane.

use crate::{AbortReason, Rank};
use std::time::Duration;

/// What can go wrong moving bytes between ranks.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// The peer closed or reset the link, or the link broke (EOF, ECONNRESET, EPIPE, ...).
    #[error("peer rank {peer} failed: {detail}")]
    PeerClosed {
        /// The rank at the other end.
        peer: Rank,
        /// What was observed (EOF, reset, ...).
        detail: String,
    },
    /// No bytes moved on the link to `peer` for the no-progress deadline.
    #[error("no progress on the link to rank {peer} for {after:?}")]
    Timeout {
        /// The rank at the other end.
        peer: Rank,
        /// The deadline that elapsed.
        after: Duration,
    },
    /// The transport was aborted locally (revocation, shutdown).
    #[error("aborted: {0}")]
    Aborted(AbortReason),
    /// The peer sent something that breaks the wire protocol; the link is closed.
    #[error("protocol violation from rank {peer}: {detail}")]
    Protocol {
        /// The rank at the other end.
        peer: Rank,
        /// What was wrong with the frame.
        detail: String,
    },
    /// Both sides are well-formed but disagree about the call (length or signature).
    #[error("rank {peer} disagrees about the operation: {detail}")]
    Mismatch {
        /// The rank at the other end.
        peer: Rank,
        /// What differs (expected vs received length or signature).
        detail: String,
    },
    /// Connection set-up failed: refused handshake (wrong job, generation, rank or token),
    /// unreachable peer, or the connect deadline passed.
    #[error("handshake with rank {peer} failed: {detail}")]
    Handshake {
        /// The rank at the other end.
        peer: Rank,
        /// Why it failed.
        detail: String,
    },
    /// The caller asked for something impossible (peer out of range, sending to self, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Any other local I/O error (bind, socket options, ...).
    #[error("i/o error: {0}")]
    Io(String),
}

impl TransportError {
    /// The peer this error is about, if any.
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Self::PeerClosed { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::Protocol { peer, .. }
            | Self::Mismatch { peer, .. }
            | Self::Handshake { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}
