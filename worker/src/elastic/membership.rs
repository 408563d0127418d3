//! [`Membership`]: every decision of a worker's membership, as a pure state machine.
//!
//! The machine does no I/O, spawns nothing and never waits, in the manner of quinn-proto's
//! `Connection` and raft-rs's `RawNode`: the shell ([`super::ElasticGroup`]) performs the
//! calls to the coordinator and hands their answers in (`handle_*`, with the time `now` where
//! time matters), asks what to do next ([`Membership::next_step`], the `*_request` methods), and
//! performs the [`Effect`]s the machine queues ([`Membership::poll_effect`]). The machine
//! alone decides which incarnation is current, which generations are revoked and why,
//! whether an answer is stale, when an excluded worker asks again, whether a re-formation is
//! pending, and when the job's event stream is reopened.
//!
//! The machine never reads a transport's status codes: the shell classifies each failed call
//! into a [`CallError`] (for the gRPC client, `From<ControlError>` in the shell), and time and
//! randomness come in as arguments. So the same machine runs in the worker, under tokio, and
//! in the deterministic simulation (`cohort-sim`, through the `test-support` feature), under
//! simulated time.

use super::ElasticError;
use crate::control::ControlError;
use crate::RootCause;
use cohort_proto::v1::{self as pb, job_ended, job_event, rendezvous_response};
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How long past the end of its exclusion (as the coordinator counted it) an excluded worker
/// asks to join again, so that the coordinator's clock has passed it too.
pub const EXCLUSION_MARGIN: Duration = Duration::from_millis(50);

/// How many times one join asks again after "a live process holds this worker id"
/// (ALREADY_EXISTS): once is what a restart after a crash needs (the coordinator says when its
/// silent predecessor counts as gone); refused again, the holder is alive and this process
/// gives up rather than fight it for the id.
const ID_IN_USE_RETRIES: u32 = 2;

/// The first and the longest wait before joining again after repeated evictions.
const REJOIN_BACKOFF_FIRST: Duration = Duration::from_millis(100);
const REJOIN_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How many revoked generations' root causes are remembered (the newest).
const REVOKED_KEPT: usize = 16;

/// The first and the longest wait before the event stream is reopened after it broke.
const WATCH_RETRY_FIRST: Duration = Duration::from_millis(50);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(1);

/// A coordinator call that brought no answer, as the machine tells failures apart. The shell
/// classifies its client's errors into it (the gRPC shell: `From<ControlError>`, NOT_FOUND
/// being [`CallError::NotMember`]); the machine decides on the class alone.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CallError {
    /// The coordinator no longer knows the incarnation that called (its lease lapsed, it was
    /// evicted, or its job is gone): the worker joins again.
    #[error("no longer a member: {0}")]
    NotMember(ControlError),
    /// A join refused while this worker is excluded (its failures repeated), until
    /// `retry_after` from now as the coordinator counts it.
    #[error("excluded: {message} (retry after {retry_after:?})")]
    Excluded {
        /// The coordinator's message (failures, cool-down).
        message: String,
        /// Until the exclusion ends.
        retry_after: Duration,
    },
    /// A join refused because a live process holds this worker id; a holder that stays
    /// silent for `retry_after` counts as gone.
    #[error("worker id in use: {message} (retry after {retry_after:?})")]
    IdInUse {
        /// The coordinator's message (the holder's host and incarnation).
        message: String,
        /// When a silent holder would count as gone.
        retry_after: Duration,
    },
    /// Any other failure (unreachable, refused for another reason): a join or a rendezvous
    /// fails with it, a heartbeat or a commit report is tried again later.
    #[error(transparent)]
    Failed(ControlError),
}

impl CallError {
    /// The error a worker stops with when this failure ends a join or a rendezvous.
    fn into_error(self) -> ElasticError {
        match self {
            CallError::NotMember(e) | CallError::Failed(e) => e.into(),
            CallError::Excluded { message, retry_after } => ControlError::Excluded { message, retry_after }.into(),
            CallError::IdInUse { message, retry_after } => ControlError::IdInUse { message, retry_after }.into(),
        }
    }
}

/// Something the shell performs for the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Abort the communicator of `generation`, the one connected now, with `cause`.
    Abort {
        /// The generation whose communicator is aborted.
        generation: u64,
        /// The cause its collectives fail with.
        cause: RootCause,
    },
    /// What waiters watch changed (a revocation, the job's end, a new incarnation): wake them
    /// so that they look again.
    Wake,
}

/// What [`super::ElasticGroup::next_generation`] does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Join again: the coordinator no longer knows the current incarnation.
    Join,
    /// Ask the rendezvous for the generation after `after_generation`, as `incarnation`.
    Rendezvous {
        /// The incarnation that asks.
        incarnation: u64,
        /// The newest generation this worker has seen formed.
        after_generation: u64,
    },
}

/// What follows a Join answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JoinNext {
    /// Joined as `incarnation`; its heartbeat runs every `heartbeat_interval`.
    Joined {
        /// The new incarnation.
        incarnation: u64,
        /// The coordinator's heartbeat interval (bounded to 10 ms ..= 60 s).
        heartbeat_interval: Duration,
        /// How long the coordinator waits for a heartbeat before it declares the member dead
        /// (zero: not said, an older coordinator).
        lease_ttl: Duration,
    },
    /// Excluded: ask again at this time.
    RetryAt(Instant),
}

/// What the event-stream task does after its stream ended or could not be opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchNext {
    /// Open the stream again at this time (for [`Membership::incarnation`]).
    ReopenAt(Instant),
    /// The job is over: stop following it.
    Stop,
}

/// A heartbeat's content: what this worker is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The generation it works in (or the newest it has seen).
    pub generation: u64,
    /// Its step.
    pub step: u64,
    /// What it is doing ("rendezvous", "connecting", "training", ...).
    pub activity: String,
    /// The no-progress deadline in force on its links, in brief.
    pub deadlines: String,
}

/// One worker's membership in an elastic job, without I/O (see the module documentation).
#[derive(Debug)]
pub struct Membership {
    /// How long in all a join waits out exclusions ([`super::ElasticConfig::exclusion_wait`]).
    exclusion_wait: Duration,
    /// The current incarnation; 0 before the first join.
    incarnation: u64,
    /// The incarnation the coordinator said it no longer knows (lease lapsed, evicted). A late
    /// answer about an older incarnation names that one and so does not mark a newer one.
    evicted: Option<u64>,
    /// When the join under way started (its exclusion waits count from there).
    join_started: Option<Instant>,
    /// ALREADY_EXISTS refusals of the join under way.
    id_in_use_refusals: u32,
    /// Joins after an eviction since this worker last connected a generation.
    rejoins: u32,
    /// The newest generation this worker has seen formed.
    last_generation: u64,
    /// The generation whose communicator is connected now.
    current: Option<u64>,
    /// Root causes of revoked generations, oldest first (only the newest few are kept).
    revoked: Vec<(u64, RootCause)>,
    /// Joiners or a leaver wait for the members to re-form at a commit point.
    reformation_pending: bool,
    /// Why the coordinator asked this member to leave as a straggler (job policy `exclude`),
    /// once it has: it leaves gracefully at its next commit point.
    straggler_leave: Option<String>,
    /// How the job ended ("finished" or "failed", and the reason), once it has.
    ended: Option<(&'static str, String)>,
    /// This worker is leaving the job: a beat answered "not a member" is the leave's doing.
    leaving: bool,
    /// The bound of the next wait before reopening the event stream.
    watch_retry: Duration,
    progress: Progress,
    effects: VecDeque<Effect>,
}

impl Membership {
    /// The membership of a worker that has not joined yet.
    pub fn new(exclusion_wait: Duration) -> Self {
        Membership {
            exclusion_wait,
            incarnation: 0,
            evicted: None,
            leaving: false,
            join_started: None,
            id_in_use_refusals: 0,
            rejoins: 0,
            last_generation: 0,
            current: None,
            revoked: Vec::new(),
            reformation_pending: false,
            straggler_leave: None,
            ended: None,
            watch_retry: WATCH_RETRY_FIRST,
            progress: Progress { generation: 0, step: 0, activity: "joining".into(), deadlines: String::new() },
            effects: VecDeque::new(),
        }
    }

    /// The next effect for the shell to perform, oldest first.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// The current incarnation (0 before the first join).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Whether the coordinator no longer knows the current incarnation.
    pub fn is_evicted(&self) -> bool {
        self.evicted == Some(self.incarnation)
    }

    /// Whether joiners or a leaver wait for a re-formation, as far as this worker has heard.
    pub fn reformation_pending(&self) -> bool {
        self.reformation_pending
    }

    /// Why the coordinator asked this member to leave as a straggler, if it has.
    pub fn straggler_leave(&self) -> Option<&str> {
        self.straggler_leave.as_deref()
    }

    /// The root cause of a revoked generation, if heard.
    pub fn cause_of(&self, generation: u64) -> Option<RootCause> {
        self.revoked.iter().find(|(g, _)| *g == generation).map(|(_, c)| c.clone())
    }

    /// How the job ended, once it has.
    pub fn ended(&self) -> Option<ElasticError> {
        self.ended.clone().map(|(outcome, reason)| ElasticError::JobEnded { outcome, reason })
    }

    /// Why a generation being connected (or in use) must be given up: its revocation, or the
    /// end of the job. `None` while it stands.
    pub fn stop_reason(&self, generation: u64) -> Option<RootCause> {
        if let Some(cause) = self.cause_of(generation) {
            return Some(cause);
        }
        self.ended.as_ref().map(|(_, reason)| RootCause::reason(format!("job ended: {reason}")))
    }

    /// Records what this worker is doing (sent with the next heartbeat).
    pub fn set_progress(&mut self, generation: u64, step: u64, activity: &str) {
        self.progress.generation = generation;
        self.progress.step = step;
        activity.clone_into(&mut self.progress.activity);
    }

    /// Records the no-progress deadline in force, in brief (sent with the next heartbeat).
    pub fn set_deadlines(&mut self, brief: &str) {
        brief.clone_into(&mut self.progress.deadlines);
    }

    // ---- Join -------------------------------------------------------------------------

    /// This worker is leaving the job: from now on a heartbeat answered "not a member" ends
    /// the heartbeats quietly (the leave removed the member) instead of marking it evicted.
    pub fn begin_leave(&mut self) {
        self.leaving = true;
    }

    /// A join starts at `now`: its exclusion waits count from here.
    pub fn begin_join(&mut self, now: Instant) {
        self.join_started = Some(now);
        self.id_in_use_refusals = 0;
    }

    /// How long to wait before the next join: nothing for a first join or a first re-join,
    /// then 100 ms doubling up to 5 s for each further eviction before a generation connects
    /// (an incarnation evicted again and again, e.g. by another process with this worker
    /// id, backs off instead of joining in a tight loop).
    pub fn rejoin_backoff(&self) -> Duration {
        match self.rejoins {
            0 | 1 => Duration::ZERO,
            n => REJOIN_BACKOFF_FIRST.saturating_mul(1 << (n - 2).min(16)).min(REJOIN_BACKOFF_MAX),
        }
    }

    /// The answer to a Join sent at or after [`Membership::begin_join`]. An exclusion is
    /// waited out (a margin past its end) as long as the whole join stays within
    /// `exclusion_wait`; past that, or on any other error, the join fails.
    pub fn handle_join(
        &mut self,
        now: Instant,
        answer: Result<pb::JoinResponse, CallError>,
    ) -> Result<JoinNext, ElasticError> {
        let started = *self.join_started.get_or_insert(now);
        match answer {
            Ok(response) => {
                self.join_started = None;
                self.incarnation = response.incarnation;
                // The event stream reopens for the new incarnation.
                self.effects.push_back(Effect::Wake);
                let heartbeat_interval = Duration::from_millis(response.heartbeat_interval_ms.clamp(10, 60_000));
                let lease_ttl = Duration::from_millis(response.lease_ttl_ms.min(3_600_000));
                Ok(JoinNext::Joined { incarnation: response.incarnation, heartbeat_interval, lease_ttl })
            }
            Err(CallError::Excluded { message, retry_after }) => {
                let (waited, limit) = (now.saturating_duration_since(started), self.exclusion_wait);
                if waited + retry_after > limit {
                    self.join_started = None;
                    return Err(ElasticError::Excluded { message, retry_after, waited, limit });
                }
                warn!(retry_after_ms = retry_after.as_millis() as u64, %message,
                      "excluded by the coordinator; joining again when the exclusion ends");
                Ok(JoinNext::RetryAt(now + retry_after + EXCLUSION_MARGIN))
            }
            Err(CallError::IdInUse { message, retry_after }) if self.id_in_use_refusals < ID_IN_USE_RETRIES => {
                self.id_in_use_refusals += 1;
                warn!(retry_after_ms = retry_after.as_millis() as u64, %message,
                      "this worker id is held by another incarnation; asking again once it counts as gone");
                Ok(JoinNext::RetryAt(now + retry_after + EXCLUSION_MARGIN))
            }
            Err(e) => {
                self.join_started = None;
                Err(e.into_error())
            }
        }
    }

    // ---- Rendezvous -------------------------------------------------------------------

    /// What the worker waiting for its next generation does now; an error when the job is
    /// over.
    pub fn next_step(&mut self) -> Result<Step, ElasticError> {
        if let Some(ended) = self.ended() {
            return Err(ended);
        }
        if self.is_evicted() {
            self.rejoins = self.rejoins.saturating_add(1);
            warn!(
                incarnation = self.incarnation,
                rejoins = self.rejoins,
                "this incarnation is no longer a member; joining again"
            );
            return Ok(Step::Join);
        }
        self.set_progress(self.last_generation, 0, "rendezvous");
        Ok(Step::Rendezvous { incarnation: self.incarnation, after_generation: self.last_generation })
    }

    /// The rendezvous' answer to a request sent as `incarnation`: the generation to connect,
    /// `None` to ask again (still waiting, or this incarnation is gone and must join again),
    /// or why the worker stops.
    pub fn handle_rendezvous(
        &mut self,
        incarnation: u64,
        answer: Result<pb::RendezvousResponse, CallError>,
    ) -> Result<Option<pb::Generation>, ElasticError> {
        let response = match answer {
            Ok(response) => response,
            Err(CallError::NotMember(_)) => {
                self.evicted = Some(incarnation);
                return Ok(None);
            }
            Err(e) => return Err(e.into_error()),
        };
        match response.outcome {
            Some(rendezvous_response::Outcome::Waiting(_)) => Ok(None),
            Some(rendezvous_response::Outcome::Ended(ended)) => {
                self.end(ended);
                Err(self.ended().expect("just recorded"))
            }
            None => Err(ElasticError::Protocol("rendezvous answer without an outcome".into())),
            Some(rendezvous_response::Outcome::Formed(generation)) => {
                if generation.number <= self.last_generation {
                    return Err(ElasticError::Protocol(format!(
                        "rendezvous returned generation {} after {}",
                        generation.number, self.last_generation
                    )));
                }
                self.last_generation = generation.number;
                self.set_progress(generation.number, 0, "connecting");
                Ok(Some(generation))
            }
        }
    }

    /// The communicator of `generation` is connected and its revoker in the shell's hands:
    /// it becomes the current one. A revocation heard while it connected applies now (an
    /// [`Effect::Abort`]); a pending re-formation is the one this generation made.
    pub fn handle_connected(&mut self, generation: u64) {
        self.current = Some(generation);
        self.rejoins = 0;
        self.reformation_pending = false;
        if let Some(cause) = self.cause_of(generation) {
            self.effects.push_back(Effect::Abort { generation, cause });
        }
    }

    // ---- Failures ---------------------------------------------------------------------

    /// `generation` is revoked with `cause` (from the event stream, the answer to a failure
    /// report, or a local detection). The first cause heard stays; the current
    /// communicator is aborted when it is the revoked one. An older generation's late
    /// revocation is recorded (its cause is still asked for) and aborts nothing.
    pub fn handle_revoked(&mut self, generation: u64, cause: RootCause) {
        if self.revoked.iter().any(|(g, _)| *g == generation) {
            return;
        }
        self.revoked.push((generation, cause.clone()));
        let excess = self.revoked.len().saturating_sub(REVOKED_KEPT);
        self.revoked.drain(..excess);
        if self.current == Some(generation) {
            self.effects.push_back(Effect::Abort { generation, cause });
        }
        self.effects.push_back(Effect::Wake);
    }

    /// The coordinator's answer to this rank's failure report of `generation`, or `None` when
    /// none came (the call failed, or took too long): the cause is the answer's (the first
    /// report of a generation, which every rank shares), else `local`, the failure as this
    /// rank saw it. The generation is revoked with it ([`Membership::handle_revoked`]), which
    /// aborts the current communicator: links left open for the report close now.
    pub fn handle_report(
        &mut self,
        generation: u64,
        answer: Option<pb::FailureReportResponse>,
        local: RootCause,
    ) -> RootCause {
        let cause = match answer {
            Some(response) => cause_from_pb(response.cause),
            None => local,
        };
        self.handle_revoked(generation, cause.clone());
        cause
    }

    // ---- Heartbeat and commit reports -------------------------------------------------

    /// The heartbeat of `incarnation` to send now; `None` when a newer incarnation took over
    /// (its own heartbeat runs): this one stops.
    pub fn heartbeat_request(&self, incarnation: u64) -> Option<Progress> {
        (incarnation == self.incarnation).then(|| self.progress.clone())
    }

    /// The answer to a heartbeat sent as `incarnation`; whether that heartbeat goes on.
    /// NOT_FOUND: the coordinator no longer knows that incarnation (a newer one is
    /// unaffected), and its heartbeat stops.
    pub fn handle_heartbeat(&mut self, incarnation: u64, answer: Result<pb::HeartbeatResponse, CallError>) -> bool {
        match answer {
            Ok(response) => {
                if response.reformation_pending {
                    self.reformation_pending = true;
                }
                if !response.leave_as_straggler.is_empty() {
                    self.straggler_leave = Some(response.leave_as_straggler);
                }
                true
            }
            Err(CallError::NotMember(e)) if self.leaving => {
                // A beat sent (or held by the host's relay) before the leave, answered after it.
                tracing::debug!(incarnation, error = %e, "a heartbeat answered after leaving");
                false
            }
            Err(CallError::NotMember(e)) => {
                warn!(incarnation, error = %e, "membership lost");
                self.evicted = Some(incarnation);
                false
            }
            Err(e) => {
                warn!(error = %e, "heartbeat failed");
                true
            }
        }
    }

    /// The answer to a commit report of `generation` sent as `incarnation`. Joiners waiting
    /// count only for the generation that is still current.
    pub fn handle_commit(&mut self, generation: u64, incarnation: u64, answer: Result<pb::CommitResponse, CallError>) {
        match answer {
            Ok(answer) => {
                if answer.reformation_pending && self.current == Some(generation) {
                    self.reformation_pending = true;
                }
            }
            Err(CallError::NotMember(_)) => self.evicted = Some(incarnation),
            Err(e) => tracing::debug!(error = %e, "commit report failed; the next one supersedes it"),
        }
    }

    // ---- The job's event stream -------------------------------------------------------

    /// The stream was opened: the next break waits the shortest time again.
    pub fn handle_watch_opened(&mut self) {
        self.watch_retry = WATCH_RETRY_FIRST;
    }

    /// Whether a stream opened for `opened_for` must be reopened for a newer incarnation.
    pub fn watch_is_stale(&self, opened_for: u64) -> bool {
        opened_for != self.incarnation
    }

    /// One event from the job's stream.
    pub fn handle_event(&mut self, event: pb::JobEvent) {
        match event.event {
            Some(job_event::Event::GenerationRevoked(revoked)) => {
                let cause = cause_from_pb(revoked.cause);
                info!(generation = revoked.generation, %cause, "generation revoked");
                self.handle_revoked(revoked.generation, cause);
            }
            Some(job_event::Event::ReformationPending(_)) => self.reformation_pending = true,
            Some(job_event::Event::JobEnded(ended)) => {
                self.end(ended);
                // Wake a rank blocked in a collective of a job that is over.
                if let Some(generation) = self.current {
                    self.effects.push_back(Effect::Abort { generation, cause: RootCause::reason("job ended") });
                }
            }
            Some(job_event::Event::StragglerNamed(named)) => {
                let reason = named.verdict.map(|v| v.reason);
                info!(worker = %named.worker_id, rank = ?named.rank, ?reason, "straggler named");
            }
            Some(job_event::Event::GenerationFormed(_)) | None => {}
        }
    }

    /// The stream opened for `opened_for` ended or could not be opened, at `now`; `entropy`
    /// is a random number that spreads the workers' reopen attempts. A new incarnation
    /// reopens at once; otherwise the wait is jittered and doubles up to a second.
    pub fn handle_watch_lost(&mut self, opened_for: u64, now: Instant, entropy: u64) -> WatchNext {
        if self.watch_is_stale(opened_for) {
            return WatchNext::ReopenAt(now);
        }
        if self.ended.is_some() {
            return WatchNext::Stop;
        }
        let bound = self.watch_retry;
        let jitter = Duration::from_millis(entropy % (bound.as_millis() as u64 + 1));
        self.watch_retry = (bound * 2).min(WATCH_RETRY_MAX);
        WatchNext::ReopenAt(now + bound / 2 + jitter / 2)
    }

    fn end(&mut self, ended: pb::JobEnded) {
        let outcome = match job_ended::Outcome::try_from(ended.outcome) {
            Ok(job_ended::Outcome::Finished) => "finished",
            _ => "failed",
        };
        self.ended = Some((outcome, ended.reason));
        self.effects.push_back(Effect::Wake);
    }
}

/// A root cause as the coordinator sent it.
pub fn cause_from_pb(cause: Option<pb::RootCause>) -> RootCause {
    let cause = cause.unwrap_or_default();
    let mut reason = cause.reason;
    if !cause.reported_by.is_empty() {
        reason = format!("{reason} (reported by {})", cause.reported_by);
    }
    RootCause { rank: cause.rank, worker_id: cause.worker_id, host: cause.host, reason }
}

/// The machine driven by hand: no sockets, no sleeps, no runtime; time is an [`Instant`]
/// the test moves forward.
#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(5);

    /// The coordinator no longer knows the incarnation that called.
    fn not_member() -> CallError {
        CallError::NotMember(ControlError::Config("not a member (test)".into()))
    }

    /// Any other failure.
    fn failed() -> CallError {
        CallError::Failed(ControlError::Config("failed (test)".into()))
    }

    fn excluded(retry_after: Duration) -> CallError {
        CallError::Excluded { message: "failed 3 times".into(), retry_after }
    }

    fn joined(incarnation: u64) -> Result<pb::JoinResponse, CallError> {
        Ok(pb::JoinResponse { incarnation, heartbeat_interval_ms: 200, lease_ttl_ms: 1000, ..Default::default() })
    }

    fn formed(number: u64) -> Result<pb::RendezvousResponse, CallError> {
        let generation = pb::Generation { number, ..Default::default() };
        Ok(pb::RendezvousResponse { outcome: Some(rendezvous_response::Outcome::Formed(generation)) })
    }

    fn waiting() -> Result<pb::RendezvousResponse, CallError> {
        Ok(pb::RendezvousResponse { outcome: Some(rendezvous_response::Outcome::Waiting(pb::Waiting::default())) })
    }

    fn revoked(generation: u64, reason: &str) -> pb::JobEvent {
        let cause =
            pb::RootCause { rank: Some(2), worker_id: "w2".into(), reason: reason.into(), ..Default::default() };
        let revoked = pb::GenerationRevoked { generation, cause: Some(cause) };
        pb::JobEvent { event: Some(job_event::Event::GenerationRevoked(revoked)) }
    }

    fn event(event: job_event::Event) -> pb::JobEvent {
        pb::JobEvent { event: Some(event) }
    }

    fn effects(machine: &mut Membership) -> Vec<Effect> {
        std::iter::from_fn(|| machine.poll_effect()).collect()
    }

    /// A machine that joined as `incarnation` at `now`, its effects drained.
    fn member(incarnation: u64, now: Instant) -> Membership {
        let mut machine = Membership::new(LIMIT);
        machine.begin_join(now);
        let next = machine.handle_join(now, joined(incarnation)).expect("joins");
        assert_eq!(
            next,
            JoinNext::Joined {
                incarnation,
                heartbeat_interval: Duration::from_millis(200),
                lease_ttl: Duration::from_millis(1000)
            }
        );
        assert_eq!(effects(&mut machine), [Effect::Wake], "a new incarnation wakes the watch");
        machine
    }

    /// A member of `incarnation` connected to generation `number` (formed by the rendezvous).
    fn connected(incarnation: u64, number: u64, now: Instant) -> Membership {
        let mut machine = member(incarnation, now);
        let Step::Rendezvous { incarnation: asking, .. } = machine.next_step().expect("not ended") else {
            panic!("a member asks the rendezvous")
        };
        let generation = machine.handle_rendezvous(asking, formed(number)).expect("formed").expect("a generation");
        assert_eq!(generation.number, number);
        machine.handle_connected(number);
        assert_eq!(effects(&mut machine), []);
        machine
    }

    #[test]
    fn a_revocation_while_connecting_stops_the_connect_and_applies_if_it_completes() {
        let mut machine = member(1, Instant::now());
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 1, after_generation: 0 });
        assert_eq!(machine.handle_rendezvous(1, waiting()).unwrap(), None, "waiting: ask again");
        let generation = machine.handle_rendezvous(1, formed(4)).unwrap().expect("generation 4 formed");
        assert_eq!(generation.number, 4);
        assert_eq!(machine.stop_reason(4), None, "nothing stops the connect yet");

        // A member died before it dialled: the coordinator revokes generation 4.
        machine.handle_event(revoked(4, "SIGKILL"));
        assert_eq!(effects(&mut machine), [Effect::Wake], "no communicator to abort yet; the connect wakes");
        let cause = machine.stop_reason(4).expect("the connect stops");
        assert_eq!((cause.rank, cause.reason.as_str()), (Some(2), "SIGKILL"));

        // Had the mesh connected in that same moment, its communicator is aborted at once.
        machine.handle_connected(4);
        assert_eq!(effects(&mut machine), [Effect::Abort { generation: 4, cause: cause.clone() }]);

        // The next rendezvous asks for a generation after 4.
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 1, after_generation: 4 });
        let stale = machine.handle_rendezvous(1, formed(4));
        assert!(matches!(stale, Err(ElasticError::Protocol(_))), "{stale:?}");
    }

    #[test]
    fn an_excluded_worker_waits_out_its_exclusion_within_its_limit() {
        let t0 = Instant::now();
        let mut machine = Membership::new(LIMIT);
        machine.begin_join(t0);
        let second = Duration::from_secs(1);
        let next = machine.handle_join(t0, Err(excluded(second))).unwrap();
        assert_eq!(next, JoinNext::RetryAt(t0 + second + EXCLUSION_MARGIN));
        // Excluded again (its failures repeated meanwhile): still within the limit.
        let t1 = t0 + Duration::from_millis(1050);
        let next = machine.handle_join(t1, Err(excluded(3 * second))).unwrap();
        assert_eq!(next, JoinNext::RetryAt(t1 + 3 * second + EXCLUSION_MARGIN));
        // Another 2 s would take the whole join past 5 s: it fails, saying so.
        let t2 = t1 + 3 * second + EXCLUSION_MARGIN;
        match machine.handle_join(t2, Err(excluded(2 * second))) {
            Err(ElasticError::Excluded { retry_after, waited, limit, message }) => {
                assert_eq!((retry_after, waited, limit), (2 * second, t2 - t0, LIMIT));
                assert_eq!(message, "failed 3 times");
            }
            other => panic!("expected Excluded, got {other:?}"),
        }
        assert_eq!(machine.incarnation(), 0, "never joined");

        // A later join counts its own waits from its own start, and joins.
        let t3 = t2 + 10 * second;
        machine.begin_join(t3);
        assert_eq!(
            machine.handle_join(t3, Err(excluded(4 * second))).unwrap(),
            JoinNext::RetryAt(t3 + 4 * second + EXCLUSION_MARGIN)
        );
        let next = machine.handle_join(t3 + 4 * second, joined(3)).unwrap();
        assert!(matches!(next, JoinNext::Joined { incarnation: 3, .. }), "{next:?}");
        assert_eq!(machine.incarnation(), 3);
        // Any other refusal fails the join at once.
        machine.begin_join(t3);
        let refused = machine.handle_join(t3, Err(failed()));
        assert!(matches!(refused, Err(ElasticError::Control(_))), "{refused:?}");
    }

    fn id_in_use(retry_after: Duration) -> CallError {
        CallError::IdInUse { message: "worker id w1 is held by a live process on host h2".into(), retry_after }
    }

    #[test]
    fn a_worker_id_held_by_a_live_process_is_given_up_after_one_retry() {
        let t0 = Instant::now();
        let mut machine = Membership::new(LIMIT);
        machine.begin_join(t0);
        let left = Duration::from_millis(800);
        // A restart after a crash: the predecessor's silence ends its hold; asked again, joined.
        assert_eq!(
            machine.handle_join(t0, Err(id_in_use(left))).unwrap(),
            JoinNext::RetryAt(t0 + left + EXCLUSION_MARGIN)
        );
        let next = machine.handle_join(t0 + left, joined(4)).unwrap();
        assert!(matches!(next, JoinNext::Joined { incarnation: 4, .. }), "{next:?}");
        // Another live process holds the id: refused again and again, it gives up with the
        // coordinator's words instead of joining (and evicting) in a loop.
        let mut other = Membership::new(LIMIT);
        other.begin_join(t0);
        let mut t = t0;
        for _ in 0..ID_IN_USE_RETRIES {
            assert!(matches!(other.handle_join(t, Err(id_in_use(left))), Ok(JoinNext::RetryAt(_))));
            t += left + EXCLUSION_MARGIN;
        }
        match other.handle_join(t, Err(id_in_use(left))) {
            Err(ElasticError::Control(ControlError::IdInUse { message, .. })) => {
                assert!(message.contains("held by a live process on host h2"), "{message}")
            }
            refused => panic!("expected the refusal, got {refused:?}"),
        }
        // A later join (after a graceful leave, say) counts its own refusals.
        other.begin_join(t);
        assert!(matches!(other.handle_join(t, Err(id_in_use(left))), Ok(JoinNext::RetryAt(_))));
    }

    #[test]
    fn repeated_evictions_back_off_until_a_generation_connects() {
        let now = Instant::now();
        let mut machine = connected(1, 1, now);
        assert_eq!(machine.rejoin_backoff(), Duration::ZERO);
        let mut waits = Vec::new();
        for incarnation in 1..=9 {
            machine.handle_commit(1, incarnation, Err(not_member()));
            assert_eq!(machine.next_step().unwrap(), Step::Join);
            waits.push(machine.rejoin_backoff());
            machine.begin_join(now);
            machine.handle_join(now, joined(incarnation + 1)).unwrap();
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        // The first re-join is at once; then 100 ms doubling, at most 5 s.
        assert_eq!(ms, [0, 100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        // A generation connected: the next eviction re-joins at once again.
        let Step::Rendezvous { incarnation, .. } = machine.next_step().unwrap() else { panic!("a member") };
        machine.handle_rendezvous(incarnation, formed(2)).unwrap();
        machine.handle_connected(2);
        machine.handle_commit(2, incarnation, Err(not_member()));
        assert_eq!(machine.next_step().unwrap(), Step::Join);
        assert_eq!(machine.rejoin_backoff(), Duration::ZERO);
    }

    #[test]
    fn a_pending_reformation_is_agreed_at_a_commit_point_and_cleared_by_the_next_generation() {
        let mut machine = connected(1, 2, Instant::now());
        assert!(!machine.reformation_pending());
        // A commit answer about an older generation says nothing about this one.
        machine.handle_commit(1, 1, Ok(pb::CommitResponse { reformation_pending: true }));
        assert!(!machine.reformation_pending(), "a stale commit answer");
        // A failed report changes nothing; the next one supersedes it.
        machine.handle_commit(2, 1, Err(failed()));
        assert!(!machine.reformation_pending() && !machine.is_evicted());
        // A member leaves (SIGTERM): the watch says the members re-form at the commit point.
        let pending = pb::ReformationPending { generation: 2, joiners: 0 };
        machine.handle_event(event(job_event::Event::ReformationPending(pending)));
        assert!(machine.reformation_pending());
        assert_eq!(effects(&mut machine), []);
        // Every member leaves generation 2 at the commit point and meets in generation 3.
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 1, after_generation: 2 });
        machine.handle_rendezvous(1, formed(3)).unwrap().expect("generation 3");
        assert!(machine.reformation_pending(), "pending until the new generation is connected");
        machine.handle_connected(3);
        assert!(!machine.reformation_pending(), "generation 3 is that re-formation");
        // A commit answer for the current generation marks the next one pending.
        machine.handle_commit(3, 1, Ok(pb::CommitResponse { reformation_pending: true }));
        assert!(machine.reformation_pending());
    }

    #[test]
    fn a_revoked_generations_late_events_abort_nothing_and_the_first_cause_stays() {
        let mut machine = connected(1, 3, Instant::now());
        // Generation 2's revocation, heard late: recorded for whoever asks, aborts nothing.
        machine.handle_event(revoked(2, "late"));
        assert_eq!(effects(&mut machine), [Effect::Wake]);
        assert_eq!(machine.cause_of(2).map(|c| c.reason), Some("late".into()));
        assert_eq!(machine.stop_reason(3), None, "generation 3 stands");
        // Generation 3's revocation aborts its communicator.
        machine.handle_event(revoked(3, "SIGKILL"));
        let cause = machine.cause_of(3).expect("recorded");
        assert_eq!(effects(&mut machine), [Effect::Abort { generation: 3, cause: cause.clone() }, Effect::Wake]);
        // A second cause for generation 3 (a local detection, a repeated event) is ignored.
        machine.handle_revoked(3, RootCause::reason("connection reset"));
        machine.handle_event(revoked(3, "again"));
        assert_eq!(effects(&mut machine), []);
        assert_eq!(machine.cause_of(3), Some(cause));
        // Only the newest 16 causes are kept.
        for generation in 10..30 {
            machine.handle_revoked(generation, RootCause::reason(format!("g{generation}")));
        }
        assert_eq!(machine.cause_of(13), None);
        assert_eq!(machine.cause_of(14).map(|c| c.reason), Some("g14".into()));
        // A formed event on the stream is not how generations are learnt: ignored.
        machine.handle_event(event(job_event::Event::GenerationFormed(pb::Generation::default())));
        machine.handle_event(pb::JobEvent { event: None });
        let _ = effects(&mut machine);
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 1, after_generation: 3 });
    }

    #[test]
    fn a_failure_reports_answer_is_the_cause_and_without_one_the_local_error_is() {
        let mut machine = connected(1, 4, Instant::now());
        let local = RootCause::reason("peer closed");
        let first = pb::RootCause {
            rank: Some(2),
            worker_id: "w2".into(),
            reason: "SIGKILL".into(),
            reported_by: "w0".into(),
            ..Default::default()
        };
        let answer = pb::FailureReportResponse { accepted: false, cause: Some(first) };
        let cause = machine.handle_report(4, Some(answer), local.clone());
        assert_eq!((cause.rank, cause.reason.as_str()), (Some(2), "SIGKILL (reported by w0)"));
        assert_eq!(effects(&mut machine), [Effect::Abort { generation: 4, cause: cause.clone() }, Effect::Wake]);
        assert_eq!(machine.cause_of(4), Some(cause));
        // No answer in time: the local error is the cause, and the links close all the same.
        let Step::Rendezvous { incarnation, .. } = machine.next_step().unwrap() else { panic!("a member") };
        machine.handle_rendezvous(incarnation, formed(5)).unwrap();
        machine.handle_connected(5);
        assert_eq!(machine.handle_report(5, None, local.clone()), local);
        assert_eq!(effects(&mut machine), [Effect::Abort { generation: 5, cause: local.clone() }, Effect::Wake]);
    }

    #[test]
    fn the_job_ending_aborts_the_current_generation_and_stops_everything() {
        let mut machine = connected(1, 5, Instant::now());
        let ended = pb::JobEnded { outcome: job_ended::Outcome::Failed as i32, reason: "below min workers".into() };
        machine.handle_event(event(job_event::Event::JobEnded(ended)));
        assert_eq!(
            effects(&mut machine),
            [Effect::Wake, Effect::Abort { generation: 5, cause: RootCause::reason("job ended") }]
        );
        assert_eq!(machine.stop_reason(6).map(|c| c.reason), Some("job ended: below min workers".into()));
        assert!(matches!(
            machine.next_step(),
            Err(ElasticError::JobEnded { outcome: "failed", reason }) if reason == "below min workers"
        ));
        assert_eq!(machine.handle_watch_lost(1, Instant::now(), 7), WatchNext::Stop);

        // The rendezvous may be the first to say so.
        let mut machine = member(1, Instant::now());
        let ended = pb::JobEnded { outcome: job_ended::Outcome::Finished as i32, reason: "done".into() };
        let answer = Ok(pb::RendezvousResponse { outcome: Some(rendezvous_response::Outcome::Ended(ended)) });
        assert!(matches!(
            machine.handle_rendezvous(1, answer),
            Err(ElasticError::JobEnded { outcome: "finished", .. })
        ));
        assert!(matches!(machine.next_step(), Err(ElasticError::JobEnded { outcome: "finished", .. })));
        let empty = machine.handle_rendezvous(1, Ok(pb::RendezvousResponse { outcome: None }));
        assert!(matches!(empty, Err(ElasticError::Protocol(_))), "{empty:?}");
    }

    #[test]
    fn a_lost_event_stream_is_reopened_with_a_bounded_jittered_backoff() {
        let now = Instant::now();
        let mut machine = member(1, now);
        // With no jitter, the waits are half the bound: 25, 50, 100, ... ms, up to 500 ms.
        let waits: Vec<Duration> = (0..7)
            .map(|_| match machine.handle_watch_lost(1, now, 0) {
                WatchNext::ReopenAt(at) => at - now,
                WatchNext::Stop => panic!("the job goes on"),
            })
            .collect();
        let ms = |m| Duration::from_millis(m);
        assert_eq!(waits, [ms(25), ms(50), ms(100), ms(200), ms(400), ms(500), ms(500)]);
        // The jitter adds up to half the bound (entropy is taken modulo the bound + 1).
        assert_eq!(machine.handle_watch_lost(1, now, 1000), WatchNext::ReopenAt(now + ms(1000)));
        assert_eq!(machine.handle_watch_lost(1, now, 999), WatchNext::ReopenAt(now + ms(500) + ms(999) / 2));
        // Once a stream opens, the next break waits the shortest time again.
        machine.handle_watch_opened();
        assert_eq!(machine.handle_watch_lost(1, now, 0), WatchNext::ReopenAt(now + ms(25)));

        // Joined again: the stream opened for incarnation 1 is stale and reopens at once,
        // without growing the backoff.
        assert!(!machine.watch_is_stale(1));
        machine.begin_join(now);
        machine.handle_join(now, joined(2)).unwrap();
        assert_eq!(effects(&mut machine), [Effect::Wake]);
        assert!(machine.watch_is_stale(1) && !machine.watch_is_stale(2));
        assert_eq!(machine.handle_watch_lost(1, now, 0), WatchNext::ReopenAt(now));
        assert_eq!(machine.handle_watch_lost(2, now, 0), WatchNext::ReopenAt(now + ms(50)));
    }

    #[test]
    fn a_beat_answered_after_the_leave_ends_the_beats_without_an_eviction() {
        let now = Instant::now();
        let mut machine = Membership::new(LIMIT);
        machine.begin_join(now);
        machine.handle_join(now, joined(7)).unwrap();
        machine.begin_leave();
        // A beat held by a slow relay reaches the coordinator after the Leave.
        assert!(!machine.handle_heartbeat(7, Err(not_member())), "the heartbeats stop");
        assert!(!machine.is_evicted(), "a member that left was not evicted");
    }

    #[test]
    fn a_late_not_found_about_an_older_incarnation_does_not_evict_the_new_one() {
        let now = Instant::now();
        let mut machine = Membership::new(LIMIT);
        assert!(!machine.is_evicted(), "not joined yet is not evicted");
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 0, after_generation: 0 });
        machine.begin_join(now);
        machine.handle_join(now, joined(7)).unwrap();
        assert!(machine.heartbeat_request(7).is_some());
        // The lease lapsed (the process was stopped): the heartbeat hears NOT_FOUND.
        assert!(!machine.handle_heartbeat(7, Err(not_member())), "its heartbeat stops");
        assert!(machine.is_evicted());
        assert_eq!(machine.next_step().unwrap(), Step::Join);
        machine.begin_join(now);
        machine.handle_join(now, joined(9)).unwrap();
        assert!(!machine.is_evicted(), "the new incarnation starts as a member");
        assert_eq!(machine.heartbeat_request(7), None, "incarnation 9 has its own heartbeat");
        // Answers to requests sent as 7 arrive late, NOT_FOUND: they say nothing about 9.
        assert!(!machine.handle_heartbeat(7, Err(not_member())));
        machine.handle_commit(1, 7, Err(not_member()));
        assert_eq!(machine.handle_rendezvous(7, Err(not_member())).unwrap(), None);
        assert!(!machine.is_evicted());
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 9, after_generation: 0 });
        // About 9 itself, they do; its heartbeat goes on until it hears NOT_FOUND itself.
        machine.handle_commit(1, 9, Err(not_member()));
        assert!(machine.is_evicted() && machine.heartbeat_request(9).is_some());
        assert_eq!(machine.next_step().unwrap(), Step::Join);
        machine.begin_join(now);
        machine.handle_join(now, joined(10)).unwrap();
        assert_eq!(machine.next_step().unwrap(), Step::Rendezvous { incarnation: 10, after_generation: 0 });
        assert_eq!(machine.handle_rendezvous(10, Err(not_member())).unwrap(), None);
        assert!(machine.is_evicted());
        assert_eq!(machine.next_step().unwrap(), Step::Join);
        // Other rendezvous errors end the wait (the client has retried already).
        let unreachable = ControlError::Unreachable { endpoints: "x".into(), attempts: 3, last: "refused".into() };
        let stopped = machine.handle_rendezvous(10, Err(CallError::Failed(unreachable)));
        assert!(matches!(stopped, Err(ElasticError::Control(ControlError::Unreachable { .. }))), "{stopped:?}");
    }

    #[test]
    fn a_heartbeat_answer_marks_a_pending_reformation_and_carries_the_progress() {
        let mut machine = connected(1, 2, Instant::now());
        machine.set_progress(2, 40, "training");
        machine.set_deadlines("no progress 300ms (learnt)");
        let progress = machine.heartbeat_request(1).expect("a member heartbeats");
        assert_eq!(
            progress,
            Progress {
                generation: 2,
                step: 40,
                activity: "training".into(),
                deadlines: "no progress 300ms (learnt)".into()
            }
        );
        // "Current revoked" carries no cause: the cause comes with the watch's revocation.
        let revoked_only = pb::HeartbeatResponse { current_generation: 2, current_revoked: true, ..Default::default() };
        assert!(machine.handle_heartbeat(1, Ok(revoked_only)));
        assert_eq!(effects(&mut machine), []);
        assert_eq!(machine.stop_reason(2), None);
        assert!(!machine.reformation_pending());
        // A failed heartbeat changes nothing (the next one tries again).
        assert!(machine.handle_heartbeat(1, Err(failed())), "it goes on");
        assert!(!machine.is_evicted() && machine.heartbeat_request(1).is_some());
        let pending = pb::HeartbeatResponse { current_generation: 2, reformation_pending: true, ..Default::default() };
        assert!(machine.handle_heartbeat(1, Ok(pending)));
        assert!(machine.reformation_pending());
        // The rendezvous records its own progress.
        machine.next_step().unwrap();
        assert_eq!(machine.heartbeat_request(1).map(|p| (p.generation, p.activity)), Some((2, "rendezvous".into())));
        machine.handle_rendezvous(1, formed(3)).unwrap();
        assert_eq!(machine.heartbeat_request(1).map(|p| (p.generation, p.activity)), Some((3, "connecting".into())));
    }
}
