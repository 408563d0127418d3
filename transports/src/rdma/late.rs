//! A busy rank is not a hung rank, on RDMA links: what a wait that moved nothing past the
//! no-progress deadline does next.
//!
//! RDMA links learn no deadline of their own (a completion says nothing about the gaps a
//! link normally has). With learning on ([`crate::Deadlines::learning`]), a wait that has
//! seen no completion from its peer for [`crate::Deadlines::no_progress`] asks the peer's
//! process where it is, with the status probe of [`crate::liveness`] sent to the UDP port
//! equal to the peer's bootstrap listener (its [`super::RdmaEndpoint`] answers there), and
//! judges the answer as the TCP and shared-memory links do ([`crate::activity::locate`]):
//! - silent, stopped or gone: the wait fails at once, with what the probe found
//!   ([`crate::Silence::NoAnswer`], ...);
//! - running and inside the operation, or running without a board for the mesh, or no
//!   verdict at all (no responder, a local failure to probe): the wait fails at the ceiling,
//!   as with learning off ([`crate::Silence::Unprobed`]);
//! - running and late to the operation: the wait goes on, asking again every no-progress
//!   interval, until the late-rank bound (`max(late_rank, no_progress)` from the link's last
//!   progress), and then fails with [`crate::Silence::Late`].
//!
//! [`hear`] and [`decide`] are that judgement, pure and tested without a device; the wait
//! that applies them is `Inner::wait_for` (`super::progress`).

use crate::activity::{self, CpuUse, Lateness, Whereabouts};
use crate::liveness::{Answer, Status};
use crate::{Rank, Silence};
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Where a link asks whether its peer's process runs, and where it is.
#[derive(Debug)]
pub(super) struct PeerProbe {
    /// The peer's bootstrap address (its liveness responder listens on the same port, UDP).
    pub(super) target: SocketAddr,
    /// Set once the responder answered after the mesh came up; until then a stall fails at
    /// the ceiling unasked (a silence proves nothing about a peer never heard).
    pub(super) verified: Arc<AtomicBool>,
}

/// What a probe said of the peer, for the wait on one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Heard {
    /// The peer's process did not answer, is stopped or gone: what to report.
    Silent(Silence),
    /// It runs inside the operation, or nothing can be said of where it is (no board for
    /// the mesh, no responder on the port, the probe could not be sent): the ceiling applies.
    Inside,
    /// It runs and is late to the operation.
    Late {
        /// Why it counts as late.
        lateness: Lateness,
        /// The late rank the wait is behind (the peer, or the root its board names).
        root: Rank,
        /// The peer's process CPU time, if it said.
        cpu: Option<Duration>,
    },
}

/// Judges a probe's `answer` about `peer` for a wait of rank `me` on operation `seq` (pure).
pub(super) fn hear(answer: Answer, seq: u32, peer: Rank, me: Rank) -> Heard {
    if let Some(silence) = answer.silence() {
        return Heard::Silent(silence);
    }
    match answer {
        Answer::Alive(Some(Status { presence: Some(p), cpu })) => match activity::locate(p, seq, me) {
            Whereabouts::Late(lateness) => Heard::Late { lateness, root: activity::late_root(peer, lateness, p), cpu },
            Whereabouts::InCollective => Heard::Inside,
        },
        _ => Heard::Inside,
    }
}

/// The bounds of one wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Bounds {
    /// The no-progress ceiling ([`crate::Deadlines::no_progress`]): also how often a late
    /// peer is asked again.
    pub(super) no_progress: Duration,
    /// How long a late peer is waited for: `max(late_rank, no_progress)`.
    pub(super) late: Duration,
}

impl Bounds {
    /// The bounds of `deadlines` (the late bound is the ceiling when learning is off).
    pub(super) fn of(deadlines: &crate::Deadlines) -> Self {
        let no_progress = deadlines.no_progress;
        Self { no_progress, late: deadlines.learning.map_or(no_progress, |l| l.late_rank.max(no_progress)) }
    }
}

/// What a wait does next ([`decide`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// Fail the link with `Timeout { after, silence }`.
    Fail {
        /// The `after` to report.
        after: Duration,
        /// What was found out about the peer.
        silence: Silence,
    },
    /// Keep waiting; ask again after this long (unless progress comes first).
    Wait(Duration),
}

/// What a wait that has seen no progress for `waited` does, given what it `heard` (and, for
/// a late peer, how it used the CPU while late: `cpu`) (pure).
pub(super) fn decide(heard: Heard, cpu: CpuUse, waited: Duration, bounds: Bounds) -> Next {
    match heard {
        Heard::Silent(silence) => Next::Fail { after: waited, silence },
        Heard::Inside if waited >= bounds.no_progress => {
            Next::Fail { after: bounds.no_progress, silence: Silence::Unprobed }
        }
        Heard::Inside => Next::Wait(bounds.no_progress - waited),
        Heard::Late { .. } if waited >= bounds.late => {
            Next::Fail { after: bounds.late, silence: Silence::Late { cpu } }
        }
        Heard::Late { .. } => Next::Wait(bounds.no_progress.min(bounds.late - waited)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::{Activity, Presence};
    use crate::{Deadlines, Learning};

    fn s(v: u64) -> Duration {
        Duration::from_secs(v)
    }

    const BOUNDS: Bounds = Bounds { no_progress: Duration::from_secs(10), late: Duration::from_secs(1800) };

    fn alive(p: Presence) -> Answer {
        Answer::Alive(Some(Status { presence: Some(p), cpu: Some(s(3)) }))
    }

    #[test]
    fn bounds_follow_the_deadlines() {
        let learned = Deadlines { no_progress: s(10), connect: s(30), learning: Some(Learning::default()) };
        assert_eq!(Bounds::of(&learned), BOUNDS);
        // A late-rank bound below the ceiling counts as the ceiling.
        let short = Deadlines { learning: Some(Learning { floor: s(1), late_rank: s(2) }), ..Deadlines::default() };
        assert_eq!(Bounds::of(&short), Bounds { no_progress: s(10), late: s(10) });
        assert_eq!(Bounds::of(&Deadlines::fixed(s(7), s(30))), Bounds { no_progress: s(7), late: s(7) });
    }

    #[test]
    fn a_silent_stopped_or_gone_peer_fails_at_once_with_what_was_found() {
        for (answer, silence) in [
            (Answer::Silent, Silence::NoAnswer),
            (Answer::Stopped, Silence::ProcessStopped),
            (Answer::Gone, Silence::ProcessGone),
        ] {
            let heard = hear(answer, 5, 1, 0);
            assert_eq!(heard, Heard::Silent(silence));
            assert_eq!(decide(heard, CpuUse::Unknown, s(10), BOUNDS), Next::Fail { after: s(10), silence });
            // Also when it was late before: a late peer then stopped fails at that probe.
            assert_eq!(decide(heard, CpuUse::Busy, s(300), BOUNDS), Next::Fail { after: s(300), silence });
        }
    }

    #[test]
    fn a_peer_inside_the_operation_or_unknown_meets_the_ceiling() {
        let board = Activity::new();
        let _call = board.enter(5);
        let heard = hear(alive(board.presence(5).unwrap()), 5, 1, 0);
        assert_eq!(heard, Heard::Inside);
        assert_eq!(
            decide(heard, CpuUse::Unknown, s(10), BOUNDS),
            Next::Fail { after: s(10), silence: Silence::Unprobed }
        );
        // Past the ceiling by a while (it was late, then entered and blocks inside): at once.
        assert_eq!(decide(heard, CpuUse::Busy, s(95), BOUNDS), Next::Fail { after: s(10), silence: Silence::Unprobed });
        assert_eq!(decide(heard, CpuUse::Unknown, s(4), BOUNDS), Next::Wait(s(6)), "not due yet");
        // No board for the mesh, nobody on the port, no probe sent: no verdict, the ceiling.
        for answer in [
            Answer::Alive(None),
            Answer::Alive(Some(Status { presence: None, cpu: None })),
            Answer::NoResponder,
            Answer::LocalFailure,
        ] {
            assert_eq!(hear(answer, 5, 1, 0), Heard::Inside, "{answer:?}");
        }
    }

    #[test]
    fn a_late_peer_is_waited_for_up_to_the_late_bound_asked_again_every_ceiling() {
        let board = Activity::new();
        drop(board.enter(4));
        let heard = hear(alive(board.presence(5).unwrap()), 5, 1, 0);
        assert_eq!(heard, Heard::Late { lateness: Lateness::NotEntered { last: Some(4) }, root: 1, cpu: Some(s(3)) });
        assert_eq!(decide(heard, CpuUse::Unknown, s(10), BOUNDS), Next::Wait(s(10)));
        assert_eq!(decide(heard, CpuUse::Busy, s(1000), BOUNDS), Next::Wait(s(10)));
        // The last look lands on the bound itself.
        assert_eq!(decide(heard, CpuUse::Busy, s(1795), BOUNDS), Next::Wait(s(5)));
        for cpu in [CpuUse::Busy, CpuUse::Idle, CpuUse::Unknown] {
            assert_eq!(
                decide(heard, cpu, s(1800), BOUNDS),
                Next::Fail { after: s(1800), silence: Silence::Late { cpu } }
            );
        }
        // Learning off (bounds equal): late or not, the ceiling.
        let fixed = Bounds { no_progress: s(10), late: s(10) };
        assert_eq!(
            decide(heard, CpuUse::Idle, s(10), fixed),
            Next::Fail { after: s(10), silence: Silence::Late { cpu: CpuUse::Idle } }
        );
    }

    #[test]
    fn between_calls_and_behind_a_late_rank_are_late_and_a_cycle_is_not() {
        let board = Activity::new();
        drop(board.enter(5));
        assert!(matches!(
            hear(alive(board.presence(5).unwrap()), 5, 1, 0),
            Heard::Late { lateness: Lateness::BetweenCalls, root: 1, .. }
        ));
        let _call = board.enter(5);
        let _wait = board.late_wait(7);
        // Behind late rank 7: the wait is behind 7, not behind the neighbour.
        assert!(matches!(
            hear(alive(board.presence(5).unwrap()), 5, 1, 0),
            Heard::Late { lateness: Lateness::BehindLate, root: 7, .. }
        ));
        // Rank 7 itself asking: a cycle of waits inside the collective.
        assert_eq!(hear(alive(board.presence(5).unwrap()), 5, 1, 7), Heard::Inside);
    }
}
