//! The data plane's model, the one part of a simulated worker that is the simulation's own
//! (the real data plane is TCP and shared memory): a lock-step ring over the [`Ledger`]'s
//! state.
//!
//! A step completes when every member has arrived and no fault sits on the ring, and every
//! member then learns whether any of them had a re-formation pending (the flags
//! `cohort-worker train` agrees on at each commit point). A rank whose predecessor died sees
//! the link close (PEER_CLOSED, at once); a rank that hears nothing from its predecessor for
//! the no-progress deadline times out naming it, with the progress a ring would show
//! (nothing received when the silence is on its own incoming link, one message otherwise),
//! which is what makes timeout cascades. A revoked communicator (the membership machine's
//! `Abort`) fails the step at once.

use crate::ledger::{now_ms, Ledger, Shared};
use crate::worker::worker_id;
use cohort::RootCause;
use cohort_proto::v1::failure_report::FailureKind;
use std::time::Duration;

/// One rank's communicator in one generation. The rank knows the generation's size and its
/// predecessor's entry (from its view, whole or sparse); the model's network knows where every
/// rank runs (the ledger's placements), as sockets would.
pub(crate) struct Ring<'a> {
    pub(crate) shared: &'a Shared,
    /// This worker's index.
    pub(crate) index: usize,
    pub(crate) generation: u64,
    /// The generation's size.
    pub(crate) size: u32,
    pub(crate) rank: u32,
    /// The far end of the incoming link (worker id, incarnation): the predecessor's entry as
    /// this rank's view gives it (the peer the link is dialled from), or, for a link carried
    /// over, the member that held the rank it is carried from.
    pub(crate) pred: &'a (String, u64),
    /// The generation and rank the incoming link was carried from, if it was.
    pub(crate) carried_from: Option<(u64, u32)>,
    /// The no-progress deadline.
    pub(crate) no_progress: Duration,
}

/// How a step's collective ended.
pub(crate) enum Outcome {
    /// Every member completed the step; `reform`: some member had a re-formation pending.
    Done { reform: bool },
    /// The communicator was revoked, with this cause.
    Revoked(RootCause),
    /// The driver asked the workers to finish.
    Finishing,
    /// A link failed, as this rank detected it.
    Failed(Failure),
}

/// A failure as a rank detects it on its link from `peer`.
pub(crate) struct Failure {
    pub(crate) kind: FailureKind,
    pub(crate) peer: u32,
    pub(crate) received: u64,
}

fn alive(ledger: &Ledger, index: usize, incarnation: u64) -> bool {
    ledger.workers.get(&index).is_some_and(|v| v.up && v.incarnation == incarnation)
}

impl Ring<'_> {
    /// The step the generation resumes after, once its sync (step 0) completed.
    pub(crate) fn resumed(&self) -> u64 {
        let ledger = self.shared.lock();
        ledger.generations.get(&self.generation).and_then(|g| g.resume).unwrap_or(0)
    }

    /// Step `step`'s collective (step 0: the sync after connecting, which agrees the step to
    /// resume after: the newest commit of any member, whose state is restored from it as a
    /// checkpoint would be); `pending` is this rank's re-formation flag for the commit point
    /// after it, `revoked` the communicator's revocation, if any.
    ///
    /// # Cancel safety
    /// Cancel safe: an abandoned step leaves only this rank's arrival behind, as a crash does.
    pub(crate) async fn step(&self, step: u64, pending: bool, revoked: impl Fn() -> Option<RootCause>) -> Outcome {
        let (g, n, rank) = (self.generation, self.size as usize, self.rank);
        {
            let mut ledger = self.shared.lock();
            ledger.arrivals.entry((g, step)).or_default().insert(rank);
            if pending {
                ledger.reform.insert((g, step));
            }
        }
        let start = now_ms();
        let pred = (rank as usize + n - 1) % n;
        loop {
            tokio::time::sleep(Duration::from_millis(2)).await;
            while self.shared.lock().paused.contains(&self.index) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if let Some(cause) = revoked() {
                return Outcome::Revoked(cause);
            }
            let now = now_ms();
            let mut ledger = self.shared.lock();
            if ledger.finish {
                return Outcome::Finishing;
            }
            let done = |ledger: &Ledger| Outcome::Done { reform: ledger.reform.contains(&(g, step)) };
            if ledger.completed.contains(&(g, step)) {
                return done(&ledger);
            }
            let arrived = ledger.arrivals.get(&(g, step)).map_or(0, |a| a.len());
            let placed = |ledger: &Ledger, r: usize| {
                ledger.generations.get(&g).and_then(|record| record.placed.get(&(r as u32)).copied())
            };
            // A rank not placed yet has not connected: nothing is known of it.
            let faulty = |r: usize| -> (bool, bool) {
                let Some((idx, inc)) = placed(&ledger, r) else { return (false, false) };
                let dead = !alive(&ledger, idx, inc);
                let silent = placed(&ledger, (r + n - 1) % n)
                    .is_some_and(|(prev, _)| ledger.paused.contains(&prev) || ledger.silent.contains(&(prev, idx)));
                (dead, silent)
            };
            // Checked only once everyone has arrived: every rank polls every 2 ms, and a scan
            // of the whole ring at each poll would cost O(N^2) per poll round.
            let ring_fault = || {
                (0..n).any(|r| {
                    let (dead, silent) = faulty(r);
                    dead || silent
                })
            };
            if arrived == n && !ring_fault() {
                ledger.completed.insert((g, step));
                if step == 0 {
                    let ranks: Vec<usize> = (0..n).filter_map(|r| placed(&ledger, r).map(|(idx, _)| idx)).collect();
                    let newest = ranks.iter().filter_map(|i| ledger.committed.get(i)).max().copied().unwrap_or(0);
                    ledger.generations.entry(g).or_default().resume = Some(newest);
                }
                return done(&ledger);
            }
            // The incoming link comes from the predecessor this rank's view names, or is a
            // link carried over from whoever held its old rank: either way another process
            // than the one running the predecessor's rank is a wrong member list or a wrong
            // carry (the handshake or the re-bind would refuse the link).
            if let Some((idx, inc)) = placed(&ledger, pred) {
                if (worker_id(idx), inc) != *self.pred {
                    drop(ledger);
                    let how = match self.carried_from {
                        Some((from_g, from_r)) => format!(
                            "worker-{}'s link carried into generation {g} from rank {from_r} of generation {from_g} reaches {:?}",
                            self.index, self.pred
                        ),
                        None => format!("worker-{}'s view of generation {g} names {:?}", self.index, self.pred),
                    };
                    self.shared
                        .violation(now, format!("{how} at rank {pred}, which worker-{idx} (incarnation {inc}) runs"));
                    return Outcome::Failed(Failure { kind: FailureKind::PeerClosed, peer: pred as u32, received: 0 });
                }
            }
            let (pred_dead, _) = faulty(pred);
            let (_, my_link_silent) = faulty(rank as usize);
            let pred_arrived = ledger.arrivals.get(&(g, step)).is_some_and(|a| a.contains(&(pred as u32)));
            if pred_dead && now >= start + 10 {
                return Outcome::Failed(Failure { kind: FailureKind::PeerClosed, peer: pred as u32, received: 0 });
            }
            if now >= start + self.no_progress.as_millis() as u64 {
                let received = u64::from(!(my_link_silent || pred_dead || !pred_arrived));
                return Outcome::Failed(Failure { kind: FailureKind::Timeout, peer: pred as u32, received });
            }
        }
    }
}
