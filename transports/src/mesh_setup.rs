//! One generation's mesh set-up, the same for every transport: what TCP, shared memory and
//! RDMA share between "here are the peers" and "here are the links".
//!
//! Every transport links a pair the same way: the higher rank dials the lower one, retrying
//! with a growing pause ([`Backoff`]) until the peer listens, and the lower rank accepts.
//! What happens on a connection (TCP's handshake, shared memory's segment hand-over, RDMA's
//! queue-pair exchange) is the transport's own, in a task that ends as a [`Paired`]. The rest
//! is here, in [`gather`]: accepting connections while the set-up runs (at most
//! [`Rules::max_accepting`] handshakes at a time), collecting each pair's outcome into a
//! [`Gathering`] of links by rank, failing the set-up on the first fatal outcome, keeping a
//! note of every problem that is not fatal (an unauthenticated stranger, a dialer of another
//! generation, a refused carried link), and, when the connect deadline passes first, one
//! error that names every rank still missing with the last problem seen with each
//! ([`Gathering::incomplete`]).
//!
//! Which outcomes are fatal is the same everywhere: a dial that never succeeded before the
//! deadline, and a peer that authenticated and then disagreed (another world size, token or
//! segment). A connection that could not prove who it is can never fail a set-up, or any
//! local process or host could break another job's generation.

use crate::links::lock;
use crate::{Rank, TransportError};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;

/// How a pair's set-up task ended (a dial, an accepted connection, a carried link's re-bind).
pub(crate) enum Paired<L> {
    /// A link to this rank, authenticated and agreed.
    Linked(Rank, L),
    /// This connection's set-up failed without failing the mesh: a connection that did not
    /// authenticate, a dialer of another generation, a carried link that could not be
    /// re-bound. `claimed`: the rank it named, if any. Kept for the deadline's error.
    Noted { claimed: Option<Rank>, detail: String },
    /// The set-up fails with this error: a peer that could not be dialled before the
    /// deadline, or one that authenticated and disagrees.
    Failed(TransportError),
}

/// The last problem seen with each rank's connections (and one with connections that named
/// no valid rank), for the error of a set-up that misses its deadline.
#[derive(Default)]
pub(crate) struct Notes {
    by_rank: HashMap<Rank, String>,
    other: Option<String>,
}

impl Notes {
    /// Records a problem seen with a connection claiming to come from `claimed` (`None`, or
    /// a rank outside a world of `world`: a connection that named no valid rank).
    pub(crate) fn record(&mut self, world: u32, claimed: Option<Rank>, note: String) {
        match claimed.filter(|&r| r < world) {
            Some(rank) => {
                self.by_rank.insert(rank, note);
            }
            None => self.other = Some(note),
        }
    }

    /// The last problem seen with `rank`, if any.
    pub(crate) fn for_rank(&self, rank: Rank) -> Option<&str> {
        self.by_rank.get(&rank).map(String::as_str)
    }

    /// The last problem with a connection that named no valid rank.
    pub(crate) fn other(&self) -> Option<&str> {
        self.other.as_deref()
    }
}

/// Notes shared between a set-up and whatever else sees its connections (TCP's endpoint
/// routes connections to set-ups and notes the ones it refuses itself).
pub(crate) type SharedNotes = Arc<Mutex<Notes>>;

/// The pause between a dialer's attempts: doubles from `min` up to `max`.
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Pauses from `min`, doubling up to `max`.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Self { next: min, max }
    }

    /// Sleeps the next pause, or returns `false` at once if it would end at or past
    /// `deadline` (the dialer then gives up).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it skips this pause.
    pub(crate) async fn pause_before(&mut self, deadline: Instant) -> bool {
        let pause = self.next;
        if Instant::now() + pause >= deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        self.next = (pause * 2).min(self.max);
        true
    }
}

/// The links of one set-up so far, by rank, and the ranks it still waits for.
pub(crate) struct Gathering<L> {
    rank: Rank,
    /// The peers the set-up waits for (others may link early; they are kept, not awaited).
    planned: Vec<bool>,
    links: Vec<Option<L>>,
    missing: usize,
    notes: SharedNotes,
}

impl<L> Gathering<L> {
    /// A set-up of `rank` in a world of `planned.len()` ranks, waiting for a link to every
    /// rank marked in `planned` (never this rank itself).
    pub(crate) fn new(rank: Rank, mut planned: Vec<bool>, notes: SharedNotes) -> Self {
        if let Some(me) = planned.get_mut(rank as usize) {
            *me = false;
        }
        let missing = planned.iter().filter(|&&p| p).count();
        let links = planned.iter().map(|_| None).collect();
        Self { rank, planned, links, missing, notes }
    }

    /// The world's size.
    pub(crate) fn world(&self) -> u32 {
        self.planned.len() as u32
    }

    /// Whether the set-up waits for a link to `peer`.
    pub(crate) fn is_planned(&self, peer: Rank) -> bool {
        self.planned.get(peer as usize).copied().unwrap_or(false)
    }

    /// Whether every planned link is here.
    pub(crate) fn is_complete(&self) -> bool {
        self.missing == 0
    }

    /// Whether a link to `peer` is here.
    pub(crate) fn has(&self, peer: Rank) -> bool {
        self.links.get(peer as usize).is_some_and(Option::is_some)
    }

    /// Keeps `link` as the link to `peer` (in range, not this rank), returning the one it
    /// replaces: the dialer uses its last connection, so a fresh one wins.
    pub(crate) fn keep(&mut self, peer: Rank, link: L) -> Option<L> {
        let slot = self.links.get_mut(peer as usize)?;
        tracing::debug!(peer, "link up");
        let earlier = slot.replace(link);
        if earlier.is_none() && self.planned[peer as usize] {
            self.missing -= 1;
        }
        earlier
    }

    /// The plain rule for [`gather`]'s `admit`: keeps every link, the latest for a peer.
    pub(crate) fn keep_latest(&mut self, peer: Rank, link: L) {
        self.keep(peer, link);
    }

    /// Notes a problem that does not fail the set-up (see [`Notes::record`]).
    pub(crate) fn note(&self, claimed: Option<Rank>, detail: String) {
        tracing::debug!(?claimed, "a connection of the set-up failed: {detail}");
        lock(&self.notes).record(self.world(), claimed, detail);
    }

    /// The planned ranks with no link yet.
    pub(crate) fn absent(&self) -> Vec<Rank> {
        (0..self.world()).filter(|&r| self.planned[r as usize] && self.links[r as usize].is_none()).collect()
    }

    /// The error of a set-up over `what` (a transport's name, "TCP") that missed its connect
    /// deadline of `connect`: the absent ranks, and the last problem seen with each.
    pub(crate) fn incomplete(&self, what: &str, connect: Duration) -> TransportError {
        let absent = self.absent();
        let mut detail =
            format!("{what} mesh not complete within the connect deadline of {connect:?}; no link to ranks {absent:?}");
        let notes = lock(&self.notes);
        for &r in &absent {
            if let Some(n) = notes.for_rank(r) {
                detail.push_str(&format!("; {n}"));
            }
        }
        if let Some(n) = notes.other() {
            detail.push_str(&format!("; {n}"));
        }
        TransportError::Handshake { peer: absent.first().copied().unwrap_or(self.rank), detail }
    }

    /// The links, by rank.
    pub(crate) fn into_links(self) -> Vec<Option<L>> {
        self.links
    }
}

/// A set-up's pair tasks: its dials (and carried links' re-binds) and the handshakes of the
/// connections it accepted, kept apart so that the latter can be bounded.
pub(crate) struct PairTasks<L> {
    /// Dials and re-binds.
    pub(crate) dials: JoinSet<Paired<L>>,
    /// Handshakes of accepted connections.
    pub(crate) accepts: JoinSet<Paired<L>>,
}

impl<L: Send + 'static> PairTasks<L> {
    /// No tasks yet.
    pub(crate) fn new() -> Self {
        Self { dials: JoinSet::new(), accepts: JoinSet::new() }
    }

    /// The next task to end, of either kind; `None` when none runs.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`JoinSet::join_next`].
    pub(crate) async fn join_next(&mut self) -> Option<Result<Paired<L>, tokio::task::JoinError>> {
        tokio::select! {
            Some(done) = self.dials.join_next() => Some(done),
            Some(done) = self.accepts.join_next() => Some(done),
            else => None,
        }
    }
}

/// The connections a set-up accepts.
pub(crate) trait Arrivals {
    /// One accepted connection, not yet handshaken.
    type Conn: Send + 'static;

    /// The next connection. A source that has none to offer (a set-up that accepts nothing)
    /// stays pending; `Err` fails the set-up (its listener broke).
    ///
    /// # Cancel safety
    /// Must be cancel safe: [`gather`] drops it whenever a pair task ends first.
    fn next(&mut self) -> impl Future<Output = Result<Self::Conn, TransportError>> + Send;
}

/// A transport's rules for [`gather`].
pub(crate) struct Rules {
    /// The transport's name in errors ("TCP", "shared-memory", "RDMA").
    pub(crate) what: &'static str,
    /// The connect deadline's length, for the error that reports it missed.
    pub(crate) connect: Duration,
    /// When the set-up gives up.
    pub(crate) deadline: Instant,
    /// Most accepted connections in their handshake at once; one beyond is closed and noted
    /// (any local process or host can connect, so the handshakes in progress are bounded).
    pub(crate) max_accepting: usize,
}

/// Runs a set-up until every planned link is in `gathering`: accepts from `arrivals`, runs
/// `handshake` on each accepted connection in `tasks.accepts`, and hands every link that a
/// task of `tasks` (dials and accepts) made to `admit`, the transport's rule for keeping it
/// (usually [`Gathering::keep`]). Fails on the first [`Paired::Failed`], a failed task, a
/// broken listener, or the deadline ([`Gathering::incomplete`]). On return, tasks still
/// running are left in `tasks` (TCP serves them after its set-up).
///
/// # Cancel safety
/// Cancel safe: what was gathered stays in `gathering` and `tasks`; dropping those closes
/// every connection made so far.
pub(crate) async fn gather<L, A, H, F>(
    gathering: &mut Gathering<L>,
    tasks: &mut PairTasks<L>,
    arrivals: &mut A,
    handshake: H,
    mut admit: impl FnMut(&mut Gathering<L>, Rank, L),
    rules: &Rules,
) -> Result<(), TransportError>
where
    L: Send + 'static,
    A: Arrivals,
    H: Fn(A::Conn) -> F,
    F: Future<Output = Paired<L>> + Send + 'static,
{
    let span = tracing::Span::current();
    while !gathering.is_complete() {
        tokio::select! {
            conn = arrivals.next() => {
                let conn = conn?;
                if tasks.accepts.len() >= rules.max_accepting {
                    drop(conn);
                    let max = rules.max_accepting;
                    gathering.note(None, format!("refused a connection: {max} handshakes already in progress"));
                } else {
                    tasks.accepts.spawn(handshake(conn).instrument(span.clone()));
                }
            }
            Some(done) = tasks.join_next() => match done {
                Ok(Paired::Linked(peer, link)) => admit(gathering, peer, link),
                Ok(Paired::Noted { claimed, detail }) => gathering.note(claimed, detail),
                Ok(Paired::Failed(e)) => return Err(e),
                Err(e) => return Err(TransportError::Io(format!("{} set-up task failed: {e}", rules.what))),
            },
            () = tokio::time::sleep_until(rules.deadline) => {
                return Err(gathering.incomplete(rules.what, rules.connect));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// Connections from a channel (the test plays the listener).
    struct Channel(mpsc::Receiver<u32>);

    impl Arrivals for Channel {
        type Conn = u32;
        async fn next(&mut self) -> Result<u32, TransportError> {
            match self.0.recv().await {
                Some(c) => Ok(c),
                None => std::future::pending().await,
            }
        }
    }

    fn rules(deadline: Instant, max_accepting: usize) -> Rules {
        Rules { what: "test", connect: Duration::from_millis(200), deadline, max_accepting }
    }

    fn gathering(rank: Rank, planned: &[Rank], world: u32) -> Gathering<&'static str> {
        let marks = (0..world).map(|r| planned.contains(&r)).collect();
        Gathering::new(rank, marks, SharedNotes::default())
    }

    #[test]
    fn a_peer_outside_the_plan_is_kept_but_not_awaited_and_a_fresh_link_replaces_the_old() {
        let mut g = gathering(1, &[0, 2], 4);
        assert!(!g.is_complete());
        assert_eq!(g.keep(3, "early"), None);
        assert_eq!(g.absent(), vec![0, 2]);
        assert_eq!(g.keep(0, "first"), None);
        assert_eq!(g.keep(0, "second"), Some("first"));
        assert_eq!(g.absent(), vec![2]);
        assert_eq!(g.keep(2, "x"), None);
        assert!(g.is_complete());
        assert_eq!(g.keep(9, "out of range"), None);
        assert_eq!(g.into_links(), vec![Some("second"), None, Some("x"), Some("early")]);
    }

    #[test]
    fn the_deadline_error_names_each_absent_rank_with_its_last_problem() {
        let mut g = gathering(0, &[1, 2, 3], 4);
        g.keep(2, "up");
        g.note(Some(1), "first problem".into());
        g.note(Some(1), "last problem".into());
        g.note(Some(2), "linked after all".into());
        g.note(Some(40), "a stranger".into());
        let TransportError::Handshake { peer, detail } = g.incomplete("test", Duration::from_millis(200)) else {
            panic!("not a handshake error")
        };
        assert_eq!(peer, 1);
        assert_eq!(
            detail,
            "test mesh not complete within the connect deadline of 200ms; no link to ranks [1, 3]; last problem; a stranger"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_doubles_to_its_ceiling_and_stops_short_of_the_deadline() {
        let start = Instant::now();
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(40));
        let deadline = start + Duration::from_millis(100);
        let mut pauses = Vec::new();
        let mut at = start;
        while b.pause_before(deadline).await {
            pauses.push((Instant::now() - at).as_millis());
            at = Instant::now();
        }
        assert_eq!(pauses, vec![10, 20, 40]);
        assert!(Instant::now() < deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn a_set_up_gathers_dials_and_accepts_and_bounds_the_handshakes_in_progress() {
        let (tx, rx) = mpsc::channel(16);
        let mut arrivals = Channel(rx);
        let mut g = gathering(1, &[0, 2, 3], 4);
        let mut tasks = PairTasks::new();
        tasks.dials.spawn(async { Paired::Linked(0, "dialled") });
        // Two accepted connections: rank 2's handshake takes a while, the stranger's never ends
        // within the test; a third finds the bound (2) reached and is refused. The clock is
        // paused: the sleeps below are the handshakes' simulated lengths, which order the
        // events exactly (the runtime advances time only when every task waits).
        for c in [2u32, 99, 3] {
            tx.send(c).await.expect("send");
        }
        let handshake = |c: u32| async move {
            match c {
                99 => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Paired::Noted { claimed: None, detail: "never".into() }
                }
                c => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Paired::Linked(c, "accepted")
                }
            }
        };
        let deadline = Instant::now() + Duration::from_millis(200);
        let r = gather(&mut g, &mut tasks, &mut arrivals, handshake, Gathering::keep_latest, &rules(deadline, 2)).await;
        // Rank 3 was refused, so the set-up misses its deadline naming it, with the refusal.
        let Err(TransportError::Handshake { peer, detail }) = r else { panic!("expected the deadline's error") };
        assert_eq!(peer, 3);
        assert!(detail.contains("no link to ranks [3]"), "{detail}");
        assert!(detail.contains("2 handshakes already in progress"), "{detail}");
        assert!(g.has(0) && g.has(2) && !g.has(3));
        // Rank 3 dials again once a handshake slot is free: the set-up completes.
        tasks.accepts.abort_all();
        while tasks.join_next().await.is_some() {}
        tx.send(3).await.expect("send");
        let deadline = Instant::now() + Duration::from_millis(200);
        gather(&mut g, &mut tasks, &mut arrivals, handshake, Gathering::keep_latest, &rules(deadline, 2))
            .await
            .expect("complete");
        assert!(g.is_complete());
    }

    #[tokio::test(start_paused = true)]
    async fn a_fatal_outcome_fails_the_set_up_and_a_noted_one_does_not() {
        let (_tx, rx) = mpsc::channel(1);
        let mut arrivals = Channel(rx);
        let mut g = gathering(2, &[0, 1], 3);
        let mut tasks: PairTasks<&'static str> = PairTasks::new();
        tasks.dials.spawn(async { Paired::Noted { claimed: Some(0), detail: "a stale carried link".into() } });
        // The fatal outcome comes 1 ms (of the paused clock) after the noted one, so the set-up
        // has taken the note before it fails.
        tasks.dials.spawn(async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Paired::Failed(TransportError::Handshake { peer: 1, detail: "disagrees".into() })
        });
        let deadline = Instant::now() + Duration::from_secs(1);
        let r = gather(
            &mut g,
            &mut tasks,
            &mut arrivals,
            |_: u32| async { Paired::Linked(0, "x") },
            Gathering::keep_latest,
            &rules(deadline, 4),
        )
        .await;
        assert!(matches!(r, Err(TransportError::Handshake { peer: 1, .. })));
        assert_eq!(lock(&g.notes).for_rank(0), Some("a stale carried link"));
    }
}
