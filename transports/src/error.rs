//! Typed errors of the data plane.

use crate::wire::Rank;
use std::sync::Arc;
use std::time::Duration;

/// Why a transport was aborted; carried by every [`TransportError::Aborted`] it returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortReason(pub Arc<str>);

impl AbortReason {
    /// Wraps a human-readable reason.
    pub fn new(reason: impl Into<Arc<str>>) -> Self {
        Self(reason.into())
    }
}

impl std::fmt::Display for AbortReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

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
    #[error("no progress on the link to rank {peer} for {after:?}{}", silence.suffix())]
    Timeout {
        /// The rank at the other end.
        peer: Rank,
        /// The deadline that elapsed.
        after: Duration,
        /// What the waiting side found out about the peer's process before giving up.
        silence: Silence,
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
        /// The two call signatures, when they differ (the layer above decodes them into
        /// the two calls).
        signatures: Option<Signatures>,
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

/// The call signatures of a [`TransportError::Mismatch`]: the peer's (carried by the message
/// that arrived) and this rank's (the receive's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Signatures {
    /// The signature the peer's message carried.
    pub received: u32,
    /// The signature this rank's receive expected.
    pub expected: u32,
}

/// What a link found out about a silent peer's process before it gave up on it (see
/// [`TransportError::Timeout`]): the difference between "the deadline passed" and "the peer's
/// process is stopped", which the error and the root cause built from it say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Silence {
    /// Nothing was asked (the ceiling passed, learning is off, or the peer has no liveness
    /// responder): only the deadline is known.
    Unprobed,
    /// The peer's process, on this host, was found stopped (SIGSTOP, a debugger).
    ProcessStopped,
    /// The peer's process, on this host, is gone (exited, a zombie) while its link is open.
    ProcessGone,
    /// The peer's process, on another host, did not answer the liveness probe (stopped,
    /// frozen host, or the path is cut).
    NoAnswer,
    /// The peer's process runs but stayed late to the operation (outside it, or blocked
    /// behind a late rank) past the late-rank bound ([`crate::Learning::late_rank`]): an
    /// endless loop or a deadlock in user code, not a stopped process. `cpu` says whether it
    /// was computing.
    Late {
        /// How the peer used the CPU while it was late.
        cpu: crate::activity::CpuUse,
    },
}

impl Silence {
    /// What it says about the peer, as a short phrase (empty for [`Silence::Unprobed`]).
    pub fn describe(self) -> &'static str {
        match self {
            Self::Unprobed => "",
            Self::ProcessStopped => "process stopped",
            Self::ProcessGone => "process gone",
            Self::NoAnswer => "process does not answer liveness probes",
            Self::Late { cpu: crate::activity::CpuUse::Busy } => {
                "process runs but stayed outside the collective past the late-rank bound, computing (CPU busy)"
            }
            Self::Late { cpu: crate::activity::CpuUse::Idle } => {
                "process runs but stayed outside the collective past the late-rank bound, idle (blocked in user code or I/O)"
            }
            Self::Late { cpu: crate::activity::CpuUse::Unknown } => {
                "process runs but stayed outside the collective past the late-rank bound"
            }
        }
    }

    fn suffix(self) -> String {
        match self {
            Self::Unprobed => String::new(),
            other => format!(" ({})", other.describe()),
        }
    }
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
