//! Typed errors of the communicator and the root cause of a revocation.

use cohort_transports::{Silence, TransportError};
use std::fmt;
use std::time::Duration;

/// Who or what made a generation fail: the first failed rank and why, as the coordinator's
/// revocation record names it. Every rank's [`CommError::Revoked`] carries it, so the error a
/// user sees on any rank points at the real culprit, not at "connection reset by peer".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootCause {
    /// The rank that failed first, if the failure is tied to one.
    pub rank: Option<u32>,
    /// Worker id of that rank (empty if unknown).
    pub worker_id: String,
    /// Host of that worker (empty if unknown).
    pub host: String,
    /// What happened (e.g. "SIGKILL", "lease expired", "graceful leave").
    pub reason: String,
}

impl RootCause {
    /// A cause with only a reason (no rank, worker or host known).
    pub fn reason(reason: impl Into<String>) -> Self {
        Self { rank: None, worker_id: String::new(), host: String::new(), reason: reason.into() }
    }
}

impl fmt::Display for RootCause {
    /// `rank 2 (worker w2 on host-a): SIGKILL`; parts that are unknown are left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut wrote = false;
        if let Some(rank) = self.rank {
            write!(f, "rank {rank}")?;
            wrote = true;
        }
        match (self.worker_id.is_empty(), self.host.is_empty()) {
            (false, false) => {
                write!(f, "{}(worker {} on {})", if wrote { " " } else { "" }, self.worker_id, self.host)?
            }
            (false, true) => write!(f, "{}(worker {})", if wrote { " " } else { "" }, self.worker_id)?,
            (true, false) => write!(f, "{}(on {})", if wrote { " " } else { "" }, self.host)?,
            (true, true) => {}
        }
        if wrote || !self.worker_id.is_empty() || !self.host.is_empty() {
            f.write_str(": ")?;
        }
        f.write_str(&self.reason)
    }
}

/// How far this rank got in the operation that failed: the operation's sequence number in
/// the generation and the messages it had received in it. Ordered by `seq`, then `received`.
///
/// Timeout reports carry it. When a link goes silent in a lock-step schedule such as the
/// ring, every rank soon starves and times out naming the rank it waits on, so the reports
/// form a cycle with no end; the rank that got least far is the one behind the silent link
/// (every rank downstream of it received at least one message more before starving), so
/// the coordinator blames the link that rank waits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpProgress {
    /// Sequence number of the operation in its generation.
    pub seq: u32,
    /// Messages received in that operation before it failed.
    pub received: u64,
}

/// Why a collective failed. Every live rank gets one of these instead of a hang or a partial
/// result; after any of them the communicator is poisoned (see [`crate::Communicator`]).
///
/// Mapping from [`TransportError`]: `PeerClosed` and `Protocol` become [`CommError::PeerFailed`];
/// `Timeout` becomes [`CommError::Timeout`]; `Aborted` becomes [`CommError::Revoked`] (with the
/// cause the [`crate::Revoker`] recorded); `Mismatch` (the ranks disagree about the call:
/// length or signature) becomes [`CommError::Mismatch`] naming both calls; `InvalidArgument`
/// becomes [`CommError::InvalidArgument`]; anything
/// else stays [`CommError::Transport`]. Once the communicator has been revoked, every failure
/// is reported as `Revoked`, whatever the transport saw.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CommError {
    /// A peer closed, reset or broke the protocol on its link.
    #[error("peer rank {rank} failed: {detail}")]
    PeerFailed {
        /// The rank at the other end.
        rank: u32,
        /// What was observed.
        detail: String,
    },
    /// A deadline passed: the no-progress deadline on the link to `rank`, or the whole-op bound
    /// (`rank` is `None` then).
    #[error(
        "timed out after {after:?}{}{}",
        rank.map(|r| format!(" waiting on rank {r}")).unwrap_or_default(),
        match silence { Silence::Unprobed => String::new(), s => format!(" ({})", s.describe()) }
    )]
    Timeout {
        /// The peer that stopped moving bytes, if known.
        rank: Option<u32>,
        /// The deadline that passed.
        after: Duration,
        /// How far this rank got in the operation (see [`OpProgress`]).
        progress: Option<OpProgress>,
        /// What the link found out about the peer's process (stopped, not answering) before
        /// it gave up; [`Silence::Unprobed`] for the whole-op bound.
        silence: Silence,
    },
    /// The generation was revoked (or the transport aborted); no collective will run on it again.
    #[error("generation {generation} revoked: {cause}")]
    Revoked {
        /// The revoked generation.
        generation: u64,
        /// The root cause, as recorded by the revoker.
        cause: RootCause,
    },
    /// Any other transport failure (handshake, local I/O).
    #[error("transport error: {0}")]
    Transport(TransportError),
    /// The call was malformed (lengths, root, counts, dtype), found on this rank before
    /// anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The ranks called different collectives, or the same one with different arguments
    /// (dtype, op, count, root, algorithm): a message of `rank`'s call reached this rank's.
    /// Messages of the operation may have been exchanged already, so this communicator is
    /// poisoned like after any failure: re-form (or build a new one) to go on.
    #[error("mismatched collectives with rank {rank}: {detail}")]
    Mismatch {
        /// The rank whose message belongs to another call.
        rank: u32,
        /// Both calls as far as each is known, and what differs.
        detail: String,
    },
}

impl CommError {
    /// What this error says of the failed rank, as the reason of the root cause reported to
    /// the coordinator (the cause every rank sees names the rank, its worker and host, then
    /// this). A timeout on a peer found stopped (or not answering) says so first:
    /// `process stopped, no progress for 458 ms`; other errors are their message.
    pub fn failure_reason(&self) -> String {
        match self {
            CommError::Timeout { rank: Some(_), after, silence, .. } if *silence != Silence::Unprobed => {
                format!("{}, no progress for {} ms", silence.describe(), after.as_millis())
            }
            other => other.to_string(),
        }
    }

    /// Whether two errors are of the same kind (variant), ignoring details.
    pub fn same_class(&self, other: &CommError) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_cause_display() {
        let c = RootCause { rank: Some(2), worker_id: "w2".into(), host: "host-a".into(), reason: "SIGKILL".into() };
        assert_eq!(c.to_string(), "rank 2 (worker w2 on host-a): SIGKILL");
        assert_eq!(RootCause::reason("shutdown").to_string(), "shutdown");
        let c = RootCause { rank: None, worker_id: "w1".into(), host: String::new(), reason: "left".into() };
        assert_eq!(c.to_string(), "(worker w1): left");
        let e = CommError::Timeout {
            rank: Some(3),
            after: Duration::from_secs(1),
            progress: None,
            silence: Silence::Unprobed,
        };
        assert_eq!(e.to_string(), "timed out after 1s waiting on rank 3");
        assert_eq!(e.failure_reason(), e.to_string());
    }

    /// A peer found stopped is named as stopped, in the error and in the reason that becomes
    /// the root cause every rank sees.
    #[test]
    fn a_stopped_peer_is_named_as_stopped() {
        let e = CommError::Timeout {
            rank: Some(1),
            after: Duration::from_millis(458),
            progress: None,
            silence: Silence::ProcessStopped,
        };
        assert_eq!(e.to_string(), "timed out after 458ms waiting on rank 1 (process stopped)");
        assert_eq!(e.failure_reason(), "process stopped, no progress for 458 ms");
        let cause = RootCause { rank: Some(1), worker_id: "w1".into(), host: "h".into(), reason: e.failure_reason() };
        assert_eq!(cause.to_string(), "rank 1 (worker w1 on h): process stopped, no progress for 458 ms");
        let remote = CommError::Timeout {
            rank: Some(1),
            after: Duration::from_millis(458),
            progress: None,
            silence: Silence::NoAnswer,
        };
        assert_eq!(remote.failure_reason(), "process does not answer liveness probes, no progress for 458 ms");
    }
}
