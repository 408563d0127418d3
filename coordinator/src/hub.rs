//! Following the store: [`PrefixFollower`] keeps a consistent view of a key prefix (one
//! read, then a watch resumed across errors), and [`Hub`] is one job's live view on this
//! replica, shared by the RPCs that wait on it (Rendezvous long polls, Watch streams) and
//! the ones that read it (Heartbeat, Commit), so that a thousand waiters cost one store
//! watch.

use crate::config::JobSettings;
use crate::keys;
use crate::records::{self, EndedRecord, GenerationRecord, JobState};
use crate::rendezvous;
use crate::store::{KeyValue, Store, StoreError, WatchEvent, WatchStream};
use cohort_proto::v1 as pb;
use futures::{FutureExt, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

/// What a [`PrefixFollower`] saw next.
#[derive(Debug)]
pub enum Batch {
    /// Changes, in revision order; a batch never splits one revision's events.
    Events(Vec<WatchEvent>),
    /// The history was lost (compaction): here is the whole prefix again, at this revision.
    Reset(Vec<KeyValue>, i64),
}

/// A consistent, resumable view of every key under a prefix.
pub struct PrefixFollower {
    store: Arc<dyn Store>,
    prefix: String,
    stream: Option<WatchStream>,
    /// The revision up to which changes have been delivered.
    revision: i64,
    /// An event read ahead of a batch boundary.
    pending: Option<WatchEvent>,
}

fn event_revision(e: &WatchEvent) -> i64 {
    match e {
        WatchEvent::Put(kv) => kv.mod_revision,
        WatchEvent::Delete { revision, .. } => *revision,
    }
}

impl PrefixFollower {
    /// Reads the prefix and starts watching it from the read's revision + 1.
    ///
    /// # Cancel safety
    /// Cancel safe (nothing is left behind but a dropped watch).
    pub async fn start(store: Arc<dyn Store>, prefix: &str) -> Result<(Self, Vec<KeyValue>, i64), StoreError> {
        let (kvs, revision) = store.get_prefix(prefix).await?;
        let stream = store.watch_prefix(prefix, revision + 1).await?;
        Ok((Self { store, prefix: prefix.to_string(), stream: Some(stream), revision, pending: None }, kvs, revision))
    }

    /// The revision this follower has delivered up to.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Waits for the next changes. Store errors are retried here (with backoff, bounded at
    /// 1 s between tries), so this only returns with changes.
    ///
    /// # Cancel safety
    /// Cancel safe: it awaits only before it has taken an event from the store (a read-ahead
    /// event is kept in `self`), never while holding a batch, so no event is lost if the
    /// future is dropped; dropping it while resuming simply resumes again next time.
    pub async fn next(&mut self) -> Batch {
        let mut retry = Duration::from_millis(20);
        loop {
            let Some(stream) = self.stream.as_mut() else {
                match self.store.watch_prefix(&self.prefix, self.revision + 1).await {
                    Ok(s) => {
                        self.stream = Some(s);
                        retry = Duration::from_millis(20);
                        continue;
                    }
                    Err(StoreError::Compacted(_)) => match self.store.get_prefix(&self.prefix).await {
                        Ok((kvs, revision)) => {
                            self.revision = revision;
                            self.pending = None;
                            return Batch::Reset(kvs, revision);
                        }
                        Err(e) => {
                            tracing::warn!(prefix = %self.prefix, error = %e, "store read failed while resyncing; retrying");
                        }
                    },
                    Err(e) => {
                        tracing::warn!(prefix = %self.prefix, error = %e, "store watch failed; retrying");
                    }
                }
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(Duration::from_secs(1));
                continue;
            };
            let first = match self.pending.take() {
                Some(e) => e,
                None => match stream.next().await {
                    Some(Ok(e)) => e,
                    Some(Err(StoreError::Compacted(_))) | None | Some(Err(_)) => {
                        tracing::debug!(prefix = %self.prefix, revision = self.revision, "store watch ended; resuming");
                        self.stream = None;
                        continue;
                    }
                },
            };
            let mut batch = vec![first];
            // Drain what is ready now, without waiting: a backend makes all events of one
            // revision ready together (see `Store::watch_prefix`), so the batch ends on a
            // revision boundary. Polled outside the cooperative budget so that an exhausted
            // budget cannot end a batch in the middle of a revision; and with no await
            // between taking events and returning them, a dropped future loses none.
            loop {
                let last = batch.last().map(event_revision).unwrap_or(0);
                let next = match tokio::task::unconstrained(stream.next()).now_or_never() {
                    Some(Some(Ok(e))) => e,
                    Some(_) => {
                        self.stream = None;
                        break;
                    }
                    None => break,
                };
                if batch.len() >= 4096 && event_revision(&next) != last {
                    self.pending = Some(next);
                    break;
                }
                batch.push(next);
            }
            if let Some(last) = batch.last() {
                self.revision = self.revision.max(event_revision(last));
            }
            return Batch::Events(batch);
        }
    }
}

/// One job's live view on this replica.
///
/// The view is one [`JobState`] that the hub's task updates in place, batch by batch.
/// Requests read it under a short lock ([`Hub::read`]); a copy ([`Hub::state`]) is made only
/// when a caller needs one across an await, at most once per change. Publishing a copy per
/// batch of writes, as the view did, cost O(members) per join and per wait: O(N²) for a
/// formation of N members.
pub struct Hub {
    /// The job.
    pub job: String,
    view: Arc<View>,
    /// The revision of the view after each change that is not bookkeeping.
    changes: watch::Receiver<i64>,
    /// [`pending`] of the state, evaluated once per change rather than per request.
    pending: watch::Receiver<Option<u32>>,
    /// What long polls and new watchers wait on, re-sent only when it changes.
    signal: watch::Receiver<Arc<Signal>>,
    events: broadcast::Sender<Arc<pb::JobEvent>>,
    task: tokio::task::JoinHandle<()>,
}

/// The state shared between a hub's task (the only writer) and the requests reading it.
#[derive(Default)]
struct View {
    /// The state, updated in place. Sync locks, never held across an await.
    live: RwLock<JobState>,
    /// A copy of `live` for [`Hub::state`], with the change count it was taken at.
    copy: Mutex<Option<(u64, Arc<JobState>)>>,
    /// Changes (batches that were not bookkeeping) applied so far.
    changes: AtomicU64,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Hub {
    /// Runs `f` on the job's state now (as of the last change this replica has seen). `f`
    /// runs under the view's lock: keep it short, and never block in it.
    pub fn read<T>(&self, f: impl FnOnce(&JobState) -> T) -> T {
        f(&self.view.live.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// The members of generation `number` as formed under shard set `set`, when that is the
    /// generation this view holds (a copy: O(members), no decoding).
    pub fn members_of(&self, number: u64, set: &crate::records::ShardSet) -> Option<Vec<crate::records::Placed>> {
        self.read(|state| {
            let (g, _) = state.generation.as_ref()?;
            (g.number == number && g.shards.as_ref() == Some(set)).then(|| g.members.clone())
        })
    }

    /// A copy of the job's state now, for a caller that holds it across an await. Copied
    /// at most once per change (O(members)); prefer [`Hub::read`] on request paths.
    pub fn state(&self) -> Arc<JobState> {
        let mut copy = self.view.copy.lock().unwrap_or_else(PoisonError::into_inner);
        let live = self.view.live.read().unwrap_or_else(PoisonError::into_inner);
        // Read under the live lock: the writer bumps the count while holding it.
        let changes = self.view.changes.load(Ordering::Acquire);
        if let Some((_, state)) = copy.as_ref().filter(|(at, _)| *at == changes) {
            return state.clone();
        }
        let state = Arc::new(live.clone());
        *copy = Some((changes, state.clone()));
        state
    }

    /// A receiver of the view's revision after each change that is not bookkeeping.
    pub fn subscribe_changes(&self) -> watch::Receiver<i64> {
        self.changes.clone()
    }

    /// The job's [`Signal`] now.
    pub fn signal(&self) -> Arc<Signal> {
        self.signal.borrow().clone()
    }

    /// A receiver of [`Signal`] changes (for long polls): it wakes only when a generation
    /// forms, is revoked, the job ends or a member leaves, not on every join or wait, so a
    /// thousand waiting members cost a thousand wake-ups per formation rather than per
    /// arrival.
    pub fn subscribe_signal(&self) -> watch::Receiver<Arc<Signal>> {
        self.signal.clone()
    }

    /// `Some(joiners)` when the active generation should re-form at its next commit point
    /// (the rendezvous evaluation of the state, as of the last change this replica has seen,
    /// or of the moment an exclusion ended). Heartbeat
    /// and Commit answers read it: evaluating the rendezvous per request would cost every
    /// heartbeat of a large job a walk over all its members.
    pub fn pending(&self) -> Option<u32> {
        *self.pending.borrow()
    }

    /// A receiver of the job's events (generation formed/revoked, re-formation pending,
    /// ended), in order.
    pub fn subscribe_events(&self) -> broadcast::Receiver<Arc<pb::JobEvent>> {
        self.events.subscribe()
    }
}

/// The newest generation as long polls need it, built once per generation rather than once
/// per waiting member: its protocol form and an index of its ranks by worker (and, built on
/// first use, by host).
#[derive(Debug)]
pub struct Formed {
    /// The generation number.
    pub number: u64,
    /// As the protocol carries it (the whole member list, its size and digest).
    pub proto: pb::Generation,
    /// Worker id to (incarnation, rank).
    ranks: HashMap<String, (u64, u32)>,
    /// Host to its ranks in rank order, built by the first `Members` call that asks by host.
    hosts: OnceLock<HashMap<String, Vec<u32>>>,
    /// The host runs, built by the first sparse answer ([`Formed::sparse_for`]).
    runs: OnceLock<HostRuns>,
}

/// A generation's host runs (`cohort_proto::host_runs`) and where each run starts.
#[derive(Debug)]
struct HostRuns {
    /// As the protocol carries them.
    entries: Vec<pb::HostRuns>,
    /// The first rank of every run, ascending.
    starts: Vec<u32>,
}

impl Formed {
    /// The index of generation `g`.
    pub fn of(g: &GenerationRecord) -> Self {
        let ranks =
            g.members.iter().enumerate().map(|(r, m)| (m.worker_id.clone(), (m.incarnation, r as u32))).collect();
        Self { number: g.number, proto: g.to_proto(), ranks, hosts: OnceLock::new(), runs: OnceLock::new() }
    }

    /// The rank of `(worker, incarnation)`, if a member. O(1).
    pub fn rank_of(&self, worker: &str, incarnation: u64) -> Option<u32> {
        self.ranks.get(worker).filter(|(inc, _)| *inc == incarnation).map(|(_, r)| *r)
    }

    /// Number of members.
    pub fn size(&self) -> u32 {
        self.proto.members.len() as u32
    }

    /// The member of rank `rank`, if in range. O(1).
    pub fn member(&self, rank: u32) -> Option<&pb::Member> {
        self.proto.members.get(rank as usize)
    }

    /// The ranks whose member's host is `host`, in rank order: O(ranks on that host) once
    /// the index is built (O(members), on the first call for this generation).
    pub fn ranks_on_host(&self, host: &str) -> &[u32] {
        let hosts = self.hosts.get_or_init(|| {
            let mut hosts: HashMap<String, Vec<u32>> = HashMap::new();
            for m in &self.proto.members {
                hosts.entry(m.host.clone()).or_default().push(m.rank);
            }
            hosts
        });
        hosts.get(host).map_or(&[], Vec::as_slice)
    }

    /// The compact answer to the member of rank `rank`: no member list, but its size, the
    /// digest, the caller's rank and its own entry, and with `partners` its partners' entries
    /// ([`cohort_proto::partner_ranks`]). O(1) members copied, or O(log N) with `partners`.
    pub fn compact_for(&self, rank: u32, partners: bool) -> pb::Generation {
        let members = if partners {
            cohort_proto::partner_ranks(rank, self.size()).into_iter().filter_map(|p| self.member(p).cloned()).collect()
        } else {
            Vec::new()
        };
        pb::Generation { rank: Some(rank), member: self.member(rank).cloned(), members, ..without_members(&self.proto) }
    }

    /// The sparse answer to the member of rank `rank` (a `Rendezvous` asked with `layout`):
    /// the compact answer with the entries of its partners and of its host run, ascending,
    /// and the host runs. O(log N + ranks on its host + run-length changes) copied; the runs
    /// are built once per generation, O(N).
    pub fn sparse_for(&self, rank: u32) -> pb::Generation {
        let runs = self.runs.get_or_init(|| {
            // The runs every member derives alike, from a whole answer as from this one.
            let entries = cohort_proto::layout_runs(&self.proto.members);
            let mut starts = Vec::new();
            let mut next = 0u32;
            for length in cohort_proto::run_lengths(&entries, self.size()).unwrap_or_default() {
                starts.push(next);
                next += length;
            }
            HostRuns { entries, starts }
        });
        let run = runs.starts.partition_point(|&start| start <= rank).saturating_sub(1);
        let first = runs.starts.get(run).copied().unwrap_or(0);
        let end = runs.starts.get(run + 1).copied().unwrap_or(self.size());
        let mut wanted = cohort_proto::partner_ranks(rank, self.size());
        wanted.extend((first..end).filter(|&r| r != rank));
        wanted.sort_unstable();
        wanted.dedup();
        let members = wanted.into_iter().filter_map(|p| self.partner_entry(p)).collect();
        pb::Generation {
            rank: Some(rank),
            member: self.member(rank).cloned(),
            members,
            host_runs: runs.entries.clone(),
            ..without_members(&self.proto)
        }
    }
}

impl Formed {
    /// The entry of rank `p` in a sparse answer: its member's record (or, with the planted
    /// bug on, its successor's relabelled as `p`'s).
    fn partner_entry(&self, p: u32) -> Option<pb::Member> {
        #[cfg(feature = "test-support")]
        if planted::wrong_partner() {
            let mut wrong = self.member((p + 1) % self.size())?.clone();
            wrong.rank = p;
            return Some(wrong);
        }
        self.member(p).cloned()
    }
}

/// Bugs a test plants on purpose, to show that the deterministic simulation catches them
/// (`test-support` only). Per thread: the simulation runs every replica on one.
#[cfg(feature = "test-support")]
pub mod planted {
    use std::cell::Cell;

    thread_local! {
        static WRONG_PARTNER: Cell<bool> = const { Cell::new(false) };
        static STALE_BEAT_WRITES: Cell<bool> = const { Cell::new(false) };
    }

    /// Plants (or removes) a bug in sparse answers made on this thread: every partner or
    /// host-mate entry is the next rank's member, labelled with the partner's rank.
    pub fn set_wrong_partner(on: bool) {
        WRONG_PARTNER.with(|w| w.set(on));
    }

    /// Whether the wrong-partner bug is planted on this thread.
    pub(crate) fn wrong_partner() -> bool {
        WRONG_PARTNER.with(Cell::get)
    }

    /// Plants (or removes) the bug fixed in the replicas' progress writes: a replica writes a
    /// member's progress as it holds it, its own old beat time included, even when another
    /// replica has written a newer one (the coordinator before 2026-11-29).
    pub fn set_stale_beat_writes(on: bool) {
        STALE_BEAT_WRITES.with(|w| w.set(on));
    }

    /// Whether the stale-beat-writes bug is planted on this thread.
    pub(crate) fn stale_beat_writes() -> bool {
        STALE_BEAT_WRITES.with(Cell::get)
    }
}

/// Generation `g` without its member list (number, size, digest, formation time): what a
/// compact watcher is sent. O(1).
pub fn without_members(g: &pb::Generation) -> pb::Generation {
    pb::Generation {
        number: g.number,
        members: Vec::new(),
        formed_at_ms: g.formed_at_ms,
        size: g.size,
        rank: None,
        member: None,
        members_digest: g.members_digest,
        host_runs: Vec::new(),
    }
}

/// What a job's long polls and new watchers wait on: the newest generation, the events that
/// describe the job to a new watcher, the end record, and a counter of member departures.
/// The hub re-sends it only when one of them changes.
#[derive(Debug, Default)]
pub struct Signal {
    /// The newest generation (`None`: none yet, or the job ended).
    pub formed: Option<Arc<Formed>>,
    /// The events describing the job's state to a new watcher (`events_between` the empty
    /// headline and the current one), built once per change.
    pub initial: Vec<pb::JobEvent>,
    /// The end record, once the job ended.
    pub ended: Option<EndedRecord>,
    /// Member keys deleted so far (evictions, expiries, leaves): a long poll wakes to see
    /// whether it was its own.
    pub departures: u64,
}

impl Signal {
    fn of(headline: &Headline, previous: Option<&Signal>, departures: u64) -> Self {
        let formed = match (&headline.generation, previous.and_then(|p| p.formed.as_ref())) {
            (Some(g), Some(f)) if f.number == g.number => Some(f.clone()),
            (Some(g), _) => Some(Arc::new(Formed::of(g))),
            (None, _) => None,
        };
        Self {
            formed,
            initial: events_between(&Headline::default(), headline),
            ended: headline.ended.clone(),
            departures,
        }
    }
}

/// What of a headline decides its events: a new generation, a revocation, the end. Cheap to
/// compare (the generation record itself is O(members)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HeadKey {
    number: Option<u64>,
    revoked: bool,
    ended: bool,
}

impl HeadKey {
    fn of_state(state: &JobState) -> Self {
        let g = state.current();
        Self { number: g.map(|g| g.number), revoked: g.is_some_and(|g| g.revoked.is_some()), ended: state.ended.is_some() }
    }

    fn of(h: &Headline) -> Self {
        let g = h.generation.as_ref();
        Self { number: g.map(|g| g.number), revoked: g.is_some_and(|g| g.revoked.is_some()), ended: h.ended.is_some() }
    }
}

/// What of a job's state its events describe: the generation record and the end record.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Headline {
    /// The newest generation.
    pub generation: Option<GenerationRecord>,
    /// The end record.
    pub ended: Option<EndedRecord>,
}

impl Headline {
    /// The headline of a job state.
    pub fn of(state: &JobState) -> Self {
        Self { generation: state.current().cloned(), ended: state.ended.clone() }
    }
}

/// The events a change from `old` to `new` means, in order (a revocation of the old
/// generation not seen yet, the new generation, its revocation, the end).
pub fn events_between(old: &Headline, new: &Headline) -> Vec<pb::JobEvent> {
    use pb::job_event::Event;
    let mut out = Vec::new();
    let (og, ng) = (old.generation.as_ref(), new.generation.as_ref());
    if let Some(n) = ng {
        let is_new = og.is_none_or(|o| o.number != n.number);
        if is_new {
            if let Some(o) = og {
                if o.revoked.is_none() {
                    if let Some(cause) = n.cause_of(o.number) {
                        out.push(pb::JobEvent {
                            event: Some(Event::GenerationRevoked(pb::GenerationRevoked {
                                generation: o.number,
                                cause: Some(cause.to_proto()),
                            })),
                        });
                    }
                }
            }
            out.push(pb::JobEvent { event: Some(Event::GenerationFormed(n.to_proto())) });
        }
        if let Some(cause) = &n.revoked {
            let was = og.filter(|o| o.number == n.number).and_then(|o| o.revoked.as_ref());
            if was.is_none() {
                out.push(pb::JobEvent {
                    event: Some(Event::GenerationRevoked(pb::GenerationRevoked {
                        generation: n.number,
                        cause: Some(cause.to_proto()),
                    })),
                });
            }
        }
    }
    if let (None, Some(ended)) = (&old.ended, &new.ended) {
        out.push(pb::JobEvent { event: Some(Event::JobEnded(ended.to_proto())) });
    }
    out
}

/// The event announcing that a member was just named a straggler, if `event` (about to be
/// applied to `state`) is the write of a progress record that names it where the record in
/// `state` did not (or named it since another time). O(1): only that record is looked at.
pub fn straggler_named(state: &JobState, event: &WatchEvent) -> Option<pb::JobEvent> {
    let put = ProgressPut::of(&state.job, event)?;
    announce_straggler(state, put.worker, &put.record)
}

/// The write of a member's progress record, decoded once: the hub announces a straggler from
/// it and applies it to the view (about one per member per second; decoding each twice was a
/// measurable share of a large job's heartbeat cost).
struct ProgressPut<'a> {
    worker: &'a str,
    record: records::ProgressRecord,
    revision: i64,
}

impl<'a> ProgressPut<'a> {
    /// `event` as the write of a progress record of `job` that decodes; `None` for any other
    /// event (a record that does not decode is left to [`JobState::apply`], which drops it).
    fn of(job: &str, event: &'a WatchEvent) -> Option<Self> {
        let WatchEvent::Put(kv) = event else { return None };
        let Some(keys::Parsed::Worker { job: of_job, kind: keys::Kind::Progress, worker }) = keys::parse(&kv.key) else {
            return None;
        };
        if of_job != job {
            return None;
        }
        let record = serde_json::from_slice(&kv.value).ok()?;
        Some(Self { worker, record, revision: kv.mod_revision })
    }
}

/// [`straggler_named`] for a progress record already decoded.
fn announce_straggler(state: &JobState, worker: &str, new: &records::ProgressRecord) -> Option<pb::JobEvent> {
    let since = new.straggler.named_since_ms?;
    let old = state.progress.get(worker).filter(|o| o.incarnation == new.incarnation);
    if old.is_some_and(|o| o.straggler.named_since_ms == Some(since)) {
        return None;
    }
    let g = state.current();
    Some(pb::JobEvent {
        event: Some(pb::job_event::Event::StragglerNamed(pb::StragglerNamed {
            generation: g.map_or(0, |g| g.number),
            rank: g.and_then(|g| g.rank_of(worker, new.incarnation)),
            worker_id: worker.to_string(),
            verdict: new.straggler_verdict(),
        })),
    })
}

/// The event announcing a pending re-formation of generation `generation`.
pub fn pending_event(generation: u64, joiners: u32) -> pb::JobEvent {
    pb::JobEvent {
        event: Some(pb::job_event::Event::ReformationPending(pb::ReformationPending { generation, joiners })),
    }
}

/// A state's pending re-formation: `Some(joiners)` when the active generation should
/// re-form at its next commit point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    joiners: Option<u32>,
    /// When the answer may change with no change to the state (an exclusion ends, ms since
    /// the epoch): the hub evaluates again then.
    recheck_at_ms: Option<u64>,
}

impl Pending {
    fn of(settings: &JobSettings, state: &JobState) -> Self {
        // Only an active generation can have a pending re-formation (the rendezvous decides
        // cooperatively only then): skip the evaluation, O(members), otherwise. Nothing but a
        // write makes a generation active, so no recheck is needed either.
        if state.ended.is_some() || state.current().is_none_or(|g| g.revoked.is_some()) {
            return Self { joiners: None, recheck_at_ms: None };
        }
        let e = rendezvous::evaluate(settings, state, records::now_ms());
        Self { joiners: e.reformation_pending.then_some(e.pending_joiners), recheck_at_ms: e.next_deadline_ms }
    }
}

/// Waits until `at_ms` (ms since the epoch); forever when `None`.
///
/// # Cancel safety
/// Cancel safe: it only sleeps.
async fn sleep_until_ms(at_ms: Option<u64>) {
    match at_ms {
        Some(at) => tokio::time::sleep(Duration::from_millis(at.saturating_sub(records::now_ms()))).await,
        None => std::future::pending().await,
    }
}

/// The hub evaluates whether a re-formation is pending (O(N log N) in the members) again no
/// sooner than this many times its previous evaluation took after it, as the leader spaces
/// its own evaluations: N members opening their watch streams at once write N records in
/// about as many batches, and one evaluation per batch was O(N² log N) (25 to 37 s of
/// coordinator CPU at 16,384 members). A pending event comes at most that much later.
const PENDING_SPACING: u32 = 4;

#[allow(clippy::too_many_arguments)] // the view's parts and the channels that publish them
async fn run_hub(
    mut follower: PrefixFollower,
    view: Arc<View>,
    settings: JobSettings,
    tx: watch::Sender<i64>,
    mut pending: Pending,
    pending_tx: watch::Sender<Option<u32>>,
    signal_tx: watch::Sender<Arc<Signal>>,
    events: broadcast::Sender<Arc<pb::JobEvent>>,
) {
    let mut headline = Headline::of(&view.live.read().unwrap_or_else(PoisonError::into_inner));
    let mut departures = 0u64;
    // When the next evaluation of `pending` may run, and whether one waits for that time.
    let mut next_evaluation = Instant::now();
    let mut deferred = false;
    loop {
        // A pending re-formation can also begin with no write at all (a waiting worker's
        // exclusion ends): evaluate again when the last evaluation said it might.
        let batch = tokio::select! {
            batch = follower.next() => Some(batch),
            () = sleep_until_ms(pending.recheck_at_ms), if !deferred => None,
            () = tokio::time::sleep_until(next_evaluation), if deferred => None,
        };
        // Events are published after the new state, so that a client reacting to an event
        // reads a state at least as new.
        let mut out = Vec::new();
        let mut relevant = false;
        let mut recheck = false;
        let mut signal_changed = false;
        // The only writer; readers wait for at most one batch's worth of updates.
        let mut state = view.live.write().unwrap_or_else(PoisonError::into_inner);
        match batch {
            None => recheck = true,
            Some(Batch::Events(list)) => {
                // Apply revision by revision so that no intermediate generation is missed.
                let mut i = 0;
                while i < list.len() {
                    let rev = event_revision(&list[i]);
                    let mut touched = false;
                    while i < list.len() && event_revision(&list[i]) == rev {
                        touched |= !is_bookkeeping(&list[i]);
                        if is_member_delete(&list[i]) {
                            departures += 1;
                            signal_changed = true;
                        }
                        match ProgressPut::of(&state.job, &list[i]) {
                            Some(put) => {
                                out.extend(announce_straggler(&state, put.worker, &put.record));
                                state.put_progress(put.worker, put.record, put.revision);
                            }
                            None => state.apply(&list[i]),
                        }
                        i += 1;
                    }
                    relevant |= touched;
                    // Compared by key, not by record: a copy of the generation per write
                    // would make every join and wait cost O(members).
                    if touched && HeadKey::of_state(&state) != HeadKey::of(&headline) {
                        let now = Headline::of(&state);
                        out.extend(events_between(&headline, &now));
                        headline = now;
                        signal_changed = true;
                    }
                }
            }
            Some(Batch::Reset(kvs, revision)) => {
                let job = std::mem::take(&mut state.job);
                *state = JobState::from_kvs(&job, &kvs, revision);
                let now = Headline::of(&state);
                out.extend(events_between(&headline, &now));
                headline = now;
                relevant = true;
                departures += 1;
                signal_changed = true;
            }
        }
        if (relevant || recheck) && Instant::now() < next_evaluation {
            deferred = true;
        } else if relevant || recheck || deferred {
            let started = Instant::now();
            let now = Pending::of(&settings, &state);
            if let (Some(joiners), Some(g)) = (now.joiners, state.current()) {
                if now.joiners != pending.joiners {
                    out.push(pending_event(g.number, joiners));
                }
            }
            pending = now;
            pending_tx.send_replace(now.joiners);
            next_evaluation = Instant::now() + started.elapsed() * PENDING_SPACING;
            deferred = false;
        }
        // Progress (heartbeats, commits: most writes of a running job) is in the view
        // only for completeness; nothing that reads the view uses it, so it counts as no
        // change (no copy for `Hub::state`, no wake-up of a subscriber).
        let revision = state.revision;
        if relevant {
            view.changes.fetch_add(1, Ordering::Release);
        }
        drop(state);
        if relevant {
            tx.send_replace(revision);
        }
        if signal_changed {
            let previous = signal_tx.borrow().clone();
            signal_tx.send_replace(Arc::new(Signal::of(&headline, Some(&previous), departures)));
        }
        for e in out {
            // Shared: each watcher's receiver takes a reference, not a copy of a member list.
            let _ = events.send(Arc::new(e));
        }
    }
}

/// Whether `event` deletes a member key (a member left, was evicted or expired).
fn is_member_delete(event: &WatchEvent) -> bool {
    matches!(event, WatchEvent::Delete { key, .. }
        if matches!(keys::parse(key), Some(keys::Parsed::Worker { kind: keys::Kind::Member, .. })))
}

/// Bookkeeping writes change nothing that events or decisions use: progress (heartbeats,
/// commits: most writes of a running job), timeout reports (read by failure reports
/// straight from the store), hosts' shared-lease records (read by joins) and generation
/// shards (written before the generation record that publishes them, which is what counts).
pub fn is_bookkeeping(event: &WatchEvent) -> bool {
    let key = match event {
        WatchEvent::Put(kv) => kv.key.as_str(),
        WatchEvent::Delete { key, .. } => key.as_str(),
    };
    matches!(
        keys::parse(key),
        Some(
            keys::Parsed::Worker { kind: keys::Kind::Progress | keys::Kind::Timeout | keys::Kind::Host, .. }
                | keys::Parsed::Shard { .. }
        )
    )
}

struct Entry {
    hub: Arc<Hub>,
    last_used: Instant,
}

/// The hubs of this replica, one per job, created on first use and dropped after a minute
/// unused.
pub struct Hubs {
    store: Arc<dyn Store>,
    hubs: tokio::sync::Mutex<HashMap<String, Entry>>,
    /// Jobs with a hub, for the sweep (a sync lock: never held across an await).
    count: Mutex<usize>,
}

/// How long an unused hub is kept.
const HUB_IDLE: Duration = Duration::from_secs(60);

impl Hubs {
    /// No hubs yet.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self { store, hubs: tokio::sync::Mutex::new(HashMap::new()), count: Mutex::new(0) }
    }

    /// The hub of `job` if this replica runs one (none is started).
    ///
    /// # Cancel safety
    /// Cancel safe: it only looks.
    pub async fn running(&self, job: &str) -> Option<Arc<Hub>> {
        let hubs = self.hubs.lock().await;
        hubs.get(job).filter(|e| !e.hub.task.is_finished()).map(|e| e.hub.clone())
    }

    /// The hub of `job`, started (one read and a watch) if there is none.
    ///
    /// # Cancel safety
    /// Cancel safe: a hub half started is dropped with the future.
    pub async fn get(&self, job: &str, settings: &JobSettings) -> Result<Arc<Hub>, StoreError> {
        let mut hubs = self.hubs.lock().await;
        let now = Instant::now();
        if let Some(entry) = hubs.get_mut(job) {
            if !entry.hub.task.is_finished() {
                entry.last_used = now;
                return Ok(entry.hub.clone());
            }
        }
        // Sweep hubs nobody used for a while (and nobody holds).
        hubs.retain(|_, e| Arc::strong_count(&e.hub) > 1 || now.duration_since(e.last_used) < HUB_IDLE);
        let (follower, kvs, revision) = PrefixFollower::start(self.store.clone(), &keys::job_prefix(job)).await?;
        let state = JobState::from_kvs(job, &kvs, revision);
        let (tx, rx) = watch::channel(state.revision);
        let pending = Pending::of(settings, &state);
        let (pending_tx, pending_rx) = watch::channel(pending.joiners);
        let (signal_tx, signal_rx) = watch::channel(Arc::new(Signal::of(&Headline::of(&state), None, 0)));
        let (events, _) = broadcast::channel(256);
        let view = Arc::new(View { live: RwLock::new(state), ..Default::default() });
        let task = tokio::spawn(run_hub(
            follower,
            view.clone(),
            *settings,
            tx,
            pending,
            pending_tx,
            signal_tx,
            events.clone(),
        ));
        let hub = Arc::new(Hub {
            job: job.to_string(),
            view,
            changes: rx,
            pending: pending_rx,
            signal: signal_rx,
            events,
            task,
        });
        hubs.insert(job.to_string(), Entry { hub: hub.clone(), last_used: now });
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) = hubs.len();
        Ok(hub)
    }

    /// How many hubs are running.
    pub fn len(&self) -> usize {
        *self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether no hub is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Cause, Outcome, Placed};
    use crate::rendezvous::next_generation;
    use pb::job_event::Event;

    fn cause() -> Cause {
        Cause {
            rank: Some(1),
            worker_id: "b".into(),
            host: "h".into(),
            reason: "died".into(),
            reported_by: "a".into(),
            domain: String::new(),
            lost_ranks: vec![],
        }
    }

    fn kinds(events: &[pb::JobEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match &e.event {
                Some(Event::GenerationFormed(g)) => format!("formed {}", g.number),
                Some(Event::GenerationRevoked(r)) => format!("revoked {}", r.generation),
                Some(Event::ReformationPending(p)) => format!("pending {}", p.generation),
                Some(Event::JobEnded(_)) => "ended".into(),
                Some(Event::StragglerNamed(n)) => format!("straggler {}", n.worker_id),
                None => "none".into(),
            })
            .collect()
    }

    #[test]
    fn events_follow_the_generation_record() {
        let members = vec![Placed {
            worker_id: "a".into(),
            incarnation: 1,
            host: String::new(),
            addresses: vec![],
            domain: String::new(),
        }];
        let g1 = next_generation(None, members.clone(), 1);
        let empty = Headline::default();
        let h1 = Headline { generation: Some(g1.clone()), ended: None };
        assert_eq!(kinds(&events_between(&empty, &h1)), ["formed 1"]);
        let g1r = crate::revocation::revoked(&g1, cause(), 2);
        let h1r = Headline { generation: Some(g1r.clone()), ended: None };
        assert_eq!(kinds(&events_between(&h1, &h1r)), ["revoked 1"]);
        assert!(events_between(&h1r, &h1r).is_empty());
        let g2 = next_generation(Some(&g1r), members, 3);
        let h2 = Headline { generation: Some(g2), ended: None };
        assert_eq!(kinds(&events_between(&h1r, &h2)), ["formed 2"]);
        // A watcher that missed the revocation of 1 still hears it, before generation 2.
        assert_eq!(kinds(&events_between(&h1, &h2)), ["revoked 1", "formed 2"]);
        let ended = Headline {
            generation: None,
            ended: Some(EndedRecord { outcome: Outcome::Failed, reason: "r".into(), ended_at_ms: 4 }),
        };
        assert_eq!(kinds(&events_between(&h2, &ended)), ["ended"]);
        // A new watcher of a revoked generation hears both.
        assert_eq!(kinds(&events_between(&empty, &h1r)), ["formed 1", "revoked 1"]);
    }

    #[test]
    fn a_straggler_is_announced_once_per_naming() {
        use crate::records::{encode, ProgressRecord};
        use crate::store::KeyValue;
        use crate::stragglers::{Finding, Slowness, Standing};
        let members = vec![
            Placed {
                worker_id: "a".into(),
                incarnation: 1,
                host: String::new(),
                addresses: vec![],
                domain: String::new(),
            },
            Placed {
                worker_id: "b".into(),
                incarnation: 2,
                host: String::new(),
                addresses: vec![],
                domain: String::new(),
            },
        ];
        let g = next_generation(None, members, 1);
        let key = keys::worker_key("j", keys::Kind::Progress, "b");
        let put = |p: &ProgressRecord| {
            WatchEvent::Put(KeyValue {
                key: key.clone(),
                value: encode(p),
                create_revision: 1,
                mod_revision: 2,
                lease: Some(2),
            })
        };
        let mut state = JobState { job: "j".into(), generation: Some((g, 1)), ..Default::default() };
        let plain = ProgressRecord { incarnation: 2, ..Default::default() };
        assert!(straggler_named(&state, &put(&plain)).is_none(), "not named: no event");
        let finding = Finding { kind: Slowness::Compute, ratio_pct: 300, reason: "slow".into() };
        let named = ProgressRecord {
            straggler: Standing { streak: 3, last: Some(finding), named_since_ms: Some(77) },
            ..plain.clone()
        };
        let event = straggler_named(&state, &put(&named)).expect("announced");
        match event.event {
            Some(Event::StragglerNamed(n)) => {
                assert_eq!((n.worker_id.as_str(), n.rank, n.generation), ("b", Some(1), 1));
                assert_eq!(n.verdict.map(|v| (v.kind, v.since_ms)), Some(("compute".to_string(), 77)));
            }
            other => panic!("{other:?}"),
        }
        state.apply(&put(&named));
        assert!(straggler_named(&state, &put(&named)).is_none(), "the same naming again: no event");
        // The hub's path (decode once, put the record) leaves the view as applying the write
        // does.
        let mut by_put = state.clone();
        let write = put(&plain);
        let decoded = ProgressPut::of("j", &write).expect("a progress write of job j");
        assert_eq!(decoded.worker, "b");
        by_put.put_progress(decoded.worker, decoded.record, decoded.revision);
        state.apply(&write);
        assert_eq!(by_put.progress, state.progress);
        assert_eq!(by_put.revision, state.revision);
        assert!(ProgressPut::of("other-job", &write).is_none(), "another job's record is not this view's");
    }

    #[tokio::test]
    async fn long_polls_wake_on_formations_and_departures_not_on_arrivals() {
        // The signal long polls wait on must not change per join or wait (N arrivals would
        // wake N waiters each: O(N²)), and must change when a generation forms, is revoked,
        // or a member key goes.
        use crate::keys::Kind;
        use crate::records::{encode, MemberRecord, WaitingRecord};
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        let job = "j";
        let settings = JobSettings { min_workers: 1, max_workers: 64, ..Default::default() };
        let hubs = Hubs::new(store.clone());
        let hub = hubs.get(job, &settings).await.expect("hub");
        let mut signal = hub.subscribe_signal();
        let mut changes = hub.subscribe_changes();
        drop(signal.borrow_and_update());
        let within = Duration::from_secs(10);
        let mut placed = Vec::new();
        for i in 0..20 {
            let w = format!("w{i}");
            let lease = store.grant_lease(Duration::from_secs(60)).await.expect("lease");
            let member = MemberRecord {
                worker_id: w.clone(),
                incarnation: lease as u64,
                host: "h".into(),
                addresses: vec![],
                capabilities: vec![],
                joined_at_ms: 1,
                domain: String::new(),
                host_lease: 0,
            };
            store.put(&keys::worker_key(job, Kind::Member, &w), encode(&member), Some(lease)).await.expect("put");
            let wait = WaitingRecord { incarnation: lease as u64, after_generation: 0, since_ms: 1 };
            let rev = store.put(&keys::worker_key(job, Kind::Waiting, &w), encode(&wait), Some(lease)).await.expect("put");
            // The view follows every arrival...
            tokio::time::timeout(within, changes.wait_for(|r| *r >= rev)).await.expect("view").expect("hub");
            placed.push(Placed { worker_id: w, incarnation: lease as u64, host: "h".into(), addresses: vec![], domain: String::new() });
        }
        // ...and the signal has not changed once.
        assert!(!signal.has_changed().expect("hub"), "arrivals wake no long poll");
        assert!(hub.signal().formed.is_none());
        let g1 = next_generation(None, placed.clone(), 2);
        store.put(&keys::generation(job), encode(&g1), None).await.expect("put");
        tokio::time::timeout(within, signal.changed()).await.expect("a formation wakes long polls").expect("hub");
        let formed = hub.signal().formed.clone().expect("formed");
        assert_eq!(formed.number, 1);
        assert_eq!(formed.rank_of("w7", placed[7].incarnation), Some(7));
        assert_eq!(formed.rank_of("w7", placed[7].incarnation + 1000), None, "another incarnation has no rank");
        assert_eq!(formed.proto, g1.to_proto());
        assert_eq!(hub.signal().initial.len(), 1, "a new watcher hears the formation");
        // A member key deleted (lease revoked) wakes them too.
        store.revoke_lease(placed[3].incarnation as i64).await.expect("revoke");
        tokio::time::timeout(within, signal.changed()).await.expect("a departure wakes long polls").expect("hub");
        assert_eq!(hub.signal().departures, 1);
        assert!(Arc::ptr_eq(&formed, hub.signal().formed.as_ref().expect("formed")), "the index is built once per generation");
    }

    #[tokio::test]
    async fn a_reformation_becomes_pending_when_a_waiting_workers_exclusion_ends() {
        // Generation 1 = [a] is active; b is a live member waiting to join but excluded for
        // another 300 ms. Nothing is written when the exclusion ends: the hub must notice
        // by itself, or the members are never told to re-form and b waits forever.
        use crate::exclusion::FailureHistory;
        use crate::keys::Kind;
        use crate::records::{encode, MemberRecord, WaitingRecord};
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        let (job, now) = ("j", records::now_ms());
        let mut incarnations = HashMap::new();
        for w in ["a", "b"] {
            let lease = store.grant_lease(Duration::from_secs(60)).await.expect("lease");
            let member = MemberRecord {
                worker_id: w.into(),
                incarnation: lease as u64,
                host: "h".into(),
                addresses: vec![],
                capabilities: vec![],
                joined_at_ms: now,
                domain: String::new(),
                host_lease: 0,
            };
            store.put(&keys::worker_key(job, Kind::Member, w), encode(&member), Some(lease)).await.expect("put");
            incarnations.insert(w, lease);
        }
        let a = Placed {
            worker_id: "a".into(),
            incarnation: incarnations["a"] as u64,
            host: "h".into(),
            addresses: vec![],
            domain: String::new(),
        };
        store.put(&keys::generation(job), encode(&next_generation(None, vec![a], now)), None).await.expect("put");
        let wait = WaitingRecord { incarnation: incarnations["b"] as u64, after_generation: 0, since_ms: now };
        store
            .put(&keys::worker_key(job, Kind::Waiting, "b"), encode(&wait), Some(incarnations["b"]))
            .await
            .expect("put");
        let history = FailureHistory {
            failures_ms: vec![],
            exclusions: 1,
            excluded_until_ms: Some(now + 300),
            ..Default::default()
        };
        store.put(&keys::worker_key(job, Kind::Failures, "b"), encode(&history), None).await.expect("put");

        let settings = JobSettings { min_workers: 1, max_workers: 4, ..Default::default() };
        let hubs = Hubs::new(store);
        let hub = hubs.get(job, &settings).await.expect("hub");
        let mut events = hub.subscribe_events();
        assert_eq!(hub.pending(), None, "b is excluded");
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("a pending re-formation within 10 s of the exclusion's end")
            .expect("event");
        assert_eq!(kinds(&[(*event).clone()]), ["pending 1"]);
        assert_eq!(hub.pending(), Some(1));
    }

    #[tokio::test]
    async fn the_view_is_read_in_place_and_copied_at_most_once_per_change() {
        // Joins and waits change the view one write at a time; a copy per write would make
        // a formation of N members cost O(N²). Requests read in place; a copy is made only
        // on demand, once per change, and bookkeeping (progress) is no change.
        use crate::keys::Kind;
        use crate::records::{encode, MemberRecord, ProgressRecord, WaitingRecord};
        let store = Arc::new(crate::store::memory::MemoryStore::new());
        let (job, within) = ("j", Duration::from_secs(10));
        let hubs = Hubs::new(store.clone());
        let hub = hubs.get(job, &JobSettings::default()).await.expect("hub");
        let mut changes = hub.subscribe_changes();
        let lease = store.grant_lease(Duration::from_secs(60)).await.expect("lease");
        let inc = lease as u64;
        let member = MemberRecord {
            worker_id: "w".into(),
            incarnation: inc,
            host: "h".into(),
            addresses: vec![],
            capabilities: vec![],
            joined_at_ms: 1,
            domain: String::new(),
            host_lease: 0,
        };
        let rev = store.put(&keys::worker_key(job, Kind::Member, "w"), encode(&member), Some(lease)).await.expect("put");
        tokio::time::timeout(within, changes.wait_for(|r| *r >= rev)).await.expect("view").expect("hub");
        assert!(hub.read(|s| s.is_live("w", inc)), "read in place");
        let first = hub.state();
        assert!(Arc::ptr_eq(&first, &hub.state()), "no change, no second copy");
        // A heartbeat's progress write reaches the view but is no change: the same copy.
        let progress = ProgressRecord { incarnation: inc, last_heartbeat_ms: 2, ..Default::default() };
        let rev = store.put(&keys::worker_key(job, Kind::Progress, "w"), encode(&progress), Some(lease)).await.expect("put");
        // A progress write sends no change notification (that is what is tested), so there
        // is nothing to await: poll the view's revision, bounded by `within`.
        let seen = tokio::time::timeout(within, async {
            while !hub.read(|s| s.revision >= rev) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        seen.await.expect("the progress reaches the view");
        assert!(Arc::ptr_eq(&first, &hub.state()), "bookkeeping is no change");
        // A wait is a change: the next copy is a new one and includes it.
        let wait = WaitingRecord { incarnation: inc, after_generation: 0, since_ms: 3 };
        let rev = store.put(&keys::worker_key(job, Kind::Waiting, "w"), encode(&wait), Some(lease)).await.expect("put");
        tokio::time::timeout(within, changes.wait_for(|r| *r >= rev)).await.expect("view").expect("hub");
        let second = hub.state();
        assert!(!Arc::ptr_eq(&first, &second));
        assert!(second.waiting.contains_key("w") && !first.waiting.contains_key("w"));
        assert!(Arc::ptr_eq(&second, &hub.state()));
    }
}
