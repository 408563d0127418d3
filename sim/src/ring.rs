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

use crate::ledger::{now_ms, Group, Ledger, Shared};
use cohort::RootCause;
use cohort_proto::v1::failure_report::FailureKind;
use std::time::Duration;

/// One rank's communicator in one generation.
pub(crate) struct Ring<'a> {
    pub(crate) shared: &'a Shared,
    /// This worker's index.
    pub(crate) index: usize,
    pub(crate) generation: u64,
    pub(crate) members: &'a Group,
    pub(crate) rank: u32,
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

fn index_of(worker_id: &str) -> Option<usize> {
    worker_id.strip_prefix('w').and_then(|i| i.parse().ok())
}

fn alive(ledger: &Ledger, index: usize, incarnation: u64) -> bool {
    ledger.workers.get(&index).is_some_and(|v| v.up && v.incarnation == incarnation)
}

impl Ring<'_> {
    /// The newest commit of the members: the step the generation resumes after (the state
    /// is restored from the member that holds it, as a checkpoint would be).
    pub(crate) fn resume_step(&self) -> u64 {
        let ledger = self.shared.lock();
        let committed = self.members.iter().filter_map(|(w, _)| index_of(w)).filter_map(|i| ledger.committed.get(&i));
        committed.max().copied().unwrap_or(0)
    }

    /// Step `step`'s collective; `pending` is this rank's re-formation flag for the commit
    /// point after it, `revoked` the communicator's revocation, if any.
    ///
    /// # Cancel safety
    /// Cancel safe: an abandoned step leaves only this rank's arrival behind, as a crash does.
    pub(crate) async fn step(&self, step: u64, pending: bool, revoked: impl Fn() -> Option<RootCause>) -> Outcome {
        let (g, members, rank) = (self.generation, self.members, self.rank);
        let n = members.len();
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
            let faulty = |r: usize| -> (bool, bool) {
                let (w, inc) = &members[r];
                let idx = index_of(w).unwrap_or(usize::MAX);
                let dead = !alive(&ledger, idx, *inc);
                let prev = index_of(&members[(r + n - 1) % n].0).unwrap_or(usize::MAX);
                let silent = ledger.paused.contains(&prev) || ledger.silent.contains(&(prev, idx));
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
                return done(&ledger);
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
